/*
 * fsdp-train.c - the trainer: trains a GPT or an image classifier (the
 * tasks of train/task.h) with FULL_SHARD (ZeRO-3) or another strategy on the
 * ranks of an MPI job, or starts that job itself with --nproc N. This file
 * holds what every task shares: the step loop, logging, evaluation, the
 * summary and the error exits; train/prepare.c turns the flags into the
 * library's sharding and plans its memory, train/launch.c starts the job
 * under mpirun and watches the launcher, train/ckpt.c finds, saves and
 * prunes checkpoints and checks the output paths before step 1.
 * One of the programs in tools/, the only code that prints and exits.
 * Errors that every rank detects alike (flags, config, data) end the job
 * with one message from rank 0 and exit code 1 (2 for usage, and for an
 * image model's bad config or data: fail_input); an error on one rank
 * alone aborts the whole job so that no peer waits forever. A run stopped
 * early by SIGUSR1 exits 3 ([Note: stop on SIGUSR1]).
 *
 * [Note: stop on SIGUSR1] A batch system's warning before it preempts or
 * ends a job (Slurm's --signal=USR1@T; mpirun passes SIGUSR1 on to every
 * rank) makes the run stop at a step boundary with a checkpoint instead of
 * losing the steps since the last one: the handler only sets a flag; the
 * per-step all-reduce (the peak RSS's) carries it, so every rank sees it
 * after the same step, saves to --save-dir (when it has one and did not just
 * save) and ends with status 3 (not 0: the run did not reach --steps;
 * --resume, or the same command with --autoresume, continues it). Nothing
 * runs that belongs to the end of a run (--save-full, the task's final
 * evaluation).
 */
#include "fsdp.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#include "train/config.h"
#include "train/mfu.h"
#include "train/options.h"
#include "train/task.h"

/* ---- Run ---- */

static struct fsdp_ctx *g_ctx;

double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* This rank's communication between two snapshots of the statistics:
 * bytes contributed and seconds blocked in waits (= exposed communication),
 * per collective type, for the log and the summary. */
struct comm_delta {
    double wait_s[FSDP_COLL_COUNT], total_s;
    uint64_t bytes[FSDP_COLL_COUNT], total_bytes;
};

static void comm_delta_add(struct comm_delta *d, const struct fsdp_comm_stats *a,
                           const struct fsdp_comm_stats *b) {
    for (int k = 0; k < FSDP_COLL_COUNT; k++) {
        d->wait_s[k] += b->wait_s[k] - a->wait_s[k];
        d->bytes[k] += b->bytes[k] - a->bytes[k];
        d->total_s += b->wait_s[k] - a->wait_s[k];
        d->total_bytes += b->bytes[k] - a->bytes[k];
    }
}

static const char *const coll_names[FSDP_COLL_COUNT] = {"allgather", "reduce_scatter", "allreduce",
                                                        "broadcast", "barrier"};

/* [Note: setup agreement]
 * Setup reads files each host keeps its own copy of (--data, --val-data,
 * --model-config, --tokenizer, an image folder, a --resume folder): one rank
 * may fail where the others do not. A rank that exited alone left the others
 * in their next collective until the watchdog ended them (300 s), and its
 * message was printed only if it was rank 0. So from the context's creation
 * until the task has opened its data, an error exit (fail_all, fail_input)
 * first meets the other ranks in one all-gather of every rank's exit code (0:
 * none) and checkpoint step; the ranks without an error meet it in
 * setup_agree, called before setup's first collective, once the checkpoint
 * is read and after the task's open, with no other collective between. The lowest failing rank prints its
 * message (naming itself when some ranks did not fail), and every rank exits
 * with that rank's code; ranks that resumed different steps of one --resume
 * stop alike, naming them, and so do ranks that read different copies of the
 * data ([Note: the same data on every rank]). */
static int g_setup_open; /* inside the window above */
static const struct task *g_task; /* what this run trains */

#define TASK_INPUTS_MAX ((int)(sizeof g_task->inputs / sizeof g_task->inputs[0]))
#define MEET_N (2 + 2 * TASK_INPUTS_MAX) /* a meeting's record: code, resume step, the task's inputs */

/* Whether a rank's inputs differ from rank 0's in all (MEET_N per rank,
 * [Note: the same data on every rank]); if so, what to print into buf. */
static int inputs_differ(const int64_t *all, int world, char *buf, size_t n) {
    for (int i = 0; g_task && i < g_task->n_inputs; i++)
        for (int r = 1; r < world; r++) {
            const int64_t *a = all + 2 + 2 * i, *b = all + (size_t)r * MEET_N + 2 + 2 * i;
            if (a[0] == b[0] && a[1] == b[1]) continue;
            const struct task_input *in = &g_task->inputs[i];
            char how[160];
            if (a[0] != b[0])
                snprintf(how, sizeof how, "%lld %s on rank 0, %lld on rank %d", (long long)a[0], in->unit,
                         (long long)b[0], r);
            else
                snprintf(how, sizeof how, "%lld %s on rank 0 and on rank %d, but other contents", (long long)a[0],
                         in->unit, r);
            snprintf(buf, n, "%s '%s': the ranks do not read the same data (%s): every rank reads it whole and takes "
                     "its part of each batch, so every host needs the same copy", in->flag, in->name, how);
            return 1;
        }
    return 0;
}

static _Noreturn void setup_exit(int code) {
    g_setup_open = 0;
    fsdp_ctx_free(g_ctx);
    exit(code);
}

/* Collective over the world: code 0 (no error) or this rank's exit code and
 * message; resume_step: the --resume checkpoint's step, or -1; the task's
 * inputs so far. Returns only when no rank failed, every rank resumed the
 * same step and read the same data. */
static void setup_meet(int code, const char *msg, int64_t resume_step, const char *resume_dir) {
    int world = fsdp_ctx_world(g_ctx), rank = fsdp_ctx_rank(g_ctx);
    int64_t mine[MEET_N] = {code, resume_step}, *all = calloc((size_t)world * MEET_N, sizeof *all);
    for (int i = 0; g_task && i < g_task->n_inputs; i++) /* zeros until the task's open recorded them */
        mine[2 + 2 * i] = g_task->inputs[i].count, mine[3 + 2 * i] = g_task->inputs[i].crc;
    if (!all || fsdp_comm_allgather(fsdp_ctx_comm(g_ctx), mine, all, MEET_N, FSDP_I64) != FSDP_OK) {
        fprintf(stderr, "fsdp-train: rank %d: error: %s%s%s\n", rank, code ? msg : "", code ? "; then " : "",
                all ? fsdp_errmsg(g_ctx) : "out of memory agreeing on setup");
        fsdp_ctx_abort(g_ctx, code ? code : 1);
    }
    int first = -1, failed = 0, other = -1;
    for (int r = 0; r < world; r++) {
        if (all[(size_t)r * MEET_N]) failed++, first = first < 0 ? r : first;
        if (all[(size_t)r * MEET_N + 1] != all[1] && other < 0) other = r;
    }
    char differ[1024];
    int data = first < 0 && other < 0 && inputs_differ(all, world, differ, sizeof differ);
    if (first < 0 && other < 0 && !data) {
        free(all);
        return;
    }
    if (first >= 0) {
        int c = (int)all[(size_t)first * MEET_N];
        if (rank == first && failed == world) fprintf(stderr, "fsdp-train: error: %s\n", msg);
        else if (rank == first)
            fprintf(stderr, "fsdp-train: error: rank %d (%d of %d ranks failed here, the others did not): %s\n", rank,
                    failed, world, msg);
        free(all);
        setup_exit(c);
    }
    if (rank == 0 && data) fprintf(stderr, "fsdp-train: error: %s\n", differ);
    else if (rank == 0)
        fprintf(stderr, "fsdp-train: error: --resume %s: the ranks found different checkpoints there (step %lld on "
                "rank 0, step %lld on rank %d): give every rank the same checkpoint\n", resume_dir,
                (long long)all[1], (long long)all[(size_t)other * MEET_N + 1], other);
    free(all);
    setup_exit(data ? 1 : 2);
}

/* Where the ranks without an error meet ([Note: setup agreement]). */
static void setup_agree(int64_t resume_step, const char *resume_dir) {
    if (g_ctx && fsdp_ctx_world(g_ctx) > 1) setup_meet(0, NULL, resume_step, resume_dir);
}

void agree_or_fail(int code, const char *msg) {
    if (g_ctx && fsdp_ctx_world(g_ctx) > 1) setup_meet(code, msg, -1, NULL);
    else if (code) fail_all("%s", msg);
}

/* [Note: the same data on every rank]
 * Every rank reads a whole data file (or image set) and takes its part of
 * each global batch, so every host needs the same copy. A --val-data of
 * another size on one host gave it another number of evaluation batches:
 * the ranks ran different collectives at the first evaluation (Open MPI
 * aborted; shm named the collectives, not the file); a --data of another
 * size or contents trained on batches no one asked for, silently. So each
 * task's open records its inputs (a count, and a CRC-32 of three 1 MiB
 * samples of a file or of three images), the setup agreement's record
 * carries them (setup_meet: the last meeting follows the open), and a
 * difference ends every rank naming the flag, the file and both counts. */
static uint32_t crc_file_samples(const char *path, int64_t *size) {
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC); /* a FIFO put there since would not block */
    struct stat sb;
    uint32_t crc = 0;
    *size = 0;
    if (fd < 0 || fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        if (fd >= 0) close(fd);
        return 0;
    }
    *size = (int64_t)sb.st_size;
    static unsigned char buf[1 << 20];
    int64_t at[3] = {0, *size / 2, *size > (int64_t)sizeof buf ? *size - (int64_t)sizeof buf : 0};
    for (int k = 0; k < 3; k++) {
        ssize_t got = pread(fd, buf, sizeof buf, (off_t)at[k]);
        crc = (uint32_t)crc32(crc, buf, (uInt)(got > 0 ? got : 0));
    }
    close(fd);
    return crc;
}

static struct task_input *input_add(struct task *t, const char *flag, const char *name, const char *unit,
                                    int64_t count) {
    if (t->n_inputs == (int)(sizeof t->inputs / sizeof t->inputs[0])) return NULL;
    struct task_input *in = &t->inputs[t->n_inputs++];
    in->flag = flag;
    snprintf(in->name, sizeof in->name, "%s", name);
    in->unit = unit;
    in->count = count;
    in->crc = 0;
    return in;
}

void task_input_file(struct task *t, const char *flag, const char *path, const char *unit, int64_t count) {
    struct task_input *in = input_add(t, flag, path, unit, count);
    int64_t size;
    if (in) in->crc = crc_file_samples(path, &size) ^ (uint32_t)size ^ (uint32_t)((uint64_t)size >> 32);
}

void task_input_images(struct task *t, const char *flag, const char *name, const struct fsdp_images *im) {
    struct fsdp_images_info ii;
    fsdp_images_info(im, &ii);
    struct task_input *in = input_add(t, flag, name, "images", ii.count);
    if (!in || ii.count <= 0) return;
    int64_t pick[3] = {0, ii.count / 2, ii.count - 1};
    for (int k = 0; k < 3; k++) {
        int32_t y = fsdp_images_label(im, pick[k]);
        in->crc = (uint32_t)crc32(in->crc, fsdp_images_pixels(im, pick[k]),
                                  (uInt)((size_t)ii.height * (size_t)ii.width * (size_t)ii.channels));
        in->crc = (uint32_t)crc32(in->crc, (const unsigned char *)&y, sizeof y);
    }
}

/* An error every rank detects alike: rank 0 reports, all finish cleanly; in
 * setup, any rank's error ends every rank ([Note: setup agreement]). */
static _Noreturn void fail_all_v(int code, const char *fmt, va_list ap) {
    char msg[8192];
    vsnprintf(msg, sizeof msg, fmt, ap);
    if (g_setup_open && g_ctx && fsdp_ctx_world(g_ctx) > 1) setup_meet(code, msg, -1, NULL);
    if (!g_ctx || fsdp_ctx_rank(g_ctx) == 0) fprintf(stderr, "fsdp-train: error: %s\n", msg);
    fsdp_ctx_free(g_ctx);
    exit(code);
}

_Noreturn void fail_all(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fail_all_v(1, fmt, ap);
}

/* Bad input that every rank sees alike (an image model's config or data): exit 2. */
_Noreturn void fail_input(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fail_all_v(2, fmt, ap);
}


/* a double's every bit (17 digits): tests compare runs' logs for the same bits */
static const char *json_num(char *buf, size_t cap, double x) {
    if (isfinite(x)) snprintf(buf, cap, "%.17g", x);
    else snprintf(buf, cap, "null");
    return buf;
}

/* One line: the precision, and how many units gather / reduce / compute in what. */
static void precision_line(const struct opts *o, const struct fsdp_model *fm) {
    int n = fsdp_model_n_units(fm), lp_param = 0, lp_reduce = 0, fp32_units = 0;
    for (int i = 0; i < n; i++) {
        struct fsdp_unit_precision up;
        fsdp_model_unit_precision(fm, i, &up);
        lp_param += up.param_dtype != FSDP_F32;
        lp_reduce += up.reduce_dtype != FSDP_F32;
        fp32_units += up.compute_dtype == FSDP_F32;
    }
    if (!strcasecmp(o->precision, "FP32")) {
        printf("precision: FP32\n");
        return;
    }
    enum fsdp_dtype lp = !strcasecmp(o->precision, "AMP_FP16") ? FSDP_F16 : FSDP_BF16;
    printf("precision: %s, mixed_precision %s: %d of %d units gather in 16 bits, %d reduce in 16 bits, %d compute "
           "in fp32%s; %s products %s\n", precision_name(o), o->mixed_precision, lp_param, n, lp_reduce, fp32_units,
           lp == FSDP_F16 ? "; dynamic loss scaling" : "", fsdp_dtype_name(lp),
           fsdp_gemm_native(lp) ? "on the CPU's native kernels" : "widened to fp32 (no native kernels here)");
}

/* An error of this rank alone: report and end every rank. */
_Noreturn void fail_rank(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "fsdp-train: rank %d: error: ", g_ctx ? fsdp_ctx_rank(g_ctx) : 0);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    fsdp_ctx_abort(g_ctx, 1);
}

static void progress(int step, int steps, double loss, double ms, double tps, const char *item) {
    int width = 30, filled = steps ? (int)((double)width * step / steps) : width;
    char bar[64];
    for (int i = 0; i < width; i++) bar[i] = i < filled ? '=' : (i == filled ? '>' : ' ');
    bar[width] = 0;
    printf("\r[%s] step %d/%d  loss %.4f  %.0f ms/step  %.0f %s/s ", bar, step, steps, loss, ms, tps, item);
    fflush(stdout);
}

/* The learning rate of step `step` (0-based): the library's warmup and
 * cosine or constant schedule, or the step schedule: warmup as the others,
 * then lr x 0.1 for every --lr-steps milestone reached (torch's MultiStepLR). */
static float lr_at(const struct opts *o, const struct fsdp_lr_sched *s, int64_t step) {
    if (strcmp(o->schedule, "step") || step < s->warmup) return fsdp_lr_at(s, step);
    double lr = (double)o->lr;
    for (int i = 0; i < o->n_lr_steps; i++)
        if (step >= o->lr_steps[i]) lr *= 0.1;
    return (float)lr;
}

/* The run's task (TASK_*): --task, else the model (--model-config's "arch",
 * --model) or the checkpoint ck's (NULL: none). */
static int task_kind(const struct opts *o, const struct fsdp_ckpt_meta *ck) {
    if (o->task) return !strcmp(o->task, "swav") ? TASK_SWAV : !strcmp(o->task, "images") ? TASK_IMAGES : TASK_TOKENS;
    return task_is_images(o, ck) ? TASK_IMAGES : TASK_TOKENS;
}

static volatile sig_atomic_t g_stop_asked; /* [Note: stop on SIGUSR1] */
static void on_stop_signal(int sig) {
    (void)sig;
    g_stop_asked = 1;
}

int main(int argc, char **argv) {
    struct sigaction stop_sa = {0}; /* from the start: a SIGUSR1 during setup stops after the first step */
    stop_sa.sa_handler = on_stop_signal;
    stop_sa.sa_flags = SA_RESTART;
    sigemptyset(&stop_sa.sa_mask);
    sigaction(SIGUSR1, &stop_sa, NULL);
    struct opts o = opts_default();
    int cargc;
    char **cargv; /* --config's flags, then argv's */
    config_argv(argc, argv, &cargc, &cargv);
    parse_args(cargc, cargv, &o);
    char env_msg[768];
    if (fsdp_env_check(env_msg, sizeof env_msg) != FSDP_OK) fail_input("%s", env_msg);
    int under_mpi = getenv("OMPI_COMM_WORLD_SIZE") != NULL;
    /* the task is known before the launch unless a checkpoint names it: its flags
     * are checked here, so that a refused one is the one line, not the launcher's too */
    if (!o.resume && !o.autoresume) config_check_read(&o, task_kind(&o, NULL));
    if (o.nproc > 1 && !under_mpi && !o.dry_run) relaunch(argc, argv, o.nproc); /* a plan needs no ranks */
    if (under_mpi) launcher_watch_start();

    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.threads = o.threads;
    if (co.threads == 0) {
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        co.threads = (int)(cores / local_ranks());
        if (co.threads < 1) co.threads = 1;
    }
    co.verbose = o.verbose;
    co.comm = !strcmp(o.comm, "mpi") ? FSDP_COMM_MPI : !strcmp(o.comm, "self") ? FSDP_COMM_SELF
              : !strcmp(o.comm, "shm") ? FSDP_COMM_SHM : FSDP_COMM_AUTO;
    /* read by every MPI communicator at its creation (src/comm/mpi.c) */
    if (o.mpi_reduce) setenv("FSDP_MPI_REDUCE", o.mpi_reduce, 1);
    if (fsdp_ctx_create(&co, &g_ctx) != FSDP_OK) {
        fprintf(stderr, "fsdp-train: cannot start the communicator\n");
        return 1;
    }
    struct fsdp_ctx *ctx = g_ctx;
    g_setup_open = 1; /* [Note: setup agreement] */
    int rank = fsdp_ctx_rank(ctx), world = fsdp_ctx_world(ctx);
    fsdp_comm_set_timeout(fsdp_ctx_comm(ctx), o.collective_timeout);
    if (o.check_collectives) fsdp_comm_set_check(fsdp_ctx_comm(ctx), 1);
    if (o.nproc > 1 && world != o.nproc && !(o.dry_run && !under_mpi))
        fail_all("--nproc %d but the MPI world has %d ranks", o.nproc, world);
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    if (rank == 0 && cpus > 0 && o.threads > cpus)
        fprintf(stderr, "fsdp-train: warning: --threads %d is more than the %ld CPUs of this host: the threads will "
                "take turns on the cores (slower, same results)\n", o.threads, cpus);

    /* --autoresume: --save-dir's newest checkpoint, when it holds one, in
     * place of --resume and --init-from */
    char auto_buf[4096];
    if (o.autoresume) setup_agree(-1, NULL); /* its search agrees across the ranks: a collective */
    const char *auto_found = o.autoresume ? resolve_autoresume(ctx, &o, auto_buf, sizeof auto_buf) : NULL;
    int autoresumed = auto_found != NULL; /* resuming --save-dir's own newest checkpoint */
    if (autoresumed) o.resume = auto_found, o.init_from = NULL;

    /* --resume: meta.json first, for its model config */
    char resume_buf[4096];
    const char *resume_dir = NULL;
    struct fsdp_ckpt_meta ck = {0};
    if (o.resume) {
        struct stat rs;
        if (stat(o.resume, &rs) != 0) fail_all("--resume: '%s': %s", o.resume, strerror(errno));
        if (!(resume_dir = resolve_resume(o.resume, resume_buf, sizeof resume_buf)))
            fail_all("--resume: '%s' is neither a checkpoint (no meta.json) nor a folder holding step-N checkpoints",
                     o.resume);
        if (fsdp_ckpt_read_meta(ctx, resume_dir, &ck) != FSDP_OK) fail_all("--resume: %s", fsdp_errmsg(ctx));
        /* the schedule, optimizer, batch and precision flags from its train_config */
        int restored = config_resume(&o, cargc, cargv, ck.train_config, resume_dir);
        if (rank == 0 && restored)
            printf("resume: %d flags from %s's configuration (schedule, optimizer, batch, precision, data, evaluation); --override "
                   "FLAG takes one from the command line\n", restored, resume_dir);
    }

    /* the task and its model config: the flags, else the checkpoint's, else the default preset */
    struct task task;
    memset(&task, 0, sizeof task);
    g_task = &task;
    if (!o.task && resume_dir && strstr(ck.model_json, "\"task\":\"swav\"")) o.task = "swav"; /* the checkpoint's task */
    int kind = task_kind(&o, resume_dir ? &ck : NULL);
    config_check_read(&o, kind); /* [Note: flags a run does not read] */
    if (kind == TASK_SWAV) task_swav_create(ctx, &o, resume_dir ? &ck : NULL, resume_dir, &task);
    else if (kind == TASK_IMAGES) task_images_create(ctx, &o, resume_dir ? &ck : NULL, resume_dir, &task);
    else task_tokens_create(ctx, &o, resume_dir ? &ck : NULL, resume_dir, &task);
    int steps = task.steps;
    if (!strcmp(o.ac, "attn") && !task.ac_attn_type) fail_input("--ac attn: this model has no attention (give --ac blocks or every:K)");
    /* the world the run is for: a plan of --nproc ranks needs no launched ranks */
    int pworld = !under_mpi && o.dry_run && o.nproc > 1 ? o.nproc : world;
    if (o.batch % pworld != 0)
        fail_all("--batch %d (global) is not divisible by the world size %d", o.batch, pworld);
    check_strategy_flags(&o, pworld);

    /* --resume at or past the last step: nothing to train; --save-dir and --save-full
     * still write the loaded model (saving at another world size reshards) */
    /* the ranks resumed one step (else none may return here alone) */
    setup_agree(resume_dir ? ck.step : -1, resume_dir);
    int nothing_left = resume_dir && ck.step >= steps;
    if (nothing_left && rank == 0)
        printf("nothing left to train: %s is at step %lld and --steps is %d (give --steps above %lld and "
               "--override steps to train further)\n", resume_dir, (long long)ck.step, steps, (long long)ck.step);
    /* --autoresume loaded --save-dir's newest checkpoint: it does not save that again */
    if (nothing_left && !o.save_full && (!o.save_dir || autoresumed)) {
        task.ops->free(&task);
        fsdp_ctx_free(ctx);
        return 0;
    }

    /* --resume: the checkpoint's seed keys the data and sampling streams */
    if (resume_dir) {
        if (ck.step > 0 && ck.seed != o.seed) { /* a converted folder (step 0) carries no data position */
            if (rank == 0) printf("resume: using the checkpoint's seed %llu\n", (unsigned long long)ck.seed);
            o.seed = ck.seed;
        }
    }

    /* the resolved configuration ([Note: run configuration] in train/config.c) */
    char *cfg_json = config_json(&o);
    if (rank == 0) printf("config: %s\n", cfg_json);

    /* data and the model (shapes only), shards, optimizer */
    task.ops->open(&task, ctx, &o);
    setup_agree(-1, NULL); /* before the first collective */
    g_setup_open = 0;
    struct fsdp_module *root = task.root;
    /* MFU's peak: a short GEMM probe on every rank (or --peak-gflops), before
     * --mem-limit caps the allocator and before the model's memory exists */
    struct mfu_peak peak = {0};
    if (task.train_flops_per_item > 0 && !nothing_left && !o.dry_run) mfu_peak_measure(ctx, &o, 0.2, &peak);
    if (o.dry_run && o.net_gbps > 0 && rank == 0) scaleout_print(ctx, &o, root, &task, pworld);
    memory_plan(ctx, g_task, &o, root, pworld);
    check_outputs(ctx, &o, resume_dir ? (long)ck.step : 0, steps);
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    oo.kind = !strcmp(o.optim, "sgd") ? FSDP_OPTIM_SGD : !strcmp(o.optim, "lars") ? FSDP_OPTIM_LARS : FSDP_OPTIM_ADAMW;
    oo.trust_coefficient = o.lars_eta;
    oo.beta1 = o.beta1;
    oo.beta2 = o.beta2;
    oo.eps = o.eps;
    oo.momentum = o.momentum;
    oo.nesterov = o.nesterov;
    oo.weight_decay = o.weight_decay;
    oo.decay_all = o.decay_all;
    struct fsdp_optim *opt;
    if (fsdp_optim_create(ctx, &oo, &opt) != FSDP_OK) fail_all("%s", fsdp_errmsg(ctx));
    if (task.ops->prepare_optim) task.ops->prepare_optim(&task, ctx, &o, opt);
    struct fsdp_model *fm = prepare_model(ctx, g_task, &o, root, opt, resume_dir || o.init_from);
    int start_step = 0;
    if (resume_dir) {
        double t0 = now_s();
        if (fsdp_ckpt_load(ctx, fm, resume_dir, &ck) != FSDP_OK) fail_all("--resume: %s", fsdp_errmsg(ctx));
        start_step = (int)ck.step;
        if (rank == 0)
            printf("resumed from %s (saved at world %d): step %d, optimizer step %lld%s, %.2f s\n", resume_dir,
                   ck.world, start_step, (long long)ck.optim_step,
                   ck.has_optim_state ? "" : " (no optimizer state)", now_s() - t0);
        if (rank == 0 && ck.has_loss_scale && fsdp_model_loss_scale(fm) == ck.loss_scale)
            printf("resume: loss scale %g, %lld clean steps since its last change\n", ck.loss_scale,
                   (long long)ck.loss_scale_growth_tracker);
    } else if (o.init_from) {
        /* --init rank0 (load_monolith_rank0_only): rank 0 reads each unit and broadcasts it */
        int rank0 = !strcmp(o.init, "rank0");
        if (fsdp_model_load_weights(ctx, fm, o.init_from) != FSDP_OK) fail_all("--init-from: %s", fsdp_errmsg(ctx));
        if (rank == 0) printf("initial weights from %s%s\n", o.init_from, rank0 ? " (rank 0, sent unit by unit)" : "");
    }

    if (task.ops->after_shard) task.ops->after_shard(&task, ctx, &o, fm, opt);
    int64_t n_params = fsdp_module_numel(root);
    int64_t largest_unit = 0;
    for (int i = 0; i < fsdp_model_n_units(fm); i++) {
        struct fsdp_unit_info ui;
        fsdp_model_unit_info(fm, i, &ui);
        if (ui.numel_padded > largest_unit) largest_unit = ui.numel_padded;
        if (o.verbose && rank == 0)
            printf("unit %d '%s': %d params, %lld elements, %lld per rank\n", i, ui.fqn[0] ? ui.fqn : "(root)",
                   ui.n_params, (long long)ui.numel_full, (long long)ui.numel_shard);
    }
    if (rank == 0) {
        task.ops->describe_model(&task, ctx, &o, fm);
        printf("world %d (%s), %d threads per rank; batch %d %s; %d steps\n", world,
               fsdp_comm_backend(fsdp_ctx_comm(ctx)), co.threads, o.batch, task.batch_unit, steps);
        printf("sharding: %s", o.sharding);
        if (!strcasecmp(o.sharding, "HYBRID_SHARD") && o.shard_group)
            printf(" (groups of %d ranks, %d replicas)", o.shard_group, world / o.shard_group);
        else if (!strcasecmp(o.sharding, "HYBRID_SHARD"))
            printf(" (groups: the ranks of each host)");
        if (o.grad_accum > 1)
            printf("; %d micro-batches of %d %s per rank per step (%s)", o.grad_accum,
                   o.batch / world / o.grad_accum, task.batch_unit, o.accum_mode);
        printf("\n");
        precision_line(&o, fm);
        task.ops->describe_data(&task, ctx, &o, fm);
    }

    if (peak.flops > 0 && rank == 0) printf("MFU peak: %.1f GFLOP/s (%s)\n", peak.flops / 1e9, peak.how);

    FILE *logf = NULL;
    if (o.log_path && rank == 0 && !(logf = open_log(o.log_path, resume_dir != NULL)))
        fail_rank("--log: cannot open '%s': %s", o.log_path, strerror(errno));
    struct stat log_sb;
    if (logf && resume_dir && fstat(fileno(logf), &log_sb) == 0 && log_sb.st_size > 0)
        printf("--log: appending to %s after its earlier lines (the run resumed at step %d)\n", o.log_path, start_step);
    /* the run's first line ([Note: a log is replaced only by a log]) */
    if (logf) fprintf(logf, "{\"config\": %s}\n", cfg_json);
    log_flush(logf, o.log_path);
    free(cfg_json);

    struct fsdp_lr_sched sched = {!strcmp(o.schedule, "cosine") ? FSDP_LR_COSINE : FSDP_LR_CONSTANT, o.lr,
                                  o.min_lr, o.warmup, steps};
    const char *tty_env = getenv("FSDP_TRAIN_TTY");
    int tty = tty_env ? atoi(tty_env) : isatty(STDOUT_FILENO);
    double total_s = 0, first_loss = 0, last_loss = 0;
    struct eval_result ev = {NAN, NAN, 0};
    int timed = 0, skipped = 0, evaluated = 0, stopped = 0;
    struct comm_delta comm_total = {0}; /* over the timed steps (all but the first) */
    if (task.ops->before_train && task.ops->before_train(&task, ctx, fm, &o) != FSDP_OK)
        fail_rank("before the first step: %s", fsdp_errmsg(ctx));
    for (int step = start_step; step < steps; step++) {
        launcher_check();
        float lr = lr_at(&o, &sched, step);
        struct fsdp_step_result r;
        struct fsdp_comm_stats cs0, cs1;
        fsdp_model_comm_stats(fm, &cs0); /* all groups of the strategy */
        if (o.profile) fsdp_profile_enable(ctx, step > 0); /* the timed steps only */
        double t0 = now_s();
        enum fsdp_status st = task.ops->step(&task, ctx, fm, &o, step, lr, &r);
        double dt = now_s() - t0;
        if (o.profile) fsdp_profile_enable(ctx, 0); /* not the evaluation */
        fsdp_model_comm_stats(fm, &cs1);
        struct comm_delta cd = {0};
        comm_delta_add(&cd, &cs0, &cs1);
        if (st == FSDP_ERR_NUMERIC) fail_all("step %d: %s", step + 1, fsdp_errmsg(ctx)); /* every rank agrees */
        if (st != FSDP_OK) fail_rank("step %d: %s", step + 1, fsdp_errmsg(ctx));
        if (step > 0) { total_s += dt; timed++; comm_delta_add(&comm_total, &cs0, &cs1); }
        skipped += r.skipped;
        if (step == start_step) first_loss = r.loss;
        last_loss = r.loss;
        /* evaluation: every --eval-every steps and after the last */
        int do_eval = task.ops->eval && ((o.eval_every && (step + 1) % o.eval_every == 0) || step + 1 == steps);
        if (do_eval) {
            if (task.ops->eval(&task, ctx, fm, &o, &ev.loss, &ev.acc, &ev.count) != FSDP_OK)
                fail_rank("step %d: evaluation: %s", step + 1, fsdp_errmsg(ctx));
            evaluated = 1;
        }
        /* the peak RSS over the ranks, and whether one was asked to stop */
        float mine[2] = {(float)((double)fsdp_peak_rss_bytes() / 1048576.0), g_stop_asked ? 1.0f : 0.0f}, most[2];
        if (fsdp_comm_allreduce(fsdp_ctx_comm(ctx), mine, most, 2, FSDP_F32, FSDP_MAX) != FSDP_OK)
            fail_rank("%s", fsdp_errmsg(ctx));
        float rss_max = most[0];
        double tps = task.items_per_step / dt;
        if (rank == 0) {
            if (tty) progress(step + 1, steps, r.loss, dt * 1e3, tps, task.item);
            else
                printf("step %4d/%d  loss %.4f  lr %.2e  grad_norm %.4f  %.1f ms  %.0f %s/s%s\n", step + 1,
                       steps, r.loss, (double)lr, r.grad_norm, dt * 1e3, tps, task.item,
                       r.skipped ? "  SKIPPED (overflow; loss scale halved)" : "");
            if (do_eval) {
                if (tty) printf("\n");
                eval_print(&task, step + 1, steps, &ev);
            }
            if (logf) {
                char jl[32], jg[32]; /* a skipped step's norm is inf or nan: null in JSON */
                fprintf(logf,
                        "{\"step\": %d, \"loss\": %s, \"lr\": %.9g, \"grad_norm\": %s, \"param_norm\": %.17g, "
                        "\"step_ms\": %.3f, \"forward_ms\": %.3f, \"backward_ms\": %.3f, \"update_ms\": %.3f, "
                        "\"%s\": %.1f, \"peak_rss_mb\": %.1f, \"comm_ms\": %.3f, \"exposed_comm_ms\": %.3f, "
                        "\"comm_bytes\": %llu, "
                        "\"precision\": \"%s\", \"skipped\": %d, \"skipped_total\": %d, \"loss_scale\": %.9g, ",
                        step + 1, json_num(jl, sizeof jl, r.loss), (double)lr,
                        json_num(jg, sizeof jg, r.grad_norm), r.param_norm, dt * 1e3, r.forward_s * 1e3,
                        r.backward_s * 1e3, r.update_s * 1e3, task.item_json, tps, (double)rss_max, cd.total_s * 1e3,
                        r.comm_wait_s * 1e3, (unsigned long long)cd.total_bytes, precision_name(&o), r.skipped,
                        skipped, r.loss_scale);
                if (do_eval) eval_log(logf, &task, &ev);
                double mfu = mfu_of(&peak, tps * task.train_flops_per_item);
                if (!isnan(mfu)) fprintf(logf, "\"mfu\": %.6g, ", mfu);
                if (task.is_gpt) fprintf(logf, "\"tokens\": %.0f, ", (step + 1) * task.items_per_step);
                fputs(task.log_extra, logf);
                fprintf(logf, "\"comm\": {");
                for (int k = 0; k < FSDP_COLL_COUNT; k++)
                    fprintf(logf, "%s\"%s\": {\"ms\": %.3f, \"bytes\": %llu}", k ? ", " : "", coll_names[k],
                            cd.wait_s[k] * 1e3, (unsigned long long)cd.bytes[k]);
                fprintf(logf, "}}\n");
                log_flush(logf, o.log_path);
            }
        }
        int stop = most[1] > 0.0f && step + 1 < steps;
        if (o.save_dir && (saves_step(&o, step + 1, steps) || stop))
            save_ckpt(ctx, fm, &o, &task, step + 1, tty);
        if (stop) {
            if (tty && rank == 0) printf("\n");
            if (rank == 0)
                printf("stopping after step %d of %d on SIGUSR1: %s\n", step + 1, steps,
                       o.save_dir ? "--resume, or this command with --autoresume, continues from its checkpoint"
                                  : "nothing saved (no --save-dir)");
            stopped = 1;
            break;
        }
    }
    if (o.save_dir && nothing_left && !autoresumed) save_ckpt(ctx, fm, &o, &task, start_step, tty);
    if (tty && rank == 0 && !stopped) printf("\n");
    if (logf && fclose(logf) != 0) fail_rank("--log: writing '%s' failed: %s", o.log_path, strerror(errno));

    if (o.save_full && !stopped) {
        double t0 = now_s();
        if (fsdp_model_save_full(ctx, fm, o.save_full) != FSDP_OK) fail_all("--save-full: %s", fsdp_errmsg(ctx));
        if (rank == 0) printf("saved %s in %.2f s\n", o.save_full, now_s() - t0);
    }
    if (task.ops->finish && !nothing_left && !stopped) task.ops->finish(&task, ctx, fm, &o);

    float rss = (float)((double)fsdp_peak_rss_bytes() / 1048576.0), rss_max = rss;
    fsdp_comm_allreduce(fsdp_ctx_comm(ctx), &rss, &rss_max, 1, FSDP_F32, FSDP_MAX);
    /* the shared windows' pages count in every rank's RSS ([Note: shared window], src/fsdp/unit.c) */
    float shared = (float)((double)fsdp_shared_rss_bytes() / 1048576.0), shared_max = shared;
    fsdp_comm_allreduce(fsdp_ctx_comm(ctx), &shared, &shared_max, 1, FSDP_F32, FSDP_MAX);
    char rss_note[96] = "";
    if (world > 1 && shared_max >= 1.0f)
        snprintf(rss_note, sizeof rss_note, ", of which %.0f MB shared among the host's ranks", (double)shared_max);
    if (rank == 0 && !nothing_left && start_step >= steps) /* --steps 0: e.g. an evaluation only */
        printf("summary: no training steps (--steps %d) | peak RSS %.0f MB per rank%s\n", steps, (double)rss_max,
               rss_note);
    else if (rank == 0 && !nothing_left) {
        double tps = timed ? task.items_per_step * timed / total_s : 0;
        /* ZeRO-3: 16 bytes per parameter (param, grad, m, v) over the world,
         * plus a gathered unit's full parameters and gradients */
        double zero3 = (16.0 * (double)n_params / world + 8.0 * (double)largest_unit) / 1048576.0;
        char note[64] = "", flops[256] = "";
        task.ops->summary_note(&task, note, sizeof note);
        if (task.train_flops_per_item > 0) {
            double mfu = mfu_of(&peak, tps * task.train_flops_per_item);
            int k = snprintf(flops, sizeof flops, " | %.2f GFLOP/s model", tps * task.train_flops_per_item / 1e9);
            if (!isnan(mfu))
                snprintf(flops + k, sizeof flops - (size_t)k, " = %.1f%% MFU of %.1f GFLOP/s (%s)", 100.0 * mfu,
                         peak.flops / 1e9, peak.how);
        }
        printf("summary: loss %.4f -> %.4f%s | %.0f %s/s%s | peak RSS %.0f MB per rank%s "
               "(ZeRO-3 estimate for params+grads+AdamW: %.0f MB)\n",
               first_loss, last_loss, note, tps, task.is_gpt ? "tokens" : "images", flops, (double)rss_max, rss_note,
               zero3);
        if (evaluated) eval_summary(&task, &ev);
        printf("precision: %s | %d skipped steps | loss scale %g\n", precision_name(&o), skipped,
               fsdp_model_loss_scale(fm));
        /* exposed communication: time the compute thread sat in waits (rank 0) */
        printf("comm (%s, rank 0, %d timed steps): exposed comm %.1f ms/step = %.1f%% of step time",
               fsdp_comm_backend(fsdp_ctx_comm(ctx)), timed, timed ? comm_total.total_s * 1e3 / timed : 0.0,
               total_s > 0 ? 100.0 * comm_total.total_s / total_s : 0.0);
        for (int k = 0; k < FSDP_COLL_COUNT; k++)
            if (comm_total.bytes[k] || comm_total.wait_s[k] > 0)
                printf(" | %s %.1f MB/step, %.1f ms/step waited", coll_names[k],
                       timed ? (double)comm_total.bytes[k] / 1e6 / timed : 0.0,
                       timed ? comm_total.wait_s[k] * 1e3 / timed : 0.0);
        printf("\n");
        if (o.profile) {
            printf("time by module (rank 0, %d timed steps; self time less the children's, FSDP hooks apart):\n",
                   timed);
            fsdp_profile_print(ctx, stdout, timed);
        }
    }
    fsdp_model_free(fm);
    fsdp_optim_free(opt);
    fsdp_module_free(root);
    task.ops->free(&task);
    fsdp_ctx_free(ctx);
    config_release();
    return stopped ? 3 : 0;
}
