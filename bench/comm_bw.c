/*
 * comm_bw.c - bus bandwidth of all-gather and reduce-scatter (fp32) on the
 * shm and mpi backends, against a single-thread memcpy, in one run; "staged"
 * is shm with its single-copy path off (FSDP_SHM_CMA=0: every byte through
 * the segment's slots, as where process_vm_readv is forbidden). Run under
 * mpirun (bench/comm_bw.sh does). For each total size S (the gathered
 * buffer of an all-gather, the input of a reduce-scatter), powers of two from
 * --min to --max: the median over --iters of the slowest rank's time t, and
 *   bus bandwidth = S / t * (world - 1) / world   (as nccl-tests define it)
 *   memcpy        = S / t_memcpy, one thread on rank 0 while the others sleep
 * and, as "best", the fastest iteration of each (the capability of a shared
 * machine when the scheduler lets every rank run).
 * Fault modes (tests/t_comm.sh), all-gathers of --max bytes in a loop on
 * --comm shm|mpi (default shm), --timeout S sets the watchdog:
 *   --kill-rank R   rank R SIGKILLs itself right after starting the 5th;
 *   --stop-rank R   rank R SIGSTOPs itself there instead (a stalled rank);
 *   --fault-coll rs reduce-scatters instead of all-gathers;
 * the others must report it and end the job.
 * --comm mpi without a fault mode times the MPI backend alone (its world may
 * span hosts, where shm cannot run): per size, the median milliseconds of
 * each collective, the link's own figures for the scale-out model (across
 * simulated hosts: bench/README.md, "Scale-out model").
 */
#include "fsdp.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static _Noreturn void die(struct fsdp_ctx *ctx, const char *what) {
    fprintf(stderr, "comm_bw: rank %d: %s: %s\n", ctx ? fsdp_ctx_rank(ctx) : 0, what,
            ctx ? fsdp_errmsg(ctx) : "cannot create the context");
    fsdp_ctx_abort(ctx, 1);
}

static struct fsdp_ctx *make_ctx(enum fsdp_comm_kind kind) {
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.threads = 1;
    co.comm = kind;
    struct fsdp_ctx *ctx = NULL;
    if (fsdp_ctx_create(&co, &ctx) != FSDP_OK) die(NULL, "context");
    return ctx;
}

/* One timed collective: the slowest rank's seconds (max over ranks via ref). */
static double time_coll(struct fsdp_ctx *ctx, struct fsdp_comm *ref, int coll, float *a, float *b,
                        size_t count) {
    struct fsdp_comm *c = fsdp_ctx_comm(ctx);
    if (fsdp_comm_barrier(c) != FSDP_OK) die(ctx, "barrier");
    double t0 = now_s();
    enum fsdp_status st = coll == 0 ? fsdp_comm_allgather(c, a, b, count, FSDP_F32)
                                    : fsdp_comm_reduce_scatter(c, b, a, count, FSDP_F32, FSDP_SUM);
    double t = now_s() - t0;
    if (st != FSDP_OK) die(ctx, coll == 0 ? "allgather" : "reduce-scatter");
    float tf = (float)t, tmax = tf;
    fsdp_comm_allreduce(ref, &tf, &tmax, 1, FSDP_F32, FSDP_MAX);
    return (double)tmax;
}

static void fault_mode(size_t bytes, int victim, int sig, enum fsdp_comm_kind kind, double timeout, int rs) {
    struct fsdp_ctx *ctx = make_ctx(kind);
    struct fsdp_comm *c = fsdp_ctx_comm(ctx);
    fsdp_comm_set_timeout(c, timeout);
    int rank = fsdp_ctx_rank(ctx), world = fsdp_ctx_world(ctx);
    size_t count = bytes / sizeof(float) / (size_t)world;
    float *a = calloc(count, sizeof(float)), *b = calloc(count * (size_t)world, sizeof(float));
    if (!a || !b) die(ctx, "out of memory");
    for (int it = 0; it < 1000000; it++) {
        struct fsdp_comm_req *r;
        enum fsdp_status st = rs ? fsdp_comm_reduce_scatter_start(c, b, a, count, FSDP_F32, FSDP_SUM, &r)
                                 : fsdp_comm_allgather_start(c, a, b, count, FSDP_F32, &r);
        if (st != FSDP_OK) die(ctx, "start");
        if (rank == victim && it == 4) {
            fprintf(stderr, "comm_bw: rank %d: raising %s inside %s #%d\n", rank,
                    sig == SIGKILL ? "SIGKILL" : "SIGSTOP", rs ? "reduce-scatter" : "allgather", it + 1);
            fflush(stderr);
            raise(sig);
        }
        if (fsdp_comm_wait(c, r) != FSDP_OK) die(ctx, rs ? "reduce-scatter" : "allgather");
    }
    fsdp_ctx_free(ctx);
    exit(0);
}

/* --comm mpi: the MPI backend alone, the median ms of each collective per size S. */
static int mpi_alone(size_t min_b, size_t max_b, int iters) {
    struct fsdp_ctx *mpi = make_ctx(FSDP_COMM_MPI);
    struct fsdp_comm *ref = fsdp_ctx_comm(mpi);
    int rank = fsdp_ctx_rank(mpi), world = fsdp_ctx_world(mpi);
    float *a = calloc(max_b / sizeof(float), sizeof(float)), *b = calloc(max_b / sizeof(float), sizeof(float));
    double *t = malloc(sizeof(double) * (size_t)iters);
    if (!a || !b || !t) die(mpi, "out of memory");
    if (rank == 0) printf("%-15s %12s %12s %10s\n", "collective", "bytes", "ms", "bus GB/s");
    for (size_t S = min_b; S <= max_b; S *= 2) {
        size_t count = S / sizeof(float) / (size_t)world;
        double bytes = (double)(count * sizeof(float) * (size_t)world);
        for (int coll = 0; coll < 2; coll++) {
            time_coll(mpi, ref, coll, a, b, count); /* warm up */
            for (int i = 0; i < iters; i++) t[i] = time_coll(mpi, ref, coll, a, b, count);
            double m = median(t, iters);
            if (rank == 0)
                printf("%-15s %12.0f %12.3f %10.4f\n", coll == 0 ? "allgather" : "reduce-scatter", bytes, m * 1e3,
                       bytes * (world - 1) / world / m / 1e9);
            fflush(stdout);
        }
    }
    free(t);
    free(a);
    free(b);
    fsdp_ctx_free(mpi);
    return 0;
}

int main(int argc, char **argv) {
    size_t min_b = (size_t)1 << 20, max_b = (size_t)256 << 20;
    int iters = 5, victim = -1, sig = SIGKILL, fault_rs = 0, only_mpi = 0;
    double timeout = 0;
    enum fsdp_comm_kind kind = FSDP_COMM_SHM;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--min")) min_b = (size_t)strtoull(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--max")) max_b = (size_t)strtoull(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--iters")) iters = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--kill-rank")) victim = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--stop-rank")) { victim = atoi(argv[i + 1]); sig = SIGSTOP; }
        else if (!strcmp(argv[i], "--timeout")) timeout = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--fault-coll")) fault_rs = !strcmp(argv[i + 1], "rs");
        else if (!strcmp(argv[i], "--comm")) only_mpi = (kind = !strcmp(argv[i + 1], "mpi") ? FSDP_COMM_MPI : FSDP_COMM_SHM) == FSDP_COMM_MPI;
        else {
            fprintf(stderr, "comm_bw: unknown flag '%s' (--min B --max B --iters N; --kill-rank R | "
                    "--stop-rank R, --comm shm|mpi, --timeout S, --fault-coll ag|rs)\n", argv[i]);
            return 2;
        }
    }
    if (iters < 1 || iters > 1000 || min_b < 4096 || max_b < min_b) {
        fprintf(stderr, "comm_bw: need --iters in [1, 1000] and 4096 <= --min <= --max\n");
        return 2;
    }
    if (victim >= 0) fault_mode(max_b, victim, sig, kind, timeout, fault_rs);
    if (only_mpi) return mpi_alone(min_b, max_b, iters);

    struct fsdp_ctx *mpi = make_ctx(FSDP_COMM_MPI), *shm = make_ctx(FSDP_COMM_SHM);
    setenv("FSDP_SHM_CMA", "0", 1);
    struct fsdp_ctx *stg = make_ctx(FSDP_COMM_SHM);
    unsetenv("FSDP_SHM_CMA");
    struct fsdp_comm *ref = fsdp_ctx_comm(mpi);
    int rank = fsdp_ctx_rank(mpi), world = fsdp_ctx_world(mpi);
    float *a = malloc(max_b), *b = malloc(max_b);
    if (!a || !b) die(mpi, "out of memory");
    for (size_t i = 0; i < max_b / sizeof(float); i++) {
        a[i] = (float)(i % 1000) * 0.5f;
        b[i] = (float)rank;
    }
    if (rank == 0) {
        printf("comm_bw: %d ranks, fp32, median of %d; bus GB/s = S/t*(W-1)/W; memcpy GB/s = S/t, 1 thread\n",
               world, iters);
        printf("%-15s %10s %9s %9s %9s %11s %8s %10s %9s %9s %9s %9s\n", "collective", "size", "mpi GB/s",
               "shm GB/s", "staged", "memcpy GB/s", "shm/mpi", "shm/memcpy", "staged/mpi", "best mpi",
               "best shm", "best cpy");
    }
    double *tm = malloc(sizeof(double) * (size_t)iters), *ts = malloc(sizeof(double) * (size_t)iters);
    double *tc = malloc(sizeof(double) * (size_t)iters), *tg = malloc(sizeof(double) * (size_t)iters);
    double busf = world > 1 ? (double)(world - 1) / world : 1.0;
    for (size_t S = min_b; S <= max_b; S *= 2) {
        size_t count = S / sizeof(float) / (size_t)world;
        double bytes = (double)(count * sizeof(float) * (size_t)world);
        /* memcpy on rank 0, the others asleep in a shm barrier */
        for (int i = 0; i < iters; i++) {
            double t0 = now_s();
            if (rank == 0) memcpy(b, a, count * sizeof(float) * (size_t)world);
            tc[i] = now_s() - t0;
            fsdp_comm_barrier(fsdp_ctx_comm(shm));
        }
        double mc = bytes / median(tc, iters) / 1e9, mc_best = bytes / tc[0] / 1e9; /* sorted */
        for (int coll = 0; coll < 2; coll++) {
            time_coll(mpi, ref, coll, a, b, count); /* warm up both */
            time_coll(shm, ref, coll, a, b, count);
            time_coll(stg, ref, coll, a, b, count);
            for (int i = 0; i < iters; i++) {
                tm[i] = time_coll(mpi, ref, coll, a, b, count);
                ts[i] = time_coll(shm, ref, coll, a, b, count);
                tg[i] = time_coll(stg, ref, coll, a, b, count);
            }
            double bm = bytes * busf / median(tm, iters) / 1e9, bs = bytes * busf / median(ts, iters) / 1e9;
            double bg = bytes * busf / median(tg, iters) / 1e9;
            /* best of the iterations (median() sorted them): the machine's capability
             * when a shared box lets both ranks run */
            double bm1 = bytes * busf / tm[0] / 1e9, bs1 = bytes * busf / ts[0] / 1e9;
            if (rank == 0)
                printf("%-15s %6zu MiB %9.2f %9.2f %9.2f %11.2f %7.2fx %9.0f%% %9.2fx %9.2f %9.2f %9.2f\n",
                       coll == 0 ? "allgather" : "reduce-scatter", S >> 20, bm, bs, bg, mc, bs / bm,
                       100.0 * bs / mc, bg / bm, bm1, bs1, mc_best);
            fflush(stdout);
        }
    }
    free(tm);
    free(ts);
    free(tc);
    free(tg);
    free(a);
    free(b);
    fsdp_ctx_free(stg);
    fsdp_ctx_free(shm);
    fsdp_ctx_free(mpi);
    return 0;
}
