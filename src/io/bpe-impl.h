/*
 * bpe-impl.h - the BPE tokenizer's own internals, shared by its two files:
 * bpe.c (pre-tokenizer, merges, encode, decode) and bpe_load.c (reading the
 * vocabulary and merges, byte symbols, the token source made from a text
 * file). The rest of src/io sees only io-impl.h's prototypes.
 */
#ifndef FSDP_IO_BPE_IMPL_H
#define FSDP_IO_BPE_IMPL_H

#include "io/io-impl.h"

#include <string.h>

#define BPE_MAX_ID ((1 << 22) - 1) /* ids above are refused (a vocabulary this big is a bad file) */
#define BPE_SHORT 48               /* pieces up to this many bytes: array merges, cached */
#define CACHE_SLOTS (1u << 16)     /* the cache is cleared when half full */
#define CACHE_BYTES (CACHE_SLOTS * 12u)

enum { C_OTHER = 0, C_LETTER = 1, C_NUMBER = 2, C_SPACE = 3 };

struct merge_slot {   /* open addressing on (a, b); rank < 0: empty */
    uint64_t key;     /* a << 32 | b */
    int32_t rank, id; /* the merge's line (0-based) and the id of a+b */
};

struct cache_slot {
    uint64_t hash;    /* 0: empty */
    uint32_t off;     /* key bytes at pool[off], then n ids (int32, aligned) */
    uint16_t len, n;
};

struct fsdp_bpe {
    struct fsdp_ctx *ctx; /* borrowed */
    int32_t n_ids;        /* largest id + 1 */
    uint32_t *tok_off;    /* (n_ids + 1) token id's bytes are tok_bytes[tok_off[id]..tok_off[id+1]) */
    uint8_t *tok_has;     /* (n_ids) 1 where the id is in the vocabulary */
    uint8_t *tok_bytes;
    int32_t byte_id[256]; /* the token of each single byte */
    struct merge_slot *merges; /* (merge_cap) */
    uint32_t merge_cap;
    int32_t n_merges;
    struct cache_slot *cache;  /* (CACHE_SLOTS) */
    uint8_t *pool;             /* (CACHE_BYTES) */
    uint32_t pool_used, cache_used;
};

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

/* A hash of the bytes s[0..n), never 0 (0 marks an empty cache slot). */
static inline uint64_t hash_bytes(const uint8_t *s, size_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ n;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v;
        memcpy(&v, s + i, 8);
        h = mix64(h ^ v);
    }
    uint64_t v = 0;
    memcpy(&v, s + i, n - i);
    h = mix64(h ^ v ^ ((uint64_t)(n - i) << 59));
    return h | 1;
}

/* Decodes the character at s[0..n) (n >= 1): sets *cp and returns its length;
 * a byte that does not start a valid, shortest-form sequence of a scalar
 * value is a character of its own with *cp = -1. (bpe.c) */
int fsdp__utf8_next(const uint8_t *s, size_t n, int32_t *cp);

#endif
