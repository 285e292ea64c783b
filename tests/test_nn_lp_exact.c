/*
 * test_nn_lp_exact.c - the 16-bit layers compute exactly the products of
 * their rounded operands ([Note: compute precision]), natively and widened
 * ([Note: widened products], [Note: widened operands]; tests/run.sh runs
 * this file in every FSDP_GEMM_BF16 mode), each against a double reference
 * that rounds every 16-bit operand where the layer does:
 *  - Linear in bf16/fp16: the forward is the double product of the rounded x
 *    and W, and its dW and dx are those of the rounded dy (dy rounded from
 *    fp32 with a bias, given in 16 bits without one; in blocks of columns
 *    where widened), db the fp32 column sums;
 *  - CausalSelfAttention in bf16/fp16, forward and backward (dx and both
 *    Linears' dW and db), to 1e-5 relative L2 (5e-5 at the longer sequence),
 *    where leaving one rounding out (the heads' output gradient) moves them
 *    by more than 1e-4.
 * (Tolerances against fp32 and the 16-bit hand-off: tests/test_nn_bf16.c.)
 */
#include "core/core-impl.h"
#include "fsdp/fsdp-impl.h"
#include "fsdp.h"
#include "harness.h"
#include "nn/nn-impl.h"
#include "nn_helpers.h"

#include <math.h>

static float round_to(enum fsdp_dtype dt, float x) {
    return dt == FSDP_BF16 ? fsdp__bf16_to_f32(fsdp__f32_to_bf16(x)) : fsdp__f16_to_f32(fsdp__f32_to_f16(x));
}

/* ---- Linear takes 16-bit inputs ---- */

TEST(linear_lowp_is_product_of_rounded_inputs) {
    rng_seed(5);
    enum fsdp_dtype dts[2] = {FSDP_BF16, FSDP_F16};
    for (int d = 0; d < 2; d++) {
        struct fsdp_ctx *ctx = make_ctx();
        struct fsdp_module *m;
        const int64_t I = 48, O = 40, N = 24;
        ASSERT_OK(fsdp__linear_create(ctx, "lin", I, O, 1, 0.02f, &m), ctx);
        ASSERT_OK(fsdp_module_finalize(ctx, m), ctx);
        ASSERT_OK(fsdp_module_materialize(ctx, m, 7), ctx);
        float *w = m->params[0]->data, *b = m->params[1]->data;
        for (int64_t i = 0; i < O * I; i++) w[i] = urand();
        for (int64_t i = 0; i < O; i++) b[i] = urand();
        ASSERT_OK(fsdp_module_set_compute_dtype(ctx, m, dts[d]), ctx);
        float *x = malloc((size_t)(N * I) * sizeof(float));
        for (int64_t i = 0; i < N * I; i++) x[i] = urand();
        struct fsdp_tensor in = {x, FSDP_F32, 2, {N, I}, FSDP_LAYOUT_PLAIN}, out = {0};
        ASSERT_OK(fsdp_module_forward(m, ctx, &in, &out), ctx);
        CHECK_INT_EQ(out.dtype, FSDP_F32);
        const float *y = out.data;
        int bad = 0, differs = 0;
        for (int64_t r = 0; r < N; r++)
            for (int64_t o = 0; o < O; o++) {
                double s = b[o], s32 = b[o], mag = fabs(b[o]);
                for (int64_t k = 0; k < I; k++) {
                    double p = (double)round_to(dts[d], x[r * I + k]) * round_to(dts[d], w[o * I + k]);
                    s += p;
                    mag += fabs(p);
                    s32 += (double)x[r * I + k] * w[o * I + k];
                }
                if (!(fabs(y[r * O + o] - s) <= 1e-5 * mag + 1e-6) && bad++ < 3)
                    TEST_FAILF("%s y[%lld,%lld] %.7g want %.7g", fsdp_dtype_name(dts[d]), (long long)r,
                               (long long)o, (double)y[r * O + o], s);
                differs += fabs(y[r * O + o] - s32) > 1e-6 * mag;
            }
        CHECK_INT_EQ(bad, 0);
        CHECK(differs > N * O / 2); /* the fp32 product is not what ran */
        free(x);
        fsdp_module_free(m);
        fsdp_ctx_free(ctx);
    }
}

/* got (rows, cols) against the double sums over k < K of a[r, k] b[k, c]
 * rounded to dt (a at a[r * ar + k * ak], b at b[c * bc + k * bk]), each
 * within 1e-5 of the sum of magnitudes (every element, or every every-th
 * where checking all would take too long); the count of misses. Over long
 * sums (K = 120000) that bound is wider than what leaving a rounding out
 * moves a sum (about 1e-5 of the magnitudes in bf16, 1e-6 in fp16, growing
 * as sqrt(K)), so each element must also lie nearer the rounded sum than a
 * quarter of its distance from the unrounded one, in 95% of the elements
 * where the two differ: an operand not rounded, or rounded only in part,
 * misses that in most of them. */
static int64_t check_rounded_products_every(const char *what, const float *got, int64_t rows, int64_t cols,
                                            int64_t K, const float *a, int64_t ar, int64_t ak, const float *b,
                                            int64_t bc, int64_t bk, enum fsdp_dtype dt, int64_t every) {
    int64_t bad = 0, apart = 0, far = 0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            if ((r * cols + c) % every) continue;
            double s = 0, mag = 0, s32 = 0;
            for (int64_t k = 0; k < K; k++) {
                double p = (double)round_to(dt, a[r * ar + k * ak]) * round_to(dt, b[c * bc + k * bk]);
                s += p, mag += fabs(p);
                s32 += (double)a[r * ar + k * ak] * b[c * bc + k * bk];
            }
            double g = got[r * cols + c];
            if (!(fabs(g - s) <= 1e-5 * mag + 1e-6) && bad++ < 3)
                TEST_FAILF("%s, %s [%lld, %lld]: %.7g want %.7g", what, fsdp_dtype_name(dt), (long long)r,
                           (long long)c, g, s);
            if (fabs(s - s32) > 1e-7 * mag) {
                apart++;
                far += !(fabs(g - s) <= 0.25 * fabs(s - s32));
            }
        }
    if (far > apart / 20) {
        TEST_FAILF("%s, %s: %lld of %lld elements not near the rounded operands' sums (within a quarter of their "
                   "distance from the unrounded ones')", what,
                   fsdp_dtype_name(dt), (long long)far, (long long)apart);
        bad++;
    }
    return bad;
}

static int64_t check_rounded_products(const char *what, const float *got, int64_t rows, int64_t cols, int64_t K,
                                      const float *a, int64_t ar, int64_t ak, const float *b, int64_t bc,
                                      int64_t bk, enum fsdp_dtype dt) {
    return check_rounded_products_every(what, got, rows, cols, K, a, ar, ak, b, bc, bk, dt, 1);
}

/* The backward of a 16-bit Linear: dW = dy^T x and dx = dy W of the operands
 * rounded to 16 bits (dy rounded from fp32 with a bias, given in 16 bits
 * without one), accumulated in fp32: each element against the double sum;
 * db the column sums of the fp32 dy. Widened (FSDP_GEMM_BF16=widen, and
 * fp16 always) the backward runs over blocks of output columns ([Note:
 * widened backward], linear.c): 64 rows of 120000 outputs take three; and
 * 1024 rows of 3072 inputs and 512 outputs would take two blocks of 256,
 * but dy fits whole beside x, so it runs as two whole products (every
 * 509th element checked there). */
TEST(linear_backward_is_product_of_rounded_operands) {
    rng_seed(41);
    const int64_t shapes[3][3] = {{24, 48, 40}, {64, 16, 120000}, {1024, 3072, 512}}; /* N, I, O */
    for (int c = 0; c < 8; c++) { /* small: bf16/f16 x bias or not; large and whole: bf16 without, f16 with */
        enum fsdp_dtype dt = c % 2 ? FSDP_F16 : FSDP_BF16;
        int big = c < 4 ? 0 : c < 6 ? 1 : 2, bias = big ? c % 2 : c / 2;
        int64_t N = shapes[big][0], I = shapes[big][1], O = shapes[big][2], every = big == 2 ? 509 : 1;
        struct fsdp_ctx *ctx = make_ctx();
        struct fsdp_module *m;
        ASSERT_OK(fsdp__linear_create(ctx, "lin", I, O, bias, 0.02f, &m), ctx);
        ASSERT_OK(fsdp_module_finalize(ctx, m), ctx);
        ASSERT_OK(fsdp_module_materialize(ctx, m, 7), ctx);
        struct fsdp_param *wp = fsdp_module_find_param(m, "weight"), *bp = bias ? fsdp_module_find_param(m, "bias") : NULL;
        float *w = wp->data, *x = malloc((size_t)(N * I) * sizeof(float)), *dy = malloc((size_t)(N * O) * sizeof(float));
        uint16_t *dy16 = malloc((size_t)(N * O) * sizeof(uint16_t));
        ASSERT(x && dy && dy16);
        for (int64_t i = 0; i < O * I; i++) w[i] = urand();
        for (int64_t i = 0; i < N * I; i++) x[i] = urand();
        for (int64_t i = 0; i < N * O; i++) dy[i] = urand();
        fsdp__cvt_from_f32(dt, dy, dy16, (size_t)(N * O));
        ASSERT_OK(fsdp_module_set_compute_dtype(ctx, m, dt), ctx);
        ASSERT_OK(fsdp_module_zero_grad(ctx, m), ctx);
        struct fsdp_tensor in = {x, FSDP_F32, 2, {N, I}, FSDP_LAYOUT_PLAIN}, out = {0}, din = {0};
        ASSERT_OK(fsdp_module_forward(m, ctx, &in, &out), ctx);
        struct fsdp_tensor dout = {bias ? (void *)dy : (void *)dy16, bias ? FSDP_F32 : dt, 2, {N, O},
                                   FSDP_LAYOUT_PLAIN};
        ASSERT_OK(fsdp_module_backward(m, ctx, &dout, &din), ctx);
        char what[96];
        snprintf(what, sizeof what, "%lld x %lld -> %lld, bias %d: dW", (long long)N, (long long)I, (long long)O, bias);
        int64_t bad = check_rounded_products_every(what, wp->grad, O, I, N, dy, 1, O, x, 1, I, dt, every);
        what[strlen(what) - 2] = 0;
        strcat(what, "dx");
        bad += check_rounded_products_every(what, din.data, N, I, O, dy, O, 1, w, 1, I, dt, every);
        for (int64_t o = 0; bp && o < O; o++) {
            double s = 0, mag = 0;
            for (int64_t r = 0; r < N; r++) s += dy[r * O + o], mag += fabs(dy[r * O + o]);
            if (!(fabs(bp->grad[o] - s) <= 1e-5 * mag + 1e-6) && bad++ < 3)
                TEST_FAILF("%s: db[%lld] %.7g want %.7g", fsdp_dtype_name(dt), (long long)o, (double)bp->grad[o], s);
        }
        CHECK_INT_EQ(bad, 0);
        free(x), free(dy), free(dy16);
        fsdp_module_free(m);
        fsdp_ctx_free(ctx);
    }
}

/* One forward (16-bit output when out16, as a hand-off asks) and backward
 * (dy given in 16 bits) of m, its weight read as `src` says: 0 the 16-bit
 * copy FSDP gathered (data_lp), 1 the fp32 values a shard group of one reads
 * in place (data_src: [Note: 16-bit values from the shard]). y, dW and dx
 * are copied out (malloc'd). */
static void linear_pass_from(struct fsdp_ctx *ctx, struct fsdp_module *m, int src, enum fsdp_dtype dt, int out16,
                             const float *w, const uint16_t *w16, const float *x, const uint16_t *dy16, int64_t N,
                             int64_t I, int64_t O, void **y, float **dw, float **dx) {
    struct fsdp_param *p = m->params[0];
    float *own = p->data;
    ASSERT_OK(fsdp_module_zero_grad(ctx, m), ctx);
    p->data = NULL;
    p->priv->data_lp = src ? NULL : w16;
    p->priv->data_src = src ? w : NULL;
    p->priv->data_lp_dtype = dt;
    p->priv->data_stale = 1;
    size_t mark = fsdp_arena_mark(ctx);
    struct fsdp_tensor in = {(void *)x, FSDP_F32, 2, {N, I}, FSDP_LAYOUT_PLAIN}, out = {0}, din = {0};
    out.dtype = out16 ? dt : FSDP_F32;
    ASSERT_OK(fsdp_module_forward(m, ctx, &in, &out), ctx);
    CHECK_INT_EQ(out.dtype, out16 ? dt : FSDP_F32);
    size_t yb = (size_t)(N * O) * fsdp_dtype_size(out.dtype);
    *y = malloc(yb);
    memcpy(*y, out.data, yb);
    struct fsdp_tensor dout = {(void *)dy16, dt, 2, {N, O}, FSDP_LAYOUT_PLAIN};
    ASSERT_OK(fsdp_module_backward(m, ctx, &dout, &din), ctx);
    CHECK(p->data == NULL && p->priv->data_stale == 1); /* read, never widened whole */
    *dw = malloc((size_t)(O * I) * sizeof(float));
    *dx = malloc((size_t)(N * I) * sizeof(float));
    memcpy(*dw, p->grad, (size_t)(O * I) * sizeof(float));
    memcpy(*dx, din.data, (size_t)(N * I) * sizeof(float));
    fsdp_arena_release(ctx, mark);
    p->data = own;
    p->priv->data_lp = NULL;
    p->priv->data_src = NULL;
    p->priv->data_stale = 0;
}

/* [Note: 16-bit values from the shard]: a 16-bit Linear reading its weight's
 * fp32 values (rounding the rows of each block as it reads them: [Note:
 * weight rows by block]) computes the very bits it computes from the
 * gathered 16-bit copy: the forward rounded into 16 bits over three blocks
 * of output columns (4096 rows), and dx = dy W over four blocks of W's rows
 * (256 inputs, 100000 outputs). Every FSDP_GEMM_BF16 mode (tests/run.sh). */
TEST(linear_reads_the_shard_as_the_gathered_copy) {
    rng_seed(43);
    const int64_t shapes[2][4] = {{4096, 16, 3000, 1}, {4, 256, 100000, 0}}; /* N, I, O, out16 */
    for (int c = 0; c < 4; c++) {
        enum fsdp_dtype dt = c % 2 ? FSDP_F16 : FSDP_BF16;
        int64_t N = shapes[c / 2][0], I = shapes[c / 2][1], O = shapes[c / 2][2];
        int out16 = (int)shapes[c / 2][3];
        struct fsdp_ctx *ctx = make_ctx();
        struct fsdp_module *m;
        ASSERT_OK(fsdp__linear_create(ctx, "lin", I, O, 0, 0.02f, &m), ctx);
        ASSERT_OK(fsdp_module_finalize(ctx, m), ctx);
        ASSERT_OK(fsdp_module_materialize(ctx, m, 7), ctx);
        ASSERT_OK(fsdp_module_set_compute_dtype(ctx, m, dt), ctx);
        float *w = m->params[0]->data, *x = malloc((size_t)(N * I) * sizeof(float));
        uint16_t *w16 = malloc((size_t)(O * I) * 2), *dy16 = malloc((size_t)(N * O) * 2);
        ASSERT(x && w16 && dy16);
        for (int64_t i = 0; i < O * I; i++) w[i] = urand();
        for (int64_t i = 0; i < N * I; i++) x[i] = urand();
        for (int64_t i = 0; i < N * O; i++) {
            float v = urand();
            fsdp__cvt_from_f32(dt, &v, dy16 + i, 1);
        }
        fsdp__cvt_from_f32(dt, w, w16, (size_t)(O * I));
        void *y[2];
        float *dw[2], *dx[2];
        for (int src = 0; src < 2; src++)
            linear_pass_from(ctx, m, src, dt, out16, w, w16, x, dy16, N, I, O, &y[src], &dw[src], &dx[src]);
        size_t es = out16 ? fsdp_dtype_size(dt) : sizeof(float);
        if (memcmp(y[0], y[1], (size_t)(N * O) * es) || memcmp(dw[0], dw[1], (size_t)(O * I) * sizeof(float)) ||
            memcmp(dx[0], dx[1], (size_t)(N * I) * sizeof(float)))
            TEST_FAILF("%s, %lld x %lld -> %lld: the shard's rows give other bits than the gathered copy",
                       fsdp_dtype_name(dt), (long long)N, (long long)I, (long long)O);
        /* and they are the products of the rounded weight, not of its fp32 values */
        float *dyf = malloc((size_t)(N * O) * sizeof(float));
        ASSERT(dyf);
        fsdp__cvt_to_f32(dt, dy16, dyf, (size_t)(N * O));
        CHECK_INT_EQ(check_rounded_products("dx from the shard", dx[1], N, I, O, dyf, O, 1, w, 1, I, dt), 0);
        free(dyf);
        for (int k = 0; k < 2; k++) free(y[k]), free(dw[k]), free(dx[k]);
        free(x), free(w16), free(dy16);
        fsdp_module_free(m);
        fsdp_ctx_free(ctx);
    }
}

/* x rounded to dt in float (a value the 16-bit path holds) */
static double rd(enum fsdp_dtype dt, double x) { return round_to(dt, (float)x); }

/* Relative L2 distance of a (float) from b (double). */
static double rel_l2(const float *a, const double *b, int64_t n) {
    double d = 0, s = 0;
    for (int64_t i = 0; i < n; i++) d += (a[i] - b[i]) * (a[i] - b[i]), s += b[i] * b[i];
    return sqrt(d / (s > 0 ? s : 1e-300));
}

/* CausalSelfAttention in 16 bits, in double: every 16-bit operand rounded
 * where the layer rounds it (x, the weights, qkv, the probabilities, the
 * heads' y, dout, the heads' dY unless round_dy is 0, dS, dqkv); the
 * softmax and its backward on the unrounded probabilities. With at F32
 * (c_attn an fp32 module under the 16-bit attention) c_attn multiplies the
 * unrounded x and W and answers qkv in fp32, which the heads round, and its
 * backward takes dqkv unrounded. Fills out (N, C), dx (N, C), dwa (3C, C),
 * dba (3C), dwp (C, C), dbp (C), N = B T. */
static double rda(enum fsdp_dtype at, enum fsdp_dtype dt, double x) { return at == FSDP_F32 ? (double)(float)x : rd(dt, x); }

static void attention_reference(enum fsdp_dtype dt, enum fsdp_dtype at, int64_t B, int64_t T, int64_t C, int nh, const float *x,
                                const float *wa, const float *ba, const float *wp, const float *bp,
                                const float *dout, int round_dy, double *out, double *dx, double *dwa,
                                double *dba, double *dwp, double *dbp) {
    int64_t N = B * T, hs = C / nh, C3 = 3 * C;
    double scale = 1.0 / sqrt((double)hs);
    double *qkv = calloc((size_t)(N * C3), sizeof(double)), *y = calloc((size_t)(N * C), sizeof(double));
    double *p = calloc((size_t)(B * nh * T * T), sizeof(double)), *dy = calloc((size_t)(N * C), sizeof(double));
    double *dqkv = calloc((size_t)(N * C3), sizeof(double));
    for (int64_t r = 0; r < N; r++) /* c_attn, handed off in 16 bits (or in fp32, then rounded by the heads) */
        for (int64_t j = 0; j < C3; j++) {
            double s = ba[j];
            for (int64_t c = 0; c < C; c++) s += rda(at, dt, x[r * C + c]) * rda(at, dt, wa[j * C + c]);
            qkv[r * C3 + j] = rd(dt, s);
        }
    for (int64_t b = 0; b < B; b++)
        for (int h = 0; h < nh; h++) {
            const double *q = qkv + b * T * C3 + h * hs, *k = q + C, *v = q + 2 * C;
            double *P = p + (b * nh + h) * T * T;
            for (int64_t t = 0; t < T; t++) {
                double mx = -1e300, sum = 0;
                for (int64_t u = 0; u <= t; u++) {
                    double s = 0;
                    for (int64_t d = 0; d < hs; d++) s += q[t * C3 + d] * k[u * C3 + d];
                    P[t * T + u] = (double)(float)(scale * s);
                    mx = P[t * T + u] > mx ? P[t * T + u] : mx;
                }
                for (int64_t u = 0; u <= t; u++) sum += P[t * T + u] = exp(P[t * T + u] - mx);
                for (int64_t u = 0; u <= t; u++) P[t * T + u] /= sum;
                for (int64_t d = 0; d < hs; d++) {
                    double s = 0;
                    for (int64_t u = 0; u <= t; u++) s += rd(dt, P[t * T + u]) * v[u * C3 + d];
                    y[(b * T + t) * C + h * hs + d] = rd(dt, s); /* handed to c_proj in 16 bits */
                }
            }
        }
    for (int64_t j = 0; j < C; j++) dbp[j] = 0;
    for (int64_t i = 0; i < C * C; i++) dwp[i] = 0;
    for (int64_t r = 0; r < N; r++)
        for (int64_t j = 0; j < C; j++) { /* c_proj: out, its gradients, and dy = dout W */
            double s = bp[j], g = rd(dt, dout[r * C + j]);
            for (int64_t c = 0; c < C; c++) {
                s += y[r * C + c] * rd(dt, wp[j * C + c]);
                dwp[j * C + c] += g * y[r * C + c];
                dy[r * C + c] += g * rd(dt, wp[j * C + c]);
            }
            out[r * C + j] = s;
            dbp[j] += dout[r * C + j];
        }
    for (int64_t i = 0; i < N * C; i++) dy[i] = round_dy ? rd(dt, dy[i]) : (double)(float)dy[i];
    for (int64_t b = 0; b < B; b++)
        for (int h = 0; h < nh; h++) {
            const double *q = qkv + b * T * C3 + h * hs, *k = q + C, *v = q + 2 * C, *P = p + (b * nh + h) * T * T;
            double *dq = dqkv + b * T * C3 + h * hs, *dk = dq + C, *dv = dq + 2 * C;
            const double *g = dy + b * T * C + h * hs;
            for (int64_t t = 0; t < T; t++) {
                double dp[256], dot = 0;
                for (int64_t u = 0; u <= t; u++) {
                    double s = 0;
                    for (int64_t d = 0; d < hs; d++) s += g[t * C + d] * v[u * C3 + d];
                    dp[u] = (double)(float)s;
                    dot += P[t * T + u] * dp[u];
                }
                for (int64_t u = 0; u <= t; u++) {
                    double ds = rd(dt, P[t * T + u] * (dp[u] - dot));
                    for (int64_t d = 0; d < hs; d++) {
                        dq[t * C3 + d] += scale * ds * k[u * C3 + d];
                        dk[u * C3 + d] += scale * ds * q[t * C3 + d];
                        dv[u * C3 + d] += rd(dt, P[t * T + u]) * g[t * C + d];
                    }
                }
            }
        }
    for (int64_t j = 0; j < C3; j++) dba[j] = 0;
    for (int64_t i = 0; i < C3 * C; i++) dwa[i] = 0;
    for (int64_t i = 0; i < N * C; i++) dx[i] = 0;
    for (int64_t r = 0; r < N; r++)
        for (int64_t j = 0; j < C3; j++) { /* c_attn's backward */
            double g = rda(at, dt, dqkv[r * C3 + j]);
            dba[j] += (float)dqkv[r * C3 + j];
            for (int64_t c = 0; c < C; c++) {
                dwa[j * C + c] += g * rda(at, dt, x[r * C + c]);
                dx[r * C + c] += g * rda(at, dt, wa[j * C + c]);
            }
        }
    free(qkv), free(y), free(p), free(dy), free(dqkv);
}

/* The 16-bit attention computes what the double reference with every 16-bit
 * rounding does (native or widened: [Note: widened operands]), to 1e-5
 * relative L2 per tensor at T = 12 (measured 3e-8 to 6e-7), where leaving
 * the heads' dY unrounded alone moves the gradients by more than 1e-4 (3.1e-3
 * in bf16, 3.4e-4 in f16). T = 12 is one block of [Note: causal blocks],
 * T = 40 two (the edge at 32), checked to 5e-5: with 40 positions a
 * probability or dS whose fp32 value (our exp, our order of sums) and the
 * reference's fall on either side of a bf16 rounding midpoint becomes likely,
 * and one such flip moves dx by about 1e-5 (1.1e-7 in the -O2 build, 1.3e-5
 * in the sanitizer build, whose sums run in another order; f16 5e-6 and
 * 7e-6). Twice more at T = 40 with c_attn an fp32 module: qkv comes to the
 * heads in fp32, and they round it to their 16-bit operands. */
TEST(attention_16bit_is_the_rounded_reference) {
    rng_seed(43);
    const int64_t B = 2, C = 32, Ts[3] = {12, 40, 40};
    const int nh = 2;
    const enum fsdp_dtype dts[2] = {FSDP_BF16, FSDP_F16};
    for (int d = 0; d < 6; d++) { /* the last two: c_attn an fp32 module, qkv handed to the heads in fp32 */
        enum fsdp_dtype dt = dts[d % 2], at = d >= 4 ? FSDP_F32 : dt;
        int64_t T = Ts[d / 2];
        struct fsdp_ctx *ctx = make_ctx();
        struct fsdp_module *m;
        ASSERT_OK(fsdp__attention_create(ctx, "attn", C, nh, 0.02f, &m), ctx);
        ASSERT_OK(fsdp_module_finalize(ctx, m), ctx);
        ASSERT_OK(fsdp_module_materialize(ctx, m, 5), ctx);
        struct fsdp_param *wa = fsdp_module_find_param(m, "c_attn.weight"), *ba = fsdp_module_find_param(m, "c_attn.bias");
        struct fsdp_param *wp = fsdp_module_find_param(m, "c_proj.weight"), *bp = fsdp_module_find_param(m, "c_proj.bias");
        ASSERT(wa && ba && wp && bp);
        struct fsdp_param *ps[4] = {wa, ba, wp, bp};
        for (int i = 0; i < 4; i++)
            for (int64_t j = 0; j < ps[i]->numel; j++) ps[i]->data[j] = 0.5f * urand();
        int64_t N = B * T;
        float *x = malloc((size_t)(N * C) * sizeof(float)), *dout = malloc((size_t)(N * C) * sizeof(float));
        for (int64_t i = 0; i < N * C; i++) x[i] = urand(), dout[i] = urand();
        ASSERT_OK(fsdp_module_set_compute_dtype(ctx, m, dt), ctx);
        ASSERT(m->n_children == 2 && !strcmp(m->children[0]->name, "c_attn"));
        ASSERT_OK(fsdp_module_set_compute_dtype(ctx, m->children[0], at), ctx);
        ASSERT_OK(fsdp_module_zero_grad(ctx, m), ctx);
        struct fsdp_tensor in = {x, FSDP_F32, 3, {B, T, C}, FSDP_LAYOUT_PLAIN}, out = {0}, din = {0};
        ASSERT_OK(fsdp_module_forward(m, ctx, &in, &out), ctx);
        ASSERT_INT_EQ(out.dtype, FSDP_F32);
        struct fsdp_tensor dt_out = {dout, FSDP_F32, 3, {B, T, C}, FSDP_LAYOUT_PLAIN};
        ASSERT_OK(fsdp_module_backward(m, ctx, &dt_out, &din), ctx);
        double *ref[2][6]; /* [round_dy][out, dx, dwa, dba, dwp, dbp] */
        const int64_t n[6] = {N * C, N * C, 3 * C * C, 3 * C, C * C, C};
        for (int r = 0; r < 2; r++) {
            for (int i = 0; i < 6; i++) ref[r][i] = malloc((size_t)n[i] * sizeof(double));
            attention_reference(dt, at, B, T, C, nh, x, wa->data, ba->data, wp->data, bp->data, dout, r, ref[r][0],
                                ref[r][1], ref[r][2], ref[r][3], ref[r][4], ref[r][5]);
        }
        const float *got[6] = {out.data, din.data, wa->grad, ba->grad, wp->grad, bp->grad};
        const char *names[6] = {"output", "dx", "c_attn dW", "c_attn db", "c_proj dW", "c_proj db"};
        double moved = 0, worst = 0;
        for (int i = 0; i < 6; i++) {
            double e = rel_l2(got[i], ref[1][i], n[i]);
            worst = e > worst ? e : worst;
            if (!(e <= (T > 12 ? 5e-5 : 1e-5))) TEST_FAILF("%s %s: relative L2 %.3g from the rounded reference", fsdp_dtype_name(dt), names[i], e);
            float *r0 = malloc((size_t)n[i] * sizeof(float));
            for (int64_t j = 0; j < n[i]; j++) r0[j] = (float)ref[0][i][j];
            double e0 = rel_l2(r0, ref[1][i], n[i]);
            moved = e0 > moved ? e0 : moved;
            free(r0);
        }
        fprintf(stderr, "  %s attention%s, T %lld: worst relative L2 %.2e from the rounded reference; dY unrounded "
                "moves it %.2e\n", fsdp_dtype_name(dt), at == dt ? "" : " (c_attn fp32)", (long long)T, worst, moved);
        CHECK(moved > 1e-4); /* the check sees the heads' dY rounding */
        for (int r = 0; r < 2; r++)
            for (int i = 0; i < 6; i++) free(ref[r][i]);
        free(x), free(dout);
        fsdp_module_free(m);
        fsdp_ctx_free(ctx);
    }
}

TEST_MAIN()
