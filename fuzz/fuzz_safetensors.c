/*
 * fuzz_safetensors.c - libFuzzer target for the safetensors header reader
 * (fsdp__st_open through fsdp__safetensors_parse; the checkpoints read their
 * shards with it). The input is a whole file. On success the parsed tensors
 * must be sorted, disjoint, inside the file, and sized numel * dtype size.
 */
#include "fuzz.h"
#include "io/io-impl.h"

static enum fsdp_status fuzz_safetensors_one(const uint8_t *data, size_t size) {
    struct fsdp_ctx *ctx;
    if (fsdp__ctx_alloc(&ctx) != FSDP_OK) return FSDP_ERR_NOMEM;
    struct fsdp__st_file f;
    enum fsdp_status st = fsdp__safetensors_parse(ctx, "fuzz.safetensors", data, size, size, &f);
    if (st == FSDP_OK) {
        uint64_t data_bytes = f.file_size - f.data_start, prev_end = 0;
        for (int i = 0; i < f.n; i++) {
            const struct fsdp__st_tensor *t = &f.t[i];
            FSDP_ASSERT(t->begin >= prev_end && t->begin <= t->end && t->end <= data_bytes,
                        "tensor %d '%s' [%llu, %llu) overlaps or leaves the %llu data bytes", i, t->name,
                        (unsigned long long)t->begin, (unsigned long long)t->end,
                        (unsigned long long)data_bytes);
            FSDP_ASSERT(t->end - t->begin == (uint64_t)t->numel * fsdp_dtype_size(t->dtype),
                        "tensor '%s': %llu bytes for %lld elements", t->name,
                        (unsigned long long)(t->end - t->begin), (long long)t->numel);
            prev_end = t->end;
        }
        fsdp__st_close(&f);
    } else {
        FUZZ_CHECK_REFUSAL(ctx, st);
    }
    fsdp__ctx_release(ctx);
    return st;
}

FUZZ_ENTRY(fuzz_safetensors_one)
