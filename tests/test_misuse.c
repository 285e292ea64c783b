/*
 * test_misuse.c - the public API's answer to misuse, on a world of one: a
 * call given sizes that would wrap, a module tree that is not a tree, a
 * train-mode module under a decoding cache, a NULL where the header asks for
 * a value, a learning rate that is not a number, or a checkpoint meta its
 * own reader would refuse returns an error whose message names the
 * argument, and nothing crashes, aborts or writes what cannot be read back
 * (each case once crashed, aborted or was taken). The readers' and layers'
 * own checks are tested beside them (test_idx.c, test_data.c, test_nn*.c).
 */
#include "fsdp.h"
#include "harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static struct fsdp_ctx *new_ctx(void) {
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.comm = FSDP_COMM_SELF;
    co.threads = 1;
    struct fsdp_ctx *ctx = NULL;
    if (fsdp_ctx_create(&co, &ctx) != FSDP_OK) abort();
    return ctx;
}

/* A module with no compute of its own (a container). */
static enum fsdp_status no_forward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *in,
                                   struct fsdp_tensor *out) {
    (void)m, (void)ctx, (void)in, (void)out;
    return FSDP_OK;
}
static const struct fsdp_module_ops box_ops = {"Box", no_forward, NULL, NULL};

static struct fsdp_module *box(struct fsdp_ctx *ctx, const char *name) {
    struct fsdp_module *m = NULL;
    if (fsdp_module_create(ctx, &box_ops, name, &m) != FSDP_OK) abort();
    return m;
}

#define CHECK_ERR(expr, want, ctx, text)                                                                   \
    do {                                                                                                   \
        enum fsdp_status e_ = (expr);                                                                      \
        if (e_ != (want)) TEST_FAILF("%s: %s, want %s", #expr, fsdp_status_str(e_), fsdp_status_str(want)); \
        else CHECK_STR_CONTAINS(fsdp_errmsg(ctx), text);                                                   \
    } while (0)

/* A parameter whose bytes would wrap size_t once multiplied out (2^62
 * elements) is refused where it is declared; parameters that pass alone but
 * together overflow a unit are refused by the sharding. */
TEST(parameter_sizes_that_wrap) {
    struct fsdp_ctx *ctx = new_ctx();
    struct fsdp_module *m = box(ctx, "m");
    struct fsdp_init z = {FSDP_INIT_ZEROS, 0};
    int64_t huge[2] = {INT64_C(1) << 31, INT64_C(1) << 31};
    CHECK_ERR(fsdp_module_add_param(ctx, m, "w", 2, huge, z, 0, NULL), FSDP_ERR_INVALID, ctx,
              "parameter 'w' of module 'm': its 2-d shape holds more than 2^48 elements");
    int64_t big[1] = {INT64_C(1) << 47}; /* each allowed; three together are not */
    CHECK_OK(fsdp_module_add_param(ctx, m, "a", 1, big, z, 0, NULL), ctx);
    CHECK_OK(fsdp_module_add_param(ctx, m, "b", 1, big, z, 0, NULL), ctx);
    CHECK_OK(fsdp_module_add_param(ctx, m, "c", 1, big, z, 0, NULL), ctx);
    CHECK_OK(fsdp_module_finalize(ctx, m), ctx);
    struct fsdp_model *fm = NULL;
    CHECK_ERR(fsdp_fully_shard(ctx, m, NULL, &fm), FSDP_ERR_INVALID, ctx,
              "unit '(root)': its parameters hold more than 2^48 elements (at 'c')");
    CHECK(fm == NULL);
    CHECK_ERR(fsdp_module_add_param(ctx, m, NULL, 1, big, z, 0, NULL), FSDP_ERR_INVALID, ctx, "the name is NULL");
    fsdp_module_free(m);
    fsdp_ctx_free(ctx);
}

/* A module is the child of one module, and never of itself or of a module
 * below it (each was taken: a double free, an endless recursion). */
TEST(module_tree_is_a_tree) {
    struct fsdp_ctx *ctx = new_ctx();
    struct fsdp_module *a = box(ctx, "a"), *b = box(ctx, "b"), *kid = box(ctx, "kid");
    CHECK_OK(fsdp_module_add_child(ctx, a, kid), ctx);
    CHECK_ERR(fsdp_module_add_child(ctx, b, kid), FSDP_ERR_INVALID, ctx, "module 'kid' already has a parent, 'a'");
    CHECK_ERR(fsdp_module_add_child(ctx, b, b), FSDP_ERR_INVALID, ctx, "it is the same module");
    CHECK_ERR(fsdp_module_add_child(ctx, kid, a), FSDP_ERR_INVALID, ctx, "it is one of its ancestors");
    CHECK_ERR(fsdp_module_add_child(ctx, b, NULL), FSDP_ERR_INVALID, ctx, "child is NULL");
    CHECK_INT_EQ(a->n_children, 1);
    CHECK_INT_EQ(b->n_children, 0);
    CHECK_OK(fsdp_module_finalize(ctx, a), ctx);
    fsdp_module_free(a);
    fsdp_module_free(b);
    fsdp_ctx_free(ctx);
}

/* Every field of the defaults is set (nesterov was left to the stack). */
static __attribute__((noinline)) void dirty_stack(void) {
    volatile unsigned char junk[4096];
    for (size_t i = 0; i < sizeof junk; i++) junk[i] = 0xA5;
}
TEST(optimizer_defaults_are_whole) {
    dirty_stack();
    struct fsdp_optim_opts o = fsdp_optim_opts_default();
    CHECK_INT_EQ(o.nesterov, 0);
    struct fsdp_ctx *ctx = new_ctx();
    struct fsdp_optim *opt = NULL;
    CHECK_OK(fsdp_optim_create(ctx, &o, &opt), ctx);
    fsdp_optim_free(opt);
    fsdp_ctx_free(ctx);
}

/* A tiny GPT, sharded with an AdamW attached. */
struct gpt_run {
    struct fsdp_module *g;
    struct fsdp_model *fm;
    struct fsdp_optim *opt;
};
static void gpt_run(struct fsdp_ctx *ctx, struct gpt_run *r) {
    struct fsdp_gpt_config gc;
    fsdp_gpt_config_preset("tiny", &gc);
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    if (fsdp_gpt_create(ctx, &gc, &r->g) != FSDP_OK || fsdp_fully_shard(ctx, r->g, NULL, &r->fm) != FSDP_OK ||
        fsdp_model_init_params(ctx, r->fm, 1) != FSDP_OK || fsdp_optim_create(ctx, &oo, &r->opt) != FSDP_OK ||
        fsdp_model_attach_optim(ctx, r->fm, r->opt) != FSDP_OK) {
        fprintf(stderr, "gpt_run: %s\n", fsdp_errmsg(ctx));
        abort();
    }
}
static void gpt_free(struct gpt_run *r) {
    fsdp_model_free(r->fm);
    fsdp_optim_free(r->opt);
    fsdp_module_free(r->g);
}

/* A Block set back to train mode under an eval GPT with a decoding cache:
 * FSDP_ERR_STATE naming the module (an assertion ended the process). */
TEST(decoding_cache_with_a_block_in_train_mode) {
    struct fsdp_ctx *ctx = new_ctx();
    struct gpt_run r;
    gpt_run(ctx, &r);
    ASSERT_OK(fsdp_gpt_set_cache(ctx, r.g, 2, 8), ctx);
    fsdp_module_set_training(r.g, 0);
    struct fsdp_module *tr = r.g->children[0], *h = NULL;
    for (int i = 0; i < tr->n_children; i++)
        if (!strcmp(tr->children[i]->name, "h")) h = tr->children[i];
    ASSERT(h && h->n_children > 0);
    fsdp_module_set_training(h->children[0], 1);
    int32_t tok[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    struct fsdp_tensor x = {tok, FSDP_I32, 2, {2, 4}, 0}, y = {0};
    CHECK_ERR(fsdp_model_forward_tensor(ctx, r.fm, &x, &y), FSDP_ERR_STATE, ctx,
              "a decoding cache is set (fsdp_gpt_set_cache), so its forwards run in eval mode, but this module "
              "is in train mode");
    fsdp_module_set_training(r.g, 0); /* all eval: the same call decodes */
    CHECK_OK(fsdp_model_forward_tensor(ctx, r.fm, &x, &y), ctx);
    gpt_free(&r);
    fsdp_ctx_free(ctx);
}

/* The step's learning rate and clip are numbers; a NULL result is allowed
 * (nothing reported); NULL outputs and names are refused. */
TEST(step_arguments) {
    struct fsdp_ctx *ctx = new_ctx();
    struct gpt_run r;
    gpt_run(ctx, &r);
    int32_t in[16], tg[16];
    for (int i = 0; i < 16; i++) in[i] = (i * 7 + 1) % 256, tg[i] = (i * 5 + 2) % 256;
    struct fsdp_step_result res;
    CHECK_ERR(fsdp_model_train_step(ctx, r.fm, in, tg, 2, 8, NAN, 1.0f, &res), FSDP_ERR_INVALID, ctx,
              "optimizer step: lr nan");
    CHECK_ERR(fsdp_model_train_step(ctx, r.fm, in, tg, 2, 8, -1e-3f, 1.0f, &res), FSDP_ERR_INVALID, ctx,
              "the learning rate finite and >= 0");
    CHECK_ERR(fsdp_model_train_step(ctx, r.fm, in, tg, 2, 8, 1e-3f, NAN, &res), FSDP_ERR_INVALID, ctx, "clip nan");
    CHECK_OK(fsdp_model_train_step(ctx, r.fm, in, tg, 2, 8, 1e-3f, 1.0f, NULL), ctx);
    CHECK_OK(fsdp_model_train_step(ctx, r.fm, in, tg, 2, 8, 1e-3f, 1.0f, &res), ctx);
    CHECK(isfinite(res.loss) && res.loss > 0);
    CHECK_ERR(fsdp_model_forward(ctx, r.fm, in, 2, 8, NULL), FSDP_ERR_INVALID, ctx, "logits is NULL");
    float w[16];
    CHECK_ERR(fsdp_model_get_param(ctx, r.fm, NULL, w), FSDP_ERR_INVALID, ctx, "the name is NULL");
    CHECK_ERR(fsdp_model_get_param(ctx, r.fm, "transformer.ln_f.bias", NULL), FSDP_ERR_INVALID, ctx,
              "the destination is NULL");
    CHECK_ERR(fsdp_model_get_grad(ctx, r.fm, "transformer.ln_f.bias", NULL), FSDP_ERR_INVALID, ctx,
              "reading a gradient: the destination is NULL");
    CHECK_ERR(fsdp_model_save_full(ctx, r.fm, ""), FSDP_ERR_INVALID, ctx, "save_full: an empty path");
    gpt_free(&r);
    fsdp_ctx_free(ctx);
}

/* A checkpoint meta that its own reader would refuse fails the save before
 * anything replaces the checkpoint already there. */
TEST(checkpoint_meta_the_reader_refuses) {
    struct fsdp_ctx *ctx = new_ctx();
    struct gpt_run r;
    gpt_run(ctx, &r);
    char dir[] = "/tmp/fsdp-misuse-XXXXXX";
    ASSERT(mkdtemp(dir));
    char ck[64];
    snprintf(ck, sizeof ck, "%s/ck", dir);
    struct fsdp_ckpt_meta m;
    memset(&m, 0, sizeof m);
    m.step = 3;
    ASSERT_OK(fsdp_ckpt_save(ctx, r.fm, ck, &m), ctx);
    struct fsdp_ckpt_meta bad = m;
    bad.has_config = 1;
    bad.config = (struct fsdp_gpt_config){-1, 0, 0, 0, 0};
    CHECK_ERR(fsdp_ckpt_save(ctx, r.fm, ck, &bad), FSDP_ERR_INVALID, ctx, "checkpoint meta: config.n_layer is -1");
    bad = m;
    bad.step = -5;
    CHECK_ERR(fsdp_ckpt_save(ctx, r.fm, ck, &bad), FSDP_ERR_INVALID, ctx, "step -5");
    bad = m;
    memset(bad.model_json, 'x', sizeof bad.model_json); /* no end within the field */
    CHECK_ERR(fsdp_ckpt_save(ctx, r.fm, ck, &bad), FSDP_ERR_INVALID, ctx, "model_json does not end within its 1024");
    struct fsdp_ckpt_meta back;
    CHECK_OK(fsdp_ckpt_read_meta(ctx, ck, &back), ctx); /* the first save stays */
    CHECK_INT_EQ(back.step, 3);
    CHECK_OK(fsdp_ckpt_load(ctx, r.fm, ck, NULL), ctx);
    CHECK_ERR(fsdp_ckpt_describe(ctx, ck, 0, NULL), FSDP_ERR_INVALID, ctx, "the output stream is NULL");
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
    gpt_free(&r);
    fsdp_ctx_free(ctx);
}

/* Options out of range: a negative max_inflight, a batch norm eps that is
 * not finite, a plan's world whose hosts x ranks wraps int, NULL outputs. */
TEST(options_out_of_range) {
    struct fsdp_ctx *ctx = new_ctx();
    struct fsdp_gpt_config gc;
    fsdp_gpt_config_preset("tiny", &gc);
    struct fsdp_module *g = NULL;
    ASSERT_OK(fsdp_gpt_create(ctx, &gc, &g), ctx);
    struct fsdp_shard_opts so = fsdp_shard_opts_default();
    so.max_inflight = -3;
    struct fsdp_model *fm = NULL;
    CHECK_ERR(fsdp_fully_shard(ctx, g, &so, &fm), FSDP_ERR_INVALID, ctx, "max_inflight -3");
    so = fsdp_shard_opts_default();
    struct fsdp_net_model nm = {1 << 20, 1 << 20, 10, 1, 0, 1, 0};
    struct fsdp_comm_plan cp;
    CHECK_ERR(fsdp_plan_comm(ctx, g, &so, &nm, &cp), FSDP_ERR_INVALID, ctx, "at most 2^20 ranks in all");
    nm.hosts = 2, nm.ranks_per_host = 2;
    CHECK_OK(fsdp_plan_comm(ctx, g, &so, &nm, &cp), ctx);
    CHECK_INT_EQ(cp.world, 4);
    CHECK_ERR(fsdp_plan_comm(ctx, g, NULL, &nm, &cp), FSDP_ERR_INVALID, ctx, "the shard options is NULL");
    struct fsdp_batchnorm_opts bo = fsdp_batchnorm_opts_default(4);
    bo.eps = INFINITY;
    struct fsdp_module *bn = NULL;
    CHECK_ERR(fsdp_batchnorm2d_create(ctx, "bn", &bo, &bn), FSDP_ERR_INVALID, ctx, "eps inf positive and finite");
    CHECK_ERR(fsdp_gemm_rate(ctx, FSDP_F32, 16, 0, NULL), FSDP_ERR_INVALID, ctx, "gflops is NULL");
    fsdp_module_free(g);
    fsdp_ctx_free(ctx);
}

TEST_MAIN()
