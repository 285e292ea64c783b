/*
 * mixed.c - mixed precision for the sharded model: each unit's precision
 * policy (param / reduce / output / compute dtype, from the model-wide
 * precision and Composer's FULL / DEFAULT / PURE, or a unit's override), the
 * casts around the unit's all-gather and reduce-scatter (see [Note:
 * low-precision gather and reduce] in fsdp-impl.h), and dynamic loss
 * scaling for the train step (torch's GradScaler).
 * Invariant: shards, gradient shards and optimizer state are fp32 whatever
 * the policy; only what moves and what the layers multiply is 16-bit.
 */
#include "fsdp/fsdp-impl.h"

#include <ctype.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- Policy ---- */

static const char *mp_name(enum fsdp_mixed_precision mp) {
    return mp == FSDP_MP_DEFAULT ? "DEFAULT" : mp == FSDP_MP_PURE ? "PURE" : mp == FSDP_MP_FULL ? "FULL" : "?";
}

enum fsdp_status fsdp__mp_resolve(struct fsdp_ctx *ctx, struct fsdp_model *fm, enum fsdp_dtype precision,
                                  enum fsdp_mixed_precision mp) {
    int any_f16 = 0;
    for (int i = 0; i < fm->n_units; i++) { /* pre-order: parents set their subtree first */
        struct fsdp__unit *u = &fm->units[i];
        int ovr = (u->overrides.set & FSDP_OVR_MIXED_PRECISION) != 0;
        enum fsdp_mixed_precision m = ovr ? u->overrides.mixed_precision : mp;
        if (m != FSDP_MP_DEFAULT && m != FSDP_MP_PURE && m != FSDP_MP_FULL)
            return fsdp__err(ctx, FSDP_ERR_INVALID, "unit '%s': mixed_precision %d is not DEFAULT, PURE or FULL",
                             u->module->fqn[0] ? u->module->fqn : "(root)", (int)m);
        u->mixed_precision = m;
        u->param_dtype = u->reduce_dtype = u->output_dtype = u->compute_dtype = FSDP_F32;
        if (precision != FSDP_F32 && !(ovr && m == FSDP_MP_FULL)) {
            u->compute_dtype = precision;
            if (m != FSDP_MP_FULL) u->param_dtype = precision;
            if (m == FSDP_MP_PURE) u->reduce_dtype = precision;
        }
        any_f16 |= u->compute_dtype == FSDP_F16;
        FSDP_TRY(fsdp_module_set_compute_dtype(ctx, u->module, u->compute_dtype));
    }
    struct fsdp_loss_scale_opts lo = fsdp_loss_scale_opts_default();
    lo.enabled = any_f16;
    return fsdp_model_set_loss_scale(ctx, fm, &lo);
}

void fsdp_model_unit_precision(const struct fsdp_model *fm, int i, struct fsdp_unit_precision *out) {
    FSDP_ASSERT(i >= 0 && i < fm->n_units, "unit %d of %d", i, fm->n_units);
    const struct fsdp__unit *u = &fm->units[i];
    out->param_dtype = u->param_dtype;
    out->reduce_dtype = u->reduce_dtype;
    out->output_dtype = u->output_dtype;
    out->compute_dtype = u->compute_dtype;
    out->mixed_precision = u->mixed_precision;
}

enum fsdp_status fsdp_precision_parse(struct fsdp_ctx *ctx, const char *name, enum fsdp_dtype *out) {
    static const struct {
        const char *name;
        enum fsdp_dtype dt;
    } names[] = {{"FP32", FSDP_F32}, {"AMP_BF16", FSDP_BF16}, {"AMP_FP16", FSDP_F16}};
    char up[16];
    size_t n = name ? strlen(name) : 0;
    if (name && n < sizeof up) {
        for (size_t i = 0; i <= n; i++) up[i] = (char)toupper((unsigned char)name[i]);
        for (size_t k = 0; k < sizeof names / sizeof names[0]; k++)
            if (!strcmp(up, names[k].name)) {
                *out = names[k].dt;
                return FSDP_OK;
            }
    }
    return fsdp__err(ctx, FSDP_ERR_INVALID, "precision '%s' is not one of FP32, AMP_BF16, AMP_FP16",
                     name ? name : "(null)");
}

/* ---- Casts around the collectives ---- */

/* Bytes [2n, 4n) of a buffer of n floats: its upper half as 16-bit elements. */
static uint16_t *upper_half(float *buf, int64_t n) { return (uint16_t *)(void *)buf + n; }

/* Below this many elements the in-place narrowing and widening run sequentially. */
#define INPLACE_SEQ 4096

/* Narrows buf[0..n) to 16-bit values at bytes [0, 2n), in place. Pass
 * [a, b) writes bytes [2a, 2b) and reads [4a, 4b): safe while b <= 2a. */
void fsdp__mp_narrow_inplace(enum fsdp_dtype dt, float *buf, int64_t n) {
    if (fsdp__measuring) return;
    uint16_t *dst = (uint16_t *)(void *)buf;
    int64_t head = n < INPLACE_SEQ ? n : INPLACE_SEQ;
    for (int64_t i = 0; i < head; i++) /* sequential: each read before its write */
        dst[i] = dt == FSDP_BF16 ? fsdp__f32_to_bf16(buf[i]) : fsdp__f32_to_f16(buf[i]);
    for (int64_t a = head; a < n;) {
        int64_t b = 2 * a < n ? 2 * a : n;
        fsdp__cvt_from_f32(dt, buf + a, dst + a, (size_t)(b - a));
        a = b;
    }
}

/* Narrows rows x cols floats in place to 16-bit rows that start every ld
 * elements (cols <= ld <= 2 cols): row r's values move from bytes 4 cols r to
 * 2 ld r, never to a higher address than they are read from. Rows [a, b) in
 * parallel write bytes [2 ld a, 2 ld b) and read [4 cols a, 4 cols b): safe
 * while ld b <= 2 cols a; before that, row by row (in element order, so
 * each 16-value read comes before the writes that reach it). ld == cols
 * is the flat narrowing of rows * cols values. */
void fsdp__mp_narrow_rows_inplace(enum fsdp_dtype dt, float *buf, int64_t rows, int64_t cols, int64_t ld) {
    FSDP_ASSERT(cols > 0 && cols <= ld && ld <= 2 * cols, "narrow rows: %lld columns at a stride of %lld",
                (long long)cols, (long long)ld);
    if (ld == cols) {
        fsdp__mp_narrow_inplace(dt, buf, rows * cols);
        return;
    }
    if (fsdp__measuring) return;
    uint16_t *dst = (uint16_t *)(void *)buf;
    for (int64_t a = 0; a < rows;) {
        int64_t b = 2 * cols * a / ld;
        if (b > rows) b = rows;
        if (b <= a + 1) { /* one row, its values in order */
            for (int64_t j = 0; j < cols; j += 16) {
                int64_t n = cols - j < 16 ? cols - j : 16;
                float v[16];
                memcpy(v, buf + a * cols + j, (size_t)n * sizeof(float));
                fsdp__cvt_from_f32(dt, v, dst + a * ld + j, (size_t)n);
            }
            a++;
            continue;
        }
#pragma omp parallel for schedule(static)
        for (int64_t r = a; r < b; r++) fsdp__cvt_from_f32(dt, buf + r * cols, dst + r * ld, (size_t)cols);
        a = b;
    }
}

/* Env FSDP_CHECK_LP_COPY=1 (the test suite sets it): every gather from a
 * valid 16-bit copy first checks it against a fresh cast of the shard, so a
 * writer of the shard that forgot fsdp__model_shards_written fails loudly. */
static void check_lp_copy(const struct fsdp__unit *u) {
    static int on = -1;
    if (on < 0) on = (int)fsdp__env_checked("FSDP_CHECK_LP_COPY", 0);
    if (!on || fsdp__measuring) return;
    for (int64_t i = 0; i < u->numel_shard; i++) {
        float x = u->shard[i];
        uint16_t want = u->param_dtype == FSDP_BF16 ? fsdp__f32_to_bf16(x) : fsdp__f32_to_f16(x);
        FSDP_ASSERT(u->shard_lp[i] == want,
                    "unit '%s': the 16-bit copy of its shard is stale at element %lld (0x%04x, the shard's "
                    "%g casts to 0x%04x): a writer of the shard did not call fsdp__model_shards_written",
                    u->module->fqn[0] ? u->module->fqn : "(root)", (long long)i, u->shard_lp[i], (double)x,
                    want);
    }
}

enum fsdp_status fsdp__mp_gather_start(struct fsdp_comm *comm, int rank, struct fsdp__unit *u,
                                       struct fsdp_comm_req **req) {
    FSDP_ASSERT(u->param_dtype == FSDP_BF16 || u->param_dtype == FSDP_F16, "unit %d: param dtype %s", u->index,
                fsdp_dtype_name(u->param_dtype));
    uint16_t *stage = (uint16_t *)(void *)(u->full + u->full_f32); /* after the fp32 values */
    uint16_t *mine = stage + (int64_t)rank * u->numel_shard;
    int alone = !comm || fsdp_comm_size(comm) == 1;
    *req = NULL;
    u->lp_direct = 0;
    if (u->shard_lp_valid) check_lp_copy(u); /* the optimizer's copy ([Note: fused 16-bit copy]): no cast */
    if ((alone || u->lp_win) && u->shard_lp) {
        /* the copy is (its block of) the whole gathered buffer: read in place, cast there first if stale */
        if (!u->shard_lp_valid) fsdp__cvt_from_f32(u->param_dtype, u->shard, u->shard_lp, (size_t)u->numel_shard);
        u->shard_lp_valid = 1;
        u->lp_direct = 1;
        /* [Note: 16-bit window] (unit.c): every rank's block written before any peer reads it */
        return u->lp_win ? fsdp_comm_barrier_start(comm, req) : FSDP_OK;
    }
    if (alone) return FSDP_OK; /* [Note: 16-bit values from the shard]: nothing to cast or move */
    if (u->shard_lp_valid)
        return fsdp_comm_allgather_start(comm, u->shard_lp, stage, (size_t)u->numel_shard, u->param_dtype, req);
    fsdp__cvt_from_f32(u->param_dtype, u->shard, mine, (size_t)u->numel_shard);
    return fsdp_comm_allgather_start(comm, mine, stage, (size_t)u->numel_shard, u->param_dtype, req);
}

int64_t fsdp__mp_f32_numel(const struct fsdp__unit *u, int lazy) {
    if (!lazy) return u->numel_padded;
    int64_t n = 0;
    for (int j = 0; j < u->n_params; j++)
        if (!u->params[j]->priv->lp_reader) n += u->params[j]->numel;
    return n;
}

int64_t fsdp__mp_full_numel(const struct fsdp__unit *u) {
    /* a group of one reads shard_lp in place, or the shard itself ([Note: 16-bit values from the shard]), and
     * so does a training pass's gather from the 16-bit window ([Note: 16-bit window] in unit.c) */
    int staged = u->param_dtype != FSDP_F32 && !u->lp_win && u->model->shard_size > 1;
    return u->full_f32 + (staged ? (u->numel_padded + 1) / 2 : 0);
}

/* [Note: 16-bit values from the shard] A shard group of one holds every
 * parameter's fp32 values in its shard, so its "gather" in 16 bits would
 * only cast the shard into a pooled copy, which then lives beside the fp32
 * values while the unit is gathered: GPT-2's root unit (the tied wte, 74 MiB
 * in bf16) from the embedding's forward to the end of backward, through the
 * step's peak. Instead (unless the unit keeps shard_lp) nothing is cast: a
 * training pass points each lp_reader parameter at its fp32 values in the
 * shard (data_src, with data NULL and data_stale), and its layer rounds the
 * rows it reads when it reads them (fsdp__prows, src/nn/precision.c: the
 * lm_head's weight a block of rows at a time, [Note: weight rows by block]
 * in linear.c; the embedding the rows it looks up); the other parameters are
 * rounded into the pooled buffer's fp32 part, and an eager gather rounds the
 * whole shard there. Every value is the rounding the cast would have made,
 * so training is bit-identical with the pooled copy; a world of one keeps
 * the pass's 16-bit values only a block at a time (the plan's full buffers
 * at one rank: 88.7 MiB to 0.04 for GPT-2 in bf16). */
/* whether u's 16-bit gather leaves the values in the shard (the note above) */
static int from_shard(const struct fsdp__unit *u) { return u->model->shard_size == 1 && !u->shard_lp; }

void fsdp__mp_finish_from(struct fsdp__unit *u, const float *src) {
    int lazy = u->gather_lazy;
    if (!lazy) fsdp__cvt_round(u->param_dtype, src, u->full, (size_t)u->numel_padded);
    int64_t at = 0;
    for (int j = 0; j < u->n_params; j++) {
        struct fsdp_param *p = u->params[j];
        p->priv->data_lp = NULL;
        p->priv->data_lp_dtype = u->param_dtype;
        p->priv->data_stale = lazy && p->priv->lp_reader;
        p->priv->data_src = p->priv->data_stale ? src + u->offsets[j] : NULL;
        if (!lazy) {
            p->data = u->full + u->offsets[j];
        } else if (p->priv->lp_reader) {
            p->data = NULL;
        } else {
            p->data = u->full + at;
            fsdp__cvt_round(u->param_dtype, src + u->offsets[j], p->data, (size_t)p->numel);
            at += p->numel;
        }
    }
    FSDP_ASSERT(!lazy || at == u->full_f32, "unit %d: %lld fp32 values rounded, %lld sized", u->index,
                (long long)at, (long long)u->full_f32);
}

void fsdp__mp_gather_finish(struct fsdp__unit *u) {
    if (from_shard(u)) {
        fsdp__mp_finish_from(u, u->shard);
        return;
    }
    const uint16_t *stage = u->lp_win      ? u->win_lp
                            : u->lp_direct ? u->shard_lp
                                           : (const uint16_t *)(const void *)(u->full + u->full_f32);
    int lazy = u->gather_lazy;
    if (!lazy) fsdp__cvt_to_f32(u->param_dtype, stage, u->full, (size_t)u->numel_padded);
    int64_t at = 0; /* a lazy gather's fp32 part: the eagerly widened parameters, end to end */
    for (int j = 0; j < u->n_params; j++) { /* the layers' 16-bit weights (fsdp__pdata_lp) */
        struct fsdp_param *p = u->params[j];
        p->priv->data_lp = stage + u->offsets[j];
        p->priv->data_lp_dtype = u->param_dtype;
        p->priv->data_src = NULL;
        p->priv->data_stale = lazy && p->priv->lp_reader; /* [Note: lazy widening] (src/nn/precision.c) */
        if (!lazy) {
            p->data = u->full + u->offsets[j];
        } else if (p->priv->lp_reader) {
            p->data = NULL; /* no fp32 values exist: the layers read data_lp */
        } else {
            p->data = u->full + at;
            fsdp__cvt_to_f32(u->param_dtype, p->priv->data_lp, p->data, (size_t)p->numel);
            at += p->numel;
        }
    }
    FSDP_ASSERT(!lazy || at == u->full_f32, "unit %d: %lld fp32 values widened, %lld sized", u->index,
                (long long)at, (long long)u->full_f32);
}

int fsdp__mp_predivide(enum fsdp_dtype reduce_dtype, int world) {
    int f = 1;
    if (reduce_dtype == FSDP_F32) return 1;
    while (world % f == 0 && world > f * f) f *= 2; /* torch FSDP's factor */
    return f;
}

void *fsdp__mp_grad_send(struct fsdp__unit *u, int world) {
    if (u->reduce_dtype == FSDP_F32 || u->full_grad == u->grad_shard || fsdp__measuring) return u->full_grad;
    int f = fsdp__mp_predivide(u->reduce_dtype, world);
    if (f > 1) { /* a power of two: exact in fp32 */
        float inv = 1.0f / (float)f, *g = u->full_grad;
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < u->numel_padded; i++) g[i] *= inv;
    }
    fsdp__mp_narrow_inplace(u->reduce_dtype, u->full_grad, u->numel_padded);
    return u->full_grad;
}

/* Widens the 16-bit values at bytes [2n, 4n) of buf (its upper half) into
 * buf[0..n), in place. Pass [a, b) reads bytes [2n + 2a, 2n + 2b) and writes
 * [4a, 4b): safe while 4b <= 2n + 2a, so each pass takes half of what is
 * left; the last INPLACE_SEQ elements go one by one, each read before its
 * write (element i's write ends at byte 4i + 4 <= 2n + 2i + 2). */
static void widen_inplace(enum fsdp_dtype dt, float *buf, int64_t n) {
    const uint16_t *src = upper_half(buf, n);
    int64_t a = 0;
    while (n - a > INPLACE_SEQ) {
        int64_t b = (n + a) / 2;
        fsdp__cvt_to_f32(dt, src + a, buf + a, (size_t)(b - a));
        a = b;
    }
    for (int64_t i = a; i < n; i++) /* sequential */
        buf[i] = dt == FSDP_BF16 ? fsdp__bf16_to_f32(src[i]) : fsdp__f16_to_f32(src[i]);
}

void *fsdp__mp_grad_recv(struct fsdp__unit *u) {
    if (u->reduce_dtype == FSDP_F32 || u->full_grad == u->grad_shard) return u->grad_shard;
    return upper_half(u->grad_shard, u->numel_shard);
}

void fsdp__mp_grad_land(struct fsdp__unit *u, const void *recv) {
    if (u->reduce_dtype == FSDP_F32 || fsdp__measuring) return;
    float *g = u->grad_shard;
    if (recv == g) { /* a world of one: round the gradient as a reduction would */
        int bf = u->reduce_dtype == FSDP_BF16;
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < u->numel_shard; i++)
            g[i] = bf ? fsdp__bf16_to_f32(fsdp__f32_to_bf16(g[i])) : fsdp__f16_to_f32(fsdp__f32_to_f16(g[i]));
        return;
    }
    if (recv == upper_half(g, u->numel_shard)) widen_inplace(u->reduce_dtype, g, u->numel_shard);
    else fsdp__cvt_to_f32(u->reduce_dtype, recv, g, (size_t)u->numel_shard); /* a shard group of one */
}

/* ---- Loss scaling ---- */

struct fsdp_loss_scale_opts fsdp_loss_scale_opts_default(void) {
    struct fsdp_loss_scale_opts o;
    memset(&o, 0, sizeof o);
    o.init_scale = 65536.0;
    o.growth_factor = 2.0;
    o.backoff_factor = 0.5;
    o.growth_interval = 2000;
    o.inject_step = fsdp__env_checked("FSDP_INJECT_OVERFLOW_STEP", -1);
    o.inject_rank = (int)fsdp__env_checked("FSDP_INJECT_OVERFLOW_RANK", 0);
    return o;
}

enum fsdp_status fsdp_model_set_loss_scale(struct fsdp_ctx *ctx, struct fsdp_model *fm,
                                           const struct fsdp_loss_scale_opts *opts) {
    const struct fsdp_loss_scale_opts *o = opts;
    if (!(isfinite(o->init_scale) && o->init_scale > 0))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "loss scaling: init_scale %g must be positive", o->init_scale);
    if (!(isfinite(o->growth_factor) && o->growth_factor >= 1))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "loss scaling: growth_factor %g must be >= 1", o->growth_factor);
    if (!(isfinite(o->backoff_factor) && o->backoff_factor > 0 && o->backoff_factor < 1))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "loss scaling: backoff_factor %g must be in (0, 1)",
                         o->backoff_factor);
    if (o->growth_interval < 1)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "loss scaling: growth_interval %lld must be >= 1",
                         (long long)o->growth_interval);
    memset(&fm->scaler, 0, sizeof fm->scaler);
    fm->scaler.opts = *o;
    fm->scaler.scale = o->init_scale;
    return FSDP_OK;
}

double fsdp_model_loss_scale(const struct fsdp_model *fm) { return fsdp__scaler_scale(fm); }

int64_t fsdp_model_skipped_steps(const struct fsdp_model *fm) { return fm->scaler.skipped; }

float fsdp__scaler_scale(const struct fsdp_model *fm) {
    return fm->scaler.opts.enabled ? (float)fm->scaler.scale : 1.0f;
}

void fsdp__scaler_inject(struct fsdp_ctx *ctx, struct fsdp_model *fm) {
    const struct fsdp__scaler *sc = &fm->scaler;
    if (sc->scale == 0 || sc->opts.inject_step < 0 || sc->calls != sc->opts.inject_step) return;
    if (ctx->rank != sc->opts.inject_rank) return;
    for (int i = 0; i < fm->n_units; i++)
        if (fm->units[i].numel_shard > 0 && fm->units[i].grad_shard) {
            fm->units[i].grad_shard[0] = INFINITY;
            return;
        }
}

int fsdp__scaler_update(struct fsdp_model *fm, double loss, double *gnorm, float *unscale) {
    struct fsdp__scaler *sc = &fm->scaler;
    sc->calls++;
    *unscale = 1.0f;
    if (!sc->opts.enabled) return 0;
    if (!isfinite(loss) || !isfinite(*gnorm)) {
        sc->skipped++;
        sc->clean = 0;
        sc->scale *= sc->opts.backoff_factor;
        return 1;
    }
    *gnorm /= sc->scale;
    *unscale = (float)(1.0 / sc->scale);
    if (++sc->clean >= sc->opts.growth_interval) {
        sc->scale *= sc->opts.growth_factor;
        sc->clean = 0;
    }
    return 0;
}

const char *fsdp__mp_name(enum fsdp_mixed_precision mp) { return mp_name(mp); }
