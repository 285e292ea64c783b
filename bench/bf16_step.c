/*
 * bf16_step.c - GPT-2 124M training step time with bf16 mixed precision
 * (fsdp_parallelize_model with FSDP_BF16 and mixed_precision DEFAULT: units
 * gathered in bf16, products on AMX, gradients reduced in fp32, fp32 master
 * weights and AdamW) against fp32, in one run: 1 rank (a world
 * of one), global batch B x T (default 4 x 256), AdamW, the built-in
 * synthetic corpus, the same seed and batches for both, learning rate 6e-4
 * with the trainer's schedule (warmup over 10% of the steps up to 20, cosine
 * decay to 6e-5). Prints per precision
 * the median step time over steps 2.. (the first step creates the oneDNN
 * primitives and grows the arena), the median forward / backward / update
 * phase times, the loss of the last step, model FLOP/s (3x the forward
 * matmul FLOPs per token), and the bf16 / fp32 speedup. It also reports
 * the median process CPU time per step (all threads), which moves less than
 * wall time when other jobs share the cores (quote both on a busy machine).
 * With 10+ steps it also prints the mean loss of the last 10 steps of each
 * and their relative difference (the 200-step comparison: 2%).
 * Usage: build/bench/bf16_step [steps] [threads] [model] [B] [T] [both|bf16|fp32] [FULL|DEFAULT|PURE]
 *        (defaults 6, 2, gpt2, 4, 256, both, DEFAULT; one precision alone is for profiling)
 */
#include "core/core-impl.h"
#include "nn/nn-impl.h"

#include <math.h>
#include <omp.h>
#include <string.h>
#include <time.h>

static double cpu_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct result {
    double step_s, fwd_s, bwd_s, upd_s, cpu_s, last_loss, tail_loss; /* tail: mean of the last 10 */
    double act_mb, total_mb; /* peaks of the activation arena and of all accounted memory, MiB */
    double act_steady_mb;    /* the arena after the last step: one chunk of a step's high-water mark */
    double rss_mb;           /* peak RSS of this run (the kernel's high-water mark reset before it), MB */
    int rss_reset;           /* 1 if that reset worked (else rss_mb includes what ran before) */
};

/* Resets the kernel's peak RSS (VmHWM) of this process to its current RSS:
 * 1 on success (Linux >= 4.0), so that each run reports its own peak. */
static int rss_reset_peak(void) {
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (!f) return 0;
    int ok = fputs("5", f) >= 0;
    return fclose(f) == 0 && ok;
}

/* VmHWM of this process in bytes (what rss_reset_peak resets), 0 if unreadable. */
static size_t rss_peak(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    size_t kb = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "VmHWM: %zu kB", &kb) == 1) break;
    if (f) fclose(f);
    return kb * 1024u;
}

static enum fsdp_mixed_precision g_mp = FSDP_MP_DEFAULT;

static void die(struct fsdp_ctx *ctx, const char *what) {
    fprintf(stderr, "bf16_step: %s: %s\n", what, fsdp_errmsg(ctx));
    exit(1);
}

static struct result run(struct fsdp_ctx *ctx, const struct fsdp_gpt_config *cfg, enum fsdp_dtype dt, int steps,
                         int B, int T, struct fsdp_data *data) {
    struct fsdp_module *g;
    struct fsdp_model *fm;
    struct fsdp_optim *opt;
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    if (fsdp_gpt_create(ctx, cfg, &g) != FSDP_OK) die(ctx, "gpt");
    if (fsdp_optim_create(ctx, &oo, &opt) != FSDP_OK) die(ctx, "optimizer");
    struct fsdp_parallel_config pc = fsdp_parallel_config_default();
    pc.seed = 1337;
    pc.mixed_precision = g_mp;
    if (fsdp_parallelize_model(ctx, g, &pc, opt, dt, NULL, NULL, NULL, &fm) != FSDP_OK) die(ctx, "parallelize");
    fsdp__arena_free_all(ctx); /* an arena of its own: not the one an earlier run in this process sized */
    fsdp_mem_reset_peak(ctx);  /* this run's peaks only */
    struct result res = {0};
    res.rss_reset = rss_reset_peak();
    int32_t *in = malloc((size_t)(B * T) * sizeof(int32_t)), *tg = malloc((size_t)(B * T) * sizeof(int32_t));
    double *st = calloc((size_t)steps, sizeof(double)), *fw = calloc((size_t)steps, sizeof(double));
    double *bw = calloc((size_t)steps, sizeof(double)), *up = calloc((size_t)steps, sizeof(double));
    double *cp = calloc((size_t)steps, sizeof(double));
    /* as the trainer: linear warmup (10% of the steps, at most 20), cosine to 10% */
    struct fsdp_lr_sched sched = {FSDP_LR_COSINE, 6e-4f, 6e-5f, steps / 10 < 20 ? steps / 10 : 20, steps};
    for (int s = 0; s < steps; s++) {
        fsdp_data_batch(data, s, B, T, 0, 1, in, tg);
        struct fsdp_step_result r;
        double t0 = fsdp__now(), c0 = cpu_now();
        if (fsdp_model_train_step(ctx, fm, in, tg, B, T, fsdp_lr_at(&sched, s), 1.0f, &r) != FSDP_OK) die(ctx, "step");
        st[s] = fsdp__now() - t0;
        cp[s] = cpu_now() - c0;
        fw[s] = r.forward_s;
        bw[s] = r.backward_s;
        up[s] = r.update_s;
        res.last_loss = r.loss;
        if (s >= steps - 10) res.tail_loss += r.loss / (steps < 10 ? steps : 10);
        fprintf(stderr, "  %s step %d: %.3f s, loss %.4f\n", fsdp_dtype_name(dt), s, st[s], r.loss);
    }
    int n = steps > 1 ? steps - 1 : 1, o = steps > 1 ? 1 : 0;
    res.step_s = median(st + o, n);
    res.fwd_s = median(fw + o, n);
    res.bwd_s = median(bw + o, n);
    res.upd_s = median(up + o, n);
    res.cpu_s = median(cp + o, n);
    struct fsdp_mem_stats ms;
    fsdp_mem_get(ctx, &ms);
    res.act_mb = (double)ms.peak[FSDP_MEM_ACT] / (1 << 20);
    res.act_steady_mb = (double)ms.cur[FSDP_MEM_ACT] / (1 << 20);
    res.total_mb = (double)ms.peak_total / (1 << 20);
    res.rss_mb = (double)rss_peak() / 1e6;
    free(cp);
    free(st);
    free(fw);
    free(bw);
    free(up);
    free(in);
    free(tg);
    fsdp_model_free(fm);
    fsdp_optim_free(opt);
    fsdp_module_free(g);
    return res;
}

int main(int argc, char **argv) {
    int steps = argc > 1 ? atoi(argv[1]) : 6, threads = argc > 2 ? atoi(argv[2]) : 2;
    const char *model = argc > 3 ? argv[3] : "gpt2";
    int B = argc > 4 ? atoi(argv[4]) : 4, T = argc > 5 ? atoi(argv[5]) : 256;
    const char *which = argc > 6 ? argv[6] : "both";
    const char *mp = argc > 7 ? argv[7] : "DEFAULT";
    g_mp = !strcmp(mp, "FULL") ? FSDP_MP_FULL : !strcmp(mp, "PURE") ? FSDP_MP_PURE : FSDP_MP_DEFAULT;
    int do32 = strcmp(which, "bf16") != 0, do16 = strcmp(which, "fp32") != 0;
    if (steps < 1 || threads < 1 || B < 1 || T < 1) {
        fprintf(stderr, "usage: bf16_step [steps>=1] [threads>=1] [model] [B] [T] [both|bf16|fp32] "
                        "[FULL|DEFAULT|PURE]\n");
        return 2;
    }
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.comm = FSDP_COMM_SELF;
    co.threads = threads;
    struct fsdp_ctx *ctx;
    if (fsdp_ctx_create(&co, &ctx) != FSDP_OK) return 1;
    struct fsdp_gpt_config cfg;
    if (fsdp_gpt_config_preset(model, &cfg) != FSDP_OK) {
        fprintf(stderr, "bf16_step: unknown model preset '%s'\n", model);
        return 2;
    }
    if (T > cfg.block_size) {
        fprintf(stderr, "bf16_step: T %d exceeds block_size %d\n", T, cfg.block_size);
        return 2;
    }
    struct fsdp_data *data;
    if (fsdp_data_synthetic(ctx, 7, (size_t)1 << 22, &data) != FSDP_OK) die(ctx, "data");
    double flops = 3.0 * fsdp_gpt_flops_per_token(&cfg, T) * B * T;
    struct result r32 = {0}, r16 = {0};
    if (do32) r32 = run(ctx, &cfg, FSDP_F32, steps, B, T, data);
    if (do16) r16 = run(ctx, &cfg, FSDP_BF16, steps, B, T, data);
    printf("model %s, batch %d x %d, 1 rank x %d threads, median of steps 2..%d, bf16 mixed_precision %s, bf16 "
           "products %s, the library's vector paths %s\n", model, B, T, threads, steps, mp,
           fsdp_gemm_native(FSDP_BF16) ? "native" : "widened to fp32 (no native bf16 kernels on this CPU)",
           fsdp__isa_name(fsdp__cpu_isa()));
    const struct result *rs[2] = {&r32, &r16};
    const char *names[2] = {"fp32", "bf16"};
    for (int i = 0; i < 2; i++)
        if (rs[i]->step_s > 0)
            printf("%s: %.3f s/step (forward %.3f, backward %.3f, update %.3f; CPU %.3f s/step), %.1f GFLOP/s "
                   "model, last loss %.4f; memory: activations %.0f MiB steady (%.0f MiB peak, first step's "
                   "chunks), all accounted %.0f MiB peak; peak RSS %.0f MB%s\n", names[i], rs[i]->step_s, rs[i]->fwd_s,
                   rs[i]->bwd_s, rs[i]->upd_s, rs[i]->cpu_s, flops / rs[i]->step_s / 1e9, rs[i]->last_loss,
                   rs[i]->act_steady_mb, rs[i]->act_mb, rs[i]->total_mb, rs[i]->rss_mb,
                   rs[i]->rss_reset ? "" : " (not reset: the process's peak so far)");
    if (do32 && do16)
        printf("bf16_speedup %.2f (fp32 s/step / bf16 s/step; by CPU time %.2f)\n", r32.step_s / r16.step_s,
               r32.cpu_s / r16.cpu_s);
    if (do32 && do16)
        printf("bf16_memory %.3f of fp32's (accounted peak %.0f / %.0f MiB), peak RSS %.3f (%.0f / %.0f MB)\n",
               r16.total_mb / r32.total_mb, r16.total_mb, r32.total_mb, r16.rss_mb / r32.rss_mb, r16.rss_mb,
               r32.rss_mb);
    if (do32 && do16) printf("bf16_mem_ratio %.3f %.3f\n", r16.total_mb / r32.total_mb, r16.rss_mb / r32.rss_mb);
    if (do16) printf("bf16_model_gflops %.1f\n", flops / r16.step_s / 1e9);
    if (do32 && do16 && steps >= 10)
        printf("loss over the last 10 steps: fp32 %.4f, bf16 %.4f, bf16_loss_rel_diff %.4f (target <= 0.02)\n",
               r32.tail_loss, r16.tail_loss, fabs(r16.tail_loss - r32.tail_loss) / r32.tail_loss);
    fsdp_data_free(data);
    fsdp_ctx_free(ctx);
    return 0;
}
