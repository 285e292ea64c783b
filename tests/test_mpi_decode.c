/*
 * test_mpi_decode.c - decoding with a cache of keys and values
 * (fsdp_gpt_set_cache; [Note: decoding cache] in src/nn/attention.c), run by
 * tests/run.sh at 1, 2, 3 and 4 ranks: every decoding step's logits against
 * the last row of a full eval forward of the whole prefix on a second model
 * made the same way (fp32 and AMP_BF16, prompts of several positions, steps
 * of one and of several), and the errors of a misused cache.
 */
#include "fsdp.h"
#include "harness.h"

#include <math.h>
#include <mpi.h>
#include <stdlib.h>
#include <string.h>

#include "mpi_harness.h"

struct run {
    struct fsdp_module *g;
    struct fsdp_optim *opt;
    struct fsdp_model *fm;
};

static struct fsdp_gpt_config cfg(void) {
    struct fsdp_gpt_config c;
    fsdp_gpt_config_preset("tiny", &c); /* 2 layers, 2 heads of 16, vocab 256, block 64 */
    return c;
}

static enum fsdp_status run_create(struct fsdp_ctx *c, enum fsdp_dtype prec, struct run *r) {
    struct fsdp_gpt_config gc = cfg();
    memset(r, 0, sizeof *r);
    enum fsdp_status st = fsdp_gpt_create(c, &gc, &r->g);
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    if (st == FSDP_OK) st = fsdp_optim_create(c, &oo, &r->opt);
    if (st != FSDP_OK) return st;
    struct fsdp_parallel_config pc = fsdp_parallel_config_default();
    pc.seed = 7;
    return fsdp_parallelize_model(c, r->g, &pc, r->opt, prec, NULL, NULL, NULL, &r->fm);
}

static void run_free(struct run *r) {
    fsdp_model_free(r->fm);
    fsdp_optim_free(r->opt);
    fsdp_module_free(r->g);
}

enum { NB = 3, LEN = 40 };

/* tokens (NB, LEN), the same on every rank */
static int32_t token(int b, int t) { return (int32_t)((b * 131 + t * 17 + (t * t) % 7 + 3) % 256); }

/* Largest |decoded - full| over the steps, and the largest |full| logit:
 * the prompt of `prompt` positions, then steps of `step` positions to LEN.
 * A forward failing sets *failed. */
static void decode_vs_full(struct fsdp_ctx *c, enum fsdp_dtype prec, int prompt, int step, double *diff,
                           double *scale, int *failed) {
    struct run dec, full;
    *diff = *scale = 0;
    *failed = 1;
    if (run_create(c, prec, &dec) != FSDP_OK || run_create(c, prec, &full) != FSDP_OK) return;
    fsdp_module_set_training(dec.g, 0);
    fsdp_module_set_training(full.g, 0);
    int64_t V = cfg().vocab_size;
    int32_t *in = malloc(sizeof(int32_t) * NB * LEN);
    float *got = malloc(sizeof(float) * NB * V);
    if (fsdp_gpt_set_cache(c, dec.g, NB, LEN) != FSDP_OK) goto out;
    for (int len = 0; len < LEN;) {
        int n = len == 0 ? prompt : (LEN - len < step ? LEN - len : step);
        for (int b = 0; b < NB; b++)
            for (int t = 0; t < n; t++) in[b * n + t] = token(b, len + t);
        struct fsdp_tensor x = {in, FSDP_I32, 2, {NB, n}, FSDP_LAYOUT_PLAIN}, y = {0};
        if (fsdp_model_forward_tensor(c, dec.fm, &x, &y) != FSDP_OK) goto out;
        if (y.ndim != 3 || y.shape[0] != NB || y.shape[1] != 1 || y.shape[2] != V) goto out;
        memcpy(got, y.data, sizeof(float) * NB * V);
        len += n;
        for (int b = 0; b < NB; b++)
            for (int t = 0; t < len; t++) in[b * len + t] = token(b, t);
        struct fsdp_tensor xf = {in, FSDP_I32, 2, {NB, len}, FSDP_LAYOUT_PLAIN}, yf = {0};
        if (fsdp_model_forward_tensor(c, full.fm, &xf, &yf) != FSDP_OK) goto out;
        for (int b = 0; b < NB; b++) {
            const float *want = (const float *)yf.data + ((int64_t)b * len + len - 1) * V;
            for (int64_t v = 0; v < V; v++) {
                double d = fabs((double)got[b * V + v] - want[v]);
                *diff = d > *diff || d != d ? d : *diff;
                *scale = fabs(want[v]) > *scale ? fabs(want[v]) : *scale;
            }
        }
    }
    *failed = 0;
out:
    if (*failed) fprintf(stderr, "  %s\n", fsdp_errmsg(c));
    free(in);
    free(got);
    run_free(&dec);
    run_free(&full);
}

/* fp32: each step's logits are the full forward's last row but for the
 * products' order of summation */
TEST(decode_matches_full_forward_fp32) {
    struct fsdp_ctx *c = get_ctx();
    const int plan[3][2] = {{1, 1}, {6, 1}, {5, 3}}; /* prompt, step */
    for (int i = 0; i < 3; i++) {
        double diff, scale;
        int failed;
        decode_vs_full(c, FSDP_F32, plan[i][0], plan[i][1], &diff, &scale, &failed);
        ASSERT(!failed);
        if (!(diff <= 1e-5 * scale) || scale < 0.05)
            TEST_FAILF("prompt %d, step %d: logits differ by %.3g (largest %.3g)", plan[i][0], plan[i][1], diff, scale);
    }
}

/* AMP_BF16: the same roundings as the full forward's (q, k, v and the
 * probabilities as 16-bit operands, the heads' output for c_proj), so the two
 * differ only where the order of the sums moved a rounding (0 here with the
 * gemm-based kernels, 6e-8 widened; the probabilities left unrounded: 2e-3
 * of the largest logit) */
TEST(decode_matches_full_forward_bf16) {
    struct fsdp_ctx *c = get_ctx();
    double diff, scale;
    int failed;
    decode_vs_full(c, FSDP_BF16, 4, 1, &diff, &scale, &failed);
    ASSERT(!failed);
    if (!(diff <= 1e-3 * scale) || scale < 0.05) TEST_FAILF("logits differ by %.3g (largest %.3g)", diff, scale);
}

TEST(cache_errors_name_the_problem) {
    struct fsdp_ctx *c = get_ctx();
    struct run r;
    ASSERT_OK(run_create(c, FSDP_F32, &r), c);
    struct fsdp_gpt_config gc = cfg();
    CHECK_INT_EQ(fsdp_gpt_set_cache(c, r.g, 2, gc.block_size + 1), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "at most block_size 64");
    CHECK_INT_EQ(fsdp_gpt_set_cache(c, r.g, 0, 8), FSDP_ERR_INVALID);
    struct fsdp_module *relu;
    ASSERT_OK(fsdp_relu_create(c, "act", &relu), c);
    CHECK_INT_EQ(fsdp_gpt_set_cache(c, relu, 1, 8), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "module 'act' is not a GPT");
    fsdp_module_free(relu);

    ASSERT_OK(fsdp_gpt_set_cache(c, r.g, 2, 8), c);
    int32_t in[2 * 9] = {0}, tg[9] = {0};
    struct fsdp_tensor x = {in, FSDP_I32, 2, {2, 5}, FSDP_LAYOUT_PLAIN}, y = {0};
    CHECK_INT_EQ(fsdp_model_forward_tensor(c, r.fm, &x, &y), FSDP_ERR_STATE); /* train mode */
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "eval mode");
    fsdp_module_set_training(r.g, 0);
    ASSERT_OK(fsdp_model_forward_tensor(c, r.fm, &x, &y), c);
    x.shape[1] = 4; /* positions 5..8 of 8 */
    CHECK_INT_EQ(fsdp_model_forward_tensor(c, r.fm, &x, &y), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "positions 5..8 of 2 sequences do not fit the decoding cache of 8");
    x.shape[0] = 1;
    x.shape[1] = 1;
    CHECK_INT_EQ(fsdp_model_forward_tensor(c, r.fm, &x, &y), FSDP_ERR_INVALID); /* 1 sequence of 2 */
    x.shape[0] = 2;
    x.shape[1] = 3; /* 5..7: the failed calls moved nothing */
    ASSERT_OK(fsdp_model_forward_tensor(c, r.fm, &x, &y), c);
    CHECK_INT_EQ(y.shape[1], 1);
    ASSERT_OK(fsdp_gpt_set_cache(c, r.g, 2, 8), c); /* starts over */
    x.shape[1] = 8;
    ASSERT_OK(fsdp_model_forward_tensor(c, r.fm, &x, &y), c);

    /* freed, the model trains and runs whole sequences again */
    ASSERT_OK(fsdp_gpt_set_cache(c, r.g, 0, 0), c);
    ASSERT_OK(fsdp_model_forward_tensor(c, r.fm, &x, &y), c);
    CHECK_INT_EQ(y.shape[1], 8);
    fsdp_module_set_training(r.g, 1);
    struct fsdp_step_result res; /* one sequence of 9 a rank */
    CHECK_OK(fsdp_model_train_step(c, r.fm, in, tg, 1, 9, 1e-3f, 1.0f, &res), c);
    CHECK(isfinite(res.loss));
    run_free(&r);
}

TEST_MAIN()
