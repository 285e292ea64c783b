/*
 * comm.c - the public collectives of fsdp.h: argument validation, statistics
 * and dispatch through the communicator's vtable (comm-impl.h). Backends
 * (mpi.c, self.c) therefore only see well-formed calls; in-place calls reach
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

enum fsdp_status fsdp__comm_create(struct fsdp_ctx *ctx, enum fsdp_comm_kind kind,
                                   struct fsdp_comm **out) {
    if (!out) return fsdp__err(ctx, FSDP_ERR_INVALID, "comm create: out is NULL");
    *out = NULL;
    switch (kind) {
    case FSDP_COMM_AUTO:
        return launched_by_mpirun() ? fsdp__comm_mpi_create(ctx, out)
                                    : fsdp__comm_self_create(ctx, out);
    case FSDP_COMM_MPI: return fsdp__comm_mpi_create(ctx, out);
    case FSDP_COMM_SELF: return fsdp__comm_self_create(ctx, out);
    }
    return fsdp__err(ctx, FSDP_ERR_INVALID, "comm create: unknown comm kind %d", (int)kind);
}

void fsdp__comm_free(struct fsdp_comm *c) {
    if (c) c->ops->free(c);
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

void fsdp__comm_req_free(struct fsdp_comm *c, void *req) { fsdp__free(c->ctx, req); }

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

/* ---- Queries ---- */

int fsdp_comm_rank(const struct fsdp_comm *c) { return c ? c->rank : 0; }
int fsdp_comm_size(const struct fsdp_comm *c) { return c ? c->size : 1; }
const char *fsdp_comm_backend(const struct fsdp_comm *c) { return c ? c->backend : "none"; }

void fsdp_comm_stats_get(const struct fsdp_comm *c, struct fsdp_comm_stats *out) {
    if (!out) return;
    if (c) *out = c->stats;
    else memset(out, 0, sizeof *out);
}

/* ---- Validation ---- */

static int dtype_ok(enum fsdp_dtype dt) { return (unsigned)dt <= (unsigned)FSDP_U8; }
static int op_ok(enum fsdp_red_op op) { return (unsigned)op <= (unsigned)FSDP_MIN; }

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
    if (!op_ok(op)) return fsdp__err(c->ctx, FSDP_ERR_INVALID, "reduce-scatter: unknown op %d", (int)op);
    if (count > 0 && (!send || !recv))
        return fsdp__err(c->ctx, FSDP_ERR_INVALID, "reduce-scatter: %s is NULL with count %zu",
                         !send ? "send" : "recv", count);
    size_t total = bytes * (size_t)c->size;
    if (overlaps(send, total, recv, bytes))
        return fsdp__err(c->ctx, FSDP_ERR_INVALID,
                         "reduce-scatter: send and recv overlap (no in-place form)");
    FSDP_TRY(c->ops->reduce_scatter_start(c, send, recv, count, dt, op, req));
    count_start(c, FSDP_COLL_REDUCE_SCATTER, total);
    return FSDP_OK;
}

enum fsdp_status fsdp_comm_allreduce_start(struct fsdp_comm *c, const void *send, void *recv,
                                           size_t count, enum fsdp_dtype dt, enum fsdp_red_op op,
                                           struct fsdp_comm_req **req) {
    if (!c) return FSDP_ERR_INVALID;
    size_t bytes;
    FSDP_TRY(check_common(c, FSDP_COLL_ALLREDUCE, count, dt, 1, req, &bytes));
    if (!op_ok(op)) return fsdp__err(c->ctx, FSDP_ERR_INVALID, "allreduce: unknown op %d", (int)op);
    if (count > 0 && (!send || !recv))
        return fsdp__err(c->ctx, FSDP_ERR_INVALID, "allreduce: %s is NULL with count %zu",
                         !send ? "send" : "recv", count);
    if (count > 0 && send == recv) send = NULL;
    else if (overlaps(send, bytes, recv, bytes))
        return fsdp__err(c->ctx, FSDP_ERR_INVALID,
                         "allreduce: send overlaps recv but is not equal to it (in place)");
    FSDP_TRY(c->ops->allreduce_start(c, send, recv, count, dt, op, req));
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
    FSDP_TRY(c->ops->broadcast_start(c, buf, count, dt, root, req));
    count_start(c, FSDP_COLL_BROADCAST, c->rank == root ? bytes : 0);
    return FSDP_OK;
}

enum fsdp_status fsdp_comm_barrier_start(struct fsdp_comm *c, struct fsdp_comm_req **req) {
    if (!c) return FSDP_ERR_INVALID;
    if (!req) return fsdp__err(c->ctx, FSDP_ERR_INVALID, "barrier: req is NULL");
    *req = NULL;
    FSDP_TRY(c->ops->barrier_start(c, req));
    count_start(c, FSDP_COLL_BARRIER, 0);
    return FSDP_OK;
}

enum fsdp_status fsdp_comm_wait(struct fsdp_comm *c, struct fsdp_comm_req *req) {
    if (!req) return FSDP_OK;
    if (!c) return FSDP_ERR_INVALID;
    enum fsdp_coll coll = req->coll;
    FSDP_ASSERT((unsigned)coll < (unsigned)FSDP_COLL_COUNT, "corrupt request (coll %d)", (int)coll);
    double t0 = fsdp__now();
    enum fsdp_status st = c->ops->wait(c, req);
    c->stats.wait_s[coll] += fsdp__now() - t0;
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
