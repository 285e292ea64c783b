/*
 * shm.c - the shared-memory backend for ranks on one host. Open MPI starts
 * the job and does the handshake (an inner MPI communicator broadcasts the
 * segment's name); after that every collective moves through one POSIX
 * shared segment, or where the kernel permits straight from the owner's
 * buffer to the reader's ([Note: single copy]), without MPI, on a progress
 * thread per rank.
 *
 * Segment (mapped by every rank, unlinked as soon as all have mapped it, so
 * that nothing is left in /dev/shm however the job ends):
 *   header | ctl[world] (one per rank, own cache lines) | data
 *   data = world x SHM_NBUF slots of `slot` bytes: slot (r, b) is written
 *   only by rank r and read by its peers. slot = 1 MiB, less for worlds
 *   over 24 ranks so that the segment stays under 48 MiB (env FSDP_SHM_SLOT
 *   overrides); rank 0 reserves it with posix_fallocate, so a full
 *   /dev/shm is an error at creation (FSDP_COMM_AUTO then falls back to
 *   MPI), never a SIGBUS later.
 *
 * [Note: rounds]
 * Every collective is cut into rounds, the same number on every rank (it
 * depends only on the type, count, dtype and world size, which all ranks
 * agree on). Round g uses buffer b = g % SHM_NBUF of every slot:
 *   1. wait until every rank has consumed round g - SHM_NBUF (the last user
 *      of buffer b), i.e. ctl[k].consumed >= g + 1 - SHM_NBUF;
 *   2. copy this rank's contribution into slot (me, b); ctl[me].posted = g+1;
 *   3. for each peer whose data this rank needs: wait ctl[k].posted >= g+1,
 *      then copy (or reduce) out of slot (k, b) straight into the user's
 *      buffer; then ctl[me].consumed = g+1.
 * So data moves with one copy in (by its owner) and one copy out per reader;
 * with SHM_NBUF = 2 a rank fills the next buffer while slower peers still
 * read the previous one. Counters are 32-bit (futex words) and compared
 * modulo 2^32.
 *
 * [Note: collective ids]
 * Rounds pair collectives by their order alone: ranks that started different
 * ones (an all-gather of 4 elements against one of 5, F32 against BF16, SUM
 * against MAX, one rank's extra collective: an evaluation run on rank 0 only)
 * completed them with wrong data, silently, unless the schedule check was on
 * ([Note: schedule check] in comm.c). So each rank publishes what its round
 * holds (ctl.rid, by buffer) before the counter that posts it, and what its
 * single-copy buffer is for (ctl.xid) before its address: the request's
 * number, type, count, dtype, op and root. A reader compares them with its
 * own request after each wait, before it reads any data, and fails naming
 * both. Collectives whose sizes chose different paths (the slots on one
 * rank, single copy on the other) wait on different counters and would meet
 * only the watchdog: a rank that waits long also compares the peer's current
 * request (ctl.cur), where it has the same number. Requests are numbered by
 * the backend (the schedule check's own exchanges count too), so equal
 * schedules have equal numbers; the cost is three stores per round and per
 * start, and three loads per wait.
 *
 * [Note: single copy] (shm_cma.c): where the kernel allows it, readers copy
 * straight from the owner's buffer with process_vm_readv instead of through
 * the slots.
 *
 * Shared windows (shm_window): further segments made the same way, one per
 * request, which src/fsdp fills with the units' shards so that gathers need
 * no copy ([Note: shared window] in src/fsdp/unit.c); env FSDP_SHM_WINDOW=0
 * declines them.
 *
 * [Note: reduction order]
 * A reduction sums the contributions of ranks 0, 1, ..., world-1 in that
 * order, element by element (acc = x0; acc += x1; ...), on every rank: the
 * result is bit-identical run to run, on every rank, and equal to a reference
 * summed in rank order. BF16/F16 accumulate in fp32 and round once, as in
 * mpi.c. Integers wrap (unsigned arithmetic). An all-reduce is done by every
 * rank reducing all contributions (world reads per element per rank): simple
 * and exact; it is meant for small tensors (norms, losses), not for DDP-size
 * gradients.
 *
 * [Note: progress and waiting]
 * A start appends a request to this rank's FIFO and returns at once; the
 * progress thread runs requests in start order (the order in which every
 * rank starts its collectives, as MPI requires too), so communication
 * advances while the compute thread computes. Waiting on a peer spins
 * briefly, then sleeps on the peer's counter with a futex (the writer wakes
 * sleepers), so oversubscribed ranks do not burn each other's cores.
 *
 * [Note: dead peers]
 * While it waits on a peer, the progress thread checks every ~50 ms that the
 * peer's process still exists (kill(pid, 0), and /proc/PID/stat is not a
 * zombie) and that no rank has set the segment's abort flag. A dead peer
 * fails the current and every later request with FSDP_ERR_COMM naming the
 * rank, the collective, its sequence number and size; the message is printed
 * at once too, since the job cannot go on. The caller then ends the job
 * (fsdp_ctx_abort, i.e. MPI_Abort through the inner communicator). A rank
 * that aborts sets the abort flag first, so that peers stop waiting on it.
 * A stopped (SIGSTOP) peer is alive and is waited on until the watchdog
 * (c->timeout_s, measured from the start of the collective) fails the
 * request the same way, naming the collective and the rank waited on.
 */
#include "comm/shm-impl.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <omp.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

/* ---- Waiting ---- */

static long futex(_Atomic uint32_t *addr, int op, uint32_t val, const struct timespec *ts) {
    return syscall(SYS_futex, (uint32_t *)addr, op, val, ts, NULL, 0);
}

/* Is a - b >= 0 modulo 2^32? */
static int ge32(uint32_t a, uint32_t b) { return (int32_t)(a - b) >= 0; }

void fsdp__shm_store_wake(_Atomic uint32_t *w, _Atomic uint32_t *waiters, uint32_t v) {
    atomic_store(w, v);
    if (atomic_load(waiters)) futex(w, FUTEX_WAKE, INT32_MAX, NULL);
}

int fsdp__shm_pid_alive(int32_t pid) {
    if (pid <= 0) return 1;
    if (kill((pid_t)pid, 0) != 0 && errno == ESRCH) return 0;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 1; /* no /proc: trust kill */
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 1;
    buf[n] = 0;
    const char *p = strrchr(buf, ')');
    return !(p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X'));
}

const char *fsdp__shm_req_what(const struct shm_req *q, char *buf, size_t n) {
    return fsdp__coll_what(q->base.coll, q->seq, q->count, q->dt, q->tag, buf, n);
}

/* Fails the progress thread (s->failed) because rank `peer` died during q. */
int fsdp__shm_fail_dead(struct shm_state *s, struct fsdp_comm *c, int peer, const struct shm_req *q) {
    char what[160];
    snprintf(s->fail_msg, sizeof s->fail_msg,
             "shm: rank %d (pid %d) died during %s; rank %d cannot go on, the job must end", peer,
             (int)s->ctl[peer].pid, fsdp__shm_req_what(q, what, sizeof what), c->rank);
    fprintf(stderr, "fsdp: rank %d: %s\n", c->rank, s->fail_msg);
    fflush(stderr);
    s->failed = 1;
    return -1;
}

/* ... because rank ab - 1 set the abort flag. */
int fsdp__shm_fail_aborted(struct shm_state *s, struct fsdp_comm *c, uint32_t ab, int peer,
                           const struct shm_req *q) {
    char what[160];
    snprintf(s->fail_msg, sizeof s->fail_msg, "shm: rank %u aborted the job while rank %d waited on rank %d in %s",
             ab - 1, c->rank, peer, fsdp__shm_req_what(q, what, sizeof what));
    s->failed = 1;
    return -1;
}

/* ---- Collective ids ([Note: collective ids]) ---- */

static uint64_t id_desc(const struct shm_req *q) {
    return (uint64_t)q->base.coll | (uint64_t)q->dt << 8 | (uint64_t)q->op << 16 | (uint64_t)(uint32_t)q->root << 32;
}

void fsdp__shm_id_set(struct shm_coll_id *id, const struct shm_req *q) {
    atomic_store_explicit(&id->req, 0, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    atomic_store_explicit(&id->count, q->count, memory_order_relaxed);
    atomic_store_explicit(&id->desc, id_desc(q), memory_order_relaxed);
    memcpy(id->tag, q->tag, sizeof id->tag - 1);
    id->tag[sizeof id->tag - 1] = '\0';
    atomic_store_explicit(&id->req, q->req, memory_order_release);
}

static void id_describe(uint64_t req, uint64_t count, uint64_t desc, const char *tag, char *buf, size_t n) {
    enum fsdp_coll coll = (enum fsdp_coll)(desc & 0xff);
    unsigned dt = (unsigned)(desc >> 8 & 0xff), op = (unsigned)(desc >> 16 & 0xff);
    int root = (int)(uint32_t)(desc >> 32);
    static const char *const ops[] = {"sum", "max", "min"}; /* an average runs as a sum (enqueue) */
    char what[96] = "barrier";
    if (coll != FSDP_COLL_BARRIER)
        snprintf(what, sizeof what, "%s of %llu x %s", (unsigned)coll < FSDP_COLL_COUNT ? fsdp__coll_name(coll) : "?",
                 (unsigned long long)count, dt <= (unsigned)FSDP_I64 ? fsdp_dtype_name((enum fsdp_dtype)dt) : "?");
    char how[32] = "";
    if (coll == FSDP_COLL_REDUCE_SCATTER || coll == FSDP_COLL_ALLREDUCE)
        snprintf(how, sizeof how, ", %s", op < 3 ? ops[op] : "?");
    if (coll == FSDP_COLL_BROADCAST) snprintf(how, sizeof how, " from rank %d", root);
    snprintf(buf, n, "%s%s (request %llu%s%.40s)", what, how, (unsigned long long)req, tag[0] ? ", tag " : "", tag);
}

int fsdp__shm_id_check(struct shm_state *s, struct fsdp_comm *c, struct shm_coll_id *w, int peer,
                       const struct shm_req *q, int now) {
    uint64_t req = atomic_load_explicit(&w->req, memory_order_acquire);
    if (now && req != q->req) return 0; /* the peer is elsewhere: not comparable */
    uint64_t count = atomic_load_explicit(&w->count, memory_order_relaxed);
    uint64_t desc = atomic_load_explicit(&w->desc, memory_order_relaxed);
    char tag[sizeof w->tag];
    memcpy(tag, w->tag, sizeof tag);
    tag[sizeof tag - 1] = '\0';
    atomic_thread_fence(memory_order_acquire);
    if (now && atomic_load_explicit(&w->req, memory_order_relaxed) != req) return 0; /* rewritten meanwhile */
    if (req == q->req && count == q->count && desc == id_desc(q)) return 0;
    char mine[160], theirs[160];
    id_describe(q->req, q->count, id_desc(q), q->tag, mine, sizeof mine);
    id_describe(req, count, desc, tag, theirs, sizeof theirs);
    snprintf(s->fail_msg, sizeof s->fail_msg,
             "shm: the ranks run different collectives: rank %d %s, rank %d %s; every rank must start the same "
             "collectives in the same order", c->rank, mine, peer, theirs);
    s->failed = 1; /* the request's error carries it to the caller */
    return -1;
}

/* Waits until *w >= target (mod 2^32), w being a counter of rank `peer`.
 * Returns 0, or -1 (with s->failed set) if the peer died or the job is being
 * aborted. */
int fsdp__shm_wait_ge(struct shm_state *s, struct fsdp_comm *c, _Atomic uint32_t *w, _Atomic uint32_t *waiters,
                      uint32_t target, int peer, const struct shm_req *q) {
    if (s->failed) return -1;
    for (int i = 0; i < 4000; i++) {
        if (ge32(atomic_load_explicit(w, memory_order_acquire), target)) return 0;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
    double last_check = fsdp__now();
    for (;;) {
        atomic_fetch_add(waiters, 1);
        uint32_t v = atomic_load(w);
        if (!ge32(v, target)) {
            struct timespec ts = {0, 20 * 1000 * 1000};
            futex(w, FUTEX_WAIT, v, &ts);
        }
        atomic_fetch_sub(waiters, 1);
        if (ge32(atomic_load_explicit(w, memory_order_acquire), target)) return 0;
        double t = fsdp__now();
        if (t - last_check < 0.05) continue;
        last_check = t;
        if (c->timeout_s > 0 && t - q->t_start > c->timeout_s) {
            char what[160];
            snprintf(s->fail_msg, sizeof s->fail_msg,
                     "collective timeout: rank %d waited %.1f s (limit %g s) on rank %d in %s", c->rank,
                     t - q->t_start, c->timeout_s, peer, fsdp__shm_req_what(q, what, sizeof what));
            fprintf(stderr, "fsdp: %s\n", s->fail_msg);
            fflush(stderr);
            s->failed = 1;
            return -1;
        }
        uint32_t ab = atomic_load(&s->hdr->aborted);
        if (ab) return fsdp__shm_fail_aborted(s, c, ab, peer, q);
        if (!fsdp__shm_pid_alive(s->peer_pid[peer])) return fsdp__shm_fail_dead(s, c, peer, q);
        if (fsdp__shm_id_check(s, c, &s->ctl[peer].cur, peer, q, 1)) return -1; /* waiting elsewhere? */
    }
}

/* ---- Rounds (see [Note: rounds]) ---- */

static unsigned char *slot_at(struct shm_state *s, int rank, uint32_t round) {
    return s->data + ((size_t)rank * SHM_NBUF + round % SHM_NBUF) * s->slot;
}

/* Step 1 of a round: may this rank overwrite its buffer for round g? */
static int round_begin(struct shm_state *s, struct fsdp_comm *c, const struct shm_req *q) {
    uint32_t g = s->round;
    uint32_t need = g + 1u - SHM_NBUF;
    /* at the start need is -1 (mod 2^32) and consumed 0: no wait */
    for (int k = 0; k < c->size; k++)
        if (k != c->rank &&
            fsdp__shm_wait_ge(s, c, &s->ctl[k].consumed, &s->ctl[k].consumed_waiters, need, k, q))
            return -1;
    return 0;
}

static void round_post(struct shm_state *s, struct fsdp_comm *c, const struct shm_req *q) {
    struct shm_ctl *me = &s->ctl[c->rank];
    fsdp__shm_id_set(&me->rid[s->round % SHM_NBUF], q); /* [Note: collective ids] */
    fsdp__shm_store_wake(&me->posted, &me->posted_waiters, s->round + 1u);
}

static int round_wait_peer(struct shm_state *s, struct fsdp_comm *c, int k, const struct shm_req *q) {
    if (k == c->rank) return 0;
    if (fsdp__shm_wait_ge(s, c, &s->ctl[k].posted, &s->ctl[k].posted_waiters, s->round + 1u, k, q)) return -1;
    return fsdp__shm_id_check(s, c, &s->ctl[k].rid[s->round % SHM_NBUF], k, q, 0);
}

static void round_end(struct shm_state *s, struct fsdp_comm *c) {
    struct shm_ctl *me = &s->ctl[c->rank];
    fsdp__shm_store_wake(&me->consumed, &me->consumed_waiters, s->round + 1u);
    s->round++;
}

/* Reductions and the copies out ([Note: reduction order]): shm_reduce.c */

/* ---- Collectives on the progress thread ---- */

static int run_allgather(struct shm_state *s, struct fsdp_comm *c, struct shm_req *q) {
    size_t esz = fsdp_dtype_size(q->dt), bytes = q->count * esz;
    unsigned char *recv = q->recv;
    const unsigned char *mine = q->send ? q->send : recv + (size_t)c->rank * bytes;
    for (size_t off = 0; off < bytes; off += s->slot) {
        size_t n = bytes - off < s->slot ? bytes - off : s->slot;
        if (round_begin(s, c, q)) return -1;
        unsigned char *my = slot_at(s, c->rank, s->round);
        memcpy(my, mine + off, n);
        round_post(s, c, q);
        /* out of place: this rank's own block from its slot, still in cache */
        if (q->send) fsdp__shm_copy_out(recv + (size_t)c->rank * bytes + off, my, n, bytes);
        for (int j = 1; j < c->size; j++) {
            int k = (c->rank + j) % c->size; /* spread the readers over the slots */
            if (round_wait_peer(s, c, k, q)) return -1;
            fsdp__shm_copy_out(recv + (size_t)k * bytes + off, slot_at(s, k, s->round), n, bytes);
        }
        round_end(s, c);
    }
    return 0;
}

static int run_reduce_scatter(struct shm_state *s, struct fsdp_comm *c, struct shm_req *q) {
    size_t esz = fsdp_dtype_size(q->dt), W = (size_t)c->size;
    int low = fsdp__dtype_is_low(q->dt);
    size_t per = s->slot / W / esz; /* elements of each destination's block per round */
    if (low && per > s->slot / 8) per = s->slot / 8;
    const unsigned char *send = q->send;
    unsigned char *recv = q->recv;
    for (size_t off = 0; off < q->count; off += per) {
        size_t n = q->count - off < per ? q->count - off : per;
        if (round_begin(s, c, q)) return -1;
        unsigned char *my = slot_at(s, c->rank, s->round);
        for (size_t k = 0; k < W; k++)
            if ((int)k != c->rank) memcpy(my + k * per * esz, send + (k * q->count + off) * esz, n * esz);
        round_post(s, c, q);
        for (int k = 0; k < c->size; k++) {
            if (round_wait_peer(s, c, k, q)) return -1;
            const unsigned char *src = k == c->rank
                                           ? send + ((size_t)c->rank * q->count + off) * esz
                                           : slot_at(s, k, s->round) + (size_t)c->rank * per * esz;
            if (low) fsdp__shm_reduce_low(s->acc, src, n, q->dt, q->op, k == 0, s->acc + s->slot / 8);
            else fsdp__shm_reduce_into(recv + off * esz, src, n, q->dt, q->op, k == 0);
        }
        if (low) fsdp__f32_to_low(s->acc, recv + off * esz, n, q->dt);
        round_end(s, c);
    }
    return 0;
}

static int run_allreduce(struct shm_state *s, struct fsdp_comm *c, struct shm_req *q) {
    size_t esz = fsdp_dtype_size(q->dt);
    int low = fsdp__dtype_is_low(q->dt);
    size_t per = s->slot / esz;
    if (low && per > s->slot / 8) per = s->slot / 8;
    const unsigned char *in = q->send ? q->send : q->recv;
    unsigned char *recv = q->recv;
    for (size_t off = 0; off < q->count; off += per) {
        size_t n = q->count - off < per ? q->count - off : per;
        if (round_begin(s, c, q)) return -1;
        memcpy(slot_at(s, c->rank, s->round), in + off * esz, n * esz);
        round_post(s, c, q);
        /* every contribution from the slots, this rank's too: recv may be the input */
        for (int k = 0; k < c->size; k++) {
            if (round_wait_peer(s, c, k, q)) return -1;
            const unsigned char *src = slot_at(s, k, s->round);
            if (low) fsdp__shm_reduce_low(s->acc, src, n, q->dt, q->op, k == 0, s->acc + s->slot / 8);
            else fsdp__shm_reduce_into(recv + off * esz, src, n, q->dt, q->op, k == 0);
        }
        if (low) fsdp__f32_to_low(s->acc, recv + off * esz, n, q->dt);
        round_end(s, c);
    }
    return 0;
}

static int run_broadcast(struct shm_state *s, struct fsdp_comm *c, struct shm_req *q) {
    size_t bytes = q->count * fsdp_dtype_size(q->dt);
    unsigned char *buf = q->recv;
    for (size_t off = 0; off < bytes; off += s->slot) {
        size_t n = bytes - off < s->slot ? bytes - off : s->slot;
        if (round_begin(s, c, q)) return -1;
        if (c->rank == q->root) memcpy(slot_at(s, c->rank, s->round), buf + off, n);
        round_post(s, c, q);
        if (c->rank != q->root) {
            if (round_wait_peer(s, c, q->root, q)) return -1;
            memcpy(buf + off, slot_at(s, q->root, s->round), n);
        }
        round_end(s, c);
    }
    return 0;
}

static int run_barrier(struct shm_state *s, struct fsdp_comm *c, struct shm_req *q) {
    if (round_begin(s, c, q)) return -1;
    round_post(s, c, q);
    for (int k = 0; k < c->size; k++)
        if (round_wait_peer(s, c, k, q)) return -1;
    round_end(s, c);
    return 0;
}

/* 0: through the slots; 1: reductions by cross-memory reads; 2: all-gathers
 * and broadcasts too. The same choice on every rank: cma, cma_min and the
 * sizes agree. */
static int cma_level(const struct shm_state *s, const struct shm_req *q) {
    return q->count * fsdp_dtype_size(q->dt) >= s->cma_min ? s->cma : 0;
}

int fsdp__shm_rs_f32_cma(const struct shm_state *s, const struct shm_req *q) {
    return q->base.coll == FSDP_COLL_REDUCE_SCATTER && q->dt == FSDP_F32 && q->op == FSDP_SUM && cma_level(s, q) >= 1;
}

static void run_one(struct shm_state *s, struct fsdp_comm *c, struct shm_req *q) {
    int rc = -1;
    if (!s->failed) {
        fsdp__shm_id_set(&s->ctl[c->rank].cur, q);
        int x = cma_level(s, q) >= 1, xg = cma_level(s, q) >= 2;
        switch (q->base.coll) {
        case FSDP_COLL_ALLGATHER: rc = xg ? fsdp__shm_allgather_cma(s, c, q) : run_allgather(s, c, q); break;
        case FSDP_COLL_REDUCE_SCATTER:
            rc = x ? fsdp__shm_reduce_scatter_cma(s, c, q) : run_reduce_scatter(s, c, q);
            break;
        case FSDP_COLL_ALLREDUCE: rc = run_allreduce(s, c, q); break;
        case FSDP_COLL_BROADCAST: rc = xg ? fsdp__shm_broadcast_cma(s, c, q) : run_broadcast(s, c, q); break;
        case FSDP_COLL_BARRIER: rc = run_barrier(s, c, q); break;
        case FSDP_COLL_COUNT: break;
        }
    }
    if (rc != 0) {
        q->st = FSDP_ERR_COMM;
        snprintf(q->err, sizeof q->err, "%s", s->fail_msg[0] ? s->fail_msg : "shm: internal error");
    }
}

static void *progress_main(void *arg) {
    struct fsdp_comm *c = arg;
    struct shm_state *s = c->state;
    /* the 16-bit conversions (half.c over dtype.c) run on this thread alone:
     * a team of its own would compete with the compute threads for the cores */
    omp_set_num_threads(1);
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->head && !s->stop) pthread_cond_wait(&s->cv_work, &s->mu);
        if (!s->head) break; /* stop, and nothing left */
        struct shm_req *q = s->head;
        pthread_mutex_unlock(&s->mu);
        run_one(s, c, q);
        pthread_mutex_lock(&s->mu);
        s->head = q->next;
        if (!s->head) s->tail = NULL;
        q->done = 1;
        pthread_cond_broadcast(&s->cv_done);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* ---- The vtable ---- */


size_t fsdp__comm_shm_req_bytes(void) { return sizeof(struct shm_req); }

static enum fsdp_status enqueue(struct fsdp_comm *c, enum fsdp_coll coll, const void *send,
                                void *recv, size_t count, enum fsdp_dtype dt, enum fsdp_red_op op,
                                int root, struct fsdp_comm_req **req) {
    struct shm_state *s = c->state;
    struct shm_req *q = fsdp__comm_req_alloc(c, sizeof *q, coll);
    if (!q) return FSDP_ERR_NOMEM;
    q->send = send;
    q->recv = recv;
    q->count = count;
    q->dt = dt;
    q->op = op == FSDP_AVG ? FSDP_SUM : op;
    q->root = root;
    /* [Note: averaging reductions] (comm.c): the fp32 cross-memory
     * reduce-scatter scales in its last addition; the wait scales the rest */
    q->base.scaled = op == FSDP_AVG && fsdp__shm_rs_f32_cma(s, q);
    q->scale = q->base.scaled ? 1.0f / (float)c->size : 1.0f;
    q->seq = c->seq;
    q->req = ++s->nreq;
    q->t_start = fsdp__now();
    memcpy(q->tag, c->tag, sizeof q->tag);
    q->st = FSDP_OK;
    pthread_mutex_lock(&s->mu);
    if (s->tail) s->tail->next = q;
    else s->head = q;
    s->tail = q;
    pthread_cond_signal(&s->cv_work);
    pthread_mutex_unlock(&s->mu);
    *req = &q->base;
    return FSDP_OK;
}

static enum fsdp_status shm_allgather_start(struct fsdp_comm *c, const void *send, void *recv,
                                            size_t count, enum fsdp_dtype dt,
                                            struct fsdp_comm_req **req) {
    return enqueue(c, FSDP_COLL_ALLGATHER, send, recv, count, dt, FSDP_SUM, 0, req);
}

static enum fsdp_status shm_reduce_scatter_start(struct fsdp_comm *c, const void *send, void *recv,
                                                 size_t count, enum fsdp_dtype dt,
                                                 enum fsdp_red_op op, struct fsdp_comm_req **req) {
    return enqueue(c, FSDP_COLL_REDUCE_SCATTER, send, recv, count, dt, op, 0, req);
}

static enum fsdp_status shm_allreduce_start(struct fsdp_comm *c, const void *send, void *recv,
                                            size_t count, enum fsdp_dtype dt, enum fsdp_red_op op,
                                            struct fsdp_comm_req **req) {
    return enqueue(c, FSDP_COLL_ALLREDUCE, send, recv, count, dt, op, 0, req);
}

static enum fsdp_status shm_broadcast_start(struct fsdp_comm *c, void *buf, size_t count,
                                            enum fsdp_dtype dt, int root,
                                            struct fsdp_comm_req **req) {
    return enqueue(c, FSDP_COLL_BROADCAST, NULL, buf, count, dt, FSDP_SUM, root, req);
}

static enum fsdp_status shm_barrier_start(struct fsdp_comm *c, struct fsdp_comm_req **req) {
    return enqueue(c, FSDP_COLL_BARRIER, NULL, NULL, 0, FSDP_U8, FSDP_SUM, 0, req);
}

static enum fsdp_status shm_wait(struct fsdp_comm *c, struct fsdp_comm_req *req) {
    struct shm_state *s = c->state;
    struct shm_req *q = (struct shm_req *)req;
    pthread_mutex_lock(&s->mu);
    while (!q->done) pthread_cond_wait(&s->cv_done, &s->mu);
    pthread_mutex_unlock(&s->mu);
    enum fsdp_status st = q->st;
    if (st != FSDP_OK) fsdp__err(c->ctx, st, "%s", q->err);
    fsdp__comm_req_free(c, q);
    return st;
}

/* ---- Life ---- */

static void shm_abort(struct fsdp_comm *c, int code) {
    struct shm_state *s = c->state;
    if (s && s->hdr) {
        uint32_t zero = 0;
        atomic_compare_exchange_strong(&s->hdr->aborted, &zero, (uint32_t)c->rank + 1u);
    }
    if (s && s->mpi) s->mpi->ops->abort(s->mpi, code);
}

static void shm_free(struct fsdp_comm *c) {
    struct shm_state *s = c->state;
    if (s) {
        if (s->thread_started) {
            pthread_mutex_lock(&s->mu);
            s->stop = 1;
            pthread_cond_signal(&s->cv_work);
            pthread_mutex_unlock(&s->mu);
            pthread_join(s->thread, NULL);
            pthread_mutex_destroy(&s->mu);
            pthread_cond_destroy(&s->cv_work);
            pthread_cond_destroy(&s->cv_done);
        }
        if (s->map) munmap(s->map, s->map_bytes);
        fsdp__free(c->ctx, s->acc);
        fsdp__free(c->ctx, s->xtmp);
        fsdp__free(c->ctx, s->xpeer);
        fsdp__free(c->ctx, s->peer_pid);
        fsdp__comm_free(s->mpi);
        fsdp__free(c->ctx, s);
    }
    fsdp__free(c->ctx, c);
}

static enum fsdp_status shm_window(struct fsdp_comm *c, size_t bytes, void **base);
static void shm_window_free(struct fsdp_comm *c, void *base, size_t bytes);

static const struct fsdp_comm_ops shm_ops = {
    .allgather_start = shm_allgather_start,
    .reduce_scatter_start = shm_reduce_scatter_start,
    .allreduce_start = shm_allreduce_start,
    .broadcast_start = shm_broadcast_start,
    .barrier_start = shm_barrier_start,
    .wait = shm_wait,
    .abort = shm_abort,
    .free = shm_free,
    .window = shm_window,
    .window_free = shm_window_free,
    .avg = 1,
};

/* Removes segments of earlier jobs whose creator is gone (a job killed
 * during its handshake, the only time a segment has a name). */
static void sweep_stale(void) {
    DIR *d = opendir("/dev/shm");
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (strncmp(e->d_name, SHM_PREFIX, strlen(SHM_PREFIX)) != 0) continue;
        long pid = strtol(e->d_name + strlen(SHM_PREFIX), NULL, 10);
        if (pid > 0 && !fsdp__shm_pid_alive((int32_t)pid)) {
            char name[300];
            snprintf(name, sizeof name, "/%s", e->d_name);
            shm_unlink(name);
        }
    }
    closedir(d);
}

/* 1 MiB slots, smaller for big worlds so that the segment stays under
 * 48 MiB (Docker's default /dev/shm is 64 MB); FSDP_SHM_SLOT overrides. */
static size_t slot_bytes(int world, long long v) {
    size_t b = SHM_SLOT_DEFAULT, cap = ((size_t)48 << 20) / SHM_NBUF / (size_t)world;
    if (b > cap) b = cap;
    if (b < ((size_t)64 << 10)) b = (size_t)64 << 10;
    if (v) b = (size_t)v;
    return (b + 63) & ~(size_t)63;
}

/* The inner MPI communicator of c, with c's watchdog and schedule check:
 * the handshakes and windows run collectives on it, and a peer that went
 * another way must end there as it would on c, not wait without a limit. */
static struct fsdp_comm *inner(struct fsdp_comm *c) {
    struct fsdp_comm *m = ((struct shm_state *)c->state)->mpi;
    m->timeout_s = c->timeout_s;
    m->check = c->check;
    return m;
}

/* One size on every rank before a segment is made: ranks that differ
 * (another model or sharding on one of them) would map past the end of rank
 * 0's segment and die of SIGBUS at the first touch, or one would skip the
 * window the others make. FSDP_ERR_INVALID on every rank, naming both.
 * COLLECTIVE: yes (the inner communicator). */
static enum fsdp_status agree_size(struct fsdp_comm *c, size_t bytes, const char *what) {
    int64_t mine[2] = {(int64_t)bytes, -(int64_t)bytes}, least[2];
    FSDP_TRY(fsdp_comm_allreduce(inner(c), mine, least, 2, FSDP_I64, FSDP_MIN));
    if (least[0] != -least[1])
        return fsdp__err(c->ctx, FSDP_ERR_INVALID, "comm shm: the ranks ask for %s of different sizes (%lld bytes on "
                         "one, %lld on another; this rank %zu): do they build the same model with the same options?",
                         what, (long long)least[0], (long long)-least[1], bytes);
    return FSDP_OK;
}

/* A segment of `bytes` that every rank maps: rank 0 creates and reserves it
 * (posix_fallocate: a full /dev/shm fails here, not with a SIGBUS later)
 * under a fresh name, which it broadcasts over the inner MPI communicator;
 * every rank maps it. Every rank leaves with the same status (a failure
 * anywhere is combined with a MAX): FSDP_OK with *map and `name` set (the
 * caller unlinks it on rank 0 after a barrier, once every rank has done
 * what it must before peers look), or FSDP_ERR_IO with nothing left mapped
 * or named, the message set where `quiet` is 0. */
static enum fsdp_status shared_segment(struct fsdp_comm *c, size_t bytes, const char *what, int quiet,
                                       unsigned char **map, char name[SHM_NAME_MAX]) {
    struct fsdp_comm *m = inner(c);
    int32_t err = 0;
    *map = NULL;
    memset(name, 0, SHM_NAME_MAX);
    if (c->rank == 0) {
        static int counter;
        sweep_stale();
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        snprintf(name, SHM_NAME_MAX, "/" SHM_PREFIX "%d-%d-%ld", (int)getpid(), counter++, (long)ts.tv_nsec);
        int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
        int rc = fd < 0 ? errno : posix_fallocate(fd, 0, (off_t)bytes);
        if (rc != 0) {
            err = rc;
            if (!quiet)
                fsdp__err(c->ctx, FSDP_ERR_IO,
                          "comm shm: cannot create /dev/shm%s of %zu bytes for %s: %s (a container may need a "
                          "larger /dev/shm, e.g. docker --shm-size; or use --comm mpi)", name, bytes, what,
                          strerror(err));
            if (fd >= 0) { close(fd); shm_unlink(name); }
            name[0] = 0;
        } else {
            close(fd);
        }
    }
    FSDP_TRY(fsdp_comm_broadcast(m, name, SHM_NAME_MAX, FSDP_U8, 0));
    name[SHM_NAME_MAX - 1] = 0;
    if (!name[0]) {
        if (c->rank != 0 && !quiet) fsdp__err(c->ctx, FSDP_ERR_IO, "comm shm: rank 0 could not create the %s", what);
        return FSDP_ERR_IO;
    }
    int fd = shm_open(name, O_RDWR, 0600);
    if (fd >= 0) {
        void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) err = errno;
        else *map = p;
        close(fd);
    } else {
        err = errno;
    }
    if (err && !quiet)
        fsdp__err(c->ctx, FSDP_ERR_IO, "comm shm: rank %d cannot map /dev/shm%s (%zu bytes, %s): %s", c->rank,
                  name, bytes, what, strerror(err));
    int32_t any = err;
    FSDP_TRY(fsdp_comm_allreduce(m, &err, &any, 1, FSDP_I32, FSDP_MAX));
    if (any) {
        if (c->rank == 0) shm_unlink(name);
        if (*map) munmap(*map, bytes);
        *map = NULL;
        if (!err && !quiet) fsdp__err(c->ctx, FSDP_ERR_IO, "comm shm: another rank could not map the %s", what);
        return FSDP_ERR_IO;
    }
    return FSDP_OK;
}

/* The handshake: the segment (shared_segment), its header and every rank's
 * control block written, then a barrier, after which rank 0 unlinks it. */
static enum fsdp_status attach(struct fsdp_comm *c, struct shm_state *s) {
    char name[SHM_NAME_MAX];
    size_t ctl_off = 4096, data_off = (ctl_off + (size_t)c->size * sizeof(struct shm_ctl) + 4095) & ~(size_t)4095;
    s->map_bytes = data_off + (size_t)c->size * SHM_NBUF * s->slot;
    FSDP_TRY(agree_size(c, s->map_bytes, "the segment (FSDP_SHM_SLOT alike on every rank?)"));
    FSDP_TRY(shared_segment(c, s->map_bytes, "the segment", 0, &s->map, name));
    s->hdr = (struct shm_header *)s->map;
    s->ctl = (struct shm_ctl *)(s->map + ctl_off);
    s->data = s->map + data_off;
    if (c->rank == 0) {
        s->hdr->magic = SHM_MAGIC;
        s->hdr->world = (uint32_t)c->size;
        s->hdr->slot = s->slot;
    }
    s->ctl[c->rank].pid = (int32_t)getpid();
    s->probe = SHM_MAGIC ^ (uint64_t)getpid();
    s->ctl[c->rank].probe_addr = (uint64_t)(uintptr_t)&s->probe;
    /* posix_fallocate zeroed the counters; everyone has mapped and written its pid */
    enum fsdp_status st = fsdp_comm_barrier(inner(c));
    if (c->rank == 0) shm_unlink(name);
    if (st != FSDP_OK) return st;
    s->peer_pid = fsdp__calloc(c->ctx, (size_t)c->size * sizeof(int32_t), FSDP_MEM_OTHER, "shm peer pids");
    if (!s->peer_pid) return FSDP_ERR_NOMEM;
    for (int k = 0; k < c->size; k++) {
        int32_t pid = s->ctl[k].pid;
        s->peer_pid[k] = k != c->rank && fsdp__shm_pid_alive(pid) && kill((pid_t)pid, 0) == 0 ? pid : 0;
    }
    return fsdp__shm_probe_cma(c, s);
}

/* [Note: window size]
 * A window lies on tmpfs pages, 4 KiB each unless the kernel's shmem
 * transparent huge pages are on (/sys/kernel/mm/transparent_hugepage/
 * shmem_enabled: always, within_size or advise; the window is then
 * madvise'd), while private shards and full buffers get 2 MiB pages
 * (core.c, [Note: huge pages]). Measured on a 2-core VM with 4 KiB shmem
 * (bench/README.md, "The shared window"): ResNet-18 (45 MB of parameters)
 * at 2 ranks 10-20% faster a step with its window, GPT-2 124M (500 MB)
 * 15-30% slower at 2-4 ranks (the optimizer and the products over 4 KiB
 * pages cost more than the copies saved). So without huge pages shm offers windows up to
 * SHM_WINDOW_MAX_SMALL bytes; env FSDP_SHM_WINDOW sets the bound (bytes;
 * 0: no window), with huge pages there is none. */
size_t fsdp__shm_window_bound(struct fsdp_ctx *ctx, int *huge) {
    long long v;
    *huge = 0;
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/shmem_enabled", "r");
    char line[256] = "";
    if (f) {
        if (!fgets(line, sizeof line, f)) line[0] = 0;
        fclose(f);
    }
    *huge = strstr(line, "[always]") || strstr(line, "[within_size]") || strstr(line, "[advise]") ||
            strstr(line, "[force]");
    if (fsdp__env_int(ctx, "FSDP_SHM_WINDOW", -1, &v) != FSDP_OK || v < 0)
        return *huge ? SIZE_MAX : SHM_WINDOW_MAX_SMALL;
    return (size_t)v;
}

size_t fsdp__comm_shm_window_max(const struct fsdp_comm *c) {
    return !strcmp(c->backend, "shm") ? ((const struct shm_state *)c->state)->window_max : 0;
}

/* ops->window: a segment of its own (shared_segment), within the bound of
 * [Note: window size]; one /dev/shm too small for it leaves every rank
 * without (NULL), which FSDP_SHM_VERBOSE=1 makes rank 0 say. */
static enum fsdp_status shm_window(struct fsdp_comm *c, size_t bytes, void **base) {
    struct shm_state *s = c->state;
    char name[SHM_NAME_MAX];
    unsigned char *map;
    *base = NULL;
    FSDP_TRY(agree_size(c, bytes, "a shared window"));
    if (bytes > s->window_max) return FSDP_OK;
    enum fsdp_status st = shared_segment(c, bytes, "a shared window", 1, &map, name);
    if (st == FSDP_ERR_IO) {
        long long verbose = 0;
        if (fsdp__env_int(c->ctx, "FSDP_SHM_VERBOSE", 0, &verbose) != FSDP_OK) return FSDP_ERR_INVALID;
        if (c->rank == 0 && verbose)
            fprintf(stderr, "fsdp: shm: no shared window of %zu bytes (/dev/shm): the units gather by copy\n", bytes);
        return FSDP_OK;
    }
    if (st != FSDP_OK) return st;
#ifdef MADV_HUGEPAGE
    if (s->window_huge) (void)madvise(map, bytes, MADV_HUGEPAGE); /* a hint: refused is fine */
#endif
    st = fsdp_comm_barrier(inner(c)); /* every rank has it mapped */
    if (c->rank == 0) shm_unlink(name);
    if (st != FSDP_OK) {
        munmap(map, bytes);
        return st;
    }
    *base = map;
    return FSDP_OK;
}

static void shm_window_free(struct fsdp_comm *c, void *base, size_t bytes) {
    (void)c;
    munmap(base, bytes);
}

struct fsdp_comm *fsdp__comm_shm_mpi(struct fsdp_comm *c) { return ((struct shm_state *)c->state)->mpi; }

int fsdp__comm_shm_cma(const struct fsdp_comm *c) {
    FSDP_ASSERT(!strcmp(c->backend, "shm"), "not a shm communicator (%s)", c->backend);
    return ((const struct shm_state *)c->state)->cma;
}

enum fsdp_status fsdp__comm_shm_create(struct fsdp_ctx *ctx, struct fsdp_comm *mpi,
                                       struct fsdp_comm **out) {
    long long slot;
    size_t chunk;
    enum fsdp_status est = fsdp__env_int(ctx, "FSDP_SHM_SLOT", 0, &slot);
    if (est == FSDP_OK) est = fsdp__shm_chunk_bytes(ctx, &chunk);
    if (est != FSDP_OK) {
        fsdp__comm_free(mpi);
        return est;
    }
    struct fsdp_comm *c = fsdp__calloc(ctx, sizeof *c, FSDP_MEM_OTHER, "communicator");
    struct shm_state *s = fsdp__calloc(ctx, sizeof *s, FSDP_MEM_OTHER, "shm communicator state");
    if (!c || !s) {
        fsdp__free(ctx, c);
        fsdp__free(ctx, s);
        fsdp__comm_free(mpi);
        return FSDP_ERR_NOMEM;
    }
    c->ops = &shm_ops;
    c->ctx = ctx;
    c->backend = "shm";
    c->rank = mpi->rank;
    c->size = mpi->size;
    c->state = s;
    s->mpi = mpi;
    s->slot = slot_bytes(c->size, slot);
    s->xchunk = chunk;
    s->window_max = fsdp__shm_window_bound(ctx, &s->window_huge);
    /* from here shm_free undoes everything */
    s->acc = fsdp__alloc(ctx, s->slot, FSDP_MEM_OTHER, "shm fp32 accumulators");
    if (!s->acc) { shm_free(c); return FSDP_ERR_NOMEM; }
    enum fsdp_status st = attach(c, s);
    if (st != FSDP_OK) { shm_free(c); return st; }
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv_work, NULL);
    pthread_cond_init(&s->cv_done, NULL);
    if (pthread_create(&s->thread, NULL, progress_main, c) != 0) {
        pthread_mutex_destroy(&s->mu);
        pthread_cond_destroy(&s->cv_work);
        pthread_cond_destroy(&s->cv_done);
        /* the peers may have started theirs: end the job rather than hang it */
        fsdp__err(ctx, FSDP_ERR_NOMEM, "comm shm: rank %d cannot start its progress thread", c->rank);
        fprintf(stderr, "fsdp: %s\n", fsdp_errmsg(ctx));
        shm_abort(c, 1);
        shm_free(c);
        return FSDP_ERR_NOMEM;
    }
    s->thread_started = 1;
    *out = c;
    return FSDP_OK;
}
