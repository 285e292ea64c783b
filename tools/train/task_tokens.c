/*
 * task_tokens.c - fsdp-train's GPT task (task.h): a GPT preset or config,
 * token data (a file or the synthetic corpus; a text file BPE-encoded with
 * --tokenizer), next-token cross-entropy through fsdp_model_train_step_accum,
 * the held-out loss on --val-data, and a text sample at the end.
 *
 * [Note: held-out batches]
 * --val-data is cut into global batches of EB = --eval-batch (default
 * --batch) sequences of --seq tokens: global batch j holds sequences
 * j EB .. j EB + EB - 1, sequence s being the T + 1 tokens from s T (as
 * fsdp_data_batch reads them, wrapping at the end), whatever the world size.
 * Rank r runs sequences [r EB / world, (r + 1) EB / world) of each batch
 * (uneven shares allowed; an empty share runs the collective forward on a
 * sequence it ignores) through the eval-mode forward, which keeps no
 * activations, and sums each sequence's token losses in double. The ranks'
 * per-sequence sums are gathered and every rank adds them in sequence order,
 * so the loss is the 1-rank value at any world size whenever a sequence's
 * logits do not depend on the sequences beside it. Evaluation reads nothing
 * training reads and draws no random numbers: training goes on bit for bit.
 * An evaluation reads only whole batches of the file, never wrapping: the
 * file holds F = floor((ntok - 1) / T / EB) of them, and F = 0 (fewer than
 * EB T + 1 tokens) is refused at startup; --eval-batches N reads min(N, F)
 * (as an image model reads at most its whole test split), so no token is
 * counted twice.
 */
#include "task.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct tokens {
    struct fsdp_gpt_config cfg;
    struct fsdp_data *data;
    struct fsdp_data *val; /* --val-data, or NULL */
    struct fsdp_bpe *bpe; /* --tokenizer, or NULL */
    const char *data_name;
    int32_t *inputs, *targets;
    int Bl, T;
};

/* The whole evaluation batches of --val-data ([Note: held-out batches]). */
static int64_t val_batches_held(const struct tokens *k, const struct opts *o) {
    return (int64_t)((fsdp_data_ntokens(k->val) - 1) / (size_t)o->seq) / task_eval_batch(o);
}

/* The batches one evaluation runs: --eval-batches N, at most what the file holds; 0: all of them. */
static int64_t val_batches(const struct tokens *k, const struct opts *o) {
    int64_t held = val_batches_held(k, o);
    return o->eval_batches && o->eval_batches < held ? o->eval_batches : held;
}

/* Opens the token source dn for `flag` (--data, --val-data): a token file, a
 * text file as bytes, or with --tokenizer a text file BPE-encoded. */
static struct fsdp_data *open_tokens(struct task *t, struct tokens *k, struct fsdp_ctx *ctx, const struct opts *o,
                                     const char *flag, const char *dn) {
    struct fsdp_data *d = NULL;
    enum fsdp_status st = !strcmp(dn, "synthetic") ? fsdp_data_synthetic(ctx, o->seed, (size_t)1 << 22, &d)
                                                   : fsdp_data_open(ctx, dn, k->cfg.vocab_size, &d);
    if (st == FSDP_OK && k->bpe && fsdp_data_is_text(d)) {
        double t0 = now_s();
        fsdp_data_free(d);
        d = NULL;
        st = fsdp_data_open_bpe(ctx, dn, k->bpe, k->cfg.vocab_size, &d);
        if (st == FSDP_OK && fsdp_ctx_rank(ctx) == 0)
            printf("tokenized %s with %s: %zu tokens in %.2f s\n", dn, o->tokenizer, fsdp_data_ntokens(d),
                   now_s() - t0);
    }
    if (st != FSDP_OK) {
        fsdp_data_free(d);
        fail_all("%s: %s", flag, fsdp_errmsg(ctx));
    }
    if (!strcmp(flag, "--val-data")) k->val = d; /* reachable from here on: an error exit leaks nothing */
    else k->data = d;
    if (fsdp_data_ntokens(d) < (size_t)o->seq + 1) /* a sequence would wrap around into itself */
        fail_all("%s: '%s' has %zu tokens, fewer than one sequence needs (--seq %d + 1 = %d tokens)", flag, dn,
                 fsdp_data_ntokens(d), o->seq, o->seq + 1);
    if (fsdp_data_is_text(d) && k->cfg.vocab_size < 256)
        fail_all("%s: '%s' is byte-level text, which needs vocab_size >= 256, the model has %d", flag, dn,
                 k->cfg.vocab_size);
    if (strcmp(dn, "synthetic")) task_input_file(t, flag, dn, "tokens", (int64_t)fsdp_data_ntokens(d));
    return d;
}

static void tok_open(struct task *t, struct fsdp_ctx *ctx, const struct opts *o) {
    struct tokens *k = t->impl;
    const char *dn = k->data_name;
    /* with --tokenizer, a file read as text is BPE-encoded instead */
    if (o->tokenizer) {
        if (!strcmp(dn, "synthetic"))
            fail_all("--tokenizer needs a --data file (the synthetic corpus is byte-level text)");
        if (fsdp_bpe_open(ctx, o->tokenizer, &k->bpe) != FSDP_OK) fail_all("--tokenizer: %s", fsdp_errmsg(ctx));
        if (fsdp_bpe_vocab_size(k->bpe) > k->cfg.vocab_size)
            fail_all("--tokenizer '%s': its %d ids do not fit the model's vocab_size %d", o->tokenizer,
                     fsdp_bpe_vocab_size(k->bpe), k->cfg.vocab_size);
    }
    open_tokens(t, k, ctx, o, "--data", dn);
    if (o->val_data) {
        open_tokens(t, k, ctx, o, "--val-data", o->val_data);
        int64_t EB = task_eval_batch(o);
        if (val_batches_held(k, o) < 1)
            fail_input("--val-data %s: %zu tokens, fewer than one evaluation batch needs: %lld sequences "
                       "(--eval-batch%s) x %d tokens (--seq) + 1 = %lld tokens", o->val_data,
                       fsdp_data_ntokens(k->val), (long long)EB, o->eval_batch ? "" : ", default --batch", o->seq,
                       (long long)(EB * o->seq + 1));
    }
    if (fsdp_gpt_create(ctx, &k->cfg, &t->root) != FSDP_OK) fail_all("%s", fsdp_errmsg(ctx));
    k->Bl = o->batch / fsdp_ctx_world(ctx);
    k->T = o->seq;
    k->inputs = malloc((size_t)k->Bl * (size_t)k->T * sizeof(int32_t));
    k->targets = malloc((size_t)k->Bl * (size_t)k->T * sizeof(int32_t));
    if (!k->inputs || !k->targets) fail_rank("out of memory for the batch");
}

static void tok_describe_model(struct task *t, struct fsdp_ctx *ctx, const struct opts *o, struct fsdp_model *fm) {
    (void)ctx;
    (void)o;
    struct tokens *k = t->impl;
    printf("model: %d layers, %d heads, %d embd, vocab %d, block %d: %.2fM parameters in %d units\n",
           k->cfg.n_layer, k->cfg.n_head, k->cfg.n_embd, k->cfg.vocab_size, k->cfg.block_size,
           (double)fsdp_module_numel(t->root) / 1e6, fsdp_model_n_units(fm));
}

static void tok_describe_data(struct task *t, struct fsdp_ctx *ctx, const struct opts *o, struct fsdp_model *fm) {
    (void)ctx;
    (void)fm;
    struct tokens *k = t->impl;
    double floor_ = fsdp_data_loss_floor(k->data);
    if (floor_ >= 0)
        printf("data: %s, %zu tokens, loss floor %.3f nats/token\n", k->data_name, fsdp_data_ntokens(k->data), floor_);
    else printf("data: %s, %zu tokens\n", k->data_name, fsdp_data_ntokens(k->data));
    if (k->val) {
        int64_t EB = task_eval_batch(o), nb = val_batches(k, o);
        printf("held-out data: %s, %zu tokens; each evaluation: ", o->val_data, fsdp_data_ntokens(k->val));
        if (o->eval_batches && o->eval_batches > nb) printf("all %lld (--eval-batches %d: the file holds %lld)",
                                                           (long long)nb, o->eval_batches, (long long)nb);
        else printf(o->eval_batches ? "%lld" : "all %lld", (long long)nb);
        printf(" batches of %lld x %d tokens\n", (long long)EB, k->T);
    }
}

static enum fsdp_status tok_step(struct task *t, struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct opts *o,
                                 int step, float lr, struct fsdp_step_result *r) {
    struct tokens *k = t->impl;
    if (fsdp_data_batch(k->data, step, o->batch, k->T, fsdp_ctx_rank(ctx), fsdp_ctx_world(ctx), k->inputs,
                        k->targets) != FSDP_OK)
        fail_rank("step %d: --data: %s", step + 1, fsdp_errmsg(ctx));
    return fsdp_model_train_step_accum(ctx, fm, k->inputs, k->targets, o->batch / fsdp_ctx_world(ctx) / o->grad_accum, k->T, o->grad_accum,
                                       !strcmp(o->accum_mode, "no_sync") ? FSDP_ACCUM_NO_SYNC
                                                                         : FSDP_ACCUM_REDUCE_EACH,
                                       lr, o->clip, r);
}

/* [Note: held-out batches] */
static enum fsdp_status tok_eval(struct task *t, struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct opts *o,
                                 double *loss_out, double *acc_out, int64_t *count_out) {
    struct tokens *k = t->impl;
    int rank = fsdp_ctx_rank(ctx), world = fsdp_ctx_world(ctx), T = k->T, V = k->cfg.vocab_size;
    int64_t EB = task_eval_batch(o), cap = (EB + world - 1) / world;
    int64_t nb = val_batches(k, o); /* at least one: tok_open checked */
    int32_t *in = malloc((size_t)(cap * T) * sizeof(int32_t)), *tg = malloc((size_t)(cap * T) * sizeof(int32_t));
    int64_t *mine = calloc((size_t)cap, sizeof(int64_t)), *all = calloc((size_t)(cap * world), sizeof(int64_t));
    if (!in || !tg || !mine || !all) fail_rank("out of memory for evaluation");
    double total = 0;
    enum fsdp_status st = FSDP_OK;
    fsdp_module_set_training(t->root, 0);
    for (int64_t j = 0; j < nb && st == FSDP_OK; j++) {
        int64_t lo = rank * EB / world, m = (rank + 1) * EB / world - lo;
        for (int64_t i = 0; i < (m ? m : 1); i++)
            if (fsdp_data_batch(k->val, j * EB + (m ? lo + i : 0), 1, T, 0, 1, in + i * T, tg + i * T) != FSDP_OK)
                fail_rank("evaluation: --val-data: %s", fsdp_errmsg(ctx));
        struct fsdp_tensor x = {in, FSDP_I32, 2, {m ? m : 1, T}, FSDP_LAYOUT_PLAIN}, out = {0};
        if ((st = fsdp_model_forward_tensor(ctx, fm, &x, &out)) != FSDP_OK) break;
        const float *lg = out.data; /* (m, T, V) */
        for (int64_t i = 0; i < m; i++) {
            double sum = 0;
            for (int64_t p = 0; p < T; p++) {
                const float *l = lg + (i * T + p) * V;
                double mx = l[0], z = 0;
                for (int v = 1; v < V; v++) mx = l[v] > mx ? l[v] : mx;
                for (int v = 0; v < V; v++) z += exp((double)l[v] - mx);
                sum += log(z) - ((double)l[tg[i * T + p]] - mx);
            }
            memcpy(&mine[i], &sum, sizeof sum); /* the bits travel as an I64 */
        }
        if ((st = fsdp_comm_allgather(fsdp_ctx_comm(ctx), mine, all, (size_t)cap, FSDP_I64)) != FSDP_OK) break;
        for (int r = 0; r < world; r++) /* in sequence order: the ranks' shares are consecutive */
            for (int64_t i = 0; i < (r + 1) * EB / world - r * EB / world; i++) {
                double v;
                memcpy(&v, &all[r * cap + i], sizeof v);
                total += v;
            }
    }
    fsdp_module_set_training(t->root, 1);
    free(in);
    free(tg);
    free(mine);
    free(all);
    *count_out = nb * EB * T;
    *loss_out = total / (double)*count_out;
    *acc_out = NAN;
    return st;
}

static void tok_meta(struct task *t, struct fsdp_ckpt_meta *m) {
    struct tokens *k = t->impl;
    m->has_config = 1;
    m->config = k->cfg;
}

static void tok_summary_note(struct task *t, char *buf, size_t cap) {
    struct tokens *k = t->impl;
    double fl = fsdp_data_loss_floor(k->data);
    if (fl >= 0) snprintf(buf, cap, " (floor %.3f)", fl);
}

/* [Note: sampling on the summoned model] Each token's forward gathers every
 * unit, so at N ranks a token all-gathered the whole model. Where the whole
 * model fits (below), the sample runs inside
 * fsdp_summon_full_params (without write-back): the units run on the
 * summoned values and a token costs no collective but the broadcast of its
 * id ([Note: a forward while summoned], src/fsdp/unit.c; the same logits).
 * "Fits": the model's fp32 values fit, on every rank, in the host's memory
 * available now per local rank (as --mem-limit auto measures it, the
 * training's own memory already taken) and within --mem-limit SIZE; the
 * training's memory stays as it is (pooled buffers, the arena), so a model
 * sharded because it does not fit one rank is not summoned, and each of its
 * tokens gathers as before. COLLECTIVE. */
static int summon_for_sampling(struct fsdp_ctx *ctx, struct fsdp_model *fm, struct fsdp_module *root) {
    struct fsdp_unit_info ui;
    fsdp_model_unit_info(fm, 0, &ui);
    if (ui.numel_shard == ui.numel_padded) return 0; /* a shard group of one: its shards are the model */
    struct fsdp_mem_stats m;
    fsdp_mem_get(ctx, &m);
    size_t need = (size_t)fsdp_module_numel(root) * sizeof(float), limit = fsdp_mem_limit(ctx),
           avail = host_free_per_rank();
    int32_t fits = need <= avail && (!limit || m.cur_total + need <= limit), all = 0;
    if (fsdp_comm_allreduce(fsdp_ctx_comm(ctx), &fits, &all, 1, FSDP_I32, FSDP_MIN) != FSDP_OK)
        fail_rank("sampling: %s", fsdp_errmsg(ctx));
    if (fsdp_ctx_rank(ctx) == 0)
        printf(all ? "sampling on the whole model, summoned on every rank (%.1f MiB each)\n"
                   : "sampling with each unit gathered per token (the whole model, %.1f MiB, would not fit a rank)\n",
               (double)need / 1048576.0);
    if (!all) return 0;
    if (fsdp_summon_full_params(ctx, fm, root, 0, 0) != FSDP_OK) fail_rank("sampling: %s", fsdp_errmsg(ctx));
    return 1;
}

/* Generates n tokens after a newline, temperature 1 sampling with the counter
 * RNG on rank 0, broadcast so every rank feeds the same context. Tokens are
 * bytes, or with a tokenizer (bpe, may be NULL) its ids, decoded at the end.
 * The model runs in eval mode with a decoding cache (fsdp_gpt_set_cache): each
 * token costs one position's forward while the context fits block_size; past
 * it, each token runs the last block_size tokens whole; on the summoned model
 * where it fits ([Note: sampling on the summoned model]). */
static void generate(struct fsdp_ctx *ctx, struct fsdp_model *fm, struct fsdp_module *root,
                     const struct fsdp_gpt_config *cfg, int n, uint64_t seed, struct fsdp_bpe *bpe) {
    int T = cfg->block_size, cap = n < T ? n : T; /* positions the cache serves: the newline and n - 1 tokens */
    int32_t *ctxbuf = calloc((size_t)T, sizeof(int32_t));
    int32_t *ids = calloc((size_t)n, sizeof(int32_t));
    char *text = calloc((size_t)n + 1, 1);
    int len = 1, out = 0;
    size_t one;
    ctxbuf[0] = '\n';
    if (bpe && (fsdp_bpe_encode(bpe, "\n", 1, ctxbuf, &one) != FSDP_OK || one != 1)) ctxbuf[0] = 0;
    fsdp_module_set_training(root, 0);
    int summoned = summon_for_sampling(ctx, fm, root);
    if (fsdp_gpt_set_cache(ctx, root, 1, cap) != FSDP_OK) fail_rank("sampling: %s", fsdp_errmsg(ctx));
    for (int i = 0; i < n; i++) {
        int cached = len <= cap, t0 = cached ? len - 1 : len - T, tl = len - t0;
        if (!cached && len == cap + 1 && fsdp_gpt_set_cache(ctx, root, 0, 0) != FSDP_OK)
            fail_rank("sampling: %s", fsdp_errmsg(ctx));
        int32_t *window = calloc((size_t)tl, sizeof(int32_t));
        for (int j = 0; j < tl; j++) window[j] = ctxbuf[(t0 + j) % T];
        struct fsdp_tensor x = {window, FSDP_I32, 2, {1, tl}, FSDP_LAYOUT_PLAIN}, y = {0};
        if (fsdp_model_forward_tensor(ctx, fm, &x, &y) != FSDP_OK) fail_rank("sampling: %s", fsdp_errmsg(ctx));
        free(window);
        const float *logits = y.data; /* (1, 1, V) cached, else (1, tl, V) */
        int32_t next = 0;
        if (fsdp_ctx_rank(ctx) == 0) {
            const float *l = logits + (size_t)(y.shape[1] - 1) * (size_t)cfg->vocab_size;
            double mx = l[0], z = 0;
            for (int v = 1; v < cfg->vocab_size; v++) mx = l[v] > mx ? l[v] : mx;
            for (int v = 0; v < cfg->vocab_size; v++) z += exp(l[v] - mx);
            /* a deterministic uniform from the seed and position */
            double u = (double)((seed * 6364136223846793005ull + (uint64_t)i * 1442695040888963407ull) >> 11) /
                       9007199254740992.0 * z;
            for (next = 0; next < cfg->vocab_size - 1; next++) {
                u -= exp(l[next] - mx);
                if (u <= 0) break;
            }
        }
        if (fsdp_comm_broadcast(fsdp_ctx_comm(ctx), &next, 1, FSDP_I32, 0) != FSDP_OK)
            fail_rank("sampling broadcast: %s", fsdp_errmsg(ctx));
        ctxbuf[len % T] = next;
        len++;
        ids[i] = next;
        text[out++] = (char)(next >= 32 && next < 127 ? next : next == '\n' ? '\n' : '?');
    }
    if (fsdp_ctx_rank(ctx) == 0 && bpe) { /* ids the tokenizer lacks (a padded vocab) show as <|id|> */
        printf("--- sample ---\n");
        for (int i = 0; i < n; i++) {
            size_t l;
            const void *t = fsdp_bpe_token(bpe, ids[i], &l);
            if (t) fwrite(t, 1, l, stdout);
            else printf("<|%d|>", (int)ids[i]);
        }
        printf("\n--------------\n");
    } else if (fsdp_ctx_rank(ctx) == 0) {
        printf("--- sample ---\n%s\n--------------\n", text);
    }
    if (fsdp_gpt_set_cache(ctx, root, 0, 0) != FSDP_OK) fail_rank("sampling: %s", fsdp_errmsg(ctx));
    if (summoned && fsdp_summon_end(ctx, fm) != FSDP_OK) fail_rank("sampling: %s", fsdp_errmsg(ctx));
    fsdp_module_set_training(root, 1);
    free(ctxbuf);
    free(ids);
    free(text);
}

static void tok_finish(struct task *t, struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct opts *o) {
    struct tokens *k = t->impl;
    if (o->sample > 0 && (fsdp_data_is_text(k->data) || k->bpe) && o->steps > 0)
        generate(ctx, fm, t->root, &k->cfg, o->sample, o->seed, k->bpe);
}

static void tok_free(struct task *t) {
    struct tokens *k = t->impl;
    if (!k) return;
    free(k->inputs);
    free(k->targets);
    fsdp_data_free(k->data);
    fsdp_data_free(k->val);
    fsdp_bpe_free(k->bpe);
    free(k);
    t->impl = NULL;
}

static const struct task_ops tokens_ops = {tok_open,     tok_describe_model, tok_describe_data, tok_step, NULL,
                                           tok_meta,     tok_summary_note,   tok_finish,        tok_free, NULL, NULL, NULL};
/* with --val-data */
static const struct task_ops tokens_val_ops = {tok_open, tok_describe_model, tok_describe_data, tok_step, tok_eval,
                                               tok_meta, tok_summary_note,   tok_finish,        tok_free, NULL, NULL, NULL};

void task_tokens_create(struct fsdp_ctx *ctx, struct opts *o, const struct fsdp_ckpt_meta *ck, const char *resume_dir,
                        struct task *t) {
    struct tokens *k = calloc(1, sizeof *k);
    if (!k) fail_rank("out of memory");
    t->impl = k; /* reachable from here on, so an error exit leaks nothing */
    struct fsdp_gpt_config cfg;
    /* model config: the flags, else the checkpoint's, else the default preset */
    if (o->model_config) {
        if (fsdp_gpt_config_load(ctx, o->model_config, &cfg) != FSDP_OK) fail_all("%s", fsdp_errmsg(ctx));
    } else if (!o->model && ck && ck->has_config) {
        cfg = ck->config;
    } else if (fsdp_gpt_config_preset(o->model ? o->model : MODEL_DEFAULT, &cfg) != FSDP_OK) {
        fail_all("--model: unknown preset '%s' (tiny, small, gpt2, gpt2-medium, gpt2-large, gpt2-xl; image models: "
                 "cnn, resnet18, resnet34, resnet50)", o->model);
    }
    if (ck && ck->model_json[0])
        fail_all("--resume: %s holds the image model %s, not a GPT (leave out --model / --model-config)", resume_dir,
                 ck->model_json);
    if (fsdp_gpt_config_validate(ctx, &cfg) != FSDP_OK) fail_all("model config: %s", fsdp_errmsg(ctx));
    if (ck && ck->has_config && (o->model || o->model_config)) {
        const char *what = o->model_config ? "--model-config" : "--model";
        const char *arg = o->model_config ? o->model_config : o->model;
        int a[5] = {cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.vocab_size, cfg.block_size};
        int b[5] = {ck->config.n_layer, ck->config.n_head, ck->config.n_embd, ck->config.vocab_size,
                    ck->config.block_size};
        static const char *const names[5] = {"n_layer", "n_head", "n_embd", "vocab_size", "block_size"};
        for (int i = 0; i < 5; i++)
            if (a[i] != b[i])
                fail_all("%s %s: %s %d, but the checkpoint %s was saved with %s %d (leave out %s to use the "
                         "checkpoint's model)", what, arg, names[i], a[i], resume_dir, names[i], b[i], what);
    } else if (ck && !ck->has_config && !o->model && !o->model_config) {
        fail_all("--resume: %s holds no model config (converted without one): give --model or --model-config",
                 resume_dir);
    }
    if (o->seq > cfg.block_size) fail_all("--seq %d is longer than the model's block_size %d", o->seq, cfg.block_size);
    if (!o->val_data && (o->eval_every || o->eval_batch || o->eval_batches))
        fail_input("--eval-every, --eval-batch and --eval-batches need --val-data FILE (a GPT's held-out tokens)");
    k->cfg = cfg;
    k->data_name = o->data ? o->data : "synthetic";
    t->ops = o->val_data ? &tokens_val_ops : &tokens_ops;
    t->eval_ppl = 1;
    t->eval_count = "eval_tokens";
    t->impl = k;
    t->block_type = "Block";
    t->ac_attn_type = "CausalSelfAttention";
    t->is_gpt = 1;
    t->item = "tok";
    t->item_json = "tokens_per_s";
    snprintf(t->batch_unit, sizeof t->batch_unit, "x %d tokens", o->seq);
    t->items_per_step = (double)o->batch * o->seq;
    t->train_flops_per_item = 3.0 * fsdp_gpt_flops_per_token(&cfg, o->seq);
    t->seq = o->seq;
    t->steps = o->steps;
}
