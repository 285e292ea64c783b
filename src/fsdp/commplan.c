/*
 * commplan.c - the scale-out model: what one training step sends per rank
 * over the network and through shared memory, per collective kind, and how
 * much of it the prefetch schedule cannot hide, for a world of H hosts of R
 * ranks on links of a given bandwidth and latency ([Note: scale-out
 * model]). Uses the unit layout fsdp_fully_shard would make
 * (fsdp__model_layout, on a shadow context of the planned world) and the
 * backward order of the hooks (fsdp__model_bwd_order); allocates no shard.
 * fsdp-train --dry-run prints it (tools/train/scaleout.c).
 *
 * [Note: scale-out model]
 * Bytes come from the algorithms the backends run. Over MPI (a world that
 * spans hosts) every collective is a direct exchange: an all-gather is
 * libnbc's linear MPI_Iallgather (each rank sends its block to each other
 * rank), an ordered reduce-scatter one MPI_Ialltoall of the W blocks, an
 * ordered all-reduce an MPI_Ialltoallv plus an MPI_Iallgatherv (2x), or
 * below 32 KiB one all-gather of whole inputs (comm/mpi.c, [Note: ordered
 * reductions]). So of the G-1 blocks a rank sends in a group of G ranks,
 * those to the r-1 other ranks of its own host move through shared memory
 * (Open MPI's vader) and G-r cross the network in G-r messages. A host's
 * link carries what its ranks of the group send at once: the time of a
 * collective is latency x (network messages per rank) + (the host's network
 * bytes) / bandwidth. HYBRID_SHARD's shard group is a host (shm backend:
 * shared memory only, counted at --shm-gbps, free when 0); its replica
 * all-reduce (G = H, r = 1) runs in R groups at once on each host's link.
 * Per unit: FULL_SHARD gathers its parameters in forward and again in
 * backward (all but the root unit, which keeps them; SHARD_GRAD_OP gathers
 * in forward only) and reduce-scatters its gradient; NO_SHARD all-reduces
 * its gradient; HYBRID_SHARD adds the replica all-reduce of the gradient
 * shard. Gathers move param_dtype (2 bytes under AMP unless mixed precision
 * FULL), reductions 4 bytes (2 under PURE); per-unit overrides are not
 * modelled.
 * Schedule (unit.c's [Note: prefetch and overlap]): one link, collectives in
 * the order the compute thread issues them; a unit's pre-forward issues its
 * gather and those of the next max_inflight-1 units, then waits for its own;
 * backward likewise in the hooks' order; a reduce-scatter is issued after
 * the unit's backward and waited at the next unit's post-backward (so it
 * overlaps that unit's backward), the last at the end. Without overlap every
 * collective is waited at once. Compute per unit is the step's compute
 * split by parameter count (matmul FLOPs are 2 x numel per token, and the
 * root unit's tied embedding is the LM head), forward net->forward_ms of it
 * (a third where not given: the backward's two products per forward one;
 * measured, a small GPT's forward took 39% on this CPU, the element-wise
 * layers' backward being cheaper than their forward's share).
 * Exposed communication = the step's simulated length - its compute: the
 * sum over the critical path of what the link did not hide. Not modelled:
 * the small all-reduces of the loss and the gradient norm, the ordered sums
 * (CPU time in the wait), contention between the progress thread and the
 * compute threads.
 */
#include "fsdp/fsdp-impl.h"

#include <string.h>

/* ---- Collective costs ---- */

struct link {
    double bw;   /* network bytes per second, per host, each way */
    double lat;  /* seconds per network message */
    double shm;  /* shared-memory bytes per second (0: free) */
};

/* A direct exchange in a group of g ranks, r of them per host (`groups`
 * such groups share each host's link), each rank sending `blocks` blocks of
 * b bytes to every other rank (1: all-gather, reduce-scatter; 2: the two
 * halves of a large all-reduce). Adds this rank's bytes to plan and returns
 * the seconds the collective occupies the link. */
static double exchange(struct fsdp_comm_plan *cp, enum fsdp_coll k, const struct link *L, int g, int r, int groups,
                       double b, int blocks) {
    double net = (double)(g - r) * b * blocks, shm = (double)(r - 1) * b * blocks;
    double msgs = (double)(g - r) * blocks;
    cp->net_bytes[k] += net;
    cp->shm_bytes[k] += shm;
    cp->net_msgs[k] += msgs;
    double t = msgs > 0 ? L->lat * msgs + net * r * groups / L->bw : 0;
    if (L->shm > 0) t += shm / L->shm;
    return t;
}

/* ---- The schedule ---- */

struct sim {
    double t;        /* the compute thread's clock */
    double link;     /* when the link is next free */
    double compute;  /* compute time added so far */
};

static double issue(struct sim *s, double dur) {
    double start = s->link > s->t ? s->link : s->t;
    s->link = start + dur;
    return s->link;
}

static void wait_until(struct sim *s, double done) {
    if (done > s->t) s->t = done;
}

enum fsdp_status fsdp_plan_comm(struct fsdp_ctx *ctx, struct fsdp_module *root, const struct fsdp_shard_opts *opts,
                                const struct fsdp_net_model *net, struct fsdp_comm_plan *out) {
    if (!ctx) return FSDP_ERR_INVALID; /* no context to say it on */
    if (!root || !opts || !net || !out)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "comm plan: %s is NULL",
                         !root ? "the model" : !opts ? "the shard options" : !net ? "the network model" : "the output");
    memset(out, 0, sizeof *out);
    int H = net->hosts, R = net->ranks_per_host;
    if (H < 1 || R < 1 || (int64_t)H * R > FSDP__PLAN_MAX_WORLD || !(net->net_gbps > 0) || !(net->net_latency_us >= 0) || !(net->compute_ms >= 0) ||
        !(net->shm_gbps >= 0) || !(net->forward_ms >= 0) || net->forward_ms > net->compute_ms)
        return fsdp__err(ctx, FSDP_ERR_INVALID,
                         "comm plan: %d hosts x %d ranks, %g Gbit/s, %g us, %g ms of compute (%g ms forward): "
                         "not a world and link (hosts, ranks, bandwidth > 0, at most 2^20 ranks in all, latency "
                         "and compute >= 0, the forward within the compute)",
                         H, R, net->net_gbps, net->net_latency_us, net->compute_ms, net->forward_ms);
    int W = H * R;
    struct fsdp_shard_opts so = *opts;
    if (so.sharding == FSDP_HYBRID_SHARD && so.shard_group == 0) so.shard_group = R; /* a group per host */
    if (so.sharding == FSDP_HYBRID_SHARD && so.shard_group != R)
        return fsdp__err(ctx, FSDP_ERR_UNSUPPORTED,
                         "comm plan: HYBRID_SHARD is modelled with a shard group per host (%d ranks), not %d",
                         R, so.shard_group);
    struct fsdp_ctx *sh = fsdp__malloc(sizeof *sh); /* the layout at W: a shadow context */
    if (!sh) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory planning communication");
    *sh = *ctx;
    sh->world = W;
    sh->rank = 0;
    sh->verbose = 0;
    struct fsdp_model *fm = NULL;
    enum fsdp_status st = fsdp__model_layout(sh, root, &so, &fm);
    int *bwd = st == FSDP_OK ? fsdp__malloc((size_t)fm->n_units * sizeof *bwd) : NULL;
    double *done = st == FSDP_OK ? fsdp__zalloc((size_t)fm->n_units, sizeof *done) : NULL;
    if (st == FSDP_OK && (!bwd || !done)) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory planning communication");
    else if (st != FSDP_OK) fsdp__err(ctx, st, "%s", sh->errmsg);
    if (st != FSDP_OK) {
        fsdp_model_free(fm);
        free(bwd);
        free(done);
        free(sh);
        return st;
    }
    int low = opts->precision != FSDP_F32;
    double g_b = low && opts->mixed_precision != FSDP_MP_FULL ? 2 : 4; /* gather bytes per element */
    double r_b = low && opts->mixed_precision == FSDP_MP_PURE ? 2 : 4; /* reduction */
    struct link L = {net->net_gbps * 1e9 / 8, net->net_latency_us * 1e-6, net->shm_gbps * 1e9 / 8};
    int n = fm->n_units;
    enum fsdp_sharding sd = fm->sharding;
    int gather = sd != FSDP_NO_SHARD && W > 1 && (sd != FSDP_HYBRID_SHARD || R > 1);
    int ahead = fm->overlap ? fm->max_inflight - 1 : 0;
    double total = 0;
    for (int i = 0; i < n; i++) total += (double)fm->units[i].numel_full;
    double comp = net->compute_ms * 1e-3;
    double fshare = net->forward_ms > 0 ? net->forward_ms / net->compute_ms : 1.0 / 3.0;
    out->n_units = n;
    out->world = W;

    /* per unit: the seconds of its gather, and of its gradient's reductions */
    double *t_ag = fsdp__malloc((size_t)n * sizeof *t_ag), *t_red = fsdp__malloc((size_t)n * sizeof *t_red);
    if (!t_ag || !t_red) {
        free(t_ag);
        free(t_red);
        fsdp_model_free(fm);
        free(bwd);
        free(done);
        free(sh);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory planning communication");
    }
    struct fsdp_comm_plan once; /* one gather per unit, counted as often as it runs */
    for (int i = 0; i < n; i++) {
        struct fsdp__unit *u = &fm->units[i];
        double P = (double)u->numel_padded;
        memset(&once, 0, sizeof once);
        t_ag[i] = t_red[i] = 0;
        if (gather) {
            if (sd == FSDP_HYBRID_SHARD) t_ag[i] = exchange(&once, FSDP_COLL_ALLGATHER, &L, R, R, 1, P / R * g_b, 1);
            else t_ag[i] = exchange(&once, FSDP_COLL_ALLGATHER, &L, W, R, 1, P / W * g_b, 1);
        }
        int times = gather ? 1 + (sd == FSDP_FULL_SHARD && u->reshard_after_forward) : 0;
        for (int k = 0; k < FSDP_COLL_COUNT; k++) {
            out->net_bytes[k] += once.net_bytes[k] * times;
            out->shm_bytes[k] += once.shm_bytes[k] * times;
            out->net_msgs[k] += once.net_msgs[k] * times;
        }
        if (W == 1) continue;
        if (sd == FSDP_NO_SHARD) { /* the full gradient over the world */
            if (P * r_b < 32 * 1024) t_red[i] = exchange(out, FSDP_COLL_ALLREDUCE, &L, W, R, 1, P * r_b, 1);
            else t_red[i] = exchange(out, FSDP_COLL_ALLREDUCE, &L, W, R, 1, P / W * r_b, 2);
        } else if (sd == FSDP_HYBRID_SHARD) { /* the host's reduce-scatter, then across hosts */
            if (R > 1) t_red[i] = exchange(out, FSDP_COLL_REDUCE_SCATTER, &L, R, R, 1, P / R * r_b, 1);
            if (H > 1) {
                double c = P / R * r_b; /* the gradient shard */
                t_red[i] += c < 32 * 1024 ? exchange(out, FSDP_COLL_ALLREDUCE, &L, H, 1, R, c, 1)
                                          : exchange(out, FSDP_COLL_ALLREDUCE, &L, H, 1, R, c / H, 2);
            }
        } else {
            t_red[i] = exchange(out, FSDP_COLL_REDUCE_SCATTER, &L, W, R, 1, P / W * r_b, 1);
        }
        out->comm_ms += t_red[i] * 1e3;
        out->comm_ms += t_ag[i] * times * 1e3;
    }

    /* forward: units in pre-order (the root unit first) */
    struct sim s = {0, 0, 0};
    int *issued = fsdp__zalloc((size_t)n, sizeof *issued);
    if (!issued) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory planning communication");
    for (int k = 0; st == FSDP_OK && k < n; k++) {
        for (int j = k; gather && j < n && j <= k + ahead; j++)
            if (!issued[j]) { done[j] = issue(&s, t_ag[j]); issued[j] = 1; }
        wait_until(&s, done[k]);
        double c = total > 0 ? comp * fshare * (double)fm->units[k].numel_full / total : 0;
        s.t += c;
        s.compute += c;
    }
    /* backward, in the hooks' order; reductions wait at the next unit's post-backward */
    fsdp__model_bwd_order(fm, bwd);
    for (int i = 0; issued && i < n; i++) issued[i] = !(gather && sd == FSDP_FULL_SHARD && fm->units[i].reshard_after_forward);
    double red_done = 0;
    for (int k = 0; st == FSDP_OK && k < n; k++) {
        int u = bwd[k];
        for (int j = k; j < n && j <= k + ahead; j++)
            if (!issued[bwd[j]]) { done[bwd[j]] = issue(&s, t_ag[bwd[j]]); issued[bwd[j]] = 1; }
        if (!issued[u]) { done[u] = issue(&s, t_ag[u]); issued[u] = 1; }
        if (fm->units[u].reshard_after_forward && sd == FSDP_FULL_SHARD && gather) wait_until(&s, done[u]);
        double c = total > 0 ? comp * (1 - fshare) * (double)fm->units[u].numel_full / total : 0;
        s.t += c;
        s.compute += c;
        if (fm->overlap) wait_until(&s, red_done); /* the previous unit's reduction */
        red_done = t_red[u] > 0 ? issue(&s, t_red[u]) : red_done;
        if (!fm->overlap) wait_until(&s, red_done);
    }
    wait_until(&s, red_done);
    out->compute_ms = s.compute * 1e3;
    out->step_ms = s.t * 1e3;
    out->exposed_ms = (s.t - s.compute) * 1e3;
    free(issued);
    free(t_ag);
    free(t_red);
    fsdp_model_free(fm);
    free(bwd);
    free(done);
    free(sh);
    return st;
}
