/*
 * vissl_swav.c - VISSL's FSDP pattern for SwAV: a trunk plus a head whose
 * prototype layers are each their own unit inside the head's unit, kept in
 * fp32 by a per-unit override, and re-initialised with a fixed seed under
 * fsdp_summon_full_params (write-back) so that every rank agrees.
 *
 *   mpirun -np 2 build/examples/vissl_swav
 *
 * Model: trunk (embed, fc, tanh) -> head (projection, then prototypes0..2
 * whose scores are concatenated into the logits). The program checks the
 * units, that after the re-init every rank's shards hold exactly the seeded
 * (row-normalised) prototypes, and that training runs; it prints the losses
 * so that runs at different world sizes can be compared
 * (tests/t_parallelize.sh). Exit 0 and "vissl_swav: OK" when every check
 * passes.
 *
 * Mixed precision: the model is prepared in bf16 with DEFAULT (parameters
 * gathered in bf16, gradients reduced in fp32); the prototypes' override
 * (FSDP_OVR_MIXED_PRECISION = FULL) keeps them wholly fp32 (gather, compute,
 * reduce), which the program checks with fsdp_model_unit_precision. The
 * toy layers multiply in fp32 whatever their compute dtype, so here bf16
 * shows in the gathered values of the trunk and the projection.
 */
#include "toy.h"

#define N_PROTO 3
static const int proto_n[N_PROTO] = {12, 16, 20}; /* prototypes per layer; sum = vocabulary */

/* ---- The head: projection, then every prototype layer on its output ---- */

struct swav_head {
    struct fsdp_module *proj, *proto[N_PROTO];
    int64_t P;
};

static enum fsdp_status head_forward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *in,
                                     struct fsdp_tensor *out) {
    struct swav_head *Hd = m->impl;
    struct fsdp_tensor z = {0};
    enum fsdp_status st = fsdp_module_forward(Hd->proj, ctx, in, &z);
    int64_t V = 0;
    for (int k = 0; k < N_PROTO; k++) V += proto_n[k];
    if (st == FSDP_OK) st = toy_prepare(ctx, out, &z, V);
    int64_t R = toy_rows(&z), off = 0;
    for (int k = 0; k < N_PROTO && st == FSDP_OK; k++) {
        struct fsdp_tensor s = {0};
        st = fsdp_module_forward(Hd->proto[k], ctx, &z, &s);
        for (int64_t r = 0; r < R && st == FSDP_OK; r++)
            memcpy((float *)out->data + r * V + off, (float *)s.data + r * proto_n[k], (size_t)proto_n[k] * sizeof(float));
        off += proto_n[k];
    }
    return st;
}

static enum fsdp_status head_backward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *dout,
                                      struct fsdp_tensor *din) {
    struct swav_head *Hd = m->impl;
    int64_t V = dout->shape[dout->ndim - 1], R = toy_rows(dout), off = 0;
    struct fsdp_tensor dz = {0};
    enum fsdp_status st = toy_prepare(ctx, &dz, dout, Hd->P);
    if (st == FSDP_OK) memset(dz.data, 0, (size_t)fsdp_tensor_numel(&dz) * sizeof(float));
    for (int k = 0; k < N_PROTO && st == FSDP_OK; k++) {
        struct fsdp_tensor ds = {0}, dzk = {0};
        st = toy_prepare(ctx, &ds, dout, proto_n[k]);
        for (int64_t r = 0; r < R && st == FSDP_OK; r++)
            memcpy((float *)ds.data + r * proto_n[k], (const float *)dout->data + r * V + off,
                   (size_t)proto_n[k] * sizeof(float));
        if (st == FSDP_OK) st = fsdp_module_backward(Hd->proto[k], ctx, &ds, &dzk);
        for (int64_t i = 0; i < fsdp_tensor_numel(&dz) && st == FSDP_OK; i++)
            ((float *)dz.data)[i] += ((const float *)dzk.data)[i];
        off += proto_n[k];
    }
    if (st == FSDP_OK) st = fsdp_module_backward(Hd->proj, ctx, &dz, din);
    return st;
}

static const struct fsdp_module_ops swav_head_ops = {"SwAVHead", head_forward, head_backward, toy_free_impl};

/* ---- Policy: trunk, head, and each prototype layer (fp32) its own unit ---- */

static enum fsdp_wrap swav_policy(struct fsdp_module *m, void *ud, struct fsdp_unit_overrides *ovr) {
    (void)ud;
    if (!strcmp(m->fqn, "trunk") || !strcmp(m->ops->type, "SwAVHead")) return FSDP_WRAP_UNIT;
    if (!strncmp(m->name, "prototypes", 10)) {
        ovr->set = FSDP_OVR_MIXED_PRECISION;
        ovr->mixed_precision = FSDP_MP_FULL;
        return FSDP_WRAP_UNIT_OVERRIDE;
    }
    return FSDP_WRAP_SKIP;
}

/* The seeded prototype init: N(0,1)-ish values from a 64-bit LCG, then each
 * row L2-normalised (SwAV keeps prototypes on the unit sphere). */
static void proto_init(float *w, int64_t rows, int64_t cols, uint64_t seed) {
    uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
    for (int64_t i = 0; i < rows * cols; i++) {
        double u = 0;
        for (int j = 0; j < 4; j++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            u += (double)(s >> 11) / 9007199254740992.0;
        }
        w[i] = (float)((u - 2.0) * 1.7320508);
    }
    for (int64_t r = 0; r < rows; r++) {
        double n = 0;
        for (int64_t c = 0; c < cols; c++) n += (double)w[r * cols + c] * w[r * cols + c];
        for (int64_t c = 0; c < cols; c++) w[r * cols + c] = (float)(w[r * cols + c] / sqrt(n));
    }
}

int main(void) {
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.threads = 1;
    struct fsdp_ctx *ctx;
    if (fsdp_ctx_create(&co, &ctx) != FSDP_OK) return 1;
    int rank = fsdp_ctx_rank(ctx), world = fsdp_ctx_world(ctx);
    int V = 0;
    for (int k = 0; k < N_PROTO; k++) V += proto_n[k];
    const int D = 24, P = 8, B = 12, T = 6, steps = 6;
    const uint64_t proto_seed = 31;

    struct fsdp_module *root = toy_seq(ctx, NULL, "");
    struct fsdp_module *trunk = toy_seq(ctx, root, "trunk");
    toy_embed(ctx, trunk, "embed", V, D);
    toy_linear(ctx, trunk, "fc", D, D, 0.2f);
    toy_tanh(ctx, trunk, "act");
    struct fsdp_module *head;
    fsdp_module_create(ctx, &swav_head_ops, "heads", &head);
    struct swav_head *Hd = calloc(1, sizeof *Hd);
    head->impl = Hd;
    Hd->P = P;
    Hd->proj = toy_linear(ctx, head, "projection", D, P, 0.2f);
    for (int k = 0; k < N_PROTO; k++) {
        char name[32];
        snprintf(name, sizeof name, "prototypes%d", k);
        Hd->proto[k] = toy_linear(ctx, head, name, P, proto_n[k], 0.02f);
    }
    fsdp_module_add_child(ctx, root, head);
    toy_check(ctx, fsdp_module_finalize(ctx, root), "finalize");

    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    oo.kind = FSDP_OPTIM_SGD;
    oo.momentum = 0.9f;
    oo.weight_decay = 0.0f;
    struct fsdp_optim *opt;
    toy_check(ctx, fsdp_optim_create(ctx, &oo, &opt), "optim");
    struct fsdp_parallel_config pc = fsdp_parallel_config_default();
    pc.seed = 7;
    pc.verbose = 1;
    pc.mixed_precision = FSDP_MP_DEFAULT;
    struct fsdp_wrap_policy wp = {swav_policy, NULL};
    struct fsdp_model *fm;
    toy_check(ctx, fsdp_parallelize_model(ctx, root, &pc, opt, FSDP_BF16, &wp, NULL, NULL, &fm), "parallelize");

    int fails = 0;
    const char *want[] = {"", "trunk", "heads", "heads.prototypes0", "heads.prototypes1", "heads.prototypes2"};
    if (fsdp_model_n_units(fm) != 6) fails++;
    for (int i = 0; i < fsdp_model_n_units(fm) && i < 6; i++) {
        struct fsdp_unit_info ui;
        fsdp_model_unit_info(fm, i, &ui);
        if (strcmp(ui.fqn, want[i])) {
            fprintf(stderr, "rank %d: unit %d is '%s', want '%s'\n", rank, i, ui.fqn, want[i]);
            fails++;
        }
        /* prototypes (units 3..5) stay fp32; the rest gathers bf16 and reduces fp32 */
        struct fsdp_unit_precision up;
        fsdp_model_unit_precision(fm, i, &up);
        enum fsdp_dtype want_param = i >= 3 ? FSDP_F32 : FSDP_BF16;
        if (up.param_dtype != want_param || up.reduce_dtype != FSDP_F32 ||
            up.compute_dtype != (i >= 3 ? FSDP_F32 : FSDP_BF16)) {
            fprintf(stderr, "rank %d: unit %d '%s' has param %s, reduce %s, compute %s\n", rank, i, ui.fqn,
                    fsdp_dtype_name(up.param_dtype), fsdp_dtype_name(up.reduce_dtype),
                    fsdp_dtype_name(up.compute_dtype));
            fails++;
        }
    }

    /* VISSL: re-initialise the prototypes with a fixed seed, edits written back */
    toy_check(ctx, fsdp_summon_full_params(ctx, fm, head, 1, 0), "summon_full_params");
    for (int k = 0; k < N_PROTO; k++) {
        struct fsdp_param *w = Hd->proto[k]->params[0];
        proto_init(w->data, w->shape[0], w->shape[1], proto_seed + (uint64_t)k);
    }
    toy_check(ctx, fsdp_summon_end(ctx, fm), "summon_end");

    /* every rank's shards now hold exactly the seeded prototypes */
    for (int k = 0; k < N_PROTO; k++) {
        struct fsdp_param *w = Hd->proto[k]->params[0];
        float *got = malloc((size_t)w->numel * sizeof(float)), *exp = malloc((size_t)w->numel * sizeof(float));
        toy_check(ctx, fsdp_model_get_param(ctx, fm, w->fqn, got), "get_param");
        proto_init(exp, w->shape[0], w->shape[1], proto_seed + (uint64_t)k);
        if (memcmp(got, exp, (size_t)w->numel * sizeof(float))) {
            fprintf(stderr, "rank %d: %s is not the seeded init after write-back\n", rank, w->fqn);
            fails++;
        }
        /* and the ranks agree with each other (a checksum's min and max over ranks) */
        float sum = 0, lo = 0, hi = 0;
        for (int64_t i = 0; i < w->numel; i++) sum += got[i] * (float)(i % 7 + 1);
        fsdp_comm_allreduce(fsdp_ctx_comm(ctx), &sum, &lo, 1, FSDP_F32, FSDP_MIN);
        fsdp_comm_allreduce(fsdp_ctx_comm(ctx), &sum, &hi, 1, FSDP_F32, FSDP_MAX);
        if (lo != hi) {
            fprintf(stderr, "rank %d: ranks disagree on %s (checksums %g .. %g)\n", rank, w->fqn, (double)lo,
                    (double)hi);
            fails++;
        }
        free(got);
        free(exp);
    }

    int32_t *in = malloc((size_t)B * T * sizeof *in), *tg = malloc((size_t)B * T * sizeof *tg);
    double first = 0, last = 0;
    for (int s = 0; s < steps; s++) {
        toy_batch(s % 2, B, T, V, rank, world, in, tg);
        struct fsdp_step_result r;
        toy_check(ctx, fsdp_model_train_step(ctx, fm, in, tg, B / world, T, 0.5f, 1.0f, &r), "train step");
        if (rank == 0) printf("step %d loss %.6f grad_norm %.6f\n", s, r.loss, r.grad_norm);
        if (s == 0) first = r.loss;
        last = r.loss;
    }
    if (!(last < first)) {
        fprintf(stderr, "rank %d: loss did not fall (%g -> %g)\n", rank, first, last);
        fails++;
    }
    int any = 0;
    fsdp_comm_allreduce(fsdp_ctx_comm(ctx), &fails, &any, 1, FSDP_I32, FSDP_MAX);
    if (rank == 0) printf("vissl_swav: %s (world %d)\n", any ? "FAILED" : "OK", world);
    free(in);
    free(tg);
    fsdp_model_free(fm);
    fsdp_optim_free(opt);
    fsdp_module_free(root);
    fsdp_ctx_free(ctx);
    return any ? 1 : 0;
}
