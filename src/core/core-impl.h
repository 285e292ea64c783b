/*
 * core-impl.h - internal API of src/core: the context struct, errors,
 * accounted allocation, the activation arena, the counter-based RNG, logging
 * and dtype conversion. Everything above core includes this header.
 * Invariant: every byte the library allocates goes through fsdp__alloc so
 * that fsdp_mem_get sees it (except MPI's and oneDNN's own memory), or, for
 * small bookkeeping, through fsdp__malloc and its family (unaccounted, but
 * counted by the allocation-failure injection).
 */
#ifndef FSDP_CORE_IMPL_H
#define FSDP_CORE_IMPL_H

#include <stdatomic.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fsdp.h"

/* ---- The context ---- */
struct fsdp_ctx {
    int rank, world;
    int verbose;
    int threads;
    struct fsdp_comm *comm;          /* owned; created by fsdp_ctx_create */
    char errmsg[1024];
    struct fsdp_mem_stats mem;
    size_t mem_limit;                /* fsdp__alloc refuses past this many bytes; 0 = none */
    int measure;                     /* a measuring context ([Note: measure mode], src/fsdp/plan.c):
                                        large blocks are reserved, not committed */
    /* activation arena: one growing list of chunks, reset per step */
    struct fsdp__arena_chunk *arena; /* current chunk (head of list) */
    size_t arena_used;               /* bytes handed out in total (mark) */
    size_t arena_high;               /* largest arena_used since the last reset */
    size_t arena_lent_high;          /* most bytes lent at once (fsdp__arena_lend) */
    size_t arena_lend_room;          /* bytes kept free below lent ones, grown when an
                                        allocation met them (fsdp__arena_lend) */
    void *arena_lender;              /* who holds the lent bytes, and what takes them back */
    void (*arena_reclaim)(struct fsdp_ctx *ctx, void *lender);
    const void *dead_dout;           /* the output gradient fsdp_model_backward hands the root
                                        when it is the library's: dead once the root's last
                                        layer has taken it (GPT's backward releases it) */
    const struct fsdp_module *dead_for; /* the module dead_dout is handed to: the root, or a
                                        child its releasing parent hands a dead gradient
                                        ([Note: backward releases the blocks], gpt.c) */
    struct fsdp__profile *prof;      /* time by module, NULL until fsdp_profile_enable ([Note:
                                        module profile], src/nn/profile.c) */
    int recompute;                   /* > 0 while a checkpointed module's forward runs
                                        again inside its backward (module.c): a layer
                                        with state (BatchNorm2d's running statistics)
                                        leaves it as the first forward left it */
};

/* Allocates an empty context (world of one, no comm). */
enum fsdp_status fsdp__ctx_alloc(struct fsdp_ctx **out);
/* Frees what fsdp__ctx_alloc made (not the comm). */
void fsdp__ctx_release(struct fsdp_ctx *ctx);

/* ---- Bookkeeping behind the public structs ----
 * struct fsdp_param and struct fsdp_module show what a module needs (names,
 * shapes, data, grad); the library's own state of each is here, allocated
 * with it (fsdp_module_add_param, fsdp_module_create) and reached through
 * its `priv`. */
struct fsdp__unit;
struct fsdp__param_priv {
    const void *data_lp; /* the same values as data in data_lp_dtype (BF16 / F16) while the
                            sharding layer gathered them in that dtype, else NULL */
    enum fsdp_dtype data_lp_dtype;
    const float *data_src; /* with data_lp NULL: the fp32 values data_lp would be the rounding to
                            data_lp_dtype of (a shard group of one reads its shard in place:
                            [Note: 16-bit values from the shard] in src/fsdp/mixed.c), else NULL */
    int lp_reader;       /* set by a built-in layer that reads these values only through data_lp
                            when gathered 16-bit (Linear and Embedding weights); others get data */
    int data_stale;      /* a 16-bit training pass gathered data_lp (or data_src) alone and data is NULL
                            (lp_reader only); an fp32 reader widens a copy (fsdp__pdata_f32) */
    int grad_writer;     /* set by a built-in layer whose backward takes this gradient only through
                            the library's accessors, which honour grad_unset; cleared by sharding
                            when a layer without it shares the parameter (tied_to) */
    int grad_unset;      /* grad holds no values yet: the first writer overwrites it (set by the
                            sharding layer on grad_writer parameters instead of zeroing) */
    int owns_data;       /* data (and grad) allocated by fsdp_module_materialize / zero_grad */
    struct fsdp__unit *unit; /* the sharding layer's unit holding it, else NULL */
};
/* Called around a module's forward and backward by the dispatchers; the
 * sharding layer sets these on unit roots. */
struct fsdp_module_hooks {
    enum fsdp_status (*pre_forward)(void *data, struct fsdp_ctx *ctx);
    enum fsdp_status (*post_forward)(void *data, struct fsdp_ctx *ctx);
    enum fsdp_status (*pre_backward)(void *data, struct fsdp_ctx *ctx);
    enum fsdp_status (*post_backward)(void *data, struct fsdp_ctx *ctx);
};
struct fsdp__module_priv {
    int cap_children, cap_params, cap_buffers; /* allocated lengths of the arrays */
    const struct fsdp_module_hooks *hooks;
    void *hook_data;
    struct fsdp_tensor ckpt_in; /* the saved input while checkpointed (arena) */
    int ckpt_saved;             /* ckpt_in is valid (forward ran, backward not yet) */
    enum fsdp_dtype dout_dtype; /* the 16-bit dtype in which the last forward's backward takes
                                   its output gradient as it is (BF16 / F16), or FSDP_F32: set by
                                   the layer's forward ([Note: 16-bit output gradient],
                                   src/nn/precision.c) */
    enum fsdp_layout dout_layout; /* and in which layout: ROWS16 where it takes padded rows (a
                                     Linear; [Note: padded rows], src/fsdp/step.c), else PLAIN */
};

/* ---- Errors ---- */
/* In a measuring context, prefixes the message with the module whose
 * `pass` ("forward", "backward") failed (the innermost; once); returns st. */
enum fsdp_status fsdp__measure_failed(struct fsdp_ctx *ctx, const struct fsdp_module *m, const char *pass,
                                      enum fsdp_status st);
/* Records a printf-style message on ctx and returns st (for `return fsdp__err(...)`). */
enum fsdp_status fsdp__err(struct fsdp_ctx *ctx, enum fsdp_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Always-on invariant check: prints "rank N: file:line: msg" and aborts the job. */
#define FSDP_ASSERT(cond, ...)                                                       \
    do {                                                                             \
        if (!(cond)) fsdp__assert_fail(__FILE__, __LINE__, #cond, __VA_ARGS__);      \
    } while (0)
_Noreturn void fsdp__assert_fail(const char *file, int line, const char *cond, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* The abort hook used by FSDP_ASSERT (set by the comm layer to MPI_Abort). */
extern void (*fsdp__abort_hook)(int code);
extern int fsdp__global_rank;

/* ---- Environment variables ([Note: environment variables], env.c) ----
 * NAME (one of env.c's list, which says what each takes) into *out: its
 * value, or def when unset or empty; any other value is FSDP_ERR_INVALID
 * with ctx's message (ctx may be NULL) "environment variable NAME='value':
 * expected ...". */
enum fsdp_status fsdp__env_int(struct fsdp_ctx *ctx, const char *name, long long def, long long *out);
enum fsdp_status fsdp__env_real(struct fsdp_ctx *ctx, const char *name, double def, double *out);
/* The index of NAME's value in its list of words. */
enum fsdp_status fsdp__env_word(struct fsdp_ctx *ctx, const char *name, int def, int *out);
/* For callers with no status to return: a whole number's value, a word's
 * index, or 1 for a set FSDP_FAULT; def when unset or empty. A refused
 * value is a broken invariant (FSDP_ASSERT naming it): fsdp_ctx_create
 * checked every variable before anything could read one. */
long long fsdp__env_checked(const char *name, long long def);
/* FSDP_FAULT's syntax (fault.c), for env.c's check. */
int fsdp__fault_spec_ok(const char *value);

/* Propagates a non-OK status. */
#define FSDP_TRY(expr)                               \
    do {                                             \
        enum fsdp_status fsdp__st_ = (expr);         \
        if (fsdp__st_ != FSDP_OK) return fsdp__st_;  \
    } while (0)

/* ---- Logging (stderr) ---- */
void fsdp__log(const struct fsdp_ctx *ctx, int level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* ---- Accounted allocation ---- */
/* The most elements a parameter, and a unit's parameters together, may hold
 * (2^48: 1 PiB of fp32): every byte count the library forms from them (a
 * shard with its optimizer state, a 16-bit copy, a unit's offsets) then fits
 * in 64 bits with room, and a shape that would wrap one is refused where it
 * is declared. */
#define FSDP__MAX_NUMEL ((int64_t)1 << 48)
/* Set while a measured step runs ([Note: measure mode], src/fsdp/plan.c):
 * the kernels (GEMM, oneDNN primitives), the layers' element-wise loops,
 * the optimizer update, initialisation and the precision casts skip their
 * arithmetic, while every allocation, arena call, gather and release still
 * happens. Process-wide, not per thread: the layers' OpenMP workers read it
 * too (so no other thread of the process may train while a plan runs). */
extern int fsdp__measuring;
/* 64-byte aligned; returns NULL and sets errmsg naming `what` on failure. */
void *fsdp__alloc(struct fsdp_ctx *ctx, size_t bytes, enum fsdp_mem_kind kind, const char *what);
void *fsdp__calloc(struct fsdp_ctx *ctx, size_t bytes, enum fsdp_mem_kind kind, const char *what);
/* [Note: reserved blocks] A block from fsdp__reserve is allocated as by
 * fsdp__alloc (mapped pages when large: [Note: large blocks are mapped] in
 * core.c) but accounted as it is used: fsdp__commit(p, upto) counts its
 * first `upto` bytes (rounded up to a page) against the block's kind and
 * the memory limit, once; fsdp__free subtracts what was counted. Fresh
 * mapped pages take no memory until written, so a block used only in part
 * (the activation arena's chunk, whose tail an allocation too large for it
 * skips) costs what its used part costs, and is counted so. */
void *fsdp__reserve(struct fsdp_ctx *ctx, size_t bytes, enum fsdp_mem_kind kind, const char *what);
/* A reserved block spanning the machine's memory (or ctx's memory limit,
 * if lower) in address space only (MAP_NORESERVE; the activation arena's one
 * chunk, [Note: one arena chunk] in arena.c); *bytes gets its size. NULL,
 * with nothing set or counted, where that is less than min bytes,
 * FSDP_ARENA_SPAN=0 asks for growing
 * chunks (tests cover that path so) or the mapping is refused (strict
 * overcommit, an address-space limit). */
void *fsdp__reserve_span(struct fsdp_ctx *ctx, enum fsdp_mem_kind kind, size_t min, size_t *bytes);
/* 0, or -1 with the limit error set (naming `what`) when the growth would
 * exceed ctx's memory limit (nothing counted then). */
int fsdp__commit(struct fsdp_ctx *ctx, void *p, size_t upto, const char *what);
/* After fsdp_arena_alloc returned NULL (its message names the cause: the
 * memory limit, or the allocation): sets the message to the caller's text
 * followed by that cause, and returns FSDP_ERR_NOMEM. */
enum fsdp_status fsdp__arena_err(struct fsdp_ctx *ctx, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Counts (add 1) or uncounts (add 0) `bytes` of memory the library holds
 * outside fsdp__alloc (a communicator's shared window, [Note: shared
 * window] in src/fsdp/unit.c) against `kind`; counting checks the memory
 * limit first: 0, or -1 with the limit error set (naming `what`). */
int fsdp__mem_count(struct fsdp_ctx *ctx, enum fsdp_mem_kind kind, size_t bytes, int add, const char *what);
/* Frees memory from fsdp__alloc or fsdp__reserve; NULL is a no-op. */
void fsdp__free(struct fsdp_ctx *ctx, void *p);
/* Allocation-failure injection (tests): every library allocation made by a
 * thread increments that thread's fsdp__alloc_count; the call that makes it
 * equal the thread's fsdp__alloc_fail_at (when > 0) fails as if out of
 * memory. Per thread, so that the background threads (the MPI progress
 * thread, the shm engine's) neither shift the count of the thread under
 * test nor fail: the k-th allocation is the same call on every rank, and a
 * collective that one rank skips for lack of memory is skipped by all. */
extern _Thread_local long fsdp__alloc_count, fsdp__alloc_fail_at;
/* Allocations that failed (injected or not), so that a parser that returns
 * NULL for both (cJSON) can say out of memory rather than bad input. */
extern long fsdp__alloc_failures;
/* Unaccounted bookkeeping (names, pointer arrays, parser output): malloc,
 * calloc, realloc and strdup that count as library allocations for the
 * injection hook; free them with free(). src/ calls no other allocator but
 * in two places that say why: the optimizer's per-chunk partial sums
 * (src/optim/optim.c) and the 16-bit GEMM's aligned per-thread scratch
 * (src/nn/gemm_lp.c). */
void *fsdp__malloc(size_t n);
void *fsdp__zalloc(size_t n, size_t size);
void *fsdp__realloc(void *p, size_t n);
char *fsdp__strdup(const char *s);
/* Bytes of outside data (a file's names and keys) for a message, in buf:
 * printable ASCII as it is, every other byte, '"' and '\\' as \xNN, cut
 * with "..." after 40 bytes. Returns buf. */
const char *fsdp__shown(const void *s, size_t n, char *buf, size_t cap);
/* Routes cJSON's allocations through fsdp__malloc (once per process; every
 * context creation calls it). */
void fsdp__json_hooks(void);

/* ---- Fault injection (fault.c, [Note: fault injection]) ---- */
/* Env FSDP_FAULT=POINT:RANK:STEP[:kill|stop|fail]: the named rank raises
 * SIGKILL (or SIGSTOP) on itself at the first call with this `point`
 * ("forward", "backward", "reduce-scatter", "ckpt-save", "ckpt-remove",
 * "ckpt-commit") once fsdp__fault_step >= STEP; with fail (ckpt-commit only)
 * it returns 1 instead, and the caller fails as on an I/O error (0 otherwise).
 * `where` (may be NULL) is printed with it, e.g. the unit. */
int fsdp__fault_point(const char *point, const char *where);
/* Training steps started in this process (fsdp_model_train_step counts them). */
extern long fsdp__fault_step;

/* ---- Arena ---- */
void fsdp__arena_free_all(struct fsdp_ctx *ctx);
/* When p (an allocation of `bytes`) is the arena's last, shrinks it to its
 * first `keep` bytes, handing the rest back, and returns 1; else 0. */
int fsdp__arena_shrink(struct fsdp_ctx *ctx, void *p, size_t bytes, size_t keep);
/* When p (an allocation of `bytes`) is the arena's last and mark (a
 * fsdp_arena_mark of the same chunk) lies at or below it, moves its bytes
 * down to the mark, hands back everything above them and returns their new
 * address; else NULL and nothing changes. */
void *fsdp__arena_slide(struct fsdp_ctx *ctx, size_t mark, void *p, size_t bytes);
/* `bytes` lent from the arena's resident pages above what is in use, valid
 * until fsdp__arena_unlend or the next reset or free (which first call
 * reclaim_fn(ctx, lender)), or NULL where there is no room or another lender
 * holds lent bytes ([Note: bytes lent by the arena] in arena.c). */
void *fsdp__arena_lend(struct fsdp_ctx *ctx, size_t bytes, void *lender,
                       void (*reclaim_fn)(struct fsdp_ctx *ctx, void *lender));
/* Takes back every lent byte. */
void fsdp__arena_unlend(struct fsdp_ctx *ctx);

/* ---- Counter-based RNG (Philox4x32-10) ---- */
/* Four 32-bit words for (key, counter): a pure function. */
void fsdp__philox(uint64_t key, uint64_t counter, uint32_t out[4]);
/* 64-bit FNV-1a of a string, to key a parameter's stream by its FQN. */
uint64_t fsdp__hash_str(const char *s);
/* N(0,1) sample number `idx` of stream `key` (Box-Muller over one Philox block). */
float fsdp__normal_at(uint64_t key, uint64_t idx);
/* Uniform in [0,1) number `idx` of stream `key`. */
double fsdp__uniform_at(uint64_t key, uint64_t idx);
/* Value of element idx of a parameter initialised by `init` under (seed, fqn). */
float fsdp__init_value(struct fsdp_init init, uint64_t seed, const char *fqn, uint64_t idx);
/* Fills dst[0..n) with elements [start, start+n) of a parameter. */
void fsdp__init_fill(struct fsdp_init init, uint64_t seed, const char *fqn, uint64_t start,
                     float *dst, size_t n);

/* ---- The CPU's vector paths (cpu.c, [Note: vector paths at run time]) ---- */
enum fsdp__isa { FSDP__ISA_SCALAR, FSDP__ISA_AVX2, FSDP__ISA_AVX512, FSDP__ISA_AVX512BF16 };
/* the level the library's own vector paths run at: the CPU's best, capped by
 * FSDP_MAX_CPU_ISA; the same value on every call (inline: the conversions
 * and softmax rows ask it per row) */
extern _Atomic int fsdp__isa_level; /* -1 until fsdp__cpu_isa_init */
enum fsdp__isa fsdp__cpu_isa_init(void);
static inline enum fsdp__isa fsdp__cpu_isa(void) {
    int l = atomic_load_explicit(&fsdp__isa_level, memory_order_relaxed);
    return l >= 0 ? (enum fsdp__isa)l : fsdp__cpu_isa_init();
}
/* the CPU's best level, whatever the cap */
enum fsdp__isa fsdp__cpu_isa_detected(void);
const char *fsdp__isa_name(enum fsdp__isa isa);
/* the function attributes of each level's paths (x86-64 builds only) */
#define FSDP__TARGET_AVX2 __attribute__((target("avx2,f16c")))
#define FSDP__TARGET_SSE42 __attribute__((target("sse4.2"))) /* the crc32 instruction, in AVX2's level */
#define FSDP__TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c")))
#define FSDP__TARGET_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,f16c")))

/* ---- Dtype conversion (dtype.c) ---- */
/* fp32 -> bf16 / fp16 round to nearest even (subnormals kept, overflow to inf,
 * NaN stays NaN, quieted); bf16 / fp16 -> fp32 is exact. */
uint16_t fsdp__f32_to_bf16(float f);
/* inline: a loop that widens as it reads vectorizes it (GELU's, [Note: GELU
 * widening in the loop]); the bits are the top half of the fp32 value */
static inline float fsdp__bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
uint16_t fsdp__f32_to_f16(float f);
float fsdp__f16_to_f32(uint16_t h);
/* The same over arrays of n elements (the CPU's vector paths, bit-identical
 * to the scalar forms); src and dst must not overlap. */
void fsdp__cvt_f32_to_bf16(const float *src, uint16_t *dst, size_t n);
void fsdp__cvt_bf16_to_f32(const uint16_t *src, float *dst, size_t n);
void fsdp__cvt_f32_to_f16(const float *src, uint16_t *dst, size_t n);
void fsdp__cvt_f16_to_f32(const uint16_t *src, float *dst, size_t n);
/* Dispatch on dt (F32: a copy; BF16, F16 as above; others: FSDP_ASSERT). */
void fsdp__cvt_from_f32(enum fsdp_dtype dt, const float *src, void *dst, size_t n);
void fsdp__cvt_to_f32(enum fsdp_dtype dt, const void *src, float *dst, size_t n);
/* dst = src rounded to dt (BF16, F16; F32: a copy) and widened back: the
 * values a 16-bit copy holds, in fp32. dst may equal src. */
void fsdp__cvt_round(enum fsdp_dtype dt, const float *src, float *dst, size_t n);

/* x[0..n) = 0, split over the OpenMP team when n is large (a serial memset
 * of a GPT-2 gradient, 0.5 GB, left the other threads waiting). */
void fsdp__zero(float *x, int64_t n);

/* ---- Files the library reads (file.c, [Note: regular files only]) ---- */
/* Opens path read-only without blocking, refuses anything but a regular file
 * (a FIFO would hang the open or the read), then makes the descriptor
 * blocking. Messages read "<what> '<path>': ..." (or "<path>: ..." when what
 * is NULL). On success *fd (O_CLOEXEC, the caller closes it) and *size (may
 * be NULL). COLLECTIVE: no. */
enum fsdp_status fsdp__open_regular(struct fsdp_ctx *ctx, const char *what, const char *path, int *fd,
                                    uint64_t *size);
/* Reads all of the regular file path into *out (malloc'd, NUL-terminated,
 * returned to the caller to free; *len its length, may be NULL);
 * FSDP_ERR_FORMAT if it holds more than max bytes. */
enum fsdp_status fsdp__read_file(struct fsdp_ctx *ctx, const char *what, const char *path, size_t max,
                                 char **out, size_t *len);

/* ---- Time ---- */
double fsdp__now(void); /* monotonic seconds */

#endif
