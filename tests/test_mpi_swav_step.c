/*
 * test_mpi_swav_step.c - the step of fsdp-train's SwAV task ([Note: SwAV
 * step] in tools/train/task_swav.c) at 1..4 ranks: two groups of crops run
 * as two forwards, SwAV's loss over both, backward of the second group,
 * the first group run again and its backward, gradients adding up in the
 * shards. With crops of one size the same rows can also go through one
 * forward and one backward: the gradients of every parameter and the
 * step's loss must agree (1e-5). The model is SwAV's head alone (hidden 0:
 * no batch norm, whose statistics would differ between one and two groups),
 * its prototypes an fp32 unit of their own, sharded.
 */
#include "fsdp.h"
#include "harness.h"

#include <mpi.h>

#include "mpi_harness.h"

enum { IN = 6, D = 5, K = 7, BL = 2, V = 2, NC = 2 + V };
#define W (D + K)

/* FSDP_LOSS_USER: the target is the precomputed gradient (out's shape). */
static enum fsdp_status give_back(struct fsdp_ctx *cx, const struct fsdp_tensor *out, const struct fsdp_tensor *tg,
                                  void *ud, double *value, struct fsdp_tensor *dout) {
    (void)cx;
    memcpy(dout->data, tg->data, (size_t)(out->shape[0] * out->shape[1]) * sizeof(float));
    *value = *(const double *)ud;
    return FSDP_OK;
}

static enum fsdp_status loss_back(struct fsdp_ctx *c, struct fsdp_model *fm, const struct fsdp_tensor *out,
                                  float *grad, double value) {
    struct fsdp_loss L = {0};
    L.kind = FSDP_LOSS_USER;
    L.fn = give_back;
    L.ud = &value;
    struct fsdp_tensor tg = *out, d = *out;
    tg.data = grad;
    d.data = NULL;
    enum fsdp_status st = fsdp_model_loss(c, fm, &L, out, &tg, 1, NULL, &d);
    return st == FSDP_OK ? fsdp_model_backward(c, fm, &d) : st;
}

static enum fsdp_wrap protos_fp32(struct fsdp_module *m, void *ud, struct fsdp_unit_overrides *ovr) {
    (void)ud;
    if (strncmp(m->name, "prototypes", 10)) return FSDP_WRAP_SKIP;
    ovr->set = FSDP_OVR_MIXED_PRECISION;
    ovr->mixed_precision = FSDP_MP_FULL;
    return FSDP_WRAP_UNIT_OVERRIDE;
}

/* rows (NC * BL, W) of outputs -> the SwAV gradient (z slice 0, scores slice
 * d loss / d scores times the world, fsdp_model_loss's convention) */
static double swav_grad(struct fsdp_ctx *c, const float *out, float *grad) {
    float sc[NC * BL * K], ds[NC * BL * K];
    for (int i = 0; i < NC * BL; i++) memcpy(sc + i * K, out + i * W + D, K * sizeof(float));
    struct fsdp_swav_opts o = fsdp_swav_opts_default();
    const int assign[2] = {0, 1};
    double loss = NAN;
    CHECK_OK(fsdp_swav_loss(c, fsdp_ctx_comm(c), &o, sc, NC, BL, K, assign, 2, NULL, NULL, &loss, ds), c);
    memset(grad, 0, NC * BL * W * sizeof(float));
    for (int i = 0; i < NC * BL; i++)
        for (int k = 0; k < K; k++) grad[i * W + D + k] = ds[i * K + k] * (float)fsdp_ctx_world(c);
    return loss;
}

TEST(two_forwards_and_a_recompute_equal_one_pass) {
    struct fsdp_ctx *c = get_ctx();
    int rank = fsdp_ctx_rank(c);
    struct fsdp_swav_head_config hc = {IN, 0, D, K, 1};
    struct fsdp_module *h;
    ASSERT_OK(fsdp_swav_head_create(c, "", &hc, &h), c);
    ASSERT_OK(fsdp_module_finalize(c, h), c);
    struct fsdp_shard_opts so = fsdp_shard_opts_default();
    so.wrap = protos_fp32;
    struct fsdp_model *fm;
    ASSERT_OK(fsdp_fully_shard(c, h, &so, &fm), c);
    ASSERT_OK(fsdp_model_init_params(c, fm, 5), c);
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    oo.kind = FSDP_OPTIM_SGD;
    oo.weight_decay = 0;
    struct fsdp_optim *opt;
    ASSERT_OK(fsdp_optim_create(c, &oo, &opt), c);
    ASSERT_OK(fsdp_model_attach_optim(c, fm, opt), c);
    /* this rank's crops: rows v * BL + b, crop v of image b; the first 2 crops the "global" group */
    float x[NC * BL * IN];
    for (int v = 0; v < NC; v++)
        for (int b = 0; b < BL; b++)
            for (int i = 0; i < IN; i++)
                x[(v * BL + b) * IN + i] = (float)sin(0.9 * v + 1.7 * (rank * BL + b) + 0.31 * i * (v + 1));
    const char *fq[3] = {"projection_head.0.weight", "projection_head.0.bias", "prototypes0.weight"};
    int64_t n[3] = {D * IN, D, K * D};
    float *g2[3], *g1[3];
    for (int p = 0; p < 3; p++) g2[p] = malloc((size_t)n[p] * sizeof(float)), g1[p] = malloc((size_t)n[p] * sizeof(float));
    float out[NC * BL * W], grad[NC * BL * W];
    struct fsdp_step_result r2, r1;
    /* (a) the task's way: two forwards, loss, backward(small), recompute(global), backward(global) */
    struct fsdp_tensor ing = {x, FSDP_F32, 2, {2 * BL, IN}, FSDP_LAYOUT_PLAIN};
    struct fsdp_tensor ins = {x + 2 * BL * IN, FSDP_F32, 2, {V * BL, IN}, FSDP_LAYOUT_PLAIN};
    struct fsdp_tensor y = {0};
    ASSERT_OK(fsdp_model_forward_tensor(c, fm, &ing, &y), c);
    memcpy(out, y.data, 2 * BL * W * sizeof(float));
    ASSERT_OK(fsdp_model_forward_tensor(c, fm, &ins, &y), c);
    memcpy(out + 2 * BL * W, y.data, V * BL * W * sizeof(float));
    double loss = swav_grad(c, out, grad);
    ASSERT_OK(loss_back(c, fm, &y, grad + 2 * BL * W, loss), c);
    ASSERT_OK(fsdp_model_forward_tensor(c, fm, &ing, &y), c);
    for (int i = 0; i < 2 * BL * W; i++) CHECK(((float *)y.data)[i] == out[i]); /* the same forward again */
    ASSERT_OK(loss_back(c, fm, &y, grad, 0.0), c);
    for (int p = 0; p < 3; p++) ASSERT_OK(fsdp_model_get_grad(c, fm, fq[p], g2[p]), c);
    ASSERT_OK(fsdp_model_optim_step(c, fm, 0.0f, 0.0f, &r2), c); /* lr 0: ends the step, moves nothing */
    /* (b) one forward and one backward of all the crops */
    struct fsdp_tensor all = {x, FSDP_F32, 2, {NC * BL, IN}, FSDP_LAYOUT_PLAIN};
    ASSERT_OK(fsdp_model_forward_tensor(c, fm, &all, &y), c);
    memcpy(out, y.data, sizeof out);
    double loss1 = swav_grad(c, out, grad);
    ASSERT_OK(loss_back(c, fm, &y, grad, loss1), c);
    for (int p = 0; p < 3; p++) ASSERT_OK(fsdp_model_get_grad(c, fm, fq[p], g1[p]), c);
    ASSERT_OK(fsdp_model_optim_step(c, fm, 0.0f, 0.0f, &r1), c);
    CHECK_NEAR(loss, loss1, 1e-6, 1e-7);
    CHECK_NEAR(r2.loss, r1.loss, 1e-6, 1e-7);
    CHECK_NEAR(r2.loss, loss, 1e-6, 1e-7);
    double worst = 0, mx = 0;
    for (int p = 0; p < 3; p++)
        for (int64_t i = 0; i < n[p]; i++) {
            worst = fmax(worst, fabs((double)g2[p][i] - g1[p][i]));
            mx = fmax(mx, fabs((double)g1[p][i]));
        }
    CHECK(mx > 1e-4);
    if (!(worst <= 1e-5 * (1 + mx))) TEST_FAILF("gradients differ by %g (largest %g)", worst, mx);
    for (int p = 0; p < 3; p++) free(g1[p]), free(g2[p]);
    fsdp_model_free(fm);
    fsdp_module_free(h);
    fsdp_optim_free(opt);
}

TEST_MAIN()
