/*
 * ckpt.c - fsdp-train's checkpoint folders and output locations: where
 * --resume and --autoresume find a checkpoint, saving DIR/step-N every
 * --save-every steps and keeping the newest --keep-last, and the check of every output path
 * before step 1, with the lock on --save-dir ([Note: output preflight]).
 * The library writes and reads the checkpoints themselves (src/fsdp/ckpt/).
 * Part of fsdp-train (tools/fsdp-train.c runs the job; task.h declares these).
 */
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "config.h"
#include "task.h"

/* ---- Checkpoints: DIR/step-NNNNNNNN folders, each complete only with
 * meta.json (--state-dict-type sharded), or DIR/step-NNNNNNNN.safetensors
 * files (full; written under a temporary name, then renamed) ---- */

static const char *ckpt_suffix(int full) { return full ? ".safetensors" : ""; }

static void ckpt_path(char *buf, size_t n, const char *dir, long step, int full) {
    snprintf(buf, n, "%s/step-%08ld%s", dir, step, ckpt_suffix(full));
}

/* The step numbers of the complete checkpoints of one kind in dir (ours:
 * fsdp_ckpt_is_ours), ascending; returns the count. */
static int list_ckpts(const char *dir, int full, long **steps) {
    *steps = NULL;
    DIR *d = opendir(dir);
    if (!d) return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        char *end;
        if (strncmp(e->d_name, "step-", 5) || !isdigit((unsigned char)e->d_name[5])) continue;
        long st = strtol(e->d_name + 5, &end, 10);
        if (strcmp(end, ckpt_suffix(full))) continue; /* skips step-N.tmp and step-N.old */
        char path[4096], named[4096];
        /* only the names the writer makes (ckpt_path): a step-9 renamed by hand is not step-00000009 */
        ckpt_path(named, sizeof named, dir, st, full);
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (strcmp(path, named)) continue;
        struct stat sb;
        if (stat(path, &sb) != 0 || (full ? !S_ISREG(sb.st_mode) : !S_ISDIR(sb.st_mode))) continue;
        if (!fsdp_ckpt_is_ours(path)) continue; /* a user's that bears the name; a folder without meta.json */
        long *ns = realloc(*steps, (size_t)(n + 1) * sizeof **steps);
        if (!ns) break;
        *steps = ns;
        int i = n++;
        for (; i > 0 && (*steps)[i - 1] > st; i--) (*steps)[i] = (*steps)[i - 1];
        (*steps)[i] = st;
    }
    closedir(d);
    return n;
}

/* --resume DIR: DIR itself if it holds meta.json, else its newest checkpoint. */
const char *resolve_resume(const char *dir, char *buf, size_t n) {
    struct stat sb;
    snprintf(buf, n, "%s/meta.json", dir);
    if (stat(buf, &sb) == 0) {
        snprintf(buf, n, "%s", dir);
        return buf;
    }
    long *steps;
    int k = list_ckpts(dir, 0, &steps);
    if (k == 0) {
        free(steps);
        return NULL;
    }
    ckpt_path(buf, n, dir, steps[k - 1], 0);
    free(steps);
    return buf;
}

const char *resolve_autoresume(struct fsdp_ctx *ctx, const struct opts *o, char *buf, size_t n) {
    const char *found = resolve_resume(o->save_dir, buf, n);
    uint32_t h = 2166136261u; /* FNV-1a of the path found: equal on every rank, or they differ */
    for (const char *s = found; s && *s; s++) h = (h ^ (unsigned char)*s) * 16777619u;
    int32_t mine[2] = {found != NULL, (int32_t)(h >> 1)}, lo[2], hi[2];
    if (fsdp_comm_allreduce(fsdp_ctx_comm(ctx), mine, lo, 2, FSDP_I32, FSDP_MIN) != FSDP_OK ||
        fsdp_comm_allreduce(fsdp_ctx_comm(ctx), mine, hi, 2, FSDP_I32, FSDP_MAX) != FSDP_OK)
        fail_rank("%s", fsdp_errmsg(ctx));
    if (lo[0] != hi[0] || lo[1] != hi[1])
        fail_all("--autoresume: the ranks find different checkpoints in --save-dir '%s' (this rank: %s): give "
                 "every rank the same folder", o->save_dir, found ? found : "none");
    if (fsdp_ctx_rank(ctx) != 0) return found;
    if (found)
        printf("autoresume: continuing from %s%s\n", found,
               o->resume ? " (not --resume's)" : o->init_from ? " (not --init-from)" : "");
    else
        printf("autoresume: no checkpoint in %s yet: %s\n", o->save_dir,
               o->resume ? "continuing from --resume" : o->init_from ? "starting from --init-from" : "starting afresh");
    return found;
}

/* Keeps the newest `keep` checkpoints of dir (rank 0 only). */
static void prune_ckpts(struct fsdp_ctx *ctx, const char *dir, int keep, int full) {
    long *steps;
    int k = list_ckpts(dir, full, &steps);
    for (int i = 0; i + keep < k; i++) {
        char p[4096];
        ckpt_path(p, sizeof p, dir, steps[i], full);
        /* removes only a checkpoint's own files; one holding others is kept */
        if (fsdp_ckpt_remove(ctx, p) != FSDP_OK)
            fprintf(stderr, "fsdp-train: --keep-last: keeping %s\n", fsdp_errmsg(ctx));
    }
    free(steps);
}

int saves_step(const struct opts *o, long n, long steps) {
    return (o->save_every && n % o->save_every == 0) || n == steps;
}

/* Saves DIR/step-N (every rank), then keeps the newest --keep-last. */
void save_ckpt(struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct opts *o, struct task *t, int step,
               int tty) {
    int rank = fsdp_ctx_rank(ctx);
    char path[4096];
    launcher_check();
    int full = !strcmp(o->state_dict_type, "full");
    ckpt_path(path, sizeof path, o->save_dir, step, full);
    if (rank == 0 && mkdir(o->save_dir, 0755) != 0 && errno != EEXIST)
        fail_rank("--save-dir: cannot create '%s': %s", o->save_dir, strerror(errno));
    struct fsdp_ckpt_meta m = {0};
    m.step = m.data_step = step;
    m.seed = o->seed;
    t->ops->meta(t, &m);
    char *cfg = config_json(o); /* [Note: run configuration] in train/config.c */
    if (strlen(cfg) >= sizeof m.train_config)
        fail_all("saving %s: the configuration is %zu bytes, more than a checkpoint keeps (%zu)", path, strlen(cfg),
                 sizeof m.train_config - 1);
    memcpy(m.train_config, cfg, strlen(cfg) + 1);
    free(cfg);
    double t0 = now_s();
    /* the barrier: nobody writes into --save-dir before rank 0 made it; the
     * model's state_dict_type (--state-dict-type) chooses the kind */
    if (fsdp_comm_barrier(fsdp_ctx_comm(ctx)) != FSDP_OK || fsdp_model_save(ctx, fm, path, &m) != FSDP_OK)
        fail_all("saving %s: %s", path, fsdp_errmsg(ctx));
    if (rank == 0) {
        if (o->keep_last) prune_ckpts(ctx, o->save_dir, o->keep_last, full);
        if (!tty) printf("saved %s in %.2f s\n", path, now_s() - t0);
    }
}

/* ---- Output locations, checked before step 1 ([Note: output preflight]) ----
 * A bad --save-full used to fail after all the training, a bad --save-dir at
 * the first save. Rank 0 checks every output location before any step (for
 * --save-full, and for the steps --save-dir will hold, also with the
 * writer's own check, which refuses a file fsdp.c did not write) and
 * creates nothing but what the flags name: the
 * --save-dir folder (one level, as the first save would) and its lock file
 * DIR/.lock, which it holds with flock for the whole run so that a second
 * job on the same folder stops at once, naming the first one's pid. The
 * lock file stays (removing it would let a third job lock a new file while a
 * second still waits on the old). */

static int g_lock_fd = -1;      /* DIR/.lock, held until exit */
static char g_lock_line[320];   /* what rank 0 wrote into it */

/* The folder holding path: "." for a bare name. */
static void dir_of(const char *path, char *buf, size_t n) {
    snprintf(buf, n, "%s", path);
    char *sl = strrchr(buf, '/');
    if (!sl) snprintf(buf, n, ".");
    else if (sl == buf) buf[1] = 0;
    else *sl = 0;
}

/* A file the run will write (created or replaced): its folder must exist and
 * be writable, and the path must not be a folder. 0 or a message in err. */
static int check_out_file(const char *flag, const char *path, char *err, size_t n) {
    struct stat sb;
    char dir[4096];
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode))
        return snprintf(err, n, "%s '%s' is a folder; give a file path", flag, path), 1;
    dir_of(path, dir, sizeof dir);
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return snprintf(err, n, "%s '%s': the folder '%s' does not exist", flag, path, dir), 1;
    if (access(dir, W_OK | X_OK) != 0)
        return snprintf(err, n, "%s '%s': cannot write in '%s': %s", flag, path, dir, strerror(errno)), 1;
    if (access(path, F_OK) == 0 && access(path, W_OK) != 0)
        return snprintf(err, n, "%s '%s': cannot write it: %s", flag, path, strerror(errno)), 1;
    return 0;
}

/* [Note: a log is replaced only by a log] --log FILE is rewritten from its
 * first line, or, by a run that resumes a checkpoint, appended to: the
 * resumed run's config record, then its steps, after the earlier run's lines
 * (which a resume into the same --log would otherwise lose; readers take a
 * config record as the start of a run). A path that exists must be a regular
 * file (not a link, a FIFO, which would block the open, or a device) and be
 * empty or a log of fsdp-train (its first line the config record, LOG_FIRST
 * and an object of the run configuration's keys: is_train_log): any other
 * file, the --data file given again by mistake or another program's JSON
 * lines opening with a "config" record among them, is the user's. */
#define LOG_FIRST "{\"config\": "

/* Up to n bytes from the start of the regular file path (fsdp_open_regular:
 * never waiting on a FIFO); the count read, or -1. */
static ssize_t read_head(const char *path, char *buf, size_t n) {
    int fd = fsdp_open_regular(path, NULL, NULL);
    ssize_t r = fd >= 0 ? pread(fd, buf, n, 0) : -1;
    if (fd >= 0) close(fd);
    return r;
}

/* Whether path's first line is fsdp-train's config record: LOG_FIRST, then
 * an object whose keys are all flags of the run configuration, "steps" and
 * "lr" among them (a user's JSON-lines file that opens with another
 * {"config": ...} record is the user's). */
static int is_train_log(const char *path) {
    enum { CAP = 1 << 16 }; /* a config record is a few KiB */
    char *head = malloc(CAP + 1);
    ssize_t got = head ? read_head(path, head, CAP) : -1;
    int ours = 0;
    if (got > (ssize_t)strlen(LOG_FIRST) && !memcmp(head, LOG_FIRST, strlen(LOG_FIRST))) {
        char *nl = memchr(head, '\n', (size_t)got);
        cJSON *j = nl ? cJSON_ParseWithLength(head, (size_t)(nl - head)) : NULL;
        const cJSON *c = cJSON_GetObjectItemCaseSensitive(j, "config"), *e;
        ours = cJSON_IsObject(c) && cJSON_GetArraySize(j) == 1 && cJSON_GetObjectItemCaseSensitive(c, "steps") &&
               cJSON_GetObjectItemCaseSensitive(c, "lr");
        cJSON_ArrayForEach(e, c) if (ours && !config_flag_known(e->string)) ours = 0;
        cJSON_Delete(j);
    }
    free(head);
    return ours;
}

static int check_log_file(const char *path, char *err, size_t n) {
    struct stat sb;
    if (lstat(path, &sb) != 0) return 0; /* a new file (its folder: check_out_file) */
    if (S_ISLNK(sb.st_mode)) return snprintf(err, n, "--log '%s' is a symbolic link; give the file itself", path), 1;
    if (S_ISDIR(sb.st_mode)) return 0; /* check_out_file names it */
    if (!S_ISREG(sb.st_mode)) return snprintf(err, n, "--log '%s' is not a regular file", path), 1;
    if (sb.st_size == 0) return 0;
    if (!is_train_log(path))
        return snprintf(err, n, "--log '%s' exists and is not a log of fsdp-train (its first line is not "
                        "%s...}, fsdp-train's configuration); give another path or remove it", path, LOG_FIRST), 1;
    return 0;
}

FILE *open_log(const char *path, int append) {
    int fd = open(path, O_WRONLY | O_CREAT | (append ? O_APPEND : O_TRUNC) | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
    struct stat sb;
    if (fd >= 0 && (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode))) {
        close(fd);
        errno = EINVAL; /* checked before step 1: replaced since */
        return NULL;
    }
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (!f && fd >= 0) close(fd);
    return f;
}

void log_flush(FILE *f, const char *path) {
    if (f && (fflush(f) != 0 || ferror(f))) fail_rank("--log: writing '%s' failed: %s", path, strerror(errno));
}

/* [Note: no run replaces another's checkpoints] A run saves step-N for
 * steps after the one it starts from; a complete checkpoint of the same name
 * already in --save-dir belongs to another run (or to this run's future,
 * resumed from an older step) and would be replaced, then maybe removed by
 * --keep-last: refused before step 1, as Composer's save_overwrite does by
 * default. */
static int check_save_steps(const char *dir, long start, char *err, size_t n) {
    for (int full = 0; full < 2; full++) {
        long *steps;
        int k = list_ckpts(dir, full, &steps);
        long last = k ? steps[k - 1] : -1;
        free(steps);
        if (last > start) {
            char p[4096];
            ckpt_path(p, sizeof p, dir, last, full);
            return snprintf(err, n, "--save-dir '%s' holds %s, a checkpoint after this run's start (step %ld) "
                            "that its saves could replace: resume from it (--resume %s), give another "
                            "--save-dir, or remove it", dir, p, start, dir), 1;
        }
    }
    return 0;
}

/* What a save would refuse, refused before step 1: a step-N (or its .tmp)
 * in dir, at a step n in (start, steps] this run saves, that is not a
 * checkpoint of ours (a user's folder or file bearing the name) stopped the
 * run at that save, after the training up to it. Each such entry is put to
 * the writer's own check (fsdp_ckpt_check_target or
 * fsdp_ckpt_check_full_target, by --state-dict-type). */
static int check_save_targets(struct fsdp_ctx *ctx, const char *dir, const struct opts *o, long start, long steps,
                              char *err, size_t n) {
    int full = !strcmp(o->state_dict_type, "full"), bad = 0;
    DIR *d = opendir(dir);
    if (!d) return 0; /* check_save_dir made it, or names it */
    struct dirent *e;
    while (!bad && (e = readdir(d))) {
        char *end, p[4096];
        if (strncmp(e->d_name, "step-", 5)) continue;
        long st = strtol(e->d_name + 5, &end, 10);
        if (end == e->d_name + 5 || st <= start || st > steps || !saves_step(o, st, steps)) continue;
        ckpt_path(p, sizeof p, dir, st, full);
        if ((full ? fsdp_ckpt_check_full_target(ctx, p) : fsdp_ckpt_check_target(ctx, p)) != FSDP_OK)
            bad = snprintf(err, n, "--save-dir: this run saves step %ld as %s, and %s", st, p, fsdp_errmsg(ctx)) > 0;
    }
    closedir(d);
    return bad;
}

/* Whether DIR/.lock is absent or a lock file of ours: a regular file, empty
 * or one line "pid N on HOST" (a user's .lock is not rewritten). */
static int lock_ours(const char *lock) {
    struct stat sb;
    if (lstat(lock, &sb) != 0) return errno == ENOENT;
    if (!S_ISREG(sb.st_mode) || sb.st_size > 320) return 0;
    if (sb.st_size == 0) return 1;
    char line[322] = "";
    ssize_t r = read_head(lock, line, sizeof line - 1);
    if (r != sb.st_size || line[r - 1] != '\n' || strncmp(line, "pid ", 4)) return 0;
    char *p = line + 4;
    while (*p >= '0' && *p <= '9') p++;
    return p > line + 4 && !strncmp(p, " on ", 4) && strchr(p, '\n') == line + r - 1;
}

/* --save-full: a writable place (check_out_file), and a path the full-file
 * writer will replace: the check fsdp_model_save_full itself runs at the
 * end, so the two cannot disagree. */
static int check_save_full(struct fsdp_ctx *ctx, const char *path, char *err, size_t n) {
    if (check_out_file("--save-full", path, err, n)) return 1;
    if (fsdp_ckpt_check_full_target(ctx, path) != FSDP_OK)
        return snprintf(err, n, "--save-full: %s", fsdp_errmsg(ctx)), 1;
    return 0;
}

/* --save-dir: an existing writable folder, or one level to create; then its lock. */
static int check_save_dir(struct fsdp_ctx *ctx, const char *dir, const struct opts *o, long start, long steps,
                          char *err, size_t n) {
    struct stat sb;
    if (stat(dir, &sb) == 0) {
        if (!S_ISDIR(sb.st_mode)) return snprintf(err, n, "--save-dir '%s' exists and is not a folder", dir), 1;
        if (access(dir, W_OK | X_OK) != 0)
            return snprintf(err, n, "--save-dir '%s': cannot write in it: %s", dir, strerror(errno)), 1;
        if (fsdp_ckpt_is_ours(dir)) /* step-N and .lock inside a checkpoint, which its loader never reads */
            return snprintf(err, n, "--save-dir '%s' is itself a checkpoint (it holds meta.json): give the folder "
                            "its step-N checkpoints go in, e.g. the one holding it", dir), 1;
        if (check_save_steps(dir, start, err, n) || check_save_targets(ctx, dir, o, start, steps, err, n)) return 1;
    } else {
        char parent[4096];
        dir_of(dir, parent, sizeof parent);
        if (stat(parent, &sb) != 0 || !S_ISDIR(sb.st_mode))
            return snprintf(err, n, "--save-dir '%s': the folder '%s' does not exist", dir, parent), 1;
        if (mkdir(dir, 0755) != 0 && errno != EEXIST)
            return snprintf(err, n, "--save-dir: cannot create '%s': %s", dir, strerror(errno)), 1;
    }
    char lock[4096];
    snprintf(lock, sizeof lock, "%s/.lock", dir);
    if (!lock_ours(lock))
        return snprintf(err, n, "--save-dir '%s' holds '.lock', which fsdp-train did not write (it holds \"pid N on "
                        "HOST\" or nothing): give another --save-dir or move it away", dir), 1;
    int fd = open(lock, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
    if (fd < 0) return snprintf(err, n, "--save-dir: cannot open its lock file '%s': %s", lock, strerror(errno)), 1;
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        int e = errno;
        char who[64] = "";
        ssize_t r = pread(fd, who, sizeof who - 1, 0);
        who[r > 0 ? r : 0] = 0;
        who[strcspn(who, "\n")] = 0;
        close(fd);
        if (e == EWOULDBLOCK)
            return snprintf(err, n, "--save-dir '%s' is in use by another training job (%s, holding %s); give "
                            "another --save-dir or wait for it to end", dir, who[0] ? who : "pid unknown", lock), 1;
        return snprintf(err, n, "--save-dir: cannot lock '%s': %s", lock, strerror(e)), 1;
    }
    char host[256] = "?", line[320];
    gethostname(host, sizeof host - 1);
    host[sizeof host - 1] = 0;
    int len = snprintf(line, sizeof line, "pid %ld on %s\n", (long)getpid(), host);
    /* it informs another job, and the other ranks compare it (check_outputs): on their hosts too */
    if (ftruncate(fd, 0) != 0 || pwrite(fd, line, (size_t)len, 0) != len || fsync(fd) != 0) line[0] = 0;
    snprintf(g_lock_line, sizeof g_lock_line, "%s", line);
    g_lock_fd = fd;
    return 0;
}

/* Whether paths a and b name one file: the same inode where both exist (a
 * hard link, "./x" for "x"), else the same name in the same folder. */
static int same_file(const char *a, const char *b) {
    struct stat sa, sb;
    int ea = stat(a, &sa) == 0, eb = stat(b, &sb) == 0;
    if (ea || eb) return ea && eb && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
    char da[4096], db[4096];
    dir_of(a, da, sizeof da);
    dir_of(b, db, sizeof db);
    const char *na = strrchr(a, '/'), *nb = strrchr(b, '/');
    na = na ? na + 1 : a;
    nb = nb ? nb + 1 : b;
    return !strcmp(na, nb) && stat(da, &sa) == 0 && stat(db, &sb) == 0 && sa.st_dev == sb.st_dev &&
           sa.st_ino == sb.st_ino;
}

/* A file path in --save-dir under a name the checkpoints use (step-N, its
 * .tmp and .old, the .lock): a save or --keep-last would replace or remove
 * it, or the log would be written into the lock. */
static int in_ckpt_names(const char *path, const char *dir) {
    char pd[4096];
    dir_of(path, pd, sizeof pd);
    const char *name = strrchr(path, '/');
    name = name ? name + 1 : path;
    int ours = !strcmp(name, ".lock") || (!strncmp(name, "step-", 5) && name[5] >= '0' && name[5] <= '9');
    return ours && same_file(pd, dir);
}

/* The outputs apart, checked first: --log and --save-full as one file
 * passed each check alone, trained, then the save refused the log the run
 * had written, and the model was lost. */
static int check_outputs_apart(const struct opts *o, char *err, size_t n) {
    const char *flag[3] = {"--log", "--save-full", "--save-dir"};
    const char *path[3] = {o->log_path, o->save_full, o->save_dir};
    for (int i = 0; i < 3; i++)
        for (int j = i + 1; j < 3; j++)
            if (path[i] && path[j] && same_file(path[i], path[j]))
                return snprintf(err, n, "%s '%s' and %s '%s' are the same file; give each its own path", flag[i],
                                path[i], flag[j], path[j]), 1;
    for (int i = 0; i < 2 && o->save_dir; i++)
        if (path[i] && in_ckpt_names(path[i], o->save_dir))
            return snprintf(err, n, "%s '%s' is in --save-dir '%s' under a name its checkpoints use (step-N, "
                            ".lock); give another name or folder", flag[i], path[i], o->save_dir), 1;
    return 0;
}

/* Every rank: rank 0 checks --log, --save-full and --save-dir (and takes the
 * lock), and all ranks end alike on a failure. */
void check_outputs(struct fsdp_ctx *ctx, const struct opts *o, long start, long steps) {
    char err[8192] = "";
    int bad = 0;
    if (fsdp_ctx_rank(ctx) == 0) {
        bad = check_outputs_apart(o, err, sizeof err) ||
              (o->log_path && (check_log_file(o->log_path, err, sizeof err) ||
                               check_out_file("--log", o->log_path, err, sizeof err))) ||
              (o->save_full && check_save_full(ctx, o->save_full, err, sizeof err)) ||
              (o->save_dir && check_save_dir(ctx, o->save_dir, o, start, steps, err, sizeof err));
    }
    int32_t v = bad;
    if (fsdp_comm_broadcast(fsdp_ctx_comm(ctx), &v, 1, FSDP_I32, 0) != FSDP_OK) fail_rank("%s", fsdp_errmsg(ctx));
    if (v) fail_all("%s", err); /* rank 0 prints it */
    /* every rank writes its own file into --save-dir: on its host too it must be a folder it can write in
     * (checked by rank 0 alone, a run on hosts without a shared --save-dir trained to its end, then lost it) */
    if (o->save_dir && fsdp_ctx_world(ctx) > 1) {
        struct stat sb;
        int mine = 0;
        if (fsdp_ctx_rank(ctx) != 0 && (stat(o->save_dir, &sb) != 0 || !S_ISDIR(sb.st_mode)))
            mine = 1, snprintf(err, sizeof err, "--save-dir '%s' is not a folder on this rank's host (every rank writes "
                               "its file there: give a folder the ranks share)", o->save_dir);
        else if (fsdp_ctx_rank(ctx) != 0 && access(o->save_dir, W_OK | X_OK) != 0)
            mine = 1, snprintf(err, sizeof err, "--save-dir '%s': cannot write in it on this rank's host: %s",
                               o->save_dir, strerror(errno));
        agree_or_fail(mine, err);
        /* ... and the one rank 0 locked: a folder of the same name on each host's own disk passed the
         * checks above, then the first save failed (after --save-every steps of training) */
        char line[sizeof g_lock_line], seen[sizeof g_lock_line] = "";
        snprintf(line, sizeof line, "%s", g_lock_line);
        if (fsdp_comm_broadcast(fsdp_ctx_comm(ctx), line, sizeof line, FSDP_U8, 0) != FSDP_OK)
            fail_rank("%s", fsdp_errmsg(ctx));
        line[sizeof line - 1] = 0;
        char lock[4096];
        snprintf(lock, sizeof lock, "%s/.lock", o->save_dir);
        ssize_t r = fsdp_ctx_rank(ctx) != 0 && line[0] ? read_head(lock, seen, sizeof seen - 1) : 0;
        seen[r > 0 ? r : 0] = 0;
        mine = fsdp_ctx_rank(ctx) != 0 && line[0] && strcmp(seen, line);
        line[strcspn(line, "\n")] = 0;
        seen[strcspn(seen, "\n")] = 0;
        if (mine)
            snprintf(err, sizeof err, "--save-dir '%s' on this rank's host is not the folder rank 0 locked (its .lock "
                     "holds %s%s%s, rank 0 wrote \"%s\"): every rank writes its file there, so the ranks must share "
                     "one folder, on a file system all hosts see", o->save_dir, seen[0] ? "\"" : "nothing",
                     seen, seen[0] ? "\"" : "", line);
        agree_or_fail(mine, err);
    }
}
