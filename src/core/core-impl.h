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
    /* activation arena: one growing list of chunks, reset per step */
    struct fsdp__arena_chunk *arena; /* current chunk (head of list) */
    size_t arena_used;               /* bytes handed out in total (mark) */
};

/* Allocates an empty context (world of one, no comm). */
enum fsdp_status fsdp__ctx_alloc(struct fsdp_ctx **out);
/* Frees what fsdp__ctx_alloc made (not the comm). */
void fsdp__ctx_release(struct fsdp_ctx *ctx);

/* ---- Errors ---- */
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
/* 64-byte aligned; returns NULL and sets errmsg naming `what` on failure. */
void *fsdp__alloc(struct fsdp_ctx *ctx, size_t bytes, enum fsdp_mem_kind kind, const char *what);
void *fsdp__calloc(struct fsdp_ctx *ctx, size_t bytes, enum fsdp_mem_kind kind, const char *what);
/* Frees memory from fsdp__alloc; NULL is a no-op. */
void fsdp__free(struct fsdp_ctx *ctx, void *p);
char *fsdp__strdup(const char *s); /* plain malloc, unaccounted (names) */

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

/* ---- Time ---- */
double fsdp__now(void); /* monotonic seconds */

#endif
