/*
 * strategy.c - the sharding strategies (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD,
 * HYBRID_SHARD) as one mechanism: a model's shard group and replica group.
 * fsdp__sharding_layout computes the group sizes and this rank's place in
 * them (pure, so the memory planner can use it for any world);
 * fsdp__sharding_comms makes the communicators (a split for hybrid).
 *
 * [Note: sharding strategies]
 * The world of W ranks is a 2-D mesh (W/K replicas) x (K shards): rank r is
 * shard r % K of shard group r / K and replica r / K of replica group r % K.
 * Every unit pads its flat buffer to a multiple of K and shards it over its
 * shard group exactly as FULL_SHARD shards over the world (wrap.c, unit.c);
 * after the reduce-scatter inside the group, the gradient shard is
 * all-reduced over the replica group (under overlap a second pipeline stage,
 * [Note: prefetch and overlap] in unit.c), then divided by W, so every rank holds
 * the average over the global batch. Replicas hold identical shards, so
 * global norms sum over the shard group only (each element once) and the
 * checkpoint code writes from replica 0 only.
 *   FULL_SHARD, SHARD_GRAD_OP: K = W (no replica group); SHARD_GRAD_OP also
 *     keeps every unit gathered from forward to backward.
 *   NO_SHARD: K = 1: the shard is the whole flat buffer (no gather), the
 *     gradient is all-reduced over the world (DDP).
 *   HYBRID_SHARD: K = shard_group, by default the number of ranks on this
 *     host (ranks are assumed numbered host by host, as mpirun does by
 *     default); the planner's measuring communicator, which sees no hosts, takes K = W
 *     then.
 */
#include "fsdp/fsdp-impl.h"
#include "comm/comm-impl.h"

#include <string.h>
#include <strings.h>

static const char *const names[] = {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"};

const char *fsdp_sharding_name(enum fsdp_sharding s) {
    return (unsigned)s < sizeof names / sizeof names[0] ? names[s] : "?";
}

enum fsdp_status fsdp_sharding_parse(struct fsdp_ctx *ctx, const char *text, enum fsdp_sharding *out) {
    for (unsigned i = 0; text && i < sizeof names / sizeof names[0]; i++)
        if (!strcasecmp(text, names[i])) {
            *out = (enum fsdp_sharding)i;
            return FSDP_OK;
        }
    return fsdp__err(ctx, FSDP_ERR_INVALID,
                     "sharding '%s' is not one of FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD",
                     text ? text : "(null)");
}

enum fsdp_status fsdp__sharding_layout(struct fsdp_ctx *ctx, const struct fsdp_shard_opts *o, int world,
                                       int rank, int local, struct fsdp_model *fm) {
    int k;
    switch (o->sharding) {
    case FSDP_FULL_SHARD:
    case FSDP_SHARD_GRAD_OP:
    case FSDP_NO_SHARD:
        if (o->shard_group != 0)
            return fsdp__err(ctx, FSDP_ERR_INVALID,
                             "shard group (--shard-group) %d is only for HYBRID_SHARD, not %s",
                             o->shard_group, fsdp_sharding_name(o->sharding));
        k = o->sharding == FSDP_NO_SHARD ? 1 : world;
        break;
    case FSDP_HYBRID_SHARD:
        if (o->shard_group < 0)
            return fsdp__err(ctx, FSDP_ERR_INVALID, "shard group (--shard-group) %d must be positive",
                             o->shard_group);
        k = o->shard_group ? o->shard_group : local > 0 ? local : world;
        if (world % k != 0)
            return fsdp__err(ctx, FSDP_ERR_INVALID,
                             "HYBRID_SHARD: shard group (--shard-group) of %d ranks does not divide the "
                             "world of %d ranks", k, world);
        break;
    default:
        return fsdp__err(ctx, FSDP_ERR_INVALID, "sharding (--sharding) %d is not a strategy", (int)o->sharding);
    }
    fm->sharding = o->sharding;
    fm->shard_size = k;
    fm->shard_rank = rank % k;
    fm->rep_size = world / k;
    fm->rep_rank = rank / k;
    return FSDP_OK;
}

enum fsdp_status fsdp__sharding_comms(struct fsdp_ctx *ctx, const struct fsdp_shard_opts *o,
                                      struct fsdp_model *fm) {
    int local = 0;
    if (o->sharding == FSDP_HYBRID_SHARD && o->shard_group == 0) {
        /* every rank must pick the same K: the smallest host decides, and
         * hosts of different sizes are an error */
        FSDP_TRY(fsdp_comm_local_size(ctx->comm, &local));
        int32_t mine[2] = {local, -local}, agg[2];
        FSDP_TRY(fsdp_comm_allreduce(ctx->comm, mine, agg, 2, FSDP_I32, FSDP_MAX));
        if (agg[0] != -agg[1])
            return fsdp__err(ctx, FSDP_ERR_UNSUPPORTED,
                             "HYBRID_SHARD: hosts run different numbers of ranks (%d to %d): give "
                             "--shard-group", -agg[1], agg[0]);
    }
    FSDP_TRY(fsdp__sharding_layout(ctx, o, ctx->world, ctx->rank, local, fm));
    if (fm->shard_size == ctx->world) fm->shard_comm = ctx->world > 1 ? ctx->comm : NULL;
    if (fm->rep_size == ctx->world) fm->rep_comm = ctx->world > 1 ? ctx->comm : NULL;
    int measure = !strcmp(fsdp_comm_backend(ctx->comm), "measure"); /* no peers to split with */
    if (fm->shard_size > 1 && fm->shard_size < ctx->world) {
        FSDP_TRY(measure ? fsdp__comm_measure_group(ctx->comm, fm->shard_size, fm->shard_rank, &fm->shard_comm)
                         : fsdp_comm_split(ctx->comm, fm->rep_rank, ctx->rank, &fm->shard_comm));
        fm->own_shard_comm = 1;
    }
    if (fm->rep_size > 1 && fm->rep_size < ctx->world) {
        FSDP_TRY(measure ? fsdp__comm_measure_group(ctx->comm, fm->rep_size, fm->rep_rank, &fm->rep_comm)
                         : fsdp_comm_split(ctx->comm, fm->shard_rank, ctx->rank, &fm->rep_comm));
        fm->own_rep_comm = 1;
    }
    return FSDP_OK;
}

void fsdp__sharding_free(struct fsdp_model *fm) {
    if (fm->own_shard_comm) fsdp_comm_free(fm->shard_comm);
    if (fm->own_rep_comm) fsdp_comm_free(fm->rep_comm);
    fm->shard_comm = fm->rep_comm = NULL;
    fm->own_shard_comm = fm->own_rep_comm = 0;
}
