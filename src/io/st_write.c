/*
 * st_write.c - the safetensors writer ([Note: chunked checksums] in
 * safetensors.c: the checksums' text is reserved in the header and filled in
 * at commit) and the durable-file helpers the checkpoints use: full writes,
 * fsync of a folder, the crash-test hook. A file is written under a
 * temporary name, fsync'd and renamed; the writer replaces only files it
 * wrote itself. Sits in io/ beside the reader (safetensors.c).
 */
#include "io/io-impl.h"

#include <cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <omp.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- Durable files ---- */

enum fsdp_status fsdp__write_all(struct fsdp_ctx *ctx, int fd, const char *path, const void *buf,
                                 size_t n, uint64_t off) {
    const uint8_t *p = buf;
    while (n) {
        ssize_t w = pwrite(fd, p, n > ((size_t)1 << 30) ? (size_t)1 << 30 : n, (off_t)off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return fsdp__err(ctx, FSDP_ERR_IO, "%s: write failed: %s", path, strerror(errno));
        p += w;
        n -= (size_t)w;
        off += (uint64_t)w;
    }
    return FSDP_OK;
}

enum fsdp_status fsdp__fsync_dir(struct fsdp_ctx *ctx, const char *dir_of_path) {
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s", dir_of_path);
    char *slash = strrchr(dir, '/');
    if (!slash) snprintf(dir, sizeof dir, ".");
    else if (slash == dir) dir[1] = 0;
    else *slash = 0;
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return fsdp__err(ctx, FSDP_ERR_IO, "%s: cannot open folder: %s", dir, strerror(errno));
    int r = fsync(fd);
    close(fd);
    if (r != 0) return fsdp__err(ctx, FSDP_ERR_IO, "%s: fsync failed: %s", dir, strerror(errno));
    return FSDP_OK;
}

void fsdp__ckpt_crash_point(const char *where) {
    static long count, at = -1;
    if (at < 0) at = (long)fsdp__env_checked("FSDP_CKPT_CRASH_AT", 0);
    fsdp__fault_point("ckpt-save", where); /* FSDP_FAULT=ckpt-save:... (core/fault.c) */
    if (at > 0 && ++count == at) {
        fprintf(stderr, "fsdp: FSDP_CKPT_CRASH_AT=%ld: exiting at '%s'\n", at, where);
        _exit(86);
    }
}

/* ---- Writer ---- */

struct fsdp__st_writer {
    struct fsdp_ctx *ctx;
    char *path, *tmp;
    int fd;
    int n, cur;             /* tensors; the one being filled */
    uint64_t *bytes;        /* (n) */
    uint32_t **crc;         /* (n) per-chunk CRCs */
    uint64_t filled;        /* bytes of tensor cur written */
    uint64_t off;           /* file offset of the next byte */
    uint64_t kicked;        /* writeback started for [data_start, kicked) ([Note: early writeback]) */
    uint64_t data_start;
    struct fsdp__st_desc *desc; /* (n) copied, names owned */
    int n_meta;
    char **meta_kv;             /* (2 n_meta) copied */
};

/* The JSON header with the given checksums (NULL: zeros), padded with spaces
 * to make 8 + length a multiple of 8. Returns malloc'd text. */
/* Appends item to arr; on failure frees item and returns 0. */
static int push(cJSON *arr, cJSON *item) {
    if (item && cJSON_AddItemToArray(arr, item)) return 1;
    cJSON_Delete(item);
    return 0;
}

static char *build_header(struct fsdp__st_writer *w, size_t *len) {
    cJSON *root = cJSON_CreateObject(), *meta = cJSON_CreateObject();
    int ok = root && meta && cJSON_AddItemToObject(root, "__metadata__", meta);
    if (!ok && root && meta && !meta->string) cJSON_Delete(meta); /* not adopted by root */
    if (!root) cJSON_Delete(meta);
    uint64_t off = 0;
    for (int i = 0; i < w->n && ok; i++) {
        cJSON *e = cJSON_CreateObject(), *sh = NULL, *of = NULL;
        if (!(ok = e && cJSON_AddItemToObject(root, w->desc[i].name, e))) {
            cJSON_Delete(e);
            break;
        }
        ok = cJSON_AddStringToObject(e, "dtype", fsdp__st_dtype_str(w->desc[i].dtype)) &&
             (sh = cJSON_AddArrayToObject(e, "shape"));
        for (int d = 0; ok && d < w->desc[i].ndim; d++) ok = push(sh, cJSON_CreateNumber((double)w->desc[i].shape[d]));
        ok = ok && (of = cJSON_AddArrayToObject(e, "data_offsets")) && push(of, cJSON_CreateNumber((double)off)) &&
             push(of, cJSON_CreateNumber((double)(off + w->bytes[i])));
        off += w->bytes[i];
    }
    for (int i = 0; i < w->n_meta && ok; i++) ok = cJSON_AddStringToObject(meta, w->meta_kv[2 * i], w->meta_kv[2 * i + 1]) != NULL;
    for (int i = 0; i < w->n && ok; i++) {
        int64_t nc = fsdp__st_chunks(w->bytes[i]);
        char *hex = fsdp__malloc((size_t)nc * 8 + 1);
        char *key = fsdp__malloc(strlen(FSDP__ST_CRC_KEY) + strlen(w->desc[i].name) + 1);
        if ((ok = hex && key)) {
            for (int64_t c = 0; c < nc; c++) snprintf(hex + c * 8, 9, "%08x", w->crc[i][c]);
            hex[nc * 8] = 0;
            sprintf(key, "%s%s", FSDP__ST_CRC_KEY, w->desc[i].name);
            ok = cJSON_AddStringToObject(meta, key, hex) != NULL;
        }
        free(hex);
        free(key);
    }
    char *text = ok ? cJSON_PrintUnformatted(root) : NULL;
    cJSON_Delete(root);
    if (!text) return NULL;
    size_t n = strlen(text), padded = (n + 7) / 8 * 8;
    char *out = fsdp__realloc(text, padded + 1);
    if (!out) {
        free(text);
        return NULL;
    }
    memset(out + n, ' ', padded - n);
    out[padded] = 0;
    *len = padded;
    return out;
}

static void writer_free(struct fsdp__st_writer *w) {
    if (!w) return;
    for (int i = 0; i < w->n; i++) free(w->crc ? w->crc[i] : NULL);
    for (int i = 0; w->desc && i < w->n; i++) free((char *)w->desc[i].name);
    for (int i = 0; w->meta_kv && i < 2 * w->n_meta; i++) free(w->meta_kv[i]);
    free(w->desc);
    free(w->meta_kv);
    free(w->crc);
    free(w->bytes);
    free(w->path);
    free(w->tmp);
    free(w);
}

/* [Note: replace only our own files] The writer renames its ".tmp" file
 * over `path`, so an existing `path` or `path.tmp` would be lost. It goes
 * ahead only when each is absent or a safetensors file this writer made
 * (its header carries our per-chunk checksums; a ".tmp" may also be empty,
 * or cut short after the header: a crashed save's), and otherwise refuses,
 * naming the file. An existing `path` must also be of the kind being
 * written, its header holding the writer's mark (the first "fsdp." key of
 * its metadata: a full file's layout, a checkpoint rank file's rank): a full
 * file saved over a checkpoint's rank file would leave that checkpoint
 * without its shard. */

/* Whether the header of path holds the quoted key `key` (a block at a time,
 * allocating nothing: a check that runs out of memory would call the file a
 * stranger's). */
static int header_has(int fd, uint64_t n, uint64_t size, const char *key, size_t k) {
    char blk[4096];
    size_t have = 0; /* bytes of blk kept from the last block: the tail a key may straddle */
    for (uint64_t at = 0; n <= (uint64_t)64 << 20 && n + 8 <= size && at < n;) {
        size_t want = sizeof blk - have;
        if (want > n - at) want = (size_t)(n - at);
        ssize_t r = pread(fd, blk + have, want, (off_t)(8 + at));
        if (r <= 0) break;
        at += (uint64_t)r;
        have += (size_t)r;
        if (memmem(blk, have, key, k)) return 1;
        if (have >= k) {
            memmove(blk, blk + have - (k - 1), k - 1);
            have = k - 1;
        }
    }
    return 0;
}

static int written_by_us(const char *path, int allow_empty, const char *mark) {
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return 0;
    struct stat sb;
    int ok = 0;
    uint8_t lenb[8];
    if (fstat(fd, &sb) == 0 && S_ISREG(sb.st_mode)) {
        if (sb.st_size == 0) ok = allow_empty;
        else if (pread(fd, lenb, 8, 0) == 8) {
            uint64_t n = 0;
            for (int i = 7; i >= 0; i--) n = n << 8 | lenb[i];
            /* one of our checksum keys, "fsdp.crc32c.<name>", and the mark as a key */
            static const char key[] = "\"" FSDP__ST_CRC_KEY;
            ok = header_has(fd, n, (uint64_t)sb.st_size, key, sizeof key - 1);
            char mk[64];
            if (ok && mark && (size_t)snprintf(mk, sizeof mk, "\"%s\"", mark) < sizeof mk)
                ok = header_has(fd, n, (uint64_t)sb.st_size, mk, strlen(mk));
        }
    }
    close(fd);
    return ok;
}

int fsdp__st_written_by_us(const char *path, int allow_empty) { return written_by_us(path, allow_empty, NULL); }

static enum fsdp_status check_replaceable(struct fsdp_ctx *ctx, const char *path, int is_tmp, const char *mark) {
    struct stat sb;
    if (lstat(path, &sb) != 0) {
        if (errno == ENOENT) return FSDP_OK;
        return fsdp__err(ctx, FSDP_ERR_IO, "%s: cannot inspect: %s", path, strerror(errno));
    }
    if (!S_ISREG(sb.st_mode))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "%s: exists and is not a regular file: refusing to replace it", path);
    if (!written_by_us(path, is_tmp, NULL))
        return fsdp__err(ctx, FSDP_ERR_INVALID,
                         "%s: exists and was not written by fsdp.c: refusing to replace it (choose another name, "
                         "or move it away)", path);
    if (mark && !written_by_us(path, 0, mark))
        return fsdp__err(ctx, FSDP_ERR_INVALID,
                         "%s: exists and is another kind of fsdp.c file (its metadata has no \"%s\", e.g. a "
                         "checkpoint's rank file): refusing to replace it (choose another name)", path, mark);
    return FSDP_OK;
}

enum fsdp_status fsdp__st_check_target(struct fsdp_ctx *ctx, const char *path, const char *mark) {
    char *tmp = fsdp__malloc(strlen(path) + 5);
    if (!tmp) return fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory", path);
    sprintf(tmp, "%s.tmp", path);
    enum fsdp_status st = check_replaceable(ctx, path, 0, mark);
    if (st == FSDP_OK) st = check_replaceable(ctx, tmp, 1, NULL);
    free(tmp);
    return st;
}

enum fsdp_status fsdp__st_writer_open(struct fsdp_ctx *ctx, const char *path, int n,
                                      const struct fsdp__st_desc *desc, int n_meta,
                                      const char *const *meta_kv, struct fsdp__st_writer **out) {
    *out = NULL;
    struct fsdp__st_writer *w = fsdp__zalloc(1, sizeof *w);
    if (!w) return fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory", path);
    w->ctx = ctx;
    w->fd = -1;
    w->n = n;
    w->path = fsdp__strdup(path);
    /* desc and meta_kv are borrowed for the call only: copy them */
    w->desc = fsdp__zalloc((size_t)n + 1, sizeof *w->desc);
    w->meta_kv = fsdp__zalloc(2 * (size_t)n_meta + 1, sizeof *w->meta_kv);
    int copied = w->desc && w->meta_kv;
    for (int i = 0; copied && i < n; i++) {
        w->desc[i] = desc[i];
        w->desc[i].name = fsdp__strdup(desc[i].name);
        copied = w->desc[i].name != NULL;
        w->n = i + 1;
    }
    for (int i = 0; copied && i < 2 * n_meta; i++) {
        w->meta_kv[i] = fsdp__strdup(meta_kv[i]);
        copied = w->meta_kv[i] != NULL;
        w->n_meta = (i + 2) / 2;
    }
    if (!copied) {
        writer_free(w);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory", path);
    }
    w->n = n;
    w->n_meta = n_meta;
    w->tmp = fsdp__malloc(strlen(path) + 5);
    w->bytes = fsdp__zalloc((size_t)n + 1, sizeof *w->bytes);
    w->crc = fsdp__zalloc((size_t)n + 1, sizeof *w->crc);
    if (!w->path || !w->tmp || !w->bytes || !w->crc) {
        writer_free(w);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory", path);
    }
    sprintf(w->tmp, "%s.tmp", path);
    const char *mark = NULL; /* the first "fsdp." key: the kind of file ([Note: replace only our own files]) */
    for (int i = 0; !mark && i < n_meta; i++)
        if (!strncmp(meta_kv[2 * i], "fsdp.", 5)) mark = meta_kv[2 * i];
    enum fsdp_status chk = fsdp__st_check_target(ctx, path, mark);
    if (chk != FSDP_OK) {
        writer_free(w);
        return chk;
    }
    for (int i = 0; i < n; i++) {
        int64_t numel = 1;
        for (int d = 0; d < desc[i].ndim; d++) numel *= desc[i].shape[d];
        w->bytes[i] = (uint64_t)numel * fsdp_dtype_size(desc[i].dtype);
        w->crc[i] = fsdp__zalloc((size_t)fsdp__st_chunks(w->bytes[i]), sizeof(uint32_t));
        if (!w->crc[i]) {
            writer_free(w);
            return fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory", path);
        }
    }
    size_t hlen;
    char *hdr = build_header(w, &hlen);
    if (!hdr) {
        writer_free(w);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory building the header", path);
    }
    w->fd = open(w->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (w->fd < 0) {
        free(hdr);
        enum fsdp_status st = fsdp__err(ctx, FSDP_ERR_IO, "%s: cannot create: %s", w->tmp, strerror(errno));
        writer_free(w);
        return st;
    }
    uint8_t lenb[8];
    for (int i = 0; i < 8; i++) lenb[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
    enum fsdp_status st = fsdp__write_all(ctx, w->fd, w->tmp, lenb, 8, 0);
    if (st == FSDP_OK) st = fsdp__write_all(ctx, w->fd, w->tmp, hdr, hlen, 8);
    free(hdr);
    w->data_start = w->off = w->kicked = 8 + hlen;
    if (st != FSDP_OK) {
        fsdp__st_writer_abort(w);
        return st;
    }
    while (w->cur < w->n && w->bytes[w->cur] == 0) {
        w->crc[w->cur][0] = fsdp__crc32c(0, NULL, 0);
        w->cur++;
    }
    *out = w;
    return FSDP_OK;
}

uint64_t fsdp__st_writer_data_start(const struct fsdp__st_writer *w) { return w->data_start; }

/* [Note: early writeback] Start writing each 8 MiB to disk as soon as it is
 * in the page cache, so the disk works while the next bytes are checksummed
 * and copied, and the fsync at commit has little left (a plain write + fsync
 * leaves it all to the end). Only a hint: durability still comes from that
 * fsync. Starts it for [kicked, upto) once that is 8 MiB or more. */
static void kick_writeback(struct fsdp__st_writer *w, uint64_t upto) {
    if (upto - w->kicked < ((uint64_t)8 << 20)) return;
    (void)sync_file_range(w->fd, (off_t)w->kicked, (off_t)(upto - w->kicked), SYNC_FILE_RANGE_WRITE);
    w->kicked = upto;
}

/* [Note: parallel chunks] A write of whole chunks checksums and writes each
 * chunk on its own (its CRC starts at zero, its bytes go to their own file
 * offset), so the compute threads share them: on one rank the save is one
 * thread copying into fresh page-cache pages, which both cores can do at
 * once. Writes chunks [c0, c0 + nc) of tensor cur from p at file offset off;
 * returns 0, or the errno of the first failed chunk in file order (the
 * message is made after the loop, on this thread). */
static int write_chunks(struct fsdp__st_writer *w, const uint8_t *p, uint64_t c0, int64_t nc, uint64_t off) {
    int64_t first = nc;
    int err = 0;
#pragma omp parallel for schedule(dynamic, 1) if (nc >= 4 && !omp_in_parallel())
    for (int64_t i = 0; i < nc; i++) {
        const uint8_t *q = p + (size_t)i * FSDP__ST_CHUNK;
        w->crc[w->cur][c0 + (uint64_t)i] = fsdp__crc32c(0, q, FSDP__ST_CHUNK);
        size_t n = FSDP__ST_CHUNK;
        uint64_t o = off + (uint64_t)i * FSDP__ST_CHUNK;
        int e = 0;
        while (n && !e) {
            ssize_t r = pwrite(w->fd, q, n, (off_t)o);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) e = r < 0 ? errno : EIO;
            else q += r, n -= (size_t)r, o += (uint64_t)r;
        }
        if (e) {
#pragma omp critical(st_write_chunks)
            if (i < first) first = i, err = e;
        }
    }
    return err;
}

enum fsdp_status fsdp__st_writer_write(struct fsdp__st_writer *w, const void *data, size_t bytes) {
    const uint8_t *p = data;
    while (bytes) {
        if (w->cur >= w->n)
            return fsdp__err(w->ctx, FSDP_ERR_INVALID, "%s: more data than the declared tensors", w->path);
        uint64_t room = w->bytes[w->cur] - w->filled;
        size_t k = bytes < room ? bytes : (size_t)room;
        /* checksum chunk by chunk as the bytes go by, writing each chunk
         * right after its checksum while it is still in the CPU cache (one
         * pass over memory, not two) */
        size_t done = 0;
        while (done < k) {
            uint64_t c = (w->filled + done) / FSDP__ST_CHUNK;
            if ((w->filled + done) % FSDP__ST_CHUNK == 0 && k - done >= FSDP__ST_CHUNK) {
                /* whole chunks, 16 at a time ([Note: parallel chunks]), each group's writeback started */
                int64_t nc = (int64_t)((k - done) / FSDP__ST_CHUNK);
                if (nc > 16) nc = 16;
                int e = write_chunks(w, p + done, c, nc, w->off + done);
                if (e) return fsdp__err(w->ctx, FSDP_ERR_IO, "%s: write failed: %s", w->tmp, strerror(e));
                done += (size_t)nc * FSDP__ST_CHUNK;
                kick_writeback(w, w->off + done);
                continue;
            }
            uint64_t chunk_end = (c + 1) * FSDP__ST_CHUNK;
            size_t m = (size_t)(chunk_end - (w->filled + done));
            if (m > k - done) m = k - done;
            w->crc[w->cur][c] = fsdp__crc32c(w->crc[w->cur][c], p + done, m);
            FSDP_TRY(fsdp__write_all(w->ctx, w->fd, w->tmp, p + done, m, w->off + done));
            done += m;
        }
        w->off += k;
        kick_writeback(w, w->off);
        w->filled += k;
        p += k;
        bytes -= k;
        while (w->cur < w->n && w->filled == w->bytes[w->cur]) {
            w->cur++;
            w->filled = 0;
            if (w->cur < w->n && w->bytes[w->cur] == 0) w->crc[w->cur][0] = fsdp__crc32c(0, NULL, 0);
            fsdp__ckpt_crash_point("safetensors tensor written");
        }
    }
    return FSDP_OK;
}

enum fsdp_status fsdp__st_writer_commit(struct fsdp__st_writer *w) {
    struct fsdp_ctx *ctx = w->ctx;
    enum fsdp_status st = FSDP_OK;
    if (w->cur != w->n)
        st = fsdp__err(ctx, FSDP_ERR_INVALID, "%s: tensor '%s' incomplete at commit", w->path,
                       w->desc[w->cur].name);
    size_t hlen = 0;
    char *hdr = st == FSDP_OK ? build_header(w, &hlen) : NULL;
    if (st == FSDP_OK && !hdr) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory", w->path);
    FSDP_ASSERT(st != FSDP_OK || 8 + hlen == w->data_start, "header length changed: %zu", hlen);
    if (st == FSDP_OK) st = fsdp__write_all(ctx, w->fd, w->tmp, hdr, hlen, 8);
    free(hdr);
    if (st == FSDP_OK && fsync(w->fd) != 0)
        st = fsdp__err(ctx, FSDP_ERR_IO, "%s: fsync failed: %s", w->tmp, strerror(errno));
    if (st == FSDP_OK) fsdp__ckpt_crash_point("safetensors before rename");
    if (st == FSDP_OK) { /* the descriptor is gone even when close fails: never closed twice */
        int rc = close(w->fd);
        w->fd = -1;
        if (rc != 0) st = fsdp__err(ctx, FSDP_ERR_IO, "%s: close failed: %s", w->tmp, strerror(errno));
    }
    if (st == FSDP_OK && rename(w->tmp, w->path) != 0)
        st = fsdp__err(ctx, FSDP_ERR_IO, "%s: cannot rename to %s: %s", w->tmp, w->path, strerror(errno));
    if (st == FSDP_OK) st = fsdp__fsync_dir(ctx, w->path);
    if (st != FSDP_OK) {
        fsdp__st_writer_abort(w);
        return st;
    }
    writer_free(w);
    return FSDP_OK;
}

void fsdp__st_writer_abort(struct fsdp__st_writer *w) {
    if (!w) return;
    if (w->fd >= 0) close(w->fd);
    unlink(w->tmp);
    writer_free(w);
}
