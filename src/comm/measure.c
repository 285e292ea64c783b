/*
 * measure.c - the communicator of a measured step ([Note: measure mode],
 * src/fsdp/plan.c): rank `rank` of a world of `size` ranks that do not
 * exist. Every collective starts and completes at once and moves no data,
 * so the caller runs the real schedule (gathers, reduce-scatters, their
 * waits and releases) for any world size in one process; only small
 * out-of-place all-reduces copy send to recv and small all-gathers give
 * every block this rank's contribution, so that agreements (a host size, a
 * loss, a batch norm's counts) read defined values. Where the plan is
 * for the MPI backend (`like_mpi`), each reduction holds from its start to
 * its wait the bytes MPI's would (fsdp__comm_mpi_reduce_bytes: the fp32
 * staging of a 16-bit reduction, an ordered reduction's gather), in the
 * library's accounting, and each request counts the bytes of the planned
 * backend's request.
 * Invariant: no collective reads or writes a data buffer larger than
 * MEASURE_COPY_MAX elements.
 */
#include "comm/comm-impl.h"

#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#define MEASURE_COPY_MAX 4096

/* 16 bytes, as mpi.c's state: a plan's split groups hold what the real
 * run's MPI splits hold (tests/test_mpi_plan.c's hybrid plans, to the byte) */
struct measure_state {
    unsigned window_mib;  /* shared windows up to this many MiB (UINT_MAX: any) */
    short like_mpi, ordered;
    size_t req_bytes; /* counted per request: the size of the planned backend's */
};

struct measure_req {
    struct fsdp_comm_req base;
    void *stage; /* MPI's reduction bytes, held until the wait, or NULL */
};

static enum fsdp_status measure_done(struct fsdp_comm *c, enum fsdp_coll coll, size_t count, enum fsdp_dtype dt,
                                     struct fsdp_comm_req **req) {
    const struct measure_state *s = c->state;
    struct measure_req *q = fsdp__comm_req_alloc(c, s->req_bytes, coll);
    if (!q) return FSDP_ERR_NOMEM;
    if (s->like_mpi && (coll == FSDP_COLL_REDUCE_SCATTER || coll == FSDP_COLL_ALLREDUCE) && c->size > 1) {
        size_t n = fsdp__comm_mpi_reduce_bytes(coll, count, dt, c->size, c->rank, s->ordered);
        if (n && !(q->stage = fsdp__alloc(c->ctx, n, FSDP_MEM_OTHER, "MPI reduction staging"))) {
            fsdp__comm_req_free(c, q);
            return FSDP_ERR_NOMEM;
        }
    }
    *req = &q->base;
    return FSDP_OK;
}

static void small_copy(const void *send, void *recv, size_t count, enum fsdp_dtype dt) {
    if (send && send != recv && count > 0 && count <= MEASURE_COPY_MAX) memmove(recv, send, count * fsdp_dtype_size(dt));
}

/* A small all-gather gives every block this rank's contribution, as if all
 * ranks agreed (a batch norm's counts, the losses): checks on the result
 * see plausible values. */
static enum fsdp_status measure_allgather_start(struct fsdp_comm *c, const void *send, void *recv, size_t count,
                                                enum fsdp_dtype dt, struct fsdp_comm_req **req) {
    size_t b = count * fsdp_dtype_size(dt);
    char *r = recv;
    const char *mine = send ? send : r + (size_t)c->rank * b; /* NULL: in place */
    if (count && count * (size_t)c->size <= MEASURE_COPY_MAX)
        for (int k = 0; k < c->size; k++)
            if (r + (size_t)k * b != mine) memmove(r + (size_t)k * b, mine, b);
    return measure_done(c, FSDP_COLL_ALLGATHER, count, dt, req);
}

static enum fsdp_status measure_reduce_scatter_start(struct fsdp_comm *c, const void *send, void *recv, size_t count,
                                                     enum fsdp_dtype dt, enum fsdp_red_op op,
                                                     struct fsdp_comm_req **req) {
    (void)send; (void)recv;
    FSDP_TRY(measure_done(c, FSDP_COLL_REDUCE_SCATTER, count, dt, req));
    (*req)->scaled = op == FSDP_AVG; /* no arithmetic ([Note: averaging reductions]) */
    return FSDP_OK;
}

static enum fsdp_status measure_allreduce_start(struct fsdp_comm *c, const void *send, void *recv, size_t count,
                                                enum fsdp_dtype dt, enum fsdp_red_op op,
                                                struct fsdp_comm_req **req) {
    small_copy(send, recv, count, dt);
    FSDP_TRY(measure_done(c, FSDP_COLL_ALLREDUCE, count, dt, req));
    (*req)->scaled = op == FSDP_AVG;
    return FSDP_OK;
}

static enum fsdp_status measure_broadcast_start(struct fsdp_comm *c, void *buf, size_t count, enum fsdp_dtype dt,
                                                int root, struct fsdp_comm_req **req) {
    (void)buf; (void)root;
    return measure_done(c, FSDP_COLL_BROADCAST, count, dt, req);
}

static enum fsdp_status measure_barrier_start(struct fsdp_comm *c, struct fsdp_comm_req **req) {
    return measure_done(c, FSDP_COLL_BARRIER, 0, FSDP_U8, req);
}

static enum fsdp_status measure_wait(struct fsdp_comm *c, struct fsdp_comm_req *req) {
    struct measure_req *q = (struct measure_req *)req;
    if (((const struct measure_state *)c->state)->like_mpi) fsdp__free(c->ctx, q->stage);
    fsdp__comm_req_free(c, q);
    return FSDP_OK;
}

static void measure_abort(struct fsdp_comm *c, int code) { (void)c; (void)code; }

static void measure_free(struct fsdp_comm *c) {
    fsdp__free(c->ctx, c->state);
    fsdp__free(c->ctx, c);
}

/* window_mib <-> bytes (SIZE_MAX: no bound) */
static unsigned window_mib(size_t bytes) {
    return bytes >= ((size_t)UINT_MAX << 20) ? UINT_MAX : (unsigned)(bytes >> 20);
}
static size_t window_bytes(unsigned mib) { return mib == UINT_MAX ? SIZE_MAX : (size_t)mib << 20; }

/* A shared window as shm makes one ([Note: shared window] in
 * src/fsdp/unit.c): reserved, never touched by a plan (no arithmetic). */
static enum fsdp_status measure_window(struct fsdp_comm *c, size_t bytes, void **base) {
    const struct measure_state *s = c->state;
    *base = NULL;
    if (bytes > window_bytes(s->window_mib)) return FSDP_OK;
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
        return fsdp__err(c->ctx, FSDP_ERR_NOMEM, "measuring communicator: cannot reserve a window of %zu bytes",
                         bytes);
    *base = p;
    return FSDP_OK;
}

static void measure_window_free(struct fsdp_comm *c, void *base, size_t bytes) {
    (void)c;
    munmap(base, bytes);
}

static const struct fsdp_comm_ops measure_ops = {
    .allgather_start = measure_allgather_start,
    .reduce_scatter_start = measure_reduce_scatter_start,
    .allreduce_start = measure_allreduce_start,
    .broadcast_start = measure_broadcast_start,
    .barrier_start = measure_barrier_start,
    .wait = measure_wait,
    .abort = measure_abort,
    .free = measure_free,
    .window = measure_window,
    .window_free = measure_window_free,
    .avg = 1,
};

enum fsdp_status fsdp__comm_measure_create(struct fsdp_ctx *ctx, int size, int rank, int like_mpi, int ordered,
                                           size_t window_max, size_t req_bytes, struct fsdp_comm **out) {
    if (size < 1 || rank < 0 || rank >= size)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "measuring communicator: rank %d of %d ranks", rank, size);
    struct fsdp_comm *c = fsdp__calloc(ctx, sizeof *c, FSDP_MEM_OTHER, "communicator");
    struct measure_state *s = fsdp__calloc(ctx, sizeof *s, FSDP_MEM_OTHER, "communicator");
    if (!c || !s) {
        fsdp__free(ctx, c);
        fsdp__free(ctx, s);
        return FSDP_ERR_NOMEM;
    }
    s->like_mpi = (short)like_mpi;
    s->ordered = (short)ordered;
    s->window_mib = window_mib(window_max);
    /* a request holds the staging pointer when it stages (MPI's are larger) */
    s->req_bytes = req_bytes > sizeof(struct measure_req) || !like_mpi ? req_bytes : sizeof(struct measure_req);
    if (s->req_bytes < sizeof(struct fsdp_comm_req)) s->req_bytes = sizeof(struct fsdp_comm_req);
    c->ops = &measure_ops;
    c->ctx = ctx;
    c->rank = rank;
    c->size = size;
    c->backend = "measure";
    c->state = s;
    *out = c;
    return FSDP_OK;
}

enum fsdp_status fsdp__comm_measure_group(struct fsdp_comm *c, int size, int rank, struct fsdp_comm **out) {
    const struct measure_state *s = c->state;
    return fsdp__comm_measure_create(c->ctx, size, rank, s->like_mpi, s->ordered, window_bytes(s->window_mib),
                                     s->req_bytes, out);
}
