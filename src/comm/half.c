/*
 * half.c - bit-exact conversions between fp32 and the 16-bit float types
 * (bf16, fp16) for the backends' low-precision reductions, which sum in fp32
 * and round once (see [Note: low-precision reductions] in mpi.c).
 */
#include "comm/comm-impl.h"

#include <math.h>
#include <string.h>

/* ---- Conversions (bit-exact, no dependence on compiler half types) ---- */

static uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

static uint16_t f32_to_bf16(float f) {
    uint32_t x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u); /* quiet NaN */
    x += 0x7fffu + ((x >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(x >> 16);
}

/* IEEE half <-> single (after M. Dukhan's FP16 library: exact, handles
 * subnormals, infinities and NaN, round to nearest even). */
static float f16_to_f32(uint16_t h) {
    uint32_t w = (uint32_t)h << 16;
    uint32_t sign = w & 0x80000000u;
    uint32_t two_w = w + w;
    float normalized = bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    float denormalized = bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
    uint32_t r = sign | (two_w < (1u << 27) ? f32_bits(denormalized) : f32_bits(normalized));
    return bits_f32(r);
}

static uint16_t f32_to_f16(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    uint32_t w = f32_bits(f);
    uint32_t shl1_w = w + w;
    uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = bits_f32((bias >> 1) + 0x07800000u) + base;
    uint32_t bits = f32_bits(base);
    uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

void fsdp__low_to_f32(const void *src, float *dst, size_t n, enum fsdp_dtype dt) {
    const uint16_t *s = src;
    if (dt == FSDP_BF16) for (size_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    else for (size_t i = 0; i < n; i++) dst[i] = f16_to_f32(s[i]);
}

void fsdp__f32_to_low(const float *src, void *dst, size_t n, enum fsdp_dtype dt) {
    uint16_t *d = dst;
    if (dt == FSDP_BF16) for (size_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    else for (size_t i = 0; i < n; i++) d[i] = f32_to_f16(src[i]);
}

int fsdp__dtype_is_low(enum fsdp_dtype dt) { return dt == FSDP_BF16 || dt == FSDP_F16; }
