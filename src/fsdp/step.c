/*
 * step.c - the training step over a sharded model: forward through the
 * unit hooks, the loss, backward (reduce-scatter per unit), the global
 * gradient norm, clipping and the optimizer update on local shards; plus the
 * global norms and per-parameter reads that gather one unit at a time.
 * Invariant: between steps every unit is SHARDED and IDLE, and no full
 * buffer is in use.
 */
#include "fsdp/fsdp-impl.h"
#include "optim/optim-impl.h"

#include <math.h>
#include <string.h>

/* ---- Optimizer binding ---- */

/* The optimizer's registered group names resolved to parameters. */
struct group_map {
    int n;
    struct fsdp_param **p; /* (n) the parameter each name resolves to (ties followed) */
    int *group;            /* (n) */
};

static int group_of_param(const struct group_map *gm, const struct fsdp_param *p) {
    for (int i = 0; i < gm->n; i++)
        if (gm->p[i] == p) return gm->group[i];
    return 0;
}

/* Resolves every group name of opt in fm; a name matching no parameter, or
 * two names of different groups meeting at one parameter, is an error. */
static enum fsdp_status map_groups(struct fsdp_ctx *ctx, struct fsdp_model *fm, struct fsdp_optim *opt,
                                   struct group_map *gm) {
    int total = 0;
    for (int g = 1; g <= fsdp_optim_n_groups(opt); g++)
        for (int i = 0; fsdp__optim_group_name(opt, g, i); i++) total++;
    gm->n = 0;
    gm->p = calloc((size_t)total + 1, sizeof *gm->p);
    gm->group = calloc((size_t)total + 1, sizeof *gm->group);
    if (!gm->p || !gm->group) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory matching optimizer groups");
    for (int g = 1; g <= fsdp_optim_n_groups(opt); g++) {
        const char *name;
        for (int i = 0; (name = fsdp__optim_group_name(opt, g, i)); i++) {
            struct fsdp_param *p = fsdp_module_find_param(fm->root, name);
            if (!p)
                return fsdp__err(ctx, FSDP_ERR_INVALID,
                                 "optimizer group %d names parameter '%s', which the model does not have", g,
                                 name);
            while (p->tied_to) p = p->tied_to;
            int prev = group_of_param(gm, p);
            if (prev && prev != g)
                return fsdp__err(ctx, FSDP_ERR_INVALID,
                                 "optimizer groups %d and %d both hold parameter '%s' (named '%s' in group %d)",
                                 prev, g, p->fqn, name, g);
            gm->p[gm->n] = p;
            gm->group[gm->n++] = g;
        }
    }
    return FSDP_OK;
}

/* Cuts the shard [rank*S, (rank+1)*S) into runs of one parameter each. */
static enum fsdp_status build_slices(struct fsdp_ctx *ctx, struct fsdp__unit *u, int decay_all,
                                     const struct group_map *gm) {
    free(u->slices);
    u->slices = calloc((size_t)u->n_params + 1, sizeof *u->slices);
    if (!u->slices) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory for optimizer slices");
    u->n_slices = 0;
    int64_t lo = (int64_t)u->model->shard_rank * u->numel_shard, hi = lo + u->numel_shard;
    for (int j = 0; j < u->n_params; j++) {
        int64_t a = u->offsets[j], b = a + u->params[j]->numel;
        int64_t s = a > lo ? a : lo, e = b < hi ? b : hi;
        if (s >= e) continue;
        struct fsdp_optim_slice *sl = &u->slices[u->n_slices++];
        sl->param = u->shard + (s - lo);
        sl->grad = u->grad_shard + (s - lo);
        sl->state = u->state ? u->state + (s - lo) : NULL;
        sl->n = e - s;
        sl->state_stride = u->numel_shard;
        sl->param_lp = u->shard_lp ? u->shard_lp + (s - lo) : NULL; /* [Note: fused 16-bit copy] */
        sl->lp_dtype = u->param_dtype;
        int g = group_of_param(gm, u->params[j]);
        sl->decay = g > 0 ? 1 + g : decay_all || !u->params[j]->no_decay;
    }
    return FSDP_OK;
}

enum fsdp_status fsdp_model_attach_optim(struct fsdp_ctx *ctx, struct fsdp_model *fm,
                                         struct fsdp_optim *opt) {
    int k = fsdp_optim_state_per_elem(opt);
    struct group_map gm = {0};
    enum fsdp_status st = map_groups(ctx, fm, opt, &gm);
    for (int i = 0; i < fm->n_units && st == FSDP_OK; i++) {
        st = fsdp__unit_alloc_shards(ctx, &fm->units[i], k);
        if (st == FSDP_OK) st = build_slices(ctx, &fm->units[i], fsdp__optim_decay_all(opt), &gm);
    }
    free(gm.p);
    free(gm.group);
    if (st == FSDP_OK) fm->optim = opt;
    return st;
}

/* ---- Norms ---- */

/* Sums the shard group's partial sums `local`: gathered as raw doubles and
 * added in rank order, so every rank gets the same bits; replicas hold the
 * same shards, so each element counts once ([Note: sharding strategies]). */
static enum fsdp_status group_total(struct fsdp_ctx *ctx, struct fsdp_model *fm, double local, double *out) {
    double *all = calloc((size_t)fm->shard_size, sizeof(double));
    if (!all) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory for the norm");
    all[0] = local;
    enum fsdp_status st = fm->shard_comm ? fsdp_comm_allgather(fm->shard_comm, &local, all, sizeof(double), FSDP_U8)
                                         : FSDP_OK;
    double total = 0.0;
    for (int r = 0; st == FSDP_OK && r < fm->shard_size; r++) total += all[r];
    free(all);
    *out = total;
    return st;
}

enum fsdp_status fsdp_model_grad_norm(struct fsdp_ctx *ctx, struct fsdp_model *fm, double *out) {
    FSDP_TRY(fsdp__model_finish_reduce(ctx, fm)); /* as in read_full */
    double local = 0.0;
    for (int i = 0; i < fm->n_units; i++) {
        const struct fsdp__unit *u = &fm->units[i];
        const float *x = u->grad_shard;
        double s = 0.0;
        /* simd: independent partial sums per lane (a single chain of double
         * adds is latency-bound at about a third of memory speed); the
         * grouping depends only on the team size, so a run repeats its bits */
#pragma omp parallel for simd reduction(+ : s) schedule(static)
        for (int64_t j = 0; j < u->numel_shard; j++) s += (double)x[j] * (double)x[j];
        local += s;
    }
    double s;
    FSDP_TRY(group_total(ctx, fm, local, &s));
    *out = sqrt(s);
    return FSDP_OK;
}

/* This rank's sum of squares of its parameters: per parameter run of each
 * shard in order (the optimizer slices' runs), fsdp__sumsq of each, which
 * is what the optimizer's fused sums give after an update
 * (optim_step_all): a skipped step reports the bits the applied one did. */
static double param_sumsq_local(const struct fsdp_model *fm) {
    double local = 0.0;
    for (int i = 0; i < fm->n_units; i++) {
        const struct fsdp__unit *u = &fm->units[i];
        int64_t lo = (int64_t)fm->shard_rank * u->numel_shard, hi = lo + u->numel_shard;
        for (int j = 0; j < u->n_params; j++) {
            int64_t a = u->offsets[j], b = a + u->params[j]->numel;
            int64_t s = a > lo ? a : lo, e = b < hi ? b : hi;
            if (s < e) local += fsdp__sumsq(u->shard + (s - lo), e - s);
        }
    }
    return local;
}

enum fsdp_status fsdp_model_param_norm(struct fsdp_ctx *ctx, struct fsdp_model *fm, double *out) {
    double s;
    FSDP_TRY(group_total(ctx, fm, param_sumsq_local(fm), &s));
    *out = sqrt(s);
    return FSDP_OK;
}

/* ---- Steps ---- */

/* Applies the optimizer to every unit's slices as one step. */
/* The optimizer over every unit's slices; *sumsq gets this rank's sum of
 * squares of the updated parameters, slice by slice in order (the same bits
 * as param_sumsq_local, see [Note: fused 16-bit copy] in optim.c). */
static enum fsdp_status optim_step_all(struct fsdp_model *fm, float lr, float grad_scale, double *sumsq) {
    int n = 0;
    for (int i = 0; i < fm->n_units; i++) n += fm->units[i].n_slices;
    struct fsdp_optim_slice *all = calloc((size_t)n + 1, sizeof *all);
    double *sums = calloc((size_t)n + 1, sizeof *sums);
    if (!all || !sums) {
        free(all);
        free(sums);
        return fsdp__err(fm->ctx, FSDP_ERR_NOMEM, "out of memory for the optimizer step");
    }
    n = 0;
    for (int i = 0; i < fm->n_units; i++) {
        memcpy(all + n, fm->units[i].slices, (size_t)fm->units[i].n_slices * sizeof *all);
        n += fm->units[i].n_slices;
    }
    for (int j = 0; j < n; j++) all[j].sumsq = &sums[j];
    fsdp_optim_step(fm->optim, all, n, lr, grad_scale);
    *sumsq = 0.0;
    for (int j = 0; j < n; j++) *sumsq += sums[j];
    free(all);
    free(sums);
    /* the slices cover every parameter element; the padding stays 0 in both */
    for (int i = 0; i < fm->n_units; i++) fm->units[i].shard_lp_valid = fm->units[i].shard_lp != NULL;
    return FSDP_OK;
}

static enum fsdp_status check_idle(struct fsdp_ctx *ctx, struct fsdp_model *fm) {
    if (fm->summon_active)
        return fsdp__err(ctx, FSDP_ERR_STATE,
                         "the model runs while its parameters are summoned: call fsdp_summon_end first");
    for (int i = 0; i < fm->n_units; i++)
        if (fm->units[i].state_ == UNIT_ERROR)
            return fsdp__err(ctx, FSDP_ERR_STATE, "unit '%s' is in the error state after a failed collective",
                             fm->units[i].module->fqn);
    return FSDP_OK;
}

static enum fsdp_status run_forward(struct fsdp_ctx *ctx, struct fsdp_model *fm, const int32_t *inputs,
                                    int B, int T, struct fsdp_tensor *logits) {
    FSDP_TRY(check_idle(ctx, fm));
    if (B <= 0 || T <= 0)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "batch shape (%d, %d) must be positive", B, T);
    fsdp_arena_reset(ctx);
    struct fsdp_tensor tok = {0};
    tok.dtype = FSDP_I32;
    tok.ndim = 2;
    tok.shape[0] = B;
    tok.shape[1] = T;
    tok.data = fsdp_arena_alloc(ctx, (size_t)B * (size_t)T * sizeof(int32_t));
    if (!tok.data) return FSDP_ERR_NOMEM;
    memcpy(tok.data, inputs, (size_t)B * (size_t)T * sizeof(int32_t));
    memset(logits, 0, sizeof *logits);
    fm->in_forward = 1;
    enum fsdp_status st = fsdp_module_forward(fm->root, ctx, &tok, logits);
    fm->in_forward = 0;
    fsdp__model_drop_prefetched(ctx, fm); /* units gathered ahead that never ran */
    if (st != FSDP_OK) fsdp__model_reshard_all(ctx, fm);
    return st;
}

enum fsdp_status fsdp_model_forward(struct fsdp_ctx *ctx, struct fsdp_model *fm, const int32_t *inputs,
                                    int B, int T, float **logits) {
    struct fsdp_tensor out;
    FSDP_TRY(run_forward(ctx, fm, inputs, B, T, &out));
    fsdp__model_reshard_all(ctx, fm); /* no backward follows */
    *logits = out.data;
    return FSDP_OK;
}

/* ---- Non-finite values ---- */

/* Appends unit u's subtree to order[] in the order backward reduces it
 * (children last to first, each before its parent). */
static void backward_order(const struct fsdp_model *fm, int u, int *order, int *n) {
    for (int i = fm->n_units - 1; i > u; i--)
        if (fm->units[i].parent == &fm->units[u]) backward_order(fm, i, order, n);
    order[(*n)++] = u;
}

/* Writes "; first non-finite gradient in unit 'X' (backward order)" naming
 * the first unit, in backward order, whose reduced gradient shard holds inf
 * or nan on any rank (agreed by a MAX all-reduce), or "" if none does.
 * COLLECTIVE: yes. */
static enum fsdp_status first_nonfinite_unit(struct fsdp_ctx *ctx, struct fsdp_model *fm, char *buf,
                                             size_t cap) {
    int n = 0, *order = calloc((size_t)fm->n_units, sizeof *order);
    int32_t *bad = calloc((size_t)fm->n_units, sizeof *bad), *any = calloc((size_t)fm->n_units, sizeof *any);
    enum fsdp_status st = FSDP_OK;
    if (!order || !bad || !any) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory checking gradients");
    if (st == FSDP_OK) {
        backward_order(fm, 0, order, &n);
        for (int k = 0; k < n; k++) {
            const struct fsdp__unit *u = &fm->units[order[k]];
            for (int64_t j = 0; j < u->numel_shard && !bad[k]; j++) bad[k] = !isfinite(u->grad_shard[j]);
        }
        st = fsdp_comm_allreduce(ctx->comm, bad, any, (size_t)n, FSDP_I32, FSDP_MAX);
    }
    buf[0] = '\0';
    for (int k = 0; st == FSDP_OK && k < n; k++)
        if (any[k]) {
            const char *name = fm->units[order[k]].module->fqn;
            snprintf(buf, cap, "; first non-finite gradient in unit '%s' (backward order)",
                     name[0] ? name : "(root)");
            break;
        }
    free(order);
    free(bad);
    free(any);
    return st;
}

void fsdp_model_comm_stats(const struct fsdp_model *fm, struct fsdp_comm_stats *out) {
    const struct fsdp_comm *cs[3] = {fm->ctx->comm, fm->own_shard_comm ? fm->shard_comm : NULL,
                                     fm->own_rep_comm ? fm->rep_comm : NULL};
    memset(out, 0, sizeof *out);
    for (int k = 0; k < 3; k++) {
        if (!cs[k]) continue;
        struct fsdp_comm_stats s;
        fsdp_comm_stats_get(cs[k], &s);
        for (int c = 0; c < FSDP_COLL_COUNT; c++) {
            out->calls[c] += s.calls[c];
            out->bytes[c] += s.bytes[c];
            out->wait_s[c] += s.wait_s[c];
        }
    }
}

/* Seconds blocked in collective waits so far, all communicators. */
static double comm_wait_total(const struct fsdp_model *fm) {
    struct fsdp_comm_stats s;
    fsdp_model_comm_stats(fm, &s);
    double t = 0;
    for (int c = 0; c < FSDP_COLL_COUNT; c++) t += s.wait_s[c];
    return t;
}

/* [Note: gradient accumulation]
 * A step of K micro-batches runs K forward+backward passes. Each
 * micro-batch's loss gradient is scaled by 1/K (the loss is the mean of the
 * K micro-batch means, all of B*T tokens), so the sum of the K gradients is
 * the gradient of the K-times batch. REDUCE_EACH reduces after every
 * backward and adds into the gradient shard (fm->grad_accumulate for k > 0);
 * NO_SYNC sets fm->no_sync for k < K-1, so each unit keeps its full gradient
 * (pooled, one per unit) and the layers add into it, and reduces once in the
 * last backward. A world of one accumulates straight into the shard. */
static enum fsdp_status micro_batches(struct fsdp_ctx *ctx, struct fsdp_model *fm, const int32_t *inputs,
                                      const int32_t *targets, int B, int T, int accum,
                                      enum fsdp_grad_accum mode, float loss_scale, float *local_loss,
                                      double *fwd_s, double *bwd_s) {
    enum fsdp_status st = FSDP_OK;
    *local_loss = 0.0f;
    for (int k = 0; k < accum && st == FSDP_OK; k++) {
        struct fsdp_tensor logits;
        int64_t N = (int64_t)B * T;
        double t0 = fsdp__now();
        fm->no_sync = 0;
        fm->grad_accumulate = 0;
        st = run_forward(ctx, fm, inputs + (size_t)k * (size_t)N, B, T, &logits);
        if (st != FSDP_OK) break;
        int64_t V = logits.shape[logits.ndim - 1];
        float loss = 0.0f;
        st = fsdp_cross_entropy(ctx, logits.data, targets + (size_t)k * (size_t)N, N, V,
                                loss_scale / (float)accum, &loss, logits.data);
        if (st != FSDP_OK) break;
        *local_loss += loss / (float)accum;
        if (k == 0) /* backward writes the shards it reaches; the rest are zeroed after it */
            for (int i = 0; i < fm->n_units; i++) fm->units[i].grad_fresh = 0;
        fm->no_sync = mode == FSDP_ACCUM_NO_SYNC && k < accum - 1;
        fm->grad_accumulate = k > 0 && (mode == FSDP_ACCUM_REDUCE_EACH || ctx->world == 1);
        double t1 = fsdp__now();
        fm->in_backward = 1;
        st = fsdp_module_backward(fm->root, ctx, &logits, NULL);
        fm->in_backward = 0;
        if (st == FSDP_OK) st = fsdp__model_finish_reduce(ctx, fm); /* the last reduction in flight */
        for (int i = 0; k == 0 && st == FSDP_OK && i < fm->n_units; i++)
            if (!fm->units[i].grad_fresh) fsdp__zero(fm->units[i].grad_shard, fm->units[i].numel_shard);
        fsdp__model_drop_prefetched(ctx, fm);
        *fwd_s += t1 - t0;
        *bwd_s += fsdp__now() - t1;
    }
    fm->no_sync = 0;
    fm->grad_accumulate = 0;
    if (st != FSDP_OK) fsdp__model_reshard_all(ctx, fm);
    return st;
}

enum fsdp_status fsdp_model_train_step(struct fsdp_ctx *ctx, struct fsdp_model *fm,
                                       const int32_t *inputs, const int32_t *targets, int B, int T,
                                       float lr, float clip, struct fsdp_step_result *res) {
    return fsdp_model_train_step_accum(ctx, fm, inputs, targets, B, T, 1, FSDP_ACCUM_REDUCE_EACH, lr, clip,
                                       res);
}

enum fsdp_status fsdp_model_train_step_accum(struct fsdp_ctx *ctx, struct fsdp_model *fm,
                                             const int32_t *inputs, const int32_t *targets, int B, int T,
                                             int accum, enum fsdp_grad_accum mode, float lr, float clip,
                                             struct fsdp_step_result *res) {
    if (!fm->optim)
        return fsdp__err(ctx, FSDP_ERR_STATE, "train_step: no optimizer attached (fsdp_model_attach_optim)");
    if (accum < 1 || (mode != FSDP_ACCUM_REDUCE_EACH && mode != FSDP_ACCUM_NO_SYNC))
        return fsdp__err(ctx, FSDP_ERR_INVALID,
                         "train_step: gradient accumulation (--grad-accum) %d with mode %d: need >= 1 "
                         "micro-batches and REDUCE_EACH or NO_SYNC", accum, (int)mode);
    double t0 = fsdp__now(), w0 = comm_wait_total(fm), fwd_s = 0, bwd_s = 0;
    fsdp__fault_step++; /* FSDP_FAULT's step ([Note: fault injection]) */
    float local_loss = 0.0f, loss_scale = fsdp__scaler_scale(fm); /* 1 without loss scaling */
    enum fsdp_status st = micro_batches(ctx, fm, inputs, targets, B, T, accum, mode, loss_scale, &local_loss,
                                        &fwd_s, &bwd_s);
    if (st != FSDP_OK) return st;
    double t1 = t0 + fwd_s, t2 = t1 + bwd_s;
    /* the global loss: mean of the ranks' means (equal shares), summed in rank order */
    float *losses = calloc((size_t)ctx->world, sizeof(float));
    if (!losses) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory gathering losses");
    st = fsdp_comm_allgather(ctx->comm, &local_loss, losses, 1, FSDP_F32);
    double loss = 0.0;
    for (int r = 0; r < ctx->world; r++) loss += (double)losses[r];
    free(losses);
    FSDP_TRY(st);
    loss /= ctx->world;
    double gnorm;
    fsdp__scaler_inject(ctx, fm); /* test hook (mixed.c) */
    FSDP_TRY(fsdp_model_grad_norm(ctx, fm, &gnorm));
    float unscale;
    res->skipped = fsdp__scaler_update(fm, loss, &gnorm, &unscale); /* unscales gnorm */
    res->loss_scale = loss_scale;
    res->loss = loss;
    res->grad_norm = gnorm;
    double psq = 0.0; /* this rank's sum of squares of the parameters after the step */
    if (res->skipped) { /* overflow under loss scaling: no update on any rank */
        psq = param_sumsq_local(fm);
    } else {
        if (!isfinite(loss) || !isfinite(gnorm)) { /* every rank sees the same loss and norm */
            char where[256];
            FSDP_TRY(first_nonfinite_unit(ctx, fm, where, sizeof where));
            return fsdp__err(ctx, FSDP_ERR_NUMERIC, "non-finite %s (loss %g, grad norm %g)%s",
                             isfinite(loss) ? "gradient" : "loss", loss, gnorm, where);
        }
        FSDP_TRY(optim_step_all(fm, lr, fsdp_clip_scale(gnorm, clip) * unscale, &psq)); /* psq fused */
        FSDP_TRY(fsdp__run_post_step_hooks(ctx, fm));
        if (fm->n_post_step) psq = param_sumsq_local(fm); /* a hook may have written the shards */
    }
    st = group_total(ctx, fm, psq, &res->param_norm);
    res->param_norm = sqrt(res->param_norm);
    res->forward_s = t1 - t0;
    res->backward_s = t2 - t1;
    res->update_s = fsdp__now() - t2;
    res->comm_wait_s = comm_wait_total(fm) - w0;
    return st;
}

/* ---- Reading full values ---- */

static enum fsdp_status read_full(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *fqn,
                                  int grads, float *dst) {
    int j;
    struct fsdp__unit *u = fsdp__model_unit_of(fm, fqn, &j);
    if (!u) return fsdp__err(ctx, FSDP_ERR_INVALID, "no parameter named '%s' in the sharded model", fqn);
    /* a backward run on a module below the root leaves its last reduction in flight */
    if (grads) FSDP_TRY(fsdp__model_finish_reduce(ctx, fm));
    float *tmp = fsdp__pool_get(fm, u->numel_padded, "full read");
    if (!tmp) return FSDP_ERR_NOMEM;
    enum fsdp_status st = FSDP_OK;
    if (!fm->shard_comm) memcpy(tmp, grads ? u->grad_shard : u->shard, (size_t)u->numel_shard * sizeof(float));
    else st = fsdp_comm_allgather(fm->shard_comm, grads ? u->grad_shard : u->shard, tmp,
                                              (size_t)u->numel_shard, FSDP_F32);
    if (st == FSDP_OK) memcpy(dst, tmp + u->offsets[j], (size_t)u->params[j]->numel * sizeof(float));
    fsdp__pool_put(fm, tmp);
    return st;
}

enum fsdp_status fsdp_model_get_param(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *fqn,
                                      float *dst) {
    return read_full(ctx, fm, fqn, 0, dst);
}

enum fsdp_status fsdp_model_get_grad(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *fqn,
                                     float *dst) {
    return read_full(ctx, fm, fqn, 1, dst);
}
