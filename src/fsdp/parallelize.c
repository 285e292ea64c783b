/*
 * parallelize.c - fsdp_parallelize_model, the preparation API (Composer's
 * parallelize_model, VISSL's FSDP task): config validation, activation
 * checkpointing marks, sharding by a wrap policy (fsdp_fully_shard),
 * initialisation unit by unit (built-in, param_init, each parameter's own
 * storage, or rank 0's values broadcast one unit at a time), optimizer
 * re-pointing, the unit plan, and fsdp_summon_full_params.
 * Invariants: at most one unit's full buffer exists at a time during init
 * (peak = shards + one unit); every rank reaches the same verdict on every
 * collective error, so no rank waits for a peer that gave up.
 */
#include "fsdp/fsdp-impl.h"
#include "optim/optim-impl.h"

#include <string.h>

struct fsdp_parallel_config fsdp_parallel_config_default(void) {
    struct fsdp_parallel_config c;
    memset(&c, 0, sizeof c);
    c.reshard_after_forward = 1;
    c.state_dict_type = FSDP_STATE_DICT_FULL;
    c.mixed_precision = FSDP_MP_DEFAULT;
    c.seed = 1337;
    c.overlap = 1;
    c.max_inflight = 2;
    return c;
}

int fsdp_ac_by_type(struct fsdp_module *m, void *ud) {
    return ud && strcmp(m->ops->type, (const char *)ud) == 0;
}

static const char *mname(const struct fsdp_module *m) {
    return !m->fqn ? m->name : m->fqn[0] ? m->fqn : "(root)";
}

/* ---- Step 1: validation ---- */

static enum fsdp_status validate(struct fsdp_ctx *ctx, const struct fsdp_parallel_config *c,
                                 enum fsdp_dtype precision, const struct fsdp_ac_check *ac) {
    if (c->mesh[1] != 0) { /* 2-D: {replicas, shard group} */
        if (c->mesh[0] < 1 || c->mesh[1] < 1 || c->mesh[0] * c->mesh[1] != ctx->world)
            return fsdp__err(ctx, FSDP_ERR_INVALID,
                             "parallelize: 2-D mesh {%d replicas, %d shards} does not cover the world of %d ranks",
                             c->mesh[0], c->mesh[1], ctx->world);
        if (c->sharding != FSDP_FULL_SHARD && c->sharding != FSDP_HYBRID_SHARD)
            return fsdp__err(ctx, FSDP_ERR_INVALID,
                             "parallelize: a 2-D mesh means HYBRID_SHARD, but sharding is %s",
                             fsdp_sharding_name(c->sharding));
    } else if (c->mesh[0] != 0 && c->mesh[0] != ctx->world)
        return fsdp__err(ctx, FSDP_ERR_INVALID,
                         "parallelize: mesh {%d} does not cover the world of %d ranks (use {0, 0} or {%d, 0})",
                         c->mesh[0], ctx->world, ctx->world);
    if (c->mixed_precision != FSDP_MP_FULL && c->mixed_precision != FSDP_MP_DEFAULT &&
        c->mixed_precision != FSDP_MP_PURE)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "parallelize: mixed_precision %d is not DEFAULT, PURE or FULL",
                         (int)c->mixed_precision);
    if (precision != FSDP_F32 && precision != FSDP_BF16 && precision != FSDP_F16)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "parallelize: precision %s is not a floating-point type",
                         fsdp_dtype_name(precision));
    if (c->state_dict_type != FSDP_STATE_DICT_FULL && c->state_dict_type != FSDP_STATE_DICT_SHARDED)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "parallelize: state_dict_type %d is not FULL or SHARDED",
                         (int)c->state_dict_type);
    if (c->activation_cpu_offload)
        return fsdp__err(ctx, FSDP_ERR_UNSUPPORTED,
                         "parallelize: activation_cpu_offload: this is a CPU-only run, activations already "
                         "live in host memory and there is no device to offload them from (use "
                         "activation_checkpointing to save memory)");
    if (ac && ac->fn && !c->activation_checkpointing)
        return fsdp__err(ctx, FSDP_ERR_INVALID,
                         "parallelize: an ac_check function was given but activation_checkpointing and "
                         "activation_cpu_offload are both off (as Composer: turn one on or drop ac_check)");
    return FSDP_OK;
}

/* ---- Step 2: activation checkpointing ---- */

static int mark_ac(struct fsdp_module *m, const struct fsdp_ac_check *ac) {
    int n = 0;
    if (m->parent && ac->fn(m, ac->ud)) { /* the root is never asked */
        m->checkpoint = 1;
        n++;
    }
    for (int i = 0; i < m->n_children; i++) n += mark_ac(m->children[i], ac);
    return n;
}

/* ---- The cross-rank model check ---- */

struct fp_args {
    int n, cap;
    uint64_t *h;            /* (n) per-parameter fingerprint */
    struct fsdp_param **p;  /* (n) */
    int missing;            /* parameters without storage */
};

static int fp_one(struct fsdp_param *p, void *ud) {
    struct fp_args *a = ud;
    if (a->n == a->cap) {
        int ncap = a->cap ? 2 * a->cap : 64;
        void *h = fsdp__realloc(a->h, (size_t)ncap * sizeof *a->h);
        void *q = h ? fsdp__realloc(a->p, (size_t)ncap * sizeof *a->p) : NULL;
        if (h) a->h = h;
        if (q) a->p = q;
        if (!h || !q) return 1;
        a->cap = ncap;
    }
    uint64_t x = fsdp__hash_str(p->fqn) ^ ((uint64_t)p->ndim * 0x9E3779B97F4A7C15ull);
    for (int d = 0; d < p->ndim; d++) x = (x ^ (uint64_t)p->shape[d]) * 0x100000001B3ull;
    a->h[a->n] = x;
    a->p[a->n++] = p;
    if (!p->data) a->missing++;
    return 0;
}

static void describe(const struct fsdp_param *p, char *buf, size_t cap) {
    int k = snprintf(buf, cap, "'%s' (", p->fqn);
    for (int d = 0; d < p->ndim && k > 0 && (size_t)k < cap; d++)
        k += snprintf(buf + k, cap - (size_t)k, "%s%lld", d ? ", " : "", (long long)p->shape[d]);
    if (k > 0 && (size_t)k < cap) snprintf(buf + k, cap - (size_t)k, ")");
}

/* Every rank must have the same parameter names and shapes (and, for
 * sync_module_states, rank 0 must have values for all). A mismatch names the
 * first differing parameter on every rank. COLLECTIVE: yes. */
static enum fsdp_status check_models(struct fsdp_ctx *ctx, struct fsdp_module *root, int sync) {
    struct fp_args a = {0};
    enum fsdp_status st = FSDP_OK;
    if (fsdp_module_foreach_param(root, fp_one, &a)) {
        st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory fingerprinting the model");
        goto out; /* ranks disagree only if memory runs out: the abort in the tool ends them */
    }
    uint64_t total = 0xcbf29ce484222325ull;
    for (int i = 0; i < a.n; i++) total = (total ^ a.h[i]) * 0x100000001B3ull;
    uint64_t mine[3] = {(uint64_t)a.n, total, (uint64_t)(sync && ctx->rank == 0 ? a.missing : 0)};
    uint64_t *all = fsdp__zalloc((size_t)ctx->world * 3, sizeof *all);
    if (!all) {
        st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory checking the model");
        goto out;
    }
    st = fsdp_comm_allgather(ctx->comm, mine, all, sizeof mine, FSDP_U8);
    int differ = 0;
    for (int r = 1; r < ctx->world && st == FSDP_OK; r++) differ |= all[3 * r] != all[0] || all[3 * r + 1] != all[1];
    uint64_t missing0 = all[2];
    free(all);
    if (st != FSDP_OK) goto out;
    if (differ) {
        /* rank 0's per-parameter fingerprints, then the first index that differs */
        int32_t n0 = a.n;
        st = fsdp_comm_broadcast(ctx->comm, &n0, 1, FSDP_I32, 0);
        uint64_t *h0 = st == FSDP_OK ? fsdp__zalloc((size_t)n0 + 1, sizeof *h0) : NULL;
        if (st == FSDP_OK && !h0) FSDP_ASSERT(0, "out of memory checking the model");
        if (st == FSDP_OK && ctx->rank == 0) memcpy(h0, a.h, (size_t)n0 * sizeof *h0);
        if (st == FSDP_OK) st = fsdp_comm_broadcast(ctx->comm, h0, (size_t)n0 * sizeof *h0, FSDP_U8, 0);
        int32_t idx = INT32_MAX;
        for (int i = 0; st == FSDP_OK && i < (a.n > n0 ? a.n : n0); i++)
            if (i >= a.n || i >= n0 || a.h[i] != h0[i]) {
                idx = i;
                break;
            }
        free(h0);
        int32_t *idxs = fsdp__zalloc((size_t)ctx->world, sizeof *idxs);
        if (!idxs) FSDP_ASSERT(0, "out of memory checking the model");
        if (st == FSDP_OK) st = fsdp_comm_allgather(ctx->comm, &idx, idxs, 1, FSDP_I32);
        int bad = -1; /* the rank whose difference comes first */
        for (int r = 1; r < ctx->world; r++)
            if (idxs[r] < INT32_MAX && (bad < 0 || idxs[r] < idxs[bad])) bad = r;
        if (bad < 0) bad = 1; /* cannot happen: equal fingerprints give equal totals */
        int32_t at = idxs[bad] < INT32_MAX ? idxs[bad] : 0;
        free(idxs);
        char d0[256] = "(no such parameter)", dr[256] = "(no such parameter)";
        if (st == FSDP_OK && ctx->rank == 0 && at < a.n) describe(a.p[at], d0, sizeof d0);
        if (st == FSDP_OK && ctx->rank == bad && at < a.n) describe(a.p[at], dr, sizeof dr);
        if (st == FSDP_OK) st = fsdp_comm_broadcast(ctx->comm, d0, sizeof d0, FSDP_U8, 0);
        if (st == FSDP_OK) st = fsdp_comm_broadcast(ctx->comm, dr, sizeof dr, FSDP_U8, bad);
        if (st == FSDP_OK)
            st = fsdp__err(ctx, FSDP_ERR_INVALID,
                           "parallelize: the model differs across ranks: parameter #%d is %s on rank 0 but "
                           "%s on rank %d",
                           (int)at, d0, dr, bad);
        goto out;
    }
    if (missing0)
        st = fsdp__err(ctx, FSDP_ERR_INVALID,
                       "parallelize: sync_module_states needs rank 0's model materialized, but %llu of its "
                       "parameters have no values",
                       (unsigned long long)missing0);
    if (missing0 && ctx->rank == 0)
        for (int i = 0; i < a.n; i++)
            if (!a.p[i]->data) {
                char d[256];
                describe(a.p[i], d, sizeof d);
                st = fsdp__err(ctx, FSDP_ERR_INVALID,
                               "parallelize: sync_module_states needs rank 0's model materialized, but "
                               "parameter %s has no values (%llu without)",
                               d, (unsigned long long)missing0);
                break;
            }
out:
    free(a.h);
    free(a.p);
    return st;
}

/* ---- Step 4: initialisation, unit by unit ---- */

/* Materialized storage taken from the parameters before sharding. */
struct saved {
    int n, cap;
    struct fsdp_param **p;
    float **data, **grad;
};

static int save_one(struct fsdp_param *p, void *ud) {
    struct saved *s = ud;
    if (!p->data) return 0;
    if (!p->priv->owns_data) return 0; /* fully_shard reports it */
    if (s->n == s->cap) {
        int ncap = s->cap ? 2 * s->cap : 64;
        void *a = fsdp__realloc(s->p, (size_t)ncap * sizeof *s->p);
        if (a) s->p = a;
        void *b = a ? fsdp__realloc(s->data, (size_t)ncap * sizeof *s->data) : NULL;
        if (b) s->data = b;
        void *c = b ? fsdp__realloc(s->grad, (size_t)ncap * sizeof *s->grad) : NULL;
        if (c) s->grad = c;
        if (!c) return 1;
        s->cap = ncap;
    }
    s->p[s->n] = p;
    s->data[s->n] = p->data;
    s->grad[s->n++] = p->grad;
    p->data = NULL;
    p->grad = NULL;
    p->priv->owns_data = 0;
    return 0;
}

static float *saved_data(const struct saved *s, const struct fsdp_param *p, int *slot) {
    for (int i = 0; i < s->n; i++)
        if (s->p[i] == p) {
            *slot = i;
            return s->data[i];
        }
    return NULL;
}

static void saved_release(struct saved *s, int i) {
    /* owned storage is accounted to no context (see fsdp_module_materialize) */
    fsdp__free(NULL, s->data[i]);
    fsdp__free(NULL, s->grad[i]);
    s->data[i] = s->grad[i] = NULL;
}

static void saved_free(struct saved *s) {
    for (int i = 0; i < s->n; i++) saved_release(s, i);
    free(s->p);
    free(s->data);
    free(s->grad);
}

/* `full` is one buffer of the largest unit's numel_padded, or NULL when no
 * unit needs its full values (the built-in init and eager values fill the
 * shard directly). */
static enum fsdp_status init_unit(struct fsdp_ctx *ctx, struct fsdp__unit *u, const struct fsdp_parallel_config *c,
                                  const struct fsdp_param_init *pi, struct saved *sv, float *full) {
    int64_t S = u->numel_shard, lo = (int64_t)u->model->shard_rank * S, hi = lo + S;
    memset(u->shard, 0, (size_t)S * sizeof(float));
    enum fsdp_status st = FSDP_OK;
    if (c->sync_module_states) {
        memset(full, 0, (size_t)u->numel_padded * sizeof(float));
        for (int j = 0; j < u->n_params && ctx->rank == 0; j++) {
            int slot;
            const float *d = saved_data(sv, u->params[j], &slot);
            FSDP_ASSERT(d, "rank 0 has no values for '%s'", u->params[j]->fqn); /* checked before */
            memcpy(full + u->offsets[j], d, (size_t)u->params[j]->numel * sizeof(float));
        }
        st = fsdp_comm_broadcast(ctx->comm, full, (size_t)u->numel_padded, FSDP_F32, 0);
        if (st == FSDP_OK) memcpy(u->shard, full + lo, (size_t)S * sizeof(float));
    } else {
        for (int j = 0; j < u->n_params && st == FSDP_OK; j++) {
            struct fsdp_param *p = u->params[j];
            int64_t a = u->offsets[j], b = a + p->numel;
            int64_t s = a > lo ? a : lo, e = b < hi ? b : hi;
            if (s >= e) continue;
            int slot;
            const float *d = saved_data(sv, p, &slot);
            if (d) { /* this rank's own values (an eager model) */
                memcpy(u->shard + (s - lo), d + (s - a), (size_t)(e - s) * sizeof(float));
            } else if (c->skip_init) { /* zero, as memset above: the caller loads every parameter next */
            } else if (pi && pi->fn) {
                st = pi->fn(ctx, p, full + a, pi->ud);
                if (st != FSDP_OK) {
                    char msg[sizeof ctx->errmsg];
                    snprintf(msg, sizeof msg, "%s", ctx->errmsg);
                    st = fsdp__err(ctx, st, "param_init failed for '%s': %s", p->fqn, msg);
                } else {
                    memcpy(u->shard + (s - lo), full + s, (size_t)(e - s) * sizeof(float));
                }
            } else {
                fsdp__init_fill(p->init, c->seed, p->fqn, (uint64_t)(s - a), u->shard + (s - lo),
                                (size_t)(e - s));
            }
        }
    }
    for (int j = 0; j < u->n_params; j++) { /* this unit's source values are no longer needed */
        int slot;
        if (saved_data(sv, u->params[j], &slot)) saved_release(sv, slot);
    }
    return st;
}

/* ---- The plan ---- */

struct sbuf {
    char *buf;
    size_t cap, len;
};

static void sb_printf(struct sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(struct sbuf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char tmp[1024];
    int k = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (k < 0) return;
    size_t n = (size_t)k < sizeof tmp ? (size_t)k : sizeof tmp - 1;
    if (b->len + 1 < b->cap) {
        size_t room = b->cap - b->len - 1;
        memcpy(b->buf + b->len, tmp, n < room ? n : room);
        b->buf[b->len + (n < room ? n : room)] = '\0';
    }
    b->len += n;
}

static void human(double bytes, char *out, size_t cap) {
    const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int i = 0;
    while (bytes >= 1024.0 && i < 4) {
        bytes /= 1024.0;
        i++;
    }
    snprintf(out, cap, i ? "%.1f %s" : "%.0f %s", bytes, u[i]);
}

static void list_ckpt(struct sbuf *b, const struct fsdp_module *m, int *n) {
    if (m->checkpoint) sb_printf(b, "%s%s", (*n)++ ? ", " : "", mname(m));
    for (int i = 0; i < m->n_children; i++) list_ckpt(b, m->children[i], n);
}

size_t fsdp_model_plan(const struct fsdp_model *fm, char *buf, size_t cap) {
    struct sbuf b = {buf, cap, 0};
    if (buf && cap) buf[0] = '\0';
    int k = fm->optim ? fsdp_optim_state_per_elem(fm->optim) : 0;
    int64_t total = 0, shard = 0;
    for (int i = 0; i < fm->n_units; i++) {
        total += fm->units[i].numel_full;
        shard += fm->units[i].numel_shard;
    }
    char h1[32], h2[32];
    human((double)shard * 4.0 * (2 + k), h1, sizeof h1);
    sb_printf(&b, "unit plan: %d units, %lld parameters, world %d; per rank %s of shards "
              "(params + grads + %d optimizer state%s, fp32)\n",
              fm->n_units, (long long)total, fm->ctx->world, h1, k, k == 1 ? "" : "s");
    sb_printf(&b, "sharding: %s, mesh {%d replicas, %d shards}, this rank: shard %d, replica %d; overlap %s",
              fsdp_sharding_name(fm->sharding), fm->rep_size, fm->shard_size, fm->shard_rank, fm->rep_rank,
              fm->overlap ? "on" : "off");
    if (fm->overlap) sb_printf(&b, " (at most %d units gathered at once)", fm->max_inflight);
    sb_printf(&b, "\n");
    for (int i = 0; i < fm->n_units; i++) {
        const struct fsdp__unit *u = &fm->units[i];
        int depth = 0;
        for (const struct fsdp__unit *x = u->parent; x; x = x->parent) depth++;
        human((double)u->numel_shard * 4.0, h1, sizeof h1);
        human((double)u->numel_padded * 4.0, h2, sizeof h2);
        unsigned ov = u->overrides.set;
        sb_printf(&b, "%*sunit %d '%s' (%s): %d params, %lld elements, shard %s/rank, full %s, "
                  "precision %s (param %s, reduce %s, compute %s)%s, reshard_after_forward %s%s%s\n",
                  2 + 2 * depth, "", i, mname(u->module), u->module->ops->type, u->n_params,
                  (long long)u->numel_full, h1, h2, fsdp__mp_name(u->mixed_precision),
                  fsdp_dtype_name(u->param_dtype), fsdp_dtype_name(u->reduce_dtype),
                  fsdp_dtype_name(u->compute_dtype), ov & FSDP_OVR_MIXED_PRECISION ? " (overridden)" : "",
                  u->reshard_after_forward ? "on" : "off", ov & FSDP_OVR_RESHARD_AFTER_FORWARD ? " (overridden)" : "",
                  u->module->checkpoint ? ", checkpointed" : "");
    }
    int n = 0;
    sb_printf(&b, "activation checkpointing: ");
    list_ckpt(&b, fm->root, &n);
    sb_printf(&b, "%s\n", n ? "" : "none");
    return b.len;
}

static void print_plan(struct fsdp_ctx *ctx, const struct fsdp_model *fm) {
    if (ctx->rank != 0) return;
    size_t n = fsdp_model_plan(fm, NULL, 0);
    char *s = fsdp__malloc(n + 1);
    if (!s) return;
    fsdp_model_plan(fm, s, n + 1);
    fputs(s, stderr);
    fflush(stderr);
    free(s);
}

/* ---- fsdp_parallelize_model ---- */

struct fsdp_shard_opts fsdp_parallel_config_shard_opts(const struct fsdp_parallel_config *c, enum fsdp_dtype precision,
                                                       const struct fsdp_wrap_policy *wrap) {
    struct fsdp_shard_opts so = fsdp_shard_opts_default();
    if (wrap) {
        so.wrap = wrap->fn;
        so.wrap_ud = wrap->ud;
    }
    so.reshard_after_forward = c->reshard_after_forward != 0;
    so.sharding = c->sharding;
    so.overlap = c->overlap;
    so.max_inflight = c->max_inflight;
    so.lp_shard_copy = c->lp_shard_copy;
    so.precision = precision;
    so.mixed_precision = c->mixed_precision;
    if (c->mesh[1] != 0) { /* {replicas, shard group} (fsdp_parallelize_model validates it) */
        so.sharding = FSDP_HYBRID_SHARD;
        so.shard_group = c->mesh[1];
    }
    return so;
}

enum fsdp_status fsdp_parallelize_model(struct fsdp_ctx *ctx, struct fsdp_module *root,
                                        const struct fsdp_parallel_config *cfg, struct fsdp_optim *opt,
                                        enum fsdp_dtype precision, const struct fsdp_wrap_policy *wrap,
                                        const struct fsdp_ac_check *ac,
                                        const struct fsdp_param_init *param_init, struct fsdp_model **out) {
    struct fsdp_parallel_config def = fsdp_parallel_config_default();
    struct fsdp_parallel_config c = cfg ? *cfg : def;
    if (!root || !out) return fsdp__err(ctx, FSDP_ERR_INVALID, "parallelize: root and out must not be NULL");
    *out = NULL;
    /* 1. precision and config */
    FSDP_TRY(validate(ctx, &c, precision, ac));
    if (!root->fqn) FSDP_TRY(fsdp_module_finalize(ctx, root));
    FSDP_TRY(check_models(ctx, root, c.sync_module_states));
    FSDP_TRY(fsdp__buffers_check(ctx, root));
    /* 2. activation checkpointing (the default selection needs the units: below) */
    if (ac && ac->fn) mark_ac(root, ac);
    /* 3. shard; materialized values are set aside for step 4 */
    struct saved sv = {0};
    if (fsdp_module_foreach_param(root, save_one, &sv)) {
        saved_free(&sv);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory taking the materialized parameters");
    }
    struct fsdp_shard_opts so = fsdp_parallel_config_shard_opts(&c, precision, wrap);
    struct fsdp_model *fm;
    enum fsdp_status st = fsdp_fully_shard(ctx, root, &so, &fm);
    if (st != FSDP_OK) {
        saved_free(&sv);
        return st;
    }
    fm->state_dict_type = c.state_dict_type;
    fm->load_monolith_rank0_only = c.load_monolith_rank0_only;
    /* per-unit dtypes (mixed.c): fsdp_fully_shard resolved a 16-bit precision; fp32 sets them too */
    st = precision == FSDP_F32 ? fsdp__mp_resolve(ctx, fm, precision, c.mixed_precision) : FSDP_OK;
    if (st != FSDP_OK) {
        saved_free(&sv);
        fsdp_model_free(fm);
        return st;
    }
    if (c.activation_checkpointing && !(ac && ac->fn))
        for (int i = 1; i < fm->n_units; i++) fm->units[i].module->checkpoint = 1;
    /* 4. initialise or sync, one unit at a time */
    int64_t biggest = 0;
    for (int i = 0; i < fm->n_units; i++)
        if (fm->units[i].numel_padded > biggest) biggest = fm->units[i].numel_padded;
    float *full = NULL;
    if (c.sync_module_states || (param_init && param_init->fn)) {
        full = fsdp__alloc(ctx, (size_t)(biggest ? biggest : 1) * sizeof(float), FSDP_MEM_FULL,
                           c.sync_module_states ? "a unit in flight (sync_module_states)" : "a unit being initialised");
        if (!full) FSDP_ASSERT(0, "%s", ctx->errmsg); /* peers would wait in the broadcast */
    }
    fsdp__model_shards_written(fm);
    for (int i = 0; i < fm->n_units && st == FSDP_OK; i++)
        st = init_unit(ctx, &fm->units[i], &c, param_init, &sv, full);
    fsdp__free(ctx, full);
    saved_free(&sv);
    /* buffers are replicated: rank 0's reach every rank ([Note: buffers] in buffers.c) */
    if (st == FSDP_OK && c.sync_module_states) st = fsdp__buffers_broadcast(ctx, root);
    /* 5. the optimizer */
    if (st == FSDP_OK && opt) {
        if (fsdp_optim_step_count(opt) > 0) {
            if (ctx->rank == 0)
                fsdp__log(ctx, 0,
                          "fsdp: warning: the optimizer has taken %lld steps before sharding; its state is "
                          "stale and is cleared (step count 0, moments zero)",
                          (long long)fsdp_optim_step_count(opt));
            fsdp__optim_set_step_count(opt, 0);
        }
        st = fsdp_model_attach_optim(ctx, fm, opt);
    }
    if (st != FSDP_OK) {
        fsdp_model_free(fm);
        return st;
    }
    if (c.verbose) print_plan(ctx, fm);
    *out = fm;
    return FSDP_OK;
}

/* ---- fsdp_summon_full_params ---- */

struct fsdp__unit *fsdp__model_busy_unit(struct fsdp_model *fm) {
    for (int i = 0; i < fm->n_units; i++)
        if (fm->units[i].state_ != UNIT_SHARDED || fm->units[i].phase != PHASE_IDLE) return &fm->units[i];
    return NULL;
}

static int is_below(const struct fsdp_module *m, const struct fsdp_module *anc) {
    for (; m; m = m->parent)
        if (m == anc) return 1;
    return 0;
}

static int unit_touches(const struct fsdp__unit *u, const struct fsdp_module *module) {
    for (int j = 0; j < u->n_params; j++)
        if (is_below(u->params[j]->owner, module)) return 1;
    return 0;
}

static void summon_release(struct fsdp_model *fm) {
    for (int i = 0; i < fm->n_units; i++) {
        struct fsdp__unit *u = &fm->units[i];
        if (!u->summoned) continue;
        for (int j = 0; j < u->n_params; j++) u->params[j]->data = NULL;
        if (u->summoned != u->shard) fsdp__pool_put(fm, u->summoned);
        u->summoned = NULL;
    }
}

enum fsdp_status fsdp_summon_full_params(struct fsdp_ctx *ctx, struct fsdp_model *fm,
                                         struct fsdp_module *module, int writeback, int rank0_only) {
    if (!module) module = fm->root;
    if (fm->summon_active)
        return fsdp__err(ctx, FSDP_ERR_STATE,
                         "summon_full_params: already summoned (nesting is not supported): call "
                         "fsdp_summon_end first");
    struct fsdp__unit *busy = fsdp__model_busy_unit(fm);
    if (busy)
        return fsdp__err(ctx, FSDP_ERR_STATE,
                         "summon_full_params called inside a forward or backward (unit '%s' is in use)",
                         mname(busy->module));
    if (writeback && rank0_only)
        return fsdp__err(ctx, FSDP_ERR_INVALID,
                         "summon_full_params: writeback with rank0_only is not supported (the other ranks "
                         "would have nothing to write back)");
    if (!is_below(module, fm->root))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "summon_full_params: module '%s' is not part of this model",
                         mname(module));
    enum fsdp_status st = FSDP_OK;
    for (int i = 0; i < fm->n_units && st == FSDP_OK; i++) {
        struct fsdp__unit *u = &fm->units[i];
        if (!unit_touches(u, module)) continue;
        /* [Note: summoned in place] Where the shard is the whole unit (a shard
         * group of one rank) and edits are to be kept, the summoned values are
         * the shard itself: no pooled copy (the pool keeps what it hands out,
         * so the SwAV head's summon at init held 18.5 MiB of ResNet-50's head
         * for the rest of a one-rank run), nothing to copy back. Without
         * write-back the edits must vanish, so there is a copy. */
        int in_place = !fm->shard_comm && writeback;
        float *buf = in_place ? u->shard : fsdp__pool_get(fm, u->numel_padded, "summoned parameters");
        if (!buf) FSDP_ASSERT(0, "out of memory summoning unit '%s'", mname(u->module)); /* peers wait */
        if (fm->shard_comm)
            st = fsdp_comm_allgather(fm->shard_comm, u->shard, buf, (size_t)u->numel_shard, FSDP_F32);
        else if (!in_place)
            memcpy(buf, u->shard, (size_t)u->numel_shard * sizeof(float));
        if (st != FSDP_OK || (rank0_only && ctx->rank != 0)) {
            fsdp__pool_put(fm, buf);
            continue;
        }
        u->summoned = buf;
        for (int j = 0; j < u->n_params; j++) u->params[j]->data = buf + u->offsets[j];
    }
    if (st != FSDP_OK) {
        summon_release(fm);
        return st;
    }
    fm->summon_active = 1;
    fm->summon_writeback = writeback != 0;
    fm->summon_rank0_only = rank0_only != 0;
    return FSDP_OK;
}

enum fsdp_status fsdp__check_unsummoned(struct fsdp_ctx *ctx, const struct fsdp_model *fm, const char *what) {
    if (!fm->summon_active) return FSDP_OK;
    return fsdp__err(ctx, FSDP_ERR_STATE, "%s while the parameters are summoned: call fsdp_summon_end first", what);
}

enum fsdp_status fsdp_summon_end(struct fsdp_ctx *ctx, struct fsdp_model *fm) {
    if (!fm->summon_active)
        return fsdp__err(ctx, FSDP_ERR_STATE, "summon_end without fsdp_summon_full_params");
    if (fm->summon_writeback) {
        fsdp__model_shards_written(fm);
        for (int i = 0; i < fm->n_units; i++) {
            struct fsdp__unit *u = &fm->units[i];
            if (u->summoned && u->summoned != u->shard) /* [Note: summoned in place] */
                memcpy(u->shard, u->summoned + (int64_t)fm->shard_rank * u->numel_shard,
                       (size_t)u->numel_shard * sizeof(float));
        }
    }
    summon_release(fm);
    fm->summon_active = 0;
    return FSDP_OK;
}
