/*
 * batchnorm.c - BatchNorm2d and SyncBatchNorm over NCHW fp32, per channel,
 * as PyTorch (eps 1e-5, momentum 0.1 by default); an (N, C) input is
 * BatchNorm1d's case (H = W = 1, as a projection head's):
 *   train: y = (x - mean_B) / sqrt(var_B + eps) * weight + bias, with the
 *          batch's mean and biased variance over (N, H, W); then
 *          running_mean = (1 - mom) running_mean + mom mean_B,
 *          running_var  = (1 - mom) running_var + mom var_B * M / (M - 1),
 *          num_batches_tracked += 1   (M: the values per channel)
 *   eval:  the same with running_mean and running_var, nothing updated.
 * The running statistics are updated once per step: not by the forward that
 * activation checkpointing runs again inside backward (ctx->recompute, see
 * [Note: activation checkpointing] in module.c), nor while
 * fsdp_batchnorm_set_update_stats has them off.
 * Plain loops (the layer is memory-bound), a thread per channel range;
 * statistics in double, each sum over 8 interleaved partial sums
 * ([Note: eight partial sums]). Saves x, the per-channel mean and 1/std (arena).
 * A BLOCKED16 input ([Note: blocked activations] in conv.c) gives a BLOCKED16
 * output and input gradient (the output gradient must be BLOCKED16 too); the
 * loops then run over 16 channels at once, each channel's values in the
 * same order as in NCHW: the same bits.
 * Weight, bias and the buffers are fp32 whatever the compute dtype.
 * [Note: synchronised statistics] A sync module's ranks all-gather, per
 * channel, their count, mean and M2 = sum (x - mean)^2 as double-float
 * pairs (hi + lo holds a double to about 48 bits), and every rank combines
 * them in rank order with Chan's formula: the global statistics, the same
 * bits on every rank, with no sum-of-squares cancellation. Backward
 * all-gathers the sums of dy and dy xhat the same way. One all-gather per
 * forward and one per backward, in train mode only.
 */
#include "nn/nn-impl.h"

#include <math.h>

struct bn {
    struct fsdp_batchnorm_opts o;
    struct fsdp_param *weight, *bias;                /* (C) each */
    struct fsdp_buffer *rmean, *rvar, *nbt;          /* (C), (C) F32; () I64 */
    const float *x;                                  /* (N, C, H, W) or (N, C) saved input (arena or the caller's) */
    enum fsdp_layout layout;                         /* of x (and the output) */
    float *mean, *rstd;                              /* (C) each, in the arena */
    int64_t n, hw;                                   /* of the saved input */
    double count;                                    /* values per channel over the (global) batch */
    int train;                                       /* the saved forward ran in train mode */
    int frozen_stats;                                /* fsdp_batchnorm_set_update_stats off */
};

static const struct fsdp_module_ops bn_ops;

/* [Note: eight partial sums] A sum in double over one channel's values, one
 * add after another, waits out the add's latency at every element (about 4
 * cycles): 13% of a ResNet-18 training step went to these sums. Element e
 * of a channel (counted over the whole batch, plane after plane) goes to
 * partial sum e mod 8 instead, and the eight are added pairwise at the end:
 * eight independent chains, and an order fixed by the data's shape alone,
 * so the result does not depend on the thread count or the machine. */
#define NSUM 8
struct sum8 {
    double s[NSUM];
    unsigned k; /* the partial sum the next element goes to */
};

static double sum8_total(const struct sum8 *a) {
    return ((a->s[0] + a->s[1]) + (a->s[2] + a->s[3])) + ((a->s[4] + a->s[5]) + (a->s[6] + a->s[7]));
}

/* The partial sums' loop over p[0..n) (and q[0..n)): the elements up to the
 * next multiple of 8 one by one, then blocks of 8 in registers, then the
 * rest one by one. TERM(i) is element i's term. */
#define SUM8_LOOP(a, n, TERM)                                                    \
    do {                                                                        \
        int64_t i_ = 0;                                                         \
        unsigned k_ = (a)->k;                                                   \
        for (; i_ < (n) && k_; i_++, k_ = (k_ + 1) & (NSUM - 1)) (a)->s[k_] += TERM(i_); \
        double r_[NSUM];                                                        \
        memcpy(r_, (a)->s, sizeof r_);                                          \
        for (; i_ + NSUM <= (n); i_ += NSUM)                                    \
            for (int j_ = 0; j_ < NSUM; j_++) r_[j_] += TERM(i_ + j_);          \
        memcpy((a)->s, r_, sizeof r_);                                          \
        for (; i_ < (n); i_++, k_ = (k_ + 1) & (NSUM - 1)) (a)->s[k_] += TERM(i_); \
        (a)->k = k_;                                                            \
    } while (0)

/* a += p[0..n) */
static void sum8_add(struct sum8 *a, const float *p, int64_t n) {
#define TERM(i) (double)p[i]
    SUM8_LOOP(a, n, TERM);
#undef TERM
}

/* a += (p[i] - mu)^2 over i in [0, n) */
static void sum8_add_sq(struct sum8 *a, const float *p, int64_t n, double mu) {
#define TERM(i) (((double)p[i] - mu) * ((double)p[i] - mu))
    SUM8_LOOP(a, n, TERM);
#undef TERM
}

/* a += g[i], b += g[i] (p[i] - mu) r over i in [0, n) (xhat in float, as the input gradient uses it) */
static void sum8_add_dy(struct sum8 *a, struct sum8 *b, const float *g, const float *p, int64_t n, float mu, float r) {
#define TERM(i) (double)g[i]
    SUM8_LOOP(a, n, TERM);
#undef TERM
#define TERM(i) ((double)g[i] * (double)((p[i] - mu) * r))
    SUM8_LOOP(b, n, TERM);
#undef TERM
}

/* The same for 16 channels at once, stored interleaved (BLOCKED16): lane l
 * of every element is channel l's value, and each lane's partial sums see
 * that channel's values in the order sum8 would. */
struct sum8x16 {
    double s[NSUM][16];
    unsigned k;
};

/* TERM(i, l): element i's term for lane l */
#define SUM8X16_LOOP(a, n, TERM)                                                 \
    do {                                                                        \
        int64_t i_ = 0;                                                         \
        unsigned k_ = (a)->k;                                                   \
        for (; i_ < (n) && k_; i_++, k_ = (k_ + 1) & (NSUM - 1))                \
            for (int l_ = 0; l_ < 16; l_++) (a)->s[k_][l_] += TERM(i_, l_);     \
        for (; i_ + NSUM <= (n); i_ += NSUM)                                    \
            for (int j_ = 0; j_ < NSUM; j_++)                                   \
                _Pragma("omp simd") for (int l_ = 0; l_ < 16; l_++) (a)->s[j_][l_] += TERM(i_ + j_, l_); \
        for (; i_ < (n); i_++, k_ = (k_ + 1) & (NSUM - 1))                      \
            for (int l_ = 0; l_ < 16; l_++) (a)->s[k_][l_] += TERM(i_, l_);     \
        (a)->k = k_;                                                            \
    } while (0)

static double sum8x16_total(const struct sum8x16 *a, int l) {
    return ((a->s[0][l] + a->s[1][l]) + (a->s[2][l] + a->s[3][l])) +
           ((a->s[4][l] + a->s[5][l]) + (a->s[6][l] + a->s[7][l]));
}

/* a += p[i * 16 + l] over i in [0, n) */
static void sum8x16_add(struct sum8x16 *a, const float *p, int64_t n) {
#define TERM(i, l) (double)p[(i) * 16 + (l)]
    SUM8X16_LOOP(a, n, TERM);
#undef TERM
}

/* a += (p[i * 16 + l] - mu[l])^2 */
static void sum8x16_add_sq(struct sum8x16 *a, const float *p, int64_t n, const double *mu) {
#define TERM(i, l) (((double)p[(i) * 16 + (l)] - mu[l]) * ((double)p[(i) * 16 + (l)] - mu[l]))
    SUM8X16_LOOP(a, n, TERM);
#undef TERM
}

/* a += g, b += g (p - mu[l]) r[l], lane by lane, as sum8_add_dy */
static void sum8x16_add_dy(struct sum8x16 *a, struct sum8x16 *b, const float *g, const float *p, int64_t n,
                           const float *mu, const float *r) {
#define TERM(i, l) (double)g[(i) * 16 + (l)]
    SUM8X16_LOOP(a, n, TERM);
#undef TERM
#define TERM(i, l) ((double)g[(i) * 16 + (l)] * (double)((p[(i) * 16 + (l)] - mu[l]) * r[l]))
    SUM8X16_LOOP(b, n, TERM);
#undef TERM
}

/* double -> (hi, lo) floats with hi + lo == d to about 48 bits */
static void split2(double d, float *hi, float *lo) {
    *hi = (float)d;
    *lo = (float)(d - (double)*hi);
}

/* Gathers n doubles per rank (as double-float pairs) over c: out[r * n + i]
 * is rank r's v[i]. out: world * n doubles (caller's). */
static enum fsdp_status gather_doubles(struct fsdp_ctx *ctx, struct fsdp_module *m, struct fsdp_comm *c,
                                       const double *v, int64_t n, double *out) {
    int world = fsdp_comm_size(c);
    size_t mark = fsdp_arena_mark(ctx);
    float *send = fsdp__scratch(ctx, 2 * n * (world + 1), "SyncBatchNorm statistics");
    if (!send) return FSDP_ERR_NOMEM;
    float *recv = send + 2 * n;
    for (int64_t i = 0; i < n; i++) split2(v[i], &send[2 * i], &send[2 * i + 1]);
    enum fsdp_status st = fsdp_comm_allgather(c, send, recv, (size_t)(2 * n), FSDP_F32);
    if (st != FSDP_OK) {
        fsdp_arena_release(ctx, mark);
        return fsdp__err(ctx, st, "SyncBatchNorm '%s': all-gather of statistics failed: %s", fsdp__mname(m),
                         fsdp_errmsg(ctx));
    }
    for (int64_t i = 0; i < world * n; i++) out[i] = (double)recv[2 * i] + (double)recv[2 * i + 1];
    fsdp_arena_release(ctx, mark);
    return FSDP_OK;
}

static struct fsdp_comm *bn_comm(struct fsdp_ctx *ctx, const struct bn *B) {
    return B->o.comm ? B->o.comm : fsdp_ctx_comm(ctx);
}

static enum fsdp_status bn_forward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *in,
                                   struct fsdp_tensor *out) {
    struct bn *B = m->impl;
    FSDP_TRY(fsdp__check_input_any(ctx, m, in, FSDP_F32, 0, 0));
    if (in->ndim != 2 && in->ndim != 4) /* (N, C): BatchNorm1d's case, H = W = 1 */
        return fsdp__err(ctx, FSDP_ERR_INVALID, "BatchNorm2d '%s': input has %d dimensions, expected 4 (N, C, H, W) "
                         "or 2 (N, C)", fsdp__mname(m), in->ndim);
    int64_t N = in->shape[0], C = B->o.num_features, HW = in->ndim == 4 ? in->shape[2] * in->shape[3] : 1;
    if (in->shape[1] != C)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "BatchNorm2d '%s': input has %lld channels, expected %lld",
                         fsdp__mname(m), (long long)in->shape[1], (long long)C);
    FSDP_TRY(fsdp__param_ready(ctx, B->weight, 0));
    FSDP_TRY(fsdp__param_ready(ctx, B->bias, 0));
    if (out->data && out->data == in->data)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "BatchNorm2d '%s': cannot run in place (backward needs the input)",
                         fsdp__mname(m));
    int train = m->training, sync = train && B->o.sync;
    float *mean = fsdp__scratch(ctx, 2 * C, "BatchNorm2d statistics");
    if (!mean) return FSDP_ERR_NOMEM;
    float *rstd = mean + C;
    FSDP_TRY(fsdp__tensor_prepare(ctx, out, FSDP_F32, in->ndim, in->shape, "BatchNorm2d output"));
    out->layout = in->layout;
    int blocked = in->layout == FSDP_LAYOUT_BLOCKED16;
    const float *x = in->data, *w = fsdp__pdata(B->weight), *b = fsdp__pdata(B->bias);
    float *rm = B->rmean->data, *rv = B->rvar->data;
    double count = (double)N * (double)HW;
    if (train) {
        size_t mark = fsdp_arena_mark(ctx);
        int world = sync ? fsdp_comm_size(bn_comm(ctx, B)) : 1;
        double *loc = (double *)fsdp__scratch(ctx, 2 * (2 * C + 1) * (world + 1), "BatchNorm2d sums");
        if (!loc) return FSDP_ERR_NOMEM;
        double *lmean = loc + 1, *lm2 = loc + 1 + C; /* loc[0]: count */
        loc[0] = count;
        if (blocked) {
            int64_t G = C / 16;
#pragma omp parallel for schedule(static)
            for (int64_t g = 0; g < G; g++) { /* channels 16 g .. 16 g + 15, as below */
                struct sum8x16 s = {{{0}}, 0}, s2 = {{{0}}, 0};
                double mu[16];
                for (int64_t n = 0; n < N; n++) sum8x16_add(&s, x + (n * G + g) * HW * 16, HW);
                for (int l = 0; l < 16; l++) mu[l] = count > 0 ? sum8x16_total(&s, l) / count : 0.0;
                for (int64_t n = 0; n < N; n++) sum8x16_add_sq(&s2, x + (n * G + g) * HW * 16, HW, mu);
                for (int l = 0; l < 16; l++) {
                    lmean[g * 16 + l] = mu[l];
                    lm2[g * 16 + l] = sum8x16_total(&s2, l);
                }
            }
        } else {
#pragma omp parallel for schedule(static)
            for (int64_t c = 0; c < C; c++) { /* two passes in double: mean, then M2 */
                struct sum8 s = {{0}, 0}, s2 = {{0}, 0}; /* [Note: eight partial sums] */
                for (int64_t n = 0; n < N; n++) sum8_add(&s, x + (n * C + c) * HW, HW);
                double mu = count > 0 ? sum8_total(&s) / count : 0.0;
                for (int64_t n = 0; n < N; n++) sum8_add_sq(&s2, x + (n * C + c) * HW, HW, mu);
                lmean[c] = mu;
                lm2[c] = sum8_total(&s2);
            }
        }
        if (sync) { /* [Note: synchronised statistics] */
            double *all = loc + 2 * C + 1;
            enum fsdp_status st = gather_doubles(ctx, m, bn_comm(ctx, B), loc, 2 * C + 1, all);
            if (st != FSDP_OK) {
                fsdp_arena_release(ctx, mark);
                return st;
            }
            double tot = 0.0;
            for (int r = 0; r < world; r++) tot += all[r * (2 * C + 1)];
            for (int64_t c = 0; c < C; c++) { /* Chan et al.: combine (n, mean, M2) in rank order */
                double n_a = 0.0, mu = 0.0, m2 = 0.0;
                for (int r = 0; r < world; r++) {
                    const double *e = all + r * (2 * C + 1);
                    double n_b = e[0];
                    if (n_b <= 0) continue;
                    double d = e[1 + c] - mu, n_ab = n_a + n_b;
                    mu += d * n_b / n_ab;
                    m2 += e[1 + C + c] + d * d * n_a * n_b / n_ab;
                    n_a = n_ab;
                }
                lmean[c] = mu;
                lm2[c] = m2;
            }
            count = tot;
        }
        if (count < 2 && !fsdp__measuring) { /* measuring: the no-op gather left no counts */
            fsdp_arena_release(ctx, mark);
            return fsdp__err(ctx, FSDP_ERR_INVALID, "BatchNorm2d '%s': training needs more than 1 value per channel "
                             "(input (%lld, %lld) x %lld values per plane)", fsdp__mname(m), (long long)N,
                             (long long)C, (long long)HW);
        }
        float mom = B->o.momentum;
        int update = !B->frozen_stats && !ctx->recompute;
        for (int64_t c = 0; c < C; c++) {
            double var = lm2[c] / count;
            mean[c] = (float)lmean[c];
            rstd[c] = (float)(1.0 / sqrt(var + (double)B->o.eps));
            if (!update) continue;
            rm[c] = (1.0f - mom) * rm[c] + mom * (float)lmean[c];
            rv[c] = (1.0f - mom) * rv[c] + mom * (float)(lm2[c] / (count - 1.0));
        }
        if (update) ((int64_t *)B->nbt->data)[0] += 1;
        fsdp_arena_release(ctx, mark);
    } else {
        for (int64_t c = 0; c < C; c++) {
            mean[c] = rm[c];
            rstd[c] = (float)(1.0 / sqrt((double)rv[c] + (double)B->o.eps));
        }
    }
    float *y = out->data; /* may equal x */
    if (blocked) {
        int64_t G = C / 16;
#pragma omp parallel for collapse(2) schedule(static)
        for (int64_t n = 0; n < N; n++)
            for (int64_t g = 0; g < G; g++) {
                float sc[16], sh[16];
                for (int l = 0; l < 16; l++) {
                    int64_t c = g * 16 + l;
                    sc[l] = rstd[c] * w[c], sh[l] = b[c] - mean[c] * sc[l];
                }
                const float *p = x + (n * G + g) * HW * 16;
                float *q = y + (n * G + g) * HW * 16;
                for (int64_t i = 0; i < HW; i++)
#pragma omp simd
                    for (int l = 0; l < 16; l++) q[i * 16 + l] = p[i * 16 + l] * sc[l] + sh[l];
            }
    } else {
#pragma omp parallel for collapse(2) schedule(static)
        for (int64_t n = 0; n < N; n++)
            for (int64_t c = 0; c < C; c++) {
                float sc = rstd[c] * w[c], sh = b[c] - mean[c] * sc;
                const float *p = x + (n * C + c) * HW;
                float *q = y + (n * C + c) * HW;
#pragma omp simd
                for (int64_t i = 0; i < HW; i++) q[i] = p[i] * sc + sh;
            }
    }
    B->x = x;
    B->layout = in->layout;
    B->mean = mean;
    B->rstd = rstd;
    B->n = N;
    B->hw = HW;
    B->count = count;
    B->train = train;
    return FSDP_OK;
}

/* train: dx = w rstd (dy - sum(dy) / M - xhat sum(dy xhat) / M), the sums
 * over the (global) batch; eval: dx = w rstd dy. dweight += sum(dy xhat),
 * dbias += sum(dy), over this rank's batch. */
static enum fsdp_status bn_backward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *dout,
                                    struct fsdp_tensor *din) {
    struct bn *B = m->impl;
    if (!B->mean) return fsdp__err(ctx, FSDP_ERR_STATE, "BatchNorm2d '%s': backward without forward", fsdp__mname(m));
    FSDP_TRY(fsdp__check_input_any(ctx, m, dout, FSDP_F32, 0, 0));
    if (dout->layout != B->layout)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "BatchNorm2d '%s': gradient in the %s layout, the output was %s",
                         fsdp__mname(m), dout->layout == FSDP_LAYOUT_PLAIN ? "PLAIN" : "BLOCKED16",
                         B->layout == FSDP_LAYOUT_PLAIN ? "PLAIN" : "BLOCKED16");
    int blocked = B->layout == FSDP_LAYOUT_BLOCKED16;
    int64_t N = B->n, C = B->o.num_features, HW = B->hw;
    if ((dout->ndim != 2 && dout->ndim != 4) || dout->shape[0] != N || dout->shape[1] != C ||
        (dout->ndim == 4 ? dout->shape[2] * dout->shape[3] : 1) != HW)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "BatchNorm2d '%s': gradient shape differs from the forward's",
                         fsdp__mname(m));
    FSDP_TRY(fsdp__param_ready(ctx, B->weight, 1));
    FSDP_TRY(fsdp__param_ready(ctx, B->bias, 1));
    int sync = B->train && B->o.sync;
    int world = sync ? fsdp_comm_size(bn_comm(ctx, B)) : 1;
    /* before the scratch, which is released below; din may alias dout */
    if (din) {
        FSDP_TRY(fsdp__tensor_prepare(ctx, din, FSDP_F32, dout->ndim, dout->shape, "BatchNorm2d input gradient"));
        din->layout = B->layout;
    }
    size_t mark = fsdp_arena_mark(ctx);
    double *sums = (double *)fsdp__scratch(ctx, 2 * 2 * C * (world + 1), "BatchNorm2d gradient sums");
    if (!sums) return FSDP_ERR_NOMEM;
    double *sdy = sums, *sdyx = sums + C;
    const float *x = B->x, *dy = dout->data, *mean = B->mean, *rstd = B->rstd, *w = fsdp__pdata(B->weight);
    if (blocked) {
        int64_t G = C / 16;
#pragma omp parallel for schedule(static)
        for (int64_t g = 0; g < G; g++) {
            struct sum8x16 a = {{{0}}, 0}, s = {{{0}}, 0};
            for (int64_t n = 0; n < N; n++) {
                int64_t o = (n * G + g) * HW * 16;
                sum8x16_add_dy(&a, &s, dy + o, x + o, HW, mean + g * 16, rstd + g * 16);
            }
            for (int l = 0; l < 16; l++) {
                sdy[g * 16 + l] = sum8x16_total(&a, l);
                sdyx[g * 16 + l] = sum8x16_total(&s, l);
            }
        }
    } else {
#pragma omp parallel for schedule(static)
        for (int64_t c = 0; c < C; c++) {
            struct sum8 a = {{0}, 0}, s = {{0}, 0}; /* [Note: eight partial sums] */
            for (int64_t n = 0; n < N; n++)
                sum8_add_dy(&a, &s, dy + (n * C + c) * HW, x + (n * C + c) * HW, HW, mean[c], rstd[c]);
            sdy[c] = sum8_total(&a);
            sdyx[c] = sum8_total(&s);
        }
    }
    float *dw = fsdp__pgrad(B->weight), *db = fsdp__pgrad(B->bias);
    for (int64_t c = 0; c < C; c++) {
        dw[c] += (float)sdyx[c];
        db[c] += (float)sdy[c];
    }
    if (!din && !sync) {
        fsdp_arena_release(ctx, mark);
        return FSDP_OK;
    }
    if (sync) { /* even without din: every rank of comm joins, whatever it asked for */
        double *all = sums + 2 * C;
        enum fsdp_status st = gather_doubles(ctx, m, bn_comm(ctx, B), sums, 2 * C, all);
        if (st != FSDP_OK) {
            fsdp_arena_release(ctx, mark);
            return st;
        }
        for (int64_t k = 0; k < 2 * C; k++) {
            double t = 0.0;
            for (int r = 0; r < world; r++) t += all[r * 2 * C + k];
            sums[k] = t;
        }
    }
    if (!din) {
        fsdp_arena_release(ctx, mark);
        return FSDP_OK;
    }
    float *dx = din->data; /* may equal dy: each element reads only its own dy */
    double M = B->count;
    int train = B->train;
    if (blocked) {
        int64_t G = C / 16;
#pragma omp parallel for collapse(2) schedule(static)
        for (int64_t n = 0; n < N; n++)
            for (int64_t gb = 0; gb < G; gb++) {
                float mu[16], r[16], k[16], a[16], s[16];
                for (int l = 0; l < 16; l++) {
                    int64_t c = gb * 16 + l;
                    mu[l] = mean[c], r[l] = rstd[c], k[l] = w[c] * r[l];
                    a[l] = train ? (float)(sdy[c] / M) : 0.0f, s[l] = train ? (float)(sdyx[c] / M) : 0.0f;
                }
                int64_t o = (n * G + gb) * HW * 16;
                const float *p = x + o, *g = dy + o;
                float *q = dx + o;
                for (int64_t i = 0; i < HW; i++)
#pragma omp simd
                    for (int l = 0; l < 16; l++)
                        q[i * 16 + l] = k[l] * (g[i * 16 + l] - a[l] - (p[i * 16 + l] - mu[l]) * r[l] * s[l]);
            }
    } else {
#pragma omp parallel for collapse(2) schedule(static)
        for (int64_t n = 0; n < N; n++)
            for (int64_t c = 0; c < C; c++) {
                float mu = mean[c], r = rstd[c], k = w[c] * r;
                float a = train ? (float)(sdy[c] / M) : 0.0f, s = train ? (float)(sdyx[c] / M) : 0.0f;
                const float *p = x + (n * C + c) * HW, *g = dy + (n * C + c) * HW;
                float *q = dx + (n * C + c) * HW;
#pragma omp simd
                for (int64_t i = 0; i < HW; i++) q[i] = k * (g[i] - a - (p[i] - mu) * r * s);
            }
    }
    fsdp_arena_release(ctx, mark);
    return FSDP_OK;
}

static void bn_destroy(struct fsdp_module *m) { free(m->impl); }

static const struct fsdp_module_ops bn_ops = {"BatchNorm2d", bn_forward, bn_backward, bn_destroy};

struct fsdp_batchnorm_opts fsdp_batchnorm_opts_default(int64_t num_features) {
    struct fsdp_batchnorm_opts o;
    memset(&o, 0, sizeof o);
    o.num_features = num_features;
    o.eps = 1e-5f;
    o.momentum = 0.1f;
    return o;
}

enum fsdp_status fsdp_batchnorm2d_create(struct fsdp_ctx *ctx, const char *name, const struct fsdp_batchnorm_opts *opts,
                                         struct fsdp_module **out_m) {
    if (opts->num_features <= 0 || !(opts->eps > 0.0f) || !(opts->momentum >= 0.0f && opts->momentum <= 1.0f))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "BatchNorm2d '%s': num_features %lld must be positive, eps %g "
                         "positive, momentum %g in [0, 1]", name, (long long)opts->num_features, (double)opts->eps,
                         (double)opts->momentum);
    struct fsdp_module *m;
    FSDP_TRY(fsdp_module_create(ctx, &bn_ops, name, &m));
    struct bn *B = fsdp__zalloc(1, sizeof *B);
    if (!B) {
        fsdp_module_free(m);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory creating BatchNorm2d '%s'", name);
    }
    m->impl = B;
    m->fp32_params = 1; /* [Note: fp32 modules] in src/fsdp/wrap.c */
    B->o = *opts;
    int64_t shape[1] = {opts->num_features};
    struct fsdp_init ones = {FSDP_INIT_ONES, 0.0f}, zeros = {FSDP_INIT_ZEROS, 0.0f};
    enum fsdp_status st = fsdp_module_add_param(ctx, m, "weight", 1, shape, ones, 1, &B->weight);
    if (st == FSDP_OK) st = fsdp_module_add_param(ctx, m, "bias", 1, shape, zeros, 1, &B->bias);
    if (st == FSDP_OK) st = fsdp_module_add_buffer(ctx, m, "running_mean", FSDP_F32, 1, shape, zeros, 1, &B->rmean);
    if (st == FSDP_OK) st = fsdp_module_add_buffer(ctx, m, "running_var", FSDP_F32, 1, shape, ones, 1, &B->rvar);
    if (st == FSDP_OK)
        st = fsdp_module_add_buffer(ctx, m, "num_batches_tracked", FSDP_I64, 0, NULL, zeros, 1, &B->nbt);
    if (st != FSDP_OK) {
        fsdp_module_free(m);
        return st;
    }
    B->weight->priv->grad_writer = B->bias->priv->grad_writer = 1; /* [Note: unset gradients] */
    *out_m = m;
    return FSDP_OK;
}

static void set_sync_rec(struct fsdp_module *m, int on, struct fsdp_comm *comm, int *n) {
    if (m->ops == &bn_ops) {
        struct bn *B = m->impl;
        B->o.sync = on ? 1 : 0;
        B->o.comm = on ? comm : NULL;
        (*n)++;
    }
    for (int i = 0; i < m->n_children; i++) set_sync_rec(m->children[i], on, comm, n);
}

void fsdp_batchnorm_set_sync(struct fsdp_module *root, int on, struct fsdp_comm *comm, int *n_out) {
    int n = 0;
    set_sync_rec(root, on, comm, &n);
    if (n_out) *n_out = n;
}

static void set_update_rec(struct fsdp_module *m, int on, int *n) {
    if (m->ops == &bn_ops) {
        ((struct bn *)m->impl)->frozen_stats = !on;
        (*n)++;
    }
    for (int i = 0; i < m->n_children; i++) set_update_rec(m->children[i], on, n);
}

void fsdp_batchnorm_set_update_stats(struct fsdp_module *root, int on, int *n_out) {
    int n = 0;
    if (root) set_update_rec(root, on, &n);
    if (n_out) *n_out = n;
}
