/*
 * pool.c - the parameter-free vision layers, NCHW fp32 (ReLU, MaxPool2d and
 * AdaptiveAvgPool2d also BLOCKED16: [Note: blocked activations] in conv.c):
 *   ReLU               y = max(x, 0); saves y (backward: dy where y > 0), so it
 *                      may run in place; any shape, either layout (kept).
 *   MaxPool2d          oneDNN's max pooling (forward_training keeps a
 *                      workspace of argmax positions in the arena for
 *                      backward); primitives kept per input shape as Conv2d's.
 *   AdaptiveAvgPool2d  (1): the mean of each (n, c) plane -> (N, C, 1, 1)
 *                      (PLAIN: with one value per plane it is BLOCKED16's
 *                      bytes too); the input gradient in the input's layout.
 *   Flatten            (start_dim 1): a view when the caller leaves out->data NULL.
 */
#include "nn/nn-impl.h"

#include <oneapi/dnnl/dnnl.h>

/* ---- ReLU ---- */

struct relu {
    const float *y; /* (n) saved output (arena or the caller's) */
    int64_t n;
    enum fsdp_layout layout; /* of y */
};

static enum fsdp_status relu_forward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *in,
                                     struct fsdp_tensor *out) {
    struct relu *R = m->impl;
    FSDP_TRY(fsdp__check_input_any(ctx, m, in, FSDP_F32, 0, 0));
    FSDP_TRY(fsdp__tensor_prepare(ctx, out, FSDP_F32, in->ndim, in->shape, "ReLU output"));
    out->layout = in->layout;
    const float *x = in->data;
    float *y = out->data; /* may equal x */
    int64_t n = fsdp_tensor_numel(in);
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; i++) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
    R->y = y;
    R->n = n;
    R->layout = in->layout;
    return FSDP_OK;
}

static enum fsdp_status relu_backward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *dout,
                                      struct fsdp_tensor *din) {
    struct relu *R = m->impl;
    if (!R->y) return fsdp__err(ctx, FSDP_ERR_STATE, "ReLU '%s': backward without forward", fsdp__mname(m));
    FSDP_TRY(fsdp__check_input_any(ctx, m, dout, FSDP_F32, 0, 0));
    FSDP_TRY(fsdp__check_grad_layout(ctx, m, dout, R->layout));
    if (fsdp_tensor_numel(dout) != R->n)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "ReLU '%s': gradient has %lld elements, forward had %lld",
                         fsdp__mname(m), (long long)fsdp_tensor_numel(dout), (long long)R->n);
    if (!din) return FSDP_OK;
    FSDP_TRY(fsdp__tensor_prepare(ctx, din, FSDP_F32, dout->ndim, dout->shape, "ReLU input gradient"));
    din->layout = dout->layout;
    const float *y = R->y, *dy = dout->data;
    float *dx = din->data; /* may equal dy */
    int64_t n = R->n;
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; i++) dx[i] = y[i] > 0.0f ? dy[i] : 0.0f;
    return FSDP_OK;
}

/* ---- MaxPool2d ---- */

struct maxpool {
    int k, s, p;
    int64_t n, c, h, w, oh, ow;     /* of the last forward */
    void *ws;                       /* its workspace (arena) */
    enum fsdp_layout l;             /* of the last forward's input (and output) */
    int made;                       /* primitives for (pn, pc, ph, pw) in pl */
    int64_t pn, pc, ph, pw;
    enum fsdp_layout pl;
    dnnl_memory_desc_t src, dst, wsd;
    dnnl_primitive_t fwd, bwd;
    size_t ws_bytes;
};

static void maxpool_prims_free(struct maxpool *P) {
    if (P->fwd) dnnl_primitive_destroy(P->fwd);
    if (P->bwd) dnnl_primitive_destroy(P->bwd);
    P->fwd = P->bwd = NULL;
    P->made = 0;
}

static dnnl_status_t maxpool_prims_make(struct maxpool *P) {
    maxpool_prims_free(P);
    dnnl_dims_t sd = {P->n, P->c, P->h, P->w}, dd = {P->n, P->c, P->oh, P->ow};
    dnnl_dims_t k = {P->k, P->k}, s = {P->s, P->s}, dil = {0, 0}, pad = {P->p, P->p};
    dnnl_pooling_v2_desc_t fd, bd;
    dnnl_primitive_desc_t fpd = NULL, bpd = NULL;
    dnnl_format_tag_t tag = P->l == FSDP_LAYOUT_BLOCKED16 ? dnnl_nChw16c : dnnl_nchw;
    dnnl_status_t st = dnnl_memory_desc_init_by_tag(&P->src, 4, sd, dnnl_f32, tag);
    if (st == dnnl_success) st = dnnl_memory_desc_init_by_tag(&P->dst, 4, dd, dnnl_f32, tag);
    if (st == dnnl_success)
        st = dnnl_pooling_v2_forward_desc_init(&fd, dnnl_forward_training, dnnl_pooling_max, &P->src, &P->dst, s, k,
                                               dil, pad, pad);
    if (st == dnnl_success) st = dnnl_primitive_desc_create(&fpd, &fd, NULL, fsdp__dnnl_engine(), NULL);
    if (st == dnnl_success) st = dnnl_primitive_create(&P->fwd, fpd);
    if (st == dnnl_success) {
        P->wsd = *dnnl_primitive_desc_query_md(fpd, dnnl_query_workspace_md, 0);
        P->ws_bytes = dnnl_memory_desc_get_size(&P->wsd);
        st = dnnl_pooling_v2_backward_desc_init(&bd, dnnl_pooling_max, &P->src, &P->dst, s, k, dil, pad, pad);
    }
    if (st == dnnl_success) st = dnnl_primitive_desc_create(&bpd, &bd, NULL, fsdp__dnnl_engine(), fpd);
    if (st == dnnl_success) st = dnnl_primitive_create(&P->bwd, bpd);
    dnnl_primitive_desc_destroy(fpd);
    dnnl_primitive_desc_destroy(bpd);
    if (st != dnnl_success) {
        maxpool_prims_free(P);
        return st;
    }
    P->made = 1;
    P->pn = P->n, P->pc = P->c, P->ph = P->h, P->pw = P->w, P->pl = P->l;
    return dnnl_success;
}

static enum fsdp_status maxpool_prims(struct fsdp_ctx *ctx, struct fsdp_module *m) {
    struct maxpool *P = m->impl;
    if (P->made && P->pn == P->n && P->pc == P->c && P->ph == P->h && P->pw == P->w && P->pl == P->l)
        return FSDP_OK;
    dnnl_status_t st = maxpool_prims_make(P);
    if (st != dnnl_success)
        return fsdp__err(ctx, FSDP_ERR_UNSUPPORTED, "MaxPool2d '%s': oneDNN has no pooling for input (%lld, %lld, "
                         "%lld, %lld) (status %d)", fsdp__mname(m), (long long)P->n, (long long)P->c,
                         (long long)P->h, (long long)P->w, (int)st);
    return FSDP_OK;
}

static enum fsdp_status maxpool_forward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *in,
                                        struct fsdp_tensor *out) {
    struct maxpool *P = m->impl;
    FSDP_TRY(fsdp__check_input_any(ctx, m, in, FSDP_F32, 4, 0));
    int64_t H = in->shape[2], W = in->shape[3];
    int64_t OH = (H + 2 * P->p - P->k) / P->s + 1, OW = (W + 2 * P->p - P->k) / P->s + 1;
    if (H + 2 * P->p < P->k || W + 2 * P->p < P->k)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "MaxPool2d '%s': input %lldx%lld is smaller than the kernel %d",
                         fsdp__mname(m), (long long)H, (long long)W, P->k);
    if (out->data && out->data == in->data)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "MaxPool2d '%s': cannot run in place", fsdp__mname(m));
    P->n = in->shape[0], P->c = in->shape[1], P->h = H, P->w = W, P->oh = OH, P->ow = OW, P->l = in->layout;
    FSDP_TRY(maxpool_prims(ctx, m));
    int64_t oshape[4] = {P->n, P->c, OH, OW};
    FSDP_TRY(fsdp__tensor_prepare(ctx, out, FSDP_F32, 4, oshape, "MaxPool2d output"));
    out->layout = P->l;
    void *ws = fsdp_arena_alloc(ctx, P->ws_bytes ? P->ws_bytes : 1);
    if (!ws) return fsdp__err(ctx, FSDP_ERR_NOMEM, "MaxPool2d '%s': no memory for the workspace", fsdp__mname(m));
    int args[3] = {DNNL_ARG_SRC, DNNL_ARG_DST, DNNL_ARG_WORKSPACE};
    const void *mds[3] = {&P->src, &P->dst, &P->wsd};
    void *ptrs[3] = {in->data, out->data, ws};
    fsdp__dnnl_exec(P->fwd, 3, args, mds, ptrs);
    P->ws = ws;
    return FSDP_OK;
}

static enum fsdp_status maxpool_backward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *dout,
                                         struct fsdp_tensor *din) {
    struct maxpool *P = m->impl;
    if (!P->ws) return fsdp__err(ctx, FSDP_ERR_STATE, "MaxPool2d '%s': backward without forward", fsdp__mname(m));
    FSDP_TRY(fsdp__check_input_any(ctx, m, dout, FSDP_F32, 4, 0));
    FSDP_TRY(fsdp__check_grad_layout(ctx, m, dout, P->l));
    if (dout->shape[0] != P->n || dout->shape[1] != P->c || dout->shape[2] != P->oh || dout->shape[3] != P->ow)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "MaxPool2d '%s': gradient shape differs from the output's",
                         fsdp__mname(m));
    if (!din) return FSDP_OK;
    FSDP_TRY(maxpool_prims(ctx, m));
    int64_t ishape[4] = {P->n, P->c, P->h, P->w};
    FSDP_TRY(fsdp__tensor_prepare(ctx, din, FSDP_F32, 4, ishape, "MaxPool2d input gradient"));
    din->layout = P->l;
    int args[3] = {DNNL_ARG_DIFF_DST, DNNL_ARG_DIFF_SRC, DNNL_ARG_WORKSPACE};
    const void *mds[3] = {&P->dst, &P->src, &P->wsd};
    void *ptrs[3] = {dout->data, din->data, P->ws};
    fsdp__dnnl_exec(P->bwd, 3, args, mds, ptrs);
    return FSDP_OK;
}

static void maxpool_destroy(struct fsdp_module *m) {
    struct maxpool *P = m->impl;
    if (!P) return;
    maxpool_prims_free(P);
    free(P);
}

/* ---- AdaptiveAvgPool2d(1) ---- */

struct avgpool {
    int64_t n, c, h, w;
    enum fsdp_layout l; /* of the input */
    int ran;
};

static enum fsdp_status avgpool_forward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *in,
                                        struct fsdp_tensor *out) {
    struct avgpool *A = m->impl;
    FSDP_TRY(fsdp__check_input_any(ctx, m, in, FSDP_F32, 4, 0));
    if (out->data && out->data == in->data)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "AdaptiveAvgPool2d '%s': cannot run in place", fsdp__mname(m));
    int64_t NC = in->shape[0] * in->shape[1], HW = in->shape[2] * in->shape[3];
    int64_t oshape[4] = {in->shape[0], in->shape[1], 1, 1};
    FSDP_TRY(fsdp__tensor_prepare(ctx, out, FSDP_F32, 4, oshape, "AdaptiveAvgPool2d output"));
    const float *x = in->data;
    float *y = out->data;
    int64_t L = fsdp__lanes(in->layout); /* plane i = (n, c): its values at x[(i - i % L) * HW + j * L + i % L] */
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < NC; i++) {
        const float *p = x + (i - i % L) * HW + i % L;
        float s = 0.0f;
        for (int64_t j = 0; j < HW; j++) s += p[j * L];
        y[i] = s / (float)HW;
    }
    A->n = in->shape[0], A->c = in->shape[1], A->h = in->shape[2], A->w = in->shape[3], A->l = in->layout;
    A->ran = 1;
    return FSDP_OK;
}

static enum fsdp_status avgpool_backward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *dout,
                                         struct fsdp_tensor *din) {
    struct avgpool *A = m->impl;
    if (!A->ran) return fsdp__err(ctx, FSDP_ERR_STATE, "AdaptiveAvgPool2d '%s': backward without forward", fsdp__mname(m));
    FSDP_TRY(fsdp__check_input(ctx, m, dout, FSDP_F32, 0, 0));
    int64_t NC = A->n * A->c, HW = A->h * A->w;
    if (fsdp_tensor_numel(dout) != NC)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "AdaptiveAvgPool2d '%s': gradient has %lld elements, output had %lld",
                         fsdp__mname(m), (long long)fsdp_tensor_numel(dout), (long long)NC);
    if (!din) return FSDP_OK;
    int64_t ishape[4] = {A->n, A->c, A->h, A->w};
    FSDP_TRY(fsdp__tensor_prepare(ctx, din, FSDP_F32, 4, ishape, "AdaptiveAvgPool2d input gradient"));
    din->layout = A->l;
    const float *dy = dout->data;
    float *dx = din->data;
    float inv = 1.0f / (float)HW;
    int64_t L = fsdp__lanes(A->l);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < NC; i++) {
        float g = dy[i] * inv, *q = dx + (i - i % L) * HW + i % L;
        for (int64_t j = 0; j < HW; j++) q[j * L] = g;
    }
    return FSDP_OK;
}

/* ---- Flatten(1) ---- */

struct flatten {
    int ndim;
    int64_t shape[FSDP_MAX_DIMS]; /* of the last input */
};

static enum fsdp_status flatten_forward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *in,
                                        struct fsdp_tensor *out) {
    struct flatten *F = m->impl;
    FSDP_TRY(fsdp__check_input(ctx, m, in, FSDP_F32, 0, 0));
    int64_t n = fsdp_tensor_numel(in), oshape[2] = {in->shape[0], n / in->shape[0]};
    F->ndim = in->ndim;
    memcpy(F->shape, in->shape, sizeof F->shape);
    if (!out->data) { /* a view */
        out->data = in->data;
        out->dtype = FSDP_F32;
        out->ndim = 2;
        memset(out->shape, 0, sizeof out->shape);
        out->shape[0] = oshape[0], out->shape[1] = oshape[1];
        return FSDP_OK;
    }
    FSDP_TRY(fsdp__tensor_prepare(ctx, out, FSDP_F32, 2, oshape, "Flatten output"));
    if (out->data != in->data) memcpy(out->data, in->data, (size_t)n * sizeof(float));
    return FSDP_OK;
}

static enum fsdp_status flatten_backward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *dout,
                                         struct fsdp_tensor *din) {
    struct flatten *F = m->impl;
    if (!F->ndim) return fsdp__err(ctx, FSDP_ERR_STATE, "Flatten '%s': backward without forward", fsdp__mname(m));
    FSDP_TRY(fsdp__check_input(ctx, m, dout, FSDP_F32, 0, 0));
    struct fsdp_tensor t = {.ndim = F->ndim};
    memcpy(t.shape, F->shape, sizeof t.shape);
    int64_t n = fsdp_tensor_numel(&t);
    if (fsdp_tensor_numel(dout) != n)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "Flatten '%s': gradient has %lld elements, forward had %lld",
                         fsdp__mname(m), (long long)fsdp_tensor_numel(dout), (long long)n);
    if (!din) return FSDP_OK;
    if (!din->data) {
        din->data = dout->data;
        din->dtype = FSDP_F32;
        din->ndim = F->ndim;
        memcpy(din->shape, F->shape, sizeof din->shape);
        return FSDP_OK;
    }
    FSDP_TRY(fsdp__tensor_prepare(ctx, din, FSDP_F32, F->ndim, F->shape, "Flatten input gradient"));
    if (din->data != dout->data) memcpy(din->data, dout->data, (size_t)n * sizeof(float));
    return FSDP_OK;
}

/* ---- constructors ---- */

static void plain_destroy(struct fsdp_module *m) { free(m->impl); }

static const struct fsdp_module_ops relu_ops = {"ReLU", relu_forward, relu_backward, plain_destroy};
static const struct fsdp_module_ops maxpool_ops = {"MaxPool2d", maxpool_forward, maxpool_backward, maxpool_destroy};
static const struct fsdp_module_ops avgpool_ops = {"AdaptiveAvgPool2d", avgpool_forward, avgpool_backward,
                                                   plain_destroy};
static const struct fsdp_module_ops flatten_ops = {"Flatten", flatten_forward, flatten_backward, plain_destroy};

static enum fsdp_status make(struct fsdp_ctx *ctx, const struct fsdp_module_ops *ops, const char *name, size_t impl,
                             struct fsdp_module **out) {
    struct fsdp_module *m;
    FSDP_TRY(fsdp_module_create(ctx, ops, name, &m));
    if (!(m->impl = fsdp__zalloc(1, impl))) {
        fsdp_module_free(m);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory creating %s '%s'", ops->type, name);
    }
    *out = m;
    return FSDP_OK;
}

enum fsdp_status fsdp_relu_create(struct fsdp_ctx *ctx, const char *name, struct fsdp_module **out) {
    return make(ctx, &relu_ops, name, sizeof(struct relu), out);
}

enum fsdp_status fsdp_maxpool2d_create(struct fsdp_ctx *ctx, const char *name, int kernel, int stride, int padding,
                                       struct fsdp_module **out) {
    if (stride == 0) stride = kernel;
    if (kernel <= 0 || stride <= 0 || padding < 0 || 2 * padding > kernel)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "MaxPool2d '%s': kernel %d and stride %d must be positive, padding %d "
                         "at most half the kernel", name, kernel, stride, padding);
    FSDP_TRY(make(ctx, &maxpool_ops, name, sizeof(struct maxpool), out));
    struct maxpool *P = (*out)->impl;
    P->k = kernel, P->s = stride, P->p = padding;
    return FSDP_OK;
}

enum fsdp_status fsdp_global_avgpool2d_create(struct fsdp_ctx *ctx, const char *name, struct fsdp_module **out) {
    return make(ctx, &avgpool_ops, name, sizeof(struct avgpool), out);
}

enum fsdp_status fsdp_flatten_create(struct fsdp_ctx *ctx, const char *name, struct fsdp_module **out) {
    return make(ctx, &flatten_ops, name, sizeof(struct flatten), out);
}
