/*
 * test_nn_vision_lp.c - the vision layers in 16 bits and in the blocked
 * layout: the 16-bit convolution against the fp32 one on rounded operands,
 * BLOCKED16 activations giving the plain layout's bits, and the 16-bit
 * hand-off between layers giving the cast's bits; SwAV's head's 16-bit
 * prototypes keeping their input. tests/run.sh runs it
 * twice: bf16 products native where the CPU has them, and widened.
 */
#include "fsdp.h"
#include "harness.h"
#include "nn_helpers.h"
#include "nn/nn-impl.h"
#include "plist.h"
#include "vision_helpers.h"

/* 16-bit compute: BF16 (native where the CPU has it, else widened) and F16
 * (widened) against the fp32 convolution of the rounded operands; the
 * widened path equals it up to summation order. The output is within 1e-2
 * of the fp32 convolution of the unrounded ones. */
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
        float *y16 = malloc((size_t)ny * sizeof(float)); /* for the exact comparison below */
        memcpy(y16, y.data, (size_t)ny * sizeof(float));
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
        /* and far from fp32's exact values only by rounding: within 1e-2
         * relative of ref's fp32 output on the unrounded input and weights */
        memcpy(ref->params[0]->data, m->params[0]->data, (size_t)nw * sizeof(float));
        fsdp_arena_reset(ctx);
        struct fsdp_tensor ye = {0};
        ASSERT_OK(fsdp_module_forward(ref, ctx, &x, &ye), ctx);
        double de = max_abs_diff(y16, ye.data, ny, &mx);
        if (!(de <= 1e-2 * mx))
            TEST_FAILF("%s, %lldx%lld: %g from fp32's output (max %g)", fsdp_dtype_name(dts[k % 2]),
                       (long long)hw[k / 2], (long long)hw[k / 2], de, mx);
        free(y16);
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
    plist_free(&pl);
    blist_free(&bl);
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

/* [Note: prototypes' input in their dtype] (src/models/swav_head.c): SwAV's
 * head with its prototype layers computing in 16 bits keeps the rounded
 * embedding they read below the scores it releases: the arena written over
 * between forward and backward (here with NaN) leaves each prototype's
 * weight gradient round(ds)^T round(z), z as the output holds it. */
TEST(swav_head_16bit_prototypes_keep_their_input) {
    rng_seed(9);
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_swav_head_config hc = {6, 0, 5, 7, 2};
    struct fsdp_module *m;
    ASSERT_OK(fsdp_swav_head_create(ctx, "head", &hc, &m), ctx);
    prepare(ctx, m, 0.4f);
    ASSERT_OK(fsdp_module_set_compute_dtype(ctx, m, FSDP_BF16), ctx);
    ASSERT_OK(fsdp_module_zero_grad(ctx, m), ctx);
    enum { N = 4, D = 5, K = 7, W = D + 2 * K };
    int64_t s2[2] = {N, 6};
    struct fsdp_tensor x = make_input(2, s2, 1.0f, 0.3f), y = {0}, dx = {0};
    fsdp_arena_reset(ctx);
    ASSERT_OK(fsdp_module_forward(m, ctx, &x, &y), ctx);
    ASSERT_INT_EQ(y.shape[1], W);
    float *junk = fsdp__scratch(ctx, 4096, "junk");
    ASSERT(junk != NULL);
    for (int i = 0; i < 4096; i++) junk[i] = NAN;
    float g[N * W];
    for (int i = 0; i < N * W; i++) g[i] = 0.1f * (float)((i * 7) % 11) - 0.5f;
    struct fsdp_tensor d = {g, FSDP_F32, 2, {N, W}, FSDP_LAYOUT_PLAIN};
    ASSERT_OK(fsdp_module_backward(m, ctx, &d, &dx), ctx);
    const float *yd = y.data;
    for (int j = 0; j < 2; j++) {
        char fqn[32];
        snprintf(fqn, sizeof fqn, "prototypes%d.weight", j);
        const float *gw = fsdp_module_find_param(m, fqn)->grad;
        float ref[K * D];
        for (int k = 0; k < K; k++)
            for (int e = 0; e < D; e++) {
                double a = 0;
                for (int n = 0; n < N; n++)
                    a += (double)fsdp__bf16_to_f32(fsdp__f32_to_bf16(g[n * W + D + j * K + k])) *
                         fsdp__bf16_to_f32(fsdp__f32_to_bf16(yd[n * W + e]));
                ref[k * D + e] = (float)a;
            }
        double mx;
        double diff = max_abs_diff(gw, ref, K * D, &mx);
        if (!(diff <= 1e-5 * mx)) TEST_FAILF("prototypes%d: weight gradient off by %g (max %g)", j, diff, mx);
    }
    free(x.data);
    fsdp_module_free(m);
    fsdp_ctx_free(ctx);
}

TEST_MAIN()
