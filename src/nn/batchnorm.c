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
    int cumulative;                                  /* fsdp_batchnorm_set_cumulative on (momentum None) */
    int relu;                                        /* a ReLU fused on the output (fsdp__batchnorm_fuse_relu) */
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

#define BN_CHUNK 1024 /* floats at a time in the stack buffers below (masked gradient, 16-bit output) */

/* g where the fused ReLU's output v was positive, else 0 (g loaded either way: the loops vectorise) */
static inline float relu_grad(float g, float v) { return v > 0.0f ? g : 0.0f; }

/* a += g[i], b += g[i] (p[i] - mu) r over i in [0, n) (xhat in float, as the input gradient uses it);
 * with relu, g[i] counts only where the output p[i] sc + sh was positive (the fused ReLU's mask) */
static void sum8_add_dy(struct sum8 *a, struct sum8 *b, const float *g, const float *p, int64_t n, float mu, float r,
                        int relu, float sc, float sh) {
    if (relu) { /* the masked gradient a chunk at a time (a float loop that vectorises), then the sums */
        float t[BN_CHUNK];
        for (int64_t i0 = 0; i0 < n; i0 += BN_CHUNK) {
            int64_t m = n - i0 < BN_CHUNK ? n - i0 : BN_CHUNK;
#pragma omp simd
            for (int64_t i = 0; i < m; i++) t[i] = relu_grad(g[i0 + i], p[i0 + i] * sc + sh);
            sum8_add_dy(a, b, t, p + i0, m, mu, r, 0, 0.0f, 0.0f);
        }
        return;
    }
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

/* a += g, b += g (p - mu[l]) r[l], lane by lane, as sum8_add_dy (and its relu mask) */
static void sum8x16_add_dy(struct sum8x16 *a, struct sum8x16 *b, const float *g, const float *p, int64_t n,
                           const float *mu, const float *r, int relu, const float *sc, const float *sh) {
    if (relu) { /* as sum8_add_dy */
        float t[BN_CHUNK];
        for (int64_t i0 = 0; i0 < n; i0 += BN_CHUNK / 16) {
            int64_t m = n - i0 < BN_CHUNK / 16 ? n - i0 : BN_CHUNK / 16;
            for (int64_t i = 0; i < m; i++)
#pragma omp simd
                for (int l = 0; l < 16; l++)
                    t[i * 16 + l] = relu_grad(g[(i0 + i) * 16 + l], p[(i0 + i) * 16 + l] * sc[l] + sh[l]);
            sum8x16_add_dy(a, b, t, p + i0 * 16, m, mu, r, 0, NULL, NULL);
        }
        return;
    }
#define TERM(i, l) (double)g[(i) * 16 + (l)]
    SUM8X16_LOOP(a, n, TERM);
#undef TERM
#define TERM(i, l) ((double)g[(i) * 16 + (l)] * (double)((p[(i) * 16 + (l)] - mu[l]) * r[l]))
    SUM8X16_LOOP(b, n, TERM);
#undef TERM
}

/* [Note: fused ReLU and 16-bit hand-off] A BatchNorm2d that a residual block
 * follows by a ReLU and a convolution (fsdp__batchnorm_fuse_relu) writes
 * max(y, 0) itself, in the dtype the caller asks (fsdp__wanted_dtype: the
 * convolution's 16-bit compute dtype, [Note: 16-bit hand-off] in
 * precision.c): one pass writing 2 bytes a value where BN's fp32 output, the
 * ReLU in place and the convolution's cast read and wrote 18. Backward
 * recomputes the ReLU's mask from x (the same float expression as forward:
 * the same mask), and writes the input gradient in the 16-bit dtype the
 * caller asks (the convolution before it rounds dy anyway). The values are
 * the bits the separate passes gave. Each helper below does one (n, block)
 * plane: len positions of L lanes (L = 1 plain, 16 BLOCKED16). */

static inline float relu_if(int relu, float v) { return relu && !(v > 0.0f) ? 0.0f : v; }

/* y = relu?(x sc + sh), stored in dt */
static void bn_apply(void *y, enum fsdp_dtype dt, const float *x, const float *sc, const float *sh, int64_t len,
                     int L, int relu) {
    float tmp[BN_CHUNK];
    int64_t step = BN_CHUNK / L;
    for (int64_t i0 = 0; i0 < len; i0 += step) {
        int64_t m = len - i0 < step ? len - i0 : step;
        const float *p = x + i0 * L;
        float *q = dt == FSDP_F32 ? (float *)y + i0 * L : tmp;
        if (L == 16) {
            for (int64_t i = 0; i < m; i++)
#pragma omp simd
                for (int l = 0; l < 16; l++) q[i * 16 + l] = relu_if(relu, p[i * 16 + l] * sc[l] + sh[l]);
        } else {
#pragma omp simd
            for (int64_t i = 0; i < m; i++) q[i] = relu_if(relu, p[i] * sc[0] + sh[0]);
        }
        if (dt != FSDP_F32) fsdp__cvt_from_f32(dt, tmp, (char *)y + i0 * L * (int64_t)fsdp_dtype_size(dt), (size_t)(m * L));
    }
}

/* dx = k (gm - a - (p - mu) r s), gm the gradient under relu's mask (p sc + sh > 0), stored in dt */
static void bn_dx(void *dx, enum fsdp_dtype dt, const float *g, const float *x, const float *k, const float *a,
                  const float *mu, const float *r, const float *s, const float *sc, const float *sh, int64_t len,
                  int L, int relu) {
    float tmp[BN_CHUNK];
    int64_t step = BN_CHUNK / L;
    for (int64_t i0 = 0; i0 < len; i0 += step) {
        int64_t m = len - i0 < step ? len - i0 : step;
        const float *p = x + i0 * L, *gg = g + i0 * L;
        float *q = dt == FSDP_F32 ? (float *)dx + i0 * L : tmp;
        if (L == 16) {
            for (int64_t i = 0; i < m; i++)
#pragma omp simd
                for (int l = 0; l < 16; l++) {
                    float pv = p[i * 16 + l], gv = gg[i * 16 + l], gm = relu ? relu_grad(gv, pv * sc[l] + sh[l]) : gv;
                    q[i * 16 + l] = k[l] * (gm - a[l] - (pv - mu[l]) * r[l] * s[l]);
                }
        } else {
#pragma omp simd
            for (int64_t i = 0; i < m; i++) {
                float gv = gg[i], gm = relu ? relu_grad(gv, p[i] * sc[0] + sh[0]) : gv;
                q[i] = k[0] * (gm - a[0] - (p[i] - mu[0]) * r[0] * s[0]);
            }
        }
        if (dt != FSDP_F32) fsdp__cvt_from_f32(dt, tmp, (char *)dx + i0 * L * (int64_t)fsdp_dtype_size(dt), (size_t)(m * L));
    }
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
        char cause[sizeof ctx->errmsg]; /* the cause is ctx's message: formatting it into itself overlaps */
        snprintf(cause, sizeof cause, "%s", fsdp_errmsg(ctx));
        return fsdp__err(ctx, st, "SyncBatchNorm '%s': all-gather of statistics failed: %s", fsdp__mname(m), cause);
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
    enum fsdp_dtype ydt = fsdp__wanted_dtype(out); /* [Note: fused ReLU and 16-bit hand-off] */
    FSDP_TRY(fsdp__tensor_prepare(ctx, out, ydt, in->ndim, in->shape, "BatchNorm2d output"));
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
        int update = !B->frozen_stats && !ctx->recompute;
        /* cumulative (PyTorch's momentum None): the running statistics are the mean over the batches since
         * the last reset, the factor 1 / num_batches_tracked after its increment */
        float mom = B->cumulative ? 1.0f / (float)(((int64_t *)B->nbt->data)[0] + 1) : B->o.momentum;
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
    {
        int64_t L = blocked ? 16 : 1, G = C / L, ysz = (int64_t)fsdp_dtype_size(ydt);
        char *y = out->data;
        int relu = B->relu;
#pragma omp parallel for collapse(2) schedule(static)
        for (int64_t n = 0; n < N; n++)
            for (int64_t g = 0; g < G; g++) { /* channels g L .. g L + L - 1 of image n */
                float sc[16], sh[16];
                for (int64_t l = 0; l < L; l++) {
                    int64_t c = g * L + l;
                    sc[l] = rstd[c] * w[c], sh[l] = b[c] - mean[c] * sc[l];
                }
                int64_t o = (n * G + g) * HW * L;
                bn_apply(y + o * ysz, ydt, x + o, sc, sh, HW, (int)L, relu);
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
    FSDP_TRY(fsdp__check_grad_layout(ctx, m, dout, B->layout));
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
    enum fsdp_dtype ddt = din ? fsdp__wanted_dtype(din) : FSDP_F32; /* [Note: fused ReLU and 16-bit hand-off] */
    if (din) {
        FSDP_TRY(fsdp__tensor_prepare(ctx, din, ddt, dout->ndim, dout->shape, "BatchNorm2d input gradient"));
        din->layout = B->layout;
    }
    size_t mark = fsdp_arena_mark(ctx);
    double *sums = (double *)fsdp__scratch(ctx, 2 * 2 * C * (world + 1), "BatchNorm2d gradient sums");
    if (!sums) return FSDP_ERR_NOMEM;
    double *sdy = sums, *sdyx = sums + C;
    const float *x = B->x, *dy = dout->data, *mean = B->mean, *rstd = B->rstd, *w = fsdp__pdata(B->weight);
    const float *bb = fsdp__pdata(B->bias);
    int relu = B->relu;
    float *scsh = relu ? fsdp__scratch(ctx, 2 * C, "BatchNorm2d scale and shift") : NULL; /* the forward's */
    if (relu && !scsh) {
        fsdp_arena_release(ctx, mark);
        return FSDP_ERR_NOMEM;
    }
    for (int64_t c = 0; c < C && relu; c++) {
        scsh[c] = rstd[c] * w[c];
        scsh[C + c] = bb[c] - mean[c] * scsh[c];
    }
    if (blocked) {
        int64_t G = C / 16;
#pragma omp parallel for schedule(static)
        for (int64_t g = 0; g < G; g++) {
            struct sum8x16 a = {{{0}}, 0}, s = {{{0}}, 0};
            for (int64_t n = 0; n < N; n++) {
                int64_t o = (n * G + g) * HW * 16;
                sum8x16_add_dy(&a, &s, dy + o, x + o, HW, mean + g * 16, rstd + g * 16, relu,
                               relu ? scsh + g * 16 : NULL, relu ? scsh + C + g * 16 : NULL);
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
                sum8_add_dy(&a, &s, dy + (n * C + c) * HW, x + (n * C + c) * HW, HW, mean[c], rstd[c], relu,
                            relu ? scsh[c] : 0.0f, relu ? scsh[C + c] : 0.0f);
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
    char *dx = din->data; /* may equal dy (fp32): each element reads only its own dy */
    double M = B->count;
    int train = B->train;
    int64_t L = blocked ? 16 : 1, G = C / L, dsz = (int64_t)fsdp_dtype_size(ddt);
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t gb = 0; gb < G; gb++) { /* channels gb L .. gb L + L - 1 of image n */
            float mu[16], r[16], k[16], a[16], s[16], sc[16] = {0}, sh[16] = {0};
            for (int64_t l = 0; l < L; l++) {
                int64_t c = gb * L + l;
                mu[l] = mean[c], r[l] = rstd[c], k[l] = w[c] * r[l];
                a[l] = train ? (float)(sdy[c] / M) : 0.0f, s[l] = train ? (float)(sdyx[c] / M) : 0.0f;
                if (relu) sc[l] = scsh[c], sh[l] = scsh[C + c];
            }
            int64_t o = (n * G + gb) * HW * L;
            bn_dx(dx + o * dsz, ddt, dy + o, x + o, k, a, mu, r, s, sc, sh, HW, (int)L, relu);
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
    if (opts->num_features <= 0 || !(opts->eps > 0.0f) || !isfinite(opts->eps) ||
        !(opts->momentum >= 0.0f && opts->momentum <= 1.0f))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "BatchNorm2d '%s': num_features %lld must be positive, eps %g "
                         "positive and finite, momentum %g in [0, 1]", name, (long long)opts->num_features,
                         (double)opts->eps, (double)opts->momentum);
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

void fsdp__batchnorm_fuse_relu(struct fsdp_module *m) {
    if (m && m->ops == &bn_ops) ((struct bn *)m->impl)->relu = 1;
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

/* Calls fn(B, on) for every batch norm below m; *n counts them. */
static void bn_visit(struct fsdp_module *m, void (*fn)(struct bn *B, int on), int on, int *n) {
    if (m->ops == &bn_ops) {
        fn(m->impl, on);
        (*n)++;
    }
    for (int i = 0; i < m->n_children; i++) bn_visit(m->children[i], fn, on, n);
}

static int bn_visit_root(struct fsdp_module *root, void (*fn)(struct bn *B, int on), int on) {
    int n = 0;
    if (root) bn_visit(root, fn, on, &n);
    return n;
}

static void set_update(struct bn *B, int on) { B->frozen_stats = !on; }
static void set_cumulative(struct bn *B, int on) { B->cumulative = on; }
static void reset_stats(struct bn *B, int on) {
    (void)on;
    float *rm = B->rmean->data, *rv = B->rvar->data;
    for (int64_t c = 0; c < B->o.num_features; c++) rm[c] = 0.0f, rv[c] = 1.0f;
    ((int64_t *)B->nbt->data)[0] = 0;
}

void fsdp_batchnorm_set_update_stats(struct fsdp_module *root, int on, int *n_out) {
    int n = bn_visit_root(root, set_update, on);
    if (n_out) *n_out = n;
}

void fsdp_batchnorm_set_cumulative(struct fsdp_module *root, int on, int *n_out) {
    int n = bn_visit_root(root, set_cumulative, on);
    if (n_out) *n_out = n;
}

void fsdp_batchnorm_reset_stats(struct fsdp_module *root, int *n_out) {
    int n = bn_visit_root(root, reset_stats, 0);
    if (n_out) *n_out = n;
}
