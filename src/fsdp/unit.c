/*
 * unit.c - a unit's life (see the state machine in fsdp-impl.h): gathering
 * its full parameters into a pooled flat buffer before its forward and
 * backward, pointing every parameter at its view of that buffer (no copy),
 * reduce-scattering the full gradient into the gradient shard after its
 * backward, and releasing full buffers back to the pool.
 * Invariant: a parameter's data is non-NULL exactly while its unit is
 * UNSHARDED; its grad is non-NULL exactly between PRE_BACKWARD and the
 * unit's reduce-scatter.
 */
#include "fsdp/fsdp-impl.h"

#include <string.h>

/* ---- Pool ---- */

float *fsdp__pool_get(struct fsdp_model *fm, int64_t numel, const char *what) {
    /* smallest free buffer that fits */
    int best = -1;
    for (int i = 0; i < fm->n_pool; i++) {
        struct fsdp__pool_buf *b = &fm->pool[i];
        if (!b->in_use && b->cap >= numel && (best < 0 || b->cap < fm->pool[best].cap)) best = i;
    }
    if (best >= 0) {
        fm->pool[best].in_use = 1;
        return fm->pool[best].mem;
    }
    if (fm->n_pool == fm->cap_pool) {
        int ncap = fm->cap_pool ? 2 * fm->cap_pool : 8;
        void *n = realloc(fm->pool, (size_t)ncap * sizeof *fm->pool);
        if (!n) {
            fsdp__err(fm->ctx, FSDP_ERR_NOMEM, "out of memory growing the buffer pool for %s", what);
            return NULL;
        }
        fm->pool = n;
        fm->cap_pool = ncap;
    }
    float *mem = fsdp__alloc(fm->ctx, (size_t)(numel ? numel : 1) * sizeof(float), FSDP_MEM_FULL, what);
    if (!mem) return NULL;
    fm->pool[fm->n_pool++] = (struct fsdp__pool_buf){mem, numel, 1};
    return mem;
}

void fsdp__pool_put(struct fsdp_model *fm, float *mem) {
    if (!mem) return;
    for (int i = 0; i < fm->n_pool; i++)
        if (fm->pool[i].mem == mem) {
            FSDP_ASSERT(fm->pool[i].in_use, "pool buffer returned twice");
            fm->pool[i].in_use = 0;
            return;
        }
    FSDP_ASSERT(0, "buffer %p is not from the pool", (void *)mem);
}

/* ---- Gather and release ---- */

static const char *unit_name(const struct fsdp__unit *u) {
    return u->module->fqn[0] ? u->module->fqn : "(root)";
}

static void point_params(struct fsdp__unit *u) {
    for (int j = 0; j < u->n_params; j++) u->params[j]->data = u->full + u->offsets[j];
}

static enum fsdp_status unit_fail(struct fsdp_ctx *ctx, struct fsdp__unit *u, const char *what) {
    char cause[sizeof ctx->errmsg];
    snprintf(cause, sizeof cause, "%s", ctx->errmsg);
    u->state_ = UNIT_ERROR;
    return fsdp__err(ctx, FSDP_ERR_COMM, "unit '%s': %s failed: %s", unit_name(u), what, cause);
}

/* Starts the all-gather of u's parameters (SHARDED -> GATHERING). */
static enum fsdp_status unit_gather_start(struct fsdp_ctx *ctx, struct fsdp__unit *u) {
    FSDP_ASSERT(u->state_ == UNIT_SHARDED, "unit %s: gather in state %d", unit_name(u), u->state_);
    if (ctx->world == 1) { /* the shard is the full buffer: nothing to move */
        u->full = u->shard;
        u->state_ = UNIT_UNSHARDED;
        point_params(u);
        return FSDP_OK;
    }
    u->full = fsdp__pool_get(u->model, u->numel_padded, "full parameters");
    if (!u->full) return FSDP_ERR_NOMEM;
    /* in place: this rank's block of the full buffer is its shard */
    float *mine = u->full + (int64_t)ctx->rank * u->numel_shard;
    memcpy(mine, u->shard, (size_t)u->numel_shard * sizeof(float));
    if (fsdp_comm_allgather_start(ctx->comm, mine, u->full, (size_t)u->numel_shard, FSDP_F32,
                                  &u->req) != FSDP_OK)
        return unit_fail(ctx, u, "all-gather");
    u->state_ = UNIT_GATHERING;
    return FSDP_OK;
}

static enum fsdp_status unit_gather_wait(struct fsdp_ctx *ctx, struct fsdp__unit *u) {
    FSDP_ASSERT(u->state_ == UNIT_GATHERING, "unit %s: wait in state %d", unit_name(u), u->state_);
    struct fsdp_comm_req *r = u->req;
    u->req = NULL;
    if (fsdp_comm_wait(ctx->comm, r) != FSDP_OK) return unit_fail(ctx, u, "all-gather wait");
    u->state_ = UNIT_UNSHARDED;
    point_params(u);
    return FSDP_OK;
}

enum fsdp_status fsdp__unit_unshard(struct fsdp_ctx *ctx, struct fsdp__unit *u) {
    if (u->state_ == UNIT_ERROR)
        return fsdp__err(ctx, FSDP_ERR_STATE, "unit '%s' is in the error state", unit_name(u));
    if (u->state_ == UNIT_SHARDED) FSDP_TRY(unit_gather_start(ctx, u));
    if (u->state_ == UNIT_GATHERING) FSDP_TRY(unit_gather_wait(ctx, u));
    return FSDP_OK;
}

enum fsdp_status fsdp__unit_reshard(struct fsdp_ctx *ctx, struct fsdp__unit *u) {
    if (u->state_ == UNIT_GATHERING) FSDP_TRY(unit_gather_wait(ctx, u));
    if (u->state_ != UNIT_UNSHARDED) return FSDP_OK;
    for (int j = 0; j < u->n_params; j++) u->params[j]->data = NULL;
    if (u->full != u->shard) fsdp__pool_put(u->model, u->full);
    u->full = NULL;
    u->state_ = UNIT_SHARDED;
    return FSDP_OK;
}

static void release_grad(struct fsdp__unit *u) {
    for (int j = 0; j < u->n_params; j++) u->params[j]->grad = NULL;
    if (u->full_grad != u->grad_shard) fsdp__pool_put(u->model, u->full_grad);
    u->full_grad = NULL;
}

void fsdp__model_reshard_all(struct fsdp_ctx *ctx, struct fsdp_model *fm) {
    for (int i = 0; i < fm->n_units; i++) {
        struct fsdp__unit *u = &fm->units[i];
        if (u->state_ == UNIT_ERROR) continue;
        if (u->full_grad) release_grad(u);
        fsdp__unit_reshard(ctx, u);
        u->phase = PHASE_IDLE;
    }
}

/* ---- Hooks ---- */

static enum fsdp_status pre_forward(void *data, struct fsdp_ctx *ctx) {
    struct fsdp__unit *u = data;
    u->phase = PHASE_FORWARD;
    return fsdp__unit_unshard(ctx, u);
}

static enum fsdp_status post_forward(void *data, struct fsdp_ctx *ctx) {
    struct fsdp__unit *u = data;
    if (u->reshard_after_forward) FSDP_TRY(fsdp__unit_reshard(ctx, u));
    return FSDP_OK;
}

static enum fsdp_status pre_backward(void *data, struct fsdp_ctx *ctx) {
    struct fsdp__unit *u = data;
    if (u->phase != PHASE_FORWARD)
        return fsdp__err(ctx, FSDP_ERR_STATE, "backward of unit '%s' without its forward",
                         unit_name(u));
    u->phase = PHASE_PRE_BACKWARD;
    FSDP_TRY(fsdp__unit_unshard(ctx, u));
    /* a world of one accumulates straight into the gradient shard */
    u->full_grad = ctx->world == 1 ? u->grad_shard
                                   : fsdp__pool_get(u->model, u->numel_padded, "full gradients");
    if (!u->full_grad) return FSDP_ERR_NOMEM;
    memset(u->full_grad, 0, (size_t)u->numel_padded * sizeof(float));
    for (int j = 0; j < u->n_params; j++) u->params[j]->grad = u->full_grad + u->offsets[j];
    return FSDP_OK;
}

/* Reduce-scatters the full gradient into the gradient shard (sum, then the
 * 1/world average), then releases both full buffers. */
static enum fsdp_status post_backward(void *data, struct fsdp_ctx *ctx) {
    struct fsdp__unit *u = data;
    u->phase = PHASE_POST_BACKWARD;
    struct fsdp_comm_req *req = NULL;
    if (ctx->world > 1 && fsdp_comm_reduce_scatter_start(ctx->comm, u->full_grad, u->grad_shard, (size_t)u->numel_shard,
                                       FSDP_F32, FSDP_SUM, &req) != FSDP_OK)
        return unit_fail(ctx, u, "reduce-scatter");
    if (req && fsdp_comm_wait(ctx->comm, req) != FSDP_OK)
        return unit_fail(ctx, u, "reduce-scatter");
    if (ctx->world > 1) {
        float inv = 1.0f / (float)ctx->world;
        for (int64_t i = 0; i < u->numel_shard; i++) u->grad_shard[i] *= inv;
    }
    release_grad(u);
    FSDP_TRY(fsdp__unit_reshard(ctx, u));
    u->phase = PHASE_IDLE;
    return FSDP_OK;
}

const struct fsdp_module_hooks fsdp__unit_hooks = {pre_forward, post_forward, pre_backward,
                                                   post_backward};
