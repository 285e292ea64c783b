/*
 * test_resnet.c - the ResNet of src/models: against torchvision (where
 * Debian's PyTorch and torchvision are installed; tests/torchvision_resnet_ref.py):
 * the state-dict names in order, the FLOP count, and with the same weights
 * the train-mode logits, cross-entropy loss, input and parameter gradients,
 * the running statistics after that forward and the eval-mode logits;
 * without Python: eval mode uses the running statistics (an image's logits do
 * not depend on its batch, and the buffers stay put), the cifar stem's and
 * the width's shapes and parameter counts (torchvision's published counts
 * for the presets), zero_init_residual, the wrap policy's units, and bad
 * configs and inputs named in one message. And SwAV's model: a trunk, then
 * the head.
 */
#include "fsdp.h"
#include "harness.h"
#include "nn/nn-impl.h"
#include "nn_helpers.h"
#include "plist.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>


static struct fsdp_resnet_config config(enum fsdp_resnet_arch arch, int in_chans, int num_classes,
                                        enum fsdp_resnet_stem stem, int width) {
    struct fsdp_resnet_config c;
    memset(&c, 0, sizeof c);
    c.arch = arch;
    c.in_chans = in_chans;
    c.num_classes = num_classes;
    c.stem = stem;
    c.width = width;
    return c;
}

static float *random_images(int64_t n) {
    float *x = malloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) x[i] = 1.2f * urand();
    return x;
}

static struct fsdp_tensor image_tensor(float *x, int64_t N, int64_t C, int64_t H, int64_t W) {
    struct fsdp_tensor t = {0};
    t.data = x;
    t.dtype = FSDP_F32;
    t.ndim = 4;
    t.shape[0] = N, t.shape[1] = C, t.shape[2] = H, t.shape[3] = W;
    return t;
}

/* ---- PyTorch reference (skipped where torch or torchvision is missing) ---- */

/* state-dict order: each module's parameters, then its persistent buffers, then its children */
static void json_names(FILE *js, struct fsdp_module *m, int *first) {
    for (int i = 0; i < m->n_params; i++, *first = 0) fprintf(js, "%s\"%s\"", *first ? "" : ", ", m->params[i]->fqn);
    for (int i = 0; i < m->n_buffers; i++)
        if (m->buffers[i]->persistent) {
            fprintf(js, "%s\"%s\"", *first ? "" : ", ", m->buffers[i]->fqn);
            *first = 0;
        }
    for (int i = 0; i < m->n_children; i++) json_names(js, m->children[i], first);
}

/* BN weights and biases moved off 1 and 0, so that a mix-up shows */
static int perturb_bn(struct fsdp_param *p, void *ud) {
    (void)ud;
    if (strcmp(p->owner->ops->type, "BatchNorm2d") != 0) return 0;
    for (int64_t i = 0; i < p->numel; i++) p->data[i] += 0.2f * urand();
    return 0;
}

/* running statistics off their initial 0 / 1 / 0, so that the momentum update and eval mode show */
static int perturb_buffer(struct fsdp_buffer *b, void *ud) {
    (void)ud;
    for (int64_t i = 0; i < b->numel; i++) {
        if (b->dtype == FSDP_I64) ((int64_t *)b->data)[i] = 5;
        else ((float *)b->data)[i] += (strstr(b->name, "var") ? 0.5f : 0.2f) * urand();
    }
    return 0;
}

/* Case `id`: cfg's names and FLOPs at H x W; with N > 0, also a forward in
 * train mode (train) or eval mode, loss and backward, then an eval-mode
 * forward, on N images. [Note: train-mode references] */
static void ref_case(FILE *js, const char *dir, int id, struct fsdp_ctx *ctx, const struct fsdp_resnet_config *cfg,
                     int N, int H, int W, int train) {
    struct fsdp_module *m = NULL;
    if (fsdp_resnet_create(ctx, cfg, &m) != FSDP_OK) {
        TEST_FAILF("case %d: %s", id, fsdp_errmsg(ctx));
        return;
    }
    struct plist pl = {0};
    struct blist bl = {0};
    fsdp_module_foreach_param(m, collect_param, &pl);
    fsdp_module_foreach_buffer(m, collect_buffer, &bl);
    fprintf(js, "%s{\"arch\": \"%s\", \"in_chans\": %d, \"num_classes\": %d, \"stem\": \"%s\", \"width\": %d, "
            "\"H\": %d, \"W\": %d, \"N\": %d, \"data\": %s, \"train\": %s, \"flops\": %.1f,\n \"names\": [",
            id ? ",\n" : "", fsdp_resnet_arch_name(cfg->arch), cfg->in_chans, cfg->num_classes,
            fsdp_resnet_stem_name(cfg->stem), cfg->width, H, W, N, N > 0 ? "true" : "false", train ? "true" : "false",
            fsdp_resnet_flops_per_image(cfg, H, W));
    int first = 1;
    json_names(js, m, &first);
    fprintf(js, "],\n \"params\": [");
    for (int i = 0; i < pl.n; i++) fprintf(js, "%s\"%s\"", i ? ", " : "", pl.p[i]->fqn);
    fprintf(js, "],\n \"buffers\": [");
    for (int i = 0; i < bl.n; i++) fprintf(js, "%s\"%s\"", i ? ", " : "", bl.b[i]->fqn);
    fprintf(js, "]}");
    if (N > 0) {
        char name[64];
        ASSERT_OK(fsdp_module_materialize(ctx, m, 11), ctx);
        fsdp_module_foreach_param(m, perturb_bn, NULL);
        fsdp_module_foreach_buffer(m, perturb_buffer, NULL);
        for (int i = 0; i < pl.n; i++) {
            snprintf(name, sizeof name, "c%d_p%d.bin", id, i);
            CHECK(test_write_file(dir, name, pl.p[i]->data, (size_t)pl.p[i]->numel * sizeof(float)));
        }
        for (int i = 0; i < bl.n; i++) {
            snprintf(name, sizeof name, "c%d_bi%d.bin", id, i);
            CHECK(test_write_file(dir, name, bl.b[i]->data, (size_t)bl.b[i]->numel * fsdp_dtype_size(bl.b[i]->dtype)));
        }
        int64_t nx = (int64_t)N * cfg->in_chans * H * W, V = cfg->num_classes;
        float *x = random_images(nx);
        int32_t *t = malloc((size_t)N * sizeof(int32_t));
        for (int i = 0; i < N; i++) t[i] = (int32_t)(rng_next() % (uint64_t)V);
        snprintf(name, sizeof name, "c%d_x.bin", id);
        CHECK(test_write_file(dir, name, x, (size_t)nx * sizeof(float)));
        snprintf(name, sizeof name, "c%d_t.bin", id);
        CHECK(test_write_file(dir, name, t, (size_t)N * sizeof(int32_t)));
        struct fsdp_tensor in = image_tensor(x, N, cfg->in_chans, H, W), y = {0}, dx = {0};
        fsdp_arena_reset(ctx);
        fsdp_module_set_training(m, train);
        CHECK_OK(fsdp_module_zero_grad(ctx, m), ctx);
        CHECK_OK(fsdp_module_forward(m, ctx, &in, &y), ctx);
        CHECK_INT_EQ(y.ndim, 2);
        CHECK_INT_EQ(y.shape[0], N);
        CHECK_INT_EQ(y.shape[1], V);
        snprintf(name, sizeof name, "c%d_y.bin", id);
        CHECK(test_write_file(dir, name, y.data, (size_t)(N * V) * sizeof(float)));
        float loss = 0.0f, *dy = malloc((size_t)(N * V) * sizeof(float));
        CHECK_OK(fsdp_cross_entropy(ctx, y.data, t, N, V, 1.0f, &loss, dy), ctx);
        snprintf(name, sizeof name, "c%d_loss.bin", id);
        CHECK(test_write_file(dir, name, &loss, sizeof loss));
        struct fsdp_tensor d = y;
        d.data = dy;
        CHECK_OK(fsdp_module_backward(m, ctx, &d, &dx), ctx);
        snprintf(name, sizeof name, "c%d_dx.bin", id);
        CHECK(test_write_file(dir, name, dx.data, (size_t)nx * sizeof(float)));
        for (int i = 0; i < pl.n; i++) {
            snprintf(name, sizeof name, "c%d_g%d.bin", id, i);
            CHECK(test_write_file(dir, name, pl.p[i]->grad, (size_t)pl.p[i]->numel * sizeof(float)));
        }
        for (int i = 0; i < bl.n; i++) {
            snprintf(name, sizeof name, "c%d_b%d.bin", id, i);
            CHECK(test_write_file(dir, name, bl.b[i]->data, (size_t)bl.b[i]->numel * fsdp_dtype_size(bl.b[i]->dtype)));
        }
        fsdp_arena_reset(ctx);
        fsdp_module_set_training(m, 0);
        struct fsdp_tensor ye = {0};
        CHECK_OK(fsdp_module_forward(m, ctx, &in, &ye), ctx);
        snprintf(name, sizeof name, "c%d_ye.bin", id);
        CHECK(test_write_file(dir, name, ye.data, (size_t)(N * V) * sizeof(float)));
        free(dy);
        free(t);
        free(x);
    }
    plist_free(&pl);
    blist_free(&bl);
    fsdp_module_free(m);
}

/* Writes the cases, runs the script; with_data: the numeric cases, else names and FLOPs only. */
static void run_reference(int with_data) {
    char script[4200];
    if (!test_python_ref("torch, torchvision", "torchvision_resnet_ref.py", script, sizeof script)) return;
    rng_seed(5);
    struct fsdp_ctx *ctx = make_ctx();
    char dir[] = "/tmp/fsdp_torch_resnet_XXXXXX";
    ASSERT(mkdtemp(dir));
    char path[1024];
    snprintf(path, sizeof path, "%s/index.json", dir);
    FILE *js = fopen(path, "w");
    ASSERT(js);
    fprintf(js, "[\n");
    int id = 0;
    if (with_data) {
        /* the model: torchvision resnet18(num_classes=10), conv1 Conv2d(1, 64, 7, 2, 3) */
        struct fsdp_resnet_config c = config(FSDP_RESNET18, 1, 10, FSDP_RESNET_STEM_IMAGENET, 64);
        ref_case(js, dir, id++, ctx, &c, 8, 28, 28, 1);
        c = config(FSDP_RESNET34, 3, 7, FSDP_RESNET_STEM_CIFAR, 16);
        ref_case(js, dir, id++, ctx, &c, 2, 12, 12, 1);
        c = config(FSDP_RESNET50, 1, 10, FSDP_RESNET_STEM_IMAGENET, 16); /* width 64's names: the other test */
        ref_case(js, dir, id++, ctx, &c, 3, 32, 32, 0);
    } else {
        const char *presets[3] = {"resnet18", "resnet34", "resnet50"};
        for (int i = 0; i < 3; i++) {
            struct fsdp_resnet_config c;
            ASSERT_INT_EQ(fsdp_resnet_config_preset(presets[i], &c), FSDP_OK);
            ref_case(js, dir, id++, ctx, &c, 0, 64, 48, 0);
            c.stem = FSDP_RESNET_STEM_CIFAR;
            c.width = 16;
            c.in_chans = 1;
            ref_case(js, dir, id++, ctx, &c, 0, 28, 30, 0);
        }
    }
    fprintf(js, "\n]\n");
    CHECK(fclose(js) == 0);
    test_run_python_ref(script, dir);
    fsdp_ctx_free(ctx);
}

/* [Note: train-mode references] A train-mode ResNet-50 at 32x32 (1x1
 * planes in layer4) on a small batch is ill-conditioned in fp32: torch's own
 * fp32 gradients differ from its fp64 ones by up to 60% there (features of
 * the few images nearly equal, so batch statistics cancel), so no two fp32
 * implementations can agree to 1e-4. Train mode is compared on ResNet-18
 * (28x28, 8 images: torch fp32 within 1e-5 of fp64) and a cifar-stem
 * ResNet-34; ResNet-50's Bottlenecks (width 16, to keep the files small)
 * are compared in eval mode (with perturbed running statistics), where
 * fp32 is within 5e-6 of fp64 (measured at width 64). */
TEST(resnet_names_and_flops_match_torchvision) { run_reference(0); }

TEST(resnet_matches_torchvision) { run_reference(1); }

/* ---- without Python ---- */

static int buffers_equal(struct fsdp_module *m, void **saved, int save) {
    struct blist bl = {0};
    fsdp_module_foreach_buffer(m, collect_buffer, &bl);
    if (bl.n > 256) abort(); /* saved[] holds 256 */
    int same = 1;
    for (int i = 0; i < bl.n; i++) {
        size_t bytes = (size_t)bl.b[i]->numel * fsdp_dtype_size(bl.b[i]->dtype);
        if (save) {
            saved[i] = malloc(bytes);
            memcpy(saved[i], bl.b[i]->data, bytes);
        } else {
            same &= memcmp(saved[i], bl.b[i]->data, bytes) == 0;
            free(saved[i]);
        }
    }
    blist_free(&bl);
    return same;
}

/* Input gradients a (the reference) and b of n values agree to 1e-5 of a's
 * largest, which is not zero. */
static void check_input_grads(const struct fsdp_tensor *a, const struct fsdp_tensor *b, int64_t n) {
    double worst = 0, mx = 0;
    for (int64_t i = 0; i < n; i++) {
        worst = fmax(worst, fabs(((float *)a->data)[i] - ((float *)b->data)[i]));
        mx = fmax(mx, fabs(((float *)a->data)[i]));
    }
    CHECK(mx > 0);
    if (!(worst <= 1e-5 * (1 + mx))) TEST_FAILF("input gradients differ by %g (max %g)", worst, mx);
}

/* num_classes 0: a trunk without fc whose output is the pooled features:
 * the classifier's logits are fc of them, and the input gradient through
 * the trunk from fc's weights' transpose equals the classifier's. */
TEST(resnet_without_fc_is_the_trunk) {
    rng_seed(12);
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_resnet_config cf = config(FSDP_RESNET18, 1, 5, FSDP_RESNET_STEM_CIFAR, 4),
                              ct = config(FSDP_RESNET18, 1, 0, FSDP_RESNET_STEM_CIFAR, 4);
    struct fsdp_module *full, *trunk;
    ASSERT_OK(fsdp_resnet_create(ctx, &cf, &full), ctx);
    ASSERT_OK(fsdp_resnet_create(ctx, &ct, &trunk), ctx);
    CHECK(fsdp_module_find_param(trunk, "fc.weight") == NULL);
    ASSERT_OK(fsdp_module_materialize(ctx, full, 3), ctx);
    ASSERT_OK(fsdp_module_materialize(ctx, trunk, 3), ctx);
    ASSERT_OK(fsdp_module_zero_grad(ctx, full), ctx);
    ASSERT_OK(fsdp_module_zero_grad(ctx, trunk), ctx);
    enum { N = 3, S = 8, F = 32, K = 5 };
    float *x = random_images(N * S * S);
    struct fsdp_tensor in = image_tensor(x, N, 1, S, S), yl = {0}, yf = {0}, dl = {0}, dt = {0};
    fsdp_arena_reset(ctx);
    ASSERT_OK(fsdp_module_forward(full, ctx, &in, &yl), ctx);
    ASSERT_OK(fsdp_module_forward(trunk, ctx, &in, &yf), ctx);
    CHECK_INT_EQ(yf.ndim, 2);
    CHECK_INT_EQ(yf.shape[1], F);
    const float *w = fsdp_module_find_param(full, "fc.weight")->data, *b = fsdp_module_find_param(full, "fc.bias")->data;
    for (int n = 0; n < N; n++)
        for (int k = 0; k < K; k++) {
            double z = b[k];
            for (int f = 0; f < F; f++) z += (double)w[k * F + f] * ((float *)yf.data)[n * F + f];
            CHECK_NEAR(((float *)yl.data)[n * K + k], z, 1e-4, 1e-5);
        }
    float gl[N * K], gf[N * F];
    for (int i = 0; i < N * K; i++) gl[i] = 0.1f * (float)(i % 7) - 0.3f;
    for (int n = 0; n < N; n++)
        for (int f = 0; f < F; f++) {
            double g = 0;
            for (int k = 0; k < K; k++) g += (double)w[k * F + f] * gl[n * K + k];
            gf[n * F + f] = (float)g;
        }
    struct fsdp_tensor tl = {gl, FSDP_F32, 2, {N, K}, FSDP_LAYOUT_PLAIN};
    struct fsdp_tensor tf = {gf, FSDP_F32, 2, {N, F}, FSDP_LAYOUT_PLAIN};
    ASSERT_OK(fsdp_module_backward(trunk, ctx, &tf, &dt), ctx);
    ASSERT_OK(fsdp_module_forward(full, ctx, &in, &yl), ctx);
    ASSERT_OK(fsdp_module_backward(full, ctx, &tl, &dl), ctx);
    check_input_grads(&dl, &dt, N * S * S);
    free(x);
    fsdp_module_free(full);
    fsdp_module_free(trunk);
    fsdp_ctx_free(ctx);
}

/* fsdp_swav_model_create: forward is the trunk, then the head, and with
 * trunk_only the trunk's features alone; backward is the head's, then the
 * trunk's, with the same bits as the children run by hand; misuse named. */
TEST(swav_model_is_trunk_then_head) {
    rng_seed(13);
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_resnet_config ct = config(FSDP_RESNET18, 1, 0, FSDP_RESNET_STEM_CIFAR, 4);
    struct fsdp_swav_head_config hc = {32, 0, 5, 7, 1};
    struct fsdp_module *trunk, *head, *m;
    ASSERT_OK(fsdp_resnet_create(ctx, &ct, &trunk), ctx);
    snprintf(trunk->name, sizeof trunk->name, "trunk");
    ASSERT_OK(fsdp_swav_head_create(ctx, "heads", &hc, &head), ctx);
    ASSERT_OK(fsdp_swav_model_create(ctx, "", trunk, head, &m), ctx);
    CHECK(fsdp_module_find_param(m, "trunk.conv1.weight") != NULL);
    CHECK(fsdp_module_find_param(m, "heads.prototypes0.weight") != NULL);
    ASSERT_OK(fsdp_module_materialize(ctx, m, 4), ctx);
    ASSERT_OK(fsdp_module_zero_grad(ctx, m), ctx);
    enum { N = 3, S = 8, F = 32, WD = 5 + 7 };
    float *x = random_images(N * S * S);
    struct fsdp_tensor in = image_tensor(x, N, 1, S, S), y = {0}, yf = {0}, yt = {0}, yh = {0};
    fsdp_arena_reset(ctx);
    CHECK_INT_EQ(fsdp_module_backward(m, ctx, &in, NULL), FSDP_ERR_STATE);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "backward without forward");
    ASSERT_OK(fsdp_module_forward(m, ctx, &in, &y), ctx);
    CHECK(y.ndim == 2 && y.shape[0] == N && y.shape[1] == WD);
    ASSERT_OK(fsdp_swav_model_set_trunk_only(ctx, m, 1), ctx);
    ASSERT_OK(fsdp_module_forward(m, ctx, &in, &yf), ctx);
    ASSERT_OK(fsdp_module_forward(trunk, ctx, &in, &yt), ctx);
    ASSERT_OK(fsdp_module_forward(head, ctx, &yt, &yh), ctx);
    CHECK(yf.ndim == 2 && yf.shape[1] == F);
    CHECK(memcmp(yf.data, yt.data, (size_t)(N * F) * sizeof(float)) == 0);
    CHECK(memcmp(y.data, yh.data, (size_t)(N * WD) * sizeof(float)) == 0);
    /* backward through the model against the children by hand, each after its own forward */
    float g[N * WD];
    for (int i = 0; i < N * WD; i++) g[i] = 0.05f * (float)(i % 9) - 0.2f;
    struct fsdp_tensor tg = {g, FSDP_F32, 2, {N, WD}, FSDP_LAYOUT_PLAIN}, dm = {0}, dh = {0}, dt = {0};
    ASSERT_OK(fsdp_swav_model_set_trunk_only(ctx, m, 0), ctx);
    ASSERT_OK(fsdp_module_forward(m, ctx, &in, &y), ctx);
    ASSERT_OK(fsdp_module_backward(m, ctx, &tg, &dm), ctx);
    ASSERT_OK(fsdp_module_forward(trunk, ctx, &in, &yt), ctx);
    ASSERT_OK(fsdp_module_forward(head, ctx, &yt, &yh), ctx);
    ASSERT_OK(fsdp_module_backward(head, ctx, &tg, &dh), ctx);
    ASSERT_OK(fsdp_module_backward(trunk, ctx, &dh, &dt), ctx);
    CHECK(dm.ndim == 4 && dm.shape[0] == N);
    CHECK(memcmp(dm.data, dt.data, (size_t)(N * S * S) * sizeof(float)) == 0);
    /* misuse */
    CHECK_INT_EQ(fsdp_swav_model_set_trunk_only(ctx, trunk, 1), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "'trunk' is not a SwAV model");
    struct fsdp_module *t2, *m2 = NULL;
    ASSERT_OK(fsdp_resnet_create(ctx, &ct, &t2), ctx);
    CHECK_INT_EQ(fsdp_swav_model_create(ctx, "x", t2, NULL, &m2), FSDP_ERR_INVALID); /* t2 freed */
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "the head is NULL");
    CHECK(m2 == NULL);
    free(x);
    fsdp_module_free(m);
    fsdp_ctx_free(ctx);
}

/* fsdp_resnet_set_feature_map: the output is layer4's map (N, C, h, w),
 * whose spatial mean is the trunk's pooled features; its backward, given
 * the pooled gradient spread evenly over the map, gives the trunk's input
 * and parameter gradients; off again, the output is the pooled features. */
TEST(resnet_feature_map_is_the_map_the_trunk_pools) {
    rng_seed(21);
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_resnet_config ct = config(FSDP_RESNET18, 1, 0, FSDP_RESNET_STEM_CIFAR, 4);
    struct fsdp_module *trunk;
    ASSERT_OK(fsdp_resnet_create(ctx, &ct, &trunk), ctx);
    ASSERT_OK(fsdp_module_materialize(ctx, trunk, 5), ctx);
    enum { N = 3, S = 12, F = 32 };
    float *x = random_images(N * S * S);
    struct fsdp_tensor in = image_tensor(x, N, 1, S, S), yf = {0}, ym = {0}, d1 = {0}, d2 = {0};
    fsdp_arena_reset(ctx);
    ASSERT_OK(fsdp_module_forward(trunk, ctx, &in, &yf), ctx);
    float pooled[N * F];
    memcpy(pooled, yf.data, sizeof pooled);
    ASSERT_OK(fsdp_resnet_set_feature_map(ctx, trunk, 4), ctx);
    ASSERT_OK(fsdp_module_forward(trunk, ctx, &in, &ym), ctx);
    CHECK_INT_EQ(ym.ndim, 4);
    CHECK_INT_EQ(ym.shape[0], N);
    CHECK_INT_EQ(ym.shape[1], F);
    CHECK_INT_EQ(ym.shape[2], 2); /* 12 -> 12, 6, 3, 2 */
    CHECK_INT_EQ(ym.shape[3], 2);
    CHECK_INT_EQ(ym.layout, FSDP_LAYOUT_PLAIN);
    int64_t hw = ym.shape[2] * ym.shape[3];
    for (int n = 0; n < N; n++)
        for (int f = 0; f < F; f++) {
            double s = 0;
            for (int64_t q = 0; q < hw; q++) s += ((float *)ym.data)[(n * F + f) * hw + q];
            CHECK_NEAR(s / (double)hw, pooled[n * F + f], 1e-5, 1e-6);
        }
    /* backward: the map's gradient g / (h w) everywhere against the pooled gradient g */
    float gf[N * F], gm[N * F * 4];
    for (int i = 0; i < N * F; i++) gf[i] = 0.05f * (float)(i % 11) - 0.25f;
    for (int i = 0; i < N * F * 4; i++) gm[i] = gf[i / 4] / 4.0f;
    struct fsdp_tensor tf = {gf, FSDP_F32, 2, {N, F}, FSDP_LAYOUT_PLAIN};
    struct fsdp_tensor tm = {gm, FSDP_F32, 4, {N, F, 2, 2}, FSDP_LAYOUT_PLAIN};
    ASSERT_OK(fsdp_module_zero_grad(ctx, trunk), ctx);
    ASSERT_OK(fsdp_module_backward(trunk, ctx, &tm, &d2), ctx);
    struct fsdp_param *w1 = fsdp_module_find_param(trunk, "conv1.weight");
    float gw_map[4 * 9];
    memcpy(gw_map, w1->grad, sizeof gw_map);
    struct fsdp_tensor wrong = {gf, FSDP_F32, 2, {N, F}, FSDP_LAYOUT_PLAIN}, dn = {0};
    CHECK(fsdp_module_backward(trunk, ctx, &wrong, &dn) == FSDP_ERR_INVALID); /* the map's backward wants the map */
    ASSERT_OK(fsdp_resnet_set_feature_map(ctx, trunk, 0), ctx);
    ASSERT_OK(fsdp_module_forward(trunk, ctx, &in, &yf), ctx);
    CHECK_INT_EQ(yf.ndim, 2);
    for (int i = 0; i < N * F; i++) CHECK(((float *)yf.data)[i] == pooled[i]);
    ASSERT_OK(fsdp_module_zero_grad(ctx, trunk), ctx);
    ASSERT_OK(fsdp_module_backward(trunk, ctx, &tf, &d1), ctx);
    check_input_grads(&d1, &d2, N * S * S);
    for (int i = 0; i < 4 * 9; i++) CHECK_NEAR(gw_map[i], w1->grad[i], 1e-4, 1e-6);
    /* layer3's map (N, F / 2, 3, 3), which layer4 run on its own turns into layer4's map */
    ASSERT_OK(fsdp_resnet_set_feature_map(ctx, trunk, 4), ctx);
    ASSERT_OK(fsdp_module_forward(trunk, ctx, &in, &ym), ctx);
    float map4[N * F * 4];
    memcpy(map4, ym.data, sizeof map4);
    struct fsdp_tensor y3 = {0}, y4 = {0};
    ASSERT_OK(fsdp_resnet_set_feature_map(ctx, trunk, 3), ctx);
    ASSERT_OK(fsdp_module_forward(trunk, ctx, &in, &y3), ctx);
    CHECK_INT_EQ(y3.ndim, 4);
    CHECK_INT_EQ(y3.shape[1], F / 2);
    CHECK_INT_EQ(y3.shape[2], 3);
    CHECK_INT_EQ(y3.shape[3], 3);
    struct fsdp_module *layer4 = NULL;
    for (int i = 0; i < trunk->n_children; i++)
        if (!strcmp(trunk->children[i]->name, "layer4")) layer4 = trunk->children[i];
    ASSERT(layer4);
    ASSERT_OK(fsdp_module_forward(layer4, ctx, &y3, &y4), ctx);
    float p4[N * F * 4];
    fsdp__relayout(p4, FSDP_LAYOUT_PLAIN, y4.data, y4.layout, y4.shape); /* layer4 alone may write blocked */
    for (int i = 0; i < N * F * 4; i++) CHECK_NEAR(p4[i], map4[i], 1e-5, 1e-6);
    /* fsdp_resnet_channels gives every layer's map its channels (0: the pooled features) */
    for (int L = 1; L <= 4; L++) {
        struct fsdp_tensor yl = {0};
        ASSERT_OK(fsdp_resnet_set_feature_map(ctx, trunk, L), ctx);
        ASSERT_OK(fsdp_module_forward(trunk, ctx, &in, &yl), ctx);
        CHECK_INT_EQ(yl.shape[1], fsdp_resnet_channels(&ct, L));
    }
    CHECK_INT_EQ(fsdp_resnet_channels(&ct, 0), F);
    CHECK_INT_EQ(fsdp_resnet_channels(&ct, 5), -1);
    struct fsdp_resnet_config c50 = config(FSDP_RESNET50, 1, 0, FSDP_RESNET_STEM_CIFAR, 4);
    CHECK_INT_EQ(fsdp_resnet_channels(&c50, 1), 16); /* a bottleneck's 4x expansion */
    CHECK_INT_EQ(fsdp_resnet_channels(&c50, 0), 128);
    /* only a ResNet's root takes it, and only layers 0..4 */
    CHECK(fsdp_resnet_set_feature_map(ctx, trunk, 5) == FSDP_ERR_INVALID);
    CHECK(strstr(fsdp_errmsg(ctx), "layer 5"));
    struct fsdp_module *c1 = trunk->children[0];
    CHECK(fsdp_resnet_set_feature_map(ctx, c1, 4) == FSDP_ERR_INVALID);
    CHECK(strstr(fsdp_errmsg(ctx), "conv1") && strstr(fsdp_errmsg(ctx), "not a ResNet"));
    free(x);
    fsdp_module_free(trunk);
    fsdp_ctx_free(ctx);
}

TEST(resnet_eval_mode_uses_running_stats) {
    rng_seed(9);
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_resnet_config c = config(FSDP_RESNET18, 1, 10, FSDP_RESNET_STEM_CIFAR, 8);
    struct fsdp_module *m;
    ASSERT_OK(fsdp_resnet_create(ctx, &c, &m), ctx);
    ASSERT_OK(fsdp_module_materialize(ctx, m, 3), ctx);
    enum { N = 3, S = 16 };
    float *x = random_images(N * S * S);
    struct fsdp_tensor all = image_tensor(x, N, 1, S, S), one = image_tensor(x, 1, 1, S, S), y = {0}, y1 = {0};
    /* two train steps' statistics first, so running stats are not the initial 0 / 1 */
    for (int k = 0; k < 2; k++) {
        fsdp_arena_reset(ctx);
        ASSERT_OK(fsdp_module_forward(m, ctx, &all, &y), ctx);
        y.data = NULL;
    }
    struct fsdp_buffer *nbt = fsdp_module_find_buffer(m, "layer3.1.bn2.num_batches_tracked");
    ASSERT(nbt);
    CHECK_INT_EQ(((int64_t *)nbt->data)[0], 2);
    /* train mode: image 0's logits depend on the batch (batch statistics) */
    fsdp_arena_reset(ctx);
    ASSERT_OK(fsdp_module_forward(m, ctx, &all, &y), ctx);
    ASSERT_OK(fsdp_module_forward(m, ctx, &one, &y1), ctx);
    double diff = 0;
    for (int j = 0; j < 10; j++) diff = fmax(diff, fabs(((float *)y.data)[j] - ((float *)y1.data)[j]));
    CHECK(diff > 1e-3);
    /* eval mode: they do not, and the buffers stay as they are */
    void *saved[256];
    buffers_equal(m, saved, 1);
    fsdp_module_set_training(m, 0);
    fsdp_arena_reset(ctx);
    y.data = y1.data = NULL;
    ASSERT_OK(fsdp_module_forward(m, ctx, &all, &y), ctx);
    ASSERT_OK(fsdp_module_forward(m, ctx, &one, &y1), ctx);
    for (int j = 0; j < 10; j++) CHECK_NEAR(((float *)y1.data)[j], ((float *)y.data)[j], 1e-5, 1e-6);
    CHECK(buffers_equal(m, saved, 0));
    CHECK_INT_EQ(((int64_t *)nbt->data)[0], 4);
    free(x);
    fsdp_module_free(m);
    fsdp_ctx_free(ctx);
}

static void check_shape(struct fsdp_module *m, const char *fqn, int ndim, int64_t d0, int64_t d1, int64_t d2,
                        int64_t d3) {
    struct fsdp_param *p = fsdp_module_find_param(m, fqn);
    if (!p) {
        TEST_FAILF("no parameter %s", fqn);
        return;
    }
    int64_t want[4] = {d0, d1, d2, d3};
    CHECK_INT_EQ(p->ndim, ndim);
    for (int d = 0; d < ndim; d++)
        if (p->shape[d] != want[d]) TEST_FAILF("%s: dimension %d is %lld, expected %lld", fqn, d, (long long)p->shape[d],
                                               (long long)want[d]);
}

TEST(resnet_stems_widths_and_counts) {
    rng_seed(4);
    struct fsdp_ctx *ctx = make_ctx();
    /* torchvision's parameter counts of resnet18/34/50 (3 channels, 1000 classes) */
    const char *presets[3] = {"resnet18", "resnet34", "resnet50"};
    const int64_t counts[3] = {11689512, 21797672, 25557032};
    for (int i = 0; i < 3; i++) {
        struct fsdp_resnet_config c;
        ASSERT_INT_EQ(fsdp_resnet_config_preset(presets[i], &c), FSDP_OK);
        struct fsdp_module *m;
        ASSERT_OK(fsdp_resnet_create(ctx, &c, &m), ctx);
        CHECK_INT_EQ(fsdp_module_numel(m), counts[i]);
        CHECK_STR_EQ(m->ops->type, "ResNet");
        fsdp_module_free(m);
    }
    /* cifar stem, width 16: 3x3 conv1, no maxpool, 16..128 channels, 32x32 stays 32x32 into layer1 */
    struct fsdp_resnet_config c = config(FSDP_RESNET18, 3, 10, FSDP_RESNET_STEM_CIFAR, 16);
    struct fsdp_module *m;
    ASSERT_OK(fsdp_resnet_create(ctx, &c, &m), ctx);
    check_shape(m, "conv1.weight", 4, 16, 3, 3, 3);
    check_shape(m, "layer1.1.conv2.weight", 4, 16, 16, 3, 3);
    check_shape(m, "layer4.0.conv1.weight", 4, 128, 64, 3, 3);
    check_shape(m, "layer4.0.downsample.0.weight", 4, 128, 64, 1, 1);
    check_shape(m, "fc.weight", 2, 10, 128, 0, 0);
    CHECK(!fsdp_module_find_param(m, "layer1.0.downsample.0.weight"));
    for (int i = 0; i < m->n_children; i++) CHECK(strcmp(m->children[i]->name, "maxpool") != 0);
    ASSERT_OK(fsdp_module_materialize(ctx, m, 1), ctx);
    float *x = random_images(2 * 3 * 32 * 32);
    struct fsdp_tensor in = image_tensor(x, 2, 3, 32, 32), y = {0};
    ASSERT_OK(fsdp_module_forward(m, ctx, &in, &y), ctx);
    CHECK_INT_EQ(y.ndim, 2);
    CHECK_INT_EQ(y.shape[0], 2);
    CHECK_INT_EQ(y.shape[1], 10);
    /* the cifar stem keeps 32x32: conv1 costs 2 * 3 * 16 * 9 * 32 * 32 of the FLOPs */
    struct fsdp_resnet_config ci = c;
    ci.stem = FSDP_RESNET_STEM_IMAGENET;
    CHECK(fsdp_resnet_flops_per_image(&c, 32, 32) > 10 * fsdp_resnet_flops_per_image(&ci, 32, 32));
    free(x);
    fsdp_module_free(m);
    /* resnet50 at width 16, 1 channel, 28x28 (imagenet stem): Bottleneck widths, fc from 512 */
    c = config(FSDP_RESNET50, 1, 10, FSDP_RESNET_STEM_IMAGENET, 16);
    c.zero_init_residual = 1;
    ASSERT_OK(fsdp_resnet_create(ctx, &c, &m), ctx);
    check_shape(m, "conv1.weight", 4, 16, 1, 7, 7);
    check_shape(m, "layer1.0.downsample.0.weight", 4, 64, 16, 1, 1);
    check_shape(m, "layer3.5.conv3.weight", 4, 256, 64, 1, 1);
    check_shape(m, "fc.weight", 2, 10, 512, 0, 0);
    ASSERT_OK(fsdp_module_materialize(ctx, m, 1), ctx);
    /* zero_init_residual: each block's last BN weight is 0, the others 1 */
    struct fsdp_param *z = fsdp_module_find_param(m, "layer2.3.bn3.weight"), *o = fsdp_module_find_param(m, "layer2.3.bn2.weight"),
                      *ds = fsdp_module_find_param(m, "layer2.0.downsample.1.weight");
    ASSERT(z && o && ds);
    for (int64_t i = 0; i < z->numel; i++) CHECK(z->data[i] == 0.0f && ds->data[i] == 1.0f);
    for (int64_t i = 0; i < o->numel; i++) CHECK(o->data[i] == 1.0f);
    x = random_images(2 * 28 * 28);
    in = image_tensor(x, 2, 1, 28, 28);
    y.data = NULL;
    ASSERT_OK(fsdp_module_forward(m, ctx, &in, &y), ctx);
    CHECK_INT_EQ(y.shape[0], 2);
    CHECK_INT_EQ(y.shape[1], 10);
    /* 3-channel images into in_chans 1: one error naming in_chans */
    struct fsdp_tensor in3 = image_tensor(x, 1, 2, 28, 14);
    y.data = NULL;
    CHECK_INT_EQ(fsdp_module_forward(m, ctx, &in3, &y), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "in_chans");
    free(x);
    fsdp_module_free(m);
    fsdp_ctx_free(ctx);
}

/* Counts m's subtree's Conv2d, BatchNorm2d and Linear layers into n[0..2],
 * and into c[0..2] those of compute dtype dt. */
static void count_layers(const struct fsdp_module *m, enum fsdp_dtype dt, int n[3], int c[3]) {
    static const char *const types[3] = {"Conv2d", "BatchNorm2d", "Linear"};
    for (int t = 0; t < 3; t++)
        if (!strcmp(m->ops->type, types[t])) {
            n[t]++;
            c[t] += m->compute_dtype == dt;
        }
    for (int i = 0; i < m->n_children; i++) count_layers(m->children[i], dt, n, c);
}

TEST(resnet_bf16_compute_close_to_fp32) { /* the compute dtype reaches every conv and fc below the root */
    rng_seed(6);
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_resnet_config c = config(FSDP_RESNET18, 3, 10, FSDP_RESNET_STEM_CIFAR, 8);
    struct fsdp_module *m;
    ASSERT_OK(fsdp_resnet_create(ctx, &c, &m), ctx);
    ASSERT_OK(fsdp_module_materialize(ctx, m, 2), ctx);
    fsdp_module_set_training(m, 0); /* eval: the same affine BN both times */
    float *x = random_images(4 * 3 * 16 * 16);
    struct fsdp_tensor in = image_tensor(x, 4, 3, 16, 16), y32 = {0}, y16 = {0};
    ASSERT_OK(fsdp_module_forward(m, ctx, &in, &y32), ctx);
    ASSERT_OK(fsdp_module_set_compute_dtype(ctx, m, FSDP_BF16), ctx);
    /* ResNet-18: the stem, 16 block convs and 3 downsamples, a BN each, one fc */
    int n[3] = {0}, in16[3] = {0};
    count_layers(m, FSDP_BF16, n, in16);
    CHECK_INT_EQ(n[0], 20);
    CHECK_INT_EQ(n[1], 20);
    CHECK_INT_EQ(n[2], 1);
    for (int t = 0; t < 3; t++) CHECK_INT_EQ(in16[t], n[t]);
    ASSERT_OK(fsdp_module_forward(m, ctx, &in, &y16), ctx);
    double mx = 0, diff = 0;
    for (int i = 0; i < 40; i++) {
        mx = fmax(mx, fabs(((float *)y32.data)[i]));
        diff = fmax(diff, fabs(((float *)y16.data)[i] - ((float *)y32.data)[i]));
    }
    CHECK(diff <= 0.05 * mx); /* bf16 inputs: 8 bits of mantissa through 17 products */
    CHECK(diff > 0.0);        /* and not the fp32 path */
    free(x);
    fsdp_module_free(m);
    fsdp_ctx_free(ctx);
}

TEST(resnet_wrap_policy_unit_per_block) {
    struct fsdp_ctx *ctx = make_ctx();
    for (int arch = 0; arch < 3; arch++) {
        struct fsdp_resnet_config c = config((enum fsdp_resnet_arch)arch, 1, 10, FSDP_RESNET_STEM_IMAGENET, 8);
        for (int by_type = 0; by_type < 2; by_type++) {
            struct fsdp_module *m;
            ASSERT_OK(fsdp_resnet_create(ctx, &c, &m), ctx);
            struct fsdp_shard_opts so = fsdp_shard_opts_default();
            so.wrap = by_type ? fsdp_wrap_by_type : fsdp_resnet_wrap_blocks;
            so.wrap_ud = by_type ? (void *)fsdp_resnet_block_type(&c) : NULL;
            struct fsdp_model *fm;
            ASSERT_OK(fsdp_fully_shard(ctx, m, &so, &fm), ctx);
            int blocks = arch == 0 ? 8 : 16;
            CHECK_INT_EQ(fsdp_model_n_units(fm), 1 + blocks);
            int root_has_stem = 0, root_has_fc = 0, block_units = 0;
            for (int u = 0; u < fsdp_model_n_units(fm); u++) {
                struct fsdp_unit_info info;
                fsdp_model_unit_info(fm, u, &info);
                if (info.fqn[0] == '\0') {
                    for (int k = 0; k < info.n_params; k++) {
                        root_has_stem |= strcmp(info.param_fqns[k], "conv1.weight") == 0;
                        root_has_fc |= strcmp(info.param_fqns[k], "fc.bias") == 0;
                        CHECK(strncmp(info.param_fqns[k], "layer", 5) != 0);
                    }
                } else {
                    block_units += strncmp(info.fqn, "layer", 5) == 0 && strchr(info.fqn, '.') != NULL;
                }
            }
            CHECK(root_has_stem && root_has_fc);
            CHECK_INT_EQ(block_units, blocks);
            fsdp_model_free(fm);
            fsdp_module_free(m);
        }
    }
    fsdp_ctx_free(ctx);
}

/* ---- bad configs ---- */

/* The file of len bytes text (NUL bytes allowed) is refused with a message naming it and needle. */
static void check_bad_bytes(struct fsdp_ctx *ctx, const char *text, size_t len, const char *needle) {
    char path[] = "/tmp/fsdp_resnet_cfg_XXXXXX";
    int fd = mkstemp(path);
    ASSERT(fd >= 0);
    ASSERT((size_t)write(fd, text, len) == len);
    close(fd);
    struct fsdp_resnet_config c = config(FSDP_RESNET34, 2, 2, FSDP_RESNET_STEM_CIFAR, 2), c0 = c;
    enum fsdp_status st = fsdp_resnet_config_load(ctx, path, &c);
    if (st == FSDP_OK) TEST_FAILF("%s: accepted", text);
    const char *msg = fsdp_errmsg(ctx);
    if (!strstr(msg, path) || !strstr(msg, needle)) TEST_FAILF("%s: message '%s' lacks the file or '%s'", text, msg, needle);
    if (strchr(msg, '\n')) TEST_FAILF("%s: message '%s' is not one line", text, msg);
    CHECK(memcmp(&c, &c0, sizeof c) == 0); /* untouched */
    unlink(path);
}

static void check_bad_file(struct fsdp_ctx *ctx, const char *text, const char *needle) {
    check_bad_bytes(ctx, text, strlen(text), needle);
}

TEST(resnet_config_load_and_bad_configs) {
    struct fsdp_ctx *ctx = make_ctx();
    char path[] = "/tmp/fsdp_resnet_cfg_XXXXXX";
    int fd = mkstemp(path);
    ASSERT(fd >= 0);
    const char *good = "{\"arch\": \"resnet50\", \"in_chans\": 1, \"num_classes\": 10, \"stem\": \"cifar\", "
                       "\"width\": 16, \"zero_init_residual\": true}";
    ASSERT((size_t)write(fd, good, strlen(good)) == strlen(good));
    close(fd);
    struct fsdp_resnet_config c;
    ASSERT_OK(fsdp_resnet_config_load(ctx, path, &c), ctx);
    CHECK_INT_EQ(c.arch, FSDP_RESNET50);
    CHECK_INT_EQ(c.in_chans, 1);
    CHECK_INT_EQ(c.num_classes, 10);
    CHECK_INT_EQ(c.stem, FSDP_RESNET_STEM_CIFAR);
    CHECK_INT_EQ(c.width, 16);
    CHECK_INT_EQ(c.zero_init_residual, 1);
    unlink(path);
    strcpy(path, "/tmp/fsdp_resnet_cfg_XXXXXX");
    fd = mkstemp(path);
    ASSERT(fd >= 0);
    ASSERT(write(fd, "{\"arch\": \"resnet34\"}", 20) == 20);
    close(fd);
    ASSERT_OK(fsdp_resnet_config_load(ctx, path, &c), ctx); /* defaults: torchvision's */
    CHECK_INT_EQ(c.arch, FSDP_RESNET34);
    CHECK_INT_EQ(c.in_chans, 3);
    CHECK_INT_EQ(c.num_classes, 1000);
    CHECK_INT_EQ(c.stem, FSDP_RESNET_STEM_IMAGENET);
    CHECK_INT_EQ(c.width, 64);
    CHECK_INT_EQ(c.zero_init_residual, 0);
    unlink(path);
    check_bad_file(ctx, "{\"arch\": \"resnet101\"}", "arch");
    check_bad_file(ctx, "{\"arch\": 18}", "arch");
    check_bad_file(ctx, "{\"in_chans\": 1}", "arch");
    check_bad_file(ctx, "{\"arch\": \"resnet18\", \"stem\": \"tiny\"}", "stem");
    check_bad_file(ctx, "{\"arch\": \"resnet18\", \"in_chans\": 0}", "in_chans");
    check_bad_file(ctx, "{\"arch\": \"resnet18\", \"in_chans\": 65}", "in_chans");
    check_bad_file(ctx, "{\"arch\": \"resnet18\", \"in_chans\": \"3\"}", "in_chans");
    check_bad_file(ctx, "{\"arch\": \"resnet18\", \"num_classes\": -1}", "num_classes");
    check_bad_file(ctx, "{\"arch\": \"resnet18\", \"num_classes\": 1.5}", "num_classes");
    check_bad_file(ctx, "{\"arch\": \"resnet18\", \"width\": 0}", "width");
    check_bad_file(ctx, "{\"arch\": \"resnet18\", \"width\": 4096}", "width");
    check_bad_file(ctx, "{\"arch\": \"resnet18\", \"zero_init_residual\": 1}", "zero_init_residual");
    check_bad_file(ctx, "{\"arch\": \"resnet18\", \"depth\": 18}", "depth");
    check_bad_file(ctx, "{\"arch\": \"resnet18\", \"arch\": \"resnet18\"}", "twice");
    check_bad_file(ctx, "{\"arch\": \"resnet18\",", "JSON");
    check_bad_file(ctx, "[1]", "object");
    /* nothing but white space after the object: cJSON alone stops at its end or at a NUL */
    check_bad_file(ctx, "{\"arch\": \"resnet18\"} junk", "bytes after the JSON value at byte 21");
    check_bad_file(ctx, "{\"arch\": \"resnet18\"}\n{\"arch\": \"resnet50\"}", "bytes after the JSON value at byte 21");
    check_bad_bytes(ctx, "{\"arch\": \"resnet18\"}\n\0", 22, "a NUL byte at byte 21");
    check_bad_bytes(ctx, "{\"arch\": \"resnet18\"}\0\1", 22, "a NUL byte at byte 20");
    CHECK_INT_EQ(fsdp_resnet_config_load(ctx, "/nonexistent/resnet.json", &c), FSDP_ERR_IO);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "/nonexistent/resnet.json");
    /* the validator and the constructor name the field */
    struct fsdp_resnet_config bad = config((enum fsdp_resnet_arch)7, 1, 10, FSDP_RESNET_STEM_IMAGENET, 64);
    struct fsdp_module *m = NULL;
    CHECK_INT_EQ(fsdp_resnet_create(ctx, &bad, &m), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "arch");
    CHECK(m == NULL);
    bad = config(FSDP_RESNET18, 1, -1, FSDP_RESNET_STEM_IMAGENET, 64);
    CHECK_INT_EQ(fsdp_resnet_config_validate(ctx, &bad), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "num_classes");
    bad = config(FSDP_RESNET18, 1, 10, (enum fsdp_resnet_stem)2, 64);
    CHECK_INT_EQ(fsdp_resnet_config_validate(ctx, &bad), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "stem");
    CHECK_INT_EQ(fsdp_resnet_config_preset("resnet101", &c), FSDP_ERR_INVALID);
    CHECK_STR_EQ(fsdp_resnet_arch_name((enum fsdp_resnet_arch)9), "?");
    fsdp_ctx_free(ctx);
}

TEST_MAIN()
