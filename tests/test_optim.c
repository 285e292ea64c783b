/*
 * test_optim.c - the optimizers, clipping factor and LR schedules of
 * src/optim against hand-written double-precision references: AdamW
 * (decoupled decay, bias correction, grad_scale, slices with and without
 * decay, state layout with a stride), SGD with and without momentum (coupled
 * decay), the step count and its setter, bit-identical results for any
 * thread count or slicing, option validation, and, where Debian's
 * python3-torch is installed, 5 steps against torch.optim.AdamW / SGD.
 * The references keep state in fp32 between steps, as the library does, so
 * agreement is to a few ulps.
 */
#include "fsdp.h"
#include "harness.h"
#include "optim/optim-impl.h"

#include <omp.h>

/* ---- Helpers ---- */

static struct fsdp_ctx *new_ctx(void) {
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.comm = FSDP_COMM_SELF;
    struct fsdp_ctx *ctx = NULL;
    if (fsdp_ctx_create(&co, &ctx) != FSDP_OK) abort();
    return ctx;
}

/* Deterministic values in [-1, 1) (xorshift64*). */
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static float urand(void) {
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    uint64_t r = rng_state * 2685821657736338717ull;
    return (float)((double)(r >> 11) * (1.0 / 9007199254740992.0) * 2.0 - 1.0);
}

static void fill(float *x, int64_t n, float scale) {
    for (int64_t i = 0; i < n; i++) x[i] = scale * urand();
}

static float *falloc(int64_t n) {
    float *p = calloc((size_t)(n > 0 ? n : 1), sizeof(float));
    if (!p) abort();
    return p;
}

/* torch.optim.AdamW on one array, written in torch's own form; state stored
 * in fp32 between steps. t is the step number after the increment. */
static void ref_adamw(float *p, const float *g, float *m, float *v, int64_t n, int64_t t,
                      const struct fsdp_optim_opts *o, double lr, int decay, double scale) {
    double b1 = o->beta1, b2 = o->beta2, eps = o->eps, wd = decay ? o->weight_decay : 0.0;
    double bc1 = 1.0 - pow(b1, (double)t), bc2 = 1.0 - pow(b2, (double)t);
    for (int64_t i = 0; i < n; i++) {
        double gi = (double)g[i] * scale;
        double pi = (double)p[i] * (1.0 - lr * wd);
        m[i] = (float)(b1 * (double)m[i] + (1.0 - b1) * gi);
        v[i] = (float)(b2 * (double)v[i] + (1.0 - b2) * gi * gi);
        double mhat = (double)m[i] / bc1, vhat = (double)v[i] / bc2;
        p[i] = (float)(pi - lr * mhat / (sqrt(vhat) + eps));
    }
}

/* torch.optim.SGD (dampening 0; nesterov: the step is d + mu*buf); buf NULL when momentum is 0. */
static void ref_sgd(float *p, const float *g, float *buf, int64_t n, int first,
                    const struct fsdp_optim_opts *o, double lr, int decay, double scale) {
    double wd = decay ? o->weight_decay : 0.0, mu = o->momentum;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)g[i] * scale + wd * (double)p[i];
        if (mu > 0.0) {
            buf[i] = first ? (float)d : (float)(mu * (double)buf[i] + d);
            d = o->nesterov ? d + mu * (double)buf[i] : (double)buf[i];
        }
        p[i] = (float)((double)p[i] - lr * d);
    }
}

static void check_close(const float *a, const float *b, int64_t n, double rtol, double atol,
                        const char *what) {
    int bad = 0;
    for (int64_t i = 0; i < n && bad < 5; i++) {
        double x = a[i], y = b[i];
        if (!isfinite(x) || !isfinite(y) || fabs(x - y) > atol + rtol * fabs(y)) {
            TEST_FAILF("%s[%lld]: %.9g vs %.9g (diff %.3g)", what, (long long)i, x, y, fabs(x - y));
            bad++;
        }
    }
}

/* ---- Options ---- */

TEST(opts_default) {
    struct fsdp_optim_opts o = fsdp_optim_opts_default();
    CHECK_INT_EQ(o.kind, FSDP_OPTIM_ADAMW);
    CHECK(o.beta1 == 0.9f);
    CHECK(o.beta2 == 0.95f);
    CHECK(o.eps == 1e-8f);
    CHECK(o.weight_decay == 0.1f);
    CHECK(o.momentum == 0.0f);
    CHECK_INT_EQ(o.decay_all, 0);

    struct fsdp_ctx *ctx = new_ctx();
    struct fsdp_mem_stats ms;
    fsdp_mem_get(ctx, &ms);
    const size_t other0 = ms.cur[FSDP_MEM_OTHER];
    struct fsdp_optim *opt = NULL;
    ASSERT_OK(fsdp_optim_create(ctx, NULL, &opt), ctx); /* NULL opts: the defaults */
    CHECK_INT_EQ(fsdp_optim_state_per_elem(opt), 2);
    CHECK_INT_EQ(fsdp_optim_step_count(opt), 0);
    CHECK_INT_EQ(fsdp__optim_decay_all(opt), 0);
    CHECK(fsdp__optim_opts(opt)->beta2 == 0.95f);
    fsdp_mem_get(ctx, &ms);
    CHECK(ms.cur[FSDP_MEM_OTHER] > other0); /* accounted */
    fsdp_optim_free(opt);
    fsdp_mem_get(ctx, &ms);
    CHECK_INT_EQ(ms.cur[FSDP_MEM_OTHER], other0);
    fsdp_optim_free(NULL); /* no-op */

    o.decay_all = 1;
    ASSERT_OK(fsdp_optim_create(ctx, &o, &opt), ctx);
    CHECK_INT_EQ(fsdp__optim_decay_all(opt), 1);
    fsdp_optim_free(opt);

    o = fsdp_optim_opts_default();
    o.kind = FSDP_OPTIM_SGD;
    ASSERT_OK(fsdp_optim_create(ctx, &o, &opt), ctx);
    CHECK_INT_EQ(fsdp_optim_state_per_elem(opt), 0);
    fsdp_optim_free(opt);
    o.momentum = 0.9f;
    ASSERT_OK(fsdp_optim_create(ctx, &o, &opt), ctx);
    CHECK_INT_EQ(fsdp_optim_state_per_elem(opt), 1);
    fsdp_optim_free(opt);
    fsdp_ctx_free(ctx);
}

TEST(opts_invalid) {
    struct fsdp_ctx *ctx = new_ctx();
    struct {
        const char *field;
        struct fsdp_optim_opts o;
    } cases[20];
    int n = 0;
    struct fsdp_optim_opts d = fsdp_optim_opts_default();
#define BAD(name, stmt) do { cases[n].field = name; cases[n].o = d; { struct fsdp_optim_opts *o = &cases[n].o; stmt; } n++; } while (0)
    BAD("beta1", o->beta1 = 1.0f);
    BAD("beta1", o->beta1 = -0.1f);
    BAD("beta1", o->beta1 = NAN);
    BAD("beta2", o->beta2 = 1.0f);
    BAD("beta2", o->beta2 = -1e-3f);
    BAD("eps", o->eps = 0.0f);
    BAD("eps", o->eps = -1e-8f);
    BAD("eps", o->eps = INFINITY);
    BAD("weight_decay", o->weight_decay = -0.1f);
    BAD("weight_decay", o->weight_decay = NAN);
    BAD("momentum", o->momentum = 1.0f);
    BAD("momentum", o->momentum = -0.5f);
    BAD("momentum", (o->kind = FSDP_OPTIM_SGD, o->momentum = 2.0f));
    BAD("kind", o->kind = (enum fsdp_optim_kind)7);
    BAD("nesterov", o->nesterov = 1); /* AdamW */
    BAD("nesterov", (o->kind = FSDP_OPTIM_SGD, o->nesterov = 1));   /* momentum 0 */
#undef BAD
    for (int i = 0; i < n; i++) {
        struct fsdp_optim *opt = (struct fsdp_optim *)&ctx; /* must be reset to NULL */
        enum fsdp_status st = fsdp_optim_create(ctx, &cases[i].o, &opt);
        CHECK_INT_EQ(st, FSDP_ERR_INVALID);
        CHECK(opt == NULL);
        CHECK_STR_CONTAINS(fsdp_errmsg(ctx), cases[i].field);
    }
    /* edges that are valid */
    struct fsdp_optim_opts o = d;
    o.beta1 = 0.0f;
    o.beta2 = 0.0f;
    o.weight_decay = 0.0f;
    o.momentum = 0.0f;
    struct fsdp_optim *opt = NULL;
    CHECK_OK(fsdp_optim_create(ctx, &o, &opt), ctx);
    fsdp_optim_free(opt);
    CHECK_INT_EQ(fsdp_optim_create(ctx, &o, NULL), FSDP_ERR_INVALID);
    fsdp_ctx_free(ctx);
}

/* ---- AdamW ---- */

/* Step 1 has a closed form: mhat = g, vhat = g^2, so
 * p1 = p0*(1 - lr*wd) - lr*g/(|g| + eps). */
TEST(adamw_first_step_closed_form) {
    struct fsdp_ctx *ctx = new_ctx();
    struct fsdp_optim_opts o = fsdp_optim_opts_default();
    o.eps = 1e-3f; /* large enough to matter */
    struct fsdp_optim *opt;
    ASSERT_OK(fsdp_optim_create(ctx, &o, &opt), ctx);
    float p[4] = {1.0f, -2.0f, 0.5f, 3.0f}, g[4] = {0.5f, -0.01f, 0.0f, 2e-3f};
    float p0[4], state[8] = {0};
    memcpy(p0, p, sizeof p);
    struct fsdp_optim_slice sl[2] = {
        {.param = p, .grad = g, .state = state, .n = 2, .state_stride = 4, .decay = 1}, /* decayed */
        {.param = p + 2, .grad = g + 2, .state = state + 2, .n = 2, .state_stride = 4, .decay = 0},
    };
    double lr = 0.1, wd = (double)o.weight_decay, eps = (double)o.eps;
    fsdp_optim_step(opt, sl, 2, (float)lr, 1.0f);
    CHECK_INT_EQ(fsdp_optim_step_count(opt), 1);
    for (int i = 0; i < 4; i++) {
        double decay = i < 2 ? 1.0 - lr * wd : 1.0;
        double want = (double)p0[i] * decay - lr * (double)g[i] / (fabs((double)g[i]) + eps);
        CHECK_NEAR(p[i], want, 1e-6, 1e-7);
        CHECK_NEAR(state[i], (1.0 - (double)o.beta1) * g[i], 1e-6, 0.0);
        CHECK_NEAR(state[4 + i], (1.0 - (double)o.beta2) * g[i] * g[i], 1e-6, 0.0);
    }
    CHECK(p[2] == 0.5f); /* zero grad, no decay: untouched */
    fsdp_optim_free(opt);
    fsdp_ctx_free(ctx);
}

/* Several steps over slices of one unit (with and without decay, one long
 * enough to take the OpenMP path), varying lr and grad_scale. */
TEST(adamw_matches_reference) {
    struct fsdp_ctx *ctx = new_ctx();
    struct fsdp_optim_opts o = fsdp_optim_opts_default();
    o.beta1 = 0.8f;
    o.beta2 = 0.99f;
    o.eps = 1e-6f;
    o.weight_decay = 0.05f;
    struct fsdp_optim *opt;
    ASSERT_OK(fsdp_optim_create(ctx, &o, &opt), ctx);

    enum { NS = 4 };
    const int64_t len[NS] = {7, 1, 20011, 33};
    const int dec[NS] = {1, 0, 1, 0};
    int64_t total = 0, off[NS];
    for (int j = 0; j < NS; j++) off[j] = total, total += len[j];
    float *p = falloc(total), *g = falloc(total), *g_copy = falloc(total);
    float *state = falloc(2 * total), *rp = falloc(total), *rm = falloc(total), *rv = falloc(total);
    fill(p, total, 1.0f);
    memcpy(rp, p, (size_t)total * sizeof(float));
    struct fsdp_optim_slice sl[NS];
    for (int j = 0; j < NS; j++)
        sl[j] = (struct fsdp_optim_slice){.param = p + off[j], .grad = g + off[j], .state = state + off[j],
                                          .n = len[j], .state_stride = total, .decay = dec[j]};

    const float lrs[6] = {1e-3f, 3e-3f, 1e-2f, 1e-2f, 5e-3f, 2e-4f};
    const float scales[6] = {1.0f, 0.5f, 1.0f, 0.25f, 1.0f, 0.9f};
    for (int s = 0; s < 6; s++) {
        fill(g, total, s == 3 ? 1e-5f : 0.3f); /* tiny grads: eps matters */
        memcpy(g_copy, g, (size_t)total * sizeof(float));
        fsdp_optim_step(opt, sl, NS, lrs[s], scales[s]);
        CHECK_INT_EQ(fsdp_optim_step_count(opt), s + 1);
        CHECK(memcmp(g, g_copy, (size_t)total * sizeof(float)) == 0); /* grad not modified */
        for (int j = 0; j < NS; j++)
            ref_adamw(rp + off[j], g + off[j], rm + off[j], rv + off[j], len[j], s + 1, &o, lrs[s],
                      dec[j], scales[s]);
    }
    check_close(p, rp, total, 2e-7, 1e-9, "param");
    check_close(state, rm, total, 2e-7, 1e-12, "m");
    check_close(state + total, rv, total, 2e-7, 1e-15, "v");
    free(p), free(g), free(g_copy), free(state), free(rp), free(rm), free(rv);
    fsdp_optim_free(opt);
    fsdp_ctx_free(ctx);
}

/* state[k*state_stride + i]: m at k = 0, v at k = 1; nothing outside
 * [0, n) of each state row is touched. */
TEST(adamw_state_layout) {
    struct fsdp_ctx *ctx = new_ctx();
    struct fsdp_optim *opt;
    ASSERT_OK(fsdp_optim_create(ctx, NULL, &opt), ctx);
    struct fsdp_optim_opts o = fsdp_optim_opts_default();
    enum { N = 5, STRIDE = 9 };
    float p[N] = {1, 2, 3, 4, 5}, g[N] = {0.1f, -0.2f, 0.3f, -0.4f, 0.5f};
    float state[2 * STRIDE + 3];
    for (int i = 0; i < 2 * STRIDE + 3; i++) state[i] = -7.0f; /* sentinel */
    for (int i = 0; i < N; i++) state[i] = state[STRIDE + i] = 0.0f;
    struct fsdp_optim_slice sl = {.param = p, .grad = g, .state = state, .n = N, .state_stride = STRIDE, .decay = 1};
    fsdp_optim_step(opt, &sl, 1, 1e-2f, 2.0f);
    for (int i = 0; i < N; i++) {
        double gi = 2.0 * g[i];
        CHECK_NEAR(state[i], (1.0 - (double)o.beta1) * gi, 1e-6, 0.0);
        CHECK_NEAR(state[STRIDE + i], (1.0 - (double)o.beta2) * gi * gi, 1e-6, 0.0);
    }
    for (int i = N; i < STRIDE; i++) CHECK(state[i] == -7.0f);
    for (int i = STRIDE + N; i < 2 * STRIDE + 3; i++) CHECK(state[i] == -7.0f);
    fsdp_optim_free(opt);
    fsdp_ctx_free(ctx);
}

/* The count advances once per call (also with no slices); a restored count
 * drives the bias correction of the next step. */
TEST(step_count_and_setter) {
    struct fsdp_ctx *ctx = new_ctx();
    struct fsdp_optim_opts o = fsdp_optim_opts_default();
    struct fsdp_optim *opt;
    ASSERT_OK(fsdp_optim_create(ctx, &o, &opt), ctx);
    fsdp_optim_step(opt, NULL, 0, 1e-3f, 1.0f);
    fsdp_optim_step(opt, NULL, 0, 1e-3f, 1.0f);
    CHECK_INT_EQ(fsdp_optim_step_count(opt), 2);
    fsdp__optim_set_step_count(opt, 10);
    CHECK_INT_EQ(fsdp_optim_step_count(opt), 10);

    enum { N = 6 };
    float p[N], g[N], state[2 * N] = {0}, rp[N], rm[N] = {0}, rv[N] = {0};
    fill(p, N, 1.0f);
    fill(g, N, 0.1f);
    memcpy(rp, p, sizeof p);
    float p0[N];
    memcpy(p0, p, sizeof p);
    struct fsdp_optim_slice sl = {.param = p, .grad = g, .state = state, .n = N, .state_stride = N, .decay = 1};
    fsdp_optim_step(opt, &sl, 1, 1e-2f, 1.0f);
    CHECK_INT_EQ(fsdp_optim_step_count(opt), 11);
    ref_adamw(rp, g, rm, rv, N, 11, &o, 1e-2f, 1, 1.0);
    check_close(p, rp, N, 2e-7, 1e-9, "param at step 11");
    /* and differs from what step 1 would give (bias correction 1-b^1) */
    float p1[N], m1[N] = {0}, v1[N] = {0};
    memcpy(p1, p0, sizeof p1);
    ref_adamw(p1, g, m1, v1, N, 1, &o, 1e-2f, 1, 1.0);
    int differs = 0;
    for (int i = 0; i < N; i++) differs |= fabs((double)p1[i] - (double)p[i]) > 1e-4;
    CHECK(differs);
    fsdp_optim_free(opt);
    fsdp_ctx_free(ctx);
}

/* ---- SGD ---- */

static void sgd_case(float momentum, int nesterov) {
    struct fsdp_ctx *ctx = new_ctx();
    struct fsdp_optim_opts o = fsdp_optim_opts_default();
    o.kind = FSDP_OPTIM_SGD;
    o.momentum = momentum;
    o.nesterov = nesterov;
    o.weight_decay = 0.01f;
    struct fsdp_optim *opt;
    ASSERT_OK(fsdp_optim_create(ctx, &o, &opt), ctx);
    int k = fsdp_optim_state_per_elem(opt);
    CHECK_INT_EQ(k, momentum > 0.0f ? 1 : 0);

    enum { NS = 3 };
    const int64_t len[NS] = {11, 17000, 3};
    const int dec[NS] = {1, 0, 1};
    int64_t total = 0, off[NS];
    for (int j = 0; j < NS; j++) off[j] = total, total += len[j];
    float *p = falloc(total), *g = falloc(total), *g_copy = falloc(total);
    float *buf = k ? falloc(total) : NULL, *rp = falloc(total), *rbuf = falloc(total);
    fill(p, total, 1.0f);
    if (buf) fill(buf, total, 5.0f); /* garbage: the first step must ignore it */
    memcpy(rp, p, (size_t)total * sizeof(float));
    struct fsdp_optim_slice sl[NS];
    for (int j = 0; j < NS; j++)
        sl[j] = (struct fsdp_optim_slice){.param = p + off[j], .grad = g + off[j], .state = buf ? buf + off[j] : NULL,
                                          .n = len[j], .state_stride = total, .decay = dec[j]};
    const float lrs[5] = {0.1f, 0.05f, 0.1f, 0.02f, 0.01f};
    const float scales[5] = {1.0f, 0.5f, 1.0f, 0.7f, 1.0f};
    for (int s = 0; s < 5; s++) {
        fill(g, total, 0.5f);
        memcpy(g_copy, g, (size_t)total * sizeof(float));
        fsdp_optim_step(opt, sl, NS, lrs[s], scales[s]);
        CHECK(memcmp(g, g_copy, (size_t)total * sizeof(float)) == 0);
        for (int j = 0; j < NS; j++)
            ref_sgd(rp + off[j], g + off[j], k ? rbuf + off[j] : NULL, len[j], s == 0, &o, lrs[s],
                    dec[j], scales[s]);
    }
    check_close(p, rp, total, 2e-7, 1e-9, "param");
    if (buf) check_close(buf, rbuf, total, 2e-7, 1e-9, "momentum buffer");
    free(p), free(g), free(g_copy), free(buf), free(rp), free(rbuf);
    fsdp_optim_free(opt);
    fsdp_ctx_free(ctx);
}

TEST(sgd_plain) {
    sgd_case(0.0f, 0);
    /* and the textbook update once: p - lr*(g + wd*p) */
    struct fsdp_ctx *ctx = new_ctx();
    struct fsdp_optim_opts o = fsdp_optim_opts_default();
    o.kind = FSDP_OPTIM_SGD;
    o.weight_decay = 0.5f;
    struct fsdp_optim *opt;
    ASSERT_OK(fsdp_optim_create(ctx, &o, &opt), ctx);
    float p[2] = {2.0f, 2.0f}, g[2] = {1.0f, 1.0f};
    struct fsdp_optim_slice sl[2] = {{.param = p, .grad = g, .n = 1, .state_stride = 1, .decay = 1},
                                     {.param = p + 1, .grad = g + 1, .n = 1, .state_stride = 1, .decay = 0}};
    fsdp_optim_step(opt, sl, 2, 0.25f, 2.0f);
    CHECK_NEAR(p[0], 2.0 - 0.25 * (2.0 + 0.5 * 2.0), 0, 1e-7);
    CHECK_NEAR(p[1], 2.0 - 0.25 * 2.0, 0, 1e-7);
    fsdp_optim_free(opt);
    fsdp_ctx_free(ctx);
}

TEST(sgd_momentum) { sgd_case(0.9f, 0); }

/* Nesterov (torch's nesterov=True): five steps against the reference, and
 * the second step by hand: buf = mu*d1 + d2, p -= lr*(d2 + mu*buf). */
TEST(sgd_nesterov) {
    sgd_case(0.9f, 1);
    struct fsdp_ctx *ctx = new_ctx();
    struct fsdp_optim_opts o = fsdp_optim_opts_default();
    o.kind = FSDP_OPTIM_SGD;
    o.momentum = 0.5f;
    o.nesterov = 1;
    o.weight_decay = 0.0f;
    struct fsdp_optim *opt;
    ASSERT_OK(fsdp_optim_create(ctx, &o, &opt), ctx);
    float p = 1.0f, g = 1.0f, buf = 0.0f;
    struct fsdp_optim_slice sl = {.param = &p, .grad = &g, .state = &buf, .n = 1, .state_stride = 1, .decay = 1};
    fsdp_optim_step(opt, &sl, 1, 0.5f, 1.0f); /* buf = 1, p = 1 - 0.5 (1 + 0.5) = 0.25 */
    CHECK_NEAR(p, 0.25, 0, 1e-7);
    g = 2.0f;
    fsdp_optim_step(opt, &sl, 1, 0.5f, 1.0f); /* buf = 0.5 + 2 = 2.5, p = 0.25 - 0.5 (2 + 1.25) = -1.375 */
    CHECK_NEAR(buf, 2.5, 0, 1e-7);
    CHECK_NEAR(p, -1.375, 0, 1e-7);
    fsdp_optim_free(opt);
    fsdp_ctx_free(ctx);
}

/* ---- Determinism ---- */

/* Same inputs give the same bits for 1 or 4 threads and for any slicing. */
TEST(deterministic_threads_and_slicing) {
    struct fsdp_ctx *ctx = new_ctx();
    struct fsdp_optim *o1, *o2, *o3;
    ASSERT_OK(fsdp_optim_create(ctx, NULL, &o1), ctx);
    ASSERT_OK(fsdp_optim_create(ctx, NULL, &o2), ctx);
    ASSERT_OK(fsdp_optim_create(ctx, NULL, &o3), ctx);
    const int64_t n = 100003;
    float *p1 = falloc(n), *p2 = falloc(n), *p3 = falloc(n), *g = falloc(n);
    float *s1 = falloc(2 * n), *s2 = falloc(2 * n), *s3 = falloc(2 * n);
    fill(p1, n, 1.0f);
    memcpy(p2, p1, (size_t)n * sizeof(float));
    memcpy(p3, p1, (size_t)n * sizeof(float));
    const int64_t cut[4] = {0, 1, 50000, n};
    for (int s = 0; s < 3; s++) {
        fill(g, n, 0.2f);
        struct fsdp_optim_slice a = {.param = p1, .grad = g, .state = s1, .n = n, .state_stride = n, .decay = 1};
        omp_set_num_threads(1);
        fsdp_optim_step(o1, &a, 1, 1e-2f, 0.7f);
        struct fsdp_optim_slice b = {.param = p2, .grad = g, .state = s2, .n = n, .state_stride = n, .decay = 1};
        omp_set_num_threads(4);
        fsdp_optim_step(o2, &b, 1, 1e-2f, 0.7f);
        struct fsdp_optim_slice c[3];
        for (int j = 0; j < 3; j++)
            c[j] = (struct fsdp_optim_slice){.param = p3 + cut[j], .grad = g + cut[j], .state = s3 + cut[j],
                                             .n = cut[j + 1] - cut[j], .state_stride = n, .decay = 1};
        omp_set_num_threads(3);
        fsdp_optim_step(o3, c, 3, 1e-2f, 0.7f);
    }
    CHECK(memcmp(p1, p2, (size_t)n * sizeof(float)) == 0);
    CHECK(memcmp(s1, s2, (size_t)(2 * n) * sizeof(float)) == 0);
    CHECK(memcmp(p1, p3, (size_t)n * sizeof(float)) == 0);
    CHECK(memcmp(s1, s3, (size_t)(2 * n) * sizeof(float)) == 0);
    free(p1), free(p2), free(p3), free(g), free(s1), free(s2), free(s3);
    fsdp_optim_free(o1), fsdp_optim_free(o2), fsdp_optim_free(o3);
    fsdp_ctx_free(ctx);
}

/* [Note: fused 16-bit copy]: a slice with param_lp gets the same fp32
 * update as one without, and its copy equals the element-by-element cast
 * of the result (dtype.c's scalar rounding, NaN included), for AdamW and
 * SGD, bf16 and fp16, with slices that are not whole chunks. */
static void lp_copy_case(enum fsdp_optim_kind kind, enum fsdp_dtype dt) {
    struct fsdp_ctx *ctx = new_ctx();
    struct fsdp_optim_opts o = fsdp_optim_opts_default();
    o.kind = kind;
    o.momentum = 0.9f;
    struct fsdp_optim *oa, *ob;
    ASSERT_OK(fsdp_optim_create(ctx, &o, &oa), ctx);
    ASSERT_OK(fsdp_optim_create(ctx, &o, &ob), ctx);
    const int64_t n = 3 * 8192 + 4099; /* chunks and a partial one */
    float *pa = falloc(n), *pb = falloc(n), *g = falloc(n), *sa = falloc(2 * n), *sb = falloc(2 * n);
    uint16_t *lp = calloc((size_t)n, sizeof *lp);
    if (!lp) abort();
    fill(pa, n, 3.0f);
    pa[5] = NAN;              /* a NaN parameter stays NaN in the copy */
    pa[6] = 1e-41f;           /* a subnormal rounds as dtype.c rounds it */
    pa[7] = 65519.0f;         /* fp16's rounding edge */
    memcpy(pb, pa, (size_t)n * sizeof(float));
    const int64_t cut[3] = {0, 10001, n};
    for (int s = 0; s < 3; s++) {
        fill(g, n, 0.2f);
        struct fsdp_optim_slice a[2], b = {.param = pb, .grad = g, .state = sb, .n = n, .state_stride = n, .decay = 1};
        for (int j = 0; j < 2; j++)
            a[j] = (struct fsdp_optim_slice){.param = pa + cut[j], .grad = g + cut[j], .state = sa + cut[j],
                                             .n = cut[j + 1] - cut[j], .state_stride = n, .decay = 1,
                                             .param_lp = lp + cut[j], .lp_dtype = dt};
        fsdp_optim_step(oa, a, 2, 1e-2f, 0.5f);
        fsdp_optim_step(ob, &b, 1, 1e-2f, 0.5f);
        CHECK(memcmp(pa, pb, (size_t)n * sizeof(float)) == 0); /* the update is unchanged */
        int64_t bad = 0;
        for (int64_t i = 0; i < n; i++)
            bad += lp[i] != (dt == FSDP_BF16 ? fsdp__f32_to_bf16(pa[i]) : fsdp__f32_to_f16(pa[i]));
        CHECK_INT_EQ(bad, 0);
    }
    CHECK(isnan(pa[5]));
    free(pa), free(pb), free(g), free(sa), free(sb), free(lp);
    fsdp_optim_free(oa), fsdp_optim_free(ob);
    fsdp_ctx_free(ctx);
}

TEST(adamw_bf16_copy) { lp_copy_case(FSDP_OPTIM_ADAMW, FSDP_BF16); }
TEST(adamw_f16_copy) { lp_copy_case(FSDP_OPTIM_ADAMW, FSDP_F16); }
TEST(sgd_bf16_copy) { lp_copy_case(FSDP_OPTIM_SGD, FSDP_BF16); }

/* ---- Clipping and schedules ---- */

TEST(clip_scale) {
    CHECK(fsdp_clip_scale(0.5, 1.0) == 1.0f);          /* below */
    CHECK(fsdp_clip_scale(1.0, 1.0) == 1.0f);          /* at: no clip */
    CHECK_NEAR(fsdp_clip_scale(4.0, 1.0), 1.0 / (4.0 + 1e-6), 1e-7, 0);
    CHECK_NEAR(fsdp_clip_scale(2.0, 0.5), 0.5 / (2.0 + 1e-6), 1e-7, 0);
    CHECK(fsdp_clip_scale(100.0, 0.0) == 1.0f);        /* max_norm <= 0: off */
    CHECK(fsdp_clip_scale(100.0, -1.0) == 1.0f);
    CHECK(fsdp_clip_scale(0.0, 1.0) == 1.0f);
    CHECK(fsdp_clip_scale(NAN, 1.0) == 1.0f);
    CHECK(fsdp_clip_scale(INFINITY, 1.0) == 0.0f);
}

TEST(lr_schedule) {
    struct fsdp_lr_sched s = {FSDP_LR_COSINE, 6e-4f, 6e-5f, 10, 110};
    /* warmup: lr*(step+1)/warmup */
    CHECK_NEAR(fsdp_lr_at(&s, 0), 6e-4 * 1 / 10, 1e-6, 0);
    CHECK_NEAR(fsdp_lr_at(&s, 4), 6e-4 * 5 / 10, 1e-6, 0);
    CHECK_NEAR(fsdp_lr_at(&s, 9), 6e-4, 1e-6, 0);
    CHECK_NEAR(fsdp_lr_at(&s, -3), 6e-4 * 1 / 10, 1e-6, 0);
    /* cosine: peak right after warmup, midpoint, end, and held after it */
    CHECK_NEAR(fsdp_lr_at(&s, 10), 6e-4, 1e-6, 0);
    CHECK_NEAR(fsdp_lr_at(&s, 60), 6e-5 + 0.5 * (6e-4 - 6e-5), 1e-6, 0);
    CHECK_NEAR(fsdp_lr_at(&s, 35), 6e-5 + 0.5 * (1 + cos(M_PI * 0.25)) * (6e-4 - 6e-5), 1e-6, 0);
    CHECK_NEAR(fsdp_lr_at(&s, 110), 6e-5, 1e-6, 0);
    CHECK_NEAR(fsdp_lr_at(&s, 1000), 6e-5, 1e-6, 0);
    /* monotone non-increasing after warmup */
    for (int64_t t = 10; t < 120; t++) CHECK(fsdp_lr_at(&s, t + 1) <= fsdp_lr_at(&s, t));
    /* constant */
    s.kind = FSDP_LR_CONSTANT;
    CHECK_NEAR(fsdp_lr_at(&s, 4), 6e-4 * 5 / 10, 1e-6, 0);
    CHECK(fsdp_lr_at(&s, 10) == 6e-4f);
    CHECK(fsdp_lr_at(&s, 1000) == 6e-4f);
    /* no warmup */
    struct fsdp_lr_sched c = {FSDP_LR_COSINE, 1.0f, 0.0f, 0, 100};
    CHECK(fsdp_lr_at(&c, 0) == 1.0f);
    CHECK_NEAR(fsdp_lr_at(&c, 50), 0.5, 1e-6, 0);
    CHECK_NEAR(fsdp_lr_at(&c, 100), 0.0, 0, 1e-7);
    /* total <= warmup: floor right after warmup */
    struct fsdp_lr_sched d = {FSDP_LR_COSINE, 1.0f, 0.1f, 5, 5};
    CHECK_NEAR(fsdp_lr_at(&d, 4), 1.0, 1e-6, 0);
    CHECK_NEAR(fsdp_lr_at(&d, 5), 0.1, 1e-6, 0);
}

/* ---- Against PyTorch (where python3-torch is installed) ---- */

static const char *torch_script =
    "import sys, torch\n"
    "tok = open(sys.argv[1]).read().split(); pos = 0\n"
    "def nxt():\n"
    "    global pos; pos += 1; return tok[pos - 1]\n"
    "kind = nxt(); n1 = int(nxt()); n2 = int(nxt()); steps = int(nxt())\n"
    "b1, b2, eps, wd, mom = (float(nxt()) for _ in range(5))\n"
    "def vec(n): return torch.tensor([float(nxt()) for _ in range(n)], dtype=torch.float32)\n"
    "p1 = torch.nn.Parameter(vec(n1)); p2 = torch.nn.Parameter(vec(n2))\n"
    "groups = [{'params': [p1], 'weight_decay': wd}, {'params': [p2], 'weight_decay': 0.0}]\n"
    "if kind == 'adamw': opt = torch.optim.AdamW(groups, lr=1e-3, betas=(b1, b2), eps=eps)\n"
    "else: opt = torch.optim.SGD(groups, lr=1e-3, momentum=mom)\n"
    "for s in range(steps):\n"
    "    lr = float(nxt()); scale = float(nxt())\n"
    "    p1.grad = vec(n1); p2.grad = vec(n2)\n"
    "    p1.grad.mul_(scale); p2.grad.mul_(scale)\n"
    "    for g in opt.param_groups: g['lr'] = lr\n"
    "    opt.step()\n"
    "out = [p1, p2]\n"
    "for p in (p1, p2):\n"
    "    st = opt.state[p]\n"
    "    if kind == 'adamw': out += [st['exp_avg'], st['exp_avg_sq']]\n"
    "    else: out += [st['momentum_buffer']]\n"
    "with open(sys.argv[2], 'w') as f:\n"
    "    for t in out: f.write(' '.join('%.9g' % x for x in t.detach().tolist()) + '\\n')\n";

static int have_torch(void) {
    return system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") == 0;
}

static void torch_case(enum fsdp_optim_kind kind) {
    if (!have_torch()) {
        test_skip("/usr/bin/python3 with torch is not available");
        return;
    }
    struct fsdp_ctx *ctx = new_ctx();
    struct fsdp_optim_opts o = fsdp_optim_opts_default();
    o.kind = kind;
    o.momentum = kind == FSDP_OPTIM_SGD ? 0.9f : 0.0f;
    o.eps = 1e-6f;
    o.weight_decay = kind == FSDP_OPTIM_SGD ? 0.01f : 0.1f;
    struct fsdp_optim *opt;
    ASSERT_OK(fsdp_optim_create(ctx, &o, &opt), ctx);
    const int k = fsdp_optim_state_per_elem(opt);

    enum { N1 = 13, N2 = 6, N = N1 + N2, STEPS = 5 };
    const float lrs[STEPS] = {1e-2f, 2e-2f, 5e-3f, 1e-2f, 3e-3f};
    const float scales[STEPS] = {1.0f, 0.5f, 1.0f, 0.3f, 1.0f};
    float p[N], g[STEPS][N], state[2 * N] = {0};
    fill(p, N, 1.0f);
    for (int s = 0; s < STEPS; s++) fill(g[s], N, s == 2 ? 1e-4f : 0.5f);

    char dir[] = "/tmp/fsdp_test_optim_XXXXXX";
    ASSERT(mkdtemp(dir) != NULL);
    char py[64], in[64], out[64], cmd[256];
    snprintf(py, sizeof py, "%s/ref.py", dir);
    snprintf(in, sizeof in, "%s/in.txt", dir);
    snprintf(out, sizeof out, "%s/out.txt", dir);
    FILE *f = fopen(py, "w");
    ASSERT(f);
    fputs(torch_script, f);
    fclose(f);
    f = fopen(in, "w");
    ASSERT(f);
    fprintf(f, "%s %d %d %d\n", kind == FSDP_OPTIM_ADAMW ? "adamw" : "sgd", N1, N2, STEPS);
    fprintf(f, "%.17g %.17g %.17g %.17g %.17g\n", (double)o.beta1, (double)o.beta2, (double)o.eps,
            (double)o.weight_decay, (double)o.momentum);
    for (int i = 0; i < N; i++) fprintf(f, "%.9g ", (double)p[i]);
    for (int s = 0; s < STEPS; s++) {
        fprintf(f, "\n%.17g %.17g\n", (double)lrs[s], (double)scales[s]);
        for (int i = 0; i < N; i++) fprintf(f, "%.9g ", (double)g[s][i]);
    }
    fclose(f);
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s %s %s", py, in, out);
    int rc = system(cmd);

    struct fsdp_optim_slice sl[2] = {{.param = p, .state = state, .n = N1, .state_stride = N, .decay = 1},
                                     {.param = p + N1, .state = state + N1, .n = N2, .state_stride = N, .decay = 0}};
    for (int s = 0; s < STEPS; s++) {
        sl[0].grad = g[s];
        sl[1].grad = g[s] + N1;
        fsdp_optim_step(opt, sl, 2, lrs[s], scales[s]);
    }

    /* torch's rows: p1, p2, then per parameter its state tensors */
    float want_p[N], want_s[2 * N];
    int ok = rc == 0 && (f = fopen(out, "r")) != NULL;
    if (ok) {
        for (int i = 0; i < N && ok; i++) ok = fscanf(f, "%f", &want_p[i]) == 1;
        for (int part = 0; part < 2 && ok; part++) {
            int lo = part ? N1 : 0, n = part ? N2 : N1;
            for (int st = 0; st < k && ok; st++)
                for (int i = 0; i < n && ok; i++) ok = fscanf(f, "%f", &want_s[st * N + lo + i]) == 1;
        }
        fclose(f);
    }
    unlink(py), unlink(in), unlink(out), rmdir(dir);
    if (!ok) {
        TEST_FAILF("running the torch reference failed (system rc %d)", rc);
        return;
    }
    check_close(p, want_p, N, 1e-6, 1e-7, "param vs torch");
    check_close(state, want_s, N, 1e-5, 1e-9, "state 0 vs torch");
    if (k == 2) check_close(state + N, want_s + N, N, 1e-5, 1e-12, "state 1 vs torch");
    fsdp_optim_free(opt);
    fsdp_ctx_free(ctx);
}

TEST(adamw_matches_torch) { torch_case(FSDP_OPTIM_ADAMW); }
TEST(sgd_matches_torch) { torch_case(FSDP_OPTIM_SGD); }

TEST_MAIN()
