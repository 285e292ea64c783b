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

/* The largest world a plan (fsdp_plan_memory_run, fsdp_plan_comm) lays a
 * model out for: 2^20 ranks; its per-rank tables stay small and quick. */
#define FSDP__PLAN_MAX_WORLD (1 << 20)

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
    enum fsdp_mixed_precision mixed_precision; /* resolved: the override or the model's (mixed.c) */
    struct fsdp_unit_overrides overrides;      /* what the wrap policy overrode (plan) */
    /* precision policy (mixed.c; all FSDP_F32 = 0 unless fsdp__mp_resolve set them) */
    enum fsdp_dtype param_dtype;   /* the all-gather's dtype and the values the compute sees */
    enum fsdp_dtype reduce_dtype;  /* the reduce-scatter's dtype */
    enum fsdp_dtype output_dtype;  /* tensors leaving the unit's modules: F32 (the composed step keeps the
                                      root's logits in compute_dtype: [Note: 16-bit model output]) */
    enum fsdp_dtype compute_dtype; /* set on the unit's modules (fsdp_module_set_compute_dtype) */
    float *summoned;              /* (numel_padded) fsdp_summon_full_params buffer, or NULL */
    /* one allocation: param shard (unless in the window) | optimizer state
     * (k x numel_shard) | shard_lp */
    float *shard_mem;
    float *shard;                 /* (numel_shard) this rank's slice of the flat params */
    float *grad_shard;            /* (numel_shard) reduced, averaged gradient slice, from its
                                     birth in backward to the optimizer step, else NULL ([Note:
                                     gradient shards born in backward], unit.c) */
    float *grad_own;              /* (numel_shard) the unit's own buffer for it, once needed;
                                     a grad_shard elsewhere is lent by the activation arena */
    int grad_lost;                /* this step's shard was in the arena when another reset it
                                     and could not move (the optimizer step refuses) */
    float *state;                 /* (k, numel_shard) optimizer state, or NULL */
    uint16_t *shard_lp;           /* (numel_shard) 16-bit copy of shard written by the optimizer
                                     ([Note: fused 16-bit copy], mixed.c), or NULL */
    int shard_lp_valid;           /* shard_lp == the cast of shard (cleared by every other writer:
                                     fsdp__model_shards_written) */
    int lp_direct;                /* the gather reads the 16-bit copy in place: shard_lp (a shard
                                     group of one) or win_lp (lp_win) */
    uint16_t *win_lp;             /* (numel_padded) a 16-bit unit's region of the model's 16-bit
                                     window, shard_lp its block there ([Note: 16-bit window],
                                     unit.c), or NULL */
    int lp_win;                   /* this gather reads win_lp in place (a barrier, no copy) */
    float *full;                  /* gathered params while not SHARDED: full_f32 floats of fp32
                                     values, then a 16-bit unit's staging area (mixed.c) */
    int64_t full_f32;             /* fp32 floats at the head of full for this gather: numel_padded
                                     (the flat layout), or in a training pass of a 16-bit unit only
                                     the eagerly widened parameters', end to end ([Note: lazy
                                     widening] in src/nn/precision.c) */
    int gather_lazy;              /* this gather is a 16-bit training pass's (lazy widening) */
    float *win_full;              /* (numel_padded) this unit's region of the model's shared
                                     window, its shard the rank's block there ([Note: shared
                                     window], unit.c), or NULL */
    int full_win;                 /* full is win_full: gathered in place (a barrier, no copy) */
    float *full_grad;             /* (numel_padded) gradient accumulator during backward */
    struct fsdp_comm_req *req;    /* the all-gather (or the window's barrier) in flight (GATHERING) */
    enum fsdp__unit_state state_;
    enum fsdp__unit_phase phase;
    int n_slices;
    struct fsdp_optim_slice *slices; /* optimizer view of the shard, per decay run */
    /* overlap ([Note: prefetch and overlap], unit.c) */
    int prefetched;               /* gathered ahead by a prefetch, its hook not yet run */
    struct fsdp_comm_req *rs_req; /* the reduce-scatter in flight (post-backward; a shard group
                                     of one: the all-reduce over the replicas), or NULL */
    struct fsdp_comm_req *ar_req; /* HYBRID's all-reduce of the result over the replicas in
                                     flight (started when rs_req completed), or NULL */
    void *rs_recv;                /* where both land (fsdp__mp_grad_recv) */
    float *rs_prev;               /* (numel_shard) the accumulated shard to add back, or NULL */
};

/* A pooled full-size buffer. */
struct fsdp__pool_buf {
    float *mem;
    int64_t cap;
    int in_use;
};

/* Dynamic loss scaling state (torch's GradScaler), see mixed.c. */
struct fsdp__scaler {
    struct fsdp_loss_scale_opts opts; /* opts.enabled == 0: scale 1, non-finite is an error */
    double scale;
    int64_t calls;    /* train steps attempted (the injection's step index) */
    int64_t clean;    /* consecutive finite steps since the last growth or skip */
    int64_t skipped;  /* steps skipped on overflow */
};

/* The split step's state between its calls ([Note: the split step], step.c):
 * a step opens at its first train-mode forward and closes at the optimizer
 * step. */
struct fsdp__step {
    int open;            /* a train-mode forward ran since the last optimizer step */
    int fwd_pending;     /* the last train-mode forward awaits its backward */
    int n_backward;      /* backwards in this step */
    int reduced;         /* one of them reduced into the gradient shards */
    int unsynced;        /* the last backward ran with gradient sync off */
    int sync_off;        /* fsdp_model_set_grad_sync(fm, 0) */
    struct fsdp_tensor out; /* the pending forward's output (shape and dtype; data in the arena) */
    float loss;          /* this rank's step loss: sum of value / accum of the losses */
    float loss_scale;    /* the loss scale of this step (1 without loss scaling) */
    double w0, fwd_s, bwd_s; /* comm wait at the start, time in forward + loss, in backward */
    size_t bwd_mark;     /* the arena's mark where the last backward began, and whether its */
    int bwd_lend;        /* gradient shards may be lent ([Note: gradient shards born in backward], unit.c) */
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
    int load_weights_only;        /* fsdp_model_load_weights: a folder's optimizer state, step
                                     count and loss scale are left as they are */
    /* fsdp_summon_full_params: active, and how it ends */
    int summon_active, summon_writeback, summon_rank0_only;
    /* the sharding strategy ([Note: sharding strategies], wrap.c): units shard
     * over shard_comm (shard_size ranks; NULL when 1) and all-reduce gradient
     * shards over rep_comm (rep_size replicas; NULL when 1). Each is ctx->comm
     * (borrowed) when it spans the world, else split from it and owned. */
    enum fsdp_sharding sharding;
    struct fsdp_comm *shard_comm, *rep_comm;
    int shard_rank, shard_size, rep_rank, rep_size;
    int own_shard_comm, own_rep_comm;
    /* gradient accumulation ([Note: gradient accumulation], step.c): no_sync
     * keeps each unit's full gradient across backward passes without reducing;
     * grad_accumulate adds the reduced gradient into the shard instead of
     * overwriting it. Both 0 outside fsdp_model_backward. */
    int no_sync, grad_accumulate;
    /* overlap ([Note: prefetch and overlap], unit.c): prefetch and defer
     * reduce-scatters when `overlap`; at most max_inflight units gathered or
     * gathering at once counting the one computing; in_forward/in_backward
     * are set by step.c around the passes (not during a recompute's forward
     * inside backward, which runs with in_forward 0) */
    int overlap, max_inflight, n_inflight, in_forward, in_backward;
    int lp_shard_copy; /* 16-bit units keep u->shard_lp (fsdp_shard_opts) */
    /* [Note: shared window] (unit.c): the shard group's window holding every
     * unit's shards (NULL: none), and whether a gather now may read it in
     * place (set by step.c around a training step's forward and backward) */
    void *win;
    size_t win_bytes;
    int win_pass;
    void *win_lp; /* [Note: 16-bit window] (unit.c): the 16-bit units' copies, or NULL */
    size_t win_lp_bytes;
    int *bwd_order;               /* (n_units) pre-backward order of the units */
    struct fsdp__unit *rs_last;   /* the unit whose reduce-scatter (rs_req) is still pending */
    struct fsdp__unit *ar_last;   /* the unit whose replica all-reduce (ar_req) is still pending */
    int64_t rep_deferred;         /* replica all-reduces a post-backward left in flight (tests) */
    struct fsdp__scaler scaler;   /* dynamic loss scaling (mixed.c) */
    struct fsdp__step step;       /* the split step (step.c) */
    int n_post_step, cap_post_step;
    struct fsdp__post_step_hook *post_step; /* (n_post_step) hooks.c, in registration order */
};

/* ---- Layout only (wrap.c), for the scale-out plan (commplan.c) ---- */
/* The units fsdp_fully_shard would make for ctx->world (flat offsets,
 * padding, overrides) without allocating shards or installing hooks. Free
 * with fsdp_model_free (which also clears the parameters' fsdp_priv). */
enum fsdp_status fsdp__model_layout(struct fsdp_ctx *ctx, struct fsdp_module *root,
                                    const struct fsdp_shard_opts *opts, struct fsdp_model **out);

/* ---- Sharding strategies (strategy.c) ---- */
/* Sets fm's strategy, shard_size/rank and rep_size/rank for `world` ranks
 * (`local`: ranks on this host, HYBRID_SHARD's default K; 0: the world).
 * Bad options are FSDP_ERR_INVALID naming the flag. COLLECTIVE: no. */
enum fsdp_status fsdp__sharding_layout(struct fsdp_ctx *ctx, const struct fsdp_shard_opts *o, int world,
                                       int rank, int local, struct fsdp_model *fm);
/* The layout for ctx's world plus the shard and replica communicators.
 * COLLECTIVE: yes (for HYBRID_SHARD). */
enum fsdp_status fsdp__sharding_comms(struct fsdp_ctx *ctx, const struct fsdp_shard_opts *o,
                                      struct fsdp_model *fm);
/* Frees the communicators fm owns. COLLECTIVE: yes when it owns any. */
void fsdp__sharding_free(struct fsdp_model *fm);

/* ---- Units ---- */
enum fsdp_status fsdp__unit_unshard(struct fsdp_ctx *ctx, struct fsdp__unit *u);
enum fsdp_status fsdp__unit_reshard(struct fsdp_ctx *ctx, struct fsdp__unit *u);
/* Releases every unit's full buffers (after an error or an eval forward). */
void fsdp__model_reshard_all(struct fsdp_ctx *ctx, struct fsdp_model *fm);
struct fsdp__unit *fsdp__model_unit_of(struct fsdp_model *fm, const char *fqn, int *param_index);

/* The hooks installed on every unit root module (unit.c). */
extern const struct fsdp_module_hooks fsdp__unit_hooks;
/* Allocates one block per unit: param shard | k_state arrays, keeping the
 * current parameter values. */
enum fsdp_status fsdp__unit_alloc_shards(struct fsdp_ctx *ctx, struct fsdp__unit *u, int k_state);
/* [Note: gradient shards born in backward] (unit.c): gives u its gradient
 * shard (u->grad_shard) if it has none yet this step; fsdp__model_grads_none
 * ends them all (the next step's first forward), fsdp__model_grads_keep moves
 * the ones the arena lent into the units' own buffers (a forward inside a
 * step, before the arena is reset). */
enum fsdp_status fsdp__unit_grad_birth(struct fsdp_ctx *ctx, struct fsdp__unit *u);
void fsdp__model_grads_none(struct fsdp_ctx *ctx, struct fsdp_model *fm);
enum fsdp_status fsdp__model_grads_keep(struct fsdp_ctx *ctx, struct fsdp_model *fm);
/* The gradients of optimizer slice sl of u (a run of its shard), in its gradient shard. */
static inline float *fsdp__slice_grad(const struct fsdp__unit *u, const struct fsdp_optim_slice *sl) {
    return u->grad_shard + (sl->param - u->shard);
}
/* [Note: shared window] (unit.c): lays every unit's shards of the shard
 * group out in one window of fm->shard_comm where its backend has one
 * (before fsdp__unit_alloc_shards); fsdp__model_window_free unmaps it. */
enum fsdp_status fsdp__model_window(struct fsdp_ctx *ctx, struct fsdp_model *fm);
void fsdp__model_window_free(struct fsdp_model *fm);
/* [Note: 16-bit window] (unit.c): the 16-bit units' regions for their
 * 16-bit copies in a second window (once, when the optimizer is attached and
 * the dtypes are known; before fsdp__unit_alloc_shards). COLLECTIVE: yes. */
enum fsdp_status fsdp__model_window_lp(struct fsdp_ctx *ctx, struct fsdp_model *fm);

/* Every writer of the parameter shards other than the optimizer step (init,
 * checkpoint loads, summon write-back) calls this: the units' 16-bit copies
 * ([Note: fused 16-bit copy], src/optim/optim.c) no longer match. */
void fsdp__model_shards_written(struct fsdp_model *fm);

/* Whether any unit is gathered or between forward and backward (summon and
 * init refuse to run then). Returns the first such unit, or NULL. */
struct fsdp__unit *fsdp__model_busy_unit(struct fsdp_model *fm);

/* ---- Mixed precision (mixed.c) ----
 * [Note: low-precision gather and reduce] A unit whose param_dtype is 16-bit
 * gathers into a pooled buffer of fsdp__mp_full_numel(u) floats: the fp32
 * full values (u->full_f32 floats) followed by the 16-bit staging area
 * (numel_padded elements). The fp32 part is the flat layout (numel_padded)
 * except in a training pass, where it holds only the parameters the layers
 * read in fp32, end to end: the others' fp32 values are never made there
 * ([Note: lazy widening] in src/nn/precision.c). Each rank casts its fp32 shard into its block of
 * the staging area, so by default no 16-bit copy of a unit's weights
 * outlives the gather (FSDP2's; on shm, ranks that share a 16-bit window
 * keep the copy there instead: [Note: 16-bit window] in unit.c). With the
 * model's lp_shard_copy each 16-bit unit also keeps u->shard_lp, which the
 * optimizer writes ([Note:
 * fused 16-bit copy] in src/optim/optim.c) and the gather sends instead of
 * casting; a shard group of one then has no staging area: it reads
 * shard_lp in place, casting the shard there first when the copy is stale
 * (a gather before the first optimizer step, after a load), so the 16-bit
 * values exist once, not in shard_lp and a pooled copy; without shard_lp it
 * has no staging area either: the layers round the values they read from the
 * shard ([Note: 16-bit values from the shard] in mixed.c). The all-gather
 * runs in place in the staging area in the 16-bit dtype (half the bytes),
 * and fsdp__mp_gather_finish widens it into the fp32 part
 * (what p->data shows) and leaves the 16-bit copy as p->priv->data_lp, which the
 * layers multiply with instead of casting the weight again
 * (fsdp__pdata_lp). The reduce-scatter needs no extra memory:
 * fsdp__mp_grad_send narrows the fp32 full gradient in place into its lower
 * half (element i's 2 bytes never reach an unread fp32 element), the
 * collective runs in reduce_dtype into the upper half of the fp32 gradient
 * shard (fsdp__mp_grad_recv; the shard is overwritten by the result anyway,
 * and an accumulated one was set aside first), and fsdp__mp_grad_land widens
 * the result in place. The result lives outside the full gradient, so the
 * full gradient is released as soon as the reduce-scatter completes, while
 * HYBRID's replica all-reduce still runs on the result ([Note: prefetch and
 * overlap], unit.c). A shard group of one all-reduces the narrowed full
 * gradient in place instead. A world of one takes the same roundings (so
 * that it computes what N ranks compute) and skips the collective. */
/* fp32 floats a gather of u widens into: numel_padded, or with lazy (a
 * training pass) the sum of its parameters that are not lp_reader. */
int64_t fsdp__mp_f32_numel(const struct fsdp__unit *u, int lazy);
/* Floats of pooled buffer a gather of u needs: u->full_f32, plus the 16-bit
 * staging area when param_dtype is BF16 / F16. */
int64_t fsdp__mp_full_numel(const struct fsdp__unit *u);

/* Resolves every unit's policy from the model-wide compute precision and
 * mixed_precision, or the unit's FSDP_OVR_MIXED_PRECISION override (FULL
 * there means fp32 compute too), and sets the compute dtype of the unit's
 * modules, parents first. Enables loss scaling when any unit computes in
 * FSDP_F16. */
enum fsdp_status fsdp__mp_resolve(struct fsdp_ctx *ctx, struct fsdp_model *fm, enum fsdp_dtype precision,
                                  enum fsdp_mixed_precision mp);
/* Casts u's shard into its block of u->full (see the note) and starts the
 * all-gather in param_dtype over comm, whose rank `rank` owns block `rank`
 * (*req NULL when comm is NULL or of size 1). With a valid 16-bit copy of
 * the shard (u->shard_lp_valid) it sends that instead of casting. A shard
 * group of one reads the copy in place (u->lp_direct), casting the shard
 * into it first when it is not valid (and marking it valid), or without a
 * copy casts nothing ([Note: 16-bit values from the shard]); so does a
 * training pass's gather from the 16-bit window (u->lp_win), followed by a
 * barrier of comm instead of the all-gather. COLLECTIVE: yes. */
enum fsdp_status fsdp__mp_gather_start(struct fsdp_comm *comm, int rank, struct fsdp__unit *u,
                                       struct fsdp_comm_req **req);
/* After the gather's wait: widens the gathered values into u->full's fp32
 * part and points every parameter at its values (data, data_lp); with
 * u->gather_lazy (a training pass), only the parameters that are not
 * lp_reader, packed, and the others get data NULL and data_stale ([Note:
 * lazy widening] in src/nn/precision.c). A shard group of one without
 * shard_lp rounds the values from the shard instead and the others point into it
 * (data_src). */
void fsdp__mp_gather_finish(struct fsdp__unit *u);
/* The shard group of one's case of it with the fp32 values at src (the shard,
 * or a summon's buffer: [Note: a forward while summoned] in unit.c): rounds
 * them into u->full (or, lazily, points lp_reader parameters at them). */
void fsdp__mp_finish_from(struct fsdp__unit *u, const float *src);
/* Narrows buf[0..n) to n 16-bit values of dt at bytes [0, 2n), in place
 * (nothing while measuring). */
void fsdp__mp_narrow_inplace(enum fsdp_dtype dt, float *buf, int64_t n);
void fsdp__mp_narrow_rows_inplace(enum fsdp_dtype dt, float *buf, int64_t rows, int64_t cols, int64_t ld);
/* Narrows u->full_grad in place to reduce_dtype (no-op for F32) and returns
 * the send buffer of the reduce-scatter (numel_padded elements). */
void *fsdp__mp_grad_send(struct fsdp__unit *u, int world);
/* [Note: gradient pre-division] A 16-bit reduction of `world` ranks'
 * gradients divides each by this power of two f before the collective
 * (the smallest doubling past sqrt(world) or off world's factors, as torch
 * FSDP's predivide factor: 2 at 2-5 ranks, 4 at 8) and the sum by
 * world / f after it, so that neither the summands underflow nor the sum
 * of fp16 gradients under a 65536 loss scale overflows at 3+ ranks. An
 * fp32 reduction divides once, after (f = 1). */
int fsdp__mp_predivide(enum fsdp_dtype reduce_dtype, int world);
/* Where the reduce-scatter of block `rank` lands: u->grad_shard for F32,
 * else the upper half of u->grad_shard (bytes [2n, 4n) of its 4n: numel_shard
 * 16-bit elements). */
void *fsdp__mp_grad_recv(struct fsdp__unit *u);
/* After the reduction's last wait: widens recv (fsdp__mp_grad_recv's upper
 * half of the shard, in place; or, for a shard group of one, the narrowed
 * full gradient) into u->grad_shard (no-op for F32). When the full gradient
 * is the shard (a world of one), rounds the shard through reduce_dtype
 * instead. */
void fsdp__mp_grad_land(struct fsdp__unit *u, const void *recv);
/* "DEFAULT", "PURE", "FULL" (the plan's text). */
const char *fsdp__mp_name(enum fsdp_mixed_precision mp);
/* The composed step's loss status over the ranks (loss.c, [Note: agreed
 * loss check]): loss_st, or an error naming the first rank whose loss
 * failed (micro-batch k). COLLECTIVE: yes. */
enum fsdp_status fsdp__loss_agree(struct fsdp_ctx *ctx, enum fsdp_status loss_st, int k);
/* st over the ranks (loss.c): this rank's own error where st failed, else an
 * error naming the first rank whose st failed, else FSDP_OK ([Note: agreed
 * preconditions], step.c). COLLECTIVE: yes. */
enum fsdp_status fsdp__status_agree(struct fsdp_ctx *ctx, enum fsdp_status st, const char *what);

/* The train step's loss scaling (step.c): the factor the loss gradient is
 * multiplied by (1 when disabled). */
float fsdp__scaler_scale(const struct fsdp_model *fm);
/* Test hook: at the configured step, makes this rank's first gradient shard
 * element +inf when this rank is the configured one. */
void fsdp__scaler_inject(struct fsdp_ctx *ctx, struct fsdp_model *fm);
/* After the global loss and (scaled) gradient norm: returns 1 if the step
 * must be skipped (scaling on and either is non-finite; the scale backs off),
 * else 0 with *gnorm unscaled, *unscale the factor the optimizer multiplies
 * gradients by (1/scale), and the scale grown after growth_interval clean
 * steps. Every rank sees the same loss and norm, so all decide alike. */
int fsdp__scaler_update(struct fsdp_model *fm, double loss, double *gnorm, float *unscale);

/* ---- Overlap (unit.c) ---- */
/* Completes the reductions still in flight (end of backward): the pending
 * replica all-reduce, then the last reduce-scatter and its all-reduce.
 * COLLECTIVE: yes. fsdp__model_drop_prefetched releases units that were
 * prefetched but never entered (end of a pass). */
enum fsdp_status fsdp__model_finish_reduce(struct fsdp_ctx *ctx, struct fsdp_model *fm);
void fsdp__model_drop_prefetched(struct fsdp_ctx *ctx, struct fsdp_model *fm);
/* Fills order[] with the units in the order their pre-backward hooks run
 * (a unit, then its child units last to first, each recursively). */
void fsdp__model_bwd_order(const struct fsdp_model *fm, int *order);
/* How many replica all-reduces post-backward hooks have left in flight
 * since fm was made (HYBRID_SHARD with overlap: all but the last of each
 * backward); what tests observe of the pipeline. */
int64_t fsdp__model_rep_deferred(const struct fsdp_model *fm);

/* ---- Buffers (buffers.c, [Note: buffers]) ---- */
/* The buffers below a module, in definition order (all, or the persistent
 * ones); b is malloc'd, the buffers borrowed. */
struct fsdp__buflist {
    int n, cap, persistent_only;
    struct fsdp_buffer **b;
};
enum fsdp_status fsdp__buffers_list(struct fsdp_ctx *ctx, struct fsdp_module *root, int persistent_only,
                                    struct fsdp__buflist *out);
void fsdp__buffers_list_free(struct fsdp__buflist *l);
size_t fsdp__buffer_bytes(const struct fsdp_buffer *b);
/* Every rank has the same buffers (names, dtypes, shapes, persistence);
 * else FSDP_ERR_INVALID naming the first that differs, on every rank.
 * COLLECTIVE: yes. */
enum fsdp_status fsdp__buffers_check(struct fsdp_ctx *ctx, struct fsdp_module *root);
/* Rank 0's values of every buffer below root reach every rank (each tagged
 * "buffer FQN"). COLLECTIVE: yes. */
enum fsdp_status fsdp__buffers_broadcast(struct fsdp_ctx *ctx, struct fsdp_module *root);

/* ---- Post-step hooks (hooks.c) ---- */
/* Runs every registered hook in order, each with its collectives tagged
 * "post-step hook FQN"; the first failure is returned naming the hook (a
 * summon the hook left open is ended first). The training step calls it
 * right after an applied optimizer update. COLLECTIVE: as the hooks. */
enum fsdp_status fsdp__run_post_step_hooks(struct fsdp_ctx *ctx, struct fsdp_model *fm);
void fsdp__post_step_hooks_free(struct fsdp_model *fm);

/* ---- Pool ---- */
float *fsdp__pool_get(struct fsdp_model *fm, int64_t numel, const char *what);
void fsdp__pool_put(struct fsdp_model *fm, float *mem);

/* ---- Checkpoints (src/fsdp/ckpt/) ----
 * ckpt/ckpt.c: shared helpers (agreement, paths, durable writes, the meta.json
 * seal, the atomic folder swap); ckpt/meta.c: meta.json's one reader (with
 * validation) and one writer; ckpt/sharded.c: the sharded save and load; ckpt/full.c: the
 * full safetensors file and Hugging Face GPT-2 import; ckpt/offline.c:
 * describe, verify and convert without a model. The notes [Note: sharded
 * layout], [Note: atomic folder] and [Note: sealed meta.json] are in ckpt.c. */
#define FSDP__META_NAME "meta.json"
#define FSDP__META_FORMAT "fsdp.c sharded checkpoint"
#define FSDP__LAYOUT_KEY "fsdp.linear_layout" /* "out,in" in our files; absent in HF files */
#define FSDP__BUFFERS_KEY "fsdp.buffers" /* full files: the buffers' FQNs, comma-separated */

struct fsdp__st_file;

/* meta.json, parsed and validated (ckpt/meta.c): each parameter's pieces
 * tile [0, numel) exactly, every byte range fits its file's size. The same
 * struct is what the writers fill for fsdp__meta_format: every string and
 * array in it is owned (malloc'd) and freed by fsdp__meta_free. */
struct fsdp__meta_range {
    int file;
    int64_t start, end;   /* element range of the flattened parameter */
    uint64_t b0, b1;      /* byte range of the parameter values in the file */
};
struct fsdp__meta_param {
    char *fqn;
    int ndim;
    int64_t shape[FSDP_MAX_DIMS], numel;
    int n_ranges;
    struct fsdp__meta_range *ranges; /* sorted by start */
};
/* A buffer of the checkpoint ([Note: buffers] in buffers.c): whole, in one file. */
struct fsdp__meta_buffer {
    char *fqn;
    enum fsdp_dtype dtype;  /* F32 or I64 */
    int ndim;
    int64_t shape[FSDP_MAX_DIMS], numel;
    int file;
    uint64_t b0, b1;        /* byte range in the file */
};
struct fsdp__meta_file {
    char *name;
    uint64_t bytes;
    int has_header_crc;  /* [Note: files of one save] (absent in older checkpoints) */
    uint32_t header_crc; /* CRC-32C of the file's first data_start bytes: its header */
};
struct fsdp__meta {
    char *dir;
    struct fsdp_ckpt_meta m;
    int n_state;
    char *state[4];
    int n_files;
    struct fsdp__meta_file *files;
    int n_params;
    struct fsdp__meta_param *params;
    int n_buffers;
    struct fsdp__meta_buffer *buffers;
};

/* Parses meta.json's text (NUL-terminated; name is for messages) into *mt,
 * checking the seal first when `sealed`. On failure *mt is freed and empty.
 * This is what the fuzz target fuzz/fuzz_ckpt_meta.c calls. */
enum fsdp_status fsdp__meta_parse_text(struct fsdp_ctx *ctx, const char *name, char *text, int sealed,
                                       struct fsdp__meta *mt);
/* Reads and parses dir/meta.json. */
enum fsdp_status fsdp__meta_load(struct fsdp_ctx *ctx, const char *dir, struct fsdp__meta *mt);
void fsdp__meta_free(struct fsdp__meta *mt);
/* The one writer: *mt (m's step, data_step, seed, optim_step, config and
 * model_json; state; files, whose count is "world"; params; buffers) as
 * meta.json's text, sealed, into *text (returned to the caller to free).
 * FSDP_ERR_INVALID if m.model_json is not a JSON object; name is for
 * messages. The struct need not pass the reader's checks: the producers
 * build it from what they wrote. */
enum fsdp_status fsdp__meta_format(struct fsdp_ctx *ctx, const char *name, const struct fsdp__meta *mt, char **text);
/* Zeroes *mt and allocates room for n_files files, n_params parameters and
 * n_buffers buffers (the counts start at 0), for a writer to fill. */
enum fsdp_status fsdp__meta_alloc(struct fsdp_ctx *ctx, struct fsdp__meta *mt, int n_files, int n_params,
                                  int n_buffers);
/* [Note: sealed meta.json]: fills in / checks the "crc32c" field. */
void fsdp__meta_seal(char *text);
enum fsdp_status fsdp__meta_check_seal(struct fsdp_ctx *ctx, const char *path, char *text);

/* Shared helpers (ckpt.c). */
/* The optimizer's state array names (exp_avg, ...) and their count k. */
const char *const *fsdp__ckpt_state_names(const struct fsdp_optim *opt, int *k);
/* Every rank returns the first failing rank's status and message. COLLECTIVE. */
enum fsdp_status fsdp__ckpt_agree(struct fsdp_ctx *ctx, enum fsdp_status st);
enum fsdp_status fsdp__ckpt_check_idle(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *what);
/* FSDP_ERR_STATE naming `what` while fsdp_summon_full_params is open: what
 * reads or writes the shards (an optimizer step, init, a checkpoint's save or
 * load) would see the summoned edits at once where the shard itself is
 * summoned ([Note: summoned in place], parallelize.c), and have them written
 * over at fsdp_summon_end elsewhere. */
enum fsdp_status fsdp__check_unsummoned(struct fsdp_ctx *ctx, const struct fsdp_model *fm, const char *what);
/* OK when v[0..n) (elements [first, first + n) of parameter `param`, read
 * from tensor `tensor` of the file `path`) are all finite; else
 * FSDP_ERR_FORMAT naming the file, the tensor, the value and its element
 * ([Note: finite weights on load], ckpt.c). */
enum fsdp_status fsdp__ckpt_finite(struct fsdp_ctx *ctx, const char *path, const char *tensor, const char *param,
                                   const float *v, int64_t n, int64_t first);
/* Rank's overlap [s, e) (flat) with parameter j of u; returns 0 if none. */
int fsdp__ckpt_overlap(const struct fsdp__unit *u, int rank, int j, int64_t *s, int64_t *e);
char *fsdp__path_join(const char *dir, const char *name); /* malloc'd */
void fsdp__ckpt_rank_file_name(char *buf, size_t n, int r, int world);
/* Writes text to path via path.tmp + fsync + rename. */
enum fsdp_status fsdp__write_durable(struct fsdp_ctx *ctx, const char *path, const char *text);
/* Rank 0: swaps the finished tmpdir in as dir ([Note: atomic folder]). A
 * failure before the swap removes tmpdir's meta.json (the save's own), so a
 * tmpdir still holding one after a failure is the previous checkpoint. */
enum fsdp_status fsdp__ckpt_commit_dir(struct fsdp_ctx *ctx, const char *dir, const char *tmpdir, int nfiles);
const char *fsdp__shape_str(char *buf, size_t n, int ndim, const int64_t *shape);

/* Full files (ckpt/full.c): whether f is Hugging Face GPT-2 rather than ours
 * ([Note: full file layouts]); HF Conv1D weights (in, out) to transpose;
 * HF keys that are buffers or the tied lm_head, not parameters. */
enum fsdp_status fsdp__full_is_hf(struct fsdp_ctx *ctx, const struct fsdp__st_file *f, int *hf);
int fsdp__is_conv1d(const char *fqn);
int fsdp__hf_ignorable(const char *name);

/* A checkpoint's rank files, opened lazily, each checked against
 * meta.json's size (ckpt/sharded.c). */
struct fsdp__fcache {
    struct fsdp__meta *mt;
    struct fsdp__st_file *f;
    int *open;
};
enum fsdp_status fsdp__fcache_open(struct fsdp_ctx *ctx, struct fsdp__meta *mt, struct fsdp__fcache *c);
void fsdp__fcache_close(struct fsdp__fcache *c);
enum fsdp_status fsdp__fcache_get(struct fsdp_ctx *ctx, struct fsdp__fcache *c, int i, struct fsdp__st_file **out);
/* Buffer b of the checkpoint, whole, into dst (numel elements of its dtype),
 * checked against meta.json. */
enum fsdp_status fsdp__fcache_read_buffer(struct fsdp_ctx *ctx, struct fsdp__fcache *c,
                                          const struct fsdp__meta_buffer *b, void *dst);
/* Elements [s, e) of stored tensor `tname` (parameter p's pieces) into dst. */
enum fsdp_status fsdp__fcache_read(struct fsdp_ctx *ctx, struct fsdp__fcache *c, const struct fsdp__meta_param *p,
                                   const char *tname, int64_t s, int64_t e, float *dst);

#endif
