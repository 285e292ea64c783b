/*
 * plan.c - the memory planner: the bytes per rank a training run will hold,
 * in the library's own accounting (fsdp_mem_get), found by running the real
 * code in measure mode rather than by a second copy of the schedule or the
 * layers. Also the size parser behind --mem-limit.
 *
 * [Note: measure mode]
 * fsdp_plan_memory_run shards the caller's model (shapes only) in a
 * measuring context: rank `rank` of a world of `world` ranks whose
 * communicator (src/comm/measure.c) completes every collective at once
 * without moving data, and whose allocator counts every block as usual but
 * reserves large ones without committing them (MAP_NORESERVE: a page costs
 * memory only once written). It attaches the optimizer and runs the
 * caller's training step twice (the second runs in the arena's merged
 * chunk) with fsdp__measuring set on this thread: the GEMMs, the oneDNN
 * primitives, initialisation, the optimizer update, the norms and the
 * precision casts skip their arithmetic, while every allocation, arena call,
 * gather, prefetch, reduction, wait and release happens as in a real run,
 * in the same order. The figures are that context's counters: shards
 * (cur[FSDP_MEM_SHARD], split by the unit sizes into parameters, gradients
 * and, after attaching, optimizer state), pooled full buffers, activation
 * arena and the rest (comm requests, MPI's staging of 16-bit reductions as
 * the measuring communicator reproduces it) at their peaks, and the total at
 * its peak over the whole run. Values are never read, so results are
 * garbage and no check of them (non-finite loss or gradients) applies. The
 * layers still run their element-wise loops (a layer norm, a softmax, a
 * copy), which cost time linear in the activations and write only the
 * activation memory a real run writes. A user module may ask
 * fsdp_ctx_measuring to skip its own arithmetic; one whose forward or
 * backward fails in measure mode makes the plan fail naming it.
 * Like ggml-alloc's measure allocator, the plan is what the allocator is
 * asked for; unlike it, the real step code runs (only the kernels stop),
 * so a plan can't drift from what the layers allocate.
 */
#include "fsdp/fsdp-impl.h"
#include "nn/nn-impl.h"
#include "comm/comm-impl.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <omp.h>
#include <string.h>

/* ---- Sizes ---- */
enum fsdp_status fsdp_mem_parse_size(struct fsdp_ctx *ctx, const char *text, size_t *out) {
    if (!text)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "memory size is NULL");
    char *end;
    errno = 0;
    double v = strtod(text, &end);
    /* a plain decimal: strtod's hex, exponents, spaces and signs are no sizes */
    int plain = end != text && strspn(text, "0123456789.") == (size_t)(end - text);
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
    if (!plain || *end || errno || mul == 0 || !(v >= 0) || !isfinite(v) || v * mul >= 1.8e19)
        return fsdp__err(ctx, FSDP_ERR_INVALID,
                         "'%s' is not a memory size (a number with an optional K, M, G or T suffix, "
                         "e.g. 1.5G)", text);
    *out = (size_t)(v * mul);
    return FSDP_OK;
}

/* ---- Keeping the caller's model as it was ---- */

/* What a measured run changes on the caller's tree and puts back: the
 * modules' compute dtypes (set by sharding under mixed precision), their
 * checkpoint state, and the buffers' values (a batch norm's running
 * statistics are updated by its training forward). */
struct keep {
    enum fsdp_dtype *dt;
    void **buf;
    int n_mod, n_buf;
};

static int count_modules(const struct fsdp_module *m) {
    int n = 1;
    for (int c = 0; c < m->n_children; c++) n += count_modules(m->children[c]);
    return n;
}

static int keep_dtypes(struct fsdp_module *m, enum fsdp_dtype *dt, int i, int save) {
    if (save) dt[i] = m->compute_dtype;
    else {
        m->compute_dtype = dt[i];
        m->priv->ckpt_saved = 0;
        memset(&m->priv->ckpt_in, 0, sizeof m->priv->ckpt_in);
    }
    i++;
    for (int c = 0; c < m->n_children; c++) i = keep_dtypes(m->children[c], dt, i, save);
    return i;
}

struct buf_walk {
    struct keep *k;
    int i, save, failed;
};

static int keep_buffer(struct fsdp_buffer *b, void *ud) {
    struct buf_walk *w = ud;
    size_t n = (size_t)b->numel * fsdp_dtype_size(b->dtype);
    if (w->save) {
        void *c = fsdp__malloc(n ? n : 1);
        if (!c) {
            w->failed = 1;
            return 1;
        }
        if (n) memcpy(c, b->data, n);
        w->k->buf[w->i] = c;
    } else {
        if (n) memcpy(b->data, w->k->buf[w->i], n);
        free(w->k->buf[w->i]);
    }
    w->i++;
    return 0;
}

static int count_buffer(struct fsdp_buffer *b, void *ud) {
    (void)b;
    (*(int *)ud)++;
    return 0;
}

static int clear_param(struct fsdp_param *p, void *ud) {
    (void)ud;
    p->priv->data_lp = NULL;
    p->priv->data_src = NULL;
    p->priv->data_stale = 0;
    p->priv->grad_unset = 0;
    return 0;
}

static enum fsdp_status keep_save(struct fsdp_ctx *ctx, struct fsdp_module *root, struct keep *k) {
    memset(k, 0, sizeof *k);
    k->n_mod = count_modules(root);
    fsdp_module_foreach_buffer(root, count_buffer, &k->n_buf);
    k->dt = fsdp__malloc((size_t)k->n_mod * sizeof *k->dt);
    k->buf = fsdp__zalloc((size_t)k->n_buf + 1, sizeof *k->buf);
    struct buf_walk w = {k, 0, 1, 0};
    if (k->dt && k->buf) fsdp_module_foreach_buffer(root, keep_buffer, &w);
    if (!k->dt || !k->buf || w.failed) {
        for (int i = 0; k->buf && i < w.i; i++) free(k->buf[i]);
        free(k->dt);
        free(k->buf);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory planning");
    }
    keep_dtypes(root, k->dt, 0, 1);
    return FSDP_OK;
}

static void keep_restore(struct fsdp_module *root, struct keep *k) {
    keep_dtypes(root, k->dt, 0, 0);
    struct buf_walk w = {k, 0, 0, 0};
    fsdp_module_foreach_buffer(root, keep_buffer, &w);
    fsdp_module_foreach_param(root, clear_param, NULL);
    free(k->dt);
    free(k->buf);
}

static int has_storage(struct fsdp_param *p, void *ud) {
    *(struct fsdp_param **)ud = p;
    return p->data != NULL || p->priv->unit != NULL;
}

/* ---- The measured run ---- */

struct fsdp_plan_opts fsdp_plan_opts_default(void) {
    struct fsdp_plan_opts o;
    memset(&o, 0, sizeof o);
    o.world = 1;
    o.optim = fsdp_optim_opts_default();
    o.steps = 2;
    o.shared_window = -1;
    return o;
}

/* The measuring context: rank `rank` of `world`, its communicator shaped
 * like ctx's backend (MPI's staging; shm's shared windows up to window_max
 * bytes; -1: as ctx's communicator; -2: as a shm communicator made on this
 * host now), no memory limit. */
static enum fsdp_status measure_ctx(struct fsdp_ctx *ctx, int world, int rank, long long window_max,
                                    struct fsdp_ctx **out) {
    struct fsdp_ctx *m;
    if (fsdp__ctx_alloc(&m) != FSDP_OK) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory planning");
    m->measure = 1;
    m->world = world;
    m->rank = rank;
    m->threads = ctx ? ctx->threads : 0;
    /* a shm or self context is planned as MPI's native path */
    int like_mpi = ctx && ctx->comm && !strcmp(fsdp_comm_backend(ctx->comm), "mpi");
    int huge;
    size_t window = window_max >= 0   ? (size_t)window_max
                    : window_max == -2 ? fsdp__shm_window_bound(ctx, &huge)
                    : ctx && ctx->comm ? fsdp__comm_shm_window_max(ctx->comm) : 0;
    enum fsdp_status st = fsdp__comm_measure_create(m, world, rank, like_mpi,
                                                    like_mpi && fsdp__comm_mpi_ordered(ctx->comm), window,
                                                    fsdp__comm_req_bytes(ctx ? ctx->comm : NULL), &m->comm);
    if (st != FSDP_OK) {
        fsdp__err(ctx, st, "plan: %s", m->errmsg);
        fsdp__ctx_release(m);
        return st;
    }
    *out = m;
    return FSDP_OK;
}

/* Shards root in mctx, attaches the optimizer, runs the steps: the
 * figures are mctx's counters. */
static enum fsdp_status measure_run(struct fsdp_ctx *mctx, struct fsdp_module *root, const struct fsdp_shard_opts *so,
                                    const struct fsdp_plan_opts *po, struct fsdp_mem_plan *p) {
    struct fsdp_mem_stats m0, m1;
    fsdp_mem_get(mctx, &m0);
    struct fsdp_model *fm = NULL;
    struct fsdp_optim *opt = NULL;
    enum fsdp_status st = fsdp_fully_shard(mctx, root, so, &fm);
    if (st == FSDP_OK) st = fsdp_optim_create(mctx, &po->optim, &opt);
    if (st == FSDP_OK && po->prepare_optim) st = po->prepare_optim(mctx, opt, po->ud);
    if (st == FSDP_OK) st = fsdp_model_attach_optim(mctx, fm, opt);
    if (st == FSDP_OK) { /* the shards' blocks, split by the units' sizes */
        fsdp_mem_get(mctx, &m1);
        size_t n = 0;
        for (int i = 0; i < fm->n_units; i++) n += (size_t)fm->units[i].numel_shard;
        p->n_units = fm->n_units;
        p->optim = (size_t)fsdp_optim_state_per_elem(opt) * n * sizeof(float);
        p->params = m1.cur[FSDP_MEM_SHARD] - m0.cur[FSDP_MEM_SHARD] - p->optim;
    }
    if (st == FSDP_OK && po->setup) st = po->setup(mctx, fm, opt, po->ud);
    for (int k = 0; k < po->steps && st == FSDP_OK; k++) st = po->step(mctx, fm, k, po->ud);
    /* the gradient shards: their own buffers, and the most the arena lent at once
     * ([Note: gradient shards born in backward], unit.c) */
    for (int i = 0; fm && i < fm->n_units; i++)
        if (fm->units[i].grad_own) p->grads += (size_t)fm->units[i].numel_shard * sizeof(float);
    p->grads_lent = mctx->arena_lent_high;
    fsdp_mem_get(mctx, &m1);
    p->full = m1.peak[FSDP_MEM_FULL] - m0.cur[FSDP_MEM_FULL];
    p->act = m1.peak[FSDP_MEM_ACT] - m0.cur[FSDP_MEM_ACT];
    p->workspace = m1.peak[FSDP_MEM_OTHER] - m0.cur[FSDP_MEM_OTHER];
    p->total = m1.peak_total - m0.cur_total;
    fsdp_model_free(fm);
    fsdp_optim_free(opt);
    return st;
}

enum fsdp_status fsdp_plan_memory_run(struct fsdp_ctx *ctx, struct fsdp_module *root, const struct fsdp_shard_opts *so,
                                      const struct fsdp_plan_opts *po, struct fsdp_mem_plan *out) {
    if (!root || !po || !out || !po->step)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "plan: root, options, a step function and the output are required");
    if (po->world < 1 || po->world > FSDP__PLAN_MAX_WORLD || po->rank < 0 || po->rank >= po->world || po->steps < 1 ||
        po->threads < 0)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "plan: rank %d of world %d (at most 2^20), %d steps, %d threads are not valid",
                         po->rank, po->world, po->steps, po->threads);
    struct fsdp_param *q = NULL;
    if (fsdp_module_foreach_param(root, has_storage, &q))
        return fsdp__err(ctx, FSDP_ERR_STATE,
                         "plan: parameter '%s' has storage: plan a model built with shapes only, before "
                         "fsdp_fully_shard or fsdp_module_materialize", q->fqn ? q->fqn : q->name);
    if (!root->fqn) FSDP_TRY(fsdp_module_finalize(ctx, root));
    struct keep k;
    FSDP_TRY(keep_save(ctx, root, &k));
    struct fsdp_ctx *mctx = NULL;
    enum fsdp_status st = measure_ctx(ctx, po->world, po->rank, po->shared_window, &mctx);
    if (st != FSDP_OK) {
        keep_restore(root, &k);
        return st;
    }
    int threads0 = omp_get_max_threads();
    if (po->threads > 0) omp_set_num_threads(po->threads);
    int measuring0 = fsdp__measuring;
    fsdp__measuring = 1;
    struct fsdp_mem_plan p;
    memset(&p, 0, sizeof p);
    p.world = po->world;
    p.rank = po->rank;
    st = measure_run(mctx, root, so, po, &p);
    fsdp__measuring = measuring0;
    omp_set_num_threads(threads0);
    fsdp_arena_reset(mctx); /* the arena's chunks are mctx's */
    if (st != FSDP_OK) fsdp__err(ctx, st, "plan (rank %d of %d): %s", po->rank, po->world, mctx->errmsg);
    fsdp__comm_free(mctx->comm);
    fsdp__ctx_release(mctx);
    keep_restore(root, &k);
    if (st == FSDP_OK) *out = p;
    return st;
}

/* ---- The GPT's step ---- */

struct gpt_step {
    int B, T, accum;
    enum fsdp_grad_accum mode;
    int32_t *tok; /* (accum, B, T) zeros: inputs and targets */
};

static enum fsdp_status gpt_step(struct fsdp_ctx *ctx, struct fsdp_model *fm, int step, void *ud) {
    (void)step;
    struct gpt_step *g = ud;
    struct fsdp_step_result r;
    return fsdp_model_train_step_accum(ctx, fm, g->tok, g->tok, g->B, g->T, g->accum, g->mode, 1e-4f, 1.0f, &r);
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
    if (world < 1 || world > FSDP__PLAN_MAX_WORLD || rank < 0 || rank >= world || optim_state < 0 || optim_state > 2 ||
        B_local < 1 || T < 1 || accum < 1)
        return fsdp__err(ctx, FSDP_ERR_INVALID,
                         "plan: world %d (at most 2^20), rank %d, optimizer state %d, batch (%d, %d), %d "
                         "micro-batches are not valid", world, rank, optim_state, B_local, T, accum);
    struct fsdp_plan_opts po = fsdp_plan_opts_default();
    po.world = world;
    po.rank = rank;
    po.threads = threads;
    /* an optimizer keeping optim_state floats per element */
    if (optim_state < 2) {
        po.optim.kind = FSDP_OPTIM_SGD;
        po.optim.momentum = optim_state ? 0.9f : 0.0f;
    }
    struct gpt_step g = {B_local, T, accum, mode, fsdp__zalloc((size_t)accum * (size_t)B_local * (size_t)T, sizeof(int32_t))};
    if (!g.tok) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory planning");
    po.step = gpt_step;
    po.ud = &g;
    enum fsdp_status st = fsdp_plan_memory_run(ctx, root, opts, &po, out);
    free(g.tok);
    return st;
}
