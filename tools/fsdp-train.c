/*
 * fsdp-train.c - the trainer: trains a GPT with FULL_SHARD (ZeRO-3) on the
 * ranks of an MPI job, or starts that job itself with --nproc N.
 * One of the programs in tools/, the only code that prints and exits.
 * Errors that every rank detects alike (flags, config, data) end the job
 * with one message from rank 0 and exit code 1 (2 for usage); an error on
 * one rank alone aborts the whole job so that no peer waits forever.
 */
#include "fsdp.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- Options ---- */

struct opts {
    const char *model, *model_config, *data, *log_path;
    int batch, seq, steps, warmup, threads, nproc, sample, verbose;
    float lr, min_lr, weight_decay, clip, beta1, beta2, eps, momentum;
    const char *schedule, *optim, *comm;
    int decay_all;
    int check_collectives;
    float collective_timeout;
    uint64_t seed;
    const char *save_dir, *resume, *init_from, *save_full; /* checkpoints */
    int save_every, keep_last;
    int dry_run;                /* --dry-run: print the memory plan and stop */
    const char *mem_limit;      /* --mem-limit SIZE per rank, or NULL */
    /* preparation (fsdp_parallelize_model) */
    const char *wrap, *ac, *init; /* --wrap, --ac, --init */
    int reshard_after_forward;    /* --reshard-after-forward on|off */
    const char *sharding;         /* --sharding FULL_SHARD | SHARD_GRAD_OP | NO_SHARD | HYBRID_SHARD */
    int shard_group;              /* --shard-group K (HYBRID_SHARD), 0 = the ranks of a host */
    int grad_accum;               /* --grad-accum K micro-batches per step */
    const char *accum_mode;       /* --accum-mode reduce | no_sync */
    int overlap, max_inflight;    /* --overlap on|off, --max-inflight N */
    /* mixed precision */
    const char *precision;        /* --precision FP32 | AMP_BF16 | AMP_FP16 */
    const char *mixed_precision;  /* --mixed-precision FULL | DEFAULT | PURE */
    double loss_scale_init;       /* --loss-scale-init (AMP_FP16) */
    int loss_scale_growth;        /* --loss-scale-growth-interval (AMP_FP16) */
};

#define MODEL_DEFAULT "small"

static struct opts opts_default(void) {
    struct opts o = {0};
    o.model = NULL; /* MODEL_DEFAULT, or the checkpoint's with --resume */
    o.data = "synthetic";
    o.batch = 8;
    o.seq = 64;
    o.steps = 50;
    o.warmup = 10;
    o.lr = 1e-3f;
    o.min_lr = -1.0f;
    o.weight_decay = 0.1f;
    o.clip = 1.0f;
    o.beta1 = 0.9f;
    o.beta2 = 0.95f;
    o.eps = 1e-8f;
    o.schedule = "cosine";
    o.optim = "adamw";
    o.comm = "auto";
    o.sample = 120;
    o.collective_timeout = 300;
    o.seed = 1337;
    o.wrap = "block";
    o.ac = "none";
    o.init = "deferred";
    o.reshard_after_forward = 1;
    o.sharding = "FULL_SHARD";
    o.grad_accum = 1;
    o.accum_mode = "reduce";
    o.overlap = 1;
    o.max_inflight = 2;
    o.precision = "FP32";
    o.mixed_precision = "DEFAULT";
    o.loss_scale_init = 65536;
    o.loss_scale_growth = 2000;
    return o;
}

static void usage(FILE *f) {
    struct opts d = opts_default();
    fprintf(f,
            "usage: fsdp-train [flags]\n"
            "Trains a GPT with fully sharded data parallelism (ZeRO-3).\n"
            "Run under `mpirun -np N`, or give --nproc N to start N local ranks.\n\n"
            "  --model NAME          preset: tiny small gpt2 gpt2-medium gpt2-large gpt2-xl (default %s;\n"
            "                        with --resume, the checkpoint's model, which model flags must match)\n"
            "  --model-config FILE   JSON {n_layer,n_head,n_embd,vocab_size,block_size}; overrides --model\n"
            "  --data PATH           token file (llm.c .bin with header, raw uint16 .bin) or any text\n"
            "                        file as bytes; 'synthetic' = built-in corpus (default %s)\n"
            "  --batch N             global batch in sequences, divisible by the world size (default %d)\n"
            "  --seq T               sequence length, <= block_size (default %d)\n"
            "  --steps N             training steps (default %d)\n"
            "  --lr X                peak learning rate (default %g)\n"
            "  --min-lr X            cosine floor (default lr/10)\n"
            "  --warmup N            linear warmup steps (default %d)\n"
            "  --lr-schedule S       cosine | constant (default %s)\n"
            "  --optim S             adamw | sgd (default %s)\n"
            "  --beta1 X             AdamW beta1 (default %g)\n"
            "  --beta2 X             AdamW beta2 (default %g)\n"
            "  --eps X               AdamW eps (default %g)\n"
            "  --momentum X          SGD momentum (default %g)\n"
            "  --weight-decay X      decoupled weight decay (default %g)\n"
            "  --decay-all           also decay biases, LayerNorm and embeddings (default off)\n"
            "  --clip X              clip the global gradient norm to X; 0 = off (default %g)\n"
            "  --seed N              init and sampling seed (default %llu)\n"
            "  --threads N           compute threads per rank; 0 = cores / local ranks (default 0)\n"
            "  --nproc N             start N ranks on this host (mpirun) (default 1)\n"
            "  --comm S              auto | mpi | shm | self: auto = shm for ranks all on one host,\n"
            "                        else mpi (default %s)\n"
            "  --collective-timeout S  a rank waiting on one collective longer than S seconds ends the\n"
            "                        job naming it (type, sequence number, bytes); 0 = never (default %g)\n"
            "  --check-collectives   compare each collective's sequence number and (type, count, dtype)\n"
            "                        across ranks first; report diverged ranks (default off)\n"
            "  --log FILE            one JSON object per step (default none)\n"
            "  --sample N            tokens to generate at the end for text data; 0 = none (default %d)\n"
            "  --save-dir DIR        save sharded checkpoints as DIR/step-NNNNNNNN (every --save-every\n"
            "                        steps and at the end)\n"
            "  --save-every K        steps between checkpoints; 0 = only at the end (default 0)\n"
            "  --keep-last K         keep the newest K checkpoints in --save-dir; 0 = all (default 0)\n"
            "  --resume DIR          continue from a checkpoint folder, or the newest one in a\n"
            "                        --save-dir (saved at any world size)\n"
            "  --save-full FILE      at the end, write the parameters as one safetensors file\n"
            "  --init-from FILE      initial weights from a safetensors file (ours, or Hugging Face\n"
            "                        GPT-2 model.safetensors)\n"
            "  --wrap P              units: block (one per Block) | size:N (a unit per module with\n"
            "                        >= N parameters not in a smaller unit) | none (default block)\n"
            "  --ac P                activation checkpointing: none | blocks | every:K (Blocks 0, K,\n"
            "                        2K, ...) | attn (each Block's attention only: its qkv, probabilities\n"
            "                        and heads' output are recomputed in backward) (default none)\n"
            "  --reshard-after-forward on|off  free a unit's gathered parameters after its forward\n"
            "                        (default on)\n"
            "  --sharding S          FULL_SHARD (ZeRO-3) | SHARD_GRAD_OP (ZeRO-2: parameters stay gathered\n"
            "                        from forward to backward) | NO_SHARD (DDP) | HYBRID_SHARD (shard in\n"
            "                        a group, replicate across groups) (default FULL_SHARD)\n"
            "  --shard-group K       HYBRID_SHARD's group size; must divide the world (default: the ranks\n"
            "                        of one host)\n"
            "  --grad-accum K        split each rank's share of --batch into K micro-batches per step\n"
            "                        (default 1)\n"
            "  --accum-mode M        reduce (reduce every micro-batch: less memory) | no_sync (keep\n"
            "                        unsharded gradients, reduce once: less communication) (default reduce)\n"
            "  --overlap on|off      prefetch the next units' all-gathers (forward and backward) and\n"
            "                        run reduce-scatters asynchronously; same results (default on)\n"
            "  --max-inflight N      units gathered or gathering at once, the computing one included;\n"
            "                        bounds the full buffers (default 2)\n"
            "  --init S              deferred (each rank initialises its shards; with --init-from each\n"
            "                        rank reads its own ranges) | rank0 (rank 0 reads --init-from and\n"
            "                        sends it unit by unit: sync_module_states) (default deferred)\n"
            "  --precision P         FP32 | AMP_BF16 | AMP_FP16 (Composer's names): the matrix products'\n"
            "                        inputs; LayerNorm, softmax, the loss, master weights, gradient shards\n"
            "                        and optimizer state stay fp32 (default FP32)\n"
            "  --mixed-precision M   with AMP_*: FULL (gather and reduce fp32) | DEFAULT (gather in the low\n"
            "                        dtype, reduce fp32) | PURE (both low) (default DEFAULT)\n"
            "  --loss-scale-init X   AMP_FP16 dynamic loss scaling: initial scale (default 65536; halved\n"
            "                        on overflow, the step skipped on every rank)\n"
            "  --loss-scale-growth-interval N  AMP_FP16: double the scale after N clean steps (default 2000)\n"
            "  --verbose             print the unit plan and debug information\n"
            "  --dry-run             print the memory plan per rank (shards, full buffers, activations)\n"
            "                        for this model, world (--nproc or the MPI world) and batch; no training\n"
            "  --mem-limit SIZE      per-rank memory limit, e.g. 1.5G: refuse a plan over it before any\n"
            "                        work, and stop the run if the library's allocations pass it (default none)\n"
            "  --help                this text\n",
            MODEL_DEFAULT, d.data, d.batch, d.seq, d.steps, (double)d.lr, d.warmup, d.schedule, d.optim,
            (double)d.beta1, (double)d.beta2, (double)d.eps, (double)d.momentum,
            (double)d.weight_decay, (double)d.clip, (unsigned long long)d.seed, d.comm,
            (double)d.collective_timeout, d.sample);
}

static int rank_env(void) {
    const char *r = getenv("OMPI_COMM_WORLD_RANK");
    return r ? atoi(r) : 0;
}

/* Usage errors happen before MPI starts; every rank sees the same argv. */
static _Noreturn void usage_error(const char *fmt, ...) {
    if (rank_env() == 0) {
        va_list ap;
        va_start(ap, fmt);
        fprintf(stderr, "fsdp-train: ");
        vfprintf(stderr, fmt, ap);
        fprintf(stderr, "\n(see fsdp-train --help)\n");
        va_end(ap);
    }
    exit(2);
}

static long parse_int(const char *flag, const char *v, long lo, long hi) {
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || *end || end == v || x < lo || x > hi)
        usage_error("%s: '%s' is not an integer in [%ld, %ld]", flag, v, lo, hi);
    return x;
}

static float parse_float(const char *flag, const char *v, double lo, double hi) {
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (errno || *end || end == v || !(x >= lo && x <= hi))
        usage_error("%s: '%s' is not a number in [%g, %g]", flag, v, lo, hi);
    return (float)x;
}

static void parse_args(int argc, char **argv, struct opts *o) {
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            if (rank_env() == 0) usage(stdout);
            exit(0);
        }
        if (!strcmp(a, "--verbose")) { o->verbose = 1; continue; }
        if (!strcmp(a, "--decay-all")) { o->decay_all = 1; continue; }
        if (!strcmp(a, "--check-collectives")) { o->check_collectives = 1; continue; }
        if (!strcmp(a, "--dry-run")) { o->dry_run = 1; continue; }
        if (strncmp(a, "--", 2) != 0) usage_error("unexpected argument '%s'", a);
        if (i + 1 >= argc) usage_error("%s needs a value", a);
        const char *v = argv[++i];
        if (!strcmp(a, "--model")) o->model = v;
        else if (!strcmp(a, "--model-config")) o->model_config = v;
        else if (!strcmp(a, "--data")) o->data = v;
        else if (!strcmp(a, "--log")) o->log_path = v;
        else if (!strcmp(a, "--mem-limit")) o->mem_limit = v;
        else if (!strcmp(a, "--save-dir")) o->save_dir = v;
        else if (!strcmp(a, "--resume")) o->resume = v;
        else if (!strcmp(a, "--init-from")) o->init_from = v;
        else if (!strcmp(a, "--save-full")) o->save_full = v;
        else if (!strcmp(a, "--wrap")) {
            o->wrap = v;
            if (strcmp(v, "block") && strcmp(v, "none") &&
                (strncmp(v, "size:", 5) || parse_int(a, v + 5, 1, 0x7fffffffL) < 1))
                usage_error("--wrap: '%s' is not block, size:N or none", v);
        } else if (!strcmp(a, "--ac")) {
            o->ac = v;
            if (strcmp(v, "none") && strcmp(v, "blocks") && strcmp(v, "attn") &&
                (strncmp(v, "every:", 6) || parse_int(a, v + 6, 1, 1 << 20) < 1))
                usage_error("--ac: '%s' is not none, blocks, every:K or attn", v);
        } else if (!strcmp(a, "--reshard-after-forward")) {
            if (strcmp(v, "on") && strcmp(v, "off")) usage_error("--reshard-after-forward: '%s' is not on or off", v);
            o->reshard_after_forward = !strcmp(v, "on");
        } else if (!strcmp(a, "--sharding")) {
            if (strcasecmp(v, "FULL_SHARD") && strcasecmp(v, "SHARD_GRAD_OP") && strcasecmp(v, "NO_SHARD") &&
                strcasecmp(v, "HYBRID_SHARD"))
                usage_error("--sharding: '%s' is not FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD", v);
            o->sharding = v;
        } else if (!strcmp(a, "--shard-group")) {
            o->shard_group = (int)parse_int(a, v, 1, 1 << 20);
        } else if (!strcmp(a, "--grad-accum")) {
            o->grad_accum = (int)parse_int(a, v, 1, 1 << 20);
        } else if (!strcmp(a, "--overlap")) {
            if (strcmp(v, "on") && strcmp(v, "off")) usage_error("--overlap: '%s' is not on or off", v);
            o->overlap = !strcmp(v, "on");
        } else if (!strcmp(a, "--max-inflight")) {
            o->max_inflight = (int)parse_int(a, v, 1, 1 << 20);
        } else if (!strcmp(a, "--accum-mode")) {
            if (strcmp(v, "reduce") && strcmp(v, "no_sync"))
                usage_error("--accum-mode: '%s' is not reduce or no_sync", v);
            o->accum_mode = v;
        } else if (!strcmp(a, "--precision")) {
            if (strcasecmp(v, "FP32") && strcasecmp(v, "AMP_BF16") && strcasecmp(v, "AMP_FP16"))
                usage_error("--precision: '%s' is not FP32, AMP_BF16 or AMP_FP16", v);
            o->precision = v;
        } else if (!strcmp(a, "--mixed-precision")) {
            if (strcasecmp(v, "FULL") && strcasecmp(v, "DEFAULT") && strcasecmp(v, "PURE"))
                usage_error("--mixed-precision: '%s' is not FULL, DEFAULT or PURE", v);
            o->mixed_precision = v;
        } else if (!strcmp(a, "--loss-scale-init")) {
            o->loss_scale_init = parse_float(a, v, 1e-30, 1e30);
        } else if (!strcmp(a, "--loss-scale-growth-interval")) {
            o->loss_scale_growth = (int)parse_int(a, v, 1, 1 << 30);
        } else if (!strcmp(a, "--init")) {
            if (strcmp(v, "deferred") && strcmp(v, "rank0")) usage_error("--init: '%s' is not deferred or rank0", v);
            o->init = v;
        }
        else if (!strcmp(a, "--save-every")) o->save_every = (int)parse_int(a, v, 0, 1 << 30);
        else if (!strcmp(a, "--keep-last")) o->keep_last = (int)parse_int(a, v, 0, 1 << 20);
        else if (!strcmp(a, "--batch")) o->batch = (int)parse_int(a, v, 1, 1 << 20);
        else if (!strcmp(a, "--seq")) o->seq = (int)parse_int(a, v, 1, 1 << 20);
        else if (!strcmp(a, "--steps")) o->steps = (int)parse_int(a, v, 0, 1 << 30);
        else if (!strcmp(a, "--warmup")) o->warmup = (int)parse_int(a, v, 0, 1 << 30);
        else if (!strcmp(a, "--threads")) o->threads = (int)parse_int(a, v, 0, 4096);
        else if (!strcmp(a, "--nproc")) o->nproc = (int)parse_int(a, v, 1, 4096);
        else if (!strcmp(a, "--sample")) o->sample = (int)parse_int(a, v, 0, 1 << 20);
        else if (!strcmp(a, "--collective-timeout")) o->collective_timeout = parse_float(a, v, 0, 1e7);
        else if (!strcmp(a, "--seed")) o->seed = (uint64_t)parse_int(a, v, 0, 0x7fffffffL);
        else if (!strcmp(a, "--lr")) o->lr = parse_float(a, v, 0, 10);
        else if (!strcmp(a, "--min-lr")) o->min_lr = parse_float(a, v, 0, 10);
        else if (!strcmp(a, "--weight-decay")) o->weight_decay = parse_float(a, v, 0, 10);
        else if (!strcmp(a, "--clip")) o->clip = parse_float(a, v, 0, 1e9);
        else if (!strcmp(a, "--beta1")) o->beta1 = parse_float(a, v, 0, 0.999999);
        else if (!strcmp(a, "--beta2")) o->beta2 = parse_float(a, v, 0, 0.999999);
        else if (!strcmp(a, "--eps")) o->eps = parse_float(a, v, 1e-30, 1);
        else if (!strcmp(a, "--momentum")) o->momentum = parse_float(a, v, 0, 0.999999);
        else if (!strcmp(a, "--lr-schedule")) {
            if (strcmp(v, "cosine") && strcmp(v, "constant"))
                usage_error("--lr-schedule: '%s' is not cosine or constant", v);
            o->schedule = v;
        } else if (!strcmp(a, "--optim")) {
            if (strcmp(v, "adamw") && strcmp(v, "sgd")) usage_error("--optim: '%s' is not adamw or sgd", v);
            o->optim = v;
        } else if (!strcmp(a, "--comm")) {
            if (strcmp(v, "auto") && strcmp(v, "mpi") && strcmp(v, "shm") && strcmp(v, "self"))
                usage_error("--comm: '%s' is not auto, mpi, shm or self", v);
            o->comm = v;
        } else usage_error("unknown flag '%s'", a);
    }
    if (o->min_lr < 0) o->min_lr = o->lr / 10;
    if (o->resume && o->init_from) usage_error("--resume and --init-from exclude each other");
    if (!strcmp(o->init, "rank0") && !o->init_from)
        usage_error("--init rank0 needs --init-from FILE (the weights rank 0 reads and sends)");
    if ((o->save_every || o->keep_last) && !o->save_dir) usage_error("--save-every and --keep-last need --save-dir");
}

/* --nproc N without mpirun: re-run this program under mpirun. */
static void relaunch(int argc, char **argv, int nproc) {
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) usage_error("--nproc: cannot find this program's path");
    exe[n] = 0;
    char np[16];
    snprintf(np, sizeof np, "%d", nproc);
    char **args = calloc((size_t)argc + 16, sizeof *args);
    int k = 0;
    args[k++] = "mpirun";
    args[k++] = "-np";
    args[k++] = np;
    args[k++] = "--oversubscribe";
    args[k++] = "--bind-to";
    args[k++] = "none";
    args[k++] = exe;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--nproc")) { i++; continue; }
        args[k++] = argv[i];
    }
    args[k] = NULL;
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 0);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 0);
    /* single-copy via ptrace is often denied in containers */
    setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", 0);
    /* mpirun gives ranks a pty: pass on whether our stdout is a terminal */
    setenv("FSDP_TRAIN_TTY", isatty(STDOUT_FILENO) ? "1" : "0", 1);
    fflush(NULL);
    execvp("mpirun", args);
    fprintf(stderr, "fsdp-train: --nproc %d: cannot run mpirun: %s (install openmpi-bin)\n", nproc,
            strerror(errno));
    exit(1);
}

/* ---- Checkpoint folders: DIR/step-NNNNNNNN, each complete only with meta.json ---- */

/* The step numbers of the complete checkpoints in dir, ascending; returns the count. */
static int list_ckpts(const char *dir, long **steps) {
    *steps = NULL;
    DIR *d = opendir(dir);
    if (!d) return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        char *end;
        if (strncmp(e->d_name, "step-", 5)) continue;
        long st = strtol(e->d_name + 5, &end, 10);
        if (*end || end == e->d_name + 5) continue; /* skips step-N.tmp and step-N.old */
        char meta[4096];
        struct stat sb;
        snprintf(meta, sizeof meta, "%s/%s/meta.json", dir, e->d_name);
        if (stat(meta, &sb) != 0) continue;
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

static void ckpt_path(char *buf, size_t n, const char *dir, long step) {
    snprintf(buf, n, "%s/step-%08ld", dir, step);
}

/* --resume DIR: DIR itself if it holds meta.json, else its newest checkpoint. */
static const char *resolve_resume(const char *dir, char *buf, size_t n) {
    struct stat sb;
    snprintf(buf, n, "%s/meta.json", dir);
    if (stat(buf, &sb) == 0) {
        snprintf(buf, n, "%s", dir);
        return buf;
    }
    long *steps;
    int k = list_ckpts(dir, &steps);
    if (k == 0) {
        free(steps);
        return NULL;
    }
    ckpt_path(buf, n, dir, steps[k - 1]);
    free(steps);
    return buf;
}

static void remove_ckpt(const char *path) {
    DIR *d = opendir(path);
    if (!d) return;
    struct dirent *e;
    char f[4096];
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        if (snprintf(f, sizeof f, "%s/%s", path, e->d_name) < (int)sizeof f) unlink(f);
    }
    closedir(d);
    rmdir(path);
}

/* Keeps the newest `keep` checkpoints of dir (rank 0 only). */
static void prune_ckpts(const char *dir, int keep) {
    long *steps;
    int k = list_ckpts(dir, &steps);
    for (int i = 0; i + keep < k; i++) {
        char p[4096];
        ckpt_path(p, sizeof p, dir, steps[i]);
        remove_ckpt(p);
    }
    free(steps);
}

/* ---- Run ---- */

static struct fsdp_ctx *g_ctx;

static double now_s(void) {
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

/* An error every rank detects alike: rank 0 reports, all finish cleanly. */
static _Noreturn void fail_all(const char *fmt, ...) {
    if (!g_ctx || fsdp_ctx_rank(g_ctx) == 0) {
        va_list ap;
        va_start(ap, fmt);
        fprintf(stderr, "fsdp-train: error: ");
        vfprintf(stderr, fmt, ap);
        fprintf(stderr, "\n");
        va_end(ap);
    }
    fsdp_ctx_free(g_ctx);
    exit(1);
}

/* ---- Preparation: --wrap, --ac, --reshard-after-forward, --init ---- */

/* The module type --ac checkpoints: "CausalSelfAttention" for attn, else "Block". */
static const char *ac_type(const struct opts *o) { return !strcmp(o->ac, "attn") ? "CausalSelfAttention" : "Block"; }

/* --ac every:K: Blocks whose index in transformer.h is a multiple of K. */
static int ac_every(struct fsdp_module *m, void *ud) {
    if (strcmp(m->ops->type, "Block")) return 0;
    return atoi(m->name) % *(const int *)ud == 0;
}

/* --sharding, --shard-group and --grad-accum against the world: every rank
 * computes the same verdict. */
static void check_strategy_flags(const struct opts *o, int world) {
    int hybrid = !strcasecmp(o->sharding, "HYBRID_SHARD");
    if (o->shard_group && !hybrid)
        fail_all("--shard-group %d needs --sharding HYBRID_SHARD (not %s)", o->shard_group, o->sharding);
    if (o->shard_group && world % o->shard_group != 0)
        fail_all("--shard-group %d does not divide the world of %d ranks", o->shard_group, world);
    if ((o->batch / world) % o->grad_accum != 0)
        fail_all("--grad-accum %d does not divide the per-rank batch of %d sequences (--batch %d over %d ranks)",
                 o->grad_accum, o->batch / world, o->batch, world);
}

static struct fsdp_model *prepare_model(struct fsdp_ctx *ctx, const struct opts *o, struct fsdp_module *gpt,
                                        struct fsdp_optim *opt) {
    struct fsdp_parallel_config pc = fsdp_parallel_config_default();
    pc.reshard_after_forward = o->reshard_after_forward;
    pc.verbose = o->verbose;
    pc.seed = o->seed;
    fsdp_sharding_parse(ctx, o->sharding, &pc.sharding); /* validated with the flags */
    pc.overlap = o->overlap;
    pc.max_inflight = o->max_inflight;
    if (o->shard_group) { /* a 2-D mesh {replicas, shard group}; divides the world (checked) */
        pc.mesh[0] = fsdp_ctx_world(ctx) / o->shard_group;
        pc.mesh[1] = o->shard_group;
    }
    static int64_t min_size;
    static int every;
    struct fsdp_wrap_policy wp = {fsdp_wrap_by_type, (void *)"Block"};
    if (!strcmp(o->wrap, "none")) wp.fn = NULL;
    else if (!strncmp(o->wrap, "size:", 5)) {
        min_size = atol(o->wrap + 5);
        wp.fn = fsdp_wrap_by_size;
        wp.ud = &min_size;
    }
    struct fsdp_ac_check ac = {fsdp_ac_by_type, (void *)ac_type(o)}, *acp = NULL;
    if (strcmp(o->ac, "none")) {
        pc.activation_checkpointing = 1;
        acp = &ac;
        if (!strncmp(o->ac, "every:", 6)) {
            every = atoi(o->ac + 6);
            ac.fn = ac_every;
            ac.ud = &every;
        }
    }
    enum fsdp_dtype prec;
    if (fsdp_precision_parse(ctx, o->precision, &prec) != FSDP_OK) fail_all("--precision: %s", fsdp_errmsg(ctx));
    pc.mixed_precision = !strcasecmp(o->mixed_precision, "FULL")   ? FSDP_MP_FULL
                         : !strcasecmp(o->mixed_precision, "PURE") ? FSDP_MP_PURE
                                                                   : FSDP_MP_DEFAULT;
    struct fsdp_model *fm;
    if (fsdp_parallelize_model(ctx, gpt, &pc, opt, prec, &wp, acp, NULL, &fm) != FSDP_OK)
        fail_all("%s", fsdp_errmsg(ctx));
    if (prec == FSDP_F16) {
        struct fsdp_loss_scale_opts lo = fsdp_loss_scale_opts_default();
        lo.enabled = 1;
        lo.init_scale = o->loss_scale_init;
        lo.growth_interval = o->loss_scale_growth;
        if (fsdp_model_set_loss_scale(ctx, fm, &lo) != FSDP_OK) fail_all("--loss-scale-*: %s", fsdp_errmsg(ctx));
    }
    return fm;
}

static const char *json_num(char *buf, size_t cap, double x) {
    if (isfinite(x)) snprintf(buf, cap, "%.9g", x);
    else snprintf(buf, cap, "null");
    return buf;
}

/* --precision as Composer spells it. */
static const char *precision_name(const struct opts *o) {
    return !strcasecmp(o->precision, "AMP_BF16") ? "AMP_BF16" : !strcasecmp(o->precision, "AMP_FP16") ? "AMP_FP16"
                                                                                                  : "FP32";
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
static _Noreturn void fail_rank(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "fsdp-train: rank %d: error: ", g_ctx ? fsdp_ctx_rank(g_ctx) : 0);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    fsdp_ctx_abort(g_ctx, 1);
}

static int local_ranks(void) {
    const char *s = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    return s && atoi(s) > 0 ? atoi(s) : 1;
}

static void progress(int step, int steps, double loss, double ms, double tps) {
    int width = 30, filled = steps ? (int)((double)width * step / steps) : width;
    char bar[64];
    for (int i = 0; i < width; i++) bar[i] = i < filled ? '=' : (i == filled ? '>' : ' ');
    bar[width] = 0;
    printf("\r[%s] step %d/%d  loss %.4f  %.0f ms/step  %.0f tok/s ", bar, step, steps, loss, ms, tps);
    fflush(stdout);
}

/* Saves DIR/step-N (every rank), then keeps the newest --keep-last. */
static void save_ckpt(struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct opts *o,
                      const struct fsdp_gpt_config *cfg, int step, int tty) {
    int rank = fsdp_ctx_rank(ctx);
    char path[4096];
    ckpt_path(path, sizeof path, o->save_dir, step);
    if (rank == 0 && mkdir(o->save_dir, 0755) != 0 && errno != EEXIST)
        fail_rank("--save-dir: cannot create '%s': %s", o->save_dir, strerror(errno));
    struct fsdp_ckpt_meta m = {0};
    m.step = m.data_step = step;
    m.seed = o->seed;
    m.has_config = 1;
    m.config = *cfg;
    double t0 = now_s();
    /* the barrier: nobody writes into --save-dir before rank 0 made it */
    if (fsdp_comm_barrier(fsdp_ctx_comm(ctx)) != FSDP_OK || fsdp_ckpt_save(ctx, fm, path, &m) != FSDP_OK)
        fail_all("saving %s: %s", path, fsdp_errmsg(ctx));
    if (rank == 0) {
        if (o->keep_last) prune_ckpts(o->save_dir, o->keep_last);
        if (!tty) printf("saved %s in %.2f s\n", path, now_s() - t0);
    }
}

/* Generates n tokens after a newline, temperature 1 sampling with the counter
 * RNG on rank 0, broadcast so every rank feeds the same context. */
static void generate(struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct fsdp_gpt_config *cfg,
                     int n, uint64_t seed) {
    int T = cfg->block_size;
    int32_t *ctxbuf = calloc((size_t)T, sizeof(int32_t));
    char *text = calloc((size_t)n + 1, 1);
    int len = 1, out = 0;
    ctxbuf[0] = '\n';
    for (int i = 0; i < n; i++) {
        float *logits;
        int t0 = len > T ? len - T : 0, tl = len - t0;
        int32_t *window = calloc((size_t)tl, sizeof(int32_t));
        for (int j = 0; j < tl; j++) window[j] = ctxbuf[(t0 + j) % T];
        if (fsdp_model_forward(ctx, fm, window, 1, tl, &logits) != FSDP_OK)
            fail_rank("sampling: %s", fsdp_errmsg(ctx));
        free(window);
        int32_t next = 0;
        if (fsdp_ctx_rank(ctx) == 0) {
            const float *l = logits + (size_t)(tl - 1) * (size_t)cfg->vocab_size;
            double mx = l[0], z = 0;
            for (int v = 1; v < cfg->vocab_size; v++) mx = l[v] > mx ? l[v] : mx;
            for (int v = 0; v < cfg->vocab_size; v++) z += exp(l[v] - mx);
            /* a deterministic uniform from the seed and position */
            double u = (double)((seed * 6364136223846793005ull + (uint64_t)i * 1442695040888963407ull) >> 11) /
                       9007199254740992.0 * z;
            for (next = 0; next < cfg->vocab_size - 1; next++) {
                u -= exp(l[next] - mx);
                if (u <= 0) break;
            }
        }
        if (fsdp_comm_broadcast(fsdp_ctx_comm(ctx), &next, 1, FSDP_I32, 0) != FSDP_OK)
            fail_rank("sampling broadcast: %s", fsdp_errmsg(ctx));
        ctxbuf[len % T] = next;
        len++;
        text[out++] = (char)(next >= 32 && next < 127 ? next : next == '\n' ? '\n' : '?');
    }
    if (fsdp_ctx_rank(ctx) == 0) printf("--- sample ---\n%s\n--------------\n", text);
    free(ctxbuf);
    free(text);
}

/* ---- Memory plan (--dry-run, --mem-limit) ---- */

static void mib(char *buf, size_t cap, size_t bytes) {
    snprintf(buf, cap, "%.1f MiB", (double)bytes / 1048576.0);
}

/* Sets (on) or clears the checkpoint flag of the modules --ac selects below m. */
static void plan_mark_ac(struct fsdp_module *m, const struct opts *o, int on) {
    static int every;
    for (int i = 0; i < m->n_children; i++) {
        struct fsdp_module *c = m->children[i];
        if (strcmp(o->ac, "none") != 0) {
            every = !strncmp(o->ac, "every:", 6) ? atoi(o->ac + 6) : 0;
            int sel = every > 0 ? ac_every(c, &every) : fsdp_ac_by_type(c, (void *)ac_type(o));
            if (sel) c->checkpoint = on;
        }
        plan_mark_ac(c, o, on);
    }
}

/* Plans the run for `pworld` ranks: --dry-run prints the plan per rank and
 * exits; --mem-limit refuses a plan over the limit before any work, then
 * hands the limit to the library's allocator. Every rank computes the same. */
static void memory_plan(struct fsdp_ctx *ctx, const struct opts *o, struct fsdp_module *gpt, int pworld) {
    if (!o->dry_run && !o->mem_limit) return;
    size_t limit = 0;
    if (o->mem_limit && fsdp_mem_parse_size(ctx, o->mem_limit, &limit) != FSDP_OK)
        fail_all("--mem-limit: %s", fsdp_errmsg(ctx));
    if (o->batch % pworld != 0)
        fail_all("--batch %d (global) is not divisible by the world size %d", o->batch, pworld);
    int k = !strcmp(o->optim, "sgd") ? (o->momentum > 0 ? 1 : 0) : 2;
    int threads = o->threads;
    if (threads == 0) {
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        threads = pworld > 1 && !getenv("OMPI_COMM_WORLD_SIZE") ? (int)(cores / pworld) : (int)(cores / local_ranks());
        if (threads < 1) threads = 1;
    }
    /* the units and checkpointing prepare_model will ask fsdp_parallelize_model for */
    struct fsdp_shard_opts so = fsdp_shard_opts_default();
    so.reshard_after_forward = o->reshard_after_forward;
    fsdp_sharding_parse(ctx, o->sharding, &so.sharding);
    so.shard_group = o->shard_group;
    so.overlap = o->overlap;
    so.max_inflight = o->max_inflight;
    if (fsdp_precision_parse(ctx, o->precision, &so.precision) != FSDP_OK)
        fail_all("--precision: %s", fsdp_errmsg(ctx));
    so.mixed_precision = !strcasecmp(o->mixed_precision, "FULL")   ? FSDP_MP_FULL
                         : !strcasecmp(o->mixed_precision, "PURE") ? FSDP_MP_PURE
                                                                   : FSDP_MP_DEFAULT;
    check_strategy_flags(o, pworld);
    static int64_t min_size;
    if (!strcmp(o->wrap, "none")) so.wrap = NULL;
    else if (!strncmp(o->wrap, "size:", 5)) {
        min_size = atol(o->wrap + 5);
        so.wrap = fsdp_wrap_by_size;
        so.wrap_ud = &min_size;
    }
    plan_mark_ac(gpt, o, 1);
    struct fsdp_mem_stats held; /* the communicator and the data, already allocated */
    fsdp_mem_get(ctx, &held);
    int shown = pworld <= 8 ? pworld : 2;
    int me = fsdp_ctx_rank(ctx);
    struct fsdp_mem_plan p0;
    memset(&p0, 0, sizeof p0);
    for (int i = 0; i < shown; i++) {
        int r = pworld <= 8 ? i : (i ? pworld - 1 : 0);
        struct fsdp_mem_plan p;
        enum fsdp_status pst = fsdp_plan_memory_accum(
            ctx, gpt, &so, pworld, r, k, o->batch / pworld / o->grad_accum, o->seq, threads, o->grad_accum,
            !strcmp(o->accum_mode, "no_sync") ? FSDP_ACCUM_NO_SYNC : FSDP_ACCUM_REDUCE_EACH, &p);
        if (pst != FSDP_OK) fail_all("memory plan: %s", fsdp_errmsg(ctx));
        p.workspace += held.cur_total;
        p.total += held.cur_total;
        if (i == 0) p0 = p;
        if (!o->dry_run || me != 0) continue;
        if (i == 0) {
            printf("memory plan: %s, world %d, %d units (--wrap %s), --ac %s, batch %d x %d tokens per "
                   "rank, %s (%d state floats per element), %d threads per rank, %s%s%s\n", o->sharding,
                   pworld, p.n_units, o->wrap, o->ac, o->batch / pworld, o->seq, o->optim, k, threads,
                   precision_name(o), so.precision != FSDP_F32 ? " mixed_precision " : "",
                   so.precision != FSDP_F32 ? o->mixed_precision : "");
            if (o->grad_accum > 1)
                printf("  in %d micro-batches of %d (--accum-mode %s)\n", o->grad_accum,
                       o->batch / pworld / o->grad_accum, o->accum_mode);
            printf("%-6s %12s %12s %12s %12s %12s %12s %12s\n", "rank", "params", "grads", "optimizer",
                   "full bufs", "activations", "workspace", "total");
        }
        if (pworld > 8 && i == 1) printf("...\n");
        char c[7][32];
        size_t v[7] = {p.params, p.grads, p.optim, p.full, p.act, p.workspace, p.total};
        for (int j = 0; j < 7; j++) mib(c[j], sizeof c[j], v[j]);
        printf("%-6d %12s %12s %12s %12s %12s %12s %12s\n", r, c[0], c[1], c[2], c[3], c[4], c[5], c[6]);
    }
    if (o->dry_run && me == 0) {
        if (limit)
            printf("--mem-limit %s (%.1f MiB): %s (%.0f%% of the limit)\n", o->mem_limit,
                   (double)limit / 1048576.0, p0.total <= limit ? "fits" : "EXCEEDED",
                   100.0 * (double)p0.total / (double)limit);
        printf("(library accounting; the process also holds MPI, oneDNN and the program itself)\n");
    }
    plan_mark_ac(gpt, o, 0); /* fsdp_parallelize_model marks them itself */
    if (limit && p0.total > limit)
        fail_all("--mem-limit %s: the plan needs %.1f MiB per rank (shards %.1f, full buffers %.1f, activations "
                 "%.1f, workspace %.1f MiB), more than the limit of %.1f MiB; use more ranks, a smaller "
                 "--batch or --seq, or a larger limit",
                 o->mem_limit, (double)p0.total / 1048576.0, (double)(p0.params + p0.grads + p0.optim) / 1048576.0,
                 (double)p0.full / 1048576.0, (double)p0.act / 1048576.0, (double)p0.workspace / 1048576.0,
                 (double)limit / 1048576.0);
    if (o->dry_run) {
        fsdp_module_free(gpt);
        fsdp_ctx_free(ctx);
        exit(0);
    }
    fsdp_mem_set_limit(ctx, limit);
}

int main(int argc, char **argv) {
    struct opts o = opts_default();
    parse_args(argc, argv, &o);
    int under_mpi = getenv("OMPI_COMM_WORLD_SIZE") != NULL;
    if (o.nproc > 1 && !under_mpi && !o.dry_run) relaunch(argc, argv, o.nproc); /* a plan needs no ranks */

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
    if (fsdp_ctx_create(&co, &g_ctx) != FSDP_OK) {
        fprintf(stderr, "fsdp-train: cannot start the communicator\n");
        return 1;
    }
    struct fsdp_ctx *ctx = g_ctx;
    int rank = fsdp_ctx_rank(ctx), world = fsdp_ctx_world(ctx);
    fsdp_comm_set_timeout(fsdp_ctx_comm(ctx), o.collective_timeout);
    if (o.check_collectives) fsdp_comm_set_check(fsdp_ctx_comm(ctx), 1);
    if (o.nproc > 1 && world != o.nproc && !(o.dry_run && !under_mpi))
        fail_all("--nproc %d but the MPI world has %d ranks", o.nproc, world);

    /* --resume: meta.json first, for its model config */
    char resume_buf[4096];
    const char *resume_dir = NULL;
    struct fsdp_ckpt_meta ck = {0};
    if (o.resume) {
        if (!(resume_dir = resolve_resume(o.resume, resume_buf, sizeof resume_buf)))
            fail_all("--resume: '%s' is neither a checkpoint (no meta.json) nor a folder holding step-N checkpoints",
                     o.resume);
        if (fsdp_ckpt_read_meta(ctx, resume_dir, &ck) != FSDP_OK) fail_all("--resume: %s", fsdp_errmsg(ctx));
    }

    /* model config: the flags, else the checkpoint's, else the default preset */
    struct fsdp_gpt_config cfg;
    if (o.model_config) {
        if (fsdp_gpt_config_load(ctx, o.model_config, &cfg) != FSDP_OK) fail_all("%s", fsdp_errmsg(ctx));
    } else if (!o.model && resume_dir && ck.has_config) {
        cfg = ck.config;
    } else if (fsdp_gpt_config_preset(o.model ? o.model : MODEL_DEFAULT, &cfg) != FSDP_OK) {
        fail_all("--model: unknown preset '%s' (tiny, small, gpt2, gpt2-medium, gpt2-large, gpt2-xl)", o.model);
    }
    if (fsdp_gpt_config_validate(ctx, &cfg) != FSDP_OK) fail_all("model config: %s", fsdp_errmsg(ctx));
    if (resume_dir && ck.has_config && (o.model || o.model_config)) {
        const char *what = o.model_config ? "--model-config" : "--model";
        const char *arg = o.model_config ? o.model_config : o.model;
        int a[5] = {cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.vocab_size, cfg.block_size};
        int b[5] = {ck.config.n_layer, ck.config.n_head, ck.config.n_embd, ck.config.vocab_size, ck.config.block_size};
        static const char *const names[5] = {"n_layer", "n_head", "n_embd", "vocab_size", "block_size"};
        for (int i = 0; i < 5; i++)
            if (a[i] != b[i])
                fail_all("%s %s: %s %d, but the checkpoint %s was saved with %s %d (leave out %s to use the "
                         "checkpoint's model)", what, arg, names[i], a[i], resume_dir, names[i], b[i], what);
    } else if (resume_dir && !ck.has_config && !o.model && !o.model_config) {
        fail_all("--resume: %s holds no model config (converted without one): give --model or --model-config",
                 resume_dir);
    }
    if (o.seq > cfg.block_size)
        fail_all("--seq %d is longer than the model's block_size %d", o.seq, cfg.block_size);
    if (o.batch % world != 0)
        fail_all("--batch %d (global) is not divisible by the world size %d", o.batch, world);
    check_strategy_flags(&o, world);

    /* --resume: the checkpoint's seed keys the data and sampling streams */
    if (resume_dir) {
        if (ck.step > 0 && ck.seed != o.seed) { /* a converted folder (step 0) carries no data position */
            if (rank == 0) printf("resume: using the checkpoint's seed %llu\n", (unsigned long long)ck.seed);
            o.seed = ck.seed;
        }
    }

    /* data */
    struct fsdp_data *data;
    enum fsdp_status st = !strcmp(o.data, "synthetic")
                              ? fsdp_data_synthetic(ctx, o.seed, (size_t)1 << 22, &data)
                              : fsdp_data_open(ctx, o.data, cfg.vocab_size, &data);
    if (st != FSDP_OK) fail_all("--data: %s", fsdp_errmsg(ctx));
    if (fsdp_data_is_text(data) && cfg.vocab_size < 256)
        fail_all("byte-level text needs vocab_size >= 256, the model has %d", cfg.vocab_size);

    /* model, shards, optimizer */
    struct fsdp_module *gpt;
    if (fsdp_gpt_create(ctx, &cfg, &gpt) != FSDP_OK) fail_all("%s", fsdp_errmsg(ctx));
    memory_plan(ctx, &o, gpt, !under_mpi && o.dry_run && o.nproc > 1 ? o.nproc : world);
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    oo.kind = !strcmp(o.optim, "sgd") ? FSDP_OPTIM_SGD : FSDP_OPTIM_ADAMW;
    oo.beta1 = o.beta1;
    oo.beta2 = o.beta2;
    oo.eps = o.eps;
    oo.momentum = o.momentum;
    oo.weight_decay = o.weight_decay;
    oo.decay_all = o.decay_all;
    struct fsdp_optim *opt;
    if (fsdp_optim_create(ctx, &oo, &opt) != FSDP_OK) fail_all("%s", fsdp_errmsg(ctx));
    struct fsdp_model *fm = prepare_model(ctx, &o, gpt, opt);
    int start_step = 0;
    if (resume_dir) {
        double t0 = now_s();
        if (fsdp_ckpt_load(ctx, fm, resume_dir, &ck) != FSDP_OK) fail_all("--resume: %s", fsdp_errmsg(ctx));
        start_step = (int)ck.step;
        if (rank == 0)
            printf("resumed from %s (saved at world %d): step %d, optimizer step %lld%s, %.2f s\n", resume_dir,
                   ck.world, start_step, (long long)ck.optim_step,
                   ck.has_optim_state ? "" : " (no optimizer state)", now_s() - t0);
    } else if (o.init_from) {
        /* --init rank0: rank 0 reads each unit and broadcasts it (sync_module_states) */
        int rank0 = !strcmp(o.init, "rank0");
        if (fsdp_model_load_full(ctx, fm, o.init_from, rank0) != FSDP_OK) fail_all("--init-from: %s", fsdp_errmsg(ctx));
        if (rank == 0) printf("initial weights from %s%s\n", o.init_from, rank0 ? " (rank 0, sent unit by unit)" : "");
    }

    int64_t n_params = fsdp_module_numel(gpt);
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
        printf("model: %d layers, %d heads, %d embd, vocab %d, block %d: %.2fM parameters in %d units\n",
               cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.vocab_size, cfg.block_size, (double)n_params / 1e6,
               fsdp_model_n_units(fm));
        printf("world %d (%s), %d threads per rank; batch %d x %d tokens; %d steps\n", world,
               fsdp_comm_backend(fsdp_ctx_comm(ctx)), co.threads, o.batch, o.seq, o.steps);
        printf("sharding: %s", o.sharding);
        if (!strcasecmp(o.sharding, "HYBRID_SHARD") && o.shard_group)
            printf(" (groups of %d ranks, %d replicas)", o.shard_group, world / o.shard_group);
        else if (!strcasecmp(o.sharding, "HYBRID_SHARD"))
            printf(" (groups: the ranks of each host)");
        if (o.grad_accum > 1)
            printf("; %d micro-batches of %d x %d tokens per rank per step (%s)", o.grad_accum,
                   o.batch / world / o.grad_accum, o.seq, o.accum_mode);
        printf("\n");
        precision_line(&o, fm);
        double floor_ = fsdp_data_loss_floor(data);
        if (floor_ >= 0) printf("data: %s, %zu tokens, loss floor %.3f nats/token\n", o.data,
                                fsdp_data_ntokens(data), floor_);
        else printf("data: %s, %zu tokens\n", o.data, fsdp_data_ntokens(data));
    }

    FILE *logf = NULL;
    if (o.log_path && rank == 0 && !(logf = fopen(o.log_path, "w")))
        fail_rank("--log: cannot open '%s': %s", o.log_path, strerror(errno));

    struct fsdp_lr_sched sched = {!strcmp(o.schedule, "cosine") ? FSDP_LR_COSINE : FSDP_LR_CONSTANT, o.lr,
                                  o.min_lr, o.warmup, o.steps};
    int Bl = o.batch / world, T = o.seq;
    int32_t *inputs = malloc((size_t)Bl * (size_t)T * sizeof(int32_t));
    int32_t *targets = malloc((size_t)Bl * (size_t)T * sizeof(int32_t));
    if (!inputs || !targets) fail_rank("out of memory for the batch");
    const char *tty_env = getenv("FSDP_TRAIN_TTY");
    int tty = tty_env ? atoi(tty_env) : isatty(STDOUT_FILENO);
    double flops_tok = 3.0 * fsdp_gpt_flops_per_token(&cfg, T);
    double total_s = 0, first_loss = 0, last_loss = 0;
    int timed = 0, skipped = 0;
    struct comm_delta comm_total = {0}; /* over the timed steps (all but the first) */
    for (int step = start_step; step < o.steps; step++) {
        fsdp_data_batch(data, step, o.batch, T, rank, world, inputs, targets);
        float lr = fsdp_lr_at(&sched, step);
        struct fsdp_step_result r;
        struct fsdp_comm_stats cs0, cs1;
        fsdp_model_comm_stats(fm, &cs0); /* all groups of the strategy */
        double t0 = now_s();
        st = fsdp_model_train_step_accum(ctx, fm, inputs, targets, Bl / o.grad_accum, T, o.grad_accum,
                                         !strcmp(o.accum_mode, "no_sync") ? FSDP_ACCUM_NO_SYNC
                                                                          : FSDP_ACCUM_REDUCE_EACH,
                                         lr, o.clip, &r);
        double dt = now_s() - t0;
        fsdp_model_comm_stats(fm, &cs1);
        struct comm_delta cd = {0};
        comm_delta_add(&cd, &cs0, &cs1);
        if (st == FSDP_ERR_NUMERIC) fail_all("step %d: %s", step + 1, fsdp_errmsg(ctx)); /* every rank agrees */
        if (st != FSDP_OK) fail_rank("step %d: %s", step + 1, fsdp_errmsg(ctx));
        if (step > 0) { total_s += dt; timed++; comm_delta_add(&comm_total, &cs0, &cs1); }
        skipped += r.skipped;
        if (step == start_step) first_loss = r.loss;
        last_loss = r.loss;
        float rss = (float)((double)fsdp_peak_rss_bytes() / 1048576.0), rss_max = rss;
        if (fsdp_comm_allreduce(fsdp_ctx_comm(ctx), &rss, &rss_max, 1, FSDP_F32, FSDP_MAX) != FSDP_OK)
            fail_rank("%s", fsdp_errmsg(ctx));
        double tps = (double)o.batch * T / dt;
        if (rank == 0) {
            if (tty) progress(step + 1, o.steps, r.loss, dt * 1e3, tps);
            else
                printf("step %4d/%d  loss %.4f  lr %.2e  grad_norm %.4f  %.1f ms  %.0f tok/s%s\n", step + 1,
                       o.steps, r.loss, (double)lr, r.grad_norm, dt * 1e3, tps,
                       r.skipped ? "  SKIPPED (overflow; loss scale halved)" : "");
            if (logf) {
                char jl[32], jg[32]; /* a skipped step's norm is inf or nan: null in JSON */
                fprintf(logf,
                        "{\"step\": %d, \"loss\": %s, \"lr\": %.9g, \"grad_norm\": %s, \"param_norm\": %.9g, "
                        "\"step_ms\": %.3f, \"forward_ms\": %.3f, \"backward_ms\": %.3f, \"update_ms\": %.3f, "
                        "\"tokens_per_s\": %.1f, \"peak_rss_mb\": %.1f, \"comm_ms\": %.3f, \"exposed_comm_ms\": %.3f, "
                        "\"comm_bytes\": %llu, "
                        "\"precision\": \"%s\", \"skipped\": %d, \"skipped_total\": %d, \"loss_scale\": %.9g, "
                        "\"comm\": {",
                        step + 1, json_num(jl, sizeof jl, r.loss), (double)lr,
                        json_num(jg, sizeof jg, r.grad_norm), r.param_norm, dt * 1e3, r.forward_s * 1e3,
                        r.backward_s * 1e3, r.update_s * 1e3, tps, (double)rss_max, cd.total_s * 1e3, r.comm_wait_s * 1e3,
                        (unsigned long long)cd.total_bytes, precision_name(&o), r.skipped, skipped, r.loss_scale);
                for (int k = 0; k < FSDP_COLL_COUNT; k++)
                    fprintf(logf, "%s\"%s\": {\"ms\": %.3f, \"bytes\": %llu}", k ? ", " : "", coll_names[k],
                            cd.wait_s[k] * 1e3, (unsigned long long)cd.bytes[k]);
                fprintf(logf, "}}\n");
            }
        }
        if (o.save_dir && ((o.save_every && (step + 1) % o.save_every == 0) || step + 1 == o.steps))
            save_ckpt(ctx, fm, &o, &cfg, step + 1, tty);
    }
    if (o.save_dir && start_step >= o.steps) save_ckpt(ctx, fm, &o, &cfg, start_step, tty);
    if (tty && rank == 0) printf("\n");
    if (logf) fclose(logf);

    if (o.save_full) {
        double t0 = now_s();
        if (fsdp_model_save_full(ctx, fm, o.save_full) != FSDP_OK) fail_all("--save-full: %s", fsdp_errmsg(ctx));
        if (rank == 0) printf("saved %s in %.2f s\n", o.save_full, now_s() - t0);
    }
    if (o.sample > 0 && fsdp_data_is_text(data) && o.steps > 0) generate(ctx, fm, &cfg, o.sample, o.seed);

    float rss = (float)((double)fsdp_peak_rss_bytes() / 1048576.0), rss_max = rss;
    fsdp_comm_allreduce(fsdp_ctx_comm(ctx), &rss, &rss_max, 1, FSDP_F32, FSDP_MAX);
    if (rank == 0) {
        double tps = timed ? (double)o.batch * T * timed / total_s : 0;
        /* ZeRO-3: 16 bytes per parameter (param, grad, m, v) over the world,
         * plus a gathered unit's full parameters and gradients */
        double zero3 = (16.0 * (double)n_params / world + 8.0 * (double)largest_unit) / 1048576.0;
        double fl = fsdp_data_loss_floor(data);
        char floor_txt[48] = "";
        if (fl >= 0) snprintf(floor_txt, sizeof floor_txt, " (floor %.3f)", fl);
        printf("summary: loss %.4f -> %.4f%s | %.0f tokens/s | %.2f GFLOP/s model | peak RSS %.0f MB per rank "
               "(ZeRO-3 estimate for params+grads+AdamW: %.0f MB)\n",
               first_loss, last_loss, floor_txt, tps, tps * flops_tok / 1e9, (double)rss_max, zero3);
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
    }
    free(inputs);
    free(targets);
    fsdp_model_free(fm);
    fsdp_optim_free(opt);
    fsdp_module_free(gpt);
    fsdp_data_free(data);
    fsdp_ctx_free(ctx);
    return 0;
}
