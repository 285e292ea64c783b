/*
 * nn-impl.h - internal API of src/nn: the GEMM wrapper (src/nn is the only
 * place that calls the GEMM library), parameter access that honours ties,
 * tensor helpers shared by the layers, fast vectorisable exp/tanh, and the
 * layer constructors.
 *
 * Layer conventions (see struct fsdp_module_ops in fsdp.h):
 *  - forward(m, ctx, in, out): out->data NULL -> allocated from the arena,
 *    else overwritten; out's dtype/ndim/shape are set. Activations needed by
 *    backward are saved in m->impl as pointers into the arena (valid for the
 *    step), so a module instance runs at most once per step.
 *  - backward(m, ctx, dout, din): accumulates (+=) into fsdp__pgrad(p) and
 *    writes din (same allocate-or-overwrite rule) unless din is NULL.
 *  - Parameter values exist only while a unit is gathered: read
 *    fsdp__pdata(p) at the start of each forward/backward, never cache it.
 *  - Composite modules call children only through fsdp_module_forward /
 *    fsdp_module_backward, so the sharding hooks run.
 */
#ifndef FSDP_NN_IMPL_H
#define FSDP_NN_IMPL_H

#include <stdint.h>
#include <string.h>

#include "core/core-impl.h"

/* ---- GEMM (gemm.c): the only caller of the GEMM library ---- */
/* Row-major C (M, N) = alpha * op(A) op(B) + beta * C, with op(A) (M, K) and
 * op(B) (K, N); transa/transb non-zero transposes the stored matrix. Leading
 * dimensions are row strides of the stored matrices. beta == 0 ignores C's
 * old contents (NaN-safe). Runs single-threaded inside an OpenMP parallel
 * region, multi-threaded outside. A library failure is a broken invariant. */
void fsdp__sgemm(int transa, int transb, int64_t M, int64_t N, int64_t K, float alpha,
                 const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C,
                 int64_t ldc);
/* The same product with 16-bit inputs (gemm_lp.c): A and B hold dt elements
 * (FSDP_BF16: oneDNN matmul on AMX; FSDP_F16: widened to fp32, then
 * fsdp__sgemm, since oneDNN 2.6 has no f16 matmul on CPU; FSDP_F32: exactly
 * fsdp__sgemm), accumulation and C in fp32. Thread-safe; inside an OpenMP
 * parallel region each call runs on its calling thread. Primitives are cached
 * by shape for the life of the process ([Note: matmul cache]). */
void fsdp__gemm_lp(enum fsdp_dtype dt, int transa, int transb, int64_t M, int64_t N, int64_t K, float alpha,
                   const void *A, int64_t lda, const void *B, int64_t ldb, float beta, float *C, int64_t ldc);
/* batch products C_i = alpha op(A_i) op(B_i) + beta C_i, with A_i = A + i*sa
 * elements (B, C likewise); the same leading dimensions for every i. BF16:
 * one oneDNN matmul (3-D, batch outermost), which threads across the batch;
 * other dtypes: fsdp__gemm_lp per entry, in parallel. */
void fsdp__gemm_lp_batched(enum fsdp_dtype dt, int64_t batch, int transa, int transb, int64_t M, int64_t N,
                           int64_t K, float alpha, const void *A, int64_t lda, int64_t sa, const void *B,
                           int64_t ldb, int64_t sb, float beta, float *C, int64_t ldc, int64_t sc);
/* C (M, N) = op(A) op(B) + bias in every row (bias: N fp32), A and B of dt
 * (F32, or 16-bit): oneDNN adds the bias in the matmul (native BF16, and
 * F32), so C is written once instead of filled with the bias and read back by
 * a sum (Linear's forward); widened, A and B go whole into fp32 scratch for
 * F32's biased product where they fit it, else C is filled with the bias and
 * the widened products add to it. */
void fsdp__gemm_lp_bias(enum fsdp_dtype dt, int transa, int transb, int64_t M, int64_t N, int64_t K, const void *A,
                        int64_t lda, const void *B, int64_t ldb, const float *bias, float *C, int64_t ldc);
/* C (M, N; row stride ldc) in bf16 = op(A) op(B) (+ bias, N fp32, when not
 * NULL), A and B bf16, each fp32 sum rounded to nearest even by oneDNN's
 * kernel ([Note: 16-bit output by the kernel], gemm_lp.c); scratch: the
 * bytes fsdp__gemm_lp_out16_scratch gives for the same shape, which is
 * SIZE_MAX where this is not available (dt not BF16, or bf16 widened). */
size_t fsdp__gemm_lp_out16_scratch(enum fsdp_dtype dt, int transa, int transb, int64_t M, int64_t N, int64_t K,
                                   int64_t lda, int64_t ldb, int64_t ldc, int bias);
void fsdp__gemm_lp_out16(enum fsdp_dtype dt, int transa, int transb, int64_t M, int64_t N, int64_t K, const void *A,
                         int64_t lda, const void *B, int64_t ldb, const float *bias, uint16_t *C, int64_t ldc,
                         void *scratch);
void fsdp__gemm_bf16(int transa, int transb, int64_t M, int64_t N, int64_t K, float alpha, const uint16_t *A,
                     int64_t lda, const uint16_t *B, int64_t ldb, float beta, float *C, int64_t ldc);
/* 1 if dt's 2-D products run on oneDNN's gemm-based native kernel ([Note:
 * bf16 kernels], gemm_lp.c: bf16 on AVX512-BF16 without AMX, or
 * FSDP_GEMM_BF16=gemm), 0 otherwise. */
int fsdp__gemm_lp_gemm_based(enum fsdp_dtype dt);
/* Number of matmul primitives in the cache (for tests and benchmarks). */
int fsdp__gemm_lp_cached(void);

/* ---- oneDNN primitives of the vision layers (conv.c) ---- */
/* One CPU engine for the process and one stream per thread (oneDNN's
 * dnnl_engine_t and dnnl_stream_t), made on first use. */
struct dnnl_engine;
struct dnnl_stream;
struct dnnl_primitive;
struct dnnl_engine *fsdp__dnnl_engine(void);
struct dnnl_stream *fsdp__dnnl_stream(void);
/* Runs prim on this thread's stream and waits: argument i is oneDNN's
 * DNNL_ARG_* arg[i] over the memory described by md[i] (a const
 * dnnl_memory_desc_t *) at ptr[i] (n <= 8). A failure is a broken invariant. */
void fsdp__dnnl_exec(struct dnnl_primitive *prim, int n, const int *arg, const void *const *md, void *const *ptr);

/* ---- Compute precision (precision.c) ---- */
/* The dtype a module's own matrix products take as inputs: m->compute_dtype
 * (FSDP_F32, FSDP_BF16 or FSDP_F16), set for a subtree by
 * fsdp_module_set_compute_dtype. See [Note: compute precision]. */
static inline enum fsdp_dtype fsdp__compute_dtype(const struct fsdp_module *m) { return m->compute_dtype; }
/* n elements of dt from the arena, converted from src (fp32), or NULL with
 * the error set naming `what`. */
void *fsdp__lp_copy(struct fsdp_ctx *ctx, enum fsdp_dtype dt, const float *src, int64_t n, const char *what);
/* The same, unconverted: n elements of dt from the arena. */
void *fsdp__lp_alloc(struct fsdp_ctx *ctx, enum fsdp_dtype dt, int64_t n, const char *what);
/* The values of parameter p as dtype dt for a product: fsdp__pdata(p) for
 * FSDP_F32, else a cast into the arena (NULL with the error set if the arena
 * is full). The one place a layer gets its low-precision weight: when FSDP
 * gathered the parameter in dt (p->priv->data_lp), that copy is returned as is. */
const void *fsdp__pdata_lp(struct fsdp_ctx *ctx, struct fsdp_param *p, enum fsdp_dtype dt);
/* The dtype a 16-bit product's operands are made in ([Note: widened
 * operands]): lp where the CPU has kernels for it (fsdp_gemm_native), else
 * FSDP_F32 holding the values lp rounds them to. */
enum fsdp_dtype fsdp__operand_dtype(enum fsdp_dtype lp);
/* n elements of src (dtype sdt: fp32, or lp itself) into dst of the operand
 * dtype od (lp, or F32), holding the values lp rounds them to: copied,
 * widened, cast or rounded in fp32. Serial (for per-row calls inside a loop). */
void fsdp__to_operand(enum fsdp_dtype lp, enum fsdp_dtype od, enum fsdp_dtype sdt, const void *src, void *dst,
                      size_t n);
/* The dtype in which m's forward takes its input without casting it
 * ([Note: 16-bit hand-off]): a Linear's or a Conv2d's 16-bit compute dtype, a
 * CausalSelfAttention's or MLP's first Linear's; FSDP_F32 for anything else. */
enum fsdp_dtype fsdp__input_dtype(const struct fsdp_module *m);
/* The output dtype a caller asked of a producer ([Note: 16-bit hand-off]):
 * out->dtype if it is BF16 or F16 and out has no buffer yet, else FSDP_F32. */
static inline enum fsdp_dtype fsdp__wanted_dtype(const struct fsdp_tensor *out) {
    return !out->data && (out->dtype == FSDP_BF16 || out->dtype == FSDP_F16) ? out->dtype : FSDP_F32;
}
/* Per-module input dtypes for fsdp__input_dtype (each file knows its ops). */
enum fsdp_dtype fsdp__linear_input_dtype(const struct fsdp_module *m);
enum fsdp_dtype fsdp__attention_input_dtype(const struct fsdp_module *m);
/* How many of BH heads of T tokens the 16-bit attention runs at once ([Note:
 * head groups], attention.c; bench/step_limit.c times its products so). */
int64_t fsdp__attention_head_group(int64_t BH, int64_t T);
/* One of causal attention's products over g heads, the masked blocks left
 * out ([Note: causal blocks], attention.c; bench/step_limit.c times them
 * so): FSDP__ATT_SCORES C (T, T) = alpha A B^T with A, B (T, hs);
 * FSDP__ATT_ROWS C (T, hs) = alpha A B with A (T, T) of probabilities or
 * dS and B (T, hs); FSDP__ATT_COLS the same with A transposed. A and B of
 * dtype dt with leading dimensions lda, ldb and head strides sa, sb; C fp32
 * (ldc, sc). */
enum fsdp__att_product { FSDP__ATT_SCORES, FSDP__ATT_ROWS, FSDP__ATT_COLS };
void fsdp__attention_product(enum fsdp__att_product how, enum fsdp_dtype dt, int64_t g, int64_t T, int64_t hs,
                             float alpha, const void *A, int64_t lda, int64_t sa, const void *B, int64_t ldb,
                             int64_t sb, float *C, int64_t ldc, int64_t sc);
enum fsdp_dtype fsdp__mlp_input_dtype(const struct fsdp_module *m);
enum fsdp_dtype fsdp__gelu_input_dtype(const struct fsdp_module *m);
enum fsdp_dtype fsdp__conv_input_dtype(const struct fsdp_module *m);

/* db[c] += sum over rows i of x[i*cols + c], summed in chunks of
 * COLSUM_ROWS rows ([Note: column sums in row chunks], gemm.c): the same
 * bits whatever the team size. With xl non-NULL it also writes x rounded to
 * dt there (the same layout), each row while it is in cache: one pass for a
 * Linear's bias gradient and the 16-bit copy of dy. Partial sums in arena
 * scratch (FSDP_ERR_NOMEM, the error set, when it is full). */
#define COLSUM_ROWS 32
enum fsdp_status fsdp__colsum_add(struct fsdp_ctx *ctx, const float *x, int64_t rows, int64_t cols, float *db,
                                  enum fsdp_dtype dt, void *xl);
/* The chunks of COLSUM_ROWS rows a column sum over rows takes; chunk k is
 * rows [k COLSUM_ROWS, fsdp__colsum_chunk_end(k, rows)). */
int64_t fsdp__colsum_chunks(int64_t rows);
static inline int64_t fsdp__colsum_chunk_end(int64_t k, int64_t rows) {
    return (k + 1) * COLSUM_ROWS < rows ? (k + 1) * COLSUM_ROWS : rows;
}
/* db[c] += the sum over chunks k = 0..nch-1, in that order from zero, of
 * part[k * cols + c]: the second half of a chunked column sum. */
void fsdp__colsum_chunks_add(const float *part, int64_t nch, int64_t cols, float *db);

/* ---- Parameters (ties honoured) ---- */
/* A tied parameter (tied_to != NULL) has no storage of its own: its values
 * and gradient are those of the parameter it is tied to. */
/* The fp32 values of p. Not for an lp_reader weight, whose fp32 values a
 * 16-bit training pass does not make (data_stale: [Note: lazy widening]);
 * its layer reads it through fsdp__pdata_f32 or fsdp__pdata_lp. */
static inline float *fsdp__pdata(struct fsdp_param *p) {
    struct fsdp_param *q = p->tied_to ? p->tied_to : p;
    FSDP_ASSERT(!q->priv->data_stale, "parameter '%s' has no fp32 values in a 16-bit training pass: its reader "
                "must use fsdp__pdata_f32 ([Note: lazy widening])", q->fqn ? q->fqn : q->name);
    return q->data;
}
/* The fp32 values of p: fsdp__pdata(p), or, when a 16-bit training pass
 * left them unmade (data_stale), a copy widened from data_lp into the arena
 * (the caller releases it with its arena mark); NULL with the error set
 * naming `what` when the arena is full. */
const float *fsdp__pdata_f32(struct fsdp_ctx *ctx, struct fsdp_param *p, const char *what);
/* Rows [r0, r0 + nr) of p's values, as rows of cols elements, into dst:
 * the values fsdp__pdata would show, wherever they are (fp32 values, the
 * 16-bit copy FSDP gathered, or the fp32 shard a shard group of one reads in
 * place: [Note: 16-bit values from the shard] in src/fsdp/mixed.c), rounded
 * to lp (FSDP_F32: as they are) and stored as od: lp, or FSDP_F32 holding
 * the rounded values (a widened operand, [Note: widened operands]). Nothing
 * while measuring. */
void fsdp__prows(const struct fsdp_param *p, int64_t cols, int64_t r0, int64_t nr, enum fsdp_dtype lp,
                 enum fsdp_dtype od, void *dst);
/* The 16-bit copy of p's values FSDP gathered in dt as a whole (a product
 * reads it in place), or NULL when there is none: then fsdp__prows makes the
 * rows a product needs. */
static inline const void *fsdp__pdata_gathered_lp(const struct fsdp_param *p, enum fsdp_dtype dt) {
    const struct fsdp_param *q = p->tied_to ? p->tied_to : p;
    return q->priv->data_lp && q->priv->data_lp_dtype == dt ? q->priv->data_lp : NULL;
}
/* [Note: unset gradients]
 * Before a unit's backward the sharding layer marks the gradients of
 * grad_writer parameters unset (p->priv->grad_unset) instead of zeroing the whole
 * full gradient: 496 MB of writes a step for GPT-2 124M, plus a read of
 * every Linear weight gradient for a product that adds into zeros. A layer
 * that can write its gradient outright takes it with fsdp__pgrad_first (its
 * product then runs with beta 0); every other access goes through
 * fsdp__pgrad, which zeroes an unset gradient first. A tied parameter's
 * gradient is its target's, so the first of the two layers to run writes and
 * the second adds. The sharding layer zeroes whatever is still unset when
 * the unit's backward ends (unit.c). */
/* p's gradient buffer (its tie target's, if tied) to add into; zeroed first
 * if unset. */
float *fsdp__pgrad(struct fsdp_param *p);
/* p's gradient buffer to write: *beta 0 when it is unset (overwrite it, it
 * is set from now on), else 1 (add). */
float *fsdp__pgrad_first(struct fsdp_param *p, float *beta);
/* FSDP_ERR_STATE naming the parameter if it has no values (or, with
 * need_grad, no gradient buffer) right now. */
enum fsdp_status fsdp__param_ready(struct fsdp_ctx *ctx, struct fsdp_param *p, int need_grad);

/* ---- Releasing backward ([Note: backward releases the blocks], src/models/gpt.c) ---- */
/* Whether dout is dead once m's backward has taken it: the library's output
 * gradient handed to the root, or a gradient a releasing parent handed to m.
 * Then nothing above m's forward is read after m's backward but the input
 * gradient it returns, and m may hand the arena back down to where its
 * forward began as its backward passes its children. */
static inline int fsdp__dout_dead(const struct fsdp_ctx *cx, const struct fsdp_module *m,
                                  const struct fsdp_tensor *dout) {
    return dout && dout->data && dout->data == cx->dead_dout && cx->dead_for == m;
}
/* A releasing module hands child c the gradient g, dead once c has taken it. */
static inline void fsdp__dout_dead_hand(struct fsdp_ctx *cx, const struct fsdp_module *c, const void *g) {
    cx->dead_dout = g;
    cx->dead_for = c;
}
/* In a releasing module, after a child's backward: the child's input
 * gradient t (on the arena's top; NULL or without data: none) moves down to
 * `mark`, where that child's forward began, and the arena above it goes
 * back. Where t is not the top nothing moves and *release is cleared: the
 * module stops releasing for the rest of its backward. (resblock.c) */
void fsdp__release_to(struct fsdp_ctx *ctx, int *release, size_t mark, struct fsdp_tensor *t);
/* A releasing module's backward of child c (its forward began at `mark`):
 * hands c the dead gradient dout while *release holds, runs c's backward
 * into din, then fsdp__release_to(din). */
enum fsdp_status fsdp__backward_releasing(struct fsdp_ctx *ctx, struct fsdp_module *c, const struct fsdp_tensor *dout,
                                          struct fsdp_tensor *din, size_t mark, int *release);
/* A module that runs its first n children in order, each one's output the
 * next one's input (Sequential; SwAV's model, trunk then head), and whose
 * backward releases as it passes them. (resblock.c) */
struct fsdp__chain {
    int ndim;
    int64_t shape[FSDP_MAX_DIMS]; /* of the last input */
    size_t *marks;                /* (n_children) the arena's mark before each child's forward */
    int ran;                      /* children the last forward ran, 0: none */
};
enum fsdp_status fsdp__chain_forward(struct fsdp_module *m, struct fsdp_ctx *ctx, struct fsdp__chain *c, int n,
                                     const struct fsdp_tensor *in, struct fsdp_tensor *out);
/* The backward of the children the last forward ran, the last one first:
 * FSDP_ERR_STATE naming m without a forward. */
enum fsdp_status fsdp__chain_backward(struct fsdp_module *m, struct fsdp_ctx *ctx, struct fsdp__chain *c,
                                      const struct fsdp_tensor *dout, struct fsdp_tensor *din);
/* Frees c (allocated with the module) and its marks. */
void fsdp__chain_free(struct fsdp__chain *c);

/* ---- Tensors ---- */
/* Sets t's dtype and shape, and its layout to PLAIN (a module writing
 * BLOCKED16 sets it after), and, if t->data is NULL, allocates it from the
 * arena (`what` names it in the error). */
enum fsdp_status fsdp__tensor_prepare(struct fsdp_ctx *ctx, struct fsdp_tensor *t, enum fsdp_dtype dt,
                                      int ndim, const int64_t *shape, const char *what);
/* FSDP_ERR_INVALID naming module m unless t has dtype dt, 1 <= ndim <=
 * FSDP_MAX_DIMS (exactly `ndim` if ndim > 0), data, last dimension `last`
 * (if last > 0), and the PLAIN layout. */
enum fsdp_status fsdp__check_input(struct fsdp_ctx *ctx, const struct fsdp_module *m,
                                   const struct fsdp_tensor *t, enum fsdp_dtype dt, int ndim, int64_t last);
/* The same for a module that also takes BLOCKED16 (then a 4-D tensor with a
 * multiple of 16 channels). */
enum fsdp_status fsdp__check_input_any(struct fsdp_ctx *ctx, const struct fsdp_module *m,
                                       const struct fsdp_tensor *t, enum fsdp_dtype dt, int ndim, int64_t last);
/* The same for a module that also takes ROWS16 (a 16-bit output gradient
 * handed on as it is: [Note: padded rows], src/fsdp/step.c). */
enum fsdp_status fsdp__check_input_rows16(struct fsdp_ctx *ctx, const struct fsdp_module *m,
                                          const struct fsdp_tensor *t, enum fsdp_dtype dt, int ndim, int64_t last);
/* The row stride of t's last dimension, in elements: fsdp_rows16_stride for
 * ROWS16, the dimension itself otherwise. */
int64_t fsdp__row_stride(const struct fsdp_tensor *t);

/* Makes BatchNorm2d m apply a ReLU to its output, as its forward and
 * backward ([Note: fused ReLU and 16-bit hand-off] in batchnorm.c). */
void fsdp__batchnorm_fuse_relu(struct fsdp_module *m);

/* ---- Blocked activations (layout.c, [Note: blocked activations] in conv.c) ---- */
/* Channels per block of FSDP_LAYOUT_BLOCKED16 (1 for PLAIN). */
static inline int64_t fsdp__lanes(enum fsdp_layout l) { return l == FSDP_LAYOUT_BLOCKED16 ? 16 : 1; }
/* The layout the vision models' convolutions write: BLOCKED16 unless
 * FSDP_VISION_LAYOUT=plain (for comparisons; the same values either way). */
enum fsdp_layout fsdp__vision_layout(void);
/* FSDP_ERR_INVALID naming module m unless the output gradient g is in the
 * layout its forward wrote the output in (want). */
enum fsdp_status fsdp__check_grad_layout(struct fsdp_ctx *ctx, const struct fsdp_module *m,
                                         const struct fsdp_tensor *g, enum fsdp_layout want);
/* l if a 4-D tensor of C channels can be in it, else PLAIN */
static inline enum fsdp_layout fsdp__layout_for(enum fsdp_layout l, int ndim, int64_t channels) {
    return l == FSDP_LAYOUT_BLOCKED16 && ndim == 4 && channels % 16 == 0 ? l : FSDP_LAYOUT_PLAIN;
}
/* dst (layout dl) = src (layout sl), both fp32 (N, C, H, W) = shape; not in
 * place (a plain copy where the layouts agree). */
void fsdp__relayout(float *dst, enum fsdp_layout dl, const float *src, enum fsdp_layout sl, const int64_t *shape);
/* t in layout l: t itself, or a copy in the arena (NULL with the error set
 * naming `what` when it is full); *out gets the tensor. */
enum fsdp_status fsdp__as_layout(struct fsdp_ctx *ctx, const struct fsdp_tensor *t, enum fsdp_layout l,
                                 struct fsdp_tensor *out, const char *what);
/* n floats from the arena, or NULL with the error set naming `what`. */
float *fsdp__scratch(struct fsdp_ctx *ctx, int64_t n, const char *what);
/* Adds the child a constructor just made (st is that constructor's status;
 * *child is freed if adding fails) and stores it in *slot (may be NULL):
 *   st = fsdp__adopt(ctx, m, fsdp__gelu_create(ctx, "gelu", &c), &c, &impl->gelu); */
enum fsdp_status fsdp__adopt(struct fsdp_ctx *ctx, struct fsdp_module *parent, enum fsdp_status st,
                             struct fsdp_module **child, struct fsdp_module **slot);
/* A module's FQN for messages ("(root)" for the root, its name if not finalized). */
const char *fsdp__mname(const struct fsdp_module *m);

/* ---- Fast math (branch-free, so loops under `omp simd` vectorise) ---- */
/* [Note: exp range] fsdp__expf clamps its argument to [-87, 88]. With the
 * bounds as literal constants GCC 12 folds the whole polynomial for each
 * clamped side into a constant and vectorises the three cases under masks
 * (25 masked operations a vector): GELU's forward ran at 0.60 ns an element
 * on one thread. Bounds the compiler cannot see through (an empty asm on
 * them, made once before the loop: an asm inside a loop stops it from
 * vectorising) give one max, one min and the plain polynomial: 0.38 ns, the
 * same bits for every one of the 2^32 inputs. So a loop takes its range first:
 *   const struct fsdp__exp_range er = fsdp__exp_range();
 *   for (...) e[j] = fsdp__expf(x[j], er); */
struct fsdp__exp_range {
    float lo, hi;
};
static inline struct fsdp__exp_range fsdp__exp_range(void) {
    struct fsdp__exp_range r = {-87.0f, 88.0f};
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
    __asm__("" : "+x"(r.lo), "+x"(r.hi));
#endif
    return r;
}
/* exp(x) to about 2 ulp for x in [-87, 88]; clamps outside (never inf/0);
 * nan gives nan (selects, not branches, so loops still vectorise; the clamp
 * turns a nan into lo, so none reaches the float -> int conversion below,
 * where it would be undefined behaviour). r is fsdp__exp_range()'s. */
static inline float fsdp__expf(float x0, struct fsdp__exp_range r) {
    float x = x0 > r.lo ? x0 : r.lo; /* a nan fails the test: lo */
    x = x < r.hi ? x : r.hi;
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float n = (x * 1.44269504f + magic) - magic;
    float r0 = x - n * 0.693145752f; /* ln 2 in two parts (Cody-Waite) */
    r0 = r0 - n * 1.42860677e-06f;
    float p = 1.0f / 720.0f;
    p = p * r0 + 1.0f / 120.0f;
    p = p * r0 + 1.0f / 24.0f;
    p = p * r0 + 1.0f / 6.0f;
    p = p * r0 + 0.5f;
    p = p * r0 + 1.0f;
    p = p * r0 + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x0 != x0 ? x0 : p * scale;
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
/* fsdp__expf on 16 lanes: the same operations in the same order, so each
 * lane gives the scalar call's bits (nan stays nan). AVX-512 code: for the
 * paths fsdp__cpu_isa() chooses ([Note: vector paths at run time]). */
FSDP__TARGET_AVX512 static inline __m512 fsdp__expf16(__m512 x0) {
    __m512 x = _mm512_min_ps(_mm512_max_ps(x0, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), magic), magic);
    __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693145752f)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(1.42860677e-06f)));
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(0.5f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f));
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
    return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q), x0);
}
#endif

/* [Note: module profile] (src/nn/profile.c): the dispatchers' frames. push opens one
 * (0 when the context is not profiling); pop closes it with the clock at the
 * dispatch's start, after its pre-hooks, after the module and after its
 * post-hooks. free releases the entries (fsdp_ctx_free). */
int fsdp__prof_push(struct fsdp_ctx *ctx);
void fsdp__prof_pop(struct fsdp_ctx *ctx, const struct fsdp_module *m, int frame, int backward, const double t[4]);
void fsdp__prof_free(struct fsdp_ctx *ctx);

/* Causal softmax row t of T in place over j <= t, and its backward (d = a (d - sum a d)),
 * zeros past t up to the row's whole vectors, to T where tail: the rows the attention
 * runs ([Note: softmax rows in registers], attention.c) and the loops every build has. */
void fsdp__softmax_row(float *row, int64_t t, int64_t T, int tail);
void fsdp__softmax_bwd_row(const float *a, float *d, int64_t t, int64_t T, int tail);
void fsdp__softmax_row_loops(float *row, int64_t t, int64_t T, int tail);
void fsdp__softmax_bwd_row_loops(const float *a, float *d, int64_t t, int64_t T, int tail);

/* ---- Layers (linear.c, embedding.c, layernorm.c, gelu.c, attention.c, block.c) ---- */
/* Each constructor returns *out_m to the caller, who owns it until
 * fsdp_module_add_child hands it to a parent. */
/* Linear: y (..., out) = x (..., in) W^T + b; weight (out, in), bias (out). */
enum fsdp_status fsdp__linear_create(struct fsdp_ctx *ctx, const char *name, int64_t in, int64_t out,
                                     int bias, float init_std, struct fsdp_module **out_m);
/* Embedding: ids I32 (...) -> (..., dim); weight (num, dim). */
enum fsdp_status fsdp__embedding_create(struct fsdp_ctx *ctx, const char *name, int64_t num, int64_t dim,
                                        float init_std, struct fsdp_module **out_m);
/* LayerNorm over the last dimension (dim), eps 1e-5; weight and bias (dim). */
enum fsdp_status fsdp__layernorm_create(struct fsdp_ctx *ctx, const char *name, int64_t dim,
                                        struct fsdp_module **out_m);
/* [Note: LayerNorm outputs rebuilt] (block.c): the next forward writes its
 * output at y (room for its input's elements in the dtype asked) instead of
 * a fresh arena tensor; rebuild writes the last forward's output there again
 * from what that forward saved, the same bits (nothing where it was not lent). */
void fsdp__layernorm_write_into(struct fsdp_module *m, void *y);
enum fsdp_status fsdp__layernorm_rebuild(struct fsdp_module *m, struct fsdp_ctx *ctx);
/* GELU, tanh approximation (GPT-2); no parameters. Backward may run in place
 * (din->data == dout->data). */
enum fsdp_status fsdp__gelu_create(struct fsdp_ctx *ctx, const char *name, struct fsdp_module **out_m);
/* Causal self-attention on (B, T, C): children c_attn Linear(C, 3C) and
 * c_proj Linear(C, C) (c_proj weight std proj_std). */
enum fsdp_status fsdp__attention_create(struct fsdp_ctx *ctx, const char *name, int64_t C, int n_head,
                                        float proj_std, struct fsdp_module **out_m);
/* MLP: c_fc Linear(C, 4C), gelu, c_proj Linear(4C, C) (std proj_std). */
enum fsdp_status fsdp__mlp_create(struct fsdp_ctx *ctx, const char *name, int64_t C, float proj_std,
                                  struct fsdp_module **out_m);
/* [Note: decoding cache] (attention.c): a cache of keys and values for cap
 * positions of B sequences (either 0: none, freed), which every eval-mode
 * forward then reads and extends, its first position set by cache_at. */
enum fsdp_status fsdp__attention_set_cache(struct fsdp_ctx *ctx, struct fsdp_module *m, int64_t B, int64_t cap);
void fsdp__attention_cache_at(struct fsdp_module *m, int64_t at);
/* Pre-LN transformer block on (B, T, C): ln_1, attn, ln_2, mlp. */
enum fsdp_status fsdp__block_create(struct fsdp_ctx *ctx, const char *name, int64_t C, int n_head,
                                    float proj_std, struct fsdp_module **out_m);
/* A Block's attention (its child attn). */
struct fsdp_module *fsdp__block_attention(struct fsdp_module *m);
/* Lends a Block the buffer (bytes long, or NULL) its next forward writes its
 * LayerNorms' outputs into and its backward rebuilds them in ([Note:
 * LayerNorm outputs rebuilt]): free from that forward to the Block's
 * backward but for the Block's own use, and in that backward until ln_1's. */
void fsdp__block_set_window(struct fsdp_module *m, void *window, size_t bytes);
/* A container that exists for naming (forward/backward: FSDP_ERR_UNSUPPORTED),
 * of type "ModuleList" if is_list, else "Module". */
enum fsdp_status fsdp__container_create(struct fsdp_ctx *ctx, const char *name, int is_list,
                                        struct fsdp_module **out_m);

/* ---- Losses of fsdp_model_loss (loss.c) ---- */
/* FSDP_ERR_INVALID naming the mismatch unless `target` fits `out` for the
 * loss (kind, dtype, shape, class ids in range, smoothing in [0, 1], a
 * function for FSDP_LOSS_USER); *count gets the items the mean divides by on
 * this rank: rows not ignored (cross-entropy), rows (soft cross-entropy,
 * user), elements (MSE). */
enum fsdp_status fsdp__loss_check(struct fsdp_ctx *ctx, const struct fsdp_loss *loss, const struct fsdp_tensor *out,
                                  const struct fsdp_tensor *target, int64_t *count);
/* A built-in loss (checked): *sum = the sum of the item losses, and, if dout
 * is non-NULL, dout (out's shape; may be out->data) = g * d(sum)/d(out). */
void fsdp__loss_builtin(const struct fsdp_loss *loss, const struct fsdp_tensor *out, const struct fsdp_tensor *target,
                        float g, double *sum, float *dout);
/* fsdp_cross_entropy over logits of dtype dt in rows ld elements apart (a
 * ROWS16 model output), the gradient written in dt with the same stride (may
 * be logits). A 16-bit row is widened into fp32 scratch in the arena,
 * computed as an fp32 row and its gradient rounded: the loss and the rounding
 * of the gradient that the fp32 rows of the widened logits give, bit for bit
 * ([Note: 16-bit model output], src/fsdp/step.c). */
enum fsdp_status fsdp__cross_entropy_rows(struct fsdp_ctx *ctx, enum fsdp_dtype dt, const void *logits, int64_t ld,
                                          const int32_t *targets, int64_t N, int64_t V, float scale, float *loss,
                                          void *dlogits);


#endif
