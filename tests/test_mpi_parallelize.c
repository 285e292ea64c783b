/*
 * test_mpi_parallelize.c - fsdp_parallelize_model and its parts, run by
 * tests/run.sh at 1..4 ranks: the units each wrap policy forms (FQNs), that
 * training with them reproduces the unsharded 1-rank run, per-unit
 * overrides, activation checkpointing (bit-identical gradients, less
 * activation memory), deferred init and sync_module_states, optimizer
 * re-pointing with FQN-named groups, summon_full_params, and the misuse
 * errors.
 */
#include "fsdp.h"
#include "harness.h"

#include <math.h>
#include <mpi.h>
#include <unistd.h>

#include "mpi_harness.h"
#include "ref_model.h"

static struct fsdp_gpt_config tiny_cfg(void) {
    struct fsdp_gpt_config c;
    fsdp_gpt_config_preset("tiny", &c);
    return c;
}

/* internal (core-impl.h): frees the activation arena, so that a test
 * measures its own arena from empty */
void fsdp__arena_free_all(struct fsdp_ctx *ctx);

/* ---- policies ---- */

/* Wraps every Block and, inside it, its MLP (nested units). */
static enum fsdp_wrap wrap_block_and_mlp(struct fsdp_module *m, void *ud, struct fsdp_unit_overrides *ovr) {
    (void)ud;
    (void)ovr;
    return !strcmp(m->ops->type, "Block") || !strcmp(m->ops->type, "MLP") ? FSDP_WRAP_UNIT : FSDP_WRAP_SKIP;
}

/* Wraps Blocks; transformer.h.0 keeps its parameters from forward to backward
 * (so they are still gathered during h.1's backward). */
static enum fsdp_wrap wrap_override_h1(struct fsdp_module *m, void *ud, struct fsdp_unit_overrides *ovr) {
    (void)ud;
    if (strcmp(m->ops->type, "Block")) return FSDP_WRAP_SKIP;
    if (!strcmp(m->fqn, "transformer.h.0")) {
        ovr->set = FSDP_OVR_RESHARD_AFTER_FORWARD | FSDP_OVR_MIXED_PRECISION;
        ovr->reshard_after_forward = 0;
        ovr->mixed_precision = FSDP_MP_FULL;
        return FSDP_WRAP_UNIT_OVERRIDE;
    }
    return FSDP_WRAP_UNIT;
}

static enum fsdp_wrap wrap_bad_mp(struct fsdp_module *m, void *ud, struct fsdp_unit_overrides *ovr) {
    (void)ud;
    if (strcmp(m->ops->type, "Block")) return FSDP_WRAP_SKIP;
    ovr->set = FSDP_OVR_MIXED_PRECISION;
    ovr->mixed_precision = (enum fsdp_mixed_precision)9;
    return FSDP_WRAP_UNIT_OVERRIDE;
}

static enum fsdp_status prepare(struct fsdp_ctx *c, struct fsdp_module **g, const struct fsdp_wrap_policy *wp,
                                const struct fsdp_parallel_config *pc, const struct fsdp_ac_check *ac,
                                struct fsdp_optim *opt, struct fsdp_model **fm) {
    struct fsdp_gpt_config cfg = tiny_cfg();
    if (fsdp_gpt_create(c, &cfg, g) != FSDP_OK) abort();
    return fsdp_parallelize_model(c, *g, pc, opt, FSDP_F32, wp, ac, NULL, fm);
}

static void check_units(const char *name, const struct fsdp_wrap_policy *wp, const char *const *want, int n_want) {
    struct fsdp_ctx *c = get_ctx();
    struct fsdp_module *g;
    struct fsdp_model *fm;
    struct fsdp_parallel_config pc = fsdp_parallel_config_default();
    ASSERT_OK(prepare(c, &g, wp, &pc, NULL, NULL, &fm), c);
    if (fsdp_model_n_units(fm) != n_want) TEST_FAILF("%s: %d units, want %d", name, fsdp_model_n_units(fm), n_want);
    for (int i = 0; i < fsdp_model_n_units(fm) && i < n_want; i++) {
        struct fsdp_unit_info ui;
        fsdp_model_unit_info(fm, i, &ui);
        CHECK_STR_EQ(ui.fqn, want[i]);
    }
    fsdp_model_free(fm);
    fsdp_module_free(g);
}

/* fsdp_parallel_config_shard_opts: the shard options fsdp_parallelize_model
 * shards with (the planners take them): each field of the config carried, a
 * 2-D mesh making HYBRID_SHARD over its shard group, the wrap policy's
 * function and data, fsdp_shard_opts_default's without one. */
TEST(parallel_config_gives_the_shard_opts_parallelize_uses) {
    (void)get_ctx(); /* the harness's MPI, for the verdict every test reports */
    struct fsdp_parallel_config c = fsdp_parallel_config_default();
    c.reshard_after_forward = 0;
    c.sharding = FSDP_SHARD_GRAD_OP;
    c.overlap = 0;
    c.max_inflight = 3;
    c.mixed_precision = FSDP_MP_PURE;
    c.lp_shard_copy = 1;
    static int ud;
    struct fsdp_wrap_policy wp = {fsdp_wrap_by_type, &ud};
    struct fsdp_shard_opts so = fsdp_parallel_config_shard_opts(&c, FSDP_BF16, &wp);
    CHECK_INT_EQ(so.reshard_after_forward, 0);
    CHECK_INT_EQ(so.sharding, FSDP_SHARD_GRAD_OP);
    CHECK_INT_EQ(so.overlap, 0);
    CHECK_INT_EQ(so.max_inflight, 3);
    CHECK_INT_EQ(so.mixed_precision, FSDP_MP_PURE);
    CHECK_INT_EQ(so.lp_shard_copy, 1);
    CHECK_INT_EQ(so.precision, FSDP_BF16);
    CHECK(so.wrap == fsdp_wrap_by_type && so.wrap_ud == &ud);
    c.mesh[0] = 2;
    c.mesh[1] = 3;
    so = fsdp_parallel_config_shard_opts(&c, FSDP_F32, NULL);
    CHECK_INT_EQ(so.sharding, FSDP_HYBRID_SHARD);
    CHECK_INT_EQ(so.shard_group, 3);
    struct fsdp_shard_opts def = fsdp_shard_opts_default();
    CHECK(so.wrap == def.wrap && so.wrap_ud == def.wrap_ud);
}

TEST(units_of_each_policy) {
    struct fsdp_wrap_policy block = {fsdp_wrap_by_type, (void *)"Block"};
    const char *w_block[] = {"", "transformer.h.0", "transformer.h.1"};
    check_units("block", &block, w_block, 3);
    struct fsdp_wrap_policy none = {NULL, NULL};
    const char *w_none[] = {""};
    check_units("none", &none, w_none, 1);
    /* tiny: a Block has 12,704 parameters, its MLP 8,352, c_fc 4,224, wte 8,192 */
    int64_t n1 = 8000;
    struct fsdp_wrap_policy size = {fsdp_wrap_by_size, &n1};
    const char *w_size[] = {"", "transformer.wte", "transformer.h.0.mlp", "transformer.h.1.mlp"};
    check_units("size:8000", &size, w_size, 4);
    int64_t n2 = 4000;
    struct fsdp_wrap_policy size2 = {fsdp_wrap_by_size, &n2};
    /* attn (4,224) and each MLP Linear reach 4000; then a Block keeps only its LayerNorms */
    const char *w_size2[] = {"",
                             "transformer.wte",
                             "transformer.h.0.attn",
                             "transformer.h.0.mlp.c_fc",
                             "transformer.h.0.mlp.c_proj",
                             "transformer.h.1.attn",
                             "transformer.h.1.mlp.c_fc",
                             "transformer.h.1.mlp.c_proj"};
    check_units("size:4000", &size2, w_size2, 8);
    struct fsdp_wrap_policy nested = {wrap_block_and_mlp, NULL};
    const char *w_nested[] = {"", "transformer.h.0", "transformer.h.0.mlp", "transformer.h.1",
                              "transformer.h.1.mlp"};
    check_units("nested", &nested, w_nested, 5);
}

/* Training with each policy (and with checkpointing) reproduces the 1-rank unsharded run. */
static void check_training(const struct fsdp_wrap_policy *wp, const struct fsdp_ac_check *ac) {
    struct fsdp_ctx *c = get_ctx();
    int world = fsdp_ctx_world(c), rank = fsdp_ctx_rank(c);
    struct fsdp_gpt_config cfg = tiny_cfg();
    struct fsdp_data *data;
    ASSERT_OK(fsdp_data_synthetic(c, 7, 1 << 16, &data), c);
    struct ref r;
    ref_init(&r, c, &cfg, 5, NULL);
    struct fsdp_parallel_config pc = fsdp_parallel_config_default();
    pc.seed = 5;
    pc.activation_checkpointing = ac != NULL;
    struct fsdp_optim *opt;
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    ASSERT_OK(fsdp_optim_create(c, &oo, &opt), c);
    struct fsdp_module *g;
    struct fsdp_model *fm;
    ASSERT_OK(prepare(c, &g, wp, &pc, ac, opt, &fm), c);
    const int B = 12, T = 32, steps = 4;
    int32_t gin[12 * 32], gtg[12 * 32], lin[12 * 32], ltg[12 * 32];
    for (int s = 0; s < steps; s++) {
        fsdp_data_batch(data, s, B, T, 0, 1, gin, gtg);
        fsdp_data_batch(data, s, B, T, rank, world, lin, ltg);
        double want[3];
        ref_step(&r, c, gin, gtg, B, T, 1e-3f, 0.0f, want);
        struct fsdp_step_result got;
        ASSERT_OK(fsdp_model_train_step(c, fm, lin, ltg, B / world, T, 1e-3f, 0.0f, &got), c);
        CHECK_NEAR(got.loss, want[0], 1e-5, 0);
        /* AdamW's update is blind to a gradient's scale: the norm and the
         * gradients themselves catch one summed twice or over the ranks */
        CHECK_NEAR(got.grad_norm, want[1], 1e-5, 0);
        for (int i = 0; s == 0 && i < r.n; i++) {
            float *gbuf = malloc((size_t)r.p[i]->numel * sizeof(float));
            CHECK_OK(fsdp_model_get_grad(c, fm, r.p[i]->fqn, gbuf), c);
            double mx, md = max_abs_diff(gbuf, r.p[i]->grad, r.p[i]->numel, &mx);
            if (!(mx > 0) || !(md <= 1e-5 * mx + 1e-9))
                TEST_FAILF("%s's gradient differs from the 1-rank run's: max diff %g (max %g)", r.p[i]->fqn, md, mx);
            free(gbuf);
        }
    }
    for (int i = 0; i < r.n; i++) {
        float *buf = malloc((size_t)r.p[i]->numel * sizeof(float));
        CHECK_OK(fsdp_model_get_param(c, fm, r.p[i]->fqn, buf), c);
        double md = max_abs_diff(buf, r.p[i]->data, r.p[i]->numel, NULL);
        if (!(md <= 1e-5)) TEST_FAILF("%s differs from the 1-rank run by %g", r.p[i]->fqn, md);
        free(buf);
    }
    fsdp_model_free(fm);
    fsdp_optim_free(opt);
    fsdp_module_free(g);
    ref_free(&r);
    fsdp_data_free(data);
}

TEST(train_block_policy_matches_unsharded) {
    struct fsdp_wrap_policy wp = {fsdp_wrap_by_type, (void *)"Block"};
    check_training(&wp, NULL);
}
TEST(train_size_policy_matches_unsharded) {
    int64_t n = 4000;
    struct fsdp_wrap_policy wp = {fsdp_wrap_by_size, &n};
    check_training(&wp, NULL);
}
TEST(train_nested_units_match_unsharded) {
    struct fsdp_wrap_policy wp = {wrap_block_and_mlp, NULL};
    check_training(&wp, NULL);
}
TEST(train_no_wrap_matches_unsharded) {
    struct fsdp_wrap_policy wp = {NULL, NULL};
    check_training(&wp, NULL);
}
TEST(train_checkpointed_nested_matches_unsharded) {
    struct fsdp_wrap_policy wp = {wrap_block_and_mlp, NULL};
    struct fsdp_ac_check ac = {fsdp_ac_by_type, (void *)"Block"};
    check_training(&wp, &ac);
}

/* reshard_after_forward=0 on one unit only keeps that unit's full buffer
 * from forward to backward: more gathered memory at the peak, same loss. */
TEST(override_reshard_after_forward_applies) {
    struct fsdp_ctx *c = get_ctx();
    size_t peak[2];
    double loss[2], gnorm[2], pnorm[2]; /* the backward and the update as well as the forward */
    for (int k = 0; k < 2; k++) {
        struct fsdp_wrap_policy wp = {k ? wrap_override_h1 : fsdp_wrap_by_type, (void *)"Block"};
        struct fsdp_parallel_config pc = fsdp_parallel_config_default();
        pc.overlap = 0; /* a prefetched next Block would hide the difference */
        struct fsdp_optim *opt;
        struct fsdp_optim_opts oo = fsdp_optim_opts_default();
        ASSERT_OK(fsdp_optim_create(c, &oo, &opt), c);
        struct fsdp_module *g;
        struct fsdp_model *fm;
        ASSERT_OK(prepare(c, &g, &wp, &pc, NULL, opt, &fm), c);
        if (k) {
            char plan[4096];
            fsdp_model_plan(fm, plan, sizeof plan);
            CHECK_STR_CONTAINS(plan, "'transformer.h.0' (Block): 12 params, 12704 elements");
            CHECK_STR_CONTAINS(plan, "reshard_after_forward off (overridden)");
        }
        int32_t in[64], tg[64];
        for (int i = 0; i < 64; i++) { in[i] = (i * 7) % 256; tg[i] = (i * 11) % 256; }
        fsdp_mem_reset_peak(c);
        struct fsdp_step_result res;
        ASSERT_OK(fsdp_model_train_step(c, fm, in, tg, 1, 16, 1e-3f, 1.0f, &res), c);
        struct fsdp_mem_stats m;
        fsdp_mem_get(c, &m);
        peak[k] = m.peak[FSDP_MEM_FULL];
        loss[k] = res.loss;
        gnorm[k] = res.grad_norm;
        pnorm[k] = res.param_norm;
        fsdp_model_free(fm);
        fsdp_optim_free(opt);
        fsdp_module_free(g);
    }
    if (fsdp_ctx_world(c) > 1) CHECK(peak[1] > peak[0]);
    CHECK_NEAR(loss[1], loss[0], 0, 0);
    CHECK_NEAR(gnorm[1], gnorm[0], 0, 0);
    CHECK_NEAR(pnorm[1], pnorm[0], 0, 0);
}

/* Gradients with and without checkpointing have the same bits; the arena's
 * peak falls. */
TEST(checkpointing_gradients_bit_identical) {
    struct fsdp_ctx *c = get_ctx();
    float *grads[2] = {0};
    size_t act[2];
    struct fsdp_module *ref;
    struct fsdp_gpt_config cfg = tiny_cfg();
    ASSERT_OK(fsdp_gpt_create(c, &cfg, &ref), c);
    int64_t total = fsdp_module_numel(ref);
    struct ref names = {0};
    fsdp_module_foreach_param(ref, ref_collect, &names);
    for (int k = 0; k < 2; k++) {
        struct fsdp_wrap_policy wp = {wrap_block_and_mlp, NULL};
        struct fsdp_ac_check ac = {fsdp_ac_by_type, (void *)"Block"};
        struct fsdp_parallel_config pc = fsdp_parallel_config_default();
        pc.activation_checkpointing = k;
        struct fsdp_optim *opt;
        struct fsdp_optim_opts oo = fsdp_optim_opts_default();
        ASSERT_OK(fsdp_optim_create(c, &oo, &opt), c);
        struct fsdp_module *g;
        struct fsdp_model *fm;
        ASSERT_OK(prepare(c, &g, &wp, &pc, k ? &ac : NULL, opt, &fm), c);
        int32_t in[4 * 64], tg[4 * 64];
        for (int i = 0; i < 4 * 64; i++) { in[i] = (i * 7 + 3) % 256; tg[i] = (i * 13) % 256; }
        struct fsdp_step_result res;
        /* two steps: the second runs on one arena chunk, sized by the first */
        ASSERT_OK(fsdp_model_train_step(c, fm, in, tg, 4, 64, 0.0f, 0.0f, &res), c);
        fsdp__arena_free_all(c); /* measure this model's arena from empty: */
        ASSERT_OK(fsdp_model_train_step(c, fm, in, tg, 4, 64, 0.0f, 0.0f, &res), c);
        fsdp_arena_reset(c); /* one chunk of the first step's high-water size */
        fsdp_mem_reset_peak(c);
        ASSERT_OK(fsdp_model_train_step(c, fm, in, tg, 4, 64, 0.0f, 0.0f, &res), c);
        struct fsdp_mem_stats m;
        fsdp_mem_get(c, &m);
        act[k] = m.peak[FSDP_MEM_ACT];
        grads[k] = malloc((size_t)total * sizeof(float));
        int64_t off = 0;
        for (int i = 0; i < names.n; i++) {
            CHECK_OK(fsdp_model_get_grad(c, fm, names.p[i]->fqn, grads[k] + off), c);
            off += names.p[i]->numel;
        }
        fsdp_model_free(fm);
        fsdp_optim_free(opt);
        fsdp_module_free(g);
    }
    CHECK(memcmp(grads[0], grads[1], (size_t)total * sizeof(float)) == 0);
    /* and they are gradients: finite, and every parameter has some that are not zero */
    int64_t off = 0, nonfinite = 0;
    for (int i = 0; i < names.n; i++) {
        int64_t nz = 0;
        for (int64_t j = off; j < off + names.p[i]->numel; j++) {
            nonfinite += !isfinite(grads[0][j]);
            nz += grads[0][j] != 0.0f;
        }
        if (!nz) TEST_FAILF("%s: gradient is all zero", names.p[i]->fqn);
        off += names.p[i]->numel;
    }
    CHECK_INT_EQ(nonfinite, 0);
    if (!(act[1] < act[0])) TEST_FAILF("activation peak %zu with checkpointing, %zu without", act[1], act[0]);
    free(grads[0]);
    free(grads[1]);
    free(names.p);
    fsdp_module_free(ref);
}

/* ---- init ---- */

static enum fsdp_status my_init(struct fsdp_ctx *c, struct fsdp_param *p, float *dst, void *ud) {
    (void)c;
    uint64_t h = 1469598103934665603ull + *(const uint64_t *)ud;
    for (const char *s = p->fqn; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    for (int64_t i = 0; i < p->numel; i++) dst[i] = (float)sin((double)(h % 1000) + 0.37 * (double)i);
    return FSDP_OK;
}

static int fill_my_init(struct fsdp_param *p, void *ud) {
    my_init(NULL, p, p->data, ud);
    return 0;
}

static void compare_to(struct fsdp_ctx *c, struct fsdp_model *fm, struct fsdp_module *want) {
    struct ref r = {0};
    fsdp_module_foreach_param(want, ref_collect, &r);
    for (int i = 0; i < r.n; i++) {
        float *buf = malloc((size_t)r.p[i]->numel * sizeof(float));
        CHECK_OK(fsdp_model_get_param(c, fm, r.p[i]->fqn, buf), c);
        if (memcmp(buf, r.p[i]->data, (size_t)r.p[i]->numel * sizeof(float)) != 0)
            TEST_FAILF("parameter %s differs from the reference", r.p[i]->fqn);
        free(buf);
    }
    free(r.p);
}

/* Deferred init (built-in and param_init) equals the eager 1-rank init bit
 * for bit; param_init's peak is the shards plus one unit's full buffer. */
TEST(deferred_init_matches_eager) {
    struct fsdp_ctx *c = get_ctx();
    struct fsdp_gpt_config cfg = tiny_cfg();
    uint64_t seed = 77;
    struct fsdp_module *eager;
    ASSERT_OK(fsdp_gpt_create(c, &cfg, &eager), c);
    ASSERT_OK(fsdp_module_materialize(c, eager, seed), c);
    struct fsdp_wrap_policy wp = {fsdp_wrap_by_type, (void *)"Block"};
    struct fsdp_parallel_config pc = fsdp_parallel_config_default();
    pc.seed = seed;
    struct fsdp_module *g;
    struct fsdp_model *fm;
    ASSERT_OK(prepare(c, &g, &wp, &pc, NULL, NULL, &fm), c);
    compare_to(c, fm, eager);
    fsdp_model_free(fm);
    fsdp_module_free(g);
    /* param_init against a materialized model filled by the same function */
    fsdp_module_foreach_param(eager, fill_my_init, &seed);
    ASSERT_OK(fsdp_gpt_create(c, &cfg, &g), c);
    struct fsdp_param_init pi = {my_init, &seed};
    fsdp_mem_reset_peak(c);
    struct fsdp_mem_stats m0;
    fsdp_mem_get(c, &m0);
    ASSERT_OK(fsdp_parallelize_model(c, g, &pc, NULL, FSDP_F32, &wp, NULL, &pi, &fm), c);
    struct fsdp_mem_stats m1;
    fsdp_mem_get(c, &m1);
    int64_t shards = 0, biggest = 0;
    for (int i = 0; i < fsdp_model_n_units(fm); i++) {
        struct fsdp_unit_info ui;
        fsdp_model_unit_info(fm, i, &ui);
        shards += ui.numel_shard;
        if (ui.numel_padded > biggest) biggest = ui.numel_padded;
    }
    /* param and grad shards, one unit's full buffer, headers and bookkeeping */
    size_t limit = (size_t)(2 * shards + biggest) * sizeof(float) + 64 * 1024;
    size_t used = m1.peak_total - m0.cur_total;
    if (used > limit) TEST_FAILF("init peak %zu bytes > shards + one unit (%zu)", used, limit);
    CHECK(m1.peak[FSDP_MEM_FULL] <= (size_t)biggest * sizeof(float) + 1024);
    compare_to(c, fm, eager);
    fsdp_model_free(fm);
    fsdp_module_free(g);
    fsdp_module_free(eager);
}

/* skip_init: neither the built-in init nor param_init runs, so every
 * parameter is zero after sharding; a load of a full checkpoint then gives
 * the saved model's values bit for bit (what fsdp-train's --resume does). */
TEST(skip_init_leaves_zeros_for_a_load) {
    struct fsdp_ctx *c = get_ctx();
    struct fsdp_gpt_config cfg = tiny_cfg();
    uint64_t seed = 77;
    struct fsdp_module *eager, *ga, *gb;
    ASSERT_OK(fsdp_gpt_create(c, &cfg, &eager), c);
    ASSERT_OK(fsdp_module_materialize(c, eager, seed), c);
    struct fsdp_wrap_policy wp = {fsdp_wrap_by_type, (void *)"Block"};
    struct fsdp_parallel_config pc = fsdp_parallel_config_default();
    pc.seed = seed;
    struct fsdp_model *fa, *fb;
    ASSERT_OK(prepare(c, &ga, &wp, &pc, NULL, NULL, &fa), c);
    char dir[64] = "/tmp/fsdp-skip-init-XXXXXX", path[128]; /* a folder this test makes, and removes */
    if (fsdp_ctx_rank(c) == 0) ASSERT(mkdtemp(dir));
    ASSERT_OK(fsdp_comm_broadcast(fsdp_ctx_comm(c), dir, sizeof dir, FSDP_U8, 0), c);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    ASSERT_OK(fsdp_model_save_full(c, fa, path), c);
    pc.skip_init = 1;
    ASSERT_OK(fsdp_gpt_create(c, &cfg, &gb), c);
    struct fsdp_param_init pi = {my_init, &seed}; /* skipped too */
    ASSERT_OK(fsdp_parallelize_model(c, gb, &pc, NULL, FSDP_F32, &wp, NULL, &pi, &fb), c);
    struct ref r = {0};
    fsdp_module_foreach_param(eager, ref_collect, &r);
    ASSERT(r.n > 0);
    for (int i = 0; i < r.n; i++) {
        float *buf = malloc((size_t)r.p[i]->numel * sizeof(float));
        CHECK_OK(fsdp_model_get_param(c, fb, r.p[i]->fqn, buf), c);
        int64_t nz = 0;
        for (int64_t k = 0; k < r.p[i]->numel; k++) nz += buf[k] != 0.0f;
        if (nz) TEST_FAILF("skip_init: %s has %lld non-zero values", r.p[i]->fqn, (long long)nz);
        free(buf);
    }
    free(r.p);
    ASSERT_OK(fsdp_model_load_full(c, fb, path, 0), c);
    compare_to(c, fb, eager);
    MPI_Barrier(MPI_COMM_WORLD);
    if (fsdp_ctx_rank(c) == 0) {
        CHECK(unlink(path) == 0);
        CHECK(rmdir(dir) == 0);
    }
    fsdp_model_free(fa);
    fsdp_model_free(fb);
    fsdp_module_free(ga);
    fsdp_module_free(gb);
    fsdp_module_free(eager);
}

/* sync_module_states: rank 0 alone has values (its own, not the seed's);
 * every rank ends with them. */
TEST(sync_module_states_broadcasts_rank0) {
    struct fsdp_ctx *c = get_ctx();
    struct fsdp_gpt_config cfg = tiny_cfg();
    uint64_t seed = 5;
    struct fsdp_module *want;
    ASSERT_OK(fsdp_gpt_create(c, &cfg, &want), c);
    ASSERT_OK(fsdp_module_materialize(c, want, 123), c);
    fsdp_module_foreach_param(want, fill_my_init, &seed);
    struct fsdp_module *g;
    ASSERT_OK(fsdp_gpt_create(c, &cfg, &g), c);
    if (fsdp_ctx_rank(c) == 0) {
        ASSERT_OK(fsdp_module_materialize(c, g, 123), c);
        fsdp_module_foreach_param(g, fill_my_init, &seed);
    }
    struct fsdp_wrap_policy wp = {wrap_block_and_mlp, NULL};
    struct fsdp_parallel_config pc = fsdp_parallel_config_default();
    pc.sync_module_states = 1;
    pc.seed = 999; /* must not be used */
    struct fsdp_model *fm;
    struct fsdp_comm_stats s0, s1;
    fsdp_comm_stats_get(fsdp_ctx_comm(c), &s0);
    ASSERT_OK(fsdp_parallelize_model(c, g, &pc, NULL, FSDP_F32, &wp, NULL, NULL, &fm), c);
    fsdp_comm_stats_get(fsdp_ctx_comm(c), &s1);
    /* one broadcast per unit, not one for the model */
    CHECK_INT_EQ(s1.calls[FSDP_COLL_BROADCAST] - s0.calls[FSDP_COLL_BROADCAST], fsdp_model_n_units(fm));
    compare_to(c, fm, want);
    fsdp_model_free(fm);
    fsdp_module_free(g);
    fsdp_module_free(want);
}

/* A rank whose model has a different shape gets an error naming the tensor
 * (every rank does: nobody hangs). */
TEST(model_shape_mismatch_names_the_tensor) {
    struct fsdp_ctx *c = get_ctx();
    if (fsdp_ctx_world(c) < 2) SKIP("needs 2 ranks");
    struct fsdp_gpt_config cfg = tiny_cfg();
    if (fsdp_ctx_rank(c) == fsdp_ctx_world(c) - 1) cfg.block_size = 32; /* wpe (32, 32) */
    struct fsdp_module *g;
    ASSERT_OK(fsdp_gpt_create(c, &cfg, &g), c);
    if (fsdp_ctx_rank(c) == 0) ASSERT_OK(fsdp_module_materialize(c, g, 1), c);
    struct fsdp_parallel_config pc = fsdp_parallel_config_default();
    pc.sync_module_states = 1;
    struct fsdp_model *fm = NULL;
    CHECK_INT_EQ(fsdp_parallelize_model(c, g, &pc, NULL, FSDP_F32, NULL, NULL, NULL, &fm), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "'transformer.wpe.weight' (64, 32) on rank 0");
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "(32, 32) on rank");
    CHECK(fm == NULL);
    fsdp_module_free(g);
    /* rank 0 without values */
    cfg = tiny_cfg();
    ASSERT_OK(fsdp_gpt_create(c, &cfg, &g), c);
    CHECK_INT_EQ(fsdp_parallelize_model(c, g, &pc, NULL, FSDP_F32, NULL, NULL, NULL, &fm), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "needs rank 0's model materialized");
    fsdp_module_free(g);
}

/* ---- optimizer ---- */

/* An optimizer built before sharding, with an FQN-named group (lr scale 0:
 * frozen), works on the shards; stale state is cleared; an unknown name is
 * an error naming it. */
TEST(optimizer_repointed_by_fqn) {
    struct fsdp_ctx *c = get_ctx();
    struct fsdp_optim *opt;
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    ASSERT_OK(fsdp_optim_create(c, &oo, &opt), c);
    const char *frozen[] = {"transformer.h.0.mlp.c_fc.weight", "lm_head.weight"};
    ASSERT_OK(fsdp_optim_add_group(opt, frozen, 2, 0.0f, 0.0f), c);
    CHECK_INT_EQ(fsdp_optim_add_group(opt, frozen, 1, 0.0f, 1.0f), FSDP_ERR_INVALID); /* twice */
    fsdp_optim_step(opt, NULL, 0, 1e-3f, 1.0f); /* a step "on the unsharded model": stale */
    CHECK_INT_EQ(fsdp_optim_step_count(opt), 1);
    struct fsdp_wrap_policy wp = {fsdp_wrap_by_type, (void *)"Block"};
    struct fsdp_parallel_config pc = fsdp_parallel_config_default();
    struct fsdp_module *g;
    struct fsdp_model *fm;
    ASSERT_OK(prepare(c, &g, &wp, &pc, NULL, opt, &fm), c);
    CHECK_INT_EQ(fsdp_optim_step_count(opt), 0);
    const char *names[3] = {"transformer.h.0.mlp.c_fc.weight", "transformer.wte.weight",
                            "transformer.h.0.mlp.c_proj.weight"};
    int64_t numel[3] = {128 * 32, 256 * 32, 32 * 128};
    float *before[3], *after[3];
    for (int i = 0; i < 3; i++) {
        before[i] = malloc((size_t)numel[i] * sizeof(float));
        after[i] = malloc((size_t)numel[i] * sizeof(float));
        CHECK_OK(fsdp_model_get_param(c, fm, names[i], before[i]), c);
    }
    int32_t in[64], tg[64];
    for (int i = 0; i < 64; i++) { in[i] = (i * 7) % 256; tg[i] = (i * 11) % 256; }
    struct fsdp_step_result res;
    ASSERT_OK(fsdp_model_train_step(c, fm, in, tg, 1, 16, 1e-2f, 1.0f, &res), c);
    for (int i = 0; i < 3; i++) CHECK_OK(fsdp_model_get_param(c, fm, names[i], after[i]), c);
    CHECK(memcmp(before[0], after[0], (size_t)numel[0] * sizeof(float)) == 0); /* frozen */
    CHECK(memcmp(before[1], after[1], (size_t)numel[1] * sizeof(float)) == 0); /* frozen via its tie */
    CHECK(memcmp(before[2], after[2], (size_t)numel[2] * sizeof(float)) != 0); /* trained */
    for (int i = 0; i < 3; i++) { free(before[i]); free(after[i]); }
    fsdp_model_free(fm);
    fsdp_module_free(g);
    fsdp_optim_free(opt);
    /* a name the model does not have */
    ASSERT_OK(fsdp_optim_create(c, &oo, &opt), c);
    const char *bad[] = {"transformer.h.7.attn.c_attn.weight"};
    ASSERT_OK(fsdp_optim_add_group(opt, bad, 1, 0.1f, 1.0f), c);
    CHECK_INT_EQ(prepare(c, &g, &wp, &pc, NULL, opt, &fm), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "'transformer.h.7.attn.c_attn.weight'");
    fsdp_module_free(g);
    fsdp_optim_free(opt);
}

/* ---- summon_full_params ---- */

TEST(summon_full_params_writeback_and_rank0_only) {
    struct fsdp_ctx *c = get_ctx();
    int rank = fsdp_ctx_rank(c);
    struct fsdp_wrap_policy wp = {wrap_block_and_mlp, NULL};
    struct fsdp_parallel_config pc = fsdp_parallel_config_default();
    pc.seed = 3;
    struct fsdp_optim *opt;
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    ASSERT_OK(fsdp_optim_create(c, &oo, &opt), c);
    struct fsdp_module *g;
    struct fsdp_model *fm;
    ASSERT_OK(prepare(c, &g, &wp, &pc, NULL, opt, &fm), c);
    struct fsdp_module *ref;
    struct fsdp_gpt_config cfg = tiny_cfg();
    ASSERT_OK(fsdp_gpt_create(c, &cfg, &ref), c);
    ASSERT_OK(fsdp_module_materialize(c, ref, 3), c);
    struct fsdp_param *rp = fsdp_module_find_param(ref, "transformer.h.1.mlp.c_fc.weight");
    struct fsdp_param *p = fsdp_module_find_param(g, "transformer.h.1.mlp.c_fc.weight");
    struct fsdp_param *lnw = fsdp_module_find_param(g, "transformer.h.1.ln_1.weight");
    struct fsdp_module *h1 = p->owner->parent->parent; /* transformer.h.1 */
    CHECK_STR_EQ(h1->fqn, "transformer.h.1");
    /* read: full values equal the reference; edits without writeback vanish */
    ASSERT_OK(fsdp_summon_full_params(c, fm, h1, 0, 0), c);
    ASSERT(p->data != NULL && lnw->data != NULL);
    CHECK(memcmp(p->data, rp->data, (size_t)p->numel * sizeof(float)) == 0);
    CHECK_INT_EQ(fsdp_summon_full_params(c, fm, h1, 0, 0), FSDP_ERR_STATE); /* nested */
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "nesting");
    int32_t in[64], tg[64];
    for (int i = 0; i < 64; i++) { in[i] = i % 256; tg[i] = (i * 3) % 256; }
    struct fsdp_step_result res;
    CHECK_INT_EQ(fsdp_model_train_step(c, fm, in, tg, 1, 16, 1e-3f, 1.0f, &res), FSDP_ERR_STATE);
    for (int64_t i = 0; i < p->numel; i++) p->data[i] = 7.0f;
    ASSERT_OK(fsdp_summon_end(c, fm), c);
    CHECK(p->data == NULL);
    float *buf = malloc((size_t)p->numel * sizeof(float));
    CHECK_OK(fsdp_model_get_param(c, fm, p->fqn, buf), c);
    CHECK(memcmp(buf, rp->data, (size_t)p->numel * sizeof(float)) == 0);
    /* writeback: every rank's edit lands in its shard */
    ASSERT_OK(fsdp_summon_full_params(c, fm, h1, 1, 0), c);
    for (int64_t i = 0; i < p->numel; i++) p->data[i] = (float)i * 0.5f;
    lnw->data[3] = -2.0f;
    ASSERT_OK(fsdp_summon_end(c, fm), c);
    CHECK_OK(fsdp_model_get_param(c, fm, p->fqn, buf), c);
    for (int64_t i = 0; i < p->numel; i++)
        if (buf[i] != (float)i * 0.5f) { TEST_FAILF("element %lld not written back", (long long)i); break; }
    float ln[32];
    CHECK_OK(fsdp_model_get_param(c, fm, lnw->fqn, ln), c);
    CHECK(ln[3] == -2.0f && ln[2] == 1.0f);
    /* rank0_only: values on rank 0 only; with writeback it is an error */
    ASSERT_OK(fsdp_summon_full_params(c, fm, NULL, 0, 1), c);
    if (rank == 0) CHECK(p->data != NULL && p->data[5] == 2.5f);
    else CHECK(p->data == NULL);
    ASSERT_OK(fsdp_summon_end(c, fm), c);
    CHECK_INT_EQ(fsdp_summon_full_params(c, fm, NULL, 1, 1), FSDP_ERR_INVALID);
    CHECK_INT_EQ(fsdp_summon_end(c, fm), FSDP_ERR_STATE);
    /* the model still trains afterwards (no lazy-init reset needed) */
    CHECK_OK(fsdp_model_train_step(c, fm, in, tg, 1, 16, 1e-3f, 1.0f, &res), c);
    CHECK(isfinite(res.loss));
    free(buf);
    fsdp_model_free(fm);
    fsdp_module_free(g);
    fsdp_module_free(ref);
    fsdp_optim_free(opt);
}

/* [Note: summoned in place]: on one rank a summon with write-back edits the
 * shard itself and fsdp_model_get_param reads it, neither leaving a pooled
 * copy behind (the pool keeps what it hands out); edits land and a summon
 * without write-back still discards its own. An optimizer step, init and a
 * checkpoint wait for the summon's end (they would see the edits at once
 * here, and have them written over at the end elsewhere). */
TEST(summon_one_rank_in_place) {
    struct fsdp_ctx *c = get_ctx();
    struct fsdp_wrap_policy wp = {wrap_block_and_mlp, NULL};
    struct fsdp_parallel_config pc = fsdp_parallel_config_default();
    pc.seed = 5;
    struct fsdp_module *g;
    struct fsdp_model *fm;
    ASSERT_OK(prepare(c, &g, &wp, &pc, NULL, NULL, &fm), c);
    struct fsdp_param *p = fsdp_module_find_param(g, "transformer.wte.weight"); /* the largest unit's */
    ASSERT(p != NULL);
    float *buf = malloc((size_t)p->numel * sizeof(float));
    ASSERT(buf != NULL);
    struct fsdp_mem_stats m0, m1;
    fsdp_mem_get(c, &m0);
    ASSERT_OK(fsdp_summon_full_params(c, fm, NULL, 1, 0), c);
    ASSERT(p->data != NULL);
    for (int64_t i = 0; i < p->numel; i++) p->data[i] = (float)(i % 13);
    /* what reads or writes the shards waits for the summon's end, at any world size */
    struct fsdp_step_result res;
    CHECK_INT_EQ(fsdp_model_optim_step(c, fm, 1e-3f, 1.0f, &res), FSDP_ERR_STATE);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "optimizer step while the parameters are summoned");
    CHECK_INT_EQ(fsdp_model_init_params(c, fm, 1), FSDP_ERR_STATE);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "init_params while the parameters are summoned");
    CHECK_INT_EQ(fsdp_model_save_full(c, fm, "/nonexistent/never-written.safetensors"), FSDP_ERR_STATE);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "summoned");
    ASSERT_OK(fsdp_summon_end(c, fm), c);
    CHECK_OK(fsdp_model_get_param(c, fm, p->fqn, buf), c);
    fsdp_mem_get(c, &m1);
    for (int64_t i = 0; i < p->numel; i++)
        if (buf[i] != (float)(i % 13)) { TEST_FAILF("element %lld not written back", (long long)i); break; }
    if (fsdp_ctx_world(c) == 1) CHECK_INT_EQ(m1.cur[FSDP_MEM_FULL], m0.cur[FSDP_MEM_FULL]);
    ASSERT_OK(fsdp_summon_full_params(c, fm, NULL, 0, 0), c);
    ASSERT(p->data != NULL);
    for (int64_t i = 0; i < p->numel; i++) p->data[i] = -1.0f;
    ASSERT_OK(fsdp_summon_end(c, fm), c);
    CHECK_OK(fsdp_model_get_param(c, fm, p->fqn, buf), c);
    CHECK(buf[0] == 0.0f && buf[p->numel - 1] == (float)((p->numel - 1) % 13));
    free(buf);
    fsdp_model_free(fm);
    fsdp_module_free(g);
}

/* [Note: a forward while summoned] (src/fsdp/unit.c): an eval-mode forward
 * inside fsdp_summon_full_params gives the bits of the same forward outside
 * it, with no all-gather for the summoned units (a summon of one Block: the
 * others gather as always); a training-mode forward, and any forward of a
 * rank0_only summon, are refused naming the summon. */
static struct fsdp_module *find_module(struct fsdp_module *m, const char *fqn) {
    if (m->fqn && !strcmp(m->fqn, fqn)) return m;
    for (int i = 0; i < m->n_children; i++) {
        struct fsdp_module *f = find_module(m->children[i], fqn);
        if (f) return f;
    }
    return NULL;
}

static void eval_while_summoned(enum fsdp_dtype prec) {
    struct fsdp_ctx *c = get_ctx();
    struct fsdp_gpt_config cfg = tiny_cfg();
    struct fsdp_module *g;
    struct fsdp_model *fm;
    struct fsdp_wrap_policy wp = {wrap_block_and_mlp, NULL};
    struct fsdp_parallel_config pc = fsdp_parallel_config_default();
    pc.seed = 11;
    ASSERT_OK(fsdp_gpt_create(c, &cfg, &g), c);
    ASSERT_OK(fsdp_parallelize_model(c, g, &pc, NULL, prec, &wp, NULL, NULL, &fm), c);
    fsdp_module_set_training(g, 0);
    enum { B = 2, T = 12 };
    int32_t tok[B * T];
    for (int i = 0; i < B * T; i++) tok[i] = (i * 37 + 5) % cfg.vocab_size;
    struct fsdp_tensor x = {tok, FSDP_I32, 2, {B, T}, FSDP_LAYOUT_PLAIN}, y = {0};
    size_t n = (size_t)B * T * (size_t)cfg.vocab_size;
    float *ref = malloc(n * sizeof(float));
    ASSERT(ref != NULL);
    ASSERT_OK(fsdp_model_forward_tensor(c, fm, &x, &y), c);
    memcpy(ref, y.data, n * sizeof(float));
    struct fsdp_module *h1 = find_module(g, "transformer.h.1");
    ASSERT(h1 != NULL);
    for (int part = 0; part < 2; part++) { /* the whole model, then one Block */
        struct fsdp_comm_stats s0, s1;
        ASSERT_OK(fsdp_summon_full_params(c, fm, part ? h1 : NULL, 0, 0), c);
        fsdp_model_comm_stats(fm, &s0);
        memset(&y, 0, sizeof y);
        CHECK_OK(fsdp_model_forward_tensor(c, fm, &x, &y), c);
        fsdp_model_comm_stats(fm, &s1);
        if (y.data && memcmp(y.data, ref, n * sizeof(float)))
            TEST_FAILF("%s, %s summoned: the logits differ from the forward outside the summon",
                       fsdp_dtype_name(prec), part ? "one Block" : "the whole model");
        uint64_t gathers = s1.calls[FSDP_COLL_ALLGATHER] - s0.calls[FSDP_COLL_ALLGATHER];
        if (!part && gathers) TEST_FAILF("%llu all-gathers with every unit summoned", (unsigned long long)gathers);
        if (part && fsdp_ctx_world(c) > 1 && !gathers) TEST_FAILF("the units not summoned did not gather");
        CHECK(fsdp_module_find_param(g, "transformer.h.1.mlp.c_fc.weight")->data != NULL); /* still readable */
        ASSERT_OK(fsdp_summon_end(c, fm), c);
    }
    ASSERT_OK(fsdp_summon_full_params(c, fm, NULL, 0, 0), c);
    fsdp_module_set_training(g, 1);
    CHECK_INT_EQ(fsdp_model_forward_tensor(c, fm, &x, &y), FSDP_ERR_STATE);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "training mode while its parameters are summoned");
    fsdp_module_set_training(g, 0);
    ASSERT_OK(fsdp_summon_end(c, fm), c);
    ASSERT_OK(fsdp_summon_full_params(c, fm, NULL, 0, 1), c);
    CHECK_INT_EQ(fsdp_model_forward_tensor(c, fm, &x, &y), FSDP_ERR_STATE);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "summoned on rank 0 only");
    ASSERT_OK(fsdp_summon_end(c, fm), c);
    /* and after the summons, the same forward again */
    memset(&y, 0, sizeof y);
    CHECK_OK(fsdp_model_forward_tensor(c, fm, &x, &y), c);
    CHECK(y.data && !memcmp(y.data, ref, n * sizeof(float)));
    free(ref);
    fsdp_model_free(fm);
    fsdp_module_free(g);
}

TEST(eval_forward_while_summoned_fp32) { eval_while_summoned(FSDP_F32); }
TEST(eval_forward_while_summoned_bf16) { eval_while_summoned(FSDP_BF16); }

/* ---- misuse ---- */

TEST(config_errors_name_the_option) {
    struct fsdp_ctx *c = get_ctx();
    struct fsdp_module *g;
    struct fsdp_model *fm = NULL;
    struct fsdp_ac_check ac = {fsdp_ac_by_type, (void *)"Block"};
    struct fsdp_parallel_config pc = fsdp_parallel_config_default();
    CHECK_INT_EQ(prepare(c, &g, NULL, &pc, &ac, NULL, &fm), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "activation_checkpointing and activation_cpu_offload are both off");
    fsdp_module_free(g);
    pc.activation_cpu_offload = 1;
    CHECK_INT_EQ(prepare(c, &g, NULL, &pc, NULL, NULL, &fm), FSDP_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "activation_cpu_offload: this is a CPU-only run");
    fsdp_module_free(g);
    pc = fsdp_parallel_config_default();
    pc.mixed_precision = (enum fsdp_mixed_precision)7;
    CHECK_INT_EQ(prepare(c, &g, NULL, &pc, NULL, NULL, &fm), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "mixed_precision 7 is not DEFAULT, PURE or FULL");
    fsdp_module_free(g);
    pc = fsdp_parallel_config_default();
    pc.mesh[0] = fsdp_ctx_world(c); /* {world replicas, 2 shards}: twice the world */
    pc.mesh[1] = 2;
    CHECK_INT_EQ(prepare(c, &g, NULL, &pc, NULL, NULL, &fm), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "2-D mesh");
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "does not cover the world");
    fsdp_module_free(g);
    pc = fsdp_parallel_config_default();
    struct fsdp_gpt_config cfg = tiny_cfg();
    ASSERT_OK(fsdp_gpt_create(c, &cfg, &g), c);
    CHECK_INT_EQ(fsdp_parallelize_model(c, g, &pc, NULL, FSDP_I32, NULL, NULL, NULL, &fm), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "precision I32");
    struct fsdp_wrap_policy wp = {wrap_bad_mp, NULL};
    CHECK_INT_EQ(fsdp_parallelize_model(c, g, &pc, NULL, FSDP_F32, &wp, NULL, NULL, &fm), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "unit 'transformer.h.0' overrides mixed_precision to 9");
    CHECK(fm == NULL);
    fsdp_module_free(g);
}

TEST_MAIN()
