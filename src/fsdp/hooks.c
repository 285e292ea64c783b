/*
 * hooks.c - what user modules reach of the sharded model: hooks run after
 * each optimizer update (VISSL's prototype renormalisation, a SwAV queue
 * reset), registered on the sharded model naming a module and run in
 * registration order on every rank by the training step once the update is
 * applied; and the tagged all-reduce a module's forward or backward calls
 * ([Note: collectives in modules] in include/fsdp.h).
 * Invariant: a hook runs with every unit SHARDED and IDLE (it may summon a
 * unit with write-back) and with its collectives tagged "post-step hook
 * FQN" on the model's communicators, so the schedule check and the
 * watchdog name it when ranks disagree.
 */
#include "fsdp/fsdp-impl.h"

#include <string.h>

struct fsdp__post_step_hook {
    struct fsdp_module *module;
    fsdp_post_step_fn fn;
    void *ud;
};

static const char *hook_name(const struct fsdp_module *m) {
    return m->fqn && m->fqn[0] ? m->fqn : "(root)";
}

static int is_below(const struct fsdp_module *m, const struct fsdp_module *anc) {
    for (; m; m = m->parent)
        if (m == anc) return 1;
    return 0;
}

enum fsdp_status fsdp_model_add_post_step_hook(struct fsdp_ctx *ctx, struct fsdp_model *fm,
                                               struct fsdp_module *m, fsdp_post_step_fn fn, void *ud) {
    if (!fn) return fsdp__err(ctx, FSDP_ERR_INVALID, "add_post_step_hook: the hook function is NULL");
    if (!m) m = fm->root;
    if (!is_below(m, fm->root))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "add_post_step_hook: module '%s' is not part of this model",
                         m->fqn ? hook_name(m) : m->name);
    if (fm->n_post_step == fm->cap_post_step) {
        int ncap = fm->cap_post_step ? 2 * fm->cap_post_step : 4;
        void *n = fsdp__realloc(fm->post_step, (size_t)ncap * sizeof *fm->post_step);
        if (!n) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory adding a post-step hook on '%s'", hook_name(m));
        fm->post_step = n;
        fm->cap_post_step = ncap;
    }
    fm->post_step[fm->n_post_step++] = (struct fsdp__post_step_hook){m, fn, ud};
    return FSDP_OK;
}

static void tag_all(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *tag) {
    fsdp_comm_set_tag(ctx->comm, tag);
    fsdp_comm_set_tag(fm->shard_comm, tag);
    fsdp_comm_set_tag(fm->rep_comm, tag);
}

enum fsdp_status fsdp__run_post_step_hooks(struct fsdp_ctx *ctx, struct fsdp_model *fm) {
    for (int i = 0; i < fm->n_post_step; i++) {
        const struct fsdp__post_step_hook *h = &fm->post_step[i];
        char tag[64];
        snprintf(tag, sizeof tag, "post-step hook %s", hook_name(h->module));
        tag_all(ctx, fm, tag);
        enum fsdp_status st = h->fn(ctx, fm, h->module, h->ud);
        tag_all(ctx, fm, NULL);
        if (fm->summon_active) { /* a hook that forgot fsdp_summon_end: end it, as the hook asked */
            enum fsdp_status st2 = fsdp_summon_end(ctx, fm);
            if (st == FSDP_OK) st = st2;
        }
        if (st != FSDP_OK) {
            char cause[sizeof ctx->errmsg];
            snprintf(cause, sizeof cause, "%s", ctx->errmsg);
            return fsdp__err(ctx, st, "post-step hook on '%s': %s", hook_name(h->module), cause);
        }
    }
    return FSDP_OK;
}

void fsdp__post_step_hooks_free(struct fsdp_model *fm) {
    free(fm->post_step);
    fm->post_step = NULL;
    fm->n_post_step = fm->cap_post_step = 0;
}

enum fsdp_status fsdp_module_allreduce(struct fsdp_ctx *ctx, struct fsdp_module *m, void *buf, size_t count,
                                       enum fsdp_dtype dt, enum fsdp_red_op op) {
    struct fsdp_comm *c = ctx->comm;
    if (!c || fsdp_comm_size(c) == 1) return FSDP_OK;
    char saved[64], tag[64];
    snprintf(saved, sizeof saved, "%s", fsdp_comm_tag(c));
    snprintf(tag, sizeof tag, "module %s", m && m->fqn && m->fqn[0] ? m->fqn : m ? m->name : "?");
    fsdp_comm_set_tag(c, tag);
    enum fsdp_status st = fsdp_comm_allreduce(c, buf, buf, count, dt, op);
    fsdp_comm_set_tag(c, saved);
    if (st != FSDP_OK) {
        char cause[sizeof ctx->errmsg];
        snprintf(cause, sizeof cause, "%s", ctx->errmsg);
        return fsdp__err(ctx, st, "all-reduce of module '%s': %s", tag + 7, cause);
    }
    return FSDP_OK;
}
