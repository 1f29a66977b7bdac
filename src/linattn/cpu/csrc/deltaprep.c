/* The delta rule's preprocessing (ops/delta_core.py: prepare_delta with qk_l2norm="rsqrt", a = beta) in one
   pass over the rows, forward and backward (issue 34.5: in torch it was ~10 full passes forward and ~15 backward
   over [B, T, H, K], more than the compiled scan itself). Per row (token and head):

     q~ = scale l2(q),  k^ = l2(k),  d2 = max(|k^|^2, 1),  d = sqrt(d2),  k~ = k^ / d,  v~ = v / d,  a = beta d2

   l2(x) = x / sqrt(sum x^2 + eps), and for a row whose sum of squares is not finite (overflow, or inf / NaN)
   the form of ops/l2norm.py: y = x / s with s = max(max |x|, 1) (NaN if the row has a NaN), then
   y / sqrt(sum y^2 + eps / s^2), s held constant in the backward. d2 and d are held constant in the backward
   (detached in prepare_delta). |k^|^2 and d2 are double for float keys, as prepare_delta's key_norms, so d2,
   d and a round as there. Backward, with r = 1 / sqrt(sum y^2 + e) and the incoming gradient G of l2(x):
   dx = (r G - y r^3 (y . G)) / s. float and double from one body; no -ffast-math. */
#include <math.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=fast")
#elif defined(__clang__)
#pragma clang fp contract(fast)
#endif

#define DEFINE_DPREP(SFX, real)                                                                                 \
/* l2 of row x [K]: the factor r, the scale s (1 on the plain path) and e (eps / s^2) so that l2(x) = (x/s) r */ \
static inline void l2_row_##SFX(const real *restrict x, int64_t K, real eps, real *r, real *s) {               \
    real ss = 0;                                                                                                \
    _Pragma("omp simd reduction(+:ss)")                                                                         \
    for (int64_t j = 0; j < K; ++j) ss += x[j] * x[j];                                                          \
    if (isfinite(ss)) {                                                                                         \
        *s = 1;                                                                                                 \
        *r = (real)1 / (real)sqrt((double)(ss + eps));                                                          \
        return;                                                                                                 \
    }                                                                                                           \
    real m = 0;                                                                                                 \
    for (int64_t j = 0; j < K; ++j) {                                                                           \
        const real a = fabs(x[j]);                                                                              \
        if (a != a || a > m) m = a;                                                                             \
        if (m != m) break; /* NaN sticks */                                                                     \
    }                                                                                                           \
    const real sc = (m != m) ? m : (m > (real)1 ? m : (real)1);                                                 \
    real sy = 0;                                                                                                \
    for (int64_t j = 0; j < K; ++j) { const real y = x[j] / sc; sy += y * y; }                                  \
    *s = sc;                                                                                                    \
    *r = (real)1 / (real)sqrt((double)(sy + eps / (sc * sc)));                                                  \
}                                                                                                               \
                                                                                                                \
/* q, k [R, K], v [R, V], beta [R] -> qo, ko [R, K], vo [R, V], a [R]. */                                       \
int linattn_dprep_fwd_##SFX(int64_t R, int64_t K, int64_t V, const real *q, const real *k, const real *v,      \
                            const real *beta, double scale, double eps, real *qo, real *ko, real *vo, real *a,  \
                            int nthreads) {                                                                     \
    const real sc = (real)scale, e = (real)eps;                                                                 \
    _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                                          \
    for (int64_t i = 0; i < R; ++i) {                                                                           \
        const real *restrict qr = q + i * K, *restrict kr = k + i * K, *restrict vr = v + i * V;               \
        real *restrict qor = qo + i * K, *restrict kor = ko + i * K, *restrict vor = vo + i * V;               \
        real r, s;                                                                                              \
        l2_row_##SFX(qr, K, e, &r, &s);                                                                         \
        if (s == (real)1) {                                                                                     \
            _Pragma("omp simd")                                                                                 \
            for (int64_t j = 0; j < K; ++j) qor[j] = (qr[j] * r) * sc;                                          \
        } else {                                                                                                \
            for (int64_t j = 0; j < K; ++j) qor[j] = ((qr[j] / s) * r) * sc;                                    \
        }                                                                                                       \
        l2_row_##SFX(kr, K, e, &r, &s);                                                                         \
        real lam = 0;                                                                                           \
        if (s == (real)1) {                                                                                     \
            _Pragma("omp simd reduction(+:lam)")                                                                \
            for (int64_t j = 0; j < K; ++j) { const real y = kr[j] * r; kor[j] = y; lam += y * y; }             \
        } else {                                                                                                \
            for (int64_t j = 0; j < K; ++j) { const real y = (kr[j] / s) * r; kor[j] = y; lam += y * y; }       \
        }                                                                                                       \
        const double l = (double)lam, d2 = (l < 1.0 || l != l) ? (l != l ? l : 1.0) : l;                        \
        const real d = (real)sqrt(d2);                                                                          \
        if (d != (real)1) {                                                                                     \
            for (int64_t j = 0; j < K; ++j) kor[j] = kor[j] / d;                                                \
            for (int64_t j = 0; j < V; ++j) vor[j] = vr[j] / d;                                                 \
        } else {                                                                                                \
            _Pragma("omp simd")                                                                                 \
            for (int64_t j = 0; j < V; ++j) vor[j] = vr[j];                                                     \
        }                                                                                                       \
        a[i] = (real)((double)beta[i] * d2);                                                                    \
    }                                                                                                           \
    return 0;                                                                                                   \
}                                                                                                               \
                                                                                                                \
/* dx of l2 for one row x [K] given G [K] (overwrites out [K]) */                                               \
static inline void l2_bwd_row_##SFX(const real *restrict x, const real *restrict G, int64_t K, real eps,       \
                                    real *restrict out) {                                                       \
    real r, s;                                                                                                  \
    l2_row_##SFX(x, K, eps, &r, &s);                                                                            \
    real c = 0;                                                                                                 \
    if (s == (real)1) {                                                                                         \
        _Pragma("omp simd reduction(+:c)")                                                                      \
        for (int64_t j = 0; j < K; ++j) c += G[j] * x[j];                                                       \
        const real r3c = r * r * r * c;                                                                         \
        _Pragma("omp simd")                                                                                     \
        for (int64_t j = 0; j < K; ++j) out[j] = G[j] * r - x[j] * r3c;                                         \
    } else {                                                                                                    \
        for (int64_t j = 0; j < K; ++j) c += G[j] * (x[j] / s);                                                 \
        const real r3c = r * r * r * c;                                                                         \
        for (int64_t j = 0; j < K; ++j) out[j] = (G[j] * r - (x[j] / s) * r3c) / s;                             \
    }                                                                                                           \
}                                                                                                               \
                                                                                                                \
/* gradients of qo, ko, vo, a (any may be NULL: zero) -> dq, dk [R, K], dv [R, V], dbeta [R] */                 \
int linattn_dprep_bwd_##SFX(int64_t R, int64_t K, int64_t V, const real *q, const real *k, double scale,       \
                            double eps, const real *dqo, const real *dko, const real *dvo, const real *da,      \
                            real *dq, real *dk, real *dv, real *dbeta, int nthreads) {                          \
    const real sc = (real)scale, e = (real)eps;                                                                 \
    _Pragma("omp parallel num_threads(nthreads)")                                                               \
    {                                                                                                           \
        real G[K > 0 ? K : 1];                                                                                  \
        _Pragma("omp for schedule(static)")                                                                     \
        for (int64_t i = 0; i < R; ++i) {                                                                       \
            const real *restrict qr = q + i * K, *restrict kr = k + i * K;                                     \
            if (dqo) {                                                                                          \
                const real *restrict g = dqo + i * K;                                                           \
                _Pragma("omp simd")                                                                             \
                for (int64_t j = 0; j < K; ++j) G[j] = g[j] * sc;                                               \
                l2_bwd_row_##SFX(qr, G, K, e, dq + i * K);                                                      \
            } else {                                                                                            \
                for (int64_t j = 0; j < K; ++j) dq[i * K + j] = 0;                                              \
            }                                                                                                   \
            /* d2 and d of the row, as the forward */                                                           \
            real r, s, lam = 0;                                                                                 \
            l2_row_##SFX(kr, K, e, &r, &s);                                                                     \
            if (s == (real)1) {                                                                                 \
                _Pragma("omp simd reduction(+:lam)")                                                            \
                for (int64_t j = 0; j < K; ++j) { const real y = kr[j] * r; lam += y * y; }                     \
            } else {                                                                                            \
                for (int64_t j = 0; j < K; ++j) { const real y = (kr[j] / s) * r; lam += y * y; }               \
            }                                                                                                   \
            const double l = (double)lam, d2 = (l < 1.0 || l != l) ? (l != l ? l : 1.0) : l;                    \
            const real d = (real)sqrt(d2);                                                                      \
            if (dko) {                                                                                          \
                const real *restrict g = dko + i * K;                                                           \
                if (d != (real)1) {                                                                             \
                    for (int64_t j = 0; j < K; ++j) G[j] = g[j] / d;                                            \
                } else {                                                                                        \
                    _Pragma("omp simd")                                                                         \
                    for (int64_t j = 0; j < K; ++j) G[j] = g[j];                                                \
                }                                                                                               \
                l2_bwd_row_##SFX(kr, G, K, e, dk + i * K);                                                      \
            } else {                                                                                            \
                for (int64_t j = 0; j < K; ++j) dk[i * K + j] = 0;                                              \
            }                                                                                                   \
            real *restrict dvr = dv + i * V;                                                                    \
            if (dvo) {                                                                                          \
                const real *restrict g = dvo + i * V;                                                           \
                if (d != (real)1) {                                                                             \
                    for (int64_t j = 0; j < V; ++j) dvr[j] = g[j] / d;                                          \
                } else {                                                                                        \
                    _Pragma("omp simd")                                                                         \
                    for (int64_t j = 0; j < V; ++j) dvr[j] = g[j];                                              \
                }                                                                                               \
            } else {                                                                                            \
                for (int64_t j = 0; j < V; ++j) dvr[j] = 0;                                                     \
            }                                                                                                   \
            dbeta[i] = da ? (real)((double)da[i] * d2) : (real)0;                                               \
        }                                                                                                       \
    }                                                                                                           \
    return 0;                                                                                                   \
}                                                                                                               \
                                                                                                                \
/* Without the normalisation (qk_l2norm=False: EFLA, whose coefficient reads lam): q~ = scale q,               \
   lam = |k|^2 (double; for float keys the float sum, widened, or where it is not finite the double sum, as      \
   key_norms), d = sqrt(max(lam, 1)), k~ = k / d, v~ = v / d -> qo, ko [R, K], vo [R, V], lam [R]. */           \
static inline double lam_row_##SFX(const real *restrict x, int64_t K, int *wide) {                              \
    real ss = 0;                                                                                                \
    _Pragma("omp simd reduction(+:ss)")                                                                         \
    for (int64_t j = 0; j < K; ++j) ss += x[j] * x[j];                                                          \
    *wide = !isfinite(ss);                                                                                      \
    if (!*wide) return (double)ss;                                                                              \
    double sd = 0;                                                                                              \
    for (int64_t j = 0; j < K; ++j) sd += (double)x[j] * (double)x[j];                                          \
    return sd;                                                                                                  \
}                                                                                                               \
                                                                                                                \
int linattn_dprep_raw_fwd_##SFX(int64_t R, int64_t K, int64_t V, const real *q, const real *k, const real *v,  \
                                double scale, real *qo, real *ko, real *vo, double *lam, int nthreads) {        \
    const real sc = (real)scale;                                                                                \
    _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                                          \
    for (int64_t i = 0; i < R; ++i) {                                                                           \
        const real *restrict qr = q + i * K, *restrict kr = k + i * K, *restrict vr = v + i * V;               \
        real *restrict qor = qo + i * K, *restrict kor = ko + i * K, *restrict vor = vo + i * V;               \
        _Pragma("omp simd")                                                                                     \
        for (int64_t j = 0; j < K; ++j) qor[j] = qr[j] * sc;                                                    \
        int wide;                                                                                               \
        const double l = lam_row_##SFX(kr, K, &wide), d2 = (l < 1.0 || l != l) ? (l != l ? l : 1.0) : l;        \
        const real d = (real)sqrt(d2);                                                                          \
        lam[i] = l;                                                                                             \
        if (d != (real)1) {                                                                                     \
            for (int64_t j = 0; j < K; ++j) kor[j] = kr[j] / d;                                                 \
            for (int64_t j = 0; j < V; ++j) vor[j] = vr[j] / d;                                                 \
        } else {                                                                                                \
            _Pragma("omp simd")                                                                                 \
            for (int64_t j = 0; j < K; ++j) kor[j] = kr[j];                                                     \
            _Pragma("omp simd")                                                                                 \
            for (int64_t j = 0; j < V; ++j) vor[j] = vr[j];                                                     \
        }                                                                                                       \
    }                                                                                                           \
    return 0;                                                                                                   \
}                                                                                                               \
                                                                                                                \
/* gradients of qo, ko, vo (NULL: zero) and lam (double, NULL: zero) -> dq, dk [R, K], dv [R, V]: dk = dko / d  \
   + 2 k dlam (d held constant). */                                                                             \
int linattn_dprep_raw_bwd_##SFX(int64_t R, int64_t K, int64_t V, const real *k, double scale, const real *dqo,  \
                                const real *dko, const real *dvo, const double *dlam, real *dq, real *dk,       \
                                real *dv, int nthreads) {                                                       \
    const real sc = (real)scale;                                                                                \
    _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                                          \
    for (int64_t i = 0; i < R; ++i) {                                                                           \
        const real *restrict kr = k + i * K;                                                                    \
        real *restrict dqr = dq + i * K, *restrict dkr = dk + i * K, *restrict dvr = dv + i * V;               \
        if (dqo) {                                                                                              \
            const real *restrict g = dqo + i * K;                                                               \
            _Pragma("omp simd")                                                                                 \
            for (int64_t j = 0; j < K; ++j) dqr[j] = g[j] * sc;                                                 \
        } else {                                                                                                \
            for (int64_t j = 0; j < K; ++j) dqr[j] = 0;                                                         \
        }                                                                                                       \
        int wide;                                                                                               \
        const double l = lam_row_##SFX(kr, K, &wide), d2 = (l < 1.0 || l != l) ? (l != l ? l : 1.0) : l;        \
        const real d = (real)sqrt(d2);                                                                          \
        /* the branches outside the loops: a conditional division inside one does not vectorise */              \
        if (!dko) {                                                                                             \
            for (int64_t j = 0; j < K; ++j) dkr[j] = 0;                                                         \
        } else if (d != (real)1) {                                                                              \
            for (int64_t j = 0; j < K; ++j) dkr[j] = dko[i * K + j] / d;                                        \
        } else {                                                                                                \
            _Pragma("omp simd")                                                                                 \
            for (int64_t j = 0; j < K; ++j) dkr[j] = dko[i * K + j];                                            \
        }                                                                                                       \
        if (dlam) {                                                                                             \
            if (!wide) {                                                                                        \
                const real gl = (real)dlam[i];                                                                  \
                _Pragma("omp simd")                                                                             \
                for (int64_t j = 0; j < K; ++j) dkr[j] += gl * kr[j] + gl * kr[j];                              \
            } else {                                                                                            \
                for (int64_t j = 0; j < K; ++j) dkr[j] += (real)(2.0 * (double)kr[j] * dlam[i]);               \
            }                                                                                                   \
        }                                                                                                       \
        if (dvo) {                                                                                              \
            const real *restrict g = dvo + i * V;                                                               \
            if (d != (real)1) {                                                                                 \
                for (int64_t j = 0; j < V; ++j) dvr[j] = g[j] / d;                                              \
            } else {                                                                                            \
                _Pragma("omp simd")                                                                             \
                for (int64_t j = 0; j < V; ++j) dvr[j] = g[j];                                                  \
            }                                                                                                   \
        } else {                                                                                                \
            for (int64_t j = 0; j < V; ++j) dvr[j] = 0;                                                         \
        }                                                                                                       \
    }                                                                                                           \
    return 0;                                                                                                   \
}                                                                                                               \
                                                                                                                \
/* l2(x) of rows x [R, K] alone (a layer's own q normalisation, EFLA's): y [R, K]; backward dx from dy. */      \
int linattn_l2rows_fwd_##SFX(int64_t R, int64_t K, const real *x, double eps, real *y, int nthreads) {          \
    const real e = (real)eps;                                                                                   \
    _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                                          \
    for (int64_t i = 0; i < R; ++i) {                                                                           \
        const real *restrict xr = x + i * K;                                                                    \
        real *restrict yr = y + i * K;                                                                          \
        real r, s;                                                                                              \
        l2_row_##SFX(xr, K, e, &r, &s);                                                                         \
        if (s == (real)1) {                                                                                     \
            _Pragma("omp simd")                                                                                 \
            for (int64_t j = 0; j < K; ++j) yr[j] = xr[j] * r;                                                  \
        } else {                                                                                                \
            for (int64_t j = 0; j < K; ++j) yr[j] = (xr[j] / s) * r;                                            \
        }                                                                                                       \
    }                                                                                                           \
    return 0;                                                                                                   \
}                                                                                                               \
                                                                                                                \
int linattn_l2rows_bwd_##SFX(int64_t R, int64_t K, const real *x, double eps, const real *dy, real *dx,        \
                             int nthreads) {                                                                    \
    const real e = (real)eps;                                                                                   \
    _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                                          \
    for (int64_t i = 0; i < R; ++i) l2_bwd_row_##SFX(x + i * K, dy + i * K, K, e, dx + i * K);                  \
    return 0;                                                                                                   \
}

DEFINE_DPREP(f32, float)
DEFINE_DPREP(f64, double)

/* the interface version the Python bindings check after loading (cpu/build.py LIBRARIES) */
int linattn_deltaprep_abi_version(void) { return 1; }
