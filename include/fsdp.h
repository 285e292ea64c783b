/*
 * fsdp.h - the public API of libfsdp: Fully Sharded Data Parallel training
 * (ZeRO stage 3) in C. Every rank keeps 1/N of each parameter, gradient and
 * optimizer state; a unit's full parameters are gathered just in time for its
 * forward and backward, then freed; gradients are reduce-scattered into shards.
 *
 * End-to-end example (error checks elided; see tools/fsdp-train.c for all of it):
 *
 *   struct fsdp_ctx *ctx;  struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
 *   fsdp_ctx_create(&co, &ctx);                         // MPI world, or a world of one
 *   struct fsdp_gpt_config cfg;  fsdp_gpt_config_preset("tiny", &cfg);
 *   struct fsdp_module *gpt;  fsdp_gpt_create(ctx, &cfg, &gpt);   // shapes only
 *   struct fsdp_shard_opts so = fsdp_shard_opts_default();       // a unit per Block
 *   struct fsdp_model *fm;  fsdp_fully_shard(ctx, gpt, &so, &fm);
 *   fsdp_model_init_params(ctx, fm, 1337);             // each rank fills its shard
 *   struct fsdp_optim_opts oo = fsdp_optim_opts_default();
 *   struct fsdp_optim *opt;  fsdp_optim_create(ctx, &oo, &opt);
 *   fsdp_model_attach_optim(ctx, fm, opt);
 *   for (int step = 0; step < steps; step++) {
 *       struct fsdp_step_result r;                      // loss, grad norm, ...
 *       fsdp_data_batch(data, step, B, T, rank, world, inputs, targets);
 *       fsdp_model_train_step(ctx, fm, inputs, targets, B_local, T,
 *                             fsdp_lr_at(&sched, step), clip, &r);
 *   }
 *   fsdp_model_free(fm); fsdp_module_free(gpt); fsdp_ctx_free(ctx);
 *
 * Conventions: functions return enum fsdp_status; on failure fsdp_errmsg(ctx)
 * names the problem. "COLLECTIVE: yes" means every rank must call it, in the
 * same order. Pointers are borrowed unless the comment says otherwise.
 */
#ifndef FSDP_H
#define FSDP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Status codes ------------------------------------------------------ */

#define FSDP_STATUS_LIST(X)                                   \
    X(OK, "ok")                                               \
    X(ERR_NOMEM, "out of memory")                             \
    X(ERR_INVALID, "invalid argument")                        \
    X(ERR_IO, "i/o error")                                    \
    X(ERR_FORMAT, "malformed input")                          \
    X(ERR_STATE, "operation not valid in this state")         \
    X(ERR_COMM, "collective communication failed")            \
    X(ERR_UNSUPPORTED, "not supported")                       \
    X(ERR_NUMERIC, "non-finite value")

enum fsdp_status {
#define FSDP_X_ENUM(name, str) FSDP_##name,
    FSDP_STATUS_LIST(FSDP_X_ENUM)
#undef FSDP_X_ENUM
    FSDP_STATUS_COUNT
};

/* A static string for a status code; never NULL. */
const char *fsdp_status_str(enum fsdp_status st);

/* ---- Data types -------------------------------------------------------- */

enum fsdp_dtype { FSDP_F32, FSDP_BF16, FSDP_F16, FSDP_I32, FSDP_U16, FSDP_U8 };

size_t fsdp_dtype_size(enum fsdp_dtype dt);
const char *fsdp_dtype_name(enum fsdp_dtype dt);

/* ---- Context ----------------------------------------------------------- */

enum fsdp_comm_kind {
    FSDP_COMM_AUTO, /* MPI when launched by mpirun, else a world of one */
    FSDP_COMM_MPI,  /* Open MPI, always (MPI_Init even without mpirun) */
    FSDP_COMM_SELF  /* a world of one, no MPI at all */
};

struct fsdp_ctx_opts {
    int threads;                 /* compute threads per rank; 0 = leave as is */
    enum fsdp_comm_kind comm;
    int verbose;                 /* 0 quiet, 1 info, 2 debug (to stderr) */
};

struct fsdp_ctx_opts fsdp_ctx_opts_default(void);

/* Per-rank context: the communicator, the error message, memory accounting
 * and the activation arena. *out is returned to the caller to free.
 * COLLECTIVE: yes (initialises the communicator). */
struct fsdp_ctx;
enum fsdp_status fsdp_ctx_create(const struct fsdp_ctx_opts *opts, struct fsdp_ctx **out);
/* COLLECTIVE: yes (finalises the communicator). fsdp_ctx_free(NULL) is a no-op. */
void fsdp_ctx_free(struct fsdp_ctx *ctx);
int fsdp_ctx_rank(const struct fsdp_ctx *ctx);
int fsdp_ctx_world(const struct fsdp_ctx *ctx);
/* The message of the last failure on this context (borrowed; "" if none). */
const char *fsdp_errmsg(const struct fsdp_ctx *ctx);
/* Ends every rank of the job at once with exit code `code` (MPI_Abort). */
void fsdp_ctx_abort(struct fsdp_ctx *ctx, int code)
#if defined(__GNUC__)
    __attribute__((noreturn))
#endif
    ;

/* ---- Memory accounting ------------------------------------------------- */

enum fsdp_mem_kind {
    FSDP_MEM_SHARD,     /* sharded params, grads, optimizer state */
    FSDP_MEM_FULL,      /* gathered full parameter/gradient buffers (pooled) */
    FSDP_MEM_ACT,       /* activation arena */
    FSDP_MEM_PARAM,     /* unsharded parameter storage (before sharding) */
    FSDP_MEM_OTHER,
    FSDP_MEM_KIND_COUNT
};

struct fsdp_mem_stats {
    size_t cur[FSDP_MEM_KIND_COUNT], peak[FSDP_MEM_KIND_COUNT];
    size_t cur_total, peak_total; /* all kinds together */
};

void fsdp_mem_get(const struct fsdp_ctx *ctx, struct fsdp_mem_stats *out);
/* Starts a new peak window: peaks become the current values. */
void fsdp_mem_reset_peak(struct fsdp_ctx *ctx);
/* Peak resident set size of this process in bytes (from the OS). */
size_t fsdp_peak_rss_bytes(void);

/* ---- Tensors and parameters ------------------------------------------- */

#define FSDP_MAX_DIMS 4

struct fsdp_tensor {
    void *data;
    enum fsdp_dtype dtype;
    int ndim;
    int64_t shape[FSDP_MAX_DIMS];
};

int64_t fsdp_tensor_numel(const struct fsdp_tensor *t);

enum fsdp_init_kind { FSDP_INIT_ZEROS, FSDP_INIT_ONES, FSDP_INIT_NORMAL };

struct fsdp_init {
    enum fsdp_init_kind kind;
    float std; /* FSDP_INIT_NORMAL: N(0, std^2) */
};

/* A parameter, always fp32 at the API. Its values are keyed by FQN: the init
 * value of element i is a pure function of (seed, fqn, i). */
struct fsdp_param {
    char name[48];       /* local name in its module, e.g. "weight" */
    char *fqn;           /* "transformer.h.0.attn.c_attn.weight"; set by fsdp_module_finalize */
    struct fsdp_module *owner;
    int ndim;
    int64_t shape[FSDP_MAX_DIMS]; /* global shape; Linear weights are (out, in) */
    int64_t numel;
    float *data;         /* full values while usable, NULL while sharded (shapes only) */
    float *grad;         /* full gradient accumulator during backward, else NULL */
    struct fsdp_param *tied_to; /* shares values and gradient with this parameter */
    struct fsdp_init init;
    int no_decay;        /* exempt from weight decay (biases, LayerNorm, embeddings) */
    int owns_data;       /* data was allocated by fsdp_module_materialize */
    void *fsdp_priv;     /* bookkeeping of the sharding layer */
};

/* ---- Modules ----------------------------------------------------------- */

struct fsdp_module;

/* A module type. forward/backward get the module, the context, and tensors.
 * Outputs: if out->data (din->data) is NULL the callee allocates it from the
 * activation arena (fsdp_arena_alloc); otherwise it writes there (overwrite).
 * backward accumulates (+=) into each parameter's grad and may leave din
 * untouched when din is NULL. Saved activations live in the arena. */
struct fsdp_module_ops {
    const char *type; /* e.g. "Linear", "Block"; used by wrap policies */
    enum fsdp_status (*forward)(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                const struct fsdp_tensor *in, struct fsdp_tensor *out);
    enum fsdp_status (*backward)(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                 const struct fsdp_tensor *dout, struct fsdp_tensor *din);
    void (*destroy)(struct fsdp_module *m); /* frees type-specific state; may be NULL */
};

/* Called around a module's forward and backward by the dispatchers below;
 * the sharding layer sets these on unit roots. */
struct fsdp_module_hooks {
    enum fsdp_status (*pre_forward)(void *data, struct fsdp_ctx *ctx);
    enum fsdp_status (*post_forward)(void *data, struct fsdp_ctx *ctx);
    enum fsdp_status (*pre_backward)(void *data, struct fsdp_ctx *ctx);
    enum fsdp_status (*post_backward)(void *data, struct fsdp_ctx *ctx);
};

struct fsdp_module {
    const struct fsdp_module_ops *ops;
    char name[48];              /* local name ("attn", "h.0" is "0" under "h") */
    char *fqn;                  /* "" for the root; set by fsdp_module_finalize */
    struct fsdp_module *parent;
    struct fsdp_module **children;
    int n_children, cap_children;
    struct fsdp_param **params; /* parameters owned directly by this module */
    int n_params, cap_params;
    const struct fsdp_module_hooks *hooks;
    void *hook_data;
    int checkpoint;             /* activation checkpointing requested */
    void *impl;                 /* type-specific state */
};

/* Creates a module of the given ops with a local name. *out is returned to the
 * caller; it is owned by its parent once added with fsdp_module_add_child. */
enum fsdp_status fsdp_module_create(struct fsdp_ctx *ctx, const struct fsdp_module_ops *ops,
                                    const char *name, struct fsdp_module **out);
/* Frees the module, its children and parameters. fsdp_module_free(NULL) is a no-op. */
void fsdp_module_free(struct fsdp_module *m);
/* Adds child (ownership passes to parent). */
enum fsdp_status fsdp_module_add_child(struct fsdp_ctx *ctx, struct fsdp_module *parent,
                                       struct fsdp_module *child);
/* Declares a parameter (shapes only; no storage). *out is borrowed (owned by m). */
enum fsdp_status fsdp_module_add_param(struct fsdp_ctx *ctx, struct fsdp_module *m, const char *name,
                                       int ndim, const int64_t *shape, struct fsdp_init init,
                                       int no_decay, struct fsdp_param **out);
/* Computes FQNs of every module and parameter below root (call once the tree is built). */
enum fsdp_status fsdp_module_finalize(struct fsdp_ctx *ctx, struct fsdp_module *root);

/* Visits every parameter below m in definition order (depth-first, own
 * parameters before children's). Tied parameters are visited once (the
 * first definition); return non-zero from fn to stop. */
int fsdp_module_foreach_param(struct fsdp_module *m,
                              int (*fn)(struct fsdp_param *p, void *ud), void *ud);
int64_t fsdp_module_numel(struct fsdp_module *m); /* tied counted once */
/* Finds a parameter by FQN below root, NULL if none. */
struct fsdp_param *fsdp_module_find_param(struct fsdp_module *root, const char *fqn);

/* Gives every parameter below m its own full storage, initialised from
 * (seed, fqn, index): the unsharded model, for tests and single-process use. */
enum fsdp_status fsdp_module_materialize(struct fsdp_ctx *ctx, struct fsdp_module *m, uint64_t seed);
/* Allocates a full gradient buffer for every materialized parameter and zeroes it. */
enum fsdp_status fsdp_module_zero_grad(struct fsdp_ctx *ctx, struct fsdp_module *m);

/* Dispatchers: run the hooks, then ops->forward / ops->backward. Modules call
 * their children through these, never through ops directly. */
enum fsdp_status fsdp_module_forward(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                     const struct fsdp_tensor *in, struct fsdp_tensor *out);
enum fsdp_status fsdp_module_backward(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                      const struct fsdp_tensor *dout, struct fsdp_tensor *din);

/* The activation arena: memory for outputs and saved activations of one step.
 * Returned memory is 64-byte aligned and valid until fsdp_arena_reset. */
void *fsdp_arena_alloc(struct fsdp_ctx *ctx, size_t bytes);
size_t fsdp_arena_mark(struct fsdp_ctx *ctx);
void fsdp_arena_release(struct fsdp_ctx *ctx, size_t mark);
void fsdp_arena_reset(struct fsdp_ctx *ctx);

/* ---- Built-in layers (src/nn) ----------------------------------------- */

struct fsdp_gpt_config {
    int n_layer, n_head, n_embd, vocab_size, block_size;
};

/* Presets: tiny, small, gpt2, gpt2-medium, gpt2-large, gpt2-xl. */
enum fsdp_status fsdp_gpt_config_preset(const char *name, struct fsdp_gpt_config *cfg);
/* Reads {"n_layer":..,"n_head":..,"n_embd":..,"vocab_size":..,"block_size":..}. */
enum fsdp_status fsdp_gpt_config_load(struct fsdp_ctx *ctx, const char *path,
                                      struct fsdp_gpt_config *cfg);
enum fsdp_status fsdp_gpt_config_validate(struct fsdp_ctx *ctx, const struct fsdp_gpt_config *cfg);

/* GPT-2 as in nanoGPT: forward takes tokens (B, T) I32 and gives logits
 * (B, T, vocab) F32. Built with shapes only. *out is returned to the caller. */
enum fsdp_status fsdp_gpt_create(struct fsdp_ctx *ctx, const struct fsdp_gpt_config *cfg,
                                 struct fsdp_module **out);
/* Forward FLOPs per token (matmuls, 2 per multiply-add), for FLOP/s figures;
 * a training step costs 3x this per token. */
double fsdp_gpt_flops_per_token(const struct fsdp_gpt_config *cfg, int T);

/* Softmax cross-entropy over logits (N, V) with targets (N): returns the mean
 * loss; if dlogits is non-NULL writes d(mean loss * scale)/dlogits there
 * (dlogits may equal logits). A target outside [0, V) is FSDP_ERR_INVALID. */
enum fsdp_status fsdp_cross_entropy(struct fsdp_ctx *ctx, const float *logits, const int32_t *targets,
                                    int64_t N, int64_t V, float scale, float *loss,
                                    float *dlogits);

/* ---- Collectives (src/comm) ------------------------------------------- */

enum fsdp_red_op { FSDP_SUM, FSDP_MAX, FSDP_MIN };

enum fsdp_coll {
    FSDP_COLL_ALLGATHER, FSDP_COLL_REDUCE_SCATTER, FSDP_COLL_ALLREDUCE,
    FSDP_COLL_BROADCAST, FSDP_COLL_BARRIER, FSDP_COLL_COUNT
};

struct fsdp_comm_stats {
    uint64_t calls[FSDP_COLL_COUNT];
    uint64_t bytes[FSDP_COLL_COUNT]; /* bytes this rank contributed (send side) */
    double wait_s[FSDP_COLL_COUNT];  /* time spent blocked in wait */
};

struct fsdp_comm;
struct fsdp_comm_req;

struct fsdp_comm *fsdp_ctx_comm(struct fsdp_ctx *ctx);
int fsdp_comm_rank(const struct fsdp_comm *c);
int fsdp_comm_size(const struct fsdp_comm *c);
const char *fsdp_comm_backend(const struct fsdp_comm *c);
void fsdp_comm_stats_get(const struct fsdp_comm *c, struct fsdp_comm_stats *out);

/* Asynchronous forms: start, then fsdp_comm_wait (which frees *req). Buffers
 * must stay valid until the wait. counts are in elements; `count` of an
 * all-gather / reduce-scatter is the per-rank block. In-place: allgather with
 * send == recv + rank*count, allreduce with send == recv.
 * COLLECTIVE: yes, for each start. */
enum fsdp_status fsdp_comm_allgather_start(struct fsdp_comm *c, const void *send, void *recv,
                                           size_t count, enum fsdp_dtype dt,
                                           struct fsdp_comm_req **req);
enum fsdp_status fsdp_comm_reduce_scatter_start(struct fsdp_comm *c, const void *send, void *recv,
                                                size_t count, enum fsdp_dtype dt,
                                                enum fsdp_red_op op, struct fsdp_comm_req **req);
enum fsdp_status fsdp_comm_allreduce_start(struct fsdp_comm *c, const void *send, void *recv,
                                           size_t count, enum fsdp_dtype dt, enum fsdp_red_op op,
                                           struct fsdp_comm_req **req);
enum fsdp_status fsdp_comm_broadcast_start(struct fsdp_comm *c, void *buf, size_t count,
                                           enum fsdp_dtype dt, int root, struct fsdp_comm_req **req);
enum fsdp_status fsdp_comm_barrier_start(struct fsdp_comm *c, struct fsdp_comm_req **req);
/* COLLECTIVE: no (completes a started one). req may be NULL (no-op). */
enum fsdp_status fsdp_comm_wait(struct fsdp_comm *c, struct fsdp_comm_req *req);

/* Blocking forms: start + wait. COLLECTIVE: yes. */
enum fsdp_status fsdp_comm_allgather(struct fsdp_comm *c, const void *send, void *recv,
                                     size_t count, enum fsdp_dtype dt);
enum fsdp_status fsdp_comm_reduce_scatter(struct fsdp_comm *c, const void *send, void *recv,
                                          size_t count, enum fsdp_dtype dt, enum fsdp_red_op op);
enum fsdp_status fsdp_comm_allreduce(struct fsdp_comm *c, const void *send, void *recv,
                                     size_t count, enum fsdp_dtype dt, enum fsdp_red_op op);
enum fsdp_status fsdp_comm_broadcast(struct fsdp_comm *c, void *buf, size_t count,
                                     enum fsdp_dtype dt, int root);
enum fsdp_status fsdp_comm_barrier(struct fsdp_comm *c);

/* ---- Sharding (src/fsdp) ---------------------------------------------- */

enum fsdp_wrap { FSDP_WRAP_SKIP, FSDP_WRAP_UNIT };

/* A wrap policy: asked for every module below the root (the root is always a
 * unit); returns FSDP_WRAP_UNIT to make the module a unit of its own. */
typedef enum fsdp_wrap (*fsdp_wrap_fn)(struct fsdp_module *m, void *ud);

/* Built-in: a unit for every module whose ops->type equals (const char *)ud. */
enum fsdp_wrap fsdp_wrap_by_type(struct fsdp_module *m, void *ud);

struct fsdp_shard_opts {
    fsdp_wrap_fn wrap;          /* default: fsdp_wrap_by_type with "Block" */
    void *wrap_ud;
    int reshard_after_forward;  /* default 1; the root unit never reshards after forward */
};

struct fsdp_shard_opts fsdp_shard_opts_default(void);

/* The sharded model: units, shards, pooled full buffers. */
struct fsdp_model;

/* Groups root's parameters into units and allocates this rank's shards
 * (zero-filled; call fsdp_model_init_params). Parameters must not be
 * materialized. Tied parameters land in one unit. *out is returned to the
 * caller; root stays owned by the caller and must outlive *out.
 * COLLECTIVE: no (pure layout; every rank computes the same). */
enum fsdp_status fsdp_fully_shard(struct fsdp_ctx *ctx, struct fsdp_module *root,
                                  const struct fsdp_shard_opts *opts, struct fsdp_model **out);
void fsdp_model_free(struct fsdp_model *fm);

/* Fills each rank's shard from (seed, fqn, index). COLLECTIVE: no. */
enum fsdp_status fsdp_model_init_params(struct fsdp_ctx *ctx, struct fsdp_model *fm, uint64_t seed);

int fsdp_model_n_units(const struct fsdp_model *fm);
/* Describes unit i: its root module's FQN ("" for the model root), its
 * parameters' FQNs (borrowed, n entries), numel_full, numel_padded, numel_shard. */
struct fsdp_unit_info {
    const char *fqn;
    int n_params;
    const char *const *param_fqns;
    int64_t numel_full, numel_padded, numel_shard;
};
void fsdp_model_unit_info(const struct fsdp_model *fm, int i, struct fsdp_unit_info *out);

/* Copies the full values of parameter `fqn` into dst (numel floats).
 * COLLECTIVE: yes (gathers its unit). */
enum fsdp_status fsdp_model_get_param(struct fsdp_ctx *ctx, struct fsdp_model *fm,
                                      const char *fqn, float *dst);
/* Same for its gradient shard gathered (after backward, before the step). COLLECTIVE: yes. */
enum fsdp_status fsdp_model_get_grad(struct fsdp_ctx *ctx, struct fsdp_model *fm,
                                     const char *fqn, float *dst);

/* Global L2 norms over all shards (padding is zero). COLLECTIVE: yes. */
enum fsdp_status fsdp_model_grad_norm(struct fsdp_ctx *ctx, struct fsdp_model *fm, double *out);
enum fsdp_status fsdp_model_param_norm(struct fsdp_ctx *ctx, struct fsdp_model *fm, double *out);

/* ---- Optimizer (src/optim) -------------------------------------------- */

enum fsdp_optim_kind { FSDP_OPTIM_ADAMW, FSDP_OPTIM_SGD };

struct fsdp_optim_opts {
    enum fsdp_optim_kind kind;
    float beta1, beta2, eps;   /* AdamW; defaults 0.9, 0.95, 1e-8 */
    float momentum;            /* SGD; default 0 */
    float weight_decay;        /* default 0.1 (decoupled for AdamW) */
    int decay_all;             /* 1: decay biases, LayerNorm, embeddings too (default 0) */
};

struct fsdp_optim_opts fsdp_optim_opts_default(void);

struct fsdp_optim;
enum fsdp_status fsdp_optim_create(struct fsdp_ctx *ctx, const struct fsdp_optim_opts *opts,
                                   struct fsdp_optim **out);
void fsdp_optim_free(struct fsdp_optim *opt);
/* Optimizer state floats per parameter element (AdamW 2, SGD 0 or 1). */
int fsdp_optim_state_per_elem(const struct fsdp_optim *opt);
int64_t fsdp_optim_step_count(const struct fsdp_optim *opt);

/* One contiguous run of a shard: n elements sharing one decay setting.
 * state points at fsdp_optim_state_per_elem(opt) arrays of n floats, each
 * `state_stride` floats apart. */
struct fsdp_optim_slice {
    float *param, *grad, *state;
    int64_t n, state_stride;
    int decay;
};
/* Updates the slices with learning rate lr, gradients multiplied by grad_scale
 * first (clipping). Advances the step count by one. COLLECTIVE: no. */
void fsdp_optim_step(struct fsdp_optim *opt, const struct fsdp_optim_slice *slices, int n_slices,
                     float lr, float grad_scale);

/* The factor that clips a gradient of norm `norm` to `max_norm` (1 if no clip
 * is needed or max_norm <= 0). */
float fsdp_clip_scale(double norm, double max_norm);

enum fsdp_lr_kind { FSDP_LR_CONSTANT, FSDP_LR_COSINE };
struct fsdp_lr_sched {
    enum fsdp_lr_kind kind;
    float lr, min_lr;     /* peak and floor (cosine decays to min_lr) */
    int64_t warmup, total; /* linear warmup steps; total steps */
};
float fsdp_lr_at(const struct fsdp_lr_sched *s, int64_t step);

/* ---- Training step (src/fsdp) ----------------------------------------- */

/* Binds the optimizer to the model's shards, allocating its state next to
 * them. COLLECTIVE: no. */
enum fsdp_status fsdp_model_attach_optim(struct fsdp_ctx *ctx, struct fsdp_model *fm,
                                         struct fsdp_optim *opt);

struct fsdp_step_result {
    double loss;       /* mean over the global batch */
    double grad_norm;  /* global, before clipping */
    double param_norm; /* global, after the update */
    double forward_s, backward_s, update_s; /* this rank's time in each phase
                                               (forward includes the loss; update
                                               includes the norms) */
};

/* One training step on this rank's share of the global batch: inputs and
 * targets are (B_local, T) token ids. Runs forward, loss, backward (gathers
 * and reduce-scatters by unit), global grad norm, clipping to `clip` (<= 0:
 * none) and the optimizer update with `lr`. COLLECTIVE: yes. */
enum fsdp_status fsdp_model_train_step(struct fsdp_ctx *ctx, struct fsdp_model *fm,
                                       const int32_t *inputs, const int32_t *targets, int B, int T,
                                       float lr, float clip, struct fsdp_step_result *res);

/* Forward only: logits (B, T, vocab) into the arena (valid until the next
 * step). Gathers and frees units as in training. COLLECTIVE: yes. */
enum fsdp_status fsdp_model_forward(struct fsdp_ctx *ctx, struct fsdp_model *fm,
                                    const int32_t *inputs, int B, int T, float **logits);

/* ---- Data (src/io) ---------------------------------------------------- */

struct fsdp_data;

/* Opens a token source: an llm.c token file (256 int32 header, magic
 * 20240520, uint16 tokens), a raw uint16 .bin (nanoGPT), or any other file as
 * byte-level text (vocab 256). Every token must be < vocab_size.
 * *out is returned to the caller to free. COLLECTIVE: no. */
enum fsdp_status fsdp_data_open(struct fsdp_ctx *ctx, const char *path, int vocab_size,
                                struct fsdp_data **out);
/* The built-in synthetic corpus (byte-level text made from `seed`); its loss
 * floor in nats per token is given by fsdp_data_loss_floor. */
enum fsdp_status fsdp_data_synthetic(struct fsdp_ctx *ctx, uint64_t seed, size_t n_bytes,
                                     struct fsdp_data **out);
void fsdp_data_free(struct fsdp_data *d);
size_t fsdp_data_ntokens(const struct fsdp_data *d);
int fsdp_data_is_text(const struct fsdp_data *d);
/* Entropy floor of the source in nats per token, or a negative value if unknown. */
double fsdp_data_loss_floor(const struct fsdp_data *d);
/* This rank's share of global batch `step`: sequence i (of B global) is the
 * T+1 tokens starting at (step*B + i)*T, wrapping at the end; rank r takes
 * sequences [r*B/world, (r+1)*B/world). inputs/targets are (B/world, T). */
void fsdp_data_batch(const struct fsdp_data *d, int64_t step, int B, int T, int rank, int world,
                     int32_t *inputs, int32_t *targets);

#ifdef __cplusplus
}
#endif
#endif /* FSDP_H */
