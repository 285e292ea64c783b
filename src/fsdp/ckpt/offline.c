/*
 * ckpt/offline.c - checkpoint tools that need no model (fsdp-ckpt): describe
 * and verify a sharded folder or a safetensors file, convert sharded <-> full.
 */
#include "fsdp/fsdp-impl.h"
#include "io/io-impl.h"

#include <errno.h>
#include <limits.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- Offline: describe, verify, convert ---- */

static enum fsdp_status verify_model(struct fsdp_ctx *ctx, const struct fsdp__meta *mt);

/* Verifies a sharded folder: every file, every checksum, every listed piece. */
static enum fsdp_status verify_dir(struct fsdp_ctx *ctx, struct fsdp__meta *mt, FILE *out) {
    struct fsdp__fcache c;
    enum fsdp_status st = fsdp__fcache_open(ctx, mt, &c);
    for (int i = 0; i < mt->n_files && st == FSDP_OK; i++) {
        struct fsdp__st_file *f;
        int unchecked = 0;
        st = fsdp__fcache_get(ctx, &c, i, &f);
        if (st == FSDP_OK) st = fsdp__st_verify(ctx, f, &unchecked);
        if (st == FSDP_OK && unchecked)
            st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: %d tensors without checksums", f->path, unchecked);
        if (st == FSDP_OK && out) fprintf(out, "  %s: %d tensors, checksums ok\n", mt->files[i].name, f->n);
    }
    char tname[4200];
    for (int i = 0; i < mt->n_params && st == FSDP_OK; i++) {
        struct fsdp__meta_param *p = &mt->params[i];
        for (int r = 0; r < p->n_ranges && st == FSDP_OK; r++) {
            struct fsdp__st_file *f;
            st = fsdp__fcache_get(ctx, &c, p->ranges[r].file, &f);
            for (int q = -1; q < mt->n_state && st == FSDP_OK; q++) {
                if (q < 0) snprintf(tname, sizeof tname, "%s", p->fqn);
                else snprintf(tname, sizeof tname, "%s#%s", p->fqn, mt->state[q]);
                int ti = fsdp__st_find(f, tname);
                if (ti < 0 || f->t[ti].dtype != FSDP_F32 || f->t[ti].numel != p->ranges[r].end - p->ranges[r].start ||
                    (q < 0 && f->data_start + f->t[ti].begin != p->ranges[r].b0))
                    st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: tensor '%s' is missing or differs from meta.json",
                                   f->path, tname);
            }
        }
    }
    for (int i = 0; i < mt->n_buffers && st == FSDP_OK; i++) {
        void *tmp = fsdp__malloc((size_t)(mt->buffers[i].b1 - mt->buffers[i].b0) + 1);
        st = tmp ? fsdp__fcache_read_buffer(ctx, &c, &mt->buffers[i], tmp)
                 : fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory for buffer '%s'", mt->buffers[i].fqn);
        free(tmp);
    }
    fsdp__fcache_close(&c);
    return st;
}

enum fsdp_status fsdp_ckpt_describe(struct fsdp_ctx *ctx, const char *path, int verify, FILE *out) {
    struct stat sb;
    if (!path || !out)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "describe: %s is NULL", !path ? "the path" : "the output stream");
    if (stat(path, &sb) != 0) return fsdp__err(ctx, FSDP_ERR_IO, "%s: %s", path, strerror(errno));
    char sh[96];
    if (S_ISDIR(sb.st_mode)) {
        struct fsdp__meta mt;
        FSDP_TRY(fsdp__meta_load(ctx, path, &mt));
        fprintf(out, "%s: sharded checkpoint, %d files, step %lld, data_step %lld, optim_step %lld, seed %llu\n", path,
                mt.n_files, (long long)mt.m.step, (long long)mt.m.data_step, (long long)mt.m.optim_step,
                (unsigned long long)mt.m.seed);
        if (mt.m.has_config)
            fprintf(out, "model_config: n_layer %d n_head %d n_embd %d vocab_size %d block_size %d\n",
                    mt.m.config.n_layer, mt.m.config.n_head, mt.m.config.n_embd, mt.m.config.vocab_size,
                    mt.m.config.block_size);
        fprintf(out, "optimizer state:");
        for (int i = 0; i < mt.n_state; i++) fprintf(out, " %s", mt.state[i]);
        fprintf(out, "%s\n", mt.n_state ? "" : " none");
        int64_t total = 0;
        for (int i = 0; i < mt.n_params; i++) {
            struct fsdp__meta_param *p = &mt.params[i];
            total += p->numel;
            fprintf(out, "  %-44s F32 %-16s %d pieces\n", p->fqn, fsdp__shape_str(sh, sizeof sh, p->ndim, p->shape),
                    p->n_ranges);
        }
        fprintf(out, "%d parameters, %lld elements\n", mt.n_params, (long long)total);
        for (int i = 0; i < mt.n_buffers; i++) {
            struct fsdp__meta_buffer *b = &mt.buffers[i];
            fprintf(out, "  %-44s %-3s %-16s buffer (file %d)\n", b->fqn, fsdp_dtype_name(b->dtype),
                    fsdp__shape_str(sh, sizeof sh, b->ndim, b->shape), b->file);
        }
        if (mt.n_buffers) fprintf(out, "%d buffers\n", mt.n_buffers);
        enum fsdp_status st = verify ? verify_dir(ctx, &mt, out) : FSDP_OK;
        if (st == FSDP_OK && verify && mt.m.has_config) {
            st = verify_model(ctx, &mt);
            if (st == FSDP_OK) fprintf(out, "  model_config: the parameters are exactly the model's, names and shapes\n");
        } else if (st == FSDP_OK && verify) {
            fprintf(out, "  no model_config: names and shapes not checked against a model (--resume needs --model)\n");
        }
        if (st == FSDP_OK && verify) fprintf(out, "verified: ok\n");
        fsdp__meta_free(&mt);
        return st;
    }
    struct fsdp__st_file f;
    FSDP_TRY(fsdp__st_open(ctx, path, &f));
    fprintf(out, "%s: safetensors, %d tensors, %llu bytes\n", path, f.n, (unsigned long long)f.file_size);
    for (int i = 0; i < f.n_meta; i++) fprintf(out, "  __metadata__ %s = %s\n", f.meta_key[i], f.meta_val[i]);
    for (int i = 0; i < f.n; i++)
        fprintf(out, "  %-44s %-4s %-16s [%llu, %llu)%s\n", f.t[i].name, fsdp__st_dtype_str(f.t[i].dtype),
                fsdp__shape_str(sh, sizeof sh, f.t[i].ndim, f.t[i].shape), (unsigned long long)f.t[i].begin,
                (unsigned long long)f.t[i].end, f.t[i].crc ? "" : " (no checksum)");
    enum fsdp_status st = FSDP_OK;
    if (verify) {
        int unchecked = 0;
        st = fsdp__st_verify(ctx, &f, &unchecked);
        if (st == FSDP_OK)
            fprintf(out, "verified: ok (%d tensors checked by checksum, %d without checksums read whole)\n",
                    f.n - unchecked, unchecked);
    }
    fsdp__st_close(&f);
    return st;
}

enum fsdp_status fsdp_ckpt_to_full(struct fsdp_ctx *ctx, const char *dir, const char *path) {
    struct fsdp__meta mt;
    FSDP_TRY(fsdp__meta_load(ctx, dir, &mt));
    struct fsdp__fcache c;
    enum fsdp_status st = fsdp__fcache_open(ctx, &mt, &c);
    struct fsdp__st_desc *desc = fsdp__zalloc((size_t)(mt.n_params + mt.n_buffers) + 1, sizeof *desc);
    size_t len = 1;
    for (int i = 0; i < mt.n_buffers; i++) len += strlen(mt.buffers[i].fqn) + 1;
    char *names = fsdp__zalloc(len, 1); /* FSDP__BUFFERS_KEY ([Note: buffers] in buffers.c) */
    if ((!desc || !names) && st == FSDP_OK) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    for (int i = 0; desc && i < mt.n_params; i++) {
        desc[i].name = mt.params[i].fqn;
        desc[i].dtype = FSDP_F32;
        desc[i].ndim = mt.params[i].ndim;
        memcpy(desc[i].shape, mt.params[i].shape, sizeof desc[i].shape);
    }
    for (int i = 0; desc && names && i < mt.n_buffers; i++) {
        struct fsdp__st_desc *d = &desc[mt.n_params + i];
        d->name = mt.buffers[i].fqn;
        d->dtype = mt.buffers[i].dtype;
        d->ndim = mt.buffers[i].ndim;
        memcpy(d->shape, mt.buffers[i].shape, sizeof d->shape);
        if (i) strcat(names, ",");
        strcat(names, mt.buffers[i].fqn);
    }
    const char *kv[] = {"format", "pt", FSDP__LAYOUT_KEY, "out,in", FSDP__BUFFERS_KEY, names ? names : ""};
    struct fsdp__st_writer *w = NULL;
    if (st == FSDP_OK)
        st = fsdp__st_writer_open(ctx, path, mt.n_params + mt.n_buffers, desc, mt.n_buffers ? 3 : 2, kv, &w);
    for (int i = 0; i < mt.n_params && st == FSDP_OK; i++) {
        struct fsdp__meta_param *p = &mt.params[i];
        float *buf = fsdp__malloc((size_t)p->numel * sizeof(float) + 1);
        if (!buf) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory for '%s'", p->fqn);
        if (st == FSDP_OK) st = fsdp__fcache_read(ctx, &c, p, p->fqn, 0, p->numel, buf);
        if (st == FSDP_OK) st = fsdp__st_writer_write(w, buf, (size_t)p->numel * sizeof(float));
        free(buf);
    }
    for (int i = 0; i < mt.n_buffers && st == FSDP_OK; i++) {
        size_t bytes = (size_t)(mt.buffers[i].b1 - mt.buffers[i].b0);
        void *buf = fsdp__malloc(bytes + 1);
        st = buf ? fsdp__fcache_read_buffer(ctx, &c, &mt.buffers[i], buf)
                 : fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory for buffer '%s'", mt.buffers[i].fqn);
        if (st == FSDP_OK) st = fsdp__st_writer_write(w, buf, bytes);
        free(buf);
    }
    if (w) {
        if (st == FSDP_OK) st = fsdp__st_writer_commit(w);
        else fsdp__st_writer_abort(w);
    }
    fsdp__fcache_close(&c);
    free(desc);
    free(names);
    fsdp__meta_free(&mt);
    return st;
}

/* One tensor of the output folder: which input tensor, under which FQN and
 * shape, transposed or not ([Note: full file layouts]). */
struct out_tensor {
    int ti;
    char *fqn;
    int ndim;
    int64_t shape[FSDP_MAX_DIMS];
    int transpose;
    int buffer;             /* a buffer: whole in file 0, in its dtype ([Note: buffers] in buffers.c) */
    enum fsdp_dtype dtype;
};

static int ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && !strcmp(s + a - b, suf);
}

/* Whether tensor `name` of f is a buffer: listed in our FSDP__BUFFERS_KEY,
 * or, in a file without that key (exported from PyTorch), an I64 tensor or
 * batch norm's running statistics. */
static int is_buffer(const struct fsdp__st_file *f, const struct fsdp__st_tensor *t) {
    const char *list = fsdp__st_meta(f, FSDP__BUFFERS_KEY);
    if (!list)
        return t->dtype == FSDP_I64 || ends_with(t->name, ".running_mean") || ends_with(t->name, ".running_var") ||
               ends_with(t->name, ".num_batches_tracked");
    size_t n = strlen(t->name);
    for (const char *p = list; *p;) {
        const char *e = strchr(p, ',');
        size_t k = e ? (size_t)(e - p) : strlen(p);
        if (k == n && !strncmp(p, t->name, n)) return 1;
        p += k + (e != NULL);
    }
    return 0;
}

/* Maps the input's tensors to ours: HF names get "transformer.", HF buffers
 * and the tied lm_head are left out, Conv1D weights are transposed. */
static enum fsdp_status map_input(struct fsdp_ctx *ctx, const struct fsdp__st_file *f, struct out_tensor *out, int *n) {
    int hf;
    FSDP_TRY(fsdp__full_is_hf(ctx, f, &hf));
    *n = 0;
    for (int i = 0; i < f->n; i++) {
        const struct fsdp__st_tensor *t = &f->t[i];
        if (hf && fsdp__hf_ignorable(t->name)) continue;
        int buffer = is_buffer(f, t);
        if (buffer ? t->dtype != FSDP_F32 && t->dtype != FSDP_I64 : t->dtype != FSDP_F32)
            return fsdp__err(ctx, FSDP_ERR_UNSUPPORTED, "%s: %s '%s' is %s; only %s is converted", f->path,
                             buffer ? "buffer" : "tensor", t->name, fsdp__st_dtype_str(t->dtype),
                             buffer ? "F32 or I64" : "F32");
        struct out_tensor *o = &out[(*n)++];
        o->buffer = buffer;
        o->dtype = t->dtype;
        int bare = hf && strncmp(t->name, "transformer.", 12);
        size_t len = strlen(t->name) + 13;
        if (!(o->fqn = fsdp__malloc(len))) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
        snprintf(o->fqn, len, "%s%s", bare ? "transformer." : "", t->name);
        o->ti = i;
        o->ndim = t->ndim;
        o->transpose = hf && !buffer && t->ndim == 2 && fsdp__is_conv1d(o->fqn);
        for (int d = 0; d < t->ndim; d++) o->shape[d] = t->shape[o->transpose ? 1 - d : d];
        for (int k = 0; k < *n - 1; k++)
            if (!strcmp(out[k].fqn, o->fqn))
                return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: '%s' and '%s' are both parameter '%s'", f->path,
                                 f->t[out[k].ti].name, t->name, o->fqn);
    }
    return FSDP_OK;
}

static void cfg_str(char *buf, size_t n, const struct fsdp_gpt_config *c) {
    snprintf(buf, n, "n_layer %d n_head %d n_embd %d vocab_size %d block_size %d", c->n_layer, c->n_head,
             c->n_embd, c->vocab_size, c->block_size);
}

static enum fsdp_status check_param(struct fsdp_ctx *ctx, const char *path, const char *cs, const struct fsdp_param *p,
                                    const struct out_tensor *out, int n, char *seen) {
    if (p->tied_to) return FSDP_OK;
    for (int k = 0; k < n; k++) {
        if (strcmp(out[k].fqn, p->fqn)) continue;
        int same = out[k].ndim == p->ndim;
        for (int d = 0; same && d < p->ndim; d++) same = out[k].shape[d] == p->shape[d];
        if (!same) {
            char a[96], b[96];
            return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: parameter '%s' has shape %s%s, the model (%s) needs %s",
                             path, p->fqn, fsdp__shape_str(a, sizeof a, out[k].ndim, out[k].shape),
                             out[k].transpose ? " (transposed from HF Conv1D)" : "", cs,
                             fsdp__shape_str(b, sizeof b, p->ndim, p->shape));
        }
        seen[k] = 1;
        return FSDP_OK;
    }
    return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: parameter '%s' of the model (%s) is not in the file", path, p->fqn, cs);
}

static enum fsdp_status check_module(struct fsdp_ctx *ctx, const char *path, const char *cs,
                                     const struct fsdp_module *m, const struct out_tensor *out, int n, char *seen) {
    for (int i = 0; i < m->n_params; i++) FSDP_TRY(check_param(ctx, path, cs, m->params[i], out, n, seen));
    for (int i = 0; i < m->n_children; i++) FSDP_TRY(check_module(ctx, path, cs, m->children[i], out, n, seen));
    return FSDP_OK;
}

/* The output tensors are exactly the parameters of the GPT of config. */
static enum fsdp_status check_model(struct fsdp_ctx *ctx, const char *path, const struct fsdp_gpt_config *config,
                                    const struct out_tensor *out, int n) {
    char cs[160];
    cfg_str(cs, sizeof cs, config);
    struct fsdp_module *gpt = NULL;
    char *seen = fsdp__zalloc((size_t)n + 1, 1);
    enum fsdp_status st = seen ? fsdp_gpt_create(ctx, config, &gpt) : fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    if (st == FSDP_OK) st = check_module(ctx, path, cs, gpt, out, n, seen);
    for (int k = 0; k < n && st == FSDP_OK; k++)
        if (!seen[k])
            st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: tensor '%s' is no parameter of the model (%s)", path,
                           out[k].fqn, cs);
    fsdp_module_free(gpt);
    free(seen);
    return st;
}

/* verify: a checkpoint with a model_config holds exactly the parameters of
 * that GPT, by name and shape, as fsdp_ckpt_load into that model checks. */
static enum fsdp_status verify_model(struct fsdp_ctx *ctx, const struct fsdp__meta *mt) {
    char *mpath = fsdp__path_join(mt->dir, FSDP__META_NAME);
    struct out_tensor *ot = fsdp__zalloc((size_t)mt->n_params + 1, sizeof *ot);
    enum fsdp_status st = mpath && ot ? FSDP_OK : fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    for (int i = 0; i < mt->n_params && st == FSDP_OK; i++) {
        const struct fsdp__meta_param *p = &mt->params[i];
        ot[i] = (struct out_tensor){i, p->fqn, p->ndim, {0}, 0, 0, FSDP_F32};
        memcpy(ot[i].shape, p->shape, sizeof ot[i].shape);
    }
    if (st == FSDP_OK && fsdp_gpt_config_validate(ctx, &mt->m.config) != FSDP_OK) {
        char msg[sizeof ctx->errmsg];
        snprintf(msg, sizeof msg, "%s", fsdp_errmsg(ctx));
        st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: model_config: %s", mpath, msg);
    }
    if (st == FSDP_OK) st = check_model(ctx, mpath, &mt->m.config, ot, mt->n_params); /* names and shapes */
    free(ot); /* the fqns belong to mt */
    free(mpath);
    return st;
}

/* Elements [s, e) of output tensor o (our layout) into dst; a transposed
 * tensor is read whole into *tbuf (kept between calls for the same tensor). */
static enum fsdp_status read_out(struct fsdp_ctx *ctx, const struct fsdp__st_file *f, const struct out_tensor *o,
                                 int64_t s, int64_t e, float *dst, float **tbuf, int *tbuf_ti) {
    if (!o->transpose) return fsdp__st_read(ctx, f, o->ti, (uint64_t)s * 4, (uint64_t)e * 4, dst);
    int64_t rows = o->shape[0], cols = o->shape[1]; /* ours (rows, cols); stored (cols, rows) */
    if (*tbuf_ti != o->ti) {
        free(*tbuf);
        *tbuf_ti = -1;
        if (!(*tbuf = fsdp__malloc((size_t)(rows * cols) * sizeof(float) + 1)))
            return fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory transposing '%s'", f->path, f->t[o->ti].name);
        FSDP_TRY(fsdp__st_read(ctx, f, o->ti, 0, (uint64_t)(rows * cols) * 4, *tbuf));
        *tbuf_ti = o->ti;
    }
    for (int64_t x = s; x < e; x++) dst[x - s] = (*tbuf)[(x % cols) * rows + x / cols];
    return FSDP_OK;
}

enum fsdp_status fsdp_ckpt_from_full(struct fsdp_ctx *ctx, const char *path, const char *dir, int n_files) {
    return fsdp_ckpt_from_full_model(ctx, path, dir, n_files, NULL);
}

enum fsdp_status fsdp_ckpt_from_full_model(struct fsdp_ctx *ctx, const char *path, const char *dir, int n_files,
                                           const struct fsdp_gpt_config *config) {
    if (n_files < 1 || n_files > 4096) return fsdp__err(ctx, FSDP_ERR_INVALID, "from_full: %d files", n_files);
    if (config) FSDP_TRY(fsdp_gpt_config_validate(ctx, config));
    struct fsdp__st_file f;
    FSDP_TRY(fsdp__st_open(ctx, path, &f));
    int nt = 0;
    struct out_tensor *ot = fsdp__zalloc((size_t)f.n + 1, sizeof *ot);
    enum fsdp_status st = ot ? map_input(ctx, &f, ot, &nt) : fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    if (st == FSDP_OK && config) st = check_model(ctx, path, config, ot, nt);
    char tmpdir[PATH_MAX];
    snprintf(tmpdir, sizeof tmpdir, "%s.tmp", dir);
    if (st == FSDP_OK) st = fsdp_ckpt_check_target(ctx, dir); /* [Note: only our own files] */
    int made = 0, wrote = 0; /* this conversion created tmpdir; rank files 0..wrote-1 it wrote there */
    if (st == FSDP_OK && !(made = mkdir(tmpdir, 0755) == 0) && errno != EEXIST)
        st = fsdp__err(ctx, FSDP_ERR_IO, "%s: cannot create: %s", tmpdir, strerror(errno));
    /* tensor i's piece r: elements [numel*r/n, numel*(r+1)/n) */
    struct fsdp__st_desc *desc = fsdp__zalloc((size_t)f.n + 1, sizeof *desc);
    if (!desc && st == FSDP_OK) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    int nparams = 0, nbufs = 0;
    for (int i = 0; i < nt; i++) ot[i].buffer ? nbufs++ : nparams++;
    struct fsdp__meta mt;
    memset(&mt, 0, sizeof mt);
    if (st == FSDP_OK) st = fsdp__meta_alloc(ctx, &mt, n_files, nparams, nbufs); /* step, seed, optim: 0 */
    if (config) mt.m.config = *config, mt.m.has_config = 1;
    for (int i = 0; i < nt && st == FSDP_OK; i++) {
        if (ot[i].buffer) continue;
        struct fsdp__meta_param *q = &mt.params[mt.n_params++];
        q->ndim = ot[i].ndim;
        memcpy(q->shape, ot[i].shape, sizeof q->shape);
        q->numel = f.t[ot[i].ti].numel;
        if (!(q->fqn = fsdp__strdup(ot[i].fqn)) || !(q->ranges = fsdp__zalloc((size_t)n_files, sizeof *q->ranges)))
            st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    }
    float *buf = NULL, *tbuf = NULL;
    int tbuf_ti = -1;
    for (int r = 0; r < n_files && st == FSDP_OK; r++) {
        int n = 0;
        for (int i = 0; i < nt; i++) {
            int64_t numel = f.t[ot[i].ti].numel, s = numel * r / n_files, e = numel * (r + 1) / n_files;
            if (ot[i].buffer && r == 0) {
                desc[n] = (struct fsdp__st_desc){ot[i].fqn, ot[i].dtype, ot[i].ndim, {0}};
                memcpy(desc[n++].shape, ot[i].shape, sizeof ot[i].shape);
            } else if (!ot[i].buffer && s < e) {
                desc[n++] = (struct fsdp__st_desc){ot[i].fqn, FSDP_F32, 1, {e - s, 0, 0, 0}};
            }
        }
        char name[64];
        fsdp__ckpt_rank_file_name(name, sizeof name, r, n_files);
        char *fpath = fsdp__path_join(tmpdir, name);
        const char *kv[] = {"format", "pt"};
        struct fsdp__st_writer *w = NULL;
        st = fpath ? fsdp__st_writer_open(ctx, fpath, n, desc, 1, kv, &w)
                   : fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory for the path of %s/%s", tmpdir, name);
        for (int i = 0; i < nt && st == FSDP_OK; i++) {
            int64_t numel = f.t[ot[i].ti].numel, s = numel * r / n_files, e = numel * (r + 1) / n_files;
            if (ot[i].buffer) { /* whole, in file 0 */
                if (r) continue;
                size_t bytes = (size_t)(f.t[ot[i].ti].end - f.t[ot[i].ti].begin);
                void *bb = fsdp__malloc(bytes + 1);
                st = bb ? fsdp__st_read(ctx, &f, ot[i].ti, 0, bytes, bb)
                        : fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory for buffer '%s' (%zu bytes)", path,
                                    ot[i].fqn, bytes);
                if (st == FSDP_OK) st = fsdp__st_writer_write(w, bb, bytes);
                free(bb);
                continue;
            }
            if (s >= e) continue;
            float *nb = fsdp__realloc(buf, (size_t)(e - s) * sizeof(float));
            if (!nb) {
                st = fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory for %lld floats of '%s'", path,
                               (long long)(e - s), ot[i].fqn);
                break;
            }
            buf = nb;
            st = read_out(ctx, &f, &ot[i], s, e, buf, &tbuf, &tbuf_ti);
            if (st == FSDP_OK) st = fsdp__ckpt_finite(ctx, path, f.t[ot[i].ti].name, ot[i].fqn, buf, e - s, s);
            if (st == FSDP_OK) st = fsdp__st_writer_write(w, buf, (size_t)(e - s) * sizeof(float));
        }
        if (w) {
            if (st == FSDP_OK) st = fsdp__st_writer_commit(w);
            else fsdp__st_writer_abort(w);
        }
        if (st == FSDP_OK) wrote = r + 1;
        struct fsdp__st_file g;
        if (st == FSDP_OK) st = fsdp__st_open(ctx, fpath, &g);
        if (st == FSDP_OK) {
            struct fsdp__meta_file *mf = &mt.files[mt.n_files++];
            mf->bytes = g.file_size;
            if (!(mf->name = fsdp__strdup(name))) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
            for (int i = 0, k = 0; i < nt && st == FSDP_OK; i++) {
                int ti = fsdp__st_find(&g, ot[i].fqn);
                if (ot[i].buffer) {
                    if (r || ti < 0) continue;
                    struct fsdp__meta_buffer *q = &mt.buffers[mt.n_buffers++];
                    *q = (struct fsdp__meta_buffer){fsdp__strdup(ot[i].fqn), ot[i].dtype, ot[i].ndim, {0},
                                                    f.t[ot[i].ti].numel, 0, g.data_start + g.t[ti].begin,
                                                    g.data_start + g.t[ti].end};
                    memcpy(q->shape, ot[i].shape, sizeof q->shape);
                    if (!q->fqn) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
                    continue;
                }
                struct fsdp__meta_param *q = &mt.params[k++]; /* the non-buffers in order */
                int64_t numel = f.t[ot[i].ti].numel, s = numel * r / n_files, e = numel * (r + 1) / n_files;
                if (s >= e || ti < 0) continue;
                q->ranges[q->n_ranges++] = (struct fsdp__meta_range){r, s, e, g.data_start + g.t[ti].begin,
                                                                     g.data_start + g.t[ti].end};
            }
            fsdp__st_close(&g);
        }
        free(fpath);
    }
    free(buf);
    free(tbuf);
    char *text = NULL, *mpath = fsdp__path_join(tmpdir, FSDP__META_NAME);
    if (st == FSDP_OK && !mpath) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    if (st == FSDP_OK) st = fsdp__meta_format(ctx, mpath, &mt, &text);
    fsdp__meta_free(&mt);
    if (st == FSDP_OK) st = fsdp__write_durable(ctx, mpath, text);
    int committing = st == FSDP_OK;
    if (committing) st = fsdp__ckpt_commit_dir(ctx, dir, tmpdir, n_files);
    /* a commit that failed with meta.json still in tmpdir did swap: tmpdir is the previous checkpoint */
    struct stat msb;
    if (st != FSDP_OK && (!committing || stat(mpath, &msb) != 0)) {
        /* [Note: a failed save leaves nothing of its own] (sharded.c): the rank files it wrote, its folder */
        for (int r = 0; r < wrote; r++) {
            char name[64];
            fsdp__ckpt_rank_file_name(name, sizeof name, r, n_files);
            char *fp = fsdp__path_join(tmpdir, name);
            if (fp) unlink(fp);
            free(fp);
        }
        if (made) rmdir(tmpdir); /* fails, leaving it, if anything else is in it */
    }
    free(mpath);
    free(text);
    free(desc);
    for (int i = 0; ot && i < nt; i++) free(ot[i].fqn);
    free(ot);
    fsdp__st_close(&f);
    return st;
}
