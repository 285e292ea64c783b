/*
 * profile.c - time by module: what fsdp_module_forward / fsdp_module_backward
 * spend in each module, summed per module path, for fsdp_profile_print.
 *
 * [Note: module profile] While a context profiles (fsdp_profile_enable), every
 * dispatch times three parts: the module's pre-hooks, its own forward or
 * backward, and its post-hooks. A dispatch inside another (a child called by
 * its parent) adds its whole time to its parent's frame on a stack, so a
 * module's self time is its own forward or backward less its children's
 * dispatches: the layer's arithmetic, its scratch and whatever it calls
 * directly (a Block's residual adds, an attention's heads). Hook time is
 * FSDP's work around a unit (the gather, its 16-bit casts, the reduce-scatter
 * and the waits for them). Entries are keyed by the module's path with its
 * numeric parts folded to '*' (transformer.h.*.attn.c_attn), so the layers
 * of a stack share one entry and its calls count them. A checkpointed
 * module runs its forward again inside its own backward (module.c's
 * ckpt_backward, not a dispatch): that is backward self time, and its
 * children's dispatches in it count as their forward calls. A
 * dispatch that fails does not pop its frame; the next one its parent ends
 * pops to the parent's depth, so the stack mends itself. A dispatch costs
 * four clock reads while profiling; otherwise the dispatchers test one pointer.
 */
#include "nn/nn-impl.h"

#include <string.h>

#define PROF_DEPTH 64

struct fsdp__profile {
    int on;
    int depth;                      /* frames in use */
    double child[PROF_DEPTH + 1];   /* each open frame's children's time */
    struct fsdp_profile_entry *e;   /* entries, in order of first call; each path owned */
    int n, cap;
};

/* "transformer.h.11.attn.c_attn" -> "transformer.h.*.attn.c_attn" */
static void fold(const char *fqn, char *out, size_t cap) {
    size_t o = 0;
    const char *p = fqn[0] ? fqn : "(root)";
    while (*p && o + 1 < cap) {
        const char *e = strchr(p, '.');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        size_t digits = strspn(p, "0123456789");
        if (digits == len && len > 0) out[o++] = '*';
        else
            for (size_t i = 0; i < len && o + 1 < cap; i++) out[o++] = p[i];
        if (!e) break;
        if (o + 1 < cap) out[o++] = '.';
        p = e + 1;
    }
    out[o] = 0;
}

static struct fsdp_profile_entry *entry(struct fsdp__profile *P, const struct fsdp_module *m) {
    char path[512];
    fold(m->fqn ? m->fqn : m->name, path, sizeof path);
    for (int i = P->n - 1; i >= 0; i--) /* the latest first: a stack's layers come in runs */
        if (P->e[i].type == m->ops->type && !strcmp(P->e[i].path, path)) return &P->e[i];
    if (P->n == P->cap) {
        int cap = P->cap ? 2 * P->cap : 32;
        struct fsdp_profile_entry *e = fsdp__realloc(P->e, (size_t)cap * sizeof *e);
        if (!e) return NULL;
        P->e = e;
        P->cap = cap;
    }
    char *copy = fsdp__strdup(path);
    if (!copy) return NULL;
    struct fsdp_profile_entry *e = &P->e[P->n++];
    memset(e, 0, sizeof *e);
    e->path = copy;
    e->type = m->ops->type;
    return e;
}

int fsdp__prof_push(struct fsdp_ctx *ctx) {
    struct fsdp__profile *P = ctx->prof;
    if (!P || !P->on || fsdp__measuring || P->depth >= PROF_DEPTH) return 0;
    P->child[++P->depth] = 0.0;
    return P->depth;
}

void fsdp__prof_pop(struct fsdp_ctx *ctx, const struct fsdp_module *m, int frame, int backward,
                    const double t[4]) {
    struct fsdp__profile *P = ctx->prof;
    if (!frame || !P || frame > P->depth) return;
    double self = (t[2] - t[1]) - P->child[frame], hooks = (t[1] - t[0]) + (t[3] - t[2]);
    P->depth = frame - 1;
    P->child[P->depth] += t[3] - t[0];
    struct fsdp_profile_entry *e = entry(P, m);
    if (!e) return; /* out of memory: this call goes uncounted */
    if (backward) e->bwd_calls++, e->bwd_s += self;
    else e->fwd_calls++, e->fwd_s += self;
    e->hooks_s += hooks;
}

static void clear(struct fsdp__profile *P) {
    for (int i = 0; i < P->n; i++) free((char *)(uintptr_t)P->e[i].path);
    P->n = 0;
    P->depth = 0;
    P->child[0] = 0.0;
}

void fsdp_profile_enable(struct fsdp_ctx *ctx, int on) {
    if (!ctx || (!on && !ctx->prof)) return;
    if (!ctx->prof) ctx->prof = fsdp__zalloc(1, sizeof *ctx->prof);
    if (!ctx->prof) return; /* out of memory: nothing profiled (fsdp_profile_entries says 0) */
    ctx->prof->on = on != 0;
    ctx->prof->depth = 0; /* frames open before the switch are not closed into entries */
}

void fsdp_profile_clear(struct fsdp_ctx *ctx) {
    if (ctx && ctx->prof) clear(ctx->prof);
}

const struct fsdp_profile_entry *fsdp_profile_entries(const struct fsdp_ctx *ctx, int *n) {
    *n = ctx && ctx->prof ? ctx->prof->n : 0;
    return *n ? ctx->prof->e : NULL;
}

static int by_time(const void *a, const void *b) {
    const struct fsdp_profile_entry *x = *(const struct fsdp_profile_entry *const *)a;
    const struct fsdp_profile_entry *y = *(const struct fsdp_profile_entry *const *)b;
    double tx = x->fwd_s + x->bwd_s + x->hooks_s, ty = y->fwd_s + y->bwd_s + y->hooks_s;
    return tx < ty ? 1 : tx > ty ? -1 : 0;
}

void fsdp_profile_print(const struct fsdp_ctx *ctx, FILE *f, int steps) {
    int n;
    const struct fsdp_profile_entry *e = fsdp_profile_entries(ctx, &n);
    double per = steps > 0 ? 1e3 / steps : 1e3, total = 0.0;
    const struct fsdp_profile_entry **order = n ? malloc((size_t)n * sizeof *order) : NULL;
    if (n && !order) return;
    size_t w = strlen("module");
    for (int i = 0; i < n; i++) {
        order[i] = &e[i];
        total += e[i].fwd_s + e[i].bwd_s + e[i].hooks_s;
        if (strlen(e[i].path) > w) w = strlen(e[i].path);
    }
    qsort(order, (size_t)n, sizeof *order, by_time);
    fprintf(f, "%-*s  %-20s %8s %8s %11s %11s %11s %6s\n", (int)w, "module", "type", "fwd", "bwd", "fwd ms",
            "bwd ms", "hooks ms", "share");
    for (int i = 0; i < n; i++) {
        const struct fsdp_profile_entry *x = order[i];
        double t = x->fwd_s + x->bwd_s + x->hooks_s;
        fprintf(f, "%-*s  %-20s %8.1f %8.1f %11.2f %11.2f %11.2f %5.1f%%\n", (int)w, x->path, x->type,
                steps > 0 ? (double)x->fwd_calls / steps : (double)x->fwd_calls,
                steps > 0 ? (double)x->bwd_calls / steps : (double)x->bwd_calls, x->fwd_s * per, x->bwd_s * per,
                x->hooks_s * per, total > 0 ? 100.0 * t / total : 0.0);
    }
    fprintf(f, "%-*s  %-20s %8s %8s %11s %11s %11.2f (ms %s; calls and times %s)\n", (int)w, "total", "", "", "", "",
            "", total * per, steps > 0 ? "a step" : "in all", steps > 0 ? "per step" : "in all");
    free(order);
}

void fsdp__prof_free(struct fsdp_ctx *ctx) {
    if (!ctx || !ctx->prof) return;
    clear(ctx->prof);
    free(ctx->prof->e);
    free(ctx->prof);
    ctx->prof = NULL;
}
