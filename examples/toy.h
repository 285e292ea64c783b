/*
 * toy.h - small user-defined layers for the examples, written against the
 * public API only (include/fsdp.h): nothing here comes from src/nn. Each
 * layer is a struct fsdp_module_ops with forward/backward over fp32 rows
 * (Linear's products through fsdp_gemm, errors named with fsdp_error);
 * composite modules call their children through fsdp_module_forward /
 * fsdp_module_backward so that the sharding hooks run.
 *
 *   Linear  (..., in) -> (..., out), weight (out, in), bias (out)
 *   Embed   ids (B, T) I32 -> (B, T, dim), weight (num, dim)
 *   Tanh    elementwise
 *   Seq     runs its children in order (the model root of both examples)
 *
 * Parameter values exist only while their unit is gathered: read p->data at
 * the start of every forward and backward, never keep it.
 */
#ifndef EXAMPLES_TOY_H
#define EXAMPLES_TOY_H

#include "fsdp.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int64_t toy_rows(const struct fsdp_tensor *t) {
    return fsdp_tensor_numel(t) / t->shape[t->ndim - 1];
}

/* Shapes `out` like `in` with last dimension `last`, allocating from the arena if needed. */
static enum fsdp_status toy_prepare(struct fsdp_ctx *ctx, struct fsdp_tensor *out, const struct fsdp_tensor *in,
                                    int64_t last) {
    out->dtype = FSDP_F32;
    out->ndim = in->ndim;
    memcpy(out->shape, in->shape, sizeof out->shape);
    out->shape[out->ndim - 1] = last;
    if (!out->data) out->data = fsdp_arena_alloc(ctx, (size_t)fsdp_tensor_numel(out) * sizeof(float));
    return out->data ? FSDP_OK : FSDP_ERR_NOMEM;
}

/* ---- Linear ---- */

struct toy_linear {
    int64_t in, out;
    struct fsdp_param *w, *b;
    struct fsdp_tensor x; /* saved input (arena) */
};

/* y = x W^T + b: the product through fsdp_gemm, which runs it in the
 * module's compute dtype (bf16 under mixed precision) as the built-in Linear
 * does. */
static enum fsdp_status linear_forward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *in,
                                       struct fsdp_tensor *out) {
    struct toy_linear *L = m->impl;
    if (in->dtype != FSDP_F32 || in->shape[in->ndim - 1] != L->in)
        return fsdp_error(ctx, FSDP_ERR_INVALID, "ToyLinear '%s': input %s with last dimension %lld, expected F32 "
                          "with %lld", m->fqn, fsdp_dtype_name(in->dtype), (long long)in->shape[in->ndim - 1],
                          (long long)L->in);
    if (!L->w->data) return fsdp_error(ctx, FSDP_ERR_STATE, "ToyLinear '%s': weight not gathered", m->fqn);
    if (toy_prepare(ctx, out, in, L->out) != FSDP_OK) return FSDP_ERR_NOMEM;
    const float *x = in->data, *w = L->w->data, *b = L->b->data;
    float *y = out->data;
    int64_t R = toy_rows(in);
    for (int64_t r = 0; r < R; r++) memcpy(y + r * L->out, b, (size_t)L->out * sizeof(float));
    L->x = *in;
    return fsdp_gemm(ctx, m, 0, 1, R, L->out, L->in, 1.0f, x, L->in, w, L->in, 1.0f, y, L->out);
}

static enum fsdp_status linear_backward(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                        const struct fsdp_tensor *dout, struct fsdp_tensor *din) {
    struct toy_linear *L = m->impl;
    if (!L->w->grad || !L->x.data) return fsdp_error(ctx, FSDP_ERR_STATE, "ToyLinear '%s': backward without forward",
                                                     m->fqn);
    const float *x = L->x.data, *w = L->w->data, *dy = dout->data;
    float *dw = L->w->grad, *db = L->b->grad;
    int64_t R = toy_rows(dout);
    for (int64_t r = 0; r < R; r++)
        for (int64_t o = 0; o < L->out; o++) db[o] += dy[r * L->out + o];
    /* dW (out, in) += dy^T x */
    enum fsdp_status st = fsdp_gemm(ctx, m, 1, 0, L->out, L->in, R, 1.0f, dy, L->out, x, L->in, 1.0f, dw, L->in);
    if (st != FSDP_OK || !din) return st;
    if (toy_prepare(ctx, din, dout, L->in) != FSDP_OK) return FSDP_ERR_NOMEM;
    /* dx (R, in) = dy W */
    return fsdp_gemm(ctx, m, 0, 0, R, L->in, L->out, 1.0f, dy, L->out, w, L->in, 0.0f, din->data, L->in);
}

static void toy_free_impl(struct fsdp_module *m) { free(m->impl); }

static const struct fsdp_module_ops toy_linear_ops = {"ToyLinear", linear_forward, linear_backward, toy_free_impl};

static struct fsdp_module *toy_linear(struct fsdp_ctx *ctx, struct fsdp_module *parent, const char *name,
                                      int64_t in, int64_t out, float std) {
    struct fsdp_module *m;
    if (fsdp_module_create(ctx, &toy_linear_ops, name, &m) != FSDP_OK) return NULL;
    struct toy_linear *L = calloc(1, sizeof *L);
    m->impl = L;
    L->in = in;
    L->out = out;
    int64_t ws[2] = {out, in}, bs[1] = {out};
    struct fsdp_init wi = {FSDP_INIT_NORMAL, std}, bi = {FSDP_INIT_ZEROS, 0};
    fsdp_module_add_param(ctx, m, "weight", 2, ws, wi, 0, &L->w);
    fsdp_module_add_param(ctx, m, "bias", 1, bs, bi, 1, &L->b);
    if (parent) fsdp_module_add_child(ctx, parent, m);
    return m;
}

/* ---- Embedding ---- */

struct toy_embed {
    int64_t num, dim;
    struct fsdp_param *w;
    struct fsdp_tensor ids;
};

static enum fsdp_status embed_forward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *in,
                                      struct fsdp_tensor *out) {
    struct toy_embed *E = m->impl;
    if (in->dtype != FSDP_I32)
        return fsdp_error(ctx, FSDP_ERR_INVALID, "ToyEmbed '%s': input dtype %s, expected I32", m->fqn,
                          fsdp_dtype_name(in->dtype));
    if (!E->w->data) return fsdp_error(ctx, FSDP_ERR_STATE, "ToyEmbed '%s': weight not gathered", m->fqn);
    struct fsdp_tensor shape = *in;
    shape.ndim = in->ndim + 1;
    shape.shape[in->ndim] = 1;
    if (toy_prepare(ctx, out, &shape, E->dim) != FSDP_OK) return FSDP_ERR_NOMEM;
    const int32_t *ids = in->data;
    for (int64_t t = 0; t < fsdp_tensor_numel(in); t++) {
        if (ids[t] < 0 || ids[t] >= E->num)
            return fsdp_error(ctx, FSDP_ERR_INVALID, "ToyEmbed '%s': id %d outside [0, %lld)", m->fqn, (int)ids[t],
                              (long long)E->num);
        memcpy((float *)out->data + t * E->dim, E->w->data + ids[t] * E->dim, (size_t)E->dim * sizeof(float));
    }
    E->ids = *in;
    return FSDP_OK;
}

static enum fsdp_status embed_backward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *dout,
                                       struct fsdp_tensor *din) {
    (void)ctx;
    (void)din;
    struct toy_embed *E = m->impl;
    const int32_t *ids = E->ids.data;
    const float *dy = dout->data;
    for (int64_t t = 0; t < fsdp_tensor_numel(&E->ids); t++)
        for (int64_t d = 0; d < E->dim; d++) E->w->grad[ids[t] * E->dim + d] += dy[t * E->dim + d];
    return FSDP_OK;
}

static const struct fsdp_module_ops toy_embed_ops = {"ToyEmbed", embed_forward, embed_backward, toy_free_impl};

static struct fsdp_module *toy_embed(struct fsdp_ctx *ctx, struct fsdp_module *parent, const char *name, int64_t num,
                                     int64_t dim) {
    struct fsdp_module *m;
    if (fsdp_module_create(ctx, &toy_embed_ops, name, &m) != FSDP_OK) return NULL;
    struct toy_embed *E = calloc(1, sizeof *E);
    m->impl = E;
    E->num = num;
    E->dim = dim;
    int64_t s[2] = {num, dim};
    struct fsdp_init wi = {FSDP_INIT_NORMAL, 0.1f};
    fsdp_module_add_param(ctx, m, "weight", 2, s, wi, 1, &E->w);
    if (parent) fsdp_module_add_child(ctx, parent, m);
    return m;
}

/* ---- Tanh ---- */

struct toy_tanh {
    struct fsdp_tensor y;
};

static enum fsdp_status tanh_forward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *in,
                                     struct fsdp_tensor *out) {
    struct toy_tanh *A = m->impl;
    if (toy_prepare(ctx, out, in, in->shape[in->ndim - 1]) != FSDP_OK) return FSDP_ERR_NOMEM;
    for (int64_t i = 0; i < fsdp_tensor_numel(in); i++)
        ((float *)out->data)[i] = tanhf(((const float *)in->data)[i]);
    A->y = *out;
    return FSDP_OK;
}

static enum fsdp_status tanh_backward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *dout,
                                      struct fsdp_tensor *din) {
    struct toy_tanh *A = m->impl;
    if (!din) return FSDP_OK;
    if (toy_prepare(ctx, din, dout, dout->shape[dout->ndim - 1]) != FSDP_OK) return FSDP_ERR_NOMEM;
    const float *y = A->y.data, *dy = dout->data;
    for (int64_t i = 0; i < fsdp_tensor_numel(dout); i++) ((float *)din->data)[i] = dy[i] * (1.0f - y[i] * y[i]);
    return FSDP_OK;
}

static const struct fsdp_module_ops toy_tanh_ops = {"ToyTanh", tanh_forward, tanh_backward, toy_free_impl};

static struct fsdp_module *toy_tanh(struct fsdp_ctx *ctx, struct fsdp_module *parent, const char *name) {
    struct fsdp_module *m;
    if (fsdp_module_create(ctx, &toy_tanh_ops, name, &m) != FSDP_OK) return NULL;
    m->impl = calloc(1, sizeof(struct toy_tanh));
    if (parent) fsdp_module_add_child(ctx, parent, m);
    return m;
}

/* ---- Seq: children in order ---- */

static enum fsdp_status seq_forward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *in,
                                    struct fsdp_tensor *out) {
    struct fsdp_tensor x = *in;
    for (int i = 0; i < m->n_children; i++) {
        struct fsdp_tensor y = {0};
        if (i == m->n_children - 1) y = *out;
        enum fsdp_status st = fsdp_module_forward(m->children[i], ctx, &x, &y);
        if (st != FSDP_OK) return st;
        x = y;
    }
    *out = x;
    return FSDP_OK;
}

static enum fsdp_status seq_backward(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                     const struct fsdp_tensor *dout, struct fsdp_tensor *din) {
    struct fsdp_tensor g = *dout;
    for (int i = m->n_children - 1; i >= 0; i--) {
        struct fsdp_tensor d = {0};
        struct fsdp_tensor *dp = i > 0 ? &d : din; /* the first child's input gradient is the caller's */
        enum fsdp_status st = fsdp_module_backward(m->children[i], ctx, &g, dp);
        if (st != FSDP_OK) return st;
        g = d;
    }
    return FSDP_OK;
}

static const struct fsdp_module_ops toy_seq_ops = {"ToySeq", seq_forward, seq_backward, NULL};

static struct fsdp_module *toy_seq(struct fsdp_ctx *ctx, struct fsdp_module *parent, const char *name) {
    struct fsdp_module *m;
    if (fsdp_module_create(ctx, &toy_seq_ops, name, &m) != FSDP_OK) return NULL;
    if (parent) fsdp_module_add_child(ctx, parent, m);
    return m;
}

/* ---- Running ---- */

/* Checks st on every rank; ends the job with the message if any failed. */
static void toy_check(struct fsdp_ctx *ctx, enum fsdp_status st, const char *what) {
    int bad = st != FSDP_OK, any = bad;
    fsdp_comm_allreduce(fsdp_ctx_comm(ctx), &bad, &any, 1, FSDP_I32, FSDP_MAX);
    if (!any) return;
    if (bad) fprintf(stderr, "rank %d: %s: %s\n", fsdp_ctx_rank(ctx), what, fsdp_errmsg(ctx));
    fsdp_ctx_abort(ctx, 1);
}

/* A deterministic token stream: (B_global, T) inputs and next-token
 * targets; rank r takes rows [r*B/world, (r+1)*B/world). */
static void toy_batch(int step, int B, int T, int V, int rank, int world, int32_t *in, int32_t *tg) {
    int b0 = rank * B / world, b1 = (rank + 1) * B / world;
    for (int b = b0; b < b1; b++)
        for (int t = 0; t < T; t++) {
            int x = (step * 31 + b * 17 + t * 5) % V;
            in[(b - b0) * T + t] = x;
            tg[(b - b0) * T + t] = (x * 3 + 1) % V;
        }
}

#endif
