/*
 * linear.c - Linear: y (N, out) = x (N, in) W^T + b, with N the product of
 * the input's leading dimensions. weight (out, in) row-major as PyTorch,
 * optional bias (out). Saves a pointer to x (arena) for backward; with a
 * 16-bit compute dtype ([Note: compute precision]) it saves the 16-bit copy
 * of x instead and multiplies with fsdp__gemm_lp, the weight cast into
 * arena scratch that is released after each product. In 16 bits it also
 * takes x already in its compute dtype ([Note: 16-bit hand-off]) and keeps
 * that tensor as the saved copy, and writes y rounded to 16 bits when asked
 * (the product lands in fp32 scratch first).
 */
#include "nn/nn-impl.h"

/* [Note: 16-bit output rounding] A Linear asked for its output in 16 bits
 * (the hand-off, [Note: 16-bit hand-off]; the model's output under
 * [Note: 16-bit model output], src/fsdp/step.c) rounds the fp32 product once.
 * The product runs over blocks of output columns (weight rows) into fp32
 * scratch of about ROUND_SCRATCH bytes (ROUND_MIN_COLS columns at least),
 * each block rounded into place:
 * GPT-2's lm_head at 4 x 256 tokens would otherwise need 196 MiB of fp32
 * beside its 98 MiB of bf16 logits (one block for its other Linears). Each
 * output element is the same dot product, rounded to nearest even. With
 * native bf16 kernels oneDNN rounds the blocks itself (product_out16, [Note:
 * 16-bit output by the kernel] in gemm_lp.c): its scratchpad holds the fp32
 * sums (twice a block's fp32 size on two threads), so the blocks are halved
 * until it fits the same ROUND_SCRATCH, and it lives in the arena (left to
 * oneDNN's own allocation, the lm_head's whole output in one product raised
 * the peak RSS 108 MB, bench/README.md). Asked for
 * ROWS16 as well, a bias-free Linear spaces its output rows as its own
 * backward takes its output gradient ([Note: padded rows], src/fsdp/step.c),
 * so a gradient written over the output in place comes back in them. */
#define ROUND_SCRATCH ((int64_t)16 << 20)
#define ROUND_MIN_COLS 1024

/* a block's columns: nc, at least lo, at most all O */
static int64_t block_cols(int64_t nc, int64_t lo, int64_t O) {
    nc = nc < lo ? lo : nc;
    return nc > O ? O : nc;
}

/* [Note: weight rows by block] A product over blocks of a weight's rows
 * (the output columns of a forward, the K of dx = dy W) takes each block's
 * rows in the compute dtype where they are: in place in the 16-bit copy
 * FSDP gathered, or else made for the block alone (fsdp__prows) into one
 * scratch of nc rows, so a weight read from its fp32 shard ([Note: 16-bit
 * values from the shard], src/fsdp/mixed.c) is never cast whole: GPT-2's
 * lm_head would hold a 74 MiB bf16 copy at the step's peak. Where the rows
 * come from changes no bit: the blocks are the same either way. */
struct wrows {
    struct fsdp_param *weight;
    enum fsdp_dtype dt;
    int64_t cols;
    const void *all; /* the gathered copy in dt, or NULL */
    void *blk;       /* nc rows of scratch, when all is NULL */
};

static enum fsdp_status wrows_init(struct fsdp_ctx *ctx, struct wrows *w, struct fsdp_param *weight,
                                   enum fsdp_dtype dt, int64_t cols, int64_t nc) {
    w->weight = weight;
    w->dt = dt;
    w->cols = cols;
    w->all = dt == FSDP_F32 ? NULL : fsdp__pdata_gathered_lp(weight, dt);
    w->blk = w->all ? NULL : fsdp__lp_alloc(ctx, dt, nc * cols, "Linear weight rows");
    return w->all || w->blk ? FSDP_OK : FSDP_ERR_NOMEM;
}

/* rows [r0, r0 + n) of the weight in w->dt */
static const void *wrows(struct wrows *w, int64_t r0, int64_t n) {
    size_t es = fsdp_dtype_size(w->dt);
    if (w->all) return (const char *)w->all + (size_t)(r0 * w->cols) * es;
    fsdp__prows(w->weight, w->cols, r0, n, w->dt, w->dt, w->blk);
    return w->blk;
}

/* product_rounded where oneDNN writes the 16-bit output itself ([Note:
 * 16-bit output by the kernel], gemm_lp.c): blocks of columns halved from
 * nc until the kernel's scratchpad fits ROUND_SCRATCH (two blocks for c_fc,
 * 2048 columns for the lm_head at 1024 rows on two threads), the
 * scratchpad in the arena. */
static enum fsdp_status product_out16(struct fsdp_ctx *ctx, enum fsdp_dtype lp, int64_t N, int64_t O, int64_t I,
                                      const void *x, struct fsdp_param *weight, const float *b, void *y, int64_t ldy,
                                      int64_t nc) {
    size_t need = fsdp__gemm_lp_out16_scratch(lp, 0, 1, N, nc, I, I, I, ldy, b != NULL);
    while (need > (size_t)ROUND_SCRATCH + 4096 && nc > 64) {
        nc = (nc + 1) / 2;
        need = fsdp__gemm_lp_out16_scratch(lp, 0, 1, N, nc, I, I, I, ldy, b != NULL);
    }
    /* the last block's own shape may ask for another size: the larger of the two */
    int64_t tail = O % nc;
    size_t need_tail = tail ? fsdp__gemm_lp_out16_scratch(lp, 0, 1, N, tail, I, I, I, ldy, b != NULL) : 0;
    if (need_tail > need) need = need_tail;
    void *s = need ? fsdp__scratch(ctx, (int64_t)((need + sizeof(float) - 1) / sizeof(float)),
                                   "Linear output's product scratchpad") : NULL;
    if (need && !s) return FSDP_ERR_NOMEM;
    struct wrows wr;
    FSDP_TRY(wrows_init(ctx, &wr, weight, lp, I, nc));
    for (int64_t c0 = 0; c0 < O; c0 += nc) {
        int64_t n = O - c0 < nc ? O - c0 : nc;
        const void *wc = wrows(&wr, c0, n); /* weight rows [c0, c0 + n) */
        fsdp__gemm_lp_out16(lp, 0, 1, N, n, I, x, I, wc, I, b ? b + c0 : NULL, (uint16_t *)y + c0, ldy, s);
    }
    return FSDP_OK;
}

/* s (N, n), fp32 dense, rounded into columns [c0, c0 + n) of y (row stride
 * ldy, dtype odt) */
static void round_block(enum fsdp_dtype odt, const float *s, int64_t N, int64_t n, void *y, int64_t ldy,
                        int64_t c0) {
    size_t os = fsdp_dtype_size(odt);
    if (n == ldy) { /* whole rows, contiguous: one cast (threaded inside) */
        fsdp__cvt_from_f32(odt, s, y, (size_t)(N * n));
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < (fsdp__measuring ? 0 : N); i++)
        fsdp__cvt_from_f32(odt, s + i * n, (char *)y + (size_t)(i * ldy + c0) * os, (size_t)n);
}

/* y (N, O, row stride ldy, dtype odt) = x W^T (+ b) rounded to odt, x (N, I)
 * and W (O, I) of the 16-bit compute dtype lp. */
static enum fsdp_status product_rounded(struct fsdp_ctx *ctx, enum fsdp_dtype lp, int64_t N, int64_t O, int64_t I,
                                        const void *x, struct fsdp_param *weight, const float *b, void *y,
                                        enum fsdp_dtype odt, int64_t ldy) {
    /* every row (a block of rows would be a product of another M, whose fp32
     * kernels may sum in another order) and as many columns as fit, at least
     * ROUND_MIN_COLS: x is read once per block */
    int64_t nc = block_cols(ROUND_SCRATCH / ((int64_t)sizeof(float) * N), ROUND_MIN_COLS, O);
    if (odt == lp && lp == FSDP_BF16 && fsdp_gemm_native(lp)) /* where fsdp__gemm_lp_out16 runs */
        return product_out16(ctx, lp, N, O, I, x, weight, b, y, ldy, nc);
    float *s = fsdp__scratch(ctx, N * nc, "Linear output before rounding");
    if (!s) return FSDP_ERR_NOMEM;
    struct wrows wr;
    FSDP_TRY(wrows_init(ctx, &wr, weight, lp, I, nc));
    for (int64_t c0 = 0; c0 < O; c0 += nc) {
        int64_t n = O - c0 < nc ? O - c0 : nc;
        const void *wc = wrows(&wr, c0, n); /* weight rows [c0, c0 + n) */
        if (b) fsdp__gemm_lp_bias(lp, 0, 1, N, n, I, x, I, wc, I, b + c0, s, n);
        else fsdp__gemm_lp(lp, 0, 1, N, n, I, 1.0f, x, I, wc, I, 0.0f, s, n);
        round_block(odt, s, N, n, y, ldy, c0);
    }
    return FSDP_OK;
}

/* [Note: widened backward] On a CPU without native kernels for lp
 * ([Note: widened operands] in precision.c) each 16-bit
 * product widens both of its inputs, so a Linear's backward widened its
 * output gradient twice (for dW and for dx), after rounding it to 16 bits
 * when it came in fp32 (a Linear with a bias): a round trip through 16 bits
 * for values that the fp32 products take exactly. The widened backward
 * instead makes each operand's fp32 values once, dy rounded straight from
 * fp32 (or widened from 16 bits) and x and W widened, and runs the fp32
 * products on them: every product is the same exact product, only the
 * blocking of the sums differs. It runs over blocks of output columns
 * (dy's columns, W's rows): x and a block take about ROUND_SCRATCH bytes, so the
 * lm_head's 50257 columns never widen whole: each block's dW rows are one
 * product over all N rows (written once, where K blocks re-read and wrote
 * the whole fp32 dW per block), and dx sums the blocks' products. The
 * forward goes the same way (forward_widened): x widened once, W's rows a
 * block at a time, fp32's products, the block rounded into place when the
 * output is asked in 16 bits. */
#define WIDEN_MIN_COLS 256

/* rows x nc block [c0, c0 + nc) of src (row stride ld, dtype sdt: fp32 or
 * lp) into dense fp32 dst holding the values lp rounds it to ([Note:
 * widened operands], precision.c) */
static void widen_cols(enum fsdp_dtype lp, enum fsdp_dtype sdt, const void *src, int64_t ld, int64_t rows,
                       int64_t c0, int64_t nc, float *dst) {
    size_t es = fsdp_dtype_size(sdt);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < (fsdp__measuring ? 0 : rows); r++) /* a serial cast per row */
        fsdp__to_operand(lp, FSDP_F32, sdt, (const char *)src + (size_t)(r * ld + c0) * es, dst + r * nc, (size_t)nc);
}

/* x (N, I) of lp widened into fp32 arena scratch, or NULL (the error set) */
static float *widened_input(struct fsdp_ctx *ctx, enum fsdp_dtype lp, const void *xl, int64_t N, int64_t I) {
    float *x = fsdp__scratch(ctx, N * I, "Linear input (widened)");
    if (x && !fsdp__measuring) fsdp__cvt_to_f32(lp, xl, x, (size_t)(N * I));
    return x;
}

/* [Note: widened backward]'s whole products: where the blocks of output
 * columns would cut dx = dy W's sums (K = O) into several products, each
 * re-reading and re-writing the fp32 dx, but dy's fp32 values fit whole
 * beside the larger of W's and x's, the backward runs in two phases in the
 * same budget: dy widened whole, then W beside it for dx (one product over
 * all of K), W released, then x beside it for dW (one product). GPT-2's
 * mlp.c_proj (O 768, I 3072, N 1024) took three blocks of 256; now its
 * widened backward takes 304-324 ms a step instead of 330-367 (`--profile`,
 * bench/README.md 2026-12-06). */
static int backward_whole_fits(int64_t N, int64_t I, int64_t O) {
    int64_t big = O * I > N * I ? O * I : N * I;
    return N * O + big <= ROUND_SCRATCH / (int64_t)sizeof(float);
}

static enum fsdp_status backward_widened_whole(struct fsdp_ctx *ctx, enum fsdp_dtype lp, int64_t N, int64_t I,
                                               int64_t O, const void *dy, enum fsdp_dtype ddt, int64_t ldy,
                                               const void *xl, struct fsdp_param *weight, float *dx) {
    float *dyw = fsdp__scratch(ctx, N * O, "Linear output gradient (widened)");
    if (!dyw) return FSDP_ERR_NOMEM;
    widen_cols(lp, ddt, dy, ldy, N, 0, O, dyw);
    size_t mark = fsdp_arena_mark(ctx);
    float *w = fsdp__scratch(ctx, O * I, "Linear weight (widened)");
    if (!w) return FSDP_ERR_NOMEM;
    fsdp__prows(weight, I, 0, O, lp, FSDP_F32, w); /* W rounded to lp, in fp32 */
    fsdp__sgemm(0, 0, N, I, O, 1.0f, dyw, O, w, I, 0.0f, dx, I);
    fsdp_arena_release(ctx, mark);
    float *x = widened_input(ctx, lp, xl, N, I);
    if (!x) return FSDP_ERR_NOMEM;
    float beta, *dw = fsdp__pgrad_first(weight, &beta); /* [Note: unset gradients] */
    fsdp__sgemm(1, 0, O, I, N, 1.0f, dyw, O, x, I, beta, dw, I);
    return FSDP_OK;
}

/* weight's dW (O, I) += dy^T x (= when unset) and, with dx, dx (N, I) = dy W,
 * on the fp32 values of the 16-bit operands ([Note: widened backward]): dy
 * (N, O) of dtype ddt with row stride ldy, x (N, I) and W (O, I) in lp. */
static enum fsdp_status backward_widened(struct fsdp_ctx *ctx, enum fsdp_dtype lp, int64_t N, int64_t I, int64_t O,
                                         const void *dy, enum fsdp_dtype ddt, int64_t ldy, const void *xl,
                                         struct fsdp_param *weight, float *dx) {
    int64_t per = N + (dx ? I : 0); /* fp32 values a column of the block takes */
    /* x widened whole, in the budget */
    int64_t nc = block_cols((ROUND_SCRATCH / (int64_t)sizeof(float) - N * I) / per, WIDEN_MIN_COLS, O);
    if (dx && nc < O && backward_whole_fits(N, I, O))
        return backward_widened_whole(ctx, lp, N, I, O, dy, ddt, ldy, xl, weight, dx);
    float *x = widened_input(ctx, lp, xl, N, I);
    float *dyw = x ? fsdp__scratch(ctx, N * nc, "Linear output gradient (widened)") : NULL;
    float *w = dyw && dx ? fsdp__scratch(ctx, nc * I, "Linear weight (widened)") : NULL;
    if (!dyw || (dx && !w)) return FSDP_ERR_NOMEM;
    float beta, *dw = fsdp__pgrad_first(weight, &beta); /* [Note: unset gradients] */
    for (int64_t c0 = 0; c0 < O; c0 += nc) {
        int64_t n = O - c0 < nc ? O - c0 : nc;
        widen_cols(lp, ddt, dy, ldy, N, c0, n, dyw);
        fsdp__sgemm(1, 0, n, I, N, 1.0f, dyw, n, x, I, beta, dw + c0 * I, I); /* dW's rows [c0, c0 + n) */
        if (!dx) continue;
        fsdp__prows(weight, I, c0, n, lp, FSDP_F32, w); /* W's rows rounded to lp, in fp32 */
        fsdp__sgemm(0, 0, N, I, n, 1.0f, dyw, n, w, I, c0 ? 1.0f : 0.0f, dx, I);
    }
    return FSDP_OK;
}

/* y (N, O, row stride ldy, dtype odt) = x W^T (+ b) on the fp32 values of
 * the 16-bit operands, the forward's half of [Note: widened backward]: x
 * widened once, W's rows made in fp32 a block of output columns at a time
 * (widened from a gathered copy, or rounded straight from the shard:
 * fsdp__prows), each block's output rounded into place when odt is 16-bit.
 * Everything in the arena: x, and up to ROUND_SCRATCH bytes each of weight
 * rows and output block. */
static enum fsdp_status forward_widened(struct fsdp_ctx *ctx, enum fsdp_dtype lp, int64_t N, int64_t O, int64_t I,
                                        const void *xl, struct fsdp_param *weight, const float *b, void *y,
                                        enum fsdp_dtype odt, int64_t ldy) {
    int out16 = odt != FSDP_F32;
    /* the columns product_rounded takes (whole for an fp32 output), and no
     * more weight rows than ROUND_SCRATCH holds: one block for every Linear
     * of a GPT-2 Block, 4096 columns for the lm_head at 1024 rows */
    int64_t nc = out16 ? ROUND_SCRATCH / ((int64_t)sizeof(float) * N) : O;
    int64_t nw = ROUND_SCRATCH / ((int64_t)sizeof(float) * I);
    nc = block_cols(nc < nw ? nc : nw, ROUND_MIN_COLS, O);
    float *x = widened_input(ctx, lp, xl, N, I);
    float *w = x ? fsdp__scratch(ctx, nc * I, "Linear weight (widened)") : NULL;
    float *s = w && out16 ? fsdp__scratch(ctx, N * nc, "Linear output before rounding") : NULL;
    if (!w || (out16 && !s)) return FSDP_ERR_NOMEM;
    for (int64_t c0 = 0; c0 < O; c0 += nc) {
        int64_t n = O - c0 < nc ? O - c0 : nc;
        fsdp__prows(weight, I, c0, n, lp, FSDP_F32, w); /* W's rows [c0, c0 + n) rounded to lp, in fp32 */
        float *dst = out16 ? s : (float *)y + c0;
        int64_t ld = out16 ? n : ldy;
        if (b) fsdp__gemm_lp_bias(FSDP_F32, 0, 1, N, n, I, x, I, w, I, b + c0, dst, ld);
        else fsdp__sgemm(0, 1, N, n, I, 1.0f, x, I, w, I, 0.0f, dst, ld);
        if (out16) round_block(odt, s, N, n, y, ldy, c0);
    }
    return FSDP_OK;
}

struct linear {
    int64_t in, out;
    struct fsdp_param *weight; /* (out, in) */
    struct fsdp_param *bias;   /* (out) or NULL */
    const float *x;            /* (N, in) saved fp32 input, borrowed from the arena (fp32 compute) */
    const void *xl;            /* (N, in) saved input in dtype lp (arena), if lp != F32 */
    enum fsdp_dtype lp;        /* compute dtype of the last forward */
    int64_t n;                 /* N of the saved input */
};

static enum fsdp_status linear_forward(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                       const struct fsdp_tensor *in, struct fsdp_tensor *out) {
    struct linear *L = m->impl;
    enum fsdp_dtype lp = fsdp__compute_dtype(m);
    int handed = lp != FSDP_F32 && in && in->dtype == lp; /* [Note: 16-bit hand-off] */
    FSDP_TRY(fsdp__check_input(ctx, m, in, handed ? lp : FSDP_F32, 0, L->in));
    FSDP_TRY(fsdp__param_ready(ctx, L->weight, 0));
    if (L->bias) FSDP_TRY(fsdp__param_ready(ctx, L->bias, 0));
    int64_t shape[FSDP_MAX_DIMS];
    memcpy(shape, in->shape, sizeof shape);
    enum fsdp_dtype odt = lp != FSDP_F32 ? fsdp__wanted_dtype(out) : FSDP_F32;
    /* [Note: 16-bit output rounding]: rows spaced for this Linear's backward, when asked */
    int rows16 = odt != FSDP_F32 && !L->bias && out->layout == FSDP_LAYOUT_ROWS16;
    int64_t ldo = rows16 ? fsdp_rows16_stride(L->out) : L->out;
    shape[in->ndim - 1] = ldo; /* allocated with the stride, then shaped as it is */
    FSDP_TRY(fsdp__tensor_prepare(ctx, out, odt, in->ndim, shape, "Linear output"));
    out->shape[in->ndim - 1] = L->out;
    if (rows16) out->layout = FSDP_LAYOUT_ROWS16;
    const float *x = in->data;   /* (N, in) */
    float *y = out->data;        /* (N, out), fp32 compute */
    int64_t N = fsdp_tensor_numel(in) / L->in, O = L->out;
    const float *b = L->bias ? fsdp__pdata(L->bias) : NULL;
    L->lp = lp;
    L->xl = NULL;
    m->priv->dout_dtype = L->bias ? FSDP_F32 : lp; /* [Note: 16-bit output gradient]: the bias sums dy in fp32 */
    /* [Note: padded rows] (src/fsdp/step.c): that dy may come in rows spaced for the products */
    m->priv->dout_layout = lp != FSDP_F32 && !L->bias ? FSDP_LAYOUT_ROWS16 : FSDP_LAYOUT_PLAIN;
    if (lp == FSDP_F32) {
        size_t mark = fsdp_arena_mark(ctx);
        const float *w = fsdp__pdata_f32(ctx, L->weight, "Linear weight (fp32)"); /* (out, in) */
        if (!w) return FSDP_ERR_NOMEM;
        if (b) fsdp__gemm_lp_bias(FSDP_F32, 0, 1, N, O, L->in, x, L->in, w, L->in, b, y, O); /* bias in the product */
        else fsdp__sgemm(0, 1, N, O, L->in, 1.0f, x, L->in, w, L->in, 0.0f, y, O);
        fsdp_arena_release(ctx, mark);
    } else {
        const void *xl = handed ? in->data : fsdp__lp_copy(ctx, lp, x, N * L->in, "Linear input (low precision)");
        if (!xl) return FSDP_ERR_NOMEM; /* kept either way */
        size_t mark = fsdp_arena_mark(ctx);
        const void *wl = NULL;
        if (fsdp__operand_dtype(lp) == FSDP_F32) /* widened ([Note: widened backward]) */
            FSDP_TRY(forward_widened(ctx, lp, N, O, L->in, xl, L->weight, b, out->data, odt, ldo));
        else if (odt != FSDP_F32) FSDP_TRY(product_rounded(ctx, lp, N, O, L->in, xl, L->weight, b, out->data, odt, ldo));
        else if (!(wl = fsdp__pdata_lp(ctx, L->weight, lp))) return FSDP_ERR_NOMEM;
        else if (b) fsdp__gemm_lp_bias(lp, 0, 1, N, O, L->in, xl, L->in, wl, L->in, b, y, O); /* bias in the product */
        else fsdp__gemm_lp(lp, 0, 1, N, O, L->in, 1.0f, xl, L->in, wl, L->in, 0.0f, y, O);
        fsdp_arena_release(ctx, mark);
        L->xl = xl;
    }
    L->x = handed ? NULL : x;
    L->n = N;
    return FSDP_OK;
}

static enum fsdp_status linear_backward(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                        const struct fsdp_tensor *dout, struct fsdp_tensor *din) {
    struct linear *L = m->impl;
    if (!L->x && !L->xl)
        return fsdp__err(ctx, FSDP_ERR_STATE, "Linear '%s': backward without forward", fsdp__mname(m));
    int handed = L->lp != FSDP_F32 && dout && dout->dtype == L->lp && !L->bias; /* [Note: 16-bit output gradient] */
    FSDP_TRY(handed ? fsdp__check_input_rows16(ctx, m, dout, L->lp, 0, L->out)
                    : fsdp__check_input(ctx, m, dout, FSDP_F32, 0, L->out));
    if (fsdp_tensor_numel(dout) != L->n * L->out)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "Linear '%s': gradient has %lld rows, forward had %lld",
                         fsdp__mname(m), (long long)(fsdp_tensor_numel(dout) / L->out), (long long)L->n);
    FSDP_TRY(fsdp__param_ready(ctx, L->weight, 1));
    if (L->bias) FSDP_TRY(fsdp__param_ready(ctx, L->bias, 1));
    int64_t N = L->n, I = L->in, O = L->out, ldy = handed ? fsdp__row_stride(dout) : O;
    const float *dy = dout->data; /* (N, out) */
    enum fsdp_dtype lp = L->lp;
    if (din) { /* prepared before any scratch, which is released below */
        int64_t shape[FSDP_MAX_DIMS];
        memcpy(shape, dout->shape, sizeof shape);
        shape[dout->ndim - 1] = I;
        FSDP_TRY(fsdp__tensor_prepare(ctx, din, FSDP_F32, dout->ndim, shape, "Linear input gradient"));
    }
    size_t mark = fsdp_arena_mark(ctx);
    const void *dyl = dy, *wl = NULL; /* operands in dtype lp */
    if (lp != FSDP_F32 && fsdp__operand_dtype(lp) == FSDP_F32) { /* [Note: widened backward] */
        enum fsdp_status st = backward_widened(ctx, lp, N, I, O, dout->data, handed ? lp : FSDP_F32, ldy, L->xl,
                                               L->weight, din ? din->data : NULL);
        if (st == FSDP_OK && L->bias) st = fsdp__colsum_add(ctx, dy, N, O, fsdp__pgrad(L->bias), FSDP_F32, NULL);
        fsdp_arena_release(ctx, mark);
        return st;
    }
    if (lp == FSDP_F32) {
        if (din && !(wl = fsdp__pdata_f32(ctx, L->weight, "Linear weight (fp32)"))) return FSDP_ERR_NOMEM;
    } else {
        const char *what = "Linear output gradient (low precision)";
        /* with a bias, the copy is made by the column sums' pass below */
        dyl = handed   ? dout->data
              : L->bias ? fsdp__lp_alloc(ctx, lp, N * O, what)
                        : fsdp__lp_copy(ctx, lp, dy, N * O, what);
        if (!dyl) {
            fsdp_arena_release(ctx, mark);
            return FSDP_ERR_NOMEM;
        }
    }
    /* db (out) += column sums of dy; in 16 bits, dyl = dy rounded in the same pass */
    void *dyc = lp == FSDP_F32 ? NULL : (void *)(uintptr_t)dyl;
    enum fsdp_status st = L->bias ? fsdp__colsum_add(ctx, dy, N, O, fsdp__pgrad(L->bias), lp, dyc) : FSDP_OK;
    if (st != FSDP_OK) {
        fsdp_arena_release(ctx, mark);
        return st;
    }
    /* dW (out, in) += dy^T x, or = when unset ([Note: unset gradients]) */
    float beta, *dw = fsdp__pgrad_first(L->weight, &beta);
    fsdp__gemm_lp(lp, 1, 0, O, I, N, 1.0f, dyl, ldy, lp == FSDP_F32 ? (const void *)L->x : L->xl, I, beta, dw, I);
    if (din && lp == FSDP_F32) { /* dx (N, in) = dy W */
        fsdp__gemm_lp(lp, 0, 0, N, I, O, 1.0f, dyl, ldy, wl, I, 0.0f, din->data, I);
    } else if (din) { /* the same over blocks of W's rows, summed ([Note: weight rows by block]) */
        int64_t nc = ROUND_SCRATCH / ((int64_t)fsdp_dtype_size(lp) * I);
        nc = block_cols(nc, ROUND_MIN_COLS, O);
        struct wrows wr;
        st = wrows_init(ctx, &wr, L->weight, lp, I, nc);
        size_t es = fsdp_dtype_size(lp);
        for (int64_t c0 = 0; st == FSDP_OK && c0 < O; c0 += nc) {
            int64_t n = O - c0 < nc ? O - c0 : nc;
            fsdp__gemm_lp(lp, 0, 0, N, I, n, 1.0f, (const char *)dyl + (size_t)c0 * es, ldy, wrows(&wr, c0, n), I,
                          c0 ? 1.0f : 0.0f, din->data, I);
        }
    }
    fsdp_arena_release(ctx, mark);
    return st;
}

static void linear_destroy(struct fsdp_module *m) { free(m->impl); }

static const struct fsdp_module_ops linear_ops = {"Linear", linear_forward, linear_backward, linear_destroy};

enum fsdp_dtype fsdp__linear_input_dtype(const struct fsdp_module *m) {
    return m->ops == &linear_ops ? fsdp__compute_dtype(m) : FSDP_F32;
}

enum fsdp_status fsdp__linear_create(struct fsdp_ctx *ctx, const char *name, int64_t in, int64_t out,
                                     int bias, float init_std, struct fsdp_module **out_m) {
    if (in <= 0 || out <= 0)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "Linear '%s': sizes (%lld, %lld) must be positive", name,
                         (long long)in, (long long)out);
    struct fsdp_module *m;
    FSDP_TRY(fsdp_module_create(ctx, &linear_ops, name, &m));
    struct linear *L = fsdp__zalloc(1, sizeof *L);
    if (!L) {
        fsdp_module_free(m);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory creating Linear '%s'", name);
    }
    m->impl = L;
    L->in = in;
    L->out = out;
    int64_t wshape[2] = {out, in}, bshape[1] = {out};
    enum fsdp_status st = fsdp_module_add_param(ctx, m, "weight", 2, wshape,
                                                (struct fsdp_init){FSDP_INIT_NORMAL, init_std}, 0, &L->weight);
    if (st == FSDP_OK && bias)
        st = fsdp_module_add_param(ctx, m, "bias", 1, bshape, (struct fsdp_init){FSDP_INIT_ZEROS, 0.0f}, 1,
                                   &L->bias);
    if (st != FSDP_OK) {
        fsdp_module_free(m);
        return st;
    }
    L->weight->priv->lp_reader = 1; /* 16-bit compute reads only fsdp__pdata_lp ([Note: lazy widening]) */
    L->weight->priv->grad_writer = 1; /* [Note: unset gradients] */
    if (L->bias) L->bias->priv->grad_writer = 1;
    *out_m = m;
    return FSDP_OK;
}
