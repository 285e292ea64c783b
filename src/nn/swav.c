/*
 * swav.c - SwAV's loss: online codes by Sinkhorn-Knopp over the data-parallel
 * batch, and the swapped prediction loss with its gradient w.r.t. the
 * prototype scores. A loss, not a module: it reads the scores a model
 * produced (z . C^T per crop) and returns the mean loss and d loss / d scores.
 * Sits in nn/; its collectives go through the communicator it is given
 * (src/comm), never MPI directly.
 *
 * [Note: SwAV loss] For B images on this rank (Bg over all ranks), n_crops
 * crops each, scores S_v (B, K) of crop v, and the crops `assign` whose codes
 * are computed:
 *   codes Q_c = sinkhorn(S_c) for c in assign (no gradient flows through them)
 *   loss = 1/|assign| sum_c 1/(n_crops - 1) sum_{v != c}
 *          -1/Bg sum_b sum_k Q_c[b,k] log softmax(S_v[b] / tau)[k]
 * Since every row of Q_c sums to 1, d loss / d S_v[b] =
 *   1/|assign| sum_{c in assign, c != v} (softmax(S_v[b] / tau) - Q_c[b]) / (tau (n_crops - 1) Bg).
 * Sinkhorn-Knopp (the distributed form of the SwAV paper's code): with n the
 * rows here (a queue's rows first, then the batch's), N their sum over ranks,
 *   Q = exp((S - max) / eps)^T (K, n); Q /= sum(Q)            [all-reduce]
 *   iters times: Q /= row sums [all-reduce]; Q /= K; Q /= column sums; Q /= N
 *   Q *= N, so every column (an image's code) sums to 1.
 * The global max (all-reduced) keeps exp in range and cancels in the first
 * normalisation, so the codes equal the formula's. Arithmetic is in double,
 * and each all-reduce sums per-rank partial sums, so N ranks give the
 * 1-rank codes to within summation order.
 */
#include "nn/nn-impl.h"

#include <math.h>

struct fsdp_swav_opts fsdp_swav_opts_default(void) {
    struct fsdp_swav_opts o = {0.1, 0.05, 3};
    return o;
}

/* x (n) = op over ranks of x; COLLECTIVE on comm (NULL: one rank). */
static enum fsdp_status allreduce_d(struct fsdp_ctx *ctx, struct fsdp_comm *comm, double *x, size_t n,
                                    enum fsdp_red_op op, const char *what) {
    if (!comm || fsdp_comm_size(comm) == 1 || n == 0) return FSDP_OK;
    /* the collectives have no double: gather the values as bytes and reduce
     * them here in rank order (the same bits on every rank) */
    int world = fsdp_comm_size(comm);
    double *all = fsdp__malloc(n * (size_t)world * sizeof(double));
    if (!all) return fsdp__err(ctx, FSDP_ERR_NOMEM, "swav: out of memory for %s", what);
    enum fsdp_status st = fsdp_comm_allgather(comm, x, all, n * sizeof(double), FSDP_U8);
    if (st != FSDP_OK) {
        free(all);
        return fsdp__err(ctx, st, "swav: all-gather of %s failed", what);
    }
    for (size_t i = 0; i < n; i++) {
        double acc = all[i];
        for (int r = 1; r < world; r++) {
            double v = all[(size_t)r * n + i];
            acc = op == FSDP_SUM ? acc + v : op == FSDP_MAX ? (v > acc ? v : acc) : (v < acc ? v : acc);
        }
        x[i] = acc;
    }
    free(all);
    return FSDP_OK;
}

enum fsdp_status fsdp_sinkhorn(struct fsdp_ctx *ctx, struct fsdp_comm *comm, const float *scores, int64_t n,
                               int64_t K, double eps, int iters, float *codes) {
    if (n < 0 || K <= 0 || !(eps > 0) || iters < 0 || (n && (!scores || !codes)))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "sinkhorn: bad arguments (rows %lld, K %lld, eps %g, iters %d)",
                         (long long)n, (long long)K, eps, iters);
    double N = (double)n, mx = -INFINITY;
    FSDP_TRY(allreduce_d(ctx, comm, &N, 1, FSDP_SUM, "the row count"));
    if (N <= 0) return fsdp__err(ctx, FSDP_ERR_INVALID, "sinkhorn: no rows on any rank");
    if (fsdp__measuring) { /* no values to balance ([Note: measure mode], src/fsdp/plan.c) */
        if (n) memset(codes, 0, (size_t)(n * K) * sizeof(float));
        return FSDP_OK;
    }
    int64_t bad = -1;
    for (int64_t i = 0; i < n * K && bad < 0; i++) {
        if (!isfinite(scores[i])) bad = i;
        mx = scores[i] > mx ? scores[i] : mx;
    }
    if (bad >= 0) mx = INFINITY; /* every rank learns of it through the maximum */
    FSDP_TRY(allreduce_d(ctx, comm, &mx, 1, FSDP_MAX, "the score maximum"));
    if (bad >= 0)
        return fsdp__err(ctx, FSDP_ERR_NUMERIC, "sinkhorn: score (%lld, %lld) is %g", (long long)(bad / K),
                         (long long)(bad % K), (double)scores[bad]);
    if (!isfinite(mx)) return fsdp__err(ctx, FSDP_ERR_NUMERIC, "sinkhorn: a score on another rank is not finite");
    double *q = fsdp__malloc((size_t)(n * K + 2 * K + 1) * sizeof(double)); /* (n, K) row-major: Q^T */
    if (!q) return fsdp__err(ctx, FSDP_ERR_NOMEM, "sinkhorn: out of memory (%lld x %lld)", (long long)n, (long long)K);
    double *rows = q + n * K; /* (K) sums over images of each prototype: Q's row sums */
    /* [Note: parallel Sinkhorn] Threads split the work so that every sum keeps
     * the serial order: the exponentials in parallel, their total in index
     * order; a prototype's sum over images in image order within one thread
     * (threads split the prototypes); an image's normalisation within one
     * thread. So the codes have the same bits at any thread count. */
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n * K; i++) q[i] = exp(((double)scores[i] - mx) / eps);
    double total = 0.0;
    for (int64_t i = 0; i < n * K; i++) total += q[i];
    enum fsdp_status st = allreduce_d(ctx, comm, &total, 1, FSDP_SUM, "the total");
    if (st == FSDP_OK) {
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n * K; i++) q[i] /= total;
    }
    for (int it = 0; st == FSDP_OK && it < iters; it++) {
#pragma omp parallel for schedule(static)
        for (int64_t k0 = 0; k0 < K; k0 += 64) {
            int64_t k1 = k0 + 64 < K ? k0 + 64 : K;
            for (int64_t k = k0; k < k1; k++) rows[k] = 0.0;
            for (int64_t b = 0; b < n; b++)
                for (int64_t k = k0; k < k1; k++) rows[k] += q[b * K + k];
        }
        st = allreduce_d(ctx, comm, rows, (size_t)K, FSDP_SUM, "the prototype sums");
        if (st != FSDP_OK) break;
#pragma omp parallel for schedule(static)
        for (int64_t b = 0; b < n; b++) {
            double *r = q + b * K, col = 0.0;
            for (int64_t k = 0; k < K; k++) col += r[k] = r[k] / rows[k] / (double)K;
            for (int64_t k = 0; k < K; k++) r[k] = r[k] / col / N;
        }
    }
    if (st == FSDP_OK) {
#pragma omp parallel for schedule(static)
        for (int64_t b = 0; b < n; b++) {
            double col = 0.0;
            for (int64_t k = 0; k < K; k++) col += q[b * K + k];
            /* Q *= N; after a column step col is 1/N already; with iters 0 normalise */
            for (int64_t k = 0; k < K; k++) codes[b * K + k] = (float)(q[b * K + k] / col);
        }
    }
    free(q);
    return st;
}

/* The argument checks of fsdp_swav_codes, fsdp_swav_predict and fsdp_swav_loss. */
static enum fsdp_status check_assign(struct fsdp_ctx *ctx, const char *fn, int n_crops, int64_t B, int64_t K,
                                     const int *assign, int n_assign, const float *const *queue,
                                     const int64_t *queue_len, double temperature) {
    if (n_crops < 2 || B < 0 || K <= 0 || n_assign < 1 || !assign || !(temperature > 0))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "%s: bad arguments (%d crops, batch %lld, K %lld, %d assigned crops, "
                         "temperature %g)", fn, n_crops, (long long)B, (long long)K, n_assign, temperature);
    for (int a = 0; a < n_assign; a++) {
        if (assign[a] < 0 || assign[a] >= n_crops)
            return fsdp__err(ctx, FSDP_ERR_INVALID, "%s: assigned crop %d is outside [0, %d)", fn, assign[a], n_crops);
        for (int a2 = 0; a2 < a; a2++)
            if (assign[a2] == assign[a])
                return fsdp__err(ctx, FSDP_ERR_INVALID, "%s: crop %d assigned twice", fn, assign[a]);
        int64_t lq = queue && queue_len ? queue_len[a] : 0;
        if (lq < 0 || (lq && !queue[a]))
            return fsdp__err(ctx, FSDP_ERR_INVALID, "%s: queue %d: %lld rows", fn, a, (long long)lq);
    }
    return FSDP_OK;
}

enum fsdp_status fsdp_swav_codes(struct fsdp_ctx *ctx, struct fsdp_comm *comm, const struct fsdp_swav_opts *opts,
                                 const float *scores, int n_crops, int64_t B, int64_t K, const int *assign,
                                 int n_assign, const float *const *queue, const int64_t *queue_len, float *codes) {
    struct fsdp_swav_opts o = opts ? *opts : fsdp_swav_opts_default();
    FSDP_TRY(check_assign(ctx, "swav_codes", n_crops, B, K, assign, n_assign, queue, queue_len, o.temperature));
    if (B && (!scores || !codes)) return fsdp__err(ctx, FSDP_ERR_INVALID, "swav_codes: no scores or codes");
    int64_t lq_max = 0;
    for (int a = 0; queue && queue_len && a < n_assign; a++) lq_max = queue_len[a] > lq_max ? queue_len[a] : lq_max;
    float *joined = fsdp__malloc((size_t)((lq_max + B) * K + 1) * sizeof(float));
    float *all = fsdp__malloc((size_t)((lq_max + B) * K + 1) * sizeof(float));
    enum fsdp_status st = FSDP_OK;
    if (!joined || !all) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "swav_codes: out of memory");
    for (int a = 0; st == FSDP_OK && a < n_assign; a++) {
        int64_t lq = queue && queue_len ? queue_len[a] : 0;
        if (lq) memcpy(joined, queue[a], (size_t)(lq * K) * sizeof(float));
        if (B) memcpy(joined + lq * K, scores + (int64_t)assign[a] * B * K, (size_t)(B * K) * sizeof(float));
        st = fsdp_sinkhorn(ctx, comm, joined, lq + B, K, o.epsilon, o.sinkhorn_iters, all);
        if (st == FSDP_OK && B) memcpy(codes + (int64_t)a * B * K, all + lq * K, (size_t)(B * K) * sizeof(float));
    }
    free(joined);
    free(all);
    return st;
}

enum fsdp_status fsdp_swav_predict(struct fsdp_ctx *ctx, struct fsdp_comm *comm, const struct fsdp_swav_opts *opts,
                                   const float *scores, int v0, int nv, int n_crops, int64_t B, int64_t K,
                                   const int *assign, int n_assign, const float *codes, double *loss, float *dscores) {
    struct fsdp_swav_opts o = opts ? *opts : fsdp_swav_opts_default();
    FSDP_TRY(check_assign(ctx, "swav_predict", n_crops, B, K, assign, n_assign, NULL, NULL, o.temperature));
    if (v0 < 0 || nv < 0 || v0 + nv > n_crops || (B && nv && (!scores || !codes)))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "swav_predict: crops [%d, %d) of %d, or no scores or codes", v0,
                         v0 + nv, n_crops);
    double Bg = (double)B;
    FSDP_TRY(allreduce_d(ctx, comm, &Bg, 1, FSDP_SUM, "the batch size"));
    if (Bg <= 0) return fsdp__err(ctx, FSDP_ERR_INVALID, "swav_predict: empty batch on every rank");
    size_t nBK = (size_t)(nv * B * K);
    /* softmax(S_v / tau) per crop and row, kept as p (float), and the logsumexp of each row / tau */
    float *p = fsdp__malloc((nBK + 1) * sizeof(float));
    double *ls = fsdp__malloc((size_t)(nv * B + 1) * sizeof(double));
    enum fsdp_status st = FSDP_OK;
    if (!p || !ls) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "swav_predict: out of memory");
    /* sub (n_assign, nv * B): each (code, crop, image) term of the loss, summed below in that order */
    double *sub = fsdp__malloc((size_t)(n_assign * nv * B + 1) * sizeof(double));
    if (st == FSDP_OK && !sub) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "swav_predict: out of memory");
    double g = 1.0 / ((double)n_assign * (double)(n_crops - 1) * Bg);
    float gg = (float)(g / o.temperature);
    /* rows in parallel; within a row the serial order of every sum ([Note: parallel Sinkhorn]) */
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < (st == FSDP_OK ? nv * B : 0); r++) {
        const float *s = scores + r * K;
        double mx = -INFINITY, sum = 0.0;
        for (int64_t k = 0; k < K; k++) mx = s[k] / o.temperature > mx ? s[k] / o.temperature : mx;
        for (int64_t k = 0; k < K; k++) sum += exp(s[k] / o.temperature - mx);
        ls[r] = mx + log(sum);
        for (int64_t k = 0; k < K; k++) p[r * K + k] = (float)exp(s[k] / o.temperature - ls[r]);
        int v = v0 + (int)(r / B);
        int64_t b = r % B;
        if (dscores) memset(dscores + r * K, 0, (size_t)K * sizeof(float));
        for (int a = 0; a < n_assign; a++) {
            sub[(int64_t)a * nv * B + r] = 0.0;
            if (v == assign[a]) continue;
            const float *q = codes + ((int64_t)a * B + b) * K; /* crop assign[a]'s code of image b */
            double t = 0.0;
            for (int64_t k = 0; k < K; k++) t -= (double)q[k] * ((double)s[k] / o.temperature - ls[r]);
            sub[(int64_t)a * nv * B + r] = t;
            if (dscores)
                for (int64_t k = 0; k < K; k++) dscores[r * K + k] += gg * (p[r * K + k] - q[k]);
        }
    }
    double total = 0.0;
    for (int a = 0; st == FSDP_OK && a < n_assign; a++)
        for (int64_t r = 0; r < nv * B; r++)
            if (v0 + (int)(r / B) != assign[a]) total += sub[(int64_t)a * nv * B + r];
    if (st == FSDP_OK) st = allreduce_d(ctx, comm, &total, 1, FSDP_SUM, "the loss");
    if (st == FSDP_OK && loss) *loss = total * g;
    free(sub);
    free(p);
    free(ls);
    return st;
}

enum fsdp_status fsdp_swav_loss(struct fsdp_ctx *ctx, struct fsdp_comm *comm, const struct fsdp_swav_opts *opts,
                                const float *scores, int n_crops, int64_t B, int64_t K, const int *assign,
                                int n_assign, const float *const *queue, const int64_t *queue_len, double *loss,
                                float *dscores) {
    struct fsdp_swav_opts o = opts ? *opts : fsdp_swav_opts_default();
    /* checked here too before the arguments size codes */
    FSDP_TRY(check_assign(ctx, "swav_loss", n_crops, B, K, assign, n_assign, queue, queue_len, o.temperature));
    float *codes = fsdp__malloc((size_t)(n_assign * B * K + 1) * sizeof(float));
    if (!codes) return fsdp__err(ctx, FSDP_ERR_NOMEM, "swav_loss: out of memory");
    enum fsdp_status st = fsdp_swav_codes(ctx, comm, &o, scores, n_crops, B, K, assign, n_assign, queue, queue_len,
                                          codes);
    if (st == FSDP_OK)
        st = fsdp_swav_predict(ctx, comm, &o, scores, 0, n_crops, n_crops, B, K, assign, n_assign, codes, loss, dscores);
    free(codes);
    return st;
}
