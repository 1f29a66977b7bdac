/* Small dense products on contiguous row-major blocks, for the chunk kernels (a chunk is at most a few
   hundred rows, so everything here fits the caches; the point is register blocking and vectorisation).

   Templated on the including file's REAL (float or double) and FN(name) (a suffixed name): include it once
   per type, after defining both. Plain C loops that the compiler vectorises (`omp simd` on the contiguous
   columns; no intrinsics), so the same code builds for x86-64 and arm64.

   All products accumulate: C[i][:] += sum_k A[i][k] B[k][:], k ascending for every element whatever the
   blocking, so a row's result never depends on how many rows are computed with it (bitwise prefix causality).
   The triangular forms restrict the sum by selection (never by multiplying with 0: 0 * inf = NaN):
     gemm_lo: row i uses k <= i          (a causal A times V)
     gemm_up: row i uses k >= i          (A^T times dO in the backward pass)                              */

#ifndef LINATTN_NB_BYTES
#define LINATTN_NB_BYTES 256 /* one accumulator row block: 4 AVX-512 / 8 AVX2 / 16 NEON registers */
#endif
#define GNB ((int)(LINATTN_NB_BYTES / sizeof(REAL)))

static inline int FN(imin)(int a, int b) { return a < b ? a : b; }

/* rows i0 .. i0+3 of C (columns n0 .. n0+nb), k in [kb, ke) */
static inline void FN(kern4)(int kb, int ke, const REAL *restrict A, int lda, const REAL *restrict B, int ldb,
                             REAL *restrict Cm, int ldc, int n0, int nb) {
    if (kb >= ke) return;
    REAL *c0 = Cm + n0, *c1 = c0 + ldc, *c2 = c1 + ldc, *c3 = c2 + ldc;
    const REAL *a0 = A, *a1 = A + lda, *a2 = a1 + lda, *a3 = a2 + lda;
#if defined(__GNUC__) && LINATTN_NB_BYTES == 256
    if (nb == GNB) { /* fixed width, GCC/clang vector types: 16 accumulators of 64 bytes stay in registers */
        typedef REAL vec __attribute__((vector_size(64), aligned(sizeof(REAL)))); /* unaligned loads allowed */
        const vec *v0 = (const vec *)c0, *v1 = (const vec *)c1, *v2 = (const vec *)c2, *v3 = (const vec *)c3;
        vec s00 = v0[0], s01 = v0[1], s02 = v0[2], s03 = v0[3], s10 = v1[0], s11 = v1[1], s12 = v1[2], s13 = v1[3],
            s20 = v2[0], s21 = v2[1], s22 = v2[2], s23 = v2[3], s30 = v3[0], s31 = v3[1], s32 = v3[2], s33 = v3[3];
        for (int k = kb; k < ke; k++) {
            const vec *b = (const vec *)(B + (int64_t)k * ldb + n0);
            const vec b0 = b[0], b1 = b[1], b2 = b[2], b3 = b[3];
            const REAL x0 = a0[k], x1 = a1[k], x2 = a2[k], x3 = a3[k];
            s00 += x0 * b0, s01 += x0 * b1, s02 += x0 * b2, s03 += x0 * b3;
            s10 += x1 * b0, s11 += x1 * b1, s12 += x1 * b2, s13 += x1 * b3;
            s20 += x2 * b0, s21 += x2 * b1, s22 += x2 * b2, s23 += x2 * b3;
            s30 += x3 * b0, s31 += x3 * b1, s32 += x3 * b2, s33 += x3 * b3;
        }
        vec *w0 = (vec *)c0, *w1 = (vec *)c1, *w2 = (vec *)c2, *w3 = (vec *)c3;
        w0[0] = s00, w0[1] = s01, w0[2] = s02, w0[3] = s03, w1[0] = s10, w1[1] = s11, w1[2] = s12, w1[3] = s13;
        w2[0] = s20, w2[1] = s21, w2[2] = s22, w2[3] = s23, w3[0] = s30, w3[1] = s31, w3[2] = s32, w3[3] = s33;
        return;
    }
#endif
    if (nb == GNB) { /* fixed width, plain C: the compiler may keep the accumulators in registers */
        REAL acc0[GNB], acc1[GNB], acc2[GNB], acc3[GNB];
        for (int n = 0; n < GNB; n++) { acc0[n] = c0[n]; acc1[n] = c1[n]; acc2[n] = c2[n]; acc3[n] = c3[n]; }
        for (int k = kb; k < ke; k++) {
            const REAL *b = B + (int64_t)k * ldb + n0;
            const REAL x0 = a0[k], x1 = a1[k], x2 = a2[k], x3 = a3[k];
#pragma omp simd
            for (int n = 0; n < GNB; n++) {
                acc0[n] += x0 * b[n];
                acc1[n] += x1 * b[n];
                acc2[n] += x2 * b[n];
                acc3[n] += x3 * b[n];
            }
        }
        for (int n = 0; n < GNB; n++) { c0[n] = acc0[n]; c1[n] = acc1[n]; c2[n] = acc2[n]; c3[n] = acc3[n]; }
        return;
    }
    for (int k = kb; k < ke; k++) {
        const REAL *b = B + (int64_t)k * ldb + n0;
        const REAL x0 = a0[k], x1 = a1[k], x2 = a2[k], x3 = a3[k];
#pragma omp simd
        for (int n = 0; n < nb; n++) {
            c0[n] += x0 * b[n];
            c1[n] += x1 * b[n];
            c2[n] += x2 * b[n];
            c3[n] += x3 * b[n];
        }
    }
}

/* one row of C (all N columns), k in [kb, ke) */
static inline void FN(kern1)(int kb, int ke, const REAL *restrict a, const REAL *restrict B, int ldb,
                             REAL *restrict c, int N) {
    for (int k = kb; k < ke; k++) {
        const REAL x = a[k];
        const REAL *b = B + (int64_t)k * ldb;
#pragma omp simd
        for (int n = 0; n < N; n++) c[n] += x * b[n];
    }
}

/* C[M][N] += A[M][Kd] B[Kd][N] */
static void FN(gemm)(int M, int N, int Kd, const REAL *restrict A, int lda, const REAL *restrict B, int ldb,
                     REAL *restrict Cm, int ldc) {
    int i0 = 0;
    for (; i0 + 4 <= M; i0 += 4)
        for (int n0 = 0; n0 < N; n0 += GNB)
            FN(kern4)(0, Kd, A + (int64_t)i0 * lda, lda, B, ldb, Cm + (int64_t)i0 * ldc, ldc, n0,
                      FN(imin)(GNB, N - n0));
    for (; i0 < M; i0++) FN(kern1)(0, Kd, A + (int64_t)i0 * lda, B, ldb, Cm + (int64_t)i0 * ldc, N);
}

/* C[M][N] += A[M][M] B[M][N] with row i using k <= i */
static void FN(gemm_lo)(int M, int N, const REAL *restrict A, int lda, const REAL *restrict B, int ldb,
                        REAL *restrict Cm, int ldc) {
    int i0 = 0;
    for (; i0 + 4 <= M; i0 += 4) {
        for (int n0 = 0; n0 < N; n0 += GNB)
            FN(kern4)(0, i0, A + (int64_t)i0 * lda, lda, B, ldb, Cm + (int64_t)i0 * ldc, ldc, n0,
                      FN(imin)(GNB, N - n0));
        for (int r = 0; r < 4; r++)
            FN(kern1)(i0, i0 + r + 1, A + (int64_t)(i0 + r) * lda, B, ldb, Cm + (int64_t)(i0 + r) * ldc, N);
    }
    for (; i0 < M; i0++) FN(kern1)(0, i0 + 1, A + (int64_t)i0 * lda, B, ldb, Cm + (int64_t)i0 * ldc, N);
}

/* C[M][N] += A[M][Kd] B[Kd][N] with row i using k >= i */
static void FN(gemm_up)(int M, int N, int Kd, const REAL *restrict A, int lda, const REAL *restrict B, int ldb,
                        REAL *restrict Cm, int ldc) {
    int i0 = 0;
    for (; i0 + 4 <= M; i0 += 4) {
        for (int r = 0; r < 3; r++)
            FN(kern1)(i0 + r, FN(imin)(i0 + 3, Kd), A + (int64_t)(i0 + r) * lda, B, ldb,
                      Cm + (int64_t)(i0 + r) * ldc, N);
        for (int n0 = 0; n0 < N; n0 += GNB)
            FN(kern4)(i0 + 3, Kd, A + (int64_t)i0 * lda, lda, B, ldb, Cm + (int64_t)i0 * ldc, ldc, n0,
                      FN(imin)(GNB, N - n0));
    }
    for (; i0 < M; i0++) FN(kern1)(i0, Kd, A + (int64_t)i0 * lda, B, ldb, Cm + (int64_t)i0 * ldc, N);
}

/* out[C][R] = in[R][C]^T (in with row stride ldi) */
static void FN(transpose)(int R, int Cc, const REAL *restrict in, int ldi, REAL *restrict out) {
    for (int r = 0; r < R; r++)
        for (int c = 0; c < Cc; c++) out[(int64_t)c * R + r] = in[(int64_t)r * ldi + c];
}
