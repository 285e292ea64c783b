/*
 * comm-impl.h - internal API of src/comm: the communicator, its vtable of
 * collectives and the backends (MPI in mpi.c, shared memory between the ranks
 * of one host in shm.c, a world of one in self.c).
 * comm.c validates arguments, counts statistics and dispatches through the
 * vtable, so a backend sees only well-formed calls:
 *   - dtype and op are in range, root is in [0, size), buffers are non-NULL
 *     when count > 0, and count * size * dtype size does not overflow;
 *   - in-place calls arrive with send == NULL (see fsdp.h: allgather with
 *     send == recv + rank*count, allreduce with send == recv);
 *   - other overlaps between send and recv were rejected.
 * comm/ knows nothing of models: it moves and reduces typed arrays.
 */
#ifndef FSDP_COMM_IMPL_H
#define FSDP_COMM_IMPL_H

#include "core/core-impl.h"

/* A started collective. A backend embeds this as the first member of its
 * own request struct; ops->wait completes the request and frees it. */
struct fsdp_comm_req {
    enum fsdp_coll coll; /* for the wait-time statistics */
    /* FSDP_AVG ([Note: averaging reductions], comm.c): set by a backend that
     * scaled the sum by 1/size itself; else comm.c scales recv at the wait */
    int scaled;
    void *avg_recv;     /* comm.c: what the wait scales (NULL: nothing) */
    size_t avg_count;
    enum fsdp_dtype avg_dt;
};

struct fsdp_comm_ops {
    /* Each start stores a new request in *req (returned; ops->wait frees it). */
    enum fsdp_status (*allgather_start)(struct fsdp_comm *c, const void *send, void *recv,
                                        size_t count, enum fsdp_dtype dt,
                                        struct fsdp_comm_req **req);
    enum fsdp_status (*reduce_scatter_start)(struct fsdp_comm *c, const void *send, void *recv,
                                             size_t count, enum fsdp_dtype dt,
                                             enum fsdp_red_op op, struct fsdp_comm_req **req);
    enum fsdp_status (*allreduce_start)(struct fsdp_comm *c, const void *send, void *recv,
                                        size_t count, enum fsdp_dtype dt, enum fsdp_red_op op,
                                        struct fsdp_comm_req **req);
    enum fsdp_status (*broadcast_start)(struct fsdp_comm *c, void *buf, size_t count,
                                        enum fsdp_dtype dt, int root, struct fsdp_comm_req **req);
    enum fsdp_status (*barrier_start)(struct fsdp_comm *c, struct fsdp_comm_req **req);
    /* Completes req and frees it, also on failure. req is non-NULL. */
    enum fsdp_status (*wait)(struct fsdp_comm *c, struct fsdp_comm_req *req);
    /* Ends every rank of the job; may return if the backend cannot (caller exits). */
    void (*abort)(struct fsdp_comm *c, int code);
    /* Releases the backend state and the struct itself. COLLECTIVE: yes. */
    void (*free)(struct fsdp_comm *c);
    /* Optional (NULL: the backend has none): `bytes` of memory that every
     * rank maps, zero-filled, one copy for all ([Note: shared window] in
     * src/fsdp/unit.c): *base, or NULL where it could not be made (every rank
     * then gets NULL). COLLECTIVE: yes. window_free unmaps it (not collective). */
    enum fsdp_status (*window)(struct fsdp_comm *c, size_t bytes, void **base);
    void (*window_free)(struct fsdp_comm *c, void *base, size_t bytes);
    /* 1: the reduction starts take FSDP_AVG (and set req->scaled where they
     * fold the 1/size into the sum); 0: comm.c hands them FSDP_SUM. */
    int avg;
};

struct fsdp_comm {
    const struct fsdp_comm_ops *ops;
    struct fsdp_ctx *ctx;         /* borrowed: receives error messages, accounts memory */
    int rank, size;
    const char *backend;          /* static string: "mpi", "shm" or "self" */
    struct fsdp_comm_stats stats; /* counted by comm.c */
    void *state;                  /* the backend's own state */
    uint64_t seq;                 /* collectives started so far (comm.c): the number of
                                     the latest, for messages */
    double timeout_s;             /* watchdog: a wait longer than this fails (0: never);
                                     backends enforce it (fsdp_comm_set_timeout) */
    int check;                    /* schedule check on (fsdp_comm_set_check) */
    char tag[64];                 /* names the next collectives (fsdp_comm_set_tag) */
    int auto_shm;                 /* made by FSDP_COMM_AUTO across hosts (MPI): its splits
                                     whose ranks share one host use shm */
};

/* ---- Creation (comm.c) ---- */
/* Creates the communicator of `kind` (FSDP_COMM_AUTO: when launched by
 * mpirun, i.e. OMPI_COMM_WORLD_SIZE or PMIX_RANK is set, SHM if the world has
 * 2+ ranks all on one host, else MPI; without mpirun SELF). *out is returned
 * to the caller to free with fsdp__comm_free. COLLECTIVE: yes. */
enum fsdp_status fsdp__comm_create(struct fsdp_ctx *ctx, enum fsdp_comm_kind kind,
                                   struct fsdp_comm **out);
/* COLLECTIVE: yes (finalizes MPI if fsdp__comm_create initialised it). NULL is a no-op. */
void fsdp__comm_free(struct fsdp_comm *c);
/* Ends every rank of the job with `code` when the backend can (MPI_Abort);
 * returns otherwise, and the caller exits. */
void fsdp__comm_abort(struct fsdp_comm *c, int code);

/* A shared window of c (ops->window): *base NULL and FSDP_OK where the
 * backend has none, c is a world of one, or bytes is 0. COLLECTIVE: yes. */
enum fsdp_status fsdp__comm_window(struct fsdp_comm *c, size_t bytes, void **base);
/* Unmaps a window of c; base NULL is a no-op. */
void fsdp__comm_window_free(struct fsdp_comm *c, void *base, size_t bytes);

/* ---- Backends ---- */
#define FSDP_HOST_MAX 64
/* This process's hostname, NUL-padded to FSDP_HOST_MAX bytes (mpi.c). */
void fsdp__comm_hostname(char name[FSDP_HOST_MAX]);
enum fsdp_status fsdp__comm_self_create(struct fsdp_ctx *ctx, struct fsdp_comm **out);
/* The measuring communicator (measure.c): rank `rank` of `size` ranks that
 * do not exist; collectives move no data; like_mpi: reductions hold MPI's
 * staging bytes (ordered: MPI's rank-ordered reductions); window_max: it
 * makes shared windows up to that many bytes as shm does (reserved pages the
 * plan never touches; its MiB are kept, SIZE_MAX as no bound); each
 * request counts req_bytes (fsdp__comm_req_bytes of the backend planned for). */
enum fsdp_status fsdp__comm_measure_create(struct fsdp_ctx *ctx, int size, int rank, int like_mpi, int ordered,
                                           size_t window_max, size_t req_bytes, struct fsdp_comm **out);
/* A group of a measuring communicator c: `size` ranks, this one `rank`
 * (fsdp_comm_split cannot know the group's size without its peers). */
enum fsdp_status fsdp__comm_measure_group(struct fsdp_comm *c, int size, int rank, struct fsdp_comm **out);
enum fsdp_status fsdp__comm_mpi_create(struct fsdp_ctx *ctx, struct fsdp_comm **out);
/* Sets *local to the number of ranks of the MPI communicator c that share
 * this rank's host (mpi.c, [Note: hosts]: one Open MPI node and one
 * hostname). COLLECTIVE: yes. */
enum fsdp_status fsdp__comm_mpi_local_size(struct fsdp_comm *c, int *local);
/* MPI_Comm_split of the MPI communicator c: a new MPI communicator (any
 * size) returned to the caller. COLLECTIVE: yes (over c). */
enum fsdp_status fsdp__comm_mpi_split(struct fsdp_comm *c, int color, int key, struct fsdp_comm **out);
/* Whether the MPI communicator c sums its reductions in rank order (1,
 * mpi.c's [Note: ordered reductions], the default) or with Open MPI's own
 * collectives (0, FSDP_MPI_REDUCE=native at its creation). */
int fsdp__comm_mpi_ordered(const struct fsdp_comm *c);
/* Bytes an MPI communicator of `world` ranks allocates on rank `rank` from
 * the start of a reduce-scatter (count: elements per rank) or all-reduce of
 * dt to its wait: the fp32 staging of 16-bit reductions, or with ordered
 * reductions the contributions' buffer. The memory planner (src/fsdp/plan.c)
 * counts it so. */
size_t fsdp__comm_mpi_reduce_bytes(enum fsdp_coll coll, size_t count, enum fsdp_dtype dt, int world, int rank,
                                   int ordered);
/* Whether the MPI communicator c hands its requests to the progress thread
 * (mpi_progress.c, [Note: MPI progress thread]): 1 yes; 0 no, FSDP_MPI_PROGRESS=0 at
 * its creation; -1 no, MPI gives less than MPI_THREAD_MULTIPLE. */
int fsdp__comm_mpi_progress(const struct fsdp_comm *c);
/* Has the progress thread seen req, a request of the MPI communicator c not
 * yet waited, complete? A flag read with no MPI call, so it drives nothing
 * (tests observe overlap with it); 0 for a request the thread does not hold. */
int fsdp__comm_mpi_req_done(const struct fsdp_comm *c, const struct fsdp_comm_req *req);
/* "allgather #97 (4 bytes, tag ...), started 0.2 s ago, not completed": the
 * latest collective any MPI communicator of this process started (the peer
 * watch's message names it). */
void fsdp__comm_mpi_latest(char *buf, size_t n);
/* The single-copy level a shm communicator settled on at creation
 * (shm_cma.c, [Note: single copy]): 0 staged only, 1 reduce-scatters,
 * 2 all-gathers and broadcasts too. */
int fsdp__comm_shm_cma(const struct fsdp_comm *c);
/* The largest shared window a communicator c makes: shm's bound ([Note:
 * window size] in shm.c; env FSDP_SHM_WINDOW), 0 for other backends. */
size_t fsdp__comm_shm_window_max(const struct fsdp_comm *c);
/* The bound a shm communicator made now on this host would have; *huge:
 * its windows would lie on transparent huge pages. */
size_t fsdp__shm_window_bound(struct fsdp_ctx *ctx, int *huge);
/* The inner MPI communicator of a shm communicator (borrowed), for splitting. */
struct fsdp_comm *fsdp__comm_shm_mpi(struct fsdp_comm *c);
/* The shared-memory backend over the ranks of `mpi` (an MPI communicator
 * whose ranks all share one host), which it uses for the handshake and for
 * aborting the job. Takes ownership of mpi, also on failure. COLLECTIVE: yes. */
enum fsdp_status fsdp__comm_shm_create(struct fsdp_ctx *ctx, struct fsdp_comm *mpi,
                                       struct fsdp_comm **out);

/* ---- The peer watch across hosts (peers.c, [Note: peer watch]) ---- */
#define FSDP_PEER_ADDRS 8
/* What a rank tells the others at the start: exchanged by mpi.c as bytes. */
struct fsdp_peer_rec {
    char host[FSDP_HOST_MAX];         /* fsdp__comm_hostname */
    uint32_t addr[FSDP_PEER_ADDRS];   /* IPv4, network order; loopback last */
    uint16_t port;                    /* the watch's TCP port; 0: not watching */
    uint16_t n_addr;
};
/* Fills *mine, listening on a TCP port unless the watch runs already or
 * FSDP_PEER_WATCH=0 (then port 0). No socket, no watch: never an error. */
void fsdp__peers_listen(struct fsdp_peer_rec *mine);
/* Starts the watch's thread over the records of all `world` ranks (all
 * borrowed, copied) when some rank on another host listens, and returns 1;
 * else releases what fsdp__peers_listen made and returns 0. */
int fsdp__peers_start(int me, int world, const struct fsdp_peer_rec *all);
/* Says goodbye to every peer and stops (the last MPI communicator goes). */
void fsdp__peers_stop(void);
/* Tells every peer that this rank aborts the job (the abort hook). */
void fsdp__peers_abort(void);
/* 1 with "rank R on host H <what happened>" in buf once a peer is lost, else 0. */
int fsdp__peers_lost(char *buf, size_t n);
/* For the watchdog: the hosts gone silent and for how long, or that all
 * answer; "" when nothing is watched. */
void fsdp__peers_silence(char *buf, size_t n);

/* ---- Helpers shared by the backends (comm.c) ---- */
/* Allocates a zeroed request of `bytes` (>= sizeof(struct fsdp_comm_req)) for coll. */
void *fsdp__comm_req_alloc(struct fsdp_comm *c, size_t bytes, enum fsdp_coll coll);
void fsdp__comm_req_free(struct fsdp_comm *c, void *req);
/* The bytes of one request of c's backend (mpi.c, shm.c: their request
 * structs), for the measuring communicator to count as c would. */
size_t fsdp__comm_req_bytes(const struct fsdp_comm *c);
size_t fsdp__comm_mpi_req_bytes(void);
size_t fsdp__comm_shm_req_bytes(void);
/* The name of a collective ("allgather", ...), for messages. */
const char *fsdp__coll_name(enum fsdp_coll coll);
/* A request as the backends' failure messages name it, into buf (n bytes):
 * "allgather #5 (17 elements of I32, 68 bytes, tag T)"; returns buf. */
const char *fsdp__coll_what(enum fsdp_coll coll, uint64_t seq, size_t count, enum fsdp_dtype dt, const char *tag,
                            char *buf, size_t n);

/* ---- Reductions in rank order (shm.c, [Note: reduction order]); mpi.c's
 * ordered reductions use the same steps, so both backends give the same bits ---- */
/* dst = src (first) or dst op= src, n elements of dt (not BF16/F16). */
void fsdp__shm_reduce_into(void *dst, const void *src, size_t n, enum fsdp_dtype dt, enum fsdp_red_op op,
                           int first);
/* fp32 accumulation of a BF16/F16 contribution; tmp holds n floats. */
void fsdp__shm_reduce_low(float *acc, const void *src, size_t n, enum fsdp_dtype dt, enum fsdp_red_op op,
                          int first, float *tmp);

/* ---- 16-bit floats (half.c) ---- */
/* BF16 or F16: the dtypes that reduce in fp32 and round once. */
int fsdp__dtype_is_low(enum fsdp_dtype dt);
/* n values of dt (BF16 or F16) to fp32 and back (round to nearest even). */
void fsdp__low_to_f32(const void *src, float *dst, size_t n, enum fsdp_dtype dt);
void fsdp__f32_to_low(const float *src, void *dst, size_t n, enum fsdp_dtype dt);

#endif
