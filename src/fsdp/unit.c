/*
 * unit.c - a unit's life (see the state machine in fsdp-impl.h): gathering
 * its full parameters into a pooled flat buffer before its forward and
 * backward, pointing every parameter at its view of that buffer (no copy),
 * reduce-scattering the full gradient into the gradient shard after its
 * backward (then, for HYBRID, all-reducing the result over the replicas),
 * and releasing full buffers back to the pool.
 * Invariant: a parameter's data is non-NULL exactly while its unit is
 * UNSHARDED; its grad is non-NULL exactly between PRE_BACKWARD and the
 * unit's post-backward.
 */
#include "fsdp/fsdp-impl.h"
#include "comm/comm-impl.h"
#include "optim/optim-impl.h"

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
        void *n = fsdp__realloc(fm->pool, (size_t)ncap * sizeof *fm->pool);
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

/* Names the unit's next collective for the watchdog and the schedule check
 * (fsdp_comm_set_tag); u == NULL clears the tag after the start. */
static void unit_tag(struct fsdp_ctx *ctx, const struct fsdp_model *fm, const struct fsdp__unit *u) {
    char tag[64];
    if (u) snprintf(tag, sizeof tag, "unit %s", unit_name(u));
    fsdp_comm_set_tag(ctx->comm, u ? tag : NULL);
    fsdp_comm_set_tag(fm->shard_comm, u ? tag : NULL); /* the shard and replica groups alike */
    fsdp_comm_set_tag(fm->rep_comm, u ? tag : NULL);
}

static void point_params(struct fsdp__unit *u) {
    for (int j = 0; j < u->n_params; j++) u->params[j]->data = u->full + u->offsets[j];
}

/* A collective of u failed with status st: u goes to ERROR, and the error
 * names the unit and the collective; a start that ran out of memory (its
 * request) stays FSDP_ERR_NOMEM, anything else is FSDP_ERR_COMM. */
static enum fsdp_status unit_fail(struct fsdp_ctx *ctx, struct fsdp__unit *u, const char *what,
                                  enum fsdp_status st) {
    char cause[sizeof ctx->errmsg];
    snprintf(cause, sizeof cause, "%s", ctx->errmsg);
    u->state_ = UNIT_ERROR;
    return fsdp__err(ctx, st == FSDP_ERR_NOMEM ? st : FSDP_ERR_COMM, "unit '%s': %s failed: %s", unit_name(u), what,
                     cause);
}

/* ---- The shared window ----
 *
 * [Note: shared window]
 * Where the shard group's communicator can map one region for all its ranks
 * (the shm backend: ranks of one host; fsdp__comm_window), the model lays
 * every unit's shards out there, unit by unit: unit u's region holds the
 * numel_padded floats of its flat parameters, rank r's block
 * [r * numel_shard, (r + 1) * numel_shard) being rank r's shard. The host
 * holds the same bytes as the ranks' private shards would (each rank counts
 * its block as FSDP_MEM_SHARD), but the region already is the unit's full
 * buffer: a gather of an fp32 unit during a training step's forward or
 * backward (fm->win_pass) is a barrier of the shard group instead of an
 * all-gather (no copy, no full buffer), after which the parameters point
 * into the region. Other gathers (eval forwards, summon_full_params, state
 * dicts, 16-bit units) copy as before, the shard simply lying in the window.
 * Safety: a rank writes its block only in its own optimizer step and
 * post-step hooks, which follow its last reduce-scatter of the step; that
 * completes only once every peer has posted its gradient for every unit,
 * i.e. finished every read of the step's parameters (a unit's forward and
 * backward, recomputation included, end before its post-backward starts
 * the reduce-scatter). Peers read a block only after the barrier that the
 * owner enters once its earlier writes are done. Writers outside the step
 * (checkpoint loads, initialisation, summon write-back) run between steps,
 * when no peer is inside a training pass. Bits: the same values in the same
 * flat layout, so results equal the copying gathers' (FSDP_SHM_WINDOW=0
 * turns the window off; tests/test_mpi_strategy.c checks both against the
 * unsharded reference). Its size is bounded by the backend ([Note: window
 * size] in src/comm/shm.c). */

/* 64-byte aligned regions */
static int64_t window_floats(int64_t numel) { return (numel + 15) & ~(int64_t)15; }

/* [Note: 16-bit window]
 * A 16-bit unit's training gathers cast the shard and all-gather 16-bit
 * values into a pooled staging area ([Note: low-precision gather and
 * reduce] in fsdp-impl.h): at 4 ranks on 2 cores the copies into and out of
 * the slots and the casts took about 5% of the CPU time of GPT-2's AMP_BF16
 * step (bench/README.md). Where the shard group's communicator can map one more
 * region for its ranks, fsdp__model_window_lp lays there, for every 16-bit
 * unit, numel_padded 16-bit elements, rank r's block being its shard_lp
 * (the 16-bit copy of its shard, [Note: fused 16-bit copy] in
 * src/optim/optim.c, kept by every such unit then, whatever lp_shard_copy
 * says: the region is the unit's whole gathered 16-bit buffer, so it
 * replaces the staging area rather than adding a copy). The optimizer
 * writes each rank's block as it steps; a gather in a training step's
 * forward or backward (fm->win_pass) casts the shard into the block only
 * when the copy is stale (a load, an init, a summon's write-back: every
 * rank's at the same call), then enters a barrier of the shard group
 * instead of the all-gather, after which the layers' 16-bit weights point
 * into the region and only the parameters widened to fp32 ([Note: lazy
 * widening]) take a pooled buffer. Safety is the fp32 window's argument: a
 * rank writes its block in its optimizer step, after its last
 * reduce-scatter, which completes only once every peer has finished the
 * step's reads; a stale copy is cast at a training gather, and its stale
 * mark came from a writer that runs between steps; the barrier orders
 * every block's writes before every peer's reads. Gathers outside a
 * training pass (eval, summon, state dicts) all-gather from the block as
 * from any valid copy. Each rank counts its block (FSDP_MEM_SHARD); the
 * window's size has the backend's bound ([Note: window size] in
 * src/comm/shm.c), so a model whose 16-bit copy exceeds it gathers by copy.
 * Bits: the same 16-bit values in the same layout as the all-gather's
 * (FSDP_SHM_WINDOW=0 turns it off; tests/test_mpi_precision.c). */

/* Whether unit u has a region in the window of kind lp (0: the fp32 shards,
 * 1: the 16-bit copies), and the region's size in floats. */
static int64_t window_region(const struct fsdp__unit *u, int lp) {
    if (lp && u->param_dtype == FSDP_F32) return 0;
    return window_floats(lp ? (u->numel_padded + 1) / 2 : u->numel_padded);
}

/* Maps the window of kind lp over fm's shard group, if its backend has one,
 * and points each unit's region into it (see the two notes). */
static enum fsdp_status make_window(struct fsdp_ctx *ctx, struct fsdp_model *fm, int lp) {
    int64_t total = 0, mine = 0;
    for (int i = 0; i < fm->n_units; i++) {
        int64_t n = window_region(&fm->units[i], lp);
        total += n;
        mine += n ? fm->units[i].numel_shard : 0;
    }
    void *base;
    size_t bytes = (size_t)total * sizeof(float), es = lp ? sizeof(uint16_t) : sizeof(float);
    if (total == 0) return FSDP_OK;
    FSDP_TRY(fsdp__comm_window(fm->shard_comm, bytes, &base));
    if (!base) return FSDP_OK;
    if (fsdp__mem_count(ctx, FSDP_MEM_SHARD, (size_t)mine * es, 1,
                        lp ? "the 16-bit shard copies in the shared window" : "the shards in the shared window")) {
        fsdp__comm_window_free(fm->shard_comm, base, bytes);
        return FSDP_ERR_NOMEM;
    }
    *(lp ? &fm->win_lp : &fm->win) = base;
    *(lp ? &fm->win_lp_bytes : &fm->win_bytes) = bytes;
    float *at = base;
    for (int i = 0; i < fm->n_units; i++) {
        struct fsdp__unit *u = &fm->units[i];
        if (!window_region(u, lp)) continue;
        if (lp) u->win_lp = (uint16_t *)(void *)at;
        else u->win_full = at;
        at += window_region(u, lp);
    }
    return FSDP_OK;
}

static void free_window(struct fsdp_model *fm, int lp) {
    void **base = lp ? &fm->win_lp : &fm->win;
    if (!*base) return;
    int64_t mine = 0;
    for (int i = 0; i < fm->n_units; i++) {
        struct fsdp__unit *u = &fm->units[i];
        if (lp ? u->win_lp != NULL : u->win_full != NULL) mine += u->numel_shard;
        if (lp) u->win_lp = NULL;
        else u->win_full = NULL;
    }
    fsdp__mem_count(fm->ctx, FSDP_MEM_SHARD, (size_t)mine * (lp ? sizeof(uint16_t) : sizeof(float)), 0, NULL);
    fsdp__comm_window_free(fm->shard_comm, *base, lp ? fm->win_lp_bytes : fm->win_bytes);
    *base = NULL;
}

enum fsdp_status fsdp__model_window(struct fsdp_ctx *ctx, struct fsdp_model *fm) {
    return fm->shard_size < 2 ? FSDP_OK : make_window(ctx, fm, 0);
}

enum fsdp_status fsdp__model_window_lp(struct fsdp_ctx *ctx, struct fsdp_model *fm) {
    return fm->shard_size < 2 || fm->win_lp ? FSDP_OK : make_window(ctx, fm, 1);
}

void fsdp__model_window_free(struct fsdp_model *fm) {
    free_window(fm, 1);
    free_window(fm, 0);
}

/* [Note: a forward while summoned] An eval-mode forward may run inside
 * fsdp_summon_full_params (on every rank: not rank0_only), as a torch
 * model's forward inside summon_full_params does, e.g. to generate text
 * with the whole model on each rank: a summoned unit's "gather" takes its
 * values from the summoned buffer, with no collective, and its reshard
 * points the parameters back at them (the summon's values stay readable
 * until fsdp_summon_end). An fp32 unit runs on the summoned buffer itself;
 * a 16-bit one rounds from it as a shard group of one rounds from its shard
 * ([Note: 16-bit values from the shard], mixed.c), the values the 16-bit
 * gather gives: the output's bits are those of the same forward outside the
 * summon. Units the summon did not reach gather as always. A training-mode
 * forward, a backward or a step while summoned stay refused (step.c). */
static void gather_summoned(struct fsdp__unit *u) {
    if (u->param_dtype == FSDP_F32) {
        u->full = u->summoned;
        point_params(u);
    } else {
        fsdp__mp_finish_from(u, u->summoned); /* into u->full, gather_start's buffer */
    }
    u->state_ = UNIT_UNSHARDED;
}

/* Starts the all-gather of u's parameters (SHARDED -> GATHERING). */
static enum fsdp_status unit_gather_start(struct fsdp_ctx *ctx, struct fsdp__unit *u) {
    FSDP_ASSERT(u->state_ == UNIT_SHARDED, "unit %s: gather in state %d", unit_name(u), u->state_);
    int lp = u->param_dtype != FSDP_F32; /* gathers 16-bit (mixed.c) */
    struct fsdp_model *fm = u->model;
    if (u->summoned && lp) { /* [Note: a forward while summoned] */
        u->gather_lazy = fm->in_forward || fm->in_backward;
        u->full_f32 = fsdp__mp_f32_numel(u, u->gather_lazy);
        if (!(u->full = fsdp__pool_get(fm, u->full_f32 ? u->full_f32 : 1, "full parameters"))) return FSDP_ERR_NOMEM;
    }
    if (u->summoned) {
        gather_summoned(u);
        return FSDP_OK;
    }
    if (fm->shard_size == 1 && !lp) { /* the shard is the full buffer: nothing to move */
        u->full = u->shard;
        u->state_ = UNIT_UNSHARDED;
        point_params(u);
        return FSDP_OK;
    }
    u->full_win = u->win_full && !lp && fm->win_pass; /* [Note: shared window]: a barrier, no copy */
    u->lp_win = u->win_lp && u->shard_lp && lp && fm->win_pass; /* [Note: 16-bit window]: likewise */
    u->gather_lazy = lp && (fm->in_forward || fm->in_backward); /* [Note: lazy widening] */
    u->full_f32 = lp ? fsdp__mp_f32_numel(u, u->gather_lazy) : u->numel_padded;
    u->full = u->full_win ? u->win_full : fsdp__pool_get(u->model, fsdp__mp_full_numel(u), "full parameters");
    if (!u->full) return FSDP_ERR_NOMEM;
    /* in place: this rank's block of the full buffer is its shard */
    float *mine = u->full + (int64_t)fm->shard_rank * u->numel_shard;
    if (!lp && !u->full_win && !fsdp__measuring) memcpy(mine, u->shard, (size_t)u->numel_shard * sizeof(float));
    unit_tag(ctx, u->model, u);
    enum fsdp_status st = u->full_win ? fsdp_comm_barrier_start(fm->shard_comm, &u->req)
                          : lp        ? fsdp__mp_gather_start(fm->shard_comm, fm->shard_rank, u, &u->req)
                                      : fsdp_comm_allgather_start(fm->shard_comm, mine, u->full,
                                                                  (size_t)u->numel_shard, FSDP_F32, &u->req);
    unit_tag(ctx, u->model, NULL);
    if (st != FSDP_OK)
        return unit_fail(ctx, u, u->full_win || u->lp_win ? "the shared window's barrier" : "all-gather", st);
    u->state_ = UNIT_GATHERING;
    return FSDP_OK;
}

static enum fsdp_status unit_gather_wait(struct fsdp_ctx *ctx, struct fsdp__unit *u) {
    FSDP_ASSERT(u->state_ == UNIT_GATHERING, "unit %s: wait in state %d", unit_name(u), u->state_);
    struct fsdp_comm_req *r = u->req;
    u->req = NULL;
    enum fsdp_status st = fsdp_comm_wait(u->model->shard_comm, r);
    if (st != FSDP_OK)
        return unit_fail(ctx, u, u->full_win || u->lp_win ? "the shared window's barrier wait" : "all-gather wait",
                         st);
    u->state_ = UNIT_UNSHARDED;
    if (u->param_dtype != FSDP_F32) fsdp__mp_gather_finish(u); /* points the parameters itself */
    else point_params(u);
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
    if (u->prefetched) { /* gathered ahead, never entered */
        u->prefetched = 0;
        u->model->n_inflight--;
    }
    for (int j = 0; j < u->n_params; j++) /* a summon's values stay readable ([Note: a forward while summoned]) */
        u->params[j]->data = u->summoned ? u->summoned + u->offsets[j] : NULL, u->params[j]->priv->data_lp = NULL,
        u->params[j]->priv->data_src = NULL, u->params[j]->priv->data_stale = 0;
    if (u->full_win) u->full_win = 0;
    else if (u->full != u->shard && u->full != u->summoned) fsdp__pool_put(u->model, u->full);
    u->full = NULL;
    u->state_ = UNIT_SHARDED;
    return FSDP_OK;
}

/* [Note: gradient shards born in backward]
 * A unit's gradient shard holds something only from the backward that first
 * writes it (the layers' own writes at a world of one, the reduction's
 * landing elsewhere, or the zeros of a unit backward did not reach) until
 * the next step begins; from then to that step's backward, a forward fills
 * the activation arena to its peak. So a shard is born in backward and ends
 * at the first forward of the next step (fsdp__model_grads_none, as
 * PyTorch's zero_grad(set_to_none=True) at the top of a training loop: the
 * gradients stay readable after the optimizer step), and it lives in the
 * activation arena's pages where backward has released enough of them
 * (fsdp__arena_lend, [Note: bytes lent by the arena] in src/core/arena.c),
 * else in the unit's own buffer, made at the first such birth and kept.
 * Lending waits until the arena is below the mark where backward began
 * (fsdp__step.bwd_mark): a backward that keeps every saved tensor to its
 * end and stacks its scratch above them (ResNet's, whose layers cast each
 * conv weight there) would reach bytes lent in the gap above its tensors,
 * and each such reach takes a chunk of fresh pages (ResNet-18's bf16 plan
 * was 7 MiB larger with lending than without). A model with checkpointed
 * modules lends nothing: each recompute stacks a module's whole forward
 * above what is in use, past the room kept below lent bytes (ResNet's plans
 * grew with it; GPT-2's with `--ac blocks` lost 3 MiB of 2148 by it).
 * GPT-2 at one rank, 4 x 256 tokens: the blocks' 325 MiB of fp32 gradients
 * fit where their activations were. A forward inside a step (gradient
 * accumulation's next micro-batch, an eval forward before the optimizer
 * step) resets the arena too, so the lent shards move to their own buffers
 * first (fsdp__model_grads_keep). FSDP_GRAD_LEND=0 turns the lending off
 * (every shard in its own buffer, the same values). */
static int grad_lend_on(void) { return fsdp__env_checked("FSDP_GRAD_LEND", 1) != 0; }

/* u's own buffer for its gradient shard, made at the first need */
static enum fsdp_status grad_own(struct fsdp_ctx *ctx, struct fsdp__unit *u) {
    if (u->grad_own) return FSDP_OK;
    u->grad_own = fsdp__alloc(ctx, (size_t)u->numel_shard * sizeof(float), FSDP_MEM_SHARD, "gradient shard");
    if (!u->grad_own)
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory for the gradient shard of unit '%s' (%lld floats)",
                         u->module->fqn[0] ? u->module->fqn : "(root)", (long long)u->numel_shard);
    return FSDP_OK;
}

/* The arena is reset or freed with this model's shards in it (another
 * model's forward on the context, a caller's reset): within a step they move
 * to own buffers, else they end; a shard that cannot move ends too, and the
 * optimizer step names it. */
static void grads_reclaim(struct fsdp_ctx *ctx, void *lender) {
    struct fsdp_model *fm = lender;
    char keep[sizeof ctx->errmsg];
    snprintf(keep, sizeof keep, "%s", ctx->errmsg);
    if (!fm->step.open || fsdp__model_grads_keep(ctx, fm) != FSDP_OK) {
        for (int i = 0; i < fm->n_units; i++)
            if (fm->units[i].grad_shard) fm->units[i].grad_lost = fm->step.open;
        fsdp__model_grads_none(ctx, fm);
    }
    snprintf(ctx->errmsg, sizeof ctx->errmsg, "%s", keep);
}

/* Whether u's gradient shard is the arena's (lent), not its own buffer. */
static int grad_lent(const struct fsdp__unit *u) { return u->grad_shard && u->grad_shard != u->grad_own; }

enum fsdp_status fsdp__unit_grad_birth(struct fsdp_ctx *ctx, struct fsdp__unit *u) {
    if (u->grad_shard) return FSDP_OK;
    u->grad_lost = 0;
    /* no padding to zero: a reduction lands the whole shard, and a shard group of one has none */
    /* lent once backward has released pages below where it began (the note above) */
    if (!u->grad_own && grad_lend_on() && u->model->step.bwd_lend && fsdp_arena_mark(ctx) < u->model->step.bwd_mark)
        u->grad_shard = fsdp__arena_lend(ctx, (size_t)u->numel_shard * sizeof(float), u->model, grads_reclaim);
    if (!u->grad_shard) {
        FSDP_TRY(grad_own(ctx, u));
        u->grad_shard = u->grad_own;
    }
    return FSDP_OK;
}

void fsdp__model_grads_none(struct fsdp_ctx *ctx, struct fsdp_model *fm) {
    int lent = 0;
    for (int i = 0; i < fm->n_units; i++) {
        lent |= grad_lent(&fm->units[i]);
        fm->units[i].grad_shard = NULL;
    }
    if (lent && ctx->arena_lender == fm) fsdp__arena_unlend(ctx);
}

enum fsdp_status fsdp__model_grads_keep(struct fsdp_ctx *ctx, struct fsdp_model *fm) {
    int lent = 0;
    for (int i = 0; i < fm->n_units; i++) {
        struct fsdp__unit *u = &fm->units[i];
        if (!grad_lent(u)) continue;
        lent = 1;
        FSDP_TRY(grad_own(ctx, u));
        if (!fsdp__measuring) memcpy(u->grad_own, u->grad_shard, (size_t)u->numel_shard * sizeof(float));
        if (u->full_grad == u->grad_shard) u->full_grad = u->grad_own; /* a world of one's, kept by no_sync */
        u->grad_shard = u->grad_own;
    }
    if (lent && ctx->arena_lender == fm) fsdp__arena_unlend(ctx);
    return FSDP_OK;
}

static void release_grad(struct fsdp__unit *u) {
    for (int j = 0; j < u->n_params; j++) u->params[j]->grad = NULL, u->params[j]->priv->grad_unset = 0;
    if (u->full_grad != u->grad_shard) fsdp__pool_put(u->model, u->full_grad);
    u->full_grad = NULL;
}

/* Readies u's full gradient for a fresh backward ([Note: unset gradients]
 * in src/nn/nn-impl.h): grad_writer parameters are marked unset (their
 * layers write it, or zero it before adding), the others and the padding
 * are zeroed. */
static void grad_begin(struct fsdp__unit *u) {
    for (int j = 0; j < u->n_params; j++) {
        struct fsdp_param *p = u->params[j];
        if (p->priv->grad_writer) p->priv->grad_unset = 1;
        else fsdp__zero(u->full_grad + u->offsets[j], p->numel);
    }
    fsdp__zero(u->full_grad + u->numel_full, u->numel_padded - u->numel_full);
}

/* Zeroes the gradients backward left unset (parameters it did not reach). */
static void grad_settle(struct fsdp__unit *u) {
    for (int j = 0; j < u->n_params; j++)
        if (u->params[j]->priv->grad_unset) {
            fsdp__zero(u->full_grad + u->offsets[j], u->params[j]->numel);
            u->params[j]->priv->grad_unset = 0;
        }
}

static struct fsdp_comm *reduce_comm(const struct fsdp__unit *u) {
    return u->model->shard_size > 1 ? u->model->shard_comm : u->model->rep_comm;
}

/* A reduction failed (a start or a wait): the unit goes to ERROR naming the
 * collective. The accumulation buffer goes back (no collective touches it);
 * the full gradient stays with the unit, since a collective that failed its
 * wait may still be reading it (MPI cannot cancel one). */
static enum fsdp_status reduce_fail(struct fsdp_ctx *ctx, struct fsdp__unit *u, const char *what,
                                    enum fsdp_status st) {
    fsdp__pool_put(u->model, u->rs_prev);
    u->rs_prev = NULL;
    return unit_fail(ctx, u, what, st);
}

void fsdp__model_reshard_all(struct fsdp_ctx *ctx, struct fsdp_model *fm) {
    for (int i = 0; i < fm->n_units; i++) {
        struct fsdp__unit *u = &fm->units[i];
        /* buffers stay valid until done; the result is dropped (the step failed) */
        if (u->rs_req) fsdp_comm_wait(reduce_comm(u), u->rs_req);
        if (u->ar_req) fsdp_comm_wait(fm->rep_comm, u->ar_req);
        u->rs_req = u->ar_req = NULL;
        fsdp__pool_put(fm, u->rs_prev);
        u->rs_prev = NULL;
        if (u->state_ == UNIT_ERROR) continue;
        if (u->full_grad) release_grad(u);
        fsdp__unit_reshard(ctx, u);
        u->phase = PHASE_IDLE;
    }
    fm->rs_last = fm->ar_last = NULL;
}

/* ---- Prefetch and overlap ----
 *
 * [Note: prefetch and overlap]
 * With fm->overlap on and a shard group of 2+ ranks:
 *   forward prefetch: a unit's pre-forward starts its own all-gather, then
 *     those of the next units in forward (pre-)order, then waits for its
 *     own; the next unit's parameters move while this one computes.
 *   backward prefetch: the same in pre-backward order (fsdp__model_bwd_order),
 *     issued before the current unit's backward.
 *   The ranks issue the same collectives in the same order (the orders are
 *     functions of the layout), so no collective can cross another.
 *   limit: at most max_inflight units are gathering or gathered counting
 *     the one computing (max_inflight - 1 prefetched), which bounds the full
 *     buffers; the planner (plan.c) replays the same gets and puts.
 *   asynchronous reductions, a pipeline (reduce_advance): post-backward
 *     starts its unit's reduce-scatter (reduce_start), then
 *       a. lands the replica all-reduce that the previous post-backward left
 *          in flight (fm->ar_last, HYBRID with 2+ replicas; reduce_land):
 *          waits, widens, averages, adds the accumulated shard back (rs_prev
 *          is kept until here);
 *       b. waits for the previous unit's reduce-scatter (fm->rs_last;
 *          reduce_scattered), releases its full gradient (the result lies in
 *          the gradient shard: fsdp__mp_grad_recv) and starts its all-reduce
 *          over the replicas in place there, left in flight as the new
 *          fm->ar_last; without replicas it lands at once.
 *     So besides the unit's own start at most one reduce-scatter (shard
 *     comm) and one all-reduce (replica comm) are in flight, and a comes
 *     before b's start, so one all-reduce runs at a time. The end of
 *     backward (fsdp__model_finish_reduce) does a, then b with its
 *     all-reduce landed at once. Overlap off runs reduce_scattered and
 *     reduce_land right after reduce_start. Full gradients held: the current
 *     unit's and the previous unit's, as before the pipeline; plan.c replays
 *     these gets and puts and the MPI backend's staging of each collective.
 * Results are bit-identical with overlap on or off: the same collectives
 * reduce the same buffers, started in the same order on each communicator
 * (the shard comm: gathers and reduce-scatters; the replica comm: the
 * all-reduces, in backward order); only the waits move.
 * Progress: both backends move a started gather while the compute thread
 * works: shm runs collectives on its progress thread, and the MPI backend
 * hands its requests to a progress thread that drives them with MPI_Test
 * ([Note: MPI progress thread] in src/comm/mpi_progress.c). Where that thread is off
 * (FSDP_MPI_PROGRESS=0, or an MPI without MPI_THREAD_MULTIPLE), MPI's
 * non-blocking collectives advance only inside MPI calls and much of a
 * prefetched gather runs at its wait; the schedule stays correct, only less
 * overlapped. */

/* A unit, then each of its children's subtrees, last child first (no
 * allocation: units nest a few levels deep). */
static void bwd_visit(const struct fsdp_model *fm, int u, int *order, int *n) {
    order[(*n)++] = u;
    for (int i = fm->n_units - 1; i > u; i--)
        if (fm->units[i].parent == &fm->units[u]) bwd_visit(fm, i, order, n);
}

void fsdp__model_bwd_order(const struct fsdp_model *fm, int *order) {
    int n = 0;
    bwd_visit(fm, 0, order, &n);
}

static int overlap_on(const struct fsdp_model *fm) { return fm->overlap && fm->shard_size > 1; }

/* The hook enters u: a prefetched unit stops counting as ahead. */
static void consume(struct fsdp__unit *u) {
    if (u->prefetched) {
        u->prefetched = 0;
        u->model->n_inflight--;
    }
}

/* Starts the all-gathers of the units after position pos of order (NULL:
 * pre-order) while fewer than max_inflight - 1 are ahead. */
static enum fsdp_status prefetch(struct fsdp_ctx *ctx, struct fsdp_model *fm, const int *order, int pos) {
    int ahead = (fm->max_inflight > 0 ? fm->max_inflight : 2) - 1;
    for (int q = pos + 1; q < fm->n_units && fm->n_inflight < ahead; q++) {
        struct fsdp__unit *v = &fm->units[order ? order[q] : q];
        if (v->state_ != UNIT_SHARDED) continue;
        FSDP_TRY(unit_gather_start(ctx, v));
        v->prefetched = 1;
        fm->n_inflight++;
    }
    return FSDP_OK;
}

void fsdp__model_drop_prefetched(struct fsdp_ctx *ctx, struct fsdp_model *fm) {
    for (int i = 0; i < fm->n_units; i++)
        if (fm->units[i].prefetched) fsdp__unit_reshard(ctx, &fm->units[i]);
}

/* ---- Hooks ---- */

static enum fsdp_status pre_forward(void *data, struct fsdp_ctx *ctx) {
    struct fsdp__unit *u = data;
    u->phase = PHASE_FORWARD;
    fsdp__fault_point("forward", unit_name(u)); /* FSDP_FAULT (core/fault.c) */
    struct fsdp_model *fm = u->model;
    consume(u);
    if (overlap_on(fm) && fm->in_forward) {
        if (u->state_ == UNIT_SHARDED) FSDP_TRY(unit_gather_start(ctx, u));
        FSDP_TRY(prefetch(ctx, fm, NULL, u->index));
    }
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
    fsdp__fault_point("backward", unit_name(u));
    struct fsdp_model *fm = u->model;
    consume(u);
    if (overlap_on(fm) && fm->in_backward) {
        if (!fm->bwd_order) {
            fm->bwd_order = fsdp__zalloc((size_t)fm->n_units, sizeof *fm->bwd_order);
            if (!fm->bwd_order) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory for the units' backward order");
            fsdp__model_bwd_order(fm, fm->bwd_order);
        }
        int pos = 0;
        while (fm->bwd_order[pos] != u->index) pos++;
        if (u->state_ == UNIT_SHARDED) FSDP_TRY(unit_gather_start(ctx, u));
        FSDP_TRY(prefetch(ctx, fm, fm->bwd_order, pos));
    }
    FSDP_TRY(fsdp__unit_unshard(ctx, u));
    /* a world of one accumulates straight into the gradient shard; a full
     * gradient kept by no_sync is accumulated into as it is */
    if (!u->full_grad) {
        int direct = ctx->world == 1;
        if (direct) FSDP_TRY(fsdp__unit_grad_birth(ctx, u));
        u->full_grad = direct ? u->grad_shard : fsdp__pool_get(fm, u->numel_padded, "full gradients");
        if (!u->full_grad) return FSDP_ERR_NOMEM;
        if (!direct || !fm->grad_accumulate) grad_begin(u);
    }
    for (int j = 0; j < u->n_params; j++) u->params[j]->grad = u->full_grad + u->offsets[j];
    return FSDP_OK;
}

/* Whether u's reduction averages as it sums: one fp32 collective over the
 * whole world (a shard group or the replicas, not both), FSDP_AVG (shm's
 * reduce-scatter folds it into its last addition; [Note: averaging
 * reductions] in src/comm/comm.c): the bits of reduce_land's 1/world after
 * a sum. */
static int reduce_averages(const struct fsdp__unit *u) {
    return u->reduce_dtype == FSDP_F32 && (u->model->shard_size == 1 || u->model->rep_size == 1);
}

/* Starts the reduction of u's full gradient ([Note: sharding strategies]):
 * a reduce-scatter over the shard group into the gradient shard, or, for a
 * group of one (the shard is the whole buffer), the all-reduce over the
 * replicas, in place; in reduce_dtype (mixed.c). When accumulating, the
 * shard so far is set aside first (the reduction lands in the shard). */
static enum fsdp_status reduce_start(struct fsdp_ctx *ctx, struct fsdp__unit *u) {
    struct fsdp_model *fm = u->model;
    FSDP_TRY(fsdp__unit_grad_birth(ctx, u)); /* where the reduction lands */
    if (fm->grad_accumulate) {
        u->rs_prev = fsdp__pool_get(fm, u->numel_shard, "gradient accumulation");
        if (!u->rs_prev) return FSDP_ERR_NOMEM;
        if (!fsdp__measuring) memcpy(u->rs_prev, u->grad_shard, (size_t)u->numel_shard * sizeof(float));
    }
    /* in reduce_dtype: send and recv are 16-bit views for BF16/F16 (mixed.c) */
    void *send = fsdp__mp_grad_send(u, ctx->world), *recv = fm->shard_size > 1 ? fsdp__mp_grad_recv(u) : send;
    enum fsdp_red_op op = reduce_averages(u) ? FSDP_AVG : FSDP_SUM;
    enum fsdp_status st;
    unit_tag(ctx, u->model, u);
    if (fm->shard_size > 1)
        st = fsdp_comm_reduce_scatter_start(fm->shard_comm, send, recv, (size_t)u->numel_shard, u->reduce_dtype,
                                            op, &u->rs_req);
    else
        st = fsdp_comm_allreduce_start(fm->rep_comm, recv, recv, (size_t)u->numel_shard, u->reduce_dtype, op,
                                       &u->rs_req);
    unit_tag(ctx, u->model, NULL);
    u->rs_recv = recv;
    if (st != FSDP_OK) return reduce_fail(ctx, u, fm->shard_size > 1 ? "reduce-scatter" : "all-reduce", st);
    return FSDP_OK;
}

/* The middle of u's reduction ([Note: prefetch and overlap]): waits for its
 * reduce-scatter (or a shard group of one's all-reduce), releases the full
 * gradient when the result lies in the shard, and with 2+ replicas starts
 * the all-reduce of the result over them, in place (u->ar_req). */
static enum fsdp_status reduce_scattered(struct fsdp_ctx *ctx, struct fsdp__unit *u) {
    struct fsdp_model *fm = u->model;
    struct fsdp_comm_req *req = u->rs_req;
    u->rs_req = NULL;
    enum fsdp_status st = fsdp_comm_wait(reduce_comm(u), req);
    if (st != FSDP_OK) return reduce_fail(ctx, u, fm->shard_size > 1 ? "reduce-scatter" : "all-reduce", st);
    if (fm->shard_size == 1) return FSDP_OK; /* the result is in the full gradient */
    release_grad(u);
    if (fm->rep_size == 1) return FSDP_OK;
    unit_tag(ctx, fm, u);
    st = fsdp_comm_allreduce_start(fm->rep_comm, u->rs_recv, u->rs_recv, (size_t)u->numel_shard, u->reduce_dtype,
                                   FSDP_SUM, &u->ar_req);
    unit_tag(ctx, fm, NULL);
    if (st != FSDP_OK) return reduce_fail(ctx, u, "all-reduce over the replicas", st);
    return FSDP_OK;
}

/* The end of u's reduction: waits for the replica all-reduce if one runs,
 * lands the result in the fp32 gradient shard, averages by 1/world (where
 * the collective did not: reduce_averages), adds
 * the accumulated shard back, and releases what is left (the accumulation
 * buffer; the full gradient of a shard group of one). */
static enum fsdp_status reduce_land(struct fsdp_ctx *ctx, struct fsdp__unit *u) {
    struct fsdp_model *fm = u->model;
    struct fsdp_comm_req *req = u->ar_req;
    u->ar_req = NULL;
    enum fsdp_status st = req ? fsdp_comm_wait(fm->rep_comm, req) : FSDP_OK;
    if (st != FSDP_OK) return reduce_fail(ctx, u, "all-reduce over the replicas", st);
    void *recv = u->rs_recv;
    if (recv != u->grad_shard && !fsdp__measuring) {
        if (u->reduce_dtype == FSDP_F32) memcpy(u->grad_shard, recv, (size_t)u->numel_shard * sizeof(float));
        else fsdp__mp_grad_land(u, recv);
    }
    /* what the pre-division left: 1/world in all ([Note: gradient pre-division]),
     * unless the collective averaged (reduce_averages; x * 1.0f == x) */
    float inv = reduce_averages(u) ? 1.0f : (float)fsdp__mp_predivide(u->reduce_dtype, ctx->world) / (float)ctx->world;
    float *g = u->grad_shard, *prev = u->rs_prev;
    if (fsdp__measuring) /* [Note: measure mode] (plan.c) */
        ;
    else if (prev)
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < u->numel_shard; i++) g[i] = g[i] * inv + prev[i];
    else if (inv != 1.0f)
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < u->numel_shard; i++) g[i] *= inv;
    fsdp__pool_put(fm, u->rs_prev);
    u->rs_prev = NULL;
    release_grad(u);
    return FSDP_OK;
}

/* Lands the replica all-reduce left in flight, then takes the pending
 * reduce-scatter through reduce_scattered and, unless `leave` and an
 * all-reduce now runs, reduce_land. */
static enum fsdp_status reduce_advance(struct fsdp_ctx *ctx, struct fsdp_model *fm, int leave) {
    struct fsdp__unit *a = fm->ar_last, *r = fm->rs_last;
    fm->ar_last = fm->rs_last = NULL; /* on failure the units keep their requests for reshard_all */
    if (a) FSDP_TRY(reduce_land(ctx, a));
    if (!r) return FSDP_OK;
    FSDP_TRY(reduce_scattered(ctx, r));
    if (!leave || !r->ar_req) return reduce_land(ctx, r);
    fm->ar_last = r;
    fm->rep_deferred++;
    return FSDP_OK;
}

/* [Note: frozen groups] A parameter group frozen with fsdp_optim_group_set
 * behaves as torch parameters whose gradient is None: backward still runs
 * through its layers (inputs' gradients flow on), but the reduced gradient
 * of its parameters is zeroed here, where every reduction has landed, so it
 * counts in no global norm and no clipping factor; the optimizer then leaves
 * its parameters and state untouched (src/optim/optim.c). */
static void zero_frozen_grads(struct fsdp_model *fm) {
    if (!fm->optim) return;
    for (int i = 0; i < fm->n_units; i++) {
        const struct fsdp__unit *u = &fm->units[i];
        for (int k = 0; u->grad_shard && k < u->n_slices; k++) { /* a unit backward did not reach: zeroed whole */
            const struct fsdp_optim_slice *sl = &u->slices[k];
            if (sl->decay > 1 && fsdp__optim_group_frozen(fm->optim, sl->decay - 1))
                fsdp__zero(fsdp__slice_grad(u, sl), sl->n);
        }
    }
}

enum fsdp_status fsdp__model_finish_reduce(struct fsdp_ctx *ctx, struct fsdp_model *fm) {
    FSDP_TRY(reduce_advance(ctx, fm, 0));
    zero_frozen_grads(fm);
    return FSDP_OK;
}

int64_t fsdp__model_rep_deferred(const struct fsdp_model *fm) { return fm->rep_deferred; }

/* Reduces the full gradient into the gradient shard (reduce_start, then
 * both stages: at once, or under overlap pipelined over the next
 * post-backwards and the end of backward), added to what the shard holds
 * when accumulating ([Note: gradient accumulation]), then releases the full
 * buffers. Under no_sync the full gradient stays, unreduced, for the next
 * backward. */
static enum fsdp_status post_backward(void *data, struct fsdp_ctx *ctx) {
    struct fsdp__unit *u = data;
    struct fsdp_model *fm = u->model;
    u->phase = PHASE_POST_BACKWARD;
    grad_settle(u);
    if (fm->no_sync) {
        for (int j = 0; j < u->n_params; j++) u->params[j]->grad = NULL;
    } else if (u->full_grad == u->grad_shard) { /* a world of one */
        fsdp__mp_grad_land(u, u->grad_shard);
        release_grad(u);
    } else {
        for (int j = 0; j < u->n_params; j++) u->params[j]->grad = NULL;
        FSDP_TRY(reduce_start(ctx, u));
        if (overlap_on(fm)) {
            FSDP_TRY(reduce_advance(ctx, fm, 1));
            fm->rs_last = u;
        } else {
            FSDP_TRY(reduce_scattered(ctx, u));
            FSDP_TRY(reduce_land(ctx, u));
        }
    }
    FSDP_TRY(fsdp__unit_reshard(ctx, u));
    u->phase = PHASE_IDLE;
    return FSDP_OK;
}

const struct fsdp_module_hooks fsdp__unit_hooks = {pre_forward, post_forward, pre_backward,
                                                   post_backward};
