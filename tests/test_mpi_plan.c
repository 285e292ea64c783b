/*
 * test_mpi_plan.c - the memory planner (src/fsdp/plan.c, [Note: measure
 * mode]) against real runs at 1..4 ranks (tests/run.sh): the planned
 * shards, pooled full buffers, activation arena, workspace and total peak
 * must equal to the byte what fsdp_mem_get measures over sharding,
 * attaching the optimizer and two training steps, with and without
 * activation checkpointing, in fp32 and under mixed precision, for the GPT
 * (AMP_BF16 with DEFAULT, PURE, FULL and a unit overridden to fp32;
 * AMP_FP16; FULL_SHARD and HYBRID_SHARD); gradient shards lent the pages
 * backward released, LayerNorm outputs rebuilt, and fsdp_mem_set_limit
 * stopping a run that would pass it with a message naming the allocation.
 * Other models (a user model, a ResNet, SwAV's): test_mpi_plan_models.c;
 * the arena itself: test_mpi_arena.c.
 */
#include "fsdp.h"
#include "harness.h"

#include <mpi.h>

#include "mpi_harness.h"
#include "plan_helpers.h"

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

/* Units per Block; the second Block's unit overridden to fp32 (FULL). */
static enum fsdp_wrap wrap_block1_fp32(struct fsdp_module *m, void *ud, struct fsdp_unit_overrides *ovr) {
    (void)ud;
    if (strcmp(m->ops->type, "Block") != 0) return FSDP_WRAP_SKIP;
    if (strcmp(m->name, "1") != 0) return FSDP_WRAP_UNIT;
    ovr->set = FSDP_OVR_MIXED_PRECISION;
    ovr->mixed_precision = FSDP_MP_FULL;
    return FSDP_WRAP_UNIT_OVERRIDE;
}

/* Builds the model (ckpt 1: Blocks checkpointed; 2: each Block's
 * CausalSelfAttention), returns the plan; so NULL: fp32 defaults. */
static enum fsdp_status setup_opts(struct fsdp_ctx *c, const struct fsdp_gpt_config *cfg, int ckpt, int Bl, int T,
                                   const struct fsdp_shard_opts *so, struct run *r, struct fsdp_mem_plan *plan) {
    memset(r, 0, sizeof *r);
    TRY(fsdp_gpt_create(c, cfg, &r->gpt));
    if (ckpt)
        for (int l = 0; l < cfg->n_layer; l++) {
            char fqn[64];
            snprintf(fqn, sizeof fqn, ckpt == 2 ? "transformer.h.%d.attn.c_attn.weight" : "transformer.h.%d.ln_1.weight",
                     l);
            fsdp_module_find_param(r->gpt, fqn)->owner->parent->checkpoint = 1;
        }
    TRY(fsdp_plan_memory(c, r->gpt, so, fsdp_ctx_world(c), fsdp_ctx_rank(c), 2, Bl, T, 1, plan));
    TRY(fsdp_fully_shard(c, r->gpt, so, &r->fm));
    TRY(fsdp_model_init_params(c, r->fm, 7));
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    TRY(fsdp_optim_create(c, &oo, &r->opt));
    return fsdp_model_attach_optim(c, r->fm, r->opt);
}

static enum fsdp_status setup(struct fsdp_ctx *c, const struct fsdp_gpt_config *cfg, int ckpt, int Bl, int T,
                              struct run *r, struct fsdp_mem_plan *plan) {
    return setup_opts(c, cfg, ckpt, Bl, T, NULL, r, plan);
}

static void batch(int n, int V, int32_t *in, int32_t *tg) {
    for (int i = 0; i < n; i++) {
        in[i] = (i * 7 + 3) % V;
        tg[i] = (i * 5 + 1) % V;
    }
}

/* prec FSDP_F32 and FULL_SHARD: the default options; mp -1: Block 1
 * overridden to FULL; HYBRID_SHARD: shard groups of 2 where the world is
 * even (at 4 ranks 2 replicas, whose all-reduces overlap pipelines), else
 * of 1. */
static void check_plan_on(struct fsdp_ctx *c, int ckpt, int B, int T, enum fsdp_dtype prec, int mp,
                          enum fsdp_sharding sh, struct fsdp_mem_plan *out) {
    int world = fsdp_ctx_world(c);
    struct fsdp_gpt_config cfg;
    fsdp_gpt_config_preset("tiny", &cfg);
    cfg.n_embd = 48;
    cfg.n_head = 3;
    struct fsdp_mem_stats m0;
    measure_from(c, &m0);
    struct run r;
    struct fsdp_mem_plan plan;
    struct fsdp_shard_opts so = fsdp_shard_opts_default();
    so.precision = prec;
    so.mixed_precision = mp < 0 ? FSDP_MP_DEFAULT : (enum fsdp_mixed_precision)mp;
    if (mp < 0) so.wrap = wrap_block1_fp32;
    so.sharding = sh;
    if (sh == FSDP_HYBRID_SHARD) so.shard_group = world % 2 == 0 ? 2 : 1;
    int defaults = prec == FSDP_F32 && sh == FSDP_FULL_SHARD;
    ASSERT_OK(setup_opts(c, &cfg, ckpt, B / world, T, defaults ? NULL : &so, &r, &plan), c);
    /* the plan leaves the modules as they were: fsdp_fully_shard set the compute dtypes */
    int n_lp = 0;
    for (int i = 0; i < fsdp_model_n_units(r.fm); i++) {
        struct fsdp_unit_precision up;
        fsdp_model_unit_precision(r.fm, i, &up);
        n_lp += up.param_dtype != FSDP_F32;
    }
    CHECK_INT_EQ(n_lp, prec == FSDP_F32 || mp == FSDP_MP_FULL ? 0 : mp < 0 ? cfg.n_layer : cfg.n_layer + 1);
    int32_t *in = malloc(sizeof(int32_t) * (size_t)(B * T)), *tg = malloc(sizeof(int32_t) * (size_t)(B * T));
    batch(B / world * T, cfg.vocab_size, in, tg);
    for (int step = 0; step < 2; step++) {
        struct fsdp_step_result res;
        CHECK_OK(fsdp_model_train_step(c, r.fm, in, tg, B / world, T, 1e-3f, 1.0f, &res), c);
    }
    char what[96];
    snprintf(what, sizeof what, "GPT %s %s mp %d ckpt %d (%s)", fsdp_sharding_name(sh), fsdp_dtype_name(prec), mp,
             ckpt, fsdp_comm_backend(fsdp_ctx_comm(c)));
    check_equal(c, &plan, &m0, what);
    if (out) *out = plan;
    free(in);
    free(tg);
    run_free(&r);
}

static void check_plan_sharded(int ckpt, int B, int T, enum fsdp_dtype prec, int mp, enum fsdp_sharding sh) {
    check_plan_on(get_ctx(), ckpt, B, T, prec, mp, sh, NULL);
}

/* On the shm backend, whose shards lie in the shared window ([Note: shared
 * window] in src/fsdp/unit.c): fp32 gathers in a training step hold no full
 * buffer, 16-bit ones only their parameters widened to fp32 ([Note: 16-bit
 * window]); the plan (measure.c's window) says the same, to the byte, with
 * the windows and without them (FSDP_SHM_WINDOW=0), and the windows' plan
 * holds fewer full buffers than the copying one (and in 16 bits each rank's
 * block of the copies among its shards). */
static void check_plan_shm(int ckpt, enum fsdp_dtype prec) {
    if (fsdp_ctx_world(get_ctx()) < 2) SKIP("a shard group of one has no window");
    struct fsdp_mem_plan p[2];
    for (int win = 1; win >= 0; win--) {
        struct fsdp_ctx *c = shm_ctx_window(win ? NULL : "0");
        ASSERT(c != NULL);
        /* the schedule check (on under tests/run.sh) is a debugging aid the plan leaves out: its
         * fingerprints would be the peak of shm's small workspace (MPI's staging hides them) */
        fsdp_comm_set_check(fsdp_ctx_comm(c), 0);
        check_plan_on(c, ckpt, 12, 64, prec, FSDP_MP_DEFAULT, FSDP_FULL_SHARD, &p[win]);
        fsdp_ctx_free(c);
    }
    CHECK(p[1].full < p[0].full);
    if (prec == FSDP_F32) CHECK_INT_EQ(p[1].params, p[0].params);
    else CHECK(p[1].params > p[0].params);
}

TEST(plan_equals_measured_shm_window) { check_plan_shm(0, FSDP_F32); }
TEST(plan_equals_measured_shm_window_checkpointed) { check_plan_shm(1, FSDP_F32); }
TEST(plan_equals_measured_shm_window_bf16) { check_plan_shm(0, FSDP_BF16); }

static void check_plan_prec(int ckpt, int B, int T, enum fsdp_dtype prec, int mp) {
    check_plan_sharded(ckpt, B, T, prec, mp, FSDP_FULL_SHARD);
}

static void check_plan(int ckpt, int B, int T) { check_plan_prec(ckpt, B, T, FSDP_F32, FSDP_MP_DEFAULT); }

TEST(plan_equals_measured) { check_plan(0, 4, 32); }
TEST(plan_equals_measured_checkpointed) { check_plan(1, 4, 32); }
/* activations over several arena chunks: the growth of machines that refuse
 * the one span ([Note: one arena chunk]) */
static void chunked(int on) {
    if (on) setenv("FSDP_ARENA_SPAN", "0", 1);
    else unsetenv("FSDP_ARENA_SPAN");
    fsdp__arena_free_all(get_ctx()); /* the next allocation opens the first chunk again */
}
TEST(plan_equals_measured_many_chunks) {
    chunked(1);
    check_plan(0, 12, 64);
    chunked(0);
}
TEST(plan_equals_measured_many_chunks_checkpointed) {
    chunked(1);
    check_plan(1, 12, 64);
    chunked(0);
}
TEST(plan_equals_measured_many_chunks_bf16) {
    chunked(1);
    check_plan_prec(0, 12, 64, FSDP_BF16, FSDP_MP_DEFAULT);
    chunked(0);
}
/* mixed precision: 16-bit gathers (staging in the full buffers from 2 ranks;
 * pooled fp32 values even at one rank), the layers' 16-bit copies and
 * scratch in the arena */
TEST(plan_equals_measured_bf16) { check_plan_prec(0, 12, 64, FSDP_BF16, FSDP_MP_DEFAULT); }
TEST(plan_equals_measured_bf16_checkpointed) { check_plan_prec(1, 4, 32, FSDP_BF16, FSDP_MP_DEFAULT); }
TEST(plan_equals_measured_bf16_pure) { check_plan_prec(0, 12, 64, FSDP_BF16, FSDP_MP_PURE); }
TEST(plan_equals_measured_bf16_pure_checkpointed) { check_plan_prec(1, 12, 64, FSDP_BF16, FSDP_MP_PURE); }
TEST(plan_equals_measured_fp16) { check_plan_prec(0, 12, 64, FSDP_F16, FSDP_MP_DEFAULT); }
TEST(plan_equals_measured_fp16_checkpointed) { check_plan_prec(1, 4, 32, FSDP_F16, FSDP_MP_DEFAULT); }
/* fp32 gathers, 16-bit products: each product casts its weight in the arena */
TEST(plan_equals_measured_bf16_full) { check_plan_prec(0, 12, 64, FSDP_BF16, FSDP_MP_FULL); }
TEST(plan_equals_measured_bf16_fp32_unit_checkpointed) { check_plan_prec(1, 12, 64, FSDP_BF16, -1); }
/* the attention alone checkpointed (fsdp-train --ac attn): in bf16 its saved
 * input is ln_1's 16-bit output ([Note: 16-bit hand-off]) */
TEST(plan_equals_measured_attention_checkpointed) { check_plan(2, 12, 64); }
TEST(plan_equals_measured_bf16_attention_checkpointed) { check_plan_prec(2, 12, 64, FSDP_BF16, FSDP_MP_DEFAULT); }

/* HYBRID_SHARD: the reduce-scatter's full gradient is released before the
 * replica all-reduce, which overlap leaves in flight to the next unit's
 * post-backward with its MPI staging (PURE) */
TEST(plan_equals_measured_hybrid) { check_plan_sharded(0, 12, 64, FSDP_F32, FSDP_MP_DEFAULT, FSDP_HYBRID_SHARD); }
TEST(plan_equals_measured_hybrid_bf16_pure) {
    check_plan_sharded(0, 12, 64, FSDP_BF16, FSDP_MP_PURE, FSDP_HYBRID_SHARD);
}

/* [Note: gradient shards born in backward]: GPT's backward releases its
 * blocks' activations as it passes them and the gradient shards born after
 * take their pages, so the plan with lending holds every shard (own buffers
 * plus lent bytes) and is smaller than with FSDP_GRAD_LEND=0, where every
 * shard has a buffer of its own; a real run's training is the same bits
 * either way (below: losses, norms and a gradient). */
static void grad_lend_run(int lend, int world, double out[7], struct fsdp_mem_plan *plan, size_t *root_bytes) {
    struct fsdp_ctx *c = get_ctx();
    if (!lend) setenv("FSDP_GRAD_LEND", "0", 1);
    struct fsdp_gpt_config cfg;
    fsdp_gpt_config_preset("tiny", &cfg);
    float g[32]; /* ln_2.weight has n_embd elements */
    ASSERT(cfg.n_embd <= (int)(sizeof g / sizeof g[0]));
    struct run r;
    struct fsdp_mem_stats m0;
    measure_from(c, &m0);
    ASSERT_OK(setup(c, &cfg, 0, 4, 64, &r, plan), c);
    int32_t in[4 * 64 * 4], tg[4 * 64 * 4];
    for (int i = 0; i < 4 * 64 * 4; i++) in[i] = (i * 37 + 11) % cfg.vocab_size, tg[i] = (i * 53 + 5) % cfg.vocab_size;
    int rank = fsdp_ctx_rank(c);
    for (int s = 0; s < 2; s++) {
        struct fsdp_step_result res;
        ASSERT_OK(fsdp_model_train_step(c, r.fm, in + rank * 4 * 64, tg + rank * 4 * 64, 4, 64, 1e-3f, 1.0f, &res), c);
        out[2 * s] = res.loss;
        out[2 * s + 1] = res.grad_norm;
    }
    check_equal(c, plan, &m0, lend ? "lent gradients" : "own gradients");
    ASSERT_OK(fsdp_model_get_grad(c, r.fm, "transformer.h.1.ln_2.weight", g), c); /* readable after the step */
    out[4] = g[0], out[5] = g[7], out[6] = g[cfg.n_embd - 1];
    struct fsdp_unit_info root;
    fsdp_model_unit_info(r.fm, 0, &root);
    *root_bytes = (size_t)root.numel_shard * sizeof(float);
    run_free(&r);
    unsetenv("FSDP_GRAD_LEND");
    (void)world;
}

TEST(plan_lends_gradient_shards) {
    struct fsdp_ctx *c = get_ctx();
    int world = fsdp_ctx_world(c);
    struct fsdp_mem_plan pl, po;
    double a[7], b[7];
    size_t root;
    grad_lend_run(1, world, a, &pl, &root);
    grad_lend_run(0, world, b, &po, &root);
    CHECK(pl.grads_lent > 0);
    CHECK_INT_EQ(po.grads_lent, 0);
    CHECK(pl.grads + pl.grads_lent >= po.grads); /* every shard: its own buffer or lent */
    CHECK(pl.grads <= root); /* every Block's lent: only the root unit's, born first, may keep its own */
    CHECK(pl.total < po.total);
    CHECK(memcmp(a, b, sizeof a) == 0);
    CHECK(a[1] > 0 && (a[4] != 0 || a[5] != 0 || a[6] != 0));
}

/* Units per Block, and each Block's LayerNorms units of their own. */
static enum fsdp_wrap wrap_block_and_ln(struct fsdp_module *m, void *ud, struct fsdp_unit_overrides *ovr) {
    (void)ud;
    (void)ovr;
    int ln_in_block = !strcmp(m->ops->type, "LayerNorm") && m->parent && !strcmp(m->parent->ops->type, "Block");
    return ln_in_block || !strcmp(m->ops->type, "Block") ? FSDP_WRAP_UNIT : FSDP_WRAP_SKIP;
}

/* [Note: LayerNorm outputs rebuilt] (src/nn/block.c): a GPT whose Blocks
 * keep no LayerNorm output (each rebuilt in backward in the window GPT
 * lends) trains to the same bits as one that keeps them (FSDP_LN_REBUILD=0),
 * in fp32 and bf16: losses, norms and gradients of the LayerNorms and of
 * c_attn and c_fc, whose weight gradients read the rebuilt outputs (a missed
 * rebuild hands c_attn ln_2's output). Blocks checkpointed (1) or their
 * attention (2) re-run their forwards into the window; with Block 1 an fp32
 * unit (mp -1) its outputs are fp32 in a bf16 model; LayerNorms that are
 * units of their own (mp -2; resharded after their forward) keep their
 * outputs. The plans equal the runs, and the rebuilding plan keeps fewer
 * activation bytes, checkpointed or not (the same where nothing is lent). */
static void ln_rebuild_run(int rebuild, enum fsdp_dtype prec, int ckpt, int mp, double out[12],
                           struct fsdp_mem_plan *plan) {
    struct fsdp_ctx *c = get_ctx();
    if (!rebuild) setenv("FSDP_LN_REBUILD", "0", 1);
    struct fsdp_gpt_config cfg;
    fsdp_gpt_config_preset("tiny", &cfg);
    struct fsdp_shard_opts so = fsdp_shard_opts_default();
    so.precision = prec;
    so.mixed_precision = mp < 0 ? FSDP_MP_DEFAULT : (enum fsdp_mixed_precision)mp;
    if (mp < 0) so.wrap = mp == -1 ? wrap_block1_fp32 : wrap_block_and_ln;
    struct run r;
    struct fsdp_mem_stats m0;
    measure_from(c, &m0);
    ASSERT_OK(setup_opts(c, &cfg, ckpt, 2, 64, &so, &r, plan), c);
    int32_t in[2 * 64], tg[2 * 64];
    for (int i = 0; i < 2 * 64; i++)
        in[i] = (i * 41 + 7 * fsdp_ctx_rank(c)) % cfg.vocab_size, tg[i] = (i * 23 + 9) % cfg.vocab_size;
    for (int s = 0; s < 2; s++) {
        struct fsdp_step_result res;
        ASSERT_OK(fsdp_model_train_step(c, r.fm, in, tg, 2, 64, 1e-3f, 1.0f, &res), c);
        out[2 * s] = res.loss;
        out[2 * s + 1] = res.grad_norm;
    }
    char what[80];
    snprintf(what, sizeof what, "%s ckpt %d mp %d, LayerNorm outputs %s", fsdp_dtype_name(prec), ckpt, mp,
             rebuild ? "rebuilt" : "kept");
    check_equal(c, plan, &m0, what);
    static const char *const names[4] = {"transformer.h.0.attn.c_attn.weight", "transformer.h.1.mlp.c_fc.weight",
                                         "transformer.h.0.ln_1.weight", "transformer.h.1.ln_2.bias"};
    for (int k = 0; k < 4; k++) {
        int64_t n = fsdp_module_find_param(r.gpt, names[k])->numel;
        float *g = malloc(sizeof(float) * (size_t)n);
        ASSERT(g != NULL);
        ASSERT_OK(fsdp_model_get_grad(c, r.fm, names[k], g), c);
        double sum = 0, asum = 0;
        for (int64_t i = 0; i < n; i++) sum += g[i] * (double)(i % 7 + 1), asum += fabs(g[i]);
        out[4 + 2 * k] = sum;
        out[5 + 2 * k] = asum;
        free(g);
    }
    run_free(&r);
    unsetenv("FSDP_LN_REBUILD");
}

static void check_ln_rebuild(enum fsdp_dtype prec, int ckpt, int mp) {
    double a[12], b[12];
    struct fsdp_mem_plan pa, pb;
    ln_rebuild_run(1, prec, ckpt, mp, a, &pa);
    ln_rebuild_run(0, prec, ckpt, mp, b, &pb);
    for (int i = 0; i < 12; i++)
        if (memcmp(&a[i], &b[i], sizeof a[i]) != 0) TEST_FAILF("value %d: rebuilt %.9g, kept %.9g", i, a[i], b[i]);
    for (int i = 4; i < 12; i += 2) CHECK(a[i + 1] > 0);
    if (mp == -2) {
        CHECK_INT_EQ(pa.act, pb.act);
        CHECK_INT_EQ(pa.total, pb.total);
    } else if (!(pa.act < pb.act)) {
        TEST_FAILF("activations rebuilt %zu bytes, kept %zu", pa.act, pb.act);
    }
}

TEST(layernorm_outputs_rebuilt) { check_ln_rebuild(FSDP_F32, 0, FSDP_MP_DEFAULT); }
TEST(layernorm_outputs_rebuilt_checkpointed) { check_ln_rebuild(FSDP_F32, 1, FSDP_MP_DEFAULT); }
TEST(layernorm_outputs_rebuilt_bf16) { check_ln_rebuild(FSDP_BF16, 0, FSDP_MP_DEFAULT); }
TEST(layernorm_outputs_rebuilt_bf16_checkpointed) { check_ln_rebuild(FSDP_BF16, 1, FSDP_MP_DEFAULT); }
TEST(layernorm_outputs_rebuilt_bf16_attention_checkpointed) { check_ln_rebuild(FSDP_BF16, 2, FSDP_MP_DEFAULT); }
TEST(layernorm_outputs_rebuilt_bf16_fp32_unit) { check_ln_rebuild(FSDP_BF16, 0, -1); }
TEST(layernorm_outputs_kept_by_layernorm_units) { check_ln_rebuild(FSDP_BF16, 0, -2); }

/* The arena lends a model's gradient shards until its optimizer step; another
 * model's forward on the same context in between resets the arena, and the
 * shards move to the first model's own buffers: its step is the same bits. */
static void split_step_around(int other, double out[3]) {
    struct fsdp_ctx *c = get_ctx();
    struct fsdp_gpt_config cfg;
    fsdp_gpt_config_preset("tiny", &cfg);
    struct run a, b;
    struct fsdp_mem_plan plan;
    ASSERT_OK(setup(c, &cfg, 0, 2, 64, &a, &plan), c);
    ASSERT_OK(setup(c, &cfg, 0, 2, 64, &b, &plan), c);
    int32_t in[2 * 64], tg[2 * 64];
    for (int i = 0; i < 2 * 64; i++) in[i] = (i * 29 + fsdp_ctx_rank(c)) % cfg.vocab_size, tg[i] = (i * 31 + 3) % cfg.vocab_size;
    struct fsdp_tensor x = {in, FSDP_I32, 2, {2, 64}, FSDP_LAYOUT_PLAIN}, t = {tg, FSDP_I32, 2, {2, 64}, FSDP_LAYOUT_PLAIN};
    struct fsdp_tensor y = {0};
    ASSERT_OK(fsdp_model_forward_tensor(c, a.fm, &x, &y), c);
    ASSERT_OK(fsdp_model_loss(c, a.fm, NULL, &y, &t, 1, NULL, &y), c);
    ASSERT_OK(fsdp_model_backward(c, a.fm, &y), c);
    struct fsdp_step_result res;
    if (other) ASSERT_OK(fsdp_model_train_step(c, b.fm, tg, in, 2, 64, 1e-3f, 1.0f, &res), c); /* other values */
    ASSERT_OK(fsdp_model_optim_step(c, a.fm, 1e-3f, 1.0f, &res), c);
    out[0] = res.loss, out[1] = res.grad_norm, out[2] = res.param_norm;
    run_free(&a);
    run_free(&b);
}

TEST(lent_gradients_survive_another_models_forward) {
    double alone[3], around[3];
    split_step_around(0, alone);
    split_step_around(1, around);
    CHECK(alone[1] > 0);
    CHECK(memcmp(alone, around, sizeof alone) == 0);
}

/* a 16-bit plan needs a 16-bit copy of each shard and fewer full-buffer
 * bytes than the fp32 one at 2+ ranks (the training pass gathers 16-bit and
 * makes no fp32 values for the Linear and embedding weights: [Note: lazy
 * widening]), and leaves the model's compute dtypes as they were (its
 * activations: plan_equals_measured_bf16*; fewer than fp32's for GPT-2,
 * whose Linears' inputs are handed off in 16 bits, [Note: 16-bit hand-off],
 * while the tiny model's are all within the first arena chunk) */
TEST(plan_bf16_against_fp32) {
    struct fsdp_ctx *c = get_ctx();
    int world = fsdp_ctx_world(c);
    struct fsdp_gpt_config cfg;
    fsdp_gpt_config_preset("tiny", &cfg);
    struct fsdp_module *gpt;
    ASSERT_OK(fsdp_gpt_create(c, &cfg, &gpt), c);
    struct fsdp_shard_opts so = fsdp_shard_opts_default();
    struct fsdp_mem_plan p32, p16;
    ASSERT_OK(fsdp_plan_memory(c, gpt, &so, world, 0, 2, 4, 32, 1, &p32), c);
    so.precision = FSDP_BF16;
    ASSERT_OK(fsdp_plan_memory(c, gpt, &so, world, 0, 2, 4, 32, 1, &p16), c);
    if (world > 1 && !(p16.full < p32.full)) TEST_FAILF("bf16 full buffers %zu bytes, fp32 %zu", p16.full, p32.full);
    /* the same shards: no 16-bit copy outlives a gather (fsdp_shard_opts' lp_shard_copy 0) */
    CHECK_INT_EQ(p16.params, p32.params);
    /* with lp_shard_copy each shard's 16-bit copy (the optimizer writes it for the gathers): 2 bytes
       of every 4 */
    so.lp_shard_copy = 1;
    struct fsdp_mem_plan pc;
    ASSERT_OK(fsdp_plan_memory(c, gpt, &so, world, 0, 2, 4, 32, 1, &pc), c);
    CHECK_INT_EQ(pc.params, p32.params + (p32.params - 64 * (size_t)p32.n_units) / 2);
    so.lp_shard_copy = 0;
    CHECK_INT_EQ(gpt->compute_dtype, FSDP_F32);
    CHECK_INT_EQ(fsdp_module_find_param(gpt, "transformer.h.0.attn.c_attn.weight")->owner->compute_dtype, FSDP_F32);
    fsdp_module_free(gpt);
    /* GPT-2 124M (shapes only) at 4 x 256 tokens, 2 threads: bf16 keeps fewer
     * activation bytes than fp32 (bench/bf16_step measures both) */
    fsdp_gpt_config_preset("gpt2", &cfg);
    ASSERT_OK(fsdp_gpt_create(c, &cfg, &gpt), c);
    so.precision = FSDP_F32;
    ASSERT_OK(fsdp_plan_memory(c, gpt, &so, world, 0, 2, 4, 256, 2, &p32), c);
    so.precision = FSDP_BF16;
    ASSERT_OK(fsdp_plan_memory(c, gpt, &so, world, 0, 2, 4, 256, 2, &p16), c);
    if (test_rank == 0)
        printf("  GPT-2, 4 x 256 tokens: activations planned %.0f MiB in fp32, %.0f MiB in bf16; total bf16 / fp32 "
               "%.3f\n", (double)p32.act / (1 << 20), (double)p16.act / (1 << 20),
               (double)p16.total / (double)p32.total);
    if (!(p16.act < p32.act)) TEST_FAILF("bf16 activations %zu bytes, fp32 %zu", p16.act, p32.act);
    /* issue 19's memory target is bf16 <= 0.8 x fp32; what is reached stays reached: activations
       0.479 of fp32's (the logits' gradient handed to lm_head in 16 bits, [Note: 16-bit output
       gradient]; GELU's input kept in 16 bits, [Note: 16-bit activations]; the first step in one
       arena chunk as the later ones, [Note: one arena chunk]; no 16-bit copy of the shards
       between steps; the logits in 16 bits, [Note: 16-bit model output]; in both precisions,
       GPT's backward over its dead output gradient, 926 MiB of fp32's 960), the total 0.810 of
       fp32's at one rank (no pooled 16-bit copy at a shard group of one, [Note: 16-bit values from
       the shard]; the gradient shards in the pages backward released, [Note: gradient shards born
       in backward]: 0.831 without them), 0.739 at two, 0.708 at three, 0.689 at four (4 x 256 tokens
       per rank). Rebuilding the LayerNorms' outputs in backward ([Note: LayerNorm outputs rebuilt])
       takes twice as much off fp32's peak as off bf16's (72 and 36 MiB): activations 0.486, the
       total 0.819 at one rank, 0.747 at two, 0.715 at three, 0.697 at four.
       An arena growing in chunks (a machine that refuses the span) strands more in bf16's first
       step. */
    if (arena_span_expected()) {
        if ((double)p16.act > 0.49 * (double)p32.act)
            TEST_FAILF("bf16 activations %zu bytes > 0.49 x fp32's %zu", p16.act, p32.act);
        static const double most_at[4] = {0.82, 0.75, 0.72, 0.70};
        double most = most_at[(world < 4 ? world : 4) - 1];
        if ((double)p16.total > most * (double)p32.total)
            TEST_FAILF("bf16 plan %zu bytes > %.3f x fp32's %zu", p16.total, most, p32.total);
    }
    if (world == 1) { /* a shard group of one: the full buffers (root unit and one Block) hold fp32
                         values only for what is not a Linear or embedding weight ([Note: lazy
                         widening]): ln_f (2C); a Block's two LayerNorms (4C) and four biases (3C +
                         C + 4C + C). No 16-bit copy of the weights: the layers round the rows they
                         read from the shard ([Note: 16-bit values from the shard]), or with
                         lp_shard_copy read the shard's copy */
        int64_t C = cfg.n_embd, root = 2 * C, blk = 13 * C;
        CHECK_INT_EQ(p16.full, (size_t)(root + blk) * sizeof(float));
        struct fsdp_mem_plan pl;
        so.lp_shard_copy = 1;
        ASSERT_OK(fsdp_plan_memory(c, gpt, &so, world, 0, 2, 4, 256, 2, &pl), c);
        so.lp_shard_copy = 0;
        CHECK_INT_EQ(pl.full, (size_t)(root + blk) * sizeof(float));
    } else if (!(p16.full < p32.full)) {
        TEST_FAILF("GPT-2: bf16 full buffers %zu bytes, fp32 %zu", p16.full, p32.full);
    }
    /* the states are the same in both precisions, so the ratio falls with the
       batch: the 0.8 holds at every world size from 12 x 256 tokens a rank (0.777 at one) */
    if (arena_span_expected()) {
        so.precision = FSDP_F32;
        ASSERT_OK(fsdp_plan_memory(c, gpt, &so, world, 0, 2, 12, 256, 2, &p32), c);
        so.precision = FSDP_BF16;
        ASSERT_OK(fsdp_plan_memory(c, gpt, &so, world, 0, 2, 12, 256, 2, &p16), c);
        if ((double)p16.total > 0.8 * (double)p32.total)
            TEST_FAILF("bf16 plan at 12 x 256 tokens %zu bytes > 0.8 x fp32's %zu", p16.total, p32.total);
    }
    fsdp_module_free(gpt);
}

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
            CHECK_STR_CONTAINS(fsdp_errmsg(c), "bytes per rank exceeded allocating");
            /* the allocation that crosses it: the arena's at one rank; at 2 ranks the arena grows
               page by page ([Note: the arena counts what it hands out]) and a gather's full
               buffer may cross first */
            if (world == 1) CHECK_STR_CONTAINS(fsdp_errmsg(c), "(activations)");
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
    const char *not_sizes[] = {"0x10", "1e3", " 5G", "+5G", "0x1p4K"}; /* strtod reads each; none is a size */
    for (int k = 0; k < 5; k++) {
        CHECK_INT_EQ(fsdp_mem_parse_size(c, not_sizes[k], &v), FSDP_ERR_INVALID);
        CHECK_STR_CONTAINS(fsdp_errmsg(c), "is not a memory size");
    }
}

TEST_MAIN()
