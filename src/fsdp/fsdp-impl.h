/*
 * fsdp-impl.h - internal API of src/fsdp: units, the sharded model, the
 * buffer pool. Flat offsets live here and never leak out of src/fsdp/.
 *
 * A unit's life:
 *
 *   SHARDED --unshard()--> GATHERING --wait()--> UNSHARDED --reshard()--> SHARDED
 *      (forward: gather before the unit, reshard after it unless
 *       reshard_after_forward=0; backward: gather again, run backward,
 *       reduce-scatter grads into the grad shard, reshard)
 *   any --collective failure--> ERROR (only fsdp_model_free() leaves it)
 *
 * Training phase per unit: IDLE -> FORWARD -> PRE_BACKWARD -> POST_BACKWARD -> IDLE.
 */
#ifndef FSDP_FSDP_IMPL_H
#define FSDP_FSDP_IMPL_H

#include "core/core-impl.h"

enum fsdp__unit_state { UNIT_SHARDED, UNIT_GATHERING, UNIT_UNSHARDED, UNIT_ERROR };
enum fsdp__unit_phase { PHASE_IDLE, PHASE_FORWARD, PHASE_PRE_BACKWARD, PHASE_POST_BACKWARD };

/* A unit: the parameters gathered and reduced together. */
struct fsdp__unit {
    int index;
    struct fsdp_model *model;
    struct fsdp_module *module;   /* the unit's root module */
    struct fsdp__unit *parent;    /* enclosing unit, NULL for the root unit */
    int n_params;
    struct fsdp_param **params;   /* in flat order; never tied parameters */
    const char **param_fqns;      /* borrowed from params */
    int64_t *offsets;             /* flat offset of params[i] */
    int64_t numel_full, numel_padded, numel_shard;
    int reshard_after_forward;
    enum fsdp_mixed_precision mixed_precision; /* FULL until mixed precision exists */
    struct fsdp_unit_overrides overrides;      /* what the wrap policy overrode (plan) */
    float *summoned;              /* (numel_padded) fsdp_summon_full_params buffer, or NULL */
    /* one allocation: param shard | grad shard | optimizer state (k x numel_shard) */
    float *shard_mem;
    float *shard;                 /* (numel_shard) this rank's slice of the flat params */
    float *grad_shard;            /* (numel_shard) reduced, averaged gradient slice */
    float *state;                 /* (k, numel_shard) optimizer state, or NULL */
    float *full;                  /* (numel_padded) gathered params while not SHARDED */
    float *full_grad;             /* (numel_padded) gradient accumulator during backward */
    struct fsdp_comm_req *req;    /* the all-gather in flight (GATHERING) */
    enum fsdp__unit_state state_;
    enum fsdp__unit_phase phase;
    int n_slices;
    struct fsdp_optim_slice *slices; /* optimizer view of the shard, per decay run */
};

/* A pooled full-size buffer. */
struct fsdp__pool_buf {
    float *mem;
    int64_t cap;
    int in_use;
};

struct fsdp_model {
    struct fsdp_ctx *ctx;
    struct fsdp_module *root;
    int n_units;
    struct fsdp__unit *units;     /* pre-order: units[0] is the root unit */
    int n_pool, cap_pool;
    struct fsdp__pool_buf *pool;
    struct fsdp_optim *optim;     /* borrowed */
    /* fsdp_parallelize_model's config, for the state-dict code */
    enum fsdp_state_dict_type state_dict_type;
    int load_monolith_rank0_only;
    /* fsdp_summon_full_params: active, and how it ends */
    int summon_active, summon_writeback, summon_rank0_only;
};

/* ---- Layout only (shard.c), for the memory planner (plan.c) ---- */
/* The units fsdp_fully_shard would make for ctx->world (flat offsets,
 * padding, overrides) without allocating shards or installing hooks. Free
 * with fsdp_model_free (which also clears the parameters' fsdp_priv). */
enum fsdp_status fsdp__model_layout(struct fsdp_ctx *ctx, struct fsdp_module *root,
                                    const struct fsdp_shard_opts *opts, struct fsdp_model **out);

/* ---- Units ---- */
enum fsdp_status fsdp__unit_unshard(struct fsdp_ctx *ctx, struct fsdp__unit *u);
enum fsdp_status fsdp__unit_reshard(struct fsdp_ctx *ctx, struct fsdp__unit *u);
/* Releases every unit's full buffers (after an error or an eval forward). */
void fsdp__model_reshard_all(struct fsdp_ctx *ctx, struct fsdp_model *fm);
struct fsdp__unit *fsdp__model_unit_of(struct fsdp_model *fm, const char *fqn, int *param_index);

/* The hooks installed on every unit root module (unit.c). */
extern const struct fsdp_module_hooks fsdp__unit_hooks;
/* Allocates one block per unit: param shard | grad shard | k_state arrays,
 * keeping the current parameter values. */
enum fsdp_status fsdp__unit_alloc_shards(struct fsdp_ctx *ctx, struct fsdp__unit *u, int k_state);

/* Whether any unit is gathered or between forward and backward (summon and
 * init refuse to run then). Returns the first such unit, or NULL. */
struct fsdp__unit *fsdp__model_busy_unit(struct fsdp_model *fm);

/* ---- Pool ---- */
float *fsdp__pool_get(struct fsdp_model *fm, int64_t numel, const char *what);
void fsdp__pool_put(struct fsdp_model *fm, float *mem);

#endif
