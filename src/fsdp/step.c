/*
 * step.c - the training step over a sharded model: forward through the
 * unit hooks, the loss (loss.c), backward (reduce-scatter per unit), the global
 * gradient norm, clipping and the optimizer update on local shards; plus the
 * global norms and per-parameter reads that gather one unit at a time.
 * Invariant: between steps every unit is SHARDED and IDLE, and no full
 * buffer is in use.
 */
#include "fsdp/fsdp-impl.h"
#include "nn/nn-impl.h"
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
    gm->p = fsdp__zalloc((size_t)total + 1, sizeof *gm->p);
    gm->group = fsdp__zalloc((size_t)total + 1, sizeof *gm->group);
    if (!gm->p || !gm->group) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory for matching optimizer groups");
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
    u->slices = fsdp__zalloc((size_t)u->n_params + 1, sizeof *u->slices);
    if (!u->slices) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory for optimizer slices");
    u->n_slices = 0;
    int64_t lo = (int64_t)u->model->shard_rank * u->numel_shard, hi = lo + u->numel_shard;
    for (int j = 0; j < u->n_params; j++) {
        int64_t a = u->offsets[j], b = a + u->params[j]->numel;
        int64_t s = a > lo ? a : lo, e = b < hi ? b : hi;
        if (s >= e) continue;
        struct fsdp_optim_slice *sl = &u->slices[u->n_slices++];
        sl->param = u->shard + (s - lo);
        sl->grad = NULL; /* the gradient shard's, at each step (optim_step_all) */
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
    for (int i = 0; i < fm->n_units; i++) /* the shards are reallocated below */
        if (fm->units[i].state_ != UNIT_SHARDED || fm->step.fwd_pending)
            return fsdp__err(ctx, FSDP_ERR_STATE, "attach_optim: unit '%s' is gathered (a train-mode forward "
                             "awaits its backward): attach the optimizer between steps",
                             fm->units[i].module->fqn[0] ? fm->units[i].module->fqn : "(root)");
    int k = fsdp_optim_state_per_elem(opt);
    struct group_map gm = {0};
    enum fsdp_status st = map_groups(ctx, fm, opt, &gm);
    if (st == FSDP_OK) st = fsdp__model_window_lp(ctx, fm); /* [Note: 16-bit window] (unit.c) */
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
    double *all = fsdp__zalloc((size_t)fm->shard_size, sizeof(double));
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
    for (int i = 0; i < fm->n_units && !fsdp__measuring; i++) {
        const struct fsdp__unit *u = &fm->units[i];
        const float *x = u->grad_shard;
        if (!x) continue; /* none since the last step: zeros */
        /* fsdp__sumsq's fixed chunks: the same bits at any thread count (an
         * OpenMP reduction's grouping follows the team's size, so a run
         * resumed with other --threads reported a norm an ulp apart) */
        local += fsdp__sumsq(x, u->numel_shard);
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
    for (int i = 0; i < fm->n_units && !fsdp__measuring; i++) {
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
/* [Note: LARS trust ratios] LARS scales each decayed parameter's step by
 * r = eta ||w|| / (||g|| + wd ||w|| + eps), norms of the whole parameter.
 * A parameter's elements lie in one unit's flat buffer, cut across the shard
 * group's ranks, so each rank sums w^2 and (g grad_scale)^2 per parameter
 * over its slices (the unit's slices follow its parameters in order, one per
 * parameter overlapping the shard: build_slices), the shard group
 * all-reduces the (2 x parameters) sums once, and every slice of a parameter
 * gets the same r. Replicas (HYBRID_SHARD) hold equal shards, so the shard
 * group's sums are the whole parameter's. Undecayed parameters keep trust 0
 * (a plain SGD step); with ||w|| or ||g|| zero the step is plain SGD without
 * decay, as LARC leaves such a parameter alone. COLLECTIVE: yes (shard group). */
static enum fsdp_status lars_trust(struct fsdp_model *fm, struct fsdp_optim_slice *all, float grad_scale) {
    const struct fsdp_optim_opts *o = fsdp__optim_opts(fm->optim);
    int P = 0;
    for (int i = 0; i < fm->n_units; i++) P += fm->units[i].n_params;
    float *sums = fsdp__zalloc((size_t)(2 * P) + 1, sizeof *sums), *tot = fsdp__zalloc((size_t)(2 * P) + 1, sizeof *tot);
    if (!sums || !tot) {
        free(sums);
        free(tot);
        return fsdp__err(fm->ctx, FSDP_ERR_NOMEM, "out of memory for LARS's norms");
    }
    int base = 0, k = 0;
    for (int i = 0; i < fm->n_units; i++) { /* slice k of the model <-> parameter base + j */
        struct fsdp__unit *u = &fm->units[i];
        int64_t lo = (int64_t)fm->shard_rank * u->numel_shard, hi = lo + u->numel_shard;
        for (int j = 0; j < u->n_params; j++) {
            int64_t a = u->offsets[j], b = a + u->params[j]->numel;
            if ((a > lo ? a : lo) >= (b < hi ? b : hi)) continue;
            const struct fsdp_optim_slice *sl = &all[k++];
            double g2 = fsdp__sumsq(sl->grad, sl->n) * (double)grad_scale * (double)grad_scale;
            sums[2 * (base + j)] = (float)fsdp__sumsq(sl->param, sl->n);
            sums[2 * (base + j) + 1] = (float)g2;
        }
        base += u->n_params;
    }
    enum fsdp_status st = FSDP_OK;
    if (fm->shard_comm && fm->shard_size > 1)
        st = fsdp_comm_allreduce(fm->shard_comm, sums, tot, (size_t)(2 * P), FSDP_F32, FSDP_SUM);
    else
        memcpy(tot, sums, (size_t)(2 * P) * sizeof *tot);
    if (st != FSDP_OK) st = fsdp__err(fm->ctx, st, "LARS: all-reduce of the parameter norms failed");
    base = 0, k = 0;
    for (int i = 0; i < fm->n_units && st == FSDP_OK; i++) {
        struct fsdp__unit *u = &fm->units[i];
        int64_t lo = (int64_t)fm->shard_rank * u->numel_shard, hi = lo + u->numel_shard;
        for (int j = 0; j < u->n_params; j++) {
            int64_t a = u->offsets[j], b = a + u->params[j]->numel;
            if ((a > lo ? a : lo) >= (b < hi ? b : hi)) continue;
            struct fsdp_optim_slice *sl = &all[k++];
            if (!sl->decay) continue; /* biases, batch norm: excluded */
            if (sl->decay > 1 && fsdp__optim_group_frozen(fm->optim, sl->decay - 1)) continue; /* untouched */
            double wn = sqrt((double)tot[2 * (base + j)]), gn = sqrt((double)tot[2 * (base + j) + 1]);
            double wd = (double)o->weight_decay;
            if (sl->decay > 1) {
                struct fsdp_optim_group_settings gs;
                if (fsdp_optim_group_get(fm->optim, sl->decay - 1, &gs) == FSDP_OK) wd = (double)gs.weight_decay;
            }
            if (wn > 0.0 && gn > 0.0)
                sl->trust = (float)((double)o->trust_coefficient * wn / (gn + wd * wn + (double)o->lars_eps));
            else
                sl->decay = 0; /* plain step, no decay (this step's copy of the slice only) */
        }
        base += u->n_params;
    }
    free(sums);
    free(tot);
    return st;
}

static enum fsdp_status optim_step_all(struct fsdp_model *fm, float lr, float grad_scale, double *sumsq) {
    int n = 0;
    for (int i = 0; i < fm->n_units; i++) {
        const struct fsdp__unit *u = &fm->units[i];
        if (!u->grad_shard && u->n_slices)
            return fsdp__err(fm->ctx, FSDP_ERR_STATE, "optimizer step: unit '%s' has no gradient shard: %s",
                             u->module->fqn[0] ? u->module->fqn : "(root)",
                             u->grad_lost ? "the activation arena holding it was reset by another forward on "
                                            "the context and there was no memory to move it"
                                          : "no backward since the step's first forward");
        n += u->n_slices;
    }
    struct fsdp_optim_slice *all = fsdp__zalloc((size_t)n + 1, sizeof *all);
    double *sums = fsdp__zalloc((size_t)n + 1, sizeof *sums);
    if (!all || !sums) {
        free(all);
        free(sums);
        return fsdp__err(fm->ctx, FSDP_ERR_NOMEM, "out of memory for the optimizer step");
    }
    n = 0;
    for (int i = 0; i < fm->n_units; i++) {
        const struct fsdp__unit *u = &fm->units[i];
        memcpy(all + n, u->slices, (size_t)u->n_slices * sizeof *all);
        for (int k = 0; k < u->n_slices; k++) all[n + k].grad = fsdp__slice_grad(u, &all[n + k]);
        n += u->n_slices;
    }
    for (int j = 0; j < n; j++) all[j].sumsq = &sums[j];
    if (fsdp__optim_opts(fm->optim)->kind == FSDP_OPTIM_LARS) {
        enum fsdp_status st = lars_trust(fm, all, grad_scale);
        if (st != FSDP_OK) {
            free(all);
            free(sums);
            return st;
        }
    }
    fsdp_optim_step(fm->optim, all, n, lr, grad_scale);
    *sumsq = 0.0;
    for (int j = 0; j < n; j++) *sumsq += sums[j];
    free(all);
    free(sums);
    /* the slices cover every parameter element; the padding stays 0 in both */
    for (int i = 0; i < fm->n_units; i++) fm->units[i].shard_lp_valid = fm->units[i].shard_lp != NULL;
    return FSDP_OK;
}

/* The model may run: no unit in the error state, and no summon open, but
 * for an eval-mode forward (`eval`) of a summon on every rank ([Note: a
 * forward while summoned], unit.c). */
static enum fsdp_status check_idle(struct fsdp_ctx *ctx, struct fsdp_model *fm, int eval) {
    if (fm->summon_active && !eval)
        return fsdp__err(ctx, FSDP_ERR_STATE, "the model runs in training mode while its parameters are summoned: "
                         "call fsdp_summon_end first (an eval-mode forward may run while summoned)");
    if (fm->summon_active && fm->summon_rank0_only)
        return fsdp__err(ctx, FSDP_ERR_STATE, "the model runs while its parameters are summoned on rank 0 only "
                         "(rank0_only): the other ranks have no values to run on; call fsdp_summon_end first");
    for (int i = 0; i < fm->n_units; i++)
        if (fm->units[i].state_ == UNIT_ERROR)
            return fsdp__err(ctx, FSDP_ERR_STATE, "unit '%s' is in the error state after a failed collective",
                             fm->units[i].module->fqn);
    return FSDP_OK;
}

/* [Note: the split step]
 * fsdp_model_train_step(_accum) is a composition of the public calls
 * fsdp_model_forward_tensor, fsdp_model_loss, fsdp_model_backward and
 * fsdp_model_optim_step, which keep what a step needs between them in
 * fm->step: a step opens at its first train-mode forward (the fault
 * injection's step count, the loss scale it uses, its clocks) and closes at
 * the optimizer step; each loss adds value / accum to the rank's step loss;
 * each backward knows from the step's earlier backwards whether the
 * reductions add into the gradient shards ([Note: gradient accumulation]).
 * The composition makes the same calls in the same order as the step did
 * before it was split, so a GPT trains to the same bits. On an error the
 * step is abandoned: every unit is resharded and the next forward opens a
 * new one. */

/* Abandons the step after an error (the units were resharded). */
static void step_abandon(struct fsdp_model *fm) {
    fm->no_sync = 0;
    fm->grad_accumulate = 0;
    fm->in_forward = fm->in_backward = fm->win_pass = 0;
    int sync_off = fm->step.sync_off;
    memset(&fm->step, 0, sizeof fm->step);
    fm->step.sync_off = sync_off;
}

static double comm_wait_total(const struct fsdp_model *fm);

/* [Note: eval forward]
 * An eval-mode forward runs the same hooks and layers with two settings
 * changed for its duration: every unit reshards after its forward, and every
 * unit root runs as an activation-checkpointed module does
 * ([Note: activation checkpointing] in src/nn/module.c), so that when a
 * unit's forward ends everything it allocated in the arena but its output is
 * released. Afterwards no unit is in its forward phase and no checkpointed
 * input is kept, so a backward is refused; the output bits are those of a
 * train-mode forward (the same code on the same values). */
static enum fsdp_status eval_forward(struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct fsdp_tensor *in,
                                     struct fsdp_tensor *out) {
    int *saved = fsdp__zalloc(2 * (size_t)fm->n_units + 1, sizeof *saved);
    if (!saved) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory for an eval forward");
    for (int i = 0; i < fm->n_units; i++) {
        struct fsdp__unit *u = &fm->units[i];
        saved[2 * i] = u->reshard_after_forward;
        saved[2 * i + 1] = u->module->checkpoint;
        u->reshard_after_forward = 1;
        u->module->checkpoint = 1;
    }
    fm->in_forward = 1; /* forward prefetch as in training */
    enum fsdp_status st = fsdp_module_forward(fm->root, ctx, in, out);
    fm->in_forward = 0;
    for (int i = 0; i < fm->n_units; i++) {
        struct fsdp__unit *u = &fm->units[i];
        u->reshard_after_forward = saved[2 * i];
        u->module->checkpoint = saved[2 * i + 1];
        u->module->priv->ckpt_saved = 0;
        u->phase = PHASE_IDLE;
    }
    free(saved);
    return st;
}

/* Copies `in` into the freshly reset arena (so it lives as long as the
 * activations that point into it) and runs the forward: a train-mode one
 * (that opens a step if `step`) or an eval one. */
static enum fsdp_status run_forward(struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct fsdp_tensor *in,
                                    struct fsdp_tensor *out, int train, int step, enum fsdp_dtype want) {
    FSDP_TRY(check_idle(ctx, fm, !train));
    if (!in || !in->data || in->ndim < 1 || in->ndim > FSDP_MAX_DIMS || (unsigned)in->dtype > FSDP_I64)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "forward: the input tensor needs data, a dtype and 1 to %d "
                         "dimensions", FSDP_MAX_DIMS);
    for (int i = 0; i < in->ndim; i++)
        if (in->shape[i] <= 0)
            return fsdp__err(ctx, FSDP_ERR_INVALID, "forward: input dimension %d is %lld", i,
                             (long long)in->shape[i]);
    fm->step.fwd_pending = 0; /* the reset below drops what a pending forward saved */
    int mid_step = fm->step.open; /* keeps the step's gradients; else they end ([Note: gradient shards born
                                     in backward], unit.c) */
    if (train && step && !fm->step.open) { /* the step's first forward opens it */
        if (!fsdp__measuring) fsdp__fault_step++; /* FSDP_FAULT's step ([Note: fault injection]); not a plan's */
        fm->step.open = 1;
        fm->step.w0 = comm_wait_total(fm);
        fm->step.loss_scale = fsdp__scaler_scale(fm); /* 1 without loss scaling */
    }
    double t0 = fsdp__now();
    struct fsdp_tensor x = *in;
    size_t bytes = (size_t)fsdp_tensor_numel(in) * fsdp_dtype_size(in->dtype);
    /* the arena's lent gradient shards move out first */
    enum fsdp_status st = mid_step ? fsdp__model_grads_keep(ctx, fm) : FSDP_OK;
    if (!mid_step) fsdp__model_grads_none(ctx, fm);
    if (st == FSDP_OK) {
        fsdp_arena_reset(ctx);
        x.data = fsdp_arena_alloc(ctx, bytes);
        if (!x.data) st = FSDP_ERR_NOMEM; /* the arena named it (a limit, or the allocation) */
    }
    if (st != FSDP_OK && train) { /* as a failed forward below: the step ends here ([Note: the split step]) */
        fsdp__model_reshard_all(ctx, fm);
        step_abandon(fm);
    }
    if (st != FSDP_OK) return st;
    memcpy(x.data, in->data, bytes);
    memset(out, 0, sizeof *out);
    if (want != FSDP_F32) { /* [Note: 16-bit model output] */
        out->dtype = want;
        out->layout = FSDP_LAYOUT_ROWS16;
    }
    ctx->errmsg[0] = '\0'; /* a module failing without a message gets one below */
    if (train) {
        fm->in_forward = 1;
        fm->win_pass = step; /* [Note: shared window] (unit.c) */
        st = fsdp_module_forward(fm->root, ctx, &x, out);
        fm->in_forward = fm->win_pass = 0;
    } else {
        st = eval_forward(ctx, fm, &x, out);
    }
    fsdp__model_drop_prefetched(ctx, fm); /* units gathered ahead that never ran */
    if (out->dtype == FSDP_F32 && out->layout == FSDP_LAYOUT_ROWS16)
        out->layout = FSDP_LAYOUT_PLAIN; /* the request passed through a layer that wrote F32 and kept it */
    if (st != FSDP_OK) {
        if (!ctx->errmsg[0])
            fsdp__err(ctx, st, "forward of the model on an input %s of %d dimensions failed: %s (a module gave "
                      "no message)", fsdp_dtype_name(in->dtype), in->ndim, fsdp_status_str(st));
        fsdp__model_reshard_all(ctx, fm);
        if (train) step_abandon(fm);
        return st;
    }
    if (!train || !step) {
        fsdp__model_reshard_all(ctx, fm); /* no backward follows */
        return FSDP_OK;
    }
    fm->step.fwd_pending = 1;
    fm->step.out = *out;
    fm->step.fwd_s += fsdp__now() - t0;
    return FSDP_OK;
}

enum fsdp_status fsdp_model_forward_tensor(struct fsdp_ctx *ctx, struct fsdp_model *fm,
                                           const struct fsdp_tensor *in, struct fsdp_tensor *out) {
    return run_forward(ctx, fm, in, out, fm->root->training, 1, FSDP_F32);
}

/* A (B, T) token batch as a tensor. */
static enum fsdp_status tokens(struct fsdp_ctx *ctx, const int32_t *inputs, int B, int T, struct fsdp_tensor *t) {
    if (B <= 0 || T <= 0)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "batch shape (%d, %d) must be positive", B, T);
    memset(t, 0, sizeof *t);
    t->data = (void *)inputs;
    t->dtype = FSDP_I32;
    t->ndim = 2;
    t->shape[0] = B;
    t->shape[1] = T;
    return FSDP_OK;
}

enum fsdp_status fsdp_model_forward(struct fsdp_ctx *ctx, struct fsdp_model *fm, const int32_t *inputs,
                                    int B, int T, float **logits) {
    struct fsdp_tensor tok, out;
    if (!logits) return fsdp__err(ctx, FSDP_ERR_INVALID, "fsdp_model_forward: logits is NULL");
    FSDP_TRY(check_idle(ctx, fm, 0));
    FSDP_TRY(tokens(ctx, inputs, B, T, &tok));
    /* a train-mode forward outside any step (the memory and bits it always
     * had), with no backward after it */
    FSDP_TRY(run_forward(ctx, fm, &tok, &out, 1, 0, FSDP_F32));
    *logits = out.data;
    return FSDP_OK;
}

/* ---- Backward ---- */

void fsdp_model_set_grad_sync(struct fsdp_model *fm, int on) { fm->step.sync_off = !on; }

/* whether m or a module below it is activation-checkpointed */
static int tree_checkpointed(const struct fsdp_module *m) {
    if (m->checkpoint) return 1;
    for (int i = 0; i < m->n_children; i++)
        if (tree_checkpointed(m->children[i])) return 1;
    return 0;
}

enum fsdp_status fsdp_model_backward(struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct fsdp_tensor *dout) {
    if (!fm->step.fwd_pending)
        return fsdp__err(ctx, FSDP_ERR_STATE, "backward without a train-mode forward before it (after an eval "
                         "forward, a backward, or an error)");
    const struct fsdp_tensor *o = &fm->step.out;
    /* F32, or a 16-bit output's own dtype and rows ([Note: 16-bit model output]) */
    int lp = dout && o->dtype != FSDP_F32 && dout->dtype == o->dtype && dout->layout == o->layout;
    int same = dout && dout->data && (lp || dout->dtype == FSDP_F32) &&
               dout->ndim == o->ndim;
    for (int i = 0; same && i < o->ndim; i++) same = dout->shape[i] == o->shape[i];
    if (!same)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "backward: the output gradient must be F32%s%s shaped as the model "
                         "output (%d dimensions, last %lld)", o->dtype != FSDP_F32 ? " or " : "",
                         o->dtype != FSDP_F32 ? fsdp_dtype_name(o->dtype) : "", o->ndim,
                         (long long)o->shape[o->ndim - 1]);
    double t0 = fsdp__now();
    struct fsdp__step *sp = &fm->step;
    /* backward writes the shards it reaches (born in it: the step's first forward ended the
     * last step's, [Note: gradient shards born in backward]); the rest are zeroed after it */
    int first = sp->n_backward == 0;
    fm->no_sync = sp->sync_off;
    fm->grad_accumulate = !first && (sp->reduced || ctx->world == 1);
    fm->in_backward = fm->win_pass = 1;
    sp->fwd_pending = 0;
    ctx->errmsg[0] = '\0';
    /* [Note: 16-bit output gradient] (src/nn/precision.c): a gradient the loss wrote over the
     * model's output in the arena is the library's to narrow in place.
     * [Note: padded rows] oneDNN runs a 16-bit product whose operand rows
     * start at unaligned addresses on its slower brgemm kernels: GPT-2's
     * lm_head backward with dlogits rows of 50257 bf16 values ran dW = dy^T x
     * at 424 GFLOP/s and dx = dy W at 585 where rows 50272 apart ran 785 and
     * 765 (2 threads, AVX512-BF16; bench/README.md). So where the receiving
     * module takes them (dout_layout ROWS16: a bias-free Linear), the
     * narrowing spaces the rows fsdp_rows16_stride apart, which still fits in
     * the fp32 buffer; the values are the same bits. */
    struct fsdp_tensor d16 = *dout;
    enum fsdp_dtype ddt = fm->root->priv->dout_dtype;
    if (lp && !(ddt == dout->dtype && (dout->layout == FSDP_LAYOUT_PLAIN ||
                                       fm->root->priv->dout_layout == dout->layout))) {
        /* the root takes it otherwise: widened into the arena, as an F32 gradient */
        size_t n = (size_t)fsdp_tensor_numel(dout);
        int64_t cols = dout->shape[dout->ndim - 1], ld = fsdp__row_stride(dout);
        float *w = fsdp_arena_alloc(ctx, n * sizeof(float));
        if (!w) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory widening the output gradient in the arena");
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < (fsdp__measuring ? 0 : (int64_t)n / cols); r++)
            fsdp__cvt_to_f32(dout->dtype, (const uint16_t *)dout->data + r * ld, w + r * cols, (size_t)cols);
        d16.data = w;
        d16.dtype = FSDP_F32;
        d16.layout = FSDP_LAYOUT_PLAIN;
    } else if (!lp && ddt != FSDP_F32 && dout->data == o->data) {
        size_t n = (size_t)fsdp_tensor_numel(dout);
        int64_t cols = dout->shape[dout->ndim - 1], rows = (int64_t)n / cols, ld = fsdp_rows16_stride(cols);
        if (fm->root->priv->dout_layout != FSDP_LAYOUT_ROWS16 || ld > 2 * cols) ld = cols; /* not asked, or no room */
        fsdp__mp_narrow_rows_inplace(ddt, dout->data, rows, cols, ld);
        if (ld != cols) d16.layout = FSDP_LAYOUT_ROWS16; /* else the output's own */
        d16.dtype = ddt;
        fsdp__arena_shrink(ctx, dout->data, n * sizeof(float), (size_t)(rows * ld) * fsdp_dtype_size(ddt));
    }
    ctx->dead_dout = d16.data == o->data ? o->data : NULL; /* the library's, in place: dead once taken */
    ctx->dead_for = fm->root;
    sp->bwd_mark = fsdp_arena_mark(ctx);
    sp->bwd_lend = !tree_checkpointed(fm->root);
    enum fsdp_status st = fsdp_module_backward(fm->root, ctx, &d16, NULL);
    ctx->dead_dout = NULL;
    ctx->dead_for = NULL;
    if (st != FSDP_OK && !ctx->errmsg[0])
        fsdp__err(ctx, st, "backward of the model failed: %s (a module gave no message)", fsdp_status_str(st));
    fm->in_backward = fm->win_pass = 0;
    if (st == FSDP_OK) st = fsdp__model_finish_reduce(ctx, fm); /* the last reduction in flight */
    for (int i = 0; first && st == FSDP_OK && i < fm->n_units; i++)
        if (!fm->units[i].grad_shard && (st = fsdp__unit_grad_birth(ctx, &fm->units[i])) == FSDP_OK)
            fsdp__zero(fm->units[i].grad_shard, fm->units[i].numel_shard);
    fsdp__model_drop_prefetched(ctx, fm);
    fm->no_sync = 0;
    fm->grad_accumulate = 0;
    if (st != FSDP_OK) {
        fsdp__model_reshard_all(ctx, fm);
        step_abandon(fm);
        return st;
    }
    sp->n_backward++;
    sp->reduced |= !sp->sync_off;
    sp->unsynced = sp->sync_off;
    sp->bwd_s += fsdp__now() - t0;
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
    int n = 0, *order = fsdp__zalloc((size_t)fm->n_units, sizeof *order);
    int32_t *bad = fsdp__zalloc((size_t)fm->n_units, sizeof *bad), *any = fsdp__zalloc((size_t)fm->n_units, sizeof *any);
    enum fsdp_status st = FSDP_OK;
    if (!order || !bad || !any) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory for checking gradients");
    if (st == FSDP_OK) {
        backward_order(fm, 0, order, &n);
        for (int k = 0; k < n; k++) {
            const struct fsdp__unit *u = &fm->units[order[k]];
            for (int64_t j = 0; u->grad_shard && j < u->numel_shard && !bad[k]; j++) bad[k] = !isfinite(u->grad_shard[j]);
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
 * last backward. A world of one accumulates straight into the shard.
 * fsdp_model_backward derives both flags from the step's earlier backwards
 * (fm->step.n_backward, .reduced) and fsdp_model_set_grad_sync, so a custom
 * loop gets the same reductions. */

/* The update's learning rate and clipping threshold, checked before any
 * work (every rank passes the same, so every rank refuses alike). */
static enum fsdp_status check_update(struct fsdp_ctx *ctx, float lr, float clip) {
    if (!(lr >= 0.0f) || !isfinite(lr) || isnan(clip))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "optimizer step: lr %g, clip %g (the learning rate finite and >= 0; "
                         "clip a number, <= 0 for none)", (double)lr, (double)clip);
    return FSDP_OK;
}

/* What any update needs: good values, no summon, an optimizer. */
static enum fsdp_status update_ready(struct fsdp_ctx *ctx, struct fsdp_model *fm, float lr, float clip) {
    FSDP_TRY(check_update(ctx, lr, clip));
    FSDP_TRY(fsdp__check_unsummoned(ctx, fm, "optimizer step"));
    if (!fm->optim)
        return fsdp__err(ctx, FSDP_ERR_STATE, "train_step: no optimizer attached (fsdp_model_attach_optim)");
    return FSDP_OK;
}

/* What the optimizer step needs of this rank's model and values. */
static enum fsdp_status optim_ready(struct fsdp_ctx *ctx, struct fsdp_model *fm, float lr, float clip) {
    FSDP_TRY(update_ready(ctx, fm, lr, clip));
    if (!fm->step.n_backward)
        return fsdp__err(ctx, FSDP_ERR_STATE, "optimizer step without a backward since the last one");
    if (fm->step.unsynced && ctx->world > 1)
        return fsdp__err(ctx, FSDP_ERR_STATE, "optimizer step after a backward with gradient sync off: the "
                         "step's last backward must reduce (fsdp_model_set_grad_sync(fm, 1))");
    return FSDP_OK;
}

/* The optimizer step; `agree`: its preconditions agreed over the ranks
 * first ([Note: agreed preconditions]), which the composed step did before
 * its forward. */
static enum fsdp_status optim_step(struct fsdp_ctx *ctx, struct fsdp_model *fm, float lr, float clip,
                                   struct fsdp_step_result *res, int agree) {
    struct fsdp_step_result unread;
    if (!res) res = &unread; /* nothing to report to */
    enum fsdp_status ready = optim_ready(ctx, fm, lr, clip);
    if (agree && ctx->world > 1) ready = fsdp__status_agree(ctx, ready, "optimizer step");
    FSDP_TRY(ready);
    struct fsdp__step *sp = &fm->step;
    double t2 = fsdp__now();
    float local_loss = sp->loss, loss_scale = sp->loss_scale;
    double w0 = sp->w0, fwd_s = sp->fwd_s, bwd_s = sp->bwd_s;
    step_abandon(fm); /* closed, whatever follows */
    /* the global loss: mean of the ranks' means (equal shares), summed in rank order */
    float *losses = fsdp__zalloc((size_t)ctx->world, sizeof(float));
    if (!losses) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory for the ranks' losses");
    enum fsdp_status st = fsdp_comm_allgather(ctx->comm, &local_loss, losses, 1, FSDP_F32);
    double loss = 0.0;
    for (int r = 0; r < ctx->world; r++) loss += (double)losses[r];
    free(losses);
    FSDP_TRY(st);
    loss /= ctx->world;
    double gnorm;
    fsdp__scaler_inject(ctx, fm); /* test hook (mixed.c) */
    FSDP_TRY(fsdp_model_grad_norm(ctx, fm, &gnorm));
    if (fsdp__measuring) loss = gnorm = 0.0; /* values are not computed ([Note: measure mode], plan.c) */
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
    res->forward_s = fwd_s;
    res->backward_s = bwd_s;
    res->update_s = fsdp__now() - t2;
    res->comm_wait_s = comm_wait_total(fm) - w0;
    return st;
}

enum fsdp_status fsdp_model_optim_step(struct fsdp_ctx *ctx, struct fsdp_model *fm, float lr, float clip,
                                       struct fsdp_step_result *res) {
    return optim_step(ctx, fm, lr, clip, res, 1);
}

enum fsdp_status fsdp_model_train_step(struct fsdp_ctx *ctx, struct fsdp_model *fm,
                                       const int32_t *inputs, const int32_t *targets, int B, int T,
                                       float lr, float clip, struct fsdp_step_result *res) {
    return fsdp_model_train_step_accum(ctx, fm, inputs, targets, B, T, 1, FSDP_ACCUM_REDUCE_EACH, lr, clip,
                                       res);
}

/* [Note: 16-bit model output] The model output's dtype in the composed step:
 * the compute dtype of the root, whose last layer (GPT's lm_head) then
 * rounds its products block by block ([Note: 16-bit output rounding],
 * src/nn/linear.c), as the output of a bf16 module is bf16 under PyTorch's
 * FSDP2 (MixedPrecisionPolicy with no output_dtype) and autocast: GPT-2's
 * logits at 4 x 256 tokens are 98 MiB instead of 196 at their peak. The
 * cross-entropy widens each row to fp32, computes as over fp32 logits and
 * rounds the gradient into the output in place (fsdp__cross_entropy_rows);
 * the rows are spaced as lm_head's backward takes them ([Note: padded rows]),
 * so the gradient goes to it as it is. What differs from fp32 logits is
 * the logits' rounding to 16 bits before the softmax (the gradient was
 * rounded before as well: [Note: 16-bit output gradient]). The split calls
 * keep returning F32 (fsdp_model_forward_tensor); fsdp_model_loss and
 * fsdp_model_backward take the 16-bit output this step makes. */
static enum fsdp_dtype output_dtype(const struct fsdp_model *fm) { return fm->root->compute_dtype; }

/* The composition of the split step ([Note: the split step]). */
/* [Note: agreed preconditions] A step that one rank refuses before its
 * first collective (a NaN learning rate, no optimizer attached, a unit left
 * gathered on that rank alone) left the others in the step's first
 * collective, ended only by a watchdog (none by default). So the composed
 * step agrees on its preconditions over the ranks before its forward, and
 * fsdp_model_optim_step on its own before the losses' all-gather: one 4-byte
 * all-reduce at world > 1; every rank then refuses alike, the ranks whose own
 * checks passed naming the first that failed. */
static enum fsdp_status train_ready(struct fsdp_ctx *ctx, struct fsdp_model *fm, int accum,
                                    enum fsdp_grad_accum mode, float lr, float clip) {
    FSDP_TRY(update_ready(ctx, fm, lr, clip));
    if (accum < 1 || (mode != FSDP_ACCUM_REDUCE_EACH && mode != FSDP_ACCUM_NO_SYNC))
        return fsdp__err(ctx, FSDP_ERR_INVALID,
                         "train_step: gradient accumulation (--grad-accum) %d with mode %d: need >= 1 "
                         "micro-batches and REDUCE_EACH or NO_SYNC", accum, (int)mode);
    FSDP_TRY(check_idle(ctx, fm, 0));
    if (!fm->root->training)
        return fsdp__err(ctx, FSDP_ERR_STATE, "train_step: the model is in eval mode (fsdp_module_set_training)");
    if (fm->step.open)
        return fsdp__err(ctx, FSDP_ERR_STATE, "train_step: a step of separate forward/backward calls is open "
                         "(end it with fsdp_model_optim_step)");
    return FSDP_OK;
}

enum fsdp_status fsdp_model_train_step_accum(struct fsdp_ctx *ctx, struct fsdp_model *fm,
                                             const int32_t *inputs, const int32_t *targets, int B, int T,
                                             int accum, enum fsdp_grad_accum mode, float lr, float clip,
                                             struct fsdp_step_result *res) {
    enum fsdp_status ready = train_ready(ctx, fm, accum, mode, lr, clip);
    if (ctx->world > 1) ready = fsdp__status_agree(ctx, ready, "train_step"); /* [Note: agreed preconditions] */
    FSDP_TRY(ready);
    int sync_off = fm->step.sync_off;
    enum fsdp_status st = FSDP_OK;
    for (int k = 0; k < accum && st == FSDP_OK; k++) {
        struct fsdp_tensor tok, logits, tg;
        int64_t N = (int64_t)B * T;
        st = tokens(ctx, inputs + (size_t)k * (size_t)N, B, T, &tok);
        if (st == FSDP_OK) st = run_forward(ctx, fm, &tok, &logits, 1, 1, output_dtype(fm));
        if (st != FSDP_OK) break;
        st = tokens(ctx, targets + (size_t)k * (size_t)N, B, T, &tg);
        if (st == FSDP_OK) st = fsdp_model_loss(ctx, fm, NULL, &logits, &tg, accum, NULL, &logits);
        if (ctx->world > 1) st = fsdp__loss_agree(ctx, st, k); /* [Note: agreed loss check] */
        fm->step.sync_off = mode == FSDP_ACCUM_NO_SYNC && k < accum - 1;
        if (st == FSDP_OK) st = fsdp_model_backward(ctx, fm, &logits);
    }
    fm->step.sync_off = sync_off;
    if (st == FSDP_OK) return optim_step(ctx, fm, lr, clip, res, 0); /* agreed above */
    fsdp__model_reshard_all(ctx, fm); /* a failed loss leaves the forward's units gathered */
    step_abandon(fm);
    return st;
}

/* ---- Reading full values ---- */

static enum fsdp_status read_full(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *fqn,
                                  int grads, float *dst) {
    int j;
    if (!fqn || !dst)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "reading a %s: %s is NULL", grads ? "gradient" : "parameter",
                         !fqn ? "the name" : "the destination");
    struct fsdp__unit *u = fsdp__model_unit_of(fm, fqn, &j);
    if (!u) return fsdp__err(ctx, FSDP_ERR_INVALID, "no parameter named '%s' in the sharded model", fqn);
    /* a backward run on a module below the root leaves its last reduction in flight */
    if (grads) FSDP_TRY(fsdp__model_finish_reduce(ctx, fm));
    if (grads && !u->grad_shard) { /* none since the last step (every rank alike): zeros */
        memset(dst, 0, (size_t)u->params[j]->numel * sizeof(float));
        return FSDP_OK;
    }
    const float *mine = grads ? u->grad_shard : u->shard;
    if (!fm->shard_comm) { /* the shard is the whole unit: no pooled copy (the pool keeps it) */
        memcpy(dst, mine + u->offsets[j], (size_t)u->params[j]->numel * sizeof(float));
        return FSDP_OK;
    }
    float *tmp = fsdp__pool_get(fm, u->numel_padded, "full read");
    if (!tmp) return FSDP_ERR_NOMEM;
    enum fsdp_status st = fsdp_comm_allgather(fm->shard_comm, mine, tmp, (size_t)u->numel_shard, FSDP_F32);
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
