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
 * On failure a message must name the problem. An accepted input, written
 * again by the one writer (fsdp__meta_format), must read back the same.
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

/* The writer's text of an accepted meta.json reads back as the same
 * checkpoint: one reader and one writer agree on every field. */
static void fuzz_ckpt_meta_roundtrip(struct fsdp_ctx *ctx, const struct fsdp__meta *mt) {
    char *text = NULL;
    if (fsdp__meta_format(ctx, "fuzz/meta.json", mt, &text) != FSDP_OK) {
        FSDP_ASSERT(strstr(fsdp_errmsg(ctx), "out of memory"), "the writer refused a parsed meta.json: %s",
                    fsdp_errmsg(ctx));
        return;
    }
    struct fsdp__meta b;
    enum fsdp_status st = fsdp__meta_parse_text(ctx, "fuzz/meta.json (written)", text, 1, &b);
    free(text);
    FSDP_ASSERT(st == FSDP_OK, "the reader refused the writer's meta.json: %s", fsdp_errmsg(ctx));
    const struct fsdp_ckpt_meta *x = &mt->m, *y = &b.m;
    FSDP_ASSERT(x->world == y->world && x->step == y->step && x->data_step == y->data_step &&
                    x->optim_step == y->optim_step && x->seed == y->seed && x->has_config == y->has_config &&
                    !memcmp(&x->config, &y->config, sizeof x->config) && !strcmp(x->model_json, y->model_json) &&
                    b.n_state == mt->n_state && b.n_files == mt->n_files && b.n_params == mt->n_params &&
                    b.n_buffers == mt->n_buffers,
                "written meta.json differs in its header fields or counts");
    for (int i = 0; i < b.n_state; i++) FSDP_ASSERT(!strcmp(b.state[i], mt->state[i]), "state %d differs", i);
    for (int i = 0; i < b.n_files; i++)
        FSDP_ASSERT(!strcmp(b.files[i].name, mt->files[i].name) && b.files[i].bytes == mt->files[i].bytes,
                    "file %d differs", i);
    for (int i = 0; i < b.n_params; i++) {
        const struct fsdp__meta_param *p = &mt->params[i], *q = &b.params[i];
        FSDP_ASSERT(!strcmp(p->fqn, q->fqn) && p->ndim == q->ndim && p->numel == q->numel &&
                        !memcmp(p->shape, q->shape, sizeof p->shape) && p->n_ranges == q->n_ranges,
                    "parameter '%s' differs", p->fqn);
        for (int r = 0; r < p->n_ranges; r++) {
            const struct fsdp__meta_range *u = &p->ranges[r], *v = &q->ranges[r];
            FSDP_ASSERT(u->file == v->file && u->start == v->start && u->end == v->end && u->b0 == v->b0 &&
                            u->b1 == v->b1,
                        "parameter '%s': piece %d differs", p->fqn, r);
        }
    }
    for (int i = 0; i < b.n_buffers; i++) {
        const struct fsdp__meta_buffer *p = &mt->buffers[i], *q = &b.buffers[i];
        FSDP_ASSERT(!strcmp(p->fqn, q->fqn) && p->dtype == q->dtype && p->ndim == q->ndim && p->numel == q->numel &&
                        !memcmp(p->shape, q->shape, sizeof p->shape) && p->file == q->file && p->b0 == q->b0 &&
                        p->b1 == q->b1,
                    "buffer '%s' differs", p->fqn);
    }
    fsdp__meta_free(&b);
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
        fuzz_ckpt_meta_roundtrip(ctx, &mt);
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
