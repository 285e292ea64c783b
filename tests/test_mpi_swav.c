/*
 * test_mpi_swav.c - SwAV's loss (src/nn/swav.c) at 1..4 ranks:
 *  - Sinkhorn codes: every row sums to 1; the codes of this rank's rows equal
 *    those of one process holding the whole batch (1e-6);
 *  - the loss and this rank's rows of d loss / d scores equal the one-process
 *    values (the global batch is split unevenly at 3 and 4 ranks);
 *  - with a queue of past scores joined for Sinkhorn, likewise, and the loss
 *    or gradient differs from the one without the queue;
 *  - in two phases (fsdp_swav_codes, then fsdp_swav_predict over crops
 *    [0, 2) and [2, NC) apart): the same gradient rows bit for bit, the
 *    parts summing to the loss;
 *  - against PyTorch (tests/swav_ref.py, written from the paper's formulas,
 *    autograd with the codes detached), where python3-torch is installed:
 *    loss and gradient within 1e-5;
 *  - bad arguments are named.
 */
#include "fsdp.h"
#include "harness.h"

#include <mpi.h>

#include "mpi_harness.h"

enum { NC = 4, GB = 10, K = 12 };

/* Scores like SwAV's: cosines of unit vectors (here bounded smooth values in
 * [-1, 1]) for global image i, crop v, prototype k. */
static float score(int v, int i, int k) { return (float)sin(0.7 * v + 1.3 * i + 0.37 * k * (1 + v) + 0.1 * i * k); }

/* This rank's contiguous share [lo, hi) of the global batch. */
static void share(int rank, int world, int *lo, int *hi) {
    *lo = GB * rank / world;
    *hi = GB * (rank + 1) / world;
}

/* (NC * n, K) scores of images [lo, lo + n), crop-major as fsdp_swav_loss takes them. */
static float *make_scores(int lo, int n) {
    float *s = malloc((size_t)(NC * n * K) * sizeof(float));
    for (int v = 0; v < NC; v++)
        for (int b = 0; b < n; b++)
            for (int k = 0; k < K; k++) s[((size_t)v * n + b) * K + k] = score(v, lo + b, k);
    return s;
}

static float qscore(int r, int k) { return (float)cos(0.9 * r + 0.21 * k); }

TEST(sinkhorn_codes_match_one_process) {
    struct fsdp_ctx *c = get_ctx();
    int rank = fsdp_ctx_rank(c), world = fsdp_ctx_world(c), lo, hi;
    share(rank, world, &lo, &hi);
    int n = hi - lo;
    float *all = make_scores(0, GB), *mine = make_scores(lo, n);
    float *ref = malloc(GB * K * sizeof(float)), *got = malloc((size_t)(n * K + 1) * sizeof(float));
    CHECK_OK(fsdp_sinkhorn(c, NULL, all, GB, K, 0.05, 3, ref), c); /* crop 0 of the whole batch */
    CHECK_OK(fsdp_sinkhorn(c, fsdp_ctx_comm(c), mine, n, K, 0.05, 3, got), c);
    double worst = 0, rowerr = 0;
    for (int b = 0; b < n; b++) {
        double rs = 0;
        for (int k = 0; k < K; k++) {
            double d = fabs((double)got[b * K + k] - ref[(lo + b) * K + k]);
            worst = d > worst || d != d ? d : worst;
            rs += got[b * K + k];
        }
        rowerr = fmax(rowerr, fabs(rs - 1.0));
    }
    if (!(worst <= 1e-6)) TEST_FAILF("codes differ from one process by %g", worst);
    if (!(rowerr <= 1e-5)) TEST_FAILF("a code row sums to 1 +- %g", rowerr);
    /* the codes spread the batch over the prototypes: no prototype gets
     * everything (a degenerate all-one-prototype answer fails this) */
    double colmax = 0;
    for (int k = 0; k < K; k++) {
        double cs = 0;
        for (int b = 0; b < GB; b++) cs += ref[b * K + k];
        colmax = fmax(colmax, cs);
    }
    if (!(colmax < 0.5 * GB)) TEST_FAILF("one prototype takes %g of %d images", colmax, GB);
    free(all), free(mine), free(ref), free(got);
}

/* The one-process loss and gradient against PyTorch's (tests/swav_ref.py)
 * on the same scores and queues. */
static void torch_compare(const struct fsdp_swav_opts *o, int with_queue, int lq, const float *all, float *const qall[2],
                          double lref, const float *gref, double gmax) {
    char dir[] = "/tmp/swav_ref_XXXXXX", path[128], cmd[256];
    CHECK(mkdtemp(dir) != NULL);
    snprintf(path, sizeof path, "%s/case.json", dir);
    FILE *f = fopen(path, "w");
    fprintf(f, "{\"n_crops\": %d, \"B\": %d, \"K\": %d, \"assign\": [0, 1], \"tau\": %.17g, \"eps\": %.17g, "
               "\"iters\": %d, \"queue_len\": [%d, %d]}\n",
            NC, GB, K, o->temperature, o->epsilon, o->sinkhorn_iters, with_queue ? lq : 0, with_queue ? lq : 0);
    fclose(f);
    snprintf(path, sizeof path, "%s/scores.bin", dir);
    f = fopen(path, "wb");
    fwrite(all, sizeof(float), NC * GB * K, f);
    fclose(f);
    for (int a = 0; a < 2; a++) {
        snprintf(path, sizeof path, "%s/queue_%d.bin", dir, a);
        f = fopen(path, "wb");
        fwrite(qall[a], sizeof(float), (size_t)lq * K, f);
        fclose(f);
    }
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 tests/swav_ref.py %s", dir);
    CHECK(system(cmd) == 0);
    snprintf(path, sizeof path, "%s/ref_loss.txt", dir);
    f = fopen(path, "r");
    double tl = NAN;
    CHECK(f && fscanf(f, "%lf", &tl) == 1);
    if (f) fclose(f);
    CHECK_NEAR(lref, tl, 1e-5, 1e-7);
    snprintf(path, sizeof path, "%s/ref_grad.bin", dir);
    f = fopen(path, "rb");
    double *tg = malloc(NC * GB * K * sizeof(double));
    CHECK(f && fread(tg, sizeof(double), NC * GB * K, f) == NC * GB * K);
    if (f) fclose(f);
    double gw = 0;
    for (int i = 0; i < NC * GB * K; i++) {
        double d = fabs(gref[i] - tg[i]) / (1e-3 * gmax + fabs(tg[i]));
        gw = d > gw || d != d ? d : gw;
    }
    if (!(gw <= 1e-5)) TEST_FAILF("gradient differs from PyTorch by %g (relative)", gw);
    free(tg);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0);
}

static void loss_case(int with_queue) {
    struct fsdp_ctx *c = get_ctx();
    int rank = fsdp_ctx_rank(c), world = fsdp_ctx_world(c), lo, hi;
    share(rank, world, &lo, &hi);
    int n = hi - lo;
    const int assign[2] = {0, 1};
    /* a queue per assigned crop: 6 rows in all, split across ranks like the batch */
    enum { LQ = 6 };
    float *qall[2], *qmine[2];
    int64_t qlen_all[2] = {LQ, LQ}, qlen[2];
    int qlo = LQ * rank / world, qhi = LQ * (rank + 1) / world;
    for (int a = 0; a < 2; a++) {
        qall[a] = malloc(LQ * K * sizeof(float));
        for (int r = 0; r < LQ; r++)
            for (int k = 0; k < K; k++) qall[a][r * K + k] = qscore(r + 17 * a, k);
        qmine[a] = qall[a] + qlo * K;
        qlen[a] = qhi - qlo;
    }
    /* the one-process reference joins the queue rows rank by rank, as the
     * ranks' [queue; batch] blocks line up in the distributed Sinkhorn: only
     * the batch rows' codes are used, and they depend on the set of rows */
    float *all = make_scores(0, GB), *mine = make_scores(lo, n);
    float *gref = malloc(NC * GB * K * sizeof(float)), *got = malloc((size_t)(NC * n * K + 1) * sizeof(float));
    double lref, lgot;
    struct fsdp_swav_opts o = fsdp_swav_opts_default();
    CHECK_OK(fsdp_swav_loss(c, NULL, &o, all, NC, GB, K, assign, 2, with_queue ? (const float *const *)qall : NULL,
                            with_queue ? qlen_all : NULL, &lref, gref), c);
    CHECK_OK(fsdp_swav_loss(c, fsdp_ctx_comm(c), &o, mine, NC, n, K, assign, 2,
                            with_queue ? (const float *const *)qmine : NULL, with_queue ? qlen : NULL, &lgot, got),
             c);
    CHECK(isfinite(lref) && lref > 0);
    CHECK_NEAR(lgot, lref, 1e-9, 1e-9);
    double worst = 0;
    for (int v = 0; v < NC; v++)
        for (int b = 0; b < n; b++)
            for (int k = 0; k < K; k++) {
                double d = fabs((double)got[((size_t)v * n + b) * K + k] - gref[((size_t)v * GB + lo + b) * K + k]);
                worst = d > worst || d != d ? d : worst;
            }
    if (!(worst <= 1e-7)) TEST_FAILF("d loss / d scores differs from one process by %g", worst);
    /* in two phases (the trainer's: global crops, then small ones): codes
     * once, the terms of crops [0, 2) and [2, NC) apart; the same gradient
     * rows bit for bit, the parts summing to the loss */
    float *codes = malloc((size_t)(2 * n * K + 1) * sizeof(float)), *part = malloc((size_t)(NC * n * K + 1) * sizeof(float));
    CHECK_OK(fsdp_swav_codes(c, fsdp_ctx_comm(c), &o, mine, 2, n, K, assign, 2,
                             with_queue ? (const float *const *)qmine : NULL, with_queue ? qlen : NULL, codes), c);
    double l01, l23;
    CHECK_OK(fsdp_swav_predict(c, fsdp_ctx_comm(c), &o, mine, 0, 2, NC, n, K, assign, 2, codes, &l01, part), c);
    CHECK_OK(fsdp_swav_predict(c, fsdp_ctx_comm(c), &o, mine + (size_t)2 * n * K, 2, NC - 2, NC, n, K, assign, 2,
                               codes, &l23, part + (size_t)2 * n * K), c);
    CHECK_NEAR(l01 + l23, lgot, 1e-12, 1e-12);
    CHECK(l01 > 0 && l23 > 0);
    CHECK(memcmp(part, got, (size_t)(NC * n * K) * sizeof(float)) == 0);
    free(codes), free(part);
    /* the gradient is not trivially zero, and the queue changes the codes */
    double gmax = 0;
    for (int i = 0; i < NC * GB * K; i++) gmax = fmax(gmax, fabs(gref[i]));
    CHECK(gmax > 1e-4);
    if (with_queue) {
        double lnq;
        float *gnq = malloc(NC * GB * K * sizeof(float));
        CHECK_OK(fsdp_swav_loss(c, NULL, &o, all, NC, GB, K, assign, 2, NULL, NULL, &lnq, gnq), c);
        double gd = max_abs_diff(gnq, gref, NC * GB * K, NULL);
        if (!(fabs(lnq - lref) > 1e-6 || gd > 1e-6))
            TEST_FAILF("the queue changes neither the loss (%.9g vs %.9g) nor the gradient (%g)", lref, lnq, gd);
        free(gnq);
    }
    if (rank == 0 && world == 1) { /* PyTorch, once, where it is installed */
        if (system("/usr/bin/python3 -c 'import torch' 2> /dev/null") != 0)
            fprintf(stderr, "  python3-torch is not installed: the PyTorch comparison is left out\n");
        else
            torch_compare(&o, with_queue, LQ, all, qall, lref, gref, gmax);
    }
    free(all), free(mine), free(gref), free(got), free(qall[0]), free(qall[1]);
}

TEST(swav_loss_matches_one_process_and_torch) { loss_case(0); }
TEST(swav_loss_with_queue_matches_one_process_and_torch) { loss_case(1); }

TEST(swav_bad_arguments_named) {
    struct fsdp_ctx *c = get_ctx();
    float s[2 * K] = {0};
    double l;
    int bad_assign[1] = {3};
    CHECK(fsdp_swav_loss(c, NULL, NULL, s, 1, 1, K, (int[]){0}, 1, NULL, NULL, &l, NULL) == FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "1 crops");
    CHECK(fsdp_swav_loss(c, NULL, NULL, s, 2, 1, K, bad_assign, 1, NULL, NULL, &l, NULL) == FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "assigned crop 3");
    CHECK(fsdp_sinkhorn(c, NULL, s, 2, 0, 0.05, 3, s) == FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "K 0");
    s[3] = NAN;
    float codes[2 * K];
    CHECK(fsdp_sinkhorn(c, NULL, s, 2, K, 0.05, 3, codes) == FSDP_ERR_NUMERIC);
}

TEST_MAIN()
