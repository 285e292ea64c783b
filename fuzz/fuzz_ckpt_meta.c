/*
 * fuzz_ckpt_meta.c - libFuzzer target for a sharded checkpoint's meta.json
 * reader (fsdp__meta_parse_text, the code fsdp_ckpt_load, fsdp_ckpt_read_meta
 * and fsdp-ckpt run on DIR/meta.json). The input is the file's text.
 *
 * The seal ([Note: sealed meta.json]) would stop nearly every mutation before
 * the parser, so the target checks the seal of the input as given, then
 * reseals a copy (when it opens with the "crc32c" field) and parses that. On
 * success the result must be consistent: files == world, each parameter's
 * pieces sorted and tiling [0, numel) exactly, byte ranges of 4 bytes per
 * element inside their file, numel the product of the shape, FQNs unique.
 * On failure a message must name the problem.
 */
#include "fuzz.h"
#include "fsdp/fsdp-impl.h"

#include <string.h>

#define FUZZ_SEAL_PREFIX "{\n\t\"crc32c\":\t\""

static void fuzz_ckpt_meta_check(const struct fsdp__meta *mt) {
    FSDP_ASSERT(mt->n_files == mt->m.world && mt->n_files >= 1, "%d files, world %d", mt->n_files, mt->m.world);
    for (int i = 0; i < mt->n_files; i++)
        FSDP_ASSERT(mt->files[i].name && mt->files[i].name[0] && !strchr(mt->files[i].name, '/'),
                    "file %d has a bad name", i);
    FSDP_ASSERT(mt->n_state >= 0 && mt->n_state <= 4, "%d state arrays", mt->n_state);
    for (int i = 0; i < mt->n_params; i++) {
        const struct fsdp__meta_param *p = &mt->params[i];
        FSDP_ASSERT(p->fqn && p->fqn[0], "parameter %d without a name", i);
        int64_t numel = 1;
        for (int d = 0; d < p->ndim; d++) numel *= p->shape[d];
        FSDP_ASSERT(numel == p->numel, "'%s': numel %lld, shape product %lld", p->fqn, (long long)p->numel,
                    (long long)numel);
        int64_t at = 0;
        for (int r = 0; r < p->n_ranges; r++) {
            const struct fsdp__meta_range *x = &p->ranges[r];
            FSDP_ASSERT(x->start == at && x->end >= x->start, "'%s': piece %d [%lld, %lld) at %lld", p->fqn, r,
                        (long long)x->start, (long long)x->end, (long long)at);
            FSDP_ASSERT(x->file >= 0 && x->file < mt->n_files, "'%s': piece %d in file %d", p->fqn, r, x->file);
            FSDP_ASSERT(x->b0 >= 8 && x->b1 >= x->b0 && x->b1 - x->b0 == (uint64_t)(x->end - x->start) * 4 &&
                            x->b1 <= mt->files[x->file].bytes,
                        "'%s': piece %d bytes [%llu, %llu)", p->fqn, r, (unsigned long long)x->b0,
                        (unsigned long long)x->b1);
            at = x->end;
        }
        FSDP_ASSERT(at == p->numel, "'%s': pieces cover %lld of %lld", p->fqn, (long long)at, (long long)p->numel);
        for (int j = 0; j < i; j++)
            FSDP_ASSERT(strcmp(mt->params[j].fqn, p->fqn), "'%s' listed twice", p->fqn);
    }
}

/* Returns the parser's status on the resealed text. */
static enum fsdp_status fuzz_ckpt_meta_one(const uint8_t *data, size_t size) {
    struct fsdp_ctx *ctx;
    if (fsdp__ctx_alloc(&ctx) != FSDP_OK) return FSDP_ERR_NOMEM;
    char *text = malloc(size + 1);
    if (!text) {
        fsdp__ctx_release(ctx);
        return FSDP_ERR_NOMEM;
    }
    memcpy(text, data, size);
    text[size] = 0;
    /* the seal check on the input as given: a clean verdict either way */
    if (fsdp__meta_check_seal(ctx, "fuzz/meta.json", text) != FSDP_OK)
        FSDP_ASSERT(fsdp_errmsg(ctx)[0] != '\0', "seal failure without a message");
    size_t p = strlen(FUZZ_SEAL_PREFIX), n = strlen(text);
    int sealed = n >= p + 9 && !strncmp(text, FUZZ_SEAL_PREFIX, p) && text[p + 8] == '"';
    if (sealed) {
        memset(text + p, '0', 8);
        fsdp__meta_seal(text);
    }
    struct fsdp__meta mt;
    enum fsdp_status st = fsdp__meta_parse_text(ctx, "fuzz/meta.json", text, 1, &mt);
    if (st == FSDP_OK) {
        fuzz_ckpt_meta_check(&mt);
        fsdp__meta_free(&mt);
    } else {
        FUZZ_CHECK_REFUSAL(ctx, st);
        FSDP_ASSERT(mt.n_params == 0 && mt.params == NULL && mt.files == NULL, "a failed parse left data behind");
    }
    free(text);
    fsdp__ctx_release(ctx);
    return st;
}

FUZZ_ENTRY(fuzz_ckpt_meta_one)
