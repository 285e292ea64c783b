/*
 * mpi.c - the MPI backend (Open MPI): non-blocking collectives on a private
 * duplicate of MPI_COMM_WORLD whose error handler is MPI_ERRORS_RETURN, so a
 * failing call becomes FSDP_ERR_COMM with MPI's own message.
 * Dtypes: F32, I32, U8 and U16 natively; BF16 and F16 move as raw 16-bit
 * words (all-gather, broadcast) and reduce in fp32 (see [Note: low-precision
 * reductions]).
 * Life of MPI in the process: the first communicator initialises MPI
 * (MPI_THREAD_FUNNELED: only the thread that created the context calls MPI)
 * unless someone else already has; when the last communicator is freed, MPI
 * is finalized if and only if we initialised it. MPI cannot be initialised
 * again after that, so a process that lets its last context go cannot make
 * another MPI one (FSDP_ERR_STATE says so).
 * Invariant: while a communicator lives, fsdp__abort_hook is MPI_Abort, so a
 * failed FSDP_ASSERT on one rank ends every rank instead of hanging them.
 * The watchdog (c->timeout_s) turns MPI_Wait into MPI_Test polling; the shm
 * backend (shm.c) uses an MPI communicator of this file for its handshake.
 */
#include "comm/comm-impl.h"

#include <limits.h>
#include <mpi.h>
#include <string.h>

struct mpi_state {
    MPI_Comm comm; /* dup of MPI_COMM_WORLD, errors return */
};

/* [Note: low-precision reductions]
 * MPI has no bf16 or fp16 type, and summing in 16 bits loses the low bits of
 * a gradient at every step of the reduction tree anyway. A BF16/F16
 * reduce-scatter or all-reduce therefore converts its input to fp32 in a
 * staging buffer at start, reduces in fp32, and converts the result back
 * (round to nearest even) at wait: one rounding in all, whatever the world
 * size. The staging buffers live in the request until the wait. */
struct mpi_req {
    struct fsdp_comm_req base;
    MPI_Request r;
    float *stage_in;     /* fp32 inputs of a low-precision reduction, else NULL */
    float *stage_out;    /* (n_out) fp32 results, converted into recv at wait */
    void *recv;
    size_t n_out;
    enum fsdp_dtype dt;
    uint64_t seq;        /* for the watchdog's message */
    size_t count;
    enum fsdp_dtype count_dt;
    double t_start;
    char tag[64];        /* c->tag at the start */
};

static int mpi_live;     /* communicators alive in this process */
static int mpi_we_init;  /* we called MPI_Init_thread, so we finalize */

/* ---- Helpers ---- */

static MPI_Datatype mpi_type(enum fsdp_dtype dt) {
    switch (dt) {
    case FSDP_F32: return MPI_FLOAT;
    case FSDP_I32: return MPI_INT32_T;
    case FSDP_BF16: case FSDP_F16: case FSDP_U16: return MPI_UINT16_T; /* raw words */
    case FSDP_U8: return MPI_UINT8_T;
    }
    return MPI_DATATYPE_NULL;
}

static MPI_Op mpi_op(enum fsdp_red_op op) {
    switch (op) {
    case FSDP_SUM: return MPI_SUM;
    case FSDP_MAX: return MPI_MAX;
    case FSDP_MIN: return MPI_MIN;
    }
    return MPI_OP_NULL;
}

static MPI_Comm comm_of(struct fsdp_comm *c) { return ((struct mpi_state *)c->state)->comm; }

static enum fsdp_status mpi_fail(struct fsdp_ctx *ctx, int rank, int size, int rc, const char *what) {
    char s[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, s, &len) != MPI_SUCCESS) snprintf(s, sizeof s, "MPI error %d", rc);
    return fsdp__err(ctx, FSDP_ERR_COMM, "%s failed on rank %d of %d: %s", what, rank, size, s);
}

/* MPI counts are int. */
static enum fsdp_status check_count(struct fsdp_comm *c, enum fsdp_coll coll, size_t count) {
    if (count > (size_t)INT_MAX)
        return fsdp__err(c->ctx, FSDP_ERR_UNSUPPORTED,
                         "%s: count %zu exceeds MPI's limit of %d elements per call",
                         fsdp__coll_name(coll), count, INT_MAX);
    return FSDP_OK;
}

static struct mpi_req *req_new(struct fsdp_comm *c, enum fsdp_coll coll) {
    struct mpi_req *q = fsdp__comm_req_alloc(c, sizeof *q, coll);
    if (q) {
        q->r = MPI_REQUEST_NULL;
        q->seq = c->seq;
        q->t_start = fsdp__now();
        q->count_dt = FSDP_U8;
        memcpy(q->tag, c->tag, sizeof q->tag);
    }
    return q;
}

/* Records what the watchdog names (elements and dtype). */
static struct mpi_req *req_sized(struct mpi_req *q, size_t count, enum fsdp_dtype dt) {
    if (q) { q->count = count; q->count_dt = dt; }
    return q;
}

/* MPI_Wait with the watchdog: polls MPI_Test (which, like MPI_Wait, drives
 * progress) until the request completes or c->timeout_s has passed since
 * its start. On timeout the request is left pending (MPI cannot cancel a
 * collective): the caller must end the job. */
static int wait_timed(struct fsdp_comm *c, struct mpi_req *q, int *timed_out) {
    *timed_out = 0;
    if (c->timeout_s <= 0) return MPI_Wait(&q->r, MPI_STATUS_IGNORE);
    for (unsigned i = 0;; i++) {
        int flag = 0, rc = MPI_Test(&q->r, &flag, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS || flag) return rc;
        if ((i & 1023) == 0 && fsdp__now() - q->t_start > c->timeout_s) {
            *timed_out = 1;
            return MPI_SUCCESS;
        }
    }
}

static void req_release(struct fsdp_comm *c, struct mpi_req *q) {
    fsdp__free(c->ctx, q->stage_in);
    fsdp__free(c->ctx, q->stage_out);
    fsdp__comm_req_free(c, q);
}

/* Finishes a start: on MPI failure frees q and reports; else hands q out. */
static enum fsdp_status started(struct fsdp_comm *c, struct mpi_req *q, int rc,
                                struct fsdp_comm_req **req) {
    if (rc != MPI_SUCCESS) {
        enum fsdp_status st = mpi_fail(c->ctx, c->rank, c->size, rc, fsdp__coll_name(q->base.coll));
        req_release(c, q);
        return st;
    }
    *req = &q->base;
    return FSDP_OK;
}

/* Sets up fp32 staging for a low-precision reduction (see the note): n_in
 * inputs from `in`, n_out results to go to recv. */
static enum fsdp_status stage(struct fsdp_comm *c, struct mpi_req *q, const void *in, size_t n_in,
                              void *recv, size_t n_out, enum fsdp_dtype dt) {
    q->stage_in = fsdp__alloc(c->ctx, (n_in ? n_in : 1) * sizeof(float), FSDP_MEM_OTHER,
                              "fp32 staging of a low-precision reduction");
    q->stage_out = fsdp__alloc(c->ctx, (n_out ? n_out : 1) * sizeof(float), FSDP_MEM_OTHER,
                               "fp32 staging of a low-precision reduction");
    if (!q->stage_in || !q->stage_out) return FSDP_ERR_NOMEM;
    fsdp__low_to_f32(in, q->stage_in, n_in, dt);
    q->recv = recv;
    q->n_out = n_out;
    q->dt = dt;
    return FSDP_OK;
}

/* ---- Collectives ---- */

static enum fsdp_status mpi_allgather_start(struct fsdp_comm *c, const void *send, void *recv,
                                            size_t count, enum fsdp_dtype dt,
                                            struct fsdp_comm_req **req) {
    FSDP_TRY(check_count(c, FSDP_COLL_ALLGATHER, count));
    struct mpi_req *q = req_sized(req_new(c, FSDP_COLL_ALLGATHER), count, dt);
    if (!q) return FSDP_ERR_NOMEM;
    MPI_Datatype t = mpi_type(dt);
    int rc = send ? MPI_Iallgather(send, (int)count, t, recv, (int)count, t, comm_of(c), &q->r)
                  : MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv, (int)count, t,
                                   comm_of(c), &q->r);
    return started(c, q, rc, req);
}

static enum fsdp_status mpi_reduce_scatter_start(struct fsdp_comm *c, const void *send, void *recv,
                                                 size_t count, enum fsdp_dtype dt,
                                                 enum fsdp_red_op op, struct fsdp_comm_req **req) {
    FSDP_TRY(check_count(c, FSDP_COLL_REDUCE_SCATTER, count));
    struct mpi_req *q = req_sized(req_new(c, FSDP_COLL_REDUCE_SCATTER), count, dt);
    if (!q) return FSDP_ERR_NOMEM;
    int rc;
    if (fsdp__dtype_is_low(dt)) {
        enum fsdp_status st = stage(c, q, send, count * (size_t)c->size, recv, count, dt);
        if (st != FSDP_OK) { req_release(c, q); return st; }
        rc = MPI_Ireduce_scatter_block(q->stage_in, q->stage_out, (int)count, MPI_FLOAT,
                                       mpi_op(op), comm_of(c), &q->r);
    } else {
        rc = MPI_Ireduce_scatter_block(send, recv, (int)count, mpi_type(dt), mpi_op(op),
                                       comm_of(c), &q->r);
    }
    return started(c, q, rc, req);
}

static enum fsdp_status mpi_allreduce_start(struct fsdp_comm *c, const void *send, void *recv,
                                            size_t count, enum fsdp_dtype dt, enum fsdp_red_op op,
                                            struct fsdp_comm_req **req) {
    FSDP_TRY(check_count(c, FSDP_COLL_ALLREDUCE, count));
    struct mpi_req *q = req_sized(req_new(c, FSDP_COLL_ALLREDUCE), count, dt);
    if (!q) return FSDP_ERR_NOMEM;
    int rc;
    if (fsdp__dtype_is_low(dt)) {
        enum fsdp_status st = stage(c, q, send ? send : recv, count, recv, count, dt);
        if (st != FSDP_OK) { req_release(c, q); return st; }
        rc = MPI_Iallreduce(q->stage_in, q->stage_out, (int)count, MPI_FLOAT, mpi_op(op),
                            comm_of(c), &q->r);
    } else {
        rc = MPI_Iallreduce(send ? send : MPI_IN_PLACE, recv, (int)count, mpi_type(dt),
                            mpi_op(op), comm_of(c), &q->r);
    }
    return started(c, q, rc, req);
}

static enum fsdp_status mpi_broadcast_start(struct fsdp_comm *c, void *buf, size_t count,
                                            enum fsdp_dtype dt, int root,
                                            struct fsdp_comm_req **req) {
    FSDP_TRY(check_count(c, FSDP_COLL_BROADCAST, count));
    struct mpi_req *q = req_sized(req_new(c, FSDP_COLL_BROADCAST), count, dt);
    if (!q) return FSDP_ERR_NOMEM;
    int rc = MPI_Ibcast(buf, (int)count, mpi_type(dt), root, comm_of(c), &q->r);
    return started(c, q, rc, req);
}

static enum fsdp_status mpi_barrier_start(struct fsdp_comm *c, struct fsdp_comm_req **req) {
    struct mpi_req *q = req_new(c, FSDP_COLL_BARRIER);
    if (!q) return FSDP_ERR_NOMEM;
    int rc = MPI_Ibarrier(comm_of(c), &q->r);
    return started(c, q, rc, req);
}

static enum fsdp_status mpi_wait(struct fsdp_comm *c, struct fsdp_comm_req *req) {
    struct mpi_req *q = (struct mpi_req *)req;
    int timed_out;
    int rc = wait_timed(c, q, &timed_out);
    enum fsdp_status st = FSDP_OK;
    if (timed_out) {
        st = fsdp__err(c->ctx, FSDP_ERR_COMM,
                       "collective timeout: rank %d waited %.1f s (limit %g s) in %s #%llu (%zu elements "
                       "of %s, %zu bytes%s%s)", c->rank, fsdp__now() - q->t_start, c->timeout_s,
                       fsdp__coll_name(q->base.coll), (unsigned long long)q->seq, q->count,
                       fsdp_dtype_name(q->count_dt), q->count * fsdp_dtype_size(q->count_dt),
                       q->tag[0] ? ", tag " : "", q->tag);
        fprintf(stderr, "fsdp: %s\n", fsdp_errmsg(c->ctx));
        fflush(stderr);
        /* q stays allocated: MPI may still write its buffers; the job must end */
        return st;
    }
    if (rc != MPI_SUCCESS) {
        char what[64];
        snprintf(what, sizeof what, "%s wait", fsdp__coll_name(q->base.coll));
        st = mpi_fail(c->ctx, c->rank, c->size, rc, what);
    } else if (q->stage_out) {
        fsdp__f32_to_low(q->stage_out, q->recv, q->n_out, q->dt);
    }
    req_release(c, q);
    return st;
}

/* ---- Topology ---- */

enum fsdp_status fsdp__comm_mpi_local_size(struct fsdp_comm *c, int *local) {
    MPI_Comm node;
    int rc = MPI_Comm_split_type(comm_of(c), MPI_COMM_TYPE_SHARED, c->rank, MPI_INFO_NULL, &node);
    if (rc != MPI_SUCCESS) return mpi_fail(c->ctx, c->rank, c->size, rc, "MPI_Comm_split_type");
    MPI_Comm_size(node, local);
    MPI_Comm_free(&node);
    return FSDP_OK;
}

/* ---- Life ---- */

static const struct fsdp_comm_ops mpi_ops;

enum fsdp_status fsdp__comm_mpi_split(struct fsdp_comm *c, int color, int key, struct fsdp_comm **out) {
    MPI_Comm sub = MPI_COMM_NULL;
    int rc = MPI_Comm_split(comm_of(c), color, key, &sub);
    if (rc != MPI_SUCCESS) return mpi_fail(c->ctx, c->rank, c->size, rc, "MPI_Comm_split");
    struct fsdp_comm *n = fsdp__calloc(c->ctx, sizeof *n, FSDP_MEM_OTHER, "communicator");
    struct mpi_state *s = fsdp__calloc(c->ctx, sizeof *s, FSDP_MEM_OTHER, "MPI communicator state");
    if (!n || !s) {
        fsdp__free(c->ctx, n);
        fsdp__free(c->ctx, s);
        MPI_Comm_free(&sub);
        return FSDP_ERR_NOMEM;
    }
    MPI_Comm_set_errhandler(sub, MPI_ERRORS_RETURN);
    s->comm = sub;
    n->ops = &mpi_ops;
    n->ctx = c->ctx;
    n->backend = "mpi";
    n->state = s;
    MPI_Comm_rank(sub, &n->rank);
    MPI_Comm_size(sub, &n->size);
    mpi_live++;
    *out = n;
    return FSDP_OK;
}

static void mpi_abort_hook(int code) {
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    if (init && !fin) MPI_Abort(MPI_COMM_WORLD, code);
}

static void mpi_abort(struct fsdp_comm *c, int code) {
    (void)c;
    mpi_abort_hook(code);
}

static void mpi_free(struct fsdp_comm *c) {
    struct mpi_state *s = c->state;
    if (s) {
        if (s->comm != MPI_COMM_NULL) MPI_Comm_free(&s->comm);
        fsdp__free(c->ctx, s);
    }
    fsdp__free(c->ctx, c);
    if (--mpi_live == 0 && mpi_we_init) {
        if (fsdp__abort_hook == mpi_abort_hook) fsdp__abort_hook = NULL;
        MPI_Finalize();
        mpi_we_init = 0;
    }
}

static const struct fsdp_comm_ops mpi_ops = {
    .allgather_start = mpi_allgather_start,
    .reduce_scatter_start = mpi_reduce_scatter_start,
    .allreduce_start = mpi_allreduce_start,
    .broadcast_start = mpi_broadcast_start,
    .barrier_start = mpi_barrier_start,
    .wait = mpi_wait,
    .abort = mpi_abort,
    .free = mpi_free,
};

enum fsdp_status fsdp__comm_mpi_create(struct fsdp_ctx *ctx, struct fsdp_comm **out) {
    int init = 0, fin = 0, rc;
    MPI_Finalized(&fin);
    if (fin)
        return fsdp__err(ctx, FSDP_ERR_STATE,
                         "MPI was already finalized in this process (freeing the last context "
                         "finalizes MPI; keep one context alive for the life of the process)");
    MPI_Initialized(&init);
    if (!init) {
        int provided = 0;
        rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided);
        if (rc != MPI_SUCCESS) return mpi_fail(ctx, 0, 1, rc, "MPI_Init_thread");
        mpi_we_init = 1;
    }
    struct fsdp_comm *c = fsdp__calloc(ctx, sizeof *c, FSDP_MEM_OTHER, "communicator");
    struct mpi_state *s = fsdp__calloc(ctx, sizeof *s, FSDP_MEM_OTHER, "MPI communicator state");
    if (!c || !s) {
        fsdp__free(ctx, c);
        fsdp__free(ctx, s);
        if (mpi_live == 0 && mpi_we_init) { MPI_Finalize(); mpi_we_init = 0; }
        return FSDP_ERR_NOMEM;
    }
    c->ops = &mpi_ops;
    c->ctx = ctx;
    c->backend = "mpi";
    c->state = s;
    s->comm = MPI_COMM_NULL;
    mpi_live++;
    /* From here mpi_free undoes everything, including MPI_Init. */
    rc = MPI_Comm_dup(MPI_COMM_WORLD, &s->comm);
    if (rc != MPI_SUCCESS) {
        s->comm = MPI_COMM_NULL;
        enum fsdp_status st = mpi_fail(ctx, 0, 1, rc, "MPI_Comm_dup");
        mpi_free(c);
        return st;
    }
    MPI_Comm_set_errhandler(s->comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(s->comm, &c->rank);
    MPI_Comm_size(s->comm, &c->size);
    fsdp__abort_hook = mpi_abort_hook;
    *out = c;
    return FSDP_OK;
}
