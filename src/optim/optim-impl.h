/*
 * optim-impl.h - internal API of src/optim: the optimizer's hidden state as
 * the sharding layer (which decides decay per slice) and the checkpoint code
 * (which saves and restores the step count) need to see it.
 * optim/ touches only the local shards it is handed: no communication.
 */
#ifndef FSDP_OPTIM_IMPL_H
#define FSDP_OPTIM_IMPL_H

#include "core/core-impl.h"

/* ---- Options ---- */
/* Whether the caller should decay every slice (opts.decay_all): optim_step
 * itself only reads each slice's `decay`. */
int fsdp__optim_decay_all(const struct fsdp_optim *opt);
/* The options the optimizer was created with (borrowed, owned by opt). */
const struct fsdp_optim_opts *fsdp__optim_opts(const struct fsdp_optim *opt);

/* ---- Parameter groups (fsdp_optim_add_group) ---- */
/* The group registering `fqn` (exact name), 0 if none. */
int fsdp__optim_group_of(const struct fsdp_optim *opt, const char *fqn);
/* Name i of group `group` (borrowed), NULL past the end. */
const char *fsdp__optim_group_name(const struct fsdp_optim *opt, int group, int i);
/* Whether group `group` is frozen now (fsdp_optim_group_set); 0 for group 0
 * and out-of-range groups. The sharding layer zeroes a frozen group's
 * gradient shard slices, optim_step leaves its slices alone. */
int fsdp__optim_group_frozen(const struct fsdp_optim *opt, int group);

/* ---- Norms ---- */
/* Sum of x[i]^2 in double, per chunk of 8192 elements (vectorized), the
 * chunks added in order: the same bits for any thread count, and the same
 * as a slice's fused sumsq ([Note: fused 16-bit copy] in optim.c). */
double fsdp__sumsq(const float *x, int64_t n);

/* ---- Step count (checkpoints) ---- */
/* Sets the number of steps taken; the next fsdp_optim_step uses step + 1 for
 * AdamW's bias correction, and SGD treats the momentum buffer as empty only
 * when step is 0. */
void fsdp__optim_set_step_count(struct fsdp_optim *opt, int64_t step);

#endif
