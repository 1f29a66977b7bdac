/* The short causal depthwise convolution of the layers (ShortConv, T > 1 on the CPU), forward and backward,
   with the optional SiLU fused (issue 34.5: in torch it was ~20% of a Gated DeltaNet LM training step, as
   depthwise conv1d or as K shifted multiply-adds, each a full pass over [B, T, D]).

     pre[b, t, d] = bias[d] + sum_j w[j, d] xp[b, t + j, d]      xp [B, T + K - 1, D] (look-back, then x)
     y = silu(pre) (act) or pre

   Forward: one pass (pre kept for the SiLU's backward). Backward: ga = gy * silu'(pre) into a buffer, then
   dxp by gathering (each output row owned by one thread: no races) and dw, db as per-thread partial sums.
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
            for (int64_t d = 0; d < D; ++d) { real a = yr[d]; pr[d] = a; yr[d] = a / ((real)1 + EXP(-a)); }     \
        }                                                                                                       \
    }                                                                                                           \
    free(zero);                                                                                                 \
    return 0;                                                                                                   \
}                                                                                                               \
                                                                                                                \
/* gy [B, T, D]; pre (act) [B, T, D]; outputs dx (stride xs), dpast (stride ps; NULL: not wanted), dw [K, D],   \
   db [D] (NULL: not wanted). */                                                                                \
static int conv_bwd_##SFX(int64_t B, int64_t T, int64_t D, int64_t K, const real *x, int64_t xs,               \
                          const real *past, int64_t ps, const real *w, const real *pre, const real *gy,         \
                          real *dx, real *dpast, real *dw, real *db, int nthreads) {                            \
    const int64_t TP = T + K - 1;                                                                               \
    real *ga = (real *)gy, *zero = NULL;                                                                        \
    if (!past && K > 1) {                                                                                       \
        zero = (real *)calloc((size_t)D + 1, sizeof(real));                                                     \
        if (!zero) return 1;                                                                                    \
    }                                                                                                           \
    if (pre) {                                                                                                  \
        ga = (real *)malloc(sizeof(real) * (size_t)(B * T * D + 1));                                            \
        if (!ga) { free(zero); return 1; }                                                                      \
        _Pragma("omp parallel for simd num_threads(nthreads) schedule(static)")                                 \
        for (int64_t i = 0; i < B * T * D; ++i) {                                                               \
            real a = pre[i], s = (real)1 / ((real)1 + EXP(-a));                                                 \
            ga[i] = gy[i] * (s * ((real)1 + a * ((real)1 - s)));                                                \
        }                                                                                                       \
    }                                                                                                           \
    if (dx || dpast) {                                                                                          \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                                      \
        for (int64_t r = 0; r < B * TP; ++r) {                                                                  \
            const int64_t b = r / TP, i = r % TP;                                                               \
            real *o = i < K - 1 ? (dpast ? dpast + b * ps + i * D : NULL) : (dx ? dx + b * xs + (i - (K - 1)) * D \
                                                                              : NULL);                          \
            if (!o) continue;                                                                                   \
            memset(o, 0, sizeof(real) * (size_t)D);                                                             \
            for (int64_t j = 0; j < K; ++j) {                                                                   \
                const int64_t t = i - j;                                                                        \
                if (t < 0 || t >= T) continue;                                                                  \
                const real *restrict g = ga + (b * T + t) * D, *restrict wj = w + j * D;                        \
                _Pragma("omp simd")                                                                             \
                for (int64_t d = 0; d < D; ++d) o[d] += g[d] * wj[d];                                           \
            }                                                                                                   \
        }                                                                                                       \
    }                                                                                                           \
    if (dw || db) {                                                                                             \
        int nt = nthreads > 0 ? nthreads : 1;                                                                   \
        real *part = (real *)calloc((size_t)nt * (size_t)((K + 1) * D), sizeof(real));                          \
        if (!part) { if (ga != gy) free(ga); free(zero); return 1; }                                            \
        _Pragma("omp parallel num_threads(nt)")                                                                 \
        {                                                                                                       \
            int tid = 0, n = 1;                                                                                 \
            IF_OMP(tid = omp_get_thread_num(); n = omp_get_num_threads();)                                      \
            real *pw = part + (int64_t)tid * (K + 1) * D, *pb = pw + K * D;                                     \
            for (int64_t r = tid; r < B * T; r += n) {                                                          \
                const int64_t b = r / T, t = r % T;                                                             \
                const real *restrict g = ga + r * D;                                                            \
                for (int64_t j = 0; j < K; ++j) {                                                               \
                    const real *restrict xr = CONV_ROW(b, t + j);                                               \
                    real *restrict p = pw + j * D;                                                              \
                    _Pragma("omp simd")                                                                         \
                    for (int64_t d = 0; d < D; ++d) p[d] += g[d] * xr[d];                                       \
                }                                                                                               \
                _Pragma("omp simd")                                                                             \
                for (int64_t d = 0; d < D; ++d) pb[d] += g[d];                                                  \
            }                                                                                                   \
        }                                                                                                       \
        for (int64_t e = 0; e < (K + 1) * D; ++e) {                                                             \
            real s = 0;                                                                                         \
            for (int i = 0; i < nt; ++i) s += part[(int64_t)i * (K + 1) * D + e];                               \
            if (e < K * D) { if (dw) dw[e] = s; }                                                               \
            else if (db) db[e - K * D] = s;                                                                     \
        }                                                                                                       \
        free(part);                                                                                             \
    }                                                                                                           \
    if (ga != gy) free(ga);                                                                                     \
    free(zero);                                                                                                 \
    return 0;                                                                                                   \
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
    return conv_bwd_##SFX(B, T, D, K, xp + (K - 1) * D, TP * D, xp, TP * D, w, pre, gy,                         \
                          dxp ? dxp + (K - 1) * D : NULL, dxp, dw, db, nthreads);                               \
}                                                                                                               \
                                                                                                                \
/* x [B, T, D] and its look-back past [B, K - 1, D] (NULL: zeros) apart. */                                     \
int linattn_conv_fwd_sep_##SFX(int64_t B, int64_t T, int64_t D, int64_t K, const real *x, const real *past,    \
                               const real *w, const real *bias, int act, real *y, real *pre, int nthreads) {    \
    return conv_fwd_##SFX(B, T, D, K, x, T * D, past, (K - 1) * D, w, bias, act, y, pre, nthreads);             \
}                                                                                                               \
                                                                                                                \
int linattn_conv_bwd_sep_##SFX(int64_t B, int64_t T, int64_t D, int64_t K, const real *x, const real *past,    \
                               const real *w, const real *pre, const real *gy, real *dx, real *dpast, real *dw, \
                               real *db, int nthreads) {                                                        \
    return conv_bwd_##SFX(B, T, D, K, x, T * D, past, (K - 1) * D, w, pre, gy, dx, dpast, dw, db, nthreads);   \
}

#ifdef _OPENMP
#define IF_OMP(...) __VA_ARGS__
#else
#define IF_OMP(...)
#endif

DEFINE_CONV(f32, float, lin_expf) /* vectorisable exp (vexp.h): libm's expf is a call per element */
DEFINE_CONV(f64, double, exp)
