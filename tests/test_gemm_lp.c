/*
 * test_gemm_lp.c - the 16-bit products of src/nn/gemm_lp.c against double
 * products of the same 16-bit inputs (so only fp32 accumulation error is
 * allowed: 1e-5 of the row's magnitude); tests/run.sh runs it twice, with
 * native bf16 kernels where the CPU has them and with FSDP_GEMM_BF16=widen:
 *  - fsdp__gemm_lp in bf16 (oneDNN matmul) and fp16 (widened sgemm) for
 *    every transpose pair, leading dimensions wider than the matrix, alpha,
 *    beta, and calls from inside an OpenMP parallel region; widened over
 *    several blocks of K;
 *  - the same with a bias row added (fsdp__gemm_lp_bias), widened whole or
 *    in blocks of K;
 *  - batched products (fsdp__gemm_lp_batched, attention's heads) entry by
 *    entry, strides with gaps left untouched;
 *  - the column sums of a Linear's output gradient with its 16-bit copy
 *    (fsdp__colsum_add), ragged shapes, in row chunks on any team size.
 */
#include "core/core-impl.h"
#include "fsdp.h"
#include "harness.h"
#include "nn/nn-impl.h"
#include "nn_helpers.h"

#include <math.h>
#include <omp.h>

static float round_to(enum fsdp_dtype dt, float x) {
    return dt == FSDP_BF16 ? fsdp__bf16_to_f32(fsdp__f32_to_bf16(x)) : fsdp__f16_to_f32(fsdp__f32_to_f16(x));
}

/* One product C (M, N) = alpha op(A) op(B) + beta C0 with 16-bit A, B of the
 * given leading dimensions, checked against double. Returns mismatches. */
static int check_gemm_b(enum fsdp_dtype dt, int ta, int tb, int64_t M, int64_t N, int64_t K, int64_t pad, float alpha,
                        float beta, int in_parallel, int with_bias) {
    int64_t ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
    int64_t lda = ac + pad, ldb = bc + pad, ldc = N + pad;
    uint16_t *A = malloc((size_t)(ar * lda) * 2), *B = malloc((size_t)(br * ldb) * 2);
    float *C = malloc((size_t)(M * ldc) * 4), *C0 = malloc((size_t)(M * ldc) * 4);
    for (int64_t i = 0; i < ar * lda; i++) A[i] = 0xffff; /* NaN padding: must never be read */
    for (int64_t i = 0; i < br * ldb; i++) B[i] = 0xffff;
    for (int64_t i = 0; i < ar; i++)
        for (int64_t j = 0; j < ac; j++) {
            float v = urand();
            A[i * lda + j] = dt == FSDP_BF16 ? fsdp__f32_to_bf16(v) : fsdp__f32_to_f16(v);
        }
    for (int64_t i = 0; i < br; i++)
        for (int64_t j = 0; j < bc; j++) {
            float v = urand();
            B[i * ldb + j] = dt == FSDP_BF16 ? fsdp__f32_to_bf16(v) : fsdp__f32_to_f16(v);
        }
    for (int64_t i = 0; i < M * ldc; i++) C0[i] = C[i] = urand();
    if (beta == 0.0f)
        for (int64_t i = 0; i < M * ldc; i++) C[i] = NAN; /* beta 0 ignores C */
    float *bias = with_bias ? malloc((size_t)N * 4) : NULL; /* with a bias: alpha 1, beta 0 */
    for (int64_t j = 0; with_bias && j < N; j++) bias[j] = urand();
#pragma omp parallel num_threads(2) if (in_parallel)
    if (omp_get_thread_num() == 0) {
        if (with_bias) fsdp__gemm_lp_bias(dt, ta, tb, M, N, K, A, lda, B, ldb, bias, C, ldc);
        else fsdp__gemm_lp(dt, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    }
    int bad = 0;
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double s = 0, mag = 0;
            for (int64_t k = 0; k < K; k++) {
                uint16_t a = ta ? A[k * lda + i] : A[i * lda + k], b = tb ? B[j * ldb + k] : B[k * ldb + j];
                double av = dt == FSDP_BF16 ? fsdp__bf16_to_f32(a) : fsdp__f16_to_f32(a);
                double bv = dt == FSDP_BF16 ? fsdp__bf16_to_f32(b) : fsdp__f16_to_f32(b);
                s += av * bv;
                mag += fabs(av * bv);
            }
            double want = alpha * s + (beta != 0.0f ? beta * C0[i * ldc + j] : 0.0) + (with_bias ? bias[j] : 0.0);
            double tol = 1e-5 * (fabs(alpha) * mag + fabs(beta * C0[i * ldc + j]) + (with_bias ? fabs(bias[j]) : 0.0)) + 1e-6;
            if (!(fabs(C[i * ldc + j] - want) <= tol) && bad++ < 3)
                TEST_FAILF("%s %c%c M%lld N%lld K%lld pad %lld alpha %g beta %g par %d: C[%lld,%lld] %.7g want %.7g",
                           fsdp_dtype_name(dt), ta ? 'T' : 'N', tb ? 'T' : 'N', (long long)M, (long long)N,
                           (long long)K, (long long)pad, (double)alpha, (double)beta, in_parallel, (long long)i,
                           (long long)j, (double)C[i * ldc + j], want);
        }
    const float qnan = NAN; /* what beta 0 filled C with */
    for (int64_t i = 0; i < M; i++) /* the padding columns of C are untouched */
        for (int64_t j = N; j < ldc; j++)
            if (memcmp(&C[i * ldc + j], beta == 0.0f ? &qnan : &C0[i * ldc + j], 4) != 0) bad++;
    free(A);
    free(B);
    free(C);
    free(C0);
    free(bias);
    return bad;
}

static int check_gemm(enum fsdp_dtype dt, int ta, int tb, int64_t M, int64_t N, int64_t K, int64_t pad, float alpha,
                      float beta, int in_parallel) {
    return check_gemm_b(dt, ta, tb, M, N, K, pad, alpha, beta, in_parallel, 0);
}

TEST(gemm_lp_matches_double_on_16bit_inputs) {
    rng_seed(3);
    enum fsdp_dtype dts[2] = {FSDP_BF16, FSDP_F16};
    for (int d = 0; d < 2; d++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++) {
                CHECK_INT_EQ(check_gemm(dts[d], ta, tb, 37, 29, 61, 0, 1.0f, 0.0f, 0), 0);
                CHECK_INT_EQ(check_gemm(dts[d], ta, tb, 64, 48, 96, 5, 0.125f, 1.0f, 0), 0);
                CHECK_INT_EQ(check_gemm(dts[d], ta, tb, 33, 40, 16, 3, -2.0f, 0.5f, 1), 0);
            }
    CHECK_INT_EQ(check_gemm(FSDP_BF16, 0, 1, 256, 384, 128, 0, 1.0f, 1.0f, 0), 0); /* a Linear-sized one */
    CHECK_INT_EQ(check_gemm(FSDP_BF16, 0, 0, 5, 7, 0, 0, 1.0f, 0.5f, 0), 0);       /* K = 0: C = beta C */

    int before = fsdp__gemm_lp_cached();
    if (fsdp_gemm_native(FSDP_BF16)) CHECK(before > 0); /* the products above made primitives (none widened) */
    CHECK_INT_EQ(check_gemm(FSDP_BF16, 0, 1, 256, 384, 128, 0, 1.0f, 1.0f, 0), 0); /* cached: no new primitive */
    CHECK_INT_EQ(fsdp__gemm_lp_cached(), before);
}

/* Widened products over several blocks of K: 64 KiB of scratch (set before
 * this process's first product) is 16384 floats, 2048 columns of K for
 * M + N = 8, so K = 5000 takes three blocks (the first with beta, the others
 * adding) and K = 3000 with M + N = 100 the 256-column minimum. */
TEST(widened_products_in_blocks_of_k) {
    setenv("FSDP_WIDEN_SCRATCH", "65536", 1);
    rng_seed(5);
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            CHECK_INT_EQ(check_gemm(FSDP_F16, ta, tb, 3, 5, 5000, 2, 0.5f, ta == tb ? 0.0f : 1.0f, 0), 0);
            CHECK_INT_EQ(check_gemm(FSDP_F16, ta, tb, 60, 40, 3000, 1, 1.0f, 1.0f, ta), 0);
        }
}

/* The product with a bias row added (the Linear forward's): oneDNN's matmul
 * with the bias inside for native bf16; widened, both inputs whole in fp32
 * and fp32's own biased product when they fit the scratch (64 KiB here: 16384
 * floats, (M + N) K = 4026 and 10368), else every row set to the bias and
 * the products added block by block of K (60 + 40 rows, K = 300). */
TEST(gemm_lp_bias_matches_double) {
    setenv("FSDP_WIDEN_SCRATCH", "65536", 1);
    rng_seed(6);
    enum fsdp_dtype dts[2] = {FSDP_BF16, FSDP_F16};
    for (int d = 0; d < 2; d++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++) {
                CHECK_INT_EQ(check_gemm_b(dts[d], ta, tb, 37, 29, 61, 0, 1.0f, 0.0f, 0, 1), 0);
                CHECK_INT_EQ(check_gemm_b(dts[d], ta, tb, 64, 48, 96, 5, 1.0f, 0.0f, 1, 1), 0);
                CHECK_INT_EQ(check_gemm_b(dts[d], ta, tb, 60, 40, 300, 3, 1.0f, 0.0f, ta, 1), 0);
            }
}

/* Batched products (attention's heads): entry i of a batch with gaps between
 * the entries (strides past the matrix) equals the double product of its
 * 16-bit inputs, for every transpose pair, in bf16 (one oneDNN matmul), f16
 * and f32 (per-entry loops); the gaps are untouched. Returns mismatches. */
static int check_batched(enum fsdp_dtype dt, int ta, int tb, int64_t batch, int64_t M, int64_t N, int64_t K,
                         float alpha, float beta) {
    int64_t ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
    int64_t sa = ar * ac + 3, sb = br * bc + 5, sc = M * N + 7, es = (int64_t)fsdp_dtype_size(dt);
    unsigned char *A = malloc((size_t)(batch * sa * es)), *B = malloc((size_t)(batch * sb * es));
    double *Ad = malloc((size_t)(batch * sa) * sizeof(double)), *Bd = malloc((size_t)(batch * sb) * sizeof(double));
    float *C = malloc((size_t)(batch * sc) * 4), *C0 = malloc((size_t)(batch * sc) * 4);
    for (int64_t i = 0; i < batch * sa; i++) {
        float v = urand();
        Ad[i] = dt == FSDP_F32 ? v : round_to(dt, v);
        if (dt == FSDP_F32) ((float *)(void *)A)[i] = v;
        else ((uint16_t *)(void *)A)[i] = dt == FSDP_BF16 ? fsdp__f32_to_bf16(v) : fsdp__f32_to_f16(v);
    }
    for (int64_t i = 0; i < batch * sb; i++) {
        float v = urand();
        Bd[i] = dt == FSDP_F32 ? v : round_to(dt, v);
        if (dt == FSDP_F32) ((float *)(void *)B)[i] = v;
        else ((uint16_t *)(void *)B)[i] = dt == FSDP_BF16 ? fsdp__f32_to_bf16(v) : fsdp__f32_to_f16(v);
    }
    for (int64_t i = 0; i < batch * sc; i++) C0[i] = C[i] = urand();
    fsdp__gemm_lp_batched(dt, batch, ta, tb, M, N, K, alpha, A, ac, sa, B, bc, sb, beta, C, N, sc);
    int bad = 0;
    for (int64_t e = 0; e < batch; e++)
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) {
                const double *a = Ad + e * sa, *b = Bd + e * sb;
                double s = 0, mag = 0;
                for (int64_t k = 0; k < K; k++) {
                    double p = (ta ? a[k * ac + i] : a[i * ac + k]) * (tb ? b[j * bc + k] : b[k * bc + j]);
                    s += p;
                    mag += fabs(p);
                }
                float c0 = C0[e * sc + i * N + j], got = C[e * sc + i * N + j];
                double want = alpha * s + beta * c0, tol = 1e-5 * (fabs(alpha) * mag + fabs(beta * c0)) + 1e-6;
                if (!(fabs(got - want) <= tol) && bad++ < 3)
                    TEST_FAILF("%s batch %lld %c%c M%lld N%lld K%lld: entry %lld C[%lld,%lld] %.7g want %.7g",
                               fsdp_dtype_name(dt), (long long)batch, ta ? 'T' : 'N', tb ? 'T' : 'N', (long long)M,
                               (long long)N, (long long)K, (long long)e, (long long)i, (long long)j, (double)got,
                               want);
            }
    for (int64_t e = 0; e < batch; e++) /* the gap after each entry's C */
        for (int64_t i = M * N; i < sc; i++)
            if (memcmp(&C[e * sc + i], &C0[e * sc + i], 4) != 0) bad++;
    free(A);
    free(B);
    free(Ad);
    free(Bd);
    free(C);
    free(C0);
    return bad;
}

TEST(gemm_lp_batched_matches_double_per_entry) {
    rng_seed(4);
    enum fsdp_dtype dts[3] = {FSDP_BF16, FSDP_F16, FSDP_F32};
    for (int d = 0; d < 3; d++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++) {
                CHECK_INT_EQ(check_batched(dts[d], ta, tb, 6, 32, 16, 24, 0.125f, 0.0f), 0);
                CHECK_INT_EQ(check_batched(dts[d], ta, tb, 3, 17, 9, 40, -1.0f, 0.5f), 0);
            }
    CHECK_INT_EQ(check_batched(FSDP_BF16, 0, 1, 1, 20, 12, 8, 1.0f, 1.0f), 0); /* a batch of one */
}

/* fsdp__colsum_add: db += the column sums (fp32: chunks of COLSUM_ROWS rows,
 * each column in row order from zero, the chunks' sums then added in chunk
 * order from zero, then added to db) and xl = x rounded (or no copy, fp32),
 * for ragged shapes (one chunk and several, a partial last one), on teams of
 * 1, 2 and 3 threads: the same bits on each. */
TEST(colsum_sums_columns_in_row_chunks_and_rounds) {
    rng_seed(8);
    struct fsdp_ctx *ctx = make_ctx();
    const int64_t shapes[][2] = {{1, 1}, {7, 9}, {8, 8}, {9, 16}, {37, 45}, {64, 40}, {23, 4100}, {97, 300}};
    enum fsdp_dtype dts[3] = {FSDP_BF16, FSDP_F16, FSDP_F32};
    int threads[3] = {1, 2, 3}, saved = omp_get_max_threads();
    for (int d = 0; d < 3; d++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            for (int t = 0; t < 3; t++) {
                int64_t R = shapes[s][0], C = shapes[s][1];
                float *x = malloc((size_t)(R * C) * 4), *db = malloc((size_t)C * 4);
                uint16_t *xl = malloc((size_t)(R * C) * 2);
                for (int64_t i = 0; i < R * C; i++) x[i] = urand();
                for (int64_t c = 0; c < C; c++) db[c] = (float)c;
                omp_set_num_threads(threads[t]);
                size_t mark = fsdp_arena_mark(ctx);
                CHECK_INT_EQ(fsdp__colsum_add(ctx, x, R, C, db, dts[d], dts[d] == FSDP_F32 ? NULL : xl), FSDP_OK);
                CHECK(fsdp_arena_mark(ctx) == mark); /* its scratch released */
                int bad = 0;
                for (int64_t c = 0; c < C; c++) {
                    float sum = 0.0f;
                    for (int64_t k = 0; k * COLSUM_ROWS < R; k++) {
                        float acc = 0.0f;
                        for (int64_t i = k * COLSUM_ROWS; i < R && i < (k + 1) * COLSUM_ROWS; i++) acc += x[i * C + c];
                        sum += acc;
                    }
                    bad += db[c] != (float)c + sum;
                }
                for (int64_t i = 0; dts[d] != FSDP_F32 && i < R; i++)
                    for (int64_t c = 0; c < C; c++) {
                        uint16_t want =
                            dts[d] == FSDP_BF16 ? fsdp__f32_to_bf16(x[i * C + c]) : fsdp__f32_to_f16(x[i * C + c]);
                        bad += xl[i * C + c] != want;
                    }
                if (bad)
                    TEST_FAILF("%s, %lld x %lld, %d threads: %d wrong values", fsdp_dtype_name(dts[d]), (long long)R,
                               (long long)C, threads[t], bad);
                free(x), free(db), free(xl);
            }
    omp_set_num_threads(saved);
    fsdp_ctx_free(ctx);
}

TEST_MAIN()
