/*
 * mfu.h - model FLOP utilisation for fsdp-train (mfu.c): the job's peak
 * matrix-product rate, measured at start by a short GEMM probe on every rank
 * (fsdp_gemm_rate, in the run's precision) or given per rank with
 * --peak-gflops; fsdp-train divides the model's FLOP/s (the task's
 * train_flops_per_item x items/s) by it for the log's "mfu" and the summary.
 */
#ifndef FSDP_TRAIN_MFU_H
#define FSDP_TRAIN_MFU_H

#include <stddef.h>

#include "fsdp.h"
#include "options.h"

struct mfu_peak {
    double flops;       /* the job's peak FLOP/s: the ranks' rates summed */
    double rank_gflops; /* rank 0's rate, GFLOP/s */
    char how[160];      /* e.g. "GEMM probe fp32, 2 ranks" */
};

/* Fills pk from --peak-gflops (x world), else from each rank's probe of
 * about `seconds`, summed over the ranks (ranks sharing a host measure at
 * once, so each sees its share of the cores, as in training).
 * COLLECTIVE: yes (the sum). Ends the job on a failure. */
void mfu_peak_measure(struct fsdp_ctx *ctx, const struct opts *o, double seconds, struct mfu_peak *pk);

/* The fraction of the peak that flops_per_s of model FLOPs is; NAN when
 * either is unknown (not positive). */
double mfu_of(const struct mfu_peak *pk, double flops_per_s);

#endif
