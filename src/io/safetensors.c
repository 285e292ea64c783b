/*
 * safetensors.c - the safetensors reader and writer, and the durable-file
 * helpers the checkpoints use (CRC-32C, full writes, fsync of a folder, the
 * crash-test hook). Sits in io/, below fsdp/ (which decides what to save) and
 * above core/. Reads with pread, never mmap, so a file that shrinks under us
 * is an i/o error and not a SIGBUS.
 * Invariants: a parsed file's tensors are sorted by offset, do not overlap,
 * lie inside the file, and have byte sizes equal to numel * dtype size; a
 * tensor with checksums has exactly ceil(bytes / FSDP__ST_CHUNK) of them
 * (one for an empty tensor).
 *
 * [Note: chunked checksums] A rank loading its slice of a big tensor must not
 * have to read the whole tensor to verify it, so the CRC-32C is kept per
 * 1 MiB chunk of each tensor (in the header's __metadata__, as hex, so other
 * safetensors readers simply ignore it). A reader extends every read to whole
 * chunks and verifies each: at most 2 MiB extra per tensor read. The writer
 * reserves the checksum text in the header (fixed width) and fills it in at
 * commit, so the data is streamed once.
 */
#include "io/io-impl.h"

#include <cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <omp.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#if defined(__SSE4_2__)
#include <nmmintrin.h>
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors.c writes tensors in host order; port it to swap bytes on big-endian hosts"
#endif

#define CRC_KEY "fsdp.crc32c."

/* ---- CRC-32C (Castagnoli) ---- */

#if !defined(__SSE4_2__)
static uint32_t crc_table[256];

static void crc_init_table(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc_table[i] = c;
    }
}
#endif

#if defined(__SSE4_2__)
/* [Note: three-way CRC] The crc32 instruction has a latency of 3 cycles and
 * a throughput of 1, so one dependent chain runs at a third of its speed.
 * Blocks of 3 x CRC3_LANE bytes are checksummed as three independent chains
 * and joined with crc(A || B) = crc(A) * x^(8 |B|) mod P xor crc(B) (as
 * zlib's crc32_combine; P reflected, the inversions cancel), where the
 * multiplier for |B| = CRC3_LANE is computed once. */
#define CRC3_LANE 4096
#define CRC32C_POLY 0x82F63B78u

/* a * b mod P, bit-reflected (zlib's multmodp). */
static uint32_t crc_multmodp(uint32_t a, uint32_t b) {
    uint32_t m = (uint32_t)1 << 31, prod = 0;
    for (;;) {
        if (a & m) {
            prod ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ CRC32C_POLY : b >> 1;
    }
    return prod;
}

/* x^(8 n) mod P: x^8 (0x00800000 reflected) multiplied in n times, by squaring. */
static uint32_t crc_x8nmodp(uint64_t n) {
    uint32_t r = (uint32_t)1 << 31, sq = (uint32_t)1 << 23; /* 1, x^8 */
    for (; n; n >>= 1, sq = crc_multmodp(sq, sq))
        if (n & 1) r = crc_multmodp(r, sq);
    return r;
}
#endif

uint32_t fsdp__crc32c(uint32_t crc, const void *buf, size_t n) {
    const uint8_t *p = buf;
#if defined(__SSE4_2__)
    static uint32_t lane_shift; /* x^(8 CRC3_LANE) mod P; racing first callers store the same value */
    if (n >= 3 * CRC3_LANE) {
        uint32_t k = __atomic_load_n(&lane_shift, __ATOMIC_RELAXED);
        if (!k) {
            k = crc_x8nmodp(CRC3_LANE);
            __atomic_store_n(&lane_shift, k, __ATOMIC_RELAXED);
        }
        for (; n >= 3 * CRC3_LANE; n -= 3 * CRC3_LANE, p += 3 * CRC3_LANE) {
            uint64_t c0 = (uint32_t)~crc, c1 = 0xffffffffu, c2 = 0xffffffffu;
            for (size_t i = 0; i < CRC3_LANE; i += 8) {
                uint64_t v0, v1, v2;
                memcpy(&v0, p + i, 8);
                memcpy(&v1, p + CRC3_LANE + i, 8);
                memcpy(&v2, p + 2 * CRC3_LANE + i, 8);
                c0 = _mm_crc32_u64(c0, v0);
                c1 = _mm_crc32_u64(c1, v1);
                c2 = _mm_crc32_u64(c2, v2);
            }
            uint32_t a = ~(uint32_t)c0, b = ~(uint32_t)c1, d = ~(uint32_t)c2;
            crc = crc_multmodp(k, crc_multmodp(k, a) ^ b) ^ d;
        }
    }
    crc = ~crc;
    uint64_t c = crc;
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = _mm_crc32_u64(c, v);
    }
    crc = (uint32_t)c;
    for (; n; n--, p++) crc = _mm_crc32_u8(crc, *p);
#else
    crc = ~crc;
    if (!crc_table[1]) crc_init_table();
    for (; n; n--, p++) crc = crc_table[(crc ^ *p) & 0xff] ^ (crc >> 8);
#endif
    return ~crc;
}

/* ---- dtypes ---- */

static const struct {
    const char *name;
    enum fsdp_dtype dt;
} dtypes[] = {{"F32", FSDP_F32}, {"BF16", FSDP_BF16}, {"F16", FSDP_F16},
              {"I32", FSDP_I32}, {"U16", FSDP_U16},   {"U8", FSDP_U8},  {"I64", FSDP_I64}};

/* valid in the format but not representable here */
static const char *const dtypes_other[] = {"F64", "U64", "I16", "I8", "U32", "BOOL",
                                           "F8_E4M3", "F8_E5M2", "C64"};

enum fsdp_status fsdp__st_dtype_parse(const char *s, enum fsdp_dtype *out) {
    for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++)
        if (!strcmp(s, dtypes[i].name)) {
            *out = dtypes[i].dt;
            return FSDP_OK;
        }
    for (size_t i = 0; i < sizeof dtypes_other / sizeof dtypes_other[0]; i++)
        if (!strcmp(s, dtypes_other[i])) return FSDP_ERR_UNSUPPORTED;
    return FSDP_ERR_FORMAT;
}

const char *fsdp__st_dtype_str(enum fsdp_dtype dt) {
    for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++)
        if (dtypes[i].dt == dt) return dtypes[i].name;
    return "?";
}

/* ---- Parsing ---- */

static void file_clear(struct fsdp__st_file *f) {
    if (!f) return;
    for (int i = 0; i < f->n; i++) {
        free(f->t[i].name);
        free(f->t[i].crc);
    }
    for (int i = 0; i < f->n_meta; i++) {
        free(f->meta_key[i]);
        free(f->meta_val[i]);
    }
    free(f->t);
    free(f->meta_key);
    free(f->meta_val);
    free(f->path);
    if (f->fd >= 0) close(f->fd);
    memset(f, 0, sizeof *f);
    f->fd = -1;
}

void fsdp__st_close(struct fsdp__st_file *f) { file_clear(f); }

/* A JSON number that is an exact integer in [0, max]. */
static int json_uint(const cJSON *j, uint64_t max, uint64_t *out) {
    if (!cJSON_IsNumber(j)) return 0;
    double v = j->valuedouble;
    if (!(v >= 0) || v > (double)max || v != (double)(uint64_t)v) return 0;
    *out = (uint64_t)v;
    return 1;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static int64_t n_chunks(uint64_t bytes) {
    return bytes == 0 ? 1 : (int64_t)((bytes + FSDP__ST_CHUNK - 1) / FSDP__ST_CHUNK);
}

static int by_begin(const void *a, const void *b) {
    const struct fsdp__st_tensor *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

static enum fsdp_status parse_tensor(struct fsdp_ctx *ctx, const char *name, const cJSON *e,
                                     uint64_t data_size, struct fsdp__st_tensor *t) {
    const char *tn = e->string;
    if (!tn[0]) return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: a tensor has an empty name", name);
    if (strlen(tn) > 4096)
        return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: a tensor name is longer than 4096 bytes", name);
    if (!cJSON_IsObject(e))
        return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: tensor '%s': entry is not a JSON object", name, tn);
    int n_fields = 0;
    for (const cJSON *k = e->child; k; k = k->next) {
        n_fields++;
        if (strcmp(k->string, "dtype") && strcmp(k->string, "shape") && strcmp(k->string, "data_offsets"))
            return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: tensor '%s': unknown field '%s'", name, tn,
                             k->string);
    }
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    const cJSON *sh = cJSON_GetObjectItemCaseSensitive(e, "shape");
    const cJSON *of = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    if (!dt || !sh || !of || n_fields != 3)
        return fsdp__err(ctx, FSDP_ERR_FORMAT,
                         "%s: tensor '%s': needs exactly the fields dtype, shape and data_offsets", name, tn);
    if (!cJSON_IsString(dt))
        return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: tensor '%s': dtype is not a string", name, tn);
    enum fsdp_status st = fsdp__st_dtype_parse(dt->valuestring, &t->dtype);
    if (st == FSDP_ERR_UNSUPPORTED)
        return fsdp__err(ctx, st, "%s: tensor '%s': dtype %s is not supported (F32 BF16 F16 I32 U16 U8)",
                         name, tn, dt->valuestring);
    if (st != FSDP_OK)
        return fsdp__err(ctx, st, "%s: tensor '%s': unknown dtype '%.32s'", name, tn, dt->valuestring);
    if (!cJSON_IsArray(sh))
        return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: tensor '%s': shape is not an array", name, tn);
    int nd = cJSON_GetArraySize(sh);
    if (nd > FSDP_MAX_DIMS)
        return fsdp__err(ctx, FSDP_ERR_UNSUPPORTED, "%s: tensor '%s': %d dimensions (at most %d supported)",
                         name, tn, nd, FSDP_MAX_DIMS);
    t->ndim = nd;
    uint64_t numel = 1;
    int i = 0;
    for (const cJSON *d = sh->child; d; d = d->next, i++) {
        uint64_t v;
        if (!json_uint(d, (uint64_t)1 << 50, &v))
            return fsdp__err(ctx, FSDP_ERR_FORMAT,
                             "%s: tensor '%s': shape[%d] is not an integer in [0, 2^50]", name, tn, i);
        t->shape[i] = (int64_t)v;
        if (v && numel > ((uint64_t)1 << 50) / v)
            return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: tensor '%s': absurd size (more than 2^50 elements)",
                             name, tn);
        numel *= v;
    }
    t->numel = (int64_t)numel;
    if (!cJSON_IsArray(of) || cJSON_GetArraySize(of) != 2 ||
        !json_uint(of->child, (uint64_t)1 << 53, &t->begin) ||
        !json_uint(of->child->next, (uint64_t)1 << 53, &t->end))
        return fsdp__err(ctx, FSDP_ERR_FORMAT,
                         "%s: tensor '%s': data_offsets is not [begin, end] with integers >= 0", name, tn);
    if (t->end < t->begin)
        return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: tensor '%s': data_offsets [%llu, %llu] end before begin",
                         name, tn, (unsigned long long)t->begin, (unsigned long long)t->end);
    if (t->end > data_size)
        return fsdp__err(ctx, FSDP_ERR_FORMAT,
                         "%s: tensor '%s': data_offsets [%llu, %llu] lie beyond the %llu data bytes "
                         "(truncated file?)",
                         name, tn, (unsigned long long)t->begin, (unsigned long long)t->end,
                         (unsigned long long)data_size);
    uint64_t want = numel * fsdp_dtype_size(t->dtype);
    if (t->end - t->begin != want)
        return fsdp__err(ctx, FSDP_ERR_FORMAT,
                         "%s: tensor '%s': data_offsets span %llu bytes but shape and dtype need %llu", name,
                         tn, (unsigned long long)(t->end - t->begin), (unsigned long long)want);
    t->name = fsdp__strdup(tn);
    if (!t->name) return fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory", name);
    return FSDP_OK;
}

static enum fsdp_status parse_crc(struct fsdp_ctx *ctx, const char *name, struct fsdp__st_tensor *t,
                                  const char *hex) {
    int64_t n = n_chunks(t->end - t->begin);
    if (strlen(hex) != (size_t)n * 8)
        return fsdp__err(ctx, FSDP_ERR_FORMAT,
                         "%s: tensor '%s': checksum metadata has %zu hex digits, expected %lld", name,
                         t->name, strlen(hex), (long long)n * 8);
    t->crc = fsdp__malloc((size_t)n * sizeof *t->crc);
    if (!t->crc) return fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory", name);
    t->n_crc = n;
    for (int64_t c = 0; c < n; c++) {
        uint32_t v = 0;
        for (int k = 0; k < 8; k++) {
            int h = hexval(hex[c * 8 + k]);
            if (h < 0)
                return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: tensor '%s': checksum metadata is not hex",
                                 name, t->name);
            v = v << 4 | (uint32_t)h;
        }
        t->crc[c] = v;
    }
    return FSDP_OK;
}

static enum fsdp_status parse_json(struct fsdp_ctx *ctx, const char *name, const cJSON *root,
                                   uint64_t data_size, struct fsdp__st_file *f) {
    if (!cJSON_IsObject(root))
        return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: the header is not a JSON object", name);
    int n = 0;
    const cJSON *meta = NULL;
    for (const cJSON *e = root->child; e; e = e->next) {
        if (!strcmp(e->string, "__metadata__")) {
            if (meta) return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: __metadata__ appears twice", name);
            meta = e;
        } else {
            n++;
        }
    }
    f->t = fsdp__zalloc((size_t)n + 1, sizeof *f->t);
    if (!f->t) return fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory for %d tensors", name, n);
    for (const cJSON *e = root->child; e; e = e->next) {
        if (e == meta) continue;
        enum fsdp_status st = parse_tensor(ctx, name, e, data_size, &f->t[f->n]);
        if (f->t[f->n].name) f->n++;
        else free(f->t[f->n].crc);
        if (st != FSDP_OK) return st;
    }
    qsort(f->t, (size_t)f->n, sizeof *f->t, by_begin);
    for (int i = 1; i < f->n; i++)
        if (f->t[i].begin < f->t[i - 1].end)
            return fsdp__err(ctx, FSDP_ERR_FORMAT,
                             "%s: tensors '%s' [%llu, %llu) and '%s' [%llu, %llu) overlap", name,
                             f->t[i - 1].name, (unsigned long long)f->t[i - 1].begin,
                             (unsigned long long)f->t[i - 1].end, f->t[i].name,
                             (unsigned long long)f->t[i].begin, (unsigned long long)f->t[i].end);
    /* duplicate names (JSON allows repeated keys) */
    for (int i = 0; i < f->n; i++)
        for (int j = i + 1; j < f->n && f->n <= 65536; j++)
            if (!strcmp(f->t[i].name, f->t[j].name))
                return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: tensor '%s' appears twice", name, f->t[i].name);
    if (!meta) return FSDP_OK;
    if (!cJSON_IsObject(meta))
        return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: __metadata__ is not an object", name);
    int nm = cJSON_GetArraySize(meta);
    f->meta_key = fsdp__zalloc((size_t)nm + 1, sizeof(char *));
    f->meta_val = fsdp__zalloc((size_t)nm + 1, sizeof(char *));
    if (!f->meta_key || !f->meta_val) return fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory", name);
    for (const cJSON *e = meta->child; e; e = e->next) {
        if (!cJSON_IsString(e))
            return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: __metadata__ value of '%s' is not a string", name,
                             e->string);
        if (!strncmp(e->string, CRC_KEY, strlen(CRC_KEY))) {
            int i = fsdp__st_find(f, e->string + strlen(CRC_KEY));
            if (i < 0)
                return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: checksum for '%s', which is not a tensor here",
                                 name, e->string + strlen(CRC_KEY));
            if (f->t[i].crc)
                return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: tensor '%s': two checksums", name, f->t[i].name);
            FSDP_TRY(parse_crc(ctx, name, &f->t[i], e->valuestring));
            continue;
        }
        f->meta_key[f->n_meta] = fsdp__strdup(e->string);
        f->meta_val[f->n_meta] = fsdp__strdup(e->valuestring);
        f->n_meta++;
        if (!f->meta_key[f->n_meta - 1] || !f->meta_val[f->n_meta - 1])
            return fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory", name);
    }
    return FSDP_OK;
}

enum fsdp_status fsdp__safetensors_parse(struct fsdp_ctx *ctx, const char *name, const void *buf,
                                         size_t len, uint64_t file_size, struct fsdp__st_file *out) {
    memset(out, 0, sizeof *out);
    out->fd = -1;
    const uint8_t *b = buf;
    if (len < 8 || file_size < 8)
        return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: %llu bytes: too short for a safetensors header length",
                         name, (unsigned long long)(len < file_size ? len : file_size));
    uint64_t h = 0;
    for (int i = 7; i >= 0; i--) h = h << 8 | b[i];
    if (h < 2 || h > FSDP__ST_MAX_HEADER)
        return fsdp__err(ctx, FSDP_ERR_FORMAT,
                         "%s: header length %llu is absurd (not a safetensors file?); at most %llu", name,
                         (unsigned long long)h, (unsigned long long)FSDP__ST_MAX_HEADER);
    if (8 + h > file_size)
        return fsdp__err(ctx, FSDP_ERR_FORMAT,
                         "%s: header length %llu runs past the end of the %llu-byte file (truncated?)", name,
                         (unsigned long long)h, (unsigned long long)file_size);
    if (8 + h > len)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "%s: only %zu header bytes given, %llu needed", name, len,
                         (unsigned long long)(8 + h));
    const char *js = (const char *)b + 8;
    if (js[0] != '{')
        return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: the header does not start with '{'", name);
    for (uint64_t i = 0; i < h; i++)
        if (js[i] == 0)
            return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: the header contains a NUL byte at %llu", name,
                             (unsigned long long)i);
    const char *end = NULL;
    long failures = fsdp__alloc_failures;
    cJSON *root = cJSON_ParseWithLengthOpts(js, (size_t)h, &end, 0);
    if (!root && fsdp__alloc_failures != failures)
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory for the header's JSON", name);
    if (!root) return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: the header is not valid JSON", name);
    for (; end && end < js + h; end++)
        if (*end != ' ' && *end != '\t' && *end != '\n' && *end != '\r') {
            cJSON_Delete(root);
            return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: the header has bytes after its JSON object (at %lld)", name,
                             (long long)(end - js));
        }
    out->file_size = file_size;
    out->data_start = 8 + h;
    out->path = fsdp__strdup(name);
    enum fsdp_status st = out->path ? parse_json(ctx, name, root, file_size - out->data_start, out)
                                    : fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    cJSON_Delete(root);
    if (st != FSDP_OK) file_clear(out);
    return st;
}

enum fsdp_status fsdp__st_open(struct fsdp_ctx *ctx, const char *path, struct fsdp__st_file *out) {
    memset(out, 0, sizeof *out);
    out->fd = -1;
    int fd;
    uint64_t size;
    FSDP_TRY(fsdp__open_regular(ctx, NULL, path, &fd, &size));
    uint8_t lenb[8];
    ssize_t r = size >= 8 ? pread(fd, lenb, 8, 0) : 0;
    if (r != 8) {
        close(fd);
        return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: %llu bytes: too short for a safetensors header length",
                         path, (unsigned long long)size);
    }
    uint64_t h = 0;
    for (int i = 7; i >= 0; i--) h = h << 8 | lenb[i];
    size_t want = h <= FSDP__ST_MAX_HEADER && 8 + h <= size ? (size_t)(8 + h) : 8;
    uint8_t *buf = fsdp__malloc(want);
    if (!buf) {
        close(fd);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory for the header", path);
    }
    memcpy(buf, lenb, 8);
    if (want > 8 && pread(fd, buf + 8, want - 8, 8) != (ssize_t)(want - 8)) {
        free(buf);
        close(fd);
        return fsdp__err(ctx, FSDP_ERR_IO, "%s: cannot read the header: %s", path, strerror(errno));
    }
    enum fsdp_status st = fsdp__safetensors_parse(ctx, path, buf, want, size, out);
    free(buf);
    if (st != FSDP_OK) {
        close(fd);
        return st;
    }
    out->fd = fd;
    return FSDP_OK;
}

int fsdp__st_find(const struct fsdp__st_file *f, const char *name) {
    for (int i = 0; i < f->n; i++)
        if (!strcmp(f->t[i].name, name)) return i;
    return -1;
}

const char *fsdp__st_meta(const struct fsdp__st_file *f, const char *key) {
    for (int i = 0; i < f->n_meta; i++)
        if (!strcmp(f->meta_key[i], key)) return f->meta_val[i];
    return NULL;
}

static enum fsdp_status read_at(struct fsdp_ctx *ctx, const struct fsdp__st_file *f, const char *tn,
                                void *dst, size_t n, uint64_t off) {
    uint8_t *p = dst;
    while (n) {
        ssize_t r = pread(f->fd, p, n > ((size_t)1 << 30) ? (size_t)1 << 30 : n, (off_t)off);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0)
            return fsdp__err(ctx, FSDP_ERR_IO, "%s: tensor '%s': cannot read %zu bytes at %llu: %s", f->path,
                             tn, n, (unsigned long long)off, r < 0 ? strerror(errno) : "file shrank");
        p += r;
        n -= (size_t)r;
        off += (uint64_t)r;
    }
    return FSDP_OK;
}

enum fsdp_status fsdp__st_read(struct fsdp_ctx *ctx, const struct fsdp__st_file *f, int i,
                               uint64_t lo, uint64_t hi, void *dst) {
    FSDP_ASSERT(i >= 0 && i < f->n, "tensor index %d of %d", i, f->n);
    const struct fsdp__st_tensor *t = &f->t[i];
    uint64_t size = t->end - t->begin;
    FSDP_ASSERT(lo <= hi && hi <= size, "read [%llu, %llu) of %llu bytes", (unsigned long long)lo,
                (unsigned long long)hi, (unsigned long long)size);
    if (f->fd < 0) return fsdp__err(ctx, FSDP_ERR_STATE, "%s: parsed from memory; no data", f->path);
    uint64_t base = f->data_start + t->begin;
    if (!t->crc) return lo == hi ? FSDP_OK : read_at(ctx, f, t->name, dst, (size_t)(hi - lo), base + lo);
    /* [Note: chunked checksums] */
    uint64_t c0 = lo / FSDP__ST_CHUNK, c1 = hi > lo ? (hi - 1) / FSDP__ST_CHUNK + 1 : c0 + 1;
    size_t cap = (size_t)(size < FSDP__ST_CHUNK ? size : FSDP__ST_CHUNK);
    uint8_t *scratch = NULL; /* made for the first chunk that is not wholly inside [lo, hi) */
    enum fsdp_status st = FSDP_OK;
    for (uint64_t c = c0; c < c1 && st == FSDP_OK; c++) {
        uint64_t a = c * FSDP__ST_CHUNK, b = a + FSDP__ST_CHUNK < size ? a + FSDP__ST_CHUNK : size;
        /* a chunk wholly inside [lo, hi) is read in place, others via scratch */
        int whole = a >= lo && b <= hi;
        if (!whole && !scratch && !(scratch = fsdp__malloc(cap ? cap : 1))) {
            st = fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory reading '%s'", f->path, t->name);
            break;
        }
        uint8_t *buf = whole ? (uint8_t *)dst + (a - lo) : scratch;
        st = read_at(ctx, f, t->name, buf, (size_t)(b - a), base + a);
        if (st != FSDP_OK) break;
        uint32_t got = fsdp__crc32c(0, buf, (size_t)(b - a));
        if (got != t->crc[c]) {
            st = fsdp__err(ctx, FSDP_ERR_FORMAT,
                           "%s: tensor '%s': checksum mismatch in bytes [%llu, %llu) (crc32c %08x, header "
                           "says %08x): the file is corrupted",
                           f->path, t->name, (unsigned long long)a, (unsigned long long)b, got, t->crc[c]);
            break;
        }
        uint64_t s = lo > a ? lo : a, e = hi < b ? hi : b;
        if (!whole && s < e) memcpy((uint8_t *)dst + (s - lo), scratch + (s - a), (size_t)(e - s));
    }
    free(scratch);
    return st;
}

enum fsdp_status fsdp__st_verify(struct fsdp_ctx *ctx, const struct fsdp__st_file *f, int *n_unchecked) {
    int unchecked = 0;
    uint8_t *buf = fsdp__malloc((size_t)FSDP__ST_CHUNK);
    if (!buf) return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory");
    enum fsdp_status st = FSDP_OK;
    for (int i = 0; i < f->n && st == FSDP_OK; i++) {
        const struct fsdp__st_tensor *t = &f->t[i];
        if (!t->crc) unchecked++;
        uint64_t size = t->end - t->begin;
        for (uint64_t a = 0; a < size && st == FSDP_OK; a += FSDP__ST_CHUNK) {
            uint64_t b = a + FSDP__ST_CHUNK < size ? a + FSDP__ST_CHUNK : size;
            st = fsdp__st_read(ctx, f, i, a, b, buf);
        }
    }
    free(buf);
    if (n_unchecked) *n_unchecked = unchecked;
    return st;
}

/* ---- Durable files ---- */

enum fsdp_status fsdp__write_all(struct fsdp_ctx *ctx, int fd, const char *path, const void *buf,
                                 size_t n, uint64_t off) {
    const uint8_t *p = buf;
    while (n) {
        ssize_t w = pwrite(fd, p, n > ((size_t)1 << 30) ? (size_t)1 << 30 : n, (off_t)off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return fsdp__err(ctx, FSDP_ERR_IO, "%s: write failed: %s", path, strerror(errno));
        p += w;
        n -= (size_t)w;
        off += (uint64_t)w;
    }
    return FSDP_OK;
}

enum fsdp_status fsdp__fsync_dir(struct fsdp_ctx *ctx, const char *dir_of_path) {
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s", dir_of_path);
    char *slash = strrchr(dir, '/');
    if (!slash) snprintf(dir, sizeof dir, ".");
    else if (slash == dir) dir[1] = 0;
    else *slash = 0;
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return fsdp__err(ctx, FSDP_ERR_IO, "%s: cannot open folder: %s", dir, strerror(errno));
    int r = fsync(fd);
    close(fd);
    if (r != 0) return fsdp__err(ctx, FSDP_ERR_IO, "%s: fsync failed: %s", dir, strerror(errno));
    return FSDP_OK;
}

void fsdp__ckpt_crash_point(const char *where) {
    static long count, at = -1;
    if (at < 0) at = (long)fsdp__env_checked("FSDP_CKPT_CRASH_AT", 0);
    fsdp__fault_point("ckpt-save", where); /* FSDP_FAULT=ckpt-save:... (core/fault.c) */
    if (at > 0 && ++count == at) {
        fprintf(stderr, "fsdp: FSDP_CKPT_CRASH_AT=%ld: exiting at '%s'\n", at, where);
        _exit(86);
    }
}

/* ---- Writer ---- */

struct fsdp__st_writer {
    struct fsdp_ctx *ctx;
    char *path, *tmp;
    int fd;
    int n, cur;             /* tensors; the one being filled */
    uint64_t *bytes;        /* (n) */
    uint32_t **crc;         /* (n) per-chunk CRCs */
    uint64_t filled;        /* bytes of tensor cur written */
    uint64_t off;           /* file offset of the next byte */
    uint64_t kicked;        /* writeback started for [data_start, kicked) ([Note: early writeback]) */
    uint64_t data_start;
    struct fsdp__st_desc *desc; /* (n) copied, names owned */
    int n_meta;
    char **meta_kv;             /* (2 n_meta) copied */
};

/* The JSON header with the given checksums (NULL: zeros), padded with spaces
 * to make 8 + length a multiple of 8. Returns malloc'd text. */
/* Appends item to arr; on failure frees item and returns 0. */
static int push(cJSON *arr, cJSON *item) {
    if (item && cJSON_AddItemToArray(arr, item)) return 1;
    cJSON_Delete(item);
    return 0;
}

static char *build_header(struct fsdp__st_writer *w, size_t *len) {
    cJSON *root = cJSON_CreateObject(), *meta = cJSON_CreateObject();
    int ok = root && meta && cJSON_AddItemToObject(root, "__metadata__", meta);
    if (!ok && root && meta && !meta->string) cJSON_Delete(meta); /* not adopted by root */
    if (!root) cJSON_Delete(meta);
    uint64_t off = 0;
    for (int i = 0; i < w->n && ok; i++) {
        cJSON *e = cJSON_CreateObject(), *sh = NULL, *of = NULL;
        if (!(ok = e && cJSON_AddItemToObject(root, w->desc[i].name, e))) {
            cJSON_Delete(e);
            break;
        }
        ok = cJSON_AddStringToObject(e, "dtype", fsdp__st_dtype_str(w->desc[i].dtype)) &&
             (sh = cJSON_AddArrayToObject(e, "shape"));
        for (int d = 0; ok && d < w->desc[i].ndim; d++) ok = push(sh, cJSON_CreateNumber((double)w->desc[i].shape[d]));
        ok = ok && (of = cJSON_AddArrayToObject(e, "data_offsets")) && push(of, cJSON_CreateNumber((double)off)) &&
             push(of, cJSON_CreateNumber((double)(off + w->bytes[i])));
        off += w->bytes[i];
    }
    for (int i = 0; i < w->n_meta && ok; i++) ok = cJSON_AddStringToObject(meta, w->meta_kv[2 * i], w->meta_kv[2 * i + 1]) != NULL;
    for (int i = 0; i < w->n && ok; i++) {
        int64_t nc = n_chunks(w->bytes[i]);
        char *hex = fsdp__malloc((size_t)nc * 8 + 1);
        char *key = fsdp__malloc(strlen(CRC_KEY) + strlen(w->desc[i].name) + 1);
        if ((ok = hex && key)) {
            for (int64_t c = 0; c < nc; c++) snprintf(hex + c * 8, 9, "%08x", w->crc[i][c]);
            hex[nc * 8] = 0;
            sprintf(key, "%s%s", CRC_KEY, w->desc[i].name);
            ok = cJSON_AddStringToObject(meta, key, hex) != NULL;
        }
        free(hex);
        free(key);
    }
    char *text = ok ? cJSON_PrintUnformatted(root) : NULL;
    cJSON_Delete(root);
    if (!text) return NULL;
    size_t n = strlen(text), padded = (n + 7) / 8 * 8;
    char *out = fsdp__realloc(text, padded + 1);
    if (!out) {
        free(text);
        return NULL;
    }
    memset(out + n, ' ', padded - n);
    out[padded] = 0;
    *len = padded;
    return out;
}

static void writer_free(struct fsdp__st_writer *w) {
    if (!w) return;
    for (int i = 0; i < w->n; i++) free(w->crc ? w->crc[i] : NULL);
    for (int i = 0; w->desc && i < w->n; i++) free((char *)w->desc[i].name);
    for (int i = 0; w->meta_kv && i < 2 * w->n_meta; i++) free(w->meta_kv[i]);
    free(w->desc);
    free(w->meta_kv);
    free(w->crc);
    free(w->bytes);
    free(w->path);
    free(w->tmp);
    free(w);
}

/* [Note: replace only our own files] The writer renames its ".tmp" file
 * over `path`, so an existing `path` or `path.tmp` would be lost. It goes
 * ahead only when each is absent or a safetensors file this writer made
 * (its header carries our per-chunk checksums; a ".tmp" may also be empty,
 * or cut short after the header: a crashed save's), and otherwise refuses,
 * naming the file. */
static int written_by_us(const char *path, int allow_empty) {
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return 0;
    struct stat sb;
    int ok = 0;
    uint8_t lenb[8];
    if (fstat(fd, &sb) == 0 && S_ISREG(sb.st_mode)) {
        if (sb.st_size == 0) ok = allow_empty;
        else if (pread(fd, lenb, 8, 0) == 8) {
            uint64_t n = 0;
            for (int i = 7; i >= 0; i--) n = n << 8 | lenb[i];
            char *h = n <= (uint64_t)64 << 20 && n + 8 <= (uint64_t)sb.st_size ? fsdp__malloc((size_t)n + 1) : NULL;
            if (h && pread(fd, h, (size_t)n, 8) == (ssize_t)n) {
                h[n] = 0;
                cJSON *root = cJSON_Parse(h);
                cJSON *meta = cJSON_GetObjectItemCaseSensitive(root, "__metadata__");
                for (cJSON *e = meta ? meta->child : NULL; e && !ok; e = e->next)
                    ok = e->string && !strncmp(e->string, CRC_KEY, strlen(CRC_KEY));
                cJSON_Delete(root);
            }
            free(h);
        }
    }
    close(fd);
    return ok;
}

int fsdp__st_written_by_us(const char *path) { return written_by_us(path, 0); }

static enum fsdp_status check_replaceable(struct fsdp_ctx *ctx, const char *path, int is_tmp) {
    struct stat sb;
    if (lstat(path, &sb) != 0) {
        if (errno == ENOENT) return FSDP_OK;
        return fsdp__err(ctx, FSDP_ERR_IO, "%s: cannot inspect: %s", path, strerror(errno));
    }
    if (!S_ISREG(sb.st_mode))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "%s: exists and is not a regular file: refusing to replace it", path);
    if (!written_by_us(path, is_tmp))
        return fsdp__err(ctx, FSDP_ERR_INVALID,
                         "%s: exists and was not written by fsdp.c: refusing to replace it (choose another name, "
                         "or move it away)", path);
    return FSDP_OK;
}

enum fsdp_status fsdp__st_writer_open(struct fsdp_ctx *ctx, const char *path, int n,
                                      const struct fsdp__st_desc *desc, int n_meta,
                                      const char *const *meta_kv, struct fsdp__st_writer **out) {
    *out = NULL;
    struct fsdp__st_writer *w = fsdp__zalloc(1, sizeof *w);
    if (!w) return fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory", path);
    w->ctx = ctx;
    w->fd = -1;
    w->n = n;
    w->path = fsdp__strdup(path);
    /* desc and meta_kv are borrowed for the call only: copy them */
    w->desc = fsdp__zalloc((size_t)n + 1, sizeof *w->desc);
    w->meta_kv = fsdp__zalloc(2 * (size_t)n_meta + 1, sizeof *w->meta_kv);
    int copied = w->desc && w->meta_kv;
    for (int i = 0; copied && i < n; i++) {
        w->desc[i] = desc[i];
        w->desc[i].name = fsdp__strdup(desc[i].name);
        copied = w->desc[i].name != NULL;
        w->n = i + 1;
    }
    for (int i = 0; copied && i < 2 * n_meta; i++) {
        w->meta_kv[i] = fsdp__strdup(meta_kv[i]);
        copied = w->meta_kv[i] != NULL;
        w->n_meta = (i + 2) / 2;
    }
    if (!copied) {
        writer_free(w);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory", path);
    }
    w->n = n;
    w->n_meta = n_meta;
    w->tmp = fsdp__malloc(strlen(path) + 5);
    w->bytes = fsdp__zalloc((size_t)n + 1, sizeof *w->bytes);
    w->crc = fsdp__zalloc((size_t)n + 1, sizeof *w->crc);
    if (!w->path || !w->tmp || !w->bytes || !w->crc) {
        writer_free(w);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory", path);
    }
    sprintf(w->tmp, "%s.tmp", path);
    enum fsdp_status chk = check_replaceable(ctx, path, 0);
    if (chk == FSDP_OK) chk = check_replaceable(ctx, w->tmp, 1);
    if (chk != FSDP_OK) {
        writer_free(w);
        return chk;
    }
    for (int i = 0; i < n; i++) {
        int64_t numel = 1;
        for (int d = 0; d < desc[i].ndim; d++) numel *= desc[i].shape[d];
        w->bytes[i] = (uint64_t)numel * fsdp_dtype_size(desc[i].dtype);
        w->crc[i] = fsdp__zalloc((size_t)n_chunks(w->bytes[i]), sizeof(uint32_t));
        if (!w->crc[i]) {
            writer_free(w);
            return fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory", path);
        }
    }
    size_t hlen;
    char *hdr = build_header(w, &hlen);
    if (!hdr) {
        writer_free(w);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory building the header", path);
    }
    w->fd = open(w->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (w->fd < 0) {
        free(hdr);
        enum fsdp_status st = fsdp__err(ctx, FSDP_ERR_IO, "%s: cannot create: %s", w->tmp, strerror(errno));
        writer_free(w);
        return st;
    }
    uint8_t lenb[8];
    for (int i = 0; i < 8; i++) lenb[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
    enum fsdp_status st = fsdp__write_all(ctx, w->fd, w->tmp, lenb, 8, 0);
    if (st == FSDP_OK) st = fsdp__write_all(ctx, w->fd, w->tmp, hdr, hlen, 8);
    free(hdr);
    w->data_start = w->off = w->kicked = 8 + hlen;
    if (st != FSDP_OK) {
        fsdp__st_writer_abort(w);
        return st;
    }
    while (w->cur < w->n && w->bytes[w->cur] == 0) {
        w->crc[w->cur][0] = fsdp__crc32c(0, NULL, 0);
        w->cur++;
    }
    *out = w;
    return FSDP_OK;
}

uint64_t fsdp__st_writer_data_start(const struct fsdp__st_writer *w) { return w->data_start; }

/* [Note: early writeback] Start writing each 8 MiB to disk as soon as it is
 * in the page cache, so the disk works while the next bytes are checksummed
 * and copied, and the fsync at commit has little left (a plain write + fsync
 * leaves it all to the end). Only a hint: durability still comes from that
 * fsync. Starts it for [kicked, upto) once that is 8 MiB or more. */
static void kick_writeback(struct fsdp__st_writer *w, uint64_t upto) {
    if (upto - w->kicked < ((uint64_t)8 << 20)) return;
    (void)sync_file_range(w->fd, (off_t)w->kicked, (off_t)(upto - w->kicked), SYNC_FILE_RANGE_WRITE);
    w->kicked = upto;
}

/* [Note: parallel chunks] A write of whole chunks checksums and writes each
 * chunk on its own (its CRC starts at zero, its bytes go to their own file
 * offset), so the compute threads share them: on one rank the save is one
 * thread copying into fresh page-cache pages, which both cores can do at
 * once. Writes chunks [c0, c0 + nc) of tensor cur from p at file offset off;
 * returns 0, or the errno of the first failed chunk in file order (the
 * message is made after the loop, on this thread). */
static int write_chunks(struct fsdp__st_writer *w, const uint8_t *p, uint64_t c0, int64_t nc, uint64_t off) {
    int64_t first = nc;
    int err = 0;
#pragma omp parallel for schedule(dynamic, 1) if (nc >= 4 && !omp_in_parallel())
    for (int64_t i = 0; i < nc; i++) {
        const uint8_t *q = p + (size_t)i * FSDP__ST_CHUNK;
        w->crc[w->cur][c0 + (uint64_t)i] = fsdp__crc32c(0, q, FSDP__ST_CHUNK);
        size_t n = FSDP__ST_CHUNK;
        uint64_t o = off + (uint64_t)i * FSDP__ST_CHUNK;
        int e = 0;
        while (n && !e) {
            ssize_t r = pwrite(w->fd, q, n, (off_t)o);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) e = r < 0 ? errno : EIO;
            else q += r, n -= (size_t)r, o += (uint64_t)r;
        }
        if (e) {
#pragma omp critical(st_write_chunks)
            if (i < first) first = i, err = e;
        }
    }
    return err;
}

enum fsdp_status fsdp__st_writer_write(struct fsdp__st_writer *w, const void *data, size_t bytes) {
    const uint8_t *p = data;
    while (bytes) {
        if (w->cur >= w->n)
            return fsdp__err(w->ctx, FSDP_ERR_INVALID, "%s: more data than the declared tensors", w->path);
        uint64_t room = w->bytes[w->cur] - w->filled;
        size_t k = bytes < room ? bytes : (size_t)room;
        /* checksum chunk by chunk as the bytes go by, writing each chunk
         * right after its checksum while it is still in the CPU cache (one
         * pass over memory, not two) */
        size_t done = 0;
        while (done < k) {
            uint64_t c = (w->filled + done) / FSDP__ST_CHUNK;
            if ((w->filled + done) % FSDP__ST_CHUNK == 0 && k - done >= FSDP__ST_CHUNK) {
                /* whole chunks, 16 at a time ([Note: parallel chunks]), each group's writeback started */
                int64_t nc = (int64_t)((k - done) / FSDP__ST_CHUNK);
                if (nc > 16) nc = 16;
                int e = write_chunks(w, p + done, c, nc, w->off + done);
                if (e) return fsdp__err(w->ctx, FSDP_ERR_IO, "%s: write failed: %s", w->tmp, strerror(e));
                done += (size_t)nc * FSDP__ST_CHUNK;
                kick_writeback(w, w->off + done);
                continue;
            }
            uint64_t chunk_end = (c + 1) * FSDP__ST_CHUNK;
            size_t m = (size_t)(chunk_end - (w->filled + done));
            if (m > k - done) m = k - done;
            w->crc[w->cur][c] = fsdp__crc32c(w->crc[w->cur][c], p + done, m);
            FSDP_TRY(fsdp__write_all(w->ctx, w->fd, w->tmp, p + done, m, w->off + done));
            done += m;
        }
        w->off += k;
        kick_writeback(w, w->off);
        w->filled += k;
        p += k;
        bytes -= k;
        while (w->cur < w->n && w->filled == w->bytes[w->cur]) {
            w->cur++;
            w->filled = 0;
            if (w->cur < w->n && w->bytes[w->cur] == 0) w->crc[w->cur][0] = fsdp__crc32c(0, NULL, 0);
            fsdp__ckpt_crash_point("safetensors tensor written");
        }
    }
    return FSDP_OK;
}

enum fsdp_status fsdp__st_writer_commit(struct fsdp__st_writer *w) {
    struct fsdp_ctx *ctx = w->ctx;
    enum fsdp_status st = FSDP_OK;
    if (w->cur != w->n)
        st = fsdp__err(ctx, FSDP_ERR_INVALID, "%s: tensor '%s' incomplete at commit", w->path,
                       w->desc[w->cur].name);
    size_t hlen = 0;
    char *hdr = st == FSDP_OK ? build_header(w, &hlen) : NULL;
    if (st == FSDP_OK && !hdr) st = fsdp__err(ctx, FSDP_ERR_NOMEM, "%s: out of memory", w->path);
    FSDP_ASSERT(st != FSDP_OK || 8 + hlen == w->data_start, "header length changed: %zu", hlen);
    if (st == FSDP_OK) st = fsdp__write_all(ctx, w->fd, w->tmp, hdr, hlen, 8);
    free(hdr);
    if (st == FSDP_OK && fsync(w->fd) != 0)
        st = fsdp__err(ctx, FSDP_ERR_IO, "%s: fsync failed: %s", w->tmp, strerror(errno));
    if (st == FSDP_OK) fsdp__ckpt_crash_point("safetensors before rename");
    if (st == FSDP_OK && close(w->fd) != 0)
        st = fsdp__err(ctx, FSDP_ERR_IO, "%s: close failed: %s", w->tmp, strerror(errno));
    else if (st == FSDP_OK) w->fd = -1;
    if (st == FSDP_OK && rename(w->tmp, w->path) != 0)
        st = fsdp__err(ctx, FSDP_ERR_IO, "%s: cannot rename to %s: %s", w->tmp, w->path, strerror(errno));
    if (st == FSDP_OK) st = fsdp__fsync_dir(ctx, w->path);
    if (st != FSDP_OK) {
        fsdp__st_writer_abort(w);
        return st;
    }
    writer_free(w);
    return FSDP_OK;
}

void fsdp__st_writer_abort(struct fsdp__st_writer *w) {
    if (!w) return;
    if (w->fd >= 0) close(w->fd);
    unlink(w->tmp);
    writer_free(w);
}
