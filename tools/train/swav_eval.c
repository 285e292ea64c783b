/*
 * swav_eval.c - the evaluation of fsdp-train's SwAV task (swav.h): the
 * trunk's features (eval mode, the whole image, no augmentation; a ResNet's
 * --eval-layer maps pooled to --eval-pool), with --eval-precise-bn's batch
 * norm statistics first. kNN (knn_acc): the features of the first
 * --knn-train training images form a bank, L2 normalised and shared by
 * all-gathers; each test image of this rank's share votes with its k = 20
 * most cosine-similar bank images, weight exp(sim / 0.07) (Wu et al.'s
 * weighted kNN); correct counts are summed over ranks. Linear probe
 * (probe_acc): task_linear_probe on the same features. With several
 * --eval-layer or --probe-wd, held-out training images choose
 * ([Note: evaluation layers]).
 */
#include "swav.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KNN_K 20
#define KNN_T 0.07

/* The layer whose map reading --eval-layer L means (0: the trunk's output; [Note: evaluation layers]). */
static int map_layer(const struct opts *o, int L) { return o->eval_pool > 1 || L != 4 ? L : 0; }

/* The evaluations' features per image: the trunk's output (ml 0), or layer
 * ml's map pooled to G x G ([Note: evaluation layers]). */
static int64_t eval_dim(const struct swav *k, const struct opts *o, int ml) {
    return ml ? fsdp_resnet_channels(&k->rc, ml) * o->eval_pool * o->eval_pool : k->feat_dim;
}

const char *swav_eval_features(const struct swav *k, const struct opts *o, char *buf, size_t cap) {
    size_t at = 0;
    buf[0] = 0;
    for (int l = 0; l < o->n_eval_layer; l++) {
        int ml = map_layer(o, o->eval_layer[l]);
        if (ml)
            at += (size_t)snprintf(buf + at, at < cap ? cap - at : 0, "%s%lld (layer%d's map pooled to %d x %d)",
                                   l ? ", " : "", (long long)eval_dim(k, o, ml), ml, o->eval_pool, o->eval_pool);
        else
            at += (size_t)snprintf(buf + at, at < cap ? cap - at : 0, "%s%lld (the trunk's output)", l ? ", " : "",
                                   (long long)eval_dim(k, o, 0));
    }
    return buf;
}

/* [Note: evaluation pooling] --eval-pool G: VISSL's linear evaluations of a
 * ResNet read the last stage's map average-pooled to a small grid (res5:
 * AvgPool2d 6 x 6, stride 1 on the 7 x 7 map of a 224 px image, 2 x 2 x
 * 2048 features) rather than the trunk's global pool. Here the trunk hands
 * over layerL's map (--eval-layer, fsdp_resnet_set_feature_map) and each of its C
 * channels is pooled as AdaptiveAvgPool2d(G) does (cell i of G covers rows
 * floor(i h / G) .. ceil((i + 1) h / G) - 1, the same for columns), written
 * (C, G, G) in order, as torch's flatten of the pooled map. */
static void pool_map(const float *map, int64_t C, int64_t h, int64_t w, int G, float *out) {
    for (int64_t c = 0; c < C; c++)
        for (int i = 0; i < G; i++) {
            int64_t r0 = i * h / G, r1 = ((i + 1) * h + G - 1) / G;
            for (int j = 0; j < G; j++) {
                int64_t c0 = j * w / G, c1 = ((j + 1) * w + G - 1) / G;
                double s = 0;
                for (int64_t r = r0; r < r1; r++)
                    for (int64_t q = c0; q < c1; q++) s += map[(c * h + r) * w + q];
                out[(c * G + i) * G + j] = (float)(s / (double)((r1 - r0) * (c1 - c0)));
            }
        }
}

/* Trunk features (eval mode, whole images; raw: the normalised pixels) of
 * images [0, n) of im, every rank getting all of them: rank r computes its
 * share of each batch, all-gathered. ml: the layer whose map the trunk
 * gives (fsdp_resnet_set_feature_map), pooled here; 0: the trunk's output.
 * COLLECTIVE (unless raw). */
static enum fsdp_status features(struct task *t, struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct opts *o,
                                 const struct fsdp_images *im, int64_t n, int raw, int ml, float *feat) {
    struct swav *k = t->impl;
    int rank = fsdp_ctx_rank(ctx), world = fsdp_ctx_world(ctx);
    int64_t EB = task_eval_batch(o), chw = (int64_t)k->ti.channels * k->ti.height * k->ti.width;
    if (raw) {
        for (int64_t i = 0; i < n; i++) task_load_image(im, &k->bo, i, feat + i * chw);
        return FSDP_OK;
    }
    int64_t F = eval_dim(k, o, ml);
    int64_t mmax = (EB + world - 1) / world;
    float *x = malloc((size_t)(mmax * chw) * sizeof(float)), *mine = malloc((size_t)(mmax * F) * sizeof(float));
    float *all = malloc((size_t)(mmax * F * world) * sizeof(float));
    if (!x || !mine || !all) fail_rank("out of memory for the evaluation's features");
    enum fsdp_status st = FSDP_OK;
    for (int64_t s = 0; s < n && st == FSDP_OK; s += EB) {
        int64_t cnt = n - s < EB ? n - s : EB;
        int64_t lo = s + rank * cnt / world, m = s + (rank + 1) * cnt / world - lo;
        for (int64_t i = 0; i < (m ? m : 1); i++) task_load_image(im, &k->bo, m ? lo + i : s, x + i * chw);
        struct fsdp_tensor in = {x, FSDP_F32, 4, {m ? m : 1, k->ti.channels, k->ti.height, k->ti.width},
                                 FSDP_LAYOUT_PLAIN};
        struct fsdp_tensor out = {0};
        if ((st = fsdp_model_forward_tensor(ctx, fm, &in, &out)) != FSDP_OK) break;
        if (!feat) continue; /* precise BN: the forward's statistics are all it wants */
        memset(mine, 0, (size_t)(mmax * F) * sizeof(float));
        if (ml) { /* out: the layer's map (m, C, h, w) */
            int64_t C = out.shape[1], h = out.shape[2], w = out.shape[3];
            for (int64_t i = 0; i < m; i++)
                pool_map((const float *)out.data + i * C * h * w, C, h, w, o->eval_pool, mine + i * F);
        } else {
            memcpy(mine, out.data, (size_t)(m * F) * sizeof(float));
        }
        if ((st = fsdp_comm_allgather(fsdp_ctx_comm(ctx), mine, all, (size_t)(mmax * F), FSDP_F32)) != FSDP_OK) break;
        for (int r = 0; r < world; r++) {
            int64_t rlo = s + r * cnt / world, rm = s + (r + 1) * cnt / world - rlo;
            memcpy(feat + rlo * F, all + r * mmax * F, (size_t)(rm * F) * sizeof(float));
        }
    }
    free(x), free(mine), free(all);
    return st;
}

/* [Note: precise BN] Training's running statistics come from its crops
 * (momentum 0.1 over the last steps' global crops, --bn-stats-crops), but
 * the evaluations read whole images, which are zoomed out against the
 * crops: each layer's activations have other means and variances there.
 * --eval-precise-bn N re-estimates them as the evaluation sees its images:
 * every batch norm of the trunk reset, then train-mode forwards of the
 * first N training images, whole (batches of --eval-batch, SyncBN's global
 * statistics at N ranks), with the cumulative mean of the batches'
 * statistics (PyTorch's momentum None; Wu and Johnson's precise BN). No
 * labels are read. The training's own statistics are restored after the
 * evaluation: the run and its checkpoints are as without the flag. */
struct bn_saved {
    char *data; /* the trunk's buffers, one after another */
    size_t n;   /* bytes copied so far */
    int restore;
};

static size_t buffer_size(const struct fsdp_buffer *b) { return (size_t)b->numel * fsdp_dtype_size(b->dtype); }

static int save_buffer(struct fsdp_buffer *b, void *ud) {
    struct bn_saved *s = ud;
    if (s->restore) memcpy(b->data, s->data + s->n, buffer_size(b));
    else memcpy(s->data + s->n, b->data, buffer_size(b));
    s->n += buffer_size(b);
    return 0;
}

static int buffer_bytes(struct fsdp_buffer *b, void *ud) {
    *(size_t *)ud += buffer_size(b);
    return 0;
}

/* Saves the trunk's buffers into *s, then re-estimates its batch norm
 * statistics on the first n training images ([Note: precise BN]); the model
 * is left in eval mode. COLLECTIVE. */
static enum fsdp_status precise_bn(struct task *t, struct fsdp_ctx *ctx, struct fsdp_model *fm,
                                   const struct opts *o, int64_t n, struct bn_saved *s) {
    struct swav *k = t->impl;
    size_t bytes = 0;
    fsdp_module_foreach_buffer(k->trunk, buffer_bytes, &bytes);
    *s = (struct bn_saved){malloc(bytes + 1), 0, 0};
    if (!s->data) fail_rank("out of memory for --eval-precise-bn's copy of the trunk's buffers");
    fsdp_module_foreach_buffer(k->trunk, save_buffer, s);
    fsdp_batchnorm_reset_stats(k->trunk, NULL);
    fsdp_batchnorm_set_cumulative(k->trunk, 1, NULL);
    fsdp_module_set_training(t->root, 1);
    enum fsdp_status st = features(t, ctx, fm, o, k->train, n < k->ti.count ? n : k->ti.count, 0, 0, NULL);
    fsdp_module_set_training(t->root, 0);
    fsdp_batchnorm_set_cumulative(k->trunk, 0, NULL);
    return st;
}

static void restore_bn(struct task *t, struct bn_saved *s) {
    struct swav *k = t->impl;
    if (!s->data) return;
    s->n = 0, s->restore = 1;
    fsdp_module_foreach_buffer(k->trunk, save_buffer, s);
    free(s->data);
    s->data = NULL;
}

/* The kNN's accuracy: queries q (nq rows, L2-normalised, labels yq) against
 * the bank (nb rows, L2-normalised), rank r voting for its share of the
 * queries, summed over ranks. Every rank reaches the all-reduce, whatever
 * its own status. COLLECTIVE. */
static double knn_accuracy(struct swav *k, struct fsdp_ctx *ctx, const float *bank, const int32_t *yb, int64_t nb,
                           const float *q, const int32_t *yq, int64_t nq, int64_t F, enum fsdp_status *st) {
    int rank = fsdp_ctx_rank(ctx), world = fsdp_ctx_world(ctx);
    int64_t correct = 0, tot = 0;
    if (*st == FSDP_OK)
        correct = task_knn_correct(ctx, bank, yb, nb, q, yq, rank * nq / world, (rank + 1) * nq / world, F,
                                   k->n_classes, KNN_K, KNN_T, st);
    enum fsdp_status st2 = fsdp_comm_allreduce(fsdp_ctx_comm(ctx), &correct, &tot, 1, FSDP_I64, FSDP_SUM);
    if (*st == FSDP_OK) *st = st2;
    return nq && nb ? (double)tot / (double)nq : NAN;
}

/* [Note: evaluation layers] --eval-layer L reads layerL's map (VISSL's
 * res(L+1)) pooled to --eval-pool G x G: (C_L, G, G) features, C_L = 2^(L-1)
 * x the width (x 4 for Bottleneck). The default, layer 4 with G = 1, is the
 * trunk's own output. VISSL's benchmarks evaluate several layers (a convnet's
 * best features for a linear classifier are not always its last stage's);
 * with a list, each evaluation reads every layer in it and chooses, for the
 * kNN and for the probe separately, the layer that does best on held-out
 * training images: the kNN with a bank of the first five sixths of its bank
 * voting for the last sixth, the probe on the held-out sixth it chooses its
 * weight decay on ([Note: linear probe]). The test split plays no part in
 * the choice; the chosen layer's test accuracy is the one reported. */

/* Both evaluations of one kind of features (the trunk's, or raw pixels):
 * the weighted kNN on the first --knn-train training images (rank r votes
 * for its share of the test images, summed) and the linear probe on the
 * first --probe-train ([Note: linear probe]: every rank trains the same),
 * both tested on the test split (its first --eval-batches global batches of
 * --eval-batch images, where given);
 * for the trunk, at each --eval-layer, the held-out figures choosing
 * ([Note: evaluation layers]). *knn_layer, *probe_layer: the layers chosen.
 * COLLECTIVE. */
static enum fsdp_status evaluate(struct task *t, struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct opts *o,
                                 int raw, double *knn, double *probe, float *wd, int *knn_layer, int *probe_layer,
                                 int64_t *count) {
    struct swav *k = t->impl;
    struct fsdp_images_info vi;
    fsdp_images_info(k->test, &vi);
    int64_t nb = o->knn_train < k->ti.count ? o->knn_train : k->ti.count, nt = task_eval_images(o, vi.count);
    int64_t np = o->probe_train < k->ti.count ? o->probe_train : k->ti.count, ntr = nb > np ? nb : np;
    /* pbn: the layer precise BN runs the trunk to (0: all of it, as when the trunk's output is read);
     * pbn_ok: a layer's map is read (the trunk is a ResNet) */
    int nl = raw ? 1 : o->n_eval_layer, choose = nl > 1, pbn = 1, pbn_ok = 0;
    for (int l = 0; l < nl; l++) {
        int ml = map_layer(o, o->eval_layer[l]);
        pbn = !ml || !pbn ? 0 : ml > pbn ? ml : pbn;
        pbn_ok |= ml != 0;
    }
    int32_t *ytr = malloc((size_t)ntr * sizeof(int32_t)), *yte = malloc((size_t)nt * sizeof(int32_t));
    if (!ytr || !yte) fail_rank("out of memory for the evaluation");
    for (int64_t i = 0; i < ntr; i++) ytr[i] = fsdp_images_label(k->train, i);
    for (int64_t i = 0; i < nt; i++) yte[i] = fsdp_images_label(k->test, i);
    fsdp_module_set_training(t->root, 0);
    if (fsdp_swav_model_set_trunk_only(ctx, t->root, 1) != FSDP_OK) fail_rank("evaluation: %s", fsdp_errmsg(ctx));
    struct bn_saved saved = {0};
    enum fsdp_status st = FSDP_OK;
    if (!raw && o->eval_precise_bn > 0) { /* through the deepest layer read */
        if (pbn_ok) st = fsdp_resnet_set_feature_map(ctx, k->trunk, pbn);
        if (st == FSDP_OK) st = precise_bn(t, ctx, fm, o, o->eval_precise_bn, &saved);
    }
    double best_k = NAN, best_p = NAN; /* the chosen layers' held-out figures */
    *knn = *probe = NAN;
    *knn_layer = *probe_layer = raw ? 0 : o->eval_layer[0];
    for (int l = 0; l < nl && st == FSDP_OK; l++) {
        int L = o->eval_layer[l], ml = raw ? 0 : map_layer(o, L);
        int64_t F = raw ? (int64_t)k->ti.channels * k->ti.height * k->ti.width : eval_dim(k, o, ml);
        float *tr = malloc((size_t)(ntr * F) * sizeof(float)), *te = malloc((size_t)(nt * F) * sizeof(float));
        float *bank = malloc((size_t)(nb * F + 1) * sizeof(float)), *ten = malloc((size_t)(nt * F) * sizeof(float));
        if (!tr || !te || !bank || !ten) fail_rank("out of memory for the evaluation");
        if (!raw && pbn_ok) st = fsdp_resnet_set_feature_map(ctx, k->trunk, ml);
        if (st == FSDP_OK) st = features(t, ctx, fm, o, k->train, ntr, raw, ml, tr);
        if (st == FSDP_OK) st = features(t, ctx, fm, o, k->test, nt, raw, ml, te);
        double kacc = NAN, kheld = NAN, pacc = NAN, pheld = NAN;
        float pwd = o->probe_wd[0];
        if (nb > 0) { /* --knn-train 0: no kNN */
            memcpy(bank, tr, (size_t)(nb * F) * sizeof(float));
            memcpy(ten, te, (size_t)(nt * F) * sizeof(float));
            swav_normalise_rows(bank, nb, F);
            swav_normalise_rows(ten, nt, F);
            int64_t nv = nb / 6;
            if (choose && nv > 0) /* the bank's last sixth against its first five sixths */
                kheld = knn_accuracy(k, ctx, bank, ytr, nb - nv, bank + (nb - nv) * F, ytr + (nb - nv), nv, F, &st);
            kacc = knn_accuracy(k, ctx, bank, ytr, nb, ten, yte, nt, F, &st);
        }
        if (st == FSDP_OK && o->probe_epochs > 0 &&
            task_linear_probe(tr, ytr, np, te, yte, nt, F, k->n_classes, o->probe_epochs, o->probe_wd, o->n_probe_wd,
                              o->seed, &pacc, &pwd, choose ? &pheld : NULL))
            fail_rank("out of memory for the linear probe");
        if (!raw) k->layer_acc[l][0] = kacc, k->layer_acc[l][1] = pacc;
        /* the first layer, then any that does better held out (no held-out rows: the first) */
        if (l == 0 || kheld > best_k) best_k = kheld, *knn = kacc, *knn_layer = L;
        if (l == 0 || pheld > best_p) best_p = pheld, *probe = pacc, *wd = pwd, *probe_layer = L;
        free(tr), free(te), free(bank), free(ten);
    }
    restore_bn(t, &saved);
    if (!raw && pbn_ok) (void)fsdp_resnet_set_feature_map(ctx, k->trunk, 0); /* a ResNet: it took the layer */
    (void)fsdp_swav_model_set_trunk_only(ctx, t->root, 0); /* the root is a SwAV model: it took 1 above */
    fsdp_module_set_training(t->root, 1);
    *count = nt;
    free(ytr), free(yte);
    return st;
}

/* What held-out images chose for an accuracy: " (wd X, layerL chosen)" after a probe's when --probe-wd
 * and --eval-layer gave candidates (wd < 0: a kNN's, no weight decay; layer 0: raw pixels), else "". */
static const char *chosen_note(const struct opts *o, float wd, int layer, char *buf, size_t cap) {
    int w = wd >= 0 && o->n_probe_wd > 1, l = layer && o->n_eval_layer > 1;
    if (w && l) snprintf(buf, cap, " (wd %g, layer%d chosen)", (double)wd, layer);
    else if (w) snprintf(buf, cap, " (wd %g chosen)", (double)wd);
    else if (l) snprintf(buf, cap, " (layer%d chosen)", layer);
    else buf[0] = 0;
    return buf;
}

/* --eval-baseline: before the first step and outside its clock, both
 * evaluations of the untrained trunk (or the one --init-from / --resume
 * loaded) and of raw pixels (rank 0 prints them; the first step's --log line
 * carries them). With --steps 0 that is all the run does: a checkpoint's
 * trunk evaluated. COLLECTIVE. */
enum fsdp_status swav_before_train(struct task *t, struct fsdp_ctx *ctx, struct fsdp_model *fm,
                                   const struct opts *o) {
    if (!o->eval_baseline) return FSDP_OK;
    double kt, pt, kr, pr;
    float wt = o->probe_wd[0], wr = o->probe_wd[0];
    int kl, pl, rl;
    int64_t cnt;
    double t0 = now_s();
    TRY(evaluate(t, ctx, fm, o, 0, &kt, &pt, &wt, &kl, &pl, &cnt));
    TRY(evaluate(t, ctx, fm, o, 1, &kr, &pr, &wr, &rl, &rl, &cnt));
    char trunk[1100], knt[48], wnt[48], wnr[48];
    const char *from = o->resume ? o->resume : o->init_from;
    if (from) snprintf(trunk, sizeof trunk, "the trunk loaded from %s,", from);
    else snprintf(trunk, sizeof trunk, "untrained trunk");
    if (fsdp_ctx_rank(ctx) == 0)
        printf("baseline: %s knn_acc %.2f%%%s probe_acc %.2f%%%s | raw pixels knn_acc %.2f%% probe_acc "
               "%.2f%%%s (%lld test images, %.1f s)\n",
               trunk, 100 * kt, chosen_note(o, -1, kl, knt, sizeof knt), 100 * pt, chosen_note(o, wt, pl, wnt, sizeof wnt),
               100 * kr, 100 * pr, chosen_note(o, wr, 0, wnr, sizeof wnr), (long long)cnt, now_s() - t0);
    fflush(stdout);
    struct swav *k = t->impl;
    k->base[0] = kt, k->base[1] = pt, k->base[2] = kr, k->base[3] = pr, k->base[4] = kl, k->base[5] = pl;
    k->baseline_done = 1;
    return FSDP_OK;
}

enum fsdp_status swav_eval(struct task *t, struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct opts *o,
                           double *loss_out, double *acc_out, int64_t *count_out) {
    double probe;
    float wd = o->probe_wd[0];
    int kl, pl;
    if (!o->knn_train && !o->probe_epochs) { /* no evaluation (step-time benchmarks) */
        *loss_out = *acc_out = NAN;
        *count_out = 0;
        return FSDP_OK;
    }
    TRY(evaluate(t, ctx, fm, o, 0, acc_out, &probe, &wd, &kl, &pl, count_out));
    *loss_out = NAN;
    swav_append_extra(t, "probe_acc", probe);
    if (o->n_probe_wd > 1) swav_append_extra(t, "probe_wd", wd); /* the one the held-out rows chose */
    if (o->n_eval_layer > 1) { /* the choice, and every layer's own figures */
        swav_append_extra(t, "knn_layer", kl), swav_append_extra(t, "probe_layer", pl);
        struct swav *k = t->impl;
        for (int l = 0; l < o->n_eval_layer; l++) {
            char key[32];
            snprintf(key, sizeof key, "knn_acc_layer%d", o->eval_layer[l]);
            swav_append_extra(t, key, k->layer_acc[l][0]);
            snprintf(key, sizeof key, "probe_acc_layer%d", o->eval_layer[l]);
            swav_append_extra(t, key, k->layer_acc[l][1]);
        }
    }
    char kn[48], wn[48];
    if (isfinite(probe))
        snprintf(t->eval_note, sizeof t->eval_note, "%s  probe_acc %.2f%%%s", chosen_note(o, -1, kl, kn, sizeof kn),
                 100.0 * probe, chosen_note(o, wd, pl, wn, sizeof wn));
    return FSDP_OK;
}
