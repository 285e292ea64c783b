/*
 * bpe_rate.c - encoding rate of GPT-2's byte-level BPE (src/io/bpe.c): loads
 * a tokenizer directory, reads a text file and encodes it whole `reps` times
 * with a fresh tokenizer each time (so the piece cache starts empty, as it
 * does for a single pass of fsdp-tokenize), timing only fsdp_bpe_encode.
 * Prints "bpe_mb_s <median> tokens <n> bytes <n>".
 * Usage: build/bench/bpe_rate DIR FILE [reps]   (default 5)
 */
#include "fsdp.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: bpe_rate DIR FILE [reps]\n");
        return 2;
    }
    int reps = argc > 3 ? atoi(argv[3]) : 5;
    if (reps < 1 || reps > 100) reps = 5;
    FILE *f = fopen(argv[2], "rb");
    if (!f) {
        fprintf(stderr, "bpe_rate: cannot open '%s'\n", argv[2]);
        return 1;
    }
    fseek(f, 0, SEEK_END);
    size_t n = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = malloc(n + 1);
    int32_t *ids = malloc((n + 1) * sizeof *ids);
    if (!text || !ids || fread(text, 1, n, f) != n) return 1;
    fclose(f);
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.comm = FSDP_COMM_SELF;
    struct fsdp_ctx *ctx;
    if (fsdp_ctx_create(&co, &ctx) != FSDP_OK) return 1;
    double t[100];
    size_t k = 0;
    for (int r = 0; r < reps; r++) {
        struct fsdp_bpe *b;
        if (fsdp_bpe_open(ctx, argv[1], &b) != FSDP_OK) {
            fprintf(stderr, "bpe_rate: %s\n", fsdp_errmsg(ctx));
            return 1;
        }
        double t0 = now_s();
        if (fsdp_bpe_encode(b, text, n, ids, &k) != FSDP_OK) return 1;
        t[r] = now_s() - t0;
        fsdp_bpe_free(b);
    }
    qsort(t, (size_t)reps, sizeof *t, cmp_d);
    printf("bpe_mb_s %.2f tokens %zu bytes %zu\n", (double)n / 1e6 / t[reps / 2], k, n);
    free(text);
    free(ids);
    fsdp_ctx_free(ctx);
    return 0;
}
