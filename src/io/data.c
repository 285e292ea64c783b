/*
 * data.c - token sources for training: llm.c token files, raw uint16 .bin
 * files (nanoGPT), byte-level text, and the built-in synthetic corpus with an
 * exactly known entropy floor; and the global batch -> per-rank share mapping.
 * A file is mmap'd read-only for one validation pass at open, then batches
 * pread the tokens they need ([Note: files change under us]), so opening a
 * multi-GB shard costs one pass and holds no copy.
 * Invariants: 2 <= ntok; every token < the vocab_size given at open; exactly
 * one of u8 / u16 is set. The byte order of token files is little-endian, as
 * llm.c and nanoGPT write them on x86, and this file assumes a little-endian host.
 */
#include "io/io-impl.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "data.c reads little-endian token files in place; port it to convert on load"
#endif

struct fsdp_data {
    struct fsdp_ctx *ctx;   /* borrowed: must outlive the data (accounts `owned`) */
    const uint8_t *u8;      /* (ntok) byte tokens, or NULL */
    const uint16_t *u16;    /* (ntok) 16-bit tokens, or NULL */
    size_t ntok;
    int is_text;
    double floor;           /* nats per token; < 0 when unknown */
    void *map;              /* the mmap'd file while it is validated, or NULL */
    size_t map_len;
    void *owned;            /* synthetic or copied bytes from fsdp__alloc, or NULL */
    /* a file's tokens are read with pread ([Note: files change under us]) */
    int fd;                 /* -1 for tokens in memory */
    char *path;             /* for messages (plain malloc) */
    uint64_t tok_off;       /* byte offset of token 0 in the file */
    uint64_t file_bytes;    /* the size validated at open */
    int tok_bytes;          /* 1 or 2 */
    int vocab_size;
};

/* llm.c token file: 256 int32 header words, then uint16 tokens. */
#define LLMC_MAGIC 20240520
#define LLMC_HEADER_BYTES 1024

static enum fsdp_status data_new(struct fsdp_ctx *ctx, struct fsdp_data **out) {
    struct fsdp_data *d = fsdp__calloc(ctx, sizeof *d, FSDP_MEM_OTHER, "data source");
    if (!d) return FSDP_ERR_NOMEM;
    d->ctx = ctx;
    d->floor = -1.0;
    d->fd = -1;
    *out = d;
    return FSDP_OK;
}

void fsdp_data_free(struct fsdp_data *d) {
    if (!d) return;
    if (d->map) munmap(d->map, d->map_len);
    if (d->fd >= 0) close(d->fd);
    free(d->path);
    fsdp__free(d->ctx, d->owned);
    fsdp__free(d->ctx, d);
}

size_t fsdp_data_ntokens(const struct fsdp_data *d) { return d ? d->ntok : 0; }
int fsdp_data_is_text(const struct fsdp_data *d) { return d ? d->is_text : 0; }
double fsdp_data_loss_floor(const struct fsdp_data *d) { return d ? d->floor : -1.0; }

static int ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

/* [Note: telling token files apart]
 * An llm.c file starts with the int32 magic 20240520. A file without it is a
 * raw uint16 token stream if its name ends in ".bin", else byte-level text.
 * llm.c has sibling formats with other date-like magics (20240522 for its
 * HellaSwag eval files); reading one of those as raw tokens would train on
 * garbage, so a .bin whose first word is a 2024 date-like magic and whose
 * second word is a small version number is rejected as an unknown llm.c
 * format. Read as uint16 tokens, such a start is (x, 308 or 309, v, 0) with
 * 1 <= v <= 255: possible in a real token stream, but rare enough.
 * A .bin laid out as an llm.c token file in all but its magic (version word
 * 1, and a token count word equal to the (size - 1024) / 2 tokens the file
 * holds after a header) is a token file with a damaged magic, and rejected
 * too: read as uint16 tokens that start is (x, y, 1, 0, n % 65536, n >> 16)
 * with n the file's own length in tokens, which no real stream matches by
 * chance. Any other .bin is raw tokens. */
static int looks_like_llmc(const int32_t *h, size_t bytes) {
    return bytes >= LLMC_HEADER_BYTES && h[0] >= 20240000 && h[0] <= 20259999 && h[1] >= 1 &&
           h[1] <= 255;
}

static int damaged_llmc(const int32_t *h, size_t bytes) {
    return bytes >= LLMC_HEADER_BYTES && h[1] == 1 && h[2] >= 0 &&
           (uint64_t)LLMC_HEADER_BYTES + 2 * (uint64_t)h[2] == bytes;
}

/* Checks every token against vocab_size; reports the first one out of range. */
static enum fsdp_status check_tokens(struct fsdp_ctx *ctx, const char *path,
                                     const struct fsdp_data *d, int vocab_size) {
    if (d->u8) return FSDP_OK; /* bytes: data_layout required vocab_size >= 256 */
    if (vocab_size > 65535) return FSDP_OK;
    uint16_t mx = 0; /* a branch-free pass first: the common case is all valid */
    for (size_t i = 0; i < d->ntok; i++) mx = d->u16[i] > mx ? d->u16[i] : mx;
    if (mx < vocab_size) return FSDP_OK;
    for (size_t i = 0; i < d->ntok; i++)
        if (d->u16[i] >= vocab_size)
            return fsdp__err(ctx, FSDP_ERR_INVALID,
                             "'%s': token %u at position %zu is >= vocab_size %d", path,
                             (unsigned)d->u16[i], i, vocab_size);
    return FSDP_OK;
}

/* Classifies the mapped file (see [Note: telling token files apart]) and
 * points d at its tokens. */
static enum fsdp_status data_layout(struct fsdp_ctx *ctx, const char *path, struct fsdp_data *d,
                                    const void *mem, size_t bytes, int vocab_size) {
    const unsigned char *base = mem;
    const int32_t *h = (const int32_t *)mem; /* page- or 64-byte aligned */
    if (bytes >= 4 && h[0] == LLMC_MAGIC) {
        if (bytes < LLMC_HEADER_BYTES)
            return fsdp__err(ctx, FSDP_ERR_FORMAT,
                             "'%s': llm.c token file is truncated: %zu bytes, the header alone "
                             "is %d", path, bytes, LLMC_HEADER_BYTES);
        if (h[1] != 1)
            return fsdp__err(ctx, FSDP_ERR_FORMAT,
                             "'%s': llm.c token file version %d is not supported (want 1: "
                             "uint16 tokens)", path, (int)h[1]);
        if (h[2] < 0)
            return fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': llm.c header has a negative token count %d",
                             path, (int)h[2]);
        size_t want = LLMC_HEADER_BYTES + 2 * (size_t)h[2];
        if (bytes != want)
            return fsdp__err(ctx, FSDP_ERR_FORMAT,
                             "'%s': llm.c header says %d tokens (%zu bytes in all) but the file "
                             "has %zu bytes", path, (int)h[2], want, bytes);
        d->u16 = (const uint16_t *)(base + LLMC_HEADER_BYTES);
        d->ntok = (size_t)h[2];
        return FSDP_OK;
    }
    if (ends_with(path, ".bin")) {
        if (looks_like_llmc(h, bytes))
            return fsdp__err(ctx, FSDP_ERR_FORMAT,
                             "'%s': unknown llm.c magic %d, version %d (token files have magic "
                             "%d, version 1)", path, (int)h[0], (int)h[1], LLMC_MAGIC);
        if (damaged_llmc(h, bytes))
            return fsdp__err(ctx, FSDP_ERR_FORMAT,
                             "'%s': laid out as an llm.c token file (version 1, %d tokens after a %d-byte "
                             "header, as its size says) but its magic is %d, not %d: a damaged header",
                             path, (int)h[2], LLMC_HEADER_BYTES, (int)h[0], LLMC_MAGIC);
        if (bytes % 2)
            return fsdp__err(ctx, FSDP_ERR_FORMAT,
                             "'%s': raw uint16 token file has an odd size (%zu bytes)", path, bytes);
        d->u16 = (const uint16_t *)base;
        d->ntok = bytes / 2;
        return FSDP_OK;
    }
    if (vocab_size < 256)
        return fsdp__err(ctx, FSDP_ERR_INVALID,
                         "'%s' is read as byte-level text, which needs vocab_size >= 256 (got %d)",
                         path, vocab_size);
    d->u8 = base;
    d->ntok = bytes;
    d->is_text = 1;
    return FSDP_OK;
}

/* Lays out d over mem[0..bytes), validates it and hands it to *out; frees d on failure. */
static enum fsdp_status data_finish(struct fsdp_ctx *ctx, const char *path, struct fsdp_data *d,
                                    const void *mem, size_t bytes, int vocab_size,
                                    struct fsdp_data **out) {
    enum fsdp_status st = data_layout(ctx, path, d, mem, bytes, vocab_size);
    if (st == FSDP_OK && d->ntok < 2)
        st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s' has %zu tokens; need at least 2", path, d->ntok);
    if (st == FSDP_OK) st = check_tokens(ctx, path, d, vocab_size);
    if (st != FSDP_OK) {
        fsdp_data_free(d);
        return st;
    }
    *out = d;
    return FSDP_OK;
}

enum fsdp_status fsdp_data_open(struct fsdp_ctx *ctx, const char *path, int vocab_size,
                                struct fsdp_data **out) {
    if (!out) return fsdp__err(ctx, FSDP_ERR_INVALID, "data open: out is NULL");
    *out = NULL;
    if (!path) return fsdp__err(ctx, FSDP_ERR_INVALID, "data open: path is NULL");
    if (vocab_size <= 0)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "data open '%s': vocab_size %d must be positive",
                         path, vocab_size);
    int fd;
    uint64_t fsize;
    FSDP_TRY(fsdp__open_regular(ctx, NULL, path, &fd, &fsize));
    size_t bytes = (size_t)fsize;
    if (bytes < 2) { /* also keeps an empty file away from mmap */
        close(fd);
        return fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s' has %zu bytes: too short to hold 2 tokens",
                         path, bytes);
    }
    void *map = mmap(NULL, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
    int map_errno = errno;
    if (map == MAP_FAILED) {
        close(fd);
        return fsdp__err(ctx, FSDP_ERR_IO, "cannot map '%s': %s", path, strerror(map_errno));
    }
    struct fsdp_data *d;
    enum fsdp_status st = data_new(ctx, &d);
    if (st != FSDP_OK) {
        munmap(map, bytes);
        close(fd);
        return st;
    }
    d->map = map;
    d->map_len = bytes;
    d->fd = fd;
    d->path = fsdp__strdup(path);
    if (!d->path) {
        fsdp_data_free(d);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory opening '%s'", path);
    }
    FSDP_TRY(data_finish(ctx, path, d, map, bytes, vocab_size, out));
    /* validated: from now on the tokens are read from the file */
    const uint8_t *first = d->u16 ? (const uint8_t *)d->u16 : d->u8;
    d->tok_off = (uint64_t)(first - (const uint8_t *)map);
    d->tok_bytes = d->u16 ? 2 : 1;
    d->file_bytes = bytes;
    d->vocab_size = vocab_size;
    d->u16 = NULL;
    d->u8 = NULL;
    munmap(map, bytes);
    d->map = NULL;
    return FSDP_OK;
}

enum fsdp_status fsdp__data_open_mem(struct fsdp_ctx *ctx, const char *name, const void *buf,
                                     size_t len, int vocab_size, struct fsdp_data **out) {
    if (!out) return fsdp__err(ctx, FSDP_ERR_INVALID, "data open: out is NULL");
    *out = NULL;
    if (!name || (!buf && len))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "data open: name or buffer is NULL");
    if (vocab_size <= 0)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "data open '%s': vocab_size %d must be positive",
                         name, vocab_size);
    if (len < 2)
        return fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s' has %zu bytes: too short to hold 2 tokens",
                         name, len);
    struct fsdp_data *d;
    FSDP_TRY(data_new(ctx, &d));
    d->owned = fsdp__alloc(ctx, len, FSDP_MEM_OTHER, "token buffer"); /* 64-byte aligned */
    if (!d->owned) {
        fsdp_data_free(d);
        return FSDP_ERR_NOMEM;
    }
    memcpy(d->owned, buf, len);
    return data_finish(ctx, name, d, d->owned, len, vocab_size, out);
}

/* ---- Batches ---- */

static inline int32_t token_at(const struct fsdp_data *d, size_t i) {
    return d->u16 ? (int32_t)d->u16[i] : (int32_t)d->u8[i];
}

/* [Note: files change under us]
 * A token file is validated once at open, but another program may rewrite
 * or truncate it while we train. Pages of a mapping past a file's new end
 * raise SIGBUS, which would kill the rank with no word of the file; so after
 * the validation pass the mapping is dropped and batches read the tokens
 * with pread. A short read (the file shrank) is an error naming the file and
 * both sizes, and every token read is checked against the vocabulary again. */

/* dst[0..n) = the n tokens from position pos on, wrapping at the end. */
static enum fsdp_status file_tokens(const struct fsdp_data *d, size_t pos, size_t n, int32_t *dst) {
    uint8_t buf[4096];
    size_t per = sizeof buf / (size_t)d->tok_bytes;
    while (n > 0) {
        size_t take = n < per ? n : per;
        if (take > d->ntok - pos) take = d->ntok - pos;
        size_t want = take * (size_t)d->tok_bytes, got = 0;
        uint64_t off = d->tok_off + (uint64_t)pos * (uint64_t)d->tok_bytes;
        while (got < want) {
            ssize_t r = pread(d->fd, buf + got, want - got, (off_t)(off + got));
            if (r < 0 && errno == EINTR) continue;
            if (r < 0)
                return fsdp__err(d->ctx, FSDP_ERR_IO, "'%s': cannot read tokens at byte %llu: %s", d->path,
                                 (unsigned long long)(off + got), strerror(errno));
            if (r == 0) {
                struct stat sb;
                long long now = fstat(d->fd, &sb) == 0 ? (long long)sb.st_size : -1;
                return fsdp__err(d->ctx, FSDP_ERR_IO,
                                 "'%s' shrank while in use: it has %lld bytes, %llu at open (token %zu is "
                                 "gone); a token file must not change while training", d->path, now,
                                 (unsigned long long)d->file_bytes, pos + got / (size_t)d->tok_bytes);
            }
            got += (size_t)r;
        }
        for (size_t k = 0; k < take; k++) {
            int32_t t = d->tok_bytes == 2 ? (int32_t)((uint16_t)buf[2 * k] | (uint16_t)buf[2 * k + 1] << 8)
                                          : (int32_t)buf[k];
            if (t >= d->vocab_size)
                return fsdp__err(d->ctx, FSDP_ERR_FORMAT,
                                 "'%s': token %d at position %zu is >= vocab_size %d (the file changed while "
                                 "in use)", d->path, (int)t, pos + k, d->vocab_size);
            dst[k] = t;
        }
        dst += take;
        n -= take;
        pos = pos + take == d->ntok ? 0 : pos + take;
    }
    return FSDP_OK;
}

enum fsdp_status fsdp_data_batch(const struct fsdp_data *d, int64_t step, int B, int T, int rank, int world,
                                 int32_t *inputs, int32_t *targets) {
    if (!d) return FSDP_ERR_INVALID; /* no context to say it on */
    if (step < 0 || B <= 0 || T <= 0 || world <= 0 || rank < 0 || rank >= world)
        return fsdp__err(d->ctx, FSDP_ERR_INVALID, "token batch: step %lld, B %d, T %d, rank %d of %d (step >= 0, "
                         "B and T > 0, 0 <= rank < world)", (long long)step, B, T, rank, world);
    int64_t lo = (int64_t)rank * B / world, hi = (int64_t)(rank + 1) * B / world;
    if (hi > lo && (!inputs || !targets))
        return fsdp__err(d->ctx, FSDP_ERR_INVALID, "token batch: %s is NULL", !inputs ? "inputs" : "targets");
    const unsigned __int128 n = d->ntok; /* (step*B + i)*T can pass 2^63 on long runs */
    for (int64_t i = lo; i < hi; i++) {
        size_t pos = (size_t)((((unsigned __int128)step * (unsigned)B + (uint64_t)i) * (unsigned)T) % n);
        int32_t *in = inputs + (i - lo) * T, *tg = targets + (i - lo) * T;
        if (d->fd >= 0) { /* inputs, then the one token after them; targets are inputs shifted by one */
            FSDP_TRY(file_tokens(d, pos, (size_t)T, in));
            FSDP_TRY(file_tokens(d, (size_t)(((unsigned __int128)pos + (unsigned)T) % n), 1, tg + T - 1));
            memmove(tg, in + 1, (size_t)(T - 1) * sizeof *tg);
            continue;
        }
        int32_t cur = token_at(d, pos);
        for (int t = 0; t < T; t++) {
            pos = pos + 1 == d->ntok ? 0 : pos + 1;
            int32_t next = token_at(d, pos);
            in[t] = cur;
            tg[t] = next;
            cur = next;
        }
    }
    return FSDP_OK;
}

/* ---- The synthetic corpus ---- */

/* [Note: synthetic corpus]
 * Items, one per line, each drawn independently:
 *   with probability 1/2 a sentence  "<det> <adj> <noun> <verb> <det> <adj> <obj>.\n"
 *   with probability 1/2 a sum       "<a>+<b>=<a+b>.\n"   a, b uniform in [0, SYN_MAX)
 * Every word is uniform over its list, independently (the two <det> and two
 * <adj> slots are separate draws). Choice `s` of item `k` is
 * fsdp__uniform_at(key, k*8 + s), so the corpus is a pure function of the seed.
 *
 * [Note: synthetic entropy]
 * The floor is the entropy rate of the byte stream, in nats per byte:
 *  1. An item's string determines its choices: words within a list are
 *     distinct and hold no ' ', '.' or '\n'; sentences start with a letter,
 *     sums with a digit; a and b are read back from the digits around '+'.
 *     So H(item) = H(choices) = ln 2 + 1/2 sum_slots ln|list| + 1/2 * 2 ln SYN_MAX.
 *  2. Every item ends at its only '\n', so the stream parses uniquely into
 *     i.i.d. items, and the entropy per byte is H(item) / E[bytes per item]
 *     (renewal-reward: n items carry n H(item) nats in n E[len] bytes).
 *  3. E[len] = 1/2 (sum_slots mean word length + 6 spaces + ".\n")
 *             + 1/2 (E[digits(a)] + E[digits(b)] + E[digits(a+b)] + "+=.\n"),
 *     the means taken exactly over the lists and the SYN_MAX^2 equally likely
 *     (a, b) pairs (syn_floor enumerates them; no sampling).
 * No model beats this on average; one with a short context pays more at
 * the start of each window. Values: H(item) ~ 8.27 nats, E[len] ~ 20.5 bytes,
 * floor ~ 0.40 nats/byte (vs ln 256 = 5.55 for uniform bytes). */
#define SYN_MAX 20

static const char *const syn_det[] = {"the", "a"};
static const char *const syn_adj[] = {"red", "big", "small", "green", "happy"};
static const char *const syn_noun[] = {"cat", "dog", "bird", "fox"};
static const char *const syn_verb[] = {"sees", "likes", "finds", "chases"};
static const char *const syn_obj[] = {"ball", "box", "tree", "hat", "cup", "book"};

struct syn_slot { const char *const *words; int n; };
#define SYN_SLOT(list) { list, (int)(sizeof list / sizeof list[0]) }
static const struct syn_slot syn_sentence[] = {
    SYN_SLOT(syn_det), SYN_SLOT(syn_adj), SYN_SLOT(syn_noun), SYN_SLOT(syn_verb),
    SYN_SLOT(syn_det), SYN_SLOT(syn_adj), SYN_SLOT(syn_obj),
};
#define SYN_N_SLOTS ((int)(sizeof syn_sentence / sizeof syn_sentence[0]))

static int syn_digits(int v) { return v >= 100 ? 3 : v >= 10 ? 2 : 1; }

/* The exact floor of [Note: synthetic entropy]. */
static double syn_floor(void) {
    double h_sent = 0, len_sent = 0;
    for (int s = 0; s < SYN_N_SLOTS; s++) {
        const struct syn_slot *sl = &syn_sentence[s];
        double mean = 0;
        for (int w = 0; w < sl->n; w++) mean += (double)strlen(sl->words[w]);
        h_sent += log((double)sl->n);
        len_sent += mean / sl->n;
    }
    len_sent += (SYN_N_SLOTS - 1) + 2; /* spaces, ".\n" */
    double h_sum = 2 * log((double)SYN_MAX), len_sum = 0;
    for (int a = 0; a < SYN_MAX; a++)
        for (int b = 0; b < SYN_MAX; b++)
            len_sum += syn_digits(a) + syn_digits(b) + syn_digits(a + b) + 4; /* "+=.\n" */
    len_sum /= (double)SYN_MAX * SYN_MAX;
    double h_item = log(2.0) + 0.5 * h_sent + 0.5 * h_sum;
    return h_item / (0.5 * len_sent + 0.5 * len_sum);
}

static int syn_choice(uint64_t key, uint64_t item, int slot, int n) {
    int c = (int)(fsdp__uniform_at(key, item * 8 + (uint64_t)slot) * n);
    return c < n ? c : n - 1;
}

/* Writes item `k` into buf (at most 64 bytes); returns its length. */
static size_t syn_item(uint64_t key, uint64_t k, char *buf) {
    size_t len = 0;
    if (syn_choice(key, k, 0, 2) == 0) {
        for (int s = 0; s < SYN_N_SLOTS; s++) {
            const char *w = syn_sentence[s].words[syn_choice(key, k, 1 + s, syn_sentence[s].n)];
            size_t wl = strlen(w);
            memcpy(buf + len, w, wl);
            len += wl;
            buf[len++] = s + 1 < SYN_N_SLOTS ? ' ' : '.';
        }
        buf[len++] = '\n';
    } else {
        int a = syn_choice(key, k, 1, SYN_MAX), b = syn_choice(key, k, 2, SYN_MAX);
        len = (size_t)snprintf(buf, 64, "%d+%d=%d.\n", a, b, a + b);
    }
    return len;
}

enum fsdp_status fsdp_data_synthetic(struct fsdp_ctx *ctx, uint64_t seed, size_t n_bytes,
                                     struct fsdp_data **out) {
    if (!out) return fsdp__err(ctx, FSDP_ERR_INVALID, "synthetic data: out is NULL");
    *out = NULL;
    if (n_bytes < 2)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "synthetic data: n_bytes %zu < 2 tokens", n_bytes);
    struct fsdp_data *d;
    FSDP_TRY(data_new(ctx, &d));
    uint8_t *text = fsdp__alloc(ctx, n_bytes, FSDP_MEM_OTHER, "synthetic corpus");
    if (!text) {
        fsdp_data_free(d);
        return FSDP_ERR_NOMEM;
    }
    uint64_t key = fsdp__hash_str("fsdp.synthetic") ^ (seed * 0x9E3779B97F4A7C15ull);
    size_t used = 0;
    char item[64];
    for (uint64_t k = 0; used < n_bytes; k++) {
        size_t len = syn_item(key, k, item);
        size_t take = len < n_bytes - used ? len : n_bytes - used;
        memcpy(text + used, item, take);
        used += take;
    }
    d->owned = text;
    d->u8 = text;
    d->ntok = n_bytes;
    d->is_text = 1;
    d->floor = syn_floor();
    *out = d;
    return FSDP_OK;
}
