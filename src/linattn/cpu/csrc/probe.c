/* The smallest kernel: proves that the build works, says whether OpenMP is on, and exposes common.h's exp to the
   tests (tests/cpu/test_common.py checks it against libm).
   linattn_probe_threads(n): the number of threads an OpenMP region with num_threads(n) gets (1 without OpenMP).
   linattn_probe_axpy(n, a, x, y): y += a * x, a vectorisable loop (checks the simd pragma compiles).
   linattn_probe_exp_f32 / _f64(n, x, y): y = la_exp(x), elementwise, in a vectorised loop (the bits the kernels
   get: a vector lane computes what a scalar call does).
   linattn_probe_silu_f32(n, x, y, path): SiLU by common.h's scalar la_silu_f32, its GCC vector loop or la_silu_ymm
   (tests/cpu/test_decode_silu.py pins their bits together).
   linattn_probe_read_sum(n, x, nthreads, out): *out = the sum of x[0..n) in blocks across nthreads threads, 64 independent
   lanes per thread (no add waits on the previous one): a read of the buffer at the rate the memory gives, the
   bandwidth pass of `linattn bench infer`'s floor. */
#include "common.h"

LA_ABI_VERSION(probe, 3)

int linattn_probe_threads(int n) {
    int got = 1;
#if defined(_OPENMP)
#pragma omp parallel num_threads(n)
    {
#pragma omp single
        got = omp_get_num_threads();
    }
#else
    (void)n;
#endif
    return got;
}

void linattn_probe_axpy(int64_t n, float a, const float *restrict x, float *restrict y) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

void linattn_probe_exp_f32(int64_t n, const float *restrict x, float *restrict y) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] = la_expf(x[i]);
}

void linattn_probe_exp_f64(int64_t n, const double *restrict x, double *restrict y) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] = la_exp(x[i]);
}

/* SiLU x / (1 + la_expf(-x)) on float by path: 0 one element a call (through a volatile pointer: never vectorised),
   1 the loop under omp simd (the vector code GCC makes of la_silu_f32), 2 la_silu_ymm 8 lanes a step (the rest by
   path 0). Returns 1 (nothing written) for path 2 where la_silu_ymm is not compiled (no AVX2 + FMA), else 0. */
#define REAL float
#define FN(name) name##_f32
#include "common.h" /* its per-REAL part: la_silu_f32 */
#undef REAL
#undef FN

static float probe_silu_one(float x) { return la_silu_f32(x); }

int linattn_probe_silu_f32(int64_t n, const float *restrict x, float *restrict y, int path) {
    int64_t i = 0;
    if (path == 1) {
#pragma omp simd
        for (int64_t j = 0; j < n; j++) y[j] = la_silu_f32(x[j]);
        return 0;
    }
    if (path == 2) {
#if defined(LA_EXPF_YMM)
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, la_silu_ymm(_mm256_loadu_ps(x + i)));
#else
        return 1;
#endif
    }
    float (*volatile one)(float) = probe_silu_one;
    for (; i < n; i++) y[i] = one(x[i]);
    return 0;
}

/* the bandwidth pass (bench/infer.py ReadBandwidth) */
#define LA_READ_LANES 64
#define LA_READ_BLOCK 16384   /* floats per block: 64 KiB, scheduled statically across the threads */

void linattn_probe_read_sum(int64_t n, const float *restrict x, int nthreads, double *out) {
    int64_t nblocks = n / LA_READ_BLOCK;
    double total = 0.0;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(nthreads) schedule(static) reduction(+ : total)
#else
    (void)nthreads;
#endif
    for (int64_t b = 0; b < nblocks; b++) {
        const float *p = x + b * LA_READ_BLOCK;
        float acc[LA_READ_LANES] = {0};
        for (int64_t i = 0; i < LA_READ_BLOCK; i += LA_READ_LANES) {
#pragma omp simd
            for (int j = 0; j < LA_READ_LANES; j++) acc[j] += p[i + j];
        }
        float s = 0.0f;
        for (int j = 0; j < LA_READ_LANES; j++) s += acc[j];
        total += s;
    }
    for (int64_t i = nblocks * LA_READ_BLOCK; i < n; i++) total += x[i];
    *out = total;
}
