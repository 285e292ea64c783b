/*
 * gemm_rate.c - measures this machine's fp32 GEMM rate through the same
 * wrapper the layers use (oneDNN), at GPT-2-like shapes, so step figures can
 * be quoted as a fraction of it. Prints "gemm_gflops <median>" (fp32), and
 * with mode bf16 or all also "gemm_bf16_gflops <median>" (fsdp__gemm_bf16:
 * oneDNN matmul, bf16 inputs, fp32 accumulation and output) and the ratio.
 * Usage: build/bench/gemm_rate [threads] [f32|bf16|all]   (default f32)
 */
#include "core/core-impl.h"
#include "nn/nn-impl.h"

#include <omp.h>
#include <string.h>

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 2;
    const char *mode = argc > 2 ? argv[2] : "f32";
    int do_f32 = strcmp(mode, "bf16") != 0, do_bf16 = strcmp(mode, "f32") != 0;
    if (strcmp(mode, "f32") && strcmp(mode, "bf16") && strcmp(mode, "all")) {
        fprintf(stderr, "gemm_rate: mode '%s' is not f32, bf16 or all\n", mode);
        return 2;
    }
    omp_set_num_threads(threads);
    /* (tokens 1024) x (768) @ (768 x 3072): an MLP projection of GPT-2 124M */
    const int64_t M = 1024, K = 768, N = 3072;
    float *A = malloc((size_t)(M * K) * sizeof(float)), *B = malloc((size_t)(K * N) * sizeof(float));
    float *C = malloc((size_t)(M * N) * sizeof(float));
    for (int64_t i = 0; i < M * K; i++) A[i] = (float)(i % 13) * 0.01f;
    for (int64_t i = 0; i < K * N; i++) B[i] = (float)(i % 7) * 0.01f;
    double rates[9], f32_rate = 0;
    for (int r = 0; r < 9 && do_f32; r++) {
        double t0 = fsdp__now();
        for (int k = 0; k < 4; k++) fsdp__sgemm(0, 0, M, N, K, 1.0f, A, K, B, N, 0.0f, C, N);
        double dt = fsdp__now() - t0;
        rates[r] = 4.0 * 2.0 * (double)(M * N * K) / dt / 1e9;
    }
    if (do_f32) {
        qsort(rates, 9, sizeof(double), cmp_d);
        f32_rate = rates[4];
        printf("gemm_gflops %.1f (fp32, %d threads, %lldx%lldx%lld, median of 9)\n", rates[4], threads,
               (long long)M, (long long)K, (long long)N);
    }
    if (do_bf16) { /* the same product with bf16 inputs; the first call creates the primitive */
        uint16_t *Ab = malloc((size_t)(M * K) * sizeof(uint16_t)), *Bb = malloc((size_t)(K * N) * sizeof(uint16_t));
        fsdp__cvt_f32_to_bf16(A, Ab, (size_t)(M * K));
        fsdp__cvt_f32_to_bf16(B, Bb, (size_t)(K * N));
        fsdp__gemm_bf16(0, 0, M, N, K, 1.0f, Ab, K, Bb, N, 0.0f, C, N);
        for (int r = 0; r < 9; r++) {
            double t0 = fsdp__now();
            for (int k = 0; k < 4; k++) fsdp__gemm_bf16(0, 0, M, N, K, 1.0f, Ab, K, Bb, N, 0.0f, C, N);
            double dt = fsdp__now() - t0;
            rates[r] = 4.0 * 2.0 * (double)(M * N * K) / dt / 1e9;
        }
        qsort(rates, 9, sizeof(double), cmp_d);
        printf("gemm_bf16_gflops %.1f (bf16 in, fp32 out, %d threads, %lldx%lldx%lld, median of 9, %s)", rates[4],
               threads, (long long)M, (long long)K, (long long)N,
               fsdp_gemm_native(FSDP_BF16) ? "native kernels" : "widened to fp32: no native bf16 here");
        if (do_f32) printf(" = %.2fx fp32", rates[4] / f32_rate);
        printf("\n");
        free(Ab);
        free(Bb);
    }
    free(A);
    free(B);
    free(C);
    return 0;
}
