/*
 * test_nn_vision.c - the vision layers of src/nn (Conv2d, BatchNorm2d, ReLU,
 * MaxPool2d, AdaptiveAvgPool2d, Flatten): finite-difference gradient checks
 * of every layer (input and parameter gradients, as test_nn.c's [Note: FD
 * checks]: loss sum(out * r) in double, central differences), BatchNorm's
 * running statistics and eval mode against formulas, the 16-bit conv path
 * against the rounded fp32 one, input errors, and, where Debian's PyTorch is
 * installed, every layer forward and backward against torch
 * (tests/torch_vision_ref.py), with BN's running statistics after 3 steps.
 */
#include "core/core-impl.h"
#include "fsdp.h"
#include "harness.h"
#include "nn_helpers.h"
#include "nn/nn-impl.h"

#include <omp.h>
#include <sys/stat.h>


static struct fsdp_tensor make_input(int ndim, const int64_t *shape, float scale, float offset) {
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

/* values spaced `gap` apart in random order (max pooling: no ties, no near-ties) */
static struct fsdp_tensor make_distinct(int ndim, const int64_t *shape, float gap) {
    struct fsdp_tensor t = make_input(ndim, shape, 0.0f, 0.0f);
    int64_t n = fsdp_tensor_numel(&t);
    float *x = t.data;
    for (int64_t i = 0; i < n; i++) x[i] = gap * (float)(i - n / 2);
    for (int64_t i = n - 1; i > 0; i--) {
        int64_t j = irand(i + 1);
        float v = x[i];
        x[i] = x[j];
        x[j] = v;
    }
    return t;
}

struct plist {
    int n;
    struct fsdp_param *p[64];
};
static int collect_param(struct fsdp_param *p, void *ud) {
    struct plist *l = ud;
    if (l->n < 64) l->p[l->n++] = p;
    return 0;
}
struct blist {
    int n;
    struct fsdp_buffer *b[64];
};
static int collect_buffer(struct fsdp_buffer *b, void *ud) {
    struct blist *l = ud;
    if (l->n < 64) l->b[l->n++] = b;
    return 0;
}
static int randomize_one(struct fsdp_param *p, void *ud) {
    float s = *(float *)ud;
    for (int64_t i = 0; i < p->numel; i++) p->data[i] = (p->init.kind == FSDP_INIT_ONES ? 1.0f : 0.0f) + s * urand();
    return 0;
}
static void prepare(struct fsdp_ctx *ctx, struct fsdp_module *m, float scale) {
    if (fsdp_module_finalize(ctx, m) != FSDP_OK || fsdp_module_materialize(ctx, m, 7) != FSDP_OK) abort();
    if (scale > 0) fsdp_module_foreach_param(m, randomize_one, &scale);
}

/* ---- finite differences ---- */

struct gc {
    const char *name;
    struct fsdp_ctx *ctx;
    struct fsdp_module *m;
    struct fsdp_tensor *in;
    double eps, rtol, atol;
    int coords;
    float *r;
    int64_t nout;
    int failures;
};

static double gc_loss(struct gc *g) {
    fsdp_arena_reset(g->ctx);
    struct fsdp_tensor out = {0};
    if (fsdp_module_forward(g->m, g->ctx, g->in, &out) != FSDP_OK) {
        TEST_FAILF("%s: forward: %s", g->name, fsdp_errmsg(g->ctx));
        return NAN;
    }
    double L = 0.0;
    for (int64_t i = 0; i < g->nout; i++) L += (double)((float *)out.data)[i] * (double)g->r[i];
    return L;
}

static void gc_tensor(struct gc *g, const char *what, float *x, const float *grad, int64_t n) {
    int64_t k = n <= g->coords ? n : g->coords;
    for (int64_t c = 0; c < k; c++) {
        int64_t i = n <= g->coords ? c : irand(n);
        float x0 = x[i];
        x[i] = x0 + (float)g->eps;
        double lp = gc_loss(g);
        x[i] = x0 - (float)g->eps;
        double lm = gc_loss(g);
        x[i] = x0;
        double fd = (lp - lm) / ((double)(x0 + (float)g->eps) - (double)(x0 - (float)g->eps));
        double tol = g->atol + g->rtol * fmax(fabs(grad[i]), fabs(fd));
        if (!(fabs(grad[i] - fd) <= tol)) {
            if (g->failures++ < 8)
                TEST_FAILF("%s: d/d %s[%lld]: analytic %.7g vs finite difference %.7g", g->name, what, (long long)i,
                           (double)grad[i], fd);
            test_failed_flag = 1;
        }
    }
}

static void gradcheck(struct gc *g) {
    struct fsdp_ctx *ctx = g->ctx;
    ASSERT_OK(fsdp_module_zero_grad(ctx, g->m), ctx);
    fsdp_arena_reset(ctx);
    struct fsdp_tensor out = {0}, din = {0};
    ASSERT_OK(fsdp_module_forward(g->m, ctx, g->in, &out), ctx);
    g->nout = fsdp_tensor_numel(&out);
    g->r = malloc((size_t)g->nout * sizeof(float));
    for (int64_t i = 0; i < g->nout; i++) g->r[i] = urand();
    float *dy = malloc((size_t)g->nout * sizeof(float));
    memcpy(dy, g->r, (size_t)g->nout * sizeof(float));
    struct fsdp_tensor dout = out;
    dout.data = dy;
    ASSERT_OK(fsdp_module_backward(g->m, ctx, &dout, &din), ctx);
    int64_t nin = fsdp_tensor_numel(g->in);
    ASSERT_INT_EQ(fsdp_tensor_numel(&din), nin);
    float *dx = malloc((size_t)nin * sizeof(float));
    memcpy(dx, din.data, (size_t)nin * sizeof(float));
    gc_tensor(g, "input", g->in->data, dx, nin);
    struct plist pl = {0};
    fsdp_module_foreach_param(g->m, collect_param, &pl);
    for (int i = 0; i < pl.n; i++) gc_tensor(g, pl.p[i]->fqn, pl.p[i]->data, pl.p[i]->grad, pl.p[i]->numel);
    free(dx);
    free(dy);
    free(g->r);
}

static struct fsdp_module *conv_with(struct fsdp_ctx *ctx, const char *name, int64_t in, int64_t out, int kh, int kw,
                                     int sh, int sw, int ph, int pw, int dil, int groups, int bias) {
    struct fsdp_conv2d_opts o = fsdp_conv2d_opts_default(in, out, kh);
    o.kernel[1] = kw;
    o.stride[0] = sh, o.stride[1] = sw;
    o.padding[0] = ph, o.padding[1] = pw;
    o.dilation[0] = o.dilation[1] = dil;
    o.groups = groups;
    o.bias = bias;
    struct fsdp_module *m = NULL;
    if (fsdp_conv2d_create(ctx, name, &o, &m) != FSDP_OK) {
        TEST_FAILF("conv create: %s", fsdp_errmsg(ctx));
        return NULL;
    }
    return m;
}

TEST(gradcheck_conv2d) { /* linear in x and W: rounding noise only; rtol 1e-3, atol 1e-4 */
    rng_seed(1);
    struct fsdp_ctx *ctx = make_ctx();
    struct {
        int64_t in, out;
        int kh, kw, sh, sw, ph, pw, dil, groups, bias;
        int64_t shape[4];
    } cases[] = {
        {3, 5, 3, 3, 1, 1, 1, 1, 1, 1, 1, {2, 3, 6, 7}},   /* 3x3 same padding, bias */
        {4, 6, 3, 2, 2, 1, 2, 0, 2, 2, 0, {2, 4, 9, 8}},   /* rectangular, strided, dilated, grouped */
        {4, 8, 1, 1, 2, 2, 0, 0, 1, 1, 0, {3, 4, 5, 5}},   /* ResNet downsample */
        {1, 4, 7, 7, 2, 2, 3, 3, 1, 1, 0, {2, 1, 11, 11}}, /* ResNet stem on 1 channel */
        /* [Note: cropped kernels] in conv.c: taps that only ever meet the padding */
        {8, 6, 3, 3, 1, 1, 1, 1, 1, 1, 1, {4, 8, 1, 1}},   /* 1x1 input: the centre tap alone */
        {4, 6, 3, 3, 2, 2, 1, 1, 1, 1, 0, {3, 4, 2, 2}},   /* 2x2 input, stride 2: a 2x2 corner */
        {3, 4, 3, 3, 1, 1, 1, 1, 1, 1, 1, {2, 3, 1, 5}},   /* cropped in height only */
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        struct fsdp_module *m = conv_with(ctx, "conv", cases[k].in, cases[k].out, cases[k].kh, cases[k].kw,
                                          cases[k].sh, cases[k].sw, cases[k].ph, cases[k].pw, cases[k].dil,
                                          cases[k].groups, cases[k].bias);
        ASSERT(m);
        prepare(ctx, m, 0.5f);
        struct fsdp_tensor x = make_input(4, cases[k].shape, 1.0f, 0.0f);
        char name[32];
        snprintf(name, sizeof name, "Conv2d case %zu", k);
        struct gc g = {.name = name, .ctx = ctx, .m = m, .in = &x, .eps = 1e-2, .rtol = 1e-3, .atol = 1e-4,
                       .coords = 60};
        gradcheck(&g);
        free(x.data);
        fsdp_module_free(m);
    }
    fsdp_ctx_free(ctx);
}

/* Conv2d's forward against a direct sum in double */
TEST(conv2d_forward_matches_direct_sum) {
    rng_seed(2);
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_module *m = conv_with(ctx, "conv", 4, 6, 3, 2, 2, 1, 1, 1, 2, 2, 1);
    ASSERT(m);
    prepare(ctx, m, 0.5f);
    int64_t shape[4] = {2, 4, 7, 6};
    struct fsdp_tensor x = make_input(4, shape, 1.0f, 0.0f), y = {0};
    ASSERT_OK(fsdp_module_forward(m, ctx, &x, &y), ctx);
    /* OH = (7 + 2 - 2*2 - 1)/2 + 1 = 3, OW = (6 + 2 - 2*1 - 1)/1 + 1 = 6 */
    ASSERT_INT_EQ(y.shape[2], 3);
    ASSERT_INT_EQ(y.shape[3], 6);
    const float *w = m->params[0]->data, *b = m->params[1]->data, *xv = x.data, *yv = y.data;
    double worst = 0.0;
    for (int n = 0; n < 2; n++)
        for (int o = 0; o < 6; o++)
            for (int oh = 0; oh < 3; oh++)
                for (int ow = 0; ow < 6; ow++) {
                    int g = o / 3;
                    double s = b[o];
                    for (int ci = 0; ci < 2; ci++)
                        for (int i = 0; i < 3; i++)
                            for (int j = 0; j < 2; j++) {
                                int h = oh * 2 - 1 + i * 2, ww = ow - 1 + j * 2;
                                if (h < 0 || h >= 7 || ww < 0 || ww >= 6) continue;
                                s += (double)w[((o * 2 + ci) * 3 + i) * 2 + j] *
                                     (double)xv[((n * 4 + g * 2 + ci) * 7 + h) * 6 + ww];
                            }
                    worst = fmax(worst, fabs(s - (double)yv[((n * 6 + o) * 3 + oh) * 6 + ow]));
                }
    CHECK(worst < 1e-5);
    free(x.data);
    fsdp_module_free(m);
    fsdp_ctx_free(ctx);
}

/* Kernels cropped to the taps that meet the image ([Note: cropped kernels] in
 * conv.c) give the direct sum over all taps, and the weight gradient too:
 * zero for the taps that never meet the image, written outright over stale
 * values and added onto */
TEST(conv2d_cropped_kernels_match_direct_sum) {
    rng_seed(12);
    struct fsdp_ctx *ctx = make_ctx();
    struct {
        int64_t in, out;
        int k, st, pad;
        int64_t shape[4];
    } cases[] = {{8, 6, 3, 1, 1, {4, 8, 1, 1}}, {4, 6, 3, 2, 1, {3, 4, 2, 2}}, {3, 4, 3, 1, 1, {2, 3, 1, 5}},
                 {2, 3, 5, 1, 2, {2, 2, 2, 1}}};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        int K = cases[k].k, S = cases[k].st, P = cases[k].pad;
        int64_t I = cases[k].in, O = cases[k].out, N = cases[k].shape[0], H = cases[k].shape[2],
                W = cases[k].shape[3];
        struct fsdp_module *m = conv_with(ctx, "conv", I, O, K, K, S, S, P, P, 1, 1, 1);
        ASSERT(m);
        prepare(ctx, m, 0.5f);
        struct fsdp_tensor x = make_input(4, cases[k].shape, 1.0f, 0.0f), y = {0};
        ASSERT_OK(fsdp_module_forward(m, ctx, &x, &y), ctx);
        int64_t OH = y.shape[2], OW = y.shape[3];
        const float *w = m->params[0]->data, *b = m->params[1]->data, *xv = x.data, *yv = y.data;
        /* dy = 1: dW[o, c, i, j] = sum over n, oh, ow of x at the tap */
        double worst = 0.0, worst_g = 0.0;
        double *gw = calloc((size_t)(O * I * K * K), sizeof(double));
        for (int64_t n = 0; n < N; n++)
            for (int64_t o = 0; o < O; o++)
                for (int64_t oh = 0; oh < OH; oh++)
                    for (int64_t ow = 0; ow < OW; ow++) {
                        double acc = b[o];
                        for (int64_t c = 0; c < I; c++)
                            for (int i = 0; i < K; i++)
                                for (int j = 0; j < K; j++) {
                                    int64_t h = oh * S - P + i, ww = ow * S - P + j;
                                    if (h < 0 || h >= H || ww < 0 || ww >= W) continue;
                                    double xx = xv[((n * I + c) * H + h) * W + ww];
                                    acc += (double)w[((o * I + c) * K + i) * K + j] * xx;
                                    gw[((o * I + c) * K + i) * K + j] += xx;
                                }
                        worst = fmax(worst, fabs(acc - (double)yv[((n * O + o) * OH + oh) * OW + ow]));
                    }
        struct fsdp_tensor dy = y;
        dy.data = malloc((size_t)fsdp_tensor_numel(&y) * sizeof(float));
        for (int64_t i = 0; i < fsdp_tensor_numel(&y); i++) ((float *)dy.data)[i] = 1.0f;
        /* pass 0: an unset gradient holding stale values is written outright; pass 1: added onto */
        ASSERT_OK(fsdp_module_zero_grad(ctx, m), ctx);
        float *g = m->params[0]->grad;
        for (int64_t i = 0; i < O * I * K * K; i++) g[i] = 7.0f;
        m->params[0]->priv->grad_unset = 1;
        for (int pass = 0; pass < 2; pass++) {
            struct fsdp_tensor y2 = {0}, dx = {0};
            ASSERT_OK(fsdp_module_forward(m, ctx, &x, &y2), ctx);
            ASSERT_OK(fsdp_module_backward(m, ctx, &dy, &dx), ctx);
            for (int64_t i = 0; i < O * I * K * K; i++)
                worst_g = fmax(worst_g, fabs((pass + 1) * gw[i] - (double)g[i]));
        }
        if (!(worst < 1e-5 && worst_g < 1e-4))
            TEST_FAILF("case %zu: forward off by %g, weight gradient off by %g", k, worst, worst_g);
        free(gw);
        free(dy.data);
        free(x.data);
        fsdp_module_free(m);
    }
    fsdp_ctx_free(ctx);
}

TEST(gradcheck_batchnorm2d) { /* train and eval mode; smooth: rtol 1e-2, atol 2e-4 */
    rng_seed(3);
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_batchnorm_opts o = fsdp_batchnorm_opts_default(3);
    struct fsdp_module *m;
    ASSERT_OK(fsdp_batchnorm2d_create(ctx, "bn", &o, &m), ctx);
    prepare(ctx, m, 0.5f);
    int64_t shape[4] = {3, 3, 4, 5};
    struct fsdp_tensor x = make_input(4, shape, 2.0f, 1.0f);
    struct gc g = {.name = "BatchNorm2d(train)", .ctx = ctx, .m = m, .in = &x, .eps = 1e-2, .rtol = 1e-2,
                   .atol = 2e-4, .coords = 60};
    gradcheck(&g);
    float *rv = m->buffers[1]->data;
    rv[0] = 0.5f, rv[1] = 2.0f, rv[2] = 1.5f; /* eval with running statistics that are not 1 */
    fsdp_module_set_training(m, 0);
    struct gc g2 = {.name = "BatchNorm2d(eval)", .ctx = ctx, .m = m, .in = &x, .eps = 1e-2, .rtol = 1e-2,
                    .atol = 2e-4, .coords = 60};
    gradcheck(&g2);
    free(x.data);
    fsdp_module_free(m);
    fsdp_ctx_free(ctx);
}

TEST(gradcheck_relu_pools_flatten) { /* piecewise linear away from kinks and ties: rtol 1e-3, atol 1e-4 */
    rng_seed(4);
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_module *relu, *mp, *mp2, *ap, *fl;
    ASSERT_OK(fsdp_relu_create(ctx, "relu", &relu), ctx);
    ASSERT_OK(fsdp_maxpool2d_create(ctx, "maxpool", 3, 2, 1, &mp), ctx);
    ASSERT_OK(fsdp_maxpool2d_create(ctx, "maxpool2", 2, 0, 0, &mp2), ctx);
    ASSERT_OK(fsdp_global_avgpool2d_create(ctx, "avgpool", &ap), ctx);
    ASSERT_OK(fsdp_flatten_create(ctx, "flatten", &fl), ctx);
    struct fsdp_module *mods[5] = {relu, mp, mp2, ap, fl};
    int64_t shape[4] = {2, 3, 7, 6};
    for (int k = 0; k < 5; k++) {
        prepare(ctx, mods[k], 0);
        struct fsdp_tensor x = make_distinct(4, shape, 0.01f); /* |x| >= 0.005 except one zero: keep it off */
        float *xv = x.data;
        for (int64_t i = 0; i < fsdp_tensor_numel(&x); i++)
            if (xv[i] == 0.0f) xv[i] = 0.005f;
        struct gc g = {.name = mods[k]->ops->type, .ctx = ctx, .m = mods[k], .in = &x, .eps = 1e-3, .rtol = 1e-3,
                       .atol = 1e-4, .coords = 80};
        gradcheck(&g);
        free(x.data);
    }
    /* shapes: MaxPool2d(3, 2, 1) on 7x6 -> 4x3, (2, 2) -> 3x3; avgpool -> (2, 3, 1, 1); flatten -> (2, 126) */
    struct fsdp_tensor x = make_input(4, shape, 1.0f, 0.0f), o1 = {0}, o2 = {0}, o3 = {0}, o4 = {0};
    fsdp_arena_reset(ctx);
    ASSERT_OK(fsdp_module_forward(mp, ctx, &x, &o1), ctx);
    CHECK(o1.shape[2] == 4 && o1.shape[3] == 3);
    ASSERT_OK(fsdp_module_forward(mp2, ctx, &x, &o2), ctx);
    CHECK(o2.shape[2] == 3 && o2.shape[3] == 3);
    ASSERT_OK(fsdp_module_forward(ap, ctx, &x, &o3), ctx);
    CHECK(o3.ndim == 4 && o3.shape[1] == 3 && o3.shape[2] == 1 && o3.shape[3] == 1);
    ASSERT_OK(fsdp_module_forward(fl, ctx, &x, &o4), ctx);
    CHECK(o4.ndim == 2 && o4.shape[0] == 2 && o4.shape[1] == 126 && o4.data == x.data); /* a view */
    /* ReLU in place: output over the input, backward in place */
    float *xv = x.data;
    float keep[8];
    memcpy(keep, xv, sizeof keep);
    struct fsdp_tensor same = x;
    ASSERT_OK(fsdp_module_forward(relu, ctx, &x, &same), ctx);
    for (int i = 0; i < 8; i++) CHECK(xv[i] == (keep[i] > 0 ? keep[i] : 0.0f));
    free(x.data);
    for (int k = 0; k < 5; k++) fsdp_module_free(mods[k]);
    fsdp_ctx_free(ctx);
}

/* A BatchNorm2d of 2 channels with `momentum`, its weight and bias random. */
static struct fsdp_module *new_bn(struct fsdp_ctx *ctx, float momentum) {
    struct fsdp_batchnorm_opts o = fsdp_batchnorm_opts_default(2);
    o.momentum = momentum;
    struct fsdp_module *m;
    if (fsdp_batchnorm2d_create(ctx, "bn", &o, &m) != FSDP_OK) abort();
    prepare(ctx, m, 0.3f);
    return m;
}

/* Its running_mean, running_var and num_batches_tracked (aborts without them). */
static void bn_buffers(struct fsdp_module *m, struct fsdp_buffer **rm, struct fsdp_buffer **rv,
                       struct fsdp_buffer **nbt) {
    *rm = fsdp_module_find_buffer(m, "running_mean");
    *rv = fsdp_module_find_buffer(m, "running_var");
    *nbt = fsdp_module_find_buffer(m, "num_batches_tracked");
    if (!*rm || !*rv || !*nbt) abort();
}

/* fsdp_batchnorm_set_update_stats off: a train-mode forward normalises with
 * the batch statistics (the same output) but leaves the running statistics
 * and the batch count alone; on again, it updates them. */
TEST(batchnorm2d_update_stats_switch) {
    rng_seed(6);
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_module *m = new_bn(ctx, 0.1f);
    struct fsdp_buffer *rm = fsdp_module_find_buffer(m, "running_mean"), *nbt = fsdp_module_find_buffer(m, "num_batches_tracked");
    ASSERT(rm && nbt);
    int64_t shape[4] = {3, 2, 3, 4};
    struct fsdp_tensor x = make_input(4, shape, 1.5f, 2.0f), y1 = {0}, y2 = {0};
    fsdp_arena_reset(ctx);
    ASSERT_OK(fsdp_module_forward(m, ctx, &x, &y1), ctx);
    float rm0 = ((float *)rm->data)[0];
    CHECK(rm0 != 0.0f);
    int n = 0;
    fsdp_batchnorm_set_update_stats(m, 0, &n);
    CHECK_INT_EQ(n, 1);
    ASSERT_OK(fsdp_module_forward(m, ctx, &x, &y2), ctx);
    CHECK(((float *)rm->data)[0] == rm0);
    CHECK_INT_EQ(((int64_t *)nbt->data)[0], 1);
    for (int i = 0; i < 72; i++) CHECK(((float *)y1.data)[i] == ((float *)y2.data)[i]);
    fsdp_batchnorm_set_update_stats(m, 1, NULL);
    ASSERT_OK(fsdp_module_forward(m, ctx, &x, &y2), ctx);
    CHECK(((float *)rm->data)[0] != rm0);
    CHECK_INT_EQ(((int64_t *)nbt->data)[0], 2);
    free(x.data);
    fsdp_module_free(m);
    fsdp_ctx_free(ctx);
}

/* Channel c of a (3, 2, 3, 4) input: its mean and sum of squared deviations, in double. */
static void channel_stats(const float *xv, int c, double *mu, double *s2) {
    double s = 0;
    for (int n = 0; n < 3; n++)
        for (int i = 0; i < 12; i++) s += xv[(n * 2 + c) * 12 + i];
    *mu = s / 36, *s2 = 0;
    for (int n = 0; n < 3; n++)
        for (int i = 0; i < 12; i++) *s2 += pow(xv[(n * 2 + c) * 12 + i] - *mu, 2);
}

/* fsdp_batchnorm_reset_stats is PyTorch's reset_running_stats (mean 0,
 * variance 1, count 0); with fsdp_batchnorm_set_cumulative on (momentum
 * None) the running statistics after 3 batches are the plain means of the
 * batches' mean and unbiased variance (in double here); off again, the
 * module's momentum 0.1 applies to the next batch. */
TEST(batchnorm2d_reset_and_cumulative) {
    rng_seed(8);
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_module *m = new_bn(ctx, 0.1f);
    struct fsdp_buffer *rm, *rv, *nbt;
    bn_buffers(m, &rm, &rv, &nbt);
    int64_t shape[4] = {3, 2, 3, 4};
    struct fsdp_tensor x0 = make_input(4, shape, 2.0f, 5.0f), y = {0};
    fsdp_arena_reset(ctx);
    ASSERT_OK(fsdp_module_forward(m, ctx, &x0, &y), ctx); /* statistics away from (0, 1) */
    free(x0.data);
    CHECK(((float *)rm->data)[1] != 0.0f && ((int64_t *)nbt->data)[0] == 1);
    int n = 0;
    fsdp_batchnorm_reset_stats(m, &n);
    CHECK_INT_EQ(n, 1);
    for (int c = 0; c < 2; c++) CHECK(((float *)rm->data)[c] == 0.0f && ((float *)rv->data)[c] == 1.0f);
    CHECK_INT_EQ(((int64_t *)nbt->data)[0], 0);
    fsdp_batchnorm_set_cumulative(m, 1, &n);
    CHECK_INT_EQ(n, 1);
    double sm[2] = {0, 0}, sv[2] = {0, 0}, last[2][2] = {{0, 0}, {0, 0}};
    for (int b = 0; b < 4; b++) {
        if (b == 3) fsdp_batchnorm_set_cumulative(m, 0, NULL);
        struct fsdp_tensor x = make_input(4, shape, 1.0f + (float)b, 4.0f * (float)b - 3.0f);
        fsdp_arena_reset(ctx);
        ASSERT_OK(fsdp_module_forward(m, ctx, &x, &y), ctx);
        const float *xv = x.data;
        for (int c = 0; c < 2; c++) {
            double mu, s2;
            channel_stats(xv, c, &mu, &s2);
            if (b < 3) sm[c] += mu / 3, sv[c] += s2 / 35 / 3;
            last[c][0] = mu, last[c][1] = s2 / 35;
        }
        free(x.data);
        if (b == 2)
            for (int c = 0; c < 2; c++) {
                CHECK_NEAR(((float *)rm->data)[c], sm[c], 1e-5, 1e-6);
                CHECK_NEAR(((float *)rv->data)[c], sv[c], 1e-5, 1e-6);
            }
    }
    for (int c = 0; c < 2; c++) { /* momentum 0.1 again */
        CHECK_NEAR(((float *)rm->data)[c], 0.9 * sm[c] + 0.1 * last[c][0], 1e-5, 1e-6);
        CHECK_NEAR(((float *)rv->data)[c], 0.9 * sv[c] + 0.1 * last[c][1], 1e-5, 1e-6);
    }
    CHECK_INT_EQ(((int64_t *)nbt->data)[0], 4);
    fsdp_module_free(m);
    fsdp_ctx_free(ctx);
}

/* Running statistics after 3 train steps against PyTorch's update rule in
 * double; eval mode uses them and updates nothing. */
TEST(batchnorm2d_running_stats_and_eval) {
    rng_seed(5);
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_module *m = new_bn(ctx, 0.25f);
    struct fsdp_buffer *rm, *rv, *nbt;
    bn_buffers(m, &rm, &rv, &nbt);
    CHECK_INT_EQ(nbt->dtype, FSDP_I64);
    double em[2] = {0, 0}, ev[2] = {1, 1};
    int64_t shape[4] = {3, 2, 3, 4};
    for (int step = 0; step < 3; step++) {
        struct fsdp_tensor x = make_input(4, shape, 1.5f, 3.0f * (float)step - 1.0f), y = {0};
        fsdp_arena_reset(ctx);
        ASSERT_OK(fsdp_module_forward(m, ctx, &x, &y), ctx);
        const float *xv = x.data;
        for (int c = 0; c < 2; c++) {
            double mu, s2;
            channel_stats(xv, c, &mu, &s2);
            em[c] = 0.75 * em[c] + 0.25 * mu;
            ev[c] = 0.75 * ev[c] + 0.25 * s2 / 35; /* unbiased */
            /* the output is normalised with the biased variance */
            double want = (xv[c * 12] - mu) / sqrt(s2 / 36 + 1e-5) * m->params[0]->data[c] + m->params[1]->data[c];
            CHECK_NEAR(((float *)y.data)[c * 12], want, 1e-5, 1e-5);
        }
        free(x.data);
    }
    for (int c = 0; c < 2; c++) {
        CHECK_NEAR(((float *)rm->data)[c], em[c], 1e-5, 1e-6);
        CHECK_NEAR(((float *)rv->data)[c], ev[c], 1e-5, 1e-6);
    }
    CHECK_INT_EQ(((int64_t *)nbt->data)[0], 3);
    fsdp_module_set_training(m, 0);
    struct fsdp_tensor x = make_input(4, shape, 1.0f, 0.0f), y = {0};
    fsdp_arena_reset(ctx);
    ASSERT_OK(fsdp_module_forward(m, ctx, &x, &y), ctx);
    for (int c = 0; c < 2; c++) {
        double want = (((float *)x.data)[c * 12 + 5] - em[c]) / sqrt(ev[c] + 1e-5) * m->params[0]->data[c] +
                      m->params[1]->data[c];
        CHECK_NEAR(((float *)y.data)[c * 12 + 5], want, 1e-5, 1e-5);
    }
    CHECK_INT_EQ(((int64_t *)nbt->data)[0], 3); /* eval counts nothing */
    CHECK_NEAR(((float *)rm->data)[0], em[0], 1e-5, 1e-6);
    free(x.data);
    fsdp_module_free(m);
    fsdp_ctx_free(ctx);
}

/* [Note: eight partial sums] in batchnorm.c: the order of each channel's
 * sums is fixed by the shape, so forward and backward (output, input
 * gradient, weight and bias gradients, running statistics) give the same
 * bits at 1 and 3 threads; and the running mean after one step is the
 * batch mean (summed as the note says) to the bit. Planes of 63 values:
 * the partial sums run on across planes that are not a multiple of 8. */
TEST(batchnorm2d_sums_fixed_order) {
    rng_seed(9);
    struct fsdp_ctx *ctx = make_ctx();
    int64_t shape[4] = {3, 5, 7, 9}, C = 5, HW = 63;
    struct fsdp_tensor x = make_input(4, shape, 1.0f, 1000.0f), dy = make_input(4, shape, 1.0f, 0.5f);
    int64_t n = fsdp_tensor_numel(&x);
    float *out[2][4];
    int threads[2] = {1, 3}, saved = omp_get_max_threads();
    for (int t = 0; t < 2; t++) {
        omp_set_num_threads(threads[t]);
        struct fsdp_batchnorm_opts o = fsdp_batchnorm_opts_default(C);
        struct fsdp_module *m;
        ASSERT_OK(fsdp_batchnorm2d_create(ctx, "bn", &o, &m), ctx);
        rng_seed(10); /* the same weight and bias both times */
        prepare(ctx, m, 0.3f);
        ASSERT_OK(fsdp_module_zero_grad(ctx, m), ctx);
        fsdp_arena_reset(ctx);
        struct fsdp_tensor y = {0}, dx = {0};
        ASSERT_OK(fsdp_module_forward(m, ctx, &x, &y), ctx);
        ASSERT_OK(fsdp_module_backward(m, ctx, &dy, &dx), ctx);
        struct fsdp_buffer *rm = fsdp_module_find_buffer(m, "running_mean");
        ASSERT(rm);
        for (int64_t c = 0; c < C && t == 0; c++) {
            double p[8] = {0};
            for (int64_t b = 0; b < 3; b++)
                for (int64_t i = 0; i < HW; i++) p[(b * HW + i) % 8] += ((const float *)x.data)[(b * C + c) * HW + i];
            double mean = (((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))) / (double)(3 * HW);
            float want = (1.0f - 0.1f) * 0.0f + 0.1f * (float)mean;
            CHECK(((float *)rm->data)[c] == want);
        }
        out[t][0] = malloc((size_t)n * sizeof(float));
        out[t][1] = malloc((size_t)n * sizeof(float));
        out[t][2] = malloc((size_t)(2 * C) * sizeof(float));
        out[t][3] = malloc((size_t)(2 * C) * sizeof(float));
        memcpy(out[t][0], y.data, (size_t)n * sizeof(float));
        memcpy(out[t][1], dx.data, (size_t)n * sizeof(float));
        memcpy(out[t][2], m->params[0]->grad, (size_t)C * sizeof(float));
        memcpy(out[t][2] + C, m->params[1]->grad, (size_t)C * sizeof(float));
        memcpy(out[t][3], rm->data, (size_t)C * sizeof(float));
        memcpy(out[t][3] + C, fsdp_module_find_buffer(m, "running_var")->data, (size_t)C * sizeof(float));
        fsdp_module_free(m);
    }
    omp_set_num_threads(saved);
    CHECK(memcmp(out[0][0], out[1][0], (size_t)n * sizeof(float)) == 0);
    CHECK(memcmp(out[0][1], out[1][1], (size_t)n * sizeof(float)) == 0);
    CHECK(memcmp(out[0][2], out[1][2], (size_t)(2 * C) * sizeof(float)) == 0);
    CHECK(memcmp(out[0][3], out[1][3], (size_t)(2 * C) * sizeof(float)) == 0);
    for (int t = 0; t < 2; t++)
        for (int k = 0; k < 4; k++) free(out[t][k]);
    free(x.data);
    free(dy.data);
    fsdp_ctx_free(ctx);
}

/* 16-bit compute: BF16 (native where the CPU has it, else widened) and F16
 * (widened) against the fp32 convolution of the rounded operands; the
 * widened path equals it up to summation order. */
TEST(conv2d_16bit_matches_rounded_fp32) {
    rng_seed(6);
    struct fsdp_ctx *ctx = make_ctx();
    enum fsdp_dtype dts[2] = {FSDP_BF16, FSDP_F16};
    /* bf16 and f16 on 6x6, 2x2 ([Note: bf16 weight gradients of small images] in conv.c) and 1x1
       ([Note: cropped kernels]) */
    const int64_t hw[3] = {6, 2, 1};
    for (int k = 0; k < 6; k++) {
        struct fsdp_module *m = conv_with(ctx, "conv", 8, 16, 3, 3, 1, 1, 1, 1, 1, 1, 1), *ref;
        ref = conv_with(ctx, "conv", 8, 16, 3, 3, 1, 1, 1, 1, 1, 1, 1);
        ASSERT(m && ref);
        prepare(ctx, m, 0.3f);
        prepare(ctx, ref, 0);
        int64_t shape[4] = {4, 8, hw[k / 2], hw[k / 2]};
        struct fsdp_tensor x = make_input(4, shape, 1.0f, 0.0f), xr = make_input(4, shape, 0.0f, 0.0f);
        int64_t nx = fsdp_tensor_numel(&x), nw = m->params[0]->numel;
        uint16_t h;
        for (int64_t i = 0; i < nx; i++) {
            h = k % 2 == 0 ? fsdp__f32_to_bf16(((float *)x.data)[i]) : fsdp__f32_to_f16(((float *)x.data)[i]);
            ((float *)xr.data)[i] = k % 2 == 0 ? fsdp__bf16_to_f32(h) : fsdp__f16_to_f32(h);
        }
        for (int64_t i = 0; i < nw; i++) {
            h = k % 2 == 0 ? fsdp__f32_to_bf16(m->params[0]->data[i]) : fsdp__f32_to_f16(m->params[0]->data[i]);
            ref->params[0]->data[i] = k % 2 == 0 ? fsdp__bf16_to_f32(h) : fsdp__f16_to_f32(h);
        }
        memcpy(ref->params[1]->data, m->params[1]->data, 16 * sizeof(float));
        ASSERT_OK(fsdp_module_set_compute_dtype(ctx, m, dts[k % 2]), ctx);
        ASSERT_OK(fsdp_module_zero_grad(ctx, m), ctx);
        ASSERT_OK(fsdp_module_zero_grad(ctx, ref), ctx);
        fsdp_arena_reset(ctx);
        struct fsdp_tensor y = {0}, yr = {0}, dx = {0}, dxr = {0};
        ASSERT_OK(fsdp_module_forward(m, ctx, &x, &y), ctx);
        ASSERT_OK(fsdp_module_forward(ref, ctx, &xr, &yr), ctx);
        int64_t ny = fsdp_tensor_numel(&y);
        double mx;
        CHECK(max_abs_diff(y.data, yr.data, ny, &mx) <= 1e-5 * mx);
        /* the output gradient is rounded too */
        float *dy = malloc((size_t)ny * sizeof(float)), *dyr = malloc((size_t)ny * sizeof(float));
        for (int64_t i = 0; i < ny; i++) {
            dy[i] = urand();
            h = k % 2 == 0 ? fsdp__f32_to_bf16(dy[i]) : fsdp__f32_to_f16(dy[i]);
            dyr[i] = k % 2 == 0 ? fsdp__bf16_to_f32(h) : fsdp__f16_to_f32(h);
        }
        struct fsdp_tensor d1 = y, d2 = yr;
        d1.data = dy, d2.data = dyr;
        ASSERT_OK(fsdp_module_backward(m, ctx, &d1, &dx), ctx);
        ASSERT_OK(fsdp_module_backward(ref, ctx, &d2, &dxr), ctx);
        CHECK(max_abs_diff(dx.data, dxr.data, nx, &mx) <= 1e-5 * mx);
        CHECK(max_abs_diff(m->params[0]->grad, ref->params[0]->grad, nw, &mx) <= 1e-5 * mx);
        /* the bias gradient sums dy, which the product rounds; the bias does not see rounding in PyTorch
           either, but oneDNN's bf16 kernel sums the rounded dy: within 16-bit rounding */
        CHECK(max_abs_diff(m->params[1]->grad, ref->params[1]->grad, 16, &mx) <= 1e-5 * mx);
        /* and far from fp32's exact values only by rounding: within 1e-2 relative */
        free(dy);
        free(dyr);
        free(x.data);
        free(xr.data);
        fsdp_module_free(m);
        fsdp_module_free(ref);
    }
    fsdp_ctx_free(ctx);
}

/* ---- BLOCKED16 activations ([Note: blocked activations] in conv.c) ---- */

/* One forward and backward of m on x (PLAIN values) handed over in layout
 * in_l, with the output gradient dy = seeded values in PLAIN order handed
 * over in the output's layout; everything read back in PLAIN order. */
struct lrun {
    float *y, *dx, *g[8], *b[8];
    int64_t ny, nx, ng[8], nb[8];
    int np, nbuf;
    enum fsdp_layout out_l;
};

static void lrun_free(struct lrun *r) {
    free(r->y);
    free(r->dx);
    for (int i = 0; i < r->np; i++) free(r->g[i]);
    for (int i = 0; i < r->nbuf; i++) free(r->b[i]);
}

static float *plain_copy(const struct fsdp_tensor *t) {
    int64_t n = fsdp_tensor_numel(t);
    float *o = malloc((size_t)n * sizeof(float));
    if (t->ndim == 4) fsdp__relayout(o, FSDP_LAYOUT_PLAIN, t->data, t->layout, t->shape);
    else memcpy(o, t->data, (size_t)n * sizeof(float));
    return o;
}

static void lrun(struct fsdp_ctx *ctx, struct fsdp_module *m, const struct fsdp_tensor *x, enum fsdp_layout in_l,
                 struct lrun *r) {
    memset(r, 0, sizeof *r);
    int64_t nx = fsdp_tensor_numel(x);
    struct fsdp_tensor xin = *x;
    xin.data = malloc((size_t)nx * sizeof(float));
    xin.layout = in_l;
    fsdp__relayout(xin.data, in_l, x->data, FSDP_LAYOUT_PLAIN, x->shape);
    ASSERT_OK(fsdp_module_zero_grad(ctx, m), ctx);
    fsdp_arena_reset(ctx);
    struct fsdp_tensor y = {0}, dx = {0};
    ASSERT_OK(fsdp_module_forward(m, ctx, &xin, &y), ctx);
    r->out_l = y.layout;
    r->ny = fsdp_tensor_numel(&y);
    r->y = plain_copy(&y);
    float *dyp = malloc((size_t)r->ny * sizeof(float)), *dyl = malloc((size_t)r->ny * sizeof(float));
    rng_seed(77);
    for (int64_t i = 0; i < r->ny; i++) dyp[i] = urand();
    if (y.ndim == 4) fsdp__relayout(dyl, y.layout, dyp, FSDP_LAYOUT_PLAIN, y.shape);
    else memcpy(dyl, dyp, (size_t)r->ny * sizeof(float));
    struct fsdp_tensor d = y;
    d.data = dyl;
    ASSERT_OK(fsdp_module_backward(m, ctx, &d, &dx), ctx);
    CHECK_INT_EQ((int)dx.layout, (int)in_l);
    r->nx = nx;
    r->dx = plain_copy(&dx);
    struct plist pl = {0};
    struct blist bl = {0};
    fsdp_module_foreach_param(m, collect_param, &pl);
    fsdp_module_foreach_buffer(m, collect_buffer, &bl);
    for (int i = 0; i < pl.n && i < 8; i++, r->np++) {
        r->ng[i] = pl.p[i]->numel;
        r->g[i] = malloc((size_t)r->ng[i] * sizeof(float));
        memcpy(r->g[i], pl.p[i]->grad, (size_t)r->ng[i] * sizeof(float));
    }
    for (int i = 0; i < bl.n && i < 8; i++) {
        if (bl.b[i]->dtype != FSDP_F32) continue;
        r->nb[r->nbuf] = bl.b[i]->numel;
        r->b[r->nbuf] = malloc((size_t)bl.b[i]->numel * sizeof(float));
        memcpy(r->b[r->nbuf++], bl.b[i]->data, (size_t)bl.b[i]->numel * sizeof(float));
    }
    free(dyp);
    free(dyl);
    free(xin.data);
}

/* a and b the same bits: output, input gradient, parameter gradients, float buffers */
static void lrun_same(const char *what, const struct lrun *a, const struct lrun *b) {
    int same = a->ny == b->ny && a->nx == b->nx && a->np == b->np && a->nbuf == b->nbuf &&
               !memcmp(a->y, b->y, (size_t)a->ny * sizeof(float)) &&
               !memcmp(a->dx, b->dx, (size_t)a->nx * sizeof(float));
    for (int i = 0; same && i < a->np; i++) same = !memcmp(a->g[i], b->g[i], (size_t)a->ng[i] * sizeof(float));
    for (int i = 0; same && i < a->nbuf; i++) same = !memcmp(a->b[i], b->b[i], (size_t)a->nb[i] * sizeof(float));
    if (!same) TEST_FAILF("%s: BLOCKED16 and PLAIN differ", what);
}

/* Each layer that takes BLOCKED16 gives, from the same values in either
 * layout, the same bits as from PLAIN: outputs, input gradients, parameter
 * gradients and BN's running statistics; fp32 and bf16 convolutions. */
TEST(blocked_layout_gives_the_plain_bits) {
    rng_seed(21);
    struct fsdp_ctx *ctx = make_ctx();
    int64_t s16[4] = {3, 16, 9, 9}, s32[4] = {2, 32, 6, 7};
    struct fsdp_tensor x16 = make_distinct(4, s16, 1.0f / 1024), x32 = make_input(4, s32, 1.0f, 0.2f);
    /* Conv2d: PLAIN or BLOCKED16 in, PLAIN or BLOCKED16 out, stride 1 and 2, fp32 and bf16 */
    for (int k = 0; k < 8; k++) {
        int stride = k % 2 ? 2 : 1, bf16 = k / 4;
        struct lrun ref, got[2];
        for (int v = 0; v < 3; v++) { /* v 0: PLAIN -> PLAIN, 1: PLAIN -> k's, 2: BLOCKED16 -> k's */
            struct fsdp_conv2d_opts o = fsdp_conv2d_opts_default(16, 32, 3);
            o.stride[0] = o.stride[1] = stride;
            o.padding[0] = o.padding[1] = 1;
            o.out_layout = v && (k / 2) % 2 == 0 ? FSDP_LAYOUT_BLOCKED16 : FSDP_LAYOUT_PLAIN;
            struct fsdp_module *m = NULL;
            ASSERT_OK(fsdp_conv2d_create(ctx, "conv", &o, &m), ctx);
            rng_seed(22);
            prepare(ctx, m, 0.3f);
            if (bf16) ASSERT_OK(fsdp_module_set_compute_dtype(ctx, m, FSDP_BF16), ctx);
            lrun(ctx, m, &x16, v == 2 ? FSDP_LAYOUT_BLOCKED16 : FSDP_LAYOUT_PLAIN, v ? &got[v - 1] : &ref);
            CHECK_INT_EQ((int)(v ? got[v - 1] : ref).out_l, (int)o.out_layout);
            fsdp_module_free(m);
        }
        char what[64];
        snprintf(what, sizeof what, "Conv2d case %d", k);
        lrun_same(what, &ref, &got[0]);
        lrun_same(what, &ref, &got[1]);
        lrun_free(&ref);
        lrun_free(&got[0]);
        lrun_free(&got[1]);
    }
    /* BatchNorm2d (train and eval), ReLU, MaxPool2d, AdaptiveAvgPool2d: the output in the input's layout */
    for (int k = 0; k < 5; k++) {
        struct lrun r[2];
        for (int v = 0; v < 2; v++) {
            struct fsdp_module *m = NULL;
            struct fsdp_batchnorm_opts bo = fsdp_batchnorm_opts_default(32);
            if (k < 2) ASSERT_OK(fsdp_batchnorm2d_create(ctx, "bn", &bo, &m), ctx);
            else if (k == 2) ASSERT_OK(fsdp_relu_create(ctx, "relu", &m), ctx);
            else if (k == 3) ASSERT_OK(fsdp_maxpool2d_create(ctx, "pool", 3, 2, 1, &m), ctx);
            else ASSERT_OK(fsdp_global_avgpool2d_create(ctx, "avg", &m), ctx);
            rng_seed(23);
            prepare(ctx, m, 0.3f);
            if (k == 1) fsdp_module_set_training(m, 0);
            lrun(ctx, m, k == 3 ? &x16 : &x32, v ? FSDP_LAYOUT_BLOCKED16 : FSDP_LAYOUT_PLAIN, &r[v]);
            CHECK_INT_EQ((int)r[v].out_l, k == 4 ? (int)FSDP_LAYOUT_PLAIN : (int)(v ? FSDP_LAYOUT_BLOCKED16 : FSDP_LAYOUT_PLAIN));
            fsdp_module_free(m);
        }
        const char *names[5] = {"BatchNorm2d (train)", "BatchNorm2d (eval)", "ReLU", "MaxPool2d", "AdaptiveAvgPool2d"};
        lrun_same(names[k], &r[0], &r[1]);
        lrun_free(&r[0]);
        lrun_free(&r[1]);
    }
    /* residual blocks: all PLAIN (FSDP_VISION_LAYOUT=plain) against BLOCKED16 convolutions fed either
       layout (a PLAIN input without downsample: the identity converted, its gradient back) */
    struct { int bottleneck; int64_t in, planes; int stride; const struct fsdp_tensor *x; } blocks[] = {
        {0, 16, 32, 2, &x16}, {0, 32, 32, 1, &x32}, {1, 16, 16, 2, &x16}};
    for (int k = 0; k < 3; k++) {
        struct lrun r[3];
        for (int v = 0; v < 3; v++) {
            if (v == 0) setenv("FSDP_VISION_LAYOUT", "plain", 1);
            struct fsdp_module *m = NULL;
            if (blocks[k].bottleneck)
                ASSERT_OK(fsdp_bottleneck_create(ctx, "", blocks[k].in, blocks[k].planes, blocks[k].stride, &m), ctx);
            else
                ASSERT_OK(fsdp_basic_block_create(ctx, "", blocks[k].in, blocks[k].planes, blocks[k].stride, &m), ctx);
            unsetenv("FSDP_VISION_LAYOUT");
            rng_seed(24);
            prepare(ctx, m, 0.3f);
            lrun(ctx, m, blocks[k].x, v == 2 ? FSDP_LAYOUT_BLOCKED16 : FSDP_LAYOUT_PLAIN, &r[v]);
            CHECK_INT_EQ((int)r[v].out_l, v ? (int)FSDP_LAYOUT_BLOCKED16 : (int)FSDP_LAYOUT_PLAIN);
            fsdp_module_free(m);
        }
        char what[64];
        snprintf(what, sizeof what, "residual block case %d", k);
        lrun_same(what, &r[0], &r[1]);
        lrun_same(what, &r[0], &r[2]);
        for (int v = 0; v < 3; v++) lrun_free(&r[v]);
    }
    free(x16.data);
    free(x32.data);
    fsdp_ctx_free(ctx);
}

/* [Note: fused ReLU and 16-bit hand-off] (batchnorm.c): a Conv2d computing in
 * bf16 given its input and output gradient already rounded to bf16 gives the
 * bits it gives from fp32 (which it rounds itself); a BatchNorm2d with its
 * ReLU fused writes relu(BN(x)) rounded as asked, and its backward (the
 * gradient masked by the ReLU, written in bf16 as asked) gives the bits of
 * BN, a ReLU and the rounding run one after the other. */
TEST(handoff_gives_the_cast_bits) {
    rng_seed(31);
    struct fsdp_ctx *ctx = make_ctx();
    int64_t shape[4] = {2, 16, 6, 6}, oshape[4] = {2, 32, 6, 6};
    struct fsdp_tensor x = make_input(4, shape, 1.0f, 0.1f);
    int64_t nx = fsdp_tensor_numel(&x), ny = 2 * 32 * 36;
    uint16_t *xb = malloc((size_t)nx * 2), *dyb = malloc((size_t)ny * 2);
    float *dy = malloc((size_t)ny * sizeof(float));
    for (int64_t i = 0; i < nx; i++) xb[i] = fsdp__f32_to_bf16(((float *)x.data)[i]);
    for (int64_t i = 0; i < ny; i++) dyb[i] = fsdp__f32_to_bf16(dy[i] = urand());
    for (int L = 0; L < 2; L++) { /* PLAIN, BLOCKED16 */
        float *out[2][3];
        for (int v = 0; v < 2; v++) { /* v 0: fp32 in, 1: bf16 in */
            struct fsdp_conv2d_opts o = fsdp_conv2d_opts_default(16, 32, 3);
            o.padding[0] = o.padding[1] = 1;
            o.out_layout = L ? FSDP_LAYOUT_BLOCKED16 : FSDP_LAYOUT_PLAIN;
            struct fsdp_module *m = NULL;
            ASSERT_OK(fsdp_conv2d_create(ctx, "conv", &o, &m), ctx);
            rng_seed(32);
            prepare(ctx, m, 0.3f);
            ASSERT_OK(fsdp_module_set_compute_dtype(ctx, m, FSDP_BF16), ctx);
            CHECK_INT_EQ((int)fsdp__input_dtype(m), (int)FSDP_BF16);
            ASSERT_OK(fsdp_module_zero_grad(ctx, m), ctx);
            fsdp_arena_reset(ctx);
            struct fsdp_tensor xi = x, y = {0}, d, dx = {0};
            if (v) xi.data = xb, xi.dtype = FSDP_BF16;
            ASSERT_OK(fsdp_module_forward(m, ctx, &xi, &y), ctx);
            CHECK_INT_EQ((int)m->priv->dout_dtype, (int)FSDP_BF16);
            float *dyl = malloc((size_t)ny * sizeof(float));
            uint16_t *dybl = malloc((size_t)ny * 2);
            fsdp__relayout(dyl, y.layout, dy, FSDP_LAYOUT_PLAIN, oshape);
            for (int64_t i = 0; i < ny; i++) dybl[i] = fsdp__f32_to_bf16(dyl[i]);
            d = y;
            d.data = v ? (void *)dybl : (void *)dyl;
            d.dtype = v ? FSDP_BF16 : FSDP_F32;
            ASSERT_OK(fsdp_module_backward(m, ctx, &d, &dx), ctx);
            out[v][0] = plain_copy(&y);
            out[v][1] = plain_copy(&dx);
            out[v][2] = malloc((size_t)m->params[0]->numel * sizeof(float));
            memcpy(out[v][2], m->params[0]->grad, (size_t)m->params[0]->numel * sizeof(float));
            free(dyl);
            free(dybl);
            fsdp_module_free(m);
        }
        CHECK(!memcmp(out[0][0], out[1][0], (size_t)ny * sizeof(float)));
        CHECK(!memcmp(out[0][1], out[1][1], (size_t)nx * sizeof(float)));
        CHECK(!memcmp(out[0][2], out[1][2], (size_t)(32 * 16 * 9) * sizeof(float)));
        for (int v = 0; v < 2; v++)
            for (int k = 0; k < 3; k++) free(out[v][k]);
    }
    /* BatchNorm2d with its ReLU fused, bf16 out and bf16 input gradient, against BN + ReLU + rounding */
    for (int L = 0; L < 2; L++) {
        uint16_t *got[2];
        float *ref[2], *gw[2];
        for (int v = 0; v < 2; v++) { /* v 0: separate passes, 1: fused */
            struct fsdp_batchnorm_opts bo = fsdp_batchnorm_opts_default(16);
            struct fsdp_module *m = NULL;
            ASSERT_OK(fsdp_batchnorm2d_create(ctx, "bn", &bo, &m), ctx);
            rng_seed(33);
            prepare(ctx, m, 0.3f);
            if (v) fsdp__batchnorm_fuse_relu(m);
            ASSERT_OK(fsdp_module_zero_grad(ctx, m), ctx);
            fsdp_arena_reset(ctx);
            struct fsdp_tensor xi = x, y = {0}, dx = {0};
            float *xl = malloc((size_t)nx * sizeof(float)), *g = malloc((size_t)nx * sizeof(float));
            fsdp__relayout(xl, L ? FSDP_LAYOUT_BLOCKED16 : FSDP_LAYOUT_PLAIN, x.data, FSDP_LAYOUT_PLAIN, shape);
            xi.data = xl;
            xi.layout = L ? FSDP_LAYOUT_BLOCKED16 : FSDP_LAYOUT_PLAIN;
            rng_seed(34);
            for (int64_t i = 0; i < nx; i++) g[i] = urand();
            if (v) y.dtype = FSDP_BF16; /* asked for bf16 */
            ASSERT_OK(fsdp_module_forward(m, ctx, &xi, &y), ctx);
            CHECK_INT_EQ((int)y.dtype, v ? (int)FSDP_BF16 : (int)FSDP_F32);
            struct fsdp_tensor d = y;
            d.data = g, d.dtype = FSDP_F32;
            if (v) {
                got[L] = malloc((size_t)nx * 2);
                memcpy(got[L], y.data, (size_t)nx * 2);
                dx.dtype = FSDP_BF16;
            } else { /* the ReLU and its mask by hand */
                float *yy = y.data;
                ref[L] = malloc((size_t)nx * sizeof(float));
                for (int64_t i = 0; i < nx; i++) {
                    ref[L][i] = yy[i] > 0.0f ? yy[i] : 0.0f;
                    if (!(yy[i] > 0.0f)) g[i] = 0.0f;
                }
            }
            ASSERT_OK(fsdp_module_backward(m, ctx, &d, &dx), ctx);
            CHECK_INT_EQ((int)dx.dtype, v ? (int)FSDP_BF16 : (int)FSDP_F32);
            gw[v] = malloc((size_t)(nx + 32) * sizeof(float));
            for (int64_t i = 0; i < nx; i++)
                gw[v][i] = v ? fsdp__bf16_to_f32(((uint16_t *)dx.data)[i])
                             : fsdp__bf16_to_f32(fsdp__f32_to_bf16(((float *)dx.data)[i]));
            memcpy(gw[v] + nx, m->params[0]->grad, 16 * sizeof(float));
            memcpy(gw[v] + nx + 16, m->params[1]->grad, 16 * sizeof(float));
            free(xl);
            free(g);
            fsdp_module_free(m);
        }
        int same = 1;
        for (int64_t i = 0; i < nx; i++) same &= got[L][i] == fsdp__f32_to_bf16(ref[L][i]);
        CHECK(same);
        CHECK(!memcmp(gw[0], gw[1], (size_t)(nx + 32) * sizeof(float)));
        free(got[L]);
        free(ref[L]);
        free(gw[0]);
        free(gw[1]);
    }
    free(xb);
    free(dyb);
    free(dy);
    free(x.data);
    fsdp_ctx_free(ctx);
}

TEST(gradcheck_residual_blocks) { /* through 2-3 BNs and ReLUs: eps 1e-3, rtol 1e-2, atol 1e-3 */
    rng_seed(8);
    struct fsdp_ctx *ctx = make_ctx();
    struct { int bottleneck; int64_t in, planes; int stride; int64_t shape[4]; } cases[] = {
        {0, 3, 4, 2, {2, 3, 6, 6}}, /* downsample: conv 1x1 stride 2 + bn */
        {0, 4, 4, 1, {2, 4, 4, 5}}, /* identity */
        {1, 4, 2, 2, {2, 4, 6, 5}}, /* Bottleneck, downsample */
        /* not the identity Bottleneck: its 3 BNs and ReLUs in a row curve the loss so much at random
           points that central differences need eps near 1e-4, where fp32 noise swamps them; the
           identity path is BasicBlock's (checked above) and torchvision's Bottleneck checks it below */
    };
    for (int k = 0; k < 3; k++) {
        struct fsdp_module *m;
        if (cases[k].bottleneck)
            ASSERT_OK(fsdp_bottleneck_create(ctx, "", cases[k].in, cases[k].planes, cases[k].stride, &m), ctx);
        else
            ASSERT_OK(fsdp_basic_block_create(ctx, "", cases[k].in, cases[k].planes, cases[k].stride, &m), ctx);
        prepare(ctx, m, 0.3f);
        CHECK((fsdp_module_find_param(m, "downsample.0.weight") != NULL) == (k % 2 == 0));
        CHECK((fsdp_module_find_buffer(m, "downsample.1.running_mean") != NULL) == (k % 2 == 0));
        CHECK(fsdp_module_find_param(m, "conv1.weight") && fsdp_module_find_param(m, "bn2.bias"));
        CHECK((fsdp_module_find_param(m, "conv3.weight") != NULL) == cases[k].bottleneck);
        CHECK(fsdp_module_find_buffer(m, "bn1.num_batches_tracked") != NULL);
        struct fsdp_tensor x = make_input(4, cases[k].shape, 1.0f, 0.0f);
        char name[48];
        snprintf(name, sizeof name, "%s case %d", m->ops->type, k);
        struct gc g = {.name = name, .ctx = ctx, .m = m, .in = &x,
                       .eps = 1e-3, .rtol = 1e-2, .atol = 1e-3, .coords = 40};
        gradcheck(&g);
        free(x.data);
        fsdp_module_free(m);
    }
    fsdp_ctx_free(ctx);
}

/* [Note: unset gradients]: under sharding a parameter's gradient may be
 * marked unset (garbage inside); the first backward must overwrite it, the
 * second add to it. */
/* SwAV's head and its parts: L2Norm (also at a row below eps), BatchNorm on
 * (N, C), the whole head with two prototype heads; its FQNs are VISSL's */
TEST(gradcheck_swav_head) { /* through a BN and normalisation: eps 1e-3, rtol 1e-2, atol 2e-4 */
    rng_seed(11);
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_module *m;
    ASSERT_OK(fsdp_l2norm_create(ctx, "norm", 1e-12f, &m), ctx);
    prepare(ctx, m, 0);
    int64_t s2[2] = {4, 6};
    struct fsdp_tensor x = make_input(2, s2, 1.0f, 0.2f);
    struct gc g = {.name = "L2Norm", .ctx = ctx, .m = m, .in = &x, .eps = 1e-3, .rtol = 1e-2, .atol = 1e-4,
                   .coords = 24};
    gradcheck(&g);
    /* a tiny row is divided by eps, linearly */
    fsdp_module_free(m);
    ASSERT_OK(fsdp_l2norm_create(ctx, "norm", 0.5f, &m), ctx);
    prepare(ctx, m, 0);
    for (int j = 0; j < 6; j++) ((float *)x.data)[j] = 0.01f * (float)(j + 1);
    struct gc g1 = {.name = "L2Norm(eps)", .ctx = ctx, .m = m, .in = &x, .eps = 1e-3, .rtol = 1e-2, .atol = 1e-4,
                    .coords = 24};
    gradcheck(&g1);
    fsdp_module_free(m);
    struct fsdp_batchnorm_opts bo = fsdp_batchnorm_opts_default(6);
    ASSERT_OK(fsdp_batchnorm2d_create(ctx, "bn", &bo, &m), ctx);
    prepare(ctx, m, 0.5f);
    struct gc g2 = {.name = "BatchNorm(N, C)", .ctx = ctx, .m = m, .in = &x, .eps = 1e-2, .rtol = 1e-2,
                    .atol = 2e-4, .coords = 24};
    gradcheck(&g2);
    fsdp_module_free(m);
    free(x.data);
    struct fsdp_swav_head_config hc = {6, 8, 5, 7, 2};
    ASSERT_OK(fsdp_swav_head_create(ctx, "head", &hc, &m), ctx);
    prepare(ctx, m, 0.4f);
    const char *want[] = {"head.projection_head.0.weight", "head.projection_head.0.bias",
                          "head.projection_head.1.weight", "head.projection_head.1.bias",
                          "head.projection_head.3.weight", "head.projection_head.3.bias",
                          "head.prototypes0.weight", "head.prototypes1.weight"};
    struct plist pl = {0};
    fsdp_module_finalize(ctx, m); /* names as a child "head" of a root would have */
    char fq[64];
    fsdp_module_foreach_param(m, collect_param, &pl);
    ASSERT_INT_EQ(pl.n, 8);
    for (int i = 0; i < 8; i++) {
        snprintf(fq, sizeof fq, "head.%s", pl.p[i]->fqn);
        CHECK_STR_EQ(fq, want[i]);
    }
    CHECK(fsdp_module_find_buffer(m, "projection_head.1.running_mean") != NULL);
    int64_t s3[2] = {5, 6};
    x = make_input(2, s3, 1.0f, 0.3f);
    struct fsdp_tensor y = {0};
    fsdp_arena_reset(ctx);
    ASSERT_OK(fsdp_module_forward(m, ctx, &x, &y), ctx);
    ASSERT_INT_EQ(y.ndim, 2);
    ASSERT_INT_EQ(y.shape[1], 5 + 2 * 7);
    for (int i = 0; i < 5; i++) { /* z has unit rows; scores are z . prototype rows */
        double nz = 0, s = 0;
        const float *r = (const float *)y.data + i * 19;
        for (int j = 0; j < 5; j++) nz += (double)r[j] * r[j];
        CHECK_NEAR(nz, 1.0, 1e-5, 1e-6);
        const float *c1 = pl.p[7]->data + 3 * 5; /* prototypes1 row 3 */
        for (int j = 0; j < 5; j++) s += (double)r[j] * c1[j];
        CHECK_NEAR(r[5 + 7 + 3], s, 1e-5, 1e-6);
    }
    struct gc g3 = {.name = "SwAVHead", .ctx = ctx, .m = m, .in = &x, .eps = 1e-3, .rtol = 1e-2, .atol = 2e-4,
                    .coords = 30};
    gradcheck(&g3);
    struct fsdp_swav_head_config bad = hc;
    bad.n_heads = 0;
    struct fsdp_module *m2 = NULL;
    CHECK(fsdp_swav_head_create(ctx, "head", &bad, &m2) == FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "n_heads 0");
    free(x.data);
    fsdp_module_free(m);
    fsdp_ctx_free(ctx);
}

TEST(vision_layers_honour_unset_gradients) {
    rng_seed(9);
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_module *mods[2];
    mods[0] = conv_with(ctx, "conv", 3, 4, 3, 3, 1, 1, 1, 1, 1, 1, 1);
    struct fsdp_batchnorm_opts bo = fsdp_batchnorm_opts_default(3);
    ASSERT_OK(fsdp_batchnorm2d_create(ctx, "bn", &bo, &mods[1]), ctx);
    int64_t shape[4] = {2, 3, 5, 5};
    for (int k = 0; k < 2; k++) {
        struct fsdp_module *m = mods[k];
        ASSERT(m);
        prepare(ctx, m, 0.3f);
        struct fsdp_tensor x = make_input(4, shape, 1.0f, 0.0f);
        float *ref[2] = {0}, *dy = NULL;
        for (int pass = 0; pass < 2; pass++) {
            ASSERT_OK(fsdp_module_zero_grad(ctx, m), ctx);
            for (int i = 0; i < m->n_params && pass == 1; i++) {
                for (int64_t j = 0; j < m->params[i]->numel; j++) m->params[i]->grad[j] = NAN;
                m->params[i]->priv->grad_unset = 1;
            }
            for (int rep = 0; rep < 2; rep++) { /* twice: written, then added */
                fsdp_arena_reset(ctx);
                struct fsdp_tensor y = {0};
                ASSERT_OK(fsdp_module_forward(m, ctx, &x, &y), ctx);
                int64_t ny = fsdp_tensor_numel(&y);
                if (!dy) {
                    dy = malloc((size_t)ny * sizeof(float));
                    for (int64_t i = 0; i < ny; i++) dy[i] = urand();
                }
                struct fsdp_tensor d = y;
                d.data = dy;
                ASSERT_OK(fsdp_module_backward(m, ctx, &d, NULL), ctx);
            }
            for (int i = 0; i < m->n_params; i++) {
                struct fsdp_param *p = m->params[i];
                CHECK_INT_EQ(p->priv->grad_unset, 0);
                if (pass == 0) {
                    ref[i] = malloc((size_t)p->numel * sizeof(float));
                    memcpy(ref[i], p->grad, (size_t)p->numel * sizeof(float));
                } else {
                    double mx;
                    CHECK(max_abs_diff(p->grad, ref[i], p->numel, &mx) <= 1e-6 * mx);
                }
            }
        }
        for (int i = 0; i < 2; i++) free(ref[i]);
        free(dy);
        free(x.data);
        fsdp_module_free(m);
    }
    fsdp_ctx_free(ctx);
}

TEST(vision_layers_reject_bad_input) {
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_module *m;
    struct fsdp_conv2d_opts o = fsdp_conv2d_opts_default(6, 4, 3);
    o.groups = 4;
    CHECK(fsdp_conv2d_create(ctx, "c", &o, &m) == FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "Conv2d 'c'");
    o = fsdp_conv2d_opts_default(3, 4, 3);
    ASSERT_OK(fsdp_conv2d_create(ctx, "conv1", &o, &m), ctx);
    prepare(ctx, m, 0);
    int64_t shape[4] = {2, 1, 8, 8};
    struct fsdp_tensor x = make_input(4, shape, 1.0f, 0.0f), y = {0};
    CHECK(fsdp_module_forward(m, ctx, &x, &y) == FSDP_ERR_INVALID); /* 1 channel into 3 */
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "1 channels, expected 3");
    fsdp_module_free(m);
    struct fsdp_batchnorm_opts bo = fsdp_batchnorm_opts_default(1);
    ASSERT_OK(fsdp_batchnorm2d_create(ctx, "bn", &bo, &m), ctx);
    prepare(ctx, m, 0);
    int64_t one[4] = {1, 1, 1, 1};
    struct fsdp_tensor x1 = make_input(4, one, 1.0f, 0.0f), y1 = {0};
    CHECK(fsdp_module_forward(m, ctx, &x1, &y1) == FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "more than 1 value per channel");
    fsdp_module_set_training(m, 0);
    CHECK_OK(fsdp_module_forward(m, ctx, &x1, &y1), ctx); /* eval: fine */
    int n = 0;
    fsdp_batchnorm_set_sync(m, 1, NULL, &n);
    CHECK_INT_EQ(n, 1);
    fsdp_module_free(m);
    CHECK(fsdp_maxpool2d_create(ctx, "mp", 3, 2, 2, &m) == FSDP_ERR_INVALID);
    /* BLOCKED16: refused by a module that takes PLAIN only, and where the channels are not a multiple of
       16; a gradient in another layout than the output's is refused */
    int64_t s20[4] = {2, 20, 3, 3}, s16[4] = {2, 16, 3, 3};
    struct fsdp_tensor xb = make_input(4, s20, 1.0f, 0.0f), yb = {0};
    xb.layout = FSDP_LAYOUT_BLOCKED16;
    bo = fsdp_batchnorm_opts_default(20);
    ASSERT_OK(fsdp_batchnorm2d_create(ctx, "bn20", &bo, &m), ctx);
    prepare(ctx, m, 0);
    CHECK(fsdp_module_forward(m, ctx, &xb, &yb) == FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "multiple of 16");
    fsdp_module_free(m);
    xb.shape[1] = 16;
    ASSERT_OK(fsdp_flatten_create(ctx, "flat", &m), ctx);
    prepare(ctx, m, 0);
    yb = (struct fsdp_tensor){0};
    CHECK(fsdp_module_forward(m, ctx, &xb, &yb) == FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "Flatten '(root)': input in the BLOCKED16 layout");
    fsdp_module_free(m);
    o = fsdp_conv2d_opts_default(16, 16, 1);
    o.out_layout = FSDP_LAYOUT_BLOCKED16;
    ASSERT_OK(fsdp_conv2d_create(ctx, "cb", &o, &m), ctx);
    prepare(ctx, m, 0);
    struct fsdp_tensor x16 = make_input(4, s16, 1.0f, 0.0f);
    yb = (struct fsdp_tensor){0};
    ASSERT_OK(fsdp_module_forward(m, ctx, &x16, &yb), ctx);
    CHECK_INT_EQ((int)yb.layout, (int)FSDP_LAYOUT_BLOCKED16);
    struct fsdp_tensor dyb = yb, dxb = {0};
    dyb.layout = FSDP_LAYOUT_PLAIN;
    CHECK(fsdp_module_backward(m, ctx, &dyb, &dxb) == FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "Conv2d '(root)': gradient in the PLAIN layout, the output was BLOCKED16");
    fsdp_module_free(m);
    free(xb.data);
    free(x16.data);
    free(x.data);
    free(x1.data);
    fsdp_ctx_free(ctx);
}

/* ---- PyTorch reference (skipped where torch is missing) ---- */

static void json_shape(FILE *f, const char *key, int ndim, const int64_t *shape) {
    fprintf(f, "\"%s\": [", key);
    for (int d = 0; d < ndim; d++) fprintf(f, "%s%lld", d ? ", " : "", (long long)shape[d]);
    fprintf(f, "]");
}

/* Runs module m for `steps` train steps (fresh input and dy each) and one eval
 * forward, writing case `id`'s files and its JSON entry: spec is the
 * module's constructor arguments for the script. */
static void ref_case_nd(FILE *js, const char *dir, int id, struct fsdp_ctx *ctx, struct fsdp_module *m,
                        const char *spec, int ndim, const int64_t *shape, int steps, int distinct) {
    char name[128];
    struct plist pl = {0};
    struct blist bl = {0};
    fsdp_module_foreach_param(m, collect_param, &pl);
    fsdp_module_foreach_buffer(m, collect_buffer, &bl);
    fprintf(js, "%s {\"spec\": %s, ", id ? "," : "", spec);
    json_shape(js, "shape", ndim, shape);
    fprintf(js, ", \"steps\": %d, \"params\": [", steps);
    for (int i = 0; i < pl.n; i++) {
        snprintf(name, sizeof name, "c%d_p%d.bin", id, i);
        CHECK(test_write_file(dir, name, pl.p[i]->data, (size_t)pl.p[i]->numel * sizeof(float)));
        fprintf(js, "%s\"%s\"", i ? ", " : "", pl.p[i]->fqn);
    }
    fprintf(js, "], \"buffers\": [");
    for (int i = 0; i < bl.n; i++) fprintf(js, "%s\"%s\"", i ? ", " : "", bl.b[i]->fqn);
    fprintf(js, "]}\n");
    for (int s = 0; s <= steps; s++) { /* s == steps: eval */
        fsdp_module_set_training(m, s < steps);
        struct fsdp_tensor x = distinct ? make_distinct(ndim, shape, 0.01f) : make_input(ndim, shape, 1.5f, 0.5f);
        struct fsdp_tensor y = {0}, dx = {0};
        fsdp_arena_reset(ctx);
        if (fsdp_module_zero_grad(ctx, m) != FSDP_OK || fsdp_module_forward(m, ctx, &x, &y) != FSDP_OK) {
            TEST_FAILF("case %d: %s", id, fsdp_errmsg(ctx));
            free(x.data);
            return;
        }
        int64_t nx = fsdp_tensor_numel(&x), ny = fsdp_tensor_numel(&y);
        snprintf(name, sizeof name, "c%d_s%d_x.bin", id, s);
        CHECK(test_write_file(dir, name, x.data, (size_t)nx * sizeof(float)));
        snprintf(name, sizeof name, "c%d_s%d_y.bin", id, s);
        CHECK(test_write_file(dir, name, y.data, (size_t)ny * sizeof(float)));
        float *dy = malloc((size_t)ny * sizeof(float));
        for (int64_t i = 0; i < ny; i++) dy[i] = urand();
        snprintf(name, sizeof name, "c%d_s%d_dy.bin", id, s);
        CHECK(test_write_file(dir, name, dy, (size_t)ny * sizeof(float)));
        struct fsdp_tensor d = y;
        d.data = dy;
        if (fsdp_module_backward(m, ctx, &d, &dx) != FSDP_OK) TEST_FAILF("case %d: %s", id, fsdp_errmsg(ctx));
        snprintf(name, sizeof name, "c%d_s%d_dx.bin", id, s);
        CHECK(test_write_file(dir, name, dx.data, (size_t)nx * sizeof(float)));
        for (int i = 0; i < pl.n; i++) {
            snprintf(name, sizeof name, "c%d_s%d_g%d.bin", id, s, i);
            CHECK(test_write_file(dir, name, pl.p[i]->grad, (size_t)pl.p[i]->numel * sizeof(float)));
        }
        for (int i = 0; i < bl.n; i++) {
            snprintf(name, sizeof name, "c%d_s%d_b%d.bin", id, s, i);
            CHECK(test_write_file(dir, name, bl.b[i]->data, (size_t)bl.b[i]->numel * fsdp_dtype_size(bl.b[i]->dtype)));
        }
        free(dy);
        free(x.data);
    }
}

static void ref_case(FILE *js, const char *dir, int id, struct fsdp_ctx *ctx, struct fsdp_module *m, const char *spec,
                     const int64_t *shape, int steps, int distinct) {
    ref_case_nd(js, dir, id, ctx, m, spec, 4, shape, steps, distinct);
}

TEST(vision_layers_match_pytorch) {
    if (system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0) {
        test_skip("/usr/bin/python3 cannot import torch");
        return;
    }
    char script[4200];
    if (!test_find_file("torch_vision_ref.py", script, sizeof script)) {
        test_skip("tests/torch_vision_ref.py not found");
        return;
    }
    rng_seed(7);
    struct fsdp_ctx *ctx = make_ctx();
    char dir[] = "/tmp/fsdp_torch_vision_XXXXXX";
    ASSERT(mkdtemp(dir));
    char path[1024];
    snprintf(path, sizeof path, "%s/index.json", dir);
    FILE *js = fopen(path, "w");
    ASSERT(js);
    fprintf(js, "[\n");
    int id = 0;
    struct fsdp_module *m;
    /* Conv2d: 3x3 padded with bias; strided dilated grouped rectangular without; 1x1 stride 2; 7x7 stem */
    m = conv_with(ctx, "conv", 3, 8, 3, 3, 1, 1, 1, 1, 1, 1, 1);
    prepare(ctx, m, 0.3f);
    int64_t s1[4] = {2, 3, 9, 9};
    ref_case(js, dir, id++, ctx, m, "{\"kind\": \"conv\", \"in\": 3, \"out\": 8, \"k\": [3, 3], \"s\": [1, 1], "
             "\"p\": [1, 1], \"d\": [1, 1], \"g\": 1, \"bias\": true}", s1, 1, 0);
    fsdp_module_free(m);
    m = conv_with(ctx, "conv", 4, 6, 3, 2, 2, 1, 2, 0, 2, 2, 0);
    prepare(ctx, m, 0.3f);
    int64_t s2[4] = {3, 4, 10, 9};
    ref_case(js, dir, id++, ctx, m, "{\"kind\": \"conv\", \"in\": 4, \"out\": 6, \"k\": [3, 2], \"s\": [2, 1], "
             "\"p\": [2, 0], \"d\": [2, 2], \"g\": 2, \"bias\": false}", s2, 1, 0);
    fsdp_module_free(m);
    m = conv_with(ctx, "conv", 8, 16, 1, 1, 2, 2, 0, 0, 1, 1, 0);
    prepare(ctx, m, 0.3f);
    int64_t s3[4] = {2, 8, 7, 7};
    ref_case(js, dir, id++, ctx, m, "{\"kind\": \"conv\", \"in\": 8, \"out\": 16, \"k\": [1, 1], \"s\": [2, 2], "
             "\"p\": [0, 0], \"d\": [1, 1], \"g\": 1, \"bias\": false}", s3, 1, 0);
    fsdp_module_free(m);
    m = conv_with(ctx, "conv", 1, 8, 7, 7, 2, 2, 3, 3, 1, 1, 0);
    prepare(ctx, m, 0.3f);
    int64_t s4[4] = {2, 1, 28, 28};
    ref_case(js, dir, id++, ctx, m, "{\"kind\": \"conv\", \"in\": 1, \"out\": 8, \"k\": [7, 7], \"s\": [2, 2], "
             "\"p\": [3, 3], \"d\": [1, 1], \"g\": 1, \"bias\": false}", s4, 1, 0);
    fsdp_module_free(m);
    /* BatchNorm2d: 3 train steps, then eval */
    struct fsdp_batchnorm_opts bo = fsdp_batchnorm_opts_default(5);
    ASSERT_OK(fsdp_batchnorm2d_create(ctx, "bn", &bo, &m), ctx);
    prepare(ctx, m, 0.3f);
    int64_t s5[4] = {4, 5, 6, 6};
    ref_case(js, dir, id++, ctx, m, "{\"kind\": \"bn\", \"c\": 5, \"eps\": 1e-5, \"momentum\": 0.1}", s5, 3, 0);
    fsdp_module_free(m);
    ASSERT_OK(fsdp_relu_create(ctx, "relu", &m), ctx);
    prepare(ctx, m, 0);
    ref_case(js, dir, id++, ctx, m, "{\"kind\": \"relu\"}", s5, 1, 1);
    fsdp_module_free(m);
    ASSERT_OK(fsdp_maxpool2d_create(ctx, "mp", 3, 2, 1, &m), ctx);
    prepare(ctx, m, 0);
    int64_t s6[4] = {2, 3, 11, 10};
    ref_case(js, dir, id++, ctx, m, "{\"kind\": \"maxpool\", \"k\": 3, \"s\": 2, \"p\": 1}", s6, 1, 1);
    fsdp_module_free(m);
    ASSERT_OK(fsdp_global_avgpool2d_create(ctx, "ap", &m), ctx);
    prepare(ctx, m, 0);
    ref_case(js, dir, id++, ctx, m, "{\"kind\": \"avgpool\"}", s6, 1, 0);
    fsdp_module_free(m);
    ASSERT_OK(fsdp_flatten_create(ctx, "fl", &m), ctx);
    prepare(ctx, m, 0);
    ref_case(js, dir, id++, ctx, m, "{\"kind\": \"flatten\"}", s6, 1, 0);
    fsdp_module_free(m);
    /* torchvision's BasicBlock, with and without downsample: 2 train steps, then eval */
    ASSERT_OK(fsdp_basic_block_create(ctx, "", 4, 6, 2, &m), ctx);
    prepare(ctx, m, 0.3f);
    int64_t s7[4] = {3, 4, 8, 7};
    ref_case(js, dir, id++, ctx, m, "{\"kind\": \"basicblock\", \"inplanes\": 4, \"planes\": 6, \"stride\": 2}", s7,
             2, 0);
    fsdp_module_free(m);
    ASSERT_OK(fsdp_basic_block_create(ctx, "", 5, 5, 1, &m), ctx);
    prepare(ctx, m, 0.3f);
    ref_case(js, dir, id++, ctx, m, "{\"kind\": \"basicblock\", \"inplanes\": 5, \"planes\": 5, \"stride\": 1}", s5,
             2, 0);
    fsdp_module_free(m);
    ASSERT_OK(fsdp_bottleneck_create(ctx, "", 4, 3, 2, &m), ctx);
    prepare(ctx, m, 0.3f);
    ref_case(js, dir, id++, ctx, m, "{\"kind\": \"bottleneck\", \"inplanes\": 4, \"planes\": 3, \"stride\": 2}", s7,
             2, 0);
    fsdp_module_free(m);
    ASSERT_OK(fsdp_bottleneck_create(ctx, "", 8, 2, 1, &m), ctx);
    prepare(ctx, m, 0.3f);
    int64_t s8[4] = {2, 8, 4, 4};
    ref_case(js, dir, id++, ctx, m, "{\"kind\": \"bottleneck\", \"inplanes\": 8, \"planes\": 2, \"stride\": 1}", s8,
             2, 0);
    fsdp_module_free(m);
    /* SwAV's head and its parts on (N, C): BatchNorm1d, L2Norm, the whole head (two heads) */
    struct fsdp_batchnorm_opts b1 = fsdp_batchnorm_opts_default(6);
    ASSERT_OK(fsdp_batchnorm2d_create(ctx, "", &b1, &m), ctx);
    prepare(ctx, m, 0.5f);
    int64_t s9[2] = {5, 6};
    ref_case_nd(js, dir, id++, ctx, m, "{\"kind\": \"bn1d\", \"c\": 6, \"eps\": 1e-5, \"momentum\": 0.1}", 2, s9, 3,
                0);
    fsdp_module_free(m);
    ASSERT_OK(fsdp_l2norm_create(ctx, "", 1e-12f, &m), ctx);
    prepare(ctx, m, 0);
    ref_case_nd(js, dir, id++, ctx, m, "{\"kind\": \"l2norm\"}", 2, s9, 1, 0);
    fsdp_module_free(m);
    struct fsdp_swav_head_config hc = {7, 9, 5, 4, 2};
    ASSERT_OK(fsdp_swav_head_create(ctx, "", &hc, &m), ctx);
    prepare(ctx, m, 0.4f);
    int64_t s10[2] = {6, 7};
    ref_case_nd(js, dir, id++, ctx, m, "{\"kind\": \"swavhead\", \"in\": 7, \"hidden\": 9, \"out\": 5, \"k\": 4, "
                "\"heads\": 2}", 2, s10, 2, 0);
    fsdp_module_free(m);
    hc.hidden_dim = 0;
    hc.n_heads = 1;
    ASSERT_OK(fsdp_swav_head_create(ctx, "", &hc, &m), ctx);
    prepare(ctx, m, 0.4f);
    ref_case_nd(js, dir, id++, ctx, m, "{\"kind\": \"swavhead\", \"in\": 7, \"hidden\": 0, \"out\": 5, \"k\": 4, "
                "\"heads\": 1}", 2, s10, 1, 0);
    fsdp_module_free(m);
    fprintf(js, "]\n");
    CHECK(fclose(js) == 0);
    char cmd[8600];
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 '%s' '%s'", script, dir);
    fflush(NULL);
    int rc = system(cmd);
    if (rc != 0) TEST_FAILF("%s exited with status %d (data kept in %s)", cmd, rc, dir);
    else {
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        CHECK(system(cmd) == 0);
    }
    fsdp_ctx_free(ctx);
}

TEST_MAIN()
