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
    size_t hw;                      /* the furthest byte ever handed out (resident, counted) */
    size_t lent;                    /* bytes lent at the top of [0, hw) (fsdp__arena_lend) */
    char *mem;
};

#define ARENA_MIN_CHUNK ((size_t)1 << 20)

static size_t round64(size_t n) { return (n + 63) & ~(size_t)63; }

void *fsdp_arena_alloc(struct fsdp_ctx *ctx, size_t bytes) {
    size_t need = round64(bytes ? bytes : 1);
    struct fsdp__arena_chunk *c = ctx->arena;
    int met = c && c->lent && c->used + need > c->hw - c->lent && c->used + need <= c->cap;
    if (met) /* the lent bytes are in the way: a chunk of its own, and more room left from now on */
        ctx->arena_lend_room = 2 * ctx->arena_lend_room + (c->used + need - (c->hw - c->lent));
    if (!c || c->used + need > (c->lent ? c->hw - c->lent : c->cap)) {
        size_t cap = need > ARENA_MIN_CHUNK ? need : ARENA_MIN_CHUNK;
        if (c && cap < c->cap && !met) cap = c->cap; /* grow geometrically-ish */
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
        n->used = n->hw = n->lent = 0;
        ctx->arena = c = n;
    }
    if (fsdp__commit(ctx, c->mem, c->used + need, "activations")) return NULL; /* the memory limit */
    void *p = c->mem + c->used;
    c->used += need;
    if (c->used > c->hw) c->hw = c->used;
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

void *fsdp__arena_slide(struct fsdp_ctx *ctx, size_t mark, void *p, size_t bytes) {
    struct fsdp__arena_chunk *c = ctx->arena;
    size_t have = round64(bytes ? bytes : 1);
    char *q = p;
    if (!c || mark < c->base || (mark & 63) || q < c->mem || q + have != c->mem + c->used) return NULL;
    char *d = c->mem + (mark - c->base);
    if (d > q) return NULL;
    if (d != q && !fsdp__measuring) memmove(d, q, bytes);
    c->used = (size_t)(d - c->mem) + have;
    ctx->arena_used = c->base + c->used;
    return d;
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

/* The oldest chunk, the one that lends (a release never frees it), or NULL. */
static struct fsdp__arena_chunk *base_chunk(struct fsdp_ctx *ctx) {
    struct fsdp__arena_chunk *b = ctx->arena;
    while (b && b->prev) b = b->prev;
    return b;
}

/* Lent bytes outstanding: their lender moves or drops what it keeps in them. */
static void reclaim(struct fsdp_ctx *ctx) {
    struct fsdp__arena_chunk *b = base_chunk(ctx);
    if (b && b->lent && ctx->arena_reclaim) ctx->arena_reclaim(ctx, ctx->arena_lender);
    fsdp__arena_unlend(ctx);
}

void fsdp_arena_reset(struct fsdp_ctx *ctx) {
    reclaim(ctx);
    struct fsdp__arena_chunk *c = ctx->arena;
    size_t high = ctx->arena_high; /* logical bytes at the high-water mark (no chunk tails) */
    if (c && (c->prev || high > c->cap)) { /* merge into one chunk of the high-water size */
        size_t room = ctx->arena_lend_room; /* what the arena learned stays */
        fsdp__arena_free_all(ctx);
        ctx->arena_lend_room = room;
        void *p = fsdp_arena_alloc(ctx, high);
        (void)p;
        c = ctx->arena;
    }
    if (c) c->used = 0; /* nothing lent: reclaim took it back */
    ctx->arena_used = 0;
    ctx->arena_high = 0;
}

/* [Note: bytes lent by the arena] Backward releases what a unit's forward
 * saved as it goes (GPT's blocks: src/models/gpt.c), but the pages stay
 * resident up to the step's high-water mark, the forward's peak, for the next
 * step. A gradient shard is born in backward and ends before the next step's
 * forward (src/fsdp/unit.c, [Note: gradient shards born in backward]), so it
 * can live in those pages: fsdp__arena_lend hands out bytes at the top of the oldest
 * chunk's resident part, [hw - lent - bytes, hw - lent), while what is in use
 * below them ends at least ARENA_LEND_ROOM of hw lower, room for the rest of
 * backward's scratch. They cost no page and no count (the plan sees them in
 * the activations' figure), and are all given back at once
 * (fsdp__arena_unlend; a reset or free first calls the lender's reclaim
 * function, which moves or drops what it keeps there: another model's
 * forward on the same context, say). An allocation that would reach
 * them takes a chunk of its own instead, of its own size (new pages, this
 * once), and the room kept free below lent bytes grows by twice what it
 * lacked, so a later step lends less and runs in the one chunk again. */
#define ARENA_LEND_ROOM 8 /* at least hw / 8 kept free below the lent bytes */

void *fsdp__arena_lend(struct fsdp_ctx *ctx, size_t bytes, void *lender,
                       void (*reclaim_fn)(struct fsdp_ctx *ctx, void *lender)) {
    struct fsdp__arena_chunk *b = base_chunk(ctx);
    size_t need = round64(bytes ? bytes : 1);
    if (!b || b->hw - b->lent < need || (b->lent && ctx->arena_lender != lender)) return NULL;
    size_t at = b->hw - b->lent - need, room = b->hw / ARENA_LEND_ROOM;
    if (room < ctx->arena_lend_room) room = ctx->arena_lend_room;
    if (at < b->used || at - b->used < room) return NULL;
    b->lent += need;
    ctx->arena_lender = lender;
    ctx->arena_reclaim = reclaim_fn;
    if (b->lent > ctx->arena_lent_high) ctx->arena_lent_high = b->lent;
    return b->mem + at;
}

void fsdp__arena_unlend(struct fsdp_ctx *ctx) {
    struct fsdp__arena_chunk *b = base_chunk(ctx);
    if (b) b->lent = 0;
    ctx->arena_lender = NULL;
    ctx->arena_reclaim = NULL;
}

void fsdp__arena_free_all(struct fsdp_ctx *ctx) {
    reclaim(ctx);
    struct fsdp__arena_chunk *c = ctx->arena;
    while (c) {
        struct fsdp__arena_chunk *p = c->prev;
        fsdp__free(ctx, c->mem);
        fsdp__free(ctx, c);
        c = p;
    }
    ctx->arena = NULL;
    ctx->arena_used = 0;
    ctx->arena_lend_room = 0; /* a fresh arena learns its own */
}
