/*
 * mpi_progress.c - the MPI backend's progress thread: one per process, it
 * drives the started requests of every MPI communicator with MPI_Test while
 * the compute threads compute ([Note: MPI progress thread]); mpi.c hands it
 * requests and waits on it (mpi-impl.h).
 */
#include "comm/mpi-impl.h"

#include <errno.h>
#include <sched.h>
#include <string.h>
#include <time.h>

#define PEER_SLICE_S 0.05 /* how often a sleeping wait looks */

/* [Note: MPI progress thread]
 * Open MPI advances a non-blocking collective only inside MPI calls (this
 * build has no asynchronous progress of its own), so a prefetched all-gather
 * used to move mostly at its wait. With MPI_THREAD_MULTIPLE, one thread per
 * process, shared by every MPI communicator of the backend, drives them. It
 * starts with the first request handed to it and is joined when the last
 * MPI communicator is freed, before MPI_Comm_free and MPI_Finalize.
 *   Ownership: a start hands its request to the thread (prog's list, in
 *     start order) as soon as MPI_I* returns; from then on only the thread
 *     calls MPI_Test on it, so no MPI_Request is ever tested by two threads.
 *     When MPI_Test reports completion, or fails, the thread records done
 *     and MPI's return code in the request, unlinks it and never touches it
 *     again. The wait sleeps on prog.done until `done`, then converts the
 *     low-precision staging and frees the request as before; a failed
 *     MPI_Test becomes FSDP_ERR_COMM with MPI's message there.
 *   Testing: the thread copies the handles of the PROG_BATCH oldest requests
 *     under prog.mu and tests the copies without it, so that waits and the
 *     bookkeeping of starts never queue behind MPI. Any MPI_Test runs Open
 *     MPI's whole progress engine, so requests past the batch advance too;
 *     they are tested once older ones have left.
 *   One MPI call at a time: every MPI call of the backend that communicates or
 *     changes MPI's state (all but MPI_Abort, the queries, MPI_Init_thread and
 *     MPI_Finalize, around which no thread runs) is made under mpi_mu, one
 *     call per hold, so a start waits at most for one MPI_Test of the thread.
 *     Unserialised, Open MPI hands its internal buffers from one thread to the
 *     other through lock-free lists that ThreadSanitizer cannot see (a
 *     fragment buffer emptied by a start and refilled by the thread was
 *     reported as a race); serialised, every hand-over is ordered by mpi_mu,
 *     so tests/tsan.sh checks our threads without reporting Open MPI's, and
 *     we lean less on Open MPI's multi-threaded paths. MPI_THREAD_MULTIPLE is
 *     still required: a program may call MPI itself next to the thread (the
 *     tests do). Blocking calls (MPI_Comm_split, the MPI_Wait of a request
 *     kept by the compute thread) hold mpi_mu throughout; they drive Open
 *     MPI's progress themselves, so the thread's requests advance meanwhile.
 *   Pace: with no request outstanding the thread sleeps on prog.work. With
 *     some, it polls: sched_yield() after each pass, which keeps Open MPI's
 *     pipelined transfers (fragments of tens of KiB) moving; after PROG_SPINS
 *     passes in a row without a completion it naps PROG_NAP_NS between passes,
 *     so that a collective waiting on a late peer costs an oversubscribed host
 *     (the suite runs 5 ranks on 2 cores) little. While a compute thread
 *     sleeps in a wait, its core is free: the thread does not nap then. Starts
 *     and waits wake it from a nap.
 *   Watchdog: a wait sleeps until t_start + c->timeout_s at most (prog.done
 *     runs on CLOCK_MONOTONIC, as fsdp__now does) and then fails as it always
 *     did. The request stays allocated and with the thread (MPI may still
 *     write its buffers; the job must end): the thread keeps testing it, and
 *     drops it without touching it when it stops.
 *   Pinned: FSDP_MPI_PROGRESS_CPU=N puts the thread on CPU N (and turns it
 *     on unless FSDP_MPI_PROGRESS=0), the core set aside for communication
 *     while the compute threads are bound elsewhere (`taskset`, the
 *     launcher's binding). The kernel's TCP copies and the veths' packet
 *     work run on the CPU of the thread that sends or receives, so pinned,
 *     transfers move beside the compute as a NIC's DMA would instead of
 *     taking its cores (bench/scaleout.sh's PIN=1). The thread is the
 *     process's: a communicator created with the variable pins it, running
 *     or when it starts. Should the kernel refuse the CPU (a cpuset without
 *     it), the thread runs unpinned.
 *   Off: with FSDP_MPI_PROGRESS=0 at a communicator's creation (its splits
 *     inherit the choice), by default when no core is free for the thread
 *     (mpi.c's progress_wanted), or an MPI below MPI_THREAD_MULTIPLE (a verbose
 *     context says so once), requests stay with the compute thread, which
 *     waits in MPI_Wait, or polls MPI_Test under the watchdog (mpi.c's wait_timed).
 *     Should the thread fail to start, a request stays there too. */enum { PROG_BATCH = 64, PROG_SPINS = 256 };
#define PROG_NAP_NS 50000L

pthread_mutex_t fsdp__mpi_mu = PTHREAD_MUTEX_INITIALIZER;

static struct {
    pthread_once_t once;
    pthread_mutex_t mu;
    pthread_cond_t work;         /* the thread sleeps here: idle, or a nap */
    pthread_cond_t done;         /* waits sleep here */
    pthread_t thread;
    int running, stop;
    int cpu;                     /* FSDP_MPI_PROGRESS_CPU, or -1 */
    int sleeping;                /* the thread is in a wait on work */
    int waiters;                 /* compute threads asleep on done */
    struct mpi_req *head, *tail; /* outstanding requests, oldest first */
} prog = {.once = PTHREAD_ONCE_INIT, .mu = PTHREAD_MUTEX_INITIALIZER, .cpu = -1};

static void prog_init(void) {
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(&prog.work, &a);
    pthread_cond_init(&prog.done, &a);
    pthread_condattr_destroy(&a);
}

/* Time t of fsdp__now (CLOCK_MONOTONIC seconds) as a deadline for prog's conds. */
static struct timespec mono_at(double t) {
    struct timespec ts;
    ts.tv_sec = (time_t)t;
    ts.tv_nsec = (long)((t - (double)ts.tv_sec) * 1e9);
    if (ts.tv_nsec > 999999999L) ts.tv_nsec = 999999999L;
    return ts;
}

/* Sleeps on prog.work (prog.mu held) until woken, or until *until if given. */
static void prog_sleep(const struct timespec *until) {
    prog.sleeping = 1;
    if (until) pthread_cond_timedwait(&prog.work, &prog.mu, until);
    else pthread_cond_wait(&prog.work, &prog.mu);
    prog.sleeping = 0;
}

/* Unlinks the requests marked done (prog.mu held). */
static void prog_unlink_done(void) {
    struct mpi_req **pp = &prog.head, *last = NULL;
    while (*pp) {
        if ((*pp)->done) {
            *pp = (*pp)->next;
        } else {
            last = *pp;
            pp = &last->next;
        }
    }
    prog.tail = last;
}

/* One pass: MPI_Test on copies of the oldest PROG_BATCH handles, with
 * prog.mu released meanwhile (held on entry and on return). A listed request
 * is not freed meanwhile: its wait frees it only once it is done, which only
 * this thread sets. Returns how many requests finished. */
static int prog_pass(void) {
    struct mpi_req *qs[PROG_BATCH];
    MPI_Request rs[PROG_BATCH];
    int flags[PROG_BATCH], rcs[PROG_BATCH], n = 0, finished = 0;
    for (struct mpi_req *q = prog.head; q && n < PROG_BATCH; q = q->next, n++) {
        qs[n] = q;
        rs[n] = q->r;
    }
    pthread_mutex_unlock(&prog.mu);
    for (int i = 0; i < n; i++) {
        flags[i] = 0;
        mpi_enter();
        rcs[i] = MPI_Test(&rs[i], &flags[i], MPI_STATUS_IGNORE);
        mpi_leave();
    }
    pthread_mutex_lock(&prog.mu);
    for (int i = 0; i < n; i++) {
        if (rcs[i] == MPI_SUCCESS && !flags[i]) continue;
        qs[i]->r = rs[i]; /* MPI_REQUEST_NULL once complete */
        qs[i]->rc = rcs[i];
        qs[i]->done = 1;
        finished++;
    }
    if (finished) {
        prog_unlink_done();
        pthread_cond_broadcast(&prog.done);
    }
    return finished;
}

static void *prog_main(void *arg) {
    (void)arg;
    unsigned idle = 0; /* passes in a row without a completion */
    pthread_mutex_lock(&prog.mu);
    while (!prog.stop) {
        if (!prog.head) {
            idle = 0;
            prog_sleep(NULL);
        } else if (prog_pass() > 0) {
            idle = 0;
        } else if (++idle < PROG_SPINS || prog.waiters > 0) {
            pthread_mutex_unlock(&prog.mu);
            sched_yield();
            pthread_mutex_lock(&prog.mu);
        } else {
            struct timespec nap = mono_at(fsdp__now() + 1e-9 * (double)PROG_NAP_NS);
            prog_sleep(&nap);
        }
    }
    pthread_mutex_unlock(&prog.mu);
    return NULL;
}

/* Puts the running thread on prog.cpu, if one is set (prog.mu held). */
static void prog_pin(void) {
    if (!prog.running || prog.cpu < 0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(prog.cpu, &set);
    pthread_setaffinity_np(prog.thread, sizeof set, &set); /* refused: runs unpinned */
}

void fsdp__mpi_prog_add(struct mpi_req *q) {
    pthread_once(&prog.once, prog_init);
    pthread_mutex_lock(&prog.mu);
    if (!prog.running && pthread_create(&prog.thread, NULL, prog_main, NULL) == 0) {
        prog.running = 1;
        prog_pin();
    }
    if (prog.running) {
        q->on_thread = 1;
        if (prog.tail) prog.tail->next = q;
        else prog.head = q;
        prog.tail = q;
        if (prog.sleeping) pthread_cond_signal(&prog.work);
    }
    pthread_mutex_unlock(&prog.mu);
}

void fsdp__mpi_prog_stop(void) {
    pthread_mutex_lock(&prog.mu);
    int running = prog.running;
    prog.stop = 1;
    if (running) pthread_cond_signal(&prog.work);
    pthread_mutex_unlock(&prog.mu);
    if (running) pthread_join(prog.thread, NULL);
    pthread_mutex_lock(&prog.mu);
    prog.running = prog.stop = 0;
    prog.head = prog.tail = NULL;
    pthread_mutex_unlock(&prog.mu);
}

int fsdp__mpi_prog_wait(struct fsdp_comm *c, struct mpi_req *q, int watched, int *timed_out) {
    struct timespec deadline = mono_at(q->t_start + c->timeout_s);
    *timed_out = 0;
    pthread_mutex_lock(&prog.mu);
    prog.waiters++;
    if (prog.sleeping) pthread_cond_signal(&prog.work); /* end its nap: this core is free now */
    char lost[8];
    while (!q->done && !*timed_out) {
        /* in slices of PEER_SLICE_S while the peer watch runs, to see a lost peer */
        double t = fsdp__now() + PEER_SLICE_S, end = q->t_start + c->timeout_s;
        struct timespec slice = mono_at(c->timeout_s > 0 && end < t ? end : t);
        if (c->timeout_s <= 0 && !watched) pthread_cond_wait(&prog.done, &prog.mu);
        else if (pthread_cond_timedwait(&prog.done, &prog.mu, watched ? &slice : &deadline) == ETIMEDOUT)
            *timed_out = !q->done && c->timeout_s > 0 && fsdp__now() >= end;
        if (!q->done && !*timed_out && fsdp__peers_lost(lost, sizeof lost)) *timed_out = 2; /* mpi_wait reports */
    }
    prog.waiters--;
    int rc = q->done ? q->rc : MPI_SUCCESS;
    pthread_mutex_unlock(&prog.mu);
    return rc;
}

void fsdp__mpi_prog_pin(int cpu) {
    pthread_once(&prog.once, prog_init);
    pthread_mutex_lock(&prog.mu);
    prog.cpu = cpu;
    prog_pin();
    pthread_mutex_unlock(&prog.mu);
}

int fsdp__comm_mpi_req_done(const struct fsdp_comm *c, const struct fsdp_comm_req *req) {
    FSDP_ASSERT(!strcmp(c->backend, "mpi"), "not an MPI communicator (%s)", c->backend);
    const struct mpi_req *q = (const struct mpi_req *)req;
    if (!q->on_thread) return 0;
    pthread_mutex_lock(&prog.mu);
    int done = q->done;
    pthread_mutex_unlock(&prog.mu);
    return done;
}
