/*
 * arena_plan.c - a simulation of the activation arena (arena.c) for the
 * memory planner: it replays a sequence of allocations, marks, releases and
 * resets over chunk sizes only, with the same chunk policy, and reports the
 * peak bytes the real arena would hold (FSDP_MEM_ACT), without allocating.
 * Invariant: alloc/release/reset follow fsdp_arena_alloc, fsdp_arena_release
 * and fsdp_arena_reset exactly; change them together (the planner's test in
 * tests/test_plan.c compares the two on the tiny model).
 */
#include "core/core-impl.h"

#include <string.h>

#define SIM_MIN_CHUNK ((size_t)1 << 20) /* ARENA_MIN_CHUNK in arena.c */
#define SIM_HDR ((size_t)40)            /* sizeof(struct fsdp__arena_chunk) */

static size_t round64(size_t n) { return (n + 63) & ~(size_t)63; }

static void sim_note(struct fsdp__arena_sim *s, size_t extra) {
    if (s->live + extra > s->peak) s->peak = s->live + extra;
}

static int sim_push(struct fsdp__arena_sim *s, size_t cap) {
    if (s->n == s->cap_chunks) {
        int ncap = s->cap_chunks ? 2 * s->cap_chunks : 64;
        void *c = realloc(s->chunks, (size_t)ncap * sizeof *s->chunks);
        if (!c) {
            s->failed = 1;
            return 0;
        }
        s->chunks = c;
        s->cap_chunks = ncap;
    }
    s->chunks[s->n].base = s->used;
    s->chunks[s->n].cap = cap;
    s->chunks[s->n].used = 0;
    s->n++;
    s->live += cap + SIM_HDR;
    sim_note(s, 0);
    return 1;
}

void fsdp__arena_sim_alloc(struct fsdp__arena_sim *s, size_t bytes) {
    size_t need = round64(bytes ? bytes : 1);
    struct fsdp__arena_sim_chunk *c = s->n ? &s->chunks[s->n - 1] : NULL;
    if (!c || c->used + need > c->cap) {
        size_t cap = need > SIM_MIN_CHUNK ? need : SIM_MIN_CHUNK;
        if (c && cap < c->cap) cap = c->cap;
        if (!sim_push(s, cap)) return;
        c = &s->chunks[s->n - 1];
    }
    c->used += need;
    s->used = c->base + c->used;
    if (s->used > s->high) s->high = s->used;
}

void fsdp__arena_sim_release(struct fsdp__arena_sim *s, size_t mark) {
    while (s->n > 1 && mark < s->chunks[s->n - 1].base) {
        s->live -= s->chunks[s->n - 1].cap + SIM_HDR;
        s->n--;
    }
    struct fsdp__arena_sim_chunk *c = s->n ? &s->chunks[s->n - 1] : NULL;
    if (c && mark >= c->base && mark <= c->base + c->used) {
        c->used = mark - c->base;
        s->used = mark;
    }
}

void fsdp__arena_sim_reset(struct fsdp__arena_sim *s) {
    size_t high = s->high;
    if (s->n && (s->n > 1 || high > s->chunks[0].cap)) {
        s->n = 0;
        s->live = 0;
        s->used = 0;
        fsdp__arena_sim_alloc(s, high);
    }
    if (s->n) s->chunks[s->n - 1].used = 0;
    s->used = 0;
    s->high = 0;
}

void fsdp__arena_sim_transient(struct fsdp__arena_sim *s, size_t bytes) { sim_note(s, bytes); }

void fsdp__arena_sim_free(struct fsdp__arena_sim *s) {
    free(s->chunks);
    memset(s, 0, sizeof *s);
}
