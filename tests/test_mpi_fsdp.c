/*
 * test_mpi_fsdp.c - the sharded model against an unsharded reference, run by
 * tests/run.sh at 1, 2, 3 and 4 ranks (3 pads unevenly). The reference is a
 * plain training loop over a materialized model on the full global batch in
 * every rank's own process: the 1-rank computation, with no sharding code.
 */
#include "fsdp.h"
#include "harness.h"

#include <mpi.h>

#include "mpi_harness.h"
#include "ref_model.h"
#include "nn/nn-impl.h"

static struct fsdp_gpt_config tiny_cfg(void) {
    struct fsdp_gpt_config c;
    fsdp_gpt_config_preset("tiny", &c);
    return c;
}

/* ---- tests ---- */

/* Every parameter of the sharded model equals the materialized model bit for bit. */
TEST(init_bit_identical_to_unsharded) {
    struct fsdp_ctx *c = get_ctx();
    struct fsdp_gpt_config cfg = tiny_cfg();
    struct fsdp_module *g, *ref;
    ASSERT_OK(fsdp_gpt_create(c, &cfg, &g), c);
    ASSERT_OK(fsdp_gpt_create(c, &cfg, &ref), c);
    fsdp_module_finalize(c, ref);
    ASSERT_OK(fsdp_module_materialize(c, ref, 42), c);
    struct fsdp_model *fm;
    ASSERT_OK(fsdp_fully_shard(c, g, NULL, &fm), c);
    ASSERT_OK(fsdp_model_init_params(c, fm, 42), c);
    struct ref r = {0};
    fsdp_module_foreach_param(ref, ref_collect, &r);
    for (int i = 0; i < r.n; i++) {
        float *buf = malloc((size_t)r.p[i]->numel * sizeof(float));
        CHECK_OK(fsdp_model_get_param(c, fm, r.p[i]->fqn, buf), c);
        if (memcmp(buf, r.p[i]->data, (size_t)r.p[i]->numel * sizeof(float)) != 0)
            TEST_FAILF("parameter %s differs from the unsharded init", r.p[i]->fqn);
        free(buf);
    }
    free(r.p);
    fsdp_model_free(fm);
    fsdp_module_free(g);
    fsdp_module_free(ref);
}

/* The default policy: one unit per Block, the rest (with the tied pair) in the root. */
TEST(units_of_default_policy) {
    struct fsdp_ctx *c = get_ctx();
    struct fsdp_gpt_config cfg = tiny_cfg();
    struct fsdp_module *g;
    ASSERT_OK(fsdp_gpt_create(c, &cfg, &g), c);
    struct fsdp_model *fm;
    ASSERT_OK(fsdp_fully_shard(c, g, NULL, &fm), c);
    ASSERT_INT_EQ(fsdp_model_n_units(fm), 1 + cfg.n_layer);
    struct fsdp_unit_info ui;
    fsdp_model_unit_info(fm, 0, &ui);
    CHECK_STR_EQ(ui.fqn, "");
    int has_wte = 0, has_lm = 0;
    for (int j = 0; j < ui.n_params; j++) {
        has_wte |= !strcmp(ui.param_fqns[j], "transformer.wte.weight");
        has_lm |= !strcmp(ui.param_fqns[j], "lm_head.weight");
    }
    CHECK(has_wte);
    CHECK(!has_lm); /* tied: stored once, as wte */
    int world = fsdp_ctx_world(c);
    for (int i = 0; i < fsdp_model_n_units(fm); i++) {
        fsdp_model_unit_info(fm, i, &ui);
        CHECK_INT_EQ(ui.numel_padded % world, 0);
        CHECK(ui.numel_padded >= ui.numel_full && ui.numel_padded - ui.numel_full < world);
        CHECK_INT_EQ(ui.numel_shard * world, ui.numel_padded);
        if (i > 0) {
            char want[64];
            snprintf(want, sizeof want, "transformer.h.%d", i - 1);
            CHECK_STR_EQ(ui.fqn, want);
        }
    }
    fsdp_model_free(fm);
    fsdp_module_free(g);
}

/* No rank holds the whole model at init: peak library memory during sharding
 * and init is within the shards plus one unit's full buffer. */
TEST(init_memory_within_shard_plus_unit) {
    struct fsdp_ctx *c = get_ctx();
    struct fsdp_gpt_config cfg;
    fsdp_gpt_config_preset("small", &cfg);
    struct fsdp_module *g;
    ASSERT_OK(fsdp_gpt_create(c, &cfg, &g), c);
    fsdp_arena_reset(c);
    struct fsdp_mem_stats m0, m1;
    fsdp_mem_get(c, &m0);
    fsdp_mem_reset_peak(c);
    struct fsdp_model *fm;
    ASSERT_OK(fsdp_fully_shard(c, g, NULL, &fm), c);
    ASSERT_OK(fsdp_model_init_params(c, fm, 1), c);
    fsdp_mem_get(c, &m1);
    size_t shard = 0, largest = 0;
    for (int i = 0; i < fsdp_model_n_units(fm); i++) {
        struct fsdp_unit_info ui;
        fsdp_model_unit_info(fm, i, &ui);
        shard += 2 * (size_t)ui.numel_shard * sizeof(float) + 64 + 64; /* param + grad shard */
        if ((size_t)ui.numel_padded * 4 > largest) largest = (size_t)ui.numel_padded * 4;
    }
    size_t used = m1.peak_total - m0.cur_total;
    if (used > shard + largest)
        TEST_FAILF("init peak %zu bytes > shards %zu + one unit %zu", used, shard, largest);
    size_t whole = (size_t)fsdp_module_numel(g) * sizeof(float);
    /* params + grads: 2/world of the whole model (plus padding and headers) */
    size_t scaled = 2 * whole / (size_t)fsdp_ctx_world(c) + 64 * 1024;
    if (used > scaled) TEST_FAILF("init used %zu bytes, more than 2/world of the model (%zu)", used, scaled);
    fsdp_model_free(fm);
    fsdp_module_free(g);
}

/* Training on N ranks reproduces the unsharded run on the full batch. */
static void check_training(const char *optim, int steps, const char *wrap_type) {
    struct fsdp_ctx *c = get_ctx();
    int world = fsdp_ctx_world(c), rank = fsdp_ctx_rank(c);
    struct fsdp_gpt_config cfg = tiny_cfg();
    struct fsdp_data *data;
    ASSERT_OK(fsdp_data_synthetic(c, 7, 1 << 16, &data), c);
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    if (!strcmp(optim, "sgd")) {
        oo.kind = FSDP_OPTIM_SGD;
        oo.momentum = 0.9f;
    }
    struct ref r;
    ref_init(&r, c, &cfg, 5, &oo);
    struct fsdp_module *g;
    ASSERT_OK(fsdp_gpt_create(c, &cfg, &g), c);
    struct fsdp_model *fm;
    struct fsdp_shard_opts so = fsdp_shard_opts_default();
    so.wrap_ud = (void *)wrap_type;
    ASSERT_OK(fsdp_fully_shard(c, g, &so, &fm), c);
    ASSERT_OK(fsdp_model_init_params(c, fm, 5), c);
    struct fsdp_optim *opt;
    ASSERT_OK(fsdp_optim_create(c, &oo, &opt), c);
    ASSERT_OK(fsdp_model_attach_optim(c, fm, opt), c);
    const int B = 12, T = 32;
    struct fsdp_lr_sched sched = {FSDP_LR_COSINE, 3e-3f, 3e-4f, 3, steps};
    int32_t *gin = malloc(B * T * sizeof(int32_t)), *gtg = malloc(B * T * sizeof(int32_t));
    int32_t *lin = malloc(B * T * sizeof(int32_t)), *ltg = malloc(B * T * sizeof(int32_t));
    for (int s = 0; s < steps; s++) {
        float lr = fsdp_lr_at(&sched, s);
        fsdp_data_batch(data, s, B, T, 0, 1, gin, gtg);
        fsdp_data_batch(data, s, B, T, rank, world, lin, ltg);
        double want[3];
        ref_step(&r, c, gin, gtg, B, T, lr, 0.5f, want);
        struct fsdp_step_result got;
        ASSERT_OK(fsdp_model_train_step(c, fm, lin, ltg, B / world, T, lr, 0.5f, &got), c);
        CHECK_NEAR(got.loss, want[0], 1e-5, 0);
        CHECK_NEAR(got.grad_norm, want[1], 1e-5, 0);
        CHECK_NEAR(got.param_norm, want[2], 1e-5, 0);
        if (s == 0) {
            /* tied weights: the sharded gradient of wte holds both paths */
            struct fsdp_param *p = fsdp_module_find_param(r.gpt, "transformer.wte.weight");
            float *gbuf = malloc((size_t)p->numel * sizeof(float));
            CHECK_OK(fsdp_model_get_grad(c, fm, "transformer.wte.weight", gbuf), c);
            double mx, md = max_abs_diff(gbuf, p->grad, p->numel, &mx);
            if (!(md <= 1e-5 * mx + 1e-9)) TEST_FAILF("wte grad differs: max diff %g (max %g)", md, mx);
            free(gbuf);
        }
    }
    free(gin); free(gtg); free(lin); free(ltg);
    fsdp_model_free(fm);
    fsdp_optim_free(opt);
    fsdp_module_free(g);
    ref_free(&r);
    fsdp_data_free(data);
}

TEST(train_adamw_matches_unsharded) { check_training("adamw", 10, "Block"); }
TEST(train_sgd_matches_unsharded) { check_training("sgd", 10, "Block"); }

/* Wrapping every Embedding would split the tied pair (wte in its own unit,
 * lm_head in the root): the shared weight is hoisted into the root unit, the
 * wte unit stays empty, and training still matches. */
TEST(tied_weight_hoisted_across_units) {
    struct fsdp_ctx *c = get_ctx();
    struct fsdp_gpt_config cfg = tiny_cfg();
    struct fsdp_module *g;
    ASSERT_OK(fsdp_gpt_create(c, &cfg, &g), c);
    struct fsdp_shard_opts so = fsdp_shard_opts_default();
    so.wrap_ud = (void *)"Embedding";
    struct fsdp_model *fm;
    ASSERT_OK(fsdp_fully_shard(c, g, &so, &fm), c);
    ASSERT_INT_EQ(fsdp_model_n_units(fm), 3);
    struct fsdp_unit_info ui;
    fsdp_model_unit_info(fm, 0, &ui);
    int in_root = 0;
    for (int j = 0; j < ui.n_params; j++) in_root |= !strcmp(ui.param_fqns[j], "transformer.wte.weight");
    CHECK(in_root);
    fsdp_model_unit_info(fm, 1, &ui);
    CHECK_STR_EQ(ui.fqn, "transformer.wte");
    CHECK_INT_EQ(ui.n_params, 0);
    fsdp_model_unit_info(fm, 2, &ui);
    CHECK_STR_EQ(ui.fqn, "transformer.wpe");
    CHECK_INT_EQ(ui.n_params, 1);
    fsdp_model_free(fm);
    fsdp_module_free(g);
    check_training("adamw", 4, "Embedding");
}

/* A container that runs a GPT (child 0) and, while extra_on, adds to its
 * logits a Linear(1, vocab) (child 1) of a constant 1. */
static int extra_on;

static enum fsdp_status sometimes_forward(struct fsdp_module *m, struct fsdp_ctx *cx, const struct fsdp_tensor *in,
                                          struct fsdp_tensor *out) {
    enum fsdp_status st = fsdp_module_forward(m->children[0], cx, in, out);
    if (st != FSDP_OK || !extra_on) return st;
    int64_t v = out->shape[out->ndim - 1], n = fsdp_tensor_numel(out) / v;
    struct fsdp_tensor x = {0}, y = {0};
    x.data = fsdp_arena_alloc(cx, (size_t)n * sizeof(float));
    if (!x.data) return FSDP_ERR_NOMEM;
    x.dtype = FSDP_F32;
    x.ndim = 2;
    x.shape[0] = n;
    x.shape[1] = 1;
    for (int64_t i = 0; i < n; i++) ((float *)x.data)[i] = 1.0f;
    st = fsdp_module_forward(m->children[1], cx, &x, &y);
    for (int64_t i = 0; st == FSDP_OK && i < n * v; i++) ((float *)out->data)[i] += ((float *)y.data)[i];
    return st;
}

static enum fsdp_status sometimes_backward(struct fsdp_module *m, struct fsdp_ctx *cx, const struct fsdp_tensor *dout,
                                           struct fsdp_tensor *din) {
    if (extra_on) {
        enum fsdp_status st = fsdp_module_backward(m->children[1], cx, dout, NULL);
        if (st != FSDP_OK) return st;
    }
    return fsdp_module_backward(m->children[0], cx, dout, din);
}

static const struct fsdp_module_ops sometimes_ops = {"Sometimes", sometimes_forward, sometimes_backward, NULL};

/* [Note: unset gradients]: a parameter in a unit that backward does not
 * reach this step gets gradient 0, not what an earlier step left in the
 * pooled full gradient (or, at one rank, in the shard). The extra Linear
 * shares the root unit with the GPT's embeddings and runs on odd steps. */
TEST(unreached_gradient_is_zero) {
    struct fsdp_ctx *c = get_ctx();
    int world = fsdp_ctx_world(c), rank = fsdp_ctx_rank(c);
    struct fsdp_gpt_config cfg = tiny_cfg();
    struct fsdp_module *root, *g, *lin;
    ASSERT_OK(fsdp_module_create(c, &sometimes_ops, "", &root), c);
    ASSERT_OK(fsdp_gpt_create(c, &cfg, &g), c);
    ASSERT_OK(fsdp__linear_create(c, "extra", 1, cfg.vocab_size, 1, 0.02f, &lin), c);
    snprintf(g->name, sizeof g->name, "gpt");
    ASSERT_OK(fsdp_module_add_child(c, root, g), c);
    ASSERT_OK(fsdp_module_add_child(c, root, lin), c);
    struct fsdp_model *fm;
    ASSERT_OK(fsdp_fully_shard(c, root, NULL, &fm), c);
    ASSERT_OK(fsdp_model_init_params(c, fm, 5), c);
    struct fsdp_optim *opt;
    ASSERT_OK(fsdp_optim_create(c, NULL, &opt), c);
    ASSERT_OK(fsdp_model_attach_optim(c, fm, opt), c);
    struct fsdp_data *data;
    ASSERT_OK(fsdp_data_synthetic(c, 7, 1 << 16, &data), c);
    enum { B = 4, T = 16 };
    int32_t in[B * T], tg[B * T];
    float *gw = malloc((size_t)cfg.vocab_size * sizeof(float)), *gb = malloc((size_t)cfg.vocab_size * sizeof(float));
    for (int s = 0; s < 4; s++) {
        extra_on = s % 2;
        fsdp_data_batch(data, s, B, T, rank, world, in, tg);
        struct fsdp_step_result res;
        ASSERT_OK(fsdp_model_train_step(c, fm, in, tg, B / world, T, 1e-3f, 1.0f, &res), c);
        CHECK_OK(fsdp_model_get_grad(c, fm, "extra.weight", gw), c);
        CHECK_OK(fsdp_model_get_grad(c, fm, "extra.bias", gb), c);
        int nonzero = 0;
        for (int64_t i = 0; i < cfg.vocab_size; i++) nonzero += gw[i] != 0.0f || gb[i] != 0.0f;
        if (extra_on) CHECK(nonzero > 0);           /* it trains when used */
        else CHECK_INT_EQ(nonzero, 0);              /* and is zero when not */
    }
    free(gw);
    free(gb);
    fsdp_data_free(data);
    fsdp_model_free(fm);
    fsdp_optim_free(opt);
    fsdp_module_free(root);
}

/* reshard_after_forward=0 keeps block buffers gathered until backward: more
 * full-buffer memory at the end of forward, same results. */
TEST(reshard_after_forward_off_keeps_buffers) {
    struct fsdp_ctx *c = get_ctx();
    struct fsdp_gpt_config cfg = tiny_cfg();
    size_t peak[2];
    double loss[2], gnorm[2], pnorm[2]; /* the backward and the update as well as the forward */
    for (int k = 0; k < 2; k++) {
        struct fsdp_module *g;
        ASSERT_OK(fsdp_gpt_create(c, &cfg, &g), c);
        struct fsdp_shard_opts so = fsdp_shard_opts_default();
        so.reshard_after_forward = k == 0;
        so.overlap = 0; /* a prefetched next Block would hide the difference in a 2-Block model */
        struct fsdp_model *fm;
        ASSERT_OK(fsdp_fully_shard(c, g, &so, &fm), c);
        ASSERT_OK(fsdp_model_init_params(c, fm, 3), c);
        struct fsdp_optim *opt;
        struct fsdp_optim_opts oo = fsdp_optim_opts_default();
        ASSERT_OK(fsdp_optim_create(c, &oo, &opt), c);
        ASSERT_OK(fsdp_model_attach_optim(c, fm, opt), c);
        int32_t in[4 * 16], tg[4 * 16];
        for (int i = 0; i < 4 * 16; i++) { in[i] = (i * 7) % 256; tg[i] = (i * 11) % 256; }
        struct fsdp_mem_stats m0, m1;
        fsdp_mem_get(c, &m0);
        fsdp_mem_reset_peak(c);
        struct fsdp_step_result res;
        ASSERT_OK(fsdp_model_train_step(c, fm, in, tg, 1, 16, 1e-3f, 1.0f, &res), c);
        fsdp_mem_get(c, &m1);
        peak[k] = m1.peak[FSDP_MEM_FULL];
        loss[k] = res.loss;
        gnorm[k] = res.grad_norm;
        pnorm[k] = res.param_norm;
        (void)m0;
        fsdp_model_free(fm);
        fsdp_optim_free(opt);
        fsdp_module_free(g);
    }
    if (fsdp_ctx_world(c) > 1) CHECK(peak[1] > peak[0]); /* a world of one gathers nothing */
    CHECK_NEAR(loss[1], loss[0], 0, 0);
    CHECK_NEAR(gnorm[1], gnorm[0], 0, 0);
    CHECK_NEAR(pnorm[1], pnorm[0], 0, 0);
}

/* Misuse gives errors, not crashes. */
TEST(errors_name_the_problem) {
    struct fsdp_ctx *c = get_ctx();
    struct fsdp_gpt_config cfg = tiny_cfg();
    struct fsdp_module *g;
    ASSERT_OK(fsdp_gpt_create(c, &cfg, &g), c);
    struct fsdp_model *fm;
    ASSERT_OK(fsdp_fully_shard(c, g, NULL, &fm), c);
    struct fsdp_model *fm2;
    CHECK(fsdp_fully_shard(c, g, NULL, &fm2) == FSDP_ERR_STATE);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "already");
    int32_t in[8] = {0}, tg[8] = {0};
    struct fsdp_step_result res;
    CHECK(fsdp_model_train_step(c, fm, in, tg, 1, 8, 1e-3f, 1, &res) == FSDP_ERR_STATE);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "optimizer");
    float buf[4];
    CHECK(fsdp_model_get_param(c, fm, "no.such.param", buf) == FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "no.such.param");
    /* a token out of range is an error, and the model is usable afterwards */
    struct fsdp_optim *opt;
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    ASSERT_OK(fsdp_optim_create(c, &oo, &opt), c);
    ASSERT_OK(fsdp_model_attach_optim(c, fm, opt), c);
    in[3] = 999;
    CHECK(fsdp_model_train_step(c, fm, in, tg, 1, 8, 1e-3f, 1, &res) != FSDP_OK);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "999");
    in[3] = 1;
    CHECK_OK(fsdp_model_train_step(c, fm, in, tg, 1, 8, 1e-3f, 1, &res), c);
    fsdp_model_free(fm);
    fsdp_optim_free(opt);
    fsdp_module_free(g);
}

TEST_MAIN()
