/* Row sums of 64-byte lane partials, several rows at once (delta.c's and rwkv7.c's backward).

   The backward kernels sum each row's products in L = 64 bytes of lanes and fold them by halving: x[l] + x[l + L/2],
   then + L/4, ..., then x[0] + x[1]. On AVX2 without AVX-512 that fold ran once per row and per sum, mostly in
   scalar shuffles and adds (a third of rwkv7's backward). With LA_ROWSUMS_BATCH the first halving stays in the row's
   loop (rowsums_half) and the rest runs for R = 32 bytes of rows at once (rowsums_add: R rows' halves transposed
   in registers): every row's sum is formed from the same pairs in the same order, so the bits are the fold's. */
#ifndef LINATTN_ROWSUMS_H
#define LINATTN_ROWSUMS_H

#include <stdint.h>

#if defined(__AVX2__) && !defined(__AVX512F__) && !defined(LINATTN_PLAIN_C)
#include <immintrin.h>
#define LA_ROWSUMS_BATCH 1

/* dst[r] += the fold of h[r] (8 floats: a row's first halving) for the rows r = 0 .. 7 */
static inline __attribute__((always_inline)) void la_rowsums_add_f32(const float (*h)[8], float *dst) {
    __m256 c[8];
    for (int r = 0; r < 8; r++) c[r] = _mm256_loadu_ps(h[r]);
    __m256 p[4]; /* p[i]: rows i (low 128 bits) and i + 4 (high), each x[l] + x[l + 4] for l < 4 */
    for (int i = 0; i < 4; i++)
        p[i] = _mm256_add_ps(_mm256_permute2f128_ps(c[i], c[i + 4], 0x20),
                             _mm256_permute2f128_ps(c[i], c[i + 4], 0x31));
    /* e01: x[l] + x[l + 2] (l < 2) of rows 0, 1 | 4, 5; e23 those of rows 2, 3 | 6, 7 */
    const __m256 e01 = _mm256_add_ps(_mm256_shuffle_ps(p[0], p[1], 0x44), _mm256_shuffle_ps(p[0], p[1], 0xEE));
    const __m256 e23 = _mm256_add_ps(_mm256_shuffle_ps(p[2], p[3], 0x44), _mm256_shuffle_ps(p[2], p[3], 0xEE));
    /* x[0] + x[1] of rows 0 .. 7 in order */
    const __m256 f = _mm256_add_ps(_mm256_shuffle_ps(e01, e23, 0x88), _mm256_shuffle_ps(e01, e23, 0xDD));
    _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_loadu_ps(dst), f));
}

/* dst[r] += the fold of h[r] (4 doubles: a row's first halving) for the rows r = 0 .. 3 */
static inline __attribute__((always_inline)) void la_rowsums_add_f64(const double (*h)[4], double *dst) {
    __m256d c[4];
    for (int r = 0; r < 4; r++) c[r] = _mm256_loadu_pd(h[r]);
    /* p02: x[l] + x[l + 2] (l < 2) of rows 0 | 2; p13 of rows 1 | 3 */
    const __m256d p02 = _mm256_add_pd(_mm256_permute2f128_pd(c[0], c[2], 0x20),
                                      _mm256_permute2f128_pd(c[0], c[2], 0x31));
    const __m256d p13 = _mm256_add_pd(_mm256_permute2f128_pd(c[1], c[3], 0x20),
                                      _mm256_permute2f128_pd(c[1], c[3], 0x31));
    const __m256d f = _mm256_add_pd(_mm256_unpacklo_pd(p02, p13), _mm256_unpackhi_pd(p02, p13));
    _mm256_storeu_pd(dst, _mm256_add_pd(_mm256_loadu_pd(dst), f));
}
#endif

#endif /* LINATTN_ROWSUMS_H */
