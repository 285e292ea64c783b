/*
 * embedding.c - Embedding: ids I32 (...) -> rows of weight (num, dim), giving
 * (..., dim). Backward scatters dout rows into the weight gradient (din is
 * ignored: ids have no gradient). Saves a pointer to the ids (arena or the
 * caller's buffer, which must stay valid until backward).
 */
#include "nn/nn-impl.h"

struct embedding {
    int64_t num, dim;
    struct fsdp_param *weight; /* (num, dim) */
    const int32_t *ids;        /* (n) saved input, borrowed */
    int64_t n;
};

static enum fsdp_status embedding_forward(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                          const struct fsdp_tensor *in, struct fsdp_tensor *out) {
    struct embedding *E = m->impl;
    FSDP_TRY(fsdp__check_input(ctx, m, in, FSDP_I32, 0, 0));
    if (in->ndim >= FSDP_MAX_DIMS)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "Embedding '%s': ids have %d dimensions, at most %d allowed",
                         fsdp__mname(m), in->ndim, FSDP_MAX_DIMS - 1);
    FSDP_TRY(fsdp__param_ready(ctx, E->weight, 0));
    const int32_t *ids = in->data; /* (n) */
    int64_t n = fsdp_tensor_numel(in), D = E->dim;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= E->num)
            return fsdp__err(ctx, FSDP_ERR_INVALID, "Embedding '%s': id %d at position %lld is outside [0, %lld)",
                             fsdp__mname(m), (int)ids[i], (long long)i, (long long)E->num);
    int64_t shape[FSDP_MAX_DIMS];
    memcpy(shape, in->shape, sizeof shape);
    shape[in->ndim] = D;
    FSDP_TRY(fsdp__tensor_prepare(ctx, out, FSDP_F32, in->ndim + 1, shape, "Embedding output"));
    float *y = out->data; /* (n, dim) */
    /* the rows looked up: the values fsdp__pdata would show, widened or rounded where a 16-bit pass keeps
     * them ([Note: lazy widening], src/nn/precision.c) */
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < (fsdp__measuring ? 0 : n); i++)
        fsdp__prows(E->weight, D, ids[i], 1, FSDP_F32, FSDP_F32, y + i * D);
    E->ids = ids;
    E->n = n;
    return FSDP_OK;
}

static enum fsdp_status embedding_backward(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                           const struct fsdp_tensor *dout, struct fsdp_tensor *din) {
    (void)din;
    struct embedding *E = m->impl;
    if (!E->ids)
        return fsdp__err(ctx, FSDP_ERR_STATE, "Embedding '%s': backward without forward", fsdp__mname(m));
    FSDP_TRY(fsdp__check_input(ctx, m, dout, FSDP_F32, 0, E->dim));
    if (fsdp_tensor_numel(dout) != E->n * E->dim)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "Embedding '%s': gradient has %lld rows, forward had %lld",
                         fsdp__mname(m), (long long)(fsdp_tensor_numel(dout) / E->dim), (long long)E->n);
    FSDP_TRY(fsdp__param_ready(ctx, E->weight, 1));
    float *dw = fsdp__pgrad(E->weight); /* (num, dim) */
    const float *dy = dout->data;       /* (n, dim) */
    int64_t D = E->dim, n = E->n;
    /* repeated ids hit the same row: split the work by columns, not rows */
#pragma omp parallel for schedule(static)
    for (int64_t c0 = 0; c0 < (fsdp__measuring ? 0 : D); c0 += 64) {
        int64_t c1 = c0 + 64 < D ? c0 + 64 : D;
        for (int64_t i = 0; i < n; i++) {
            float *row = dw + (int64_t)E->ids[i] * D;
            const float *g = dy + i * D;
            for (int64_t c = c0; c < c1; c++) row[c] += g[c];
        }
    }
    return FSDP_OK;
}

static void embedding_destroy(struct fsdp_module *m) { free(m->impl); }

static const struct fsdp_module_ops embedding_ops = {"Embedding", embedding_forward, embedding_backward,
                                                     embedding_destroy};

enum fsdp_status fsdp__embedding_create(struct fsdp_ctx *ctx, const char *name, int64_t num, int64_t dim,
                                        float init_std, struct fsdp_module **out_m) {
    if (num <= 0 || dim <= 0)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "Embedding '%s': sizes (%lld, %lld) must be positive", name,
                         (long long)num, (long long)dim);
    struct fsdp_module *m;
    FSDP_TRY(fsdp_module_create(ctx, &embedding_ops, name, &m));
    struct embedding *E = fsdp__zalloc(1, sizeof *E);
    if (!E) {
        fsdp_module_free(m);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory creating Embedding '%s'", name);
    }
    m->impl = E;
    E->num = num;
    E->dim = dim;
    int64_t shape[2] = {num, dim};
    enum fsdp_status st = fsdp_module_add_param(ctx, m, "weight", 2, shape,
                                                (struct fsdp_init){FSDP_INIT_NORMAL, init_std}, 1, &E->weight);
    if (st != FSDP_OK) {
        fsdp_module_free(m);
        return st;
    }
    E->weight->priv->lp_reader = 1; /* rows widened from the 16-bit copy ([Note: lazy widening]) */
    E->weight->priv->grad_writer = 1; /* [Note: unset gradients] */
    *out_m = m;
    return FSDP_OK;
}
