/*
 * test_mpi_precision.c - mixed precision of the sharded model (src/fsdp/mixed.c),
 * run by tests/run.sh at 1, 2, 3 and 4 ranks: bf16 training against the
 * same configuration's 1-rank run (a world-of-one context in every process),
 * fp16 dynamic loss scaling with an injected overflow, an fp32-override unit
 * against the same unit of an all-fp32 model, the shards' 16-bit copy
 * (lp_shard_copy) against gathers that cast, the shared-memory backend's
 * 16-bit window against gathers that copy, and the all-gather and
 * reduce-scatter byte counters.
 */
#include "fsdp.h"
#include "harness.h"

#include <math.h>
#include <mpi.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "mpi_harness.h"

static struct fsdp_gpt_config tiny_cfg(void) {
    struct fsdp_gpt_config c;
    fsdp_gpt_config_preset("tiny", &c);
    return c;
}

/* A world of one in this process (no MPI): the 1-rank reference run. */
static struct fsdp_ctx *self_ctx(void) {
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.threads = 1;
    co.comm = FSDP_COMM_SELF;
    struct fsdp_ctx *c = NULL;
    if (fsdp_ctx_create(&co, &c) != FSDP_OK) abort();
    return c;
}

struct run {
    struct fsdp_module *g;
    struct fsdp_optim *opt;
    struct fsdp_model *fm;
};

/* lp_copy: fsdp_parallel_config's lp_shard_copy (16-bit units keep their
 * shard's 16-bit copy between steps) */
static enum fsdp_status run_create_lp(struct fsdp_ctx *c, enum fsdp_dtype prec, enum fsdp_mixed_precision mp,
                                      const struct fsdp_wrap_policy *wp, int lp_copy, struct run *r) {
    struct fsdp_gpt_config cfg = tiny_cfg();
    memset(r, 0, sizeof *r);
    if (fsdp_gpt_create(c, &cfg, &r->g) != FSDP_OK) abort();
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    if (fsdp_optim_create(c, &oo, &r->opt) != FSDP_OK) abort();
    struct fsdp_parallel_config pc = fsdp_parallel_config_default();
    pc.seed = 5;
    pc.mixed_precision = mp;
    pc.lp_shard_copy = lp_copy;
    return fsdp_parallelize_model(c, r->g, &pc, r->opt, prec, wp, NULL, NULL, &r->fm);
}

static enum fsdp_status run_create(struct fsdp_ctx *c, enum fsdp_dtype prec, enum fsdp_mixed_precision mp,
                                   const struct fsdp_wrap_policy *wp, struct run *r) {
    return run_create_lp(c, prec, mp, wp, 0, r);
}

static void run_free(struct run *r) {
    fsdp_model_free(r->fm);
    fsdp_optim_free(r->opt);
    fsdp_module_free(r->g);
}

enum { B = 12, T = 16 };

/* Trains `steps` steps of global batch (B, T) on context c; losses[s] etc. */
static enum fsdp_status train(struct fsdp_ctx *c, struct run *r, const struct fsdp_data *data, int steps,
                              struct fsdp_step_result *res) {
    int world = fsdp_ctx_world(c), rank = fsdp_ctx_rank(c);
    int32_t in[B * T], tg[B * T];
    for (int s = 0; s < steps; s++) {
        fsdp_data_batch(data, s, B, T, rank, world, in, tg);
        enum fsdp_status st = fsdp_model_train_step(c, r->fm, in, tg, B / world, T, 1e-3f, 1.0f, &res[s]);
        if (st != FSDP_OK) return st;
    }
    return FSDP_OK;
}

/* bf16 training at N ranks reproduces the 1-rank run of the same
 * configuration within 1e-3 relative loss over 20 steps, for DEFAULT (bf16
 * gather, fp32 reduce) and PURE (bf16 reduce too). */
static void check_bf16_vs_one_rank(enum fsdp_mixed_precision mp) {
    struct fsdp_ctx *c = get_ctx(), *one = self_ctx();
    struct fsdp_data *data;
    ASSERT_OK(fsdp_data_synthetic(c, 7, 1 << 16, &data), c);
    enum { STEPS = 20 };
    struct fsdp_step_result got[STEPS], want[STEPS];
    struct run rn, r1;
    ASSERT_OK(run_create(c, FSDP_BF16, mp, NULL, &rn), c);
    ASSERT_OK(run_create(one, FSDP_BF16, mp, NULL, &r1), one);
    CHECK_OK(train(c, &rn, data, STEPS, got), c);
    CHECK_OK(train(one, &r1, data, STEPS, want), one);
    double worst = 0;
    for (int s = 0; s < STEPS; s++) {
        CHECK(isfinite(got[s].loss) && isfinite(got[s].grad_norm));
        CHECK_INT_EQ(got[s].skipped, 0);
        double rel = fabs(got[s].loss - want[s].loss) / fabs(want[s].loss);
        if (!(rel <= worst)) worst = isfinite(rel) ? rel : INFINITY; /* NaN: the worst */
    }
    if (!(worst <= 1e-3)) TEST_FAILF("bf16 loss differs from the 1-rank run by %g relative", worst);
    CHECK(got[STEPS - 1].loss < got[0].loss - 0.1); /* it trains */
    run_free(&rn);
    run_free(&r1);
    fsdp_data_free(data);
    fsdp_ctx_free(one);
}

TEST(bf16_default_matches_one_rank_run) { check_bf16_vs_one_rank(FSDP_MP_DEFAULT); }
TEST(bf16_pure_matches_one_rank_run) { check_bf16_vs_one_rank(FSDP_MP_PURE); }

/* The logits of a forward on batch 0, copied out of the arena. */
static float *logits_of(struct fsdp_ctx *c, struct run *r, const struct fsdp_data *data) {
    int world = fsdp_ctx_world(c), rank = fsdp_ctx_rank(c);
    int32_t in[B * T], tg[B * T];
    fsdp_data_batch(data, 0, B, T, rank, world, in, tg);
    float *lg = NULL;
    if (fsdp_model_forward(c, r->fm, in, B / world, T, &lg) != FSDP_OK) return NULL;
    size_t n = (size_t)(B / world) * T * (size_t)tiny_cfg().vocab_size;
    float *out = malloc(n * sizeof(float));
    if (out) memcpy(out, lg, n * sizeof(float));
    return out;
}

/* Halves every parameter through fsdp_summon_full_params with write-back. */
static enum fsdp_status halve_params(struct fsdp_ctx *c, struct run *r) {
    enum fsdp_status st = fsdp_summon_full_params(c, r->fm, r->g, 1, 0);
    if (st != FSDP_OK) return st;
    const char *names[] = {"transformer.wte.weight", "transformer.h.0.attn.c_attn.weight",
                           "transformer.h.1.mlp.c_fc.weight", "transformer.ln_f.weight"};
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) {
        struct fsdp_param *p = fsdp_module_find_param(r->g, names[k]);
        if (!p) abort();
        for (int64_t i = 0; i < p->numel; i++) p->data[i] *= 0.5f;
    }
    return fsdp_summon_end(c, r->fm);
}

/* With lp_shard_copy a 16-bit unit gathers the 16-bit copy of its shard
 * that AdamW writes ([Note: fused 16-bit copy]); every other writer of the
 * shard must make the next gather cast the shard afresh. Run A: 2 steps,
 * forward (logits L0), save, a 3rd step, load the save: a forward must give
 * L0 again (a stale copy would carry step 3's weights). Run B: the same 2
 * steps, then halve weights by summon write-back; A, whose copy the load
 * already dropped, halves the same weights: both forwards must agree (a
 * stale copy in B would miss the halving). */
static void check_refresh(struct fsdp_ctx *c, int lp_copy, int window) {
    struct fsdp_data *data;
    ASSERT_OK(fsdp_data_synthetic(c, 7, 1 << 16, &data), c);
    char dir[256];
    int pid = (int)getpid();
    fsdp_comm_broadcast(fsdp_ctx_comm(c), &pid, 1, FSDP_I32, 0);
    snprintf(dir, sizeof dir, "/tmp/fsdp-lpcopy-test-%d-w%d", pid, fsdp_ctx_world(c));
    struct run a, b;
    struct fsdp_step_result res[3];
    ASSERT_OK(run_create_lp(c, FSDP_BF16, FSDP_MP_DEFAULT, NULL, lp_copy, &a), c);
    ASSERT_OK(run_create_lp(c, FSDP_BF16, FSDP_MP_DEFAULT, NULL, lp_copy, &b), c);
    struct fsdp_comm_stats s0, s1;
    fsdp_model_comm_stats(a.fm, &s0);
    CHECK_OK(train(c, &a, data, 2, res), c);
    fsdp_model_comm_stats(a.fm, &s1);
    if (window) /* the training gathers read the 16-bit window: no parameter all-gathered */
        CHECK(s1.bytes[FSDP_COLL_ALLGATHER] - s0.bytes[FSDP_COLL_ALLGATHER] < 256 * 2);
    CHECK_OK(train(c, &b, data, 2, res), c);
    float *l0 = logits_of(c, &a, data);
    CHECK_OK(fsdp_ckpt_save(c, a.fm, dir, NULL), c);
    CHECK_OK(train(c, &a, data, 3, res), c); /* steps 0..2 of the data again: new weights */
    float *l3 = logits_of(c, &a, data);
    CHECK_OK(fsdp_ckpt_load(c, a.fm, dir, NULL), c);
    float *l0again = logits_of(c, &a, data);
    CHECK_OK(halve_params(c, &a), c);
    CHECK_OK(halve_params(c, &b), c);
    float *la = logits_of(c, &a, data), *lb = logits_of(c, &b, data);
    size_t n = (size_t)(B / fsdp_ctx_world(c)) * T * (size_t)tiny_cfg().vocab_size;
    if (!l0 || !l3 || !l0again || !la || !lb) TEST_FAILF("a forward failed: %s", fsdp_errmsg(c));
    else {
        CHECK(memcmp(l0, l3, n * sizeof(float)) != 0);      /* step 3 changed the weights */
        CHECK(memcmp(l0, l0again, n * sizeof(float)) == 0); /* the load is what is gathered */
        CHECK(memcmp(l0, la, n * sizeof(float)) != 0);      /* halving changed them */
        CHECK(memcmp(la, lb, n * sizeof(float)) == 0);      /* and reached B's gathers too */
    }
    free(l0), free(l3), free(l0again), free(la), free(lb);
    if (fsdp_ctx_rank(c) == 0) {
        char cmd[600];
        snprintf(cmd, sizeof cmd, "rm -rf '%s' '%s.tmp'", dir, dir);
        if (system(cmd) != 0) fprintf(stderr, "  (could not remove %s)\n", dir);
    }
    run_free(&a);
    run_free(&b);
    fsdp_data_free(data);
}

TEST(shard_writers_refresh_16bit_copy) { check_refresh(get_ctx(), 1, 0); }

/* A context of one thread over the shared-memory backend whose windows may
 * hold 1 GiB (win) or that has none; NULL (the test skips) at one rank. */
static struct fsdp_ctx *shm_ctx_or_skip(int win) {
    if (fsdp_ctx_world(get_ctx()) < 2) return NULL;
    struct fsdp_ctx *c = shm_ctx_window(win ? "1073741824" : "0");
    if (!c) TEST_FAILF("no shared-memory context (FSDP_SHM_WINDOW=%s) at %d ranks", win ? "1073741824" : "0",
                       fsdp_ctx_world(get_ctx()));
    return c;
}

/* [Note: 16-bit window] (src/fsdp/unit.c): on shm the 16-bit copies lie in
 * a window, which a training step's gathers read in place; the same
 * writers (a load, a summon's write-back) must leave them stale. */
TEST(shard_writers_refresh_16bit_window) {
    struct fsdp_ctx *c = shm_ctx_or_skip(1);
    if (!c) SKIP("a shard group of one has no window");
    check_refresh(c, 0, 1); /* the window keeps the copy whatever lp_shard_copy says */
    fsdp_ctx_free(c);
}

/* bf16 training, DEFAULT and PURE, of run a (context ca, lp_shard_copy
 * lp_a) and run b (cb, lp_b) gives the same bits: losses, gradient and
 * parameter norms, a forward's logits after; a holds 2 bytes of every shard
 * element more than b (its 16-bit copy). With window_a, a's training steps
 * (after the first, which casts the copies) all-gather no parameter: a
 * barrier per gather instead ([Note: 16-bit window] in src/fsdp/unit.c). */
static void check_copy_same_bits(struct fsdp_ctx *ca, int lp_a, struct fsdp_ctx *cb, int lp_b, int window_a) {
    struct fsdp_data *data;
    ASSERT_OK(fsdp_data_synthetic(ca, 7, 1 << 16, &data), ca);
    enum { STEPS = 4 };
    const enum fsdp_mixed_precision mps[2] = {FSDP_MP_DEFAULT, FSDP_MP_PURE};
    for (int k = 0; k < 2; k++) {
        struct run a, b;
        struct fsdp_step_result ra[STEPS], rb[STEPS];
        struct fsdp_mem_stats a0, a1, b0, b1;
        fsdp_mem_get(ca, &a0);
        ASSERT_OK(run_create_lp(ca, FSDP_BF16, mps[k], NULL, lp_a, &a), ca);
        fsdp_mem_get(ca, &a1);
        fsdp_mem_get(cb, &b0);
        ASSERT_OK(run_create_lp(cb, FSDP_BF16, mps[k], NULL, lp_b, &b), cb);
        fsdp_mem_get(cb, &b1);
        /* the copy is 2 bytes of every shard element more, nothing else */
        int64_t shard_numel = 0;
        for (int i = 0; i < fsdp_model_n_units(b.fm); i++) {
            struct fsdp_unit_info ui;
            fsdp_model_unit_info(b.fm, i, &ui);
            shard_numel += ui.numel_shard;
        }
        size_t sa = a1.cur[FSDP_MEM_SHARD] - a0.cur[FSDP_MEM_SHARD], sb = b1.cur[FSDP_MEM_SHARD] - b0.cur[FSDP_MEM_SHARD];
        CHECK_INT_EQ(sa - sb, 2 * (size_t)shard_numel);
        CHECK_OK(train(ca, &a, data, 1, ra), ca); /* the first step casts the stale copies */
        struct fsdp_comm_stats s0, s1;
        fsdp_model_comm_stats(a.fm, &s0);
        CHECK_OK(train(ca, &a, data, STEPS, ra), ca);
        fsdp_model_comm_stats(a.fm, &s1);
        CHECK_OK(train(cb, &b, data, 1, rb), cb);
        CHECK_OK(train(cb, &b, data, STEPS, rb), cb);
        if (window_a) {
            /* what is left is the steps' few partial sums (step.c), not parameters */
            CHECK(s1.bytes[FSDP_COLL_ALLGATHER] - s0.bytes[FSDP_COLL_ALLGATHER] < 256 * STEPS);
            /* a barrier per gather: each Block unit's forward and backward, the root's once */
            CHECK(s1.calls[FSDP_COLL_BARRIER] - s0.calls[FSDP_COLL_BARRIER] >=
                  (uint64_t)(STEPS * (2 * fsdp_model_n_units(a.fm) - 1)));
        }
        for (int s = 0; s < STEPS; s++) {
            CHECK(ra[s].loss == rb[s].loss);
            CHECK(ra[s].grad_norm == rb[s].grad_norm);
            CHECK(ra[s].param_norm == rb[s].param_norm);
        }
        CHECK(rb[STEPS - 1].loss < rb[0].loss); /* it trains */
        float *la = logits_of(ca, &a, data), *lb = logits_of(cb, &b, data);
        size_t n = (size_t)(B / fsdp_ctx_world(ca)) * T * (size_t)tiny_cfg().vocab_size;
        if (!la || !lb) TEST_FAILF("a forward failed: %s / %s", fsdp_errmsg(ca), fsdp_errmsg(cb));
        else CHECK(memcmp(la, lb, n * sizeof(float)) == 0);
        free(la), free(lb);
        run_free(&a);
        run_free(&b);
    }
    fsdp_data_free(data);
}

/* [Note: 16-bit window]: on shm, with the window (1 GiB allowed) and with
 * gathers that copy (FSDP_SHM_WINDOW=0), lp_shard_copy off in both. */
TEST(bf16_window_same_bits_as_copying_gathers) {
    struct fsdp_ctx *cw = shm_ctx_or_skip(1), *cc = cw ? shm_ctx_or_skip(0) : NULL;
    if (!cw || !cc) {
        fsdp_ctx_free(cw);
        SKIP("a shard group of one has no window");
    }
    check_copy_same_bits(cw, 0, cc, 0, 1);
    fsdp_ctx_free(cw);
    fsdp_ctx_free(cc);
}

/* The shard's 16-bit copy (lp_shard_copy) is the cast a gather without it
 * makes (MPI: no window); at one rank, the rounding the layers make of the
 * shard's rows as they read them ([Note: 16-bit values from the shard]). */
TEST(lp_shard_copy_same_bits_as_casting_gathers) { check_copy_same_bits(get_ctx(), 1, get_ctx(), 0, 0); }

/* Trains a run of compute precision dt and policy mp and an fp32 run side by
 * side for `steps` steps: lo[] and fp[] hold their results. */
static void train_pair(struct fsdp_ctx *c, enum fsdp_dtype dt, enum fsdp_mixed_precision mp, int steps,
                       struct fsdp_step_result *lo, struct fsdp_step_result *fp) {
    struct fsdp_data *data;
    ASSERT_OK(fsdp_data_synthetic(c, 7, 1 << 16, &data), c);
    struct run a, b;
    ASSERT_OK(run_create(c, dt, mp, NULL, &a), c);
    ASSERT_OK(run_create(c, FSDP_F32, FSDP_MP_FULL, NULL, &b), c);
    CHECK_OK(train(c, &a, data, steps, lo), c);
    CHECK_OK(train(c, &b, data, steps, fp), c);
    run_free(&a);
    run_free(&b);
    fsdp_data_free(data);
}

/* bf16 stays close to fp32 (the loss over 10 steps within 2%), as a sanity
 * check that the low-precision path computes the same model. */
TEST(bf16_close_to_fp32) {
    struct fsdp_step_result lp[10], fp[10];
    train_pair(get_ctx(), FSDP_BF16, FSDP_MP_PURE, 10, lp, fp);
    for (int s = 0; s < 10; s++) CHECK_NEAR(lp[s].loss, fp[s].loss, 2e-2, 0);
    CHECK(lp[9].loss != fp[9].loss); /* bf16 really ran */
}

/* A run of compute dtype dt (DEFAULT) whose gradient the last rank makes
 * infinite at train step inject_step, with loss scaling on or off (scale
 * 1024, growth after 3 clean steps); *default_scale is the scale the run had
 * before; *data is the data to train on. */
static void overflow_run(struct fsdp_ctx *c, enum fsdp_dtype dt, int scaling, int inject_step, struct run *r,
                         struct fsdp_data **data, double *default_scale) {
    ASSERT_OK(fsdp_data_synthetic(c, 7, 1 << 16, data), c);
    ASSERT_OK(run_create(c, dt, FSDP_MP_DEFAULT, NULL, r), c);
    *default_scale = fsdp_model_loss_scale(r->fm);
    struct fsdp_loss_scale_opts lo = fsdp_loss_scale_opts_default();
    lo.enabled = scaling;
    lo.init_scale = 1024;
    lo.growth_interval = 3;
    lo.inject_step = inject_step;
    lo.inject_rank = fsdp_ctx_world(c) - 1;
    ASSERT_OK(fsdp_model_set_loss_scale(c, r->fm, &lo), c);
}

/* fp16 with dynamic loss scaling: an overflow injected on the last rank at
 * step 4 skips exactly that step on every rank (no update: same parameter
 * norm, one optimizer step fewer) and halves the scale; the scale grows
 * after growth_interval clean steps. */
TEST(fp16_injected_overflow_skips_that_step) {
    struct fsdp_ctx *c = get_ctx();
    struct run r;
    struct fsdp_data *data;
    double scale0;
    overflow_run(c, FSDP_F16, 1, 4, &r, &data, &scale0);
    CHECK(scale0 == 65536.0); /* on by default for F16 */
    enum { STEPS = 8 };
    struct fsdp_step_result res[STEPS];
    ASSERT_OK(train(c, &r, data, STEPS, res), c);
    /* scale used per step: 3 clean at 1024 -> 2048; step 4 overflows -> 1024; 3 clean -> 2048 */
    const double want_scale[STEPS] = {1024, 1024, 1024, 2048, 2048, 1024, 1024, 1024};
    for (int s = 0; s < STEPS; s++) {
        CHECK_INT_EQ(res[s].skipped, s == 4);
        if (res[s].loss_scale != want_scale[s])
            TEST_FAILF("step %d: loss scale %g, want %g", s, res[s].loss_scale, want_scale[s]);
        CHECK(isfinite(res[s].loss));
        if (s != 4) CHECK(isfinite(res[s].grad_norm));
    }
    CHECK(res[4].param_norm == res[3].param_norm); /* nothing was updated */
    CHECK(res[5].param_norm != res[4].param_norm);
    CHECK(fsdp_model_loss_scale(r.fm) == 2048.0);
    CHECK_INT_EQ(fsdp_model_skipped_steps(r.fm), 1);
    CHECK_INT_EQ(fsdp_optim_step_count(r.opt), STEPS - 1);
    /* every rank agrees on the skip (the harness combines, but say it outright) */
    int skipped = res[4].skipped, all = 0;
    MPI_Allreduce(&skipped, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    CHECK_INT_EQ(all, 1);
    run_free(&r);
    fsdp_data_free(data);
}

/* fp16 with the default scale (65536) trains without skips and stays close
 * to fp32, with an fp32 reduce (DEFAULT) and with an fp16 reduce (PURE),
 * where the pre-division keeps the sum of 65536-scaled gradients of 3+
 * ranks from overflowing ([Note: gradient pre-division]). */
TEST(fp16_trains_close_to_fp32) {
    enum fsdp_mixed_precision mps[2] = {FSDP_MP_DEFAULT, FSDP_MP_PURE};
    for (int m = 0; m < 2; m++) {
        struct fsdp_step_result h[6], f[6];
        train_pair(get_ctx(), FSDP_F16, mps[m], 6, h, f);
        for (int s = 0; s < 6; s++) {
            if (h[s].skipped) TEST_FAILF("fp16 %s: step %d skipped", m ? "PURE" : "DEFAULT", s);
            CHECK_NEAR(h[s].loss, f[s].loss, 1e-2, 0);
            CHECK_NEAR(h[s].grad_norm, f[s].grad_norm, 5e-2, 0); /* unscaled */
        }
        if (h[5].loss == f[5].loss) /* fp16 really ran */
            TEST_FAILF("fp16 %s: the last loss is fp32's", m ? "PURE" : "DEFAULT");
    }
}

/* No NaN passes: without loss scaling (bf16), an overflow is an error on
 * every rank naming the unit, and the parameters are not updated. */
TEST(bf16_overflow_is_an_error_without_scaling) {
    struct fsdp_ctx *c = get_ctx();
    struct run r;
    struct fsdp_data *data;
    double scale0;
    overflow_run(c, FSDP_BF16, 0, 1, &r, &data, &scale0);
    CHECK(scale0 == 1.0); /* off by default for BF16 */
    struct fsdp_step_result res[2];
    CHECK_INT_EQ(train(c, &r, data, 2, res), FSDP_ERR_NUMERIC);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "non-finite gradient");
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "first non-finite gradient in unit");
    CHECK_INT_EQ(fsdp_optim_step_count(r.opt), 1);
    run_free(&r);
    fsdp_data_free(data);
}

/* ---- The fp32-override unit ---- */

static enum fsdp_wrap wrap_h1_fp32(struct fsdp_module *m, void *ud, struct fsdp_unit_overrides *ovr) {
    (void)ud;
    if (strcmp(m->ops->type, "Block")) return FSDP_WRAP_SKIP;
    if (!strcmp(m->fqn, "transformer.h.1")) {
        ovr->set = FSDP_OVR_MIXED_PRECISION;
        ovr->mixed_precision = FSDP_MP_FULL;
        return FSDP_WRAP_UNIT_OVERRIDE;
    }
    return FSDP_WRAP_UNIT;
}

static struct fsdp_module *find_module(struct fsdp_module *m, const char *fqn) {
    if (!strcmp(m->fqn, fqn)) return m;
    for (int i = 0; i < m->n_children; i++) {
        struct fsdp_module *x = find_module(m->children[i], fqn);
        if (x) return x;
    }
    return NULL;
}

/* Runs block `fqn` of r's model forward and backward directly (its unit's
 * hooks gather and reduce-scatter) on x and dy; copies y, dx and the
 * block's reduced gradients out (caller frees). */
static void run_block(struct fsdp_ctx *c, struct run *r, const char *fqn, const float *x, const float *dy,
                      int64_t n, float **y, float **dx, float **grads, int64_t *n_grads) {
    struct fsdp_module *blk = find_module(r->g, fqn);
    if (!blk) abort();
    int64_t C = tiny_cfg().n_embd;
    struct fsdp_tensor tx = {0}, ty = {0}, tdy = {0}, tdx = {0};
    fsdp_arena_reset(c);
    tx.dtype = tdy.dtype = FSDP_F32;
    tx.ndim = tdy.ndim = 3;
    tx.shape[0] = tdy.shape[0] = 2;
    tx.shape[1] = tdy.shape[1] = n / (2 * C);
    tx.shape[2] = tdy.shape[2] = C;
    tx.data = fsdp_arena_alloc(c, (size_t)n * sizeof(float));
    tdy.data = fsdp_arena_alloc(c, (size_t)n * sizeof(float));
    memcpy(tx.data, x, (size_t)n * sizeof(float));
    memcpy(tdy.data, dy, (size_t)n * sizeof(float));
    if (fsdp_module_forward(blk, c, &tx, &ty) != FSDP_OK) abort();
    if (fsdp_module_backward(blk, c, &tdy, &tdx) != FSDP_OK) abort();
    *y = malloc((size_t)n * sizeof(float));
    *dx = malloc((size_t)n * sizeof(float));
    memcpy(*y, ty.data, (size_t)n * sizeof(float));
    memcpy(*dx, tdx.data, (size_t)n * sizeof(float));
    int ui = -1;
    for (int i = 0; i < fsdp_model_n_units(r->fm); i++) {
        struct fsdp_unit_info info;
        fsdp_model_unit_info(r->fm, i, &info);
        if (!strcmp(info.fqn, fqn)) ui = i;
    }
    struct fsdp_unit_info info;
    fsdp_model_unit_info(r->fm, ui, &info);
    *n_grads = info.numel_full;
    *grads = malloc((size_t)info.numel_full * sizeof(float));
    int64_t off = 0;
    for (int j = 0; j < info.n_params; j++) {
        struct fsdp_param *p = fsdp_module_find_param(r->g, info.param_fqns[j]);
        if (fsdp_model_get_grad(c, r->fm, info.param_fqns[j], *grads + off) != FSDP_OK) abort();
        off += p->numel;
    }
}

/* A unit overridden to FULL inside a bf16 model stays fp32 (gather, compute,
 * reduce): given the same input and output gradient, its output, input
 * gradient and reduced parameter gradients equal, bit for bit, those of the
 * same unit in an all-fp32 model; a bf16 unit of the same model does not. */
TEST(fp32_override_unit_bit_identical_to_fp32_run) {
    struct fsdp_ctx *c = get_ctx();
    struct fsdp_wrap_policy wp = {wrap_h1_fp32, NULL};
    struct run mixed, full;
    ASSERT_OK(run_create(c, FSDP_BF16, FSDP_MP_DEFAULT, &wp, &mixed), c);
    ASSERT_OK(run_create(c, FSDP_F32, FSDP_MP_FULL, &wp, &full), c);
    struct fsdp_unit_precision up;
    fsdp_model_unit_precision(mixed.fm, 2, &up); /* transformer.h.1 */
    CHECK(up.param_dtype == FSDP_F32 && up.reduce_dtype == FSDP_F32 && up.compute_dtype == FSDP_F32);
    CHECK(up.mixed_precision == FSDP_MP_FULL);
    fsdp_model_unit_precision(mixed.fm, 1, &up); /* transformer.h.0 */
    CHECK(up.param_dtype == FSDP_BF16 && up.reduce_dtype == FSDP_F32 && up.compute_dtype == FSDP_BF16);
    char plan[4096];
    fsdp_model_plan(mixed.fm, plan, sizeof plan);
    CHECK_STR_CONTAINS(plan, "'transformer.h.1' (Block): ");
    CHECK_STR_CONTAINS(plan, "precision FULL (param F32, reduce F32, compute F32) (overridden)");
    CHECK_STR_CONTAINS(plan, "precision DEFAULT (param BF16, reduce F32, compute BF16), ");
    int64_t C = tiny_cfg().n_embd, n = 2 * 8 * C;
    float *x = malloc((size_t)n * sizeof(float)), *dy = malloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) {
        x[i] = (float)sin(0.37 * (double)i + 0.1);
        dy[i] = (float)cos(0.11 * (double)i) * 1e-2f;
    }
    const char *names[2] = {"transformer.h.1", "transformer.h.0"};
    for (int k = 0; k < 2; k++) {
        float *y1, *dx1, *g1, *y2, *dx2, *g2;
        int64_t ng1, ng2;
        run_block(c, &mixed, names[k], x, dy, n, &y1, &dx1, &g1, &ng1);
        run_block(c, &full, names[k], x, dy, n, &y2, &dx2, &g2, &ng2);
        ASSERT_INT_EQ(ng1, ng2);
        int same = !memcmp(y1, y2, (size_t)n * 4) && !memcmp(dx1, dx2, (size_t)n * 4) &&
                   !memcmp(g1, g2, (size_t)ng1 * 4);
        if (k == 0 && !same) TEST_FAILF("the fp32-override unit differs from the all-fp32 run");
        if (k == 1 && same) TEST_FAILF("the bf16 unit equals the all-fp32 run: bf16 did not run");
        free(y1), free(dx1), free(g1), free(y2), free(dx2), free(g2);
    }
    free(x);
    free(dy);
    run_free(&mixed);
    run_free(&full);
}

/* ---- Bytes on the wire ---- */

static void comm_bytes(struct fsdp_ctx *c, uint64_t *ag, uint64_t *rs) {
    struct fsdp_comm_stats st;
    fsdp_comm_stats_get(fsdp_ctx_comm(c), &st);
    *ag = st.bytes[FSDP_COLL_ALLGATHER];
    *rs = st.bytes[FSDP_COLL_REDUCE_SCATTER];
}

/* A forward all-gathers every unit once: 4 bytes per shard element in fp32,
 * exactly 2 for bf16 units; PURE reduce-scatters half the bytes of DEFAULT. */
TEST(allgather_bytes_halve_for_bf16_units) {
    struct fsdp_ctx *c = get_ctx();
    int world = fsdp_ctx_world(c), rank = fsdp_ctx_rank(c);
    struct fsdp_data *data;
    ASSERT_OK(fsdp_data_synthetic(c, 7, 1 << 16, &data), c);
    int32_t in[B * T], tg[B * T];
    fsdp_data_batch(data, 0, B, T, rank, world, in, tg);
    const enum fsdp_dtype prec[3] = {FSDP_F32, FSDP_BF16, FSDP_BF16};
    const enum fsdp_mixed_precision mp[3] = {FSDP_MP_FULL, FSDP_MP_DEFAULT, FSDP_MP_PURE};
    uint64_t fwd[3], rs[3];
    int64_t shard_elems = 0;
    for (int k = 0; k < 3; k++) {
        struct run r;
        ASSERT_OK(run_create(c, prec[k], mp[k], NULL, &r), c);
        if (k == 0)
            for (int i = 0; i < fsdp_model_n_units(r.fm); i++) {
                struct fsdp_unit_info info;
                fsdp_model_unit_info(r.fm, i, &info);
                shard_elems += info.numel_shard;
            }
        uint64_t a0, r0, a1, r1, a2, r2;
        comm_bytes(c, &a0, &r0);
        float *logits;
        ASSERT_OK(fsdp_model_forward(c, r.fm, in, B / world, T, &logits), c);
        comm_bytes(c, &a1, &r1);
        struct fsdp_step_result res;
        ASSERT_OK(fsdp_model_train_step(c, r.fm, in, tg, B / world, T, 1e-3f, 1.0f, &res), c);
        comm_bytes(c, &a2, &r2);
        fwd[k] = a1 - a0;
        rs[k] = r2 - r1;
        run_free(&r);
    }
    if (world == 1) {
        CHECK_INT_EQ(fwd[0], 0);
        CHECK_INT_EQ(fwd[1], 0);
    } else {
        CHECK_INT_EQ(fwd[0], 4 * shard_elems);
        CHECK_INT_EQ(fwd[1], 2 * shard_elems);
        CHECK_INT_EQ(fwd[2], 2 * shard_elems);
        CHECK(rs[0] > 0);
        CHECK_INT_EQ(rs[1], rs[0]); /* DEFAULT reduces in fp32 */
        CHECK_INT_EQ(2 * rs[2], rs[0]);
    }
    fsdp_data_free(data);
}

TEST(precision_names_and_errors) {
    struct fsdp_ctx *c = get_ctx();
    enum fsdp_dtype dt;
    CHECK_OK(fsdp_precision_parse(c, "FP32", &dt), c);
    CHECK(dt == FSDP_F32);
    CHECK_OK(fsdp_precision_parse(c, "amp_bf16", &dt), c);
    CHECK(dt == FSDP_BF16);
    CHECK_OK(fsdp_precision_parse(c, "AMP_FP16", &dt), c);
    CHECK(dt == FSDP_F16);
    CHECK_INT_EQ(fsdp_precision_parse(c, "bf16", &dt), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "precision 'bf16' is not one of FP32, AMP_BF16, AMP_FP16");
    struct run r;
    ASSERT_OK(run_create(c, FSDP_F16, FSDP_MP_DEFAULT, NULL, &r), c);
    struct fsdp_loss_scale_opts lo = fsdp_loss_scale_opts_default();
    lo.backoff_factor = 1.5;
    CHECK_INT_EQ(fsdp_model_set_loss_scale(c, r.fm, &lo), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "backoff_factor 1.5");
    run_free(&r);
}

TEST_MAIN()
