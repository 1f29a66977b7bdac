/* The layers' output norm with its gate (GatedRMSNorm's default form, layers/common.py), forward and backward
   in one pass each (issue 34.5: in torch it was ~8 full passes forward and ~14 backward over [B, T, HV, Dv]).

     r = 1 / sqrt(mean_d x_d^2 + eps),   n = x r,   y = n w silu(gate)          (w and gate optional)

   Backward, with s = silu(gate) and dn = dy w s:
     dx = r (dn - n mean_d(dn n)),  dgate = dy n w silu'(gate),  dw = sum_rows dy n s.
   dw is summed in fixed blocks of rows, then the blocks in order: the same bits for every thread count.
   float and double from one body; the float SiLU takes its exp from vexp.h (vectorisable). No -ffast-math:
   inf/NaN propagate as in torch (a row with a NaN gives a NaN row). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "vexp.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=fast")
#elif defined(__clang__)
#pragma clang fp contract(fast)
#endif

#define GN_BLOCK 64 /* rows per partial sum of dw */

#define DEFINE_GNORM(SFX, real, EXP)                                                                            \
/* x, gate (NULL: none) [R, D]; w [D] (NULL: none); -> y [R, D], rstd [R]. */                                   \
int linattn_gnorm_fwd_##SFX(int64_t R, int64_t D, const real *x, const real *gate, const real *w, double eps,   \
                            real *y, real *rstd, int nthreads) {                                                \
    const real e = (real)eps;                                                                                   \
    _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                                          \
    for (int64_t i = 0; i < R; ++i) {                                                                           \
        const real *restrict xr = x + i * D;                                                                    \
        real *restrict yr = y + i * D;                                                                          \
        real ss = 0;                                                                                            \
        _Pragma("omp simd reduction(+:ss)")                                                                     \
        for (int64_t d = 0; d < D; ++d) ss += xr[d] * xr[d];                                                    \
        const real r = (real)1 / (real)sqrt((double)(ss / (real)D + e));                                        \
        rstd[i] = r;                                                                                            \
        if (gate) {                                                                                             \
            const real *restrict gr = gate + i * D;                                                             \
            _Pragma("omp simd")                                                                                 \
            for (int64_t d = 0; d < D; ++d) {                                                                   \
                real t = xr[d] * r;                                                                             \
                if (w) t = t * w[d];                                                                            \
                const real g = gr[d];                                                                           \
                yr[d] = t * (g / ((real)1 + EXP(-g)));                                                          \
            }                                                                                                   \
        } else {                                                                                                \
            _Pragma("omp simd")                                                                                 \
            for (int64_t d = 0; d < D; ++d) yr[d] = w ? (xr[d] * r) * w[d] : xr[d] * r;                         \
        }                                                                                                       \
    }                                                                                                           \
    return 0;                                                                                                   \
}                                                                                                               \
                                                                                                                \
/* dy [R, D] -> dx [R, D], dgate [R, D] (with a gate), dw [D] (with w; NULL: not wanted). */                    \
int linattn_gnorm_bwd_##SFX(int64_t R, int64_t D, const real *x, const real *gate, const real *w,               \
                            const real *rstd, const real *dy, real *dx, real *dgate, real *dw, int nthreads) {  \
    const int64_t nb = (R + GN_BLOCK - 1) / GN_BLOCK;                                                           \
    real *part = NULL;                                                                                          \
    if (dw) {                                                                                                   \
        part = (real *)malloc(sizeof(real) * (size_t)(nb * D + 1));                                             \
        if (!part) return 1;                                                                                    \
    }                                                                                                           \
    _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                                          \
    for (int64_t blk = 0; blk < nb; ++blk) {                                                                    \
        real *restrict pw = part ? part + blk * D : NULL;                                                       \
        if (pw)                                                                                                 \
            for (int64_t d = 0; d < D; ++d) pw[d] = 0;                                                          \
        const int64_t hi = (blk + 1) * GN_BLOCK < R ? (blk + 1) * GN_BLOCK : R;                                 \
        for (int64_t i = blk * GN_BLOCK; i < hi; ++i) {                                                         \
            const real *restrict xr = x + i * D, *restrict gyr = dy + i * D;                                    \
            const real *restrict gr = gate ? gate + i * D : NULL;                                               \
            real *restrict dxr = dx + i * D;                                                                    \
            const real r = rstd[i];                                                                             \
            real c = 0;                                                                                         \
            /* dx holds dn first; dgate and dw's part are written on the way */                                 \
            if (gr) {                                                                                           \
                real *restrict dgr = dgate + i * D;                                                             \
                _Pragma("omp simd reduction(+:c)")                                                              \
                for (int64_t d = 0; d < D; ++d) {                                                               \
                    const real g = gr[d], sg = (real)1 / ((real)1 + EXP(-g)), s = g * sg;                       \
                    const real n = xr[d] * r, wd = w ? w[d] : (real)1, gy = gyr[d];                             \
                    const real dn = gy * wd * s;                                                                \
                    dgr[d] = gy * n * wd * (sg * ((real)1 + g * ((real)1 - sg)));                               \
                    if (pw) pw[d] += gy * n * s;                                                                \
                    dxr[d] = dn;                                                                                \
                    c += dn * n;                                                                                \
                }                                                                                               \
            } else {                                                                                            \
                _Pragma("omp simd reduction(+:c)")                                                              \
                for (int64_t d = 0; d < D; ++d) {                                                               \
                    const real n = xr[d] * r, gy = gyr[d];                                                      \
                    const real dn = w ? gy * w[d] : gy;                                                         \
                    if (pw) pw[d] += gy * n;                                                                    \
                    dxr[d] = dn;                                                                                \
                    c += dn * n;                                                                                \
                }                                                                                               \
            }                                                                                                   \
            c = c / (real)D;                                                                                    \
            _Pragma("omp simd")                                                                                 \
            for (int64_t d = 0; d < D; ++d) dxr[d] = r * (dxr[d] - (xr[d] * r) * c);                            \
        }                                                                                                       \
    }                                                                                                           \
    if (dw) {                                                                                                   \
        for (int64_t d = 0; d < D; ++d) dw[d] = 0;                                                              \
        for (int64_t blk = 0; blk < nb; ++blk)                                                                  \
            for (int64_t d = 0; d < D; ++d) dw[d] += part[blk * D + d];                                         \
        free(part);                                                                                             \
    }                                                                                                           \
    return 0;                                                                                                   \
}

DEFINE_GNORM(f32, float, lin_expf) /* vectorisable exp (vexp.h): libm's expf is a call per element */
DEFINE_GNORM(f64, double, exp)

/* the interface version the Python bindings check after loading (cpu/build.py LIBRARIES) */
int linattn_gatednorm_abi_version(void) { return 1; }
