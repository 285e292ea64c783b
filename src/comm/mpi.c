/*
 * mpi.c - the MPI backend (Open MPI): non-blocking collectives on a private
 * duplicate of MPI_COMM_WORLD whose error handler is MPI_ERRORS_RETURN, so a
 * failing call becomes FSDP_ERR_COMM with MPI's own message.
 * Dtypes: F32, I32, U8 and U16 natively; BF16 and F16 move as raw 16-bit
 * words (all-gather, broadcast) and reduce in fp32 (see [Note: low-precision
 * reductions]).
 * Life of MPI in the process: the first communicator initialises MPI
 * (MPI_THREAD_MULTIPLE, for the progress thread) unless someone else already
 * has; when the last communicator is freed, the progress thread is joined
 * and MPI is finalized if and only if we initialised it. MPI cannot be
 * initialised again after that, so a process that lets its last context go
 * cannot make another MPI one (FSDP_ERR_STATE says so).
 * Progress: a started request is handed to one progress thread per process,
 * which drives it with MPI_Test while the compute thread computes; the wait
 * sleeps until the thread has seen it complete ([Note: MPI progress
 * thread], mpi_progress.c).
 * Without MPI_THREAD_MULTIPLE, without a free core for the thread (unless
 * FSDP_MPI_PROGRESS=1), or with FSDP_MPI_PROGRESS=0, the compute thread
 * waits with MPI_Wait as before, and collectives advance only inside MPI
 * calls.
 * Invariant: while a communicator lives, fsdp__abort_hook is MPI_Abort, so a
 * failed FSDP_ASSERT on one rank ends every rank instead of hanging them.
 * The watchdog (c->timeout_s) bounds either wait; across hosts the peer
 * watch (peers.c, started with the job's first communicator) fails a wait
 * as soon as a rank of another host is gone, and tells the watchdog which
 * hosts went silent. The shm backend (shm.c) uses an MPI communicator of
 * this file for its handshake.
 */
#include "comm/mpi-impl.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <mpi.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* [Note: ordered reductions]
 * Open MPI's reduce-scatter and all-reduce add the contributions in an order
 * that depends on the algorithm it picks for the world size and message
 * size (and on which rank runs which step): 30-43% of fp32 elements differed
 * from the rank-order sum at 4-5 ranks, so a run across hosts differed from
 * the same run on one host (shm) and from itself at another size. By
 * default (FSDP_MPI_REDUCE=ordered) this file therefore moves the data with
 * MPI and does the arithmetic itself, in shm.c's order ([Note: reduction
 * order]: acc = x0; acc op= x1; ... with the same helpers, BF16/F16 in fp32
 * rounded once), so MPI across hosts gives shm's bits on one host:
 *   reduce-scatter: one MPI_Ialltoall hands every rank the W contributions
 *     to its block (each rank sends (W-1)/W of its input, as a ring does);
 *     the wait sums them in rank order into recv;
 *   all-reduce, small (< ORDERED_SPLIT bytes): MPI_Iallgather of every
 *     rank's input, and every rank sums all W in rank order (one collective:
 *     norms, losses, SyncBatchNorm's statistics);
 *   all-reduce, larger: a reduce-scatter as above over W near-equal blocks
 *     (MPI_Ialltoallv), the ordered sum of this rank's block, then an
 *     in-place MPI_Iallgatherv of the summed blocks: 2(W-1)/W of the input
 *     sent per rank, as a ring all-reduce.
 * 16-bit floats travel as 16-bit words (half the bytes of the native path's
 * fp32 staging). The first MPI request goes to the progress thread like any
 * other; the sums (and the all-gather of the two-step all-reduce, started
 * then) happen in the wait, on the caller's thread. The gather buffer holds
 * W blocks: for a reduce-scatter as much as the input. FSDP_MPI_REDUCE=native
 * (fsdp-train --mpi-reduce native) selects Open MPI's own collectives, for
 * speed comparisons; a communicator reads it at creation, splits inherit. */
enum { ORD_NONE, ORD_RS, ORD_AR_GATHER, ORD_AR_RS, ORD_AR_AG };
#define ORDERED_SPLIT ((size_t)32 << 10)

/* [Note: low-precision reductions]
 * MPI has no bf16 or fp16 type, and summing in 16 bits loses the low bits of
 * a gradient at every step of the reduction tree anyway. A BF16/F16
 * reduce-scatter or all-reduce therefore converts its input to fp32 in a
 * staging buffer at start, reduces in fp32, and converts the result back
 * (round to nearest even) at wait: one rounding in all, whatever the world
 * size. The staging buffers live in the request until the wait. */
static int mpi_live;     /* communicators alive in this process */
static int peers_watched; /* the peer watch runs ([Note: peer watch], peers.c): waits look at it */
#define ABORT_GRACE_S 5   /* seconds MPI_Abort has to end the process */
static int mpi_we_init;  /* we called MPI_Init_thread, so we finalize */
static int mpi_multiple; /* MPI provides MPI_THREAD_MULTIPLE */

/* ---- Helpers ---- */

static MPI_Datatype mpi_type(enum fsdp_dtype dt) {
    switch (dt) {
    case FSDP_F32: return MPI_FLOAT;
    case FSDP_I32: return MPI_INT32_T;
    case FSDP_BF16: case FSDP_F16: case FSDP_U16: return MPI_UINT16_T; /* raw words */
    case FSDP_U8: return MPI_UINT8_T;
    case FSDP_I64: return MPI_INT64_T;
    }
    return MPI_DATATYPE_NULL;
}

static MPI_Op mpi_op(enum fsdp_red_op op) {
    switch (op) {
    case FSDP_SUM: return MPI_SUM;
    case FSDP_MAX: return MPI_MAX;
    case FSDP_MIN: return MPI_MIN;
    case FSDP_AVG: break; /* comm.c hands this backend FSDP_SUM ([Note: averaging reductions]) */
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

/* The wait of a request kept by the compute thread: MPI_Wait, or with the
 * watchdog or the peer watch MPI_Test polling (which, like MPI_Wait, drives
 * progress) until the request completes, c->timeout_s has passed since its
 * start (*timed_out = 1) or the peer watch has lost a peer (2). Then the
 * request is left pending (MPI cannot cancel a collective): the caller must
 * end the job. */
static int wait_timed(struct fsdp_comm *c, struct mpi_req *q, int *timed_out) {
    *timed_out = 0;
    int rc;
    char lost[8];
    if (c->timeout_s <= 0 && !peers_watched) {
        mpi_enter();
        rc = MPI_Wait(&q->r, MPI_STATUS_IGNORE);
        mpi_leave();
        return rc;
    }
    for (unsigned i = 0;; i++) {
        int flag = 0;
        mpi_enter();
        rc = MPI_Test(&q->r, &flag, MPI_STATUS_IGNORE);
        mpi_leave();
        if (rc != MPI_SUCCESS || flag) return rc;
        if ((i & 1023) == 0 && c->timeout_s > 0 && fsdp__now() - q->t_start > c->timeout_s) {
            *timed_out = 1;
            return MPI_SUCCESS;
        }
        if ((i & 1023) == 0 && fsdp__peers_lost(lost, sizeof lost)) {
            *timed_out = 2; /* a lost peer: mpi_wait reports */
            return MPI_SUCCESS;
        }
    }
}

int fsdp__comm_mpi_progress(const struct fsdp_comm *c) {
    FSDP_ASSERT(!strcmp(c->backend, "mpi"), "not an MPI communicator (%s)", c->backend);
    if (!mpi_multiple) return -1;
    return ((const struct mpi_state *)c->state)->progress;
}

static void req_release(struct fsdp_comm *c, struct mpi_req *q) {
    fsdp__free(c->ctx, q->gather);
    fsdp__free(c->ctx, q->counts);
    fsdp__free(c->ctx, q->stage_in);
    fsdp__free(c->ctx, q->stage_out);
    fsdp__comm_req_free(c, q);
}

/* The latest collective this process started, for the peer watch's message
 * (fsdp__comm_mpi_latest): a copy taken at start, under its own lock. */
static struct {
    pthread_mutex_t mu;
    int any, done;
    enum fsdp_coll coll;
    unsigned long long seq;
    size_t bytes;
    double t_start;
    char tag[64];
} latest = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void latest_set(const struct mpi_req *q, int done) {
    pthread_mutex_lock(&latest.mu);
    if (done) {
        if (latest.any && latest.seq == q->seq && latest.coll == q->base.coll) latest.done = 1;
    } else {
        latest.any = 1;
        latest.done = 0;
        latest.coll = q->base.coll;
        latest.seq = q->seq;
        latest.bytes = q->count * fsdp_dtype_size(q->count_dt);
        latest.t_start = q->t_start;
        memcpy(latest.tag, q->tag, sizeof latest.tag);
    }
    pthread_mutex_unlock(&latest.mu);
}

void fsdp__comm_mpi_latest(char *buf, size_t n) {
    pthread_mutex_lock(&latest.mu);
    if (!latest.any) snprintf(buf, n, "no collective started yet");
    else
        snprintf(buf, n, "%s #%llu (%zu bytes%s%s), started %.1f s ago, %s", fsdp__coll_name(latest.coll),
                 latest.seq, latest.bytes, latest.tag[0] ? ", tag " : "", latest.tag,
                 fsdp__now() - latest.t_start, latest.done ? "completed" : "not completed");
    pthread_mutex_unlock(&latest.mu);
}

/* Finishes a start: on MPI failure frees q and reports; else hands q out. */
static enum fsdp_status started(struct fsdp_comm *c, struct mpi_req *q, int rc,
                                struct fsdp_comm_req **req) {
    if (rc != MPI_SUCCESS) {
        enum fsdp_status st = mpi_fail(c->ctx, c->rank, c->size, rc, fsdp__coll_name(q->base.coll));
        req_release(c, q);
        return st;
    }
    latest_set(q, 0);
    if (((struct mpi_state *)c->state)->progress) fsdp__mpi_prog_add(q);
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
    mpi_enter();
    int rc = send ? MPI_Iallgather(send, (int)count, t, recv, (int)count, t, comm_of(c), &q->r)
                  : MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv, (int)count, t,
                                   comm_of(c), &q->r);
    mpi_leave();
    return started(c, q, rc, req);
}

/* ---- Ordered reductions (see [Note: ordered reductions]) ---- */

/* dst = the rank-order reduction of W contributions of n elements of dt, the
 * k-th at src + k * stride elements (shm.c's steps, in chunks that stay in
 * cache; 16-bit floats accumulate in fp32 and round once). */
static void ordered_sum(void *dst, const void *src, size_t stride, size_t n, int W, enum fsdp_dtype dt,
                        enum fsdp_red_op op) {
    enum { CH = 4096 };
    size_t esz = fsdp_dtype_size(dt);
    int low = fsdp__dtype_is_low(dt);
    float acc[CH], tmp[CH];
    for (size_t off = 0; off < n; off += CH) {
        size_t m = n - off < CH ? n - off : CH;
        for (int k = 0; k < W; k++) {
            const unsigned char *x = (const unsigned char *)src + ((size_t)k * stride + off) * esz;
            if (low) fsdp__shm_reduce_low(acc, x, m, dt, op, k == 0, tmp);
            else fsdp__shm_reduce_into((unsigned char *)dst + off * esz, x, m, dt, op, k == 0);
        }
        if (low) fsdp__f32_to_low(acc, (unsigned char *)dst + off * esz, m, dt);
    }
}

/* Block k of an all-reduce of count elements: [lo(k), lo(k+1)). */
static size_t block_lo(size_t count, int W, int k) { return count * (size_t)k / (size_t)W; }

static enum fsdp_status ordered_start(struct fsdp_comm *c, struct mpi_req *q, const void *in, void *recv,
                                      size_t count, enum fsdp_dtype dt, enum fsdp_red_op op,
                                      struct fsdp_comm_req **req) {
    int W = c->size, me = c->rank;
    size_t esz = fsdp_dtype_size(dt);
    MPI_Datatype t = mpi_type(dt);
    q->recv = recv;
    q->dt = dt;
    q->op = op;
    q->n_out = count;
    int rc;
    if (q->base.coll == FSDP_COLL_REDUCE_SCATTER) {
        q->ord = ORD_RS;
        q->gather = fsdp__alloc(c->ctx, (count ? count : 1) * (size_t)W * esz, FSDP_MEM_OTHER,
                                "ordered reduce-scatter: the contributions");
        if (!q->gather) { req_release(c, q); return FSDP_ERR_NOMEM; }
        mpi_enter();
        rc = MPI_Ialltoall(in, (int)count, t, q->gather, (int)count, t, comm_of(c), &q->r);
        mpi_leave();
    } else if (count * esz < ORDERED_SPLIT) {
        q->ord = ORD_AR_GATHER;
        q->gather = fsdp__alloc(c->ctx, (count ? count : 1) * (size_t)W * esz, FSDP_MEM_OTHER,
                                "ordered all-reduce: the contributions");
        if (!q->gather) { req_release(c, q); return FSDP_ERR_NOMEM; }
        mpi_enter();
        rc = MPI_Iallgather(in, (int)count, t, q->gather, (int)count, t, comm_of(c), &q->r);
        mpi_leave();
    } else {
        q->ord = ORD_AR_RS;
        size_t blk = block_lo(count, W, me + 1) - block_lo(count, W, me);
        q->gather = fsdp__alloc(c->ctx, (blk ? blk : 1) * (size_t)W * esz, FSDP_MEM_OTHER,
                                "ordered all-reduce: the contributions to this rank's block");
        q->counts = fsdp__alloc(c->ctx, 4 * (size_t)W * sizeof(int), FSDP_MEM_OTHER,
                                "ordered all-reduce: block sizes");
        if (!q->gather || !q->counts) { req_release(c, q); return FSDP_ERR_NOMEM; }
        int *cnt = q->counts, *off = cnt + W, *rcnt = cnt + 2 * W, *roff = cnt + 3 * W;
        for (int k = 0; k < W; k++) {
            cnt[k] = (int)(block_lo(count, W, k + 1) - block_lo(count, W, k));
            off[k] = (int)block_lo(count, W, k);
            rcnt[k] = (int)blk;
            roff[k] = (int)(blk * (size_t)k);
        }
        mpi_enter();
        rc = MPI_Ialltoallv(in, cnt, off, t, q->gather, rcnt, roff, t, comm_of(c), &q->r);
        mpi_leave();
    }
    return started(c, q, rc, req);
}

/* The wait's part of an ordered reduction once q->r completed: the sums,
 * and for the two-step all-reduce the start of its all-gather (*again: wait
 * for that too). Returns MPI's code. */
static int ordered_finish(struct fsdp_comm *c, struct mpi_req *q, int *again) {
    int W = c->size, me = c->rank;
    size_t count = q->n_out;
    *again = 0;
    switch (q->ord) {
    case ORD_RS: case ORD_AR_GATHER:
        ordered_sum(q->recv, q->gather, count, count, W, q->dt, q->op);
        return MPI_SUCCESS;
    case ORD_AR_RS: {
        size_t lo = block_lo(count, W, me), blk = block_lo(count, W, me + 1) - lo;
        size_t esz = fsdp_dtype_size(q->dt);
        ordered_sum((unsigned char *)q->recv + lo * esz, q->gather, blk, blk, W, q->dt, q->op);
        q->ord = ORD_AR_AG;
        q->done = 0;
        q->on_thread = 0;
        q->next = NULL;
        mpi_enter();
        int rc = MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, q->recv, q->counts, q->counts + W,
                                 mpi_type(q->dt), comm_of(c), &q->r);
        mpi_leave();
        if (rc != MPI_SUCCESS) return rc;
        if (((struct mpi_state *)c->state)->progress) fsdp__mpi_prog_add(q);
        *again = 1;
        return MPI_SUCCESS;
    }
    }
    return MPI_SUCCESS;
}

size_t fsdp__comm_mpi_reduce_bytes(enum fsdp_coll coll, size_t count, enum fsdp_dtype dt, int world, int rank,
                                   int ordered) {
    size_t esz = fsdp_dtype_size(dt), W = (size_t)world;
    int rs = coll == FSDP_COLL_REDUCE_SCATTER;
    if (!ordered || world < 2) { /* stage(): fp32 inputs and results of a 16-bit reduction */
        if (!fsdp__dtype_is_low(dt)) return 0;
        size_t n_in = rs ? count * W : count;
        return ((n_in ? n_in : 1) + (count ? count : 1)) * sizeof(float);
    }
    if (rs || count * esz < ORDERED_SPLIT) return (count ? count : 1) * W * esz; /* ordered_start's gather */
    size_t blk = block_lo(count, world, rank + 1) - block_lo(count, world, rank);
    return (blk ? blk : 1) * W * esz + 4 * W * sizeof(int);
}

static int req_ordered(struct fsdp_comm *c) {
    return ((struct mpi_state *)c->state)->ordered && c->size > 1;
}

size_t fsdp__comm_mpi_req_bytes(void) { return sizeof(struct mpi_req); }

int fsdp__comm_mpi_ordered(const struct fsdp_comm *c) {
    FSDP_ASSERT(!strcmp(c->backend, "mpi"), "not an MPI communicator (%s)", c->backend);
    return ((const struct mpi_state *)c->state)->ordered;
}

static enum fsdp_status mpi_reduce_scatter_start(struct fsdp_comm *c, const void *send, void *recv,
                                                 size_t count, enum fsdp_dtype dt,
                                                 enum fsdp_red_op op, struct fsdp_comm_req **req) {
    FSDP_TRY(check_count(c, FSDP_COLL_REDUCE_SCATTER, count));
    struct mpi_req *q = req_sized(req_new(c, FSDP_COLL_REDUCE_SCATTER), count, dt);
    if (!q) return FSDP_ERR_NOMEM;
    if (req_ordered(c)) return ordered_start(c, q, send, recv, count, dt, op, req);
    if (fsdp__dtype_is_low(dt)) {
        enum fsdp_status st = stage(c, q, send, count * (size_t)c->size, recv, count, dt);
        if (st != FSDP_OK) { req_release(c, q); return st; }
    }
    mpi_enter();
    int rc = q->stage_in ? MPI_Ireduce_scatter_block(q->stage_in, q->stage_out, (int)count, MPI_FLOAT,
                                                     mpi_op(op), comm_of(c), &q->r)
                         : MPI_Ireduce_scatter_block(send, recv, (int)count, mpi_type(dt), mpi_op(op),
                                                     comm_of(c), &q->r);
    mpi_leave();
    return started(c, q, rc, req);
}

static enum fsdp_status mpi_allreduce_start(struct fsdp_comm *c, const void *send, void *recv,
                                            size_t count, enum fsdp_dtype dt, enum fsdp_red_op op,
                                            struct fsdp_comm_req **req) {
    FSDP_TRY(check_count(c, FSDP_COLL_ALLREDUCE, count));
    struct mpi_req *q = req_sized(req_new(c, FSDP_COLL_ALLREDUCE), count, dt);
    if (!q) return FSDP_ERR_NOMEM;
    if (req_ordered(c)) return ordered_start(c, q, send ? send : recv, recv, count, dt, op, req);
    if (fsdp__dtype_is_low(dt)) {
        enum fsdp_status st = stage(c, q, send ? send : recv, count, recv, count, dt);
        if (st != FSDP_OK) { req_release(c, q); return st; }
    }
    mpi_enter();
    int rc = q->stage_in ? MPI_Iallreduce(q->stage_in, q->stage_out, (int)count, MPI_FLOAT, mpi_op(op),
                                          comm_of(c), &q->r)
                         : MPI_Iallreduce(send ? send : MPI_IN_PLACE, recv, (int)count, mpi_type(dt),
                                          mpi_op(op), comm_of(c), &q->r);
    mpi_leave();
    return started(c, q, rc, req);
}

static enum fsdp_status mpi_broadcast_start(struct fsdp_comm *c, void *buf, size_t count,
                                            enum fsdp_dtype dt, int root,
                                            struct fsdp_comm_req **req) {
    FSDP_TRY(check_count(c, FSDP_COLL_BROADCAST, count));
    struct mpi_req *q = req_sized(req_new(c, FSDP_COLL_BROADCAST), count, dt);
    if (!q) return FSDP_ERR_NOMEM;
    mpi_enter();
    int rc = MPI_Ibcast(buf, (int)count, mpi_type(dt), root, comm_of(c), &q->r);
    mpi_leave();
    return started(c, q, rc, req);
}

static enum fsdp_status mpi_barrier_start(struct fsdp_comm *c, struct fsdp_comm_req **req) {
    struct mpi_req *q = req_new(c, FSDP_COLL_BARRIER);
    if (!q) return FSDP_ERR_NOMEM;
    mpi_enter();
    int rc = MPI_Ibarrier(comm_of(c), &q->r);
    mpi_leave();
    return started(c, q, rc, req);
}

static enum fsdp_status mpi_wait(struct fsdp_comm *c, struct fsdp_comm_req *req) {
    struct mpi_req *q = (struct mpi_req *)req;
    int timed_out, again = 0;
    int rc;
    do {
        rc = q->on_thread ? fsdp__mpi_prog_wait(c, q, peers_watched, &timed_out) : wait_timed(c, q, &timed_out);
        if (!timed_out && rc == MPI_SUCCESS && q->ord != ORD_NONE) {
            rc = ordered_finish(c, q, &again);
            q->ord = again ? q->ord : ORD_NONE;
        } else {
            again = 0;
        }
    } while (again);
    enum fsdp_status st = FSDP_OK;
    char lost[320], silence[320], named[160];
    if (timed_out == 2 && fsdp__peers_lost(lost, sizeof lost)) {
        st = fsdp__err(c->ctx, FSDP_ERR_COMM, "%s cannot complete: %s; rank %d waited %.1f s",
                       fsdp__coll_what(q->base.coll, q->seq, q->count, q->count_dt, q->tag, named, sizeof named), lost,
                       c->rank, fsdp__now() - q->t_start);
        return st; /* q stays, as on a timeout */
    }
    if (timed_out) {
        fsdp__peers_silence(silence, sizeof silence);
        st = fsdp__err(c->ctx, FSDP_ERR_COMM, "collective timeout: rank %d waited %.1f s (limit %g s) in %s%s%s",
                       c->rank, fsdp__now() - q->t_start, c->timeout_s,
                       fsdp__coll_what(q->base.coll, q->seq, q->count, q->count_dt, q->tag, named, sizeof named),
                       silence[0] ? "; peer watch: " : "", silence);
        fprintf(stderr, "fsdp: %s\n", fsdp_errmsg(c->ctx));
        fflush(stderr);
        /* q stays allocated (and with the progress thread, if it was): MPI may
         * still write its buffers; the job must end */
        return st;
    }
    if (rc != MPI_SUCCESS) {
        char what[64];
        snprintf(what, sizeof what, "%s wait", fsdp__coll_name(q->base.coll));
        st = mpi_fail(c->ctx, c->rank, c->size, rc, what);
    } else if (q->stage_out) {
        fsdp__f32_to_low(q->stage_out, q->recv, q->n_out, q->dt);
    }
    if (rc == MPI_SUCCESS) latest_set(q, 1);
    req_release(c, q);
    return st;
}

/* ---- Topology ---- */

/* [Note: hosts] Two ranks share a host when Open MPI places them on one node
 * (MPI_COMM_TYPE_SHARED) and their hostnames (gethostname, the UTS
 * namespace's) are equal. Both must hold: Open MPI alone would pair ranks
 * that a launcher started in separate containers or namespaces of one
 * machine, which may share /dev/shm and /tmp (the simulated hosts of
 * scripts/simhosts.sh do) but are separate hosts to the user; the hostname
 * alone would pair two machines of one name. The shm backend and HYBRID_SHARD's
 * groups go by this count, so the shm engine never spans two hosts. */
void fsdp__comm_hostname(char name[FSDP_HOST_MAX]) {
    memset(name, 0, FSDP_HOST_MAX);
    if (gethostname(name, FSDP_HOST_MAX - 1) != 0) snprintf(name, FSDP_HOST_MAX, "?");
    name[FSDP_HOST_MAX - 1] = 0;
}

enum fsdp_status fsdp__comm_mpi_local_size(struct fsdp_comm *c, int *local) {
    MPI_Comm node;
    char mine[FSDP_HOST_MAX], *all = NULL;
    fsdp__comm_hostname(mine);
    int n = 0, same = 0;
    mpi_enter();
    int rc = MPI_Comm_split_type(comm_of(c), MPI_COMM_TYPE_SHARED, c->rank, MPI_INFO_NULL, &node);
    if (rc == MPI_SUCCESS) {
        MPI_Comm_size(node, &n);
        all = fsdp__malloc((size_t)n * FSDP_HOST_MAX);
        if (all) rc = MPI_Allgather(mine, FSDP_HOST_MAX, MPI_CHAR, all, FSDP_HOST_MAX, MPI_CHAR, node);
        for (int k = 0; all && rc == MPI_SUCCESS && k < n; k++)
            same += memcmp(all + (size_t)k * FSDP_HOST_MAX, mine, FSDP_HOST_MAX) == 0;
        MPI_Comm_free(&node);
    }
    mpi_leave();
    free(all);
    if (rc != MPI_SUCCESS) return mpi_fail(c->ctx, c->rank, c->size, rc, "MPI_Comm_split_type");
    if (!all && n > 0)
        return fsdp__err(c->ctx, FSDP_ERR_NOMEM, "rank %d: out of memory for the hostnames of the %d ranks sharing "
                         "its memory (%zu bytes)", c->rank, n, (size_t)n * FSDP_HOST_MAX);
    *local = same;
    return FSDP_OK;
}

/* ---- Life ---- */

static const struct fsdp_comm_ops mpi_ops;

enum fsdp_status fsdp__comm_mpi_split(struct fsdp_comm *c, int color, int key, struct fsdp_comm **out) {
    MPI_Comm sub = MPI_COMM_NULL;
    int rank = 0, size = 1;
    mpi_enter();
    int rc = MPI_Comm_split(comm_of(c), color, key, &sub);
    if (rc == MPI_SUCCESS) {
        MPI_Comm_set_errhandler(sub, MPI_ERRORS_RETURN);
        MPI_Comm_rank(sub, &rank);
        MPI_Comm_size(sub, &size);
    }
    mpi_leave();
    if (rc != MPI_SUCCESS) return mpi_fail(c->ctx, c->rank, c->size, rc, "MPI_Comm_split");
    struct fsdp_comm *n = fsdp__calloc(c->ctx, sizeof *n, FSDP_MEM_OTHER, "communicator");
    struct mpi_state *s = fsdp__calloc(c->ctx, sizeof *s, FSDP_MEM_OTHER, "MPI communicator state");
    if (!n || !s) {
        fsdp__free(c->ctx, n);
        fsdp__free(c->ctx, s);
        mpi_enter();
        MPI_Comm_free(&sub);
        mpi_leave();
        return FSDP_ERR_NOMEM;
    }
    s->comm = sub;
    s->progress = ((struct mpi_state *)c->state)->progress;
    s->ordered = ((struct mpi_state *)c->state)->ordered;
    n->ops = &mpi_ops;
    n->ctx = c->ctx;
    n->backend = "mpi";
    n->state = s;
    n->rank = rank;
    n->size = size;
    mpi_live++;
    *out = n;
    return FSDP_OK;
}

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000 * 1000};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
}

/* mpirun reads our stderr through a pipe, and when MPI_Abort makes it end
 * the job it may kill us before reading what is still there ("you may or may
 * not see output from other processes"): the message saying why the job ends
 * was lost that way (a rank naming a dead peer, then aborting; a fixed 300 ms
 * pause was not enough on a loaded machine). With other ranks around we wait
 * until the launcher has read the pipe (FIONREAD says 0 bytes left), then a
 * little more for it to pass them on (stderr_drained); shm.c sets its abort
 * flag before calling us, so no peer waits on us.
 * The peer watch tells the other hosts that this rank aborts. MPI_Abort
 * needs the launcher: a rank on a host cut off from mpirun (a dead link)
 * would sit in it for good, so a thread ends the process with `code` after
 * ABORT_GRACE_S if MPI_Abort has not. */
static void *abort_grace(void *arg) {
    sleep_ms(ABORT_GRACE_S * 1000L);
    fprintf(stderr, "fsdp: rank %d: MPI_Abort did not end this process in %d s (the launcher is out of "
            "reach); exiting\n", fsdp__global_rank, ABORT_GRACE_S);
    fflush(NULL);
    _exit((int)(intptr_t)arg);
}

/* Waits (at most 3 s) until whoever reads our stderr pipe has read it all,
 * then 200 ms for it to pass it on; 300 ms where stderr is not a pipe. */
static void stderr_drained(void) {
    struct stat st;
    if (fstat(STDERR_FILENO, &st) != 0 || !S_ISFIFO(st.st_mode)) {
        sleep_ms(300);
        return;
    }
    for (int i = 0; i < 150; i++) {
        int left = 0;
        if (ioctl(STDERR_FILENO, FIONREAD, &left) != 0 || left == 0) break;
        sleep_ms(20);
    }
    sleep_ms(200);
}

static void mpi_abort_hook(int code) {
    int init = 0, fin = 0, size = 1;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    if (!init || fin) return;
    fsdp__peers_abort();
    pthread_t th; /* detached: ends the process if MPI_Abort cannot */
    if (pthread_create(&th, NULL, abort_grace, (void *)(intptr_t)(code ? code : 1)) == 0) pthread_detach(th);
    fflush(NULL);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size > 1) stderr_drained();
    MPI_Abort(MPI_COMM_WORLD, code);
}

static void mpi_abort(struct fsdp_comm *c, int code) {
    (void)c;
    mpi_abort_hook(code);
}

static void mpi_free(struct fsdp_comm *c) {
    struct mpi_state *s = c->state;
    if (mpi_live == 1) { /* the last MPI communicator: join before MPI lets go */
        fsdp__mpi_prog_stop();
        fsdp__peers_stop();
        peers_watched = 0;
    }
    if (s) {
        if (s->comm != MPI_COMM_NULL) {
            mpi_enter();
            MPI_Comm_free(&s->comm);
            mpi_leave();
        }
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

/* Env FSDP_MPI_PROGRESS=0 keeps requests on the compute thread, 1 hands
 * them to the progress thread. Unset, the thread runs only when a core is
 * free for it: this rank's OpenMP threads fewer than the CPUs it is bound
 * to, or, unbound, the host's ranks (MPI_COMM_TYPE_SHARED of comm) times
 * their threads fewer than its CPUs. Polling on a core the compute threads
 * already fill takes their time: GPT-2 124M FULL_SHARD on 2 ranks x 1
 * thread on 2 cores ran 4.7-5.1 s/step with the thread against 3.9-4.2
 * without (bench/README.md). COLLECTIVE: yes (the split runs whatever the
 * environment says, so ranks that disagree on it cannot deadlock). */
static int progress_wanted(MPI_Comm comm, int forced) {
    int local = 1;
    MPI_Comm node;
    mpi_enter();
    if (MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) == MPI_SUCCESS) {
        MPI_Comm_size(node, &local);
        MPI_Comm_free(&node);
    }
    mpi_leave();
    if (forced >= 0) return forced;
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    cpu_set_t set;
    int mine = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : (int)online;
    int threads = omp_get_max_threads();
    if (mine < online) return threads < mine; /* bound by the launcher */
    return (long)local * threads < online;
}

/* Starts the peer watch over c's ranks: every rank's record (peers.c) to
 * every rank. COLLECTIVE: yes. */
static enum fsdp_status watch_peers(struct fsdp_ctx *ctx, struct fsdp_comm *c) {
    struct fsdp_peer_rec mine, *all = fsdp__malloc((size_t)c->size * sizeof *all);
    if (!all) return fsdp__err(ctx, FSDP_ERR_NOMEM, "peer watch: %d records", c->size);
    fsdp__peers_listen(&mine);
    mpi_enter();
    int rc = MPI_Allgather(&mine, (int)sizeof mine, MPI_BYTE, all, (int)sizeof mine, MPI_BYTE, comm_of(c));
    mpi_leave();
    if (rc == MPI_SUCCESS) peers_watched = fsdp__peers_start(c->rank, c->size, all);
    free(all);
    if (rc != MPI_SUCCESS) return mpi_fail(ctx, c->rank, c->size, rc, "peer watch: MPI_Allgather");
    return FSDP_OK;
}

/* A verbose context says once, on rank 0, that MPI's thread level rules the
 * progress thread out. */
static void note_no_progress(struct fsdp_ctx *ctx, int rank, int level) {
    static int noted;
    if (mpi_multiple || noted || rank != 0 || !ctx) return;
    noted = 1;
    fsdp__log(ctx, 1, "fsdp: mpi: MPI gives thread level %d, not MPI_THREAD_MULTIPLE: no progress "
              "thread, collectives advance only inside MPI calls", level);
}

enum fsdp_status fsdp__comm_mpi_create(struct fsdp_ctx *ctx, struct fsdp_comm **out) {
    int init = 0, fin = 0, rc, ordered;
    long long forced, cpu;
    FSDP_TRY(fsdp__env_int(ctx, "FSDP_MPI_PROGRESS", -1, &forced));
    FSDP_TRY(fsdp__env_int(ctx, "FSDP_MPI_PROGRESS_CPU", -1, &cpu));
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    if (cpu >= online)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "FSDP_MPI_PROGRESS_CPU=%lld: this host has CPUs 0..%ld", cpu,
                         online - 1);
    if (cpu >= 0 && forced < 0) forced = 1; /* a core set aside for it */
    FSDP_TRY(fsdp__env_word(ctx, "FSDP_MPI_REDUCE", 1, &ordered));
    MPI_Finalized(&fin);
    if (fin)
        return fsdp__err(ctx, FSDP_ERR_STATE,
                         "MPI was already finalized in this process (freeing the last context "
                         "finalizes MPI; keep one context alive for the life of the process)");
    MPI_Initialized(&init);
    if (!init) {
        int provided = 0;
        rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &provided);
        if (rc != MPI_SUCCESS) return mpi_fail(ctx, 0, 1, rc, "MPI_Init_thread");
        mpi_we_init = 1;
    }
    int level = MPI_THREAD_SINGLE; /* also when someone else initialised MPI */
    MPI_Query_thread(&level);
    mpi_multiple = level >= MPI_THREAD_MULTIPLE;
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
    mpi_enter();
    rc = MPI_Comm_dup(MPI_COMM_WORLD, &s->comm);
    if (rc == MPI_SUCCESS) {
        MPI_Comm_set_errhandler(s->comm, MPI_ERRORS_RETURN);
        MPI_Comm_rank(s->comm, &c->rank);
        MPI_Comm_size(s->comm, &c->size);
    }
    mpi_leave();
    enum fsdp_status st;
    if (rc != MPI_SUCCESS) {
        s->comm = MPI_COMM_NULL;
        st = mpi_fail(ctx, 0, 1, rc, "MPI_Comm_dup");
        mpi_free(c);
        return st;
    }
    if (mpi_live == 1 && c->size > 1) { /* the job's first: the peer watch ([Note: peer watch]) */
        st = watch_peers(ctx, c);
        if (st != FSDP_OK) { mpi_free(c); return st; }
    }
    s->progress = progress_wanted(s->comm, (int)forced) && mpi_multiple;
    if (s->progress && cpu >= 0) fsdp__mpi_prog_pin((int)cpu);
    s->ordered = ordered; /* "native" 0, "ordered" 1 */
    note_no_progress(ctx, c->rank, level);
    fsdp__abort_hook = mpi_abort_hook;
    *out = c;
    return FSDP_OK;
}
