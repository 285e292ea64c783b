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
#include <stdio.h>

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

enum fsdp_dtype { FSDP_F32, FSDP_BF16, FSDP_F16, FSDP_I32, FSDP_U16, FSDP_U8, FSDP_I64 };

size_t fsdp_dtype_size(enum fsdp_dtype dt);
const char *fsdp_dtype_name(enum fsdp_dtype dt);
/* 1 if matrix products with 16-bit inputs of dt run on this CPU's native
 * kernels (bf16 through oneDNN where the CPU has bf16 instructions: AMX or
 * AVX512-BF16), 0 if they are computed as fp32 products of the widened
 * inputs (fp16 always; bf16 on AVX2, on AVX-512 without BF16, whose
 * emulated bf16 kernels run slower than fp32's, or with
 * FSDP_GEMM_BF16=widen): same results up to summation order, fp32 speed.
 * 1 for FSDP_F32. */
int fsdp_gemm_native(enum fsdp_dtype dt);
/* This machine's GEMM rate in GFLOP/s (2 FLOPs per multiply-add) through
 * the layers' own product for dt (FSDP_F32; FSDP_BF16 or FSDP_F16: 16-bit
 * inputs, fp32 accumulation, native or widened as fsdp_gemm_native says), on
 * the context's threads: an (M x 768) @ (768 x 3072) product (an MLP
 * projection of GPT-2 124M over M tokens, 1 <= M <= 65536) repeated for about
 * `seconds` (at least 2 timed products, after an untimed first one);
 * *gflops is the fastest one's rate. For model FLOP utilisation (fsdp-train's
 * mfu, M 256) and benchmarks (bench/gemm_rate, M 1024). Another dtype, M or
 * seconds outside [0, 3600] is FSDP_ERR_INVALID. COLLECTIVE: no. */
struct fsdp_ctx;
enum fsdp_status fsdp_gemm_rate(struct fsdp_ctx *ctx, enum fsdp_dtype dt, int64_t M, double seconds, double *gflops);

/* ---- Context ----------------------------------------------------------- */

enum fsdp_comm_kind {
    FSDP_COMM_AUTO, /* under mpirun: SHM if 2+ ranks all on one host, else MPI;
                       without mpirun a world of one */
    FSDP_COMM_MPI,  /* Open MPI, always (MPI_Init even without mpirun) */
    FSDP_COMM_SELF, /* a world of one, no MPI at all */
    FSDP_COMM_SHM   /* shared memory between the ranks of one host (MPI only
                       starts the job); an error if the ranks span hosts */
};

struct fsdp_ctx_opts {
    int threads;                 /* compute threads per rank; 0 = leave as is */
    enum fsdp_comm_kind comm;
    int verbose;                 /* 0 quiet, 1 info, 2 debug (to stderr) */
};

struct fsdp_ctx_opts fsdp_ctx_opts_default(void);

/* The library's FSDP_* environment variables (README.md lists them): each
 * unset, empty, or a value it takes in full. FSDP_ERR_INVALID for the first
 * that is not, with "environment variable NAME='value': expected ..." in
 * msg (cap bytes; msg may be NULL). fsdp_ctx_create makes the same check
 * first (printing that line to stderr); programs call it before anything
 * else to report a bad variable their own way. The library never exits over
 * a variable. COLLECTIVE: no. */
enum fsdp_status fsdp_env_check(char *msg, size_t cap);

/* Per-rank context: the communicator, the error message, memory accounting
 * and the activation arena. *out is returned to the caller to free.
 * FSDP_ERR_INVALID if an environment variable is refused (fsdp_env_check).
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
/* The shared memory among this process's resident pages now, in bytes (the
 * OS's RssShmem; 0 where it does not say): the shared windows and the
 * collectives' segment, which every rank of a host maps and each counts in
 * its own RSS. */
size_t fsdp_shared_rss_bytes(void);

/* ---- Tensors and parameters ------------------------------------------- */

#define FSDP_MAX_DIMS 4

/* How a tensor's values lie in memory. PLAIN: row-major over shape (NCHW
 * for images). BLOCKED16: a 4-D (N, C, H, W) tensor with C a multiple of 16
 * stored as (N, C/16, H, W, 16), oneDNN's nChw16c: the layout its
 * convolutions run on, so that a chain of vision layers passes activations
 * on without converting them at every layer ([Note: blocked activations] in
 * src/nn/conv.c). The same number of values, the same bytes. Modules that
 * take BLOCKED16 say so; every other one refuses it with an error naming
 * the module. A zeroed tensor is PLAIN.
 * ROWS16: row-major over shape, each row of the last dimension starting a
 * multiple of 16 elements after the one before (row stride
 * fsdp_rows16_stride(last); the gaps hold nothing). The library makes it
 * for one tensor, the model's 16-bit output gradient that a bias-free
 * Linear's backward takes as it is ([Note: padded rows] in src/fsdp/step.c):
 * oneDNN's 16-bit products run up to 1.8x faster over rows that start at
 * aligned addresses. */
enum fsdp_layout { FSDP_LAYOUT_PLAIN, FSDP_LAYOUT_BLOCKED16, FSDP_LAYOUT_ROWS16 };
/* The row stride, in elements, of a ROWS16 tensor whose last dimension is n. */
int64_t fsdp_rows16_stride(int64_t n);

struct fsdp_tensor {
    void *data;
    enum fsdp_dtype dtype;
    int ndim;
    int64_t shape[FSDP_MAX_DIMS];
    enum fsdp_layout layout;
};

int64_t fsdp_tensor_numel(const struct fsdp_tensor *t);

enum fsdp_init_kind { FSDP_INIT_ZEROS, FSDP_INIT_ONES, FSDP_INIT_NORMAL };

struct fsdp_init {
    enum fsdp_init_kind kind;
    float std; /* FSDP_INIT_NORMAL: N(0, std^2) */
};

/* A parameter, always fp32 at the API. Its values are keyed by FQN: the init
 * value of element i is a pure function of (seed, fqn, i). */
struct fsdp__param_priv; /* the library's bookkeeping of a parameter (not API) */

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
    struct fsdp__param_priv *priv; /* set by fsdp_module_add_param, owned by the library: the
                                      sharding layer's and the built-in layers' bookkeeping */
};

/* A buffer: a non-trainable tensor of a module, named by FQN like a
 * parameter (batch norm's running_mean, running_var and num_batches_tracked,
 * a queue, a counter). Buffers are never sharded: every rank holds the full
 * values, in their own dtype (FSDP_F32 or FSDP_I64) whatever the mixed
 * precision. Storage is allocated and initialised by fsdp_module_add_buffer. */
struct fsdp_buffer {
    char name[48];           /* local name in its module, e.g. "running_mean" */
    char *fqn;               /* "layer1.0.bn1.running_mean"; set by fsdp_module_finalize */
    struct fsdp_module *owner;
    enum fsdp_dtype dtype;   /* FSDP_F32 or FSDP_I64 */
    int ndim;                /* 0 for a scalar (numel 1) */
    int64_t shape[FSDP_MAX_DIMS];
    int64_t numel;
    void *data;              /* numel values, owned by the buffer */
    struct fsdp_init init;   /* FSDP_INIT_ZEROS or FSDP_INIT_ONES */
    int persistent;          /* part of state dicts and checkpoints (PyTorch's persistent) */
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

struct fsdp__module_priv; /* the library's bookkeeping of a module (not API) */

struct fsdp_module {
    const struct fsdp_module_ops *ops;
    char name[48];              /* local name ("attn", "h.0" is "0" under "h") */
    char *fqn;                  /* "" for the root; set by fsdp_module_finalize */
    struct fsdp_module *parent;
    struct fsdp_module **children;
    int n_children;
    struct fsdp_param **params; /* parameters owned directly by this module */
    int n_params;
    int checkpoint;             /* activation checkpointing: forward keeps only its input,
                                   backward recomputes the forward (module.c) */
    void *impl;                 /* type-specific state */
    enum fsdp_dtype compute_dtype; /* inputs of this module's own matrix products:
                                      FSDP_F32 (default), FSDP_BF16 or FSDP_F16;
                                      see fsdp_module_set_compute_dtype */
    struct fsdp_buffer **buffers; /* buffers owned directly by this module */
    int n_buffers;
    int training;               /* 1 (default) in train mode, 0 in eval mode:
                                   fsdp_module_set_training */
    int fp32_params;            /* its parameters stay fp32 under mixed precision: when the
                                   units compute in 16 bits, sharding makes it a wholly fp32
                                   unit of its own unless the wrap policy overrides its
                                   mixed precision (set by BatchNorm2d, as PyTorch's
                                   autocast and FSDP keep batch norm in fp32) */
    struct fsdp__module_priv *priv; /* set by fsdp_module_create, owned by the library: array
                                       capacities, the sharding layer's hooks, the saved input
                                       of activation checkpointing */
};

/* Creates a module of the given ops with a local name. *out is returned to the
 * caller; it is owned by its parent once added with fsdp_module_add_child. */
enum fsdp_status fsdp_module_create(struct fsdp_ctx *ctx, const struct fsdp_module_ops *ops,
                                    const char *name, struct fsdp_module **out);
/* Frees the module, its children and parameters. fsdp_module_free(NULL) is a no-op. */
void fsdp_module_free(struct fsdp_module *m);
/* Adds child (ownership passes to parent). A child that already has a
 * parent, or that is parent itself or one of its ancestors, is
 * FSDP_ERR_INVALID. */
enum fsdp_status fsdp_module_add_child(struct fsdp_ctx *ctx, struct fsdp_module *parent,
                                       struct fsdp_module *child);
/* Declares a parameter (shapes only; no storage). *out is borrowed (owned by m).
 * A shape of more than 2^48 elements is FSDP_ERR_INVALID (so are a unit's
 * parameters together, at fsdp_fully_shard). */
enum fsdp_status fsdp_module_add_param(struct fsdp_ctx *ctx, struct fsdp_module *m, const char *name,
                                       int ndim, const int64_t *shape, struct fsdp_init init,
                                       int no_decay, struct fsdp_param **out);
/* Declares a buffer of `dtype` (FSDP_F32 or FSDP_I64) and shape (ndim 0: a
 * scalar) on m, allocated and filled per init (ZEROS or ONES). *out is
 * borrowed (owned by m); out may be NULL. */
enum fsdp_status fsdp_module_add_buffer(struct fsdp_ctx *ctx, struct fsdp_module *m, const char *name,
                                        enum fsdp_dtype dtype, int ndim, const int64_t *shape,
                                        struct fsdp_init init, int persistent, struct fsdp_buffer **out);
/* Visits every buffer below m in definition order (own before children's);
 * return non-zero from fn to stop. */
int fsdp_module_foreach_buffer(struct fsdp_module *m, int (*fn)(struct fsdp_buffer *b, void *ud), void *ud);
/* Finds a buffer by FQN below root, NULL if none. */
struct fsdp_buffer *fsdp_module_find_buffer(struct fsdp_module *root, const char *fqn);
/* Train mode (on = 1, the default) or eval mode (on = 0) for m and every
 * module below it, as PyTorch's Module.train(on). */
void fsdp_module_set_training(struct fsdp_module *m, int on);

/* Computes FQNs of every module, parameter and buffer below root (call once the tree is built). */
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

/* Time by module ([Note: module profile], src/nn/profile.c). While a context
 * collects, every dispatch above adds to one entry per module path, its numeric
 * parts folded to '*' ("transformer.h.*.attn.c_attn": the layers of a stack
 * share an entry, their calls counted): the module's self time (its own
 * forward or backward less its children's dispatches) and its FSDP hooks'
 * time (a unit's pre- and post-hooks: the gather and its casts, the
 * reduce-scatter, waits for them). A
 * checkpointed module's recompute is part of its backward, its children's
 * forwards in it count as their forward calls. The optimizer step
 * and anything else outside the dispatchers is not in them. One thread per
 * context, as the dispatchers. */
struct fsdp_profile_entry {
    const char *path, *type; /* folded FQN ("(root)" for the root), ops->type */
    long fwd_calls, bwd_calls;
    double fwd_s, bwd_s; /* self time, seconds */
    double hooks_s;      /* the module's pre- and post-hooks, forward and backward */
};
/* on: collect from now (after a pause, adding to the entries); 0: pause. */
void fsdp_profile_enable(struct fsdp_ctx *ctx, int on);
void fsdp_profile_clear(struct fsdp_ctx *ctx); /* no entries; collecting or not as before */
/* The entries in order of first call (*n of them; valid until the next call
 * that collects, a clear or fsdp_ctx_free). */
const struct fsdp_profile_entry *fsdp_profile_entries(const struct fsdp_ctx *ctx, int *n);
/* A table of the entries, the most time first: calls and milliseconds per
 * step over `steps` steps (0: totals). */
void fsdp_profile_print(const struct fsdp_ctx *ctx, FILE *f, int steps);

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
/* Reads {"n_layer":..,"n_head":..,"n_embd":..,"vocab_size":..,"block_size":..}:
 * the one JSON object of the file, with nothing but white space after it (a
 * second object, other bytes or a NUL byte is FSDP_ERR_FORMAT naming the
 * file and the byte offset). */
enum fsdp_status fsdp_gpt_config_load(struct fsdp_ctx *ctx, const char *path,
                                      struct fsdp_gpt_config *cfg);
/* Every field positive and at most: n_layer 4096, n_head 4096, n_embd 131072,
 * vocab_size 16777216, block_size 1048576; n_embd divisible by n_head. */
enum fsdp_status fsdp_gpt_config_validate(struct fsdp_ctx *ctx, const struct fsdp_gpt_config *cfg);

/* GPT-2 as in nanoGPT: forward takes tokens (B, T) I32 and gives logits
 * (B, T, vocab) F32. Built with shapes only. *out is returned to the caller. */
enum fsdp_status fsdp_gpt_create(struct fsdp_ctx *ctx, const struct fsdp_gpt_config *cfg,
                                 struct fsdp_module **out);
/* Forward FLOPs per token (matmuls, 2 per multiply-add), for FLOP/s figures;
 * a training step costs 3x this per token. */
double fsdp_gpt_flops_per_token(const struct fsdp_gpt_config *cfg, int T);
/* Decoding with a cache of keys and values: gives every attention layer of
 * the GPT `root` room for cap positions (1..block_size) of B sequences
 * (2 * B * cap * n_embd floats a layer, allocated here; B = cap = 0 frees
 * it, as does freeing the module). Then each forward of root, which must run
 * in eval mode (fsdp_module_set_training(root, 0); a train-mode forward is
 * FSDP_ERR_STATE), takes tokens (B, n) at the positions after those it has
 * run so far (0 first), reads the earlier positions' keys and values from
 * the cache and adds its own, and gives only the logits of each sequence's
 * last position, (B, 1, vocab): generation's n = 1 steps cost one row each.
 * Positions past cap are FSDP_ERR_INVALID (call again to start over). The
 * logits agree with a full forward's last row to rounding (the products sum
 * in another order). Not a GPT, or other sizes: FSDP_ERR_INVALID.
 * COLLECTIVE: no (its forwards are). */
enum fsdp_status fsdp_gpt_set_cache(struct fsdp_ctx *ctx, struct fsdp_module *root, int B, int cap);

/* Softmax cross-entropy over logits (N, V) with targets (N): returns the mean
 * loss; if dlogits is non-NULL writes d(mean loss * scale)/dlogits there
 * (dlogits may equal logits). A target outside [0, V) is FSDP_ERR_INVALID. */
enum fsdp_status fsdp_cross_entropy(struct fsdp_ctx *ctx, const float *logits, const int32_t *targets,
                                    int64_t N, int64_t V, float scale, float *loss,
                                    float *dlogits);

/* ---- Compute precision of layers (src/nn/precision.c) ------------------ */

/* Sets the compute dtype of m and every module below it (a unit sets its
 * subtree): FSDP_F32, FSDP_BF16 or FSDP_F16. In BF16/F16 the matrix products
 * of Linear and attention take 16-bit inputs (weights cast from the fp32 full
 * parameters once per forward and once per backward, activations as they
 * come) and accumulate in fp32; LayerNorm, softmax, GELU, embeddings and the
 * loss stay fp32; activations between layers, outputs and parameter
 * gradients stay fp32. BF16 runs on oneDNN's AMX path; F16 widens to fp32
 * internally (no f16 GEMM in oneDNN 2.6 on CPU) and gives no loss scaling by
 * itself. Another dtype is FSDP_ERR_INVALID naming the module. COLLECTIVE: no. */
enum fsdp_status fsdp_module_set_compute_dtype(struct fsdp_ctx *ctx, struct fsdp_module *m,
                                               enum fsdp_dtype dt);

/* ---- Vision layers (src/nn) ------------------------------------------- */

/* Image tensors are NCHW fp32 (batch, channels, height, width), as PyTorch,
 * in the PLAIN layout, or BLOCKED16 (enum fsdp_layout) where a layer says
 * so: Conv2d writes its output as opts.out_layout asks and takes either;
 * BatchNorm2d, ReLU and MaxPool2d keep their input's layout, AdaptiveAvgPool2d
 * takes either; BasicBlock and Bottleneck write FSDP_VISION_LAYOUT's
 * (BLOCKED16 where the widths are multiples of 16, by default), as the ResNet
 * does between its stem and its pooling. Each constructor returns *out to the caller, who owns it until
 * fsdp_module_add_child hands it to a parent. Types (ops->type, for wrap
 * policies): "Conv2d", "BatchNorm2d", "ReLU", "MaxPool2d",
 * "AdaptiveAvgPool2d", "Flatten". */

/* Conv2d: (N, in, H, W) -> (N, out, OH, OW), OH = (H + 2 padding - dilation
 * (kernel - 1) - 1) / stride + 1 (likewise OW); [0] is the height's, [1] the
 * width's. weight (out, in/groups, kh, kw) initialised N(0, init_std^2),
 * init_std 0 meaning torchvision ResNet's kaiming_normal fan_out, sqrt(2 /
 * (out kh kw)); bias (out) zero-initialised, exempt from weight decay. With a
 * 16-bit compute dtype (fsdp_module_set_compute_dtype) the convolution takes
 * 16-bit input and weight and accumulates in fp32: oneDNN's bf16 kernels
 * where fsdp_gemm_native(FSDP_BF16), else the rounded values in fp32; it
 * then also takes its input and its output gradient already in that 16-bit
 * dtype (the same values as its own rounding gives), F32 otherwise. */
struct fsdp_conv2d_opts {
    int64_t in_channels, out_channels;
    int kernel[2], stride[2], padding[2], dilation[2];
    int groups;
    int bias;       /* 1: add a bias (PyTorch's default), 0: none */
    float init_std; /* weight init; 0: kaiming normal, fan_out */
    enum fsdp_layout out_layout; /* of the output: PLAIN (default), or BLOCKED16 where out_channels
                                    is a multiple of 16 (PLAIN otherwise) */
};
/* kernel x kernel, stride 1, padding 0, dilation 1, groups 1, with a bias. */
struct fsdp_conv2d_opts fsdp_conv2d_opts_default(int64_t in_channels, int64_t out_channels, int kernel);
enum fsdp_status fsdp_conv2d_create(struct fsdp_ctx *ctx, const char *name, const struct fsdp_conv2d_opts *opts,
                                    struct fsdp_module **out);

/* BatchNorm2d over (N, C, H, W) (or BatchNorm1d's (N, C)), per channel, as PyTorch: parameters weight
 * (ones) and bias (zeros), exempt from weight decay; buffers running_mean
 * (zeros), running_var (ones) and num_batches_tracked (I64 scalar). Train mode
 * (m->training) normalises with the batch's mean and biased variance and
 * updates running = (1 - momentum) running + momentum batch, with the
 * unbiased variance (count / (count - 1)) for running_var, and counts the
 * batch; eval mode normalises with the running statistics. Always fp32,
 * whatever the compute dtype.
 * sync (SyncBatchNorm): in train mode the per-channel sums of x and x^2
 * (forward) and of dy and dy xhat (backward) are all-reduced over `comm`
 * (NULL: the context's, fsdp_ctx_comm), so that N ranks with local batches
 * use the statistics of the global batch: outputs, input gradients and
 * running statistics are those of one rank holding the whole batch (up to
 * rounding), and weight/bias gradients are each rank's share, summing to the
 * 1-rank gradient as a data-parallel reduction expects. A sync BatchNorm's
 * forward and backward in train mode are COLLECTIVE: yes (over comm). */
struct fsdp_batchnorm_opts {
    int64_t num_features;
    float eps;               /* default 1e-5 */
    float momentum;          /* default 0.1 */
    int sync;                /* 1: SyncBatchNorm */
    struct fsdp_comm *comm;  /* borrowed, must outlive the module; NULL: the context's */
};
struct fsdp_batchnorm_opts fsdp_batchnorm_opts_default(int64_t num_features);
enum fsdp_status fsdp_batchnorm2d_create(struct fsdp_ctx *ctx, const char *name, const struct fsdp_batchnorm_opts *opts,
                                         struct fsdp_module **out);
/* Makes every BatchNorm2d below root synchronised (on != 0) over comm (NULL:
 * the context's) or local (on == 0), as torch's convert_sync_batchnorm;
 * *n_out (may be NULL) gets how many it changed. COLLECTIVE: no. */
void fsdp_batchnorm_set_sync(struct fsdp_module *root, int on, struct fsdp_comm *comm, int *n_out);
/* Whether a train-mode forward of every BatchNorm2d below root updates its
 * running statistics (running_mean, running_var, num_batches_tracked): on
 * (1, the default) as PyTorch, off (0) it normalises with the batch
 * statistics as usual but leaves them untouched (a recomputed forward, e.g.
 * SwAV's second pass over the same crops, must not count twice). *n_out
 * (may be NULL) gets how many it set. COLLECTIVE: no. */
void fsdp_batchnorm_set_update_stats(struct fsdp_module *root, int on, int *n_out);
/* PyTorch's bn.momentum = None for every BatchNorm2d below root (on != 0):
 * the running statistics a train-mode forward updates become the plain mean
 * of the batches' statistics since the last reset (factor 1 /
 * num_batches_tracked), e.g. to re-estimate them on other images (precise
 * BN); off (0, the default) the module's own momentum again. *n_out (may be
 * NULL) gets how many it set. COLLECTIVE: no. */
void fsdp_batchnorm_set_cumulative(struct fsdp_module *root, int on, int *n_out);
/* PyTorch's reset_running_stats() for every BatchNorm2d below root:
 * running_mean 0, running_var 1, num_batches_tracked 0. COLLECTIVE: no. */
void fsdp_batchnorm_reset_stats(struct fsdp_module *root, int *n_out);

/* ReLU: max(x, 0) on any F32 shape. Runs in place when the caller passes
 * out->data == in->data (then the input is overwritten: safe when nothing
 * else reads it later, e.g. after a BatchNorm2d, which saves its own input);
 * backward may run in place too (din->data == dout->data). */
enum fsdp_status fsdp_relu_create(struct fsdp_ctx *ctx, const char *name, struct fsdp_module **out);
/* MaxPool2d(kernel, stride, padding) on (N, C, H, W), padding as -inf,
 * floor mode, through oneDNN's pooling (the first maximum of a window takes
 * the gradient). stride 0 means stride = kernel (PyTorch's default). */
enum fsdp_status fsdp_maxpool2d_create(struct fsdp_ctx *ctx, const char *name, int kernel, int stride, int padding,
                                       struct fsdp_module **out);
/* AdaptiveAvgPool2d(1): (N, C, H, W) -> (N, C, 1, 1), the mean of each plane. */
enum fsdp_status fsdp_global_avgpool2d_create(struct fsdp_ctx *ctx, const char *name, struct fsdp_module **out);
/* Flatten(start_dim=1): (N, d1, ..., dk) -> (N, d1 ... dk). When out->data
 * is NULL the output is a view of the input (no copy), likewise the input
 * gradient of the output gradient. */
enum fsdp_status fsdp_flatten_create(struct fsdp_ctx *ctx, const char *name, struct fsdp_module **out);

/* Sequential: runs its children in the order they were added (name them
 * "0", "1", ... as PyTorch's nn.Sequential); type "Sequential". */
enum fsdp_status fsdp_sequential_create(struct fsdp_ctx *ctx, const char *name, struct fsdp_module **out);
/* ResNet's BasicBlock with torchvision's names, type "BasicBlock": conv1
 * (3x3, stride, no bias), bn1, ReLU, conv2 (3x3, no bias), bn2, plus
 * downsample = Sequential(0: Conv2d 1x1 stride, 1: BatchNorm2d) when stride
 * != 1 or inplanes != planes; out = relu(bn2(...) + identity). */
enum fsdp_status fsdp_basic_block_create(struct fsdp_ctx *ctx, const char *name, int64_t inplanes, int64_t planes,
                                         int stride, struct fsdp_module **out);
/* ResNet's Bottleneck (torchvision v1.5), type "Bottleneck": conv1 (1x1),
 * bn1, conv2 (3x3, stride), bn2, conv3 (1x1, 4 planes wide), bn3, ReLUs
 * after bn1, bn2 and the sum, downsample as BasicBlock's when stride != 1
 * or inplanes != 4 planes. */
enum fsdp_status fsdp_bottleneck_create(struct fsdp_ctx *ctx, const char *name, int64_t inplanes, int64_t planes,
                                        int stride, struct fsdp_module **out);

/* ---- Custom modules: matrix products and errors (src/nn/gemm.c) -------- */

/* Row-major C (M, N) = alpha * op(A) op(B) + beta * C, with op(A) (M, K) and
 * op(B) (K, N); transa / transb non-zero transposes the stored matrix; lda,
 * ldb, ldc are the row strides of the stored matrices. beta 0 ignores C's
 * old contents (NaN-safe). The product runs in m's compute dtype
 * (m->compute_dtype, set by fsdp_module_set_compute_dtype or the unit's
 * mixed precision; m NULL: fp32) through the path the built-in Linear takes:
 * FSDP_F32 is oneDNN's sgemm; FSDP_BF16 / FSDP_F16 round A and B to 16 bits
 * into activation-arena scratch (released before it returns) and multiply
 * with fp32 accumulation (oneDNN's bf16 matmul, or the widened fp32 product
 * where there is none: fsdp_gemm_native). A, B, C are borrowed. Negative
 * sizes, strides too small for the shapes or NULL matrices are
 * FSDP_ERR_INVALID naming the module; a full arena FSDP_ERR_NOMEM. Call it
 * from one thread (not inside an OpenMP parallel region: it threads itself).
 * COLLECTIVE: no. */
enum fsdp_status fsdp_gemm(struct fsdp_ctx *ctx, const struct fsdp_module *m, int transa, int transb, int64_t M,
                           int64_t N, int64_t K, float alpha, const float *A, int64_t lda, const float *B,
                           int64_t ldb, float beta, float *C, int64_t ldc);

/* Records a message for fsdp_errmsg and returns st: for user modules and
 * losses, so that their failures name what failed. COLLECTIVE: no. */
enum fsdp_status fsdp_error(struct fsdp_ctx *ctx, enum fsdp_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* ---- Collectives (src/comm) ------------------------------------------- */

/* FSDP_AVG (floating dtypes): the sum, times 1/size rounded once more (the
 * bits of FSDP_SUM followed by x *= 1.0f / size), as torch's ReduceOp.AVG. */
enum fsdp_red_op { FSDP_SUM, FSDP_MAX, FSDP_MIN, FSDP_AVG };

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

/* Splits c into disjoint communicators, one per distinct color (>= 0), ranks
 * ordered by (key, rank in c), as MPI_Comm_split. The new communicator uses
 * c's backend (a group of one rank: "self"), inherits its watchdog and
 * schedule check, and counts its own statistics. *out is returned to the
 * caller to free with fsdp_comm_free (COLLECTIVE: yes, over *out; NULL is a
 * no-op) before c is freed. COLLECTIVE: yes (over c). */
enum fsdp_status fsdp_comm_split(struct fsdp_comm *c, int color, int key, struct fsdp_comm **out);
void fsdp_comm_free(struct fsdp_comm *c);
/* Sets *out to the number of c's ranks on this rank's host (self: 1, shm:
 * all). COLLECTIVE: yes. */
enum fsdp_status fsdp_comm_local_size(struct fsdp_comm *c, int *out);

/* ---- Collective watchdog and schedule check (src/comm) ----------------- */

/* Watchdog: a wait on a collective that has not completed `seconds` after
 * its start fails with FSDP_ERR_COMM, naming the collective (type, sequence
 * number, elements, dtype, bytes) and, on shm, the rank waited on; the
 * message is printed at once too. The communicator is unusable afterwards:
 * end the job (fsdp_ctx_abort). 0 (the default) = wait forever.
 * COLLECTIVE: no (set it alike on every rank). */
void fsdp_comm_set_timeout(struct fsdp_comm *c, double seconds);
/* Schedule check: before each collective the ranks exchange its sequence
 * number and fingerprint (type, element count, dtype, op, root); if they
 * differ, the collective fails on every rank with FSDP_ERR_COMM naming both
 * sides ("rank 0 called allgather(#7, 1024 x F32), rank 1 called
 * reduce-scatter(#7, ...)") before any data moves, and the communicator stays
 * usable. Costs one small blocking all-gather per collective.
 * COLLECTIVE: no (set it alike on every rank). */
void fsdp_comm_set_check(struct fsdp_comm *c, int on);
/* Names the collectives started from now on (e.g. "unit 3 transformer.h.2"),
 * until the next call; NULL or "" clears it. The watchdog prints the tag,
 * and the schedule check compares it across ranks (as a hash) with the
 * fingerprint. Copied (at most 63 bytes). COLLECTIVE: no. */
void fsdp_comm_set_tag(struct fsdp_comm *c, const char *tag);
/* The current tag ("" if none; borrowed until the next fsdp_comm_set_tag). */
const char *fsdp_comm_tag(const struct fsdp_comm *c);

/* ---- Collectives inside a module's forward, backward or a loss ---------
 *
 * [Note: collectives in modules] A module may communicate inside its
 * forward or backward (SyncBatchNorm's per-channel sums) and a loss inside
 * its computation (SwAV's Sinkhorn sums), on the context's communicator
 * fsdp_ctx_comm(ctx): every data-parallel rank, for every sharding
 * strategy (HYBRID_SHARD included: it spans the replicas as well as the
 * shard group; the model's own shard and replica groups are split from it
 * and never handed out). This is safe with overlap on: the sharding
 * layer's prefetched all-gathers and asynchronous reduce-scatters are issued
 * in the same order on every rank, each communicator runs its collectives
 * in start order, and the backends progress them while a rank blocks in
 * another (shm: one progress thread per communicator; MPI: its progress
 * thread, or MPI's own progress inside the blocking wait), so a module's
 * blocking collective waits behind the in-flight ones without deadlock.
 * The rule is the usual one: every rank calls the same collectives in the
 * same order, so a module must take the same branch on every rank (train
 * or eval mode, batch present or not). Under activation checkpointing a
 * checkpointed module's forward runs again inside backward (and calls its
 * collectives again, on every rank alike). */

/* All-reduces buf (count elements of dt, in place) over fsdp_ctx_comm(ctx)
 * for module m, naming it: the collective is tagged "module FQN" (the tag
 * in force before is restored after), so the schedule check and the
 * watchdog name the module when ranks diverge. A world of one returns at
 * once. COLLECTIVE: yes. */
enum fsdp_status fsdp_module_allreduce(struct fsdp_ctx *ctx, struct fsdp_module *m, void *buf, size_t count,
                                       enum fsdp_dtype dt, enum fsdp_red_op op);

/* ---- SwAV's head and model (src/models/swav_head.c) -------------------- */

/* L2Norm, type "L2Norm": each row of an (N, D) input divided by its norm,
 * y = x / max(||x||, eps) (torch.nn.functional.normalize with dim 1). */
enum fsdp_status fsdp_l2norm_create(struct fsdp_ctx *ctx, const char *name, float eps, struct fsdp_module **out);

/* SwAV's head (VISSL's SwAVPrototypesHead), type "SwAVHead": input (N, in_dim)
 * trunk features; children projection_head = Sequential(0 Linear(in_dim,
 * hidden_dim), 1 BatchNorm (N, C), 2 ReLU, 3 Linear(hidden_dim, out_dim))
 * (hidden_dim 0: only 0 Linear(in_dim, out_dim)), l2norm, and prototypes0 ..
 * prototypes<n_heads-1>, each Linear(out_dim, n_prototypes) without bias.
 * Output (N, out_dim + n_heads n_prototypes): the normalised embedding z,
 * then each head's scores z C_j^T, along dim 1. Linear weights start N(0,
 * 1 / (3 fan_in)), the variance of PyTorch's default uniform init; VISSL then
 * re-initialises the head under fsdp_summon_full_params with a fixed seed.
 * To keep each prototype layer an fp32 unit of its own inside the head's
 * unit, as VISSL does, wrap "<head>.prototypes<j>" with
 * FSDP_WRAP_UNIT_OVERRIDE and precision FSDP_F32. *out is returned to the
 * caller. */
struct fsdp_swav_head_config {
    int64_t in_dim, hidden_dim, out_dim, n_prototypes;
    int n_heads;
};
/* SwAV's ImageNet head: hidden 2048, out 128, 3000 prototypes, 1 head. */
struct fsdp_swav_head_config fsdp_swav_head_config_default(int64_t in_dim);
enum fsdp_status fsdp_swav_head_create(struct fsdp_ctx *ctx, const char *name, const struct fsdp_swav_head_config *cfg,
                                       struct fsdp_module **out);

/* SwAV's model as VISSL trains it, type "SwAV": `trunk` (any module whose
 * output is (N, in_dim) features: a ResNet of fsdp_resnet_create, a user's
 * CNN), then `head` (fsdp_swav_head_create's); forward returns the head's
 * output. The children keep their names, so the FQNs are "<trunk
 * name>.<...>" and "<head name>.<...>". With the library's own output
 * gradient (the loss's gradient written over the model's output) backward
 * hands the arena back as it passes the head and the trunk's layers ([Note:
 * backward releases the blocks], src/models/gpt.c). The model takes trunk
 * and head, also on failure; finalized. */
enum fsdp_status fsdp_swav_model_create(struct fsdp_ctx *ctx, const char *name, struct fsdp_module *trunk,
                                        struct fsdp_module *head, struct fsdp_module **out);
/* on: forward stops at the trunk and returns its features (VISSL's feature
 * evaluation: a kNN, a linear probe); 0: trunk, then head. FSDP_ERR_INVALID
 * unless m is fsdp_swav_model_create's. */
enum fsdp_status fsdp_swav_model_set_trunk_only(struct fsdp_ctx *ctx, struct fsdp_module *m, int on);

/* ---- SwAV's loss (src/nn/swav.c) ------------------------------------- */

/* [Note: SwAV loss] in src/nn/swav.c has the formulas. */
struct fsdp_swav_opts {
    double temperature; /* tau of the softmax over prototype scores (0.1) */
    double epsilon;     /* Sinkhorn's entropic regularisation (0.05) */
    int sinkhorn_iters; /* Sinkhorn-Knopp iterations (3) */
};
struct fsdp_swav_opts fsdp_swav_opts_default(void);
/* Codes (n, K) of scores (n, K) by Sinkhorn-Knopp over the rows of every rank
 * of comm (NULL: this rank alone): each code row sums to 1, and every
 * prototype gets an equal share of the global batch. codes may not alias
 * scores. COLLECTIVE: yes on comm (3 + iters all-gathers). */
enum fsdp_status fsdp_sinkhorn(struct fsdp_ctx *ctx, struct fsdp_comm *comm, const float *scores, int64_t n,
                               int64_t K, double eps, int iters, float *codes);
/* SwAV's swapped prediction loss. scores (n_crops * B, K) row-major: crop v
 * of this rank's image b is row v * B + b (crops of one resolution may come
 * from one batched forward). assign: the n_assign crops whose codes predict
 * every other crop (SwAV's crops_for_assign, usually {0, 1}). queue: NULL, or
 * per assigned crop NULL or (queue_len[a], K) scores of queued features,
 * joined before this batch for Sinkhorn (their codes are not used).
 * *loss: the mean over the global batch (every rank gets the same value);
 * dscores (n_crops * B, K), may be NULL: d loss / d scores for this rank's
 * rows (overwritten), so that summed over ranks it is the global gradient.
 * Buffers are borrowed. COLLECTIVE: yes on comm. */
enum fsdp_status fsdp_swav_loss(struct fsdp_ctx *ctx, struct fsdp_comm *comm, const struct fsdp_swav_opts *opts,
                                const float *scores, int n_crops, int64_t B, int64_t K, const int *assign,
                                int n_assign, const float *const *queue, const int64_t *queue_len, double *loss,
                                float *dscores);
/* The same loss in two phases, for a model whose crops of each resolution
 * go through forward and backward in turn (one forward per resolution):
 * fsdp_swav_codes: the codes (n_assign, B, K) of the assigned crops, scores
 * (n_crops * B, K) crop-major as fsdp_swav_loss's (only the assigned crops'
 * rows are read), each queue joined before them as fsdp_swav_loss joins it.
 * COLLECTIVE.
 * fsdp_swav_predict: the terms of crops [v0, v0 + nv) of n_crops, scores
 * (nv * B, K) of those crops: *loss their part of the global mean (every rank
 * the same value), dscores (nv * B, K) as fsdp_swav_loss's rows. The parts
 * over crops partitioned sum to fsdp_swav_loss's loss, and the rows equal its
 * gradient's (bit for bit). COLLECTIVE. */
enum fsdp_status fsdp_swav_codes(struct fsdp_ctx *ctx, struct fsdp_comm *comm, const struct fsdp_swav_opts *opts,
                                 const float *scores, int n_crops, int64_t B, int64_t K, const int *assign,
                                 int n_assign, const float *const *queue, const int64_t *queue_len, float *codes);
enum fsdp_status fsdp_swav_predict(struct fsdp_ctx *ctx, struct fsdp_comm *comm, const struct fsdp_swav_opts *opts,
                                   const float *scores, int v0, int nv, int n_crops, int64_t B, int64_t K,
                                   const int *assign, int n_assign, const float *codes, double *loss, float *dscores);

/* ---- Sharding (src/fsdp) ---------------------------------------------- */

/* What a wrap policy answers for a module: not a unit root, a unit root, or a
 * unit root whose config fields named in *ovr differ from the model's. */
enum fsdp_wrap { FSDP_WRAP_SKIP, FSDP_WRAP_UNIT, FSDP_WRAP_UNIT_OVERRIDE };

/* Parameter and reduction precision (Composer's FSDP2Config.mixed_precision):
 * DEFAULT: parameters in the low dtype, gradients reduced in fp32; PURE: both
 * low; FULL: parameters and reduction fp32. The low dtype is
 * fsdp_parallelize_model's precision (see "Mixed precision" below). */
enum fsdp_mixed_precision { FSDP_MP_DEFAULT, FSDP_MP_PURE, FSDP_MP_FULL };

/* Per-unit overrides: `set` names (FSDP_OVR_* bits) the fields that replace
 * the model-wide value for this unit; a later field gets a new bit, so old
 * policies keep compiling and meaning the same. */
#define FSDP_OVR_RESHARD_AFTER_FORWARD (1u << 0)
#define FSDP_OVR_MIXED_PRECISION (1u << 1)
struct fsdp_unit_overrides {
    unsigned set;
    int reshard_after_forward;
    enum fsdp_mixed_precision mixed_precision; /* FULL here: this unit wholly fp32 */
};

/* A wrap policy: asked for every module below the root, parents before
 * children (the root is always a unit). A unit may hold units (nested): each
 * parameter belongs to the unit of its nearest wrapped ancestor. *ovr is
 * zeroed before each call; fill it and return FSDP_WRAP_UNIT_OVERRIDE to
 * override fields for this unit only. */
typedef enum fsdp_wrap (*fsdp_wrap_fn)(struct fsdp_module *m, void *ud, struct fsdp_unit_overrides *ovr);

/* Built-in: a unit for every module whose ops->type equals (const char *)ud. */
enum fsdp_wrap fsdp_wrap_by_type(struct fsdp_module *m, void *ud, struct fsdp_unit_overrides *ovr);
/* Built-in (torch's size_based_auto_wrap_policy): a unit for every module
 * whose parameters not already in a unit below it number at least
 * *(const int64_t *)ud (tied parameters counted once, at their definition).
 * Naming-only containers (types "Module", "ModuleList") never run, so they
 * are never units. */
enum fsdp_wrap fsdp_wrap_by_size(struct fsdp_module *m, void *ud, struct fsdp_unit_overrides *ovr);

/* Sharding strategies (torch FSDP's ShardingStrategy). One mechanism: each
 * unit shards its flat buffer over a shard group of K ranks and all-reduces
 * its gradient shard over the world/K replicas of that group.
 *   FULL_SHARD (0, default, ZeRO-3): K = world; gather before forward and
 *     again before backward.
 *   SHARD_GRAD_OP (ZeRO-2): K = world; parameters stay gathered from forward
 *     to backward (reshard_after_forward off for every unit).
 *   NO_SHARD (DDP): K = 1; every rank holds everything, gradients all-reduced.
 *   HYBRID_SHARD: K = shard_group, by default the ranks of one host (ranks
 *     numbered host by host); replicate across the world/K groups. */
enum fsdp_sharding {
    FSDP_FULL_SHARD, FSDP_SHARD_GRAD_OP, FSDP_NO_SHARD, FSDP_HYBRID_SHARD
};
/* "FULL_SHARD", ... ("?" if out of range). */
const char *fsdp_sharding_name(enum fsdp_sharding s);
/* Parses a name (case-insensitive); an unknown one is FSDP_ERR_INVALID
 * listing the valid names. COLLECTIVE: no. */
enum fsdp_status fsdp_sharding_parse(struct fsdp_ctx *ctx, const char *text, enum fsdp_sharding *out);

struct fsdp_shard_opts {
    fsdp_wrap_fn wrap;          /* default: fsdp_wrap_by_type with "Block" */
    void *wrap_ud;
    int reshard_after_forward;  /* default 1; the root unit never reshards after forward */
    enum fsdp_sharding sharding; /* default FSDP_FULL_SHARD */
    int shard_group;            /* HYBRID_SHARD's K (0: the ranks of this host); must
                                   divide the world; 0 for the other strategies */
    int overlap;                /* default 1: forward and backward prefetch of the next
                                   units' all-gathers and asynchronous reduce-scatters
                                   (and HYBRID_SHARD's replica all-reduces after them);
                                   results are bit-identical either way */
    int max_inflight;           /* default 2: units gathered or gathering at once, the
                                   computing one included (bounds memory; 0 = 2) */
    enum fsdp_dtype precision;  /* default FSDP_F32: the compute precision of the units
                                   (fsdp_parallelize_model's precision); a 16-bit one
                                   resolves each unit's policy with mixed_precision
                                   and its FSDP_OVR_MIXED_PRECISION override, as
                                   fsdp_parallelize_model does. FSDP_F32 leaves the
                                   modules' compute dtypes as they are */
    enum fsdp_mixed_precision mixed_precision; /* default FSDP_MP_DEFAULT; with precision */
    int lp_shard_copy;          /* default 0: a unit gathered in 16 bits casts its fp32
                                   shard at each gather, so no 16-bit copy of the weights
                                   outlives the gather (FSDP2's). 1 = each 16-bit unit also
                                   keeps its shard's 16-bit copy, written by the optimizer
                                   and gathered without a cast: 2 bytes a parameter for
                                   fewer casts ([Note: fused 16-bit copy]) */
};

struct fsdp_shard_opts fsdp_shard_opts_default(void);

/* The sharded model: units, shards, pooled full buffers. */
struct fsdp_model;

/* Groups root's parameters into units and allocates this rank's shards
 * (zero-filled; call fsdp_model_init_params). Parameters must not be
 * materialized. Tied parameters land in one unit. *out is returned to the
 * caller; root stays owned by the caller and must outlive *out.
 * COLLECTIVE: yes: HYBRID_SHARD splits the communicator into shard and
 * replica groups, and on the shm backend the shards' shared window
 * ([Note: shared window], src/fsdp/unit.c) is made by every rank at once
 * (ranks that lay out different models fail alike there, naming both sizes). */
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
/* Same for its gradient shard gathered: from the backward that writes it until the next
 * step's first forward, the optimizer step included; zeros from that forward until its
 * step's backward writes them again (PyTorch's gradients set to None). COLLECTIVE: yes. */
enum fsdp_status fsdp_model_get_grad(struct fsdp_ctx *ctx, struct fsdp_model *fm,
                                     const char *fqn, float *dst);

/* Global L2 norms over all shards (padding is zero). COLLECTIVE: yes. */
enum fsdp_status fsdp_model_grad_norm(struct fsdp_ctx *ctx, struct fsdp_model *fm, double *out);
enum fsdp_status fsdp_model_param_norm(struct fsdp_ctx *ctx, struct fsdp_model *fm, double *out);

/* ---- Models: ResNet (src/models) ------------------------------------- */

/* torchvision's ResNet-18/34/50 (resnet.py, v1.5: a Bottleneck's stride on
 * its 3x3), with torchvision's parameter and buffer names:
 *   conv1        Conv2d(in_chans, w, 7, 2, 3) (stem imagenet) or (3, 1, 1) (cifar), no bias
 *   bn1, relu    BatchNorm2d(w), ReLU
 *   maxpool      MaxPool2d(3, 2, 1) (imagenet stem only)
 *   layer1..4    Sequential of blocks "0".."n-1" (BasicBlock or Bottleneck),
 *                planes w, 2w, 4w, 8w, stride 1, 2, 2, 2
 *   avgpool      AdaptiveAvgPool2d(1), then a flatten (a view)
 *   fc           Linear(8w * expansion, num_classes), expansion 1 (BasicBlock) or 4
 * with w = width (64: torchvision's). Forward: (N, in_chans, H, W) F32 ->
 * logits (N, num_classes) F32; the root's type is "ResNet". Init: convs
 * kaiming normal fan_out (torchvision's), BN weight 1 and bias 0 (each
 * block's last BN weight 0 with zero_init_residual), fc weight N(0, 1 / (3
 * fan_in)) (the variance of PyTorch's default Linear init, uniform(-1 /
 * sqrt(fan_in), 1 / sqrt(fan_in)): the init kinds have no uniform) and fc
 * bias 0 (PyTorch's is uniform too). */
enum fsdp_resnet_arch { FSDP_RESNET18, FSDP_RESNET34, FSDP_RESNET50 };
enum fsdp_resnet_stem { FSDP_RESNET_STEM_IMAGENET, FSDP_RESNET_STEM_CIFAR };
struct fsdp_resnet_config {
    enum fsdp_resnet_arch arch; /* resnet18 / 34: BasicBlock [2,2,2,2] / [3,4,6,3];
                                   resnet50: Bottleneck [3,4,6,3] */
    int in_chans;               /* 1 .. 64 */
    int num_classes;            /* 1 .. 2^24; 0: no fc, the output is the pooled
                                   features (N, 8w * expansion) (a trunk for a head) */
    enum fsdp_resnet_stem stem;
    int width;                  /* 1 .. 1024; 64 = torchvision */
    int zero_init_residual;     /* 1: each block's last BN weight starts at 0 */
};
/* Presets "resnet18", "resnet34", "resnet50": that arch, in_chans 3,
 * num_classes 1000, stem imagenet, width 64 (torchvision's defaults);
 * FSDP_ERR_INVALID for another name (no message: ctx-free). */
enum fsdp_status fsdp_resnet_config_preset(const char *name, struct fsdp_resnet_config *cfg);
/* Reads {"arch": "resnet18" | "resnet34" | "resnet50", "in_chans": 1,
 * "num_classes": 10, "stem": "imagenet" | "cifar", "width": 64,
 * "zero_init_residual": false}: arch is required, the others default to
 * the preset's values (in_chans 3, num_classes 1000, imagenet, width 64,
 * false). An unknown or repeated key, a wrong type, or a value out of range
 * is one error naming the file and the key, and anything after the object
 * but white space (junk, a second object, a NUL byte) one naming the file
 * and the byte offset; *cfg is written only on success. COLLECTIVE: no. */
enum fsdp_status fsdp_resnet_config_load(struct fsdp_ctx *ctx, const char *path, struct fsdp_resnet_config *cfg);
/* The same from len bytes of JSON text (need not be NUL-terminated); its
 * messages name `path` as the file. */
enum fsdp_status fsdp_resnet_config_parse(struct fsdp_ctx *ctx, const char *path, const char *text, size_t len,
                                          struct fsdp_resnet_config *cfg);
/* cfg as the JSON object the readers take, every key written (a checkpoint
 * records its model so); snprintf's return value. */
int fsdp_resnet_config_json(const struct fsdp_resnet_config *cfg, char *buf, size_t cap);
/* FSDP_ERR_INVALID naming the field for an unknown arch or stem, or
 * in_chans, num_classes or width out of range. */
enum fsdp_status fsdp_resnet_config_validate(struct fsdp_ctx *ctx, const struct fsdp_resnet_config *cfg);
/* "resnet18", ... and "imagenet" / "cifar" ("?" when out of range). */
const char *fsdp_resnet_arch_name(enum fsdp_resnet_arch arch);
const char *fsdp_resnet_stem_name(enum fsdp_resnet_stem stem);
/* Builds the model with shapes only (fsdp_module_materialize or sharding
 * gives it values); finalized (FQNs set). *out is returned to the caller. */
enum fsdp_status fsdp_resnet_create(struct fsdp_ctx *ctx, const struct fsdp_resnet_config *cfg,
                                    struct fsdp_module **out);
/* layer L in 1..4: the ResNet's output is layerL's feature map (N,
 * 2^(L-1) w * expansion, h, w) F32 NCHW, the later layers, avgpool and fc
 * skipped, and backward takes its gradient (the feature extractors of VISSL's
 * evaluations, which read res2..res5 and pool the maps themselves); 0: the
 * model's output again. FSDP_ERR_INVALID if resnet is not a ResNet's root or
 * L is outside 0..4. COLLECTIVE: no. */
enum fsdp_status fsdp_resnet_set_feature_map(struct fsdp_ctx *ctx, struct fsdp_module *resnet, int layer);
/* The channels of layer L's output map, L in 1..4: 2^(L-1) w x expansion
 * (1 for resnet18/34, 4 for resnet50); 0 gives layer4's, the width of the
 * pooled features fc reads. -1 for L outside 0..4. */
int64_t fsdp_resnet_channels(const struct fsdp_resnet_config *cfg, int layer);
/* The residual block's module type: "BasicBlock" (resnet18/34) or
 * "Bottleneck" (resnet50). The default wrap policy for sharding a ResNet, a
 * unit per block with the stem and the head (fc) in the root unit (VISSL's
 * style), is fsdp_wrap_by_type with it as user data:
 *   struct fsdp_wrap_policy wp = {fsdp_wrap_by_type, (void *)fsdp_resnet_block_type(&cfg)};
 * and the same with fsdp_ac_by_type checkpoints every block. */
const char *fsdp_resnet_block_type(const struct fsdp_resnet_config *cfg);
/* The same policy for either kind of block: a unit for every module of type
 * BasicBlock or Bottleneck (ud unused). */
enum fsdp_wrap fsdp_resnet_wrap_blocks(struct fsdp_module *m, void *ud, struct fsdp_unit_overrides *ovr);
/* Forward FLOPs per image of H x W (2 per multiply-add of every convolution
 * and of fc; batch norm, ReLU and pooling not counted), for FLOP/s figures;
 * a training step costs about 3x this. */
double fsdp_resnet_flops_per_image(const struct fsdp_resnet_config *cfg, int H, int W);

/* ---- Optimizer (src/optim) -------------------------------------------- */

/* FSDP_OPTIM_LARS: SGD (momentum, coupled weight decay) whose every decayed
 * parameter's step is scaled by its trust ratio (LARC as SwAV trains,
 * without clipping): d = r (g + wd w), r = eta ||w|| / (||g|| + wd ||w|| +
 * eps), norms of the whole parameter (over its shards: the training step
 * all-reduces per-parameter sums once); parameters without weight decay
 * (biases, batch norm) and those with ||w|| or ||g|| zero take plain SGD
 * steps without decay. */
enum fsdp_optim_kind { FSDP_OPTIM_ADAMW, FSDP_OPTIM_SGD, FSDP_OPTIM_LARS };

struct fsdp_optim_opts {
    enum fsdp_optim_kind kind;
    float beta1, beta2, eps;   /* AdamW; defaults 0.9, 0.95, 1e-8 */
    float momentum;            /* SGD; default 0 */
    float weight_decay;        /* default 0.1 (decoupled for AdamW) */
    int decay_all;             /* 1: decay biases, LayerNorm, embeddings too (default 0) */
    float trust_coefficient;   /* LARS's eta; default 0.001 */
    float lars_eps;            /* LARS's eps in the ratio's denominator; default 1e-8 */
    int nesterov;              /* SGD: Nesterov momentum as torch.optim.SGD's (needs momentum > 0);
                                  default 0 */
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
    int decay; /* 0: no weight decay; 1: the optimizer's; 1 + g (g >= 1): parameter group g's
                  weight decay and learning-rate scale (fsdp_optim_add_group) */
    void *param_lp;          /* optional (NULL: none): n elements of lp_dtype that receive the
                                updated parameters rounded to nearest even, written while they
                                are still in cache (a 16-bit copy without a separate cast) */
    enum fsdp_dtype lp_dtype; /* FSDP_BF16 or FSDP_F16 when param_lp is set */
    float trust;             /* LARS: this slice's factor on (g + wd w) (set by the training step
                                per parameter); 0: none (plain SGD step, e.g. excluded) */
    double *sumsq;           /* optional (NULL: none): receives the sum of squares of the updated
                                parameters, in double, per 8192-element chunk and the chunks in
                                order (the same bits for any thread count) */
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
    int skipped;       /* 1: loss scaling found inf/nan; no update (see fsdp_loss_scale_opts) */
    double loss_scale; /* the loss scale this step used (1 without loss scaling) */
    double comm_wait_s; /* exposed communication: this rank's wall time blocked
                           waiting on collectives during the step (all groups) */
};

/* One training step on this rank's share of the global batch: inputs and
 * targets are (B_local, T) token ids. Runs forward, loss, backward (gathers
 * and reduce-scatters by unit), global grad norm, clipping to `clip` (<= 0:
 * none) and the optimizer update with `lr`. A non-finite loss or gradient
 * norm skips the update and returns FSDP_ERR_NUMERIC on every rank, the
 * message naming the first unit (in backward order) whose reduced gradient
 * holds inf or nan; under loss scaling (fsdp_loss_scale_opts) it is an
 * overflow instead: the update is skipped on every rank, res->skipped = 1,
 * and FSDP_OK is returned. It is fsdp_model_forward_tensor, fsdp_model_loss
 * (cross-entropy), fsdp_model_backward and fsdp_model_optim_step in turn
 * (see "Training step, split"); the model must be in train mode. Where the
 * root computes in 16 bits the logits stay in that dtype from the last
 * layer's product to the loss (a bf16 module's output is bf16 under FSDP2
 * and autocast as well): the cross-entropy widens each row to fp32, and the
 * split calls, which return F32 logits, give the same bits once those are
 * rounded to it ([Note: 16-bit model output], src/fsdp/step.c). A target
 * id outside the vocabulary fails the step on every rank before its
 * backward, the ranks without one naming the first rank that had one.
 * COLLECTIVE: yes. */
enum fsdp_status fsdp_model_train_step(struct fsdp_ctx *ctx, struct fsdp_model *fm,
                                       const int32_t *inputs, const int32_t *targets, int B, int T,
                                       float lr, float clip, struct fsdp_step_result *res);

/* Gradient accumulation (FSDP2's two modes): how the micro-batches of one
 * step reduce. REDUCE_EACH reduces every micro-batch into the fp32 gradient
 * shard (full gradients live one unit at a time: less memory); NO_SYNC keeps
 * every unit's unsharded gradient across the micro-batches and reduces once
 * after the last (less communication, a full gradient per unit held). */
enum fsdp_grad_accum { FSDP_ACCUM_REDUCE_EACH, FSDP_ACCUM_NO_SYNC };

/* One training step over `accum` micro-batches: inputs and targets are
 * (accum * B_local, T) token ids, micro-batch k being rows [k*B_local,
 * (k+1)*B_local). The loss is the mean over all of them and the gradients
 * equal one step on the (accum * B_local, T) batch (up to rounding); then
 * norm, clipping and the update as fsdp_model_train_step (which is this with
 * accum = 1). accum < 1 or an unknown mode is FSDP_ERR_INVALID.
 * COLLECTIVE: yes. */
enum fsdp_status fsdp_model_train_step_accum(struct fsdp_ctx *ctx, struct fsdp_model *fm,
                                             const int32_t *inputs, const int32_t *targets, int B, int T,
                                             int accum, enum fsdp_grad_accum mode, float lr, float clip,
                                             struct fsdp_step_result *res);

/* The sum of the statistics of every communicator the model uses (the
 * context's, and the shard and replica groups a strategy split off).
 * COLLECTIVE: no. */
void fsdp_model_comm_stats(const struct fsdp_model *fm, struct fsdp_comm_stats *out);

/* The scale-out model (src/fsdp/commplan.c, [Note: scale-out model]): a
 * world of `hosts` x `ranks_per_host` ranks whose hosts are joined by links
 * of net_gbps (each way) and net_latency_us per message. */
struct fsdp_net_model {
    int hosts, ranks_per_host;
    double net_gbps, net_latency_us;
    double shm_gbps;   /* shared memory within a host; 0: not counted */
    double compute_ms; /* one step's forward + backward compute per rank */
    double forward_ms; /* the forward's part of compute_ms; 0: a third of it */
};
/* Per rank and step: bytes sent over the network and through shared memory
 * per collective kind, the time the collectives occupy the link, and the part
 * of it the prefetch schedule cannot hide behind compute. */
struct fsdp_comm_plan {
    int world, n_units;
    double net_bytes[FSDP_COLL_COUNT], shm_bytes[FSDP_COLL_COUNT], net_msgs[FSDP_COLL_COUNT];
    double comm_ms;     /* every collective's time on the link, summed */
    double compute_ms;  /* net->compute_ms */
    double exposed_ms;  /* predicted exposed communication (step - compute) */
    double step_ms;     /* predicted forward + backward time */
};
/* Plans the communication of one training step of `root` (shapes only,
 * not sharded) under opts (strategy, overlap, max_inflight, precision) on
 * the world and links of `net`: bytes from the algorithms the backends run,
 * time from the prefetch schedule. Allocates no shard. A world of more than
 * 2^20 ranks is FSDP_ERR_INVALID (as for the memory plans). COLLECTIVE: no. */
enum fsdp_status fsdp_plan_comm(struct fsdp_ctx *ctx, struct fsdp_module *root, const struct fsdp_shard_opts *opts,
                                const struct fsdp_net_model *net, struct fsdp_comm_plan *out);

/* Forward only: logits (B, T, vocab) into the arena (valid until the next
 * step). Gathers and frees units as in training, the activations kept as a
 * train-mode forward keeps them (fsdp_model_forward_tensor in eval mode
 * keeps none); no backward may follow. COLLECTIVE: yes. */
enum fsdp_status fsdp_model_forward(struct fsdp_ctx *ctx, struct fsdp_model *fm,
                                    const int32_t *inputs, int B, int T, float **logits);

/* ---- Training step, split (src/fsdp/step.c) ----------------------------
 *
 * fsdp_model_train_step is the composition of four calls a custom loop
 * makes itself (PyTorch's forward, loss, backward, optimizer.step()):
 *
 *   fsdp_model_forward_tensor(ctx, fm, &x, &y);          // y in the arena
 *   fsdp_model_loss(ctx, fm, &loss, &y, &target, 1, &value, &dy);
 *   fsdp_model_backward(ctx, fm, &dy);                    // reduce-scatters
 *   fsdp_model_optim_step(ctx, fm, lr, clip, &res);       // norm, clip, update
 *
 * A step is every forward, loss and backward since the last optimizer step:
 * gradients add up over its backwards (gradient accumulation; with
 * fsdp_model_set_grad_sync off a backward keeps the unsharded gradients and
 * reduces nothing, FSDP2's set_requires_gradient_sync). Every rank passes
 * its share of the global batch; the shares of one micro-batch have the
 * same size on every rank (the loss of the global batch is the mean of the
 * ranks' means), except for a cross-entropy with `ignore`, which counts the
 * rows across ranks. Between a train-mode forward and its backward the
 * units it gathered stay gathered: call only the loss, the backward, another
 * forward (which drops the first) or read-only functions then (attaching an
 * optimizer is FSDP_ERR_STATE). Each call of the step is COLLECTIVE: yes
 * unless said. */

/* Runs the model on `in` (any dtype and shape the model takes: F32 images
 * (N, C, H, W), I32 tokens (B, T), ...; borrowed, copied into the activation
 * arena, which this call resets first, so in->data must not point into the
 * arena: copy an earlier output out before feeding it back) and sets *out to
 * its output, which lives in the arena until the next forward. In train mode (the root module's
 * `training`, fsdp_module_set_training) the activations stay for
 * fsdp_model_backward. In eval mode it is an inference pass: every unit is
 * gathered, run and resharded (whatever its reshard_after_forward), what a
 * unit saved for backward is released as soon as the unit's forward ends, so
 * the arena holds the input, the units' outputs and one unit's scratch at a
 * time, and no backward may follow (evaluation loops use it). A failure is
 * the module's error (fsdp_errmsg), every unit resharded. */
enum fsdp_status fsdp_model_forward_tensor(struct fsdp_ctx *ctx, struct fsdp_model *fm,
                                           const struct fsdp_tensor *in, struct fsdp_tensor *out);

/* A loss over the model output `out` (F32, read as rows (N, C) with C its
 * last dimension) and a target. Built-in losses return the mean and write
 * its gradient; a user function does both for its own loss. */
enum fsdp_loss_kind {
    FSDP_LOSS_CROSS_ENTROPY,      /* target I32 (N) class ids, shaped as out without its last
                                     dimension (or flat); mean over rows of -log softmax */
    FSDP_LOSS_SOFT_CROSS_ENTROPY, /* target F32 probability rows, out's shape; mean over rows of
                                     -sum_j target_j log softmax_j */
    FSDP_LOSS_MSE,                /* target F32, out's shape; mean over elements of (out - t)^2 */
    FSDP_LOSS_USER                /* fn below */
};
/* A user loss: given the output and the target (as passed to
 * fsdp_model_loss), sets *value to this rank's loss on its share and writes
 * d(value)/d(out) into dout (F32, out's shape, allocated by the caller).
 * It may set an error with fsdp_error. It may call collectives on the
 * model's communicators only if every rank calls it alike. */
typedef enum fsdp_status (*fsdp_loss_fn)(struct fsdp_ctx *ctx, const struct fsdp_tensor *out,
                                         const struct fsdp_tensor *target, void *ud, double *value,
                                         struct fsdp_tensor *dout);
struct fsdp_loss {                /* all zero: cross-entropy, no smoothing, nothing ignored */
    enum fsdp_loss_kind kind;
    float label_smoothing;        /* cross-entropy kinds: the target becomes
                                     (1 - s) target + s / C (PyTorch's label_smoothing), [0, 1] */
    int ignore;                   /* CROSS_ENTROPY: rows whose target is ignore_index count for
                                     nothing (gradient 0); the mean is over the other rows of the
                                     global micro-batch, counted by one all-reduce (COLLECTIVE
                                     then); a step of K micro-batches has the mean of their K
                                     means, as without `ignore` */
    int32_t ignore_index;         /* PyTorch's default is -100 */
    fsdp_loss_fn fn;              /* FSDP_LOSS_USER */
    void *ud;                     /* passed to fn */
};

/* Computes `loss` (NULL: cross-entropy) on out and target (both borrowed)
 * (out F32; or 16-bit, as fsdp_model_train_step's logits, PLAIN or ROWS16:
 * then plain cross-entropy only, no smoothing or ignored ids, its gradient
 * written over out in out's dtype and rows, dout->data == out->data, or not
 * at all; anything else is FSDP_ERR_INVALID naming it)
 * and, if dout is non-NULL, writes into *dout (F32, out's shape; allocated
 * from the arena when dout->data is NULL, and dout->data == out->data is
 * allowed: the output is then overwritten) the gradient of
 * value * loss_scale / accum, where loss_scale is the model's fp16 loss
 * scale (1 without one) and accum the number of micro-batches the step will
 * have. *value (may be NULL) gets this rank's mean loss. After a train-mode
 * forward, value / accum is added to the step's loss, which
 * fsdp_model_optim_step averages over the ranks (after an eval forward it
 * is only returned). A target whose dtype or shape does not fit out (the
 * same on every rank, so every rank fails alike), a class id outside
 * [0, C) (only the ranks holding it fail: agree on the status before the
 * next collective; with `ignore` at world > 1 every rank fails, the others
 * naming the first rank that did), a smoothing outside [0, 1] or a USER kind
 * without fn is FSDP_ERR_INVALID naming it. COLLECTIVE: no (yes with
 * `ignore`). */
enum fsdp_status fsdp_model_loss(struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct fsdp_loss *loss,
                                 const struct fsdp_tensor *out, const struct fsdp_tensor *target, int accum,
                                 double *value, struct fsdp_tensor *dout);

/* Runs backward from dout (d loss / d output, F32, the shape of the last
 * train-mode forward's output; borrowed): gathers each unit again, runs its
 * backward and reduce-scatters its gradient into the gradient shard (adding
 * to what earlier backwards of the step left), as fsdp_model_train_step
 * does. Without a train-mode forward since the last backward it is
 * FSDP_ERR_STATE; a dout of another shape or dtype is FSDP_ERR_INVALID.
 * When dout->data is the output's buffer (fsdp_model_loss wrote the
 * gradient over the output, as fsdp_model_train_step does) the buffer is
 * the library's: where the model's last layer multiplies in 16 bits it is
 * narrowed in place and its upper half reused, and a GPT reuses all of it
 * once lm_head has read it, so its contents are unspecified afterwards. A
 * 16-bit output (fsdp_model_train_step's) takes its gradient in its own
 * dtype and rows as well as in F32. */
enum fsdp_status fsdp_model_backward(struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct fsdp_tensor *dout);

/* Gradient synchronisation of the following backwards (on = 1, the default):
 * off, a backward keeps every unit's unsharded gradient and adds the next
 * backward's into it, reducing nothing (less communication, a full gradient
 * per unit held); the step's last backward must run with it on.
 * COLLECTIVE: no (set it alike on every rank). */
void fsdp_model_set_grad_sync(struct fsdp_model *fm, int on);

/* Ends the step: the step's loss averaged over the ranks, the global
 * gradient norm, fp16 loss scaling (an overflow skips the update on every
 * rank: res->skipped), clipping to `clip` (<= 0: none) and the optimizer
 * update with `lr` on every shard; res (NULL: none) gets what
 * fsdp_model_train_step reports. An lr that is not finite or is below 0, or
 * a clip that is NaN, is FSDP_ERR_INVALID before any work (the step stays
 * open, to be ended with good values). A non-finite loss or norm without
 * loss scaling is FSDP_ERR_NUMERIC naming the first unit (backward order)
 * holding inf or nan. Without a backward in the step, or after a backward with gradient
 * sync off, it is FSDP_ERR_STATE. */
enum fsdp_status fsdp_model_optim_step(struct fsdp_ctx *ctx, struct fsdp_model *fm, float lr, float clip,
                                       struct fsdp_step_result *res);

/* ---- Mixed precision: per-unit policy and loss scaling (src/fsdp/mixed.c) ----
 *
 * fsdp_parallelize_model's `precision` (compute) and config mixed_precision
 * give each unit (PyTorch FSDP's MixedPrecision):
 *   precision F32:          everything fp32 (mixed_precision is ignored)
 *   low = BF16 or F16, FULL:    param fp32, reduce fp32, compute low
 *                    DEFAULT: param low,  reduce fp32, compute low
 *                    PURE:    param low,  reduce low,  compute low
 * A unit's FSDP_OVR_MIXED_PRECISION override replaces mixed_precision for it;
 * an override to FULL keeps the unit wholly fp32 (compute too): the VISSL
 * prototypes head inside a bf16 model. Master weights, gradient shards and
 * optimizer state are always fp32; param_dtype is what the all-gather moves
 * (each rank casts its shard first) and what the layers see; the
 * reduce-scatter runs in reduce_dtype and lands in the fp32 gradient shard.
 * Tensors between modules (output_dtype) are fp32, except the 16-bit
 * hand-offs between layers and fsdp_model_train_step's logits. */
struct fsdp_unit_precision {
    enum fsdp_dtype param_dtype, reduce_dtype, output_dtype, compute_dtype;
    enum fsdp_mixed_precision mixed_precision; /* the unit's resolved mode */
};
void fsdp_model_unit_precision(const struct fsdp_model *fm, int i, struct fsdp_unit_precision *out);
/* Composer's precision names: "FP32", "AMP_BF16", "AMP_FP16" (case-insensitive)
 * -> FSDP_F32, FSDP_BF16, FSDP_F16; FSDP_ERR_INVALID naming the text otherwise. */
enum fsdp_status fsdp_precision_parse(struct fsdp_ctx *ctx, const char *name, enum fsdp_dtype *out);

/* Dynamic loss scaling (torch's GradScaler) in fsdp_model_train_step: the
 * loss gradient is multiplied by the scale, gradients are unscaled in the
 * optimizer update (clipping sees the true norm), and a non-finite loss or
 * global gradient norm (every rank sees the same) skips the update on every
 * rank and multiplies the scale by backoff_factor; after growth_interval
 * clean steps in a row the scale is multiplied by growth_factor.
 * fsdp_parallelize_model turns it on with these defaults when any unit
 * computes in FSDP_F16. */
struct fsdp_loss_scale_opts {
    int enabled;             /* 0: scale 1 and a non-finite step is FSDP_ERR_NUMERIC */
    double init_scale;       /* default 65536 */
    double growth_factor;    /* default 2 */
    double backoff_factor;   /* default 0.5 */
    int64_t growth_interval; /* default 2000 */
    /* test hook: at train step `inject_step` (0-based count of
       fsdp_model_train_step calls since the options were set; -1 = never,
       the default) rank `inject_rank` makes one gradient element +inf after
       backward, as an overflow would. The environment variables
       FSDP_INJECT_OVERFLOW_STEP and FSDP_INJECT_OVERFLOW_RANK set these
       when the options are set from the defaults. */
    int64_t inject_step;
    int inject_rank;
};
struct fsdp_loss_scale_opts fsdp_loss_scale_opts_default(void);
/* Sets (and resets: scale = init_scale, counters zero) the model's loss
 * scaling. A non-positive or non-finite factor is FSDP_ERR_INVALID.
 * COLLECTIVE: no (set it alike on every rank). */
enum fsdp_status fsdp_model_set_loss_scale(struct fsdp_ctx *ctx, struct fsdp_model *fm,
                                           const struct fsdp_loss_scale_opts *opts);
/* The current scale (1 when disabled) and the steps skipped so far. */
double fsdp_model_loss_scale(const struct fsdp_model *fm);
int64_t fsdp_model_skipped_steps(const struct fsdp_model *fm);

/* ---- Data (src/io) ---------------------------------------------------- */

/* Opens `path` to read without ever waiting on it: a FIFO, a socket or a
 * device is refused at once (an open of a FIFO waits for a writer that may
 * never come), not opened ([Note: regular files only], src/core/file.c).
 * Returns a descriptor (O_CLOEXEC, blocking; the caller closes it) and the
 * file's size in *size (may be NULL), or -1 with errno set: by open() or
 * fstat(), or EINVAL with *kind (may be NULL) naming what the path is
 * instead ("a directory", "a FIFO", ...). Every reader of the library
 * opens through it, and tools that read files can. COLLECTIVE: no. */
int fsdp_open_regular(const char *path, uint64_t *size, const char **kind);

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
 * sequences [r*B/world, (r+1)*B/world). inputs/targets are (B/world, T).
 * A file's tokens are read from the file at each call: a file that shrank or
 * changed since the open is FSDP_ERR_IO / FSDP_ERR_FORMAT naming it, and a
 * step below 0, a B or T below 1, a rank outside the world or a NULL buffer
 * is FSDP_ERR_INVALID (the message is on the context given to the open; d
 * NULL is FSDP_ERR_INVALID with none). COLLECTIVE: no. */
enum fsdp_status fsdp_data_batch(const struct fsdp_data *d, int64_t step, int B, int T, int rank, int world,
                                 int32_t *inputs, int32_t *targets);


/* ---- Image data (src/data) -------------------------------------------- */

/* An image set held in memory: count images of height x width x channels
 * uint8 pixels (HWC) and an I32 label each. */
struct fsdp_images;

enum fsdp_split { FSDP_SPLIT_TRAIN, FSDP_SPLIT_TEST };

/* Opens one split of a set stored as the MNIST distributions are: the folder
 * `dir` holds train-images-idx3-ubyte and train-labels-idx1-ubyte (the train
 * split), t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte (the test split),
 * each plain or gzip-compressed (name.gz; the plain file is preferred when
 * both exist). dir "fashion-mnist" is the folder of Debian's
 * dataset-fashion-mnist package (/usr/share/datasets/fashion-mnist). A
 * folder without the split's IDX image file may hold it in the raw format
 * instead (fsdp_images_open_raw): train.fsdpimg or test.fsdpimg, plain or
 * .gz. Every label must be < num_classes. A missing file, wrong magic, wrong
 * dimension count, truncated or overlong data, a label count that is not the
 * image count, or a label >= num_classes is one error naming the file.
 * *out is returned to the caller to free. COLLECTIVE: no. */
enum fsdp_status fsdp_images_open(struct fsdp_ctx *ctx, const char *dir, enum fsdp_split split, int num_classes,
                                  struct fsdp_images **out);
/* The same from an IDX image file (ubyte, 3 dimensions N x H x W, or 4:
 * N x H x W x C) and an IDX label file (ubyte, 1 dimension N). */
enum fsdp_status fsdp_images_open_idx(struct fsdp_ctx *ctx, const char *images_path, const char *labels_path,
                                      int num_classes, struct fsdp_images **out);
/* Opens a set in fsdp.c's raw format (README, "Raw image format"), for any
 * set that is not IDX: a 32-byte header (the magic "FSDPIMG1", then
 * little-endian uint32 count, height, width, channels 1-4, label size 1 or
 * 4, and 0), count x height x width x channels uint8 pixels (HWC, image
 * after image), then count labels, uint8 or little-endian int32; the whole
 * file plain or gzip-compressed. Every label must be in [0, num_classes),
 * num_classes at most 2^24. A wrong magic, a bad header field, truncated or
 * overlong data, or a label out of range is one error naming the file.
 * *out is returned to the caller to free. COLLECTIVE: no. */
enum fsdp_status fsdp_images_open_raw(struct fsdp_ctx *ctx, const char *path, int num_classes,
                                      struct fsdp_images **out);
void fsdp_images_free(struct fsdp_images *im); /* NULL: no-op */
struct fsdp_images_info {
    int64_t count;
    int channels, height, width, num_classes;
};
void fsdp_images_info(const struct fsdp_images *im, struct fsdp_images_info *out);
/* Image i's pixels (height x width x channels, borrowed) and label. */
const uint8_t *fsdp_images_pixels(const struct fsdp_images *im, int64_t i);
int32_t fsdp_images_label(const struct fsdp_images *im, int64_t i);

/* How batches are drawn. The training stream is epoch after epoch of the
 * set: global position g is image perm_e[g mod count] of epoch e = g /
 * count, perm_e the identity without shuffle, else a permutation drawn from
 * (seed, e). Augmentations are drawn from (seed, epoch, image index), so a
 * batch is the same at every world size. */
struct fsdp_image_batch_opts {
    uint64_t seed;
    int shuffle;         /* 1: a new permutation each epoch */
    int crop_padding;    /* > 0: a random height x width crop of the image zero-padded
                            by this many pixels on each side (torchvision RandomCrop) */
    int hflip;           /* 1: mirror left-right with probability 1/2 */
    float mean[4], std[4]; /* per channel: x = (p / 255 - mean) / std */
    int resized_crop;    /* 1: a random resized crop of the image back to height x width
                            (fsdp_images_random_resized_crop, view 0; before the flip);
                            exclusive with crop_padding */
    float crop_scale[2]; /* its scale range, default (0.08, 1) */
};
/* seed 0, shuffle on, no augmentation (crop_scale 0.08 to 1 when
 * resized_crop is turned on), Fashion-MNIST's mean 0.2860 and std 0.3530 in
 * every channel. */
struct fsdp_image_batch_opts fsdp_image_batch_opts_default(void);
/* Random resized crop (torchvision's RandomResizedCrop; the exact draws in
 * src/data/idx.c, [Note: random resized crop]): a box of image idx with an
 * area of scale_lo to scale_hi of the image's and an aspect ratio (width /
 * height) of 3/4 to 4/3, from up to 10 attempts, else the central crop,
 * drawn from (seed, epoch, idx, view) alone, so every rank and world size
 * draws the same; `view` numbers independent crops of one image in one
 * epoch (SwAV's multi-crop: views 0, 1 large, 2.. small). */
struct fsdp_crop_box {
    int top, left, height, width; /* inside the image */
};
void fsdp_images_crop_box(const struct fsdp_images *im, uint64_t seed, int64_t epoch, int64_t idx, int view,
                          float scale_lo, float scale_hi, struct fsdp_crop_box *out);
/* The box of image idx resized bilinearly (torch's interpolate, align_corners
 * false) to dst (channels, out_h, out_w), values p / 255 in [0, 1] (normalise
 * after). A box outside the image, idx out of range or a side outside
 * [1, 65536] is FSDP_ERR_INVALID. COLLECTIVE: no. */
enum fsdp_status fsdp_images_resized_crop(struct fsdp_ctx *ctx, const struct fsdp_images *im, int64_t idx,
                                          const struct fsdp_crop_box *box, int out_h, int out_w, float *dst);
/* Both: the random box of (seed, epoch, idx, view), resized to out_h x out_w.
 * 0 < scale_lo <= scale_hi <= 1, epoch >= 0, else FSDP_ERR_INVALID.
 * COLLECTIVE: no. */
enum fsdp_status fsdp_images_random_resized_crop(struct fsdp_ctx *ctx, const struct fsdp_images *im, uint64_t seed,
                                                 int64_t epoch, int64_t idx, int view, int out_h, int out_w,
                                                 float scale_lo, float scale_hi, float *dst);

/* This rank's share of global batch `step` of B images: positions step*B + i
 * for i in [rank*B/world, (rank+1)*B/world), as normalised fp32 images x
 * (n, channels, height, width) and labels (n), n = that share's size. With
 * shuffle and augmentation off, step s is images s*B ... s*B+B-1 in order
 * (wrapping at the end). Not thread-safe on one im (it caches the epoch's
 * permutation). COLLECTIVE: no. */
enum fsdp_status fsdp_images_batch(struct fsdp_ctx *ctx, struct fsdp_images *im, const struct fsdp_image_batch_opts *o,
                                   int64_t step, int64_t B, int rank, int world, float *x, int32_t *labels);

/* ---- GPT-2's byte-level BPE tokenizer (src/io/bpe.c, bpe_load.c) -------- */

struct fsdp_bpe;

/* Reads a tokenizer directory: GPT-2's encoder.json + vocab.bpe, or else a
 * Hugging Face tokenizer.json of GPT-2's kind (model.vocab, model.merges,
 * the ByteLevel pre-tokenizer). Every key, symbol and merge is checked; a bad
 * one fails naming the file (and line). *out is returned to the caller to
 * free with fsdp_bpe_free; it borrows ctx. Encoding keeps a cache in the
 * object: use one object from one thread at a time. COLLECTIVE: no. */
enum fsdp_status fsdp_bpe_open(struct fsdp_ctx *ctx, const char *dir, struct fsdp_bpe **out);
void fsdp_bpe_free(struct fsdp_bpe *b);
/* The largest id + 1. */
int fsdp_bpe_vocab_size(const struct fsdp_bpe *b);
/* Encodes the bytes text[0..len) (UTF-8 or not) as GPT-2 does; ids must hold
 * len entries (a token covers at least one byte); *n_ids is set. */
enum fsdp_status fsdp_bpe_encode(struct fsdp_bpe *b, const void *text, size_t len, int32_t *ids,
                                 size_t *n_ids);
/* The first offset >= from (and >= 1) where text may be cut so that encoding
 * the two parts gives the ids of the whole, or len if none: for streaming
 * large inputs in chunks. */
size_t fsdp_bpe_split(const void *text, size_t len, size_t from);
/* The bytes of token id (*len set), borrowed from b; NULL if id is not in
 * the vocabulary. */
const void *fsdp_bpe_token(const struct fsdp_bpe *b, int32_t id, size_t *len);
/* Decodes n ids into out[0..cap); *len is the decoded length, also when it
 * does not fit (then FSDP_ERR_INVALID). An id not in the vocabulary fails. */
enum fsdp_status fsdp_bpe_decode(struct fsdp_bpe *b, const int32_t *ids, size_t n, void *out,
                                 size_t cap, size_t *len);
/* A token source from the text file `path` encoded with b (as an llm.c token
 * file would hold it; the tokenizer's ids must fit 16 bits). *out is returned
 * to the caller to free. COLLECTIVE: no. */
enum fsdp_status fsdp_data_open_bpe(struct fsdp_ctx *ctx, const char *path, struct fsdp_bpe *b,
                                    int vocab_size, struct fsdp_data **out);

/* ---- Preparing a model: fsdp_parallelize_model (src/fsdp) --------------
 *
 * The one call that turns a module tree built with shapes only (or
 * materialized on rank 0) into a sharded model, in Composer's order:
 *   1. validate precision and the config;
 *   2. mark the modules ac_check selects for activation checkpointing;
 *   3. shard by the wrap policy (units may nest; a policy may override
 *      per-unit fields);
 *   4. initialise the shards unit by unit: from rank 0's values
 *      (sync_module_states), else from each parameter's own storage if it has
 *      one, else param_init (or the built-in init from `seed`);
 *   5. re-point the optimizer (built before sharding, its groups naming
 *      parameters by FQN) at the shards.
 *
 *   struct fsdp_parallel_config pc = fsdp_parallel_config_default();
 *   struct fsdp_wrap_policy wp = {fsdp_wrap_by_type, (void *)"Block"};
 *   struct fsdp_ac_check ac = {fsdp_ac_by_type, (void *)"Block"};
 *   pc.activation_checkpointing = 1;
 *   fsdp_parallelize_model(ctx, gpt, &pc, opt, FSDP_F32, &wp, &ac, NULL, &fm);
 */

enum fsdp_state_dict_type { FSDP_STATE_DICT_FULL, FSDP_STATE_DICT_SHARDED };

struct fsdp_parallel_config {
    int mesh[2];                 /* {0, 0} or {world, 0}: a 1-D mesh over every rank;
                                    2-D {replicas, shard group} (Composer's
                                    data_parallel_replicate/shard degrees, product =
                                    world): HYBRID_SHARD with that shard group */
    int reshard_after_forward;   /* default 1 (the root unit never reshards after forward) */
    int activation_checkpointing; /* default 0 */
    int activation_cpu_offload;  /* default 0; a CPU-only run has nowhere to offload to:
                                    FSDP_ERR_UNSUPPORTED */
    enum fsdp_state_dict_type state_dict_type; /* default FULL: what fsdp_model_save writes
                                    (FULL one safetensors file, SHARDED a folder) */
    int load_monolith_rank0_only; /* default 0: 1 = fsdp_model_load reads a full file on
                                    rank 0 only and broadcasts it unit by unit (Composer's;
                                    the load comes after sharding, so rank 0 never holds
                                    more than one unit and needs no materialized model:
                                    unlike Composer it does not imply sync_module_states) */
    enum fsdp_mixed_precision mixed_precision; /* default DEFAULT (as fsdp_shard_opts and
                                    fsdp-train); with a 16-bit precision: DEFAULT / PURE
                                    gather (and PURE reduces) in it, FULL keeps both fp32 */
    int sync_module_states;      /* default 0: 1 = rank 0's materialized values reach
                                    every rank's shards, unit by unit, and rank 0's
                                    buffers every rank's buffers */
    int verbose;                 /* default 0: 1 = rank 0 prints the unit plan (stderr) */
    uint64_t seed;               /* built-in init when param_init is NULL; default 1337 */
    int skip_init;               /* default 0: 1 = no init after sharding (neither param_init
                                    nor the built-in one): the parameters the model does not
                                    bring as values are zero, for a caller that loads every
                                    parameter next (fsdp-train's --resume: a checkpoint
                                    holds them all, fsdp_ckpt_load checks it) */
    enum fsdp_sharding sharding; /* default FULL_SHARD (a 2-D mesh: HYBRID_SHARD) */
    int overlap;                 /* default 1: prefetch and asynchronous reduce-scatters */
    int max_inflight;            /* default 2: gathered units at once (fsdp_shard_opts) */
    int lp_shard_copy;           /* default 0: 1 = 16-bit units keep their shard's 16-bit
                                    copy between steps (fsdp_shard_opts) */
};

struct fsdp_parallel_config fsdp_parallel_config_default(void);

struct fsdp_wrap_policy {
    fsdp_wrap_fn fn;             /* NULL: the root is the only unit */
    void *ud;
};

/* Selects the modules to checkpoint (non-zero: checkpoint m). Checkpointed
 * forward keeps only the module's input (which the caller must not modify
 * until backward); backward runs the forward again first. Gradients are
 * bit-identical to a run without checkpointing, and so are the buffers: the
 * forward run again does not update BatchNorm2d's running statistics a
 * second time (unlike torch.utils.checkpoint). */
typedef int (*fsdp_ac_check_fn)(struct fsdp_module *m, void *ud);
struct fsdp_ac_check {
    fsdp_ac_check_fn fn;
    void *ud;
};
/* Built-in: modules whose ops->type equals (const char *)ud. */
int fsdp_ac_by_type(struct fsdp_module *m, void *ud);

/* Fills dst (p->numel floats, the full parameter, row-major) with p's initial
 * values. Called for every parameter without storage, one unit at a time,
 * on every rank: it must give every rank the same values (e.g. use the FQN
 * and a seed). */
typedef enum fsdp_status (*fsdp_param_init_fn)(struct fsdp_ctx *ctx, struct fsdp_param *p, float *dst,
                                               void *ud);
struct fsdp_param_init {
    fsdp_param_init_fn fn;
    void *ud;
};

/* Prepares `root` (see above). precision is the compute dtype: FSDP_F32,
 * FSDP_BF16 or FSDP_F16 (see "Mixed precision" for what each unit then
 * gathers, computes and reduces in; F16 turns on loss scaling). opt may be
 * NULL; if it has taken steps its state is stale: cleared with a warning.
 * wrap, ac and param_init may be NULL (wrap NULL: a unit per Block). Giving ac
 * while both activation_checkpointing and activation_cpu_offload are 0 is
 * FSDP_ERR_INVALID; activation_checkpointing without ac checkpoints every
 * unit root but the model root. Materialized storage of root's parameters
 * is consumed (freed) by this call. *out is returned to the caller.
 * COLLECTIVE: yes (checks that every rank's model has the same parameter
 * names and shapes, and the same buffers (names, dtypes, shapes,
 * persistence), naming the first that differs, and broadcasts for
 * sync_module_states). */
enum fsdp_status fsdp_parallelize_model(struct fsdp_ctx *ctx, struct fsdp_module *root,
                                        const struct fsdp_parallel_config *cfg, struct fsdp_optim *opt,
                                        enum fsdp_dtype precision, const struct fsdp_wrap_policy *wrap,
                                        const struct fsdp_ac_check *ac,
                                        const struct fsdp_param_init *param_init, struct fsdp_model **out);
/* The fsdp_shard_opts fsdp_parallelize_model shards with for config c (its
 * sharding, mesh, reshard_after_forward, overlap, max_inflight,
 * mixed_precision, lp_shard_copy), `precision` and `wrap` (borrowed; NULL:
 * fsdp_shard_opts_default's, as fsdp_parallelize_model): what the planners
 * (fsdp_plan_memory_run, fsdp_plan_comm) take, so that they see the units
 * and strategy the model will have. c is not validated here.
 * COLLECTIVE: no. */
struct fsdp_shard_opts fsdp_parallel_config_shard_opts(const struct fsdp_parallel_config *c, enum fsdp_dtype precision,
                                                       const struct fsdp_wrap_policy *wrap);

/* The unit plan as text (rank 0 prints it when verbose): the tree of units
 * with parameter counts, bytes per rank, dtypes, overrides, and the
 * checkpointed modules. Writes at most cap bytes (NUL-terminated) and returns
 * the length the whole text needs. COLLECTIVE: no. */
size_t fsdp_model_plan(const struct fsdp_model *fm, char *buf, size_t cap);

/* Registers an optimizer parameter group (torch's param_groups): the
 * parameters named by fqns[0..n) (FQNs of the unsharded model; a tied alias
 * such as lm_head.weight names the parameter it is tied to) are all decayed
 * with weight_decay (whatever their no_decay flag) and use lr * lr_scale.
 * Parameters in no group use the optimizer's options. Names are matched when
 * the optimizer is attached to a model: a name matching no parameter is then
 * an error naming it. A name in two groups is FSDP_ERR_INVALID. fqns are
 * copied. COLLECTIVE: no. */
enum fsdp_status fsdp_optim_add_group(struct fsdp_optim *opt, const char *const *fqns, int n,
                                      float weight_decay, float lr_scale);
int fsdp_optim_n_groups(const struct fsdp_optim *opt); /* registered groups (not counting 0) */

/* A group's settings, changeable between steps (VISSL freezes the SwAV
 * prototypes for the first iterations, then lets them train). Groups are
 * numbered 1.. in the order fsdp_optim_add_group registered them (the group
 * just added is fsdp_optim_n_groups(opt)). A change applies from the next
 * optimizer step; the slices need no re-attaching.
 * frozen: the group's parameters and optimizer state stay bit-identical:
 * backward still runs through its layers (the gradients of their inputs
 * flow on), but its reduced gradients are zeroed once every reduction has
 * landed (as torch parameters whose grad is None: they count in neither the
 * global gradient norm nor clipping; fsdp_model_get_grad reads zeros), and
 * the optimizer skips it (no update, no weight decay, no state change).
 * AdamW's bias correction uses the optimizer's step count, which advances
 * while a group is frozen: a group unfrozen at step t is corrected as at t
 * (torch's per-parameter count would restart at 1). Bad group numbers or
 * values are FSDP_ERR_INVALID naming them. COLLECTIVE: no (set alike on
 * every rank). */
struct fsdp_optim_group_settings {
    float weight_decay, lr_scale;
    int frozen;
};
enum fsdp_status fsdp_optim_group_get(const struct fsdp_optim *opt, int group,
                                      struct fsdp_optim_group_settings *out);
enum fsdp_status fsdp_optim_group_set(struct fsdp_optim *opt, int group,
                                      const struct fsdp_optim_group_settings *s);

/* Gathers the full fp32 values of every parameter below `module` (all units
 * holding such a parameter) so they can be read or edited through
 * fsdp_param.data, e.g. with fsdp_module_find_param. With writeback, every
 * rank's edits of its own copy land in its shard at fsdp_summon_end (edit the
 * same way on every rank, e.g. from a fixed seed); without, edits are
 * discarded. rank0_only: only rank 0's parameters get values (others stay
 * shapes only); it cannot be combined with writeback. An eval-mode forward
 * (fsdp_module_set_training 0) may run while summoned, as torch's does: the
 * summoned units run on the summoned values without gathering (the same
 * output bits), e.g. to generate with the whole model on every rank. Nesting,
 * calling it from inside a forward or backward, and a training-mode forward,
 * a backward, an optimizer step, fsdp_model_init_params or a checkpoint's
 * save or load while summoned (or any forward of a rank0_only summon) are
 * FSDP_ERR_STATE. Nothing needs resetting afterwards (no
 * _reset_lazy_init): units keep no state derived from parameter values,
 * and the summoned buffers are separate from the units' own, so the next
 * forward simply gathers the (written-back) shards. Where a shard holds its
 * whole unit (one rank, or a shard group of one) a summon with writeback
 * hands out the shard itself: no copy and no memory, the edits in place.
 * Buffers (struct fsdp_buffer) are never sharded, so there is nothing to
 * summon: b->data always holds the full values on every rank, and an edit
 * of it takes effect at once on the rank that makes it, with or without
 * writeback (edit alike on every rank to keep the replicas equal).
 * COLLECTIVE: yes for fsdp_summon_full_params (it all-gathers); no for
 * fsdp_summon_end (each rank copies its own slice back). */
enum fsdp_status fsdp_summon_full_params(struct fsdp_ctx *ctx, struct fsdp_model *fm,
                                         struct fsdp_module *module, int writeback, int rank0_only);
enum fsdp_status fsdp_summon_end(struct fsdp_ctx *ctx, struct fsdp_model *fm);

/* A hook run after each optimizer update of the training step, on every
 * rank, in registration order (torch's optimizer step post-hooks; VISSL
 * renormalises the SwAV prototype rows to unit L2 norm there). `m` is the
 * module it was registered on. It runs with every unit sharded and idle, so
 * it may call fsdp_summon_full_params on a small module with write-back,
 * edit fsdp_param.data alike on every rank, and fsdp_summon_end (a summon
 * the hook leaves open is ended for it, honouring its write-back). It does
 * not run when a step was skipped (loss-scaling overflow, a non-finite
 * step). A hook is COLLECTIVE by contract: every rank runs it, so whatever
 * collectives it calls must be called on every rank; they are tagged
 * "post-step hook FQN", so the schedule check (FSDP_CHECK_COLLECTIVES /
 * fsdp_comm_set_check) or the watchdog names the hook when one rank calls a
 * collective the others do not. A hook's failure ends the step with its
 * status, the message naming the hook. The step's param_norm is measured
 * after the hooks. COLLECTIVE: no (registering; do it alike on every rank). */
typedef enum fsdp_status (*fsdp_post_step_fn)(struct fsdp_ctx *ctx, struct fsdp_model *fm, struct fsdp_module *m,
                                              void *ud);
enum fsdp_status fsdp_model_add_post_step_hook(struct fsdp_ctx *ctx, struct fsdp_model *fm,
                                               struct fsdp_module *m, fsdp_post_step_fn fn, void *ud);

/* ---- Checkpoints (src/fsdp/ckpt*.c, src/io/safetensors.c, st_write.c) - */

/* Training position saved with a sharded checkpoint. */
struct fsdp_ckpt_meta {
    int64_t step;        /* training steps done (the LR schedule position) */
    int64_t data_step;   /* index of the next global batch (fsdp_data_batch) */
    uint64_t seed;       /* init and sampling seed: the counter-based RNG's whole state */
    int has_config;      /* config is valid */
    struct fsdp_gpt_config config;
    char model_json[1024]; /* another model's config as the text of a JSON object ("" = none),
                              kept as meta.json's "model" (fsdp-train's image models) */
    char train_config[16384]; /* the training program's configuration as the text of a JSON
                                 object ("" = none), kept as meta.json's "train_config"
                                 (fsdp-train's resolved flags) */
    /* filled by load and read_meta (ignored by save): */
    int64_t optim_step;  /* the optimizer's step count at save time */
    int world;           /* world size the checkpoint was saved with */
    int has_optim_state; /* whether optimizer state was saved */
    int has_loss_scale;  /* the model's dynamic loss scaling state was saved (it had loss scaling
                            on); fsdp_ckpt_load restores it into a model that has loss scaling on: */
    double loss_scale;   /*   the scale, */
    int64_t loss_scale_growth_tracker; /* the clean steps since its last growth or backoff, */
    int64_t loss_scale_skipped;        /* and the steps skipped so far */
};

/* Buffers in checkpoints: the persistent buffers (fsdp_module_add_buffer's
 * persistent; non-persistent ones are never saved nor read) travel with the
 * parameters, whole, under their FQN and in their dtype (F32, or I64 for
 * counters such as num_batches_tracked). Loading a checkpoint, full or
 * sharded, that lacks a persistent buffer of the model is FSDP_ERR_FORMAT
 * naming the buffer; so is a dtype or shape that differs. */

/* Sharded checkpoint: the folder `dir` gets one safetensors file per rank
 * (that rank's slices of every parameter and of the optimizer state; rank
 * 0's file also holds the persistent buffers, whole) and meta.json (per
 * parameter: FQN, global shape, dtype and which element and byte ranges each
 * file holds; per buffer: FQN, dtype, shape, file and byte range; the step,
 * data position, seed, config, train_config, optimizer step count and the
 * dynamic loss scaling state). Written under dir.tmp, fsync'd, then renamed over
 * `dir`: a crash leaves the previous `dir` intact. No data moves between
 * ranks. Every checkpoint writer (this one, fsdp_model_save_full,
 * fsdp_ckpt_to_full, fsdp_ckpt_from_full) replaces only what a checkpoint
 * writer made: a `dir` (or dir.tmp) that is not a folder, or holds any other
 * file or folder, and a full file `path` (or path.tmp) that fsdp.c did not
 * write, are refused with FSDP_ERR_INVALID naming them, before anything is
 * written. A save that fails (a full disk) removes what it made itself (the
 * ranks' files, and dir.tmp if it created it) and returns the error; the
 * previous `dir` stays. COLLECTIVE: yes (three small agreements on success). */
enum fsdp_status fsdp_ckpt_save(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *dir,
                                const struct fsdp_ckpt_meta *meta);
/* Loads a sharded checkpoint saved at any world size into fm (same model,
 * any world size): each rank reads only the byte ranges (in 1 MiB checksum
 * chunks) that overlap its shards, verifying checksums, and every buffer
 * whole (every rank gets the buffers). The optimizer state
 * and step count are restored when fm has an optimizer attached and the
 * checkpoint has state of the same kind; the loss scaling state (scale,
 * growth tracker, skipped steps) when fm has loss scaling on and the
 * checkpoint has that state. *meta may be NULL.
 * COLLECTIVE: yes (every rank returns the same status and message). */
enum fsdp_status fsdp_ckpt_load(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *dir,
                                struct fsdp_ckpt_meta *meta);
/* Removes a checkpoint folder: its rank files, then its meta.json (so a removal
 * cut short still reads as a checkpoint, and removing it again finishes), then
 * the folder.
 * Refuses (removing nothing) when `dir` holds anything else, naming it. A
 * rank file that cannot be removed fails naming it, with meta.json left in
 * place. A regular file `dir` is removed when a checkpoint writer made it (a
 * full file), else refused.
 * COLLECTIVE: no. */
enum fsdp_status fsdp_ckpt_remove(struct fsdp_ctx *ctx, const char *dir);
/* Whether path is a checkpoint a writer of this library made: a folder
 * whose meta.json is ours (it opens with its seal), or a safetensors file
 * carrying our checksums; not whether it is whole (fsdp_ckpt_describe
 * verifies). A file or folder of someone else's that only bears a
 * checkpoint's name is not. COLLECTIVE: no. */
int fsdp_ckpt_is_ours(const char *path);
/* The check every sharded checkpoint writer (fsdp_ckpt_save,
 * fsdp_ckpt_from_full_model) runs on rank 0 before writing the folder `dir`,
 * on its own, for a caller that wants to know before the work that produces
 * it (fsdp-train checks the steps it will save before step 1): `dir` and
 * `dir.tmp` are each absent or a folder holding only files a checkpoint
 * writer made; otherwise FSDP_ERR_INVALID naming the entry (a user's file,
 * a regular file given as the folder). Creates nothing. COLLECTIVE: no. */
enum fsdp_status fsdp_ckpt_check_target(struct fsdp_ctx *ctx, const char *dir);
/* Reads only meta.json (e.g. the model config before building the model).
 * COLLECTIVE: no. */
enum fsdp_status fsdp_ckpt_read_meta(struct fsdp_ctx *ctx, const char *dir, struct fsdp_ckpt_meta *meta);

/* Full checkpoint: one safetensors file of every parameter under its FQN
 * (the fp32 values of the shards, whatever the units gather in), then every
 * persistent buffer (rank 0's values; the header key "fsdp.buffers" lists
 * their FQNs), written by rank 0 while units are gathered one at a time
 * (rank 0 holds one unit beyond its shards). COLLECTIVE: yes. */
enum fsdp_status fsdp_model_save_full(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *path);
/* The check every full-file writer (fsdp_model_save_full, fsdp_ckpt_to_full)
 * runs before writing `path`, on its own, for a caller that wants to know
 * before the work that produces the file (fsdp-train checks --save-full
 * before step 1): `path` and `path.tmp` are each absent or a file fsdp.c
 * wrote; otherwise FSDP_ERR_INVALID naming it (a file of someone else's, a
 * device such as /dev/null, a folder). Creates nothing. COLLECTIVE: no. */
enum fsdp_status fsdp_ckpt_check_full_target(struct fsdp_ctx *ctx, const char *path);
/* Loads a full safetensors file: ours, or Hugging Face GPT-2 names
 * ("h.0.attn.c_attn.weight", with or without "transformer.") whose Conv1D
 * weights are (in, out) and get transposed; attn.bias / attn.masked_bias
 * buffers and a tied lm_head.weight are ignored. Buffers of the model are
 * read by FQN (e.g. "bn1.running_mean", an I64 "bn1.num_batches_tracked"
 * from a PyTorch state dict), whole, in their own dtype; a non-persistent
 * buffer's tensor in the file is skipped. Every rank reads only its own
 * ranges (and every buffer); rank0_only: rank 0 reads each unit and
 * broadcasts it, then the buffers. A parameter value that is NaN or
 * infinite is FSDP_ERR_FORMAT naming the file, the tensor and the element
 * (a training step never writes one). COLLECTIVE: yes. */
enum fsdp_status fsdp_model_load_full(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *path,
                                      int rank0_only);

/* A checkpoint of the kind fsdp_parallelize_model's config names
 * (Composer's state_dict_type): SHARDED writes the folder `path` as
 * fsdp_ckpt_save (with meta), FULL the file `path` as fsdp_model_save_full
 * (meta unused). COLLECTIVE: yes. */
enum fsdp_status fsdp_model_save(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *path,
                                 const struct fsdp_ckpt_meta *meta);
/* Loads either kind: a folder as fsdp_ckpt_load (meta filled), a file as
 * fsdp_model_load_full (meta, when not NULL, zeroed), rank 0 alone reading it
 * and sending each unit, then the buffers, when the config's
 * load_monolith_rank0_only is set (Composer's; rank 0 also tells the others
 * which kind `path` is, so they never open, nor even look at, it).
 * COLLECTIVE: yes (every rank returns the same status). */
enum fsdp_status fsdp_model_load(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *path,
                                 struct fsdp_ckpt_meta *meta);
/* As fsdp_model_load, the parameters and buffers only (Composer's
 * load_weights_only): a sharded folder's optimizer state, step count and
 * loss scale are not read, whatever optimizer saved it, and fm's optimizer
 * starts from zero state (fine-tuning from a checkpoint). COLLECTIVE: yes. */
enum fsdp_status fsdp_model_load_weights(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *path);

/* Offline tools (no model needed). COLLECTIVE: no. */
/* Prints a checkpoint's contents (a sharded folder or a safetensors file) to
 * out; with verify, reads everything and checks every checksum. */
enum fsdp_status fsdp_ckpt_describe(struct fsdp_ctx *ctx, const char *path, int verify, FILE *out);
/* Sharded folder -> full safetensors file (parameters, then the buffers), one
 * tensor at a time. */
enum fsdp_status fsdp_ckpt_to_full(struct fsdp_ctx *ctx, const char *dir, const char *path);
/* Full safetensors file -> sharded folder of n_files files (no optimizer
 * state; step 0). The file is ours (fsdp_model_save_full, fsdp_ckpt_to_full),
 * any F32 file with our FQNs and (out, in) Linear weights, or Hugging Face
 * GPT-2 (HF names, Conv1D weights transposed, buffers and the tied lm_head
 * left out), as fsdp_model_load_full reads them. Buffers (the tensors our
 * "fsdp.buffers" key lists; in a file without that key, I64 tensors and
 * names ending in running_mean, running_var or num_batches_tracked) go
 * whole into file 0, F32 or I64. A parameter value that is NaN or infinite
 * is refused as fsdp_model_load_full refuses it; a conversion that fails
 * removes the files and the folder it made. */
enum fsdp_status fsdp_ckpt_from_full(struct fsdp_ctx *ctx, const char *path, const char *dir, int n_files);
/* The same, for the GPT of `config` (NULL: as above): the file must hold
 * exactly that model's parameters with its shapes (else an error naming the
 * parameter and both shapes), and meta.json records config, so that
 * fsdp-train --resume rebuilds the model without model flags. */
enum fsdp_status fsdp_ckpt_from_full_model(struct fsdp_ctx *ctx, const char *path, const char *dir, int n_files,
                                           const struct fsdp_gpt_config *config);

/* ---- Memory planning and limits (src/fsdp/plan.c, src/core) ----------- */

/* A per-rank cap on the library's accounted memory (fsdp_mem_get's
 * cur_total), as on an accelerator: an allocation that would pass it fails
 * with FSDP_ERR_NOMEM and a message naming what it was for. 0 (the default)
 * is no limit. COLLECTIVE: no. */
void fsdp_mem_set_limit(struct fsdp_ctx *ctx, size_t bytes);
size_t fsdp_mem_limit(const struct fsdp_ctx *ctx);
/* Parses a size: a number with an optional suffix K, M, G or T (powers of
 * 1024; "1.5G", "800M", "65536"). FSDP_ERR_INVALID naming the text if it is
 * not one. */
enum fsdp_status fsdp_mem_parse_size(struct fsdp_ctx *ctx, const char *text, size_t *out);

/* Bytes per rank of training in fsdp_mem_get's accounting, as the planner measures them. */
struct fsdp_mem_plan {
    int world, rank;
    int n_units;
    size_t params, grads, optim; /* this rank's shards (FSDP_MEM_SHARD); params includes the
                                    16-bit copy a 16-bit unit keeps for its gathers; grads the
                                    gradient shards in buffers of their own */
    size_t grads_lent; /* gradient shards in the activation arena's pages at once (within act:
                          a shard lives from its backward to the optimizer step, where
                          backward has released activations) */
    size_t full;      /* pooled full parameter and gradient buffers (FSDP_MEM_FULL) */
    size_t act;       /* activation arena at its peak, checkpointing included (FSDP_MEM_ACT) */
    size_t workspace; /* the rest the library allocates at its peak: comm requests, MPI's
                         staging of 16-bit reductions (FSDP_MEM_OTHER) */
    size_t total;     /* all kinds together at their peak (not the sum of the kinds' peaks) */
};

/* [Note: measure mode] The plan is measured, not computed: the planner
 * shards `root` in a measuring context (rank `rank` of `world` ranks that do
 * not exist: collectives complete at once and move no data; large blocks are
 * reserved, not committed), attaches the optimizer and runs the caller's
 * training step `steps` times with the kernels (GEMMs, convolutions, the
 * optimizer update) skipped, so every allocation, gather and release of the
 * real code happens and is counted, for any model, user modules included.
 * The step reads no values: give inputs of the real shapes (zeros do). */
struct fsdp_plan_opts {
    int world, rank;             /* the run planned (default 1, 0); world at most 2^20 */
    int threads;                 /* compute threads per rank while measuring (0: as now); the
                                    layers' per-thread scratch depends on it */
    struct fsdp_optim_opts optim; /* the optimizer attached (default fsdp_optim_opts_default) */
    int steps;                   /* steps measured (default 2: the second runs in the arena's
                                    merged chunk, as every later step) */
    long long shared_window;     /* plan the shm backend's shared window of the shards (README,
                                    FSDP_SHM_WINDOW: a training step's fp32 gathers hold no full
                                    buffer) when the window takes at most this many bytes (0:
                                    none); -1 (default): as ctx's communicator does; -2: as a shm
                                    communicator made now on this host would (a launch to come) */
    /* Optional (NULL: none): what the run does to its optimizer before
     * attaching it (parameter groups), and after attaching it, before its
     * first step (post-step hooks, re-initialisation). */
    enum fsdp_status (*prepare_optim)(struct fsdp_ctx *ctx, struct fsdp_optim *opt, void *ud);
    enum fsdp_status (*setup)(struct fsdp_ctx *ctx, struct fsdp_model *fm, struct fsdp_optim *opt, void *ud);
    /* One training step of fm (forward, loss, backward, fsdp_model_optim_step
     * or fsdp_model_train_step) on ctx, the measuring context. Required. */
    enum fsdp_status (*step)(struct fsdp_ctx *ctx, struct fsdp_model *fm, int step, void *ud);
    void *ud;
};
struct fsdp_plan_opts fsdp_plan_opts_default(void);

/* Plans the training of `root` (built with shapes only, not yet sharded;
 * checkpointing as set on its modules) under `so` (NULL: defaults) by
 * measuring it (above). Leaves root as it was (compute dtypes, buffers'
 * values). The model's buffers, allocated when it was built, are not part
 * of the plan. A module whose forward or backward fails in measure mode
 * fails the plan with a message naming it. COLLECTIVE: no. */
enum fsdp_status fsdp_plan_memory_run(struct fsdp_ctx *ctx, struct fsdp_module *root,
                                      const struct fsdp_shard_opts *so, const struct fsdp_plan_opts *po,
                                      struct fsdp_mem_plan *out);
/* Whether ctx is the planner's measuring context: a user module may skip
 * its arithmetic then (it must still allocate as it would). */
int fsdp_ctx_measuring(const struct fsdp_ctx *ctx);

/* fsdp_plan_memory_run for a model trained on tokens by
 * fsdp_model_train_step_accum (the GPT): `accum` micro-batches of (B_local,
 * T) per rank in `mode`, an optimizer keeping `optim_state` floats per
 * element (2: AdamW, 1: SGD with momentum, 0: SGD), `threads` compute
 * threads. Any sharding strategy (HYBRID_SHARD without a shard_group is
 * planned with one host: a group of `world`). COLLECTIVE: no. */
enum fsdp_status fsdp_plan_memory_accum(struct fsdp_ctx *ctx, struct fsdp_module *root,
                                        const struct fsdp_shard_opts *opts, int world, int rank,
                                        int optim_state, int B_local, int T, int threads, int accum,
                                        enum fsdp_grad_accum mode, struct fsdp_mem_plan *out);
/* The same with accum = 1. COLLECTIVE: no. */
enum fsdp_status fsdp_plan_memory(struct fsdp_ctx *ctx, struct fsdp_module *root,
                                  const struct fsdp_shard_opts *opts, int world, int rank,
                                  int optim_state, int B_local, int T, int threads,
                                  struct fsdp_mem_plan *out);

#ifdef __cplusplus
}
#endif
#endif /* FSDP_H */
