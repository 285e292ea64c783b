/*
 * config.c - fsdp-train's run configuration (config.h).
 *
 * [Note: run configuration]
 * The flags table below lists every flag a configuration holds: its long
 * name, where it lives in struct opts, its type, and whether --resume
 * restores it (R_AGREE: the schedule, the optimizer, the batch, the precision and
 * the loss scaling, what decides the numbers of the run; R_FILL: the data files
 * and the evaluation's cadence and sizes, taken from the checkpoint when not
 * given, and a given one wins, since files move between machines: a resumed
 * run never falls back to the default data, nor stops evaluating). A configuration is
 * a JSON object keyed by those names; each value becomes the text a flag
 * takes on the command line, and the flags go through parse_args, so a value
 * in a file or a checkpoint is checked exactly as the flag is:
 *   --config FILE: argv = FILE's flags, then the command line (which wins);
 *   the resolved configuration: every flag's value after parsing (and after
 *     --resume), so that a log's first line can be given back as --config;
 *   --resume: argv = the checkpoint's restored flags (those neither given nor
 *     named by --override), then the above; a restored flag that was given
 *     with another value is an error naming both values.
 * Values compare as their canonical text: a number as the shortest decimal
 * that reads back to the same float (double, integer), strings ignoring case.
 */
#include "config.h"

#include "task.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

enum kind {
    K_STR,    /* const char * (NULL: null) */
    K_INT,    /* int */
    K_INT0,   /* int, 0 = unset (null) */
    K_U64,    /* uint64_t */
    K_FLOAT,  /* float */
    K_FLOAT0, /* float, 0 = unset (null) */
    K_DOUBLE, /* double */
    K_SWITCH, /* int 0/1, a flag without value */
    K_ONOFF,  /* int 0/1 as on | off; -1 = unset (null) */
    K_INTS,   /* int[16] with its count at aux */
    K_FLOATS, /* float[4] with its count at aux */
    K_PAIR    /* float[2] */
};

/* What --resume does with a flag ([Note: run configuration]) */
enum restore {
    R_NO,    /* nothing: the command line's or the default */
    R_AGREE, /* the checkpoint's; a given value must agree (or be named by --override) */
    R_FILL   /* the checkpoint's when not given; a given value wins */
};

struct flag {
    const char *name;  /* the long name, without "--" */
    enum kind kind;
    size_t off, aux;   /* the field in struct opts; K_INTS / K_FLOATS: the count's */
    int restore;       /* enum restore */
    const char *alias; /* another spelling of the flag, or NULL */
    /* [Note: flags a run does not read]: the tasks that read it (TASK_*; 0: every
     * task), and where only some runs read it, which (applies) and what they
     * are given (when) */
    int tasks;
    int (*applies)(const struct opts *o);
    const char *when;
};

static int optim_momentum(const struct opts *o) { return strcmp(o->optim, "adamw") != 0; }
static int optim_adamw(const struct opts *o) { return !strcmp(o->optim, "adamw"); }
static int optim_lars(const struct opts *o) { return !strcmp(o->optim, "lars"); }
static int amp(const struct opts *o) { return strcasecmp(o->precision, "FP32") != 0; }
static int amp_fp16(const struct opts *o) { return !strcasecmp(o->precision, "AMP_FP16"); }
static int scaleout(const struct opts *o) { return o->net_gbps > 0; }
static int accumulating(const struct opts *o) { return o->grad_accum > 1; }
static int saving(const struct opts *o) { return o->save_dir != NULL; }
static int mpi_possible(const struct opts *o) { return strcmp(o->comm, "shm") && strcmp(o->comm, "self"); }
static int cosine(const struct opts *o) { return !strcmp(o->schedule, "cosine"); }
static int prefetching(const struct opts *o) { return o->overlap != 0; }

#define FL(name, kind, field, count, restore, tasks, applies, when) \
    {name, kind, offsetof(struct opts, field), count, restore, NULL, tasks, applies, when}
#define F(name, kind, field, restore) FL(name, kind, field, 0, restore, 0, NULL, NULL)
#define FN(name, kind, field, count, restore) FL(name, kind, field, offsetof(struct opts, count), restore, 0, NULL, NULL)
/* read by the tasks in mask only */
#define FT(name, kind, field, restore, mask) FL(name, kind, field, 0, restore, mask, NULL, NULL)
#define FNT(name, kind, field, count, restore, mask) \
    FL(name, kind, field, offsetof(struct opts, count), restore, mask, NULL, NULL)
/* read only where applies(o) */
#define FA(name, kind, field, restore, applies, when) FL(name, kind, field, 0, restore, 0, applies, when)
#define T_IMG (TASK_IMAGES | TASK_SWAV)

static const struct flag flags[] = {
    F("model", K_STR, model, R_NO),
    F("model-config", K_STR, model_config, R_NO),
    F("task", K_STR, task, R_NO),
    F("data", K_STR, data, R_FILL),
    FT("val-data", K_STR, val_data, R_FILL, TASK_TOKENS),
    FT("tokenizer", K_STR, tokenizer, R_FILL, TASK_TOKENS),
    F("batch", K_INT, batch, R_AGREE),
    FT("seq", K_INT, seq, R_AGREE, TASK_TOKENS),
    F("steps", K_INT, steps, R_AGREE),
    FT("epochs", K_INT0, epochs, R_AGREE, T_IMG),
    F("eval-every", K_INT, eval_every, R_FILL),
    F("eval-batch", K_INT0, eval_batch, R_FILL),
    F("eval-batches", K_INT, eval_batches, R_FILL),
    F("lr", K_FLOAT, lr, R_AGREE),
    FA("min-lr", K_FLOAT, min_lr, R_AGREE, cosine, "--lr-schedule cosine"),
    F("warmup", K_INT, warmup, R_AGREE),
    F("lr-schedule", K_STR, schedule, R_AGREE),
    FN("lr-steps", K_INTS, lr_steps, n_lr_steps, R_AGREE),
    F("optim", K_STR, optim, R_AGREE),
    {"lars-eta", K_FLOAT, offsetof(struct opts, lars_eta), 0, R_AGREE, "trust-coefficient", 0, optim_lars, "--optim lars"},
    FA("beta1", K_FLOAT, beta1, R_AGREE, optim_adamw, "--optim adamw"),
    FA("beta2", K_FLOAT, beta2, R_AGREE, optim_adamw, "--optim adamw"),
    FA("eps", K_FLOAT, eps, R_AGREE, optim_adamw, "--optim adamw"),
    FA("momentum", K_FLOAT, momentum, R_AGREE, optim_momentum, "--optim sgd or lars"),
    F("nesterov", K_SWITCH, nesterov, R_AGREE),
    F("weight-decay", K_FLOAT, weight_decay, R_AGREE),
    F("decay-all", K_SWITCH, decay_all, R_AGREE),
    F("clip", K_FLOAT, clip, R_AGREE),
    F("grad-accum", K_INT, grad_accum, R_AGREE),
    FA("accum-mode", K_STR, accum_mode, R_NO, accumulating, "--grad-accum above 1"),
    F("precision", K_STR, precision, R_AGREE),
    FA("mixed-precision", K_STR, mixed_precision, R_AGREE, amp, "--precision AMP_BF16 or AMP_FP16"),
    FA("lp-shard-copy", K_ONOFF, lp_shard_copy, R_NO, amp, "--precision AMP_BF16 or AMP_FP16"),
    FA("loss-scale-init", K_DOUBLE, loss_scale_init, R_AGREE, amp_fp16, "--precision AMP_FP16"),
    FA("loss-scale-growth-interval", K_INT, loss_scale_growth, R_AGREE, amp_fp16, "--precision AMP_FP16"),
    FT("label-smoothing", K_FLOAT, label_smoothing, R_AGREE, TASK_IMAGES),
    FT("augment", K_STR, augment, R_AGREE, TASK_IMAGES),
    FT("crop-padding", K_INT, crop_padding, R_AGREE, TASK_IMAGES),
    FT("shuffle", K_ONOFF, shuffle, R_AGREE, T_IMG),
    FNT("mean", K_FLOATS, mean, n_mean, R_AGREE, TASK_IMAGES),
    FNT("std", K_FLOATS, std, n_std, R_AGREE, TASK_IMAGES),
    FT("sync-bn", K_ONOFF, sync_bn, R_NO, T_IMG),
    FT("swav-hidden", K_INT, swav_hidden, R_AGREE, TASK_SWAV),
    FT("swav-dim", K_INT, swav_dim, R_AGREE, TASK_SWAV),
    FT("nmb-prototypes", K_INT, nmb_prototypes, R_AGREE, TASK_SWAV),
    FT("nmb-heads", K_INT, nmb_heads, R_AGREE, TASK_SWAV),
    FT("crops-global-size", K_INT, crops_global_size, R_AGREE, TASK_SWAV),
    FT("crops-small", K_INT, crops_small, R_AGREE, TASK_SWAV),
    FT("crops-small-size", K_INT, crops_small_size, R_AGREE, TASK_SWAV),
    FT("crops-global-scale", K_PAIR, crops_global_scale, R_AGREE, TASK_SWAV),
    FT("crops-small-scale", K_PAIR, crops_small_scale, R_AGREE, TASK_SWAV),
    FT("freeze-prototypes-iters", K_INT, freeze_prototypes_iters, R_AGREE, TASK_SWAV),
    FT("swav-temperature", K_FLOAT, swav_temperature, R_AGREE, TASK_SWAV),
    FT("swav-epsilon", K_FLOAT, swav_epsilon, R_AGREE, TASK_SWAV),
    FT("sinkhorn-iters", K_INT, sinkhorn_iters, R_AGREE, TASK_SWAV),
    FT("crops-jitter", K_FLOAT, crops_jitter, R_AGREE, TASK_SWAV),
    FT("bn-stats-crops", K_STR, bn_stats_crops, R_AGREE, TASK_SWAV),
    FT("queue-length", K_INT, queue_length, R_AGREE, TASK_SWAV),
    FT("queue-start-epoch", K_INT, queue_start_epoch, R_AGREE, TASK_SWAV),
    FT("knn-train", K_INT, knn_train, R_FILL, TASK_SWAV),
    FT("probe-train", K_INT, probe_train, R_FILL, TASK_SWAV),
    FT("probe-epochs", K_INT, probe_epochs, R_FILL, TASK_SWAV),
    FNT("probe-wd", K_FLOATS, probe_wd, n_probe_wd, R_FILL, TASK_SWAV),
    FT("eval-pool", K_INT, eval_pool, R_FILL, TASK_SWAV),
    FNT("eval-layer", K_INTS, eval_layer, n_eval_layer, R_FILL, TASK_SWAV),
    FT("eval-precise-bn", K_INT, eval_precise_bn, R_FILL, TASK_SWAV),
    FT("eval-baseline", K_SWITCH, eval_baseline, R_NO, TASK_SWAV),
    F("seed", K_U64, seed, R_NO), /* --resume takes the checkpoint's seed itself (meta.json's "seed") */
    F("wrap", K_STR, wrap, R_NO),
    F("ac", K_STR, ac, R_NO),
    F("reshard-after-forward", K_ONOFF, reshard_after_forward, R_NO),
    F("sharding", K_STR, sharding, R_NO),
    F("shard-group", K_INT0, shard_group, R_NO),
    F("overlap", K_ONOFF, overlap, R_NO),
    FA("max-inflight", K_INT, max_inflight, R_NO, prefetching, "--overlap on"),
    F("init", K_STR, init, R_NO),
    F("threads", K_INT, threads, R_NO),
    F("nproc", K_INT0, nproc, R_NO),
    F("comm", K_STR, comm, R_NO),
    FA("mpi-reduce", K_STR, mpi_reduce, R_NO, mpi_possible, "--comm auto or mpi"),
    F("collective-timeout", K_FLOAT, collective_timeout, R_NO),
    F("check-collectives", K_SWITCH, check_collectives, R_NO),
    F("profile", K_SWITCH, profile, R_NO),
    F("log", K_STR, log_path, R_NO),
    FT("sample", K_INT, sample, R_NO, TASK_TOKENS),
    F("save-dir", K_STR, save_dir, R_NO),
    F("save-every", K_INT, save_every, R_NO),
    F("keep-last", K_INT, keep_last, R_NO),
    F("resume", K_STR, resume, R_NO),
    F("autoresume", K_SWITCH, autoresume, R_NO),
    F("save-full", K_STR, save_full, R_NO),
    FA("state-dict-type", K_STR, state_dict_type, R_NO, saving, "--save-dir DIR"),
    F("init-from", K_STR, init_from, R_NO),
    F("mem-limit", K_STR, mem_limit, R_NO),
    F("dry-run", K_SWITCH, dry_run, R_NO),
    F("hosts", K_INT0, hosts, R_NO),
    F("ranks-per-host", K_INT0, ranks_per_host, R_NO),
    F("net-gbps", K_FLOAT0, net_gbps, R_NO),
    FA("net-latency-us", K_FLOAT, net_latency_us, R_NO, scaleout, "--dry-run --net-gbps X"),
    FA("shm-gbps", K_FLOAT, shm_gbps, R_NO, scaleout, "--dry-run --net-gbps X"),
    FA("step-compute-ms", K_FLOAT0, step_compute_ms, R_NO, scaleout, "--dry-run --net-gbps X"),
    FA("step-forward-ms", K_FLOAT0, step_forward_ms, R_NO, scaleout, "--dry-run --net-gbps X"),
    F("peak-gflops", K_FLOAT0, peak_gflops, R_NO),
    F("verbose", K_SWITCH, verbose, R_NO),
};
#define N_FLAGS ((int)(sizeof flags / sizeof flags[0]))

/* The flag called name (with or without "--"; '_' for '-'), or NULL. */
static const struct flag *find_flag(const char *name) {
    char n[64];
    if (!strncmp(name, "--", 2)) name += 2;
    size_t len = strlen(name);
    if (len >= sizeof n) return NULL;
    for (size_t i = 0; i <= len; i++) n[i] = name[i] == '_' ? '-' : name[i];
    for (int i = 0; i < N_FLAGS; i++)
        if (!strcmp(flags[i].name, n) || (flags[i].alias && !strcmp(flags[i].alias, n))) return &flags[i];
    return NULL;
}

int config_flag_known(const char *name) {
    return find_flag(name) || !strcmp(name, "--config") || !strcmp(name, "--override");
}

#define FIELD(o, f, type) ((type *)((char *)(o) + (f)->off))
#define CFIELD(o, f, type) ((const type *)((const char *)(o) + (f)->off))

/* The shortest decimal that reads back as x (a float, or a double when dbl). */
static void fmt_num(char *b, size_t n, double x, int dbl) {
    if (x == (double)(long long)x && x > -1e15 && x < 1e15) { /* 300, not 3e+02 */
        snprintf(b, n, "%lld", (long long)x);
        return;
    }
    for (int p = 1; p <= 17; p++) {
        snprintf(b, n, "%.*g", p, x);
        double y = strtod(b, NULL);
        if (dbl ? y == x : (float)y == (float)x) return;
    }
}

/* The flag's value in o as JSON (a null item when unset). */
static cJSON *value_json(const struct flag *f, const struct opts *o) {
    char b[64];
    switch (f->kind) {
    case K_STR: {
        const char *s = *CFIELD(o, f, const char *);
        return s ? cJSON_CreateString(s) : cJSON_CreateNull();
    }
    case K_INT:
    case K_INT0: {
        int v = *CFIELD(o, f, int);
        if (f->kind == K_INT0 && v == 0) return cJSON_CreateNull();
        snprintf(b, sizeof b, "%d", v);
        return cJSON_CreateRaw(b);
    }
    case K_U64:
        snprintf(b, sizeof b, "%llu", (unsigned long long)*CFIELD(o, f, uint64_t));
        return cJSON_CreateRaw(b);
    case K_FLOAT:
    case K_FLOAT0:
        if (f->kind == K_FLOAT0 && *CFIELD(o, f, float) == 0.0f) return cJSON_CreateNull();
        fmt_num(b, sizeof b, (double)*CFIELD(o, f, float), 0);
        return cJSON_CreateRaw(b);
    case K_DOUBLE:
        fmt_num(b, sizeof b, *CFIELD(o, f, double), 1);
        return cJSON_CreateRaw(b);
    case K_SWITCH: return cJSON_CreateBool(*CFIELD(o, f, int) != 0);
    case K_ONOFF: {
        int v = *CFIELD(o, f, int);
        return v < 0 ? cJSON_CreateNull() : cJSON_CreateString(v ? "on" : "off");
    }
    case K_INTS:
    case K_FLOATS:
    case K_PAIR: {
        int n = f->kind == K_PAIR ? 2 : *(const int *)((const char *)o + f->aux);
        cJSON *a = cJSON_CreateArray();
        for (int i = 0; i < n && a; i++) {
            if (f->kind == K_INTS) snprintf(b, sizeof b, "%d", CFIELD(o, f, int)[i]);
            else fmt_num(b, sizeof b, (double)CFIELD(o, f, float)[i], 0);
            cJSON_AddItemToArray(a, cJSON_CreateRaw(b));
        }
        return a;
    }
    }
    return cJSON_CreateNull();
}

/* A JSON value of flag f as the text the flag takes ("true"/"false" for a
 * switch): 1, or 0 for null (unset), or -1 with *want naming the type
 * expected. Numbers come out canonical ([Note: run configuration]). */
static int to_arg(const struct flag *f, const cJSON *v, char *b, size_t n, const char **want) {
    if (!v || cJSON_IsNull(v)) return 0;
    switch (f->kind) {
    case K_STR:
        *want = "a string";
        if (!cJSON_IsString(v)) return -1;
        snprintf(b, n, "%s", v->valuestring);
        return 1;
    case K_INT:
    case K_INT0:
    case K_U64:
        *want = "a whole number";
        if (!cJSON_IsNumber(v) || v->valuedouble != (double)(long long)v->valuedouble ||
            !(v->valuedouble > -9e15 && v->valuedouble < 9e15))
            return -1;
        snprintf(b, n, "%lld", (long long)v->valuedouble);
        return 1;
    case K_FLOAT:
    case K_FLOAT0:
    case K_DOUBLE:
        *want = "a number";
        if (!cJSON_IsNumber(v)) return -1;
        fmt_num(b, n, v->valuedouble, f->kind == K_DOUBLE);
        return 1;
    case K_SWITCH:
        *want = "true or false";
        if (!cJSON_IsBool(v)) return -1;
        snprintf(b, n, "%s", cJSON_IsTrue(v) ? "true" : "false");
        return 1;
    case K_ONOFF:
        *want = "true, false, \"on\" or \"off\"";
        if (cJSON_IsBool(v)) snprintf(b, n, "%s", cJSON_IsTrue(v) ? "on" : "off");
        else if (cJSON_IsString(v) && (!strcmp(v->valuestring, "on") || !strcmp(v->valuestring, "off")))
            snprintf(b, n, "%s", v->valuestring);
        else return -1;
        return 1;
    case K_INTS:
    case K_FLOATS:
    case K_PAIR: {
        *want = f->kind == K_INTS ? "a list of whole numbers" : "a list of numbers";
        if (!cJSON_IsArray(v)) return -1;
        size_t at = 0;
        b[0] = 0;
        for (const cJSON *e = v->child; e; e = e->next) {
            char x[64];
            if (!cJSON_IsNumber(e)) return -1;
            if (f->kind == K_INTS) {
                if (e->valuedouble != (double)(long long)e->valuedouble || fabs(e->valuedouble) > 9e15) return -1;
                snprintf(x, sizeof x, "%lld", (long long)e->valuedouble);
            } else fmt_num(x, sizeof x, e->valuedouble, 0);
            at += (size_t)snprintf(b + at, at < n ? n - at : 0, "%s%s", at ? "," : "", x);
        }
        return at ? 1 : 0; /* an empty list: unset */
    }
    }
    return -1;
}

static char *read_file(const char *path, size_t *len, const char **why) {
    struct stat sb; /* a FIFO would block the open */
    if (stat(path, &sb) != 0) return *why = strerror(errno), NULL;
    if (!S_ISREG(sb.st_mode)) return *why = "not a regular file", NULL;
    if (sb.st_size > (1 << 20)) return *why = "larger than 1 MiB", NULL;
    FILE *fp = fopen(path, "rb");
    if (!fp) return *why = strerror(errno), NULL;
    char *buf = malloc((size_t)sb.st_size + 1);
    *len = buf ? fread(buf, 1, (size_t)sb.st_size, fp) : 0;
    fclose(fp);
    if (!buf) return *why = "out of memory", NULL;
    buf[*len] = 0;
    return buf;
}

cJSON *config_read_json(const char *path, char *err, size_t n) {
    const char *why = "";
    size_t len;
    char *text = read_file(path, &len, &why);
    if (!text) return snprintf(err, n, "cannot read it: %s", why), NULL;
    size_t nul = strlen(text); /* cJSON would stop there: the rest would go unread */
    const char *esc = strstr(text, "\\u0000"); /* a string would end there alike ("a\u0000b" read as "a") */
    if (esc && (size_t)(esc - text) < nul) nul = (size_t)(esc - text);
    const char *end = NULL;
    cJSON *root = nul < len ? NULL : cJSON_ParseWithLengthOpts(text, len, &end, 0);
    if (root)
        while (end < text + len && (*end == ' ' || *end == '\t' || *end == '\n' || *end == '\r')) end++;
    size_t at = nul < len ? nul : end && end >= text && end <= text + len ? (size_t)(end - text) : 0;
    long line = 1;
    for (size_t i = 0; i < at; i++) line += text[i] == '\n';
    if (nul < len)
        snprintf(err, n, "a NUL %s at byte %zu (line %ld)", esc && at == (size_t)(esc - text) ? "(\\u0000)" : "byte",
                 at, line);
    else if (!root) snprintf(err, n, "invalid JSON near byte %zu (line %ld)", at, line);
    else if (at < len) snprintf(err, n, "bytes after the JSON value at byte %zu (line %ld; one value per file)", at, line);
    if (root && at < len) {
        cJSON_Delete(root);
        root = NULL;
    }
    free(text);
    return root;
}

/* argv being built: each string is borrowed (argv's) or owned by the list
 * (own: the ones add_flag wrote). The options point into it for the whole run:
 * config_release frees it when the run is over. */
struct args {
    char **v, **own;
    int n, cap, n_own;
};

static void args_add(struct args *a, const char *s) {
    if (a->n + 2 > a->cap) {
        a->cap = 2 * a->cap + 16;
        a->v = realloc(a->v, (size_t)a->cap * sizeof *a->v);
        if (!a->v) usage_error("out of memory");
    }
    a->v[a->n++] = (char *)s;
    a->v[a->n] = NULL;
}

/* a copy of s, added to a and owned by it */
static void args_add_copy(struct args *a, const char *s) {
    char *d = malloc(strlen(s) + 1);
    char **own = realloc(a->own, (size_t)(a->n_own + 1) * sizeof *own);
    if (!d || !own) usage_error("out of memory");
    a->own = own;
    a->own[a->n_own++] = strcpy(d, s);
    args_add(a, d);
}

static void args_free(struct args *a) {
    for (int i = 0; i < a->n_own; i++) free(a->own[i]);
    free(a->own);
    free(a->v);
    *a = (struct args){0};
}

/* "--name" [value] for flag f whose JSON value is v; 0 when nothing (null, a false switch). */
static int add_flag(struct args *a, const struct flag *f, const cJSON *v, const char *src_flag, const char *src,
                    const char *key) {
    char b[4096];
    const char *want = "";
    int r = to_arg(f, v, b, sizeof b, &want);
    if (r < 0) usage_error("%s %s: key \"%s\": expected %s", src_flag, src, key, want);
    if (r == 0 || (f->kind == K_SWITCH && !strcmp(b, "false"))) return 0;
    char name[80];
    snprintf(name, sizeof name, "--%s", f->name);
    args_add_copy(a, name);
    if (f->kind != K_SWITCH) args_add_copy(a, b);
    return 1;
}

/* The flag at argv[*i] (NULL for a word that names none) and *i moved past
 * its value: the flags not in the table (--config, --override) take one, and
 * no value is ever read as a flag of its own. */
static const struct flag *arg_flag(char **argv, int *i) {
    const struct flag *f = strncmp(argv[*i], "--", 2) ? NULL : find_flag(argv[*i]);
    if (!f || f->kind != K_SWITCH) ++*i;
    return f;
}

static int g_cfg_end = 1;       /* argv[1, g_cfg_end) came from --config */
static int g_cl_argc;           /* the command line (config_argv's argv) */
static char **g_cl_argv;
static struct args g_config_args; /* config_argv's argv */
static struct args g_resume_args; /* config_resume's argv */
static const char *g_cfg_name;  /* its file */

void config_argv(int argc, char **argv, int *nargc, char ***nargv) {
    *nargc = g_cl_argc = argc;
    *nargv = g_cl_argv = argv;
    const char *path = NULL;
    for (int i = 1; i + 1 < argc; i++) {
        if (!strcmp(argv[i], "--config")) {
            if (path) usage_error("--config is given twice ('%s' and '%s')", path, argv[i + 1]);
            path = argv[i + 1];
        }
        arg_flag(argv, &i);
    }
    if (!path) return;
    char err[160];
    cJSON *root = config_read_json(path, err, sizeof err);
    if (!root) usage_error("--config %s: %s", path, err);
    if (!cJSON_IsObject(root)) usage_error("--config %s: not a JSON object", path);
    struct args a = {0};
    args_add(&a, argv[0]);
    for (const cJSON *e = root->child; e; e = e->next) {
        const struct flag *f = find_flag(e->string);
        if (!strcmp(e->string, "config") || !strcmp(e->string, "override") || !strcmp(e->string, "help"))
            usage_error("--config %s: key \"%s\": not allowed in a config file (give it on the command line)", path,
                        e->string);
        if (!f)
            usage_error("--config %s: unknown key \"%s\" (the keys are fsdp-train's long flag names, e.g. \"lr\", "
                        "\"lr-schedule\"; see --help)", path, e->string);
        for (const cJSON *p = root->child; p != e; p = p->next)
            if (find_flag(p->string) == f)
                usage_error("--config %s: key \"%s\" is given twice (also as \"%s\")", path, e->string, p->string);
        add_flag(&a, f, e, "--config", path, e->string);
    }
    cJSON_Delete(root);
    g_cfg_end = a.n;
    g_cfg_name = path;
    for (int i = 1; i < argc; i++) args_add(&a, argv[i]);
    opts_set_origin(1, NULL, g_cfg_end, g_cfg_name);
    g_config_args = a;
    *nargc = a.n;
    *nargv = a.v;
}

void config_release(void) {
    args_free(&g_config_args);
    args_free(&g_resume_args);
}

char *config_json(const struct opts *o) {
    cJSON *root = cJSON_CreateObject();
    for (int i = 0; i < N_FLAGS && root; i++) /* --epochs sets the steps: "steps" would contradict it */
        cJSON_AddItemToObject(root, flags[i].name, o->epochs && !strcmp(flags[i].name, "steps")
                                                       ? cJSON_CreateNull() : value_json(&flags[i], o));
    char *s = root ? cJSON_PrintUnformatted(root) : NULL;
    cJSON_Delete(root);
    if (!s) fail_rank("out of memory for the configuration");
    return s;
}

/* The canonical text of o's value of f ("" when unset). */
static void current_text(const struct flag *f, const struct opts *o, char *b, size_t n) {
    cJSON *v = value_json(f, o);
    char *txt = v ? cJSON_PrintUnformatted(v) : NULL; /* its numbers are raw text: read them back */
    cJSON *w = txt ? cJSON_Parse(txt) : NULL;
    const char *want;
    if (to_arg(f, w, b, n, &want) <= 0) b[0] = 0;
    cJSON_Delete(w);
    free(txt);
    cJSON_Delete(v);
}

/* Whether two canonical texts of f's value are the same value (a switch's
 * "false" is unset; strings ignore case). */
static int same_text(const struct flag *f, const char *a, const char *b) {
    if (f->kind == K_SWITCH) return !strcmp(a[0] && strcmp(a, "false") ? "true" : "", b[0] && strcmp(b, "false") ? "true" : "");
    return f->kind == K_STR ? !strcasecmp(a, b) : !strcmp(a, b);
}

int config_resume(struct opts *o, int argc, char **argv, const char *ck_json, const char *ck_dir) {
    if (!ck_json || !ck_json[0]) return 0;
    cJSON *ck = cJSON_Parse(ck_json);
    if (!cJSON_IsObject(ck)) usage_error("--resume %s: its train_config is not a JSON object", ck_dir);
    /* the flags given (argv = --config's, then the command line's) and the ones --override names */
    char given[N_FLAGS] = {0}, over[N_FLAGS] = {0};
    for (int i = 1; i < argc; i++) {
        const struct flag *f = arg_flag(argv, &i);
        if (f) given[f - flags] = 1;
    }
    if (o->override) {
        char *list = strdup(o->override), *save = NULL;
        if (!list) usage_error("out of memory");
        size_t ol = strlen(o->override);
        if (!ol || o->override[0] == ',' || o->override[ol - 1] == ',' || strstr(o->override, ",,"))
            usage_error("--override '%s': an empty name in the list (FLAG[,FLAG...])", o->override);
        for (char *t = strtok_r(list, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
            const struct flag *f = find_flag(t);
            if (f && f->restore == R_FILL)
                usage_error("--override: '%s' needs no override: a --%s given with --resume is used as given", t,
                            f->name);
            if (!f || f->restore != R_AGREE) {
                char names[2048] = "";
                size_t at = 0;
                for (int i = 0; i < N_FLAGS; i++)
                    if (flags[i].restore == R_AGREE && at < sizeof names)
                        at += (size_t)snprintf(names + at, sizeof names - at, "%s%s", at ? "," : "", flags[i].name);
                usage_error("--override: '%s' is not a flag --resume restores (those are: %s)", t, names);
            }
            over[f - flags] = 1;
        }
        free(list);
    }
    const cJSON *ck_epochs = cJSON_GetObjectItemCaseSensitive(ck, "epochs");
    int by_epochs = ck_epochs && !cJSON_IsNull(ck_epochs);
    struct args a = {0};
    int restored = 0;
    args_add(&a, argv[0]);
    for (int i = 0; i < N_FLAGS; i++) {
        const struct flag *f = &flags[i];
        if (!f->restore || over[i]) continue;
        if (by_epochs && !strcmp(f->name, "steps")) continue; /* follows from the epochs */
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(ck, f->name);
        if (!v) continue; /* a flag the checkpoint's program did not have */
        if (given[i] && f->restore == R_FILL) continue;
        if (given[i]) {
            char mine[4096], theirs[4096];
            const char *want = "";
            current_text(f, o, mine, sizeof mine);
            int r = to_arg(f, v, theirs, sizeof theirs, &want);
            if (r < 0) usage_error("--resume %s: its train_config: key \"%s\": expected %s", ck_dir, f->name, want);
            if (r == 0) theirs[0] = 0;
            if (!same_text(f, mine, theirs))
                usage_error("--%s %s disagrees with the checkpoint %s, saved with --%s %s: leave --%s out to "
                            "continue with the checkpoint's value, or give --override %s to use yours",
                            f->name, mine[0] ? mine : "(unset)", ck_dir, f->name, theirs[0] ? theirs : "(unset)",
                            f->name, f->name);
            continue;
        }
        restored += add_flag(&a, f, v, "--resume", ck_dir, f->name);
    }
    cJSON_Delete(ck);
    int ck_end = a.n;
    for (int i = 1; i < argc; i++) args_add(&a, argv[i]);
    opts_set_origin(ck_end, ck_dir, g_cfg_end + ck_end - 1, g_cfg_name);
    *o = opts_default();
    parse_args(a.n, a.v, o);
    g_resume_args = a; /* the options point into it */
    return restored;
}

/* [Note: flags a run does not read]
 * A flag that the run's task never reads (--augment on a GPT, --knn-train on
 * a classifier), or that only other settings read (--momentum with AdamW,
 * --loss-scale-init without AMP_FP16, --shm-gbps without the scale-out plan),
 * would be ignored without a word, and the user would believe it took
 * effect. The flags table says who reads each flag (tasks, applies); one
 * given on the command line is refused, and a --config key only when its
 * value is not the default: a log's first line, given back as --config,
 * holds every key with the defaults of the ones its run did not read. */
static void check_one(const struct flag *f, const struct opts *o, int task, const char *value, const char *origin) {
    static const char *const names[] = {"tokens (a GPT on token data)", "images", "swav"};
    char readers[64] = "";
    size_t at = 0;
    if (f->tasks && !(f->tasks & task)) {
        for (int k = 0; k < 3; k++)
            if (f->tasks & (1 << k))
                at += (size_t)snprintf(readers + at, sizeof readers - at, "%s%.*s", at ? " or " : "--task ",
                                       (int)strcspn(names[k], " "), names[k]);
        int me = task == TASK_TOKENS ? 0 : task == TASK_IMAGES ? 1 : 2;
        usage_error("%s--%s%s%s: this run's task, %s, does not read it; it applies to %s (leave it out)", origin,
                    f->name, value ? " " : "", value ? value : "", names[me], readers);
    }
    if (f->applies && !f->applies(o))
        usage_error("%s--%s%s%s: this run does not read it; it applies with %s (leave it out)", origin, f->name,
                    value ? " " : "", value ? value : "", f->when);
}

void config_check_read(const struct opts *o, int task) {
    for (int i = 1; i < g_cl_argc; i++) {
        int at = i;
        const struct flag *f = arg_flag(g_cl_argv, &i);
        if (f) check_one(f, o, task, f->kind == K_SWITCH || at + 1 >= g_cl_argc ? NULL : g_cl_argv[at + 1], "");
    }
    struct opts def = opts_default();
    def.lr = o->lr; /* the defaults that follow another flag, as this run has it */
    opts_derive(&def);
    char origin[1100];
    for (int i = 1; i < g_cfg_end; i++) {
        int at = i;
        const struct flag *f = arg_flag(g_config_args.v, &i);
        if (!f) continue;
        const char *v = f->kind != K_SWITCH ? g_config_args.v[at + 1] : "true";
        char d[4096];
        current_text(f, &def, d, sizeof d);
        if (same_text(f, v, d)) continue;
        snprintf(origin, sizeof origin, "--config %s: ", g_cfg_name);
        check_one(f, o, task, f->kind == K_SWITCH ? NULL : v, origin);
    }
}
