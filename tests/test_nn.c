/*
 * test_nn.c - the layers of src/nn: a central finite-difference gradient
 * check for every layer's backward (input and parameter gradients), the
 * fast exp and the softmax rows against their references, and the module
 * tree's buffers and training mode. The GPT module tree (nanoGPT's FQNs,
 * weight tying, input errors, the comparison with nanoGPT in torch):
 * tests/test_nn_gpt.c; the GPT configuration (presets, JSON loading):
 * tests/test_gpt_config.c.
 *
 * [Note: FD checks] The loss is L = sum(out * r) with fixed random r (or the
 * mean cross-entropy, computed here in double), evaluated in double from
 * float32 outputs; the analytic gradient comes from backward with dout = r.
 * Central differences with eps 1e-2 on a random subset of coordinates; a
 * coordinate passes when |analytic - fd| <= atol + rtol * max(|analytic|, |fd|).
 * Float32 rounding of L divided by 2 eps sets the noise floor (about 1e-5),
 * so atol sits above it; tolerances are stated per layer below.
 */
#include "core/core-impl.h"
#include "fsdp.h"
#include "harness.h"
#include "nn_helpers.h"
#include "nn/nn-impl.h"
#include "plist.h"

#include <float.h>

/* ---- helpers ---- */

static struct fsdp_tensor make_ids(int ndim, const int64_t *shape, int64_t num) {
    struct fsdp_tensor t = {0};
    t.dtype = FSDP_I32;
    t.ndim = ndim;
    memcpy(t.shape, shape, (size_t)ndim * sizeof(int64_t));
    int64_t n = fsdp_tensor_numel(&t);
    int32_t *x = malloc((size_t)n * sizeof(int32_t));
    for (int64_t i = 0; i < n; i++) x[i] = (int32_t)irand(num);
    t.data = x;
    return t;
}

/* Mean cross-entropy over rows of logits (N, V), in double. */
static double ce_double(const float *logits, const int32_t *targets, int64_t N, int64_t V) {
    double total = 0.0;
    for (int64_t i = 0; i < N; i++) {
        const float *l = logits + i * V;
        double mx = l[0], s = 0.0;
        for (int64_t j = 1; j < V; j++) mx = l[j] > mx ? l[j] : mx;
        for (int64_t j = 0; j < V; j++) s += exp((double)l[j] - mx);
        total += mx + log(s) - (double)l[targets[i]];
    }
    return total / (double)N;
}

/* One gradient check: module m on input `in`; the loss is sum(out * r), or
 * the mean cross-entropy against `targets` (out is then (..., V)). */
struct gc {
    const char *name;
    struct fsdp_ctx *ctx;
    struct fsdp_module *m;
    struct fsdp_tensor *in;
    const int32_t *targets; /* NULL: weighted-sum loss */
    double eps, rtol, atol;
    int coords;             /* coordinates checked per tensor (all if fewer) */
    float *r;               /* (numel out) weights of the sum loss */
    int64_t nout, V;
    int failures;
};

static double gc_loss(struct gc *g) {
    fsdp_arena_reset(g->ctx);
    struct fsdp_tensor out = {0};
    enum fsdp_status st = fsdp_module_forward(g->m, g->ctx, g->in, &out);
    if (st != FSDP_OK) {
        TEST_FAILF("%s: forward: %s", g->name, fsdp_errmsg(g->ctx));
        return NAN;
    }
    const float *y = out.data;
    if (g->targets) return ce_double(y, g->targets, g->nout / g->V, g->V);
    double L = 0.0;
    for (int64_t i = 0; i < g->nout; i++) L += (double)y[i] * (double)g->r[i];
    return L;
}

static void gc_compare(struct gc *g, const char *what, int64_t idx, double analytic, double fd) {
    double tol = g->atol + g->rtol * fmax(fabs(analytic), fabs(fd));
    if (!(fabs(analytic - fd) <= tol)) {
        if (g->failures < 8)
            TEST_FAILF("%s: d/d %s[%lld]: analytic %.7g vs finite difference %.7g (diff %.3g > tol %.3g)", g->name,
                       what, (long long)idx, analytic, fd, fabs(analytic - fd), tol);
        else test_failed_flag = 1;
        g->failures++;
    }
}

/* FD over `coords` random coordinates of x (n floats); grad is the analytic
 * gradient. */
static void gc_check_tensor(struct gc *g, const char *what, float *x, const float *grad, int64_t n) {
    int64_t k = n <= g->coords ? n : g->coords;
    for (int64_t c = 0; c < k; c++) {
        int64_t i = n <= g->coords ? c : irand(n);
        float x0 = x[i];
        x[i] = x0 + (float)g->eps;
        double lp = gc_loss(g);
        x[i] = x0 - (float)g->eps;
        double lm = gc_loss(g);
        x[i] = x0;
        double h = (double)(x0 + (float)g->eps) - (double)(x0 - (float)g->eps); /* the step actually taken */
        gc_compare(g, what, i, grad[i], (lp - lm) / h);
    }
}

static void gradcheck(struct gc *g) {
    struct fsdp_ctx *ctx = g->ctx;
    ASSERT_OK(fsdp_module_zero_grad(ctx, g->m), ctx);
    fsdp_arena_reset(ctx);
    struct fsdp_tensor out = {0};
    ASSERT_OK(fsdp_module_forward(g->m, ctx, g->in, &out), ctx);
    g->nout = fsdp_tensor_numel(&out);
    g->V = out.shape[out.ndim - 1];
    float *dy = malloc((size_t)g->nout * sizeof(float));
    if (g->targets) {
        float loss = 0.0f;
        int64_t N = g->nout / g->V;
        ASSERT_OK(fsdp_cross_entropy(ctx, out.data, g->targets, N, g->V, 1.0f, &loss, dy), ctx);
        CHECK_NEAR(loss, ce_double(out.data, g->targets, N, g->V), 1e-6, 0.0);
    } else {
        g->r = malloc((size_t)g->nout * sizeof(float));
        for (int64_t i = 0; i < g->nout; i++) g->r[i] = urand();
        memcpy(dy, g->r, (size_t)g->nout * sizeof(float));
    }
    struct fsdp_tensor dout = out, din = {0};
    dout.data = dy;
    int has_dx = g->in->dtype == FSDP_F32;
    ASSERT_OK(fsdp_module_backward(g->m, ctx, &dout, has_dx ? &din : NULL), ctx);
    float *dx = NULL;
    if (has_dx) {
        int64_t nin = fsdp_tensor_numel(g->in);
        ASSERT_INT_EQ(fsdp_tensor_numel(&din), nin);
        ASSERT_INT_EQ(din.dtype, FSDP_F32);
        dx = malloc((size_t)nin * sizeof(float));
        memcpy(dx, din.data, (size_t)nin * sizeof(float));
        gc_check_tensor(g, "input", g->in->data, dx, nin);
    }
    struct plist pl = {0};
    fsdp_module_foreach_param(g->m, collect_param, &pl);
    for (int i = 0; i < pl.n; i++)
        gc_check_tensor(g, pl.p[i]->fqn, pl.p[i]->data, pl.p[i]->grad, pl.p[i]->numel);
    plist_free(&pl);
    free(dx);
    free(dy);
    free(g->r);
    g->r = NULL;
}

/* ---- finite-difference checks, one per layer ---- */

TEST(gradcheck_linear) { /* linear in x and W: only rounding noise; rtol 1e-3, atol 1e-4 */
    rng_seed(1);
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_module *m;
    ASSERT_OK(fsdp__linear_create(ctx, "lin", 7, 5, 1, 0.02f, &m), ctx);
    prepare(ctx, m, 0.5f);
    int64_t shape[3] = {2, 3, 7};
    struct fsdp_tensor x = make_input(3, shape, 1.0f, 0.0f);
    struct gc g = {.name = "Linear", .ctx = ctx, .m = m, .in = &x, .eps = 1e-2, .rtol = 1e-3, .atol = 1e-4, .coords = 1000};
    gradcheck(&g);
    /* without bias, and a 2-D input */
    struct fsdp_module *m2;
    ASSERT_OK(fsdp__linear_create(ctx, "nobias", 4, 6, 0, 0.02f, &m2), ctx);
    prepare(ctx, m2, 0.5f);
    CHECK_INT_EQ(m2->n_params, 1);
    int64_t s2[2] = {5, 4};
    struct fsdp_tensor x2 = make_input(2, s2, 1.0f, 0.0f);
    struct gc g2 = {.name = "Linear(no bias)", .ctx = ctx, .m = m2, .in = &x2, .eps = 1e-2, .rtol = 1e-3, .atol = 1e-4, .coords = 1000};
    gradcheck(&g2);
    free(x.data);
    free(x2.data);
    fsdp_module_free(m);
    fsdp_module_free(m2);
    fsdp_ctx_free(ctx);
}

TEST(gradcheck_embedding) { /* ids repeat, so rows accumulate; linear: rtol 1e-3, atol 1e-4 */
    rng_seed(2);
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_module *m;
    ASSERT_OK(fsdp__embedding_create(ctx, "emb", 6, 5, 0.02f, &m), ctx);
    prepare(ctx, m, 0.5f);
    int64_t shape[2] = {3, 4}; /* 12 ids over 6 rows: repeats certain */
    struct fsdp_tensor ids = make_ids(2, shape, 6);
    struct gc g = {.name = "Embedding", .ctx = ctx, .m = m, .in = &ids, .eps = 1e-2, .rtol = 1e-3, .atol = 1e-4, .coords = 1000};
    gradcheck(&g);
    fsdp_arena_reset(ctx);
    struct fsdp_tensor out = {0};
    ASSERT_OK(fsdp_module_forward(m, ctx, &ids, &out), ctx);
    CHECK_INT_EQ(out.ndim, 3);
    CHECK_INT_EQ(out.shape[2], 5);
    free(ids.data);
    fsdp_module_free(m);
    fsdp_ctx_free(ctx);
}

/* 6 rows are one chunk of [Note: column sums in row chunks], 70 rows three (the last partial) */
TEST(gradcheck_layernorm) { /* smooth; rtol 1e-2, atol 1e-4 */
    rng_seed(3);
    const int64_t shapes[2][3] = {{2, 3, 10}, {2, 35, 10}};
    for (int s = 0; s < 2; s++) {
        struct fsdp_ctx *ctx = make_ctx();
        struct fsdp_module *m;
        ASSERT_OK(fsdp__layernorm_create(ctx, "ln", 10, &m), ctx);
        prepare(ctx, m, 0.5f);
        struct fsdp_tensor x = make_input(3, shapes[s], 2.0f, 0.0f);
        struct gc g = {.name = "LayerNorm", .ctx = ctx, .m = m, .in = &x, .eps = 1e-2, .rtol = 1e-2, .atol = 1e-4, .coords = 1000};
        gradcheck(&g);
        free(x.data);
        fsdp_module_free(m);
        fsdp_ctx_free(ctx);
    }
}

/* LayerNorm's backward may write its input gradient over its output gradient
 * (din->data == dout->data): the same bits as out of place, over several row
 * chunks, for dx and both parameter gradients. */
TEST(layernorm_backward_in_place) {
    rng_seed(13);
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_module *m;
    ASSERT_OK(fsdp__layernorm_create(ctx, "ln", 24, &m), ctx);
    prepare(ctx, m, 0.5f);
    int64_t shape[3] = {2, 35, 24}, n = 2 * 35 * 24;
    struct fsdp_tensor x = make_input(3, shape, 2.0f, 0.5f), dy = make_input(3, shape, 1.0f, 0.0f), y = {0};
    ASSERT_OK(fsdp_module_forward(m, ctx, &x, &y), ctx);
    float got[2][2][24]; /* [in place][weight, bias][c] */
    float *dx[2] = {malloc((size_t)n * sizeof(float)), malloc((size_t)n * sizeof(float))};
    for (int inplace = 0; inplace < 2; inplace++) {
        ASSERT_OK(fsdp_module_zero_grad(ctx, m), ctx);
        memcpy(dx[1], dy.data, (size_t)n * sizeof(float));
        struct fsdp_tensor g = dy, d = {0};
        if (inplace) g.data = d.data = dx[1];
        ASSERT_OK(fsdp_module_backward(m, ctx, &g, &d), ctx);
        if (!inplace) memcpy(dx[0], d.data, (size_t)n * sizeof(float));
        CHECK(!inplace || d.data == dx[1]);
        for (int j = 0; j < 2; j++) memcpy(got[inplace][j], m->params[j]->grad, sizeof got[0][0]);
    }
    CHECK(memcmp(dx[0], dx[1], (size_t)n * sizeof(float)) == 0);
    CHECK(memcmp(got[0], got[1], sizeof got[0]) == 0);
    free(dx[0]), free(dx[1]), free(x.data), free(dy.data);
    fsdp_module_free(m);
    fsdp_ctx_free(ctx);
}

TEST(gradcheck_gelu) { /* elementwise and smooth; rtol 1e-2, atol 1e-4 */
    rng_seed(4);
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_module *m;
    ASSERT_OK(fsdp__gelu_create(ctx, "gelu", &m), ctx);
    prepare(ctx, m, 0);
    int64_t shape[2] = {4, 9};
    struct fsdp_tensor x = make_input(2, shape, 3.0f, 0.0f);
    struct gc g = {.name = "GELU", .ctx = ctx, .m = m, .in = &x, .eps = 1e-2, .rtol = 1e-2, .atol = 1e-4, .coords = 1000};
    gradcheck(&g);
    /* the forward against the formula, in double */
    fsdp_arena_reset(ctx);
    struct fsdp_tensor out = {0};
    ASSERT_OK(fsdp_module_forward(m, ctx, &x, &out), ctx);
    const float *xv = x.data, *yv = out.data;
    for (int i = 0; i < 36; i++) {
        double v = xv[i], want = 0.5 * v * (1.0 + tanh(sqrt(2.0 / M_PI) * (v + 0.044715 * v * v * v)));
        CHECK_NEAR(yv[i], want, 1e-6, 1e-7);
    }
    free(x.data);
    fsdp_module_free(m);
    fsdp_ctx_free(ctx);
}

/* one element at a time, not vectorised: what the loops' lanes must agree with */
static __attribute__((noinline)) float expf_one(float x) { return fsdp__expf(x, fsdp__exp_range()); }

/* [Note: exp range]: accuracy against libm's double exp over [-87, 88], the
 * clamp outside it, nan and the infinities, and the vectorised loop (range
 * hoisted, as the layers use it) giving the scalar call's bits */
TEST(fast_expf_against_libm) {
    enum { N = 400003 };
    float *x = malloc(N * sizeof(float)), *e = malloc(N * sizeof(float));
    ASSERT(x && e);
    for (int i = 0; i < N; i++) x[i] = -95.0f + 190.0f * (float)i / (float)(N - 1);
    x[0] = NAN, x[1] = INFINITY, x[2] = -INFINITY, x[3] = 0.0f, x[4] = -0.0f, x[5] = 1e-30f;
    const struct fsdp__exp_range er = fsdp__exp_range();
#pragma omp simd
    for (int i = 0; i < N; i++) e[i] = fsdp__expf(x[i], er);
    double worst = 0.0;
    for (int i = 0; i < N; i++) {
        float one = expf_one(x[i]);
        if (memcmp(&one, &e[i], sizeof one)) {
            TEST_FAILF("x = %.9g: the vectorised loop gives %.9g, one call %.9g", x[i], e[i], one);
            break;
        }
        if (isnan(x[i])) continue;
        double c = x[i] < -87.0f ? -87.0 : x[i] > 88.0f ? 88.0 : (double)x[i], want = exp(c);
        double rel = fabs((double)e[i] - want) / want;
        if (rel > worst) worst = rel;
    }
    if (!(worst < 4.0 * FLT_EPSILON)) TEST_FAILF("worst relative error %.3g (want under 4 ulp)", worst);
    CHECK(isnan(e[0]));
    CHECK(isfinite(e[1]) && e[1] == expf_one(88.0f));
    CHECK(e[2] > 0.0f && e[2] == expf_one(-87.0f));
    CHECK(e[3] == 1.0f && e[4] == 1.0f && e[5] == 1.0f);
    free(x);
    free(e);
}

#if defined(__x86_64__) || defined(__i386__)
FSDP__TARGET_AVX512 static void expf16_of(const float *x, float *e) { _mm512_storeu_ps(e, fsdp__expf16(_mm512_loadu_ps(x))); }

/* fsdp__expf16 gives fsdp__expf's bits in every lane ([Note: softmax rows in registers]) */
TEST(fast_expf16_gives_the_scalar_bits) {
    if (fsdp__cpu_isa_detected() < FSDP__ISA_AVX512) SKIP("the CPU has no AVX-512");
    enum { N = 400016 };
    float *x = malloc(N * sizeof(float));
    ASSERT(x);
    for (int i = 0; i < N; i++) x[i] = -95.0f + 190.0f * (float)i / (float)(N - 1);
    x[0] = NAN, x[1] = INFINITY, x[2] = -INFINITY, x[3] = 0.0f, x[4] = -0.0f, x[5] = 1e-30f;
    for (int i = 0; i < N; i += 16) {
        float e[16];
        expf16_of(x + i, e);
        for (int l = 0; l < 16; l++) {
            float one = expf_one(x[i + l]);
            if (memcmp(&one, &e[l], sizeof one)) {
                TEST_FAILF("x = %.9g: fsdp__expf16 gives %.9g, fsdp__expf %.9g", x[i + l], e[l], one);
                i = N;
                break;
            }
        }
    }
    free(x);
}
#endif

/* The rows the attention runs (on AVX-512 registers where the build has it)
 * against the loops every build has: softmax and its backward, each row t of
 * T in {1, 17, 40, 256} (whole vectors, a partial last vector, one lane), with
 * and without the tail's zeros, to 1e-6 relative (the sums' lane order); the
 * same zeros past t; a nan in a row's live part makes the whole row nan in
 * both, one past t changes nothing. */
TEST(softmax_rows_match_the_loops) {
    rng_seed(11);
    const int64_t Ts[4] = {1, 17, 40, 256};
    for (int k = 0; k < 4; k++) {
        int64_t T = Ts[k];
        float *a = malloc((size_t)(T * T) * sizeof(float)), *b = malloc((size_t)(T * T) * sizeof(float));
        float *da = malloc((size_t)(T * T) * sizeof(float)), *db = malloc((size_t)(T * T) * sizeof(float));
        ASSERT(a && b && da && db);
        for (int tail = 0; tail < 2; tail++) {
            for (int64_t i = 0; i < T * T; i++) a[i] = 4.0f * urand(), da[i] = urand();
            memcpy(b, a, (size_t)(T * T) * sizeof(float));
            memcpy(db, da, (size_t)(T * T) * sizeof(float));
            for (int64_t t = 0; t < T; t++) {
                fsdp__softmax_row(a + t * T, t, T, tail);
                fsdp__softmax_row_loops(b + t * T, t, T, tail);
                fsdp__softmax_bwd_row(a + t * T, da + t * T, t, T, tail);
                fsdp__softmax_bwd_row_loops(a + t * T, db + t * T, t, T, tail);
            }
            double worst = 0.0, worst_d = 0.0;
            for (int64_t t = 0; t < T; t++) {
                int64_t n = tail ? T : (t + 16) / 16 * 16 < T ? (t + 16) / 16 * 16 : T;
                double rs = 0.0;
                for (int64_t j = 0; j < n; j++) {
                    float x = a[t * T + j], y = b[t * T + j];
                    if (j > t && (x != 0.0f || y != 0.0f || da[t * T + j] != 0.0f || db[t * T + j] != 0.0f)) {
                        TEST_FAILF("T %lld row %lld: lane %lld past t is %g / %g, gradient %g / %g", (long long)T,
                                   (long long)t, (long long)j, x, y, da[t * T + j], db[t * T + j]);
                        j = n, t = T;
                        break;
                    }
                    double r = fabs((double)x - y) / fmax(fabs((double)y), 1e-30);
                    double rd = fabs((double)da[t * T + j] - db[t * T + j]) / fmax(fabs((double)db[t * T + j]), 1e-3);
                    worst = r > worst ? r : worst;
                    worst_d = rd > worst_d ? rd : worst_d;
                    rs += x;
                }
                if (t < T && fabs(rs - 1.0) > 1e-5)
                    TEST_FAILF("T %lld row %lld sums to %.9g", (long long)T, (long long)t, rs);
            }
            if (!(worst <= 1e-6 && worst_d <= 1e-5))
                TEST_FAILF("T %lld tail %d: probabilities %.3g and gradients %.3g relative from the loops'",
                           (long long)T, tail, worst, worst_d);
        }
        /* a nan at (t, t) makes row t nan; one at (t - 1, t) is past row t - 1's edge */
        if (T > 1) {
            int64_t t = T - 1;
            for (int64_t i = 0; i < T * T; i++) a[i] = urand();
            a[t * T + t] = NAN;
            a[(t - 1) * T + t] = NAN;
            memcpy(b, a, (size_t)(T * T) * sizeof(float));
            fsdp__softmax_row(a + t * T, t, T, 1);
            fsdp__softmax_row_loops(b + t * T, t, T, 1);
            fsdp__softmax_row(a + (t - 1) * T, t - 1, T, 1);
            fsdp__softmax_row_loops(b + (t - 1) * T, t - 1, T, 1);
            for (int64_t j = 0; j <= t; j++)
                if (!isnan(a[t * T + j]) || !isnan(b[t * T + j])) {
                    TEST_FAILF("T %lld: a nan score left p[%lld] = %g / %g", (long long)T, (long long)j, a[t * T + j],
                               b[t * T + j]);
                    break;
                }
            for (int64_t j = 0; j < T; j++)
                if (isnan(a[(t - 1) * T + j]) || isnan(b[(t - 1) * T + j])) {
                    TEST_FAILF("T %lld: a nan past row %lld's edge reached p[%lld]", (long long)T, (long long)(t - 1),
                               (long long)j);
                    break;
                }
        }
        free(a), free(b), free(da), free(db);
    }
}

/* T = 5 is one block of [Note: causal blocks]; T = 40 is three (edges 16, 32) */
TEST(gradcheck_attention) { /* softmax: rtol 1e-2, atol 2e-4 */
    rng_seed(5);
    const int64_t shapes[2][3] = {{2, 5, 16}, {1, 40, 16}};
    for (int s = 0; s < 2; s++) {
        struct fsdp_ctx *ctx = make_ctx();
        struct fsdp_module *m;
        ASSERT_OK(fsdp__attention_create(ctx, "attn", 16, 4, 0.02f, &m), ctx);
        prepare(ctx, m, 0.5f);
        int64_t B = shapes[s][0], T = shapes[s][1], p = T * 3 / 5; /* the position changed below: 3, 24 */
        struct fsdp_tensor x = make_input(3, shapes[s], 1.0f, 0.0f);
        struct gc g = {.name = "CausalSelfAttention", .ctx = ctx, .m = m, .in = &x, .eps = 1e-2, .rtol = 1e-2, .atol = 2e-4, .coords = 60};
        gradcheck(&g);
        /* causality: changing position p leaves outputs at positions 0..p-1 as they were */
        fsdp_arena_reset(ctx);
        struct fsdp_tensor o1 = {0}, o2 = {0};
        ASSERT_OK(fsdp_module_forward(m, ctx, &x, &o1), ctx);
        float *x0 = x.data;
        for (int64_t b = 0; b < B; b++)
            for (int c = 0; c < 16; c++) x0[(b * T + p) * 16 + c] += 1.0f;
        ASSERT_OK(fsdp_module_forward(m, ctx, &x, &o2), ctx);
        const float *a = o1.data, *o = o2.data;
        int same_before = 1, changed_at = 0;
        for (int64_t i = 0; i < B * T; i++)
            for (int c = 0; c < 16; c++) {
                if (i % T < p && a[i * 16 + c] != o[i * 16 + c]) same_before = 0;
                if (i % T >= p && a[i * 16 + c] != o[i * 16 + c]) changed_at = 1;
            }
        CHECK(same_before);
        CHECK(changed_at);
        free(x.data);
        fsdp_module_free(m);
        fsdp_ctx_free(ctx);
    }
}

TEST(gradcheck_mlp) { /* rtol 1e-2, atol 2e-4 */
    rng_seed(6);
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_module *m;
    ASSERT_OK(fsdp__mlp_create(ctx, "mlp", 6, 0.02f, &m), ctx);
    prepare(ctx, m, 0.5f);
    int64_t shape[3] = {2, 3, 6};
    struct fsdp_tensor x = make_input(3, shape, 1.0f, 0.0f);
    struct gc g = {.name = "MLP", .ctx = ctx, .m = m, .in = &x, .eps = 1e-2, .rtol = 1e-2, .atol = 2e-4, .coords = 40};
    gradcheck(&g);
    free(x.data);
    fsdp_module_free(m);
    fsdp_ctx_free(ctx);
}

TEST(gradcheck_block) { /* rtol 1e-2, atol 3e-4 */
    rng_seed(7);
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_module *m;
    ASSERT_OK(fsdp__block_create(ctx, "blk", 16, 2, 0.02f, &m), ctx);
    prepare(ctx, m, 0.4f);
    int64_t shape[3] = {2, 4, 16};
    struct fsdp_tensor x = make_input(3, shape, 1.0f, 0.0f);
    struct gc g = {.name = "Block", .ctx = ctx, .m = m, .in = &x, .eps = 1e-2, .rtol = 1e-2, .atol = 3e-4, .coords = 30};
    gradcheck(&g);
    free(x.data);
    fsdp_module_free(m);
    fsdp_ctx_free(ctx);
}

TEST(gradcheck_gpt_cross_entropy) { /* mean CE of the whole GPT; rtol 2e-2, atol 2e-5 */
    rng_seed(8);
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_gpt_config cfg = small_gpt();
    struct fsdp_module *m;
    ASSERT_OK(small_gpt_model(ctx, 11, &m), ctx);
    int64_t shape[2] = {2, 6};
    struct fsdp_tensor tok = make_ids(2, shape, cfg.vocab_size);
    int32_t targets[12];
    for (int i = 0; i < 12; i++) targets[i] = (int32_t)irand(cfg.vocab_size);
    struct gc g = {.name = "GPT+cross_entropy", .ctx = ctx, .m = m, .in = &tok, .targets = targets, .eps = 1e-2, .rtol = 2e-2, .atol = 2e-5, .coords = 12};
    gradcheck(&g); /* covers transformer.wte.weight: both the embedding and the lm_head path */
    /* rows of wpe at positions >= T get no gradient */
    struct fsdp_param *wpe = fsdp_module_find_param(m, "transformer.wpe.weight");
    ASSERT(wpe);
    double unused = 0.0;
    for (int64_t i = 6 * cfg.n_embd; i < wpe->numel; i++) unused += fabs(wpe->grad[i]);
    CHECK(unused == 0.0);
    free(tok.data);
    fsdp_module_free(m);
    fsdp_ctx_free(ctx);
}

TEST(gradcheck_cross_entropy) { /* CE alone against FD of the double CE: rtol 1e-3, atol 1e-6 */
    rng_seed(9);
    struct fsdp_ctx *ctx = make_ctx();
    enum { N = 7, V = 11 };
    float logits[N * V], d[N * V], d2[N * V];
    int32_t t[N];
    for (int i = 0; i < N * V; i++) logits[i] = 3.0f * urand();
    for (int i = 0; i < N; i++) t[i] = (int32_t)irand(V);
    logits[5] = 80.0f; /* a large logit: stable softmax must not overflow */
    float loss = 0.0f;
    ASSERT_OK(fsdp_cross_entropy(ctx, logits, t, N, V, 1.0f, &loss, d), ctx);
    CHECK_NEAR(loss, ce_double(logits, t, N, V), 1e-6, 0.0);
    for (int i = 0; i < N * V; i++) {
        float x0 = logits[i];
        logits[i] = x0 + 1e-2f;
        double lp = ce_double(logits, t, N, V);
        logits[i] = x0 - 1e-2f;
        double lm = ce_double(logits, t, N, V);
        logits[i] = x0;
        double fd = (lp - lm) / ((double)(x0 + 1e-2f) - (double)(x0 - 1e-2f));
        CHECK_NEAR(d[i], fd, 1e-3, 1e-6);
    }
    /* scale multiplies the gradient, not the loss; dlogits may alias logits */
    float loss2 = 0.0f;
    memcpy(d2, logits, sizeof d2);
    ASSERT_OK(fsdp_cross_entropy(ctx, d2, t, N, V, 4.0f, &loss2, d2), ctx);
    CHECK(loss2 == loss);
    for (int i = 0; i < N * V; i++) CHECK_NEAR(d2[i], 4.0f * d[i], 1e-6, 1e-9);
    /* loss only */
    float loss3 = 0.0f;
    ASSERT_OK(fsdp_cross_entropy(ctx, logits, t, N, V, 1.0f, &loss3, NULL), ctx);
    CHECK(loss3 == loss);
    /* a bad target names itself */
    t[4] = V;
    CHECK_INT_EQ(fsdp_cross_entropy(ctx, logits, t, N, V, 1.0f, &loss, d), FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "target 11 at row 4");
    fsdp_ctx_free(ctx);
}

/* Buffers: named by FQN at finalize, initialised, found, visited in order,
 * kept apart from parameters; set_training reaches the whole tree. */
static const struct fsdp_module_ops plain_ops = {"Plain", NULL, NULL, NULL};

TEST(module_buffers_and_training_mode) {
    struct fsdp_ctx *ctx = make_ctx();
    struct fsdp_module *root, *bn;
    CHECK_OK(fsdp_module_create(ctx, &plain_ops, "root", &root), ctx);
    CHECK_OK(fsdp_module_create(ctx, &plain_ops, "bn1", &bn), ctx);
    CHECK_OK(fsdp_module_add_child(ctx, root, bn), ctx);
    int64_t c = 3;
    struct fsdp_buffer *mean, *var, *nbt;
    CHECK_OK(fsdp_module_add_param(ctx, bn, "weight", 1, &c, (struct fsdp_init){FSDP_INIT_ONES, 0}, 1, NULL), ctx);
    CHECK_OK(fsdp_module_add_buffer(ctx, bn, "running_mean", FSDP_F32, 1, &c, (struct fsdp_init){FSDP_INIT_ZEROS, 0},
                                    1, &mean), ctx);
    CHECK_OK(fsdp_module_add_buffer(ctx, bn, "running_var", FSDP_F32, 1, &c, (struct fsdp_init){FSDP_INIT_ONES, 0},
                                    1, &var), ctx);
    CHECK_OK(fsdp_module_add_buffer(ctx, bn, "num_batches_tracked", FSDP_I64, 0, NULL,
                                    (struct fsdp_init){FSDP_INIT_ZEROS, 0}, 1, &nbt), ctx);
    CHECK_OK(fsdp_module_finalize(ctx, root), ctx);
    CHECK_STR_EQ(mean->fqn, "bn1.running_mean");
    CHECK_STR_EQ(nbt->fqn, "bn1.num_batches_tracked");
    CHECK_INT_EQ(nbt->numel, 1);
    CHECK_INT_EQ(((int64_t *)nbt->data)[0], 0);
    for (int i = 0; i < 3; i++) {
        CHECK(((float *)mean->data)[i] == 0.0f);
        CHECK(((float *)var->data)[i] == 1.0f);
    }
    CHECK(fsdp_module_find_buffer(root, "bn1.running_var") == var);
    CHECK(fsdp_module_find_buffer(root, "bn1.weight") == NULL);
    CHECK(fsdp_module_find_param(root, "bn1.running_var") == NULL);
    CHECK_INT_EQ(fsdp_module_numel(root), 3); /* buffers are not parameters */
    /* a name taken by a parameter or buffer, a float16 buffer, a normal init */
    CHECK(fsdp_module_add_buffer(ctx, bn, "weight", FSDP_F32, 1, &c, (struct fsdp_init){FSDP_INIT_ZEROS, 0}, 1,
                                 NULL) == FSDP_ERR_INVALID);
    CHECK_STR_CONTAINS(fsdp_errmsg(ctx), "'weight'");
    CHECK(fsdp_module_add_buffer(ctx, bn, "running_mean", FSDP_F32, 1, &c, (struct fsdp_init){FSDP_INIT_ZEROS, 0}, 1,
                                 NULL) == FSDP_ERR_INVALID);
    CHECK(fsdp_module_add_buffer(ctx, bn, "h", FSDP_F16, 1, &c, (struct fsdp_init){FSDP_INIT_ZEROS, 0}, 1, NULL) ==
          FSDP_ERR_INVALID);
    CHECK(fsdp_module_add_buffer(ctx, bn, "n", FSDP_F32, 1, &c, (struct fsdp_init){FSDP_INIT_NORMAL, 1}, 1, NULL) ==
          FSDP_ERR_INVALID);
    CHECK_INT_EQ(root->training, 1);
    CHECK_INT_EQ(bn->training, 1);
    fsdp_module_set_training(root, 0);
    CHECK_INT_EQ(root->training, 0);
    CHECK_INT_EQ(bn->training, 0);
    fsdp_module_set_training(root, 1);
    CHECK_INT_EQ(bn->training, 1);
    fsdp_module_free(root);
    fsdp_ctx_free(ctx);
}

TEST_MAIN()
