/*
 * ckpt/meta.c - a sharded checkpoint's meta.json: its one reader and its
 * one writer ([Note: sharded layout], [Note: sealed meta.json] in ckpt.c).
 * Reading: everything in it is outside data: every field is range-checked,
 * every parameter's pieces must tile it exactly and fit their files, before
 * any file is read. Writing: the sharded save and the conversion from a full
 * file fill a struct fsdp__meta and fsdp__meta_format prints it.
 */
#include "fsdp/fsdp-impl.h"
#include "io/io-impl.h"

#include <cJSON.h>
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define MAX_META_BYTES ((size_t)256 << 20)

static char *read_text(struct fsdp_ctx *ctx, const char *path, enum fsdp_status *st) {
    char *buf = NULL;
    *st = fsdp__read_file(ctx, NULL, path, MAX_META_BYTES, &buf, NULL);
    return buf;
}

void fsdp__meta_free(struct fsdp__meta *mt) {
    for (int i = 0; i < mt->n_params; i++) {
        free(mt->params[i].fqn);
        free(mt->params[i].ranges);
    }
    for (int i = 0; i < mt->n_files; i++) free(mt->files[i].name);
    for (int i = 0; i < mt->n_state; i++) free(mt->state[i]);
    for (int i = 0; i < mt->n_buffers; i++) free(mt->buffers[i].fqn);
    free(mt->buffers);
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
    const struct fsdp__meta_range *x = a, *y = b;
    return x->start < y->start ? -1 : x->start > y->start;
}

#define BAD(...) (st = fsdp__err(ctx, FSDP_ERR_FORMAT, __VA_ARGS__))

/* "buffers" (optional: checkpoints of models without buffers may lack it):
 * each whole in one file, F32 or I64, its byte range fitting the file and
 * its element count ([Note: buffers] in src/fsdp/buffers.c). */
static enum fsdp_status parse_buffers(struct fsdp_ctx *ctx, const char *mpath, const cJSON *root,
                                      struct fsdp__meta *mt) {
    enum fsdp_status st = FSDP_OK;
    const cJSON *bs = cJSON_GetObjectItemCaseSensitive(root, "buffers");
    if (!bs) return FSDP_OK;
    if (!cJSON_IsArray(bs)) return BAD("%s: \"buffers\" is not a list", mpath);
    mt->buffers = fsdp__zalloc((size_t)cJSON_GetArraySize(bs) + 1, sizeof *mt->buffers);
    if (!mt->buffers) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    for (const cJSON *e = bs->child; e; e = e->next) {
        struct fsdp__meta_buffer *b = &mt->buffers[mt->n_buffers];
        const cJSON *fq = cJSON_GetObjectItemCaseSensitive(e, "fqn");
        if (!cJSON_IsString(fq) || !fq->valuestring[0])
            return BAD("%s: buffers[%d] has no \"fqn\"", mpath, mt->n_buffers);
        if (!(b->fqn = fsdp__strdup(fq->valuestring))) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
        mt->n_buffers++;
        const cJSON *dt = cJSON_GetObjectItemCaseSensitive(e, "dtype");
        if (cJSON_IsString(dt) && !strcmp(dt->valuestring, "F32")) b->dtype = FSDP_F32;
        else if (cJSON_IsString(dt) && !strcmp(dt->valuestring, "I64")) b->dtype = FSDP_I64;
        else return BAD("%s: buffer '%s': dtype is not F32 or I64", mpath, b->fqn);
        const cJSON *sh = cJSON_GetObjectItemCaseSensitive(e, "shape");
        if (!cJSON_IsArray(sh) || cJSON_GetArraySize(sh) > FSDP_MAX_DIMS)
            return BAD("%s: buffer '%s': bad shape", mpath, b->fqn);
        b->numel = 1;
        for (const cJSON *d = sh->child; d; d = d->next) {
            double x = cJSON_IsNumber(d) ? d->valuedouble : -1;
            if (!(x >= 0 && x <= (double)(INT64_C(1) << 40)) || x != (double)(int64_t)x ||
                b->numel > (INT64_C(1) << 50) / ((int64_t)x + 1))
                return BAD("%s: buffer '%s': bad shape", mpath, b->fqn);
            b->shape[b->ndim++] = (int64_t)x;
            b->numel *= (int64_t)x;
        }
        int64_t f;
        const cJSON *by = cJSON_GetObjectItemCaseSensitive(e, "bytes");
        if (!get_int(e, "file", 0, mt->n_files - 1, &f) || !cJSON_IsArray(by) || cJSON_GetArraySize(by) != 2 ||
            !cJSON_IsNumber(by->child) || !cJSON_IsNumber(by->child->next) ||
            !(by->child->valuedouble >= 8 && by->child->valuedouble <= 0x1p52) ||
            !(by->child->next->valuedouble >= 0 && by->child->next->valuedouble <= 0x1p52))
            return BAD("%s: buffer '%s': \"file\" or \"bytes\" is invalid", mpath, b->fqn);
        b->file = (int)f;
        b->b0 = (uint64_t)by->child->valuedouble;
        b->b1 = (uint64_t)by->child->next->valuedouble;
        if ((double)b->b0 != by->child->valuedouble || (double)b->b1 != by->child->next->valuedouble ||
            b->b1 < b->b0 || b->b1 - b->b0 != (uint64_t)b->numel * fsdp_dtype_size(b->dtype) ||
            b->b1 > mt->files[f].bytes)
            return BAD("%s: buffer '%s': bytes [%llu, %llu) do not fit %lld %s elements in its file", mpath, b->fqn,
                       (unsigned long long)b->b0, (unsigned long long)b->b1, (long long)b->numel,
                       fsdp_dtype_name(b->dtype));
        for (int i = 0; i < mt->n_buffers - 1; i++)
            if (!strcmp(mt->buffers[i].fqn, b->fqn)) return BAD("%s: buffer '%s' is listed twice", mpath, b->fqn);
        for (int i = 0; i < mt->n_params; i++)
            if (!strcmp(mt->params[i].fqn, b->fqn))
                return BAD("%s: '%s' is listed both as a parameter and as a buffer", mpath, b->fqn);
    }
    return st;
}

/* The ranges meta.json's numbers may take: the reader refuses others, and
 * the writer (meta_refused) will not write them. */
#define META_COUNT_MAX (INT64_C(1) << 52) /* steps, counters, byte offsets: exact in a double */
#define META_CONFIG_MAX (1 << 30)        /* each field of model_config, at least 1 */
static const char *const config_names[5] = {"n_layer", "n_head", "n_embd", "vocab_size", "block_size"};

static enum fsdp_status meta_parse(struct fsdp_ctx *ctx, const char *mpath, const cJSON *root, struct fsdp__meta *mt) {
    enum fsdp_status st = FSDP_OK;
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(root, "format");
    if (!cJSON_IsObject(root) || !cJSON_IsString(fmt) || strcmp(fmt->valuestring, FSDP__META_FORMAT))
        return BAD("%s: not an fsdp.c checkpoint (\"format\" is not \"%s\")", mpath, FSDP__META_FORMAT);
    int64_t v, world, step, dstep, ostep;
    if (!get_int(root, "version", 1, 1, &v)) return BAD("%s: unsupported \"version\" (want 1)", mpath);
    if (!get_int(root, "world", 1, 1 << 20, &world)) return BAD("%s: \"world\" is missing or invalid", mpath);
    if (!get_int(root, "step", 0, META_COUNT_MAX, &step) || !get_int(root, "data_step", 0, META_COUNT_MAX, &dstep) ||
        !get_int(root, "optim_step", 0, META_COUNT_MAX, &ostep))
        return BAD("%s: \"step\", \"data_step\" or \"optim_step\" is missing or invalid", mpath);
    mt->m.world = (int)world;
    mt->m.step = step;
    mt->m.data_step = dstep;
    mt->m.optim_step = ostep;
    const cJSON *seed = cJSON_GetObjectItemCaseSensitive(root, "seed");
    char *end;
    if (!cJSON_IsString(seed) || !isdigit((unsigned char)seed->valuestring[0]) || /* strtoull takes "-1" as 2^64 - 1 */
        !(errno = 0, mt->m.seed = strtoull(seed->valuestring, &end, 10), *end == 0 && errno == 0))
        return BAD("%s: \"seed\" is not a decimal string", mpath);
    const cJSON *cfg = cJSON_GetObjectItemCaseSensitive(root, "model_config");
    if (cfg) {
        int64_t x[5];
        for (int i = 0; i < 5; i++)
            if (!get_int(cfg, config_names[i], 1, META_CONFIG_MAX, &x[i]))
                return BAD("%s: model_config.%s is missing or invalid", mpath, config_names[i]);
        mt->m.config = (struct fsdp_gpt_config){(int)x[0], (int)x[1], (int)x[2], (int)x[3], (int)x[4]};
        mt->m.has_config = 1;
    }
    const cJSON *mj = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (mj) {
        char *txt = cJSON_IsObject(mj) ? cJSON_PrintUnformatted(mj) : NULL;
        if (!txt && cJSON_IsObject(mj)) return fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory for \"model\"", mpath);
        size_t len = txt ? strlen(txt) : 0;
        if (txt && len < sizeof mt->m.model_json) memcpy(mt->m.model_json, txt, len + 1);
        free(txt);
        if (!len || len >= sizeof mt->m.model_json)
            return BAD("%s: \"model\" is not a JSON object of at most %zu bytes", mpath, sizeof mt->m.model_json - 1);
    }
    const cJSON *tc = cJSON_GetObjectItemCaseSensitive(root, "train_config");
    if (tc) {
        char *txt = cJSON_IsObject(tc) ? cJSON_PrintUnformatted(tc) : NULL;
        size_t len = txt ? strlen(txt) : 0;
        if (txt && len < sizeof mt->m.train_config) memcpy(mt->m.train_config, txt, len + 1);
        free(txt);
        if (!len || len >= sizeof mt->m.train_config)
            return BAD("%s: \"train_config\" is not a JSON object of at most %zu bytes", mpath,
                       sizeof mt->m.train_config - 1);
    }
    const cJSON *ls = cJSON_GetObjectItemCaseSensitive(root, "loss_scale");
    if (ls) { /* the dynamic loss scaling state (mixed.c) */
        const cJSON *sc = cJSON_GetObjectItemCaseSensitive(ls, "scale");
        int64_t gt, sk;
        if (!cJSON_IsNumber(sc) || !(sc->valuedouble > 0 && sc->valuedouble < 1e300) ||
            !get_int(ls, "growth_tracker", 0, META_COUNT_MAX, &gt) || !get_int(ls, "skipped", 0, META_COUNT_MAX, &sk))
            return BAD("%s: \"loss_scale\" needs a positive \"scale\", \"growth_tracker\" and \"skipped\"", mpath);
        mt->m.has_loss_scale = 1;
        mt->m.loss_scale = sc->valuedouble;
        mt->m.loss_scale_growth_tracker = gt;
        mt->m.loss_scale_skipped = sk;
    }
    const cJSON *sn = cJSON_GetObjectItemCaseSensitive(root, "optim_state");
    if (!cJSON_IsArray(sn) || cJSON_GetArraySize(sn) > 4) return BAD("%s: \"optim_state\" is not a list", mpath);
    for (const cJSON *e = sn->child; e; e = e->next) {
        if (!cJSON_IsString(e)) return BAD("%s: \"optim_state\" holds a non-string", mpath);
        if (!(mt->state[mt->n_state] = fsdp__strdup(e->valuestring)))
            return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
        mt->n_state++;
    }
    mt->m.has_optim_state = mt->n_state > 0;
    const cJSON *fl = cJSON_GetObjectItemCaseSensitive(root, "files");
    if (!cJSON_IsArray(fl) || cJSON_GetArraySize(fl) != world)
        return BAD("%s: \"files\" must list %lld files", mpath, (long long)world);
    mt->files = fsdp__zalloc((size_t)world, sizeof *mt->files);
    if (!mt->files) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    for (const cJSON *e = fl->child; e; e = e->next) {
        const cJSON *nm = cJSON_GetObjectItemCaseSensitive(e, "name");
        int64_t b;
        if (!cJSON_IsString(nm) || strchr(nm->valuestring, '/') || !nm->valuestring[0] ||
            !strcmp(nm->valuestring, ".") || !strcmp(nm->valuestring, "..") ||
            !get_int(e, "bytes", 8, META_COUNT_MAX, &b))
            return BAD("%s: files[%d] needs a plain \"name\" and \"bytes\"", mpath, mt->n_files);
        for (int i = 0; i < mt->n_files; i++)
            if (!strcmp(mt->files[i].name, nm->valuestring))
                return BAD("%s: files[%d] and files[%d] are both '%s'", mpath, i, mt->n_files, nm->valuestring);
        const cJSON *hc = cJSON_GetObjectItemCaseSensitive(e, "header_crc32c");
        unsigned hv = 0;
        int hn = -1;
        if (hc && !(cJSON_IsString(hc) && strlen(hc->valuestring) == 8 && sscanf(hc->valuestring, "%8x%n", &hv, &hn) == 1 &&
                    hn == 8))
            return BAD("%s: files[%d]: \"header_crc32c\" is not 8 hex digits", mpath, mt->n_files);
        if (!(mt->files[mt->n_files].name = fsdp__strdup(nm->valuestring)))
            return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
        mt->files[mt->n_files].has_header_crc = hc != NULL;
        mt->files[mt->n_files].header_crc = hv;
        mt->files[mt->n_files++].bytes = (uint64_t)b;
    }
    const cJSON *ps = cJSON_GetObjectItemCaseSensitive(root, "params");
    if (!cJSON_IsArray(ps)) return BAD("%s: \"params\" is not a list", mpath);
    int np = cJSON_GetArraySize(ps);
    mt->params = fsdp__zalloc((size_t)np + 1, sizeof *mt->params);
    if (!mt->params) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    for (const cJSON *e = ps->child; e; e = e->next) {
        struct fsdp__meta_param *p = &mt->params[mt->n_params];
        const cJSON *fq = cJSON_GetObjectItemCaseSensitive(e, "fqn");
        if (!cJSON_IsString(fq) || !fq->valuestring[0]) return BAD("%s: params[%d] has no \"fqn\"", mpath, mt->n_params);
        if (!(p->fqn = fsdp__strdup(fq->valuestring))) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
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
        p->ranges = fsdp__zalloc((size_t)cJSON_GetArraySize(rg) + 1, sizeof *p->ranges);
        if (!p->ranges) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
        for (const cJSON *r = rg->child; r; r = r->next) {
            struct fsdp__meta_range *x = &p->ranges[p->n_ranges];
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
            if ((double)b0 != b->child->valuedouble || (double)b1 != b->child->next->valuedouble)
                return BAD("%s: parameter '%s': ranges[%d] bytes are not whole numbers", mpath, p->fqn, p->n_ranges);
            if (b0 < 8 || b1 - b0 != (en - s) * 4 || (uint64_t)b1 > mt->files[f].bytes)
                return BAD("%s: parameter '%s': ranges[%d] bytes [%lld, %lld) do not fit", mpath, p->fqn,
                           p->n_ranges, (long long)b0, (long long)b1);
            *x = (struct fsdp__meta_range){(int)f, s, en, (uint64_t)b0, (uint64_t)b1};
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
    return parse_buffers(ctx, mpath, root, mt);
}

enum fsdp_status fsdp__meta_parse_text(struct fsdp_ctx *ctx, const char *name, char *text, int sealed,
                                       struct fsdp__meta *mt) {
    memset(mt, 0, sizeof *mt);
    if (sealed) FSDP_TRY(fsdp__meta_check_seal(ctx, name, text));
    long failures = fsdp__alloc_failures;
    cJSON *root = cJSON_Parse(text);
    enum fsdp_status st = root ? meta_parse(ctx, name, root, mt)
                          : fsdp__alloc_failures != failures
                              ? fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory for its JSON", name)
                              : fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: not valid JSON", name);
    cJSON_Delete(root);
    if (st != FSDP_OK) fsdp__meta_free(mt);
    return st;
}

enum fsdp_status fsdp__meta_load(struct fsdp_ctx *ctx, const char *dir, struct fsdp__meta *mt) {
    memset(mt, 0, sizeof *mt);
    char *mpath = fsdp__path_join(dir, FSDP__META_NAME);
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
        char newest[256] = ""; /* a folder of checkpoints (fsdp-train's --save-dir) names one of them */
        DIR *d = opendir(dir);
        for (struct dirent *e; d && (e = readdir(d));)
            if (!strncmp(e->d_name, "step-", 5) && !strchr(e->d_name, '.') && strlen(e->d_name) < sizeof newest &&
                strcmp(e->d_name, newest) > 0)
                snprintf(newest, sizeof newest, "%s", e->d_name);
        if (d) closedir(d);
        if (newest[0])
            st = fsdp__err(ctx, FSDP_ERR_IO, "%s: no %s: a folder of checkpoints, not one; give one of them, e.g. %s/%s",
                           dir, FSDP__META_NAME, dir, newest);
        else
            st = fsdp__err(ctx, FSDP_ERR_IO, "%s: no %s: not a complete checkpoint (an interrupted save never has one)",
                           dir, FSDP__META_NAME);
        free(mpath);
        return st;
    }
    char *text = read_text(ctx, mpath, &st);
    if (text) st = fsdp__meta_parse_text(ctx, mpath, text, 1, mt);
    free(text);
    free(mpath);
    if (st == FSDP_OK && !(mt->dir = fsdp__strdup(dir))) {
        fsdp__meta_free(mt);
        st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    }
    return st;
}

enum fsdp_status fsdp_ckpt_read_meta(struct fsdp_ctx *ctx, const char *dir, struct fsdp_ckpt_meta *out) {
    struct fsdp__meta mt;
    FSDP_TRY(fsdp__meta_load(ctx, dir, &mt));
    *out = mt.m;
    fsdp__meta_free(&mt);
    return FSDP_OK;
}

/* ---- Writing: the one writer of meta.json ----
 * Both producers (the sharded save, ckpt/sharded.c, and the conversion from a
 * full file, ckpt/offline.c) describe the checkpoint in the struct the reader
 * fills, and this turns it into the text. Keys in a fixed order, "crc32c"
 * first ([Note: sealed meta.json]); "world" is the number of files; "lr_step"
 * repeats "step" (the schedule position) for readers of the JSON. */

/* Appends item to arr; on failure frees item and returns 0. */
static int push(cJSON *arr, cJSON *item) {
    if (item && cJSON_AddItemToArray(arr, item)) return 1;
    cJSON_Delete(item);
    return 0;
}

static int add_shape(cJSON *o, int ndim, const int64_t *shape) {
    cJSON *sh = cJSON_AddArrayToObject(o, "shape");
    int ok = sh != NULL;
    for (int d = 0; d < ndim && ok; d++) ok = push(sh, cJSON_CreateNumber((double)shape[d]));
    return ok;
}

static int add_bytes(cJSON *o, uint64_t b0, uint64_t b1) {
    cJSON *b = cJSON_AddArrayToObject(o, "bytes");
    return b && push(b, cJSON_CreateNumber((double)b0)) && push(b, cJSON_CreateNumber((double)b1));
}

static int add_config(cJSON *root, const struct fsdp_gpt_config *c) {
    cJSON *o = cJSON_AddObjectToObject(root, "model_config");
    return o && cJSON_AddNumberToObject(o, "n_layer", c->n_layer) && cJSON_AddNumberToObject(o, "n_head", c->n_head) &&
           cJSON_AddNumberToObject(o, "n_embd", c->n_embd) &&
           cJSON_AddNumberToObject(o, "vocab_size", c->vocab_size) &&
           cJSON_AddNumberToObject(o, "block_size", c->block_size);
}

static int add_param(cJSON *params, const struct fsdp__meta_param *p) {
    cJSON *po = cJSON_CreateObject();
    if (!push(params, po)) return 0;
    cJSON *rg = NULL;
    int ok = cJSON_AddStringToObject(po, "fqn", p->fqn) && add_shape(po, p->ndim, p->shape) &&
             cJSON_AddStringToObject(po, "dtype", "F32") && (rg = cJSON_AddArrayToObject(po, "ranges"));
    for (int r = 0; r < p->n_ranges && ok; r++) {
        const struct fsdp__meta_range *x = &p->ranges[r];
        cJSON *ro = cJSON_CreateObject();
        ok = push(rg, ro) && cJSON_AddNumberToObject(ro, "file", x->file) &&
             cJSON_AddNumberToObject(ro, "start", (double)x->start) &&
             cJSON_AddNumberToObject(ro, "end", (double)x->end) && add_bytes(ro, x->b0, x->b1);
    }
    return ok;
}

static int add_buffer(cJSON *bufs, const struct fsdp__meta_buffer *b) {
    cJSON *bo = cJSON_CreateObject();
    return push(bufs, bo) && cJSON_AddStringToObject(bo, "fqn", b->fqn) && add_shape(bo, b->ndim, b->shape) &&
           cJSON_AddStringToObject(bo, "dtype", fsdp_dtype_name(b->dtype)) &&
           cJSON_AddNumberToObject(bo, "file", b->file) && add_bytes(bo, b->b0, b->b1);
}

/* What meta_parse would refuse in m, said into why (n bytes); 0 when none: a
 * save writes nothing its own load cannot read. */
static int meta_refused(const struct fsdp_ckpt_meta *m, char *why, size_t n) {
    const int64_t most = META_COUNT_MAX;
    if (m->step < 0 || m->step > most || m->data_step < 0 || m->data_step > most || m->optim_step < 0 ||
        m->optim_step > most)
        return snprintf(why, n, "step %lld, data_step %lld, optim_step %lld (each 0 to 2^52)", (long long)m->step,
                        (long long)m->data_step, (long long)m->optim_step), 1;
    const int c[5] = {m->config.n_layer, m->config.n_head, m->config.n_embd, m->config.vocab_size,
                      m->config.block_size};
    for (int i = 0; i < 5 && m->has_config; i++)
        if (c[i] < 1 || c[i] > META_CONFIG_MAX)
            return snprintf(why, n, "config.%s is %d (1 to 2^30)", config_names[i], c[i]), 1;
    if (!memchr(m->model_json, 0, sizeof m->model_json) || !memchr(m->train_config, 0, sizeof m->train_config))
        return snprintf(why, n, "%s does not end within its %zu bytes",
                        !memchr(m->model_json, 0, sizeof m->model_json) ? "model_json" : "train_config",
                        !memchr(m->model_json, 0, sizeof m->model_json) ? sizeof m->model_json
                                                                         : sizeof m->train_config), 1;
    if (m->has_loss_scale && (!(m->loss_scale > 0 && m->loss_scale < 1e300) || m->loss_scale_growth_tracker < 0 ||
                              m->loss_scale_growth_tracker > most || m->loss_scale_skipped < 0 ||
                              m->loss_scale_skipped > most))
        return snprintf(why, n, "loss scale %g, growth tracker %lld, skipped %lld", m->loss_scale,
                        (long long)m->loss_scale_growth_tracker, (long long)m->loss_scale_skipped), 1;
    return 0;
}

enum fsdp_status fsdp__meta_format(struct fsdp_ctx *ctx, const char *name, const struct fsdp__meta *mt, char **out) {
    *out = NULL;
    const struct fsdp_ckpt_meta *m = &mt->m;
    char why[256];
    if (meta_refused(m, why, sizeof why))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "%s: checkpoint meta: %s", name, why);
    cJSON *root = cJSON_CreateObject(), *sn = NULL, *fl = NULL, *ps = NULL, *bs = NULL;
    char seed[32];
    snprintf(seed, sizeof seed, "%llu", (unsigned long long)m->seed);
    int ok = root && cJSON_AddStringToObject(root, "crc32c", "00000000") && /* first: [Note: sealed meta.json] */
             cJSON_AddStringToObject(root, "format", FSDP__META_FORMAT) &&
             cJSON_AddNumberToObject(root, "version", 1) && cJSON_AddNumberToObject(root, "world", mt->n_files) &&
             cJSON_AddNumberToObject(root, "step", (double)m->step) &&
             cJSON_AddNumberToObject(root, "data_step", (double)m->data_step) &&
             cJSON_AddNumberToObject(root, "lr_step", (double)m->step) &&
             cJSON_AddStringToObject(root, "seed", seed) &&
             cJSON_AddStringToObject(root, "rng", "philox4x32-10 keyed by (seed, fqn): the seed is the state") &&
             cJSON_AddNumberToObject(root, "optim_step", (double)m->optim_step) &&
             (sn = cJSON_AddArrayToObject(root, "optim_state"));
    for (int i = 0; i < mt->n_state && ok; i++) ok = push(sn, cJSON_CreateString(mt->state[i]));
    if (ok && m->has_config) ok = add_config(root, &m->config);
    if (ok && m->model_json[0]) {
        long failures = fsdp__alloc_failures;
        cJSON *mj = cJSON_Parse(m->model_json);
        if (!mj && fsdp__alloc_failures != failures) {
            cJSON_Delete(root);
            return fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory for \"model\"", name);
        }
        if (!cJSON_IsObject(mj)) {
            cJSON_Delete(mj);
            cJSON_Delete(root);
            return fsdp__err(ctx, FSDP_ERR_INVALID, "%s: checkpoint meta: model_json is not a JSON object", name);
        }
        if (!cJSON_AddItemToObject(root, "model", mj)) {
            cJSON_Delete(mj);
            ok = 0;
        }
    }
    if (ok && m->train_config[0]) {
        cJSON *tc = cJSON_Parse(m->train_config);
        if (!cJSON_IsObject(tc)) {
            cJSON_Delete(tc);
            cJSON_Delete(root);
            return fsdp__err(ctx, FSDP_ERR_INVALID, "%s: checkpoint meta: train_config is not a JSON object", name);
        }
        if (!cJSON_AddItemToObject(root, "train_config", tc)) {
            cJSON_Delete(tc);
            ok = 0;
        }
    }
    if (ok && m->has_loss_scale) { /* exact: cJSON prints a double that reads back the same */
        cJSON *ls = cJSON_AddObjectToObject(root, "loss_scale");
        ok = ls && cJSON_AddNumberToObject(ls, "scale", m->loss_scale) &&
             cJSON_AddNumberToObject(ls, "growth_tracker", (double)m->loss_scale_growth_tracker) &&
             cJSON_AddNumberToObject(ls, "skipped", (double)m->loss_scale_skipped);
    }
    ok = ok && (fl = cJSON_AddArrayToObject(root, "files"));
    for (int r = 0; r < mt->n_files && ok; r++) {
        cJSON *fo = cJSON_CreateObject();
        char hex[9];
        snprintf(hex, sizeof hex, "%08x", mt->files[r].header_crc);
        ok = push(fl, fo) && cJSON_AddStringToObject(fo, "name", mt->files[r].name) &&
             cJSON_AddNumberToObject(fo, "bytes", (double)mt->files[r].bytes) &&
             (!mt->files[r].has_header_crc || cJSON_AddStringToObject(fo, "header_crc32c", hex));
    }
    ok = ok && (ps = cJSON_AddArrayToObject(root, "params"));
    for (int i = 0; i < mt->n_params && ok; i++) ok = add_param(ps, &mt->params[i]);
    ok = ok && (bs = cJSON_AddArrayToObject(root, "buffers"));
    for (int i = 0; i < mt->n_buffers && ok; i++) ok = add_buffer(bs, &mt->buffers[i]);
    char *text = ok ? cJSON_Print(root) : NULL;
    cJSON_Delete(root);
    if (!text) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory for the text of %s", name);
    fsdp__meta_seal(text);
    *out = text;
    return FSDP_OK;
}

enum fsdp_status fsdp__meta_alloc(struct fsdp_ctx *ctx, struct fsdp__meta *mt, int n_files, int n_params,
                                  int n_buffers) {
    memset(mt, 0, sizeof *mt);
    mt->files = fsdp__zalloc((size_t)n_files + 1, sizeof *mt->files);
    mt->params = fsdp__zalloc((size_t)n_params + 1, sizeof *mt->params);
    mt->buffers = fsdp__zalloc((size_t)n_buffers + 1, sizeof *mt->buffers);
    if (mt->files && mt->params && mt->buffers) return FSDP_OK;
    fsdp__meta_free(mt);
    return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory for a checkpoint's meta.json");
}
