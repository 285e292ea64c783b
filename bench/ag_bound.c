/*
 * ag_bound.c - the fastest an out-of-place all-gather between ranks of one
 * host can be with CPU copies, against Open MPI's MPI_Allgather in the same
 * run: the bound that issue 6's "shm >= 3x Open MPI" target meets.
 * Every rank's block lives in an MPI-3 shared window (MPI_Win_allocate_shared),
 * so after a barrier each rank copies the W blocks (its own included) straight
 * from the owners' memory into its private recv with streaming stores, then
 * a barrier: one copy per byte received, no staging, no per-chunk handshakes.
 * Any engine that fills private recv buffers does at least these copies
 * (W x S bytes written over all ranks, as many read); real ones add staging
 * and synchronisation. Run under mpirun on one host:
 *   mpirun -np 2 build/bench/ag_bound [ITERS] [MIN_BYTES] [MAX_BYTES]
 * (defaults 7, 16 MiB, 256 MiB; sizes are the gathered S). Prints bus GB/s =
 * S/t*(W-1)/W (median over ITERS of the slowest rank) and the ratio.
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

/* memcpy with streaming stores (the stores the shm backend uses for large
 * destinations); plain memcpy without AVX */
static void copy_stream(void *dst, const void *src, size_t n) {
#if defined(__AVX__)
    unsigned char *d = dst;
    const unsigned char *p = src;
    size_t head = (32 - ((uintptr_t)d & 31)) & 31;
    if (head > n) head = n;
    memcpy(d, p, head);
    d += head, p += head, n -= head;
    for (; n >= 128; n -= 128, d += 128, p += 128) {
        __m256i x0 = _mm256_loadu_si256((const __m256i *)(const void *)p);
        __m256i x1 = _mm256_loadu_si256((const __m256i *)(const void *)(p + 32));
        __m256i x2 = _mm256_loadu_si256((const __m256i *)(const void *)(p + 64));
        __m256i x3 = _mm256_loadu_si256((const __m256i *)(const void *)(p + 96));
        _mm256_stream_si256((__m256i *)(void *)d, x0);
        _mm256_stream_si256((__m256i *)(void *)(d + 32), x1);
        _mm256_stream_si256((__m256i *)(void *)(d + 64), x2);
        _mm256_stream_si256((__m256i *)(void *)(d + 96), x3);
    }
    memcpy(d, p, n);
    _mm_sfence();
#else
    memcpy(dst, src, n);
#endif
}

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
            fprintf(stderr, "ag_bound: need 1 <= ITERS <= 1000, 4096 <= MIN <= MAX, and every rank on one host\n");
        MPI_Finalize();
        return 2;
    }
    size_t blk_max = max_b / (size_t)world;
    unsigned char *mine, *recv = malloc(max_b), *send = malloc(blk_max);
    MPI_Win win;
    MPI_Win_allocate_shared((MPI_Aint)blk_max, 1, MPI_INFO_NULL, node, &mine, &win);
    unsigned char **base = malloc(sizeof *base * (size_t)world);
    double *tm = malloc(sizeof(double) * (size_t)iters), *ti = malloc(sizeof(double) * (size_t)iters);
    if (!recv || !send || !base || !tm || !ti) {
        fprintf(stderr, "ag_bound: rank %d: out of memory\n", rank);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    for (int k = 0; k < world; k++) {
        MPI_Aint sz;
        int du;
        MPI_Win_shared_query(win, k, &sz, &du, &base[k]);
    }
    memset(recv, 0, max_b);
    for (size_t i = 0; i < blk_max; i++) send[i] = mine[i] = (unsigned char)(i * 7 + (size_t)rank);
    if (rank == 0) {
        printf("ag_bound: %d ranks, median of %d, bus GB/s = S/t*(W-1)/W; ideal = one streaming copy per byte "
               "from a shared window\n", world, iters);
        printf("%10s %12s %12s %10s\n", "S", "mpi GB/s", "ideal GB/s", "ideal/mpi");
    }
    double busf = world > 1 ? (double)(world - 1) / world : 1.0;
    for (size_t S = min_b; S <= max_b; S *= 2) {
        size_t blk = S / (size_t)world;
        for (int i = -1; i < iters; i++) { /* i = -1: warm-up */
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = MPI_Wtime();
            MPI_Allgather(send, (int)blk, MPI_BYTE, recv, (int)blk, MPI_BYTE, MPI_COMM_WORLD);
            double t = slowest(MPI_Wtime() - t0);
            if (i >= 0) tm[i] = t;
            MPI_Barrier(MPI_COMM_WORLD);
            t0 = MPI_Wtime();
            for (int j = 0; j < world; j++) {
                int k = (rank + j) % world; /* spread the readers over the owners */
                copy_stream(recv + (size_t)k * blk, base[k], blk);
            }
            MPI_Barrier(MPI_COMM_WORLD); /* the owners may change their blocks after this */
            t = slowest(MPI_Wtime() - t0);
            if (i >= 0) ti[i] = t;
        }
        for (int k = 0; k < world; k++) /* the copy is right */
            if (memcmp(recv + (size_t)k * blk, base[k], blk) != 0) {
                fprintf(stderr, "ag_bound: rank %d: block %d differs\n", rank, k);
                MPI_Abort(MPI_COMM_WORLD, 1);
            }
        qsort(tm, (size_t)iters, sizeof *tm, cmp_double);
        qsort(ti, (size_t)iters, sizeof *ti, cmp_double);
        double bm = (double)S * busf / tm[iters / 2] / 1e9, bi = (double)S * busf / ti[iters / 2] / 1e9;
        if (rank == 0) printf("%6zu MiB %12.2f %12.2f %9.2fx\n", S >> 20, bm, bi, bi / bm);
        fflush(stdout);
    }
    MPI_Win_free(&win);
    MPI_Comm_free(&node);
    free(base);
    free(tm);
    free(ti);
    free(recv);
    free(send);
    MPI_Finalize();
    return 0;
}
