/*
 * ckpt/full.c - the full checkpoint: one safetensors file with every
 * parameter under its FQN, written by rank 0 while units are gathered one
 * at a time, loaded by every rank reading its own ranges (or by rank 0 with
 * broadcast); Hugging Face GPT-2 files load through the same path, with
 * their names mapped and Conv1D weights transposed.
 */
#include "fsdp/fsdp-impl.h"
#include "io/io-impl.h"

#include <string.h>

/* ---- Full safetensors ---- */

static int n_model_params(const struct fsdp_model *fm) {
    int n = 0;
    for (int i = 0; i < fm->n_units; i++) n += fm->units[i].n_params;
    return n;
}

enum fsdp_status fsdp_ckpt_check_full_target(struct fsdp_ctx *ctx, const char *path) {
    if (!path || !path[0]) return fsdp__err(ctx, FSDP_ERR_INVALID, "full checkpoint: no file name");
    return fsdp__st_check_target(ctx, path, FSDP__LAYOUT_KEY); /* the writer's own check (fsdp__st_writer_open) */
}

enum fsdp_status fsdp_model_save_full(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *path) {
    enum fsdp_status st = fsdp__ckpt_check_idle(ctx, fm, "save_full");
    if (st == FSDP_OK && (!path || !path[0]))
        st = fsdp__err(ctx, FSDP_ERR_INVALID, "save_full: %s path", path ? "an empty" : "a NULL");
    st = fsdp__ckpt_agree(ctx, st);
    if (st != FSDP_OK) return st;
    struct fsdp__st_writer *w = NULL;
    struct fsdp__st_desc *desc = NULL;
    struct fsdp__buflist bl;
    FSDP_TRY(fsdp__buffers_list(ctx, fm->root, 1, &bl)); /* after the parameters ([Note: buffers]) */
    char *names = NULL;                                  /* fsdp.buffers: their FQNs, comma-separated */
    if (ctx->rank == 0) {
        int n = n_model_params(fm), t = 0;
        desc = fsdp__zalloc((size_t)(n + bl.n) + 1, sizeof *desc);
        size_t len = 1;
        for (int i = 0; i < bl.n; i++) len += strlen(bl.b[i]->fqn) + 1;
        names = fsdp__zalloc(len, 1);
        if (!names) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
        for (int i = 0; i < bl.n && names; i++) {
            if (i) strcat(names, ",");
            strcat(names, bl.b[i]->fqn);
        }
        if (!desc) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
        for (int i = 0; i < fm->n_units && desc; i++)
            for (int j = 0; j < fm->units[i].n_params; j++, t++) {
                struct fsdp_param *p = fm->units[i].params[j];
                desc[t].name = p->fqn;
                desc[t].dtype = FSDP_F32;
                desc[t].ndim = p->ndim;
                memcpy(desc[t].shape, p->shape, sizeof p->shape);
            }
        for (int i = 0; i < bl.n && desc; i++, t++) {
            desc[t].name = bl.b[i]->fqn;
            desc[t].dtype = bl.b[i]->dtype;
            desc[t].ndim = bl.b[i]->ndim;
            memcpy(desc[t].shape, bl.b[i]->shape, sizeof bl.b[i]->shape);
        }
        const char *kv[] = {"format", "pt", FSDP__LAYOUT_KEY, "out,in", FSDP__BUFFERS_KEY, names ? names : ""};
        if (st == FSDP_OK) st = fsdp__st_writer_open(ctx, path, n + bl.n, desc, bl.n ? 3 : 2, kv, &w);
    }
    /* every rank gathers each unit's fp32 shards in turn (the master weights,
     * not a 16-bit unit's training gather); rank 0 writes while it is
     * gathered. A write failure on rank 0 does not stop the gathers (peers
     * would hang): it stops the writing, and the status is agreed at the end. */
    for (int i = 0; i < fm->n_units; i++) {
        struct fsdp__unit *u = &fm->units[i];
        float *full = fsdp__pool_get(fm, u->numel_padded, "full parameters (save)");
        enum fsdp_status g = full ? FSDP_OK : FSDP_ERR_NOMEM;
        if (!full) FSDP_ASSERT(0, "%s", ctx->errmsg); /* peers would wait in the gather */
        if (!fm->shard_comm) memcpy(full, u->shard, (size_t)u->numel_shard * sizeof(float));
        else g = fsdp_comm_allgather(fm->shard_comm, u->shard, full, (size_t)u->numel_shard, FSDP_F32);
        if (g != FSDP_OK) {
            fsdp__pool_put(fm, full);
            fsdp__st_writer_abort(w);
            free(desc);
            free(names);
            fsdp__buffers_list_free(&bl);
            return g; /* a failed collective: the unit is in ERROR on every rank */
        }
        for (int j = 0; j < u->n_params && w && st == FSDP_OK; j++)
            st = fsdp__st_writer_write(w, full + u->offsets[j], (size_t)u->params[j]->numel * sizeof(float));
        fsdp__pool_put(fm, full);
    }
    for (int i = 0; i < bl.n && w && st == FSDP_OK; i++)
        st = fsdp__st_writer_write(w, bl.b[i]->data, fsdp__buffer_bytes(bl.b[i]));
    if (w) {
        if (st == FSDP_OK) st = fsdp__st_writer_commit(w);
        else fsdp__st_writer_abort(w);
    }
    free(desc);
    free(names);
    fsdp__buffers_list_free(&bl);
    return fsdp__ckpt_agree(ctx, st);
}

/* How a model parameter is found in a full file. */
struct src {
    int ti;         /* tensor index */
    int transpose;  /* HF Conv1D (in, out) -> our (out, in) */
};

static int ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && !strcmp(s + a - b, suf);
}

int fsdp__is_conv1d(const char *fqn) {
    return ends_with(fqn, ".attn.c_attn.weight") || ends_with(fqn, ".attn.c_proj.weight") ||
           ends_with(fqn, ".mlp.c_fc.weight") || ends_with(fqn, ".mlp.c_proj.weight");
}

int fsdp__hf_ignorable(const char *k) {
    return ends_with(k, ".attn.bias") || ends_with(k, ".attn.masked_bias") || !strcmp(k, "lm_head.weight");
}

/* [Note: full file layouts] A full file is ours (Linear weights (out, in))
 * when it says so (FSDP__LAYOUT_KEY "out,in"). Without that key the weight
 * shapes decide: c_attn (3C, C) and c_fc (4C, C) are ours (e.g. written by
 * another tool from our state dict), (C, 3C) and (C, 4C) are Hugging Face
 * GPT-2 Conv1D (in, out); files that mix the two are refused. With no such
 * weight, names decide: any name without "transformer." or any HF buffer
 * (attn.bias, attn.masked_bias, lm_head.weight) makes it HF. */
enum fsdp_status fsdp__full_is_hf(struct fsdp_ctx *ctx, const struct fsdp__st_file *f, int *hf) {
    const char *layout = fsdp__st_meta(f, FSDP__LAYOUT_KEY);
    *hf = 0;
    if (fsdp__st_meta(f, "fsdp.rank")) /* its tensors are one rank's flat shards, not the model's */
        return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: a rank file of a sharded checkpoint (rank %s of %s), not a full "
                         "file: give its folder (fsdp-ckpt to-full converts it)", f->path, fsdp__st_meta(f, "fsdp.rank"),
                         fsdp__st_meta(f, "fsdp.world") ? fsdp__st_meta(f, "fsdp.world") : "?");
    if (layout)
        return strcmp(layout, "out,in") ? fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: unknown %s '%s'", f->path,
                                                    FSDP__LAYOUT_KEY, layout)
                                         : FSDP_OK;
    int ours = -1, theirs = -1, named_hf = 0; /* index of a tensor voting for each */
    for (int i = 0; i < f->n; i++) {
        const struct fsdp__st_tensor *t = &f->t[i];
        if (fsdp__hf_ignorable(t->name) || strncmp(t->name, "transformer.", 12)) named_hf = 1;
        int64_t k = ends_with(t->name, ".attn.c_attn.weight") ? 3 : ends_with(t->name, ".mlp.c_fc.weight") ? 4 : 0;
        if (!k || t->ndim != 2) continue;
        if (t->shape[0] == k * t->shape[1]) ours = i;
        else if (t->shape[1] == k * t->shape[0]) theirs = i;
    }
    if (ours >= 0 && theirs >= 0)
        return fsdp__err(ctx, FSDP_ERR_FORMAT,
                         "%s: tensor '%s' is laid out (out, in) but '%s' (in, out): mixed Linear layouts", f->path,
                         f->t[ours].name, f->t[theirs].name);
    *hf = theirs >= 0 || (ours < 0 && named_hf);
    return FSDP_OK;
}

static enum fsdp_status map_full(struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct fsdp__st_file *f,
                                 struct src *map, const struct fsdp__buflist *bl, int *bmap) {
    int hf;
    FSDP_TRY(fsdp__full_is_hf(ctx, f, &hf));
    int ours = !hf;
    char *used = fsdp__zalloc((size_t)f->n + 1, 1);
    if (!used) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    enum fsdp_status st = FSDP_OK;
    int t = 0;
    for (int i = 0; i < fm->n_units && st == FSDP_OK; i++)
        for (int j = 0; j < fm->units[i].n_params && st == FSDP_OK; j++, t++) {
            struct fsdp_param *p = fm->units[i].params[j];
            int ti = fsdp__st_find(f, p->fqn);
            const char *bare = !strncmp(p->fqn, "transformer.", 12) ? p->fqn + 12 : p->fqn;
            if (ti < 0 && !ours) ti = fsdp__st_find(f, bare);
            if (ti < 0) { /* "(or 'h.0...')" only where a bare name was tried (a GPT's) */
                int alt = !ours && bare != p->fqn;
                st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: parameter '%s'%s%s%s is not in the file", f->path, p->fqn,
                               alt ? " (or '" : "", alt ? bare : "", alt ? "')" : "");
                break;
            }
            used[ti] = 1;
            const struct fsdp__st_tensor *x = &f->t[ti];
            int tr = !ours && p->ndim == 2 && fsdp__is_conv1d(p->fqn);
            int same = x->ndim == p->ndim;
            for (int d = 0; same && d < p->ndim; d++) same = x->shape[d] == p->shape[tr ? p->ndim - 1 - d : d];
            if (x->dtype != FSDP_F32)
                st = fsdp__err(ctx, FSDP_ERR_UNSUPPORTED, "%s: tensor '%s' is %s; only F32 is loaded", f->path, x->name,
                               fsdp__st_dtype_str(x->dtype));
            else if (!same) {
                char a[96], b[96];
                st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: tensor '%s' has shape %s, parameter '%s' needs %s%s", f->path,
                               x->name, fsdp__shape_str(a, sizeof a, x->ndim, x->shape), p->fqn,
                               fsdp__shape_str(b, sizeof b, p->ndim, p->shape), tr ? " transposed (HF Conv1D)" : "");
            }
            map[t] = (struct src){ti, tr};
        }
    /* persistent buffers by FQN, whole, in their dtype ([Note: buffers] in buffers.c) */
    for (int i = 0; i < bl->n && st == FSDP_OK; i++) {
        const struct fsdp_buffer *b = bl->b[i];
        int ti = fsdp__st_find(f, b->fqn);
        const char *bare = !strncmp(b->fqn, "transformer.", 12) ? b->fqn + 12 : b->fqn;
        if (ti < 0 && !ours) ti = fsdp__st_find(f, bare);
        if (ti < 0) {
            st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: buffer '%s' is not in the file", f->path, b->fqn);
            break;
        }
        const struct fsdp__st_tensor *x = &f->t[ti];
        int same = x->ndim == b->ndim && x->dtype == b->dtype;
        for (int d = 0; same && d < b->ndim; d++) same = x->shape[d] == b->shape[d];
        if (!same) {
            char a[96], c[96];
            st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: tensor '%s' is %s %s, buffer '%s' needs %s %s", f->path, x->name,
                           fsdp__st_dtype_str(x->dtype), fsdp__shape_str(a, sizeof a, x->ndim, x->shape), b->fqn,
                           fsdp_dtype_name(b->dtype), fsdp__shape_str(c, sizeof c, b->ndim, b->shape));
        }
        used[ti] = 1;
        bmap[i] = ti;
    }
    /* a model's non-persistent buffers are derived values: a file may hold them, they are not read */
    for (int i = 0; i < f->n && st == FSDP_OK; i++) {
        const struct fsdp_buffer *b = fsdp_module_find_buffer(fm->root, f->t[i].name);
        if (b && !b->persistent) used[i] = 1;
    }
    for (int i = 0; i < f->n && st == FSDP_OK; i++) {
        if (used[i] || (!ours && fsdp__hf_ignorable(f->t[i].name))) continue;
        /* 'ln_f.bias' beside 'transformer.ln_f.bias': one parameter named twice, not an unknown one */
        char other[512];
        const char *nm = f->t[i].name;
        snprintf(other, sizeof other, "%s%s", strncmp(nm, "transformer.", 12) ? "transformer." : "",
                 strncmp(nm, "transformer.", 12) ? nm : nm + 12);
        int twin = strcmp(other, nm) ? fsdp__st_find(f, other) : -1;
        if (twin >= 0 && used[twin])
            st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: tensors '%s' and '%s' name one parameter; keep one", f->path,
                           f->t[twin].name, nm);
        else
            st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: tensor '%s' matches no parameter or buffer of the model", f->path,
                           nm);
    }
    free(used);
    return st;
}

/* Elements [s, e) of parameter p (our layout) from its tensor into dst. */
static enum fsdp_status read_param_range(struct fsdp_ctx *ctx, const struct fsdp__st_file *f, struct src sr,
                                         const struct fsdp_param *p, int64_t s, int64_t e, float *dst) {
    if (!sr.transpose) {
        FSDP_TRY(fsdp__st_read(ctx, f, sr.ti, (uint64_t)s * 4, (uint64_t)e * 4, dst));
        return fsdp__ckpt_finite(ctx, f->path, f->t[sr.ti].name, p->fqn, dst, e - s, s);
    }
    /* (in, out) stored: read it whole (one tensor at a time) and pick */
    int64_t out_ = p->shape[0], in_ = p->shape[1];
    float *tmp = fsdp__malloc((size_t)p->numel * sizeof(float) + 1);
    if (!tmp) return fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory transposing '%s'", f->path, p->fqn);
    enum fsdp_status st = fsdp__st_read(ctx, f, sr.ti, 0, (uint64_t)p->numel * 4, tmp);
    for (int64_t x = s; x < e && st == FSDP_OK; x++) {
        int64_t o = x / in_, i = x % in_;
        dst[x - s] = tmp[i * out_ + o];
    }
    free(tmp);
    if (st == FSDP_OK) st = fsdp__ckpt_finite(ctx, f->path, f->t[sr.ti].name, p->fqn, dst, e - s, s);
    return st;
}

enum fsdp_status fsdp_model_load_full(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *path,
                                      int rank0_only) {
    enum fsdp_status st = fsdp__ckpt_check_idle(ctx, fm, "load_full");
    if (st == FSDP_OK) fsdp__model_shards_written(fm);
    struct fsdp__st_file f;
    memset(&f, 0, sizeof f);
    f.fd = -1;
    int reader = !rank0_only || ctx->rank == 0;
    struct src *map = fsdp__zalloc((size_t)n_model_params(fm) + 1, sizeof *map);
    struct fsdp__buflist bl = {0};
    if (!map) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    if (st == FSDP_OK) st = fsdp__buffers_list(ctx, fm->root, 1, &bl);
    int *bmap = fsdp__zalloc((size_t)bl.n + 1, sizeof *bmap);
    if (!bmap && st == FSDP_OK) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    if (st == FSDP_OK && reader) st = fsdp__st_open(ctx, path, &f);
    if (st == FSDP_OK && reader) st = map_full(ctx, fm, &f, map, &bl, bmap);
    st = fsdp__ckpt_agree(ctx, st);
    int t = 0;
    for (int i = 0; i < fm->n_units && st == FSDP_OK; i++) {
        struct fsdp__unit *u = &fm->units[i];
        int64_t lo = (int64_t)fm->shard_rank * u->numel_shard;
        if (!rank0_only || ctx->world == 1) {
            memset(u->shard, 0, (size_t)u->numel_shard * sizeof(float));
            for (int j = 0; j < u->n_params && st == FSDP_OK; j++) {
                int64_t s, e;
                if (!fsdp__ckpt_overlap(u, fm->shard_rank, j, &s, &e)) continue;
                st = read_param_range(ctx, &f, map[t + j], u->params[j], s - u->offsets[j], e - u->offsets[j],
                                      u->shard + (s - lo));
            }
        } else {
            /* rank 0 reads the unit's full flat buffer and broadcasts it */
            float *full = fsdp__pool_get(fm, u->numel_padded, "full parameters (load)");
            int code = full ? FSDP_OK : FSDP_ERR_NOMEM;
            if (full && ctx->rank == 0) {
                memset(full, 0, (size_t)u->numel_padded * sizeof(float));
                for (int j = 0; j < u->n_params && code == FSDP_OK; j++)
                    code = (int)read_param_range(ctx, &f, map[t + j], u->params[j], 0, u->params[j]->numel,
                                                 full + u->offsets[j]);
            }
            st = fsdp__ckpt_agree(ctx, (enum fsdp_status)code);
            if (st == FSDP_OK && fsdp_comm_broadcast(ctx->comm, full, (size_t)u->numel_padded, FSDP_F32, 0) != FSDP_OK)
                st = FSDP_ERR_COMM;
            if (st == FSDP_OK) memcpy(u->shard, full + lo, (size_t)u->numel_shard * sizeof(float));
            fsdp__pool_put(fm, full);
        }
        t += u->n_params;
    }
    /* buffers: every rank reads them whole, or rank 0 reads and broadcasts */
    if (!rank0_only || ctx->world == 1) {
        for (int i = 0; i < bl.n && st == FSDP_OK; i++)
            st = fsdp__st_read(ctx, &f, bmap[i], 0, fsdp__buffer_bytes(bl.b[i]), bl.b[i]->data);
    } else if (st == FSDP_OK) {
        enum fsdp_status rd = FSDP_OK;
        for (int i = 0; i < bl.n && rd == FSDP_OK && ctx->rank == 0; i++)
            rd = fsdp__st_read(ctx, &f, bmap[i], 0, fsdp__buffer_bytes(bl.b[i]), bl.b[i]->data);
        st = fsdp__ckpt_agree(ctx, rd);
        for (int i = 0; i < bl.n && st == FSDP_OK; i++)
            if (fsdp_comm_broadcast(ctx->comm, bl.b[i]->data, (size_t)bl.b[i]->numel, bl.b[i]->dtype, 0) != FSDP_OK)
                st = FSDP_ERR_COMM;
    }
    fsdp__st_close(&f);
    free(map);
    free(bmap);
    fsdp__buffers_list_free(&bl);
    return rank0_only && ctx->world > 1 ? st : fsdp__ckpt_agree(ctx, st);
}
