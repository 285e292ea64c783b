/*
 * swav.h - what fsdp-train's SwAV task shares between its files:
 * task_swav.c (the model, crops, queue, step, checkpoints) and swav_eval.c
 * (the kNN and linear-probe evaluation of the trunk's features).
 */
#ifndef FSDP_TRAIN_SWAV_H
#define FSDP_TRAIN_SWAV_H

#include "task.h"

struct swav {
    char arch[16];
    struct fsdp_resnet_config rc; /* a ResNet trunk */
    int cnn_width;
    int64_t feat_dim;
    double layer_acc[EVAL_LAYERS_MAX][2]; /* the last evaluation's kNN and probe test accuracies at each --eval-layer */
    struct fsdp_swav_head_config hc;
    const char *data_name, *cfg_source;
    struct fsdp_images *train, *test;
    struct fsdp_images_info ti;
    struct fsdp_image_batch_opts bo;
    int Bl, V, Sg, Ss, n_classes;
    int64_t W; /* output width D + H K */
    float *xg, *xs, *og, *os, *sc, *dsc, *dg, *ds;
    float *codes; /* (H, 2, Bl, K) this step's codes of the global crops, per head */
    struct fsdp_module *root_m, *trunk, *head; /* fsdp_swav_model_create's, its children */
    struct fsdp_optim *opt;
    int proto_group; /* optimizer group of the frozen prototypes, 0: none */
    int frozen;
    struct fsdp_swav_opts so;
    double loss_value;
    /* SwAV's queue ([Note: SwAV queue]); L 0: none */
    int64_t L;
    struct fsdp_buffer *queue;        /* F32 (2, L, D): past embeddings of each global crop, newest first */
    struct fsdp_buffer *queue_filled; /* I64 scalar: rows of it filled so far (at most L) */
    float *zmine, *zall;              /* (2, Bl, D) this rank's embeddings, (world, 2, Bl, D) every rank's */
    float *qsc;                       /* (H, 2, Lr, K) scores of this rank's queue rows, Lr = its share of L */
    int64_t q_lo, q_rows;             /* this rank's rows [q_lo, q_lo + q_rows) of the queue */
    int queue_used;                   /* the last step's codes used the queue */
    int baseline_done;                /* --eval-baseline ran (1), and its figures are logged (2) */
    double base[6];                   /* its kNN and probe accuracies: untrained trunk, raw pixels; the trunk's
                                         layers chosen (several --eval-layer) */
    /* the last hook's checks */
    double proto_err;
    int proto_agree;
    uint64_t proto_hash;
};

/* task_swav.c */
/* Scales each of rows rows of cols floats to unit L2 norm (zero rows stay). */
void swav_normalise_rows(float *w, int64_t rows, int64_t cols);
/* Appends "key": v (null when not finite) to the step's --log extras. */
void swav_append_extra(struct task *t, const char *key, double v);

/* swav_eval.c */
/* "4096 (layer4's map pooled to 4 x 4)", or one such per --eval-layer, into buf. */
const char *swav_eval_features(const struct swav *k, const struct opts *o, char *buf, size_t cap);
/* task_ops.before_train: --eval-baseline's evaluations. COLLECTIVE. */
enum fsdp_status swav_before_train(struct task *t, struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct opts *o);
/* task_ops.eval: the kNN and the probe on the trunk's features. COLLECTIVE. */
enum fsdp_status swav_eval(struct task *t, struct fsdp_ctx *ctx, struct fsdp_model *fm, const struct opts *o,
                           double *loss_out, double *acc_out, int64_t *count_out);

#endif
