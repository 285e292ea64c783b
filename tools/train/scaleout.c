/*
 * scaleout.c - fsdp-train --dry-run's scale-out plan: given a world
 * (--nproc N: one host; --hosts H --ranks-per-host R) and links (--net-gbps,
 * --net-latency-us), prints per step and rank the bytes each collective kind
 * sends over the network and through shared memory, the time the collectives
 * occupy a host's link, and the predicted exposed communication with the
 * prefetch schedule (the library's fsdp_plan_comm, [Note: scale-out model]
 * in src/fsdp/commplan.c). One step's compute comes from --step-compute-ms,
 * or from the model's FLOPs at the GEMM rate this machine measures in a
 * fraction of a second.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "task.h"

/* fp32 GEMM FLOP/s with the context's threads: 512^3 products for ~0.3 s. */
static double gemm_rate(struct fsdp_ctx *ctx, struct fsdp_module *m) {
    enum { N = 512 };
    float *a = calloc((size_t)N * N, sizeof *a), *b = calloc((size_t)N * N, sizeof *b),
          *c = calloc((size_t)N * N, sizeof *c);
    double rate = 0;
    if (a && b && c) {
        for (size_t i = 0; i < (size_t)N * N; i++) a[i] = b[i] = (float)(i % 7) * 0.01f;
        fsdp_gemm(ctx, m, 0, 0, N, N, N, 1, a, N, b, N, 0, c, N); /* warm-up */
        double t0 = now_s(), t = t0;
        long reps = 0;
        while (t - t0 < 0.3) {
            if (fsdp_gemm(ctx, m, 0, 0, N, N, N, 1, a, N, b, N, 0, c, N) != FSDP_OK) break;
            reps++;
            t = now_s();
        }
        if (reps) rate = 2.0 * N * N * N * (double)reps / (t - t0);
    }
    free(a);
    free(b);
    free(c);
    return rate;
}

static void mb(char *buf, size_t n, double bytes) { snprintf(buf, n, "%.3f MB", bytes / 1e6); }

void scaleout_print(struct fsdp_ctx *ctx, const struct opts *o, struct fsdp_module *root, const struct task *t,
                    int world) {
    struct fsdp_net_model net = {0};
    net.hosts = o->hosts ? o->hosts : 1;
    net.ranks_per_host = o->hosts ? o->ranks_per_host : world;
    net.net_gbps = o->net_gbps;
    net.net_latency_us = o->net_latency_us;
    net.shm_gbps = o->shm_gbps;
    char how[160];
    if (o->step_compute_ms > 0) {
        net.compute_ms = o->step_compute_ms;
        net.forward_ms = o->step_forward_ms;
        if (net.forward_ms > 0) snprintf(how, sizeof how, "--step-compute-ms, %.1f ms of it forward", net.forward_ms);
        else snprintf(how, sizeof how, "--step-compute-ms");
    } else {
        if (!(t->train_flops_per_item > 0))
            fail_all("--net-gbps: this model has no FLOP count; give --step-compute-ms (one step's forward and "
                     "backward compute per rank)");
        double rate = gemm_rate(ctx, root);
        if (!(rate > 0)) fail_all("--net-gbps: cannot measure the GEMM rate; give --step-compute-ms");
        double items = t->items_per_step / world;
        net.compute_ms = t->train_flops_per_item * items / rate * 1e3;
        snprintf(how, sizeof how, "%.3g GFLOP per rank at this machine's fp32 GEMM rate, %.1f GFLOP/s",
                 t->train_flops_per_item * items / 1e9, rate / 1e9);
    }
    /* the units and strategy the run would have */
    struct fsdp_shard_opts so = shard_opts_of(ctx, t, o, net.hosts * net.ranks_per_host);
    struct fsdp_comm_plan p;
    if (fsdp_plan_comm(ctx, root, &so, &net, &p) != FSDP_OK) fail_all("scale-out plan: %s", fsdp_errmsg(ctx));
    printf("scale-out plan: %s, %d host%s x %d ranks (world %d), %d units; links %g Gbit/s, %g us per message%s; "
           "compute %.1f ms per step per rank (%s)\n",
           o->sharding, net.hosts, net.hosts == 1 ? "" : "s", net.ranks_per_host, p.world, p.n_units,
           (double)o->net_gbps, (double)o->net_latency_us, o->shm_gbps > 0 ? "" : ", shared memory not counted",
           net.compute_ms, how);
    printf("  %-16s %14s %14s %12s\n", "per rank, step", "network", "shared memory", "net messages");
    static const char *const names[] = {"all-gather", "reduce-scatter", "all-reduce"};
    for (int k = 0; k < 3; k++) {
        if (p.net_bytes[k] == 0 && p.shm_bytes[k] == 0) continue;
        char a[32], b[32];
        mb(a, sizeof a, p.net_bytes[k]);
        mb(b, sizeof b, p.shm_bytes[k]);
        printf("  %-16s %14s %14s %12.0f\n", names[k], a, b, p.net_msgs[k]);
    }
    printf("  collectives on a host's link %.1f ms per step; predicted exposed communication %.1f ms (step %.1f "
           "ms, %.0f%% of it compute)\n",
           p.comm_ms, p.exposed_ms, p.step_ms, p.step_ms > 0 ? 100.0 * p.compute_ms / p.step_ms : 100.0);
}
