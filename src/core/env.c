/*
 * env.c - the readers of the library's environment variables
 * ([Note: environment variables]).
 *
 * [Note: environment variables] The library's tuning and test switches
 * (FSDP_SHM_SLOT, FSDP_GEMM_BF16, FSDP_COLLECTIVE_TIMEOUT, ...; README.md
 * lists them all) are read through these helpers only. Unset or empty means
 * the default. Any other value must be what the variable takes, in full: a
 * whole number in its range, a number of seconds, or one of its words. A
 * value that is not stops the process (exit status 2; under MPI the whole
 * job, through the abort hook) with one line naming the variable, the value
 * and what it accepts. A silent fallback would run, say, a benchmark with
 * FSDP_SHM_SLOT=4M on the default slot and report it as the 4 MiB one.
 */
#include "core/core-impl.h"

#include <errno.h>
#include <math.h>
#include <string.h>

void fsdp__env_refuse(const char *name, const char *value, const char *fmt, ...) {
    char want[320], line[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(want, sizeof want, fmt, ap);
    va_end(ap);
    /* one write, so that the ranks' lines do not interleave; the rank is not
     * known yet when a communicator's own variables are read */
    snprintf(line, sizeof line, "fsdp: environment variable %s='%s': expected %s\n", name, value, want);
    fputs(line, stderr);
    fflush(stderr);
    if (fsdp__abort_hook) fsdp__abort_hook(2);
    exit(2);
}

long long fsdp__env_int(const char *name, long long def, long long lo, long long hi) {
    const char *e = getenv(name);
    if (!e || !*e) return def;
    char *end;
    errno = 0;
    long long v = strtoll(e, &end, 10);
    if (errno || *end || end == e || v < lo || v > hi)
        fsdp__env_refuse(name, e, "a whole number in [%lld, %lld]", lo, hi);
    return v;
}

double fsdp__env_real(const char *name, double def, double lo, double hi) {
    const char *e = getenv(name);
    if (!e || !*e) return def;
    char *end;
    errno = 0;
    double v = strtod(e, &end);
    if (errno || *end || end == e || !isfinite(v) || v < lo || v > hi)
        fsdp__env_refuse(name, e, "a number in [%g, %g]", lo, hi);
    return v;
}

int fsdp__env_word(const char *name, const char *const *words, int n, int def) {
    const char *e = getenv(name);
    if (!e || !*e) return def;
    for (int i = 0; i < n; i++)
        if (!strcmp(e, words[i])) return i;
    char list[256] = "";
    for (int i = 0; i < n; i++)
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", i ? ", " : "", words[i]);
    fsdp__env_refuse(name, e, "one of: %s", list);
}
