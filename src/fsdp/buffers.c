/*
 * buffers.c - a model's buffers seen from the sharding layer: listing them,
 * checking that every rank has the same ones, and broadcasting rank 0's
 * values (sync_module_states, a rank-0 load).
 *
 * [Note: buffers]
 * Buffers (struct fsdp_buffer, src/nn/module.c: batch norm's running
 * statistics, a queue, a counter) are never sharded: every rank holds the
 * full values in the module's own storage, in their own dtype (F32 or I64)
 * whatever the mixed precision (the units' casts never see them). They stay
 * equal across ranks when every rank updates them alike (statistics of an
 * all-reduced batch, fsdp_module_allreduce) or when they come from rank 0:
 *   - sync_module_states broadcasts all of them from rank 0
 *     (fsdp__buffers_broadcast, after the parameters' units);
 *   - the full file holds the persistent ones after the parameters, whole,
 *     under their FQN and dtype; its header key fsdp.buffers lists their
 *     names, so tools without a model tell them from parameters
 *     (ckpt/full.c, ckpt/offline.c);
 *   - a sharded checkpoint holds them whole in file 0 (written by rank 0,
 *     after the parameters and the optimizer state); meta.json's "buffers"
 *     lists each with dtype, shape and byte range, and every rank of any
 *     world size reads them from there (ckpt/sharded.c). A persistent buffer
 *     of the model missing from a checkpoint is an error naming it.
 *   - summon_full_params has nothing to gather for them: b->data is always
 *     the full value and an edit is immediate on the rank that makes it,
 *     with or without write-back (edit alike on every rank).
 * Only persistent buffers (PyTorch's persistent=True) are saved and loaded;
 * non-persistent ones are derived values a module recomputes.
 */
#include "fsdp/fsdp-impl.h"

#include <string.h>

static int add_one(struct fsdp_buffer *b, void *ud) {
    struct fsdp__buflist *l = ud;
    if (l->persistent_only && !b->persistent) return 0;
    if (l->n == l->cap) {
        int ncap = l->cap ? 2 * l->cap : 16;
        void *n = fsdp__realloc(l->b, (size_t)ncap * sizeof *l->b);
        if (!n) return 1;
        l->b = n;
        l->cap = ncap;
    }
    l->b[l->n++] = b;
    return 0;
}

enum fsdp_status fsdp__buffers_list(struct fsdp_ctx *ctx, struct fsdp_module *root, int persistent_only,
                                    struct fsdp__buflist *out) {
    memset(out, 0, sizeof *out);
    out->persistent_only = persistent_only;
    if (fsdp_module_foreach_buffer(root, add_one, out)) {
        fsdp__buffers_list_free(out);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory listing the model's buffers");
    }
    return FSDP_OK;
}

void fsdp__buffers_list_free(struct fsdp__buflist *l) {
    free(l->b);
    memset(l, 0, sizeof *l);
}

size_t fsdp__buffer_bytes(const struct fsdp_buffer *b) { return (size_t)b->numel * fsdp_dtype_size(b->dtype); }

static uint64_t buffer_hash(const struct fsdp_buffer *b) {
    uint64_t x = fsdp__hash_str(b->fqn ? b->fqn : b->name) ^ ((uint64_t)b->ndim * 0x9E3779B97F4A7C15ull);
    x = (x ^ (uint64_t)b->dtype) * 0x100000001B3ull;
    x = (x ^ (uint64_t)(b->persistent != 0)) * 0x100000001B3ull;
    for (int d = 0; d < b->ndim; d++) x = (x ^ (uint64_t)b->shape[d]) * 0x100000001B3ull;
    return x;
}

static void describe(const struct fsdp_buffer *b, char *buf, size_t cap) {
    char sh[96];
    snprintf(buf, cap, "'%s' (%s %s%s)", b->fqn ? b->fqn : b->name, fsdp_dtype_name(b->dtype),
             fsdp__shape_str(sh, sizeof sh, b->ndim, b->shape), b->persistent ? "" : ", not persistent");
}

enum fsdp_status fsdp__buffers_check(struct fsdp_ctx *ctx, struct fsdp_module *root) {
    if (ctx->world == 1) return FSDP_OK;
    struct fsdp__buflist l;
    FSDP_TRY(fsdp__buffers_list(ctx, root, 0, &l));
    uint64_t *h = fsdp__zalloc((size_t)l.n + 1, sizeof *h), total = 0xcbf29ce484222325ull;
    uint64_t *all = fsdp__zalloc((size_t)ctx->world * 2, sizeof *all);
    if (!h || !all) FSDP_ASSERT(0, "out of memory checking the model's buffers"); /* peers would wait */
    for (int i = 0; i < l.n; i++) total = (total ^ (h[i] = buffer_hash(l.b[i]))) * 0x100000001B3ull;
    uint64_t mine[2] = {(uint64_t)l.n, total};
    enum fsdp_status st = fsdp_comm_allgather(ctx->comm, mine, all, sizeof mine, FSDP_U8);
    int differ = 0;
    for (int r = 1; r < ctx->world && st == FSDP_OK; r++) differ |= all[2 * r] != all[0] || all[2 * r + 1] != all[1];
    if (st == FSDP_OK && differ) {
        /* rank 0's per-buffer fingerprints, then the first index that differs anywhere */
        int32_t n0 = l.n, idx = INT32_MAX;
        st = fsdp_comm_broadcast(ctx->comm, &n0, 1, FSDP_I32, 0);
        uint64_t *h0 = st == FSDP_OK ? fsdp__zalloc((size_t)n0 + 1, sizeof *h0) : NULL;
        if (st == FSDP_OK && !h0) FSDP_ASSERT(0, "out of memory checking the model's buffers");
        if (st == FSDP_OK && ctx->rank == 0) memcpy(h0, h, (size_t)n0 * sizeof *h0);
        if (st == FSDP_OK) st = fsdp_comm_broadcast(ctx->comm, h0, (size_t)n0 * sizeof *h0, FSDP_U8, 0);
        for (int i = 0; st == FSDP_OK && i < (l.n > n0 ? l.n : n0); i++)
            if (i >= l.n || i >= n0 || h[i] != h0[i]) {
                idx = i;
                break;
            }
        free(h0);
        int32_t *idxs = fsdp__zalloc((size_t)ctx->world, sizeof *idxs);
        if (!idxs) FSDP_ASSERT(0, "out of memory checking the model's buffers");
        if (st == FSDP_OK) st = fsdp_comm_allgather(ctx->comm, &idx, idxs, 1, FSDP_I32);
        int bad = 1;
        for (int r = 1; r < ctx->world; r++)
            if (idxs[r] < idxs[bad]) bad = r;
        int32_t at = idxs[bad] < INT32_MAX ? idxs[bad] : 0;
        free(idxs);
        char d0[256] = "(no such buffer)", dr[256] = "(no such buffer)";
        if (st == FSDP_OK && ctx->rank == 0 && at < l.n) describe(l.b[at], d0, sizeof d0);
        if (st == FSDP_OK && ctx->rank == bad && at < l.n) describe(l.b[at], dr, sizeof dr);
        if (st == FSDP_OK) st = fsdp_comm_broadcast(ctx->comm, d0, sizeof d0, FSDP_U8, 0);
        if (st == FSDP_OK) st = fsdp_comm_broadcast(ctx->comm, dr, sizeof dr, FSDP_U8, bad);
        if (st == FSDP_OK)
            st = fsdp__err(ctx, FSDP_ERR_INVALID,
                           "parallelize: the model differs across ranks: buffer #%d is %s on rank 0 but %s on rank %d",
                           (int)at, d0, dr, bad);
    }
    free(h);
    free(all);
    fsdp__buffers_list_free(&l);
    return st;
}

enum fsdp_status fsdp__buffers_broadcast(struct fsdp_ctx *ctx, struct fsdp_module *root) {
    if (ctx->world == 1) return FSDP_OK;
    struct fsdp__buflist l;
    FSDP_TRY(fsdp__buffers_list(ctx, root, 0, &l));
    char saved[64];
    snprintf(saved, sizeof saved, "%s", fsdp_comm_tag(ctx->comm));
    enum fsdp_status st = FSDP_OK;
    for (int i = 0; i < l.n && st == FSDP_OK; i++) {
        char tag[64];
        snprintf(tag, sizeof tag, "buffer %s", l.b[i]->fqn);
        fsdp_comm_set_tag(ctx->comm, tag);
        st = fsdp_comm_broadcast(ctx->comm, l.b[i]->data, (size_t)l.b[i]->numel, l.b[i]->dtype, 0);
        if (st != FSDP_OK) {
            char cause[sizeof ctx->errmsg];
            snprintf(cause, sizeof cause, "%s", ctx->errmsg);
            st = fsdp__err(ctx, st, "broadcasting buffer '%s' from rank 0: %s", l.b[i]->fqn, cause);
        }
    }
    fsdp_comm_set_tag(ctx->comm, saved);
    fsdp__buffers_list_free(&l);
    return st;
}
