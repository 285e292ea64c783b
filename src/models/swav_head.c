/*
 * swav_head.c - SwAV's head as VISSL builds it (SwAVPrototypesHead): a
 * projection MLP, L2 normalisation, and n_heads prototype layers
 *   projection_head: Sequential(0 Linear(in, hidden), 1 BatchNorm (hidden),
 *                    2 ReLU, 3 Linear(hidden, out_dim))   [hidden 0: 0 Linear(in, out_dim)]
 *   z = normalize(projection_head(x))                      (N, out_dim), rows of norm 1
 *   prototypes<j>: Linear(out_dim, n_prototypes, no bias), scores_j = z C_j^T
 * Output (N, out_dim + n_heads n_prototypes): z, then scores_0, scores_1, ...
 * along dim 1 (one tensor, so it is a module like any other; a loss reads the
 * slices: SwAV's loss takes the scores, a queue takes z). Names as VISSL's:
 * projection_head.0.weight, projection_head.1.running_mean,
 * prototypes0.weight. Its prototypes are the layers VISSL keeps in fp32 units
 * of their own inside the head's unit (a wrap policy by FQN does that; see
 * fsdp_swav_head_create in include/fsdp.h).
 * Backward: d z = dout's z slice + sum_j prototypes_j' (dout's scores_j
 * slice), then the normalisation and the projection.
 */
#include "nn/nn-impl.h"

#include <math.h>

struct swav_head {
    struct fsdp_swav_head_config cfg;
    struct fsdp_module *proj, *norm, **protos; /* children */
    int64_t n;                                 /* rows of the last forward */
    int ran;
};

static int64_t out_width(const struct fsdp_swav_head_config *c) { return c->out_dim + c->n_heads * c->n_prototypes; }

/* The head's 16-bit copy of z for dtype dt (of two: BF16, F16), NULL for fp32. */
static struct fsdp_tensor *z16_slot(struct fsdp_tensor *z16, enum fsdp_dtype dt) {
    return dt == FSDP_BF16 ? &z16[0] : dt == FSDP_F16 ? &z16[1] : NULL;
}

static enum fsdp_status head_forward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *in,
                                     struct fsdp_tensor *out) {
    struct swav_head *H = m->impl;
    const struct fsdp_swav_head_config *c = &H->cfg;
    FSDP_TRY(fsdp__check_input(ctx, m, in, FSDP_F32, 2, c->in_dim));
    int64_t N = in->shape[0], D = c->out_dim, K = c->n_prototypes, W = out_width(c);
    int64_t oshape[2] = {N, W};
    FSDP_TRY(fsdp__tensor_prepare(ctx, out, FSDP_F32, 2, oshape, "SwAV head output"));
    struct fsdp_tensor h = {0}, z = {0};
    FSDP_TRY(fsdp_module_forward(H->proj, ctx, in, &h));
    FSDP_TRY(fsdp_module_forward(H->norm, ctx, &h, &z));
    float *o = out->data;
    const float *zd = z.data;
    for (int64_t i = 0; i < N; i++) memcpy(o + i * W, zd + i * D, (size_t)D * sizeof(float));
    /* [Note: prototypes' input in their dtype] A prototype layer computing
     * in 16 bits keeps a 16-bit copy of z for its backward: made by the layer
     * itself it would lie above the mark each head releases its scores to,
     * and be overwritten before backward (a bf16 head in a bf16 unit trained
     * on freed bytes). So z goes to it already rounded to its dtype ([Note:
     * 16-bit hand-off]), one copy per dtype made below the marks, which the
     * layer keeps as its saved copy: the same values it would round. */
    struct fsdp_tensor z16[2] = {{0}, {0}}; /* BF16, F16 */
    for (int j = 0; j < c->n_heads; j++) {
        enum fsdp_dtype dt = fsdp__input_dtype(H->protos[j]);
        struct fsdp_tensor *t = z16_slot(z16, dt);
        if (!t || t->data) continue;
        FSDP_TRY(fsdp__tensor_prepare(ctx, t, dt, 2, z.shape, "SwAV head's 16-bit embedding"));
        if (!fsdp__measuring) fsdp__cvt_from_f32(dt, zd, t->data, (size_t)(N * D));
    }
    for (int j = 0; j < c->n_heads; j++) {
        struct fsdp_tensor s = {0};
        const struct fsdp_tensor *zin = z16_slot(z16, fsdp__input_dtype(H->protos[j]));
        if (!zin) zin = &z;
        size_t mark = fsdp_arena_mark(ctx);
        FSDP_TRY(fsdp_module_forward(H->protos[j], ctx, zin, &s));
        const float *sd = s.data;
        for (int64_t i = 0; i < N; i++) memcpy(o + i * W + D + j * K, sd + i * K, (size_t)K * sizeof(float));
        /* a prototype layer saves its input (z), not its output: the scores
         * can go (in eval mode nothing is saved at all) */
        fsdp_arena_release(ctx, mark);
    }
    H->n = N;
    H->ran = 1;
    return FSDP_OK;
}

static enum fsdp_status head_backward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *dout,
                                      struct fsdp_tensor *din) {
    struct swav_head *H = m->impl;
    const struct fsdp_swav_head_config *c = &H->cfg;
    if (!H->ran) return fsdp__err(ctx, FSDP_ERR_STATE, "SwAVHead '%s': backward without forward", fsdp__mname(m));
    int64_t N = H->n, D = c->out_dim, K = c->n_prototypes, W = out_width(c);
    FSDP_TRY(fsdp__check_input(ctx, m, dout, FSDP_F32, 2, W));
    if (dout->shape[0] != N)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "SwAVHead '%s': gradient has %lld rows, forward had %lld",
                         fsdp__mname(m), (long long)dout->shape[0], (long long)N);
    if (din) {
        int64_t ishape[2] = {N, c->in_dim};
        FSDP_TRY(fsdp__tensor_prepare(ctx, din, FSDP_F32, 2, ishape, "SwAV head input gradient"));
    }
    size_t mark = fsdp_arena_mark(ctx);
    enum fsdp_status st = FSDP_OK;
    float *dz = fsdp__scratch(ctx, N * D, "SwAV head embedding gradient");
    float *ds = dz ? fsdp__scratch(ctx, N * K, "SwAV head score gradient") : NULL;
    if (!ds) st = FSDP_ERR_NOMEM;
    const float *g = dout->data;
    for (int64_t i = 0; st == FSDP_OK && i < N; i++) memcpy(dz + i * D, g + i * W, (size_t)D * sizeof(float));
    int64_t zshape[2] = {N, D}, sshape[2] = {N, K};
    /* backward in reverse order of the forward, as the units' hooks expect */
    for (int j = c->n_heads - 1; st == FSDP_OK && j >= 0; j--) {
        for (int64_t i = 0; i < N; i++) memcpy(ds + i * K, g + i * W + D + j * K, (size_t)K * sizeof(float));
        struct fsdp_tensor dst = {ds, FSDP_F32, 2, {sshape[0], sshape[1]}, FSDP_LAYOUT_PLAIN}, dzj = {0};
        size_t m2 = fsdp_arena_mark(ctx);
        st = fsdp_module_backward(H->protos[j], ctx, &dst, &dzj);
        if (st == FSDP_OK) {
            const float *a = dzj.data;
            for (int64_t i = 0; i < N * D; i++) dz[i] += a[i];
        }
        fsdp_arena_release(ctx, m2);
    }
    struct fsdp_tensor dzt = {dz, FSDP_F32, 2, {zshape[0], zshape[1]}, FSDP_LAYOUT_PLAIN}, dh = {0};
    if (st == FSDP_OK) st = fsdp_module_backward(H->norm, ctx, &dzt, &dh);
    if (st == FSDP_OK) st = fsdp_module_backward(H->proj, ctx, &dh, din);
    fsdp_arena_release(ctx, mark);
    H->ran = 0;
    return st;
}

static void head_destroy(struct fsdp_module *m) {
    struct swav_head *H = m->impl;
    if (H) free(H->protos);
    free(H);
}

static const struct fsdp_module_ops head_ops = {"SwAVHead", head_forward, head_backward, head_destroy};

struct fsdp_swav_head_config fsdp_swav_head_config_default(int64_t in_dim) {
    struct fsdp_swav_head_config c = {in_dim, 2048, 128, 3000, 1};
    return c;
}

enum fsdp_status fsdp_swav_head_create(struct fsdp_ctx *ctx, const char *name, const struct fsdp_swav_head_config *cfg,
                                       struct fsdp_module **out) {
    const struct fsdp_swav_head_config *c = cfg;
    const int64_t big = (int64_t)1 << 24;
    if (c->in_dim < 1 || c->in_dim > big || c->hidden_dim < 0 || c->hidden_dim > big || c->out_dim < 1 ||
        c->out_dim > big || c->n_prototypes < 1 || c->n_prototypes > big || c->n_heads < 1 || c->n_heads > 64)
        return fsdp__err(ctx, FSDP_ERR_INVALID,
                         "SwAV head '%s': in_dim %lld, hidden_dim %lld, out_dim %lld, n_prototypes %lld, n_heads %d: "
                         "each must be positive (hidden_dim may be 0), n_heads at most 64",
                         name, (long long)c->in_dim, (long long)c->hidden_dim, (long long)c->out_dim,
                         (long long)c->n_prototypes, c->n_heads);
    struct fsdp_module *m;
    FSDP_TRY(fsdp_module_create(ctx, &head_ops, name, &m));
    struct swav_head *H = fsdp__zalloc(1, sizeof *H);
    if (H) H->protos = fsdp__zalloc((size_t)c->n_heads, sizeof *H->protos);
    if (!H || !H->protos) {
        if (H) free(H);
        fsdp_module_free(m);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory creating SwAV head '%s'", name);
    }
    m->impl = H;
    H->cfg = *c;
    struct fsdp_module *t = NULL;
    enum fsdp_status st = fsdp__adopt(ctx, m, fsdp_sequential_create(ctx, "projection_head", &t), &t, &H->proj);
    int64_t first_out = c->hidden_dim ? c->hidden_dim : c->out_dim;
    /* PyTorch's Linear init is uniform(+-1/sqrt(in)); ours is the normal of the same variance */
    if (st == FSDP_OK)
        st = fsdp__adopt(ctx, H->proj, fsdp__linear_create(ctx, "0", c->in_dim, first_out, 1,
                                                            (float)(1.0 / sqrt(3.0 * (double)c->in_dim)), &t), &t, NULL);
    if (st == FSDP_OK && c->hidden_dim) {
        struct fsdp_batchnorm_opts bo = fsdp_batchnorm_opts_default(c->hidden_dim);
        st = fsdp__adopt(ctx, H->proj, fsdp_batchnorm2d_create(ctx, "1", &bo, &t), &t, NULL);
        if (st == FSDP_OK) st = fsdp__adopt(ctx, H->proj, fsdp_relu_create(ctx, "2", &t), &t, NULL);
        if (st == FSDP_OK)
            st = fsdp__adopt(ctx, H->proj, fsdp__linear_create(ctx, "3", c->hidden_dim, c->out_dim, 1,
                                                                (float)(1.0 / sqrt(3.0 * (double)c->hidden_dim)), &t),
                             &t, NULL);
    }
    if (st == FSDP_OK) st = fsdp__adopt(ctx, m, fsdp_l2norm_create(ctx, "l2norm", 1e-12f, &t), &t, &H->norm);
    for (int j = 0; st == FSDP_OK && j < c->n_heads; j++) {
        char pn[24];
        snprintf(pn, sizeof pn, "prototypes%d", j);
        st = fsdp__adopt(ctx, m, fsdp__linear_create(ctx, pn, c->out_dim, c->n_prototypes, 0,
                                                      (float)(1.0 / sqrt(3.0 * (double)c->out_dim)), &t),
                         &t, &H->protos[j]);
    }
    if (st != FSDP_OK) {
        fsdp_module_free(m);
        return st;
    }
    *out = m;
    return FSDP_OK;
}

/* ---- The model: trunk, then head ---- */

struct swav_model {
    struct fsdp__chain chain; /* first: freed as one (fsdp__chain_free); children trunk, head
                                 ([Note: backward releases the blocks] as Sequential's: a
                                 ResNet trunk releases its layers too) */
    int trunk_only;
};

static enum fsdp_status model_forward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *in,
                                      struct fsdp_tensor *out) {
    struct swav_model *S = m->impl;
    FSDP_TRY(fsdp__check_input_any(ctx, m, in, FSDP_F32, 0, 0));
    return fsdp__chain_forward(m, ctx, &S->chain, S->trunk_only ? 1 : 2, in, out);
}

static enum fsdp_status model_backward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *dout,
                                       struct fsdp_tensor *din) {
    struct swav_model *S = m->impl;
    return fsdp__chain_backward(m, ctx, &S->chain, dout, din);
}

static void model_destroy(struct fsdp_module *m) {
    struct swav_model *S = m->impl;
    fsdp__chain_free(S ? &S->chain : NULL);
}

static const struct fsdp_module_ops model_ops = {"SwAV", model_forward, model_backward, model_destroy};

enum fsdp_status fsdp_swav_model_create(struct fsdp_ctx *ctx, const char *name, struct fsdp_module *trunk,
                                        struct fsdp_module *head, struct fsdp_module **out) {
    struct fsdp_module *m = NULL;
    enum fsdp_status st = trunk && head ? FSDP_OK
                                        : fsdp__err(ctx, FSDP_ERR_INVALID, "SwAV model '%s': %s is NULL", name,
                                                    trunk ? "the head" : "the trunk");
    struct swav_model *S = NULL;
    if (st == FSDP_OK) st = fsdp_module_create(ctx, &model_ops, name, &m);
    if (st == FSDP_OK && !(S = fsdp__zalloc(1, sizeof *S)))
        st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory creating SwAV model '%s'", name);
    if (st != FSDP_OK) { /* the model takes trunk and head, also on failure */
        if (m) fsdp_module_free(m);
        if (trunk) fsdp_module_free(trunk);
        if (head) fsdp_module_free(head);
        return st;
    }
    m->impl = S;
    struct fsdp_module *t = trunk;
    st = fsdp__adopt(ctx, m, FSDP_OK, &t, NULL);
    t = head;
    if (st == FSDP_OK) st = fsdp__adopt(ctx, m, FSDP_OK, &t, NULL);
    else fsdp_module_free(head);
    if (st == FSDP_OK) st = fsdp_module_finalize(ctx, m);
    if (st != FSDP_OK) {
        fsdp_module_free(m);
        return st;
    }
    *out = m;
    return FSDP_OK;
}

enum fsdp_status fsdp_swav_model_set_trunk_only(struct fsdp_ctx *ctx, struct fsdp_module *m, int on) {
    if (!m || m->ops != &model_ops)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "set_trunk_only: module '%s' is not a SwAV model",
                         m ? fsdp__mname(m) : "(null)");
    struct swav_model *S = m->impl;
    S->trunk_only = on != 0;
    return FSDP_OK;
}
