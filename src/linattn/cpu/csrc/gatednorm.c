/* The layers' output norm with its gate (GatedRMSNorm's default form, layers/common.py), forward and backward
   in one pass each (in torch it was ~8 full passes forward and ~14 backward over [B, T, HV, Dv]).

     r = 1 / sqrt(mean_d x_d^2 + eps),   n = x r,   y = n w silu(gate)          (w and gate optional)

   Backward, with s = silu(gate) and dn = dy w s:
     dx = r (dn - n mean_d(dn n)),  dgate = dy n w silu'(gate),  dw = sum_rows dy n s.
   dw is summed in fixed blocks of rows, then the blocks in order: the same bits for every thread count.
   float and double from one body (this file includes itself once per REAL); the SiLU takes its exp from
   common.h (vectorisable). No -ffast-math: inf/NaN propagate as in torch (a row with a NaN gives a NaN
   row). */
#ifndef LINATTN_GATEDNORM_BODY
#define LINATTN_GATEDNORM_BODY

#include "common.h"

LA_ABI_VERSION(gatednorm, 1)

#define GN_BLOCK 64 /* rows per partial sum of dw */

#define REAL float
#define FN(name) name##_f32
#include "gatednorm.c"
#undef REAL
#undef FN

#define REAL double
#define FN(name) name##_f64
#include "gatednorm.c"
#undef REAL
#undef FN

#else /* ------------------------------------------------------------------ the body, once per REAL */
#include "common.h" /* its per-REAL part: la_exp, la_silu, la_l2_row, la_rms_rstd */

/* x, gate (NULL: none) [R, D]; w [D] (NULL: none); -> y [R, D], rstd [R]. */
int FN(linattn_gnorm_fwd)(int64_t R, int64_t D, const REAL *x, const REAL *gate, const REAL *w, double eps,
                          REAL *y, REAL *rstd, int nthreads) {
    const REAL e = (REAL)eps;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < R; ++i) {
        const REAL *restrict xr = x + i * D;
        REAL *restrict yr = y + i * D;
        const REAL r = FN(la_rms_rstd)(xr, D, e);
        rstd[i] = r;
        if (gate) {
            const REAL *restrict gr = gate + i * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) {
                REAL t = xr[d] * r;
                if (w) t = t * w[d];
                const REAL g = gr[d];
                yr[d] = t * FN(la_silu)(g);
            }
        } else {
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) yr[d] = w ? (xr[d] * r) * w[d] : xr[d] * r;
        }
    }
    return 0;
}

/* dy [R, D] -> dx [R, D], dgate [R, D] (with a gate), dw [D] (with w; NULL: not wanted). */
int FN(linattn_gnorm_bwd)(int64_t R, int64_t D, const REAL *x, const REAL *gate, const REAL *w,
                          const REAL *rstd, const REAL *dy, REAL *dx, REAL *dgate, REAL *dw, int nthreads) {
    const int64_t nb = (R + GN_BLOCK - 1) / GN_BLOCK;
    REAL *part = NULL;
    if (dw) {
        part = (REAL *)malloc(sizeof(REAL) * (size_t)(nb * D + 1));
        if (!part) return 1;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t blk = 0; blk < nb; ++blk) {
        REAL *restrict pw = part ? part + blk * D : NULL;
        if (pw)
            for (int64_t d = 0; d < D; ++d) pw[d] = 0;
        const int64_t hi = (blk + 1) * GN_BLOCK < R ? (blk + 1) * GN_BLOCK : R;
        for (int64_t i = blk * GN_BLOCK; i < hi; ++i) {
            const REAL *restrict xr = x + i * D, *restrict gyr = dy + i * D;
            const REAL *restrict gr = gate ? gate + i * D : NULL;
            REAL *restrict dxr = dx + i * D;
            const REAL r = rstd[i];
            REAL c = 0;
            /* dx holds dn first; dgate and dw's part are written on the way */
            if (gr) {
                REAL *restrict dgr = dgate + i * D;
#pragma omp simd reduction(+:c)
                for (int64_t d = 0; d < D; ++d) {
                    const REAL g = gr[d], sg = FN(la_sigmoid)(g), s = g * sg;
                    const REAL n = xr[d] * r, wd = w ? w[d] : (REAL)1, gy = gyr[d];
                    const REAL dn = gy * wd * s;
                    dgr[d] = gy * n * wd * (sg * ((REAL)1 + g * ((REAL)1 - sg)));
                    if (pw) pw[d] += gy * n * s;
                    dxr[d] = dn;
                    c += dn * n;
                }
            } else {
#pragma omp simd reduction(+:c)
                for (int64_t d = 0; d < D; ++d) {
                    const REAL n = xr[d] * r, gy = gyr[d];
                    const REAL dn = w ? gy * w[d] : gy;
                    if (pw) pw[d] += gy * n;
                    dxr[d] = dn;
                    c += dn * n;
                }
            }
            c = c / (REAL)D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) dxr[d] = r * (dxr[d] - (xr[d] * r) * c);
        }
    }
    if (dw) {
        for (int64_t d = 0; d < D; ++d) dw[d] = 0;
        for (int64_t blk = 0; blk < nb; ++blk)
            for (int64_t d = 0; d < D; ++d) dw[d] += part[blk * D + d];
        free(part);
    }
    return 0;
}

#endif
