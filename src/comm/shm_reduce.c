/*
 * shm_reduce.c - the element work of the shared-memory backend (shm.c): the
 * copies out of the slots into the user's buffers, streaming past the caches
 * for large collectives, and the reductions, each element one IEEE operation
 * in the order [Note: reduction order] (shm.c) fixes, whatever the CPU's
 * vector level ([Note: vector paths at run time], src/core/cpu.c).
 */
#include "comm/shm-impl.h"

#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

/* memcpy with streaming (non-temporal) stores on CPUs with AVX-512 or AVX2
 * (the level fsdp__cpu_isa() runs, [Note: vector paths at run time]), for
 * destinations much larger than L2 (a gathered all-gather buffer): the
 * stores skip reading dst's lines first and do not evict the caches; about
 * twice glibc's memcpy rate at 32 MiB on the AVX-512 machines here, 1.7x for
 * two threads at once on an AVX2 one (bench/README.md). Else a memcpy. Each
 * vector path streams whole 64-byte lines from dst's first line boundary
 * and returns the bytes it copied past that boundary. */
#if defined(__x86_64__) || defined(__i386__)
FSDP__TARGET_AVX512 static size_t copy_nt_avx512(unsigned char *d, const unsigned char *p, size_t n) {
    size_t i = 0;
    for (; i + 256 <= n; i += 256) {
        __m512i x0 = _mm512_loadu_si512(p + i), x1 = _mm512_loadu_si512(p + i + 64);
        __m512i x2 = _mm512_loadu_si512(p + i + 128), x3 = _mm512_loadu_si512(p + i + 192);
        _mm512_stream_si512((__m512i *)(void *)(d + i), x0);
        _mm512_stream_si512((__m512i *)(void *)(d + i + 64), x1);
        _mm512_stream_si512((__m512i *)(void *)(d + i + 128), x2);
        _mm512_stream_si512((__m512i *)(void *)(d + i + 192), x3);
    }
    for (; i + 64 <= n; i += 64) _mm512_stream_si512((__m512i *)(void *)(d + i), _mm512_loadu_si512(p + i));
    return i;
}

FSDP__TARGET_AVX2 static size_t copy_nt_avx2(unsigned char *d, const unsigned char *p, size_t n) {
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        __m256i x0 = _mm256_loadu_si256((const __m256i *)(const void *)(p + i));
        __m256i x1 = _mm256_loadu_si256((const __m256i *)(const void *)(p + i + 32));
        __m256i x2 = _mm256_loadu_si256((const __m256i *)(const void *)(p + i + 64));
        __m256i x3 = _mm256_loadu_si256((const __m256i *)(const void *)(p + i + 96));
        _mm256_stream_si256((__m256i *)(void *)(d + i), x0);
        _mm256_stream_si256((__m256i *)(void *)(d + i + 32), x1);
        _mm256_stream_si256((__m256i *)(void *)(d + i + 64), x2);
        _mm256_stream_si256((__m256i *)(void *)(d + i + 96), x3);
    }
    return i;
}
#endif

static void copy_nt(void *dst, const void *src, size_t n) {
#if defined(__x86_64__) || defined(__i386__)
    enum fsdp__isa isa = fsdp__cpu_isa();
    if (isa >= FSDP__ISA_AVX2) {
        unsigned char *d = dst;
        const unsigned char *p = src;
        size_t head = (64 - ((uintptr_t)d & 63)) & 63;
        if (head > n) head = n;
        memcpy(d, p, head);
        d += head, p += head, n -= head;
        size_t done = isa >= FSDP__ISA_AVX512 ? copy_nt_avx512(d, p, n) : copy_nt_avx2(d, p, n);
        memcpy(d + done, p + done, n - done);
        _mm_sfence(); /* before the progress thread tells anyone the data is there */
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* A copy into the user's buffer of a collective moving `total` bytes per
 * rank: streaming from SHM_NT_MIN up. */
void fsdp__shm_copy_out(void *dst, const void *src, size_t n, size_t total) {
    if (total >= SHM_NT_MIN) copy_nt(dst, src, n);
    else memcpy(dst, src, n);
}

/* fsdp__shm_add_f32's vector paths: elements [0, return) of dst, from an
 * i0 at which dst is aligned to the vector when nt */
#define ADD1(i) (sc ? (a[i] + b[i]) * scale : a[i] + b[i])
#if defined(__x86_64__) || defined(__i386__)
FSDP__TARGET_AVX512 static size_t add_f32_avx512(float *dst, const float *a, const float *b, size_t n, int nt,
                                                  float scale) {
    size_t i = 0;
    const int sc = scale != 1.0f;
    const __m512 vs = _mm512_set1_ps(scale);
#define ADDV(i) (sc ? _mm512_mul_ps(_mm512_add_ps(_mm512_loadu_ps(a + (i)), _mm512_loadu_ps(b + (i))), vs) \
                    : _mm512_add_ps(_mm512_loadu_ps(a + (i)), _mm512_loadu_ps(b + (i))))
    if (nt) {
        for (; i < n && ((uintptr_t)(dst + i) & 63); i++) dst[i] = ADD1(i);
        for (; i + 16 <= n; i += 16) _mm512_stream_ps(dst + i, ADDV(i));
        _mm_sfence(); /* before the progress thread tells anyone the data is there */
    } else {
        for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, ADDV(i));
    }
#undef ADDV
    return i;
}

FSDP__TARGET_AVX2 static size_t add_f32_avx2(float *dst, const float *a, const float *b, size_t n, int nt,
                                              float scale) {
    size_t i = 0;
    const int sc = scale != 1.0f;
    const __m256 vs = _mm256_set1_ps(scale);
#define ADDV(i) (sc ? _mm256_mul_ps(_mm256_add_ps(_mm256_loadu_ps(a + (i)), _mm256_loadu_ps(b + (i))), vs) \
                    : _mm256_add_ps(_mm256_loadu_ps(a + (i)), _mm256_loadu_ps(b + (i))))
    if (nt) {
        for (; i < n && ((uintptr_t)(dst + i) & 31); i++) dst[i] = ADD1(i);
        for (; i + 8 <= n; i += 8) _mm256_stream_ps(dst + i, ADDV(i));
        _mm_sfence(); /* before the progress thread tells anyone the data is there */
    } else {
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, ADDV(i));
    }
#undef ADDV
    return i;
}
#endif

/* dst = a + b, n floats, each sum one IEEE single addition as in the scalar
 * loop (bit-identical; a may be dst), times `scale` unless it is 1 (one
 * more rounding, as a pass x *= scale after it: [Note: averaging
 * reductions]). nt: stream the stores past the caches (a final result not
 * read again soon; saves reading dst's lines first), on the vector paths. */
void fsdp__shm_add_f32(float *dst, const float *a, const float *b, size_t n, int nt, float scale) {
    size_t i = 0;
    const int sc = scale != 1.0f;
#if defined(__x86_64__) || defined(__i386__)
    enum fsdp__isa isa = fsdp__cpu_isa();
    i = isa >= FSDP__ISA_AVX512 ? add_f32_avx512(dst, a, b, n, nt, scale)
        : isa >= FSDP__ISA_AVX2 ? add_f32_avx2(dst, a, b, n, nt, scale)
                                : 0;
#else
    (void)nt;
#endif
    for (; i < n; i++) dst[i] = ADD1(i);
}
#undef ADD1

/* dst = src (first contribution) or dst op= src, n elements of dt (not BF16/F16). */
void fsdp__shm_reduce_into(void *dst, const void *src, size_t n, enum fsdp_dtype dt, enum fsdp_red_op op,
                           int first) {
    if (first) { memcpy(dst, src, n * fsdp_dtype_size(dt)); return; }
    if (dt == FSDP_F32 && op == FSDP_SUM) { fsdp__shm_add_f32(dst, dst, src, n, 0, 1.0f); return; }
#define RED_LOOP(T, ADD)                                                     \
    do {                                                                     \
        T *d_ = dst;                                                         \
        const T *s_ = src;                                                   \
        if (op == FSDP_SUM) for (size_t i = 0; i < n; i++) d_[i] = ADD;      \
        else if (op == FSDP_MAX)                                             \
            for (size_t i = 0; i < n; i++) d_[i] = s_[i] > d_[i] ? s_[i] : d_[i]; \
        else for (size_t i = 0; i < n; i++) d_[i] = s_[i] < d_[i] ? s_[i] : d_[i]; \
    } while (0)
    switch (dt) {
    case FSDP_F32: RED_LOOP(float, d_[i] + s_[i]); break;
    case FSDP_I32: RED_LOOP(int32_t, (int32_t)((uint32_t)d_[i] + (uint32_t)s_[i])); break;
    case FSDP_U16: RED_LOOP(uint16_t, (uint16_t)(d_[i] + s_[i])); break;
    case FSDP_U8: RED_LOOP(uint8_t, (uint8_t)(d_[i] + s_[i])); break;
    case FSDP_I64: RED_LOOP(int64_t, (int64_t)((uint64_t)d_[i] + (uint64_t)s_[i])); break;
    case FSDP_BF16: case FSDP_F16: FSDP_ASSERT(0, "16-bit floats reduce through fp32"); break;
    }
#undef RED_LOOP
}

/* fp32 accumulation of a BF16/F16 contribution (acc = x or acc op= x). */
void fsdp__shm_reduce_low(float *acc, const void *src, size_t n, enum fsdp_dtype dt, enum fsdp_red_op op,
                          int first, float *tmp) {
    if (first) { fsdp__low_to_f32(src, acc, n, dt); return; }
    fsdp__low_to_f32(src, tmp, n, dt);
    fsdp__shm_reduce_into(acc, tmp, n, FSDP_F32, op, 0);
}
