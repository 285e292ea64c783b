/*
 * precision.c - the per-module compute precision switch
 * (fsdp_module_set_compute_dtype) and the arena helper the layers use to cast
 * fp32 operands to it.
 *
 * [Note: compute precision] Every module carries compute_dtype (FSDP_F32 by
 * default: fsdp_module_create zero-fills). A layer that owns matrix products
 * (Linear; CausalSelfAttention for q k^T and att v) reads its own field at
 * each forward and backward: in FSDP_BF16 / FSDP_F16 it casts the weight from
 * the fp32 full parameter into the arena (once per forward, once per
 * backward; never cached, since values exist only while a unit is gathered)
 * and the activations as they come, multiplies with fsdp__gemm_lp (fp32
 * accumulation and output), and saves the 16-bit copy of its input for the
 * weight gradient. Everything else (LayerNorm, softmax, GELU, embeddings, the
 * loss, residual adds) is fp32, as are the tensors passed between modules
 * and the gradients accumulated in p->grad. Composites (MLP, Block, GPT) have
 * no products of their own; the setter reaches their children. A sharding
 * unit sets the dtype on its root to cover its subtree; a nested unit that
 * sets FSDP_F32 afterwards stays fp32 inside a bf16 parent (set parents first).
 *
 * [Note: 16-bit hand-off] A Linear computing in 16 bits needs only the
 * 16-bit copy of its input: for backward (the weight gradient) as for the
 * product. When that input is the fresh output of a LayerNorm, a GELU or the
 * attention heads, the producer writes it in 16 bits directly instead of an
 * fp32 tensor that the Linear casts and that would then sit unread in the
 * arena until the step ends. Likewise attention's 16-bit path needs qkv only
 * as the 16-bit copies it makes of it, so it asks c_attn for qkv in 16 bits.
 * ln_1, qkv, the heads' y, ln_2 and GELU are 10 of a Block's C-wide
 * activations per token: 10 fp32 values kept, and the 16-bit copies on top,
 * became 5 fp32 values' worth. The composite that wires them (Block, MLP,
 * CausalSelfAttention, GPT; a residual block for the BatchNorm with its
 * fused ReLU before a Conv2d, [Note: fused ReLU and 16-bit hand-off] in
 * batchnorm.c) asks for it by setting the output tensor's dtype
 * before the producer's forward, to fsdp__input_dtype(consumer); a producer
 * that honours the request (fsdp__wanted_dtype: LayerNorm, GELU, a Linear
 * computing in 16 bits) computes each row or block in fp32 as before and
 * rounds it once, so the 16-bit values are the bits the cast gave, and
 * training is bit-identical with or without the hand-off. Any other module
 * ignores the request and returns fp32, which the consumer casts as before.
 * A consumer computing in fp32 (a per-unit override) is asked for fp32.
 *
 * [Note: 16-bit output gradient] The same hand-off backwards, for the one
 * gradient that is not the library's own: the model's output gradient. A
 * Linear computing in 16 bits without a bias uses its output gradient dy
 * only as the 16-bit copy it makes of it (dW = dy^T x and dx = dy W, both
 * 16-bit products); with a bias it also sums dy in fp32. Each forward
 * records in m->priv->dout_dtype the 16-bit dtype its backward takes dy in
 * as it is (a composite whose output is such a Linear's, GPT for its
 * lm_head, passes it on), and the backward of a Linear given dy in that
 * dtype uses it without a copy. fsdp_model_backward narrows the output
 * gradient in place to that dtype when the loss wrote it over the model's
 * output in the arena (so the buffer is the library's, and nobody reads
 * the output after the loss), and hands the buffer's upper half back to the
 * arena (fsdp__arena_shrink: the output is the arena's last allocation).
 * GPT-2's logits gradient at 4 x 256 tokens is 196 MiB in fp32: the lm_head's
 * 16-bit copy of it (98 MiB) is no longer made, and backward runs in the
 * freed 98 MiB. The 16-bit values are the bits the copy had (the same
 * rounding of the same fp32 values), so training is bit-identical with or
 * without it. (The composed step now keeps the logits themselves in 16
 * bits: [Note: 16-bit model output], src/fsdp/step.c.)
 *
 * [Note: 16-bit activations] One activation is kept in 16 bits with
 * different numerics from fp32 compute: under 16-bit compute, MLP asks c_fc
 * for its output (GELU's input, which GELU keeps for backward) in the
 * compute dtype, and GELU computes in fp32 from the rounded values. This is
 * what PyTorch's autocast does (a Linear's output is in the autocast dtype,
 * and GELU runs on it), and it halves the largest activation of a Block
 * (4C per token: 72 of GPT-2's 144 MiB at 4 x 256 tokens). Which tensors
 * are 16-bit is decided in one place, fsdp__input_dtype (a GELU computing
 * in 16 bits takes 16-bit input); the rest stays as above: LayerNorm,
 * softmax, the residual stream and the loss are fp32 (the composed step's
 * logits are 16-bit: [Note: 16-bit model output], src/fsdp/step.c), and every
 * other 16-bit tensor is the exact rounding the consumer's cast would make.
 * fp32 compute is untouched (bit-identical).
 */
#include "nn/nn-impl.h"

enum fsdp_status fsdp_module_set_compute_dtype(struct fsdp_ctx *ctx, struct fsdp_module *m, enum fsdp_dtype dt) {
    if (!m) return fsdp__err(ctx, FSDP_ERR_INVALID, "fsdp_module_set_compute_dtype: module is NULL");
    if (dt != FSDP_F32 && dt != FSDP_BF16 && dt != FSDP_F16)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "module '%s': compute dtype %s is not one of f32, bf16, f16",
                         fsdp__mname(m), fsdp_dtype_name(dt));
    m->compute_dtype = dt;
    for (int i = 0; i < m->n_children; i++) FSDP_TRY(fsdp_module_set_compute_dtype(ctx, m->children[i], dt));
    return FSDP_OK;
}

/* [Note: lazy widening] A unit gathered 16-bit during a training pass
 * makes no fp32 values for its lp_reader parameters (Linear, Embedding and
 * Conv2d weights): Linear multiplies with data_lp, Embedding widens just the
 * rows it looks up and Conv2d hands the primitives its 16-bit weight (or,
 * widened, the values rounded: conv_weight in conv.c), so widening the whole
 * weight (GPT-2's tied wte alone is 38.6M elements, twice a step) would be
 * written and never read, and the pooled full buffer holding them would be
 * as large as fp32's for nothing (ResNet-18's 42 MiB at one rank).
 * So the pass's gather sizes the buffer's fp32 part for the other
 * parameters alone (biases, norms), packed end to end, and leaves an
 * lp_reader's data NULL and data_stale set (fsdp__mp_gather_finish,
 * src/fsdp/mixed.c). A reader that does need its fp32 values (a Linear set to
 * fp32 compute inside a 16-bit unit, or to another 16-bit dtype) widens a
 * copy into the arena for the product (fsdp__pdata_f32); fsdp__pdata asserts
 * that nobody reads them otherwise, and a parameter tied to by a layer that
 * is not lp_reader is not lp_reader either (hoist_tied, src/fsdp/wrap.c).
 * Every other path that gathers (summon, checkpoints, sync) widens eagerly
 * into the flat layout. The values read are the same bits either way. A
 * shard group of one has no data_lp either ([Note: 16-bit values from the
 * shard], mixed.c): its lp_readers point at the shard (data_src), and every
 * reader goes through fsdp__prows, which rounds what it reads. */
/* n elements of dt in the arena for `what` (of parameter `name`, or NULL);
 * NULL with the error set (FSDP_ERR_NOMEM) when the arena cannot hold them */
static void *arena_elems(struct fsdp_ctx *ctx, int64_t n, enum fsdp_dtype dt, const char *what, const char *name) {
    void *p = fsdp_arena_alloc(ctx, (size_t)n * fsdp_dtype_size(dt));
    if (!p)
        fsdp__arena_err(ctx, "out of memory for %s (%s%s%lld %s elements) in the activation arena", what,
                        name ? name : "", name ? ", " : "", (long long)n, fsdp_dtype_name(dt));
    return p;
}

/* n values of q's from element `at` into dst: the values fsdp__pdata would
 * show, wherever they are ([Note: lazy widening]; [Note: 16-bit values from
 * the shard] in src/fsdp/mixed.c: the fp32 values, the gathered 16-bit copy,
 * or the fp32 values that copy would be the rounding of), rounded to lp
 * (FSDP_F32: as they are) and stored as od (lp, or FSDP_F32 holding them:
 * fsdp__to_operand's forms). */
static void pvalues(const struct fsdp_param *q, size_t at, size_t n, enum fsdp_dtype lp, enum fsdp_dtype od,
                    void *dst) {
    const struct fsdp__param_priv *v = q->priv;
    enum fsdp_dtype ldt = v->data_lp_dtype;
    int lp16 = v->data_stale || (v->data_lp && od != FSDP_F32); /* read the 16-bit values, not data */
    if (!lp16) { /* fp32 values */
        fsdp__to_operand(lp, od, FSDP_F32, q->data + at, dst, n);
    } else if (lp == FSDP_F32 || lp == ldt) { /* the 16-bit values are what is asked */
        enum fsdp_dtype o = od == FSDP_F32 ? FSDP_F32 : ldt;
        if (v->data_lp) fsdp__to_operand(ldt, o, ldt, (const uint16_t *)v->data_lp + at, dst, n);
        else fsdp__to_operand(ldt, o, FSDP_F32, v->data_src + at, dst, n);
    } else { /* rounded to another 16-bit dtype: through their fp32 values, 256 at a time */
        float w[256];
        for (size_t i = 0; i < n; i += 256) {
            size_t len = n - i < 256 ? n - i : 256;
            pvalues(q, at + i, len, FSDP_F32, FSDP_F32, w);
            fsdp__to_operand(lp, od, FSDP_F32, w, (char *)dst + i * fsdp_dtype_size(od), len);
        }
    }
}

void fsdp__prows(const struct fsdp_param *p, int64_t cols, int64_t r0, int64_t nr, enum fsdp_dtype lp,
                 enum fsdp_dtype od, void *dst) {
    const struct fsdp_param *q = p->tied_to ? p->tied_to : p;
    FSDP_ASSERT(r0 >= 0 && nr >= 0 && (r0 + nr) * cols <= q->numel, "parameter '%s': rows [%lld, %lld) of %lld",
                q->fqn ? q->fqn : q->name, (long long)r0, (long long)(r0 + nr), (long long)(q->numel / cols));
    FSDP_ASSERT(q->data || q->priv->data_lp || q->priv->data_src, "parameter '%s' has no values",
                q->fqn ? q->fqn : q->name);
    FSDP_ASSERT(od == lp || od == FSDP_F32, "parameter '%s': values rounded to %s stored as %s",
                q->fqn ? q->fqn : q->name, fsdp_dtype_name(lp), fsdp_dtype_name(od));
    if (!fsdp__measuring) pvalues(q, (size_t)(r0 * cols), (size_t)(nr * cols), lp, od, dst);
}

const float *fsdp__pdata_f32(struct fsdp_ctx *ctx, struct fsdp_param *p, const char *what) {
    struct fsdp_param *q = p->tied_to ? p->tied_to : p;
    if (!q->priv->data_stale) return q->data;
    float *w = arena_elems(ctx, q->numel, FSDP_F32, what, q->fqn ? q->fqn : q->name);
    if (!w) return NULL;
    fsdp__prows(q, q->numel, 0, 1, FSDP_F32, FSDP_F32, w);
    return w;
}

enum fsdp_dtype fsdp__input_dtype(const struct fsdp_module *m) {
    enum fsdp_dtype dt = fsdp__linear_input_dtype(m);
    if (dt == FSDP_F32) dt = fsdp__attention_input_dtype(m);
    if (dt == FSDP_F32) dt = fsdp__mlp_input_dtype(m);
    if (dt == FSDP_F32) dt = fsdp__gelu_input_dtype(m); /* [Note: 16-bit activations] */
    if (dt == FSDP_F32) dt = fsdp__conv_input_dtype(m);
    return dt;
}

/* [Note: widened operands] Where the CPU has no kernels for lp
 * (fsdp_gemm_native; [Note: widened products] in gemm_lp.c), a 16-bit
 * product widens both its inputs, so an operand rounded to 16 bits only to
 * be widened again by every product that reads it is a round trip. There a
 * layer makes its operands in fp32 instead, holding the values lp rounds
 * them to (fsdp__operand_dtype: F32), and multiplies them with fp32's
 * products: the same exact products of the same values, with fp32 scratch
 * twice the size. Attention makes each head's q, k, v, probabilities and
 * dS so ([Note: heads one by one], attention.c); Linear's widened backward
 * its dy, x and W ([Note: widened backward], linear.c). */
enum fsdp_dtype fsdp__operand_dtype(enum fsdp_dtype lp) { return fsdp_gemm_native(lp) ? lp : FSDP_F32; }

void fsdp__to_operand(enum fsdp_dtype lp, enum fsdp_dtype od, enum fsdp_dtype sdt, const void *src, void *dst,
                      size_t n) {
    if (fsdp__measuring) return;
    if (sdt == lp && od == lp) memcpy(dst, src, n * fsdp_dtype_size(lp)); /* 16-bit as is */
    else if (sdt == lp) fsdp__cvt_to_f32(lp, src, dst, n);               /* widened */
    else if (od == lp) fsdp__cvt_from_f32(lp, src, dst, n);              /* fp32 cast */
    else fsdp__cvt_round(lp, src, dst, n);                               /* fp32 rounded in fp32 */
}

void *fsdp__lp_alloc(struct fsdp_ctx *ctx, enum fsdp_dtype dt, int64_t n, const char *what) {
    return arena_elems(ctx, n, dt, what, NULL);
}

void *fsdp__lp_copy(struct fsdp_ctx *ctx, enum fsdp_dtype dt, const float *src, int64_t n, const char *what) {
    void *p = fsdp__lp_alloc(ctx, dt, n, what);
    if (!p) return NULL;
    fsdp__cvt_from_f32(dt, src, p, (size_t)n);
    return p;
}

const void *fsdp__pdata_lp(struct fsdp_ctx *ctx, struct fsdp_param *p, enum fsdp_dtype dt) {
    if (dt == FSDP_F32) return fsdp__pdata_f32(ctx, p, "a weight in fp32");
    const struct fsdp_param *q = p->tied_to ? p->tied_to : p;
    if (q->priv->data_lp && q->priv->data_lp_dtype == dt) return q->priv->data_lp; /* gathered in dt: no cast */
    char what[96];
    snprintf(what, sizeof what, "%s in %s", p->fqn ? p->fqn : p->name, fsdp_dtype_name(dt));
    void *c = arena_elems(ctx, p->numel, dt, what, NULL);
    if (c) fsdp__prows(q, q->numel, 0, 1, dt, dt, c);
    return c;
}
