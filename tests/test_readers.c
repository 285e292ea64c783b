/*
 * test_readers.c - the fuzz corpus as a regression test: every file in
 * fuzz/corpus/<target>/ (seeds and every fuzzer finding, kept there) is
 * replayed through the very code the libFuzzer targets run (fuzz/fuzz_*.c,
 * included with FUZZ_NO_MAIN). A crash, a sanitizer report (under
 * `make asan`) or a broken invariant fails the test; files named ok-* must
 * be accepted and bad-* rejected with a message. The readers of the
 * library's environment variables (core/env.c) take their values in full or
 * refuse them naming the variable.
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

/* The library's environment variables ([Note: environment variables]):
 * unset or empty is the default, a value is taken in full or refused with
 * FSDP_ERR_INVALID naming the variable, the value and what it takes, by
 * the reader, by fsdp_env_check and by fsdp_ctx_create; nothing exits. */
TEST(env_values_taken_in_full_or_refused) {
    struct fsdp_ctx *ctx;
    ASSERT(fsdp__ctx_alloc(&ctx) == FSDP_OK);
    long long iv = 0;
    double rv = 0;
    int wv = 0;
    unsetenv("FSDP_SHM_SLOT");
    CHECK_OK(fsdp__env_int(ctx, "FSDP_SHM_SLOT", 7, &iv), ctx);
    CHECK_INT_EQ(iv, 7);
    setenv("FSDP_SHM_SLOT", "", 1);
    CHECK_OK(fsdp__env_int(ctx, "FSDP_SHM_SLOT", 7, &iv), ctx); /* empty is unset */
    CHECK_INT_EQ(iv, 7);
    setenv("FSDP_SHM_SLOT", "4096", 1);
    CHECK_OK(fsdp__env_int(ctx, "FSDP_SHM_SLOT", 0, &iv), ctx);
    CHECK_INT_EQ(iv, 4096);
    unsetenv("FSDP_SHM_SLOT");
    const char *was = getenv("FSDP_COLLECTIVE_TIMEOUT");
    char *saved = was ? strdup(was) : NULL;
    setenv("FSDP_COLLECTIVE_TIMEOUT", "2.5", 1);
    CHECK_OK(fsdp__env_real(ctx, "FSDP_COLLECTIVE_TIMEOUT", -1, &rv), ctx);
    CHECK(rv == 2.5);
    if (saved) setenv("FSDP_COLLECTIVE_TIMEOUT", saved, 1);
    else unsetenv("FSDP_COLLECTIVE_TIMEOUT");
    free(saved);
    setenv("FSDP_GEMM_BF16", "widen", 1);
    CHECK_OK(fsdp__env_word(ctx, "FSDP_GEMM_BF16", 0, &wv), ctx);
    CHECK_INT_EQ(wv, 1);
    unsetenv("FSDP_GEMM_BF16");
    char msg[768];
    CHECK_INT_EQ(fsdp_env_check(msg, sizeof msg), FSDP_OK); /* the suite's own settings are valid */
    struct { const char *name, *value, *msg; } bad[] = {
        {"FSDP_SHM_SLOT", "4M", "environment variable FSDP_SHM_SLOT='4M': expected a whole number in [4096, 1073741824]"},
        {"FSDP_SHM_SLOT", "4095", "'4095': expected a whole number in [4096, 1073741824]"},
        {"FSDP_SHM_SLOT", "99999999999999999999", "expected a whole number"},
        {"FSDP_SHM_SLOT", "1e4", "expected a whole number"},
        {"FSDP_SHM_CHUNK", "65536k", "FSDP_SHM_CHUNK='65536k': expected a whole number"},
        {"FSDP_COLLECTIVE_TIMEOUT", "soon", "FSDP_COLLECTIVE_TIMEOUT='soon': expected a number in [0, 1e+09]"},
        {"FSDP_COLLECTIVE_TIMEOUT", "-1", "expected a number in [0, 1e+09]"},
        {"FSDP_COLLECTIVE_TIMEOUT", "nan", "expected a number"},
        {"FSDP_COLLECTIVE_TIMEOUT", "30s", "FSDP_COLLECTIVE_TIMEOUT='30s': expected a number"},
        {"FSDP_GEMM_BF16", "fast", "FSDP_GEMM_BF16='fast': expected one of: auto, widen, matmul, gemm"},
        {"FSDP_GEMM_BF16", "Widen", "expected one of: auto, widen, matmul, gemm"},
        {"FSDP_MAX_CPU_ISA", "avx512_bf16", "FSDP_MAX_CPU_ISA='avx512_bf16': expected one of: auto, scalar, avx2, avx512, "
                                            "avx512bf16"},
        {"FSDP_FAULT", "sideways:1:3", "FSDP_FAULT='sideways:1:3': expected POINT:RANK:STEP"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        was = getenv(bad[i].name);
        saved = was ? strdup(was) : NULL;
        setenv(bad[i].name, bad[i].value, 1);
        ctx->errmsg[0] = 0;
        if (!strcmp(bad[i].name, "FSDP_FAULT")) {
            /* no reader with a status (its one reader asserts): its validator
             * refuses it, and fsdp_env_check's message is checked below */
            CHECK(fsdp__fault_spec_ok("forward:1:3"));
            CHECK(!fsdp__fault_spec_ok(bad[i].value));
        } else {
            enum fsdp_status st;
            if (!strcmp(bad[i].name, "FSDP_COLLECTIVE_TIMEOUT")) st = fsdp__env_real(ctx, bad[i].name, -1, &rv);
            else if (!strcmp(bad[i].name, "FSDP_GEMM_BF16") || !strcmp(bad[i].name, "FSDP_MAX_CPU_ISA")) st = fsdp__env_word(ctx, bad[i].name, 0, &wv);
            else st = fsdp__env_int(ctx, bad[i].name, 0, &iv);
            if (st != FSDP_ERR_INVALID) TEST_FAILF("%s='%s': the reader said %s", bad[i].name, bad[i].value, fsdp_status_str(st));
            CHECK_STR_CONTAINS(fsdp_errmsg(ctx), bad[i].msg);
        }
        CHECK_INT_EQ(fsdp_env_check(msg, sizeof msg), FSDP_ERR_INVALID);
        CHECK_STR_CONTAINS(msg, bad[i].msg);
        struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
        co.comm = FSDP_COMM_SELF;
        struct fsdp_ctx *c2 = NULL;
        CHECK_INT_EQ(fsdp_ctx_create(&co, &c2), FSDP_ERR_INVALID);
        CHECK(c2 == NULL);
        if (saved) setenv(bad[i].name, saved, 1);
        else unsetenv(bad[i].name);
        free(saved);
    }
    CHECK_INT_EQ(fsdp_env_check(msg, sizeof msg), FSDP_OK);
    fsdp__ctx_release(ctx);
}

TEST_MAIN()
