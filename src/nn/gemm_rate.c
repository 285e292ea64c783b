/*
 * gemm_rate.c - a short measurement of this machine's GEMM rate through the
 * layers' own product (fsdp__gemm_lp: oneDNN's sgemm for fp32, its bf16
 * matmul or the widened product for 16-bit inputs), so that training
 * figures can be quoted as a fraction of it (model FLOP utilisation) and
 * benchmarks measure the same way (bench/gemm_rate.c). Part of src/nn, the
 * only code that reaches oneDNN.
 */
#include "nn/nn-impl.h"

#include <math.h>

/* [Note: the fastest product] The rate is the best of the timed products,
 * not their median: other processes on the cores only make a product slower,
 * so the fastest is the closest to what the machine can do, and a peak that
 * the training steps then exceed (an MFU above 1) is less likely. */
static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

enum fsdp_status fsdp_gemm_rate(struct fsdp_ctx *ctx, enum fsdp_dtype dt, int64_t M, double seconds, double *gflops) {
    if (!gflops) return fsdp__err(ctx, FSDP_ERR_INVALID, "gemm rate: gflops is NULL");
    *gflops = 0;
    if (dt != FSDP_F32 && dt != FSDP_BF16 && dt != FSDP_F16)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "gemm rate: dtype %s is not F32, BF16 or F16", fsdp_dtype_name(dt));
    if (!(seconds >= 0) || seconds > 3600)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "gemm rate: %g seconds is not in [0, 3600]", seconds);
    if (M < 1 || M > 65536) return fsdp__err(ctx, FSDP_ERR_INVALID, "gemm rate: %lld rows is not in [1, 65536]", (long long)M);
    /* (M tokens x 768) @ (768 x 3072): an MLP projection of GPT-2 124M */
    const int64_t K = 768, N = 3072;
    size_t es = fsdp_dtype_size(dt);
    float *A32 = fsdp__alloc(ctx, (size_t)(M * K) * sizeof(float), FSDP_MEM_OTHER, "gemm rate: A");
    float *B32 = fsdp__alloc(ctx, (size_t)(K * N) * sizeof(float), FSDP_MEM_OTHER, "gemm rate: B");
    float *C = fsdp__alloc(ctx, (size_t)(M * N) * sizeof(float), FSDP_MEM_OTHER, "gemm rate: C");
    void *A = dt == FSDP_F32 ? (void *)A32 : fsdp__alloc(ctx, (size_t)(M * K) * es, FSDP_MEM_OTHER, "gemm rate: A");
    void *B = dt == FSDP_F32 ? (void *)B32 : fsdp__alloc(ctx, (size_t)(K * N) * es, FSDP_MEM_OTHER, "gemm rate: B");
    enum fsdp_status st = A32 && B32 && C && A && B ? FSDP_OK : FSDP_ERR_NOMEM; /* fsdp__alloc set the message */
    if (st == FSDP_OK) {
        for (int64_t i = 0; i < M * K; i++) A32[i] = (float)(i % 13) * 0.01f;
        for (int64_t i = 0; i < K * N; i++) B32[i] = (float)(i % 7) * 0.01f;
        if (dt != FSDP_F32) {
            fsdp__cvt_from_f32(dt, A32, A, (size_t)(M * K));
            fsdp__cvt_from_f32(dt, B32, B, (size_t)(K * N));
        }
        /* the first product creates the primitive (and warms the caches): not timed */
        fsdp__gemm_lp(dt, 0, 0, M, N, K, 1.0f, A, K, B, N, 0.0f, C, N);
        double rates[64], flops = 2.0 * (double)M * (double)N * (double)K, t_end = fsdp__now() + seconds;
        int n = 0;
        while (n < 64 && (n < 2 || fsdp__now() < t_end)) {
            double t0 = fsdp__now();
            fsdp__gemm_lp(dt, 0, 0, M, N, K, 1.0f, A, K, B, N, 0.0f, C, N);
            double dt_s = fsdp__now() - t0;
            rates[n++] = flops / (dt_s > 1e-9 ? dt_s : 1e-9) / 1e9;
        }
        qsort(rates, (size_t)n, sizeof *rates, cmp_d);
        *gflops = rates[n - 1]; /* the fastest: a busy machine only slows a product down */
    }
    if (A != A32) fsdp__free(ctx, A);
    if (B != B32) fsdp__free(ctx, B);
    fsdp__free(ctx, A32);
    fsdp__free(ctx, B32);
    fsdp__free(ctx, C);
    return st;
}
