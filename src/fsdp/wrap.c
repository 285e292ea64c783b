/*
 * wrap.c - turning a module tree into units (fsdp_fully_shard): the wrap
 * policy picks unit roots, each parameter joins the unit of its nearest
 * wrapped ancestor, tied parameters are hoisted to one unit, and each unit
 * gets a flat layout padded to a multiple of the world size. Then this
 * rank's shard is allocated and initialised from the counter-based RNG.
 * Invariant: the layout is a pure function of (tree, policy, world), so
 * every rank computes the same units without communicating.
 *
 * [Note: uneven shards] numel_padded = ceil(numel_full / world) * world;
 * rank r owns flat [r*numel_shard, (r+1)*numel_shard). The padding tail is
 * zero in params and grads and is never given to the optimizer, so norms and
 * updates ignore it and every world size sees the same model.
 */
#include "fsdp/fsdp-impl.h"

#include <string.h>

static const char *mod_name(const struct fsdp_module *m) {
    return !m->fqn ? m->name : m->fqn[0] ? m->fqn : "(root)";
}

enum fsdp_wrap fsdp_wrap_by_type(struct fsdp_module *m, void *ud, struct fsdp_unit_overrides *ovr) {
    (void)ovr;
    const char *type = ud ? (const char *)ud : "Block";
    return strcmp(m->ops->type, type) == 0 ? FSDP_WRAP_UNIT : FSDP_WRAP_SKIP;
}

/* Naming-only containers never run (their parents call the children), so
 * their hooks would never gather: they are not offered as units. */
static int is_container(const struct fsdp_module *m) {
    return !strcmp(m->ops->type, "Module") || !strcmp(m->ops->type, "ModuleList");
}

/* Parameters below m (own and children's) that no wrapped descendant takes,
 * for a threshold of min: a child is wrapped when its own count reaches min. */
static int64_t unwrapped_numel(struct fsdp_module *m, int64_t min) {
    int64_t n = 0;
    for (int i = 0; i < m->n_params; i++)
        if (!m->params[i]->tied_to) n += m->params[i]->numel;
    for (int i = 0; i < m->n_children; i++) {
        int64_t c = unwrapped_numel(m->children[i], min);
        if (c < min || is_container(m->children[i])) n += c;
    }
    return n;
}

enum fsdp_wrap fsdp_wrap_by_size(struct fsdp_module *m, void *ud, struct fsdp_unit_overrides *ovr) {
    (void)ovr;
    if (is_container(m)) return FSDP_WRAP_SKIP;
    int64_t min = ud ? *(const int64_t *)ud : 100000000;
    if (min < 1) min = 1;
    return unwrapped_numel(m, min) >= min ? FSDP_WRAP_UNIT : FSDP_WRAP_SKIP;
}

struct fsdp_shard_opts fsdp_shard_opts_default(void) {
    struct fsdp_shard_opts o = {0};
    o.wrap = fsdp_wrap_by_type;
    o.wrap_ud = (void *)"Block";
    o.reshard_after_forward = 1;
    o.overlap = 1;
    o.max_inflight = 2;
    return o;
}

/* ---- Layout ---- */

struct plan {
    struct fsdp_module **unit_roots; /* pre-order */
    struct fsdp_unit_overrides *ovr; /* per unit root (set == 0: none) */
    int n_units, cap;
};

static enum fsdp_status collect_units(struct fsdp_ctx *ctx, struct fsdp_module *m, int is_root,
                                      const struct fsdp_shard_opts *o, struct plan *pl) {
    if (m->priv->hooks)
        return fsdp__err(ctx, FSDP_ERR_STATE, "module '%s' is already part of a sharded model",
                         m->fqn ? m->fqn : m->name);
    struct fsdp_unit_overrides ovr = {0};
    enum fsdp_wrap w = is_root ? FSDP_WRAP_UNIT : o->wrap ? o->wrap(m, o->wrap_ud, &ovr) : FSDP_WRAP_SKIP;
    if (w != FSDP_WRAP_SKIP && w != FSDP_WRAP_UNIT && w != FSDP_WRAP_UNIT_OVERRIDE)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "wrap policy returned %d for module '%s'", (int)w,
                         mod_name(m));
    if (w != FSDP_WRAP_UNIT_OVERRIDE) ovr.set = 0;
    /* [Note: fp32 modules] a module whose parameters must stay fp32 under
     * mixed precision (batch norm, as PyTorch's autocast and FSDP keep it)
     * becomes a wholly fp32 unit of its own when the units gather 16-bit,
     * unless the policy said otherwise for it */
    if (!is_root && m->fp32_params && o->precision != FSDP_F32 && !(ovr.set & FSDP_OVR_MIXED_PRECISION)) {
        w = FSDP_WRAP_UNIT_OVERRIDE;
        ovr.set |= FSDP_OVR_MIXED_PRECISION;
        ovr.mixed_precision = FSDP_MP_FULL;
    }
    if (ovr.set & ~(FSDP_OVR_RESHARD_AFTER_FORWARD | FSDP_OVR_MIXED_PRECISION))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "wrap policy: unknown override bits 0x%x for module '%s'",
                         ovr.set, mod_name(m));
    if ((ovr.set & FSDP_OVR_MIXED_PRECISION) && ovr.mixed_precision != FSDP_MP_FULL &&
        ovr.mixed_precision != FSDP_MP_DEFAULT && ovr.mixed_precision != FSDP_MP_PURE)
        return fsdp__err(ctx, FSDP_ERR_INVALID,
                         "wrap policy: unit '%s' overrides mixed_precision to %d, which is not DEFAULT, PURE "
                         "or FULL", mod_name(m), (int)ovr.mixed_precision);
    if (w != FSDP_WRAP_SKIP) {
        if (pl->n_units == pl->cap) {
            int ncap = pl->cap ? 2 * pl->cap : 16;
            void *n = fsdp__realloc(pl->unit_roots, (size_t)ncap * sizeof *pl->unit_roots);
            void *v = n ? fsdp__realloc(pl->ovr, (size_t)ncap * sizeof *pl->ovr) : NULL;
            if (n) pl->unit_roots = n;
            if (v) pl->ovr = v;
            if (!n || !v) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory planning units");
            pl->cap = ncap;
        }
        pl->ovr[pl->n_units] = ovr;
        pl->unit_roots[pl->n_units++] = m;
    }
    for (int i = 0; i < m->n_children; i++) FSDP_TRY(collect_units(ctx, m->children[i], 0, o, pl));
    return FSDP_OK;
}

/* Index of the unit whose root is the nearest wrapped ancestor-or-self of m. */
static int unit_index_of_module(const struct plan *pl, struct fsdp_module *m) {
    for (; m; m = m->parent)
        for (int i = 0; i < pl->n_units; i++)
            if (pl->unit_roots[i] == m) return i;
    return 0;
}

static int is_ancestor_unit(const struct fsdp_model *fm, int anc, int u) {
    for (const struct fsdp__unit *x = &fm->units[u]; x; x = x->parent)
        if (x->index == anc) return 1;
    return 0;
}

struct assign_args {
    struct fsdp_model *fm;
    const struct plan *pl;
    int *param_unit; /* per visited parameter, in visit order */
    struct fsdp_param **visit;
    int n;
    int cap;
    enum fsdp_status st;
};

static int assign_one(struct fsdp_param *p, void *ud) {
    struct assign_args *a = ud;
    if (p->data) {
        a->st = fsdp__err(a->fm->ctx, FSDP_ERR_STATE,
                          "parameter '%s' already has storage: shard a model built with shapes only",
                          p->fqn);
        return 1;
    }
    if (a->n == a->cap) {
        int ncap = a->cap ? 2 * a->cap : 64;
        void *v = fsdp__realloc(a->visit, (size_t)ncap * sizeof *a->visit);
        void *u = v ? fsdp__realloc(a->param_unit, (size_t)ncap * sizeof *a->param_unit) : NULL;
        if (v) a->visit = v;
        if (u) a->param_unit = u;
        if (!v || !u) {
            a->st = fsdp__err(a->fm->ctx, FSDP_ERR_NOMEM, "out of memory assigning parameters");
            return 1;
        }
        a->cap = ncap;
    }
    a->visit[a->n] = p;
    a->param_unit[a->n] = unit_index_of_module(a->pl, p->owner);
    a->n++;
    return 0;
}

/* Finds, for each tied parameter below m, the unit of its user and hoists the
 * shared parameter to the lowest unit enclosing both. */
static void hoist_tied(struct assign_args *a, struct fsdp_module *m) {
    for (int i = 0; i < m->n_params; i++) {
        struct fsdp_param *p = m->params[i];
        if (!p->tied_to) continue;
        if (!p->priv->grad_writer) p->tied_to->priv->grad_writer = 0; /* its layer adds into grad directly */
        if (!p->priv->lp_reader) p->tied_to->priv->lp_reader = 0; /* its layer reads data ([Note: lazy widening]) */
        int user = unit_index_of_module(a->pl, m);
        for (int j = 0; j < a->n; j++) {
            if (a->visit[j] != p->tied_to) continue;
            int u = a->param_unit[j];
            while (!is_ancestor_unit(a->fm, u, user)) u = a->fm->units[u].parent->index;
            if (u != a->param_unit[j])
                fsdp__log(a->fm->ctx, 1, "fsdp: tied parameter '%s' (used by '%s') kept in unit '%s'",
                          p->tied_to->fqn, p->fqn, a->fm->units[u].module->fqn);
            a->param_unit[j] = u;
        }
    }
    for (int i = 0; i < m->n_children; i++) hoist_tied(a, m->children[i]);
}

static enum fsdp_status build_units(struct fsdp_model *fm, const struct fsdp_shard_opts *o) {
    struct fsdp_ctx *ctx = fm->ctx;
    if (o->max_inflight < 0)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "shard options: max_inflight %d (units gathered at once: 1 or more, "
                         "0 for the default 2)", o->max_inflight);
    struct plan pl = {0};
    enum fsdp_status st = collect_units(ctx, fm->root, 1, o, &pl);
    if (st != FSDP_OK) {
        free(pl.unit_roots);
        free(pl.ovr);
        return st;
    }
    fm->units = fsdp__zalloc((size_t)pl.n_units, sizeof *fm->units);
    if (!fm->units) {
        free(pl.unit_roots);
        free(pl.ovr);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory creating units");
    }
    fm->n_units = pl.n_units;
    for (int i = 0; i < pl.n_units; i++) {
        struct fsdp__unit *u = &fm->units[i];
        u->index = i;
        u->model = fm;
        u->module = pl.unit_roots[i];
        u->parent = i == 0 ? NULL : &fm->units[unit_index_of_module(&pl, u->module->parent)];
        /* the root unit keeps its parameters from forward to backward (FSDP2) */
        u->reshard_after_forward = i == 0 ? 0 : o->reshard_after_forward;
        if (i > 0 && (pl.ovr[i].set & FSDP_OVR_RESHARD_AFTER_FORWARD))
            u->reshard_after_forward = pl.ovr[i].reshard_after_forward != 0;
        if (fm->sharding == FSDP_SHARD_GRAD_OP) u->reshard_after_forward = 0; /* ZeRO-2 */
        u->mixed_precision = FSDP_MP_FULL;
        u->overrides = pl.ovr[i];
    }
    fm->overlap = o->overlap != 0;
    fm->max_inflight = o->max_inflight > 0 ? o->max_inflight : 2;
    fm->lp_shard_copy = o->lp_shard_copy != 0;
    struct assign_args a = {fm, &pl, NULL, NULL, 0, 0, FSDP_OK};
    fsdp_module_foreach_param(fm->root, assign_one, &a);
    if (a.st == FSDP_OK) hoist_tied(&a, fm->root);
    /* lay out each unit's parameters in visit order, padded for the shard group */
    int world = fm->shard_size;
    for (int i = 0; i < fm->n_units && a.st == FSDP_OK; i++) {
        struct fsdp__unit *u = &fm->units[i];
        int n = 0;
        for (int j = 0; j < a.n; j++) n += a.param_unit[j] == i;
        u->params = fsdp__zalloc((size_t)n + 1, sizeof *u->params);
        u->param_fqns = fsdp__zalloc((size_t)n + 1, sizeof *u->param_fqns);
        u->offsets = fsdp__zalloc((size_t)n + 1, sizeof *u->offsets);
        if (!u->params || !u->param_fqns || !u->offsets) {
            a.st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory laying out units");
            break;
        }
        int64_t off = 0;
        for (int j = 0; j < a.n; j++) {
            if (a.param_unit[j] != i) continue;
            u->params[u->n_params] = a.visit[j];
            u->param_fqns[u->n_params] = a.visit[j]->fqn;
            u->offsets[u->n_params] = off;
            a.visit[j]->priv->unit = u;
            off += a.visit[j]->numel; /* each at most FSDP__MAX_NUMEL: no wrap before the check below */
            u->n_params++;
            if (off > FSDP__MAX_NUMEL && a.st == FSDP_OK)
                a.st = fsdp__err(ctx, FSDP_ERR_INVALID, "unit '%s': its parameters hold more than 2^48 elements "
                                 "(at '%s'); wrap them in smaller units", u->module->fqn[0] ? u->module->fqn : "(root)",
                                 a.visit[j]->fqn);
        }
        if (a.st != FSDP_OK) break;
        u->numel_full = off;
        u->numel_shard = (off + world - 1) / world;
        u->numel_padded = u->numel_shard * world;
    }
    free(a.visit);
    free(a.param_unit);
    free(pl.unit_roots);
    free(pl.ovr);
    return a.st;
}

enum fsdp_status fsdp__unit_alloc_shards(struct fsdp_ctx *ctx, struct fsdp__unit *u, int k_state) {
    size_t n = (size_t)u->numel_shard;
    /* a 16-bit unit's copy for its gathers when the model keeps one
     * (lp_shard_copy; mixed.c): the optimizer writes it, and
     * fsdp_fully_shard's first call runs before the dtypes resolve, so it
     * comes with fsdp_model_attach_optim's call */
    size_t lp = u->param_dtype != FSDP_F32 && u->model->lp_shard_copy && !u->win_lp ? n * sizeof(uint16_t) : 0;
    size_t own = u->win_full ? 0 : 1; /* the parameter shard, unless it lies in the shared window */
    float *mem = fsdp__calloc(ctx, (own + (size_t)k_state) * n * sizeof(float) + lp + 64, FSDP_MEM_SHARD,
                              u->module->fqn[0] ? u->module->fqn : "root unit shards");
    if (!mem) return FSDP_ERR_NOMEM;
    if (own && u->shard_mem && !fsdp__measuring) memcpy(mem, u->shard, n * sizeof(float)); /* keep the values */
    fsdp__free(ctx, u->shard_mem);
    u->shard_mem = mem;
    u->shard = own ? mem : u->win_full + (int64_t)u->model->shard_rank * u->numel_shard;
    u->state = k_state ? mem + own * n : NULL;
    u->shard_lp = u->win_lp ? u->win_lp + (int64_t)u->model->shard_rank * u->numel_shard /* [Note: 16-bit window] */
                  : lp      ? (uint16_t *)(void *)(mem + (own + (size_t)k_state) * n)
                            : NULL;
    u->shard_lp_valid = 0;
    return FSDP_OK;
}

/* The empty model both constructors below start from: root finalized (FQNs),
 * *fm zeroed with its context and root; `what` names the job in the error. */
static enum fsdp_status model_new(struct fsdp_ctx *ctx, struct fsdp_module *root, const char *what,
                                  struct fsdp_model **fm) {
    if (!root->fqn) FSDP_TRY(fsdp_module_finalize(ctx, root));
    if (!(*fm = fsdp__zalloc(1, sizeof **fm))) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory %s", what);
    (*fm)->ctx = ctx;
    (*fm)->root = root;
    return FSDP_OK;
}

enum fsdp_status fsdp__model_layout(struct fsdp_ctx *ctx, struct fsdp_module *root,
                                    const struct fsdp_shard_opts *opts, struct fsdp_model **out) {
    struct fsdp_shard_opts def = fsdp_shard_opts_default();
    if (!opts) opts = &def;
    struct fsdp_model *fm;
    FSDP_TRY(model_new(ctx, root, "laying out units", &fm));
    enum fsdp_status st = fsdp__sharding_layout(ctx, opts, ctx->world, ctx->rank, 0, fm);
    if (st == FSDP_OK) st = build_units(fm, opts);
    if (st != FSDP_OK) {
        fsdp_model_free(fm);
        return st;
    }
    *out = fm;
    return FSDP_OK;
}

enum fsdp_status fsdp_fully_shard(struct fsdp_ctx *ctx, struct fsdp_module *root,
                                  const struct fsdp_shard_opts *opts, struct fsdp_model **out) {
    struct fsdp_shard_opts def = fsdp_shard_opts_default();
    if (!opts) opts = &def;
    struct fsdp_model *fm;
    FSDP_TRY(model_new(ctx, root, "creating the sharded model", &fm));
    enum fsdp_status st = fsdp__sharding_comms(ctx, opts, fm);
    if (st == FSDP_OK) st = build_units(fm, opts);
    if (st == FSDP_OK) st = fsdp__model_window(ctx, fm);
    for (int i = 0; i < fm->n_units && st == FSDP_OK; i++)
        st = fsdp__unit_alloc_shards(ctx, &fm->units[i], 0);
    if (st == FSDP_OK && opts->precision != FSDP_F32) /* per-unit dtypes (mixed.c) */
        st = fsdp__mp_resolve(ctx, fm, opts->precision, opts->mixed_precision);
    if (st != FSDP_OK) {
        fsdp_model_free(fm);
        return st;
    }
    for (int i = 0; i < fm->n_units; i++) {
        fm->units[i].module->priv->hooks = &fsdp__unit_hooks;
        fm->units[i].module->priv->hook_data = &fm->units[i];
    }
    *out = fm;
    return FSDP_OK;
}

void fsdp_model_free(struct fsdp_model *fm) {
    if (!fm) return;
    struct fsdp_ctx *ctx = fm->ctx;
    fsdp__model_grads_none(ctx, fm); /* the arena forgets this lender */
    for (int i = 0; i < fm->n_units; i++) {
        struct fsdp__unit *u = &fm->units[i];
        if (u->req) fsdp_comm_wait(fm->shard_comm, u->req);
        if (u->rs_req) fsdp_comm_wait(fm->shard_size > 1 ? fm->shard_comm : fm->rep_comm, u->rs_req);
        if (u->ar_req) fsdp_comm_wait(fm->rep_comm, u->ar_req);
        for (int j = 0; j < u->n_params; j++) {
            u->params[j]->data = NULL;
            u->params[j]->grad = NULL;
            u->params[j]->priv->unit = NULL;
        }
        if (u->module && u->module->priv->hook_data == u) {
            u->module->priv->hooks = NULL;
            u->module->priv->hook_data = NULL;
        }
        fsdp__free(ctx, u->shard_mem);
        fsdp__free(ctx, u->grad_own);
        free(u->params);
        free(u->param_fqns);
        free(u->offsets);
        free(u->slices);
    }
    for (int i = 0; i < fm->n_pool; i++) fsdp__free(ctx, fm->pool[i].mem);
    free(fm->pool);
    fsdp__model_window_free(fm);
    free(fm->units);
    free(fm->bwd_order);
    fsdp__post_step_hooks_free(fm);
    fsdp__sharding_free(fm);
    free(fm);
}

void fsdp__model_shards_written(struct fsdp_model *fm) {
    for (int i = 0; i < fm->n_units; i++) fm->units[i].shard_lp_valid = 0;
}

/* ---- Initialisation after sharding ---- */

enum fsdp_status fsdp_model_init_params(struct fsdp_ctx *ctx, struct fsdp_model *fm, uint64_t seed) {
    FSDP_TRY(fsdp__check_unsummoned(ctx, fm, "init_params"));
    fsdp__model_shards_written(fm);
    for (int i = 0; i < fm->n_units; i++) {
        struct fsdp__unit *u = &fm->units[i];
        if (u->state_ != UNIT_SHARDED)
            return fsdp__err(ctx, FSDP_ERR_STATE, "init_params while unit '%s' is gathered",
                             u->module->fqn);
        if (fsdp__measuring) continue; /* [Note: measure mode] (plan.c) */
        int64_t lo = (int64_t)fm->shard_rank * u->numel_shard, hi = lo + u->numel_shard;
        memset(u->shard, 0, (size_t)u->numel_shard * sizeof(float));
        for (int j = 0; j < u->n_params; j++) {
            int64_t a = u->offsets[j], b = a + u->params[j]->numel;
            int64_t s = a > lo ? a : lo, e = b < hi ? b : hi;
            if (s >= e) continue;
            fsdp__init_fill(u->params[j]->init, seed, u->params[j]->fqn, (uint64_t)(s - a),
                            u->shard + (s - lo), (size_t)(e - s));
        }
    }
    return FSDP_OK;
}

/* ---- Queries ---- */

int fsdp_model_n_units(const struct fsdp_model *fm) { return fm->n_units; }

void fsdp_model_unit_info(const struct fsdp_model *fm, int i, struct fsdp_unit_info *out) {
    const struct fsdp__unit *u = &fm->units[i];
    out->fqn = u->module->fqn;
    out->n_params = u->n_params;
    out->param_fqns = u->param_fqns;
    out->numel_full = u->numel_full;
    out->numel_padded = u->numel_padded;
    out->numel_shard = u->numel_shard;
}

struct fsdp__unit *fsdp__model_unit_of(struct fsdp_model *fm, const char *fqn, int *param_index) {
    struct fsdp_param *p = fsdp_module_find_param(fm->root, fqn);
    if (!p) return NULL;
    while (p->tied_to) p = p->tied_to;
    struct fsdp__unit *u = p->priv->unit;
    if (!u) return NULL;
    for (int j = 0; j < u->n_params; j++)
        if (u->params[j] == p) {
            if (param_index) *param_index = j;
            return u;
        }
    return NULL;
}
