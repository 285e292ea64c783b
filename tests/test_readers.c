/*
 * test_readers.c - the fuzz corpus as a regression test: every file in
 * fuzz/corpus/<target>/ (seeds and every fuzzer finding, kept there) is
 * replayed through the very code the libFuzzer targets run (fuzz/fuzz_*.c,
 * included with FUZZ_NO_MAIN). A crash, a sanitizer report (under
 * `make asan`) or a broken invariant fails the test; files named ok-* must
 * be accepted and bad-* rejected with a message. The readers of the
 * library's environment variables (core/env.c) take their values in full or
 * stop the process naming the variable.
 */
#define FUZZ_NO_MAIN
#include "../fuzz/fuzz_config.c"
#include "../fuzz/fuzz_data.c"
#include "../fuzz/fuzz_safetensors.c"
#include "../fuzz/fuzz_ckpt_meta.c"
#include "../fuzz/fuzz_bpe.c"

#include <dirent.h>

#include "harness.h"

typedef enum fsdp_status (*reader_fn)(const uint8_t *data, size_t size);

/* Replays every file of fuzz/corpus/<target>; returns how many it read. */
static int replay(const char *target, reader_fn fn) {
    char dir[512];
    const char *root = getenv("FUZZ_CORPUS");
    snprintf(dir, sizeof dir, "%s/%s", root ? root : "fuzz/corpus", target);
    DIR *dp = opendir(dir);
    if (!dp) {
        TEST_FAILF("cannot open corpus directory '%s' (run from the repository root)", dir);
        return 0;
    }
    int n = 0;
    struct dirent *e;
    while ((e = readdir(dp))) {
        if (e->d_name[0] == '.') continue;
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        FILE *f = fopen(path, "rb");
        if (!f) { TEST_FAILF("cannot open '%s'", path); continue; }
        fseek(f, 0, SEEK_END);
        long len = ftell(f);
        fseek(f, 0, SEEK_SET);
        uint8_t *buf = malloc((size_t)len + 1);
        size_t got = fread(buf, 1, (size_t)len, f);
        fclose(f);
        enum fsdp_status st = fn(buf, got);
        free(buf);
        if (!strncmp(e->d_name, "ok-", 3) && st != FSDP_OK)
            TEST_FAILF("%s: expected to be accepted, got %s", path, fsdp_status_str(st));
        if (!strncmp(e->d_name, "bad-", 4) && st == FSDP_OK)
            TEST_FAILF("%s: expected to be rejected, was accepted", path);
        n++;
    }
    closedir(dp);
    return n;
}

TEST(corpus_data) { CHECK(replay("data", fuzz_data_one) >= 10); }

TEST(corpus_config) { CHECK(replay("config", fuzz_config_one) >= 10); }

TEST(corpus_safetensors) { CHECK(replay("safetensors", fuzz_safetensors_one) >= 10); }

TEST(corpus_ckpt_meta) { CHECK(replay("ckpt_meta", fuzz_ckpt_meta_one) >= 10); }

TEST(corpus_bpe) { CHECK(replay("bpe", fuzz_bpe_one) >= 10); }

/* The from-memory entries give the same messages as the file readers. */
TEST(mem_entries_name_the_input) {
    struct fsdp_ctx *ctx;
    ASSERT_OK(fsdp__ctx_alloc(&ctx), NULL);
    struct fsdp_data *d = NULL;
    const uint8_t odd[3] = {1, 0, 2};
    CHECK_INT_EQ(fsdp__data_open_mem(ctx, "x.bin", odd, 3, 256, &d), FSDP_ERR_FORMAT);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "'x.bin': raw uint16 token file has an odd size (3 bytes)");
    CHECK(d == NULL);
    struct fsdp_gpt_config cfg;
    const char *js = "{\"n_layer\":2,\"n_head\":3,\"n_embd\":32,\"vocab_size\":256,\"block_size\":64}";
    CHECK_INT_EQ(fsdp__gpt_config_parse(ctx, "m.json", js, strlen(js), &cfg), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "model config 'm.json': GPT config: n_embd 32 is not divisible by n_head 3");
    /* not NUL-terminated: only len bytes are read */
    const char *two = "{\"n_layer\":2,\"n_head\":2,\"n_embd\":32,\"vocab_size\":256,\"block_size\":64}garbage";
    ASSERT_OK(fsdp__gpt_config_parse(ctx, "m.json", two, strlen(two) - 7, &cfg), ctx);
    CHECK_INT_EQ(cfg.n_embd, 32);
    fsdp__ctx_release(ctx);
}

/* Runs fn in a child with NAME=value; returns its exit status (-1 if it
 * did not exit) and the first line it wrote to stderr in err. */
static int env_child(const char *name, const char *value, void (*fn)(const char *), char *err, size_t cap) {
    int fd[2];
    if (pipe(fd) != 0) return -1;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fd[1], 2);
        close(fd[0]);
        setenv(name, value, 1);
        fn(name);
        _exit(0);
    }
    close(fd[1]);
    ssize_t n = read(fd[0], err, cap - 1);
    err[n > 0 ? n : 0] = 0;
    close(fd[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static void env_bytes(const char *name) { (void)fsdp__env_int(name, 0, 4096, (long long)1 << 30); }
static void env_seconds(const char *name) { (void)fsdp__env_real(name, -1, 0, 1e9); }
static void env_mode(const char *name) {
    static const char *const modes[] = {"auto", "widen"};
    (void)fsdp__env_word(name, modes, 2, 0);
}

TEST(env_values_taken_in_full_or_refused) {
    const char *v = "FSDP_TEST_VALUE";
    unsetenv(v);
    CHECK_INT_EQ(fsdp__env_int(v, 7, 0, 9), 7);
    setenv(v, "", 1);
    CHECK_INT_EQ(fsdp__env_int(v, 7, 0, 9), 7); /* empty is unset */
    setenv(v, "4096", 1);
    CHECK_INT_EQ(fsdp__env_int(v, 0, 4096, (long long)1 << 30), 4096);
    setenv(v, "2.5", 1);
    CHECK(fsdp__env_real(v, -1, 0, 1e9) == 2.5);
    setenv(v, "widen", 1);
    static const char *const modes[] = {"auto", "widen"};
    CHECK_INT_EQ(fsdp__env_word(v, modes, 2, 0), 1);
    struct { void (*fn)(const char *); const char *value, *msg; } bad[] = {
        {env_bytes, "4M", "FSDP_TEST_VALUE='4M': expected a whole number in [4096, 1073741824]"},
        {env_bytes, "4095", "'4095': expected a whole number in [4096, 1073741824]"},
        {env_bytes, "99999999999999999999", "expected a whole number"},
        {env_bytes, "1e4", "expected a whole number"},
        {env_bytes, "65536k", "FSDP_TEST_VALUE='65536k': expected a whole number"},
        {env_seconds, "soon", "FSDP_TEST_VALUE='soon': expected a number in [0, 1e+09]"},
        {env_seconds, "-1", "expected a number in [0, 1e+09]"},
        {env_seconds, "nan", "expected a number"},
        {env_seconds, "30s", "FSDP_TEST_VALUE='30s': expected a number"},
        {env_mode, "fast", "FSDP_TEST_VALUE='fast': expected one of: auto, widen"},
        {env_mode, "Widen", "expected one of: auto, widen"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char err[512];
        int rc = env_child(v, bad[i].value, bad[i].fn, err, sizeof err);
        if (rc != 2) TEST_FAILF("%s='%s': exit %d, expected 2", v, bad[i].value, rc);
        CHECK_STR_CONTAINS(err, bad[i].msg);
    }
}

TEST_MAIN()
