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
#include <time.h>
#include <unistd.h>

/* ---- Options ---- */

struct opts {
    const char *model, *model_config, *data, *log_path;
    int batch, seq, steps, warmup, threads, nproc, sample, verbose;
    float lr, min_lr, weight_decay, clip, beta1, beta2, eps, momentum;
    const char *schedule, *optim, *comm;
    int decay_all;
    uint64_t seed;
};

static struct opts opts_default(void) {
    struct opts o = {0};
    o.model = "small";
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
    o.seed = 1337;
    return o;
}

static void usage(FILE *f) {
    struct opts d = opts_default();
    fprintf(f,
            "usage: fsdp-train [flags]\n"
            "Trains a GPT with fully sharded data parallelism (ZeRO-3).\n"
            "Run under `mpirun -np N`, or give --nproc N to start N local ranks.\n\n"
            "  --model NAME          preset: tiny small gpt2 gpt2-medium gpt2-large gpt2-xl (default %s)\n"
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
            "  --comm S              auto | mpi | self (default %s)\n"
            "  --log FILE            one JSON object per step (default none)\n"
            "  --sample N            tokens to generate at the end for text data; 0 = none (default %d)\n"
            "  --verbose             print the unit plan and debug information\n"
            "  --help                this text\n",
            d.model, d.data, d.batch, d.seq, d.steps, (double)d.lr, d.warmup, d.schedule, d.optim,
            (double)d.beta1, (double)d.beta2, (double)d.eps, (double)d.momentum,
            (double)d.weight_decay, (double)d.clip, (unsigned long long)d.seed, d.comm, d.sample);
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
        if (strncmp(a, "--", 2) != 0) usage_error("unexpected argument '%s'", a);
        if (i + 1 >= argc) usage_error("%s needs a value", a);
        const char *v = argv[++i];
        if (!strcmp(a, "--model")) o->model = v;
        else if (!strcmp(a, "--model-config")) o->model_config = v;
        else if (!strcmp(a, "--data")) o->data = v;
        else if (!strcmp(a, "--log")) o->log_path = v;
        else if (!strcmp(a, "--batch")) o->batch = (int)parse_int(a, v, 1, 1 << 20);
        else if (!strcmp(a, "--seq")) o->seq = (int)parse_int(a, v, 1, 1 << 20);
        else if (!strcmp(a, "--steps")) o->steps = (int)parse_int(a, v, 0, 1 << 30);
        else if (!strcmp(a, "--warmup")) o->warmup = (int)parse_int(a, v, 0, 1 << 30);
        else if (!strcmp(a, "--threads")) o->threads = (int)parse_int(a, v, 0, 4096);
        else if (!strcmp(a, "--nproc")) o->nproc = (int)parse_int(a, v, 1, 4096);
        else if (!strcmp(a, "--sample")) o->sample = (int)parse_int(a, v, 0, 1 << 20);
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
            if (strcmp(v, "auto") && strcmp(v, "mpi") && strcmp(v, "self"))
                usage_error("--comm: '%s' is not auto, mpi or self", v);
            o->comm = v;
        } else usage_error("unknown flag '%s'", a);
    }
    if (o->min_lr < 0) o->min_lr = o->lr / 10;
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

/* ---- Run ---- */

static struct fsdp_ctx *g_ctx;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

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

int main(int argc, char **argv) {
    struct opts o = opts_default();
    parse_args(argc, argv, &o);
    int under_mpi = getenv("OMPI_COMM_WORLD_SIZE") != NULL;
    if (o.nproc > 1 && !under_mpi) relaunch(argc, argv, o.nproc);

    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.threads = o.threads;
    if (co.threads == 0) {
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        co.threads = (int)(cores / local_ranks());
        if (co.threads < 1) co.threads = 1;
    }
    co.verbose = o.verbose;
    co.comm = !strcmp(o.comm, "mpi") ? FSDP_COMM_MPI : !strcmp(o.comm, "self") ? FSDP_COMM_SELF : FSDP_COMM_AUTO;
    if (fsdp_ctx_create(&co, &g_ctx) != FSDP_OK) {
        fprintf(stderr, "fsdp-train: cannot start the communicator\n");
        return 1;
    }
    struct fsdp_ctx *ctx = g_ctx;
    int rank = fsdp_ctx_rank(ctx), world = fsdp_ctx_world(ctx);
    if (o.nproc > 1 && world != o.nproc)
        fail_all("--nproc %d but the MPI world has %d ranks", o.nproc, world);

    /* model config */
    struct fsdp_gpt_config cfg;
    if (o.model_config) {
        if (fsdp_gpt_config_load(ctx, o.model_config, &cfg) != FSDP_OK) fail_all("%s", fsdp_errmsg(ctx));
    } else if (fsdp_gpt_config_preset(o.model, &cfg) != FSDP_OK) {
        fail_all("--model: unknown preset '%s' (tiny, small, gpt2, gpt2-medium, gpt2-large, gpt2-xl)", o.model);
    }
    if (fsdp_gpt_config_validate(ctx, &cfg) != FSDP_OK) fail_all("model config: %s", fsdp_errmsg(ctx));
    if (o.seq > cfg.block_size)
        fail_all("--seq %d is longer than the model's block_size %d", o.seq, cfg.block_size);
    if (o.batch % world != 0)
        fail_all("--batch %d (global) is not divisible by the world size %d", o.batch, world);

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
    struct fsdp_shard_opts so = fsdp_shard_opts_default();
    struct fsdp_model *fm;
    if (fsdp_fully_shard(ctx, gpt, &so, &fm) != FSDP_OK) fail_all("%s", fsdp_errmsg(ctx));
    if (fsdp_model_init_params(ctx, fm, o.seed) != FSDP_OK) fail_all("%s", fsdp_errmsg(ctx));
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
    if (fsdp_model_attach_optim(ctx, fm, opt) != FSDP_OK) fail_all("%s", fsdp_errmsg(ctx));

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
    int timed = 0;
    for (int step = 0; step < o.steps; step++) {
        fsdp_data_batch(data, step, o.batch, T, rank, world, inputs, targets);
        float lr = fsdp_lr_at(&sched, step);
        struct fsdp_step_result r;
        double t0 = now_s();
        st = fsdp_model_train_step(ctx, fm, inputs, targets, Bl, T, lr, o.clip, &r);
        double dt = now_s() - t0;
        if (st != FSDP_OK) fail_rank("step %d: %s", step, fsdp_errmsg(ctx));
        if (step > 0) { total_s += dt; timed++; }
        if (step == 0) first_loss = r.loss;
        last_loss = r.loss;
        float rss = (float)((double)fsdp_peak_rss_bytes() / 1048576.0), rss_max = rss;
        if (fsdp_comm_allreduce(fsdp_ctx_comm(ctx), &rss, &rss_max, 1, FSDP_F32, FSDP_MAX) != FSDP_OK)
            fail_rank("%s", fsdp_errmsg(ctx));
        double tps = (double)o.batch * T / dt;
        if (rank == 0) {
            if (tty) progress(step + 1, o.steps, r.loss, dt * 1e3, tps);
            else
                printf("step %4d/%d  loss %.4f  lr %.2e  grad_norm %.4f  %.1f ms  %.0f tok/s\n", step + 1,
                       o.steps, r.loss, (double)lr, r.grad_norm, dt * 1e3, tps);
            if (logf)
                fprintf(logf,
                        "{\"step\": %d, \"loss\": %.9g, \"lr\": %.9g, \"grad_norm\": %.9g, \"param_norm\": %.9g, "
                        "\"step_ms\": %.3f, \"forward_ms\": %.3f, \"backward_ms\": %.3f, \"update_ms\": %.3f, "
                        "\"tokens_per_s\": %.1f, \"peak_rss_mb\": %.1f}\n",
                        step + 1, r.loss, (double)lr, r.grad_norm, r.param_norm, dt * 1e3, r.forward_s * 1e3,
                        r.backward_s * 1e3, r.update_s * 1e3, tps, (double)rss_max);
        }
    }
    if (tty && rank == 0) printf("\n");
    if (logf) fclose(logf);

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
