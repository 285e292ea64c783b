/*
 * test_mpi_ckpt.c - checkpoints of a sharded model (src/fsdp/ckpt/ckpt.c), run by
 * tests/run.sh at 1, 2, 3 and 4 ranks: a sharded save at this world size
 * loads back bit for bit (parameters, AdamW m and v, step count) and training
 * continues with identical losses; the same folder loads at world size 1 in
 * every rank's own process (resharding N -> 1) with every parameter and
 * state element equal; the full safetensors file round-trips in both load
 * modes; mismatched models and missing files fail on every rank alike with a
 * message naming the file or parameter; the config's state_dict_type picks
 * what fsdp_model_save writes and load_monolith_rank0_only has only rank 0
 * open the file fsdp_model_load reads. Resharding to every M in 1..4 is
 * covered end to end by tests/t_ckpt.sh.
 */
#include "fsdp.h"
#include "fsdp/fsdp-impl.h"
#include "harness.h"

#include <mpi.h>
#include <sys/stat.h>

#include "mpi_harness.h"

/* A folder name every rank agrees on. */
static void shared_name(struct fsdp_ctx *c, const char *tag, char *buf, size_t n) {
    int pid = (int)getpid();
    fsdp_comm_broadcast(fsdp_ctx_comm(c), &pid, 1, FSDP_I32, 0);
    snprintf(buf, n, "/tmp/fsdp-ckpt-test-%d-w%d-%s", pid, fsdp_ctx_world(c), tag);
}

static void rm_rf(const char *p) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' '%s.tmp'", p, p);
    if (system(cmd) != 0) fprintf(stderr, "  (could not remove %s)\n", p);
}

struct trained {
    struct fsdp_module *gpt;
    struct fsdp_model *fm;
    struct fsdp_optim *opt;
};

static enum fsdp_status build(struct fsdp_ctx *c, const struct fsdp_gpt_config *cfg, struct trained *t) {
    memset(t, 0, sizeof *t);
    FSDP_TRY(fsdp_gpt_create(c, cfg, &t->gpt));
    FSDP_TRY(fsdp_fully_shard(c, t->gpt, NULL, &t->fm));
    FSDP_TRY(fsdp_model_init_params(c, t->fm, 7));
    FSDP_TRY(fsdp_optim_create(c, NULL, &t->opt));
    return fsdp_model_attach_optim(c, t->fm, t->opt);
}

static void destroy(struct trained *t) {
    fsdp_model_free(t->fm);
    fsdp_optim_free(t->opt);
    fsdp_module_free(t->gpt);
}

enum { B = 12, T = 16 };

static enum fsdp_status train(struct fsdp_ctx *c, struct trained *t, struct fsdp_data *d, int from, int to,
                              double *losses) {
    int world = fsdp_ctx_world(c), Bl = B / world;
    int32_t in[B * T], tg[B * T];
    for (int s = from; s < to; s++) {
        fsdp_data_batch(d, s, B, T, fsdp_ctx_rank(c), world, in, tg);
        struct fsdp_step_result r;
        FSDP_TRY(fsdp_model_train_step(c, t->fm, in, tg, Bl, T, 3e-3f, 1.0f, &r));
        losses[s - from] = r.loss;
    }
    return FSDP_OK;
}

static struct fsdp_gpt_config tiny(void) {
    struct fsdp_gpt_config g;
    fsdp_gpt_config_preset("tiny", &g);
    return g;
}

/* Bit-identical shards and optimizer state of two models at the same world size. */
static void check_same_shards(const struct trained *a, const struct trained *b) {
    for (int i = 0; i < a->fm->n_units; i++) {
        const struct fsdp__unit *u = &a->fm->units[i], *v = &b->fm->units[i];
        size_t n = (size_t)u->numel_shard * sizeof(float);
        if (memcmp(u->shard, v->shard, n)) TEST_FAILF("unit %d: parameter shard differs", i);
        if (memcmp(u->state, v->state, 2 * n)) TEST_FAILF("unit %d: AdamW state differs", i);
    }
    CHECK_INT_EQ(fsdp_optim_step_count(a->opt), fsdp_optim_step_count(b->opt));
}

TEST(sharded_save_load_resume_bit_identical) {
    struct fsdp_ctx *c = get_ctx();
    struct fsdp_gpt_config cfg = tiny();
    struct fsdp_data *d;
    ASSERT_OK(fsdp_data_synthetic(c, 3, 1 << 16, &d), c);
    struct trained a, b;
    ASSERT_OK(build(c, &cfg, &a), c);
    ASSERT_OK(build(c, &cfg, &b), c);
    double la[6], lb[3];
    ASSERT_OK(train(c, &a, d, 0, 3, la), c);
    char dir[256];
    shared_name(c, "rt", dir, sizeof dir);
    struct fsdp_ckpt_meta m = {0};
    m.step = 3;
    m.data_step = 3;
    m.seed = 7;
    m.has_config = 1;
    m.config = cfg;
    ASSERT_OK(fsdp_ckpt_save(c, a.fm, dir, &m), c);
    /* saving again over it swaps the folders atomically */
    ASSERT_OK(fsdp_ckpt_save(c, a.fm, dir, &m), c);
    /* the load writes every element of the shards and the state, the
     * padding's zeros included: b holds garbage (NaN bytes) there first */
    for (int i = 0; i < b.fm->n_units; i++) {
        struct fsdp__unit *u = &b.fm->units[i];
        memset(u->shard, 0xff, (size_t)u->numel_shard * sizeof(float));
        memset(u->state, 0xff, 2 * (size_t)u->numel_shard * sizeof(float));
    }
    struct fsdp_ckpt_meta got;
    ASSERT_OK(fsdp_ckpt_load(c, b.fm, dir, &got), c);
    CHECK_INT_EQ(got.step, 3);
    CHECK_INT_EQ(got.optim_step, 3);
    CHECK_INT_EQ(got.world, fsdp_ctx_world(c));
    CHECK_INT_EQ(got.seed, 7);
    CHECK(got.has_config && got.config.n_embd == cfg.n_embd);
    check_same_shards(&a, &b);
    /* continued training: the same losses, bit for bit */
    ASSERT_OK(train(c, &a, d, 3, 6, la + 3), c);
    ASSERT_OK(train(c, &b, d, 3, 6, lb), c);
    for (int i = 0; i < 3; i++)
        if (memcmp(&la[3 + i], &lb[i], sizeof(double))) TEST_FAILF("step %d: loss %.17g vs resumed %.17g", 4 + i, la[3 + i], lb[i]);
    check_same_shards(&a, &b);
    /* resharding N -> 1: every rank loads the folder alone into a world of
     * one and compares every element it owns at N */
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.comm = FSDP_COMM_SELF;
    co.threads = 1;
    struct fsdp_ctx *one;
    ASSERT_OK(fsdp_ctx_create(&co, &one), c);
    struct trained s1, sN;
    ASSERT_OK(build(one, &cfg, &s1), one);
    ASSERT_OK(build(c, &cfg, &sN), c);
    ASSERT_OK(fsdp_ckpt_load(one, s1.fm, dir, NULL), one);
    ASSERT_OK(fsdp_ckpt_load(c, sN.fm, dir, NULL), c);
    CHECK_INT_EQ(fsdp_optim_step_count(s1.opt), 3);
    int rank = fsdp_ctx_rank(c);
    long compared = 0;
    for (int i = 0; i < sN.fm->n_units; i++) {
        const struct fsdp__unit *u = &sN.fm->units[i], *w = &s1.fm->units[i];
        for (int64_t x = 0; x < u->numel_shard; x++) {
            int64_t flat = (int64_t)rank * u->numel_shard + x;
            if (flat >= u->numel_full) break;
            for (int q = 0; q < 3; q++) {
                const float *pa = q == 0 ? u->shard : u->state + (q - 1) * u->numel_shard;
                const float *pb = q == 0 ? w->shard : w->state + (q - 1) * w->numel_shard;
                if (memcmp(&pa[x], &pb[flat], sizeof(float))) {
                    TEST_FAILF("unit %d flat %lld array %d: %g at world %d vs %g at world 1", i, (long long)flat, q,
                               (double)pa[x], fsdp_ctx_world(c), (double)pb[flat]);
                    x = u->numel_shard;
                    break;
                }
                compared++;
            }
        }
    }
    CHECK(compared > 0);
    destroy(&s1);
    destroy(&sN);
    fsdp_ctx_free(one);
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0) rm_rf(dir);
    destroy(&a);
    destroy(&b);
    fsdp_data_free(d);
}

TEST(full_safetensors_round_trip_both_modes) {
    struct fsdp_ctx *c = get_ctx();
    struct fsdp_gpt_config cfg = tiny();
    struct trained a, b;
    ASSERT_OK(build(c, &cfg, &a), c);
    ASSERT_OK(build(c, &cfg, &b), c);
    struct fsdp_data *d;
    ASSERT_OK(fsdp_data_synthetic(c, 3, 1 << 16, &d), c);
    double l[2];
    ASSERT_OK(train(c, &a, d, 0, 2, l), c);
    char path[256];
    shared_name(c, "full.safetensors", path, sizeof path);
    ASSERT_OK(fsdp_model_save_full(c, a.fm, path), c);
    for (int mode = 0; mode < 2; mode++) {
        ASSERT_OK(fsdp_model_init_params(c, b.fm, 99), c);
        ASSERT_OK(fsdp_model_load_full(c, b.fm, path, mode), c);
        for (int i = 0; i < a.fm->n_units; i++)
            if (memcmp(a.fm->units[i].shard, b.fm->units[i].shard, (size_t)a.fm->units[i].numel_shard * sizeof(float)))
                TEST_FAILF("mode %d: unit %d differs after load_full", mode, i);
    }
    /* all units are sharded again: a step still works */
    ASSERT_OK(train(c, &b, d, 2, 3, l), c);
    MPI_Barrier(MPI_COMM_WORLD);
    if (fsdp_ctx_rank(c) == 0) unlink(path);
    destroy(&a);
    destroy(&b);
    fsdp_data_free(d);
}

TEST(mismatches_fail_alike_on_every_rank) {
    struct fsdp_ctx *c = get_ctx();
    struct fsdp_gpt_config cfg = tiny(), other = tiny();
    other.n_embd = cfg.n_embd * 2;
    struct trained a, b;
    ASSERT_OK(build(c, &cfg, &a), c);
    ASSERT_OK(build(c, &other, &b), c);
    char dir[256], path[600];
    shared_name(c, "mm", dir, sizeof dir);
    ASSERT_OK(fsdp_ckpt_save(c, a.fm, dir, NULL), c);
    CHECK_INT_EQ(fsdp_ckpt_load(c, b.fm, dir, NULL), FSDP_ERR_FORMAT);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "transformer.wte.weight': checkpoint shape [256, 32], model shape [256, 64]");
    /* the last rank's file disappears: every rank fails, naming it */
    int world = fsdp_ctx_world(c);
    snprintf(path, sizeof path, "%s/rank-%05d-of-%05d.safetensors", dir, world - 1, world);
    MPI_Barrier(MPI_COMM_WORLD);
    if (fsdp_ctx_rank(c) == 0) unlink(path);
    MPI_Barrier(MPI_COMM_WORLD);
    CHECK(fsdp_ckpt_load(c, a.fm, dir, NULL) != FSDP_OK);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "missing file");
    CHECK_STR_CONTAINS(fsdp_errmsg(c), path);
    /* not a checkpoint */
    CHECK_INT_EQ(fsdp_ckpt_load(c, a.fm, "/nonexistent/ckpt", NULL), FSDP_ERR_IO);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "/nonexistent/ckpt");
    /* a full file into the wrong model */
    snprintf(path, sizeof path, "%s.safetensors", dir);
    ASSERT_OK(fsdp_model_save_full(c, a.fm, path), c);
    CHECK_INT_EQ(fsdp_model_load_full(c, b.fm, path, 0), FSDP_ERR_FORMAT);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "needs [256, 64]");
    CHECK_INT_EQ(fsdp_model_load_full(c, b.fm, path, 1), FSDP_ERR_FORMAT);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), path);
    MPI_Barrier(MPI_COMM_WORLD);
    if (fsdp_ctx_rank(c) == 0) {
        rm_rf(dir);
        unlink(path);
    }
    destroy(&a);
    destroy(&b);
}

/* Every byte of meta.json flipped (world 1 only: one process does it all):
 * each load is rejected with a message naming meta.json, or (a flip that
 * changes nothing, e.g. the case of a hex digit it accepts) loads the same
 * values; never a silently different model or position. */
TEST(meta_json_every_byte_flip_rejected) {
    struct fsdp_ctx *c = get_ctx();
    if (fsdp_ctx_world(c) != 1) SKIP("the sweep needs no collective: it runs in the world of one");
    struct fsdp_gpt_config cfg = tiny();
    struct trained a, b;
    ASSERT_OK(build(c, &cfg, &a), c);
    ASSERT_OK(build(c, &cfg, &b), c);
    char dir[256], mpath[300];
    shared_name(c, "flip", dir, sizeof dir);
    struct fsdp_ckpt_meta m = {0};
    m.step = m.data_step = 5;
    ASSERT_OK(fsdp_ckpt_save(c, a.fm, dir, &m), c);
    snprintf(mpath, sizeof mpath, "%s/meta.json", dir);
    FILE *f = fopen(mpath, "r+b");
    ASSERT(f);
    static char orig[1 << 16];
    size_t n = fread(orig, 1, sizeof orig, f);
    ASSERT(n > 100 && n < sizeof orig);
    int rejected = 0, same = 0;
    /* every byte in the normal build; a sanitized build (about 100x slower per
     * load) takes every 37th byte so the sweep stays within the test timeout */
#if defined(__SANITIZE_ADDRESS__)
    const size_t stride = 37;
#else
    const size_t stride = 1;
#endif
    for (size_t i = 0; i < n; i += stride) {
        char x = (char)(orig[i] ^ 0x02);
        fseek(f, (long)i, SEEK_SET);
        fwrite(&x, 1, 1, f);
        fflush(f);
        struct fsdp_ckpt_meta got;
        for (int u = 0; u < b.fm->n_units; u++) /* a load that leaves b as it was differs from a */
            for (int64_t j = 0; j < b.fm->units[u].numel_shard; j++) b.fm->units[u].shard[j] = NAN;
        enum fsdp_status st = fsdp_ckpt_load(c, b.fm, dir, &got);
        if (st != FSDP_OK) {
            rejected++;
            if (!strstr(fsdp_errmsg(c), "meta.json")) TEST_FAILF("flip at %zu: message lacks meta.json: %s", i, fsdp_errmsg(c));
        } else {
            same++;
            int differs = got.step != 5 || got.data_step != 5;
            for (int u = 0; u < a.fm->n_units; u++)
                differs |= memcmp(a.fm->units[u].shard, b.fm->units[u].shard,
                                  (size_t)a.fm->units[u].numel_shard * sizeof(float)) != 0;
            if (differs) TEST_FAILF("flip at byte %zu of meta.json loaded a different checkpoint", i);
        }
        fseek(f, (long)i, SEEK_SET);
        fwrite(&orig[i], 1, 1, f);
        fflush(f);
    }
    fclose(f);
    printf("  meta.json %zu bytes: %d flips rejected, %d harmless\n", n, rejected, same);
    CHECK(rejected >= (int)((n + stride - 1) / stride) - 8);
    rm_rf(dir);
    destroy(&a);
    destroy(&b);
}

/* ---- The config's checkpoint kind (fsdp_model_save / fsdp_model_load) ---- */

/* A model prepared by fsdp_parallelize_model with pc (built-in init from seed). */
static enum fsdp_status build_pc(struct fsdp_ctx *c, const struct fsdp_gpt_config *cfg,
                                 const struct fsdp_parallel_config *pc, uint64_t seed, struct trained *t) {
    memset(t, 0, sizeof *t);
    struct fsdp_parallel_config p = *pc;
    p.seed = seed;
    FSDP_TRY(fsdp_gpt_create(c, cfg, &t->gpt));
    FSDP_TRY(fsdp_optim_create(c, NULL, &t->opt));
    return fsdp_parallelize_model(c, t->gpt, &p, t->opt, FSDP_F32, NULL, NULL, NULL, &t->fm);
}

static int same_params(const struct trained *a, const struct trained *b) {
    for (int i = 0; i < a->fm->n_units; i++)
        if (memcmp(a->fm->units[i].shard, b->fm->units[i].shard, (size_t)a->fm->units[i].numel_shard * sizeof(float)))
            return 0;
    return 1;
}

TEST(state_dict_type_chooses_what_save_writes) {
    struct fsdp_ctx *c = get_ctx();
    struct fsdp_gpt_config cfg = tiny();
    struct fsdp_data *d;
    ASSERT_OK(fsdp_data_synthetic(c, 3, 1 << 16, &d), c);
    const enum fsdp_state_dict_type kinds[2] = {FSDP_STATE_DICT_FULL, FSDP_STATE_DICT_SHARDED};
    for (int k = 0; k < 2; k++) {
        struct fsdp_parallel_config pc = fsdp_parallel_config_default();
        pc.state_dict_type = kinds[k];
        struct trained a, b;
        ASSERT_OK(build_pc(c, &cfg, &pc, 5, &a), c);
        ASSERT_OK(build_pc(c, &cfg, &pc, 9, &b), c);
        double l[2];
        ASSERT_OK(train(c, &a, d, 0, 2, l), c);
        CHECK(!same_params(&a, &b));
        char path[256];
        shared_name(c, k ? "sdt-sharded" : "sdt-full", path, sizeof path);
        struct fsdp_ckpt_meta m = {0};
        m.step = m.data_step = 2;
        ASSERT_OK(fsdp_model_save(c, a.fm, path, &m), c);
        struct stat sb;
        char meta[300];
        snprintf(meta, sizeof meta, "%s/meta.json", path);
        CHECK(stat(path, &sb) == 0);
        if (k == 0) CHECK(S_ISREG(sb.st_mode)); /* one safetensors file */
        else CHECK(S_ISDIR(sb.st_mode) && stat(meta, &sb) == 0); /* the folder, with meta.json */
        struct fsdp_ckpt_meta got;
        ASSERT_OK(fsdp_model_load(c, b.fm, path, &got), c);
        if (!same_params(&a, &b)) TEST_FAILF("%s: the loaded parameters differ", k ? "sharded" : "full");
        /* the sharded kind carries the step and the optimizer's state, the full one neither */
        CHECK_INT_EQ(got.step, k ? 2 : 0);
        CHECK_INT_EQ(fsdp_optim_step_count(b.opt), k ? 2 : 0);
        MPI_Barrier(MPI_COMM_WORLD);
        if (fsdp_ctx_rank(c) == 0) rm_rf(path);
        destroy(&a);
        destroy(&b);
    }
    fsdp_data_free(d);
}

/* load_monolith_rank0_only: only rank 0 opens the file, so the other ranks
 * may name one that does not exist; without it they fail, naming it. */
TEST(load_monolith_rank0_only_reads_on_rank_0_alone) {
    struct fsdp_ctx *c = get_ctx();
    int rank = fsdp_ctx_rank(c), world = fsdp_ctx_world(c);
    struct fsdp_gpt_config cfg = tiny();
    struct fsdp_parallel_config pc = fsdp_parallel_config_default();
    struct trained a, b, n;
    ASSERT_OK(build_pc(c, &cfg, &pc, 5, &a), c);
    char path[256], nowhere[300];
    shared_name(c, "monolith.safetensors", path, sizeof path);
    snprintf(nowhere, sizeof nowhere, "%s.only-rank-0-has-it", path);
    ASSERT_OK(fsdp_model_save_full(c, a.fm, path), c);
    const char *mine = rank == 0 ? path : nowhere;
    pc.load_monolith_rank0_only = 1;
    ASSERT_OK(build_pc(c, &cfg, &pc, 9, &b), c);
    ASSERT_OK(fsdp_model_load(c, b.fm, mine, NULL), c);
    if (!same_params(&a, &b)) TEST_FAILF("rank 0's file did not reach every rank's shards");
    pc.load_monolith_rank0_only = 0;
    ASSERT_OK(build_pc(c, &cfg, &pc, 9, &n), c);
    enum fsdp_status st = fsdp_model_load(c, n.fm, mine, NULL);
    if (world > 1) {
        CHECK(st != FSDP_OK); /* on every rank alike */
        CHECK(strstr(fsdp_errmsg(c), "only-rank-0-has-it") != NULL);
    } else {
        CHECK_INT_EQ(st, FSDP_OK);
    }
    /* a missing file on rank 0 fails on every rank alike */
    st = fsdp_model_load(c, b.fm, nowhere, NULL);
    CHECK(st != FSDP_OK);
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0) unlink(path);
    destroy(&a);
    destroy(&b);
    destroy(&n);
}

TEST(one_mixed_precision_default) {
    /* Composer's DEFAULT (parameters low, reduction fp32) for the config and the shard options alike */
    CHECK_INT_EQ(fsdp_parallel_config_default().mixed_precision, FSDP_MP_DEFAULT);
    CHECK_INT_EQ(fsdp_shard_opts_default().mixed_precision, FSDP_MP_DEFAULT);
}

TEST_MAIN()
