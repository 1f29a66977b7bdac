/* The house style of the kernel sources in csrc/: what every file shares.

   Included twice by a kernel source: once at its top (the part below LINATTN_COMMON_ONCE: headers, pragmas as
   macros, the two exp functions, the ABI and sizeof export macros) and once inside its body for each REAL (the
   part under `#ifdef REAL`: SiLU, the overflow-safe L2 row, the RMSNorm row, compiled once per REAL with FN()).

   Floating-point contraction: ON (fused multiply-add where the compiler finds a * b + c), decided once, by the
   build flag -ffp-contract=fast (cpu/build.py BASE_FLAGS), and stated nowhere else: no source carries an
   fp-contract pragma. Why on: an FMA rounds once instead of twice (never less accurate than the two roundings),
   it is what PyTorch's own vectorised CPU kernels do, it keeps inf and NaN as they are (unlike -ffast-math,
   which the build never uses), and on the delta family it was measured faster. GCC's -std=c11 would default
   to off ("standard" contraction), which is why the flag is explicit. The bits therefore depend on the
   compiler's choice of which products to fuse: the golden-bits test (tests/cpu/test_golden_bits.py) is keyed
   by compiler version and CPU. */
#ifndef LINATTN_COMMON_ONCE
#define LINATTN_COMMON_ONCE

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

/* simd pragmas always (honoured under -fopenmp or -fopenmp-simd, ignored otherwise); threads under OpenMP */
#define LA_PRAGMA(x) _Pragma(#x)
#define LA_SIMD LA_PRAGMA(omp simd)
#define LA_SIMD_SUM(...) LA_PRAGMA(omp simd reduction(+ : __VA_ARGS__))
#if defined(_OPENMP)
#define LA_ATOMIC_WRITE LA_PRAGMA(omp atomic write)
#else
#define LA_ATOMIC_WRITE
#endif
#define LA_INLINE static inline __attribute__((always_inline))
#if defined(__GNUC__)
#define LA_PREFETCH(p, w) __builtin_prefetch((p), (w))
#else
#define LA_PREFETCH(p, w) ((void)0)
#endif

/* The feature maps a kernel applies itself (linear.c; decode.c's literals are the same numbers), shared with
   the Python side through linattn/feature_codes.py: identity (features given), elu(x) + 1, relu. */
#define LA_FMAP_IDENTITY 0
#define LA_FMAP_ELU1 1
#define LA_FMAP_RELU 2

/* Every library exports its interface version, which the loader checks against the binding table
   (cpu/bindings.py), and the size of each plan struct it takes (checked against the ctypes struct). */
#define LA_ABI_VERSION(lib, n) \
    int linattn_##lib##_abi_version(void) { return (n); }
#define LA_EXPORT_SIZEOF(name) \
    int64_t linattn_sizeof_##name(void) { return (int64_t)sizeof(linattn_##name); }

/* e^r for |r| <= ln2 / 2 by its Taylor polynomial of degree 7 (Horner; the truncation is far below half an ulp):
   the float exp's core, shared by la_expf and linear.c's elu+1 */
static inline float la_expf_poly(float r) {
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    return p * r + 1.0f;
}

/* exp in plain arithmetic, so that loops over it vectorise (libm's exp is a call per element) and every element
   gets the same bits wherever it sits in a vector (a prefix run reproduces the full run's values). x = n ln2 + r,
   |r| <= ln2 / 2 (Cody-Waite: ln2 in two parts, n rounded by adding and subtracting 1.5 2^k), e^r by its Taylor
   polynomial (degree 7 in float, 13 in double: the truncation is far below half an ulp), times 2^n applied as
   two exact powers of two, so that results down into the subnormals and the overflow to inf come out of the last
   product with one rounding. Within 1 ulp of libm over the whole range (tests/cpu/test_common.py).
   Clamps: x is clamped to [-104, 100] (float) / [-746, 710] (double) before the reduction, which keeps n and the
   two exponent fields in range; below the lower bound exp(x) rounds to 0 and is returned as 0, above the upper
   bound the product overflows to inf. NaN stays NaN, exp(-inf) = 0, exp(inf) = inf. The float function is
   linear.c's elu+1 polynomial too (lin_elu1_f32 reproduces its bits). */
/* la_expf's constants, shared by every float exp written out (la_expf_ymm, linear.c's elu+1): its clamps, log2(e),
   1.5 2^23 (added and subtracted: round to nearest), ln2 in two parts (Cody-Waite) */
#define LA_EXPF_LO (-104.0f)
#define LA_EXPF_HI 100.0f
#define LA_LOG2E_F 1.44269504088896341f
#define LA_ROUND_F 12582912.0f
#define LA_LN2_HI_F 0.693359375f
#define LA_LN2_LO_F (-2.12194440e-4f)

static inline float la_expf(float x) {
    float xc = x < LA_EXPF_LO ? LA_EXPF_LO : (x > LA_EXPF_HI ? LA_EXPF_HI : x);
    xc = x == x ? xc : 0.0f; /* NaN: computed on 0 (no float-to-int conversion of NaN), then NaN returned */
    const float t = xc * LA_LOG2E_F;
    const float n = (t + LA_ROUND_F) - LA_ROUND_F; /* round to nearest (|t| < 2^22) */
    const float r = (xc - n * LA_LN2_HI_F) - n * LA_LN2_LO_F;
    const float p = la_expf_poly(r);
    const int32_t ni = (int32_t)n, n1 = ni / 2, n2 = ni - n1;
    union {
        int32_t i;
        float f;
    } s1, s2; /* 2^n1, 2^n2 by their bits (a union, not memcpy: the loops around stay vectorisable) */
    s1.i = (n1 + 127) << 23;
    s2.i = (n2 + 127) << 23;
    const float y = (p * s1.f) * s2.f;
    return x < LA_EXPF_LO ? 0.0f : (x != x ? x : y);
}

static inline double la_exp(double x) {
    double xc = x < -746.0 ? -746.0 : (x > 710.0 ? 710.0 : x);
    xc = x == x ? xc : 0.0;
    const double t = xc * 1.44269504088896338700e+00;
    const double n = (t + 6755399441055744.0) - 6755399441055744.0; /* round to nearest (|t| < 2^51) */
    const double r = (xc - n * 6.93147180369123816490e-01) - n * 1.90821492927058770002e-10;
    double p = 1.0 / 6227020800.0;
    p = p * r + 1.0 / 479001600.0;
    p = p * r + 1.0 / 39916800.0;
    p = p * r + 1.0 / 3628800.0;
    p = p * r + 1.0 / 362880.0;
    p = p * r + 1.0 / 40320.0;
    p = p * r + 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    const int64_t ni = (int64_t)n, n1 = ni / 2, n2 = ni - n1;
    union {
        int64_t i;
        double f;
    } s1, s2;
    s1.i = (n1 + 1023) << 52;
    s2.i = (n2 + 1023) << 52;
    const double y = (p * s1.f) * s2.f;
    return x < -746.0 ? 0.0 : (x != x ? x : y);
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(LINATTN_PLAIN_C)
#include <immintrin.h>
/* la_expf on 8 lanes in AVX2 intrinsics, with la_expf's bits lane by lane: the same IEEE operations in the same
   order, fused where -ffp-contract=fast makes GCC fuse la_expf (read off its vectorised code: t + 1.5 2^23 as one
   fma, r's two products each an fnmadd, the polynomial's Horner steps fmas; 2^n's two products and the selections
   plain). The clamp by max / min gives la_expf's clamped value for every non-NaN x (x itself inside the bounds, the
   bound outside), NaN lanes are zeroed as there; int n / 2 truncates toward zero as C's division does. Only where
   its bits are pinned to the scalar ones (tests/cpu/test_decode_silu.py). */
#define LA_EXPF_YMM 1
static inline __m256 la_expf_ymm(__m256 x) {
    const __m256 lo = _mm256_set1_ps(LA_EXPF_LO);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q), under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    const __m256 xc = _mm256_andnot_ps(nan, _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(LA_EXPF_HI)));
    const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(xc, _mm256_set1_ps(LA_LOG2E_F), _mm256_set1_ps(LA_ROUND_F)),
                                   _mm256_set1_ps(LA_ROUND_F));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LA_LN2_HI_F), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LA_LN2_LO_F), r);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(1.0f / 5040.0f), r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i ni = _mm256_cvttps_epi32(n), bias = _mm256_set1_epi32(127);
    const __m256i n1 = _mm256_srai_epi32(_mm256_add_epi32(ni, _mm256_srli_epi32(ni, 31)), 1); /* ni / 2 */
    const __m256i n2 = _mm256_sub_epi32(ni, n1);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23)),
                 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    const __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
    return _mm256_andnot_ps(under, _mm256_blendv_ps(y, x, nan));
}

/* la_silu_f32 on 8 lanes: x / (1 + la_expf(-x)), the same bits */
static inline __m256 la_silu_ymm(__m256 x) {
    const __m256 e = la_expf_ymm(_mm256_xor_ps(x, _mm256_set1_ps(-0.0f)));
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}
#endif

#endif /* LINATTN_COMMON_ONCE */

/* ------------------------------------------------------------------------------------------- once per REAL */
#if defined(REAL) && defined(FN)

static inline REAL FN(la_exp)(REAL x) { return sizeof(REAL) == 4 ? (REAL)la_expf((float)x) : (REAL)la_exp((double)x); }

/* the logistic function and SiLU: x sigma(x) = x / (1 + exp(-x)) (SiLU: inf -> inf, -inf -> NaN as torch's; NaN
   -> NaN) */
static inline REAL FN(la_sigmoid)(REAL x) { return (REAL)1 / ((REAL)1 + FN(la_exp)(-x)); }
static inline REAL FN(la_silu)(REAL x) { return x / ((REAL)1 + FN(la_exp)(-x)); }

/* The L2 normalisation of a row x [K] (ops/l2norm.py's "rsqrt" form): l2(x) = (x / s) r, returned as r and s.
   r = 1 / sqrt(sum x^2 + eps) and s = 1 on the plain path; for a row whose sum of squares is not finite
   (overflow, inf or NaN) the row is first divided by s = max(max |x|, 1) (NaN if the row has a NaN), and
   r = 1 / sqrt(sum (x/s)^2 + eps / s^2). s is held constant in the backward. */
static inline void FN(la_l2_row)(const REAL *restrict x, int64_t K, REAL eps, REAL *r, REAL *s) {
    REAL ss = 0;
    LA_SIMD_SUM(ss)
    for (int64_t j = 0; j < K; ++j) ss += x[j] * x[j];
    if (isfinite(ss)) {
        *s = 1;
        *r = (REAL)1 / (REAL)sqrt((double)(ss + eps));
        return;
    }
    REAL m = 0;
    for (int64_t j = 0; j < K; ++j) {
        const REAL a = fabs(x[j]);
        if (a != a || a > m) m = a;
        if (m != m) break; /* NaN sticks */
    }
    const REAL sc = (m != m) ? m : (m > (REAL)1 ? m : (REAL)1);
    REAL sy = 0;
    for (int64_t j = 0; j < K; ++j) {
        const REAL y = x[j] / sc;
        sy += y * y;
    }
    *s = sc;
    *r = (REAL)1 / (REAL)sqrt((double)(sy + eps / (sc * sc)));
}

/* RMSNorm's factor of a row x [D]: 1 / sqrt(mean x^2 + eps) (the square root in double, as torch's rsqrt of a
   float rounds once) */
static inline REAL FN(la_rms_rstd)(const REAL *restrict x, int64_t D, REAL eps) {
    REAL ss = 0;
    LA_SIMD_SUM(ss)
    for (int64_t d = 0; d < D; ++d) ss += x[d] * x[d];
    return (REAL)1 / (REAL)sqrt((double)(ss / (REAL)D + eps));
}

#endif /* REAL */
