/*
 * resnet.c - torchvision's ResNet-18/34/50 built from the vision layers of
 * src/nn: the module tree with torchvision's names, its forward/backward,
 * the configuration presets, JSON loader and validator, the default wrap
 * policy (a unit per residual block) and the FLOP count.
 *
 * Tree (FQNs as torchvision's state dict; w = cfg.width, e = 1 for
 * BasicBlock, 4 for Bottleneck):
 *   ""          ResNet             (N, in_chans, H, W) -> logits (N, num_classes)
 *   conv1       Conv2d             in_chans -> w: 7x7 s2 p3 (imagenet) or 3x3 s1 p1 (cifar)
 *   bn1, relu   BatchNorm2d, ReLU  (the ReLU runs fused in bn1: relu is in the
 *               tree for torchvision's structure and is not run)
 *   maxpool     MaxPool2d(3, 2, 1) imagenet stem only
 *   layer1..4   Sequential         blocks "0".."n-1", planes w, 2w, 4w, 8w, stride 1, 2, 2, 2
 *   avgpool     AdaptiveAvgPool2d  (N, 8 w e, 1, 1), seen as (N, 8 w e) by fc (a view)
 *   fc          Linear             8 w e -> num_classes
 *               (num_classes 0: no fc; the output is the pooled features
 *               (N, 8 w e), a trunk for a head such as SwAV's)
 * The ResNet module runs its children itself, through the dispatchers, so
 * that the sharding hooks of units below it run.
 * Invariant: children[] below holds exactly the modules of the tree, in
 * the order the forward runs them (maxpool NULL for the cifar stem).
 */
#include "io/io-impl.h"
#include "models/models-impl.h"
#include "nn/nn-impl.h"

#include <cJSON.h>
#include <math.h>

enum { RN_CONV1, RN_BN1, RN_RELU, RN_MAXPOOL, RN_LAYER1, RN_LAYER4 = RN_LAYER1 + 3, RN_AVGPOOL, RN_FC, RN_N };

struct resnet {
    struct fsdp_resnet_config cfg;
    struct fsdp_module *mod[RN_N]; /* children (owned by the tree); mod[RN_MAXPOOL] NULL for cifar */
    int ran;                       /* forward ran (backward may follow) */
    int feature_map;               /* fsdp_resnet_set_feature_map: 0, or L: the output is layerL's (N, C, h, w) */
    enum fsdp_layout map_layout;   /* the layout layer4 wrote it in (its gradient goes back so) */
    int64_t in_shape[4];           /* (N, C, H, W) of the last input */
    int64_t pool_shape[4];         /* (N, C, 1, 1): avgpool's output; (N, C, h, w): layerL's (feature_map) */
    size_t marks[RN_N];            /* the arena's mark before each child's forward (RN_FC: before the
                                      output, fc's or the features') */
};

static const int blocks_of[3][4] = {{2, 2, 2, 2}, {3, 4, 6, 3}, {3, 4, 6, 3}};

static int expansion(const struct fsdp_resnet_config *cfg) { return cfg->arch == FSDP_RESNET50 ? 4 : 1; }

static enum fsdp_status resnet_forward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *in,
                                       struct fsdp_tensor *out) {
    struct resnet *R = m->impl;
    FSDP_TRY(fsdp__check_input(ctx, m, in, FSDP_F32, 4, 0));
    if (in->shape[1] != R->cfg.in_chans)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "ResNet: input has %lld channels, the model's in_chans is %d",
                         (long long)in->shape[1], R->cfg.in_chans);
    R->ran = 0;
    struct fsdp_tensor cur = *in;
    int last = R->feature_map ? RN_LAYER1 + R->feature_map - 1 : RN_AVGPOOL;
    for (int i = RN_CONV1; i <= last; i++) {
        if (!R->mod[i] || i == RN_RELU) continue; /* relu: fused in bn1 (resnet_build) */
        struct fsdp_tensor next = {0};
        R->marks[i] = fsdp_arena_mark(ctx);
        FSDP_TRY(fsdp_module_forward(R->mod[i], ctx, &cur, &next));
        cur = next;
    }
    memcpy(R->pool_shape, cur.shape, sizeof R->pool_shape);
    memcpy(R->in_shape, in->shape, sizeof R->in_shape);
    if (R->feature_map) { /* layerL's output, NCHW whatever layout the convolutions wrote */
        FSDP_TRY(fsdp__tensor_prepare(ctx, out, FSDP_F32, 4, cur.shape, "ResNet feature map"));
        fsdp__relayout(out->data, FSDP_LAYOUT_PLAIN, cur.data, cur.layout, cur.shape); /* out is never cur */
        R->map_layout = cur.layout;
        R->ran = 1;
        return FSDP_OK;
    }
    struct fsdp_tensor flat = cur; /* (N, C, 1, 1) seen as (N, C) */
    flat.ndim = 2;
    flat.shape[2] = flat.shape[3] = 0;
    R->marks[RN_FC] = fsdp_arena_mark(ctx);
    if (R->mod[RN_FC]) {
        FSDP_TRY(fsdp_module_forward(R->mod[RN_FC], ctx, &flat, out));
    } else { /* a trunk: the pooled features */
        FSDP_TRY(fsdp__tensor_prepare(ctx, out, FSDP_F32, 2, flat.shape, "ResNet features"));
        if (out->data != flat.data)
            memcpy(out->data, flat.data, (size_t)(flat.shape[0] * flat.shape[1]) * sizeof(float));
    }
    R->ran = 1;
    return FSDP_OK;
}

static enum fsdp_status resnet_backward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *dout,
                                        struct fsdp_tensor *din) {
    struct resnet *R = m->impl;
    if (!R->ran) return fsdp__err(ctx, FSDP_ERR_STATE, "ResNet: backward without forward");
    int fm = R->feature_map;
    FSDP_TRY(fsdp__check_input(ctx, m, dout, FSDP_F32, fm ? 4 : 2,
                               fm ? R->pool_shape[3] : R->mod[RN_FC] ? R->cfg.num_classes : R->pool_shape[1]));
    if (fm && memcmp(dout->shape, R->pool_shape, sizeof R->pool_shape) != 0)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "ResNet: the feature map's gradient is not the shape of its output");
    /* [Note: backward releases the blocks] (src/models/gpt.c) with a dead gradient: each child's
     * input gradient moves down to where the child's forward began and the arena above it goes
     * back (the layers' Sequentials do the same for their blocks), so backward's peak stays
     * below forward's and the gradient shards born in it find released pages (ResNet-50 at 64
     * images of 28 x 28: the plan's activations 126.5 -> 100 MiB); din is then made by conv1 */
    int release = fsdp__dout_dead(ctx, m, dout) && !fm && (!din || !din->data), handed = release;
    /* else din is allocated before the mark, so releasing the step's scratch keeps it */
    if (din && !release) FSDP_TRY(fsdp__tensor_prepare(ctx, din, FSDP_F32, 4, R->in_shape, "ResNet input gradient"));
    size_t mark = fsdp_arena_mark(ctx);
    struct fsdp_tensor g = {0};
    enum fsdp_status st = FSDP_OK;
    int64_t n = R->pool_shape[0] * R->pool_shape[1] * (fm ? R->pool_shape[2] * R->pool_shape[3] : 1);
    if (R->mod[RN_FC] && !fm) {
        st = fsdp__backward_releasing(ctx, R->mod[RN_FC], dout, &g, R->marks[RN_FC], &release);
    } else { /* the gradient of the pooled features or of the map, copied (dout is borrowed) */
        g.dtype = FSDP_F32;
        g.data = fsdp__scratch(ctx, n, "ResNet feature gradient");
        if (!g.data) st = FSDP_ERR_NOMEM;
        else if (fm) fsdp__relayout(g.data, R->map_layout, dout->data, FSDP_LAYOUT_PLAIN, R->pool_shape);
        else memcpy(g.data, dout->data, (size_t)n * sizeof(float));
        g.layout = fm ? R->map_layout : FSDP_LAYOUT_PLAIN;
    }
    if (st == FSDP_OK) { /* (N, C) back to (N, C, 1, 1) */
        g.ndim = 4;
        memcpy(g.shape, R->pool_shape, sizeof g.shape);
        if (!R->mod[RN_FC] || fm) fsdp__release_to(ctx, &release, R->marks[RN_FC], &g); /* the copy */
    }
    for (int i = fm ? RN_LAYER1 + fm - 1 : RN_AVGPOOL; i >= RN_CONV1 && st == FSDP_OK; i--) {
        if (!R->mod[i] || i == RN_RELU) continue; /* relu: fused in bn1 */
        struct fsdp_tensor prev = {0}, *dst = i == RN_CONV1 ? din : &prev;
        st = fsdp__backward_releasing(ctx, R->mod[i], &g, dst, R->marks[i], &release);
        g = prev;
    }
    if (handed) fsdp__dout_dead_hand(ctx, NULL, NULL); /* din may lie above mark: nothing released */
    else fsdp_arena_release(ctx, mark);
    return st;
}

static void resnet_destroy(struct fsdp_module *m) { free(m->impl); }

static const struct fsdp_module_ops resnet_ops = {"ResNet", resnet_forward, resnet_backward, resnet_destroy};

/* The last BN of a block: bn2 (BasicBlock) or bn3 (Bottleneck). */
static void zero_last_bn(struct fsdp_module *block, const char *bn) {
    for (int i = 0; i < block->n_children; i++) {
        struct fsdp_module *c = block->children[i];
        if (strcmp(c->name, bn) != 0) continue;
        for (int j = 0; j < c->n_params; j++)
            if (strcmp(c->params[j]->name, "weight") == 0) c->params[j]->init = (struct fsdp_init){FSDP_INIT_ZEROS, 0.0f};
    }
}

static enum fsdp_status resnet_build(struct fsdp_ctx *ctx, struct fsdp_module *root, struct resnet *R) {
    const struct fsdp_resnet_config *cfg = &R->cfg;
    int64_t w = cfg->width;
    struct fsdp_module *c = NULL;
    struct fsdp_conv2d_opts co = fsdp_conv2d_opts_default(cfg->in_chans, w, 7);
    co.bias = 0;
    co.out_layout = fsdp__vision_layout(); /* [Note: blocked activations] in src/nn/conv.c */
    if (cfg->stem == FSDP_RESNET_STEM_IMAGENET) {
        co.stride[0] = co.stride[1] = 2;
        co.padding[0] = co.padding[1] = 3;
    } else {
        co.kernel[0] = co.kernel[1] = 3;
        co.padding[0] = co.padding[1] = 1;
    }
    FSDP_TRY(fsdp__adopt(ctx, root, fsdp_conv2d_create(ctx, "conv1", &co, &c), &c, &R->mod[RN_CONV1]));
    struct fsdp_batchnorm_opts bo = fsdp_batchnorm_opts_default(w);
    FSDP_TRY(fsdp__adopt(ctx, root, fsdp_batchnorm2d_create(ctx, "bn1", &bo, &c), &c, &R->mod[RN_BN1]));
    fsdp__batchnorm_fuse_relu(R->mod[RN_BN1]); /* one pass instead of two each way, the same bits */
    FSDP_TRY(fsdp__adopt(ctx, root, fsdp_relu_create(ctx, "relu", &c), &c, &R->mod[RN_RELU]));
    if (cfg->stem == FSDP_RESNET_STEM_IMAGENET)
        FSDP_TRY(fsdp__adopt(ctx, root, fsdp_maxpool2d_create(ctx, "maxpool", 3, 2, 1, &c), &c, &R->mod[RN_MAXPOOL]));
    int e = expansion(cfg);
    int64_t inplanes = w;
    for (int l = 0; l < 4; l++) {
        char name[16];
        snprintf(name, sizeof name, "layer%d", l + 1);
        struct fsdp_module *layer = NULL;
        FSDP_TRY(fsdp__adopt(ctx, root, fsdp_sequential_create(ctx, name, &c), &c, &layer));
        R->mod[RN_LAYER1 + l] = layer;
        int64_t planes = w << l;
        for (int b = 0; b < blocks_of[cfg->arch][l]; b++) {
            snprintf(name, sizeof name, "%d", b);
            int stride = b == 0 && l > 0 ? 2 : 1;
            struct fsdp_module *blk = NULL;
            enum fsdp_status st = e == 4 ? fsdp_bottleneck_create(ctx, name, inplanes, planes, stride, &c)
                                         : fsdp_basic_block_create(ctx, name, inplanes, planes, stride, &c);
            FSDP_TRY(fsdp__adopt(ctx, layer, st, &c, &blk));
            if (cfg->zero_init_residual) zero_last_bn(blk, e == 4 ? "bn3" : "bn2");
            inplanes = planes * e;
        }
    }
    FSDP_TRY(fsdp__adopt(ctx, root, fsdp_global_avgpool2d_create(ctx, "avgpool", &c), &c, &R->mod[RN_AVGPOOL]));
    /* PyTorch's Linear init is uniform(-1/sqrt(in), 1/sqrt(in)), variance 1 / (3 in): the same variance, normal */
    float fc_std = (float)(1.0 / sqrt(3.0 * (double)inplanes));
    if (cfg->num_classes > 0)
        FSDP_TRY(fsdp__adopt(ctx, root, fsdp__linear_create(ctx, "fc", inplanes, cfg->num_classes, 1, fc_std, &c), &c,
                             &R->mod[RN_FC]));
    return fsdp_module_finalize(ctx, root);
}

enum fsdp_status fsdp_resnet_create(struct fsdp_ctx *ctx, const struct fsdp_resnet_config *cfg,
                                    struct fsdp_module **out) {
    FSDP_TRY(fsdp_resnet_config_validate(ctx, cfg));
    struct fsdp_module *root;
    FSDP_TRY(fsdp_module_create(ctx, &resnet_ops, "", &root));
    struct resnet *R = fsdp__zalloc(1, sizeof *R);
    if (!R) {
        fsdp_module_free(root);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory creating ResNet");
    }
    root->impl = R;
    R->cfg = *cfg;
    enum fsdp_status st = resnet_build(ctx, root, R);
    if (st != FSDP_OK) {
        fsdp_module_free(root);
        return st;
    }
    *out = root;
    return FSDP_OK;
}

enum fsdp_status fsdp_resnet_set_feature_map(struct fsdp_ctx *ctx, struct fsdp_module *resnet, int layer) {
    if (!resnet || resnet->ops != &resnet_ops)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "fsdp_resnet_set_feature_map: module '%s' is not a ResNet",
                         resnet ? (resnet->fqn ? resnet->fqn : resnet->name) : "(null)");
    if (layer < 0 || layer > 4)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "fsdp_resnet_set_feature_map: layer %d of '%s' (0: off, 1-4: layer1-4)",
                         layer, resnet->fqn ? resnet->fqn : resnet->name);
    struct resnet *R = resnet->impl;
    R->feature_map = layer;
    R->ran = 0; /* a backward pairs with a forward of the same output */
    return FSDP_OK;
}

int64_t fsdp_resnet_channels(const struct fsdp_resnet_config *cfg, int layer) {
    if (!cfg || layer < 0 || layer > 4) return -1;
    return ((int64_t)cfg->width << ((layer ? layer : 4) - 1)) * expansion(cfg);
}

const char *fsdp_resnet_block_type(const struct fsdp_resnet_config *cfg) {
    return cfg->arch == FSDP_RESNET50 ? "Bottleneck" : "BasicBlock";
}

enum fsdp_wrap fsdp_resnet_wrap_blocks(struct fsdp_module *m, void *ud, struct fsdp_unit_overrides *ovr) {
    (void)ud;
    (void)ovr;
    return strcmp(m->ops->type, "BasicBlock") == 0 || strcmp(m->ops->type, "Bottleneck") == 0 ? FSDP_WRAP_UNIT
                                                                                              : FSDP_WRAP_SKIP;
}

/* ---- FLOPs ---- */

static int64_t conv_out(int64_t h, int k, int s, int p) { return (h + 2 * p - k) / s + 1; }

/* 2 * multiply-adds of a k x k conv from cin to cout channels on h x w (stride s, padding k/2) */
static double conv_flops(int64_t cin, int64_t cout, int k, int s, int64_t *h, int64_t *w) {
    *h = conv_out(*h, k, s, k / 2);
    *w = conv_out(*w, k, s, k / 2);
    return 2.0 * (double)cin * (double)cout * k * k * (double)*h * (double)*w;
}

double fsdp_resnet_flops_per_image(const struct fsdp_resnet_config *cfg, int H, int W) {
    int64_t h = H, w = W, cw = cfg->width;
    double f;
    if (cfg->stem == FSDP_RESNET_STEM_IMAGENET) {
        f = conv_flops(cfg->in_chans, cw, 7, 2, &h, &w);
        h = conv_out(h, 3, 2, 1);
        w = conv_out(w, 3, 2, 1);
    } else {
        f = conv_flops(cfg->in_chans, cw, 3, 1, &h, &w);
    }
    int e = expansion(cfg);
    int64_t inplanes = cw;
    for (int l = 0; l < 4; l++) {
        int64_t planes = cw << l;
        for (int b = 0; b < blocks_of[cfg->arch][l]; b++) {
            int stride = b == 0 && l > 0 ? 2 : 1;
            int64_t h0 = h, w0 = w;
            if (e == 1) {
                f += conv_flops(inplanes, planes, 3, stride, &h, &w);
                f += conv_flops(planes, planes, 3, 1, &h, &w);
            } else {
                f += conv_flops(inplanes, planes, 1, 1, &h, &w);
                f += conv_flops(planes, planes, 3, stride, &h, &w);
                f += conv_flops(planes, planes * 4, 1, 1, &h, &w);
            }
            if (stride != 1 || inplanes != planes * e) f += conv_flops(inplanes, planes * e, 1, stride, &h0, &w0);
            inplanes = planes * e;
        }
    }
    return f + 2.0 * (double)inplanes * cfg->num_classes;
}

/* ---- Configuration ---- */

static const char *const arch_names[3] = {"resnet18", "resnet34", "resnet50"};
static const char *const stem_names[2] = {"imagenet", "cifar"};

const char *fsdp_resnet_arch_name(enum fsdp_resnet_arch arch) {
    return (unsigned)arch < 3 ? arch_names[arch] : "?";
}

const char *fsdp_resnet_stem_name(enum fsdp_resnet_stem stem) {
    return (unsigned)stem < 2 ? stem_names[stem] : "?";
}

enum fsdp_status fsdp_resnet_config_preset(const char *name, struct fsdp_resnet_config *cfg) {
    for (int i = 0; name && i < 3; i++)
        if (strcmp(arch_names[i], name) == 0) {
            memset(cfg, 0, sizeof *cfg);
            cfg->arch = (enum fsdp_resnet_arch)i;
            cfg->in_chans = 3;
            cfg->num_classes = 1000;
            cfg->stem = FSDP_RESNET_STEM_IMAGENET;
            cfg->width = 64;
            return FSDP_OK;
        }
    return FSDP_ERR_INVALID;
}

/* [Note: ResNet config bounds] far above any useful model, low enough that
 * every size fits in int64 with room: the widest tensor, layer4's conv2 of
 * a width-1024 ResNet-18 (or conv3 of a ResNet-50), has 8192 * 8192 * 9 <
 * 2^30 elements; fc at most 32768 * 2^24 = 2^39. */
#define RN_MAX_IN_CHANS 64
#define RN_MAX_CLASSES (1 << 24)
#define RN_MAX_WIDTH 1024

enum fsdp_status fsdp_resnet_config_validate(struct fsdp_ctx *ctx, const struct fsdp_resnet_config *cfg) {
    if ((unsigned)cfg->arch >= 3)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "ResNet config: arch %d is unknown (resnet18, resnet34, resnet50)",
                         (int)cfg->arch);
    if ((unsigned)cfg->stem >= 2)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "ResNet config: stem %d is unknown (imagenet, cifar)", (int)cfg->stem);
    const char *names[3] = {"in_chans", "num_classes", "width"};
    int vals[3] = {cfg->in_chans, cfg->num_classes, cfg->width};
    int max[3] = {RN_MAX_IN_CHANS, RN_MAX_CLASSES, RN_MAX_WIDTH};
    for (int i = 0; i < 3; i++)
        if (vals[i] < (i == 1 ? 0 : 1) || vals[i] > max[i])
            return fsdp__err(ctx, FSDP_ERR_INVALID, "ResNet config: %s %d is out of range [%d, %d]", names[i], vals[i],
                             i == 1 ? 0 : 1, max[i]);
    return FSDP_OK;
}

#define CONFIG_MAX_BYTES (1 << 20)

static enum fsdp_status config_parse(struct fsdp_ctx *ctx, const char *path, const cJSON *root,
                                     struct fsdp_resnet_config *cfg) {
    static const char *const keys[6] = {"arch", "in_chans", "num_classes", "stem", "width", "zero_init_residual"};
    int seen[6] = {0};
    if (!cJSON_IsObject(root))
        return fsdp__err(ctx, FSDP_ERR_FORMAT, "model config '%s': expected a JSON object", path);
    fsdp_resnet_config_preset("resnet18", cfg);
    for (const cJSON *it = root->child; it; it = it->next) {
        int k = -1;
        for (int i = 0; i < 6; i++)
            if (it->string && strcmp(it->string, keys[i]) == 0) k = i;
        if (k < 0)
            return fsdp__err(ctx, FSDP_ERR_FORMAT, "model config '%s': unknown key '%s' (expected arch, in_chans, "
                             "num_classes, stem, width, zero_init_residual)", path, it->string ? it->string : "");
        if (seen[k]) return fsdp__err(ctx, FSDP_ERR_FORMAT, "model config '%s': key '%s' appears twice", path, keys[k]);
        seen[k] = 1;
        if (k == 0 || k == 3) { /* names */
            const char *const *names = k == 0 ? arch_names : stem_names;
            int n = k == 0 ? 3 : 2, found = -1;
            for (int i = 0; cJSON_IsString(it) && i < n; i++)
                if (strcmp(it->valuestring, names[i]) == 0) found = i;
            if (found < 0)
                return fsdp__err(ctx, FSDP_ERR_INVALID, "model config '%s': %s %s%s%s is unknown (expected %s)", path,
                                 keys[k], cJSON_IsString(it) ? "'" : "", cJSON_IsString(it) ? it->valuestring : "(not a string)",
                                 cJSON_IsString(it) ? "'" : "", k == 0 ? "resnet18, resnet34 or resnet50" : "imagenet or cifar");
            if (k == 0) cfg->arch = (enum fsdp_resnet_arch)found;
            else cfg->stem = (enum fsdp_resnet_stem)found;
        } else if (k == 5) {
            if (!cJSON_IsBool(it))
                return fsdp__err(ctx, FSDP_ERR_FORMAT, "model config '%s': key '%s' must be true or false", path,
                                 keys[k]);
            cfg->zero_init_residual = cJSON_IsTrue(it);
        } else {
            double v = cJSON_IsNumber(it) ? it->valuedouble : NAN;
            if (!(v >= -2147483648.0 && v <= 2147483647.0 && floor(v) == v))
                return fsdp__err(ctx, FSDP_ERR_FORMAT, "model config '%s': key '%s' must be an integer", path, keys[k]);
            *(k == 1 ? &cfg->in_chans : k == 2 ? &cfg->num_classes : &cfg->width) = (int)v;
        }
    }
    if (!seen[0]) return fsdp__err(ctx, FSDP_ERR_FORMAT, "model config '%s': missing key 'arch'", path);
    if (fsdp_resnet_config_validate(ctx, cfg) != FSDP_OK) {
        char msg[sizeof ctx->errmsg];
        snprintf(msg, sizeof msg, "%s", fsdp_errmsg(ctx));
        const char *tail = strncmp(msg, "ResNet config: ", 15) == 0 ? msg + 15 : msg;
        return fsdp__err(ctx, FSDP_ERR_INVALID, "model config '%s': %s", path, tail);
    }
    return FSDP_OK;
}

enum fsdp_status fsdp_resnet_config_parse(struct fsdp_ctx *ctx, const char *path, const char *text, size_t len,
                                          struct fsdp_resnet_config *cfg) {
    cJSON *root; /* one JSON object, nothing after it */
    FSDP_TRY(fsdp__json_parse(ctx, "model config", path, text, len, &root));
    struct fsdp_resnet_config tmp;
    enum fsdp_status st = config_parse(ctx, path, root, &tmp);
    if (st == FSDP_OK) *cfg = tmp;
    cJSON_Delete(root);
    return st;
}

enum fsdp_status fsdp_resnet_config_load(struct fsdp_ctx *ctx, const char *path, struct fsdp_resnet_config *cfg) {
    char *buf;
    size_t len;
    FSDP_TRY(fsdp__read_file(ctx, "model config", path, CONFIG_MAX_BYTES, &buf, &len));
    enum fsdp_status st = fsdp_resnet_config_parse(ctx, path, buf, len, cfg);
    free(buf);
    return st;
}

int fsdp_resnet_config_json(const struct fsdp_resnet_config *cfg, char *buf, size_t cap) {
    return snprintf(buf, cap,
                    "{\"arch\":\"%s\",\"in_chans\":%d,\"num_classes\":%d,\"stem\":\"%s\",\"width\":%d,"
                    "\"zero_init_residual\":%s}",
                    fsdp_resnet_arch_name(cfg->arch), cfg->in_chans, cfg->num_classes,
                    fsdp_resnet_stem_name(cfg->stem), cfg->width, cfg->zero_init_residual ? "true" : "false");
}
