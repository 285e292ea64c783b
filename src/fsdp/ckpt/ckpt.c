/*
 * ckpt.c - checkpoints of a sharded model: the helpers shared by
 * ckpt/sharded.c (the sharded folder: one safetensors file per rank +
 * meta.json, loadable at any world size), ckpt/meta.c (meta.json's reader),
 * ckpt/full.c (the full safetensors file, written by rank 0 one gathered
 * unit at a time, loaded by every rank reading its own ranges or by rank 0
 * with broadcast; Hugging Face GPT-2 import) and ckpt/offline.c (describe,
 * verify, convert). Sits in fsdp/ because it needs unit layouts; the file
 * format is io/'s. Invariants: everything outside src/fsdp is per parameter (FQN, global
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
 * meta.json the same way, fsyncs, renames dir.tmp -> dir (over an existing
 * dir: exchanges the two, then removes the old one, now named dir.tmp, which a
 * save of that step cleans if a crash leaves it) and fsyncs the parent. A
 * folder without meta.json is never a checkpoint, so a crash at any point
 * leaves the previous one loadable; removal takes meta.json last ([Note:
 * removal order]).
 * Only files a checkpoint writer makes are ever replaced or removed
 * ([Note: only our own files]).
 */
#include "fsdp/fsdp-impl.h"
#include "io/io-impl.h"
#include "optim/optim-impl.h"

#include <cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <string.h>
#include <stdio.h> /* renameat2 */
#include <sys/stat.h>
#include <unistd.h>

static const char *const adam_names[] = {"exp_avg", "exp_avg_sq"};
static const char *const sgd_names[] = {"momentum_buffer"};

const char *const *fsdp__ckpt_state_names(const struct fsdp_optim *opt, int *k) {
    *k = opt ? fsdp_optim_state_per_elem(opt) : 0;
    if (*k == 2) return adam_names;
    if (*k == 1) return sgd_names;
    *k = 0;
    return NULL;
}

/* ---- Weights read from a file ---- */

/* [Note: finite weights on load] A training step never writes a
 * non-finite value into a weight (a step whose update is not finite is
 * skipped, src/fsdp/step.c), so a NaN or an infinity in a weight read from
 * a file is damage (or a foreign writer's diverged run). Our own files'
 * checksums catch damage, but a file without them (Hugging Face's, a
 * conversion of one) loaded it unnoticed, and the run then stopped at step
 * 1 on a non-finite gradient, naming a unit and no file. The full-file
 * load and the conversion to a sharded checkpoint check every parameter
 * value they read (one pass over values just read, in cache; buffers and
 * optimizer state are not weights and are not checked). */
enum fsdp_status fsdp__ckpt_finite(struct fsdp_ctx *ctx, const char *path, const char *tensor, const char *param,
                                   const float *v, int64_t n, int64_t first) {
    int bad = 0;
#pragma omp simd reduction(| : bad)
    for (int64_t i = 0; i < n; i++) bad |= !(v[i] - v[i] == 0.0f); /* NaN or an infinity */
    if (!bad) return FSDP_OK;
    int64_t i = 0;
    while (v[i] - v[i] == 0.0f) i++;
    return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: tensor '%s' holds %s at element %lld of parameter '%s': a "
                     "model's weights must be finite (a damaged file, or one written from a run that diverged)",
                     path, tensor, isnan(v[i]) ? "NaN" : v[i] > 0 ? "+inf" : "-inf", (long long)(first + i), param);
}

/* ---- Agreement: every rank returns the first failing rank's status and message ---- */

enum fsdp_status fsdp__ckpt_agree(struct fsdp_ctx *ctx, enum fsdp_status st) {
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

enum fsdp_status fsdp__ckpt_check_idle(struct fsdp_ctx *ctx, struct fsdp_model *fm, const char *what) {
    FSDP_TRY(fsdp__check_unsummoned(ctx, fm, what));
    for (int i = 0; i < fm->n_units; i++)
        if (fm->units[i].state_ != UNIT_SHARDED)
            return fsdp__err(ctx, FSDP_ERR_STATE, "%s: unit '%s' is gathered or failed (state %d)", what,
                             fm->units[i].module->fqn, (int)fm->units[i].state_);
    return FSDP_OK;
}

/* This rank's overlap [s, e) (flat) of parameter j of u; returns 0 if none. */
int fsdp__ckpt_overlap(const struct fsdp__unit *u, int rank, int j, int64_t *s, int64_t *e) {
    int64_t lo = (int64_t)rank * u->numel_shard, hi = lo + u->numel_shard;
    int64_t a = u->offsets[j], b = a + u->params[j]->numel;
    *s = a > lo ? a : lo;
    *e = b < hi ? b : hi;
    return *s < *e;
}

char *fsdp__path_join(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = fsdp__malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

void fsdp__ckpt_rank_file_name(char *buf, size_t n, int r, int world) {
    snprintf(buf, n, "rank-%05d-of-%05d.safetensors", r, world);
}

/* Writes text to path via path.tmp + fsync + rename. */
enum fsdp_status fsdp__write_durable(struct fsdp_ctx *ctx, const char *path, const char *text) {
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

void fsdp__meta_seal(char *text) {
    FSDP_ASSERT(!strncmp(text, SEAL_PREFIX "00000000\"", strlen(SEAL_PREFIX) + 9), "meta.json layout");
    char hex[9];
    snprintf(hex, sizeof hex, "%08x", fsdp__crc32c(0, text, strlen(text)));
    memcpy(text + strlen(SEAL_PREFIX), hex, 8);
}

enum fsdp_status fsdp__meta_check_seal(struct fsdp_ctx *ctx, const char *path, char *text) {
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

/* [Note: only our own files] A checkpoint writer deletes or replaces only
 * what a checkpoint writer makes: meta.json, rank-NNNNN-of-NNNNN.safetensors
 * and their ".tmp" names, in the target folder and in its ".tmp" sibling,
 * and only when they hold what it writes (owned_file: a user's file of
 * such a name is the user's).
 * Before anything is written, rank 0 refuses a target that is not a folder,
 * or a folder (or .tmp sibling) holding anything else, naming it; so an
 * existing --save-dir, a folder of notes or a regular file given as the
 * target is left as it was. The removals below skip foreign names anyway,
 * so a file that appears after the check survives (the folder then stays). */

/* Whether `name` is a file a checkpoint writer makes (with or without ".tmp"). */
static int owned_name(const char *name) {
    size_t n = strlen(name);
    if (n > 4 && !strcmp(name + n - 4, ".tmp")) n -= 4;
    if (n == strlen(FSDP__META_NAME) && !strncmp(name, FSDP__META_NAME, n)) return 1;
    static const char pat[] = "rank-#####-of-#####.safetensors";
    if (n != sizeof pat - 1) return 0;
    for (size_t i = 0; i < n; i++)
        if (pat[i] == '#' ? (name[i] < '0' || name[i] > '9') : name[i] != pat[i]) return 0;
    return 1;
}

/* Whether dir/name (at path) is a file a checkpoint writer made: by its name
 * (owned_name), and by what it holds, as a user's file of such a name is
 * not ours: a meta.json opens with its seal's field ([Note: sealed
 * meta.json]), a rank file is a safetensors file carrying our checksums
 * ([Note: replace only our own files], st_write.c); a ".tmp" one may also be
 * empty, or a meta.json.tmp cut short within the seal's field. */
static int owned_file(const char *path, const char *name) {
    if (!owned_name(name)) return 0;
    size_t n = strlen(name);
    int tmp = n > 4 && !strcmp(name + n - 4, ".tmp");
    if (strncmp(name, FSDP__META_NAME, strlen(FSDP__META_NAME))) return fsdp__st_written_by_us(path, tmp);
    char head[sizeof SEAL_PREFIX] = "";
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    struct stat sb;
    ssize_t r = fd >= 0 && fstat(fd, &sb) == 0 && S_ISREG(sb.st_mode) ? pread(fd, head, sizeof head - 1, 0) : -1;
    if (fd >= 0) close(fd);
    if (r < 0) return 0;
    return r == (ssize_t)sizeof head - 1 ? !memcmp(head, SEAL_PREFIX, sizeof head - 1)
                                         : tmp && !memcmp(head, SEAL_PREFIX, (size_t)r);
}

/* OK if dir does not exist, or is a folder holding only our regular files. */
static enum fsdp_status check_owned_dir(struct fsdp_ctx *ctx, const char *dir, const char *role, int removing) {
    struct stat sb;
    if (lstat(dir, &sb) != 0) {
        if (errno == ENOENT) return FSDP_OK;
        return fsdp__err(ctx, FSDP_ERR_IO, "%s: cannot inspect %s: %s", dir, role, strerror(errno));
    }
    if (!S_ISDIR(sb.st_mode))
        return fsdp__err(ctx, FSDP_ERR_INVALID,
                         "%s: exists and is not a folder: refusing to replace it with a checkpoint (%s)", dir, role);
    DIR *d = opendir(dir);
    if (!d) return fsdp__err(ctx, FSDP_ERR_IO, "%s: cannot list %s: %s", dir, role, strerror(errno));
    enum fsdp_status st = FSDP_OK;
    struct dirent *e;
    while (st == FSDP_OK && (e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char p[PATH_MAX];
        struct stat fb;
        int regular = (size_t)snprintf(p, sizeof p, "%s/%s", dir, e->d_name) < sizeof p && lstat(p, &fb) == 0 &&
                      S_ISREG(fb.st_mode);
        if (!regular || !owned_file(p, e->d_name))
            st = removing ? fsdp__err(ctx, FSDP_ERR_INVALID, "%s: holds '%s', which no checkpoint writer made: not "
                                      "removing the folder", dir, e->d_name)
                          : fsdp__err(ctx, FSDP_ERR_INVALID,
                                      "%s: holds '%s', which no checkpoint writer made: refusing to write the "
                                      "checkpoint there (%s; name a new or empty folder, or move '%s' away)",
                                      dir, e->d_name, role, e->d_name);
    }
    closedir(d);
    return st;
}

enum fsdp_status fsdp_ckpt_check_target(struct fsdp_ctx *ctx, const char *dir) {
    char tmpdir[PATH_MAX];
    if (!dir || !dir[0] || strlen(dir) > PATH_MAX - 64)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "checkpoint: bad folder name");
    snprintf(tmpdir, sizeof tmpdir, "%s.tmp", dir);
    FSDP_TRY(check_owned_dir(ctx, dir, "the checkpoint folder", 0));
    return check_owned_dir(ctx, tmpdir, "the unfinished save's folder", 0);
}

/* Removes the files of ours from a flat folder but `keep` (a name, or NULL),
 * then the folder if that left it empty. Goes through every entry, and
 * returns the first that stays, naming it: one of ours that unlink refused,
 * or one that owned_file does not take for ours (the callers checked the
 * folder first, so it appeared or changed since, or cannot be read), refused
 * in check_owned_dir's words. ctx may be NULL (best effort: no message). */
static enum fsdp_status remove_owned(struct fsdp_ctx *ctx, const char *dir, const char *keep) {
    DIR *d = opendir(dir);
    if (!d)
        return errno == ENOENT ? FSDP_OK : fsdp__err(ctx, FSDP_ERR_IO, "%s: cannot list: %s", dir, strerror(errno));
    enum fsdp_status st = FSDP_OK;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") || (keep && !strcmp(e->d_name, keep))) continue;
        char p[PATH_MAX];
        struct stat sb;
        int fits = (size_t)snprintf(p, sizeof p, "%s/%s", dir, e->d_name) < sizeof p;
        int ours = fits && owned_file(p, e->d_name);
        if (ours && unlink(p) == 0) continue;
        int gone = ours ? errno == ENOENT : fits && lstat(p, &sb) != 0 && errno == ENOENT; /* removed meanwhile */
        if (gone || st != FSDP_OK) continue;
        st = ours ? fsdp__err(ctx, FSDP_ERR_IO, "%s: cannot remove: %s", p, strerror(errno))
                  : fsdp__err(ctx, FSDP_ERR_INVALID,
                              "%s: holds '%s', which no checkpoint writer made: not removing the folder", dir,
                              e->d_name);
    }
    closedir(d);
    rmdir(dir);
    return st;
}

int fsdp_ckpt_is_ours(const char *path) {
    struct stat sb;
    if (!path || lstat(path, &sb) != 0) return 0;
    if (S_ISREG(sb.st_mode)) return fsdp__st_written_by_us(path, 0);
    char meta[PATH_MAX];
    if (!S_ISDIR(sb.st_mode) || (size_t)snprintf(meta, sizeof meta, "%s/%s", path, FSDP__META_NAME) >= sizeof meta)
        return 0;
    return lstat(meta, &sb) == 0 && S_ISREG(sb.st_mode) && owned_file(meta, FSDP__META_NAME);
}

enum fsdp_status fsdp_ckpt_remove(struct fsdp_ctx *ctx, const char *dir) {
    struct stat sb;
    if (dir && lstat(dir, &sb) == 0 && S_ISREG(sb.st_mode)) { /* a full file (fsdp_model_save_full) */
        if (!fsdp__st_written_by_us(dir, 0))
            return fsdp__err(ctx, FSDP_ERR_INVALID, "%s: was not written by fsdp.c: not removing it", dir);
        if (unlink(dir) != 0) return fsdp__err(ctx, FSDP_ERR_IO, "%s: cannot remove: %s", dir, strerror(errno));
        return FSDP_OK;
    }
    if (!dir || stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return fsdp__err(ctx, FSDP_ERR_IO, "%s: not a checkpoint folder", dir ? dir : "(null)");
    FSDP_TRY(check_owned_dir(ctx, dir, "", 1));
    /* [Note: removal order] meta.json goes last, after the rank files' unlinks
     * are on disk: a removal cut short (a kill, a power loss) leaves a folder
     * that still reads as a checkpoint, so the next --keep-last finds it and
     * removes the rest, where meta.json gone first would leave its rank files
     * behind in a folder nothing lists, for good. Such a folder's load fails
     * naming the missing file; --keep-last never removes the newest one.
     * So a rank file that stays (unlink refused, or no longer ours) keeps
     * meta.json too. */
    FSDP_TRY(remove_owned(ctx, dir, FSDP__META_NAME));
    char meta[PATH_MAX];
    if ((size_t)snprintf(meta, sizeof meta, "%s/%s", dir, FSDP__META_NAME) >= sizeof meta)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "%s: path too long", dir);
    FSDP_TRY(fsdp__fsync_dir(ctx, meta)); /* the folder itself: meta.json's parent */
    fsdp__fault_point("ckpt-remove", dir);
    if (unlink(meta) != 0 && errno != ENOENT)
        return fsdp__err(ctx, FSDP_ERR_IO, "%s: cannot remove: %s", meta, strerror(errno));
    if (rmdir(dir) != 0 && errno != ENOENT)
        return fsdp__err(ctx, FSDP_ERR_IO, "%s: cannot remove: %s", dir, strerror(errno));
    return fsdp__fsync_dir(ctx, dir); /* its parent */
}

/* Rank 0: removes files of dir.tmp that this save did not write (a crashed
 * save at another world size), then swaps dir.tmp into place. */
/* A commit that failed before its swap or rename: tmpdir's meta.json is this
 * save's own, and without it the caller's cleanup ([Note: a failed save
 * leaves nothing of its own], sharded.c) takes the rank files it wrote
 * instead of keeping them as the previous checkpoint. */
static enum fsdp_status not_swapped(const char *tmpdir, enum fsdp_status st) {
    char p[PATH_MAX];
    if ((size_t)snprintf(p, sizeof p, "%s/%s", tmpdir, FSDP__META_NAME) < sizeof p) unlink(p);
    return st;
}

enum fsdp_status fsdp__ckpt_commit_dir(struct fsdp_ctx *ctx, const char *dir, const char *tmpdir, int nfiles) {
    DIR *d = opendir(tmpdir);
    if (d) {
        struct dirent *e;
        while ((e = readdir(d))) {
            int keep = !owned_name(e->d_name) || !strcmp(e->d_name, FSDP__META_NAME);
            for (int r = 0; r < nfiles && !keep; r++) {
                char name[64];
                fsdp__ckpt_rank_file_name(name, sizeof name, r, nfiles);
                keep = !strcmp(e->d_name, name);
            }
            char p[PATH_MAX];
            if (!keep && (size_t)snprintf(p, sizeof p, "%s/%s", tmpdir, e->d_name) < sizeof p && owned_file(p, e->d_name))
                unlink(p);
        }
        closedir(d);
    }
    enum fsdp_status st = fsdp__fsync_dir(ctx, tmpdir); /* fsyncs the parent of tmpdir... */
    char self[PATH_MAX];
    snprintf(self, sizeof self, "%s/.", tmpdir);
    if (st == FSDP_OK) st = fsdp__fsync_dir(ctx, self); /* ...and tmpdir itself */
    if (st != FSDP_OK) return not_swapped(tmpdir, st);
    fsdp__ckpt_crash_point("before folder rename");
    if (fsdp__fault_point("ckpt-commit", dir)) /* FSDP_FAULT=ckpt-commit:0:STEP:fail, as a rename's EIO */
        return not_swapped(tmpdir, fsdp__err(ctx, FSDP_ERR_IO, "%s: cannot move %s into place: %s (FSDP_FAULT)", dir,
                                             tmpdir, strerror(EIO)));
    struct stat sb;
    if (stat(dir, &sb) == 0) {
        /* replace an existing checkpoint: swap the two folders atomically,
         * then remove the old one (now under the tmp name) */
        if (renameat2(AT_FDCWD, tmpdir, AT_FDCWD, dir, RENAME_EXCHANGE) != 0)
            return not_swapped(tmpdir, fsdp__err(ctx, FSDP_ERR_IO, "%s: cannot swap in %s: %s", dir, tmpdir,
                                                 strerror(errno)));
        FSDP_TRY(fsdp__fsync_dir(ctx, dir));
        (void)remove_owned(NULL, tmpdir, NULL); /* best effort: what stays is cleaned as after a crash */
        return FSDP_OK;
    }
    if (rename(tmpdir, dir) != 0)
        return not_swapped(tmpdir, fsdp__err(ctx, FSDP_ERR_IO, "%s: cannot rename to %s: %s", tmpdir, dir,
                                             strerror(errno)));
    return fsdp__fsync_dir(ctx, dir);
}
const char *fsdp__shape_str(char *buf, size_t n, int ndim, const int64_t *shape) {
    size_t k = (size_t)snprintf(buf, n, "[");
    for (int d = 0; d < ndim && k < n; d++) k += (size_t)snprintf(buf + k, n - k, d ? ", %lld" : "%lld", (long long)shape[d]);
    if (k < n) snprintf(buf + k, n - k, "]");
    return buf;
}
