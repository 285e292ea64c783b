/*
 * rng.c - the counter-based RNG (Philox4x32-10) and parameter init values.
 * A value is a pure function of (key, counter): a rank can produce element i
 * of any stream without producing elements 0..i-1, so each rank initialises
 * only its shard and the model is bit-identical at every world size.
 * Key of a parameter: seed mixed with the FNV-1a hash of its FQN.
 */
#include "core/core-impl.h"

#include <math.h>

void fsdp__philox(uint64_t key, uint64_t counter, uint32_t out[4]) {
    uint32_t c0 = (uint32_t)counter, c1 = (uint32_t)(counter >> 32), c2 = 0, c3 = 0;
    uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    for (int r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c0;
        uint64_t p1 = (uint64_t)0xCD9E8D57u * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c1 = (uint32_t)p1;
        c3 = (uint32_t)p0;
        c0 = n0;
        c2 = n2;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}

uint64_t fsdp__hash_str(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 1099511628211ull;
    }
    return h;
}

float fsdp__normal_at(uint64_t key, uint64_t idx) {
    uint32_t r[4];
    fsdp__philox(key, idx, r);
    /* two 53-bit uniforms in (0, 1] from the four words */
    double u1 = ((double)(((uint64_t)r[0] << 21) ^ r[1]) + 1.0) / 9007199254740993.0;
    double u2 = (double)(((uint64_t)r[2] << 21) ^ r[3]) / 9007199254740992.0;
    u1 = fmin(u1, 1.0);
    return (float)(sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * fmod(u2, 1.0)));
}

double fsdp__uniform_at(uint64_t key, uint64_t idx) {
    uint32_t r[4];
    fsdp__philox(key, idx, r);
    return (double)(((uint64_t)r[0] << 21) ^ r[1]) / 9007199254740992.0;
}

static uint64_t param_key(uint64_t seed, const char *fqn) {
    return fsdp__hash_str(fqn) ^ (seed * 0x9E3779B97F4A7C15ull);
}

float fsdp__init_value(struct fsdp_init init, uint64_t seed, const char *fqn, uint64_t idx) {
    switch (init.kind) {
    case FSDP_INIT_ZEROS: return 0.0f;
    case FSDP_INIT_ONES: return 1.0f;
    case FSDP_INIT_NORMAL: return init.std * fsdp__normal_at(param_key(seed, fqn), idx);
    }
    return 0.0f;
}

void fsdp__init_fill(struct fsdp_init init, uint64_t seed, const char *fqn, uint64_t start,
                     float *dst, size_t n) {
    if (init.kind != FSDP_INIT_NORMAL) {
        float v = init.kind == FSDP_INIT_ONES ? 1.0f : 0.0f;
        for (size_t i = 0; i < n; i++) dst[i] = v;
        return;
    }
    uint64_t key = param_key(seed, fqn);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) dst[i] = init.std * fsdp__normal_at(key, start + i);
}
