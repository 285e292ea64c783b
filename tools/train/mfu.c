/*
 * mfu.c - the peak matrix-product rate behind fsdp-train's MFU (see mfu.h).
 * MFU = model FLOPs per second (6 N_matmul + 12 L T C per token for the GPT,
 * 3x the forward's convolution and linear FLOPs per image for the image
 * models: the task's train_flops_per_item) / the job's peak, the peak being
 * what the layers' own GEMM reaches on this machine in the run's precision.
 */
#include "mfu.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "task.h"

void mfu_peak_measure(struct fsdp_ctx *ctx, const struct opts *o, double seconds, struct mfu_peak *pk) {
    memset(pk, 0, sizeof *pk);
    int world = fsdp_ctx_world(ctx);
    if (o->peak_gflops > 0) {
        pk->rank_gflops = o->peak_gflops;
        pk->flops = o->peak_gflops * 1e9 * world;
        snprintf(pk->how, sizeof pk->how, "--peak-gflops %g per rank, %d rank%s", o->peak_gflops, world,
                 world == 1 ? "" : "s");
        return;
    }
    enum fsdp_dtype dt;
    if (fsdp_precision_parse(ctx, o->precision, &dt) != FSDP_OK) fail_all("--precision: %s", fsdp_errmsg(ctx));
    double g = 0;
    /* 256 tokens: a product of about 1.2 GFLOP, so a short probe still times several */
    if (fsdp_gemm_rate(ctx, dt, 256, seconds, &g) != FSDP_OK) fail_rank("GEMM probe: %s", fsdp_errmsg(ctx));
    float mine = (float)g, sum = mine;
    if (fsdp_comm_allreduce(fsdp_ctx_comm(ctx), &mine, &sum, 1, FSDP_F32, FSDP_SUM) != FSDP_OK)
        fail_rank("GEMM probe: %s", fsdp_errmsg(ctx));
    pk->rank_gflops = g;
    pk->flops = (double)sum * 1e9;
    snprintf(pk->how, sizeof pk->how, "GEMM probe %s%s, %d rank%s", dt == FSDP_F32 ? "fp32" : dt == FSDP_BF16 ? "bf16" : "fp16",
             dt == FSDP_F32 || fsdp_gemm_native(dt) ? "" : " (widened)", world, world == 1 ? "" : "s");
}

double mfu_of(const struct mfu_peak *pk, double flops_per_s) {
    return pk->flops > 0 && flops_per_s > 0 && isfinite(flops_per_s) ? flops_per_s / pk->flops : NAN;
}
