/*
 * test_mpi_comm.c - conformance of the collectives (src/comm) at any world
 * size, against EVERY backend that applies: "mpi" and "shm" always (run
 * alone, they start a singleton MPI world of one), "self" in a world of one.
 * tests/run.sh runs it under mpirun at 1..5 ranks. Every collective at sizes
 * 0, 1, 7, 1000 and 2^20+3 elements, every dtype, the in-place forms, several
 * requests outstanding at once, argument validation and the statistics.
 * Reductions are compared with a reference summed in rank order; inputs are
 * small integers so that every dtype's sums are exact, except in
 * comm_reduce_rank_order, where non-exact floats must match the rank-order
 * sum bit for bit on shm, self and MPI (shm.c and mpi.c's ordered
 * reductions sum in rank order) and within a tolerance on "mpi native"
 * (FSDP_MPI_REDUCE=native: Open MPI's reduction order depends on its
 * algorithm; the test prints whether it happened to match). FSDP_AVG is
 * checked there too: the rank-order sum's bits times 1/world.
 * The backends' own paths (shm's single copy and watchdog, MPI's progress
 * thread, self, a second MPI context): test_mpi_comm_backends.c; shared
 * helpers: comm_helpers.h.
 */
#include "fsdp.h"
#include "harness.h"
#include "comm_helpers.h"

#include <fcntl.h>

/* ---- tests ---- */

TEST(comm_basics) {
    struct fsdp_ctx *c = get_ctx();
    struct fsdp_comm *comm = fsdp_ctx_comm(c);
    ASSERT(comm != NULL);
    const char *ws = getenv("OMPI_COMM_WORLD_SIZE");
    int want_world = ws ? atoi(ws) : 1;
    CHECK_INT_EQ(fsdp_comm_size(comm), want_world);
    CHECK_INT_EQ(fsdp_ctx_world(c), want_world);
    CHECK_INT_EQ(fsdp_comm_rank(comm), test_rank);
    CHECK_INT_EQ(fsdp_ctx_rank(c), test_rank);
    /* auto: shm for 2+ ranks on this one host, MPI for a world of one under mpirun */
    CHECK_STR_EQ(fsdp_comm_backend(comm), !ws ? "self" : want_world > 1 ? "shm" : "mpi");
    CHECK_OK(fsdp_comm_barrier(comm), c);
    CHECK_OK(fsdp_comm_wait(comm, NULL), c);
    const char *names[] = {"mpi", "shm", "shm", "self", "mpi"};
    for (int b = 0; b < N_BACKENDS; b++) {
        struct fsdp_ctx *bc = backend_ctx(b);
        if (!bc) continue;
        CHECK_STR_EQ(fsdp_comm_backend(fsdp_ctx_comm(bc)), names[b]);
        CHECK_INT_EQ(fsdp_ctx_world(bc), backends[b] == FSDP_COMM_SELF ? 1 : want_world);
        CHECK_INT_EQ(fsdp_ctx_rank(bc), backends[b] == FSDP_COMM_SELF ? 0 : test_rank);
        CHECK_OK(fsdp_comm_barrier(fsdp_ctx_comm(bc)), bc);
    }
}

/* Contexts on every backend (the peer watch of each MPI context set up and,
 * on one host, released at once) leave the process's standard descriptors
 * open: a released watch once closed descriptor 0 and whatever fds its
 * unset table held, and the rank's output vanished. */
TEST(comm_keeps_std_fds) {
    ASSERT(get_ctx() != NULL);
    for (int b = 0; b < N_BACKENDS; b++) (void)backend_ctx(b);
    for (int fd = 0; fd <= 2; fd++)
        if (fcntl(fd, F_GETFD) == -1) TEST_FAILF("descriptor %d was closed by the library", fd);
}


TEST(comm_allgather) {
    FOR_EACH_BACKEND(c) {
        struct fsdp_comm *comm = fsdp_ctx_comm(c);
        int rank = fsdp_comm_rank(comm), world = fsdp_comm_size(comm);
        for (size_t d = 0; d < N_DTS; d++) {
            enum fsdp_dtype dt = all_dts[d], rt = raw_of(dt);
            size_t esz = fsdp_dtype_size(dt);
            for (size_t s = 0; s < N_SIZES; s++) {
                size_t n = sizes[s];
                void *send = xmalloc(n * esz), *recv = xmalloc(n * esz * (size_t)world);
                for (size_t i = 0; i < n; i++) put(send, rt, i, gval(rt, rank, i));
                memset(recv, 0xAB, n * esz * (size_t)world);
                CHECK_OK(fsdp_comm_allgather(comm, send, recv, n, dt), c);
                EXPECT_ALL(recv, rt, n * (size_t)world, gval(rt, (int)(k_ / n), k_ % n), "allgather");
                /* in place: this rank's block already sits in recv */
                memset(recv, 0xCD, n * esz * (size_t)world);
                char *mine = (char *)recv + (size_t)rank * n * esz;
                for (size_t i = 0; i < n; i++) put(mine, rt, i, gval(rt, rank, i));
                CHECK_OK(fsdp_comm_allgather(comm, mine, recv, n, dt), c);
                EXPECT_ALL(recv, rt, n * (size_t)world, gval(rt, (int)(k_ / n), k_ % n),
                           "allgather in place");
                free(send);
                free(recv);
            }
        }
    }
}

TEST(comm_reduce_scatter) {
    const enum fsdp_red_op ops[] = {FSDP_SUM, FSDP_MAX, FSDP_MIN};
    FOR_EACH_BACKEND(c) {
        struct fsdp_comm *comm = fsdp_ctx_comm(c);
        int rank = fsdp_comm_rank(comm), world = fsdp_comm_size(comm);
        for (size_t d = 0; d < N_DTS; d++) {
            enum fsdp_dtype dt = all_dts[d];
            size_t esz = fsdp_dtype_size(dt);
            for (size_t s = 0; s < N_SIZES; s++) {
                size_t n = sizes[s], total = n * (size_t)world;
                if (n > 1000 && dt != FSDP_F32 && dt != FSDP_BF16) continue; /* keep it quick */
                void *send = xmalloc(total * esz), *recv = xmalloc(n * esz);
                for (size_t j = 0; j < total; j++) put(send, dt, j, rvalt(dt, rank, j));
                for (size_t o = 0; o < 3; o++) {
                    if (ops[o] != FSDP_SUM && n > 1000) continue; /* keep the big size to SUM */
                    memset(recv, 0xAB, n * esz);
                    CHECK_OK(fsdp_comm_reduce_scatter(comm, send, recv, n, dt, ops[o]), c);
                    EXPECT_ALL(recv, dt, n, reduce_ref_t(dt, ops[o], world, (size_t)rank * n + k_),
                               ops[o] == FSDP_SUM ? "reduce-scatter sum" : "reduce-scatter max/min");
                }
                free(send);
                free(recv);
            }
        }
    }
}

TEST(comm_allreduce) {
    const enum fsdp_red_op ops[] = {FSDP_SUM, FSDP_MAX, FSDP_MIN};
    FOR_EACH_BACKEND(c) {
        struct fsdp_comm *comm = fsdp_ctx_comm(c);
        int rank = fsdp_comm_rank(comm), world = fsdp_comm_size(comm);
        for (size_t d = 0; d < N_DTS; d++) {
            enum fsdp_dtype dt = all_dts[d];
            size_t esz = fsdp_dtype_size(dt);
            for (size_t s = 0; s < N_SIZES; s++) {
                size_t n = sizes[s];
                if (n > 1000 && dt != FSDP_F32 && dt != FSDP_I32) continue;
                void *send = xmalloc(n * esz), *recv = xmalloc(n * esz);
                for (size_t o = 0; o < 3; o++) {
                    if (ops[o] != FSDP_SUM && n > 1000) continue;
                    for (size_t i = 0; i < n; i++) put(send, dt, i, rvalt(dt, rank, i));
                    memset(recv, 0xAB, n * esz);
                    CHECK_OK(fsdp_comm_allreduce(comm, send, recv, n, dt, ops[o]), c);
                    EXPECT_ALL(recv, dt, n, reduce_ref_t(dt, ops[o], world, k_), "allreduce");
                    /* in place */
                    for (size_t i = 0; i < n; i++) put(recv, dt, i, rvalt(dt, rank, i));
                    CHECK_OK(fsdp_comm_allreduce(comm, recv, recv, n, dt, ops[o]), c);
                    EXPECT_ALL(recv, dt, n, reduce_ref_t(dt, ops[o], world, k_), "allreduce in place");
                }
                free(send);
                free(recv);
            }
        }
    }
}

TEST(comm_broadcast) {
    FOR_EACH_BACKEND(c) {
        struct fsdp_comm *comm = fsdp_ctx_comm(c);
        int rank = fsdp_comm_rank(comm), world = fsdp_comm_size(comm);
        for (size_t d = 0; d < N_DTS; d++) {
            enum fsdp_dtype dt = all_dts[d], rt = raw_of(dt);
            size_t esz = fsdp_dtype_size(dt);
            for (size_t s = 0; s < N_SIZES; s++) {
                size_t n = sizes[s];
                void *buf = xmalloc(n * esz);
                for (int root = 0; root < world; root++) {
                    if (n > 1000 && root != world - 1) continue;
                    if (rank == root) for (size_t i = 0; i < n; i++) put(buf, rt, i, gval(rt, root, i));
                    else memset(buf, 0xAB, n * esz);
                    CHECK_OK(fsdp_comm_broadcast(comm, buf, n, dt, root), c);
                    EXPECT_ALL(buf, rt, n, gval(rt, root, k_), "broadcast");
                }
                free(buf);
            }
        }
    }
}

/* Several requests in flight at once, waited for in an order unlike the starts. */
static void body_async_outstanding(struct fsdp_ctx *c) {
    struct fsdp_comm *comm = fsdp_ctx_comm(c);
    int rank = fsdp_comm_rank(comm), world = fsdp_comm_size(comm);
    const size_t n = 1000;
    enum { K = 4 };
    float *ag_send[K], *ag_recv[K];
    int32_t *ar[K];
    float *rs_send = xmalloc(n * (size_t)world * sizeof(float)), *rs_recv = xmalloc(n * sizeof(float));
    int32_t *bc = xmalloc(n * sizeof(int32_t));
    struct fsdp_comm_req *reqs[2 * K + 3] = {0};
    int nr = 0;
    for (int k = 0; k < K; k++) {
        ag_send[k] = xmalloc(n * sizeof(float));
        ag_recv[k] = xmalloc(n * (size_t)world * sizeof(float));
        ar[k] = xmalloc(n * sizeof(int32_t));
        for (size_t i = 0; i < n; i++) {
            ag_send[k][i] = (float)(gval(FSDP_F32, rank, i) + k);
            ar[k][i] = (int32_t)(rval(rank, i) * (k + 1));
        }
        ASSERT_OK(fsdp_comm_allgather_start(comm, ag_send[k], ag_recv[k], n, FSDP_F32, &reqs[nr++]), c);
        ASSERT_OK(fsdp_comm_allreduce_start(comm, ar[k], ar[k], n, FSDP_I32, FSDP_SUM, &reqs[nr++]), c);
    }
    for (size_t j = 0; j < n * (size_t)world; j++) rs_send[j] = (float)rval(rank, j);
    ASSERT_OK(fsdp_comm_reduce_scatter_start(comm, rs_send, rs_recv, n, FSDP_F32, FSDP_SUM, &reqs[nr++]), c);
    for (size_t i = 0; i < n; i++) bc[i] = rank == 0 ? (int32_t)(i * 3) : -1;
    ASSERT_OK(fsdp_comm_broadcast_start(comm, bc, n, FSDP_I32, 0, &reqs[nr++]), c);
    ASSERT_OK(fsdp_comm_barrier_start(comm, &reqs[nr++]), c);
    for (int i = 0; i < nr; i++) CHECK(reqs[i] != NULL);
    /* wait odd ones from the back, then even ones from the front */
    for (int i = nr - 1; i >= 0; i--)
        if (i % 2) CHECK_OK(fsdp_comm_wait(comm, reqs[i]), c);
    for (int i = 0; i < nr; i++)
        if (i % 2 == 0) CHECK_OK(fsdp_comm_wait(comm, reqs[i]), c);
    for (int k = 0; k < K; k++) {
        EXPECT_ALL(ag_recv[k], FSDP_F32, n * (size_t)world, gval(FSDP_F32, (int)(k_ / n), k_ % n) + k,
                   "async allgather");
        EXPECT_ALL(ar[k], FSDP_I32, n, reduce_ref(FSDP_SUM, world, k_) * (k + 1), "async allreduce");
        free(ag_send[k]);
        free(ag_recv[k]);
        free(ar[k]);
    }
    EXPECT_ALL(rs_recv, FSDP_F32, n, reduce_ref(FSDP_SUM, world, (size_t)rank * n + k_),
               "async reduce-scatter");
    EXPECT_ALL(bc, FSDP_I32, n, (double)(k_ * 3), "async broadcast");
    free(rs_send);
    free(rs_recv);
    free(bc);
}

TEST(comm_async_outstanding) {
    FOR_EACH_BACKEND(c) body_async_outstanding(c);
}

/* Non-exact floats: close to the rank-order sum, and the same bits on every rank. */
static void body_allreduce_inexact(struct fsdp_ctx *c) {
    struct fsdp_comm *comm = fsdp_ctx_comm(c);
    int rank = fsdp_comm_rank(comm), world = fsdp_comm_size(comm);
    const size_t n = 100003;
    float *x = xmalloc(n * sizeof(float)), *y = xmalloc(n * sizeof(float));
    float *ref = xmalloc(n * sizeof(float));
    /* value of (r, i): a fixed pseudo-random float of varying magnitude */
    for (size_t i = 0; i < n; i++) ref[i] = 0.0f;
    for (int r = 0; r < world; r++) {
        for (size_t i = 0; i < n; i++) {
            uint64_t h = (uint64_t)(r + 1) * 0x9E3779B97F4A7C15ull ^ (uint64_t)i * 0xBF58476D1CE4E5B9ull;
            h ^= h >> 31;
            h *= 0x94D049BB133111EBull;
            h ^= h >> 29;
            float v = (float)((double)(h >> 11) / 9007199254740992.0 - 0.5) * (float)(1 + (i % 7) * 100);
            if (r == rank) x[i] = v;
            ref[i] += v; /* rank order */
        }
    }
    ASSERT_OK(fsdp_comm_allreduce(comm, x, y, n, FSDP_F32, FSDP_SUM), c);
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        double scale = (double)(1 + (i % 7) * 100);
        if (!(fabs((double)y[i] - (double)ref[i]) <= 4e-7 * scale * world)) { /* NaN fails too */
            if (!bad) TEST_FAILF("element %zu: %.9g vs rank-order %.9g", i, (double)y[i], (double)ref[i]);
            bad++;
        }
    }
    CHECK_INT_EQ(bad, 0);
    /* every rank holds the same bits: compare a hash */
    uint32_t h = 2166136261u;
    const unsigned char *p = (const unsigned char *)y;
    for (size_t i = 0; i < n * sizeof(float); i++) h = (h ^ p[i]) * 16777619u;
    int32_t hs[2] = {(int32_t)(h & 0x7fffffff), -(int32_t)(h & 0x7fffffff)};
    ASSERT_OK(fsdp_comm_allreduce(comm, hs, hs, 2, FSDP_I32, FSDP_MAX), c);
    CHECK_INT_EQ(hs[0], -hs[1]); /* max == min */
    free(x);
    free(y);
    free(ref);
}

TEST(comm_allreduce_inexact) {
    FOR_EACH_BACKEND(c) body_allreduce_inexact(c);
}

/* [Note: rank order] shm, self and MPI (ordered, the default) must return
 * exactly the rank-order sum acc = x0; acc += x1; ... (fp32, and for
 * BF16/F16 in fp32 rounded once at the end), bit for bit, on every rank and
 * every run; "mpi native" within a tolerance (Open MPI's order depends on
 * its algorithm and world size). */
static float hval(int r, size_t i) {
    uint64_t h = (uint64_t)(r + 1) * 0x9E3779B97F4A7C15ull ^ (uint64_t)i * 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
    h *= 0x94D049BB133111EBull;
    h ^= h >> 29;
    return (float)((double)(h >> 11) / 9007199254740992.0 - 0.5) * (float)(1 + (i % 7) * 100);
}

/* Rounds v to dt (F32, BF16 or F16, nearest even) and stores it. */
static void put_round(void *b, enum fsdp_dtype dt, size_t k, float v) {
    if (dt == FSDP_F32) { ((float *)b)[k] = v; return; }
    if (dt == FSDP_F16) { _Float16 h = (_Float16)v; memcpy((uint16_t *)b + k, &h, 2); return; }
    uint32_t u;
    memcpy(&u, &v, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    ((uint16_t *)b)[k] = (uint16_t)(u >> 16);
}

static size_t count_bit_mismatches(const void *a, const void *b, size_t n, enum fsdp_dtype dt,
                                   const char *what) {
    size_t esz = fsdp_dtype_size(dt), bad = 0;
    for (size_t k = 0; k < n; k++)
        if (memcmp((const char *)a + k * esz, (const char *)b + k * esz, esz) && bad++ == 0)
            TEST_FAILF("[%s] %s %s: element %zu is %.9g, the rank-order sum is %.9g", cur_backend, what,
                       fsdp_dtype_name(dt), k, get(a, dt, k), get(b, dt, k));
    return bad;
}

/* n elements per rank: 300007 (odd; several rounds of a 1 MiB shm slot; MPI's
 * two-step ordered all-reduce) and 1001 (MPI's ordered all-reduce by all-gather) */
static void body_reduce_rank_order_n(struct fsdp_ctx *c, size_t n) {
    struct fsdp_comm *comm = fsdp_ctx_comm(c);
    int rank = fsdp_comm_rank(comm), world = fsdp_comm_size(comm);
    int exact = strcmp(cur_backend, "mpi native") != 0;
    const enum fsdp_dtype dts[] = {FSDP_F32, FSDP_BF16, FSDP_F16};
    size_t total = n * (size_t)world;
    float *acc = xmalloc(total * sizeof(float)), *tmp = xmalloc(sizeof(float));
    for (size_t d = 0; d < 3; d++) {
        enum fsdp_dtype dt = dts[d];
        size_t esz = fsdp_dtype_size(dt);
        void *send = xmalloc(total * esz), *ref = xmalloc(total * esz), *y = xmalloc(2 * n * esz);
        void *y2 = xmalloc(total * esz);
        /* reference: every rank's (rounded) input summed in rank order in fp32 */
        for (int r = 0; r < world; r++) {
            for (size_t j = 0; j < total; j++) {
                put_round(tmp, dt, 0, hval(r, j));
                float v = (float)get(tmp, dt, 0);
                acc[j] = r == 0 ? v : acc[j] + v;
                if (r == rank) put_round(send, dt, j, hval(r, j));
            }
        }
        for (size_t j = 0; j < total; j++) put_round(ref, dt, j, acc[j]);
        /* all-reduce of the first n, out of place, in place, and again */
        CHECK_OK(fsdp_comm_allreduce(comm, send, y, n, dt, FSDP_SUM), c);
        memcpy(y2, send, n * esz);
        CHECK_OK(fsdp_comm_allreduce(comm, y2, y2, n, dt, FSDP_SUM), c);
        if (exact) CHECK_INT_EQ(count_bit_mismatches(y2, ref, n, dt, "allreduce in place"), 0);
        /* reduce-scatter of all world blocks: this rank's block of the sum */
        void *rs = (char *)y + n * esz;
        CHECK_OK(fsdp_comm_reduce_scatter(comm, send, rs, n, dt, FSDP_SUM), c);
        const void *ref_rs = (const char *)ref + (size_t)rank * n * esz;
        if (exact) {
            CHECK_INT_EQ(count_bit_mismatches(y, ref, n, dt, "allreduce"), 0);
            CHECK_INT_EQ(count_bit_mismatches(rs, ref_rs, n, dt, "reduce-scatter"), 0);
            /* run to run: the same call again gives the same bits */
            CHECK_OK(fsdp_comm_allreduce(comm, send, y2, n, dt, FSDP_SUM), c);
            CHECK_INT_EQ(count_bit_mismatches(y2, y, n, dt, "allreduce repeated"), 0);
            /* FSDP_AVG: the sum's bits times 1/world, rounded once more (shm's
             * fp32 reduce-scatter folds it into its last addition at 300007
             * elements; the wait scales the others: src/comm/comm.c) */
            void *ref_avg = xmalloc(total * esz);
            for (size_t j = 0; j < total; j++)
                put_round(ref_avg, dt, j, (float)get(ref, dt, j) * (1.0f / (float)world));
            CHECK_OK(fsdp_comm_reduce_scatter(comm, send, rs, n, dt, FSDP_AVG), c);
            CHECK_INT_EQ(count_bit_mismatches(rs, (const char *)ref_avg + (size_t)rank * n * esz, n, dt,
                                              "reduce-scatter FSDP_AVG"), 0);
            memcpy(y2, send, n * esz);
            CHECK_OK(fsdp_comm_allreduce(comm, y2, y2, n, dt, FSDP_AVG), c);
            CHECK_INT_EQ(count_bit_mismatches(y2, ref_avg, n, dt, "allreduce FSDP_AVG in place"), 0);
            free(ref_avg);
        } else {
            double ulp = dt == FSDP_F32 ? 0x1p-23 : dt == FSDP_BF16 ? 0x1p-7 : 0x1p-10;
            size_t bad = 0, differ = 0;
            for (size_t k = 0; k < n; k++) {
                double scale = (double)(1 + (k % 7) * 100) * world;
                double e1 = fabs(get(y, dt, k) - get(ref, dt, k));
                double e3 = fabs(get(y2, dt, k) - get(ref, dt, k)); /* in place: Open MPI may differ */
                e1 = e3 > e1 ? e3 : e1;
                double e2 = fabs(get(rs, dt, k) - get(ref_rs, dt, (size_t)k));
                size_t krs = (size_t)rank * n + k;
                double e2s = (double)(1 + (krs % 7) * 100) * world;
                if (!(e1 <= 2 * ulp * scale && e2 <= 2 * ulp * e2s)) { /* NaN fails too */
                    if (bad++ == 0)
                        TEST_FAILF("[mpi native] %s element %zu: allreduce %.9g / reduce-scatter %.9g vs "
                                   "rank-order %.9g / %.9g", fsdp_dtype_name(dt), k, get(y, dt, k),
                                   get(rs, dt, k), get(ref, dt, k), get(ref_rs, dt, k));
                }
                differ += e1 != 0 || e2 != 0;
            }
            CHECK_INT_EQ(bad, 0);
            if (rank == 0)
                fprintf(stderr, "  note: mpi native %s sums at world %d: %zu of %zu elements differ from the "
                        "rank-order sum\n", fsdp_dtype_name(dt), world, differ, n);
        }
        free(send);
        free(ref);
        free(y);
        free(y2);
    }
    free(acc);
    free(tmp);
}

TEST(comm_reduce_rank_order) {
    FOR_EACH_BACKEND(c) {
        body_reduce_rank_order_n(c, 300007);
        body_reduce_rank_order_n(c, 1001);
    }
}

/* BF16/F16: gathered as raw words, reduced in fp32 (exact for small integers),
 * and every bit pattern survives the conversions (MAX of equal inputs). */
static void body_low_precision(struct fsdp_ctx *c) {
    struct fsdp_comm *comm = fsdp_ctx_comm(c);
    int rank = fsdp_comm_rank(comm), world = fsdp_comm_size(comm);
    const enum fsdp_dtype dts[] = {FSDP_BF16, FSDP_F16};
    for (size_t d = 0; d < 2; d++) {
        enum fsdp_dtype dt = dts[d];
        const size_t n = 1000, total = n * (size_t)world;
        uint16_t *send = xmalloc(total * 2), *recv = xmalloc(total * 2);
        for (size_t j = 0; j < total; j++) put(send, dt, j, rval(rank, j));
        CHECK_OK(fsdp_comm_reduce_scatter(comm, send, recv, n, dt, FSDP_SUM), c);
        EXPECT_ALL(recv, dt, n, reduce_ref(FSDP_SUM, world, (size_t)rank * n + k_), "low reduce-scatter");
        CHECK_OK(fsdp_comm_allreduce(comm, send, recv, n, dt, FSDP_SUM), c);
        EXPECT_ALL(recv, dt, n, reduce_ref(FSDP_SUM, world, k_), "low allreduce");
        CHECK_OK(fsdp_comm_allreduce(comm, send, send, n, dt, FSDP_MIN), c);
        EXPECT_ALL(send, dt, n, reduce_ref(FSDP_MIN, world, k_), "low allreduce in place");
        CHECK_OK(fsdp_comm_allgather(comm, send, recv, n, dt), c);
        EXPECT_ALL(recv, dt, total, reduce_ref(FSDP_MIN, world, k_ % n), "low allgather");
        free(send);
        free(recv);
        /* all 65536 patterns through f32 and back */
        uint16_t *all = xmalloc(65536 * 2), *out = xmalloc(65536 * 2);
        for (size_t i = 0; i < 65536; i++) all[i] = (uint16_t)i;
        CHECK_OK(fsdp_comm_allreduce(comm, all, out, 65536, dt, FSDP_MAX), c);
        size_t bad = 0;
        for (size_t i = 0; i < 65536; i++) {
            int nan = dt == FSDP_BF16 ? ((i & 0x7f80) == 0x7f80 && (i & 0x7f))
                                      : ((i & 0x7c00) == 0x7c00 && (i & 0x3ff));
            int ok = nan ? isnan(get(out, dt, i)) : out[i] == all[i];
            if (!ok && bad++ == 0)
                TEST_FAILF("%s pattern 0x%04zx came back as 0x%04x", fsdp_dtype_name(dt), i, out[i]);
        }
        CHECK_INT_EQ(bad, 0);
        free(all);
        free(out);
    }
}

TEST(comm_low_precision) {
    FOR_EACH_BACKEND(c) body_low_precision(c);
}

static void body_stats(struct fsdp_ctx *c) {
    struct fsdp_comm *comm = fsdp_ctx_comm(c);
    int rank = fsdp_comm_rank(comm), world = fsdp_comm_size(comm);
    ASSERT(world <= 8); /* buffers below hold 8 blocks */
    struct fsdp_comm_stats a, b;
    fsdp_comm_stats_get(comm, &a);
    float x[10] = {0}, all[80] = {0}, rs[80] = {0};
    CHECK_OK(fsdp_comm_allgather(comm, x, all, 10, FSDP_F32), c);
    CHECK_OK(fsdp_comm_allgather(comm, x, all, 10, FSDP_F32), c);
    CHECK_OK(fsdp_comm_reduce_scatter(comm, rs, x, 10, FSDP_F32, FSDP_SUM), c);
    CHECK_OK(fsdp_comm_allreduce(comm, x, x, 10, FSDP_F32, FSDP_SUM), c);
    CHECK_OK(fsdp_comm_broadcast(comm, x, 10, FSDP_F32, 0), c);
    CHECK_OK(fsdp_comm_barrier(comm), c);
    fsdp_comm_stats_get(comm, &b);
    CHECK_INT_EQ(b.calls[FSDP_COLL_ALLGATHER] - a.calls[FSDP_COLL_ALLGATHER], 2);
    CHECK_INT_EQ(b.bytes[FSDP_COLL_ALLGATHER] - a.bytes[FSDP_COLL_ALLGATHER], 80);
    CHECK_INT_EQ(b.calls[FSDP_COLL_REDUCE_SCATTER] - a.calls[FSDP_COLL_REDUCE_SCATTER], 1);
    CHECK_INT_EQ(b.bytes[FSDP_COLL_REDUCE_SCATTER] - a.bytes[FSDP_COLL_REDUCE_SCATTER], 40 * world);
    CHECK_INT_EQ(b.calls[FSDP_COLL_ALLREDUCE] - a.calls[FSDP_COLL_ALLREDUCE], 1);
    CHECK_INT_EQ(b.bytes[FSDP_COLL_ALLREDUCE] - a.bytes[FSDP_COLL_ALLREDUCE], 40);
    CHECK_INT_EQ(b.calls[FSDP_COLL_BROADCAST] - a.calls[FSDP_COLL_BROADCAST], 1);
    CHECK_INT_EQ(b.bytes[FSDP_COLL_BROADCAST] - a.bytes[FSDP_COLL_BROADCAST], rank == 0 ? 40 : 0);
    CHECK_INT_EQ(b.calls[FSDP_COLL_BARRIER] - a.calls[FSDP_COLL_BARRIER], 1);
    for (int k = 0; k < FSDP_COLL_COUNT; k++) CHECK(b.wait_s[k] >= a.wait_s[k]);
    /* a failed start counts nothing */
    CHECK_INT_EQ(fsdp_comm_broadcast(comm, x, 10, FSDP_F32, world), FSDP_ERR_INVALID);
    struct fsdp_comm_stats d;
    fsdp_comm_stats_get(comm, &d);
    CHECK_INT_EQ(d.calls[FSDP_COLL_BROADCAST], b.calls[FSDP_COLL_BROADCAST]);
}

TEST(comm_stats) {
    FOR_EACH_BACKEND(c) body_stats(c);
}

/* Validation fails identically on every rank, before any communication. */
static void body_invalid_args(struct fsdp_ctx *c) {
    struct fsdp_comm *comm = fsdp_ctx_comm(c);
    int rank = fsdp_comm_rank(comm), world = fsdp_comm_size(comm);
    float buf[64] = {0};
    struct fsdp_comm_req *r = NULL;
    CHECK_INT_EQ(fsdp_comm_allgather(comm, NULL, buf, 4, FSDP_F32), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "send is NULL");
    CHECK_INT_EQ(fsdp_comm_allgather(comm, buf, NULL, 4, FSDP_F32), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "recv is NULL");
    CHECK_INT_EQ(fsdp_comm_reduce_scatter(comm, NULL, buf, 1, FSDP_F32, FSDP_SUM), FSDP_ERR_INVALID);
    CHECK_INT_EQ(fsdp_comm_allreduce(comm, buf, NULL, 1, FSDP_F32, FSDP_SUM), FSDP_ERR_INVALID);
    CHECK_INT_EQ(fsdp_comm_broadcast(comm, NULL, 3, FSDP_I32, 0), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "buf is NULL");
    CHECK_INT_EQ(fsdp_comm_broadcast(comm, buf, 3, FSDP_I32, -1), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "root -1");
    CHECK_INT_EQ(fsdp_comm_broadcast(comm, buf, 3, FSDP_I32, world), FSDP_ERR_INVALID);
    CHECK_INT_EQ(fsdp_comm_allreduce(comm, buf, buf + 8, 4, (enum fsdp_dtype)42, FSDP_SUM),
                 FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "dtype");
    CHECK_INT_EQ(fsdp_comm_allreduce(comm, buf, buf + 8, 4, FSDP_F32, (enum fsdp_red_op)9),
                 FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "op");
    CHECK_INT_EQ(fsdp_comm_allreduce(comm, buf, buf + 8, 4, FSDP_I32, FSDP_AVG), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "FSDP_AVG of I32");
    CHECK_INT_EQ(fsdp_comm_reduce_scatter(comm, buf, buf + 8, 1, FSDP_U8, FSDP_AVG), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "reduce-scatter: FSDP_AVG of U8");
    CHECK_INT_EQ(fsdp_comm_allreduce_start(comm, buf, buf + 8, 4, FSDP_F32, FSDP_SUM, NULL),
                 FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "req is NULL");
    /* overlaps that are not the documented in-place forms */
    CHECK_INT_EQ(fsdp_comm_allreduce_start(comm, buf, buf + 1, 4, FSDP_F32, FSDP_SUM, &r),
                 FSDP_ERR_INVALID);
    CHECK(r == NULL);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "overlap");
    CHECK_INT_EQ(fsdp_comm_reduce_scatter(comm, buf, buf, 2, FSDP_F32, FSDP_SUM), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "overlap");
    if (world > 1) {
        /* a block other than this rank's own */
        float *other = buf + (size_t)((rank + 1) % world) * 4;
        CHECK_INT_EQ(fsdp_comm_allgather(comm, other, buf, 4, FSDP_F32), FSDP_ERR_INVALID);
        CHECK_STR_CONTAINS(fsdp_errmsg(c), "overlap");
    }
    CHECK_INT_EQ(fsdp_comm_allgather(comm, buf, buf + 1, 4, FSDP_F32), FSDP_ERR_INVALID);
    /* count 0 with NULL buffers is fine, and still collective */
    CHECK_OK(fsdp_comm_allgather(comm, NULL, NULL, 0, FSDP_F32), c);
    CHECK_OK(fsdp_comm_allreduce(comm, NULL, NULL, 0, FSDP_F32, FSDP_SUM), c);
    CHECK_OK(fsdp_comm_reduce_scatter(comm, NULL, NULL, 0, FSDP_F32, FSDP_SUM), c);
    CHECK_OK(fsdp_comm_broadcast(comm, NULL, 0, FSDP_F32, 0), c);
    /* the communicator still works after all that */
    buf[0] = 1.0f;
    CHECK_OK(fsdp_comm_allreduce(comm, buf, buf, 1, FSDP_F32, FSDP_SUM), c);
    CHECK_NEAR(buf[0], world, 0, 0);
    CHECK_INT_EQ(fsdp_comm_barrier(NULL), FSDP_ERR_INVALID);
}

TEST(comm_invalid_args) {
    FOR_EACH_BACKEND(c) body_invalid_args(c);
}

/* --check-collectives: diverged ranks fail alike, naming both sides, before
 * any data moves; the communicator stays usable. */
static void body_schedule_check(struct fsdp_ctx *c) {
    struct fsdp_comm *comm = fsdp_ctx_comm(c);
    int rank = fsdp_comm_rank(comm), world = fsdp_comm_size(comm);
    float buf[64] = {0}, all[64 * 8] = {0};
    ASSERT(world <= 8);
    fsdp_comm_set_check(comm, 1);
    buf[0] = 1.0f;
    CHECK_OK(fsdp_comm_allreduce(comm, buf, buf, 1, FSDP_F32, FSDP_SUM), c);
    CHECK_NEAR(buf[0], world, 0, 0);
    if (world > 1) {
        struct fsdp_comm_stats a, b;
        fsdp_comm_stats_get(comm, &a);
        /* another element count on ranks > 0 */
        CHECK_INT_EQ(fsdp_comm_allgather(comm, buf, all, rank == 0 ? 4 : 5, FSDP_F32), FSDP_ERR_COMM);
        CHECK_STR_CONTAINS(fsdp_errmsg(c), "collective schedule diverged");
        CHECK_STR_CONTAINS(fsdp_errmsg(c), "rank 0 called allgather(#");
        CHECK_STR_CONTAINS(fsdp_errmsg(c), ", 4 x F32");
        CHECK_STR_CONTAINS(fsdp_errmsg(c), "rank 1 called allgather(#");
        CHECK_STR_CONTAINS(fsdp_errmsg(c), ", 5 x F32");
        /* another collective: rank 0 skips ahead to a barrier */
        enum fsdp_status st = rank == 0 ? fsdp_comm_barrier(comm)
                                        : fsdp_comm_broadcast(comm, buf, 3, FSDP_I32, 0);
        CHECK_INT_EQ(st, FSDP_ERR_COMM);
        CHECK_STR_CONTAINS(fsdp_errmsg(c), "rank 0 called barrier(#");
        CHECK_STR_CONTAINS(fsdp_errmsg(c), "rank 1 called broadcast(#");
        /* the same collective on another unit (tag) */
        fsdp_comm_set_tag(comm, rank == 0 ? "unit 3" : "unit 4");
        CHECK_INT_EQ(fsdp_comm_allreduce(comm, buf, buf, 1, FSDP_F32, FSDP_SUM), FSDP_ERR_COMM);
        CHECK_STR_CONTAINS(fsdp_errmsg(c), "rank 0 called allreduce(#");
        CHECK_STR_CONTAINS(fsdp_errmsg(c), ", tag ");
        CHECK_STR_CONTAINS(fsdp_errmsg(c), ", tag 'unit 3')"); /* both sides named in full */
        CHECK_STR_CONTAINS(fsdp_errmsg(c), ", tag 'unit 4')");
        CHECK_STR_CONTAINS(fsdp_errmsg(c), rank == 0 ? "this rank's tag: unit 3" : "this rank's tag: unit 4");
        fsdp_comm_set_tag(comm, NULL);
        fsdp_comm_stats_get(comm, &b);
        CHECK_INT_EQ(b.calls[FSDP_COLL_ALLGATHER], a.calls[FSDP_COLL_ALLGATHER]);
        CHECK_INT_EQ(b.calls[FSDP_COLL_ALLREDUCE], a.calls[FSDP_COLL_ALLREDUCE]);
    }
    fsdp_comm_set_tag(comm, "unit 5"); /* equal tags pass */
    /* still in step */
    buf[0] = 2.0f;
    CHECK_OK(fsdp_comm_allreduce(comm, buf, buf, 1, FSDP_F32, FSDP_SUM), c);
    CHECK_NEAR(buf[0], 2 * world, 0, 0);
    fsdp_comm_set_tag(comm, NULL);
    fsdp_comm_set_check(comm, getenv("FSDP_CHECK_COLLECTIVES") != NULL); /* as before */
}

TEST(comm_schedule_check) {
    FOR_EACH_BACKEND(c) body_schedule_check(c);
}

TEST_MAIN()
