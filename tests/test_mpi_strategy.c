/*
 * test_mpi_strategy.c - sharding strategies, gradient accumulation and
 * prefetch, run by tests/run.sh at 1, 2, 3 and 4 ranks. The oracle is the
 * unsharded 1-rank computation (a plain training loop over a materialized
 * model on the full global batch, in every rank's own process); gradient
 * accumulation is checked against one step on the K-times batch.
 */
#include "fsdp.h"
#include "harness.h"

#include <mpi.h>

#include "mpi_harness.h"
#include "ref_model.h"

/* internal (core-impl.h): frees the activation arena, so that a run measured
 * against a plan starts, as the plan does, from an empty one (the gradient
 * shards it lends depend on the pages it holds) */
void fsdp__arena_free_all(struct fsdp_ctx *ctx);

static struct fsdp_gpt_config tiny_cfg(void) {
    struct fsdp_gpt_config c;
    fsdp_gpt_config_preset("tiny", &c);
    return c;
}


/* ---- helpers ---- */

struct run {
    struct fsdp_module *g;
    struct fsdp_model *fm;
    struct fsdp_optim *opt;
};

/* The tiny model with n_layer Blocks (0: the preset's). */
static enum fsdp_status run_open_layers(struct fsdp_ctx *c, const struct fsdp_shard_opts *so, uint64_t seed,
                                        const struct fsdp_optim_opts *oo, int n_layer, struct run *r) {
    struct fsdp_gpt_config cfg = tiny_cfg();
    if (n_layer) cfg.n_layer = n_layer;
    memset(r, 0, sizeof *r);
    if (fsdp_gpt_create(c, &cfg, &r->g) != FSDP_OK) abort();
    enum fsdp_status st = fsdp_fully_shard(c, r->g, so, &r->fm);
    if (st != FSDP_OK) return st;
    st = fsdp_model_init_params(c, r->fm, seed);
    if (st == FSDP_OK) st = fsdp_optim_create(c, oo, &r->opt);
    if (st == FSDP_OK) st = fsdp_model_attach_optim(c, r->fm, r->opt);
    return st;
}

static enum fsdp_status run_open(struct fsdp_ctx *c, const struct fsdp_shard_opts *so, uint64_t seed,
                                 const struct fsdp_optim_opts *oo, struct run *r) {
    return run_open_layers(c, so, seed, oo, 0, r);
}

static void run_close(struct run *r) {
    fsdp_model_free(r->fm);
    fsdp_optim_free(r->opt);
    fsdp_module_free(r->g);
}

/* Trains `steps` steps of a global batch of 12 x 32 with the given options
 * and compares loss, grad norm, param norm and the final parameters with the
 * unsharded reference (1e-5). */
static void check_strategy(struct fsdp_ctx *c, const struct fsdp_shard_opts *so, int steps) {
    int rank = fsdp_comm_rank(fsdp_ctx_comm(c)), world = fsdp_comm_size(fsdp_ctx_comm(c));
    struct fsdp_gpt_config cfg = tiny_cfg();
    struct fsdp_data *data;
    ASSERT_OK(fsdp_data_synthetic(c, 7, 1 << 16, &data), c);
    /* SGD with momentum: linear in the gradients, so the parameters can be
     * compared element by element (AdamW divides tiny rounding differences
     * of near-zero gradients by their own tiny magnitude) */
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    oo.kind = FSDP_OPTIM_SGD;
    oo.momentum = 0.9f;
    struct ref r;
    ref_init(&r, c, &cfg, 5, &oo);
    struct run x;
    ASSERT_OK(run_open(c, so, 5, &oo, &x), c);
    const int B = 12, T = 32;
    int32_t *gin = malloc(B * T * sizeof(int32_t)), *gtg = malloc(B * T * sizeof(int32_t));
    int32_t *lin = malloc(B * T * sizeof(int32_t)), *ltg = malloc(B * T * sizeof(int32_t));
    for (int s = 0; s < steps; s++) {
        float lr = 0.05f;
        fsdp_data_batch(data, s, B, T, 0, 1, gin, gtg);
        fsdp_data_batch(data, s, B, T, rank, world, lin, ltg);
        double want[3];
        ref_step(&r, c, gin, gtg, B, T, lr, 0.5f, want);
        struct fsdp_step_result got;
        ASSERT_OK(fsdp_model_train_step(c, x.fm, lin, ltg, B / world, T, lr, 0.5f, &got), c);
        CHECK_NEAR(got.loss, want[0], 1e-5, 0);
        CHECK_NEAR(got.grad_norm, want[1], 1e-5, 0);
        CHECK_NEAR(got.param_norm, want[2], 1e-5, 0);
        CHECK(got.comm_wait_s >= 0);
    }
    /* every parameter, element by element */
    for (int i = 0; i < r.n; i++) {
        float *buf = malloc((size_t)r.p[i]->numel * sizeof(float));
        CHECK_OK(fsdp_model_get_param(c, x.fm, r.p[i]->fqn, buf), c);
        double mx, md = max_abs_diff(buf, r.p[i]->data, r.p[i]->numel, &mx);
        if (!(md <= 1e-5 * mx + 1e-7)) TEST_FAILF("%s differs: max diff %g (max %g)", r.p[i]->fqn, md, mx);
        free(buf);
    }
    free(gin); free(gtg); free(lin); free(ltg);
    run_close(&x);
    ref_free(&r);
    fsdp_data_free(data);
}

static struct fsdp_shard_opts opts_of(enum fsdp_sharding s, int k) {
    struct fsdp_shard_opts so = fsdp_shard_opts_default();
    so.sharding = s;
    so.shard_group = k;
    return so;
}

/* ---- strategies ---- */

TEST(full_shard_matches_unsharded) {
    struct fsdp_shard_opts so = opts_of(FSDP_FULL_SHARD, 0);
    check_strategy(get_ctx(), &so, 3);
}

TEST(shard_grad_op_matches_unsharded) {
    struct fsdp_shard_opts so = opts_of(FSDP_SHARD_GRAD_OP, 0);
    check_strategy(get_ctx(), &so, 3);
}

TEST(no_shard_matches_unsharded) {
    struct fsdp_shard_opts so = opts_of(FSDP_NO_SHARD, 0);
    check_strategy(get_ctx(), &so, 3);
}

/* Hybrid with a shard group of 2 (the 4-rank case: 2 replicas x 2 shards,
 * whose replica all-reduces overlap pipelines), and of 1 (pure replication
 * through the hybrid path) where 2 does not divide the world; overlap on
 * and off. */
TEST(hybrid_shard_group_matches_unsharded) {
    struct fsdp_ctx *c = get_ctx();
    int world = fsdp_comm_size(fsdp_ctx_comm(c));
    for (int ov = 1; ov >= 0; ov--) {
        struct fsdp_shard_opts so = opts_of(FSDP_HYBRID_SHARD, world % 2 == 0 ? 2 : 1);
        so.overlap = ov;
        check_strategy(c, &so, 3);
    }
}

/* Hybrid with the default group (the ranks of this host: all of them). */
TEST(hybrid_default_group_is_the_host) {
    struct fsdp_ctx *c = get_ctx();
    struct fsdp_shard_opts so = opts_of(FSDP_HYBRID_SHARD, 0);
    struct run x;
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    ASSERT_OK(run_open(c, &so, 5, &oo, &x), c);
    char buf[4096];
    fsdp_model_plan(x.fm, buf, sizeof buf);
    char want[96];
    snprintf(want, sizeof want, "sharding: HYBRID_SHARD, mesh {1 replicas, %d shards}",
             fsdp_comm_size(fsdp_ctx_comm(c)));
    CHECK_STR_CONTAINS(buf, want);
    run_close(&x);
}

/* The split on the shared-memory backend: a second context over shm, hybrid
 * with a group of 2 where the world allows. */
TEST(hybrid_on_shm_matches_unsharded) {
    int world = fsdp_comm_size(fsdp_ctx_comm(get_ctx()));
    if (world < 2) SKIP("needs 2+ ranks");
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.threads = 1;
    co.comm = FSDP_COMM_SHM;
    struct fsdp_ctx *c;
    ASSERT_OK(fsdp_ctx_create(&co, &c), ctx);
    CHECK_STR_EQ(fsdp_comm_backend(fsdp_ctx_comm(c)), "shm");
    struct fsdp_shard_opts so = opts_of(FSDP_HYBRID_SHARD, world % 2 == 0 ? 2 : 1);
    check_strategy(c, &so, 2);
    fsdp_ctx_free(c);
}

/* [Note: shared window] (src/fsdp/unit.c): on shm the shards lie in one
 * window of the host's ranks and a training step's fp32 gathers are
 * barriers: the unsharded reference's values under FULL_SHARD and
 * SHARD_GRAD_OP, overlap on and off; no parameter all-gathered in a training
 * step with it, the gathers' bytes with FSDP_SHM_WINDOW=0. */
static uint64_t step_gather_bytes(struct fsdp_ctx *c, struct run *x, uint64_t *barriers) {
    const int B = 4, T = 16;
    int32_t in[4 * 16], tg[4 * 16];
    for (int i = 0; i < B * T; i++) in[i] = i % 61, tg[i] = (i * 7) % 61;
    struct fsdp_comm_stats s0, s1;
    fsdp_model_comm_stats(x->fm, &s0);
    struct fsdp_step_result got;
    CHECK_OK(fsdp_model_train_step(c, x->fm, in, tg, B, T, 0.01f, 1.0f, &got), c);
    fsdp_model_comm_stats(x->fm, &s1);
    *barriers = s1.calls[FSDP_COLL_BARRIER] - s0.calls[FSDP_COLL_BARRIER];
    return s1.bytes[FSDP_COLL_ALLGATHER] - s0.bytes[FSDP_COLL_ALLGATHER];
}

TEST(shm_window_matches_unsharded) {
    int world = fsdp_comm_size(fsdp_ctx_comm(get_ctx()));
    if (world < 2) SKIP("needs 2+ ranks");
    for (int win = 1; win >= 0; win--) {
        struct fsdp_ctx *c = shm_ctx_window(win ? "1073741824" : "0"); /* a bound of 1 GiB, or none */
        ASSERT(c != NULL);
        for (int ov = 1; ov >= 0 && win; ov--) {
            struct fsdp_shard_opts so = opts_of(FSDP_FULL_SHARD, 0);
            so.overlap = ov;
            check_strategy(c, &so, 3);
        }
        if (win) {
            struct fsdp_shard_opts so = opts_of(FSDP_SHARD_GRAD_OP, 0);
            check_strategy(c, &so, 2);
        }
        struct fsdp_shard_opts so = opts_of(FSDP_FULL_SHARD, 0);
        struct fsdp_optim_opts oo = fsdp_optim_opts_default();
        struct run x;
        ASSERT_OK(run_open(c, &so, 5, &oo, &x), c);
        uint64_t barriers, bytes = step_gather_bytes(c, &x, &barriers);
        /* what is left is the step's few partial sums (step.c), not parameters */
        if (win) {
            CHECK(bytes < 256);
            CHECK(barriers >= (uint64_t)2 * 2); /* each Block unit: forward and backward */
        } else {
            CHECK(bytes > 4096);
            CHECK_INT_EQ(barriers, 0);
        }
        run_close(&x);
        fsdp_ctx_free(c);
    }
}

TEST(comm_split_groups) {
    struct fsdp_ctx *c = get_ctx();
    struct fsdp_comm *w = fsdp_ctx_comm(c), *s;
    int rank = fsdp_comm_rank(w), world = fsdp_comm_size(w);
    ASSERT_OK(fsdp_comm_split(w, rank % 2, -rank, &s), c); /* key reverses the order */
    int n = (world - rank % 2 + 1) / 2;
    CHECK_INT_EQ(fsdp_comm_size(s), n);
    CHECK_INT_EQ(fsdp_comm_rank(s), n - 1 - rank / 2);
    int32_t one = rank, sum = 0;
    CHECK_OK(fsdp_comm_allreduce(s, &one, &sum, 1, FSDP_I32, FSDP_SUM), c);
    int want = 0;
    for (int r = rank % 2; r < world; r += 2) want += r;
    CHECK_INT_EQ(sum, want);
    fsdp_comm_free(s);
}

/* Composer's 2-D mesh {replicas, shard group} is HYBRID_SHARD; the plan says so. */
TEST(parallelize_2d_mesh_is_hybrid) {
    struct fsdp_ctx *c = get_ctx();
    int world = fsdp_comm_size(fsdp_ctx_comm(c)), k = world % 2 == 0 ? 2 : 1;
    struct fsdp_gpt_config cfg = tiny_cfg();
    struct fsdp_module *g;
    ASSERT_OK(fsdp_gpt_create(c, &cfg, &g), c);
    struct fsdp_parallel_config pc = fsdp_parallel_config_default();
    pc.mesh[0] = world / k;
    pc.mesh[1] = k;
    struct fsdp_model *fm;
    ASSERT_OK(fsdp_parallelize_model(c, g, &pc, NULL, FSDP_F32, NULL, NULL, NULL, &fm), c);
    char buf[4096], want[96];
    fsdp_model_plan(fm, buf, sizeof buf);
    snprintf(want, sizeof want, "sharding: HYBRID_SHARD, mesh {%d replicas, %d shards}", world / k, k);
    CHECK_STR_CONTAINS(buf, want);
    fsdp_model_free(fm);
    fsdp_module_free(g);
    pc = fsdp_parallel_config_default();
    pc.sharding = FSDP_NO_SHARD;
    pc.mesh[0] = world / k;
    pc.mesh[1] = k;
    ASSERT_OK(fsdp_gpt_create(c, &cfg, &g), c);
    CHECK(fsdp_parallelize_model(c, g, &pc, NULL, FSDP_F32, NULL, NULL, NULL, &fm) == FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "2-D mesh means HYBRID_SHARD, but sharding is NO_SHARD");
    fsdp_module_free(g);
}

/* ---- errors name the flag ---- */

TEST(strategy_errors_name_the_flag) {
    struct fsdp_ctx *c = get_ctx();
    int world = fsdp_comm_size(fsdp_ctx_comm(c));
    enum fsdp_sharding s;
    CHECK(fsdp_sharding_parse(c, "ZERO3", &s) == FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD");
    CHECK_OK(fsdp_sharding_parse(c, "hybrid_shard", &s), c);
    CHECK_INT_EQ(s, FSDP_HYBRID_SHARD);
    struct run x;
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    struct fsdp_shard_opts so = opts_of(FSDP_HYBRID_SHARD, world + 1);
    CHECK(run_open(c, &so, 5, &oo, &x) == FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "--shard-group");
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "does not divide");
    fsdp_module_free(x.g);
    so = opts_of(FSDP_FULL_SHARD, 2);
    CHECK(run_open(c, &so, 5, &oo, &x) == FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "only for HYBRID_SHARD");
    fsdp_module_free(x.g);
}

/* ---- gradient accumulation ---- */

/* K micro-batches of B/K rows equal one step on the B-row batch (1e-6), in
 * both modes, under FULL_SHARD and HYBRID_SHARD. */
static void check_accum(enum fsdp_sharding sh, enum fsdp_grad_accum mode) {
    struct fsdp_ctx *c = get_ctx();
    int rank = fsdp_comm_rank(fsdp_ctx_comm(c)), world = fsdp_comm_size(fsdp_ctx_comm(c));
    struct fsdp_data *data;
    ASSERT_OK(fsdp_data_synthetic(c, 7, 1 << 16, &data), c);
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    struct fsdp_shard_opts so = opts_of(sh, sh == FSDP_HYBRID_SHARD ? (world % 2 == 0 ? 2 : 1) : 0);
    struct run big, acc;
    ASSERT_OK(run_open(c, &so, 9, &oo, &big), c);
    ASSERT_OK(run_open(c, &so, 9, &oo, &acc), c);
    const int K = 3, Bl = 6, T = 16; /* per rank: 3 micro-batches of 2 rows */
    int32_t *in = malloc(Bl * T * sizeof(int32_t)), *tg = malloc(Bl * T * sizeof(int32_t));
    for (int s = 0; s < 3; s++) {
        fsdp_data_batch(data, s, Bl * world, T, rank, world, in, tg);
        struct fsdp_step_result a, b;
        ASSERT_OK(fsdp_model_train_step(c, big.fm, in, tg, Bl, T, 3e-3f, 0.5f, &a), c);
        ASSERT_OK(fsdp_model_train_step_accum(c, acc.fm, in, tg, Bl / K, T, K, mode, 3e-3f, 0.5f, &b), c);
        CHECK_NEAR(b.loss, a.loss, 1e-6, 0);
        CHECK_NEAR(b.grad_norm, a.grad_norm, 1e-6, 0);
        CHECK_NEAR(b.param_norm, a.param_norm, 1e-6, 0);
    }
    free(in); free(tg);
    run_close(&big);
    run_close(&acc);
    fsdp_data_free(data);
}

TEST(grad_accum_reduce_each_equals_big_batch) { check_accum(FSDP_FULL_SHARD, FSDP_ACCUM_REDUCE_EACH); }
TEST(grad_accum_no_sync_equals_big_batch) { check_accum(FSDP_FULL_SHARD, FSDP_ACCUM_NO_SYNC); }
TEST(grad_accum_hybrid_both_modes) {
    check_accum(FSDP_HYBRID_SHARD, FSDP_ACCUM_REDUCE_EACH);
    check_accum(FSDP_HYBRID_SHARD, FSDP_ACCUM_NO_SYNC);
}
TEST(grad_accum_no_shard_no_sync) { check_accum(FSDP_NO_SHARD, FSDP_ACCUM_NO_SYNC); }

TEST(grad_accum_bad_count) {
    struct fsdp_ctx *c = get_ctx();
    struct fsdp_shard_opts so = opts_of(FSDP_FULL_SHARD, 0);
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    struct run x;
    ASSERT_OK(run_open(c, &so, 9, &oo, &x), c);
    int32_t in[16] = {0}, tg[16] = {0};
    struct fsdp_step_result r;
    CHECK(fsdp_model_train_step_accum(c, x.fm, in, tg, 1, 16, 0, FSDP_ACCUM_NO_SYNC, 1e-3f, 1, &r) ==
          FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "--grad-accum");
    run_close(&x);
}

/* ---- checkpoints: shard index and count from the shard group ---- */

/* A fixed per-rank batch of n tokens and targets (vocab 256). */
static void fixed_batch(int32_t *in, int32_t *tg, int n, int rank) {
    for (int i = 0; i < n; i++) {
        in[i] = (i * 7 + 3 * rank) % 256;
        tg[i] = (i * 5 + rank) % 256;
    }
}

/* A sharded checkpoint saved under HYBRID_SHARD (replica 0 writes) or
 * NO_SHARD loads into every other strategy with the same parameters and
 * optimizer state (the next step's loss and norms agree). */
TEST(checkpoint_across_strategies) {
    struct fsdp_ctx *c = get_ctx();
    int rank = fsdp_comm_rank(fsdp_ctx_comm(c)), world = fsdp_comm_size(fsdp_ctx_comm(c));
    int pid = (int)getpid();
    fsdp_comm_broadcast(fsdp_ctx_comm(c), &pid, 1, FSDP_I32, 0);
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    const int Bl = 2, T = 16;
    int32_t in[2 * 16], tg[2 * 16];
    fixed_batch(in, tg, Bl * T, rank);
    enum fsdp_sharding from[2] = {FSDP_HYBRID_SHARD, FSDP_NO_SHARD};
    for (int f = 0; f < 2; f++) {
        char dir[256];
        snprintf(dir, sizeof dir, "/tmp/fsdp-strategy-test-%d-w%d-%d", pid, world, f);
        struct fsdp_shard_opts so = opts_of(from[f], from[f] == FSDP_HYBRID_SHARD ? (world % 2 == 0 ? 2 : 1) : 0);
        struct run a;
        ASSERT_OK(run_open(c, &so, 11, &oo, &a), c);
        struct fsdp_step_result r0, want;
        ASSERT_OK(fsdp_model_train_step(c, a.fm, in, tg, Bl, T, 1e-3f, 1.0f, &r0), c);
        struct fsdp_ckpt_meta m = {0};
        m.step = 1;
        ASSERT_OK(fsdp_ckpt_save(c, a.fm, dir, &m), c);
        ASSERT_OK(fsdp_model_train_step(c, a.fm, in, tg, Bl, T, 1e-3f, 1.0f, &want), c);
        run_close(&a);
        for (int t = FSDP_FULL_SHARD; t <= FSDP_HYBRID_SHARD; t++) {
            struct fsdp_shard_opts to = opts_of((enum fsdp_sharding)t, t == FSDP_HYBRID_SHARD ? 1 : 0);
            struct run b;
            ASSERT_OK(run_open(c, &to, 99, &oo, &b), c);
            struct fsdp_ckpt_meta got = {0};
            ASSERT_OK(fsdp_ckpt_load(c, b.fm, dir, &got), c);
            CHECK_INT_EQ(got.step, 1);
            struct fsdp_step_result r;
            ASSERT_OK(fsdp_model_train_step(c, b.fm, in, tg, Bl, T, 1e-3f, 1.0f, &r), c);
            CHECK_NEAR(r.loss, want.loss, 1e-5, 0);
            CHECK_NEAR(r.grad_norm, want.grad_norm, 1e-5, 0);
            CHECK_NEAR(r.param_norm, want.param_norm, 1e-5, 0);
            run_close(&b);
        }
        fsdp_comm_barrier(fsdp_ctx_comm(c));
        if (rank == 0) {
            char cmd[600];
            snprintf(cmd, sizeof cmd, "rm -rf '%s' '%s.tmp'", dir, dir);
            if (system(cmd) != 0) fprintf(stderr, "  (could not remove %s)\n", dir);
        }
    }
}

/* ---- the planner accounts each strategy and accumulation mode ---- */

/* Options of strategy sh on this world (HYBRID: groups of 2 where the world
 * is even), with overlap and the in-flight limit. */
static struct fsdp_shard_opts strategy_opts(int world, enum fsdp_sharding sh, int overlap, int inflight) {
    struct fsdp_shard_opts so = opts_of(sh, sh == FSDP_HYBRID_SHARD ? (world % 2 == 0 ? 2 : 1) : 0);
    so.overlap = overlap;
    so.max_inflight = inflight;
    return so;
}

/* n_layer: Blocks of the tiny model (0: the preset's) */
static void check_plan_layers(enum fsdp_sharding sh, int accum, enum fsdp_grad_accum mode, int overlap,
                              int inflight, int n_layer) {
    struct fsdp_ctx *c = get_ctx();
    int rank = fsdp_comm_rank(fsdp_ctx_comm(c)), world = fsdp_comm_size(fsdp_ctx_comm(c));
    struct fsdp_shard_opts so = strategy_opts(world, sh, overlap, inflight);
    struct fsdp_gpt_config cfg = tiny_cfg();
    if (n_layer) cfg.n_layer = n_layer;
    struct fsdp_module *g;
    ASSERT_OK(fsdp_gpt_create(c, &cfg, &g), c);
    struct fsdp_mem_plan plan;
    const int Bm = 2, T = 16;
    ASSERT_OK(fsdp_plan_memory_accum(c, g, &so, world, rank, 2, Bm, T, 1, accum, mode, &plan), c);
    fsdp_module_free(g);
    struct fsdp_mem_stats m0, m;
    fsdp__arena_free_all(c);
    fsdp_mem_get(c, &m0);
    struct run x;
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    ASSERT_OK(run_open_layers(c, &so, 3, &oo, n_layer, &x), c);
    int32_t *in = calloc((size_t)(accum * Bm * T), sizeof(int32_t)), *tg = calloc((size_t)(accum * Bm * T), sizeof(int32_t));
    for (int i = 0; i < accum * Bm * T; i++) { in[i] = (i * 7 + rank) % 256; tg[i] = (i * 5 + 1) % 256; }
    fsdp_mem_reset_peak(c);
    for (int step = 0; step < 2; step++) {
        struct fsdp_step_result res;
        CHECK_OK(fsdp_model_train_step_accum(c, x.fm, in, tg, Bm, T, accum, mode, 1e-3f, 1.0f, &res), c);
    }
    fsdp_mem_get(c, &m);
    CHECK_INT_EQ(m.cur[FSDP_MEM_SHARD] - m0.cur[FSDP_MEM_SHARD], plan.params + plan.grads + plan.optim);
    if (m.peak[FSDP_MEM_FULL] != plan.full)
        TEST_FAILF("%s, %d micro-batches (mode %d), overlap %d/%d: full buffers measured %zu, planned %zu",
                   fsdp_sharding_name(sh), accum, (int)mode, overlap, inflight, m.peak[FSDP_MEM_FULL], plan.full);
    free(in);
    free(tg);
    run_close(&x);
}

static void check_plan(enum fsdp_sharding sh, int accum, enum fsdp_grad_accum mode, int overlap, int inflight) {
    check_plan_layers(sh, accum, mode, overlap, inflight, 0);
}

/* ---- overlap: prefetch and asynchronous reductions change no bit ---- */

static void train_bits(enum fsdp_sharding sh, int overlap, int inflight, int accum, enum fsdp_grad_accum mode,
                       double out[3], float *param, const char *fqn) {
    struct fsdp_ctx *c = get_ctx();
    int rank = fsdp_comm_rank(fsdp_ctx_comm(c)), world = fsdp_comm_size(fsdp_ctx_comm(c));
    struct fsdp_shard_opts so = strategy_opts(world, sh, overlap, inflight);
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    struct run x;
    if (run_open(c, &so, 21, &oo, &x) != FSDP_OK) abort();
    const int Bl = 4, T = 16;
    int32_t in[4 * 16], tg[4 * 16];
    for (int s = 0; s < 3; s++) {
        for (int i = 0; i < Bl * T; i++) { in[i] = (i * 7 + 3 * rank + s) % 256; tg[i] = (i * 5 + rank + 2 * s) % 256; }
        struct fsdp_step_result r;
        if (fsdp_model_train_step_accum(c, x.fm, in, tg, Bl / accum, T, accum, mode, 1e-3f, 1.0f, &r) != FSDP_OK)
            abort();
        out[0] = r.loss, out[1] = r.grad_norm, out[2] = r.param_norm;
    }
    if (fsdp_model_get_param(c, x.fm, fqn, param) != FSDP_OK) abort();
    run_close(&x);
}

TEST(overlap_on_off_bit_identical) {
    const char *fqn = "transformer.h.1.mlp.c_fc.weight";
    struct fsdp_gpt_config cfg = tiny_cfg();
    size_t n = (size_t)(4 * cfg.n_embd * cfg.n_embd);
    float *a = malloc(n * sizeof(float)), *b = malloc(n * sizeof(float));
    for (int s = FSDP_FULL_SHARD; s <= FSDP_HYBRID_SHARD; s++)
        for (int k = 0; k < 3; k++) {
            int accum = k ? 2 : 1;
            enum fsdp_grad_accum mode = k == 2 ? FSDP_ACCUM_NO_SYNC : FSDP_ACCUM_REDUCE_EACH;
            double ra[3], rb[3], rc[3];
            train_bits((enum fsdp_sharding)s, 0, 2, accum, mode, ra, a, fqn);
            train_bits((enum fsdp_sharding)s, 1, 2, accum, mode, rb, b, fqn);
            if (memcmp(ra, rb, sizeof ra) || memcmp(a, b, n * sizeof(float)))
                TEST_FAILF("%s, accum %d mode %d: overlap on differs from off (loss %.9g vs %.9g)",
                           fsdp_sharding_name((enum fsdp_sharding)s), accum, (int)mode, rb[0], ra[0]);
            train_bits((enum fsdp_sharding)s, 1, 3, accum, mode, rc, b, fqn);
            if (memcmp(ra, rc, sizeof ra) || memcmp(a, b, n * sizeof(float)))
                TEST_FAILF("%s: max_inflight 3 differs from overlap off", fsdp_sharding_name((enum fsdp_sharding)s));
        }
    free(a);
    free(b);
}

/* internal (src/fsdp/fsdp-impl.h): replica all-reduces that post-backward
 * hooks left in flight since the model was made */
int64_t fsdp__model_rep_deferred(const struct fsdp_model *fm);

/* Under HYBRID with 2+ ranks per shard group and 2+ replicas (4 ranks),
 * overlap leaves each unit's all-reduce over the replicas in flight past its
 * post-backward, to be waited at the next one (all but the last unit of
 * each backward that reduces), and issues exactly the collectives (calls
 * and bytes per type) that overlap off issues. Other strategies, other
 * worlds and overlap off leave none in flight. */
TEST(hybrid_replica_allreduce_left_in_flight) {
    struct fsdp_ctx *c = get_ctx();
    int rank = fsdp_comm_rank(fsdp_ctx_comm(c)), world = fsdp_comm_size(fsdp_ctx_comm(c));
    int two_stage = world % 2 == 0 && world / 2 >= 2; /* strategy_opts' groups of 2 */
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    const int Bl = 4, T = 16;
    int32_t in[4 * 16], tg[4 * 16];
    fixed_batch(in, tg, Bl * T, rank);
    enum fsdp_sharding shs[2] = {FSDP_FULL_SHARD, FSDP_HYBRID_SHARD};
    for (int k = 0; k < 2; k++) {
        struct fsdp_comm_stats d[2];
        for (int ov = 0; ov < 2; ov++) {
            struct fsdp_shard_opts so = strategy_opts(world, shs[k], ov, 2);
            struct run x;
            ASSERT_OK(run_open(c, &so, 13, &oo, &x), c);
            struct fsdp_comm_stats s0, s1;
            fsdp_model_comm_stats(x.fm, &s0);
            struct fsdp_step_result r;
            /* backwards that reduce: 1, then 2 (reduce each), then 1 (no_sync's last) */
            ASSERT_OK(fsdp_model_train_step(c, x.fm, in, tg, Bl, T, 1e-3f, 1.0f, &r), c);
            ASSERT_OK(fsdp_model_train_step_accum(c, x.fm, in, tg, Bl / 2, T, 2, FSDP_ACCUM_REDUCE_EACH, 1e-3f,
                                                  1.0f, &r), c);
            ASSERT_OK(fsdp_model_train_step_accum(c, x.fm, in, tg, Bl / 2, T, 2, FSDP_ACCUM_NO_SYNC, 1e-3f, 1.0f,
                                                  &r), c);
            fsdp_model_comm_stats(x.fm, &s1);
            for (int t = 0; t < FSDP_COLL_COUNT; t++) {
                d[ov].calls[t] = s1.calls[t] - s0.calls[t];
                d[ov].bytes[t] = s1.bytes[t] - s0.bytes[t];
            }
            int64_t want = shs[k] == FSDP_HYBRID_SHARD && ov && two_stage ? 4 * (fsdp_model_n_units(x.fm) - 1) : 0;
            if (fsdp__model_rep_deferred(x.fm) != want)
                TEST_FAILF("%s, overlap %d: %lld replica all-reduces left in flight, want %lld",
                           fsdp_sharding_name(shs[k]), ov, (long long)fsdp__model_rep_deferred(x.fm),
                           (long long)want);
            run_close(&x);
        }
        for (int t = 0; t < FSDP_COLL_COUNT; t++)
            if (d[0].calls[t] != d[1].calls[t] || d[0].bytes[t] != d[1].bytes[t])
                TEST_FAILF("%s: collective type %d: overlap on issues %llu calls (%llu bytes), off %llu (%llu)",
                           fsdp_sharding_name(shs[k]), t, (unsigned long long)d[1].calls[t],
                           (unsigned long long)d[1].bytes[t], (unsigned long long)d[0].calls[t],
                           (unsigned long long)d[0].bytes[t]);
    }
}

/* internal (core-impl.h): the allocation-failure injection hook */
extern _Thread_local long fsdp__alloc_count, fsdp__alloc_fail_at;

/* A step that fails midway, with reductions in flight: for every k, the
 * k-th library allocation of a steady-state step fails on every rank alike
 * (the same allocations in the same order: mostly collective requests, so
 * a collective start fails while earlier ones, such as a replica all-reduce
 * the pipeline left in flight, are still running). The step reports it,
 * every request and staging buffer comes back by the time it returns
 * (reshard_all waits what is in flight), and freeing the model returns every
 * accounted byte. */
static void check_step_fails_cleanly(enum fsdp_sharding sh, int overlap) {
    struct fsdp_ctx *c = get_ctx();
    int rank = fsdp_comm_rank(fsdp_ctx_comm(c)), world = fsdp_comm_size(fsdp_ctx_comm(c));
    struct fsdp_shard_opts so = strategy_opts(world, sh, overlap, 2);
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    const int Bl = 4, T = 16;
    int32_t in[4 * 16], tg[4 * 16];
    fixed_batch(in, tg, Bl * T, rank);
    struct fsdp_step_result r, ref = {0};
    long n = -1, failed = 0;
    for (long k = 0; k <= n || n < 0; k++) { /* k = 0: count the allocations */
        struct fsdp_mem_stats m0, m1, m2;
        fsdp_mem_get(c, &m0);
        struct run x;
        ASSERT_OK(run_open(c, &so, 17, &oo, &x), c);
        ASSERT_OK(fsdp_model_train_step(c, x.fm, in, tg, Bl, T, 1e-3f, 1.0f, &r), c); /* the pool is warm */
        fsdp_mem_get(c, &m1);
        fsdp__alloc_count = 0;
        fsdp__alloc_fail_at = k;
        enum fsdp_status st = fsdp_model_train_step(c, x.fm, in, tg, Bl, T, 1e-3f, 1.0f, &r);
        fsdp__alloc_fail_at = 0;
        if (k == 0) {
            ASSERT_OK(st, c);
            n = fsdp__alloc_count;
            ref = r;
            ASSERT(n > 0);
        } else if (st == FSDP_OK && (r.loss != ref.loss || r.grad_norm != ref.grad_norm)) {
            /* a block with a fallback (the optimizer's partial sums): the step
             * goes on without it and must compute the same values */
            TEST_FAILF("%s, overlap %d, allocation %ld of %ld: the step went on without it but got loss %.9g, "
                       "grad norm %.9g (%.9g, %.9g with it)", fsdp_sharding_name(sh), overlap, k, n, (double)r.loss,
                       (double)r.grad_norm, (double)ref.loss, (double)ref.grad_norm);
        } else if (st != FSDP_OK && !strstr(fsdp_errmsg(c), "out of memory")) {
            TEST_FAILF("%s, overlap %d, allocation %ld of %ld: got %s (%s)", fsdp_sharding_name(sh), overlap, k, n,
                       fsdp_status_str(st), fsdp_errmsg(c));
        }
        failed += k > 0 && st != FSDP_OK;
        fsdp_mem_get(c, &m2);
        if (m2.cur[FSDP_MEM_OTHER] != m1.cur[FSDP_MEM_OTHER])
            TEST_FAILF("%s, overlap %d, allocation %ld of %ld: %lld bytes of requests or staging left after the "
                       "step", fsdp_sharding_name(sh), overlap, k, n,
                       (long long)m2.cur[FSDP_MEM_OTHER] - (long long)m1.cur[FSDP_MEM_OTHER]);
        run_close(&x);
        fsdp_mem_get(c, &m2);
        long long left = (long long)(m2.cur_total - m2.cur[FSDP_MEM_ACT]) - (long long)(m0.cur_total - m0.cur[FSDP_MEM_ACT]);
        if (left != 0)
            TEST_FAILF("%s, overlap %d, allocation %ld of %ld: %lld accounted bytes not returned",
                       fsdp_sharding_name(sh), overlap, k, n, left);
        if (test_combine) test_combine(0); /* every rank finished the case */
    }
    /* the injection reached the step: most allocations have no fallback */
    if (!(2 * failed > n))
        TEST_FAILF("%s, overlap %d: only %ld of %ld injected allocation failures failed the step", fsdp_sharding_name(sh),
                   overlap, failed, n);
}

TEST(hybrid_step_failing_midway_cleans_up) {
    check_step_fails_cleanly(FSDP_HYBRID_SHARD, 1);
    check_step_fails_cleanly(FSDP_HYBRID_SHARD, 0);
}

/* Under overlap, gathers really are issued ahead: the peak of full buffers
 * in a training step grows by the units in flight, and so does the plan's. */
TEST(overlap_holds_more_buffers) {
    struct fsdp_ctx *c = get_ctx();
    int rank = fsdp_comm_rank(fsdp_ctx_comm(c)), world = fsdp_comm_size(fsdp_ctx_comm(c));
    if (world < 2) SKIP("nothing is gathered in a world of one");
    struct fsdp_gpt_config cfg = tiny_cfg();
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    int32_t in[2 * 16], tg[2 * 16];
    fixed_batch(in, tg, 2 * 16, rank);
    size_t planned[2], measured[2];
    for (int ov = 0; ov < 2; ov++) {
        struct fsdp_shard_opts so = opts_of(FSDP_FULL_SHARD, 0);
        so.overlap = ov;
        struct fsdp_module *g; /* planned before sharding, as fsdp_plan_memory takes it */
        ASSERT_OK(fsdp_gpt_create(c, &cfg, &g), c);
        struct fsdp_mem_plan p;
        ASSERT_OK(fsdp_plan_memory(c, g, &so, world, rank, 2, 2, 16, 1, &p), c);
        planned[ov] = p.full;
        fsdp_module_free(g);
        struct run x;
        ASSERT_OK(run_open(c, &so, 17, &oo, &x), c);
        struct fsdp_step_result r;
        ASSERT_OK(fsdp_model_train_step(c, x.fm, in, tg, 2, 16, 1e-3f, 1.0f, &r), c); /* the pool is warm */
        fsdp_mem_reset_peak(c);
        ASSERT_OK(fsdp_model_train_step(c, x.fm, in, tg, 2, 16, 1e-3f, 1.0f, &r), c);
        struct fsdp_mem_stats m;
        fsdp_mem_get(c, &m);
        measured[ov] = m.peak[FSDP_MEM_FULL];
        run_close(&x);
    }
    if (!(measured[1] > measured[0]))
        TEST_FAILF("peak of full buffers in a step: %zu bytes with overlap, %zu without", measured[1], measured[0]);
    if (!(planned[1] > planned[0]))
        TEST_FAILF("planned full buffers: %zu bytes with overlap, %zu without", planned[1], planned[0]);
}

/* HYBRID at 4 ranks with overlap keeps a unit's accumulation buffer until
 * its replica all-reduce lands at the next post-backward: with 4 Blocks and
 * 3 micro-batches reduced each, that buffer raises the peak of the pool, so
 * the plan must follow the pipeline to match */
TEST(plan_equals_measured_hybrid_pipeline_accum) {
    check_plan_layers(FSDP_HYBRID_SHARD, 3, FSDP_ACCUM_REDUCE_EACH, 1, 2, 4);
    check_plan_layers(FSDP_HYBRID_SHARD, 3, FSDP_ACCUM_REDUCE_EACH, 0, 2, 4);
}

TEST(plan_equals_measured_per_strategy) {
    for (int s = FSDP_FULL_SHARD; s <= FSDP_HYBRID_SHARD; s++) {
        for (int ov = 0; ov < 3; ov++) { /* off; on, 2 in flight; on, 3 */
            check_plan((enum fsdp_sharding)s, 1, FSDP_ACCUM_REDUCE_EACH, ov > 0, ov + 1);
            check_plan((enum fsdp_sharding)s, 3, FSDP_ACCUM_REDUCE_EACH, ov > 0, ov + 1);
            check_plan((enum fsdp_sharding)s, 3, FSDP_ACCUM_NO_SYNC, ov > 0, ov + 1);
        }
    }
}

TEST_MAIN()
