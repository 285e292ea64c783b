/*
 * mpi-impl.h - what the MPI backend's two files share: mpi.c (communicators,
 * collectives, ordered reductions, MPI's life in the process) and
 * mpi_progress.c (the progress thread, [Note: MPI progress thread]).
 */
#ifndef FSDP_COMM_MPI_IMPL_H
#define FSDP_COMM_MPI_IMPL_H

#include "comm/comm-impl.h"

#include <mpi.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

struct mpi_state {
    MPI_Comm comm; /* dup of MPI_COMM_WORLD, errors return */
    int progress;  /* starts hand requests to the progress thread */
    int ordered;   /* reductions sum in rank order ([Note: ordered reductions]) */
};

/* A request of the MPI backend ([Note: low-precision reductions] and
 * [Note: ordered reductions] in mpi.c). */
struct mpi_req {
    struct fsdp_comm_req base;
    MPI_Request r;
    float *stage_in;     /* fp32 inputs of a low-precision reduction, else NULL */
    float *stage_out;    /* (n_out) fp32 results, converted into recv at wait */
    void *recv;
    size_t n_out;
    enum fsdp_dtype dt;
    uint64_t seq;        /* for the watchdog's message */
    size_t count;
    enum fsdp_dtype count_dt;
    double t_start;
    char tag[64];        /* c->tag at the start */
    /* the progress thread's (mpi_progress.c), under its mutex */
    int on_thread;       /* handed to the thread: only it tests r */
    int done;            /* the thread saw r complete, or fail */
    int rc;              /* MPI's return code then */
    struct mpi_req *next;
    /* an ordered reduction ([Note: ordered reductions]) */
    int ord;             /* ORD_*: what the wait does when r completes */
    void *gather;        /* (W, blk) elements of dt: the contributions, by rank */
    int *counts;         /* (2, W) the all-reduce's block sizes and offsets (elements) */
    enum fsdp_red_op op;
};

/* One MPI call at a time ([Note: MPI progress thread]): every MPI call of
 * the backend that communicates or changes MPI's state is made between
 * mpi_enter and mpi_leave. */
extern pthread_mutex_t fsdp__mpi_mu;
static inline void mpi_enter(void) { pthread_mutex_lock(&fsdp__mpi_mu); }
static inline void mpi_leave(void) { pthread_mutex_unlock(&fsdp__mpi_mu); }

/* ---- The progress thread (mpi_progress.c) ---- */

/* Hands q, just started, to the thread, starting it if it is not running;
 * if it cannot start, q stays with the compute thread (q->on_thread 0). */
void fsdp__mpi_prog_add(struct mpi_req *q);
/* Stops and joins the thread: the last MPI communicator is being freed.
 * Requests still listed (abandoned by a watchdog timeout) are dropped,
 * allocated and untouched. */
void fsdp__mpi_prog_stop(void);
/* Puts the thread on CPU cpu (FSDP_MPI_PROGRESS_CPU): now if it runs, else
 * when it starts. */
void fsdp__mpi_prog_pin(int cpu);
/* The wait of a request on the thread: sleeps until the thread has seen it
 * finish, or past the watchdog's deadline (*timed_out = 1, the request
 * stays listed), or, while the peer watch runs (watched), until it has lost
 * a peer (2). Returns MPI's code from the thread's MPI_Test. */
int fsdp__mpi_prog_wait(struct fsdp_comm *c, struct mpi_req *q, int watched, int *timed_out);

#endif
