/*
 * module.c - the module tree: creation, parameters with fully qualified
 * names, traversal, materialisation, and the forward/backward dispatchers
 * that run the sharding layer's hooks around a module; buffers (replicated,
 * never sharded) and the train/eval mode.
 * Invariants: a module owns its children, its parameters and its buffers; a tied
 * parameter (tied_to != NULL) never has storage of its own and is skipped by
 * traversals (PyTorch's named_parameters dedup).
 */
#include "nn/nn-impl.h"

#include <string.h>

static int grow(void **arr, int *cap, int need, size_t elem) {
    if (need <= *cap) return 0;
    int ncap = *cap ? *cap * 2 : 4;
    while (ncap < need) ncap *= 2;
    void *n = fsdp__realloc(*arr, (size_t)ncap * elem);
    if (!n) return -1;
    *arr = n;
    *cap = ncap;
    return 0;
}

enum fsdp_status fsdp_module_create(struct fsdp_ctx *ctx, const struct fsdp_module_ops *ops,
                                    const char *name, struct fsdp_module **out) {
    if (!ops || !name || strlen(name) >= sizeof((struct fsdp_module *)0)->name)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "module name missing or too long: '%s'",
                         name ? name : "(null)");
    struct module_block { /* one allocation: the module and its bookkeeping */
        struct fsdp_module m;
        struct fsdp__module_priv priv;
    } *b = fsdp__zalloc(1, sizeof *b);
    if (!b) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory creating module '%s'", name);
    struct fsdp_module *m = &b->m;
    m->priv = &b->priv;
    m->ops = ops;
    m->training = 1;
    strcpy(m->name, name);
    *out = m;
    return FSDP_OK;
}

void fsdp_module_free(struct fsdp_module *m) {
    if (!m) return;
    for (int i = 0; i < m->n_children; i++) fsdp_module_free(m->children[i]);
    free(m->children);
    for (int i = 0; i < m->n_params; i++) {
        struct fsdp_param *p = m->params[i];
        if (p->priv->owns_data) {
            fsdp__free(NULL, p->data);
            fsdp__free(NULL, p->grad);
        }
        free(p->fqn);
        free(p); /* with its priv: one block */
    }
    free(m->params);
    for (int i = 0; i < m->n_buffers; i++) {
        free(m->buffers[i]->data);
        free(m->buffers[i]->fqn);
        free(m->buffers[i]);
    }
    free(m->buffers);
    if (m->ops && m->ops->destroy) m->ops->destroy(m);
    free(m->fqn);
    free(m);
}

enum fsdp_status fsdp_module_add_child(struct fsdp_ctx *ctx, struct fsdp_module *parent,
                                       struct fsdp_module *child) {
    if (!parent || !child)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "fsdp_module_add_child: %s is NULL", parent ? "child" : "parent");
    if (child->parent)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "module '%s' already has a parent, '%s': a module is the child of "
                         "one module only", child->name, child->parent->name);
    for (const struct fsdp_module *a = parent; a; a = a->parent)
        if (a == child)
            return fsdp__err(ctx, FSDP_ERR_INVALID, "module '%s' cannot be a child of '%s': it is %s", child->name,
                             parent->name, a == parent ? "the same module" : "one of its ancestors");
    for (int i = 0; i < parent->n_children; i++)
        if (strcmp(parent->children[i]->name, child->name) == 0)
            return fsdp__err(ctx, FSDP_ERR_INVALID, "module '%s' already has a child named '%s'",
                             parent->name, child->name);
    if (grow((void **)&parent->children, &parent->priv->cap_children, parent->n_children + 1,
             sizeof(struct fsdp_module *)))
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory adding child '%s'", child->name);
    parent->children[parent->n_children++] = child;
    child->parent = parent;
    return FSDP_OK;
}

enum fsdp_status fsdp_module_add_param(struct fsdp_ctx *ctx, struct fsdp_module *m, const char *name,
                                       int ndim, const int64_t *shape, struct fsdp_init init,
                                       int no_decay, struct fsdp_param **out) {
    if (!m || !name || !shape)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "fsdp_module_add_param: %s is NULL",
                         !m ? "the module" : !name ? "the name" : "the shape");
    if (ndim < 1 || ndim > FSDP_MAX_DIMS || strlen(name) >= sizeof((struct fsdp_param *)0)->name)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "parameter '%s' of module '%s': bad name or rank %d",
                         name, m->name, ndim);
    int64_t numel = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] <= 0)
            return fsdp__err(ctx, FSDP_ERR_INVALID, "parameter '%s' of module '%s': dim %d is %lld",
                             name, m->name, i, (long long)shape[i]);
        if (__builtin_mul_overflow(numel, shape[i], &numel) || numel > FSDP__MAX_NUMEL)
            return fsdp__err(ctx, FSDP_ERR_INVALID, "parameter '%s' of module '%s': its %d-d shape holds more "
                             "than 2^48 elements", name, m->name, ndim);
    }
    for (int i = 0; i < m->n_params; i++)
        if (strcmp(m->params[i]->name, name) == 0)
            return fsdp__err(ctx, FSDP_ERR_INVALID, "module '%s' already has a parameter '%s'",
                             m->name, name);
    struct param_block { /* one allocation: the parameter and its bookkeeping */
        struct fsdp_param p;
        struct fsdp__param_priv priv;
    } *b = fsdp__zalloc(1, sizeof *b);
    struct fsdp_param *p = b ? &b->p : NULL;
    if (p) p->priv = &b->priv;
    if (!p || grow((void **)&m->params, &m->priv->cap_params, m->n_params + 1, sizeof(struct fsdp_param *))) {
        free(p);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory adding parameter '%s'", name);
    }
    strcpy(p->name, name);
    p->owner = m;
    p->ndim = ndim;
    memcpy(p->shape, shape, (size_t)ndim * sizeof(int64_t));
    p->numel = numel;
    p->init = init;
    p->no_decay = no_decay;
    m->params[m->n_params++] = p;
    if (out) *out = p;
    return FSDP_OK;
}

enum fsdp_status fsdp_module_add_buffer(struct fsdp_ctx *ctx, struct fsdp_module *m, const char *name,
                                        enum fsdp_dtype dtype, int ndim, const int64_t *shape,
                                        struct fsdp_init init, int persistent, struct fsdp_buffer **out) {
    if (!name || ndim < 0 || ndim > FSDP_MAX_DIMS || strlen(name) >= sizeof((struct fsdp_buffer *)0)->name)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "buffer '%s' of module '%s': bad name or rank %d",
                         name ? name : "(null)", m->name, ndim);
    if (dtype != FSDP_F32 && dtype != FSDP_I64)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "buffer '%s' of module '%s': dtype %s (F32 or I64 only)", name,
                         m->name, fsdp_dtype_name(dtype));
    if (init.kind != FSDP_INIT_ZEROS && init.kind != FSDP_INIT_ONES)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "buffer '%s' of module '%s': init must be zeros or ones", name,
                         m->name);
    int64_t numel = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] <= 0 || numel > INT64_MAX / 8 / shape[i])
            return fsdp__err(ctx, FSDP_ERR_INVALID, "buffer '%s' of module '%s': dim %d is %lld", name, m->name,
                             i, (long long)shape[i]);
        numel *= shape[i];
    }
    for (int i = 0; i < m->n_buffers; i++)
        if (strcmp(m->buffers[i]->name, name) == 0)
            return fsdp__err(ctx, FSDP_ERR_INVALID, "module '%s' already has a buffer '%s'", m->name, name);
    for (int i = 0; i < m->n_params; i++)
        if (strcmp(m->params[i]->name, name) == 0)
            return fsdp__err(ctx, FSDP_ERR_INVALID, "module '%s' already has a parameter '%s'", m->name, name);
    struct fsdp_buffer *b = fsdp__zalloc(1, sizeof *b);
    void *data = fsdp__malloc((size_t)numel * fsdp_dtype_size(dtype));
    if (!b || !data ||
        grow((void **)&m->buffers, &m->priv->cap_buffers, m->n_buffers + 1, sizeof(struct fsdp_buffer *))) {
        free(b);
        free(data);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory adding buffer '%s'", name);
    }
    strcpy(b->name, name);
    b->owner = m;
    b->dtype = dtype;
    b->ndim = ndim;
    if (ndim) memcpy(b->shape, shape, (size_t)ndim * sizeof(int64_t));
    b->numel = numel;
    b->data = data;
    b->init = init;
    b->persistent = persistent;
    for (int64_t i = 0; i < numel; i++) {
        if (dtype == FSDP_F32) ((float *)data)[i] = init.kind == FSDP_INIT_ONES ? 1.0f : 0.0f;
        else ((int64_t *)data)[i] = init.kind == FSDP_INIT_ONES ? 1 : 0;
    }
    m->buffers[m->n_buffers++] = b;
    if (out) *out = b;
    return FSDP_OK;
}

int fsdp_module_foreach_buffer(struct fsdp_module *m, int (*fn)(struct fsdp_buffer *b, void *ud), void *ud) {
    for (int i = 0; i < m->n_buffers; i++) {
        int r = fn(m->buffers[i], ud);
        if (r) return r;
    }
    for (int i = 0; i < m->n_children; i++) {
        int r = fsdp_module_foreach_buffer(m->children[i], fn, ud);
        if (r) return r;
    }
    return 0;
}

struct fsdp_buffer *fsdp_module_find_buffer(struct fsdp_module *root, const char *fqn) {
    for (int i = 0; i < root->n_buffers; i++)
        if (root->buffers[i]->fqn && strcmp(root->buffers[i]->fqn, fqn) == 0) return root->buffers[i];
    for (int i = 0; i < root->n_children; i++) {
        struct fsdp_buffer *b = fsdp_module_find_buffer(root->children[i], fqn);
        if (b) return b;
    }
    return NULL;
}

void fsdp_module_set_training(struct fsdp_module *m, int on) {
    m->training = on ? 1 : 0;
    for (int i = 0; i < m->n_children; i++) fsdp_module_set_training(m->children[i], on);
}

static char *join_name(const char *prefix, const char *name) {
    size_t a = strlen(prefix), b = strlen(name);
    char *s = fsdp__malloc(a + b + 2);
    if (!s) return NULL;
    if (a == 0) {
        memcpy(s, name, b + 1);
    } else {
        memcpy(s, prefix, a);
        s[a] = '.';
        memcpy(s + a + 1, name, b + 1);
    }
    return s;
}

static enum fsdp_status finalize_rec(struct fsdp_ctx *ctx, struct fsdp_module *m, const char *fqn) {
    free(m->fqn);
    m->fqn = fsdp__strdup(fqn);
    if (!m->fqn) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory naming modules");
    for (int i = 0; i < m->n_params; i++) {
        struct fsdp_param *p = m->params[i];
        free(p->fqn);
        p->fqn = join_name(fqn, p->name);
        if (!p->fqn) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory naming parameters");
    }
    for (int i = 0; i < m->n_buffers; i++) {
        struct fsdp_buffer *b = m->buffers[i];
        free(b->fqn);
        b->fqn = join_name(fqn, b->name);
        if (!b->fqn) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory naming buffers");
    }
    for (int i = 0; i < m->n_children; i++) {
        char *c = join_name(fqn, m->children[i]->name);
        if (!c) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory naming modules");
        enum fsdp_status st = finalize_rec(ctx, m->children[i], c);
        free(c);
        FSDP_TRY(st);
    }
    return FSDP_OK;
}

enum fsdp_status fsdp_module_finalize(struct fsdp_ctx *ctx, struct fsdp_module *root) {
    return finalize_rec(ctx, root, "");
}

int fsdp_module_foreach_param(struct fsdp_module *m, int (*fn)(struct fsdp_param *p, void *ud),
                              void *ud) {
    for (int i = 0; i < m->n_params; i++) {
        if (m->params[i]->tied_to) continue;
        int r = fn(m->params[i], ud);
        if (r) return r;
    }
    for (int i = 0; i < m->n_children; i++) {
        int r = fsdp_module_foreach_param(m->children[i], fn, ud);
        if (r) return r;
    }
    return 0;
}

static int add_numel(struct fsdp_param *p, void *ud) {
    *(int64_t *)ud += p->numel;
    return 0;
}

int64_t fsdp_module_numel(struct fsdp_module *m) {
    int64_t n = 0;
    fsdp_module_foreach_param(m, add_numel, &n);
    return n;
}

/* Searches tied parameters too (lm_head.weight is found, and is tied). */
struct fsdp_param *fsdp_module_find_param(struct fsdp_module *root, const char *fqn) {
    for (int i = 0; i < root->n_params; i++)
        if (root->params[i]->fqn && strcmp(root->params[i]->fqn, fqn) == 0) return root->params[i];
    for (int i = 0; i < root->n_children; i++) {
        struct fsdp_param *p = fsdp_module_find_param(root->children[i], fqn);
        if (p) return p;
    }
    return NULL;
}

struct materialize_args {
    struct fsdp_ctx *ctx;
    uint64_t seed;
    enum fsdp_status st;
};

static int materialize_one(struct fsdp_param *p, void *ud) {
    struct materialize_args *a = ud;
    if (!p->fqn) {
        a->st = fsdp__err(a->ctx, FSDP_ERR_STATE, "parameter '%s' has no FQN: call fsdp_module_finalize",
                          p->name);
        return 1;
    }
    if (p->data && !p->priv->owns_data) {
        a->st = fsdp__err(a->ctx, FSDP_ERR_STATE, "parameter '%s' is managed by a sharded model", p->fqn);
        return 1;
    }
    if (!p->data) {
        /* owned storage is freed by fsdp_module_free without a context, so it is
         * accounted to no context (kind PARAM is informational only here) */
        p->data = fsdp__alloc(NULL, (size_t)p->numel * sizeof(float), FSDP_MEM_PARAM, p->fqn);
        if (!p->data) {
            a->st = fsdp__err(a->ctx, FSDP_ERR_NOMEM, "out of memory materializing '%s' (%lld floats)",
                              p->fqn, (long long)p->numel);
            return 1;
        }
        p->priv->owns_data = 1;
    }
    fsdp__init_fill(p->init, a->seed, p->fqn, 0, p->data, (size_t)p->numel);
    return 0;
}

enum fsdp_status fsdp_module_materialize(struct fsdp_ctx *ctx, struct fsdp_module *m, uint64_t seed) {
    struct materialize_args a = {ctx, seed, FSDP_OK};
    fsdp_module_foreach_param(m, materialize_one, &a);
    return a.st;
}

/* A materialized parameter gets its own gradient buffer, freed with the
 * module (owns_data covers both). */
static int zero_grad_one(struct fsdp_param *p, void *ud) {
    struct materialize_args *a = ud;
    if (!p->priv->owns_data) {
        a->st = fsdp__err(a->ctx, FSDP_ERR_STATE, "parameter '%s' is not materialized%s", p->fqn ? p->fqn : p->name,
                          p->fqn ? "" : " (nor finalized: fsdp_module_finalize, then fsdp_module_materialize)");
        return 1;
    }
    if (!p->grad) {
        p->grad = fsdp__alloc(NULL, (size_t)p->numel * sizeof(float), FSDP_MEM_PARAM, p->fqn);
        if (!p->grad) {
            a->st = fsdp__err(a->ctx, FSDP_ERR_NOMEM, "out of memory for the gradient of '%s'", p->fqn);
            return 1;
        }
    }
    memset(p->grad, 0, (size_t)p->numel * sizeof(float));
    return 0;
}

enum fsdp_status fsdp_module_zero_grad(struct fsdp_ctx *ctx, struct fsdp_module *m) {
    struct materialize_args a = {ctx, 0, FSDP_OK};
    fsdp_module_foreach_param(m, zero_grad_one, &a);
    return a.st;
}

/* ---- Dispatchers ----
 *
 * [Note: activation checkpointing]
 * A module with m->checkpoint set keeps only its input across the step:
 *   forward:  mark the arena; ops->forward (children save what they need,
 *             as usual); copy the output aside; release the arena to the
 *             mark; put the output back in the arena (at the mark); save the
 *             input tensor (it lies before the mark, so it survives).
 *   backward: (the unit hooks have gathered m's unit) allocate din before
 *             the mark; mark; ops->forward again on the saved input (the
 *             children's hooks run again: nested units gather and reshard as
 *             in a forward); ops->backward; release to the mark.
 * The recompute runs the same code on the same values with the same thread
 * count, so activations and gradients are bit-identical to a run without
 * checkpointing. The caller must not modify the input in place before the
 * backward (the same rule as for any module that saves its input).
 * Live activations: the inputs of the checkpointed modules plus one
 * module's internals at a time. */

static enum fsdp_status ckpt_forward(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                     const struct fsdp_tensor *in, struct fsdp_tensor *out) {
    size_t mark = fsdp_arena_mark(ctx);
    int alloc_out = out->data == NULL;
    m->priv->ckpt_saved = 0;
    FSDP_TRY(m->ops->forward(m, ctx, in, out));
    if (alloc_out) {
        size_t bytes = (size_t)fsdp_tensor_numel(out) * fsdp_dtype_size(out->dtype);
        void *tmp = fsdp__alloc(ctx, bytes, FSDP_MEM_ACT, "checkpointed output");
        if (!tmp) return FSDP_ERR_NOMEM;
        memcpy(tmp, out->data, bytes);
        fsdp_arena_release(ctx, mark);
        out->data = fsdp_arena_alloc(ctx, bytes);
        if (out->data) memcpy(out->data, tmp, bytes);
        fsdp__free(ctx, tmp);
        if (!out->data)
            return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory for the output of checkpointed '%s'",
                             m->fqn ? m->fqn : m->name);
    } else {
        fsdp_arena_release(ctx, mark);
    }
    m->priv->ckpt_in = *in;
    m->priv->ckpt_saved = 1;
    return FSDP_OK;
}

static enum fsdp_status ckpt_backward(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                      const struct fsdp_tensor *dout, struct fsdp_tensor *din) {
    if (!m->priv->ckpt_saved)
        return fsdp__err(ctx, FSDP_ERR_STATE, "backward of checkpointed module '%s' without its forward",
                         m->fqn ? m->fqn : m->name);
    if (din && !din->data) { /* din outlives the recompute: place it before the mark */
        din->dtype = FSDP_F32;
        din->ndim = m->priv->ckpt_in.ndim;
        din->layout = m->priv->ckpt_in.layout;
        memcpy(din->shape, m->priv->ckpt_in.shape, sizeof din->shape);
        din->data = fsdp_arena_alloc(ctx, (size_t)fsdp_tensor_numel(&m->priv->ckpt_in) * sizeof(float));
        if (!din->data)
            return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory for the input gradient of '%s'",
                             m->fqn ? m->fqn : m->name);
    }
    size_t mark = fsdp_arena_mark(ctx);
    struct fsdp_tensor again = {0};
    ctx->recompute++;
    enum fsdp_status st = m->ops->forward(m, ctx, &m->priv->ckpt_in, &again);
    ctx->recompute--;
    if (st == FSDP_OK) st = m->ops->backward(m, ctx, dout, din);
    fsdp_arena_release(ctx, mark);
    m->priv->ckpt_saved = 0;
    return st;
}

enum fsdp_status fsdp_module_forward(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                     const struct fsdp_tensor *in, struct fsdp_tensor *out) {
    const struct fsdp_module_hooks *h = m->priv->hooks;
    double t[4] = {0}; /* [Note: module profile] */
    int frame = ctx->prof ? fsdp__prof_push(ctx) : 0;
    if (frame) t[0] = fsdp__now();
    if (h && h->pre_forward) FSDP_TRY(h->pre_forward(m->priv->hook_data, ctx));
    if (frame) t[1] = fsdp__now();
    enum fsdp_status st = m->checkpoint ? ckpt_forward(m, ctx, in, out) : m->ops->forward(m, ctx, in, out);
    if (st != FSDP_OK) return fsdp__measure_failed(ctx, m, "forward", st);
    if (frame) t[2] = fsdp__now();
    if (h && h->post_forward) FSDP_TRY(h->post_forward(m->priv->hook_data, ctx));
    if (frame) t[3] = fsdp__now(), fsdp__prof_pop(ctx, m, frame, 0, t);
    return FSDP_OK;
}

enum fsdp_status fsdp_module_backward(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                      const struct fsdp_tensor *dout, struct fsdp_tensor *din) {
    const struct fsdp_module_hooks *h = m->priv->hooks;
    double t[4] = {0}; /* [Note: module profile] */
    int frame = ctx->prof ? fsdp__prof_push(ctx) : 0;
    if (frame) t[0] = fsdp__now();
    if (h && h->pre_backward) FSDP_TRY(h->pre_backward(m->priv->hook_data, ctx));
    if (frame) t[1] = fsdp__now();
    enum fsdp_status st = m->checkpoint ? ckpt_backward(m, ctx, dout, din) : m->ops->backward(m, ctx, dout, din);
    if (st != FSDP_OK) return fsdp__measure_failed(ctx, m, "backward", st);
    if (frame) t[2] = fsdp__now();
    if (h && h->post_backward) FSDP_TRY(h->post_backward(m->priv->hook_data, ctx));
    if (frame) t[3] = fsdp__now(), fsdp__prof_pop(ctx, m, frame, 1, t);
    return FSDP_OK;
}
