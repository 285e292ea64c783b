/*
 * layout.c - the BLOCKED16 activation layout's helpers: which layout the
 * vision models use, and conversions between PLAIN (N, C, H, W) and
 * BLOCKED16 (N, C/16, H, W, 16) ([Note: blocked activations] in conv.c).
 */
#include "nn/nn-impl.h"

enum fsdp_layout fsdp__vision_layout(void) {
    return fsdp__env_checked("FSDP_VISION_LAYOUT", 0) == 1 ? FSDP_LAYOUT_PLAIN : FSDP_LAYOUT_BLOCKED16;
}

void fsdp__relayout(float *dst, enum fsdp_layout dl, const float *src, enum fsdp_layout sl, const int64_t *shape) {
    int64_t N = shape[0], C = shape[1], HW = shape[2] * shape[3];
    if (dl == sl) {
        memcpy(dst, src, (size_t)(N * C * HW) * sizeof(float));
        return;
    }
    int64_t G = C / 16;
    int to_blocked = dl == FSDP_LAYOUT_BLOCKED16;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t g = 0; g < G; g++) {
            float *b = (float *)(to_blocked ? dst : src) + (n * G + g) * HW * 16; /* the block's plane */
            float *p = (float *)(to_blocked ? src : dst) + (n * C + g * 16) * HW;  /* its 16 channels' planes */
            for (int64_t i = 0; i < HW; i++)
                for (int l = 0; l < 16; l++) {
                    if (to_blocked) b[i * 16 + l] = p[l * HW + i];
                    else p[l * HW + i] = b[i * 16 + l];
                }
        }
}

enum fsdp_status fsdp__as_layout(struct fsdp_ctx *ctx, const struct fsdp_tensor *t, enum fsdp_layout l,
                                 struct fsdp_tensor *out, const char *what) {
    *out = *t;
    if (t->layout == l) return FSDP_OK;
    out->data = fsdp__scratch(ctx, fsdp_tensor_numel(t), what);
    if (!out->data) return FSDP_ERR_NOMEM;
    fsdp__relayout(out->data, l, t->data, t->layout, t->shape);
    out->layout = l;
    return FSDP_OK;
}

static const char *layout_name(enum fsdp_layout l) { return l == FSDP_LAYOUT_BLOCKED16 ? "BLOCKED16" : "PLAIN"; }

enum fsdp_status fsdp__check_grad_layout(struct fsdp_ctx *ctx, const struct fsdp_module *m,
                                         const struct fsdp_tensor *g, enum fsdp_layout want) {
    if (g->layout == want) return FSDP_OK;
    return fsdp__err(ctx, FSDP_ERR_INVALID, "%s '%s': gradient in the %s layout, the output was %s", m->ops->type,
                     fsdp__mname(m), layout_name(g->layout), layout_name(want));
}
