/*
 * test_nn_vision.c - the vision layers of src/nn (Conv2d, BatchNorm2d, ReLU,
 * MaxPool2d, AdaptiveAvgPool2d, Flatten): finite-difference gradient checks
 * of every layer (input and parameter gradients, as test_nn.c's [Note: FD
 * checks]: loss sum(out * r) in double, central differences), also through
 * residual blocks and the SwAV head, unset gradients, input errors, and,
 * where Debian's PyTorch is installed, every layer forward and backward
 * against torch (tests/torch_vision_ref.py), with BN's running statistics
 * after 3 steps. BatchNorm's statistics: test_nn_batchnorm.c; 16 bits and
 * the blocked layout: test_nn_vision_lp.c; shared helpers: vision_helpers.h.
 */
#include "core/core-impl.h"
#include "fsdp.h"
#include "harness.h"
#include "nn_helpers.h"
#include "plist.h"
#include "vision_helpers.h"

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
    plist_free(&pl);
    free(dx);
    free(dy);
    free(g->r);
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
    plist_free(&pl);
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
            break;
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
    plist_free(&pl);
    blist_free(&bl);
}

static void ref_case(FILE *js, const char *dir, int id, struct fsdp_ctx *ctx, struct fsdp_module *m, const char *spec,
                     const int64_t *shape, int steps, int distinct) {
    ref_case_nd(js, dir, id, ctx, m, spec, 4, shape, steps, distinct);
}

TEST(vision_layers_match_pytorch) {
    char script[4200];
    if (!test_python_ref("torch", "torch_vision_ref.py", script, sizeof script)) return;
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
    test_run_python_ref(script, dir);
    fsdp_ctx_free(ctx);
}

TEST_MAIN()
