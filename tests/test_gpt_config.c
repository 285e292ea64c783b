/*
 * test_gpt_config.c - the GPT configuration (src/models/gpt.c): the presets
 * and their FLOP counts, and loading a configuration from JSON, with the
 * errors that name the file and the field.
 */
#include "fsdp.h"
#include "harness.h"
#include "nn_helpers.h"
#include "models/models-impl.h"
#include "nn/nn-impl.h"

TEST(config_presets_and_flops) {
    struct fsdp_gpt_config c;
    CHECK_INT_EQ(fsdp_gpt_config_preset("tiny", &c), FSDP_OK);
    CHECK(c.n_layer == 2 && c.n_head == 2 && c.n_embd == 32 && c.vocab_size == 256 && c.block_size == 64);
    CHECK_INT_EQ(fsdp_gpt_config_preset("small", &c), FSDP_OK);
    CHECK(c.n_layer == 4 && c.n_head == 4 && c.n_embd == 128 && c.vocab_size == 256 && c.block_size == 256);
    CHECK_INT_EQ(fsdp_gpt_config_preset("gpt2", &c), FSDP_OK);
    CHECK(c.n_layer == 12 && c.n_head == 12 && c.n_embd == 768 && c.vocab_size == 50257 && c.block_size == 1024);
    double L = 12, C = 768, V = 50257, T = 256;
    CHECK_NEAR(fsdp_gpt_flops_per_token(&c, 256), 2 * (L * 12 * C * C + C * V) + 4 * L * T * C, 1e-12, 0);
    CHECK_INT_EQ(fsdp_gpt_config_preset("gpt2-medium", &c), FSDP_OK);
    CHECK(c.n_layer == 24 && c.n_head == 16 && c.n_embd == 1024 && c.vocab_size == 50257);
    CHECK_INT_EQ(fsdp_gpt_config_preset("gpt2-large", &c), FSDP_OK);
    CHECK(c.n_layer == 36 && c.n_head == 20 && c.n_embd == 1280);
    CHECK_INT_EQ(fsdp_gpt_config_preset("gpt2-xl", &c), FSDP_OK);
    CHECK(c.n_layer == 48 && c.n_head == 25 && c.n_embd == 1600 && c.block_size == 1024);
    CHECK_INT_EQ(fsdp_gpt_config_preset("gpt5", &c), FSDP_ERR_INVALID);
    CHECK_INT_EQ(fsdp_gpt_config_preset(NULL, &c), FSDP_ERR_INVALID);
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_gpt_config bad = {2, 3, 32, 256, 64};
    CHECK_INT_EQ(fsdp_gpt_config_validate(ctx, &bad), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "n_head");
    bad.n_head = 2;
    bad.block_size = 0;
    CHECK_INT_EQ(fsdp_gpt_config_validate(ctx, &bad), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "block_size");
    /* every field has a ceiling, so no size derived from a config overflows */
    struct fsdp_gpt_config huge[5] = {{4097, 1, 32, 256, 64}, {2, 4097, 4097 * 4, 256, 64},
                                      {2, 1, 2147483647, 256, 64}, {2, 1, 32, (1 << 24) + 1, 64},
                                      {2, 1, 32, 256, (1 << 20) + 1}};
    const char *field[5] = {"n_layer 4097", "n_head 4097", "n_embd 2147483647", "vocab_size 16777217",
                            "block_size 1048577"};
    for (int i = 0; i < 5; i++) {
        CHECK_INT_EQ(fsdp_gpt_config_validate(ctx, &huge[i]), FSDP_ERR_INVALID);
        CHECK_STR_CONTAINS(fsdp_errmsg(ctx), field[i]);
        CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "above the largest supported");
    }
    struct fsdp_gpt_config top = {4096, 4096, 1 << 17, 1 << 24, 1 << 20};
    CHECK_INT_EQ(fsdp_gpt_config_validate(ctx, &top), FSDP_OK);
    /* a parameter whose element count overflows int64 (or passes 2^48) is refused */
    struct fsdp_gpt_config tc;
    fsdp_gpt_config_preset("tiny", &tc);
    struct fsdp_module *g;
    CHECK_INT_EQ(fsdp_gpt_create(ctx, &tc, &g), FSDP_OK);
    int64_t shape[2] = {(int64_t)1 << 32, (int64_t)1 << 32};
    struct fsdp_init z = {0};
    CHECK_INT_EQ(fsdp_module_add_param(ctx, g, "w", 2, shape, z, 0, NULL), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "its 2-d shape holds more than 2^48 elements");
    fsdp_module_free(g);
    fsdp_ctx_free(ctx);
}

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (!f) abort();
    fputs(text, f);
    fclose(f);
}

/* Loads `text` as a config file; returns the status (message in ctx). */
static enum fsdp_status load_text(struct fsdp_ctx *ctx, const char *dir, const char *text,
                                  struct fsdp_gpt_config *c) {
    char path[512];
    snprintf(path, sizeof path, "%s/cfg.json", dir);
    write_text(path, text);
    return fsdp_gpt_config_load(ctx, path, c);
}

TEST(config_load_json) {
    struct fsdp_ctx *ctx = make_ctx();
    char dir[] = "/tmp/fsdp_test_nn_XXXXXX";
    ASSERT(mkdtemp(dir));
    struct fsdp_gpt_config c = {0};
    ASSERT_OK(load_text(ctx, dir, "{\"n_layer\": 3, \"n_head\": 4, \"n_embd\": 64, \"vocab_size\": 100, "
                                  "\"block_size\": 32}", &c), ctx);
    CHECK(c.n_layer == 3 && c.n_head == 4 && c.n_embd == 64 && c.vocab_size == 100 && c.block_size == 32);
    struct {
        const char *text, *needle;
        enum fsdp_status st;
    } bad[] = {
        {"{\"n_layer\": 3, \"n_head\": 4, \"n_embd\": 64, \"vocab_size\": 100}", "missing key 'block_size'", FSDP_ERR_FORMAT},
        {"{\"n_layer\": 3, \"n_head\": 4, \"n_embd\": 64, \"vocab_size\": 100, \"block_size\": 32, \"dropout\": 0}",
         "unknown key 'dropout'", FSDP_ERR_FORMAT},
        {"{\"n_layer\": \"3\", \"n_head\": 4, \"n_embd\": 64, \"vocab_size\": 100, \"block_size\": 32}",
         "'n_layer' must be a positive integer", FSDP_ERR_FORMAT},
        {"{\"n_layer\": 3, \"n_head\": -4, \"n_embd\": 64, \"vocab_size\": 100, \"block_size\": 32}",
         "'n_head' must be a positive integer", FSDP_ERR_FORMAT},
        {"{\"n_layer\": 3, \"n_head\": 4, \"n_embd\": 64.5, \"vocab_size\": 100, \"block_size\": 32}",
         "'n_embd' must be a positive integer", FSDP_ERR_FORMAT},
        {"{\"n_layer\": 2, \"n_head\": 3, \"n_embd\": 32, \"vocab_size\": 256, \"block_size\": 64}",
         "n_embd 32 is not divisible by n_head 3", FSDP_ERR_INVALID},
        {"{\"n_layer\": 2, \"n_layer\": 2, \"n_head\": 2, \"n_embd\": 32, \"vocab_size\": 256, \"block_size\": 64}",
         "'n_layer' appears twice", FSDP_ERR_FORMAT},
        {"{\"n_layer\": 2,", "invalid JSON", FSDP_ERR_FORMAT},
        {"[1, 2]", "expected a JSON object", FSDP_ERR_FORMAT},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        struct fsdp_gpt_config before = c;
        CHECK_INT_EQ(load_text(ctx, dir, bad[i].text, &c), bad[i].st);
        CHECK_STR_CONTAINS(fsdp_errmsg(ctx), bad[i].needle);
        CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "cfg.json");
        CHECK(memcmp(&before, &c, sizeof c) == 0); /* untouched on failure */
    }
    /* one object, then only white space: junk, a second object or a NUL byte
     * after it is refused naming the file and the byte (cJSON alone stops at
     * the end of the first value, or at the NUL) */
    static const char good[] = "{\"n_layer\": 2, \"n_head\": 2, \"n_embd\": 32, \"vocab_size\": 256, "
                               "\"block_size\": 64}";
    struct {
        const char *tail, *needle;
        size_t len;
    } after[] = {
        {" junk", "bytes after the JSON value at byte 79", 5},
        {"\n{\"n_layer\": 3}", "bytes after the JSON value at byte 79", 15},
        {"\n\0", "a NUL byte at byte 79", 2},
        {"\0\1", "a NUL byte at byte 78", 2},
    };
    CHECK_INT_EQ((int)strlen(good), 78);
    for (size_t i = 0; i < sizeof after / sizeof after[0]; i++) {
        char path[512], buf[256];
        snprintf(path, sizeof path, "%s/cfg.json", dir);
        memcpy(buf, good, sizeof good - 1);
        memcpy(buf + sizeof good - 1, after[i].tail, after[i].len);
        FILE *f = fopen(path, "wb");
        ASSERT(f && fwrite(buf, 1, sizeof good - 1 + after[i].len, f) == sizeof good - 1 + after[i].len);
        fclose(f);
        struct fsdp_gpt_config before = c;
        CHECK_INT_EQ(fsdp_gpt_config_load(ctx, path, &c), FSDP_ERR_FORMAT);
        CHECK_STR_CONTAINS(fsdp_errmsg(ctx), after[i].needle);
        CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "cfg.json");
        CHECK(memcmp(&before, &c, sizeof c) == 0);
        /* the in-memory reader (the fuzz target's) checks alike */
        CHECK_INT_EQ(fsdp__gpt_config_parse(ctx, "mem.json", buf, sizeof good - 1 + after[i].len, &c),
                     FSDP_ERR_FORMAT);
        CHECK_STR_CONTAINS(fsdp_errmsg(ctx), after[i].needle);
    }
    ASSERT_OK(load_text(ctx, dir, "\n {\"n_layer\": 2, \"n_head\": 2, \"n_embd\": 32, \"vocab_size\": 256, "
                                  "\"block_size\": 64} \r\n\t\n", &c), ctx); /* white space around it is fine */
    CHECK(c.n_layer == 2 && c.n_embd == 32);
    char missing[600];
    snprintf(missing, sizeof missing, "%s/no/such/config.json", dir);
    CHECK_INT_EQ(fsdp_gpt_config_load(ctx, missing, &c), FSDP_ERR_IO);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), missing);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
    fsdp_ctx_free(ctx);
}

TEST_MAIN()
