/* The smallest kernel: proves that the build works, says whether OpenMP is on, and exposes common.h's exp to the
   tests (tests/cpu/test_common.py checks it against libm).
   linattn_probe_threads(n): the number of threads an OpenMP region with num_threads(n) gets (1 without OpenMP).
   linattn_probe_axpy(n, a, x, y): y += a * x, a vectorisable loop (checks the simd pragma compiles).
   linattn_probe_exp_f32 / _f64(n, x, y): y = la_exp(x), elementwise, in a vectorised loop (the bits the kernels
   get: a vector lane computes what a scalar call does). */
#include "common.h"

LA_ABI_VERSION(probe, 2)

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
