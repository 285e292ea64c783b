/*
 * loss.c - the loss of a sharded model's output (fsdp_model_loss, the
 * losses themselves in src/nn/loss.c) and the agreement on its status across
 * the ranks before backward's collectives ([Note: agreed loss check]): a
 * check that fails on one rank fails every rank, naming it, instead of
 * leaving the others in a collective it never enters.
 */
#include "fsdp/fsdp-impl.h"
#include "nn/nn-impl.h"

#include <string.h>

/* [Note: agreed loss check]
 * A class id outside [0, C) fails the loss check only on the ranks whose
 * targets hold it. With `ignore` at world > 1 the loss's mean is over the
 * global micro-batch's rows, counted by an all-reduce that every rank must
 * enter: so a rank whose check failed enters it too, a flag added to its row
 * count, and every rank fails, naming the first failing rank (which keeps
 * its own message, naming the row); an early return there would leave the
 * others waiting in the all-reduce. The composed step agrees on its loss's
 * status the same way before backward's collectives (fsdp__loss_agree). */

/* *first = the lowest rank whose st failed, or the world size if none.
 * COLLECTIVE: yes. */
static enum fsdp_status first_failed(struct fsdp_ctx *ctx, enum fsdp_status st, int32_t *first) {
    int32_t me = st != FSDP_OK ? ctx->rank : ctx->world;
    *first = me;
    enum fsdp_status cs = fsdp_comm_allreduce(ctx->comm, &me, first, 1, FSDP_I32, FSDP_MIN);
    /* a rank outside [0, world], or a failure named on a rank that did not fail, is no answer to this
     * all-reduce: the peers met it from another collective (their schedule went another way) */
    if (cs == FSDP_OK && (*first < 0 || *first > ctx->world || (*first == ctx->rank && st == FSDP_OK)))
        return fsdp__err(ctx, FSDP_ERR_COMM, "the ranks' collectives diverged: the agreement on the loss met another "
                         "collective of the peers (got %d; fsdp_comm_set_check names both sides)", (int)*first);
    return cs;
}

/* With `ignore` at world > 1: *all = the row count over the ranks, or an
 * error on every rank if check_st failed on any. COLLECTIVE: yes. */
static enum fsdp_status loss_count_agree(struct fsdp_ctx *ctx, enum fsdp_status check_st, int64_t count,
                                         int64_t *all) {
    int64_t mine[2] = {check_st == FSDP_OK ? count : 0, check_st != FSDP_OK}, sum[2] = {0, 0};
    enum fsdp_status st = fsdp_comm_allreduce(ctx->comm, mine, sum, 2, FSDP_I64, FSDP_SUM);
    if (st != FSDP_OK) return check_st != FSDP_OK ? check_st : st;
    if (!sum[1]) {
        *all = sum[0];
        return check_st; /* FSDP_OK: its failure would have been counted */
    }
    int32_t first;
    st = first_failed(ctx, check_st, &first); /* every rank takes this branch */
    if (check_st != FSDP_OK) return check_st;
    if (st != FSDP_OK) return st;
    return fsdp__err(ctx, FSDP_ERR_INVALID, "cross-entropy: the loss's check failed on rank %d (%lld of %d ranks; "
                     "its error says why): no rank has a loss, the mean over the rows not ignored needs them all",
                     first, (long long)sum[1], ctx->world);
}

enum fsdp_status fsdp_model_loss(struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct fsdp_loss *loss,
                                 const struct fsdp_tensor *out, const struct fsdp_tensor *target, int accum,
                                 double *value, struct fsdp_tensor *dout) {
    static const struct fsdp_loss ce = {0};
    if (!loss) loss = &ce;
    if (accum < 1) return fsdp__err(ctx, FSDP_ERR_INVALID, "loss: accum %d must be >= 1", accum);
    int64_t count = 0, all = 0;
    enum fsdp_status check_st = fsdp__loss_check(ctx, loss, out, target, &count);
    /* rows left after the ignored ones differ across ranks: the mean is the global batch's */
    int count_all = loss->kind == FSDP_LOSS_CROSS_ENTROPY && loss->ignore && ctx->world > 1;
    if (count_all) FSDP_TRY(loss_count_agree(ctx, check_st, count, &all)); /* [Note: agreed loss check] */
    else FSDP_TRY(check_st);
    double t0 = fsdp__now();
    float scale = (fm->step.fwd_pending ? fm->step.loss_scale : fsdp__scaler_scale(fm)) / (float)accum;
    int64_t C = out->shape[out->ndim - 1], N = fsdp_tensor_numel(out) / C;
    if (out->dtype != FSDP_F32) { /* the train step's 16-bit output (plain cross-entropy, checked) */
        if (dout && dout->data && dout->data != out->data)
            return fsdp__err(ctx, FSDP_ERR_INVALID, "loss: the gradient of a 16-bit model output is written over "
                             "the output (dout->data == out->data) or nowhere");
        if (dout) *dout = *out; /* its dtype and row layout: [Note: 16-bit model output] */
    } else if (dout) {
        if (!dout->data && !(dout->data = fsdp_arena_alloc(ctx, (size_t)(N * C) * sizeof(float))))
            return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory for the loss gradient in the arena");
        dout->dtype = FSDP_F32;
        dout->layout = FSDP_LAYOUT_PLAIN;
        dout->ndim = out->ndim;
        memcpy(dout->shape, out->shape, sizeof dout->shape);
    }
    void *d = dout ? dout->data : NULL;
    double v;
    if (loss->kind == FSDP_LOSS_CROSS_ENTROPY && loss->label_smoothing == 0.0f && !loss->ignore) {
        float l = 0.0f; /* the GPT's loss, unchanged */
        FSDP_TRY(fsdp__cross_entropy_rows(ctx, out->dtype, out->data, fsdp__row_stride(out), target->data, N, C,
                                          scale, &l, d));
        v = (double)l;
    } else if (loss->kind == FSDP_LOSS_USER) {
        struct fsdp_tensor g = dout ? *dout : (struct fsdp_tensor){0};
        if (!dout) {
            g = *out;
            g.data = fsdp_arena_alloc(ctx, (size_t)(N * C) * sizeof(float));
            if (!g.data) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory for the loss gradient in the arena");
        }
        ctx->errmsg[0] = '\0';
        enum fsdp_status st = loss->fn(ctx, out, target, loss->ud, &v, &g);
        if (st != FSDP_OK) {
            if (!ctx->errmsg[0]) fsdp__err(ctx, st, "user loss failed: %s", fsdp_status_str(st));
            return st;
        }
        if (scale != 1.0f)
            for (int64_t i = 0; i < N * C; i++) ((float *)g.data)[i] *= scale;
    } else {
        double world = count_all ? (double)ctx->world : 1.0, n = (double)(count_all ? all : count);
        double sum;
        float g = n > 0 ? (float)(world * (double)scale / n) : 0.0f;
        fsdp__loss_builtin(loss, out, target, g, &sum, d);
        v = n > 0 ? sum * world / n : 0.0;
    }
    if (fm->step.fwd_pending) fm->step.loss += (float)v / (float)accum; /* not an eval forward's */
    if (value) *value = v;
    fm->step.fwd_s += fsdp__now() - t0;
    return FSDP_OK;
}

enum fsdp_status fsdp__status_agree(struct fsdp_ctx *ctx, enum fsdp_status st, const char *what) {
    int32_t first;
    enum fsdp_status cs = first_failed(ctx, st, &first);
    if (st != FSDP_OK) return st;
    if (cs != FSDP_OK) return cs;
    if (first < ctx->world)
        return fsdp__err(ctx, FSDP_ERR_STATE, "%s: refused on rank %d (its error says why), so on every rank", what,
                         first);
    return FSDP_OK;
}

/* The composed step's loss status over the ranks, before backward's
 * collectives: a target id out of range fails the loss on the ranks holding
 * it only ([Note: agreed loss check]). COLLECTIVE: yes. */
enum fsdp_status fsdp__loss_agree(struct fsdp_ctx *ctx, enum fsdp_status loss_st, int k) {
    int32_t first;
    enum fsdp_status st = first_failed(ctx, loss_st, &first);
    if (loss_st != FSDP_OK) return loss_st;
    if (st != FSDP_OK) return st;
    if (first < ctx->world)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "train_step: the loss of micro-batch %d failed on rank %d (its error "
                         "says why, e.g. a target id outside the vocabulary)", k, first);
    return FSDP_OK;
}

