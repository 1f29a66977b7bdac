/* Small dense products on contiguous row-major blocks, for the chunk kernels (a chunk is at most a few
   hundred rows, so everything here fits the caches; the point is register blocking and vectorisation).

   Templated on the including file's REAL (float or double), IREAL (the integer of its width: int32_t, int64_t)
   and FN(name) (a suffixed name): include it once per type, after defining them. Plain C loops that the compiler
   vectorises (`omp simd` on the contiguous columns; no intrinsics), plus register-blocked kernels written with
   GCC/clang vector types (64-byte vectors, lowered to AVX-512, AVX2 or NEON registers), with a plain-C fallback
   for other compilers.

   All products accumulate: C[i][:] += sum_k A[i][k] B[k][:]. Columns come in two parts: the leading multiple of
   a 64-byte vector (VL columns), k ascending for every element; the last N % VL columns (the normaliser's
   column beside V, for instance) by dot products over k with fixed accumulation lanes. Either way a row's
   result never depends on how many rows are computed with it, nor on where the buffers sit in memory (bitwise
   prefix causality). The including file assembles whole products from these blocks (linear.c: pgemm, and the
   triangular pgemm_lo, row i using k <= i, a causal A times V, and pgemm_up, k >= i, A^T times dO); triangular
   products restrict the sum by selection, never by multiplying with 0 (0 * inf = NaN).                      */

#include <string.h>

#define VL ((int)(64 / sizeof(REAL))) /* elements of one 64-byte vector: 16 float, 8 double */
#define TAIL_MAX_K 1024               /* longest k range of the tail columns' column buffer (longer: plain loop) */

static inline int FN(imin)(int a, int b) { return a < b ? a : b; }

#if defined(__GNUC__) && !defined(LINATTN_PLAIN_C) /* -DLINATTN_PLAIN_C: the fallback */
/* The register blocks' vector: a 64-byte line with AVX-512 (32 registers of 64 bytes), half a line elsewhere (16 or
   32 registers of 32 / 16 bytes: a 64-byte vector there is 2-4 registers, and the 4 x 4 block's accumulators spilled
   on every k, ~3x slower on AVX2 than plain loops). Every element of C is the same k-ascending sum whatever vector
   or block makes it, so the bits do not depend on this choice; the columns' split (VL) stays 64 bytes. */
#if defined(__AVX512F__)
#define GVB 64
#else
#define GVB 32
#endif
#define GVL ((int)(GVB / sizeof(REAL))) /* elements of one register block vector */
typedef REAL FN(vec) __attribute__((vector_size(GVB), aligned(sizeof(REAL)))); /* unaligned access allowed */

/* rows 0..3 of C (ldc apart), columns n0 .. n0 + 4 GVL, k in [kb, ke): 16 accumulators in registers */
static inline void FN(k4v4)(int kb, int ke, const REAL *restrict A, int lda, const REAL *restrict B, int ldb,
                            REAL *restrict Cm, int ldc, int n0, int zero) {
    typedef FN(vec) vec;
    vec *w0 = (vec *)(Cm + n0), *w1 = (vec *)(Cm + ldc + n0), *w2 = (vec *)(Cm + 2 * ldc + n0),
        *w3 = (vec *)(Cm + 3 * ldc + n0);
    const REAL *a0 = A, *a1 = A + lda, *a2 = a1 + lda, *a3 = a2 + lda;
    vec s00, s01, s02, s03, s10, s11, s12, s13, s20, s21, s22, s23, s30, s31, s32, s33;
    if (zero) {
        const vec z = {0};
        s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = s20 = s21 = s22 = s23 = s30 = s31 = s32 = s33 = z;
    } else {
        s00 = w0[0], s01 = w0[1], s02 = w0[2], s03 = w0[3], s10 = w1[0], s11 = w1[1], s12 = w1[2], s13 = w1[3];
        s20 = w2[0], s21 = w2[1], s22 = w2[2], s23 = w2[3], s30 = w3[0], s31 = w3[1], s32 = w3[2], s33 = w3[3];
    }
    for (int k = kb; k < ke; k++) {
        const vec *b = (const vec *)(B + (int64_t)k * ldb + n0);
        const vec b0 = b[0], b1 = b[1], b2 = b[2], b3 = b[3];
        const REAL x0 = a0[k], x1 = a1[k], x2 = a2[k], x3 = a3[k];
        s00 += x0 * b0, s01 += x0 * b1, s02 += x0 * b2, s03 += x0 * b3;
        s10 += x1 * b0, s11 += x1 * b1, s12 += x1 * b2, s13 += x1 * b3;
        s20 += x2 * b0, s21 += x2 * b1, s22 += x2 * b2, s23 += x2 * b3;
        s30 += x3 * b0, s31 += x3 * b1, s32 += x3 * b2, s33 += x3 * b3;
    }
    w0[0] = s00, w0[1] = s01, w0[2] = s02, w0[3] = s03, w1[0] = s10, w1[1] = s11, w1[2] = s12, w1[3] = s13;
    w2[0] = s20, w2[1] = s21, w2[2] = s22, w2[3] = s23, w3[0] = s30, w3[1] = s31, w3[2] = s32, w3[3] = s33;
}

/* the same for 2 GVL columns */
static inline void FN(k4v2)(int kb, int ke, const REAL *restrict A, int lda, const REAL *restrict B, int ldb,
                            REAL *restrict Cm, int ldc, int n0, int zero) {
    typedef FN(vec) vec;
    vec *w0 = (vec *)(Cm + n0), *w1 = (vec *)(Cm + ldc + n0), *w2 = (vec *)(Cm + 2 * ldc + n0),
        *w3 = (vec *)(Cm + 3 * ldc + n0);
    const REAL *a0 = A, *a1 = A + lda, *a2 = a1 + lda, *a3 = a2 + lda;
    vec s00, s01, s10, s11, s20, s21, s30, s31;
    if (zero) {
        const vec z = {0};
        s00 = s01 = s10 = s11 = s20 = s21 = s30 = s31 = z;
    } else {
        s00 = w0[0], s01 = w0[1], s10 = w1[0], s11 = w1[1], s20 = w2[0], s21 = w2[1], s30 = w3[0], s31 = w3[1];
    }
    for (int k = kb; k < ke; k++) {
        const vec *b = (const vec *)(B + (int64_t)k * ldb + n0);
        const vec b0 = b[0], b1 = b[1];
        const REAL x0 = a0[k], x1 = a1[k], x2 = a2[k], x3 = a3[k];
        s00 += x0 * b0, s01 += x0 * b1, s10 += x1 * b0, s11 += x1 * b1;
        s20 += x2 * b0, s21 += x2 * b1, s30 += x3 * b0, s31 += x3 * b1;
    }
    w0[0] = s00, w0[1] = s01, w1[0] = s10, w1[1] = s11, w2[0] = s20, w2[1] = s21, w3[0] = s30, w3[1] = s31;
}

/* the same for GVL columns */
static inline void FN(k4v1)(int kb, int ke, const REAL *restrict A, int lda, const REAL *restrict B, int ldb,
                            REAL *restrict Cm, int ldc, int n0, int zero) {
    typedef FN(vec) vec;
    vec *w0 = (vec *)(Cm + n0), *w1 = (vec *)(Cm + ldc + n0), *w2 = (vec *)(Cm + 2 * ldc + n0),
        *w3 = (vec *)(Cm + 3 * ldc + n0);
    const REAL *a0 = A, *a1 = A + lda, *a2 = a1 + lda, *a3 = a2 + lda;
    vec s0, s1, s2, s3;
    if (zero) {
        const vec z = {0};
        s0 = s1 = s2 = s3 = z;
    } else {
        s0 = w0[0], s1 = w1[0], s2 = w2[0], s3 = w3[0];
    }
    for (int k = kb; k < ke; k++) {
        const vec b0 = *(const vec *)(B + (int64_t)k * ldb + n0);
        s0 += a0[k] * b0, s1 += a1[k] * b0, s2 += a2[k] * b0, s3 += a3[k] * b0;
    }
    w0[0] = s0, w1[0] = s1, w2[0] = s2, w3[0] = s3;
}
#endif

/* rows i0 .. i0+3 of C, columns 0 .. Nv (a multiple of VL), k in [kb, ke); zero: C = the product (the
   accumulators start at 0 instead of C's values, the same bits as a zeroed C, without a pass to zero it) */
static inline void FN(block4)(int kb, int ke, const REAL *restrict A, int lda, const REAL *restrict B, int ldb,
                              REAL *restrict Cm, int ldc, int Nv, int zero) {
    if (Nv <= 0) return;
#if defined(__GNUC__) && !defined(LINATTN_PLAIN_C)
    if (kb >= ke) {
        if (zero)
            for (int r = 0; r < 4; r++) memset(Cm + (int64_t)r * ldc, 0, sizeof(REAL) * Nv);
        return;
    }
    int n0 = 0;
#if GVB == 64
    for (; n0 + 4 * GVL <= Nv; n0 += 4 * GVL) FN(k4v4)(kb, ke, A, lda, B, ldb, Cm, ldc, n0, zero);
#endif
    for (; n0 + 2 * GVL <= Nv; n0 += 2 * GVL) FN(k4v2)(kb, ke, A, lda, B, ldb, Cm, ldc, n0, zero);
    if (n0 + GVL <= Nv) FN(k4v1)(kb, ke, A, lda, B, ldb, Cm, ldc, n0, zero);
#else /* plain C: accumulate in memory, the column loop vectorised */
    if (zero)
        for (int r = 0; r < 4; r++) memset(Cm + (int64_t)r * ldc, 0, sizeof(REAL) * Nv);
    if (kb >= ke) return;
    REAL *c0 = Cm, *c1 = c0 + ldc, *c2 = c1 + ldc, *c3 = c2 + ldc;
    const REAL *a0 = A, *a1 = A + lda, *a2 = a1 + lda, *a3 = a2 + lda;
    for (int k = kb; k < ke; k++) {
        const REAL *b = B + (int64_t)k * ldb;
        const REAL x0 = a0[k], x1 = a1[k], x2 = a2[k], x3 = a3[k];
#pragma omp simd
        for (int n = 0; n < Nv; n++) {
            c0[n] += x0 * b[n];
            c1[n] += x1 * b[n];
            c2[n] += x2 * b[n];
            c3[n] += x3 * b[n];
        }
    }
#endif
}

/* one row of C, columns 0 .. Nv, k in [kb, ke) */
static inline void FN(kern1)(int kb, int ke, const REAL *restrict a, const REAL *restrict B, int ldb,
                             REAL *restrict c, int Nv) {
    for (int k = kb; k < ke; k++) {
        const REAL x = a[k];
        const REAL *b = B + (int64_t)k * ldb;
#pragma omp simd
        for (int n = 0; n < Nv; n++) c[n] += x * b[n];
    }
}

/* sum_k a[k] b[k], k < n, in 16 fixed lanes (their order does not depend on alignment), lanes summed in order */
static inline REAL FN(dot16)(const REAL *restrict a, const REAL *restrict b, int n) {
    REAL acc[16] = {0};
    int k = 0;
    for (; k + 16 <= n; k += 16) {
#pragma omp simd
        for (int l = 0; l < 16; l++) acc[l] += a[k + l] * b[k + l];
    }
    for (int l = 0; k + l < n; l++) acc[l] += a[k + l] * b[k + l];
    REAL s = 0;
    for (int l = 0; l < 16; l++) s += acc[l];
    return s;
}

/* the columns Nv .. N of C for every row: mode 0 all k < Kd, 1 (lo) k <= i, 2 (up) k >= i */
static void FN(tail)(int M, int N, int Nv, int Kd, const REAL *restrict A, int lda, const REAL *restrict B, int ldb,
                     REAL *restrict Cm, int ldc, int mode) {
    REAL col[TAIL_MAX_K];
    for (int n = Nv; n < N; n++) {
        const int buffered = Kd <= TAIL_MAX_K;
        if (buffered)
            for (int k = 0; k < Kd; k++) col[k] = B[(int64_t)k * ldb + n];
        for (int i = 0; i < M; i++) {
            const int kb = mode == 2 ? i : 0, ke = mode == 1 ? FN(imin)(i + 1, Kd) : Kd;
            if (kb >= ke) continue;
            const REAL *a = A + (int64_t)i * lda;
            if (buffered) {
                Cm[(int64_t)i * ldc + n] += FN(dot16)(a + kb, col + kb, ke - kb);
            } else {
                REAL s = 0;
                for (int k = kb; k < ke; k++) s += a[k] * B[(int64_t)k * ldb + n];
                Cm[(int64_t)i * ldc + n] += s;
            }
        }
    }
}

/* out[C][R] = in[R][C]^T (in with row stride ldi); copies only, so the bits are the same on every path.
   With GCC and AVX-512: VL x VL blocks in registers, log2(VL) rounds of two-input shuffles (each round swaps the
   off-diagonal d x d blocks of every 2d x 2d block), ~4x faster than building each vector from strided scalars
   (the backward pass transposes several blocks per chunk). Elsewhere: blocks of 16 rows, each output row segment
   16 contiguous stores fed by one strided loop the compiler vectorises; the rest element by element. */
#if defined(__GNUC__) && !defined(__clang__) && !defined(LINATTN_PLAIN_C) && defined(__AVX512F__)
typedef IREAL FN(ivec) __attribute__((vector_size(64)));

/* one round: rows i and i + d (i & d == 0) exchange their off-diagonal d x d blocks */
static inline __attribute__((always_inline)) void FN(tround)(FN(vec) *r, const int d) {
    typedef FN(ivec) ivec;
    ivec lo, hi; /* new row i: its own columns j (j & d == 0), then row i + d's; new row i + d: the others */
#pragma GCC unroll 16
    for (int j = 0; j < VL; j++) {
        lo[j] = (j & d) == 0 ? j : VL + j - d;
        hi[j] = (j & d) == 0 ? j + d : VL + j;
    }
#pragma GCC unroll 16
    for (int i = 0; i < VL; i++)
        if ((i & d) == 0) {
            const FN(vec) x = r[i], y = r[i + d];
            r[i] = __builtin_shuffle(x, y, lo);
            r[i + d] = __builtin_shuffle(x, y, hi);
        }
}

static inline __attribute__((always_inline)) void FN(tblock)(const REAL *restrict in, int64_t ldi,
                                                             REAL *restrict out, int64_t ldo) {
    typedef FN(vec) vec;
    vec r[VL];
#pragma GCC unroll 16
    for (int i = 0; i < VL; i++) r[i] = *(const vec *)(in + i * ldi);
    if (VL == 16) FN(tround)(r, 8);
    FN(tround)(r, 4);
    FN(tround)(r, 2);
    FN(tround)(r, 1);
#pragma GCC unroll 16
    for (int i = 0; i < VL; i++) *(vec *)(out + i * ldo) = r[i];
}
#define LINATTN_TBLOCK 1
#endif

static void FN(transpose)(int R, int Cc, const REAL *restrict in, int ldi, REAL *restrict out) {
    int r0 = 0;
#ifdef LINATTN_TBLOCK
    for (; r0 + VL <= R; r0 += VL) {
        int c0 = 0;
        for (; c0 + VL <= Cc; c0 += VL) FN(tblock)(in + (int64_t)r0 * ldi + c0, ldi, out + (int64_t)c0 * R + r0, R);
        for (int c = c0; c < Cc; c++)
            for (int j = 0; j < VL; j++) out[(int64_t)c * R + r0 + j] = in[(int64_t)(r0 + j) * ldi + c];
    }
#undef LINATTN_TBLOCK
#endif
    for (; r0 + 16 <= R; r0 += 16)
        for (int c = 0; c < Cc; c++) {
            REAL *restrict o = out + (int64_t)c * R + r0;
            const REAL *restrict x = in + (int64_t)r0 * ldi + c;
#pragma omp simd
            for (int j = 0; j < 16; j++) o[j] = x[(int64_t)j * ldi];
        }
    for (; r0 < R; r0++)
        for (int c = 0; c < Cc; c++) out[(int64_t)c * R + r0] = in[(int64_t)r0 * ldi + c];
}

#undef VL
#undef TAIL_MAX_K
