/*
 * conv.c - Conv2d on NCHW fp32 tensors through oneDNN's convolution
 * primitives (forward, backward data, backward weights), and the oneDNN
 * engine, stream and execution helpers the other vision layers share.
 * weight (out, in/groups, kh, kw) as PyTorch (oneDNN's oihw, or goihw with
 * groups), optional bias (out). At the API the input (and its gradient) is
 * PLAIN or BLOCKED16, the output (and its gradient) in opts.out_layout
 * ([Note: blocked activations]); each primitive takes the layouts oneDNN
 * prefers, and every tensor whose layout differs is reordered into arena
 * scratch around the call ([Note: conv layouts] below; in place where they
 * agree).
 * Primitives are made for one input shape and kept in the module until the
 * shape or the compute dtype changes ([Note: conv primitives]).
 * 16-bit compute ([Note: compute precision]): with BF16 the input and the
 * weight are cast to bf16 and oneDNN's bf16 convolution accumulates in fp32
 * (output, gradients in fp32), where fsdp_gemm_native(FSDP_BF16) says the CPU
 * runs bf16 kernels and oneDNN has the convolution; otherwise (F16 always,
 * FSDP_GEMM_BF16=widen) the inputs are rounded to 16 bits and widened back,
 * then convolved in fp32: the same products, fp32 speed ([Note: widened
 * products] in gemm_lp.c). Forward saves x (fp32, or its 16-bit or rounded
 * copy) in the arena for backward.
 */
#include "nn/nn-impl.h"

#include <math.h>
#include <oneapi/dnnl/dnnl.h>
#include <pthread.h>

/* ---- oneDNN helpers shared by the vision layers ---- */

static dnnl_engine_t vis_engine;
static pthread_once_t vis_once = PTHREAD_ONCE_INIT;
static _Thread_local dnnl_stream_t vis_stream;

static void vis_engine_init(void) {
    dnnl_status_t st = dnnl_engine_create(&vis_engine, dnnl_cpu, 0);
    FSDP_ASSERT(st == dnnl_success, "dnnl_engine_create(cpu) failed with status %d", (int)st);
}

struct dnnl_engine *fsdp__dnnl_engine(void) {
    pthread_once(&vis_once, vis_engine_init);
    return vis_engine;
}

struct dnnl_stream *fsdp__dnnl_stream(void) {
    if (!vis_stream) {
        dnnl_status_t st = dnnl_stream_create(&vis_stream, fsdp__dnnl_engine(), dnnl_stream_default_flags);
        FSDP_ASSERT(st == dnnl_success, "dnnl_stream_create failed with status %d", (int)st);
    }
    return vis_stream;
}

void fsdp__dnnl_exec(struct dnnl_primitive *prim, int n, const int *arg, const void *const *md, void *const *ptr) {
    if (fsdp__measuring) return;
    dnnl_exec_arg_t args[8];
    FSDP_ASSERT(n <= 8, "too many oneDNN arguments (%d)", n);
    for (int i = 0; i < n; i++) {
        dnnl_status_t st = dnnl_memory_create(&args[i].memory, (const dnnl_memory_desc_t *)md[i],
                                              fsdp__dnnl_engine(), ptr[i]);
        FSDP_ASSERT(st == dnnl_success, "dnnl_memory_create failed with status %d", (int)st);
        args[i].arg = arg[i];
    }
    dnnl_stream_t s = fsdp__dnnl_stream();
    dnnl_status_t st = dnnl_primitive_execute(prim, s, n, args);
    if (st == dnnl_success) st = dnnl_stream_wait(s);
    FSDP_ASSERT(st == dnnl_success, "oneDNN primitive failed with status %d", (int)st);
    for (int i = 0; i < n; i++) dnnl_memory_destroy(args[i].memory);
}

/* ---- Conv2d ---- */

/* [Note: conv primitives]
 * Making a oneDNN primitive costs milliseconds (JIT), a convolution runs for
 * about as long, so each Conv2d keeps the three primitives it made for the
 * last (N, H, W, dtype) and remakes them only when that changes (a last,
 * smaller batch; train then eval with another batch size). Primitives use
 * oneDNN's own scratchpad; a module runs one forward or backward at a time.
 * [Note: conv layouts] On plain NCHW tensors oneDNN 2.6 has only its
 * im2col + GEMM convolution, whose backward-weights pass ran at a tenth of
 * the direct kernels' rate; so each primitive is made with layouts of
 * oneDNN's choice (format "any": blocked nChw16c and the like), and every
 * operand whose chosen layout differs from the plain one goes through a
 * reorder into arena scratch before (inputs) or after (outputs) the
 * primitive. The tensors at the API keep their layouts (PLAIN or BLOCKED16).
 * [Note: blocked activations] oneDNN's convolutions run on nChw16c (16
 * channels interleaved), so a ResNet in plain NCHW tensors paid two passes
 * per convolution just for the layout: the output back to NCHW after
 * forward, the input gradient back after backward data (with the casts,
 * 28% of oneDNN's time in an AMP_BF16 ResNet-18 step, 2026-12-02). A
 * tensor's layout field says BLOCKED16 when it is nChw16c itself; Conv2d
 * writes its output so when opts.out_layout asks (the ResNet's convolutions
 * do, FSDP_VISION_LAYOUT=plain aside) and takes either layout in; the
 * layers between two convolutions (BatchNorm2d, ReLU, the residual add,
 * MaxPool2d, AdaptiveAvgPool2d) take BLOCKED16 as it comes, with the same
 * arithmetic in the same order per value, so the results are the same bits
 * in either layout. What remains is the conversion to bf16 where the
 * primitives compute in bf16; fp32 primitives read the blocked tensors as
 * they are.
 * [Note: cropped kernels] Where some kernel taps fall in the padding for
 * every output (a 3x3 kernel with padding 1 on a 1x1 input: only the centre
 * tap meets the image; on 2x2 with stride 2, a 2x2 corner), the primitives
 * are made for the taps that meet the image only, with the padding shifted
 * to match: the same sums without the zero products (ResNet-18's layer4 on
 * 28x28 images is 1x1: 9x fewer FLOPs there). The weight operand is then a
 * sub-memory of the full (out, in, kh, kw) weight (the reorder reads it in
 * place), and the weight gradient's other taps are written as zeros.
 * [Note: bf16 weight gradients of small images] oneDNN 2.6's bf16
 * backward-weights kernel takes seconds where the output has 16 pixels or
 * fewer (ResNet-18 on 28x28 images, batch 128: layer2's strided first conv
 * (4x4 output) 2.7 s, layer3 and layer4 (2x2, 1x1) up to 4.5 s each, where
 * fp32 takes tens of milliseconds; PyTorch alike). There the weight gradient runs in
 * fp32 on the bf16 values widened (x) and dy rounded to bf16 and widened:
 * the same products (a product of two bf16 values is exact in fp32), the
 * same fp32 accumulation.
 * [Note: one pass into the primitives' layout] The input and the output
 * gradient reach the primitives through one reorder each from the plain
 * fp32 tensor, which converts to bf16 on the way (no separate cast pass):
 * the input's reordered copy is what forward saves for the weight gradient
 * (where that primitive takes the forward's layout, and the copy is not
 * padded much beyond the plain tensor), and the output gradient's serves
 * both backward primitives (where they take one layout; fp32 too). Before,
 * each operand went through a cast and then a reorder per primitive: 8
 * passes over activation-sized tensors per convolution and step, now 4
 * (with the output's and the input gradient's reorders back to NCHW). The
 * same values: oneDNN's conversion rounds to nearest even, as ours. */
struct xarg {                 /* one operand of a primitive */
    dnnl_memory_desc_t md;    /* the layout the primitive runs on */
    dnnl_memory_desc_t user;  /* the layout at the API (PLAIN or BLOCKED16, fp32 or bf16) */
    dnnl_primitive_t reorder; /* user -> md (input) or md -> user (output); NULL when equal */
    size_t bytes;             /* of md */
    int output;
};

enum { FWD_SRC, FWD_WEI, FWD_DST, BD_DDST, BD_WEI, BD_DSRC, BW_SRC, BW_DDST, BW_DWEI, N_XARG };

struct conv_prims {
    int64_t n, h, w;
    enum fsdp_dtype dt;  /* FSDP_F32 or FSDP_BF16 (native) */
    enum fsdp_layout in_l, out_l; /* the API layouts of the input (and its gradient) and the output (and its) */
    int made;
    int crop;                   /* the primitives see a part of the kernel ([Note: cropped kernels]) */
    int bw_f32;                 /* dt BF16, but backward weights in fp32 ([Note: bf16 weight gradients
                                   of small images]) */
    dnnl_memory_desc_t bias;    /* (out) fp32: the bias and its gradient */
    struct xarg a[N_XARG];
    dnnl_primitive_t fwd, bwd_data, bwd_wei;
    /* [Note: one pass into the primitives' layout]: plain fp32 -> the layout and dtype of FWD_SRC (made when
       the weight gradient takes the forward's input layout: keep_x) and of both backward primitives' output
       gradient (made when they agree); reorder NULL when not made. x_op, dy_op: the same operands as the
       primitives take them once reordered (no reorder of their own) */
    struct xarg x_in, dy_in, x_op, dy_op;
    int keep_x;
};

struct conv {
    struct fsdp_conv2d_opts o;
    struct fsdp_param *weight; /* (out, in/groups, kh, kw) */
    struct fsdp_param *bias;   /* (out) or NULL */
    const void *x;             /* (N, in, H, W) saved input in xdt (arena or the caller's; in the input's
                                  layout, or in p.x_in's when x_kept) */
    enum fsdp_dtype xdt;       /* FSDP_F32 or FSDP_BF16 */
    enum fsdp_dtype lp;        /* compute dtype of the last forward */
    int widen;                 /* the last forward rounded 16-bit values and ran in fp32 */
    int x_kept;                /* x is in the primitives' layout (p.x_in), not the input's */
    int64_t n, h, w, oh, ow;
    enum fsdp_layout in_l, out_l; /* of the last forward's input and output */
    struct conv_prims p;
};

static void prims_free(struct conv_prims *p) {
    if (p->fwd) dnnl_primitive_destroy(p->fwd);
    if (p->bwd_data) dnnl_primitive_destroy(p->bwd_data);
    if (p->bwd_wei) dnnl_primitive_destroy(p->bwd_wei);
    for (int i = 0; i < N_XARG; i++)
        if (p->a[i].reorder) dnnl_primitive_destroy(p->a[i].reorder);
    if (p->x_in.reorder) dnnl_primitive_destroy(p->x_in.reorder);
    if (p->dy_in.reorder) dnnl_primitive_destroy(p->dy_in.reorder);
    memset(p, 0, sizeof *p);
}

/* operand a in layout md against its plain layout user */
static dnnl_status_t xarg_make_md(struct xarg *a, const dnnl_memory_desc_t *md, const dnnl_memory_desc_t *user,
                                  int output) {
    a->md = *md;
    a->user = *user;
    a->output = output;
    a->reorder = NULL;
    if (dnnl_memory_desc_equal(&a->md, user)) return dnnl_success;
    a->bytes = dnnl_memory_desc_get_size(&a->md);
    dnnl_primitive_desc_t rpd = NULL;
    dnnl_engine_t e = fsdp__dnnl_engine();
    dnnl_status_t st = dnnl_reorder_primitive_desc_create(&rpd, output ? &a->md : user, e, output ? user : &a->md, e,
                                                          NULL);
    if (st == dnnl_success) st = dnnl_primitive_create(&a->reorder, rpd);
    dnnl_primitive_desc_destroy(rpd);
    return st;
}

/* operand a of primitive pd (queried as q) against its plain layout user */
static dnnl_status_t xarg_make(struct xarg *a, const_dnnl_primitive_desc_t pd, dnnl_query_t q,
                               const dnnl_memory_desc_t *user, int output) {
    return xarg_make_md(a, dnnl_primitive_desc_query_md(pd, q, 0), user, output);
}

/* a's operand once in a's layout: passed to the primitive as it is */
static struct xarg xarg_ready(const struct xarg *a) {
    struct xarg r = *a;
    r.reorder = NULL;
    r.output = 0;
    return r;
}

/* the plain fp32 tensor at src reordered (and converted) into a's layout, in
 * the arena; NULL when the arena is full */
static void *xarg_from_f32(struct fsdp_ctx *ctx, const struct xarg *a, const void *src) {
    void *buf = fsdp_arena_alloc(ctx, a->bytes);
    if (!buf) return NULL;
    int args[2] = {DNNL_ARG_FROM, DNNL_ARG_TO};
    const void *mds[2] = {&a->user, &a->md};
    void *ptrs[2] = {(void *)src, buf};
    fsdp__dnnl_exec(a->reorder, 2, args, mds, ptrs);
    return buf;
}

/* The pointer the primitive takes for operand a whose plain data is at ptr:
 * ptr itself, or arena scratch (an input reordered into it now). NULL when
 * the arena is full. */
static void *xarg_in(struct fsdp_ctx *ctx, const struct xarg *a, const void *ptr) {
    if (!a->reorder) return (void *)ptr;
    void *buf = fsdp_arena_alloc(ctx, a->bytes);
    if (!buf) return NULL;
    if (!a->output) {
        int args[2] = {DNNL_ARG_FROM, DNNL_ARG_TO};
        const void *mds[2] = {&a->user, &a->md};
        void *ptrs[2] = {(void *)ptr, buf};
        fsdp__dnnl_exec(a->reorder, 2, args, mds, ptrs);
    }
    return buf;
}

/* after the primitive: an output held in scratch goes to its plain place */
static void xarg_out(const struct xarg *a, void *buf, void *ptr) {
    if (!a->reorder) return;
    int args[2] = {DNNL_ARG_FROM, DNNL_ARG_TO};
    const void *mds[2] = {&a->md, &a->user};
    void *ptrs[2] = {buf, ptr};
    fsdp__dnnl_exec(a->reorder, 2, args, mds, ptrs);
}

static dnnl_status_t make_prim(dnnl_primitive_desc_t *pd_out, const void *desc, const_dnnl_primitive_desc_t hint,
                               dnnl_primitive_t *prim) {
    dnnl_primitive_desc_t pd = NULL;
    dnnl_status_t st = dnnl_primitive_desc_create(&pd, desc, NULL, fsdp__dnnl_engine(), hint);
    if (st == dnnl_success) st = dnnl_primitive_create(prim, pd);
    if (st == dnnl_success) *pd_out = pd;
    else dnnl_primitive_desc_destroy(pd);
    return st;
}

/* The taps [*k0, *k0 + *kc) of a kernel of k taps (stride st, padding p,
 * dilation d) that meet an input of n pixels for some of the out outputs,
 * and the left and right padding that keeps the output size with those
 * taps alone; 0 when every tap is needed or the shifted padding would be
 * negative ([Note: cropped kernels]). */
static int crop_taps(int64_t n, int64_t out, int k, int st, int p, int d, int *k0, int *kc, int64_t *pl,
                     int64_t *pr) {
    int lo = k, hi = -1;
    for (int t = 0; t < k; t++)
        for (int64_t o = 0; o < out; o++) {
            int64_t i = o * st - p + (int64_t)t * d;
            if (i >= 0 && i < n) {
                if (t < lo) lo = t;
                hi = t;
                break;
            }
        }
    if (hi < lo || (lo == 0 && hi == k - 1)) return 0;
    *k0 = lo;
    *kc = hi - lo + 1;
    *pl = p - (int64_t)lo * d;
    *pr = (out - 1) * st + (int64_t)(*kc - 1) * d + 1 - n - *pl;
    return *pl >= 0 && *pr >= 0;
}

/* Makes the forward and both backward primitives for input (N, in, H, W) in
 * dtype dt (F32 or BF16) with their operands ([Note: conv layouts]); a
 * failure leaves p empty and returns oneDNN's status. */
static dnnl_status_t prims_make(struct conv *C, int64_t N, int64_t H, int64_t W, enum fsdp_dtype dt) {
    dnnl_format_tag_t itag = C->in_l == FSDP_LAYOUT_BLOCKED16 ? dnnl_nChw16c : dnnl_nchw;
    dnnl_format_tag_t otag = C->out_l == FSDP_LAYOUT_BLOCKED16 ? dnnl_nChw16c : dnnl_nchw;
    struct conv_prims *p = &C->p;
    prims_free(p);
    const struct fsdp_conv2d_opts *o = &C->o;
    int64_t G = o->groups, O = o->out_channels, I = o->in_channels;
    dnnl_data_type_t ddt = dt == FSDP_BF16 ? dnnl_bf16 : dnnl_f32;
    dnnl_dims_t sd = {N, I, H, W}, dd = {N, O, C->oh, C->ow}, bd = {O};
    dnnl_dims_t wd = {O, I, o->kernel[0], o->kernel[1]}, gwd = {G, O / G, I / G, o->kernel[0], o->kernel[1]};
    dnnl_dims_t strides = {o->stride[0], o->stride[1]}, dil = {o->dilation[0] - 1, o->dilation[1] - 1};
    dnnl_dims_t pad = {o->padding[0], o->padding[1]}, padr = {o->padding[0], o->padding[1]};
    int wnd = G > 1 ? 5 : 4;
    dnnl_format_tag_t wtag = G > 1 ? dnnl_goihw : dnnl_oihw, any = dnnl_format_tag_any;
    const int64_t *wdims = G > 1 ? gwd : wd;
    /* [Note: cropped kernels]: cd, the taps the primitives see (groups 1 only) */
    int k0[2] = {0, 0}, kc[2] = {o->kernel[0], o->kernel[1]}, cut[2] = {0, 0};
    for (int i = 0; i < 2 && G == 1; i++)
        cut[i] = crop_taps(i ? W : H, i ? C->ow : C->oh, o->kernel[i], o->stride[i], o->padding[i], o->dilation[i],
                           &k0[i], &kc[i], &pad[i], &padr[i]);
    for (int i = 0; i < 2; i++)
        if (!cut[i]) { /* undo a partial answer */
            k0[i] = 0, kc[i] = o->kernel[i];
            pad[i] = padr[i] = o->padding[i];
        }
    p->crop = cut[0] || cut[1];
    dnnl_dims_t cd = {O, I, kc[0], kc[1]}, coff = {0, 0, k0[0], k0[1]};
    if (p->crop) wdims = cd;
    /* the API's layouts (itag, otag: [Note: blocked activations]) and "any" layouts (the primitives') */
    dnnl_memory_desc_t src, wei, dst, dsrc, dwei, ddst, asrc, awei, adst, adsrc, adwei, addst;
    dnnl_status_t st = dnnl_memory_desc_init_by_tag(&src, 4, sd, ddt, itag);
    if (st == dnnl_success) st = dnnl_memory_desc_init_by_tag(&wei, wnd, G > 1 ? gwd : wd, ddt, wtag);
    if (st == dnnl_success) st = dnnl_memory_desc_init_by_tag(&dst, 4, dd, dnnl_f32, otag);
    if (st == dnnl_success) st = dnnl_memory_desc_init_by_tag(&dsrc, 4, sd, dnnl_f32, itag);
    if (st == dnnl_success) st = dnnl_memory_desc_init_by_tag(&dwei, wnd, G > 1 ? gwd : wd, dnnl_f32, wtag);
    if (st == dnnl_success && p->crop) { /* the taps' part of the full weight and its gradient, in place */
        dnnl_memory_desc_t full = wei;
        st = dnnl_memory_desc_init_submemory(&wei, &full, cd, coff);
        full = dwei;
        if (st == dnnl_success) st = dnnl_memory_desc_init_submemory(&dwei, &full, cd, coff);
    }
    if (st == dnnl_success) st = dnnl_memory_desc_init_by_tag(&ddst, 4, dd, ddt, otag);
    if (st == dnnl_success) st = dnnl_memory_desc_init_by_tag(&asrc, 4, sd, ddt, any);
    if (st == dnnl_success) st = dnnl_memory_desc_init_by_tag(&awei, wnd, wdims, ddt, any);
    if (st == dnnl_success) st = dnnl_memory_desc_init_by_tag(&adst, 4, dd, dnnl_f32, any);
    if (st == dnnl_success) st = dnnl_memory_desc_init_by_tag(&adsrc, 4, sd, dnnl_f32, any);
    if (st == dnnl_success) st = dnnl_memory_desc_init_by_tag(&adwei, wnd, wdims, dnnl_f32, any);
    if (st == dnnl_success) st = dnnl_memory_desc_init_by_tag(&addst, 4, dd, ddt, any);
    if (st == dnnl_success) st = dnnl_memory_desc_init_by_tag(&p->bias, 1, bd, dnnl_f32, dnnl_a);
    dnnl_convolution_desc_t fd, bdd, bwd;
    dnnl_primitive_desc_t fpd = NULL, dpd = NULL, wpd = NULL;
    if (st == dnnl_success)
        st = dnnl_dilated_convolution_forward_desc_init(&fd, dnnl_forward_training, dnnl_convolution_direct, &asrc,
                                                        &awei, C->bias ? &p->bias : NULL, &adst, strides, dil, pad,
                                                        padr);
    if (st == dnnl_success) st = make_prim(&fpd, &fd, NULL, &p->fwd);
    if (st == dnnl_success)
        st = dnnl_dilated_convolution_backward_data_desc_init(&bdd, dnnl_convolution_direct, &adsrc, &awei, &addst,
                                                              strides, dil, pad, padr);
    if (st == dnnl_success) st = make_prim(&dpd, &bdd, fpd, &p->bwd_data);
    if (st == dnnl_success)
        st = dnnl_dilated_convolution_backward_weights_desc_init(&bwd, dnnl_convolution_direct, &asrc, &adwei,
                                                                 C->bias ? &p->bias : NULL, &addst, strides, dil,
                                                                 pad, padr);
    /* [Note: bf16 weight gradients of small images]: its own fp32 operands and forward hint */
    dnnl_memory_desc_t wsrc = src, wddst = ddst;
    p->bw_f32 = dt == FSDP_BF16 && C->oh * C->ow <= 16;
    if (st == dnnl_success && p->bw_f32) {
        dnnl_memory_desc_t bsrc, bddst, bdst;
        dnnl_convolution_desc_t f32d;
        dnnl_primitive_desc_t hint = NULL;
        st = dnnl_memory_desc_init_by_tag(&wsrc, 4, sd, dnnl_f32, itag);
        wddst = dst; /* f32 (N, out, OH, OW) in the output's layout */
        if (st == dnnl_success) st = dnnl_memory_desc_init_by_tag(&bsrc, 4, sd, dnnl_f32, any);
        if (st == dnnl_success) st = dnnl_memory_desc_init_by_tag(&bddst, 4, dd, dnnl_f32, any);
        if (st == dnnl_success) st = dnnl_memory_desc_init_by_tag(&bdst, 4, dd, dnnl_f32, any);
        if (st == dnnl_success)
            st = dnnl_dilated_convolution_forward_desc_init(&f32d, dnnl_forward_training, dnnl_convolution_direct,
                                                            &bsrc, &adwei, C->bias ? &p->bias : NULL, &bdst, strides,
                                                            dil, pad, padr);
        if (st == dnnl_success) st = dnnl_primitive_desc_create(&hint, &f32d, NULL, fsdp__dnnl_engine(), NULL);
        if (st == dnnl_success)
            st = dnnl_dilated_convolution_backward_weights_desc_init(&bwd, dnnl_convolution_direct, &bsrc, &adwei,
                                                                     C->bias ? &p->bias : NULL, &bddst, strides, dil,
                                                                     pad, padr);
        if (st == dnnl_success) st = make_prim(&wpd, &bwd, hint, &p->bwd_wei);
        dnnl_primitive_desc_destroy(hint);
    } else if (st == dnnl_success) {
        st = make_prim(&wpd, &bwd, fpd, &p->bwd_wei);
    }
    if (st == dnnl_success) st = xarg_make(&p->a[FWD_SRC], fpd, dnnl_query_src_md, &src, 0);
    if (st == dnnl_success) st = xarg_make(&p->a[FWD_WEI], fpd, dnnl_query_weights_md, &wei, 0);
    if (st == dnnl_success) st = xarg_make(&p->a[FWD_DST], fpd, dnnl_query_dst_md, &dst, 1);
    if (st == dnnl_success) st = xarg_make(&p->a[BD_DDST], dpd, dnnl_query_diff_dst_md, &ddst, 0);
    if (st == dnnl_success) st = xarg_make(&p->a[BD_WEI], dpd, dnnl_query_weights_md, &wei, 0);
    if (st == dnnl_success) st = xarg_make(&p->a[BD_DSRC], dpd, dnnl_query_diff_src_md, &dsrc, 1);
    if (st == dnnl_success) st = xarg_make(&p->a[BW_SRC], wpd, dnnl_query_src_md, &wsrc, 0);
    if (st == dnnl_success) st = xarg_make(&p->a[BW_DDST], wpd, dnnl_query_diff_dst_md, &wddst, 0);
    if (st == dnnl_success) st = xarg_make(&p->a[BW_DWEI], wpd, dnnl_query_diff_weights_md, &dwei, 1);
    /* [Note: one pass into the primitives' layout] (a layout the reorders can make: dsrc and dst are the
       plain fp32 input and output; a blocked copy padded beyond 1/4 more than plain is not kept) */
    size_t plain_x = dnnl_memory_desc_get_size(&src);
    p->keep_x = st == dnnl_success && dt == FSDP_BF16 && !p->bw_f32 && p->a[FWD_SRC].reorder &&
                dnnl_memory_desc_equal(&p->a[FWD_SRC].md, &p->a[BW_SRC].md) &&
                dnnl_memory_desc_get_size(&p->a[FWD_SRC].md) <= plain_x + plain_x / 4;
    if (p->keep_x) st = xarg_make_md(&p->x_in, &p->a[FWD_SRC].md, &dsrc, 0);
    if (st == dnnl_success && !p->bw_f32 && (p->a[BD_DDST].reorder || dt == FSDP_BF16) &&
        dnnl_memory_desc_equal(&p->a[BD_DDST].md, &p->a[BW_DDST].md))
        st = xarg_make_md(&p->dy_in, &p->a[BD_DDST].md, &dst, 0);
    p->x_op = xarg_ready(&p->x_in);
    p->dy_op = xarg_ready(&p->dy_in);
    dnnl_primitive_desc_destroy(fpd);
    dnnl_primitive_desc_destroy(dpd);
    dnnl_primitive_desc_destroy(wpd);
    if (st != dnnl_success) {
        prims_free(p);
        return st;
    }
    p->n = N, p->h = H, p->w = W, p->dt = dt, p->made = 1;
    p->in_l = C->in_l, p->out_l = C->out_l;
    return dnnl_success;
}

/* Primitives for this input in dt, made if needed; FSDP_ERR_UNSUPPORTED
 * naming the module if oneDNN has none (fp32), or *ok = 0 (bf16: the caller
 * widens instead). */
static enum fsdp_status prims_get(struct fsdp_ctx *ctx, struct fsdp_module *m, enum fsdp_dtype dt, int *ok) {
    struct conv *C = m->impl;
    *ok = 1;
    if (C->p.made && C->p.n == C->n && C->p.h == C->h && C->p.w == C->w && C->p.dt == dt && C->p.in_l == C->in_l &&
        C->p.out_l == C->out_l)
        return FSDP_OK;
    dnnl_status_t st = prims_make(C, C->n, C->h, C->w, dt);
    if (st == dnnl_success) return FSDP_OK;
    *ok = 0;
    if (dt != FSDP_F32) return FSDP_OK;
    return fsdp__err(ctx, FSDP_ERR_UNSUPPORTED, "Conv2d '%s': oneDNN has no convolution for input (%lld, %lld, %lld, %lld) "
                     "(status %d)", fsdp__mname(m), (long long)C->n, (long long)C->o.in_channels, (long long)C->h,
                     (long long)C->w, (int)st);
}

/* Runs prim over operands a[0..n) at plain pointers ptr[] (inputs reordered
 * before, outputs after), plus the bias (or its gradient) at bias if not NULL
 * with argument bias_arg. FSDP_ERR_NOMEM when the arena cannot hold a
 * reordered operand (scratch released either way). */
static enum fsdp_status run_prim(struct fsdp_ctx *ctx, struct fsdp_module *m, dnnl_primitive_t prim,
                                 const struct xarg *const *a, const int *arg, int n, void *const *ptr,
                                 void *bias, int bias_arg) {
    struct conv *C = m->impl;
    size_t mark = fsdp_arena_mark(ctx);
    int args[5];
    const void *mds[5];
    void *bufs[5];
    for (int i = 0; i < n; i++) {
        bufs[i] = xarg_in(ctx, a[i], ptr[i]);
        if (!bufs[i]) {
            fsdp_arena_release(ctx, mark);
            return fsdp__err(ctx, FSDP_ERR_NOMEM, "Conv2d '%s': no memory for a reordered operand", fsdp__mname(m));
        }
        args[i] = arg[i];
        mds[i] = &a[i]->md;
    }
    if (bias) {
        args[n] = bias_arg;
        mds[n] = &C->p.bias;
        bufs[n] = bias;
    }
    fsdp__dnnl_exec(prim, n + (bias != NULL), args, mds, bufs);
    for (int i = 0; i < n; i++)
        if (a[i]->output) xarg_out(a[i], bufs[i], ptr[i]);
    fsdp_arena_release(ctx, mark);
    return FSDP_OK;
}

/* n 16-bit values of dt (BF16/F16) at src widened to fp32, in the arena (exact) */
static float *widened_copy(struct fsdp_ctx *ctx, enum fsdp_dtype dt, const void *src, int64_t n, const char *what) {
    float *out = fsdp__scratch(ctx, n, what);
    if (out) fsdp__cvt_to_f32(dt, src, out, (size_t)n);
    return out;
}

/* n values of src rounded to dt (BF16/F16) and widened back to fp32, in the arena */
static float *rounded_copy(struct fsdp_ctx *ctx, enum fsdp_dtype dt, const float *src, int64_t n, const char *what) {
    float *out = fsdp__scratch(ctx, n, what);
    if (out) fsdp__cvt_round(dt, src, out, (size_t)n);
    return out;
}

/* The weight as the primitives take it (fsdp__pdata_lp's 16-bit values, the
 * fp32 values rounded to lp where the products are widened, or the fp32
 * values), in the arena where a copy is made. The weight is an lp_reader: a
 * 16-bit pass may have made no fp32 values for it ([Note: lazy widening] in
 * precision.c), so every form is read through the accessors that know where
 * the values are. */
static const void *conv_weight(struct fsdp_ctx *ctx, const struct conv *C, enum fsdp_dtype xdt) {
    if (xdt == FSDP_BF16) return fsdp__pdata_lp(ctx, C->weight, FSDP_BF16);
    if (!C->widen) return fsdp__pdata_f32(ctx, C->weight, "Conv2d weight (fp32)");
    float *w = fsdp__scratch(ctx, C->weight->numel, "Conv2d weight (rounded)");
    if (w) fsdp__prows(C->weight, C->weight->numel, 0, 1, C->lp, FSDP_F32, w);
    return w;
}

static int64_t out_size(int64_t in, int k, int s, int p, int d) {
    return (in + 2 * (int64_t)p - (int64_t)d * (k - 1) - 1) / s + 1;
}

static const struct fsdp_module_ops conv_ops;

static enum fsdp_status conv_forward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *in,
                                     struct fsdp_tensor *out) {
    struct conv *C = m->impl;
    const struct fsdp_conv2d_opts *o = &C->o;
    enum fsdp_dtype lp = fsdp__compute_dtype(m);
    int in16 = lp != FSDP_F32 && in && in->dtype == lp; /* [Note: 16-bit hand-off]: the rounded input */
    FSDP_TRY(fsdp__check_input_any(ctx, m, in, in16 ? lp : FSDP_F32, 4, 0));
    if (in->shape[1] != o->in_channels)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "Conv2d '%s': input has %lld channels, expected %lld",
                         fsdp__mname(m), (long long)in->shape[1], (long long)o->in_channels);
    int64_t N = in->shape[0], H = in->shape[2], W = in->shape[3];
    int64_t OH = out_size(H, o->kernel[0], o->stride[0], o->padding[0], o->dilation[0]);
    int64_t OW = out_size(W, o->kernel[1], o->stride[1], o->padding[1], o->dilation[1]);
    if (OH <= 0 || OW <= 0)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "Conv2d '%s': input %lldx%lld is smaller than the kernel",
                         fsdp__mname(m), (long long)H, (long long)W);
    FSDP_TRY(fsdp__param_ready(ctx, C->weight, 0));
    if (C->bias) FSDP_TRY(fsdp__param_ready(ctx, C->bias, 0));
    int64_t oshape[4] = {N, o->out_channels, OH, OW};
    FSDP_TRY(fsdp__tensor_prepare(ctx, out, FSDP_F32, 4, oshape, "Conv2d output"));
    out->layout = fsdp__layout_for(o->out_layout, 4, o->out_channels);
    C->n = N, C->h = H, C->w = W, C->oh = OH, C->ow = OW;
    C->in_l = in->layout, C->out_l = out->layout;
    int ok = 0;
    if (lp == FSDP_BF16 && fsdp_gemm_native(FSDP_BF16)) FSDP_TRY(prims_get(ctx, m, FSDP_BF16, &ok));
    C->lp = lp;
    C->widen = lp != FSDP_F32 && !ok;
    const void *x = in->data, *w = NULL;
    enum fsdp_dtype xdt = FSDP_F32;
    int64_t nx = fsdp_tensor_numel(in);
    int keep = ok && C->p.keep_x && !in16;
    if (in16 && ok) { /* the caller's bf16 input, kept for backward as it is */
        xdt = FSDP_BF16;
    } else if (in16) { /* widened: the 16-bit values in fp32 are the rounded copy */
        float *xw = widened_copy(ctx, lp, in->data, nx, "Conv2d input (16-bit, widened)");
        if (!xw) return FSDP_ERR_NOMEM;
        FSDP_TRY(prims_get(ctx, m, FSDP_F32, &ok));
        x = xw;
    } else if (keep) { /* [Note: one pass into the primitives' layout]: kept for backward */
        x = xarg_from_f32(ctx, &C->p.x_in, in->data);
        if (!x) return fsdp__err(ctx, FSDP_ERR_NOMEM, "Conv2d '%s': no memory for the input (bf16)", fsdp__mname(m));
        xdt = FSDP_BF16;
    } else if (ok) { /* native bf16: the 16-bit input is kept for backward */
        x = fsdp__lp_copy(ctx, FSDP_BF16, in->data, nx, "Conv2d input (bf16)");
        if (!x) return FSDP_ERR_NOMEM;
        xdt = FSDP_BF16;
    } else {
        FSDP_TRY(prims_get(ctx, m, FSDP_F32, &ok));
        if (C->widen && !(x = rounded_copy(ctx, lp, in->data, nx, "Conv2d input (rounded)"))) return FSDP_ERR_NOMEM;
    }
    size_t mark = fsdp_arena_mark(ctx);
    if (!(w = conv_weight(ctx, C, xdt))) {
        fsdp_arena_release(ctx, mark);
        return FSDP_ERR_NOMEM;
    }
    const struct xarg *a[3] = {keep ? &C->p.x_op : &C->p.a[FWD_SRC], &C->p.a[FWD_WEI], &C->p.a[FWD_DST]};
    int args[3] = {DNNL_ARG_SRC, DNNL_ARG_WEIGHTS, DNNL_ARG_DST};
    void *ptrs[3] = {(void *)x, (void *)w, out->data};
    enum fsdp_status st = run_prim(ctx, m, C->p.fwd, a, args, 3, ptrs, C->bias ? fsdp__pdata(C->bias) : NULL,
                                   DNNL_ARG_BIAS);
    fsdp_arena_release(ctx, mark);
    FSDP_TRY(st);
    C->x = x;
    C->xdt = xdt;
    C->x_kept = keep;
    m->priv->dout_dtype = lp; /* [Note: 16-bit hand-off]: 16-bit compute rounds dy, so it takes dy rounded */
    return FSDP_OK;
}

enum fsdp_dtype fsdp__conv_input_dtype(const struct fsdp_module *m) {
    return m->ops == &conv_ops ? fsdp__compute_dtype(m) : FSDP_F32;
}

static enum fsdp_status conv_backward(struct fsdp_module *m, struct fsdp_ctx *ctx, const struct fsdp_tensor *dout,
                                      struct fsdp_tensor *din) {
    struct conv *C = m->impl;
    const struct fsdp_conv2d_opts *o = &C->o;
    if (!C->x) return fsdp__err(ctx, FSDP_ERR_STATE, "Conv2d '%s': backward without forward", fsdp__mname(m));
    int d16 = C->lp != FSDP_F32 && dout && dout->dtype == C->lp; /* [Note: 16-bit hand-off]: dy rounded */
    FSDP_TRY(fsdp__check_input_any(ctx, m, dout, d16 ? C->lp : FSDP_F32, 4, 0));
    FSDP_TRY(fsdp__check_grad_layout(ctx, m, dout, C->out_l));
    if (dout->shape[0] != C->n || dout->shape[1] != o->out_channels || dout->shape[2] != C->oh ||
        dout->shape[3] != C->ow)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "Conv2d '%s': gradient is (%lld, %lld, %lld, %lld), output was "
                         "(%lld, %lld, %lld, %lld)", fsdp__mname(m), (long long)dout->shape[0],
                         (long long)dout->shape[1], (long long)dout->shape[2], (long long)dout->shape[3],
                         (long long)C->n, (long long)o->out_channels, (long long)C->oh, (long long)C->ow);
    FSDP_TRY(fsdp__param_ready(ctx, C->weight, 1));
    if (C->bias) FSDP_TRY(fsdp__param_ready(ctx, C->bias, 1));
    int ok = 1;
    FSDP_TRY(prims_get(ctx, m, C->xdt, &ok)); /* the forward's (remade if another shape ran since) */
    if (!ok) return fsdp__err(ctx, FSDP_ERR_STATE, "Conv2d '%s': bf16 primitives vanished", fsdp__mname(m));
    int64_t in_shape[4] = {C->n, o->in_channels, C->h, C->w};
    if (din) {
        FSDP_TRY(fsdp__tensor_prepare(ctx, din, FSDP_F32, 4, in_shape, "Conv2d input gradient"));
        din->layout = C->in_l;
    }
    size_t mark = fsdp_arena_mark(ctx);
    int64_t ny = fsdp_tensor_numel(dout);
    const void *dy = dout->data;
    const struct xarg *bw_src = C->x_kept ? &C->p.x_op : &C->p.a[BW_SRC];
    const struct xarg *bw_ddst = &C->p.a[BW_DDST], *bd_ddst = &C->p.a[BD_DDST];
    if (d16 && C->xdt == FSDP_BF16) { /* as it is */
    } else if (d16) { /* widened: the 16-bit values in fp32 are the rounded copy */
        dy = widened_copy(ctx, C->lp, dout->data, ny, "Conv2d output gradient (16-bit, widened)");
    } else if (C->p.dy_in.reorder && !C->widen) { /* [Note: one pass into the primitives' layout] (widened: rounded first) */
        dy = xarg_from_f32(ctx, &C->p.dy_in, dout->data);
        bw_ddst = bd_ddst = &C->p.dy_op;
    } else if (C->xdt == FSDP_BF16) {
        dy = fsdp__lp_copy(ctx, FSDP_BF16, dout->data, ny, "Conv2d output gradient (bf16)");
    } else if (C->widen) {
        dy = rounded_copy(ctx, C->lp, dout->data, ny, "Conv2d output gradient (rounded)");
    }
    if (!dy) {
        fsdp_arena_release(ctx, mark);
        return FSDP_ERR_NOMEM;
    }
    /* weights (and bias) gradient: written outright when unset, else via scratch and added */
    float bw = 0.0f, bb = 0.0f;
    float *gw = fsdp__pgrad_first(C->weight, &bw), *gb = C->bias ? fsdp__pgrad_first(C->bias, &bb) : NULL;
    float *tw = bw != 0.0f ? fsdp__scratch(ctx, C->weight->numel, "Conv2d weight gradient") : gw;
    float *tb = gb && bb != 0.0f ? fsdp__scratch(ctx, o->out_channels, "Conv2d bias gradient") : gb;
    if (!tw || (gb && !tb)) {
        fsdp_arena_release(ctx, mark);
        return FSDP_ERR_NOMEM;
    }
    if (C->p.crop) memset(tw, 0, (size_t)C->weight->numel * sizeof(float)); /* taps outside the crop */
    const void *wx = C->x, *wdy = dy;
    size_t wmark = fsdp_arena_mark(ctx);
    if (C->p.bw_f32) { /* [Note: bf16 weight gradients of small images] */
        int64_t nx = C->n * o->in_channels * C->h * C->w;
        wx = widened_copy(ctx, FSDP_BF16, C->x, nx, "Conv2d input (bf16, widened)");
        wdy = d16 ? widened_copy(ctx, FSDP_BF16, dout->data, ny, "Conv2d output gradient (bf16, widened)")
                  : rounded_copy(ctx, FSDP_BF16, dout->data, ny, "Conv2d output gradient (bf16, widened)");
        if (!wx || !wdy) {
            fsdp_arena_release(ctx, mark);
            return FSDP_ERR_NOMEM;
        }
    }
    const struct xarg *aw[3] = {bw_src, bw_ddst, &C->p.a[BW_DWEI]};
    int argw[3] = {DNNL_ARG_SRC, DNNL_ARG_DIFF_DST, DNNL_ARG_DIFF_WEIGHTS};
    void *ptrw[3] = {(void *)wx, (void *)wdy, tw};
    enum fsdp_status st = run_prim(ctx, m, C->p.bwd_wei, aw, argw, 3, ptrw, tb, DNNL_ARG_DIFF_BIAS);
    fsdp_arena_release(ctx, wmark); /* the widened copies (tw, tb lie before the mark) */
    if (st != FSDP_OK) {
        fsdp_arena_release(ctx, mark);
        return st;
    }
    if (tw != gw) {
        int64_t n = C->weight->numel;
#pragma omp parallel for simd schedule(static)
        for (int64_t i = 0; i < n; i++) gw[i] += tw[i];
    }
    if (tb != gb)
        for (int64_t i = 0; i < o->out_channels; i++) gb[i] += tb[i];
    if (din) {
        const void *w = conv_weight(ctx, C, C->xdt);
        if (!w) {
            fsdp_arena_release(ctx, mark);
            return FSDP_ERR_NOMEM;
        }
        const struct xarg *ad[3] = {bd_ddst, &C->p.a[BD_WEI], &C->p.a[BD_DSRC]};
        int argd[3] = {DNNL_ARG_DIFF_DST, DNNL_ARG_WEIGHTS, DNNL_ARG_DIFF_SRC};
        void *ptrd[3] = {(void *)dy, (void *)w, din->data};
        st = run_prim(ctx, m, C->p.bwd_data, ad, argd, 3, ptrd, NULL, 0);
    }
    fsdp_arena_release(ctx, mark);
    return st;
}

static void conv_destroy(struct fsdp_module *m) {
    struct conv *C = m->impl;
    if (!C) return;
    prims_free(&C->p);
    free(C);
}

static const struct fsdp_module_ops conv_ops = {"Conv2d", conv_forward, conv_backward, conv_destroy};

struct fsdp_conv2d_opts fsdp_conv2d_opts_default(int64_t in_channels, int64_t out_channels, int kernel) {
    struct fsdp_conv2d_opts o;
    memset(&o, 0, sizeof o);
    o.in_channels = in_channels;
    o.out_channels = out_channels;
    o.kernel[0] = o.kernel[1] = kernel;
    o.stride[0] = o.stride[1] = 1;
    o.dilation[0] = o.dilation[1] = 1;
    o.groups = 1;
    o.bias = 1;
    return o;
}

enum fsdp_status fsdp_conv2d_create(struct fsdp_ctx *ctx, const char *name, const struct fsdp_conv2d_opts *opts,
                                    struct fsdp_module **out_m) {
    const struct fsdp_conv2d_opts *o = opts;
    if (o->in_channels <= 0 || o->out_channels <= 0 || o->groups <= 0 || o->in_channels % o->groups ||
        o->out_channels % o->groups)
        return fsdp__err(ctx, FSDP_ERR_INVALID, "Conv2d '%s': channels (%lld, %lld) must be positive multiples of "
                         "groups %d", name, (long long)o->in_channels, (long long)o->out_channels, o->groups);
    for (int i = 0; i < 2; i++)
        if (o->kernel[i] <= 0 || o->stride[i] <= 0 || o->dilation[i] <= 0 || o->padding[i] < 0)
            return fsdp__err(ctx, FSDP_ERR_INVALID, "Conv2d '%s': kernel %d, stride %d, dilation %d must be "
                             "positive and padding %d not negative", name, o->kernel[i], o->stride[i],
                             o->dilation[i], o->padding[i]);
    if (!(o->init_std >= 0.0f))
        return fsdp__err(ctx, FSDP_ERR_INVALID, "Conv2d '%s': init_std %g is negative", name, (double)o->init_std);
    struct fsdp_module *m;
    FSDP_TRY(fsdp_module_create(ctx, &conv_ops, name, &m));
    struct conv *C = fsdp__zalloc(1, sizeof *C);
    if (!C) {
        fsdp_module_free(m);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory creating Conv2d '%s'", name);
    }
    m->impl = C;
    C->o = *o;
    /* torchvision's ResNet init: kaiming_normal_(mode="fan_out", nonlinearity="relu") */
    float std = o->init_std > 0.0f ? o->init_std
                                   : sqrtf(2.0f / (float)(o->out_channels * o->kernel[0] * o->kernel[1]));
    int64_t wshape[4] = {o->out_channels, o->in_channels / o->groups, o->kernel[0], o->kernel[1]};
    int64_t bshape[1] = {o->out_channels};
    enum fsdp_status st = fsdp_module_add_param(ctx, m, "weight", 4, wshape, (struct fsdp_init){FSDP_INIT_NORMAL, std},
                                                0, &C->weight);
    if (st == FSDP_OK && o->bias)
        st = fsdp_module_add_param(ctx, m, "bias", 1, bshape, (struct fsdp_init){FSDP_INIT_ZEROS, 0.0f}, 1, &C->bias);
    if (st != FSDP_OK) {
        fsdp_module_free(m);
        return st;
    }
    C->weight->priv->grad_writer = 1; /* [Note: unset gradients] */
    C->weight->priv->lp_reader = 1;   /* read through conv_weight ([Note: lazy widening]) */
    if (C->bias) C->bias->priv->grad_writer = 1;
    *out_m = m;
    return FSDP_OK;
}
