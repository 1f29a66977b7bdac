/* The delta rule's preprocessing (ops/delta_core.py: prepare_delta with qk_l2norm="rsqrt", a = beta) in one
   pass over the rows, forward and backward (in torch it was ~10 full passes forward and ~15 backward
   over [B, T, H, K], more than the compiled scan itself). Per row (token and head):

     q~ = scale l2(q),  k^ = l2(k),  d2 = max(|k^|^2, 1),  d = sqrt(d2),  k~ = k^ / d,  v~ = v / d,  a = beta d2

   l2(x) = x / sqrt(sum x^2 + eps), and for a row whose sum of squares is not finite (overflow, or inf / NaN)
   the form of ops/l2norm.py: y = x / s with s = max(max |x|, 1) (NaN if the row has a NaN), then
   y / sqrt(sum y^2 + eps / s^2), s held constant in the backward. d2 and d are held constant in the backward
   (detached in prepare_delta). |k^|^2 and d2 are double for float keys, as prepare_delta's key_norms, so d2,
   d and a round as there. Backward, with r = 1 / sqrt(sum y^2 + e) and the incoming gradient G of l2(x):
   dx = (r G - y r^3 (y . G)) / s. float and double from one body (this file includes itself once per REAL;
   the L2 row is common.h's, a forward row deltarow.h's, which delta.c's scan shares); no -ffast-math. */
#ifndef LINATTN_DELTAPREP_BODY
#define LINATTN_DELTAPREP_BODY

#include "common.h"

LA_ABI_VERSION(deltaprep, 1)

/* rows per claim: the threads claim blocks of rows as they go (a thread that the system deschedules holds back
   one block, not a static half of the call); every row's arithmetic is its own, so any split gives the same bits */
#define LA_PREP_ROWS 1024

#define REAL float
#define FN(name) name##_f32
#include "deltaprep.c"
#undef REAL
#undef FN

#define REAL double
#define FN(name) name##_f64
#include "deltaprep.c"
#undef REAL
#undef FN

#else /* ------------------------------------------------------------------ the body, once per REAL */
#include "common.h" /* its per-REAL part: la_exp, la_silu, la_l2_row, la_rms_rstd */
#include "deltarow.h" /* the forward's rows, shared with delta.c's scan */

/* q, k [R, K], v [R, V], beta [R] -> qo, ko [R, K], vo [R, V], a [R]. */
int FN(linattn_dprep_fwd)(int64_t R, int64_t K, int64_t V, const REAL *q, const REAL *k, const REAL *v,
                          const REAL *beta, double scale, double eps, REAL *qo, REAL *ko, REAL *vo, REAL *a,
                          int nthreads) {
    const REAL sc = (REAL)scale, e = (REAL)eps;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, LA_PREP_ROWS)
    for (int64_t i = 0; i < R; ++i)
        a[i] = (REAL)((double)beta[i] * FN(la_dprep_row)(K, V, q + i * K, k + i * K, v + i * V, sc, e, qo + i * K,
                                                         ko + i * K, vo + i * V));
    return 0;
}

/* gradients of qo, ko, vo, a (any may be NULL: zero) -> dq, dk [R, K], dv [R, V], dbeta [R] */
int FN(linattn_dprep_bwd)(int64_t R, int64_t K, int64_t V, const REAL *q, const REAL *k, double scale,
                          double eps, const REAL *dqo, const REAL *dko, const REAL *dvo, const REAL *da,
                          REAL *dq, REAL *dk, REAL *dv, REAL *dbeta, int nthreads) {
    const REAL sc = (REAL)scale, e = (REAL)eps;
#pragma omp parallel num_threads(nthreads)
    {
        REAL G[K > 0 ? K : 1];
#pragma omp for schedule(dynamic, LA_PREP_ROWS)
        for (int64_t i = 0; i < R; ++i)
            FN(la_dprep_bwd_row)(K, V, q + i * K, k + i * K, sc, e, dqo ? dqo + i * K : NULL, dko ? dko + i * K : NULL,
                                 dvo ? dvo + i * V : NULL, da ? da + i : NULL, dq + i * K, dk + i * K, dv + i * V,
                                 dbeta + i, G);
    }
    return 0;
}

/* Without the normalisation (qk_l2norm=False: EFLA, whose coefficient reads lam): q~ = scale q,
   lam = |k|^2 (double; for float keys the float sum, widened, or where it is not finite the double sum, as
   key_norms), d = sqrt(max(lam, 1)), k~ = k / d, v~ = v / d -> qo, ko [R, K], vo [R, V], lam [R] (the row:
   deltarow.h's la_dprep_raw_row). The raw pass, and lam or a = beta max(lam, 1) (prepare_delta's write_strength:
   the product in double, rounded once to REAL) from it: each of lam, beta / a may be NULL. */
static int FN(raw_fwd)(int64_t R, int64_t K, int64_t V, const REAL *q, const REAL *k, const REAL *v,
                       double scale, REAL *qo, REAL *ko, REAL *vo, double *lam, const REAL *beta, REAL *a,
                       int nthreads) {
    const REAL sc = (REAL)scale;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, LA_PREP_ROWS)
    for (int64_t i = 0; i < R; ++i) {
        double d2;
        const double l = FN(la_dprep_raw_row)(K, V, q + i * K, k + i * K, v + i * V, sc, qo + i * K, ko + i * K,
                                              vo + i * V, &d2);
        if (lam) lam[i] = l;
        if (a) a[i] = (REAL)((double)beta[i] * d2);
    }
    return 0;
}

int FN(linattn_dprep_raw_fwd)(int64_t R, int64_t K, int64_t V, const REAL *q, const REAL *k, const REAL *v,
                              double scale, REAL *qo, REAL *ko, REAL *vo, double *lam, int nthreads) {
    return FN(raw_fwd)(R, K, V, q, k, v, scale, qo, ko, vo, lam, NULL, NULL, nthreads);
}

/* The raw pass with the write strength a [R] = beta max(lam, 1) in place of lam (Gated DeltaNet without qk_l2norm:
   no torch operators on [R] between this pass and the scan). */
int FN(linattn_dprep_rawa_fwd)(int64_t R, int64_t K, int64_t V, const REAL *q, const REAL *k, const REAL *v,
                               const REAL *beta, double scale, REAL *qo, REAL *ko, REAL *vo, REAL *a, int nthreads) {
    return FN(raw_fwd)(R, K, V, q, k, v, scale, qo, ko, vo, NULL, beta, a, nthreads);
}

/* gradients of qo, ko, vo (NULL: zero) and lam (double, NULL: zero) -> dq, dk [R, K], dv [R, V]: dk = dko / d
   + 2 k dlam (d held constant); with dbeta, also dbeta = da max(lam, 1) (da NULL: zero; lam held constant). */
static int FN(raw_bwd)(int64_t R, int64_t K, int64_t V, const REAL *k, double scale, const REAL *dqo,
                       const REAL *dko, const REAL *dvo, const double *dlam, const REAL *da, REAL *dq, REAL *dk,
                       REAL *dv, REAL *dbeta, int nthreads) {
    const REAL sc = (REAL)scale;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, LA_PREP_ROWS)
    for (int64_t i = 0; i < R; ++i)
        FN(la_dprep_raw_bwd_row)(K, V, k + i * K, sc, dqo ? dqo + i * K : NULL, dko ? dko + i * K : NULL,
                                 dvo ? dvo + i * V : NULL, dlam ? dlam + i : NULL, da ? da + i : NULL, dq + i * K,
                                 dk + i * K, dv + i * V, dbeta ? dbeta + i : NULL);
    return 0;
}

int FN(linattn_dprep_raw_bwd)(int64_t R, int64_t K, int64_t V, const REAL *k, double scale, const REAL *dqo,
                              const REAL *dko, const REAL *dvo, const double *dlam, REAL *dq, REAL *dk,
                              REAL *dv, int nthreads) {
    return FN(raw_bwd)(R, K, V, k, scale, dqo, dko, dvo, dlam, NULL, dq, dk, dv, NULL, nthreads);
}

/* linattn_dprep_rawa_fwd's backward: dq, dk, dv as linattn_dprep_raw_bwd's without dlam, and dbeta from da. */
int FN(linattn_dprep_rawa_bwd)(int64_t R, int64_t K, int64_t V, const REAL *k, double scale, const REAL *dqo,
                               const REAL *dko, const REAL *dvo, const REAL *da, REAL *dq, REAL *dk, REAL *dv,
                               REAL *dbeta, int nthreads) {
    return FN(raw_bwd)(R, K, V, k, scale, dqo, dko, dvo, NULL, da, dq, dk, dv, dbeta, nthreads);
}

/* l2(x) of rows x [R, K] alone (a layer's own q normalisation, EFLA's): y [R, K]; backward dx from dy. */
int FN(linattn_l2rows_fwd)(int64_t R, int64_t K, const REAL *x, double eps, REAL *y, int nthreads) {
    const REAL e = (REAL)eps;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, LA_PREP_ROWS)
    for (int64_t i = 0; i < R; ++i) {
        const REAL *restrict xr = x + i * K;
        REAL *restrict yr = y + i * K;
        REAL r, s;
        FN(la_l2_row)(xr, K, e, &r, &s);
        if (s == (REAL)1) {
#pragma omp simd
            for (int64_t j = 0; j < K; ++j) yr[j] = xr[j] * r;
        } else {
            for (int64_t j = 0; j < K; ++j) yr[j] = (xr[j] / s) * r;
        }
    }
    return 0;
}

int FN(linattn_l2rows_bwd)(int64_t R, int64_t K, const REAL *x, double eps, const REAL *dy, REAL *dx,
                           int nthreads) {
    const REAL e = (REAL)eps;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, LA_PREP_ROWS)
    for (int64_t i = 0; i < R; ++i) FN(l2_bwd_row)(x + i * K, dy + i * K, K, e, dx + i * K);
    return 0;
}

#endif
