/*
 * step_limit.c - the limit of a GPT training step on this machine, from
 * rates measured in this run (issue 19: "first write down the limit"): the
 * step's matrix products, shape class by shape class, at the rate the
 * layers' own products (fsdp__gemm_lp, fsdp__gemm_lp_batched, the per-head
 * fsdp__sgemm of the fp32 attention) reach on exactly those shapes, plus its
 * memory-bound passes (AdamW, norms, LayerNorm, GELU, residual adds, biases,
 * softmax, logits and loss, 16-bit casts, gathers) at the machine's measured
 * memory bandwidth. Nothing overlaps in the model: on two cores the
 * element-wise passes and the products run one after the other, so the
 * limit is the sum of the two.
 *
 * Prints, per configuration (fp32 and AMP_BF16; 1 rank x THREADS threads
 * over the global batch, and WORLD ranks x 1 thread each over 1/WORLD of
 * it), a table: class, GFLOP or GB a step, measured rate, seconds; then the
 * limit in seconds and as model FLOP/s over the plain fp32 (or bf16) GEMM
 * rate (fsdp_gemm_rate at B*T rows on THREADS threads, measured here too).
 * Lines "limit <config> <seconds> <fraction>", "phases <config> <forward>
 * <backward> <update>" (the limit split as fsdp-train's log splits a step)
 * and "product_flops <config> <FLOPs>" are for bench/step_limit.sh and the
 * test.
 *
 * [Note: oversubscribed ranks] WORLD ranks x 1 thread on THREADS cores: the
 * ranks time-share the cores, WORLD / THREADS ranks to a core. The products
 * are modelled as WORLD ranks' products at the 1-thread rate of the per-rank
 * shapes, divided over THREADS cores; the memory-bound passes as the bytes
 * of all ranks together at the THREADS-thread bandwidth (the cores share one
 * memory system). The collectives are counted as memory traffic only (shm:
 * copies through shared memory), their waits not at all.
 *
 * Rates are the fastest of repeated calls over about SECONDS a class
 * ([Note: the fastest product] in src/nn/gemm_rate.c), in three windows
 * ([Note: rounds]).
 *
 * Usage: build/bench/step_limit [model] [B] [T] [threads] [world] [seconds]
 *   (defaults gpt2 4 256 2 4 0.2; model gpt2 or tiny; `tiny 4 32 2 4 0.01`
 *    checks the program in a second)
 */
#include "comm/comm-impl.h"
#include "core/core-impl.h"
#include "nn/nn-impl.h"

#include <math.h>
#include <omp.h>
#include <string.h>

struct cfg {
    int64_t L, nh, C, V;
};

static double now(void) { return fsdp__now(); }

/* ---- memory bandwidth: STREAM-like copy and triad ---- */

/* Best GB/s of copy (a = b: 8 bytes an element) and triad (a = b + s c: 12
 * bytes) over n floats each, on `threads` threads; STREAM's byte counting
 * (no write-allocate traffic). Returns the larger of the two; *copy and
 * *triad get each. */
static double bandwidth(int64_t n, int threads, double seconds, double *copy, double *triad) {
    float *a = aligned_alloc(64, (size_t)n * sizeof(float));
    float *b = aligned_alloc(64, (size_t)n * sizeof(float));
    float *c = aligned_alloc(64, (size_t)n * sizeof(float));
    if (!a || !b || !c) {
        fprintf(stderr, "step_limit: out of memory for the bandwidth arrays\n");
        exit(1);
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) a[i] = 0.0f, b[i] = 1.0f, c[i] = 2.0f; /* first touch by the same threads */
    *copy = *triad = 0;
    for (int kind = 0; kind < 2; kind++) {
        double t_end = now() + seconds;
        for (int rep = 0; rep < 3 || now() < t_end; rep++) {
            double t0 = now();
            if (kind == 0) {
#pragma omp parallel for num_threads(threads) schedule(static)
                for (int64_t i = 0; i < n; i++) a[i] = b[i];
            } else {
#pragma omp parallel for num_threads(threads) schedule(static)
                for (int64_t i = 0; i < n; i++) a[i] = b[i] + 0.5f * c[i];
            }
            double gbs = (double)n * (kind ? 12.0 : 8.0) / (now() - t0) / 1e9;
            double *best = kind ? triad : copy;
            if (gbs > *best) *best = gbs;
        }
    }
    volatile float sink = a[n / 2];
    (void)sink;
    free(a), free(b), free(c);
    return *copy > *triad ? *copy : *triad;
}

/* ---- the products ---- */

static float *buf(int64_t n) { /* fp32 buffer of small values */
    float *p = aligned_alloc(64, (size_t)((n * 4 + 63) / 64 * 64));
    if (!p) {
        fprintf(stderr, "step_limit: out of memory (%lld floats)\n", (long long)n);
        exit(1);
    }
    for (int64_t i = 0; i < n; i++) p[i] = (float)(i % 13) * 0.01f;
    return p;
}

static uint16_t *buf16(enum fsdp_dtype dt, int64_t n) { /* the same values rounded */
    float *f = buf(n);
    uint16_t *p = aligned_alloc(64, (size_t)((n * 2 + 63) / 64 * 64));
    if (!p) exit(1);
    fsdp__cvt_from_f32(dt, f, p, (size_t)n);
    free(f);
    return p;
}

/* One product class: what run() does once, the FLOPs of one call. */
struct prod {
    int kind; /* 0 Linear-like fsdp__gemm_lp / _bias; 1 batched heads (16-bit); 2 fp32 per-head sgemm loop;
               * 3 16-bit heads one by one ([Note: heads one by one], src/nn/attention.c) */
    enum fsdp__att_product how; /* kinds 1, 2: which causal product (fsdp__attention_product) */
    int64_t group; /* kind 1: heads a call ([Note: head groups], src/nn/attention.c) */
    enum fsdp_dtype dt;
    int ta, tb; /* kind 0 (the attention products' follow from how) */
    int64_t M, N, K, batch;
    const void *A, *B;
    int64_t lda, ldb, ldc, sa, sb, sc;
    const float *bias;
    float *C;
    /* kind 2: operand layouts (0: a head's columns of qkv, row stride 3C;
     * 1: of y or dY, row stride C; 2: a dense T x T block per head), and
     * the three base pointers (qkv-like, y-like, T x T) */
    int la, lb, lc;
    int64_t nh, T, Cm, hs;
    float *qkv, *y, *tt, *dqkv; /* dqkv: where layout-0 outputs go (attention.c's dqkv) */
    /* kind 3: qkv and a thread's (T, T) and dense (T, hs) 16-bit operands;
     * outputs fp32 into tt, dqkv and a thread's dense (T, hs) th (layout 3) */
    const uint16_t *qkv16, *tt16, *th16;
    float *th;
};

/* kind 3's operand (out 0, 16-bit) or output (out 1, fp32) of head bh on thread me */
static void *head_view_ph(const struct prod *p, int layout, int out, int64_t bh, int64_t me, int64_t *ld) {
    int64_t b = bh / p->nh, h = bh % p->nh, o = b * p->T * 3 * p->Cm + h * p->hs;
    if (layout == 0) return *ld = 3 * p->Cm, out ? (void *)(p->dqkv + o) : (void *)(uintptr_t)(p->qkv16 + o);
    if (layout == 2) return *ld = p->T, out ? (void *)(p->tt + me * p->T * p->T)
                                            : (void *)(uintptr_t)(p->tt16 + me * p->T * p->T);
    return *ld = p->hs, out ? (void *)(p->th + me * p->T * p->hs) : (void *)(uintptr_t)(p->th16 + me * p->T * p->hs);
}

static float *head_view(const struct prod *p, int layout, int out, int64_t bh, int64_t *ld) {
    int64_t b = bh / p->nh, h = bh % p->nh;
    if (layout == 0) return *ld = 3 * p->Cm, (out ? p->dqkv : p->qkv) + b * p->T * 3 * p->Cm + h * p->hs;
    if (layout == 1) return *ld = p->Cm, p->y + b * p->T * p->Cm + h * p->hs;
    return *ld = p->T, p->tt + bh * p->T * p->T;
}

static void run(const struct prod *p) {
    if (p->kind == 0) {
        if (p->bias) fsdp__gemm_lp_bias(p->dt, p->ta, p->tb, p->M, p->N, p->K, p->A, p->lda, p->B, p->ldb, p->bias,
                                        p->C, p->ldc);
        else fsdp__gemm_lp(p->dt, p->ta, p->tb, p->M, p->N, p->K, 1.0f, p->A, p->lda, p->B, p->ldb, 0.0f, p->C,
                           p->ldc);
    } else if (p->kind == 1) { /* group by group, as attention.c runs them */
        size_t es = fsdp_dtype_size(p->dt);
        for (int64_t h0 = 0; h0 < p->batch; h0 += p->group) {
            int64_t g = p->batch - h0 < p->group ? p->batch - h0 : p->group;
            fsdp__attention_product(p->how, p->dt, g, p->T, p->hs, 1.0f, (const char *)p->A + (size_t)(h0 * p->sa) * es,
                                    p->lda, p->sa, (const char *)p->B + (size_t)(h0 * p->sb) * es, p->ldb, p->sb,
                                    p->C + h0 * p->sc, p->ldc, p->sc);
        }
    } else if (p->kind == 3) { /* attention.c's 16-bit heads one by one, a thread's scratch reused */
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t bh = 0; bh < p->batch; bh++) {
            int64_t lda, ldb, ldc, me = omp_get_thread_num();
            const void *A = head_view_ph(p, p->la, 0, bh, me, &lda), *B = head_view_ph(p, p->lb, 0, bh, me, &ldb);
            float *C = head_view_ph(p, p->lc, 1, bh, me, &ldc);
            fsdp__attention_product(p->how, p->dt, 1, p->T, p->hs, 1.0f, A, lda, 0, B, ldb, 0, C, ldc, 0);
        }
    } else { /* attention.c's fp32 loop: heads in parallel, one single-threaded sgemm each on strided views */
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t bh = 0; bh < p->batch; bh++) {
            int64_t lda, ldb, ldc;
            const float *A = head_view(p, p->la, 0, bh, &lda), *B = head_view(p, p->lb, 0, bh, &ldb);
            float *C = head_view(p, p->lc, 1, bh, &ldc);
            fsdp__attention_product(p->how, FSDP_F32, 1, p->T, p->hs, 1.0f, A, lda, 0, B, ldb, 0, C, ldc, 0);
        }
    }
}

/* GFLOP/s of the fastest call over about `seconds` (after an untimed one). */
static double rate(const struct prod *p, double seconds) {
    double flops = 2.0 * (double)p->M * (double)p->N * (double)p->K * (double)(p->batch ? p->batch : 1);
    run(p);
    double best = 0, t_end = now() + seconds;
    for (int rep = 0; rep < 2 || now() < t_end; rep++) {
        double t0 = now();
        run(p);
        double r = flops / fmax(now() - t0, 1e-9) / 1e9;
        if (r > best) best = r;
    }
    return best;
}

/* [Note: flushed caches] The rate above is the fastest of repeated calls on
 * one operand set, whose operands stay in cache between calls. In the step
 * each layer brings its own weights and activations: the same class then
 * runs nearer the mean call on operands from memory. So each class is also
 * timed as the mean of FLUSH_CALLS calls, each after writing a buffer of
 * FLUSH_BYTES (past the caches) outside the timing: the "flushed" column and
 * limit, a bound the step can come nearer. */
enum { FLUSH_CALLS = 3 };
static char *flush_buf;
static size_t flush_bytes;

static void flush_caches(void) {
    static unsigned char v;
    v++;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < flush_bytes; i += 64) flush_buf[i] = (char)v; /* every cache line written */
}

static double rate_flushed(const struct prod *p) {
    double flops = 2.0 * (double)p->M * (double)p->N * (double)p->K * (double)(p->batch ? p->batch : 1), t = 0;
    for (int k = 0; k < FLUSH_CALLS; k++) {
        flush_caches();
        double t0 = now();
        run(p);
        t += now() - t0;
    }
    return flops * FLUSH_CALLS / fmax(t, 1e-9) / 1e9;
}

/* ---- one configuration's table ---- */

struct row {
    char name[64];
    double amount; /* FLOPs or bytes a step (all ranks) */
    double rate;   /* GFLOP/s or GB/s */
    double sec;
    double flushed, flushed_sec; /* products: [Note: flushed caches]; memory-bound rows: rate, sec */
    double fwd; /* the share of it in fsdp-train's forward phase (the rest: backward, or update if upd) */
    int upd;
};

struct table {
    struct row r[48];
    int n;
    double flop_s, mem_s;
};

/* The last row's phase: a share in forward, the rest in backward, or update. */
static void phase(struct table *t, double fwd, int upd) {
    t->r[t->n - 1].fwd = fwd;
    t->r[t->n - 1].upd = upd;
}

static void add(struct table *t, const char *name, double amount, double rate_, double share) {
    if (t->n == (int)(sizeof t->r / sizeof t->r[0])) {
        fprintf(stderr, "step_limit: more than %d rows\n", t->n);
        exit(1);
    }
    struct row *r = &t->r[t->n++];
    snprintf(r->name, sizeof r->name, "%s", name);
    r->amount = amount;
    r->rate = r->flushed = rate_;
    r->sec = r->flushed_sec = amount / (rate_ * 1e9) / share;
}

/* A product class's row: fl FLOPs a step at p's measured rate, the share fwd of it in forward. */
static void add_product(struct table *t, const char *name, double fl, const struct prod *p, double seconds,
                        double share, double fwd) {
    add(t, name, fl, rate(p, seconds), share);
    phase(t, fwd, 0);
    struct row *r = &t->r[t->n - 1];
    r->flushed = rate_flushed(p);
    r->flushed_sec = fl / (r->flushed * 1e9) / share;
    t->flop_s += r->sec;
}

/* The products of one rank's step (Bn sequences of T tokens, all L layers)
 * in dtype dt on `threads` threads, each class timed; `ranks` ranks run the
 * same on `cores` cores ([Note: oversubscribed ranks]). */
static void products(struct table *t, const struct cfg *g, enum fsdp_dtype dt, int64_t Bn, int64_t T, int ranks,
                     int cores, double seconds) {
    int64_t N = Bn * T, C = g->C, L = g->L, hs = C / g->nh, BH = Bn * g->nh;
    double share = ranks > 1 ? cores : 1; /* 1 rank: the rate is already on all threads */
    int lp = dt != FSDP_F32;
    /* the Linears: (name, in, out, count a step, bias) */
    struct {
        const char *name;
        int64_t in, out, count;
        int bias;
    } lin[] = {{"c_attn", C, 3 * C, L, 1}, {"attn.c_proj", C, C, L, 1}, {"c_fc", C, 4 * C, L, 1},
               {"mlp.c_proj", 4 * C, C, L, 1}, {"lm_head", C, g->V, 1, 0}};
    for (size_t i = 0; i < sizeof lin / sizeof lin[0]; i++) {
        int64_t I = lin[i].in, O = lin[i].out;
        /* operands as linear.c holds them: x (N, I), w (O, I), dy (N, O);
         * in 16 bits all three are 16-bit copies made before the product
         * (their casts are memory passes below) */
        /* a bias-free 16-bit Linear takes dy in rows fsdp_rows16_stride(O) apart ([Note: padded rows]) */
        int64_t ldy = lp && !lin[i].bias ? fsdp_rows16_stride(O) : O;
        const void *x = lp ? (const void *)buf16(dt, N * I) : buf(N * I);
        const void *w = lp ? (const void *)buf16(dt, O * I) : buf(O * I);
        const void *dy = lp ? (const void *)buf16(dt, N * ldy) : buf(N * O);
        float *bias = lin[i].bias ? buf(O) : NULL, *y = buf(N * O), *dw = buf(O * I), *dx = buf(N * I);
        /* forward: y = x w^T (+ b, added in the product) */
        struct prod f = {.kind = 0, .dt = dt, .ta = 0, .tb = 1, .M = N, .N = O, .K = I, .A = x, .B = w, .lda = I,
                         .ldb = I, .ldc = O, .bias = bias, .C = y};
        /* dW = dy^T x (the first backward writes it: beta 0, [Note: unset gradients]) */
        struct prod bw = {.kind = 0, .dt = dt, .ta = 1, .tb = 0, .M = O, .N = I, .K = N, .A = dy, .B = x,
                          .lda = ldy, .ldb = I, .ldc = I, .C = dw};
        /* dX = dy w */
        struct prod bx = {.kind = 0, .dt = dt, .ta = 0, .tb = 0, .M = N, .N = I, .K = O, .A = dy, .B = w,
                          .lda = ldy, .ldb = I, .ldc = I, .C = dx};
        const char *orient[3] = {"fwd", "dW", "dX"};
        struct prod *ps[3] = {&f, &bw, &bx};
        for (int k = 0; k < 3; k++) {
            char name[64];
            snprintf(name, sizeof name, "%s %s (%lldx%lldx%lld)", lin[i].name, orient[k], (long long)ps[k]->M,
                     (long long)ps[k]->N, (long long)ps[k]->K);
            add_product(t, name, 2.0 * (double)(N * I * O) * (double)(lin[i].count * ranks), ps[k], seconds, share,
                        k == 0);
        }
        free((void *)x), free((void *)w), free((void *)dy), free(bias), free(y), free(dw), free(dx);
    }
    /* attention.c's products per layer: forward q k^T (T x T x hs) and
     * att v (T x hs x T); backward dY v^T, att^T dY, dS k, dS^T q; in 16
     * bits one more q k^T, the recomputed probabilities. Each runs as the
     * layer runs it, through fsdp__attention_product, which leaves out the
     * masked blocks ([Note: causal blocks], src/nn/attention.c): its rate
     * is the full product's (model) FLOPs per second, above the kernel's. */
    struct {
        const char *name;
        enum fsdp__att_product how; /* its transposes and causal blocks */
        int64_t M, N, K;            /* of the full product */
        int count;                  /* per layer */
    } att[] = {{"q k^T", FSDP__ATT_SCORES, T, T, hs, lp ? 2 : 1}, {"att v", FSDP__ATT_ROWS, T, hs, T, 1},
               {"dY v^T", FSDP__ATT_SCORES, T, T, hs, 1},            {"att^T dY", FSDP__ATT_COLS, T, hs, T, 1},
               {"dS k", FSDP__ATT_ROWS, T, hs, T, 1},                {"dS^T q", FSDP__ATT_COLS, T, hs, T, 1}};
    /* the row of att[i] measured with p (q k^T and att v run in forward) */
#define ATTN_ROW()                                                                                                 \
    do {                                                                                                           \
        char name[64];                                                                                             \
        snprintf(name, sizeof name, "attn %s (%lld x %lldx%lldx%lld)", att[i].name, (long long)BH,               \
                 (long long)att[i].M, (long long)att[i].N, (long long)att[i].K);                                 \
        add_product(t, name, 2.0 * (double)(T * T * hs) * (double)(BH * L * att[i].count * ranks), &p, seconds, \
                    share, i == 0 ? 1.0 / att[i].count : i == 1);                                                  \
    } while (0)
    /* a per-head class (kinds 2 and 3) of att[i], operands laid out as lay[i] */
#define HEAD_PROD(kind_, dt_)                                                                                      \
    (struct prod) {                                                                                                \
        .kind = (kind_), .how = att[i].how, .dt = (dt_), .M = att[i].M, .N = att[i].N, .K = att[i].K, .batch = BH, \
        .la = lay[i][0], .lb = lay[i][1], .lc = lay[i][2], .nh = g->nh, .T = T, .Cm = C, .hs = hs                 \
    }
    if (lp && fsdp__gemm_lp_gemm_based(dt)) { /* heads one by one, as attention.c runs them there */
        int64_t nthr = omp_get_max_threads();
        uint16_t *qkv16 = buf16(dt, N * 3 * C), *tt16 = buf16(dt, nthr * T * T), *th16 = buf16(dt, nthr * T * hs);
        float *tt = buf(nthr * T * T), *th = buf(nthr * T * hs), *o = buf(N * 3 * C);
        /* layouts (0: a head's columns of qkv / dqkv; 2: the thread's T x T;
         * 3: the thread's dense T x hs, y's or dY's head): q k^T: q, k, s; att v:
         * att, v, y; dY v^T: dY, v, ds; att^T dY: att, dY, dv; dS k: dS, k, dq;
         * dS^T q: dS, q, dk */
        int lay[6][3] = {{0, 0, 2}, {2, 0, 3}, {3, 0, 2}, {2, 3, 0}, {2, 0, 0}, {2, 0, 0}};
        for (size_t i = 0; i < sizeof att / sizeof att[0]; i++) {
            struct prod p = HEAD_PROD(3, dt);
            p.qkv16 = qkv16, p.tt16 = tt16, p.th16 = th16, p.tt = tt, p.th = th, p.dqkv = o;
            ATTN_ROW();
        }
        free(qkv16), free(tt16), free(th16), free(tt), free(th), free(o);
    } else if (lp) { /* head-major dense copies (B*nh, T, hs), probabilities (B*nh, T, T), all 16-bit */
        uint16_t *qh = buf16(dt, BH * T * hs), *kh = buf16(dt, BH * T * hs), *pt = buf16(dt, BH * T * T);
        float *out = buf(BH * T * T);
        for (size_t i = 0; i < sizeof att / sizeof att[0]; i++) {
            /* A is T x T (att, dS) when K = T or it is transposed (M, K) = (T, T): strides from the shapes */
            int a_tt = att[i].K == T && att[i].M == T; /* op(A) is T x T */
            const uint16_t *A = a_tt ? pt : qh;
            int64_t lda = a_tt ? T : hs, sa = a_tt ? T * T : T * hs;
            int64_t ldb = hs, sb = T * hs, ldc = att[i].N, sc = att[i].M * att[i].N;
            struct prod p = {.kind = 1, .how = att[i].how, .T = T, .hs = hs, .dt = dt, .M = att[i].M, .N = att[i].N,
                             .K = att[i].K, .batch = BH, .group = fsdp__attention_head_group(BH, T), .A = A, .B = kh,
                             .lda = lda, .ldb = ldb, .ldc = ldc, .sa = sa, .sb = sb, .sc = sc, .C = out};
            ATTN_ROW();
        }
        free(qh), free(kh), free(pt), free(out);
    } else { /* strided views into qkv (N, 3C) and y / dY (N, C), T x T blocks per head */
        float *qkv = buf(N * 3 * C), *yv = buf(N * C), *s = buf(BH * T * T), *o = buf(N * 3 * C);
        /* operand layouts as attention.c's fp32 loop: q k^T: q, k (qkv), s (T x T);
         * att v: s, v (qkv), y (C); dY v^T: dY (C), v, ds; att^T dY: att, dY, dv (qkv);
         * dS k: ds, k, dq (qkv); dS^T q: ds, q, dk (qkv) */
        int lay[6][3] = {{0, 0, 2}, {2, 0, 1}, {1, 0, 2}, {2, 1, 0}, {2, 0, 0}, {2, 0, 0}};
        for (size_t i = 0; i < sizeof att / sizeof att[0]; i++) {
            struct prod p = HEAD_PROD(2, FSDP_F32);
            p.qkv = qkv, p.dqkv = o, p.y = yv, p.tt = s;
            ATTN_ROW();
        }
        free(qkv), free(yv), free(s), free(o);
    }
}
#undef ATTN_ROW
#undef HEAD_PROD

/* The memory-bound passes of a step, in bytes over all ranks, from the code
 * (src/nn, src/optim, src/fsdp); each assumption beside its count. Per
 * token of one layer unless said; "rw" = read + write. A pass whose
 * operands stay in L2 (one head's T x T scores, one row of logits, an AdamW
 * chunk) costs only its first read and last write. */
static void memory(struct table *t, const struct cfg *g, int lp, int64_t Bn, int64_t T, int ranks, double bw,
                   double P, size_t window) {
    double C = (double)g->C, L = (double)g->L, V = (double)g->V, nh = (double)g->nh, Tt = (double)T;
    double tok = (double)(Bn * T) * ranks; /* tokens a step, all ranks */
    double Pr = P / ranks;                 /* each rank's shard */
    double es = lp ? 2 : 4;                /* a 16-bit hand-off writes the consumer's copy in 2 bytes */
    /* the ranks' shared window, where shm's bound (window: bytes) lets the
     * parameters in it ([Note: shared window] and [Note: 16-bit window] in
     * src/fsdp/unit.c): a training gather is then a barrier, no copy */
    int win = ranks > 1 && P * (lp ? 2 : 4) <= (double)window;
    /* AdamW (optim.c adamw_update): reads p, g, m, v, writes p, m, v (28 B a
     * parameter), and in the 16-bit window the copy there (2 B more; the
     * copy of --lp-shard-copy is not the default elsewhere, so the gathers
     * below cast instead); the parameter norm is fused (in L2) */
    add(t, win && lp ? "AdamW (p,g,m,v read; p,m,v,p16 written)" : "AdamW (p,g,m,v read; p,m,v written)",
        P * (win && lp ? 30 : 28), bw, 1);
    phase(t, 0, 1);
    /* the gradient norm for clipping: one read of the gradient shards */
    add(t, "gradient norm (g read)", P * 4, bw, 1);
    phase(t, 0, 1);
    /* LayerNorm (2 a layer + ln_f): forward reads x (4C), writes y (es C;
     * the input of c_attn / c_fc / lm_head); backward reads x, dy, writes dx (12C) */
    add(t, "LayerNorm fwd+bwd", tok * (2 * L + 1) * (4 * C + es * C + 12 * C), bw, 1);
    phase(t, (4 + es) / (16 + es), 0);
    /* GELU on 4C: forward reads h (16C), writes g (4C es); backward reads h,
     * dg, writes dh (48C) */
    add(t, "GELU fwd+bwd", tok * L * (16 * C + 4 * C * es + 48 * C), bw, 1);
    phase(t, (16 + 4 * es) / (64 + 4 * es), 0);
    /* residual adds (2 a layer): forward x += r (read 8C, write 4C); backward
     * the gradient sum dx = d + d_branch (12C) */
    add(t, "residual adds fwd+bwd", tok * L * 2 * 24 * C, bw, 1);
    phase(t, 0.5, 0);
    /* biases (c_attn 3C, c_proj C, c_fc 4C, mlp.c_proj C = 9C outputs):
     * the forward adds them in the product; backward sums the columns of dy
     * (read 36C) */
    add(t, "bias column sums", tok * L * 36 * C, bw, 1);
    phase(t, 0, 0);
    if (!lp) {
        /* fp32 attention: each head's scores stay in L2 through the softmax;
         * the probabilities (nh T floats a token) are written once and read
         * once in backward */
        add(t, "attention probabilities (saved, read back)", tok * L * nh * Tt * 8, bw, 1);
        phase(t, 0.5, 0);
    } else if (fsdp__gemm_lp_gemm_based(FSDP_BF16)) {
        /* 16-bit heads one by one: a head's T x T scores, probabilities and
         * dS stay in the thread's L2; what goes to memory: y's head rows
         * written in 16 bits (2C) and dY read (4C) for its 16-bit copy */
        add(t, "attention y and dY casts (heads one by one)", tok * L * 6 * C, bw, 1);
        phase(t, 2.0 / 6, 0);
    } else {
        /* 16-bit attention: the batched products write all heads' T x T
         * scores (out of L2): forward softmax rw (8), cast to 16 bits (4 + 2);
         * backward: recomputed softmax rw (8) and cast (6), softmax backward
         * reads att and dS, writes dS (12), cast dS (6): 44 bytes per score */
        add(t, "attention softmax + casts (T x T, 16-bit path)", tok * L * nh * Tt * 44, bw, 1);
        phase(t, 14.0 / 44, 0);
        /* head-major copies: forward q, k, v (read 2 x 3C, write 2 x 3C), y
         * scattered back (read 4C, write 2C); backward q, k, v again (12C), dY
         * (read 4C, write 2C), dq, dk, dv scattered (24C) */
        add(t, "attention head-major copies", tok * L * (12 * C + 6 * C + 12 * C + 6 * C + 24 * C), bw, 1);
        phase(t, 18.0 / 60, 0);
    }
    if (lp) {
        /* Linear backward casts dy to 16 bits: read 4, write 2 per output
         * (9C outputs a layer); widened, c_attn's forward rounds qkv to 16
         * bits from fp32 scratch (read 12C, write 6C), which native kernels
         * write rounded themselves ([Note: 16-bit output by the kernel]); the
         * other inputs arrive in 16 bits already ([Note: 16-bit hand-off],
         * counted with their producers) */
        double qkv = fsdp_gemm_native(FSDP_BF16) ? 0 : 18 * C;
        add(t, "Linear casts to 16 bits (dy; qkv)", tok * L * (9 * C * 6 + qkv), bw, 1);
        phase(t, qkv / (9 * C * 6 + qkv), 0);
    }
    /* embeddings: forward reads the wte row and wpe row, writes x (12C);
     * backward reads dx, adds into the wte and wpe gradient rows (rw 16C) */
    add(t, "embeddings fwd+bwd", tok * 32 * C, bw, 1);
    phase(t, 12.0 / 32, 0);
    /* logits (N, V), written by the lm_head product; the loss reads each
     * row once (in L2 for the max and the sum) and writes the gradient in
     * place: fp32, 8V. Under AMP the train step keeps them in 16 bits
     * ([Note: 16-bit model output]): the product's fp32 blocks (16 MiB, in
     * cache) are rounded into place (write 2), the loss reads 2 and writes
     * 2, and lm_head's backward takes the gradient as it is: 6V */
    add(t, lp ? "cross-entropy (+ logits rounding)" : "cross-entropy", tok * V * (lp ? 6 : 8), bw, 1);
    phase(t, 1, 0); /* forward's: the lm_head product's rounding and the loss */
    /* parameter gathers ([Note: sharding] src/fsdp/unit.c), twice a step
     * (forward, and backward after resharding): under AMP each rank first
     * casts its shard to 16 bits (read 4, write 2: 6P over all ranks,
     * [Note: low-precision gather and reduce]); with more than one rank the
     * all-gather then copies the full unit into each rank's buffer: read +
     * write of P x (4 or 2) bytes per rank (fp32 at 1 rank uses the shard
     * itself; in the window nothing moves). The gradient reduce-scatter
     * (ranks > 1, fp32): each rank reads every rank's part of its shard
     * (4P / ranks x ranks) and writes its shard. */
    double gath = win ? 0 : 2.0 * ((lp ? 6 * P : 0) + (ranks > 1 ? 2.0 * P * (lp ? 2 : 4) * ranks : 0));
    if (gath > 0) add(t, "parameter gathers (2 a step)", gath, bw, 1);
    if (gath > 0) phase(t, 0.5, 0);
    if (ranks > 1) add(t, "gradient reduce-scatter", ranks * (4 * P + 4 * Pr), bw, 1);
    if (ranks > 1) phase(t, 0, 0);
}

static void print_table(const char *title, struct table *t, int first_mem, double model_flops, double ref_rate,
                        const char *ref_name, const char *key) {
    printf("\n== %s ==\n", title);
    printf("%-52s %12s %10s %9s %9s %9s\n", "class", "GFLOP|GB", "GFLOP/s|GB/s", "seconds", "flushed", "seconds");
    double total = 0, total_fl = 0, flop_fl = 0;
    for (int i = 0; i < t->n; i++) {
        if (i == first_mem) printf("-- memory-bound passes --\n");
        if (i < first_mem)
            printf("%-52s %12.3f %10.1f %9.4f %9.1f %9.4f\n", t->r[i].name, t->r[i].amount / 1e9, t->r[i].rate,
                   t->r[i].sec, t->r[i].flushed, t->r[i].flushed_sec);
        else printf("%-52s %12.3f %10.1f %9.4f\n", t->r[i].name, t->r[i].amount / 1e9, t->r[i].rate, t->r[i].sec);
        total += t->r[i].sec;
        total_fl += t->r[i].flushed_sec;
        if (i < first_mem) flop_fl += t->r[i].flushed_sec;
        if (i >= first_mem) t->mem_s += t->r[i].sec;
    }
    double pf = 0;
    for (int i = 0; i < first_mem; i++) pf += t->r[i].amount;
    printf("products %.3f s + memory-bound %.3f s = limit %.3f s\n", t->flop_s, t->mem_s, total);
    double ph[3] = {0, 0, 0}; /* forward, backward, update */
    for (int i = 0; i < t->n; i++) {
        const struct row *r = &t->r[i];
        if (r->upd) ph[2] += r->sec;
        else ph[0] += r->fwd * r->sec, ph[1] += (1 - r->fwd) * r->sec;
    }
    printf("phases %s %.6g %.6g %.6g (forward, backward, update seconds)\n", key, ph[0], ph[1], ph[2]);
    printf("product_flops %s %.0f\n", key, pf); /* all ranks: the model's FLOPs (+ the recompute in 16 bits) */
    printf("limit %s %.6g %.4g (model %.1f GFLOP a step at the limit = %.1f GFLOP/s = %.3f of the %s rate %.1f)\n",
           key, total, model_flops / total / 1e9 / ref_rate, model_flops / 1e9, model_flops / total / 1e9,
           model_flops / total / 1e9 / ref_rate, ref_name, ref_rate);
    printf("limit_flushed %s %.6g %.4g (products %.3f s at their flushed mean rates + memory-bound %.3f s; "
           "[Note: flushed caches])\n", key, total_fl, model_flops / total_fl / 1e9 / ref_rate, flop_fl, t->mem_s);
}

int main(int argc, char **argv) {
    const char *model = argc > 1 ? argv[1] : "gpt2";
    int64_t B = argc > 2 ? atol(argv[2]) : 4, T = argc > 3 ? atol(argv[3]) : 256;
    int threads = argc > 4 ? atoi(argv[4]) : 2, world = argc > 5 ? atoi(argv[5]) : 4;
    double seconds = argc > 6 ? atof(argv[6]) : 0.2;
    struct cfg g;
    if (!strcmp(model, "gpt2")) g = (struct cfg){12, 12, 768, 50257};
    else if (!strcmp(model, "tiny")) g = (struct cfg){2, 2, 32, 256}; /* src/models/gpt.c's preset */
    else return fprintf(stderr, "step_limit: model '%s' is not gpt2 or tiny\n", model), 2;
    if (B < 1 || T < 1 || threads < 1 || world < 1 || B % world || !(seconds > 0))
        return fprintf(stderr, "step_limit: need B, T, threads, world >= 1, world dividing B, seconds > 0\n"), 2;
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.comm = FSDP_COMM_SELF;
    co.threads = threads;
    struct fsdp_ctx *ctx;
    if (fsdp_ctx_create(&co, &ctx) != FSDP_OK) return 1;
    int64_t C = g.C, L = g.L, N = B * T;
    /* parameters: wte (V C, tied to lm_head), wpe (1024 C, gpt2's block; tiny 64),
     * per layer 12 C^2 + 13 C (weights, biases, two LayerNorms), ln_f 2C */
    double P = (double)(g.V * C + (strcmp(model, "tiny") ? 1024 : 64) * C + L * (12 * C * C + 13 * C) + 2 * C);
    double n_matmul = (double)(L * 12 * C * C + C * g.V);
    double model_flops = (6.0 * n_matmul + 12.0 * (double)(L * T * C)) * (double)N; /* fsdp-train's count */
    printf("step_limit: %s (L %lld, C %lld, heads %lld, V %lld, %.1fM parameters), batch %lld x %lld, "
           "%d threads / %d ranks x 1 thread, %.2f s a class\n",
           model, (long long)L, (long long)C, (long long)g.nh, (long long)g.V, P / 1e6, (long long)B, (long long)T,
           threads, world, seconds);
    printf("model FLOPs a step (6 N_matmul + 12 L T C per token): %.1f GFLOP\n", model_flops / 1e9);
    int native = fsdp_gemm_native(FSDP_BF16);
    printf("bf16 products: %s\n", native ? "native kernels (oneDNN)" : "widened to fp32 (no native bf16 here)");
    printf("the library's vector paths: %s (the CPU's best: %s; FSDP_MAX_CPU_ISA caps them)\n",
           fsdp__isa_name(fsdp__cpu_isa()), fsdp__isa_name(fsdp__cpu_isa_detected()));

    /* the plain rates (fsdp_gemm_rate: M x 768 x 3072 at the global rows) */
    double r32 = 0, r16 = 0;
    omp_set_num_threads(threads);
    int64_t rows = N < 65536 ? N : 65536;
    if (fsdp_gemm_rate(ctx, FSDP_F32, rows, 5 * seconds, &r32) != FSDP_OK ||
        fsdp_gemm_rate(ctx, FSDP_BF16, rows, 5 * seconds, &r16) != FSDP_OK)
        return fprintf(stderr, "%s\n", fsdp_errmsg(ctx)), 1;
    printf("gemm_gflops %.1f (fp32, %d threads, %lldx768x3072)\n", r32, threads, (long long)rows);
    printf("gemm_bf16_gflops %.1f (bf16, %d threads, %lldx768x3072)\n", r16, threads, (long long)rows);

    /* bandwidth over arrays far beyond the L3 (3 x 64 MiB; tiny: 3 x 1 MiB) */
    int64_t bn = strcmp(model, "tiny") ? (64 << 20) / 4 : (1 << 20) / 4;
    double cp, tr, bw2 = bandwidth(bn, threads, 5 * seconds, &cp, &tr);
    printf("bandwidth %d threads: copy %.1f GB/s, triad %.1f GB/s\n", threads, cp, tr);
    double bw1 = bandwidth(bn, 1, 5 * seconds, &cp, &tr);
    printf("bandwidth 1 thread: copy %.1f GB/s, triad %.1f GB/s\n", cp, tr);
    (void)bw1;

    int huge;
    size_t window = fsdp__shm_window_bound(ctx, &huge); /* what shm would map at `world` ranks */
    if (window == SIZE_MAX) printf("shm window: any size (shmem huge pages)\n");
    else printf("shm window: up to %zu MiB (a model's parameters in it gather in place)\n", window >> 20);
    flush_bytes = strcmp(model, "tiny") ? (size_t)256 << 20 : (size_t)1 << 20; /* [Note: flushed caches] */
    flush_buf = malloc(flush_bytes);
    if (!flush_buf) return fprintf(stderr, "step_limit: no memory for the flush buffer\n"), 1;
    memset(flush_buf, 0, flush_bytes);
    /* [Note: rounds] each class is timed in ROUNDS windows of seconds / ROUNDS,
     * one per pass over all four configurations, and keeps its fastest: a busy
     * minute then slows one window of a class, not all of it */
    const char *names[2] = {"fp32", "AMP_BF16"};
    enum { ROUNDS = 3 };
    static struct table tab[4];
    for (int round = 0; round < ROUNDS; round++) {
        for (int c = 0; c < 4; c++) {
            int lp = c / 2, multi = c % 2, ranks = multi ? world : 1;
            struct table u = {0};
            omp_set_num_threads(multi ? 1 : threads);
            products(&u, &g, lp ? FSDP_BF16 : FSDP_F32, B / ranks, T, ranks, threads, seconds / ROUNDS);
            for (int i = 0; i < u.n; i++) {
                struct row best = round == 0 || u.r[i].rate > tab[c].r[i].rate ? u.r[i] : tab[c].r[i];
                if (round > 0 && tab[c].r[i].flushed > u.r[i].flushed) /* the fastest flushed mean too */
                    best.flushed = tab[c].r[i].flushed, best.flushed_sec = tab[c].r[i].flushed_sec;
                else best.flushed = u.r[i].flushed, best.flushed_sec = u.r[i].flushed_sec;
                tab[c].r[i] = best;
            }
            tab[c].n = u.n;
        }
    }
    /* the bandwidth again after the products: the larger of the two */
    double cp2, tr2, bw2b = bandwidth(bn, threads, 5 * seconds, &cp2, &tr2);
    printf("bandwidth %d threads, again: copy %.1f GB/s, triad %.1f GB/s; using %.1f GB/s\n", threads, cp2, tr2,
           bw2b > bw2 ? bw2b : bw2);
    if (bw2b > bw2) bw2 = bw2b;
    for (int c = 0; c < 4; c++) {
        int lp = c / 2, multi = c % 2, ranks = multi ? world : 1;
        struct table *t = &tab[c];
        t->flop_s = 0;
        for (int i = 0; i < t->n; i++) t->flop_s += t->r[i].sec;
        int first_mem = t->n;
        memory(t, &g, lp, B / ranks, T, ranks, bw2, P, window);
        char title[160], key[64];
        snprintf(title, sizeof title, "%s, %d rank%s x %d thread%s, %lld tokens a rank", names[lp], ranks,
                 ranks > 1 ? "s" : "", multi ? 1 : threads, multi || threads == 1 ? "" : "s",
                 (long long)(N / ranks));
        snprintf(key, sizeof key, "%s_%dx%d", lp ? "bf16" : "fp32", ranks, multi ? 1 : threads);
        print_table(title, t, first_mem, model_flops, lp ? r16 : r32, lp ? "bf16 GEMM" : "fp32 GEMM", key);
    }
    omp_set_num_threads(threads);
    free(flush_buf);
    fsdp_ctx_free(ctx);
    return 0;
}
