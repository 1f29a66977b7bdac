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
   operations.

   The row schedule (every integer product): a step reads four rows i, i + q, i + 2q, i + 3q (q = Q_QUARTER(n),
   rowsched.h: about n / 4), sharing its loads of x, so the four rows are four sequential streams, each through its
   own quarter of the matrix, and each stream's line Q_PF_BYTES ahead is prefetched as its line is read; then (from
   n = 8) one step of the four neighbouring rows 4q .. 4q + 3, and the n % 4 last rows one at a time. Four
   neighbouring rows (the fp32 / bf16 products' schedule) share a 4 KiB page when rows are short (int4 rows of 1024
   inputs: 512 bytes), and the hardware prefetcher, which follows about one stream per page, then leaves the reads
   to the software prefetches alone, whose fill buffers cap one core near 8-11 GB/s: those products read at 0.6-0.8
   of the read pass's rate. Each row's arithmetic is what it was (the same bits). */
#ifndef LINATTN_QMATVEC_H
#define LINATTN_QMATVEC_H

#define WF_PLAN 0
#define WF_BF16 1
#define WF_INT8 2
#define WF_INT4 3
#define WF_INT8_A8 4   /* WF_INT8 / WF_INT4 weights times x rounded to int8 per block of 32 inputs (below) */
#define WF_INT4_A8 5
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

#include "rowsched.h"   /* the row schedule: q_step_rows, Q_STEPS, Q_FOR_STEPS, the stream prefetch Q_PF */

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
#if defined(LINE_YMM)
static inline __m256 i8_ymm(const int8_t *w);
#endif
static inline vline_f32 i8_line(const int8_t *w) {
#if defined(LINE_YMM)
    return vline_of(i8_ymm(w), i8_ymm(w + 8));
#else
    vq_i8 v;
    Q_LOAD16(v, w);
    return __builtin_convertvector(__builtin_convertvector(v, vq_i32), vline_f32);
#endif
}
#if defined(LINE_YMM)
/* 8 int8 weights widened to fp32 (decode.c's LINE_YMM: AVX2 without AVX-512) */
static inline __m256 i8_ymm(const int8_t *w) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)w)));
}
#endif
#endif

/* the r rows i0, i0 + stride, ... (q_step_rows) of y = add + W x + bias, W int8 [n, m] with per-row scales s (bf16) */
static void matvec_rows_int8(int64_t B, int64_t n, int64_t m, int64_t i0, int64_t stride, int r, const int8_t *W,
                             const uint16_t *s, const float *bias, const float *x, const float *add, float *y) {
    int64_t row[4];
    for (int k = 0; k < r; ++k) row[k] = i0 + k * stride;
#if defined(HAVE_VLINE)
    const int64_t mv = m & ~(int64_t)15;   /* the vector part; the rest scalar */
    const uint8_t *end = (const uint8_t *)(W + n * m);
#else
    const int64_t mv = 0;
#endif
    for (int64_t b = 0; b < B; ++b) {
        const float *restrict xb = x + b * m;
        float acc[4] = {0, 0, 0, 0};
#if defined(HAVE_VLINE)
        if (r == 4) {
            const int8_t *w0 = W + row[0] * m, *w1 = W + row[1] * m, *w2 = W + row[2] * m, *w3 = W + row[3] * m;
            vline_f32 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
#if defined(LINE_YMM)
            YMM_ROWS4(i8_ymm, mv, 63, Q_PF(w0 + j, end); Q_PF(w1 + j, end); Q_PF(w2 + j, end);
                                      Q_PF(w3 + j, end));   /* (a line of each stream per 4 steps) */
#else
            for (int64_t j = 0; j < mv; j += 16) {
                if (b == 0 && (j & 63) == 0) {   /* a line of each stream per 4 steps */
                    Q_PF(w0 + j, end); Q_PF(w1 + j, end);
                    Q_PF(w2 + j, end); Q_PF(w3 + j, end);
                }
                const vline_f32 xv = *(const vline_f32 *)(xb + j);
                a0 += i8_line(w0 + j) * xv; a1 += i8_line(w1 + j) * xv;
                a2 += i8_line(w2 + j) * xv; a3 += i8_line(w3 + j) * xv;
            }
#endif
            acc[0] = vsum_f32(a0); acc[1] = vsum_f32(a1); acc[2] = vsum_f32(a2); acc[3] = vsum_f32(a3);
        } else
            for (int k = 0; k < r; ++k) {
                const int8_t *w = W + row[k] * m;
                vline_f32 a = {0};
                for (int64_t j = 0; j < mv; j += 16) a += i8_line(w + j) * *(const vline_f32 *)(xb + j);
                acc[k] = vsum_f32(a);
            }
#endif
        for (int k = 0; k < r; ++k) {
            const int8_t *w = W + row[k] * m;
            float a = 0;
            for (int64_t j = mv; j < m; ++j) a += (float)w[j] * xb[j];
            q_store_row(n, b, row[k], (acc[k] + a) * bf16_to_f32(s[row[k]]), bias, add, y);
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
   (groups are 32 or 64 inputs), so a block's partial sums take their scales lane by lane. */

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
/* the next 16 group scales of a row (bf16 bits, `left` of them remaining: the others read as 0) in fp32 */
static inline __m512 q4_scales16(const uint16_t *s, int64_t left) {
    uint16_t tmp[16] = {0};
    if (left < 16) {
        memcpy(tmp, s, (size_t)left * sizeof *tmp);
        s = tmp;
    }
    const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)s));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}
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
/* R (1 or 4) rows r of W from w + r ws (bytes) and scales sr + r ss times the permuted x: out[r]; each row's line
   Q_PF_BYTES ahead prefetched unless past pf_end (NULL: none) */
static inline __attribute__((always_inline)) void int4_rows_vec(const int R, int64_t m, int64_t group,
                                                                const uint8_t *w, int64_t ws, const uint16_t *sr,
                                                                int64_t ss, const float *xp, const float *x,
                                                                const uint8_t *pf_end, float *out) {
    const int64_t ng = m / group, mv = m & ~(int64_t)127, gsh = group == 32 ? 5 : 6;
    const __m512 codes = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    /* lane k's group within its block: k / 4 (group 32) or k / 8 (64), offset by the block's first group among
       the 16 scales converted at a time */
    const __m512i lane_group = group == 32 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                                           : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    __m512 acc[4], sc[4];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t j = 0; j < mv; j += 128) {
        const int64_t g0 = j >> gsh, k = g0 & 15;
        if (k == 0)
            for (int r = 0; r < R; ++r) sc[r] = q4_scales16(sr + r * ss + g0, ng - g0);   /* row r's next 16 */
        const __m512i si = _mm512_add_epi32(lane_group, _mm512_set1_epi32((int)k));
        const float *xb = xp + j;
        const __m512 x0 = _mm512_load_ps(xb), x1 = _mm512_load_ps(xb + 16), x2 = _mm512_load_ps(xb + 32),
                     x3 = _mm512_load_ps(xb + 48), x4 = _mm512_load_ps(xb + 64), x5 = _mm512_load_ps(xb + 80),
                     x6 = _mm512_load_ps(xb + 96), x7 = _mm512_load_ps(xb + 112);
        for (int r = 0; r < R; ++r) {
            const uint8_t *wr = w + r * ws + j / 2;
            if (pf_end) Q_PF(wr, pf_end);
            const __m512i d = _mm512_loadu_si512((const void *)wr);
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
        out[r] = mv < m ? sum[r] + int4_row_scalar(mv, m, group, w + r * ws, sr + r * ss, x) : sum[r];
}
#elif defined(__AVX2__) && defined(__FMA__) && !defined(LINATTN_PLAIN_C)
#include <immintrin.h>
#define Q4_LANES 8
/* as the AVX-512 path on 8 lanes (blocks of 64 inputs); without a 16-entry shuffle a code c becomes c - 8 through
   the float whose bits are 0x4B000000 | c (2^23 + c, exact) minus 2^23 + 8 */
static inline __attribute__((always_inline)) void int4_rows_vec(const int R, int64_t m, int64_t group,
                                                                const uint8_t *w, int64_t ws, const uint16_t *sr,
                                                                int64_t ss, const float *xp, const float *x,
                                                                const uint8_t *pf_end, float *out) {
    const int64_t mv = m & ~(int64_t)63, gsh = group == 32 ? 5 : 6;
    const __m256i nib = _mm256_set1_epi32(15), magic = _mm256_set1_epi32(0x4B000000);
    const __m256 bias = _mm256_set1_ps(8388616.0f);
    __m256 acc[4];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
#define Q4_CODE(d, s) _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256( \
        _mm256_and_si256(_mm256_srli_epi32(d, 4 * (s)), nib), magic)), bias)
    for (int64_t j = 0; j < mv; j += 64) {
        const float *xb = xp + j;
        const __m256 x0 = _mm256_load_ps(xb), x1 = _mm256_load_ps(xb + 8), x2 = _mm256_load_ps(xb + 16),
                     x3 = _mm256_load_ps(xb + 24), x4 = _mm256_load_ps(xb + 32), x5 = _mm256_load_ps(xb + 40),
                     x6 = _mm256_load_ps(xb + 48), x7 = _mm256_load_ps(xb + 56);
        for (int r = 0; r < R; ++r) {
            const uint8_t *wr = w + r * ws + j / 2;
            if (pf_end && (j & 64)) Q_PF(wr, pf_end);   /* 32 bytes a step: a line every other step */
            const __m256i d = _mm256_loadu_si256((const __m256i *)wr);
            __m256 part = _mm256_mul_ps(Q4_CODE(d, 0), x0);
            part = _mm256_fmadd_ps(Q4_CODE(d, 1), x1, part);
            part = _mm256_fmadd_ps(Q4_CODE(d, 2), x2, part);
            part = _mm256_fmadd_ps(Q4_CODE(d, 3), x3, part);
            part = _mm256_fmadd_ps(Q4_CODE(d, 4), x4, part);
            part = _mm256_fmadd_ps(Q4_CODE(d, 5), x5, part);
            part = _mm256_fmadd_ps(Q4_CODE(d, 6), x6, part);
            part = _mm256_fmadd_ps(Q4_CODE(d, 7), x7, part);
            const uint16_t *s = sr + r * ss + (j >> gsh);   /* lanes 0-3 and 4-7: one or two groups */
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
        out[r] = t[0] + int4_row_scalar(mv, m, group, w + r * ws, sr + r * ss, x);
    }
}
#endif

/* the r rows i0, i0 + stride, ... (q_step_rows) of y = add + W x + bias, W int4 [n, m] (m / 2 bytes a row) with
   scales s [n, m / group] (bf16); xp: x permuted per block (Q4_LANES), NULL for the scalar path */
static void matvec_rows_int4(int64_t B, int64_t n, int64_t m, int64_t group, int64_t i0, int64_t stride, int r,
                             const uint8_t *W, const uint16_t *s, const float *bias, const float *x, const float *xp,
                             const float *add, float *y) {
    const int64_t mb = m / 2, ng = m / group;
    for (int64_t b = 0; b < B; ++b) {
        const float *xb = x + b * m;
        float out[4];
#if defined(Q4_LANES)
        if (xp) {
            const uint8_t *pf_end = b == 0 ? W + n * mb : NULL;   /* (later x rows find the rows in cache) */
            if (r == 4)
                int4_rows_vec(4, m, group, W + i0 * mb, stride * mb, s + i0 * ng, stride * ng, xp + b * m, xb,
                              pf_end, out);
            else
                int4_rows_vec(1, m, group, W + i0 * mb, 0, s + i0 * ng, 0, xp + b * m, xb, pf_end, out);
        } else
#endif
            for (int k = 0; k < r; ++k)
                out[k] = int4_row_scalar(0, m, group, W + (i0 + k * stride) * mb, s + (i0 + k * stride) * ng, xb);
        for (int k = 0; k < r; ++k) q_store_row(n, b, i0 + k * stride, out[k], bias, add, y);
    }
}

static void matvec_int8(int64_t B, int64_t n, int64_t m, const int8_t *W, const uint16_t *s, const float *bias,
                        const float *x, const float *add, float *y, int nthreads) {
    const int par = nthreads > 1 && n * m >= 2 * PAR_MIN_ELEMS;   /* (the threshold in bytes of fp32 weights) */
    q_prefetch_starts(n, m, W, par ? nthreads : 1);
    Q_FOR_STEPS(n, par, matvec_rows_int8(B, n, m, i0, stride, r, W, s, bias, x, add, y));
}

static void matvec_int4(int64_t B, int64_t n, int64_t m, int64_t group, const uint8_t *W, const uint16_t *s,
                        const float *bias, const float *x, const float *add, float *y, int nthreads) {
    const int par = nthreads > 1 && n * m >= 4 * PAR_MIN_ELEMS;
    q_prefetch_starts(n, m / 2, W, par ? nthreads : 1);   /* (before the permutation of x) */
    q_prefetch_starts(n, 2 * (m / group), s, par ? nthreads : 1);
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
    Q_FOR_STEPS(n, par,
                matvec_rows_int4(B, n, m, group, i0, stride, r, W, s, bias, x, xp, add, y));
    free(xp);
}

/* ---- int8 activations (WF_INT8_A8, WF_INT4_A8): the opt-in products of quantize(..., activations="int8") ----

   x is rounded once per call, per block of A8_BLOCK consecutive inputs (the last block of a row may be shorter):
   s_b = max_{j in b} |x_j| / 127 (fp32, raised by ulps until s_b * 127 >= the max), q_j = round(x_j / s_b) in
   [-127, 127] (nearest, ties to even), so |x_j - q_j s_b| <= s_b / 2. The weights stay exact: a block's products
   q_w q_j are summed as integers (exact: |sum| < 2^19), and the sum times s_b (and the weight's scale) enters an fp32
   accumulator. So y = sum_j w_j x^_j with x^_j = q_j s_b up to fp32 rounding, and
       |y - W x| <= sum_b (s_b / 2) sum_{j in b} |w_j|  +  gamma_{m+8} sum_j |w_j| |x^_j|
   (tests/cpu/test_qmatvec_a8.py asserts both parts against fp64). A partial sum is scaled before it is added
   (the integer sum times s_b, then times the weight scale: neither product underflows for x as small as 1e-38),
   so |x| above ~6e35 overflows a 4-input partial, as in the exact products. A NaN or inf anywhere in x sends the
   whole call to the exact product (whose NaN / inf pattern it then has).

   Paths: AVX-512 VNNI and AVX-VNNI (`vpdpbusd` on 64 / 32 bytes: unsigned bytes times signed bytes, 4 at a time
   into int32 lanes), AVX2 without VNNI (`vpmaddubsw` + `vpmaddwd`), plain C. The unsigned operand is the weights':
   int4 codes c = q + 8 are already in [1, 15], int8 weights become w + 128 by one xor (VNNI); the excess 8 (or 128)
   times the lane's sum of x's integers, negated in a table made once per call, is the value `vpdpbusd` starts its
   lanes from, so the lanes come out corrected (exact in int32) without a subtraction per row. AVX2's `vpmaddubsw`
   saturates 16-bit pair sums, which int8 weights + 128 would reach: there x's magnitudes are the unsigned operand
   and the weights take x's sign (`vpsignb`), exact. */
#include <float.h>
#define A8_BLOCK 32
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && !defined(LINATTN_PLAIN_C)
#include <immintrin.h>
#define A8_I8_COLS 64    /* int8 weights: inputs per vector step (one 64-byte load per row) */
#define A8_I4_COLS 64    /* int4: inputs per vector step (32 bytes of codes per row: the 256-bit steps, as AVX2's) */
#define A8_VNNI 1
#define A8_DP256 _mm256_dpbusd_epi32   /* (the int4 steps' 256-bit vpdpbusd: AVX-512 VNNI's VL form) */
#elif defined(__AVX2__) && !defined(LINATTN_PLAIN_C)
#include <immintrin.h>
#define A8_I8_COLS 32
#define A8_I4_COLS 64
#if defined(__AVXVNNI__)
#define A8_VNNI 1        /* `vpdpbusd` on ymm (AVX-VNNI): int8 weights + 128 as on AVX-512, no |x| table */
#define A8_DP256 _mm256_dpbusd_avx_epi32
#endif
#endif

/* x rounded per block, with the vector paths' tables (every array [B, ...], row b at b * its row length) */
typedef struct {
    int64_t m, nb, mv, nl;   /* inputs, blocks, inputs on the vector path, lanes on it (mv / lane width) */
    int8_t *q;               /* [B, m] x's integers */
    float *s;                /* [B, nb] the blocks' scales */
    int8_t *v;               /* [B, mv] int4: per step of A8_I4_COLS inputs its even inputs' integers, then its odd
                                ones' (the low and high nibbles of the step's bytes); int8 on AVX2 without VNNI: |q| */
    float *ls;               /* [B, nl] the scale of each lane's block */
    int32_t *lc;             /* [B, nl] minus the excess per lane: -8 (int4) or -128 (int8, VNNI) x its sum of q */
    void *mem;
    int32_t *bc;             /* [B, nl] int4, AVX2 without VNNI: minus the excess of each lane's block (its 4 lanes' lc
                                summed) */
} a8_x;

/* x's block x[j0 .. e-1] (e - j0 <= A8_BLOCK) rounded into q[j0 .. e-1], its scale returned in *s; 0 when it holds a
   NaN or inf */
static inline int a8_round_block(int64_t j0, int64_t e, const float *x, int8_t *q, float *s) {
    float mx = 0;
    for (int64_t j = j0; j < e; ++j) {
        const float a = fabsf(x[j]);
        if (!(a <= FLT_MAX)) return 0;
        mx = a > mx ? a : mx;
    }
    float sc = mx / 127.0f;
    while (sc * 127.0f < mx) sc = nextafterf(sc, INFINITY);   /* (a max near fp32's smallest values) */
    *s = sc;
    for (int64_t j = j0; j < e; ++j) {
        const float r = sc > 0 ? nearbyintf(x[j] / sc) : 0.0f;
        q[j] = (int8_t)(r > 127.0f ? 127 : r < -127.0f ? -127 : r);
    }
    return 1;
}

/* x's row (m inputs) rounded per block into q and s; 0 when it holds a NaN or inf. With AVX-512 a whole block's
   32 inputs at once, the same operations as a8_round_block (the max is exact, the division is IEEE's, the rounding
   the current mode's as nearbyintf's): the same integers and scales. */
static int a8_round_row(int64_t m, const float *x, int8_t *q, float *s) {
    int64_t j0 = 0, b = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && !defined(LINATTN_PLAIN_C)
    const __m512 fmax = _mm512_set1_ps(FLT_MAX), lim = _mm512_set1_ps(127.0f), nlim = _mm512_set1_ps(-127.0f);
    for (; j0 + A8_BLOCK <= m; j0 += A8_BLOCK, ++b) {
        const __m512 v0 = _mm512_loadu_ps(x + j0), v1 = _mm512_loadu_ps(x + j0 + 16);
        const __m512 a0 = _mm512_abs_ps(v0), a1 = _mm512_abs_ps(v1);
        if ((__mmask16)(_mm512_cmp_ps_mask(a0, fmax, _CMP_LE_OQ) & _mm512_cmp_ps_mask(a1, fmax, _CMP_LE_OQ)) !=
            (__mmask16)0xFFFF)
            return 0;
        const float mx = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
        float sc = mx / 127.0f;
        while (sc * 127.0f < mx) sc = nextafterf(sc, INFINITY);
        s[b] = sc;
        if (!(sc > 0)) {
            memset(q + j0, 0, A8_BLOCK);
            continue;
        }
        const __m512 sv = _mm512_set1_ps(sc);
        const int rnd = _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC;
        const __m512 r0 = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_div_ps(v0, sv), rnd), nlim), lim),
                     r1 = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_div_ps(v1, sv), rnd), nlim), lim);
        _mm_storeu_si128((__m128i *)(void *)(q + j0), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r0)));
        _mm_storeu_si128((__m128i *)(void *)(q + j0 + 16), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r1)));
    }
#elif defined(__AVX2__) && !defined(LINATTN_PLAIN_C)
    /* AVX2: the same operations 8 at a time (the scalar loop's division and nearbyintf per input were ~7 us of
       every call at 1024 inputs, more than a 256-row product's arithmetic) */
    const __m256 fmax = _mm256_set1_ps(FLT_MAX), lim = _mm256_set1_ps(127.0f), nlim = _mm256_set1_ps(-127.0f),
                 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (; j0 + A8_BLOCK <= m; j0 += A8_BLOCK, ++b) {
        __m256 v[4], mxv = _mm256_setzero_ps();
        int finite = 0xFF;
        for (int k = 0; k < 4; ++k) {
            v[k] = _mm256_loadu_ps(x + j0 + 8 * k);
            const __m256 a = _mm256_and_ps(v[k], absm);
            finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, fmax, _CMP_LE_OQ));
            mxv = _mm256_max_ps(mxv, a);
        }
        if (finite != 0xFF) return 0;
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mxv), _mm256_extractf128_ps(mxv, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        const float mx = _mm_cvtss_f32(h);
        float sc = mx / 127.0f;
        while (sc * 127.0f < mx) sc = nextafterf(sc, INFINITY);
        s[b] = sc;
        if (!(sc > 0)) {
            memset(q + j0, 0, A8_BLOCK);
            continue;
        }
        const __m256 sv = _mm256_set1_ps(sc);
        __m256i r[4];
        for (int k = 0; k < 4; ++k)
            r[k] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(
                _mm256_round_ps(_mm256_div_ps(v[k], sv), _MM_FROUND_CUR_DIRECTION), nlim), lim));
        /* in [-127, 127]: the saturating packs are exact; they interleave 128-bit halves, which `order` undoes */
        const __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
        _mm256_storeu_si256((__m256i *)(void *)(q + j0), _mm256_permutevar8x32_epi32(p8, order));
    }
#endif
    for (; j0 < m; j0 += A8_BLOCK, ++b)
        if (!a8_round_block(j0, j0 + A8_BLOCK < m ? j0 + A8_BLOCK : m, x, q, s + b)) return 0;
    return 1;
}

/* x [B, m] rounded (the tables for int4 weights when int4); 0 (nothing allocated) on a NaN / inf or no memory */
static int a8_prepare(int int4, int64_t B, int64_t m, const float *x, a8_x *p) {
    const int64_t lw = int4 ? 8 : 4;   /* inputs per int32 lane */
#if defined(A8_I8_COLS)
    const int64_t cols = int4 ? A8_I4_COLS : A8_I8_COLS;
#else
    const int64_t cols = m + 1;
#endif
    p->m = m, p->nb = (m + A8_BLOCK - 1) / A8_BLOCK, p->mv = m - m % cols, p->nl = p->mv / lw;
    const size_t nq = (size_t)((B * m + 63) & ~(int64_t)63), nv = (size_t)((B * p->mv + 63) & ~(int64_t)63),
                 ns = (size_t)B * (size_t)(p->nb + 3 * p->nl) * 4;
    if (!(p->mem = aligned_alloc(64, (nq + nv + ns + 63) & ~(size_t)63))) return 0;
    p->q = (int8_t *)p->mem, p->v = p->q + nq, p->s = (float *)(void *)(p->v + nv), p->ls = p->s + B * p->nb;
    p->lc = (int32_t *)(void *)(p->ls + B * p->nl), p->bc = p->lc + B * p->nl;
    for (int64_t b = 0; b < B; ++b) {
        int8_t *q = p->q + b * m, *v = p->v + b * p->mv;
        const float *s = p->s + b * p->nb;
        if (!a8_round_row(m, x + b * m, q, p->s + b * p->nb)) {
            free(p->mem);
            return 0;
        }
        float *ls = p->ls + b * p->nl;
        int32_t *lc = p->lc + b * p->nl;
        for (int64_t l = 0; l < p->nl; ++l) ls[l] = s[l * lw / A8_BLOCK];
        /* the excess table (a lane's lw inputs summed; lw a constant in each loop, so that they vectorise): int4's
           paths and VNNI's read it, AVX2's int8 product without VNNI does not */
        if (int4) {
            for (int64_t l = 0; l < p->nl; ++l) {
                int32_t sum = 0;
                for (int64_t j = 0; j < 8; ++j) sum += q[8 * l + j];
                lc[l] = -8 * sum;
            }
#if defined(A8_I8_COLS) && !defined(A8_VNNI)
            /* the blocks' excess, which only AVX2's int4 step without VNNI reads (its lanes are whole blocks: mv
               is a multiple of 64) */
            for (int64_t l = 0; l < p->nl; ++l) {
                const int64_t l0 = l & ~(int64_t)3;
                p->bc[b * p->nl + l] = lc[l0] + lc[l0 + 1] + lc[l0 + 2] + lc[l0 + 3];
            }
#endif
        }
#if defined(A8_VNNI) || !defined(A8_I8_COLS)
        else
            for (int64_t l = 0; l < p->nl; ++l) {
                int32_t sum = 0;
                for (int64_t j = 0; j < 4; ++j) sum += q[4 * l + j];
                lc[l] = -128 * sum;
            }
#endif
        if (int4)
            for (int64_t j = 0; j < p->mv; j += cols)
                for (int64_t k = 0; k < cols / 2; ++k) v[j + k] = q[j + 2 * k], v[j + cols / 2 + k] = q[j + 2 * k + 1];
#if !defined(A8_VNNI)
        else
            for (int64_t j = 0; j < p->mv; ++j) v[j] = (int8_t)abs(q[j]);   /* (q >= -127) */
#endif
    }
    return 1;
}

/* one row's product over inputs j0 .. m-1 (block-aligned) in plain C: the int8 / int4 weights' rows */
static inline float a8_int8_row_scalar(int64_t j0, int64_t m, const int8_t *w, float ws, const int8_t *q,
                                       const float *s) {
    float a = 0;
    for (int64_t b0 = j0; b0 < m; b0 += A8_BLOCK) {
        const int64_t e = b0 + A8_BLOCK < m ? b0 + A8_BLOCK : m;
        int32_t si = 0;
        for (int64_t j = b0; j < e; ++j) si += (int32_t)w[j] * q[j];
        a += (float)((double)si * ((double)s[b0 / A8_BLOCK] * ws));   /* exact in double, one rounding */
    }
    return a;
}
static inline float a8_int4_row_scalar(int64_t j0, int64_t m, int64_t group, const uint8_t *w, const uint16_t *sr,
                                       int64_t gs, const int8_t *q, const float *s) {
    float a = 0;
    for (int64_t b0 = j0; b0 < m; b0 += A8_BLOCK) {   /* (m is a multiple of the group, 32 or 64) */
        int32_t si = 0;
        for (int64_t j = b0; j < b0 + A8_BLOCK; j += 2) {
            const uint8_t c = w[j / 2];
            si += ((int32_t)(c & 15) - 8) * q[j] + ((int32_t)(c >> 4) - 8) * q[j + 1];
        }
        a += (float)((double)si * ((double)s[b0 / A8_BLOCK] * bf16_to_f32(sr[b0 / group * gs])));
    }
    return a;
}

/* b's row of the rounded x times one row of int8 weights (scale ws) or int4 weights (group scales sr, gs apart:
   a8_step_scales), inputs j0 .. m-1 in plain C: the vector paths' tail, and every row without them */
static inline float a8_row_scalar(int int4, const a8_x *p, int64_t b, int64_t j0, int64_t group, const uint8_t *w,
                                  const uint16_t *sr, int64_t gs, float ws) {
    const int8_t *q = p->q + b * p->m;
    const float *s = p->s + b * p->nb;
    return int4 ? a8_int4_row_scalar(j0, p->m, group, w, sr, gs, q, s)
                : a8_int8_row_scalar(j0, p->m, (const int8_t *)w, ws, q, s);
}

/* The vector paths: a8_rows_vec(int4, R, ...) is R (1 or 4) rows, row r's bytes at w + r rs, of int8 weights (int4 0;
   scales ws[r]) or int4 weights (int4 1; group scales sr + r ss) times b's row of the rounded x: out[r]. Each row's
   line Q_PF_BYTES ahead is prefetched unless past pf_end (NULL: none). A step reads 32 bytes of each row: int4 codes
   whose low nibbles meet the step's even inputs and high nibbles its odd ones (a8_x.v), on AVX2 and AVX-512 alike;
   int8 weights, 64 bytes a step with AVX-512, 32 with AVX2. int4 / R are constants at every call (always inlined). */
#if defined(A8_I8_COLS)   /* int4 weights: the 256-bit steps, with AVX-512 VNNI too (round 21f) */
/* the next 8 group scales of a row (bf16 bits, `left` of them remaining: the others read as 0) in fp32 */
static inline __m256 q4_scales8(const uint16_t *s, int64_t left) {
    uint16_t tmp[8] = {0};
    if (left < 8) {
        memcpy(tmp, s, (size_t)left * sizeof *tmp);
        s = tmp;
    }
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(const void *)s));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
/* AVX2, int4 weights: a step's 64 inputs are two of x's blocks (bytes 0-15 of a row's 32 and 16-31), one scale each,
   and each lies in one group (32 or 64 inputs), so a block's 32 products are summed as integers, exactly, before any
   float step: the row's and / shift / and, two `vpmaddubsw` (pair sums of codes <= 15 times |q| <= 127: |.| <= 3810,
   no saturation) and `vpaddw` give 16-bit lanes of 4 products each (|.| <= 7620); for 4 rows two rounds of `vphaddw`
   (three of them; it wraps, but sums of 8 and 16 products stay within 15240 and 30480) and one `vpmaddwd` with ones
   leave [r0 r1 r2 r3 | r0 r1 r2 r3] of the two blocks as int32, from which the blocks' excess (a8_x.bc) is taken
   once. Then one conversion, one product with the blocks' x scales and one fma with the four rows' group scales
   (stored in the step's order: a8_step_scales) into one accumulator for the four rows: the block's integer sum times
   s_b, then times the weight scale, as the bound above says (x's scale first: no underflow for tiny x). Callgrind:
   49.5 instructions a step of 4 rows (36 vector) against 83 (59) when each row's 8 lanes were scaled apart. (Round
   11: the steps' loop computed each step's addresses from its input index, ~15 more a step; the loop now advances
   pointers, a8_i4_rows, 16.6 -> 13.7 instructions per 64 weights at 1024 x 3584, 19.8 -> 16.2 at the 530M model's
   1024-input rows; round 14: one index for every array, the format's constants in the steps' loop, 13.7 -> 13.0 and
   16.2 -> 14.3.) With AVX-VNNI `vpdpbusd` makes each row's 8 lanes (started from a8_x.lc) and `vphaddd` sums them:
   the same integers. One row (R = 1, the n % 4 last) sums its lanes to [r x4 | r x4] by `vphaddd` and takes the same
   float steps on the same values, and a row's two lanes (its blocks at even and odd 32-input offsets) are added
   last: the same bits as in a step of four rows. */
/* one row's 32 bytes at wr times the step's x (x0: the low nibbles' inputs, x1: the high ones'): VNNI, 8 lanes of 8
   products started from the lanes' excess (corr: a8_x.lc); otherwise 16 lanes of 4 products (16-bit) */
static inline __attribute__((always_inline)) __m256i a8_i4_dot(__m256i lo, __m256i hi, __m256i x0, __m256i x1,
                                                               __m256i corr) {
#if defined(A8_VNNI)
    return A8_DP256(A8_DP256(corr, lo, x0), hi, x1);
#else
    (void)corr;
    return _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1));
#endif
}
/* a row's 32 bytes at wr split into its low and high nibbles (the step's even and odd inputs' codes) */
#define A8_I4_NIBS(lo, hi, wr)                                                                                   \
    const __m256i lo##_d = _mm256_loadu_si256((const __m256i *)(const void *)(wr)),                              \
                  lo = _mm256_and_si256(lo##_d, _mm256_set1_epi8(15)),                                           \
                  hi = _mm256_and_si256(_mm256_srli_epi16(lo##_d, 4), _mm256_set1_epi8(15))
static inline __attribute__((always_inline)) __m256i a8_i4_row(const uint8_t *wr, __m256i x0, __m256i x1,
                                                               __m256i corr) {
    A8_I4_NIBS(lo, hi, wr);
    return a8_i4_dot(lo, hi, x0, x1, corr);
}
/* four rows' a8_i4_row summed per block: [r0 r1 r2 r3 | r0 r1 r2 r3] (corr: VNNI none, the lanes started from it;
   otherwise a8_x.bc, the blocks' excess) */
static inline __attribute__((always_inline)) __m256i a8_i4_sum4(__m256i p0, __m256i p1, __m256i p2, __m256i p3,
                                                                __m256i corr) {
#if defined(A8_VNNI)
    (void)corr;
    return _mm256_hadd_epi32(_mm256_hadd_epi32(p0, p1), _mm256_hadd_epi32(p2, p3));
#else
    const __m256i h = _mm256_hadd_epi16(_mm256_hadd_epi16(p0, p1), _mm256_hadd_epi16(p2, p3));
    return _mm256_add_epi32(_mm256_madd_epi16(h, _mm256_set1_epi16(1)), corr);
#endif
}
/* a8_i4_sum4 in two halves (its same operations): rows 0 and 1's lanes paired, rows 2 and 3's, then the join */
static inline __attribute__((always_inline)) __m256i a8_i4_half(__m256i p0, __m256i p1) {
#if defined(A8_VNNI)
    return _mm256_hadd_epi32(p0, p1);
#else
    return _mm256_hadd_epi16(p0, p1);
#endif
}
static inline __attribute__((always_inline)) __m256i a8_i4_join(__m256i h01, __m256i h23, __m256i corr) {
#if defined(A8_VNNI)
    (void)corr;
    return _mm256_hadd_epi32(h01, h23);
#else
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_hadd_epi16(h01, h23), _mm256_set1_epi16(1)), corr);
#endif
}
/* one row's a8_i4_row summed per block: [r x4 | r x4] (corr as a8_i4_sum4's) */
static inline __attribute__((always_inline)) __m256i a8_i4_sum1(__m256i p0, __m256i corr) {
#if defined(A8_VNNI)
    (void)corr;
#else
    p0 = _mm256_madd_epi16(p0, _mm256_set1_epi16(1));
#endif
    const __m256i u = _mm256_hadd_epi32(p0, p0);
    const __m256i i = _mm256_hadd_epi32(u, u);
#if defined(A8_VNNI)
    return i;
#else
    return _mm256_add_epi32(i, corr);
#endif
}
#if defined(A8_VNNI)
#define A8_ROW_CORR corr   /* (the rows' lanes start from the lanes' excess, a8_x.lc) */
#else
#define A8_ROW_CORR _mm256_setzero_si256()   /* (the blocks' excess, a8_x.bc, added after the sum) */
#endif
/* the step of R rows in groups of G into acc at lane k (inputs 8k .. 8k + 63 of the span): its x integers at v + 8k
   (64), excess at c + k (8 lanes), x scales at l + k (8), the rows' bytes at w0 + 4k .. w3 + 4k, the scales of its
   first group at g4 (R = 4: bf16 [group][4 rows] as a8_step_scales stores them) or the row's 8 in sc picked by gi
   (R = 1). pf: each row's line Q_PF_BYTES ahead (32
   bytes a step: the caller asks every other step) 0 not, 1 with no bound check, 2 checked against pf_end (NULL:
   none). Every array is addressed from its base by the one index k (round 14: the loop advanced seven pointers;
   round 11: each step's addresses were computed from its input index, ~15 of its ~65 instructions) */
static inline __attribute__((always_inline)) __m256 a8_i4_step(const int R, const int G, const int pf, int64_t k,
                                                               const int8_t *v, const int32_t *c, const float *l,
                                                               const uint8_t *w0, const uint8_t *w1,
                                                               const uint8_t *w2, const uint8_t *w3,
                                                               const uint16_t *g4,
                                                               __m256 sc, __m256i gi, const uint8_t *pf_end,
                                                               __m256 acc) {
    const __m256i x0 = _mm256_loadu_si256((const __m256i *)(const void *)(v + 8 * k)),
                  x1 = _mm256_loadu_si256((const __m256i *)(const void *)(v + 8 * k + 32)),
                  corr = _mm256_loadu_si256((const __m256i *)(const void *)(c + k));
    __m256i i;
    __m256 g;
    if (pf == 1) {
        __builtin_prefetch((const void *)(w0 + 4 * k + Q_PF_BYTES), 0, Q_PF_HINT);
        if (R == 4) {
            __builtin_prefetch((const void *)(w1 + 4 * k + Q_PF_BYTES), 0, Q_PF_HINT);
            __builtin_prefetch((const void *)(w2 + 4 * k + Q_PF_BYTES), 0, Q_PF_HINT);
            __builtin_prefetch((const void *)(w3 + 4 * k + Q_PF_BYTES), 0, Q_PF_HINT);
        }
    } else if (pf == 2 && pf_end) {
        Q_PF(w0 + 4 * k, pf_end);
        if (R == 4) {
            Q_PF(w1 + 4 * k, pf_end);
            Q_PF(w2 + 4 * k, pf_end);
            Q_PF(w3 + 4 * k, pf_end);
        }
    }
    if (R == 4) {
        const __m256i rc = A8_ROW_CORR;
        i = a8_i4_sum4(a8_i4_row(w0 + 4 * k, x0, x1, rc), a8_i4_row(w1 + 4 * k, x0, x1, rc),
                       a8_i4_row(w2 + 4 * k, x0, x1, rc), a8_i4_row(w3 + 4 * k, x0, x1, rc), corr);
        /* group 32: the step's two groups; 64: its one group in both halves. bf16 bits to fp32: the upper half of
           a lane (exact, the values round 14 converted per span into a table: the same bits) */
        if (G == 32)
            g = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(const void *)g4)), 16));
        else
            g = _mm256_castsi256_ps(_mm256_unpacklo_epi16(
                _mm256_setzero_si256(), _mm256_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)(const void *)g4))));
    } else {
        (void)g4; (void)w1; (void)w2; (void)w3;
        i = a8_i4_sum1(a8_i4_row(w0 + 4 * k, x0, x1, A8_ROW_CORR), corr);
        g = _mm256_permutevar8x32_ps(sc, gi);   /* lanes 0-3 and 4-7: the step's two groups (32) or its one (64) */
    }
    return _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(i), _mm256_loadu_ps(l + k)), g, acc);
}
/* R (1 or 4) rows of int4 weights in groups of G (a8_rows_vec's arguments): R = 4 reads the four rows' scales as
   stored (a8_step_scales: [group][4 rows], one widening a step; round 15: they were transposed and converted per
   span of 128 groups into a table first, ~1.4 instructions per 64 weights at 1024 inputs), R = 1 its row's in spans
   of 8 groups (sc). The steps in pairs (even, odd: the odd one prefetches), those whose prefetches stay below
   pf_end (the last row's is the furthest) with no check, counted before the loop. */
static inline __attribute__((always_inline)) __m256 a8_i4_acc(const int R, const int G, const a8_x *p, int64_t b,
                                                              const uint8_t *w, int64_t rs, const uint16_t *sr,
                                                              const uint8_t *pf_end) {
    const int64_t m = p->m, mv = p->mv, ng = m / G, nlv = mv / 8;   /* lanes (8 inputs) on the vector path */
    const int64_t span = R == 4 ? nlv : G;                           /* lanes a span (R = 1: 8 groups) */
    const int8_t *v = p->v + b * mv;
    const float *ls = p->ls + b * p->nl;
#if defined(A8_VNNI)
    const int32_t *cv = p->lc + b * p->nl;
#else
    const int32_t *cv = p->bc + b * p->nl;
#endif
    __m256 sc = _mm256_setzero_ps(), acc = sc;
    /* R = 1: lanes 0-3 and 4-7 take the step's two groups (32) or its one (64) among the row's 8: k-th step of 8 */
    const __m256i gi0 = G == 32 ? _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1) : _mm256_setzero_si256(),
                  gstep = _mm256_set1_epi32(G == 32 ? 2 : 1);
    /* a pair of steps at lane i prefetches (its odd step) byte 4i + 32 + Q_PF_BYTES of each row: below pf_end
       for every row when 4i < lim */
    const intptr_t lim = pf_end ? (intptr_t)((uintptr_t)pf_end - (uintptr_t)(w + (R - 1) * rs)) - Q_PF_BYTES - 32
                                : 0;
    for (int64_t i0 = 0; i0 < nlv; i0 = R == 4 ? nlv : i0 + span) {   /* (R = 4: one span) */
        const int64_t g0 = i0 * 8 / G, e = i0 + span < nlv ? span : nlv - i0;   /* e: the span's lanes */
        if (R == 1) sc = q4_scales8(sr + g0, ng - g0);
        /* the span's arrays from its first lane; the scales [group][row] (R = 4): lane k's step at k bf16 values
           (32: two groups of 4 rows a step of 8 lanes) or k / 2 (64), here in bytes */
        const int8_t *vs = v + 8 * i0;
        const int32_t *cs = cv + i0;
        const float *lp = ls + i0;
        const char *gb = (const char *)(const void *)(sr + 4 * g0);
        const int64_t gsh = G == 32 ? 2 : 1;   /* the scales' bytes per lane */
        const uint8_t *w0 = w + 4 * i0, *w1 = w0 + rs, *w2 = w0 + 2 * rs, *w3 = w0 + 3 * rs;
        __m256i gi = gi0;
#define A8_I4_STEP(pf, k)                                                                                        \
        do {                                                                                                     \
            acc = a8_i4_step(R, G, pf, k, vs, cs, lp, w0, w1, w2, w3,                                            \
                             (const uint16_t *)(const void *)(gb + gsh * (k)), sc, gi, pf_end, acc);             \
            gi = _mm256_add_epi32(gi, gstep);                                                                    \
        } while (0)
        int64_t k = 0;
        if (pf_end) {
            /* the pairs t (lanes k = 16 t, 16 t + 8) with 4 (i0 + 16 t) < lim */
            const intptr_t room = lim - 4 * (intptr_t)i0;
            int64_t safe = room <= 0 ? 0 : (room + 63) / 64;
            if (safe > e / 16) safe = e / 16;
            for (; k < 16 * safe; k += 16) {
                /* (the rows' bases opaque to GCC, which otherwise advanced a pointer per row: 4 adds a pair, where
                   w0 + 4k is one addressing mode) */
                __asm__("" : "+r"(w0), "+r"(w1), "+r"(w2), "+r"(w3));
                A8_I4_STEP(0, k);
                A8_I4_STEP(1, k + 8);
            }
            for (; k < e; k += 8) {
                if (k & 8) A8_I4_STEP(2, k);
                else A8_I4_STEP(0, k);
            }
        } else   /* (later x rows: the rows are in cache) */
            for (; k < e; k += 8) A8_I4_STEP(0, k);
#undef A8_I4_STEP
    }
    return acc;
}
/* a8_i4_acc's sums of R rows into out (a8_i4_rows' arguments) */
static inline __attribute__((always_inline)) void a8_i4_out(const int R, const int G, const a8_x *p, int64_t b,
                                                            const uint8_t *w, int64_t rs, const uint16_t *sr,
                                                            int64_t ss, __m256 acc, float *out) {
    const int64_t m = p->m, mv = p->mv;
    /* row r's lanes r and r + 4 (its blocks at even and odd offsets) added, then its tail's sum (+0 without one,
       added all the same: -0 + 0 is +0): the four rows' sums in one add */
    const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    if (R == 4 && mv == m) {
        _mm_storeu_ps(out, _mm_add_ps(sum, _mm_setzero_ps()));
        return;
    }
    float t[4];
    _mm_storeu_ps(t, sum);
    for (int r = 0; r < R; ++r)
        out[r] = t[r] + a8_int4_row_scalar(mv, m, G, w + r * rs, sr + r * ss, R == 4 ? 4 : 1, p->q + b * m,
                                           p->s + b * p->nb);
}
static inline __attribute__((always_inline)) void a8_i4_rows(const int R, const int G, const a8_x *p, int64_t b,
                                                             const uint8_t *w, int64_t rs, const uint16_t *sr,
                                                             int64_t ss, const uint8_t *pf_end, float *out) {
    a8_i4_out(R, G, p, b, w, rs, sr, ss, a8_i4_acc(R, G, p, b, w, rs, sr, pf_end), out);
}
/* int4, one x row (the decode's), one thread or a thread's range: the steps of four rows t = 0 .. q - 1
   (q_step_rows' rows t + r q) in one loop of their own, not inlined into matvec_a8's (round 15: each step went through
   matvec_rows_a8 there, ~85 instructions of setup a step at 1024 inputs, GCC keeping its values on the stack). Per
   product: the row stride, the x arrays and the steps whose prefetches all stay inside the matrix (a8_i4_acc's count at
   step t, whose last row starts (t + 3q) rows in, is every pair while (n - 3q - t) rowb - Q_PF_BYTES - 32 > 64
   (pairs - 1)), and whether the sums go into y directly (no bias, add or tail); per step: one rows' pointer and one y
   pointer advanced, the other rows' pointers one add each. The same arithmetic per row: the same bits. Steps
   t0 .. t1 - 1 (t1 <= q: a thread's range, Q_FOR_RANGES; round 15b's loop ran only the whole product on one
   thread). */
static inline __attribute__((always_inline)) void a8_i4_steps4(const int G, const int direct, const a8_x *p,
                                                               int64_t n, const uint8_t *W, const uint16_t *s,
                                                               const float *bias, const float *add, float *y,
                                                               int64_t t0, int64_t t1) {
    const int64_t m = p->m, rowb = m / 2, q = Q_QUARTER(n), ng = m / G, rs = q * rowb, nlv = p->mv / 8;
    const int64_t kp = 16 * (nlv / 16), gsh = G == 32 ? 2 : 1;   /* (lanes in pairs; the scales' bytes a lane) */
    const int8_t *v = p->v;
#if defined(A8_VNNI)
    const int32_t *cv = p->lc;
#else
    const int32_t *cv = p->bc;
#endif
    const float *ls = p->ls;
    const int8_t *ve = v + 8 * kp;
    const int32_t *ce = cv + kp;
    const float *le = ls + kp;
    const uint8_t *pf_end = W + n * rowb, *w = W + t0 * rowb;
    const uint16_t *sr = s + 4 * t0 * ng;
    float *yt = y + t0;
    const int64_t need = Q_PF_BYTES + 32 + 64 * (nlv / 16 - 1);
    int64_t tc = rowb > 0 ? n - 3 * q - need / rowb : 0;
    tc = tc < 0 ? 0 : tc > q ? q : tc;
    const __m256 z = _mm256_setzero_ps();
    const __m256i zi = _mm256_setzero_si256();
#define A8_I4_STEP4(full)                                                                                        \
    do {                                                                                                         \
        __asm__("" : "+r"(w), "+r"(yt));   /* (one pointer each, not one per row advanced on the stack) */        \
        __m256 acc;                                                                                              \
        if (full) {   /* (k from -kp up to 0, the arrays from the pairs' end: no bound to compare with) */         \
            const uint8_t *w0 = w + 4 * kp, *w1 = w0 + rs, *w2 = w1 + rs, *w3 = w2 + rs;                         \
            const char *gb = (const char *)(const void *)sr + gsh * kp;                                          \
            acc = z;                                                                                             \
            for (int64_t k = -kp; k < 0; k += 16) {                                                              \
                __asm__("" : "+r"(w0), "+r"(w1), "+r"(w2), "+r"(w3));   /* (as in a8_i4_acc) */                   \
                acc = a8_i4_step(4, G, 0, k, ve, ce, le, w0, w1, w2, w3,                                         \
                                 (const uint16_t *)(const void *)(gb + gsh * k), z, zi, pf_end, acc);            \
                acc = a8_i4_step(4, G, 1, k + 8, ve, ce, le, w0, w1, w2, w3,                                     \
                                 (const uint16_t *)(const void *)(gb + gsh * (k + 8)), z, zi, pf_end, acc);      \
            }                                                                                                    \
            if (kp < nlv)   /* (an odd last step: no prefetch, as a8_i4_acc's) */                                \
                acc = a8_i4_step(4, G, 0, 0, ve, ce, le, w0, w1, w2, w3, (const uint16_t *)(const void *)gb, z, zi,   \
                                 pf_end, acc);                                                                   \
        } else                                                                                                   \
            acc = a8_i4_acc(4, G, p, 0, w, rs, sr, pf_end);                                                      \
        if (direct) {   /* (+ 0 as a8_i4_out adds: a -0 sum becomes +0) */                                        \
            const __m128 u = _mm_add_ps(_mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1)),   \
                                        _mm_setzero_ps());                                                       \
            _mm_store_ss(yt, u);                                                                                 \
            _mm_store_ss(yt + q, _mm_movehdup_ps(u));                                                            \
            _mm_store_ss(yt + 2 * q, _mm_movehl_ps(u, u));                                                       \
            _mm_store_ss(yt + 3 * q, _mm_shuffle_ps(u, u, 3));                                                   \
        } else {                                                                                                 \
            float o[4];                                                                                          \
            a8_i4_out(4, G, p, 0, w, rs, sr, 1, acc, o);                                                         \
            for (int r = 0; r < 4; ++r) q_store_row(n, 0, t + r * q, o[r], bias, add, y);                        \
        }                                                                                                        \
    } while (0)
    int64_t t = t0;
    for (const int64_t e = tc < t1 ? tc : t1; t < e; ++t, w += rowb, sr += 4 * ng, ++yt) A8_I4_STEP4(1);
    for (; t < t1; ++t, w += rowb, sr += 4 * ng, ++yt) A8_I4_STEP4(0);
#undef A8_I4_STEP4
}
static __attribute__((noinline)) void a8_i4_steps4_g32(const a8_x *p, int64_t n, const uint8_t *W, const uint16_t *s,
                                                       const float *bias, const float *add, float *y, int64_t t0,
                                                       int64_t t1) {
    if (!bias && !add && p->mv == p->m) a8_i4_steps4(32, 1, p, n, W, s, bias, add, y, t0, t1);
    else a8_i4_steps4(32, 0, p, n, W, s, bias, add, y, t0, t1);
}
static __attribute__((noinline)) void a8_i4_steps4_g64(const a8_x *p, int64_t n, const uint8_t *W, const uint16_t *s,
                                                       const float *bias, const float *add, float *y, int64_t t0,
                                                       int64_t t1) {
    if (!bias && !add && p->mv == p->m) a8_i4_steps4(64, 1, p, n, W, s, bias, add, y, t0, t1);
    else a8_i4_steps4(64, 0, p, n, W, s, bias, add, y, t0, t1);
}
/* int4, several x rows (prefill chunks, batch and speculative decode): the steps t0 .. t1 - 1 of four rows with
   up to A8_XB x rows at a time sharing each load of the rows' codes and its nibble split (and the step's scales),
   where round 15's per-step path ran each x row over the rows again (matvec_rows_a8: the loads, the splits and
   ~85 instructions of setup per step and x row). Each x row's accumulator takes the same steps in the same order
   as on the one-row path: the same bits. pf: the first x rows' pass prefetches each row's line Q_PF_BYTES ahead
   (1: no bound check, 2: checked; later passes find the rows in cache, 0). */
#define A8_XB 4
/* a8_i4_pass's step at lane k (pf: 0 none, 1 / 2 the rows' lines prefetched as a8_i4_pass's pf says) */
#if defined(A8_VNNI)
#define A8_PASS_RC(c) _mm256_loadu_si256((const __m256i *)(const void *)(c))
#else
#define A8_PASS_RC(c) _mm256_setzero_si256()
#endif
static inline __attribute__((always_inline)) void a8_i4_pass_step(const int G, const int pf, const int NB, int64_t k,
                                                                  const int8_t *v, const int32_t *cv,
                                                                  const float *ls, int64_t mv, int64_t nl,
                                                                  const char *gb, const uint8_t *w0,
                                                                  const uint8_t *w1, const uint8_t *w2,
                                                                  const uint8_t *w3, const uint8_t *pf_end,
                                                                  __m256 *acc) {
    const int64_t gsh = G == 32 ? 2 : 1;
    if (pf == 1) {
        __builtin_prefetch((const void *)(w0 + 4 * k + Q_PF_BYTES), 0, Q_PF_HINT);
        __builtin_prefetch((const void *)(w1 + 4 * k + Q_PF_BYTES), 0, Q_PF_HINT);
        __builtin_prefetch((const void *)(w2 + 4 * k + Q_PF_BYTES), 0, Q_PF_HINT);
        __builtin_prefetch((const void *)(w3 + 4 * k + Q_PF_BYTES), 0, Q_PF_HINT);
    } else if (pf == 2) {
        Q_PF(w0 + 4 * k, pf_end);
        Q_PF(w1 + 4 * k, pf_end);
        Q_PF(w2 + 4 * k, pf_end);
        Q_PF(w3 + 4 * k, pf_end);
    }
    /* rows 0 and 1 split, their pair sums for every x row, then rows 2 and 3 (four split rows live at a time:
       with all four, GCC spilled and split them again per x row) */
    __m256i h01[A8_XB];
    {
        A8_I4_NIBS(lo0, hi0, w0 + 4 * k);
        A8_I4_NIBS(lo1, hi1, w1 + 4 * k);
        for (int bb = 0; bb < NB; ++bb) {
            const int8_t *vb = v + bb * mv + 8 * k;
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)(const void *)vb),
                          x1 = _mm256_loadu_si256((const __m256i *)(const void *)(vb + 32));
            const __m256i rc = A8_PASS_RC(cv + bb * nl + k);
            h01[bb] = a8_i4_half(a8_i4_dot(lo0, hi0, x0, x1, rc), a8_i4_dot(lo1, hi1, x0, x1, rc));
        }
    }
    A8_I4_NIBS(lo2, hi2, w2 + 4 * k);
    A8_I4_NIBS(lo3, hi3, w3 + 4 * k);
    const uint16_t *g4 = (const uint16_t *)(const void *)(gb + gsh * k);
    /* (as a8_i4_step's R = 4 scales) */
    const __m256 g = G == 32 ? _mm256_castsi256_ps(_mm256_slli_epi32(
                                   _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(const void *)g4)), 16))
                             : _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(),
                                   _mm256_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)(const void *)g4))));
    for (int bb = 0; bb < NB; ++bb) {
        const int8_t *vb = v + bb * mv + 8 * k;
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(const void *)vb),
                      x1 = _mm256_loadu_si256((const __m256i *)(const void *)(vb + 32)),
                      corr = _mm256_loadu_si256((const __m256i *)(const void *)(cv + bb * nl + k));
        const __m256i rc = A8_ROW_CORR;
        const __m256i i = a8_i4_join(h01[bb], a8_i4_half(a8_i4_dot(lo2, hi2, x0, x1, rc),
                                                         a8_i4_dot(lo3, hi3, x0, x1, rc)), corr);
        acc[bb] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(i), _mm256_loadu_ps(ls + bb * nl + k)), g,
                                  acc[bb]);
    }
}
#undef A8_PASS_RC
static inline __attribute__((always_inline)) void a8_i4_pass(const int G, const int pf, const int NB, const a8_x *p,
                                                             int64_t b0, const uint8_t *w, int64_t rs,
                                                             const uint16_t *sr, const uint8_t *pf_end,
                                                             __m256 *out) {
    const int64_t mv = p->mv, nl = p->nl, nlv = mv / 8;
    const int8_t *v = p->v + b0 * mv;
#if defined(A8_VNNI)
    const int32_t *cv = p->lc + b0 * nl;
#else
    const int32_t *cv = p->bc + b0 * nl;
#endif
    const float *ls = p->ls + b0 * nl;
    const char *gb = (const char *)(const void *)sr;
    const uint8_t *w0 = w, *w1 = w + rs, *w2 = w + 2 * rs, *w3 = w + 3 * rs;
    __m256 acc[A8_XB];
    for (int bb = 0; bb < NB; ++bb) acc[bb] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= nlv; k += 16) {   /* (in pairs, the odd step prefetching, as a8_i4_acc's) */
        a8_i4_pass_step(G, 0, NB, k, v, cv, ls, mv, nl, gb, w0, w1, w2, w3, pf_end, acc);
        a8_i4_pass_step(G, pf, NB, k + 8, v, cv, ls, mv, nl, gb, w0, w1, w2, w3, pf_end, acc);
    }
    if (k < nlv) a8_i4_pass_step(G, 0, NB, k, v, cv, ls, mv, nl, gb, w0, w1, w2, w3, pf_end, acc);
    for (int bb = 0; bb < NB; ++bb) out[bb] = acc[bb];
}
static inline __attribute__((always_inline)) void a8_i4_stepsx(const int G, const a8_x *p, int64_t B, int64_t n,
                                                               const uint8_t *W, const uint16_t *s,
                                                               const float *bias, const float *add, float *y,
                                                               int64_t t0, int64_t t1) {
    const int64_t m = p->m, rowb = m / 2, q = Q_QUARTER(n), ng = m / G, rs = q * rowb, nlv = p->mv / 8;
    const uint8_t *pf_end = W + n * rowb;
    /* the steps whose prefetches all stay inside the matrix (as a8_i4_steps4 counts them) */
    const int64_t need = Q_PF_BYTES + 32 + 64 * (nlv / 16 - 1);
    int64_t tc = rowb > 0 ? n - 3 * q - need / rowb : 0;
    tc = tc < 0 ? 0 : tc > q ? q : tc;
    for (int64_t t = t0; t < t1; ++t) {
        const uint8_t *w = W + t * rowb;
        const uint16_t *sr = s + 4 * t * ng;
        for (int64_t b0 = 0; b0 < B; b0 += A8_XB) {
            const int nb = B - b0 < A8_XB ? (int)(B - b0) : A8_XB;
            __m256 acc[A8_XB];
            const int pf = b0 > 0 ? 0 : t < tc ? 1 : 2;
#define A8_I4_PASS(NB)                                                                                           \
            do {                                                                                                 \
                if (pf == 0) a8_i4_pass(G, 0, NB, p, b0, w, rs, sr, pf_end, acc);                                \
                else if (pf == 1) a8_i4_pass(G, 1, NB, p, b0, w, rs, sr, pf_end, acc);                           \
                else a8_i4_pass(G, 2, NB, p, b0, w, rs, sr, pf_end, acc);                                        \
            } while (0)
            if (nb == 4) A8_I4_PASS(4);   /* (x rows a constant: their accumulators in registers) */
            else if (nb == 3) A8_I4_PASS(3);
            else if (nb == 2) A8_I4_PASS(2);
            else A8_I4_PASS(1);
#undef A8_I4_PASS
            for (int bb = 0; bb < nb; ++bb) {
                float o[4];
                a8_i4_out(4, G, p, b0 + bb, w, rs, sr, 1, acc[bb], o);
                for (int r = 0; r < 4; ++r) q_store_row(n, b0 + bb, t + r * q, o[r], bias, add, y);
            }
        }
    }
}
static __attribute__((noinline)) void a8_i4_stepsx_g32(const a8_x *p, int64_t B, int64_t n, const uint8_t *W,
                                                       const uint16_t *s, const float *bias, const float *add,
                                                       float *y, int64_t t0, int64_t t1) {
    a8_i4_stepsx(32, p, B, n, W, s, bias, add, y, t0, t1);
}
static __attribute__((noinline)) void a8_i4_stepsx_g64(const a8_x *p, int64_t B, int64_t n, const uint8_t *W,
                                                       const uint16_t *s, const float *bias, const float *add,
                                                       float *y, int64_t t0, int64_t t1) {
    a8_i4_stepsx(64, p, B, n, W, s, bias, add, y, t0, t1);
}
#define A8_I4_STEPS4 1
#endif
#if defined(A8_I8_COLS) && defined(__AVX512F__) && defined(__AVX512VNNI__)
/* AVX-512 VNNI, int8 weights: one row's step (inside a8_rows_vec), its 64 bytes at wr times the step's x (x0, corr,
   xs) into acc with the row's scale sc. pf 1: the line Q_PF_BYTES ahead prefetched with no bound check (the caller's
   steps keep it inside the matrix); pf 2: checked against pf_end (NULL: none). Written out per row, with the
   accumulators as named variables, so that they stay in registers (GCC 12 kept an array of them on the stack: a
   store and a load per row and step) and the bound check leaves the steps that cannot need it. (int4 weights take
   the 256-bit steps above: a 512-bit int4 step here, each row's 16 lanes converted and scaled apart and its group
   scales gathered from the steps' order, ran 13.4 GB/s from cache against their 23.2 on an AVX-512 Xeon:
   docs/cpu_kernels.md, round 21f.) */
#define A8_ROW_STEP(acc, sc, wr, pf)                                                                             \
    do {                                                                                                         \
        if ((pf) == 1) __builtin_prefetch((const void *)((wr) + Q_PF_BYTES), 0, Q_PF_HINT);                      \
        else Q_PF(wr, pf_end);                                                                                   \
        const __m512i i_ = _mm512_dpbusd_epi32(corr, _mm512_xor_si512(_mm512_loadu_si512((const void *)(wr)),    \
                                                                      flip), x0);                                \
        acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(i_), xs), sc, acc);                               \
    } while (0)
/* the step at input j of the R rows */
#define A8_STEP(pf)                                                                                              \
    do {                                                                                                         \
        const __m512i x0 = _mm512_loadu_si512((const void *)(xi + j)),                                          \
                      corr = _mm512_loadu_si512((const void *)(lc + j / 4));   /* (negated) */                   \
        const __m512 xs = _mm512_loadu_ps(ls + j / 4);                                                           \
        const uint8_t *w0 = w + j;                                                                               \
        A8_ROW_STEP(acc0, sc0, w0, pf);                                                                          \
        if (R == 4) {                                                                                            \
            A8_ROW_STEP(acc1, sc1, w0 + rs, pf);                                                                 \
            A8_ROW_STEP(acc2, sc2, w0 + 2 * rs, pf);                                                             \
            A8_ROW_STEP(acc3, sc3, w0 + 3 * rs, pf);                                                             \
        }                                                                                                        \
    } while (0)
static inline __attribute__((always_inline)) void a8_i8_rows(const int R, const a8_x *p, int64_t b, const uint8_t *w,
                                                             int64_t rs, const float *ws, const uint8_t *pf_end,
                                                             float *out) {
    const int64_t m = p->m, mv = p->mv;
    const int8_t *xi = p->q + b * m;
    const float *ls = p->ls + b * p->nl;
    const int32_t *lc = p->lc + b * p->nl;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    __m512 sc0 = _mm512_set1_ps(ws[0]), sc1 = sc0, sc2 = sc0, sc3 = sc0;
    if (R == 4) sc1 = _mm512_set1_ps(ws[1]), sc2 = _mm512_set1_ps(ws[2]), sc3 = _mm512_set1_ps(ws[3]);
    /* the steps whose every row's prefetch stays below pf_end (the last row's is the furthest), then the rest */
    const intptr_t pf_room = pf_end ? (intptr_t)((uintptr_t)pf_end - (uintptr_t)(w + (R - 1) * rs)) - Q_PF_BYTES : 0;
    int64_t j = 0;
    for (; j < mv && j < pf_room; j += A8_I8_COLS) A8_STEP(1);
    for (; j < mv; j += A8_I8_COLS) A8_STEP(2);
    const __m512 accs[4] = {acc0, acc1, acc2, acc3};
    for (int r = 0; r < R; ++r)
        out[r] = _mm512_reduce_add_ps(accs[r]) + a8_row_scalar(0, p, b, mv, 0, w + r * rs, NULL, 0, ws[r]);
}
#undef A8_STEP
#undef A8_ROW_STEP
#elif defined(A8_I8_COLS)
#undef A8_ROW_CORR
/* AVX2, int8 weights: with AVX-VNNI `vpdpbusd` on 32 bytes as the AVX-512 path; without it `vpmaddubsw` pairs then
   `vpmaddwd` with ones, the weights taking x's sign (x's magnitudes the unsigned operand, a8_x.v), so no excess.
   Both give the same integer lanes, and the float steps are the same: the same bits. As on AVX-512 the rows' steps
   are written out per row with named accumulators (an array of them lived on the stack: a store and a load per row
   and step, twice the instructions of the arithmetic). Every array a step reads is addressed by one index, its
   int32 lane k (inputs 4k ..): x's integers and the rows' bytes at 4k, the lanes' scales (and VNNI's excess) at k,
   so the steps' loop advances one register (round 14: it advanced five and recomputed ls + j / 4 each step), and
   runs in pairs of steps, the odd one prefetching, those whose prefetches cannot leave the matrix counted first. */
#if defined(A8_VNNI)
#define A8_LANES(d) A8_DP256(corr, _mm256_xor_si256(d, flip), x0)
#define A8_X_LOADS(k)                                                                                            \
    const __m256i x0 = _mm256_loadu_si256((const __m256i *)(const void *)(q + 4 * (k))),                        \
                  corr = _mm256_loadu_si256((const __m256i *)(const void *)(lc + (k))) /* (negated) */
#else
#define A8_LANES(d) _mm256_madd_epi16(_mm256_maddubs_epi16(x1, _mm256_sign_epi8(d, x0)), ones)
#define A8_X_LOADS(k)                                                                                            \
    const __m256i x0 = _mm256_loadu_si256((const __m256i *)(const void *)(q + 4 * (k))),                        \
                  x1 = _mm256_loadu_si256((const __m256i *)(const void *)(v + 4 * (k)))
#endif
/* one row's step: its 32 bytes at wr + 4k (pf 0: no prefetch; 1: the line Q_PF_BYTES ahead, no bound check; 2: checked
   against pf_end) into acc with its scale sc */
#define A8_ROW_STEP(acc, sc, wr, k, pf)                                                                          \
    do {                                                                                                         \
        if ((pf) == 1) __builtin_prefetch((const void *)((wr) + 4 * (k) + Q_PF_BYTES), 0, Q_PF_HINT);            \
        else if ((pf) == 2) Q_PF((wr) + 4 * (k), pf_end);                                                        \
        const __m256i d_ = _mm256_loadu_si256((const __m256i *)(const void *)((wr) + 4 * (k)));                  \
        acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(A8_LANES(d_)), xs), sc, acc);                     \
    } while (0)
/* the step of the R rows at lane k (inputs 4k .. 4k + 31) */
#define A8_STEP(k, pf)                                                                                           \
    do {                                                                                                         \
        A8_X_LOADS(k);                                                                                           \
        const __m256 xs = _mm256_loadu_ps(ls + (k));                                                             \
        A8_ROW_STEP(acc0, sc0, w0, k, pf);                                                                       \
        if (R == 4) {                                                                                            \
            A8_ROW_STEP(acc1, sc1, w1, k, pf);                                                                   \
            A8_ROW_STEP(acc2, sc2, w2, k, pf);                                                                   \
            A8_ROW_STEP(acc3, sc3, w3, k, pf);                                                                   \
        }                                                                                                        \
    } while (0)
static inline __attribute__((always_inline)) void a8_i8_rows(const int R, const a8_x *p, int64_t b, const uint8_t *w,
                                                             int64_t rs, const float *ws, const uint8_t *pf_end,
                                                             float *out) {
    const int64_t m = p->m, mv = p->mv, nl = mv / 4;   /* the vector part's int32 lanes (4 inputs each) */
    const int8_t *q = p->q + b * m, *v = p->v + b * mv;
    const float *ls = p->ls + b * p->nl;
    const int32_t *lc = p->lc + b * p->nl;
#if defined(A8_VNNI)
    const __m256i flip = _mm256_set1_epi8((char)0x80);
#else
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    (void)v; (void)lc;
    const uint8_t *w0 = w, *w1 = w + rs, *w2 = w + 2 * rs, *w3 = w + 3 * rs;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    __m256 sc0 = _mm256_set1_ps(ws[0]), sc1 = sc0, sc2 = sc0, sc3 = sc0;
    if (R == 4) sc1 = _mm256_set1_ps(ws[1]), sc2 = _mm256_set1_ps(ws[2]), sc3 = _mm256_set1_ps(ws[3]);
    int64_t k = 0;
    if (pf_end) {
        /* the pairs (lanes k, k + 8) whose odd step's prefetch stays below pf_end (the last row's is the furthest):
           4k + 32 + Q_PF_BYTES past that row below pf_end, i.e. 4k < lim */
        const intptr_t lim = (intptr_t)((uintptr_t)pf_end - (uintptr_t)(w + (R - 1) * rs)) - Q_PF_BYTES - 32;
        int64_t safe = lim <= 0 ? 0 : (lim + 63) / 64;
        if (safe > nl / 16) safe = nl / 16;
        for (const int64_t e = 16 * safe; k < e; k += 16) {
            A8_STEP(k, 0);
            A8_STEP(k + 8, 1);
        }
        for (; k < nl; k += 8) {
            if (k & 8) A8_STEP(k, 2);
            else A8_STEP(k, 0);
        }
    } else
        for (; k < nl; k += 8) A8_STEP(k, 0);   /* (later x rows: the rows are in cache) */
    float t[4];
    if (R == 4) {
        /* the four rows' lanes summed in the order of the scalar halving below (lane l + lane l + 4, then + 2, then
           + 1, the lower lane first: the same bits), all four rows at once: a row's halves, then its pairs */
        const __m256 u01 = _mm256_add_ps(_mm256_permute2f128_ps(acc0, acc1, 0x20),
                                         _mm256_permute2f128_ps(acc0, acc1, 0x31)),   /* [u0 | u1] */
                     u23 = _mm256_add_ps(_mm256_permute2f128_ps(acc2, acc3, 0x20),
                                         _mm256_permute2f128_ps(acc2, acc3, 0x31));
        const __m256 c = _mm256_add_ps(_mm256_shuffle_ps(u01, u23, 0x44), _mm256_shuffle_ps(u01, u23, 0xEE));
        const __m256 h = _mm256_hadd_ps(c, c);   /* [r0 r2 r0 r2 | r1 r3 r1 r3] */
        const __m128 sum = _mm_unpacklo_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        if (mv == m) {   /* (+ 0 as the tail's sum would be: a -0 sum becomes +0) */
            _mm_storeu_ps(out, _mm_add_ps(sum, _mm_setzero_ps()));
            return;
        }
        _mm_storeu_ps(t, sum);
    } else {
        float u[8];
        _mm256_storeu_ps(u, acc0);
        for (int h = 4; h >= 1; h /= 2)
            for (int l = 0; l < h; ++l) u[l] += u[l + h];
        t[0] = u[0];
    }
    for (int r = 0; r < R; ++r)
        t[r] += a8_int8_row_scalar(mv, m, (const int8_t *)(w + r * rs), ws[r], q, p->s + b * p->nb);
    for (int r = 0; r < R; ++r) out[r] = t[r];
}
#undef A8_X_LOADS
#undef A8_STEP
#undef A8_ROW_STEP
#undef A8_LANES
/* int8: the steps t0 .. t1 - 1 of four rows (t1 <= q) in a loop of their own (as a8_i4_steps4), each x row of
   B in turn (the first prefetches; the later ones find the step's rows in cache) */
static inline __attribute__((always_inline)) void a8_i8_steps(const a8_x *p, int64_t B, int64_t n, const uint8_t *W,
                                                              const uint16_t *s, const float *bias, const float *add,
                                                              float *y, int64_t t0, int64_t t1) {
    const int64_t m = p->m, q = Q_QUARTER(n), rs = q * m;
    const uint8_t *pf_end = W + n * m, *w = W + t0 * m;
    for (int64_t t = t0; t < t1; ++t, w += m) {
        const float ws[4] = {bf16_to_f32(s[t]), bf16_to_f32(s[t + q]), bf16_to_f32(s[t + 2 * q]),
                             bf16_to_f32(s[t + 3 * q])};
        for (int64_t b = 0; b < B; ++b) {
            float o[4];
            a8_i8_rows(4, p, b, w, rs, ws, b == 0 ? pf_end : NULL, o);
            for (int r = 0; r < 4; ++r) q_store_row(n, b, t + r * q, o[r], bias, add, y);
        }
    }
}
/* (one x row a function of its own: GCC's allocation of round 15b's loop; +5-10 % instructions with B a variable
   or both in one function) */
static __attribute__((noinline)) void a8_i8_steps4(const a8_x *p, int64_t n, const uint8_t *W, const uint16_t *s,
                                                   const float *bias, const float *add, float *y, int64_t t0,
                                                   int64_t t1) {
    a8_i8_steps(p, 1, n, W, s, bias, add, y, t0, t1);
}
static __attribute__((noinline)) void a8_i8_stepsx(const a8_x *p, int64_t B, int64_t n, const uint8_t *W,
                                                   const uint16_t *s, const float *bias, const float *add, float *y,
                                                   int64_t t0, int64_t t1) {
    a8_i8_steps(p, B, n, W, s, bias, add, y, t0, t1);
}
#define A8_I8_STEPS4 1
#endif
#if defined(A8_I8_COLS)
/* the R rows' products by format: a8_i8_rows is each vector target's own, a8_i4_rows the 256-bit steps' */
static inline __attribute__((always_inline)) void a8_rows_vec(const int int4, const int R, const a8_x *p, int64_t b,
                                                              int64_t group, const uint8_t *w, int64_t rs,
                                                              const uint16_t *sr, int64_t ss, const float *ws,
                                                              const uint8_t *pf_end, float *out) {
    if (!int4) a8_i8_rows(R, p, b, w, rs, ws, pf_end, out);
    else if (group == 32) a8_i4_rows(R, 32, p, b, w, rs, sr, ss, pf_end, out);
    else a8_i4_rows(R, 64, p, b, w, rs, sr, ss, pf_end, out);
}
#endif

/* the r rows i0, i0 + stride, ... (q_step_rows) of y = add + W x^ + bias, W int8 [n, m] (row scales) or int4
   [n, m / 2] (group scales). Inlined into the steps' loop, so that what does not change from step to step is set up
   once (callgrind: ~110 of the ~1400 instructions of an int4 step of 4 rows at 1024 inputs; ~1040 since round 11) */
static inline __attribute__((always_inline)) void matvec_rows_a8(int int4, const a8_x *p, int64_t B, int64_t n,
                                                                 int64_t group, int64_t i0, int64_t stride, int r,
                                                                 const void *W, const uint16_t *s, const float *bias,
                                                                 const float *add, float *y) {
    const int64_t m = p->m, rowb = int4 ? m / 2 : m;
    /* (groups of 32 and 64 spelt out: a division per step of 4 rows otherwise) */
    const int64_t ng = !int4 ? 1 : group == 32 ? m / 32 : group == 64 ? m / 64 : m / group;
    const uint8_t *Wb = (const uint8_t *)W;
    /* int4: step t's four rows' scales at s + 4 t ng (t = i0 < q; the step of neighbouring rows, t = q, i0 = 4q), a
       last row's at s + i0 ng (a8_step_scales); int8: no group scales */
    const uint16_t *si = int4 ? s + (r == 4 && i0 < Q_QUARTER(n) ? 4 : 1) * i0 * ng : s;
    float ws[4];
    for (int k = 0; k < r; ++k) ws[k] = int4 ? 0.0f : bf16_to_f32(s[i0 + k * stride]);
    for (int64_t b = 0; b < B; ++b) {
        float out[4];
#if defined(A8_I8_COLS)
        const uint8_t *pf_end = b == 0 ? Wb + n * rowb : NULL;   /* (later x rows find the rows in cache) */
        const uint8_t *w = Wb + i0 * rowb;
        const int64_t rs = stride * rowb, ss = int4 ? 1 : 0;   /* (row r's scales at si + r, 4 apart) */
        if (int4 && r == 4) a8_rows_vec(1, 4, p, b, group, w, rs, si, ss, ws, pf_end, out);
        else if (int4) a8_rows_vec(1, 1, p, b, group, w, 0, si, 0, ws, pf_end, out);
        else if (r == 4) a8_rows_vec(0, 4, p, b, group, w, rs, si, 0, ws, pf_end, out);
        else a8_rows_vec(0, 1, p, b, group, w, 0, si, 0, ws, pf_end, out);
#else
        for (int k = 0; k < r; ++k)
            out[k] = a8_row_scalar(int4, p, b, 0, group, Wb + (i0 + k * stride) * rowb, si + k, r == 4 ? 4 : 1, ws[k]);
#endif
        for (int k = 0; k < r; ++k) q_store_row(n, b, i0 + k * stride, out[k], bias, add, y);
    }
}

/* int4-a8's group scales s [n * m / group] (bf16) in the order the steps of four rows read them (quant's
   a8_step_scales): with q = Q_QUARTER(n), step t < q's rows t, t + q, t + 2q, t + 3q as [group][4 rows] at
   s + 4 t ng, the step of neighbouring rows 4q .. 4q + 3 (n >= 8, q_step_rows) as [group][4 rows] at s + 4 q ng,
   then the n % 4 last rows as [row][group] from s + 4 (n / 4) ng (where they are in the plain [n, ng] order). Row
   i's scale of group g: a8_scale_at. */
static inline uint16_t a8_scale_at(const uint16_t *s, int64_t n, int64_t ng, int64_t i, int64_t g) {
    const int64_t q = Q_QUARTER(n);
    if (i < 4 * q) return s[4 * ((i % q) * ng + g) + i / q];
    return i < 4 * (n / 4) ? s[4 * (q * ng + g) + i - 4 * q] : s[i * ng + g];
}

/* the exact int4 product (matvec_int4) of weights whose scales are in the steps' order: the scales put back into
   [n, ng] first (only when x holds a NaN or inf); with no memory for them, row by row in plain C */
static void matvec_int4_step_scales(int64_t B, int64_t n, int64_t m, int64_t group, const uint8_t *W,
                                    const uint16_t *s, const float *bias, const float *x, const float *add, float *y,
                                    int nthreads) {
    const int64_t ng = m / group;
    uint16_t *plain = malloc(sizeof(uint16_t) * (size_t)(n * ng > 0 ? n * ng : 1));
    if (plain) {
        for (int64_t i = 0; i < n; ++i)
            for (int64_t g = 0; g < ng; ++g) plain[i * ng + g] = a8_scale_at(s, n, ng, i, g);
        matvec_int4(B, n, m, group, W, plain, bias, x, add, y, nthreads);
        free(plain);
        return;
    }
    for (int64_t i = 0; i < n; ++i) {
        uint16_t row[ng > 0 ? ng : 1];
        for (int64_t g = 0; g < ng; ++g) row[g] = a8_scale_at(s, n, ng, i, g);
        for (int64_t b = 0; b < B; ++b)
            q_store_row(n, b, i, int4_row_scalar(0, m, group, W + i * (m / 2), row, x + b * m), bias, add, y);
    }
}

#if defined(A8_I4_STEPS4)
/* the steps s0 .. s1 - 1 of a product (a thread's range, Q_FOR_RANGES): its steps of four rows through the loops
   of their own (set up once per range: round 15b's for one x row on one thread, now every x row count and thread),
   then its other steps (q_step_rows: the step of neighbouring rows, the n % 4 last rows) one at a time (on
   AVX-512 int4 only: its int8 has no such loop) */
static void a8_steps_range(int int4, const a8_x *p, int64_t B, int64_t n, int64_t group, const void *W,
                           const uint16_t *s, const float *bias, const float *add, float *y, int64_t s0, int64_t s1) {
    const int64_t q = Q_QUARTER(n), e = s1 < q ? s1 : q;
    const uint8_t *Wb = (const uint8_t *)W;
    if (s0 < e) {
#if defined(A8_I8_STEPS4)
        if (!int4 && B == 1) a8_i8_steps4(p, n, Wb, s, bias, add, y, s0, e);
        else if (!int4) a8_i8_stepsx(p, B, n, Wb, s, bias, add, y, s0, e);
        else
#endif
        if (B == 1 && group == 32) a8_i4_steps4_g32(p, n, Wb, s, bias, add, y, s0, e);
        else if (B == 1) a8_i4_steps4_g64(p, n, Wb, s, bias, add, y, s0, e);
        else if (group == 32) a8_i4_stepsx_g32(p, B, n, Wb, s, bias, add, y, s0, e);
        else a8_i4_stepsx_g64(p, B, n, Wb, s, bias, add, y, s0, e);
    }
    for (int64_t t = s0 > q ? s0 : q; t < s1; ++t) {
        int64_t stride;
        int r;
        const int64_t i0 = q_step_rows(n, t, &stride, &r);
        if (!int4) matvec_rows_a8(0, p, B, n, 0, i0, stride, r, W, s, bias, add, y);
        else if (group == 32) matvec_rows_a8(1, p, B, n, 32, i0, stride, r, W, s, bias, add, y);
        else matvec_rows_a8(1, p, B, n, 64, i0, stride, r, W, s, bias, add, y);
    }
}
#endif

static void matvec_a8(int int4, int64_t B, int64_t n, int64_t m, int64_t group, const void *W, const uint16_t *s,
                      const float *bias, const float *x, const float *add, float *y, int nthreads) {
    const int par = nthreads > 1 && n * m >= (int4 ? 4 : 2) * PAR_MIN_ELEMS;
    q_prefetch_starts(n, int4 ? m / 2 : m, W, par ? nthreads : 1);   /* (before the rounding of x) */
    if (int4)   /* the scales each thread's first step reads (a8_step_scales: step t's at 4 t ng while t < n / 4, the
                   steps of four rows; then row i's, t + 3 (n / 4), at i ng) */
        for (int t = 0, nt = par ? nthreads : 1; t < nt; ++t) {
            const int64_t f = n / 4, st = Q_STEPS(n) * t / nt, ng = m / group;
            const uintptr_t a = (uintptr_t)(s + (st < f ? 4 * st : 3 * f + st) * ng), end = (uintptr_t)(s + n * ng);
            for (uintptr_t o = 0; o < Q_PF_BYTES && a + o < end; o += 64)
                __builtin_prefetch((const void *)(a + o), 0, Q_PF_HINT);
        }
    a8_x p;
    if (!a8_prepare(int4, B, m, x, &p)) {   /* NaN / inf in x (or no memory): the exact product */
        if (int4) matvec_int4_step_scales(B, n, m, group, (const uint8_t *)W, s, bias, x, add, y, nthreads);
        else matvec_int8(B, n, m, (const int8_t *)W, s, bias, x, add, y, nthreads);
        return;
    }
    /* int4 and the group constants in each steps' loop (round 14: one loop for all of them set up every format's
       pointers and strides at each step, ~80 instructions of a 4-row step, spilled to the stack) */
#if defined(A8_I8_COLS)
    const int64_t g = 64;   /* (the vector paths take groups of 32 and 64: quantize's two) */
#else
    const int64_t g = group;
#endif
#define A8_STEPS(i4, G, BB) Q_FOR_STEPS(n, par, matvec_rows_a8(i4, &p, BB, n, G, i0, stride, r, W, s, bias, add, y))
#if defined(A8_I4_STEPS4) && defined(A8_I8_STEPS4)
    /* (AVX2 / AVX-VNNI: every product through the step loops, each thread's range set up once) */
    (void)g;
    Q_FOR_RANGES(n, par, a8_steps_range(int4, &p, B, n, group, W, s, bias, add, y, s0_, s1_));
#elif defined(A8_I4_STEPS4)
    /* (AVX-512 VNNI: int4 through the 256-bit step loops, int8 through its 512-bit steps) */
    (void)g;
    if (int4) Q_FOR_RANGES(n, par, a8_steps_range(1, &p, B, n, group, W, s, bias, add, y, s0_, s1_));
    else A8_STEPS(0, 0, B);
#else
    if (!int4) A8_STEPS(0, 0, B);   /* (int8: B == 1 apart measured +5 % instructions, GCC's allocation) */
    else if (B == 1 && group == 32) A8_STEPS(1, 32, 1);   /* int4: the decode's one x row a constant too */
    else if (B == 1) A8_STEPS(1, g, 1);
    else if (group == 32) A8_STEPS(1, 32, B);
    else A8_STEPS(1, g, B);
#endif
#undef A8_STEPS
    free(p.mem);
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
    case WF_INT8_A8: matvec_a8(0, B, n, m, 0, W, (const uint16_t *)scales, bias, x, add, y, nthreads); break;
    case WF_INT4_A8:   /* (scales in the steps' order: a8_step_scales) */
        matvec_a8(1, B, n, m, group, W, (const uint16_t *)scales, bias, x, add, y, nthreads);
        break;
    default: matvec_f32(B, n, m, (const float *)W, bias, x, add, y, nthreads); break;
    }
}

#endif
