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
#include "io/io-impl.h"
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
    struct fsdp_tensor grad[2];                     /* (B, T, C) F32 each, arena, below the blocks:
                                                       backward's gradient stream ([Note: backward
                                                       releases the blocks]) */
    size_t *marks;                                  /* (n_layer + 1) arena marks before each block's
                                                       forward and before ln_f's */
    int64_t B, T;
    int64_t cache_B, cache_cap, cache_len; /* fsdp_gpt_set_cache's, and the positions decoded */
};

static enum fsdp_status gpt_forward(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                    const struct fsdp_tensor *in, struct fsdp_tensor *out) {
    struct gpt *G = m->impl;
    FSDP_TRY(fsdp__check_input(ctx, m, in, FSDP_I32, 2, 0));
    int64_t B = in->shape[0], T = in->shape[1], C = G->cfg.n_embd;
    if (T > G->cfg.block_size)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "GPT: sequence length T %lld exceeds block_size %d",
                         (long long)T, G->cfg.block_size);
    int64_t at = 0; /* the first position */
    G->B = G->T = 0;
    if (G->cache_cap) { /* [Note: decoding cache] (attention.c): positions at..at+T-1 only */
        if (m->training)
            return fsdp__err(ctx, FSDP_ERR_STATE, "GPT: a decoding cache is set (fsdp_gpt_set_cache): its "
                             "forwards run in eval mode; free it (a cap of 0) to train");
        if (B != G->cache_B || G->cache_len + T > G->cache_cap)
            return fsdp__err(ctx, FSDP_ERR_INVALID, "GPT: positions %lld..%lld of %lld sequences do not fit the "
                             "decoding cache of %lld positions of %lld sequences (fsdp_gpt_set_cache starts over)",
                             (long long)G->cache_len, (long long)(G->cache_len + T - 1), (long long)B,
                             (long long)G->cache_cap, (long long)G->cache_B);
        at = G->cache_len;
        for (int l = 0; l < G->cfg.n_layer; l++) fsdp__attention_cache_at(fsdp__block_attention(G->h[l]), at);
    }
    /* positions (T) */
    memset(&G->pos, 0, sizeof G->pos);
    int64_t tshape[1] = {T};
    FSDP_TRY(fsdp__tensor_prepare(ctx, &G->pos, FSDP_I32, 1, tshape, "GPT positions"));
    int32_t *pos = G->pos.data;
    for (int64_t t = 0; t < T; t++) pos[t] = (int32_t)(at + t);
    /* x (B, T, C) = wte(tokens) + wpe(pos) */
    struct fsdp_tensor x = {0}, pe = {0};
    FSDP_TRY(fsdp_module_forward(G->wte, ctx, in, &x));
    FSDP_TRY(fsdp_module_forward(G->wpe, ctx, &G->pos, &pe)); /* (T, C) */
    float *xd = x.data;
    const float *ped = pe.data;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < (fsdp__measuring ? 0 : B * T); r++) {
        float *row = xd + r * C;
        const float *p = ped + (r % T) * C;
        for (int64_t c = 0; c < C; c++) row[c] += p[c];
    }
    /* backward's two gradient buffers, below the blocks ([Note: backward releases the blocks]) */
    memset(G->grad, 0, sizeof G->grad);
    int64_t gshape[3] = {B, T, C};
    for (int k = 0; k < 2 && m->training; k++)
        FSDP_TRY(fsdp__tensor_prepare(ctx, &G->grad[k], FSDP_F32, 3, gshape, "GPT gradient stream"));
    int lend = m->training && fsdp__env_checked("FSDP_LN_REBUILD", 1);
    /* blocks: each output is a fresh buffer (each block's ln_1 saved its input) */
    for (int l = 0; l < G->cfg.n_layer; l++) {
        struct fsdp_tensor y = {0};
        /* block l's backward writes its input gradient into grad[(n_layer - 1 - l) % 2] (the
           ping-pong below): its window until then ([Note: LayerNorm outputs rebuilt], block.c) */
        const struct fsdp_tensor *w = &G->grad[(G->cfg.n_layer - 1 - l) % 2];
        fsdp__block_set_window(G->h[l], lend ? w->data : NULL, lend ? (size_t)(B * T * C) * sizeof(float) : 0);
        G->marks[l] = fsdp_arena_mark(ctx);
        FSDP_TRY(fsdp_module_forward(G->h[l], ctx, &x, &y));
        x = y;
    }
    G->marks[G->cfg.n_layer] = fsdp_arena_mark(ctx);
    if (G->cache_cap && T > 1) { /* decoding: the logits of each sequence's last position only */
        struct fsdp_tensor xl = {0};
        int64_t lshape[3] = {B, 1, C};
        FSDP_TRY(fsdp__tensor_prepare(ctx, &xl, FSDP_F32, 3, lshape, "GPT last positions"));
        for (int64_t b = 0; b < (fsdp__measuring ? 0 : B); b++)
            memcpy((float *)xl.data + b * C, (const float *)x.data + (b * T + T - 1) * C, (size_t)C * sizeof(float));
        x = xl;
    }
    struct fsdp_tensor xf = {0};
    xf.dtype = fsdp__input_dtype(G->lm_head); /* [Note: 16-bit hand-off] */
    FSDP_TRY(fsdp_module_forward(G->ln_f, ctx, &x, &xf));
    FSDP_TRY(fsdp_module_forward(G->lm_head, ctx, &xf, out)); /* (B, T, V) */
    m->priv->dout_dtype = G->lm_head->priv->dout_dtype; /* dlogits go to lm_head as they come */
    m->priv->dout_layout = G->lm_head->priv->dout_layout;
    if (G->cache_cap) { /* nothing for a backward */
        G->cache_len += T;
        return FSDP_OK;
    }
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
    enum fsdp_dtype ddt = dout && dout->dtype == m->priv->dout_dtype ? m->priv->dout_dtype : FSDP_F32;
    /* [Note: 16-bit output gradient]: 16-bit dlogits may come in padded rows, for lm_head */
    FSDP_TRY(ddt != FSDP_F32 ? fsdp__check_input_rows16(ctx, m, dout, ddt, 3, G->cfg.vocab_size)
                             : fsdp__check_input(ctx, m, dout, ddt, 3, G->cfg.vocab_size));
    if (dout->shape[0] != G->B || dout->shape[1] != G->T)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "GPT: gradient is (%lld, %lld, V), forward was (%lld, %lld, V)",
                         (long long)dout->shape[0], (long long)dout->shape[1], (long long)G->B, (long long)G->T);
    int64_t B = G->B, T = G->T, C = G->cfg.n_embd;
    size_t mark = fsdp_arena_mark(ctx);
    /* [Note: backward releases the blocks] When dlogits are the library's
     * (the output gradient fsdp_model_backward hands over in place,
     * ctx->dead_dout), nothing above the blocks' forward is read after ln_f's
     * backward and nothing of block l's after its own: the gradient runs
     * through the two buffers the forward made below the blocks, and the
     * arena is released to ln_f's mark, then to each block's mark as its
     * backward ends. GPT-2's dlogits (98 MiB in 16 bits, 196 in fp32 at 4 x
     * 256 tokens) and every block's saved activations go back as backward
     * passes them, and the gradient shards born in backward take their pages
     * ([Note: gradient shards born in backward], src/fsdp/unit.c). The dead
     * gradient is handed to one module (ctx->dead_for: the root, fsdp__dout_dead
     * in nn-impl.h); a releasing module may hand its children theirs in turn
     * (ResNet and Sequential: each child's input gradient moved down to where
     * the child's forward began, fsdp__release_to in resblock.c), a module
     * that does not never does, so nothing releases below a caller that may
     * still read its own buffers. */
    int release = fsdp__dout_dead(ctx, m, dout) && G->grad[0].data && G->grad[1].data &&
                  fsdp_tensor_numel(&G->grad[0]) == B * T * C;
    struct fsdp_tensor g = {0}, g2 = {0}; /* (B, T, C) each: ping-pong through the blocks */
    if (release) g = G->grad[0], g2 = G->grad[1];
    enum fsdp_status st = fsdp_module_backward(G->lm_head, ctx, dout, &g);
    if (st == FSDP_OK) st = fsdp_module_backward(G->ln_f, ctx, &g, &g2);
    if (st == FSDP_OK && release) fsdp_arena_release(ctx, G->marks[G->cfg.n_layer]);
    for (int l = G->cfg.n_layer - 1; l >= 0 && st == FSDP_OK; l--) {
        struct fsdp_tensor next = g;
        st = fsdp_module_backward(G->h[l], ctx, &g2, &next);
        g = g2;
        g2 = next;
        if (st == FSDP_OK && release) fsdp_arena_release(ctx, G->marks[l]);
    }
    if (st == FSDP_OK) st = fsdp_module_backward(G->wte, ctx, &g2, NULL);
    struct fsdp_tensor dpos = {0}; /* (T, C): the batch sum of the embedding gradient */
    int64_t pshape[2] = {T, C};
    if (st == FSDP_OK) st = fsdp__tensor_prepare(ctx, &dpos, FSDP_F32, 2, pshape, "GPT position gradient");
    if (st == FSDP_OK) {
        float *dp = dpos.data;
        const float *gd = g2.data;
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < (fsdp__measuring ? 0 : T); t++) {
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
    if (G) free(G->h), free(G->marks);
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

enum fsdp_status fsdp_gpt_set_cache(struct fsdp_ctx *ctx, struct fsdp_module *root, int B, int cap) {
    if (!root || root->ops != &gpt_ops)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "fsdp_gpt_set_cache: module '%s' is not a GPT (fsdp_gpt_create)",
                         root ? fsdp__mname(root) : "(null)");
    struct gpt *G = root->impl;
    if (B < 0 || cap < 0 || cap > G->cfg.block_size || (cap > 0) != (B > 0))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "fsdp_gpt_set_cache: %d sequences of %d positions: both positive "
                         "(positions at most block_size %d), or both 0 to free the cache", B, cap,
                         G->cfg.block_size);
    G->cache_B = G->cache_cap = G->cache_len = 0;
    enum fsdp_status st = FSDP_OK;
    for (int l = 0; l < G->cfg.n_layer && st == FSDP_OK; l++)
        st = fsdp__attention_set_cache(ctx, fsdp__block_attention(G->h[l]), B, cap);
    if (st != FSDP_OK) { /* none half made */
        for (int l = 0; l < G->cfg.n_layer; l++) fsdp__attention_set_cache(ctx, fsdp__block_attention(G->h[l]), 0, 0);
        return st;
    }
    G->cache_B = B;
    G->cache_cap = cap;
    return FSDP_OK;
}

enum fsdp_status fsdp_gpt_create(struct fsdp_ctx *ctx, const struct fsdp_gpt_config *cfg,
                                 struct fsdp_module **out) {
    FSDP_TRY(fsdp_gpt_config_validate(ctx, cfg));
    struct fsdp_module *root;
    FSDP_TRY(fsdp_module_create(ctx, &gpt_ops, "", &root));
    struct gpt *G = fsdp__zalloc(1, sizeof *G);
    if (G) G->h = fsdp__zalloc((size_t)cfg->n_layer, sizeof *G->h);
    if (G) G->marks = fsdp__zalloc((size_t)cfg->n_layer + 1, sizeof *G->marks);
    if (!G || !G->h || !G->marks) {
        if (G) free(G->h), free(G->marks), free(G);
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

/* Parses text[0..len) (fsdp__json_parse: one JSON object, nothing after
 * it); *cfg is written only on success. */
static enum fsdp_status config_parse_text(struct fsdp_ctx *ctx, const char *path, const char *text, size_t len,
                                          struct fsdp_gpt_config *cfg) {
    cJSON *root;
    FSDP_TRY(fsdp__json_parse(ctx, "model config", path, text, len, &root));
    struct fsdp_gpt_config tmp;
    enum fsdp_status st = config_parse(ctx, path, root, &tmp);
    if (st == FSDP_OK) *cfg = tmp;
    cJSON_Delete(root);
    return st;
}

enum fsdp_status fsdp_gpt_config_load(struct fsdp_ctx *ctx, const char *path, struct fsdp_gpt_config *cfg) {
    char *buf;
    size_t len;
    FSDP_TRY(fsdp__read_file(ctx, "model config", path, CONFIG_MAX_BYTES, &buf, &len));
    enum fsdp_status st = config_parse_text(ctx, path, buf, len, cfg);
    free(buf);
    return st;
}

enum fsdp_status fsdp__gpt_config_parse(struct fsdp_ctx *ctx, const char *name, const char *text,
                                        size_t len, struct fsdp_gpt_config *cfg) {
    if (len > CONFIG_MAX_BYTES)
        return fsdp__err(ctx, FSDP_ERR_FORMAT, "model config '%s' is larger than %d bytes", name,
                         CONFIG_MAX_BYTES);
    return config_parse_text(ctx, name, text, len, cfg);
}
