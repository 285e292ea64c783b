/*
 * test_mpi_arena.c - the activation arena (src/core/arena.c) on each rank
 * (tests/run.sh runs it at 1..4 ranks): what it counts over growing chunks
 * and in its one span, and the bytes it lends from its released top
 * ([Note: bytes lent by the arena]). The planner's use of it:
 * test_mpi_plan.c.
 */
#include "fsdp.h"
#include "harness.h"

#include <mpi.h>

#include "mpi_harness.h"

#include <stdlib.h>

/* internal (core-impl.h): frees the activation arena; lends from it */
void fsdp__arena_free_all(struct fsdp_ctx *ctx);
void *fsdp__arena_lend(struct fsdp_ctx *ctx, size_t bytes, void *lender,
                       void (*reclaim_fn)(struct fsdp_ctx *ctx, void *lender));
void fsdp__arena_unlend(struct fsdp_ctx *ctx);

/* growing chunks (on) or the one span ([Note: one arena chunk]), from an empty arena */
static void chunked(int on) {
    if (on) setenv("FSDP_ARENA_SPAN", "0", 1);
    else unsetenv("FSDP_ARENA_SPAN");
    fsdp__arena_free_all(get_ctx());
}

/* an empty arena, the peaks reset, the counters now in m0 */
static void measure_from(struct fsdp_ctx *c, struct fsdp_mem_stats *m0) {
    fsdp__arena_free_all(c);
    fsdp_mem_reset_peak(c);
    fsdp_mem_get(c, m0);
}

/* [Note: the arena counts what it hands out]: allocations that each open a
 * chunk (9, 12, 196 MiB, then 3 MiB that opens a fourth chunk as large as
 * the third) count what they use, to a page per chunk, not the chunks'
 * 413 MiB; every byte handed out is written. */
TEST(arena_counts_what_it_hands_out) {
    chunked(1);
    struct fsdp_ctx *c = get_ctx();
    struct fsdp_mem_stats m0, m;
    measure_from(c, &m0);
    const size_t MiB = (size_t)1 << 20, sizes[4] = {9 * MiB, 12 * MiB, 196 * MiB, 3 * MiB};
    size_t used = 0;
    for (int i = 0; i < 4; i++) {
        char *p = fsdp_arena_alloc(c, sizes[i]);
        ASSERT(p != NULL);
        memset(p, 0x5a, sizes[i]);
        used += sizes[i];
    }
    fsdp_mem_get(c, &m);
    size_t act = m.peak[FSDP_MEM_ACT] - m0.cur[FSDP_MEM_ACT];
    if (!(act >= used && act <= used + 4 * (4096 + 64)))
        TEST_FAILF("activations counted %zu bytes for %zu handed out in 4 chunks", act, used);
    fsdp_arena_reset(c); /* one chunk of the high-water size and its header */
    fsdp_mem_get(c, &m);
    size_t steady = m.cur[FSDP_MEM_ACT] - m0.cur[FSDP_MEM_ACT];
    if (!(steady >= used && steady <= used + 64)) TEST_FAILF("one chunk counted %zu bytes for %zu", steady, used);
    char *p = fsdp_arena_alloc(c, used);
    ASSERT(p != NULL);
    memset(p, 0x5a, used);
    fsdp_mem_get(c, &m);
    CHECK_INT_EQ(m.cur[FSDP_MEM_ACT] - m0.cur[FSDP_MEM_ACT], steady);
    fsdp__arena_free_all(c);
    chunked(0);
}

/* [Note: one arena chunk]: the same allocations in the one span (where the
 * machine maps it): counted as handed out, in one chunk that a reset keeps;
 * a release to a mark and a larger allocation after it stay in the chunk
 * (the chunked arena would open a second one there and count both). */
TEST(arena_runs_in_one_span) {
    if (!arena_span_expected()) SKIP("no span here (strict overcommit or an address-space limit)");
    struct fsdp_ctx *c = get_ctx();
    fsdp__arena_free_all(c);
    struct fsdp_mem_stats m0, m;
    measure_from(c, &m0);
    const size_t MiB = (size_t)1 << 20, sizes[4] = {9 * MiB, 12 * MiB, 196 * MiB, 3 * MiB};
    size_t used = 0;
    char *first = NULL;
    for (int i = 0; i < 4; i++) {
        char *p = fsdp_arena_alloc(c, sizes[i]);
        ASSERT(p != NULL);
        if (!first) first = p;
        else if (p != first + used) TEST_FAILF("allocation %d opened a chunk of its own", i);
        memset(p, 0x5a, sizes[i]);
        used += sizes[i];
    }
    fsdp_mem_get(c, &m);
    size_t act = m.peak[FSDP_MEM_ACT] - m0.cur[FSDP_MEM_ACT];
    if (!(act >= used && act <= used + 4096 + 64)) TEST_FAILF("one span counted %zu bytes for %zu", act, used);
    fsdp_arena_release(c, 9 * MiB);          /* back to after the first */
    char *p = fsdp_arena_alloc(c, 300 * MiB); /* larger than what was released */
    ASSERT(p == first + 9 * MiB);
    memset(p, 0x5a, 300 * MiB);
    fsdp_mem_get(c, &m);
    act = m.peak[FSDP_MEM_ACT] - m0.cur[FSDP_MEM_ACT];
    if (!(act >= 309 * MiB && act <= 309 * MiB + 4096 + 64))
        TEST_FAILF("one span counted %zu bytes for a high-water mark of %zu", act, 309 * MiB);
    fsdp_arena_reset(c); /* the same chunk: nothing freed or merged */
    CHECK(fsdp_arena_alloc(c, 64) == first);
    fsdp__arena_free_all(c);
}

/* fsdp__arena_lend ([Note: bytes lent by the arena]): bytes at the top of
 * what the arena has handed out, above what is in use by at least an eighth
 * of it; none where that room is missing; an allocation that would reach
 * them goes to a chunk of its own (the lent bytes untouched) and the room
 * kept below lent bytes grows; all lent bytes come back at once. */
static int reclaims;
static void count_reclaim(struct fsdp_ctx *cx, void *lender) {
    (void)cx;
    (*(int *)lender)++;
}

TEST(arena_lends_its_released_top) {
    struct fsdp_ctx *c = get_ctx();
    fsdp__arena_free_all(c); /* and the room it learned */
    reclaims = 0;
    char *base = fsdp_arena_alloc(c, 1 << 20);
    ASSERT(base != NULL);
    size_t mark = fsdp_arena_mark(c);
    ASSERT(fsdp_arena_alloc(c, 7 << 20) != NULL); /* the top: 8 MiB handed out */
    CHECK(fsdp__arena_lend(c, (1 << 20), &reclaims, count_reclaim) == NULL);   /* all of it in use */
    fsdp_arena_release(c, mark);
    char *g1 = fsdp__arena_lend(c, (3 << 20), &reclaims, count_reclaim), *g2 = fsdp__arena_lend(c, (3 << 20), &reclaims, count_reclaim);
    CHECK(g1 == base + (5 << 20)); /* [5, 8) MiB */
    CHECK(g2 == base + (2 << 20)); /* [2, 5) MiB */
    CHECK(fsdp__arena_lend(c, (64), &reclaims, count_reclaim) == NULL); /* [1, 2) MiB left: less than 8 MiB / 8 above the 1 in use */
    ASSERT(g1 && g2);
    memset(g1, 1, 3 << 20);
    memset(g2, 2, 3 << 20);
    char *a = fsdp_arena_alloc(c, 512 << 10); /* fits below the lent bytes */
    CHECK(a == base + (1 << 20));
    char *big = fsdp_arena_alloc(c, 3 << 20); /* would reach them by 2.5 MiB: a chunk of its own */
    ASSERT(big != NULL);
    CHECK(big < base || big >= base + (8 << 20));
    memset(big, 3, 3 << 20);
    int kept = 1;
    for (size_t i = 0; i < (3u << 20); i += 4096) kept &= g1[i] == 1 && g2[i] == 2;
    CHECK(kept);
    fsdp_arena_release(c, mark);
    fsdp__arena_unlend(c); /* the lender gives them back: no call */
    /* 2.5 MiB kept free below lent bytes from now on, not 1 */
    CHECK(fsdp__arena_lend(c, (5 << 20), &reclaims, count_reclaim) == NULL); /* [3, 8): 2 MiB above the 1 in use */
    CHECK(fsdp__arena_lend(c, (4 << 20), &reclaims, count_reclaim) == base + (4 << 20));
    int other;
    CHECK(fsdp__arena_lend(c, (64), &other, count_reclaim) == NULL); /* one lender at a time */
    CHECK_INT_EQ(reclaims, 0);
    fsdp_arena_reset(c); /* gives every lent byte back, after the lender took what it keeps there */
    CHECK_INT_EQ(reclaims, 1);
    fsdp_arena_reset(c);
    CHECK_INT_EQ(reclaims, 1); /* nothing lent: no call */
    CHECK(fsdp_arena_alloc(c, 64) == base); /* the same chunk */
    fsdp__arena_free_all(c);
}

TEST_MAIN()
