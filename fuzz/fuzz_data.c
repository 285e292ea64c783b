/*
 * fuzz_data.c - libFuzzer target for the token-file reader (fsdp_data_open
 * through fsdp__data_open_mem): llm.c token files, raw uint16 .bin files and
 * byte-level text. Input: byte 0 picks the file name (.bin or .txt) and the
 * vocab size; the rest is the file. On success, every token must be below
 * the vocab size and fsdp_data_batch must stay inside the data.
 */
#include "fuzz.h"
#include "io/io-impl.h"

#include <string.h>

/* Returns the reader's status (FSDP_ERR_NOMEM if no context could be made). */
static enum fsdp_status fuzz_data_one(const uint8_t *data, size_t size) {
    if (size < 1) return FSDP_ERR_INVALID;
    static const int vocabs[8] = {1, 2, 255, 256, 1000, 50257, 65535, 65536};
    const char *name = (data[0] & 1) ? "fuzz.bin" : "fuzz.txt";
    int vocab = vocabs[(data[0] >> 1) & 7];
    struct fsdp_ctx *ctx;
    if (fsdp__ctx_alloc(&ctx) != FSDP_OK) return FSDP_ERR_NOMEM;
    struct fsdp_data *d = NULL;
    enum fsdp_status st = fsdp__data_open_mem(ctx, name, data + 1, size - 1, vocab, &d);
    if (st == FSDP_OK) {
        FSDP_ASSERT(d != NULL && fsdp_data_ntokens(d) >= 2, "open succeeded without 2 tokens");
        int32_t in[2 * 5], tg[2 * 5];
        for (int64_t step = 0; step < 3; step++) {
            fsdp_data_batch(d, step, 2, 5, 0, 1, in, tg);
            for (int i = 0; i < 10; i++)
                FSDP_ASSERT(in[i] >= 0 && in[i] < vocab && tg[i] >= 0 && tg[i] < vocab,
                            "token %d / %d outside vocab %d", in[i], tg[i], vocab);
        }
    } else {
        FSDP_ASSERT(d == NULL, "failed open returned data");
        FUZZ_CHECK_REFUSAL(ctx, st);
    }
    fsdp_data_free(d);
    fsdp__ctx_release(ctx);
    return st;
}

FUZZ_ENTRY(fuzz_data_one)
