/*
 * ctx.c - creating and freeing the per-rank context: the allocation from
 * core, the communicator from comm, the thread count for compute.
 * Sits in fsdp/ because it is the first layer that may use every other.
 */
#include "core/core-impl.h"
#include "comm/comm-impl.h"
#include "nn/nn-impl.h"

#include <omp.h>
#include <unistd.h>

struct fsdp_ctx_opts fsdp_ctx_opts_default(void) {
    struct fsdp_ctx_opts o = {0};
    o.comm = FSDP_COMM_AUTO;
    return o;
}

enum fsdp_status fsdp_ctx_create(const struct fsdp_ctx_opts *opts, struct fsdp_ctx **out) {
    struct fsdp_ctx_opts def = fsdp_ctx_opts_default();
    if (!opts) opts = &def;
    if (opts->threads < 0) return FSDP_ERR_INVALID;
    char env_msg[768];
    if (fsdp_env_check(env_msg, sizeof env_msg) != FSDP_OK) { /* [Note: environment variables] */
        fprintf(stderr, "fsdp: %s\n", env_msg);
        return FSDP_ERR_INVALID;
    }
    struct fsdp_ctx *ctx;
    FSDP_TRY(fsdp__ctx_alloc(&ctx));
    ctx->verbose = opts->verbose;
    ctx->threads = opts->threads;
    if (opts->threads > 0) omp_set_num_threads(opts->threads);
    enum fsdp_status st = fsdp__comm_create(ctx, opts->comm, &ctx->comm);
    if (st != FSDP_OK) {
        fprintf(stderr, "fsdp: cannot create the communicator: %s\n", ctx->errmsg);
        fsdp__ctx_release(ctx);
        return st;
    }
    ctx->rank = fsdp_comm_rank(ctx->comm);
    ctx->world = fsdp_comm_size(ctx->comm);
    fsdp__global_rank = ctx->rank;
    if (ctx->rank == 0) { /* [Note: vector paths at run time] */
        enum fsdp__isa l = fsdp__cpu_isa(), cpu = fsdp__cpu_isa_detected();
        fsdp__log(ctx, 1, "fsdp: the library's vector paths: %s%s%s%s", fsdp__isa_name(l),
                  l != cpu ? " (the CPU's: " : "", l != cpu ? fsdp__isa_name(cpu) : "",
                  l != cpu ? "; FSDP_MAX_CPU_ISA caps them)" : "");
    }
    *out = ctx;
    return FSDP_OK;
}

void fsdp_ctx_free(struct fsdp_ctx *ctx) {
    if (!ctx) return;
    fsdp__comm_free(ctx->comm);
    fsdp__prof_free(ctx); /* [Note: module profile] (src/nn) */
    fsdp__ctx_release(ctx);
}

void fsdp_ctx_abort(struct fsdp_ctx *ctx, int code) {
    fflush(NULL);
    if (ctx && ctx->comm) fsdp__comm_abort(ctx->comm, code);
    _exit(code);
}

struct fsdp_comm *fsdp_ctx_comm(struct fsdp_ctx *ctx) { return ctx->comm; }
