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
 */
#include "comm/comm-impl.h"

#include <limits.h>
#include <math.h>
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
};

static int mpi_live;     /* communicators alive in this process */
static int mpi_we_init;  /* we called MPI_Init_thread, so we finalize */

/* ---- Conversions (bit-exact, no dependence on compiler half types) ---- */

static uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

static uint16_t f32_to_bf16(float f) {
    uint32_t x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u); /* quiet NaN */
    x += 0x7fffu + ((x >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(x >> 16);
}

/* IEEE half <-> single (after M. Dukhan's FP16 library: exact, handles
 * subnormals, infinities and NaN, round to nearest even). */
static float f16_to_f32(uint16_t h) {
    uint32_t w = (uint32_t)h << 16;
    uint32_t sign = w & 0x80000000u;
    uint32_t two_w = w + w;
    float normalized = bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    float denormalized = bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
    uint32_t r = sign | (two_w < (1u << 27) ? f32_bits(denormalized) : f32_bits(normalized));
    return bits_f32(r);
}

static uint16_t f32_to_f16(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    uint32_t w = f32_bits(f);
    uint32_t shl1_w = w + w;
    uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = bits_f32((bias >> 1) + 0x07800000u) + base;
    uint32_t bits = f32_bits(base);
    uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

static void low_to_f32(const void *src, float *dst, size_t n, enum fsdp_dtype dt) {
    const uint16_t *s = src;
    if (dt == FSDP_BF16) for (size_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    else for (size_t i = 0; i < n; i++) dst[i] = f16_to_f32(s[i]);
}

static void f32_to_low(const float *src, void *dst, size_t n, enum fsdp_dtype dt) {
    uint16_t *d = dst;
    if (dt == FSDP_BF16) for (size_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    else for (size_t i = 0; i < n; i++) d[i] = f32_to_f16(src[i]);
}

static int is_low(enum fsdp_dtype dt) { return dt == FSDP_BF16 || dt == FSDP_F16; }

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
    if (q) q->r = MPI_REQUEST_NULL;
    return q;
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
    low_to_f32(in, q->stage_in, n_in, dt);
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
    struct mpi_req *q = req_new(c, FSDP_COLL_ALLGATHER);
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
    struct mpi_req *q = req_new(c, FSDP_COLL_REDUCE_SCATTER);
    if (!q) return FSDP_ERR_NOMEM;
    int rc;
    if (is_low(dt)) {
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
    struct mpi_req *q = req_new(c, FSDP_COLL_ALLREDUCE);
    if (!q) return FSDP_ERR_NOMEM;
    int rc;
    if (is_low(dt)) {
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
    struct mpi_req *q = req_new(c, FSDP_COLL_BROADCAST);
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
    int rc = MPI_Wait(&q->r, MPI_STATUS_IGNORE);
    enum fsdp_status st = FSDP_OK;
    if (rc != MPI_SUCCESS) {
        char what[64];
        snprintf(what, sizeof what, "%s wait", fsdp__coll_name(q->base.coll));
        st = mpi_fail(c->ctx, c->rank, c->size, rc, what);
    } else if (q->stage_out) {
        f32_to_low(q->stage_out, q->recv, q->n_out, q->dt);
    }
    req_release(c, q);
    return st;
}

/* ---- Life ---- */

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
