/*
 * resblock.c - Sequential (children run in order; PyTorch's nn.Sequential,
 * children named "0", "1", ...) and ResNet's BasicBlock with torchvision's
 * names: conv1 (3x3, stride s), bn1, relu, conv2 (3x3), bn2, plus
 * downsample = Sequential(Conv2d 1x1 stride s, BatchNorm2d) when the stride
 * or the width changes; out = relu(bn2(conv2(relu(bn1(conv1(x))))) + id(x)).
 * The two ReLUs run inline (in place on bn1's and on the sum's output: each
 * BatchNorm saves its own input, so nothing overwritten is read again); the
 * block saves both ReLU outputs for backward.
 */
#include "nn/nn-impl.h"

/* ---- Sequential ---- */

struct sequential {
    int ndim;
    int64_t shape[FSDP_MAX_DIMS]; /* of the last input */
};

static enum fsdp_status seq_forward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *in,
                                    struct fsdp_tensor *out) {
    struct sequential *S = m->impl;
    if (!m->n_children) return fsdp__err(ctx, FSDP_ERR_STATE, "Sequential '%s' is empty", fsdp__mname(m));
    FSDP_TRY(fsdp__check_input(ctx, m, in, FSDP_F32, 0, 0));
    S->ndim = in->ndim;
    memcpy(S->shape, in->shape, sizeof S->shape);
    struct fsdp_tensor cur = *in;
    for (int i = 0; i < m->n_children; i++) {
        struct fsdp_tensor next = {0};
        struct fsdp_tensor *dst = i + 1 == m->n_children ? out : &next;
        FSDP_TRY(fsdp_module_forward(m->children[i], ctx, &cur, dst));
        cur = *dst;
    }
    return FSDP_OK;
}

static enum fsdp_status seq_backward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *dout,
                                     struct fsdp_tensor *din) {
    struct sequential *S = m->impl;
    if (!S->ndim) return fsdp__err(ctx, FSDP_ERR_STATE, "Sequential '%s': backward without forward", fsdp__mname(m));
    if (din) FSDP_TRY(fsdp__tensor_prepare(ctx, din, FSDP_F32, S->ndim, S->shape, "Sequential input gradient"));
    size_t mark = fsdp_arena_mark(ctx);
    struct fsdp_tensor cur = *dout;
    enum fsdp_status st = FSDP_OK;
    for (int i = m->n_children - 1; i >= 0 && st == FSDP_OK; i--) {
        struct fsdp_tensor prev = {0};
        st = fsdp_module_backward(m->children[i], ctx, &cur, i == 0 ? din : &prev);
        cur = prev;
    }
    fsdp_arena_release(ctx, mark);
    return st;
}

static void seq_destroy(struct fsdp_module *m) { free(m->impl); }

static const struct fsdp_module_ops seq_ops = {"Sequential", seq_forward, seq_backward, seq_destroy};

enum fsdp_status fsdp_sequential_create(struct fsdp_ctx *ctx, const char *name, struct fsdp_module **out) {
    struct fsdp_module *m;
    FSDP_TRY(fsdp_module_create(ctx, &seq_ops, name, &m));
    if (!(m->impl = calloc(1, sizeof(struct sequential)))) {
        fsdp_module_free(m);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory creating Sequential '%s'", name);
    }
    *out = m;
    return FSDP_OK;
}

/* ---- BasicBlock ---- */

struct basic_block {
    int64_t inplanes, planes;
    struct fsdp_module *conv1, *bn1, *conv2, *bn2, *downsample; /* children; downsample may be NULL */
    const float *r1, *r2; /* saved ReLU outputs: after bn1, and the block's output (arena) */
    int64_t n1, n2;
    int ndim;
    int64_t shape[FSDP_MAX_DIMS]; /* of the input */
};

static void relu_inplace(float *x, int64_t n) {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; i++) x[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

/* g[i] = y[i] > 0 ? g[i] : 0 */
static void relu_mask(float *g, const float *y, int64_t n) {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; i++) g[i] = y[i] > 0.0f ? g[i] : 0.0f;
}

static enum fsdp_status bb_forward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *in,
                                   struct fsdp_tensor *out) {
    struct basic_block *K = m->impl;
    FSDP_TRY(fsdp__check_input(ctx, m, in, FSDP_F32, 4, 0));
    if (out->data && out->data == in->data)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "BasicBlock '%s': cannot run in place", fsdp__mname(m));
    struct fsdp_tensor t1 = {0}, t2 = {0}, t3 = {0}, id = {0};
    FSDP_TRY(fsdp_module_forward(K->conv1, ctx, in, &t1));
    FSDP_TRY(fsdp_module_forward(K->bn1, ctx, &t1, &t2));
    relu_inplace(t2.data, fsdp_tensor_numel(&t2));
    FSDP_TRY(fsdp_module_forward(K->conv2, ctx, &t2, &t3));
    FSDP_TRY(fsdp_module_forward(K->bn2, ctx, &t3, out));
    if (K->downsample) FSDP_TRY(fsdp_module_forward(K->downsample, ctx, in, &id));
    else id = *in;
    int64_t n = fsdp_tensor_numel(out);
    if (fsdp_tensor_numel(&id) != n)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "BasicBlock '%s': the identity has %lld values, the residual %lld",
                         fsdp__mname(m), (long long)fsdp_tensor_numel(&id), (long long)n);
    float *y = out->data;
    const float *s = id.data;
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; i++) y[i] = y[i] + s[i] > 0.0f ? y[i] + s[i] : 0.0f;
    K->r1 = t2.data;
    K->n1 = fsdp_tensor_numel(&t2);
    K->r2 = y;
    K->n2 = n;
    K->ndim = in->ndim;
    memcpy(K->shape, in->shape, sizeof K->shape);
    return FSDP_OK;
}

/* g = dout masked by the output's ReLU; din = conv1'(bn1'(mask1(conv2'(bn2'(g))))) + (downsample'(g) or g) */
static enum fsdp_status bb_backward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *dout,
                                    struct fsdp_tensor *din) {
    struct basic_block *K = m->impl;
    if (!K->r2) return fsdp__err(ctx, FSDP_ERR_STATE, "BasicBlock '%s': backward without forward", fsdp__mname(m));
    FSDP_TRY(fsdp__check_input(ctx, m, dout, FSDP_F32, 4, 0));
    if (fsdp_tensor_numel(dout) != K->n2)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "BasicBlock '%s': gradient has %lld values, output had %lld",
                         fsdp__mname(m), (long long)fsdp_tensor_numel(dout), (long long)K->n2);
    if (din) FSDP_TRY(fsdp__tensor_prepare(ctx, din, FSDP_F32, K->ndim, K->shape, "BasicBlock input gradient"));
    size_t mark = fsdp_arena_mark(ctx);
    float *g = fsdp__scratch(ctx, K->n2, "BasicBlock output gradient");
    if (!g) return FSDP_ERR_NOMEM;
    memcpy(g, dout->data, (size_t)K->n2 * sizeof(float));
    relu_mask(g, K->r2, K->n2);
    struct fsdp_tensor gt = *dout, d3 = {0}, d2 = {0}, d1 = {0}, did = {0};
    gt.data = g;
    enum fsdp_status st = fsdp_module_backward(K->bn2, ctx, &gt, &d3);
    if (st == FSDP_OK) st = fsdp_module_backward(K->conv2, ctx, &d3, &d2);
    if (st == FSDP_OK) {
        relu_mask(d2.data, K->r1, K->n1);
        d1 = d3; /* reuses bn2's gradient buffer: same shape as bn1's output */
        if (fsdp_tensor_numel(&d3) != K->n1) d1.data = NULL;
        st = fsdp_module_backward(K->bn1, ctx, &d2, &d1);
    }
    if (st == FSDP_OK) st = fsdp_module_backward(K->conv1, ctx, &d1, din);
    if (st == FSDP_OK && K->downsample) st = fsdp_module_backward(K->downsample, ctx, &gt, din ? &did : NULL);
    if (st == FSDP_OK && din) {
        const float *s = K->downsample ? did.data : g;
        float *dx = din->data;
        int64_t n = fsdp_tensor_numel(din);
#pragma omp parallel for simd schedule(static)
        for (int64_t i = 0; i < n; i++) dx[i] += s[i];
    }
    fsdp_arena_release(ctx, mark);
    return st;
}

static void bb_destroy(struct fsdp_module *m) { free(m->impl); }

static const struct fsdp_module_ops bb_ops = {"BasicBlock", bb_forward, bb_backward, bb_destroy};

static enum fsdp_status add_conv(struct fsdp_ctx *ctx, struct fsdp_module *parent, const char *name, int64_t in,
                                 int64_t out, int k, int stride, struct fsdp_module **slot) {
    struct fsdp_conv2d_opts o = fsdp_conv2d_opts_default(in, out, k);
    o.stride[0] = o.stride[1] = stride;
    o.padding[0] = o.padding[1] = k / 2;
    o.bias = 0;
    struct fsdp_module *c = NULL;
    return fsdp__adopt(ctx, parent, fsdp_conv2d_create(ctx, name, &o, &c), &c, slot);
}

static enum fsdp_status add_bn(struct fsdp_ctx *ctx, struct fsdp_module *parent, const char *name, int64_t ch,
                               struct fsdp_module **slot) {
    struct fsdp_batchnorm_opts o = fsdp_batchnorm_opts_default(ch);
    struct fsdp_module *c = NULL;
    return fsdp__adopt(ctx, parent, fsdp_batchnorm2d_create(ctx, name, &o, &c), &c, slot);
}

enum fsdp_status fsdp_basic_block_create(struct fsdp_ctx *ctx, const char *name, int64_t inplanes, int64_t planes,
                                         int stride, struct fsdp_module **out) {
    if (inplanes <= 0 || planes <= 0 || stride <= 0)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "BasicBlock '%s': inplanes %lld, planes %lld and stride %d must be "
                         "positive", name, (long long)inplanes, (long long)planes, stride);
    struct fsdp_module *m;
    FSDP_TRY(fsdp_module_create(ctx, &bb_ops, name, &m));
    struct basic_block *K = calloc(1, sizeof *K);
    if (!K) {
        fsdp_module_free(m);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory creating BasicBlock '%s'", name);
    }
    m->impl = K;
    K->inplanes = inplanes;
    K->planes = planes;
    enum fsdp_status st = add_conv(ctx, m, "conv1", inplanes, planes, 3, stride, &K->conv1);
    if (st == FSDP_OK) st = add_bn(ctx, m, "bn1", planes, &K->bn1);
    if (st == FSDP_OK) st = add_conv(ctx, m, "conv2", planes, planes, 3, 1, &K->conv2);
    if (st == FSDP_OK) st = add_bn(ctx, m, "bn2", planes, &K->bn2);
    if (st == FSDP_OK && (stride != 1 || inplanes != planes)) {
        struct fsdp_module *ds = NULL;
        st = fsdp__adopt(ctx, m, fsdp_sequential_create(ctx, "downsample", &ds), &ds, &K->downsample);
        if (st == FSDP_OK) st = add_conv(ctx, K->downsample, "0", inplanes, planes, 1, stride, NULL);
        if (st == FSDP_OK) st = add_bn(ctx, K->downsample, "1", planes, NULL);
    }
    if (st != FSDP_OK) {
        fsdp_module_free(m);
        return st;
    }
    *out = m;
    return FSDP_OK;
}
