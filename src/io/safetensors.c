/*
 * safetensors.c - the safetensors reader and CRC-32C; the writer and the
 * durable-file helpers the checkpoints use (full writes, fsync of a folder,
 * the crash-test hook) are st_write.c's. Sits in io/, below fsdp/ (which decides what to save) and
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
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <pthread.h>
#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors.c writes tensors in host order; port it to swap bytes on big-endian hosts"
#endif


/* ---- CRC-32C (Castagnoli) ---- */

/* [Note: CRC-32C paths] The crc32 instruction (SSE4.2) where the CPU's
 * level has it (AVX2 and up: [Note: vector paths at run time], cpu.c), a
 * table a byte at a time elsewhere and at FSDP_MAX_CPU_ISA=scalar: the same
 * checksum (tests/test_safetensors.c, run at every level). */
#define CRC32C_POLY 0x82F63B78u

static uint32_t crc_table[256];
static pthread_once_t crc_table_once = PTHREAD_ONCE_INIT;

static void crc_init_table(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ CRC32C_POLY : c >> 1;
        crc_table[i] = c;
    }
}

static uint32_t crc_bytes(uint32_t crc, const uint8_t *p, size_t n) {
    pthread_once(&crc_table_once, crc_init_table);
    crc = ~crc;
    for (; n; n--, p++) crc = crc_table[(crc ^ *p) & 0xff] ^ (crc >> 8);
    return ~crc;
}

#if defined(__x86_64__)
/* [Note: three-way CRC] The crc32 instruction has a latency of 3 cycles and
 * a throughput of 1, so one dependent chain runs at a third of its speed.
 * Blocks of 3 x CRC3_LANE bytes are checksummed as three independent chains
 * and joined with crc(A || B) = crc(A) * x^(8 |B|) mod P xor crc(B) (as
 * zlib's crc32_combine; P reflected, the inversions cancel), where the
 * multiplier for |B| = CRC3_LANE is computed once. */
#define CRC3_LANE 4096

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

FSDP__TARGET_SSE42 static uint32_t crc_sse42(uint32_t crc, const uint8_t *p, size_t n) {
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
    return ~crc;
}
#endif

uint32_t fsdp__crc32c(uint32_t crc, const void *buf, size_t n) {
#if defined(__x86_64__)
    if (fsdp__cpu_isa() >= FSDP__ISA_AVX2) return crc_sse42(crc, buf, n);
#endif
    return crc_bytes(crc, buf, n);
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
    char shown[200];
    for (const char *c = tn; *c; c++) /* every later message prints the name as it is */
        if ((unsigned char)*c < 0x20 || *c == 0x7F)
            return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: the tensor name \"%s\" holds a control character "
                             "(a damaged header?)", name, fsdp__shown(tn, strlen(tn), shown, sizeof shown));
    if (!cJSON_IsObject(e))
        return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: tensor '%s': entry is not a JSON object", name, tn);
    int n_fields = 0;
    for (const cJSON *k = e->child; k; k = k->next) {
        n_fields++;
        if (strcmp(k->string, "dtype") && strcmp(k->string, "shape") && strcmp(k->string, "data_offsets"))
            return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: tensor '%s': unknown field \"%s\"", name, tn,
                             fsdp__shown(k->string, strlen(k->string), shown, sizeof shown));
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
        return fsdp__err(ctx, st, "%s: tensor '%s': unknown dtype \"%s\"", name, tn,
                         fsdp__shown(dt->valuestring, strlen(dt->valuestring), shown, sizeof shown));
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
    int64_t n = fsdp__st_chunks(t->end - t->begin);
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
    char shown[200];
    for (const cJSON *e = meta->child; e; e = e->next) {
        if (!cJSON_IsString(e))
            return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: __metadata__ value of \"%s\" is not a string", name,
                             fsdp__shown(e->string, strlen(e->string), shown, sizeof shown));
        if (!strncmp(e->string, FSDP__ST_CRC_KEY, strlen(FSDP__ST_CRC_KEY))) {
            int i = fsdp__st_find(f, e->string + strlen(FSDP__ST_CRC_KEY));
            if (i < 0)
                return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: checksum for \"%s\", which is not a tensor here",
                                 name, fsdp__shown(e->string + strlen(FSDP__ST_CRC_KEY),
                                                   strlen(e->string + strlen(FSDP__ST_CRC_KEY)), shown, sizeof shown));
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
    /* our writer sums every tensor that has bytes: one without, beside others with, is a
       damaged key (a flipped byte in its name left the tensor unchecked) */
    int checked = 0;
    for (int i = 0; i < f->n; i++) checked |= f->t[i].crc != NULL;
    for (int i = 0; checked && i < f->n; i++)
        if (!f->t[i].crc && f->t[i].end > f->t[i].begin)
            return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: tensor '%s' has no checksum where the file's other "
                             "tensors have theirs (a damaged \"%s\" key?)", name, f->t[i].name, FSDP__ST_CRC_KEY);
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
    if (st == FSDP_OK) out->header_crc = fsdp__crc32c(0, buf, want); /* want = data_start once parsed */
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
