/*
 * l2norm.c - L2Norm: each row of an (N, D) fp32 tensor divided by its
 * Euclidean norm, y = x / max(||x||, eps) (torch.nn.functional.normalize,
 * dim 1, eps 1e-12): SwAV's embedding before the prototypes. Saves the
 * output and the per-row norms. Backward, with r = max(||x||, eps):
 *   ||x|| > eps:  dx = (dy - y (y . dy)) / r
 *   otherwise:    dx = dy / r          (y = x / eps is linear in x)
 * Row sums in double; a row per thread.
 */
#include "nn/nn-impl.h"

#include <math.h>

struct l2norm {
    float eps;
    const float *y;  /* (N, D) saved output (arena) */
    float *norm;     /* (N) ||x||, arena */
    int64_t n, d;
};

static enum fsdp_status l2_forward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *in,
                                   struct fsdp_tensor *out) {
    struct l2norm *L = m->impl;
    FSDP_TRY(fsdp__check_input(ctx, m, in, FSDP_F32, 2, 0));
    if (out->data && out->data == in->data)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "L2Norm '%s': cannot run in place", fsdp__mname(m));
    int64_t N = in->shape[0], D = in->shape[1];
    float *norm = fsdp__scratch(ctx, N, "L2Norm row norms");
    if (!norm) return FSDP_ERR_NOMEM;
    FSDP_TRY(fsdp__tensor_prepare(ctx, out, FSDP_F32, 2, in->shape, "L2Norm output"));
    const float *x = in->data;
    float *y = out->data;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; i++) {
        double s = 0.0;
        for (int64_t j = 0; j < D; j++) s += (double)x[i * D + j] * x[i * D + j];
        double nr = sqrt(s), r = nr > L->eps ? nr : L->eps;
        norm[i] = (float)nr;
        for (int64_t j = 0; j < D; j++) y[i * D + j] = (float)(x[i * D + j] / r);
    }
    L->y = y;
    L->norm = norm;
    L->n = N;
    L->d = D;
    return FSDP_OK;
}

static enum fsdp_status l2_backward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *dout,
                                    struct fsdp_tensor *din) {
    struct l2norm *L = m->impl;
    if (!L->y) return fsdp__err(ctx, FSDP_ERR_STATE, "L2Norm '%s': backward without forward", fsdp__mname(m));
    FSDP_TRY(fsdp__check_input(ctx, m, dout, FSDP_F32, 2, L->d));
    if (dout->shape[0] != L->n)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "L2Norm '%s': gradient has %lld rows, forward had %lld",
                         fsdp__mname(m), (long long)dout->shape[0], (long long)L->n);
    if (!din) return FSDP_OK;
    FSDP_TRY(fsdp__tensor_prepare(ctx, din, FSDP_F32, 2, dout->shape, "L2Norm input gradient"));
    const float *y = L->y, *dy = dout->data;
    float *dx = din->data; /* may equal dy: each row is read whole before it is written */
    int64_t N = L->n, D = L->d;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; i++) {
        double nr = L->norm[i], r = nr > L->eps ? nr : L->eps, dot = 0.0;
        if (nr > L->eps)
            for (int64_t j = 0; j < D; j++) dot += (double)y[i * D + j] * dy[i * D + j];
        for (int64_t j = 0; j < D; j++) dx[i * D + j] = (float)((dy[i * D + j] - y[i * D + j] * dot) / r);
    }
    return FSDP_OK;
}

static void l2_destroy(struct fsdp_module *m) { free(m->impl); }

static const struct fsdp_module_ops l2_ops = {"L2Norm", l2_forward, l2_backward, l2_destroy};

enum fsdp_status fsdp_l2norm_create(struct fsdp_ctx *ctx, const char *name, float eps, struct fsdp_module **out) {
    if (!(eps > 0)) return fsdp__err(ctx, FSDP_ERR_INVALID, "L2Norm '%s': eps %g must be positive", name, (double)eps);
    struct fsdp_module *m;
    FSDP_TRY(fsdp_module_create(ctx, &l2_ops, name, &m));
    struct l2norm *L = fsdp__zalloc(1, sizeof *L);
    if (!L) {
        fsdp_module_free(m);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory creating L2Norm '%s'", name);
    }
    L->eps = eps;
    m->impl = L;
    *out = m;
    return FSDP_OK;
}
