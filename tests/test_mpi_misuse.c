/*
 * test_mpi_misuse.c - a mistake on one rank fails every rank alike (2+
 * ranks; a world of one skips): a step whose learning rate the last rank
 * gives as NaN, through the composed step and through the split calls'
 * optimizer step, is refused on every rank before any other collective
 * ([Note: agreed preconditions], src/fsdp/step.c; the other ranks waited in
 * the step's first collective), and the same step with good values then runs
 * on all; ranks that lay out different models refuse the shm backend's shared
 * window alike, naming both sizes (the larger rank died of SIGBUS); ranks
 * that save a checkpoint into folders they do not share (each host's own
 * disk) all fail naming that, and leave nothing behind (rank 0 named a rank
 * file it could not open); on the shm backend with the schedule check off,
 * collectives the last rank starts differently (another count, op or dtype,
 * a size that takes the single-copy path, one collective more) fail on every
 * rank naming both sides ([Note: collective ids], src/comm/shm.c; they
 * completed with wrong data).
 */
#include "fsdp.h"
#include "harness.h"

#include <dirent.h>
#include <math.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "mpi_harness.h"

struct run {
    struct fsdp_module *g;
    struct fsdp_model *fm;
    struct fsdp_optim *opt;
};

static enum fsdp_status run_open(struct fsdp_ctx *c, int extra_layer, struct run *r) {
    struct fsdp_gpt_config cfg;
    fsdp_gpt_config_preset("tiny", &cfg);
    cfg.n_layer += extra_layer;
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    memset(r, 0, sizeof *r);
    enum fsdp_status st = fsdp_gpt_create(c, &cfg, &r->g);
    if (st == FSDP_OK) st = fsdp_fully_shard(c, r->g, NULL, &r->fm);
    if (st == FSDP_OK) st = fsdp_model_init_params(c, r->fm, 5);
    if (st == FSDP_OK) st = fsdp_optim_create(c, &oo, &r->opt);
    if (st == FSDP_OK) st = fsdp_model_attach_optim(c, r->fm, r->opt);
    return st;
}

static void run_close(struct run *r) {
    fsdp_model_free(r->fm);
    fsdp_optim_free(r->opt);
    fsdp_module_free(r->g);
}

/* the last rank's error, or on the others the agreement's naming it */
static void check_refused(struct fsdp_ctx *c, enum fsdp_status st, const char *what) {
    int rank = fsdp_ctx_rank(c), last = fsdp_ctx_world(c) - 1;
    char want[128];
    snprintf(want, sizeof want, "%s: refused on rank %d", what, last);
    CHECK_INT_EQ(st, rank == last ? FSDP_ERR_INVALID : FSDP_ERR_STATE);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), rank == last ? "optimizer step: lr nan" : want);
}

TEST(a_step_one_rank_refuses_is_refused_on_every_rank) {
    struct fsdp_ctx *c = get_ctx();
    int rank = fsdp_ctx_rank(c), world = fsdp_ctx_world(c);
    if (world < 2) SKIP("a world of one");
    struct run r;
    ASSERT_OK(run_open(c, 0, &r), c);
    int32_t in[16], tg[16];
    for (int i = 0; i < 16; i++) in[i] = (i * 7 + 3) % 256, tg[i] = (i * 5 + 1) % 256;
    float bad = rank == world - 1 ? NAN : 1e-3f;
    struct fsdp_step_result res;
    check_refused(c, fsdp_model_train_step(c, r.fm, in, tg, 2, 8, bad, 1.0f, &res), "train_step");
    CHECK_OK(fsdp_model_train_step(c, r.fm, in, tg, 2, 8, 1e-3f, 1.0f, &res), c);
    CHECK(isfinite(res.loss));
    /* the split calls: forward, loss and backward on every rank, then the optimizer step */
    struct fsdp_tensor x = {in, FSDP_I32, 2, {2, 8}, 0}, t = {tg, FSDP_I32, 2, {2, 8}, 0}, y = {0}, dy = {0};
    double value = 0;
    ASSERT_OK(fsdp_model_forward_tensor(c, r.fm, &x, &y), c);
    ASSERT_OK(fsdp_model_loss(c, r.fm, NULL, &y, &t, 1, &value, &dy), c);
    ASSERT_OK(fsdp_model_backward(c, r.fm, &dy), c);
    check_refused(c, fsdp_model_optim_step(c, r.fm, bad, 1.0f, &res), "optimizer step");
    CHECK_OK(fsdp_model_optim_step(c, r.fm, 1e-3f, 1.0f, &res), c); /* the step stayed open */
    CHECK(isfinite(res.loss));
    run_close(&r);
}

TEST(different_models_refuse_the_shared_window_alike) {
    struct fsdp_ctx *c = get_ctx();
    int rank = fsdp_ctx_rank(c), world = fsdp_ctx_world(c);
    if (world < 2) SKIP("a world of one");
    struct fsdp_ctx *s = shm_ctx_window("1073741824"); /* windows up to 1 GiB */
    ASSERT(s != NULL);
    struct run r;
    enum fsdp_status st = run_open(s, rank == world - 1, &r); /* the last rank: one layer more */
    CHECK_INT_EQ(st, FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(s), "comm shm: the ranks ask for a shared window of different sizes");
    CHECK(r.fm == NULL);
    run_close(&r);
    ASSERT_OK(run_open(s, 0, &r), s); /* the same model on every rank: the window, and a step on it */
    int32_t in[16];
    for (int i = 0; i < 16; i++) in[i] = (i * 11 + 2) % 256;
    struct fsdp_step_result res;
    CHECK_OK(fsdp_model_train_step(s, r.fm, in, in, 2, 8, 1e-3f, 1.0f, &res), s);
    run_close(&r);
    fsdp_ctx_free(s);
}

/* the entries of folder d, "." and ".." aside */
static int entries(const char *d) {
    DIR *dd = opendir(d);
    int n = 0;
    for (struct dirent *e; dd && (e = readdir(dd));) n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    if (dd) closedir(dd);
    return dd ? n : -1;
}

TEST(a_save_into_folders_the_ranks_do_not_share_is_named_and_leaves_nothing) {
    struct fsdp_ctx *c = get_ctx();
    if (fsdp_ctx_world(c) < 2) SKIP("a world of one");
    char base[] = "/tmp/fsdp_misuse_XXXXXX", ck[64];
    ASSERT(mkdtemp(base) != NULL); /* each rank its own: each host's own disk */
    snprintf(ck, sizeof ck, "%s/ck", base);
    /* the last rank's host already holds ck.tmp with a file of someone else's: it stays */
    int last = fsdp_ctx_rank(c) == fsdp_ctx_world(c) - 1;
    char tmpdir[80], notes[96];
    snprintf(tmpdir, sizeof tmpdir, "%s.tmp", ck);
    snprintf(notes, sizeof notes, "%s/notes.txt", tmpdir);
    if (last) {
        ASSERT(mkdir(tmpdir, 0755) == 0);
        FILE *f = fopen(notes, "w");
        ASSERT(f && fputs("mine\n", f) >= 0 && fclose(f) == 0);
    }
    struct run r;
    ASSERT_OK(run_open(c, 0, &r), c);
    enum fsdp_status st = fsdp_ckpt_save(c, r.fm, ck, NULL);
    CHECK_INT_EQ(st, FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "rank 1 wrote its file, but not into");
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "the ranks do not share the checkpoint folder");
    /* no ck and no ck.tmp of this save on any rank; the last rank's own ck.tmp keeps only the notes */
    CHECK_INT_EQ(entries(base), last ? 1 : 0);
    if (last) {
        CHECK_INT_EQ(entries(tmpdir), 1);
        char got[16] = "";
        FILE *f = fopen(notes, "r");
        CHECK(f && fgets(got, sizeof got, f));
        if (f) fclose(f);
        CHECK_STR_EQ(got, "mine\n");
        unlink(notes);
        rmdir(tmpdir);
    }
    rmdir(base);
    run_close(&r);
}

TEST(different_collectives_on_shm_fail_on_every_rank_naming_both) {
    struct fsdp_ctx *c = get_ctx();
    int rank = fsdp_ctx_rank(c), world = fsdp_ctx_world(c);
    if (world < 2) SKIP("a world of one");
    int last = rank == world - 1;
    const char *names[5] = {"count", "op", "dtype", "path", "one more"};
    for (int k = 0; k < 5; k++) {
        struct fsdp_ctx *s = shm_ctx_window(NULL);
        ASSERT(s != NULL);
        struct fsdp_comm *m = fsdp_ctx_comm(s);
        fsdp_comm_set_check(m, 0);
        fsdp_comm_set_timeout(m, 30); /* a regression times out (the case of another path hung) */
        size_t n = 40000; /* per rank: 160 KB of F32, past the single-copy threshold */
        float *in = calloc(n * (size_t)world, sizeof *in), *out = calloc(n * (size_t)world, sizeof *out);
        ASSERT(in && out);
        enum fsdp_status st = FSDP_OK;
        switch (k) {
        case 0: st = fsdp_comm_allgather(m, in, out, last ? 5 : 4, FSDP_F32); break;
        case 1: st = fsdp_comm_allreduce(m, in, out, 8, FSDP_F32, last ? FSDP_MAX : FSDP_SUM); break;
        case 2: st = fsdp_comm_allgather(m, in, out, 8, last ? FSDP_BF16 : FSDP_F32); break;
        case 3: st = fsdp_comm_reduce_scatter(m, in, out, last ? n : 8, FSDP_F32, FSDP_SUM); break;
        case 4:
            if (rank == 0) st = fsdp_comm_barrier(m);
            if (st == FSDP_OK) st = fsdp_comm_allreduce(m, in, out, 8, FSDP_F32, FSDP_SUM);
            break;
        }
        if (st != FSDP_ERR_COMM || !strstr(fsdp_errmsg(s), "the ranks run different collectives"))
            printf("case '%s' on rank %d: status %d, %s\n", names[k], rank, (int)st, fsdp_errmsg(s));
        CHECK_INT_EQ(st, FSDP_ERR_COMM);
        CHECK_STR_CONTAINS(fsdp_errmsg(s), "the ranks run different collectives");
        free(in);
        free(out);
        fsdp_ctx_free(s);
    }
}

TEST_MAIN()
