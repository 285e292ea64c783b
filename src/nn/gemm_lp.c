/*
 * gemm_lp.c - low-precision GEMM: 16-bit inputs, fp32 accumulation, fp32
 * output (fsdp__gemm_lp). Part of src/nn's GEMM wrapper (gemm.c has fp32).
 *  - bf16: oneDNN's matmul primitive with bf16 src/weights and f32 dst, which
 *    runs on AMX or AVX512-BF16 where the CPU has them (brgemm). Transposes and
 *    leading dimensions are expressed as memory strides, so nothing is copied.
 *  - fp16, and bf16 on a CPU without a bf16 matmul in oneDNN (AVX2 only, say:
 *    creation returns dnnl_unimplemented there, and for f16 on every CPU in
 *    oneDNN 2.6): both inputs are widened to fp32 in a per-thread scratch
 *    buffer and multiplied with fsdp__sgemm ([Note: widened products]).
 *  - fp32: fsdp__sgemm (dnnl_sgemm), except a product with a bias
 *    (fsdp__gemm_lp_bias): the fp32 matmul primitive, which adds the bias in
 *    its kernel where the sgemm path first filled every output row with it
 *    and accumulated (beta 1). For GPT-2's Linears at 1024 rows on 2 threads
 *    (AVX-512) it ran their four forwards in 0.410 s of products a step
 *    against 0.437 s for dnnl_sgemm (mlp.c_proj's 1024 x 768 from K = 3072:
 *    422 against 342 GFLOP/s), and the fill's pass is gone.
 * [Note: matmul cache] Creating a matmul primitive costs milliseconds (JIT),
 * so primitives are kept in a process-wide table keyed by everything that
 * shapes them: dtype, M, N, K, transposes, leading dimensions, alpha (output
 * scale), beta (a sum post-op) and whether the call is inside an OpenMP
 * parallel region (oneDNN sizes its thread split at creation). The table is
 * guarded by a mutex and never evicts (a primitive may be executing on another
 * thread); when it is full a call creates and destroys its own primitive.
 * Execution is thread-safe: each call brings its own memory objects, stream
 * (one per thread) and scratchpad (user-managed, one growing buffer per
 * thread), so attention can run per-(batch, head) products in parallel.
 * A oneDNN failure is a broken invariant (FSDP_ASSERT), as in fsdp__sgemm.
 */
#include "nn/nn-impl.h"

#include <omp.h>
#include <oneapi/dnnl/dnnl.h>
#include <pthread.h>

struct mm_key {
    int dt, transa, transb, in_par;
    int64_t M, N, K, lda, ldb, ldc;
    int64_t batch, sa, sb, sc; /* batched products: count and element strides (batch 1: 2-D) */
    int64_t bias;              /* 1: a row vector of N fp32 added to every row (2-D only) */
    int64_t out16;             /* 1: C in bf16, rounded by the kernel ([Note: 16-bit output by the kernel]) */
    uint32_t alpha_bits, beta_bits;
};

struct mm_entry {
    struct mm_key key;
    dnnl_primitive_t prim;
    dnnl_memory_desc_t a, b, c, bias, scratch; /* the descs the primitive was made for */
    size_t scratch_bytes;
};

#define MM_CACHE_CAP 512

static pthread_mutex_t mm_lock = PTHREAD_MUTEX_INITIALIZER;
static struct mm_entry mm_cache[MM_CACHE_CAP];
static int mm_count;
static dnnl_engine_t mm_engine;
static pthread_once_t mm_once = PTHREAD_ONCE_INIT;

static _Thread_local dnnl_stream_t tl_stream;
static _Thread_local void *tl_scratch;   /* oneDNN scratchpad, this thread */
static _Thread_local size_t tl_scratch_cap;
static _Thread_local float *tl_wide;     /* widened products: A and B in fp32, this thread */
static _Thread_local size_t tl_wide_cap; /* floats */

/* [Note: widened products]
 * A 16-bit product oneDNN cannot run natively is computed as the fp32 product
 * of the widened inputs. Every product of two bf16 (or fp16) values is exact
 * in fp32, so this is the same mathematical result with fp32 accumulation as
 * the native kernel: only the summation order, hence the last bits, differ.
 * What stays 16-bit is everything around the product (the gathered weights,
 * the bytes moved, the rounding of the inputs), so a bf16 run on an AVX2 CPU
 * trains like one on AMX, at fp32 GEMM speed plus the widening.
 * Whether bf16 is native is decided once per process ([Note: bf16
 * kernels]); FSDP_GEMM_BF16=widen forces the widened path (tests use it
 * to cover it on CPUs that have the native one). The widened inputs go
 * through a per-thread scratch of about FSDP_WIDEN_SCRATCH bytes (default
 * 32 MiB; gemm_widen), read once per process too. */
/* [Note: bf16 kernels] oneDNN 2.6 has bf16 matmuls for every AVX-512 CPU,
 * but only AMX and AVX512-BF16 have bf16 instructions: on AVX-512 without
 * them (Skylake, Cascade Lake) its kernels emulate the bf16 dot products and
 * ran GPT-2's products at 135 GFLOP/s where fp32's reach 370 (this CPU with
 * ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI: a bf16 step 6.3 s native, 2.9 s
 * widened). So bf16 is native where a probe primitive can be made and the
 * CPU oneDNN runs on has bf16 instructions; elsewhere it is widened. And of
 * oneDNN's two bf16 matmuls, the first it offers (brgemm kernels: AMX's)
 * ran each of GPT-2's 2-D products 4-33% slower on AVX512-BF16 without AMX
 * than the gemm-based one (gemm:jit; its lm_head dW 1.9x), while the
 * batched (T, T) attention products ran faster on brgemm. So on AVX512-BF16
 * without AMX a 2-D bf16 product asks for the gemm-based implementation
 * (mm_create). FSDP_GEMM_BF16 forces a choice: widen, matmul (oneDNN's first
 * implementation, even where bf16 is emulated), gemm (the gemm-based one for
 * 2-D products, likewise); auto is the rule above. Each choice is fixed for
 * the process, so runs are bit-reproducible; implementations sum in
 * different orders, so bits differ between them. */
enum { MM_AUTO, MM_WIDEN, MM_MATMUL, MM_GEMM }; /* FSDP_GEMM_BF16's words */
static int mm_bf16_native, mm_bf16_gemm;
static size_t mm_widen_floats = ((size_t)32 << 20) / sizeof(float);

/* 1 if oneDNN makes a bf16 matmul on this CPU (with or without bf16 instructions) */
static int mm_probe_bf16(void) {
    dnnl_dims_t d = {16, 16};
    dnnl_memory_desc_t a, b, c;
    dnnl_matmul_desc_t md;
    dnnl_primitive_desc_t pd = NULL;
    dnnl_status_t st = dnnl_memory_desc_init_by_tag(&a, 2, d, dnnl_bf16, dnnl_ab);
    if (st == dnnl_success) st = dnnl_memory_desc_init_by_tag(&b, 2, d, dnnl_bf16, dnnl_ab);
    if (st == dnnl_success) st = dnnl_memory_desc_init_by_tag(&c, 2, d, dnnl_f32, dnnl_ab);
    if (st == dnnl_success) st = dnnl_matmul_desc_init(&md, &a, &b, NULL, &c);
    if (st == dnnl_success) st = dnnl_primitive_desc_create(&pd, &md, NULL, mm_engine, NULL);
    dnnl_primitive_desc_destroy(pd);
    return st == dnnl_success;
}

static void mm_engine_init(void) {
    dnnl_status_t st = dnnl_engine_create(&mm_engine, dnnl_cpu, 0);
    FSDP_ASSERT(st == dnnl_success, "dnnl_engine_create(cpu) failed with status %d", (int)st);
    long long how = fsdp__env_checked("FSDP_GEMM_BF16", MM_AUTO); /* [Note: bf16 kernels] */
    dnnl_cpu_isa_t isa = dnnl_get_effective_cpu_isa();
    int hw = isa == dnnl_cpu_isa_avx512_core_bf16 || isa == dnnl_cpu_isa_avx512_core_amx;
    mm_bf16_native = how != MM_WIDEN && (hw || how != MM_AUTO) && mm_probe_bf16();
    mm_bf16_gemm = mm_bf16_native && (how == MM_GEMM || (how == MM_AUTO && isa == dnnl_cpu_isa_avx512_core_bf16));
    long long v = fsdp__env_checked("FSDP_WIDEN_SCRATCH", 0);
    if (v) mm_widen_floats = (size_t)v / sizeof(float);
}

/* 1 if dt's products run on oneDNN's native 16-bit kernels (bf16 where the
 * CPU has them), 0 if they are widened to fp32 */
static int mm_native(enum fsdp_dtype dt) {
    if (dt != FSDP_BF16) return 0;
    pthread_once(&mm_once, mm_engine_init);
    return mm_bf16_native;
}

static uint32_t fbits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* The primitive descriptor of oneDNN's gemm-based implementation of md
 * ([Note: bf16 kernels]), or NULL when it offers none for it. */
static dnnl_primitive_desc_t mm_pd_gemm(const dnnl_matmul_desc_t *md, const_dnnl_primitive_attr_t attr) {
    dnnl_primitive_desc_iterator_t it = NULL;
    dnnl_primitive_desc_t pd = NULL;
    if (dnnl_primitive_desc_iterator_create(&it, md, attr, mm_engine, NULL) != dnnl_success) return NULL;
    do {
        dnnl_primitive_desc_t p = dnnl_primitive_desc_iterator_fetch(it);
        const char *impl = NULL;
        if (p && dnnl_primitive_desc_query(p, dnnl_query_impl_info_str, 0, &impl) == dnnl_success && impl &&
            !strncmp(impl, "gemm:", 5)) {
            pd = p;
            break;
        }
        dnnl_primitive_desc_destroy(p);
    } while (dnnl_primitive_desc_iterator_next(it) == dnnl_success);
    dnnl_primitive_desc_iterator_destroy(it);
    return pd;
}

/* Creates the primitive for key k into *e (not yet in the table). */
static void mm_create(const struct mm_key *k, float alpha, float beta, struct mm_entry *e) {
    dnnl_data_type_t in_dt = k->dt == FSDP_BF16 ? dnnl_bf16 : k->dt == FSDP_F32 ? dnnl_f32 : dnnl_f16;
    /* 2-D, or 3-D with the batch as the outer dimension */
    int nd = k->batch > 1 ? 3 : 2, o = nd - 2;
    dnnl_dims_t ad = {0}, bd = {0}, cd = {0}, as = {0}, bs = {0}, cs = {0};
    ad[0] = bd[0] = cd[0] = k->batch;
    as[0] = k->sa;
    bs[0] = k->sb;
    cs[0] = k->sc;
    ad[o] = k->M, ad[o + 1] = k->K, bd[o] = k->K, bd[o + 1] = k->N, cd[o] = k->M, cd[o + 1] = k->N;
    as[o] = k->transa ? 1 : k->lda, as[o + 1] = k->transa ? k->lda : 1;
    bs[o] = k->transb ? 1 : k->ldb, bs[o + 1] = k->transb ? k->ldb : 1;
    cs[o] = k->ldc, cs[o + 1] = 1;
    dnnl_status_t st = dnnl_memory_desc_init_by_strides(&e->a, nd, ad, in_dt, as);
    if (st == dnnl_success) st = dnnl_memory_desc_init_by_strides(&e->b, nd, bd, in_dt, bs);
    if (st == dnnl_success) st = dnnl_memory_desc_init_by_strides(&e->c, nd, cd, k->out16 ? dnnl_bf16 : dnnl_f32, cs);
    if (st == dnnl_success && k->bias) {
        dnnl_dims_t vd = {1, k->N}, vs = {k->N, 1};
        st = dnnl_memory_desc_init_by_strides(&e->bias, 2, vd, dnnl_f32, vs);
    }
    dnnl_matmul_desc_t md;
    if (st == dnnl_success) st = dnnl_matmul_desc_init(&md, &e->a, &e->b, k->bias ? &e->bias : NULL, &e->c);
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t po = NULL;
    if (st == dnnl_success) st = dnnl_primitive_attr_create(&attr);
    if (st == dnnl_success) st = dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user);
    if (st == dnnl_success && alpha != 1.0f) st = dnnl_primitive_attr_set_output_scales(attr, 1, 0, &alpha);
    if (st == dnnl_success && beta != 0.0f) {
        st = dnnl_post_ops_create(&po);
        if (st == dnnl_success) st = dnnl_post_ops_append_sum(po, beta);
        if (st == dnnl_success) st = dnnl_primitive_attr_set_post_ops(attr, po);
    }
    dnnl_primitive_desc_t pd = NULL;
    if (st == dnnl_success && k->dt == FSDP_BF16 && k->batch == 1 && mm_bf16_gemm)
        pd = mm_pd_gemm(&md, attr); /* [Note: bf16 kernels] */
    if (st == dnnl_success && !pd) st = dnnl_primitive_desc_create(&pd, &md, attr, mm_engine, NULL);
    if (st == dnnl_success) st = dnnl_primitive_create(&e->prim, pd);
    if (st == dnnl_success) {
        e->scratch = *dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
        e->scratch_bytes = dnnl_memory_desc_get_size(&e->scratch);
    }
    dnnl_primitive_desc_destroy(pd);
    dnnl_post_ops_destroy(po);
    dnnl_primitive_attr_destroy(attr);
    FSDP_ASSERT(st == dnnl_success, "oneDNN %s matmul (%c%c, batch %lld, M=%lld N=%lld K=%lld, lda=%lld "
                "ldb=%lld ldc=%lld, alpha %g beta %g): creation failed with status %d", fsdp_dtype_name(k->dt),
                k->transa ? 'T' : 'N', k->transb ? 'T' : 'N', (long long)k->batch, (long long)k->M,
                (long long)k->N, (long long)k->K, (long long)k->lda, (long long)k->ldb, (long long)k->ldc,
                (double)alpha, (double)beta, (int)st);
    e->key = *k;
}

/* Returns the cached entry for k, creating it (*owned = 0), or a private
 * entry in *tmp when the table is full (*owned = 1: destroy after use). */
static const struct mm_entry *mm_get(const struct mm_key *k, float alpha, float beta, struct mm_entry *tmp,
                                     int *owned) {
    pthread_once(&mm_once, mm_engine_init);
    *owned = 0;
    pthread_mutex_lock(&mm_lock);
    for (int i = 0; i < mm_count; i++)
        if (memcmp(&mm_cache[i].key, k, sizeof *k) == 0) {
            pthread_mutex_unlock(&mm_lock);
            return &mm_cache[i];
        }
    const struct mm_entry *e;
    if (mm_count < MM_CACHE_CAP) { /* create under the lock: a shape is made once */
        mm_create(k, alpha, beta, &mm_cache[mm_count]);
        e = &mm_cache[mm_count++];
    } else {
        mm_create(k, alpha, beta, tmp);
        *owned = 1;
        e = tmp;
    }
    pthread_mutex_unlock(&mm_lock);
    return e;
}

/* A thread's scratch, grown to the largest product it ran and kept: 64-byte
 * aligned for the kernels, so aligned_alloc rather than fsdp__malloc (the
 * failure injection does not reach it; running out here is fatal). */
static void *tl_grow(void **buf, size_t *cap, size_t bytes) {
    if (bytes > *cap) {
        free(*buf);
        *buf = aligned_alloc(64, (bytes + 63) / 64 * 64);
        FSDP_ASSERT(*buf, "out of memory for %zu bytes of GEMM scratch", bytes);
        *cap = (bytes + 63) / 64 * 64;
    }
    return *buf;
}

/* Runs k's primitive; scratch: the caller's buffer of the primitive's
 * scratchpad size, or NULL for this thread's */
static void gemm_onednn(const struct mm_key *k, float alpha, float beta, const void *A, const void *B,
                        const float *bias, void *C, void *scratch) {
    struct mm_entry tmp;
    int owned;
    const struct mm_entry *e = mm_get(k, alpha, beta, &tmp, &owned);
    if (!tl_stream) {
        dnnl_status_t st = dnnl_stream_create(&tl_stream, mm_engine, dnnl_stream_default_flags);
        FSDP_ASSERT(st == dnnl_success, "dnnl_stream_create failed with status %d", (int)st);
    }
    if (!e->scratch_bytes) scratch = NULL;
    else if (!scratch) scratch = tl_grow(&tl_scratch, &tl_scratch_cap, e->scratch_bytes);
    dnnl_memory_t ma = NULL, mb = NULL, mc = NULL, ms = NULL, mv = NULL;
    dnnl_status_t st = dnnl_memory_create(&ma, &e->a, mm_engine, (void *)(uintptr_t)A);
    if (st == dnnl_success) st = dnnl_memory_create(&mb, &e->b, mm_engine, (void *)(uintptr_t)B);
    if (st == dnnl_success) st = dnnl_memory_create(&mc, &e->c, mm_engine, C);
    if (st == dnnl_success && scratch) st = dnnl_memory_create(&ms, &e->scratch, mm_engine, scratch);
    if (st == dnnl_success && k->bias) st = dnnl_memory_create(&mv, &e->bias, mm_engine, (void *)(uintptr_t)bias);
    dnnl_exec_arg_t args[5] = {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}};
    int nargs = 3;
    if (scratch) args[nargs++] = (dnnl_exec_arg_t){DNNL_ARG_SCRATCHPAD, ms};
    if (k->bias) args[nargs++] = (dnnl_exec_arg_t){DNNL_ARG_BIAS, mv};
    if (st == dnnl_success) st = dnnl_primitive_execute(e->prim, tl_stream, nargs, args);
    if (st == dnnl_success) st = dnnl_stream_wait(tl_stream);
    dnnl_memory_destroy(ma);
    dnnl_memory_destroy(mb);
    dnnl_memory_destroy(mc);
    dnnl_memory_destroy(ms);
    dnnl_memory_destroy(mv);
    if (owned) dnnl_primitive_destroy(tmp.prim);
    FSDP_ASSERT(st == dnnl_success, "oneDNN %s matmul (M=%lld N=%lld K=%lld) failed with status %d",
                fsdp_dtype_name(k->dt), (long long)k->M, (long long)k->N, (long long)k->K, (int)st);
}

/* Widens rows [r0, r0 + nr) x columns [c0, c0 + nc) of a stored 16-bit
 * matrix (row stride ld) into a dense nr x nc fp32 block; rows in parallel
 * when it is large and we are not inside a parallel region already. */
static void widen_block(enum fsdp_dtype dt, const uint16_t *X, int64_t ld, int64_t r0, int64_t nr, int64_t c0,
                        int64_t nc, float *out) {
#pragma omp parallel for schedule(static) if (!omp_in_parallel() && nr * nc >= (1 << 18))
    for (int64_t i = 0; i < nr; i++) fsdp__cvt_to_f32(dt, X + (r0 + i) * ld + c0, out + i * nc, (size_t)nc);
}

/* op(A)[:, k0:k0+kn] into a (dense, stored as A is) and op(B)[k0:k0+kn, :]
 * into b, widened to fp32: the inputs of one block of K */
static void widen_k_block(enum fsdp_dtype dt, int transa, int transb, int64_t M, int64_t N, int64_t k0, int64_t kn,
                          const uint16_t *A, int64_t lda, const uint16_t *B, int64_t ldb, float *a, float *b) {
    if (transa) widen_block(dt, A, lda, k0, kn, 0, M, a); /* stored (K, M): kn rows */
    else widen_block(dt, A, lda, 0, M, k0, kn, a);        /* stored (M, K): kn columns */
    if (transb) widen_block(dt, B, ldb, 0, N, k0, kn, b); /* stored (N, K) */
    else widen_block(dt, B, ldb, k0, kn, 0, N, b);        /* stored (K, N) */
}

/* A product oneDNN has no 16-bit kernel for ([Note: widened products]):
 * fsdp__sgemm on the inputs widened to fp32, over blocks of K so that this
 * thread's scratch stays near FSDP_WIDEN_SCRATCH (the lm_head's products would
 * otherwise widen 150-200 MB at once): C = alpha op(A) op(B) + beta C for the
 * first block, += for the next. Each input element is widened once. */
static void gemm_widen(enum fsdp_dtype dt, int transa, int transb, int64_t M, int64_t N, int64_t K, float alpha,
                       const uint16_t *A, int64_t lda, const uint16_t *B, int64_t ldb, float beta, float *C,
                       int64_t ldc) {
    pthread_once(&mm_once, mm_engine_init);
    int64_t kb = (int64_t)mm_widen_floats / (M + N);
    if (kb < 256) kb = 256; /* short blocks would cost sgemm more than the memory saves */
    if (kb > K) kb = K;
    float *a = tl_grow((void **)&tl_wide, &tl_wide_cap, (size_t)((M + N) * kb) * sizeof(float)), *b = a + M * kb;
    for (int64_t k0 = 0; k0 < K; k0 += kb) {
        int64_t kn = K - k0 < kb ? K - k0 : kb;
        widen_k_block(dt, transa, transb, M, N, k0, kn, A, lda, B, ldb, a, b);
        fsdp__sgemm(transa, transb, M, N, kn, alpha, a, transa ? M : kn, b, transb ? kn : N, k0 ? 1.0f : beta, C,
                    ldc);
    }
}

/* The key of a 2-D bf16 product (batch 1, no bias), padding zeroed: the
 * cache compares keys with memcmp. */
static struct mm_key mm_key_2d(enum fsdp_dtype dt, int transa, int transb, int64_t M, int64_t N, int64_t K,
                               int64_t lda, int64_t ldb, int64_t ldc, float alpha, float beta) {
    struct mm_key k;
    memset(&k, 0, sizeof k);
    k.dt = (int)dt;
    k.transa = transa != 0;
    k.transb = transb != 0;
    k.in_par = omp_in_parallel();
    k.M = M, k.N = N, k.K = K, k.lda = lda, k.ldb = ldb, k.ldc = ldc, k.batch = 1;
    k.alpha_bits = fbits(alpha);
    k.beta_bits = fbits(beta);
    return k;
}

/* One product of 16-bit (or f32) operands, the 2-D case of fsdp__gemm_lp_batched. */
static void gemm_one(enum fsdp_dtype dt, int transa, int transb, int64_t M, int64_t N, int64_t K, float alpha,
                     const void *A, int64_t lda, const void *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    if (dt == FSDP_F32) {
        fsdp__sgemm(transa, transb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    } else if (K <= 0) { /* no products: C = beta * C */
        for (int64_t r = 0; r < M; r++)
            for (int64_t c = 0; c < N; c++) C[r * ldc + c] = beta == 0.0f ? 0.0f : beta * C[r * ldc + c];
    } else if (!mm_native(dt)) {
        gemm_widen(dt, transa, transb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    } else {
        struct mm_key k = mm_key_2d(dt, transa, transb, M, N, K, lda, ldb, ldc, alpha, beta);
        gemm_onednn(&k, alpha, beta, A, B, NULL, C, NULL);
    }
}

void fsdp__gemm_lp_batched(enum fsdp_dtype dt, int64_t batch, int transa, int transb, int64_t M, int64_t N,
                           int64_t K, float alpha, const void *A, int64_t lda, int64_t sa, const void *B,
                           int64_t ldb, int64_t sb, float beta, float *C, int64_t ldc, int64_t sc) {
    FSDP_ASSERT(dt == FSDP_F32 || dt == FSDP_BF16 || dt == FSDP_F16, "GEMM input dtype %s (want f32, bf16 or f16)",
                fsdp_dtype_name(dt));
    if (batch <= 0 || M <= 0 || N <= 0 || fsdp__measuring) return;
    const char *a = A, *b = B;
    size_t es = fsdp_dtype_size(dt);
    if (batch == 1) { /* not inside a parallel construct: a team of one would make oneDNN nest a new team */
        gemm_one(dt, transa, transb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        return;
    }
    if (!mm_native(dt) || K <= 0) { /* one product per batch entry, threads across them */
#pragma omp parallel for schedule(dynamic, 1) if (!omp_in_parallel())
        for (int64_t i = 0; i < batch; i++)
            gemm_one(dt, transa, transb, M, N, K, alpha, a + (size_t)(i * sa) * es, lda, b + (size_t)(i * sb) * es,
                     ldb, beta, C + i * sc, ldc);
        return;
    }
    /* bf16, batch > 1: one oneDNN matmul over the whole batch, which threads
     * across it; dense (T, hs)-like operands take the AMX brgemm kernels */
    struct mm_key k = mm_key_2d(dt, transa, transb, M, N, K, lda, ldb, ldc, alpha, beta);
    k.batch = batch, k.sa = sa, k.sb = sb, k.sc = sc;
    gemm_onednn(&k, alpha, beta, A, B, NULL, C, NULL);
}

void fsdp__gemm_lp(enum fsdp_dtype dt, int transa, int transb, int64_t M, int64_t N, int64_t K, float alpha,
                   const void *A, int64_t lda, const void *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    fsdp__gemm_lp_batched(dt, 1, transa, transb, M, N, K, alpha, A, lda, 0, B, ldb, 0, beta, C, ldc, 0);
}

void fsdp__gemm_lp_bias(enum fsdp_dtype dt, int transa, int transb, int64_t M, int64_t N, int64_t K, const void *A,
                        int64_t lda, const void *B, int64_t ldb, const float *bias, float *C, int64_t ldc) {
    if (M <= 0 || N <= 0 || fsdp__measuring) return;
    pthread_once(&mm_once, mm_engine_init); /* mm_widen_floats */
    if (dt != FSDP_F32 && !mm_native(dt) && K > 0 && (M + N) * K <= (int64_t)mm_widen_floats) {
        /* widened ([Note: widened products]): both inputs whole in this thread's
         * scratch, then fp32's own product with the bias inside it */
        float *a = tl_grow((void **)&tl_wide, &tl_wide_cap, (size_t)((M + N) * K) * sizeof(float)), *b = a + M * K;
        widen_k_block(dt, transa, transb, M, N, 0, K, A, lda, B, ldb, a, b); /* K whole: one block */
        fsdp__gemm_lp_bias(FSDP_F32, transa, transb, M, N, K, a, transa ? M : K, b, transb ? K : N, bias, C, ldc);
        return;
    }
    if ((dt != FSDP_F32 && !mm_native(dt)) || K <= 0) { /* every row starts as the bias, then C += op(A) op(B) */
#pragma omp parallel for schedule(static) if (!omp_in_parallel())
        for (int64_t i = 0; i < M; i++) memcpy(C + i * ldc, bias, (size_t)N * sizeof(float));
        fsdp__gemm_lp(dt, transa, transb, M, N, K, 1.0f, A, lda, B, ldb, 1.0f, C, ldc);
        return;
    }
    struct mm_key k = mm_key_2d(dt, transa, transb, M, N, K, lda, ldb, ldc, 1.0f, 0.0f);
    k.bias = 1;
    gemm_onednn(&k, 1.0f, 0.0f, A, B, bias, C, NULL);
}

/* [Note: 16-bit output by the kernel] A Linear whose output is wanted in
 * bf16 rounded its fp32 product in a pass of its own ([Note: 16-bit output
 * rounding], linear.c): 33 ms of a GPT-2 bf16 step (1024 tokens, 2 threads),
 * the outputs of c_attn, c_fc and the lm_head. oneDNN's bf16 matmul can
 * write bf16 itself, rounding each fp32 sum to nearest even as the cast does
 * (the same bits: 0 of 3.1 M outputs differed for c_fc; tests/test_nn_bf16.c
 * checks every element against the cast) in the product's own time: c_fc
 * 6.76 ms against 6.62 + 1.02 (mean 7.97), an lm_head block of 2048 columns
 * 4.33 against 4.89, a scratch program, 2 threads. Its gemm-based kernel
 * keeps fp32 sums in its scratchpad, twice the output's fp32 size on two
 * threads (25 MB for c_fc), so the caller gives the scratchpad (the arena,
 * where the memory plan counts it) and asks its size first. Native bf16
 * only: elsewhere fsdp__gemm_lp_out16_scratch says no (SIZE_MAX). */
static struct mm_key out16_key(int transa, int transb, int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb,
                               int64_t ldc, int bias) {
    struct mm_key k = mm_key_2d(FSDP_BF16, transa, transb, M, N, K, lda, ldb, ldc, 1.0f, 0.0f);
    k.bias = bias != 0;
    k.out16 = 1;
    return k;
}

size_t fsdp__gemm_lp_out16_scratch(enum fsdp_dtype dt, int transa, int transb, int64_t M, int64_t N, int64_t K,
                                   int64_t lda, int64_t ldb, int64_t ldc, int bias) {
    if (dt != FSDP_BF16 || !mm_native(dt) || M <= 0 || N <= 0 || K <= 0) return SIZE_MAX;
    struct mm_key k = out16_key(transa, transb, M, N, K, lda, ldb, ldc, bias);
    struct mm_entry tmp;
    int owned;
    const struct mm_entry *e = mm_get(&k, 1.0f, 0.0f, &tmp, &owned);
    size_t bytes = e->scratch_bytes;
    if (owned) dnnl_primitive_destroy(tmp.prim);
    return bytes;
}

void fsdp__gemm_lp_out16(enum fsdp_dtype dt, int transa, int transb, int64_t M, int64_t N, int64_t K, const void *A,
                         int64_t lda, const void *B, int64_t ldb, const float *bias, uint16_t *C, int64_t ldc,
                         void *scratch) {
    FSDP_ASSERT(dt == FSDP_BF16 && mm_native(dt) && K > 0, "a %s product written in bf16 by the kernel needs "
                "native bf16 kernels and K > 0 (K = %lld)", fsdp_dtype_name(dt), (long long)K);
    if (M <= 0 || N <= 0 || fsdp__measuring) return;
    struct mm_key k = out16_key(transa, transb, M, N, K, lda, ldb, ldc, bias != NULL);
    gemm_onednn(&k, 1.0f, 0.0f, A, B, bias, C, scratch);
}

void fsdp__gemm_bf16(int transa, int transb, int64_t M, int64_t N, int64_t K, float alpha, const uint16_t *A,
                     int64_t lda, const uint16_t *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    fsdp__gemm_lp(FSDP_BF16, transa, transb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

int fsdp_gemm_native(enum fsdp_dtype dt) { return dt == FSDP_F32 || mm_native(dt); }

int fsdp__gemm_lp_gemm_based(enum fsdp_dtype dt) { return mm_native(dt) && mm_bf16_gemm; }

int fsdp__gemm_lp_cached(void) {
    pthread_mutex_lock(&mm_lock);
    int n = mm_count;
    pthread_mutex_unlock(&mm_lock);
    return n;
}
