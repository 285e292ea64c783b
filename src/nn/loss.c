/*
 * loss.c - softmax cross-entropy over logits (N, V) with integer targets (N):
 * loss = mean_i (logsumexp(logits_i) - logits_i[target_i]), numerically
 * stable (the row max is subtracted first). The gradient
 * d(loss * scale)/dlogits = (softmax - onehot) * scale / N may overwrite the
 * logits (dlogits == logits): each row's max and target logit are read before
 * the row is written. The mean is summed in fixed chunks so the result does
 * not depend on the thread count.
 * Below it, the losses of fsdp_model_loss (src/fsdp/step.c): the checks of a
 * target against the model output, and cross-entropy with label smoothing,
 * soft targets and an ignored class id, and MSE, as sums of item losses with
 * the gradient scaled by the caller's factor (which divides by the count).
 */
#include "nn/nn-impl.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>

#define CE_CHUNKS 256

/* Row i's loss term (max + log sum exp - target logit) from its logits l (V),
 * and, with d non-NULL (may be l), its gradient (softmax - onehot(t)) * g. */
static double ce_row(const float *l, float *d, int64_t V, int64_t t, float g) {
    float mx = l[0];
#pragma omp simd reduction(max : mx)
    for (int64_t j = 1; j < V; j++) mx = l[j] > mx ? l[j] : mx;
    float lt = l[t];
    const struct fsdp__exp_range er = fsdp__exp_range(); /* [Note: exp range] */
    double sum = 0.0; /* float sums over blocks of 1024, in double across them */
    for (int64_t j0 = 0; j0 < V; j0 += 1024) {
        int64_t j1 = j0 + 1024 < V ? j0 + 1024 : V;
        float s = 0.0f;
        if (d) {
#pragma omp simd reduction(+ : s)
            for (int64_t j = j0; j < j1; j++) {
                float e = fsdp__expf(l[j] - mx, er);
                d[j] = e;
                s += e;
            }
        } else {
#pragma omp simd reduction(+ : s)
            for (int64_t j = j0; j < j1; j++) s += fsdp__expf(l[j] - mx, er);
        }
        sum += (double)s;
    }
    if (d) {
        float k = (float)(1.0 / sum) * g;
#pragma omp simd
        for (int64_t j = 0; j < V; j++) d[j] *= k;
        d[t] -= g;
    }
    return (double)mx + log(sum) - (double)lt;
}

/* The rows of fsdp__cross_entropy_rows: logits of dtype
 * dt (F32, or 16-bit widened a row at a time into rows[thread]), row stride
 * ld, gradient rows of the same dtype and stride (rounded from fp32). */
static enum fsdp_status ce_rows(struct fsdp_ctx *ctx, enum fsdp_dtype dt, const void *logits, int64_t ld,
                                const int32_t *targets, int64_t N, int64_t V, float scale, float *loss, void *dlogits,
                                float *rows) {
    if (N <= 0 || V <= 0 || ld < V || !logits || !targets)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "cross_entropy: bad arguments (N %lld, V %lld)", (long long)N,
                         (long long)V);
    for (int64_t i = 0; i < N; i++)
        if (targets[i] < 0 || targets[i] >= V)
            return fsdp__err(ctx, FSDP_ERR_INVALID, "cross_entropy: target %d at row %lld is outside [0, %lld)",
                             (int)targets[i], (long long)i, (long long)V);
    double part[CE_CHUNKS] = {0};
    int64_t per = (N + CE_CHUNKS - 1) / CE_CHUNKS, nch = (N + per - 1) / per;
    float g = scale / (float)N;
    size_t es = fsdp_dtype_size(dt);
#pragma omp parallel for schedule(static)
    for (int64_t ch = 0; ch < (fsdp__measuring ? 0 : nch); ch++) {
        int64_t i1 = (ch + 1) * per < N ? (ch + 1) * per : N;
        float *r = rows ? rows + (int64_t)omp_get_thread_num() * V : NULL;
        double acc = 0.0;
        for (int64_t i = ch * per; i < i1; i++) {
            const void *li = (const char *)logits + (size_t)(i * ld) * es;
            void *di = dlogits ? (char *)dlogits + (size_t)(i * ld) * es : NULL; /* may be li */
            if (dt == FSDP_F32) {
                acc += ce_row(li, di, V, targets[i], g);
                continue;
            }
            fsdp__cvt_to_f32(dt, li, r, (size_t)V);
            acc += ce_row(r, di ? r : NULL, V, targets[i], g);
            if (di) fsdp__cvt_from_f32(dt, r, di, (size_t)V);
        }
        part[ch] = acc;
    }
    double total = 0.0;
    for (int64_t ch = 0; ch < nch; ch++) total += part[ch];
    if (loss) *loss = (float)(total / (double)N);
    return FSDP_OK;
}

enum fsdp_status fsdp__cross_entropy_rows(struct fsdp_ctx *ctx, enum fsdp_dtype dt, const void *logits, int64_t ld,
                                          const int32_t *targets, int64_t N, int64_t V, float scale, float *loss,
                                          void *dlogits) {
    if (dt == FSDP_F32) return ce_rows(ctx, dt, logits, ld, targets, N, V, scale, loss, dlogits, NULL);
    size_t mark = fsdp_arena_mark(ctx);
    float *rows = fsdp__scratch(ctx, (int64_t)omp_get_max_threads() * V, "cross-entropy rows");
    if (!rows) return FSDP_ERR_NOMEM;
    enum fsdp_status st = ce_rows(ctx, dt, logits, ld, targets, N, V, scale, loss, dlogits, rows);
    fsdp_arena_release(ctx, mark);
    return st;
}

enum fsdp_status fsdp_cross_entropy(struct fsdp_ctx *ctx, const float *logits, const int32_t *targets,
                                    int64_t N, int64_t V, float scale, float *loss, float *dlogits) {
    return fsdp__cross_entropy_rows(ctx, FSDP_F32, logits, V, targets, N, V, scale, loss, dlogits);
}

/* ---- The losses of fsdp_model_loss ----
 * Cross-entropy with label smoothing s over C classes, target distribution
 * q (hard: onehot(t); soft: the target row) smoothed to q' = (1 - s) q + s/C:
 *   row loss  = sum_j q'_j (lse - l_j),   lse = logsumexp(l)
 *   gradient  = (sum_j q'_j) softmax(l) - q'      (times g)
 * MSE over E elements: item loss (y - t)^2, gradient 2 (y - t) (times g).
 * Sums run in fixed chunks of rows, so they do not depend on the threads. */

static int64_t rows_of(const struct fsdp_tensor *t) { return fsdp_tensor_numel(t) / t->shape[t->ndim - 1]; }

static const char *kind_name(enum fsdp_loss_kind k) {
    switch (k) {
    case FSDP_LOSS_CROSS_ENTROPY: return "cross-entropy";
    case FSDP_LOSS_SOFT_CROSS_ENTROPY: return "soft cross-entropy";
    case FSDP_LOSS_MSE: return "MSE";
    case FSDP_LOSS_USER: return "user loss";
    }
    return "loss";
}

static void shape_str(const struct fsdp_tensor *t, char *buf, size_t cap) {
    size_t n = (size_t)snprintf(buf, cap, "%s (", fsdp_dtype_name(t->dtype));
    for (int i = 0; i < t->ndim && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
    if (n < cap) snprintf(buf + n, cap - n, ")");
}

enum fsdp_status fsdp__loss_check(struct fsdp_ctx *ctx, const struct fsdp_loss *loss, const struct fsdp_tensor *out,
                                  const struct fsdp_tensor *target, int64_t *count) {
    const char *what = kind_name(loss->kind);
    if ((unsigned)loss->kind > FSDP_LOSS_USER)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "loss: unknown kind %d", (int)loss->kind);
    if (!out || !out->data || out->ndim < 1 || out->ndim > FSDP_MAX_DIMS ||
        !(out->dtype == FSDP_F32 || out->dtype == FSDP_BF16 || out->dtype == FSDP_F16))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "%s: the model output must be an F32 (or the train step's BF16 "
                         "or F16) tensor of 1 to %d dimensions", what, FSDP_MAX_DIMS);
    int plain_ce = loss->kind == FSDP_LOSS_CROSS_ENTROPY && loss->label_smoothing == 0.0f && !loss->ignore;
    if (out->dtype != FSDP_F32 && !plain_ce) /* [Note: 16-bit model output], src/fsdp/step.c */
        return fsdp__err(ctx, FSDP_ERR_INVALID, "%s: the model output is %s; a 16-bit output takes plain "
                         "cross-entropy only (no label smoothing, nothing ignored)", what, fsdp_dtype_name(out->dtype));
    if (out->layout != FSDP_LAYOUT_PLAIN && !(out->layout == FSDP_LAYOUT_ROWS16 && out->dtype != FSDP_F32))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "%s: the model output's layout %d is not one a loss reads", what,
                         (int)out->layout);
    for (int i = 0; i < out->ndim; i++)
        if (out->shape[i] <= 0) return fsdp__err(ctx, FSDP_ERR_INVALID, "%s: model output dimension %d is %lld",
                                                 what, i, (long long)out->shape[i]);
    if (!(loss->label_smoothing >= 0.0f && loss->label_smoothing <= 1.0f))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "%s: label_smoothing %g is outside [0, 1]", what,
                         (double)loss->label_smoothing);
    if (loss->kind == FSDP_LOSS_USER && !loss->fn)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "user loss: no function (struct fsdp_loss.fn is NULL)");
    if (!target || !target->data || target->ndim < 1 || target->ndim > FSDP_MAX_DIMS)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "%s: no target tensor", what);
    char os[96], ts[96];
    shape_str(out, os, sizeof os);
    shape_str(target, ts, sizeof ts);
    int64_t N = rows_of(out), C = out->shape[out->ndim - 1];
    if (loss->kind == FSDP_LOSS_CROSS_ENTROPY) {
        int same = target->ndim == out->ndim - 1;
        for (int i = 0; same && i < target->ndim; i++) same = target->shape[i] == out->shape[i];
        if (target->dtype != FSDP_I32 || !(same || (target->ndim == 1 && target->shape[0] == N)))
            return fsdp__err(ctx, FSDP_ERR_INVALID, "cross-entropy: target %s does not fit model output %s "
                             "(want I32 class ids shaped as the output without its last dimension)", ts, os);
        const int32_t *t = target->data;
        int64_t n = 0;
        for (int64_t i = 0; i < N; i++) {
            if (loss->ignore && t[i] == loss->ignore_index) continue;
            if (t[i] < 0 || t[i] >= C)
                return fsdp__err(ctx, FSDP_ERR_INVALID, "cross-entropy: target %d at row %lld is outside [0, %lld)",
                                 (int)t[i], (long long)i, (long long)C);
            n++;
        }
        *count = n;
        return FSDP_OK;
    }
    if (loss->kind != FSDP_LOSS_USER) {
        int same = target->ndim == out->ndim && target->dtype == FSDP_F32;
        for (int i = 0; same && i < out->ndim; i++) same = target->shape[i] == out->shape[i];
        if (!same)
            return fsdp__err(ctx, FSDP_ERR_INVALID, "%s: target %s does not match model output %s (want F32 of "
                             "the same shape)", what, ts, os);
    }
    *count = loss->kind == FSDP_LOSS_MSE ? N * C : N;
    return FSDP_OK;
}

#define LOSS_CHUNKS 256

/* One cross-entropy row: the loss, and the gradient into d (may be l). */
static double xent_row(const float *l, float *d, int64_t C, int32_t t, const float *q, float s, float g) {
    float mx = l[0];
    for (int64_t j = 1; j < C; j++) mx = l[j] > mx ? l[j] : mx;
    const struct fsdp__exp_range er = fsdp__exp_range(); /* [Note: exp range] */
    double sum = 0.0;
    for (int64_t j = 0; j < C; j++) sum += (double)fsdp__expf(l[j] - mx, er);
    double lse = (double)mx + log(sum), qsum = 0.0, ql = 0.0;
    float u = s / (float)C; /* the smoothing's uniform part */
    for (int64_t j = 0; j < C; j++) {
        float qj = (q ? (1.0f - s) * q[j] : (j == t ? 1.0f - s : 0.0f)) + u;
        qsum += (double)qj;
        ql += (double)qj * (double)l[j];
    }
    double loss = qsum * lse - ql;
    if (d) {
        float k = (float)qsum / (float)sum;
        for (int64_t j = 0; j < C; j++) {
            float qj = (q ? (1.0f - s) * q[j] : (j == t ? 1.0f - s : 0.0f)) + u;
            d[j] = (fsdp__expf(l[j] - mx, er) * k - qj) * g;
        }
    }
    return loss;
}

void fsdp__loss_builtin(const struct fsdp_loss *loss, const struct fsdp_tensor *out, const struct fsdp_tensor *target,
                        float g, double *sum, float *dout) {
    const float *y = out->data;
    int64_t C = out->shape[out->ndim - 1], N = rows_of(out);
    double part[LOSS_CHUNKS] = {0};
    int64_t per = (N + LOSS_CHUNKS - 1) / LOSS_CHUNKS, nch = (N + per - 1) / per;
#pragma omp parallel for schedule(static)
    for (int64_t ch = 0; ch < (fsdp__measuring ? 0 : nch); ch++) {
        int64_t i1 = (ch + 1) * per < N ? (ch + 1) * per : N;
        double acc = 0.0;
        for (int64_t i = ch * per; i < i1; i++) {
            const float *l = y + i * C;
            float *d = dout ? dout + i * C : NULL;
            if (loss->kind == FSDP_LOSS_MSE) {
                const float *t = (const float *)target->data + i * C;
                for (int64_t j = 0; j < C; j++) {
                    float e = l[j] - t[j];
                    acc += (double)e * (double)e;
                    if (d) d[j] = 2.0f * e * g;
                }
            } else if (loss->kind == FSDP_LOSS_SOFT_CROSS_ENTROPY) {
                acc += xent_row(l, d, C, -1, (const float *)target->data + i * C, loss->label_smoothing, g);
            } else {
                int32_t t = ((const int32_t *)target->data)[i];
                if (loss->ignore && t == loss->ignore_index) {
                    if (d) memset(d, 0, (size_t)C * sizeof(float));
                    continue;
                }
                acc += xent_row(l, d, C, t, NULL, loss->label_smoothing, g);
            }
        }
        part[ch] = acc;
    }
    double total = 0.0;
    for (int64_t ch = 0; ch < nch; ch++) total += part[ch];
    *sum = total;
}
