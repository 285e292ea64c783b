/*
 * task_images.c - fsdp-train's image classification task (task.h): a small
 * CNN (--model cnn) or a ResNet on an IDX image set (MNIST layout), trained
 * with cross-entropy (label smoothing) through the split step API, and
 * evaluated (top-1 accuracy, mean loss) on the test split in eval mode.
 *
 * [Note: evaluation batches]
 * The test split is cut into global batches of --eval-batch (default --batch) images, the last one
 * partial; rank r takes images [r n / world, (r+1) n / world) of a batch of
 * n, as training does. A rank whose share is empty (n < world) still runs the
 * forward, on one image it ignores, because the forward is collective. Each
 * rank sums its images' losses (in double) and counts its correct top-1
 * predictions; the sums are gathered and added in rank order. An image's
 * logits do not depend on the other images of its batch in eval mode (batch
 * norm uses its running statistics), so the result is the same at any world
 * size, up to the rounding of the loss sum.
 */
#include "config.h"
#include "task.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The model: arch "cnn" (built here) or a ResNet (src/models). */
struct img_cfg {
    char arch[16];
    int in_chans, num_classes, width;
    char stem[16];          /* ResNet: imagenet | cifar */
    int zero_init_residual; /* ResNet */
};

struct images {
    struct img_cfg cfg;
    const char *data_name, *cfg_source; /* --data, and the flag or file the model came from */
    struct fsdp_images *train, *test;
    struct fsdp_images_info ti;
    struct fsdp_image_batch_opts bo;
    float *x;
    int32_t *y;
    int Bl;
    int64_t chw;
};

int task_is_resnet(const char *arch) {
    struct fsdp_resnet_config c;
    return arch && fsdp_resnet_config_preset(arch, &c) == FSDP_OK;
}

int task_epoch_steps(const struct opts *o, int64_t count, const char *data) {
    if (!o->epochs) return o->steps;
    int64_t per_epoch = (count + o->batch - 1) / o->batch;
    /* compared by division: the product in an int once wrapped to a negative step count */
    if (per_epoch > STEPS_MAX / o->epochs)
        fail_input("--epochs %d x %lld steps per epoch (%lld images of --data %s in batches of %d) is %lld steps, "
                   "more than the most a run takes (%d, the largest --steps)", o->epochs, (long long)per_epoch,
                   (long long)count, data, o->batch, (long long)o->epochs * per_epoch, STEPS_MAX);
    return (int)(o->epochs * per_epoch);
}

/* ---- The small CNN ----
 * layer1 = Sequential(0: Conv2d(in, w, 3, padding 1, no bias), 1: BatchNorm2d(w),
 *                     2: ReLU, 3: MaxPool2d(2)),
 * layer2 = the same from w to 2w, avgpool (global), fc = Conv2d(2w, classes, 1)
 * with a bias (a Linear on the pooled features), flatten: (N, classes). */
static enum fsdp_status cnn_layer(struct fsdp_ctx *ctx, struct fsdp_module *root, const char *name, int64_t cin,
                                  int64_t cout) {
    struct fsdp_module *s, *m;
    TRY(fsdp_sequential_create(ctx, name, &s));
    enum fsdp_status st = fsdp_module_add_child(ctx, root, s);
    if (st != FSDP_OK) {
        fsdp_module_free(s);
        return st;
    }
    struct fsdp_conv2d_opts co = fsdp_conv2d_opts_default(cin, cout, 3);
    co.padding[0] = co.padding[1] = 1;
    co.bias = 0;
    struct fsdp_batchnorm_opts bn = fsdp_batchnorm_opts_default(cout);
#define ADD(expr)                                                                                                  \
    do {                                                                                                           \
        TRY(expr);                                                                                            \
        if ((st = fsdp_module_add_child(ctx, s, m)) != FSDP_OK) {                                                  \
            fsdp_module_free(m);                                                                                   \
            return st;                                                                                             \
        }                                                                                                          \
    } while (0)
    ADD(fsdp_conv2d_create(ctx, "0", &co, &m));
    ADD(fsdp_batchnorm2d_create(ctx, "1", &bn, &m));
    ADD(fsdp_relu_create(ctx, "2", &m));
    ADD(fsdp_maxpool2d_create(ctx, "3", 2, 2, 0, &m));
    return FSDP_OK;
}

/* The CNN's forward FLOPs per H x W image (2 per multiply-add of its
 * convolutions and fc, as fsdp_resnet_flops_per_image counts): layer1's 3x3
 * conv at H x W, layer2's at (H/2) x (W/2) after the 2x2 max pool. */
static double cnn_flops_per_image(const struct img_cfg *c, int64_t H, int64_t W) {
    double w = c->width;
    return 2.0 * (9.0 * c->in_chans * w * (double)(H * W) + 9.0 * w * 2.0 * w * (double)((H / 2) * (W / 2)) +
                  2.0 * w * (c->num_classes > 0 ? c->num_classes : 0));
}

static enum fsdp_status cnn_create(struct fsdp_ctx *ctx, const struct img_cfg *c, struct fsdp_module **out) {
    struct fsdp_module *root, *m;
    TRY(fsdp_sequential_create(ctx, "", &root));
    enum fsdp_status st = cnn_layer(ctx, root, "layer1", c->in_chans, c->width);
    if (st == FSDP_OK) st = cnn_layer(ctx, root, "layer2", c->width, 2 * (int64_t)c->width);
    if (st == FSDP_OK && (st = fsdp_global_avgpool2d_create(ctx, "avgpool", &m)) == FSDP_OK &&
        (st = fsdp_module_add_child(ctx, root, m)) != FSDP_OK)
        fsdp_module_free(m);
    struct fsdp_conv2d_opts fc = fsdp_conv2d_opts_default(2 * (int64_t)c->width, c->num_classes, 1);
    fc.init_std = (float)(1.0 / sqrt(3.0 * 2 * c->width)); /* the variance of PyTorch's Linear init */
    if (st == FSDP_OK && c->num_classes > 0 && (st = fsdp_conv2d_create(ctx, "fc", &fc, &m)) == FSDP_OK &&
        (st = fsdp_module_add_child(ctx, root, m)) != FSDP_OK)
        fsdp_module_free(m);
    if (st == FSDP_OK && (st = fsdp_flatten_create(ctx, "flatten", &m)) == FSDP_OK &&
        (st = fsdp_module_add_child(ctx, root, m)) != FSDP_OK)
        fsdp_module_free(m);
    if (st == FSDP_OK) st = fsdp_module_finalize(ctx, root);
    if (st != FSDP_OK) {
        fsdp_module_free(root);
        return st;
    }
    *out = root;
    return FSDP_OK;
}

enum fsdp_status task_cnn_create(struct fsdp_ctx *ctx, int in_chans, int width, int num_classes,
                                 struct fsdp_module **out) {
    struct img_cfg c;
    memset(&c, 0, sizeof c);
    snprintf(c.arch, sizeof c.arch, "cnn");
    c.in_chans = in_chans;
    c.width = width;
    c.num_classes = num_classes;
    return cnn_create(ctx, &c, out);
}

/* ---- Model configs ---- */

static void cfg_preset(const char *arch, struct img_cfg *c) {
    memset(c, 0, sizeof *c);
    snprintf(c->arch, sizeof c->arch, "%s", arch);
    c->in_chans = 1;
    c->num_classes = 10;
    c->width = !strcmp(arch, "cnn") ? 16 : 64;
    snprintf(c->stem, sizeof c->stem, "imagenet");
}

/* The config as a JSON object (checkpoint meta, and the comparison on resume). */
static void cfg_json(const struct img_cfg *c, char *buf, size_t cap) {
    if (task_is_resnet(c->arch))
        snprintf(buf, cap,
                 "{\"arch\":\"%s\",\"in_chans\":%d,\"num_classes\":%d,\"stem\":\"%s\",\"width\":%d,"
                 "\"zero_init_residual\":%s}",
                 c->arch, c->in_chans, c->num_classes, c->stem, c->width, c->zero_init_residual ? "true" : "false");
    else
        snprintf(buf, cap, "{\"arch\":\"%s\",\"in_chans\":%d,\"num_classes\":%d,\"width\":%d}", c->arch, c->in_chans,
                 c->num_classes, c->width);
}

/* Parses a config object; 0 or a message naming the key in err. */
static int cfg_parse(const cJSON *j, struct img_cfg *c, char *err, size_t n) {
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(j, "arch");
    if (!cJSON_IsObject(j)) return snprintf(err, n, "not a JSON object"), 1;
    if (!cJSON_IsString(a)) return snprintf(err, n, "\"arch\" is missing or not a string"), 1;
    if (strcmp(a->valuestring, "cnn") && !task_is_resnet(a->valuestring))
        return snprintf(err, n, "\"arch\": unknown arch '%.40s' (cnn, resnet18, resnet34, resnet50)", a->valuestring),
               1;
    cfg_preset(a->valuestring, c);
    int resnet = task_is_resnet(c->arch);
    for (const cJSON *e = j->child; e; e = e->next) {
        const char *k = e->string;
        if (!strcmp(k, "arch")) continue;
        int *dst = !strcmp(k, "in_chans") ? &c->in_chans : !strcmp(k, "num_classes") ? &c->num_classes
                   : !strcmp(k, "width")  ? &c->width : NULL;
        int lo = 1, hi = !strcmp(k, "num_classes") ? 1 << 24 : !strcmp(k, "in_chans") ? 64 : 1024;
        if (dst) {
            if (!cJSON_IsNumber(e) || e->valuedouble != (double)(int)e->valuedouble || e->valuedouble < lo ||
                e->valuedouble > hi)
                return snprintf(err, n, "\"%s\" is not an integer in [%d, %d]", k, lo, hi), 1;
            *dst = (int)e->valuedouble;
        } else if (resnet && !strcmp(k, "stem")) {
            if (!cJSON_IsString(e) || (strcmp(e->valuestring, "imagenet") && strcmp(e->valuestring, "cifar")))
                return snprintf(err, n, "\"stem\" is not \"imagenet\" or \"cifar\""), 1;
            snprintf(c->stem, sizeof c->stem, "%s", e->valuestring);
        } else if (resnet && !strcmp(k, "zero_init_residual")) {
            if (!cJSON_IsBool(e)) return snprintf(err, n, "\"zero_init_residual\" is not true or false"), 1;
            c->zero_init_residual = cJSON_IsTrue(e);
        } else {
            return snprintf(err, n, "unknown key \"%.40s\" for arch %s", k, c->arch), 1;
        }
    }
    return 0;
}

int task_is_images(const struct opts *o, const struct fsdp_ckpt_meta *ck) {
    if (o->model_config) { /* an "arch" key makes it an image model */
        char err[160]; /* a file it cannot read goes to the GPT's loader, which names the problem */
        cJSON *j = config_read_json(o->model_config, err, sizeof err);
        int r = cJSON_IsObject(j) && cJSON_GetObjectItemCaseSensitive(j, "arch") != NULL;
        cJSON_Delete(j);
        return r;
    }
    if (o->model) return !strcmp(o->model, "cnn") || !strncmp(o->model, "resnet", 6);
    return ck && ck->model_json[0];
}

int task_images_open_data(struct task *t, struct fsdp_ctx *ctx, const struct opts *o, const char *name,
                          int num_classes, struct fsdp_images **train, struct fsdp_images **test) {
    if (fsdp_images_open(ctx, name, FSDP_SPLIT_TRAIN, num_classes ? num_classes : 256, train) != FSDP_OK)
        fail_input("--data: %s", fsdp_errmsg(ctx));
    struct fsdp_images_info ti, vi;
    fsdp_images_info(*train, &ti);
    const char *inferred = "";
    if (!num_classes) { /* the training labels' classes: the test labels are checked against them as a config's */
        int32_t mx = 0;
        for (int64_t i = 0; i < ti.count; i++) {
            int32_t y = fsdp_images_label(*train, i);
            if (y > mx) mx = y;
        }
        num_classes = mx + 1;
        inferred = " (num_classes follows the training labels)";
    }
    if (fsdp_images_open(ctx, name, FSDP_SPLIT_TEST, num_classes, test) != FSDP_OK)
        fail_input("--data: %s%s", fsdp_errmsg(ctx), inferred);
    fsdp_images_info(*test, &vi);
    if (vi.channels != ti.channels || vi.height != ti.height || vi.width != ti.width)
        fail_input("--data %s: the test images are %dx%dx%d, the training images %dx%dx%d", name, vi.channels,
                   vi.height, vi.width, ti.channels, ti.height, ti.width);
    if ((o->n_mean > 1 && o->n_mean != ti.channels) || (o->n_std > 1 && o->n_std != ti.channels))
        fail_input("--mean / --std: give one value or one per channel (the images have %d channels)", ti.channels);
    char split[sizeof t->inputs[0].name];
    snprintf(split, sizeof split, "%s (training images)", name);
    task_input_images(t, "--data", split, *train);
    snprintf(split, sizeof split, "%s (test images)", name);
    task_input_images(t, "--data", split, *test);
    return num_classes;
}

/* ---- The task ---- */

static struct fsdp_tensor tensor4(float *x, int64_t n, const struct fsdp_images_info *ti) {
    struct fsdp_tensor t = {x, FSDP_F32, 4, {n, ti->channels, ti->height, ti->width}, FSDP_LAYOUT_PLAIN};
    return t;
}

static void img_open(struct task *t, struct fsdp_ctx *ctx, const struct opts *o) {
    struct images *k = t->impl;
    const struct img_cfg *c = &k->cfg;
    if (!strcmp(c->arch, "cnn")) {
        if (cnn_create(ctx, c, &t->root) != FSDP_OK) fail_all("model: %s", fsdp_errmsg(ctx));
        t->train_flops_per_item = 3.0 * cnn_flops_per_image(c, k->ti.height, k->ti.width);
    } else {
        struct fsdp_resnet_config rc;
        if (fsdp_resnet_config_preset(c->arch, &rc) != FSDP_OK)
            fail_input("%s: unknown arch '%s' (cnn, resnet18, resnet34, resnet50)", k->cfg_source, c->arch);
        rc.in_chans = c->in_chans;
        rc.num_classes = c->num_classes;
        rc.width = c->width;
        rc.stem = !strcmp(c->stem, "cifar") ? FSDP_RESNET_STEM_CIFAR : FSDP_RESNET_STEM_IMAGENET;
        rc.zero_init_residual = c->zero_init_residual;
        if (fsdp_resnet_config_validate(ctx, &rc) != FSDP_OK) fail_input("%s: %s", k->cfg_source, fsdp_errmsg(ctx));
        if (fsdp_resnet_create(ctx, &rc, &t->root) != FSDP_OK) fail_all("model: %s", fsdp_errmsg(ctx));
        t->block_type = fsdp_resnet_block_type(&rc);
        t->train_flops_per_item = 3.0 * fsdp_resnet_flops_per_image(&rc, k->ti.height, k->ti.width);
    }
    /* sync-BN: the batch statistics of the global batch */
    int sync = o->sync_bn >= 0 ? o->sync_bn : fsdp_ctx_world(ctx) > 1;
    fsdp_batchnorm_set_sync(t->root, sync, NULL, NULL);
    k->Bl = o->batch / fsdp_ctx_world(ctx);
    k->chw = (int64_t)k->ti.channels * k->ti.height * k->ti.width;
    k->x = malloc((size_t)k->Bl * (size_t)k->chw * sizeof(float));
    k->y = malloc((size_t)k->Bl * sizeof(int32_t));
    if (!k->x || !k->y) fail_rank("out of memory for the batch");
    k->bo = fsdp_image_batch_opts_default();
    k->bo.seed = o->seed;
    k->bo.shuffle = o->shuffle;
    if (!strcmp(o->augment, "crop-flip")) {
        k->bo.crop_padding = o->crop_padding;
        k->bo.hflip = 1;
    }
    task_images_norm(o, &k->bo);
}

void task_images_norm(const struct opts *o, struct fsdp_image_batch_opts *bo) {
    for (int ch = 0; ch < 4; ch++) {
        bo->mean[ch] = o->mean[o->n_mean == 1 ? 0 : ch < o->n_mean ? ch : 0];
        bo->std[ch] = o->std[o->n_std == 1 ? 0 : ch < o->n_std ? ch : 0];
    }
}

static void img_describe_model(struct task *t, struct fsdp_ctx *ctx, const struct opts *o, struct fsdp_model *fm) {
    (void)ctx;
    struct images *k = t->impl;
    char js[256];
    cfg_json(&k->cfg, js, sizeof js);
    int sync = o->sync_bn >= 0 ? o->sync_bn : fsdp_ctx_world(ctx) > 1;
    printf("model: %s %s: %.3fM parameters in %d units; batch norm %s\n", k->cfg.arch, js,
           (double)fsdp_module_numel(t->root) / 1e6, fsdp_model_n_units(fm), sync ? "synchronised (SyncBatchNorm)" : "per rank");
}

static void img_describe_data(struct task *t, struct fsdp_ctx *ctx, const struct opts *o, struct fsdp_model *fm) {
    (void)ctx;
    (void)fm;
    struct images *k = t->impl;
    struct fsdp_images_info vi;
    fsdp_images_info(k->test, &vi);
    printf("data: %s, %lld training and %lld test images of %dx%dx%d; %lld steps per epoch; augment %s, shuffle "
           "%s\n", k->data_name, (long long)k->ti.count, (long long)vi.count, k->ti.channels, k->ti.height,
           k->ti.width, (long long)((k->ti.count + o->batch - 1) / o->batch), o->augment, o->shuffle ? "on" : "off");
}

static enum fsdp_status img_step(struct task *t, struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct opts *o,
                                 int step, float lr, struct fsdp_step_result *r) {
    struct images *k = t->impl;
    if (fsdp_images_batch(ctx, k->train, &k->bo, step, o->batch, fsdp_ctx_rank(ctx), fsdp_ctx_world(ctx), k->x,
                          k->y) != FSDP_OK)
        fail_rank("step %d: --data: %s", step + 1, fsdp_errmsg(ctx));
    /* the batch per rank of ctx's world (k->Bl's, or the memory plan's: fsdp-train --dry-run --nproc) */
    int accum = o->grad_accum, mb = o->batch / fsdp_ctx_world(ctx) / accum, no_sync = !strcmp(o->accum_mode, "no_sync");
    struct fsdp_loss loss = {0};
    loss.kind = FSDP_LOSS_CROSS_ENTROPY;
    loss.label_smoothing = o->label_smoothing;
    for (int a = 0; a < accum; a++) {
        if (no_sync) fsdp_model_set_grad_sync(fm, a == accum - 1);
        struct fsdp_tensor in = tensor4(k->x + (int64_t)a * mb * k->chw, mb, &k->ti), out = {0};
        struct fsdp_tensor tg = {k->y + (int64_t)a * mb, FSDP_I32, 1, {mb}, FSDP_LAYOUT_PLAIN};
        TRY(fsdp_model_forward_tensor(ctx, fm, &in, &out));
        struct fsdp_tensor dout = out; /* in place */
        TRY(fsdp_model_loss(ctx, fm, &loss, &out, &tg, accum, NULL, &dout));
        TRY(fsdp_model_backward(ctx, fm, &dout));
    }
    return fsdp_model_optim_step(ctx, fm, lr, o->clip, r);
}

/* Image i of im as normalised fp32 CHW, as fsdp_images_batch without augmentation. */
void task_load_image(const struct fsdp_images *im, const struct fsdp_image_batch_opts *bo, int64_t i, float *dst) {
    struct fsdp_images_info ti;
    fsdp_images_info(im, &ti);
    const uint8_t *p = fsdp_images_pixels(im, i);
    int C = ti.channels, H = ti.height, W = ti.width;
    for (int y = 0; y < H; y++)
        for (int xx = 0; xx < W; xx++)
            for (int c = 0; c < C; c++)
                dst[((int64_t)c * H + y) * W + xx] =
                    ((float)p[((int64_t)y * W + xx) * C + c] / 255.0f - bo->mean[c]) / bo->std[c];
}

/* [Note: evaluation batches] */
static enum fsdp_status img_eval(struct task *t, struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct opts *o,
                                 double *loss_out, double *acc_out, int64_t *count_out) {
    struct images *k = t->impl;
    struct fsdp_images_info vi;
    fsdp_images_info(k->test, &vi);
    int rank = fsdp_ctx_rank(ctx), world = fsdp_ctx_world(ctx);
    int64_t EB = task_eval_batch(o), n = task_eval_images(o, vi.count);
    float *x = malloc((size_t)(EB / world + 1) * (size_t)k->chw * sizeof(float));
    if (!x) fail_rank("out of memory for evaluation");
    double sum = 0;
    int64_t correct = 0, seen = 0;
    enum fsdp_status st = FSDP_OK;
    fsdp_module_set_training(t->root, 0);
    for (int64_t s = 0; s < n && st == FSDP_OK; s += EB) {
        int64_t cnt = n - s < EB ? n - s : EB;
        int64_t lo = s + rank * cnt / world, hi = s + (rank + 1) * cnt / world, m = hi - lo;
        for (int64_t i = 0; i < (m ? m : 1); i++) task_load_image(k->test, &k->bo, m ? lo + i : s, x + i * k->chw);
        struct fsdp_tensor in = tensor4(x, m ? m : 1, &k->ti), out = {0};
        if ((st = fsdp_model_forward_tensor(ctx, fm, &in, &out)) != FSDP_OK) break;
        const float *lg = out.data;
        int64_t C = out.shape[out.ndim - 1];
        for (int64_t i = 0; i < m; i++) {
            const float *l = lg + i * C;
            int32_t y = fsdp_images_label(k->test, lo + i);
            int64_t best = 0;
            double mx = l[0], z = 0;
            for (int64_t c = 1; c < C; c++)
                if (l[c] > l[best]) best = c;
            mx = l[best];
            for (int64_t c = 0; c < C; c++) z += exp((double)l[c] - mx);
            sum += log(z) - ((double)l[y] - mx);
            seen++;
            correct += best == y;
        }
    }
    fsdp_module_set_training(t->root, 1);
    free(x);
    if (st != FSDP_OK) return st;
    /* gathered and added in rank order: the bits of each rank's double travel as an I64 */
    int64_t mine[3], *all = malloc((size_t)world * 3 * sizeof(int64_t));
    if (!all) fail_rank("out of memory for evaluation");
    memcpy(&mine[0], &sum, sizeof sum);
    mine[1] = correct;
    mine[2] = seen;
    st = fsdp_comm_allgather(fsdp_ctx_comm(ctx), mine, all, 3, FSDP_I64);
    double tot = 0;
    int64_t ok = 0, cnt = 0;
    for (int r = 0; r < world; r++) {
        double v;
        memcpy(&v, &all[3 * r], sizeof v);
        tot += v;
        ok += all[3 * r + 1];
        cnt += all[3 * r + 2];
    }
    free(all);
    *loss_out = cnt ? tot / (double)cnt : NAN;
    *acc_out = cnt ? (double)ok / (double)cnt : NAN;
    *count_out = cnt;
    return st;
}

static void img_meta(struct task *t, struct fsdp_ckpt_meta *m) {
    struct images *k = t->impl;
    cfg_json(&k->cfg, m->model_json, sizeof m->model_json);
}

static void img_summary_note(struct task *t, char *buf, size_t cap) {
    (void)t;
    (void)buf;
    (void)cap;
}

static void img_free(struct task *t) {
    struct images *k = t->impl;
    if (!k) return;
    free(k->x);
    free(k->y);
    fsdp_images_free(k->train);
    fsdp_images_free(k->test);
    free(k);
    t->impl = NULL;
}

static const struct task_ops images_ops = {img_open, img_describe_model, img_describe_data, img_step, img_eval,
                                           img_meta, img_summary_note,   NULL,              img_free, NULL, NULL, NULL};

void task_images_create(struct fsdp_ctx *ctx, struct opts *o, const struct fsdp_ckpt_meta *ck, const char *resume_dir,
                        struct task *t) {
    struct images *k = calloc(1, sizeof *k);
    if (!k) fail_rank("out of memory");
    t->impl = k; /* reachable from here on, so an error exit leaks nothing */
    char err[256];
    int preset = 0; /* --model NAME: in_chans and num_classes follow the data */
    if (o->model_config) {
        cJSON *j = config_read_json(o->model_config, err, sizeof err);
        int bad = !j || cfg_parse(j, &k->cfg, err, sizeof err);
        cJSON_Delete(j);
        if (bad) fail_input("--model-config %s: %s", o->model_config, err);
        k->cfg_source = o->model_config;
    } else if (o->model) {
        if (strcmp(o->model, "cnn") && !task_is_resnet(o->model))
            fail_input("--model: unknown image model '%s' (cnn, resnet18, resnet34, resnet50)", o->model);
        cfg_preset(o->model, &k->cfg);
        k->cfg_source = "--model";
        preset = 1;
    } else {
        /* no model flag and no checkpoint (--task images, from the flags or a --config file) */
        if (!ck)
            fail_input("--task images needs --model cnn|resnet18|resnet34|resnet50, --model-config FILE or --resume "
                       "CHECKPOINT (there is no default image model)");
        cJSON *j = cJSON_Parse(ck->model_json);
        int bad = cfg_parse(j, &k->cfg, err, sizeof err);
        cJSON_Delete(j);
        if (bad) fail_input("--resume %s: its meta.json's \"model\": %s", resume_dir, err);
        k->cfg_source = resume_dir;
    }
    k->data_name = o->data ? o->data : IMAGE_DATA_DEFAULT;
    /* the data: labels below num_classes (a preset takes the training labels' classes) */
    int nc = task_images_open_data(t, ctx, o, k->data_name, preset ? 0 : k->cfg.num_classes, &k->train, &k->test);
    fsdp_images_info(k->train, &k->ti);
    if (preset) {
        k->cfg.in_chans = k->ti.channels;
        k->cfg.num_classes = nc;
    }
    if (k->ti.channels != k->cfg.in_chans)
        fail_input("--data %s: the images have %d channel%s, but the model's in_chans is %d (%s)", k->data_name,
                   k->ti.channels, k->ti.channels == 1 ? "" : "s", k->cfg.in_chans, k->cfg_source);
    if (k->ti.height < 4 || k->ti.width < 4)
        fail_input("--data %s: images of %dx%d are too small for the model (at least 4x4)", k->data_name,
                   k->ti.height, k->ti.width);
    /* resuming with model flags: the same model as the checkpoint's */
    if (ck && ck->model_json[0] && (o->model || o->model_config)) {
        char mine[256];
        cfg_json(&k->cfg, mine, sizeof mine);
        cJSON *a = cJSON_Parse(mine), *b = cJSON_Parse(ck->model_json);
        int same = cJSON_Compare(a, b, 1);
        cJSON_Delete(a);
        cJSON_Delete(b);
        if (!same)
            fail_all("%s: the model %s differs from the checkpoint %s's %s (leave out the model flags to use the "
                     "checkpoint's model)", k->cfg_source, mine, resume_dir, ck->model_json);
    } else if (ck && !ck->model_json[0] && (o->model || o->model_config)) {
        fail_all("--resume: %s holds a GPT, not the image model of %s", resume_dir, k->cfg_source);
    }
    t->ops = &images_ops;
    t->impl = k;
    t->block_type = !strcmp(k->cfg.arch, "cnn") ? "Sequential" : !strcmp(k->cfg.arch, "resnet50") ? "Bottleneck"
                                                                                                  : "BasicBlock";
    t->ac_attn_type = NULL;
    t->is_gpt = 0;
    t->item = "img";
    t->item_json = "images_per_s";
    snprintf(t->batch_unit, sizeof t->batch_unit, "images");
    t->items_per_step = o->batch;
    t->train_flops_per_item = 0; /* set by img_open for a ResNet */
    t->seq = 1;
    t->steps = task_epoch_steps(o, k->ti.count, k->data_name);
}
