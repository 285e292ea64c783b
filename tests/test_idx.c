/*
 * test_idx.c - image sets in the IDX format (src/data/idx.c): small files
 * written here, plain and gzip'd, read back; the batch's exact definition
 * (no shuffle, no augmentation: step s is images s*B ... s*B+B-1, wrapping),
 * the same global batch at world sizes 1-4 with shuffle and augmentation,
 * every epoch a permutation, augmented images that are crops/flips of their
 * source; bad files rejected with one error naming the file; and the real
 * Fashion-MNIST where Debian's dataset-fashion-mnist is installed (counts,
 * shapes, labels and CRC-32 checksums of images computed with Python's gzip);
 * and the fuzz corpus fuzz/corpus/idx replayed through the fuzz target's
 * code (ok-* accepted, bad-* refused with a message).
 */
#define FUZZ_NO_MAIN
#include "../fuzz/fuzz_idx.c"

#include <dirent.h>
#include <sys/stat.h>
#include <zlib.h>

#include "harness.h"

enum { N = 10, H = 3, W = 4 };

static struct fsdp_ctx *make_ctx(void) {
    struct fsdp_ctx_opts o = fsdp_ctx_opts_default();
    o.comm = FSDP_COMM_SELF;
    struct fsdp_ctx *ctx = NULL;
    if (fsdp_ctx_create(&o, &ctx) != FSDP_OK) abort();
    return ctx;
}

static uint8_t pixel(int i, int k) { return (uint8_t)((i * 37 + k * 11 + 3) & 0xff); }

/* an IDX header: type 0x08, ndim dims (big-endian) */
static size_t header(uint8_t *h, int type, int ndim, const uint32_t *dims) {
    h[0] = 0, h[1] = 0, h[2] = (uint8_t)type, h[3] = (uint8_t)ndim;
    for (int d = 0; d < ndim; d++) {
        h[4 + 4 * d] = (uint8_t)(dims[d] >> 24), h[5 + 4 * d] = (uint8_t)(dims[d] >> 16);
        h[6 + 4 * d] = (uint8_t)(dims[d] >> 8), h[7 + 4 * d] = (uint8_t)dims[d];
    }
    return 4 + 4 * (size_t)ndim;
}

/* writes bytes to path, gzip'd if gz */
static void put(const char *path, const uint8_t *b, size_t n, int gz) {
    if (gz) {
        gzFile f = gzopen(path, "wb");
        if (!f || gzwrite(f, b, (unsigned)n) != (int)n || gzclose(f) != Z_OK) TEST_FAILF("cannot write %s", path);
    } else {
        FILE *f = fopen(path, "wb");
        if (!f || fwrite(b, 1, n, f) != n || fclose(f) != 0) TEST_FAILF("cannot write %s", path);
    }
}

static void write_images(const char *path, int n, int gz) {
    static uint8_t b[16 + N * H * W * 2];
    uint32_t dims[3] = {(uint32_t)n, H, W};
    size_t o = header(b, 0x08, 3, dims);
    for (int i = 0; i < n; i++)
        for (int k = 0; k < H * W; k++) b[o++] = pixel(i, k);
    put(path, b, o, gz);
}

static void write_labels(const char *path, int n, int gz, int bad_at) {
    uint8_t b[8 + 2 * N];
    uint32_t dims[1] = {(uint32_t)n};
    size_t o = header(b, 0x08, 1, dims);
    for (int i = 0; i < n; i++) b[o++] = (uint8_t)(i == bad_at ? 10 : i % 3);
    put(path, b, o, gz);
}

/* a folder with the train split plain and the test split gzip'd */
static void make_set(char *dir) {
    strcpy(dir, "/tmp/fsdp_idx_XXXXXX");
    if (!mkdtemp(dir)) abort();
    char p[256];
    snprintf(p, sizeof p, "%s/train-images-idx3-ubyte", dir);
    write_images(p, N, 0);
    snprintf(p, sizeof p, "%s/train-labels-idx1-ubyte", dir);
    write_labels(p, N, 0, -1);
    snprintf(p, sizeof p, "%s/t10k-images-idx3-ubyte.gz", dir);
    write_images(p, N - 3, 1);
    snprintf(p, sizeof p, "%s/t10k-labels-idx1-ubyte.gz", dir);
    write_labels(p, N - 3, 1, -1);
}

static void remove_dir(const char *dir) {
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) TEST_FAILF("%s failed", cmd);
}

static struct fsdp_image_batch_opts plain_opts(void) {
    struct fsdp_image_batch_opts o = fsdp_image_batch_opts_default();
    o.shuffle = 0;
    for (int c = 0; c < 4; c++) o.mean[c] = 0.0f, o.std[c] = 1.0f;
    return o;
}

TEST(idx_reads_plain_and_gzip) {
    struct fsdp_ctx *ctx = make_ctx();
    char dir[64];
    make_set(dir);
    struct fsdp_images *tr, *te;
    ASSERT_OK(fsdp_images_open(ctx, dir, FSDP_SPLIT_TRAIN, 3, &tr), ctx);
    ASSERT_OK(fsdp_images_open(ctx, dir, FSDP_SPLIT_TEST, 3, &te), ctx);
    struct fsdp_images_info a, b;
    fsdp_images_info(tr, &a);
    fsdp_images_info(te, &b);
    CHECK(a.count == N && a.channels == 1 && a.height == H && a.width == W && a.num_classes == 3);
    CHECK(b.count == N - 3 && b.height == H && b.width == W);
    for (int i = 0; i < N; i++) {
        CHECK_INT_EQ(fsdp_images_label(tr, i), i % 3);
        const uint8_t *p = fsdp_images_pixels(tr, i);
        for (int k = 0; k < H * W; k++) CHECK_INT_EQ(p[k], pixel(i, k));
    }
    for (int i = 0; i < N - 3; i++) { /* the gzip'd split, every byte */
        CHECK_INT_EQ(fsdp_images_label(te, i), i % 3);
        const uint8_t *p = fsdp_images_pixels(te, i);
        for (int k = 0; k < H * W; k++) CHECK_INT_EQ(p[k], pixel(i, k));
    }
    fsdp_images_free(tr);
    fsdp_images_free(te);
    remove_dir(dir);
    fsdp_ctx_free(ctx);
}

/* N x H x W x C images (4 dimensions): pixels HWC in the file, CHW in a batch,
 * each channel with its own mean and std */
TEST(idx_reads_colour_images) {
    struct fsdp_ctx *ctx = make_ctx();
    char dir[64];
    make_set(dir);
    char ip[256], lp[256];
    snprintf(ip, sizeof ip, "%s/rgb-images.gz", dir);
    snprintf(lp, sizeof lp, "%s/train-labels-idx1-ubyte", dir);
    static uint8_t b[16 + 4 + N * H * W * 3];
    uint32_t dims[4] = {N, H, W, 3};
    size_t o = header(b, 0x08, 4, dims);
    for (int i = 0; i < N * H * W * 3; i++) b[o++] = (uint8_t)(i * 7 + 1);
    put(ip, b, o, 1);
    struct fsdp_images *im;
    ASSERT_OK(fsdp_images_open_idx(ctx, ip, lp, 3, &im), ctx);
    struct fsdp_images_info a;
    fsdp_images_info(im, &a);
    CHECK(a.count == N && a.channels == 3 && a.height == H && a.width == W);
    struct fsdp_image_batch_opts opt = plain_opts();
    opt.mean[1] = 0.5f, opt.std[2] = 2.0f;
    float x[3 * H * W];
    int32_t y;
    ASSERT_OK(fsdp_images_batch(ctx, im, &opt, 2, 1, 0, 1, x, &y), ctx); /* image 2 */
    CHECK_INT_EQ(y, 2);
    for (int c = 0; c < 3; c++)
        for (int k = 0; k < H * W; k++) {
            uint8_t p = (uint8_t)(((2 * H * W + k) * 3 + c) * 7 + 1);
            CHECK(x[c * H * W + k] == ((float)p / 255.0f - opt.mean[c]) / opt.std[c]);
        }
    fsdp_images_free(im);
    remove_dir(dir);
    fsdp_ctx_free(ctx);
}

TEST(image_batch_exact_definition) { /* no shuffle, no augmentation: step s is images s*B .. s*B+B-1, wrapping */
    struct fsdp_ctx *ctx = make_ctx();
    char dir[64];
    make_set(dir);
    struct fsdp_images *im;
    ASSERT_OK(fsdp_images_open(ctx, dir, FSDP_SPLIT_TRAIN, 3, &im), ctx);
    struct fsdp_image_batch_opts o = plain_opts();
    o.mean[0] = 0.25f, o.std[0] = 0.5f;
    enum { B = 4 };
    float x[B * H * W];
    int32_t y[B];
    for (int step = 0; step < 4; step++) {
        ASSERT_OK(fsdp_images_batch(ctx, im, &o, step, B, 0, 1, x, y), ctx);
        for (int j = 0; j < B; j++) {
            int i = (step * B + j) % N;
            CHECK_INT_EQ(y[j], i % 3);
            for (int k = 0; k < H * W; k++) CHECK(x[j * H * W + k] == ((float)pixel(i, k) / 255.0f - 0.25f) / 0.5f);
        }
    }
    /* a rank's share: rank 1 of 3 takes [4/3, 8/3) = position 1 of the batch,
     * one image: image 9 of step 2, nothing written past it */
    for (int j = 0; j < B; j++) y[j] = -1;
    for (int k = 0; k < B * H * W; k++) x[k] = -7.0f;
    ASSERT_OK(fsdp_images_batch(ctx, im, &o, 2, B, 1, 3, x, y), ctx);
    int i9 = (2 * B + 1) % N;
    CHECK_INT_EQ(y[0], i9 % 3);
    for (int k = 0; k < H * W; k++) CHECK(x[k] == ((float)pixel(i9, k) / 255.0f - 0.25f) / 0.5f);
    CHECK_INT_EQ(y[1], -1);
    CHECK(x[H * W] == -7.0f);
    CHECK(fsdp_images_batch(ctx, im, &o, 0, B, 3, 3, x, y) == FSDP_ERR_INVALID);
    /* a step whose positions step * B + j pass 2^63 (they wrapped negative and read outside the set) */
    for (int shuffle = 0; shuffle < 2; shuffle++) {
        o.shuffle = shuffle;
        CHECK(fsdp_images_batch(ctx, im, &o, INT64_MAX / 2, B, 0, 1, x, y) == FSDP_ERR_INVALID);
        CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "puts its positions past 2^63");
    }
    CHECK(fsdp_images_batch(ctx, im, &o, 0, B, 0, 1, x, NULL) == FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "labels is NULL");
    fsdp_images_free(im);
    remove_dir(dir);
    fsdp_ctx_free(ctx);
}

/* the global batch gathered from world ranks' shares */
static void global_batch(struct fsdp_ctx *ctx, struct fsdp_images *im, const struct fsdp_image_batch_opts *o,
                         int64_t step, int B, int world, float *x, int32_t *y) {
    for (int r = 0; r < world; r++) {
        int64_t lo = (int64_t)r * B / world;
        CHECK_OK(fsdp_images_batch(ctx, im, o, step, B, r, world, x + lo * H * W, y + lo), ctx);
    }
}

TEST(image_batch_same_at_every_world_size) {
    struct fsdp_ctx *ctx = make_ctx();
    char dir[64];
    make_set(dir);
    struct fsdp_images *im;
    ASSERT_OK(fsdp_images_open(ctx, dir, FSDP_SPLIT_TRAIN, 3, &im), ctx);
    struct fsdp_image_batch_opts o = fsdp_image_batch_opts_default();
    o.seed = 42;
    o.crop_padding = 1;
    o.hflip = 1;
    enum { B = 6, STEPS = 7 }; /* 42 positions: 4.2 epochs, batches straddle epochs */
    static float ref[STEPS][B * H * W], got[B * H * W];
    int32_t yref[STEPS][B], ygot[B];
    for (int s = 0; s < STEPS; s++) global_batch(ctx, im, &o, s, B, 1, ref[s], yref[s]);
    for (int world = 2; world <= 4; world++)
        for (int s = STEPS - 1; s >= 0; s--) { /* backwards: the cached permutation must not matter */
            global_batch(ctx, im, &o, s, B, world, got, ygot);
            CHECK(memcmp(got, ref[s], sizeof got) == 0);
            CHECK(memcmp(ygot, yref[s], sizeof ygot) == 0);
        }
    /* shuffle only: each epoch visits every image once, and epochs differ */
    struct fsdp_image_batch_opts sh = plain_opts();
    sh.seed = 42;
    sh.shuffle = 1;
    int order[4][N], differ = 0;
    for (int e = 0; e < 4; e++) {
        int seen[N] = {0};
        for (int k = 0; k < N; k++) {
            float xi[H * W];
            int32_t yi;
            ASSERT_OK(fsdp_images_batch(ctx, im, &sh, e * N + k, 1, 0, 1, xi, &yi), ctx);
            int idx = -1;
            for (int i = 0; i < N && idx < 0; i++)
                if (xi[0] == (float)pixel(i, 0) / 255.0f && xi[1] == (float)pixel(i, 1) / 255.0f) idx = i;
            ASSERT(idx >= 0);
            seen[idx]++;
            order[e][k] = idx;
        }
        for (int i = 0; i < N; i++) CHECK_INT_EQ(seen[i], 1);
        if (e && memcmp(order[e], order[0], sizeof order[0]) != 0) differ = 1;
    }
    CHECK(differ);
    /* another seed, another order */
    sh.seed = 43;
    float x0[H * W];
    int32_t y0;
    int other = 0;
    for (int k = 0; k < N && !other; k++) {
        ASSERT_OK(fsdp_images_batch(ctx, im, &sh, k, 1, 0, 1, x0, &y0), ctx);
        other = x0[0] != (float)pixel(order[0][k], 0) / 255.0f;
    }
    CHECK(other);
    fsdp_images_free(im);
    remove_dir(dir);
    fsdp_ctx_free(ctx);
}

TEST(image_batch_augmentations_are_crops_and_flips) {
    struct fsdp_ctx *ctx = make_ctx();
    char dir[64];
    make_set(dir);
    struct fsdp_images *im;
    ASSERT_OK(fsdp_images_open(ctx, dir, FSDP_SPLIT_TRAIN, 3, &im), ctx);
    struct fsdp_image_batch_opts o = plain_opts();
    o.crop_padding = 2;
    o.hflip = 1;
    int flips = 0, shifted = 0;
    for (int64_t g = 0; g < 40; g++) { /* 4 epochs, no shuffle: image g mod N */
        float x[H * W];
        int32_t y;
        ASSERT_OK(fsdp_images_batch(ctx, im, &o, g, 1, 0, 1, x, &y), ctx);
        int i = (int)(g % N), match = 0;
        for (int oy = 0; oy <= 4 && !match; oy++)
            for (int ox = 0; ox <= 4 && !match; ox++)
                for (int f = 0; f < 2 && !match; f++) {
                    int ok = 1;
                    for (int r = 0; r < H && ok; r++)
                        for (int c = 0; c < W && ok; c++) {
                            int sy = r + oy - 2, sx = (f ? W - 1 - c : c) + ox - 2;
                            int p = sy >= 0 && sy < H && sx >= 0 && sx < W ? pixel(i, sy * W + sx) : 0;
                            ok = x[r * W + c] == (float)p / 255.0f;
                        }
                    if (ok) {
                        match = 1;
                        flips += f;
                        shifted += ox != 2 || oy != 2;
                    }
                }
        CHECK(match);
    }
    CHECK(flips > 5 && flips < 35);
    CHECK(shifted > 20);
    fsdp_images_free(im);
    remove_dir(dir);
    fsdp_ctx_free(ctx);
}

/* one bad file: the error names it */
static void expect_bad(struct fsdp_ctx *ctx, const char *ip, const char *lp, int classes, const char *named,
                       const char *what) {
    struct fsdp_images *im = NULL;
    enum fsdp_status st = fsdp_images_open_idx(ctx, ip, lp, classes, &im);
    if (st == FSDP_OK) {
        TEST_FAILF("%s: accepted", what);
        fsdp_images_free(im);
        return;
    }
    CHECK(im == NULL);
    if (!strstr(fsdp_errmsg(ctx), named) || !strstr(fsdp_errmsg(ctx), what))
        TEST_FAILF("%s: message \"%s\" should name '%s' and say \"%s\"", what, fsdp_errmsg(ctx), named, what);
}

TEST(idx_rejects_bad_files) {
    struct fsdp_ctx *ctx = make_ctx();
    char dir[64];
    make_set(dir);
    char img[256], lab[256], bad[256];
    snprintf(img, sizeof img, "%s/train-images-idx3-ubyte", dir);
    snprintf(lab, sizeof lab, "%s/train-labels-idx1-ubyte", dir);
    snprintf(bad, sizeof bad, "%s/bad.gz", dir);
    uint8_t b[64];
    uint32_t dims3[3] = {N, H, W}, dims2[2] = {N, H * W};
    size_t o = header(b, 0x0D, 3, dims3); /* float data: another type */
    put(bad, b, o, 1);
    expect_bad(ctx, bad, lab, 3, bad, "not an IDX file of unsigned bytes");
    o = header(b, 0x08, 2, dims2);
    put(bad, b, o, 1);
    expect_bad(ctx, bad, lab, 3, bad, "2 dimensions, expected 3 to 4");
    expect_bad(ctx, img, img, 3, img, "3 dimensions, expected 1"); /* images as labels */
    o = header(b, 0x08, 3, dims3);
    for (int k = 0; k < 30; k++) b[o++] = 1; /* 30 of 120 bytes */
    put(bad, b, o, 1);
    expect_bad(ctx, bad, lab, 3, bad, "truncated: 30 of 120 data bytes");
    put(bad, b, 6, 0); /* plain, cut in the header */
    expect_bad(ctx, bad, lab, 3, bad, "truncated in its header");
    /* an absurd item count is named with the whole shape, not as the later
     * dimension at which the product overflows; a zero dimension by its index */
    uint32_t huge[3] = {2147483647u, 28, 28}, empty[3] = {N, 0, W};
    o = header(b, 0x08, 3, huge);
    put(bad, b, o, 1);
    char want[128];
    snprintf(want, sizeof want, "announces 2147483647 x 28 x 28 = %.0f bytes", 2147483647.0 * 28 * 28);
    expect_bad(ctx, bad, lab, 3, bad, want);
    o = header(b, 0x08, 3, empty);
    put(bad, b, o, 1);
    expect_bad(ctx, bad, lab, 3, bad, "dimension 1 is 0");
    /* overlong: a valid file plus a byte */
    static uint8_t big[16 + N * H * W + 1];
    o = header(big, 0x08, 3, dims3);
    memset(big + o, 7, N * H * W + 1);
    put(bad, big, o + N * H * W + 1, 1);
    expect_bad(ctx, bad, lab, 3, bad, "longer than its header says");
    /* label count, label range, num_classes */
    write_labels(bad, N - 1, 1, -1);
    expect_bad(ctx, img, bad, 3, bad, "9 labels for the 10 images");
    remove_dir(dir);
    fsdp_ctx_free(ctx);
}

TEST(idx_rejects_bad_labels_and_missing_files) {
    struct fsdp_ctx *ctx = make_ctx();
    char dir[64];
    make_set(dir);
    char img[256], bad[256], miss[256];
    snprintf(img, sizeof img, "%s/train-images-idx3-ubyte", dir);
    snprintf(bad, sizeof bad, "%s/bad", dir);
    write_labels(bad, N, 0, 4); /* image 4 has label 10 */
    expect_bad(ctx, img, bad, 10, bad, "label 10 of image 4 is not below num_classes 10");
    write_labels(bad, N, 0, -1); /* labels 0..2 */
    expect_bad(ctx, img, bad, 2, bad, "label 2 of image 2 is not below num_classes 2");
    snprintf(miss, sizeof miss, "%s/nothing", dir);
    expect_bad(ctx, miss, bad, 3, miss, "cannot open");
    /* a folder without the test split's labels */
    snprintf(miss, sizeof miss, "%s/t10k-labels-idx1-ubyte.gz", dir);
    CHECK(remove(miss) == 0);
    struct fsdp_images *im = NULL;
    CHECK(fsdp_images_open(ctx, dir, FSDP_SPLIT_TEST, 3, &im) == FSDP_ERR_IO);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "no t10k-labels-idx1-ubyte or t10k-labels-idx1-ubyte.gz");
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), dir);
    /* a corrupt gzip stream */
    snprintf(bad, sizeof bad, "%s/corrupt.gz", dir);
    FILE *f = fopen(bad, "wb");
    ASSERT(f);
    const uint8_t gzhead[] = {0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
    fwrite(gzhead, 1, sizeof gzhead, f);
    fclose(f);
    char lab[256];
    snprintf(lab, sizeof lab, "%s/train-labels-idx1-ubyte", dir);
    im = NULL;
    CHECK(fsdp_images_open_idx(ctx, bad, lab, 3, &im) != FSDP_OK);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), bad);
    /* a FIFO is refused at once, not waited on (no writer ever comes) */
    snprintf(bad, sizeof bad, "%s/fifo", dir);
    ASSERT(mkfifo(bad, 0600) == 0);
    CHECK(fsdp_images_open_idx(ctx, bad, lab, 3, &im) != FSDP_OK);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "not a regular file (a FIFO)");
    remove_dir(dir);
    fsdp_ctx_free(ctx);
}

TEST(fashion_mnist_from_debian) {
    struct stat sb;
    if (stat("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz", &sb) != 0) {
        SKIP("Debian's dataset-fashion-mnist is not installed");
    }
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_images *tr, *te;
    ASSERT_OK(fsdp_images_open(ctx, "fashion-mnist", FSDP_SPLIT_TRAIN, 10, &tr), ctx);
    ASSERT_OK(fsdp_images_open(ctx, "fashion-mnist", FSDP_SPLIT_TEST, 10, &te), ctx);
    struct fsdp_images_info a, b;
    fsdp_images_info(tr, &a);
    fsdp_images_info(te, &b);
    CHECK(a.count == 60000 && a.channels == 1 && a.height == 28 && a.width == 28);
    CHECK(b.count == 10000 && b.channels == 1 && b.height == 28 && b.width == 28);
    /* (index, pixel sum, CRC-32 of the 784 bytes, label), from Python's gzip and zlib */
    static const struct { int64_t i; long sum; unsigned long crc; int label; } want_tr[] = {
        {0, 76247, 4067475125ul, 9}, {1, 84598, 2256113758ul, 0}, {59999, 16684, 1834570600ul, 5}};
    static const struct { int64_t i; long sum; unsigned long crc; int label; } want_te[] = {
        {0, 33456, 1384319072ul, 9}, {1, 100994, 368027561ul, 2}, {9999, 24390, 1281285270ul, 5}};
    for (int k = 0; k < 3; k++) {
        const uint8_t *p = fsdp_images_pixels(tr, want_tr[k].i);
        long s = 0;
        for (int j = 0; j < 784; j++) s += p[j];
        CHECK_INT_EQ(s, want_tr[k].sum);
        CHECK_INT_EQ(crc32(0, p, 784), want_tr[k].crc);
        CHECK_INT_EQ(fsdp_images_label(tr, want_tr[k].i), want_tr[k].label);
        p = fsdp_images_pixels(te, want_te[k].i);
        s = 0;
        for (int j = 0; j < 784; j++) s += p[j];
        CHECK_INT_EQ(s, want_te[k].sum);
        CHECK_INT_EQ(crc32(0, p, 784), want_te[k].crc);
        CHECK_INT_EQ(fsdp_images_label(te, want_te[k].i), want_te[k].label);
    }
    /* all pixels and labels at once */
    CHECK_INT_EQ(crc32(0, fsdp_images_pixels(tr, 0), 60000u * 784u), 2925911245ul);
    CHECK_INT_EQ(crc32(0, fsdp_images_pixels(te, 0), 10000u * 784u), 309494841ul);
    /* the default normalisation: Fashion-MNIST's mean and std */
    struct fsdp_image_batch_opts o = fsdp_image_batch_opts_default();
    o.shuffle = 0;
    float x[784];
    int32_t y;
    ASSERT_OK(fsdp_images_batch(ctx, tr, &o, 0, 1, 0, 1, x, &y), ctx);
    CHECK_INT_EQ(y, 9);
    CHECK(x[0] == (0.0f / 255.0f - 0.2860f) / 0.3530f);
    fsdp_images_free(tr);
    fsdp_images_free(te);
    fsdp_ctx_free(ctx);
}

/* every file of fuzz/corpus/idx through fuzz/fuzz_idx.c's code */
TEST(corpus_idx) {
    const char *root = getenv("FUZZ_CORPUS");
    char dir[512];
    snprintf(dir, sizeof dir, "%s/idx", root ? root : "fuzz/corpus");
    DIR *dp = opendir(dir);
    if (!dp) {
        TEST_FAILF("cannot open corpus directory '%s' (run from the repository root)", dir);
        return;
    }
    int n = 0;
    struct dirent *e;
    while ((e = readdir(dp))) {
        if (e->d_name[0] == '.') continue;
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        FILE *f = fopen(path, "rb");
        if (!f) {
            TEST_FAILF("cannot open '%s'", path);
            continue;
        }
        static uint8_t buf[1 << 20];
        size_t got = fread(buf, 1, sizeof buf, f);
        fclose(f);
        enum fsdp_status st = fuzz_idx_one(buf, got);
        if (!strncmp(e->d_name, "ok-", 3) && st != FSDP_OK)
            TEST_FAILF("%s: expected to be accepted, got %s", path, fsdp_status_str(st));
        if (!strncmp(e->d_name, "bad-", 4) && st == FSDP_OK) TEST_FAILF("%s: expected to be rejected", path);
        n++;
    }
    closedir(dp);
    CHECK(n >= 10);
}

/* ---- the raw format and the random resized crop ---- */

static void put32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8), p[2] = (uint8_t)(v >> 16), p[3] = (uint8_t)(v >> 24);
}

/* a raw file in buf: n images h x w x c of pixel(i, k) (or `fill` if >= 0), labels i % 3 of lsize
 * bytes (label `bad_label` at image bad_at); returns its length */
static size_t raw_file(uint8_t *buf, uint32_t n, uint32_t h, uint32_t w, uint32_t c, uint32_t lsize, int fill,
                       int bad_at, int32_t bad_label) {
    memcpy(buf, "FSDPIMG1", 8);
    put32(buf + 8, n), put32(buf + 12, h), put32(buf + 16, w), put32(buf + 20, c), put32(buf + 24, lsize);
    put32(buf + 28, 0);
    size_t o = 32;
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t k = 0; k < h * w * c; k++) buf[o++] = fill >= 0 ? (uint8_t)fill : pixel((int)i, (int)k);
    for (uint32_t i = 0; i < n; i++) {
        int32_t v = (int)i == bad_at ? bad_label : (int32_t)(i % 3);
        if (lsize == 1) buf[o++] = (uint8_t)v;
        else put32(buf + o, (uint32_t)v), o += 4;
    }
    return o;
}

static uint8_t rawbuf[64 + 64 * 64 * 3 * 8 + 256];

TEST(raw_images_read_plain_and_gzip) {
    struct fsdp_ctx *ctx = make_ctx();
    char dir[64];
    make_set(dir);
    char path[256];
    for (int variant = 0; variant < 4; variant++) { /* uint8 / int32 labels, plain / gzip */
        uint32_t ls = variant & 1 ? 4 : 1, C = 3;
        int gz = variant >> 1;
        size_t len = raw_file(rawbuf, 7, 5, 4, C, ls, -1, -1, 0);
        snprintf(path, sizeof path, "%s/set%d.fsdpimg%s", dir, variant, gz ? ".gz" : "");
        put(path, rawbuf, len, gz);
        struct fsdp_images *im;
        ASSERT_OK(fsdp_images_open_raw(ctx, path, 3, &im), ctx);
        struct fsdp_images_info info;
        fsdp_images_info(im, &info);
        CHECK_INT_EQ(info.count, 7);
        CHECK_INT_EQ(info.height, 5);
        CHECK_INT_EQ(info.width, 4);
        CHECK_INT_EQ(info.channels, 3);
        CHECK_INT_EQ(info.num_classes, 3);
        for (int i = 0; i < 7; i++) {
            CHECK_INT_EQ(fsdp_images_label(im, i), i % 3);
            const uint8_t *px = fsdp_images_pixels(im, i);
            for (int k = 0; k < 5 * 4 * 3; k++)
                if (px[k] != pixel(i, k)) {
                    TEST_FAILF("variant %d image %d byte %d: %d, expected %d", variant, i, k, px[k], pixel(i, k));
                    break;
                }
        }
        /* the batch reads it as any set: image 2's channel 1, pixel (1, 2) */
        struct fsdp_image_batch_opts o = plain_opts();
        float x[3 * 5 * 4];
        int32_t y;
        ASSERT_OK(fsdp_images_batch(ctx, im, &o, 2, 1, 0, 1, x, &y), ctx);
        CHECK_INT_EQ(y, 2);
        CHECK(x[(1 * 5 + 1) * 4 + 2] == (float)pixel(2, (1 * 4 + 2) * 3 + 1) / 255.0f);
        fsdp_images_free(im);
    }
    remove_dir(dir);
    /* a folder of raw files: train.fsdpimg (plain) and test.fsdpimg.gz, through fsdp_images_open */
    strcpy(dir, "/tmp/fsdp_raw_XXXXXX");
    ASSERT(mkdtemp(dir));
    struct fsdp_images *im = NULL;
    CHECK_INT_EQ(fsdp_images_open(ctx, dir, FSDP_SPLIT_TRAIN, 3, &im), FSDP_ERR_IO);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "no train-images-idx3-ubyte, train-images-idx3-ubyte.gz, train.fsdpimg or "
                                         "train.fsdpimg.gz there");
    size_t len = raw_file(rawbuf, 6, 2, 3, 1, 1, -1, -1, 0);
    snprintf(path, sizeof path, "%s/train.fsdpimg", dir);
    put(path, rawbuf, len, 0);
    len = raw_file(rawbuf, 2, 2, 3, 1, 4, -1, -1, 0);
    snprintf(path, sizeof path, "%s/test.fsdpimg.gz", dir);
    put(path, rawbuf, len, 1);
    struct fsdp_images_info info;
    ASSERT_OK(fsdp_images_open(ctx, dir, FSDP_SPLIT_TRAIN, 3, &im), ctx);
    fsdp_images_info(im, &info);
    CHECK_INT_EQ(info.count, 6);
    fsdp_images_free(im);
    ASSERT_OK(fsdp_images_open(ctx, dir, FSDP_SPLIT_TEST, 3, &im), ctx);
    fsdp_images_info(im, &info);
    CHECK_INT_EQ(info.count, 2);
    CHECK_INT_EQ(fsdp_images_label(im, 1), 1);
    fsdp_images_free(im);
    remove_dir(dir);
    fsdp_ctx_free(ctx);
}

static void expect_bad_raw(struct fsdp_ctx *ctx, const char *path, const uint8_t *b, size_t len, int gz, int nc,
                           const char *what) {
    put(path, b, len, gz);
    struct fsdp_images *im = (struct fsdp_images *)1;
    enum fsdp_status st = fsdp_images_open_raw(ctx, path, nc, &im);
    if (st == FSDP_OK) {
        TEST_FAILF("%s: accepted", what);
        fsdp_images_free(im);
        return;
    }
    CHECK(im == NULL);
    const char *msg = fsdp_errmsg(ctx);
    if (!strstr(msg, path) || !strstr(msg, what) || strchr(msg, '\n'))
        TEST_FAILF("%s: message \"%s\" should be one line naming '%s'", what, msg, path);
}

TEST(raw_images_reject_bad_files) {
    struct fsdp_ctx *ctx = make_ctx();
    char dir[64];
    make_set(dir);
    char bad[256];
    snprintf(bad, sizeof bad, "%s/bad.fsdpimg", dir);
    size_t len = raw_file(rawbuf, 4, 3, 2, 1, 4, -1, -1, 0);
    memcpy(rawbuf, "FSDPIMG2", 8);
    expect_bad_raw(ctx, bad, rawbuf, len, 0, 3, "magic is not FSDPIMG1");
    len = raw_file(rawbuf, 4, 3, 2, 1, 4, -1, -1, 0);
    expect_bad_raw(ctx, bad, rawbuf, 20, 0, 3, "too short for a raw image header");
    expect_bad_raw(ctx, bad, rawbuf, 20, 1, 3, "too short for a raw image header");
    expect_bad_raw(ctx, bad, rawbuf, len - 1, 0, 3, "truncated");
    expect_bad_raw(ctx, bad, rawbuf, len - 1, 1, 3, "truncated");
    expect_bad_raw(ctx, bad, rawbuf, 32 + 10, 0, 3, "truncated");
    rawbuf[len] = 0;
    expect_bad_raw(ctx, bad, rawbuf, len + 1, 0, 3, "longer than its header says");
    expect_bad_raw(ctx, bad, rawbuf, len + 1, 1, 3, "longer than its header says");
    len = raw_file(rawbuf, 0, 3, 2, 1, 4, -1, -1, 0);
    expect_bad_raw(ctx, bad, rawbuf, len, 0, 3, "image count 0");
    len = raw_file(rawbuf, 4, 3, 0, 1, 4, -1, -1, 0);
    expect_bad_raw(ctx, bad, rawbuf, len, 0, 3, "images of 3x0");
    len = raw_file(rawbuf, 2, 3, 2, 5, 1, -1, -1, 0);
    expect_bad_raw(ctx, bad, rawbuf, len, 0, 3, "5 channels");
    len = raw_file(rawbuf, 4, 3, 2, 1, 4, -1, -1, 0);
    put32(rawbuf + 24, 2);
    expect_bad_raw(ctx, bad, rawbuf, len, 0, 3, "label size 2");
    put32(rawbuf + 24, 4);
    put32(rawbuf + 28, 1);
    expect_bad_raw(ctx, bad, rawbuf, len, 0, 3, "reserved header field");
    len = raw_file(rawbuf, 4, 3, 2, 1, 4, -1, 2, 3);
    expect_bad_raw(ctx, bad, rawbuf, len, 0, 3, "label 3 of image 2");
    len = raw_file(rawbuf, 4, 3, 2, 1, 4, -1, 1, -5);
    expect_bad_raw(ctx, bad, rawbuf, len, 1, 3, "label -5 of image 1");
    len = raw_file(rawbuf, 4, 3, 2, 1, 1, -1, 3, 200);
    expect_bad_raw(ctx, bad, rawbuf, len, 0, 100, "label 200 of image 3");
    /* a huge announced size in a short file: refused before any allocation */
    len = raw_file(rawbuf, 4, 3, 2, 1, 4, -1, -1, 0);
    put32(rawbuf + 12, 65536), put32(rawbuf + 16, 65536);
    expect_bad_raw(ctx, bad, rawbuf, len, 0, 3, "truncated");
    struct fsdp_images *im = NULL;
    CHECK_INT_EQ(fsdp_images_open_raw(ctx, "/nonexistent/x.fsdpimg", 3, &im), FSDP_ERR_IO);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "/nonexistent/x.fsdpimg");
    remove_dir(dir);
    fsdp_ctx_free(ctx);
}

/* a raw set of n images h x w x c opened from a file in dir */
static struct fsdp_images *raw_set(struct fsdp_ctx *ctx, const char *dir, uint32_t n, uint32_t h, uint32_t w,
                                   uint32_t c, int fill) {
    char path[256];
    snprintf(path, sizeof path, "%s/crop.fsdpimg", dir);
    size_t len = raw_file(rawbuf, n, h, w, c, 1, fill, -1, 0);
    put(path, rawbuf, len, 0);
    struct fsdp_images *im = NULL;
    if (fsdp_images_open_raw(ctx, path, 3, &im) != FSDP_OK) TEST_FAILF("%s", fsdp_errmsg(ctx));
    return im;
}

TEST(random_resized_crop_boxes) {
    struct fsdp_ctx *ctx = make_ctx();
    char dir[64];
    make_set(dir);
    struct fsdp_images *im = raw_set(ctx, dir, 8, 24, 20, 1, -1);
    ASSERT(im);
    const float scales[3][2] = {{0.08f, 1.0f}, {0.14f, 1.0f}, {0.05f, 0.14f}};
    int moved = 0, fallback = 0;
    for (int sc = 0; sc < 3; sc++)
        for (int e = 0; e < 3; e++)
            for (int i = 0; i < 8; i++)
                for (int v = 0; v < 4; v++) {
                    struct fsdp_crop_box b, b2;
                    fsdp_images_crop_box(im, 9, e, i, v, scales[sc][0], scales[sc][1], &b);
                    fsdp_images_crop_box(im, 9, e, i, v, scales[sc][0], scales[sc][1], &b2);
                    CHECK(memcmp(&b, &b2, sizeof b) == 0); /* a pure function of its arguments */
                    if (b.top < 0 || b.left < 0 || b.height < 1 || b.width < 1 || b.top + b.height > 24 ||
                        b.left + b.width > 20)
                        TEST_FAILF("box %dx%d at (%d, %d) outside 24x20", b.height, b.width, b.top, b.left);
                    double area = (double)b.height * b.width / (24.0 * 20.0);
                    if (b.height == 24 && b.width == 20) fallback++;
                    /* rounding each side moves the area by at most about (h + w) / 2 + 1/4 pixels */
                    double slack = ((double)b.height + b.width) / 2.0 / (24.0 * 20.0) + 0.01;
                    if (!(b.height == 24 && b.width == 20) &&
                        (area < scales[sc][0] - slack || area > scales[sc][1] + slack))
                        TEST_FAILF("box %dx%d: area fraction %.3f outside [%.2f, %.2f]", b.height, b.width, area,
                                   (double)scales[sc][0], (double)scales[sc][1]);
                    moved += b.top != 0 || b.left != 0;
                }
    CHECK(moved > 100);
    CHECK(fallback < 20);
    /* views, epochs and seeds draw independently */
    struct fsdp_crop_box a, b, c, d;
    int differ_view = 0, differ_epoch = 0, differ_seed = 0;
    for (int i = 0; i < 8; i++) {
        fsdp_images_crop_box(im, 9, 0, i, 0, 0.08f, 1.0f, &a);
        fsdp_images_crop_box(im, 9, 0, i, 1, 0.08f, 1.0f, &b);
        fsdp_images_crop_box(im, 9, 1, i, 0, 0.08f, 1.0f, &c);
        fsdp_images_crop_box(im, 10, 0, i, 0, 0.08f, 1.0f, &d);
        differ_view += memcmp(&a, &b, sizeof a) != 0;
        differ_epoch += memcmp(&a, &c, sizeof a) != 0;
        differ_seed += memcmp(&a, &d, sizeof a) != 0;
    }
    CHECK(differ_view >= 6 && differ_epoch >= 6 && differ_seed >= 6);
    fsdp_images_free(im);
    /* no attempt fits a 3x40 image at scale 0.9-1 with ratios 3/4-4/3: the central 3x4 */
    im = raw_set(ctx, dir, 2, 3, 40, 1, -1);
    ASSERT(im);
    fsdp_images_crop_box(im, 1, 0, 1, 0, 0.9f, 1.0f, &a);
    CHECK_INT_EQ(a.height, 3);
    CHECK_INT_EQ(a.width, 4);
    CHECK_INT_EQ(a.top, 0);
    CHECK_INT_EQ(a.left, 18);
    fsdp_images_free(im);
    remove_dir(dir);
    fsdp_ctx_free(ctx);
}

TEST(random_resized_crop_values) {
    struct fsdp_ctx *ctx = make_ctx();
    char dir[64];
    make_set(dir);
    /* a constant image stays constant at any box and size */
    struct fsdp_images *im = raw_set(ctx, dir, 3, 17, 13, 2, 77);
    ASSERT(im);
    static float out[2 * 40 * 40];
    for (int v = 0; v < 6; v++) {
        int oh = 5 + 7 * v, ow = 40 - 5 * v;
        ASSERT_OK(fsdp_images_random_resized_crop(ctx, im, 4, 2, 1, v, oh, ow, 0.05f, 1.0f, out), ctx);
        for (int k = 0; k < 2 * oh * ow; k++)
            if (out[k] != 77.0f / 255.0f) {
                TEST_FAILF("view %d (%dx%d) value %d: %.9g, expected %.9g", v, oh, ow, k, (double)out[k],
                           77.0 / 255.0);
                break;
            }
    }
    fsdp_images_free(im);
    /* scale 1 on a square image to its own size: the image itself */
    im = raw_set(ctx, dir, 4, 6, 6, 3, -1);
    ASSERT(im);
    for (int i = 0; i < 4; i++)
        for (int v = 0; v < 3; v++) {
            ASSERT_OK(fsdp_images_random_resized_crop(ctx, im, 5, 3, i, v, 6, 6, 1.0f, 1.0f, out), ctx);
            const uint8_t *px = fsdp_images_pixels(im, i);
            for (int c = 0; c < 3; c++)
                for (int k = 0; k < 36; k++)
                    if (out[c * 36 + k] != (float)px[k * 3 + c] / 255.0f) {
                        TEST_FAILF("image %d view %d channel %d pixel %d: %.9g, expected %.9g", i, v, c, k,
                                   (double)out[c * 36 + k], (double)px[k * 3 + c] / 255.0);
                        c = 3;
                        break;
                    }
        }
    /* a box upsampled 2x: bilinear, half-pixel centres (torch's align_corners=False) */
    struct fsdp_crop_box box = {1, 2, 2, 3};
    ASSERT_OK(fsdp_images_resized_crop(ctx, im, 1, &box, 4, 6, out), ctx);
    const uint8_t *px = fsdp_images_pixels(im, 1);
#define PX(y, x) ((float)px[((y) * 6 + (x)) * 3] / 255.0f)
    /* output (1, 3): source (0.25, 1.25) inside the box, i.e. rows 1-2, columns 3-4 */
    float top = PX(1, 3) + 0.25f * (PX(1, 4) - PX(1, 3)), bot = PX(2, 3) + 0.25f * (PX(2, 4) - PX(2, 3));
    CHECK_NEAR(out[1 * 6 + 3], top + 0.25f * (bot - top), 1e-6, 1e-7);
    CHECK(out[0] == PX(1, 2)); /* (0, 0): source clamped to the corner */
    CHECK(out[3 * 6 + 5] == PX(2, 4)); /* the far corner */
#undef PX
    /* bad arguments */
    struct fsdp_crop_box outside = {5, 0, 2, 2};
    CHECK_INT_EQ(fsdp_images_resized_crop(ctx, im, 1, &outside, 4, 4, out), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "not inside");
    struct fsdp_crop_box wraps[2] = {{INT32_MAX, 0, 10, 1}, {0, INT32_MAX - 1, 1, 5}}; /* top + height wrapped int */
    for (int k = 0; k < 2; k++) {
        CHECK_INT_EQ(fsdp_images_resized_crop(ctx, im, 1, &wraps[k], 4, 4, out), FSDP_ERR_INVALID);
        CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "not inside");
    }
    CHECK_INT_EQ(fsdp_images_random_resized_crop(ctx, im, 1, 0, 4, 0, 4, 4, 0.1f, 1.0f, out), FSDP_ERR_INVALID);
    CHECK_INT_EQ(fsdp_images_random_resized_crop(ctx, im, 1, 0, 0, 0, 0, 4, 0.1f, 1.0f, out), FSDP_ERR_INVALID);
    CHECK_INT_EQ(fsdp_images_random_resized_crop(ctx, im, 1, 0, 0, 0, 4, 4, 0.5f, 0.2f, out), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "scale");
    CHECK_INT_EQ(fsdp_images_random_resized_crop(ctx, im, 1, 0, 0, 0, 4, 4, 0.0f, 1.0f, out), FSDP_ERR_INVALID);
    fsdp_images_free(im);
    remove_dir(dir);
    fsdp_ctx_free(ctx);
}

TEST(random_resized_crop_batch_same_at_every_world_size) {
    struct fsdp_ctx *ctx = make_ctx();
    char dir[64];
    make_set(dir);
    struct fsdp_images *im;
    ASSERT_OK(fsdp_images_open(ctx, dir, FSDP_SPLIT_TRAIN, 3, &im), ctx);
    struct fsdp_image_batch_opts o = fsdp_image_batch_opts_default();
    o.seed = 7;
    o.resized_crop = 1;
    o.hflip = 1;
    enum { B = 6, STEPS = 5 };
    static float ref[STEPS][B * H * W], got[B * H * W];
    int32_t yref[STEPS][B], ygot[B];
    for (int s = 0; s < STEPS; s++) global_batch(ctx, im, &o, s, B, 1, ref[s], yref[s]);
    for (int world = 2; world <= 4; world++)
        for (int s = STEPS - 1; s >= 0; s--) {
            global_batch(ctx, im, &o, s, B, world, got, ygot);
            CHECK(memcmp(got, ref[s], sizeof got) == 0);
            CHECK(memcmp(ygot, yref[s], sizeof ygot) == 0);
        }
    /* each image is its (seed, epoch, index) crop, flipped or not, normalised */
    struct fsdp_image_batch_opts p = o;
    p.shuffle = 0;
    for (int c = 0; c < 4; c++) p.mean[c] = 0.5f, p.std[c] = 2.0f;
    float x[H * W], crop[H * W];
    int32_t y;
    int flipped = 0, cropped = 0;
    for (int k = 0; k < N; k++) {
        ASSERT_OK(fsdp_images_batch(ctx, im, &p, N + k, 1, 0, 1, x, &y), ctx); /* epoch 1, image k */
        ASSERT_OK(fsdp_images_random_resized_crop(ctx, im, 7, 1, k, 0, H, W, 0.08f, 1.0f, crop), ctx);
        int same = 1, mirror = 1;
        for (int r = 0; r < H; r++)
            for (int c = 0; c < W; c++) {
                same &= x[r * W + c] == (crop[r * W + c] - 0.5f) / 2.0f;
                mirror &= x[r * W + c] == (crop[r * W + W - 1 - c] - 0.5f) / 2.0f;
            }
        CHECK(same || mirror);
        flipped += !same;
        cropped += crop[0] != (float)pixel(k, 0) / 255.0f;
    }
    CHECK(flipped > 0 && flipped < N);
    CHECK(cropped > 0);
    o.crop_padding = 1;
    CHECK_INT_EQ(fsdp_images_batch(ctx, im, &o, 0, B, 0, 1, got, ygot), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "exclusive");
    fsdp_images_free(im);
    remove_dir(dir);
    fsdp_ctx_free(ctx);
}

TEST_MAIN()
