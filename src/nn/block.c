/*
 * block.c - the composite layers of GPT-2: MLP (c_fc, gelu, c_proj) and the
 * pre-LN transformer Block (x += attn(ln_1(x)); x += mlp(ln_2(x))), plus the
 * naming-only containers ("Module", "ModuleList"). Composites call their
 * children only through fsdp_module_forward/backward so unit hooks run; they
 * save nothing themselves (each child saves what its backward needs). They
 * ask each producer for its consumer's input dtype ([Note: 16-bit hand-off]).
 */
#include "nn/nn-impl.h"

/* ---- MLP ---- */

struct mlp {
    struct fsdp_module *c_fc, *gelu, *c_proj; /* children */
};

static enum fsdp_status mlp_forward(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                    const struct fsdp_tensor *in, struct fsdp_tensor *out) {
    struct mlp *M = m->impl;
    struct fsdp_tensor h = {0}, g = {0};                  /* (..., 4C) each */
    g.dtype = fsdp__input_dtype(M->c_proj);
    h.dtype = fsdp__input_dtype(M->gelu); /* 16-bit under 16-bit compute: [Note: 16-bit activations] */
    FSDP_TRY(fsdp_module_forward(M->c_fc, ctx, in, &h));
    FSDP_TRY(fsdp_module_forward(M->gelu, ctx, &h, &g));  /* gelu saves h */
    return fsdp_module_forward(M->c_proj, ctx, &g, out);  /* c_proj saves g */
}

static enum fsdp_status mlp_backward(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                     const struct fsdp_tensor *dout, struct fsdp_tensor *din) {
    struct mlp *M = m->impl;
    struct fsdp_tensor dg = {0};                                  /* (..., 4C) */
    FSDP_TRY(fsdp_module_backward(M->c_proj, ctx, dout, &dg));
    struct fsdp_tensor dh = dg;                                   /* in place */
    FSDP_TRY(fsdp_module_backward(M->gelu, ctx, &dg, &dh));
    return fsdp_module_backward(M->c_fc, ctx, &dh, din);
}

static void composite_destroy(struct fsdp_module *m) { free(m->impl); }

static const struct fsdp_module_ops mlp_ops = {"MLP", mlp_forward, mlp_backward, composite_destroy};

enum fsdp_dtype fsdp__mlp_input_dtype(const struct fsdp_module *m) {
    return m->ops == &mlp_ops ? fsdp__input_dtype(((const struct mlp *)m->impl)->c_fc) : FSDP_F32;
}

enum fsdp_status fsdp__mlp_create(struct fsdp_ctx *ctx, const char *name, int64_t C, float proj_std,
                                  struct fsdp_module **out_m) {
    struct fsdp_module *m, *c;
    FSDP_TRY(fsdp_module_create(ctx, &mlp_ops, name, &m));
    struct mlp *M = fsdp__zalloc(1, sizeof *M);
    if (!M) {
        fsdp_module_free(m);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory creating MLP '%s'", name);
    }
    m->impl = M;
    enum fsdp_status st = fsdp__adopt(ctx, m, fsdp__linear_create(ctx, "c_fc", C, 4 * C, 1, 0.02f, &c), &c,
                                      &M->c_fc);
    if (st == FSDP_OK) st = fsdp__adopt(ctx, m, fsdp__gelu_create(ctx, "gelu", &c), &c, &M->gelu);
    if (st == FSDP_OK)
        st = fsdp__adopt(ctx, m, fsdp__linear_create(ctx, "c_proj", 4 * C, C, 1, proj_std, &c), &c, &M->c_proj);
    if (st != FSDP_OK) {
        fsdp_module_free(m);
        return st;
    }
    *out_m = m;
    return FSDP_OK;
}

/* ---- Block ---- */

struct block {
    int64_t C;
    struct fsdp_module *ln_1, *attn, *ln_2, *mlp; /* children */
    void *window; /* (window_bytes) bytes lent by the model, or NULL ([Note: LayerNorm outputs rebuilt]) */
    size_t window_bytes;
};

/* [Note: LayerNorm outputs rebuilt] A Block's LayerNorms hand their outputs
 * to c_attn and c_fc (in 16 bits on the 16-bit path: [Note: 16-bit
 * hand-off], precision.c), which keep them for their weight gradients. Each
 * output is a function of what the LayerNorm keeps for its own backward
 * anyway (its fp32 input, the rows' means and deviations), so the Block
 * keeps neither: both LayerNorms write their outputs into a window the model
 * lends the Block (fsdp__block_set_window), the consumers keep pointers into
 * it as they would into tensors of their own, and the Block's backward writes
 * each output there again just before its consumer's backward reads it
 * (fsdp__layernorm_rebuild runs the forward's own row loop: the same bits):
 * ln_2's before the MLP's backward, then ln_1's before the attention's. GPT
 * lends block l the buffer of its gradient stream that the block's backward
 * writes its input gradient into ([Note: backward releases the blocks],
 * gpt.c; fp32 (B, T, C)), which nothing reads through the forward and which
 * in the backward is free until ln_1's backward writes it, after the
 * attention's backward, the window's last reader: the window costs nothing.
 * GPT-2 at 4 x 256 tokens keeps 24 x 3 MiB less at the step's peak in fp32
 * (ln_f's backward), 24 x 1.5 in bf16 (the lm_head's forward), for two passes
 * over a LayerNorm's input a Block in backward, within the noise of the
 * step's time (bench/README.md: the dW products read the operand from a
 * window in cache). A checkpointed Block or attention re-runs its forward
 * into the same window before the rebuild. A LayerNorm that is a unit of its
 * own (whose parameters could be resharded before the rebuild) or is
 * checkpointed itself (its output is copied out of the window) is not lent
 * the window; GPT lends none under FSDP_LN_REBUILD=0, which keeps the outputs
 * (tests/test_mpi_plan.c checks the same bits either way). */
void fsdp__block_set_window(struct fsdp_module *m, void *window, size_t bytes) {
    struct block *K = m->impl;
    K->window = window;
    K->window_bytes = bytes;
}

/* ln's next forward writes its output (n elements of dt) into the window where
 * it fits */
static void lend(struct block *K, struct fsdp_module *ln, enum fsdp_dtype dt, int64_t n) {
    if (K->window && (size_t)n * fsdp_dtype_size(dt) <= K->window_bytes && !ln->priv->hooks && !ln->checkpoint)
        fsdp__layernorm_write_into(ln, K->window);
}

static void add_into(float *dst, const float *src, int64_t n) {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < (fsdp__measuring ? 0 : n); i++) dst[i] += src[i];
}

static enum fsdp_status block_forward(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                      const struct fsdp_tensor *in, struct fsdp_tensor *out) {
    struct block *K = m->impl;
    FSDP_TRY(fsdp__check_input(ctx, m, in, FSDP_F32, 3, K->C));
    int64_t n = fsdp_tensor_numel(in);
    struct fsdp_tensor a = {0}, x1 = {0}, c = {0};     /* (B, T, C) each */
    a.dtype = fsdp__input_dtype(K->attn);
    c.dtype = fsdp__input_dtype(K->mlp);
    lend(K, K->ln_1, a.dtype, n); /* [Note: LayerNorm outputs rebuilt] */
    FSDP_TRY(fsdp_module_forward(K->ln_1, ctx, in, &a)); /* ln_1 saves x: never written */
    FSDP_TRY(fsdp_module_forward(K->attn, ctx, &a, &x1));
    add_into(x1.data, in->data, n);                       /* x1 = x + attn(ln_1(x)) */
    lend(K, K->ln_2, c.dtype, n);
    FSDP_TRY(fsdp_module_forward(K->ln_2, ctx, &x1, &c)); /* ln_2 saves x1; c may overwrite a */
    FSDP_TRY(fsdp_module_forward(K->mlp, ctx, &c, out));
    add_into(out->data, x1.data, n);                      /* out = x1 + mlp(ln_2(x1)) */
    return FSDP_OK;
}

/* dx1 = dy + ln_2'(mlp'(dy));  dx = dx1 + ln_1'(attn'(dx1)). Scratch is
 * released at the end; din may equal dout (dout is consumed before din is
 * written). */
static enum fsdp_status block_backward(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                       const struct fsdp_tensor *dout, struct fsdp_tensor *din) {
    struct block *K = m->impl;
    FSDP_TRY(fsdp__check_input(ctx, m, dout, FSDP_F32, 3, K->C));
    int64_t n = fsdp_tensor_numel(dout);
    if (din) FSDP_TRY(fsdp__tensor_prepare(ctx, din, FSDP_F32, 3, dout->shape, "Block input gradient"));
    size_t mark = fsdp_arena_mark(ctx);
    struct fsdp_tensor dc = {0}, dx1 = {0}; /* (B, T, C) each */
    /* [Note: LayerNorm outputs rebuilt]: each just before its reader's backward */
    enum fsdp_status st = fsdp__layernorm_rebuild(K->ln_2, ctx);
    if (st == FSDP_OK) st = fsdp_module_backward(K->mlp, ctx, dout, &dc);
    if (st == FSDP_OK) st = fsdp_module_backward(K->ln_2, ctx, &dc, &dx1);
    if (st == FSDP_OK) st = fsdp__layernorm_rebuild(K->ln_1, ctx);
    if (st == FSDP_OK) {
        add_into(dx1.data, dout->data, n);
        struct fsdp_tensor da = dc;             /* reuses dc's buffer */
        st = fsdp_module_backward(K->attn, ctx, &dx1, &da);
        if (st == FSDP_OK) st = fsdp_module_backward(K->ln_1, ctx, &da, din);
        if (st == FSDP_OK && din) add_into(din->data, dx1.data, n);
    }
    fsdp_arena_release(ctx, mark);
    return st;
}

static const struct fsdp_module_ops block_ops = {"Block", block_forward, block_backward, composite_destroy};

struct fsdp_module *fsdp__block_attention(struct fsdp_module *m) { return ((struct block *)m->impl)->attn; }

enum fsdp_status fsdp__block_create(struct fsdp_ctx *ctx, const char *name, int64_t C, int n_head,
                                    float proj_std, struct fsdp_module **out_m) {
    struct fsdp_module *m, *c;
    FSDP_TRY(fsdp_module_create(ctx, &block_ops, name, &m));
    struct block *K = fsdp__zalloc(1, sizeof *K);
    if (!K) {
        fsdp_module_free(m);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory creating Block '%s'", name);
    }
    m->impl = K;
    K->C = C;
    enum fsdp_status st = fsdp__adopt(ctx, m, fsdp__layernorm_create(ctx, "ln_1", C, &c), &c, &K->ln_1);
    if (st == FSDP_OK)
        st = fsdp__adopt(ctx, m, fsdp__attention_create(ctx, "attn", C, n_head, proj_std, &c), &c, &K->attn);
    if (st == FSDP_OK) st = fsdp__adopt(ctx, m, fsdp__layernorm_create(ctx, "ln_2", C, &c), &c, &K->ln_2);
    if (st == FSDP_OK) st = fsdp__adopt(ctx, m, fsdp__mlp_create(ctx, "mlp", C, proj_std, &c), &c, &K->mlp);
    if (st != FSDP_OK) {
        fsdp_module_free(m);
        return st;
    }
    *out_m = m;
    return FSDP_OK;
}

/* ---- Containers (naming only) ---- */

static enum fsdp_status container_forward(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                          const struct fsdp_tensor *in, struct fsdp_tensor *out) {
    (void)in;
    (void)out;
    return fsdp__err(ctx, FSDP_ERR_UNSUPPORTED, "%s '%s' is a container: run its children instead",
                     m->ops->type, fsdp__mname(m));
}

static enum fsdp_status container_backward(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                           const struct fsdp_tensor *dout, struct fsdp_tensor *din) {
    return container_forward(m, ctx, dout, din);
}

static const struct fsdp_module_ops module_ops = {"Module", container_forward, container_backward, NULL};
static const struct fsdp_module_ops module_list_ops = {"ModuleList", container_forward, container_backward,
                                                       NULL};

enum fsdp_status fsdp__container_create(struct fsdp_ctx *ctx, const char *name, int is_list,
                                        struct fsdp_module **out_m) {
    return fsdp_module_create(ctx, is_list ? &module_list_ops : &module_ops, name, out_m);
}
