/*
 * mpi_harness.h - what every test_mpi_* file shares on top of harness.h: one
 * MPI context per process (get_ctx, created on first use, freed at exit) and
 * test_combine set to an MPI_Allreduce(MAX), so all ranks agree on each
 * test's result. Include after fsdp.h and harness.h.
 */
#ifndef FSDP_TEST_MPI_HARNESS_H
#define FSDP_TEST_MPI_HARNESS_H

#include <mpi.h>
#include <stdio.h>
#include <sys/resource.h>

static int combine_max(int flag) {
    int out = flag;
    MPI_Allreduce(&flag, &out, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    return out;
}

static struct fsdp_ctx *ctx;

__attribute__((constructor(200))) static void setup_combine(void) { test_combine = combine_max; }

static struct fsdp_ctx *get_ctx(void) {
    if (!ctx) {
        struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
        co.threads = 1;
        co.comm = FSDP_COMM_MPI;
        if (fsdp_ctx_create(&co, &ctx) != FSDP_OK) abort();
    }
    return ctx;
}

__attribute__((destructor)) static void teardown(void) { fsdp_ctx_free(ctx); }

/* A second context of one thread over the shared-memory backend, its
 * FSDP_SHM_WINDOW set to `window` while it is made (NULL: the default);
 * NULL if it could not be made (ctx's message says why). */
static inline struct fsdp_ctx *shm_ctx_window(const char *window) {
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.threads = 1;
    co.comm = FSDP_COMM_SHM;
    if (window) setenv("FSDP_SHM_WINDOW", window, 1);
    struct fsdp_ctx *c = NULL;
    if (fsdp_ctx_create(&co, &c) != FSDP_OK) c = NULL;
    if (window) unsetenv("FSDP_SHM_WINDOW");
    return c;
}

/* Whether the activation arena runs in its one span here ([Note: one arena
 * chunk]): Linux maps it unless overcommit is strict or the address space is
 * limited. */
static inline int arena_span_expected(void) {
    FILE *f = fopen("/proc/sys/vm/overcommit_memory", "r");
    int mode = 0;
    if (f && fscanf(f, "%d", &mode) != 1) mode = 0;
    if (f) fclose(f);
    struct rlimit rl;
    return mode != 2 && !(getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY);
}

#endif
