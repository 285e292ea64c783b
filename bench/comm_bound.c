/*
 * comm_bound.c - the fastest an out-of-place all-gather and an fp32
 * reduce-scatter between ranks of one host can be with CPU copies, against
 * Open MPI's blocking MPI_Allgather and MPI_Reduce_scatter_block and a
 * single-thread memcpy in the same run: the bounds that issue 6's targets
 * (shm >= 3x Open MPI and >= 50% of memcpy) meet.
 * Every rank's input lives in an MPI-3 shared window (MPI_Win_allocate_shared),
 * so between two barriers each rank works straight from the owners' memory:
 *  - all-gather: copies the W blocks (its own included) into its private
 *    recv with streaming stores, one copy per byte received;
 *  - reduce-scatter: sums its block of the W inputs in rank order, in 64 KiB
 *    pieces that stay in L1/L2, the last addition streamed into recv.
 * No staging and no per-chunk handshakes: any engine that fills private recv
 * buffers reads and writes at least this much; real ones add staging and
 * synchronisation. memcpy: rank 0 copies S bytes while the others wait in a
 * barrier (as in bench/comm_bw.c). Run under mpirun on one host:
 *   mpirun -np 2 build/bench/comm_bound [ITERS] [MIN_BYTES] [MAX_BYTES]
 * (defaults 7, 16 MiB, 256 MiB; S is the gathered buffer, or the input of a
 * reduce-scatter). Prints bus GB/s = S/t*(W-1)/W (median over ITERS of the
 * slowest rank) and the ratios.
 */
#include "comm/shm-impl.h" /* the shm backend's own copy and sum */

#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* the slowest rank's time of this iteration */
static double slowest(double t) {
    double m = t;
    MPI_Allreduce(&t, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return m;
}

/* One line: medians of the MPI (tm) and ideal (ti) times, as bus GB/s. */
static void report(const char *coll, size_t S, double busf, double *tm, double *ti, int iters, double mc, int rank) {
    qsort(tm, (size_t)iters, sizeof *tm, cmp_double);
    qsort(ti, (size_t)iters, sizeof *ti, cmp_double);
    double bm = (double)S * busf / tm[iters / 2] / 1e9, bi = (double)S * busf / ti[iters / 2] / 1e9;
    if (rank == 0)
        printf("%-15s %6zu MiB %12.2f %12.2f %9.2fx %11.2f %12.0f%%\n", coll, S >> 20, bm, bi, bi / bm, mc,
               100.0 * bi / mc);
    fflush(stdout);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, world, iters = argc > 1 ? atoi(argv[1]) : 7;
    size_t min_b = argc > 2 ? (size_t)strtoull(argv[2], NULL, 10) : (size_t)16 << 20;
    size_t max_b = argc > 3 ? (size_t)strtoull(argv[3], NULL, 10) : (size_t)256 << 20;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    int node_size;
    MPI_Comm_size(node, &node_size);
    if (iters < 1 || iters > 1000 || min_b < 4096 || min_b > max_b || node_size != world) {
        if (rank == 0)
            fprintf(stderr, "comm_bound: need 1 <= ITERS <= 1000, 4096 <= MIN <= MAX, and every rank on one host\n");
        MPI_Finalize();
        return 2;
    }
    /* the window holds a whole reduce-scatter input (max_b) per rank; an
     * all-gather uses its first block */
    unsigned char *mine, *recv = malloc(max_b), *send = malloc(max_b);
    float *acc = malloc(64 << 10);
    MPI_Win win;
    MPI_Win_allocate_shared((MPI_Aint)max_b, 1, MPI_INFO_NULL, node, &mine, &win);
    unsigned char **base = malloc(sizeof *base * (size_t)world);
    double *tm = malloc(sizeof(double) * (size_t)iters), *ti = malloc(sizeof(double) * (size_t)iters);
    double *tc = malloc(sizeof(double) * (size_t)iters);
    if (!recv || !send || !acc || !base || !tm || !ti || !tc) {
        fprintf(stderr, "comm_bound: rank %d: out of memory\n", rank);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    for (int k = 0; k < world; k++) {
        MPI_Aint sz;
        int du;
        MPI_Win_shared_query(win, k, &sz, &du, &base[k]);
    }
    memset(recv, 0, max_b);
    /* small integers: every sum is exact, so any order checks */
    for (size_t i = 0; i < max_b / sizeof(float); i++)
        ((float *)(void *)send)[i] = ((float *)(void *)mine)[i] = (float)((i * 7 + (size_t)rank) % 64);
    if (rank == 0) {
        printf("comm_bound: %d ranks, median of %d, bus GB/s = S/t*(W-1)/W; ideal = straight from the owners' "
               "memory (a shared window); memcpy GB/s = S/t, 1 thread\n", world, iters);
        printf("%-15s %10s %12s %12s %10s %11s %13s\n", "collective", "S", "mpi GB/s", "ideal GB/s", "ideal/mpi",
               "memcpy GB/s", "ideal/memcpy");
    }
    double busf = world > 1 ? (double)(world - 1) / world : 1.0;
    for (size_t S = min_b; S <= max_b; S *= 2) {
        size_t blk = S / (size_t)world;
        for (int i = 0; i < iters; i++) { /* memcpy on rank 0, the others in a barrier */
            double t0 = MPI_Wtime();
            if (rank == 0) memcpy(recv, send, S);
            tc[i] = MPI_Wtime() - t0;
            MPI_Bcast(&tc[i], 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
        }
        qsort(tc, (size_t)iters, sizeof *tc, cmp_double);
        double mc = (double)S / tc[iters / 2] / 1e9;
        for (int i = -1; i < iters; i++) { /* all-gather; i = -1: warm-up */
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = MPI_Wtime();
            MPI_Allgather(send, (int)blk, MPI_BYTE, recv, (int)blk, MPI_BYTE, MPI_COMM_WORLD);
            double t = slowest(MPI_Wtime() - t0);
            if (i >= 0) tm[i] = t;
            MPI_Barrier(MPI_COMM_WORLD);
            t0 = MPI_Wtime();
            for (int j = 0; j < world; j++) {
                int k = (rank + j) % world; /* spread the readers over the owners */
                fsdp__shm_copy_out(recv + (size_t)k * blk, base[k], blk, SHM_NT_MIN); /* streamed */
            }
            MPI_Barrier(MPI_COMM_WORLD); /* the owners may change their blocks after this */
            t = slowest(MPI_Wtime() - t0);
            if (i >= 0) ti[i] = t;
        }
        for (int k = 0; k < world; k++) /* the copy is right */
            if (memcmp(recv + (size_t)k * blk, base[k], blk) != 0) {
                fprintf(stderr, "comm_bound: rank %d: all-gather block %d differs\n", rank, k);
                MPI_Abort(MPI_COMM_WORLD, 1);
            }
        report("allgather", S, busf, tm, ti, iters, mc, rank);
        size_t per = blk / sizeof(float), piece = (64 << 10) / sizeof(float);
        for (int i = -1; i < iters; i++) { /* reduce-scatter (fp32 sum) */
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = MPI_Wtime();
            MPI_Reduce_scatter_block(send, recv, (int)per, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            double t = slowest(MPI_Wtime() - t0);
            if (i >= 0) tm[i] = t;
            MPI_Barrier(MPI_COMM_WORLD);
            t0 = MPI_Wtime();
            float *out = (float *)(void *)recv;
            for (size_t off = 0; off < per; off += piece) {
                size_t n = per - off < piece ? per - off : piece;
                const float *in0 = (const float *)(const void *)base[0] + (size_t)rank * per + off;
                if (world == 1) { fsdp__shm_copy_out(out + off, in0, n * sizeof(float), SHM_NT_MIN); continue; }
                for (int k = 1; k < world; k++) {
                    const float *ink = (const float *)(const void *)base[k] + (size_t)rank * per + off;
                    fsdp__shm_add_f32(k == world - 1 ? out + off : acc, k == 1 ? in0 : acc, ink, n, k == world - 1, 1.0f);
                }
            }
            MPI_Barrier(MPI_COMM_WORLD);
            t = slowest(MPI_Wtime() - t0);
            if (i >= 0) ti[i] = t;
        }
        for (size_t j = 0; j < per; j++) { /* the sum is right */
            float want = 0;
            for (int k = 0; k < world; k++) want += (float)(((((size_t)rank * per + j) * 7 + (size_t)k)) % 64);
            if (((float *)(void *)recv)[j] != want) {
                fprintf(stderr, "comm_bound: rank %d: reduce-scatter element %zu is %g, not %g\n", rank, j,
                        (double)((float *)(void *)recv)[j], (double)want);
                MPI_Abort(MPI_COMM_WORLD, 1);
            }
        }
        report("reduce-scatter", S, busf, tm, ti, iters, mc, rank);
    }
    MPI_Win_free(&win);
    MPI_Comm_free(&node);
    free(base);
    free(tm);
    free(ti);
    free(tc);
    free(acc);
    free(recv);
    free(send);
    MPI_Finalize();
    return 0;
}
