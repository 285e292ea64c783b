/*
 * fault.c - fault injection for the reliability tests ([Note: fault
 * injection]): a rank kills or stops itself at a named point of the library,
 * so that tests can end a rank at a precise place (in a unit's forward, in
 * its backward, inside a reduce-scatter, inside a checkpoint save) instead of
 * racing a `kill` from outside. Costs one branch per point when unset.
 * Invariant: called from the compute thread only (not thread-safe).
 *
 * [Note: fault injection]
 * FSDP_FAULT=POINT:RANK:STEP[:ACTION]
 *   POINT  forward (a unit's pre-forward hook), backward (its pre-backward
 *          hook), reduce-scatter (after the start, before the wait), ckpt-save
 *          (the checkpoint writer's crash points, see fsdp__ckpt_crash_point),
 *          ckpt-remove (fsdp_ckpt_remove, its rank files gone, meta.json not),
 *          ckpt-commit (rank 0's swap of a save's complete folder into place)
 *   RANK   the global rank that faults
 *   STEP   fires at the first hit of POINT once this process has started its
 *          STEP-th training step (fsdp_model_train_step calls, from 1; 0 = at
 *          once), so ckpt-save:1:4 hits the save that follows step 4
 *   ACTION kill (SIGKILL, the default: the process vanishes as in an OOM kill),
 *          stop (SIGSTOP: a stalled rank, for the watchdog) or fail (the
 *          point's operation fails as a full disk or an I/O error would make
 *          it; only where the caller takes an error: ckpt-commit)
 * The rank prints one line naming the point before it raises the signal.
 * The checkpoint writer's crash points (fsdp__ckpt_crash_point, io/) are this
 * mechanism's ckpt-save point; their FSDP_CKPT_CRASH_AT=k (the k-th crash
 * point ends the process with _exit(86)) stays for the crash-safety tests.
 */
#include "core/core-impl.h"

#include <signal.h>
#include <string.h>

long fsdp__fault_step;

static const char *const points[] = {"forward", "backward", "reduce-scatter", "ckpt-save", "ckpt-remove",
                                     "ckpt-commit"};
#define FAIL_SIG (-1) /* ACTION fail: no signal, fsdp__fault_point returns 1 */

static struct {
    int parsed, on, fired;
    char point[32];
    int rank, sig;
    long step;
} F;

/* FSDP_FAULT's value into *f; 1 if it is well formed. */
static int parse_spec(const char *e, char point[32], int *rank, long *step, int *sig) {
    char action[16] = "kill";
    int n = sscanf(e, "%31[^:]:%d:%ld:%15s", point, rank, step, action);
    int known = 0;
    for (size_t i = 0; n >= 1 && i < sizeof points / sizeof *points; i++) known |= !strcmp(point, points[i]);
    *sig = !strcmp(action, "kill") ? SIGKILL : !strcmp(action, "stop") ? SIGSTOP : 0;
    if (!strcmp(action, "fail") && !strcmp(point, "ckpt-commit")) *sig = FAIL_SIG;
    return n >= 3 && known && *sig && *rank >= 0 && *step >= 0;
}

int fsdp__fault_spec_ok(const char *value) {
    char point[32];
    int rank, sig;
    long step;
    return parse_spec(value, point, &rank, &step, &sig);
}

static void parse(void) {
    F.parsed = 1;
    if (!fsdp__env_checked("FSDP_FAULT", 0)) return; /* unset (a malformed value asserts) */
    F.on = parse_spec(getenv("FSDP_FAULT"), F.point, &F.rank, &F.step, &F.sig);
}

int fsdp__fault_point(const char *point, const char *where) {
    if (!F.parsed) parse();
    if (!F.on || F.fired || fsdp__measuring || fsdp__global_rank != F.rank || fsdp__fault_step < F.step ||
        strcmp(point, F.point) != 0)
        return 0;
    F.fired = 1;
    fprintf(stderr, "fsdp: FSDP_FAULT: rank %d %s at %s (step %ld%s%s)\n", fsdp__global_rank,
            F.sig == SIGKILL ? "raises SIGKILL" : F.sig == SIGSTOP ? "raises SIGSTOP" : "fails", point,
            fsdp__fault_step, where ? ", " : "", where ? where : "");
    fflush(NULL);
    if (F.sig == FAIL_SIG) return 1;
    raise(F.sig);
    return 0;
}
