/*
 * test_mpi_vision.c - SyncBatchNorm across ranks, run by tests/run.sh at 1,
 * 2, 3 and 4 ranks: every rank holds a contiguous share of one global batch
 * (uneven at 4 ranks), runs a synchronised BatchNorm2d on it for 3 train
 * steps, and compares with a local BatchNorm2d on the whole batch (the 1-rank
 * run): outputs and input gradients of its share, running statistics and
 * num_batches_tracked, and the weight and bias gradients summed over ranks.
 * Then eval mode, which uses the running statistics and communicates nothing.
 */
#include "fsdp.h"
#include "harness.h"

#include <math.h>
#include <mpi.h>
#include <stdlib.h>
#include <string.h>

#include "mpi_harness.h"

static uint64_t rng_state = 88172645463325252ull;
static float urand(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (float)((double)(rng_state >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static int param_values(struct fsdp_param *p, void *ud) {
    (void)ud;
    for (int64_t i = 0; i < p->numel; i++) p->data[i] = (p->init.kind == FSDP_INIT_ONES ? 1.0f : 0.0f) + 0.3f * urand();
    return 0;
}

static struct fsdp_module *make_bn(struct fsdp_ctx *c, int sync, int64_t C) {
    struct fsdp_batchnorm_opts o = fsdp_batchnorm_opts_default(C);
    o.sync = sync;
    struct fsdp_module *m = NULL;
    if (fsdp_batchnorm2d_create(c, "bn", &o, &m) != FSDP_OK || fsdp_module_finalize(c, m) != FSDP_OK ||
        fsdp_module_materialize(c, m, 3) != FSDP_OK)
        abort();
    rng_state = 12345; /* the same values on every rank and in both modules */
    fsdp_module_foreach_param(m, param_values, NULL);
    return m;
}

static double rel_diff(const float *a, const float *b, int64_t n) {
    double mx;
    double d = max_abs_diff(a, b, n, &mx);
    return d / (mx > 0 ? mx : 1.0);
}

TEST(sync_batchnorm_matches_one_rank) {
    struct fsdp_ctx *c = get_ctx();
    int rank = fsdp_ctx_rank(c), world = fsdp_ctx_world(c);
    enum { N = 6, C = 3, H = 4, W = 5, HW = H * W };
    struct fsdp_module *sync = make_bn(c, 1, C), *full = make_bn(c, 0, C);
    int64_t lo = (int64_t)rank * N / world, hi = (int64_t)(rank + 1) * N / world, nl = hi - lo;
    static float x[N * C * HW], dy[N * C * HW];
    for (int step = 0; step < 4; step++) { /* steps 0-2 train, 3 eval */
        int train = step < 3;
        fsdp_module_set_training(sync, train);
        fsdp_module_set_training(full, train);
        rng_state = 777 + (uint64_t)step; /* the global batch, the same on every rank */
        for (int i = 0; i < N * C * HW; i++) {
            x[i] = 2.0f * urand() + (float)(i % C) - 1.0f;
            dy[i] = urand();
        }
        fsdp_arena_reset(c);
        ASSERT_OK(fsdp_module_zero_grad(c, sync), c);
        ASSERT_OK(fsdp_module_zero_grad(c, full), c);
        struct fsdp_tensor xf = {.data = x, .dtype = FSDP_F32, .ndim = 4, .shape = {N, C, H, W}};
        struct fsdp_tensor xs = {.data = x + lo * C * HW, .dtype = FSDP_F32, .ndim = 4, .shape = {nl, C, H, W}};
        struct fsdp_tensor yf = {0}, ys = {0}, dxf = {0}, dxs = {0};
        ASSERT_OK(fsdp_module_forward(full, c, &xf, &yf), c);
        ASSERT_OK(fsdp_module_forward(sync, c, &xs, &ys), c);
        float *yfv = yf.data;
        double d = rel_diff(ys.data, yfv + lo * C * HW, nl * C * HW);
        if (!(d <= 1e-6)) TEST_FAILF("step %d: output differs from the 1-rank one by %.3g (relative)", step, d);
        struct fsdp_tensor dyf = yf, dys = ys;
        dyf.data = dy;
        dys.data = dy + lo * C * HW;
        ASSERT_OK(fsdp_module_backward(full, c, &dyf, &dxf), c);
        ASSERT_OK(fsdp_module_backward(sync, c, &dys, &dxs), c);
        d = rel_diff(dxs.data, (float *)dxf.data + lo * C * HW, nl * C * HW);
        if (!(d <= 1e-5)) TEST_FAILF("step %d: input gradient differs by %.3g (relative)", step, d);
        for (int p = 0; p < 2; p++) { /* weight, bias: each rank's share sums to the 1-rank gradient */
            float g[C];
            MPI_Allreduce(sync->params[p]->grad, g, C, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            d = rel_diff(g, full->params[p]->grad, C);
            if (!(d <= 1e-5)) TEST_FAILF("step %d: %s gradient differs by %.3g (relative)", step,
                                         sync->params[p]->name, d);
        }
        for (int b = 0; b < 2; b++) {
            d = rel_diff(sync->buffers[b]->data, full->buffers[b]->data, C);
            if (!(d <= 1e-6)) TEST_FAILF("step %d: %s differs by %.3g (relative)", step, sync->buffers[b]->name, d);
        }
        CHECK_INT_EQ(((int64_t *)sync->buffers[2]->data)[0], train ? step + 1 : 3);
        CHECK_INT_EQ(((int64_t *)full->buffers[2]->data)[0], train ? step + 1 : 3);
    }
    /* eval mode is local: ranks may run it a different number of times */
    fsdp_module_set_training(sync, 0);
    struct fsdp_tensor xs = {.data = x, .dtype = FSDP_F32, .ndim = 4, .shape = {1, C, H, W}}, ys = {0};
    for (int k = 0; k <= rank; k++) ASSERT_OK(fsdp_module_forward(sync, c, &xs, &ys), c);
    fsdp_module_free(sync);
    fsdp_module_free(full);
}

/* [Note: fp32 modules]: under AMP_BF16 a BatchNorm2d inside a bf16 unit gets
 * an fp32 unit of its own, so its weight is not rounded to bf16 (a weight of
 * 1 + 2^-12, not a bf16 value, must act as itself); under FP32 no extra unit. */
TEST(batchnorm_keeps_fp32_parameters_under_bf16) {
    struct fsdp_ctx *c = get_ctx();
    enum { C = 3, HW = 4 };
    for (int prec = 0; prec < 2; prec++) {
        struct fsdp_module *root = NULL, *conv = NULL, *bn = NULL;
        ASSERT_OK(fsdp_sequential_create(c, "", &root), c);
        struct fsdp_conv2d_opts co = fsdp_conv2d_opts_default(C, C, 1);
        ASSERT_OK(fsdp_conv2d_create(c, "0", &co, &conv), c);
        ASSERT_OK(fsdp_module_add_child(c, root, conv), c);
        struct fsdp_batchnorm_opts bo = fsdp_batchnorm_opts_default(C);
        ASSERT_OK(fsdp_batchnorm2d_create(c, "1", &bo, &bn), c);
        ASSERT_OK(fsdp_module_add_child(c, root, bn), c);
        ASSERT_OK(fsdp_module_finalize(c, root), c);
        struct fsdp_shard_opts so = fsdp_shard_opts_default();
        so.wrap = NULL; /* one unit for everything... */
        so.precision = prec ? FSDP_BF16 : FSDP_F32;
        struct fsdp_model *fm = NULL;
        ASSERT_OK(fsdp_fully_shard(c, root, &so, &fm), c);
        ASSERT_OK(fsdp_model_init_params(c, fm, 5), c);
        /* ...but the batch norm's own under bf16, wholly fp32 */
        CHECK_INT_EQ(fsdp_model_n_units(fm), prec ? 2 : 1);
        int bn_unit = -1;
        for (int i = 0; i < fsdp_model_n_units(fm); i++) {
            struct fsdp_unit_info ui;
            struct fsdp_unit_precision up;
            fsdp_model_unit_info(fm, i, &ui);
            fsdp_model_unit_precision(fm, i, &up);
            if (!strcmp(ui.fqn, "1")) {
                bn_unit = i;
                CHECK_INT_EQ(up.param_dtype, FSDP_F32);
                CHECK_INT_EQ(up.compute_dtype, FSDP_F32);
            } else {
                CHECK_INT_EQ(up.param_dtype, prec ? FSDP_BF16 : FSDP_F32);
            }
        }
        CHECK(prec ? bn_unit > 0 : bn_unit < 0);
        /* weight 1 + 2^-12, bias 2^-13: eval output = conv(x) / sqrt(1 + eps) w + b, in fp32 */
        ASSERT_OK(fsdp_summon_full_params(c, fm, bn, 1, 0), c);
        for (int i = 0; i < C; i++) bn->params[0]->data[i] = 1.0f + 0x1p-12f, bn->params[1]->data[i] = 0x1p-13f;
        ASSERT_OK(fsdp_summon_end(c, fm), c);
        fsdp_module_set_training(root, 0);
        static float x[2 * C * HW];
        for (int i = 0; i < 2 * C * HW; i++) x[i] = (float)(i % 7) * 0.25f - 0.5f;
        struct fsdp_tensor xt = {.data = x, .dtype = FSDP_F32, .ndim = 4, .shape = {2, C, 2, 2}}, y = {0};
        ASSERT_OK(fsdp_model_forward_tensor(c, fm, &xt, &y), c);
        /* the conv alone, for the reference: the same conv in eval mode on the same input */
        static float yc[2 * C * HW], yo[2 * C * HW];
        memcpy(yo, y.data, sizeof yo);
        ASSERT_OK(fsdp_summon_full_params(c, fm, root, 0, 0), c);
        struct fsdp_tensor t = {0};
        fsdp_arena_reset(c);
        ASSERT_OK(fsdp_module_forward(conv, c, &xt, &t), c);
        memcpy(yc, t.data, sizeof yc);
        ASSERT_OK(fsdp_summon_end(c, fm), c);
        double worst = 0;
        for (int i = 0; i < 2 * C * HW; i++) {
            double want = (double)yc[i] / sqrt(1.0 + 1e-5) * (1.0 + 0x1p-12) + 0x1p-13;
            double d = fabs(yo[i] - want);
            worst = d > worst || d != d ? d : worst;
        }
        /* rounding the weight to bf16 (1.0) would be off by |y| 2^-12, about 1e-4 here */
        if (!(worst <= 2e-6)) TEST_FAILF("precision %d: batch norm output off by %g", prec, worst);
        fsdp_model_free(fm);
        fsdp_module_free(root);
    }
}

TEST_MAIN()
