/*
 * attention.c - CausalSelfAttention as nanoGPT: qkv = c_attn(x) with q, k, v
 * in that order along the 3C axis; per (batch b, head h) with head size
 * hs = C / n_head:  att = softmax_causal(q k^T / sqrt(hs)),  y = att v;
 * out = c_proj(y).
 * Saves: qkv (B, T, 3C) and, computing in fp32, the attention probabilities
 * att (B, nh, T, T), both in the arena; masked entries (j > t) of att are
 * stored as zeros. In 16 bits it saves only qkv ([Note: recomputed
 * probabilities]).
 * fp32: the (b, h) pairs run in parallel with single-threaded GEMMs each, on
 * strided views into qkv (row stride 3C) and y (row stride C), so no head is
 * ever copied out.
 * 16-bit compute ([Note: compute precision]): [Note: batched heads] q, k, v
 * (and in backward dY) are cast once into head-major 16-bit copies (B*nh, T,
 * hs), dense, and every product runs as one batched matmul over a group of
 * heads (fsdp__gemm_lp_batched; [Note: head groups]): oneDNN takes its AMX
 * kernels only for dense operands, and one call per product and group
 * instead of one per head removes a per-call setup that cost more than the
 * arithmetic (48 heads x 6 products x 12 layers of 256 x 256 x 64 in GPT-2).
 * The probabilities are cast row by row, and the heads' results (fp32,
 * head-major) are scattered back into
 * y / dqkv. The softmax and its backward stay fp32; qkv is saved in 16
 * bits (below) and the backward makes its head-major copies again rather
 * than keeping them alive. All 16-bit scratch is released before the layer
 * returns. Where 2-D bf16 products run on oneDNN's gemm-based kernel the
 * heads instead run one by one as in fp32, on strided views, and where the
 * products are widened, one by one on fp32 copies of each head ([Note: heads
 * one by one]).
 * [Note: recomputed probabilities] On the 16-bit path the backward
 * recomputes att from the saved 16-bit qkv (heads_probs_lp: the same batched
 * product with the same shapes, hence the same oneDNN primitive, and the same
 * row-wise softmax) instead of keeping the fp32 (B, nh, T, T) tensor from
 * forward: the same bits for one more q k^T product per layer (1/6 of the
 * heads' products), and a Block keeps nh*T*4 bytes less per token (12 KiB
 * for GPT-2 at T = 256, the largest activation of a Block; quadratic in T).
 * [Note: 16-bit hand-off]: the input goes to c_attn as it comes (16-bit if
 * c_attn computes in it); on the 16-bit path c_attn is asked for qkv in 16
 * bits (what the head-major copies round it to anyway, so that is what is
 * saved), and the heads are scattered into y rounded to c_proj's compute
 * dtype when c_proj takes it.
 */
#include "nn/nn-impl.h"

#include <math.h>
#include <omp.h>

/* [Note: whole vectors] A causal row's softmax and its backward run over
 * j <= t, 1 to T elements: with 16-float vectors a row left up to 15
 * elements to the loops' scalar tails, each with its own exp, and GPT-2's
 * rows average 128. Every pass runs instead to the next multiple of 16 (at
 * most T), the lanes past t selected to zero (the causal blocks' edges are
 * multiples of 16, so those lanes were written by the row's product): one
 * head's 256 rows 50 -> 35 us (a scratch program). The sums now add the
 * tail's lanes in vector order: the last bits differ from the scalar tails'
 * (4e-7 relative at most there), the same on every run. The heads one by
 * one ([Note: heads one by one]) also stop each row there: the thread's
 * fp32 rows keep no zeros past it (nothing reads them) and its 16-bit rows
 * are cast up to it, their zeros past it written once a layer (ab_zeroed). */
static int64_t whole_vectors(int64_t t, int64_t T) {
    int64_t n = (t + 16) / 16 * 16;
    return n < T ? n : T;
}

#if defined(__x86_64__) || defined(__i386__)
/* [Note: softmax rows in registers] The loops below, written for the
 * compiler's vectoriser, ran each row's max and sum through the stack (its
 * reductions store and reload the partial vector every iteration) and built
 * the lanes' j <= t masks from 64-bit indices: one head's 256 rows took
 * 33.5 us. With AVX-512 the rows run on 16-lane registers instead, the
 * causal edge one mask on the row's last vector: 12.0 us (a scratch
 * program), softmax's backward likewise. Each lane's exp is fsdp__expf's
 * (fsdp__expf16, the same bits); the max is exact in any order; the sums
 * add 16 lane partials, then the lanes in _mm512_reduce_add_ps's order, so
 * their last bits may differ from the loops' (4e-7 relative at most): the
 * same on every run, and forward and the recompute share this code. The
 * loops stay in every build, the rows of a CPU run below the AVX512 level
 * ([Note: vector paths at run time]) and the reference the registers' are
 * checked against (tests/test_nn.c
 * softmax_rows_match_the_loops, fast_expf16_gives_the_scalar_bits). */

/* lanes [0, k) of a 16-lane vector, k in [0, 16] and beyond */
FSDP__TARGET_AVX512 static inline __mmask16 lanes_below(int64_t k) {
    return k >= 16 ? (__mmask16)0xffff : k <= 0 ? (__mmask16)0 : (__mmask16)((1u << k) - 1u);
}

FSDP__TARGET_AVX512 static void softmax_row_regs(float *row, int64_t t, int64_t T, int tail) {
    int64_t n = whole_vectors(t, T);
    __m512 mx = _mm512_set1_ps(row[0]);
    for (int64_t j = 0; j < n; j += 16) { /* lanes j + l <= t (< n) */
        __mmask16 live = lanes_below(t + 1 - j);
        mx = _mm512_mask_max_ps(mx, live, _mm512_maskz_loadu_ps(live, row + j), mx);
    }
    __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx)), sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 in = lanes_below(n - j), live = lanes_below(t + 1 - j);
        __m512 e = _mm512_maskz_mov_ps(live, fsdp__expf16(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, row + j), top)));
        _mm512_mask_storeu_ps(row + j, in, e);
        sum = _mm512_add_ps(sum, e);
    }
    __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 in = lanes_below(n - j);
        _mm512_mask_storeu_ps(row + j, in, _mm512_mul_ps(_mm512_maskz_loadu_ps(in, row + j), inv));
    }
    for (int64_t j = n; j < (tail ? T : 0); j++) row[j] = 0.0f;
}

FSDP__TARGET_AVX512 static void softmax_bwd_row_regs(const float *a, float *d, int64_t t, int64_t T, int tail) {
    int64_t n = whole_vectors(t, T);
    __m512 dot = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 live = lanes_below(t + 1 - j);
        dot = _mm512_add_ps(dot, _mm512_mul_ps(_mm512_maskz_loadu_ps(live, a + j), _mm512_maskz_loadu_ps(live, d + j)));
    }
    __m512 s = _mm512_set1_ps(_mm512_reduce_add_ps(dot));
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 in = lanes_below(n - j), live = lanes_below(t + 1 - j);
        __m512 aj = _mm512_maskz_loadu_ps(live, a + j), dj = _mm512_maskz_loadu_ps(live, d + j);
        __m512 g = _mm512_mul_ps(aj, _mm512_sub_ps(dj, s));
        _mm512_mask_storeu_ps(d + j, in, _mm512_maskz_mov_ps(live, g));
    }
    for (int64_t j = n; j < (tail ? T : 0); j++) d[j] = 0.0f;
}
#endif

/* Causal softmax of row t (length T) in place: over j <= t, zeros after
 * (up to whole_vectors(t, T) only when tail is 0). The loops every build
 * has: the layer's rows without AVX-512, the reference of the registers'
 * (tests/test_nn.c) with it. */
void fsdp__softmax_row_loops(float *row, int64_t t, int64_t T, int tail) {
    int64_t n = whole_vectors(t, T);
    float mx = row[0];
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < n; j++) mx = j <= t && row[j] > mx ? row[j] : mx;
    float sum = 0.0f;
    const struct fsdp__exp_range er = fsdp__exp_range(); /* [Note: exp range] */
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; j++) {
        float e = j <= t ? fsdp__expf(row[j] - mx, er) : 0.0f;
        row[j] = e;
        sum += e;
    }
    float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t j = 0; j < n; j++) row[j] *= inv;
    for (int64_t j = n; j < (tail ? T : 0); j++) row[j] = 0.0f;
}

/* Softmax backward of row t: d = a * (d - sum_j a_j d_j) over j <= t, zeros
 * after (up to whole_vectors(t, T) only when tail is 0). */
void fsdp__softmax_bwd_row_loops(const float *a, float *d, int64_t t, int64_t T, int tail) {
    int64_t n = whole_vectors(t, T);
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < n; j++) dot += j <= t ? a[j] * d[j] : 0.0f;
#pragma omp simd
    for (int64_t j = 0; j < n; j++) d[j] = j <= t ? a[j] * (d[j] - dot) : 0.0f;
    for (int64_t j = n; j < (tail ? T : 0); j++) d[j] = 0.0f;
}

/* The rows the layer runs: on registers where the CPU runs AVX-512 */
void fsdp__softmax_row(float *row, int64_t t, int64_t T, int tail) {
#if defined(__x86_64__) || defined(__i386__)
    if (fsdp__cpu_isa() >= FSDP__ISA_AVX512) {
        softmax_row_regs(row, t, T, tail);
        return;
    }
#endif
    fsdp__softmax_row_loops(row, t, T, tail);
}

void fsdp__softmax_bwd_row(const float *a, float *d, int64_t t, int64_t T, int tail) {
#if defined(__x86_64__) || defined(__i386__)
    if (fsdp__cpu_isa() >= FSDP__ISA_AVX512) {
        softmax_bwd_row_regs(a, d, t, T, tail);
        return;
    }
#endif
    fsdp__softmax_bwd_row_loops(a, d, t, T, tail);
}

/* Head-major operand copy: dst (B*nh, T, hs) dense, of the operand dtype od
 * ([Note: widened operands], precision.c), from the columns [col0, col0 +
 * nh*hs) of src (B*T rows, row stride ld) of dtype sdt: fp32 or lp. */
static void heads_to_operand(enum fsdp_dtype lp, enum fsdp_dtype od, enum fsdp_dtype sdt, const void *src,
                             int64_t ld, int64_t col0, int64_t B, int64_t T, int64_t nh, int64_t hs, void *dst) {
    size_t es = fsdp_dtype_size(od), ses = fsdp_dtype_size(sdt);
#pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < (fsdp__measuring ? 0 : B * T); bt++) {
        int64_t b = bt / T, t = bt % T;
        for (int64_t h = 0; h < nh; h++) /* inside the loop: a serial cast */
            fsdp__to_operand(lp, od, sdt, (const char *)src + (size_t)(bt * ld + col0 + h * hs) * ses,
                             (char *)dst + (size_t)(((b * nh + h) * T + t) * hs) * es, (size_t)hs);
    }
}

/* The inverse scatter: src (B*nh, T, hs) dense into the columns
 * [col0, col0 + nh*hs) of dst (B*T rows, row stride ld), elements of dtype
 * dt (FSDP_F32: copied; 16-bit: rounded). */
static void heads_from(const float *src, int64_t B, int64_t T, int64_t nh, int64_t hs, enum fsdp_dtype dt,
                       void *dst, int64_t ld, int64_t col0) {
    size_t es = fsdp_dtype_size(dt);
#pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < (fsdp__measuring ? 0 : B * T); bt++) {
        int64_t b = bt / T, t = bt % T;
        for (int64_t h = 0; h < nh; h++) { /* inside the loop: a serial cast */
            const float *s = src + ((b * nh + h) * T + t) * hs;
            char *d = (char *)dst + (size_t)(bt * ld + col0 + h * hs) * es;
            if (dt == FSDP_F32) memcpy(d, s, (size_t)hs * sizeof(float));
            else fsdp__cvt_from_f32(dt, s, d, (size_t)hs);
        }
    }
}

static enum fsdp_status lp_nomem(struct fsdp_ctx *ctx, enum fsdp_dtype lp) {
    return fsdp__arena_err(ctx, "out of memory for attention %s scratch in the activation arena",
                     fsdp_dtype_name(lp));
}

/* [Note: causal blocks] Half of every (T, T) product of a causal head is
 * masked: the probabilities and dS are zero above the diagonal. So each
 * product runs over blocks of rows (query positions) or columns (key
 * positions) and leaves out the parts that only meet zeros:
 *  - scores, S = alpha A B^T (q k^T, dY v^T): query rows [r0, r1) against
 *    keys [0, r1) only; what lies right of r1 is past the diagonal, never
 *    read (the softmax and its backward read j <= t and write the zeros);
 *  - rows, C = alpha P B (att v, dS k): rows [r0, r1) of P (T, T) against
 *    keys [0, r1) only, the rest of those rows being zeros;
 *  - columns, C = alpha P^T B (att^T dY, dS^T q): keys [c0, c1) against query
 *    rows [c0, T) only.
 * nb blocks do (nb + 1) / (2 nb) of the full products' work: 5/8 at 4, 3/4
 * at 2, but each block is a call of its own. fp32 runs 4 (per-head sgemm
 * calls, cheap to make: GPT-2's attention 104-119 ms a step at 1, 95 at 2,
 * 89 at 4, bench/README.md 2026-12-05); the 16-bit path 2: its batched
 * matmuls cost a oneDNN call each, and the blocks' strided operands run on
 * oneDNN's gemm-based batched kernel instead of brgemm (122.7 ms at 1,
 * 119.4 at 2). Leaving out exact zeros changes no sum's value, but each
 * block is a product of its own shape, whose kernel may block the sums
 * differently from the whole one; forward and the backward's recompute run
 * the same blocks ([Note: recomputed probabilities]). The blocks' edges are
 * multiples of 16 rows. */
#define ATT_CAUSAL_BLOCKS 4    /* fp32: per-head sgemm calls */
#define ATT_CAUSAL_BLOCKS_LP 2 /* 16 bits: batched oneDNN matmuls */

/* Edge i of T positions cut into nb blocks (edge 0 = 0, edge nb = T). */
static int64_t causal_edge(int64_t T, int i, int nb) {
    int64_t e = (T * i / nb + 15) / 16 * 16;
    return i == nb || e > T ? T : e;
}

void fsdp__attention_product(enum fsdp__att_product how, enum fsdp_dtype dt, int64_t g, int64_t T, int64_t hs,
                             float alpha, const void *A, int64_t lda, int64_t sa, const void *B, int64_t ldb,
                             int64_t sb, float *C, int64_t ldc, int64_t sc) {
    size_t es = fsdp_dtype_size(dt);
    const char *a = A, *b = B;
    int nb = dt == FSDP_F32 ? ATT_CAUSAL_BLOCKS : ATT_CAUSAL_BLOCKS_LP;
    for (int i = 0; i < nb; i++) {
        int64_t e0 = causal_edge(T, i, nb), e1 = causal_edge(T, i + 1, nb);
        if (e1 <= e0) continue;
        if (how == FSDP__ATT_SCORES) /* C[e0:e1, 0:e1] = A[e0:e1] B[0:e1]^T */
            fsdp__gemm_lp_batched(dt, g, 0, 1, e1 - e0, e1, hs, alpha, a + (size_t)(e0 * lda) * es, lda, sa, b, ldb,
                                  sb, 0.0f, C + e0 * ldc, ldc, sc);
        else if (how == FSDP__ATT_ROWS) /* C[e0:e1] = A[e0:e1, 0:e1] B[0:e1] */
            fsdp__gemm_lp_batched(dt, g, 0, 0, e1 - e0, hs, e1, alpha, a + (size_t)(e0 * lda) * es, lda, sa, b, ldb,
                                  sb, 0.0f, C + e0 * ldc, ldc, sc);
        else /* C[e0:e1] = A[e0:T, e0:e1]^T B[e0:T] */
            fsdp__gemm_lp_batched(dt, g, 1, 0, e1 - e0, hs, T - e0, alpha, a + (size_t)(e0 * lda + e0) * es, lda, sa,
                                  b + (size_t)(e0 * ldb) * es, ldb, sb, 0.0f, C + e0 * ldc, ldc, sc);
    }
}

struct attention {
    int64_t C;
    int n_head;
    struct fsdp_module *c_attn, *c_proj; /* children, owned by the module */
    const void *qkv;                     /* (B, T, 3C) saved, arena, in dtype qkv_dt */
    enum fsdp_dtype qkv_dt;              /* fp32, or lp when c_attn handed it in 16 bits */
    enum fsdp_dtype lp;                  /* compute dtype of the last forward */
    float *att;                          /* (B, nh, T, T) saved probabilities, arena (fp32 path) */
    int64_t B, T;
    float *kc, *vc;        /* [Note: decoding cache]: keys, values (cB, nh, cap, hs), or NULL */
    int64_t cB, cap, at;   /* its sequences, positions, and the next forward's first position */
};

/* [Note: head groups]
 * The 16-bit path's (T, T) scores, probabilities and dS of all B*nh heads
 * are 12.6 MB each in fp32 for GPT-2 (B 4, T 256), so every pass over them
 * (a product, the softmax and its cast, the next product) went to memory.
 * The heads run in groups whose fp32 (T, T) buffer is ATT_GROUP_BYTES (8
 * heads at T = 256), so that it stays in cache: one group's products,
 * softmax and casts, then the next group's; the buffers are a group's size.
 * Each head's values are the same whatever the grouping (each head is its
 * own entry of the batched product and its own rows of the softmax), and
 * the backward's recompute uses the same groups. */
#define ATT_GROUP_BYTES ((int64_t)2 << 20)

int64_t fsdp__attention_head_group(int64_t BH, int64_t T) {
    int64_t g = ATT_GROUP_BYTES / (T * T * (int64_t)sizeof(float));
    return g < 1 ? 1 : g > BH ? BH : g;
}

/* att (BH, T, T) = softmax(scale q k^T) from the head-major operands q and k
 * (dtype od, [Note: widened operands]) of BH heads (a group of them: the scores product, then the
 * causal softmax row by row), and ab, its rounding to lp (dtype od), each
 * row cast while it is in cache: forward and the backward's recompute run
 * this same code on the same operands, so the two give the same bits
 * ([Note: recomputed probabilities]). */
static void heads_probs_lp(enum fsdp_dtype lp, enum fsdp_dtype od, const void *q, const void *k, int64_t BH,
                           int64_t T, int64_t hs, float *att, void *ab) {
    float scale = 1.0f / sqrtf((float)hs);
    size_t es = fsdp_dtype_size(od);
    fsdp__attention_product(FSDP__ATT_SCORES, od, BH, T, hs, scale, q, hs, T * hs, k, hs, T * hs, att, T, T * T);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < (fsdp__measuring ? 0 : BH * T); r++) {
        fsdp__softmax_row(att + r * T, r % T, T, 1);
        fsdp__to_operand(lp, od, FSDP_F32, att + r * T, (char *)ab + (size_t)(r * T) * es, (size_t)T);
    }
}

/* [Note: heads one by one] Where oneDNN runs 2-D bf16 products on its
 * gemm-based kernel ([Note: bf16 kernels]: AVX512-BF16 without AMX, or
 * FSDP_GEMM_BF16=gemm), the 16-bit path runs like fp32's: each thread takes
 * one (b, h) head at a time, its products single-threaded 2-D matmuls on
 * strided views into qkv (row stride 3C) and dqkv, the softmax, its backward
 * and their 16-bit casts on the thread's own (T, T) scratch, which stays in
 * its core's cache: no head-major copies, no group barriers, and the heads
 * go to whichever thread is free. A scratch program (GPT-2: B 4, T 256, 12
 * heads of 64, 2 threads, mean of 35) timed one layer's heads at 3.0 ms
 * forward and 6.2 backward against 3.5 and 7.5 for [Note: batched heads],
 * with the same bits (the kernel sums each K = 64 or T-long dot product
 * alike in both). Where the products are widened ([Note: widened operands]:
 * no 16-bit kernels for lp), the heads run one by one too, on fp32's
 * per-head products: each thread makes its head's q, k and v as fp32
 * holding the values lp rounds them to (widened from a 16-bit qkv, rounded
 * from an fp32 one) in its own scratch, and the probabilities and dS are
 * rounded in fp32 (GPT-2 widened, by `--profile`: the attention layers 54
 * -> 35-41 ms a step forward, 111-114 -> 66-74 backward, bench/README.md
 * 2026-12-06).
 * Elsewhere (AMX, whose kernels oneDNN takes for dense operands; native
 * fp16; qkv handed in fp32 to native kernels) the batched path stays. */
static int per_head(enum fsdp_dtype lp, enum fsdp_dtype qdt) {
    if (fsdp__operand_dtype(lp) == FSDP_F32) return 1; /* widened */
    return lp == FSDP_BF16 && qdt == lp && fsdp__gemm_lp_gemm_based(lp);
}

/* Zeroes the (T, T) operand scratch (es bytes an element) of each of nthr
 * threads (per elements a thread), once per layer call: every head then
 * writes each row t only up to whole_vectors(t, T), so the zeros past it,
 * which the causal blocks' products read up to their edge, stay ([Note:
 * whole vectors]). */
static void ab_zeroed(void *ab, size_t es, int64_t nthr, int64_t T, int64_t per) {
    for (int64_t i = 0; i < (fsdp__measuring ? 0 : nthr); i++)
        memset((char *)ab + (size_t)(i * per) * es, 0, (size_t)(T * T) * es);
}

/* Whether a head's q, k, v are read in place from qkv (16-bit, multiplied
 * as they are), or made first (head_operands). */
static int head_in_place(enum fsdp_dtype lp, enum fsdp_dtype od, enum fsdp_dtype qdt) { return qdt == lp && od == lp; }

/* One head's q, k, v (T, hs each, row stride 3C in qkv of dtype qdt) as the
 * operands the products take (od): in place where they are those already
 * (head_in_place: *q.. point into qkv, *ld = 3C), else made in own (3 T hs
 * elements of od, dense: *ld = hs), holding the values lp rounds them to. */
static void head_operands(enum fsdp_dtype lp, enum fsdp_dtype od, enum fsdp_dtype qdt, const void *qkv, int64_t C,
                          int64_t T, int64_t hs, void *own, const void **q, const void **k, const void **v,
                          int64_t *ld) {
    size_t qs = fsdp_dtype_size(qdt), es = fsdp_dtype_size(od);
    const char *src = qkv;
    *ld = 3 * C;
    *q = src, *k = src + (size_t)C * qs, *v = src + (size_t)(2 * C) * qs;
    if (head_in_place(lp, od, qdt)) return;
    for (int part = 0; part < 3; part++)
        for (int64_t t = 0; t < T; t++)
            fsdp__to_operand(lp, od, qdt, src + (size_t)(t * 3 * C + part * C) * qs,
                             (char *)own + (size_t)((part * T + t) * hs) * es, (size_t)hs);
    *ld = hs;
    *q = own, *k = (char *)own + (size_t)(T * hs) * es, *v = (char *)own + (size_t)(2 * T * hs) * es;
}

/* One head's probabilities: att (T, T) = softmax(scale q k^T) and ab, its
 * rounding to lp as operands of dtype od; q and k (T, hs) of od, row stride
 * ld. Forward and the backward's recompute both run this ([Note: recomputed
 * probabilities]). */
static void head_probs_ph(enum fsdp_dtype lp, enum fsdp_dtype od, const void *q, const void *k, int64_t ld,
                          int64_t T, int64_t hs, float *att, void *ab) {
    size_t es = fsdp_dtype_size(od);
    fsdp__attention_product(FSDP__ATT_SCORES, od, 1, T, hs, 1.0f / sqrtf((float)hs), q, ld, 0, k, ld, 0, att, T, 0);
    for (int64_t t = 0; t < T; t++) { /* ab's zeros past whole_vectors were written once (ab_zeroed) */
        fsdp__softmax_row(att + t * T, t, T, 0);
        fsdp__to_operand(lp, od, FSDP_F32, att + t * T, (char *)ab + (size_t)(t * T) * es,
                         (size_t)whole_vectors(t, T));
    }
}

static enum fsdp_status heads_forward_ph(struct fsdp_ctx *ctx, enum fsdp_dtype lp, enum fsdp_dtype qdt,
                                         const void *qkv, int64_t B, int64_t T, int64_t nh, int64_t hs,
                                         enum fsdp_dtype ydt, void *y) {
    int64_t C = nh * hs, nthr = omp_get_max_threads();
    enum fsdp_dtype od = fsdp__operand_dtype(lp);
    int64_t per = T * T + (head_in_place(lp, od, qdt) ? 0 : 3 * T * hs); /* ab; the head's operands */
    size_t mark = fsdp_arena_mark(ctx), ys = fsdp_dtype_size(ydt), es = fsdp_dtype_size(od),
           qs = fsdp_dtype_size(qdt);
    float *att = fsdp_arena_alloc(ctx, (size_t)(nthr * (T * T + T * hs)) * sizeof(float)); /* att, then yh */
    char *ab = fsdp_arena_alloc(ctx, (size_t)(nthr * per) * es);
    if (!att || !ab) return lp_nomem(ctx, lp);
    ab_zeroed(ab, es, nthr, T, per);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < (fsdp__measuring ? 0 : B * nh); bh++) {
        int64_t b = bh / nh, h = bh % nh, me = omp_get_thread_num(), ld;
        float *s = att + me * (T * T + T * hs), *yh = s + T * T;
        char *a = ab + (size_t)(me * per) * es;
        const void *q, *k, *v;
        head_operands(lp, od, qdt, (const char *)qkv + (size_t)(b * T * 3 * C + h * hs) * qs, C, T, hs,
                      a + (size_t)(T * T) * es, &q, &k, &v, &ld);
        head_probs_ph(lp, od, q, k, ld, T, hs, s, a);
        fsdp__attention_product(FSDP__ATT_ROWS, od, 1, T, hs, 1.0f, a, T, 0, v, ld, 0, yh, hs, 0);
        for (int64_t t = 0; t < T; t++)
            fsdp__cvt_from_f32(ydt, yh + t * hs, (char *)y + (size_t)((b * T + t) * C + h * hs) * ys, (size_t)hs);
    }
    fsdp_arena_release(ctx, mark);
    return FSDP_OK;
}

/* The backward of heads_forward_ph: dqkv (B, T, 3C) fp32, every element
 * written by one head's products straight into its columns. */
static enum fsdp_status heads_backward_ph(struct fsdp_ctx *ctx, enum fsdp_dtype lp, enum fsdp_dtype qdt,
                                          const void *qkv, const float *dy, int64_t B, int64_t T, int64_t nh,
                                          int64_t hs, float *dqkv) {
    int64_t C = nh * hs, nthr = omp_get_max_threads();
    enum fsdp_dtype od = fsdp__operand_dtype(lp);
    int64_t per = T * T + T * hs + (head_in_place(lp, od, qdt) ? 0 : 3 * T * hs); /* att, dS; dY; q k v */
    size_t mark = fsdp_arena_mark(ctx), es = fsdp_dtype_size(od), qs = fsdp_dtype_size(qdt);
    float *att = fsdp_arena_alloc(ctx, (size_t)(nthr * 2 * T * T) * sizeof(float)); /* att and dS */
    char *ab = fsdp_arena_alloc(ctx, (size_t)(nthr * per) * es);
    if (!att || !ab) return lp_nomem(ctx, lp);
    ab_zeroed(ab, es, nthr, T, per);
    float scale = 1.0f / sqrtf((float)hs);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < (fsdp__measuring ? 0 : B * nh); bh++) {
        int64_t b = bh / nh, h = bh % nh, me = omp_get_thread_num(), ld;
        float *dq = dqkv + b * T * 3 * C + h * hs, *dk = dq + C, *dv = dq + 2 * C;
        float *s = att + me * 2 * T * T, *ds = s + T * T;
        char *a = ab + (size_t)(me * per) * es, *dyh = a + (size_t)(T * T) * es;
        const void *q, *k, *v;
        head_operands(lp, od, qdt, (const char *)qkv + (size_t)(b * T * 3 * C + h * hs) * qs, C, T, hs,
                      dyh + (size_t)(T * hs) * es, &q, &k, &v, &ld);
        for (int64_t t = 0; t < T; t++)
            fsdp__to_operand(lp, od, FSDP_F32, dy + (b * T + t) * C + h * hs, dyh + (size_t)(t * hs) * es, (size_t)hs);
        head_probs_ph(lp, od, q, k, ld, T, hs, s, a);
        /* datt = dY v^T;  dv = att^T dY */
        fsdp__attention_product(FSDP__ATT_SCORES, od, 1, T, hs, 1.0f, dyh, hs, 0, v, ld, 0, ds, T, 0);
        fsdp__attention_product(FSDP__ATT_COLS, od, 1, T, hs, 1.0f, a, T, 0, dyh, hs, 0, dv, 3 * C, 0);
        for (int64_t t = 0; t < T; t++) { /* dS, rounded over att's copy */
            fsdp__softmax_bwd_row(s + t * T, ds + t * T, t, T, 0);
            fsdp__to_operand(lp, od, FSDP_F32, ds + t * T, a + (size_t)(t * T) * es, (size_t)whole_vectors(t, T));
        }
        /* dq = scale dS k;  dk = scale dS^T q */
        fsdp__attention_product(FSDP__ATT_ROWS, od, 1, T, hs, scale, a, T, 0, k, ld, 0, dq, 3 * C, 0);
        fsdp__attention_product(FSDP__ATT_COLS, od, 1, T, hs, scale, a, T, 0, q, ld, 0, dk, 3 * C, 0);
    }
    fsdp_arena_release(ctx, mark);
    return FSDP_OK;
}

/* att = softmax(scale q k^T), y = att v: the 16-bit path; y (B, T, C) in
 * dtype ydt. The probabilities are scratch here: backward recomputes them. */
static enum fsdp_status heads_forward_lp(struct fsdp_ctx *ctx, enum fsdp_dtype lp, enum fsdp_dtype qdt,
                                         const void *qkv, int64_t B, int64_t T, int64_t nh, int64_t hs,
                                         enum fsdp_dtype ydt, void *y) {
    if (per_head(lp, qdt)) return heads_forward_ph(ctx, lp, qdt, qkv, B, T, nh, hs, ydt, y);
    int64_t C = nh * hs, BH = B * nh, G = fsdp__attention_head_group(BH, T), n = BH * T * hs;
    enum fsdp_dtype od = fsdp__operand_dtype(lp); /* [Note: widened operands] */
    size_t es = fsdp_dtype_size(od), mark = fsdp_arena_mark(ctx);
    char *q = fsdp_arena_alloc(ctx, (size_t)(3 * n) * es); /* q, k, v head-major */
    float *att = fsdp_arena_alloc(ctx, (size_t)(G * T * T) * sizeof(float));
    void *ab = fsdp_arena_alloc(ctx, (size_t)(G * T * T) * es);
    float *yh = fsdp_arena_alloc(ctx, (size_t)n * sizeof(float));
    if (!q || !att || !ab || !yh) return lp_nomem(ctx, lp);
    char *k = q + n * es, *v = k + n * es;
    heads_to_operand(lp, od, qdt, qkv, 3 * C, 0, B, T, nh, hs, q);
    heads_to_operand(lp, od, qdt, qkv, 3 * C, C, B, T, nh, hs, k);
    heads_to_operand(lp, od, qdt, qkv, 3 * C, 2 * C, B, T, nh, hs, v);
    for (int64_t h0 = 0; h0 < BH; h0 += G) { /* [Note: head groups] */
        int64_t g = BH - h0 < G ? BH - h0 : G, o = h0 * T * hs;
        heads_probs_lp(lp, od, q + o * es, k + o * es, g, T, hs, att, ab);
        fsdp__attention_product(FSDP__ATT_ROWS, od, g, T, hs, 1.0f, ab, T, T * T, v + o * es, hs, T * hs, yh + o, hs,
                                T * hs);
    }
    heads_from(yh, B, T, nh, hs, ydt, y, C, 0);
    fsdp_arena_release(ctx, mark);
    return FSDP_OK;
}

/* [Note: decoding cache] Generating a token after a prefix of T ran the
 * whole prefix through the model again: GPT-2 sampling 120 tokens after
 * training took 5-11 s, nearly all of it rows whose outputs were known.
 * With a cache (fsdp_gpt_set_cache, src/models/gpt.c) an eval-mode forward
 * takes only the new positions at..at+n-1: c_attn makes their q, k and v,
 * k and v go into the cache at their positions, and each new query attends
 * over the cache's keys 0..its own position, one head at a time on its
 * thread. The values are those the full forward multiplies: q, k and v as
 * the heads' operands hold them (fsdp__to_operand: rounded to lp on the
 * 16-bit path) and on that path the probabilities rounded to lp, the
 * softmax the same rows' code; the dot products and sums run in fp32 in
 * another order than the GEMMs', so the logits agree with the full
 * forward's to rounding (tests/test_mpi_decode.c), not bit for bit.
 * Nothing is saved for a backward (none may follow: eval mode). */
enum fsdp_status fsdp__attention_set_cache(struct fsdp_ctx *ctx, struct fsdp_module *m, int64_t B, int64_t cap) {
    struct attention *A = m->impl;
    free(A->kc);
    A->kc = A->vc = NULL;
    A->cB = A->cap = A->at = 0;
    if (B <= 0 || cap <= 0) return FSDP_OK;
    size_t n = (size_t)(B * cap * A->C);
    A->kc = fsdp__malloc(2 * n * sizeof(float));
    if (!A->kc)
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "CausalSelfAttention '%s': out of memory for a decoding cache of "
                         "%lld x %lld positions (%.1f MiB)", fsdp__mname(m), (long long)B, (long long)cap,
                         (double)(2 * n * sizeof(float)) / 1048576.0);
    A->vc = A->kc + n;
    A->cB = B;
    A->cap = cap;
    return FSDP_OK;
}

void fsdp__attention_cache_at(struct fsdp_module *m, int64_t at) { ((struct attention *)m->impl)->at = at; }

/* y (B, n, C) of dtype ydt: the heads of positions at..at+n-1 from qkv (B, n,
 * 3C) of dtype qdt over the cache, which takes their k and v ([Note:
 * decoding cache]) */
static enum fsdp_status heads_decode(struct fsdp_ctx *ctx, struct attention *A, enum fsdp_dtype lp,
                                     enum fsdp_dtype qdt, const void *qkv, int64_t B, int64_t n,
                                     enum fsdp_dtype ydt, void *y) {
    int64_t C = A->C, nh = A->n_head, hs = C / nh, at = A->at, cap = A->cap;
    int64_t row = (at + n + 15) / 16 * 16; /* a score row: room for whole_vectors */
    size_t qs = fsdp_dtype_size(qdt);
    float *q = fsdp__scratch(ctx, B * n * C, "attention queries (decoding)");
    float *s = q ? fsdp__scratch(ctx, B * nh * row, "attention scores (decoding)") : NULL;
    float *yf = s ? (ydt == FSDP_F32 ? (float *)y : fsdp__scratch(ctx, B * n * C, "attention heads (decoding)"))
                  : NULL;
    if (!yf) return FSDP_ERR_NOMEM;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < (fsdp__measuring ? 0 : B * n); r++) { /* the rows' operands; k, v into the cache */
        int64_t b = r / n, t = r % n;
        const char *src = (const char *)qkv + (size_t)(r * 3 * C) * qs;
        fsdp__to_operand(lp, FSDP_F32, qdt, src, q + r * C, (size_t)C);
        for (int64_t h = 0; h < nh; h++) {
            size_t o = (size_t)(((b * nh + h) * cap + at + t) * hs);
            fsdp__to_operand(lp, FSDP_F32, qdt, src + (size_t)(C + h * hs) * qs, A->kc + o, (size_t)hs);
            fsdp__to_operand(lp, FSDP_F32, qdt, src + (size_t)(2 * C + h * hs) * qs, A->vc + o, (size_t)hs);
        }
    }
    float scale = 1.0f / sqrtf((float)hs);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < (fsdp__measuring ? 0 : B * nh); bh++) {
        int64_t b = bh / nh, h = bh % nh;
        const float *kh = A->kc + (size_t)(bh * cap * hs), *vh = A->vc + (size_t)(bh * cap * hs);
        float *sr = s + bh * row;
        for (int64_t t = 0; t < n; t++) {
            const float *qr = q + (b * n + t) * C + h * hs;
            int64_t len = at + t + 1;
            for (int64_t j = 0; j < len; j++) {
                float d = 0.0f;
#pragma omp simd reduction(+ : d)
                for (int64_t e = 0; e < hs; e++) d += qr[e] * kh[j * hs + e];
                sr[j] = scale * d;
            }
            fsdp__softmax_row(sr, len - 1, row, 0);
            if (lp != FSDP_F32) fsdp__cvt_round(lp, sr, sr, (size_t)len); /* the probabilities as operands */
            float *yr = yf + (b * n + t) * C + h * hs;
            for (int64_t e = 0; e < hs; e++) yr[e] = 0.0f;
            for (int64_t j = 0; j < len; j++) {
                float p = sr[j];
#pragma omp simd
                for (int64_t e = 0; e < hs; e++) yr[e] += p * vh[j * hs + e];
            }
        }
    }
    if (ydt != FSDP_F32) fsdp__cvt_from_f32(ydt, yf, y, (size_t)(B * n * C));
    return FSDP_OK;
}

static enum fsdp_status attention_forward(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                          const struct fsdp_tensor *in, struct fsdp_tensor *out) {
    struct attention *A = m->impl;
    enum fsdp_dtype idt = fsdp__linear_input_dtype(A->c_attn);
    FSDP_TRY(fsdp__check_input(ctx, m, in, in && in->dtype == idt ? idt : FSDP_F32, 3, A->C));
    int64_t B = in->shape[0], T = in->shape[1], C = A->C, nh = A->n_head, hs = C / nh;
    enum fsdp_dtype lp = fsdp__compute_dtype(m);
    struct fsdp_tensor qkv = {0};
    qkv.dtype = lp; /* asked in 16 bits on the 16-bit path; c_attn may still answer fp32 */
    FSDP_TRY(fsdp_module_forward(A->c_attn, ctx, in, &qkv)); /* (B, T, 3C) */
    A->qkv = NULL; /* no backward until this forward has ended */
    if (A->kc) { /* [Note: decoding cache]: the GPT checked its own mode, sequences and positions */
        if (m->training) /* a Block set back to train mode below an eval GPT (fsdp_module_set_training) */
            return fsdp__err(ctx, FSDP_ERR_STATE, "attention '%s': a decoding cache is set (fsdp_gpt_set_cache), "
                             "so its forwards run in eval mode, but this module is in train mode", fsdp__mname(m));
        FSDP_ASSERT(B == A->cB && A->at + T <= A->cap, "attention '%s': positions %lld..%lld of "
                    "%lld sequences, decoding cache of %lld of %lld", fsdp__mname(m), (long long)A->at,
                    (long long)(A->at + T - 1), (long long)B, (long long)A->cap, (long long)A->cB);
        struct fsdp_tensor y = {0};
        int64_t yshape[3] = {B, T, C};
        enum fsdp_dtype ydt = lp != FSDP_F32 ? fsdp__linear_input_dtype(A->c_proj) : FSDP_F32;
        FSDP_TRY(fsdp__tensor_prepare(ctx, &y, ydt, 3, yshape, "attention heads output"));
        FSDP_TRY(heads_decode(ctx, A, lp, qkv.dtype, qkv.data, B, T, ydt, y.data));
        return fsdp_module_forward(A->c_proj, ctx, &y, out);
    }
    float *att = NULL; /* fp32: kept for backward; 16-bit: recomputed there */
    if (lp == FSDP_F32 && !(att = fsdp__scratch(ctx, B * nh * T * T, "attention probabilities")))
        return FSDP_ERR_NOMEM;
    struct fsdp_tensor y = {0};
    int64_t yshape[3] = {B, T, C};
    enum fsdp_dtype ydt = lp != FSDP_F32 ? fsdp__linear_input_dtype(A->c_proj) : FSDP_F32;
    FSDP_TRY(fsdp__tensor_prepare(ctx, &y, ydt, 3, yshape, "attention heads output"));
    const float *q_all = qkv.data; /* fp32 path: qkv is fp32 */
    float *y_all = y.data; /* (B, T, C), head h in columns [h*hs, (h+1)*hs); fp32 here unless handed off */
    if (lp != FSDP_F32) {
        FSDP_TRY(heads_forward_lp(ctx, lp, qkv.dtype, qkv.data, B, T, nh, hs, ydt, y.data));
    } else {
        float scale = 1.0f / sqrtf((float)hs);
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t bh = 0; bh < (fsdp__measuring ? 0 : B * nh); bh++) {
            int64_t b = bh / nh, h = bh % nh;
            const float *q = q_all + b * T * 3 * C + h * hs; /* (T, hs), row stride 3C */
            const float *k = q + C, *v = q + 2 * C;
            float *s = att + bh * T * T; /* (T, T) */
            fsdp__attention_product(FSDP__ATT_SCORES, FSDP_F32, 1, T, hs, scale, q, 3 * C, 0, k, 3 * C, 0, s, T, 0);
            for (int64_t t = 0; t < T; t++) fsdp__softmax_row(s + t * T, t, T, 1);
            fsdp__attention_product(FSDP__ATT_ROWS, FSDP_F32, 1, T, hs, 1.0f, s, T, 0, v, 3 * C, 0,
                                    y_all + b * T * C + h * hs, C, 0);
        }
    }
    A->lp = lp;
    A->qkv = qkv.data;
    A->qkv_dt = qkv.dtype;
    A->att = att;
    A->B = B;
    A->T = T;
    return fsdp_module_forward(A->c_proj, ctx, &y, out);
}

/* The backward products of all heads at once, 16-bit inputs ([Note: batched
 * heads]); dqkv (B, T, 3C) is written whole. */
static enum fsdp_status heads_backward_lp(struct fsdp_ctx *ctx, enum fsdp_dtype lp, enum fsdp_dtype qdt,
                                          const void *qkv, const float *dy, int64_t B, int64_t T, int64_t nh,
                                          int64_t hs, float *dqkv) {
    if (per_head(lp, qdt)) return heads_backward_ph(ctx, lp, qdt, qkv, dy, B, T, nh, hs, dqkv);
    int64_t C = nh * hs, BH = B * nh, n = BH * T * hs, G = fsdp__attention_head_group(BH, T);
    enum fsdp_dtype od = fsdp__operand_dtype(lp); /* [Note: widened operands] */
    size_t es = fsdp_dtype_size(od), mark = fsdp_arena_mark(ctx);
    char *q = fsdp_arena_alloc(ctx, (size_t)(4 * n) * es); /* q, k, v, dY head-major */
    char *ab = fsdp_arena_alloc(ctx, (size_t)(G * T * T) * es);       /* att, then dS */
    float *att = fsdp_arena_alloc(ctx, (size_t)(G * T * T) * sizeof(float)); /* recomputed */
    float *ds = fsdp_arena_alloc(ctx, (size_t)(G * T * T) * sizeof(float));
    float *dh = fsdp_arena_alloc(ctx, (size_t)(3 * n) * sizeof(float)); /* dq, dk, dv head-major */
    if (!q || !ab || !att || !ds || !dh) return lp_nomem(ctx, lp);
    char *k = q + n * es, *v = k + n * es, *dyh = v + n * es;
    for (int part = 0; part < 3; part++)
        heads_to_operand(lp, od, qdt, qkv, 3 * C, part * C, B, T, nh, hs, q + part * n * (int64_t)es);
    heads_to_operand(lp, od, FSDP_F32, dy, C, 0, B, T, nh, hs, dyh);
    float scale = 1.0f / sqrtf((float)hs);
    for (int64_t h0 = 0; h0 < BH; h0 += G) { /* [Note: head groups] */
        int64_t g = BH - h0 < G ? BH - h0 : G, o = h0 * T * hs;
        heads_probs_lp(lp, od, q + o * es, k + o * es, g, T, hs, att, ab);
        /* datt = dY v^T;  dv = att^T dY */
        fsdp__attention_product(FSDP__ATT_SCORES, od, g, T, hs, 1.0f, dyh + o * es, hs, T * hs, v + o * es, hs,
                                T * hs, ds, T, T * T);
        fsdp__attention_product(FSDP__ATT_COLS, od, g, T, hs, 1.0f, ab, T, T * T, dyh + o * es, hs, T * hs,
                                dh + 2 * n + o, hs, T * hs);
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < (fsdp__measuring ? 0 : g * T); r++) { /* dS, and its rounding over att's in ab */
            fsdp__softmax_bwd_row(att + r * T, ds + r * T, r % T, T, 1);
            fsdp__to_operand(lp, od, FSDP_F32, ds + r * T, ab + (size_t)(r * T) * es, (size_t)T);
        }
        /* dq = scale dS k;  dk = scale dS^T q */
        fsdp__attention_product(FSDP__ATT_ROWS, od, g, T, hs, scale, ab, T, T * T, k + o * es, hs, T * hs, dh + o,
                                hs, T * hs);
        fsdp__attention_product(FSDP__ATT_COLS, od, g, T, hs, scale, ab, T, T * T, q + o * es, hs, T * hs,
                                dh + n + o, hs, T * hs);
    }
    for (int part = 0; part < 3; part++) heads_from(dh + part * n, B, T, nh, hs, FSDP_F32, dqkv, 3 * C, part * C);
    fsdp_arena_release(ctx, mark);
    return FSDP_OK;
}

/* Per (b, h), with dY the gradient of y's head slice:
 *   datt = dY v^T;  dv = att^T dY;  dS = att * (datt - rowsum(att * datt));
 *   dq = scale dS k;  dk = scale dS^T q. */
static enum fsdp_status attention_backward(struct fsdp_module *m, struct fsdp_ctx *ctx,
                                           const struct fsdp_tensor *dout, struct fsdp_tensor *din) {
    struct attention *A = m->impl;
    if (!A->qkv)
        return fsdp__err(ctx, FSDP_ERR_STATE, "CausalSelfAttention '%s': backward without forward", fsdp__mname(m));
    FSDP_TRY(fsdp__check_input(ctx, m, dout, FSDP_F32, 3, A->C));
    int64_t B = A->B, T = A->T, C = A->C, nh = A->n_head, hs = C / nh;
    if (dout->shape[0] != B || dout->shape[1] != T)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "CausalSelfAttention '%s': gradient is (%lld, %lld, C), forward "
                         "was (%lld, %lld, C)", fsdp__mname(m), (long long)dout->shape[0],
                         (long long)dout->shape[1], (long long)B, (long long)T);
    struct fsdp_tensor dy = {0};
    FSDP_TRY(fsdp_module_backward(A->c_proj, ctx, dout, &dy)); /* (B, T, C) */
    struct fsdp_tensor dqkv = {0};
    int64_t shape[3] = {B, T, 3 * C};
    FSDP_TRY(fsdp__tensor_prepare(ctx, &dqkv, FSDP_F32, 3, shape, "attention qkv gradient"));
    const float *q_all = A->qkv, *dy_all = dy.data;
    float *dq_all = dqkv.data;
    if (A->lp != FSDP_F32) {
        FSDP_TRY(heads_backward_lp(ctx, A->lp, A->qkv_dt, A->qkv, dy_all, B, T, nh, hs, dq_all));
        return fsdp_module_backward(A->c_attn, ctx, &dqkv, din);
    }
    int nthr = omp_get_max_threads();
    float *scratch = fsdp__scratch(ctx, (int64_t)nthr * T * T, "attention backward scratch");
    if (!scratch) return FSDP_ERR_NOMEM;
    float scale = 1.0f / sqrtf((float)hs);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < (fsdp__measuring ? 0 : B * nh); bh++) {
        int64_t b = bh / nh, h = bh % nh;
        const float *q = q_all + b * T * 3 * C + h * hs, *k = q + C, *v = q + 2 * C; /* (T, hs), stride 3C */
        float *dq = dq_all + b * T * 3 * C + h * hs, *dk = dq + C, *dv = dq + 2 * C;
        const float *dY = dy_all + b * T * C + h * hs; /* (T, hs), stride C */
        const float *att = A->att + bh * T * T;        /* (T, T) */
        float *ds = scratch + (int64_t)omp_get_thread_num() * T * T; /* (T, T) */
        fsdp__attention_product(FSDP__ATT_SCORES, FSDP_F32, 1, T, hs, 1.0f, dY, C, 0, v, 3 * C, 0, ds, T, 0);
        fsdp__attention_product(FSDP__ATT_COLS, FSDP_F32, 1, T, hs, 1.0f, att, T, 0, dY, C, 0, dv, 3 * C, 0);
        for (int64_t t = 0; t < T; t++) fsdp__softmax_bwd_row(att + t * T, ds + t * T, t, T, 1);
        fsdp__attention_product(FSDP__ATT_ROWS, FSDP_F32, 1, T, hs, scale, ds, T, 0, k, 3 * C, 0, dq, 3 * C, 0);
        fsdp__attention_product(FSDP__ATT_COLS, FSDP_F32, 1, T, hs, scale, ds, T, 0, q, 3 * C, 0, dk, 3 * C, 0);
    }
    return fsdp_module_backward(A->c_attn, ctx, &dqkv, din);
}

static void attention_destroy(struct fsdp_module *m) {
    struct attention *A = m->impl;
    if (A) free(A->kc);
    free(A);
}

static const struct fsdp_module_ops attention_ops = {"CausalSelfAttention", attention_forward,
                                                     attention_backward, attention_destroy};

enum fsdp_dtype fsdp__attention_input_dtype(const struct fsdp_module *m) {
    return m->ops == &attention_ops ? fsdp__linear_input_dtype(((const struct attention *)m->impl)->c_attn)
                                    : FSDP_F32;
}

enum fsdp_status fsdp__attention_create(struct fsdp_ctx *ctx, const char *name, int64_t C, int n_head,
                                        float proj_std, struct fsdp_module **out_m) {
    if (C <= 0 || n_head <= 0 || C % n_head != 0)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "CausalSelfAttention '%s': n_embd %lld is not a positive "
                         "multiple of n_head %d", name, (long long)C, n_head);
    struct fsdp_module *m, *c;
    FSDP_TRY(fsdp_module_create(ctx, &attention_ops, name, &m));
    struct attention *A = fsdp__zalloc(1, sizeof *A);
    if (!A) {
        fsdp_module_free(m);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory creating CausalSelfAttention '%s'", name);
    }
    m->impl = A;
    A->C = C;
    A->n_head = n_head;
    enum fsdp_status st = fsdp__adopt(ctx, m, fsdp__linear_create(ctx, "c_attn", C, 3 * C, 1, 0.02f, &c), &c,
                                      &A->c_attn);
    if (st == FSDP_OK)
        st = fsdp__adopt(ctx, m, fsdp__linear_create(ctx, "c_proj", C, C, 1, proj_std, &c), &c, &A->c_proj);
    if (st != FSDP_OK) {
        fsdp_module_free(m);
        return st;
    }
    *out_m = m;
    return FSDP_OK;
}
