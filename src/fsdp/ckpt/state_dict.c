/*
 * ckpt/state_dict.c - checkpoints of the kind the model's config names
 * (Composer's FSDP2Config): state_dict_type chooses what fsdp_model_save
 * writes, a sharded folder (sharded.c) or one full safetensors file
 * (full.c); fsdp_model_load reads either kind, and a full file with
 * load_monolith_rank0_only on rank 0 alone, which sends it unit by unit, so
 * that the other ranks never open the file (it need not exist there).
 * Nothing here writes or reads a byte itself: it dispatches to the writers
 * and readers of the other files.
 */
#include "fsdp/fsdp-impl.h"

#include <errno.h>
#include <string.h>
#include <sys/stat.h>

enum fsdp_status fsdp_model_save(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *path,
                                 const struct fsdp_ckpt_meta *meta) {
    if (fm->state_dict_type == FSDP_STATE_DICT_SHARDED) return fsdp_ckpt_save(ctx, fm, path, meta);
    return fsdp_model_save_full(ctx, fm, path);
}

enum fsdp_status fsdp_model_load(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *path,
                                 struct fsdp_ckpt_meta *meta) {
    /* rank 0 tells what path is (1 a folder, 2 a file, else -errno): with
     * load_monolith_rank0_only the other ranks never look at it */
    int32_t kind = 0;
    if (ctx->rank == 0 || !fm->load_monolith_rank0_only) {
        struct stat sb;
        kind = stat(path, &sb) != 0 ? -errno : S_ISDIR(sb.st_mode) ? 1 : 2;
    }
    if (fm->load_monolith_rank0_only && ctx->world > 1 &&
        fsdp_comm_broadcast(ctx->comm, &kind, 1, FSDP_I32, 0) != FSDP_OK)
        return fsdp__err(ctx, FSDP_ERR_COMM, "%s: load: broadcast of the checkpoint's kind failed", path);
    enum fsdp_status st = kind < 0 ? fsdp__err(ctx, FSDP_ERR_IO, "%s: cannot open: %s%s", path,
                                               strerror(-kind), fm->load_monolith_rank0_only ? " (rank 0)" : "")
                                   : FSDP_OK;
    if (!fm->load_monolith_rank0_only) st = fsdp__ckpt_agree(ctx, st);
    if (st != FSDP_OK) return st;
    if (kind == 1) return fsdp_ckpt_load(ctx, fm, path, meta);
    if (meta) memset(meta, 0, sizeof *meta);
    return fsdp_model_load_full(ctx, fm, path, fm->load_monolith_rank0_only);
}

enum fsdp_status fsdp_model_load_weights(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *path) {
    fm->load_weights_only = 1;
    enum fsdp_status st = fsdp_model_load(ctx, fm, path, NULL);
    fm->load_weights_only = 0;
    return st;
}
