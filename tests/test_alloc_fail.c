/*
 * test_alloc_fail.c - allocation-failure injection: for every k, the k-th
 * library allocation (fsdp__alloc) of a training step of the tiny model at
 * one rank fails. Each time the step must return FSDP_ERR_NOMEM with a
 * message naming what was being allocated, leave the model usable (the next
 * step succeeds), and return every accounted byte when freed; under `make
 * asan` LeakSanitizer also checks that nothing else leaked. The same for
 * building and sharding the model and for a checkpoint's save and load. The
 * hook counts every allocation of the library: fsdp__alloc's accounted
 * blocks and fsdp__malloc's bookkeeping (cJSON's nodes included).
 */
#include "fsdp.h"
#include "harness.h"

#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif

/* internal (core-impl.h): the injection hook */
extern _Thread_local long fsdp__alloc_count, fsdp__alloc_fail_at;

struct rig {
    struct fsdp_ctx *ctx;
    struct fsdp_module *gpt;
    struct fsdp_model *fm;
    struct fsdp_optim *opt;
    size_t base; /* accounted bytes of the bare context */
};

/* The model: the tiny preset, or (small_model) one block of width 16 with a
 * vocabulary of 32, whose checkpoint holds few tensors. */
static int small_model;

static int rig_open(struct rig *r) {
    memset(r, 0, sizeof *r);
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.comm = FSDP_COMM_SELF;
    co.threads = 1;
    if (fsdp_ctx_create(&co, &r->ctx) != FSDP_OK) return 0;
    struct fsdp_mem_stats m;
    fsdp_mem_get(r->ctx, &m);
    r->base = m.cur_total;
    struct fsdp_gpt_config cfg;
    fsdp_gpt_config_preset("tiny", &cfg);
    if (small_model) cfg = (struct fsdp_gpt_config){1, 2, 16, 32, 16};
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    return fsdp_gpt_create(r->ctx, &cfg, &r->gpt) == FSDP_OK &&
           fsdp_fully_shard(r->ctx, r->gpt, NULL, &r->fm) == FSDP_OK &&
           fsdp_model_init_params(r->ctx, r->fm, 3) == FSDP_OK && fsdp_optim_create(r->ctx, &oo, &r->opt) == FSDP_OK &&
           fsdp_model_attach_optim(r->ctx, r->fm, r->opt) == FSDP_OK;
}

/* Frees the model; returns the accounted bytes left beyond the bare context
 * and its activation arena (0 when nothing leaked). */
static long long rig_close(struct rig *r) {
    fsdp_model_free(r->fm);
    fsdp_optim_free(r->opt);
    fsdp_module_free(r->gpt);
    struct fsdp_mem_stats m;
    fsdp_mem_get(r->ctx, &m);
    long long left = (long long)m.cur_total - (long long)m.cur[FSDP_MEM_ACT] - (long long)r->base;
    fsdp_ctx_free(r->ctx);
    return left;
}

static enum fsdp_status step_res(struct rig *r, struct fsdp_step_result *res) {
    enum { B = 2, T = 16 };
    int32_t in[B * T], tg[B * T];
    int V = small_model ? 32 : 256;
    for (int i = 0; i < B * T; i++) {
        in[i] = (i * 31 + 7) % V;
        tg[i] = (i * 17 + 1) % V;
    }
    return fsdp_model_train_step(r->ctx, r->fm, in, tg, B, T, 1e-3f, 1.0f, res);
}

static enum fsdp_status step(struct rig *r) {
    struct fsdp_step_result res;
    return step_res(r, &res);
}

TEST(every_allocation_of_a_step_fails_cleanly) {
    struct rig r;
    ASSERT(rig_open(&r));
    fsdp__alloc_count = 0;
    ASSERT_OK(step(&r), r.ctx);
    long n = fsdp__alloc_count;
    struct fsdp_step_result ref;
    ASSERT_OK(step_res(&r, &ref), r.ctx);
    CHECK_INT_EQ(rig_close(&r), 0);
    fprintf(stderr, "  a first training step makes %ld library allocations\n", n);
    ASSERT(n >= 3); /* at least the arena chunk header, the chunk and a comm request */
    int fallbacks = 0;
    for (long k = 1; k <= n; k++) {
        ASSERT(rig_open(&r));
        fsdp__alloc_count = 0;
        fsdp__alloc_fail_at = k;
        enum fsdp_status st = step(&r);
        fsdp__alloc_fail_at = 0;
        const char *msg = fsdp_errmsg(r.ctx);
        if (st != FSDP_OK && st != FSDP_ERR_NOMEM)
            TEST_FAILF("allocation %ld of %ld: got %s (%s), expected out of memory", k, n, fsdp_status_str(st), msg);
        else if (st != FSDP_OK && (!strstr(msg, "out of memory") || !strstr(msg, " for ")))
            TEST_FAILF("allocation %ld of %ld: message does not name the allocation: \"%s\"", k, n, msg);
        struct fsdp_step_result res;
        CHECK_OK(step_res(&r, &res), r.ctx); /* the model survives: the next step runs */
        /* a step that went on without the block (the optimizer's partial sums
         * have a second-pass fallback) must have computed the same update */
        if (st == FSDP_OK && (res.loss != ref.loss || res.grad_norm != ref.grad_norm))
            TEST_FAILF("allocation %ld of %ld: the step succeeded without it but the next step differs "
                       "(loss %.9g vs %.9g)", k, n, (double)res.loss, (double)ref.loss);
        fallbacks += st == FSDP_OK;
        long long left = rig_close(&r);
        if (left != 0) TEST_FAILF("allocation %ld of %ld: %lld accounted bytes not returned", k, n, left);
    }
    fprintf(stderr, "  %d of them have a fallback (the step succeeds, same values)\n", fallbacks);
    /* the failures reached the step: most have no fallback (a hook that
     * stopped failing would let every step succeed) */
    if (!(fallbacks <= n / 2)) TEST_FAILF("%d of %ld failed allocations let the step succeed", fallbacks, n);
#if defined(__SANITIZE_ADDRESS__)
    CHECK(__lsan_do_recoverable_leak_check() == 0);
#endif
}

/* The same while building the sharded model and attaching the optimizer:
 * the failing call reports it and nothing accounted is left behind. */
TEST(every_allocation_of_setup_fails_cleanly) {
    struct rig r;
    fsdp__alloc_count = 0;
    ASSERT(rig_open(&r));
    long n = fsdp__alloc_count;
    CHECK_INT_EQ(rig_close(&r), 0);
    for (long k = 1; k <= n; k++) {
        fsdp__alloc_count = 0;
        fsdp__alloc_fail_at = k;
        int ok = rig_open(&r);
        fsdp__alloc_fail_at = 0;
        if (ok) TEST_FAILF("allocation %ld of %ld failed but setup succeeded", k, n);
        else if (r.ctx && !strstr(fsdp_errmsg(r.ctx), "out of memory"))
            TEST_FAILF("allocation %ld of %ld: \"%s\"", k, n, fsdp_errmsg(r.ctx));
        if (r.ctx) {
            long long left = rig_close(&r);
            if (left != 0) TEST_FAILF("allocation %ld of %ld: %lld accounted bytes not returned", k, n, left);
        }
    }
#if defined(__SANITIZE_ADDRESS__)
    CHECK(__lsan_do_recoverable_leak_check() == 0);
#endif
}

/* The memory planner (--dry-run, --mem-limit): it builds a measuring
 * context and runs the real step there, so every allocation of both, and its
 * own bookkeeping (the saved buffers and dtypes it restores), fails in turn;
 * the plan reports out of memory, leaves the model as it was (the next plan
 * gives the same figures) and returns every byte. */
static enum fsdp_status plan_tiny(struct fsdp_ctx *c, struct fsdp_module *gpt, struct fsdp_mem_plan *p) {
    struct fsdp_shard_opts so = fsdp_shard_opts_default();
    return fsdp_plan_memory(c, gpt, &so, 2, 0, 2, 2, 16, 1, p);
}

TEST(every_allocation_of_a_plan_fails_cleanly) {
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.comm = FSDP_COMM_SELF;
    co.threads = 1;
    struct fsdp_ctx *c;
    ASSERT(fsdp_ctx_create(&co, &c) == FSDP_OK);
    struct fsdp_gpt_config cfg = {1, 2, 16, 32, 16};
    struct fsdp_module *gpt;
    ASSERT_OK(fsdp_gpt_create(c, &cfg, &gpt), c);
    struct fsdp_mem_stats m0, m1;
    fsdp_mem_get(c, &m0);
    struct fsdp_mem_plan ref, p;
    fsdp__alloc_count = 0;
    ASSERT_OK(plan_tiny(c, gpt, &ref), c);
    long n = fsdp__alloc_count;
    fprintf(stderr, "  a plan makes %ld library allocations\n", n);
    ASSERT(n >= 10);
    long failed = 0;
    for (long k = 1; k <= n; k++) {
        fsdp__alloc_count = 0;
        fsdp__alloc_fail_at = k;
        enum fsdp_status st = plan_tiny(c, gpt, &p);
        fsdp__alloc_fail_at = 0;
        failed += st == FSDP_ERR_NOMEM;
        if (st != FSDP_OK && st != FSDP_ERR_NOMEM)
            TEST_FAILF("allocation %ld of %ld: got %s (%s), expected out of memory", k, n, fsdp_status_str(st),
                       fsdp_errmsg(c));
        else if (st != FSDP_OK && !strstr(fsdp_errmsg(c), "out of memory"))
            TEST_FAILF("allocation %ld of %ld: \"%s\"", k, n, fsdp_errmsg(c));
        fsdp_mem_get(c, &m1);
        if (m1.cur_total != m0.cur_total)
            TEST_FAILF("allocation %ld of %ld: %lld accounted bytes left", k, n,
                       (long long)m1.cur_total - (long long)m0.cur_total);
        CHECK_OK(plan_tiny(c, gpt, &p), c); /* the model is as it was: the same plan */
        if (p.total != ref.total || p.act != ref.act || p.full != ref.full)
            TEST_FAILF("allocation %ld of %ld: the next plan gives %zu bytes, not %zu", k, n, p.total, ref.total);
    }
    if (!(failed > n / 2)) TEST_FAILF("only %ld of %ld failed allocations failed the plan", failed, n);
    fsdp_module_free(gpt);
    fsdp_ctx_free(c);
#if defined(__SANITIZE_ADDRESS__)
    CHECK(__lsan_do_recoverable_leak_check() == 0);
#endif
}

static void rm_rf(const char *p) {
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' '%s.tmp' '%s.old'", p, p, p);
    if (system(cmd) != 0) fprintf(stderr, "  (could not remove %s)\n", p);
}

/* A sharded checkpoint's save (rank file, meta.json through cJSON, the
 * folder swap) and load (meta.json's reader, the file's header, the pieces,
 * the optimizer state) of the rig's model. */
static enum fsdp_status save_load(struct rig *r, const char *dir) {
    struct fsdp_ckpt_meta m;
    memset(&m, 0, sizeof m);
    m.step = 1;
    m.seed = 3;
    m.config = (struct fsdp_gpt_config){1, 2, 16, 32, 16};
    m.has_config = 1;
    snprintf(m.model_json, sizeof m.model_json, "{\"note\": \"allocation failures\"}");
    enum fsdp_status st = fsdp_ckpt_save(r->ctx, r->fm, dir, &m);
    struct fsdp_ckpt_meta back;
    if (st == FSDP_OK) st = fsdp_ckpt_load(r->ctx, r->fm, dir, &back);
    return st;
}

/* The same for a checkpoint's save and load after a step (so with optimizer
 * state): the library's allocations, accounted or not (names, the files'
 * headers and meta.json as cJSON trees, the reader's tables), fail in turn;
 * the call reports out of memory, and the next save and load of the same
 * model succeed over whatever the failed one left. */
TEST(every_allocation_of_a_checkpoint_fails_cleanly) {
    char dir[256];
    snprintf(dir, sizeof dir, "%s/fsdp-alloc-fail-%d", access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp",
             (int)getpid());
    small_model = 1;
    struct rig r;
    ASSERT(rig_open(&r));
    ASSERT_OK(step(&r), r.ctx);
    rm_rf(dir);
    fsdp__alloc_count = 0;
    ASSERT_OK(save_load(&r, dir), r.ctx);
    long n = fsdp__alloc_count;
    CHECK_INT_EQ(rig_close(&r), 0);
    fprintf(stderr, "  a checkpoint save and load make %ld library allocations\n", n);
    ASSERT(n >= 100); /* meta.json's tree alone has more nodes */
    /* each of the first 600 (the save's tables, names and first file
     * header), then every 23rd: all ~5000 would take the suite minutes, and
     * the headers' and meta.json's nodes repeat per tensor, so a stride
     * prime to that period still reaches every kind of site */
    long every = n < 600 ? n : 600;
    for (long k = 1; k <= n; k += k < every ? 1 : 23) {
        ASSERT(rig_open(&r));
        ASSERT_OK(step(&r), r.ctx);
        fsdp__alloc_count = 0;
        fsdp__alloc_fail_at = k;
        enum fsdp_status st = save_load(&r, dir);
        fsdp__alloc_fail_at = 0;
        if (st != FSDP_ERR_NOMEM || !strstr(fsdp_errmsg(r.ctx), "out of memory"))
            TEST_FAILF("allocation %ld of %ld: got %s (%s), expected out of memory", k, n, fsdp_status_str(st),
                       fsdp_errmsg(r.ctx));
        CHECK_OK(save_load(&r, dir), r.ctx); /* nothing left in the way; the model survives */
        long long left = rig_close(&r);
        if (left != 0) TEST_FAILF("allocation %ld of %ld: %lld accounted bytes not returned", k, n, left);
    }
    rm_rf(dir);
#if defined(__SANITIZE_ADDRESS__)
    CHECK(__lsan_do_recoverable_leak_check() == 0);
#endif
}

/* internal (core-impl.h): accounted allocation */
void *fsdp__alloc(struct fsdp_ctx *ctx, size_t bytes, enum fsdp_mem_kind kind, const char *what);
void fsdp__free(struct fsdp_ctx *ctx, void *p);

/* Blocks on both sides of the 1 MiB line ([Note: large blocks are mapped]):
 * 64-byte aligned, writable to the last byte, accounted and returned exactly;
 * an injected failure and the memory limit refuse a large block cleanly. */
TEST(large_blocks_are_accounted_and_fail_cleanly) {
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.comm = FSDP_COMM_SELF;
    struct fsdp_ctx *ctx;
    ASSERT_OK(fsdp_ctx_create(&co, &ctx), NULL);
    struct fsdp_mem_stats m0, m;
    fsdp_mem_get(ctx, &m0);
    const size_t sizes[] = {((size_t)1 << 20) - 1, (size_t)1 << 20, ((size_t)3 << 20) + 5, 100};
    void *p[4];
    size_t sum = 0;
    for (int i = 0; i < 4; i++) {
        p[i] = fsdp__alloc(ctx, sizes[i], FSDP_MEM_OTHER, "test block");
        ASSERT(p[i] != NULL);
        CHECK_INT_EQ((long long)((uintptr_t)p[i] % 64), 0);
        memset(p[i], 0x5a, sizes[i]);
        sum += sizes[i];
    }
    for (int i = 0; i < 4; i++) CHECK_INT_EQ(((unsigned char *)p[i])[sizes[i] - 1], 0x5a);
    fsdp_mem_get(ctx, &m);
    CHECK_INT_EQ((long long)(m.cur_total - m0.cur_total), (long long)sum);
    for (int i = 0; i < 4; i++) fsdp__free(ctx, p[i]);
    fsdp_mem_get(ctx, &m);
    CHECK_INT_EQ((long long)m.cur_total, (long long)m0.cur_total);
    fsdp__alloc_fail_at = fsdp__alloc_count + 1;
    void *q = fsdp__alloc(ctx, (size_t)8 << 20, FSDP_MEM_OTHER, "injected block");
    fsdp__alloc_fail_at = 0;
    CHECK(q == NULL);
    CHECK(strstr(fsdp_errmsg(ctx), "out of memory allocating 8388608 bytes for injected block") != NULL);
    fsdp_mem_set_limit(ctx, m0.cur_total + ((size_t)4 << 20));
    q = fsdp__alloc(ctx, (size_t)8 << 20, FSDP_MEM_OTHER, "limited block");
    CHECK(q == NULL);
    CHECK(strstr(fsdp_errmsg(ctx), "limited block") != NULL);
    fsdp_mem_get(ctx, &m);
    CHECK_INT_EQ((long long)m.cur_total, (long long)m0.cur_total);
    fsdp_ctx_free(ctx);
}

/* The VmFlags of the mapping that holds p ("" when none is found). */
static void vm_flags(const void *p, char *flags, size_t n) {
    flags[0] = 0;
    FILE *f = fopen("/proc/self/smaps", "r");
    if (!f) return;
    char line[512];
    int in = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, '-') < strchr(line, ' '))
            in = (uintptr_t)p >= lo && (uintptr_t)p < hi;
        else if (in && !strncmp(line, "VmFlags:", 8)) {
            snprintf(flags, n, "%.200s", line + 8);
            break;
        }
    }
    fclose(f);
}

/* [Note: huge pages]: a mapped block of 2 MiB or more carries the huge-page
 * advice (VmFlags "hg"), a smaller one does not, and FSDP_THP=0 (read once per
 * process: checked in a child) turns the advice off. */
TEST(large_blocks_ask_for_huge_pages) {
#if defined(__SANITIZE_ADDRESS__)
    SKIP("sanitized builds allocate every block through malloc ([Note: large blocks are mapped])");
#else
    if (access("/sys/kernel/mm/transparent_hugepage/enabled", F_OK) != 0) SKIP("no transparent huge pages here");
    char fl[256];
    pid_t pid = fork();
    if (pid == 0) {
        setenv("FSDP_THP", "0", 1);
        void *q = fsdp__alloc(NULL, (size_t)4 << 20, FSDP_MEM_OTHER, "test block");
        vm_flags(q, fl, sizeof fl);
        _exit(q && fl[0] && !strstr(fl, " hg") ? 0 : 1);
    }
    int st = 0;
    ASSERT(pid > 0 && waitpid(pid, &st, 0) == pid);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0); /* FSDP_THP=0: a 4 MiB block without the advice */
    void *big = fsdp__alloc(NULL, (size_t)4 << 20, FSDP_MEM_OTHER, "test block");
    void *mid = fsdp__alloc(NULL, ((size_t)3 << 19), FSDP_MEM_OTHER, "test block"); /* 1.5 MiB: mapped, no advice */
    ASSERT(big && mid);
    vm_flags(big, fl, sizeof fl);
    CHECK_STR_CONTAINS(fl, " hg");
    vm_flags(mid, fl, sizeof fl);
    CHECK(fl[0] && !strstr(fl, " hg"));
    fsdp__free(NULL, big);
    fsdp__free(NULL, mid);
#endif
}

TEST_MAIN()
