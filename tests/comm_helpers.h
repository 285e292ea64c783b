/*
 * comm_helpers.h - what the collective tests share (test_mpi_comm.c,
 * test_mpi_comm_backends.c): the default context (get_ctx), one context per
 * backend under test (backend_ctx, FOR_EACH_BACKEND; MPI, shm, shm staged,
 * self, MPI with Open MPI's own reductions), failures combined over ranks
 * (test_combine), typed element access (put, get), the values each rank
 * contributes (gval for gathers, rval/rvalt for reductions, exact in every
 * dtype) and their rank-order references, and EXPECT_ALL. Each test program
 * includes it once, after fsdp.h and harness.h.
 */
#ifndef FSDP_TEST_COMM_HELPERS_H
#define FSDP_TEST_COMM_HELPERS_H

#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static struct fsdp_ctx *ctx; /* FSDP_COMM_AUTO: what programs get by default */

static __attribute__((unused)) struct fsdp_ctx *make_ctx(enum fsdp_comm_kind kind) {
    struct fsdp_ctx *c;
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.threads = 1;
    co.comm = kind;
    if (fsdp_ctx_create(&co, &c) != FSDP_OK) abort();
    return c;
}

static __attribute__((unused)) struct fsdp_ctx *get_ctx(void) {
    if (!ctx) ctx = make_ctx(FSDP_COMM_AUTO); /* shm or MPI under mpirun, else a world of one */
    return ctx;
}

/* The backends under test, each context created once. The second shm one
 * has its single-copy path off (FSDP_SHM_CMA=0 at creation): every
 * collective staged through the segment's slots, the path of containers
 * that forbid process_vm_readv. */
static const enum fsdp_comm_kind backends[] = {FSDP_COMM_MPI, FSDP_COMM_SHM, FSDP_COMM_SHM, FSDP_COMM_SELF,
                                               FSDP_COMM_MPI};
#define N_BACKENDS 5
#define B_STAGED 2
#define B_NATIVE 4 /* MPI with Open MPI's own reductions (FSDP_MPI_REDUCE=native at creation) */
static struct fsdp_ctx *backend_ctxs[N_BACKENDS];
static const char *cur_backend = "?";

/* The context of backend b, or NULL where it does not apply (self in a
 * world of more than one). */
static __attribute__((unused)) struct fsdp_ctx *backend_ctx(int b) {
    const char *ws = getenv("OMPI_COMM_WORLD_SIZE");
    if (backends[b] == FSDP_COMM_SELF && ws && atoi(ws) > 1) return NULL;
    if (!backend_ctxs[b] && (b == B_STAGED || b == B_NATIVE)) {
        const char *var = b == B_STAGED ? "FSDP_SHM_CMA" : "FSDP_MPI_REDUCE";
        const char *was = getenv(var);
        char keep[32];
        snprintf(keep, sizeof keep, "%s", was ? was : "");
        setenv(var, b == B_STAGED ? "0" : "native", 1);
        backend_ctxs[b] = make_ctx(backends[b]);
        if (was) setenv(var, keep, 1);
        else unsetenv(var);
    }
    if (!backend_ctxs[b]) backend_ctxs[b] = make_ctx(backends[b]);
    cur_backend = fsdp_comm_backend(fsdp_ctx_comm(backend_ctxs[b]));
    if (b == B_STAGED) cur_backend = "shm staged";
    if (b == B_NATIVE) cur_backend = "mpi native";
    return backend_ctxs[b];
}

/* Runs the block once per applicable backend with `c` its context. */
#define FOR_EACH_BACKEND(c)                                                   \
    for (int b_ = 0; b_ < N_BACKENDS; b_++)                                   \
        for (struct fsdp_ctx *c = backend_ctx(b_); c; c = NULL)

static __attribute__((unused)) int combine_max(int flag) {
    int out = flag;
    get_ctx();
    backend_ctx(0); /* MPI is initialised by the MPI context */
    MPI_Allreduce(&flag, &out, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    return out;
}

__attribute__((constructor(200))) static void setup_combine(void) { test_combine = combine_max; }
__attribute__((destructor)) static void teardown(void) {
    for (int b = N_BACKENDS - 1; b >= 0; b--) fsdp_ctx_free(backend_ctxs[b]);
    fsdp_ctx_free(ctx);
}

static const size_t sizes[] __attribute__((unused)) = {0, 1, 7, 1000, (1u << 20) + 3};
#define N_SIZES (sizeof sizes / sizeof sizes[0])

/* ---- typed element access (values are small integers: exact in every dtype) ---- */

static __attribute__((unused)) void put(void *b, enum fsdp_dtype dt, size_t k, double v) {
    switch (dt) {
    case FSDP_F32: ((float *)b)[k] = (float)v; break;
    case FSDP_I32: ((int32_t *)b)[k] = (int32_t)v; break;
    case FSDP_U16: ((uint16_t *)b)[k] = (uint16_t)v; break;
    case FSDP_U8: ((uint8_t *)b)[k] = (uint8_t)v; break;
    case FSDP_I64: ((int64_t *)b)[k] = (int64_t)v; break;
    case FSDP_BF16: {
        float f = (float)v;
        uint32_t u;
        memcpy(&u, &f, 4);
        ((uint16_t *)b)[k] = (uint16_t)(u >> 16); /* exact for small integers */
        break;
    }
    case FSDP_F16: {
        _Float16 h = (_Float16)v;
        memcpy((uint16_t *)b + k, &h, 2);
        break;
    }
    }
}

static __attribute__((unused)) double get(const void *b, enum fsdp_dtype dt, size_t k) {
    switch (dt) {
    case FSDP_F32: return ((const float *)b)[k];
    case FSDP_I32: return ((const int32_t *)b)[k];
    case FSDP_U16: return ((const uint16_t *)b)[k];
    case FSDP_U8: return ((const uint8_t *)b)[k];
    case FSDP_I64: return (double)((const int64_t *)b)[k];
    case FSDP_BF16: {
        uint32_t u = (uint32_t)((const uint16_t *)b)[k] << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    case FSDP_F16: {
        _Float16 h;
        memcpy(&h, (const uint16_t *)b + k, 2);
        return (double)h;
    }
    }
    return 0;
}

/* A value identifying (rank, index), for gathers and broadcasts. */
static __attribute__((unused)) double gval(enum fsdp_dtype dt, int r, size_t i) {
    switch (dt) {
    case FSDP_F32: return (double)(r * 4096 + (int)(i % 4096));
    case FSDP_I32: case FSDP_I64: return (double)((size_t)r * 100003u + i);
    case FSDP_U8: return (double)(((size_t)r * 37u + i * 7u) & 0xffu);
    default: return (double)(((size_t)r * 911u + i * 7u) & 0xffffu);
    }
}

/* Gathers and broadcasts move raw words: check BF16/F16 as U16 patterns. */
static __attribute__((unused)) enum fsdp_dtype raw_of(enum fsdp_dtype dt) {
    return dt == FSDP_BF16 || dt == FSDP_F16 ? FSDP_U16 : dt;
}

/* A small signed integer for reductions: sums over 5 ranks stay in [-55, 55]. */
static __attribute__((unused)) double rval(int r, size_t i) { return (double)(((size_t)r * 7u + i * 13u) % 23u) - 11.0; }
/* ... made non-negative for the unsigned dtypes (sums in [0, 110]). */
static __attribute__((unused)) double rvalt(enum fsdp_dtype dt, int r, size_t i) {
    return rval(r, i) + (dt == FSDP_U16 || dt == FSDP_U8 ? 11.0 : 0.0);
}

static __attribute__((unused)) double reduce_ref_t(enum fsdp_dtype dt, enum fsdp_red_op op, int world, size_t j) {
    double acc = rvalt(dt, 0, j);
    for (int r = 1; r < world; r++) {
        double v = rvalt(dt, r, j);
        acc = op == FSDP_SUM ? acc + v : op == FSDP_MAX ? (v > acc ? v : acc) : (v < acc ? v : acc);
    }
    return acc;
}

static __attribute__((unused)) double reduce_ref(enum fsdp_red_op op, int world, size_t j) {
    return reduce_ref_t(FSDP_F32, op, world, j);
}

static __attribute__((unused)) void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) abort();
    return p;
}

/* Counts mismatches of buf[0..n) against want_expr, a function of the index
 * k_, printing the first. */
#define EXPECT_ALL(buf, dt, n, want_expr, what)                                           \
    do {                                                                                  \
        size_t bad_ = 0;                                                                  \
        for (size_t k_ = 0; k_ < (n); k_++) {                                             \
            double got_ = get((buf), (dt), k_), want_ = (want_expr);                      \
            if (got_ != want_) {                                                          \
                if (bad_ == 0)                                                            \
                    TEST_FAILF("[%s] %s %s n=%zu: element %zu is %g, want %g", cur_backend, \
                               what, fsdp_dtype_name(dt), (size_t)(n), k_, got_, want_);  \
                bad_++;                                                                   \
            }                                                                             \
        }                                                                                 \
        if (bad_ > 1) TEST_FAILF("  (%zu mismatches in all)", bad_);                      \
    } while (0)

static const enum fsdp_dtype all_dts[] __attribute__((unused)) = {FSDP_F32, FSDP_BF16, FSDP_F16, FSDP_I32,
                                                                  FSDP_U16, FSDP_U8, FSDP_I64};
#define N_DTS 7

#endif
