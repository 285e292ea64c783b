/*
 * test_nn_gpt.c - the GPT module tree of src/models/gpt.c built from the
 * layers of src/nn: nanoGPT's parameter names and order, the tied weight's
 * gradient as the sum of its two paths, input errors that name the problem,
 * layers writing into a caller's output buffer, and, where Debian's PyTorch
 * is installed, one forward and backward against nanoGPT in torch
 * (tests/torch_ref.py: logits, loss and every gradient). The layers' own
 * finite-difference checks: tests/test_nn.c.
 */
#include "core/core-impl.h"
#include "fsdp.h"
#include "harness.h"
#include "nn_helpers.h"
#include "nn/nn-impl.h"
#include "plist.h"

/* ---- GPT structure ---- */

static const char *const block_param_names[] = {
    "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
    "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
    "mlp.c_proj.weight", "mlp.c_proj.bias"};

TEST(gpt_fqns_match_nanogpt) {
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_gpt_config cfg;
    ASSERT_OK(fsdp_gpt_config_preset("tiny", &cfg), ctx);
    struct fsdp_module *m;
    ASSERT_OK(fsdp_gpt_create(ctx, &cfg, &m), ctx);
    /* nanoGPT's named_parameters(), in order (lm_head.weight is wte's, so listed once) */
    char want[64][64];
    int n = 0;
    snprintf(want[n++], 64, "transformer.wte.weight");
    snprintf(want[n++], 64, "transformer.wpe.weight");
    for (int l = 0; l < cfg.n_layer; l++)
        for (int k = 0; k < 12; k++) snprintf(want[n++], 64, "transformer.h.%d.%s", l, block_param_names[k]);
    snprintf(want[n++], 64, "transformer.ln_f.weight");
    snprintf(want[n++], 64, "transformer.ln_f.bias");
    struct plist pl = {0};
    fsdp_module_foreach_param(m, collect_param, &pl);
    ASSERT_INT_EQ(pl.n, n);
    for (int i = 0; i < n; i++) CHECK_STR_EQ(pl.p[i]->fqn, want[i]);
    plist_free(&pl);
    /* lm_head.weight exists, is tied to wte, and has the same shape */
    struct fsdp_param *lm = fsdp_module_find_param(m, "lm_head.weight");
    struct fsdp_param *wte = fsdp_module_find_param(m, "transformer.wte.weight");
    ASSERT(lm && wte);
    CHECK(lm->tied_to == wte);
    CHECK_INT_EQ(lm->shape[0], cfg.vocab_size);
    CHECK_INT_EQ(lm->shape[1], cfg.n_embd);
    CHECK(fsdp_module_find_param(m, "lm_head.bias") == NULL);
    /* module types and names */
    CHECK_STR_EQ(m->ops->type, "GPT");
    CHECK_STR_EQ(m->fqn, "");
    ASSERT_INT_EQ(m->n_children, 2);
    CHECK_STR_EQ(m->children[0]->fqn, "transformer");
    CHECK_STR_EQ(m->children[1]->fqn, "lm_head");
    CHECK_STR_EQ(m->children[1]->ops->type, "Linear");
    struct fsdp_module *h = m->children[0]->children[2];
    CHECK_STR_EQ(h->fqn, "transformer.h");
    CHECK_STR_EQ(h->ops->type, "ModuleList");
    CHECK_STR_EQ(h->children[1]->fqn, "transformer.h.1");
    CHECK_STR_EQ(h->children[1]->ops->type, "Block");
    CHECK_STR_EQ(h->children[1]->children[1]->ops->type, "CausalSelfAttention");
    CHECK_STR_EQ(h->children[1]->children[3]->ops->type, "MLP");
    CHECK_STR_EQ(h->children[1]->children[3]->children[1]->ops->type, "GELU");
    /* init and weight decay per nanoGPT */
    float proj_std = 0.02f / sqrtf(2.0f * (float)cfg.n_layer);
    struct fsdp_param *p;
    p = fsdp_module_find_param(m, "transformer.h.0.attn.c_proj.weight");
    ASSERT(p);
    CHECK(p->init.kind == FSDP_INIT_NORMAL && p->init.std == proj_std && !p->no_decay);
    p = fsdp_module_find_param(m, "transformer.h.1.mlp.c_proj.weight");
    ASSERT(p);
    CHECK(p->init.kind == FSDP_INIT_NORMAL && p->init.std == proj_std);
    p = fsdp_module_find_param(m, "transformer.h.1.mlp.c_fc.weight");
    ASSERT(p);
    CHECK(p->init.kind == FSDP_INIT_NORMAL && p->init.std == 0.02f && !p->no_decay);
    CHECK_INT_EQ(p->shape[0], 4 * cfg.n_embd);
    p = fsdp_module_find_param(m, "transformer.h.0.attn.c_attn.bias");
    ASSERT(p);
    CHECK(p->init.kind == FSDP_INIT_ZEROS && p->no_decay);
    CHECK_INT_EQ(p->shape[0], 3 * cfg.n_embd);
    p = fsdp_module_find_param(m, "transformer.ln_f.weight");
    ASSERT(p);
    CHECK(p->init.kind == FSDP_INIT_ONES && p->no_decay);
    CHECK(wte->init.kind == FSDP_INIT_NORMAL && wte->init.std == 0.02f && wte->no_decay);
    p = fsdp_module_find_param(m, "transformer.wpe.weight");
    ASSERT(p);
    CHECK(p->no_decay);
    CHECK_INT_EQ(p->shape[0], cfg.block_size);
    fsdp_module_free(m);
    /* GPT-2 124M: the well-known parameter count (shapes only, nothing allocated) */
    ASSERT_OK(fsdp_gpt_config_preset("gpt2", &cfg), ctx);
    ASSERT_OK(fsdp_gpt_create(ctx, &cfg, &m), ctx);
    CHECK_INT_EQ(fsdp_module_numel(m), 124439808);
    fsdp_module_free(m);
    fsdp_ctx_free(ctx);
}

/* The tied weight's gradient is the sum of the embedding path and the
 * lm_head path: untie lm_head (its own copy of wte's values) and compare. */
TEST(gpt_tied_gradient_is_sum_of_paths) {
    rng_seed(10);
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_gpt_config cfg = small_gpt();
    struct fsdp_module *m;
    ASSERT_OK(small_gpt_model(ctx, 5, &m), ctx);
    struct fsdp_param *wte = fsdp_module_find_param(m, "transformer.wte.weight");
    struct fsdp_param *lm = fsdp_module_find_param(m, "lm_head.weight");
    ASSERT(wte && lm);
    int64_t B = 2, T = 5, N = B * T, V = cfg.vocab_size, n = wte->numel;
    int32_t tok[10], tgt[10];
    for (int i = 0; i < 10; i++) {
        tok[i] = (int32_t)irand(V / 2); /* rows >= V/2 get only the lm_head path */
        tgt[i] = (int32_t)irand(V);
    }
    struct fsdp_tensor in = {.data = tok, .dtype = FSDP_I32, .ndim = 2, .shape = {B, T}};
    float *total = malloc((size_t)n * sizeof(float));
    for (int pass = 0; pass < 2; pass++) {
        ASSERT_OK(fsdp_module_zero_grad(ctx, m), ctx);
        if (pass == 1) memset(lm->grad, 0, (size_t)n * sizeof(float));
        fsdp_arena_reset(ctx);
        struct fsdp_tensor out = {0};
        ASSERT_OK(fsdp_module_forward(m, ctx, &in, &out), ctx);
        float loss;
        ASSERT_OK(fsdp_cross_entropy(ctx, out.data, tgt, N, V, 1.0f, &loss, out.data), ctx);
        ASSERT_OK(fsdp_module_backward(m, ctx, &out, NULL), ctx);
        if (pass == 0) {
            memcpy(total, wte->grad, (size_t)n * sizeof(float));
            /* untie: lm_head gets its own values (a copy) and gradient */
            lm->tied_to = NULL;
            lm->data = fsdp__alloc(NULL, (size_t)n * sizeof(float), FSDP_MEM_PARAM, "test");
            lm->grad = fsdp__alloc(NULL, (size_t)n * sizeof(float), FSDP_MEM_PARAM, "test");
            lm->priv->owns_data = 1;
            ASSERT(lm->data && lm->grad);
            memcpy(lm->data, wte->data, (size_t)n * sizeof(float));
        }
    }
    double emb_norm = 0.0, head_norm = 0.0, unused_emb = 0.0;
    for (int64_t i = 0; i < n; i++) {
        CHECK_NEAR(wte->grad[i] + lm->grad[i], total[i], 1e-5, 1e-9);
        emb_norm += fabs(wte->grad[i]);
        head_norm += fabs(lm->grad[i]);
        if (i >= (V / 2) * cfg.n_embd) unused_emb += fabs(wte->grad[i]);
    }
    CHECK(emb_norm > 0.0);
    CHECK(head_norm > 0.0);
    CHECK(unused_emb == 0.0);
    free(total);
    fsdp_module_free(m);
    fsdp_ctx_free(ctx);
}

TEST(gpt_input_errors) {
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_gpt_config cfg = small_gpt();
    struct fsdp_module *m;
    ASSERT_OK(fsdp_gpt_create(ctx, &cfg, &m), ctx);
    struct fsdp_tensor out = {0};
    int32_t tok[2 * 9] = {0};
    struct fsdp_tensor in = {.data = tok, .dtype = FSDP_I32, .ndim = 2, .shape = {2, 4}};
    /* parameters not materialized yet: a state error naming the parameter */
    CHECK_INT_EQ(fsdp_module_forward(m, ctx, &in, &out), FSDP_ERR_STATE);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "transformer.wte.weight");
    ASSERT_OK(fsdp_module_materialize(ctx, m, 1), ctx);
    /* T > block_size */
    in.shape[1] = 9;
    memset(&out, 0, sizeof out);
    CHECK_INT_EQ(fsdp_module_forward(m, ctx, &in, &out), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "T 9");
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "block_size 8");
    /* out-of-range token, named with the module */
    in.shape[1] = 4;
    tok[5] = 24;
    memset(&out, 0, sizeof out);
    CHECK_INT_EQ(fsdp_module_forward(m, ctx, &in, &out), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "id 24");
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "transformer.wte");
    tok[5] = -3;
    memset(&out, 0, sizeof out);
    CHECK_INT_EQ(fsdp_module_forward(m, ctx, &in, &out), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "id -3");
    /* wrong dtype */
    in.dtype = FSDP_F32;
    CHECK_INT_EQ(fsdp_module_forward(m, ctx, &in, &out), FSDP_ERR_INVALID);
    /* fine: T == block_size; logits (B, T, V); backward needs gradient buffers */
    tok[5] = 3;
    in.dtype = FSDP_I32;
    in.shape[1] = 8;
    memset(&out, 0, sizeof out);
    ASSERT_OK(fsdp_module_forward(m, ctx, &in, &out), ctx);
    CHECK_INT_EQ(out.ndim, 3);
    CHECK_INT_EQ(out.shape[0], 2);
    CHECK_INT_EQ(out.shape[1], 8);
    CHECK_INT_EQ(out.shape[2], cfg.vocab_size);
    CHECK_INT_EQ(fsdp_module_backward(m, ctx, &out, NULL), FSDP_ERR_STATE);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "gradient");
    /* a container cannot run */
    CHECK_INT_EQ(fsdp_module_forward(m->children[0], ctx, &in, &out), FSDP_ERR_UNSUPPORTED);
    fsdp_module_free(m);
    /* a bad config is refused at creation */
    cfg.n_head = 3;
    CHECK_INT_EQ(fsdp_gpt_create(ctx, &cfg, &m), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "n_head 3");
    fsdp_ctx_free(ctx);
}

/* A forward into a caller's buffer overwrites it; outputs land in the arena otherwise. */
TEST(layers_overwrite_given_output) {
    rng_seed(12);
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_module *m;
    ASSERT_OK(fsdp__block_create(ctx, "blk", 8, 2, 0.02f, &m), ctx);
    prepare(ctx, m, 0.3f);
    int64_t shape[3] = {1, 3, 8};
    struct fsdp_tensor x = make_input(3, shape, 1.0f, 0.0f);
    struct fsdp_tensor a = {0};
    ASSERT_OK(fsdp_module_forward(m, ctx, &x, &a), ctx);
    float buf[24];
    for (int i = 0; i < 24; i++) buf[i] = NAN;
    struct fsdp_tensor b = {.data = buf};
    ASSERT_OK(fsdp_module_forward(m, ctx, &x, &b), ctx);
    CHECK(b.data == buf);
    for (int i = 0; i < 24; i++) CHECK(buf[i] == ((float *)a.data)[i]);
    free(x.data);
    fsdp_module_free(m);
    fsdp_ctx_free(ctx);
}

/* ---- reference: nanoGPT in PyTorch (skipped where torch is missing) ---- */

TEST(gpt_matches_pytorch_nanogpt) {
    char script[4200];
    if (!test_python_ref("torch", "torch_ref.py", script, sizeof script)) return;
    rng_seed(13);
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_gpt_config cfg;
    ASSERT_OK(fsdp_gpt_config_preset("tiny", &cfg), ctx);
    struct fsdp_module *m;
    ASSERT_OK(fsdp_gpt_create(ctx, &cfg, &m), ctx);
    ASSERT_OK(fsdp_module_materialize(ctx, m, 1337), ctx);
    randomize_params(m, 0.1f); /* larger than init, so every path matters */
    ASSERT_OK(fsdp_module_zero_grad(ctx, m), ctx);
    enum { B = 3, T = 40 };
    int32_t tok[B * T], tgt[B * T];
    for (int i = 0; i < B * T; i++) {
        tok[i] = (int32_t)irand(cfg.vocab_size);
        tgt[i] = (int32_t)irand(cfg.vocab_size);
    }
    struct fsdp_tensor in = {.data = tok, .dtype = FSDP_I32, .ndim = 2, .shape = {B, T}};
    struct fsdp_tensor out = {0};
    fsdp_arena_reset(ctx);
    ASSERT_OK(fsdp_module_forward(m, ctx, &in, &out), ctx);
    size_t nlog = (size_t)B * T * (size_t)cfg.vocab_size;
    char dir[] = "/tmp/fsdp_torch_ref_XXXXXX";
    ASSERT(mkdtemp(dir));
    CHECK(test_write_file(dir, "logits.bin", out.data, nlog * sizeof(float)));
    float loss;
    ASSERT_OK(fsdp_cross_entropy(ctx, out.data, tgt, B * T, cfg.vocab_size, 1.0f, &loss, out.data), ctx);
    ASSERT_OK(fsdp_module_backward(m, ctx, &out, NULL), ctx);
    CHECK(test_write_file(dir, "tokens.bin", tok, sizeof tok));
    CHECK(test_write_file(dir, "targets.bin", tgt, sizeof tgt));
    struct plist pl = {0};
    fsdp_module_foreach_param(m, collect_param, &pl);
    char path[1024];
    snprintf(path, sizeof path, "%s/index.json", dir);
    FILE *f = fopen(path, "w");
    ASSERT(f);
    fprintf(f, "{\"n_layer\": %d, \"n_head\": %d, \"n_embd\": %d, \"vocab_size\": %d, \"block_size\": %d,\n",
            cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.vocab_size, cfg.block_size);
    fprintf(f, " \"B\": %d, \"T\": %d, \"loss\": %.9g,\n \"params\": [\n", B, T, (double)loss);
    for (int i = 0; i < pl.n; i++) {
        struct fsdp_param *p = pl.p[i];
        char name[64];
        snprintf(name, sizeof name, "param_%d.bin", i);
        CHECK(test_write_file(dir, name, p->data, (size_t)p->numel * sizeof(float)));
        snprintf(name, sizeof name, "grad_%d.bin", i);
        CHECK(test_write_file(dir, name, p->grad, (size_t)p->numel * sizeof(float)));
        fprintf(f, "  {\"fqn\": \"%s\", \"shape\": [", p->fqn);
        for (int d = 0; d < p->ndim; d++) fprintf(f, "%s%lld", d ? ", " : "", (long long)p->shape[d]);
        fprintf(f, "], \"param\": \"param_%d.bin\", \"grad\": \"grad_%d.bin\"}%s\n", i, i, i + 1 < pl.n ? "," : "");
    }
    plist_free(&pl);
    fprintf(f, " ]}\n");
    CHECK(fclose(f) == 0);
    test_run_python_ref(script, dir);
    fsdp_module_free(m);
    fsdp_ctx_free(ctx);
}

TEST_MAIN()
