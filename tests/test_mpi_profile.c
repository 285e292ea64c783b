/*
 * test_mpi_profile.c - time by module ([Note: module profile],
 * src/nn/profile.c), run by tests/run.sh at 1..4 ranks, on the tiny GPT
 * wrapped by Block: the entries fold a stack's layers into one path and
 * count their calls (a checkpointed Block's recompute as its children's
 * forward calls),
 * the times are the dispatches' own (none negative, their sum within the
 * steps' wall time, the Blocks' FSDP hooks apart: their gathers at two ranks
 * and more), a paused profile counts nothing and a clear empties it.
 */
#include "fsdp.h"
#include "harness.h"

#include <math.h>
#include <string.h>
#include <time.h>

#include "mpi_harness.h"

static void mark_blocks(struct fsdp_module *m) {
    if (!strcmp(m->ops->type, "Block")) m->checkpoint = 1;
    for (int i = 0; i < m->n_children; i++) mark_blocks(m->children[i]);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

struct run {
    struct fsdp_module *g;
    struct fsdp_model *fm;
    struct fsdp_optim *opt;
    int n_layer;
};

static void run_open(struct run *r, int ac) {
    struct fsdp_ctx *c = get_ctx();
    struct fsdp_gpt_config cfg;
    fsdp_gpt_config_preset("tiny", &cfg);
    r->n_layer = cfg.n_layer;
    if (fsdp_gpt_create(c, &cfg, &r->g) != FSDP_OK) abort();
    if (ac) mark_blocks(r->g);
    struct fsdp_shard_opts so = fsdp_shard_opts_default();
    if (fsdp_fully_shard(c, r->g, &so, &r->fm) != FSDP_OK) abort();
    if (fsdp_model_init_params(c, r->fm, 3) != FSDP_OK) abort();
    struct fsdp_optim_opts oo = fsdp_optim_opts_default();
    if (fsdp_optim_create(c, &oo, &r->opt) != FSDP_OK || fsdp_model_attach_optim(c, r->fm, r->opt) != FSDP_OK)
        abort();
}

/* `steps` training steps; their wall time */
static double run_steps(struct run *r, int steps) {
    struct fsdp_ctx *c = get_ctx();
    int32_t in[2 * 16], tg[2 * 16];
    double t0 = now();
    for (int s = 0; s < steps; s++) {
        for (int i = 0; i < 2 * 16; i++) in[i] = (i * 7 + s) % 64, tg[i] = (i * 5 + 2 * s) % 64;
        struct fsdp_step_result res;
        if (fsdp_model_train_step(c, r->fm, in, tg, 2, 16, 1e-3f, 1.0f, &res) != FSDP_OK) abort();
    }
    return now() - t0;
}

static void run_close(struct run *r) {
    fsdp_model_free(r->fm);
    fsdp_optim_free(r->opt);
    fsdp_module_free(r->g);
}

static const struct fsdp_profile_entry *find(const char *path) {
    int n;
    const struct fsdp_profile_entry *e = fsdp_profile_entries(get_ctx(), &n);
    for (int i = 0; i < n; i++)
        if (!strcmp(e[i].path, path)) return &e[i];
    return NULL;
}

/* each entry's calls: (path, type, forward calls, backward calls) for `steps` steps */
static void check_calls(const char *path, const char *type, long fwd, long bwd) {
    const struct fsdp_profile_entry *e = find(path);
    if (!e) {
        TEST_FAILF("no profile entry '%s'", path);
        return;
    }
    if (strcmp(e->type, type) || e->fwd_calls != fwd || e->bwd_calls != bwd)
        TEST_FAILF("'%s': %s with %ld forward and %ld backward calls, want %s with %ld and %ld", path, e->type,
                   e->fwd_calls, e->bwd_calls, type, fwd, bwd);
}

static void check_times(double wall) {
    int n;
    const struct fsdp_profile_entry *e = fsdp_profile_entries(get_ctx(), &n);
    double sum = 0.0;
    for (int i = 0; i < n; i++) {
        if (e[i].fwd_s < -1e-6 || e[i].bwd_s < -1e-6 || e[i].hooks_s < 0 || !isfinite(e[i].fwd_s + e[i].bwd_s))
            TEST_FAILF("'%s': times %g, %g, %g s", e[i].path, e[i].fwd_s, e[i].bwd_s, e[i].hooks_s);
        sum += e[i].fwd_s + e[i].bwd_s + e[i].hooks_s;
    }
    /* the dispatches nest, each counted once: their sum is within the steps */
    if (!(sum > 0.0) || sum > wall * 1.001 + 1e-4)
        TEST_FAILF("the entries sum to %.6f s over steps of %.6f s", sum, wall);
}

TEST(profile_counts_layers_by_path) {
    for (int ac = 0; ac < 2; ac++) {
        struct run r;
        run_open(&r, ac);
        run_steps(&r, 1); /* the first step, not profiled */
        if (find("(root)")) TEST_FAILF("entries before the profile started");
        fsdp_profile_clear(get_ctx());
        fsdp_profile_enable(get_ctx(), 1);
        const int steps = 3;
        double wall = run_steps(&r, steps);
        fsdp_profile_enable(get_ctx(), 0);
        long L = r.n_layer * steps;
        check_calls("(root)", "GPT", steps, steps);
        check_calls("transformer.wte", "Embedding", steps, steps);
        check_calls("transformer.h.*", "Block", L, L); /* its recompute is in its backward... */
        check_calls("transformer.h.*.attn.c_attn", "Linear", (ac ? 2 : 1) * L, L); /* ...its children's, calls */
        check_calls("transformer.h.*.mlp.gelu", "GELU", (ac ? 2 : 1) * L, L);
        check_calls("lm_head", "Linear", steps, steps);
        if (find("transformer.h.0.attn.c_attn")) TEST_FAILF("a layer's index was not folded");
        check_times(wall);
        /* the Blocks are units: their gathers (and, at 2 ranks and more, reduce-scatters) are hook time */
        const struct fsdp_profile_entry *b = find("transformer.h.*");
        if (b && fsdp_comm_size(fsdp_ctx_comm(get_ctx())) > 1 && !(b->hooks_s > 0.0))
            TEST_FAILF("the Blocks' hooks took %g s at %d ranks", b->hooks_s, fsdp_comm_size(fsdp_ctx_comm(get_ctx())));
        /* paused: nothing added */
        const struct fsdp_profile_entry *root = find("(root)");
        long before = root ? root->fwd_calls : -1;
        run_steps(&r, 1);
        if (root && root->fwd_calls != before) TEST_FAILF("a paused profile counted a step");
        int n;
        fsdp_profile_clear(get_ctx());
        if (fsdp_profile_entries(get_ctx(), &n) || n) TEST_FAILF("%d entries after a clear", n);
        run_close(&r);
    }
}

TEST(profile_table_prints_each_path) {
    struct run r;
    run_open(&r, 0);
    fsdp_profile_enable(get_ctx(), 1);
    run_steps(&r, 2);
    fsdp_profile_enable(get_ctx(), 0);
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    fsdp_profile_print(get_ctx(), f, 2);
    fclose(f);
    int n;
    const struct fsdp_profile_entry *e = fsdp_profile_entries(get_ctx(), &n);
    for (int i = 0; i < n; i++) {
        char line[256];
        snprintf(line, sizeof line, "\n%s ", e[i].path);
        if (!strstr(buf, line)) TEST_FAILF("the table has no line for '%s':\n%s", e[i].path, buf);
    }
    /* per step: the root's 2 forward and 2 backward calls print as 1.0, on
     * its own line (path, type, forward calls, backward calls, ...) */
    const char *root = strstr(buf, "\n(root) ");
    char path[64] = "", type[64] = "";
    double fwd = 0, bwd = 0;
    if (!root || sscanf(root + 1, "%63s %63s %lf %lf", path, type, &fwd, &bwd) != 4 || strcmp(path, "(root)") ||
        fwd != 1.0 || bwd != 1.0)
        TEST_FAILF("the root's calls per step are not 1.0 and 1.0:\n%s", buf);
    if (!strstr(buf, "\ntotal ")) TEST_FAILF("no total line:\n%s", buf);
    free(buf);
    fsdp_profile_clear(get_ctx());
    run_close(&r);
}

TEST_MAIN()
