/*
 * vision_helpers.h - what the vision layer tests share (test_nn_vision.c,
 * test_nn_batchnorm.c, test_nn_vision_lp.c): tie-free inputs
 * (make_distinct; make_input and prepare, finalize + materialize + random
 * weights, are nn_helpers.h's) and a Conv2d with every option (conv_with).
 * Include after fsdp.h, harness.h and nn_helpers.h (and plist.h, for the
 * files that list a module's parameters).
 */
#ifndef FSDP_TEST_VISION_HELPERS_H
#define FSDP_TEST_VISION_HELPERS_H

#include <stdlib.h>
#include <string.h>

/* values spaced `gap` apart in random order (max pooling: no ties, no near-ties) */
static inline struct fsdp_tensor make_distinct(int ndim, const int64_t *shape, float gap) {
    struct fsdp_tensor t = make_input(ndim, shape, 0.0f, 0.0f);
    int64_t n = fsdp_tensor_numel(&t);
    float *x = t.data;
    for (int64_t i = 0; i < n; i++) x[i] = gap * (float)(i - n / 2);
    for (int64_t i = n - 1; i > 0; i--) {
        int64_t j = irand(i + 1);
        float v = x[i];
        x[i] = x[j];
        x[j] = v;
    }
    return t;
}

static inline struct fsdp_module *conv_with(struct fsdp_ctx *ctx, const char *name, int64_t in, int64_t out, int kh, int kw,
                                     int sh, int sw, int ph, int pw, int dil, int groups, int bias) {
    struct fsdp_conv2d_opts o = fsdp_conv2d_opts_default(in, out, kh);
    o.kernel[1] = kw;
    o.stride[0] = sh, o.stride[1] = sw;
    o.padding[0] = ph, o.padding[1] = pw;
    o.dilation[0] = o.dilation[1] = dil;
    o.groups = groups;
    o.bias = bias;
    struct fsdp_module *m = NULL;
    if (fsdp_conv2d_create(ctx, name, &o, &m) != FSDP_OK) {
        TEST_FAILF("conv create: %s", fsdp_errmsg(ctx));
        return NULL;
    }
    return m;
}

#endif
