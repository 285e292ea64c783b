/*
 * nn_helpers.h - what the single-process layer tests share: a seeded
 * xorshift stream (rng_seed, rng_next, urand in [-1, 1), irand in [0, n))
 * a context on the self communicator (make_ctx, aborts on failure) and an
 * fp32 input of uniform values in malloc'd memory (make_input: it survives
 * fsdp_arena_reset), a module's parameters made uniform (randomize_params),
 * a standalone layer finalized with values (prepare) and a 2-layer GPT
 * (small_gpt, small_gpt_model).
 * Include after fsdp.h and harness.h.
 */
#ifndef FSDP_TEST_NN_HELPERS_H
#define FSDP_TEST_NN_HELPERS_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng_state = 88172645463325252ull;
static inline void rng_seed(uint64_t s) { rng_state = s * 2654435761ull + 88172645463325252ull; }
static inline uint64_t rng_next(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}
static inline float urand(void) { return (float)((double)(rng_next() >> 11) / 9007199254740992.0 * 2.0 - 1.0); }
static inline int64_t irand(int64_t n) { return (int64_t)(rng_next() % (uint64_t)n); }

static inline struct fsdp_ctx *make_ctx(void) {
    struct fsdp_ctx_opts o = fsdp_ctx_opts_default();
    o.comm = FSDP_COMM_SELF;
    struct fsdp_ctx *ctx = NULL;
    if (fsdp_ctx_create(&o, &ctx) != FSDP_OK) abort();
    return ctx;
}

/* offset + scale * U[-1, 1) in every element */
static inline struct fsdp_tensor make_input(int ndim, const int64_t *shape, float scale, float offset) {
    struct fsdp_tensor t = {0};
    t.dtype = FSDP_F32;
    t.ndim = ndim;
    memcpy(t.shape, shape, (size_t)ndim * sizeof(int64_t));
    int64_t n = fsdp_tensor_numel(&t);
    float *x = malloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) x[i] = offset + scale * urand();
    t.data = x;
    return t;
}

/* Replaces initial values by uniform(-scale, scale) (LayerNorm weights: 1 +
 * that), so checks do not depend on a special point such as zero biases. */
static inline int randomize_one(struct fsdp_param *p, void *ud) {
    float s = *(float *)ud;
    for (int64_t i = 0; i < p->numel; i++) p->data[i] = (p->init.kind == FSDP_INIT_ONES ? 1.0f : 0.0f) + s * urand();
    return 0;
}
static inline void randomize_params(struct fsdp_module *m, float scale) {
    fsdp_module_foreach_param(m, randomize_one, &scale);
}

/* Finalizes a standalone layer (FQNs from its own name) and gives it values. */
static inline void prepare(struct fsdp_ctx *ctx, struct fsdp_module *m, float scale) {
    if (fsdp_module_finalize(ctx, m) != FSDP_OK || fsdp_module_materialize(ctx, m, 7) != FSDP_OK) abort();
    if (scale > 0) randomize_params(m, scale);
}

/* a 2-layer GPT small enough for finite differences */
static inline struct fsdp_gpt_config small_gpt(void) {
    struct fsdp_gpt_config c = {2, 2, 16, 24, 8}; /* n_layer, n_head, n_embd, vocab, block */
    return c;
}

/* small_gpt's model with values (initialised from seed, then uniform in
 * +-0.3, randomize_params) in *out; a failure's status (ctx's error says
 * why) with nothing made, for ASSERT_OK */
static inline enum fsdp_status small_gpt_model(struct fsdp_ctx *ctx, uint64_t seed, struct fsdp_module **out) {
    struct fsdp_gpt_config cfg = small_gpt();
    enum fsdp_status st = fsdp_gpt_create(ctx, &cfg, out);
    if (st != FSDP_OK) return st;
    if ((st = fsdp_module_materialize(ctx, *out, seed)) != FSDP_OK) {
        fsdp_module_free(*out);
        return st;
    }
    randomize_params(*out, 0.3f);
    return FSDP_OK;
}

#endif
