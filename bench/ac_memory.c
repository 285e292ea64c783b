/*
 * ac_memory.c - activation memory with and without activation
 * checkpointing, by the library's own accounting (the FSDP_MEM_ACT peak of
 * a training step, after a first step has sized the arena), on a 12-layer
 * GPT in a world of one. Also checks that the gradients are bit-identical.
 *
 *   build/bench/ac_memory [n_layer n_embd B T]     (default 12 128 4 128)
 *
 * Prints one line per setting (none, every:2, blocks) with the peak, its
 * ratio to "none", and the median step time of 3 steps; exits 1 if
 * checkpointing every Block does not at least halve the peak or changes a
 * gradient bit.
 */
#include "fsdp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* internal (core-impl.h): frees the activation arena so that each setting
 * measures its own arena from empty */
void fsdp__arena_free_all(struct fsdp_ctx *ctx);

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int every_k(struct fsdp_module *m, void *ud) {
    return !strcmp(m->ops->type, "Block") && atoi(m->name) % *(const int *)ud == 0;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int collect(struct fsdp_param *p, void *ud) {
    const char ***names = ud;
    **names = p->fqn;
    (*names)++;
    return 0;
}

/* mode 0: none, 1: every second Block, 2: every Block */
static int run(struct fsdp_ctx *ctx, const struct fsdp_gpt_config *cfg, int mode, int B, int T, size_t *peak,
               double *step_s, float *grads) {
    struct fsdp_module *g;
    if (fsdp_gpt_create(ctx, cfg, &g) != FSDP_OK) return 1;
    struct fsdp_parallel_config pc = fsdp_parallel_config_default();
    pc.activation_checkpointing = mode > 0;
    int two = 2;
    struct fsdp_ac_check ac = {mode == 1 ? every_k : fsdp_ac_by_type, mode == 1 ? (void *)&two : (void *)"Block"};
    struct fsdp_optim *opt;
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    fsdp_optim_create(ctx, &oo, &opt);
    struct fsdp_model *fm;
    if (fsdp_parallelize_model(ctx, g, &pc, opt, FSDP_F32, NULL, mode ? &ac : NULL, NULL, &fm) != FSDP_OK) {
        fprintf(stderr, "ac_memory: %s\n", fsdp_errmsg(ctx));
        return 1;
    }
    int32_t *in = malloc((size_t)B * T * sizeof *in), *tg = malloc((size_t)B * T * sizeof *tg);
    for (int i = 0; i < B * T; i++) {
        in[i] = (i * 7 + 1) % cfg->vocab_size;
        tg[i] = (i * 13 + 5) % cfg->vocab_size;
    }
    struct fsdp_step_result r;
    fsdp__arena_free_all(ctx);
    if (fsdp_model_train_step(ctx, fm, in, tg, B, T, 0.0f, 0.0f, &r) != FSDP_OK) return 1;
    fsdp_arena_reset(ctx); /* one chunk of the first step's high-water size */
    fsdp_mem_reset_peak(ctx);
    double t[3];
    for (int s = 0; s < 3; s++) {
        double t0 = now_s();
        if (fsdp_model_train_step(ctx, fm, in, tg, B, T, 0.0f, 0.0f, &r) != FSDP_OK) return 1;
        t[s] = now_s() - t0;
    }
    qsort(t, 3, sizeof t[0], cmp_d);
    *step_s = t[1];
    struct fsdp_mem_stats m;
    fsdp_mem_get(ctx, &m);
    *peak = m.peak[FSDP_MEM_ACT];
    /* lr 0: the gradients of every step are those of the same parameters */
    int64_t n = fsdp_module_numel(g);
    const char **names = malloc((size_t)n * sizeof *names), **end = names;
    fsdp_module_foreach_param(g, collect, &end);
    int64_t off = 0;
    for (const char **q = names; q < end; q++) {
        struct fsdp_param *p = fsdp_module_find_param(g, *q);
        if (fsdp_model_get_grad(ctx, fm, *q, grads + off) != FSDP_OK) {
            fprintf(stderr, "ac_memory: %s\n", fsdp_errmsg(ctx));
            return 1;
        }
        off += p->numel;
    }
    free(names);
    free(in);
    free(tg);
    fsdp_model_free(fm);
    fsdp_optim_free(opt);
    fsdp_module_free(g);
    return 0;
}

int main(int argc, char **argv) {
    struct fsdp_gpt_config cfg = {12, 4, 128, 256, 128};
    int B = 4, T = 128;
    if (argc == 5) {
        cfg.n_layer = atoi(argv[1]);
        cfg.n_embd = atoi(argv[2]);
        B = atoi(argv[3]);
        T = atoi(argv[4]);
        cfg.block_size = T;
    } else if (argc != 1) {
        fprintf(stderr, "usage: ac_memory [n_layer n_embd B T]\n");
        return 2;
    }
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.comm = FSDP_COMM_SELF;
    struct fsdp_ctx *ctx;
    if (fsdp_ctx_create(&co, &ctx) != FSDP_OK) return 1;
    struct fsdp_module *probe;
    fsdp_gpt_create(ctx, &cfg, &probe);
    int64_t n = fsdp_module_numel(probe);
    fsdp_module_free(probe);
    const char *names[3] = {"none", "every:2", "blocks"};
    size_t peak[3];
    double step[3];
    float *grads[3];
    printf("activation memory, GPT %d layers x %d embd, batch %d x %d tokens, 1 rank (FSDP_MEM_ACT peak of a step)\n",
           cfg.n_layer, cfg.n_embd, B, T);
    for (int k = 0; k < 3; k++) {
        grads[k] = calloc((size_t)n, sizeof(float));
        if (run(ctx, &cfg, k, B, T, &peak[k], &step[k], grads[k])) return 1;
        printf("  ac %-8s  %8.2f MiB  %5.3f of none  step %.3f s (%.2fx none)\n", names[k],
               (double)peak[k] / (1 << 20), (double)peak[k] / (double)peak[0], step[k], step[k] / step[0]);
    }
    int nonzero = 0; /* gradients read as zeros would be bit-identical too */
    for (int64_t i = 0; i < n && !nonzero; i++) nonzero = grads[0][i] != 0.0f;
    int same = nonzero && !memcmp(grads[0], grads[2], (size_t)n * sizeof(float)) &&
               !memcmp(grads[0], grads[1], (size_t)n * sizeof(float));
    printf("gradients bit-identical with and without checkpointing: %s\n", same ? "yes" : "NO");
    int ok = same && 2 * peak[2] <= peak[0];
    printf("checkpointing every Block: activation memory %s by at least half\n", ok ? "falls" : "does NOT fall");
    for (int k = 0; k < 3; k++) free(grads[k]);
    fsdp_ctx_free(ctx);
    return ok ? 0 : 1;
}
