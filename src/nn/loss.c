/*
 * loss.c - softmax cross-entropy over logits (N, V) with integer targets (N):
 * loss = mean_i (logsumexp(logits_i) - logits_i[target_i]), numerically
 * stable (the row max is subtracted first). The gradient
 * d(loss * scale)/dlogits = (softmax - onehot) * scale / N may overwrite the
 * logits (dlogits == logits): each row's max and target logit are read before
 * the row is written. The mean is summed in fixed chunks so the result does
 * not depend on the thread count.
 */
#include "nn/nn-impl.h"

#include <math.h>

#define CE_CHUNKS 256

enum fsdp_status fsdp_cross_entropy(struct fsdp_ctx *ctx, const float *logits, const int32_t *targets,
                                    int64_t N, int64_t V, float scale, float *loss, float *dlogits) {
    if (N <= 0 || V <= 0 || !logits || !targets)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "cross_entropy: bad arguments (N %lld, V %lld)", (long long)N,
                         (long long)V);
    for (int64_t i = 0; i < N; i++)
        if (targets[i] < 0 || targets[i] >= V)
            return fsdp__err(ctx, FSDP_ERR_INVALID, "cross_entropy: target %d at row %lld is outside [0, %lld)",
                             (int)targets[i], (long long)i, (long long)V);
    double part[CE_CHUNKS] = {0};
    int64_t per = (N + CE_CHUNKS - 1) / CE_CHUNKS, nch = (N + per - 1) / per;
    float g = scale / (float)N;
#pragma omp parallel for schedule(static)
    for (int64_t ch = 0; ch < nch; ch++) {
        int64_t i1 = (ch + 1) * per < N ? (ch + 1) * per : N;
        double acc = 0.0;
        for (int64_t i = ch * per; i < i1; i++) {
            const float *l = logits + i * V; /* (V) */
            int64_t t = targets[i];
            float mx = l[0];
#pragma omp simd reduction(max : mx)
            for (int64_t j = 1; j < V; j++) mx = l[j] > mx ? l[j] : mx;
            float lt = l[t];
            float *d = dlogits ? dlogits + i * V : NULL; /* (V); may be l */
            double sum = 0.0; /* float sums over blocks of 1024, in double across them */
            for (int64_t j0 = 0; j0 < V; j0 += 1024) {
                int64_t j1 = j0 + 1024 < V ? j0 + 1024 : V;
                float s = 0.0f;
                if (d) {
#pragma omp simd reduction(+ : s)
                    for (int64_t j = j0; j < j1; j++) {
                        float e = fsdp__expf(l[j] - mx);
                        d[j] = e;
                        s += e;
                    }
                } else {
#pragma omp simd reduction(+ : s)
                    for (int64_t j = j0; j < j1; j++) s += fsdp__expf(l[j] - mx);
                }
                sum += (double)s;
            }
            if (d) {
                float k = (float)(1.0 / sum) * g;
#pragma omp simd
                for (int64_t j = 0; j < V; j++) d[j] *= k;
                d[t] -= g;
            }
            acc += (double)mx + log(sum) - (double)lt;
        }
        part[ch] = acc;
    }
    double total = 0.0;
    for (int64_t ch = 0; ch < nch; ch++) total += part[ch];
    if (loss) *loss = (float)(total / (double)N);
    return FSDP_OK;
}
