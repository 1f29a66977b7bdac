/* The delta rule's preparation of one row (token and head), prepare_delta's, shared by deltaprep.c's passes and
   delta.c's scan, which prepares each row itself as it reads it when no gradient is needed (the plan's `prep`):
   one body, so that both give the same bits. deltaprep.c has the formulas. Included inside a body once per REAL,
   after common.h's per-REAL part (la_l2_row); with LA_DELTAROW_OUTLINED also the calls that are never inlined
   (delta.c: see there why). */

/* |x|^2 of a row x [K] in double: for float rows the float sum, widened, or where it is not finite the double sum
   (as key_norms); *wide tells which */
static inline double FN(lam_row)(const REAL *restrict x, int64_t K, int *wide) {
    REAL ss = 0;
#pragma omp simd reduction(+:ss)
    for (int64_t j = 0; j < K; ++j) ss += x[j] * x[j];
    *wide = !isfinite(ss);
    if (!*wide) return (double)ss;
    double sd = 0;
    for (int64_t j = 0; j < K; ++j) sd += (double)x[j] * (double)x[j];
    return sd;
}

/* qk_l2norm="rsqrt", a = beta: q, k [K], v [V] -> qo = scale l2(q), ko = l2(k) / d, vo = v / d [K, K, V]; returns
   d2 = max(|l2(k)|^2, 1) (NaN stays NaN), d = sqrt(d2) */
static inline double FN(la_dprep_row)(int64_t K, int64_t V, const REAL *restrict qr, const REAL *restrict kr,
                                      const REAL *restrict vr, REAL sc, REAL e, REAL *restrict qor,
                                      REAL *restrict kor, REAL *restrict vor) {
    REAL r, s;
    FN(la_l2_row)(qr, K, e, &r, &s);
    if (s == (REAL)1) {
#pragma omp simd
        for (int64_t j = 0; j < K; ++j) qor[j] = (qr[j] * r) * sc;
    } else {
        for (int64_t j = 0; j < K; ++j) qor[j] = ((qr[j] / s) * r) * sc;
    }
    FN(la_l2_row)(kr, K, e, &r, &s);
    REAL lam = 0;
    if (s == (REAL)1) {
#pragma omp simd reduction(+:lam)
        for (int64_t j = 0; j < K; ++j) { const REAL y = kr[j] * r; kor[j] = y; lam += y * y; }
    } else {
        for (int64_t j = 0; j < K; ++j) { const REAL y = (kr[j] / s) * r; kor[j] = y; lam += y * y; }
    }
    const double l = (double)lam, d2 = (l < 1.0 || l != l) ? (l != l ? l : 1.0) : l;
    const REAL d = (REAL)sqrt(d2);
    if (d != (REAL)1) {
        for (int64_t j = 0; j < K; ++j) kor[j] = kor[j] / d;
        for (int64_t j = 0; j < V; ++j) vor[j] = vr[j] / d;
    } else {
#pragma omp simd
        for (int64_t j = 0; j < V; ++j) vor[j] = vr[j];
    }
    return d2;
}

/* without the normalisation: q, k [K], v [V] -> qo = scale q, ko = k / d, vo = v / d; returns lam = |k|^2
   (lam_row) and *d2 = max(lam, 1) (NaN stays NaN), d = sqrt(d2) */
static inline double FN(la_dprep_raw_row)(int64_t K, int64_t V, const REAL *restrict qr, const REAL *restrict kr,
                                          const REAL *restrict vr, REAL sc, REAL *restrict qor, REAL *restrict kor,
                                          REAL *restrict vor, double *d2out) {
#pragma omp simd
    for (int64_t j = 0; j < K; ++j) qor[j] = qr[j] * sc;
    int wide;
    const double l = FN(lam_row)(kr, K, &wide), d2 = (l < 1.0 || l != l) ? (l != l ? l : 1.0) : l;
    const REAL d = (REAL)sqrt(d2);
    if (d != (REAL)1) {
        for (int64_t j = 0; j < K; ++j) kor[j] = kr[j] / d;
        for (int64_t j = 0; j < V; ++j) vor[j] = vr[j] / d;
    } else {
#pragma omp simd
        for (int64_t j = 0; j < K; ++j) kor[j] = kr[j];
#pragma omp simd
        for (int64_t j = 0; j < V; ++j) vor[j] = vr[j];
    }
    *d2out = d2;
    return l;
}

#if defined(LA_DELTAROW_OUTLINED)
/* the two rows with their write strength a = beta d2 (the product in double, rounded once), as calls of their own:
   compiled with the options of the file's top, where the caller includes this (see delta.c) */
static __attribute__((noinline)) REAL FN(la_dprep_row_a)(int64_t K, int64_t V, const REAL *qr, const REAL *kr,
                                                          const REAL *vr, REAL beta, REAL sc, REAL e, REAL *qor,
                                                          REAL *kor, REAL *vor) {
    return (REAL)((double)beta * FN(la_dprep_row)(K, V, qr, kr, vr, sc, e, qor, kor, vor));
}

static __attribute__((noinline)) REAL FN(la_dprep_raw_row_a)(int64_t K, int64_t V, const REAL *qr, const REAL *kr,
                                                              const REAL *vr, REAL beta, REAL sc, REAL *qor,
                                                              REAL *kor, REAL *vor) {
    double d2;
    FN(la_dprep_raw_row)(K, V, qr, kr, vr, sc, qor, kor, vor, &d2);
    return (REAL)((double)beta * d2);
}
#endif
