/*
 * launch.c - how fsdp-train's ranks come to be and stop with their
 * launcher: --nproc N without mpirun re-runs the program under mpirun
 * (relaunch), and a rank started by mpirun watches for mpirun's death and
 * stops at once ([Note: launcher watch]). Part of fsdp-train
 * (tools/fsdp-train.c runs the job; task.h declares these).
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "task.h"

/* --nproc N without mpirun: re-run this program under mpirun. */
_Noreturn void relaunch(int argc, char **argv, int nproc) {
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) usage_error("--nproc: cannot find this program's path");
    exe[n] = 0;
    char np[16];
    snprintf(np, sizeof np, "%d", nproc);
    char **args = calloc((size_t)argc + 16, sizeof *args);
    int k = 0;
    args[k++] = "mpirun";
    args[k++] = "-np";
    args[k++] = np;
    args[k++] = "--oversubscribe";
    args[k++] = "--bind-to";
    args[k++] = "none";
    args[k++] = exe;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--nproc")) { i++; continue; }
        args[k++] = argv[i];
    }
    args[k] = NULL;
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 0);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 0);
    /* single-copy via ptrace is often denied in containers */
    setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", 0);
    /* mpirun gives ranks a pty: pass on whether our stdout is a terminal */
    setenv("FSDP_TRAIN_TTY", isatty(STDOUT_FILENO) ? "1" : "0", 1);
    fflush(NULL);
    execvp("mpirun", args);
    fprintf(stderr, "fsdp-train: --nproc %d: cannot run mpirun: %s (install openmpi-bin)\n", nproc,
            strerror(errno));
    exit(1);
}

/* ---- The launcher's death ([Note: launcher watch]) ----
 * A rank started by mpirun (directly, or by mpirun's daemon on another host)
 * is its child. When mpirun is killed with SIGKILL, it cannot tell the ranks,
 * which went on training, and saving checkpoints, until Open MPI noticed about
 * two seconds later. A rank therefore records its parent at start and stops
 * as soon as it is reparented: a thread polls getppid every 20 ms (for a rank
 * busy in a long step or blocked in a collective), and the main loop checks
 * before every step and every save, so a rank never starts either after the
 * launcher is gone; it exits with status 1. Started alone (no launcher), a
 * rank watches nothing. A watched rank ignores SIGPIPE from the start: its
 * stdout and stderr are pipes to the launcher, so a step line printed in the
 * 20 ms before the poll sees the launcher gone would otherwise kill the rank
 * with SIGPIPE instead of letting it stop by this check (the write fails with
 * EPIPE; the check runs before the next step). */
static pid_t g_launcher; /* 0 = not watched */

void launcher_check(void) {
    if (!g_launcher || getppid() == g_launcher) return;
    const char *r = getenv("OMPI_COMM_WORLD_RANK");
    fprintf(stderr, "fsdp-train: rank %s: the launcher (pid %ld) is gone; stopping\n", r ? r : "?",
            (long)g_launcher);
    fflush(NULL); /* the --log lines written so far */
    _exit(1);
}

static void *launcher_watch(void *arg) {
    (void)arg;
    for (;;) {
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
        launcher_check();
    }
    return NULL;
}

void launcher_watch_start(void) {
    g_launcher = getppid();
    signal(SIGPIPE, SIG_IGN);
    pthread_t th;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&th, &at, launcher_watch, NULL) != 0) { /* the loop's checks remain */ }
    pthread_attr_destroy(&at);
    launcher_check();
}
