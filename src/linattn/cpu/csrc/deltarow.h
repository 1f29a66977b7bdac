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

/* dx of l2 for one row x [K] given G [K] (overwrites out [K]) */
static inline void FN(l2_bwd_row)(const REAL *restrict x, const REAL *restrict G, int64_t K, REAL eps,
                                  REAL *restrict out) {
    REAL r, s;
    FN(la_l2_row)(x, K, eps, &r, &s);
    REAL c = 0;
    if (s == (REAL)1) {
#pragma omp simd reduction(+:c)
        for (int64_t j = 0; j < K; ++j) c += G[j] * x[j];
        const REAL r3c = r * r * r * c;
#pragma omp simd
        for (int64_t j = 0; j < K; ++j) out[j] = G[j] * r - x[j] * r3c;
    } else {
        for (int64_t j = 0; j < K; ++j) c += G[j] * (x[j] / s);
        const REAL r3c = r * r * r * c;
        for (int64_t j = 0; j < K; ++j) out[j] = (G[j] * r - (x[j] / s) * r3c) / s;
    }
}

/* out [n] = g / d (d != 1), g (d == 1: x / 1 is x, and the copy vectorises) or 0 (g NULL): a prepared row's
   gradient through its division by d */
static inline void FN(la_over_d)(int64_t n, const REAL *restrict g, REAL d, REAL *restrict out) {
    if (!g) {
        for (int64_t j = 0; j < n; ++j) out[j] = 0;
    } else if (d != (REAL)1) {
        for (int64_t j = 0; j < n; ++j) out[j] = g[j] / d;
    } else {
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) out[j] = g[j];
    }
}

/* la_dprep_row's backward (deltaprep.c's linattn_dprep_bwd, row by row; delta.c's backward with PREP_L2): the
   gradients of qo, ko [K], vo [V] and a (each may be NULL: zero) -> dq, dk [K], dv [V], *dbeta of the raw row q, k;
   G [K] scratch. The outputs may not alias the gradients given. */
static inline void FN(la_dprep_bwd_row)(int64_t K, int64_t V, const REAL *restrict qr, const REAL *restrict kr,
                                        REAL sc, REAL e, const REAL *dqo, const REAL *dko, const REAL *dvo,
                                        const REAL *da, REAL *dq, REAL *dk, REAL *dv, REAL *dbeta,
                                        REAL *restrict G) {
    if (dqo) {
        const REAL *restrict g = dqo;
#pragma omp simd
        for (int64_t j = 0; j < K; ++j) G[j] = g[j] * sc;
        FN(l2_bwd_row)(qr, G, K, e, dq);
    } else {
        for (int64_t j = 0; j < K; ++j) dq[j] = 0;
    }
    /* d2 and d of the row, as the forward */
    REAL r, s, lam = 0;
    FN(la_l2_row)(kr, K, e, &r, &s);
    if (s == (REAL)1) {
#pragma omp simd reduction(+:lam)
        for (int64_t j = 0; j < K; ++j) { const REAL y = kr[j] * r; lam += y * y; }
    } else {
        for (int64_t j = 0; j < K; ++j) { const REAL y = (kr[j] / s) * r; lam += y * y; }
    }
    const double l = (double)lam, d2 = (l < 1.0 || l != l) ? (l != l ? l : 1.0) : l;
    const REAL d = (REAL)sqrt(d2);
    if (dko) {
        FN(la_over_d)(K, dko, d, G);
        FN(l2_bwd_row)(kr, G, K, e, dk);
    } else {
        for (int64_t j = 0; j < K; ++j) dk[j] = 0;
    }
    FN(la_over_d)(V, dvo, d, dv);
    *dbeta = da ? (REAL)((double)*da * d2) : (REAL)0;
}

/* la_dprep_raw_row's backward (deltaprep.c's raw passes, row by row; delta.c's backward with PREP_RAW): the
   gradients of qo, ko [K], vo [V] (NULL: zero), lam (double, NULL: zero) and a -> dq, dk [K], dv [V] of the raw
   row k: dk = dko / d + 2 k dlam (d held constant); with dbeta, also *dbeta = da max(lam, 1) (da NULL: zero). The
   outputs may not alias the gradients given. */
static inline void FN(la_dprep_raw_bwd_row)(int64_t K, int64_t V, const REAL *restrict kr, REAL sc, const REAL *dqo,
                                            const REAL *dko, const REAL *dvo, const double *dlam, const REAL *da,
                                            REAL *restrict dqr, REAL *restrict dkr, REAL *restrict dvr,
                                            REAL *dbeta) {
    if (dqo) {
        const REAL *restrict g = dqo;
#pragma omp simd
        for (int64_t j = 0; j < K; ++j) dqr[j] = g[j] * sc;
    } else {
        for (int64_t j = 0; j < K; ++j) dqr[j] = 0;
    }
    int wide;
    const double l = FN(lam_row)(kr, K, &wide), d2 = (l < 1.0 || l != l) ? (l != l ? l : 1.0) : l;
    const REAL d = (REAL)sqrt(d2);
    if (dbeta) *dbeta = (REAL)((da ? (double)*da : 0.0) * d2); /* a zero gradient times d2, as torch's */
    /* the branches outside the loops: a conditional division inside one does not vectorise */
    FN(la_over_d)(K, dko, d, dkr);
    if (dlam) {
        if (!wide) {
            const REAL gl = (REAL)*dlam;
#pragma omp simd
            for (int64_t j = 0; j < K; ++j) dkr[j] += gl * kr[j] + gl * kr[j];
        } else {
            for (int64_t j = 0; j < K; ++j) dkr[j] += (REAL)(2.0 * (double)kr[j] * *dlam);
        }
    }
    FN(la_over_d)(V, dvo, d, dvr);
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

/* the two rows' backward (the write strength's gradient dbeta = da d2 included) as calls of their own, likewise */
static __attribute__((noinline)) void FN(la_dprep_bwd_row_a)(int64_t K, int64_t V, const REAL *qr, const REAL *kr,
                                                             REAL sc, REAL e, const REAL *dqo, const REAL *dko,
                                                             const REAL *dvo, const REAL *da, REAL *dq, REAL *dk,
                                                             REAL *dv, REAL *dbeta, REAL *G) {
    FN(la_dprep_bwd_row)(K, V, qr, kr, sc, e, dqo, dko, dvo, da, dq, dk, dv, dbeta, G);
}

static __attribute__((noinline)) void FN(la_dprep_raw_bwd_row_a)(int64_t K, int64_t V, const REAL *kr, REAL sc,
                                                                 const REAL *dqo, const REAL *dko, const REAL *dvo,
                                                                 const REAL *da, REAL *dq, REAL *dk, REAL *dv,
                                                                 REAL *dbeta) {
    FN(la_dprep_raw_bwd_row)(K, V, kr, sc, dqo, dko, dvo, NULL, da, dq, dk, dv, dbeta);
}
#endif
