/*
 * options.c - fsdp-train's flags (options.h): defaults, --help, parsing and
 * the checks between flags that need no model or world.
 */
#include "options.h"
#include "config.h"

#include "fsdp.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>


void opts_derive(struct opts *o) {
    if (o->min_lr < 0) o->min_lr = o->lr / 10;
}

struct opts opts_default(void) {
    struct opts o = {0};
    o.model = NULL; /* MODEL_DEFAULT, or the checkpoint's with --resume */
    o.data = NULL; /* "synthetic" for a GPT, IMAGE_DATA_DEFAULT for an image model */
    o.batch = 8;
    o.seq = 64;
    o.steps = 50;
    o.warmup = 10;
    o.lr = 1e-3f;
    o.min_lr = -1.0f;
    o.weight_decay = 0.1f;
    o.clip = 1.0f;
    o.beta1 = 0.9f;
    o.beta2 = 0.95f;
    o.eps = 1e-8f;
    o.schedule = "cosine";
    o.optim = "adamw";
    o.comm = "auto";
    o.sample = 120;
    o.collective_timeout = 300;
    o.net_latency_us = 10;
    o.seed = 1337;
    o.wrap = "block";
    o.ac = "none";
    o.init = "deferred";
    o.state_dict_type = "sharded";
    o.reshard_after_forward = 1;
    o.sharding = "FULL_SHARD";
    o.grad_accum = 1;
    o.accum_mode = "reduce";
    o.overlap = 1;
    o.max_inflight = 2;
    o.precision = "FP32";
    o.mixed_precision = "DEFAULT";
    o.loss_scale_init = 65536;
    o.loss_scale_growth = 2000;
    o.mem_limit = "auto";
    o.mem_limit_auto = 1;
    o.augment = "crop-flip";
    o.crop_padding = 4;
    o.shuffle = 1;
    o.sync_bn = -1;
    o.swav_hidden = 2048;
    o.swav_dim = 128;
    o.nmb_prototypes = 3000;
    o.nmb_heads = 1;
    o.crops_global_size = 24;
    o.crops_small = 2;
    o.crops_small_size = 16;
    o.crops_global_scale[0] = 0.14f;
    o.crops_global_scale[1] = 1.0f;
    o.crops_small_scale[0] = 0.05f;
    o.crops_small_scale[1] = 0.14f;
    o.knn_train = 10000;
    o.probe_train = 60000;
    o.probe_epochs = 10;
    o.probe_wd[0] = 1e-4f;
    o.n_probe_wd = 1;
    o.eval_pool = 1;
    o.eval_layer[0] = 4;
    o.n_eval_layer = 1;
    o.queue_start_epoch = 15;
    o.crops_jitter = 0.4f;
    o.bn_stats_crops = "all";
    o.swav_temperature = 0.1f;
    o.swav_epsilon = 0.05f;
    o.sinkhorn_iters = 3;
    o.lars_eta = 0.001f;
    o.mean[0] = 0.2860f;
    o.std[0] = 0.3530f;
    o.n_mean = o.n_std = 1;
    return o;
}

static void usage(FILE *f) {
    struct opts d = opts_default();
    fprintf(f,
            "usage: fsdp-train [flags]\n"
            "Trains a GPT, or an image classifier, with fully sharded data parallelism (ZeRO-3).\n"
            "Run under `mpirun -np N`, or give --nproc N to start N local ranks.\n\n"
            "  --model NAME          preset: tiny small gpt2 gpt2-medium gpt2-large gpt2-xl (GPT), or an\n"
            "                        image classifier: cnn (a small CNN) resnet18 resnet34 resnet50 (default\n"
            "                        %s; with --resume, the checkpoint's model, which model flags must match)\n"
            "  --model-config FILE   JSON {n_layer,n_head,n_embd,vocab_size,block_size} (GPT), or with an\n"
            "                        \"arch\" key an image model {arch,in_chans,num_classes,stem,width,\n"
            "                        zero_init_residual}; overrides --model\n"
            "  --data PATH           GPT: token file (llm.c .bin with header, raw uint16 .bin) or any text\n"
            "                        file as bytes; 'synthetic' = built-in corpus (default). Image model:\n"
            "                        a folder laid out as MNIST (train-images-idx3-ubyte[.gz], ...), or\n"
            "                        'fashion-mnist' = Debian's dataset-fashion-mnist (default)\n"
            "  --tokenizer DIR       GPT: GPT-2 BPE (encoder.json + vocab.bpe, or tokenizer.json): a text\n"
            "                        --data is encoded with it at start, and the sample decoded\n"
            "  --batch N             global batch in sequences, divisible by the world size (default %d)\n"
            "  --seq T               sequence length, <= block_size (default %d)\n"
            "  --steps N             training steps (default %d)\n"
            "  --epochs E            image model: train E epochs of ceil(train images / batch) steps\n"
            "                        (instead of --steps)\n"
            "  --val-data FILE       GPT: held-out tokens (any --data format; text with --tokenizer is\n"
            "                        BPE-encoded): eval_loss and perplexity every --eval-every steps and\n"
            "                        at the end (eval mode, the same global batches at any world size)\n"
            "  --eval-every K        evaluate every K steps (the image model on its test split, a GPT on\n"
            "                        --val-data); 0 = only at the end (default 0)\n"
            "  --eval-batch N        test images or --val-data sequences per evaluation forward, over all\n"
            "                        ranks (default --batch)\n"
            "  --eval-batches N      evaluate the first N global batches of the held-out set; 0 = all of\n"
            "                        it once (default 0)\n"
            "  --label-smoothing X   image model: cross-entropy label smoothing in [0, 1] (default 0)\n"
            "  --augment A           image model: none | crop-flip (random crop of the image padded by\n"
            "                        --crop-padding pixels, and a horizontal flip; training only)\n"
            "                        (default crop-flip)\n"
            "  --crop-padding N      crop-flip's padding (default 4)\n"
            "  --shuffle on|off      image model: a new order every epoch, from the seed (default on)\n"
            "  --mean X[,X..]        image model: per-channel mean of (pixel / 255) (default 0.2860)\n"
            "  --std X[,X..]         image model: per-channel std (default 0.3530)\n"
            "  --sync-bn on|off      image model: batch statistics over every rank (SyncBatchNorm)\n"
            "                        (default on when the world is larger than one)\n"
            "  --task S              tokens | images | swav (default: from --model or the checkpoint); swav:\n"
            "                        SwAV self-supervised training of --model (cnn, resnet18/34/50) as a trunk\n"
            "                        with SwAV's head, on multi-crop views of --data; kNN evaluation (knn_acc)\n"
            "  --swav-hidden N       head MLP hidden width, 0: one Linear (default 2048)\n"
            "  --swav-dim N          embedding dimension (default 128)\n"
            "  --nmb-prototypes K    prototypes per head (default 3000)\n"
            "  --nmb-heads H         prototype heads (default 1)\n"
            "  --crops-global-size S two global crops of S x S per image (default 24)\n"
            "  --crops-small V       small crops per image (default 2)\n"
            "  --crops-small-size S  their size (default 16)\n"
            "  --crops-global-scale LO,HI / --crops-small-scale LO,HI  RandomResizedCrop's area ranges\n"
            "                        (default 0.14,1 and 0.05,0.14)\n"
            "  --freeze-prototypes-iters N  the prototypes stay fixed for the first N steps (default 0)\n"
            "  --swav-temperature X / --swav-epsilon X / --sinkhorn-iters N  SwAV's loss (0.1, 0.05, 3)\n"
            "  --knn-train N         train images in the kNN evaluation's bank (default 10000; 0 with\n"
            "                        --probe-epochs 0: no evaluation)\n"
            "  --probe-train N       train images of the linear probe (probe_acc) (default 60000: all)\n"
            "  --probe-epochs E      the probe's epochs of SGD on the frozen features (default 10)\n"
            "  --probe-wd X[,X..]    the probe's weight decay (default 1e-4); 2 to 4 values: the one whose\n"
            "                        probe does best on a held-out sixth of the probe's training images\n"
            "  --eval-pool G         kNN and probe features: a ResNet trunk's last feature map average-pooled\n"
            "                        to G x G (VISSL's res5 linear evaluation pools to 2 x 2; default 1: the\n"
            "                        trunk's output)\n"
            "  --eval-layer L[,L..]  a ResNet trunk's layers whose maps (pooled by --eval-pool) the kNN and\n"
            "                        probe read (default 4); several: for each, the layer doing best on\n"
            "                        held-out training images (the last sixth of the kNN bank or the probe's)\n"
            "  --eval-precise-bn N   before each evaluation, the trunk's batch norm statistics re-estimated on\n"
            "                        the first N training images, whole, as the evaluation sees them (the\n"
            "                        mean of their batches' statistics: precise BN), then restored (default\n"
            "                        0: the running statistics of training's crops)\n"
            "  --eval-baseline       before training: kNN and probe of the untrained trunk (or the one\n"
            "                        --init-from loaded; with --steps 0 only that) and of raw pixels\n"
            "  --queue-length L      SwAV's queue: L past global-crop embeddings per crop, a multiple of\n"
            "                        --batch, in the codes from --queue-start-epoch E (default 0: none; E 15)\n"
            "  --crops-jitter X      brightness and contrast factors in [1-X, 1+X], with probability 0.8\n"
            "                        (default 0.4; 0: none)\n"
            "  --bn-stats-crops all|global  the crops whose batch statistics update batch norm's running\n"
            "                        statistics (default all, as SwAV; global: not the small crops, whose\n"
            "                        statistics at 12-16 px are far from the whole images evaluated)\n"
            "  --lr X                peak learning rate (default %g)\n"
            "  --min-lr X            cosine floor (default lr/10)\n"
            "  --warmup N            linear warmup steps (default %d)\n"
            "  --lr-schedule S       cosine | constant | step (x0.1 at each --lr-steps milestone) (default %s)\n"
            "  --lr-steps A,B,..     the step schedule's milestones in steps\n"
            "  --optim S             adamw | sgd | lars (SGD with per-parameter trust ratios, SwAV's LARC\n"
            "                        without clipping) (default %s)\n"
            "  --lars-eta X          LARS's trust coefficient (default 0.001; also --trust-coefficient)\n"
            "  --beta1 X             AdamW beta1 (default %g)\n"
            "  --beta2 X             AdamW beta2 (default %g)\n"
            "  --eps X               AdamW eps (default %g)\n"
            "  --momentum X          SGD momentum (default %g)\n"
            "  --nesterov            SGD: Nesterov momentum (PyTorch's formula; needs --momentum)\n"
            "  --weight-decay X      decoupled weight decay (default %g)\n"
            "  --decay-all           also decay biases, LayerNorm, BatchNorm and embeddings (default off)\n"
            "  --clip X              clip the global gradient norm to X; 0 = off (default %g)\n"
            "  --seed N              init and sampling seed (default %llu)\n"
            "  --threads N           compute threads per rank; 0 = cores / local ranks (default 0)\n"
            "  --nproc N             start N ranks on this host (mpirun) (default 1)\n"
            "  --comm S              auto | mpi | shm | self: auto = shm for ranks all on one host,\n"
            "                        else mpi (default %s)\n"
            "  --mpi-reduce S        ordered | native: MPI reductions sum in rank order (bit-identical to\n"
            "                        shm and run to run) or with Open MPI's own collectives (faster, the\n"
            "                        bits vary) (default ordered; env FSDP_MPI_REDUCE)\n"
            "  --collective-timeout S  a rank waiting on one collective longer than S seconds ends the\n"
            "                        job naming it (type, sequence number, bytes); 0 = never (default %g)\n"
            "  --check-collectives   compare each collective's sequence number and (type, count, dtype)\n"
            "                        across ranks first; report diverged ranks (default off)\n"
            "  --profile             time by module over the timed steps (all but the first): rank 0's\n"
            "                        self time and FSDP hook time per layer, printed at the end\n"
            "  --log FILE            one JSON object per step (default none)\n"
            "  --sample N            tokens to generate at the end for text data; 0 = none (default %d)\n"
            "  --save-dir DIR        save checkpoints as DIR/step-NNNNNNNN (every --save-every steps\n"
            "                        and at the end; the kind: --state-dict-type)\n"
            "  --save-every K        steps between checkpoints; 0 = only at the end (default 0)\n"
            "  --keep-last K         keep the newest K checkpoints in --save-dir; 0 = all (default 0)\n"
            "  --state-dict-type T   what --save-dir saves (Composer's state_dict_type): sharded (the\n"
            "                        folder DIR/step-N: each rank's shards and the optimizer state,\n"
            "                        resumable) | full (one file DIR/step-N.safetensors of the parameters\n"
            "                        and buffers, written by rank 0: for --init-from, export or\n"
            "                        inference) (default sharded)\n"
            "  --resume DIR          continue from a checkpoint folder, or the newest one in a\n"
            "                        --save-dir (saved at any world size)\n"
            "  --autoresume          (Composer's autoresume) continue from the newest checkpoint in\n"
            "                        --save-dir when it holds one (--resume and --init-from are then\n"
            "                        not used), else start as without it: the same command line\n"
            "                        starts a job and restarts it after a failure. SIGUSR1 stops a\n"
            "                        run after the step in progress, saved to --save-dir (exit 3)\n"
            "  --save-full FILE      at the end, write the parameters as one safetensors file\n"
            "  --init-from FILE      initial weights from a safetensors file (ours, or Hugging Face\n"
            "                        GPT-2 model.safetensors)\n"
            "  --wrap P              units: block (one per Block) | size:N (a unit per module with\n"
            "                        >= N parameters not in a smaller unit) | none (default block)\n"
            "  --ac P                activation checkpointing: none | blocks | every:K (Blocks 0, K,\n"
            "                        2K, ...) | attn (each Block's attention only: its qkv, probabilities\n"
            "                        and heads' output are recomputed in backward) (default none)\n"
            "  --reshard-after-forward on|off  free a unit's gathered parameters after its forward\n"
            "                        (default on)\n"
            "  --sharding S          FULL_SHARD (ZeRO-3) | SHARD_GRAD_OP (ZeRO-2: parameters stay gathered\n"
            "                        from forward to backward) | NO_SHARD (DDP) | HYBRID_SHARD (shard in\n"
            "                        a group, replicate across groups) (default FULL_SHARD)\n"
            "  --shard-group K       HYBRID_SHARD's group size; must divide the world (default: the ranks\n"
            "                        of one host)\n"
            "  --grad-accum K        split each rank's share of --batch into K micro-batches per step\n"
            "                        (default 1)\n"
            "  --accum-mode M        reduce (reduce every micro-batch: less memory) | no_sync (keep\n"
            "                        unsharded gradients, reduce once: less communication) (default reduce)\n"
            "  --overlap on|off      prefetch the next units' all-gathers (forward and backward) and\n"
            "                        run reduce-scatters asynchronously; same results (default on)\n"
            "  --max-inflight N      with --overlap on: units gathered or gathering at once, the\n"
            "                        computing one included; bounds the full buffers (default 2)\n"
            "  --init S              deferred (each rank initialises its shards; with --init-from each\n"
            "                        rank reads its own ranges) | rank0 (rank 0 reads --init-from and\n"
            "                        sends it unit by unit: Composer's load_monolith_rank0_only; the\n"
            "                        other ranks never open the file) (default deferred)\n"
            "  --precision P         FP32 | AMP_BF16 | AMP_FP16 (Composer's names): the matrix products'\n"
            "                        inputs; LayerNorm, softmax, the loss, master weights, gradient shards\n"
            "                        and optimizer state stay fp32 (default FP32)\n"
            "  --mixed-precision M   with AMP_*: FULL (gather and reduce fp32) | DEFAULT (gather in the low\n"
            "                        dtype, reduce fp32) | PURE (both low) (default DEFAULT)\n"
            "  --lp-shard-copy on|off  with AMP_*: keep each shard's 16-bit copy between steps (written by\n"
            "                        the optimizer: no cast at each gather, 2 bytes a parameter more)\n"
            "                        (default off: each gather casts the fp32 shard)\n"
            "  --loss-scale-init X   AMP_FP16 dynamic loss scaling: initial scale (default 65536; halved\n"
            "                        on overflow, the step skipped on every rank)\n"
            "  --loss-scale-growth-interval N  AMP_FP16: double the scale after N clean steps (default 2000)\n"
            "  --peak-gflops X       MFU's peak: GEMM GFLOP/s per rank (default: measured at start, a\n"
            "                        0.2 s GEMM probe in the run's precision on every rank)\n"
            "  --verbose             print the unit plan and debug information\n"
            "  --dry-run             print the memory plan per rank (shards, full buffers, activations)\n"
            "                        for this model, world (--nproc or the MPI world) and batch; no training\n"
            "  --hosts H --ranks-per-host R  with --dry-run: plan a world of H hosts of R ranks (as --nproc H*R)\n"
            "  --net-gbps G          with --dry-run: also print the scale-out plan: per step and rank, the bytes\n"
            "                        each collective sends over the network (links of G Gbit/s) and through\n"
            "                        shared memory, and the predicted exposed communication\n"
            "  --net-latency-us U    the links' latency per message (default %g)\n"
            "  --shm-gbps G          shared memory's rate within a host (default 0: not counted)\n"
            "  --step-compute-ms MS  one step's forward + backward compute per rank (default: from the\n"
            "                        model's FLOPs and a short GEMM measurement on this machine)\n"
            "  --step-forward-ms MS  the forward's part of it (default: a third), as a run logs forward_ms\n"
            "  --mem-limit SIZE      per-rank memory limit, at least 1M, e.g. 1.5G: refuse a plan over it\n"
            "                        before any work, and stop the run if the library's allocations pass it;\n"
            "                        auto = refuse a plan over the memory this host can give each of its ranks\n"
            "                        (MemAvailable and the cgroup's limit, shared by the local ranks, less\n"
            "                        64 MiB + 1%% each for what the plan does not count); off = no check\n"
            "                        (default auto)\n"
            "  --config FILE         a JSON object of flags by long name ({\"lr\": 3e-4, \"steps\": 100,\n"
            "                        \"lr-schedule\": \"cosine\"}; switches true/false, lists as arrays);\n"
            "                        flags on the command line override it. The resolved configuration\n"
            "                        is printed at the start, is the first line of --log and is saved in\n"
            "                        each checkpoint's meta.json\n"
            "  --override F[,F..]    with --resume: take these flags (e.g. steps,lr) from the command line\n"
            "                        (or their defaults) instead of the checkpoint. Without it --resume\n"
            "                        restores the schedule, optimizer, batch and precision flags and the\n"
            "                        fp16 loss scale from the checkpoint, and a flag given otherwise is\n"
            "                        an error naming both values; the data (--data, --val-data,\n"
            "                        --tokenizer) and evaluation flags (--eval-every, --eval-batch,\n"
            "                        --eval-batches, --knn-train, --probe-train, --probe-epochs, --probe-wd,\n"
            "                        --eval-pool, --eval-layer, --eval-precise-bn) not given are the checkpoint's too\n"
            "                        (given ones are used as given)\n"
            "  --help                this text\n",
            MODEL_DEFAULT, d.batch, d.seq, d.steps, (double)d.lr, d.warmup, d.schedule, d.optim,
            (double)d.beta1, (double)d.beta2, (double)d.eps, (double)d.momentum,
            (double)d.weight_decay, (double)d.clip, (unsigned long long)d.seed, d.comm,
            (double)d.collective_timeout, d.sample, (double)d.net_latency_us);
}

int rank_env(void) {
    const char *r = getenv("OMPI_COMM_WORLD_RANK");
    return r ? atoi(r) : 0;
}

/* Where the argument parse_args is reading came from (opts_set_origin). */
static int g_arg, g_ck_end = 1, g_cfg_end = 1;
static const char *g_ck_name, *g_cfg_name;

void opts_set_origin(int ck_end, const char *ck_name, int cfg_end, const char *cfg_name) {
    g_ck_end = ck_end;
    g_ck_name = ck_name;
    g_cfg_end = cfg_end;
    g_cfg_name = cfg_name;
}

/* Usage errors happen before MPI starts (or, with --resume, where every
 * rank reads the same checkpoint); every rank sees the same argv. */
_Noreturn void usage_error(const char *fmt, ...) {
    if (rank_env() == 0) {
        va_list ap;
        va_start(ap, fmt);
        fprintf(stderr, "fsdp-train: ");
        if (g_arg >= 1 && g_arg < g_ck_end) fprintf(stderr, "the checkpoint %s's train_config: ", g_ck_name);
        else if (g_arg >= g_ck_end && g_arg < g_cfg_end) fprintf(stderr, "--config %s: ", g_cfg_name);
        vfprintf(stderr, fmt, ap);
        fprintf(stderr, "\n(see fsdp-train --help)\n");
        va_end(ap);
    }
    exit(2);
}

static long parse_int(const char *flag, const char *v, long lo, long hi) {
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || *end || end == v || x < lo || x > hi)
        usage_error("%s: '%s' is not an integer in [%ld, %ld]", flag, v, lo, hi);
    return x;
}

static float parse_float(const char *flag, const char *v, double lo, double hi) {
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (errno || *end || end == v || !(x >= lo && x <= hi))
        usage_error("%s: '%s' is not a number in [%g, %g]", flag, v, lo, hi);
    return (float)x;
}

/* A,B,.. into out: up to cap whole numbers in [lo, hi], each one above the
 * one before (increasing) or unlike every one before (else); returns the
 * count. Anything else is a usage error naming the flag and `want`. */
static int parse_int_list(const char *flag, const char *v, int *out, int cap, long lo, long hi, int increasing,
                          const char *want) {
    const char *p = v;
    int n = 0;
    for (;;) {
        char *end;
        errno = 0;
        long x = strtol(p, &end, 10);
        int bad = errno || end == p || x < lo || x > hi || (*end && *end != ',') || n == cap;
        for (int i = 0; i < n && !bad; i++) bad = increasing ? x <= out[i] : x == out[i];
        if (bad) usage_error("%s: '%s' is not %s", flag, v, want);
        out[n++] = (int)x;
        if (!*end) return n;
        p = end + 1;
    }
}

/* X or X,X,.. (up to 4, one per channel); returns the count. */
static int parse_floats(const char *flag, const char *v, float *out, double lo, double hi) {
    const char *p = v;
    int n = 0;
    for (;;) {
        char *end;
        errno = 0;
        double x = strtod(p, &end);
        if (errno || end == p || !(x >= lo && x <= hi) || (*end && *end != ',') || n == 4)
            usage_error("%s: '%s' is not 1 to 4 comma-separated numbers in [%g, %g]", flag, v, lo, hi);
        out[n++] = (float)x;
        if (!*end) break;
        p = end + 1;
    }
    return n;
}

/* --mem-limit auto | off | SIZE; a size below 1 MiB is no limit a run can keep. */
static void parse_mem_limit(struct opts *o) {
    o->mem_limit_auto = !strcmp(o->mem_limit, "auto");
    o->mem_limit_bytes = 0;
    if (o->mem_limit_auto || !strcmp(o->mem_limit, "off")) return;
    size_t b;
    if (fsdp_mem_parse_size(NULL, o->mem_limit, &b) != FSDP_OK)
        usage_error("--mem-limit: '%s' is not a memory size (a number with an optional K, M, G or T suffix, e.g. "
                    "1.5G), auto or off", o->mem_limit);
    if (b < ((size_t)1 << 20))
        usage_error("--mem-limit %s is %zu bytes, below the smallest limit of 1 MiB (give e.g. 512M, or off for "
                    "no limit)", o->mem_limit, b);
    o->mem_limit_bytes = b;
}

void parse_args(int argc, char **argv, struct opts *o) {
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        g_arg = i;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            if (rank_env() == 0) usage(stdout);
            exit(0);
        }
        if (!strcmp(a, "--verbose")) { o->verbose = 1; continue; }
        if (!strcmp(a, "--decay-all")) { o->decay_all = 1; continue; }
        if (!strcmp(a, "--check-collectives")) { o->check_collectives = 1; continue; }
        if (!strcmp(a, "--profile")) { o->profile = 1; continue; }
        if (!strcmp(a, "--dry-run")) { o->dry_run = 1; continue; }
        if (!strcmp(a, "--autoresume")) { o->autoresume = 1; continue; }
        if (!strcmp(a, "--nesterov")) { o->nesterov = 1; continue; }
        if (!strcmp(a, "--eval-baseline")) { o->eval_baseline = 1; continue; }
        if (strncmp(a, "--", 2) != 0) usage_error("unexpected argument '%s'", a);
        const char *eq = strchr(a, '=');
        if (eq) { /* --steps=3: the flags take their value as the next argument */
            char name[64];
            snprintf(name, sizeof name, "%.*s", (int)(eq - a), a);
            if (config_flag_known(name))
                usage_error("'%s': give the value as the next argument ('%s %s')", a, name, eq + 1);
            usage_error("unknown flag '%s'", a);
        }
        if (i + 1 >= argc) usage_error(config_flag_known(a) ? "%s needs a value" : "unknown flag '%s'", a);
        const char *v = argv[++i];
        if (!strcmp(a, "--model")) o->model = v;
        else if (!strcmp(a, "--model-config")) o->model_config = v;
        else if (!strcmp(a, "--data")) o->data = v;
        else if (!strcmp(a, "--tokenizer")) o->tokenizer = v;
        else if (!strcmp(a, "--log")) o->log_path = v;
        else if (!strcmp(a, "--mem-limit")) o->mem_limit = v;
        else if (!strcmp(a, "--save-dir")) o->save_dir = v;
        else if (!strcmp(a, "--resume")) o->resume = v;
        else if (!strcmp(a, "--init-from")) o->init_from = v;
        else if (!strcmp(a, "--save-full")) o->save_full = v;
        else if (!strcmp(a, "--wrap")) {
            o->wrap = v;
            if (strcmp(v, "block") && strcmp(v, "none") &&
                (strncmp(v, "size:", 5) || parse_int(a, v + 5, 1, 0x7fffffffL) < 1))
                usage_error("--wrap: '%s' is not block, size:N or none", v);
        } else if (!strcmp(a, "--ac")) {
            o->ac = v;
            if (strcmp(v, "none") && strcmp(v, "blocks") && strcmp(v, "attn") &&
                (strncmp(v, "every:", 6) || parse_int(a, v + 6, 1, 1 << 20) < 1))
                usage_error("--ac: '%s' is not none, blocks, every:K or attn", v);
        } else if (!strcmp(a, "--reshard-after-forward")) {
            if (strcmp(v, "on") && strcmp(v, "off")) usage_error("--reshard-after-forward: '%s' is not on or off", v);
            o->reshard_after_forward = !strcmp(v, "on");
        } else if (!strcmp(a, "--sharding")) {
            if (strcasecmp(v, "FULL_SHARD") && strcasecmp(v, "SHARD_GRAD_OP") && strcasecmp(v, "NO_SHARD") &&
                strcasecmp(v, "HYBRID_SHARD"))
                usage_error("--sharding: '%s' is not FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD", v);
            o->sharding = v;
        } else if (!strcmp(a, "--shard-group")) {
            o->shard_group = (int)parse_int(a, v, 1, 1 << 20);
        } else if (!strcmp(a, "--grad-accum")) {
            o->grad_accum = (int)parse_int(a, v, 1, 1 << 20);
        } else if (!strcmp(a, "--overlap")) {
            if (strcmp(v, "on") && strcmp(v, "off")) usage_error("--overlap: '%s' is not on or off", v);
            o->overlap = !strcmp(v, "on");
        } else if (!strcmp(a, "--lp-shard-copy")) {
            if (strcmp(v, "on") && strcmp(v, "off")) usage_error("--lp-shard-copy: '%s' is not on or off", v);
            o->lp_shard_copy = !strcmp(v, "on");
        } else if (!strcmp(a, "--max-inflight")) {
            o->max_inflight = (int)parse_int(a, v, 1, 1 << 20);
        } else if (!strcmp(a, "--accum-mode")) {
            if (strcmp(v, "reduce") && strcmp(v, "no_sync"))
                usage_error("--accum-mode: '%s' is not reduce or no_sync", v);
            o->accum_mode = v;
        } else if (!strcmp(a, "--precision")) {
            if (strcasecmp(v, "FP32") && strcasecmp(v, "AMP_BF16") && strcasecmp(v, "AMP_FP16"))
                usage_error("--precision: '%s' is not FP32, AMP_BF16 or AMP_FP16", v);
            o->precision = v;
        } else if (!strcmp(a, "--mixed-precision")) {
            if (strcasecmp(v, "FULL") && strcasecmp(v, "DEFAULT") && strcasecmp(v, "PURE"))
                usage_error("--mixed-precision: '%s' is not FULL, DEFAULT or PURE", v);
            o->mixed_precision = v;
        } else if (!strcmp(a, "--loss-scale-init")) {
            o->loss_scale_init = parse_float(a, v, 1e-30, 1e30);
        } else if (!strcmp(a, "--loss-scale-growth-interval")) {
            o->loss_scale_growth = (int)parse_int(a, v, 1, 1 << 30);
        } else if (!strcmp(a, "--state-dict-type")) {
            if (strcmp(v, "sharded") && strcmp(v, "full")) usage_error("--state-dict-type: '%s' is not sharded or full", v);
            o->state_dict_type = v;
        } else if (!strcmp(a, "--peak-gflops")) {
            o->peak_gflops = parse_float(a, v, 1e-6, 1e12);
        } else if (!strcmp(a, "--init")) {
            if (strcmp(v, "deferred") && strcmp(v, "rank0")) usage_error("--init: '%s' is not deferred or rank0", v);
            o->init = v;
        }
        else if (!strcmp(a, "--save-every")) o->save_every = (int)parse_int(a, v, 0, 1 << 30);
        else if (!strcmp(a, "--keep-last")) o->keep_last = (int)parse_int(a, v, 0, 1 << 20);
        else if (!strcmp(a, "--batch")) o->batch = (int)parse_int(a, v, 1, 1 << 20);
        else if (!strcmp(a, "--seq")) o->seq = (int)parse_int(a, v, 1, 1 << 20);
        else if (!strcmp(a, "--steps")) { o->steps = (int)parse_int(a, v, 0, STEPS_MAX); o->steps_given = 1; }
        else if (!strcmp(a, "--epochs")) o->epochs = (int)parse_int(a, v, 1, 1 << 20);
        else if (!strcmp(a, "--eval-every")) o->eval_every = (int)parse_int(a, v, 0, 1 << 30);
        else if (!strcmp(a, "--eval-batch")) o->eval_batch = (int)parse_int(a, v, 1, 1 << 20);
        else if (!strcmp(a, "--eval-batches")) o->eval_batches = (int)parse_int(a, v, 0, 1 << 30);
        else if (!strcmp(a, "--val-data")) o->val_data = v;
        else if (!strcmp(a, "--config")) o->config = v; /* read by config_argv before the flags */
        else if (!strcmp(a, "--override")) {
            if (o->override) /* a second list would replace the first */
                usage_error("--override is given twice ('%s' and '%s'): give one list (--override %s,%s)", o->override,
                            v, o->override, v);
            o->override = v;
        }
        else if (!strcmp(a, "--label-smoothing")) o->label_smoothing = parse_float(a, v, 0, 1);
        else if (!strcmp(a, "--crop-padding")) o->crop_padding = (int)parse_int(a, v, 1, 1 << 12);
        else if (!strcmp(a, "--lr-steps"))
            o->n_lr_steps = parse_int_list(a, v, o->lr_steps, 16, 1, 1L << 30, 1,
                                           "up to 16 increasing positive step numbers (e.g. 30,60,80)");
        else if (!strcmp(a, "--mean")) o->n_mean = parse_floats(a, v, o->mean, -1e3, 1e3);
        else if (!strcmp(a, "--std")) o->n_std = parse_floats(a, v, o->std, 1e-6, 1e3);
        else if (!strcmp(a, "--augment")) {
            if (strcmp(v, "none") && strcmp(v, "crop-flip")) usage_error("--augment: '%s' is not none or crop-flip", v);
            o->augment = v;
        } else if (!strcmp(a, "--shuffle")) {
            if (strcmp(v, "on") && strcmp(v, "off")) usage_error("--shuffle: '%s' is not on or off", v);
            o->shuffle = !strcmp(v, "on");
        } else if (!strcmp(a, "--sync-bn")) {
            if (strcmp(v, "on") && strcmp(v, "off")) usage_error("--sync-bn: '%s' is not on or off", v);
            o->sync_bn = !strcmp(v, "on");
        }
        else if (!strcmp(a, "--warmup")) o->warmup = (int)parse_int(a, v, 0, 1 << 30);
        else if (!strcmp(a, "--threads")) o->threads = (int)parse_int(a, v, 0, 4096);
        else if (!strcmp(a, "--nproc")) o->nproc = (int)parse_int(a, v, 1, 4096);
        else if (!strcmp(a, "--hosts")) o->hosts = (int)parse_int(a, v, 1, 1 << 16);
        else if (!strcmp(a, "--ranks-per-host")) o->ranks_per_host = (int)parse_int(a, v, 1, 4096);
        else if (!strcmp(a, "--net-gbps")) o->net_gbps = parse_float(a, v, 1e-6, 1e6);
        else if (!strcmp(a, "--net-latency-us")) o->net_latency_us = parse_float(a, v, 0, 1e7);
        else if (!strcmp(a, "--shm-gbps")) o->shm_gbps = parse_float(a, v, 0, 1e7);
        else if (!strcmp(a, "--step-compute-ms")) o->step_compute_ms = parse_float(a, v, 1e-6, 1e9);
        else if (!strcmp(a, "--step-forward-ms")) o->step_forward_ms = parse_float(a, v, 1e-6, 1e9);
        else if (!strcmp(a, "--sample")) o->sample = (int)parse_int(a, v, 0, 1 << 20);
        else if (!strcmp(a, "--collective-timeout")) o->collective_timeout = parse_float(a, v, 0, 1e7);
        else if (!strcmp(a, "--seed")) o->seed = (uint64_t)parse_int(a, v, 0, 0x7fffffffL);
        else if (!strcmp(a, "--lr")) o->lr = parse_float(a, v, 0, 10);
        else if (!strcmp(a, "--min-lr")) o->min_lr = parse_float(a, v, 0, 10);
        else if (!strcmp(a, "--weight-decay")) o->weight_decay = parse_float(a, v, 0, 10);
        else if (!strcmp(a, "--clip")) o->clip = parse_float(a, v, 0, 1e9);
        else if (!strcmp(a, "--beta1")) o->beta1 = parse_float(a, v, 0, 0.999999);
        else if (!strcmp(a, "--beta2")) o->beta2 = parse_float(a, v, 0, 0.999999);
        else if (!strcmp(a, "--eps")) o->eps = parse_float(a, v, 1e-30, 1);
        else if (!strcmp(a, "--momentum")) o->momentum = parse_float(a, v, 0, 0.999999);
        else if (!strcmp(a, "--lars-eta")) o->lars_eta = parse_float(a, v, 1e-9, 1e3);
        else if (!strcmp(a, "--lr-schedule")) {
            if (strcmp(v, "cosine") && strcmp(v, "constant") && strcmp(v, "step"))
                usage_error("--lr-schedule: '%s' is not cosine, constant or step", v);
            o->schedule = v;
        } else if (!strcmp(a, "--optim")) {
            if (strcmp(v, "adamw") && strcmp(v, "sgd") && strcmp(v, "lars"))
                usage_error("--optim: '%s' is not adamw, sgd or lars", v);
            o->optim = v;
        } else if (!strcmp(a, "--task")) {
            if (strcmp(v, "tokens") && strcmp(v, "images") && strcmp(v, "swav"))
                usage_error("--task: '%s' is not tokens, images or swav", v);
            o->task = v;
        }
        else if (!strcmp(a, "--trust-coefficient")) o->lars_eta = parse_float(a, v, 1e-9, 1e3);
        else if (!strcmp(a, "--swav-hidden")) o->swav_hidden = (int)parse_int(a, v, 0, 1 << 20);
        else if (!strcmp(a, "--swav-dim")) o->swav_dim = (int)parse_int(a, v, 1, 1 << 20);
        else if (!strcmp(a, "--nmb-prototypes")) o->nmb_prototypes = (int)parse_int(a, v, 1, 1 << 20);
        else if (!strcmp(a, "--nmb-heads")) o->nmb_heads = (int)parse_int(a, v, 1, 64);
        else if (!strcmp(a, "--crops-global-size")) o->crops_global_size = (int)parse_int(a, v, 1, 1 << 12);
        else if (!strcmp(a, "--crops-small")) o->crops_small = (int)parse_int(a, v, 0, 64);
        else if (!strcmp(a, "--crops-small-size")) o->crops_small_size = (int)parse_int(a, v, 1, 1 << 12);
        else if (!strcmp(a, "--crops-global-scale") || !strcmp(a, "--crops-small-scale")) {
            float *sc = a[8] == 'g' ? o->crops_global_scale : o->crops_small_scale;
            if (parse_floats(a, v, sc, 1e-6, 1) != 2 || sc[0] > sc[1])
                usage_error("%s: '%s' is not LO,HI with 0 < LO <= HI <= 1", a, v);
        }
        else if (!strcmp(a, "--freeze-prototypes-iters")) o->freeze_prototypes_iters = (int)parse_int(a, v, 0, 1 << 30);
        else if (!strcmp(a, "--knn-train")) o->knn_train = (int)parse_int(a, v, 0, 1 << 30);
        else if (!strcmp(a, "--probe-train")) o->probe_train = (int)parse_int(a, v, 1, 1 << 30);
        else if (!strcmp(a, "--probe-epochs")) o->probe_epochs = (int)parse_int(a, v, 0, 10000);
        else if (!strcmp(a, "--probe-wd")) o->n_probe_wd = parse_floats(a, v, o->probe_wd, 0, 1);
        else if (!strcmp(a, "--eval-pool")) o->eval_pool = (int)parse_int(a, v, 1, 8);
        else if (!strcmp(a, "--eval-layer"))
            o->n_eval_layer = parse_int_list(a, v, o->eval_layer, EVAL_LAYERS_MAX, 1, 4, 0,
                                             "up to 4 different ResNet layers 1..4 (e.g. 3,4)");
        else if (!strcmp(a, "--eval-precise-bn")) o->eval_precise_bn = (int)parse_int(a, v, 0, 1 << 30);
        else if (!strcmp(a, "--queue-length")) o->queue_length = (int)parse_int(a, v, 0, 1 << 30);
        else if (!strcmp(a, "--queue-start-epoch")) o->queue_start_epoch = (int)parse_int(a, v, 0, 1 << 30);
        else if (!strcmp(a, "--crops-jitter")) o->crops_jitter = parse_float(a, v, 0, 1);
        else if (!strcmp(a, "--bn-stats-crops")) {
            if (strcmp(v, "all") && strcmp(v, "global")) usage_error("--bn-stats-crops: '%s' is not all or global", v);
            o->bn_stats_crops = v;
        }
        else if (!strcmp(a, "--swav-temperature")) o->swav_temperature = parse_float(a, v, 1e-4, 100);
        else if (!strcmp(a, "--swav-epsilon")) o->swav_epsilon = parse_float(a, v, 1e-4, 100);
        else if (!strcmp(a, "--sinkhorn-iters")) o->sinkhorn_iters = (int)parse_int(a, v, 0, 1000);
        else if (!strcmp(a, "--comm")) {
            if (strcmp(v, "auto") && strcmp(v, "mpi") && strcmp(v, "shm") && strcmp(v, "self"))
                usage_error("--comm: '%s' is not auto, mpi, shm or self", v);
            o->comm = v;
        } else if (!strcmp(a, "--mpi-reduce")) {
            if (strcmp(v, "ordered") && strcmp(v, "native"))
                usage_error("--mpi-reduce: '%s' is not ordered or native", v);
            o->mpi_reduce = v;
        } else usage_error("unknown flag '%s'", a);
    }
    g_arg = 0;
    parse_mem_limit(o);
    opts_derive(o);
    if (o->min_lr > o->lr)
        usage_error("--min-lr %g is above --lr %g (the cosine floor must not exceed the peak)", (double)o->min_lr,
                    (double)o->lr);
    /* a self world has one rank: N of them would be N independent jobs
     * writing the same --save-dir and --log */
    const char *ws = getenv("OMPI_COMM_WORLD_SIZE");
    int mpi_world = ws ? atoi(ws) : 0;
    if (!strcmp(o->comm, "self") && (o->nproc > 1 || mpi_world > 1))
        usage_error("--comm self is a world of one rank, but %d ranks were asked for (%s); use --comm auto, shm "
                    "or mpi", o->nproc > 1 ? o->nproc : mpi_world, o->nproc > 1 ? "--nproc" : "the MPI job");
    if (!o->hosts != !o->ranks_per_host) usage_error("--hosts and --ranks-per-host go together");
    if ((o->hosts || o->net_gbps > 0) && !o->dry_run)
        usage_error("--hosts, --ranks-per-host and --net-gbps plan a world with --dry-run (a run's world is "
                    "mpirun's)");
    if (o->hosts) {
        long w = (long)o->hosts * o->ranks_per_host;
        if (w > (1L << 20)) usage_error("--hosts %d x --ranks-per-host %d: a world of %ld ranks is too large", o->hosts,
                                        o->ranks_per_host, w);
        if (o->nproc > 1 && o->nproc != w)
            usage_error("--nproc %d but --hosts %d x --ranks-per-host %d is %ld ranks", o->nproc, o->hosts,
                        o->ranks_per_host, w);
        o->nproc = (int)w;
    }
    if (o->step_forward_ms > 0 && !(o->step_compute_ms > 0))
        usage_error("--step-forward-ms is the forward's part of --step-compute-ms: give both");
    if (o->step_forward_ms > o->step_compute_ms)
        usage_error("--step-forward-ms %g is more than --step-compute-ms %g (the step's forward and backward)",
                    (double)o->step_forward_ms, (double)o->step_compute_ms);
    if (o->resume && o->init_from) usage_error("--resume and --init-from exclude each other");
    if (o->override && !o->resume && !o->autoresume)
        usage_error("--override %s: it names flags --resume restores from a checkpoint; without --resume it "
                    "changes nothing", o->override);
    if (o->autoresume && !o->save_dir)
        usage_error("--autoresume needs --save-dir (the folder it resumes from and the run saves into)");
    if (o->autoresume && !strcmp(o->state_dict_type, "full"))
        usage_error("--autoresume needs --state-dict-type sharded: a full checkpoint holds no optimizer state or "
                    "data position to resume");
    if (!strcmp(o->init, "rank0") && !o->init_from)
        usage_error("--init rank0 needs --init-from FILE (the weights rank 0 reads and sends)");
    if ((o->save_every || o->keep_last) && !o->save_dir) usage_error("--save-every and --keep-last need --save-dir");
    if (o->epochs && o->steps_given) usage_error("--epochs and --steps exclude each other");
    if (!o->knn_train && o->probe_epochs) /* a kNN over an empty bank would report NaN */
        usage_error("--knn-train 0 needs --probe-epochs 0 (both: no evaluation); the kNN bank needs an image");
    if (!strcmp(o->schedule, "step") && !o->n_lr_steps) usage_error("--lr-schedule step needs --lr-steps A,B,...");
    if (o->n_lr_steps && strcmp(o->schedule, "step")) usage_error("--lr-steps needs --lr-schedule step");
    if (o->nesterov && (strcmp(o->optim, "sgd") || !(o->momentum > 0)))
        usage_error("--nesterov needs --optim sgd and a --momentum above 0");
}
