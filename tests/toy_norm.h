/*
 * toy_norm.h - the test model of test_mpi_modules.c and test_mpi_buffers.c:
 * embed (V -> C) -> SyncNorm -> head (C -> V), tokens in, logits out, built
 * from examples/toy.h's layers and a batch norm whose statistics span every
 * rank (fsdp_module_allreduce in forward and backward) and live in buffers.
 * Include after fsdp.h and examples/toy.h.
 */
#ifndef FSDP_TEST_TOY_NORM_H
#define FSDP_TEST_TOY_NORM_H

#define TN_TRY(expr) do { enum fsdp_status tn_ = (expr); if (tn_ != FSDP_OK) return tn_; } while (0)

/* ---- SyncNorm: batch norm over the rows of every rank ----
 * in (..., C) F32; training: mean and biased variance per channel over the
 * global batch (two all-reduces: sums and count, then squared deviations);
 * backward all-reduces the per-channel sums of dy and dy * xhat. Buffers
 * running_mean, running_var (unbiased, momentum 0.1) and num_batches_tracked
 * (I64), as PyTorch's BatchNorm. Eval: the running statistics, no
 * collective. */
static int sn_skip_rank = -1; /* this rank skips forward's first all-reduce (tests of bad input) */

struct syncnorm {
    int64_t C;
    struct fsdp_param *w, *b;
    struct fsdp_buffer *rm, *rv, *nbt;
    float *xhat, *invstd; /* (R, C), (C) arena */
    int64_t R;
};

static enum fsdp_status sn_forward(struct fsdp_module *m, struct fsdp_ctx *c, const struct fsdp_tensor *in,
                                   struct fsdp_tensor *out) {
    struct syncnorm *S = m->impl;
    int64_t C = S->C, R = toy_rows(in);
    if (in->dtype != FSDP_F32 || in->shape[in->ndim - 1] != C) return FSDP_ERR_INVALID;
    TN_TRY(toy_prepare(c, out, in, C));
    const float *x = in->data, *w = S->w->data, *b = S->b->data;
    float *y = out->data;
    float *stat = fsdp_arena_alloc(c, (size_t)(2 * C + 1) * sizeof(float));
    S->xhat = fsdp_arena_alloc(c, (size_t)(R * C) * sizeof(float));
    S->invstd = fsdp_arena_alloc(c, (size_t)C * sizeof(float));
    if (!stat || !S->xhat || !S->invstd) return FSDP_ERR_NOMEM;
    S->R = R;
    float *mean = stat, *var = stat + C;
    if (m->training) {
        memset(stat, 0, (size_t)(2 * C + 1) * sizeof(float));
        for (int64_t r = 0; r < R; r++)
            for (int64_t k = 0; k < C; k++) mean[k] += x[r * C + k];
        stat[2 * C] = (float)R;
        if (fsdp_ctx_rank(c) != sn_skip_rank) /* bad input: a rank that skips the collective */
            TN_TRY(fsdp_module_allreduce(c, m, stat, (size_t)C, FSDP_F32, FSDP_SUM));
        TN_TRY(fsdp_module_allreduce(c, m, stat + 2 * C, 1, FSDP_F32, FSDP_SUM));
        float n = stat[2 * C];
        for (int64_t k = 0; k < C; k++) mean[k] /= n;
        for (int64_t r = 0; r < R; r++)
            for (int64_t k = 0; k < C; k++) {
                float d = x[r * C + k] - mean[k];
                var[k] += d * d;
            }
        TN_TRY(fsdp_module_allreduce(c, m, var, (size_t)C, FSDP_F32, FSDP_SUM));
        float *rm = S->rm->data, *rv = S->rv->data;
        for (int64_t k = 0; k < C; k++) {
            rm[k] = 0.9f * rm[k] + 0.1f * mean[k];
            rv[k] = 0.9f * rv[k] + 0.1f * var[k] / (n - 1.0f);
            var[k] /= n;
        }
        ((int64_t *)S->nbt->data)[0] += 1;
    } else {
        memcpy(mean, S->rm->data, (size_t)C * sizeof(float));
        memcpy(var, S->rv->data, (size_t)C * sizeof(float));
    }
    for (int64_t k = 0; k < C; k++) S->invstd[k] = 1.0f / sqrtf(var[k] + 1e-5f);
    for (int64_t r = 0; r < R; r++)
        for (int64_t k = 0; k < C; k++) {
            float h = (x[r * C + k] - mean[k]) * S->invstd[k];
            S->xhat[r * C + k] = h;
            y[r * C + k] = h * w[k] + b[k];
        }
    return FSDP_OK;
}

static enum fsdp_status sn_backward(struct fsdp_module *m, struct fsdp_ctx *c, const struct fsdp_tensor *dout,
                                    struct fsdp_tensor *din) {
    struct syncnorm *S = m->impl;
    int64_t C = S->C, R = S->R;
    const float *dy = dout->data, *w = S->w->data;
    float *sum = fsdp_arena_alloc(c, (size_t)(2 * C) * sizeof(float));
    if (!sum) return FSDP_ERR_NOMEM;
    memset(sum, 0, (size_t)(2 * C) * sizeof(float));
    for (int64_t r = 0; r < R; r++)
        for (int64_t k = 0; k < C; k++) {
            sum[k] += dy[r * C + k];
            sum[C + k] += dy[r * C + k] * S->xhat[r * C + k];
        }
    for (int64_t k = 0; k < C; k++) {
        S->b->grad[k] += sum[k];
        S->w->grad[k] += sum[C + k];
    }
    if (!din) return FSDP_OK;
    float n = (float)R;
    TN_TRY(fsdp_module_allreduce(c, m, &n, 1, FSDP_F32, FSDP_SUM));
    TN_TRY(fsdp_module_allreduce(c, m, sum, (size_t)(2 * C), FSDP_F32, FSDP_SUM));
    TN_TRY(toy_prepare(c, din, dout, C));
    float *dx = din->data;
    for (int64_t r = 0; r < R; r++)
        for (int64_t k = 0; k < C; k++)
            dx[r * C + k] =
                w[k] * S->invstd[k] * (dy[r * C + k] - sum[k] / n - S->xhat[r * C + k] * sum[C + k] / n);
    return FSDP_OK;
}

static const struct fsdp_module_ops syncnorm_ops = {"SyncNorm", sn_forward, sn_backward, toy_free_impl};

static struct fsdp_module *syncnorm(struct fsdp_ctx *c, struct fsdp_module *parent, const char *name, int64_t C) {
    struct fsdp_module *m;
    if (fsdp_module_create(c, &syncnorm_ops, name, &m) != FSDP_OK) return NULL;
    struct syncnorm *S = calloc(1, sizeof *S);
    m->impl = S;
    S->C = C;
    int64_t s[1] = {C};
    struct fsdp_init one = {FSDP_INIT_ONES, 0}, zero = {FSDP_INIT_ZEROS, 0};
    fsdp_module_add_param(c, m, "weight", 1, s, one, 1, &S->w);
    fsdp_module_add_param(c, m, "bias", 1, s, zero, 1, &S->b);
    fsdp_module_add_buffer(c, m, "running_mean", FSDP_F32, 1, s, zero, 1, &S->rm);
    fsdp_module_add_buffer(c, m, "running_var", FSDP_F32, 1, s, one, 1, &S->rv);
    fsdp_module_add_buffer(c, m, "num_batches_tracked", FSDP_I64, 0, NULL, zero, 1, &S->nbt);
    fsdp_module_add_buffer(c, m, "scratch", FSDP_F32, 1, s, zero, 0, NULL); /* not persistent: never saved */
    fsdp_module_add_child(c, parent, m);
    return m;
}

/* embed (V -> C) -> norm -> head (C -> V): tokens in, logits out */
enum { V = 16, C = 8, B = 12, T = 4 };

static struct fsdp_module *build(struct fsdp_ctx *c) {
    struct fsdp_module *root = toy_seq(c, NULL, "root");
    toy_embed(c, root, "embed", V, C);
    syncnorm(c, root, "norm", C);
    toy_linear(c, root, "head", C, V, 0.2f);
    fsdp_module_finalize(c, root);
    return root;
}

static enum fsdp_wrap wrap_children(struct fsdp_module *m, void *ud, struct fsdp_unit_overrides *ovr) {
    (void)ud, (void)ovr;
    return m->parent ? FSDP_WRAP_UNIT : FSDP_WRAP_SKIP;
}

#endif
