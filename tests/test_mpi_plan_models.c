/*
 * test_mpi_plan_models.c - the memory planner (src/fsdp/plan.c, [Note:
 * measure mode]) on models other than the GPT, against real runs at 1..4
 * ranks (tests/run.sh): a user model of examples/toy.h layers, a ResNet and
 * SwAV's model (fp32 and AMP_BF16, with and without checkpointing), each
 * planned with its own step (fsdp_plan_memory_run) and equal to the byte to
 * what fsdp_mem_get measures over sharding, attaching the optimizer and two
 * training steps; backward's release of ResNet's blocks; a plan that leaves
 * the model as it was; a module that cannot run in measure mode failing the
 * plan by name; a bf16 ResNet making no fp32 conv weights. The GPT's plans:
 * test_mpi_plan.c.
 */
#include "fsdp.h"
#include "harness.h"

#include <math.h>
#include <mpi.h>

#pragma GCC diagnostic ignored "-Wunused-function" /* toy.h's helpers this file does not use */
#include "../examples/toy.h" /* before mpi_harness.h, whose global ctx its parameters would shadow */
#include "mpi_harness.h"
#include "plan_helpers.h"

/* ---- Any model: a user model and a ResNet ---- */

/* A model, its batch and its step, for both the plan and the real run. */
struct model_case {
    const char *name;
    enum fsdp_status (*build)(struct fsdp_ctx *c, int ckpt, struct fsdp_module **out);
    const char *unit_type;          /* a unit per module of this type */
    int B;                          /* global batch; per rank B / world */
    struct fsdp_tensor x, y;        /* this rank's batch (data owned here) */
    int inplace;                    /* the loss's gradient over the output: the library's, dead
                                       once taken ([Note: backward releases the blocks]) */
    double got[4];                  /* the real run's loss and gradient norm at steps 0 and 1 */
    struct fsdp_mem_plan plan;      /* check_case's */
};

/* A user model on tokens from examples/toy.h: embed -> fc1 -> act1 -> fc2
 * -> act2 -> head (logits over V), the Linears' units; ckpt: fc1 and fc2
 * checkpointed. */
enum { TOY_V = 40, TOY_C = 24, TOY_H = 56, TOY_T = 16 };

static enum fsdp_status toy_build(struct fsdp_ctx *c, int ckpt, struct fsdp_module **out) {
    struct fsdp_module *root = toy_seq(c, NULL, "");
    toy_embed(c, root, "embed", TOY_V, TOY_C);
    struct fsdp_module *f1 = toy_linear(c, root, "fc1", TOY_C, TOY_H, 0.3f);
    toy_tanh(c, root, "act1");
    struct fsdp_module *f2 = toy_linear(c, root, "fc2", TOY_H, TOY_C, 0.3f);
    toy_tanh(c, root, "act2");
    toy_linear(c, root, "head", TOY_C, TOY_V, 0.3f);
    f1->checkpoint = f2->checkpoint = ckpt;
    *out = root;
    return fsdp_module_finalize(c, root);
}

/* A ResNet-18 of width 8 on 12 x 12 images (the CIFAR stem), its blocks'
 * units; ckpt: every BasicBlock checkpointed. */
static enum fsdp_status resnet_build(struct fsdp_ctx *c, int ckpt, struct fsdp_module **out) {
    struct fsdp_resnet_config rc;
    fsdp_resnet_config_preset("resnet18", &rc);
    rc.width = 8;
    rc.num_classes = 10;
    rc.stem = FSDP_RESNET_STEM_CIFAR;
    TRY(fsdp_resnet_create(c, &rc, out));
    for (int l = 1; ckpt && l <= 4; l++)
        for (int b = 0; b < 2; b++) {
            char fqn[64];
            snprintf(fqn, sizeof fqn, "layer%d.%d.conv1.weight", l, b);
            fsdp_module_find_param(*out, fqn)->owner->parent->checkpoint = 1;
        }
    return FSDP_OK;
}

/* SwAV's model (fsdp_swav_model_create): ResNet-18/8's logits as the
 * trunk's 10 features, then a head (hidden 16, dimension 8, 12 prototypes);
 * the trunk's blocks' units. */
static enum fsdp_status swav_build(struct fsdp_ctx *c, int ckpt, struct fsdp_module **out) {
    struct fsdp_module *trunk, *head;
    TRY(resnet_build(c, ckpt, &trunk));
    snprintf(trunk->name, sizeof trunk->name, "trunk");
    struct fsdp_swav_head_config hc = {10, 16, 8, 12, 1};
    enum fsdp_status st = fsdp_swav_head_create(c, "head", &hc, &head);
    if (st != FSDP_OK) {
        fsdp_module_free(trunk);
        return st;
    }
    return fsdp_swav_model_create(c, "", trunk, head, out);
}

/* One step: forward, cross-entropy, backward, AdamW (the step of
 * fsdp-train's image task, and of a user's loop). */
static enum fsdp_status case_step(struct fsdp_ctx *c, struct fsdp_model *fm, int step, void *ud) {
    (void)step;
    struct model_case *k = ud;
    struct fsdp_tensor out, dout = {0};
    double value;
    TRY(fsdp_model_forward_tensor(c, fm, &k->x, &out));
    if (k->inplace) dout = out;
    TRY(fsdp_model_loss(c, fm, NULL, &out, &k->y, 1, &value, &dout));
    TRY(fsdp_model_backward(c, fm, &dout));
    struct fsdp_step_result res;
    TRY(fsdp_model_optim_step(c, fm, 1e-3f, 1.0f, &res));
    if (step < 2) k->got[2 * step] = value, k->got[2 * step + 1] = res.grad_norm;
    return FSDP_OK;
}

static void case_batch(struct model_case *k, int Bl, int images) {
    struct fsdp_tensor *x = &k->x, *y = &k->y;
    memset(x, 0, sizeof *x);
    memset(y, 0, sizeof *y);
    if (images) {
        *x = (struct fsdp_tensor){NULL, FSDP_F32, 4, {Bl, 3, 12, 12}, FSDP_LAYOUT_PLAIN};
        *y = (struct fsdp_tensor){NULL, FSDP_I32, 1, {Bl}, FSDP_LAYOUT_PLAIN};
    } else {
        *x = (struct fsdp_tensor){NULL, FSDP_I32, 2, {Bl, TOY_T}, FSDP_LAYOUT_PLAIN};
        *y = (struct fsdp_tensor){NULL, FSDP_I32, 2, {Bl, TOY_T}, FSDP_LAYOUT_PLAIN};
    }
    int64_t nx = fsdp_tensor_numel(x), ny = fsdp_tensor_numel(y);
    x->data = malloc((size_t)nx * 4);
    y->data = malloc((size_t)ny * 4);
    for (int64_t i = 0; i < nx; i++) {
        if (images) ((float *)x->data)[i] = sinf(0.37f * (float)i);
        else ((int32_t *)x->data)[i] = (int32_t)((i * 7 + 3) % TOY_V);
    }
    for (int64_t i = 0; i < ny; i++) ((int32_t *)y->data)[i] = (int32_t)((i * 5 + 1) % (images ? 10 : TOY_V));
}

/* The case's sharding (a unit per module of its unit type, precision prec)
 * and plan options (this rank and world, the case's own step). */
static void case_opts(struct fsdp_ctx *c, struct model_case *k, enum fsdp_dtype prec, struct fsdp_shard_opts *so,
                      struct fsdp_plan_opts *po) {
    *so = fsdp_shard_opts_default();
    so->wrap_ud = (void *)k->unit_type;
    so->precision = prec;
    *po = fsdp_plan_opts_default();
    po->world = fsdp_ctx_world(c);
    po->rank = fsdp_ctx_rank(c);
    po->threads = 1;
    po->step = case_step;
    po->ud = k;
}

/* Plans the case (fsdp_plan_memory_run with the case's own step), then runs
 * it for real: every figure equal. */
static void check_case(struct model_case *k, int images, enum fsdp_dtype prec, int ckpt) {
    struct fsdp_ctx *c = get_ctx();
    int world = fsdp_ctx_world(c);
    case_batch(k, k->B / world, images);
    struct fsdp_module *root;
    ASSERT_OK(k->build(c, ckpt, &root), c);
    struct fsdp_shard_opts so;
    struct fsdp_plan_opts po;
    case_opts(c, k, prec, &so, &po);
    struct fsdp_mem_stats m0;
    measure_from(c, &m0); /* after the model's buffers */
    struct fsdp_mem_plan plan;
    ASSERT_OK(fsdp_plan_memory_run(c, root, &so, &po, &plan), c);
    struct fsdp_model *fm = NULL;
    struct fsdp_optim *opt = NULL;
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    ASSERT_OK(fsdp_fully_shard(c, root, &so, &fm), c);
    ASSERT_OK(fsdp_model_init_params(c, fm, 7), c);
    ASSERT_OK(fsdp_optim_create(c, &oo, &opt), c);
    ASSERT_OK(fsdp_model_attach_optim(c, fm, opt), c);
    for (int s = 0; s < 2; s++) CHECK_OK(case_step(c, fm, s, k), c);
    char what[96];
    snprintf(what, sizeof what, "%s %s ckpt %d%s", k->name, fsdp_dtype_name(prec), ckpt,
             k->inplace ? " in place" : "");
    check_equal(c, &plan, &m0, what);
    k->plan = plan;
    fsdp_model_free(fm);
    fsdp_optim_free(opt);
    fsdp_module_free(root);
    free(k->x.data);
    free(k->y.data);
}

static void check_toy(enum fsdp_dtype prec, int ckpt) {
    struct model_case k = {.name = "user model", .build = toy_build, .unit_type = "ToyLinear", .B = 8};
    check_case(&k, 0, prec, ckpt);
}

static void check_resnet(enum fsdp_dtype prec, int ckpt) {
    struct model_case k = {.name = "ResNet-18/8", .build = resnet_build, .unit_type = "BasicBlock", .B = 4};
    check_case(&k, 1, prec, ckpt);
}

/* [Note: backward releases the blocks] in ResNet and its Sequentials (and
 * in SwAV's model around one, swav 1): with
 * the loss's gradient over the output (the library's, as fsdp-train's image
 * task passes it) backward moves each layer's input gradient down to where
 * the layer's forward began and hands the rest back, so the plan (equal to
 * the real run's figures) holds fewer activation bytes than with a gradient
 * of the caller's, where nothing may be released; the training is the same
 * bits either way. */
static void check_resnet_release(enum fsdp_dtype prec, int ckpt, int swav) {
    struct model_case own = {.name = swav ? "SwAV ResNet-18/8" : "ResNet-18/8",
                             .build = swav ? swav_build : resnet_build, .unit_type = "BasicBlock", .B = 8};
    struct model_case lib = own;
    lib.inplace = 1;
    check_case(&own, 1, prec, ckpt);
    check_case(&lib, 1, prec, ckpt);
    if (lib.plan.act >= own.plan.act)
        fprintf(stderr, "activations %zu bytes releasing, %zu not\n", lib.plan.act, own.plan.act);
    CHECK(lib.plan.act < own.plan.act);
    CHECK(lib.plan.total < own.plan.total);
    CHECK(own.got[1] > 0);
    CHECK(memcmp(own.got, lib.got, sizeof own.got) == 0);
}

TEST(plan_equals_measured_user_model) { check_toy(FSDP_F32, 0); }
TEST(plan_equals_measured_user_model_checkpointed) { check_toy(FSDP_F32, 1); }
TEST(plan_equals_measured_user_model_bf16) { check_toy(FSDP_BF16, 0); }
TEST(plan_equals_measured_user_model_bf16_checkpointed) { check_toy(FSDP_BF16, 1); }
TEST(plan_equals_measured_resnet) { check_resnet(FSDP_F32, 0); }
TEST(plan_equals_measured_resnet_checkpointed) { check_resnet(FSDP_F32, 1); }
TEST(plan_equals_measured_resnet_bf16) { check_resnet(FSDP_BF16, 0); }
TEST(plan_equals_measured_resnet_bf16_checkpointed) { check_resnet(FSDP_BF16, 1); }
TEST(resnet_backward_releases) { check_resnet_release(FSDP_F32, 0, 0); }
TEST(resnet_backward_releases_bf16) { check_resnet_release(FSDP_BF16, 0, 0); }
TEST(resnet_backward_releases_checkpointed) { check_resnet_release(FSDP_F32, 1, 0); }
TEST(swav_backward_releases) { check_resnet_release(FSDP_F32, 0, 1); }
TEST(swav_backward_releases_bf16) { check_resnet_release(FSDP_BF16, 0, 1); }

/* The plan leaves the model as it was: a batch norm's running statistics
 * (updated by a training forward) and the compute dtypes. */
TEST(plan_keeps_the_model) {
    struct fsdp_ctx *c = get_ctx();
    struct model_case k = {.name = "ResNet-18/8", .build = resnet_build, .unit_type = "BasicBlock", .B = 4};
    case_batch(&k, 2, 1);
    struct fsdp_module *root;
    ASSERT_OK(resnet_build(c, 0, &root), c);
    struct fsdp_buffer *b = fsdp_module_find_buffer(root, "bn1.running_var");
    ASSERT(b != NULL);
    ((float *)b->data)[0] = 2.5f;
    struct fsdp_shard_opts so = fsdp_shard_opts_default();
    so.wrap_ud = (void *)"BasicBlock";
    so.precision = FSDP_BF16;
    struct fsdp_plan_opts po = fsdp_plan_opts_default();
    po.world = 3;
    po.rank = 2;
    po.step = case_step;
    po.ud = &k;
    struct fsdp_mem_plan plan;
    ASSERT_OK(fsdp_plan_memory_run(c, root, &so, &po, &plan), c);
    CHECK_INT_EQ(plan.world, 3);
    CHECK_INT_EQ(plan.rank, 2);
    CHECK(((float *)b->data)[0] == 2.5f);
    CHECK_INT_EQ(fsdp_module_find_param(root, "layer1.0.conv1.weight")->owner->compute_dtype, FSDP_F32);
    CHECK(fsdp_module_find_param(root, "fc.weight")->data == NULL);
    /* and it can be planned again and sharded for real */
    struct fsdp_mem_plan again;
    ASSERT_OK(fsdp_plan_memory_run(c, root, &so, &po, &again), c);
    CHECK_INT_EQ(again.total, plan.total);
    struct fsdp_model *fm;
    ASSERT_OK(fsdp_fully_shard(c, root, &so, &fm), c);
    /* a sharded model is refused, naming a parameter */
    CHECK_INT_EQ(fsdp_plan_memory_run(c, root, &so, &po, &again), FSDP_ERR_STATE);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "has storage");
    fsdp_model_free(fm);
    fsdp_module_free(root);
    free(k.x.data);
    free(k.y.data);
}

/* A user module whose forward fails in measure mode (here: it refuses
 * to run there) fails the plan with a message naming it. */
static enum fsdp_status picky_forward(struct fsdp_module *m, struct fsdp_ctx *c, const struct fsdp_tensor *in,
                                      struct fsdp_tensor *out) {
    if (fsdp_ctx_measuring(c)) return fsdp_error(c, FSDP_ERR_UNSUPPORTED, "no values to look at");
    return tanh_forward(m, c, in, out);
}
static const struct fsdp_module_ops picky_ops = {"Picky", picky_forward, tanh_backward, toy_free_impl};

static enum fsdp_status picky_build(struct fsdp_ctx *c, int ckpt, struct fsdp_module **out) {
    TRY(toy_build(c, ckpt, out));
    struct fsdp_module *p;
    TRY(fsdp_module_create(c, &picky_ops, "picky", &p));
    TRY(fsdp_module_add_child(c, *out, p));
    return fsdp_module_finalize(c, *out);
}

TEST(plan_names_a_module_that_cannot_be_measured) {
    struct fsdp_ctx *c = get_ctx();
    struct model_case k = {.name = "picky", .build = picky_build, .unit_type = "ToyLinear", .B = 4};
    case_batch(&k, 2, 0);
    k.y.shape[1] = TOY_T;
    struct fsdp_module *root;
    ASSERT_OK(picky_build(c, 0, &root), c);
    struct fsdp_plan_opts po = fsdp_plan_opts_default();
    po.world = 2;
    po.step = case_step;
    po.ud = &k;
    struct fsdp_shard_opts so = fsdp_shard_opts_default();
    so.wrap_ud = (void *)"ToyLinear";
    struct fsdp_mem_plan plan;
    CHECK_INT_EQ(fsdp_plan_memory_run(c, root, &so, &po, &plan), FSDP_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "module 'picky' (Picky) cannot run its forward in measure mode");
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "no values to look at");
    fsdp_module_free(root);
    free(k.x.data);
    free(k.y.data);
}

/* The bytes of m's parameters of ndim dimensions, its subtree's included. */
static size_t param_bytes(const struct fsdp_module *m, int ndim) {
    size_t n = 0;
    for (int i = 0; i < m->n_params; i++)
        if (m->params[i]->ndim == ndim && !m->params[i]->tied_to) n += (size_t)m->params[i]->numel * sizeof(float);
    for (int i = 0; i < m->n_children; i++) n += param_bytes(m->children[i], ndim);
    return n;
}

/* The plan of ResNet-18/8 (BasicBlock units) at this world, without a real run. */
static void resnet_plan(enum fsdp_dtype prec, int lend, struct fsdp_mem_plan *plan, size_t *bytes1d) {
    struct fsdp_ctx *c = get_ctx();
    int world = fsdp_ctx_world(c);
    if (!lend) setenv("FSDP_GRAD_LEND", "0", 1);
    struct model_case k = {.name = "ResNet-18/8", .build = resnet_build, .unit_type = "BasicBlock", .B = 8};
    case_batch(&k, k.B / world, 1);
    struct fsdp_module *root;
    ASSERT_OK(resnet_build(c, 0, &root), c);
    *bytes1d = param_bytes(root, 1);
    struct fsdp_shard_opts so;
    struct fsdp_plan_opts po;
    case_opts(c, &k, prec, &so, &po);
    ASSERT_OK(fsdp_plan_memory_run(c, root, &so, &po, plan), c);
    fsdp_module_free(root);
    free(k.x.data);
    free(k.y.data);
    unsetenv("FSDP_GRAD_LEND");
}

/* [Note: lazy widening] for Conv2d: a bf16 training pass reads each conv
 * weight's 16-bit values (gathered, or rounded from the shard at one rank)
 * and makes no fp32 copy of it, so the full buffers hold at most the fp32
 * values of the 1-D parameters (biases) beyond what fp32's hold; with fp32
 * copies of the conv weights the bf16 plan at one rank held a block's conv
 * weights in fp32 beside the shard (ResNet-18 on Fashion-MNIST: 42 MiB). */
TEST(plan_resnet_bf16_makes_no_fp32_conv_weights) {
    struct fsdp_mem_plan p32, p16;
    size_t b1, b1b;
    resnet_plan(FSDP_F32, 1, &p32, &b1);
    resnet_plan(FSDP_BF16, 1, &p16, &b1b);
    CHECK(b1 > 0 && b1 == b1b);
    if (p16.full > p32.full + b1)
        fprintf(stderr, "bf16 full buffers %zu bytes, fp32's %zu + 1-D parameters %zu\n", p16.full, p32.full, b1);
    CHECK(p16.full <= p32.full + b1);
}

/* A backward that releases nothing of its forward's tensors (ResNet's: its
 * scratch stacks above them to the end) lends no gradient shard, so its plan
 * is the one without lending; lent bytes there were reached by the next
 * layer's scratch, which took fresh pages of its own every step. */
TEST(plan_resnet_lending_costs_nothing) {
    for (int k = 0; k < 2; k++) {
        enum fsdp_dtype prec = k ? FSDP_BF16 : FSDP_F32;
        struct fsdp_mem_plan on, off;
        size_t b1;
        resnet_plan(prec, 1, &on, &b1);
        resnet_plan(prec, 0, &off, &b1);
        if (on.grads_lent != 0 || on.grads != off.grads || on.total != off.total)
            TEST_FAILF("%s: with lending %zu bytes (gradients %zu, lent %zu), without %zu (gradients %zu)",
                       fsdp_dtype_name(prec), on.total, on.grads, on.grads_lent, off.total, off.grads);
    }
}

TEST_MAIN()
