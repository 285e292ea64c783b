/*
 * plan.c - the memory planner: predicts, per rank, the bytes a FULL_SHARD
 * training run will hold, in the library's own accounting (fsdp_mem_get),
 * without allocating any of it: shards from the unit layout fsdp_fully_shard
 * would make (fsdp__model_layout), pooled full buffers by replaying the
 * gather/release order of the unit hooks over a model of the pool (unit.c),
 * and activations by replaying the arena use of a step (fsdp__gpt_act_trace
 * over fsdp__arena_sim). Mixed precision (opts->precision, mixed_precision)
 * is resolved per unit as fsdp_fully_shard does (fsdp__mp_resolve on the
 * shadow layout; the modules' compute dtypes are put back afterwards): a
 * 16-bit gather pools fsdp__mp_full_numel floats, the trace follows each
 * module's compute dtype and whether its weight is gathered in it, and the
 * workspace holds the MPI backend's fp32 staging of 16-bit reductions.
 * Also the size parser behind --mem-limit.
 * Invariant: every figure mirrors an allocation site: shards
 * fsdp__unit_alloc_shards, full buffers fsdp__pool_get, activations the
 * arena, staging comm/mpi.c's stage(); tests/test_mpi_plan.c checks the
 * prediction against a real run.
 */
#include "fsdp/fsdp-impl.h"
#include "nn/nn-impl.h"
#include "comm/comm-impl.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <string.h>

/* ---- Sizes ---- */

enum fsdp_status fsdp_mem_parse_size(struct fsdp_ctx *ctx, const char *text, size_t *out) {
    if (!text)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "memory size is NULL");
    char *end;
    errno = 0;
    double v = strtod(text, &end);
    double mul = 1;
    if (end != text && *end) {
        switch (toupper((unsigned char)*end)) {
        case 'K': mul = 1024.0; break;
        case 'M': mul = 1024.0 * 1024; break;
        case 'G': mul = 1024.0 * 1024 * 1024; break;
        case 'T': mul = 1024.0 * 1024 * 1024 * 1024; break;
        default: mul = 0;
        }
        end++;
        if (*end == 'i' || *end == 'I') end++;
        if (*end == 'b' || *end == 'B') end++;
    }
    if (end == text || *end || errno || mul == 0 || !(v >= 0) || !isfinite(v) || v * mul >= 1.8e19)
        return fsdp__err(ctx, FSDP_ERR_INVALID,
                         "'%s' is not a memory size (a number with an optional K, M, G or T suffix, "
                         "e.g. 1.5G)", text);
    *out = (size_t)(v * mul);
    return FSDP_OK;
}

/* ---- The pool ---- */

/* A model of fsdp__pool_get/_put: buffers are never freed, a request takes
 * the smallest free buffer that fits, else a new one of exactly its size. */
struct pool_sim {
    int64_t *cap;
    int *in_use;
    int n, room;
    size_t bytes;
    size_t stage, stage_peak; /* the MPI backend's reduction buffers, live and peak */
    int ordered;              /* ... with its ordered reductions (comm/mpi.c) */
    int failed;
};

static void stage_note(struct pool_sim *p, size_t extra) {
    if (p->stage + extra > p->stage_peak) p->stage_peak = p->stage + extra;
}


static int pool_get(struct pool_sim *p, int64_t numel) {
    int best = -1;
    for (int i = 0; i < p->n; i++)
        if (!p->in_use[i] && p->cap[i] >= numel && (best < 0 || p->cap[i] < p->cap[best])) best = i;
    if (best >= 0) {
        p->in_use[best] = 1;
        return best;
    }
    if (p->n == p->room) {
        int nr = p->room ? 2 * p->room : 16;
        int64_t *c = realloc(p->cap, (size_t)nr * sizeof *c);
        if (c) p->cap = c;
        int *u = c ? realloc(p->in_use, (size_t)nr * sizeof *u) : NULL;
        if (u) p->in_use = u;
        if (!c || !u) {
            p->failed = 1;
            return -1;
        }
        p->room = nr;
    }
    p->cap[p->n] = numel;
    p->in_use[p->n] = 1;
    p->bytes += (size_t)(numel ? numel : 1) * sizeof(float);
    return p->n++;
}

static void pool_put(struct pool_sim *p, int i) {
    if (i >= 0) p->in_use[i] = 0;
}

/* What the unit hooks do with the pool under a strategy, an accumulation
 * mode and overlap (unit.c): params pooled when the shard group has 2+
 * ranks or the unit gathers 16-bit (unit_gather_start; fsdp__mp_full_numel
 * floats), gradients when the world has 2+ ranks ([Note: sharding
 * strategies]); prefetches and the pipelined reductions (reduce-scatter,
 * then HYBRID's replica all-reduce) as [Note: prefetch and overlap]. */
struct pool_mode {
    int params, grads;  /* full parameters of fp32 units / gradients come from the pool */
    int no_sync;        /* this backward keeps its full gradients */
    int accumulate;     /* this backward adds into the shard (a numel_shard buffer) */
    int overlap;        /* prefetch and deferred reductions (shard group of 2+) */
    int ahead;          /* units that may be gathered ahead (max_inflight - 1) */
};

/* The simulated state: per unit its full parameter buffer (held), full
 * gradient (grad), accumulation buffer (prev), whether it was prefetched;
 * the units whose reduce-scatter (last) and replica all-reduce (ar_last)
 * are in flight, or -1. */
struct pool_state {
    int *held, *grad, *prev, *pref, *bwd;
    int inflight, last, ar_last;
    const struct fsdp_model *fm;
};

/* Whether u's full parameters come from the pool (unit_gather_start). */
static int params_pooled(const struct pool_mode *m, const struct fsdp__unit *u) {
    return m->params || u->param_dtype != FSDP_F32;
}

static void consume(struct pool_state *s, int u) {
    if (s->pref[u]) {
        s->pref[u] = 0;
        s->inflight--;
    }
}

static void prefetch(const struct fsdp_model *fm, struct pool_sim *p, const struct pool_mode *m,
                     struct pool_state *s, const int *order, int pos) {
    for (int q = pos + 1; q < fm->n_units && s->inflight < m->ahead; q++) {
        int v = order ? order[q] : q;
        if (s->held[v] >= 0) continue;
        s->held[v] = pool_get(p, fsdp__mp_full_numel(&fm->units[v]));
        s->pref[v] = 1;
        s->inflight++;
    }
}

/* Units directly below u, in pre-order (their forward order). */
static void pool_forward(const struct fsdp_model *fm, const struct fsdp__unit *u, struct pool_sim *p,
                         const struct pool_mode *m, struct pool_state *s) {
    int i = u->index;
    consume(s, i);
    if (params_pooled(m, u) && s->held[i] < 0) s->held[i] = pool_get(p, fsdp__mp_full_numel(u)); /* gather */
    if (m->overlap) prefetch(fm, p, m, s, NULL, i);
    for (int c = i + 1; c < fm->n_units; c++)
        if (fm->units[c].parent == u) pool_forward(fm, &fm->units[c], p, m, s);
    if (u->reshard_after_forward) { /* post_forward */
        pool_put(p, s->held[i]);
        s->held[i] = -1;
    }
}

/* The MPI backend's staging (comm/mpi.c [Note: low-precision reductions])
 * of reduce_start's 16-bit collective, held from its start to its wait: a
 * reduce-scatter of the full gradient, or all-reduce of the shard (a shard
 * group of one). */
static size_t reduce_stage(const struct pool_sim *p, const struct fsdp_model *fm, const struct fsdp__unit *u) {
    return fm->shard_size > 1
               ? fsdp__comm_mpi_reduce_bytes(FSDP_COLL_REDUCE_SCATTER, (size_t)u->numel_shard, u->reduce_dtype,
                                             fm->shard_size, fm->shard_rank, p->ordered)
               : fsdp__comm_mpi_reduce_bytes(FSDP_COLL_ALLREDUCE, (size_t)u->numel_shard, u->reduce_dtype,
                                             fm->rep_size, fm->rep_rank, p->ordered);
}

/* Whether a reduce-scatter is followed by an all-reduce over the replicas
 * (HYBRID with 2+ ranks per group and 2+ replicas). */
static int two_stage(const struct fsdp_model *fm) { return fm->shard_size > 1 && fm->rep_size > 1; }

/* The staging of that all-reduce, held from its start to its wait. */
static size_t replica_stage(const struct pool_sim *p, const struct fsdp_model *fm, const struct fsdp__unit *u) {
    return fsdp__comm_mpi_reduce_bytes(FSDP_COLL_ALLREDUCE, (size_t)u->numel_shard, u->reduce_dtype, fm->rep_size,
                                       fm->rep_rank, p->ordered);
}

/* unit.c's reduce_start: the accumulation buffer, then the collective */
static void reduce_start(struct pool_sim *p, struct pool_state *s, const struct pool_mode *m, int u) {
    const struct fsdp__unit *fu = &s->fm->units[u];
    if (m->accumulate) s->prev[u] = pool_get(p, fu->numel_shard);
    p->stage += reduce_stage(p, s->fm, fu);
    stage_note(p, 0);
}

/* reduce_scattered: the first collective's wait, the full gradient put when
 * the result lies in the shard (a shard group of 2+), the replica
 * all-reduce started */
static void scattered(struct pool_sim *p, struct pool_state *s, int u) {
    const struct fsdp__unit *fu = &s->fm->units[u];
    p->stage -= reduce_stage(p, s->fm, fu);
    if (s->fm->shard_size > 1) {
        pool_put(p, s->grad[u]);
        s->grad[u] = -1;
    }
    if (two_stage(s->fm)) {
        p->stage += replica_stage(p, s->fm, fu);
        stage_note(p, 0);
    }
}

/* reduce_land: the replica all-reduce's wait, the accumulation buffer, then
 * the full gradient if still held */
static void land(struct pool_sim *p, struct pool_state *s, int u) {
    const struct fsdp__unit *fu = &s->fm->units[u];
    if (two_stage(s->fm)) p->stage -= replica_stage(p, s->fm, fu);
    pool_put(p, s->prev[u]);
    s->prev[u] = -1;
    pool_put(p, s->grad[u]);
    s->grad[u] = -1;
}

/* reduce_advance ([Note: prefetch and overlap]): lands the all-reduce in
 * flight, takes the last reduce-scatter through both stages, leaving its
 * all-reduce in flight when `leave`. */
static void advance(struct pool_sim *p, struct pool_state *s, int leave) {
    int a = s->ar_last, r = s->last;
    s->ar_last = s->last = -1;
    if (a >= 0) land(p, s, a);
    if (r < 0) return;
    scattered(p, s, r);
    if (leave && two_stage(s->fm)) s->ar_last = r;
    else land(p, s, r);
}

static void pool_backward(const struct fsdp_model *fm, const struct fsdp__unit *u, struct pool_sim *p,
                          const struct pool_mode *m, struct pool_state *s) {
    int i = u->index;
    consume(s, i);
    if (params_pooled(m, u) && s->held[i] < 0) s->held[i] = pool_get(p, fsdp__mp_full_numel(u)); /* pre_backward */
    if (m->overlap) {
        int pos = 0;
        while (s->bwd[pos] != i) pos++;
        prefetch(fm, p, m, s, s->bwd, pos);
    }
    if (m->grads && s->grad[i] < 0) s->grad[i] = pool_get(p, u->numel_padded);
    for (int c = fm->n_units - 1; c > i; c--)
        if (fm->units[c].parent == u) pool_backward(fm, &fm->units[c], p, m, s);
    if (!m->no_sync && m->grads) { /* post_backward: reduce_start, then the stages */
        reduce_start(p, s, m, i);
        if (m->overlap) {
            advance(p, s, 1);
            s->last = i;
        } else {
            scattered(p, s, i);
            land(p, s, i);
        }
    }
    pool_put(p, s->held[i]); /* reshard */
    s->held[i] = -1;
}

/* Puts the units still prefetched (step.c's fsdp__model_drop_prefetched). */
static void drop_prefetched(const struct fsdp_model *fm, struct pool_sim *p, struct pool_state *s) {
    for (int i = 0; i < fm->n_units; i++)
        if (s->pref[i]) {
            pool_put(p, s->held[i]);
            s->held[i] = -1;
            s->pref[i] = 0;
            s->inflight--;
        }
}

/* ---- The plan ---- */

/* Saves (save != 0) the compute dtypes of m's subtree into dt, pre-order,
 * or puts them back; returns the next index. */
static int keep_dtypes(struct fsdp_module *m, enum fsdp_dtype *dt, int i, int save) {
    if (save) dt[i] = m->compute_dtype;
    else m->compute_dtype = dt[i];
    i++;
    for (int c = 0; c < m->n_children; c++) i = keep_dtypes(m->children[c], dt, i, save);
    return i;
}

static int count_modules(const struct fsdp_module *m) {
    int n = 1;
    for (int c = 0; c < m->n_children; c++) n += count_modules(m->children[c]);
    return n;
}

/* The activation trace's `gathered`: the param_dtype of p's unit. */
static enum fsdp_dtype unit_param_dtype(const struct fsdp_param *p, void *ud) {
    const struct fsdp_model *fm = ud;
    for (int i = 0; i < fm->n_units; i++)
        for (int j = 0; j < fm->units[i].n_params; j++)
            if (fm->units[i].params[j] == p) return fm->units[i].param_dtype;
    return FSDP_F32;
}

enum fsdp_status fsdp_plan_memory(struct fsdp_ctx *ctx, struct fsdp_module *root,
                                  const struct fsdp_shard_opts *opts, int world, int rank,
                                  int optim_state, int B_local, int T, int threads,
                                  struct fsdp_mem_plan *out) {
    return fsdp_plan_memory_accum(ctx, root, opts, world, rank, optim_state, B_local, T, threads, 1,
                                  FSDP_ACCUM_REDUCE_EACH, out);
}

enum fsdp_status fsdp_plan_memory_accum(struct fsdp_ctx *ctx, struct fsdp_module *root,
                                        const struct fsdp_shard_opts *opts, int world, int rank,
                                        int optim_state, int B_local, int T, int threads, int accum,
                                        enum fsdp_grad_accum mode, struct fsdp_mem_plan *out) {
    if (world < 1 || rank < 0 || rank >= world || optim_state < 0 || B_local < 1 || T < 1 || accum < 1)
        return fsdp__err(ctx, FSDP_ERR_INVALID,
                         "plan: world %d, rank %d, optimizer state %d, batch (%d, %d), %d micro-batches are "
                         "not valid", world, rank, optim_state, B_local, T, accum);
    if (strcmp(root->ops->type, "GPT") != 0)
        return fsdp__err(ctx, FSDP_ERR_UNSUPPORTED,
                         "plan: activations are known for the built-in GPT only, not a %s root",
                         root->ops->type);
    /* the layout at `world`: a shadow context, so nothing of ctx changes */
    struct fsdp_ctx *sh = malloc(sizeof *sh);
    if (!sh) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory planning");
    *sh = *ctx;
    sh->world = world;
    sh->rank = rank;
    sh->verbose = 0;
    /* a 16-bit precision: the unit policies fsdp_fully_shard resolves, and
     * the modules' compute dtypes it sets, put back after the trace */
    enum fsdp_dtype precision = opts ? opts->precision : FSDP_F32;
    enum fsdp_dtype *kept = NULL;
    if (precision != FSDP_F32) {
        if (!root->fqn) {
            enum fsdp_status fst = fsdp_module_finalize(ctx, root);
            if (fst != FSDP_OK) {
                free(sh);
                return fst;
            }
        }
        kept = malloc((size_t)count_modules(root) * sizeof *kept);
        if (!kept) {
            free(sh);
            return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory planning");
        }
        keep_dtypes(root, kept, 0, 1);
    }
    struct fsdp_model *fm = NULL;
    enum fsdp_status st = fsdp__model_layout(sh, root, opts, &fm);
    if (st == FSDP_OK && precision != FSDP_F32) st = fsdp__mp_resolve(sh, fm, precision, opts->mixed_precision);
    if (st != FSDP_OK) {
        fsdp__err(ctx, st, "%s", sh->errmsg);
        fsdp_model_free(fm);
        if (kept) keep_dtypes(root, kept, 0, 0);
        free(kept);
        free(sh);
        return st;
    }
    struct fsdp_mem_plan p;
    memset(&p, 0, sizeof p);
    p.world = world;
    p.rank = rank;
    p.n_units = fm->n_units;
    size_t last_unit = 0;
    for (int i = 0; i < fm->n_units; i++) { /* fsdp__unit_alloc_shards: one block per unit */
        size_t n = (size_t)fm->units[i].numel_shard;
        p.params += n * sizeof(float) + 64; /* + the block's padding */
        if (fm->units[i].param_dtype != FSDP_F32) p.params += n * sizeof(uint16_t); /* shard_lp */
        p.grads += n * sizeof(float);
        p.optim += (size_t)optim_state * n * sizeof(float);
        last_unit = 2 * n * sizeof(float) + 64;
    }
    /* full buffers: a world of one uses its shards (unit.c), a shard group
     * of one its parameter shards, except where a unit gathers 16-bit */
    struct pool_sim pool = {0};
    /* the MPI backend's buffers: a shm or self context is planned as MPI's native path */
    pool.ordered = ctx && ctx->comm && !strcmp(fsdp_comm_backend(ctx->comm), "mpi") && fsdp__comm_mpi_ordered(ctx->comm);
    int lp_units = 0;
    for (int i = 0; i < fm->n_units; i++) lp_units |= fm->units[i].param_dtype != FSDP_F32;
    if (world > 1 || lp_units) {
        size_t n = (size_t)fm->n_units;
        struct pool_state ps = {malloc(n * sizeof(int)), malloc(n * sizeof(int)), malloc(n * sizeof(int)),
                                malloc(n * sizeof(int)), malloc(n * sizeof(int)), 0, -1, -1, fm};
        if (!ps.held || !ps.grad || !ps.prev || !ps.pref || !ps.bwd)
            st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory planning");
        else
            fsdp__model_bwd_order(fm, ps.bwd);
        for (int step = 0; step < 2 && st == FSDP_OK; step++) {
            for (size_t i = 0; i < n; i++) ps.held[i] = ps.grad[i] = ps.prev[i] = -1, ps.pref[i] = 0;
            for (int k = 0; k < accum; k++) { /* step.c's micro_batches */
                struct pool_mode m = {fm->shard_size > 1, world > 1, mode == FSDP_ACCUM_NO_SYNC && k < accum - 1,
                                      k > 0 && mode == FSDP_ACCUM_REDUCE_EACH,
                                      fm->overlap && fm->shard_size > 1, fm->max_inflight - 1};
                pool_forward(fm, &fm->units[0], &pool, &m, &ps);
                drop_prefetched(fm, &pool, &ps);
                pool_backward(fm, &fm->units[0], &pool, &m, &ps);
                advance(&pool, &ps, 0); /* fsdp__model_finish_reduce */
                drop_prefetched(fm, &pool, &ps);
            }
        }
        free(ps.held);
        free(ps.grad);
        free(ps.prev);
        free(ps.pref);
        free(ps.bwd);
        if (pool.failed) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory planning");
    }
    p.full = pool.bytes;
    size_t staging = pool.stage_peak;
    free(pool.cap);
    free(pool.in_use);
    /* activations: two steps (the second one runs in the merged chunk) */
    struct fsdp__arena_sim as = {0};
    for (int step = 0; step < 2 && st == FSDP_OK; step++) {
        fsdp__arena_sim_reset(&as);
        fsdp__arena_sim_alloc(&as, (size_t)B_local * (size_t)T * sizeof(int32_t)); /* tokens */
        fsdp__gpt_act_trace(root, B_local, T, threads, unit_param_dtype, fm, &as);
    }
    if (as.failed) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory planning");
    fsdp_model_free(fm);
    if (kept) keep_dtypes(root, kept, 0, 0);
    free(kept);
    free(sh);
    p.act = as.peak;
    fsdp__arena_sim_free(&as);
    if (st != FSDP_OK) return st;
    /* workspace: per-step transients (comm requests, a few hundred bytes) and
     * the MPI backend's fp32 staging of 16-bit reductions (shm reduces in
     * its communicator's own accumulators: none) */
    p.workspace = 4096 + staging;
    size_t steady = p.params + p.grads + p.optim + p.full + p.act + p.workspace;
    /* attaching the optimizer holds the last unit's old shard block next to the new one */
    size_t attach = p.params + p.grads + p.optim + last_unit;
    p.total = steady > attach ? steady : attach;
    *out = p;
    return FSDP_OK;
}
