/*
 * cpu.c - which of the library's own vector paths this CPU runs
 * ([Note: vector paths at run time]).
 *
 * [Note: vector paths at run time] The machines the library runs on differ
 * (AMX; AVX-512 with AVX512-BF16; AVX2 only), and a path chosen when the
 * library is compiled is tested only on the machines that build it: the AVX2
 * conversions only where the build had no AVX-512, the integer bf16 rounding
 * only where it had no AVX512-BF16. So the hand-written vector paths (the
 * 16-bit conversions of dtype.c, the softmax rows of attention.c, shm's
 * streaming copies and sums, the CRC-32C of checkpoint files) are all
 * compiled in every x86-64 build, each function with the target it needs,
 * and the one to run is chosen here, once, from what the CPU reports (cpuid,
 * and xgetbv for the registers the OS saves): the best level the CPU has, or
 * the lower one FSDP_MAX_CPU_ISA names (scalar, avx2, avx512, avx512bf16; as
 * oneDNN's ONEDNN_MAX_CPU_ISA caps its kernels). The conversions, shm's sums
 * and the CRC give the same bits at every level (the scalar forms are the
 * reference: tests/test_dtype.c, tests/test_mpi_comm.c,
 * tests/test_safetensors.c); the softmax rows' sums add in another lane order
 * on AVX-512 registers than in the loops (4e-7 relative at most, [Note:
 * softmax rows in registers]). tests/run.sh runs the tests of those paths
 * once at each level up to the CPU's. The compiler's own code (the loops it
 * vectorises) is what the build's -march made, and oneDNN chooses its
 * kernels itself. A context created with verbose >= 1 says the level on rank 0.
 * Levels: AVX2 asks AVX2, F16C and SSE4.2 (the crc32 instruction) with the OS
 * saving the YMM registers; AVX512 asks AVX-512 F, BW and VL with the OS
 * saving the ZMM and mask registers; AVX512BF16 asks AVX512 and AVX512-BF16.
 */
#include "core/core-impl.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

static uint64_t xcr0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

/* the best level this CPU and its OS give */
static enum fsdp__isa detect(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return FSDP__ISA_SCALAR;
    int osxsave = (c >> 27) & 1, f16c = (c >> 29) & 1, sse42 = (c >> 20) & 1;
    if (!osxsave) return FSDP__ISA_SCALAR;
    uint64_t x = xcr0();
    int ymm = (x & 0x6) == 0x6, zmm = (x & 0xe6) == 0xe6; /* SSE, AVX; opmask, ZMM_Hi256, Hi16_ZMM */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return FSDP__ISA_SCALAR;
    int avx2 = (b >> 5) & 1, f = (b >> 16) & 1, bw = (b >> 30) & 1, vl = (b >> 31) & 1;
    if (!(ymm && avx2 && f16c && sse42)) return FSDP__ISA_SCALAR;
    if (!(zmm && f && bw && vl)) return FSDP__ISA_AVX2;
    unsigned max7 = a;
    if (max7 >= 1 && __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 5) & 1)) return FSDP__ISA_AVX512BF16;
    return FSDP__ISA_AVX512;
}
#else
static enum fsdp__isa detect(void) { return FSDP__ISA_SCALAR; }
#endif

enum fsdp__isa fsdp__cpu_isa_detected(void) {
    static _Atomic int have = -1;
    int h = atomic_load_explicit(&have, memory_order_relaxed);
    if (h < 0) atomic_store_explicit(&have, h = (int)detect(), memory_order_relaxed);
    return (enum fsdp__isa)h;
}

_Atomic int fsdp__isa_level = -1;

enum fsdp__isa fsdp__cpu_isa_init(void) { /* the same value whichever thread computes it first */
    int l = (int)fsdp__cpu_isa_detected();
    /* env.c's words: auto, then the levels in order (fsdp_ctx_create has checked the value) */
    long long cap = fsdp__env_checked("FSDP_MAX_CPU_ISA", 0) - 1;
    if (cap >= 0 && cap < l) l = (int)cap;
    atomic_store_explicit(&fsdp__isa_level, l, memory_order_relaxed);
    return (enum fsdp__isa)l;
}

const char *fsdp__isa_name(enum fsdp__isa isa) {
    switch (isa) {
    case FSDP__ISA_SCALAR: return "scalar";
    case FSDP__ISA_AVX2: return "avx2";
    case FSDP__ISA_AVX512: return "avx512";
    case FSDP__ISA_AVX512BF16: return "avx512bf16";
    }
    return "?";
}
