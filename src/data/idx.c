/*
 * idx.c - image sets in the IDX format of MNIST and Fashion-MNIST, plain or
 * gzip-compressed (inflated by zlib, [Note: IDX bytes]), and
 * fsdp.c's raw format for any other set ([Note: raw image format]), and
 * the world-size-independent image batch: per-epoch shuffle and
 * augmentations (random crop with zero padding, random resized crop
 * [Note: random resized crop], horizontal flip) drawn from the
 * counter-based RNG, normalisation to NCHW fp32.
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
#include <math.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#define FASHION_MNIST_DIR "/usr/share/datasets/fashion-mnist"
#define IDX_MAX_BYTES ((int64_t)1 << 36)
#define FSDP_IMAGES_MAX_CLASSES (1 << 24) /* raw files' int32 labels */

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
    double product = 1.0;
    char shape[80] = "";
    for (int d = 0; d < *ndim; d++) {
        const uint8_t *p = h + 4 + 4 * d;
        dims[d] = (int64_t)((uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3]);
        if (dims[d] == 0) {
            st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': dimension %d is 0 (an empty file)", name, d);
            goto out;
        }
        product *= (double)dims[d];
        size_t o = strlen(shape);
        snprintf(shape + o, sizeof shape - o, "%s%lld", d ? " x " : "", (long long)dims[d]);
    }
    /* the whole shape named: the first dimension (the item count) is the one a
     * damaged header usually makes absurd, while the product only overflows later */
    if (product > (double)IDX_MAX_BYTES) {
        st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': its header announces %s = %.0f bytes, more than the %lld "
                       "an IDX file is read with", name, shape, product, (long long)IDX_MAX_BYTES);
        goto out;
    }
    for (int d = 0; d < *ndim; d++) bytes *= dims[d];
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
    if (st == FSDP_OK && !(im = fsdp__zalloc(1, sizeof *im)))
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

/* ---- The raw format ----
 * [Note: raw image format] For any image set that is not IDX: a 32-byte
 * header, all fields little-endian,
 *   bytes 0-7    magic "FSDPIMG1"
 *   8-11         count N (uint32, >= 1, < 2^31)
 *   12-15        height H (uint32, 1..65536)
 *   16-19        width W (uint32, 1..65536)
 *   20-23        channels C (uint32, 1..4)
 *   24-27        label size in bytes: 1 (uint8 labels) or 4 (int32)
 *   28-31        0 (reserved)
 * then N x H x W x C uint8 pixels (image after image, each row-major HWC),
 * then N labels; nothing after. The whole file may be gzip-compressed, read
 * as IDX files are ([Note: IDX bytes]). */
#define RAW_MAGIC "FSDPIMG1"
#define RAW_HEADER 32

static uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

enum fsdp_status fsdp__images_open_raw_mem(struct fsdp_ctx *ctx, const char *name, const void *data, size_t len,
                                           int num_classes, struct fsdp_images **out) {
    *out = NULL;
    if (num_classes < 1 || num_classes > FSDP_IMAGES_MAX_CLASSES)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "'%s': num_classes %d must be in [1, %d]", name, num_classes,
                         FSDP_IMAGES_MAX_CLASSES);
    const uint8_t *buf = data;
    struct bytes_in b;
    memset(&b, 0, sizeof b);
    b.buf = buf;
    b.len = len;
    b.gz = len >= 2 && buf[0] == 0x1f && buf[1] == 0x8b;
    if (b.gz) {
        if (len > UINT32_MAX)
            return fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': gzip'd files of 4 GiB and more are not read", name);
        b.zs.next_in = (Bytef *)(uintptr_t)buf;
        b.zs.avail_in = (uInt)len;
        if (inflateInit2(&b.zs, 15 + 16) != Z_OK)
            return fsdp__err(ctx, FSDP_ERR_NOMEM, "'%s': cannot start inflating", name);
        b.zinit = 1;
    }
    uint8_t *pix = NULL, *lab = NULL;
    struct fsdp_images *im = NULL;
    uint8_t h[RAW_HEADER];
    size_t got;
    enum fsdp_status st = bytes_read(ctx, name, &b, h, RAW_HEADER, &got);
    if (st != FSDP_OK) goto out;
    if (got >= 8 && memcmp(h, RAW_MAGIC, 8) != 0) {
        st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': not an fsdp.c raw image file (magic is not %s)", name, RAW_MAGIC);
        goto out;
    }
    if (got < RAW_HEADER) {
        st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': too short for a raw image header (%zu of %d bytes)", name, got,
                       RAW_HEADER);
        goto out;
    }
    uint32_t n = le32(h + 8), hh = le32(h + 12), ww = le32(h + 16), cc = le32(h + 20), ls = le32(h + 24);
    if (n < 1 || n > INT32_MAX) st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': image count %u out of range [1, 2^31 - 1]", name, n);
    else if (hh < 1 || hh > 65536 || ww < 1 || ww > 65536)
        st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': images of %ux%u (each side 1 to 65536)", name, hh, ww);
    else if (cc < 1 || cc > 4) st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': %u channels (1 to 4)", name, cc);
    else if (ls != 1 && ls != 4) st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': label size %u (1 or 4 bytes)", name, ls);
    else if (le32(h + 28) != 0) st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': reserved header field is not 0", name);
    if (st != FSDP_OK) goto out;
    int64_t per = (int64_t)hh * ww * cc;
    if (per > IDX_MAX_BYTES / n) {
        st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': %u images of %lld bytes are too large", name, n, (long long)per);
        goto out;
    }
    int64_t pbytes = per * n, lbytes = (int64_t)ls * n;
    double room = b.gz ? (double)DEFLATE_MAX_RATIO * (double)len + 64.0 : (double)(len - b.pos);
    if ((double)(pbytes + lbytes) > room) {
        st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': truncated: %lld data bytes announced, the file holds at most %.0f",
                       name, (long long)(pbytes + lbytes), room);
        goto out;
    }
    if (!(pix = fsdp__alloc(ctx, (size_t)pbytes, FSDP_MEM_OTHER, name)) ||
        !(lab = fsdp__alloc(ctx, (size_t)lbytes, FSDP_MEM_OTHER, name))) {
        st = FSDP_ERR_NOMEM;
        goto out;
    }
    if ((st = bytes_read(ctx, name, &b, pix, (size_t)pbytes, &got)) != FSDP_OK) goto out;
    size_t got_l = 0;
    if ((int64_t)got == pbytes && (st = bytes_read(ctx, name, &b, lab, (size_t)lbytes, &got_l)) != FSDP_OK) goto out;
    if ((int64_t)got < pbytes || (int64_t)got_l < lbytes) {
        st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': truncated: %lld of %lld data bytes", name,
                       (long long)(got + got_l), (long long)(pbytes + lbytes));
        goto out;
    }
    uint8_t extra;
    if ((st = bytes_read(ctx, name, &b, &extra, 1, &got)) != FSDP_OK) goto out;
    if (got) {
        st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': longer than its header says (%lld data bytes)", name,
                       (long long)(pbytes + lbytes));
        goto out;
    }
    if (!(im = fsdp__zalloc(1, sizeof *im))) {
        st = fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory opening '%s'", name);
        goto out;
    }
    if (!(im->labels = fsdp__alloc(ctx, (size_t)n * sizeof(int32_t), FSDP_MEM_OTHER, name))) {
        st = FSDP_ERR_NOMEM;
        goto out;
    }
    for (uint32_t i = 0; i < n; i++) {
        int32_t v = ls == 1 ? (int32_t)lab[i] : (int32_t)le32(lab + 4 * (size_t)i);
        if (v < 0 || v >= num_classes) {
            st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': label %d of image %u is not in [0, num_classes %d)", name, v,
                           i, num_classes);
            goto out;
        }
        im->labels[i] = v;
    }
    im->ctx = ctx;
    im->count = n;
    im->height = (int)hh;
    im->width = (int)ww;
    im->channels = (int)cc;
    im->num_classes = num_classes;
    im->pix = pix;
    im->perm_epoch = -1;
    pix = NULL;
out:
    bytes_close(&b);
    fsdp__free(ctx, lab);
    if (st != FSDP_OK) {
        if (im) fsdp__free(ctx, im->labels);
        free(im);
        im = NULL;
    }
    fsdp__free(ctx, pix);
    *out = im;
    return st;
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

enum fsdp_status fsdp_images_open_raw(struct fsdp_ctx *ctx, const char *path, int num_classes,
                                      struct fsdp_images **out) {
    *out = NULL;
    uint8_t *buf = NULL;
    size_t len = 0;
    FSDP_TRY(read_file(ctx, path, &buf, &len));
    enum fsdp_status st = fsdp__images_open_raw_mem(ctx, path, buf, len, num_classes, out);
    fsdp__free(ctx, buf);
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
    if (find_file(ctx, dir, iname, ipath, sizeof ipath) != FSDP_OK) { /* no IDX images: a raw file? */
        char rname[64];
        snprintf(rname, sizeof rname, "%s.fsdpimg", split == FSDP_SPLIT_TRAIN ? "train" : "test");
        if (find_file(ctx, dir, rname, ipath, sizeof ipath) == FSDP_OK)
            return fsdp_images_open_raw(ctx, ipath, num_classes, out);
        return fsdp__err(ctx, FSDP_ERR_IO, "'%s': no %s, %s.gz, %s or %s.gz there", dir, iname, iname, rname, rname);
    }
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
    o.crop_scale[0] = 0.08f;
    o.crop_scale[1] = 1.0f;
    for (int c = 0; c < 4; c++) {
        o.mean[c] = 0.2860f;
        o.std[c] = 0.3530f;
    }
    return o;
}

static uint64_t stream_key(uint64_t seed, const char *what) {
    return fsdp__hash_str(what) ^ (seed * 0x9E3779B97F4A7C15ull);
}

/* ---- Random resized crop ----
 * [Note: random resized crop] torchvision's RandomResizedCrop.get_params,
 * with our counter-based draws: up to 10 attempts, attempt a drawing from
 * Philox at (key(seed, view), (epoch * count + idx) * 16 + a) a target area
 * (area times uniform in [scale_lo, scale_hi)), an aspect ratio (exp of
 * uniform in [log 3/4, log 4/3)), w = round(sqrt(area' ratio)), h =
 * round(sqrt(area' / ratio)), and if 0 < w <= W and 0 < h <= H the top-left
 * corner uniform over the places the box fits; if no attempt fits, the
 * central crop of the largest box with a ratio in [3/4, 4/3]. Then the box
 * is resized to (out_h, out_w) bilinearly as torch's interpolate with
 * align_corners=False (source coordinate (o + 0.5) * in / out - 0.5, clamped
 * at 0), on the pixels scaled to [0, 1] (ToTensor first, as torchvision's
 * tensor path), each interpolation written a + t (b - a), so that equal
 * neighbours give exactly their value. */
#define RRC_ATTEMPTS 10

static double unit_double(uint32_t hi, uint32_t lo) {
    return (double)(((uint64_t)hi << 32 | lo) >> 11) * (1.0 / 9007199254740992.0);
}

void fsdp_images_crop_box(const struct fsdp_images *im, uint64_t seed, int64_t epoch, int64_t idx, int view,
                          float scale_lo, float scale_hi, struct fsdp_crop_box *out) {
    int H = im->height, W = im->width;
    double area = (double)H * W, lr0 = log(3.0 / 4.0), lr1 = log(4.0 / 3.0);
    uint64_t key = stream_key(seed, "fsdp.images.resized_crop") ^ ((uint64_t)(uint32_t)view * 0xD1B54A32D192ED03ull);
    uint64_t base = ((uint64_t)epoch * (uint64_t)im->count + (uint64_t)idx) * 16u;
    for (int a = 0; a < RRC_ATTEMPTS; a++) {
        uint32_t r[4], q[4];
        fsdp__philox(key, base + (uint64_t)a, r);
        fsdp__philox(key ^ 0x5851F42D4C957F2Dull, base + (uint64_t)a, q);
        double target = area * ((double)scale_lo + ((double)scale_hi - scale_lo) * unit_double(r[0], r[1]));
        double ratio = exp(lr0 + (lr1 - lr0) * unit_double(r[2], r[3]));
        long w = lround(sqrt(target * ratio)), h = lround(sqrt(target / ratio));
        if (w > 0 && w <= W && h > 0 && h <= H) {
            out->height = (int)h;
            out->width = (int)w;
            out->top = (int)(q[0] % (uint32_t)(H - h + 1));
            out->left = (int)(q[1] % (uint32_t)(W - w + 1));
            return;
        }
    }
    double in_ratio = (double)W / H;
    int w = W, h = H;
    if (in_ratio < 3.0 / 4.0) h = (int)lround(W / (3.0 / 4.0));
    else if (in_ratio > 4.0 / 3.0) w = (int)lround(H * (4.0 / 3.0));
    if (h > H) h = H;
    if (w > W) w = W;
    out->height = h;
    out->width = w;
    out->top = (H - h) / 2;
    out->left = (W - w) / 2;
}

/* one axis of the resize: source index pair and weight of output position o */
static void bilinear_src(int o, float scale, int n, int *i0, int *i1, float *t) {
    float s = ((float)o + 0.5f) * scale - 0.5f;
    if (s < 0.0f) s = 0.0f;
    int a = (int)s;
    if (a > n - 1) a = n - 1;
    *i0 = a;
    *i1 = a < n - 1 ? a + 1 : a;
    *t = s - (float)a;
}

/* box of image idx resized into dst (C, oh, ow), values p / 255 */
static void resized_crop(const struct fsdp_images *im, int64_t idx, const struct fsdp_crop_box *box, int oh, int ow,
                         float *dst) {
    int C = im->channels, W = im->width;
    const uint8_t *src = fsdp_images_pixels(im, idx);
    float sy = (float)box->height / (float)oh, sx = (float)box->width / (float)ow;
    for (int y = 0; y < oh; y++) {
        int y0, y1;
        float ty;
        bilinear_src(y, sy, box->height, &y0, &y1, &ty);
        const uint8_t *r0 = src + (int64_t)(box->top + y0) * W * C, *r1 = src + (int64_t)(box->top + y1) * W * C;
        for (int x = 0; x < ow; x++) {
            int x0, x1;
            float tx;
            bilinear_src(x, sx, box->width, &x0, &x1, &tx);
            int64_t c0 = (int64_t)(box->left + x0) * C, c1 = (int64_t)(box->left + x1) * C;
            for (int c = 0; c < C; c++) {
                float a = (float)r0[c0 + c] / 255.0f, b = (float)r0[c1 + c] / 255.0f;
                float d = (float)r1[c0 + c] / 255.0f, e = (float)r1[c1 + c] / 255.0f;
                float top = a + tx * (b - a), bot = d + tx * (e - d);
                dst[((int64_t)c * oh + y) * ow + x] = top + ty * (bot - top);
            }
        }
    }
}

static enum fsdp_status check_crop_args(struct fsdp_ctx *ctx, const struct fsdp_images *im, int64_t idx, int oh,
                                        int ow) {
    if (idx < 0 || idx >= im->count)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "resized crop: image %lld of %lld", (long long)idx,
                         (long long)im->count);
    if (oh < 1 || oh > 65536 || ow < 1 || ow > 65536)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "resized crop: output size %dx%d (each side 1 to 65536)", oh, ow);
    return FSDP_OK;
}

static enum fsdp_status check_scale(struct fsdp_ctx *ctx, float lo, float hi) {
    if (!(lo > 0.0f && lo <= hi && hi <= 1.0f))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "resized crop: scale range (%g, %g) must satisfy 0 < lo <= hi <= 1",
                         (double)lo, (double)hi);
    return FSDP_OK;
}

enum fsdp_status fsdp_images_resized_crop(struct fsdp_ctx *ctx, const struct fsdp_images *im, int64_t idx,
                                          const struct fsdp_crop_box *box, int out_h, int out_w, float *dst) {
    FSDP_TRY(check_crop_args(ctx, im, idx, out_h, out_w));
    if (!box)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "resized crop: the box is NULL");
    /* in 64 bits: a top or left near INT_MAX plus the size would wrap in int */
    if (box->top < 0 || box->left < 0 || box->height < 1 || box->width < 1 ||
        (int64_t)box->top + box->height > im->height || (int64_t)box->left + box->width > im->width)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "resized crop: box %dx%d at (%d, %d) is not inside the %dx%d image",
                         box->height, box->width, box->top, box->left, im->height, im->width);
    resized_crop(im, idx, box, out_h, out_w, dst);
    return FSDP_OK;
}

enum fsdp_status fsdp_images_random_resized_crop(struct fsdp_ctx *ctx, const struct fsdp_images *im, uint64_t seed,
                                                 int64_t epoch, int64_t idx, int view, int out_h, int out_w,
                                                 float scale_lo, float scale_hi, float *dst) {
    FSDP_TRY(check_crop_args(ctx, im, idx, out_h, out_w));
    FSDP_TRY(check_scale(ctx, scale_lo, scale_hi));
    if (epoch < 0) return fsdp__err(ctx, FSDP_ERR_INVALID, "resized crop: epoch %lld", (long long)epoch);
    struct fsdp_crop_box box;
    fsdp_images_crop_box(im, seed, epoch, idx, view, scale_lo, scale_hi, &box);
    resized_crop(im, idx, &box, out_h, out_w, dst);
    return FSDP_OK;
}

/* epoch e's permutation into im->perm ([Note: image stream]) */
static enum fsdp_status make_perm(struct fsdp_ctx *ctx, struct fsdp_images *im, uint64_t seed, int64_t e) {
    if (im->perm && im->perm_epoch == e && im->perm_seed == seed) return FSDP_OK;
    if (!im->perm && !(im->perm = fsdp__malloc((size_t)im->count * sizeof(int32_t))))
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
    if (!im || !o || !x || !labels)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "image batch: %s is NULL",
                         !im ? "the images" : !o ? "the options" : !x ? "x" : "labels");
    if (B <= 0 || world < 1 || rank < 0 || rank >= world || step < 0 || o->crop_padding < 0 ||
        o->crop_padding > 65536)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "image batch: step %lld, B %lld, rank %d of %d, crop padding %d",
                         (long long)step, (long long)B, rank, world, o->crop_padding);
    if (B > INT64_MAX / world || step > (INT64_MAX - B) / B) /* positions step * B + j, and rank * B, in int64 */
        return fsdp__err(ctx, FSDP_ERR_INVALID, "image batch: step %lld of %lld images puts its positions past 2^63",
                         (long long)step, (long long)B);
    int C = im->channels, H = im->height, W = im->width, P = o->crop_padding;
    if (o->resized_crop) {
        if (P > 0)
            return fsdp__err(ctx, FSDP_ERR_INVALID, "image batch: crop padding and random resized crop are exclusive");
        FSDP_TRY(check_scale(ctx, o->crop_scale[0], o->crop_scale[1]));
    }
    for (int c = 0; c < C; c++)
        if (!(o->std[c] > 0.0f))
            return fsdp__err(ctx, FSDP_ERR_INVALID, "image batch: std[%d] = %g must be positive", c, (double)o->std[c]);
    int64_t lo = (int64_t)rank * B / world, hi = (int64_t)(rank + 1) * B / world;
    uint64_t akey = stream_key(o->seed, "fsdp.images.augment");
    float *crop = NULL; /* (C, H, W) the resized crop, values p / 255 */
    if (o->resized_crop && !(crop = fsdp__malloc((size_t)C * H * W * sizeof(float))))
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory cropping %dx%d images", H, W);
    for (int64_t j = lo; j < hi; j++) {
        int64_t g = step * B + j, e = g / im->count, k = g % im->count;
        if (o->shuffle) {
            enum fsdp_status st = make_perm(ctx, im, o->seed, e);
            if (st != FSDP_OK) {
                free(crop);
                return st;
            }
        }
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
        if (crop) { /* [Note: random resized crop], view 0, to the image's own size */
            struct fsdp_crop_box box;
            fsdp_images_crop_box(im, o->seed, e, idx, 0, o->crop_scale[0], o->crop_scale[1], &box);
            resized_crop(im, idx, &box, H, W, crop);
            for (int c = 0; c < C; c++)
                for (int y = 0; y < H; y++)
                    for (int xx = 0; xx < W; xx++) {
                        float v = crop[((int64_t)c * H + y) * W + (flip ? W - 1 - xx : xx)];
                        dst[((int64_t)c * H + y) * W + xx] = (v - o->mean[c]) / o->std[c];
                    }
        } else {
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
        }
        labels[j - lo] = im->labels[idx];
    }
    free(crop);
    return FSDP_OK;
}
