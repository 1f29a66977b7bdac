/* The short causal depthwise convolution of the layers (ShortConv, T > 1 on the CPU), forward and backward,
   with the optional SiLU fused (in torch it was ~20% of a Gated DeltaNet LM training step, as
   depthwise conv1d or as K shifted multiply-adds, each a full pass over [B, T, D]).

     pre[b, t, d] = bias[d] + sum_j w[j, d] xp[b, t + j, d]      xp [B, T + K - 1, D] (look-back, then x)
     y = silu(pre) (act) or pre

   Forward: one pass (pre kept for the SiLU's backward). Backward: one pass over blocks of rows (conv_bwd: the
   gradient through the SiLU per block, dx by gathering, each row owned by one block, and dw, db as per-block
   partial sums added in block order). x and its look-back are read where they lie (CONV_ROW): the layer passes
   them apart (linattn_conv_*_sep), so no padded copy of x is built.
   float and double from one body (this file includes itself once per REAL). The SiLU takes its exp from
   common.h (plain arithmetic, so the loops vectorise; libm's expf is a call per element and made the SiLU most
   of the kernel's time). No -ffast-math: inf/NaN propagate as in torch. */
#ifndef LINATTN_CONV_BODY
#define LINATTN_CONV_BODY

#include "common.h"

LA_ABI_VERSION(conv, 1)

/* Row i of the padded input (i < K - 1: the look-back, past row i, or zeros; else x row i - (K - 1)) of sequence b:
   the look-back and x are read where they lie, so the layer never builds the padded copy [B, T + K - 1, D] (nor its
   backward a slice of it). xs, ps: the sequence strides of x and past, in elements. */
#define CONV_BLOCK 64 /* padded rows per block of the backward */
#define CONV_ROW(b, i) ((i) < K - 1 ? (past ? past + (b) * ps + (i) * D : zero) : x + (b) * xs + ((i) - (K - 1)) * D)

#define REAL float
#define FN(name) name##_f32
#include "conv.c"
#undef REAL
#undef FN

#define REAL double
#define FN(name) name##_f64
#include "conv.c"
#undef REAL
#undef FN

#else /* ------------------------------------------------------------------ the body, once per REAL */
#include "common.h" /* its per-REAL part: la_exp, la_silu, la_l2_row, la_rms_rstd */

static int FN(conv_fwd)(int64_t B, int64_t T, int64_t D, int64_t K, const REAL *x, int64_t xs,
                        const REAL *past, int64_t ps, const REAL *w, const REAL *bias, int act, REAL *y,
                        REAL *pre, int nthreads) {
    REAL *zero = NULL;
    if (!past && K > 1) {
        zero = (REAL *)calloc((size_t)D + 1, sizeof(REAL));
        if (!zero) return 1;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < B * T; ++r) {
        const int64_t b = r / T, t = r % T;
        const REAL *x0 = CONV_ROW(b, t);
        REAL *yr = y + r * D, *pr = pre ? pre + r * D : NULL;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) yr[d] = x0[d] * w[d];
        for (int64_t j = 1; j < K; ++j) {
            const REAL *restrict xj = CONV_ROW(b, t + j), *restrict wj = w + j * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) yr[d] += xj[d] * wj[d];
        }
        if (bias)
            for (int64_t d = 0; d < D; ++d) yr[d] += bias[d];
        if (act) {
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) { REAL a = yr[d]; if (pr) pr[d] = a; yr[d] = FN(la_silu)(a); }
        }
    }
    free(zero);
    return 0;
}

/* gy [B, T, D]; pre (act) [B, T, D]; outputs dx (stride xs), dpast (stride ps; NULL: not wanted), dw [K, D],
   db [D] (NULL: not wanted). One pass over blocks of CONV_BLOCK padded rows of one sequence: a block forms the
   gradient through the SiLU (ga) of the outputs it touches in a buffer of its own, then for each padded row i
   dx_i = sum_j ga_{i-j} w_j, dw_j += ga_{i-j} x_i, db += ga_i; dw and db are summed per block, then the blocks
   in order (the same bits for every thread count). */
static int FN(conv_bwd)(int64_t B, int64_t T, int64_t D, int64_t K, const REAL *x, int64_t xs,
                        const REAL *past, int64_t ps, const REAL *w, const REAL *bias, int act,
                        const REAL *pre, const REAL *gy, REAL *dx, REAL *dpast, REAL *dw, REAL *db,
                        int nthreads) {
    const int64_t TP = T + K - 1, nbs = (TP + CONV_BLOCK - 1) / CONV_BLOCK, nb = B * nbs, W = (K + 1) * D;
    const int want_w = dw != NULL || db != NULL;
    REAL *zero = NULL, *part = NULL;
    int failed = 0;
    if (!past && K > 1) {
        zero = (REAL *)calloc((size_t)D + 1, sizeof(REAL));
        if (!zero) return 1;
    }
    if (want_w) {
        part = (REAL *)calloc((size_t)(nb * W) + 1, sizeof(REAL));
        if (!part) { free(zero); return 1; }
    }
#pragma omp parallel num_threads(nthreads)
    {
        /* ga of outputs t in [i0 - K + 1, i0 + CONV_BLOCK): row t at buf + (t - i0 + K - 1) * D */
        REAL *buf = act ? (REAL *)malloc(sizeof(REAL) * (size_t)((CONV_BLOCK + K - 1) * D + 1)) : NULL;
        if (act && !buf) {
            LA_ATOMIC_WRITE failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t blk = 0; blk < nb; ++blk) {
            if (act && !buf) continue;
            const int64_t b = blk / nbs, i0 = (blk % nbs) * CONV_BLOCK;
            const int64_t i1 = i0 + CONV_BLOCK < TP ? i0 + CONV_BLOCK : TP;
            const int64_t tlo = i0 - K + 1 > 0 ? i0 - K + 1 : 0, thi = i1 < T ? i1 : T;
            const REAL *gb = gy + b * T * D;
            if (act) { /* pre from the forward, or recomputed from the rows this block reads anyway */
                for (int64_t t = tlo; t < thi; ++t) {
                    const REAL *restrict gr = gb + t * D;
                    REAL *restrict o = buf + (t - i0 + K - 1) * D;
                    if (pre) {
                        const REAL *restrict pr = pre + (b * T + t) * D;
#pragma omp simd
                        for (int64_t d = 0; d < D; ++d) o[d] = pr[d];
                    } else {
                        const REAL *restrict x0 = CONV_ROW(b, t);
#pragma omp simd
                        for (int64_t d = 0; d < D; ++d) o[d] = x0[d] * w[d];
                        for (int64_t j = 1; j < K; ++j) {
                            const REAL *restrict xj = CONV_ROW(b, t + j), *restrict wj = w + j * D;
#pragma omp simd
                            for (int64_t d = 0; d < D; ++d) o[d] += xj[d] * wj[d];
                        }
                        if (bias)
                            for (int64_t d = 0; d < D; ++d) o[d] += bias[d];
                    }
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) {
                        REAL a = o[d], s = FN(la_sigmoid)(a);
                        o[d] = gr[d] * (s * ((REAL)1 + a * ((REAL)1 - s)));
                    }
                }
            }
            REAL *pw = want_w ? part + blk * W : NULL;
            for (int64_t i = i0; i < i1; ++i) {
                REAL *o = i < K - 1 ? (dpast ? dpast + b * ps + i * D : NULL)
                                    : (dx ? dx + b * xs + (i - (K - 1)) * D : NULL);
                const REAL *restrict xr = CONV_ROW(b, i);
                if (o) memset(o, 0, sizeof(REAL) * (size_t)D);
                for (int64_t j = 0; j < K; ++j) {
                    const int64_t t = i - j;
                    if (t < 0 || t >= T) continue;
                    const REAL *restrict g = act ? buf + (t - i0 + K - 1) * D : gb + t * D;
                    const REAL *restrict wj = w + j * D;
                    if (o) {
#pragma omp simd
                        for (int64_t d = 0; d < D; ++d) o[d] += g[d] * wj[d];
                    }
                    if (pw) {
                        REAL *restrict p = pw + j * D;
#pragma omp simd
                        for (int64_t d = 0; d < D; ++d) p[d] += g[d] * xr[d];
                    }
                }
                if (pw && i < T) { /* db: each output once, in the block that holds its index */
                    const REAL *restrict g = act ? buf + (i - i0 + K - 1) * D : gb + i * D;
                    REAL *restrict p = pw + K * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) p[d] += g[d];
                }
            }
        }
        free(buf);
    }
    if (want_w && !failed) {
        for (int64_t e = 0; e < W; ++e) {
            REAL s = 0;
            for (int64_t blk = 0; blk < nb; ++blk) s += part[blk * W + e];
            if (e < K * D) { if (dw) dw[e] = s; }
            else if (db) db[e - K * D] = s;
        }
    }
    free(part);
    free(zero);
    return failed;
}

/* The padded input xp [B, T + K - 1, D] (the look-back, then x). */
int FN(linattn_conv_fwd)(int64_t B, int64_t T, int64_t D, int64_t K, const REAL *xp, const REAL *w,
                         const REAL *bias, int act, REAL *y, REAL *pre, int nthreads) {
    const int64_t TP = T + K - 1;
    return FN(conv_fwd)(B, T, D, K, xp + (K - 1) * D, TP * D, xp, TP * D, w, bias, act, y, pre, nthreads);
}

int FN(linattn_conv_bwd)(int64_t B, int64_t T, int64_t D, int64_t K, const REAL *xp, const REAL *w,
                         const REAL *pre, const REAL *gy, REAL *dxp, REAL *dw, REAL *db, int nthreads) {
    const int64_t TP = T + K - 1;
    return FN(conv_bwd)(B, T, D, K, xp + (K - 1) * D, TP * D, xp, TP * D, w, NULL, pre != NULL, pre, gy,
                        dxp ? dxp + (K - 1) * D : NULL, dxp, dw, db, nthreads);
}

/* x [B, T, D] and its look-back past [B, K - 1, D] (NULL: zeros) apart. pre may be NULL with act: the backward
   then recomputes it (from the rows it reads anyway), which saves the forward a [B, T, D] write. */
int FN(linattn_conv_fwd_sep)(int64_t B, int64_t T, int64_t D, int64_t K, const REAL *x, const REAL *past,
                             const REAL *w, const REAL *bias, int act, REAL *y, REAL *pre, int nthreads) {
    return FN(conv_fwd)(B, T, D, K, x, T * D, past, (K - 1) * D, w, bias, act, y, pre, nthreads);
}

int FN(linattn_conv_bwd_sep)(int64_t B, int64_t T, int64_t D, int64_t K, const REAL *x, const REAL *past,
                             const REAL *w, const REAL *bias, int act, const REAL *gy, REAL *dx,
                             REAL *dpast, REAL *dw, REAL *db, int nthreads) {
    return FN(conv_bwd)(B, T, D, K, x, T * D, past, (K - 1) * D, w, bias, act, NULL, gy, dx, dpast, dw, db,
                        nthreads);
}

#endif
