/*
 * dtype.c - conversion between fp32 and the 16-bit float formats bf16 and
 * fp16 (IEEE binary16), element by element and over arrays.
 * Invariants (tests/test_dtype.c checks all 65536 patterns of each format):
 *  - fp32 -> bf16/fp16 rounds to nearest, ties to even; fp32 subnormals are
 *    kept (never flushed), overflow gives inf of the right sign, and a NaN
 *    stays a NaN of the same sign with the quiet bit set and its top payload
 *    bits kept (as the x86 conversion instructions do).
 *  - bf16/fp16 -> fp32 is exact (every value, subnormals included, is
 *    representable in fp32); NaN payloads are kept.
 *  - the array forms give exactly the bits of the scalar forms, on the
 *    vector path of the level the CPU runs ([Note: vector paths at run
 *    time], cpu.c). With AVX-512 they run 16 lanes at a time (bf16 with
 *    integer arithmetic, because vcvtneps2bf16 flushes subnormals, or with
 *    AVX512-BF16 32 lanes by vcvtne2ps2bf16 where none is subnormal: [Note:
 *    bf16 rounding instruction]; fp16 with vcvtps2ph/vcvtph2ps, which round
 *    correctly), with AVX2 and F16C 8 or 16 the same way; the scalar forms
 *    finish the tail and are the whole of the scalar level. Long arrays are
 *    split across OpenMP threads (outside a parallel region; inside one they
 *    run on the calling thread).
 */
#include "core/core-impl.h"

#include <omp.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#define FSDP_X86 1
#include <immintrin.h>
#endif

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* ---- Scalar forms (the reference) ---- */

uint16_t fsdp__f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u); /* NaN: quiet */
    u += 0x7fffu + ((u >> 16) & 1u); /* ties to even; a carry moves into the exponent (inf on overflow) */
    return (uint16_t)(u >> 16);
}

uint16_t fsdp__f32_to_f16(float f) {
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x03ffu)); /* NaN: quiet */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 (incl. inf) rounds to inf */
    if (a >= 0x38800000u) {                                   /* normal fp16: >= 2^-14 */
        uint32_t r = a - (112u << 23);                        /* rebias the exponent 127 -> 15 */
        r += 0x0fffu + ((r >> 13) & 1u);                      /* ties to even; carry is fine */
        return (uint16_t)(sign | (r >> 13));
    }
    if (a <= 0x33000000u) return sign; /* <= 2^-25: rounds to zero (2^-25 is a tie, even is 0) */
    /* subnormal fp16: value = m 2^(e-150), in units of 2^-24 that is m >> (126 - e) */
    uint32_t e = a >> 23, m = (a & 0x007fffffu) | 0x00800000u;
    uint32_t shift = 126u - e; /* 14..24 */
    uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) q++; /* q may reach 0x400: the smallest normal */
    return (uint16_t)(sign | q);
}

float fsdp__f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x03ffu;
    if (e == 0x1fu) return bits_f32(sign | 0x7f800000u | (m << 13)); /* inf, NaN (payload kept) */
    if (e) return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
    if (!m) return bits_f32(sign);
    e = 113; /* subnormal m 2^-24: normalise */
    while (!(m & 0x0400u)) {
        m <<= 1;
        e--;
    }
    return bits_f32(sign | (e << 23) | ((m & 0x03ffu) << 13));
}

/* ---- Array forms ---- */

/* Block size of the OpenMP split; arrays shorter than two blocks stay serial. */
#define CVT_BLOCK 16384

/* Each vector path below handles a prefix of the array and returns its
 * length; the scalar forms finish it. Which path runs is fsdp__cpu_isa()'s
 * ([Note: vector paths at run time], cpu.c): every x86-64 build has them all. */
#ifdef FSDP_X86
/* src[0, 16) to bf16 in dst[0, 16), with integer arithmetic (subnormals kept) */
FSDP__TARGET_AVX512 static inline void f32_to_bf16_16(const float *src, uint16_t *dst) {
    const __m512i one = _mm512_set1_epi32(1), round = _mm512_set1_epi32(0x7fff);
    const __m512i absmask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    const __m512i quiet = _mm512_set1_epi32(0x00400000);
    __m512i u = _mm512_loadu_si512((const void *)src);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(round, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, absmask), inf);
    r = _mm512_mask_or_epi32(r, nan, u, quiet); /* NaN lanes: u | quiet bit, truncated */
    _mm256_storeu_si256((__m256i *)(void *)dst, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}

FSDP__TARGET_AVX512 static size_t f32_to_bf16_avx512(const float *src, uint16_t *dst, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) f32_to_bf16_16(src + i, dst + i);
    return i;
}

/* [Note: bf16 rounding instruction] vcvtne2ps2bf16 (AVX512-BF16) rounds 32
 * values in one instruction, to nearest even, overflow to inf, a NaN quieted
 * and truncated: the scalar form's bits, except that it reads a subnormal
 * input as zero. So 32 values with no subnormal among them take the
 * instruction, and any 32 with one take the integer arithmetic. The test
 * for one is on the bits (exponent 0, mantissa not): vfpclassps reads a
 * subnormal as zero under MXCSR's DAZ. The integer path alone cost about
 * twice as long per value, which showed in every 16-bit output written
 * block by block (GELU's, LayerNorm's rows). */
FSDP__TARGET_AVX512BF16 static size_t f32_to_bf16_avx512bf16(const float *src, uint16_t *dst, size_t n) {
    size_t i = 0;
    const __m512i expo = _mm512_set1_epi32(0x7f800000), mant = _mm512_set1_epi32(0x007fffff);
    for (; i + 32 <= n; i += 32) {
        __m512i a = _mm512_loadu_si512((const void *)(src + i)), b = _mm512_loadu_si512((const void *)(src + i + 16));
        __mmask16 sa = _mm512_mask_test_epi32_mask(_mm512_testn_epi32_mask(a, expo), a, mant);
        __mmask16 sb = _mm512_mask_test_epi32_mask(_mm512_testn_epi32_mask(b, expo), b, mant);
        if (sa | sb) { /* a subnormal among them */
            f32_to_bf16_16(src + i, dst + i);
            f32_to_bf16_16(src + i + 16, dst + i + 16);
        } else {
            __m512bh h = _mm512_cvtne2ps_pbh(_mm512_castsi512_ps(b), _mm512_castsi512_ps(a));
            _mm512_storeu_si512((void *)(dst + i), (__m512i)h);
        }
    }
    for (; i + 16 <= n; i += 16) f32_to_bf16_16(src + i, dst + i);
    return i;
}

FSDP__TARGET_AVX2 static size_t f32_to_bf16_avx2(const float *src, uint16_t *dst, size_t n) {
    size_t i = 0;
    const __m256i one = _mm256_set1_epi32(1), round = _mm256_set1_epi32(0x7fff);
    const __m256i absmask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    const __m256i quiet = _mm256_set1_epi32(0x00400000);
    for (; i + 16 <= n; i += 16) {
        __m256i h[2];
        for (int j = 0; j < 2; j++) {
            __m256i u = _mm256_loadu_si256((const __m256i *)(const void *)(src + i + 8 * j));
            __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(round, _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
            /* |u| > inf as signed 32-bit: both sides are non-negative */
            __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, absmask), inf);
            r = _mm256_blendv_epi8(r, _mm256_or_si256(u, quiet), nan);
            h[j] = _mm256_srli_epi32(r, 16); /* 0..0xffff: packus keeps it */
        }
        /* packus interleaves 128-bit lanes (a0-3 b0-3 a4-7 b4-7): put them back in order */
        __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(h[0], h[1]), 0xd8);
        _mm256_storeu_si256((__m256i *)(void *)(dst + i), p);
    }
    return i;
}

FSDP__TARGET_AVX512 static size_t bf16_to_f32_avx512(const uint16_t *src, float *dst, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(const void *)(src + i)));
        _mm512_storeu_si512((void *)(dst + i), _mm512_slli_epi32(h, 16));
    }
    return i;
}

FSDP__TARGET_AVX2 static size_t bf16_to_f32_avx2(const uint16_t *src, float *dst, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(const void *)(src + i)));
        _mm256_storeu_si256((__m256i *)(void *)(dst + i), _mm256_slli_epi32(h, 16));
    }
    return i;
}

FSDP__TARGET_AVX512 static size_t f32_to_f16_avx512(const float *src, uint16_t *dst, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm256_storeu_si256((__m256i *)(void *)(dst + i), h);
    }
    return i;
}

FSDP__TARGET_AVX2 static size_t f32_to_f16_avx2(const float *src, uint16_t *dst, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128((__m128i *)(void *)(dst + i), h);
    }
    return i;
}

FSDP__TARGET_AVX512 static size_t f16_to_f32_avx512(const uint16_t *src, float *dst, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(src + i))));
    return i;
}

FSDP__TARGET_AVX2 static size_t f16_to_f32_avx2(const uint16_t *src, float *dst, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(src + i))));
    return i;
}

/* bf16 rounding in place of the two casts: the bits f32_to_bf16_run keeps,
 * with the low 16 cleared (NaN: quieted, truncated), in one pass */
FSDP__TARGET_AVX512 static size_t bf16_round_avx512(const float *src, float *dst, size_t n) {
    size_t i = 0;
    const __m512i one = _mm512_set1_epi32(1), round = _mm512_set1_epi32(0x7fff);
    const __m512i absmask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    const __m512i quiet = _mm512_set1_epi32(0x00400000), high = _mm512_set1_epi32((int)0xffff0000u);
    for (; i + 16 <= n; i += 16) {
        __m512i u = _mm512_loadu_si512((const void *)(src + i));
        __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(round, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
        __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, absmask), inf);
        r = _mm512_mask_or_epi32(r, nan, u, quiet);
        _mm512_storeu_si512((void *)(dst + i), _mm512_and_si512(r, high));
    }
    return i;
}

FSDP__TARGET_AVX2 static size_t bf16_round_avx2(const float *src, float *dst, size_t n) {
    size_t i = 0;
    const __m256i one = _mm256_set1_epi32(1), round = _mm256_set1_epi32(0x7fff);
    const __m256i absmask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    const __m256i quiet = _mm256_set1_epi32(0x00400000), high = _mm256_set1_epi32((int)0xffff0000u);
    for (; i + 8 <= n; i += 8) {
        __m256i u = _mm256_loadu_si256((const __m256i *)(const void *)(src + i));
        __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(round, _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
        __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, absmask), inf);
        r = _mm256_blendv_epi8(r, _mm256_or_si256(u, quiet), nan);
        _mm256_storeu_si256((__m256i *)(void *)(dst + i), _mm256_and_si256(r, high));
    }
    return i;
}

/* The vector prefix of an array form: the path of the level the CPU runs,
 * isa = fsdp__cpu_isa() (vbf16 at AVX512BF16, v512 at AVX512, v2 at AVX2). */
#define VECTOR_PREFIX(isa, vbf16, v512, v2, src, dst, n)               \
    ((isa) == FSDP__ISA_AVX512BF16 ? (vbf16)((src), (dst), (n))        \
     : (isa) == FSDP__ISA_AVX512   ? (v512)((src), (dst), (n))         \
     : (isa) == FSDP__ISA_AVX2     ? (v2)((src), (dst), (n))           \
                                   : (size_t)0)
#else
#define VECTOR_PREFIX(isa, vbf16, v512, v2, src, dst, n) ((void)(isa), (size_t)0)
#endif

/* An array form: the vector prefix of the CPU's level, then the scalar form
 * (one, of element i) for the rest */
#define ARRAY_FORM(name, S, D, vbf16, v512, v2, one)                    \
    static void name(const S *src, D *dst, size_t n) {                  \
        enum fsdp__isa isa = fsdp__cpu_isa();                           \
        size_t i = VECTOR_PREFIX(isa, vbf16, v512, v2, src, dst, n);    \
        for (; i < n; i++) dst[i] = (one);                              \
    }
ARRAY_FORM(f32_to_bf16_run, float, uint16_t, f32_to_bf16_avx512bf16, f32_to_bf16_avx512, f32_to_bf16_avx2,
           fsdp__f32_to_bf16(src[i]))
ARRAY_FORM(bf16_to_f32_run, uint16_t, float, bf16_to_f32_avx512, bf16_to_f32_avx512, bf16_to_f32_avx2,
           fsdp__bf16_to_f32(src[i]))
ARRAY_FORM(f32_to_f16_run, float, uint16_t, f32_to_f16_avx512, f32_to_f16_avx512, f32_to_f16_avx2,
           fsdp__f32_to_f16(src[i]))
ARRAY_FORM(f16_to_f32_run, uint16_t, float, f16_to_f32_avx512, f16_to_f32_avx512, f16_to_f32_avx2,
           fsdp__f16_to_f32(src[i]))
/* bf16 rounding in fp32: the bits the two casts give, in one pass */
ARRAY_FORM(bf16_round_run, float, float, bf16_round_avx512, bf16_round_avx512, bf16_round_avx2,
           fsdp__bf16_to_f32(fsdp__f32_to_bf16(src[i])))

/* Runs fn over [0, n) in CVT_BLOCK pieces, in parallel when n is large and
 * the caller is not already inside a parallel region. A short array, or a
 * call from a parallel loop (attention's per-head casts) or from a thread
 * limited to one (shm's progress thread), runs straight through: even an if(false) parallel region costs a team setup (a malloc
 * and a futex round) per call, which dominated per-row casts. */
#define CVT_SPLIT(fn, src, dst, n)                                                       \
    do {                                                                                 \
        int64_t nb_ = (int64_t)(((n) + CVT_BLOCK - 1) / CVT_BLOCK);                      \
        if (nb_ <= 1 || omp_in_parallel() || omp_get_max_threads() <= 1) {              \
            fn((src), (dst), (n));                                                       \
            break;                                                                       \
        }                                                                                \
        _Pragma("omp parallel for schedule(static)")                                     \
        for (int64_t b_ = 0; b_ < nb_; b_++) {                                           \
            size_t lo_ = (size_t)b_ * CVT_BLOCK, len_ = (n) - lo_;                       \
            fn((src) + lo_, (dst) + lo_, len_ < CVT_BLOCK ? len_ : CVT_BLOCK);          \
        }                                                                                \
    } while (0)

void fsdp__cvt_f32_to_bf16(const float *src, uint16_t *dst, size_t n) { CVT_SPLIT(f32_to_bf16_run, src, dst, n); }
void fsdp__cvt_bf16_to_f32(const uint16_t *src, float *dst, size_t n) { CVT_SPLIT(bf16_to_f32_run, src, dst, n); }
void fsdp__cvt_f32_to_f16(const float *src, uint16_t *dst, size_t n) { CVT_SPLIT(f32_to_f16_run, src, dst, n); }
void fsdp__cvt_f16_to_f32(const uint16_t *src, float *dst, size_t n) { CVT_SPLIT(f16_to_f32_run, src, dst, n); }

static void zero_run(const float *unused, float *dst, size_t n) {
    (void)unused;
    memset(dst, 0, n * sizeof(float));
}

void fsdp__zero(float *x, int64_t n) {
    if (n > 0 && !fsdp__measuring) CVT_SPLIT(zero_run, (const float *)x, x, (size_t)n); /* src unused */
}

void fsdp__cvt_from_f32(enum fsdp_dtype dt, const float *src, void *dst, size_t n) {
    if (fsdp__measuring) return;
    switch (dt) {
    case FSDP_F32: if (n && (const void *)src != dst) memcpy(dst, src, n * sizeof(float)); return;
    case FSDP_BF16: fsdp__cvt_f32_to_bf16(src, dst, n); return;
    case FSDP_F16: fsdp__cvt_f32_to_f16(src, dst, n); return;
    default: FSDP_ASSERT(0, "no conversion from f32 to %s", fsdp_dtype_name(dt));
    }
}

/* n values rounded to 16 bits by down and widened back by up, through a stack block */
static void round_via(void (*down)(const float *, uint16_t *, size_t), void (*up)(const uint16_t *, float *, size_t),
                      const float *src, float *dst, size_t n) {
    uint16_t h[1024];
    for (size_t i = 0; i < n; i += 1024) {
        size_t len = n - i < 1024 ? n - i : 1024;
        down(src + i, h, len);
        up(h, dst + i, len);
    }
}

static void f16_round_run(const float *src, float *dst, size_t n) { round_via(f32_to_f16_run, f16_to_f32_run, src, dst, n); }

void fsdp__cvt_round(enum fsdp_dtype dt, const float *src, float *dst, size_t n) {
    if (fsdp__measuring) return;
    switch (dt) {
    case FSDP_F32: if (n && src != dst) memcpy(dst, src, n * sizeof(float)); return;
    case FSDP_BF16: CVT_SPLIT(bf16_round_run, src, dst, n); return;
    case FSDP_F16: CVT_SPLIT(f16_round_run, src, dst, n); return;
    default: FSDP_ASSERT(0, "no rounding of f32 to %s", fsdp_dtype_name(dt));
    }
}

void fsdp__cvt_to_f32(enum fsdp_dtype dt, const void *src, float *dst, size_t n) {
    if (fsdp__measuring) return;
    switch (dt) {
    case FSDP_F32: if (n && src != (const void *)dst) memcpy(dst, src, n * sizeof(float)); return;
    case FSDP_BF16: fsdp__cvt_bf16_to_f32(src, dst, n); return;
    case FSDP_F16: fsdp__cvt_f16_to_f32(src, dst, n); return;
    default: FSDP_ASSERT(0, "no conversion from %s to f32", fsdp_dtype_name(dt));
    }
}
