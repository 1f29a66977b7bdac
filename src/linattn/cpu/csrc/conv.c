/* The short causal depthwise convolution of the layers (ShortConv, T > 1 on the CPU), forward and backward,
   with the optional SiLU fused (issue 34.5: in torch it was ~20% of a Gated DeltaNet LM training step, as
   depthwise conv1d or as K shifted multiply-adds, each a full pass over [B, T, D]).

     pre[b, t, d] = bias[d] + sum_j w[j, d] xp[b, t + j, d]      xp [B, T + K - 1, D] (look-back, then x)
     y = silu(pre) (act) or pre

   Forward: one pass (pre kept for the SiLU's backward). Backward: one pass over blocks of rows (conv_bwd: the
   gradient through the SiLU per block, dx by gathering, each row owned by one block, and dw, db as per-block
   partial sums added in block order). x and its look-back are read where they lie (CONV_ROW): the layer passes
   them apart (linattn_conv_*_sep), so no padded copy of x is built.
   float and double from one body. The float SiLU takes its exp from vexp.h (plain arithmetic, so the loops
   vectorise; libm's expf is a call per element and made the SiLU most of the kernel's time). No -ffast-math:
   inf/NaN propagate as in torch. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "vexp.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=fast")
#elif defined(__clang__)
#pragma clang fp contract(fast)
#endif

/* Row i of the padded input (i < K - 1: the look-back, past row i, or zeros; else x row i - (K - 1)) of sequence b:
   the look-back and x are read where they lie, so the layer never builds the padded copy [B, T + K - 1, D] (nor its
   backward a slice of it). xs, ps: the sequence strides of x and past, in elements. */
#define CONV_BLOCK 64 /* padded rows per block of the backward */
#define CONV_ROW(b, i) ((i) < K - 1 ? (past ? past + (b) * ps + (i) * D : zero) : x + (b) * xs + ((i) - (K - 1)) * D)

#define DEFINE_CONV(SFX, real, EXP)                                                                             \
static int conv_fwd_##SFX(int64_t B, int64_t T, int64_t D, int64_t K, const real *x, int64_t xs,               \
                          const real *past, int64_t ps, const real *w, const real *bias, int act, real *y,      \
                          real *pre, int nthreads) {                                                            \
    real *zero = NULL;                                                                                          \
    if (!past && K > 1) {                                                                                       \
        zero = (real *)calloc((size_t)D + 1, sizeof(real));                                                     \
        if (!zero) return 1;                                                                                    \
    }                                                                                                           \
    _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                                          \
    for (int64_t r = 0; r < B * T; ++r) {                                                                       \
        const int64_t b = r / T, t = r % T;                                                                     \
        const real *x0 = CONV_ROW(b, t);                                                                        \
        real *yr = y + r * D, *pr = pre ? pre + r * D : NULL;                                                   \
        _Pragma("omp simd")                                                                                     \
        for (int64_t d = 0; d < D; ++d) yr[d] = x0[d] * w[d];                                                   \
        for (int64_t j = 1; j < K; ++j) {                                                                       \
            const real *restrict xj = CONV_ROW(b, t + j), *restrict wj = w + j * D;                             \
            _Pragma("omp simd")                                                                                 \
            for (int64_t d = 0; d < D; ++d) yr[d] += xj[d] * wj[d];                                             \
        }                                                                                                       \
        if (bias)                                                                                               \
            for (int64_t d = 0; d < D; ++d) yr[d] += bias[d];                                                   \
        if (act) {                                                                                              \
            _Pragma("omp simd")                                                                                 \
            for (int64_t d = 0; d < D; ++d) { real a = yr[d]; if (pr) pr[d] = a; yr[d] = a / ((real)1 + EXP(-a)); } \
        }                                                                                                       \
    }                                                                                                           \
    free(zero);                                                                                                 \
    return 0;                                                                                                   \
}                                                                                                               \
                                                                                                                \
/* gy [B, T, D]; pre (act) [B, T, D]; outputs dx (stride xs), dpast (stride ps; NULL: not wanted), dw [K, D],   \
   db [D] (NULL: not wanted). One pass over blocks of CONV_BLOCK padded rows of one sequence: a block forms the   \
   gradient through the SiLU (ga) of the outputs it touches in a buffer of its own, then for each padded row i   \
   dx_i = sum_j ga_{i-j} w_j, dw_j += ga_{i-j} x_i, db += ga_i; dw and db are summed per block, then the blocks  \
   in order (the same bits for every thread count). */                                                          \
static int conv_bwd_##SFX(int64_t B, int64_t T, int64_t D, int64_t K, const real *x, int64_t xs,               \
                          const real *past, int64_t ps, const real *w, const real *bias, int act,               \
                          const real *pre, const real *gy, real *dx, real *dpast, real *dw, real *db,           \
                          int nthreads) {                                                                       \
    const int64_t TP = T + K - 1, nbs = (TP + CONV_BLOCK - 1) / CONV_BLOCK, nb = B * nbs, W = (K + 1) * D;      \
    const int want_w = dw != NULL || db != NULL;                                                                \
    real *zero = NULL, *part = NULL;                                                                            \
    int failed = 0;                                                                                             \
    if (!past && K > 1) {                                                                                       \
        zero = (real *)calloc((size_t)D + 1, sizeof(real));                                                     \
        if (!zero) return 1;                                                                                    \
    }                                                                                                           \
    if (want_w) {                                                                                               \
        part = (real *)calloc((size_t)(nb * W) + 1, sizeof(real));                                              \
        if (!part) { free(zero); return 1; }                                                                    \
    }                                                                                                           \
    _Pragma("omp parallel num_threads(nthreads)")                                                               \
    {                                                                                                           \
        /* ga of outputs t in [i0 - K + 1, i0 + CONV_BLOCK): row t at buf + (t - i0 + K - 1) * D */             \
        real *buf = act ? (real *)malloc(sizeof(real) * (size_t)((CONV_BLOCK + K - 1) * D + 1)) : NULL;          \
        if (act && !buf) {                                                                                      \
            ATOMIC_WRITE failed = 1;                                                                            \
        }                                                                                                       \
        _Pragma("omp for schedule(static)")                                                                     \
        for (int64_t blk = 0; blk < nb; ++blk) {                                                                \
            if (act && !buf) continue;                                                                          \
            const int64_t b = blk / nbs, i0 = (blk % nbs) * CONV_BLOCK;                                         \
            const int64_t i1 = i0 + CONV_BLOCK < TP ? i0 + CONV_BLOCK : TP;                                     \
            const int64_t tlo = i0 - K + 1 > 0 ? i0 - K + 1 : 0, thi = i1 < T ? i1 : T;                         \
            const real *gb = gy + b * T * D;                                                                    \
            if (act) { /* pre from the forward, or recomputed from the rows this block reads anyway */          \
                for (int64_t t = tlo; t < thi; ++t) {                                                           \
                    const real *restrict gr = gb + t * D;                                                       \
                    real *restrict o = buf + (t - i0 + K - 1) * D;                                              \
                    if (pre) {                                                                                  \
                        const real *restrict pr = pre + (b * T + t) * D;                                        \
                        _Pragma("omp simd")                                                                     \
                        for (int64_t d = 0; d < D; ++d) o[d] = pr[d];                                           \
                    } else {                                                                                    \
                        const real *restrict x0 = CONV_ROW(b, t);                                               \
                        _Pragma("omp simd")                                                                     \
                        for (int64_t d = 0; d < D; ++d) o[d] = x0[d] * w[d];                                    \
                        for (int64_t j = 1; j < K; ++j) {                                                       \
                            const real *restrict xj = CONV_ROW(b, t + j), *restrict wj = w + j * D;             \
                            _Pragma("omp simd")                                                                 \
                            for (int64_t d = 0; d < D; ++d) o[d] += xj[d] * wj[d];                              \
                        }                                                                                       \
                        if (bias)                                                                               \
                            for (int64_t d = 0; d < D; ++d) o[d] += bias[d];                                    \
                    }                                                                                           \
                    _Pragma("omp simd")                                                                         \
                    for (int64_t d = 0; d < D; ++d) {                                                           \
                        real a = o[d], s = (real)1 / ((real)1 + EXP(-a));                                       \
                        o[d] = gr[d] * (s * ((real)1 + a * ((real)1 - s)));                                     \
                    }                                                                                           \
                }                                                                                               \
            }                                                                                                   \
            real *pw = want_w ? part + blk * W : NULL;                                                          \
            for (int64_t i = i0; i < i1; ++i) {                                                                 \
                real *o = i < K - 1 ? (dpast ? dpast + b * ps + i * D : NULL)                                   \
                                    : (dx ? dx + b * xs + (i - (K - 1)) * D : NULL);                            \
                const real *restrict xr = CONV_ROW(b, i);                                                       \
                if (o) memset(o, 0, sizeof(real) * (size_t)D);                                                  \
                for (int64_t j = 0; j < K; ++j) {                                                               \
                    const int64_t t = i - j;                                                                    \
                    if (t < 0 || t >= T) continue;                                                              \
                    const real *restrict g = act ? buf + (t - i0 + K - 1) * D : gb + t * D;                     \
                    const real *restrict wj = w + j * D;                                                        \
                    if (o) {                                                                                    \
                        _Pragma("omp simd")                                                                     \
                        for (int64_t d = 0; d < D; ++d) o[d] += g[d] * wj[d];                                   \
                    }                                                                                           \
                    if (pw) {                                                                                   \
                        real *restrict p = pw + j * D;                                                          \
                        _Pragma("omp simd")                                                                     \
                        for (int64_t d = 0; d < D; ++d) p[d] += g[d] * xr[d];                                   \
                    }                                                                                           \
                }                                                                                               \
                if (pw && i < T) { /* db: each output once, in the block that holds its index */               \
                    const real *restrict g = act ? buf + (i - i0 + K - 1) * D : gb + i * D;                     \
                    real *restrict p = pw + K * D;                                                              \
                    _Pragma("omp simd")                                                                         \
                    for (int64_t d = 0; d < D; ++d) p[d] += g[d];                                               \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
        free(buf);                                                                                              \
    }                                                                                                           \
    if (want_w && !failed) {                                                                                    \
        for (int64_t e = 0; e < W; ++e) {                                                                       \
            real s = 0;                                                                                         \
            for (int64_t blk = 0; blk < nb; ++blk) s += part[blk * W + e];                                      \
            if (e < K * D) { if (dw) dw[e] = s; }                                                               \
            else if (db) db[e - K * D] = s;                                                                     \
        }                                                                                                       \
    }                                                                                                           \
    free(part);                                                                                                 \
    free(zero);                                                                                                 \
    return failed;                                                                                              \
}                                                                                                               \
                                                                                                                \
/* The padded input xp [B, T + K - 1, D] (the look-back, then x). */                                            \
int linattn_conv_fwd_##SFX(int64_t B, int64_t T, int64_t D, int64_t K, const real *xp, const real *w,          \
                           const real *bias, int act, real *y, real *pre, int nthreads) {                       \
    const int64_t TP = T + K - 1;                                                                               \
    return conv_fwd_##SFX(B, T, D, K, xp + (K - 1) * D, TP * D, xp, TP * D, w, bias, act, y, pre, nthreads);    \
}                                                                                                               \
                                                                                                                \
int linattn_conv_bwd_##SFX(int64_t B, int64_t T, int64_t D, int64_t K, const real *xp, const real *w,          \
                           const real *pre, const real *gy, real *dxp, real *dw, real *db, int nthreads) {      \
    const int64_t TP = T + K - 1;                                                                               \
    return conv_bwd_##SFX(B, T, D, K, xp + (K - 1) * D, TP * D, xp, TP * D, w, NULL, pre != NULL, pre, gy,      \
                          dxp ? dxp + (K - 1) * D : NULL, dxp, dw, db, nthreads);                               \
}                                                                                                               \
                                                                                                                \
/* x [B, T, D] and its look-back past [B, K - 1, D] (NULL: zeros) apart. pre may be NULL with act: the backward \
   then recomputes it (from the rows it reads anyway), which saves the forward a [B, T, D] write. */             \
int linattn_conv_fwd_sep_##SFX(int64_t B, int64_t T, int64_t D, int64_t K, const real *x, const real *past,    \
                               const real *w, const real *bias, int act, real *y, real *pre, int nthreads) {    \
    return conv_fwd_##SFX(B, T, D, K, x, T * D, past, (K - 1) * D, w, bias, act, y, pre, nthreads);             \
}                                                                                                               \
                                                                                                                \
int linattn_conv_bwd_sep_##SFX(int64_t B, int64_t T, int64_t D, int64_t K, const real *x, const real *past,    \
                               const real *w, const real *bias, int act, const real *gy, real *dx,              \
                               real *dpast, real *dw, real *db, int nthreads) {                                 \
    return conv_bwd_##SFX(B, T, D, K, x, T * D, past, (K - 1) * D, w, bias, act, NULL, gy, dx, dpast, dw, db,   \
                          nthreads);                                                                            \
}

#ifdef _OPENMP
#define ATOMIC_WRITE _Pragma("omp atomic write")
#else
#define ATOMIC_WRITE
#endif

DEFINE_CONV(f32, float, lin_expf) /* vectorisable exp (vexp.h): libm's expf is a call per element */
DEFINE_CONV(f64, double, exp)

/* the interface version the Python bindings check after loading (cpu/build.py LIBRARIES) */
int linattn_conv_abi_version(void) { return 1; }
