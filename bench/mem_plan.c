/*
 * mem_plan.c - the memory planner against a measured run: run under
 * `mpirun -np N` (bench/mem_plan.sh does 1, 2 and 4), it plans a GPT
 * (default gpt2 = GPT-2 124M) for the world, then trains STEPS steps of a
 * global batch B x T with AdamW and prints, from rank 0, the plan next to
 * the measured peaks (max over ranks): the library's accounting
 * (fsdp_mem_get) and the process's peak RSS less its RSS before the model
 * existed (MPI, oneDNN, the program). Usage: mem_plan [MODEL B T STEPS [ac|-]
 * [PRECISION]] (ac: checkpoint every Block; PRECISION: FP32 (default),
 * AMP_BF16 or AMP_FP16, mixed_precision DEFAULT), and the time the plan took (it runs the
 * step in measure mode, [Note: measure mode] in src/fsdp/plan.c).
 */
#include "fsdp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double mb(double bytes) { return bytes / 1048576.0; }

int main(int argc, char **argv) {
    const char *model = argc > 1 ? argv[1] : "gpt2";
    int B = argc > 2 ? atoi(argv[2]) : 4, T = argc > 3 ? atoi(argv[3]) : 256;
    int steps = argc > 4 ? atoi(argv[4]) : 2, ac = argc > 5 && !strcmp(argv[5], "ac");
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.threads = 1;
    const char *w = getenv("OMPI_COMM_WORLD_SIZE");
    if (!w || atoi(w) == 1) co.threads = 2;
    struct fsdp_ctx *ctx;
    if (fsdp_ctx_create(&co, &ctx) != FSDP_OK) return 1;
    int rank = fsdp_ctx_rank(ctx), world = fsdp_ctx_world(ctx), Bl = B / world;
    struct fsdp_gpt_config cfg;
    struct fsdp_shard_opts so = fsdp_shard_opts_default();
    const char *prec = argc > 6 ? argv[6] : "FP32";
    if (fsdp_precision_parse(ctx, prec, &so.precision) != FSDP_OK) {
        fprintf(stderr, "mem_plan: %s\n", fsdp_errmsg(ctx));
        fsdp_ctx_abort(ctx, 2);
    }
    if (fsdp_gpt_config_preset(model, &cfg) != FSDP_OK || B % world || T > cfg.block_size) {
        fprintf(stderr, "mem_plan: bad model '%s' or batch %d x %d for world %d\n", model, B, T, world);
        fsdp_ctx_abort(ctx, 2);
    }
    struct fsdp_mem_stats m0;
    fsdp_mem_get(ctx, &m0);
    struct fsdp_module *gpt;
    struct fsdp_model *fm;
    struct fsdp_optim *opt;
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    struct fsdp_mem_plan plan;
    size_t rss0 = fsdp_peak_rss_bytes();
#define OK(x) do { if ((x) != FSDP_OK) { fprintf(stderr, "rank %d: %s\n", rank, fsdp_errmsg(ctx)); fsdp_ctx_abort(ctx, 1); } } while (0)
    OK(fsdp_gpt_create(ctx, &cfg, &gpt));
    for (int l = 0; ac && l < cfg.n_layer; l++) {
        char fqn[64];
        snprintf(fqn, sizeof fqn, "transformer.h.%d.ln_1.weight", l);
        fsdp_module_find_param(gpt, fqn)->owner->parent->checkpoint = 1;
    }
    double t0 = now();
    OK(fsdp_plan_memory(ctx, gpt, &so, world, rank, 2, Bl, T, co.threads, &plan));
    double plan_s = now() - t0;
    OK(fsdp_fully_shard(ctx, gpt, &so, &fm));
    OK(fsdp_model_init_params(ctx, fm, 1));
    OK(fsdp_optim_create(ctx, &oo, &opt));
    OK(fsdp_model_attach_optim(ctx, fm, opt));
    int32_t *in = malloc(sizeof(int32_t) * (size_t)Bl * (size_t)T), *tg = malloc(sizeof(int32_t) * (size_t)Bl * (size_t)T);
    for (int i = 0; i < Bl * T; i++) {
        in[i] = (i * 7919 + rank) % cfg.vocab_size;
        tg[i] = (i * 104729 + 3) % cfg.vocab_size;
    }
    for (int s = 0; s < steps; s++) {
        struct fsdp_step_result r;
        OK(fsdp_model_train_step(ctx, fm, in, tg, Bl, T, 1e-4f, 1.0f, &r));
    }
    struct fsdp_mem_stats m;
    fsdp_mem_get(ctx, &m);
    double v[3] = {(double)(m.peak_total - m0.cur_total), (double)(fsdp_peak_rss_bytes() - rss0),
                   (double)m.peak[FSDP_MEM_ACT]}, mx[3];
    double *all = malloc(sizeof(double) * 3 * (size_t)world);
    OK(fsdp_comm_allgather(fsdp_ctx_comm(ctx), v, all, 3 * sizeof(double), FSDP_U8));
    for (int j = 0; j < 3; j++) {
        mx[j] = 0;
        for (int r = 0; r < world; r++) mx[j] = all[3 * r + j] > mx[j] ? all[3 * r + j] : mx[j];
    }
    if (rank == 0)
        printf("%s%s %s world %d, batch %d x %d per rank: plan %.1f MB (shards %.1f, full %.1f, act %.1f) | "
               "accounted peak %.1f MB = %.3f of plan (act %.1f) | RSS growth %.1f MB = %.3f of plan | "
               "plan measured in %.2f s\n",
               model, ac ? " (ac)" : "", prec, world, Bl, T, mb((double)plan.total), mb((double)(plan.params + plan.grads + plan.optim)),
               mb((double)plan.full), mb((double)plan.act), mb(mx[0]), mx[0] / (double)plan.total, mb(mx[2]),
               mb(mx[1]), mx[1] / (double)plan.total, plan_s);
    free(all);
    free(in);
    free(tg);
    fsdp_model_free(fm);
    fsdp_optim_free(opt);
    fsdp_module_free(gpt);
    fsdp_ctx_free(ctx);
    return 0;
}
