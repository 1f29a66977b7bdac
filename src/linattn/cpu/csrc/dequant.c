/* Dequantizing stored int8 / int4 weights to fp32 rows (quant/linear.py `_dequantize_rows`): the weight blocks
   that the many-rows product of a CPU without bf16 instructions multiplies in torch's fp32 matmul.

     int8   w[i, k] = q[i, k] * s[i]                    q int8 [R, K], s bf16 [R]
     int4   w[i, k] = (c[i, k] - 8) * s[i, k / G]       c the nibbles of uint8 [R, K / 2] (even k: the low one),
                                                        s bf16 [R, K / G]

   q * s is exact in fp32 (8 x 8 significant bits at most). `form` says what is written:
     DQ_EXACT      float, the exact product: `dequantize(torch.float32)`'s bits;
     DQ_BF16_F32   float, the product rounded once to bf16, to nearest, ties to even: the bits of torch's
                   `dequantize(torch.bfloat16).float()`, whose bf16 multiply computes the product in fp32 and
                   rounds it the same way;
     DQ_BF16       the same bf16 values as bf16 (uint16 bits): `dequantize(torch.bfloat16)`.
   A NaN or inf scale gives NaN / inf where torch's does (a NaN's sign and payload aside).

   torch's elementwise ops took 7-10 ms per 3.6M int4 weights (a pass per op over the whole block); here one
   pass writes each weight once, the loops vectorised by the compiler (the bf16 rounding is integer arithmetic on
   the float's bits), int4's fp32 forms on AVX2 by a lookup per weight (dq_int4_group_avx2; -DLINATTN_PLAIN_C
   leaves the loops, tests/quant/test_dequant.py runs both). Rows are split over the threads. */
#include "common.h"

LA_ABI_VERSION(dequant, 1)

#define DQ_EXACT 0
#define DQ_BF16_F32 1
#define DQ_BF16 2

/* v (an exact product of two bf16-sized values) rounded to bf16, to nearest, ties to even, as a float. A NaN
   product has its quiet bit set (the low 16 bits of every operand are zero), so the carry cannot turn it into
   an infinity; a finite value past bf16's largest becomes inf, as IEEE rounding does. */
LA_INLINE uint32_t dq_round_bits(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
}

LA_INLINE float dq_round_bf16(float v) {
    const uint32_t u = dq_round_bits(v);
    memcpy(&v, &u, sizeof v);
    return v;
}

LA_INLINE float dq_bf16(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float v;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* q [R, K] int8, s [R] (bf16 bits) -> out [R, K] (float, or bf16 for DQ_BF16) */
int linattn_dequant_int8(int64_t R, int64_t K, const int8_t *q, const uint16_t *s, int form, void *out,
                         int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < R; ++i) {
        const int8_t *restrict qr = q + i * K;
        const float si = dq_bf16(s[i]);
        if (form == DQ_BF16) {
            uint16_t *restrict o = (uint16_t *)out + i * K;
            LA_SIMD
            for (int64_t k = 0; k < K; ++k) o[k] = (uint16_t)(dq_round_bits((float)qr[k] * si) >> 16);
        } else if (form == DQ_BF16_F32) {
            float *restrict o = (float *)out + i * K;
            LA_SIMD
            for (int64_t k = 0; k < K; ++k) o[k] = dq_round_bf16((float)qr[k] * si);
        } else {
            float *restrict o = (float *)out + i * K;
            LA_SIMD
            for (int64_t k = 0; k < K; ++k) o[k] = (float)qr[k] * si;
        }
    }
    return 0;
}

#if defined(__AVX2__) && !defined(LINATTN_PLAIN_C)
#include <immintrin.h>
#define DQ_AVX2 1

/* y rounded to bf16 as dq_round_bits does, 8 lanes: the bits of the bf16 value in each lane's high half */
LA_INLINE __m256i dq_round8(__m256 y) {
    const __m256i u = _mm256_castps_si256(y);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    return _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
}

/* One int4 group of `half` bytes (a multiple of 16) with scale sg in the DQ_BF16_F32 / DQ_EXACT forms: the 16
   values a code can take computed once (two vectors: codes 0-7 and 8-15, rounded as the form says), then every
   weight is a lookup (two permutes and a blend on the code's bit 3) instead of a conversion, a product and the
   rounding's five integer operations; the bytes' low and high nibbles interleaved in code order. */
LA_INLINE void dq_int4_group_avx2(const uint8_t *pg, int64_t half, float sg, int form, float *o) {
    const __m256 s = _mm256_set1_ps(sg);
    __m256 lo = _mm256_mul_ps(_mm256_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1), s);
    __m256 hi = _mm256_mul_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), s);
    if (form == DQ_BF16_F32) {
        lo = _mm256_castsi256_ps(dq_round8(lo));
        hi = _mm256_castsi256_ps(dq_round8(hi));
    }
    const __m128i nib = _mm_set1_epi8(15);
    for (int64_t j = 0; j < half; j += 16) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(pg + j));
        const __m128i cl = _mm_and_si128(b, nib), ch = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
        const __m128i c[2] = {_mm_unpacklo_epi8(cl, ch), _mm_unpackhi_epi8(cl, ch)};   /* 32 codes, in order */
        for (int h = 0; h < 2; ++h) {
            const __m128i parts[2] = {c[h], _mm_srli_si128(c[h], 8)};
            for (int e = 0; e < 2; ++e) {
                const __m256i idx = _mm256_cvtepu8_epi32(parts[e]);
                const __m256 vl = _mm256_permutevar8x32_ps(lo, idx), vh = _mm256_permutevar8x32_ps(hi, idx);
                const __m256 sel = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));   /* bit 3: the sign */
                _mm256_storeu_ps(o + 2 * j + 16 * h + 8 * e, _mm256_blendv_ps(vl, vh, sel));
            }
        }
    }
}
#endif

/* p [R, K / 2] uint8 (two codes c = q + 8 a byte, the even column low), s [R, K / group] (bf16 bits), K a multiple
   of group, group even -> out [R, K] (float, or bf16 for DQ_BF16). A group is written as its low nibbles and its
   high nibbles, interleaved: the two-element store groups vectorise (AVX2, fp32 forms, groups a multiple of 32: a
   lookup per weight, dq_int4_group_avx2, the same bits). */
int linattn_dequant_int4(int64_t R, int64_t K, int64_t group, const uint8_t *p, const uint16_t *s, int form,
                         void *out, int nthreads) {
    const int64_t ng = K / group, half = group / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < R; ++i) {
        for (int64_t g = 0; g < ng; ++g) {
            const uint8_t *restrict pg = p + i * (K / 2) + g * half;
            const float sg = dq_bf16(s[i * ng + g]);
#if defined(DQ_AVX2)
            if (form != DQ_BF16 && half % 16 == 0) {
                dq_int4_group_avx2(pg, half, sg, form, (float *)out + i * K + g * group);
                continue;
            }
#endif
            if (form == DQ_BF16) {
                uint16_t *restrict o = (uint16_t *)out + i * K + g * group;
                LA_SIMD
                for (int64_t j = 0; j < half; ++j) {
                    o[2 * j] = (uint16_t)(dq_round_bits((float)((int)(pg[j] & 15) - 8) * sg) >> 16);
                    o[2 * j + 1] = (uint16_t)(dq_round_bits((float)((int)(pg[j] >> 4) - 8) * sg) >> 16);
                }
            } else if (form == DQ_BF16_F32) {
                float *restrict o = (float *)out + i * K + g * group;
                LA_SIMD
                for (int64_t j = 0; j < half; ++j) {
                    o[2 * j] = dq_round_bf16((float)((int)(pg[j] & 15) - 8) * sg);
                    o[2 * j + 1] = dq_round_bf16((float)((int)(pg[j] >> 4) - 8) * sg);
                }
            } else {
                float *restrict o = (float *)out + i * K + g * group;
                LA_SIMD
                for (int64_t j = 0; j < half; ++j) {
                    o[2 * j] = (float)((int)(pg[j] & 15) - 8) * sg;
                    o[2 * j + 1] = (float)((int)(pg[j] >> 4) - 8) * sg;
                }
            }
        }
    }
    return 0;
}
