/*
 * test_nn_batchnorm.c - BatchNorm2d's statistics (src/nn/batchnorm.c): the
 * update switch, reset and cumulative averages, running statistics and eval
 * mode against formulas, and sums in a fixed order whatever the thread
 * count. Its gradients are checked with the other vision layers' in
 * test_nn_vision.c.
 */
#include "fsdp.h"
#include "harness.h"
#include "nn_helpers.h"
#include "vision_helpers.h"

#include <omp.h>

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

TEST_MAIN()
