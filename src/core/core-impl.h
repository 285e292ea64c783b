/*
 * core-impl.h - internal API of src/core: the context struct, errors,
 * accounted allocation, the activation arena, the counter-based RNG, logging
 * and dtype conversion. Everything above core includes this header.
 * Invariant: every byte the library allocates goes through fsdp__alloc so
 * that fsdp_mem_get sees it (except MPI's and oneDNN's own memory).
 */
#ifndef FSDP_CORE_IMPL_H
#define FSDP_CORE_IMPL_H

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

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
};

/* Allocates an empty context (world of one, no comm). */
enum fsdp_status fsdp__ctx_alloc(struct fsdp_ctx **out);
/* Frees what fsdp__ctx_alloc made (not the comm). */
void fsdp__ctx_release(struct fsdp_ctx *ctx);

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
 * The value of NAME, or def when unset or empty; any other value outside
 * what the variable takes ends the process naming the variable. */
long long fsdp__env_int(const char *name, long long def, long long lo, long long hi);
double fsdp__env_real(const char *name, double def, double lo, double hi);
/* The index of NAME's value in words[0..n) */
int fsdp__env_word(const char *name, const char *const *words, int n, int def);
/* Ends the process over NAME's value: "fsdp: environment variable
 * NAME='value': expected <fmt...>", exit status 2 (the whole job under MPI). */
_Noreturn void fsdp__env_refuse(const char *name, const char *value, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

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
/* Frees memory from fsdp__alloc; NULL is a no-op. */
void fsdp__free(struct fsdp_ctx *ctx, void *p);
/* Allocation-failure injection (tests): every fsdp__alloc call increments
 * fsdp__alloc_count; the call that makes it equal fsdp__alloc_fail_at (when
 * > 0) fails as if out of memory. Not thread-safe; set from one thread. */
extern long fsdp__alloc_count, fsdp__alloc_fail_at;
char *fsdp__strdup(const char *s); /* plain malloc, unaccounted (names) */

/* ---- Fault injection (fault.c, [Note: fault injection]) ---- */
/* Env FSDP_FAULT=POINT:RANK:STEP[:kill|stop]: the named rank raises SIGKILL
 * (or SIGSTOP) on itself at the first call with this `point` ("forward",
 * "backward", "reduce-scatter", "ckpt-save") once fsdp__fault_step >= STEP.
 * `where` (may be NULL) is printed with it, e.g. the unit. */
void fsdp__fault_point(const char *point, const char *where);
/* Training steps started in this process (fsdp_model_train_step counts them). */
extern long fsdp__fault_step;

/* ---- Arena ---- */
void fsdp__arena_free_all(struct fsdp_ctx *ctx);

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

/* ---- Dtype conversion (dtype.c) ---- */
/* fp32 -> bf16 / fp16 round to nearest even (subnormals kept, overflow to inf,
 * NaN stays NaN, quieted); bf16 / fp16 -> fp32 is exact. */
uint16_t fsdp__f32_to_bf16(float f);
float fsdp__bf16_to_f32(uint16_t h);
uint16_t fsdp__f32_to_f16(float f);
float fsdp__f16_to_f32(uint16_t h);
/* The same over arrays of n elements (AVX-512 when built for it; bit-identical
 * to the scalar forms); src and dst must not overlap. */
void fsdp__cvt_f32_to_bf16(const float *src, uint16_t *dst, size_t n);
void fsdp__cvt_bf16_to_f32(const uint16_t *src, float *dst, size_t n);
void fsdp__cvt_f32_to_f16(const float *src, uint16_t *dst, size_t n);
void fsdp__cvt_f16_to_f32(const uint16_t *src, float *dst, size_t n);
/* Dispatch on dt (F32: a copy; BF16, F16 as above; others: FSDP_ASSERT). */
void fsdp__cvt_from_f32(enum fsdp_dtype dt, const float *src, void *dst, size_t n);
void fsdp__cvt_to_f32(enum fsdp_dtype dt, const void *src, float *dst, size_t n);

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
