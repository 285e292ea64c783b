/*
 * shm-impl.h - internal to the shared-memory backend: the segment's layout,
 * the per-communicator state and requests (shm.c), and what the single-copy
 * collectives (shm_cma.c) share with the staged ones. The notes live in
 * shm.c ([Note: rounds], [Note: reduction order], [Note: progress and
 * waiting], [Note: dead peers]) and shm_cma.c ([Note: single copy]).
 */
#ifndef FSDP_SHM_IMPL_H
#define FSDP_SHM_IMPL_H

#include "comm/comm-impl.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#define SHM_NBUF 2
#define SHM_SLOT_DEFAULT ((size_t)1 << 20) /* env FSDP_SHM_SLOT overrides (bytes); 1 MiB
                                              chunks stay in a core's L2 between the owner's
                                              copy in and the readers' copy out, and beat
                                              4 MiB ones at 16-64 MiB (bench/README.md) */
#define SHM_CHUNK_DEFAULT ((size_t)256 << 10)   /* reduce-scatter chunk of a single-copy collective */
#define SHM_CMA_MIN_DEFAULT ((size_t)64 << 10)  /* single copy from blocks of this many bytes */
#define SHM_NT_MIN ((size_t)4 << 20)           /* streaming stores for blocks of this many bytes */
#define SHM_WINDOW_MAX_SMALL ((size_t)256 << 20) /* shared windows on 4 KiB pages up to this
                                                    ([Note: window size] in shm.c) */
#define SHM_MAGIC 0x46534d31u              /* "FSM1" */
#define SHM_PREFIX "fsdp-shm-"
#define SHM_NAME_MAX 64

struct shm_header {
    uint32_t magic, world;
    uint64_t slot;
    _Atomic uint32_t aborted; /* 1 + the rank that aborted the job, or 0 */
};

/* What a rank runs ([Note: collective ids] in shm.c): written by its owner
 * before the counter that publishes it, read by the peers after it. */
struct shm_coll_id {
    _Alignas(64) _Atomic uint64_t req; /* the request's number on this communicator (1-based; 0: being written) */
    _Atomic uint64_t count;
    _Atomic uint64_t desc; /* type | dtype << 8 | op << 16 | root << 32 */
    char tag[40];          /* for the message only */
};

struct shm_ctl {
    _Atomic uint32_t posted;   /* rounds whose contribution this rank has put in its slot */
    _Atomic uint32_t posted_waiters;
    char pad0[56];
    _Atomic uint32_t consumed; /* rounds this rank has finished reading */
    _Atomic uint32_t consumed_waiters;
    char pad1[56];
    int32_t pid;
    int32_t pad2a;
    uint64_t probe_addr;       /* address of this rank's probe word (single-copy check) */
    char pad2[48];
    /* single-copy collectives (see [Note: single copy]) */
    _Atomic uint32_t xposted;  /* single-copy collectives whose buffer this rank has published */
    _Atomic uint32_t xposted_waiters;
    _Atomic uint64_t xaddr;    /* ... at this address of its address space */
    char pad3[48];
    _Atomic uint32_t xdone;    /* single-copy collectives this rank has finished reading */
    _Atomic uint32_t xdone_waiters;
    char pad4[56];
    struct shm_coll_id rid[SHM_NBUF]; /* the collective of this rank's round in each buffer */
    struct shm_coll_id xid;           /* ... of its published single-copy buffer */
    struct shm_coll_id cur;           /* ... it runs now */
};

struct shm_req {
    struct fsdp_comm_req base;
    struct shm_req *next;
    const void *send; /* NULL: in place */
    void *recv;
    size_t count;
    enum fsdp_dtype dt;
    enum fsdp_red_op op; /* FSDP_AVG arrives as FSDP_SUM with scale 1/size */
    float scale;      /* the fp32 cross-memory reduce-scatter's last addition: (a + b) * scale */
    int root;
    uint64_t seq;     /* 1-based number of this collective on this communicator */
    uint64_t req;     /* 1-based number of this request (the schedule check's exchanges count) */
    double t_start;   /* when it was started (the watchdog's clock) */
    char tag[64];     /* c->tag at the start */
    int done;         /* under mu */
    enum fsdp_status st;
    char err[512];
};

struct shm_state {
    struct fsdp_comm *mpi; /* inner: handshake and abort */
    unsigned char *map;
    size_t map_bytes;
    struct shm_header *hdr;
    struct shm_ctl *ctl;
    unsigned char *data;
    size_t slot;
    float *acc;            /* (2, slot / 8) fp32: accumulators and a conversion
                              buffer for BF16/F16 reductions (slot bytes) */
    uint32_t round;        /* progress thread only */
    uint64_t nreq;         /* requests started (the compute thread's) */
    pthread_t thread;
    int thread_started;
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_done;
    struct shm_req *head, *tail; /* under mu */
    int stop;                    /* under mu */
    int failed;                  /* progress thread: a peer died or aborted */
    int32_t *peer_pid;           /* (world) pids to watch; 0 where not visible from here
                                    (another PID namespace): never declared dead */
    char fail_msg[512];          /* progress thread: why */
    /* single copy (see [Note: single copy]) */
    int cma;                     /* every rank can process_vm_readv every other, and uses it
                                    for: 0 nothing, 1 reduce-scatters, 2 also all-gathers
                                    and broadcasts (env FSDP_SHM_CMA, default 1) */
    size_t cma_min;              /* bytes per rank's block from which it is used */
    size_t xchunk;               /* reduce-scatter chunk (bytes of xtmp) */
    unsigned char *xtmp;         /* (xchunk) a peer's chunk, L2-resident, to reduce from */
    uint64_t *xpeer;             /* (world) the peers' published addresses */
    uint32_t xop;                /* single-copy collectives so far (progress thread) */
    uint64_t probe;              /* SHM_MAGIC ^ pid, read by the peers at creation */
    size_t window_max;           /* shared windows offered up to this many bytes (shm_window) */
    int window_huge;             /* ... on transparent huge pages (the kernel's shmem THP allows it) */
};

/* ---- Shared by the staged and the single-copy collectives (shm.c) ---- */

/* Stores v into *w and wakes its futex sleepers (release). */
void fsdp__shm_store_wake(_Atomic uint32_t *w, _Atomic uint32_t *waiters, uint32_t v);
/* 0 if process pid is gone (or a zombie); pids not visible here count as alive. */
int fsdp__shm_pid_alive(int32_t pid);
/* q as the failure messages name it (fsdp__coll_what), into buf; returns buf. */
const char *fsdp__shm_req_what(const struct shm_req *q, char *buf, size_t n);
/* Fail the progress thread (returns -1) naming a dead peer / an aborted job. */
int fsdp__shm_fail_dead(struct shm_state *s, struct fsdp_comm *c, int peer, const struct shm_req *q);
int fsdp__shm_fail_aborted(struct shm_state *s, struct fsdp_comm *c, uint32_t ab, int peer,
                           const struct shm_req *q);
/* [Note: collective ids]: publishes q in id; compares rank peer's id with q
 * (0, or -1 naming both with the failure recorded); `now`: the peer's
 * current one, compared only where it is the same request. */
void fsdp__shm_id_set(struct shm_coll_id *id, const struct shm_req *q);
int fsdp__shm_id_check(struct shm_state *s, struct fsdp_comm *c, struct shm_coll_id *w, int peer,
                       const struct shm_req *q, int now);
/* Waits until *w >= target (mod 2^32) set by rank peer: spin, then futex; the
 * watchdog and dead-peer checks apply. 0, or -1 with the failure recorded. */
int fsdp__shm_wait_ge(struct shm_state *s, struct fsdp_comm *c, _Atomic uint32_t *w, _Atomic uint32_t *waiters,
                      uint32_t target, int peer, const struct shm_req *q);
/* n bytes into the user's buffer, streaming stores when `total` is large. */
void fsdp__shm_copy_out(void *dst, const void *src, size_t n, size_t total);
/* Whether q runs as the fp32 reduce-scatter over cross-memory reads
 * (reduce_scatter_f32_cma, shm_cma.c): the one path that folds FSDP_AVG's
 * 1/size into its last addition. The enqueue (which tells comm.c the sum
 * comes scaled) and the dispatch both ask here. */
int fsdp__shm_rs_f32_cma(const struct shm_state *s, const struct shm_req *q);
/* dst = (a + b) [* scale] (fp32), streaming stores with nt ([Note: reduction order]). */
void fsdp__shm_add_f32(float *dst, const float *a, const float *b, size_t n, int nt, float scale);
/* fsdp__shm_reduce_into and fsdp__shm_reduce_low: comm-impl.h (mpi.c's ordered reductions use them too) */

/* ---- Single copy (shm_cma.c) ---- */

/* The collectives of [Note: single copy]: 0, or -1 with s->fail_msg set. */
int fsdp__shm_allgather_cma(struct shm_state *s, struct fsdp_comm *c, struct shm_req *q);
int fsdp__shm_reduce_scatter_cma(struct shm_state *s, struct fsdp_comm *c, struct shm_req *q);
int fsdp__shm_broadcast_cma(struct shm_state *s, struct fsdp_comm *c, struct shm_req *q);
/* Decides single copy for every rank alike at creation (s->cma, s->cma_min,
 * s->xpeer, s->xtmp). COLLECTIVE: yes (over the inner MPI communicator). */
enum fsdp_status fsdp__shm_probe_cma(struct fsdp_comm *c, struct shm_state *s);
/* The reduce-scatter chunk (bytes); FSDP_SHM_CHUNK overrides. */
enum fsdp_status fsdp__shm_chunk_bytes(struct fsdp_ctx *ctx, size_t *out);

#endif
