/*
 * gpt.c - GPT-2 as nanoGPT: the module tree, its forward/backward, the
 * configuration presets and JSON loader, and the FLOP count.
 *
 * Tree (FQNs as nanoGPT's state dict):
 *   ""            GPT          forward: tokens (B, T) I32 -> logits (B, T, V)
 *   transformer   Module       naming only
 *     wte         Embedding    (V, C)
 *     wpe         Embedding    (block_size, C)
 *     h           ModuleList   naming only
 *       0..L-1    Block
 *     ln_f        LayerNorm    (C)
 *   lm_head       Linear       C -> V, no bias; weight tied to transformer.wte.weight
 * The GPT module runs the children itself, through the dispatchers.
 * Init as GPT-2: weights N(0, 0.02), c_proj weights N(0, 0.02 / sqrt(2 L)),
 * biases 0, LayerNorm weight 1 / bias 0.
 */
#include "models/models-impl.h"
#include "nn/nn-impl.h"

#include <cJSON.h>
#include <errno.h>
#include <math.h>

struct gpt {
    struct fsdp_gpt_config cfg;
    struct fsdp_module *wte, *wpe, *ln_f, *lm_head; /* children (in the tree) */
    struct fsdp_module **h;                         /* (n_layer) blocks, owned by the tree */
    struct fsdp_tensor pos;                         /* (T) I32 positions 0..T-1, arena */
    int64_t B, T;
};

static enum fsdp_status gpt_forward(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                    const struct fsdp_tensor *in, struct fsdp_tensor *out) {
    struct gpt *G = m->impl;
    FSDP_TRY(fsdp__check_input(ctx, m, in, FSDP_I32, 2, 0));
    int64_t B = in->shape[0], T = in->shape[1], C = G->cfg.n_embd;
    if (T > G->cfg.block_size)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "GPT: sequence length T %lld exceeds block_size %d",
                         (long long)T, G->cfg.block_size);
    /* positions (T) */
    memset(&G->pos, 0, sizeof G->pos);
    int64_t tshape[1] = {T};
    FSDP_TRY(fsdp__tensor_prepare(ctx, &G->pos, FSDP_I32, 1, tshape, "GPT positions"));
    int32_t *pos = G->pos.data;
    for (int64_t t = 0; t < T; t++) pos[t] = (int32_t)t;
    /* x (B, T, C) = wte(tokens) + wpe(pos) */
    struct fsdp_tensor x = {0}, pe = {0};
    FSDP_TRY(fsdp_module_forward(G->wte, ctx, in, &x));
    FSDP_TRY(fsdp_module_forward(G->wpe, ctx, &G->pos, &pe)); /* (T, C) */
    float *xd = x.data;
    const float *ped = pe.data;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < B * T; r++) {
        float *row = xd + r * C;
        const float *p = ped + (r % T) * C;
        for (int64_t c = 0; c < C; c++) row[c] += p[c];
    }
    /* blocks: each output is a fresh buffer (each block's ln_1 saved its input) */
    for (int l = 0; l < G->cfg.n_layer; l++) {
        struct fsdp_tensor y = {0};
        FSDP_TRY(fsdp_module_forward(G->h[l], ctx, &x, &y));
        x = y;
    }
    struct fsdp_tensor xf = {0};
    xf.dtype = fsdp__input_dtype(G->lm_head); /* [Note: 16-bit hand-off] */
    FSDP_TRY(fsdp_module_forward(G->ln_f, ctx, &x, &xf));
    FSDP_TRY(fsdp_module_forward(G->lm_head, ctx, &xf, out)); /* (B, T, V) */
    G->B = B;
    G->T = T;
    return FSDP_OK;
}

/* dout: dlogits (B, T, V); din is ignored (tokens have no gradient). Scratch
 * is released at the end. */
static enum fsdp_status gpt_backward(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                     const struct fsdp_tensor *dout, struct fsdp_tensor *din) {
    (void)din;
    struct gpt *G = m->impl;
    if (!G->T) return fsdp__err(ctx, FSDP_ERR_STATE, "GPT: backward without forward");
    FSDP_TRY(fsdp__check_input(ctx, m, dout, FSDP_F32, 3, G->cfg.vocab_size));
    if (dout->shape[0] != G->B || dout->shape[1] != G->T)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "GPT: gradient is (%lld, %lld, V), forward was (%lld, %lld, V)",
                         (long long)dout->shape[0], (long long)dout->shape[1], (long long)G->B, (long long)G->T);
    int64_t B = G->B, T = G->T, C = G->cfg.n_embd;
    size_t mark = fsdp_arena_mark(ctx);
    struct fsdp_tensor g = {0}, g2 = {0}; /* (B, T, C) each: ping-pong through the blocks */
    enum fsdp_status st = fsdp_module_backward(G->lm_head, ctx, dout, &g);
    if (st == FSDP_OK) st = fsdp_module_backward(G->ln_f, ctx, &g, &g2);
    for (int l = G->cfg.n_layer - 1; l >= 0 && st == FSDP_OK; l--) {
        struct fsdp_tensor next = g;
        st = fsdp_module_backward(G->h[l], ctx, &g2, &next);
        g = g2;
        g2 = next;
    }
    if (st == FSDP_OK) st = fsdp_module_backward(G->wte, ctx, &g2, NULL);
    struct fsdp_tensor dpos = {0}; /* (T, C): the batch sum of the embedding gradient */
    int64_t pshape[2] = {T, C};
    if (st == FSDP_OK) st = fsdp__tensor_prepare(ctx, &dpos, FSDP_F32, 2, pshape, "GPT position gradient");
    if (st == FSDP_OK) {
        float *dp = dpos.data;
        const float *gd = g2.data;
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            float *row = dp + t * C;
            memcpy(row, gd + t * C, (size_t)C * sizeof(float));
            for (int64_t b = 1; b < B; b++) {
                const float *src = gd + (b * T + t) * C;
                for (int64_t c = 0; c < C; c++) row[c] += src[c];
            }
        }
        st = fsdp_module_backward(G->wpe, ctx, &dpos, NULL);
    }
    fsdp_arena_release(ctx, mark);
    return st;
}

static void gpt_destroy(struct fsdp_module *m) {
    struct gpt *G = m->impl;
    if (G) free(G->h);
    free(G);
}

static const struct fsdp_module_ops gpt_ops = {"GPT", gpt_forward, gpt_backward, gpt_destroy};

static enum fsdp_status gpt_build(struct fsdp_ctx *ctx, struct fsdp_module *root, struct gpt *G) {
    const struct fsdp_gpt_config *cfg = &G->cfg;
    int64_t C = cfg->n_embd;
    float proj_std = 0.02f / sqrtf(2.0f * (float)cfg->n_layer);
    struct fsdp_module *tr, *hl, *c;
    FSDP_TRY(fsdp__adopt(ctx, root, fsdp__container_create(ctx, "transformer", 0, &c), &c, &tr));
    FSDP_TRY(fsdp__adopt(ctx, tr, fsdp__embedding_create(ctx, "wte", cfg->vocab_size, C, 0.02f, &c), &c, &G->wte));
    FSDP_TRY(fsdp__adopt(ctx, tr, fsdp__embedding_create(ctx, "wpe", cfg->block_size, C, 0.02f, &c), &c, &G->wpe));
    FSDP_TRY(fsdp__adopt(ctx, tr, fsdp__container_create(ctx, "h", 1, &c), &c, &hl));
    for (int l = 0; l < cfg->n_layer; l++) {
        char name[16];
        snprintf(name, sizeof name, "%d", l);
        FSDP_TRY(fsdp__adopt(ctx, hl, fsdp__block_create(ctx, name, C, cfg->n_head, proj_std, &c), &c, &G->h[l]));
    }
    FSDP_TRY(fsdp__adopt(ctx, tr, fsdp__layernorm_create(ctx, "ln_f", C, &c), &c, &G->ln_f));
    FSDP_TRY(fsdp__adopt(ctx, root, fsdp__linear_create(ctx, "lm_head", C, cfg->vocab_size, 0, 0.02f, &c), &c,
                         &G->lm_head));
    /* weight tying (nanoGPT: lm_head.weight is wte.weight); both are (V, C) */
    G->lm_head->params[0]->tied_to = G->wte->params[0];
    return fsdp_module_finalize(ctx, root);
}

enum fsdp_status fsdp_gpt_create(struct fsdp_ctx *ctx, const struct fsdp_gpt_config *cfg,
                                 struct fsdp_module **out) {
    FSDP_TRY(fsdp_gpt_config_validate(ctx, cfg));
    struct fsdp_module *root;
    FSDP_TRY(fsdp_module_create(ctx, &gpt_ops, "", &root));
    struct gpt *G = fsdp__zalloc(1, sizeof *G);
    if (G) G->h = fsdp__zalloc((size_t)cfg->n_layer, sizeof *G->h);
    if (!G || !G->h) {
        if (G) free(G);
        fsdp_module_free(root);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory creating GPT");
    }
    root->impl = G;
    G->cfg = *cfg;
    enum fsdp_status st = gpt_build(ctx, root, G);
    if (st != FSDP_OK) {
        fsdp_module_free(root);
        return st;
    }
    *out = root;
    return FSDP_OK;
}

/* Per token: 2 FLOPs per multiply-add of every matmul weight (12 C^2 per
 * layer: c_attn 3, attn.c_proj 1, c_fc 4, mlp.c_proj 4; plus lm_head C V),
 * and attention's q k^T and att v: 2 * 2 * T * C per layer (full T x T). */
double fsdp_gpt_flops_per_token(const struct fsdp_gpt_config *cfg, int T) {
    double L = cfg->n_layer, C = cfg->n_embd, V = cfg->vocab_size;
    return 2.0 * (L * 12.0 * C * C + C * V) + 2.0 * 2.0 * L * (double)T * C;
}

/* ---- Configuration ---- */

static const struct {
    const char *name;
    struct fsdp_gpt_config cfg; /* n_layer, n_head, n_embd, vocab_size, block_size */
} presets[] = {
    {"tiny", {2, 2, 32, 256, 64}},
    {"small", {4, 4, 128, 256, 256}},
    {"gpt2", {12, 12, 768, 50257, 1024}},
    {"gpt2-medium", {24, 16, 1024, 50257, 1024}},
    {"gpt2-large", {36, 20, 1280, 50257, 1024}},
    {"gpt2-xl", {48, 25, 1600, 50257, 1024}},
};

enum fsdp_status fsdp_gpt_config_preset(const char *name, struct fsdp_gpt_config *cfg) {
    for (size_t i = 0; name && i < sizeof presets / sizeof presets[0]; i++)
        if (strcmp(presets[i].name, name) == 0) {
            *cfg = presets[i].cfg;
            return FSDP_OK;
        }
    return FSDP_ERR_INVALID;
}

/* [Note: config bounds]
 * Each field has a ceiling far above any model this library can train, low
 * enough that every size derived from a config (a parameter's elements, the
 * model's, a layer's row times a sequence) fits in int64 with room to spare:
 * the largest tensor, wte, has at most 2^24 * 2^17 = 2^41 elements, and the
 * whole model at most 4096 * 12 * 2^34 + 2^41 + 2^37 < 2^50. */
static const int config_max[5] = {4096, 4096, 1 << 17, 1 << 24, 1 << 20};

enum fsdp_status fsdp_gpt_config_validate(struct fsdp_ctx *ctx, const struct fsdp_gpt_config *cfg) {
    const char *names[5] = {"n_layer", "n_head", "n_embd", "vocab_size", "block_size"};
    int vals[5] = {cfg->n_layer, cfg->n_head, cfg->n_embd, cfg->vocab_size, cfg->block_size};
    for (int i = 0; i < 5; i++) {
        if (vals[i] <= 0)
            return fsdp__err(ctx, FSDP_ERR_INVALID, "GPT config: %s must be positive (got %d)", names[i], vals[i]);
        if (vals[i] > config_max[i])
            return fsdp__err(ctx, FSDP_ERR_INVALID, "GPT config: %s %d is above the largest supported, %d",
                             names[i], vals[i], config_max[i]);
    }
    if (cfg->n_embd % cfg->n_head != 0)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "GPT config: n_embd %d is not divisible by n_head %d",
                         cfg->n_embd, cfg->n_head);
    return FSDP_OK;
}

#define CONFIG_MAX_BYTES (1 << 20)

static enum fsdp_status config_parse(struct fsdp_ctx *ctx, const char *path, const cJSON *root,
                                     struct fsdp_gpt_config *cfg) {
    const char *keys[5] = {"n_layer", "n_head", "n_embd", "vocab_size", "block_size"};
    int *slots[5] = {&cfg->n_layer, &cfg->n_head, &cfg->n_embd, &cfg->vocab_size, &cfg->block_size};
    int seen[5] = {0};
    if (!cJSON_IsObject(root))
        return fsdp__err(ctx, FSDP_ERR_FORMAT, "model config '%s': expected a JSON object", path);
    for (const cJSON *it = root->child; it; it = it->next) {
        int k = -1;
        for (int i = 0; i < 5; i++)
            if (it->string && strcmp(it->string, keys[i]) == 0) k = i;
        if (k < 0)
            return fsdp__err(ctx, FSDP_ERR_FORMAT, "model config '%s': unknown key '%s' (expected n_layer, "
                             "n_head, n_embd, vocab_size, block_size)", path, it->string ? it->string : "");
        if (seen[k]) return fsdp__err(ctx, FSDP_ERR_FORMAT, "model config '%s': key '%s' appears twice", path, keys[k]);
        seen[k] = 1;
        double v = cJSON_IsNumber(it) ? it->valuedouble : NAN;
        if (!(v >= 1.0 && v <= 2147483647.0 && floor(v) == v))
            return fsdp__err(ctx, FSDP_ERR_FORMAT, "model config '%s': key '%s' must be a positive integer",
                             path, keys[k]);
        *slots[k] = (int)v;
    }
    for (int i = 0; i < 5; i++)
        if (!seen[i]) return fsdp__err(ctx, FSDP_ERR_FORMAT, "model config '%s': missing key '%s'", path, keys[i]);
    if (fsdp_gpt_config_validate(ctx, cfg) != FSDP_OK) {
        char msg[sizeof ctx->errmsg];
        snprintf(msg, sizeof msg, "%s", fsdp_errmsg(ctx));
        return fsdp__err(ctx, FSDP_ERR_INVALID, "model config '%s': %s", path, msg);
    }
    return FSDP_OK;
}

/* Parses the NUL-terminated text buf; *cfg is written only on success. */
static enum fsdp_status config_parse_text(struct fsdp_ctx *ctx, const char *path, const char *buf,
                                          struct fsdp_gpt_config *cfg) {
    cJSON *root = cJSON_Parse(buf);
    enum fsdp_status st;
    if (!root) {
        const char *at = cJSON_GetErrorPtr();
        st = fsdp__err(ctx, FSDP_ERR_FORMAT, "model config '%s': invalid JSON near byte %lld", path,
                       at ? (long long)(at - buf) : -1LL);
    } else {
        struct fsdp_gpt_config tmp;
        st = config_parse(ctx, path, root, &tmp);
        if (st == FSDP_OK) *cfg = tmp;
    }
    cJSON_Delete(root);
    return st;
}

enum fsdp_status fsdp_gpt_config_load(struct fsdp_ctx *ctx, const char *path, struct fsdp_gpt_config *cfg) {
    char *buf;
    FSDP_TRY(fsdp__read_file(ctx, "model config", path, CONFIG_MAX_BYTES, &buf, NULL));
    enum fsdp_status st = config_parse_text(ctx, path, buf, cfg);
    free(buf);
    return st;
}

enum fsdp_status fsdp__gpt_config_parse(struct fsdp_ctx *ctx, const char *name, const char *text,
                                        size_t len, struct fsdp_gpt_config *cfg) {
    if (len > CONFIG_MAX_BYTES)
        return fsdp__err(ctx, FSDP_ERR_FORMAT, "model config '%s' is larger than %d bytes", name,
                         CONFIG_MAX_BYTES);
    char *buf = fsdp__malloc(len + 1);
    if (!buf) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory reading model config '%s'", name);
    if (len) memcpy(buf, text, len);
    buf[len] = '\0';
    enum fsdp_status st = config_parse_text(ctx, name, buf, cfg);
    free(buf);
    return st;
}

/* ---- Activation planning ----
 * [Note: activation trace] fsdp__gpt_act_trace replays, over sizes only, the
 * arena allocations, marks and releases of one training step (forward, then
 * backward) of the layers in this directory, as they run under the GPT: the
 * same order, the same allocate-or-reuse decisions, checkpointed modules
 * (module.c's ckpt_forward/ckpt_backward) included. Each tr_* function below
 * mirrors the forward or backward of one layer; change them with the layer.
 * Rows are tokens (B*T, or T for the position embedding); features are the
 * last dimension. A module computing in 16 bits (fsdp__compute_dtype) adds
 * what its layer takes then: Linear's kept 16-bit input (unless handed to it
 * in 16 bits, [Note: 16-bit hand-off], which makes the producer's output
 * 16-bit instead), the cast of its weight unless gathered in that dtype (the
 * caller's `gathered` says), the 16-bit output gradient in backward;
 * attention's head-major scratch. */

struct tr {
    struct fsdp__arena_sim *s;
    int64_t B, T, nh;
    int nthr;
    enum fsdp_dtype (*gathered)(const struct fsdp_param *p, void *ud);
    void *ud;
};

static size_t f4(int64_t n) { return (size_t)n * 4u; }

/* n elements of dt */
static size_t lpb(enum fsdp_dtype dt, int64_t n) { return (size_t)n * fsdp_dtype_size(dt); }

/* fsdp__pdata_lp of Linear m's weight: a cast into the arena unless the
 * weight (its tie's definition) is gathered in dt. */
static void tr_weight_lp(struct tr *t, struct fsdp_module *m, enum fsdp_dtype dt) {
    const struct fsdp_param *p = m->params[0], *q = p->tied_to ? p->tied_to : p;
    enum fsdp_dtype g = t->gathered ? t->gathered(q, t->ud) : FSDP_F32;
    if (g != dt) fsdp__arena_sim_alloc(t->s, lpb(dt, p->numel));
}

static struct fsdp_module *tr_child(struct fsdp_module *m, const char *name) {
    for (int i = 0; i < m->n_children; i++)
        if (strcmp(m->children[i]->name, name) == 0) return m->children[i];
    FSDP_ASSERT(0, "activation trace: module '%s' has no child '%s'", m->name, name);
}

/* idt: the dtype of m's input; want: the dtype its caller asks of its
 * output ([Note: 16-bit hand-off]); both also for a checkpointed module's
 * recompute in backward. */
static int64_t tr_fwd(struct tr *t, struct fsdp_module *m, int64_t rows, int64_t in_f, enum fsdp_dtype idt,
                      enum fsdp_dtype want, int out_alloc);
static void tr_bwd(struct tr *t, struct fsdp_module *m, int64_t rows, int64_t in_f, int64_t out_f,
                   enum fsdp_dtype idt, enum fsdp_dtype want, int din_alloc);

/* Output features of m for in_f input features. */
static int64_t tr_out_f(struct fsdp_module *m, int64_t in_f) {
    const char *ty = m->ops->type;
    if (!strcmp(ty, "Linear") || !strcmp(ty, "Embedding"))
        return m->params[0]->shape[!strcmp(ty, "Linear") ? 0 : 1];
    return in_f;
}

/* The dtype m writes its output in when asked for `want`: the producers
 * that honour the request (fsdp__wanted_dtype) give it, the rest fp32. */
static enum fsdp_dtype tr_out_dt(struct fsdp_module *m, enum fsdp_dtype want) {
    const char *ty = m->ops->type;
    if (!strcmp(ty, "Linear")) return fsdp__compute_dtype(m) != FSDP_F32 ? want : FSDP_F32;
    return !strcmp(ty, "LayerNorm") || !strcmp(ty, "GELU") ? want : FSDP_F32;
}

static int64_t tr_fwd_raw(struct tr *t, struct fsdp_module *m, int64_t rows, int64_t in_f, enum fsdp_dtype idt,
                          enum fsdp_dtype want, int out_alloc) {
    const char *ty = m->ops->type;
    int64_t out_f = tr_out_f(m, in_f);
    enum fsdp_dtype odt = tr_out_dt(m, want);
    if (!strcmp(ty, "LayerNorm")) fsdp__arena_sim_alloc(t->s, f4(2 * rows)); /* statistics */
    enum fsdp_dtype lp = fsdp__compute_dtype(m);
    if (!strcmp(ty, "CausalSelfAttention")) {
        int64_t C = in_f, B = rows / t->T, BH = B * t->nh;
        struct fsdp_module *proj = tr_child(m, "c_proj");
        enum fsdp_dtype ydt = lp != FSDP_F32 ? fsdp__input_dtype(proj) : FSDP_F32;
        tr_fwd(t, tr_child(m, "c_attn"), rows, C, idt, lp, 1);      /* qkv (N, 3C), asked in lp */
        if (lp == FSDP_F32) fsdp__arena_sim_alloc(t->s, f4(BH * t->T * t->T)); /* probabilities, kept */
        fsdp__arena_sim_alloc(t->s, lpb(ydt, rows * C));             /* heads output y */
        if (lp != FSDP_F32) { /* heads_forward_lp: q k v, att in f32 and lp, y head-major; released */
            size_t mark = t->s->used;
            fsdp__arena_sim_alloc(t->s, lpb(lp, 3 * rows * C));
            fsdp__arena_sim_alloc(t->s, f4(BH * t->T * t->T));
            fsdp__arena_sim_alloc(t->s, lpb(lp, BH * t->T * t->T));
            fsdp__arena_sim_alloc(t->s, f4(rows * C));
            fsdp__arena_sim_release(t->s, mark);
        }
        return tr_fwd(t, proj, rows, C, ydt, want, out_alloc);
    }
    if (!strcmp(ty, "MLP")) {
        struct fsdp_module *proj = tr_child(m, "c_proj");
        enum fsdp_dtype gdt = fsdp__input_dtype(proj);
        int64_t h = tr_fwd(t, tr_child(m, "c_fc"), rows, in_f, idt, FSDP_F32, 1);
        tr_fwd(t, tr_child(m, "gelu"), rows, h, FSDP_F32, gdt, 1);
        return tr_fwd(t, proj, rows, h, gdt, want, out_alloc);
    }
    if (!strcmp(ty, "Block")) {
        struct fsdp_module *attn = tr_child(m, "attn"), *mlp = tr_child(m, "mlp");
        enum fsdp_dtype adt = fsdp__input_dtype(attn), cdt = fsdp__input_dtype(mlp);
        tr_fwd(t, tr_child(m, "ln_1"), rows, in_f, FSDP_F32, adt, 1);
        tr_fwd(t, attn, rows, in_f, adt, FSDP_F32, 1);
        tr_fwd(t, tr_child(m, "ln_2"), rows, in_f, FSDP_F32, cdt, 1);
        return tr_fwd(t, mlp, rows, in_f, cdt, want, out_alloc);
    }
    if (out_alloc) fsdp__arena_sim_alloc(t->s, lpb(odt, rows * out_f)); /* Linear, LayerNorm, GELU, Embedding */
    if (!strcmp(ty, "LayerNorm") && odt != FSDP_F32) { /* a row per thread, released */
        size_t mark = t->s->used;
        fsdp__arena_sim_alloc(t->s, f4((int64_t)t->nthr * out_f));
        fsdp__arena_sim_release(t->s, mark);
    }
    if (!strcmp(ty, "Linear") && lp != FSDP_F32) {
        if (idt != lp) fsdp__arena_sim_alloc(t->s, lpb(lp, rows * in_f)); /* the 16-bit input, kept */
        size_t mark = t->s->used;
        if (odt != FSDP_F32) fsdp__arena_sim_alloc(t->s, f4(rows * out_f)); /* the product before rounding */
        tr_weight_lp(t, m, lp); /* released after the product */
        fsdp__arena_sim_release(t->s, mark);
    }
    return out_f;
}

static void tr_bwd_raw(struct tr *t, struct fsdp_module *m, int64_t rows, int64_t in_f, int64_t out_f,
                       enum fsdp_dtype idt, int din_alloc) {
    const char *ty = m->ops->type;
    enum fsdp_dtype lp = fsdp__compute_dtype(m);
    if (!strcmp(ty, "CausalSelfAttention")) {
        int64_t C = in_f, BH = rows / t->T * t->nh;
        struct fsdp_module *proj = tr_child(m, "c_proj");
        enum fsdp_dtype ydt = lp != FSDP_F32 ? fsdp__input_dtype(proj) : FSDP_F32;
        tr_bwd(t, proj, rows, C, C, ydt, FSDP_F32, 1);             /* dy */
        fsdp__arena_sim_alloc(t->s, f4(rows * 3 * C));              /* dqkv */
        if (lp == FSDP_F32) fsdp__arena_sim_alloc(t->s, f4((int64_t)t->nthr * t->T * t->T)); /* scratch */
        if (lp != FSDP_F32) { /* heads_backward_lp: q k v dY, att/dS in lp, att recomputed, dS, dq dk dv */
            size_t mark = t->s->used;
            fsdp__arena_sim_alloc(t->s, lpb(lp, 4 * rows * C));
            fsdp__arena_sim_alloc(t->s, lpb(lp, BH * t->T * t->T));
            fsdp__arena_sim_alloc(t->s, f4(BH * t->T * t->T));
            fsdp__arena_sim_alloc(t->s, f4(BH * t->T * t->T));
            fsdp__arena_sim_alloc(t->s, f4(3 * rows * C));
            fsdp__arena_sim_release(t->s, mark);
        }
        tr_bwd(t, tr_child(m, "c_attn"), rows, C, 3 * C, idt, lp, din_alloc);
        return;
    }
    if (!strcmp(ty, "MLP")) {
        struct fsdp_module *fc = tr_child(m, "c_fc"), *proj = tr_child(m, "c_proj");
        enum fsdp_dtype gdt = fsdp__input_dtype(proj);
        int64_t h = tr_out_f(fc, in_f);
        tr_bwd(t, proj, rows, h, out_f, gdt, FSDP_F32, 1);          /* dg */
        tr_bwd(t, tr_child(m, "gelu"), rows, h, h, FSDP_F32, gdt, 0); /* in place */
        tr_bwd(t, fc, rows, in_f, h, idt, FSDP_F32, din_alloc);
        return;
    }
    if (!strcmp(ty, "Block")) {
        struct fsdp_module *attn = tr_child(m, "attn"), *mlp = tr_child(m, "mlp");
        enum fsdp_dtype adt = fsdp__input_dtype(attn), cdt = fsdp__input_dtype(mlp);
        if (din_alloc) fsdp__arena_sim_alloc(t->s, f4(rows * in_f));
        size_t mark = t->s->used;
        tr_bwd(t, mlp, rows, in_f, in_f, cdt, FSDP_F32, 1);                      /* dc */
        tr_bwd(t, tr_child(m, "ln_2"), rows, in_f, in_f, FSDP_F32, cdt, 1);      /* dx1 */
        tr_bwd(t, attn, rows, in_f, in_f, adt, FSDP_F32, 0);                     /* into dc */
        tr_bwd(t, tr_child(m, "ln_1"), rows, in_f, in_f, FSDP_F32, adt, 0);      /* into din */
        fsdp__arena_sim_release(t->s, mark);
        return;
    }
    if (din_alloc && strcmp(ty, "Embedding") != 0) fsdp__arena_sim_alloc(t->s, f4(rows * in_f));
    if (!strcmp(ty, "Linear") && lp != FSDP_F32) { /* 16-bit dy and weight, released */
        size_t mark = t->s->used;
        fsdp__arena_sim_alloc(t->s, lpb(lp, rows * out_f));
        tr_weight_lp(t, m, lp);
        fsdp__arena_sim_release(t->s, mark);
    }
}

/* fsdp_module_forward / _backward: checkpointed modules as module.c runs them. */
static int64_t tr_fwd(struct tr *t, struct fsdp_module *m, int64_t rows, int64_t in_f, enum fsdp_dtype idt,
                      enum fsdp_dtype want, int out_alloc) {
    if (!m->checkpoint) return tr_fwd_raw(t, m, rows, in_f, idt, want, out_alloc);
    size_t mark = t->s->used;
    int64_t out_f = tr_fwd_raw(t, m, rows, in_f, idt, want, out_alloc);
    size_t out_b = lpb(tr_out_dt(m, want), rows * out_f);
    if (out_alloc) fsdp__arena_sim_transient(t->s, out_b); /* the copy aside */
    fsdp__arena_sim_release(t->s, mark);
    if (out_alloc) fsdp__arena_sim_alloc(t->s, out_b);
    return out_f;
}

static void tr_bwd(struct tr *t, struct fsdp_module *m, int64_t rows, int64_t in_f, int64_t out_f,
                   enum fsdp_dtype idt, enum fsdp_dtype want, int din_alloc) {
    if (!m->checkpoint) {
        tr_bwd_raw(t, m, rows, in_f, out_f, idt, din_alloc);
        return;
    }
    if (din_alloc) fsdp__arena_sim_alloc(t->s, f4(rows * in_f));
    size_t mark = t->s->used;
    tr_fwd_raw(t, m, rows, in_f, idt, want, 1);
    tr_bwd_raw(t, m, rows, in_f, out_f, idt, 0);
    fsdp__arena_sim_release(t->s, mark);
}

void fsdp__gpt_act_trace(struct fsdp_module *gpt, int64_t B, int64_t T, int nthr,
                         enum fsdp_dtype (*gathered)(const struct fsdp_param *p, void *ud), void *ud,
                         struct fsdp__arena_sim *s) {
    FSDP_ASSERT(!strcmp(gpt->ops->type, "GPT"), "activation trace of a %s", gpt->ops->type);
    struct gpt *G = gpt->impl;
    struct tr t = {s, B, T, G->cfg.n_head, nthr < 1 ? 1 : nthr, gathered, ud};
    int64_t N = B * T, C = G->cfg.n_embd, V = G->cfg.vocab_size;
    FSDP_ASSERT(!gpt->checkpoint, "activation trace: checkpointing the whole GPT");
    /* forward */
    fsdp__arena_sim_alloc(s, f4(T));                               /* positions */
    const enum fsdp_dtype F = FSDP_F32, xdt = fsdp__input_dtype(G->lm_head); /* ln_f's output */
    tr_fwd(&t, G->wte, N, 1, F, F, 1);
    tr_fwd(&t, G->wpe, T, 1, F, F, 1);
    for (int l = 0; l < G->cfg.n_layer; l++) tr_fwd(&t, G->h[l], N, C, F, F, 1);
    tr_fwd(&t, G->ln_f, N, C, F, xdt, 1);
    tr_fwd(&t, G->lm_head, N, C, xdt, F, 1);                       /* logits (N, V) */
    /* backward: dlogits overwrite the logits */
    size_t mark = s->used;
    tr_bwd(&t, G->lm_head, N, C, V, xdt, F, 1);                    /* g */
    tr_bwd(&t, G->ln_f, N, C, C, F, xdt, 1);                       /* g2 */
    for (int l = G->cfg.n_layer - 1; l >= 0; l--) tr_bwd(&t, G->h[l], N, C, C, F, F, 0);
    tr_bwd(&t, G->wte, N, 1, C, F, F, 0);
    fsdp__arena_sim_alloc(s, f4(T * C));                           /* position gradient */
    tr_bwd(&t, G->wpe, T, 1, C, F, F, 0);
    fsdp__arena_sim_release(s, mark);
}
