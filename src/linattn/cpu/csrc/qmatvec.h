/* The weight formats of the compiled decode's matrix-vector products, and the one function every weight matrix's
   product goes through (matvec_w_f32; f64 plans read fp64 weights only). Included by decode.c after its bf16
   helpers and vector types.

       WF_PLAN  the plan's own type (fp32 / fp64)
       WF_BF16  bfloat16 (f32 plans)
       WF_INT8  int8 q [n, m], one bf16 scale per row:          W[i, j] = q[i, j] * s[i]
       WF_INT4  uint8 [n, m/2] of two codes c = q + 8 per byte (the even column in the low nibble), one bf16 scale
                per row and group of `group` inputs (32 or 64):  W[i, j] = (c[i, j] - 8) * s[i, j / group]

   (quant/linear.py stores them so; the bytes are read as stored.) Activations and accumulation are fp32: int8
   weights convert exactly to fp32, a row's products accumulate in fp32 vector lanes and the sum is multiplied by
   the row's scale once; int4 codes minus 8 are exact fp32 integers, a group's products are summed and the sum
   multiplied by the group's scale. So the result is the dequantized matrix's product up to the rounding of fp32
   operations. Four rows are read per step as in the fp32 / bf16 products. */
#ifndef LINATTN_QMATVEC_H
#define LINATTN_QMATVEC_H

#define WF_PLAN 0
#define WF_BF16 1
#define WF_INT8 2
#define WF_INT4 3
/* the format a plan's matrix is in: its own field when set, else the plan-wide bf16 switch */
#define WEIGHT_FORMAT(wbf16, fmt) ((fmt) ? (int)(fmt) : ((wbf16) ? WF_BF16 : WF_PLAN))

static void matvec_f32(int64_t B, int64_t n, int64_t m, const float *W, const float *bias, const float *x,
                       const float *add, float *y, int nthreads);

/* y[b, i] = add[b, i] + v + bias[i] (add, bias: NULL for none) */
static inline void q_store_row(int64_t n, int64_t b, int64_t i, float v, const float *bias, const float *add,
                               float *y) {
    if (bias) v = v + bias[i];
    y[b * n + i] = add ? add[b * n + i] + v : v;
}

#if defined(HAVE_VLINE)
typedef int8_t vq_i8 __attribute__((vector_size(16)));
typedef uint8_t vq_u8 __attribute__((vector_size(16)));
typedef int32_t vq_i32 __attribute__((vector_size(64)));
/* 16 bytes loaded (unaligned) into a vector register: without the empty asm GCC 12 widens a loaded byte vector one
   byte at a time (16 scalar sign extensions and conversions instead of one vpmovsxbd) */
#if defined(__x86_64__) || defined(__i386__)
#define Q_LOAD16(v, p) do { memcpy(&(v), (p), 16); __asm__("" : "+x"(v)); } while (0)
#else
#define Q_LOAD16(v, p) memcpy(&(v), (p), 16)
#endif
static inline vline_f32 i8_line(const int8_t *w) {
    vq_i8 v;
    Q_LOAD16(v, w);
    return __builtin_convertvector(__builtin_convertvector(v, vq_i32), vline_f32);
}
#endif

/* rows i0 .. i0+3 of y = add + W x + bias, W int8 [n, m] with per-row scales s (bf16) */
static void matvec_rows_int8(int64_t B, int64_t n, int64_t m, int64_t i0, const int8_t *W, const uint16_t *s,
                             const float *bias, const float *x, const float *add, float *y) {
    const int64_t r = n - i0 < 4 ? n - i0 : 4;
#if defined(HAVE_VLINE)
    const int64_t mv = m & ~(int64_t)15;   /* the vector part; the rest scalar */
#else
    const int64_t mv = 0;
#endif
    for (int64_t b = 0; b < B; ++b) {
        const float *restrict xb = x + b * m;
        float acc[4] = {0, 0, 0, 0};
#if defined(HAVE_VLINE)
        if (r == 4) {
            const int8_t *w0 = W + i0 * m, *w1 = w0 + m, *w2 = w1 + m, *w3 = w2 + m;
            const char *pf = (const char *)w0 + MV_PF_BYTES, *pf_end = (const char *)(W + n * m) - 64;
            vline_f32 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t j = 0; j < mv; j += 16) {
                if (b == 0 && pf <= pf_end) {   /* one line ahead for the one (4 x 16 bytes) read */
                    __builtin_prefetch(pf, 0, 2);
                    pf += 64;
                }
                const vline_f32 xv = *(const vline_f32 *)(xb + j);
                a0 += i8_line(w0 + j) * xv; a1 += i8_line(w1 + j) * xv;
                a2 += i8_line(w2 + j) * xv; a3 += i8_line(w3 + j) * xv;
            }
            acc[0] = vsum_f32(a0); acc[1] = vsum_f32(a1); acc[2] = vsum_f32(a2); acc[3] = vsum_f32(a3);
        } else
            for (int64_t rr = 0; rr < r; ++rr) {
                const int8_t *w = W + (i0 + rr) * m;
                vline_f32 a = {0};
                for (int64_t j = 0; j < mv; j += 16) a += i8_line(w + j) * *(const vline_f32 *)(xb + j);
                acc[rr] = vsum_f32(a);
            }
#endif
        for (int64_t rr = 0; rr < r; ++rr) {
            const int8_t *w = W + (i0 + rr) * m;
            float a = 0;
            for (int64_t j = mv; j < m; ++j) a += (float)w[j] * xb[j];
            q_store_row(n, b, i0 + rr, (acc[rr] + a) * bf16_to_f32(s[i0 + rr]), bias, add, y);
        }
    }
}

/* int4: a row's products are summed per group in fp32, the sum multiplied by the group's scale and added to the row's
   accumulator: y_i = sum_g s[i, g] * (sum_{j in g} (c[i, j] - 8) x[j]). Every code minus 8 is an exact fp32 integer
   and the scale multiplies once per partial sum, so the result is the dequantized matrix's product up to the
   rounding of fp32 operations (depth <= m + 8, the same bound as a plain dot product).

   The vector paths read a row's bytes as 32-bit lanes, each holding 8 consecutive codes (lane k of a 64-byte load:
   inputs 8k .. 8k+7). Lane k's code 8k+s is its nibble s, which a shuffle selects after a right shift by 4s: 7 shifts
   and 8 single-instruction conversions per 128 codes, against 3 instructions per 32 codes when a byte is widened
   and its two nibbles split. The inputs are permuted once per call to match (x_perm[b + L s + k] = x[b + 8k + s]
   per block of 8L inputs, L lanes), the 4 rows of a step sharing their loads. A lane's 8 codes lie in one group
   (groups are 32 or 64 inputs), so a block's partial sums take their scales lane by lane. The next rows' bytes
   are prefetched Q4_PF_BYTES ahead (whole steps of 4 rows, at least 2), one line per row read: one stream at the
   pace of the four rows read (this product computes ~0.5 of the time its bytes take from memory; without the
   prefetch the two overlapped poorly: ~2.2x its bytes' floor instead of ~1.3x, a loaded 1-thread loop over 4096 x
   4096 matrices). A distance in bytes keeps short rows (1024 inputs: 2 KiB a step) as far ahead as long ones. */
#define Q4_PF_BYTES 16384

/* the scalar product of one row (every build; the vector paths' tail of < one block): inputs j0 .. m-1 */
static inline float int4_row_scalar(int64_t j0, int64_t m, int64_t group, const uint8_t *w, const uint16_t *sr,
                                    const float *x) {
    float a = 0;
    for (int64_t g = j0 / group; g < m / group; ++g) {
        float part = 0;
        for (int64_t j = g * group; j < (g + 1) * group; j += 2) {
            const uint8_t v = w[j / 2];
            part += (float)((int)(v & 15) - 8) * x[j];
            part += (float)((int)(v >> 4) - 8) * x[j + 1];
        }
        a += part * bf16_to_f32(sr[g]);
    }
    return a;
}

#if defined(__AVX512F__) && !defined(LINATTN_PLAIN_C)
#include <immintrin.h>
#define Q4_LANES 16
#if defined(__AVX512BW__)
/* the code in bits 16-19 of each lane (its nibble s + 4 after the shift that serves nibble s) as an fp32: a 16-bit
   permute writes the upper half of the lane from a table of the codes' upper halves (c - 8 is exact in them, the
   lower half zero), its index bit 4 (the next nibble's low bit) falling on the table's second, equal half. So 3
   shifts serve the 8 nibbles of a lane instead of 7. */
static const uint16_t Q4_UPPER_TABLE[32] = {
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80, 0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0,
    0x40C0, 0x40E0, 0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80, 0x0000, 0x3F80, 0x4000, 0x4040,
    0x4080, 0x40A0, 0x40C0, 0x40E0};
#define Q4_UPPER(d, codes) _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16( \
        0xAAAAAAAAu, d, _mm512_loadu_si512((const void *)Q4_UPPER_TABLE)))
#else
#define Q4_UPPER(d, codes) _mm512_permutexvar_ps(_mm512_srli_epi32(d, 16), codes)
#endif
/* R (1 or 4) rows r of W from w (stride mb bytes) and scales sr (stride ng) times the permuted x: out[r] */
static inline __attribute__((always_inline)) void int4_rows_vec(const int R, int64_t m, int64_t group,
                                                                const uint8_t *w, const uint16_t *sr,
                                                                const float *xp, const float *x, const uint8_t *pf,
                                                                int64_t pf_bytes, float *out) {
    const int64_t mb = m / 2, ng = m / group, mv = m & ~(int64_t)127;
    const __m512 codes = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    /* lane k's group within its block: k / 4 (group 32) or k / 8 (64), offset by the block's first group among
       the 16 scales converted at a time */
    const __m512i lane_group = group == 32 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                                           : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    __m512 acc[4], sc[4];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    int64_t line = 0;
    for (int64_t j = 0; j < mv; j += 128) {
        const int64_t g0 = j / group, k = g0 & 15;
        if (k == 0)
            for (int r = 0; r < R; ++r) {   /* the next 16 scales of row r in fp32 */
                uint16_t tmp[16] = {0};
                const uint16_t *src = sr + r * ng + g0;
                if (ng - g0 < 16) {
                    memcpy(tmp, src, (size_t)(ng - g0) * sizeof *tmp);
                    src = tmp;
                }
                const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src));
                sc[r] = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
            }
        const __m512i si = _mm512_add_epi32(lane_group, _mm512_set1_epi32((int)k));
        const float *xb = xp + j;
        const __m512 x0 = _mm512_load_ps(xb), x1 = _mm512_load_ps(xb + 16), x2 = _mm512_load_ps(xb + 32),
                     x3 = _mm512_load_ps(xb + 48), x4 = _mm512_load_ps(xb + 64), x5 = _mm512_load_ps(xb + 80),
                     x6 = _mm512_load_ps(xb + 96), x7 = _mm512_load_ps(xb + 112);
        for (int r = 0; r < R; ++r) {
            if (pf_bytes > 0) {   /* line `line` of the rows ahead, taken row by row */
                const int64_t off = (line & 3) * mb + (line >> 2) * 64;
                if (off < pf_bytes) _mm_prefetch((const char *)(pf + off), _MM_HINT_T1);
                ++line;
            }
            const __m512i d = _mm512_loadu_si512((const void *)(w + r * mb + j / 2));
            const __m512i d1 = _mm512_srli_epi32(d, 4), d2 = _mm512_srli_epi32(d, 8),
                          d3 = _mm512_srli_epi32(d, 12);
            __m512 part = _mm512_mul_ps(_mm512_permutexvar_ps(d, codes), x0);
            part = _mm512_fmadd_ps(_mm512_permutexvar_ps(d1, codes), x1, part);
            part = _mm512_fmadd_ps(_mm512_permutexvar_ps(d2, codes), x2, part);
            part = _mm512_fmadd_ps(_mm512_permutexvar_ps(d3, codes), x3, part);
            part = _mm512_fmadd_ps(Q4_UPPER(d, codes), x4, part);
            part = _mm512_fmadd_ps(Q4_UPPER(d1, codes), x5, part);
            part = _mm512_fmadd_ps(Q4_UPPER(d2, codes), x6, part);
            part = _mm512_fmadd_ps(Q4_UPPER(d3, codes), x7, part);
            acc[r] = _mm512_fmadd_ps(part, _mm512_permutexvar_ps(si, sc[r]), acc[r]);
        }
    }
    float sum[4];
    if (R == 4) {   /* the four rows' lanes summed together: a row's quarters, then a quarter's lanes */
        const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(acc[0], acc[1], 0x44),
                                        _mm512_shuffle_f32x4(acc[0], acc[1], 0xEE)),
                     u1 = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2], acc[3], 0x44),
                                        _mm512_shuffle_f32x4(acc[2], acc[3], 0xEE));
        __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xDD));
        v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4E));
        v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xB1));
        float t[16];
        _mm512_storeu_ps(t, v);
        for (int r = 0; r < 4; ++r) sum[r] = t[4 * r];
    } else
        for (int r = 0; r < R; ++r) sum[r] = _mm512_reduce_add_ps(acc[r]);
    for (int r = 0; r < R; ++r)
        out[r] = mv < m ? sum[r] + int4_row_scalar(mv, m, group, w + r * mb, sr + r * ng, x) : sum[r];
}
#elif defined(__AVX2__) && defined(__FMA__) && !defined(LINATTN_PLAIN_C)
#include <immintrin.h>
#define Q4_LANES 8
/* as the AVX-512 path on 8 lanes (blocks of 64 inputs); without a 16-entry shuffle a code c becomes c - 8 through
   the float whose bits are 0x4B000000 | c (2^23 + c, exact) minus 2^23 + 8 */
static inline __attribute__((always_inline)) void int4_rows_vec(const int R, int64_t m, int64_t group,
                                                                const uint8_t *w, const uint16_t *sr,
                                                                const float *xp, const float *x, const uint8_t *pf,
                                                                int64_t pf_bytes, float *out) {
    const int64_t mb = m / 2, ng = m / group, mv = m & ~(int64_t)63;
    const __m256i nib = _mm256_set1_epi32(15), magic = _mm256_set1_epi32(0x4B000000);
    const __m256 bias = _mm256_set1_ps(8388616.0f);
    __m256 acc[4];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    int64_t line = 0;
#define Q4_CODE(d, s) _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256( \
        _mm256_and_si256(_mm256_srli_epi32(d, 4 * (s)), nib), magic)), bias)
    for (int64_t j = 0; j < mv; j += 64) {
        const float *xb = xp + j;
        const __m256 x0 = _mm256_load_ps(xb), x1 = _mm256_load_ps(xb + 8), x2 = _mm256_load_ps(xb + 16),
                     x3 = _mm256_load_ps(xb + 24), x4 = _mm256_load_ps(xb + 32), x5 = _mm256_load_ps(xb + 40),
                     x6 = _mm256_load_ps(xb + 48), x7 = _mm256_load_ps(xb + 56);
        for (int r = 0; r < R; ++r) {
            if (pf_bytes > 0 && (j & 64)) {   /* a 32-byte read per row step: a line every other step */
                const int64_t off = (line & 3) * mb + (line >> 2) * 64;
                if (off < pf_bytes) _mm_prefetch((const char *)(pf + off), _MM_HINT_T1);
                ++line;
            }
            const __m256i d = _mm256_loadu_si256((const __m256i *)(w + r * mb + j / 2));
            __m256 part = _mm256_mul_ps(Q4_CODE(d, 0), x0);
            part = _mm256_fmadd_ps(Q4_CODE(d, 1), x1, part);
            part = _mm256_fmadd_ps(Q4_CODE(d, 2), x2, part);
            part = _mm256_fmadd_ps(Q4_CODE(d, 3), x3, part);
            part = _mm256_fmadd_ps(Q4_CODE(d, 4), x4, part);
            part = _mm256_fmadd_ps(Q4_CODE(d, 5), x5, part);
            part = _mm256_fmadd_ps(Q4_CODE(d, 6), x6, part);
            part = _mm256_fmadd_ps(Q4_CODE(d, 7), x7, part);
            const uint16_t *s = sr + r * ng + j / group;   /* lanes 0-3 and 4-7: one or two groups */
            const float sa = bf16_to_f32(s[0]), sb = group == 32 ? bf16_to_f32(s[1]) : sa;
            acc[r] = _mm256_fmadd_ps(part, _mm256_setr_ps(sa, sa, sa, sa, sb, sb, sb, sb), acc[r]);
        }
    }
#undef Q4_CODE
    for (int r = 0; r < R; ++r) {
        float t[8];
        _mm256_storeu_ps(t, acc[r]);
        for (int h = 4; h >= 1; h /= 2)
            for (int q = 0; q < h; ++q) t[q] += t[q + h];
        out[r] = t[0] + int4_row_scalar(mv, m, group, w + r * mb, sr + r * ng, x);
    }
}
#endif

/* rows i0 .. i0+3 of y = add + W x + bias, W int4 [n, m] (m / 2 bytes a row) with scales s [n, m / group] (bf16);
   xp: x permuted per block (Q4_LANES), NULL for the scalar path */
static void matvec_rows_int4(int64_t B, int64_t n, int64_t m, int64_t group, int64_t i0, const uint8_t *W,
                             const uint16_t *s, const float *bias, const float *x, const float *xp,
                             const float *add, float *y) {
    const int64_t r = n - i0 < 4 ? n - i0 : 4, mb = m / 2, ng = m / group;
    for (int64_t b = 0; b < B; ++b) {
        const float *xb = x + b * m;
        float out[4];
#if defined(Q4_LANES)
        if (xp) {
            /* the rows Q4_PF_BYTES on (pf_bytes of them in W), prefetched while the first x row is read */
            const int64_t steps = (Q4_PF_BYTES + 4 * mb - 1) / (4 * mb), ahead = i0 + 4 * (steps < 2 ? 2 : steps),
                          pf_bytes = b == 0 && ahead < n ? (n - ahead) * mb : 0;
            const uint8_t *pf = pf_bytes ? W + ahead * mb : W;
            if (r == 4)
                int4_rows_vec(4, m, group, W + i0 * mb, s + i0 * ng, xp + b * m, xb, pf, pf_bytes, out);
            else
                for (int64_t rr = 0; rr < r; ++rr)
                    int4_rows_vec(1, m, group, W + (i0 + rr) * mb, s + (i0 + rr) * ng, xp + b * m, xb, pf, 0,
                                  out + rr);
        } else
#endif
            for (int64_t rr = 0; rr < r; ++rr)
                out[rr] = int4_row_scalar(0, m, group, W + (i0 + rr) * mb, s + (i0 + rr) * ng, xb);
        for (int64_t rr = 0; rr < r; ++rr) q_store_row(n, b, i0 + rr, out[rr], bias, add, y);
    }
}

static void matvec_int8(int64_t B, int64_t n, int64_t m, const int8_t *W, const uint16_t *s, const float *bias,
                        const float *x, const float *add, float *y, int nthreads) {
    if (nthreads > 1 && n * m >= 2 * PAR_MIN_ELEMS) {   /* (the threshold in bytes of fp32 weights) */
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)")
        for (int64_t i0 = 0; i0 < n; i0 += 4) matvec_rows_int8(B, n, m, i0, W, s, bias, x, add, y);
    } else
        for (int64_t i0 = 0; i0 < n; i0 += 4) matvec_rows_int8(B, n, m, i0, W, s, bias, x, add, y);
}

static void matvec_int4(int64_t B, int64_t n, int64_t m, int64_t group, const uint8_t *W, const uint16_t *s,
                        const float *bias, const float *x, const float *add, float *y, int nthreads) {
    float *xp = NULL;
#if defined(Q4_LANES)
    /* x permuted for the vector paths (no memory: the scalar path) */
    const int64_t blk = 8 * Q4_LANES, mv = m - m % blk;
    if (mv > 0 && (xp = aligned_alloc(64, (size_t)((B * m * sizeof(float) + 63) & ~(size_t)63))) != NULL)
        for (int64_t b = 0; b < B; ++b)
            for (int64_t j = 0; j < mv; j += blk)
                for (int sh = 0; sh < 8; ++sh)
                    for (int k = 0; k < Q4_LANES; ++k) xp[b * m + j + Q4_LANES * sh + k] = x[b * m + j + 8 * k + sh];
#endif
    if (nthreads > 1 && n * m >= 4 * PAR_MIN_ELEMS) {
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)")
        for (int64_t i0 = 0; i0 < n; i0 += 4) matvec_rows_int4(B, n, m, group, i0, W, s, bias, x, xp, add, y);
    } else
        for (int64_t i0 = 0; i0 < n; i0 += 4) matvec_rows_int4(B, n, m, group, i0, W, s, bias, x, xp, add, y);
    free(xp);
}

/* y [B, n] = add + W x + bias for x [B, m], W [n, m] in format fmt (WF_*; scales and group for the integer ones):
   every weight matrix of an f32 plan goes through here */
static void matvec_w_f32(int fmt, const void *W, const void *scales, int64_t group, int64_t B, int64_t n,
                         int64_t m, const float *bias, const float *x, const float *add, float *y, int nthreads) {
    switch (fmt) {
    case WF_BF16: matvec_bf16(B, n, m, (const uint16_t *)W, bias, x, add, y, nthreads); break;
    case WF_INT8: matvec_int8(B, n, m, (const int8_t *)W, (const uint16_t *)scales, bias, x, add, y, nthreads); break;
    case WF_INT4:
        matvec_int4(B, n, m, group, (const uint8_t *)W, (const uint16_t *)scales, bias, x, add, y, nthreads);
        break;
    default: matvec_f32(B, n, m, (const float *)W, bias, x, add, y, nthreads); break;
    }
}

#endif
