/*
 * task_swav.c - fsdp-train's SwAV task (task.h, --task swav): self-supervised
 * training of a trunk (the image task's small CNN, or a ResNet without its
 * classifier) and SwAV's head (fsdp_swav_head_create) on multi-crop views of
 * an IDX image set, as VISSL trains SwAV, and a kNN evaluation of the
 * trunk's features.
 *
 * Model: fsdp_swav_model_create's root "SwAV" = trunk (FQNs "trunk.*") then
 * head ("head.*"); its output is the head's [z, scores_0, ...]; each
 * backward takes SwAV's gradient written over that output, so the model
 * hands the arena back as it passes the head and the trunk's layers. Units (--wrap block): each
 * residual block (each layer of the CNN), the head, and each
 * head.prototypes<j> an fp32 unit of its own inside it (mixed precision
 * FULL); sync batch norm when the world is larger than one. After sharding
 * the head is re-initialised under fsdp_summon_full_params (write-back) from
 * a fixed seed, so every rank holds the same values.
 *
 * [Note: SwAV step] Per image of the global batch 2 global crops of
 * --crops-global-size and V small crops (RandomResizedCrop and a flip drawn
 * from (seed, epoch, image, crop) only, so a batch is the same at any world
 * size). Crops of one resolution go through the model together, crop-major
 * (row v Bl + b is crop v of this rank's image b, as fsdp_swav_loss reads
 * them). The layers save one forward's activations, and the codes come from
 * the global crops alone (no gradient flows through them), so each
 * resolution goes forward and backward once, in turn:
 *   forward(global) -> codes (fsdp_swav_codes) and the global crops' terms of
 *   the loss (fsdp_swav_predict), d loss / d scores -> backward(global);
 *   forward(small) -> their terms with the same codes -> backward(small)
 *   (the two backwards accumulate); optimizer step.
 * The loss over heads is averaged. fsdp_model_loss's convention is a rank's
 * gradient of its own mean loss, the ranks' gradients averaged; the terms
 * come as this rank's share of the global gradient, so they are multiplied
 * by the world. Each backward's call records its part of the loss value,
 * which the step sums.
 *
 * Prototypes: a post-step hook renormalises every row to unit L2 norm (under
 * fsdp_summon_full_params with write-back, one prototype unit at a time)
 * and records the largest |norm - 1|, whether every rank's gathered copy is
 * the same, and a hash of the bits (--log: proto_norm_err, proto_ranks_agree,
 * proto_hash). With --freeze-prototypes-iters N they form an optimizer group
 * frozen for the first N steps (and not renormalised: they were unit rows
 * already), so they stay bit-identical.
 *
 * Evaluation (kNN and linear probe of the trunk's features): swav_eval.c.
 */
#include "swav.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define QUEUE_MAX_BATCHES 64 /* SwAV: 3840 rows with batches of 256, 15 */
#define HEAD_SEED 0x5357415648454144ull /* the head's re-initialisation */

/* --wrap block: a unit per residual block (per layer of the CNN), the head,
 * and each prototype layer an fp32 unit inside it (VISSL's FSDP SwAV). */
static enum fsdp_wrap swav_wrap(struct fsdp_module *m, void *ud, struct fsdp_unit_overrides *ovr) {
    (void)ud;
    const char *ty = m->ops->type;
    if (!strcmp(ty, "BasicBlock") || !strcmp(ty, "Bottleneck") || !strcmp(ty, "SwAVHead")) return FSDP_WRAP_UNIT;
    if (!strcmp(ty, "Sequential") && !strncmp(m->fqn, "trunk.layer", 11) && !strchr(m->fqn + 11, '.'))
        return !strcmp(m->parent ? m->parent->ops->type : "", "ResNet") ? FSDP_WRAP_SKIP : FSDP_WRAP_UNIT;
    if (m->parent && !strcmp(m->parent->ops->type, "SwAVHead") && !strncmp(m->name, "prototypes", 10)) {
        ovr->set = FSDP_OVR_MIXED_PRECISION;
        ovr->mixed_precision = FSDP_MP_FULL;
        return FSDP_WRAP_UNIT_OVERRIDE;
    }
    return FSDP_WRAP_SKIP;
}

static enum fsdp_status build(struct fsdp_ctx *ctx, struct swav *k, struct fsdp_module **out) {
    struct fsdp_module *root, *trunk = NULL, *head = NULL;
    if (task_is_resnet(k->arch)) TRY(fsdp_resnet_create(ctx, &k->rc, &trunk));
    else TRY(task_cnn_create(ctx, k->ti.channels, k->cnn_width, 0, &trunk));
    snprintf(trunk->name, sizeof trunk->name, "trunk");
    enum fsdp_status st = fsdp_swav_head_create(ctx, "head", &k->hc, &head);
    if (st == FSDP_OK && k->L) { /* the queue: buffers of the head ([Note: SwAV queue]) */
        int64_t qs[3] = {2, k->L, k->hc.out_dim};
        struct fsdp_init zeros = {FSDP_INIT_ZEROS, 0.0f};
        st = fsdp_module_add_buffer(ctx, head, "queue", FSDP_F32, 3, qs, zeros, 1, &k->queue);
        if (st == FSDP_OK) st = fsdp_module_add_buffer(ctx, head, "queue_filled", FSDP_I64, 0, NULL, zeros, 1, &k->queue_filled);
        if (st != FSDP_OK) fsdp_module_free(head);
    }
    if (st != FSDP_OK) {
        fsdp_module_free(trunk);
        return st;
    }
    TRY(fsdp_swav_model_create(ctx, "", trunk, head, &root)); /* it takes trunk and head */
    k->trunk = trunk;
    k->head = head;
    *out = root;
    return FSDP_OK;
}

/* ---- Deterministic draws ---- */

static uint64_t mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* Position p of epoch e's order of n images: a Fisher-Yates permutation
 * drawn from (seed, e), cached. */
static int32_t *g_perm;
static int64_t g_perm_epoch = -1;
static int64_t image_at(const struct swav *k, uint64_t seed, int64_t g) {
    int64_t n = k->ti.count, e = g / n, p = g % n;
    if (g_perm_epoch != e) {
        if (!g_perm && !(g_perm = malloc((size_t)n * sizeof(int32_t)))) fail_rank("out of memory shuffling");
        for (int64_t i = 0; i < n; i++) g_perm[i] = (int32_t)i;
        for (int64_t i = n - 1; i > 0; i--) {
            int64_t j = (int64_t)(mix64(mix64(seed ^ 0x73687566ull) + (uint64_t)e * 0x100000001ull + (uint64_t)i) %
                                  (uint64_t)(i + 1));
            int32_t t = g_perm[i];
            g_perm[i] = g_perm[j];
            g_perm[j] = t;
        }
        g_perm_epoch = e;
    }
    return g_perm[p];
}

static double unit01(uint64_t h) { return (double)(mix64(h) >> 11) / 9007199254740992.0; }

/* Intensity jitter of a crop x (C, S, S) of values in [0, 1], torchvision's
 * ColorJitter(brightness=X, contrast=X) applied with probability 0.8 (as
 * SwAV's RandomApply): brightness x *= b, contrast x = c x + (1 - c) mean(x)
 * (the crop's mean over channels: the grayscale mean for one channel), each
 * clamped to [0, 1], b and c uniform in [max(0, 1 - X), 1 + X], in an order
 * drawn too; every draw from the key h alone. */
static void jitter(float *x, int C, int S, float X, uint64_t h) {
    if (unit01(h) >= 0.8) return;
    double lo = X < 1 ? 1.0 - X : 0.0, hi = 1.0 + X;
    float b = (float)(lo + (hi - lo) * unit01(h + 1)), c = (float)(lo + (hi - lo) * unit01(h + 2));
    int contrast_first = unit01(h + 3) < 0.5;
    int64_t n = (int64_t)C * S * S;
    for (int pass = 0; pass < 2; pass++) {
        if ((pass == 0) != contrast_first) { /* brightness */
            for (int64_t i = 0; i < n; i++) x[i] = fminf(fmaxf(x[i] * b, 0.0f), 1.0f);
        } else {
            double m = 0;
            for (int64_t i = 0; i < n; i++) m += x[i];
            float mf = (float)(m / (double)n);
            for (int64_t i = 0; i < n; i++) x[i] = fminf(fmaxf(c * x[i] + (1.0f - c) * mf, 0.0f), 1.0f);
        }
    }
}

/* Crop `view` of image idx in epoch e: RandomResizedCrop to S x S, the
 * intensity jitter, a flip, normalised, into dst (C, S, S). */
static void make_crop(struct fsdp_ctx *ctx, const struct swav *k, const struct opts *o, int64_t e, int64_t idx,
                      int view, int S, const float *scale, float *dst, float *tmp) {
    if (fsdp_images_random_resized_crop(ctx, k->train, o->seed, e, idx, view, S, S, scale[0], scale[1], tmp) !=
        FSDP_OK)
        fail_rank("--data: %s", fsdp_errmsg(ctx));
    uint64_t key = ((uint64_t)e * (uint64_t)k->ti.count + (uint64_t)idx) * 64 + (uint64_t)view;
    int flip = (int)(mix64(mix64(o->seed ^ 0x666c6970ull) ^ key) & 1u);
    int C = k->ti.channels;
    if (o->crops_jitter > 0) jitter(tmp, C, S, o->crops_jitter, mix64(mix64(o->seed ^ 0x6a6974746572ull) ^ key));
    for (int c = 0; c < C; c++)
        for (int y = 0; y < S; y++)
            for (int x = 0; x < S; x++)
                dst[((int64_t)c * S + y) * S + x] =
                    (tmp[((int64_t)c * S + y) * S + (flip ? S - 1 - x : x)] - k->bo.mean[c]) / k->bo.std[c];
}

/* ---- Head re-initialisation and the prototype hook ---- */

static double gauss(uint64_t *s) { /* Irwin-Hall of 4 uniforms, unit variance */
    double u = 0;
    for (int j = 0; j < 4; j++) {
        *s = mix64(*s);
        u += (double)(*s >> 11) / 9007199254740992.0;
    }
    return (u - 2.0) * 1.7320508075688772;
}

void swav_normalise_rows(float *w, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; r++) {
        double n = 0;
        for (int64_t c = 0; c < cols; c++) n += (double)w[r * cols + c] * w[r * cols + c];
        n = sqrt(n);
        if (n > 0)
            for (int64_t c = 0; c < cols; c++) w[r * cols + c] = (float)(w[r * cols + c] / n);
    }
}

static int reinit_param(struct fsdp_param *p, void *ud) {
    uint64_t *s = ud;
    if (!strcmp(p->owner->ops->type, "BatchNorm2d")) {
        for (int64_t i = 0; i < p->numel; i++) p->data[i] = strcmp(p->name, "weight") ? 0.0f : 1.0f;
        return 0;
    }
    if (p->ndim != 2) { /* Linear biases */
        for (int64_t i = 0; i < p->numel; i++) p->data[i] = 0.0f;
        return 0;
    }
    double std = 1.0 / sqrt(3.0 * (double)p->shape[1]);
    for (int64_t i = 0; i < p->numel; i++) p->data[i] = (float)(std * gauss(s));
    if (!strncmp(p->owner->name, "prototypes", 10)) swav_normalise_rows(p->data, p->shape[0], p->shape[1]);
    return 0;
}

static struct fsdp_param *proto_param(struct swav *k, int j) {
    char fqn[64];
    snprintf(fqn, sizeof fqn, "head.prototypes%d.weight", j);
    return fsdp_module_find_param(k->root_m, fqn);
}

static struct fsdp_module *proto_module(struct swav *k, int j) {
    char name[24];
    snprintf(name, sizeof name, "prototypes%d", j);
    for (int i = 0; i < k->head->n_children; i++)
        if (!strcmp(k->head->children[i]->name, name)) return k->head->children[i];
    return NULL;
}

/* post-step: unit rows (unless frozen), and the checks for --log */
static enum fsdp_status proto_hook(struct fsdp_ctx *ctx, struct fsdp_model *fm, struct fsdp_module *m, void *ud) {
    (void)m;
    struct swav *k = ud;
    double err = 0;
    uint64_t h = 1469598103934665603ull;
    for (int j = 0; j < k->hc.n_heads; j++) {
        TRY(fsdp_summon_full_params(ctx, fm, proto_module(k, j), !k->frozen, 0));
        struct fsdp_param *p = proto_param(k, j);
        if (!k->frozen) swav_normalise_rows(p->data, p->shape[0], p->shape[1]);
        for (int64_t r = 0; r < p->shape[0]; r++) {
            double n = 0;
            for (int64_t c = 0; c < p->shape[1]; c++) n += (double)p->data[r * p->shape[1] + c] * p->data[r * p->shape[1] + c];
            err = fmax(err, fabs(sqrt(n) - 1.0));
        }
        for (int64_t i = 0; i < p->numel; i++) {
            uint32_t b;
            memcpy(&b, &p->data[i], 4);
            h = (h ^ b) * 1099511628211ull;
        }
        TRY(fsdp_summon_end(ctx, fm));
    }
    int world = fsdp_ctx_world(ctx);
    int64_t mine = (int64_t)h, *all = malloc((size_t)world * sizeof(int64_t));
    if (!all) return FSDP_ERR_NOMEM;
    enum fsdp_status st = fsdp_comm_allgather(fsdp_ctx_comm(ctx), &mine, all, 1, FSDP_I64);
    k->proto_agree = 1;
    for (int r = 0; r < world; r++) k->proto_agree &= all[r] == mine;
    free(all);
    k->proto_err = err;
    k->proto_hash = h;
    return st;
}

/* ---- SwAV's queue ---- */

/* [Note: SwAV queue]
 * SwAV keeps, per rank and per assigned (global) crop, the embeddings z of
 * the last L / world images that rank saw; before Sinkhorn-Knopp their scores
 * against the current prototypes are put in front of the batch's scores, the
 * codes are computed over both, and only the batch's codes enter the loss.
 * That queue depends on the world size (which images each rank saw), so its
 * codes at N ranks are not the 1-rank codes. Here the queue is global and
 * the same at every world size:
 *   - the buffer head.queue (2, L, D) holds, per global crop, the embeddings
 *     of the last L images of the global batches, in global order (image
 *     r Bl + b of a batch, rank r's b-th, in row r Bl + b; the newest batch in
 *     rows [0, B), as SwAV rolls its queue), identical on every rank: after
 *     the loss each rank all-gathers the batch's embeddings (2 Bl D floats of
 *     each rank) and rolls them in alike; head.queue_filled counts the rows
 *     filled;
 *   - in the codes rank r contributes rows [r L / N, (r + 1) L / N) (their
 *     scores against the prototypes, gathered with fsdp_summon_full_params at
 *     the start of the step, before they change): the ranks' rows make up
 *     the queue once, and fsdp_sinkhorn's sums over ranks give the 1-rank
 *     codes to within summation order;
 *   - as a replicated persistent buffer it is saved whole and read back at
 *     any world size ([Note: buffers] in src/fsdp/buffers.c), so a resumed
 *     run continues with the same queue.
 * As in SwAV, filling starts with the first step of epoch
 * --queue-start-epoch and the queue enters the codes from the first step
 * that finds it full. One queue of embeddings serves every prototype head
 * (its scores are per head). Cost: 2 L D floats per rank (L 3840, D 128:
 * 3.9 MB) and an all-gather of 2 B D floats per step. */

/* The scores of this rank's queue rows against every head's prototypes,
 * into k->qsc. COLLECTIVE (summons each prototype unit). */
static enum fsdp_status queue_scores(struct fsdp_ctx *ctx, struct fsdp_model *fm, struct swav *k) {
    int64_t D = k->hc.out_dim, K = k->hc.n_prototypes, Lr = k->q_rows;
    const float *q = k->queue->data;
    for (int j = 0; j < k->hc.n_heads; j++) {
        TRY(fsdp_summon_full_params(ctx, fm, proto_module(k, j), 0, 0));
        const struct fsdp_param *p = proto_param(k, j);
        enum fsdp_status st = FSDP_OK;
        for (int a = 0; a < 2 && st == FSDP_OK && Lr; a++)
            st = fsdp_gemm(ctx, NULL, 0, 1, Lr, K, D, 1.0f, q + ((int64_t)a * k->L + k->q_lo) * D, D, p->data, D,
                           0.0f, k->qsc + ((int64_t)j * 2 + a) * Lr * K, K);
        enum fsdp_status st2 = fsdp_summon_end(ctx, fm);
        TRY(st);
        TRY(st2);
    }
    return FSDP_OK;
}

/* Rolls the global batch's embeddings (the global crops' z, columns [0, D)
 * of k->og) into the queue, alike on every rank. COLLECTIVE. */
static enum fsdp_status queue_push(struct fsdp_ctx *ctx, struct swav *k) {
    int world = fsdp_ctx_world(ctx);
    int64_t D = k->hc.out_dim, Bl = k->Bl, Bg = Bl * world, L = k->L;
    for (int64_t i = 0; i < 2 * Bl; i++) memcpy(k->zmine + i * D, k->og + i * k->W, (size_t)D * sizeof(float));
    TRY(fsdp_comm_allgather(fsdp_ctx_comm(ctx), k->zmine, k->zall, (size_t)(2 * Bl * D), FSDP_F32));
    float *q = k->queue->data;
    for (int64_t v = 0; v < 2; v++) {
        float *qv = q + v * L * D;
        memmove(qv + Bg * D, qv, (size_t)((L - Bg) * D) * sizeof(float));
        for (int r = 0; r < world; r++)
            memcpy(qv + (int64_t)r * Bl * D, k->zall + (((int64_t)r * 2 + v) * Bl) * D, (size_t)(Bl * D) * sizeof(float));
    }
    int64_t *filled = k->queue_filled->data;
    *filled = *filled + Bg < L ? *filled + Bg : L;
    return FSDP_OK;
}

/* ---- The task ---- */

static void swav_open(struct task *t, struct fsdp_ctx *ctx, const struct opts *o) {
    struct swav *k = t->impl;
    if (build(ctx, k, &t->root) != FSDP_OK) fail_all("model: %s", fsdp_errmsg(ctx));
    k->root_m = t->root;
    int sync = o->sync_bn >= 0 ? o->sync_bn : fsdp_ctx_world(ctx) > 1;
    fsdp_batchnorm_set_sync(t->root, sync, NULL, NULL);
    k->Bl = o->batch / fsdp_ctx_world(ctx);
    int C = k->ti.channels;
    int64_t ng = 2 * (int64_t)k->Bl, ns = (int64_t)k->V * k->Bl, K = k->hc.n_prototypes;
    size_t gsz = (size_t)(ng * C * k->Sg * k->Sg), ssz = (size_t)(ns * C * k->Ss * k->Ss);
    k->xg = malloc(gsz * sizeof(float));
    k->xs = malloc((ssz + 1) * sizeof(float));
    k->og = malloc((size_t)(ng * k->W) * sizeof(float));
    k->os = malloc((size_t)(ns * k->W + 1) * sizeof(float));
    k->dg = malloc((size_t)(ng * k->W) * sizeof(float));
    k->ds = malloc((size_t)(ns * k->W + 1) * sizeof(float));
    k->sc = malloc((size_t)((ng + ns) * K) * sizeof(float));
    k->dsc = malloc((size_t)((ng + ns) * K) * sizeof(float));
    k->codes = malloc((size_t)((int64_t)k->hc.n_heads * ng * K) * sizeof(float));
    if (!k->xg || !k->xs || !k->og || !k->os || !k->dg || !k->ds || !k->sc || !k->dsc || !k->codes)
        fail_rank("out of memory for the crops");
    if (k->L) {
        int rank = fsdp_ctx_rank(ctx), world = fsdp_ctx_world(ctx);
        int64_t D = k->hc.out_dim;
        k->q_lo = (int64_t)rank * k->L / world;
        k->q_rows = (int64_t)(rank + 1) * k->L / world - k->q_lo;
        k->zmine = malloc((size_t)(2 * k->Bl * D) * sizeof(float));
        k->zall = malloc((size_t)(2 * k->Bl * D * world) * sizeof(float));
        k->qsc = malloc((size_t)((int64_t)k->hc.n_heads * 2 * k->q_rows * K + 1) * sizeof(float));
        if (!k->zmine || !k->zall || !k->qsc) fail_rank("out of memory for the queue");
    }
    k->bo = fsdp_image_batch_opts_default();
    task_images_norm(o, &k->bo);
    k->so = fsdp_swav_opts_default();
    k->so.temperature = o->swav_temperature;
    k->so.epsilon = o->swav_epsilon;
    k->so.sinkhorn_iters = o->sinkhorn_iters;
}

static void swav_prepare_optim(struct task *t, struct fsdp_ctx *ctx, const struct opts *o, struct fsdp_optim *opt) {
    struct swav *k = t->impl;
    k->opt = opt;
    k->frozen = 0; /* a new optimizer's groups start unfrozen (the memory plan ran steps on its own) */
    if (o->freeze_prototypes_iters <= 0) return;
    char names[64][32];
    const char *fq[64];
    for (int j = 0; j < k->hc.n_heads; j++) {
        snprintf(names[j], sizeof names[j], "head.prototypes%d.weight", j);
        fq[j] = names[j];
    }
    if (fsdp_optim_add_group(opt, fq, k->hc.n_heads, o->weight_decay, 1.0f) != FSDP_OK)
        fail_all("--freeze-prototypes-iters: %s", fsdp_errmsg(ctx));
    k->proto_group = fsdp_optim_n_groups(opt);
}

static void set_frozen(struct fsdp_ctx *ctx, struct swav *k, int on) {
    if (!k->proto_group || k->frozen == on) return;
    struct fsdp_optim_group_settings gs;
    if (fsdp_optim_group_get(k->opt, k->proto_group, &gs) != FSDP_OK) fail_all("%s", fsdp_errmsg(ctx));
    gs.frozen = on;
    if (fsdp_optim_group_set(k->opt, k->proto_group, &gs) != FSDP_OK) fail_all("%s", fsdp_errmsg(ctx));
    k->frozen = on;
}

static void swav_after_shard(struct task *t, struct fsdp_ctx *ctx, const struct opts *o, struct fsdp_model *fm,
                             struct fsdp_optim *opt) {
    (void)opt;
    struct swav *k = t->impl;
    if (!o->resume && !o->init_from) { /* VISSL: the head from a fixed seed, alike on every rank */
        uint64_t s = HEAD_SEED ^ o->seed;
        if (fsdp_summon_full_params(ctx, fm, k->head, 1, 0) != FSDP_OK) fail_all("head init: %s", fsdp_errmsg(ctx));
        fsdp_module_foreach_param(k->head, reinit_param, &s);
        if (fsdp_summon_end(ctx, fm) != FSDP_OK) fail_all("head init: %s", fsdp_errmsg(ctx));
    }
    if (fsdp_model_add_post_step_hook(ctx, fm, k->head, proto_hook, k) != FSDP_OK)
        fail_all("prototype hook: %s", fsdp_errmsg(ctx));
    set_frozen(ctx, k, o->freeze_prototypes_iters > 0);
    /* the starting prototypes' checks (a collective: every rank) */
    int fr = k->frozen;
    k->frozen = 1; /* read only */
    if (proto_hook(ctx, fm, k->head, k) != FSDP_OK) fail_all("prototypes: %s", fsdp_errmsg(ctx));
    k->frozen = fr;
}

static void swav_describe_model(struct task *t, struct fsdp_ctx *ctx, const struct opts *o, struct fsdp_model *fm) {
    struct swav *k = t->impl;
    int sync = o->sync_bn >= 0 ? o->sync_bn : fsdp_ctx_world(ctx) > 1;
    printf("model: swav: trunk %s (%lld features), head hidden %lld, dim %lld, %d x %lld prototypes: %.3fM "
           "parameters in %d units; batch norm %s\n",
           k->arch, (long long)k->feat_dim, (long long)k->hc.hidden_dim, (long long)k->hc.out_dim, k->hc.n_heads,
           (long long)k->hc.n_prototypes, (double)fsdp_module_numel(t->root) / 1e6, fsdp_model_n_units(fm),
           sync ? "synchronised (SyncBatchNorm)" : "per rank");
    printf("prototypes: start hash %016llx, max |row norm - 1| %.2e, the same on every rank: %s%s\n",
           (unsigned long long)k->proto_hash, k->proto_err, k->proto_agree ? "yes" : "NO",
           k->proto_group ? "; frozen for the first steps" : "");
}

static void swav_describe_data(struct task *t, struct fsdp_ctx *ctx, const struct opts *o, struct fsdp_model *fm) {
    (void)ctx;
    (void)fm;
    struct swav *k = t->impl;
    char fl[160];
    printf("data: %s, %lld training images of %dx%dx%d; crops per image: 2 x %dx%d (scale %g-%g) + %d x %dx%d "
           "(scale %g-%g), intensity jitter %g; kNN on %d, linear probe on %d training images, features: %s%s\n",
           k->data_name, (long long)k->ti.count, k->ti.channels, k->ti.height, k->ti.width, k->Sg, k->Sg,
           (double)o->crops_global_scale[0], (double)o->crops_global_scale[1], k->V, k->Ss, k->Ss,
           (double)o->crops_small_scale[0], (double)o->crops_small_scale[1], (double)o->crops_jitter, o->knn_train,
           o->probe_train, swav_eval_features(k, o, fl, sizeof fl), o->n_eval_layer > 1 ? " (the layer chosen on held-out training images)" : "");
    if (o->eval_precise_bn > 0)
        printf("evaluation: the trunk's batch norm statistics re-estimated on %d whole training images first "
               "(precise BN)\n", o->eval_precise_bn);
    if (k->L)
        printf("queue: %lld global-crop embeddings per crop (%lld batches), filled from epoch %d, in the codes once full\n",
               (long long)k->L, (long long)(k->L / o->batch), o->queue_start_epoch);
}

/* FSDP_LOSS_USER: the target is the precomputed gradient (out's shape),
 * handed back; the loss is recorded once per step. */
static enum fsdp_status user_loss(struct fsdp_ctx *ctx, const struct fsdp_tensor *out, const struct fsdp_tensor *tg,
                                  void *ud, double *value, struct fsdp_tensor *dout) {
    (void)ctx;
    struct swav *k = ud;
    int64_t n = out->shape[0] * out->shape[1];
    if (dout->data != tg->data) memmove(dout->data, tg->data, (size_t)n * sizeof(float));
    *value = k->loss_value;
    return FSDP_OK;
}

/* The gradient is written over the model's output (the library's then, and
 * dead once taken: backward hands the arena back as it passes the head and
 * the trunk's layers, [Note: backward releases the blocks]); the output's
 * values were copied out before. */
static enum fsdp_status loss_backward(struct fsdp_ctx *ctx, struct fsdp_model *fm, struct swav *k,
                                      const struct fsdp_tensor *out, const float *grad, double value) {
    struct fsdp_loss L = {0};
    L.kind = FSDP_LOSS_USER;
    L.fn = user_loss;
    L.ud = k;
    k->loss_value = value;
    struct fsdp_tensor d = *out, tg = *out;
    tg.data = (void *)grad;
    TRY(fsdp_model_loss(ctx, fm, &L, out, &tg, 1, NULL, &d));
    return fsdp_model_backward(ctx, fm, &d);
}

/* SwAV's loss terms, averaged over the heads, of the global crops (small 0:
 * out holds their 2 Bl rows of W, and the codes of every head are made
 * first) or of the V small crops (small 1: V Bl rows, the codes the global
 * call made); d loss / d out into dout (zero in z's columns [0, D): the loss
 * reads the scores only), scaled to the ranks' averaging convention
 * ([Note: SwAV step]). COLLECTIVE. */
static enum fsdp_status crop_terms(struct fsdp_ctx *ctx, struct swav *k, int Bl, int V, int small, const float *out,
                                   float *dout, double *loss) {
    struct fsdp_comm *comm = fsdp_ctx_comm(ctx);
    int64_t K = k->hc.n_prototypes, D = k->hc.out_dim, W = k->W;
    int nv = small ? V : 2, v0 = small ? 2 : 0;
    int64_t rows = (int64_t)nv * Bl;
    const int assign[2] = {0, 1};
    float gscale = (float)fsdp_ctx_world(ctx) / (float)k->hc.n_heads;
    memset(dout, 0, (size_t)(rows * W) * sizeof(float));
    *loss = 0;
    for (int j = 0; j < k->hc.n_heads; j++) {
        for (int64_t i = 0; i < rows; i++) memcpy(k->sc + i * K, out + i * W + D + j * K, (size_t)K * sizeof(float));
        float *codes = k->codes + (int64_t)j * 2 * Bl * K;
        if (!small) { /* the queue's rows, when it is in the codes (else none) */
            const float *qp[2] = {NULL, NULL};
            int64_t ql[2] = {0, 0};
            for (int a = 0; k->queue_used && a < 2; a++) {
                qp[a] = k->qsc + ((int64_t)j * 2 + a) * k->q_rows * K;
                ql[a] = k->q_rows;
            }
            TRY(fsdp_swav_codes(ctx, comm, &k->so, k->sc, 2, Bl, K, assign, 2, qp, ql, codes));
        }
        double lj;
        TRY(fsdp_swav_predict(ctx, comm, &k->so, k->sc, v0, nv, 2 + V, Bl, K, assign, 2, codes, &lj, k->dsc));
        *loss += lj / k->hc.n_heads;
        for (int64_t i = 0; i < rows; i++)
            for (int64_t c = 0; c < K; c++) dout[i * W + D + j * K + c] = k->dsc[i * K + c] * gscale;
    }
    return FSDP_OK;
}

void swav_append_extra(struct task *t, const char *key, double v) {
    size_t len = strlen(t->log_extra);
    if (isfinite(v)) snprintf(t->log_extra + len, sizeof t->log_extra - len, "\"%s\": %.6f, ", key, v);
    else snprintf(t->log_extra + len, sizeof t->log_extra - len, "\"%s\": null, ", key);
}

static enum fsdp_status swav_step(struct task *t, struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct opts *o,
                                  int step, float lr, struct fsdp_step_result *r) {
    struct swav *k = t->impl;
    set_frozen(ctx, k, step < o->freeze_prototypes_iters);
    int rank = fsdp_ctx_rank(ctx), world = fsdp_ctx_world(ctx), C = k->ti.channels, V = k->V;
    int Bl = o->batch / world; /* k->Bl, or the memory plan's world (fsdp-train --dry-run --nproc) */
    int64_t n = k->ti.count, W = k->W;
    float *tmp = malloc((size_t)C * (size_t)(k->Sg > k->Ss ? k->Sg : k->Ss) * (size_t)(k->Sg > k->Ss ? k->Sg : k->Ss) *
                        sizeof(float));
    if (!tmp) fail_rank("out of memory for a crop");
    for (int b = 0; b < Bl; b++) {
        int64_t g = (int64_t)step * o->batch + (int64_t)rank * Bl + b, e = g / n;
        int64_t idx = o->shuffle ? image_at(k, o->seed, g) : g % n;
        for (int v = 0; v < 2; v++)
            make_crop(ctx, k, o, e, idx, v, k->Sg, o->crops_global_scale,
                      k->xg + ((int64_t)v * Bl + b) * C * k->Sg * k->Sg, tmp);
        for (int v = 0; v < V; v++)
            make_crop(ctx, k, o, e, idx, 2 + v, k->Ss, o->crops_small_scale,
                      k->xs + ((int64_t)v * Bl + b) * C * k->Ss * k->Ss, tmp);
    }
    free(tmp);
    /* the queue's scores, before any forward ([Note: SwAV queue]) */
    k->queue_used = k->L && *(const int64_t *)k->queue_filled->data >= k->L;
    if (k->queue_used) TRY(queue_scores(ctx, fm, k));
    struct fsdp_tensor ing = {k->xg, FSDP_F32, 4, {2 * (int64_t)Bl, C, k->Sg, k->Sg}, FSDP_LAYOUT_PLAIN};
    struct fsdp_tensor ins = {k->xs, FSDP_F32, 4, {(int64_t)V * Bl, C, k->Ss, k->Ss}, FSDP_LAYOUT_PLAIN};
    struct fsdp_tensor outg = {0}, outs = {0};
    TRY(fsdp_model_forward_tensor(ctx, fm, &ing, &outg));
    memcpy(k->og, outg.data, (size_t)(2 * Bl * W) * sizeof(float));
    /* the global crops: codes and their terms, their backward; then the small crops' */
    double loss_g = 0;
    TRY(crop_terms(ctx, k, Bl, V, 0, k->og, k->dg, &loss_g));
    if (k->L && (int64_t)step * o->batch / n >= o->queue_start_epoch) TRY(queue_push(ctx, k));
    TRY(loss_backward(ctx, fm, k, &outg, k->dg, loss_g));
    if (V) { /* --bn-stats-crops global: the small crops leave the running statistics alone */
        int global_only = !strcmp(o->bn_stats_crops, "global");
        if (global_only) fsdp_batchnorm_set_update_stats(t->root, 0, NULL);
        enum fsdp_status st = fsdp_model_forward_tensor(ctx, fm, &ins, &outs);
        if (global_only) fsdp_batchnorm_set_update_stats(t->root, 1, NULL);
        TRY(st);
        memcpy(k->os, outs.data, (size_t)(V * Bl * W) * sizeof(float));
        double loss_s = 0;
        TRY(crop_terms(ctx, k, Bl, V, 1, k->os, k->ds, &loss_s));
        TRY(loss_backward(ctx, fm, k, &outs, k->ds, loss_s));
    }
    TRY(fsdp_model_optim_step(ctx, fm, lr, o->clip, r));
    char hx[24];
    snprintf(hx, sizeof hx, "%016llx", (unsigned long long)k->proto_hash);
    snprintf(t->log_extra, sizeof t->log_extra,
             "\"proto_norm_err\": %.3g, \"proto_ranks_agree\": %d, \"proto_hash\": \"%s\", \"proto_frozen\": %d, "
             "\"queue_used\": %d, \"queue_filled\": %lld, ",
             k->proto_err, k->proto_agree, hx, k->frozen, k->queue_used,
             (long long)(k->L ? *(const int64_t *)k->queue_filled->data : 0));
    if (k->baseline_done == 1) {
        static const char *const keys[4] = {"base_knn_acc", "base_probe_acc", "raw_knn_acc", "raw_probe_acc"};
        for (int i = 0; i < 4; i++) swav_append_extra(t, keys[i], k->base[i]);
        if (o->n_eval_layer > 1) swav_append_extra(t, "base_knn_layer", k->base[4]), swav_append_extra(t, "base_probe_layer", k->base[5]);
        k->baseline_done = 2;
    }
    return FSDP_OK;
}

/* The trunk as meta.json records it: "cnn", or the ResNet's config object. */
static void trunk_json(const struct swav *k, char *buf, size_t cap) {
    if (task_is_resnet(k->arch)) fsdp_resnet_config_json(&k->rc, buf, cap);
    else snprintf(buf, cap, "\"%s\"", k->arch);
}

static void swav_meta(struct task *t, struct fsdp_ckpt_meta *m) {
    struct swav *k = t->impl;
    char trunk[256];
    trunk_json(k, trunk, sizeof trunk);
    snprintf(m->model_json, sizeof m->model_json,
             "{\"task\":\"swav\",\"trunk\":%s,\"swav_hidden\":%lld,\"swav_dim\":%lld,\"nmb_prototypes\":%lld,"
             "\"nmb_heads\":%d}",
             trunk, (long long)k->hc.hidden_dim, (long long)k->hc.out_dim, (long long)k->hc.n_prototypes,
             k->hc.n_heads);
}

/* --resume: the checkpoint's trunk (meta.json's "trunk": "cnn", a ResNet's
 * config object, or, from older checkpoints, a ResNet's name) into k->arch
 * and k->rc; 0 when it records none. */
static int ck_trunk(struct fsdp_ctx *ctx, struct swav *k, const struct fsdp_ckpt_meta *ck, const char *resume_dir) {
    cJSON *j = cJSON_Parse(ck->model_json);
    const cJSON *tr = cJSON_GetObjectItemCaseSensitive(j, "trunk");
    int found = tr != NULL;
    char name[600];
    snprintf(name, sizeof name, "--resume %s: meta.json's \"trunk\"", resume_dir);
    if (cJSON_IsString(tr) && (!strcmp(tr->valuestring, "cnn") || task_is_resnet(tr->valuestring))) {
        snprintf(k->arch, sizeof k->arch, "%s", tr->valuestring);
        if (task_is_resnet(k->arch)) fsdp_resnet_config_preset(k->arch, &k->rc);
        k->rc.in_chans = k->ti.channels;
    } else if (cJSON_IsObject(tr)) {
        char *txt = cJSON_PrintUnformatted(tr);
        enum fsdp_status st = txt ? fsdp_resnet_config_parse(ctx, name, txt, strlen(txt), &k->rc) : FSDP_ERR_NOMEM;
        free(txt);
        if (st != FSDP_OK) {
            cJSON_Delete(j);
            fail_input("%s", st == FSDP_ERR_NOMEM ? "out of memory" : fsdp_errmsg(ctx));
        }
        snprintf(k->arch, sizeof k->arch, "%s", fsdp_resnet_arch_name(k->rc.arch));
    } else if (found) {
        cJSON_Delete(j);
        fail_input("%s is not a trunk (cnn, a ResNet's name or config)", name);
    }
    cJSON_Delete(j);
    return found;
}

static void swav_summary_note(struct task *t, char *buf, size_t cap) {
    (void)t;
    (void)buf;
    (void)cap;
}

static void swav_free(struct task *t) {
    struct swav *k = t->impl;
    if (!k) return;
    free(k->xg), free(k->xs), free(k->og), free(k->os), free(k->dg), free(k->ds), free(k->sc), free(k->dsc);
    free(k->codes);
    free(k->zmine), free(k->zall), free(k->qsc);
    fsdp_images_free(k->train);
    fsdp_images_free(k->test);
    free(g_perm);
    g_perm = NULL;
    free(k);
    t->impl = NULL;
}

static const struct task_ops swav_ops = {swav_open, swav_describe_model, swav_describe_data, swav_step,
                                         swav_eval, swav_meta,           swav_summary_note,  NULL,
                                         swav_free, swav_prepare_optim,  swav_after_shard, swav_before_train};

void task_swav_create(struct fsdp_ctx *ctx, struct opts *o, const struct fsdp_ckpt_meta *ck, const char *resume_dir,
                      struct task *t) {
    struct swav *k = calloc(1, sizeof *k);
    if (!k) fail_rank("out of memory");
    t->impl = k; /* reachable from here on, so an error exit leaks nothing */
    k->data_name = o->data ? o->data : IMAGE_DATA_DEFAULT;
    /* the classes of the training labels (the kNN's and the probe's), the test labels below them */
    k->n_classes = task_images_open_data(t, ctx, o, k->data_name, 0, &k->train, &k->test);
    fsdp_images_info(k->train, &k->ti);
    /* the trunk: --model cnn | resnet18/34/50, or a ResNet --model-config, else the checkpoint's */
    int from_ck = !o->model && !o->model_config && ck && ck_trunk(ctx, k, ck, resume_dir);
    if (from_ck) {
        k->cfg_source = resume_dir;
    } else if (o->model_config) {
        if (fsdp_resnet_config_load(ctx, o->model_config, &k->rc) != FSDP_OK) fail_input("%s", fsdp_errmsg(ctx));
        snprintf(k->arch, sizeof k->arch, "%s", fsdp_resnet_arch_name(k->rc.arch));
        k->cfg_source = o->model_config;
    } else {
        const char *m = o->model ? o->model : "resnet18";
        if (strcmp(m, "cnn") && !task_is_resnet(m))
            fail_input("--model: '%s' is not a trunk for --task swav (cnn, resnet18, resnet34, resnet50)", m);
        snprintf(k->arch, sizeof k->arch, "%s", m);
        if (task_is_resnet(m)) fsdp_resnet_config_preset(m, &k->rc);
        k->rc.in_chans = k->ti.channels;
        k->cfg_source = "--model";
    }
    k->rc.num_classes = 0;
    if (!from_ck && ck && (o->model || o->model_config)) { /* resuming with model flags: the checkpoint's trunk */
        struct swav c = *k;
        char mine[256], theirs[256];
        trunk_json(k, mine, sizeof mine);
        if (ck_trunk(ctx, &c, ck, resume_dir)) {
            c.rc.num_classes = 0;
            trunk_json(&c, theirs, sizeof theirs);
            if (strcmp(mine, theirs))
                fail_all("%s: the trunk %s differs from the checkpoint %s's %s (leave out the model flags to use the "
                         "checkpoint's trunk)", k->cfg_source, mine, resume_dir, theirs);
        }
    }
    if (o->eval_pool > 1 && !task_is_resnet(k->arch))
        fail_input("--eval-pool %d: the %s trunk has no feature map to pool (a ResNet trunk has)", o->eval_pool, k->arch);
    if ((o->n_eval_layer > 1 || o->eval_layer[0] != 4) && !task_is_resnet(k->arch))
        fail_input("--eval-layer: the %s trunk has no layers to read (a ResNet trunk has)", k->arch);
    if (task_is_resnet(k->arch) && k->rc.in_chans != k->ti.channels)
        fail_input("--data %s: the images have %d channels, but the trunk's in_chans is %d (%s)", k->data_name,
                   k->ti.channels, k->rc.in_chans, k->cfg_source);
    k->cnn_width = 16;
    k->feat_dim = task_is_resnet(k->arch) ? fsdp_resnet_channels(&k->rc, 0) : 2LL * k->cnn_width;
    k->hc = fsdp_swav_head_config_default(k->feat_dim);
    k->hc.hidden_dim = o->swav_hidden;
    k->hc.out_dim = o->swav_dim;
    k->hc.n_prototypes = o->nmb_prototypes;
    k->hc.n_heads = o->nmb_heads;
    k->W = k->hc.out_dim + (int64_t)k->hc.n_heads * k->hc.n_prototypes;
    k->Sg = o->crops_global_size;
    k->Ss = o->crops_small_size;
    k->V = o->crops_small;
    int side = k->ti.height < k->ti.width ? k->ti.height : k->ti.width;
    if (k->Sg > side)
        fail_input("--crops-global-size %d is larger than the images (%dx%d) of --data %s", k->Sg, k->ti.height,
                   k->ti.width, k->data_name);
    if (k->V && k->Ss > side)
        fail_input("--crops-small-size %d is larger than the images (%dx%d) of --data %s", k->Ss, k->ti.height,
                   k->ti.width, k->data_name);
    k->L = o->queue_length;
    if (k->L % o->batch)
        fail_input("--queue-length %d is not a multiple of the global batch (--batch %d): the queue rolls in whole "
                   "batches", o->queue_length, o->batch);
    if (k->L > (int64_t)QUEUE_MAX_BATCHES * o->batch || k->L > k->ti.count)
        fail_input("--queue-length %d is longer than %d global batches (--batch %d) or the %lld training images of "
                   "--data %s", o->queue_length, QUEUE_MAX_BATCHES, o->batch, (long long)k->ti.count, k->data_name);
    if (o->grad_accum != 1) fail_input("--grad-accum: --task swav takes no micro-batches (SwAV's codes need the whole batch)");
    t->ops = &swav_ops;
    t->impl = k;
    t->block_type = !strcmp(k->arch, "cnn") ? "Sequential" : !strcmp(k->arch, "resnet50") ? "Bottleneck" : "BasicBlock";
    t->wrap = swav_wrap;
    t->acc_name = "knn_acc";
    t->ac_attn_type = NULL;
    t->is_gpt = 0;
    t->item = "img";
    t->item_json = "images_per_s";
    snprintf(t->batch_unit, sizeof t->batch_unit, "images (x %d crops)", 2 + k->V);
    t->items_per_step = o->batch;
    t->train_flops_per_item = 0;
    t->seq = 1;
    t->steps = task_epoch_steps(o, k->ti.count, k->data_name);
}
