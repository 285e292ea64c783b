/*
 * optim.c - AdamW, SGD and LARS over the local shards, the gradient-clipping
 * factor and the learning-rate schedules. Sits above core and below fsdp/:
 * it sees only slices of floats (param, grad, state) and never communicates;
 * the caller (src/fsdp/step.c) cuts shards into slices, decides which slices
 * are decayed, and computes the global gradient norm for clipping.
 * Invariants: the gradient buffers are read, never written (grad_scale is
 * applied on the fly); every update is elementwise, so the result has the
 * same bits for any thread count and any way the shard is cut into slices
 * (see [Note: determinism]).
 */
#include "optim/optim-impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* A registered parameter group (index >= 1; 0 is the options). */
struct optim_group {
    float weight_decay, lr_scale;
    int frozen;                  /* fsdp_optim_group_set: skip the group's slices */
    int n;
    char **fqns;                 /* (n) owned copies */
};

struct fsdp_optim {
    struct fsdp_ctx *ctx;        /* borrowed; must outlive the optimizer */
    struct fsdp_optim_opts opts; /* validated copy */
    int64_t step;                /* steps taken so far (0 before the first) */
    int n_groups;                /* registered groups; groups[0] is unused */
    struct optim_group *groups;  /* (n_groups + 1) */
};

/* Slices at least this long are updated by an OpenMP team; shorter ones run
 * on the calling thread (a parallel region costs more than it saves). */
#define OPTIM_PAR_MIN 16384

/* ---- Options ---- */

struct fsdp_optim_opts fsdp_optim_opts_default(void) {
    struct fsdp_optim_opts o;
    memset(&o, 0, sizeof o); /* every field, the ones set below and any other (nesterov: off) */
    o.kind = FSDP_OPTIM_ADAMW;
    o.beta1 = 0.9f;
    o.beta2 = 0.95f;
    o.eps = 1e-8f;
    o.momentum = 0.0f;
    o.weight_decay = 0.1f;
    o.decay_all = 0;
    o.trust_coefficient = 0.001f;
    o.lars_eps = 1e-8f;
    return o;
}

/* Written so that NaN fails every check. */
static int in_unit_interval(float x) { return x >= 0.0f && x < 1.0f; }

static enum fsdp_status validate(struct fsdp_ctx *ctx, const struct fsdp_optim_opts *o) {
    if (o->kind != FSDP_OPTIM_ADAMW && o->kind != FSDP_OPTIM_SGD && o->kind != FSDP_OPTIM_LARS)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "optim: kind %d is not adamw (%d), sgd (%d) or lars (%d)",
                         (int)o->kind, (int)FSDP_OPTIM_ADAMW, (int)FSDP_OPTIM_SGD, (int)FSDP_OPTIM_LARS);
    if (o->kind == FSDP_OPTIM_LARS && (!(o->trust_coefficient > 0.0f) || !(o->lars_eps >= 0.0f) ||
                                       !isfinite(o->trust_coefficient) || !isfinite(o->lars_eps)))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "optim: LARS trust_coefficient %g must be positive, eps %g >= 0",
                         (double)o->trust_coefficient, (double)o->lars_eps);
    if (!in_unit_interval(o->beta1))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "optim: beta1 = %g is not in [0, 1)", (double)o->beta1);
    if (!in_unit_interval(o->beta2))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "optim: beta2 = %g is not in [0, 1)", (double)o->beta2);
    if (!(o->eps > 0.0f) || isinf(o->eps))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "optim: eps = %g is not a finite value > 0",
                         (double)o->eps);
    if (!(o->weight_decay >= 0.0f) || isinf(o->weight_decay))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "optim: weight_decay = %g is not a finite value >= 0",
                         (double)o->weight_decay);
    if (!in_unit_interval(o->momentum))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "optim: momentum = %g is not in [0, 1)",
                         (double)o->momentum);
    if (o->nesterov && (o->kind != FSDP_OPTIM_SGD || !(o->momentum > 0.0f)))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "optim: nesterov needs SGD with momentum > 0 (momentum = %g)",
                         (double)o->momentum);
    return FSDP_OK;
}

/* Validates *opts (NULL: the defaults) and creates an optimizer with no
 * state of its own: the state lives with the shards (fsdp_model_attach_optim).
 * Every field is validated whichever kind is chosen. *out is returned to the
 * caller to free with fsdp_optim_free; ctx is retained and must outlive it. */
enum fsdp_status fsdp_optim_create(struct fsdp_ctx *ctx, const struct fsdp_optim_opts *opts,
                                   struct fsdp_optim **out) {
    if (!out) return fsdp__err(ctx, FSDP_ERR_INVALID, "optim_create: out is NULL");
    *out = NULL;
    struct fsdp_optim_opts def = fsdp_optim_opts_default();
    if (!opts) opts = &def;
    FSDP_TRY(validate(ctx, opts));
    struct fsdp_optim *opt = fsdp__calloc(ctx, sizeof *opt, FSDP_MEM_OTHER, "the optimizer");
    if (!opt) return FSDP_ERR_NOMEM;
    opt->ctx = ctx;
    opt->opts = *opts;
    opt->step = 0;
    *out = opt;
    return FSDP_OK;
}

void fsdp_optim_free(struct fsdp_optim *opt) {
    if (!opt) return;
    for (int g = 1; g <= opt->n_groups; g++) {
        for (int i = 0; i < opt->groups[g].n; i++) free(opt->groups[g].fqns[i]);
        free(opt->groups[g].fqns);
    }
    free(opt->groups);
    fsdp__free(opt->ctx, opt);
}

/* ---- Parameter groups ---- */

enum fsdp_status fsdp_optim_add_group(struct fsdp_optim *opt, const char *const *fqns, int n,
                                      float weight_decay, float lr_scale) {
    struct fsdp_ctx *ctx = opt->ctx;
    if (n < 1 || !fqns)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "optim_add_group: a group needs at least one parameter name");
    if (!(weight_decay >= 0.0f) || isinf(weight_decay))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "optim_add_group: weight_decay = %g is not a finite value >= 0",
                         (double)weight_decay);
    if (!(lr_scale >= 0.0f) || isinf(lr_scale))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "optim_add_group: lr_scale = %g is not a finite value >= 0",
                         (double)lr_scale);
    for (int i = 0; i < n; i++) {
        if (!fqns[i]) return fsdp__err(ctx, FSDP_ERR_INVALID, "optim_add_group: name %d is NULL", i);
        for (int j = 0; j < i; j++)
            if (!strcmp(fqns[i], fqns[j]))
                return fsdp__err(ctx, FSDP_ERR_INVALID, "optim_add_group: '%s' is named twice", fqns[i]);
        if (fsdp__optim_group_of(opt, fqns[i]))
            return fsdp__err(ctx, FSDP_ERR_INVALID, "optim_add_group: '%s' is already in group %d", fqns[i],
                             fsdp__optim_group_of(opt, fqns[i]));
    }
    void *ng = fsdp__realloc(opt->groups, (size_t)(opt->n_groups + 2) * sizeof *opt->groups);
    if (!ng) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory adding an optimizer group");
    opt->groups = ng;
    struct optim_group *g = &opt->groups[opt->n_groups + 1];
    memset(g, 0, sizeof *g);
    g->fqns = fsdp__zalloc((size_t)n, sizeof *g->fqns);
    if (!g->fqns) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory adding an optimizer group");
    for (int i = 0; i < n; i++) {
        g->fqns[i] = fsdp__strdup(fqns[i]);
        if (!g->fqns[i]) {
            for (int j = 0; j < i; j++) free(g->fqns[j]);
            free(g->fqns);
            return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory adding an optimizer group");
        }
    }
    g->n = n;
    g->weight_decay = weight_decay;
    g->lr_scale = lr_scale;
    opt->n_groups++;
    return FSDP_OK;
}

int fsdp_optim_n_groups(const struct fsdp_optim *opt) { return opt->n_groups; }

static enum fsdp_status check_group(const struct fsdp_optim *opt, int group, const char *what) {
    if (group < 1 || group > opt->n_groups)
        return fsdp__err(opt->ctx, FSDP_ERR_INVALID, "%s: group %d does not exist (groups are 1..%d)", what, group,
                         opt->n_groups);
    return FSDP_OK;
}

enum fsdp_status fsdp_optim_group_get(const struct fsdp_optim *opt, int group,
                                      struct fsdp_optim_group_settings *out) {
    FSDP_TRY(check_group(opt, group, "optim_group_get"));
    const struct optim_group *g = &opt->groups[group];
    out->weight_decay = g->weight_decay;
    out->lr_scale = g->lr_scale;
    out->frozen = g->frozen;
    return FSDP_OK;
}

enum fsdp_status fsdp_optim_group_set(struct fsdp_optim *opt, int group,
                                      const struct fsdp_optim_group_settings *s) {
    FSDP_TRY(check_group(opt, group, "optim_group_set"));
    if (!(s->weight_decay >= 0.0f) || isinf(s->weight_decay))
        return fsdp__err(opt->ctx, FSDP_ERR_INVALID, "optim_group_set: group %d: weight_decay = %g is not a finite "
                         "value >= 0", group, (double)s->weight_decay);
    if (!(s->lr_scale >= 0.0f) || isinf(s->lr_scale))
        return fsdp__err(opt->ctx, FSDP_ERR_INVALID, "optim_group_set: group %d: lr_scale = %g is not a finite "
                         "value >= 0", group, (double)s->lr_scale);
    struct optim_group *g = &opt->groups[group];
    g->weight_decay = s->weight_decay;
    g->lr_scale = s->lr_scale;
    g->frozen = s->frozen != 0;
    return FSDP_OK;
}

int fsdp__optim_group_frozen(const struct fsdp_optim *opt, int group) {
    return group >= 1 && group <= opt->n_groups && opt->groups[group].frozen;
}

int fsdp__optim_group_of(const struct fsdp_optim *opt, const char *fqn) {
    for (int g = 1; g <= opt->n_groups; g++)
        for (int i = 0; i < opt->groups[g].n; i++)
            if (!strcmp(opt->groups[g].fqns[i], fqn)) return g;
    return 0;
}

const char *fsdp__optim_group_name(const struct fsdp_optim *opt, int group, int i) {
    if (group < 1 || group > opt->n_groups || i < 0 || i >= opt->groups[group].n) return NULL;
    return opt->groups[group].fqns[i];
}

int fsdp_optim_state_per_elem(const struct fsdp_optim *opt) {
    if (opt->opts.kind == FSDP_OPTIM_ADAMW) return 2;        /* m, v */
    return opt->opts.momentum > 0.0f ? 1 : 0;                /* momentum buffer */
}

int64_t fsdp_optim_step_count(const struct fsdp_optim *opt) { return opt->step; }

int fsdp__optim_decay_all(const struct fsdp_optim *opt) { return opt->opts.decay_all; }

const struct fsdp_optim_opts *fsdp__optim_opts(const struct fsdp_optim *opt) { return &opt->opts; }

void fsdp__optim_set_step_count(struct fsdp_optim *opt, int64_t step) {
    FSDP_ASSERT(step >= 0, "optimizer step count %lld < 0", (long long)step);
    opt->step = step;
}

/* ---- The update ----
 *
 * [Note: AdamW as torch]
 * torch.optim.AdamW (single-tensor path, torch 1.13) at step t, with g the
 * gradient after clipping:
 *     p  = p * (1 - lr*wd)                       decoupled decay, first
 *     m  = b1*m + (1-b1)*g                        stored
 *     v  = b2*v + (1-b2)*g*g                      stored
 *     p -= (lr / (1-b1^t)) * m / (sqrt(v)/sqrt(1-b2^t) + eps)
 * i.e. p -= lr * mhat / (sqrt(vhat) + eps). Each element is computed in
 * double from its fp32 values and rounded once per stored quantity; like
 * torch, the update uses m and v as stored (rounded to fp32). The gradient is
 * multiplied by grad_scale on the fly (torch scales p.grad in place in
 * clip_grad_norm_; we leave the grad buffer alone).
 *
 * [Note: SGD as torch]
 * torch.optim.SGD (dampening 0, no Nesterov): d = g + wd*p (coupled decay);
 * with momentum, buf = d on the first step, else buf = mu*buf + d, and d = buf;
 * then p -= lr*d. "First step" is this optimizer's step count being 1 after
 * the increment (torch: the buffer does not exist yet). With nesterov, the
 * update direction is d + mu*buf instead of buf (torch's nesterov=True).
 *
 * [Note: determinism]
 * Every element's new values depend only on that element's old values and on
 * per-step scalars computed once before the loops, and the loops contain no
 * reductions, so neither the OpenMP team size nor how the shard is cut into
 * slices changes any bit. (-std=c11 keeps GCC from contracting into FMAs,
 * and where it does contract it does so in scalar and vector code alike.)
 */

struct adamw_coef {
    double b1, b2, eps;
    double step_size;  /* lr / (1 - b1^t) */
    double bc2_sqrt;   /* sqrt(1 - b2^t) */
    double scale;      /* grad_scale */
};

/* [Note: fused 16-bit copy]
 * A slice with param_lp set also gets its updated parameters rounded to
 * 16 bits (the copy a 16-bit unit all-gathers, src/fsdp/mixed.c), and one
 * with sumsq set their sum of squares (the parameter norm). The update runs
 * in chunks of OPTIM_CHUNK elements, each rounded and squared right after
 * its update while it is still in L2: the copy costs its 2-byte writes and
 * the norm nothing, instead of later passes that read the 4-byte parameters
 * back from memory. Chunking changes nothing in the updated bits (every
 * update is elementwise); the rounding is dtype.c's, so the copy equals a
 * cast of the shard; the sum is fsdp__sumsq's (per chunk, then the chunks in
 * order), so it equals fsdp__sumsq of the updated slice for any thread count. */
#define OPTIM_CHUNK 8192

/* One chunk's sum of squares in double. One copy of the code (noinline,
 * noclone), so every caller gets the same vectorized grouping and bits. */
__attribute__((noinline, noclone)) static double chunk_sumsq(const float *x, int64_t n) {
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += (double)x[i] * (double)x[i];
    return s;
}

static int64_t n_chunks(int64_t n) { return (n + OPTIM_CHUNK - 1) / OPTIM_CHUNK; }
static int64_t chunk_end(int64_t k, int64_t nc, int64_t n) { return k + 1 < nc ? (k + 1) * OPTIM_CHUNK : n; }

double fsdp__sumsq(const float *x, int64_t n) {
    const int64_t nc = n_chunks(n);
    double *part = nc > 1 ? fsdp__malloc((size_t)nc * sizeof *part) : NULL, t = 0.0;
    if (!part) { /* serial: the same sums in the same order */
        for (int64_t k = 0; k < nc; k++) t += chunk_sumsq(x + k * OPTIM_CHUNK, chunk_end(k, nc, n) - k * OPTIM_CHUNK);
        return t;
    }
#pragma omp parallel for schedule(static) if (n >= OPTIM_PAR_MIN)
    for (int64_t k = 0; k < nc; k++) part[k] = chunk_sumsq(x + k * OPTIM_CHUNK, chunk_end(k, nc, n) - k * OPTIM_CHUNK);
    for (int64_t k = 0; k < nc; k++) t += part[k];
    free(part);
    return t;
}

/* An update of elements [a, b) of a slice, with its coefficients. */
typedef void (*update_fn)(const struct fsdp_optim_slice *s, const void *coef, int64_t a, int64_t b);

/* Runs `update` over the slice chunk by chunk (in parallel when long), each
 * chunk followed by its 16-bit copy and sum of squares (see the note). */
static void run_chunks(const struct fsdp_optim_slice *s, update_fn update, const void *coef) {
    const int64_t n = s->n, nc = n_chunks(n);
    /* plain malloc, not counted by the failure injection (core-impl.h): how
     * many slices a rank updates depends on its shard, so a counted block
     * here would shift the k-th allocation from rank to rank; and its
     * failure changes nothing but the time (the second pass below) */
    double *part = s->sumsq ? malloc((size_t)(nc ? nc : 1) * sizeof *part) : NULL;
#pragma omp parallel for schedule(static) if (n >= OPTIM_PAR_MIN)
    for (int64_t k = 0; k < nc; k++) {
        int64_t a = k * OPTIM_CHUNK, b = chunk_end(k, nc, n);
        update(s, coef, a, b);
        if (s->param_lp)
            fsdp__cvt_from_f32(s->lp_dtype, s->param + a, (uint16_t *)s->param_lp + a, (size_t)(b - a));
        if (part) part[k] = chunk_sumsq(s->param + a, b - a);
    }
    if (!s->sumsq) return;
    if (!part) { /* no memory for the partial sums: a second pass, same bits */
        *s->sumsq = fsdp__sumsq(s->param, n);
        return;
    }
    double t = 0.0;
    for (int64_t k = 0; k < nc; k++) t += part[k];
    free(part);
    *s->sumsq = t;
}

/* A frozen group's slice: nothing changes; run_chunks still writes its
 * 16-bit copy (the caller marks every unit's copy valid after a step) and
 * its sum of squares (the parameter norm). */
static void frozen_update(const struct fsdp_optim_slice *s, const void *coef, int64_t a, int64_t b) {
    (void)s, (void)coef, (void)a, (void)b;
}

struct adamw_args {
    const struct adamw_coef *c;
    double decay;
};

static void adamw_update(const struct fsdp_optim_slice *s, const void *coef, int64_t a, int64_t b) {
    const struct adamw_args *x = coef;
    float *p = s->param, *m = s->state, *v = s->state + s->state_stride;
    const float *g = s->grad;
    const double b1 = x->c->b1, b2 = x->c->b2, eps = x->c->eps, step_size = x->c->step_size;
    const double bc2_sqrt = x->c->bc2_sqrt, scale = x->c->scale, decay = x->decay;
    /* simd: vectorized IEEE double ops give the scalar loop's bits (no FMA
     * contraction in ISO C mode); about 2x faster with -fno-math-errno */
#pragma omp simd
    for (int64_t i = a; i < b; i++) {
        double gi = (double)g[i] * scale;
        float mf = (float)(b1 * (double)m[i] + (1.0 - b1) * gi);
        float vf = (float)(b2 * (double)v[i] + (1.0 - b2) * gi * gi);
        m[i] = mf;
        v[i] = vf;
        double pi = (double)p[i] * decay;
        pi -= step_size * (double)mf / (sqrt((double)vf) / bc2_sqrt + eps);
        p[i] = (float)pi;
    }
}

static void adamw_slice(const struct fsdp_optim_slice *s, const struct adamw_coef *c, double decay) {
    struct adamw_args x = {c, decay};
    run_chunks(s, adamw_update, &x);
}

struct sgd_args {
    double lr, wd, mu, scale;
    int first, nesterov;
};

static void sgd_update(const struct fsdp_optim_slice *s, const void *coef, int64_t a, int64_t b) {
    const struct sgd_args *x = coef;
    float *p = s->param, *buf = s->state;
    const float *g = s->grad;
    if (x->mu > 0.0) {
        for (int64_t i = a; i < b; i++) {
            double d = (double)g[i] * x->scale + x->wd * (double)p[i];
            float bf = x->first ? (float)d : (float)(x->mu * (double)buf[i] + d);
            buf[i] = bf;
            double u = x->nesterov ? d + x->mu * (double)bf : (double)bf;
            p[i] = (float)((double)p[i] - x->lr * u);
        }
    } else {
        for (int64_t i = a; i < b; i++) {
            double d = (double)g[i] * x->scale + x->wd * (double)p[i];
            p[i] = (float)((double)p[i] - x->lr * d);
        }
    }
}

static void sgd_slice(const struct fsdp_optim_slice *s, double lr, double wd, double mu,
                      int first, int nesterov, double scale) {
    struct sgd_args x = {lr, wd, mu, scale, first, nesterov};
    run_chunks(s, sgd_update, &x);
}

/* Slices are borrowed; their param and state arrays are updated in place,
 * grad arrays only read. A broken slice (NULL arrays where needed, n < 0, a
 * stride shorter than n with two states) is an invariant failure. */
void fsdp_optim_step(struct fsdp_optim *opt, const struct fsdp_optim_slice *slices, int n_slices,
                     float lr, float grad_scale) {
    FSDP_ASSERT(opt != NULL, "fsdp_optim_step: opt is NULL");
    FSDP_ASSERT(n_slices >= 0 && (n_slices == 0 || slices != NULL),
                "fsdp_optim_step: %d slices at %p", n_slices, (const void *)slices);
    if (fsdp__measuring) return; /* [Note: measure mode] (src/fsdp/plan.c) */
    const int k = fsdp_optim_state_per_elem(opt);
    for (int j = 0; j < n_slices; j++) {
        const struct fsdp_optim_slice *s = &slices[j];
        FSDP_ASSERT(s->n >= 0, "optim slice %d: n = %lld", j, (long long)s->n);
        if (s->n == 0) continue;
        FSDP_ASSERT(s->param && s->grad, "optim slice %d: NULL param or grad", j);
        FSDP_ASSERT(k == 0 || s->state, "optim slice %d: NULL state but %d state(s) per element", j, k);
        FSDP_ASSERT(!s->param_lp || s->lp_dtype == FSDP_BF16 || s->lp_dtype == FSDP_F16,
                    "optim slice %d: 16-bit copy of dtype %s", j, fsdp_dtype_name(s->lp_dtype));
        FSDP_ASSERT(s->decay >= 0 && s->decay <= 1 + opt->n_groups, "optim slice %d: decay %d with %d groups",
                    j, s->decay, opt->n_groups);
        FSDP_ASSERT(k < 2 || s->state_stride >= s->n,
                    "optim slice %d: state_stride %lld < n %lld", j, (long long)s->state_stride,
                    (long long)s->n);
    }

    opt->step++;
    const struct fsdp_optim_opts *o = &opt->opts;
    const double dlr = (double)lr, wd = (double)o->weight_decay, scale = (double)grad_scale;
    if (o->kind == FSDP_OPTIM_ADAMW) {
        struct adamw_coef c;
        const double t = (double)opt->step;
        c.b1 = (double)o->beta1;
        c.b2 = (double)o->beta2;
        c.eps = (double)o->eps;
        c.step_size = dlr / (1.0 - pow(c.b1, t));
        c.bc2_sqrt = sqrt(1.0 - pow(c.b2, t));
        c.scale = scale;
        const double decay = 1.0 - dlr * wd;
        for (int j = 0; j < n_slices; j++) {
            if (slices[j].n <= 0) continue;
            if (slices[j].decay > 1 && opt->groups[slices[j].decay - 1].frozen) {
                run_chunks(&slices[j], frozen_update, NULL);
            } else if (slices[j].decay > 1) { /* the group's lr and decay */
                const struct optim_group *g = &opt->groups[slices[j].decay - 1];
                struct adamw_coef cg = c;
                const double glr = dlr * (double)g->lr_scale;
                cg.step_size = glr / (1.0 - pow(c.b1, t));
                adamw_slice(&slices[j], &cg, 1.0 - glr * (double)g->weight_decay);
            } else {
                adamw_slice(&slices[j], &c, slices[j].decay ? decay : 1.0);
            }
        }
    } else {
        const int first = opt->step == 1;
        for (int j = 0; j < n_slices; j++) {
            if (slices[j].n <= 0) continue;
            if (slices[j].decay > 1 && opt->groups[slices[j].decay - 1].frozen) {
                run_chunks(&slices[j], frozen_update, NULL);
                continue;
            }
            double glr = dlr, gwd = wd;
            if (slices[j].decay > 1) {
                glr = dlr * (double)opt->groups[slices[j].decay - 1].lr_scale;
                gwd = (double)opt->groups[slices[j].decay - 1].weight_decay;
            }
            /* LARS: d = r (g scale + wd p) is SGD's step with scale r scale and decay r wd */
            const double r = slices[j].trust > 0.0f ? (double)slices[j].trust : 1.0;
            sgd_slice(&slices[j], glr, slices[j].decay ? gwd * r : 0.0, (double)o->momentum, first, o->nesterov,
                      scale * r);
        }
    }
}

/* ---- Clipping and schedules ---- */

/* As torch.nn.utils.clip_grad_norm_: max_norm / (norm + 1e-6), clamped to 1.
 * A NaN norm gives 1 (nothing to clip to; the caller checks finiteness). */
float fsdp_clip_scale(double norm, double max_norm) {
    if (max_norm > 0.0 && norm > max_norm) return (float)(max_norm / (norm + 1e-6));
    return 1.0f;
}

/* nanoGPT's get_lr: linear warmup lr*(step+1)/warmup for step < warmup; then
 * the peak (constant) or a cosine from lr down to min_lr reached at `total`
 * and held after it. A negative step counts as step 0; total <= warmup makes
 * the cosine end at once (min_lr after warmup). */
float fsdp_lr_at(const struct fsdp_lr_sched *s, int64_t step) {
    const double lr = (double)s->lr, min_lr = (double)s->min_lr;
    if (step < 0) step = 0;
    if (step < s->warmup) return (float)(lr * (double)(step + 1) / (double)s->warmup);
    if (s->kind == FSDP_LR_CONSTANT) return s->lr;
    double ratio = 1.0;
    if (s->total > s->warmup)
        ratio = (double)(step - s->warmup) / (double)(s->total - s->warmup);
    if (ratio > 1.0) ratio = 1.0;
    if (ratio < 0.0) ratio = 0.0;
    const double coeff = 0.5 * (1.0 + cos(M_PI * ratio));
    return (float)(min_lr + coeff * (lr - min_lr));
}
