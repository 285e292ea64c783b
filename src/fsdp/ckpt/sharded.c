/*
 * ckpt/sharded.c - the sharded checkpoint: save (one file per rank, then
 * meta.json by rank 0, then the folder swap) and load at any world size
 * ([Note: sharded layout], [Note: atomic folder] in ckpt.c).
 */
#include "fsdp/fsdp-impl.h"
#include "io/io-impl.h"
#include "optim/optim-impl.h"

#include <errno.h>
#include <limits.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- Sharded save ---- */

struct piece { /* one tensor of a rank file */
    struct fsdp_buffer *b; /* a buffer, whole (file 0 only; u NULL), or NULL */
    struct fsdp__unit *u;
    int j;          /* param index in u */
    int state;      /* -1: parameter values, else state array index */
    int64_t s, e;   /* flat range of u */
};

/* Lists the tensors rank r writes, in file order ([Note: sharded layout]).
 * names: malloc'd strings, caller frees. */
static enum fsdp_status plan_rank(struct fsdp_ctx *ctx, struct fsdp_model *fm, int r, int k,
                                  const char *const *snames, const struct fsdp__buflist *bl,
                                  struct piece **pieces, struct fsdp__st_desc **desc, int *n) {
    int cap = bl->n;
    for (int i = 0; i < fm->n_units; i++) cap += fm->units[i].n_params * (1 + k);
    *pieces = fsdp__zalloc((size_t)cap + 1, sizeof **pieces);
    *desc = fsdp__zalloc((size_t)cap + 1, sizeof **desc);
    if (!*pieces || !*desc) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory planning a checkpoint");
    *n = 0;
    for (int state = -1; state < k; state++)
        for (int i = 0; i < fm->n_units; i++) {
            struct fsdp__unit *u = &fm->units[i];
            for (int j = 0; j < u->n_params; j++) {
                int64_t s, e;
                if (!fsdp__ckpt_overlap(u, r, j, &s, &e)) continue;
                const char *fqn = u->params[j]->fqn;
                size_t len = strlen(fqn) + (state >= 0 ? strlen(snames[state]) + 2 : 1);
                char *name = fsdp__malloc(len);
                if (!name) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory planning a checkpoint");
                if (state >= 0) snprintf(name, len, "%s#%s", fqn, snames[state]);
                else snprintf(name, len, "%s", fqn);
                (*pieces)[*n] = (struct piece){NULL, u, j, state, s, e};
                (*desc)[*n] = (struct fsdp__st_desc){name, FSDP_F32, 1, {e - s, 0, 0, 0}};
                (*n)++;
            }
        }
    /* file 0 ends with the persistent buffers, whole ([Note: buffers] in buffers.c) */
    for (int i = 0; r == 0 && i < bl->n; i++) {
        struct fsdp_buffer *b = bl->b[i];
        char *name = fsdp__strdup(b->fqn);
        if (!name) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory planning a checkpoint");
        (*pieces)[*n] = (struct piece){b, NULL, 0, -1, 0, b->numel};
        (*desc)[*n] = (struct fsdp__st_desc){name, b->dtype, b->ndim, {0}};
        memcpy((*desc)[*n].shape, b->shape, sizeof b->shape);
        (*n)++;
    }
    return FSDP_OK;
}

static void free_plan(struct piece *pieces, struct fsdp__st_desc *desc, int n) {
    for (int i = 0; desc && i < n; i++) free((char *)desc[i].name);
    free(pieces);
    free(desc);
}

static enum fsdp_status save_rank_file(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *tmpdir) {
    int k;
    const char *const *snames = fsdp__ckpt_state_names(fm->optim, &k);
    struct piece *pieces = NULL;
    struct fsdp__st_desc *desc = NULL;
    int n = 0;
    struct fsdp__buflist bl;
    FSDP_TRY(fsdp__buffers_list(ctx, fm->root, 1, &bl));
    /* the file of this rank's shard ([Note: sharding strategies]: replica 0's) */
    enum fsdp_status st = plan_rank(ctx, fm, fm->shard_rank, k, snames, &bl, &pieces, &desc, &n);
    char name[64], rankstr[16], worldstr[16];
    fsdp__ckpt_rank_file_name(name, sizeof name, fm->shard_rank, fm->shard_size);
    snprintf(rankstr, sizeof rankstr, "%d", fm->shard_rank);
    snprintf(worldstr, sizeof worldstr, "%d", fm->shard_size);
    const char *kv[] = {"format", "pt", "fsdp.rank", rankstr, "fsdp.world", worldstr};
    char *path = fsdp__path_join(tmpdir, name);
    if (st == FSDP_OK && !path) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    struct fsdp__st_writer *w = NULL;
    if (st == FSDP_OK) st = fsdp__st_writer_open(ctx, path, n, desc, 3, kv, &w);
    for (int i = 0; i < n && st == FSDP_OK; i++) {
        struct piece *p = &pieces[i];
        if (p->b) {
            st = fsdp__st_writer_write(w, p->b->data, fsdp__buffer_bytes(p->b));
            continue;
        }
        int64_t lo = (int64_t)fm->shard_rank * p->u->numel_shard;
        const float *src = p->state < 0 ? p->u->shard : p->u->state + (int64_t)p->state * p->u->numel_shard;
        st = fsdp__st_writer_write(w, src + (p->s - lo), (size_t)(p->e - p->s) * sizeof(float));
    }
    if (st == FSDP_OK) st = fsdp__st_writer_commit(w);
    else fsdp__st_writer_abort(w);
    free(path);
    free_plan(pieces, desc, n);
    fsdp__buffers_list_free(&bl);
    return st;
}

/* Rank r's file is not in rank 0's tmpdir although every rank wrote its own
 * (they agreed so first): the ranks wrote into different folders, each host
 * its own disk or each rank its own path (reported as a file rank 0 could not
 * open before). */
static enum fsdp_status not_shared(struct fsdp_ctx *ctx, const char *tmpdir, int r) {
    return fsdp__err(ctx, FSDP_ERR_INVALID, "ckpt_save: rank %d wrote its file, but not into %s, which rank 0 "
                     "wrote into: the ranks do not share the checkpoint folder (another path on each rank, or "
                     "each host's own disk); give every rank one folder on a file system they all see", r, tmpdir);
}

/* [Note: files of one save] meta.json's sizes alone let a rank file of
 * another save of the same model and world (a copy gone wrong) pass: it
 * loaded, and the resumed run went elsewhere. Each file's entry also
 * records the CRC-32C of its header, which holds the checksums of all its
 * data ([Note: replace only our own files], st_write.c), and a reader that
 * opens the file compares it (fsdp__st_open's header_crc, from the one read
 * of the header): a file of another save is named as such before any of it
 * is read. */
/* meta.json, by rank 0 after every rank file exists: the layout is a pure
 * function of (model, shard group size), and byte ranges come from the
 * files' headers. Its "world" is the number of shards (files). */
static enum fsdp_status describe(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *tmpdir,
                                 struct fsdp__st_file *files, struct fsdp__meta *mt) {
    int world = fm->shard_size, k;
    const char *const *snames = fsdp__ckpt_state_names(fm->optim, &k);
    for (int i = 0; i < k; i++)
        if (!(mt->state[mt->n_state++] = fsdp__strdup(snames[i]))) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    for (int r = 0; r < world; r++) {
        char name[64];
        fsdp__ckpt_rank_file_name(name, sizeof name, r, world);
        char *path = fsdp__path_join(tmpdir, name);
        struct stat sb;
        enum fsdp_status st = !path ? fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory")
                              : r > 0 && lstat(path, &sb) != 0 && errno == ENOENT ? not_shared(ctx, tmpdir, r)
                                                                                  : fsdp__st_open(ctx, path, &files[r]);
        free(path);
        FSDP_TRY(st);
        struct fsdp__meta_file *f = &mt->files[mt->n_files++];
        if (!(f->name = fsdp__strdup(name))) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
        f->bytes = files[r].file_size;
        f->header_crc = files[r].header_crc;
        f->has_header_crc = 1;
    }
    for (int i = 0; i < fm->n_units; i++) {
        struct fsdp__unit *u = &fm->units[i];
        for (int j = 0; j < u->n_params; j++) {
            struct fsdp_param *p = u->params[j];
            struct fsdp__meta_param *q = &mt->params[mt->n_params++];
            if (!(q->fqn = fsdp__strdup(p->fqn)) || !(q->ranges = fsdp__zalloc((size_t)world, sizeof *q->ranges)))
                return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
            q->ndim = p->ndim;
            memcpy(q->shape, p->shape, sizeof q->shape);
            q->numel = p->numel;
            for (int r = 0; r < world; r++) {
                int64_t s, e;
                if (!fsdp__ckpt_overlap(u, r, j, &s, &e)) continue;
                int ti = fsdp__st_find(&files[r], p->fqn);
                if (ti < 0) return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: rank %d's file lacks '%s'", tmpdir, r, p->fqn);
                q->ranges[q->n_ranges++] = (struct fsdp__meta_range){
                    r, s - u->offsets[j], e - u->offsets[j], files[r].data_start + files[r].t[ti].begin,
                    files[r].data_start + files[r].t[ti].end};
            }
        }
    }
    struct fsdp__buflist bl = {0};
    enum fsdp_status st = fsdp__buffers_list(ctx, fm->root, 1, &bl);
    if (st == FSDP_OK && bl.n) {
        free(mt->buffers);
        if (!(mt->buffers = fsdp__zalloc((size_t)bl.n, sizeof *mt->buffers))) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    }
    for (int i = 0; i < bl.n && st == FSDP_OK; i++) {
        struct fsdp_buffer *b = bl.b[i];
        int ti = fsdp__st_find(&files[0], b->fqn);
        if (ti < 0) {
            st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: rank 0's file lacks buffer '%s'", tmpdir, b->fqn);
            break;
        }
        struct fsdp__meta_buffer *q = &mt->buffers[mt->n_buffers++];
        *q = (struct fsdp__meta_buffer){fsdp__strdup(b->fqn), b->dtype, b->ndim, {0}, b->numel, 0,
                                        files[0].data_start + files[0].t[ti].begin,
                                        files[0].data_start + files[0].t[ti].end};
        memcpy(q->shape, b->shape, sizeof q->shape);
        if (!q->fqn) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    }
    fsdp__buffers_list_free(&bl);
    return st;
}

static enum fsdp_status write_meta(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *tmpdir,
                                   const struct fsdp_ckpt_meta *m) {
    int world = fm->shard_size, np = 0;
    for (int i = 0; i < fm->n_units; i++) np += fm->units[i].n_params;
    struct fsdp__meta mt;
    FSDP_TRY(fsdp__meta_alloc(ctx, &mt, world, np, 0));
    mt.m = *m;
    mt.m.optim_step = fm->optim ? fsdp_optim_step_count(fm->optim) : 0;
    mt.m.has_loss_scale = fm->scaler.opts.enabled;
    if (mt.m.has_loss_scale) { /* the dynamic loss scaling state (mixed.c) */
        mt.m.loss_scale = fm->scaler.scale;
        mt.m.loss_scale_growth_tracker = fm->scaler.clean;
        mt.m.loss_scale_skipped = fm->scaler.skipped;
    }
    struct fsdp__st_file *files = fsdp__zalloc((size_t)world, sizeof *files);
    enum fsdp_status st = files ? FSDP_OK : fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    for (int r = 0; files && r < world; r++) files[r].fd = -1;
    if (st == FSDP_OK) st = describe(ctx, fm, tmpdir, files, &mt);
    for (int r = 0; files && r < world; r++) fsdp__st_close(&files[r]);
    free(files);
    char *text = NULL, *mpath = fsdp__path_join(tmpdir, FSDP__META_NAME);
    if (st == FSDP_OK && !mpath) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    if (st == FSDP_OK) st = fsdp__meta_format(ctx, mpath, &mt, &text);
    fsdp__meta_free(&mt);
    if (st == FSDP_OK) fsdp__ckpt_crash_point("before meta.json");
    if (st == FSDP_OK) st = fsdp__write_durable(ctx, mpath, text);
    free(mpath);
    free(text);
    return st;
}

/* [Note: a failed save leaves nothing of its own] A save that fails (a full
 * disk, a rank that could not write) removes what it made itself: each
 * rank's own rank file in dir.tmp, then, once every rank has (a barrier),
 * dir.tmp if this save created it and it is empty. A dir.tmp that was there
 * before (a crashed save's, [Note: only our own files]) stays, and so does
 * anything another writer put there. A dir.tmp holding meta.json is left
 * alone: past the commit's swap it is the previous checkpoint, which the
 * commit removes only once the new one is in place. COLLECTIVE: yes (every
 * rank has the failure from the agreement). */
static void discard_save(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *tmpdir, int made, int wrote) {
    char *mpath = fsdp__path_join(tmpdir, FSDP__META_NAME);
    struct stat sb;
    if (!mpath || stat(mpath, &sb) == 0) made = wrote = 0;
    free(mpath);
    if (wrote) {
        char name[64];
        fsdp__ckpt_rank_file_name(name, sizeof name, fm->shard_rank, fm->shard_size);
        char *path = fsdp__path_join(tmpdir, name);
        if (path) unlink(path);
        free(path);
    }
    if (ctx->world > 1) (void)fsdp_comm_barrier(ctx->comm); /* every rank file gone before the rmdir */
    if (made) rmdir(tmpdir); /* fails, leaving it, if anything else is in it */
}

enum fsdp_status fsdp_ckpt_save(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *dir,
                                const struct fsdp_ckpt_meta *meta) {
    struct fsdp_ckpt_meta zero = {0};
    if (!meta) meta = &zero;
    char tmpdir[PATH_MAX];
    enum fsdp_status st = fsdp__ckpt_check_idle(ctx, fm, "ckpt_save");
    if (st == FSDP_OK && (!dir || !dir[0] || strlen(dir) > PATH_MAX - 64))
        st = fsdp__err(ctx, FSDP_ERR_INVALID, "ckpt_save: bad folder name");
    if (st == FSDP_OK) snprintf(tmpdir, sizeof tmpdir, "%s.tmp", dir);
    /* rank 0 looks before anyone writes: [Note: only our own files] */
    if (st == FSDP_OK && ctx->rank == 0) st = fsdp_ckpt_check_target(ctx, dir);
    st = fsdp__ckpt_agree(ctx, st);
    int made = 0, wrote = 0; /* this rank created tmpdir; wrote its rank file there */
    if (st == FSDP_OK) {
        if (mkdir(tmpdir, 0755) == 0) made = 1;
        else if (errno != EEXIST) st = fsdp__err(ctx, FSDP_ERR_IO, "%s: cannot create: %s", tmpdir, strerror(errno));
    }
    if (st == FSDP_OK && fm->rep_rank == 0) /* replicas are equal */
        wrote = (st = save_rank_file(ctx, fm, tmpdir)) == FSDP_OK;
    st = fsdp__ckpt_agree(ctx, st);
    if (st == FSDP_OK) {
        if (ctx->rank == 0) {
            st = write_meta(ctx, fm, tmpdir, meta);
            if (st == FSDP_OK) st = fsdp__ckpt_commit_dir(ctx, dir, tmpdir, fm->shard_size);
        }
        st = fsdp__ckpt_agree(ctx, st);
    }
    if (st != FSDP_OK) discard_save(ctx, fm, tmpdir, made, wrote);
    return st;
}

/* ---- Sharded load ---- */

enum fsdp_status fsdp__fcache_get(struct fsdp_ctx *ctx, struct fsdp__fcache *c, int i, struct fsdp__st_file **out) {
    if (!c->open[i]) {
        char *path = fsdp__path_join(c->mt->dir, c->mt->files[i].name);
        if (!path) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
        struct stat sb;
        enum fsdp_status st = FSDP_OK;
        if (stat(path, &sb) != 0)
            st = fsdp__err(ctx, FSDP_ERR_IO, "%s: missing file of the checkpoint: %s", path, strerror(errno));
        else if ((uint64_t)sb.st_size != c->mt->files[i].bytes)
            st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: %llu bytes but meta.json says %llu (truncated or replaced)",
                           path, (unsigned long long)sb.st_size, (unsigned long long)c->mt->files[i].bytes);
        if (st == FSDP_OK) st = fsdp__st_open(ctx, path, &c->f[i]);
        if (st == FSDP_OK && c->mt->files[i].has_header_crc && c->f[i].header_crc != c->mt->files[i].header_crc)
            st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: not the file this checkpoint's meta.json was saved with (its "
                           "header's crc32c %08x, recorded %08x): a file of another save?", path, c->f[i].header_crc,
                           c->mt->files[i].header_crc);
        if (st != FSDP_OK && c->f[i].fd >= 0) fsdp__st_close(&c->f[i]);
        free(path);
        if (st != FSDP_OK) return st;
        c->open[i] = 1;
    }
    *out = &c->f[i];
    return FSDP_OK;
}

/* Reads elements [s, e) of stored tensor `tname` (parameter p of the
 * checkpoint, whose pieces are p->ranges) into dst. */
enum fsdp_status fsdp__fcache_read(struct fsdp_ctx *ctx, struct fsdp__fcache *c, const struct fsdp__meta_param *p,
                                   const char *tname, int64_t s, int64_t e, float *dst) {
    for (int i = 0; i < p->n_ranges; i++) {
        const struct fsdp__meta_range *r = &p->ranges[i];
        int64_t a = s > r->start ? s : r->start, b = e < r->end ? e : r->end;
        if (a >= b) continue;
        struct fsdp__st_file *f;
        FSDP_TRY(fsdp__fcache_get(ctx, c, r->file, &f));
        int ti = fsdp__st_find(f, tname);
        if (ti < 0)
            return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: tensor '%s' is missing (meta.json lists it)", f->path, tname);
        const struct fsdp__st_tensor *t = &f->t[ti];
        if (t->dtype != FSDP_F32 || t->numel != r->end - r->start)
            return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: tensor '%s' has %lld %s elements, meta.json says %lld F32",
                             f->path, tname, (long long)t->numel, fsdp__st_dtype_str(t->dtype),
                             (long long)(r->end - r->start));
        if (!strchr(tname, '#') && f->data_start + t->begin != r->b0)
            return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: tensor '%s' starts at byte %llu, meta.json says %llu",
                             f->path, tname, (unsigned long long)(f->data_start + t->begin),
                             (unsigned long long)r->b0);
        FSDP_TRY(fsdp__st_read(ctx, f, ti, (uint64_t)(a - r->start) * 4, (uint64_t)(b - r->start) * 4,
                               dst + (a - s)));
    }
    return FSDP_OK;
}

enum fsdp_status fsdp__fcache_read_buffer(struct fsdp_ctx *ctx, struct fsdp__fcache *c,
                                          const struct fsdp__meta_buffer *b, void *dst) {
    struct fsdp__st_file *f;
    FSDP_TRY(fsdp__fcache_get(ctx, c, b->file, &f));
    int ti = fsdp__st_find(f, b->fqn);
    if (ti < 0)
        return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: buffer '%s' is missing (meta.json lists it)", f->path, b->fqn);
    const struct fsdp__st_tensor *t = &f->t[ti];
    if (t->dtype != b->dtype || t->numel != b->numel || f->data_start + t->begin != b->b0)
        return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: buffer '%s' is %lld %s elements at byte %llu, meta.json says "
                         "%lld %s at %llu", f->path, b->fqn, (long long)t->numel, fsdp__st_dtype_str(t->dtype),
                         (unsigned long long)(f->data_start + t->begin), (long long)b->numel,
                         fsdp_dtype_name(b->dtype), (unsigned long long)b->b0);
    return fsdp__st_read(ctx, f, ti, 0, b->b1 - b->b0, dst);
}

/* Every persistent buffer of the model is in the checkpoint with its dtype
 * and shape, nothing else is, and each is read whole on this rank (from
 * file 0 whatever the world size: [Note: buffers] in buffers.c). */
static enum fsdp_status load_buffers(struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct fsdp__meta *mt,
                                     struct fsdp__fcache *c) {
    struct fsdp__buflist bl;
    FSDP_TRY(fsdp__buffers_list(ctx, fm->root, 1, &bl));
    enum fsdp_status st = FSDP_OK;
    for (int i = 0; i < bl.n && st == FSDP_OK; i++) {
        struct fsdp_buffer *b = bl.b[i];
        const struct fsdp__meta_buffer *q = NULL;
        for (int k = 0; k < mt->n_buffers && !q; k++)
            if (!strcmp(mt->buffers[k].fqn, b->fqn)) q = &mt->buffers[k];
        int same = q && q->dtype == b->dtype && q->ndim == b->ndim;
        for (int d = 0; same && d < b->ndim; d++) same = q->shape[d] == b->shape[d];
        char x[96], y[96];
        if (!q)
            st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: buffer '%s' of the model is not in the checkpoint", mt->dir,
                           b->fqn);
        else if (!same)
            st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: buffer '%s': checkpoint %s %s, model %s %s", mt->dir, b->fqn,
                           fsdp_dtype_name(q->dtype), fsdp__shape_str(x, sizeof x, q->ndim, q->shape),
                           fsdp_dtype_name(b->dtype), fsdp__shape_str(y, sizeof y, b->ndim, b->shape));
        else
            st = fsdp__fcache_read_buffer(ctx, c, q, b->data);
    }
    for (int k = 0; k < mt->n_buffers && st == FSDP_OK; k++) {
        int found = 0;
        for (int i = 0; i < bl.n && !found; i++) found = !strcmp(mt->buffers[k].fqn, bl.b[i]->fqn);
        if (!found)
            st = fsdp__err(ctx, FSDP_ERR_FORMAT,
                           "%s: the checkpoint has buffer '%s', which the model lacks (or does not persist)", mt->dir,
                           mt->buffers[k].fqn);
    }
    fsdp__buffers_list_free(&bl);
    return st;
}

/* Every model parameter is in the checkpoint with its shape, and nothing else is. */
static enum fsdp_status match_model(struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct fsdp__meta *mt,
                                    const struct fsdp__meta_param **map) {
    int total = 0;
    for (int i = 0; i < fm->n_units; i++) {
        struct fsdp__unit *u = &fm->units[i];
        for (int j = 0; j < u->n_params; j++, total++) {
            struct fsdp_param *p = u->params[j];
            const struct fsdp__meta_param *q = NULL;
            for (int k = 0; k < mt->n_params && !q; k++)
                if (!strcmp(mt->params[k].fqn, p->fqn)) q = &mt->params[k];
            if (!q)
                return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: parameter '%s' of the model is not in the checkpoint",
                                 mt->dir, p->fqn);
            int same = q->ndim == p->ndim;
            for (int d = 0; same && d < p->ndim; d++) same = q->shape[d] == p->shape[d];
            if (!same) {
                char a[96], b[96];
                return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: parameter '%s': checkpoint shape %s, model shape %s",
                                 mt->dir, p->fqn, fsdp__shape_str(a, sizeof a, q->ndim, q->shape),
                                 fsdp__shape_str(b, sizeof b, p->ndim, p->shape));
            }
            map[total] = q;
        }
    }
    if (total != mt->n_params)
        for (int k = 0; k < mt->n_params; k++)
            if (!fsdp__model_unit_of(fm, mt->params[k].fqn, NULL))
                return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: the checkpoint has parameter '%s', which the model lacks",
                                 mt->dir, mt->params[k].fqn);
    if (total != mt->n_params)
        return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: %d parameters in the checkpoint, %d in the model", mt->dir,
                         mt->n_params, total);
    return FSDP_OK;
}

static enum fsdp_status load_local(struct fsdp_ctx *ctx, struct fsdp_model *fm, struct fsdp__meta *mt) {
    fsdp__model_shards_written(fm);
    int k;
    const char *const *snames = fsdp__ckpt_state_names(fm->optim, &k);
    int load_state = 0;
    if (k && mt->n_state && !fm->load_weights_only) {
        int same = mt->n_state == k;
        for (int i = 0; same && i < k; i++) same = !strcmp(mt->state[i], snames[i]);
        if (!same)
            return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: optimizer state is %d arrays (%s...), the optimizer has %d (%s...)",
                             mt->dir, mt->n_state, mt->state[0], k, snames[0]);
        load_state = 1;
    }
    int total = 0;
    for (int i = 0; i < fm->n_units; i++) total += fm->units[i].n_params;
    const struct fsdp__meta_param **map = fsdp__zalloc((size_t)total + 1, sizeof *map);
    struct fsdp__fcache c = {mt, fsdp__zalloc((size_t)mt->n_files, sizeof(struct fsdp__st_file)),
                       fsdp__zalloc((size_t)mt->n_files, sizeof(int))};
    enum fsdp_status st = map && c.f && c.open ? FSDP_OK : fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    for (int i = 0; c.f && i < mt->n_files; i++) c.f[i].fd = -1;
    if (st == FSDP_OK) st = match_model(ctx, fm, mt, map);
    char tname[4200];
    int idx = 0;
    for (int i = 0; i < fm->n_units && st == FSDP_OK; i++) {
        struct fsdp__unit *u = &fm->units[i];
        int64_t lo = (int64_t)fm->shard_rank * u->numel_shard, ns = u->numel_shard;
        /* the parameters tile the flat buffer's [0, numel_full) and every one
         * is read below (match_model): only the padding after them is zeroed
         * here, not the whole shard and state first (a write pass over all of
         * it that the reads then overwrite) */
        int64_t pad = u->numel_full > lo ? u->numel_full - lo : 0;
        if (pad > ns) pad = ns;
        memset(u->shard + pad, 0, (size_t)(ns - pad) * sizeof(float));
        for (int q = 0; u->state && q < k; q++) {
            int64_t z = load_state ? pad : 0; /* no state in the checkpoint: all zeros */
            memset(u->state + q * ns + z, 0, (size_t)(ns - z) * sizeof(float));
        }
        for (int j = 0; j < u->n_params && st == FSDP_OK; j++, idx++) {
            int64_t s, e;
            if (!fsdp__ckpt_overlap(u, fm->shard_rank, j, &s, &e)) continue;
            int64_t ps = s - u->offsets[j], pe = e - u->offsets[j];
            st = fsdp__fcache_read(ctx, &c, map[idx], u->params[j]->fqn, ps, pe, u->shard + (s - lo));
            for (int q = 0; load_state && q < k && st == FSDP_OK; q++) {
                snprintf(tname, sizeof tname, "%s#%s", u->params[j]->fqn, snames[q]);
                st = fsdp__fcache_read(ctx, &c, map[idx], tname, ps, pe, u->state + q * u->numel_shard + (s - lo));
            }
        }
    }
    if (st == FSDP_OK) st = load_buffers(ctx, fm, mt, &c);
    if (st == FSDP_OK && fm->optim) fsdp__optim_set_step_count(fm->optim, load_state ? mt->m.optim_step : 0);
    if (st == FSDP_OK && fm->scaler.opts.enabled && mt->m.has_loss_scale && !fm->load_weights_only) { /* torch's GradScaler state */
        fm->scaler.scale = mt->m.loss_scale;
        fm->scaler.clean = mt->m.loss_scale_growth_tracker;
        fm->scaler.skipped = mt->m.loss_scale_skipped;
    }
    for (int i = 0; c.f && i < mt->n_files; i++) fsdp__st_close(&c.f[i]);
    free(c.f);
    free(c.open);
    free(map);
    return st;
}

enum fsdp_status fsdp_ckpt_load(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *dir,
                                struct fsdp_ckpt_meta *meta) {
    struct fsdp__meta mt;
    memset(&mt, 0, sizeof mt);
    enum fsdp_status st = fsdp__ckpt_check_idle(ctx, fm, "ckpt_load");
    if (st == FSDP_OK) st = fsdp__meta_load(ctx, dir, &mt);
    if (st == FSDP_OK) st = load_local(ctx, fm, &mt);
    if (st == FSDP_OK && meta) *meta = mt.m;
    fsdp__meta_free(&mt);
    return fsdp__ckpt_agree(ctx, st);
}

enum fsdp_status fsdp__fcache_open(struct fsdp_ctx *ctx, struct fsdp__meta *mt, struct fsdp__fcache *c) {
    c->mt = mt;
    c->f = fsdp__zalloc((size_t)mt->n_files + 1, sizeof *c->f);
    c->open = fsdp__zalloc((size_t)mt->n_files + 1, sizeof *c->open);
    if (!c->f || !c->open) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    for (int i = 0; i < mt->n_files; i++) c->f[i].fd = -1;
    return FSDP_OK;
}

void fsdp__fcache_close(struct fsdp__fcache *c) {
    for (int i = 0; c->f && i < c->mt->n_files; i++) fsdp__st_close(&c->f[i]);
    free(c->f);
    free(c->open);
}
