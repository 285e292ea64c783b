/*
 * test_data.c - token sources (src/io/data.c): each file format round-trips
 * through small files in a mkdtemp directory; every open error names the
 * file and the problem; the batch formula gives each rank its share of a
 * world-size-independent global batch and wraps at the end; the synthetic
 * corpus is a pure function of its seed, and its loss floor agrees with a
 * calculation made here from the corpus itself (parsed back into choices).
 */
#include "fsdp.h"
#include "harness.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

static struct fsdp_ctx *new_ctx(void) {
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.comm = FSDP_COMM_SELF;
    co.threads = 1;
    struct fsdp_ctx *c = NULL;
    if (fsdp_ctx_create(&co, &c) != FSDP_OK) abort();
    return c;
}

/* ---- scratch files ---- */

static char tmpdir[64];
static char paths[32][128];
static int n_paths;

static void tmp_begin(void) {
    snprintf(tmpdir, sizeof tmpdir, "/tmp/fsdp_test_data_XXXXXX");
    if (!mkdtemp(tmpdir)) abort();
    n_paths = 0;
}

static void tmp_end(void) {
    for (int i = 0; i < n_paths; i++) unlink(paths[i]);
    rmdir(tmpdir);
}

/* Writes n bytes to tmpdir/name; returns the path (valid until tmp_end). */
static const char *write_file(const char *name, const void *bytes, size_t n) {
    if (n_paths == 32) abort();
    char *p = paths[n_paths++];
    snprintf(p, 128, "%s/%s", tmpdir, name);
    FILE *f = fopen(p, "wb");
    if (!f || (n && fwrite(bytes, 1, n, f) != n) || fclose(f) != 0) abort();
    return p;
}

/* An llm.c file: header {magic, version, header_ntok} and ntok uint16 tokens. */
static const char *write_llmc(const char *name, int32_t magic, int32_t version, int32_t header_ntok,
                              const uint16_t *tok, size_t ntok) {
    size_t n = 1024 + 2 * ntok;
    unsigned char *buf = calloc(1, n);
    int32_t h[3] = {magic, version, header_ntok};
    memcpy(buf, h, sizeof h);
    memcpy(buf + 1024, tok, 2 * ntok);
    const char *p = write_file(name, buf, n);
    free(buf);
    return p;
}

static uint16_t tok_of(size_t i) { return (uint16_t)((i * 7919u + 13u) % 50257u); }

/* Expects a failing open with status st and a message containing both needles. */
#define EXPECT_OPEN_FAIL(ctx, path, vocab, st, needle1, needle2)                 \
    do {                                                                         \
        struct fsdp_data *d_ = (struct fsdp_data *)1;                            \
        CHECK_INT_EQ(fsdp_data_open((ctx), (path), (vocab), &d_), (st));         \
        CHECK(d_ == NULL);                                                       \
        CHECK_STR_CONTAINS(fsdp_errmsg(ctx), (needle1));                         \
        CHECK_STR_CONTAINS(fsdp_errmsg(ctx), (needle2));                         \
    } while (0)

/* Reads all tokens of d through the public batch API (world 1, B 1). */
static int32_t *all_tokens(const struct fsdp_data *d) {
    size_t n = fsdp_data_ntokens(d);
    int32_t *in = malloc(n * sizeof *in), *tg = malloc(n * sizeof *tg);
    fsdp_data_batch(d, 0, 1, (int)(n - 1), 0, 1, in, tg);
    in[n - 1] = tg[n - 2];
    free(tg);
    return in;
}

/* ---- formats ---- */

TEST(data_llmc_roundtrip) {
    struct fsdp_ctx *c = new_ctx();
    tmp_begin();
    enum { N = 1000 };
    uint16_t tok[N];
    for (size_t i = 0; i < N; i++) tok[i] = tok_of(i);
    const char *p = write_llmc("train.bin", 20240520, 1, N, tok, N);
    struct fsdp_data *d;
    ASSERT_OK(fsdp_data_open(c, p, 50257, &d), c);
    CHECK_INT_EQ(fsdp_data_ntokens(d), N);
    CHECK_INT_EQ(fsdp_data_is_text(d), 0);
    CHECK(fsdp_data_loss_floor(d) < 0);
    int32_t *all = all_tokens(d);
    for (size_t i = 0; i < N; i++) CHECK_INT_EQ(all[i], tok[i]);
    free(all);
    fsdp_data_free(d);
    /* the llm.c magic wins whatever the extension */
    p = write_llmc("train.tok", 20240520, 1, N, tok, N);
    ASSERT_OK(fsdp_data_open(c, p, 50257, &d), c);
    CHECK_INT_EQ(fsdp_data_ntokens(d), N);
    fsdp_data_free(d);
    tmp_end();
    fsdp_ctx_free(c);
}

TEST(data_raw_bin_roundtrip) {
    struct fsdp_ctx *c = new_ctx();
    tmp_begin();
    enum { N = 777 };
    uint16_t tok[N];
    for (size_t i = 0; i < N; i++) tok[i] = tok_of(i);
    const char *p = write_file("val.bin", tok, sizeof tok);
    struct fsdp_data *d;
    ASSERT_OK(fsdp_data_open(c, p, 50257, &d), c);
    CHECK_INT_EQ(fsdp_data_ntokens(d), N);
    CHECK_INT_EQ(fsdp_data_is_text(d), 0);
    int32_t *all = all_tokens(d);
    for (size_t i = 0; i < N; i++) CHECK_INT_EQ(all[i], tok[i]);
    free(all);
    fsdp_data_free(d);
    /* the largest id of a 65536 vocabulary */
    uint16_t big[3] = {65535, 0, 1};
    p = write_file("big.bin", big, sizeof big);
    ASSERT_OK(fsdp_data_open(c, p, 65536, &d), c);
    all = all_tokens(d);
    CHECK_INT_EQ(all[0], 65535);
    free(all);
    fsdp_data_free(d);
    tmp_end();
    fsdp_ctx_free(c);
}

TEST(data_text_roundtrip) {
    struct fsdp_ctx *c = new_ctx();
    tmp_begin();
    const char text[] = "hello, w\xc3\xb6rld\n\x01\xff";
    size_t n = sizeof text - 1;
    const char *p = write_file("input.txt", text, n);
    struct fsdp_data *d;
    ASSERT_OK(fsdp_data_open(c, p, 256, &d), c);
    CHECK_INT_EQ(fsdp_data_ntokens(d), n);
    CHECK_INT_EQ(fsdp_data_is_text(d), 1);
    CHECK(fsdp_data_loss_floor(d) < 0);
    int32_t *all = all_tokens(d);
    for (size_t i = 0; i < n; i++) CHECK_INT_EQ(all[i], (unsigned char)text[i]);
    free(all);
    fsdp_data_free(d);
    /* no extension, larger vocabulary: still bytes */
    p = write_file("README", text, n);
    ASSERT_OK(fsdp_data_open(c, p, 50257, &d), c);
    CHECK_INT_EQ(fsdp_data_is_text(d), 1);
    CHECK_INT_EQ(fsdp_data_ntokens(d), n);
    fsdp_data_free(d);
    tmp_end();
    fsdp_ctx_free(c);
}

/* ---- errors ---- */

TEST(data_open_errors_io) {
    struct fsdp_ctx *c = new_ctx();
    tmp_begin();
    char missing[160];
    snprintf(missing, sizeof missing, "%s/nope.bin", tmpdir);
    EXPECT_OPEN_FAIL(c, missing, 256, FSDP_ERR_IO, missing, "No such file");
    EXPECT_OPEN_FAIL(c, tmpdir, 256, FSDP_ERR_IO, tmpdir, "not a regular file");
    if (getuid() != 0) { /* root reads anything */
        const char *p = write_file("secret.txt", "abc", 3);
        chmod(p, 0);
        EXPECT_OPEN_FAIL(c, p, 256, FSDP_ERR_IO, p, "Permission denied");
    }
    struct fsdp_data *d;
    CHECK_INT_EQ(fsdp_data_open(c, NULL, 256, &d), FSDP_ERR_INVALID);
    const char *p = write_file("ok.txt", "abc", 3);
    EXPECT_OPEN_FAIL(c, p, 0, FSDP_ERR_INVALID, p, "vocab_size 0");
    CHECK_INT_EQ(fsdp_data_open(c, p, 256, NULL), FSDP_ERR_INVALID);
    tmp_end();
    fsdp_ctx_free(c);
}

/* fsdp_open_regular: what every reader of the library and the tools open with */
TEST(open_regular_refuses_at_once) {
    tmp_begin();
    const char *p = write_file("seven.txt", "1234567", 7);
    uint64_t size = 99;
    const char *kind = "x";
    int fd = fsdp_open_regular(p, &size, &kind);
    CHECK(fd >= 0);
    CHECK_INT_EQ(size, 7);
    CHECK(kind == NULL);
    CHECK((fcntl(fd, F_GETFL) & O_NONBLOCK) == 0); /* blocking again */
    CHECK((fcntl(fd, F_GETFD) & FD_CLOEXEC) != 0);
    close(fd);
    errno = 0;
    CHECK_INT_EQ(fsdp_open_regular(tmpdir, &size, &kind), -1);
    CHECK_INT_EQ(errno, EINVAL);
    CHECK_STR_CONTAINS(kind ? kind : "(null)", "a directory");
    char fifo[200];
    snprintf(fifo, sizeof fifo, "%s/fifo", tmpdir);
    ASSERT(mkfifo(fifo, 0600) == 0);
    CHECK_INT_EQ(fsdp_open_regular(fifo, NULL, &kind), -1); /* at once: no writer ever comes */
    CHECK_STR_CONTAINS(kind ? kind : "(null)", "a FIFO");
    unlink(fifo);
    char missing[200];
    snprintf(missing, sizeof missing, "%s/nope", tmpdir);
    CHECK_INT_EQ(fsdp_open_regular(missing, NULL, &kind), -1);
    CHECK_INT_EQ(errno, ENOENT);
    CHECK(kind == NULL);
    CHECK_INT_EQ(fsdp_open_regular("/dev/null", NULL, NULL), -1);
    CHECK_INT_EQ(errno, EINVAL);
    tmp_end();
}

TEST(data_open_errors_format) {
    struct fsdp_ctx *c = new_ctx();
    tmp_begin();
    uint16_t tok[64];
    for (size_t i = 0; i < 64; i++) tok[i] = tok_of(i);
    const char *p = write_llmc("v2.bin", 20240520, 2, 64, tok, 64);
    EXPECT_OPEN_FAIL(c, p, 50257, FSDP_ERR_FORMAT, p, "version 2");
    p = write_llmc("short.bin", 20240520, 1, 64, tok, 63);
    EXPECT_OPEN_FAIL(c, p, 50257, FSDP_ERR_FORMAT, p, "header says 64 tokens");
    p = write_llmc("long.bin", 20240520, 1, 63, tok, 64);
    EXPECT_OPEN_FAIL(c, p, 50257, FSDP_ERR_FORMAT, p, "1152 bytes");
    p = write_llmc("neg.bin", 20240520, 1, -5, tok, 64);
    EXPECT_OPEN_FAIL(c, p, 50257, FSDP_ERR_FORMAT, p, "negative");
    int32_t trunc[25] = {20240520, 1, 10};
    p = write_file("trunc.bin", trunc, sizeof trunc);
    EXPECT_OPEN_FAIL(c, p, 50257, FSDP_ERR_FORMAT, p, "truncated");
    p = write_llmc("hellaswag.bin", 20240522, 1, 64, tok, 64);
    EXPECT_OPEN_FAIL(c, p, 50257, FSDP_ERR_FORMAT, p, "magic 20240522");
    /* an llm.c file in all but its magic: not read as raw tokens */
    p = write_llmc("damaged.bin", 12345678, 1, 64, tok, 64);
    EXPECT_OPEN_FAIL(c, p, 50257, FSDP_ERR_FORMAT, p, "its magic is 12345678, not 20240520");
    /* a count that does not match the size: raw tokens after all */
    p = write_llmc("raw-like.bin", 12345678, 1, 63, tok, 64);
    struct fsdp_data *d;
    ASSERT_OK(fsdp_data_open(c, p, 65536, &d), c);
    CHECK_INT_EQ(fsdp_data_ntokens(d), (1024 + 2 * 64) / 2);
    fsdp_data_free(d);
    p = write_file("odd.bin", tok, 17);
    EXPECT_OPEN_FAIL(c, p, 50257, FSDP_ERR_FORMAT, p, "odd size (17 bytes)");
    tmp_end();
    fsdp_ctx_free(c);
}

TEST(data_open_errors_tokens) {
    struct fsdp_ctx *c = new_ctx();
    tmp_begin();
    uint16_t tok[64];
    for (size_t i = 0; i < 64; i++) tok[i] = (uint16_t)(i % 50);
    tok[37] = 50257;
    const char *p = write_llmc("bad.bin", 20240520, 1, 64, tok, 64);
    EXPECT_OPEN_FAIL(c, p, 50257, FSDP_ERR_INVALID, p, "token 50257 at position 37");
    p = write_file("bad_raw.bin", tok, sizeof tok);
    EXPECT_OPEN_FAIL(c, p, 50257, FSDP_ERR_INVALID, p, "token 50257 at position 37");
    /* a smaller vocabulary catches an earlier token */
    EXPECT_OPEN_FAIL(c, p, 30, FSDP_ERR_INVALID, "token 30 at position 30", "vocab_size 30");
    p = write_file("text.txt", "hello", 5);
    EXPECT_OPEN_FAIL(c, p, 100, FSDP_ERR_INVALID, p, "vocab_size >= 256");
    /* fewer than 2 tokens */
    p = write_llmc("one.bin", 20240520, 1, 1, tok, 1);
    EXPECT_OPEN_FAIL(c, p, 50257, FSDP_ERR_FORMAT, p, "need at least 2");
    p = write_llmc("zero.bin", 20240520, 1, 0, tok, 0);
    EXPECT_OPEN_FAIL(c, p, 50257, FSDP_ERR_FORMAT, p, "0 tokens");
    p = write_file("one_raw.bin", tok, 2);
    EXPECT_OPEN_FAIL(c, p, 50257, FSDP_ERR_FORMAT, p, "has 1 tokens; need at least 2");
    p = write_file("empty.txt", "", 0);
    EXPECT_OPEN_FAIL(c, p, 256, FSDP_ERR_FORMAT, p, "0 bytes");
    p = write_file("one.txt", "x", 1);
    EXPECT_OPEN_FAIL(c, p, 256, FSDP_ERR_FORMAT, p, "1 bytes");
    tmp_end();
    fsdp_ctx_free(c);
}

/* ---- batches ---- */

/* Sequence i of global batch `step` by the documented formula, computed
 * here without 128-bit arithmetic: its start is ((step*B + i)*T) mod n. */
static void ref_seq(const int32_t *all, size_t n, int64_t step, int B, int T, int i, int32_t *in,
                    int32_t *tg) {
    uint64_t s = (uint64_t)step % n;
    s = (s * (uint64_t)B % n + (uint64_t)i) % n;
    s = s * (uint64_t)T % n;
    for (int t = 0; t < T; t++) {
        in[t] = all[(s + (uint64_t)t) % n];
        tg[t] = all[(s + (uint64_t)t + 1) % n];
    }
}

TEST(data_batch_worlds) {
    struct fsdp_ctx *c = new_ctx();
    tmp_begin();
    enum { N = 1001 };
    uint16_t tok[N];
    for (size_t i = 0; i < N; i++) tok[i] = tok_of(i);
    const char *p = write_file("t.bin", tok, sizeof tok);
    struct fsdp_data *d;
    ASSERT_OK(fsdp_data_open(c, p, 50257, &d), c);
    int32_t *all = all_tokens(d);
    const int Bs[] = {12, 5, 1, 7};
    const int T = 16;
    for (size_t bi = 0; bi < 4; bi++) {
        int B = Bs[bi];
        size_t full = (size_t)B * T;
        int32_t *ref_in = malloc(full * 4), *ref_tg = malloc(full * 4);
        int32_t *in = malloc(full * 4), *tg = malloc(full * 4);
        for (int64_t step = 0; step < 9; step++) {
            for (int i = 0; i < B; i++) ref_seq(all, N, step, B, T, i, ref_in + i * T, ref_tg + i * T);
            for (int world = 1; world <= 4; world++) {
                memset(in, 0xff, full * 4);
                memset(tg, 0xff, full * 4);
                size_t off = 0;
                for (int r = 0; r < world; r++) {
                    int nseq = (int)((int64_t)(r + 1) * B / world - (int64_t)r * B / world);
                    fsdp_data_batch(d, step, B, T, r, world, in + off, tg + off);
                    off += (size_t)nseq * T;
                }
                CHECK_INT_EQ(off, full);
                int same = !memcmp(in, ref_in, full * 4) && !memcmp(tg, ref_tg, full * 4);
                if (!same) TEST_FAILF("B %d step %lld world %d: concatenated shares differ", B,
                                      (long long)step, world);
            }
        }
        free(ref_in);
        free(ref_tg);
        free(in);
        free(tg);
    }
    free(all);
    fsdp_data_free(d);
    tmp_end();
    fsdp_ctx_free(c);
}

TEST(data_batch_wraps) {
    struct fsdp_ctx *c = new_ctx();
    tmp_begin();
    const char text[] = "0123456789"; /* 10 tokens */
    const char *p = write_file("ten.txt", text, 10);
    struct fsdp_data *d;
    ASSERT_OK(fsdp_data_open(c, p, 256, &d), c);
    int32_t in[12], tg[12];
    fsdp_data_batch(d, 0, 3, 4, 0, 1, in, tg); /* starts 0, 4, 8 */
    const char *want_in = "012345678901", *want_tg = "123456789012";
    for (int k = 0; k < 12; k++) {
        CHECK_INT_EQ(in[k], want_in[k]);
        CHECK_INT_EQ(tg[k], want_tg[k]);
    }
    /* step 1 starts at 12 = 2 (mod 10) */
    fsdp_data_batch(d, 1, 3, 4, 0, 1, in, tg);
    CHECK_INT_EQ(in[0], '2');
    CHECK_INT_EQ(tg[11], '4'); /* third sequence starts at 20 = 0: 0123 -> 1234 */
    /* sequences longer than the data wrap more than once */
    int32_t lin[25], ltg[25];
    fsdp_data_batch(d, 0, 1, 25, 0, 1, lin, ltg);
    for (int k = 0; k < 25; k++) {
        CHECK_INT_EQ(lin[k], '0' + k % 10);
        CHECK_INT_EQ(ltg[k], '0' + (k + 1) % 10);
    }
    /* a huge step: (step*B + i)*T passes 2^63 */
    int32_t *all = all_tokens(d);
    int64_t step = (int64_t)1 << 60;
    int32_t rin[4], rtg[4];
    for (int i = 0; i < 3; i++) {
        fsdp_data_batch(d, step, 3, 4, i, 3, in, tg);
        ref_seq(all, 10, step, 3, 4, i, rin, rtg);
        CHECK(!memcmp(in, rin, sizeof rin) && !memcmp(tg, rtg, sizeof rtg));
    }
    free(all);
    /* bad arguments are errors on the open's context (they were assertions that ended the process) */
    struct { int64_t step; int B, T, rank, world; int32_t *in; const char *text; } bad[] = {
        {-1, 3, 4, 0, 1, in, "step -1"}, {0, 0, 4, 0, 1, in, "B 0"}, {0, 3, 0, 0, 1, in, "T 0"},
        {0, 3, 4, 5, 2, in, "rank 5 of 2"}, {0, 3, 4, 0, 0, in, "rank 0 of 0"}, {0, 3, 4, 0, 1, NULL, "inputs is NULL"}};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        CHECK_INT_EQ(fsdp_data_batch(d, bad[k].step, bad[k].B, bad[k].T, bad[k].rank, bad[k].world, bad[k].in, tg),
                     FSDP_ERR_INVALID);
        CHECK_STR_CONTAINS(fsdp_errmsg(c), bad[k].text);
    }
    CHECK_INT_EQ(fsdp_data_batch(NULL, 0, 3, 4, 0, 1, in, tg), FSDP_ERR_INVALID);
    fsdp_data_free(d);
    tmp_end();
    fsdp_ctx_free(c);
}

/* ---- synthetic corpus ---- */

static uint8_t *synth_bytes(struct fsdp_ctx *c, uint64_t seed, size_t n) {
    struct fsdp_data *d;
    if (fsdp_data_synthetic(c, seed, n, &d) != FSDP_OK) return NULL;
    int32_t *all = all_tokens(d);
    uint8_t *b = malloc(n);
    for (size_t i = 0; i < n; i++) b[i] = (uint8_t)all[i];
    free(all);
    fsdp_data_free(d);
    return b;
}

TEST(data_synthetic_deterministic) {
    struct fsdp_ctx *c = new_ctx();
    struct fsdp_mem_stats m0, m1;
    fsdp_mem_get(c, &m0);
    struct fsdp_data *d;
    ASSERT_OK(fsdp_data_synthetic(c, 7, 5000, &d), c);
    CHECK_INT_EQ(fsdp_data_ntokens(d), 5000);
    CHECK_INT_EQ(fsdp_data_is_text(d), 1);
    fsdp_data_free(d);
    fsdp_mem_get(c, &m1);
    CHECK_INT_EQ(m1.cur_total, m0.cur_total); /* everything returned */
    uint8_t *a = synth_bytes(c, 7, 5000), *b = synth_bytes(c, 7, 5000);
    uint8_t *p = synth_bytes(c, 7, 1000), *o = synth_bytes(c, 8, 5000);
    ASSERT(a && b && p && o);
    CHECK(!memcmp(a, b, 5000));
    CHECK(!memcmp(a, p, 1000)); /* a shorter corpus is a prefix */
    CHECK(memcmp(a, o, 5000) != 0);
    for (size_t i = 0; i < 5000; i++)
        if (a[i] >= 128 || (a[i] < 32 && a[i] != '\n')) {
            TEST_FAILF("byte %zu is %u", i, a[i]);
            break;
        }
    free(a);
    free(b);
    free(p);
    free(o);
    CHECK_INT_EQ(fsdp_data_synthetic(c, 1, 1, &d), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "n_bytes 1");
    fsdp_ctx_free(c);
}

/* The floor recomputed from the corpus: every complete line is parsed back
 * into its choices; the number of distinct values seen in each slot gives
 * the entropy of a uniform choice there (checked roughly uniform), and the
 * mean line length is measured (Monte Carlo). */
#define MAX_VALS 32
struct slot_seen { char vals[MAX_VALS][16]; long count[MAX_VALS]; int n; };

static void seen_add(struct slot_seen *s, const char *v, size_t len) {
    for (int i = 0; i < s->n; i++)
        if (strlen(s->vals[i]) == len && !memcmp(s->vals[i], v, len)) { s->count[i]++; return; }
    if (s->n == MAX_VALS || len >= 16) {
        TEST_FAILF("slot value '%.*s' is new beyond %d values or too long", (int)len, v, MAX_VALS);
        return;
    }
    memcpy(s->vals[s->n], v, len);
    s->vals[s->n][len] = 0;
    s->count[s->n++] = 1;
}

TEST(data_synthetic_floor) {
    struct fsdp_ctx *c = new_ctx();
    const size_t n = (size_t)4 << 20;
    struct fsdp_data *d;
    ASSERT_OK(fsdp_data_synthetic(c, 1234, n, &d), c);
    double floor_ = fsdp_data_loss_floor(d);
    fsdp_data_free(d);
    uint8_t *b = synth_bytes(c, 1234, n);
    ASSERT(b != NULL);
    struct slot_seen sent[7], sum[2];
    memset(sent, 0, sizeof sent);
    memset(sum, 0, sizeof sum);
    long n_sent = 0, n_sum = 0, bytes = 0, bad = 0;
    size_t start = 0;
    for (size_t i = 0; i < n; i++) {
        if (b[i] != '\n') continue;
        const char *line = (const char *)b + start;
        size_t len = i - start;
        bytes += (long)len + 1;
        start = i + 1;
        if (len < 2 || line[len - 1] != '.') { bad++; continue; }
        if (line[0] >= '0' && line[0] <= '9') {
            int x, y, z, used = 0;
            char tmp[64];
            memcpy(tmp, line, len < 63 ? len : 63);
            tmp[len < 63 ? len : 63] = 0;
            if (sscanf(tmp, "%d+%d=%d.%n", &x, &y, &z, &used) != 3 || (size_t)used != len || z != x + y) {
                bad++;
                continue;
            }
            seen_add(&sum[0], line, strcspn(line, "+"));
            const char *after = strchr(line, '+') + 1;
            seen_add(&sum[1], after, strcspn(after, "="));
            n_sum++;
        } else {
            int w = 0;
            size_t ws = 0;
            for (size_t k = 0; k <= len - 1; k++) {
                if (line[k] == ' ' || k == len - 1) {
                    if (w < 7) seen_add(&sent[w], line + ws, k - ws);
                    w++;
                    ws = k + 1;
                }
            }
            if (w != 7) { bad++; continue; }
            n_sent++;
        }
    }
    CHECK_INT_EQ(bad, 0);
    long items = n_sent + n_sum;
    ASSERT(items > 100000);
    CHECK_NEAR((double)n_sent / (double)items, 0.5, 0, 0.01);
    double h = log(2.0);
    for (int s = 0; s < 7; s++) {
        h += 0.5 * log((double)sent[s].n);
        for (int v = 0; v < sent[s].n; v++) /* roughly uniform */
            CHECK_NEAR((double)sent[s].count[v] * sent[s].n / (double)n_sent, 1.0, 0, 0.05);
    }
    for (int s = 0; s < 2; s++) {
        h += 0.5 * log((double)sum[s].n);
        for (int v = 0; v < sum[s].n; v++)
            CHECK_NEAR((double)sum[s].count[v] * sum[s].n / (double)n_sum, 1.0, 0, 0.08);
    }
    double mean_len = (double)bytes / (double)items;
    double est = h / mean_len;
    CHECK_NEAR(floor_, est, 0.01, 0);
    CHECK(floor_ > 0.1 && floor_ < log(256.0) / 4);
    fprintf(stderr, "  floor %.5f nats/byte, estimate %.5f (%ld items, %.3f bytes each)\n", floor_,
            est, items, mean_len);
    free(b);
    fsdp_ctx_free(c);
}

TEST_MAIN()
