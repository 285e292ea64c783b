/*
 * gelu.c - GELU, tanh approximation as GPT-2:
 *   y = 0.5 x (1 + tanh(k (x + 0.044715 x^3))), k = sqrt(2 / pi).
 * computed as y = x s with s = sigmoid(2u) = 0.5 (1 + tanh(u)), u = k (x + 0.044715 x^3),
 * which keeps full relative accuracy in the tails; dy/dx = s + x 2 s (1 - s) du/dx.
 * Elementwise on any F32 shape; saves x (arena). Backward may run in place.
 * Writes y in 16 bits when asked ([Note: 16-bit hand-off]): blocks of
 * GELU_BLOCK elements computed in fp32 by the same loop, then rounded.
 * Computing in 16 bits it also takes x in its compute dtype and keeps it so
 * for backward ([Note: 16-bit activations], precision.c), widened as it is
 * read ([Note: GELU widening in the loop]).
 */
#include "nn/nn-impl.h"

#define GELU_K 0.7978845608028654f
#define GELU_A 0.044715f
#define GELU_BLOCK 2048

/* s = sigmoid(2u) at x = v (y = v s), and dy/dx there: the formulas, once */
static inline float gelu_s(float v, struct fsdp__exp_range er) {
    return 1.0f / (1.0f + fsdp__expf(-2.0f * GELU_K * (v + GELU_A * v * v * v), er));
}

static inline float gelu_grad(float v, struct fsdp__exp_range er) {
    float sg = gelu_s(v, er);
    return sg + 2.0f * v * sg * (1.0f - sg) * GELU_K * (1.0f + 3.0f * GELU_A * v * v);
}


struct gelu {
    const void *x;      /* (n) saved input in xdt, borrowed from the arena */
    enum fsdp_dtype xdt; /* F32, or the 16-bit compute dtype ([Note: 16-bit activations]) */
    int64_t n;
};

/* [Note: GELU widening in the loop] x in bf16 is widened by the loops that
 * compute on it, a shift in each lane, rather than into a block of fp32 on
 * the stack by a pass of its own first: that pass (stores, then loads of
 * the block) took about 0.1 ms of a forward's 0.8 at 1024 x 3072 on two
 * threads. fp16 is not widened by a shift (subnormals), so it keeps the
 * block, widened by fsdp__cvt_to_f32. The values are the same either way. */

/* x[i0, i0 + len) in fp32 where x is F32 or F16 (bf16 is read in the loop):
 * x itself, or widened into blk */
static const float *block_in(enum fsdp_dtype xdt, const void *x, int64_t i0, int64_t len, float *blk) {
    if (xdt == FSDP_F32) return (const float *)x + i0;
    fsdp__cvt_to_f32(xdt, (const uint16_t *)x + i0, blk, (size_t)len);
    return blk;
}

/* y[i] = gelu(x[i]) for the block [i0, i0 + len) of x in xdt (xb: its
 * scratch) into y[0, len); both output paths use it */
static void gelu_run(enum fsdp_dtype xdt, const void *x, int64_t i0, int64_t len, float *y, float *xb) {
    const struct fsdp__exp_range er = fsdp__exp_range(); /* [Note: exp range] */
    if (xdt == FSDP_BF16) {
        const uint16_t *h = (const uint16_t *)x + i0;
#pragma omp simd
        for (int64_t i = 0; i < len; i++) {
            float v = fsdp__bf16_to_f32(h[i]);
            y[i] = v * gelu_s(v, er);
        }
        return;
    }
    const float *f = block_in(xdt, x, i0, len, xb);
#pragma omp simd
    for (int64_t i = 0; i < len; i++) y[i] = f[i] * gelu_s(f[i], er);
}

/* dx[i] = dy[i] * gelu'(x[i]) for the block [i0, i0 + len), dx and dy
 * offset to it (dx may be dy) */
static void gelu_grad_run(enum fsdp_dtype xdt, const void *x, int64_t i0, int64_t len, const float *dy, float *dx,
                          float *xb) {
    const struct fsdp__exp_range er = fsdp__exp_range();
    if (xdt == FSDP_BF16) {
        const uint16_t *h = (const uint16_t *)x + i0;
#pragma omp simd
        for (int64_t i = 0; i < len; i++) dx[i] = dy[i] * gelu_grad(fsdp__bf16_to_f32(h[i]), er);
        return;
    }
    const float *f = block_in(xdt, x, i0, len, xb);
#pragma omp simd
    for (int64_t i = 0; i < len; i++) dx[i] = dy[i] * gelu_grad(f[i], er);
}

static enum fsdp_status gelu_forward(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                     const struct fsdp_tensor *in, struct fsdp_tensor *out) {
    struct gelu *G = m->impl;
    enum fsdp_dtype xdt = in && in->dtype == fsdp__gelu_input_dtype(m) ? in->dtype : FSDP_F32;
    FSDP_TRY(fsdp__check_input(ctx, m, in, xdt, 0, 0));
    enum fsdp_dtype odt = fsdp__wanted_dtype(out);
    FSDP_TRY(fsdp__tensor_prepare(ctx, out, odt, in->ndim, in->shape, "GELU output"));
    const void *x = in->data;
    int64_t n = fsdp_tensor_numel(in), nb = (n + GELU_BLOCK - 1) / GELU_BLOCK;
    if (odt == FSDP_F32) {
        float *y = out->data;
#pragma omp parallel for schedule(static)
        for (int64_t k = 0; k < (fsdp__measuring ? 0 : nb); k++) {
            float xb[GELU_BLOCK];
            int64_t i0 = k * GELU_BLOCK, len = n - i0 < GELU_BLOCK ? n - i0 : GELU_BLOCK;
            gelu_run(xdt, x, i0, len, y + i0, xb);
        }
    } else {
        uint16_t *y = out->data;
#pragma omp parallel for schedule(static)
        for (int64_t k = 0; k < (fsdp__measuring ? 0 : nb); k++) {
            float xb[GELU_BLOCK], blk[GELU_BLOCK];
            int64_t i0 = k * GELU_BLOCK, len = n - i0 < GELU_BLOCK ? n - i0 : GELU_BLOCK;
            gelu_run(xdt, x, i0, len, blk, xb);
            fsdp__cvt_from_f32(odt, blk, y + i0, (size_t)len);
        }
    }
    G->x = x;
    G->xdt = xdt;
    G->n = n;
    return FSDP_OK;
}

static enum fsdp_status gelu_backward(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                      const struct fsdp_tensor *dout, struct fsdp_tensor *din) {
    struct gelu *G = m->impl;
    if (!G->x) return fsdp__err(ctx, FSDP_ERR_STATE, "GELU '%s': backward without forward", fsdp__mname(m));
    FSDP_TRY(fsdp__check_input(ctx, m, dout, FSDP_F32, 0, 0));
    if (fsdp_tensor_numel(dout) != G->n)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "GELU '%s': gradient has %lld elements, forward had %lld",
                         fsdp__mname(m), (long long)fsdp_tensor_numel(dout), (long long)G->n);
    if (!din) return FSDP_OK;
    FSDP_TRY(fsdp__tensor_prepare(ctx, din, FSDP_F32, dout->ndim, dout->shape, "GELU input gradient"));
    const float *dy = dout->data;
    float *dx = din->data; /* may equal dy */
    int64_t n = G->n, nb = (n + GELU_BLOCK - 1) / GELU_BLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < (fsdp__measuring ? 0 : nb); k++) {
        float xb[GELU_BLOCK];
        int64_t i0 = k * GELU_BLOCK, len = n - i0 < GELU_BLOCK ? n - i0 : GELU_BLOCK;
        gelu_grad_run(G->xdt, G->x, i0, len, dy + i0, dx + i0, xb);
    }
    return FSDP_OK;
}

static void gelu_destroy(struct fsdp_module *m) { free(m->impl); }

static const struct fsdp_module_ops gelu_ops = {"GELU", gelu_forward, gelu_backward, gelu_destroy};

enum fsdp_dtype fsdp__gelu_input_dtype(const struct fsdp_module *m) {
    return m->ops == &gelu_ops ? fsdp__compute_dtype(m) : FSDP_F32;
}

enum fsdp_status fsdp__gelu_create(struct fsdp_ctx *ctx, const char *name, struct fsdp_module **out_m) {
    struct fsdp_module *m;
    FSDP_TRY(fsdp_module_create(ctx, &gelu_ops, name, &m));
    m->impl = fsdp__zalloc(1, sizeof(struct gelu));
    if (!m->impl) {
        fsdp_module_free(m);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory creating GELU '%s'", name);
    }
    *out_m = m;
    return FSDP_OK;
}
