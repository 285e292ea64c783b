/*
 * peers.c - the peer watch: whether the ranks of the other hosts are alive
 * and reachable, over TCP connections of its own beside MPI's ([Note: peer
 * watch]). mpi.c starts it with the first MPI communicator of a job that
 * spans hosts, asks it in every wait (a lost peer fails the wait at once)
 * and when the watchdog fires (which hosts have gone silent), and stops it
 * with the last MPI communicator. This file makes no MPI call: mpi.c
 * exchanges the records of fsdp__peers_listen itself.
 * Invariant: one watch per process; only its thread touches the sockets
 * between start and stop; what it learns is read under W.mu. Its tables
 * live as long as the process's MPI, outside any context: they come from
 * malloc, not the accounted allocator (like MPI's own memory), so that the
 * memory plan's figures stay the library's.
 *
 * [Note: peer watch]
 * Open MPI does not fail a pending collective when a peer on another host
 * dies: its TCP transport prints "peer hung up" and the survivors sit in the
 * collective until mpirun, told by the dead ranks' daemon, kills them
 * (3-4 s on the simulated hosts, no word from the ranks themselves); and a
 * link that drops every packet looks like any slow collective until the
 * watchdog fires, which could not say whether a rank or the network stalled.
 * So every rank listens on a TCP port of its own, the ranks exchange
 * (hostname, port, IPv4 addresses) at the start, and each rank connects to
 * every rank of a higher number on another host (ranks of one host are the
 * shm backend's business: [Note: dead peers]). On every connection each side
 * sends a heartbeat byte every HEARTBEAT_S, 'b' before a normal close, 'a'
 * when it aborts the job. The watch's thread polls them:
 *   - end of stream or a reset without 'b' (the kernel closes a killed
 *     process's sockets at once), or a refused connection (its port is gone):
 *     the peer is lost. The thread prints one line naming its rank and host,
 *     and every MPI wait fails from then on with that message, so that each
 *     surviving rank ends with its own error naming the host and the
 *     collective within a poll interval (mpi.c).
 *   - 'a': the peer aborted the job (its own error says why); also lost,
 *     and said so, so that the survivors do not blame a healthy host.
 *   - silence: a host none of whose ranks has sent anything for a while. Not
 *     an error by itself (a stopped rank is the watchdog's case too); the
 *     watchdog's message names the silent hosts and for how long, which
 *     tells a dead or stalled link from a stalled rank.
 * Connections that cannot be made (no route: a multi-homed host whose first
 * addresses are private) leave that peer unwatched; the watch is a
 * diagnosis, never a reason to fail. FSDP_PEER_WATCH=0 turns it off.
 */
#include "comm/comm-impl.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define HEARTBEAT_S 0.2   /* a byte to every peer this often */
#define CONNECT_S 5.0     /* per address */
#define SILENT_S 1.0      /* a host quiet this long is named by the watchdog */

enum { P_NONE, P_CONNECTING, P_HELLO, P_UP, P_GONE, P_UNWATCHED };

struct peer {
    int state;
    int fd;
    int addr_i;        /* the address being tried (P_CONNECTING) */
    double since;      /* connect start */
    double heard;      /* last byte from it (fsdp__now) */
    int bye;           /* it said goodbye */
};

static struct {
    pthread_mutex_t mu;
    pthread_t th;
    int running;
    _Atomic int stop;
    int stopping;                  /* finishing: ends of connections are no losses */
    _Atomic int lost;              /* 1 + the first lost rank, or 0 */
    char lost_msg[320];
    int lfd;                       /* the listening socket, or -1 */
    int me, world;
    struct fsdp_peer_rec *recs;    /* (world) */
    struct peer *p;                /* (world) */
    int *pending;                  /* (world) accepted fds awaiting their hello, or -1 */
    unsigned char (*hello)[4];     /* (world) their hello bytes so far */
    int *hello_n;
    double started;
} W = {.mu = PTHREAD_MUTEX_INITIALIZER, .lfd = -1};

static int nonblock(int fd) {
    int fl = fcntl(fd, F_GETFL);
    return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

/* ---- Before the exchange ---- */

void fsdp__peers_listen(struct fsdp_peer_rec *mine) {
    memset(mine, 0, sizeof *mine);
    fsdp__comm_hostname(mine->host);
    if (W.running || W.lfd >= 0 || !fsdp__env_checked("FSDP_PEER_WATCH", 1)) return;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return; /* unwatched */
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_ANY), .sin_port = 0};
    socklen_t len = sizeof a;
    if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || listen(fd, 128) != 0 ||
        getsockname(fd, (struct sockaddr *)&a, &len) != 0 || nonblock(fd) != 0) {
        close(fd);
        return;
    }
    W.lfd = fd;
    mine->port = ntohs(a.sin_port);
    /* the host's IPv4 addresses, loopback last (reachable only from this host) */
    struct ifaddrs *ifs = NULL, *i;
    if (getifaddrs(&ifs) == 0) {
        for (int pass = 0; pass < 2; pass++)
            for (i = ifs; i && mine->n_addr < FSDP_PEER_ADDRS; i = i->ifa_next) {
                if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || !(i->ifa_flags & IFF_UP)) continue;
                if (!!(i->ifa_flags & IFF_LOOPBACK) != pass) continue;
                mine->addr[mine->n_addr++] = ((struct sockaddr_in *)i->ifa_addr)->sin_addr.s_addr;
            }
        freeifaddrs(ifs);
    }
    if (!mine->n_addr) { close(fd); W.lfd = -1; mine->port = 0; }
}

/* ---- The thread ---- */

static const char *host_of(int r) { return W.recs[r].host; }

/* Records the first lost peer (W.mu held) and says so once on stderr. */
static void lose(int r, const char *why) {
    struct peer *q = &W.p[r];
    if (q->fd >= 0) close(q->fd);
    q->fd = -1;
    q->state = P_GONE;
    if (atomic_load(&W.lost) || W.stopping) return;
    snprintf(W.lost_msg, sizeof W.lost_msg, "rank %d on host %.*s %s", r, FSDP_HOST_MAX, host_of(r), why);
    atomic_store(&W.lost, r + 1);
    char coll[200];
    fsdp__comm_mpi_latest(coll, sizeof coll);
    fprintf(stderr, "fsdp: rank %d (host %.*s): peer watch: %s; this rank's latest collective: %s\n", W.me,
            FSDP_HOST_MAX, host_of(W.me), W.lost_msg, coll);
    fflush(stderr);
}

static void start_connect(int r) {
    struct peer *q = &W.p[r];
    for (; q->addr_i < W.recs[r].n_addr; q->addr_i++) {
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0 || nonblock(fd) != 0) {
            if (fd >= 0) close(fd);
            break;
        }
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(W.recs[r].port)};
        a.sin_addr.s_addr = W.recs[r].addr[q->addr_i];
        if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0 || errno == EINPROGRESS) {
            q->fd = fd;
            q->state = P_CONNECTING;
            q->since = fsdp__now();
            return;
        }
        int e = errno;
        close(fd);
        if (e == ECONNREFUSED) { lose(r, "refused the peer watch's connection (its process is gone)"); return; }
    }
    q->state = P_UNWATCHED;
}

/* A failed send is not a loss: the read that follows tells a goodbye from a death. */
static void send_byte(int r, char b) {
    struct peer *q = &W.p[r];
    if (q->state == P_UP) (void)!send(q->fd, &b, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
}

/* An accepted connection sent its 4-byte hello: the rank it comes from. */
static void hello_read(int slot) {
    int fd = W.pending[slot];
    ssize_t n = recv(fd, W.hello[slot] + W.hello_n[slot], 4 - (size_t)W.hello_n[slot], MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        close(fd);
        W.pending[slot] = -1;
        return;
    }
    if (n < 0) return;
    W.hello_n[slot] += (int)n;
    if (W.hello_n[slot] < 4) return;
    unsigned char *h = W.hello[slot];
    uint32_t r = (uint32_t)h[0] << 24 | (uint32_t)h[1] << 16 | (uint32_t)h[2] << 8 | h[3];
    W.pending[slot] = -1;
    if (r >= (uint32_t)W.world || W.p[r].state != P_HELLO) { close(fd); return; }
    W.p[r].fd = fd;
    W.p[r].state = P_UP;
    W.p[r].heard = fsdp__now();
}

static void peer_read(int r) {
    struct peer *q = &W.p[r];
    char buf[256];
    for (;;) {
        ssize_t n = recv(q->fd, buf, sizeof buf, MSG_DONTWAIT);
        if (n > 0) {
            q->heard = fsdp__now();
            for (ssize_t k = 0; k < n; k++) {
                if (buf[k] == 'b') q->bye = 1;
                if (buf[k] == 'a') { lose(r, "aborted the job (its own message says why)"); return; }
            }
            continue;
        }
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
        if (q->bye) { /* a normal end */
            close(q->fd);
            q->fd = -1;
            q->state = P_NONE;
        } else {
            lose(r, "closed its connection to this rank without a goodbye (its process ended or was killed)");
        }
        return;
    }
}

static void *watch_main(void *arg) {
    (void)arg;
    int W_ = W.world;
    struct pollfd *pf = fsdp__malloc(((size_t)W_ * 2 + 1) * sizeof *pf);
    int *who = fsdp__malloc(((size_t)W_ * 2 + 1) * sizeof *who); /* >= 0 peer, -1 listener, -2 - slot pending */
    if (!pf || !who) { free(pf); free(who); return NULL; }
    double next_beat = 0;
    pthread_mutex_lock(&W.mu);
    while (!atomic_load(&W.stop)) {
        double t = fsdp__now();
        int n = 0;
        pf[n] = (struct pollfd){.fd = W.lfd, .events = POLLIN};
        who[n++] = -1;
        for (int r = 0; r < W_; r++) {
            struct peer *q = &W.p[r];
            if (q->state == P_CONNECTING && t - q->since > CONNECT_S) {
                close(q->fd);
                q->fd = -1;
                q->addr_i++;
                start_connect(r);
            }
            if (q->state == P_CONNECTING || q->state == P_UP) {
                pf[n] = (struct pollfd){.fd = q->fd, .events = q->state == P_CONNECTING ? POLLOUT : POLLIN};
                who[n++] = r;
            }
            if (W.pending[r] >= 0) {
                pf[n] = (struct pollfd){.fd = W.pending[r], .events = POLLIN};
                who[n++] = -2 - r;
            }
        }
        if (t >= next_beat) {
            for (int r = 0; r < W_; r++) send_byte(r, 'h');
            next_beat = t + HEARTBEAT_S;
        }
        pthread_mutex_unlock(&W.mu);
        int k = poll(pf, (nfds_t)n, 50);
        pthread_mutex_lock(&W.mu);
        if (k <= 0) continue;
        for (int i = 0; i < n; i++) {
            if (!pf[i].revents) continue;
            int r = who[i];
            if (r == -1) {
                int fd = accept4(W.lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
                int slot = -1;
                for (int s = 0; fd >= 0 && s < W_ && slot < 0; s++)
                    if (W.pending[s] < 0) slot = s;
                if (slot < 0) { if (fd >= 0) close(fd); continue; }
                W.pending[slot] = fd;
                W.hello_n[slot] = 0;
            } else if (r <= -2) {
                hello_read(-2 - r);
            } else if (W.p[r].state == P_CONNECTING) {
                int err = 0;
                socklen_t len = sizeof err;
                getsockopt(W.p[r].fd, SOL_SOCKET, SO_ERROR, &err, &len);
                if (err == 0) {
                    unsigned char h[4] = {(unsigned char)(W.me >> 24), (unsigned char)(W.me >> 16),
                                          (unsigned char)(W.me >> 8), (unsigned char)W.me};
                    if (send(W.p[r].fd, h, 4, MSG_NOSIGNAL | MSG_DONTWAIT) == 4) {
                        W.p[r].state = P_UP;
                        W.p[r].heard = fsdp__now();
                        continue;
                    }
                    err = errno;
                }
                close(W.p[r].fd);
                W.p[r].fd = -1;
                if (err == ECONNREFUSED) lose(r, "refused the peer watch's connection (its process is gone)");
                else { W.p[r].addr_i++; start_connect(r); }
            } else if (W.p[r].state == P_UP) {
                peer_read(r);
            }
        }
    }
    pthread_mutex_unlock(&W.mu);
    free(pf);
    free(who);
    return NULL;
}

/* ---- Life ---- */

/* Closes fd after reading what it holds: a socket closed with unread data
 * resets the connection, which could reach the peer before our goodbye. */
static void drain_close(int fd) {
    char buf[256];
    shutdown(fd, SHUT_WR);
    while (recv(fd, buf, sizeof buf, MSG_DONTWAIT) > 0) {}
    close(fd);
}

static void release(void) {
    for (int r = 0; W.p && r < W.world; r++)
        if (W.p[r].fd >= 0) drain_close(W.p[r].fd);
    for (int r = 0; W.pending && r < W.world; r++)
        if (W.pending[r] >= 0) close(W.pending[r]);
    if (W.lfd >= 0) close(W.lfd);
    W.lfd = -1;
    free(W.recs);
    free(W.p);
    free(W.pending);
    free(W.hello);
    free(W.hello_n);
    W.recs = NULL;
    W.p = NULL;
    W.pending = NULL;
    W.hello = NULL;
    W.hello_n = NULL;
}

int fsdp__peers_start(int me, int world, const struct fsdp_peer_rec *all) {
    if (W.running || W.lfd < 0) return W.running;
    int other = 0;
    for (int r = 0; r < world; r++)
        other |= all[r].port && memcmp(all[r].host, all[me].host, FSDP_HOST_MAX) != 0;
    W.recs = fsdp__malloc((size_t)world * sizeof *W.recs);
    W.p = fsdp__zalloc((size_t)world, sizeof *W.p);
    W.pending = fsdp__malloc((size_t)world * sizeof *W.pending);
    W.hello = fsdp__zalloc((size_t)world, sizeof *W.hello);
    W.hello_n = fsdp__zalloc((size_t)world, sizeof *W.hello_n);
    W.world = world;
    for (int r = 0; r < world; r++) { /* no socket yet: release() closes only what is >= 0 */
        if (W.p) W.p[r].fd = -1;
        if (W.pending) W.pending[r] = -1;
    }
    if (!other || !W.recs || !W.p || !W.pending || !W.hello || !W.hello_n) { release(); return 0; }
    memcpy(W.recs, all, (size_t)world * sizeof *W.recs);
    W.me = me;
    W.started = fsdp__now();
    atomic_store(&W.lost, 0);
    atomic_store(&W.stop, 0);
    for (int r = 0; r < world; r++) {
        int remote = all[r].port && r != me && memcmp(all[r].host, all[me].host, FSDP_HOST_MAX) != 0;
        W.p[r].state = !remote ? P_NONE : r > me ? P_CONNECTING : P_HELLO;
        W.p[r].heard = W.started;
        if (remote && r > me) start_connect(r);
    }
    if (pthread_create(&W.th, NULL, watch_main, NULL) != 0) { release(); return 0; }
    W.running = 1;
    return 1;
}

/* Sends `b` to every connected peer, then stops the thread and closes. */
static void finish(char b) {
    if (!W.running) { release(); return; }
    pthread_mutex_lock(&W.mu);
    W.stopping = b == 'b';
    for (int r = 0; r < W.world; r++) send_byte(r, b);
    atomic_store(&W.stop, 1);
    pthread_mutex_unlock(&W.mu);
    pthread_join(W.th, NULL);
    W.running = 0;
    release();
}

void fsdp__peers_stop(void) { finish('b'); }

void fsdp__peers_abort(void) {
    if (!W.running) return;
    /* no join: the thread may hold W.mu in a long poll pass no more than 50 ms,
     * and the process is about to end */
    pthread_mutex_lock(&W.mu);
    for (int r = 0; r < W.world; r++) send_byte(r, 'a');
    pthread_mutex_unlock(&W.mu);
}

int fsdp__peers_lost(char *buf, size_t n) {
    if (!atomic_load(&W.lost)) return 0;
    pthread_mutex_lock(&W.mu);
    snprintf(buf, n, "%s", W.lost_msg);
    pthread_mutex_unlock(&W.mu);
    return 1;
}

void fsdp__peers_silence(char *buf, size_t n) {
    buf[0] = 0;
    if (!W.running || n == 0) return;
    pthread_mutex_lock(&W.mu);
    double t = fsdp__now();
    size_t len = 0;
    int watched = 0;
    for (int r = 0; r < W.world && len + 1 < n; r++) {
        if (W.p[r].state != P_UP) continue;
        watched++;
        int first = 1; /* one entry per host, at its first watched rank */
        for (int j = 0; j < r && first; j++)
            first = !(W.p[j].state == P_UP && !memcmp(W.recs[j].host, W.recs[r].host, FSDP_HOST_MAX));
        if (!first) continue;
        double last = 0;
        int lo = -1, hi = -1;
        for (int j = r; j < W.world; j++) {
            if (W.p[j].state != P_UP || memcmp(W.recs[j].host, W.recs[r].host, FSDP_HOST_MAX)) continue;
            if (W.p[j].heard > last) last = W.p[j].heard;
            if (lo < 0) lo = j;
            hi = j;
        }
        if (t - last < SILENT_S) continue;
        char ranks[32];
        if (hi > lo) snprintf(ranks, sizeof ranks, "ranks %d-%d", lo, hi);
        else snprintf(ranks, sizeof ranks, "rank %d", lo);
        int k = snprintf(buf + len, n - len, "%sno word from host %.*s (%s) for %.1f s", len ? "; " : "",
                         FSDP_HOST_MAX, W.recs[r].host, ranks, t - last);
        if (k > 0) len += (size_t)k < n - len ? (size_t)k : n - len - 1;
    }
    if (watched && !len)
        snprintf(buf, n, "every other host's ranks answer the peer watch (a stalled rank, not the network)");
    else if (len && len + 1 < n)
        snprintf(buf + len, n - len, " (a dead or stalled link, or a stalled host)");
    pthread_mutex_unlock(&W.mu);
}
