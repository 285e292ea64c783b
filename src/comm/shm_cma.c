/*
 * shm_cma.c - the single-copy collectives of the shared-memory backend
 * (shm.c runs them on its progress thread when the sizes call for it).
 *
 * [Note: single copy]
 * Default (FSDP_SHM_CMA=1): reduce-scatters only; all-gathers and
 * broadcasts take it at FSDP_SHM_CMA=2. Measured on a 2-core VM, the
 * kernel's copy (4 KiB pages pinned and copied one by one) cost more CPU
 * than the staged all-gather whose copies into recv are streaming stores
 * (copy_nt), at 2 ranks and, twice over, at 4 (bench/README.md).
 * Where the kernel lets every rank read every other's memory with
 * process_vm_readv (cross-memory attach: same user, ptrace access mode
 * "attach" allowed by Yama's ptrace_scope and seccomp, all pids visible),
 * all-gathers, reduce-scatters and broadcasts whose per-rank block is at
 * least cma_min bytes (64 KiB; env FSDP_SHM_CMA_MIN) skip the slots: each
 * reader copies straight from the owner's own buffer, one copy per byte
 * instead of two. At creation every rank reads each peer's probe word
 * (SHM_MAGIC ^ pid) and the ranks agree with an MPI all-reduce (MIN), so all
 * take the same path or none does (env FSDP_SHM_CMA=0 turns it off; env
 * FSDP_SHM_VERBOSE=1 makes rank 0 say which path it got). Protocol, per
 * single-copy collective n (a counter of their own, xop, beside the rounds):
 *   1. publish: ctl[me].xaddr = the address of this rank's contribution
 *      (send, or its block of recv in place; the root's buffer for a
 *      broadcast), then ctl[me].xposted = n (release);
 *   2. for each peer k read from: wait ctl[k].xposted >= n, take xaddr and
 *      process_vm_readv from it in 1 MiB pieces (the abort flag is checked
 *      between pieces);
 *   3. ctl[me].xdone = n; then, if peers read this rank's buffer, wait
 *      ctl[k].xdone >= n for all of them before the request completes (the
 *      caller may then reuse the buffer, and this rank publish again).
 * All-gather: the owner's own block send -> recv is a memcpy, the W-1
 * others are read straight into recv. Reduce-scatter: each rank reduces only
 * its own block, reading every peer's part of it once, in chunks of 256 KiB
 * (env FSDP_SHM_CHUNK) that stay in L2: for each chunk, rank 0's part, then
 * 1's, ... are added in rank order into an fp32 accumulator; for an fp32 sum
 * the last addition writes recv with streaming (non-temporal) stores
 * (add_f32, AVX-512 where compiled for it, same IEEE additions as the scalar
 * loop). Waits are the same wait_ge as the rounds', so the watchdog and the
 * dead-peer checks apply; a read from a dead peer fails with ESRCH and names
 * it as well. A SIGSTOPped peer's memory stays readable: the others finish
 * their reads and the watchdog fires in step 3. All-reduce and barrier keep
 * the rounds (an in-place all-reduce overwrites the very buffer its peers
 * read; the slots give it the needed snapshot).
 * Copies per byte of all-gather, out of place, per rank: the staged path
 * does own block send -> recv, copy in, and W-1 copies out; single copy does
 * the first and the W-1 reads only (at 2 ranks 2 bytes of memcpy traffic
 * per bus byte instead of 3, i.e. at most 50% of one core's memcpy rate as
 * bus bandwidth, from about 33%).
 */
#include "comm/shm-impl.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

/* ---- Single copy (see [Note: single copy]) ---- */

/* process_vm_readv pieces: an abort is seen within a fraction of a ms, and 1 MiB
 * pieces copy a little faster than larger ones (fewer pages pinned at once) */
#define SHM_CMA_PIECE ((size_t)1 << 20)

/* Copies n bytes at `addr` in rank peer's address space to dst. */
static int cma_read(struct shm_state *s, struct fsdp_comm *c, const struct shm_req *q, int peer,
                    void *dst, uint64_t addr, size_t n) {
    unsigned char *d = dst;
    while (n) {
        uint32_t ab = atomic_load_explicit(&s->hdr->aborted, memory_order_relaxed);
        if (ab) return fsdp__shm_fail_aborted(s, c, ab, peer, q);
        size_t piece = n < SHM_CMA_PIECE ? n : SHM_CMA_PIECE;
        struct iovec lo = {d, piece}, re = {(void *)(uintptr_t)addr, piece};
        ssize_t got = process_vm_readv((pid_t)s->peer_pid[peer], &lo, 1, &re, 1, 0);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) {
            int err = got < 0 ? errno : EFAULT;
            if (err == ESRCH || !fsdp__shm_pid_alive(s->peer_pid[peer])) return fsdp__shm_fail_dead(s, c, peer, q);
            char what[160];
            snprintf(s->fail_msg, sizeof s->fail_msg,
                     "shm: rank %d cannot read rank %d's buffer (process_vm_readv: %s) in %s", c->rank, peer,
                     strerror(err), fsdp__shm_req_what(q, what, sizeof what));
            fprintf(stderr, "fsdp: %s\n", s->fail_msg);
            fflush(stderr);
            s->failed = 1;
            return -1;
        }
        d += got;
        addr += (uint64_t)got;
        n -= (size_t)got;
    }
    return 0;
}

/* Step 1: publishes this rank's buffer for the next single-copy collective. */
static void x_post(struct shm_state *s, struct fsdp_comm *c, const struct shm_req *q, const void *addr) {
    struct shm_ctl *me = &s->ctl[c->rank];
    s->xop++;
    fsdp__shm_id_set(&me->xid, q); /* [Note: collective ids] in shm.c */
    atomic_store_explicit(&me->xaddr, (uint64_t)(uintptr_t)addr, memory_order_relaxed);
    fsdp__shm_store_wake(&me->xposted, &me->xposted_waiters, s->xop); /* releases xaddr */
}

/* Step 2: rank k's published address for this collective, in s->xpeer[k]. */
static int x_peer(struct shm_state *s, struct fsdp_comm *c, int k, const struct shm_req *q) {
    if (fsdp__shm_wait_ge(s, c, &s->ctl[k].xposted, &s->ctl[k].xposted_waiters, s->xop, k, q)) return -1;
    s->xpeer[k] = atomic_load_explicit(&s->ctl[k].xaddr, memory_order_relaxed);
    return fsdp__shm_id_check(s, c, &s->ctl[k].xid, k, q, 0);
}

/* Step 3: this rank has read all it needs; if the peers read this rank's
 * buffer, waits until every one of them has too (then the caller may reuse
 * it, and this rank may publish another address). */
static int x_finish(struct shm_state *s, struct fsdp_comm *c, const struct shm_req *q, int read_by_peers) {
    struct shm_ctl *me = &s->ctl[c->rank];
    fsdp__shm_store_wake(&me->xdone, &me->xdone_waiters, s->xop);
    if (!read_by_peers) return 0;
    for (int k = 0; k < c->size; k++)
        if (k != c->rank && fsdp__shm_wait_ge(s, c, &s->ctl[k].xdone, &s->ctl[k].xdone_waiters, s->xop, k, q))
            return -1;
    return 0;
}

int fsdp__shm_allgather_cma(struct shm_state *s, struct fsdp_comm *c, struct shm_req *q) {
    size_t bytes = q->count * fsdp_dtype_size(q->dt);
    unsigned char *recv = q->recv;
    const unsigned char *mine = q->send ? q->send : recv + (size_t)c->rank * bytes;
    x_post(s, c, q, mine);
    if (q->send) fsdp__shm_copy_out(recv + (size_t)c->rank * bytes, q->send, bytes, bytes);
    for (int j = 1; j < c->size; j++) {
        int k = (c->rank + j) % c->size; /* spread the readers over the owners */
        /* (through an L2-sized buffer then streamed to recv measured no faster) */
        if (x_peer(s, c, k, q) || cma_read(s, c, q, k, recv + (size_t)k * bytes, s->xpeer[k], bytes))
            return -1;
    }
    return x_finish(s, c, q, 1);
}

/* The fp32 sum of fsdp__shm_reduce_scatter_cma (gradients): per chunk,
 * acc = x0 + x1 (+ x2 ...) in rank order in an L2-resident buffer, the last
 * addition storing straight to recv with streaming stores (times 1/size
 * for FSDP_AVG: [Note: averaging reductions], comm.c); a peer's
 * contribution lands in acc (rank 0's) or xtmp, this rank's is read in place. */
static int reduce_scatter_f32_cma(struct shm_state *s, struct fsdp_comm *c, struct shm_req *q) {
    int me = c->rank, W = c->size;
    size_t per = s->xchunk / sizeof(float);
    if (per > s->slot / sizeof(float)) per = s->slot / sizeof(float); /* acc holds slot bytes */
    const float *send = q->send;
    float *recv = q->recv, *acc = s->acc, *tmp = (float *)(void *)s->xtmp;
    for (size_t off = 0; off < q->count; off += per) {
        size_t n = q->count - off < per ? q->count - off : per;
        size_t boff = (size_t)me * q->count + off; /* elements: this chunk in every send buffer */
        const float *a = send + boff;
        if (me != 0 && cma_read(s, c, q, 0, acc, s->xpeer[0] + boff * sizeof(float), n * sizeof(float)))
            return -1;
        if (me != 0) a = acc;
        for (int k = 1; k < W; k++) {
            const float *b = send + boff;
            if (k != me) {
                if (cma_read(s, c, q, k, tmp, s->xpeer[k] + boff * sizeof(float), n * sizeof(float)))
                    return -1;
                b = tmp;
            }
            int last = k == W - 1;
            fsdp__shm_add_f32(last ? recv + off : acc, a, b, n, last, last ? q->scale : 1.0f);
            a = acc;
        }
    }
    return x_finish(s, c, q, 1);
}

/* Each rank reduces only its own block, reading every peer's part of it once,
 * chunk by chunk through an L2-sized buffer, in rank order. */
int fsdp__shm_reduce_scatter_cma(struct shm_state *s, struct fsdp_comm *c, struct shm_req *q) {
    size_t esz = fsdp_dtype_size(q->dt);
    int low = fsdp__dtype_is_low(q->dt), me = c->rank;
    size_t per = s->xchunk / esz;
    if (low && per > s->slot / 8) per = s->slot / 8;
    const unsigned char *send = q->send;
    unsigned char *recv = q->recv;
    x_post(s, c, q, send);
    for (int k = 0; k < c->size; k++)
        if (k != me && x_peer(s, c, k, q)) return -1;
    if (fsdp__shm_rs_f32_cma(s, q)) return reduce_scatter_f32_cma(s, c, q);
    for (size_t off = 0; off < q->count; off += per) {
        size_t n = q->count - off < per ? q->count - off : per;
        size_t boff = ((size_t)me * q->count + off) * esz; /* this chunk in every send buffer */
        unsigned char *dst = recv + off * esz;
        for (int k = 0; k < c->size; k++) {
            const unsigned char *src = s->xtmp;
            if (k == me) {
                src = send + boff;
            } else if (k == 0 && !low) { /* the first contribution straight into recv */
                if (cma_read(s, c, q, k, dst, s->xpeer[k] + boff, n * esz)) return -1;
                continue;
            } else if (cma_read(s, c, q, k, s->xtmp, s->xpeer[k] + boff, n * esz)) {
                return -1;
            }
            if (low) fsdp__shm_reduce_low(s->acc, src, n, q->dt, q->op, k == 0, s->acc + s->slot / 8);
            else fsdp__shm_reduce_into(dst, src, n, q->dt, q->op, k == 0);
        }
        if (low) fsdp__f32_to_low(s->acc, dst, n, q->dt);
    }
    return x_finish(s, c, q, 1);
}

int fsdp__shm_broadcast_cma(struct shm_state *s, struct fsdp_comm *c, struct shm_req *q) {
    size_t bytes = q->count * fsdp_dtype_size(q->dt);
    x_post(s, c, q, q->recv);
    if (c->rank != q->root &&
        (x_peer(s, c, q->root, q) || cma_read(s, c, q, q->root, q->recv, s->xpeer[q->root], bytes)))
        return -1;
    return x_finish(s, c, q, c->rank == q->root);
}

/* Decides [Note: single copy] for every rank alike: on if every rank can
 * read every other's probe word with process_vm_readv (ptrace rules,
 * seccomp, PID namespaces allow it), at the lowest level FSDP_SHM_CMA any
 * rank asks for (0 off, 1 reduce-scatters, 2 all-gathers and broadcasts
 * too); the threshold FSDP_SHM_CMA_MIN (bytes per rank's block) is the
 * largest any rank asks for.
 * COLLECTIVE: yes (over the inner MPI communicator). */
enum fsdp_status fsdp__shm_probe_cma(struct fsdp_comm *c, struct shm_state *s) {
    /* a value refused here (fsdp_ctx_create checked them all) still takes part in the
     * agreement below, as off, so that no peer waits; then it is this rank's error */
    long long lv = 1, mv = SHM_CMA_MIN_DEFAULT, verbose = 0;
    enum fsdp_status est = fsdp__env_int(c->ctx, "FSDP_SHM_CMA", 1, &lv);
    if (est == FSDP_OK) est = fsdp__env_int(c->ctx, "FSDP_SHM_CMA_MIN", SHM_CMA_MIN_DEFAULT, &mv);
    if (est == FSDP_OK) est = fsdp__env_int(c->ctx, "FSDP_SHM_VERBOSE", 0, &verbose);
    if (est != FSDP_OK) lv = 0;
    int32_t level = (int32_t)lv, ok = level > 0 && c->size > 1;
    for (int k = 0; k < c->size && ok; k++) {
        if (k == c->rank) continue;
        uint64_t v = 0;
        struct iovec lo = {&v, sizeof v}, re = {(void *)(uintptr_t)s->ctl[k].probe_addr, sizeof v};
        ok = s->peer_pid[k] > 0 &&
             process_vm_readv((pid_t)s->peer_pid[k], &lo, 1, &re, 1, 0) == (ssize_t)sizeof v &&
             v == (SHM_MAGIC ^ (uint64_t)(uint32_t)s->ctl[k].pid);
    }
    ok = ok ? level : 0;
    int32_t all = ok, min = (int32_t)mv, max = min;
    FSDP_TRY(fsdp_comm_allreduce(s->mpi, &ok, &all, 1, FSDP_I32, FSDP_MIN));
    FSDP_TRY(fsdp_comm_allreduce(s->mpi, &min, &max, 1, FSDP_I32, FSDP_MAX));
    FSDP_TRY(est);
    s->cma = all;
    s->cma_min = (size_t)max;
    if (c->rank == 0 && verbose) {
        if (s->cma) fprintf(stderr, "fsdp: shm: %d ranks, single copy (process_vm_readv) for %s from "
                            "%zu-byte blocks, staged otherwise\n", c->size,
                            s->cma >= 2 ? "reduce-scatters, all-gathers and broadcasts" : "reduce-scatters",
                            s->cma_min);
        else fprintf(stderr, "fsdp: shm: %d ranks, staged through %zu-byte slots (no single copy)\n",
                     c->size, s->slot);
    }
    if (!s->cma) return FSDP_OK;
    s->xpeer = fsdp__calloc(c->ctx, (size_t)c->size * sizeof(uint64_t), FSDP_MEM_OTHER, "shm peer addresses");
    s->xtmp = fsdp__alloc(c->ctx, s->xchunk, FSDP_MEM_OTHER, "shm single-copy chunk");
    return s->xpeer && s->xtmp ? FSDP_OK : FSDP_ERR_NOMEM;
}

/* The reduce-scatter chunk of [Note: single copy]; FSDP_SHM_CHUNK overrides. */
enum fsdp_status fsdp__shm_chunk_bytes(struct fsdp_ctx *ctx, size_t *out) {
    long long v;
    FSDP_TRY(fsdp__env_int(ctx, "FSDP_SHM_CHUNK", 0, &v));
    size_t b = v ? (size_t)v : SHM_CHUNK_DEFAULT;
    *out = (b + 63) & ~(size_t)63;
    return FSDP_OK;
}
