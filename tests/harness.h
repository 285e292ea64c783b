/*
 * harness.h - the tiny test harness. Tests are functions registered with
 * TEST(name); main() comes from TEST_MAIN(). Each test runs in a child
 * process with a timeout (a broken collective hangs instead of crashing),
 * except under mpirun (OMPI_COMM_WORLD_SIZE set), where tests run in-process
 * and tests/run.sh's timeout guards the job. Asserts print both sides.
 * Output: "ok NAME" / "FAIL NAME" lines, then "N passed, N failed".
 * A test may call SKIP("why") to be counted as skipped.
 * Argument: a test name (substring) runs only the matching tests.
 */
#ifndef FSDP_TEST_HARNESS_H
#define FSDP_TEST_HARNESS_H

#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

typedef void (*test_fn)(void);
struct test_case { const char *name; test_fn fn; };
#define TEST_MAX 256
static struct test_case test_cases[TEST_MAX];
static int test_count;
static int test_failed_flag;
static int test_rank;
#define TEST_SKIP_CODE 77

#define TEST(name)                                                             \
    static void test_##name(void);                                             \
    __attribute__((constructor)) static void test_register_##name(void) {      \
        if (test_count < TEST_MAX) test_cases[test_count++] = (struct test_case){#name, test_##name}; \
    }                                                                          \
    static void test_##name(void)

#define TEST_FAILF(...)                                                        \
    do {                                                                       \
        fprintf(stderr, "  rank %d: %s:%d: ", test_rank, __FILE__, __LINE__);  \
        fprintf(stderr, __VA_ARGS__);                                          \
        fprintf(stderr, "\n");                                                 \
        test_failed_flag = 1;                                                  \
    } while (0)

/* Non-fatal checks record the failure and go on; ASSERT_* variants return. */
#define CHECK(c) do { if (!(c)) TEST_FAILF("check failed: %s", #c); } while (0)
#define ASSERT(c) do { if (!(c)) { TEST_FAILF("assert failed: %s", #c); return; } } while (0)
#define CHECK_INT_EQ(a, b) do { long long a_ = (long long)(a), b_ = (long long)(b); \
    if (a_ != b_) TEST_FAILF("%s == %s: %lld != %lld", #a, #b, a_, b_); } while (0)
#define ASSERT_INT_EQ(a, b) do { long long a_ = (long long)(a), b_ = (long long)(b); \
    if (a_ != b_) { TEST_FAILF("%s == %s: %lld != %lld", #a, #b, a_, b_); return; } } while (0)
#define CHECK_STR_EQ(a, b) do { const char *a_ = (a), *b_ = (b); \
    if (strcmp(a_, b_) != 0) TEST_FAILF("%s == %s: \"%s\" != \"%s\"", #a, #b, a_, b_); } while (0)
#define CHECK_STR_CONTAINS(hay, needle) do { const char *h_ = (hay), *n_ = (needle); \
    if (!h_ || !strstr(h_, n_)) TEST_FAILF("%s contains \"%s\": got \"%s\"", #hay, n_, h_ ? h_ : "(null)"); } while (0)
/* |a-b| <= atol + rtol*|b|, and both finite */
#define CHECK_NEAR(a, b, rtol, atol) do { double a_ = (double)(a), b_ = (double)(b); \
    if (!isfinite(a_) || !isfinite(b_) || fabs(a_ - b_) > (atol) + (rtol) * fabs(b_)) \
        TEST_FAILF("%s ~= %s: %.9g vs %.9g (diff %.3g, rtol %g, atol %g)", #a, #b, a_, b_, \
                   fabs(a_ - b_), (double)(rtol), (double)(atol)); } while (0)
#define CHECK_OK(expr, ctx) do { enum fsdp_status s_ = (expr); if (s_ != FSDP_OK) \
    TEST_FAILF("%s: %s: %s", #expr, fsdp_status_str(s_), fsdp_errmsg(ctx)); } while (0)
#define ASSERT_OK(expr, ctx) do { enum fsdp_status s_ = (expr); if (s_ != FSDP_OK) { \
    TEST_FAILF("%s: %s: %s", #expr, fsdp_status_str(s_), fsdp_errmsg(ctx)); return; } } while (0)
#define SKIP(why) do { fprintf(stderr, "  skipped: %s\n", why); fflush(NULL); \
    if (test_in_child) { _exit(TEST_SKIP_CODE); } \
    test_skipped_flag = 1; return; } while (0)

/* max |got[i] - ref[i]| over n elements, or INFINITY if any of them is not
 * finite (fmax would drop a NaN, and a NaN difference would pass any
 * tolerance); *ref_max (if not NULL) gets max |ref[i]|. */
static inline double max_abs_diff(const float *got, const float *ref, int64_t n, double *ref_max) {
    double md = 0, mx = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - (double)ref[i]), r = fabs((double)ref[i]);
        if (!isfinite(d) || !isfinite(r)) md = INFINITY;
        else if (d > md) md = d;
        if (r > mx) mx = r;
    }
    if (ref_max) *ref_max = mx;
    return md;
}

static int test_in_child;
static int test_skipped_flag;

/* What SKIP does, as a function (SKIP's `if` and the statement after it on
 * one line trip -Wmisleading-indentation in some callers); the caller returns. */
static inline void test_skip(const char *why) {
    fprintf(stderr, "  skipped: %s\n", why);
    fflush(NULL);
    if (test_in_child) _exit(TEST_SKIP_CODE);
    test_skipped_flag = 1;
}

/* Finds tests/<name> (a reference script) from the working directory or,
 * failing that, up to three folders above the test binary (build/tests/x ->
 * the repository root); 1 with its path in out, else 0. */
static inline int test_find_file(const char *name, char *out, size_t cap) {
    struct stat st;
    snprintf(out, cap, "tests/%s", name);
    if (stat(out, &st) == 0) return 1;
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) return 0;
    exe[n] = '\0';
    for (int up = 0; up < 3; up++) {
        char *slash = strrchr(exe, '/');
        if (!slash) return 0;
        *slash = '\0';
        snprintf(out, cap, "%s/tests/%s", exe, name);
        if (stat(out, &st) == 0) return 1;
    }
    return 0;
}

/* A reference script's path, tests/<name>, in script: 1 where
 * /usr/bin/python3 imports `modules` (a comma-separated list) and the
 * script is found; else the test is skipped saying which (test_skip) and 0:
 * the caller returns. */
static inline int test_python_ref(const char *modules, const char *name, char *script, size_t cap) {
    char cmd[256], why[256];
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 -c 'import %s' >/dev/null 2>&1", modules);
    if (system(cmd) != 0) {
        snprintf(why, sizeof why, "/usr/bin/python3 cannot import %s", modules);
        test_skip(why);
        return 0;
    }
    if (!test_find_file(name, script, cap)) {
        snprintf(why, sizeof why, "tests/%s not found", name);
        test_skip(why);
        return 0;
    }
    return 1;
}

/* Runs /usr/bin/python3 script dir: on success dir is removed; else the
 * test fails naming the command and its status, and dir is kept. */
static inline void test_run_python_ref(const char *script, const char *dir) {
    char cmd[8600];
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 '%s' '%s'", script, dir);
    fflush(NULL);
    int rc = system(cmd);
    if (rc != 0) TEST_FAILF("%s exited with status %d (data kept in %s)", cmd, rc, dir);
    else {
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        CHECK(system(cmd) == 0);
    }
}

/* Writes bytes to dir/name; 1 on success. */
static inline int test_write_file(const char *dir, const char *name, const void *data, size_t bytes) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) return 0;
    size_t w = fwrite(data, 1, bytes, f);
    return (fclose(f) == 0) & (w == bytes);
}
/* Under mpirun: combines a per-rank flag across ranks (max); an MPI test file
 * sets it (e.g. to an MPI_Allreduce) so that every rank agrees on the result. */
static int (*test_combine)(int flag);

/* The timeout for one test in seconds (env TEST_TIMEOUT, default 120). */
static int test_timeout(void) {
    const char *e = getenv("TEST_TIMEOUT");
    return e ? atoi(e) : 120;
}

static int test_main(int argc, char **argv) {
    const char *filter = argc > 1 ? argv[1] : NULL;
    int under_mpi = getenv("OMPI_COMM_WORLD_SIZE") != NULL;
    if (getenv("OMPI_COMM_WORLD_RANK")) test_rank = atoi(getenv("OMPI_COMM_WORLD_RANK"));
    int passed = 0, failed = 0, skipped = 0;
    for (int i = 0; i < test_count; i++) {
        struct test_case *t = &test_cases[i];
        if (filter && !strstr(t->name, filter)) continue;
        int result; /* 0 ok, 1 fail, 2 skip */
        if (under_mpi) {
            test_failed_flag = 0;
            test_skipped_flag = 0;
            t->fn();
            int f = test_failed_flag, sk = test_skipped_flag;
            if (test_combine) { f = test_combine(f); sk = test_combine(sk); }
            result = f ? 1 : sk ? 2 : 0;
        } else {
            fflush(NULL);
            pid_t pid = fork();
            if (pid == 0) {
                test_in_child = 1;
                alarm((unsigned)test_timeout());
                t->fn();
                fflush(NULL);
                _exit(test_failed_flag ? 1 : 0);
            }
            int status = 0;
            waitpid(pid, &status, 0);
            if (WIFEXITED(status) && WEXITSTATUS(status) == 0) result = 0;
            else if (WIFEXITED(status) && WEXITSTATUS(status) == TEST_SKIP_CODE) result = 2;
            else {
                result = 1;
                if (WIFSIGNALED(status))
                    fprintf(stderr, "  %s: killed by signal %d%s\n", t->name, WTERMSIG(status),
                            WTERMSIG(status) == SIGALRM ? " (timeout)" : "");
            }
        }
        if (test_rank == 0)
            printf("%s %s\n", result == 0 ? "ok" : result == 1 ? "FAIL" : "skip", t->name);
        fflush(stdout);
        if (result == 0) passed++;
        else if (result == 1) failed++;
        else skipped++;
    }
    if (test_rank == 0) printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
    return failed ? 1 : 0;
}

#define TEST_MAIN() int main(int argc, char **argv) { return test_main(argc, argv); }

#endif
