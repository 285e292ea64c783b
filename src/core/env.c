/*
 * env.c - the readers of the library's environment variables
 * ([Note: environment variables]).
 *
 * [Note: environment variables] The library's tuning and test switches
 * (FSDP_SHM_SLOT, FSDP_GEMM_BF16, FSDP_COLLECTIVE_TIMEOUT, ...; README.md
 * lists them all) are listed in `vars` below with what each takes, and read
 * through these helpers only. Unset or empty means the default. Any other
 * value must be what the variable takes, in full: a whole number in its
 * range, a number of seconds, or one of its words. A value that is not is
 * FSDP_ERR_INVALID with one line naming the variable, the value and what it
 * accepts: fsdp_env_check checks them all (fsdp_ctx_create calls it first,
 * and the tools before anything else, then print the line and exit 2), and
 * each reader returns the same error where the value is used. The library
 * never ends the process over a value; a silent fallback would run, say, a
 * benchmark with FSDP_SHM_SLOT=4M on the default slot and report it as the
 * 4 MiB one. A reader whose caller has no status to return (a crash point,
 * a once-per-process probe) asserts the value, which fsdp_ctx_create has
 * checked: only a program that changes the variable later can trip it.
 */
#include "core/core-impl.h"

#include <errno.h>
#include <math.h>
#include <sched.h>
#include <string.h>

enum env_kind { ENV_INT, ENV_REAL, ENV_WORD, ENV_SPEC };

struct env_var {
    const char *name;
    enum env_kind kind;
    long long lo, hi;           /* ENV_INT */
    double rlo, rhi;            /* ENV_REAL */
    const char *const *words;   /* ENV_WORD: NULL-terminated */
    int (*spec_ok)(const char *value); /* ENV_SPEC */
    const char *spec;           /* ENV_SPEC: what it takes */
};

static const char *const gemm_bf16_words[] = {"auto", "widen", "matmul", "gemm", NULL}; /* gemm_lp.c's MM_* */
static const char *const mpi_reduce_words[] = {"native", "ordered", NULL};
static const char *const vision_layout_words[] = {"blocked", "plain", NULL};
/* after auto, cpu.c's levels in order (enum fsdp__isa + 1) */
static const char *const cpu_isa_words[] = {"auto", "scalar", "avx2", "avx512", "avx512bf16", NULL};

static const struct env_var vars[] = {
    {"FSDP_SHM_SLOT", ENV_INT, 4096, (long long)1 << 30, 0, 0, NULL, NULL, NULL},
    {"FSDP_SHM_CHUNK", ENV_INT, 4096, (long long)1 << 30, 0, 0, NULL, NULL, NULL},
    {"FSDP_SHM_CMA", ENV_INT, 0, 2, 0, 0, NULL, NULL, NULL},
    {"FSDP_SHM_CMA_MIN", ENV_INT, 0, INT32_MAX, 0, 0, NULL, NULL, NULL},
    {"FSDP_SHM_VERBOSE", ENV_INT, 0, 1, 0, 0, NULL, NULL, NULL},
    {"FSDP_SHM_WINDOW", ENV_INT, 0, (long long)1 << 50, 0, 0, NULL, NULL, NULL},
    {"FSDP_MPI_PROGRESS", ENV_INT, 0, 1, 0, 0, NULL, NULL, NULL},
    {"FSDP_MPI_PROGRESS_CPU", ENV_INT, 0, CPU_SETSIZE - 1, 0, 0, NULL, NULL, NULL},
    {"FSDP_PEER_WATCH", ENV_INT, 0, 1, 0, 0, NULL, NULL, NULL},
    {"FSDP_MPI_REDUCE", ENV_WORD, 0, 0, 0, 0, mpi_reduce_words, NULL, NULL},
    {"FSDP_CHECK_COLLECTIVES", ENV_INT, 0, 1, 0, 0, NULL, NULL, NULL},
    {"FSDP_COLLECTIVE_TIMEOUT", ENV_REAL, 0, 0, 0, 1e9, NULL, NULL, NULL},
    {"FSDP_GEMM_BF16", ENV_WORD, 0, 0, 0, 0, gemm_bf16_words, NULL, NULL},
    {"FSDP_MAX_CPU_ISA", ENV_WORD, 0, 0, 0, 0, cpu_isa_words, NULL, NULL},
    {"FSDP_VISION_LAYOUT", ENV_WORD, 0, 0, 0, 0, vision_layout_words, NULL, NULL},
    {"FSDP_WIDEN_SCRATCH", ENV_INT, 4096, (long long)1 << 40, 0, 0, NULL, NULL, NULL},
    {"FSDP_CHECK_LP_COPY", ENV_INT, 0, 1, 0, 0, NULL, NULL, NULL},
    {"FSDP_THP", ENV_INT, 0, 1, 0, 0, NULL, NULL, NULL},
    {"FSDP_ARENA_SPAN", ENV_INT, 0, 1, 0, 0, NULL, NULL, NULL},
    {"FSDP_GRAD_LEND", ENV_INT, 0, 1, 0, 0, NULL, NULL, NULL},
    {"FSDP_LN_REBUILD", ENV_INT, 0, 1, 0, 0, NULL, NULL, NULL},
    {"FSDP_INJECT_OVERFLOW_STEP", ENV_INT, 0, INT64_MAX, 0, 0, NULL, NULL, NULL},
    {"FSDP_INJECT_OVERFLOW_RANK", ENV_INT, 0, INT32_MAX, 0, 0, NULL, NULL, NULL},
    {"FSDP_CKPT_CRASH_AT", ENV_INT, 0, INT32_MAX, 0, 0, NULL, NULL, NULL},
    {"FSDP_FAULT", ENV_SPEC, 0, 0, 0, 0, NULL, fsdp__fault_spec_ok,
     "POINT:RANK:STEP[:kill|stop|fail], POINT one of forward, backward, reduce-scatter, ckpt-save, ckpt-remove, "
     "ckpt-commit (fail: ckpt-commit only)"},
};

static const struct env_var *find(const char *name) {
    for (size_t i = 0; i < sizeof vars / sizeof *vars; i++)
        if (!strcmp(vars[i].name, name)) return &vars[i];
    FSDP_ASSERT(0, "environment variable %s is not in env.c's list", name);
}

/* What v takes, for the message. */
static void expected(const struct env_var *v, char *buf, size_t n) {
    switch (v->kind) {
    case ENV_INT: snprintf(buf, n, "a whole number in [%lld, %lld]", v->lo, v->hi); break;
    case ENV_REAL: snprintf(buf, n, "a number in [%g, %g]", v->rlo, v->rhi); break;
    case ENV_WORD:
        snprintf(buf, n, "one of: ");
        for (int i = 0; v->words[i]; i++)
            snprintf(buf + strlen(buf), n - strlen(buf), "%s%s", i ? ", " : "", v->words[i]);
        break;
    case ENV_SPEC: snprintf(buf, n, "%s", v->spec); break;
    }
}

/* Parses e (non-empty) as v takes it: 1 and *out set, or 0. */
static int parse(const struct env_var *v, const char *e, long long *iv, double *rv) {
    char *end;
    errno = 0;
    switch (v->kind) {
    case ENV_INT:
        *iv = strtoll(e, &end, 10);
        return !errno && !*end && end != e && *iv >= v->lo && *iv <= v->hi;
    case ENV_REAL:
        *rv = strtod(e, &end);
        return !errno && !*end && end != e && isfinite(*rv) && *rv >= v->rlo && *rv <= v->rhi;
    case ENV_WORD:
        for (int i = 0; v->words[i]; i++)
            if (!strcmp(e, v->words[i])) {
                *iv = i;
                return 1;
            }
        return 0;
    case ENV_SPEC: return v->spec_ok(e);
    }
    return 0;
}

/* v's value: 1 with *iv / *rv set, 0 when unset or empty, or
 * FSDP_ERR_INVALID's message in msg and -1. */
static int lookup(const struct env_var *v, long long *iv, double *rv, char *msg, size_t n) {
    const char *e = getenv(v->name);
    if (!e || !*e) return 0;
    if (parse(v, e, iv, rv)) return 1;
    char want[320];
    expected(v, want, sizeof want);
    snprintf(msg, n, "environment variable %s='%s': expected %s", v->name, e, want);
    return -1;
}

static enum fsdp_status refuse(struct fsdp_ctx *ctx, const char *msg) {
    return fsdp__err(ctx, FSDP_ERR_INVALID, "%s", msg);
}

enum fsdp_status fsdp_env_check(char *msg, size_t cap) {
    char m[768];
    for (size_t i = 0; i < sizeof vars / sizeof *vars; i++) {
        long long iv;
        double rv;
        if (lookup(&vars[i], &iv, &rv, m, sizeof m) < 0) {
            if (msg && cap) snprintf(msg, cap, "%s", m);
            return FSDP_ERR_INVALID;
        }
    }
    if (msg && cap) msg[0] = 0;
    return FSDP_OK;
}

enum fsdp_status fsdp__env_int(struct fsdp_ctx *ctx, const char *name, long long def, long long *out) {
    const struct env_var *v = find(name);
    FSDP_ASSERT(v->kind == ENV_INT, "%s is not a whole number", name);
    char msg[768];
    double rv;
    int r = lookup(v, out, &rv, msg, sizeof msg);
    if (r < 0) return refuse(ctx, msg);
    if (r == 0) *out = def;
    return FSDP_OK;
}

enum fsdp_status fsdp__env_real(struct fsdp_ctx *ctx, const char *name, double def, double *out) {
    const struct env_var *v = find(name);
    FSDP_ASSERT(v->kind == ENV_REAL, "%s is not a number", name);
    char msg[768];
    long long iv;
    int r = lookup(v, &iv, out, msg, sizeof msg);
    if (r < 0) return refuse(ctx, msg);
    if (r == 0) *out = def;
    return FSDP_OK;
}

enum fsdp_status fsdp__env_word(struct fsdp_ctx *ctx, const char *name, int def, int *out) {
    const struct env_var *v = find(name);
    FSDP_ASSERT(v->kind == ENV_WORD, "%s is not a word", name);
    char msg[768];
    long long iv;
    double rv;
    int r = lookup(v, &iv, &rv, msg, sizeof msg);
    if (r < 0) return refuse(ctx, msg);
    *out = r ? (int)iv : def;
    return FSDP_OK;
}

long long fsdp__env_checked(const char *name, long long def) {
    const struct env_var *v = find(name);
    FSDP_ASSERT(v->kind != ENV_REAL, "%s is a real number", name);
    char msg[768];
    long long iv = 0;
    double rv;
    int r = lookup(v, &iv, &rv, msg, sizeof msg);
    FSDP_ASSERT(r >= 0, "%s (fsdp_ctx_create checks the library's variables: a program must not change them later)",
                msg);
    return r == 0 ? def : v->kind == ENV_SPEC ? 1 : iv;
}
