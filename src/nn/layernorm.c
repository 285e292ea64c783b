/*
 * layernorm.c - LayerNorm over the last dimension C (eps 1e-5, as PyTorch):
 * y = (x - mean) * rstd * weight + bias, per row of x (N, C). Saves x, the
 * row means and the reciprocal standard deviations (arena) for backward.
 * Writes y in 16 bits when asked ([Note: 16-bit hand-off]): each row is
 * computed in fp32 as always, then rounded. Into a buffer lent for it, the
 * output can be written there again later, the same bits ([Note: LayerNorm
 * outputs rebuilt], block.c).
 */
#include "nn/nn-impl.h"

#include <math.h>
#include <omp.h>

#define LN_EPS 1e-5f

struct layernorm {
    int64_t dim;
    struct fsdp_param *weight, *bias; /* (C) each */
    const float *x;                   /* (N, C) saved input, borrowed from the arena */
    float *mean, *rstd;               /* (N) each, in the arena */
    int64_t n;
    void *into;                       /* (N, C) lent for the next forward's output, or NULL */
    void *lent;                       /* (N, C) in odt: the last forward's output where it was
                                         lent, else NULL */
    enum fsdp_dtype odt;              /* the last forward's output dtype */
};

/* Row i of y (N, C) = (x_i - mu) * r * w + b, in dt: fp32 in place, 16-bit
 * through the calling thread's fp32 row of rows (a row per thread). Forward
 * and fsdp__layernorm_rebuild write their rows with this one loop, so a
 * rebuilt output is the forward's bits. */
static void write_row(const float *xi, float mu, float r, const float *w, const float *b, float *rows,
                      enum fsdp_dtype dt, void *y, int64_t i, int64_t C) {
    float *yi = rows ? rows + (int64_t)omp_get_thread_num() * C : (float *)y + i * C;
#pragma omp simd
    for (int64_t c = 0; c < C; c++) yi[c] = (xi[c] - mu) * r * w[c] + b[c];
    if (rows) fsdp__cvt_from_f32(dt, yi, (uint16_t *)y + i * C, (size_t)C);
}

/* write_row's rows for an output in dt (arena scratch), NULL for fp32 */
static float *thread_rows(struct fsdp_ctx *ctx, enum fsdp_dtype dt, int64_t C) {
    return dt == FSDP_F32 ? NULL : fsdp__scratch(ctx, (int64_t)omp_get_max_threads() * C, "LayerNorm rows");
}

static enum fsdp_status layernorm_forward(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                          const struct fsdp_tensor *in, struct fsdp_tensor *out) {
    struct layernorm *L = m->impl;
    void *into = L->into; /* taken first: a forward that fails leaves no lent buffer behind */
    L->into = L->lent = NULL;
    FSDP_TRY(fsdp__check_input(ctx, m, in, FSDP_F32, 0, L->dim));
    FSDP_TRY(fsdp__param_ready(ctx, L->weight, 0));
    FSDP_TRY(fsdp__param_ready(ctx, L->bias, 0));
    int64_t C = L->dim, N = fsdp_tensor_numel(in) / C;
    float *mean = fsdp__scratch(ctx, 2 * N, "LayerNorm statistics");
    if (!mean) return FSDP_ERR_NOMEM;
    enum fsdp_dtype odt = fsdp__wanted_dtype(out);
    if (into) out->data = into; /* the lender sized it */
    FSDP_TRY(fsdp__tensor_prepare(ctx, out, odt, in->ndim, in->shape, "LayerNorm output"));
    size_t mark = fsdp_arena_mark(ctx);
    float *rows = thread_rows(ctx, odt, C);
    if (odt != FSDP_F32 && !rows) return FSDP_ERR_NOMEM;
    float *rstd = mean + N;
    const float *x = in->data, *w = fsdp__pdata(L->weight), *b = fsdp__pdata(L->bias);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < (fsdp__measuring ? 0 : N); i++) {
        const float *xi = x + i * C;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t c = 0; c < C; c++) s += xi[c];
        float mu = s / (float)C, v = 0.0f;
#pragma omp simd reduction(+ : v)
        for (int64_t c = 0; c < C; c++) v += (xi[c] - mu) * (xi[c] - mu);
        float r = 1.0f / sqrtf(v / (float)C + LN_EPS);
        write_row(xi, mu, r, w, b, rows, odt, out->data, i, C);
        mean[i] = mu;
        rstd[i] = r;
    }
    fsdp_arena_release(ctx, mark);
    L->x = x;
    L->mean = mean;
    L->rstd = rstd;
    L->n = N;
    L->odt = odt;
    L->lent = into;
    return FSDP_OK;
}

void fsdp__layernorm_write_into(struct fsdp_module *m, void *y) { ((struct layernorm *)m->impl)->into = y; }

enum fsdp_status fsdp__layernorm_rebuild(struct fsdp_module *m, struct fsdp_ctx *ctx) {
    struct layernorm *L = m->impl;
    if (!L->lent) return FSDP_OK;
    FSDP_TRY(fsdp__param_ready(ctx, L->weight, 0));
    FSDP_TRY(fsdp__param_ready(ctx, L->bias, 0));
    int64_t C = L->dim, N = L->n;
    size_t mark = fsdp_arena_mark(ctx);
    float *rows = thread_rows(ctx, L->odt, C);
    if (L->odt != FSDP_F32 && !rows) return FSDP_ERR_NOMEM;
    const float *x = L->x, *mean = L->mean, *rstd = L->rstd, *w = fsdp__pdata(L->weight), *b = fsdp__pdata(L->bias);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < (fsdp__measuring ? 0 : N); i++)
        write_row(x + i * C, mean[i], rstd[i], w, b, rows, L->odt, L->lent, i, C);
    fsdp_arena_release(ctx, mark);
    return FSDP_OK;
}

/* dbias += sum_i dy; dweight += sum_i dy * xhat; dx = rstd * (dxhat - mean(dxhat)
 * - xhat * mean(dxhat * xhat)) with dxhat = dy * weight and xhat the normalised x. */
static enum fsdp_status layernorm_backward(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                           const struct fsdp_tensor *dout, struct fsdp_tensor *din) {
    struct layernorm *L = m->impl;
    if (!L->x)
        return fsdp__err(ctx, FSDP_ERR_STATE, "LayerNorm '%s': backward without forward", fsdp__mname(m));
    FSDP_TRY(fsdp__check_input(ctx, m, dout, FSDP_F32, 0, L->dim));
    if (fsdp_tensor_numel(dout) != L->n * L->dim)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "LayerNorm '%s': gradient has %lld rows, forward had %lld",
                         fsdp__mname(m), (long long)(fsdp_tensor_numel(dout) / L->dim), (long long)L->n);
    FSDP_TRY(fsdp__param_ready(ctx, L->weight, 1));
    FSDP_TRY(fsdp__param_ready(ctx, L->bias, 1));
    int64_t C = L->dim, N = L->n, nch = fsdp__colsum_chunks(N);
    const float *x = L->x, *mean = L->mean, *rstd = L->rstd, *dy = dout->data;
    const float *w = fsdp__pdata(L->weight);
    float *dw = fsdp__pgrad(L->weight), *db = fsdp__pgrad(L->bias);
    if (din) FSDP_TRY(fsdp__tensor_prepare(ctx, din, FSDP_F32, dout->ndim, dout->shape, "LayerNorm input gradient"));
    float *dx = din ? din->data : NULL; /* (N, C); may equal dy */
    /* one pass over the rows in chunks ([Note: column sums in row chunks],
     * gemm.c): each row's parameter-gradient terms into its chunk's partial
     * sums (dweight's, then dbias's), then its input gradient written over
     * what it read (dx may be dy: each element is read before it is written) */
    size_t mark = fsdp_arena_mark(ctx);
    float *part = fsdp__scratch(ctx, 2 * nch * C, "LayerNorm parameter gradients (partial)");
    if (!part) return FSDP_ERR_NOMEM;
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < (fsdp__measuring ? 0 : nch); k++) {
        float *pw = part + k * C, *pb = part + (nch + k) * C;
        memset(pw, 0, (size_t)C * sizeof(float));
        memset(pb, 0, (size_t)C * sizeof(float));
        for (int64_t i = k * COLSUM_ROWS; i < fsdp__colsum_chunk_end(k, N); i++) {
            const float *xi = x + i * C, *gi = dy + i * C;
            float mu = mean[i], r = rstd[i], s1 = 0.0f, s2 = 0.0f;
#pragma omp simd reduction(+ : s1, s2)
            for (int64_t c = 0; c < C; c++) {
                float g = gi[c] * w[c];
                pw[c] += gi[c] * (xi[c] - mu) * r;
                pb[c] += gi[c];
                s1 += g;
                s2 += g * (xi[c] - mu) * r;
            }
            if (!dx) continue;
            float *dxi = dx + i * C;
            s1 /= (float)C;
            s2 /= (float)C;
#pragma omp simd
            for (int64_t c = 0; c < C; c++) dxi[c] = r * (gi[c] * w[c] - s1 - (xi[c] - mu) * r * s2);
        }
    }
    fsdp__colsum_chunks_add(part, nch, C, dw);
    fsdp__colsum_chunks_add(part + nch * C, nch, C, db);
    fsdp_arena_release(ctx, mark);
    return FSDP_OK;
}

static void layernorm_destroy(struct fsdp_module *m) { free(m->impl); }

static const struct fsdp_module_ops layernorm_ops = {"LayerNorm", layernorm_forward, layernorm_backward,
                                                     layernorm_destroy};

enum fsdp_status fsdp__layernorm_create(struct fsdp_ctx *ctx, const char *name, int64_t dim,
                                        struct fsdp_module **out_m) {
    if (dim <= 0)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "LayerNorm '%s': size %lld must be positive", name, (long long)dim);
    struct fsdp_module *m;
    FSDP_TRY(fsdp_module_create(ctx, &layernorm_ops, name, &m));
    struct layernorm *L = fsdp__zalloc(1, sizeof *L);
    if (!L) {
        fsdp_module_free(m);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory creating LayerNorm '%s'", name);
    }
    m->impl = L;
    L->dim = dim;
    int64_t shape[1] = {dim};
    enum fsdp_status st = fsdp_module_add_param(ctx, m, "weight", 1, shape,
                                                (struct fsdp_init){FSDP_INIT_ONES, 0.0f}, 1, &L->weight);
    if (st == FSDP_OK)
        st = fsdp_module_add_param(ctx, m, "bias", 1, shape, (struct fsdp_init){FSDP_INIT_ZEROS, 0.0f}, 1,
                                   &L->bias);
    if (st != FSDP_OK) {
        fsdp_module_free(m);
        return st;
    }
    L->weight->priv->grad_writer = L->bias->priv->grad_writer = 1; /* [Note: unset gradients] */
    *out_m = m;
    return FSDP_OK;
}
