/*
 * test_gemm.c - the public fsdp_gemm for custom modules: every transpose
 * pair, strides wider than the matrices, alpha and beta, against a double
 * product: in fp32 (m NULL, or a module computing in fp32) within 1e-5 of
 * the row's magnitude; in the module's bf16 / fp16 compute dtype against the
 * double product of the inputs rounded to 16 bits (so it really takes
 * 16-bit inputs), the arena left as it was; bad arguments named.
 */
#include "fsdp.h"
#include "harness.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static struct fsdp_ctx *make_ctx(void) {
    struct fsdp_ctx_opts o = fsdp_ctx_opts_default();
    o.threads = 1;
    o.comm = FSDP_COMM_SELF;
    struct fsdp_ctx *c;
    if (fsdp_ctx_create(&o, &c) != FSDP_OK) abort();
    return c;
}

static float round16(enum fsdp_dtype dt, float x) {
    if (dt == FSDP_F32) return x;
    if (dt == FSDP_F16) return (float)(_Float16)x;
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&x, &u, sizeof x);
    return x;
}

static const struct fsdp_module_ops noop_ops = {"Noop", NULL, NULL, NULL};

/* C = alpha op(A) op(B) + beta C at dt, checked against double. */
static void check(struct fsdp_ctx *c, enum fsdp_dtype dt, int ta, int tb, float alpha, float beta) {
    const int64_t M = 7, N = 9, K = 13, pad = 3;
    int64_t ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
    int64_t lda = ac + pad, ldb = bc + pad, ldc = N + pad;
    float *A = malloc((size_t)(ar * lda) * sizeof(float)), *B = malloc((size_t)(br * ldb) * sizeof(float));
    float *C = malloc((size_t)(M * ldc) * sizeof(float));
    for (int64_t i = 0; i < ar * lda; i++) A[i] = sinf(0.7f * (float)i + 0.1f);
    for (int64_t i = 0; i < br * ldb; i++) B[i] = cosf(0.3f * (float)i - 0.2f);
    for (int64_t i = 0; i < M * ldc; i++) C[i] = (float)(i % 5) - 2.0f;
    double *want = malloc((size_t)(M * N) * sizeof(double));
    double scale = 0;
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double s = 0;
            for (int64_t k = 0; k < K; k++) {
                float a = ta ? A[k * lda + i] : A[i * lda + k], b = tb ? B[j * ldb + k] : B[k * ldb + j];
                s += (double)round16(dt, a) * round16(dt, b);
                scale += fabs((double)a * b);
            }
            want[i * N + j] = alpha * s + beta * C[i * ldc + j];
        }
    struct fsdp_module *m = NULL;
    if (dt != FSDP_F32 || ta) { /* fp32: a module computing in fp32, or none (m NULL) */
        if (fsdp_module_create(c, &noop_ops, "mine", &m) != FSDP_OK) abort();
        if (fsdp_module_set_compute_dtype(c, m, dt) != FSDP_OK) abort();
    }
    size_t mark = fsdp_arena_mark(c);
    CHECK_OK(fsdp_gemm(c, m, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc), c);
    CHECK_INT_EQ(fsdp_arena_mark(c), mark);
    scale /= (double)(M * N);
    for (int64_t i = 0; i < M; i++) {
        for (int64_t j = 0; j < N; j++)
            if (!(fabs(C[i * ldc + j] - want[i * N + j]) <= 1e-5 * (scale + 1)))
                TEST_FAILF("%s ta %d tb %d alpha %g beta %g: C[%lld][%lld] = %.9g, want %.9g", fsdp_dtype_name(dt),
                           ta, tb, (double)alpha, (double)beta, (long long)i, (long long)j, (double)C[i * ldc + j],
                           want[i * N + j]);
        for (int64_t j = N; j < ldc; j++) /* the stride's gap is not written */
            CHECK(C[i * ldc + j] == (float)((i * ldc + j) % 5) - 2.0f);
    }
    fsdp_module_free(m);
    free(A);
    free(B);
    free(C);
    free(want);
}

TEST(gemm_every_transpose_and_dtype_matches_double) {
    struct fsdp_ctx *c = make_ctx();
    const enum fsdp_dtype dts[] = {FSDP_F32, FSDP_BF16, FSDP_F16};
    for (int d = 0; d < 3; d++)
        for (int t = 0; t < 4; t++) {
            check(c, dts[d], t & 1, t >> 1, 1.0f, 0.0f);
            check(c, dts[d], t & 1, t >> 1, -0.5f, 1.5f);
        }
    fsdp_ctx_free(c);
}

/* The 16-bit path really rounds its inputs: it differs from fp32. */
TEST(gemm_bf16_differs_from_fp32) {
    struct fsdp_ctx *c = make_ctx();
    struct fsdp_module *m;
    ASSERT_OK(fsdp_module_create(c, &noop_ops, "mine", &m), c);
    ASSERT_OK(fsdp_module_set_compute_dtype(c, m, FSDP_BF16), c);
    float a[4] = {1.001f, 0.3f, 0.7f, 0.1234567f}, b[4] = {0.999f, 0.3333333f, 0.9f, 0.7654321f}, x = 0, y = 0;
    ASSERT_OK(fsdp_gemm(c, NULL, 0, 0, 1, 1, 4, 1.0f, a, 4, b, 1, 0.0f, &x, 1), c);
    ASSERT_OK(fsdp_gemm(c, m, 0, 0, 1, 1, 4, 1.0f, a, 4, b, 1, 0.0f, &y, 1), c);
    CHECK(x != y);
    fsdp_module_free(m);
    fsdp_ctx_free(c);
}

TEST(gemm_bad_arguments_named) {
    struct fsdp_ctx *c = make_ctx();
    struct fsdp_module *m;
    ASSERT_OK(fsdp_module_create(c, &noop_ops, "mine", &m), c);
    float a[4] = {0}, b[4] = {0}, d[4] = {0};
    CHECK_INT_EQ(fsdp_gemm(c, m, 0, 0, 2, 2, 2, 1.0f, a, 1, b, 2, 0.0f, d, 2), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "fsdp_gemm in 'mine': strides lda 1");
    CHECK_INT_EQ(fsdp_gemm(c, m, 0, 0, -1, 2, 2, 1.0f, a, 2, b, 2, 0.0f, d, 2), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "M -1");
    CHECK_INT_EQ(fsdp_gemm(c, NULL, 0, 0, 2, 2, 2, 1.0f, NULL, 2, b, 2, 0.0f, d, 2), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(c), "NULL matrix");
    fsdp_module_free(m);
    fsdp_ctx_free(c);
}

TEST_MAIN()
