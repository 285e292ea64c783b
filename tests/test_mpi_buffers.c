/*
 * test_mpi_buffers.c - module buffers through the sharded model at 1-4
 * ranks ([Note: buffers] in src/fsdp/buffers.c): sync_module_states
 * broadcasts rank 0's; full and sharded checkpoints carry the persistent
 * ones, F32 and I64, and load them at another world size (the job's world,
 * a world of one, and the shard groups of NO_SHARD and HYBRID_SHARD);
 * exact resume includes them; the offline tools (to-full, to-sharded,
 * describe, verify) keep them; a missing buffer is an error naming it.
 */
#include "fsdp.h"
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function" /* toy.h's helpers this file does not use */
#include "../examples/toy.h" /* before mpi_harness.h, whose global ctx its parameters would shadow */
#pragma GCC diagnostic pop
#include "toy_norm.h"
#include "io/io-impl.h"
#include "harness.h"
#include "mpi_harness.h"

#include <sys/stat.h>

struct run {
    struct fsdp_module *root;
    struct fsdp_optim *opt;
    struct fsdp_model *fm;
};

struct prep {
    enum fsdp_sharding sharding;
    int hybrid_group;  /* HYBRID_SHARD's shard group (0: none) */
    int sync;          /* sync_module_states (the root must be materialized on rank 0) */
    int extra_buffer;  /* one more persistent buffer ("norm.extra") than the checkpoints have */
    enum fsdp_dtype precision;
};

static enum fsdp_status prepare(struct fsdp_ctx *c, struct run *r, const struct prep *p,
                                void (*before)(struct fsdp_ctx *, struct fsdp_module *)) {
    memset(r, 0, sizeof *r);
    r->root = build(c);
    if (p->extra_buffer) {
        int64_t s[1] = {3};
        struct fsdp_init z = {FSDP_INIT_ZEROS, 0};
        struct fsdp_module *norm = r->root->children[1];
        fsdp_module_add_buffer(c, norm, "extra", FSDP_F32, 1, s, z, 1, NULL);
        fsdp_module_finalize(c, r->root);
    }
    if (before) before(c, r->root);
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    if (fsdp_optim_create(c, &oo, &r->opt) != FSDP_OK) return FSDP_ERR_NOMEM;
    struct fsdp_parallel_config pc = fsdp_parallel_config_default();
    pc.sharding = p->sharding;
    pc.sync_module_states = p->sync;
    if (p->hybrid_group) {
        pc.mesh[0] = fsdp_ctx_world(c) / p->hybrid_group;
        pc.mesh[1] = p->hybrid_group;
    }
    if (p->precision != FSDP_F32) pc.mixed_precision = FSDP_MP_DEFAULT;
    struct fsdp_wrap_policy wp = {wrap_children, NULL};
    return fsdp_parallelize_model(c, r->root, &pc, r->opt, p->precision, &wp, NULL, NULL, &r->fm);
}

static void finish(struct run *r) {
    fsdp_model_free(r->fm);
    fsdp_optim_free(r->opt);
    fsdp_module_free(r->root);
}

static enum fsdp_status train(struct fsdp_ctx *c, struct run *r, int step0, int steps) {
    int world = fsdp_ctx_world(c), rank = fsdp_ctx_rank(c), Bl = B / world;
    int32_t in[B * T], tg[B * T];
    for (int s = step0; s < step0 + steps; s++) {
        toy_batch(s, B, T, V, rank, world, in, tg);
        struct fsdp_step_result res;
        enum fsdp_status st = fsdp_model_train_step(c, r->fm, in, tg, Bl, T, 0.05f, 1.0f, &res);
        if (st != FSDP_OK) return st;
    }
    return FSDP_OK;
}

static struct fsdp_ctx *self_ctx(void) {
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.threads = 1;
    co.comm = FSDP_COMM_SELF;
    struct fsdp_ctx *c = NULL;
    if (fsdp_ctx_create(&co, &c) != FSDP_OK) abort();
    return c;
}

static const char *const pnames[] = {"embed.weight", "norm.weight", "norm.bias", "head.weight", "head.bias"};
static const char *const bnames[] = {"norm.running_mean", "norm.running_var", "norm.num_batches_tracked"};

/* Every parameter and persistent buffer of a and b, bit for bit. */
static void same_bits(struct run *a, struct fsdp_ctx *ca, struct run *b, struct fsdp_ctx *cb, const char *what) {
    float x[V * C], y[V * C];
    for (int i = 0; i < 5; i++) {
        int64_t n = fsdp_module_find_param(a->root, pnames[i])->numel;
        CHECK_OK(fsdp_model_get_param(ca, a->fm, pnames[i], x), ca);
        CHECK_OK(fsdp_model_get_param(cb, b->fm, pnames[i], y), cb);
        if (memcmp(x, y, (size_t)n * sizeof(float))) TEST_FAILF("%s: parameter %s differs", what, pnames[i]);
    }
    for (int i = 0; i < 3; i++) {
        struct fsdp_buffer *p = fsdp_module_find_buffer(a->root, bnames[i]), *q = fsdp_module_find_buffer(b->root, bnames[i]);
        if (!p || !q || memcmp(p->data, q->data, (size_t)p->numel * fsdp_dtype_size(p->dtype)))
            TEST_FAILF("%s: buffer %s differs", what, bnames[i]);
    }
}

static int64_t nbt(struct run *r) {
    return *(int64_t *)fsdp_module_find_buffer(r->root, "norm.num_batches_tracked")->data;
}

/* A folder name shared by the ranks of this job (rank 0's pid). */
static void tmp_name(struct fsdp_ctx *c, char *buf, size_t n, const char *what) {
    int32_t pid = (int32_t)getpid();
    fsdp_comm_broadcast(fsdp_ctx_comm(c), &pid, 1, FSDP_I32, 0);
    snprintf(buf, n, "/tmp/fsdp_test_buffers_%d_%s", (int)pid, what);
}

static void rm_rf(const char *path) {
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' '%s.tmp'", path, path);
    if (system(cmd) != 0) fprintf(stderr, "cannot remove %s\n", path);
}

/* ---- sync_module_states ---- */

/* rank 0: materialized, buffers set to values no init gives; the others:
 * shapes only, buffers holding garbage */
static void rank0_values(struct fsdp_ctx *c, struct fsdp_module *root) {
    struct fsdp_buffer *rm = fsdp_module_find_buffer(root, "norm.running_mean");
    struct fsdp_buffer *n = fsdp_module_find_buffer(root, "norm.num_batches_tracked");
    int rank = fsdp_ctx_rank(c);
    if (rank == 0) fsdp_module_materialize(c, root, 99);
    for (int k = 0; k < C; k++) ((float *)rm->data)[k] = rank == 0 ? 0.5f + (float)k : -7.0f * (float)(rank + 1);
    *(int64_t *)n->data = rank == 0 ? INT64_C(1) << 40 : rank;
}

TEST(sync_module_states_broadcasts_buffers) {
    struct fsdp_ctx *c = get_ctx();
    struct run r;
    struct prep p = {FSDP_FULL_SHARD, 0, 1, 0, FSDP_F32};
    ASSERT_OK(prepare(c, &r, &p, rank0_values), c);
    float *rm = fsdp_module_find_buffer(r.root, "norm.running_mean")->data;
    for (int k = 0; k < C; k++) CHECK_NEAR(rm[k], 0.5 + k, 0, 0);
    CHECK_INT_EQ(nbt(&r), INT64_C(1) << 40);
    CHECK_OK(train(c, &r, 0, 1), c);
    CHECK_INT_EQ(nbt(&r), (INT64_C(1) << 40) + 1);
    finish(&r);
}

static void rank1_extra(struct fsdp_ctx *c, struct fsdp_module *root) {
    if (fsdp_ctx_rank(c) != 1) return;
    int64_t s[2] = {2, 2};
    struct fsdp_init z = {FSDP_INIT_ZEROS, 0};
    fsdp_module_add_buffer(c, root->children[2], "queue", FSDP_F32, 2, s, z, 1, NULL);
    fsdp_module_finalize(c, root);
}

TEST(buffers_differing_across_ranks_are_named) {
    struct fsdp_ctx *c = get_ctx();
    if (fsdp_ctx_world(c) < 2) SKIP("needs 2+ ranks");
    struct run r;
    struct prep p = {FSDP_FULL_SHARD, 0, 0, 0, FSDP_F32};
    CHECK_INT_EQ(prepare(c, &r, &p, rank1_extra), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "buffer #4 is (no such buffer) on rank 0 but 'head.queue' (F32 [2, 2]) on rank 1");
    fsdp_optim_free(r.opt);
    fsdp_module_free(r.root);
}

/* ---- Full checkpoints ---- */

TEST(full_checkpoint_carries_buffers) {
    struct fsdp_ctx *c = get_ctx(), *one = self_ctx();
    char path[256];
    tmp_name(c, path, sizeof path, "full.safetensors");
    struct run r, s, t;
    struct prep p = {FSDP_FULL_SHARD, 0, 0, 0, FSDP_BF16}; /* buffers stay F32 / I64 under mixed precision */
    ASSERT_OK(prepare(c, &r, &p, NULL), c);
    CHECK_OK(train(c, &r, 0, 2), c);
    CHECK_INT_EQ(nbt(&r), 2);
    CHECK_OK(fsdp_model_save_full(c, r.fm, path), c);
    /* at the job's world size, every rank reading and rank 0 sending */
    for (int rank0 = 0; rank0 < 2; rank0++) {
        ASSERT_OK(prepare(c, &s, &p, NULL), c);
        CHECK_OK(fsdp_model_load_full(c, s.fm, path, rank0), c);
        same_bits(&r, c, &s, c, rank0 ? "load_full rank 0" : "load_full");
        finish(&s);
    }
    /* at a world of one */
    p.precision = FSDP_F32;
    ASSERT_OK(prepare(one, &t, &p, NULL), one);
    CHECK_OK(fsdp_model_load_full(one, t.fm, path, 0), one);
    same_bits(&r, c, &t, one, "load_full at 1 rank");
    finish(&t);
    /* the file: F32 statistics, an I64 count, the non-persistent scratch left out */
    if (fsdp_ctx_rank(c) == 0) {
        char desc[8192] = "";
        FILE *mf = fmemopen(desc, sizeof desc - 1, "w");
        CHECK_OK(fsdp_ckpt_describe(one, path, 1, mf), one);
        fclose(mf);
        CHECK_STR_CONTAINS(desc, "norm.num_batches_tracked");
        CHECK_STR_CONTAINS(desc, "I64");
        CHECK_STR_CONTAINS(desc, "fsdp.buffers = norm.running_mean,norm.running_var,norm.num_batches_tracked");
        CHECK(strstr(desc, "scratch") == NULL);
    }
    /* a model with a buffer the file lacks: an error naming it, on every rank */
    p.extra_buffer = 1;
    ASSERT_OK(prepare(c, &s, &p, NULL), c);
    CHECK_INT_EQ(fsdp_model_load_full(c, s.fm, path, 0), FSDP_ERR_FORMAT);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "buffer 'norm.extra' is not in the file");
    finish(&s);
    finish(&r);
    fsdp_comm_barrier(fsdp_ctx_comm(c));
    if (fsdp_ctx_rank(c) == 0) remove(path);
    fsdp_ctx_free(one);
}

/* ---- Sharded checkpoints ---- */

/* Saves r at this job (its shard group's files), then loads into a fresh
 * model at the job's world size (FULL_SHARD) and at a world of one: both
 * must hold r's bits. */
static void roundtrip(struct fsdp_ctx *c, struct fsdp_ctx *one, struct run *r, const char *dir, const char *what) {
    struct fsdp_ckpt_meta m = {0};
    m.step = 2;
    CHECK_OK(fsdp_ckpt_save(c, r->fm, dir, &m), c);
    struct run s;
    struct prep p = {FSDP_FULL_SHARD, 0, 0, 0, FSDP_F32};
    ASSERT_OK(prepare(c, &s, &p, NULL), c);
    CHECK_OK(fsdp_ckpt_load(c, s.fm, dir, NULL), c);
    same_bits(r, c, &s, c, what);
    finish(&s);
    ASSERT_OK(prepare(one, &s, &p, NULL), one);
    CHECK_OK(fsdp_ckpt_load(one, s.fm, dir, NULL), one);
    same_bits(r, c, &s, one, what);
    finish(&s);
}

static void check_sharded(enum fsdp_sharding sh, int hybrid_group) {
    struct fsdp_ctx *c = get_ctx(), *one = self_ctx();
    char dir[256];
    tmp_name(c, dir, sizeof dir, "sharded");
    struct run r;
    struct prep p = {sh, hybrid_group, 0, 0, FSDP_F32};
    ASSERT_OK(prepare(c, &r, &p, NULL), c);
    CHECK_OK(train(c, &r, 0, 2), c);
    roundtrip(c, one, &r, dir, fsdp_sharding_name(sh));
    finish(&r);
    fsdp_comm_barrier(fsdp_ctx_comm(c));
    if (fsdp_ctx_rank(c) == 0) rm_rf(dir);
    fsdp_ctx_free(one);
}

TEST(sharded_checkpoint_full_shard_any_world) { check_sharded(FSDP_FULL_SHARD, 0); }
TEST(sharded_checkpoint_no_shard_one_file) { check_sharded(FSDP_NO_SHARD, 0); }
TEST(sharded_checkpoint_hybrid_two_files) {
    if (fsdp_ctx_world(get_ctx()) != 4) SKIP("HYBRID_SHARD {2 x 2} needs 4 ranks");
    check_sharded(FSDP_HYBRID_SHARD, 2);
}

/* Saved at a world of one (rank 0 writes), loaded at the job's world size. */
TEST(sharded_checkpoint_from_one_rank) {
    struct fsdp_ctx *c = get_ctx(), *one = self_ctx();
    char dir[256];
    tmp_name(c, dir, sizeof dir, "from_one");
    struct run r, s;
    struct prep p = {FSDP_FULL_SHARD, 0, 0, 0, FSDP_F32};
    ASSERT_OK(prepare(one, &r, &p, NULL), one);
    CHECK_OK(train(one, &r, 0, 2), one);
    if (fsdp_ctx_rank(c) == 0) CHECK_OK(fsdp_ckpt_save(one, r.fm, dir, NULL), one);
    fsdp_comm_barrier(fsdp_ctx_comm(c));
    ASSERT_OK(prepare(c, &s, &p, NULL), c);
    CHECK_OK(fsdp_ckpt_load(c, s.fm, dir, NULL), c);
    same_bits(&r, one, &s, c, "saved at 1 rank");
    CHECK_INT_EQ(nbt(&s), 2);
    finish(&s);
    finish(&r);
    fsdp_comm_barrier(fsdp_ctx_comm(c));
    if (fsdp_ctx_rank(c) == 0) rm_rf(dir);
    fsdp_ctx_free(one);
}

/* 2 steps, save, a fresh model loads, 2 more: the same bits as 4 straight. */
TEST(exact_resume_includes_buffers) {
    struct fsdp_ctx *c = get_ctx();
    char dir[256];
    tmp_name(c, dir, sizeof dir, "resume");
    struct run a, b;
    struct prep p = {FSDP_FULL_SHARD, 0, 0, 0, FSDP_F32};
    ASSERT_OK(prepare(c, &a, &p, NULL), c);
    CHECK_OK(train(c, &a, 0, 4), c);
    ASSERT_OK(prepare(c, &b, &p, NULL), c);
    CHECK_OK(train(c, &b, 0, 2), c);
    CHECK_OK(fsdp_ckpt_save(c, b.fm, dir, NULL), c);
    finish(&b);
    ASSERT_OK(prepare(c, &b, &p, NULL), c);
    CHECK_OK(fsdp_ckpt_load(c, b.fm, dir, NULL), c);
    CHECK_INT_EQ(nbt(&b), 2);
    CHECK_OK(train(c, &b, 2, 2), c);
    same_bits(&a, c, &b, c, "resumed");
    CHECK_INT_EQ(nbt(&b), 4);
    finish(&a);
    finish(&b);
    fsdp_comm_barrier(fsdp_ctx_comm(c));
    if (fsdp_ctx_rank(c) == 0) rm_rf(dir);
}

/* to-full, to-sharded (3 files), describe, verify keep the buffers; a
 * buffer missing from a checkpoint is named. */
TEST(offline_tools_and_missing_buffer) {
    struct fsdp_ctx *c = get_ctx(), *one = self_ctx();
    char dir[256], full[256], dir3[256];
    tmp_name(c, dir, sizeof dir, "off");
    tmp_name(c, full, sizeof full, "off.safetensors");
    tmp_name(c, dir3, sizeof dir3, "off3");
    struct run r, s;
    struct prep p = {FSDP_FULL_SHARD, 0, 0, 0, FSDP_F32};
    ASSERT_OK(prepare(c, &r, &p, NULL), c);
    CHECK_OK(train(c, &r, 0, 3), c);
    CHECK_OK(fsdp_ckpt_save(c, r.fm, dir, NULL), c);
    if (fsdp_ctx_rank(c) == 0) {
        char desc[16384] = "";
        FILE *mf = fmemopen(desc, sizeof desc - 1, "w");
        CHECK_OK(fsdp_ckpt_describe(one, dir, 1, mf), one);
        fclose(mf);
        CHECK_STR_CONTAINS(desc, "norm.num_batches_tracked");
        CHECK_STR_CONTAINS(desc, "3 buffers");
        CHECK_STR_CONTAINS(desc, "verified: ok");
        CHECK_OK(fsdp_ckpt_to_full(one, dir, full), one);
        CHECK_OK(fsdp_ckpt_from_full(one, full, dir3, 3), one);
    }
    fsdp_comm_barrier(fsdp_ctx_comm(c));
    ASSERT_OK(prepare(c, &s, &p, NULL), c);
    CHECK_OK(fsdp_model_load_full(c, s.fm, full, 0), c);
    same_bits(&r, c, &s, c, "to-full");
    finish(&s);
    ASSERT_OK(prepare(c, &s, &p, NULL), c);
    CHECK_OK(fsdp_ckpt_load(c, s.fm, dir3, NULL), c);
    same_bits(&r, c, &s, c, "to-sharded");
    finish(&s);
    /* the model has a buffer the checkpoint lacks */
    p.extra_buffer = 1;
    ASSERT_OK(prepare(c, &s, &p, NULL), c);
    CHECK_INT_EQ(fsdp_ckpt_load(c, s.fm, dir, NULL), FSDP_ERR_FORMAT);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "buffer 'norm.extra' of the model is not in the checkpoint");
    finish(&s);
    /* the checkpoint has a buffer the model lacks */
    struct fsdp_ckpt_meta m = {0};
    ASSERT_OK(prepare(c, &s, &p, NULL), c);
    CHECK_OK(fsdp_ckpt_save(c, s.fm, dir3, &m), c);
    finish(&s);
    p.extra_buffer = 0;
    ASSERT_OK(prepare(c, &s, &p, NULL), c);
    CHECK_INT_EQ(fsdp_ckpt_load(c, s.fm, dir3, NULL), FSDP_ERR_FORMAT);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "the checkpoint has buffer 'norm.extra', which the model lacks");
    finish(&s);
    finish(&r);
    fsdp_comm_barrier(fsdp_ctx_comm(c));
    if (fsdp_ctx_rank(c) == 0) {
        rm_rf(dir);
        rm_rf(dir3);
        remove(full);
    }
    fsdp_ctx_free(one);
}

/* A state dict exported from PyTorch: no fsdp.buffers key, batch norm's
 * statistics F32 and num_batches_tracked an I64 scalar. load_full imports
 * the buffers by FQN; to-sharded tells them from parameters by dtype and
 * name. */
TEST(pytorch_state_dict_import) {
    struct fsdp_ctx *c = get_ctx(), *one = self_ctx();
    char path[256], dir[256];
    tmp_name(c, path, sizeof path, "torch.safetensors");
    tmp_name(c, dir, sizeof dir, "torch_sharded");
    float emb[V * C], hw[V * C], hb[V], nw[C], nb[C], rm[C], rv[C];
    for (int i = 0; i < V * C; i++) emb[i] = 0.01f * (float)i, hw[i] = -0.02f * (float)i;
    for (int i = 0; i < V; i++) hb[i] = (float)i;
    for (int k = 0; k < C; k++) nw[k] = 1.5f, nb[k] = 0.25f, rm[k] = (float)k / 3.0f, rv[k] = 2.0f + (float)k;
    int64_t count = 12345;
    const void *data[8] = {emb, nw, nb, rm, rv, &count, hw, hb};
    struct fsdp__st_desc d[8] = {{"embed.weight", FSDP_F32, 2, {V, C}}, {"norm.weight", FSDP_F32, 1, {C}},
                                 {"norm.bias", FSDP_F32, 1, {C}}, {"norm.running_mean", FSDP_F32, 1, {C}},
                                 {"norm.running_var", FSDP_F32, 1, {C}}, {"norm.num_batches_tracked", FSDP_I64, 0, {0}},
                                 {"head.weight", FSDP_F32, 2, {V, C}}, {"head.bias", FSDP_F32, 1, {V}}};
    if (fsdp_ctx_rank(c) == 0) {
        const char *kv[] = {"format", "pt", "fsdp.linear_layout", "out,in"};
        struct fsdp__st_writer *w = NULL;
        CHECK_OK(fsdp__st_writer_open(one, path, 8, d, 2, kv, &w), one);
        for (int i = 0; i < 8 && w; i++) {
            int64_t n = 1;
            for (int k = 0; k < d[i].ndim; k++) n *= d[i].shape[k];
            CHECK_OK(fsdp__st_writer_write(w, data[i], (size_t)n * fsdp_dtype_size(d[i].dtype)), one);
        }
        if (w) CHECK_OK(fsdp__st_writer_commit(w), one);
        CHECK_OK(fsdp_ckpt_from_full(one, path, dir, 2), one);
    }
    fsdp_comm_barrier(fsdp_ctx_comm(c));
    struct prep p = {FSDP_FULL_SHARD, 0, 0, 0, FSDP_F32};
    for (int how = 0; how < 2; how++) {
        struct run r;
        ASSERT_OK(prepare(c, &r, &p, NULL), c);
        if (how == 0) CHECK_OK(fsdp_model_load_full(c, r.fm, path, 0), c);
        else CHECK_OK(fsdp_ckpt_load(c, r.fm, dir, NULL), c);
        CHECK_INT_EQ(nbt(&r), 12345);
        CHECK(memcmp(fsdp_module_find_buffer(r.root, "norm.running_var")->data, rv, sizeof rv) == 0);
        CHECK(memcmp(fsdp_module_find_buffer(r.root, "norm.running_mean")->data, rm, sizeof rm) == 0);
        float x[V * C];
        CHECK_OK(fsdp_model_get_param(c, r.fm, "head.weight", x), c);
        CHECK(memcmp(x, hw, sizeof hw) == 0);
        finish(&r);
    }
    fsdp_comm_barrier(fsdp_ctx_comm(c));
    if (fsdp_ctx_rank(c) == 0) {
        remove(path);
        rm_rf(dir);
    }
    fsdp_ctx_free(one);
}

TEST_MAIN()
