/* The smallest kernel: proves that the build works and says whether OpenMP is on.
   linattn_probe_threads(n): the number of threads an OpenMP region with num_threads(n) gets (1 without OpenMP).
   linattn_probe_axpy(n, a, x, y): y += a * x, a vectorisable loop (checks the simd pragma compiles). */
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

int linattn_probe_threads(int n) {
    int got = 1;
#ifdef _OPENMP
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

/* the interface version the Python bindings check after loading (cpu/build.py LIBRARIES) */
int linattn_probe_abi_version(void) { return 1; }
