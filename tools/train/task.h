/*
 * task.h - what fsdp-train trains: a task builds the model and its data and
 * runs one step; fsdp-train.c and its other files here own everything
 * around it (flags, sharding, the launch, the step loop, logging,
 * checkpoints, the summary). Two tasks:
 *   tokens (task_tokens.c): a GPT on token data, next-token cross-entropy;
 *   images (task_images.c): an image classifier (a small CNN or a ResNet)
 *       on an IDX image set, cross-entropy, top-1 evaluation on the test split;
 *   swav (task_swav.c): SwAV self-supervised training of a trunk (the image
 *       task's CNN or a ResNet without classifier) and SwAV's head on
 *       multi-crop views, kNN evaluation of the trunk's features.
 * Errors that every rank detects alike end the job through fail_all /
 * fail_input, errors of one rank through fail_rank.
 */
#ifndef FSDP_TRAIN_TASK_H
#define FSDP_TRAIN_TASK_H

#include "fsdp.h"
#include "options.h"

#include <stdio.h>

struct task;

struct task_ops {
    /* Second phase of creation, after the checks between flags, world and
     * checkpoint and after --resume settled the seed: opens the data and
     * builds root (shapes only). */
    void (*open)(struct task *t, struct fsdp_ctx *ctx, const struct opts *o);
    /* Rank 0: the line describing the model, after sharding, and the lines
     * describing the data (after the world, sharding and precision lines). */
    void (*describe_model)(struct task *t, struct fsdp_ctx *ctx, const struct opts *o, struct fsdp_model *fm);
    void (*describe_data)(struct task *t, struct fsdp_ctx *ctx, const struct opts *o, struct fsdp_model *fm);
    /* One training step (global batch `step`, learning rate lr): data,
     * forward, loss, backward, optimizer update. COLLECTIVE. */
    enum fsdp_status (*step)(struct task *t, struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct opts *o,
                             int step, float lr, struct fsdp_step_result *r);
    /* Evaluation on held-out data (NULL: none): mean loss, top-1 accuracy
     * and the number of examples evaluated, the same on every rank. COLLECTIVE. */
    enum fsdp_status (*eval)(struct task *t, struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct opts *o,
                             double *loss, double *acc, int64_t *count);
    /* The model's identity for a checkpoint's meta (config or model_json). */
    void (*meta)(struct task *t, struct fsdp_ckpt_meta *m);
    /* Appends to the summary's loss figure (e.g. " (floor 1.234)"). */
    void (*summary_note)(struct task *t, char *buf, size_t cap);
    /* After training (e.g. sampling text); may be NULL. COLLECTIVE. */
    void (*finish)(struct task *t, struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct opts *o);
    void (*free)(struct task *t);
    /* Optional (NULL: nothing): before sharding, parameter groups on the
     * optimizer (fsdp_optim_add_group); after sharding (and loading), set-up
     * that needs the sharded model (re-initialisation, post-step hooks).
     * COLLECTIVE (after_shard). */
    void (*prepare_optim)(struct task *t, struct fsdp_ctx *ctx, const struct opts *o, struct fsdp_optim *opt);
    void (*after_shard)(struct task *t, struct fsdp_ctx *ctx, const struct opts *o, struct fsdp_model *fm,
                        struct fsdp_optim *opt);
    /* Optional: once before this run's first step, outside the step's clock
     * (e.g. --eval-baseline's evaluations). COLLECTIVE. */
    enum fsdp_status (*before_train)(struct task *t, struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct opts *o);
};

/* An input every rank reads whole, taking its part of each batch: the ranks
 * must read the same one ([Note: the same data on every rank], fsdp-train.c). */
struct task_input {
    const char *flag; /* "--data", "--val-data" */
    char name[200];   /* the path, or a data set's name and split */
    const char *unit; /* what count counts: "tokens", "images" */
    int64_t count;
    uint32_t crc;     /* CRC-32 of samples of its contents */
};

struct task {
    const struct task_ops *ops;
    struct fsdp_module *root;   /* the model, shapes only until sharded; freed by fsdp-train */
    const char *block_type;     /* --wrap block and --ac blocks / every:K select this module type */
    const char *ac_attn_type;   /* --ac attn's module type, NULL when the model has none */
    int is_gpt;                 /* the GPT on tokens (the summary's rate in tokens) */
    const char *item, *item_json; /* rates: "tok" / "tokens_per_s", "img" / "images_per_s" */
    char batch_unit[48];        /* after the batch size in messages: "x 64 tokens", "images" */
    double items_per_step;      /* items in one global batch */
    double train_flops_per_item; /* model FLOPs of a training step per item (3x forward) */
    int seq;                    /* the GPT's T for the memory plan (1 otherwise) */
    int steps;                  /* the run's steps (--steps, or --epochs of the image set) */
    fsdp_wrap_fn wrap;          /* --wrap block's policy (NULL: a unit per block_type), ud the task */
    const char *acc_name;       /* the evaluation's accuracy in the log (NULL: "eval_acc") */
    int eval_ppl;               /* the evaluation is a text's: perplexity, no accuracy (eval.c) */
    const char *eval_count;     /* what it counts in the log (NULL: "eval_images") */
    char log_extra[1024];       /* after a step: JSON members (`"k": v, `) for the --log line
                                   (an evaluation may append its own) */
    char eval_note[96];         /* after the accuracy in the evaluation's lines (e.g. "  probe_acc 90.1%") */
    struct task_input inputs[4]; /* what open read, compared across the ranks */
    int n_inputs;
    void *impl;
};

/* Records an input of t (open): a file by its size and samples of its bytes,
 * or an image set by its images' pixels and labels. */
void task_input_file(struct task *t, const char *flag, const char *path, const char *unit, int64_t count);
void task_input_images(struct task *t, const char *flag, const char *name, const struct fsdp_images *im);

/* Which task a run is: 1 for an image model (--model cnn/resnet*, a
 * --model-config with an "arch" key, or a checkpoint whose meta holds
 * "model"), else 0. */
int task_is_images(const struct opts *o, const struct fsdp_ckpt_meta *ck);
/* First phase: the model config from the flags or the checkpoint `ck`
 * (NULL without --resume), checked against them; sets t->steps. */
void task_tokens_create(struct fsdp_ctx *ctx, struct opts *o, const struct fsdp_ckpt_meta *ck,
                        const char *resume_dir, struct task *t);
void task_images_create(struct fsdp_ctx *ctx, struct opts *o, const struct fsdp_ckpt_meta *ck,
                        const char *resume_dir, struct task *t);
void task_swav_create(struct fsdp_ctx *ctx, struct opts *o, const struct fsdp_ckpt_meta *ck,
                      const char *resume_dir, struct task *t);

/* Returns the status of expr from the calling function unless it is FSDP_OK. */
#define TRY(expr)                                                                                                  \
    do {                                                                                                           \
        enum fsdp_status try_st_ = (expr);                                                                         \
        if (try_st_ != FSDP_OK) return try_st_;                                                                    \
    } while (0)

/* --eval-batch: items of one evaluation forward over all ranks (default
 * --batch); of n held-out images, an image evaluation reads the first
 * --eval-batches global batches of them, or all (0). */
static inline int64_t task_eval_batch(const struct opts *o) { return o->eval_batch ? o->eval_batch : o->batch; }
static inline int64_t task_eval_images(const struct opts *o, int64_t n) {
    int64_t first = (int64_t)o->eval_batches * task_eval_batch(o);
    return o->eval_batches && first < n ? first : n;
}

/* Shared by the image tasks (task_images.c): the small CNN (num_classes 0:
 * no fc, the output is the pooled features (N, 2 width)); the data set's
 * two splits, checked alike (exit 2 naming --data): every label of both
 * below num_classes, or, num_classes 0, the classes of the training labels
 * (their largest + 1, bytes: at most 256), which the test labels must then
 * be below; returns the num_classes used; normalisation of the flags' mean
 * and std into bo; image i of im as normalised CHW. */
enum fsdp_status task_cnn_create(struct fsdp_ctx *ctx, int in_chans, int width, int num_classes,
                                 struct fsdp_module **out);
int task_images_open_data(struct task *t, struct fsdp_ctx *ctx, const struct opts *o, const char *name,
                          int num_classes, struct fsdp_images **train, struct fsdp_images **test);
void task_images_norm(const struct opts *o, struct fsdp_image_batch_opts *bo);
void task_load_image(const struct fsdp_images *im, const struct fsdp_image_batch_opts *bo, int64_t i, float *dst);
/* arch names one of the library's ResNets (fsdp_resnet_config_preset takes it). */
int task_is_resnet(const char *arch);
/* The run's steps: --steps, or --epochs x the batches of count training
 * images (the last one partial); exit 2 when that is past STEPS_MAX. */
int task_epoch_steps(const struct opts *o, int64_t count, const char *data);

/* eval.c: an evaluation's figures on the terminal (the line after step
 * `step`), in a --log line (JSON members `"k": v, `) and in the summary. */
struct eval_result {
    double loss, acc; /* mean loss; top-1 accuracy (NaN: none) */
    int64_t count;    /* examples (images, tokens) evaluated */
};
void eval_print(const struct task *t, int step, int steps, const struct eval_result *e);
void eval_log(FILE *f, const struct task *t, const struct eval_result *e);
void eval_summary(const struct task *t, const struct eval_result *e);

/* Evaluations of frozen features (probe.c), the same on every rank, no
 * communication. The linear probe ([Note: linear probe]) standardises xtr
 * (n, F) and xte (nt, F) in place, trains a linear classifier of C classes
 * on xtr, ytr for `epochs` epochs from `seed` with weight decay wd[0], or
 * with the best of wd[0..n_wd) on held-out training rows (*wd_used), and
 * sets *acc to the top-1 accuracy on xte, yte (held non-NULL: *held the
 * held-out accuracy of the chosen wd, even with one); -1 when out of
 * memory, else 0. The kNN counts the
 * test rows [lo, hi) of test (L2-normalised rows) whose k nearest bank rows
 * (cosine; bank L2-normalised, nb rows), weighted exp(sim / temperature),
 * vote for their label; *st is an fsdp_gemm failure or FSDP_OK. */
int task_linear_probe(float *xtr, const int32_t *ytr, int64_t n, float *xte, const int32_t *yte, int64_t nt,
                      int64_t F, int C, int epochs, const float *wd, int n_wd, uint64_t seed, double *acc,
                      float *wd_used, double *held);
int64_t task_knn_correct(struct fsdp_ctx *ctx, const float *bank, const int32_t *ybank, int64_t nb, const float *test,
                         const int32_t *ytest, int64_t lo, int64_t hi, int64_t F, int C, int k, double temperature,
                         enum fsdp_status *st);

/* --dry-run --net-gbps: rank 0 prints the scale-out plan of root at `world` (scaleout.c). */
void scaleout_print(struct fsdp_ctx *ctx, const struct opts *o, struct fsdp_module *root, const struct task *t,
                    int world);

/* The flags as the library's sharding (prepare.c). check_strategy_flags:
 * --sharding, --shard-group and --grad-accum against the world (the same
 * verdict on every rank). prepare_model: fsdp_parallelize_model of root with
 * --wrap, --ac, --precision, --mixed-precision, the strategy and, loading
 * (--resume or --init-from replace every parameter), no initialisation.
 * memory_plan: plans the run for `pworld` ranks by measuring the task's real
 * step (fsdp_plan_memory_run); --dry-run prints the plan per rank and exits,
 * --mem-limit refuses a plan over the limit before any work and hands the
 * limit to the library's allocator. precision_name: --precision as Composer
 * spells it. local_ranks: this host's ranks (Open MPI's local size, else 1).
 * host_free_per_rank: the host's memory available now (MemAvailable, or its
 * cgroup's limit) per local rank, less a reserve, as --mem-limit auto
 * measures it (0: unknown).
 * shard_opts_of: the units, precision and strategy prepare_model asks
 * fsdp_parallelize_model for on `world` ranks, as fsdp_shard_opts (for the
 * planners; from the same config, fsdp_parallel_config_shard_opts). */
void check_strategy_flags(const struct opts *o, int world);
struct fsdp_shard_opts shard_opts_of(struct fsdp_ctx *ctx, const struct task *t, const struct opts *o, int world);
struct fsdp_model *prepare_model(struct fsdp_ctx *ctx, const struct task *t, const struct opts *o,
                                 struct fsdp_module *root, struct fsdp_optim *opt, int loading);
void memory_plan(struct fsdp_ctx *ctx, const struct task *t, const struct opts *o, struct fsdp_module *root,
                 int pworld);
const char *precision_name(const struct opts *o);
int local_ranks(void);
size_t host_free_per_rank(void);

/* The job's ranks and their launcher (launch.c). relaunch: --nproc N
 * without mpirun re-runs this program under mpirun (does not return; exit 1
 * when mpirun cannot run). launcher_watch_start: a rank under mpirun stops
 * (exit 1) as soon as its launcher is gone, [Note: launcher watch];
 * launcher_check: that check now (nothing when unwatched). */
_Noreturn void relaunch(int argc, char **argv, int nproc);
void launcher_watch_start(void);
void launcher_check(void);

/* Checkpoint folders and output paths (ckpt.c). resolve_resume: --resume
 * DIR as a checkpoint (DIR itself, else its newest step-N, written into buf;
 * NULL: none). save_ckpt: every rank saves --save-dir/step-N, then rank 0
 * keeps the newest --keep-last; saves_step: whether a run of `steps` steps
 * saves after step n (every --save-every and the last). COLLECTIVE.
 * check_outputs: rank 0 checks --log, --save-full and --save-dir (no
 * checkpoint there after step `start`, the resumed one, and nothing at a
 * step this run saves that its writer would refuse) and locks --save-dir
 * ([Note: output preflight]); every rank ends alike on a failure.
 * COLLECTIVE. open_log: --log for writing (appending: after its lines, for
 * a resumed run), a regular file only, never through a link (NULL and errno
 * on failure);
 * log_flush: writes out what it holds (f may be NULL), a failure ends the
 * rank naming the file (a full disk, /dev/full) instead of losing lines. */
const char *resolve_resume(const char *dir, char *buf, size_t n);
/* --autoresume (Composer's autoresume): --save-dir's newest complete
 * checkpoint (into buf), or NULL when it holds none; every rank must find the
 * same one (a --save-dir each host keeps its own copy of would not), which
 * the ranks check before any of them loads: a difference ends the job naming
 * the folder. Rank 0 says which. COLLECTIVE. */
const char *resolve_autoresume(struct fsdp_ctx *ctx, const struct opts *o, char *buf, size_t n);
void save_ckpt(struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct opts *o, struct task *t, int step,
               int tty);
int saves_step(const struct opts *o, long n, long steps);
void check_outputs(struct fsdp_ctx *ctx, const struct opts *o, long start, long steps);
FILE *open_log(const char *path, int append);
void log_flush(FILE *f, const char *path);

/* fsdp-train.c's error exits and clock, for the tasks. */
_Noreturn void fail_all(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
_Noreturn void fail_input(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
_Noreturn void fail_rank(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* COLLECTIVE: code 0 (this rank is fine) or this rank's exit code and msg;
 * returns where no rank failed, else every rank exits with the lowest failing
 * rank's code, that rank printing its msg ([Note: setup agreement]). */
void agree_or_fail(int code, const char *msg);
double now_s(void);

#endif
