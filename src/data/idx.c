/*
 * idx.c - image sets in the IDX format of MNIST and Fashion-MNIST, plain or
 * gzip-compressed (inflated by zlib, [Note: IDX bytes]), and
 * the world-size-independent image batch: per-epoch shuffle and
 * augmentations (random crop with zero padding, horizontal flip) drawn from
 * the counter-based RNG, normalisation to NCHW fp32.
 * IDX: 2 zero bytes, a type byte (0x08: unsigned bytes, the only one used by
 * these sets), a dimension count, then each dimension as a big-endian
 * uint32, then the data, row-major. Images are N x H x W (or N x H x W x C),
 * labels N.
 * Invariants: count >= 1; every label < num_classes; pix holds count x H x W
 * x C bytes (HWC per image); perm, when valid, is the permutation of epoch
 * perm_epoch under perm_seed.
 * [Note: image stream] Global position g of the training stream is image
 * perm_e[g mod count] of epoch e = g / count. Epoch e's permutation is a
 * Fisher-Yates shuffle whose i-th swap is drawn from Philox at (key(seed),
 * e * 2^32 + i); image idx's augmentation in epoch e from Philox at
 * (key'(seed), e * count + idx). Neither depends on the rank or the world
 * size, so the global batch is the same at every world size.
 */
#include "data/data-impl.h"

#include <errno.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#define FASHION_MNIST_DIR "/usr/share/datasets/fashion-mnist"
#define IDX_MAX_BYTES ((int64_t)1 << 36)

struct fsdp_images {
    struct fsdp_ctx *ctx;   /* borrowed: accounts pix and labels */
    int64_t count;
    int channels, height, width, num_classes;
    uint8_t *pix;           /* (count, height, width, channels) */
    int32_t *labels;        /* (count) */
    int32_t *perm;          /* (count) epoch perm_epoch's order, or NULL */
    int64_t perm_epoch;
    uint64_t perm_seed;
};

/* [Note: IDX bytes] A file is read whole into memory and parsed from
 * there (fsdp__images_open_mem: the fuzz target and the corpus replay run
 * exactly this code). Bytes starting with gzip's magic (1f 8b) are inflated
 * by zlib as they are parsed, member after member (gzip -c a b > c is one
 * file), anything else is taken as plain IDX. The data's claimed size is
 * checked against what the input can hold before it is allocated: plain,
 * the bytes left; gzip, 1032 times them (deflate's largest ratio), so a
 * short input cannot make the reader allocate gigabytes. */
#define DEFLATE_MAX_RATIO 1032

struct bytes_in {           /* a plain or gzip'd byte source in memory */
    const uint8_t *buf;
    size_t len, pos;        /* plain: the next byte; gzip: consumed by zlib */
    int gz, zinit, zend;    /* gzip stream, inflate initialised, last member ended */
    z_stream zs;
};

static void bytes_close(struct bytes_in *b) {
    if (b->zinit) inflateEnd(&b->zs);
    b->zinit = 0;
}

/* Reads up to n bytes into dst; *got is how many. FSDP_ERR_FORMAT naming
 * `name` for a corrupt gzip stream or bytes after its last member. */
static enum fsdp_status bytes_read(struct fsdp_ctx *ctx, const char *name, struct bytes_in *b, uint8_t *dst,
                                   size_t n, size_t *got) {
    *got = 0;
    if (!b->gz) {
        size_t k = n < b->len - b->pos ? n : b->len - b->pos;
        if (k) memcpy(dst, b->buf + b->pos, k);
        b->pos += k;
        *got = k;
        return FSDP_OK;
    }
    while (*got < n && !b->zend) {
        size_t want = n - *got > (1u << 30) ? (1u << 30) : n - *got;
        b->zs.next_out = dst + *got;
        b->zs.avail_out = (uInt)want;
        int r = inflate(&b->zs, Z_NO_FLUSH);
        *got += want - b->zs.avail_out;
        if (r == Z_STREAM_END) {
            if (b->zs.avail_in == 0) b->zend = 1;
            else if (b->zs.avail_in >= 2 && b->zs.next_in[0] == 0x1f && b->zs.next_in[1] == 0x8b)
                inflateReset(&b->zs); /* the next member */
            else
                return fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': %u bytes after the end of the gzip data", name,
                                 b->zs.avail_in);
        } else if (r == Z_BUF_ERROR) { /* no progress: the input is used up before the stream's end */
            return fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': truncated gzip data", name);
        } else if (r != Z_OK && r != Z_BUF_ERROR) {
            return fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': corrupt gzip data (%s)", name,
                             b->zs.msg ? b->zs.msg : "inflate failed");
        }
    }
    return FSDP_OK;
}

/* An IDX file of unsigned bytes in buf[0..len) (the file `name`): its
 * dimensions and data (from fsdp__alloc). ndim_lo..ndim_hi dimensions. */
static enum fsdp_status idx_parse(struct fsdp_ctx *ctx, const char *name, const uint8_t *buf, size_t len,
                                  int ndim_lo, int ndim_hi, int *ndim, int64_t dims[4], uint8_t **data) {
    *data = NULL;
    struct bytes_in b;
    memset(&b, 0, sizeof b);
    b.buf = buf;
    b.len = len;
    b.gz = len >= 2 && buf[0] == 0x1f && buf[1] == 0x8b;
    if (b.gz) {
        b.zs.next_in = (Bytef *)(uintptr_t)buf;
        b.zs.avail_in = (uInt)(len > UINT32_MAX ? UINT32_MAX : len);
        if (len > UINT32_MAX)
            return fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': gzip'd files of 4 GiB and more are not read", name);
        if (inflateInit2(&b.zs, 15 + 16) != Z_OK)
            return fsdp__err(ctx, FSDP_ERR_NOMEM, "'%s': cannot start inflating", name);
        b.zinit = 1;
    }
    enum fsdp_status st;
    uint8_t h[4 + 4 * 4];
    size_t got;
    if ((st = bytes_read(ctx, name, &b, h, 4, &got)) != FSDP_OK) goto out;
    if (got < 4) {
        st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': too short for an IDX header", name);
        goto out;
    }
    if (h[0] != 0 || h[1] != 0 || h[2] != 0x08) {
        st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': not an IDX file of unsigned bytes (magic 0x%02x%02x%02x%02x)",
                       name, h[0], h[1], h[2], h[3]);
        goto out;
    }
    *ndim = h[3];
    if (*ndim < ndim_lo || *ndim > ndim_hi) {
        if (ndim_lo == ndim_hi)
            st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': %d dimensions, expected %d", name, *ndim, ndim_lo);
        else
            st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': %d dimensions, expected %d to %d", name, *ndim, ndim_lo,
                           ndim_hi);
        goto out;
    }
    if ((st = bytes_read(ctx, name, &b, h + 4, (size_t)(4 * *ndim), &got)) != FSDP_OK) goto out;
    if (got < (size_t)(4 * *ndim)) {
        st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': truncated in its header", name);
        goto out;
    }
    int64_t bytes = 1;
    for (int d = 0; d < *ndim; d++) {
        const uint8_t *p = h + 4 + 4 * d;
        dims[d] = (int64_t)((uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3]);
        if (dims[d] <= 0 || dims[d] > IDX_MAX_BYTES / bytes) {
            st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': dimension %d is %lld (empty or too large)", name, d,
                           (long long)dims[d]);
            goto out;
        }
        bytes *= dims[d];
    }
    /* [Note: IDX bytes]: no allocation the input cannot fill */
    double room = b.gz ? (double)DEFLATE_MAX_RATIO * (double)len + 64.0 : (double)(len - b.pos);
    if ((double)bytes > room) {
        st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': truncated: %lld data bytes announced, the file holds at most "
                       "%.0f", name, (long long)bytes, room);
        goto out;
    }
    if (!(*data = fsdp__alloc(ctx, (size_t)bytes, FSDP_MEM_OTHER, name))) {
        st = FSDP_ERR_NOMEM;
        goto out;
    }
    if ((st = bytes_read(ctx, name, &b, *data, (size_t)bytes, &got)) != FSDP_OK) goto out;
    if ((int64_t)got < bytes) {
        st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': truncated: %lld of %lld data bytes", name, (long long)got,
                       (long long)bytes);
        goto out;
    }
    uint8_t extra;
    if ((st = bytes_read(ctx, name, &b, &extra, 1, &got)) != FSDP_OK) goto out;
    if (got)
        st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': longer than its header says (%lld data bytes)", name,
                       (long long)bytes);
out:
    bytes_close(&b);
    if (st != FSDP_OK) {
        fsdp__free(ctx, *data);
        *data = NULL;
    }
    return st;
}

enum fsdp_status fsdp__images_open_mem(struct fsdp_ctx *ctx, const char *images_name, const void *images,
                                       size_t images_len, const char *labels_name, const void *labels,
                                       size_t labels_len, int num_classes, struct fsdp_images **out) {
    *out = NULL;
    if (num_classes < 1 || num_classes > 256)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "'%s': num_classes %d must be in [1, 256]", labels_name, num_classes);
    int nd_i, nd_l;
    int64_t di[4] = {0}, dl[4] = {0};
    uint8_t *pix = NULL, *lab = NULL;
    FSDP_TRY(idx_parse(ctx, images_name, images, images_len, 3, 4, &nd_i, di, &pix));
    enum fsdp_status st = idx_parse(ctx, labels_name, labels, labels_len, 1, 1, &nd_l, dl, &lab);
    struct fsdp_images *im = NULL;
    if (st == FSDP_OK && dl[0] != di[0])
        st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': %lld labels for the %lld images of '%s'", labels_name,
                       (long long)dl[0], (long long)di[0], images_name);
    if (st == FSDP_OK && nd_i == 4 && di[3] > 4)
        st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': %lld channels (at most 4)", images_name, (long long)di[3]);
    if (st == FSDP_OK && (di[1] > 65536 || di[2] > 65536))
        st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': images of %lldx%lld are too large", images_name,
                       (long long)di[1], (long long)di[2]);
    if (st == FSDP_OK && di[0] > INT32_MAX)
        st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': %lld images (at most 2^31 - 1)", images_name, (long long)di[0]);
    for (int64_t i = 0; st == FSDP_OK && i < dl[0]; i++)
        if (lab[i] >= num_classes)
            st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': label %d of image %lld is not below num_classes %d",
                           labels_name, lab[i], (long long)i, num_classes);
    if (st == FSDP_OK && !(im = calloc(1, sizeof *im)))
        st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory opening '%s'", images_name);
    if (st == FSDP_OK && !(im->labels = fsdp__alloc(ctx, (size_t)dl[0] * sizeof(int32_t), FSDP_MEM_OTHER, labels_name)))
        st = FSDP_ERR_NOMEM;
    if (st != FSDP_OK) {
        free(im);
        fsdp__free(ctx, pix);
        fsdp__free(ctx, lab);
        return st;
    }
    for (int64_t i = 0; i < dl[0]; i++) im->labels[i] = lab[i];
    fsdp__free(ctx, lab);
    im->ctx = ctx;
    im->count = di[0];
    im->height = (int)di[1];
    im->width = (int)di[2];
    im->channels = nd_i == 4 ? (int)di[3] : 1;
    im->num_classes = num_classes;
    im->pix = pix;
    im->perm_epoch = -1;
    *out = im;
    return FSDP_OK;
}

/* The whole file at path (from fsdp__alloc) */
static enum fsdp_status read_file(struct fsdp_ctx *ctx, const char *path, uint8_t **buf, size_t *len) {
    *buf = NULL;
    int fd;
    uint64_t size;
    FSDP_TRY(fsdp__open_regular(ctx, NULL, path, &fd, &size)); /* a FIFO is refused, not waited on */
    size_t n = (size_t)size;
    if (!(*buf = fsdp__alloc(ctx, n ? n : 1, FSDP_MEM_OTHER, path))) {
        close(fd);
        return FSDP_ERR_NOMEM;
    }
    size_t got = 0;
    int err = 0;
    while (got < n) {
        ssize_t r = read(fd, *buf + got, n - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            err = r < 0 ? errno : 0;
            break;
        }
        got += (size_t)r;
    }
    close(fd);
    if (got != n) {
        fsdp__free(ctx, *buf);
        *buf = NULL;
        return fsdp__err(ctx, FSDP_ERR_IO, "cannot read '%s': %s", path, err ? strerror(err) : "short read");
    }
    *len = n;
    return FSDP_OK;
}

enum fsdp_status fsdp_images_open_idx(struct fsdp_ctx *ctx, const char *images_path, const char *labels_path,
                                      int num_classes, struct fsdp_images **out) {
    *out = NULL;
    uint8_t *ib = NULL, *lb = NULL;
    size_t il = 0, ll = 0;
    enum fsdp_status st = read_file(ctx, images_path, &ib, &il);
    if (st == FSDP_OK) st = read_file(ctx, labels_path, &lb, &ll);
    if (st == FSDP_OK) st = fsdp__images_open_mem(ctx, images_path, ib, il, labels_path, lb, ll, num_classes, out);
    fsdp__free(ctx, ib);
    fsdp__free(ctx, lb);
    return st;
}

/* dir/name if it exists, else dir/name.gz if that does, else an error */
static enum fsdp_status find_file(struct fsdp_ctx *ctx, const char *dir, const char *name, char *out, size_t cap) {
    struct stat sb;
    snprintf(out, cap, "%s/%s", dir, name);
    if (stat(out, &sb) == 0) return FSDP_OK;
    snprintf(out, cap, "%s/%s.gz", dir, name);
    if (stat(out, &sb) == 0) return FSDP_OK;
    return fsdp__err(ctx, FSDP_ERR_IO, "'%s': no %s or %s.gz there", dir, name, name);
}

enum fsdp_status fsdp_images_open(struct fsdp_ctx *ctx, const char *dir, enum fsdp_split split, int num_classes,
                                  struct fsdp_images **out) {
    *out = NULL;
    struct stat sb;
    if (strcmp(dir, "fashion-mnist") == 0) {
        if (stat(FASHION_MNIST_DIR, &sb) != 0)
            return fsdp__err(ctx, FSDP_ERR_IO, "fashion-mnist: %s is missing (install Debian's dataset-fashion-mnist)",
                             FASHION_MNIST_DIR);
        dir = FASHION_MNIST_DIR;
    }
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return fsdp__err(ctx, FSDP_ERR_IO, "'%s': not a folder of IDX files", dir);
    const char *pre = split == FSDP_SPLIT_TRAIN ? "train" : "t10k";
    char iname[64], lname[64], ipath[4096], lpath[4096];
    snprintf(iname, sizeof iname, "%s-images-idx3-ubyte", pre);
    snprintf(lname, sizeof lname, "%s-labels-idx1-ubyte", pre);
    FSDP_TRY(find_file(ctx, dir, iname, ipath, sizeof ipath));
    FSDP_TRY(find_file(ctx, dir, lname, lpath, sizeof lpath));
    return fsdp_images_open_idx(ctx, ipath, lpath, num_classes, out);
}

void fsdp_images_free(struct fsdp_images *im) {
    if (!im) return;
    fsdp__free(im->ctx, im->pix);
    fsdp__free(im->ctx, im->labels);
    free(im->perm);
    free(im);
}

void fsdp_images_info(const struct fsdp_images *im, struct fsdp_images_info *out) {
    out->count = im->count;
    out->channels = im->channels;
    out->height = im->height;
    out->width = im->width;
    out->num_classes = im->num_classes;
}

const uint8_t *fsdp_images_pixels(const struct fsdp_images *im, int64_t i) {
    return im->pix + i * (int64_t)im->height * im->width * im->channels;
}

int32_t fsdp_images_label(const struct fsdp_images *im, int64_t i) { return im->labels[i]; }

struct fsdp_image_batch_opts fsdp_image_batch_opts_default(void) {
    struct fsdp_image_batch_opts o;
    memset(&o, 0, sizeof o);
    o.shuffle = 1;
    for (int c = 0; c < 4; c++) {
        o.mean[c] = 0.2860f;
        o.std[c] = 0.3530f;
    }
    return o;
}

static uint64_t stream_key(uint64_t seed, const char *what) {
    return fsdp__hash_str(what) ^ (seed * 0x9E3779B97F4A7C15ull);
}

/* epoch e's permutation into im->perm ([Note: image stream]) */
static enum fsdp_status make_perm(struct fsdp_ctx *ctx, struct fsdp_images *im, uint64_t seed, int64_t e) {
    if (im->perm && im->perm_epoch == e && im->perm_seed == seed) return FSDP_OK;
    if (!im->perm && !(im->perm = malloc((size_t)im->count * sizeof(int32_t))))
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory shuffling %lld images", (long long)im->count);
    int32_t *p = im->perm;
    for (int64_t i = 0; i < im->count; i++) p[i] = (int32_t)i;
    uint64_t key = stream_key(seed, "fsdp.images.shuffle");
    for (int64_t i = im->count - 1; i > 0; i--) {
        uint32_t r[4];
        fsdp__philox(key, (uint64_t)e << 32 | (uint64_t)i, r);
        uint64_t u = (uint64_t)r[0] << 32 | r[1];
        int64_t j = (int64_t)(u % (uint64_t)(i + 1));
        int32_t t = p[i];
        p[i] = p[j];
        p[j] = t;
    }
    im->perm_epoch = e;
    im->perm_seed = seed;
    return FSDP_OK;
}

enum fsdp_status fsdp_images_batch(struct fsdp_ctx *ctx, struct fsdp_images *im, const struct fsdp_image_batch_opts *o,
                                   int64_t step, int64_t B, int rank, int world, float *x, int32_t *labels) {
    if (B <= 0 || world < 1 || rank < 0 || rank >= world || step < 0 || o->crop_padding < 0 ||
        o->crop_padding > 65536)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "image batch: step %lld, B %lld, rank %d of %d, crop padding %d",
                         (long long)step, (long long)B, rank, world, o->crop_padding);
    int C = im->channels, H = im->height, W = im->width, P = o->crop_padding;
    for (int c = 0; c < C; c++)
        if (!(o->std[c] > 0.0f))
            return fsdp__err(ctx, FSDP_ERR_INVALID, "image batch: std[%d] = %g must be positive", c, (double)o->std[c]);
    int64_t lo = (int64_t)rank * B / world, hi = (int64_t)(rank + 1) * B / world;
    uint64_t akey = stream_key(o->seed, "fsdp.images.augment");
    for (int64_t j = lo; j < hi; j++) {
        int64_t g = step * B + j, e = g / im->count, k = g % im->count;
        if (o->shuffle) FSDP_TRY(make_perm(ctx, im, o->seed, e));
        int64_t idx = o->shuffle ? im->perm[k] : k;
        int ox = P, oy = P, flip = 0;
        if (P > 0 || o->hflip) {
            uint32_t r[4];
            fsdp__philox(akey, (uint64_t)e * (uint64_t)im->count + (uint64_t)idx, r);
            if (P > 0) {
                ox = (int)(r[0] % (uint32_t)(2 * P + 1));
                oy = (int)(r[1] % (uint32_t)(2 * P + 1));
            }
            flip = o->hflip && (r[2] & 1u);
        }
        const uint8_t *src = fsdp_images_pixels(im, idx);
        float *dst = x + (j - lo) * (int64_t)C * H * W;
        for (int c = 0; c < C; c++)
            for (int y = 0; y < H; y++) {
                int sy = y + oy - P;
                for (int xx = 0; xx < W; xx++) {
                    int sx = (flip ? W - 1 - xx : xx) + ox - P;
                    int p = sy >= 0 && sy < H && sx >= 0 && sx < W ? src[((int64_t)sy * W + sx) * C + c] : 0;
                    /* as torchvision's ToTensor then Normalize, operation for operation */
                    dst[((int64_t)c * H + y) * W + xx] = ((float)p / 255.0f - o->mean[c]) / o->std[c];
                }
            }
        labels[j - lo] = im->labels[idx];
    }
    return FSDP_OK;
}
