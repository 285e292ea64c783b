/*
 * probe.c - fsdp-train's evaluations of frozen features (task.h), used by
 * --task swav: a weighted kNN classifier and a linear probe. Both read
 * features that every rank holds whole (the task gathers them) and return
 * the same accuracy on every rank without communicating: the kNN votes of a
 * rank's share of the test set are summed by the caller; the probe is small
 * enough that each rank trains the same one (the same bits: the same inputs
 * and sums in an order that no thread count changes, [Note: probe sums]).
 *
 * [Note: linear probe] Multinomial logistic regression on features x (n, F):
 * each feature standardised with the training rows' mean and standard
 * deviation (what a batch norm before the linear layer does in VISSL's
 * linear evaluation), then W (C, F) and b (C) from zero by SGD with momentum
 * 0.9, batches of 256 in an order drawn from (seed, epoch), learning rate
 * 0.1 on a cosine to 0 over the epochs, weight decay wd on W (1e-4 by
 * default), minimising the mean cross-entropy; the result is the test
 * rows' top-1 accuracy. Given several weight decays, the probe's own
 * training rows choose (as linear evaluations select their regularisation
 * on a validation split, never on the test set): a probe for each is
 * trained on the first n - n/6 rows and scored on the last n/6, and the
 * best (the first of equals) is trained again on all n rows. Deterministic
 * and independent of the world size.
 */
#include "task.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define PROBE_BATCH 256
#define PROBE_LR 0.1
#define PROBE_MOMENTUM 0.9f

static uint64_t mix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* [Note: probe sums] A dot product of F floats as one chain of adds waits
 * out the add's latency at every element: the probe at 4096 features spent
 * minutes there. Element f goes to partial sum f mod 32 instead (vector
 * lanes, independent chains) and the 32 are added pairwise at the end: an
 * order fixed by F alone. The batch's rows run in parallel (each row's
 * logits are its own), and each gradient element sums the rows in order in
 * the one thread that owns its block of features: the same bits at any
 * thread count, so every rank still trains the same probe. */
#define NLANE 32
static float dot(const float *w, const float *x, int64_t F) {
    float p[NLANE] = {0};
    int64_t f = 0;
    for (; f + NLANE <= F; f += NLANE) {
#pragma omp simd
        for (int l = 0; l < NLANE; l++) p[l] += w[f + l] * x[f + l];
    }
    for (int l = 0; f < F; f++, l++) p[l] += w[f] * x[f];
    for (int h = NLANE / 2; h; h >>= 1)
        for (int l = 0; l < h; l++) p[l] += p[l + h];
    return p[0];
}

/* logits (C) = W x + b; returns the argmax */
static int logits(const float *W, const float *b, const float *x, int64_t F, int C, float *z) {
    int best = 0;
    for (int c = 0; c < C; c++) {
        z[c] = b[c] + dot(W + (int64_t)c * F, x, F);
        if (z[c] > z[best]) best = c;
    }
    return best;
}

/* Correct top-1 predictions of the probe (W, b) on the nt rows of x (z: nt C logits). */
static int64_t count_correct(const float *W, const float *b, const float *x, const int32_t *y, int64_t nt, int64_t F,
                             int C, float *z) {
    int64_t correct = 0;
#pragma omp parallel for schedule(static) reduction(+ : correct)
    for (int64_t i = 0; i < nt; i++) correct += logits(W, b, x + i * F, F, C, z + i * C) == y[i];
    return correct;
}

/* Standardises xtr (n rows) and xte (nt rows) with xtr's per-feature mean
 * and standard deviation; -1 when out of memory. */
static int standardise(float *xtr, int64_t n, float *xte, int64_t nt, int64_t F) {
    double *mu = calloc((size_t)F, sizeof(double)), *var = calloc((size_t)F, sizeof(double));
    if (!mu || !var) {
        free(mu), free(var);
        return -1;
    }
    for (int64_t i = 0; i < n; i++)
        for (int64_t f = 0; f < F; f++) mu[f] += xtr[i * F + f];
    for (int64_t f = 0; f < F; f++) mu[f] /= (double)n;
    for (int64_t i = 0; i < n; i++)
        for (int64_t f = 0; f < F; f++) {
            double d = xtr[i * F + f] - mu[f];
            var[f] += d * d;
        }
    for (int64_t f = 0; f < F; f++) var[f] = 1.0 / sqrt(var[f] / (double)n + 1e-5);
    for (int64_t i = 0; i < n; i++)
        for (int64_t f = 0; f < F; f++) xtr[i * F + f] = (float)((xtr[i * F + f] - mu[f]) * var[f]);
    for (int64_t i = 0; i < nt; i++)
        for (int64_t f = 0; f < F; f++) xte[i * F + f] = (float)((xte[i * F + f] - mu[f]) * var[f]);
    free(mu), free(var);
    return 0;
}

/* One probe (standardised features): trained on the n rows of xtr with
 * weight decay wd, its top-1 accuracy on the nt rows of xte in *acc; -1
 * when out of memory. */
static int probe_once(const float *xtr, const int32_t *ytr, int64_t n, const float *xte, const int32_t *yte,
                      int64_t nt, int64_t F, int C, int epochs, float wd, uint64_t seed, double *acc) {
    float *W = calloc((size_t)(C * F), sizeof(float)), *mW = calloc((size_t)(C * F), sizeof(float));
    float *b = calloc((size_t)C, sizeof(float)), *mb = calloc((size_t)C, sizeof(float));
    int64_t nblk = (F + 255) / 256; /* blocks of 256 features */
    float *gW = malloc((size_t)(C * nblk * 256) * sizeof(float)), *g = malloc((size_t)(PROBE_BATCH * C) * sizeof(float));
    float *z = malloc((size_t)(nt * C + 1) * sizeof(float));
    int64_t *order = malloc((size_t)n * sizeof(int64_t));
    int ok = W && mW && b && mb && gW && g && z && order;
    if (ok) {
        int64_t per_epoch = (n + PROBE_BATCH - 1) / PROBE_BATCH, total = per_epoch * epochs, it = 0;
        for (int e = 0; e < epochs; e++) {
            for (int64_t i = 0; i < n; i++) order[i] = i;
            for (int64_t i = n - 1; i > 0; i--) {
                int64_t j = (int64_t)(mix(mix(seed ^ 0x70726f6265ull) + (uint64_t)e * 0x100000001ull + (uint64_t)i) %
                                      (uint64_t)(i + 1));
                int64_t t = order[i];
                order[i] = order[j];
                order[j] = t;
            }
            for (int64_t s = 0; s < n; s += PROBE_BATCH, it++) {
                int64_t m = n - s < PROBE_BATCH ? n - s : PROBE_BATCH;
                /* g (m, C): the softmax less the one-hot target, over m, row by row in parallel */
#pragma omp parallel for schedule(static)
                for (int64_t r = 0; r < m; r++) {
                    int64_t i = order[s + r];
                    float *zr = g + r * C;
                    int best = logits(W, b, xtr + i * F, F, C, zr);
                    double sum = 0;
                    for (int c = 0; c < C; c++) sum += exp((double)(zr[c] - zr[best]));
                    float zb = zr[best];
                    for (int c = 0; c < C; c++)
                        zr[c] = ((float)(exp((double)(zr[c] - zb)) / sum) - (c == ytr[i] ? 1.0f : 0.0f)) / (float)m;
                }
                for (int c = 0; c < C; c++) {
                    float gb = 0.0f;
                    for (int64_t r = 0; r < m; r++) gb += g[r * C + c];
                    mb[c] = PROBE_MOMENTUM * mb[c] + gb;
                }
                float lr = (float)(PROBE_LR * 0.5 * (1.0 + cos(M_PI * (double)it / (double)total)));
                /* per block of 256 features (all C rows of W): the gradient over the rows in order, then
                 * momentum, weight decay and the step */
#pragma omp parallel for schedule(static)
                for (int64_t k = 0; k < nblk; k++) {
                    int64_t f0 = k * 256, f1 = f0 + 256 < F ? f0 + 256 : F;
                    float *gw = gW + k * 256 * C;
                    memset(gw, 0, sizeof(float) * (size_t)(C * (f1 - f0)));
                    for (int64_t r = 0; r < m; r++) {
                        const float *x = xtr + order[s + r] * F;
                        for (int c = 0; c < C; c++) {
                            float gc = g[r * C + c], *gwc = gw + c * (f1 - f0);
                            for (int64_t f = f0; f < f1; f++) gwc[f - f0] += gc * x[f];
                        }
                    }
                    for (int c = 0; c < C; c++)
                        for (int64_t f = f0; f < f1; f++) {
                            int64_t q = (int64_t)c * F + f;
                            mW[q] = PROBE_MOMENTUM * mW[q] + gw[c * (f1 - f0) + f - f0] + wd * W[q];
                            W[q] -= lr * mW[q];
                        }
                }
                for (int c = 0; c < C; c++) b[c] -= lr * mb[c];
            }
        }
        *acc = (double)count_correct(W, b, xte, yte, nt, F, C, z) / (double)nt;
    }
    free(W), free(mW), free(b), free(mb), free(gW), free(g), free(z), free(order);
    return ok ? 0 : -1;
}

int task_linear_probe(float *xtr, const int32_t *ytr, int64_t n, float *xte, const int32_t *yte, int64_t nt,
                      int64_t F, int C, int epochs, const float *wd, int n_wd, uint64_t seed, double *acc,
                      float *wd_used, double *held) {
    *acc = NAN;
    *wd_used = wd[0];
    if (held) *held = NAN;
    if (n <= 0 || nt <= 0 || F <= 0 || C <= 0) return 0;
    if (standardise(xtr, n, xte, nt, F)) return -1;
    int64_t nv = n / 6;
    if ((n_wd > 1 || held) && nv > 0) { /* choose on the held-out last sixth */
        double best = -1;
        for (int i = 0; i < n_wd; i++) {
            double a;
            if (probe_once(xtr, ytr, n - nv, xtr + (n - nv) * F, ytr + (n - nv), nv, F, C, epochs, wd[i], seed, &a))
                return -1;
            if (a > best) best = a, *wd_used = wd[i];
        }
        if (held) *held = best;
    }
    return probe_once(xtr, ytr, n, xte, yte, nt, F, C, epochs, *wd_used, seed, acc);
}

int64_t task_knn_correct(struct fsdp_ctx *ctx, const float *bank, const int32_t *ybank, int64_t nb, const float *test,
                         const int32_t *ytest, int64_t lo, int64_t hi, int64_t F, int C, int k, double temperature,
                         enum fsdp_status *st) {
    *st = FSDP_OK;
    int kk = nb < k ? (int)nb : k;
    const int64_t chunk = 64;
    float *sim = malloc((size_t)(chunk * nb + 1) * sizeof(float));
    double *votes = malloc((size_t)C * sizeof(double));
    int64_t *top = malloc((size_t)(kk + 1) * sizeof(int64_t)), correct = 0;
    if (!sim || !votes || !top) {
        *st = fsdp_error(ctx, FSDP_ERR_NOMEM, "out of memory for the kNN evaluation");
        kk = 0, hi = lo;
    }
    for (int64_t s = lo; s < hi && *st == FSDP_OK; s += chunk) {
        int64_t m = hi - s < chunk ? hi - s : chunk;
        /* cosine similarities of m test rows with the bank: sim (m, nb) */
        if ((*st = fsdp_gemm(ctx, NULL, 0, 1, m, nb, F, 1.0f, test + s * F, F, bank, F, 0.0f, sim, nb)) != FSDP_OK)
            break;
        for (int64_t r = 0; r < m; r++) {
            const float *sr = sim + r * nb;
            int nt_ = 0; /* the k largest, ties to the lower index */
            for (int64_t j = 0; j < nb; j++) {
                int p = nt_;
                while (p > 0 && sr[top[p - 1]] < sr[j]) p--;
                if (p >= kk) continue;
                if (nt_ < kk) nt_++;
                memmove(top + p + 1, top + p, (size_t)(nt_ - 1 - p) * sizeof(int64_t));
                top[p] = j;
            }
            memset(votes, 0, (size_t)C * sizeof(double));
            for (int q = 0; q < nt_; q++) votes[ybank[top[q]]] += exp((double)sr[top[q]] / temperature);
            int best = 0;
            for (int c = 1; c < C; c++)
                if (votes[c] > votes[best]) best = c;
            correct += best == ytest[s + r];
        }
    }
    free(sim), free(votes), free(top);
    return correct;
}
