/*
 * comm.c - the public collectives of fsdp.h: argument validation, statistics
 * and dispatch through the communicator's vtable (comm-impl.h). Backends
 * (mpi.c, shm.c, self.c) therefore only see well-formed calls; in-place calls reach
 * them with send == NULL.
 * Statistics: calls and bytes count every successful start; bytes are the
 * caller's send buffer at its dtype (all-gather: count, reduce-scatter:
 * world*count, all-reduce: count, broadcast: count on the root and 0
 * elsewhere, barrier: 0), whatever the backend moves on the wire. wait_s
 * counts the time blocked in fsdp_comm_wait (blocking forms are start + wait).
 * Invariant: a request returned by a start is freed by exactly one wait.
 */
#include "comm/comm-impl.h"

#include <string.h>

/* ---- Creation ---- */

static int launched_by_mpirun(void) {
    return getenv("OMPI_COMM_WORLD_SIZE") != NULL || getenv("PMIX_RANK") != NULL;
}

/* "h0: ranks 0-1; h1: ranks 2-3": the hosts of m's ranks by hostname (mpi.c,
 * [Note: hosts]), for messages. COLLECTIVE: yes (over m). */
static enum fsdp_status describe_hosts(struct fsdp_comm *m, char *buf, size_t n) {
    char mine[FSDP_HOST_MAX];
    fsdp__comm_hostname(mine);
    char *all = fsdp__alloc(m->ctx, (size_t)m->size * FSDP_HOST_MAX, FSDP_MEM_OTHER, "hostnames");
    if (!all) return FSDP_ERR_NOMEM;
    enum fsdp_status st = fsdp_comm_allgather(m, mine, all, FSDP_HOST_MAX, FSDP_U8);
    size_t len = 0;
    buf[0] = 0;
    for (int k = 0; st == FSDP_OK && k < m->size && len + 1 < n; k++) {
        const char *h = all + (size_t)k * FSDP_HOST_MAX;
        int first = 1;
        for (int j = 0; j < k && first; j++) first = memcmp(all + (size_t)j * FSDP_HOST_MAX, h, FSDP_HOST_MAX) != 0;
        if (!first) continue; /* listed with its host's first rank */
        len += (size_t)snprintf(buf + len, n - len, "%s%.*s: ranks", len ? "; " : "", FSDP_HOST_MAX, h);
        for (int j = k; j < m->size && len + 1 < n; j++) {
            if (memcmp(all + (size_t)j * FSDP_HOST_MAX, h, FSDP_HOST_MAX) != 0) continue;
            int e = j; /* a run of ranks on h: j..e */
            while (e + 1 < m->size && !memcmp(all + (size_t)(e + 1) * FSDP_HOST_MAX, h, FSDP_HOST_MAX)) e++;
            len += (size_t)(e > j ? snprintf(buf + len, n - len, " %d-%d", j, e) : snprintf(buf + len, n - len, " %d", j));
            j = e;
        }
    }
    fsdp__free(m->ctx, all);
    return st;
}

/* Over the MPI communicator m (owned, also on failure): shm when its ranks
 * share one host and the segment can be made, else m itself. */
static enum fsdp_status shm_or_mpi(struct fsdp_ctx *ctx, struct fsdp_comm *m, struct fsdp_comm **out) {
    /* a spare MPI communicator to fall back on (and to keep MPI initialised)
     * if the segment cannot be set up, e.g. a container's /dev/shm is full */
    struct fsdp_comm *spare;
    enum fsdp_status st = fsdp__comm_mpi_split(m, 0, m->rank, &spare);
    if (st != FSDP_OK) { fsdp__comm_free(m); return st; }
    st = fsdp__comm_shm_create(ctx, m, out);
    if (st == FSDP_OK) { fsdp__comm_free(spare); return FSDP_OK; }
    if (spare->rank == 0) fprintf(stderr, "fsdp: %s; using MPI\n", ctx ? fsdp_errmsg(ctx) : "shm failed");
    *out = spare;
    return FSDP_OK;
}

static enum fsdp_status create_kind(struct fsdp_ctx *ctx, enum fsdp_comm_kind kind,
                                    struct fsdp_comm **out) {
    switch (kind) {
    case FSDP_COMM_AUTO: {
        if (!launched_by_mpirun()) return fsdp__comm_self_create(ctx, out);
        struct fsdp_comm *m;
        FSDP_TRY(fsdp__comm_mpi_create(ctx, &m));
        int local = 0;
        enum fsdp_status st = fsdp__comm_mpi_local_size(m, &local);
        if (st != FSDP_OK) { fsdp__comm_free(m); return st; }
        /* every rank computes the same answer: the world is on one host or not;
         * across hosts, groups split off on one host use shm ([Note: communicator split]) */
        if (m->size < 2 || local != m->size) {
            m->auto_shm = m->size > 1;
            *out = m;
            return FSDP_OK;
        }
        return shm_or_mpi(ctx, m, out);
    }
    case FSDP_COMM_MPI: return fsdp__comm_mpi_create(ctx, out);
    case FSDP_COMM_SHM: {
        struct fsdp_comm *m;
        FSDP_TRY(fsdp__comm_mpi_create(ctx, &m));
        int local = 0;
        enum fsdp_status st = fsdp__comm_mpi_local_size(m, &local);
        if (st == FSDP_OK && local != m->size) {
            char hosts[256];
            st = describe_hosts(m, hosts, sizeof hosts);
            if (st == FSDP_OK)
                st = fsdp__err(ctx, FSDP_ERR_UNSUPPORTED,
                               "comm shm: the %d ranks are not all on one host (%s); shared memory "
                               "works within one host only: use --comm mpi or auto", m->size, hosts);
        }
        if (st != FSDP_OK) { fsdp__comm_free(m); return st; }
        return fsdp__comm_shm_create(ctx, m, out);
    }
    case FSDP_COMM_SELF: return fsdp__comm_self_create(ctx, out);
    }
    return fsdp__err(ctx, FSDP_ERR_INVALID, "comm create: unknown comm kind %d", (int)kind);
}

/* Env FSDP_CHECK_COLLECTIVES=1 turns the schedule check on for every
 * communicator (tests/run.sh sets it); FSDP_COLLECTIVE_TIMEOUT=S sets the
 * watchdog. Programs may override both afterwards. */
enum fsdp_status fsdp__comm_create(struct fsdp_ctx *ctx, enum fsdp_comm_kind kind,
                                   struct fsdp_comm **out) {
    if (!out) return fsdp__err(ctx, FSDP_ERR_INVALID, "comm create: out is NULL");
    *out = NULL;
    long long check;
    double to;
    FSDP_TRY(fsdp__env_int(ctx, "FSDP_CHECK_COLLECTIVES", 0, &check));
    FSDP_TRY(fsdp__env_real(ctx, "FSDP_COLLECTIVE_TIMEOUT", -1, &to)); /* 0: no watchdog */
    FSDP_TRY(create_kind(ctx, kind, out));
    if (check) fsdp_comm_set_check(*out, 1);
    if (to >= 0) fsdp_comm_set_timeout(*out, to);
    return FSDP_OK;
}

void fsdp__comm_free(struct fsdp_comm *c) {
    if (c) c->ops->free(c);
}

void fsdp_comm_free(struct fsdp_comm *c) { fsdp__comm_free(c); }

/* [Note: communicator split] The groups come from MPI_Comm_split over the
 * MPI communicator underneath (a shm communicator's handshake one); a group
 * of one rank becomes a "self" communicator, a shm group gets its own
 * segment and progress thread. Under FSDP_COMM_AUTO across hosts (an MPI
 * communicator with auto_shm), a group whose ranks share one host uses shm
 * too, and one that spans hosts stays MPI and passes auto_shm on: so
 * HYBRID_SHARD's shard group of a host moves through shared memory and its
 * replica group across hosts through MPI. The new communicator inherits the
 * watchdog and the schedule check; its statistics start at zero. */
enum fsdp_status fsdp_comm_local_size(struct fsdp_comm *c, int *out) {
    if (!c || !out) return FSDP_ERR_INVALID;
    if (!strcmp(c->backend, "mpi")) return fsdp__comm_mpi_local_size(c, out);
    *out = c->size; /* self: one rank; shm: one host */
    return FSDP_OK;
}

enum fsdp_status fsdp_comm_split(struct fsdp_comm *c, int color, int key, struct fsdp_comm **out) {
    if (!c || !out) return FSDP_ERR_INVALID;
    *out = NULL;
    if (color < 0) return fsdp__err(c->ctx, FSDP_ERR_INVALID, "comm split: color %d is negative", color);
    struct fsdp_comm *m = NULL, *n = NULL;
    enum fsdp_status st = FSDP_OK;
    if (!strcmp(c->backend, "measure")) {
        return fsdp__err(c->ctx, FSDP_ERR_UNSUPPORTED, "comm split: a measuring communicator has no peers to "
                         "agree on groups with");
    } else if (!strcmp(c->backend, "self")) {
        st = fsdp__comm_self_create(c->ctx, &n);
    } else {
        struct fsdp_comm *base = !strcmp(c->backend, "shm") ? fsdp__comm_shm_mpi(c) : c;
        st = fsdp__comm_mpi_split(base, color, key, &m);
        if (st == FSDP_OK && m->size == 1) {
            fsdp__comm_free(m);
            st = fsdp__comm_self_create(c->ctx, &n);
        } else if (st == FSDP_OK && !strcmp(c->backend, "shm")) {
            st = fsdp__comm_shm_create(c->ctx, m, &n); /* owns m, also on failure */
        } else if (st == FSDP_OK && c->auto_shm) {
            int local = 0;
            st = fsdp__comm_mpi_local_size(m, &local); /* the same answer on all of m */
            if (st != FSDP_OK) fsdp__comm_free(m);
            else if (local == m->size) st = shm_or_mpi(c->ctx, m, &n); /* owns m */
            else { m->auto_shm = 1; n = m; }
        } else if (st == FSDP_OK) {
            n = m;
        }
    }
    if (st != FSDP_OK) return st;
    n->timeout_s = c->timeout_s;
    n->check = c->check;
    *out = n;
    return FSDP_OK;
}

void fsdp__comm_abort(struct fsdp_comm *c, int code) {
    if (c) c->ops->abort(c, code);
}

void *fsdp__comm_req_alloc(struct fsdp_comm *c, size_t bytes, enum fsdp_coll coll) {
    FSDP_ASSERT(bytes >= sizeof(struct fsdp_comm_req), "request of %zu bytes", bytes);
    struct fsdp_comm_req *r = fsdp__calloc(c->ctx, bytes, FSDP_MEM_OTHER, "comm request");
    if (r) r->coll = coll;
    return r;
}

size_t fsdp__comm_req_bytes(const struct fsdp_comm *c) {
    if (!c) return sizeof(struct fsdp_comm_req);
    if (!strcmp(c->backend, "mpi")) return fsdp__comm_mpi_req_bytes();
    if (!strcmp(c->backend, "shm")) return fsdp__comm_shm_req_bytes();
    return sizeof(struct fsdp_comm_req);
}

void fsdp__comm_req_free(struct fsdp_comm *c, void *req) { fsdp__free(c->ctx, req); }

enum fsdp_status fsdp__comm_window(struct fsdp_comm *c, size_t bytes, void **base) {
    *base = NULL;
    if (!c || !c->ops->window || c->size < 2 || bytes == 0) return FSDP_OK;
    return c->ops->window(c, bytes, base);
}

void fsdp__comm_window_free(struct fsdp_comm *c, void *base, size_t bytes) {
    if (c && base) c->ops->window_free(c, base, bytes);
}

const char *fsdp__coll_name(enum fsdp_coll coll) {
    switch (coll) {
    case FSDP_COLL_ALLGATHER: return "allgather";
    case FSDP_COLL_REDUCE_SCATTER: return "reduce-scatter";
    case FSDP_COLL_ALLREDUCE: return "allreduce";
    case FSDP_COLL_BROADCAST: return "broadcast";
    case FSDP_COLL_BARRIER: return "barrier";
    case FSDP_COLL_COUNT: break;
    }
    return "?";
}

const char *fsdp__coll_what(enum fsdp_coll coll, uint64_t seq, size_t count, enum fsdp_dtype dt, const char *tag,
                            char *buf, size_t n) {
    snprintf(buf, n, "%s #%llu (%zu elements of %s, %zu bytes%s%s)", fsdp__coll_name(coll), (unsigned long long)seq,
             count, fsdp_dtype_name(dt), count * fsdp_dtype_size(dt), tag[0] ? ", tag " : "", tag);
    return buf;
}

/* ---- Queries ---- */

int fsdp_comm_rank(const struct fsdp_comm *c) { return c ? c->rank : 0; }
int fsdp_comm_size(const struct fsdp_comm *c) { return c ? c->size : 1; }
const char *fsdp_comm_backend(const struct fsdp_comm *c) { return c ? c->backend : "none"; }

void fsdp_comm_stats_get(const struct fsdp_comm *c, struct fsdp_comm_stats *out) {
    if (!out) return;
    if (c) *out = c->stats;
    else memset(out, 0, sizeof *out);
}

void fsdp_comm_set_timeout(struct fsdp_comm *c, double seconds) {
    if (c) c->timeout_s = seconds > 0 ? seconds : 0;
}

void fsdp_comm_set_check(struct fsdp_comm *c, int on) {
    if (c) c->check = on != 0;
}

void fsdp_comm_set_tag(struct fsdp_comm *c, const char *tag) {
    if (c) snprintf(c->tag, sizeof c->tag, "%s", tag ? tag : "");
}

const char *fsdp_comm_tag(const struct fsdp_comm *c) { return c ? c->tag : ""; }

/* ---- Validation ---- */

static int dtype_ok(enum fsdp_dtype dt) { return (unsigned)dt <= (unsigned)FSDP_I64; }
/* A known op, and FSDP_AVG only over floating values. */
static enum fsdp_status op_check(struct fsdp_comm *c, const char *what, enum fsdp_red_op op, enum fsdp_dtype dt) {
    if ((unsigned)op > (unsigned)FSDP_AVG) return fsdp__err(c->ctx, FSDP_ERR_INVALID, "%s: unknown op %d", what, (int)op);
    if (op == FSDP_AVG && dt != FSDP_F32 && dt != FSDP_BF16 && dt != FSDP_F16)
        return fsdp__err(c->ctx, FSDP_ERR_INVALID, "%s: FSDP_AVG of %s (a floating dtype is needed)", what,
                         fsdp_dtype_name(dt));
    return FSDP_OK;
}

/* [Note: averaging reductions] FSDP_AVG is the sum times 1/size, rounded
 * once more: the bits of FSDP_SUM followed by a pass x *= 1.0f / size (in
 * fp32 for 16-bit values, then rounded back). A backend that can fold the
 * scaling into its last addition (shm's fp32 reduce-scatter, whose last
 * addition streams the result out: the separate pass would read and write
 * it back from memory) declares ops->avg, takes FSDP_AVG and sets
 * req->scaled where it folded; every other backend gets FSDP_SUM and the
 * wait scales recv here, on the caller's threads. */
static enum fsdp_red_op backend_op(const struct fsdp_comm *c, enum fsdp_red_op op) {
    return op == FSDP_AVG && !c->ops->avg ? FSDP_SUM : op;
}

static void avg_mark(const struct fsdp_comm *c, struct fsdp_comm_req *r, enum fsdp_red_op op, void *recv,
                     size_t count, enum fsdp_dtype dt) {
    if (op != FSDP_AVG || r->scaled || c->size == 1 || count == 0) return; /* x * 1.0f == x */
    r->avg_recv = recv;
    r->avg_count = count;
    r->avg_dt = dt;
}

static void avg_scale(void *recv, size_t n, enum fsdp_dtype dt, int size) {
    const float inv = 1.0f / (float)size;
    const int64_t N = (int64_t)n;
    if (dt == FSDP_F32) {
        float *x = recv;
#pragma omp parallel for schedule(static) if (N >= 65536)
        for (int64_t i = 0; i < N; i++) x[i] *= inv;
        return;
    }
    uint16_t *h = recv;
    float buf[256];
    for (size_t off = 0; off < n; off += 256) {
        size_t m = n - off < 256 ? n - off : 256;
        fsdp__cvt_to_f32(dt, h + off, buf, m);
        for (size_t i = 0; i < m; i++) buf[i] *= inv;
        fsdp__cvt_from_f32(dt, buf, h + off, m);
    }
}

/* Do [a, a+na) and [b, b+nb) share a byte? */
static int overlaps(const void *a, size_t na, const void *b, size_t nb) {
    if (na == 0 || nb == 0) return 0;
    uintptr_t pa = (uintptr_t)a, pb = (uintptr_t)b;
    return pa < pb + nb && pb < pa + na;
}

/* Checks what every start shares: c, req, dtype, and that count elements
 * times `blocks` fit in size_t. Sets *bytes to count * dtype size. */
static enum fsdp_status check_common(struct fsdp_comm *c, enum fsdp_coll coll, size_t count,
                                     enum fsdp_dtype dt, size_t blocks,
                                     struct fsdp_comm_req **req, size_t *bytes) {
    const char *name = fsdp__coll_name(coll);
    if (!req) return fsdp__err(c->ctx, FSDP_ERR_INVALID, "%s: req is NULL", name);
    *req = NULL;
    if (!dtype_ok(dt)) return fsdp__err(c->ctx, FSDP_ERR_INVALID, "%s: unknown dtype %d", name, (int)dt);
    size_t esz = fsdp_dtype_size(dt);
    if (count > SIZE_MAX / esz / blocks)
        return fsdp__err(c->ctx, FSDP_ERR_INVALID, "%s: count %zu x %zu blocks of %s overflows", name,
                         count, blocks, fsdp_dtype_name(dt));
    *bytes = count * esz;
    return FSDP_OK;
}

static void count_start(struct fsdp_comm *c, enum fsdp_coll coll, size_t bytes) {
    c->stats.calls[coll]++;
    c->stats.bytes[coll] += bytes;
}

/* [Note: schedule check]
 * With c->check on, each start first all-gathers (through the backend, not
 * counted in the statistics) a fingerprint of the collective: its sequence
 * number, type, element count, dtype, op or root, and a hash of the tag
 * (fsdp_comm_set_tag, e.g. the unit). Ranks that diverged (a
 * skipped or extra collective, another batch shape) then disagree on some
 * field; every rank sees the same table, so all fail the start alike, name
 * the first rank that differs from rank 0, and no data has moved. The
 * exchange has a fixed size, so it cannot itself deadlock on a mismatch; a
 * rank that stops calling collectives altogether is the watchdog's case. */
enum { FP_SEQ, FP_COLL, FP_COUNT_LO, FP_COUNT_HI, FP_DTYPE, FP_OPROOT, FP_TAG, FP_TEXT, FP_N = FP_TEXT + 10 };
/* FP_TEXT..FP_N: the tag's first 39 bytes, NUL-padded, so that a mismatch
 * names what each rank called ("post-step hook proto", "unit h.2"). */

/* FNV-1a of the tag: equal tags, equal hashes ("" is 0). */
static int32_t tag_hash(const char *t) {
    if (!t[0]) return 0;
    uint32_t h = 2166136261u;
    for (; *t; t++) h = (h ^ (unsigned char)*t) * 16777619u;
    return (int32_t)h;
}

static void fp_describe(const int32_t *f, char *buf, size_t n) {
    uint64_t count = (uint64_t)(uint32_t)f[FP_COUNT_LO] | (uint64_t)(uint32_t)f[FP_COUNT_HI] << 32;
    enum fsdp_coll coll = (enum fsdp_coll)f[FP_COLL];
    const char *dt = (unsigned)f[FP_DTYPE] <= (unsigned)FSDP_I64 ? fsdp_dtype_name((enum fsdp_dtype)f[FP_DTYPE]) : "?";
    char text[4 * (FP_N - FP_TEXT)], tag[sizeof text + 16] = "";
    memcpy(text, f + FP_TEXT, sizeof text);
    text[sizeof text - 1] = '\0';
    if (f[FP_TAG]) snprintf(tag, sizeof tag, ", tag '%s'", text);
    if (coll == FSDP_COLL_BARRIER)
        snprintf(buf, n, "barrier(#%u%s)", (unsigned)f[FP_SEQ], tag);
    else if (coll == FSDP_COLL_BROADCAST)
        snprintf(buf, n, "broadcast(#%u, %llu x %s, root %d%s)", (unsigned)f[FP_SEQ], (unsigned long long)count,
                 dt, (int)f[FP_OPROOT], tag);
    else
        snprintf(buf, n, "%s(#%u, %llu x %s, op %d%s)", fsdp__coll_name(coll), (unsigned)f[FP_SEQ],
                 (unsigned long long)count, dt, (int)f[FP_OPROOT], tag);
}

static enum fsdp_status check_schedule(struct fsdp_comm *c, enum fsdp_coll coll, size_t count,
                                       enum fsdp_dtype dt, int op_or_root) {
    if (!c->check || c->size == 1) return FSDP_OK;
    int32_t mine[FP_N] = {(int32_t)(uint32_t)(c->seq + 1), (int32_t)coll, (int32_t)(uint32_t)count,
                          (int32_t)(uint32_t)((uint64_t)count >> 32), (int32_t)dt, op_or_root,
                          tag_hash(c->tag)};
    char *text = (char *)(mine + FP_TEXT); /* NUL-padded: bytes after the NUL must agree too */
    size_t tl = strnlen(c->tag, 4 * (FP_N - FP_TEXT) - 1);
    memset(text, 0, 4 * (FP_N - FP_TEXT));
    memcpy(text, c->tag, tl);
    int32_t *all = fsdp__alloc(c->ctx, sizeof mine * (size_t)c->size, FSDP_MEM_OTHER,
                               "schedule check fingerprints");
    if (!all) return FSDP_ERR_NOMEM;
    /* the exchange is tagged with what it checks, so that a watchdog timeout
     * in it (a peer that stopped before its next collective) names that */
    char tag[sizeof c->tag];
    memcpy(tag, c->tag, sizeof tag);
    snprintf(c->tag, sizeof c->tag, "schedule check of %s #%llu%s%.24s", fsdp__coll_name(coll),
             (unsigned long long)(c->seq + 1), tag[0] ? ", " : "", tag);
    struct fsdp_comm_req *r = NULL;
    enum fsdp_status st = c->ops->allgather_start(c, mine, all, FP_N, FSDP_I32, &r);
    memcpy(c->tag, tag, sizeof tag);
    if (st == FSDP_OK) st = c->ops->wait(c, r);
    for (int k = 1; st == FSDP_OK && k < c->size; k++) {
        if (memcmp(all, all + (size_t)k * FP_N, sizeof mine) == 0) continue;
        char a[128], b[128];
        fp_describe(all, a, sizeof a);
        fp_describe(all + (size_t)k * FP_N, b, sizeof b);
        st = fsdp__err(c->ctx, FSDP_ERR_COMM,
                       "collective schedule diverged (--check-collectives): rank 0 called %s, rank %d "
                       "called %s%s%s", a, k, b, c->tag[0] ? "; this rank's tag: " : "", c->tag);
    }
    fsdp__free(c->ctx, all);
    return st;
}

/* ---- Asynchronous forms ---- */

enum fsdp_status fsdp_comm_allgather_start(struct fsdp_comm *c, const void *send, void *recv,
                                           size_t count, enum fsdp_dtype dt,
                                           struct fsdp_comm_req **req) {
    if (!c) return FSDP_ERR_INVALID;
    size_t bytes;
    FSDP_TRY(check_common(c, FSDP_COLL_ALLGATHER, count, dt, (size_t)c->size, req, &bytes));
    if (count > 0 && (!send || !recv))
        return fsdp__err(c->ctx, FSDP_ERR_INVALID, "allgather: %s is NULL with count %zu",
                         !send ? "send" : "recv", count);
    size_t total = bytes * (size_t)c->size;
    if (count > 0 && send == (const char *)recv + (size_t)c->rank * bytes) send = NULL;
    else if (overlaps(send, bytes, recv, total))
        return fsdp__err(c->ctx, FSDP_ERR_INVALID,
                         "allgather: send overlaps recv but is not recv + rank*count (in place)");
    FSDP_TRY(check_schedule(c, FSDP_COLL_ALLGATHER, count, dt, 0));
    c->seq++;
    FSDP_TRY(c->ops->allgather_start(c, send, recv, count, dt, req));
    count_start(c, FSDP_COLL_ALLGATHER, bytes);
    return FSDP_OK;
}

enum fsdp_status fsdp_comm_reduce_scatter_start(struct fsdp_comm *c, const void *send, void *recv,
                                                size_t count, enum fsdp_dtype dt,
                                                enum fsdp_red_op op, struct fsdp_comm_req **req) {
    if (!c) return FSDP_ERR_INVALID;
    size_t bytes;
    FSDP_TRY(check_common(c, FSDP_COLL_REDUCE_SCATTER, count, dt, (size_t)c->size, req, &bytes));
    FSDP_TRY(op_check(c, "reduce-scatter", op, dt));
    if (count > 0 && (!send || !recv))
        return fsdp__err(c->ctx, FSDP_ERR_INVALID, "reduce-scatter: %s is NULL with count %zu",
                         !send ? "send" : "recv", count);
    size_t total = bytes * (size_t)c->size;
    if (overlaps(send, total, recv, bytes))
        return fsdp__err(c->ctx, FSDP_ERR_INVALID,
                         "reduce-scatter: send and recv overlap (no in-place form)");
    FSDP_TRY(check_schedule(c, FSDP_COLL_REDUCE_SCATTER, count, dt, (int)op));
    c->seq++;
    FSDP_TRY(c->ops->reduce_scatter_start(c, send, recv, count, dt, backend_op(c, op), req));
    avg_mark(c, *req, op, recv, count, dt);
    count_start(c, FSDP_COLL_REDUCE_SCATTER, total);
    fsdp__fault_point("reduce-scatter", c->tag[0] ? c->tag : NULL); /* FSDP_FAULT (core/fault.c) */
    return FSDP_OK;
}

enum fsdp_status fsdp_comm_allreduce_start(struct fsdp_comm *c, const void *send, void *recv,
                                           size_t count, enum fsdp_dtype dt, enum fsdp_red_op op,
                                           struct fsdp_comm_req **req) {
    if (!c) return FSDP_ERR_INVALID;
    size_t bytes;
    FSDP_TRY(check_common(c, FSDP_COLL_ALLREDUCE, count, dt, 1, req, &bytes));
    FSDP_TRY(op_check(c, "allreduce", op, dt));
    if (count > 0 && (!send || !recv))
        return fsdp__err(c->ctx, FSDP_ERR_INVALID, "allreduce: %s is NULL with count %zu",
                         !send ? "send" : "recv", count);
    if (count > 0 && send == recv) send = NULL;
    else if (overlaps(send, bytes, recv, bytes))
        return fsdp__err(c->ctx, FSDP_ERR_INVALID,
                         "allreduce: send overlaps recv but is not equal to it (in place)");
    FSDP_TRY(check_schedule(c, FSDP_COLL_ALLREDUCE, count, dt, (int)op));
    c->seq++;
    FSDP_TRY(c->ops->allreduce_start(c, send, recv, count, dt, backend_op(c, op), req));
    avg_mark(c, *req, op, recv, count, dt);
    count_start(c, FSDP_COLL_ALLREDUCE, bytes);
    return FSDP_OK;
}

enum fsdp_status fsdp_comm_broadcast_start(struct fsdp_comm *c, void *buf, size_t count,
                                           enum fsdp_dtype dt, int root, struct fsdp_comm_req **req) {
    if (!c) return FSDP_ERR_INVALID;
    size_t bytes;
    FSDP_TRY(check_common(c, FSDP_COLL_BROADCAST, count, dt, 1, req, &bytes));
    if (root < 0 || root >= c->size)
        return fsdp__err(c->ctx, FSDP_ERR_INVALID, "broadcast: root %d is not in [0, %d)", root,
                         c->size);
    if (count > 0 && !buf)
        return fsdp__err(c->ctx, FSDP_ERR_INVALID, "broadcast: buf is NULL with count %zu", count);
    FSDP_TRY(check_schedule(c, FSDP_COLL_BROADCAST, count, dt, root));
    c->seq++;
    FSDP_TRY(c->ops->broadcast_start(c, buf, count, dt, root, req));
    count_start(c, FSDP_COLL_BROADCAST, c->rank == root ? bytes : 0);
    return FSDP_OK;
}

enum fsdp_status fsdp_comm_barrier_start(struct fsdp_comm *c, struct fsdp_comm_req **req) {
    if (!c) return FSDP_ERR_INVALID;
    if (!req) return fsdp__err(c->ctx, FSDP_ERR_INVALID, "barrier: req is NULL");
    *req = NULL;
    FSDP_TRY(check_schedule(c, FSDP_COLL_BARRIER, 0, FSDP_U8, 0));
    c->seq++;
    FSDP_TRY(c->ops->barrier_start(c, req));
    count_start(c, FSDP_COLL_BARRIER, 0);
    return FSDP_OK;
}

enum fsdp_status fsdp_comm_wait(struct fsdp_comm *c, struct fsdp_comm_req *req) {
    if (!req) return FSDP_OK;
    if (!c) return FSDP_ERR_INVALID;
    enum fsdp_coll coll = req->coll;
    FSDP_ASSERT((unsigned)coll < (unsigned)FSDP_COLL_COUNT, "corrupt request (coll %d)", (int)coll);
    void *avg = req->avg_recv; /* ops->wait frees req */
    size_t avg_n = req->avg_count;
    enum fsdp_dtype avg_dt = req->avg_dt;
    double t0 = fsdp__now();
    enum fsdp_status st = c->ops->wait(c, req);
    c->stats.wait_s[coll] += fsdp__now() - t0;
    if (st == FSDP_OK && avg) avg_scale(avg, avg_n, avg_dt, c->size);
    return st;
}

/* ---- Blocking forms ---- */

enum fsdp_status fsdp_comm_allgather(struct fsdp_comm *c, const void *send, void *recv,
                                     size_t count, enum fsdp_dtype dt) {
    struct fsdp_comm_req *r;
    FSDP_TRY(fsdp_comm_allgather_start(c, send, recv, count, dt, &r));
    return fsdp_comm_wait(c, r);
}

enum fsdp_status fsdp_comm_reduce_scatter(struct fsdp_comm *c, const void *send, void *recv,
                                          size_t count, enum fsdp_dtype dt, enum fsdp_red_op op) {
    struct fsdp_comm_req *r;
    FSDP_TRY(fsdp_comm_reduce_scatter_start(c, send, recv, count, dt, op, &r));
    return fsdp_comm_wait(c, r);
}

enum fsdp_status fsdp_comm_allreduce(struct fsdp_comm *c, const void *send, void *recv,
                                     size_t count, enum fsdp_dtype dt, enum fsdp_red_op op) {
    struct fsdp_comm_req *r;
    FSDP_TRY(fsdp_comm_allreduce_start(c, send, recv, count, dt, op, &r));
    return fsdp_comm_wait(c, r);
}

enum fsdp_status fsdp_comm_broadcast(struct fsdp_comm *c, void *buf, size_t count,
                                     enum fsdp_dtype dt, int root) {
    struct fsdp_comm_req *r;
    FSDP_TRY(fsdp_comm_broadcast_start(c, buf, count, dt, root, &r));
    return fsdp_comm_wait(c, r);
}

enum fsdp_status fsdp_comm_barrier(struct fsdp_comm *c) {
    struct fsdp_comm_req *r;
    FSDP_TRY(fsdp_comm_barrier_start(c, &r));
    return fsdp_comm_wait(c, r);
}
