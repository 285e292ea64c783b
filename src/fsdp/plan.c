/*
 * plan.c - the memory planner: predicts, per rank, the bytes a FULL_SHARD
 * training run will hold, in the library's own accounting (fsdp_mem_get),
 * without allocating any of it: shards from the unit layout fsdp_fully_shard
 * would make (fsdp__model_layout), pooled full buffers by replaying the
 * gather/release order of the unit hooks over a model of the pool (unit.c),
 * and activations by replaying the arena use of a step (fsdp__gpt_act_trace
 * over fsdp__arena_sim). Also the size parser behind --mem-limit.
 * Invariant: every figure mirrors an allocation site: shards
 * fsdp__unit_alloc_shards, full buffers fsdp__pool_get, activations the
 * arena; tests/test_plan.c checks the prediction against a real run.
 */
#include "fsdp/fsdp-impl.h"
#include "nn/nn-impl.h"

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
    int failed;
};

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

/* Units directly below u, in pre-order (their forward order). */
static void pool_forward(const struct fsdp_model *fm, const struct fsdp__unit *u, struct pool_sim *p,
                         int *held) {
    held[u->index] = pool_get(p, u->numel_padded); /* pre_forward: gather */
    for (int i = u->index + 1; i < fm->n_units; i++)
        if (fm->units[i].parent == u) pool_forward(fm, &fm->units[i], p, held);
    if (u->reshard_after_forward) { /* post_forward */
        pool_put(p, held[u->index]);
        held[u->index] = -1;
    }
}

static void pool_backward(const struct fsdp_model *fm, const struct fsdp__unit *u, struct pool_sim *p,
                          int *held) {
    if (held[u->index] < 0) held[u->index] = pool_get(p, u->numel_padded); /* pre_backward */
    int grad = pool_get(p, u->numel_padded);
    for (int i = fm->n_units - 1; i > u->index; i--)
        if (fm->units[i].parent == u) pool_backward(fm, &fm->units[i], p, held);
    pool_put(p, grad); /* post_backward: release_grad, then reshard */
    pool_put(p, held[u->index]);
    held[u->index] = -1;
}

/* ---- The plan ---- */

/* The first module below m (or m) computing in a 16-bit dtype, or NULL. */
static const struct fsdp_module *low_precision_module(const struct fsdp_module *m) {
    if (m->compute_dtype != FSDP_F32) return m;
    for (int i = 0; i < m->n_children; i++) {
        const struct fsdp_module *x = low_precision_module(m->children[i]);
        if (x) return x;
    }
    return NULL;
}

enum fsdp_status fsdp_plan_memory(struct fsdp_ctx *ctx, struct fsdp_module *root,
                                  const struct fsdp_shard_opts *opts, int world, int rank,
                                  int optim_state, int B_local, int T, int threads,
                                  struct fsdp_mem_plan *out) {
    if (world < 1 || rank < 0 || rank >= world || optim_state < 0 || B_local < 1 || T < 1)
        return fsdp__err(ctx, FSDP_ERR_INVALID,
                         "plan: world %d, rank %d, optimizer state %d, batch (%d, %d) are not valid",
                         world, rank, optim_state, B_local, T);
    if (strcmp(root->ops->type, "GPT") != 0)
        return fsdp__err(ctx, FSDP_ERR_UNSUPPORTED,
                         "plan: activations are known for the built-in GPT only, not a %s root",
                         root->ops->type);
    const struct fsdp_module *lp = low_precision_module(root);
    if (lp)
        return fsdp__err(ctx, FSDP_ERR_UNSUPPORTED,
                         "plan: module '%s' computes in %s; the planner models fp32 compute only",
                         lp->fqn && lp->fqn[0] ? lp->fqn : "(root)", fsdp_dtype_name(lp->compute_dtype));
    /* the layout at `world`: a shadow context, so nothing of ctx changes */
    struct fsdp_ctx *sh = malloc(sizeof *sh);
    if (!sh) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory planning");
    *sh = *ctx;
    sh->world = world;
    sh->rank = rank;
    sh->verbose = 0;
    struct fsdp_model *fm = NULL;
    enum fsdp_status st = fsdp__model_layout(sh, root, opts, &fm);
    if (st != FSDP_OK) {
        fsdp__err(ctx, st, "%s", sh->errmsg);
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
        p.grads += n * sizeof(float);
        p.optim += (size_t)optim_state * n * sizeof(float);
        last_unit = 2 * n * sizeof(float) + 64;
    }
    /* full buffers: a world of one uses its shards (unit.c) */
    struct pool_sim pool = {0};
    if (world > 1) {
        int *held = malloc((size_t)fm->n_units * sizeof *held);
        if (!held) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory planning");
        for (int step = 0; step < 2 && held; step++) {
            for (int i = 0; i < fm->n_units; i++) held[i] = -1;
            pool_forward(fm, &fm->units[0], &pool, held);
            pool_backward(fm, &fm->units[0], &pool, held);
        }
        free(held);
        if (pool.failed) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory planning");
    }
    p.full = pool.bytes;
    free(pool.cap);
    free(pool.in_use);
    fsdp_model_free(fm);
    free(sh);
    /* activations: two steps (the second one runs in the merged chunk) */
    struct fsdp__arena_sim as = {0};
    for (int step = 0; step < 2 && st == FSDP_OK; step++) {
        fsdp__arena_sim_reset(&as);
        fsdp__arena_sim_alloc(&as, (size_t)B_local * (size_t)T * sizeof(int32_t)); /* tokens */
        fsdp__gpt_act_trace(root, B_local, T, threads, &as);
    }
    if (as.failed) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory planning");
    p.act = as.peak;
    fsdp__arena_sim_free(&as);
    if (st != FSDP_OK) return st;
    /* workspace: per-step transients (comm requests, a few hundred bytes) */
    p.workspace = 4096;
    size_t steady = p.params + p.grads + p.optim + p.full + p.act + p.workspace;
    /* attaching the optimizer holds the last unit's old shard block next to the new one */
    size_t attach = p.params + p.grads + p.optim + last_unit;
    p.total = steady > attach ? steady : attach;
    *out = p;
    return FSDP_OK;
}
