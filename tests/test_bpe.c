/*
 * test_bpe.c - GPT-2's byte-level BPE (src/io/bpe.c, bpe_load.c) without the real
 * vocabulary (tests/t_bpe.sh compares with the JavaScript reference on it):
 * the pre-tokenizer's pieces on chosen strings, both merge algorithms against
 * a plain transcription of GPT-2's bpe() on a random vocabulary whose merge
 * ranks are shuffled, round trips of arbitrary bytes, cut points, the token
 * source, and one clear message for each kind of bad file (a FIFO refused
 * at once).
 * `test_bpe --classes OUT` writes the class of every code point (one byte
 * each, as tests/bpe_ref.js does) for t_bpe.sh to compare with JavaScript's.
 */
#include "io/io-impl.h"

#include <sys/stat.h>

#include "harness.h"

/* ---- A synthetic vocabulary ---- */

static int printable(int b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE; }

/* Appends the JSON string of the byte-symbol spelling of bytes s[0..n). */
static size_t put_sym(char *o, const uint8_t *s, size_t n, int json) {
    static int sym[256];
    if (!sym['!']) {
        int k = 0;
        for (int b = 0; b < 256; b++) sym[b] = printable(b) ? b : 256 + k++;
    }
    size_t w = 0;
    for (size_t i = 0; i < n; i++) {
        int c = sym[s[i]];
        if (json && (c == '"' || c == '\\')) o[w++] = '\\';
        if (c < 0x80) o[w++] = (char)c;
        else {
            o[w++] = (char)(0xC0 | (c >> 6));
            o[w++] = (char)(0x80 | (c & 0x3F));
        }
    }
    return w;
}

#define NTOK 512
struct synth {
    int n;                  /* tokens: 256 bytes, then merge results */
    uint8_t str[NTOK][64];  /* bytes of each id */
    int len[NTOK];
    int nm;                 /* merges, in rank order */
    int ml[NTOK], mr[NTOK], mid[NTOK];
    char enc[NTOK * 160], bpe[NTOK * 160];
};

/* 256 byte tokens plus up to `merges` merges built over "abcd" (each of
 * existing tokens), listed in shuffled order when `shuffle` (ranks then need
 * not follow creation, the case [Note: merge passes] is careful about). */
static void synth_make(struct synth *v, uint64_t seed, int merges, int shuffle) {
    memset(v, 0, sizeof *v);
    for (int b = 0; b < 256; b++) {
        v->str[b][0] = (uint8_t)b;
        v->len[b] = 1;
    }
    v->n = 256;
    uint64_t x = seed * 2654435761u + 1;
#define RND() (x ^= x << 13, x ^= x >> 7, x ^= x << 17, x)
    int pool[NTOK], np = 4;
    pool[0] = 'a', pool[1] = 'b', pool[2] = 'c', pool[3] = 'd';
    for (int tries = 0; v->nm < merges && tries < 100000; tries++) {
        int l = pool[RND() % (uint64_t)np], r = pool[RND() % (uint64_t)np];
        if (v->len[l] + v->len[r] > 12) continue;
        uint8_t s[64];
        memcpy(s, v->str[l], (size_t)v->len[l]);
        memcpy(s + v->len[l], v->str[r], (size_t)v->len[r]);
        int n = v->len[l] + v->len[r], dup = 0;
        for (int i = 256; i < v->n; i++) dup |= v->len[i] == n && !memcmp(v->str[i], s, (size_t)n);
        if (dup) continue;
        memcpy(v->str[v->n], s, (size_t)n);
        v->len[v->n] = n;
        v->ml[v->nm] = l, v->mr[v->nm] = r, v->mid[v->nm] = v->n;
        pool[np++] = v->n++;
        v->nm++;
    }
    for (int i = v->nm - 1; shuffle && i > 0; i--) {
        int j = (int)(RND() % (uint64_t)(i + 1)), t;
        t = v->ml[i], v->ml[i] = v->ml[j], v->ml[j] = t;
        t = v->mr[i], v->mr[i] = v->mr[j], v->mr[j] = t;
        t = v->mid[i], v->mid[i] = v->mid[j], v->mid[j] = t;
    }
#undef RND
    char *o = v->enc;
    *o++ = '{';
    for (int id = 0; id < v->n; id++) {
        *o++ = '"';
        o += put_sym(o, v->str[id], (size_t)v->len[id], 1);
        o += sprintf(o, "\": %d%s", id, id + 1 < v->n ? ", " : "}");
    }
    o = v->bpe + sprintf(v->bpe, "#version: 0.2\n");
    for (int m = 0; m < v->nm; m++) {
        o += put_sym(o, v->str[v->ml[m]], (size_t)v->len[v->ml[m]], 0);
        *o++ = ' ';
        o += put_sym(o, v->str[v->mr[m]], (size_t)v->len[v->mr[m]], 0);
        *o++ = '\n';
    }
}

/* GPT-2's bpe() as written: lowest-rank pair, merge all its occurrences
 * left to right, repeat. */
static int ref_bpe(const struct synth *v, const uint8_t *s, int n, int *w) {
    for (int i = 0; i < n; i++) w[i] = s[i];
    for (;;) {
        int best = -1, bl = 0, br = 0;
        for (int i = 0; i + 1 < n; i++)
            for (int m = 0; m < v->nm; m++)
                if (v->ml[m] == w[i] && v->mr[m] == w[i + 1] && (best < 0 || m < best)) best = m, bl = w[i], br = w[i + 1];
        if (best < 0) return n;
        int o = 0;
        for (int i = 0; i < n;) {
            if (i + 1 < n && w[i] == bl && w[i + 1] == br) w[o++] = v->mid[best], i += 2;
            else w[o++] = w[i++];
        }
        n = o;
    }
}

static struct fsdp_bpe *synth_open(struct fsdp_ctx *ctx, const struct synth *v) {
    struct fsdp_bpe *b = NULL;
    enum fsdp_status st = fsdp__bpe_from_gpt2(ctx, "encoder.json", v->enc, strlen(v->enc), "vocab.bpe",
                                              v->bpe, strlen(v->bpe), &b);
    if (st != FSDP_OK) TEST_FAILF("synthetic vocabulary refused: %s", fsdp_errmsg(ctx));
    return b;
}

/* ---- Pieces ---- */

/* Pieces of s joined with '|'. */
static void pieces(const char *s, char *out) {
    size_t ends[256], n = fsdp__bpe_pieces(s, strlen(s), ends, 256), p = 0, o = 0;
    for (size_t i = 0; i < n; i++) {
        if (i) out[o++] = '|';
        memcpy(out + o, s + p, ends[i] - p);
        o += ends[i] - p;
        p = ends[i];
    }
    out[o] = 0;
}

TEST(pieces_follow_gpt2_regex) {
    static const char *const cases[][2] = {
        {"Hello world", "Hello| world"},
        {"it's I'm we've they'll she'd you're don't", "it|'s| I|'m| we|'ve| they|'ll| she|'d| you|'re| don|'t"},
        {"IT'S 'sre", "IT|'|S| '|sre"},          /* contractions are lower case; ' ?[^\s\pL\pN]+ takes "'" */
        {"!!'s", "!!'|s"},                         /* the punctuation run swallows the apostrophe */
        {"a   b", "a|  | b"},                      /* \s+(?!\S) leaves the last space to the word */
        {"a\tb", "a|\t|b"},                        /* one non-' ' space before a word: \s+ */
        {"a \t b", "a| \t| b"},
        {"a  !", "a| | !"},
        {"x   ", "x|   "},                         /* spaces at the end: all of them */
        {"123 4567 ab12", "123| 4567| ab|12"},
        {"\n\nHi", "\n|\nHi" + 0},                  /* replaced below */
        {"caf\xc3\xa9 na\xc3\xafve", "caf\xc3\xa9| na\xc3\xafve"},
        {"\xe2\x80\x83x", "\xe2\x80\x83|x"},       /* U+2003 is \s */
        {"a\xc2\xa0\xc2\xa0z", "a|\xc2\xa0|\xc2\xa0|z"}, /* NBSP run: \s+(?!\S) then \s+ */
        {"\xc2\x85x", "\xc2\x85x" + 0},            /* replaced below */
        {"x\xff\xfey", "x|\xff\xfe|y"},            /* invalid bytes are 'other' */
        {" \xf0\x9f\x98\x80\xf0\x9f\x98\x82!", " \xf0\x9f\x98\x80\xf0\x9f\x98\x82!"},
        {"\xd9\xa3\xd9\xa4 \xc2\xbd", "\xd9\xa3\xd9\xa4| \xc2\xbd"}, /* Arabic-Indic digits, 1/2: \p{N} */
    };
    char got[512];
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        const char *want = cases[i][1];
        if (i == 10) want = "\n|\n|Hi";           /* "\n\n" before a letter: "\n", then \s+ "\n" */
        if (i == 14) want = "\xc2\x85|x";          /* U+0085 is not \s in JavaScript: other, then letter */
        pieces(cases[i][0], got);
        CHECK_STR_EQ(got, want);
    }
}

TEST(classes_from_the_table) {
    CHECK_INT_EQ(fsdp__bpe_class('a'), 1);
    CHECK_INT_EQ(fsdp__bpe_class(0x4E00), 1);  /* CJK */
    CHECK_INT_EQ(fsdp__bpe_class(0x20000), 1); /* CJK extension B */
    CHECK_INT_EQ(fsdp__bpe_class('7'), 2);
    CHECK_INT_EQ(fsdp__bpe_class(0x2167), 2);  /* Roman numeral eight: Nl */
    CHECK_INT_EQ(fsdp__bpe_class(0xFEFF), 3);
    CHECK_INT_EQ(fsdp__bpe_class(0x3000), 3);
    CHECK_INT_EQ(fsdp__bpe_class(0x85), 0);
    CHECK_INT_EQ(fsdp__bpe_class(0x1F600), 0);
    CHECK_INT_EQ(fsdp__bpe_class(0x301), 0);   /* combining acute: Mn */
    CHECK_INT_EQ(fsdp__bpe_class(-1), 0);
    CHECK_INT_EQ(fsdp__bpe_class(0x110000), 0);
}

/* ---- Merges ---- */

TEST(both_merge_algorithms_match_gpt2_bpe) {
    struct fsdp_ctx *ctx;
    ASSERT_OK(fsdp__ctx_alloc(&ctx), NULL);
    static struct synth v;
    uint64_t x = 99;
    for (int round = 0; round < 6; round++) {
        synth_make(&v, (uint64_t)round + 1, 120, round % 2);
        struct fsdp_bpe *b = synth_open(ctx, &v);
        ASSERT(b);
        for (int t = 0; t < 300; t++) {
            uint8_t s[300];
            int n = 1 + (int)((x = x * 6364136223846793005ull + 1442695040888963407ull) >> 33) % (t < 200 ? 60 : 300);
            for (int i = 0; i < n; i++) s[i] = (uint8_t)("abcd"[(x = x * 6364136223846793005ull + 1) >> 62]);
            int want[300], got_s[300];
            int32_t got_l[300], got_e[300];
            size_t nl = 0, ne = 0;
            int nw = ref_bpe(&v, s, n, want);
            int ns = fsdp__bpe_merge_short(b, s, (size_t)n, got_s);
            CHECK_OK(fsdp__bpe_merge_long(b, s, (size_t)n, got_l, &nl), ctx);
            CHECK_OK(fsdp_bpe_encode(b, s, (size_t)n, got_e, &ne), ctx); /* one piece, cached or not */
            int same_s = n > 48 ? ns == -1 : ns == nw, same_l = (int)nl == nw, same_e = (int)ne == nw;
            for (int i = 0; i < nw; i++) {
                same_s &= n > 48 || (i < ns && got_s[i] == want[i]);
                same_l &= i < (int)nl && got_l[i] == want[i];
                same_e &= i < (int)ne && got_e[i] == want[i];
            }
            if (!same_s || !same_l || !same_e) {
                TEST_FAILF("round %d text %.*s: array %d, heap %d, encode %d (1 = same as GPT-2's bpe)", round,
                           n, (const char *)s, same_s, same_l, same_e);
                break;
            }
        }
        fsdp_bpe_free(b);
    }
    fsdp__ctx_release(ctx);
}

/* decode(encode(x)) == x for arbitrary bytes; a cut point does not change the ids. */
TEST(round_trip_and_cut_points) {
    struct fsdp_ctx *ctx;
    ASSERT_OK(fsdp__ctx_alloc(&ctx), NULL);
    static struct synth v;
    synth_make(&v, 7, 150, 0);
    struct fsdp_bpe *b = synth_open(ctx, &v);
    ASSERT(b);
    enum { N = 6000 };
    static uint8_t s[N], back[N];
    static int32_t ids[N], a[N];
    static const char *const bits[] = {"abcd", " ab", "  ", "\t", "\n", "'s", "'ll", "12", "!!", "\xc3\xa9",
                                       "\xff", "\xe2\x80", "\xf0\x9f\x98\x80", " \xed\xa0\x80", "dcba "};
    uint64_t x = 5;
    for (int round = 0; round < 20; round++) {
        size_t n = 0;
        while (n < N - 8) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            const char *p = (x >> 60) < 14 ? bits[(x >> 33) % 15] : NULL;
            if (p) {
                memcpy(s + n, p, strlen(p));
                n += strlen(p);
            } else {
                s[n++] = (uint8_t)(x >> 40); /* any byte */
            }
        }
        size_t k, len;
        ASSERT_OK(fsdp_bpe_encode(b, s, n, ids, &k), ctx);
        ASSERT_OK(fsdp_bpe_decode(b, ids, k, back, N, &len), ctx);
        CHECK_INT_EQ(len, n);
        CHECK(!memcmp(back, s, n));
        size_t cut = fsdp_bpe_split(s, n, n / 2), ka, kb;
        ASSERT(cut < n);
        ASSERT_OK(fsdp_bpe_encode(b, s, cut, a, &ka), ctx);
        ASSERT_OK(fsdp_bpe_encode(b, s + cut, n - cut, a + ka, &kb), ctx);
        CHECK_INT_EQ(ka + kb, k);
        CHECK(!memcmp(a, ids, k * sizeof *ids));
    }
    size_t len;
    int32_t bad[2] = {3, 9999};
    CHECK_INT_EQ(fsdp_bpe_decode(b, bad, 2, back, N, &len), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "id 9999 at position 1 is not in the vocabulary");
    CHECK_INT_EQ(fsdp_bpe_decode(b, ids, 5, back, 1, &len), FSDP_ERR_INVALID); /* too small */
    fsdp_bpe_free(b);
    fsdp__ctx_release(ctx);
}

/* ---- Files ---- */

/* dst = a b c (strings), asserting it fits. */
static void cat3(char *dst, size_t cap, const char *a, const char *b, const char *c) {
    size_t la = strlen(a), lb = strlen(b), lc = strlen(c);
    FSDP_ASSERT(la + lb + lc < cap, "test buffer too small");
    memcpy(dst, a, la);
    memcpy(dst + la, b, lb);
    memcpy(dst + la + lb, c, lc + 1);
}

static void write_file(const char *path, const char *s) {
    FILE *f = fopen(path, "wb");
    fputs(s, f);
    fclose(f);
}

TEST(token_source_from_text) {
    struct fsdp_ctx *ctx;
    ASSERT_OK(fsdp__ctx_alloc(&ctx), NULL);
    static struct synth v;
    synth_make(&v, 3, 100, 0);
    char dir[] = "/tmp/fsdp_bpe_XXXXXX", p[300];
    ASSERT(mkdtemp(dir));
    snprintf(p, sizeof p, "%s/encoder.json", dir);
    write_file(p, v.enc);
    snprintf(p, sizeof p, "%s/vocab.bpe", dir);
    write_file(p, v.bpe);
    struct fsdp_bpe *b = NULL;
    ASSERT_OK(fsdp_bpe_open(ctx, dir, &b), ctx);
    CHECK_INT_EQ(fsdp_bpe_vocab_size(b), v.n);
    const char *text = "abcd dcba 'll aabbccdd\n\n  abc";
    snprintf(p, sizeof p, "%s/t.txt", dir);
    write_file(p, text);
    struct fsdp_data *d = NULL;
    ASSERT_OK(fsdp_data_open_bpe(ctx, p, b, v.n, &d), ctx);
    int32_t ids[64], in[1], tg[1];
    size_t k;
    ASSERT_OK(fsdp_bpe_encode(b, text, strlen(text), ids, &k), ctx);
    CHECK_INT_EQ(fsdp_data_ntokens(d), k);
    for (size_t i = 0; i + 1 < k; i++) { /* batch of one sequence of one token at offset i */
        fsdp_data_batch(d, (int64_t)i, 1, 1, 0, 1, in, tg);
        CHECK_INT_EQ(in[0], ids[i]);
        CHECK_INT_EQ(tg[0], ids[i + 1]);
    }
    fsdp_data_free(d);
    CHECK_INT_EQ(fsdp_data_open_bpe(ctx, p, b, 100, &d), FSDP_ERR_INVALID); /* ids >= vocab 100 */
    CHECK(d == NULL);
    fsdp_bpe_free(b);
    /* a directory missing a file */
    snprintf(p, sizeof p, "%s/vocab.bpe", dir);
    remove(p);
    CHECK_INT_EQ(fsdp_bpe_open(ctx, dir, &b), FSDP_ERR_IO);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "/vocab.bpe' is missing");
    CHECK(b == NULL);
    snprintf(p, sizeof p, "%s/encoder.json", dir);
    remove(p);
    CHECK_INT_EQ(fsdp_bpe_open(ctx, dir, &b), FSDP_ERR_IO);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "/encoder.json' is missing");
    snprintf(p, sizeof p, "%s/t.txt", dir);
    remove(p);
    rmdir(dir);
    fsdp__ctx_release(ctx);
}

/* A FIFO as a tokenizer file or as the text is refused at once, naming it
 * ([Note: regular files only]): the open used to wait for a writer, so the
 * alarm fails the test instead of the harness's timeout. */
TEST(fifo_refused_not_waited_on) {
    struct fsdp_ctx *ctx;
    ASSERT_OK(fsdp__ctx_alloc(&ctx), NULL);
    static struct synth v;
    synth_make(&v, 5, 50, 0);
    char dir[] = "/tmp/fsdp_bpe_XXXXXX", p[300], q[400];
    ASSERT(mkdtemp(dir));
    alarm(10);
    static const char *const names[][2] = {{"encoder.json", "vocab.bpe"}, {"vocab.bpe", "encoder.json"}};
    struct fsdp_bpe *b = NULL;
    for (int i = 0; i < 2; i++) { /* one of GPT-2's two files a FIFO, the other real */
        snprintf(p, sizeof p, "%s/%s", dir, names[i][0]);
        ASSERT(mkfifo(p, 0600) == 0);
        snprintf(q, sizeof q, "%s/%s", dir, names[i][1]);
        write_file(q, i ? v.enc : v.bpe);
        CHECK_INT_EQ(fsdp_bpe_open(ctx, dir, &b), FSDP_ERR_IO);
        snprintf(q, sizeof q, "%s: not a regular file (a FIFO)", p);
        CHECK_STR_CONTAINS(fsdp_errmsg(ctx), q);
        CHECK(b == NULL);
        remove(p);
        snprintf(p, sizeof p, "%s/%s", dir, names[i][1]);
        remove(p);
    }
    snprintf(p, sizeof p, "%s/encoder.json", dir);
    write_file(p, v.enc);
    snprintf(p, sizeof p, "%s/vocab.bpe", dir);
    write_file(p, v.bpe);
    ASSERT_OK(fsdp_bpe_open(ctx, dir, &b), ctx);
    snprintf(p, sizeof p, "%s/t.txt", dir);
    ASSERT(mkfifo(p, 0600) == 0);
    struct fsdp_data *d = NULL;
    CHECK_INT_EQ(fsdp_data_open_bpe(ctx, p, b, v.n, &d), FSDP_ERR_IO);
    snprintf(q, sizeof q, "%s: not a regular file (a FIFO)", p);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), q);
    CHECK(d == NULL);
    fsdp_bpe_free(b);
    static const char *const all[] = {"t.txt", "encoder.json", "vocab.bpe"};
    for (int i = 0; i < 3; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, all[i]);
        remove(p);
    }
    /* tokenizer.json alone */
    snprintf(p, sizeof p, "%s/tokenizer.json", dir);
    ASSERT(mkfifo(p, 0600) == 0);
    CHECK_INT_EQ(fsdp_bpe_open(ctx, dir, &b), FSDP_ERR_IO);
    snprintf(q, sizeof q, "%s: not a regular file (a FIFO)", p);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), q);
    remove(p);
    rmdir(dir);
    alarm(0);
    fsdp__ctx_release(ctx);
}

/* Each bad vocabulary is refused with one line naming the file and the problem. */
TEST(bad_vocabularies_named) {
    struct fsdp_ctx *ctx;
    ASSERT_OK(fsdp__ctx_alloc(&ctx), NULL);
    static struct synth v;
    synth_make(&v, 11, 20, 0);
    static char enc[sizeof v.enc + 100], bpe[sizeof v.bpe + 100];
    struct { const char *enc_edit, *bpe_add, *msg; } cases[] = {
        {NULL, "a\n", "'vocab.bpe' line 22: expected two symbols separated by one space, got \"a\""},
        {NULL, "a b c\n", "'vocab.bpe' line 22: expected two symbols separated by one space"},
        {NULL, "a  b\n", "line 22: expected two symbols separated by one space"},
        {NULL, "\xc3\x28 b\n", "'vocab.bpe' line 22: the symbol \"\\xC3(\" is not valid UTF-8"},
        {NULL, "a \xe2\x82\xac\n", "line 22: the symbol \"\\xE2\\x82\\xAC\" has the character U+20AC, which is not"},
        {NULL, "a zzzz\n", "line 22: the symbol \"zzzz\" is not in the vocabulary"},
        {NULL, "d d\n", "line 22: the merge \"d\" + \"d\" is not in the vocabulary"},
        {"\"q\xff\": 900, ", NULL, "'encoder.json': key \"q\\xFF\" is not valid UTF-8 (byte 0xFF at offset 1)"},
        {"\"\xe2\x82\xac\": 900, ", NULL, "'encoder.json': key \"\\xE2\\x82\\xAC\" has the character U+20AC"},
        {"\"zz\": 0, ", NULL, "'encoder.json': keys \"zz\" and \"\\xC4\\x80\" both have id 0"},
        {"\"zz\": -1, ", NULL, "'encoder.json': key \"zz\": the id must be a whole number in [0, 4194303]"},
        {"\"zz\": 1.5, ", NULL, "key \"zz\": the id must be a whole number"},
        {"\"a\": 901, ", NULL, "'encoder.json': the key \"a\" appears twice"},
        {"", NULL, NULL}, /* control: accepted */
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        cat3(enc, sizeof enc, "{", cases[i].enc_edit ? cases[i].enc_edit : "", v.enc + 1);
        cat3(bpe, sizeof bpe, v.bpe, cases[i].bpe_add ? cases[i].bpe_add : "", "");
        struct fsdp_bpe *b = NULL;
        enum fsdp_status st = fsdp__bpe_from_gpt2(ctx, "encoder.json", enc, strlen(enc), "vocab.bpe", bpe,
                                                  strlen(bpe), &b);
        if (!cases[i].msg) {
            CHECK_OK(st, ctx);
        } else {
            CHECK_INT_EQ(st, FSDP_ERR_FORMAT);
            CHECK_STR_CONTAINS(fsdp_errmsg(ctx), cases[i].msg);
            CHECK(!strchr(fsdp_errmsg(ctx), '\n'));
            CHECK(b == NULL);
        }
        fsdp_bpe_free(b);
    }
    /* a vocabulary without every byte */
    const char *few = "{\"a\": 0, \"b\": 1}";
    struct fsdp_bpe *b = NULL;
    CHECK_INT_EQ(fsdp__bpe_from_gpt2(ctx, "e.json", few, strlen(few), "v.bpe", "", 0, &b), FSDP_ERR_FORMAT);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "'e.json' has 2 entries; byte-level BPE needs at least the 256");
    CHECK_INT_EQ(fsdp__bpe_from_gpt2(ctx, "e.json", "{\"a\":", 5, "v.bpe", "", 0, &b), FSDP_ERR_FORMAT);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "tokenizer file 'e.json': invalid JSON near byte");
    /* a merges file with no merge (empty, or only its #version line) */
    static const char *const no_merges[] = {"", "#version: 0.2\n", "#version: 0.2\n\n"};
    for (int k = 0; k < 3; k++) {
        CHECK_INT_EQ(fsdp__bpe_from_gpt2(ctx, "encoder.json", v.enc, strlen(v.enc), "vocab.bpe", no_merges[k],
                                         strlen(no_merges[k]), &b), FSDP_ERR_FORMAT);
        CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "'vocab.bpe' holds no merges, so none of the");
        CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "tokens of more than one byte in 'encoder.json' can be made");
        CHECK(b == NULL);
    }
    /* the 256 bytes alone (and a special token) need no merges */
    static struct synth bytes;
    synth_make(&bytes, 3, 0, 0);
    cat3(enc, sizeof enc, "{\"<|endoftext|>\": 256, ", bytes.enc + 1, "");
    CHECK_OK(fsdp__bpe_from_gpt2(ctx, "encoder.json", enc, strlen(enc), "vocab.bpe", bytes.bpe, strlen(bytes.bpe), &b),
             ctx);
    fsdp_bpe_free(b);
    b = NULL;
    const char *two = "{\"a\": 0} {\"b\": 1}"; /* nothing may follow the value */
    CHECK_INT_EQ(fsdp__bpe_from_gpt2(ctx, "e.json", two, strlen(two), "v.bpe", "", 0, &b), FSDP_ERR_FORMAT);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "tokenizer file 'e.json': bytes after the JSON value at byte 9");
    fsdp__ctx_release(ctx);
}

TEST(hugging_face_tokenizer_json) {
    struct fsdp_ctx *ctx;
    ASSERT_OK(fsdp__ctx_alloc(&ctx), NULL);
    static struct synth v;
    synth_make(&v, 13, 60, 1);
    struct fsdp_bpe *ref = synth_open(ctx, &v);
    ASSERT(ref);
    static char js[sizeof v.enc + sizeof v.bpe + 1000], merges[sizeof v.bpe * 2];
    for (int form = 0; form < 2; form++) { /* merges as "a b", then as ["a", "b"] */
        char *o = merges;
        for (int m = 0; m < v.nm; m++) {
            o += sprintf(o, "%s%s\"", m ? ", " : "", form ? "[" : "");
            o += put_sym(o, v.str[v.ml[m]], (size_t)v.len[v.ml[m]], 1);
            o += sprintf(o, form ? "\", \"" : " ");
            o += put_sym(o, v.str[v.mr[m]], (size_t)v.len[v.mr[m]], 1);
            o += sprintf(o, "\"%s", form ? "]" : "");
        }
        *o = 0;
        static char head[2000];
        snprintf(head, sizeof head, "%s",
                 "{\"version\": \"1.0\", \"added_tokens\": [], \"normalizer\": null, \"pre_tokenizer\": "
                 "{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, "
                 "\"use_regex\": true}, \"model\": {\"type\": \"BPE\", \"dropout\": null, "
                 "\"continuing_subword_prefix\": \"\", \"end_of_word_suffix\": \"\", \"fuse_unk\": false, "
                 "\"vocab\": ");
        cat3(js, sizeof js, head, v.enc, ", \"merges\": [");
        cat3(js + strlen(js), sizeof js - strlen(js), merges, "]}}", "");
        struct fsdp_bpe *b = NULL;
        ASSERT_OK(fsdp__bpe_from_hf(ctx, "tokenizer.json", js, strlen(js), &b), ctx);
        const char *text = "abcdabcd ddccbbaa 'll\n\n  cab12";
        int32_t x[64], y[64];
        size_t kx, ky;
        CHECK_OK(fsdp_bpe_encode(b, text, strlen(text), x, &kx), ctx);
        CHECK_OK(fsdp_bpe_encode(ref, text, strlen(text), y, &ky), ctx);
        CHECK_INT_EQ(kx, ky);
        CHECK(!memcmp(x, y, kx * sizeof *x));
        fsdp_bpe_free(b);
    }
    static const char *const bad[][2] = {
        {"{\"model\": {\"type\": \"WordPiece\"}}", "'tokenizer.json': model.type is not \"BPE\""},
        {"{\"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": true}, \"model\": {}}",
         "'tokenizer.json': pre_tokenizer is not GPT-2's"},
        {"{\"model\": {\"dropout\": 0.1}}", "'tokenizer.json': model.dropout is set"},
        {"{\"model\": {\"vocab\": {}}}", "'tokenizer.json': model.vocab has 0 entries"},
        {"{\"models\": {}}", "'tokenizer.json': no \"model\" object"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        struct fsdp_bpe *b = NULL;
        CHECK(fsdp__bpe_from_hf(ctx, "tokenizer.json", bad[i][0], strlen(bad[i][0]), &b) != FSDP_OK);
        CHECK_STR_CONTAINS(fsdp_errmsg(ctx), bad[i][1]);
        CHECK(b == NULL);
    }
    /* a malformed merge entry */
    cat3(js, sizeof js, "{\"model\": {\"vocab\": ", v.enc, ", \"merges\": [\"a b\", \"ab\"]}}");
    struct fsdp_bpe *b = NULL;
    CHECK_INT_EQ(fsdp__bpe_from_hf(ctx, "tokenizer.json", js, strlen(js), &b), FSDP_ERR_FORMAT);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "'tokenizer.json': model.merges[1]: expected two symbols separated by one space, got \"ab\"");
    /* no merges beside a vocabulary of words: none of them could be made */
    cat3(js, sizeof js, "{\"model\": {\"vocab\": ", v.enc, ", \"merges\": []}}");
    CHECK_INT_EQ(fsdp__bpe_from_hf(ctx, "tokenizer.json", js, strlen(js), &b), FSDP_ERR_FORMAT);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "'tokenizer.json': model.merges holds no merges, so none of the");
    CHECK(b == NULL);
    fsdp_bpe_free(ref);
    fsdp__ctx_release(ctx);
}

/* `test_bpe --classes OUT`: the class of every code point, one byte each. */
int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[1], "--classes")) {
        FILE *f = fopen(argv[2], "wb");
        if (!f) return 1;
        for (int32_t cp = 0; cp < 0x110000; cp++) fputc(cp >= 0xD800 && cp <= 0xDFFF ? 255 : fsdp__bpe_class(cp), f);
        return fclose(f) != 0;
    }
    return test_main(argc, argv);
}
