/*
 * plan_helpers.h - what the memory planner's tests (test_mpi_plan.c,
 * test_mpi_plan_models.c) share: TRY for builders that return a status,
 * measure_from (the real run's counters from an empty arena) and
 * check_equal (the plan against the run to the byte, every kind and the
 * total at its peak). Include after fsdp.h, harness.h and mpi_harness.h.
 */
#ifndef FSDP_TEST_PLAN_HELPERS_H
#define FSDP_TEST_PLAN_HELPERS_H

#include <stdio.h>

/* internal (core-impl.h): frees the activation arena, so that each test
 * measures its own arena from empty */
void fsdp__arena_free_all(struct fsdp_ctx *ctx);

#define TRY(expr)                                   \
    do {                                            \
        enum fsdp_status st_ = (expr);              \
        if (st_ != FSDP_OK) return st_;             \
    } while (0)

/* The real run's counters from here: an empty arena, peaks at the current values. */
static inline void measure_from(struct fsdp_ctx *c, struct fsdp_mem_stats *m0) {
    fsdp__arena_free_all(c);
    fsdp_mem_reset_peak(c);
    fsdp_mem_get(c, m0);
}

/* The plan against the run measured since m0 (sharding, attaching, two
 * steps): every kind to the byte, the total at its peak too. */
static inline void check_equal(struct fsdp_ctx *c, const struct fsdp_mem_plan *plan, const struct fsdp_mem_stats *m0,
                        const char *what) {
    struct fsdp_mem_stats m;
    fsdp_mem_get(c, &m);
    CHECK_INT_EQ(plan->world, fsdp_ctx_world(c));
    CHECK_INT_EQ(m.cur[FSDP_MEM_SHARD] - m0->cur[FSDP_MEM_SHARD], plan->params + plan->grads + plan->optim);
    CHECK_INT_EQ(m.peak[FSDP_MEM_FULL] - m0->cur[FSDP_MEM_FULL], plan->full);
    CHECK_INT_EQ(m.peak[FSDP_MEM_ACT] - m0->cur[FSDP_MEM_ACT], plan->act);
    /* comm requests (the backend's size), MPI's staging of 16-bit reductions */
    CHECK_INT_EQ(m.peak[FSDP_MEM_OTHER] - m0->cur[FSDP_MEM_OTHER], plan->workspace);
    CHECK_INT_EQ(m.peak_total - m0->cur_total, plan->total);
    if (test_rank == 0 && fsdp_ctx_world(c) == 2)
        fprintf(stderr, "  %s: plan %zu (shards %zu, full %zu, act %zu, workspace %zu) = measured peak %zu\n", what,
                plan->total, plan->params + plan->grads + plan->optim, plan->full, plan->act, plan->workspace,
                m.peak_total - m0->cur_total);
}

#endif
