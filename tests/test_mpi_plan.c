/*
 * test_mpi_plan.c - the memory planner (src/fsdp/plan.c) against real runs
 * at 1..4 ranks (tests/run.sh): the predicted shards, pooled full buffers
 * and activation arena must equal what fsdp_mem_get measures over two
 * training steps, with and without activation checkpointing, and
 * fsdp_mem_set_limit must stop a run that would pass it with a message
 * naming the allocation.
 */
#include "fsdp.h"
#include "harness.h"

#include <mpi.h>

#include "mpi_harness.h"

/* internal (core-impl.h): frees the activation arena, so that each test
 * measures its own arena from empty */
void fsdp__arena_free_all(struct fsdp_ctx *ctx);

#define TRY(expr)                                   \
    do {                                            \
        enum fsdp_status st_ = (expr);              \
        if (st_ != FSDP_OK) return st_;             \
    } while (0)

struct run {
    struct fsdp_module *gpt;
    struct fsdp_model *fm;
    struct fsdp_optim *opt;
};

static void run_free(struct run *r) {
    fsdp_model_free(r->fm);
    fsdp_optim_free(r->opt);
    fsdp_module_free(r->gpt);
    memset(r, 0, sizeof *r);
}

/* Builds the model (Blocks checkpointed if ckpt), returns the plan. */
static enum fsdp_status setup(struct fsdp_ctx *c, const struct fsdp_gpt_config *cfg, int ckpt, int Bl, int T,
                              struct run *r, struct fsdp_mem_plan *plan) {
    memset(r, 0, sizeof *r);
    TRY(fsdp_gpt_create(c, cfg, &r->gpt));
    if (ckpt)
        for (int l = 0; l < cfg->n_layer; l++) {
            char fqn[64];
            snprintf(fqn, sizeof fqn, "transformer.h.%d.ln_1.weight", l);
            fsdp_module_find_param(r->gpt, fqn)->owner->parent->checkpoint = 1;
        }
    TRY(fsdp_plan_memory(c, r->gpt, NULL, fsdp_ctx_world(c), fsdp_ctx_rank(c), 2, Bl, T, 1, plan));
    TRY(fsdp_fully_shard(c, r->gpt, NULL, &r->fm));
    TRY(fsdp_model_init_params(c, r->fm, 7));
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    TRY(fsdp_optim_create(c, &oo, &r->opt));
    return fsdp_model_attach_optim(c, r->fm, r->opt);
}

static void batch(int n, int V, int32_t *in, int32_t *tg) {
    for (int i = 0; i < n; i++) {
        in[i] = (i * 7 + 3) % V;
        tg[i] = (i * 5 + 1) % V;
    }
}

static void check_plan(int ckpt, int B, int T) {
    struct fsdp_ctx *c = get_ctx();
    int world = fsdp_ctx_world(c);
    struct fsdp_gpt_config cfg;
    fsdp_gpt_config_preset("tiny", &cfg);
    cfg.n_embd = 48;
    cfg.n_head = 3;
    fsdp__arena_free_all(c);
    struct fsdp_mem_stats m0;
    fsdp_mem_get(c, &m0);
    struct run r;
    struct fsdp_mem_plan plan;
    ASSERT_OK(setup(c, &cfg, ckpt, B / world, T, &r, &plan), c);
    CHECK_INT_EQ(plan.world, world);
    int32_t *in = malloc(sizeof(int32_t) * (size_t)(B * T)), *tg = malloc(sizeof(int32_t) * (size_t)(B * T));
    batch(B / world * T, cfg.vocab_size, in, tg);
    fsdp_mem_reset_peak(c);
    for (int step = 0; step < 2; step++) {
        struct fsdp_step_result res;
        CHECK_OK(fsdp_model_train_step(c, r.fm, in, tg, B / world, T, 1e-3f, 1.0f, &res), c);
    }
    struct fsdp_mem_stats m;
    fsdp_mem_get(c, &m);
    CHECK_INT_EQ(m.cur[FSDP_MEM_SHARD] - m0.cur[FSDP_MEM_SHARD], plan.params + plan.grads + plan.optim);
    CHECK_INT_EQ(m.peak[FSDP_MEM_FULL], plan.full);
    CHECK_INT_EQ(m.peak[FSDP_MEM_ACT], plan.act);
    double measured = (double)(m.peak_total - m0.cur_total);
    CHECK(measured <= (double)plan.total && measured >= 0.97 * (double)plan.total);
    if (test_rank == 0 && world == 2)
        fprintf(stderr, "  ckpt %d: plan %zu (shards %zu, full %zu, act %zu) vs measured peak %.0f\n", ckpt,
                plan.total, plan.params + plan.grads + plan.optim, plan.full, plan.act, measured);
    free(in);
    free(tg);
    run_free(&r);
}

TEST(plan_equals_measured) { check_plan(0, 4, 32); }
TEST(plan_equals_measured_checkpointed) { check_plan(1, 4, 32); }
/* activations over several arena chunks */
TEST(plan_equals_measured_many_chunks) { check_plan(0, 12, 64); }
TEST(plan_equals_measured_many_chunks_checkpointed) { check_plan(1, 12, 64); }

/* A limit just below the plan stops the run with a message naming the
 * allocation; the same limit at the plan lets it run. */
TEST(mem_limit_enforced_at_run_time) {
    struct fsdp_ctx *c = get_ctx();
    int world = fsdp_ctx_world(c);
    struct fsdp_gpt_config cfg;
    fsdp_gpt_config_preset("tiny", &cfg);
    int B = 4, T = 32;
    int32_t *in = malloc(sizeof(int32_t) * (size_t)(B * T)), *tg = malloc(sizeof(int32_t) * (size_t)(B * T));
    batch(B / world * T, cfg.vocab_size, in, tg);
    for (int tight = 1; tight >= 0; tight--) {
        fsdp__arena_free_all(c);
        struct fsdp_mem_stats m0;
        fsdp_mem_get(c, &m0);
        struct run r;
        struct fsdp_mem_plan plan;
        struct fsdp_gpt_config cc = cfg;
        ASSERT_OK(fsdp_gpt_create(c, &cc, &r.gpt), c);
        ASSERT_OK(fsdp_plan_memory(c, r.gpt, NULL, world, fsdp_ctx_rank(c), 2, B / world, T, 1, &plan), c);
        fsdp_module_free(r.gpt);
        /* the activations need more than this, the shards less */
        size_t limit = m0.cur_total + plan.total - (tight ? plan.act / 2 : 0);
        fsdp_mem_set_limit(c, limit);
        CHECK_INT_EQ(fsdp_mem_limit(c), limit);
        enum fsdp_status st = setup(c, &cfg, 0, B / world, T, &r, &plan);
        struct fsdp_step_result res;
        if (st == FSDP_OK) st = fsdp_model_train_step(c, r.fm, in, tg, B / world, T, 1e-3f, 1.0f, &res);
        if (st == FSDP_OK) st = fsdp_model_train_step(c, r.fm, in, tg, B / world, T, 1e-3f, 1.0f, &res);
        if (tight) {
            CHECK_INT_EQ(st, FSDP_ERR_NOMEM);
            CHECK_STR_CONTAINS(fsdp_errmsg(c), "memory limit of");
            CHECK_STR_CONTAINS(fsdp_errmsg(c), "(activations)");
        } else {
            CHECK_OK(st, c);
        }
        fsdp_mem_set_limit(c, 0);
        run_free(&r);
        if (test_combine) test_combine(0); /* every rank finished the case */
    }
    free(in);
    free(tg);
}

TEST(parse_size) {
    struct fsdp_ctx *c = get_ctx();
    size_t v = 0;
    ASSERT_OK(fsdp_mem_parse_size(c, "1.5G", &v), c);
    CHECK_INT_EQ(v, 1610612736);
    ASSERT_OK(fsdp_mem_parse_size(c, "800M", &v), c);
    CHECK_INT_EQ(v, 800 * 1048576LL);
    ASSERT_OK(fsdp_mem_parse_size(c, "2KiB", &v), c);
    CHECK_INT_EQ(v, 2048);
    ASSERT_OK(fsdp_mem_parse_size(c, "4096", &v), c);
    CHECK_INT_EQ(v, 4096);
    CHECK_INT_EQ(fsdp_mem_parse_size(c, "1.5Q", &v), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "'1.5Q' is not a memory size");
    CHECK_INT_EQ(fsdp_mem_parse_size(c, "-1G", &v), FSDP_ERR_INVALID);
    CHECK_INT_EQ(fsdp_mem_parse_size(c, "", &v), FSDP_ERR_INVALID);
}

TEST_MAIN()
