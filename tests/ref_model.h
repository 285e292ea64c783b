/*
 * ref_model.h - the unsharded reference the sharded tests compare against:
 * a plain training loop over a materialized GPT on the full global batch,
 * in the test's own process (the 1-rank computation, with no sharding code).
 * Include after fsdp.h and harness.h.
 */
#ifndef FSDP_TEST_REF_MODEL_H
#define FSDP_TEST_REF_MODEL_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct ref {
    struct fsdp_module *gpt;
    int n;
    struct fsdp_param **p;  /* (n) every parameter, in foreach order */
    float **state;          /* (n) optimizer state, k x numel each */
    struct fsdp_optim *opt;
};

/* fsdp_module_foreach_param callback appending p to the struct ref in ud. */
static inline int ref_collect(struct fsdp_param *p, void *ud) {
    struct ref *r = ud;
    r->p = realloc(r->p, (size_t)(r->n + 1) * sizeof *r->p);
    r->p[r->n++] = p;
    return 0;
}

/* A GPT of cfg materialized with seed and its optimizer (oo: NULL for the
 * defaults, AdamW). */
static inline void ref_init(struct ref *r, struct fsdp_ctx *c, const struct fsdp_gpt_config *cfg,
                            uint64_t seed, const struct fsdp_optim_opts *oo) {
    memset(r, 0, sizeof *r);
    if (fsdp_gpt_create(c, cfg, &r->gpt) != FSDP_OK) abort();
    fsdp_module_finalize(c, r->gpt);
    if (fsdp_module_materialize(c, r->gpt, seed) != FSDP_OK) abort();
    fsdp_module_foreach_param(r->gpt, ref_collect, r);
    struct fsdp_optim_opts def = fsdp_optim_opts_default();
    if (fsdp_optim_create(c, oo ? oo : &def, &r->opt) != FSDP_OK) abort();
    int k = fsdp_optim_state_per_elem(r->opt);
    r->state = calloc((size_t)r->n, sizeof *r->state);
    for (int i = 0; i < r->n; i++) r->state[i] = calloc((size_t)(k ? k : 1) * (size_t)r->p[i]->numel, sizeof(float));
}

static inline void ref_free(struct ref *r) {
    for (int i = 0; i < r->n; i++) free(r->state[i]);
    free(r->state);
    free(r->p);
    fsdp_optim_free(r->opt);
    fsdp_module_free(r->gpt);
}

/* One step on the full batch (in, tg: B x T) with global-norm clipping at
 * clip (0: none). Returns the loss; out (if non-NULL) gets loss, grad norm
 * and the parameter norm after the step. */
static inline double ref_step(struct ref *r, struct fsdp_ctx *c, const int32_t *in, const int32_t *tg, int B,
                              int T, float lr, float clip, double out[3]) {
    fsdp_arena_reset(c);
    fsdp_module_zero_grad(c, r->gpt);
    struct fsdp_tensor tok = {(void *)in, FSDP_I32, 2, {B, T}, FSDP_LAYOUT_PLAIN}, logits = {0};
    if (fsdp_module_forward(r->gpt, c, &tok, &logits) != FSDP_OK) abort();
    float loss;
    fsdp_cross_entropy(c, logits.data, tg, (int64_t)B * T, logits.shape[2], 1.0f, &loss, logits.data);
    if (fsdp_module_backward(r->gpt, c, &logits, NULL) != FSDP_OK) abort();
    double ss = 0;
    for (int i = 0; i < r->n; i++)
        for (int64_t j = 0; j < r->p[i]->numel; j++) ss += (double)r->p[i]->grad[j] * r->p[i]->grad[j];
    double gn = sqrt(ss);
    struct fsdp_optim_slice *sl = calloc(r->n > 0 ? (size_t)r->n : 1u, sizeof *sl);
    for (int i = 0; i < r->n; i++)
        sl[i] = (struct fsdp_optim_slice){.param = r->p[i]->data, .grad = r->p[i]->grad, .state = r->state[i],
                                          .n = r->p[i]->numel, .state_stride = r->p[i]->numel,
                                          .decay = !r->p[i]->no_decay};
    fsdp_optim_step(r->opt, sl, r->n, lr, fsdp_clip_scale(gn, clip));
    free(sl);
    if (out) {
        double ps = 0;
        for (int i = 0; i < r->n; i++)
            for (int64_t j = 0; j < r->p[i]->numel; j++) ps += (double)r->p[i]->data[j] * r->p[i]->data[j];
        out[0] = loss;
        out[1] = gn;
        out[2] = sqrt(ps);
    }
    return loss;
}

#endif
