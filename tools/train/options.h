/*
 * options.h - fsdp-train's flags: the options struct with its defaults, the
 * --help text and the parser (options.c). Every rank parses the same argv
 * before MPI starts; a bad flag is a usage error (exit 2, one line from
 * rank 0).
 */
#ifndef FSDP_TRAIN_OPTIONS_H
#define FSDP_TRAIN_OPTIONS_H

#include <stddef.h>
#include <stdint.h>

#define EVAL_LAYERS_MAX 4 /* --eval-layer: layer1..layer4, each at most once */
#define STEPS_MAX (1 << 30) /* --steps, and the steps --epochs makes: a step count fits an int */

struct opts {
    const char *model, *model_config, *data, *log_path;
    const char *tokenizer;      /* --tokenizer DIR (GPT-2 BPE), or NULL */
    int batch, seq, steps, warmup, threads, nproc, sample, verbose;
    float lr, min_lr, weight_decay, clip, beta1, beta2, eps, momentum;
    const char *schedule, *optim, *comm;
    const char *mpi_reduce; /* --mpi-reduce: NULL (the library's default), ordered or native */
    int decay_all;
    int check_collectives;
    int profile;                /* --profile: time by module over the timed steps (rank 0's) */
    float collective_timeout;
    uint64_t seed;
    const char *save_dir, *resume, *init_from, *save_full; /* checkpoints */
    int save_every, keep_last;
    int autoresume;             /* --autoresume: --save-dir's newest checkpoint when it holds one */
    const char *state_dict_type; /* --state-dict-type sharded | full: what --save-dir saves */
    float peak_gflops;          /* --peak-gflops X per rank for MFU; 0 = measure (train/mfu.c) */
    int dry_run;                /* --dry-run: print the memory plan and stop */
    /* the scale-out model with --dry-run (tools/train/scaleout.c) */
    int hosts, ranks_per_host;  /* --hosts H --ranks-per-host R (0: one host of --nproc) */
    float net_gbps;             /* --net-gbps: each host's link (0: no scale-out plan) */
    float net_latency_us;       /* --net-latency-us: per network message */
    float shm_gbps;             /* --shm-gbps: shared memory within a host (0: free) */
    float step_compute_ms;      /* --step-compute-ms (0: measured on this machine) */
    float step_forward_ms;      /* --step-forward-ms (0: a third of the step's compute) */
    const char *mem_limit;      /* --mem-limit auto | off | SIZE per rank (default auto) */
    int mem_limit_auto;         /* auto: refuse a plan over the host's memory per local rank */
    size_t mem_limit_bytes;     /* SIZE: refuse a plan over it and cap the allocator; 0 = none */
    /* preparation (fsdp_parallelize_model) */
    const char *wrap, *ac, *init; /* --wrap, --ac, --init */
    int reshard_after_forward;    /* --reshard-after-forward on|off */
    const char *sharding;         /* --sharding FULL_SHARD | SHARD_GRAD_OP | NO_SHARD | HYBRID_SHARD */
    int shard_group;              /* --shard-group K (HYBRID_SHARD), 0 = the ranks of a host */
    int grad_accum;               /* --grad-accum K micro-batches per step */
    const char *accum_mode;       /* --accum-mode reduce | no_sync */
    int overlap, max_inflight;    /* --overlap on|off, --max-inflight N */
    /* mixed precision */
    const char *precision;        /* --precision FP32 | AMP_BF16 | AMP_FP16 */
    const char *mixed_precision;  /* --mixed-precision FULL | DEFAULT | PURE */
    int lp_shard_copy;            /* --lp-shard-copy on|off */
    double loss_scale_init;       /* --loss-scale-init (AMP_FP16) */
    int loss_scale_growth;        /* --loss-scale-growth-interval (AMP_FP16) */
    /* image classification (tools/train/task_images.c) */
    int epochs;                   /* --epochs E: steps = E * ceil(train count / batch); 0 = --steps */
    int steps_given;              /* --steps was on the command line */
    int eval_every;               /* --eval-every K steps; 0 = only at the end */
    int eval_batch;               /* --eval-batch N global test images (sequences) per forward; 0 = --batch */
    int eval_batches;             /* --eval-batches N: evaluate N global batches; 0 = the whole set once */
    const char *val_data;         /* --val-data FILE: GPT held-out tokens (any --data format) */
    const char *config;           /* --config FILE (tools/train/config.c) */
    const char *override;         /* --override FLAG[,FLAG]: with --resume, these come from the flags */
    float label_smoothing;        /* --label-smoothing X */
    int nesterov;                 /* --nesterov (SGD) */
    int lr_steps[16], n_lr_steps; /* --lr-steps a,b,...: the step schedule's milestones */
    const char *augment;          /* --augment none | crop-flip */
    int crop_padding;             /* --crop-padding N (crop-flip) */
    int shuffle;                  /* --shuffle on|off */
    float mean[4], std[4];        /* --mean, --std: per channel (one value: every channel) */
    int n_mean, n_std;
    int sync_bn;                  /* --sync-bn on|off; -1 = on when the world is larger than one */
    const char *task;             /* --task tokens | images | swav; NULL: from the model */
    /* SwAV (tools/train/task_swav.c) */
    int swav_hidden, swav_dim, nmb_prototypes, nmb_heads;
    int crops_global_size, crops_small, crops_small_size;
    float crops_global_scale[4], crops_small_scale[4];
    int freeze_prototypes_iters;
    int knn_train;                /* --knn-train N train images for the kNN bank */
    int probe_train, probe_epochs; /* --probe-train N images, --probe-epochs E of the linear probe */
    float probe_wd[4];            /* --probe-wd X[,X..]: the probe's weight decay, or candidates to select from */
    int n_probe_wd;
    int eval_pool;                /* --eval-pool G: the evaluations read the trunk's last map pooled to G x G */
    int eval_layer[EVAL_LAYERS_MAX], n_eval_layer; /* --eval-layer L[,L..]: the ResNet layers read, chosen on
                                                      held-out images */
    int eval_precise_bn;          /* --eval-precise-bn N: batch norm statistics of N whole training images */
    int eval_baseline;            /* --eval-baseline: the probes on the untrained trunk and raw pixels */
    int queue_length, queue_start_epoch; /* --queue-length L (global rows), --queue-start-epoch E */
    float crops_jitter;           /* --crops-jitter X: brightness and contrast in [1-X, 1+X] */
    const char *bn_stats_crops;   /* --bn-stats-crops all | global: the crops batch norm's running statistics follow */
    float swav_temperature, swav_epsilon;
    int sinkhorn_iters;
    float lars_eta;               /* --lars-eta: LARS's trust coefficient */
};

#define MODEL_DEFAULT "small"
#define IMAGE_DATA_DEFAULT "fashion-mnist"

/* The defaults (--help prints them). */
struct opts opts_default(void);
/* Sets the defaults that follow another flag (--min-lr: --lr / 10) where o
 * left them unset; parse_args does it, and config_check_read for the
 * defaults a --config value is compared with. */
void opts_derive(struct opts *o);
/* Parses argv into o (which holds the defaults); --help prints and exits 0. */
void parse_args(int argc, char **argv, struct opts *o);
/* Usage errors about argv[i] name where it came from: for i in [1, ck_end)
 * the checkpoint ck_name's train_config, in [ck_end, cfg_end) --config
 * cfg_name (tools/train/config.c builds such an argv). */
void opts_set_origin(int ck_end, const char *ck_name, int cfg_end, const char *cfg_name);
/* This process's rank from the launcher's environment (0 when started alone). */
int rank_env(void);
/* "fsdp-train: <message>" on rank 0, exit 2. */
_Noreturn void usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
