/* Dequantizing stored int8 / int4 weights to fp32 rows (quant/linear.py `_dequantize_rows`): the weight blocks
   that the many-rows product of a CPU without bf16 instructions multiplies in torch's fp32 matmul.

     int8   w[i, k] = q[i, k] * s[i]                    q int8 [R, K], s bf16 [R]
     int4   w[i, k] = (c[i, k] - 8) * s[i, k / G]       c the nibbles of uint8 [R, K / 2] (even k: the low one),
                                                        s bf16 [R, K / G]

   q * s is exact in fp32 (8 x 8 significant bits at most); with `round` it is then rounded once to bf16, to
   nearest, ties to even (returned as the fp32 value of that bf16): the bits of torch's
   `dequantize(torch.bfloat16).float()`, whose bf16 multiply computes the product in fp32 and rounds it the same
   way. A NaN or inf scale gives NaN / inf where torch's does (a NaN's sign and payload aside). Without `round`:
   the exact fp32 product, `dequantize(torch.float32)`'s bits.

   torch's elementwise ops took 7-10 ms per 3.6M int4 weights (a pass per op over the whole block); here one
   pass writes each weight once, the loop vectorised by the compiler (no intrinsics: the bf16 rounding is integer
   arithmetic on the float's bits). Rows are split over the threads. */
#include "common.h"

LA_ABI_VERSION(dequant, 1)

/* v (an exact product of two bf16-sized values) rounded to bf16, to nearest, ties to even, as a float. A NaN
   product has its quiet bit set (the low 16 bits of every operand are zero), so the carry cannot turn it into
   an infinity; a finite value past bf16's largest becomes inf, as IEEE rounding does. */
LA_INLINE float dq_round_bf16(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&v, &u, sizeof v);
    return v;
}

LA_INLINE float dq_bf16(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float v;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* q [R, K] int8, s [R] (bf16 bits) -> out [R, K] fp32 (bf16-rounded with `round`) */
int linattn_dequant_int8(int64_t R, int64_t K, const int8_t *q, const uint16_t *s, int round, float *out,
                         int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < R; ++i) {
        const int8_t *restrict qr = q + i * K;
        float *restrict o = out + i * K;
        const float si = dq_bf16(s[i]);
        if (round) {
            LA_SIMD
            for (int64_t k = 0; k < K; ++k) o[k] = dq_round_bf16((float)qr[k] * si);
        } else {
            LA_SIMD
            for (int64_t k = 0; k < K; ++k) o[k] = (float)qr[k] * si;
        }
    }
    return 0;
}

/* p [R, K / 2] uint8 (two codes c = q + 8 a byte, the even column low), s [R, K / group] (bf16 bits), K a multiple
   of group, group even -> out [R, K] fp32 (bf16-rounded with `round`). A group is written as its low nibbles and
   its high nibbles, interleaved: the two-element store groups vectorise. */
int linattn_dequant_int4(int64_t R, int64_t K, int64_t group, const uint8_t *p, const uint16_t *s, int round,
                         float *out, int nthreads) {
    const int64_t ng = K / group, half = group / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < R; ++i) {
        for (int64_t g = 0; g < ng; ++g) {
            const uint8_t *restrict pg = p + i * (K / 2) + g * half;
            float *restrict o = out + i * K + g * group;
            const float sg = dq_bf16(s[i * ng + g]);
            if (round) {
                LA_SIMD
                for (int64_t j = 0; j < half; ++j) {
                    o[2 * j] = dq_round_bf16((float)((int)(pg[j] & 15) - 8) * sg);
                    o[2 * j + 1] = dq_round_bf16((float)((int)(pg[j] >> 4) - 8) * sg);
                }
            } else {
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
