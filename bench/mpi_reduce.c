/*
 * mpi_reduce.c - the cost of the MPI backend's ordered reductions (mpi.c,
 * [Note: ordered reductions]) against Open MPI's own (FSDP_MPI_REDUCE=native),
 * fp32 reduce-scatter and all-reduce, both contexts in one run, alternating.
 * Run under mpirun (bench/mpi_reduce.sh does, on this host and across the
 * simulated hosts of scripts/simhosts.sh). For each total size S (the
 * reduce-scatter's input, the all-reduce's buffer), powers of 4 from --min to
 * --max: the median and the best over --iters of the slowest rank's time (on
 * a shared machine the best is the capability, when the scheduler lets every
 * rank run; the median what a busy one gives).
 */
#include "fsdp.h"

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

static struct fsdp_ctx *make_ctx(const char *reduce) {
    setenv("FSDP_MPI_REDUCE", reduce, 1);
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.threads = 1;
    co.comm = FSDP_COMM_MPI;
    struct fsdp_ctx *c;
    if (fsdp_ctx_create(&co, &c) != FSDP_OK) exit(1);
    unsetenv("FSDP_MPI_REDUCE");
    return c;
}

/* One timed collective: the slowest rank's seconds (a MAX all-reduce of each rank's). */
static double timed(struct fsdp_ctx *c, int rs, float *a, float *b, size_t n) {
    struct fsdp_comm *comm = fsdp_ctx_comm(c);
    int w = fsdp_comm_size(comm);
    if (fsdp_comm_barrier(comm) != FSDP_OK) exit(1);
    double t0 = now_s();
    enum fsdp_status st = rs ? fsdp_comm_reduce_scatter(comm, a, b, n / (size_t)w, FSDP_F32, FSDP_SUM)
                             : fsdp_comm_allreduce(comm, a, b, n, FSDP_F32, FSDP_SUM);
    if (st != FSDP_OK) exit(1);
    float t = (float)(now_s() - t0), tmax = t;
    if (fsdp_comm_allreduce(comm, &t, &tmax, 1, FSDP_F32, FSDP_MAX) != FSDP_OK) exit(1);
    return (double)tmax;
}

int main(int argc, char **argv) {
    size_t min_b = 65536, max_b = (size_t)64 << 20;
    int iters = 5;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--min")) min_b = (size_t)strtoull(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--max")) max_b = (size_t)strtoull(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--iters")) iters = atoi(argv[i + 1]);
        else { fprintf(stderr, "mpi_reduce: unknown flag '%s' (--min B --max B --iters N)\n", argv[i]); return 2; }
    }
    if (iters < 1 || iters > 1000 || min_b < 4096 || min_b > max_b) {
        fprintf(stderr, "mpi_reduce: need --iters in [1, 1000] and 4096 <= --min <= --max\n");
        return 2;
    }
    struct fsdp_ctx *ord = make_ctx("ordered"), *nat = make_ctx("native");
    struct fsdp_comm *comm = fsdp_ctx_comm(ord);
    int rank = fsdp_comm_rank(comm), w = fsdp_comm_size(comm);
    size_t maxn = max_b / sizeof(float);
    float *a = malloc(maxn * sizeof(float)), *b = malloc(maxn * sizeof(float));
    double *t_o = malloc((size_t)iters * sizeof(double)), *t_n = malloc((size_t)iters * sizeof(double));
    if (!a || !b || !t_o || !t_n) return 1;
    for (size_t i = 0; i < maxn; i++) a[i] = (float)((i * 7 + (size_t)rank) % 1000) * 1e-3f;
    if (rank == 0)
        printf("world %d: fp32, slowest rank, ms: median (best) of %d\n%10s  %-21s %-21s  %-21s %-21s\n", w,
               iters, "bytes", "rs ordered", "rs native", "ar ordered", "ar native");
    for (size_t s = min_b; s <= max_b; s *= 4) {
        size_t n = s / sizeof(float) / (size_t)w * (size_t)w;
        if (rank == 0) printf("%10zu", s);
        for (int rs = 1; rs >= 0; rs--) {
            for (int k = 0; k < iters; k++) {
                t_o[k] = timed(ord, rs, a, b, n);
                t_n[k] = timed(nat, rs, a, b, n);
            }
            qsort(t_o, (size_t)iters, sizeof(double), cmp_double);
            qsort(t_n, (size_t)iters, sizeof(double), cmp_double);
            if (rank == 0)
                printf("  %8.3f (%8.3f)   %8.3f (%8.3f)", t_o[iters / 2] * 1e3, t_o[0] * 1e3,
                       t_n[iters / 2] * 1e3, t_n[0] * 1e3);
        }
        if (rank == 0) printf("\n");
    }
    free(a);
    free(b);
    free(t_o);
    free(t_n);
    fsdp_ctx_free(nat);
    fsdp_ctx_free(ord);
    return 0;
}
