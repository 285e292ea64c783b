/*
 * fuzz_bpe.c - libFuzzer target for GPT-2's byte-level BPE (src/io/bpe.c,
 * src/io/bpe_load.c): the vocabulary readers and encode/decode. Byte 0
 * picks what the rest is:
 *   0: an encoder.json (with an empty vocab.bpe: refused where it holds
 *      a token of more than one byte, which no merge could make)
 *   1: a vocab.bpe over a built-in encoder.json
 *   2: a Hugging Face tokenizer.json
 *   3+: text, encoded with a built-in tokenizer (GPT-2-like merges over
 *       English words, spaces, digits, contractions and a two-byte letter)
 * Every accepted vocabulary encodes and decodes a fixed text and the input
 * itself; on text the checks are: at most one id per byte, every id in the
 * vocabulary, decode(encode(x)) == x, the array and heap merges agree on
 * every piece, and a cut from fsdp_bpe_split leaves the ids unchanged.
 */
#include "fuzz.h"
#include "io/io-impl.h"

#include <string.h>

static int bpe_fz_printable(int b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE; }

/* The byte-symbol spelling of s[0..n) (UTF-8), JSON-escaped when json. */
static size_t bpe_fz_sym(char *o, const char *s, size_t n, int json) {
    int sym[256], k = 0;
    for (int b = 0; b < 256; b++) sym[b] = bpe_fz_printable(b) ? b : 256 + k++;
    size_t w = 0;
    for (size_t i = 0; i < n; i++) {
        int c = sym[(uint8_t)s[i]];
        if (json && (c == '"' || c == '\\')) o[w++] = '\\';
        if (c < 0x80) o[w++] = (char)c;
        else o[w++] = (char)(0xC0 | (c >> 6)), o[w++] = (char)(0x80 | (c & 0x3F));
    }
    return w;
}

static char bpe_fz_enc[64 << 10], bpe_fz_merges[32 << 10];

/* Builds the built-in vocabulary: the 256 bytes, then each word's prefixes
 * merged one byte at a time (so ranks follow creation, as in a trained BPE). */
static void bpe_fz_build(void) {
    static const char *const words[] = {" the", "the", " and", "ing", " a", "ab", "abab", "    ", "\n\n",
                                        "'s", "'ll", "123", "2026", " caf\xc3\xa9", "\xc3\xa9\xc3\xa9", " x",
                                        "!!", "...", " \xf0\x9f\x98\x80", "tion", " nation", "  \t"};
    static char tok[600][24];
    static size_t tl[600];
    int n = 0;
    for (int b = 0; b < 256; b++) tok[n][0] = (char)b, tl[n++] = 1;
    char *m = bpe_fz_merges + sprintf(bpe_fz_merges, "#version: 0.2\n");
    for (size_t w = 0; w < sizeof words / sizeof *words; w++) {
        size_t len = strlen(words[w]);
        for (size_t i = 2; i <= len; i++) {
            int dup = 0;
            for (int t = 256; t < n; t++) dup |= tl[t] == i && !memcmp(tok[t], words[w], i);
            if (dup) continue;
            memcpy(tok[n], words[w], i);
            tl[n++] = i;
            m += bpe_fz_sym(m, words[w], i - 1, 0);
            *m++ = ' ';
            m += bpe_fz_sym(m, words[w] + i - 1, 1, 0);
            *m++ = '\n';
        }
    }
    *m = 0;
    char *e = bpe_fz_enc;
    *e++ = '{';
    for (int t = 0; t < n; t++) {
        *e++ = '"';
        e += bpe_fz_sym(e, tok[t], tl[t], 1);
        e += sprintf(e, "\": %d%s", t, t + 1 < n ? ", " : "}");
    }
    *e = 0;
}

/* Encodes and decodes text[0..n) with b, checking the invariants above. */
static void bpe_fz_check_text(struct fsdp_ctx *ctx, struct fsdp_bpe *b, const uint8_t *text, size_t n) {
    int32_t *ids = malloc((n + 1) * sizeof *ids), *ids2 = malloc((n + 1) * sizeof *ids2);
    uint8_t *back = malloc(n + 1);
    size_t k = 0, len = 0, *ends = malloc((n + 1) * sizeof *ends);
    FSDP_ASSERT(ids && ids2 && back && ends, "fuzz: out of memory");
    FSDP_ASSERT(fsdp_bpe_encode(b, text, n, ids, &k) == FSDP_OK, "encode failed: %s", fsdp_errmsg(ctx));
    FSDP_ASSERT(k <= n, "%zu ids for %zu bytes", k, n);
    for (size_t i = 0; i < k; i++)
        FSDP_ASSERT(fsdp_bpe_token(b, ids[i], NULL) != NULL, "id %d not in the vocabulary", (int)ids[i]);
    FSDP_ASSERT(fsdp_bpe_decode(b, ids, k, back, n, &len) == FSDP_OK, "decode failed: %s", fsdp_errmsg(ctx));
    FSDP_ASSERT(len == n && (n == 0 || !memcmp(back, text, n)), "decode(encode(x)) != x");
    /* pieces cover the text; both merge algorithms agree on each */
    size_t np = fsdp__bpe_pieces(text, n, ends, n + 1), p = 0, o = 0;
    for (size_t i = 0; i < np; i++) {
        FSDP_ASSERT(ends[i] > p && ends[i] <= n, "piece %zu ends at %zu (start %zu)", i, ends[i], p);
        size_t kl;
        FSDP_ASSERT(fsdp__bpe_merge_long(b, text + p, ends[i] - p, ids2, &kl) == FSDP_OK, "merge failed");
        FSDP_ASSERT(o + kl <= k && !memcmp(ids2, ids + o, kl * sizeof *ids), "heap merge differs at piece %zu", i);
        if (ends[i] - p <= 48) {
            int ks = fsdp__bpe_merge_short(b, text + p, ends[i] - p, ids2);
            FSDP_ASSERT(ks == (int)kl && !memcmp(ids2, ids + o, kl * sizeof *ids), "array merge differs at piece %zu", i);
        }
        o += kl;
        p = ends[i];
    }
    FSDP_ASSERT(p == n && o == k, "pieces cover %zu of %zu bytes", p, n);
    /* a cut point changes nothing */
    size_t cut = fsdp_bpe_split(text, n, n / 2), ka = 0, kb = 0;
    FSDP_ASSERT(cut >= 1 || n == 0, "cut at 0");
    if (cut < n) {
        FSDP_ASSERT(fsdp_bpe_encode(b, text, cut, ids2, &ka) == FSDP_OK, "encode failed");
        FSDP_ASSERT(fsdp_bpe_encode(b, text + cut, n - cut, ids2 + ka, &kb) == FSDP_OK, "encode failed");
        FSDP_ASSERT(ka + kb == k && !memcmp(ids, ids2, k * sizeof *ids), "cut at %zu changes the ids", cut);
    }
    free(ids);
    free(ids2);
    free(back);
    free(ends);
}

static enum fsdp_status fuzz_bpe_one(const uint8_t *data, size_t size) {
    if (size < 1) return FSDP_ERR_INVALID;
    static int built;
    if (!built) bpe_fz_build(), built = 1;
    struct fsdp_ctx *ctx;
    if (fsdp__ctx_alloc(&ctx) != FSDP_OK) return FSDP_ERR_NOMEM;
    struct fsdp_bpe *b = NULL;
    const uint8_t *rest = data + 1;
    size_t n = size - 1;
    enum fsdp_status st;
    if (data[0] == 0)
        st = fsdp__bpe_from_gpt2(ctx, "encoder.json", rest, n, "vocab.bpe", "", 0, &b);
    else if (data[0] == 1)
        st = fsdp__bpe_from_gpt2(ctx, "encoder.json", bpe_fz_enc, strlen(bpe_fz_enc), "vocab.bpe", rest, n, &b);
    else if (data[0] == 2)
        st = fsdp__bpe_from_hf(ctx, "tokenizer.json", rest, n, &b);
    else { /* the built-in tokenizer, made once: its cache carries over between inputs */
        static struct fsdp_ctx *keep_ctx;
        static struct fsdp_bpe *keep;
        if (!keep) {
            FSDP_ASSERT(fsdp__ctx_alloc(&keep_ctx) == FSDP_OK, "fuzz: no context");
            st = fsdp__bpe_from_gpt2(keep_ctx, "encoder.json", bpe_fz_enc, strlen(bpe_fz_enc), "vocab.bpe",
                                     bpe_fz_merges, strlen(bpe_fz_merges), &keep);
            FSDP_ASSERT(st == FSDP_OK, "the built-in vocabulary was refused: %s", fsdp_errmsg(keep_ctx));
        }
        bpe_fz_check_text(keep_ctx, keep, rest, n);
        fsdp__ctx_release(ctx);
        return FSDP_OK;
    }
    if (st == FSDP_OK) {
        FSDP_ASSERT(b != NULL, "accepted without a tokenizer");
        static const char fixed[] = "Hello world, it's 2026!\n\n  caf\xc3\xa9 \xff\xfe the nation's abab";
        bpe_fz_check_text(ctx, b, (const uint8_t *)fixed, sizeof fixed - 1);
        bpe_fz_check_text(ctx, b, rest, n < 4096 ? n : 4096);
    } else {
        FSDP_ASSERT(b == NULL, "refused but returned a tokenizer");
        FUZZ_CHECK_REFUSAL(ctx, st);
    }
    fsdp_bpe_free(b);
    fsdp__ctx_release(ctx);
    return st;
}

FUZZ_ENTRY(fuzz_bpe_one)
