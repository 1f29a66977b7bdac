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
   the row's scale once; an int4 weight becomes its exact dequantized value (c - 8) * s (4 bits times a bf16's 8)
   before its product. So the result is the dequantized matrix's product up to the rounding of fp32 operations.
   Four rows are read per step as in the fp32 / bf16 products, the weights prefetched MV_PF_BYTES ahead. */
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

/* one row's int4 dot product over 32 inputs x[0 .. 31] from 16 bytes (codes of x[2k] low, x[2k+1] high), the
   codes minus 8 exact in int8 then fp32 */
#if defined(HAVE_VLINE)
/* acc + the products of 32 inputs (even ones xe, odd ones xo) with their weights, 16 bytes of codes c (x[2k] low
   nibble, x[2k+1] high), dequantized by a table: tbl[c] = (c - 8) * scale, exact in fp32 (4 bits times a bf16's
   8). A shuffle's selector is taken modulo 16, so the widened byte selects by its low nibble and the byte shifted
   right by 4 by its high one: one vpermps each, no masks or conversions. */
static inline vline_f32 int4_chunk(vline_f32 acc, const uint8_t *w, vline_f32 tbl, vline_f32 xe, vline_f32 xo) {
    vq_u8 v;
    Q_LOAD16(v, w);
    const vq_i32 b = __builtin_convertvector(v, vq_i32);
    acc += __builtin_shuffle(tbl, b) * xe;
    return acc + __builtin_shuffle(tbl, b >> 4) * xo;
}
#endif

/* rows i0 .. i0+3 of y = add + W x + bias, W int4 [n, m] (m / 2 bytes a row) with scales s [n, m / group] (bf16):
   per group, the products of the group's inputs summed in fp32 lanes, times the group's scale, into the row's
   lanes; the even and odd inputs of 32 split once per 4 rows (two permutes) */
static void matvec_rows_int4(int64_t B, int64_t n, int64_t m, int64_t group, int64_t i0, const uint8_t *W,
                             const uint16_t *s, const float *bias, const float *x, const float *add, float *y) {
    const int64_t r = n - i0 < 4 ? n - i0 : 4, mb = m / 2, ng = m / group;
    for (int64_t b = 0; b < B; ++b) {
        const float *restrict xb = x + b * m;
#if defined(HAVE_VLINE)
        const vq_i32 even = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
        const vq_i32 odd = even + 1;
        const int64_t cpg = group / 32;   /* chunks of 32 inputs per group */
        if (r == 4 && group % 32 == 0) {
            const uint8_t *w0 = W + i0 * mb, *w1 = w0 + mb, *w2 = w1 + mb, *w3 = w2 + mb;
            const uint16_t *s0 = s + i0 * ng, *s1 = s0 + ng, *s2 = s1 + ng, *s3 = s2 + ng;
            const char *pf = (const char *)w0 + MV_PF_BYTES, *pf_end = (const char *)(W + n * mb) - 64;
            const vline_f32 codes = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
            vline_f32 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            float sc[4][16];   /* 16 groups' scales of each row in fp32, converted 16 at a time */
            for (int64_t g = 0; g < ng; ++g) {
                const int64_t k = g & 15;
                if (k == 0) {
                    const uint16_t *sr[4] = {s0 + g, s1 + g, s2 + g, s3 + g};
                    for (int rr = 0; rr < 4; ++rr) {
                        if (ng - g >= 16) {
                            const vline_f32 v = bf16_line(sr[rr]);
                            memcpy(sc[rr], &v, sizeof v);
                        } else
                            for (int64_t kk = 0; kk < ng - g; ++kk) sc[rr][kk] = bf16_to_f32(sr[rr][kk]);
                    }
                }
                const vline_f32 t0 = codes * sc[0][k], t1 = codes * sc[1][k], t2 = codes * sc[2][k],
                                t3 = codes * sc[3][k];
                for (int64_t c = 0; c < cpg; ++c) {
                    const int64_t j = (g * cpg + c) * 32;
                    if (b == 0 && pf <= pf_end) {
                        __builtin_prefetch(pf, 0, 2);
                        pf += 64;
                    }
                    const vline_f32 x0 = *(const vline_f32 *)(xb + j), x1 = *(const vline_f32 *)(xb + j + 16);
                    const vline_f32 xe = __builtin_shuffle(x0, x1, even), xo = __builtin_shuffle(x0, x1, odd);
                    a0 = int4_chunk(a0, w0 + j / 2, t0, xe, xo); a1 = int4_chunk(a1, w1 + j / 2, t1, xe, xo);
                    a2 = int4_chunk(a2, w2 + j / 2, t2, xe, xo); a3 = int4_chunk(a3, w3 + j / 2, t3, xe, xo);
                }
            }
            q_store_row(n, b, i0, vsum_f32(a0), bias, add, y);
            q_store_row(n, b, i0 + 1, vsum_f32(a1), bias, add, y);
            q_store_row(n, b, i0 + 2, vsum_f32(a2), bias, add, y);
            q_store_row(n, b, i0 + 3, vsum_f32(a3), bias, add, y);
            continue;
        }
#endif
        for (int64_t rr = 0; rr < r; ++rr) {
            const uint8_t *w = W + (i0 + rr) * mb;
            const uint16_t *sr = s + (i0 + rr) * ng;
            float a = 0;
            for (int64_t g = 0; g < ng; ++g) {
                const float sg = bf16_to_f32(sr[g]);
                for (int64_t j = g * group; j < (g + 1) * group; j += 2) {
                    const uint8_t v = w[j / 2];
                    a += (float)((int)(v & 15) - 8) * sg * xb[j];
                    a += (float)((int)(v >> 4) - 8) * sg * xb[j + 1];
                }
            }
            q_store_row(n, b, i0 + rr, a, bias, add, y);
        }
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
    if (nthreads > 1 && n * m >= 4 * PAR_MIN_ELEMS) {
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)")
        for (int64_t i0 = 0; i0 < n; i0 += 4) matvec_rows_int4(B, n, m, group, i0, W, s, bias, x, add, y);
    } else
        for (int64_t i0 = 0; i0 < n; i0 += 4) matvec_rows_int4(B, n, m, group, i0, W, s, bias, x, add, y);
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
