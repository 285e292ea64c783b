/*
 * test_safetensors.c - the safetensors reader and writer (src/io/safetensors.c,
 * st_write.c): round trips across checksum chunks, whole chunks written by
 * several threads, headers that lie (each rejected with a message naming the
 * file and the tensor), and a sweep that flips every byte and truncates at
 * every length of a small file: each is either rejected or (for bytes that
 * carry no meaning, e.g. metadata values) reads back the exact original
 * values; never a silent wrong load.
 */
#include "io/io-impl.h"
#include "harness.h"

#include <fcntl.h>
#include <omp.h>
#include <sys/stat.h>
#include <unistd.h>

static struct fsdp_ctx *mkctx(void) {
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.comm = FSDP_COMM_SELF;
    co.threads = 1;
    struct fsdp_ctx *c;
    if (fsdp_ctx_create(&co, &c) != FSDP_OK) abort();
    return c;
}

static void tmpname(char *buf, size_t n, const char *tag) {
    snprintf(buf, n, "/tmp/fsdp-st-%d-%s.safetensors", (int)getpid(), tag);
}

/* Writes three tensors: a (3, 5) F32, an empty (0, 4) F32, and a U8 tensor of
 * 2 MiB + 37 bytes (three checksum chunks). */
#define BIG ((size_t)(2u << 20) + 37)
static void write_sample(struct fsdp_ctx *c, const char *path, float *a, uint8_t *big) {
    for (int i = 0; i < 15; i++) a[i] = (float)i * 0.5f - 3.0f;
    for (size_t i = 0; i < BIG; i++) big[i] = (uint8_t)(i * 131u + (i >> 9));
    struct fsdp__st_desc d[3] = {{"a.weight", FSDP_F32, 2, {3, 5, 0, 0}},
                                 {"empty", FSDP_F32, 2, {0, 4, 0, 0}},
                                 {"big", FSDP_U8, 1, {(int64_t)BIG, 0, 0, 0}}};
    const char *kv[] = {"format", "pt"};
    struct fsdp__st_writer *w;
    ASSERT_OK(fsdp__st_writer_open(c, path, 3, d, 1, kv, &w), c);
    ASSERT_OK(fsdp__st_writer_write(w, a, 7 * sizeof(float)), c); /* split writes */
    ASSERT_OK(fsdp__st_writer_write(w, a + 7, 8 * sizeof(float)), c);
    ASSERT_OK(fsdp__st_writer_write(w, big, 1000), c);
    ASSERT_OK(fsdp__st_writer_write(w, big + 1000, BIG - 1000), c);
    ASSERT_OK(fsdp__st_writer_commit(w), c);
}

TEST(round_trip_and_partial_reads) {
    struct fsdp_ctx *c = mkctx();
    char path[128];
    tmpname(path, sizeof path, "rt");
    float a[15], a2[15];
    uint8_t *big = malloc(BIG), *big2 = malloc(BIG);
    write_sample(c, path, a, big);
    struct fsdp__st_file f;
    ASSERT_OK(fsdp__st_open(c, path, &f), c);
    ASSERT_INT_EQ(f.n, 3);
    CHECK_INT_EQ(f.data_start % 8, 0);
    CHECK_STR_EQ(fsdp__st_meta(&f, "format"), "pt");
    int ia = fsdp__st_find(&f, "a.weight"), ib = fsdp__st_find(&f, "big"), ie = fsdp__st_find(&f, "empty");
    ASSERT(ia >= 0 && ib >= 0 && ie >= 0);
    CHECK_INT_EQ(f.t[ia].shape[1], 5);
    CHECK_INT_EQ(f.t[ib].n_crc, 3);
    CHECK_INT_EQ(f.t[ie].numel, 0);
    ASSERT_OK(fsdp__st_read(c, &f, ia, 0, sizeof a, a2), c);
    CHECK(memcmp(a, a2, sizeof a) == 0);
    ASSERT_OK(fsdp__st_read(c, &f, ib, 0, BIG, big2), c);
    CHECK(memcmp(big, big2, BIG) == 0);
    /* a range across the first chunk boundary */
    uint64_t lo = (1u << 20) - 11, hi = (1u << 20) + 5000;
    memset(big2, 0, BIG);
    ASSERT_OK(fsdp__st_read(c, &f, ib, lo, hi, big2), c);
    CHECK(memcmp(big + lo, big2, (size_t)(hi - lo)) == 0);
    int unchecked = -1;
    CHECK_OK(fsdp__st_verify(c, &f, &unchecked), c);
    CHECK_INT_EQ(unchecked, 0);
    fsdp__st_close(&f);
    /* a flipped byte in the last chunk: a read of the first chunk still
     * works, a read touching the last one names the tensor and the range */
    int fd = open(path, O_RDWR);
    ASSERT(fd >= 0);
    struct fsdp__st_file g;
    ASSERT_OK(fsdp__st_open(c, path, &g), c);
    off_t at = (off_t)(g.data_start + g.t[fsdp__st_find(&g, "big")].begin + BIG - 3);
    uint8_t x;
    ASSERT(pread(fd, &x, 1, at) == 1);
    x ^= 0x40;
    ASSERT(pwrite(fd, &x, 1, at) == 1);
    close(fd);
    ib = fsdp__st_find(&g, "big");
    CHECK_OK(fsdp__st_read(c, &g, ib, 0, 100, big2), c);
    CHECK_INT_EQ(fsdp__st_read(c, &g, ib, BIG - 10, BIG, big2), FSDP_ERR_FORMAT);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "tensor 'big': checksum mismatch in bytes [2097152, 2097189)");
    CHECK_STR_CONTAINS(fsdp_errmsg(c), path);
    fsdp__st_close(&g);
    unlink(path);
    free(big);
    free(big2);
    fsdp_ctx_free(c);
}

/* A file image: 8-byte length, header text, n_data zero bytes. */
static uint8_t *image(const char *hdr, size_t n_data, size_t *len) {
    size_t h = strlen(hdr);
    uint8_t *b = calloc(8 + h + n_data + 1, 1);
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)((uint64_t)h >> (8 * i));
    memcpy(b + 8, hdr, h);
    *len = 8 + h + n_data;
    return b;
}

/* Parses hdr (with n_data bytes of data) and expects failure with a message
 * containing each of the needles. */
static void expect_reject(struct fsdp_ctx *c, const char *hdr, size_t n_data, const char *n1, const char *n2) {
    size_t len;
    uint8_t *b = image(hdr, n_data, &len);
    struct fsdp__st_file f;
    enum fsdp_status st = fsdp__safetensors_parse(c, "lie.safetensors", b, len, len, &f);
    if (st == FSDP_OK) {
        TEST_FAILF("accepted: %s", hdr);
        fsdp__st_close(&f);
    } else {
        CHECK_STR_CONTAINS(fsdp_errmsg(c), "lie.safetensors");
        if (n1) CHECK_STR_CONTAINS(fsdp_errmsg(c), n1);
        if (n2) CHECK_STR_CONTAINS(fsdp_errmsg(c), n2);
    }
    free(b);
}

TEST(headers_that_lie) {
    struct fsdp_ctx *c = mkctx();
    /* control: a valid header parses */
    size_t len;
    uint8_t *b = image("{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, &len);
    struct fsdp__st_file f;
    CHECK_OK(fsdp__safetensors_parse(c, "ok.safetensors", b, len, len, &f), c);
    fsdp__st_close(&f);
    free(b);
    const char *X = "'x'";
    expect_reject(c, "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4, X, "beyond");
    expect_reject(c, "{\"x\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8, X, "need 12");
    expect_reject(c, "{\"x\":{\"dtype\":\"F31\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, X, "unknown dtype");
    expect_reject(c, "{\"x\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[0,8]}}", 8, X, "not supported");
    expect_reject(c, "{\"x\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8, X, "shape[0]");
    expect_reject(c, "{\"x\":{\"dtype\":\"F32\",\"shape\":[2.5],\"data_offsets\":[0,8]}}", 8, X, "shape[0]");
    expect_reject(c, "{\"x\":{\"dtype\":\"F32\",\"shape\":[\"2\"],\"data_offsets\":[0,8]}}", 8, X, "shape[0]");
    expect_reject(c, "{\"x\":{\"dtype\":\"F32\",\"shape\":[1125899906842624,1125899906842624],\"data_offsets\":[0,8]}}",
                  8, X, "absurd");
    expect_reject(c, "{\"x\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,2],\"data_offsets\":[0,8]}}", 8, X, "dimensions");
    expect_reject(c, "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8, X, "end before begin");
    expect_reject(c, "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 8, X, "data_offsets");
    expect_reject(c, "{\"x\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, X, "data_offsets");
    expect_reject(c, "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"extra\":1}}", 8, X, "extra");
    expect_reject(c, "{\"x\":[1,2]}", 8, X, "not a JSON object");
    expect_reject(c,
                  "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                  "\"y\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
                  12, "overlap", "'y'");
    expect_reject(c,
                  "{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                  "\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
                  8, X, "twice");
    expect_reject(c, "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"__metadata__\":{\"k\":1}}", 8,
                  "__metadata__", "\"k\"");
    /* names and strings of a damaged header never reach a message raw: a
     * control character in a tensor name is refused, shown escaped */
    expect_reject(c, "{\"x\\u001b[2J\\n\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8,
                  "holds a control character", "\"x\\x1B[2J\\x0A\"");
    expect_reject(c, "{\"x\":{\"dtype\":\"F\\u00073\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, X,
                  "unknown dtype \"F\\x073\"");
    expect_reject(c,
                  "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                  "\"__metadata__\":{\"fsdp.crc32c.x\":\"12zz5678\"}}",
                  8, X, "hex");
    expect_reject(c,
                  "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                  "\"__metadata__\":{\"fsdp.crc32c.x\":\"1234\"}}",
                  8, X, "hex digits");
    expect_reject(c,
                  "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                  "\"__metadata__\":{\"fsdp.crc32c.q\":\"12345678\"}}",
                  8, "\"q\"", "not a tensor");
    expect_reject(c, /* a flipped byte in x's checksum key: x unchecked beside y */
                  "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                  "\"y\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]},"
                  "\"__metadata__\":{\"fsdp.crc32d.x\":\"12345678\",\"fsdp.crc32c.y\":\"12345678\"}}",
                  16, "'x'", "no checksum");
    expect_reject(c, "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}junk", 8, "after its JSON", NULL);
    expect_reject(c, "{\"x\":{\"dtype\":\"F32\",", 8, "not valid JSON", NULL);
    expect_reject(c, "[1]", 8, "start with '{'", NULL);
    expect_reject(c, "{\"\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "empty name", NULL);
    /* the length word itself */
    uint8_t raw[16] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, '{', '}'};
    CHECK_INT_EQ(fsdp__safetensors_parse(c, "lie.safetensors", raw, 16, 16, &f), FSDP_ERR_FORMAT);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "absurd");
    uint8_t raw2[16] = {200, 0, 0, 0, 0, 0, 0, 0, '{', '}'};
    CHECK_INT_EQ(fsdp__safetensors_parse(c, "lie.safetensors", raw2, 16, 16, &f), FSDP_ERR_FORMAT);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "truncated");
    CHECK_INT_EQ(fsdp__safetensors_parse(c, "lie.safetensors", raw2, 5, 5, &f), FSDP_ERR_FORMAT);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "too short");
    fsdp_ctx_free(c);
}

/* Opens path and reads every tensor; returns the status, and *same = 1 when
 * the values equal the originals. */
static enum fsdp_status load_all(struct fsdp_ctx *c, const char *path, const float *a, const uint8_t *u8, int *same) {
    struct fsdp__st_file f;
    *same = 0;
    FSDP_TRY(fsdp__st_open(c, path, &f));
    enum fsdp_status st = FSDP_OK;
    int ia = fsdp__st_find(&f, "w"), ib = fsdp__st_find(&f, "b");
    if (ia < 0 || ib < 0 || f.n != 2 || f.t[ia].numel != 64 || f.t[ib].numel != 100 || f.t[ia].dtype != FSDP_F32 ||
        f.t[ib].dtype != FSDP_U8 || f.t[ia].ndim != 2 || f.t[ia].shape[0] != 8) {
        fsdp__st_close(&f);
        return FSDP_OK; /* structurally different: counts as a wrong load (same = 0) */
    }
    float a2[64];
    uint8_t b2[100];
    st = fsdp__st_read(c, &f, ia, 0, sizeof a2, a2);
    if (st == FSDP_OK) st = fsdp__st_read(c, &f, ib, 0, sizeof b2, b2);
    if (st == FSDP_OK) *same = !memcmp(a, a2, sizeof a2) && !memcmp(u8, b2, sizeof b2);
    fsdp__st_close(&f);
    return st;
}

TEST(every_byte_flip_and_truncation_is_caught) {
    struct fsdp_ctx *c = mkctx();
    char path[128];
    tmpname(path, sizeof path, "sweep");
    float a[64];
    uint8_t u8[100];
    for (int i = 0; i < 64; i++) a[i] = (float)i / 7.0f;
    for (int i = 0; i < 100; i++) u8[i] = (uint8_t)(i * 37);
    struct fsdp__st_desc d[2] = {{"w", FSDP_F32, 2, {8, 8, 0, 0}}, {"b", FSDP_U8, 1, {100, 0, 0, 0}}};
    const char *kv[] = {"format", "pt"};
    struct fsdp__st_writer *w;
    ASSERT_OK(fsdp__st_writer_open(c, path, 2, d, 1, kv, &w), c);
    ASSERT_OK(fsdp__st_writer_write(w, a, sizeof a), c);
    ASSERT_OK(fsdp__st_writer_write(w, u8, sizeof u8), c);
    ASSERT_OK(fsdp__st_writer_commit(w), c);
    int same;
    ASSERT_OK(load_all(c, path, a, u8, &same), c);
    ASSERT(same);
    int fd = open(path, O_RDWR);
    ASSERT(fd >= 0);
    off_t size = lseek(fd, 0, SEEK_END);
    uint8_t *orig = malloc((size_t)size);
    ASSERT(pread(fd, orig, (size_t)size, 0) == size);
    int rejected = 0, harmless = 0, silent = 0;
    for (off_t i = 0; i < size; i++) {
        for (int bit = 0; bit < 8; bit += 3) {
            uint8_t x = (uint8_t)(orig[i] ^ (1u << bit));
            if (pwrite(fd, &x, 1, i) != 1) abort();
            enum fsdp_status st = load_all(c, path, a, u8, &same);
            if (st != FSDP_OK) {
                rejected++;
                if (!strstr(fsdp_errmsg(c), path)) TEST_FAILF("flip at %lld: message lacks the file: %s", (long long)i, fsdp_errmsg(c));
            } else if (same) {
                harmless++;
            } else {
                silent++;
                TEST_FAILF("flip of bit %d at byte %lld loaded wrong values silently", bit, (long long)i);
            }
            if (pwrite(fd, &orig[i], 1, i) != 1) abort();
        }
    }
    for (off_t n = 0; n < size; n++) {
        if (ftruncate(fd, n) != 0) abort();
        if (load_all(c, path, a, u8, &same) == FSDP_OK) TEST_FAILF("truncation to %lld bytes accepted", (long long)n);
        if (pwrite(fd, orig, (size_t)size, 0) != size) abort();
    }
    printf("  %lld bytes: %d flips rejected, %d harmless (metadata text), %d silent\n", (long long)size, rejected,
           harmless, silent);
    CHECK(rejected > harmless);
    close(fd);
    free(orig);
    unlink(path);
    fsdp_ctx_free(c);
}

/* The three-way CRC-32C ([Note: three-way CRC]) against a bit-by-bit
 * reference, for lengths around the 3 x 4 KiB block and in pieces. */
static uint32_t crc_bitwise(uint32_t crc, const uint8_t *p, size_t n) {
    crc = ~crc;
    for (size_t i = 0; i < n; i++) {
        crc ^= p[i];
        for (int k = 0; k < 8; k++) crc = crc & 1 ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
    }
    return ~crc;
}

TEST(crc32c_matches_a_bitwise_reference) {
    CHECK_INT_EQ(fsdp__crc32c(0, "123456789", 9), 0xE3069283u); /* the standard check value */
    size_t cap = 3 * 4096 * 3 + 77;
    uint8_t *buf = malloc(cap);
    uint64_t x = 88172645463325252ull;
    for (size_t i = 0; i < cap; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        buf[i] = (uint8_t)x;
    }
    const size_t lens[] = {0, 1, 7, 8, 4095, 12287, 12288, 12289, 24576 + 5, cap};
    for (size_t i = 0; i < sizeof lens / sizeof *lens; i++) {
        uint32_t want = crc_bitwise(0, buf, lens[i]);
        CHECK_INT_EQ(fsdp__crc32c(0, buf, lens[i]), want);
        for (size_t cut = 1; cut < lens[i]; cut += 5003) /* streamed in two pieces */
            CHECK_INT_EQ(fsdp__crc32c(fsdp__crc32c(0, buf, cut), buf + cut, lens[i] - cut), want);
        CHECK_INT_EQ(fsdp__crc32c(0x1234567u, buf, lens[i]), crc_bitwise(0x1234567u, buf, lens[i]));
    }
    free(buf);
}

/* [Note: parallel chunks]: whole chunks written by several threads give the
 * very file one thread writes (data and per-chunk checksums), over calls that
 * start mid-chunk, end mid-chunk and span more than one group of 16 chunks. */
static void write_big_u8(struct fsdp_ctx *c, const char *path, const uint8_t *v, size_t n, int threads) {
    struct fsdp__st_desc d[1] = {{"v", FSDP_U8, 1, {(int64_t)n, 0, 0, 0}}};
    const char *kv[] = {"format", "pt"};
    struct fsdp__st_writer *w;
    int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    ASSERT_OK(fsdp__st_writer_open(c, path, 1, d, 1, kv, &w), c);
    size_t cuts[] = {1000, (2u << 20) + 5, 30u << 20, n};
    for (size_t i = 0, at = 0; i < 4; at = cuts[i++]) ASSERT_OK(fsdp__st_writer_write(w, v + at, cuts[i] - at), c);
    ASSERT_OK(fsdp__st_writer_commit(w), c);
    omp_set_num_threads(saved);
}

static uint8_t *slurp_file(const char *path, size_t *n) {
    struct stat sb;
    int fd = open(path, O_RDONLY);
    if (fd < 0 || fstat(fd, &sb) != 0) abort();
    uint8_t *b = malloc((size_t)sb.st_size);
    if (!b || pread(fd, b, (size_t)sb.st_size, 0) != sb.st_size) abort();
    close(fd);
    *n = (size_t)sb.st_size;
    return b;
}

TEST(parallel_chunk_writes_match_one_thread) {
    struct fsdp_ctx *c = mkctx();
    size_t n = ((size_t)37 << 20) + 123;
    uint8_t *v = malloc(n);
    for (size_t i = 0; i < n; i++) v[i] = (uint8_t)(i * 2654435761u >> 13);
    char p1[128], p3[128];
    tmpname(p1, sizeof p1, "par1");
    tmpname(p3, sizeof p3, "par3");
    write_big_u8(c, p1, v, n, 1);
    write_big_u8(c, p3, v, n, 3);
    size_t n1, n3;
    uint8_t *b1 = slurp_file(p1, &n1), *b3 = slurp_file(p3, &n3);
    CHECK_INT_EQ(n3, n1);
    CHECK(n1 == n3 && memcmp(b1, b3, n1) == 0);
    struct fsdp__st_file f;
    ASSERT_OK(fsdp__st_open(c, p3, &f), c);
    CHECK_INT_EQ(f.t[0].n_crc, 38);
    int unchecked = -1;
    CHECK_OK(fsdp__st_verify(c, &f, &unchecked), c);
    CHECK_INT_EQ(unchecked, 0);
    memset(b3, 0, n);
    ASSERT_OK(fsdp__st_read(c, &f, 0, 0, n, b3), c);
    CHECK(memcmp(v, b3, n) == 0);
    fsdp__st_close(&f);
    unlink(p1);
    unlink(p3);
    free(b1);
    free(b3);
    free(v);
    fsdp_ctx_free(c);
}

TEST_MAIN()
