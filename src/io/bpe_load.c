/*
 * bpe_load.c - the BPE tokenizer's files (its encoding is bpe.c's): GPT-2's
 * encoder.json + vocab.bpe, or a Hugging Face tokenizer.json of the same
 * kind (a byte-level BPE with GPT-2's pre-tokenizer, checked field by field),
 * read into the vocabulary, the byte symbols' ids and the merge table, every
 * id and merge checked so that encoding never meets an unknown one; and a
 * token source (fsdp_data) made by encoding a text file.
 */
#include "io/bpe-impl.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- Byte symbols ---- */

/* [Note: byte symbols]
 * GPT-2 writes each byte as one printable character so that vocabulary files
 * are text: bytes '!'..'~', 0xA1..0xAC and 0xAE..0xFF stand for themselves
 * (as code points), and the other 68 bytes, in increasing order, for U+0100,
 * U+0101, ... U+0143. So ' ' is 'Ġ' (U+0120) and '\n' is 'Ċ' (U+010A). */
static int byte_printable(int b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE; }

static uint16_t sym_of_byte[256]; /* byte -> code point */
static int16_t byte_of_sym[0x144]; /* code point -> byte, -1 if none */
static int syms_ready;

static void syms_init(void) {
    if (__atomic_load_n(&syms_ready, __ATOMIC_ACQUIRE)) return;
    int16_t bs[0x144];
    uint16_t sb[256];
    for (int c = 0; c < 0x144; c++) bs[c] = -1;
    int n = 0;
    for (int b = 0; b < 256; b++) {
        sb[b] = (uint16_t)(byte_printable(b) ? b : 256 + n++);
        bs[sb[b]] = (int16_t)b;
    }
    memcpy(sym_of_byte, sb, sizeof sb); /* same values from every thread */
    memcpy(byte_of_sym, bs, sizeof bs);
    __atomic_store_n(&syms_ready, 1, __ATOMIC_RELEASE);
}

/* ---- Loading ---- */

void fsdp_bpe_free(struct fsdp_bpe *b) {
    if (!b) return;
    struct fsdp_ctx *ctx = b->ctx;
    fsdp__free(ctx, b->tok_off);
    fsdp__free(ctx, b->tok_has);
    fsdp__free(ctx, b->tok_bytes);
    fsdp__free(ctx, b->merges);
    fsdp__free(ctx, b->cache);
    fsdp__free(ctx, b->pool);
    fsdp__free(ctx, b);
}

/* A symbol string (UTF-8 of byte symbols) -> bytes in out (n bytes, at most
 * the string's length). Returns 0, or -1 with a reason in why. */
static int sym_decode(const uint8_t *s, size_t n, uint8_t *out, size_t *olen, char *why, size_t cap) {
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        int32_t cp;
        int l = fsdp__utf8_next(s + i, n - i, &cp);
        if (cp < 0) {
            snprintf(why, cap, "is not valid UTF-8 (byte 0x%02X at offset %zu)", s[i], i);
            return -1;
        }
        if (cp >= 0x144 || byte_of_sym[cp] < 0) {
            snprintf(why, cap, "has the character U+%04X, which is not one of byte-level BPE's 256 "
                     "byte symbols", (unsigned)cp);
            return -1;
        }
        out[o++] = (uint8_t)byte_of_sym[cp];
        i += (size_t)l;
    }
    *olen = o;
    return 0;
}

/* The vocabulary under construction: string -> id (by the decoded bytes). */
struct vocab_build {
    uint32_t cap;     /* slots, power of two */
    int32_t *slot;    /* (cap) id or -1 */
};

static int32_t vocab_lookup(const struct fsdp_bpe *b, const struct vocab_build *vb, const uint8_t *s,
                            size_t n) {
    uint32_t mask = vb->cap - 1;
    for (uint32_t i = (uint32_t)hash_bytes(s, n) & mask;; i = (i + 1) & mask) {
        int32_t id = vb->slot[i];
        if (id < 0) return -1;
        size_t l = b->tok_off[id + 1] - b->tok_off[id];
        if (l == n && !memcmp(b->tok_bytes + b->tok_off[id], s, n)) return id;
    }
}

/* Reads a JSON object {symbols: id} (GPT-2's encoder.json, tokenizer.json's
 * model.vocab) into b's tokens; `what` names it in messages. */
static enum fsdp_status read_vocab(struct fsdp_bpe *b, const char *what, const cJSON *obj,
                                   struct vocab_build *vb) {
    struct fsdp_ctx *ctx = b->ctx;
    char buf[200], why[160];
    if (!cJSON_IsObject(obj)) return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s is not a JSON object", what);
    int32_t max_id = -1;
    size_t n_keys = 0, total = 0;
    for (const cJSON *e = obj->child; e; e = e->next) {
        double v = cJSON_IsNumber(e) ? e->valuedouble : -1;
        if (!cJSON_IsNumber(e) || v < 0 || v > BPE_MAX_ID || v != (double)(int32_t)v)
            return fsdp__err(ctx, FSDP_ERR_FORMAT,
                             "%s: key \"%s\": the id must be a whole number in [0, %d]", what,
                             fsdp__shown(e->string, strlen(e->string), buf, sizeof buf), BPE_MAX_ID);
        if ((int32_t)v > max_id) max_id = (int32_t)v;
        n_keys++;
        total += strlen(e->string);
    }
    if (n_keys < 256)
        return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s has %zu entries; byte-level BPE needs at least the "
                         "256 byte symbols", what, n_keys);
    b->n_ids = max_id + 1;
    b->tok_off = fsdp__calloc(ctx, ((size_t)b->n_ids + 1) * sizeof *b->tok_off, FSDP_MEM_OTHER, "BPE vocabulary");
    b->tok_has = fsdp__calloc(ctx, (size_t)b->n_ids, FSDP_MEM_OTHER, "BPE vocabulary");
    b->tok_bytes = fsdp__alloc(ctx, total + 1, FSDP_MEM_OTHER, "BPE vocabulary");
    vb->cap = 1;
    while (vb->cap < 2 * n_keys) vb->cap <<= 1;
    vb->slot = fsdp__alloc(ctx, vb->cap * sizeof(int32_t), FSDP_MEM_OTHER, "BPE vocabulary index");
    uint32_t *len = fsdp__calloc(ctx, (size_t)b->n_ids * sizeof(uint32_t), FSDP_MEM_OTHER, "BPE vocabulary");
    uint8_t *tmp = fsdp__alloc(ctx, total + 1, FSDP_MEM_OTHER, "BPE vocabulary");
    uint32_t *at = fsdp__alloc(ctx, (size_t)b->n_ids * sizeof(uint32_t), FSDP_MEM_OTHER, "BPE vocabulary");
    enum fsdp_status st = FSDP_OK;
    if (!b->tok_off || !b->tok_has || !b->tok_bytes || !vb->slot || !len || !tmp || !at) {
        st = FSDP_ERR_NOMEM;
        goto out;
    }
    memset(vb->slot, 0xFF, vb->cap * sizeof(int32_t));
    /* pass 1: decode every key into tmp, note its id, length and place */
    size_t o = 0;
    for (const cJSON *e = obj->child; e; e = e->next) {
        int32_t id = (int32_t)e->valuedouble;
        size_t kl = strlen(e->string), bl;
        if (!kl) {
            st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: an empty key (id %d)", what, (int)id);
            goto out;
        }
        if (sym_decode((const uint8_t *)e->string, kl, tmp + o, &bl, why, sizeof why)) {
            st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: key \"%s\" %s", what,
                           fsdp__shown(e->string, kl, buf, sizeof buf), why);
            goto out;
        }
        if (b->tok_has[id]) {
            char b2[200], sp[4 * 48];
            size_t l = 0; /* the first key, spelled in symbols again */
            for (uint32_t k = 0; k < len[id] && l + 2 <= sizeof sp; k++) {
                uint16_t c = sym_of_byte[tmp[at[id] + k]];
                if (c < 0x80) sp[l++] = (char)c;
                else sp[l++] = (char)(0xC0 | (c >> 6)), sp[l++] = (char)(0x80 | (c & 0x3F));
            }
            st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: keys \"%s\" and \"%s\" both have id %d", what,
                           fsdp__shown(sp, l, b2, sizeof b2),
                           fsdp__shown(e->string, kl, buf, sizeof buf), (int)id);
            goto out;
        }
        b->tok_has[id] = 1;
        len[id] = (uint32_t)bl;
        at[id] = (uint32_t)o;
        o += bl;
    }
    /* pass 2: lay the tokens out by id and index them */
    uint32_t off = 0;
    for (int32_t id = 0; id < b->n_ids; id++) {
        b->tok_off[id] = off;
        if (b->tok_has[id]) {
            memcpy(b->tok_bytes + off, tmp + at[id], len[id]);
            off += len[id];
        }
    }
    b->tok_off[b->n_ids] = off;
    for (int32_t id = 0; id < b->n_ids; id++) {
        if (!b->tok_has[id]) continue;
        const uint8_t *s = b->tok_bytes + b->tok_off[id];
        size_t n = len[id];
        if (vocab_lookup(b, vb, s, n) >= 0) {
            st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: the key \"%s\" appears twice", what,
                           fsdp__shown(s, n, buf, sizeof buf));
            goto out;
        }
        uint32_t mask = vb->cap - 1, i = (uint32_t)hash_bytes(s, n) & mask;
        while (vb->slot[i] >= 0) i = (i + 1) & mask;
        vb->slot[i] = id;
    }
    for (int c = 0; c < 256; c++) {
        uint8_t byte = (uint8_t)c;
        b->byte_id[c] = vocab_lookup(b, vb, &byte, 1);
        if (b->byte_id[c] < 0) {
            st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s has no token for the byte 0x%02X (symbol U+%04X)",
                           what, c, (unsigned)sym_of_byte[c]);
            goto out;
        }
    }
out:
    fsdp__free(ctx, len);
    fsdp__free(ctx, tmp);
    fsdp__free(ctx, at);
    return st;
}

static enum fsdp_status merges_alloc(struct fsdp_bpe *b, size_t n) {
    if (n > (size_t)INT32_MAX / 4)
        return fsdp__err(b->ctx, FSDP_ERR_FORMAT, "BPE: %zu merges are too many", n);
    b->merge_cap = 16;
    while (b->merge_cap < 2 * n + 2) b->merge_cap <<= 1;
    b->merges = fsdp__alloc(b->ctx, b->merge_cap * sizeof *b->merges, FSDP_MEM_OTHER, "BPE merges");
    if (!b->merges) return FSDP_ERR_NOMEM;
    for (uint32_t i = 0; i < b->merge_cap; i++) b->merges[i].rank = -1;
    return FSDP_OK;
}

/* Adds the merge of symbol strings l and r (rank = order of appearance; a
 * repeated pair takes the later rank, as GPT-2's dict does). `where` names
 * the line for messages. */
static enum fsdp_status add_merge(struct fsdp_bpe *b, const struct vocab_build *vb, const char *where,
                                  const uint8_t *l, size_t ln, const uint8_t *r, size_t rn) {
    char why[160], buf[200];
    uint8_t stack[512];
    uint8_t *tmp = ln + rn <= sizeof stack ? stack : fsdp__alloc(b->ctx, ln + rn, FSDP_MEM_OTHER, "BPE merge");
    if (!tmp) return FSDP_ERR_NOMEM;
    enum fsdp_status st = FSDP_OK;
    size_t a, c;
    const uint8_t *sides[2] = {l, r};
    size_t lens[2] = {ln, rn};
    int32_t ids[2];
    for (int k = 0; k < 2; k++) {
        if (sym_decode(sides[k], lens[k], tmp, &a, why, sizeof why)) {
            st = fsdp__err(b->ctx, FSDP_ERR_FORMAT, "%s: the symbol \"%s\" %s", where,
                           fsdp__shown(sides[k], lens[k], buf, sizeof buf), why);
            goto out;
        }
        ids[k] = vocab_lookup(b, vb, tmp, a);
        if (ids[k] < 0) {
            st = fsdp__err(b->ctx, FSDP_ERR_FORMAT, "%s: the symbol \"%s\" is not in the vocabulary",
                           where, fsdp__shown(sides[k], lens[k], buf, sizeof buf));
            goto out;
        }
    }
    sym_decode(l, ln, tmp, &a, why, sizeof why);
    sym_decode(r, rn, tmp + a, &c, why, sizeof why);
    int32_t id = vocab_lookup(b, vb, tmp, a + c);
    if (id < 0) {
        char b2[200];
        st = fsdp__err(b->ctx, FSDP_ERR_FORMAT, "%s: the merge \"%s\" + \"%s\" is not in the vocabulary",
                       where, fsdp__shown(l, ln, buf, sizeof buf), fsdp__shown(r, rn, b2, sizeof b2));
        goto out;
    }
    uint64_t key = (uint64_t)(uint32_t)ids[0] << 32 | (uint32_t)ids[1];
    uint32_t mask = b->merge_cap - 1, i = (uint32_t)mix64(key) & mask;
    while (b->merges[i].rank >= 0 && b->merges[i].key != key) i = (i + 1) & mask;
    b->merges[i].key = key;
    b->merges[i].rank = b->n_merges++;
    b->merges[i].id = id;
out:
    if (tmp != stack) fsdp__free(b->ctx, tmp);
    return st;
}

/* vocab.bpe: "#version: ..." first (optional), then one merge a line: two
 * symbol strings separated by one space; blank lines are skipped. */
static enum fsdp_status read_merges_txt(struct fsdp_bpe *b, const struct vocab_build *vb, const char *name,
                                        const uint8_t *s, size_t n) {
    size_t lines = 0;
    for (size_t i = 0; i < n; i++) lines += s[i] == '\n';
    FSDP_TRY(merges_alloc(b, lines + 1));
    char where[600], buf[200];
    size_t lineno = 0;
    for (size_t p = 0; p < n;) {
        const uint8_t *nl = memchr(s + p, '\n', n - p);
        size_t e = nl ? (size_t)(nl - s) : n, next = nl ? e + 1 : n;
        lineno++;
        if (e > p && s[e - 1] == '\r') e--;
        if (lineno == 1 && e - p >= 8 && !memcmp(s + p, "#version", 8)) { p = next; continue; }
        if (e == p) { p = next; continue; }
        const uint8_t *sp = memchr(s + p, ' ', e - p);
        snprintf(where, sizeof where, "'%s' line %zu", name, lineno);
        if (!sp || sp == s + p || sp + 1 == s + e || memchr(sp + 1, ' ', (size_t)(s + e - sp - 1)))
            return fsdp__err(b->ctx, FSDP_ERR_FORMAT,
                             "%s: expected two symbols separated by one space, got \"%s\"", where,
                             fsdp__shown(s + p, e - p, buf, sizeof buf));
        FSDP_TRY(add_merge(b, vb, where, s + p, (size_t)(sp - (s + p)), sp + 1, (size_t)(s + e - sp - 1)));
        p = next;
    }
    return FSDP_OK;
}

/* A merges file without a single merge beside a vocabulary of words (an
 * empty vocab.bpe, or one cut after its #version line) left every token of
 * more than one byte unreachable: text was encoded byte by byte. Refused;
 * a vocabulary of the bytes alone (and special tokens, "<|...|>") needs no
 * merges. */
static enum fsdp_status check_reachable(const struct fsdp_bpe *b, const char *merges, const char *vocab) {
    if (b->n_merges > 0) return FSDP_OK;
    int32_t words = 0;
    for (int32_t id = 0; id < b->n_ids; id++) {
        const uint8_t *t = b->tok_bytes + b->tok_off[id];
        uint32_t len = b->tok_off[id + 1] - b->tok_off[id];
        int special = len >= 4 && !memcmp(t, "<|", 2) && !memcmp(t + len - 2, "|>", 2);
        words += b->tok_has[id] && len > 1 && !special;
    }
    if (!words) return FSDP_OK;
    return fsdp__err(b->ctx, FSDP_ERR_FORMAT, "%s holds no merges, so none of the %d tokens of more than one byte in "
                     "%s can be made: an empty or cut merges file?", merges, (int)words, vocab);
}

static enum fsdp_status bpe_new(struct fsdp_ctx *ctx, struct fsdp_bpe **out) {
    syms_init();
    struct fsdp_bpe *b = fsdp__calloc(ctx, sizeof *b, FSDP_MEM_OTHER, "BPE tokenizer");
    if (!b) return FSDP_ERR_NOMEM;
    b->ctx = ctx; /* the cache comes with the first encode */
    *out = b;
    return FSDP_OK;
}

/* the tokenizer's JSON file: one value, nothing after it (fsdp__json_parse) */
static enum fsdp_status parse_json(struct fsdp_ctx *ctx, const char *name, const void *buf, size_t len,
                                   cJSON **out) {
    return fsdp__json_parse(ctx, "tokenizer file", name, buf, len, out);
}

enum fsdp_status fsdp__bpe_from_gpt2(struct fsdp_ctx *ctx, const char *enc_name, const void *enc,
                                     size_t enc_len, const char *bpe_name, const void *merges,
                                     size_t merges_len, struct fsdp_bpe **out) {
    *out = NULL;
    struct fsdp_bpe *b;
    FSDP_TRY(bpe_new(ctx, &b));
    cJSON *js = NULL;
    struct vocab_build vb = {0, NULL};
    char what[560];
    snprintf(what, sizeof what, "'%s'", enc_name);
    enum fsdp_status st = parse_json(ctx, enc_name, enc, enc_len, &js);
    if (st == FSDP_OK) st = read_vocab(b, what, js, &vb);
    cJSON_Delete(js);
    if (st == FSDP_OK) st = read_merges_txt(b, &vb, bpe_name, merges, merges_len);
    char mw[560];
    snprintf(mw, sizeof mw, "'%s'", bpe_name);
    if (st == FSDP_OK) st = check_reachable(b, mw, what);
    fsdp__free(ctx, vb.slot);
    if (st != FSDP_OK) {
        fsdp_bpe_free(b);
        return st;
    }
    *out = b;
    return FSDP_OK;
}

/* Refuses tokenizer.json settings that change what GPT-2's encoding does. */
static enum fsdp_status hf_check(struct fsdp_ctx *ctx, const char *name, const cJSON *root,
                                 const cJSON *model) {
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(model, "type");
    if (t && !(cJSON_IsString(t) && !strcmp(t->valuestring, "BPE")))
        return fsdp__err(ctx, FSDP_ERR_UNSUPPORTED, "'%s': model.type is not \"BPE\"", name);
    static const char *const empty_ok[] = {"dropout", "continuing_subword_prefix", "end_of_word_suffix"};
    for (int i = 0; i < 3; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(model, empty_ok[i]);
        if (v && !cJSON_IsNull(v) && !(cJSON_IsString(v) && !v->valuestring[0]))
            return fsdp__err(ctx, FSDP_ERR_UNSUPPORTED, "'%s': model.%s is set (GPT-2's BPE has none)",
                             name, empty_ok[i]);
    }
    static const char *const false_ok[] = {"byte_fallback", "ignore_merges"};
    for (int i = 0; i < 2; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(model, false_ok[i]);
        if (v && !cJSON_IsFalse(v) && !cJSON_IsNull(v))
            return fsdp__err(ctx, FSDP_ERR_UNSUPPORTED, "'%s': model.%s is not false (GPT-2's BPE)",
                             name, false_ok[i]);
    }
    const cJSON *nm = cJSON_GetObjectItemCaseSensitive(root, "normalizer");
    if (nm && !cJSON_IsNull(nm))
        return fsdp__err(ctx, FSDP_ERR_UNSUPPORTED, "'%s': a normalizer is set (GPT-2's BPE has none)", name);
    const cJSON *pt = cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer");
    if (pt && !cJSON_IsNull(pt)) {
        const cJSON *ty = cJSON_GetObjectItemCaseSensitive(pt, "type");
        const cJSON *aps = cJSON_GetObjectItemCaseSensitive(pt, "add_prefix_space");
        const cJSON *ure = cJSON_GetObjectItemCaseSensitive(pt, "use_regex");
        if (!cJSON_IsString(ty) || strcmp(ty->valuestring, "ByteLevel") || (aps && !cJSON_IsFalse(aps)) ||
            (ure && !cJSON_IsTrue(ure)))
            return fsdp__err(ctx, FSDP_ERR_UNSUPPORTED,
                             "'%s': pre_tokenizer is not GPT-2's (ByteLevel, add_prefix_space false, "
                             "use_regex true)", name);
    }
    return FSDP_OK;
}

enum fsdp_status fsdp__bpe_from_hf(struct fsdp_ctx *ctx, const char *name, const void *buf, size_t len,
                                   struct fsdp_bpe **out) {
    *out = NULL;
    struct fsdp_bpe *b;
    FSDP_TRY(bpe_new(ctx, &b));
    cJSON *js = NULL;
    struct vocab_build vb = {0, NULL};
    char what[600], buf2[200];
    enum fsdp_status st = parse_json(ctx, name, buf, len, &js);
    const cJSON *model = js ? cJSON_GetObjectItemCaseSensitive(js, "model") : NULL;
    if (st == FSDP_OK && !cJSON_IsObject(model))
        st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': no \"model\" object", name);
    if (st == FSDP_OK) st = hf_check(ctx, name, js, model);
    if (st == FSDP_OK) {
        snprintf(what, sizeof what, "'%s': model.vocab", name);
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(model, "vocab");
        st = v ? read_vocab(b, what, v, &vb) : fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': no model.vocab", name);
    }
    const cJSON *m = model ? cJSON_GetObjectItemCaseSensitive(model, "merges") : NULL;
    if (st == FSDP_OK && !cJSON_IsArray(m))
        st = fsdp__err(ctx, FSDP_ERR_FORMAT, "'%s': model.merges is not an array", name);
    if (st == FSDP_OK) st = merges_alloc(b, (size_t)cJSON_GetArraySize(m));
    size_t i = 0;
    for (const cJSON *e = m ? m->child : NULL; st == FSDP_OK && e; e = e->next, i++) {
        snprintf(what, sizeof what, "'%s': model.merges[%zu]", name, i);
        const char *l = NULL, *r = NULL;
        size_t ln = 0, rn = 0;
        if (cJSON_IsString(e)) { /* "a b" */
            const char *s = e->valuestring, *sp = strchr(s, ' ');
            if (sp && sp != s && sp[1] && !strchr(sp + 1, ' ')) {
                l = s;
                ln = (size_t)(sp - s);
                r = sp + 1;
                rn = strlen(r);
            } else {
                st = fsdp__err(ctx, FSDP_ERR_FORMAT,
                               "%s: expected two symbols separated by one space, got \"%s\"", what,
                               fsdp__shown(s, strlen(s), buf2, sizeof buf2));
                break;
            }
        } else if (cJSON_IsArray(e) && cJSON_GetArraySize(e) == 2 && cJSON_IsString(e->child) &&
                   cJSON_IsString(e->child->next) && e->child->valuestring[0] &&
                   e->child->next->valuestring[0]) { /* ["a", "b"] */
            l = e->child->valuestring;
            ln = strlen(l);
            r = e->child->next->valuestring;
            rn = strlen(r);
        } else {
            st = fsdp__err(ctx, FSDP_ERR_FORMAT, "%s: expected \"a b\" or [\"a\", \"b\"]", what);
            break;
        }
        st = add_merge(b, &vb, what, (const uint8_t *)l, ln, (const uint8_t *)r, rn);
    }
    snprintf(what, sizeof what, "'%s': model.merges", name);
    snprintf(buf2, sizeof buf2, "its model.vocab");
    if (st == FSDP_OK) st = check_reachable(b, what, buf2);
    cJSON_Delete(js);
    fsdp__free(ctx, vb.slot);
    if (st != FSDP_OK) {
        fsdp_bpe_free(b);
        return st;
    }
    *out = b;
    return FSDP_OK;
}

/* Reads a whole file into memory from fsdp__alloc. A FIFO or a device is
 * refused at once, not waited on ([Note: regular files only], core/file.c). */
static enum fsdp_status slurp(struct fsdp_ctx *ctx, const char *path, uint8_t **buf, size_t *len) {
    *buf = NULL;
    int fd;
    uint64_t size;
    FSDP_TRY(fsdp__open_regular(ctx, NULL, path, &fd, &size));
    size_t n = (size_t)size, got = 0;
    uint8_t *p = fsdp__alloc(ctx, n + 1, FSDP_MEM_OTHER, path);
    if (!p) {
        close(fd);
        return FSDP_ERR_NOMEM;
    }
    while (got < n) {
        ssize_t r = read(fd, p + got, n - got);
        if (r <= 0) {
            int e = errno;
            close(fd);
            fsdp__free(ctx, p);
            return fsdp__err(ctx, FSDP_ERR_IO, "cannot read '%s': %s", path, r ? strerror(e) : "file shrank");
        }
        got += (size_t)r;
    }
    close(fd);
    *buf = p;
    *len = n;
    return FSDP_OK;
}

enum fsdp_status fsdp_bpe_open(struct fsdp_ctx *ctx, const char *dir, struct fsdp_bpe **out) {
    if (!out) return fsdp__err(ctx, FSDP_ERR_INVALID, "BPE open: out is NULL");
    *out = NULL;
    if (!dir) return fsdp__err(ctx, FSDP_ERR_INVALID, "BPE open: dir is NULL");
    struct stat sb;
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return fsdp__err(ctx, FSDP_ERR_IO, "tokenizer '%s' is not a directory", dir);
    size_t dl = strlen(dir) + 32;
    char *hf = fsdp__alloc(ctx, 3 * dl, FSDP_MEM_OTHER, "tokenizer paths");
    if (!hf) return FSDP_ERR_NOMEM;
    char *enc = hf + dl, *mer = enc + dl;
    snprintf(hf, dl, "%s/tokenizer.json", dir);
    snprintf(enc, dl, "%s/encoder.json", dir);
    snprintf(mer, dl, "%s/vocab.bpe", dir);
    uint8_t *a = NULL, *c = NULL;
    size_t al = 0, cl = 0;
    enum fsdp_status st;
    if (access(enc, F_OK) == 0 || access(mer, F_OK) == 0 || access(hf, F_OK) != 0) {
        if (access(enc, F_OK) != 0 || access(mer, F_OK) != 0)
            st = fsdp__err(ctx, FSDP_ERR_IO,
                           "tokenizer '%s': '%s' is missing (a tokenizer directory holds encoder.json "
                           "and vocab.bpe, or tokenizer.json)", dir, access(enc, F_OK) != 0 ? enc : mer);
        else if ((st = slurp(ctx, enc, &a, &al)) == FSDP_OK && (st = slurp(ctx, mer, &c, &cl)) == FSDP_OK)
            st = fsdp__bpe_from_gpt2(ctx, enc, a, al, mer, c, cl, out);
    } else if ((st = slurp(ctx, hf, &a, &al)) == FSDP_OK) {
        st = fsdp__bpe_from_hf(ctx, hf, a, al, out);
    }
    fsdp__free(ctx, a);
    fsdp__free(ctx, c);
    fsdp__free(ctx, hf);
    return st;
}

/* ---- A token source from text ---- */

enum fsdp_status fsdp_data_open_bpe(struct fsdp_ctx *ctx, const char *path, struct fsdp_bpe *b,
                                    int vocab_size, struct fsdp_data **out) {
    if (!out) return fsdp__err(ctx, FSDP_ERR_INVALID, "data open: out is NULL");
    *out = NULL;
    if (!path || !b) return fsdp__err(ctx, FSDP_ERR_INVALID, "data open: path or tokenizer is NULL");
    if (b->n_ids > 65536)
        return fsdp__err(ctx, FSDP_ERR_UNSUPPORTED,
                         "'%s': the tokenizer's %d ids do not fit 16-bit tokens", path, (int)b->n_ids);
    uint8_t *text;
    size_t n;
    FSDP_TRY(slurp(ctx, path, &text, &n));
    /* the ids (a token covers at least one byte), then an llm.c token file
     * image over the same block: 256 int32 header words, then uint16 tokens */
    int32_t *ids = fsdp__alloc(ctx, 1024 + 4 * n, FSDP_MEM_OTHER, "tokenized text");
    uint8_t *img = (uint8_t *)ids;
    size_t ntok = 0;
    enum fsdp_status st = ids ? fsdp_bpe_encode(b, text, n, ids + 256, &ntok) : FSDP_ERR_NOMEM;
    if (st == FSDP_OK)
        for (size_t i = 0; i < ntok; i++) { /* in place: each write lands at or before its read */
            int32_t v;
            memcpy(&v, img + 1024 + 4 * i, 4);
            uint16_t t = (uint16_t)v;
            memcpy(img + 1024 + 2 * i, &t, 2);
        }
    if (st == FSDP_OK && ntok > INT32_MAX)
        st = fsdp__err(ctx, FSDP_ERR_UNSUPPORTED, "'%s': %zu tokens exceed an llm.c file's count", path, ntok);
    if (st == FSDP_OK) {
        int32_t h[3] = {20240520, 1, (int32_t)ntok};
        memset(img, 0, 1024);
        memcpy(img, h, sizeof h);
        st = fsdp__data_open_mem(ctx, path, img, 1024 + 2 * ntok, vocab_size, out);
    }
    fsdp__free(ctx, ids);
    fsdp__free(ctx, text);
    return st;
}
