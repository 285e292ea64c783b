/*
 * test_dtype.c - fp32 <-> bf16 / fp16 conversion (src/core/dtype.c):
 *  - every one of the 65536 patterns of each format converts to the fp32
 *    value computed here independently (ldexp), and back to itself (NaNs come
 *    back as NaNs of the same sign, quieted);
 *  - rounding against an independent nearest-value search over the sorted
 *    16-bit values (ties to the even pattern): at every exact midpoint
 *    between neighbours, one fp32 ulp either side of it, the overflow
 *    threshold, subnormals, and a million random fp32 bit patterns;
 *  - the array forms (on the vector path of the level the CPU runs: tests/run.sh
 *    runs this file at each level the CPU has, by FSDP_MAX_CPU_ISA) give the
 *    scalar forms' bits, odd lengths included (the scalar tail), and bf16's with
 *    a subnormal in any lane, under DAZ too;
 *  - the level is the CPU's best, capped by FSDP_MAX_CPU_ISA.
 */
#include "core/core-impl.h"
#include "harness.h"

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

static uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}
static float float_of(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static uint64_t rs = 0x9E3779B97F4A7C15ull;
static uint32_t rnd32(void) {
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return (uint32_t)(rs >> 16);
}

/* ---- independent references ---- */

/* The value of a 16-bit pattern with `mbits` mantissa bits and exponent bias
 * `bias` (bf16: 7, 127; fp16: 10, 15), in double. */
static double ref_value(uint16_t h, int mbits, int bias) {
    int ebits = 15 - mbits;
    int sign = h >> 15, e = (h >> mbits) & ((1 << ebits) - 1), m = h & ((1 << mbits) - 1);
    double v;
    if (e == (1 << ebits) - 1) v = m ? NAN : INFINITY;
    else if (e == 0) v = ldexp((double)m, 1 - bias - mbits);
    else v = ldexp((double)(m + (1 << mbits)), e - bias - mbits);
    return sign ? -v : v;
}

/* Nearest 16-bit pattern to finite x by binary search over the positive
 * finite patterns (monotonic in their bits), ties to the even pattern, and
 * inf beyond the largest finite value plus half an ulp (a tie there goes to
 * inf, which is the even pattern). */
static uint16_t ref_round(float xf, int mbits, int bias) {
    double x = (double)xf, a = fabs(x);
    uint16_t sign = signbit(x) ? 0x8000 : 0;
    uint16_t inf = (uint16_t)(((1 << (15 - mbits)) - 1) << mbits), maxf = (uint16_t)(inf - 1);
    double top = ref_value(maxf, mbits, bias), ulp = top - ref_value((uint16_t)(maxf - 1), mbits, bias);
    if (a >= top + ulp / 2) return (uint16_t)(sign | inf);
    uint16_t lo = 0, hi = maxf; /* value(lo) <= a < value(hi) unless a >= top */
    if (a >= top) return (uint16_t)(sign | maxf);
    while (hi - lo > 1) {
        uint16_t mid = (uint16_t)((lo + hi) / 2);
        if (ref_value(mid, mbits, bias) <= a) lo = mid;
        else hi = mid;
    }
    double dl = a - ref_value(lo, mbits, bias), dh = ref_value(hi, mbits, bias) - a;
    uint16_t r = dl < dh ? lo : dh < dl ? hi : (lo & 1) ? hi : lo;
    return (uint16_t)(sign | r);
}

/* ---- every pattern ---- */

TEST(bf16_all_patterns_exact_and_round_trip) {
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = fsdp__bf16_to_f32((uint16_t)h);
        double want = ref_value((uint16_t)h, 7, 127);
        uint16_t back = fsdp__f32_to_bf16(f);
        if (isnan(want)) {
            if (!isnan(f) || back != (uint16_t)(h | 0x40)) bad++;
        } else if ((double)f != want || !signbit(f) != !signbit(want) || back != h) {
            if (bad++ < 5) TEST_FAILF("bf16 0x%04x: f32 %.9g (want %.9g), back 0x%04x", h, (double)f, want, back);
        }
    }
    CHECK_INT_EQ(bad, 0);
}

TEST(f16_all_patterns_exact_and_round_trip) {
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = fsdp__f16_to_f32((uint16_t)h);
        double want = ref_value((uint16_t)h, 10, 15);
        uint16_t back = fsdp__f32_to_f16(f);
        if (isnan(want)) {
            if (!isnan(f) || back != (uint16_t)(h | 0x200)) {
                if (bad++ < 5) TEST_FAILF("f16 NaN 0x%04x: back 0x%04x", h, back);
            }
        } else if ((double)f != want || !signbit(f) != !signbit(want) || back != h) {
            if (bad++ < 5) TEST_FAILF("f16 0x%04x: f32 %.9g (want %.9g), back 0x%04x", h, (double)f, want, back);
        }
    }
    CHECK_INT_EQ(bad, 0);
}

/* ---- rounding ---- */

/* Checks conv(x) against ref_round for x at every midpoint between
 * neighbouring patterns (both signs), one fp32 ulp either side, and n_random
 * random fp32 bit patterns (NaNs skipped). Returns the number of mismatches. */
static int check_rounding(uint16_t (*conv)(float), int mbits, int bias, int n_random) {
    int bad = 0;
    uint16_t inf = (uint16_t)(((1 << (15 - mbits)) - 1) << mbits);
    for (uint32_t h = 0; h < inf; h++) {
        double lo = ref_value((uint16_t)h, mbits, bias);
        double hi = h + 1 < inf ? ref_value((uint16_t)(h + 1), mbits, bias)
                                : lo + (lo - ref_value((uint16_t)(h - 1), mbits, bias));
        float mid = (float)((lo + hi) / 2); /* exact: needs mbits + 2 bits */
        FSDP_ASSERT((double)mid == (lo + hi) / 2, "midpoint not exact");
        float xs[3] = {mid, nextafterf(mid, 0.0f), nextafterf(mid, INFINITY)};
        for (int k = 0; k < 3; k++)
            for (int s = 0; s < 2; s++) {
                float x = s ? -xs[k] : xs[k];
                uint16_t got = conv(x), want = ref_round(x, mbits, bias);
                if (got != want && bad++ < 5)
                    TEST_FAILF("round %.9g (0x%08x): got 0x%04x want 0x%04x", (double)x, bits_of(x), got, want);
            }
    }
    for (int i = 0; i < n_random; i++) {
        float x = float_of(rnd32() ^ (rnd32() << 16));
        if (isnan(x)) continue;
        uint16_t got = conv(x), want = ref_round(x, mbits, bias);
        if (got != want && bad++ < 5)
            TEST_FAILF("round %.9g (0x%08x): got 0x%04x want 0x%04x", (double)x, bits_of(x), got, want);
    }
    return bad;
}

TEST(bf16_rounding_nearest_even) {
    CHECK_INT_EQ(check_rounding(fsdp__f32_to_bf16, 7, 127, 1000000), 0);
    /* named cases */
    CHECK_INT_EQ(fsdp__f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);        /* tie, even below */
    CHECK_INT_EQ(fsdp__f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);    /* tie, even above */
    CHECK_INT_EQ(fsdp__f32_to_bf16(1.0f + 0x1p-8f + 0x1p-23f), 0x3f81);
    CHECK_INT_EQ(fsdp__f32_to_bf16(3.4028235e38f), 0x7f80);         /* FLT_MAX overflows */
    CHECK_INT_EQ(fsdp__f32_to_bf16(-INFINITY), 0xff80);
    CHECK_INT_EQ(fsdp__f32_to_bf16(-0.0f), 0x8000);
    CHECK_INT_EQ(fsdp__f32_to_bf16(0x1p-133f), 0x0001);             /* bf16 subnormal, not flushed */
    CHECK_INT_EQ(fsdp__f32_to_bf16(float_of(0x7f800001u)), 0x7fc0); /* sNaN -> qNaN */
    CHECK_INT_EQ(fsdp__f32_to_bf16(float_of(0xffc12345u)), 0xffc1);
}

TEST(f16_rounding_nearest_even) {
    CHECK_INT_EQ(check_rounding(fsdp__f32_to_f16, 10, 15, 1000000), 0);
    CHECK_INT_EQ(fsdp__f32_to_f16(65504.0f), 0x7bff);
    CHECK_INT_EQ(fsdp__f32_to_f16(65519.996f), 0x7bff);
    CHECK_INT_EQ(fsdp__f32_to_f16(65520.0f), 0x7c00);               /* tie at the top goes to inf */
    CHECK_INT_EQ(fsdp__f32_to_f16(-1e9f), 0xfc00);
    CHECK_INT_EQ(fsdp__f32_to_f16(1.0f + 0x1p-11f), 0x3c00);
    CHECK_INT_EQ(fsdp__f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3c02);
    CHECK_INT_EQ(fsdp__f32_to_f16(0x1p-24f), 0x0001);               /* smallest subnormal */
    CHECK_INT_EQ(fsdp__f32_to_f16(0x1p-25f), 0x0000);               /* tie to even zero */
    CHECK_INT_EQ(fsdp__f32_to_f16(nextafterf(0x1p-25f, 1.0f)), 0x0001);
    CHECK_INT_EQ(fsdp__f32_to_f16(3 * 0x1p-25f), 0x0002);           /* tie 1.5 units -> 2 */
    CHECK_INT_EQ(fsdp__f32_to_f16(0x1p-14f - 0x1p-25f), 0x0400);    /* rounds up into the normals */
    CHECK_INT_EQ(fsdp__f32_to_f16(-0.0f), 0x8000);
    CHECK_INT_EQ(fsdp__f32_to_f16(1e-30f), 0x0000);
    CHECK_INT_EQ(fsdp__f32_to_f16(float_of(0x7f800001u)), 0x7e00);  /* sNaN -> qNaN */
    CHECK_INT_EQ(fsdp__f32_to_f16(float_of(0xffc12345u)), 0xfe09);
}

/* ---- arrays against scalars ---- */

/* [Note: vector paths at run time] (src/core/cpu.c): the level the array
 * forms run at is the CPU's own best, or the one FSDP_MAX_CPU_ISA names when
 * that is lower, so each of tests/run.sh's runs of this file tests the path
 * it names. */
TEST(vector_level_is_the_cpus_capped_by_the_variable) {
    static const char *const names[] = {"scalar", "avx2", "avx512", "avx512bf16"};
    enum fsdp__isa cpu = fsdp__cpu_isa_detected(), want = cpu;
    const char *cap = getenv("FSDP_MAX_CPU_ISA");
    for (int l = 0; cap && l < 4; l++)
        if (!strcmp(cap, names[l]) && (enum fsdp__isa)l < cpu) want = (enum fsdp__isa)l;
    fprintf(stderr, "  the CPU's level %s; FSDP_MAX_CPU_ISA %s; running %s\n", fsdp__isa_name(cpu), cap ? cap : "unset",
            fsdp__isa_name(fsdp__cpu_isa()));
    CHECK_INT_EQ(fsdp__cpu_isa(), want);
    for (int l = 0; l < 4; l++) CHECK_STR_EQ(fsdp__isa_name((enum fsdp__isa)l), names[l]);
    /* an independent reference: what the compiler's -march (native by default) said of the CPU */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    CHECK_INT_EQ(cpu, FSDP__ISA_AVX512BF16);
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    CHECK(cpu >= FSDP__ISA_AVX512);
#elif defined(__AVX2__) && defined(__F16C__) && defined(__SSE4_2__)
    CHECK(cpu >= FSDP__ISA_AVX2);
#endif
}

/* A cap above the CPU's level runs the CPU's (tests/run.sh stops its level runs at the CPU's, so
 * the case is checked here: the harness forks each test, the level is recomputed under each cap). */
TEST(a_cap_above_the_cpus_level_runs_the_cpus) {
    static const char *const names[] = {"scalar", "avx2", "avx512", "avx512bf16"};
    enum fsdp__isa cpu = fsdp__cpu_isa_detected();
    for (int l = 0; l < 4; l++) {
        setenv("FSDP_MAX_CPU_ISA", names[l], 1);
        atomic_store(&fsdp__isa_level, -1);
        CHECK_INT_EQ(fsdp__cpu_isa(), (enum fsdp__isa)l < cpu ? (enum fsdp__isa)l : cpu);
    }
    setenv("FSDP_MAX_CPU_ISA", "auto", 1);
    atomic_store(&fsdp__isa_level, -1);
    CHECK_INT_EQ(fsdp__cpu_isa(), cpu);
}

TEST(array_forms_match_scalar_bits) {
    const size_t n16 = 65536 + 7; /* odd: exercises the scalar tail */
    uint16_t *h = malloc(n16 * sizeof *h), *h2 = malloc(n16 * sizeof *h2);
    float *f = malloc(n16 * sizeof *f);
    ASSERT(h && h2 && f);
    for (size_t i = 0; i < n16; i++) h[i] = (uint16_t)i;
    int bad = 0;
    fsdp__cvt_bf16_to_f32(h, f, n16);
    for (size_t i = 0; i < n16; i++) bad += bits_of(f[i]) != bits_of(fsdp__bf16_to_f32(h[i]));
    CHECK_INT_EQ(bad, 0);
    fsdp__cvt_f16_to_f32(h, f, n16);
    bad = 0;
    for (size_t i = 0; i < n16; i++) {
        float s = fsdp__f16_to_f32(h[i]);
        /* vcvtph2ps quiets signalling NaNs; the scalar form keeps the payload as is */
        bad += isnan(s) ? !isnan(f[i]) || (bits_of(f[i]) & ~0x00400000u) != (bits_of(s) & ~0x00400000u)
                        : bits_of(f[i]) != bits_of(s);
    }
    CHECK_INT_EQ(bad, 0);
    /* fp32 -> 16: the midpoint neighbourhoods via every pattern shifted, random bits, NaNs, infs */
    const size_t n = 3 * 65536 + 300001;
    float *x = malloc(n * sizeof *x);
    uint16_t *y = malloc(n * sizeof *y);
    ASSERT(x && y);
    for (size_t i = 0; i < 65536; i++) {
        uint32_t b = (uint32_t)i << 16;
        x[3 * i] = float_of(b | 0x8000u);      /* bf16 ties */
        x[3 * i + 1] = float_of(b | 0x8001u);
        x[3 * i + 2] = float_of((uint32_t)i << 13 | 0x1000u | (b & 0x80000000u)); /* f16-like ties */
    }
    for (size_t i = 3 * 65536; i < n; i++) x[i] = float_of(rnd32() ^ (rnd32() << 16));
    x[n - 1] = INFINITY;
    x[n - 2] = -INFINITY;
    x[n - 3] = float_of(0x7fa00001u);
    fsdp__cvt_f32_to_bf16(x, y, n);
    bad = 0;
    for (size_t i = 0; i < n; i++)
        if (y[i] != fsdp__f32_to_bf16(x[i]) && bad++ < 5)
            TEST_FAILF("bf16 array 0x%08x: 0x%04x vs scalar 0x%04x", bits_of(x[i]), y[i], fsdp__f32_to_bf16(x[i]));
    CHECK_INT_EQ(bad, 0);
    /* every length to 80, from an odd start: each mix of the vector loop and the scalar tail */
    for (size_t len = 1; len <= 80; len++) {
        for (size_t i = 0; i < len; i++) y[i] = 0xdead;
        fsdp__cvt_f32_to_bf16(x + 3 * 4095 + 1, y, len);
        for (size_t i = 0; i < len; i++)
            if (y[i] != fsdp__f32_to_bf16(x[3 * 4095 + 1 + i]) && bad++ < 5)
                TEST_FAILF("bf16 array of %zu, element %zu: 0x%04x vs scalar 0x%04x", len, i, y[i],
                           fsdp__f32_to_bf16(x[3 * 4095 + 1 + i]));
    }
    CHECK_INT_EQ(bad, 0);
    fsdp__cvt_f32_to_f16(x, y, n);
    bad = 0;
    for (size_t i = 0; i < n; i++)
        if (y[i] != fsdp__f32_to_f16(x[i]) && bad++ < 5)
            TEST_FAILF("f16 array 0x%08x: 0x%04x vs scalar 0x%04x", bits_of(x[i]), y[i], fsdp__f32_to_f16(x[i]));
    CHECK_INT_EQ(bad, 0);
    /* the dispatchers */
    fsdp__cvt_from_f32(FSDP_BF16, x, h2, 1000);
    fsdp__cvt_to_f32(FSDP_BF16, h2, f, 1000);
    bad = 0;
    for (size_t i = 0; i < 1000; i++)
        bad += bits_of(f[i]) != bits_of(fsdp__bf16_to_f32(fsdp__f32_to_bf16(x[i]))) && !isnan(f[i]);
    CHECK_INT_EQ(bad, 0);
    /* rounding in fp32 (fsdp__cvt_round): the scalar round trip's bits, split
     * over threads, in place too; F32 copies */
    float *r = malloc(n * sizeof *r);
    ASSERT(r);
    enum fsdp_dtype rdt[2] = {FSDP_BF16, FSDP_F16};
    for (int d = 0; d < 2; d++)
        for (int inplace = 0; inplace < 2; inplace++) {
            if (inplace) memcpy(r, x, n * sizeof *r);
            fsdp__cvt_round(rdt[d], inplace ? r : x, r, n);
            bad = 0;
            for (size_t i = 0; i < n; i++) {
                float want = rdt[d] == FSDP_BF16 ? fsdp__bf16_to_f32(fsdp__f32_to_bf16(x[i]))
                                                 : fsdp__f16_to_f32(fsdp__f32_to_f16(x[i]));
                if (isnan(want) ? !isnan(r[i]) : bits_of(r[i]) != bits_of(want)) bad++;
            }
            CHECK_INT_EQ(bad, 0);
        }
    fsdp__cvt_round(FSDP_F32, x, r, 1000);
    CHECK_INT_EQ(memcmp(r, x, 1000 * sizeof *r), 0);
    free(r);
    free(h);
    free(h2);
    free(f);
    free(x);
    free(y);
}

/* [Note: bf16 rounding instruction] (dtype.c): 64 normal values (ties and
 * NaNs among them) with a subnormal at each position in turn, and none,
 * give the scalar form's bits, also with MXCSR's DAZ and FTZ set (the
 * instruction reads a subnormal as zero either way) */
TEST(bf16_array_subnormal_at_every_lane) {
    float x[64];
    uint16_t y[64];
    int bad = 0;
    for (int daz = 0; daz < 2; daz++) {
#if defined(__SSE__)
        if (daz) _mm_setcsr(_mm_getcsr() | 0x8040u);
#else
        if (daz) break;
#endif
        for (int at = -1; at < 64; at++) {
            for (int i = 0; i < 64; i++) x[i] = float_of(((uint32_t)(i + 1) << 23) | 0x8000u | (uint32_t)i << 16);
            x[5] = float_of(0x7fa00001u);
            if (at >= 0) x[at] = float_of(0x00018000u | (uint32_t)at);
            fsdp__cvt_f32_to_bf16(x, y, 64);
            for (int i = 0; i < 64; i++)
                if (y[i] != fsdp__f32_to_bf16(x[i]) && bad++ < 5)
                    TEST_FAILF("DAZ %d, subnormal at %d: 0x%08x gives 0x%04x, scalar 0x%04x", daz, at,
                               bits_of(x[i]), y[i], fsdp__f32_to_bf16(x[i]));
        }
    }
    CHECK_INT_EQ(bad, 0);
}

TEST_MAIN()
