/*
 * test_mpi_comm_backends.c - what one backend of src/comm does beyond the
 * conformance suite (test_mpi_comm.c): shm's single-copy path
 * (process_vm_readv) at every dtype and op and its watchdog on a dead peer;
 * MPI's progress thread (collectives advance while the caller computes,
 * through mpi.c's internal completion flag, comm/comm-impl.h), off by
 * FSDP_MPI_PROGRESS=0 and pinned by FSDP_MPI_PROGRESS_CPU; the self backend;
 * a second MPI context beside the first. tests/run.sh runs it under mpirun
 * at 1..5 ranks, tests/tsan.sh under ThreadSanitizer at 2 and 4.
 */
#include "comm/comm-impl.h"
#include "fsdp.h"
#include "harness.h"
#include "comm_helpers.h"

#include <dirent.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

/* shm's single-copy path (process_vm_readv) at every dtype and op, for
 * all-gathers and broadcasts too (FSDP_SHM_CMA=2; by default only
 * reduce-scatters take it), forced from 1-byte blocks (FSDP_SHM_CMA_MIN=1)
 * with 4 KiB reduce-scatter chunks (FSDP_SHM_CHUNK), so that odd sizes cross
 * chunk boundaries. Skipped where the container forbids process_vm_readv
 * (the communicator settled on the staged path, which the other tests run). */
TEST(comm_shm_single_copy) {
    struct fsdp_ctx *g = get_ctx();
    if (fsdp_ctx_world(g) < 2) SKIP("needs 2+ ranks");
    setenv("FSDP_SHM_CMA", "2", 1);
    setenv("FSDP_SHM_CMA_MIN", "1", 1);
    setenv("FSDP_SHM_CHUNK", "4096", 1);
    struct fsdp_ctx *c = make_ctx(FSDP_COMM_SHM);
    unsetenv("FSDP_SHM_CMA");
    unsetenv("FSDP_SHM_CMA_MIN");
    unsetenv("FSDP_SHM_CHUNK");
    cur_backend = "shm single copy";
    struct fsdp_comm *comm = fsdp_ctx_comm(c);
    if (fsdp__comm_shm_cma(comm) != 2) {
        fsdp_ctx_free(c);
        SKIP("process_vm_readv between the ranks is not allowed here: no single copy");
    }
    int rank = fsdp_comm_rank(comm), world = fsdp_comm_size(comm);
    const enum fsdp_red_op ops[] = {FSDP_SUM, FSDP_MAX, FSDP_MIN};
    const size_t ns[] = {1, 7, 5003};
    for (size_t d = 0; d < N_DTS; d++) {
        enum fsdp_dtype dt = all_dts[d], rt = raw_of(dt);
        size_t esz = fsdp_dtype_size(dt);
        for (size_t s = 0; s < 3; s++) {
            size_t n = ns[s], total = n * (size_t)world;
            void *send = xmalloc(total * esz), *recv = xmalloc(total * esz);
            for (size_t j = 0; j < total; j++) put(send, dt, j, rvalt(dt, rank, j));
            for (size_t o = 0; o < 3; o++) {
                memset(recv, 0xAB, n * esz);
                CHECK_OK(fsdp_comm_reduce_scatter(comm, send, recv, n, dt, ops[o]), c);
                EXPECT_ALL(recv, dt, n, reduce_ref_t(dt, ops[o], world, (size_t)rank * n + k_),
                           "single-copy reduce-scatter");
            }
            for (size_t i = 0; i < n; i++) put(send, rt, i, gval(rt, rank, i));
            memset(recv, 0xAB, total * esz);
            CHECK_OK(fsdp_comm_allgather(comm, send, recv, n, dt), c);
            EXPECT_ALL(recv, rt, total, gval(rt, (int)(k_ / n), k_ % n), "single-copy allgather");
            memset(recv, 0xCD, total * esz);
            char *mine = (char *)recv + (size_t)rank * n * esz;
            for (size_t i = 0; i < n; i++) put(mine, rt, i, gval(rt, rank, i));
            CHECK_OK(fsdp_comm_allgather(comm, mine, recv, n, dt), c);
            EXPECT_ALL(recv, rt, total, gval(rt, (int)(k_ / n), k_ % n), "single-copy allgather in place");
            int root = world - 1;
            for (size_t i = 0; i < n; i++) put(recv, rt, i, rank == root ? gval(rt, root, i) : 0.0);
            CHECK_OK(fsdp_comm_broadcast(comm, recv, n, dt, root), c);
            EXPECT_ALL(recv, rt, n, gval(rt, root, k_), "single-copy broadcast");
            free(send);
            free(recv);
        }
    }
    fsdp_ctx_free(c);
}

/* The watchdog: rank 0 waits on a barrier the others join 1.5 s late; with a
 * 0.3 s limit it fails, naming the collective and the rank it waited on. shm
 * only: a timed-out MPI request stays pending (the job must end), which a
 * test cannot leave behind; tests/t_comm.sh covers both through a job. */
TEST(comm_watchdog_shm) {
    struct fsdp_ctx *g = get_ctx();
    if (fsdp_ctx_world(g) < 2) SKIP("needs 2+ ranks");
    struct fsdp_ctx *c = make_ctx(FSDP_COMM_SHM);
    struct fsdp_comm *comm = fsdp_ctx_comm(c);
    int rank = fsdp_comm_rank(comm);
    fsdp_comm_set_timeout(comm, 0.3);
    fsdp_comm_set_check(comm, 0); /* the barrier itself must be what times out */
    fsdp_comm_set_tag(comm, "unit 7 transformer.h.6");
    if (rank != 0) usleep(1500 * 1000);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    enum fsdp_status st = fsdp_comm_barrier(comm);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double dt = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    if (rank == 0) {
        CHECK_INT_EQ(st, FSDP_ERR_COMM);
        CHECK_STR_CONTAINS(fsdp_errmsg(c), "collective timeout: rank 0 waited");
        CHECK_STR_CONTAINS(fsdp_errmsg(c), "on rank 1 in barrier #1 (0 elements of U8, 0 bytes, "
                                           "tag unit 7 transformer.h.6)");
        CHECK(dt >= 0.3 && dt < 1.2);
    } else {
        CHECK_OK(st, c); /* rank 0 posted before it gave up */
    }
    fsdp_ctx_free(c);
    CHECK_OK(fsdp_comm_barrier(fsdp_ctx_comm(g)), g);
}

/* A context created with FSDP_MPI_PROGRESS=0 keeps its requests on the
 * calling thread, and its collectives work. */
static void check_progress_off(void) {
    setenv("FSDP_MPI_PROGRESS", "0", 1);
    struct fsdp_ctx *c = make_ctx(FSDP_COMM_MPI);
    unsetenv("FSDP_MPI_PROGRESS");
    struct fsdp_comm *comm = fsdp_ctx_comm(c);
    CHECK_INT_EQ(fsdp__comm_mpi_progress(comm), 0);
    int32_t x = fsdp_comm_rank(comm) + 1;
    struct fsdp_comm_req *r = NULL;
    CHECK_OK(fsdp_comm_allreduce_start(comm, &x, &x, 1, FSDP_I32, FSDP_SUM, &r), c);
    if (r) {
        CHECK_INT_EQ(fsdp__comm_mpi_req_done(comm, r), 0); /* not the thread's */
        CHECK_OK(fsdp_comm_wait(comm, r), c);
    }
    int w = fsdp_comm_size(comm);
    CHECK_INT_EQ(x, w * (w + 1) / 2);
    fsdp_ctx_free(c);
}

static void check_overlapped(const float *ag_recv, size_t ag_n, const float *rs_recv, size_t rs_n,
                             int rank, int world) {
    EXPECT_ALL(ag_recv, FSDP_F32, ag_n * (size_t)world, gval(FSDP_F32, (int)(k_ / ag_n), k_ % ag_n),
               "overlapped allgather");
    EXPECT_ALL(rs_recv, FSDP_F32, rs_n, reduce_ref(FSDP_SUM, world, (size_t)rank * rs_n + k_),
               "overlapped reduce-scatter");
}

/* The MPI backend's progress thread ([Note: MPI progress thread] in mpi_progress.c):
 * a 16 MiB all-gather and an 8 MiB reduce-scatter, started and then left
 * alone while this thread computes, complete before their waits are called,
 * their data in place. The compute loop makes no MPI (or fsdp) call; between
 * slices of it the test reads the thread's completion flags, which call no
 * MPI either, and gives up after 30 s. The context asks for the thread
 * (FSDP_MPI_PROGRESS=1: by default it runs only with a core free for it)
 * unless the environment says otherwise; under FSDP_MPI_PROGRESS=0
 * (requests advance only in MPI calls, here their waits) it fails. */
TEST(comm_mpi_progress) {
    backend_ctx(0); /* keeps MPI initialised when this test's own context goes */
    const char *env0 = getenv("FSDP_MPI_PROGRESS");
    if (!env0) setenv("FSDP_MPI_PROGRESS", "1", 1);
    struct fsdp_ctx *c = make_ctx(FSDP_COMM_MPI);
    if (!env0) unsetenv("FSDP_MPI_PROGRESS");
    struct fsdp_comm *comm = fsdp_ctx_comm(c);
    int rank = fsdp_comm_rank(comm), world = fsdp_comm_size(comm), level = fsdp__comm_mpi_progress(comm);
    if (world < 2 || level < 0) {
        fsdp_ctx_free(c);
        if (world < 2) SKIP("needs 2+ ranks");
        SKIP("MPI gives less than MPI_THREAD_MULTIPLE");
    }
    size_t ag_n = (16u << 20) / sizeof(float) / (size_t)world, rs_n = (8u << 20) / sizeof(float) / (size_t)world;
    float *ag_send = xmalloc(ag_n * sizeof(float)), *ag_recv = xmalloc(ag_n * (size_t)world * sizeof(float));
    float *rs_send = xmalloc(rs_n * (size_t)world * sizeof(float)), *rs_recv = xmalloc(rs_n * sizeof(float));
    for (size_t i = 0; i < ag_n; i++) ag_send[i] = (float)gval(FSDP_F32, rank, i);
    for (size_t j = 0; j < rs_n * (size_t)world; j++) rs_send[j] = (float)rval(rank, j);
    struct fsdp_comm_req *ag = NULL, *rs = NULL;
    ASSERT_OK(fsdp_comm_allgather_start(comm, ag_send, ag_recv, ag_n, FSDP_F32, &ag), c);
    ASSERT_OK(fsdp_comm_reduce_scatter_start(comm, rs_send, rs_recv, rs_n, FSDP_F32, FSDP_SUM, &rs), c);
    double t0 = fsdp__now(), t = t0;
    volatile double sink = 0;
    int ag_done = 0, rs_done = 0;
    while (!(ag_done && rs_done) && t - t0 < 30) {
        for (int i = 0; i < 200000; i++) sink += 1e-9 * i; /* compute, no MPI */
        ag_done = fsdp__comm_mpi_req_done(comm, ag);
        rs_done = fsdp__comm_mpi_req_done(comm, rs);
        t = fsdp__now();
    }
    int early = ag_done && rs_done;
    const char *env = getenv("FSDP_MPI_PROGRESS");
    if (!early)
        TEST_FAILF("[mpi] after %.1f s of computing the all-gather was %s, the reduce-scatter %s "
                   "(FSDP_MPI_PROGRESS=%s)", t - t0, ag_done ? "done" : "not done",
                   rs_done ? "done" : "not done", env ? env : "unset");
    else if (rank == 0)
        fprintf(stderr, "  note: mpi at world %d: both done after %.2f s of computing\n", world, t - t0);
    /* before any wait; an ordered reduce-scatter (mpi.c, the default) moves its
     * data early and sums it in the wait, so it is checked after that */
    int ordered = fsdp__comm_mpi_ordered(comm);
    if (early && !ordered) check_overlapped(ag_recv, ag_n, rs_recv, rs_n, rank, world);
    if (early && ordered)
        EXPECT_ALL(ag_recv, FSDP_F32, ag_n * (size_t)world, gval(FSDP_F32, (int)(k_ / ag_n), k_ % ag_n),
                   "overlapped allgather");
    CHECK_OK(fsdp_comm_wait(comm, ag), c);
    CHECK_OK(fsdp_comm_wait(comm, rs), c);
    if (!early || ordered) check_overlapped(ag_recv, ag_n, rs_recv, rs_n, rank, world);
    free(ag_send);
    free(ag_recv);
    free(rs_send);
    free(rs_recv);
    fsdp_ctx_free(c);
    check_progress_off();
}

/* The threads of this process whose CPU mask is exactly {cpu}. */
static int threads_on(int cpu) {
    DIR *d = opendir("/proc/self/task");
    int n = 0;
    if (!d) return -1;
    for (struct dirent *e; (e = readdir(d));) {
        if (e->d_name[0] == '.') continue;
        cpu_set_t set;
        if (sched_getaffinity((pid_t)atoi(e->d_name), sizeof set, &set) == 0 && CPU_COUNT(&set) == 1 &&
            CPU_ISSET(cpu, &set))
            n++;
    }
    closedir(d);
    return n;
}

/* FSDP_MPI_PROGRESS_CPU=N puts the progress thread on CPU N (and turns it
 * on): after a collective one more thread of this process runs on N alone
 * (N outside the launcher's binding where there is such a CPU, so that the
 * main thread cannot be the one counted). A CPU the host does not have is
 * refused naming the variable. */
TEST(comm_mpi_progress_cpu) {
    backend_ctx(0);
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    char v[32];
    snprintf(v, sizeof v, "%ld", online);
    setenv("FSDP_MPI_PROGRESS_CPU", v, 1);
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.threads = 1;
    co.comm = FSDP_COMM_MPI;
    struct fsdp_ctx *bad = NULL;
    enum fsdp_status st = fsdp_ctx_create(&co, &bad);
    CHECK_INT_EQ(st, FSDP_ERR_INVALID);
    if (st == FSDP_OK) fsdp_ctx_free(bad);
    if (online < 2) {
        unsetenv("FSDP_MPI_PROGRESS_CPU");
        SKIP("one CPU: nothing to set aside");
    }
    cpu_set_t mine;
    int cpu = 0;
    if (sched_getaffinity(0, sizeof mine, &mine) == 0)
        for (int i = 0; i < online; i++)
            if (!CPU_ISSET(i, &mine)) { cpu = i; break; }
    int before = threads_on(cpu);
    snprintf(v, sizeof v, "%d", cpu);
    setenv("FSDP_MPI_PROGRESS_CPU", v, 1);
    struct fsdp_ctx *c = make_ctx(FSDP_COMM_MPI);
    unsetenv("FSDP_MPI_PROGRESS_CPU");
    struct fsdp_comm *comm = fsdp_ctx_comm(c);
    if (fsdp__comm_mpi_progress(comm) <= 0) {
        fsdp_ctx_free(c);
        SKIP("MPI gives less than MPI_THREAD_MULTIPLE");
    }
    int32_t x = 1;
    struct fsdp_comm_req *r = NULL;
    CHECK_OK(fsdp_comm_allreduce_start(comm, &x, &x, 1, FSDP_I32, FSDP_SUM, &r), c);
    if (r) CHECK_OK(fsdp_comm_wait(comm, r), c);
    CHECK_INT_EQ(x, fsdp_comm_size(comm));
    CHECK_INT_EQ(threads_on(cpu), before + 1);
    fsdp_ctx_free(c);
}

/* A second context on the self backend works next to the MPI one. */
TEST(comm_self_backend) {
    get_ctx();
    struct fsdp_ctx *s;
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.comm = FSDP_COMM_SELF;
    ASSERT_OK(fsdp_ctx_create(&co, &s), s);
    struct fsdp_comm *comm = fsdp_ctx_comm(s);
    CHECK_STR_EQ(fsdp_comm_backend(comm), "self");
    CHECK_INT_EQ(fsdp_comm_size(comm), 1);
    CHECK_INT_EQ(fsdp_comm_rank(comm), 0);
    int32_t a[5] = {1, 2, 3, 4, 5}, b[5] = {0};
    CHECK_OK(fsdp_comm_allgather(comm, a, b, 5, FSDP_I32), s);
    EXPECT_ALL(b, FSDP_I32, 5, (double)(k_ + 1), "self allgather");
    memset(b, 0, sizeof b);
    CHECK_OK(fsdp_comm_reduce_scatter(comm, a, b, 5, FSDP_I32, FSDP_SUM), s);
    EXPECT_ALL(b, FSDP_I32, 5, (double)(k_ + 1), "self reduce-scatter");
    memset(b, 0, sizeof b);
    CHECK_OK(fsdp_comm_allreduce(comm, a, b, 5, FSDP_I32, FSDP_MAX), s);
    EXPECT_ALL(b, FSDP_I32, 5, (double)(k_ + 1), "self allreduce");
    CHECK_OK(fsdp_comm_allreduce(comm, a, a, 5, FSDP_I32, FSDP_SUM), s);
    EXPECT_ALL(a, FSDP_I32, 5, (double)(k_ + 1), "self allreduce in place");
    CHECK_OK(fsdp_comm_broadcast(comm, a, 5, FSDP_I32, 0), s);
    CHECK_INT_EQ(fsdp_comm_broadcast(comm, a, 5, FSDP_I32, 1), FSDP_ERR_INVALID);
    CHECK_OK(fsdp_comm_barrier(comm), s);
    struct fsdp_comm_stats st;
    fsdp_comm_stats_get(comm, &st);
    CHECK_INT_EQ(st.calls[FSDP_COLL_ALLREDUCE], 2);
    CHECK_INT_EQ(st.calls[FSDP_COLL_BROADCAST], 1);
    fsdp_ctx_free(s);
}

/* A second MPI context next to the first: freeing it must leave MPI usable
 * (under mpirun); run alone, it initialises MPI as a singleton and
 * finalizes it when freed. */
TEST(comm_second_mpi_context) {
    struct fsdp_ctx *c = get_ctx();
    struct fsdp_ctx *m;
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.comm = FSDP_COMM_MPI;
    ASSERT_OK(fsdp_ctx_create(&co, &m), m);
    struct fsdp_comm *comm = fsdp_ctx_comm(m);
    CHECK_STR_EQ(fsdp_comm_backend(comm), "mpi");
    CHECK_INT_EQ(fsdp_comm_size(comm), fsdp_ctx_world(c));
    int32_t x = 1;
    CHECK_OK(fsdp_comm_allreduce(comm, &x, &x, 1, FSDP_I32, FSDP_SUM), m);
    CHECK_INT_EQ(x, fsdp_ctx_world(c));
    fsdp_ctx_free(m);
    x = 2;
    CHECK_OK(fsdp_comm_allreduce(fsdp_ctx_comm(c), &x, &x, 1, FSDP_I32, FSDP_SUM), c);
    CHECK_INT_EQ(x, 2 * fsdp_ctx_world(c));
}

TEST_MAIN()
