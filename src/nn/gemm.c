/*
 * gemm.c - the GEMM wrapper over oneDNN's dnnl_sgemm, and the small helpers
 * every layer shares (parameter readiness, output tensors, arena scratch).
 * src/nn is the only place that calls the GEMM library, and every matrix
 * product of the layers goes through fsdp__sgemm.
 * oneDNN's sgemm is row-major and uses OpenMP: called inside a parallel
 * region it runs on the calling thread only (attention uses that for its
 * per-(batch, head) products).
 * Custom modules reach the same products through the public fsdp_gemm (at
 * the end), which takes the module's compute dtype as Linear does, and
 * report their failures with fsdp_error.
 */
#include "nn/nn-impl.h"

#include <omp.h>
#include <stdarg.h>
#include <stdio.h>
#include <oneapi/dnnl/dnnl.h>

void fsdp__sgemm(int transa, int transb, int64_t M, int64_t N, int64_t K, float alpha,
                 const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C,
                 int64_t ldc) {
    if (M <= 0 || N <= 0 || fsdp__measuring) return;
    if (K <= 0) { /* no products: C = beta * C */
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
        return;
    }
    dnnl_status_t st = dnnl_sgemm(transa ? 'T' : 'N', transb ? 'T' : 'N', M, N, K, alpha, A, lda, B,
                                  ldb, beta, C, ldc);
    FSDP_ASSERT(st == dnnl_success, "dnnl_sgemm(%c%c, M=%lld N=%lld K=%lld, lda=%lld ldb=%lld ldc=%lld) "
                "failed with status %d", transa ? 'T' : 'N', transb ? 'T' : 'N', (long long)M,
                (long long)N, (long long)K, (long long)lda, (long long)ldb, (long long)ldc, (int)st);
}

enum fsdp_status fsdp__adopt(struct fsdp_ctx *ctx, struct fsdp_module *parent, enum fsdp_status st,
                             struct fsdp_module **child, struct fsdp_module **slot) {
    FSDP_TRY(st);
    st = fsdp_module_add_child(ctx, parent, *child);
    if (st != FSDP_OK) {
        fsdp_module_free(*child);
        return st;
    }
    if (slot) *slot = *child;
    return FSDP_OK;
}

const char *fsdp__mname(const struct fsdp_module *m) {
    if (!m->fqn) return m->name;
    return m->fqn[0] ? m->fqn : "(root)";
}

/* [Note: column sums in row chunks] A column sum over the rows of a row-major
 * (rows, cols) matrix (a bias gradient, LayerNorm's parameter gradients) is
 * summed per chunk of COLSUM_ROWS rows, each chunk's sums in row order from
 * zero into its own row of partial sums, and then the chunks' partials in
 * chunk order, added to the gradient. Threads take whole chunks, so every
 * thread streams whole rows (one pass, each row read once and while in
 * cache for whatever else the pass does with it), and the order of every
 * sum is fixed by the shape alone: the same bits whatever the team size.
 * Splitting the columns between the threads instead (each thread half of
 * every row) ran at half the rate: a 1024 x 3072 sum with its 16-bit copy
 * took 0.96 ms against 0.49 with the rows chunked (2 threads, operand from
 * memory; bench/README.md, 2026-12-05). The partials are nch x cols floats
 * of arena scratch (GPT-2's c_fc: 32 x 3072). */
int64_t fsdp__colsum_chunks(int64_t rows) { return (rows + COLSUM_ROWS - 1) / COLSUM_ROWS; }

void fsdp__colsum_chunks_add(const float *part, int64_t nch, int64_t cols, float *db) {
#pragma omp parallel for schedule(static)
    for (int64_t c0 = 0; c0 < (fsdp__measuring ? 0 : cols); c0 += 256) { /* 1 KiB column blocks */
        int64_t c1 = c0 + 256 < cols ? c0 + 256 : cols;
        float acc[256] = {0};
        for (int64_t k = 0; k < nch; k++) {
            const float *pk = part + k * cols;
#pragma omp simd
            for (int64_t c = c0; c < c1; c++) acc[c - c0] += pk[c];
        }
        for (int64_t c = c0; c < c1; c++) db[c] += acc[c - c0];
    }
}

enum fsdp_status fsdp__colsum_add(struct fsdp_ctx *ctx, const float *x, int64_t rows, int64_t cols, float *db,
                                  enum fsdp_dtype dt, void *xl) {
    size_t es = xl ? fsdp_dtype_size(dt) : 0, mark = fsdp_arena_mark(ctx);
    int64_t nch = fsdp__colsum_chunks(rows);
    float *part = fsdp__scratch(ctx, nch * cols, "column sums (partial)");
    if (!part) return FSDP_ERR_NOMEM;
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < (fsdp__measuring ? 0 : nch); k++) {
        float *pk = part + k * cols;
        memset(pk, 0, (size_t)cols * sizeof(float));
        for (int64_t i = k * COLSUM_ROWS; i < fsdp__colsum_chunk_end(k, rows); i++) {
            const float *row = x + i * cols;
#pragma omp simd
            for (int64_t c = 0; c < cols; c++) pk[c] += row[c];
            if (xl) fsdp__cvt_from_f32(dt, row, (char *)xl + (size_t)(i * cols) * es, (size_t)cols);
        }
    }
    fsdp__colsum_chunks_add(part, nch, cols, db);
    fsdp_arena_release(ctx, mark);
    return FSDP_OK;
}

float *fsdp__pgrad(struct fsdp_param *p) {
    struct fsdp_param *q = p->tied_to ? p->tied_to : p;
    if (q->priv->grad_unset) {
        fsdp__zero(q->grad, q->numel);
        q->priv->grad_unset = 0;
    }
    return q->grad;
}

float *fsdp__pgrad_first(struct fsdp_param *p, float *beta) {
    struct fsdp_param *q = p->tied_to ? p->tied_to : p;
    *beta = q->priv->grad_unset ? 0.0f : 1.0f;
    q->priv->grad_unset = 0;
    return q->grad;
}

enum fsdp_status fsdp__param_ready(struct fsdp_ctx *ctx, struct fsdp_param *p, int need_grad) {
    const char *name = p->fqn ? p->fqn : p->name;
    const struct fsdp_param *q = p->tied_to ? p->tied_to : p;
    if (!q->data && !q->priv->data_stale) /* a lazily gathered weight has data_lp alone ([Note: lazy widening]) */
        return fsdp__err(ctx, FSDP_ERR_STATE,
                         "parameter '%s' has no values (not materialized, or its unit is not gathered)", name);
    if (need_grad && !q->grad)
        return fsdp__err(ctx, FSDP_ERR_STATE,
                         "parameter '%s' has no gradient buffer (call fsdp_module_zero_grad)", name);
    return FSDP_OK;
}

enum fsdp_status fsdp__tensor_prepare(struct fsdp_ctx *ctx, struct fsdp_tensor *t, enum fsdp_dtype dt,
                                      int ndim, const int64_t *shape, const char *what) {
    FSDP_ASSERT(ndim >= 1 && ndim <= FSDP_MAX_DIMS, "tensor rank %d for %s", ndim, what);
    t->dtype = dt;
    t->ndim = ndim;
    t->layout = FSDP_LAYOUT_PLAIN;
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        t->shape[i] = shape[i];
        n *= shape[i];
    }
    for (int i = ndim; i < FSDP_MAX_DIMS; i++) t->shape[i] = 0;
    if (!t->data) {
        t->data = fsdp_arena_alloc(ctx, (size_t)n * fsdp_dtype_size(dt));
        if (!t->data)
            return fsdp__arena_err(ctx, "out of memory for %s (%lld elements) in the activation arena",
                             what, (long long)n);
    }
    return FSDP_OK;
}

/* The name of layout l, or NULL for a value that is none. */
static const char *layout_name(enum fsdp_layout l) {
    switch (l) {
    case FSDP_LAYOUT_PLAIN: return "PLAIN";
    case FSDP_LAYOUT_BLOCKED16: return "BLOCKED16";
    case FSDP_LAYOUT_ROWS16: return "ROWS16";
    }
    return NULL;
}

/* takes: the layout besides PLAIN that the module takes (PLAIN: none) */
static enum fsdp_status check_input(struct fsdp_ctx *ctx, const struct fsdp_module *m, const struct fsdp_tensor *t,
                                    enum fsdp_dtype dt, int ndim, int64_t last, enum fsdp_layout takes);

enum fsdp_status fsdp__check_input(struct fsdp_ctx *ctx, const struct fsdp_module *m,
                                   const struct fsdp_tensor *t, enum fsdp_dtype dt, int ndim, int64_t last) {
    return check_input(ctx, m, t, dt, ndim, last, FSDP_LAYOUT_PLAIN);
}

enum fsdp_status fsdp__check_input_any(struct fsdp_ctx *ctx, const struct fsdp_module *m,
                                       const struct fsdp_tensor *t, enum fsdp_dtype dt, int ndim, int64_t last) {
    return check_input(ctx, m, t, dt, ndim, last, FSDP_LAYOUT_BLOCKED16);
}

enum fsdp_status fsdp__check_input_rows16(struct fsdp_ctx *ctx, const struct fsdp_module *m,
                                          const struct fsdp_tensor *t, enum fsdp_dtype dt, int ndim, int64_t last) {
    return check_input(ctx, m, t, dt, ndim, last, FSDP_LAYOUT_ROWS16);
}

int64_t fsdp__row_stride(const struct fsdp_tensor *t) {
    int64_t last = t->shape[t->ndim - 1];
    return t->layout == FSDP_LAYOUT_ROWS16 ? fsdp_rows16_stride(last) : last;
}

static enum fsdp_status check_input(struct fsdp_ctx *ctx, const struct fsdp_module *m, const struct fsdp_tensor *t,
                                    enum fsdp_dtype dt, int ndim, int64_t last, enum fsdp_layout takes) {
    const char *who = fsdp__mname(m);
    if (!t || !t->data)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "%s '%s': input tensor has no data", m->ops->type, who);
    if (t->dtype != dt)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "%s '%s': input dtype %s, expected %s", m->ops->type, who,
                         fsdp_dtype_name(t->dtype), fsdp_dtype_name(dt));
    if (t->ndim < 1 || t->ndim > FSDP_MAX_DIMS || (ndim > 0 && t->ndim != ndim))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "%s '%s': input has %d dimensions, expected %d", m->ops->type,
                         who, t->ndim, ndim);
    for (int i = 0; i < t->ndim; i++)
        if (t->shape[i] <= 0)
            return fsdp__err(ctx, FSDP_ERR_INVALID, "%s '%s': input dimension %d is %lld", m->ops->type, who,
                             i, (long long)t->shape[i]);
    if (last > 0 && t->shape[t->ndim - 1] != last)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "%s '%s': input last dimension is %lld, expected %lld",
                         m->ops->type, who, (long long)t->shape[t->ndim - 1], (long long)last);
    if (t->layout == FSDP_LAYOUT_PLAIN) return FSDP_OK;
    if (!layout_name(t->layout))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "%s '%s': input layout %d is unknown", m->ops->type, who,
                         (int)t->layout);
    if (t->layout != takes)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "%s '%s': input in the %s layout; this module takes PLAIN%s%s "
                         "tensors only", m->ops->type, who, layout_name(t->layout),
                         takes == FSDP_LAYOUT_PLAIN ? "" : " or ", takes == FSDP_LAYOUT_PLAIN ? "" : layout_name(takes));
    if (t->layout == FSDP_LAYOUT_ROWS16) return FSDP_OK;
    if (t->ndim != 4 || t->shape[1] % 16)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "%s '%s': a BLOCKED16 input must be 4-D with a multiple of 16 "
                         "channels (has %d dimensions, %lld channels)", m->ops->type, who, t->ndim,
                         (long long)(t->ndim > 1 ? t->shape[1] : 0));
    return FSDP_OK;
}

float *fsdp__scratch(struct fsdp_ctx *ctx, int64_t n, const char *what) {
    float *p = fsdp_arena_alloc(ctx, (size_t)n * sizeof(float));
    if (!p)
        fsdp__arena_err(ctx, "out of memory for %s (%lld floats) in the activation arena", what,
                  (long long)n);
    return p;
}

/* ---- Public entry points for custom modules ---- */

enum fsdp_status fsdp_error(struct fsdp_ctx *ctx, enum fsdp_status st, const char *fmt, ...) {
    if (ctx && fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(ctx->errmsg, sizeof ctx->errmsg, fmt, ap);
        va_end(ap);
    }
    return st;
}

/* The elements a stored rows x cols matrix with row stride ld spans. */
static int64_t span(int64_t rows, int64_t cols, int64_t ld) { return rows > 0 ? (rows - 1) * ld + cols : 0; }

enum fsdp_status fsdp_gemm(struct fsdp_ctx *ctx, const struct fsdp_module *m, int transa, int transb, int64_t M,
                           int64_t N, int64_t K, float alpha, const float *A, int64_t lda, const float *B,
                           int64_t ldb, float beta, float *C, int64_t ldc) {
    const char *who = m ? fsdp__mname(m) : "(no module)";
    int64_t ar = transa ? K : M, ac = transa ? M : K; /* A as stored */
    int64_t br = transb ? N : K, bc = transb ? K : N; /* B as stored */
    if (M < 0 || N < 0 || K < 0)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "fsdp_gemm in '%s': sizes M %lld, N %lld, K %lld must not be "
                         "negative", who, (long long)M, (long long)N, (long long)K);
    if (lda < (ac > 1 ? ac : 1) || ldb < (bc > 1 ? bc : 1) || ldc < (N > 1 ? N : 1))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "fsdp_gemm in '%s': strides lda %lld, ldb %lld, ldc %lld are "
                         "below the rows (%lld, %lld, %lld)", who, (long long)lda, (long long)ldb, (long long)ldc,
                         (long long)ac, (long long)bc, (long long)N);
    if (M == 0 || N == 0) return FSDP_OK;
    if (!C || (K > 0 && (!A || !B)))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "fsdp_gemm in '%s': a NULL matrix", who);
    enum fsdp_dtype dt = m ? fsdp__compute_dtype(m) : FSDP_F32;
    if (dt == FSDP_F32 || K == 0) {
        fsdp__sgemm(transa, transb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        return FSDP_OK;
    }
    size_t mark = fsdp_arena_mark(ctx);
    const void *al = fsdp__lp_copy(ctx, dt, A, span(ar, ac, lda), "fsdp_gemm's A (low precision)");
    const void *bl = al ? fsdp__lp_copy(ctx, dt, B, span(br, bc, ldb), "fsdp_gemm's B (low precision)") : NULL;
    if (bl) fsdp__gemm_lp(dt, transa, transb, M, N, K, alpha, al, lda, bl, ldb, beta, C, ldc);
    fsdp_arena_release(ctx, mark);
    return bl ? FSDP_OK : FSDP_ERR_NOMEM;
}
