/*
 * custom_module.c - sharding a model made of a user-defined module type
 * (not from src/nn) with a custom wrap policy and per-unit overrides.
 *
 *   mpirun -np 3 build/examples/custom_module
 *
 * The model: embed -> 4 x ResidualMLP (x + fc2(tanh(fc1(x)))) -> head.
 * The policy makes every ResidualMLP a unit and the head a unit that keeps
 * its parameters from forward to backward (an override); blocks 1 and 3 are
 * checkpointed. It trains with the split step calls (forward, loss,
 * backward, optimizer step) and ends with an eval-mode pass. The program
 * checks the units it gets, that calling
 * fsdp_summon_full_params from inside a forward is a clear error, and that
 * the loss falls; it prints the losses so that runs at different world sizes
 * can be compared (tests/t_parallelize.sh). Exit 0 and "custom_module: OK"
 * when every check passes.
 */
#include "toy.h"

/* ---- The user-defined module: ResidualMLP ---- */

struct resmlp {
    struct fsdp_module *fc1, *act, *fc2;
};

static struct fsdp_model *g_fm;   /* for the misuse probe below */
static int g_probe = 1;           /* probe once, from the first forward */
static int g_probe_ok;

static enum fsdp_status resmlp_forward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *in,
                                       struct fsdp_tensor *out) {
    struct resmlp *R = m->impl;
    if (g_probe && g_fm) { /* summon inside a forward must fail cleanly (and not hang) */
        g_probe = 0;
        enum fsdp_status st = fsdp_summon_full_params(ctx, g_fm, m, 0, 0);
        g_probe_ok = st == FSDP_ERR_STATE && strstr(fsdp_errmsg(ctx), "inside a forward") != NULL;
        if (fsdp_ctx_rank(ctx) == 0) printf("summon inside forward: %s (%s)\n", fsdp_status_str(st), fsdp_errmsg(ctx));
    }
    struct fsdp_tensor h = {0}, a = {0};
    enum fsdp_status st = fsdp_module_forward(R->fc1, ctx, in, &h);
    if (st == FSDP_OK) st = fsdp_module_forward(R->act, ctx, &h, &a);
    if (st == FSDP_OK) st = fsdp_module_forward(R->fc2, ctx, &a, out);
    if (st != FSDP_OK) return st;
    for (int64_t i = 0; i < fsdp_tensor_numel(in); i++) ((float *)out->data)[i] += ((const float *)in->data)[i];
    return FSDP_OK;
}

static enum fsdp_status resmlp_backward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *dout,
                                        struct fsdp_tensor *din) {
    struct resmlp *R = m->impl;
    struct fsdp_tensor da = {0}, dh = {0}, dx = {0};
    enum fsdp_status st = fsdp_module_backward(R->fc2, ctx, dout, &da);
    if (st == FSDP_OK) st = fsdp_module_backward(R->act, ctx, &da, &dh);
    if (st == FSDP_OK) st = fsdp_module_backward(R->fc1, ctx, &dh, &dx);
    if (st != FSDP_OK || !din) return st;
    if (toy_prepare(ctx, din, dout, dout->shape[dout->ndim - 1]) != FSDP_OK) return FSDP_ERR_NOMEM;
    for (int64_t i = 0; i < fsdp_tensor_numel(dout); i++)
        ((float *)din->data)[i] = ((const float *)dx.data)[i] + ((const float *)dout->data)[i];
    return FSDP_OK;
}

static const struct fsdp_module_ops resmlp_ops = {"ResidualMLP", resmlp_forward, resmlp_backward, toy_free_impl};

static struct fsdp_module *resmlp(struct fsdp_ctx *ctx, struct fsdp_module *parent, const char *name, int64_t D,
                                  int64_t H) {
    struct fsdp_module *m;
    if (fsdp_module_create(ctx, &resmlp_ops, name, &m) != FSDP_OK) return NULL;
    struct resmlp *R = calloc(1, sizeof *R);
    m->impl = R;
    R->fc1 = toy_linear(ctx, m, "fc1", D, H, 0.2f);
    R->act = toy_tanh(ctx, m, "act");
    R->fc2 = toy_linear(ctx, m, "fc2", H, D, 0.1f);
    fsdp_module_add_child(ctx, parent, m);
    return m;
}

/* ---- The policies ---- */

/* Every module of type *ud is a unit; the head keeps its parameters
 * gathered from forward to backward. */
static enum fsdp_wrap my_policy(struct fsdp_module *m, void *ud, struct fsdp_unit_overrides *ovr) {
    if (!strcmp(m->ops->type, (const char *)ud)) return FSDP_WRAP_UNIT;
    if (!strcmp(m->fqn, "head")) {
        ovr->set = FSDP_OVR_RESHARD_AFTER_FORWARD;
        ovr->reshard_after_forward = 0;
        return FSDP_WRAP_UNIT_OVERRIDE;
    }
    return FSDP_WRAP_SKIP;
}

static int my_ac(struct fsdp_module *m, void *ud) {
    (void)ud;
    return !strcmp(m->ops->type, "ResidualMLP") && (m->name[5] - '0') % 2 == 1; /* block1, block3 */
}

int main(void) {
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.threads = 1;
    struct fsdp_ctx *ctx;
    if (fsdp_ctx_create(&co, &ctx) != FSDP_OK) return 1;
    int rank = fsdp_ctx_rank(ctx), world = fsdp_ctx_world(ctx);
    const int V = 48, D = 16, H = 32, B = 12, T = 8, steps = 8;
    struct fsdp_module *root = toy_seq(ctx, NULL, "");
    toy_embed(ctx, root, "embed", V, D);
    for (int i = 0; i < 4; i++) {
        char name[16];
        snprintf(name, sizeof name, "block%d", i);
        resmlp(ctx, root, name, D, H);
    }
    toy_linear(ctx, root, "head", D, V, 0.1f);
    toy_check(ctx, fsdp_module_finalize(ctx, root), "finalize");

    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    struct fsdp_optim *opt;
    toy_check(ctx, fsdp_optim_create(ctx, &oo, &opt), "optim");
    struct fsdp_parallel_config pc = fsdp_parallel_config_default();
    pc.activation_checkpointing = 1;
    pc.seed = 11;
    pc.verbose = 1;
    struct fsdp_wrap_policy wp = {my_policy, (void *)"ResidualMLP"};
    struct fsdp_ac_check ac = {my_ac, NULL};
    struct fsdp_model *fm;
    toy_check(ctx, fsdp_parallelize_model(ctx, root, &pc, opt, FSDP_F32, &wp, &ac, NULL, &fm), "parallelize");

    int fails = 0;
    const char *want[] = {"", "block0", "block1", "block2", "block3", "head"};
    if (fsdp_model_n_units(fm) != 6) fails++;
    for (int i = 0; i < fsdp_model_n_units(fm) && i < 6; i++) {
        struct fsdp_unit_info ui;
        fsdp_model_unit_info(fm, i, &ui);
        if (strcmp(ui.fqn, want[i])) {
            fprintf(stderr, "rank %d: unit %d is '%s', want '%s'\n", rank, i, ui.fqn, want[i]);
            fails++;
        }
    }

    g_fm = fm;
    int32_t *in = malloc((size_t)B * T * sizeof *in), *tg = malloc((size_t)B * T * sizeof *tg);
    double first = 0, last = 0;
    for (int s = 0; s < steps; s++) {
        toy_batch(s % 2, B, T, V, rank, world, in, tg);
        /* fsdp_model_train_step(ctx, fm, in, tg, B / world, T, ...) spelled out as its split calls */
        struct fsdp_tensor x = {in, FSDP_I32, 2, {B / world, T}, FSDP_LAYOUT_PLAIN};
        struct fsdp_tensor t = {tg, FSDP_I32, 2, {B / world, T}, FSDP_LAYOUT_PLAIN};
        struct fsdp_tensor y = {0};
        struct fsdp_loss ce = {.kind = FSDP_LOSS_CROSS_ENTROPY};
        struct fsdp_step_result r;
        toy_check(ctx, fsdp_model_forward_tensor(ctx, fm, &x, &y), "forward");
        toy_check(ctx, fsdp_model_loss(ctx, fm, &ce, &y, &t, 1, NULL, &y), "loss"); /* gradient over y */
        toy_check(ctx, fsdp_model_backward(ctx, fm, &y), "backward");
        toy_check(ctx, fsdp_model_optim_step(ctx, fm, 2e-2f, 1.0f, &r), "optimizer step");
        if (rank == 0) printf("step %d loss %.6f grad_norm %.6f\n", s, r.loss, r.grad_norm);
        if (s == 0) first = r.loss;
        last = r.loss;
    }
    /* an evaluation pass: eval mode keeps no activations; the loss without a gradient */
    fsdp_module_set_training(root, 0);
    toy_batch(0, B, T, V, rank, world, in, tg);
    struct fsdp_tensor x = {in, FSDP_I32, 2, {B / world, T}, FSDP_LAYOUT_PLAIN};
    struct fsdp_tensor t = {tg, FSDP_I32, 2, {B / world, T}, FSDP_LAYOUT_PLAIN};
    struct fsdp_tensor y = {0};
    double eval = 0;
    float mine, sum = 0;
    toy_check(ctx, fsdp_model_forward_tensor(ctx, fm, &x, &y), "eval forward");
    toy_check(ctx, fsdp_model_loss(ctx, fm, NULL, &y, &t, 1, &eval, NULL), "eval loss");
    mine = (float)eval;
    fsdp_comm_allreduce(fsdp_ctx_comm(ctx), &mine, &sum, 1, FSDP_F32, FSDP_SUM);
    if (rank == 0) printf("eval loss %.6f\n", (double)sum / world);
    if (!((double)sum / world < first)) {
        fprintf(stderr, "rank %d: eval loss %g is not below the first step's %g\n", rank, (double)sum / world, first);
        fails++;
    }
    if (!g_probe_ok) {
        fprintf(stderr, "rank %d: summon inside forward was not refused\n", rank);
        fails++;
    }
    if (!(last < first)) {
        fprintf(stderr, "rank %d: loss did not fall (%g -> %g)\n", rank, first, last);
        fails++;
    }
    int any = 0;
    fsdp_comm_allreduce(fsdp_ctx_comm(ctx), &fails, &any, 1, FSDP_I32, FSDP_MAX);
    if (rank == 0) printf("custom_module: %s (world %d)\n", any ? "FAILED" : "OK", world);
    free(in);
    free(tg);
    fsdp_model_free(fm);
    fsdp_optim_free(opt);
    fsdp_module_free(root);
    fsdp_ctx_free(ctx);
    return any ? 1 : 0;
}
