/*
 * self.c - the communicator of a world of one: no MPI calls at all. With one
 * rank every collective is a copy from send to recv (or nothing, in place):
 * the all-gather of one block is that block, and the sum, max or min of one
 * contribution is the contribution itself, for every dtype. Each start
 * completes at once; wait only frees the request.
 */
#include "comm/comm-impl.h"

#include <string.h>

static enum fsdp_status self_done(struct fsdp_comm *c, enum fsdp_coll coll,
                                  struct fsdp_comm_req **req) {
    *req = fsdp__comm_req_alloc(c, sizeof(struct fsdp_comm_req), coll);
    return *req ? FSDP_OK : FSDP_ERR_NOMEM;
}

/* send == NULL means in place (comm.c); memmove because validation allows
 * no overlap but costs nothing here. */
static void self_copy(const void *send, void *recv, size_t count, enum fsdp_dtype dt) {
    if (send && count > 0) memmove(recv, send, count * fsdp_dtype_size(dt));
}

static enum fsdp_status self_allgather_start(struct fsdp_comm *c, const void *send, void *recv,
                                             size_t count, enum fsdp_dtype dt,
                                             struct fsdp_comm_req **req) {
    self_copy(send, recv, count, dt);
    return self_done(c, FSDP_COLL_ALLGATHER, req);
}

static enum fsdp_status self_reduce_scatter_start(struct fsdp_comm *c, const void *send, void *recv,
                                                  size_t count, enum fsdp_dtype dt,
                                                  enum fsdp_red_op op, struct fsdp_comm_req **req) {
    (void)op;
    self_copy(send, recv, count, dt);
    return self_done(c, FSDP_COLL_REDUCE_SCATTER, req);
}

static enum fsdp_status self_allreduce_start(struct fsdp_comm *c, const void *send, void *recv,
                                             size_t count, enum fsdp_dtype dt, enum fsdp_red_op op,
                                             struct fsdp_comm_req **req) {
    (void)op;
    self_copy(send, recv, count, dt);
    return self_done(c, FSDP_COLL_ALLREDUCE, req);
}

static enum fsdp_status self_broadcast_start(struct fsdp_comm *c, void *buf, size_t count,
                                             enum fsdp_dtype dt, int root,
                                             struct fsdp_comm_req **req) {
    (void)buf; (void)count; (void)dt; (void)root;
    return self_done(c, FSDP_COLL_BROADCAST, req);
}

static enum fsdp_status self_barrier_start(struct fsdp_comm *c, struct fsdp_comm_req **req) {
    return self_done(c, FSDP_COLL_BARRIER, req);
}

static enum fsdp_status self_wait(struct fsdp_comm *c, struct fsdp_comm_req *req) {
    fsdp__comm_req_free(c, req);
    return FSDP_OK;
}

/* Nothing to end but this process; fsdp_ctx_abort exits after us. */
static void self_abort(struct fsdp_comm *c, int code) { (void)c; (void)code; }

static void self_free(struct fsdp_comm *c) { fsdp__free(c->ctx, c); }

static const struct fsdp_comm_ops self_ops = {
    .allgather_start = self_allgather_start,
    .reduce_scatter_start = self_reduce_scatter_start,
    .allreduce_start = self_allreduce_start,
    .broadcast_start = self_broadcast_start,
    .barrier_start = self_barrier_start,
    .wait = self_wait,
    .abort = self_abort,
    .free = self_free,
};

enum fsdp_status fsdp__comm_self_create(struct fsdp_ctx *ctx, struct fsdp_comm **out) {
    struct fsdp_comm *c = fsdp__calloc(ctx, sizeof *c, FSDP_MEM_OTHER, "communicator");
    if (!c) return FSDP_ERR_NOMEM;
    c->ops = &self_ops;
    c->ctx = ctx;
    c->rank = 0;
    c->size = 1;
    c->backend = "self";
    *out = c;
    return FSDP_OK;
}
