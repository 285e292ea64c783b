/*
 * bpe.c - GPT-2's byte-level BPE tokenizer: encodes any bytes to token ids
 * and decodes ids back to the exact bytes. Reading GPT-2's encoder.json +
 * vocab.bpe or a Hugging Face tokenizer.json of the same kind, and the token
 * source (fsdp_data) made by encoding a text file, are bpe_load.c's; the
 * structures both share are in bpe-impl.h.
 *
 * Encoding is GPT-2's: (1) the text is cut into pieces by the pre-tokenizer
 * regex of [Note: GPT-2 pieces], matched by hand over UTF-8 with the
 * character classes of bpe_unicode.h; (2) each piece's bytes start as the
 * tokens of single bytes (byte_encoder's 256 symbols, [Note: byte symbols]);
 * (3) merges apply in rank order ([Note: merge passes]); a cache remembers
 * the ids of short pieces already seen.
 * Invariants: every id in a piece's result is in the vocabulary, because
 * every byte symbol and every merge result was checked at load; a token
 * covers at least one byte, so n bytes give at most n ids; decode(encode(x))
 * == x for every byte string x, valid UTF-8 or not.
 */
#include "io/bpe-impl.h"

#include <limits.h>
#include <string.h>

#include "io/bpe_unicode.h"

/* ---- UTF-8 and character classes ---- */

/* bpe-impl.h */
int fsdp__utf8_next(const uint8_t *s, size_t n, int32_t *cp) {
    uint8_t c = s[0];
    if (c < 0x80) { *cp = c; return 1; }
    int len;
    int32_t v, min;
    if (c >= 0xC2 && c <= 0xDF) { len = 2; v = c & 0x1F; min = 0x80; }
    else if (c >= 0xE0 && c <= 0xEF) { len = 3; v = c & 0x0F; min = 0x800; }
    else if (c >= 0xF0 && c <= 0xF4) { len = 4; v = c & 0x07; min = 0x10000; }
    else { *cp = -1; return 1; }
    if ((size_t)len > n) { *cp = -1; return 1; }
    for (int i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80) { *cp = -1; return 1; }
        v = (v << 6) | (s[i] & 0x3F);
    }
    if (v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) { *cp = -1; return 1; }
    *cp = v;
    return len;
}

static inline int uclass(int32_t cp) {
    if (cp < 0) return C_OTHER;
    return bpe_uclass_blocks[bpe_uclass_index[cp >> 8]][cp & 255];
}

/* Class of the character at s[0..n) and its length in *len. */
static inline int class_at(const uint8_t *s, size_t n, int *len) {
    if (s[0] < 0x80) {
        *len = 1;
        return bpe_uclass_blocks[0][s[0]];
    }
    int32_t cp;
    *len = fsdp__utf8_next(s, n, &cp);
    return uclass(cp);
}

int fsdp__bpe_class(int32_t cp) { return cp >= 0 && cp <= 0x10FFFF ? uclass(cp) : C_OTHER; }

/* ---- Pre-tokenizer ---- */

/* [Note: GPT-2 pieces]
 * GPT-2 cuts text with the regex
 *   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * matched repeatedly from the end of the previous match. Every character is
 * a letter, a number, a space (\s) or other, so some alternative always
 * matches, and the pieces cover the text. By hand, from position p:
 *  - a contraction (case-sensitive bytes) if one starts at p;
 *  - an optional ' ' (U+0020 only) followed by a maximal run of one class
 *    (letters, numbers or other), the class of the character after the space;
 *  - else a run of spaces: to the end of the text if it reaches it; else all
 *    but its last character if it has two or more (\s+(?!\S) backtracks one
 *    character, leaving the last space to lead the next piece); else the one
 *    space character (\s+).
 * An invalid UTF-8 byte is a character of class other (as U+FFFD would be).
 * \s is JavaScript's (the reference encoder is JavaScript; see
 * scripts/gen_unicode_classes.py). */
static size_t piece_end(const uint8_t *s, size_t n, size_t p) {
    if (s[p] == '\'' && p + 1 < n) {
        uint8_t a = s[p + 1], b = p + 2 < n ? s[p + 2] : 0;
        if (a == 's' || a == 't' || a == 'm' || a == 'd') return p + 2;
        if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return p + 3;
    }
    size_t q = p;
    int len, c = class_at(s + q, n - q, &len);
    if (s[q] == ' ' && q + 1 < n) {
        int len1, c1 = class_at(s + q + 1, n - q - 1, &len1);
        if (c1 != C_SPACE) {
            c = c1;
            q += 1;
            len = len1;
        }
    }
    if (c != C_SPACE) {
        q += (size_t)len;
        while (q < n) {
            if (s[q] < 0x80) {
                if (bpe_uclass_blocks[0][s[q]] != c) break;
                q++;
                continue;
            }
            if (class_at(s + q, n - q, &len) != c) break;
            q += (size_t)len;
        }
        return q;
    }
    size_t last = q; /* start of the run's last character */
    int chars = 0;
    while (q < n && class_at(s + q, n - q, &len) == C_SPACE) {
        last = q;
        q += (size_t)len;
        chars++;
    }
    if (q == n) return q;
    return chars >= 2 ? last : q;
}

size_t fsdp_bpe_split(const void *text, size_t len, size_t from) {
    /* p is a piece start when s[p] == ' ' and s[p-1] is an ASCII character
     * that is not a space: the piece holding s[p-1] has no space after its
     * optional leading ' ', so it ends at p; and matches before p look at
     * most one character past their end, which for a run of spaces ending
     * before p-1 is still before p. */
    const uint8_t *s = text;
    for (size_t p = from > 0 ? from : 1; p < len; p++)
        if (s[p] == ' ' && s[p - 1] < 0x80 && bpe_uclass_blocks[0][s[p - 1]] != C_SPACE) return p;
    return len;
}

/* ---- Merges ---- */

static inline const struct merge_slot *merge_find(const struct fsdp_bpe *b, int32_t x, int32_t y) {
    uint64_t key = (uint64_t)(uint32_t)x << 32 | (uint32_t)y;
    uint32_t mask = b->merge_cap - 1;
    for (uint32_t i = (uint32_t)mix64(key) & mask;; i = (i + 1) & mask) {
        const struct merge_slot *m = &b->merges[i];
        if (m->rank < 0) return NULL;
        if (m->key == key) return m;
    }
}

/* [Note: merge passes]
 * GPT-2's bpe() repeats: take the adjacent pair of lowest rank; if it has no
 * rank, stop; else merge every occurrence of that pair, left to right
 * without overlap, in one pass. A pass makes no new occurrence of its own
 * pair (a+b is longer than a and than b), so the pass is the same as merging
 * the occurrences present at its start in position order, skipping one that
 * an earlier merge took a symbol from. Short pieces do exactly the passes
 * over an array (quadratic, but small); long ones (a run of thousands of
 * letters) use a heap of (rank, position) from which a whole rank is taken
 * out before any of its merges is done, so that a pair of lower rank made
 * during a pass waits for the pass to end, as it does in GPT-2's loop. */
static inline int32_t pair_rank(const struct fsdp_bpe *b, int32_t x, int32_t y) {
    const struct merge_slot *m = merge_find(b, x, y);
    return m ? m->rank : INT32_MAX;
}

/* w[0..n), n <= BPE_SHORT; r[i] is the rank of (w[i], w[i+1]), and only
 * the pairs touching a merge are looked up again after a pass. */
static int merge_array(const struct fsdp_bpe *b, int32_t *w, int n) {
    int32_t r[BPE_SHORT];
    for (int i = 0; i + 1 < n; i++) r[i] = pair_rank(b, w[i], w[i + 1]);
    while (n > 1) {
        int32_t best = INT32_MAX;
        int at = 0;
        for (int i = 0; i + 1 < n; i++)
            if (r[i] < best) best = r[i], at = i;
        if (best == INT32_MAX) break;
        int32_t x = w[at], y = w[at + 1], id = merge_find(b, x, y)->id;
        int o = 0;
        uint8_t fresh[BPE_SHORT]; /* output position o holds a merge result */
        for (int i = 0; i < n;) {
            if (i + 1 < n && w[i] == x && w[i + 1] == y) {
                fresh[o] = 1;
                w[o++] = id;
                i += 2;
            } else {
                fresh[o] = 0;
                r[o] = r[i]; /* valid unless a neighbour merged: fixed below */
                w[o++] = w[i++];
            }
        }
        n = o;
        for (int i = 0; i + 1 < n; i++)
            if (fresh[i] || fresh[i + 1]) r[i] = pair_rank(b, w[i], w[i + 1]);
    }
    return n;
}

struct hent { int32_t rank, pos, x, y; };

static inline int hless(const struct hent *a, const struct hent *b) {
    return a->rank < b->rank || (a->rank == b->rank && a->pos < b->pos);
}

static void hpush(struct hent *h, size_t *n, struct hent e) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!hless(&e, &h[parent])) break;
        h[i] = h[parent];
        i = parent;
    }
    h[i] = e;
}

static struct hent hpop(struct hent *h, size_t *n) {
    struct hent top = h[0], e = h[--*n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && hless(&h[c + 1], &h[c])) c++;
        if (!hless(&h[c], &e)) break;
        h[i] = h[c];
        i = c;
    }
    if (*n) h[i] = e;
    return top;
}

/* Merges w[0..n) (one id per byte) with a heap; returns the new length.
 * nx, pv: (n) links of the list of symbols; h, group: (3n) heap entries. */
static int merge_heap(const struct fsdp_bpe *b, int32_t *w, int n, int32_t *nx, int32_t *pv,
                      struct hent *h, struct hent *group) {
    size_t hn = 0;
    for (int i = 0; i < n; i++) {
        nx[i] = i + 1 < n ? i + 1 : -1;
        pv[i] = i - 1;
    }
    for (int i = 0; i + 1 < n; i++) {
        const struct merge_slot *m = merge_find(b, w[i], w[i + 1]);
        if (m) hpush(h, &hn, (struct hent){m->rank, i, w[i], w[i + 1]});
    }
    while (hn) {
        int32_t r = h[0].rank;
        size_t g = 0;
        while (hn && h[0].rank == r) group[g++] = hpop(h, &hn);
        for (size_t k = 0; k < g; k++) {
            struct hent e = group[k];
            int32_t i = e.pos, j = nx[i];
            if (w[i] != e.x || j < 0 || w[j] != e.y) continue; /* stale (w[i] = -1: gone) */
            const struct merge_slot *m = merge_find(b, e.x, e.y);
            w[i] = m->id;
            w[j] = -1;
            nx[i] = nx[j];
            if (nx[j] >= 0) pv[nx[j]] = i;
            if (pv[i] >= 0) {
                const struct merge_slot *mp = merge_find(b, w[pv[i]], w[i]);
                if (mp) hpush(h, &hn, (struct hent){mp->rank, pv[i], w[pv[i]], w[i]});
            }
            if (nx[i] >= 0) {
                const struct merge_slot *mn = merge_find(b, w[i], w[nx[i]]);
                if (mn) hpush(h, &hn, (struct hent){mn->rank, i, w[i], w[nx[i]]});
            }
        }
    }
    int o = 0;
    for (int i = 0; i >= 0; i = nx[i]) w[o++] = w[i];
    return o;
}

/* ---- Cache of short pieces ---- */

static void cache_clear(struct fsdp_bpe *b) {
    memset(b->cache, 0, CACHE_SLOTS * sizeof *b->cache);
    b->pool_used = b->cache_used = 0;
}

/* ---- Encode ---- */

/* Encodes one piece s[0..n) into ids; returns how many. scratch holds
 * BPE_SHORT int32 for short pieces; long ones allocate. */
static enum fsdp_status encode_piece(struct fsdp_bpe *b, const uint8_t *s, size_t n, int32_t *ids,
                                     size_t *n_out) {
    if (n <= BPE_SHORT) {
        uint64_t h = hash_bytes(s, n);
        uint32_t mask = CACHE_SLOTS - 1, i = (uint32_t)h & mask;
        for (;; i = (i + 1) & mask) {
            struct cache_slot *c = &b->cache[i];
            if (!c->hash) break;
            if (c->hash == h && c->len == n && !memcmp(b->pool + c->off, s, n)) {
                memcpy(ids, b->pool + ((c->off + n + 3) & ~3u), (size_t)c->n * 4);
                *n_out = c->n;
                return FSDP_OK;
            }
        }
        int32_t w[BPE_SHORT];
        for (size_t k = 0; k < n; k++) w[k] = b->byte_id[s[k]];
        int m = merge_array(b, w, (int)n);
        memcpy(ids, w, (size_t)m * 4);
        *n_out = (size_t)m;
        uint32_t need = ((uint32_t)n + 3 + 4 * (uint32_t)m + 3) & ~3u;
        if (b->cache_used >= CACHE_SLOTS / 2 || b->pool_used + need > CACHE_BYTES) {
            cache_clear(b);
            i = (uint32_t)h & mask;
        }
        struct cache_slot *c = &b->cache[i];
        c->hash = h;
        c->off = b->pool_used;
        c->len = (uint16_t)n;
        c->n = (uint16_t)m;
        memcpy(b->pool + c->off, s, n);
        memcpy(b->pool + ((c->off + n + 3) & ~3u), w, (size_t)m * 4);
        b->pool_used += need;
        b->cache_used++;
        return FSDP_OK;
    }
    return fsdp__bpe_merge_long(b, s, n, ids, n_out);
}

enum fsdp_status fsdp__bpe_merge_long(struct fsdp_bpe *b, const uint8_t *s, size_t n, int32_t *ids,
                                      size_t *n_out) {
    if (n > INT32_MAX / 4)
        return fsdp__err(b->ctx, FSDP_ERR_INVALID, "BPE: a piece of %zu bytes is too long", n);
    /* the heap holds the n - 1 first pairs and two per merge (at most n - 1) */
    size_t bytes = n * (3 * sizeof(int32_t) + 6 * sizeof(struct hent));
    int32_t *nx = fsdp__alloc(b->ctx, bytes, FSDP_MEM_OTHER, "BPE merge heap");
    if (!nx) return FSDP_ERR_NOMEM;
    int32_t *pv = nx + n, *w = pv + n;
    struct hent *h = (struct hent *)(w + n), *group = h + 3 * n;
    for (size_t k = 0; k < n; k++) w[k] = b->byte_id[s[k]];
    int m = n > 1 ? merge_heap(b, w, (int)n, nx, pv, h, group) : (int)n;
    memcpy(ids, w, (size_t)m * 4);
    *n_out = (size_t)m;
    fsdp__free(b->ctx, nx);
    return FSDP_OK;
}

int fsdp__bpe_merge_short(const struct fsdp_bpe *b, const uint8_t *s, size_t n, int32_t *ids) {
    if (n > BPE_SHORT) return -1;
    for (size_t k = 0; k < n; k++) ids[k] = b->byte_id[s[k]];
    return merge_array(b, ids, (int)n);
}

enum fsdp_status fsdp_bpe_encode(struct fsdp_bpe *b, const void *text, size_t len, int32_t *ids,
                                 size_t *n_ids) {
    const uint8_t *s = text;
    size_t o = 0;
    *n_ids = 0;
    if (!b->cache) {
        b->cache = fsdp__calloc(b->ctx, CACHE_SLOTS * sizeof *b->cache, FSDP_MEM_OTHER, "BPE cache");
        b->pool = fsdp__alloc(b->ctx, CACHE_BYTES, FSDP_MEM_OTHER, "BPE cache");
        if (!b->cache || !b->pool) {
            fsdp__free(b->ctx, b->cache);
            fsdp__free(b->ctx, b->pool);
            b->cache = NULL;
            b->pool = NULL;
            return FSDP_ERR_NOMEM;
        }
    }
    for (size_t p = 0; p < len;) {
        size_t e = piece_end(s, len, p), k;
        FSDP_TRY(encode_piece(b, s + p, e - p, ids + o, &k));
        o += k;
        p = e;
    }
    *n_ids = o;
    return FSDP_OK;
}

size_t fsdp__bpe_pieces(const void *text, size_t len, size_t *ends, size_t cap) {
    size_t k = 0;
    for (size_t p = 0; p < len && k < cap;) ends[k++] = p = piece_end(text, len, p);
    return k;
}

/* ---- Decode ---- */

int fsdp_bpe_vocab_size(const struct fsdp_bpe *b) { return b ? b->n_ids : 0; }

const void *fsdp_bpe_token(const struct fsdp_bpe *b, int32_t id, size_t *len) {
    if (!b || id < 0 || id >= b->n_ids || !b->tok_has[id]) return NULL;
    if (len) *len = b->tok_off[id + 1] - b->tok_off[id];
    return b->tok_bytes + b->tok_off[id];
}

enum fsdp_status fsdp_bpe_decode(struct fsdp_bpe *b, const int32_t *ids, size_t n, void *out,
                                 size_t cap, size_t *len) {
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        size_t l;
        const void *t = fsdp_bpe_token(b, ids[i], &l);
        if (!t)
            return fsdp__err(b->ctx, FSDP_ERR_INVALID,
                             "BPE decode: id %d at position %zu is not in the vocabulary", (int)ids[i], i);
        if (o + l <= cap) memcpy((uint8_t *)out + o, t, l);
        o += l;
    }
    *len = o;
    if (o > cap)
        return fsdp__err(b->ctx, FSDP_ERR_INVALID, "BPE decode: %zu bytes do not fit the %zu given", o,
                         cap);
    return FSDP_OK;
}
