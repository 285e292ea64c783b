/*
 * test_mpi_modules.c - what a user module reaches of the sharded model, at
 * 1-4 ranks: collectives inside a forward and a backward (a SyncBatchNorm-
 * like module all-reducing per-channel sums) under every strategy with
 * overlap on and off, against the same model trained in a world of one;
 * post-step hooks that summon one unit with write-back; optimizer groups
 * frozen and re-scaled between steps; a hook that calls a collective on one
 * rank only, named by the schedule check.
 */
#include "fsdp.h"
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function" /* toy.h's helpers this file does not use */
#include "../examples/toy.h" /* before mpi_harness.h, whose global ctx its parameters would shadow */
#pragma GCC diagnostic pop
#include "toy_norm.h"
#include "fsdp/fsdp-impl.h"
#include "nn/nn-impl.h"
#include "harness.h"
#include "mpi_harness.h"

static enum fsdp_dtype prep_precision = FSDP_F32; /* prepare()'s compute precision */

struct run {
    struct fsdp_module *root;
    struct fsdp_optim *opt;
    struct fsdp_model *fm;
    double gnorm[8]; /* each step's gradient norm (steps 0..7) */
};

static enum fsdp_status prepare(struct fsdp_ctx *c, struct run *r, enum fsdp_sharding sh, int overlap,
                                int hybrid_group, enum fsdp_optim_kind kind, int head_group) {
    memset(r, 0, sizeof *r);
    r->root = build(c);
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    oo.kind = kind;
    oo.momentum = kind == FSDP_OPTIM_SGD ? 0.5f : 0.0f;
    FSDP_TRY(fsdp_optim_create(c, &oo, &r->opt));
    if (head_group) {
        const char *names[2] = {"head.weight", "head.bias"};
        FSDP_TRY(fsdp_optim_add_group(r->opt, names, 2, 0.1f, 1.0f));
    }
    struct fsdp_parallel_config pc = fsdp_parallel_config_default();
    pc.sharding = sh;
    pc.overlap = overlap;
    if (hybrid_group) {
        pc.mesh[0] = fsdp_ctx_world(c) / hybrid_group;
        pc.mesh[1] = hybrid_group;
    }
    if (prep_precision != FSDP_F32) pc.mixed_precision = FSDP_MP_DEFAULT;
    struct fsdp_wrap_policy wp = {wrap_children, NULL};
    return fsdp_parallelize_model(c, r->root, &pc, r->opt, prep_precision, &wp, NULL, NULL, &r->fm);
}

static void finish(struct run *r) {
    fsdp_model_free(r->fm);
    fsdp_optim_free(r->opt);
    fsdp_module_free(r->root);
}

/* `steps` steps on this rank's share of the global batch (B rows). */
static enum fsdp_status train(struct fsdp_ctx *c, struct run *r, int step0, int steps) {
    int world = fsdp_ctx_world(c), rank = fsdp_ctx_rank(c), Bl = B / world;
    int32_t in[B * T], tg[B * T];
    for (int s = step0; s < step0 + steps; s++) {
        toy_batch(s, B, T, V, rank, world, in, tg);
        struct fsdp_step_result res;
        FSDP_TRY(fsdp_model_train_step(c, r->fm, in, tg, Bl, T, 0.05f, 1.0f, &res));
        if (s < 8) r->gnorm[s] = res.grad_norm;
    }
    return FSDP_OK;
}

static struct fsdp_ctx *self_ctx(void) {
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.threads = 1;
    co.comm = FSDP_COMM_SELF;
    struct fsdp_ctx *c = NULL;
    if (fsdp_ctx_create(&co, &c) != FSDP_OK) abort();
    return c;
}

static const char *const param_names[] = {"embed.weight", "norm.weight", "norm.bias", "head.weight", "head.bias"};

/* every parameter and buffer of a against b (the world-of-one run), and the
 * gradient norms of the steps both ran (an update of AdamW, clipped or not,
 * hardly shows a gradient's scale) */
static void compare_runs(struct run *a, struct fsdp_ctx *ca, struct run *b, struct fsdp_ctx *cb, double tol) {
    float x[V * C], y[V * C];
    for (int i = 0; i < 5; i++) {
        CHECK_OK(fsdp_model_get_param(ca, a->fm, param_names[i], x), ca);
        CHECK_OK(fsdp_model_get_param(cb, b->fm, param_names[i], y), cb);
        int64_t n = fsdp_module_find_param(a->root, param_names[i])->numel;
        double rmax, d = max_abs_diff(x, y, n, &rmax);
        if (d > tol * (1 + rmax)) TEST_FAILF("%s differs from the world of one by %g", param_names[i], d);
    }
    const char *bufs[2] = {"norm.running_mean", "norm.running_var"};
    for (int i = 0; i < 2; i++) {
        struct fsdp_buffer *p = fsdp_module_find_buffer(a->root, bufs[i]), *q = fsdp_module_find_buffer(b->root, bufs[i]);
        double rmax, d = max_abs_diff(p->data, q->data, C, &rmax);
        if (d > tol * (1 + rmax)) TEST_FAILF("%s differs from the world of one by %g", bufs[i], d);
    }
    CHECK_INT_EQ(*(int64_t *)fsdp_module_find_buffer(a->root, "norm.num_batches_tracked")->data,
                 *(int64_t *)fsdp_module_find_buffer(b->root, "norm.num_batches_tracked")->data);
    for (int s = 0; s < 8; s++) {
        if (a->gnorm[s] == 0 && b->gnorm[s] == 0) continue; /* a step neither ran */
        if (!(fabs(a->gnorm[s] - b->gnorm[s]) <= tol * (1 + b->gnorm[s])))
            TEST_FAILF("step %d's gradient norm %.9g differs from the world of one's %.9g", s, a->gnorm[s], b->gnorm[s]);
    }
}

static void check_syncnorm(enum fsdp_sharding sh, int overlap, int hybrid_group) {
    struct fsdp_ctx *c = get_ctx(), *one = self_ctx();
    struct run r, ref;
    ASSERT_OK(prepare(c, &r, sh, overlap, hybrid_group, FSDP_OPTIM_ADAMW, 0), c);
    ASSERT_OK(prepare(one, &ref, FSDP_FULL_SHARD, overlap, 0, FSDP_OPTIM_ADAMW, 0), one);
    struct fsdp_comm_stats s0, s1;
    fsdp_comm_stats_get(fsdp_ctx_comm(c), &s0);
    CHECK_OK(train(c, &r, 0, 3), c);
    fsdp_comm_stats_get(fsdp_ctx_comm(c), &s1);
    CHECK_OK(train(one, &ref, 0, 3), one);
    compare_runs(&r, c, &ref, one, 1e-5);
    CHECK_INT_EQ(*(int64_t *)fsdp_module_find_buffer(r.root, "norm.num_batches_tracked")->data, 3);
    /* 3 forward + 2 backward all-reduces per step on the context's communicator */
    if (fsdp_ctx_world(c) > 1) CHECK(s1.calls[FSDP_COLL_ALLREDUCE] - s0.calls[FSDP_COLL_ALLREDUCE] >= 15);
    /* eval mode: the running statistics, no collective, every rank the same logits */
    fsdp_module_set_training(r.root, 0);
    int32_t in[B * T], tg[B * T];
    toy_batch(7, B, T, V, 0, 1, in, tg);
    float *lg = NULL;
    CHECK_OK(fsdp_model_forward(c, r.fm, in, 1, T, &lg), c);
    fsdp_module_set_training(ref.root, 0);
    float *lg1 = NULL;
    CHECK_OK(fsdp_model_forward(one, ref.fm, in, 1, T, &lg1), one);
    if (lg && lg1) CHECK(max_abs_diff(lg, lg1, T * V, NULL) < 1e-4);
    finish(&r);
    finish(&ref);
    fsdp_ctx_free(one);
}

/* [Note: lazy widening]: a weight tied to by a layer that reads its values
 * through data (a user module) is no longer lp_reader once sharded, so a
 * 16-bit training pass widens it (the user module would find data NULL
 * otherwise); untied, the built-in Linear's weight stays lazily widened */
TEST(weight_tied_to_user_reader_is_widened) {
    struct fsdp_ctx *c = get_ctx();
    for (int tie = 0; tie < 2; tie++) {
        struct fsdp_module *root = toy_seq(c, NULL, ""), *lin;
        ASSERT_OK(fsdp__linear_create(c, "lin", 8, 8, 0, 0.02f, &lin), c);
        ASSERT_OK(fsdp_module_add_child(c, root, lin), c);
        struct fsdp_module *user = toy_linear(c, root, "user", 8, 8, 0.3f);
        if (tie) user->params[0]->tied_to = lin->params[0];
        ASSERT_OK(fsdp_module_finalize(c, root), c);
        struct fsdp_model *fm;
        ASSERT_OK(fsdp_fully_shard(c, root, NULL, &fm), c);
        CHECK_INT_EQ(lin->params[0]->priv->lp_reader, !tie);
        fsdp_model_free(fm);
        fsdp_module_free(root);
    }
}

TEST(syncnorm_full_shard_overlap_matches_one_rank) { check_syncnorm(FSDP_FULL_SHARD, 1, 0); }
TEST(syncnorm_full_shard_no_overlap_matches_one_rank) { check_syncnorm(FSDP_FULL_SHARD, 0, 0); }
TEST(syncnorm_shard_grad_op_matches_one_rank) { check_syncnorm(FSDP_SHARD_GRAD_OP, 1, 0); }
TEST(syncnorm_no_shard_matches_one_rank) { check_syncnorm(FSDP_NO_SHARD, 1, 0); }
TEST(syncnorm_hybrid_spans_all_ranks) {
    if (fsdp_ctx_world(get_ctx()) != 4) SKIP("HYBRID_SHARD {2 x 2} needs 4 ranks");
    check_syncnorm(FSDP_HYBRID_SHARD, 1, 2);
}

/* ---- Frozen and re-scaled groups ---- */

/* This rank's optimizer state of the head group's slices, appended to out. */
static int64_t head_state(struct run *r, float *out) {
    int64_t n = 0;
    struct fsdp_model *fm = r->fm;
    int k = fsdp_optim_state_per_elem(r->opt);
    for (int i = 0; i < fm->n_units; i++)
        for (int j = 0; j < fm->units[i].n_slices; j++) {
            const struct fsdp_optim_slice *sl = &fm->units[i].slices[j];
            if (sl->decay != 2) continue;
            for (int q = 0; q < k; q++) {
                memcpy(out + n, sl->state + q * sl->state_stride, (size_t)sl->n * sizeof(float));
                n += sl->n;
            }
        }
    return n;
}

static void check_frozen(enum fsdp_optim_kind kind) {
    struct fsdp_ctx *c = get_ctx();
    struct run r;
    ASSERT_OK(prepare(c, &r, FSDP_FULL_SHARD, 1, 0, kind, 1), c);
    ASSERT_INT_EQ(fsdp_optim_n_groups(r.opt), 1);
    CHECK_OK(train(c, &r, 0, 1), c); /* state no longer zero */
    struct fsdp_optim_group_settings gs;
    ASSERT_OK(fsdp_optim_group_get(r.opt, 1, &gs), c);
    gs.frozen = 1;
    ASSERT_OK(fsdp_optim_group_set(r.opt, 1, &gs), c);
    /* an edit of the frozen weights before the frozen steps (its 16-bit copy is then stale until
     * a step writes it: the optimizer must write it for skipped slices too) */
    ASSERT_OK(fsdp_summon_full_params(c, r.fm, r.root->children[2], 1, 0), c);
    struct fsdp_param *hw = fsdp_module_find_param(r.root, "head.weight");
    for (int i = 0; i < V * C; i++) hw->data[i] *= 0.5f;
    ASSERT_OK(fsdp_summon_end(c, r.fm), c);
    float w0[V * C], w1[V * C], e0[V * C], e1[V * C], b0[V], b1[V], st0[4 * V * C], st1[4 * V * C], g[V * C];
    CHECK_OK(fsdp_model_get_param(c, r.fm, "head.weight", w0), c);
    CHECK_OK(fsdp_model_get_param(c, r.fm, "head.bias", b0), c);
    CHECK_OK(fsdp_model_get_param(c, r.fm, "embed.weight", e0), c);
    int64_t ns = head_state(&r, st0);
    CHECK_OK(train(c, &r, 1, 3), c);
    CHECK_OK(fsdp_model_get_param(c, r.fm, "head.weight", w1), c);
    CHECK_OK(fsdp_model_get_param(c, r.fm, "head.bias", b1), c);
    CHECK_OK(fsdp_model_get_param(c, r.fm, "embed.weight", e1), c);
    CHECK_OK(fsdp_model_get_grad(c, r.fm, "head.weight", g), c);
    CHECK_INT_EQ(head_state(&r, st1), ns);
    CHECK(memcmp(w0, w1, sizeof w0) == 0); /* bit-identical while frozen */
    CHECK(memcmp(b0, b1, sizeof b0) == 0);
    CHECK(memcmp(st0, st1, (size_t)ns * sizeof(float)) == 0);
    CHECK(memcmp(e0, e1, sizeof e0) != 0); /* the rest trains */
    int zero = 1;
    for (int i = 0; i < V * C; i++) zero &= g[i] == 0.0f;
    CHECK(zero); /* a frozen gradient reads as none */
    /* unfrozen: it trains again */
    gs.frozen = 0;
    ASSERT_OK(fsdp_optim_group_set(r.opt, 1, &gs), c);
    CHECK_OK(train(c, &r, 4, 1), c);
    CHECK_OK(fsdp_model_get_param(c, r.fm, "head.weight", w1), c);
    CHECK(memcmp(w0, w1, sizeof w0) != 0);
    /* lr_scale 0 (AdamW, no decay): parameters stay, the state moves: not the same as frozen */
    if (kind == FSDP_OPTIM_ADAMW) {
        gs.lr_scale = 0.0f;
        gs.weight_decay = 0.0f;
        ASSERT_OK(fsdp_optim_group_set(r.opt, 1, &gs), c);
        CHECK_OK(fsdp_model_get_param(c, r.fm, "head.weight", w0), c);
        head_state(&r, st0);
        CHECK_OK(train(c, &r, 5, 1), c);
        CHECK_OK(fsdp_model_get_param(c, r.fm, "head.weight", w1), c);
        head_state(&r, st1);
        CHECK(memcmp(w0, w1, sizeof w0) == 0);
        if (ns > 0) CHECK(memcmp(st0, st1, (size_t)ns * sizeof(float)) != 0);
    }
    /* bad input names the group */
    CHECK_INT_EQ(fsdp_optim_group_set(r.opt, 2, &gs), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "group 2 does not exist");
    gs.lr_scale = -1.0f;
    CHECK_INT_EQ(fsdp_optim_group_set(r.opt, 1, &gs), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "lr_scale");
    finish(&r);
}

TEST(frozen_group_adamw_bit_identical) { check_frozen(FSDP_OPTIM_ADAMW); }
TEST(frozen_group_sgd_momentum_bit_identical) { check_frozen(FSDP_OPTIM_SGD); }
/* 16-bit gathers: the skipped slices still write the shard's 16-bit copy
 * (FSDP_CHECK_LP_COPY, set by tests/run.sh, compares every gather with a cast) */
TEST(frozen_group_amp_bf16_bit_identical) {
    prep_precision = FSDP_BF16;
    check_frozen(FSDP_OPTIM_ADAMW);
    prep_precision = FSDP_F32;
}

/* ---- Post-step hooks ---- */

struct hook_count {
    int calls;
};

/* VISSL's prototype normalisation: the head's weight rows to unit L2 norm,
 * through a summon with write-back. */
static enum fsdp_status renormalise(struct fsdp_ctx *c, struct fsdp_model *fm, struct fsdp_module *m, void *ud) {
    ((struct hook_count *)ud)->calls++;
    FSDP_TRY(fsdp_summon_full_params(c, fm, m, 1, 0));
    struct fsdp_param *w = fsdp_module_find_param(m, "head.weight");
    for (int64_t o = 0; o < V; o++) {
        double s = 0;
        for (int64_t i = 0; i < C; i++) s += (double)w->data[o * C + i] * w->data[o * C + i];
        for (int64_t i = 0; i < C; i++) w->data[o * C + i] = (float)(w->data[o * C + i] / sqrt(s));
    }
    return fsdp_summon_end(c, fm);
}

TEST(post_step_hook_renormalises_rows) {
    struct fsdp_ctx *c = get_ctx(), *one = self_ctx();
    struct run r, ref;
    ASSERT_OK(prepare(c, &r, FSDP_FULL_SHARD, 1, 0, FSDP_OPTIM_ADAMW, 0), c);
    ASSERT_OK(prepare(one, &ref, FSDP_FULL_SHARD, 1, 0, FSDP_OPTIM_ADAMW, 0), one);
    struct hook_count n = {0}, n1 = {0};
    struct fsdp_module *head = r.root->children[2];
    ASSERT_OK(fsdp_model_add_post_step_hook(c, r.fm, head, renormalise, &n), c);
    ASSERT_OK(fsdp_model_add_post_step_hook(one, ref.fm, ref.root->children[2], renormalise, &n1), one);
    CHECK_OK(train(c, &r, 0, 3), c);
    CHECK_OK(train(one, &ref, 0, 3), one);
    CHECK_INT_EQ(n.calls, 3);
    float w[V * C];
    CHECK_OK(fsdp_model_get_param(c, r.fm, "head.weight", w), c);
    for (int o = 0; o < V; o++) {
        double s = 0;
        for (int i = 0; i < C; i++) s += (double)w[o * C + i] * w[o * C + i];
        CHECK_NEAR(s, 1.0, 1e-5, 0);
    }
    compare_runs(&r, c, &ref, one, 1e-5);
    /* bad input */
    CHECK_INT_EQ(fsdp_model_add_post_step_hook(c, r.fm, head, NULL, NULL), FSDP_ERR_INVALID);
    CHECK_INT_EQ(fsdp_model_add_post_step_hook(c, r.fm, ref.root, renormalise, &n), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "not part of this model");
    finish(&r);
    finish(&ref);
    fsdp_ctx_free(one);
}

/* A hook that all-reduces on rank 0 only: with the schedule check on, rank
 * 0's step and the other ranks' next collective fail alike, both naming the
 * hook; no rank hangs. */
static enum fsdp_status rank0_collective(struct fsdp_ctx *c, struct fsdp_model *fm, struct fsdp_module *m,
                                         void *ud) {
    (void)fm, (void)m, (void)ud;
    if (fsdp_ctx_rank(c) != 0) return FSDP_OK;
    float x = 1.0f;
    return fsdp_comm_allreduce(fsdp_ctx_comm(c), &x, &x, 1, FSDP_F32, FSDP_SUM);
}

TEST(hook_collective_on_one_rank_is_named) {
    struct fsdp_ctx *c = get_ctx();
    if (fsdp_ctx_world(c) < 2) SKIP("needs 2+ ranks");
    struct fsdp_comm *comm = fsdp_ctx_comm(c);
    fsdp_comm_set_check(comm, 1);
    struct run r;
    ASSERT_OK(prepare(c, &r, FSDP_FULL_SHARD, 1, 0, FSDP_OPTIM_ADAMW, 0), c);
    ASSERT_OK(fsdp_model_add_post_step_hook(c, r.fm, r.root->children[2], rank0_collective, NULL), c);
    /* the others' next collective (the step's parameter norm, or the next
     * step's first gather) meets rank 0's extra one */
    enum fsdp_status st = train(c, &r, 0, 1);
    if (st == FSDP_OK) st = train(c, &r, 1, 1);
    CHECK_INT_EQ(st, FSDP_ERR_COMM);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "collective schedule diverged");
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "tag 'post-step hook head'");
    if (fsdp_ctx_rank(c) == 0) CHECK_STR_CONTAINS(fsdp_errmsg(c), "post-step hook on 'head'");
    finish(&r);
    fsdp_comm_set_check(comm, getenv("FSDP_CHECK_COLLECTIVES") != NULL);
}

/* A module whose forward skips its all-reduce on one rank: with the
 * schedule check on, every rank's step fails naming the module (its tag),
 * with overlap's prefetched gathers in flight; no rank hangs. */
TEST(module_collective_on_one_rank_is_named) {
    struct fsdp_ctx *c = get_ctx();
    if (fsdp_ctx_world(c) < 2) SKIP("needs 2+ ranks");
    struct fsdp_comm *comm = fsdp_ctx_comm(c);
    fsdp_comm_set_check(comm, 1);
    struct run r;
    ASSERT_OK(prepare(c, &r, FSDP_FULL_SHARD, 1, 0, FSDP_OPTIM_ADAMW, 0), c);
    sn_skip_rank = 1;
    CHECK_INT_EQ(train(c, &r, 0, 1), FSDP_ERR_COMM);
    sn_skip_rank = -1;
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "collective schedule diverged");
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "tag 'module norm'");
    finish(&r);
    fsdp_comm_set_check(comm, getenv("FSDP_CHECK_COLLECTIVES") != NULL);
}

TEST_MAIN()
