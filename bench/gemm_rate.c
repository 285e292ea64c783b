/*
 * gemm_rate.c - measures this machine's fp32 GEMM rate through the same
 * wrapper the layers use (oneDNN), at GPT-2-like shapes, so step figures can
 * be quoted as a fraction of it: the library's fsdp_gemm_rate (the probe
 * fsdp-train's MFU uses), given a second per dtype. Prints
 * "gemm_gflops <rate>" (fp32), and with mode bf16 or all also
 * "gemm_bf16_gflops <rate>" (bf16 inputs, fp32 accumulation and output)
 * and the ratio. The rate is the fastest product's of about a second
 * ([Note: the fastest product] in src/nn/gemm_rate.c).
 * Usage: build/bench/gemm_rate [threads] [f32|bf16|all] [rows]   (default 2 f32 1024;
 *        fsdp-train's MFU probe uses 256 rows)
 */
#include "fsdp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 2;
    const char *mode = argc > 2 ? argv[2] : "f32";
    long rows = argc > 3 ? atol(argv[3]) : 1024;
    int do_f32 = strcmp(mode, "bf16") != 0, do_bf16 = strcmp(mode, "f32") != 0;
    if (strcmp(mode, "f32") && strcmp(mode, "bf16") && strcmp(mode, "all")) {
        fprintf(stderr, "gemm_rate: mode '%s' is not f32, bf16 or all\n", mode);
        return 2;
    }
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.comm = FSDP_COMM_SELF;
    co.threads = threads;
    struct fsdp_ctx *ctx;
    if (fsdp_ctx_create(&co, &ctx) != FSDP_OK) return 1;
    double f32_rate = 0, bf16_rate = 0;
    char shape[64];
    snprintf(shape, sizeof shape, "%ldx768x3072, fastest of 1 s", rows);
    if (do_f32) {
        if (fsdp_gemm_rate(ctx, FSDP_F32, rows, 1.0, &f32_rate) != FSDP_OK) return fprintf(stderr, "%s\n", fsdp_errmsg(ctx)), 1;
        printf("gemm_gflops %.1f (fp32, %d threads, %s)\n", f32_rate, threads, shape);
    }
    if (do_bf16) {
        if (fsdp_gemm_rate(ctx, FSDP_BF16, rows, 1.0, &bf16_rate) != FSDP_OK) return fprintf(stderr, "%s\n", fsdp_errmsg(ctx)), 1;
        printf("gemm_bf16_gflops %.1f (bf16 in, fp32 out, %d threads, %s, %s)", bf16_rate, threads, shape,
               fsdp_gemm_native(FSDP_BF16) ? "native kernels" : "widened to fp32: no native bf16 here");
        if (do_f32) printf(" = %.2fx fp32", bf16_rate / f32_rate);
        printf("\n");
    }
    fsdp_ctx_free(ctx);
    return 0;
}
