/*
 * arena.c - the per-step activation arena: a bump allocator over a list of
 * chunks. Marks are byte offsets into the logical sequence of allocations, so
 * fsdp_arena_release(mark) frees everything allocated after the mark.
 * Invariant: chunks are never freed during a step, so pointers stay valid
 * until fsdp_arena_reset (or a release below their allocation); after a reset
 * the chunks are merged into one chunk of the step's high-water size, so a
 * steady state has a single chunk and no mallocs.
 *
 * [Note: the arena counts what it hands out] A chunk is reserved, not
 * allocated ([Note: reserved blocks], core-impl.h): it counts as activations
 * up to the furthest byte handed out of it. A step's first pass grows the
 * arena chunk by chunk, and an allocation too large for the top chunk's tail
 * starts a new chunk, skipping that tail: counted whole, the skipped tails
 * and the unused end of the last chunk made GPT-2's first step (one chunk
 * of 196 MiB opened for 3 MiB after the logits) 1264 MiB against the 960 MiB
 * of every later step; their pages are never written, so they are not
 * counted, and the first step costs what the later ones do (to a page per
 * chunk).
 *
 * [Note: one arena chunk] Counted so, a first step still cost more than the
 * later ones where a chunk's used part was released (a layer's scratch) and
 * a later allocation did not fit the rest of it: the released pages stay
 * resident and counted while the new chunk grows (GPT-2 in bf16: 580 MiB in
 * the first step, 526 in every later one). So the first chunk is reserved
 * as one span of address space the size of the machine's memory (or the
 * memory limit; fsdp__reserve_span): every step then runs in that one chunk,
 * which is counted and resident up to the step's high-water mark only, and
 * the first step costs what the later ones do. Where such a mapping is
 * refused (strict overcommit, an address-space limit) or
 * FSDP_ARENA_SPAN=0 is set, the chunks grow as above.
 */
#include "core/core-impl.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

struct fsdp__arena_chunk {
    struct fsdp__arena_chunk *prev; /* older chunk */
    size_t base;                    /* logical offset of this chunk's first byte */
    size_t cap, used;               /* used is relative to this chunk */
    char *mem;
};

#define ARENA_MIN_CHUNK ((size_t)1 << 20)

static size_t round64(size_t n) { return (n + 63) & ~(size_t)63; }

void *fsdp_arena_alloc(struct fsdp_ctx *ctx, size_t bytes) {
    size_t need = round64(bytes ? bytes : 1);
    struct fsdp__arena_chunk *c = ctx->arena;
    if (!c || c->used + need > c->cap) {
        size_t cap = need > ARENA_MIN_CHUNK ? need : ARENA_MIN_CHUNK;
        if (c && cap < c->cap) cap = c->cap; /* grow geometrically-ish */
        struct fsdp__arena_chunk *n = fsdp__alloc(ctx, sizeof *n, FSDP_MEM_ACT, "arena chunk header");
        if (!n) return NULL;
        size_t span = 0; /* [Note: one arena chunk] */
        n->mem = c ? NULL : fsdp__reserve_span(ctx, FSDP_MEM_ACT, cap, &span);
        if (n->mem) cap = span;
        else n->mem = fsdp__reserve(ctx, cap, FSDP_MEM_ACT, "activations");
        if (!n->mem) {
            fsdp__free(ctx, n);
            return NULL;
        }
        n->prev = c;
        n->base = ctx->arena_used;
        n->cap = cap;
        n->used = 0;
        ctx->arena = c = n;
    }
    if (fsdp__commit(ctx, c->mem, c->used + need, "activations")) return NULL; /* the memory limit */
    void *p = c->mem + c->used;
    c->used += need;
    ctx->arena_used = c->base + c->used;
    if (ctx->arena_used > ctx->arena_high) ctx->arena_high = ctx->arena_used;
    return p;
}

enum fsdp_status fsdp__arena_err(struct fsdp_ctx *ctx, const char *fmt, ...) {
    char cause[sizeof ctx->errmsg], mine[sizeof ctx->errmsg];
    snprintf(cause, sizeof cause, "%s", ctx->errmsg);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(mine, sizeof mine, fmt, ap);
    va_end(ap);
    return fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: %s", mine, cause[0] ? cause : "(no cause given)");
}

int fsdp__arena_shrink(struct fsdp_ctx *ctx, void *p, size_t bytes, size_t keep) {
    struct fsdp__arena_chunk *c = ctx->arena;
    size_t have = round64(bytes ? bytes : 1), want = round64(keep ? keep : 1);
    if (!c || want >= have || c->used < have || (char *)p + have != c->mem + c->used) return 0;
    c->used -= have - want;
    ctx->arena_used = c->base + c->used;
    return 1;
}

int fsdp__arena_slide(struct fsdp_ctx *ctx, void *dead, void *p, size_t bytes, size_t *at) {
    struct fsdp__arena_chunk *c = ctx->arena;
    size_t have = round64(bytes ? bytes : 1);
    char *d = dead, *q = p;
    if (!c || d >= q || d < c->mem || ((uintptr_t)d & 63) || q + have != c->mem + c->used) return 0;
    if (!fsdp__measuring) memmove(d, q, bytes);
    *at = c->base + (size_t)(d - c->mem);
    c->used = (size_t)(d - c->mem) + have;
    ctx->arena_used = c->base + c->used;
    return 1;
}

size_t fsdp_arena_mark(struct fsdp_ctx *ctx) { return ctx->arena_used; }

void fsdp_arena_release(struct fsdp_ctx *ctx, size_t mark) {
    struct fsdp__arena_chunk *c = ctx->arena;
    /* chunks that start after the mark are freed (the next reset sizes its one
     * chunk by the high-water mark, so a steady state still never grows) */
    while (c && c->prev && mark < c->base) {
        struct fsdp__arena_chunk *p = c->prev;
        fsdp__free(ctx, c->mem);
        fsdp__free(ctx, c);
        ctx->arena = c = p;
    }
    if (c && mark >= c->base && mark <= c->base + c->used) {
        c->used = mark - c->base;
        ctx->arena_used = mark;
    }
}

void fsdp_arena_reset(struct fsdp_ctx *ctx) {
    struct fsdp__arena_chunk *c = ctx->arena;
    size_t high = ctx->arena_high; /* logical bytes at the high-water mark (no chunk tails) */
    if (c && (c->prev || high > c->cap)) { /* merge into one chunk of the high-water size */
        fsdp__arena_free_all(ctx);
        void *p = fsdp_arena_alloc(ctx, high);
        (void)p;
        c = ctx->arena;
    }
    if (c) c->used = 0;
    ctx->arena_used = 0;
    ctx->arena_high = 0;
}

void fsdp__arena_free_all(struct fsdp_ctx *ctx) {
    struct fsdp__arena_chunk *c = ctx->arena;
    while (c) {
        struct fsdp__arena_chunk *p = c->prev;
        fsdp__free(ctx, c->mem);
        fsdp__free(ctx, c);
        c = p;
    }
    ctx->arena = NULL;
    ctx->arena_used = 0;
}
