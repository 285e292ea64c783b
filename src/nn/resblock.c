/*
 * resblock.c - Sequential (children run in order; PyTorch's nn.Sequential,
 * children named "0", "1", ...) and ResNet's residual blocks with
 * torchvision's names: BasicBlock conv1 (3x3, stride s), bn1, relu, conv2
 * (3x3), bn2; Bottleneck conv1 (1x1), bn1, conv2 (3x3, stride s), bn2, conv3
 * (1x1, 4x wider), bn3; both with downsample = Sequential(Conv2d 1x1 stride
 * s, BatchNorm2d) when the stride or the width changes, and out =
 * relu(last bn + identity). The inner ReLUs are fused into their BNs, which
 * write the next convolution's input in its compute dtype ([Note: fused ReLU
 * and 16-bit hand-off] in batchnorm.c), and take the gradient back in it;
 * the last ReLU runs inline on the sum, and the block saves its output for
 * backward.
 * Layouts ([Note: blocked activations] in conv.c): Sequential passes its
 * children's on; a block's convolutions write FSDP_VISION_LAYOUT's (BLOCKED16
 * where the width is a multiple of 16), the output is in that layout, and an
 * identity in another one (a PLAIN input without downsample) is converted
 * for the add (and its gradient back).
 */
#include "nn/nn-impl.h"

/* ---- Sequential ---- */
void fsdp__release_to(struct fsdp_ctx *ctx, int *release, size_t mark, struct fsdp_tensor *t) {
    if (!*release) return;
    if (!t || !t->data) {
        fsdp_arena_release(ctx, mark);
        return;
    }
    void *d = fsdp__arena_slide(ctx, mark, t->data, (size_t)fsdp_tensor_numel(t) * fsdp_dtype_size(t->dtype));
    if (d) t->data = d;
    else *release = 0;
}

enum fsdp_status fsdp__backward_releasing(struct fsdp_ctx *ctx, struct fsdp_module *c, const struct fsdp_tensor *dout,
                                          struct fsdp_tensor *din, size_t mark, int *release) {
    if (*release) fsdp__dout_dead_hand(ctx, c, dout->data);
    FSDP_TRY(fsdp_module_backward(c, ctx, dout, din));
    fsdp__release_to(ctx, release, mark, din);
    return FSDP_OK;
}


enum fsdp_status fsdp__chain_forward(struct fsdp_module *m, struct fsdp_ctx *ctx, struct fsdp__chain *c, int n,
                                     const struct fsdp_tensor *in, struct fsdp_tensor *out) {
    c->ran = 0;
    if (!c->marks && !(c->marks = calloc((size_t)m->n_children, sizeof *c->marks)))
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory for %s '%s'", m->ops->type, fsdp__mname(m));
    c->ndim = in->ndim;
    memcpy(c->shape, in->shape, sizeof c->shape);
    struct fsdp_tensor cur = *in;
    for (int i = 0; i < n; i++) {
        struct fsdp_tensor next = {0};
        struct fsdp_tensor *dst = i + 1 == n ? out : &next;
        c->marks[i] = fsdp_arena_mark(ctx);
        FSDP_TRY(fsdp_module_forward(m->children[i], ctx, &cur, dst));
        cur = *dst;
    }
    c->ran = n;
    return FSDP_OK;
}

enum fsdp_status fsdp__chain_backward(struct fsdp_module *m, struct fsdp_ctx *ctx, struct fsdp__chain *c,
                                      const struct fsdp_tensor *dout, struct fsdp_tensor *din) {
    if (!c->ran)
        return fsdp__err(ctx, FSDP_ERR_STATE, "%s '%s': backward without forward", m->ops->type, fsdp__mname(m));
    /* [Note: backward releases the blocks] (src/models/gpt.c) with a dead gradient: each child's
     * input gradient moves down to where the child's forward began, the rest above goes back; the
     * first child makes din itself, for the same move */
    int release = fsdp__dout_dead(ctx, m, dout) && (!din || !din->data), handed = release;
    if (din && !release) {
        char what[64];
        snprintf(what, sizeof what, "%s input gradient", m->ops->type);
        FSDP_TRY(fsdp__tensor_prepare(ctx, din, FSDP_F32, c->ndim, c->shape, what));
    }
    size_t mark = fsdp_arena_mark(ctx);
    struct fsdp_tensor cur = *dout;
    enum fsdp_status st = FSDP_OK;
    for (int i = c->ran - 1; i >= 0 && st == FSDP_OK; i--) {
        struct fsdp_tensor prev = {0}, *dst = i == 0 ? din : &prev;
        st = fsdp__backward_releasing(ctx, m->children[i], &cur, dst, c->marks[i], &release);
        cur = prev;
    }
    if (handed) fsdp__dout_dead_hand(ctx, NULL, NULL); /* din may lie above mark: nothing released */
    else fsdp_arena_release(ctx, mark);
    return st;
}

static enum fsdp_status seq_forward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *in,
                                    struct fsdp_tensor *out) {
    if (!m->n_children) return fsdp__err(ctx, FSDP_ERR_STATE, "Sequential '%s' is empty", fsdp__mname(m));
    FSDP_TRY(fsdp__check_input_any(ctx, m, in, FSDP_F32, 0, 0));
    return fsdp__chain_forward(m, ctx, m->impl, m->n_children, in, out);
}

static enum fsdp_status seq_backward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *dout,
                                     struct fsdp_tensor *din) {
    return fsdp__chain_backward(m, ctx, m->impl, dout, din);
}

void fsdp__chain_free(struct fsdp__chain *c) {
    if (c) free(c->marks);
    free(c);
}

static void seq_destroy(struct fsdp_module *m) { fsdp__chain_free(m->impl); }

static const struct fsdp_module_ops seq_ops = {"Sequential", seq_forward, seq_backward, seq_destroy};

enum fsdp_status fsdp_sequential_create(struct fsdp_ctx *ctx, const char *name, struct fsdp_module **out) {
    struct fsdp_module *m;
    FSDP_TRY(fsdp_module_create(ctx, &seq_ops, name, &m));
    if (!(m->impl = fsdp__zalloc(1, sizeof(struct fsdp__chain)))) {
        fsdp_module_free(m);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory creating Sequential '%s'", name);
    }
    *out = m;
    return FSDP_OK;
}

/* ---- BasicBlock and Bottleneck ---- */

/* A residual block: n (conv, bn) pairs with a ReLU after each bn but the
 * last, then out = relu(that + identity), the identity being downsample(x)
 * or x. BasicBlock: 3x3 (stride), 3x3; Bottleneck: 1x1, 3x3 (stride), 1x1
 * to 4x the width (torchvision's v1.5: the stride on the 3x3). */
#define RB_MAX 3

struct resblock {
    int n;
    struct fsdp_module *conv[RB_MAX], *bn[RB_MAX], *downsample; /* children; downsample may be NULL */
    const float *y;         /* the saved block output (after its ReLU; arena) */
    int64_t ny;
    int ndim;
    int64_t shape[FSDP_MAX_DIMS]; /* of the input */
    enum fsdp_layout in_l, out_l; /* of the input and the output */
};

/* g[i] = y[i] > 0 ? d[i] : 0 (d may be g) */
static void relu_mask(float *g, const float *d, const float *y, int64_t n) {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; i++) g[i] = y[i] > 0.0f ? d[i] : 0.0f;
}

static enum fsdp_status rb_forward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *in,
                                   struct fsdp_tensor *out) {
    struct resblock *K = m->impl;
    FSDP_TRY(fsdp__check_input_any(ctx, m, in, FSDP_F32, 4, 0));
    if (out->data && out->data == in->data)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "%s '%s': cannot run in place", m->ops->type, fsdp__mname(m));
    struct fsdp_tensor cur = *in, id = {0};
    for (int i = 0; i < K->n; i++) {
        struct fsdp_tensor t = {0}, u = {0};
        int last = i + 1 == K->n;
        FSDP_TRY(fsdp_module_forward(K->conv[i], ctx, &cur, &t));
        if (!last) u.dtype = fsdp__input_dtype(K->conv[i + 1]); /* bn[i] with its ReLU: conv[i+1]'s input */
        FSDP_TRY(fsdp_module_forward(K->bn[i], ctx, &t, last ? out : &u));
        if (!last) cur = u;
    }
    if (K->downsample) FSDP_TRY(fsdp_module_forward(K->downsample, ctx, in, &id));
    else FSDP_TRY(fsdp__as_layout(ctx, in, out->layout, &id, "residual block identity (relaid out)"));
    int64_t n = fsdp_tensor_numel(out);
    if (fsdp_tensor_numel(&id) != n)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "%s '%s': the identity has %lld values, the residual %lld",
                         m->ops->type, fsdp__mname(m), (long long)fsdp_tensor_numel(&id), (long long)n);
    float *y = out->data;
    const float *s = id.data;
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; i++) y[i] = y[i] + s[i] > 0.0f ? y[i] + s[i] : 0.0f;
    K->y = y;
    K->ny = n;
    K->ndim = in->ndim;
    memcpy(K->shape, in->shape, sizeof K->shape);
    K->in_l = in->layout, K->out_l = out->layout;
    return FSDP_OK;
}

/* g = dout masked by the output's ReLU; back through bn, conv pairs with the
 * inner ReLUs' masks; din = that + (downsample'(g) or g) */
static enum fsdp_status rb_backward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *dout,
                                    struct fsdp_tensor *din) {
    struct resblock *K = m->impl;
    const float *yout = K->y;
    int64_t nout = K->ny;
    if (!yout) return fsdp__err(ctx, FSDP_ERR_STATE, "%s '%s': backward without forward", m->ops->type, fsdp__mname(m));
    FSDP_TRY(fsdp__check_input_any(ctx, m, dout, FSDP_F32, 4, 0));
    FSDP_TRY(fsdp__check_grad_layout(ctx, m, dout, K->out_l));
    if (fsdp_tensor_numel(dout) != nout)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "%s '%s': gradient has %lld values, output had %lld", m->ops->type,
                         fsdp__mname(m), (long long)fsdp_tensor_numel(dout), (long long)nout);
    if (din) FSDP_TRY(fsdp__tensor_prepare(ctx, din, FSDP_F32, K->ndim, K->shape, "residual block input gradient"));
    size_t mark = fsdp_arena_mark(ctx);
    float *g = fsdp__scratch(ctx, nout, "residual block output gradient");
    if (!g) return FSDP_ERR_NOMEM;
    relu_mask(g, dout->data, yout, nout);
    struct fsdp_tensor gt = *dout, cur = *dout, did = {0};
    gt.data = g;
    cur.data = g;
    enum fsdp_status st = FSDP_OK;
    for (int i = K->n - 1; i >= 0 && st == FSDP_OK; i--) { /* bn[i < n-1] mask with their fused ReLUs */
        struct fsdp_tensor t = {0}, u = {0};
        t.dtype = K->conv[i]->priv->dout_dtype; /* the gradient in the dtype conv[i] takes it in */
        st = fsdp_module_backward(K->bn[i], ctx, &cur, &t);
        if (st == FSDP_OK) st = fsdp_module_backward(K->conv[i], ctx, &t, i ? &u : din);
        cur = u;
    }
    if (st == FSDP_OK && K->downsample) st = fsdp_module_backward(K->downsample, ctx, &gt, din ? &did : NULL);
    struct fsdp_tensor gid = gt; /* the identity's gradient, in the input's layout */
    if (st == FSDP_OK && din && !K->downsample)
        st = fsdp__as_layout(ctx, &gt, K->in_l, &gid, "residual block identity gradient (relaid out)");
    if (st == FSDP_OK && din) {
        const float *s = K->downsample ? did.data : gid.data;
        float *dx = din->data;
        int64_t n = fsdp_tensor_numel(din);
#pragma omp parallel for simd schedule(static)
        for (int64_t i = 0; i < n; i++) dx[i] += s[i];
    }
    fsdp_arena_release(ctx, mark);
    return st;
}

static void rb_destroy(struct fsdp_module *m) { free(m->impl); }

static const struct fsdp_module_ops basic_ops = {"BasicBlock", rb_forward, rb_backward, rb_destroy};
static const struct fsdp_module_ops bottleneck_ops = {"Bottleneck", rb_forward, rb_backward, rb_destroy};

static enum fsdp_status add_conv(struct fsdp_ctx *ctx, struct fsdp_module *parent, const char *name, int64_t in,
                                 int64_t out, int k, int stride, struct fsdp_module **slot) {
    struct fsdp_conv2d_opts o = fsdp_conv2d_opts_default(in, out, k);
    o.stride[0] = o.stride[1] = stride;
    o.padding[0] = o.padding[1] = k / 2;
    o.bias = 0;
    o.out_layout = fsdp__vision_layout();
    struct fsdp_module *c = NULL;
    return fsdp__adopt(ctx, parent, fsdp_conv2d_create(ctx, name, &o, &c), &c, slot);
}

static enum fsdp_status add_bn(struct fsdp_ctx *ctx, struct fsdp_module *parent, const char *name, int64_t ch,
                               struct fsdp_module **slot) {
    struct fsdp_batchnorm_opts o = fsdp_batchnorm_opts_default(ch);
    struct fsdp_module *c = NULL;
    return fsdp__adopt(ctx, parent, fsdp_batchnorm2d_create(ctx, name, &o, &c), &c, slot);
}

/* n pairs conv<i+1>/bn<i+1> of kernels k[i], widths w[i] -> w[i+1], the
 * stride on pair `sp`; a downsample when the stride or the width changes */
static enum fsdp_status rb_create(struct fsdp_ctx *ctx, const struct fsdp_module_ops *ops, const char *name, int n,
                                  const int *k, const int64_t *w, int stride, int sp, struct fsdp_module **out) {
    for (int i = 0; i <= n; i++)
        if (w[i] <= 0 || stride <= 0)
            return fsdp__err(ctx, FSDP_ERR_INVALID, "%s '%s': widths and the stride %d must be positive", ops->type,
                             name, stride);
    struct fsdp_module *m;
    FSDP_TRY(fsdp_module_create(ctx, ops, name, &m));
    struct resblock *K = fsdp__zalloc(1, sizeof *K);
    if (!K) {
        fsdp_module_free(m);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory creating %s '%s'", ops->type, name);
    }
    m->impl = K;
    K->n = n;
    enum fsdp_status st = FSDP_OK;
    for (int i = 0; i < n && st == FSDP_OK; i++) {
        char cn[8], bn[8];
        snprintf(cn, sizeof cn, "conv%d", i + 1);
        snprintf(bn, sizeof bn, "bn%d", i + 1);
        st = add_conv(ctx, m, cn, w[i], w[i + 1], k[i], i == sp ? stride : 1, &K->conv[i]);
        if (st == FSDP_OK) st = add_bn(ctx, m, bn, w[i + 1], &K->bn[i]);
        if (st == FSDP_OK && i + 1 < n) fsdp__batchnorm_fuse_relu(K->bn[i]);
    }
    if (st == FSDP_OK && (stride != 1 || w[0] != w[n])) {
        struct fsdp_module *ds = NULL;
        st = fsdp__adopt(ctx, m, fsdp_sequential_create(ctx, "downsample", &ds), &ds, &K->downsample);
        if (st == FSDP_OK) st = add_conv(ctx, K->downsample, "0", w[0], w[n], 1, stride, NULL);
        if (st == FSDP_OK) st = add_bn(ctx, K->downsample, "1", w[n], NULL);
    }
    if (st != FSDP_OK) {
        fsdp_module_free(m);
        return st;
    }
    *out = m;
    return FSDP_OK;
}

enum fsdp_status fsdp_basic_block_create(struct fsdp_ctx *ctx, const char *name, int64_t inplanes, int64_t planes,
                                         int stride, struct fsdp_module **out) {
    int k[2] = {3, 3};
    int64_t w[3] = {inplanes, planes, planes};
    return rb_create(ctx, &basic_ops, name, 2, k, w, stride, 0, out);
}

enum fsdp_status fsdp_bottleneck_create(struct fsdp_ctx *ctx, const char *name, int64_t inplanes, int64_t planes,
                                        int stride, struct fsdp_module **out) {
    int k[3] = {1, 3, 1};
    int64_t w[4] = {inplanes, planes, planes, 4 * planes};
    return rb_create(ctx, &bottleneck_ops, name, 3, k, w, stride, 1, out);
}
