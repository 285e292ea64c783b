/*
 * ckpt.c - checkpoints of a sharded model: the sharded folder (one
 * safetensors file per rank + meta.json, loadable at any world size), the
 * full safetensors file (written by rank 0 one gathered unit at a time,
 * loaded by every rank reading its own ranges or by rank 0 with broadcast),
 * Hugging Face GPT-2 import, and the offline describe / convert helpers.
 * Sits in fsdp/ because it needs unit layouts; the file format is io/'s.
 * Invariants: everything outside this file is per parameter (FQN, global
 * shape, element ranges); flat offsets and padding never reach a file.
 *
 * [Note: sharded layout] Rank r's file holds, for every parameter that
 * overlaps r's shard of its unit, the tensor "<fqn>" = elements [s, e) of the
 * flattened parameter (1-D, shape [e - s]) and, with optimizer state,
 * "<fqn>#<state>" for each state array (exp_avg, exp_avg_sq or momentum).
 * meta.json lists for each parameter the (file, start, end, bytes) pieces,
 * which must tile [0, numel) exactly. A loader at any world size intersects
 * its own shard ranges with the pieces, so resharding needs no layout of the
 * saving run, only element ranges.
 *
 * [Note: atomic folder] Every rank writes its file into dir.tmp (tmp name,
 * fsync, rename); the ranks agree that all succeeded; rank 0 writes
 * meta.json the same way, fsyncs, renames dir -> dir.old, dir.tmp -> dir,
 * removes dir.old and fsyncs the parent. A folder without meta.json is never
 * a checkpoint, so a crash at any point leaves the previous one loadable.
 */
#include "fsdp/fsdp-impl.h"
#include "io/io-impl.h"
#include "optim/optim-impl.h"

#include <cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <string.h>
#include <stdio.h> /* renameat2 */
#include <sys/stat.h>
#include <unistd.h>

#define META_NAME "meta.json"
#define META_FORMAT "fsdp.c sharded checkpoint"
#define LAYOUT_KEY "fsdp.linear_layout" /* "out,in" in our files; absent in HF files */
#define MAX_META_BYTES ((size_t)256 << 20)

static const char *const adam_names[] = {"exp_avg", "exp_avg_sq"};
static const char *const sgd_names[] = {"momentum_buffer"};

static const char *const *state_names(const struct fsdp_optim *opt, int *k) {
    *k = opt ? fsdp_optim_state_per_elem(opt) : 0;
    if (*k == 2) return adam_names;
    if (*k == 1) return sgd_names;
    *k = 0;
    return NULL;
}

/* ---- Agreement: every rank returns the first failing rank's status and message ---- */

static enum fsdp_status agree(struct fsdp_ctx *ctx, enum fsdp_status st) {
    if (ctx->world == 1) return st;
    int mine = st != FSDP_OK ? ctx->rank : ctx->world, first = mine;
    if (fsdp_comm_allreduce(ctx->comm, &mine, &first, 1, FSDP_I32, FSDP_MIN) != FSDP_OK) return FSDP_ERR_COMM;
    if (first == ctx->world) return FSDP_OK;
    int code = (int)st;
    char msg[sizeof ctx->errmsg];
    snprintf(msg, sizeof msg, "%s", ctx->errmsg);
    if (fsdp_comm_broadcast(ctx->comm, &code, 1, FSDP_I32, first) != FSDP_OK ||
        fsdp_comm_broadcast(ctx->comm, msg, sizeof msg, FSDP_U8, first) != FSDP_OK)
        return FSDP_ERR_COMM;
    msg[sizeof msg - 1] = 0;
    if (first != ctx->rank) fsdp__err(ctx, (enum fsdp_status)code, "rank %d: %s", first, msg);
    return (enum fsdp_status)code;
}

static enum fsdp_status check_idle(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *what) {
    for (int i = 0; i < fm->n_units; i++)
        if (fm->units[i].state_ != UNIT_SHARDED)
            return fsdp__err(ctx, FSDP_ERR_STATE, "%s: unit '%s' is gathered or failed (state %d)", what,
                             fm->units[i].module->fqn, (int)fm->units[i].state_);
    return FSDP_OK;
}

/* This rank's overlap [s, e) (flat) of parameter j of u; returns 0 if none. */
static int overlap(const struct fsdp__unit *u, int rank, int j, int64_t *s, int64_t *e) {
    int64_t lo = (int64_t)rank * u->numel_shard, hi = lo + u->numel_shard;
    int64_t a = u->offsets[j], b = a + u->params[j]->numel;
    *s = a > lo ? a : lo;
    *e = b < hi ? b : hi;
    return *s < *e;
}

static char *path_join(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

static void rank_file_name(char *buf, size_t n, int r, int world) {
    snprintf(buf, n, "rank-%05d-of-%05d.safetensors", r, world);
}

static char *read_text(struct fsdp_ctx *ctx, const char *path, enum fsdp_status *st) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        *st = fsdp__err(ctx, FSDP_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
        return NULL;
    }
    struct stat sb;
    size_t cap = fstat(fileno(f), &sb) == 0 && (uint64_t)sb.st_size <= MAX_META_BYTES ? (size_t)sb.st_size + 1
                                                                                    : MAX_META_BYTES + 1;
    char *buf = malloc(cap + 1);
    size_t n = buf ? fread(buf, 1, cap, f) : 0; /* reads one byte more than stat said: growth shows */
    fclose(f);
    if (!buf) {
        *st = fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory", path);
        return NULL;
    }
    if (n > MAX_META_BYTES) {
        free(buf);
        *st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: larger than %zu bytes", path, MAX_META_BYTES);
        return NULL;
    }
    buf[n] = 0;
    *st = FSDP_OK;
    return buf;
}

/* Writes text to path via path.tmp + fsync + rename. */
static enum fsdp_status write_durable(struct fsdp_ctx *ctx, const char *path, const char *text) {
    char tmp[PATH_MAX];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return fsdp__err(ctx, FSDP_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
    enum fsdp_status st = fsdp__write_all(ctx, fd, tmp, text, strlen(text), 0);
    if (st == FSDP_OK && fsync(fd) != 0) st = fsdp__err(ctx, FSDP_ERR_IO, "%s: fsync: %s", tmp, strerror(errno));
    close(fd);
    if (st == FSDP_OK && rename(tmp, path) != 0)
        st = fsdp__err(ctx, FSDP_ERR_IO, "%s: cannot rename: %s", tmp, strerror(errno));
    if (st != FSDP_OK) unlink(tmp);
    return st;
}

/* [Note: sealed meta.json] meta.json opens with the field "crc32c": the
 * CRC-32C of the whole text with that field's 8 hex digits as "00000000".
 * The writer fills the digits in after printing; the reader zeroes them in a
 * copy and compares, so any edit or corruption of meta.json is caught. */
#define SEAL_PREFIX "{\n\t\"crc32c\":\t\""

static void seal_meta(char *text) {
    FSDP_ASSERT(!strncmp(text, SEAL_PREFIX "00000000\"", strlen(SEAL_PREFIX) + 9), "meta.json layout");
    char hex[9];
    snprintf(hex, sizeof hex, "%08x", fsdp__crc32c(0, text, strlen(text)));
    memcpy(text + strlen(SEAL_PREFIX), hex, 8);
}

static enum fsdp_status check_meta(struct fsdp_ctx *ctx, const char *path, char *text) {
    size_t n = strlen(text), p = strlen(SEAL_PREFIX);
    if (n < p + 9 || strncmp(text, SEAL_PREFIX, p) || text[p + 8] != '"')
        return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: does not open with its \"crc32c\" field (not written by fsdp.c, or damaged)",
                         path);
    char saved[8];
    memcpy(saved, text + p, 8);
    uint32_t want = 0;
    for (int i = 0; i < 8; i++) {
        char ch = saved[i];
        int v = ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : -1;
        if (v < 0) return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: \"crc32c\" is not 8 lowercase hex digits", path);
        want = want << 4 | (uint32_t)v;
    }
    memset(text + p, '0', 8);
    uint32_t got = fsdp__crc32c(0, text, n);
    memcpy(text + p, saved, 8);
    if (got != want)
        return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: checksum mismatch (crc32c %08x, recorded %08x): edited or corrupted",
                         path, got, want);
    return FSDP_OK;
}

/* Removes a flat folder and the files in it (no recursion). */
static void remove_flat_dir(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char *p = path_join(dir, e->d_name);
        if (p) unlink(p);
        free(p);
    }
    closedir(d);
    rmdir(dir);
}

/* ---- Sharded save ---- */

struct piece { /* one tensor of a rank file */
    struct fsdp__unit *u;
    int j;          /* param index in u */
    int state;      /* -1: parameter values, else state array index */
    int64_t s, e;   /* flat range of u */
};

/* Lists the tensors rank r writes, in file order ([Note: sharded layout]).
 * names: malloc'd strings, caller frees. */
static enum fsdp_status plan_rank(struct fsdp_ctx *ctx, struct fsdp_model *fm, int r, int k,
                                  const char *const *snames, struct piece **pieces,
                                  struct fsdp__st_desc **desc, int *n) {
    int cap = 0;
    for (int i = 0; i < fm->n_units; i++) cap += fm->units[i].n_params * (1 + k);
    *pieces = calloc((size_t)cap + 1, sizeof **pieces);
    *desc = calloc((size_t)cap + 1, sizeof **desc);
    if (!*pieces || !*desc) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory planning a checkpoint");
    *n = 0;
    for (int state = -1; state < k; state++)
        for (int i = 0; i < fm->n_units; i++) {
            struct fsdp__unit *u = &fm->units[i];
            for (int j = 0; j < u->n_params; j++) {
                int64_t s, e;
                if (!overlap(u, r, j, &s, &e)) continue;
                const char *fqn = u->params[j]->fqn;
                size_t len = strlen(fqn) + (state >= 0 ? strlen(snames[state]) + 2 : 1);
                char *name = malloc(len);
                if (!name) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory planning a checkpoint");
                if (state >= 0) snprintf(name, len, "%s#%s", fqn, snames[state]);
                else snprintf(name, len, "%s", fqn);
                (*pieces)[*n] = (struct piece){u, j, state, s, e};
                (*desc)[*n] = (struct fsdp__st_desc){name, FSDP_F32, 1, {e - s, 0, 0, 0}};
                (*n)++;
            }
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
    const char *const *snames = state_names(fm->optim, &k);
    struct piece *pieces = NULL;
    struct fsdp__st_desc *desc = NULL;
    int n = 0;
    enum fsdp_status st = plan_rank(ctx, fm, ctx->rank, k, snames, &pieces, &desc, &n);
    char name[64], rankstr[16], worldstr[16];
    rank_file_name(name, sizeof name, ctx->rank, ctx->world);
    snprintf(rankstr, sizeof rankstr, "%d", ctx->rank);
    snprintf(worldstr, sizeof worldstr, "%d", ctx->world);
    const char *kv[] = {"format", "pt", "fsdp.rank", rankstr, "fsdp.world", worldstr};
    char *path = path_join(tmpdir, name);
    if (st == FSDP_OK && !path) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    struct fsdp__st_writer *w = NULL;
    if (st == FSDP_OK) st = fsdp__st_writer_open(ctx, path, n, desc, 3, kv, &w);
    for (int i = 0; i < n && st == FSDP_OK; i++) {
        struct piece *p = &pieces[i];
        int64_t lo = (int64_t)ctx->rank * p->u->numel_shard;
        const float *src = p->state < 0 ? p->u->shard : p->u->state + (int64_t)p->state * p->u->numel_shard;
        st = fsdp__st_writer_write(w, src + (p->s - lo), (size_t)(p->e - p->s) * sizeof(float));
    }
    if (st == FSDP_OK) st = fsdp__st_writer_commit(w);
    else fsdp__st_writer_abort(w);
    free(path);
    free_plan(pieces, desc, n);
    return st;
}

static void add_config(cJSON *root, const struct fsdp_gpt_config *c) {
    cJSON *o = cJSON_AddObjectToObject(root, "model_config");
    if (!o) return;
    cJSON_AddNumberToObject(o, "n_layer", c->n_layer);
    cJSON_AddNumberToObject(o, "n_head", c->n_head);
    cJSON_AddNumberToObject(o, "n_embd", c->n_embd);
    cJSON_AddNumberToObject(o, "vocab_size", c->vocab_size);
    cJSON_AddNumberToObject(o, "block_size", c->block_size);
}

/* meta.json, by rank 0 after every rank file exists: the layout is a pure
 * function of (model, world), and byte ranges come from the files' headers. */
static enum fsdp_status write_meta(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *tmpdir,
                                   const struct fsdp_ckpt_meta *m) {
    int k;
    const char *const *snames = state_names(fm->optim, &k);
    struct fsdp__st_file *files = calloc((size_t)ctx->world, sizeof *files);
    if (!files) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    for (int r = 0; r < ctx->world; r++) files[r].fd = -1;
    enum fsdp_status st = FSDP_OK;
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "crc32c", "00000000"); /* first: [Note: sealed meta.json] */
    cJSON_AddStringToObject(root, "format", META_FORMAT);
    cJSON_AddNumberToObject(root, "version", 1);
    cJSON_AddNumberToObject(root, "world", ctx->world);
    cJSON_AddNumberToObject(root, "step", (double)m->step);
    cJSON_AddNumberToObject(root, "data_step", (double)m->data_step);
    cJSON_AddNumberToObject(root, "lr_step", (double)m->step);
    char seed[32];
    snprintf(seed, sizeof seed, "%llu", (unsigned long long)m->seed);
    cJSON_AddStringToObject(root, "seed", seed);
    cJSON_AddStringToObject(root, "rng", "philox4x32-10 keyed by (seed, fqn): the seed is the state");
    cJSON_AddNumberToObject(root, "optim_step", fm->optim ? (double)fsdp_optim_step_count(fm->optim) : 0);
    cJSON *sn = cJSON_AddArrayToObject(root, "optim_state");
    for (int i = 0; i < k; i++) cJSON_AddItemToArray(sn, cJSON_CreateString(snames[i]));
    if (m->has_config) add_config(root, &m->config);
    cJSON *fl = cJSON_AddArrayToObject(root, "files");
    for (int r = 0; r < ctx->world && st == FSDP_OK; r++) {
        char name[64];
        rank_file_name(name, sizeof name, r, ctx->world);
        char *path = path_join(tmpdir, name);
        st = path ? fsdp__st_open(ctx, path, &files[r]) : fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
        free(path);
        cJSON *fo = cJSON_CreateObject();
        cJSON_AddItemToArray(fl, fo);
        cJSON_AddStringToObject(fo, "name", name);
        cJSON_AddNumberToObject(fo, "bytes", (double)files[r].file_size);
    }
    cJSON *params = cJSON_AddArrayToObject(root, "params");
    for (int i = 0; i < fm->n_units && st == FSDP_OK; i++) {
        struct fsdp__unit *u = &fm->units[i];
        for (int j = 0; j < u->n_params; j++) {
            struct fsdp_param *p = u->params[j];
            cJSON *po = cJSON_CreateObject();
            cJSON_AddItemToArray(params, po);
            cJSON_AddStringToObject(po, "fqn", p->fqn);
            cJSON *sh = cJSON_AddArrayToObject(po, "shape");
            for (int d = 0; d < p->ndim; d++) cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)p->shape[d]));
            cJSON_AddStringToObject(po, "dtype", "F32");
            cJSON *rg = cJSON_AddArrayToObject(po, "ranges");
            for (int r = 0; r < ctx->world; r++) {
                int64_t s, e;
                if (!overlap(u, r, j, &s, &e)) continue;
                int ti = fsdp__st_find(&files[r], p->fqn);
                if (ti < 0) {
                    st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: rank %d's file lacks '%s'", tmpdir, r, p->fqn);
                    break;
                }
                cJSON *ro = cJSON_CreateObject();
                cJSON_AddItemToArray(rg, ro);
                cJSON_AddNumberToObject(ro, "file", r);
                cJSON_AddNumberToObject(ro, "start", (double)(s - u->offsets[j]));
                cJSON_AddNumberToObject(ro, "end", (double)(e - u->offsets[j]));
                cJSON *b = cJSON_AddArrayToObject(ro, "bytes");
                cJSON_AddItemToArray(b, cJSON_CreateNumber((double)(files[r].data_start + files[r].t[ti].begin)));
                cJSON_AddItemToArray(b, cJSON_CreateNumber((double)(files[r].data_start + files[r].t[ti].end)));
            }
        }
    }
    for (int r = 0; r < ctx->world; r++) fsdp__st_close(&files[r]);
    free(files);
    char *text = st == FSDP_OK ? cJSON_Print(root) : NULL;
    cJSON_Delete(root);
    if (st == FSDP_OK && !text) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory writing meta.json");
    char *mpath = path_join(tmpdir, META_NAME);
    if (st == FSDP_OK) fsdp__ckpt_crash_point("before meta.json");
    if (st == FSDP_OK) seal_meta(text);
    if (st == FSDP_OK) st = mpath ? write_durable(ctx, mpath, text) : fsdp__err(ctx, FSDP_ERR_NOMEM, "oom");
    free(mpath);
    free(text);
    return st;
}

/* Rank 0: removes files of dir.tmp that this save did not write (a crashed
 * save at another world size), then swaps dir.tmp into place. */
static enum fsdp_status commit_dir(struct fsdp_ctx *ctx, const char *dir, const char *tmpdir, int nfiles) {
    DIR *d = opendir(tmpdir);
    if (d) {
        struct dirent *e;
        while ((e = readdir(d))) {
            int keep = !strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") || !strcmp(e->d_name, META_NAME);
            for (int r = 0; r < nfiles && !keep; r++) {
                char name[64];
                rank_file_name(name, sizeof name, r, nfiles);
                keep = !strcmp(e->d_name, name);
            }
            if (keep) continue;
            char *p = path_join(tmpdir, e->d_name);
            if (p) unlink(p);
            free(p);
        }
        closedir(d);
    }
    FSDP_TRY(fsdp__fsync_dir(ctx, tmpdir)); /* fsyncs the parent of tmpdir... */
    char self[PATH_MAX];
    snprintf(self, sizeof self, "%s/.", tmpdir);
    FSDP_TRY(fsdp__fsync_dir(ctx, self)); /* ...and tmpdir itself */
    fsdp__ckpt_crash_point("before folder rename");
    struct stat sb;
    if (stat(dir, &sb) == 0) {
        /* replace an existing checkpoint: swap the two folders atomically,
         * then remove the old one (now under the tmp name) */
        if (renameat2(AT_FDCWD, tmpdir, AT_FDCWD, dir, RENAME_EXCHANGE) != 0)
            return fsdp__err(ctx, FSDP_ERR_IO, "%s: cannot swap in %s: %s", dir, tmpdir, strerror(errno));
        FSDP_TRY(fsdp__fsync_dir(ctx, dir));
        remove_flat_dir(tmpdir);
        return FSDP_OK;
    }
    if (rename(tmpdir, dir) != 0)
        return fsdp__err(ctx, FSDP_ERR_IO, "%s: cannot rename to %s: %s", tmpdir, dir, strerror(errno));
    return fsdp__fsync_dir(ctx, dir);
}

enum fsdp_status fsdp_ckpt_save(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *dir,
                                const struct fsdp_ckpt_meta *meta) {
    struct fsdp_ckpt_meta zero = {0};
    if (!meta) meta = &zero;
    char tmpdir[PATH_MAX];
    enum fsdp_status st = check_idle(ctx, fm, "ckpt_save");
    if (st == FSDP_OK && (!dir || !dir[0] || strlen(dir) > PATH_MAX - 64))
        st = fsdp__err(ctx, FSDP_ERR_INVALID, "ckpt_save: bad folder name");
    if (st == FSDP_OK) {
        snprintf(tmpdir, sizeof tmpdir, "%s.tmp", dir);
        if (mkdir(tmpdir, 0755) != 0 && errno != EEXIST)
            st = fsdp__err(ctx, FSDP_ERR_IO, "%s: cannot create: %s", tmpdir, strerror(errno));
    }
    if (st == FSDP_OK) st = save_rank_file(ctx, fm, tmpdir);
    st = agree(ctx, st);
    if (st != FSDP_OK) return st;
    if (ctx->rank == 0) {
        st = write_meta(ctx, fm, tmpdir, meta);
        if (st == FSDP_OK) st = commit_dir(ctx, dir, tmpdir, ctx->world);
    }
    return agree(ctx, st);
}

/* ---- meta.json ---- */

struct mrange {
    int file;
    int64_t start, end;
    uint64_t b0, b1;
};
struct mparam {
    char *fqn;
    int ndim;
    int64_t shape[FSDP_MAX_DIMS], numel;
    int n_ranges;
    struct mrange *ranges;
};
struct mfile {
    char *name;
    uint64_t bytes;
};
struct meta {
    char *dir;
    struct fsdp_ckpt_meta m;
    int n_state;
    char *state[4];
    int n_files;
    struct mfile *files;
    int n_params;
    struct mparam *params;
};

static void meta_free(struct meta *mt) {
    for (int i = 0; i < mt->n_params; i++) {
        free(mt->params[i].fqn);
        free(mt->params[i].ranges);
    }
    for (int i = 0; i < mt->n_files; i++) free(mt->files[i].name);
    for (int i = 0; i < mt->n_state; i++) free(mt->state[i]);
    free(mt->params);
    free(mt->files);
    free(mt->dir);
    memset(mt, 0, sizeof *mt);
}

static int get_int(const cJSON *o, const char *key, int64_t lo, int64_t hi, int64_t *out) {
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(j)) return 0;
    double v = j->valuedouble;
    if (!(v >= (double)lo && v <= (double)hi) || v != (double)(int64_t)v) return 0;
    *out = (int64_t)v;
    return 1;
}

static int by_start(const void *a, const void *b) {
    const struct mrange *x = a, *y = b;
    return x->start < y->start ? -1 : x->start > y->start;
}

#define BAD(...) (st = fsdp__err(ctx, FSDP_ERR_FORMAT, __VA_ARGS__))

static enum fsdp_status meta_parse(struct fsdp_ctx *ctx, const char *mpath, const cJSON *root, struct meta *mt) {
    enum fsdp_status st = FSDP_OK;
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(root, "format");
    if (!cJSON_IsObject(root) || !cJSON_IsString(fmt) || strcmp(fmt->valuestring, META_FORMAT))
        return BAD("%s: not an fsdp.c checkpoint (\"format\" is not \"%s\")", mpath, META_FORMAT);
    int64_t v, world, step, dstep, ostep;
    if (!get_int(root, "version", 1, 1, &v)) return BAD("%s: unsupported \"version\" (want 1)", mpath);
    if (!get_int(root, "world", 1, 1 << 20, &world)) return BAD("%s: \"world\" is missing or invalid", mpath);
    if (!get_int(root, "step", 0, INT64_C(1) << 52, &step) || !get_int(root, "data_step", 0, INT64_C(1) << 52, &dstep) ||
        !get_int(root, "optim_step", 0, INT64_C(1) << 52, &ostep))
        return BAD("%s: \"step\", \"data_step\" or \"optim_step\" is missing or invalid", mpath);
    mt->m.world = (int)world;
    mt->m.step = step;
    mt->m.data_step = dstep;
    mt->m.optim_step = ostep;
    const cJSON *seed = cJSON_GetObjectItemCaseSensitive(root, "seed");
    char *end;
    if (!cJSON_IsString(seed) || !(mt->m.seed = strtoull(seed->valuestring, &end, 10), *end == 0 && end != seed->valuestring))
        return BAD("%s: \"seed\" is not a decimal string", mpath);
    const cJSON *cfg = cJSON_GetObjectItemCaseSensitive(root, "model_config");
    if (cfg) {
        int64_t x[5];
        const char *names[5] = {"n_layer", "n_head", "n_embd", "vocab_size", "block_size"};
        for (int i = 0; i < 5; i++)
            if (!get_int(cfg, names[i], 1, 1 << 30, &x[i]))
                return BAD("%s: model_config.%s is missing or invalid", mpath, names[i]);
        mt->m.config = (struct fsdp_gpt_config){(int)x[0], (int)x[1], (int)x[2], (int)x[3], (int)x[4]};
        mt->m.has_config = 1;
    }
    const cJSON *sn = cJSON_GetObjectItemCaseSensitive(root, "optim_state");
    if (!cJSON_IsArray(sn) || cJSON_GetArraySize(sn) > 4) return BAD("%s: \"optim_state\" is not a list", mpath);
    for (const cJSON *e = sn->child; e; e = e->next) {
        if (!cJSON_IsString(e)) return BAD("%s: \"optim_state\" holds a non-string", mpath);
        mt->state[mt->n_state++] = fsdp__strdup(e->valuestring);
    }
    mt->m.has_optim_state = mt->n_state > 0;
    const cJSON *fl = cJSON_GetObjectItemCaseSensitive(root, "files");
    if (!cJSON_IsArray(fl) || cJSON_GetArraySize(fl) != world)
        return BAD("%s: \"files\" must list %lld files", mpath, (long long)world);
    mt->files = calloc((size_t)world, sizeof *mt->files);
    if (!mt->files) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    for (const cJSON *e = fl->child; e; e = e->next) {
        const cJSON *nm = cJSON_GetObjectItemCaseSensitive(e, "name");
        int64_t b;
        if (!cJSON_IsString(nm) || strchr(nm->valuestring, '/') || !nm->valuestring[0] ||
            !get_int(e, "bytes", 8, INT64_C(1) << 52, &b))
            return BAD("%s: files[%d] needs a plain \"name\" and \"bytes\"", mpath, mt->n_files);
        mt->files[mt->n_files].name = fsdp__strdup(nm->valuestring);
        mt->files[mt->n_files++].bytes = (uint64_t)b;
    }
    const cJSON *ps = cJSON_GetObjectItemCaseSensitive(root, "params");
    if (!cJSON_IsArray(ps)) return BAD("%s: \"params\" is not a list", mpath);
    int np = cJSON_GetArraySize(ps);
    mt->params = calloc((size_t)np + 1, sizeof *mt->params);
    if (!mt->params) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    for (const cJSON *e = ps->child; e; e = e->next) {
        struct mparam *p = &mt->params[mt->n_params];
        const cJSON *fq = cJSON_GetObjectItemCaseSensitive(e, "fqn");
        if (!cJSON_IsString(fq) || !fq->valuestring[0]) return BAD("%s: params[%d] has no \"fqn\"", mpath, mt->n_params);
        p->fqn = fsdp__strdup(fq->valuestring);
        mt->n_params++;
        const cJSON *dt = cJSON_GetObjectItemCaseSensitive(e, "dtype");
        if (!cJSON_IsString(dt) || strcmp(dt->valuestring, "F32"))
            return BAD("%s: parameter '%s': dtype is not F32", mpath, p->fqn);
        const cJSON *sh = cJSON_GetObjectItemCaseSensitive(e, "shape");
        if (!cJSON_IsArray(sh) || cJSON_GetArraySize(sh) > FSDP_MAX_DIMS)
            return BAD("%s: parameter '%s': bad shape", mpath, p->fqn);
        p->numel = 1;
        for (const cJSON *d = sh->child; d; d = d->next) {
            double x = cJSON_IsNumber(d) ? d->valuedouble : -1;
            if (!(x >= 0 && x <= (double)(INT64_C(1) << 40)) || x != (double)(int64_t)x || p->numel > (INT64_C(1) << 50) / ((int64_t)x + 1))
                return BAD("%s: parameter '%s': bad shape", mpath, p->fqn);
            p->shape[p->ndim++] = (int64_t)x;
            p->numel *= (int64_t)x;
        }
        const cJSON *rg = cJSON_GetObjectItemCaseSensitive(e, "ranges");
        if (!cJSON_IsArray(rg)) return BAD("%s: parameter '%s': no \"ranges\"", mpath, p->fqn);
        p->ranges = calloc((size_t)cJSON_GetArraySize(rg) + 1, sizeof *p->ranges);
        if (!p->ranges) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
        for (const cJSON *r = rg->child; r; r = r->next) {
            struct mrange *x = &p->ranges[p->n_ranges];
            int64_t f, s, en, b0 = 0, b1 = 0;
            const cJSON *b = cJSON_GetObjectItemCaseSensitive(r, "bytes");
            if (!get_int(r, "file", 0, world - 1, &f) || !get_int(r, "start", 0, p->numel, &s) ||
                !get_int(r, "end", s, p->numel, &en) || !cJSON_IsArray(b) || cJSON_GetArraySize(b) != 2 ||
                !cJSON_IsNumber(b->child) || !cJSON_IsNumber(b->child->next) ||
                !(b->child->valuedouble >= 0 && b->child->valuedouble <= 0x1p52) ||
                !(b->child->next->valuedouble >= 0 && b->child->next->valuedouble <= 0x1p52))
                return BAD("%s: parameter '%s': ranges[%d] is invalid", mpath, p->fqn, p->n_ranges);
            b0 = (int64_t)b->child->valuedouble;
            b1 = (int64_t)b->child->next->valuedouble;
            if (b0 < 8 || b1 - b0 != (en - s) * 4 || (uint64_t)b1 > mt->files[f].bytes)
                return BAD("%s: parameter '%s': ranges[%d] bytes [%lld, %lld) do not fit", mpath, p->fqn,
                           p->n_ranges, (long long)b0, (long long)b1);
            *x = (struct mrange){(int)f, s, en, (uint64_t)b0, (uint64_t)b1};
            p->n_ranges++;
        }
        qsort(p->ranges, (size_t)p->n_ranges, sizeof *p->ranges, by_start);
        int64_t at = 0;
        for (int i = 0; i < p->n_ranges; i++) {
            if (p->ranges[i].start != at)
                return BAD("%s: parameter '%s': ranges leave a gap or overlap at element %lld", mpath, p->fqn,
                           (long long)at);
            at = p->ranges[i].end;
        }
        if (at != p->numel)
            return BAD("%s: parameter '%s': ranges cover %lld of %lld elements", mpath, p->fqn, (long long)at,
                       (long long)p->numel);
    }
    for (int i = 0; i < mt->n_params; i++)
        for (int j = i + 1; j < mt->n_params; j++)
            if (!strcmp(mt->params[i].fqn, mt->params[j].fqn))
                return BAD("%s: parameter '%s' is listed twice", mpath, mt->params[i].fqn);
    return st;
}

static enum fsdp_status meta_load(struct fsdp_ctx *ctx, const char *dir, struct meta *mt) {
    memset(mt, 0, sizeof *mt);
    char *mpath = path_join(dir, META_NAME);
    if (!mpath) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    struct stat sb;
    enum fsdp_status st;
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
        st = fsdp__err(ctx, FSDP_ERR_IO, "%s: not a checkpoint folder: %s", dir,
                       stat(dir, &sb) != 0 ? strerror(errno) : "not a folder");
        free(mpath);
        return st;
    }
    if (stat(mpath, &sb) != 0) {
        st = fsdp__err(ctx, FSDP_ERR_IO,
                       "%s: no %s: not a complete checkpoint (an interrupted save never has one)", dir, META_NAME);
        free(mpath);
        return st;
    }
    char *text = read_text(ctx, mpath, &st);
    if (text) {
        st = check_meta(ctx, mpath, text);
        cJSON *root = st == FSDP_OK ? cJSON_Parse(text) : NULL;
        if (st != FSDP_OK) {
            free(text);
            free(mpath);
            return st;
        }
        free(text);
        if (!root) st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: not valid JSON", mpath);
        else st = meta_parse(ctx, mpath, root, mt);
        cJSON_Delete(root);
    }
    free(mpath);
    mt->dir = fsdp__strdup(dir);
    if (st != FSDP_OK) meta_free(mt);
    return st;
}

enum fsdp_status fsdp_ckpt_read_meta(struct fsdp_ctx *ctx, const char *dir, struct fsdp_ckpt_meta *out) {
    struct meta mt;
    FSDP_TRY(meta_load(ctx, dir, &mt));
    *out = mt.m;
    meta_free(&mt);
    return FSDP_OK;
}

/* ---- Sharded load ---- */

/* Files opened lazily; checks each against meta.json's size. */
struct fcache {
    struct meta *mt;
    struct fsdp__st_file *f;
    int *open;
};

static enum fsdp_status cache_get(struct fsdp_ctx *ctx, struct fcache *c, int i, struct fsdp__st_file **out) {
    if (!c->open[i]) {
        char *path = path_join(c->mt->dir, c->mt->files[i].name);
        if (!path) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
        struct stat sb;
        enum fsdp_status st = FSDP_OK;
        if (stat(path, &sb) != 0)
            st = fsdp__err(ctx, FSDP_ERR_IO, "%s: missing file of the checkpoint: %s", path, strerror(errno));
        else if ((uint64_t)sb.st_size != c->mt->files[i].bytes)
            st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: %llu bytes but meta.json says %llu (truncated or replaced)",
                           path, (unsigned long long)sb.st_size, (unsigned long long)c->mt->files[i].bytes);
        if (st == FSDP_OK) st = fsdp__st_open(ctx, path, &c->f[i]);
        free(path);
        if (st != FSDP_OK) return st;
        c->open[i] = 1;
    }
    *out = &c->f[i];
    return FSDP_OK;
}

/* Reads elements [s, e) of stored tensor `tname` (parameter p of the
 * checkpoint, whose pieces are p->ranges) into dst. */
static enum fsdp_status read_elems(struct fsdp_ctx *ctx, struct fcache *c, const struct mparam *p,
                                   const char *tname, int64_t s, int64_t e, float *dst) {
    for (int i = 0; i < p->n_ranges; i++) {
        const struct mrange *r = &p->ranges[i];
        int64_t a = s > r->start ? s : r->start, b = e < r->end ? e : r->end;
        if (a >= b) continue;
        struct fsdp__st_file *f;
        FSDP_TRY(cache_get(ctx, c, r->file, &f));
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

static const char *shape_str(char *buf, size_t n, int ndim, const int64_t *shape) {
    size_t k = (size_t)snprintf(buf, n, "[");
    for (int d = 0; d < ndim && k < n; d++) k += (size_t)snprintf(buf + k, n - k, d ? ", %lld" : "%lld", (long long)shape[d]);
    if (k < n) snprintf(buf + k, n - k, "]");
    return buf;
}

/* Every model parameter is in the checkpoint with its shape, and nothing else is. */
static enum fsdp_status match_model(struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct meta *mt,
                                    const struct mparam **map) {
    int total = 0;
    for (int i = 0; i < fm->n_units; i++) {
        struct fsdp__unit *u = &fm->units[i];
        for (int j = 0; j < u->n_params; j++, total++) {
            struct fsdp_param *p = u->params[j];
            const struct mparam *q = NULL;
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
                                 mt->dir, p->fqn, shape_str(a, sizeof a, q->ndim, q->shape),
                                 shape_str(b, sizeof b, p->ndim, p->shape));
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

static enum fsdp_status load_local(struct fsdp_ctx *ctx, struct fsdp_model *fm, struct meta *mt) {
    int k;
    const char *const *snames = state_names(fm->optim, &k);
    int load_state = 0;
    if (k && mt->n_state) {
        int same = mt->n_state == k;
        for (int i = 0; same && i < k; i++) same = !strcmp(mt->state[i], snames[i]);
        if (!same)
            return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: optimizer state is %d arrays (%s...), the optimizer has %d (%s...)",
                             mt->dir, mt->n_state, mt->state[0], k, snames[0]);
        load_state = 1;
    }
    int total = 0;
    for (int i = 0; i < fm->n_units; i++) total += fm->units[i].n_params;
    const struct mparam **map = calloc((size_t)total + 1, sizeof *map);
    struct fcache c = {mt, calloc((size_t)mt->n_files, sizeof(struct fsdp__st_file)),
                       calloc((size_t)mt->n_files, sizeof(int))};
    enum fsdp_status st = map && c.f && c.open ? FSDP_OK : fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    for (int i = 0; c.f && i < mt->n_files; i++) c.f[i].fd = -1;
    if (st == FSDP_OK) st = match_model(ctx, fm, mt, map);
    char tname[4200];
    int idx = 0;
    for (int i = 0; i < fm->n_units && st == FSDP_OK; i++) {
        struct fsdp__unit *u = &fm->units[i];
        int64_t lo = (int64_t)ctx->rank * u->numel_shard;
        memset(u->shard, 0, (size_t)u->numel_shard * sizeof(float));
        if (u->state) memset(u->state, 0, (size_t)(k * u->numel_shard) * sizeof(float));
        for (int j = 0; j < u->n_params && st == FSDP_OK; j++, idx++) {
            int64_t s, e;
            if (!overlap(u, ctx->rank, j, &s, &e)) continue;
            int64_t ps = s - u->offsets[j], pe = e - u->offsets[j];
            st = read_elems(ctx, &c, map[idx], u->params[j]->fqn, ps, pe, u->shard + (s - lo));
            for (int q = 0; load_state && q < k && st == FSDP_OK; q++) {
                snprintf(tname, sizeof tname, "%s#%s", u->params[j]->fqn, snames[q]);
                st = read_elems(ctx, &c, map[idx], tname, ps, pe, u->state + q * u->numel_shard + (s - lo));
            }
        }
    }
    if (st == FSDP_OK && fm->optim) fsdp__optim_set_step_count(fm->optim, load_state ? mt->m.optim_step : 0);
    for (int i = 0; c.f && i < mt->n_files; i++) fsdp__st_close(&c.f[i]);
    free(c.f);
    free(c.open);
    free(map);
    return st;
}

enum fsdp_status fsdp_ckpt_load(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *dir,
                                struct fsdp_ckpt_meta *meta) {
    struct meta mt;
    memset(&mt, 0, sizeof mt);
    enum fsdp_status st = check_idle(ctx, fm, "ckpt_load");
    if (st == FSDP_OK) st = meta_load(ctx, dir, &mt);
    if (st == FSDP_OK) st = load_local(ctx, fm, &mt);
    if (st == FSDP_OK && meta) *meta = mt.m;
    meta_free(&mt);
    return agree(ctx, st);
}

/* ---- Full safetensors ---- */

static int n_model_params(const struct fsdp_model *fm) {
    int n = 0;
    for (int i = 0; i < fm->n_units; i++) n += fm->units[i].n_params;
    return n;
}

enum fsdp_status fsdp_model_save_full(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *path) {
    enum fsdp_status st = agree(ctx, check_idle(ctx, fm, "save_full"));
    if (st != FSDP_OK) return st;
    struct fsdp__st_writer *w = NULL;
    struct fsdp__st_desc *desc = NULL;
    if (ctx->rank == 0) {
        int n = n_model_params(fm), t = 0;
        desc = calloc((size_t)n + 1, sizeof *desc);
        if (!desc) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
        for (int i = 0; i < fm->n_units && desc; i++)
            for (int j = 0; j < fm->units[i].n_params; j++, t++) {
                struct fsdp_param *p = fm->units[i].params[j];
                desc[t].name = p->fqn;
                desc[t].dtype = FSDP_F32;
                desc[t].ndim = p->ndim;
                memcpy(desc[t].shape, p->shape, sizeof p->shape);
            }
        const char *kv[] = {"format", "pt", LAYOUT_KEY, "out,in"};
        if (st == FSDP_OK) st = fsdp__st_writer_open(ctx, path, n, desc, 2, kv, &w);
    }
    /* every rank gathers each unit in turn; rank 0 writes while it is
     * gathered. A write failure on rank 0 does not stop the gathers (peers
     * would hang): it stops the writing, and the status is agreed at the end. */
    for (int i = 0; i < fm->n_units; i++) {
        struct fsdp__unit *u = &fm->units[i];
        enum fsdp_status g = fsdp__unit_unshard(ctx, u);
        if (g != FSDP_OK) {
            fsdp__st_writer_abort(w);
            free(desc);
            return g; /* a failed collective: the unit is in ERROR on every rank */
        }
        for (int j = 0; j < u->n_params && w && st == FSDP_OK; j++)
            st = fsdp__st_writer_write(w, u->full + u->offsets[j], (size_t)u->params[j]->numel * sizeof(float));
        FSDP_TRY(fsdp__unit_reshard(ctx, u));
    }
    if (w) {
        if (st == FSDP_OK) st = fsdp__st_writer_commit(w);
        else fsdp__st_writer_abort(w);
    }
    free(desc);
    return agree(ctx, st);
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

static int is_conv1d(const char *fqn) {
    return ends_with(fqn, ".attn.c_attn.weight") || ends_with(fqn, ".attn.c_proj.weight") ||
           ends_with(fqn, ".mlp.c_fc.weight") || ends_with(fqn, ".mlp.c_proj.weight");
}

/* Hugging Face keys that are buffers, not parameters, or tied copies. */
static int hf_ignorable(const char *k) {
    return ends_with(k, ".attn.bias") || ends_with(k, ".attn.masked_bias") || !strcmp(k, "lm_head.weight");
}

static enum fsdp_status map_full(struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct fsdp__st_file *f,
                                 struct src *map) {
    const char *layout = fsdp__st_meta(f, LAYOUT_KEY);
    int ours = layout && !strcmp(layout, "out,in");
    if (layout && !ours)
        return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: unknown %s '%s'", f->path, LAYOUT_KEY, layout);
    char *used = calloc((size_t)f->n + 1, 1);
    if (!used) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    enum fsdp_status st = FSDP_OK;
    int t = 0;
    for (int i = 0; i < fm->n_units && st == FSDP_OK; i++)
        for (int j = 0; j < fm->units[i].n_params && st == FSDP_OK; j++, t++) {
            struct fsdp_param *p = fm->units[i].params[j];
            int ti = fsdp__st_find(f, p->fqn);
            const char *bare = !strncmp(p->fqn, "transformer.", 12) ? p->fqn + 12 : p->fqn;
            if (ti < 0 && !ours) ti = fsdp__st_find(f, bare);
            if (ti < 0) {
                st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: parameter '%s'%s%s%s is not in the file", f->path, p->fqn,
                               ours ? "" : " (or '", ours ? "" : bare, ours ? "" : "')");
                break;
            }
            used[ti] = 1;
            const struct fsdp__st_tensor *x = &f->t[ti];
            int tr = !ours && p->ndim == 2 && is_conv1d(p->fqn);
            int same = x->ndim == p->ndim;
            for (int d = 0; same && d < p->ndim; d++) same = x->shape[d] == p->shape[tr ? p->ndim - 1 - d : d];
            if (x->dtype != FSDP_F32)
                st = fsdp__err(ctx, FSDP_ERR_UNSUPPORTED, "%s: tensor '%s' is %s; only F32 is loaded", f->path, x->name,
                               fsdp__st_dtype_str(x->dtype));
            else if (!same) {
                char a[96], b[96];
                st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: tensor '%s' has shape %s, parameter '%s' needs %s%s", f->path,
                               x->name, shape_str(a, sizeof a, x->ndim, x->shape), p->fqn,
                               shape_str(b, sizeof b, p->ndim, p->shape), tr ? " transposed (HF Conv1D)" : "");
            }
            map[t] = (struct src){ti, tr};
        }
    for (int i = 0; i < f->n && st == FSDP_OK; i++)
        if (!used[i] && (ours || !hf_ignorable(f->t[i].name)))
            st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: tensor '%s' matches no parameter of the model", f->path,
                           f->t[i].name);
    free(used);
    return st;
}

/* Elements [s, e) of parameter p (our layout) from its tensor into dst. */
static enum fsdp_status read_param_range(struct fsdp_ctx *ctx, const struct fsdp__st_file *f, struct src sr,
                                         const struct fsdp_param *p, int64_t s, int64_t e, float *dst) {
    if (!sr.transpose) return fsdp__st_read(ctx, f, sr.ti, (uint64_t)s * 4, (uint64_t)e * 4, dst);
    /* (in, out) stored: read it whole (one tensor at a time) and pick */
    int64_t out_ = p->shape[0], in_ = p->shape[1];
    float *tmp = malloc((size_t)p->numel * sizeof(float) + 1);
    if (!tmp) return fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory transposing '%s'", f->path, p->fqn);
    enum fsdp_status st = fsdp__st_read(ctx, f, sr.ti, 0, (uint64_t)p->numel * 4, tmp);
    for (int64_t x = s; x < e && st == FSDP_OK; x++) {
        int64_t o = x / in_, i = x % in_;
        dst[x - s] = tmp[i * out_ + o];
    }
    free(tmp);
    return st;
}

enum fsdp_status fsdp_model_load_full(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *path,
                                      int rank0_only) {
    enum fsdp_status st = check_idle(ctx, fm, "load_full");
    struct fsdp__st_file f;
    memset(&f, 0, sizeof f);
    f.fd = -1;
    int reader = !rank0_only || ctx->rank == 0;
    struct src *map = calloc((size_t)n_model_params(fm) + 1, sizeof *map);
    if (!map) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    if (st == FSDP_OK && reader) st = fsdp__st_open(ctx, path, &f);
    if (st == FSDP_OK && reader) st = map_full(ctx, fm, &f, map);
    st = agree(ctx, st);
    int t = 0;
    for (int i = 0; i < fm->n_units && st == FSDP_OK; i++) {
        struct fsdp__unit *u = &fm->units[i];
        int64_t lo = (int64_t)ctx->rank * u->numel_shard;
        if (!rank0_only || ctx->world == 1) {
            memset(u->shard, 0, (size_t)u->numel_shard * sizeof(float));
            for (int j = 0; j < u->n_params && st == FSDP_OK; j++) {
                int64_t s, e;
                if (!overlap(u, ctx->rank, j, &s, &e)) continue;
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
            st = agree(ctx, (enum fsdp_status)code);
            if (st == FSDP_OK && fsdp_comm_broadcast(ctx->comm, full, (size_t)u->numel_padded, FSDP_F32, 0) != FSDP_OK)
                st = FSDP_ERR_COMM;
            if (st == FSDP_OK) memcpy(u->shard, full + lo, (size_t)u->numel_shard * sizeof(float));
            fsdp__pool_put(fm, full);
        }
        t += u->n_params;
    }
    fsdp__st_close(&f);
    free(map);
    return rank0_only && ctx->world > 1 ? st : agree(ctx, st);
}

/* ---- Offline: describe, verify, convert ---- */

static enum fsdp_status open_cache(struct fsdp_ctx *ctx, struct meta *mt, struct fcache *c) {
    c->mt = mt;
    c->f = calloc((size_t)mt->n_files + 1, sizeof *c->f);
    c->open = calloc((size_t)mt->n_files + 1, sizeof *c->open);
    if (!c->f || !c->open) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    for (int i = 0; i < mt->n_files; i++) c->f[i].fd = -1;
    return FSDP_OK;
}

static void close_cache(struct fcache *c) {
    for (int i = 0; c->f && i < c->mt->n_files; i++) fsdp__st_close(&c->f[i]);
    free(c->f);
    free(c->open);
}

/* Verifies a sharded folder: every file, every checksum, every listed piece. */
static enum fsdp_status verify_dir(struct fsdp_ctx *ctx, struct meta *mt, FILE *out) {
    struct fcache c;
    enum fsdp_status st = open_cache(ctx, mt, &c);
    for (int i = 0; i < mt->n_files && st == FSDP_OK; i++) {
        struct fsdp__st_file *f;
        int unchecked = 0;
        st = cache_get(ctx, &c, i, &f);
        if (st == FSDP_OK) st = fsdp__st_verify(ctx, f, &unchecked);
        if (st == FSDP_OK && unchecked)
            st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: %d tensors without checksums", f->path, unchecked);
        if (st == FSDP_OK && out) fprintf(out, "  %s: %d tensors, checksums ok\n", mt->files[i].name, f->n);
    }
    char tname[4200];
    for (int i = 0; i < mt->n_params && st == FSDP_OK; i++) {
        struct mparam *p = &mt->params[i];
        for (int r = 0; r < p->n_ranges && st == FSDP_OK; r++) {
            struct fsdp__st_file *f;
            st = cache_get(ctx, &c, p->ranges[r].file, &f);
            for (int q = -1; q < mt->n_state && st == FSDP_OK; q++) {
                if (q < 0) snprintf(tname, sizeof tname, "%s", p->fqn);
                else snprintf(tname, sizeof tname, "%s#%s", p->fqn, mt->state[q]);
                int ti = fsdp__st_find(f, tname);
                if (ti < 0 || f->t[ti].numel != p->ranges[r].end - p->ranges[r].start ||
                    (q < 0 && f->data_start + f->t[ti].begin != p->ranges[r].b0))
                    st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: tensor '%s' is missing or differs from meta.json",
                                   f->path, tname);
            }
        }
    }
    close_cache(&c);
    return st;
}

enum fsdp_status fsdp_ckpt_describe(struct fsdp_ctx *ctx, const char *path, int verify, FILE *out) {
    struct stat sb;
    if (stat(path, &sb) != 0) return fsdp__err(ctx, FSDP_ERR_IO, "%s: %s", path, strerror(errno));
    char sh[96];
    if (S_ISDIR(sb.st_mode)) {
        struct meta mt;
        FSDP_TRY(meta_load(ctx, path, &mt));
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
            struct mparam *p = &mt.params[i];
            total += p->numel;
            fprintf(out, "  %-44s F32 %-16s %d pieces\n", p->fqn, shape_str(sh, sizeof sh, p->ndim, p->shape),
                    p->n_ranges);
        }
        fprintf(out, "%d parameters, %lld elements\n", mt.n_params, (long long)total);
        enum fsdp_status st = verify ? verify_dir(ctx, &mt, out) : FSDP_OK;
        if (st == FSDP_OK && verify) fprintf(out, "verified: ok\n");
        meta_free(&mt);
        return st;
    }
    struct fsdp__st_file f;
    FSDP_TRY(fsdp__st_open(ctx, path, &f));
    fprintf(out, "%s: safetensors, %d tensors, %llu bytes\n", path, f.n, (unsigned long long)f.file_size);
    for (int i = 0; i < f.n_meta; i++) fprintf(out, "  __metadata__ %s = %s\n", f.meta_key[i], f.meta_val[i]);
    for (int i = 0; i < f.n; i++)
        fprintf(out, "  %-44s %-4s %-16s [%llu, %llu)%s\n", f.t[i].name, fsdp__st_dtype_str(f.t[i].dtype),
                shape_str(sh, sizeof sh, f.t[i].ndim, f.t[i].shape), (unsigned long long)f.t[i].begin,
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
    struct meta mt;
    FSDP_TRY(meta_load(ctx, dir, &mt));
    struct fcache c;
    enum fsdp_status st = open_cache(ctx, &mt, &c);
    struct fsdp__st_desc *desc = calloc((size_t)mt.n_params + 1, sizeof *desc);
    if (!desc && st == FSDP_OK) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    for (int i = 0; desc && i < mt.n_params; i++) {
        desc[i].name = mt.params[i].fqn;
        desc[i].dtype = FSDP_F32;
        desc[i].ndim = mt.params[i].ndim;
        memcpy(desc[i].shape, mt.params[i].shape, sizeof desc[i].shape);
    }
    const char *kv[] = {"format", "pt", LAYOUT_KEY, "out,in"};
    struct fsdp__st_writer *w = NULL;
    if (st == FSDP_OK) st = fsdp__st_writer_open(ctx, path, mt.n_params, desc, 2, kv, &w);
    for (int i = 0; i < mt.n_params && st == FSDP_OK; i++) {
        struct mparam *p = &mt.params[i];
        float *buf = malloc((size_t)p->numel * sizeof(float) + 1);
        if (!buf) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory for '%s'", p->fqn);
        if (st == FSDP_OK) st = read_elems(ctx, &c, p, p->fqn, 0, p->numel, buf);
        if (st == FSDP_OK) st = fsdp__st_writer_write(w, buf, (size_t)p->numel * sizeof(float));
        free(buf);
    }
    if (w) {
        if (st == FSDP_OK) st = fsdp__st_writer_commit(w);
        else fsdp__st_writer_abort(w);
    }
    close_cache(&c);
    free(desc);
    meta_free(&mt);
    return st;
}

enum fsdp_status fsdp_ckpt_from_full(struct fsdp_ctx *ctx, const char *path, const char *dir, int n_files) {
    if (n_files < 1 || n_files > 4096) return fsdp__err(ctx, FSDP_ERR_INVALID, "from_full: %d files", n_files);
    struct fsdp__st_file f;
    FSDP_TRY(fsdp__st_open(ctx, path, &f));
    enum fsdp_status st = FSDP_OK;
    const char *layout = fsdp__st_meta(&f, LAYOUT_KEY);
    if (!layout || strcmp(layout, "out,in"))
        st = fsdp__err(ctx, FSDP_ERR_UNSUPPORTED,
                       "%s: not written by fsdp.c (no %s): load Hugging Face weights with fsdp-train --init-from",
                       path, LAYOUT_KEY);
    for (int i = 0; i < f.n && st == FSDP_OK; i++)
        if (f.t[i].dtype != FSDP_F32)
            st = fsdp__err(ctx, FSDP_ERR_UNSUPPORTED, "%s: tensor '%s' is not F32", path, f.t[i].name);
    char tmpdir[PATH_MAX];
    snprintf(tmpdir, sizeof tmpdir, "%s.tmp", dir);
    if (st == FSDP_OK && mkdir(tmpdir, 0755) != 0 && errno != EEXIST)
        st = fsdp__err(ctx, FSDP_ERR_IO, "%s: cannot create: %s", tmpdir, strerror(errno));
    /* tensor i's piece r: elements [numel*r/n, numel*(r+1)/n) */
    struct fsdp__st_desc *desc = calloc((size_t)f.n + 1, sizeof *desc);
    if (!desc && st == FSDP_OK) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "crc32c", "00000000"); /* first: [Note: sealed meta.json] */
    cJSON_AddStringToObject(root, "format", META_FORMAT);
    cJSON_AddNumberToObject(root, "version", 1);
    cJSON_AddNumberToObject(root, "world", n_files);
    cJSON_AddNumberToObject(root, "step", 0);
    cJSON_AddNumberToObject(root, "data_step", 0);
    cJSON_AddNumberToObject(root, "lr_step", 0);
    cJSON_AddStringToObject(root, "seed", "0");
    cJSON_AddNumberToObject(root, "optim_step", 0);
    cJSON_AddArrayToObject(root, "optim_state");
    cJSON *fl = cJSON_AddArrayToObject(root, "files");
    cJSON *params = cJSON_AddArrayToObject(root, "params");
    for (int i = 0; i < f.n; i++) {
        cJSON *po = cJSON_CreateObject();
        cJSON_AddItemToArray(params, po);
        cJSON_AddStringToObject(po, "fqn", f.t[i].name);
        cJSON *sh = cJSON_AddArrayToObject(po, "shape");
        for (int d = 0; d < f.t[i].ndim; d++) cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)f.t[i].shape[d]));
        cJSON_AddStringToObject(po, "dtype", "F32");
        cJSON_AddArrayToObject(po, "ranges");
    }
    float *buf = NULL;
    for (int r = 0; r < n_files && st == FSDP_OK; r++) {
        int n = 0;
        for (int i = 0; i < f.n; i++) {
            int64_t s = f.t[i].numel * r / n_files, e = f.t[i].numel * (r + 1) / n_files;
            if (s < e) desc[n++] = (struct fsdp__st_desc){f.t[i].name, FSDP_F32, 1, {e - s, 0, 0, 0}};
        }
        char name[64];
        rank_file_name(name, sizeof name, r, n_files);
        char *fpath = path_join(tmpdir, name);
        const char *kv[] = {"format", "pt"};
        struct fsdp__st_writer *w = NULL;
        st = fpath ? fsdp__st_writer_open(ctx, fpath, n, desc, 1, kv, &w) : fsdp__err(ctx, FSDP_ERR_NOMEM, "oom");
        for (int i = 0; i < f.n && st == FSDP_OK; i++) {
            int64_t s = f.t[i].numel * r / n_files, e = f.t[i].numel * (r + 1) / n_files;
            if (s >= e) continue;
            float *nb = realloc(buf, (size_t)(e - s) * sizeof(float));
            if (!nb) {
                st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
                break;
            }
            buf = nb;
            st = fsdp__st_read(ctx, &f, i, (uint64_t)s * 4, (uint64_t)e * 4, buf);
            if (st == FSDP_OK) st = fsdp__st_writer_write(w, buf, (size_t)(e - s) * sizeof(float));
        }
        if (w) {
            if (st == FSDP_OK) st = fsdp__st_writer_commit(w);
            else fsdp__st_writer_abort(w);
        }
        struct fsdp__st_file g;
        if (st == FSDP_OK) st = fsdp__st_open(ctx, fpath, &g);
        if (st == FSDP_OK) {
            cJSON *fo = cJSON_CreateObject();
            cJSON_AddItemToArray(fl, fo);
            cJSON_AddStringToObject(fo, "name", name);
            cJSON_AddNumberToObject(fo, "bytes", (double)g.file_size);
            cJSON *po = params->child;
            for (int i = 0; i < f.n; i++, po = po->next) {
                int64_t s = f.t[i].numel * r / n_files, e = f.t[i].numel * (r + 1) / n_files;
                int ti = fsdp__st_find(&g, f.t[i].name);
                if (s >= e || ti < 0) continue;
                cJSON *ro = cJSON_CreateObject();
                cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(po, "ranges"), ro);
                cJSON_AddNumberToObject(ro, "file", r);
                cJSON_AddNumberToObject(ro, "start", (double)s);
                cJSON_AddNumberToObject(ro, "end", (double)e);
                cJSON *b = cJSON_AddArrayToObject(ro, "bytes");
                cJSON_AddItemToArray(b, cJSON_CreateNumber((double)(g.data_start + g.t[ti].begin)));
                cJSON_AddItemToArray(b, cJSON_CreateNumber((double)(g.data_start + g.t[ti].end)));
            }
            fsdp__st_close(&g);
        }
        free(fpath);
    }
    free(buf);
    char *text = st == FSDP_OK ? cJSON_Print(root) : NULL;
    cJSON_Delete(root);
    if (st == FSDP_OK && !text) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    char *mpath = path_join(tmpdir, META_NAME);
    if (st == FSDP_OK) seal_meta(text);
    if (st == FSDP_OK) st = mpath ? write_durable(ctx, mpath, text) : fsdp__err(ctx, FSDP_ERR_NOMEM, "oom");
    if (st == FSDP_OK) st = commit_dir(ctx, dir, tmpdir, n_files);
    free(mpath);
    free(text);
    free(desc);
    fsdp__st_close(&f);
    return st;
}
