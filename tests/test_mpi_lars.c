/*
 * test_mpi_lars.c - LARS ([Note: LARS trust ratios] in src/fsdp/step.c) at
 * 1..4 ranks, on the tiny GPT under FULL_SHARD and HYBRID_SHARD: after each
 * of three steps every parameter equals the update written out here from
 * the gathered parameters and gradients, in double:
 *   decayed (weights):  d = r (g + wd w), r = eta ||w|| / (||g|| + wd ||w|| + eps)
 *   excluded (biases, LayerNorm, embeddings without decay):  d = g
 *   buf = d on the first step, else mu buf + d;  w -= lr buf
 * The norms are the whole parameter's though its elements are cut across
 * the ranks (3 ranks cut parameters unevenly). Also: a frozen group stays
 * bit-identical under LARS, and bad options are named.
 */
#include "fsdp.h"
#include "harness.h"

#include <mpi.h>

#include "mpi_harness.h"
#include "plist.h"


static void lars_case(enum fsdp_sharding sh, int freeze) {
    struct fsdp_ctx *c = get_ctx();
    int rank = fsdp_ctx_rank(c), world = fsdp_ctx_world(c);
    struct fsdp_gpt_config cfg;
    fsdp_gpt_config_preset("tiny", &cfg);
    struct fsdp_module *g;
    ASSERT_OK(fsdp_gpt_create(c, &cfg, &g), c);
    struct fsdp_shard_opts so = fsdp_shard_opts_default();
    so.sharding = sh;
    if (sh == FSDP_HYBRID_SHARD) so.shard_group = world % 2 == 0 ? 2 : 1;
    struct fsdp_model *fm;
    ASSERT_OK(fsdp_fully_shard(c, g, &so, &fm), c);
    ASSERT_OK(fsdp_model_init_params(c, fm, 9), c);
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    oo.kind = FSDP_OPTIM_LARS;
    oo.momentum = 0.9f;
    oo.weight_decay = 0.05f;
    oo.trust_coefficient = 0.02f;
    struct fsdp_optim *opt;
    ASSERT_OK(fsdp_optim_create(c, &oo, &opt), c);
    const char *frozen_fqn = "transformer.h.1.mlp.c_fc.weight";
    if (freeze) {
        ASSERT_OK(fsdp_optim_add_group(opt, &frozen_fqn, 1, 0.05f, 1.0f), c);
        struct fsdp_optim_group_settings gs = {0.05f, 1.0f, 1};
        ASSERT_OK(fsdp_optim_group_set(opt, 1, &gs), c);
    }
    ASSERT_OK(fsdp_model_attach_optim(c, fm, opt), c);
    struct plist pl = {0};
    fsdp_module_foreach_param(g, collect_param, &pl);
    float **w = calloc((size_t)pl.n, sizeof *w), **gr = calloc((size_t)pl.n, sizeof *gr);
    double **buf = calloc((size_t)pl.n, sizeof *buf);
    for (int i = 0; i < pl.n; i++) {
        w[i] = malloc((size_t)pl.p[i]->numel * sizeof(float));
        gr[i] = malloc((size_t)pl.p[i]->numel * sizeof(float));
        buf[i] = calloc((size_t)pl.p[i]->numel, sizeof(double));
    }
    const int Bl = 2, T = 16;
    const float lr = 0.5f;
    int32_t in[2 * 16], tg[2 * 16];
    double worst = 0, moved = 0;
    for (int s = 0; s < 3; s++) {
        for (int i = 0; i < Bl * T; i++) {
            int gi = rank * Bl * T + i; /* a global batch the world cuts into shares */
            in[i] = (gi * 7 + s) % cfg.vocab_size;
            tg[i] = (gi * 5 + 2 * s + 1) % cfg.vocab_size;
        }
        struct fsdp_tensor x = {in, FSDP_I32, 2, {Bl, T}, FSDP_LAYOUT_PLAIN};
        struct fsdp_tensor y = {0};
        struct fsdp_tensor t = {tg, FSDP_I32, 2, {Bl, T}, FSDP_LAYOUT_PLAIN};
        ASSERT_OK(fsdp_model_forward_tensor(c, fm, &x, &y), c);
        ASSERT_OK(fsdp_model_loss(c, fm, NULL, &y, &t, 1, NULL, &y), c);
        ASSERT_OK(fsdp_model_backward(c, fm, &y), c);
        for (int i = 0; i < pl.n; i++) {
            ASSERT_OK(fsdp_model_get_param(c, fm, pl.p[i]->fqn, w[i]), c);
            ASSERT_OK(fsdp_model_get_grad(c, fm, pl.p[i]->fqn, gr[i]), c);
        }
        struct fsdp_step_result r;
        ASSERT_OK(fsdp_model_optim_step(c, fm, lr, 0.0f, &r), c);
        for (int i = 0; i < pl.n; i++) {
            int64_t n = pl.p[i]->numel;
            int frozen = freeze && !strcmp(pl.p[i]->fqn, frozen_fqn);
            double wn = 0, gn = 0, wd = pl.p[i]->no_decay ? 0.0 : 0.05, rt = 1.0;
            for (int64_t e = 0; e < n; e++) wn += (double)w[i][e] * w[i][e], gn += (double)gr[i][e] * gr[i][e];
            wn = sqrt(wn), gn = sqrt(gn);
            if (wd > 0 && wn > 0 && gn > 0) rt = 0.02 * wn / (gn + wd * wn + 1e-8);
            else wd = 0;
            float *after = malloc((size_t)n * sizeof(float));
            ASSERT_OK(fsdp_model_get_param(c, fm, pl.p[i]->fqn, after), c);
            for (int64_t e = 0; e < n; e++) {
                double want = w[i][e];
                if (!frozen) {
                    double d = rt * ((double)gr[i][e] + wd * w[i][e]);
                    buf[i][e] = s == 0 ? d : 0.9 * buf[i][e] + d;
                    want = w[i][e] - lr * buf[i][e];
                }
                double diff = fabs(after[e] - want) / (1e-3 + fabs(want));
                worst = diff > worst || diff != diff ? diff : worst;
                if (frozen && after[e] != w[i][e]) worst = INFINITY;
                moved = fmax(moved, fabs(after[e] - w[i][e]));
            }
            free(after);
        }
    }
    if (!(worst <= 1e-5)) TEST_FAILF("LARS update differs from the formula by %g (relative)", worst);
    CHECK(moved > 1e-4); /* the steps did something */
    for (int i = 0; i < pl.n; i++) free(w[i]), free(gr[i]), free(buf[i]);
    plist_free(&pl);
    free(w), free(gr), free(buf);
    fsdp_model_free(fm);
    fsdp_optim_free(opt);
    fsdp_module_free(g);
}

TEST(lars_full_shard_matches_formula) { lars_case(FSDP_FULL_SHARD, 0); }
TEST(lars_hybrid_shard_matches_formula) { lars_case(FSDP_HYBRID_SHARD, 0); }
TEST(lars_frozen_group_untouched) { lars_case(FSDP_FULL_SHARD, 1); }

TEST(lars_bad_options_named) {
    struct fsdp_ctx *c = get_ctx();
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    oo.kind = FSDP_OPTIM_LARS;
    oo.trust_coefficient = 0.0f;
    struct fsdp_optim *opt = NULL;
    CHECK(fsdp_optim_create(c, &oo, &opt) == FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "trust_coefficient 0");
    oo.trust_coefficient = NAN;
    CHECK(fsdp_optim_create(c, &oo, &opt) == FSDP_ERR_INVALID);
}

TEST_MAIN()
