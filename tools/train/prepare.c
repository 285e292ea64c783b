/*
 * prepare.c - how fsdp-train turns its flags into the library's sharding:
 * the strategy checks against the world, the wrap policy (--wrap), the
 * activation checkpointing selection (--ac), precision and mixed precision,
 * and the memory plan of that configuration (--dry-run, --mem-limit),
 * measured by running the task's own step in measure mode. Part of
 * fsdp-train (tools/fsdp-train.c runs the job; task.h declares these).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "task.h"

/* ---- Preparation: --wrap, --ac, --reshard-after-forward, --init ---- */

/* The module type --ac checkpoints: the task's attention type for attn
 * ("CausalSelfAttention"), else its block type ("Block", "BasicBlock"). */
static const char *ac_type(const struct task *t, const struct opts *o) {
    return !strcmp(o->ac, "attn") ? t->ac_attn_type : t->block_type;
}

/* --ac every:K: blocks (Blocks in transformer.h, a ResNet's blocks in their
 * layer) whose index is a multiple of K. */
struct ac_every_sel {
    const char *block_type;
    int every;
};
static int ac_every(struct fsdp_module *m, void *ud) {
    const struct ac_every_sel *s = ud;
    if (strcmp(m->ops->type, s->block_type)) return 0;
    return atoi(m->name) % s->every == 0;
}

/* --wrap: the task's policy (or wrap by its block type), none, or size:N */
static struct fsdp_wrap_policy wrap_policy(const struct task *t, const struct opts *o) {
    static int64_t min_size;
    struct fsdp_wrap_policy wp = {fsdp_wrap_by_type, (void *)t->block_type};
    if (t->wrap) {
        wp.fn = t->wrap;
        wp.ud = (void *)t;
    }
    if (!strcmp(o->wrap, "none")) wp.fn = NULL;
    else if (!strncmp(o->wrap, "size:", 5)) {
        min_size = atol(o->wrap + 5);
        wp.fn = fsdp_wrap_by_size;
        wp.ud = &min_size;
    }
    return wp;
}

/* --precision (validated with the flags) and --mixed-precision */
static enum fsdp_dtype precision_of(struct fsdp_ctx *ctx, const struct opts *o) {
    enum fsdp_dtype prec;
    if (fsdp_precision_parse(ctx, o->precision, &prec) != FSDP_OK) fail_all("--precision: %s", fsdp_errmsg(ctx));
    return prec;
}
static enum fsdp_mixed_precision mp_mode(const struct opts *o) {
    return !strcasecmp(o->mixed_precision, "FULL")   ? FSDP_MP_FULL
           : !strcasecmp(o->mixed_precision, "PURE") ? FSDP_MP_PURE
                                                     : FSDP_MP_DEFAULT;
}

/* --sharding, --shard-group and --grad-accum against the world: every rank
 * computes the same verdict. */
void check_strategy_flags(const struct opts *o, int world) {
    int hybrid = !strcasecmp(o->sharding, "HYBRID_SHARD");
    if (o->shard_group && !hybrid)
        fail_all("--shard-group %d needs --sharding HYBRID_SHARD (not %s)", o->shard_group, o->sharding);
    if (o->shard_group && world % o->shard_group != 0)
        fail_all("--shard-group %d does not divide the world of %d ranks", o->shard_group, world);
    if ((o->batch / world) % o->grad_accum != 0)
        fail_all("--grad-accum %d does not divide the per-rank batch of %d sequences (--batch %d over %d ranks)",
                 o->grad_accum, o->batch / world, o->batch, world);
}

/* The config prepare_model asks fsdp_parallelize_model for, on `world` ranks
 * (the run's, or the one a plan is made for). */
static struct fsdp_parallel_config parallel_config_of(struct fsdp_ctx *ctx, const struct opts *o, int world) {
    struct fsdp_parallel_config pc = fsdp_parallel_config_default();
    pc.reshard_after_forward = o->reshard_after_forward;
    pc.verbose = o->verbose;
    pc.seed = o->seed;
    fsdp_sharding_parse(ctx, o->sharding, &pc.sharding); /* validated with the flags */
    pc.overlap = o->overlap;
    pc.max_inflight = o->max_inflight;
    /* what --save-dir writes, and how --init-from is read (--init rank0) */
    pc.state_dict_type = !strcmp(o->state_dict_type, "full") ? FSDP_STATE_DICT_FULL : FSDP_STATE_DICT_SHARDED;
    pc.load_monolith_rank0_only = !strcmp(o->init, "rank0");
    if (o->shard_group) { /* a 2-D mesh {replicas, shard group}; divides the world (checked) */
        pc.mesh[0] = world / o->shard_group;
        pc.mesh[1] = o->shard_group;
    }
    if (strcmp(o->ac, "none")) pc.activation_checkpointing = 1;
    pc.mixed_precision = mp_mode(o);
    pc.lp_shard_copy = o->lp_shard_copy;
    return pc;
}

struct fsdp_shard_opts shard_opts_of(struct fsdp_ctx *ctx, const struct task *t, const struct opts *o, int world) {
    struct fsdp_parallel_config pc = parallel_config_of(ctx, o, world);
    struct fsdp_wrap_policy wp = wrap_policy(t, o);
    return fsdp_parallel_config_shard_opts(&pc, precision_of(ctx, o), &wp);
}

/* loading: --resume or --init-from replaces every parameter (both loads
 * refuse a file that lacks one), so none is initialised first */
struct fsdp_model *prepare_model(struct fsdp_ctx *ctx, const struct task *t, const struct opts *o,
                                 struct fsdp_module *root, struct fsdp_optim *opt, int loading) {
    struct fsdp_parallel_config pc = parallel_config_of(ctx, o, fsdp_ctx_world(ctx));
    pc.skip_init = loading;
    static struct ac_every_sel every;
    struct fsdp_wrap_policy wp = wrap_policy(t, o);
    struct fsdp_ac_check ac = {fsdp_ac_by_type, (void *)ac_type(t, o)}, *acp = NULL;
    if (strcmp(o->ac, "none")) {
        acp = &ac;
        if (!strncmp(o->ac, "every:", 6)) {
            every = (struct ac_every_sel){t->block_type, atoi(o->ac + 6)};
            ac.fn = ac_every;
            ac.ud = &every;
        }
    }
    enum fsdp_dtype prec = precision_of(ctx, o);
    struct fsdp_model *fm;
    if (fsdp_parallelize_model(ctx, root, &pc, opt, prec, &wp, acp, NULL, &fm) != FSDP_OK)
        fail_all("%s", fsdp_errmsg(ctx));
    if (prec == FSDP_F16) {
        struct fsdp_loss_scale_opts lo = fsdp_loss_scale_opts_default();
        lo.enabled = 1;
        lo.init_scale = o->loss_scale_init;
        lo.growth_interval = o->loss_scale_growth;
        if (fsdp_model_set_loss_scale(ctx, fm, &lo) != FSDP_OK) fail_all("--loss-scale-*: %s", fsdp_errmsg(ctx));
    }
    return fm;
}

/* --precision as Composer spells it. */
const char *precision_name(const struct opts *o) {
    return !strcasecmp(o->precision, "AMP_BF16") ? "AMP_BF16" : !strcasecmp(o->precision, "AMP_FP16") ? "AMP_FP16"
                                                                                                  : "FP32";
}

/* ranks on this host (Open MPI says; 1 when not launched by it) */
int local_ranks(void) {
    const char *s = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    return s && atoi(s) > 0 ? atoi(s) : 1;
}

/* ---- Memory plan (--dry-run, --mem-limit) ---- */

static void mib(char *buf, size_t cap, size_t bytes) {
    snprintf(buf, cap, "%.1f MiB", (double)bytes / 1048576.0);
}

/* Sets (on) or clears the checkpoint flag of the modules --ac selects below m. */
static void plan_mark_ac(struct fsdp_module *m, const struct task *t, const struct opts *o, int on) {
    struct ac_every_sel every = {t->block_type, !strncmp(o->ac, "every:", 6) ? atoi(o->ac + 6) : 0};
    for (int i = 0; i < m->n_children; i++) {
        struct fsdp_module *c = m->children[i];
        if (strcmp(o->ac, "none") != 0) {
            int sel = every.every > 0 ? ac_every(c, &every) : fsdp_ac_by_type(c, (void *)ac_type(t, o));
            if (sel) c->checkpoint = on;
        }
        plan_mark_ac(c, t, o, on);
    }
}

/* The memory this host can give each of its `local` ranks: the least of
 * MemAvailable and the cgroup's memory limit (v2, or v1), shared equally,
 * less a reserve per rank for what the plan does not count and a run still
 * takes (page tables, oneDNN's kernels and scratch, MPI's buffers, the stdio
 * and log buffers): 64 MiB + 1% of the share. Without it a plan that fit by a
 * few MiB passed the check and the run met the kernel's OOM killer instead
 * (a 1.17B GPT on 2 ranks of a 24 GB host: plan 11181.5 of 11231.6 MiB).
 * per_rank = 0 when neither can be read. `how` says where it came from. */
struct host_mem {
    size_t per_rank;
    char how[256];
};

static int read_u64_file(const char *path, unsigned long long *out) {
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char line[64] = "";
    int ok = fgets(line, sizeof line, f) != NULL;
    fclose(f);
    char *end;
    errno = 0;
    unsigned long long v = strtoull(line, &end, 10);
    if (!ok || end == line || errno) return 0; /* "max": no limit */
    *out = v;
    return 1;
}

static void host_memory(struct host_mem *hm, int local) {
    unsigned long long avail = 0, cg = 0;
    FILE *f = fopen("/proc/meminfo", "r");
    if (f) {
        char line[256];
        while (fgets(line, sizeof line, f))
            if (sscanf(line, "MemAvailable: %llu kB", &avail) == 1) { avail *= 1024; break; }
        fclose(f);
    }
    /* cgroup v2: the memory.max of this process's group (from /proc/self/cgroup), else the root's */
    char path[4096] = "", grp[3800] = "";
    if ((f = fopen("/proc/self/cgroup", "r"))) {
        char line[3800];
        while (fgets(line, sizeof line, f))
            if (!strncmp(line, "0::", 3)) {
                snprintf(grp, sizeof grp, "%s", line + 3);
                grp[strcspn(grp, "\n")] = 0;
            }
        fclose(f);
    }
    snprintf(path, sizeof path, "/sys/fs/cgroup%s/memory.max", grp[0] == '/' && grp[1] ? grp : "");
    if (!read_u64_file(path, &cg) && !read_u64_file("/sys/fs/cgroup/memory.max", &cg) &&
        !read_u64_file("/sys/fs/cgroup/memory/memory.limit_in_bytes", &cg))
        cg = 0;
    if (cg >= (1ull << 60)) cg = 0; /* v1's "unlimited" */
    unsigned long long host = avail && cg ? (avail < cg ? avail : cg) : avail ? avail : cg;
    if (local < 1) local = 1;
    unsigned long long share = host / (unsigned long long)local, reserve = (64ull << 20) + share / 100;
    hm->per_rank = (size_t)(share > reserve ? share - reserve : 0);
    if (!hm->per_rank && host) hm->per_rank = 1; /* nothing left: every plan is refused (0 = unknown) */
    char a[48] = "", c[48] = "";
    if (avail) snprintf(a, sizeof a, "MemAvailable %.1f MiB", (double)avail / 1048576.0);
    if (cg) snprintf(c, sizeof c, "cgroup limit %.1f MiB", (double)cg / 1048576.0);
    snprintf(hm->how, sizeof hm->how, "%s%s%s over %d local rank%s, less %.1f MiB each kept for what the plan "
             "does not count", a, avail && cg ? ", " : "", c, local, local == 1 ? "" : "s",
             (double)reserve / 1048576.0);
}

size_t host_free_per_rank(void) {
    struct host_mem hm = {0};
    host_memory(&hm, local_ranks());
    return hm.per_rank;
}

/* The planner's step and set-up: the task's own, on the measuring context
 * (src/fsdp/plan.c, [Note: measure mode]). */
struct plan_task {
    struct task *t;
    const struct opts *o;
};

static enum fsdp_status plan_step(struct fsdp_ctx *ctx, struct fsdp_model *fm, int step, void *ud) {
    struct plan_task *pt = ud;
    struct fsdp_step_result r;
    return pt->t->ops->step(pt->t, ctx, fm, pt->o, step, pt->o->lr, &r);
}

static enum fsdp_status plan_prepare(struct fsdp_ctx *ctx, struct fsdp_optim *opt, void *ud) {
    struct plan_task *pt = ud;
    if (pt->t->ops->prepare_optim) pt->t->ops->prepare_optim(pt->t, ctx, pt->o, opt);
    return FSDP_OK;
}

static enum fsdp_status plan_setup(struct fsdp_ctx *ctx, struct fsdp_model *fm, struct fsdp_optim *opt, void *ud) {
    struct plan_task *pt = ud;
    if (pt->t->ops->after_shard) pt->t->ops->after_shard(pt->t, ctx, pt->o, fm, opt);
    return FSDP_OK;
}

/* Plans the run for `pworld` ranks by measuring the task's real step
 * (fsdp_plan_memory_run): --dry-run prints the plan per rank and exits;
 * --mem-limit refuses a plan over the limit before any work, then hands the
 * limit to the library's allocator. Every rank computes the same. */
void memory_plan(struct fsdp_ctx *ctx, const struct task *t, const struct opts *o, struct fsdp_module *root,
                 int pworld) {
    if (!o->dry_run && !o->mem_limit_bytes && !o->mem_limit_auto) return;
    size_t limit = o->mem_limit_bytes;
    if (o->batch % pworld != 0)
        fail_all("--batch %d (global) is not divisible by the world size %d", o->batch, pworld);
    int threads = o->threads;
    if (threads == 0) {
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        threads = pworld > 1 && !getenv("OMPI_COMM_WORLD_SIZE") ? (int)(cores / pworld) : (int)(cores / local_ranks());
        if (threads < 1) threads = 1;
    }
    check_strategy_flags(o, pworld);
    struct fsdp_shard_opts so = shard_opts_of(ctx, t, o, pworld);
    struct plan_task pt = {(struct task *)t, o}; /* the task runs its step */
    struct fsdp_plan_opts po = fsdp_plan_opts_default();
    po.threads = threads;
    po.optim.kind = !strcmp(o->optim, "sgd") ? FSDP_OPTIM_SGD : !strcmp(o->optim, "lars") ? FSDP_OPTIM_LARS
                                                                                         : FSDP_OPTIM_ADAMW;
    po.optim.momentum = o->momentum;
    po.optim.nesterov = o->nesterov;
    if (pworld > 1 && !getenv("OMPI_COMM_WORLD_SIZE")) /* planned, not launched: --nproc ranks on this host */
        po.shared_window = !strcmp(o->comm, "auto") || !strcmp(o->comm, "shm") ? -2 : 0;
    po.prepare_optim = plan_prepare;
    po.setup = plan_setup;
    po.step = plan_step;
    po.ud = &pt;
    plan_mark_ac(root, t, o, 1);
    struct fsdp_mem_stats held; /* the communicator and the data, already allocated */
    fsdp_mem_get(ctx, &held);
    int shown = pworld <= 8 ? pworld : 2;
    int me = fsdp_ctx_rank(ctx);
    struct fsdp_mem_plan p0;
    memset(&p0, 0, sizeof p0);
    double t0 = now_s();
    for (int i = 0; i < (o->dry_run ? shown : 1); i++) {
        int r = pworld <= 8 ? i : (i ? pworld - 1 : 0);
        struct fsdp_mem_plan p;
        po.world = pworld;
        po.rank = r; /* a run checks rank 0's plan on every rank: the same verdict everywhere */
        if (fsdp_plan_memory_run(ctx, root, &so, &po, &p) != FSDP_OK) fail_all("memory plan: %s", fsdp_errmsg(ctx));
        p.workspace += held.cur_total;
        p.total += held.cur_total;
        if (i == 0 || p.total > p0.total) p0 = p;
        if (!o->dry_run || me != 0) continue;
        if (i == 0) {
            printf("memory plan: %s, world %d, %d units (--wrap %s), --ac %s, batch %d %s per rank, %s (%s), "
                   "%d threads per rank, %s%s%s\n", o->sharding, pworld, p.n_units, o->wrap, o->ac,
                   o->batch / pworld, t->batch_unit, o->optim,
                   po.optim.kind == FSDP_OPTIM_ADAMW ? "2 state floats per element"
                   : o->momentum > 0 ? "1 state float per element" : "no state", threads,
                   precision_name(o), so.precision != FSDP_F32 ? " mixed_precision " : "",
                   so.precision != FSDP_F32 ? o->mixed_precision : "");
            if (o->grad_accum > 1)
                printf("  in %d micro-batches of %d (--accum-mode %s)\n", o->grad_accum,
                       o->batch / pworld / o->grad_accum, o->accum_mode);
            printf("%-6s %12s %12s %12s %12s %12s %12s %12s\n", "rank", "params", "grads", "optimizer",
                   "full bufs", "activations", "workspace", "total");
        }
        if (pworld > 8 && i == 1) printf("...\n");
        char c[7][32];
        size_t v[7] = {p.params, p.grads, p.optim, p.full, p.act, p.workspace, p.total};
        for (int j = 0; j < 7; j++) mib(c[j], sizeof c[j], v[j]);
        printf("%-6d %12s %12s %12s %12s %12s %12s %12s\n", r, c[0], c[1], c[2], c[3], c[4], c[5], c[6]);
    }
    if (o->dry_run && me == 0) printf("(measured by running two steps in measure mode: %.2f s)\n", now_s() - t0);
    if (o->dry_run && me == 0 && p0.grads_lent)
        printf("gradient shards (the largest rank): %.1f MiB in the activations' pages that backward released (counted "
               "under activations), %.1f MiB in buffers of their own (grads)\n",
               (double)p0.grads_lent / 1048576.0, (double)p0.grads / 1048576.0);
    /* --mem-limit auto: the host's memory per local rank, the smallest over
     * the job's hosts so that every rank reaches the same verdict */
    struct host_mem hm = {0};
    if (o->mem_limit_auto) {
        host_memory(&hm, pworld > 1 && !getenv("OMPI_COMM_WORLD_SIZE") ? pworld : local_ranks());
        float mine = (float)((double)hm.per_rank / 1048576.0), least = mine;
        if (fsdp_comm_allreduce(fsdp_ctx_comm(ctx), &mine, &least, 1, FSDP_F32, FSDP_MIN) != FSDP_OK)
            fail_rank("%s", fsdp_errmsg(ctx));
        if (least < mine) hm.per_rank = (size_t)((double)least * 1048576.0);
    }
    if (o->dry_run && me == 0) {
        if (limit)
            printf("--mem-limit %s (%.1f MiB): %s (%.0f%% of the limit)\n", o->mem_limit,
                   (double)limit / 1048576.0, p0.total <= limit ? "fits" : "EXCEEDED",
                   100.0 * (double)p0.total / (double)limit);
        if (hm.per_rank)
            printf("host memory (--mem-limit auto): %.1f MiB per rank (%s): %s\n", (double)hm.per_rank / 1048576.0,
                   hm.how, p0.total <= hm.per_rank ? "fits" : "EXCEEDED, a run would be refused");
        printf("(library accounting; the process also holds MPI, oneDNN and the program itself)\n");
    }
    plan_mark_ac(root, t, o, 0); /* fsdp_parallelize_model marks them itself */
    if (!o->dry_run && hm.per_rank && p0.total > hm.per_rank) {
        /* the three biggest parts, largest first */
        const char *name[6] = {"parameter shards", "gradient shards", "optimizer state", "full buffers",
                               "activations", "workspace"};
        size_t v[6] = {p0.params, p0.grads, p0.optim, p0.full, p0.act, p0.workspace};
        int idx[6] = {0, 1, 2, 3, 4, 5};
        for (int a = 1; a < 6; a++)
            for (int b = a; b > 0 && v[idx[b]] > v[idx[b - 1]]; b--) {
                int swap = idx[b];
                idx[b] = idx[b - 1];
                idx[b - 1] = swap;
            }
        fail_all("the plan needs %.1f MiB per rank, most of it %s %.1f MiB, %s %.1f MiB and %s %.1f MiB; this host "
                 "can give each rank %.1f MiB (%s); use more ranks, a smaller --batch or --seq, --ac blocks or a "
                 "smaller model, or override the check with --mem-limit off (or --mem-limit SIZE)",
                 (double)p0.total / 1048576.0, name[idx[0]], (double)v[idx[0]] / 1048576.0, name[idx[1]],
                 (double)v[idx[1]] / 1048576.0, name[idx[2]], (double)v[idx[2]] / 1048576.0,
                 (double)hm.per_rank / 1048576.0, hm.how);
    }
    if (limit && p0.total > limit)
        fail_all("--mem-limit %s: the plan needs %.1f MiB per rank (shards %.1f, full buffers %.1f, activations "
                 "%.1f, workspace %.1f MiB), more than the limit of %.1f MiB; use more ranks, a smaller "
                 "--batch or --seq, or a larger limit",
                 o->mem_limit, (double)p0.total / 1048576.0, (double)(p0.params + p0.grads + p0.optim) / 1048576.0,
                 (double)p0.full / 1048576.0, (double)p0.act / 1048576.0, (double)p0.workspace / 1048576.0,
                 (double)limit / 1048576.0);
    if (o->dry_run) {
        fsdp_module_free(root);
        fsdp_ctx_free(ctx);
        exit(0);
    }
    fsdp_mem_set_limit(ctx, limit);
}
