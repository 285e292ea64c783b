/*
 * test_mpi_hosts.c - the communicators' view of hosts (src/comm, mpi.c's
 * [Note: hosts]) and ordered reductions across them. tests/run.sh runs it on
 * this one host at 1..4 ranks; tests/t_multihost.sh runs it across the
 * simulated hosts of scripts/simhosts.sh with FSDP_TEST_HOSTS=H (ranks laid
 * out by host, world/H on each). Checks: FSDP_COMM_AUTO picks shm on one host
 * and MPI across hosts; fsdp_comm_local_size counts the ranks of this host;
 * under AUTO a split by host gives shm groups and a split across hosts MPI
 * ones; FSDP_COMM_SHM across hosts is refused; and all-reduce and
 * reduce-scatter of non-exact floats (fp32, BF16) equal the rank-order sum
 * bit for bit over the world (MPI across hosts, ordered), within each host
 * (shm) and across them (MPI), i.e. the bits shm gives on one host.
 */
#include "comm/comm-impl.h"
#include "fsdp.h"
#include "harness.h"
#include "mpi_harness.h"

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) abort();
    return p;
}

static int hosts(void) {
    const char *h = getenv("FSDP_TEST_HOSTS");
    return h && atoi(h) > 0 ? atoi(h) : 1;
}

static struct fsdp_ctx *auto_ctx;

static struct fsdp_ctx *get_auto(void) {
    if (!auto_ctx) {
        get_ctx(); /* MPI's, kept for the harness */
        struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
        co.threads = 1;
        co.comm = FSDP_COMM_AUTO;
        if (fsdp_ctx_create(&co, &auto_ctx) != FSDP_OK) abort();
    }
    return auto_ctx;
}

__attribute__((destructor(150))) static void free_auto(void) { fsdp_ctx_free(auto_ctx); }

TEST(hosts_auto_backend) {
    struct fsdp_comm *w = fsdp_ctx_comm(get_auto());
    int world = fsdp_comm_size(w), H = hosts();
    ASSERT(world % H == 0);
    CHECK_STR_EQ(fsdp_comm_backend(w), world == 1 ? "mpi" : H == 1 ? "shm" : "mpi");
    int local = -1;
    CHECK_OK(fsdp_comm_local_size(w, &local), get_auto());
    CHECK_INT_EQ(local, world / H);
    /* MPI's own view agrees: ranks on one Open MPI node and one hostname */
    CHECK_OK(fsdp_comm_local_size(fsdp_ctx_comm(get_ctx()), &local), get_ctx());
    CHECK_INT_EQ(local, world / H);
}

/* Under AUTO, HYBRID_SHARD's two splits: a group per host (shm; self for one
 * rank) and a group across hosts (MPI; self on one host). */
TEST(hosts_auto_split) {
    struct fsdp_ctx *c = get_auto();
    struct fsdp_comm *w = fsdp_ctx_comm(c);
    int world = fsdp_comm_size(w), rank = fsdp_comm_rank(w), H = hosts(), L = world / H;
    struct fsdp_comm *host = NULL, *across = NULL;
    CHECK_OK(fsdp_comm_split(w, rank / L, rank, &host), c);
    CHECK_OK(fsdp_comm_split(w, rank % L, rank, &across), c);
    CHECK(host && across); /* both colours are >= 0: a communicator each */
    if (host) CHECK_STR_EQ(fsdp_comm_backend(host), L > 1 ? "shm" : "self");
    if (across) CHECK_STR_EQ(fsdp_comm_backend(across), H > 1 ? "mpi" : "self");
    if (host) CHECK_INT_EQ(fsdp_comm_size(host), L);
    if (across) CHECK_INT_EQ(fsdp_comm_size(across), H);
    fsdp_comm_free(across);
    fsdp_comm_free(host);
}

TEST(hosts_shm_refused_across) {
    if (hosts() < 2) SKIP("needs 2+ hosts (tests/t_multihost.sh)");
    get_auto();
    struct fsdp_ctx *c = NULL;
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.threads = 1;
    co.comm = FSDP_COMM_SHM;
    enum fsdp_status st = fsdp_ctx_create(&co, &c);
    CHECK_INT_EQ(st, FSDP_ERR_UNSUPPORTED);
    if (st == FSDP_OK) fsdp_ctx_free(c);
}

/* ---- ordered reductions: the rank-order sum, bit for bit ---- */

static float hval(int r, size_t i) {
    uint64_t h = (uint64_t)(r + 1) * 0x9E3779B97F4A7C15ull ^ (uint64_t)i * 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
    h *= 0x94D049BB133111EBull;
    h ^= h >> 29;
    return (float)((double)(h >> 11) / 9007199254740992.0 - 0.5) * (float)(1 + (i % 5) * 1000);
}

static uint16_t to_bf16(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static float from_bf16(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float v;
    memcpy(&v, &u, 4);
    return v;
}

/* The members of comm, by their world rank (an all-gather over comm). */
static void members(struct fsdp_ctx *c, struct fsdp_comm *comm, int wrank, int32_t *out) {
    int32_t me = wrank;
    CHECK_OK(fsdp_comm_allgather(comm, &me, out, 1, FSDP_I32), c);
}

/* All-reduce and reduce-scatter of n elements per block over comm, whose
 * ranks are the world ranks who[0..size); inputs hval(world rank, i). */
static void check_ordered(struct fsdp_ctx *c, struct fsdp_comm *comm, const int32_t *who, size_t n,
                          enum fsdp_dtype dt, const char *what) {
    int size = fsdp_comm_size(comm), rank = fsdp_comm_rank(comm);
    size_t total = n * (size_t)size, esz = fsdp_dtype_size(dt);
    float *ref = xmalloc(total * sizeof(float));
    unsigned char *send = xmalloc(total * esz), *ar = xmalloc(total * esz), *rs = xmalloc(n * esz + 1);
    for (int k = 0; k < size; k++)
        for (size_t i = 0; i < total; i++) {
            float v = hval(who[k], i);
            if (dt == FSDP_BF16) v = from_bf16(to_bf16(v));
            ref[i] = k == 0 ? v : ref[i] + v;
            if (k == rank) {
                if (dt == FSDP_BF16) ((uint16_t *)(void *)send)[i] = to_bf16(v);
                else ((float *)(void *)send)[i] = v;
            }
        }
    CHECK_OK(fsdp_comm_allreduce(comm, send, ar, total, dt, FSDP_SUM), c);
    CHECK_OK(fsdp_comm_reduce_scatter(comm, send, rs, n, dt, FSDP_SUM), c);
    size_t bad = 0;
    for (size_t i = 0; i < total; i++) {
        float want = dt == FSDP_BF16 ? from_bf16(to_bf16(ref[i])) : ref[i];
        float got = dt == FSDP_BF16 ? from_bf16(((uint16_t *)(void *)ar)[i]) : ((float *)(void *)ar)[i];
        float got_rs = 0;
        size_t j = i - (size_t)rank * n;
        int in_rs = i >= (size_t)rank * n && j < n;
        if (in_rs) got_rs = dt == FSDP_BF16 ? from_bf16(((uint16_t *)(void *)rs)[j]) : ((float *)(void *)rs)[j];
        if ((memcmp(&got, &want, 4) || (in_rs && memcmp(&got_rs, &want, 4))) && bad++ == 0)
            TEST_FAILF("%s %s n=%zu over %d ranks (%s): element %zu: allreduce %.9g%s%.9g, rank-order sum %.9g",
                       what, fsdp_dtype_name(dt), n, size, fsdp_comm_backend(comm), i, got,
                       in_rs ? ", reduce-scatter " : "", in_rs ? got_rs : 0.0f, want);
    }
    CHECK_INT_EQ(bad, 0);
    free(ref);
    free(send);
    free(ar);
    free(rs);
}

TEST(hosts_ordered_reductions) {
    struct fsdp_ctx *c = get_auto();
    struct fsdp_comm *w = fsdp_ctx_comm(c);
    int world = fsdp_comm_size(w), rank = fsdp_comm_rank(w), H = hosts(), L = world / H;
    if (world < 2) SKIP("needs 2+ ranks");
    int32_t *who = xmalloc((size_t)world * sizeof(int32_t));
    struct fsdp_comm *host = NULL, *across = NULL;
    CHECK_OK(fsdp_comm_split(w, rank / L, rank, &host), c);
    CHECK_OK(fsdp_comm_split(w, rank % L, rank, &across), c);
    CHECK(host && across); /* both colours are >= 0: a communicator each */
    const size_t ns[] = {3, 1001, 40009}; /* MPI: all-gather path, then the two-step all-reduce */
    const enum fsdp_dtype dts[] = {FSDP_F32, FSDP_BF16};
    struct fsdp_comm *comms[] = {w, host, across};
    const char *names[] = {"world", "host", "across hosts"};
    for (int g = 0; g < 3; g++) {
        if (!comms[g] || fsdp_comm_size(comms[g]) < 2) continue;
        members(c, comms[g], rank, who);
        for (size_t d = 0; d < 2; d++)
            for (size_t k = 0; k < 3; k++) check_ordered(c, comms[g], who, ns[k], dts[d], names[g]);
    }
    fsdp_comm_free(across);
    fsdp_comm_free(host);
    free(who);
}

TEST_MAIN()
