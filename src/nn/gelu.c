/*
 * gelu.c - GELU, tanh approximation as GPT-2:
 *   y = 0.5 x (1 + tanh(k (x + 0.044715 x^3))), k = sqrt(2 / pi).
 * computed as y = x s with s = sigmoid(2u) = 0.5 (1 + tanh(u)), u = k (x + 0.044715 x^3),
 * which keeps full relative accuracy in the tails; dy/dx = s + x 2 s (1 - s) du/dx.
 * Elementwise on any F32 shape; saves x (arena). Backward may run in place.
 * Writes y in 16 bits when asked ([Note: 16-bit hand-off]): blocks of
 * GELU_BLOCK elements computed in fp32 by the same loop, then rounded.
 * Computing in 16 bits it also takes x in its compute dtype and keeps it so
 * for backward, widening each block ([Note: 16-bit activations], precision.c).
 */
#include "nn/nn-impl.h"

#define GELU_K 0.7978845608028654f
#define GELU_A 0.044715f
#define GELU_BLOCK 2048

/* y[i] = gelu(x[i]) for n elements (one block; both output paths use it) */
static void gelu_run(const float *x, float *y, int64_t n) {
    const struct fsdp__exp_range er = fsdp__exp_range(); /* [Note: exp range] */
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        float v = x[i];
        float sg = 1.0f / (1.0f + fsdp__expf(-2.0f * GELU_K * (v + GELU_A * v * v * v), er));
        y[i] = v * sg;
    }
}

struct gelu {
    const void *x;      /* (n) saved input in xdt, borrowed from the arena */
    enum fsdp_dtype xdt; /* F32, or the 16-bit compute dtype ([Note: 16-bit activations]) */
    int64_t n;
};

/* x[i0, i0 + len) in fp32: x itself, or widened into blk */
static const float *block_in(enum fsdp_dtype xdt, const void *x, int64_t i0, int64_t len, float *blk) {
    if (xdt == FSDP_F32) return (const float *)x + i0;
    fsdp__cvt_to_f32(xdt, (const uint16_t *)x + i0, blk, (size_t)len);
    return blk;
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
            gelu_run(block_in(xdt, x, i0, len, xb), y + i0, len);
        }
    } else {
        uint16_t *y = out->data;
#pragma omp parallel for schedule(static)
        for (int64_t k = 0; k < (fsdp__measuring ? 0 : nb); k++) {
            float xb[GELU_BLOCK], blk[GELU_BLOCK];
            int64_t i0 = k * GELU_BLOCK, len = n - i0 < GELU_BLOCK ? n - i0 : GELU_BLOCK;
            gelu_run(block_in(xdt, x, i0, len, xb), blk, len);
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
        const float *x = block_in(G->xdt, G->x, i0, len, xb);
        const float *dyb = dy + i0;
        float *dxb = dx + i0;
        const struct fsdp__exp_range er = fsdp__exp_range();
#pragma omp simd
        for (int64_t i = 0; i < len; i++) {
            float v = x[i];
            float sg = 1.0f / (1.0f + fsdp__expf(-2.0f * GELU_K * (v + GELU_A * v * v * v), er));
            float d = sg + 2.0f * v * sg * (1.0f - sg) * GELU_K * (1.0f + 3.0f * GELU_A * v * v);
            dxb[i] = dyb[i] * d;
        }
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
