/*
 * attention.c - CausalSelfAttention as nanoGPT: qkv = c_attn(x) with q, k, v
 * in that order along the 3C axis; per (batch b, head h) with head size
 * hs = C / n_head:  att = softmax_causal(q k^T / sqrt(hs)),  y = att v;
 * out = c_proj(y). The per-(b, h) matrices are strided views into qkv (row
 * stride 3C) and y (row stride C), so no head is ever copied out.
 * Saves: qkv (B, T, 3C) and the attention probabilities att (B, nh, T, T),
 * both in the arena; masked entries (j > t) of att are stored as zeros.
 * The (b, h) pairs run in parallel with single-threaded GEMMs each.
 * With a 16-bit compute dtype ([Note: compute precision]) each (b, h) casts
 * its q, k, v (and dY) head slices into dense (T, hs) per-thread scratch and
 * its probabilities into (T, T), and multiplies with fsdp__gemm_lp; the
 * softmax and its backward stay fp32, and what is saved is unchanged.
 */
#include "nn/nn-impl.h"

#include <math.h>
#include <omp.h>

/* dst (rows, cols) dense in dtype lp (2-byte) from src (rows, cols), row stride ld. */
static void rows_to_lp(enum fsdp_dtype lp, const float *src, int64_t ld, int64_t rows, int64_t cols,
                       uint16_t *dst) {
    for (int64_t r = 0; r < rows; r++) fsdp__cvt_from_f32(lp, src + r * ld, dst + r * cols, (size_t)cols);
}

struct attention {
    int64_t C;
    int n_head;
    struct fsdp_module *c_attn, *c_proj; /* children, owned by the module */
    const float *qkv;                    /* (B, T, 3C) saved, arena */
    enum fsdp_dtype lp;                  /* compute dtype of the last forward */
    float *att;                          /* (B, nh, T, T) saved probabilities, arena */
    int64_t B, T;
};

static enum fsdp_status attention_forward(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                          const struct fsdp_tensor *in, struct fsdp_tensor *out) {
    struct attention *A = m->impl;
    FSDP_TRY(fsdp__check_input(ctx, m, in, FSDP_F32, 3, A->C));
    int64_t B = in->shape[0], T = in->shape[1], C = A->C, nh = A->n_head, hs = C / nh;
    struct fsdp_tensor qkv = {0};
    FSDP_TRY(fsdp_module_forward(A->c_attn, ctx, in, &qkv)); /* (B, T, 3C) */
    float *att = fsdp__scratch(ctx, B * nh * T * T, "attention probabilities");
    if (!att) return FSDP_ERR_NOMEM;
    struct fsdp_tensor y = {0};
    int64_t yshape[3] = {B, T, C};
    FSDP_TRY(fsdp__tensor_prepare(ctx, &y, FSDP_F32, 3, yshape, "attention heads output"));
    const float *q_all = qkv.data;
    float *y_all = y.data; /* (B, T, C), head h in columns [h*hs, (h+1)*hs) */
    float scale = 1.0f / sqrtf((float)hs);
    enum fsdp_dtype lp = fsdp__compute_dtype(m);
    size_t mark = fsdp_arena_mark(ctx);
    int64_t per = 3 * T * hs + T * T; /* 16-bit scratch per thread: qb, kb, vb (T, hs), sb (T, T) */
    uint16_t *lpbuf = NULL;
    if (lp != FSDP_F32) {
        lpbuf = fsdp_arena_alloc(ctx, (size_t)(omp_get_max_threads() * per) * sizeof(uint16_t));
        if (!lpbuf)
            return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory for attention %s scratch in the activation arena",
                             fsdp_dtype_name(lp));
    }
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < B * nh; bh++) {
        int64_t b = bh / nh, h = bh % nh;
        const float *q = q_all + b * T * 3 * C + h * hs; /* (T, hs), row stride 3C */
        const float *k = q + C, *v = q + 2 * C;
        float *s = att + bh * T * T; /* (T, T) */
        uint16_t *qb = NULL, *kb = NULL, *vb = NULL, *sb = NULL;
        if (lp != FSDP_F32) {
            qb = lpbuf + (int64_t)omp_get_thread_num() * per;
            kb = qb + T * hs;
            vb = kb + T * hs;
            sb = vb + T * hs;
            rows_to_lp(lp, q, 3 * C, T, hs, qb);
            rows_to_lp(lp, k, 3 * C, T, hs, kb);
            rows_to_lp(lp, v, 3 * C, T, hs, vb);
            fsdp__gemm_lp(lp, 0, 1, T, T, hs, scale, qb, hs, kb, hs, 0.0f, s, T);
        } else {
            fsdp__sgemm(0, 1, T, T, hs, scale, q, 3 * C, k, 3 * C, 0.0f, s, T);
        }
        for (int64_t t = 0; t < T; t++) { /* causal softmax of row t over j <= t */
            float *row = s + t * T;
            float mx = row[0];
#pragma omp simd reduction(max : mx)
            for (int64_t j = 1; j <= t; j++) mx = row[j] > mx ? row[j] : mx;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j <= t; j++) {
                float e = fsdp__expf(row[j] - mx);
                row[j] = e;
                sum += e;
            }
            float inv = 1.0f / sum;
            for (int64_t j = 0; j <= t; j++) row[j] *= inv;
            for (int64_t j = t + 1; j < T; j++) row[j] = 0.0f;
        }
        if (lp != FSDP_F32) {
            rows_to_lp(lp, s, T, T, T, sb);
            fsdp__gemm_lp(lp, 0, 0, T, hs, T, 1.0f, sb, T, vb, hs, 0.0f, y_all + b * T * C + h * hs, C);
        } else {
            fsdp__sgemm(0, 0, T, hs, T, 1.0f, s, T, v, 3 * C, 0.0f, y_all + b * T * C + h * hs, C);
        }
    }
    fsdp_arena_release(ctx, mark);
    A->lp = lp;
    A->qkv = q_all;
    A->att = att;
    A->B = B;
    A->T = T;
    return fsdp_module_forward(A->c_proj, ctx, &y, out);
}

/* Per (b, h), with dY the gradient of y's head slice:
 *   datt = dY v^T;  dv = att^T dY;  dS = att * (datt - rowsum(att * datt));
 *   dq = scale dS k;  dk = scale dS^T q. */
static enum fsdp_status attention_backward(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                           const struct fsdp_tensor *dout, struct fsdp_tensor *din) {
    struct attention *A = m->impl;
    if (!A->att)
        return fsdp__err(ctx, FSDP_ERR_STATE, "CausalSelfAttention '%s': backward without forward", fsdp__mname(m));
    FSDP_TRY(fsdp__check_input(ctx, m, dout, FSDP_F32, 3, A->C));
    int64_t B = A->B, T = A->T, C = A->C, nh = A->n_head, hs = C / nh;
    if (dout->shape[0] != B || dout->shape[1] != T)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "CausalSelfAttention '%s': gradient is (%lld, %lld, C), forward "
                         "was (%lld, %lld, C)", fsdp__mname(m), (long long)dout->shape[0],
                         (long long)dout->shape[1], (long long)B, (long long)T);
    struct fsdp_tensor dy = {0};
    FSDP_TRY(fsdp_module_backward(A->c_proj, ctx, dout, &dy)); /* (B, T, C) */
    struct fsdp_tensor dqkv = {0};
    int64_t shape[3] = {B, T, 3 * C};
    FSDP_TRY(fsdp__tensor_prepare(ctx, &dqkv, FSDP_F32, 3, shape, "attention qkv gradient"));
    int nthr = omp_get_max_threads();
    float *scratch = fsdp__scratch(ctx, (int64_t)nthr * T * T, "attention backward scratch");
    if (!scratch) return FSDP_ERR_NOMEM;
    const float *q_all = A->qkv, *dy_all = dy.data;
    float *dq_all = dqkv.data;
    float scale = 1.0f / sqrtf((float)hs);
    enum fsdp_dtype lp = A->lp;
    int64_t per = 4 * T * hs + T * T; /* 16-bit scratch per thread: qb, kb, vb, dyb (T, hs), ab (T, T) */
    uint16_t *lpbuf = NULL;
    if (lp != FSDP_F32) {
        lpbuf = fsdp_arena_alloc(ctx, (size_t)(nthr * per) * sizeof(uint16_t));
        if (!lpbuf)
            return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory for attention %s scratch in the activation arena",
                             fsdp_dtype_name(lp));
    }
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < B * nh; bh++) {
        int64_t b = bh / nh, h = bh % nh;
        const float *q = q_all + b * T * 3 * C + h * hs, *k = q + C, *v = q + 2 * C; /* (T, hs), stride 3C */
        float *dq = dq_all + b * T * 3 * C + h * hs, *dk = dq + C, *dv = dq + 2 * C;
        const float *dY = dy_all + b * T * C + h * hs; /* (T, hs), stride C */
        const float *att = A->att + bh * T * T;        /* (T, T) */
        float *ds = scratch + (int64_t)omp_get_thread_num() * T * T; /* (T, T) */
        uint16_t *qb = NULL, *kb = NULL, *vb = NULL, *dyb = NULL, *ab = NULL;
        if (lp != FSDP_F32) {
            qb = lpbuf + (int64_t)omp_get_thread_num() * per;
            kb = qb + T * hs;
            vb = kb + T * hs;
            dyb = vb + T * hs;
            ab = dyb + T * hs;
            rows_to_lp(lp, q, 3 * C, T, hs, qb);
            rows_to_lp(lp, k, 3 * C, T, hs, kb);
            rows_to_lp(lp, v, 3 * C, T, hs, vb);
            rows_to_lp(lp, dY, C, T, hs, dyb);
            rows_to_lp(lp, att, T, T, T, ab);
            fsdp__gemm_lp(lp, 0, 1, T, T, hs, 1.0f, dyb, hs, vb, hs, 0.0f, ds, T);
            fsdp__gemm_lp(lp, 1, 0, T, hs, T, 1.0f, ab, T, dyb, hs, 0.0f, dv, 3 * C);
        } else {
            fsdp__sgemm(0, 1, T, T, hs, 1.0f, dY, C, v, 3 * C, 0.0f, ds, T);
            fsdp__sgemm(1, 0, T, hs, T, 1.0f, att, T, dY, C, 0.0f, dv, 3 * C);
        }
        for (int64_t t = 0; t < T; t++) {
            const float *a = att + t * T;
            float *d = ds + t * T;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t j = 0; j <= t; j++) dot += a[j] * d[j];
            for (int64_t j = 0; j <= t; j++) d[j] = a[j] * (d[j] - dot);
            for (int64_t j = t + 1; j < T; j++) d[j] = 0.0f;
        }
        if (lp != FSDP_F32) { /* dS in ab (att is no longer needed) */
            rows_to_lp(lp, ds, T, T, T, ab);
            fsdp__gemm_lp(lp, 0, 0, T, hs, T, scale, ab, T, kb, hs, 0.0f, dq, 3 * C);
            fsdp__gemm_lp(lp, 1, 0, T, hs, T, scale, ab, T, qb, hs, 0.0f, dk, 3 * C);
        } else {
            fsdp__sgemm(0, 0, T, hs, T, scale, ds, T, k, 3 * C, 0.0f, dq, 3 * C);
            fsdp__sgemm(1, 0, T, hs, T, scale, ds, T, q, 3 * C, 0.0f, dk, 3 * C);
        }
    }
    return fsdp_module_backward(A->c_attn, ctx, &dqkv, din);
}

static void attention_destroy(struct fsdp_module *m) { free(m->impl); }

static const struct fsdp_module_ops attention_ops = {"CausalSelfAttention", attention_forward,
                                                     attention_backward, attention_destroy};

enum fsdp_status fsdp__attention_create(struct fsdp_ctx *ctx, const char *name, int64_t C, int n_head,
                                        float proj_std, struct fsdp_module **out_m) {
    if (C <= 0 || n_head <= 0 || C % n_head != 0)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "CausalSelfAttention '%s': n_embd %lld is not a positive "
                         "multiple of n_head %d", name, (long long)C, n_head);
    struct fsdp_module *m, *c;
    FSDP_TRY(fsdp_module_create(ctx, &attention_ops, name, &m));
    struct attention *A = calloc(1, sizeof *A);
    if (!A) {
        fsdp_module_free(m);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory creating CausalSelfAttention '%s'", name);
    }
    m->impl = A;
    A->C = C;
    A->n_head = n_head;
    enum fsdp_status st = fsdp__adopt(ctx, m, fsdp__linear_create(ctx, "c_attn", C, 3 * C, 1, 0.02f, &c), &c,
                                      &A->c_attn);
    if (st == FSDP_OK)
        st = fsdp__adopt(ctx, m, fsdp__linear_create(ctx, "c_proj", C, C, 1, proj_std, &c), &c, &A->c_proj);
    if (st != FSDP_OK) {
        fsdp_module_free(m);
        return st;
    }
    *out_m = m;
    return FSDP_OK;
}
