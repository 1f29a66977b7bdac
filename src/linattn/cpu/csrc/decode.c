/* Fused single-token decoding step of the delta-rule layers (DeltaNet, Gated DeltaNet, EFLA) and of linear
   attention (linear-space elementwise feature maps).

   The layer's projections stay one matrix-vector product in torch (BLAS reads the fused weights at the memory
   rate; nothing to win there) and o_proj another; everything between them is one call here: the short
   convolution (window in, new window out), q/k normalisation, beta / EFLA's coefficient, the decay, the state
   update, the read-out, the output RMSNorm and the SiLU gate. Without this the step is ~40 small torch ops per
   layer whose dispatch costs more than the arithmetic.

   Inputs are raw contiguous buffers. The new state and conv window are written to fresh buffers (never in
   place): a cache copied for beam search may still share the old ones. The arithmetic follows the PyTorch
   fast step (layers/delta.py, layers/linear_attention.py) operation by operation, in the same precisions
   (fp32 model: key norms and EFLA's coefficient in fp64, like ops/delta_core.key_norms); only summation order
   differs. No -ffast-math (the build never passes it): inf/NaN propagate as in torch.

   float and double from one body (this file includes itself once per REAL). SiLU, the L2 row ("rsqrt" form)
   and the RMSNorm rows come from common.h; the scalar exps of beta, the decays, softplus and softmax are libm's
   (MATH(f): f's float or double variant), one call per head or key, not per element. */
#ifndef LINATTN_DECODE_BODY
#define LINATTN_DECODE_BODY

#include "common.h"

LA_ABI_VERSION(decode, 7)

/* the most parts a fused product is read from (the plan's parts_W / parts_Wgu tables) */
#define PLAN_PARTS 8

/* parallelise over (batch, value head) only when the state is big enough to pay for waking the threads */
#define PAR_MIN_ELEMS 65536
/* rows of a head's state prefetched ahead in the first pass over it */
#define PF_ROWS 8
/* the next head's state, prefetched during a head's second pass: into L2 (a head is 64 KiB at 128 x 128 fp32) */
#define PF_NEXT_HINT _MM_HINT_T1

/* Where a decoded token's time goes (a developer's build: cpu/decode.py builds decode.c with LINATTN_DECODE_TIMING
   defined when the variable of that name is set at plan build; the library built without it has none of this). Each
   section's seconds and the bytes it read or wrote from memory (weights, states, KV cache) add up in process-wide
   counters over every call, read and reset by linattn_decode_timing; a lap is taken on the calling thread, around
   the parallel regions, so at n threads a section's time is its wall time. */
enum { LT_EMBED, LT_NORM, LT_QKV, LT_CONV, LT_STATE, LT_ATTN, LT_MIXER, LT_OUT, LT_RESID, LT_GATE_UP, LT_ACT, LT_DOWN,
       LT_MOE, LT_HEAD, LT_LOGITS, LT_SETUP, LT_TEARDOWN, LT_TOTAL, LT_N };
#if defined(LINATTN_DECODE_TIMING)
#include <time.h>
static double lt_sec[LT_N], lt_bytes[LT_N], lt_pending;
static int64_t lt_tokens;
static inline double lt_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
#define LT_START(t) double t = lt_now()
/* the time since t (and the bytes counted since the last lap) to section s; t restarts */
#define LT_LAP(t, s)                                                                             \
    do {                                                                                         \
        const double n_ = lt_now();                                                              \
        lt_sec[s] += n_ - (t), lt_bytes[s] += lt_pending, lt_pending = 0, (t) = n_;              \
    } while (0)
/* t restarts (a callee timed its own sections) */
#define LT_RESTART(t) ((t) = lt_now())
/* the time since t to section s and to "total" (the greedy loop's own work between its whole-model steps, which
   time themselves) */
#define LT_GLUE(t, s)                                                                            \
    do {                                                                                         \
        const double n_ = lt_now();                                                              \
        lt_sec[s] += n_ - (t), lt_sec[LT_TOTAL] += n_ - (t);                                     \
    } while (0)
#define LT_BYTES(n) (lt_pending += (double)(n))
/* out[0 .. LT_N) seconds, out[LT_N .. 2 LT_N) bytes, out[2 LT_N] whole-model calls; reset after reading when reset.
   Returns LT_N (the sections' count). */
int64_t linattn_decode_timing(double *out, int reset) {
    for (int s = 0; s < LT_N; ++s) out[s] = lt_sec[s], out[LT_N + s] = lt_bytes[s];
    out[2 * LT_N] = (double)lt_tokens;
    if (reset) {
        memset(lt_sec, 0, sizeof lt_sec), memset(lt_bytes, 0, sizeof lt_bytes);
        lt_tokens = 0, lt_pending = 0;
    }
    return LT_N;
}
#else
#define LT_START(t) ((void)0)
#define LT_LAP(t, s) ((void)0)
#define LT_RESTART(t) ((void)0)
#define LT_GLUE(t, s) ((void)0)
#define LT_BYTES(n) ((void)0)
#endif

/* A whole pre-norm block of one decoded token in one call (the per-op dispatch of ~15 torch calls per
   layer cost more than the weights' memory traffic):

       h = x + o_proj(mixer(rmsnorm1(x))),   x_out = h + w_down(silu(a) * b), [a | b] = w_gate_up(rmsnorm2(h))

   (no FFN: x_out = h); or post-norm (`postnorm`, OLMo-hybrid's attention blocks): the norms on the mixer's and the
   FFN's outputs, h = x + rmsnorm1(o_proj(mixer(x))), x_out = h + rmsnorm2(w_down(silu(a) * b)), [a | b] =
   w_gate_up(h). The mixer is the delta or linear step above on the fused projection y = W rmsnorm1(x) + Wb.
   Everything per layer that does not change from token to token is one plan (the struct below, built once in
   cpu/decode.py and checked against the parameters' versions there), so a token costs one call with 6
   buffers. The matrix-vector products read each weight row once, 4 rows at a time (memory-bound at batch 1). */
typedef struct {
    int64_t B, H, HV, K, V, d, ny, KC, hid;
    int32_t kind, conv_act, dkind, l2conv, q_l2, beta_mode, gated, fmap, gate_kind, normalize, nonneg, has_norm,
            has_gate, has_ffn, nthreads, wbf16;   /* wbf16: W, Wo, Wgu, Wd stored as bf16 (f32 compute only) */
    double l2eps, scale, eps, norm_eps, n1eps, n2eps;
    const void *n1w, *W, *Wb, *cw, *cb, *alpha, *neg_a, *dt_bias, *decay, *nw, *Wo, *n2w, *Wgu, *bgu, *Wd, *bd;
    /* softmax attention (kind 2; H query heads, kvh key/value heads of K / V, HV = H): q, k, v (and the gate's)
       projections Wq.. in the weights' storage, q/k RMSNorm weights qnw / knw (qk_norm 1: per head, [K]; 2: over
       the whole projection, [H*K] / [kvh*K], before the heads are split, OLMo-hybrid's), RoPE on the
       first rot channels of each head (inv_freq [rot/2] doubles; rope_f32: angles and cos / sin in float, times
       rope_scale, as transformers; else in double, as layers/common.RotaryEmbedding), an output gate (att_gate 1:
       its own projection Wg, 2: the second half of each head's q_proj rows, Qwen3-Next's; gate_sig: sigmoid, else
       SiLU). Set per call: the KV cache kc / vc [B, kv_cap, kvh, K / V] (bf16 when kv_bf16, else the plan's
       type), the new token's row kv_len, its position pos[b] (NULL: pos0 for every row) and its first visible
       key lo[b] (NULL: lo0). */
    int64_t kvh, rot, kv_cap, kv_len, pos0, lo0;
    int32_t att_gate, gate_sig, qk_norm, kv_bf16, rope_f32, pad2_;
    double qk_eps, rope_scale;
    const void *Wq, *bq, *Wk, *bk, *Wv, *bv, *Wg, *qnw, *knw, *inv_freq;
    void *kc, *vc;
    const int64_t *pos, *lo;
    /* the matrices' formats (qmatvec.h WF_*; 0: as wbf16 says), bf16 scales and int4 groups */
    int32_t fmt_W, fmt_Wo, fmt_Wgu, fmt_Wd, fmt_Wq, fmt_Wk, fmt_Wv, fmt_Wg;
    int64_t grp_W, grp_Wo, grp_Wgu, grp_Wd, grp_Wq, grp_Wk, grp_Wv, grp_Wg;
    const void *sc_W, *sc_Wo, *sc_Wgu, *sc_Wd, *sc_Wq, *sc_Wk, *sc_Wv, *sc_Wg;
    /* KDA (kind 4, decode_kda.h) and Mamba2 (kind 5, decode_mamba2.h). KDA: the gate's low-rank second stage Wf
       [HV*K, rank_f] (its first stage is in W), the output gate's Wg2 [HV*V, rank_g] + bg2 when low-rank
       (rank_g 0: a full-rank gate in W), gate_lb_on: fla's bounded gate gate_lb * sigmoid(-neg_a f) instead of
       neg_a softplus(f); gate_sig: the output gate's sigmoid. Mamba2: n_groups of B / C, dt clamped to
       [dt_lo, dt_hi], D skip Dsk ([H], or [H*P] with d_per_channel), norm_mode 0 y*silu(z), 1 RMSNorm(y*silu(z))
       (Mamba2's), 2 RMSNorm(y)*silu(z), over groups of H*P / n_groups. bo: o_proj's bias (any kind). */
    int64_t rank_f, rank_g, n_groups;
    int32_t gate_lb_on, norm_mode, d_per_channel, pad3_;
    double gate_lb, dt_lo, dt_hi;
    const void *Wf, *Wg2, *bg2, *Dsk, *bo;
    int32_t fmt_Wf, fmt_Wg2;
    int64_t grp_Wf, grp_Wg2;
    const void *sc_Wf, *sc_Wg2;
    /* ELA's maps: kind 3, log-space (decode_log.h; ela_map 0 Hadamard Exp, log_decay RetNet's log gamma [HV]),
       kind 6, linear-space (decode_ela.h; ela_map 1 / 2 squared-Euclidean sum / sub, 3 magnitude-direction) */
    int32_t ela_map, pad4_;
    const void *log_decay;
    /* the residual order: postnorm 0, pre-norm (above: n1w before the mixer, n2w before the FFN); 1, post-norm
       (OLMo-hybrid's attention blocks): h = x + rmsnorm_n1(mixer(x)), x_out = h + rmsnorm_n2(ffn(h)) */
    int32_t postnorm, pad5_;
    /* Fused products read from their parts (no concatenated copy of the weights): W's rows are nparts_W matrices
       stacked in order, part i at parts_W[i] with rows_W[i] rows (nparts_W 0: W is one matrix); likewise Wgu's
       (gate | up). Parts are in the plan's type or bf16 (a quantized fused product is one matrix). */
    int32_t nparts_W, nparts_Wgu;
    const void *parts_W[PLAN_PARTS];
    int64_t rows_W[PLAN_PARTS];
    const void *parts_Wgu[PLAN_PARTS];
    int64_t rows_Wgu[PLAN_PARTS];
    /* a mixture-of-experts feed-forward (ffn_kind 1, decode_moe.h; 0: the dense SwiGLU above): n_experts E, top_k
       k, renormalised top-k probabilities (norm_topk), the router Wr [E, d], the experts' fused gate | up Weg
       [E, 2 moe_hid, d] and down Wed [E, d, moe_hid] (in the weights' storage, as wbf16 says), the shared expert
       in Wgu / Wd (hid > 0) with its sigmoid gate Wsg [1, d] (NULL: ungated) */
    int64_t n_experts, top_k, moe_hid;
    int32_t ffn_kind, norm_topk;
    const void *Wr, *Weg, *Wed, *Wsg;
    /* Mamba2 (kind 5): state_pn 1 keeps a head's state as [P, N] (transformers' ssm state, no z column: the
       cache's own tensor is the plan's state), 0 as [N, P + 1] (linear attention's kv | z, linattn's layout) */
    int32_t state_pn, pad6_;
    /* MLA: multi-head latent attention (kind 7, decode_mla.h; H heads, V the value head dim dv, scale, the cache
       fields kc / vc / kv_cap / kv_len / pos / lo and the RoPE fields rot (0: none) / inv_freq / rope_scale of the
       softmax kind): kv_lora_rank mla_rank, qk_nope_head_dim mla_nope, qk_rope_head_dim mla_rope, q_lora_rank
       mla_qr (0: q in the first product), the head-wise sigmoid output gate (mla_gate), kv_b_proj mla_Wkb
       [H (nope + dv), rank], the latent's RMSNorm weight mla_kvnw, q_b_proj mla_Wqb and q_a's norm mla_qnw */
    int64_t mla_rank, mla_nope, mla_rope, mla_qr;
    int32_t mla_gate, pad_mla_;
    double mla_kv_eps, mla_q_eps;
    const void *mla_Wkb, *mla_kvnw, *mla_Wqb, *mla_qnw;
    /* MoE router mode 2 (decode_moe.h; 0: the softmax top-k above): DeepSeek-V3's sigmoid scores, the choice on
       scores + e_bias [E] (float) in moe_groups groups of which moe_topk_groups are kept, routed_scale times the
       (renormalised with norm_topk) scores; the router Wr bf16 when router_wbf16, else in the plan's type */
    int64_t moe_groups, moe_topk_groups;
    int32_t router, router_wbf16;
    double routed_scale;
    const void *e_bias;
    /* the scaled residual orders (res_scaled, pre-norm; out = a res + b branch, per half): 1, MiniMax's, the normed
       input as the residual: h = a1 rmsnorm_n1(x) + b1 o_proj(mixer(rmsnorm_n1(x))), x_out = a2 rmsnorm_n2(h) + b2
       ffn(rmsnorm_n2(h)); 2, Granite's residual multiplier: h = x + b1 o_proj(..), x_out = h + b2 ffn(..) (a1 = a2 =
       1). MiniMax's lightning attention is kind 8 (decode_lightning.h: the per-head decay exp(-slope) in `decay`
       [H], the norm over all heads' outputs in nw / norm_eps). */
    int32_t res_scaled, pad_mx_;
    double res_a1, res_b1, res_a2, res_b2;
    /* Granite / Nemotron-H. ffn_only: a block without a mixer, h = x, its one norm in n2w (Nemotron-H's MLP and MoE
       blocks). ffn_act 1: the FFN is non-gated, act = relu(u)^2 of its first product u = Wgu xn [hid] (Nemotron-H's
       relu2; the MoE experts' Weg [E, moe_hid, d] and the shared expert alike); 0: silu(a) * b of u = [a | b]
       [2 hid]. */
    int32_t ffn_only, ffn_act;
    /* (k46) quantized second products: MLA's kv_b_proj mla_Wkb and q_b_proj mla_Wqb (kind 7, decode_mla.h) and a
       MoE shared expert's gate Wsg (decode_moe.h), each with its format (qmatvec.h WF_*; 0: as wbf16 says), int4
       group and bf16 scales, as fmt_W.. */
    int32_t fmt_mla_Wkb, fmt_mla_Wqb, fmt_Wsg, pad_k46_;
    int64_t grp_mla_Wkb, grp_mla_Wqb, grp_Wsg;
    const void *sc_mla_Wkb, *sc_mla_Wqb, *sc_Wsg;
} linattn_block_plan;
LA_EXPORT_SIZEOF(block_plan)

/* The matrix-vector products stream every weight once per token (from memory at batch 1: the model is bigger
   than L2). A step reads one 64-byte line of each of four rows into four vector accumulators (GCC / clang vector
   types; the rows' lengths a multiple of a line), the rows of rowsched.h's schedule: rows i, i + q, i + 2q, i + 3q
   (q about n / 4), four sequential streams each prefetched Q_PF_BYTES ahead. Four neighbouring rows, the schedule
   before, restarted four short streams every step (a 4 KiB fp32 row of 1024 inputs each its own page, two bf16 rows a
   page), which the hardware prefetcher follows poorly. */
#include "rowsched.h"
#if defined(__GNUC__)
#define HAVE_VLINE 1
typedef float vline_f32 __attribute__((vector_size(64), aligned(4)));
typedef double vline_f64 __attribute__((vector_size(64), aligned(8)));
/* the sum of a line's elements, pairwise (the same order everywhere: the per-block and whole-model steps agree
   bit for bit) */
static inline float vsum_f32(vline_f32 a) {
    float t[16];
    memcpy(t, &a, sizeof t);
    for (int h = 8; h >= 1; h /= 2)
        for (int k = 0; k < h; ++k) t[k] += t[k + h];
    return t[0];
}
static inline double vsum_f64(vline_f64 a) {
    double t[8];
    memcpy(t, &a, sizeof t);
    for (int h = 4; h >= 1; h /= 2)
        for (int k = 0; k < h; ++k) t[k] += t[k + h];
    return t[0];
}
#endif




/* Where a product's weight rows are: one matrix W (nparts 0), or nparts matrices stacked by rows, part i at
   parts[i] with rows[i] rows (a fused product read from its parts). Rows are scheduled over the stacked rows, as
   in one concatenated matrix, so both give the same bits. */
typedef struct {
    const void *W;
    int nparts;
    const void *const *parts;
    const int64_t *rows;
} mv_src;

/* the address of row i of n rows of rowbytes bytes, and the end of the matrix or part holding it (where its
   stream's prefetch stops) */
static inline const char *mv_row_at(const mv_src *s, int64_t n, size_t rowbytes, int64_t i, const char **end) {
    if (!s->nparts) {
        *end = (const char *)s->W + (size_t)n * rowbytes;
        return (const char *)s->W + (size_t)i * rowbytes;
    }
    int p = 0;
    int64_t first = 0;
    while (p < s->nparts - 1 && i >= first + s->rows[p]) first += s->rows[p++];
    *end = (const char *)s->parts[p] + (size_t)s->rows[p] * rowbytes;
    return (const char *)s->parts[p] + (size_t)(i - first) * rowbytes;
}

/* the r (4 or 1) rows i0, i0 + stride, ... of a step (q_step_rows) from src: their addresses and ends */
static inline void mv_step_rows(const mv_src *s, int64_t n, size_t rowbytes, int64_t i0, int64_t stride, int r,
                                const char *w[4], const char *end[4]) {
    for (int k = 0; k < r; ++k) w[k] = mv_row_at(s, n, rowbytes, i0 + k * stride, &end[k]);
}

/* bf16 weights (the upper half of an fp32: converting is a 16-bit shift, exact), read by the matrix-vector
   products of an f32 plan with wbf16 set: half the bytes per decoded token, fp32 accumulation in the same order
   as the fp32 products over the bf16-rounded weights (one line of 16 weights per row and step, the same vector
   accumulators and pairwise sums), so the two agree to the last bit where both take the vector path. */
static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp32 -> bf16, rounded to nearest even (NaN kept a quiet NaN), as torch's .to(torch.bfloat16) */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if defined(HAVE_VLINE) && defined(__AVX512F__) && !defined(LINATTN_PLAIN_C)
#include <immintrin.h>
/* One line of 16 bf16 weights widened in a 512-bit register: one zero-extending load (vpmovzxwd from memory) and a
   shift. The vector types' generic code splits a line into two 256-bit halves wherever the compiler prefers 256-bit
   vectors (GCC's tuning for recent Xeons): three shuffles per line, which made the bf16 product compute-bound
   (~0.75 of the read rate at one thread, where the fp32 product keeps up). The same lanes and the same fused
   multiply-adds as the generic path: the same bits. */
#define BF16_ZMM 1
static inline __m512 bf16_zmm(const uint16_t *w) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)w)), 16));
}
#elif defined(HAVE_VLINE) && defined(__AVX2__) && defined(__FMA__) && !defined(LINATTN_PLAIN_C)
#include <immintrin.h>
/* AVX2 without AVX-512: GCC's generic code for a 16-lane widening (`bf16_line`, `i8_line`) goes element by element
   there (~2.5x slower than the fp32 product). A line is two 8-lane halves, each widened by one vpmovzxwd /
   vpmovsxbd: the same lanes and fused multiply-adds as the generic path, so the same bits. */
#define LINE_YMM 1
static inline __m256 bf16_ymm(const uint16_t *w) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w)), 16));
}
/* a line from its two halves (lanes 0-7, 8-15) */
static inline vline_f32 vline_of(__m256 lo, __m256 hi) {
    vline_f32 v;
    memcpy(&v, &lo, sizeof lo);
    memcpy((char *)&v + sizeof lo, &hi, sizeof hi);
    return v;
}
/* vsum_f32 of the line lo | hi in registers: lane k + 8 onto k, then + 4, + 2, + 1, each sum low + high as there
   (GCC's code for vsum_f32 of a line built by vline_of went through the stack) */
static inline float vsum_ymm(__m256 lo, __m256 hi) {
    const __m256 s8 = _mm256_add_ps(lo, hi);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
/* Four rows R0 .. R3 times X over [0, N) (N a multiple of 16) into 8 half-line accumulators l0 / h0 .. l3 / h3,
   declared here (a statement list: put it in a block), the rows' elements widened 8 at a time by WIDEN(p); PF run
   at the steps j where PFWHEN holds. The generic 16-lane loops' lanes and fmas (row element times x, onto the
   accumulator): the same bits. */
#define YMM_DOT4(WIDEN, X, R0, R1, R2, R3, N, PFWHEN, PF)                                                        \
    __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0, l3 = l0, h3 = l0;              \
    for (int64_t j = 0; j < (N); j += 16) {                                                                      \
        if (PFWHEN) { PF; }                                                                                      \
        const __m256 xl = _mm256_loadu_ps((X) + j), xh = _mm256_loadu_ps((X) + j + 8);                           \
        l0 = _mm256_fmadd_ps(WIDEN((R0) + j), xl, l0); h0 = _mm256_fmadd_ps(WIDEN((R0) + j + 8), xh, h0);        \
        l1 = _mm256_fmadd_ps(WIDEN((R1) + j), xl, l1); h1 = _mm256_fmadd_ps(WIDEN((R1) + j + 8), xh, h1);        \
        l2 = _mm256_fmadd_ps(WIDEN((R2) + j), xl, l2); h2 = _mm256_fmadd_ps(WIDEN((R2) + j + 8), xh, h2);        \
        l3 = _mm256_fmadd_ps(WIDEN((R3) + j), xl, l3); h3 = _mm256_fmadd_ps(WIDEN((R3) + j + 8), xh, h3);        \
    }
/* The 4-row loop of the AVX2 products (fp32, bf16 and int8 rows w0 .. w3 times xb, inputs [0, N)): YMM_DOT4 with
   PF (the rows' prefetches) at the steps j with (j & PFMASK) == 0 of batch row 0; a0 .. a3 get the lines. */
#define YMM_ROWS4(WIDEN, N, PFMASK, PF)                                                                          \
    do {                                                                                                         \
        YMM_DOT4(WIDEN, xb, w0, w1, w2, w3, N, b == 0 && (j & (PFMASK)) == 0, PF)                                \
        a0 = vline_of(l0, h0); a1 = vline_of(l1, h1); a2 = vline_of(l2, h2); a3 = vline_of(l3, h3);              \
    } while (0)
#endif
#if defined(HAVE_VLINE)
typedef uint16_t vhalf_u16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t vline_u32 __attribute__((vector_size(64)));
static inline vline_f32 bf16_line(const uint16_t *w) {
#if defined(LINE_YMM)
    return vline_of(bf16_ymm(w), bf16_ymm(w + 8));
#else
    const vline_u32 u = __builtin_convertvector(*(const vhalf_u16 *)w, vline_u32) << 16;
    vline_f32 f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}
#endif

/* the r rows i0, i0 + stride, ... (q_step_rows) of y = add + W x + bias, W [n, m] bf16 from src (matvec_rows_f32's
   loops on converted weights) */
static void matvec_rows_bf16(int64_t B, int64_t n, int64_t m, int64_t i0, int64_t stride, int r, const mv_src *src,
                             const float *bias, const float *x, const float *add, float *y) {
    const char *wr[4], *end[4];
    mv_step_rows(src, n, sizeof(uint16_t) * (size_t)m, i0, stride, r, wr, end);
#if defined(HAVE_VLINE)
    if (r == 4 && m % 16 == 0) {
        const uint16_t *w0 = (const uint16_t *)wr[0], *w1 = (const uint16_t *)wr[1], *w2 = (const uint16_t *)wr[2],
                       *w3 = (const uint16_t *)wr[3];
        for (int64_t b = 0; b < B; ++b) {
            const float *xb = x + b * m;
            vline_f32 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
#if defined(BF16_ZMM)
            __m512 z0 = _mm512_setzero_ps(), z1 = z0, z2 = z0, z3 = z0;
            for (int64_t j = 0; j < m; j += 16) {
                if (b == 0 && (j & 31) == 0) {   /* a line of each stream per 2 steps */
                    Q_PF(w0 + j, end[0]); Q_PF(w1 + j, end[1]); Q_PF(w2 + j, end[2]); Q_PF(w3 + j, end[3]);
                }
                const __m512 xv = _mm512_loadu_ps(xb + j);
                z0 = _mm512_fmadd_ps(bf16_zmm(w0 + j), xv, z0); z1 = _mm512_fmadd_ps(bf16_zmm(w1 + j), xv, z1);
                z2 = _mm512_fmadd_ps(bf16_zmm(w2 + j), xv, z2); z3 = _mm512_fmadd_ps(bf16_zmm(w3 + j), xv, z3);
            }
            memcpy(&a0, &z0, sizeof a0); memcpy(&a1, &z1, sizeof a1);
            memcpy(&a2, &z2, sizeof a2); memcpy(&a3, &z3, sizeof a3);
#elif defined(LINE_YMM)
            YMM_ROWS4(bf16_ymm, m, 31, Q_PF(w0 + j, end[0]); Q_PF(w1 + j, end[1]); Q_PF(w2 + j, end[2]);
                                      Q_PF(w3 + j, end[3]));   /* (a line of each stream per 2 steps) */
#else
            for (int64_t j = 0; j < m; j += 16) {
                if (b == 0 && (j & 31) == 0) {   /* a line of each stream per 2 steps */
                    Q_PF(w0 + j, end[0]); Q_PF(w1 + j, end[1]); Q_PF(w2 + j, end[2]); Q_PF(w3 + j, end[3]);
                }
                const vline_f32 xv = *(const vline_f32 *)(xb + j);
                a0 += bf16_line(w0 + j) * xv; a1 += bf16_line(w1 + j) * xv;
                a2 += bf16_line(w2 + j) * xv; a3 += bf16_line(w3 + j) * xv;
            }
#endif
            const float acc[4] = {vsum_f32(a0), vsum_f32(a1), vsum_f32(a2), vsum_f32(a3)};
            for (int k = 0; k < 4; ++k) {
                const int64_t i = i0 + k * stride;
                float v = acc[k];
                if (bias) v = v + bias[i];
                y[b * n + i] = add ? add[b * n + i] + v : v;
            }
        }
        return;
    }
#endif
    for (int64_t b = 0; b < B; ++b) {
        const float *restrict xb = x + b * m;
        float acc[4] = {0, 0, 0, 0};
        if (r == 4) {
            const uint16_t *restrict w0 = (const uint16_t *)wr[0], *restrict w1 = (const uint16_t *)wr[1],
                           *restrict w2 = (const uint16_t *)wr[2], *restrict w3 = (const uint16_t *)wr[3];
            float a0 = 0, a1 = 0, a2 = 0, a3 = 0;
#pragma omp simd reduction(+:a0,a1,a2,a3)
            for (int64_t j = 0; j < m; ++j) {
                const float xj = xb[j];
                a0 += bf16_to_f32(w0[j]) * xj; a1 += bf16_to_f32(w1[j]) * xj;
                a2 += bf16_to_f32(w2[j]) * xj; a3 += bf16_to_f32(w3[j]) * xj;
            }
            acc[0] = a0; acc[1] = a1; acc[2] = a2; acc[3] = a3;
        } else
            for (int k = 0; k < r; ++k) {
                const uint16_t *restrict w = (const uint16_t *)wr[k];
                float a = 0;
#pragma omp simd reduction(+:a)
                for (int64_t j = 0; j < m; ++j) a += bf16_to_f32(w[j]) * xb[j];
                acc[k] = a;
            }
        for (int k = 0; k < r; ++k) {
            const int64_t i = i0 + k * stride;
            float v = acc[k];
            if (bias) v = v + bias[i];
            y[b * n + i] = add ? add[b * n + i] + v : v;
        }
    }
}

static void matvec_src_bf16(int64_t B, int64_t n, int64_t m, const mv_src *src, const float *bias, const float *x,
                            const float *add, float *y, int nthreads) {
    Q_FOR_STEPS(n, nthreads > 1 && n * m >= PAR_MIN_ELEMS,
                matvec_rows_bf16(B, n, m, i0, stride, r, src, bias, x, add, y));
}

static void matvec_bf16(int64_t B, int64_t n, int64_t m, const uint16_t *W, const float *bias, const float *x,
                        const float *add, float *y, int nthreads) {
    const mv_src src = {W, 0, NULL, NULL};
    matvec_src_bf16(B, n, m, &src, bias, x, add, y, nthreads);
}

#include "qmatvec.h"

#if defined(LINATTN_DECODE_TIMING)
/* the bytes a product over W [n, m] in format fmt reads (real: the plan's element size for fp32 / fp64 weights) */
static double lt_weight_bytes(int fmt, int64_t n, int64_t m, int64_t grp, size_t real) {
    switch (fmt) {
    case WF_BF16: return 2.0 * (double)n * (double)m;
    case WF_INT8: case WF_INT8_A8: return (double)n * (double)m + 2.0 * (double)n;
    case WF_INT4: case WF_INT4_A8: return 0.5 * (double)n * (double)m + 2.0 * (double)n * (double)(m / (grp ? grp : 1));
    default: return (double)real * (double)n * (double)m;
    }
}
#endif

/* The whole model's decoding step in one call (with one call per block, the Python around the calls
   cost more than half the weights' memory traffic): the token embedding, every block (linattn_decode_block, so
   the blocks' arithmetic is the per-block call's, bit for bit), the final RMSNorm and the head.

       x = embed[ids],   x = block_l(x) for l = 0 .. L-1,   logits = head rmsnorm(x)    (no final norm: head x)

   The states and conv windows of all layers live in one buffer each (layer l's at s_off[l] / w_off[l]
   elements; w_off[l] < 0: no short convolution), read from S_in / w_in (NULL before the first token) and
   written to fresh S_out / w_out (never in place). Everything fixed while the parameters are is one plan. */
typedef struct {
    int64_t L, B, d, vocab;
    int32_t has_norm, nthreads, wbf16, pad_;     /* wbf16: embed and head bf16, logits written as bf16 */
    double norm_eps;
    const void *embed, *norm_w, *head;           /* embed [vocab, d], norm_w [d] or NULL, head [vocab, d] */
    const linattn_block_plan *const *blocks;     /* L plans */
    const int64_t *s_off, *w_off;                /* L offsets (elements) into the state / window buffers */
    int32_t fmt_head, pad2_;                     /* the head's format (qmatvec.h WF_*; 0: as wbf16 says) */
    int64_t grp_head;                            /* its int4 group */
    const void *sc_head;                         /* its bf16 scales */
    /* Granite / Nemotron-H: the embedded row times emb_scale (emb_scaled: Granite's embedding_multiplier), the
       logits divided by logits_div (logits_scaled: Granite's logits_scaling) */
    int32_t emb_scaled, logits_scaled;
    double emb_scale, logits_div;
    /* set per call (NULL: S_in + s_off[l]): layer l's input state at s_in_at[l] (NULL: none yet), the cache's own
       entries on the first token after another path wrote them, instead of a gathered copy of every state */
    const void *const *s_in_at;
    /* set per call (NULL: the buffers): layer l's conv window as transformers keeps it at w_io_at[l] (NULL: w_in /
       w_out + w_off[l]), its conv state [B, C, KC] read and advanced in place to [old[1:] | x] (kinds 0, 1, 4, 5) */
    void *const *w_io_at;
} linattn_model_plan;
LA_EXPORT_SIZEOF(model_plan)

/* every weight matrix's product in the block plans' argument order: f32 plans read fp32, bf16, int8 or int4
   (qmatvec.h), f64 plans fp64 only */
static void matvec_f64(int64_t B, int64_t n, int64_t m, const double *W, const double *bias, const double *x,
                       const double *add, double *y, int nthreads);
static inline void weight_product_f32(int fmt, const void *sc, int64_t grp, int64_t B, int64_t n, int64_t m,
                                      const void *W, const float *bias, const float *x, const float *add, float *y,
                                      int nthreads) {
    LT_BYTES(lt_weight_bytes(fmt, n, m, grp, sizeof(float)));
    matvec_w_f32(fmt, W, sc, grp, B, n, m, bias, x, add, y, nthreads);
}
static inline void weight_product_f64(int fmt, const void *sc, int64_t grp, int64_t B, int64_t n, int64_t m,
                                      const void *W, const double *bias, const double *x, const double *add, double *y,
                                      int nthreads) {
    (void)fmt, (void)sc, (void)grp;
    LT_BYTES(lt_weight_bytes(WF_PLAN, n, m, 0, sizeof(double)));
    matvec_f64(B, n, m, (const double *)W, bias, x, add, y, nthreads);
}

/* the dispatch as an entry point, for tests and benchmarks (cpu/decode.py `weight_matvec`) */
void linattn_decode_matvec_f32(int fmt, const void *W, const void *scales, int64_t group, int64_t B, int64_t n,
                               int64_t m, const float *bias, const float *x, const float *add, float *y, int nthreads) {
    matvec_w_f32(fmt, W, scales, group, B, n, m, bias, x, add, y, nthreads);
}

#include "decode_moe.h" /* (the routing: moe_route_row) */

/* the routing as an entry point (tests): R rows of E logits -> idx [R, k] (increasing), w [R, k]. Returns 0, or
   1 when out of memory. */
int linattn_decode_moe_route(int64_t R, int64_t E, int64_t k, int norm, const float *logits, int64_t *idx,
                             float *w) {
    moe_elem *buf = (moe_elem *)malloc(sizeof(moe_elem) * (size_t)(E + 1));
    if (!buf) return 1;
    for (int64_t r = 0; r < R; ++r) moe_route_row(E, k, norm, logits + r * E, buf, idx + r * k, w + r * k);
    free(buf);
    return 0;
}

/* router mode 2 as an entry point (tests): R rows of E logits -> idx [R, k] (increasing), w [R, k]. Returns 0,
   or 1 when out of memory. */
int linattn_decode_moe_route_grouped(int64_t R, int64_t E, int64_t k, int64_t G, int64_t kg, int norm, double scale,
                                     const float *logits, const float *bias, int64_t *idx, float *w) {
    moe_elem *buf = (moe_elem *)malloc(sizeof(moe_elem) * (size_t)(E + 1));
    float *f = (float *)malloc(sizeof(float) * (size_t)(E + G + 1));
    if (!buf || !f) { free(buf); free(f); return 1; }
    for (int64_t r = 0; r < R; ++r)
        moe_route_grouped_row(E, k, G, kg, norm, (float)scale, logits + r * E, bias, buf, f + E, f, idx + r * k,
                              w + r * k);
    free(buf); free(f);
    return 0;
}

#define REAL float
#define FN(name) name##_f32
#define MATH(name) name##f
#define REAL_IS_FLOAT 1   /* (bf16 weights: f32 plans only) */
#include "decode.c"
#undef REAL
#undef FN
#undef MATH
#undef REAL_IS_FLOAT

#define REAL double
#define FN(name) name##_f64
#define MATH(name) name
#define REAL_IS_FLOAT 0
#include "decode.c"
#undef REAL
#undef FN
#undef MATH
#undef REAL_IS_FLOAT

#else /* ------------------------------------------------------------------ the body, once per REAL */
#include "common.h" /* its per-REAL part: la_silu, la_l2_row, la_rms_rstd */

static REAL FN(softplus)(REAL x) { return x > (REAL)20 ? x : MATH(log1p)(MATH(exp)(x)); }

/* x[n] L2-normalised in place (ops/l2norm.py): conv 0 "rsqrt" x * rsqrt(sum x^2 + eps) by common.h's row,
   1 "clamp" x / max(||x||, eps). A row whose sum of squares is not finite is divided by common.h's scale
   s = max(max |x|, 1) first (NaN when the row holds a NaN, and then the whole row is NaN, as in torch). */
static void FN(l2norm)(REAL *restrict x, int64_t n, int conv, REAL eps) {
    REAL r, s = 1;
    if (conv == 0) {
        FN(la_l2_row)(x, n, eps, &r, &s);
        if (s == 1) {   /* (the finite row: x / 1 is x to the bit, and the division is the loop's cost) */
            LA_SIMD
            for (int64_t i = 0; i < n; ++i) x[i] = x[i] * r;
            return;
        }
        LA_SIMD
        for (int64_t i = 0; i < n; ++i) x[i] = (x[i] / s) * r;
        return;
    }
    REAL ss = 0;
    LA_SIMD_SUM(ss)
    for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
    if (!isfinite(ss)) {
        FN(la_l2_row)(x, n, 0, &r, &s);   /* (for its s) */
        ss = 0;
        for (int64_t i = 0; i < n; ++i) ss += (x[i] / s) * (x[i] / s);
    }
    const REAL nrm = MATH(sqrt)(ss), lo = eps / s;
    const REAL den = nrm > lo ? nrm : (isnan(nrm) ? nrm : lo);
    for (int64_t i = 0; i < n; ++i) x[i] = (x[i] / s) / den;
}

/* a row's convolution outputs u [C] plus the bias cb (or none), then SiLU'd when act: in their own passes (a branch
   inside the taps' pass made the compiler mask every lane's SiLU: 3x the time) */
LA_INLINE void FN(conv_bias_act)(int64_t C, const REAL *cb, int act, REAL *restrict ub) {
    if (cb) {
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) ub[c] += cb[c];
    }
    if (act) {
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) ub[c] = FN(la_silu)(ub[c]);
    }
}

#if defined(LINE_YMM) && REAL_IS_FLOAT && defined(LA_EXPF_YMM)
/* conv_bias_act on the AVX2 taps pass's 8 outputs, inside that pass (the SiLU's arithmetic under the window's and
   taps' reads instead of a pass of its own): the bias added, then la_silu_ymm (la_silu's bits) */
LA_INLINE __m256 FN(conv_out_ymm)(__m256 acc, const float *cb, int act) {
    if (cb) acc = _mm256_add_ps(acc, _mm256_loadu_ps(cb));
    return act ? la_silu_ymm(acc) : acc;
}
#endif

/* the conv's AVX2 passes ask for their window's and taps' lines this many channels ahead */
#define CONV_PF_CH 64

/* the short convolution of one token over the first C channels of y [B, ldy] (q | k | v) into u [B, C]:
   window w_in [B, C, KC-1] (NULL: zeros) then the token; new window to w_out [B, C, KC-1]. */
static void FN(conv)(int64_t B, int64_t C, int64_t KC, const REAL *y, int64_t ldy, const REAL *w_in,
                     const REAL *cw, const REAL *cb, int act, REAL *w_out, REAL *u) {
    const int64_t W = KC - 1;
    if (W == 3 && w_in) {   /* the default kernel size 4: the taps and the window's shift in one vectorised pass
                               per row, then the bias and the SiLU in their own (a branch inside the first pass
                               made the compiler mask every lane's SiLU: 3x the time); on AVX2 (float) the bias
                               and the SiLU inside the taps pass, in intrinsics (conv_out_ymm) */
        for (int64_t b = 0; b < B; ++b) {
            const REAL *restrict wi = w_in + b * C * 3, *restrict yb = y + b * ldy;
            REAL *restrict wo = w_out + b * C * 3, *restrict ub = u + b * C;
            int64_t c0 = 0;
#if defined(LINE_YMM) && REAL_IS_FLOAT
            /* AVX2: 8 channels a step, their window [8, 3] and taps [8, 4] deinterleaved by blends and one permute
               per row (GCC's code for the loop below took ~110 instructions a step), the new window as the old one
               shifted by an element with the token blended in. The same fmas in the same order as the loop (acc
               from +0, then the taps in order): the same bits. The last step reads one element past its window
               (the shifted load), so it is left to the loop. */
            {
                const __m256 zero = _mm256_setzero_ps();
                const __m256i ia = _mm256_setr_epi32(0, 3, 6, 1, 4, 7, 2, 5),
                              ib = _mm256_setr_epi32(1, 4, 7, 2, 5, 0, 3, 6),
                              ic = _mm256_setr_epi32(2, 5, 0, 3, 6, 1, 4, 7),
                              it = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7),   /* (the taps' unpacks' order) */
                              ix0 = _mm256_setr_epi32(0, 0, 0, 0, 0, 1, 1, 1),
                              ix1 = _mm256_setr_epi32(2, 2, 2, 3, 3, 3, 4, 4),
                              ix2 = _mm256_setr_epi32(5, 5, 5, 5, 6, 6, 6, 7);
                for (; c0 + 8 < C; c0 += 8) {
                    const float *w3 = wi + 3 * c0, *t4 = cw + 4 * c0;
                    /* the window's and taps' lines CONV_PF_CH channels ahead (from memory: a layer's weights
                       passed through the caches since the last token) */
                    if (c0 + CONV_PF_CH + 8 <= C) {   /* (no pointer formed past the window's or the taps' end) */
                        __builtin_prefetch(w3 + 3 * CONV_PF_CH, 0, 3);
                        __builtin_prefetch(w3 + 3 * CONV_PF_CH + 16, 0, 3);
                        __builtin_prefetch(t4 + 4 * CONV_PF_CH, 0, 3);
                        __builtin_prefetch(t4 + 4 * CONV_PF_CH + 16, 0, 3);
                    }
                    const __m256 v0 = _mm256_loadu_ps(w3), v1 = _mm256_loadu_ps(w3 + 8),
                                 v2 = _mm256_loadu_ps(w3 + 16);
                    const __m256 xa = _mm256_permutevar8x32_ps(
                        _mm256_blend_ps(_mm256_blend_ps(v0, v1, 0x92), v2, 0x24), ia);
                    const __m256 xb = _mm256_permutevar8x32_ps(
                        _mm256_blend_ps(_mm256_blend_ps(v0, v1, 0x24), v2, 0x49), ib);
                    const __m256 xc = _mm256_permutevar8x32_ps(
                        _mm256_blend_ps(_mm256_blend_ps(v0, v1, 0x49), v2, 0x92), ic);
                    const __m256 u0 = _mm256_loadu_ps(t4), u1 = _mm256_loadu_ps(t4 + 8),
                                 u2 = _mm256_loadu_ps(t4 + 16), u3 = _mm256_loadu_ps(t4 + 24);
                    const __m256d l01 = _mm256_castps_pd(_mm256_unpacklo_ps(u0, u1)),
                                  h01 = _mm256_castps_pd(_mm256_unpackhi_ps(u0, u1)),
                                  l23 = _mm256_castps_pd(_mm256_unpacklo_ps(u2, u3)),
                                  h23 = _mm256_castps_pd(_mm256_unpackhi_ps(u2, u3));
                    const __m256 k0 = _mm256_permutevar8x32_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(l01, l23)), it),
                                 k1 = _mm256_permutevar8x32_ps(_mm256_castpd_ps(_mm256_unpackhi_pd(l01, l23)), it),
                                 k2 = _mm256_permutevar8x32_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(h01, h23)), it),
                                 k3 = _mm256_permutevar8x32_ps(_mm256_castpd_ps(_mm256_unpackhi_pd(h01, h23)), it);
                    const __m256 xt = _mm256_loadu_ps(yb + c0);
                    __m256 acc = _mm256_fmadd_ps(xa, k0, zero);
                    acc = _mm256_fmadd_ps(xb, k1, acc);
                    acc = _mm256_fmadd_ps(xc, k2, acc);
                    acc = _mm256_fmadd_ps(xt, k3, acc);
                    _mm256_storeu_ps(ub + c0, FN(conv_out_ymm)(acc, cb ? cb + c0 : NULL, act));
                    float *o3 = wo + 3 * c0;
                    const __m256 p0 = _mm256_permutevar8x32_ps(xt, ix0), p1 = _mm256_permutevar8x32_ps(xt, ix1),
                                 p2 = _mm256_permutevar8x32_ps(xt, ix2);
                    _mm256_storeu_ps(o3, _mm256_blend_ps(_mm256_loadu_ps(w3 + 1), p0, 0x24));
                    _mm256_storeu_ps(o3 + 8, _mm256_blend_ps(_mm256_loadu_ps(w3 + 9), p1, 0x49));
                    _mm256_storeu_ps(o3 + 16, _mm256_blend_ps(_mm256_loadu_ps(w3 + 17), p2, 0x92));
                }
            }
#endif
#pragma omp simd
            for (int64_t c = c0; c < C; ++c) {
                const REAL *wc = cw + c * 4, xt = yb[c];
                REAL acc = 0;
                acc += wi[3 * c] * wc[0]; acc += wi[3 * c + 1] * wc[1]; acc += wi[3 * c + 2] * wc[2];
                acc += xt * wc[3];
                ub[c] = acc;
                wo[3 * c] = wi[3 * c + 1]; wo[3 * c + 1] = wi[3 * c + 2]; wo[3 * c + 2] = xt;
            }
            FN(conv_bias_act)(C - c0, cb ? cb + c0 : NULL, act, ub + c0); /* (the rows past the AVX2 steps) */
        }
        return;
    }
    for (int64_t b = 0; b < B; ++b)
        for (int64_t c = 0; c < C; ++c) {
            const REAL *win = w_in ? w_in + (b * C + c) * W : NULL;
            const REAL *wc = cw + c * KC;
            REAL *wo = w_out + (b * C + c) * W;
            REAL xt = y[b * ldy + c], acc = 0;
            for (int64_t j = 0; j < W; ++j) acc += (win ? win[j] : (REAL)0) * wc[j];
            acc += xt * wc[W];
            if (cb) acc += cb[c];
            u[b * C + c] = act ? FN(la_silu)(acc) : acc;
            for (int64_t j = 0; j + 1 < W; ++j) wo[j] = win ? win[j + 1] : (REAL)0;
            if (W > 0) wo[W - 1] = xt;
        }
}

/* FN(conv) on a window kept as transformers keeps it: w [B, C, KC] (a GDN layer's conv state, the last KC inputs,
   `[old[1:] | x]` after each step), whose last KC - 1 columns are the window, advanced in place to [w[1:] | token]
   in the same pass (transformers' conv state is then what its own update writes, and no shift is left to do
   outside the call). The same operations in the same order as FN(conv) on the window w[.., 1:]: the same bits.
   In place, so no restrict: a channel reads its own row before it writes it, and no other. */
static void FN(conv_io)(int64_t B, int64_t C, int64_t KC, const REAL *y, int64_t ldy, REAL *w, const REAL *cw,
                        const REAL *cb, int act, REAL *u) {
    const int64_t W = KC - 1;
    if (W == 3) {   /* (FN(conv)'s vectorised pass, its window now rows of 4 from +1) */
        for (int64_t b = 0; b < B; ++b) {
            REAL *wb = w + b * C * 4, *restrict ub = u + b * C;
            const REAL *yb = y + b * ldy;
            int64_t c0 = 0;
#if defined(LINE_YMM) && REAL_IS_FLOAT
            /* AVX2: 8 channels a step, their rows [8, 4] and the taps [8, 4] transposed alike (unpacks and one
               permute); the new rows are the old ones loaded from +1 with the token blended in as each row's last.
               Every load before the stores; the last step's shifted load reads one element past its rows, so it
               is left to the loop. */
            {
                const __m256 zero = _mm256_setzero_ps();
                const __m256i it = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7),
                              ix0 = _mm256_setr_epi32(0, 0, 0, 0, 0, 0, 0, 1),
                              ix1 = _mm256_setr_epi32(2, 2, 2, 2, 2, 2, 2, 3),
                              ix2 = _mm256_setr_epi32(4, 4, 4, 4, 4, 4, 4, 5),
                              ix3 = _mm256_setr_epi32(6, 6, 6, 6, 6, 6, 6, 7);
                for (; c0 + 8 < C; c0 += 8) {
                    float *w4 = wb + 4 * c0;
                    const float *t4 = cw + 4 * c0;
                    /* (as FN(conv): the rows and taps CONV_PF_CH channels ahead) */
                    if (c0 + CONV_PF_CH + 8 <= C) {   /* (as there: inside the rows and the taps) */
                        __builtin_prefetch(w4 + 4 * CONV_PF_CH, 1, 3);
                        __builtin_prefetch(w4 + 4 * CONV_PF_CH + 16, 1, 3);
                        __builtin_prefetch(t4 + 4 * CONV_PF_CH, 0, 3);
                        __builtin_prefetch(t4 + 4 * CONV_PF_CH + 16, 0, 3);
                    }
#define LA_T4(r0, r1, r2, r3, c1, c2, c3, c4)                                                                   \
    do {                                                                                                        \
        const __m256d l01 = _mm256_castps_pd(_mm256_unpacklo_ps(r0, r1)),                                       \
                      h01 = _mm256_castps_pd(_mm256_unpackhi_ps(r0, r1)),                                       \
                      l23 = _mm256_castps_pd(_mm256_unpacklo_ps(r2, r3)),                                       \
                      h23 = _mm256_castps_pd(_mm256_unpackhi_ps(r2, r3));                                       \
        c1 = _mm256_permutevar8x32_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(l01, l23)), it);                      \
        c2 = _mm256_permutevar8x32_ps(_mm256_castpd_ps(_mm256_unpackhi_pd(l01, l23)), it);                      \
        c3 = _mm256_permutevar8x32_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(h01, h23)), it);                      \
        c4 = _mm256_permutevar8x32_ps(_mm256_castpd_ps(_mm256_unpackhi_pd(h01, h23)), it);                      \
    } while (0)
                    const __m256 v0 = _mm256_loadu_ps(w4), v1 = _mm256_loadu_ps(w4 + 8),
                                 v2 = _mm256_loadu_ps(w4 + 16), v3 = _mm256_loadu_ps(w4 + 24);
                    const __m256 s0 = _mm256_loadu_ps(w4 + 1), s1 = _mm256_loadu_ps(w4 + 9),
                                 s2 = _mm256_loadu_ps(w4 + 17), s3 = _mm256_loadu_ps(w4 + 25);
                    __m256 xo, xa, xb, xc, k0, k1, k2, k3;
                    LA_T4(v0, v1, v2, v3, xo, xa, xb, xc);
                    LA_T4(_mm256_loadu_ps(t4), _mm256_loadu_ps(t4 + 8), _mm256_loadu_ps(t4 + 16),
                          _mm256_loadu_ps(t4 + 24), k0, k1, k2, k3);
#undef LA_T4
                    (void)xo;   /* (the oldest input: out of the window) */
                    const __m256 xt = _mm256_loadu_ps(yb + c0);
                    __m256 acc = _mm256_fmadd_ps(xa, k0, zero);
                    acc = _mm256_fmadd_ps(xb, k1, acc);
                    acc = _mm256_fmadd_ps(xc, k2, acc);
                    acc = _mm256_fmadd_ps(xt, k3, acc);
                    _mm256_storeu_ps(ub + c0, FN(conv_out_ymm)(acc, cb ? cb + c0 : NULL, act));
                    _mm256_storeu_ps(w4, _mm256_blend_ps(s0, _mm256_permutevar8x32_ps(xt, ix0), 0x88));
                    _mm256_storeu_ps(w4 + 8, _mm256_blend_ps(s1, _mm256_permutevar8x32_ps(xt, ix1), 0x88));
                    _mm256_storeu_ps(w4 + 16, _mm256_blend_ps(s2, _mm256_permutevar8x32_ps(xt, ix2), 0x88));
                    _mm256_storeu_ps(w4 + 24, _mm256_blend_ps(s3, _mm256_permutevar8x32_ps(xt, ix3), 0x88));
                }
            }
#endif
#pragma omp simd
            for (int64_t c = c0; c < C; ++c) {
                const REAL *wc = cw + c * 4, xt = yb[c];
                REAL *r = wb + 4 * c;
                const REAL a0 = r[1], a1 = r[2], a2 = r[3];
                REAL acc = 0;
                acc += a0 * wc[0]; acc += a1 * wc[1]; acc += a2 * wc[2];
                acc += xt * wc[3];
                ub[c] = acc;
                r[0] = a0; r[1] = a1; r[2] = a2; r[3] = xt;
            }
            FN(conv_bias_act)(C - c0, cb ? cb + c0 : NULL, act, ub + c0); /* (the rows past the AVX2 steps) */
        }
        return;
    }
    for (int64_t b = 0; b < B; ++b)
        for (int64_t c = 0; c < C; ++c) {
            REAL *r = w + (b * C + c) * KC;
            const REAL *wc = cw + c * KC;
            REAL xt = y[b * ldy + c], acc = 0;
            for (int64_t j = 0; j < W; ++j) acc += r[j + 1] * wc[j];
            acc += xt * wc[W];
            if (cb) acc += cb[c];
            u[b * C + c] = act ? FN(la_silu)(acc) : acc;
            for (int64_t j = 0; j < W; ++j) r[j] = r[j + 1];
            r[W] = xt;
        }
}

/* RMSNorm over V (weight nw or NULL) and the SiLU gate (g or NULL), in place */
static void FN(outnorm)(REAL *restrict o, int64_t V, int has_norm, const REAL *nw, double eps,
                        const REAL *g) {
    if (has_norm) {
        const REAL r = FN(la_rms_rstd)(o, V, (REAL)eps);
        for (int64_t j = 0; j < V; ++j) o[j] = o[j] * r * (nw ? nw[j] : (REAL)1);
    }
    if (g) {
#pragma omp simd
        for (int64_t j = 0; j < V; ++j) o[j] *= FN(la_silu)(g[j]);
    }
}

/* The delta rule's q / k of one token, in place in u [B, C] (q H*K | k H*K | ...): kind 0 both l2-normalised
   (l2conv), 1 (EFLA) q by "rsqrt" when q_l2, keys kept; q scaled; the key-norm rescaling k / d, with d2 = max(lam,
   1) and lam = ||k||^2 per (b, h) into dd[2 (b H + h)] and dd[2 (b H + h) + 1]. */
static void FN(delta_prepare_qk)(int64_t B, int64_t H, int64_t K, int64_t C, REAL *u, int kind, int l2conv,
                                 int q_l2, double l2eps, double scale, double *dd) {
    for (int64_t b = 0; b < B; ++b) {
        REAL *qb = u + b * C, *kb = qb + H * K;
        for (int64_t h = 0; h < H; ++h) {
            REAL *q = qb + h * K, *k = kb + h * K;
            if (kind == 0) { FN(l2norm)(q, K, l2conv, (REAL)l2eps); FN(l2norm)(k, K, l2conv, (REAL)l2eps); }
            else if (q_l2) FN(l2norm)(q, K, 0, (REAL)l2eps);
            for (int64_t i = 0; i < K; ++i) q[i] = q[i] * (REAL)scale;
        }
        /* key norms (ops/delta_core.key_norms): lam = ||k||^2, the fp32 sum in order unless it overflowed: one
           chain of K dependent fmas per head, four heads' chains interleaved (each its own order: the same bits,
           a quarter of the latency) */
        REAL lr[4];
        for (int64_t h0 = 0; h0 < H; h0 += 4) {
            const int64_t nh = H - h0 < 4 ? H - h0 : 4;
            if (nh == 4) {
                const REAL *k0 = kb + h0 * K, *k1 = k0 + K, *k2 = k1 + K, *k3 = k2 + K;
                REAL a0 = 0, a1 = 0, a2 = 0, a3 = 0;
                for (int64_t i = 0; i < K; ++i) {
                    a0 += k0[i] * k0[i]; a1 += k1[i] * k1[i]; a2 += k2[i] * k2[i]; a3 += k3[i] * k3[i];
                }
                lr[0] = a0, lr[1] = a1, lr[2] = a2, lr[3] = a3;
            } else
                for (int64_t x = 0; x < nh; ++x) {
                    const REAL *k = kb + (h0 + x) * K;
                    REAL a = 0;
                    for (int64_t i = 0; i < K; ++i) a += k[i] * k[i];
                    lr[x] = a;
                }
            for (int64_t x = 0; x < nh; ++x) {
                const int64_t h = h0 + x;
                REAL *k = kb + h * K;
                double lam = lr[x];
                if (!isfinite(lr[x])) { lam = 0; for (int64_t i = 0; i < K; ++i) lam += (double)k[i] * (double)k[i]; }
                double d2 = lam > 1.0 ? lam : (isnan(lam) ? lam : 1.0);
                REAL d = (REAL)sqrt(d2);
                if (d != 1)   /* (k / 1 is k to the bit) */
                    for (int64_t i = 0; i < K; ++i) k[i] = k[i] / d;
                dd[2 * (b * H + h)] = d2; dd[2 * (b * H + h) + 1] = lam;
            }
        }
    }
}

/* The delta rule's write and read for one head, after the decayed old state is in S and o holds k^T S:
   err = a (v / d) - a (k^T S) (in o), S += k err^T, then o = S^T q. Kinds 0, 1 and KDA share it. */
static void FN(delta_write_read)(int64_t K, int64_t V, const REAL *q, const REAL *k, const REAL *v, REAL d,
                                 REAL ar, REAL *S, REAL *o) {
    for (int64_t j = 0; j < V; ++j) o[j] = (v[j] / d) * ar - ar * o[j];
    for (int64_t i = 0; i < K; ++i) {
        REAL *restrict s = S + i * V;
        const REAL ki = k[i];
#pragma omp simd
        for (int64_t j = 0; j < V; ++j) s[j] += ki * o[j];
    }
    for (int64_t j = 0; j < V; ++j) o[j] = 0;
    for (int64_t i = 0; i < K; ++i) {
        const REAL *restrict s = S + i * V;
        const REAL qi = q[i];
#pragma omp simd
        for (int64_t j = 0; j < V; ++j) o[j] += qi * s[j];
    }
}

/* The second pass's rows by vector lines, the new state written past the caches by streaming stores (the state is
   read back only by the next token, after every weight of the model has gone through the caches, so reading the
   fresh buffer's lines in to write them, as a plain store does, is a third of the traffic). The operations are
   the plain loop's (a product, then two fmas): 512-bit lines with AVX-512, 256-bit halves of them with AVX2. */
#if defined(HAVE_VLINE) && !defined(LINATTN_PLAIN_C) && \
    (defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__)))
#define STREAM_LINES 1
#if defined(__AVX512F__)
#define ZW 64
#define ZSFX(op, t) _mm512_##op##_##t
#define ZV_ps __m512
#define ZV_pd __m512d
#else
#define ZW 32
#define ZSFX(op, t) _mm256_##op##_##t
#define ZV_ps __m256
#define ZV_pd __m256d
#endif
#if REAL_IS_FLOAT
#define ZV ZV_ps
#define ZOP(op) ZSFX(op, ps)
#else
#define ZV ZV_pd
#define ZOP(op) ZSFX(op, pd)
#endif
static inline void FN(delta_row_stream)(int64_t V, const REAL *s0, int gated, REAL decay, REAL ki, REAL qi,
                                        const REAL *e, REAL *s, REAL *o, const REAL *pf) {
    const ZV dv = ZOP(set1)(decay), kv = ZOP(set1)(ki), qv = ZOP(set1)(qi);
    const int64_t step = ZW / (int64_t)sizeof(REAL), line = 64 / (int64_t)sizeof(REAL);
    for (int64_t c = 0; c < V; c += step) {
        if (pf && c % line == 0) _mm_prefetch((const char *)(pf + c), PF_NEXT_HINT);
        ZV sv = s0 ? ZOP(loadu)(s0 + c) : ZOP(set1)((REAL)0);
        if (gated && s0) sv = ZOP(mul)(sv, dv);
        const ZV sn = ZOP(fmadd)(kv, ZOP(loadu)(e + c), sv);
        ZOP(storeu)(o + c, ZOP(fmadd)(qv, sn, ZOP(loadu)(o + c)));
        ZOP(stream)(s + c, sn);
    }
}

/* delta_update's two passes over a column block of nv vectors (DELTA_CV, or a line's vectors at V's tail: a constant
   once inlined) with s0 given (err [j] needs only column j's rows): the first walks the block's columns down all K
   rows, e in registers (each e[j] sums its rows in ascending order by the same fma from the same zero as the row
   loop: the same bits); err is made by the row loop's expression; the second walks them again, o in registers and e
   from L1, each row's part made and streamed, o stored once (each o[j] again in ascending rows from zero). A block
   is 8 vectors: o takes 8 of AVX2's 16 registers (e, the fmas' memory operand, held too would not fit; blocks of 4
   holding both were slower), a whole 128-float row with AVX-512, so that its rows are written in address order. The
   first walk reads the block's columns from L2 (the previous head's prefetch), the second again from L1 or L2. The
   rows PF_ROWS ahead of the first walk are prefetched, and during the second the next head's lines (pf: its part
   [c K, (c + nv step) K) for the block at column c, in order, so that over the blocks every line of the next head is
   fetched once, in address order). */
#define DELTA_CV 8
LA_INLINE void FN(delta_cols)(int64_t K, int64_t V, const REAL *s0, int nv, int gated, REAL decay, const REAL *k,
                              const REAL *q, const REAL *v, REAL d, REAL ar, REAL *e, REAL *s, REAL *o,
                              const REAL *pf) {
    const int64_t step = ZW / (int64_t)sizeof(REAL), line = 64 / (int64_t)sizeof(REAL), w = nv * step;
    const ZV dv = ZOP(set1)(decay);
    ZV ev[DELTA_CV], ov[DELTA_CV];
    for (int x = 0; x < nv; ++x) ev[x] = ZOP(setzero)();
    for (int64_t i = 0; i < K; ++i) {
        if (i + PF_ROWS < K)
            for (int64_t c = 0; c < w; c += line) __builtin_prefetch(s0 + (i + PF_ROWS) * V + c, 0, 3);
        const ZV kv = ZOP(set1)(k[i]);
        for (int x = 0; x < nv; ++x) {
            ZV sv = ZOP(loadu)(s0 + i * V + x * step);
            if (gated) sv = ZOP(mul)(sv, dv);
            ev[x] = ZOP(fmadd)(kv, sv, ev[x]);
        }
    }
    for (int x = 0; x < nv; ++x) ZOP(storeu)(e + x * step, ev[x]);
    for (int64_t j = 0; j < w; ++j) e[j] = (v[j] / d) * ar - ar * e[j];
    for (int x = 0; x < nv; ++x) ov[x] = ZOP(setzero)();
    for (int64_t i = 0; i < K; ++i) {
        const ZV kv = ZOP(set1)(k[i]), qv = ZOP(set1)(q[i]);
        if (pf)
            for (int64_t c = 0; c < w; c += line) _mm_prefetch((const char *)(pf + i * w + c), PF_NEXT_HINT);
        for (int x = 0; x < nv; ++x) {
            ZV sv = ZOP(loadu)(s0 + i * V + x * step);
            if (gated) sv = ZOP(mul)(sv, dv);
            const ZV sn = ZOP(fmadd)(kv, ZOP(loadu)(e + x * step), sv);
            ov[x] = ZOP(fmadd)(qv, sn, ov[x]);
            ZOP(stream)(s + i * V + x * step, sn);
        }
    }
    for (int x = 0; x < nv; ++x) ZOP(storeu)(o + x * step, ov[x]);
}

/* delta_update with S0 given and the state streamed: block by block of columns, both passes of a block in turn (the
   passes over the whole state one after the other, the second by row blocks or by column blocks, were no faster:
   docs/cpu_kernels.md, rounds 19b and 21); gated and S0_next's presence are constants in each of the caller's four
   instances. */
LA_INLINE void FN(delta_update_lines)(int64_t K, int64_t V, const REAL *q, const REAL *k, const REAL *v, REAL d,
                                      REAL ar, int gated, REAL decay, const REAL *S0, REAL *S, REAL *e, REAL *o,
                                      const REAL *S0_next) {
    const int64_t blk = DELTA_CV * (ZW / (int64_t)sizeof(REAL)), line = 64 / (int64_t)sizeof(REAL);
    int64_t c = 0;
    for (; c + blk <= V; c += blk)
        FN(delta_cols)(K, V, S0 + c, DELTA_CV, gated, decay, k, q, v + c, d, ar, e + c, S + c, o + c,
                       S0_next ? S0_next + c * K : NULL);
    for (; c < V; c += line)   /* (V a multiple of a line) */
        FN(delta_cols)(K, V, S0 + c, 64 / ZW, gated, decay, k, q, v + c, d, ar, e + c, S + c, o + c,
                       S0_next ? S0_next + c * K : NULL);
    _mm_sfence();   /* (the streamed lines ordered before whatever reads the state next) */
}
#undef DELTA_CV
#undef ZW
#undef ZSFX
#undef ZV_ps
#undef ZV_pd
#undef ZV
#undef ZOP
#else
#define STREAM_LINES 0
#endif

/* The delta rule's state update and read for one head in two passes over the state (kinds 0 and 1):

       pass 1 (reads S0):           ks = k^T (decay S0),   err = a (v / d) - a ks   (into e [V])
       pass 2 (reads S0, writes S): S = decay S0 + k err^T, row by row, and o += q_i S[i, :] as each row is made

   The same operations in the same order as the three passes they replace (decay, k^T S, the rank-1 write, then
   S^T q accumulated over ascending rows), so the same bits; the second pass reads S0 from L2 (a head's state is
   64 KiB at 128 x 128 fp32) and writes S once, by streaming stores when `stream` (S 64-byte aligned, V a multiple
   of a line). S0 NULL: a zero state. S0_next (NULL: none) is prefetched into L2 during the second pass (the next
   head's old state: its first pass then reads from L2 while this one's writes drain). The rank-1 write is an
   explicit fma where the target has one: written as decay * s0 + k_i err_j, contraction may fuse either product
   (the three passes stored decay S0 first). With S0 and streaming stores, delta_update_lines (the same operations
   in the same order, both passes by column blocks, no per-vector tests). */
static void FN(delta_update)(int64_t K, int64_t V, const REAL *q, const REAL *k, const REAL *v, REAL d, REAL ar,
                             int gated, REAL decay, const REAL *S0, REAL *S, REAL *e, REAL *o, int stream,
                             const REAL *S0_next) {
#if STREAM_LINES
    if (stream && S0) {
        if (gated && S0_next) FN(delta_update_lines)(K, V, q, k, v, d, ar, 1, decay, S0, S, e, o, S0_next);
        else if (gated) FN(delta_update_lines)(K, V, q, k, v, d, ar, 1, decay, S0, S, e, o, NULL);
        else if (S0_next) FN(delta_update_lines)(K, V, q, k, v, d, ar, 0, decay, S0, S, e, o, S0_next);
        else FN(delta_update_lines)(K, V, q, k, v, d, ar, 0, decay, S0, S, e, o, NULL);
        return;
    }
#endif
    for (int64_t j = 0; j < V; ++j) e[j] = 0;
    if (S0)
        for (int64_t i = 0; i < K; ++i) {
            const REAL *restrict s0 = S0 + i * V;
            const REAL ki = k[i];
            if (i + PF_ROWS < K)   /* the old state a few rows ahead (not cached), and the new one's rows for the
                                      second pass's plain stores (fetched beside the old: two streams at once) */
                for (int64_t c = 0; c < V; c += 64 / (int64_t)sizeof(REAL)) {
                    __builtin_prefetch(s0 + PF_ROWS * V + c, 0, 3);
                    if (!stream) __builtin_prefetch(S + (i + PF_ROWS) * V + c, 1, 3);
                }
#pragma omp simd
            for (int64_t j = 0; j < V; ++j) { REAL sv = gated ? s0[j] * decay : s0[j]; e[j] += ki * sv; }
        }
    for (int64_t j = 0; j < V; ++j) e[j] = (v[j] / d) * ar - ar * e[j];
    for (int64_t j = 0; j < V; ++j) o[j] = 0;
#if defined(__FMA__)
#define DELTA_WRITE(sv, ki, ej) MATH(fma)(ki, ej, sv)
#else
#define DELTA_WRITE(sv, ki, ej) ((sv) + (ki) * (ej))
#endif
    for (int64_t i = 0; i < K; ++i) {
        const REAL *restrict s0 = S0 ? S0 + i * V : NULL;
        REAL *restrict s = S + i * V;
        const REAL ki = k[i], qi = q[i];
        const REAL *pf = S0_next ? S0_next + i * V : NULL;
#if STREAM_LINES
        if (stream) {
            FN(delta_row_stream)(V, s0, gated, decay, ki, qi, e, s, o, pf);
            continue;
        }
#endif
        (void)stream;
        if (pf)
            for (int64_t c = 0; c < V; c += 64 / (int64_t)sizeof(REAL)) __builtin_prefetch(pf + c, 0, 2);
#pragma omp simd
        for (int64_t j = 0; j < V; ++j) {
            REAL sv = s0 ? (gated ? s0[j] * decay : s0[j]) : (REAL)0;
            REAL sn = DELTA_WRITE(sv, ki, e[j]);
            s[j] = sn;
            o[j] += qi * sn;
        }
    }
#if STREAM_LINES
    if (stream) _mm_sfence();   /* (the streamed lines ordered before whatever reads the state next) */
#endif
#undef DELTA_WRITE
}

/* One head's step of the kernel-map state [kv | z] ([K, V+1] rows): S = decay S0 + k [v | 1] (S0 NULL: none;
   gated 0: decay unused), o = S[:, :V]^T q; returns the normaliser q^T z. Linear (kind 2) and ELA share it. */
static REAL FN(kv_z_step)(int64_t K, int64_t V, const REAL *fq, const REAL *fk, const REAL *v, int gated,
                          REAL decay, const REAL *S0, REAL *S, REAL *o) {
    const int64_t V1 = V + 1;
    REAL dn = 0;
    for (int64_t j = 0; j < V; ++j) o[j] = 0;
    for (int64_t i = 0; i < K; ++i) {
        const REAL *restrict s0 = S0 ? S0 + i * V1 : NULL;
        REAL *restrict s = S + i * V1;
        const REAL ki = fk[i], qi = fq[i];
        if (s0) {
#pragma omp simd
            for (int64_t j = 0; j < V; ++j) s[j] = (gated ? decay * s0[j] : s0[j]) + ki * v[j];
            s[V] = (gated ? decay * s0[V] : s0[V]) + ki;
        } else {
#pragma omp simd
            for (int64_t j = 0; j < V; ++j) s[j] = ki * v[j];
            s[V] = ki;
        }
#pragma omp simd
        for (int64_t j = 0; j < V; ++j) o[j] += qi * s[j];
        dn += qi * s[V];
    }
    return dn;
}

/* The normaliser's floor eps: nonneg clamps below at eps (as clamp_min), else |dn| >= eps keeping the sign;
   NaN stays NaN. */
static REAL FN(den_floor)(REAL dn, REAL e, int nonneg) {
    if (nonneg) return dn < e ? (isnan(dn) ? dn : e) : dn;
    if (dn < 0) return dn < -e ? dn : -e;
    return dn > e ? dn : (isnan(dn) ? dn : e);
}

/* Delta-rule layers. y [B, ldy] = [q H*K | k H*K | v HV*V | b HV | a HV (gated) | gate HV*V (has_gate)]
   (q, k, v before the conv when KC > 0). kind 0: DeltaNet / Gated DeltaNet (q, k l2-normalised by l2conv),
   1: EFLA (q by "rsqrt" when q_l2, keys kept; exact coefficient). beta_mode 0 sigmoid, 1 adaptive (alpha),
   2 loose, 3 doubled (2 sigmoid: negative eigenvalues allowed, OLMo-hybrid's). neg_a = -exp(A_log), dt_bias [HV]
   when gated. S_in [B, HV, K, V] or NULL -> S_out; out [B, HV*V].
   Returns 0, or 1 when out of memory. */
static int FN(decode_delta_io)(int64_t B, int64_t H, int64_t HV, int64_t K, int64_t V, const REAL *y,
        int64_t ldy, int64_t KC, const REAL *w_in, const REAL *cw, const REAL *cb, int conv_act, REAL *w_out,
        int kind, int l2conv, int q_l2, double l2eps, double scale, int beta_mode, const REAL *alpha,
        int gated, const REAL *neg_a, const REAL *dt_bias, const REAL *S_in, REAL *S_out, int has_norm,
        const REAL *nw, double norm_eps, int has_gate, REAL *out, int nthreads, REAL *w_io) {
    const int64_t C = 2 * H * K + HV * V, G = HV / H;
    LT_START(lt);
    /* work: the prepared q | k | v per batch row [B, C], then d (key rescaling) and lam per (b, h) */
    /* and err per (b, hv) [B HV, V] (delta_update) */
    REAL *u = (REAL *)malloc(sizeof(REAL) * (size_t)(B * C + B * HV * V + 1));
    double *dd = (double *)malloc(sizeof(double) * (size_t)(2 * B * H + 1));
    if (!u || !dd) { free(u); free(dd); return 1; }
    REAL *e = u + B * C;
    if (KC > 0 && w_io) FN(conv_io)(B, C, KC, y, ldy, w_io, cw, cb, conv_act, u);
    else if (KC > 0) FN(conv)(B, C, KC, y, ldy, w_in, cw, cb, conv_act, w_out, u);
    else for (int64_t b = 0; b < B; ++b) memcpy(u + b * C, y + b * ldy, sizeof(REAL) * (size_t)C);
    FN(delta_prepare_qk)(B, H, K, C, u, kind, l2conv, q_l2, l2eps, scale, dd);
    LT_LAP(lt, LT_CONV);
    const int64_t nb = B * HV;
    const int stream = V % (64 / (int64_t)sizeof(REAL)) == 0 && ((uintptr_t)S_out & 63) == 0;
    const int par = nb > 1 && nb * K * V >= PAR_MIN_ELEMS;
    const int64_t per_thread = (nb + nthreads - 1) / (nthreads > 0 ? nthreads : 1);
#pragma omp parallel for num_threads(nthreads) schedule(static, per_thread) if(par)
    for (int64_t t = 0; t < nb; ++t) {
        const int64_t b = t / HV, hv = t % HV, h = hv / G;
        const REAL *q = u + b * C + h * K, *k = u + b * C + H * K + h * K, *v = u + b * C + 2 * H * K + hv * V;
        const REAL *yb = y + b * ldy + C;
        const double d2 = dd[2 * (b * H + h)], lam = dd[2 * (b * H + h) + 1];
        const REAL d = (REAL)sqrt(d2);
        REAL bt = yb[hv];
        REAL beta = beta_mode == 2 ? FN(softplus)(bt) : (REAL)1 / ((REAL)1 + MATH(exp)(-bt));
        if (beta_mode == 1) beta = FN(softplus)(alpha[hv]) * beta;
        else if (beta_mode == 3) beta = beta * (REAL)2;
        double a = beta;
        if (kind == 1) {   /* EFLA: (1 - exp(-beta lam)) / lam, its series below x = 1e-3 (delta_core) */
            double x = a * lam;
            a = x < 1e-3 ? a * (1 - x / 2 * (1 - x / 3 * (1 - x / 4))) : -expm1(-a * lam) / lam;
        }
        const REAL ar = (REAL)(a * d2);
        REAL decay = 1;
        if (gated) decay = MATH(exp)(neg_a[hv] * FN(softplus)(yb[HV + hv] + dt_bias[hv]));
        const REAL *S0 = S_in ? S_in + t * K * V : NULL;
        REAL *S = S_out + t * K * V;
        REAL *o = out + t * V;
        /* the next head's old state (this thread's next t, contiguous) fetched while this one's second pass
           runs on cached lines and streaming stores: the reads of the state then never wait on a pass's writes */
        const REAL *S0_next = S0 && t + 1 < nb && (!par || (t + 1) % per_thread != 0) ? S0 + K * V : NULL;
        FN(delta_update)(K, V, q, k, v, d, ar, gated, decay, S0, S, e + t * V, o, stream, S0_next);
        FN(outnorm)(o, V, has_norm, nw, norm_eps, has_gate ? y + b * ldy + ldy - HV * V + hv * V : NULL);
    }
    LT_BYTES(sizeof(REAL) * (double)(nb * K * V) * (S_in ? 2 : 1));
    LT_LAP(lt, LT_STATE);
    free(u); free(dd);
    return 0;
}

/* (w_io: the window as transformers keeps it, read and advanced in place, FN(conv_io); w_in / w_out unused) */
int FN(linattn_decode_delta)(int64_t B, int64_t H, int64_t HV, int64_t K, int64_t V, const REAL *y,
        int64_t ldy, int64_t KC, const REAL *w_in, const REAL *cw, const REAL *cb, int conv_act, REAL *w_out,
        int kind, int l2conv, int q_l2, double l2eps, double scale, int beta_mode, const REAL *alpha,
        int gated, const REAL *neg_a, const REAL *dt_bias, const REAL *S_in, REAL *S_out, int has_norm,
        const REAL *nw, double norm_eps, int has_gate, REAL *out, int nthreads) {
    return FN(decode_delta_io)(B, H, HV, K, V, y, ldy, KC, w_in, cw, cb, conv_act, w_out, kind, l2conv, q_l2, l2eps,
                               scale, beta_mode, alpha, gated, neg_a, dt_bias, S_in, S_out, has_norm, nw, norm_eps,
                               has_gate, out, nthreads, NULL);
}

/* Linear attention, linear-space elementwise map fmap (0 identity, 1 elu+1, 2 relu) applied to q*scale and
   k. y [B, ldy] = [q H*K | k H*K | v HV*V | a HV (gate_kind 2) | gate HV*V (has_gate)]. The state is
   [kv | z] as one [B, HV, K, V+1]. gate_kind 0 none, 1 retnet (decay [HV] given), 2 scalar (neg_a, dt_bias:
   Mamba2's log-decay). normalize: o / floor(den) with the floor eps (nonneg: clamp_min, else sign-keeping). */
static int FN(decode_linear_io)(int64_t B, int64_t H, int64_t HV, int64_t K, int64_t V, const REAL *y,
        int64_t ldy, int64_t KC, const REAL *w_in, const REAL *cw, const REAL *cb, int conv_act, REAL *w_out,
        int fmap, double scale, int gate_kind, const REAL *decay_h, const REAL *neg_a, const REAL *dt_bias,
        const REAL *S_in, REAL *S_out, int normalize, int nonneg, double eps, int has_norm, const REAL *nw,
        double norm_eps, int has_gate, REAL *out, int nthreads, REAL *w_io) {
    const int64_t C = 2 * H * K + HV * V, G = HV / H, V1 = V + 1;
    LT_START(lt);
    REAL *u = (REAL *)malloc(sizeof(REAL) * (size_t)(B * C + 1));
    if (!u) return 1;
    if (KC > 0 && w_io) FN(conv_io)(B, C, KC, y, ldy, w_io, cw, cb, conv_act, u);
    else if (KC > 0) FN(conv)(B, C, KC, y, ldy, w_in, cw, cb, conv_act, w_out, u);
    else for (int64_t b = 0; b < B; ++b) memcpy(u + b * C, y + b * ldy, sizeof(REAL) * (size_t)C);
    for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < 2 * H * K; ++i) {
            REAL x = u[b * C + i];
            if (i < H * K && scale != 1.0) x = x * (REAL)scale;
            if (fmap == 1) x = x > 0 ? x + (REAL)1 : MATH(expm1)(x) + (REAL)1;   /* F.elu(x) + 1 */
            else if (fmap == 2) x = x > 0 ? x : (isnan(x) ? x : (REAL)0);
            u[b * C + i] = x;
        }
    LT_LAP(lt, LT_CONV);
    const int64_t nb = B * HV;
    const int par = nb > 1 && nb * K * V1 >= PAR_MIN_ELEMS;
#pragma omp parallel for num_threads(nthreads) schedule(static) if(par)
    for (int64_t t = 0; t < nb; ++t) {
        const int64_t b = t / HV, hv = t % HV, h = hv / G;
        const REAL *fq = u + b * C + h * K, *fk = u + b * C + H * K + h * K, *v = u + b * C + 2 * H * K + hv * V;
        const REAL *yb = y + b * ldy + C;
        REAL decay = 1;
        if (gate_kind == 1) decay = decay_h[hv];
        else if (gate_kind == 2) decay = MATH(exp)(neg_a[hv] * FN(softplus)(yb[hv] + dt_bias[hv]));
        const REAL *S0 = S_in ? S_in + t * K * V1 : NULL;
        REAL *S = S_out + t * K * V1;
        REAL *o = out + t * V;
        const REAL dn = FN(kv_z_step)(K, V, fq, fk, v, gate_kind, decay, S0, S, o);
        if (normalize) {
            const REAL den = FN(den_floor)(dn, (REAL)eps, nonneg);
            for (int64_t j = 0; j < V; ++j) o[j] = o[j] / den;
        }
        FN(outnorm)(o, V, has_norm, nw, norm_eps, has_gate ? y + b * ldy + ldy - HV * V + hv * V : NULL);
    }
    LT_BYTES(sizeof(REAL) * (double)(nb * K * V1) * (S_in ? 2 : 1));
    LT_LAP(lt, LT_STATE);
    free(u);
    return 0;
}

/* (w_io as linattn_decode_delta's) */
int FN(linattn_decode_linear)(int64_t B, int64_t H, int64_t HV, int64_t K, int64_t V, const REAL *y,
        int64_t ldy, int64_t KC, const REAL *w_in, const REAL *cw, const REAL *cb, int conv_act, REAL *w_out,
        int fmap, double scale, int gate_kind, const REAL *decay_h, const REAL *neg_a, const REAL *dt_bias,
        const REAL *S_in, REAL *S_out, int normalize, int nonneg, double eps, int has_norm, const REAL *nw,
        double norm_eps, int has_gate, REAL *out, int nthreads) {
    return FN(decode_linear_io)(B, H, HV, K, V, y, ldy, KC, w_in, cw, cb, conv_act, w_out, fmap, scale, gate_kind,
                                decay_h, neg_a, dt_bias, S_in, S_out, normalize, nonneg, eps, has_norm, nw, norm_eps,
                                has_gate, out, nthreads, NULL);
}

/* the r rows i0, i0 + stride, ... (q_step_rows) of y[b, i] = (add ? add[b, i] : 0) + (W x[b])_i + (bias ? bias[i] :
   0) for every b, W [n, m] rows contiguous (at batch > 1 the 4 rows are read from memory once, then from L1) */
static void FN(matvec_rows)(int64_t B, int64_t n, int64_t m, int64_t i0, int64_t stride, int r, const mv_src *src,
                            const REAL *bias, const REAL *x, const REAL *add, REAL *y) {
    const char *wr[4], *end[4];
    mv_step_rows(src, n, sizeof(REAL) * (size_t)m, i0, stride, r, wr, end);
#if defined(HAVE_VLINE)
    if (r == 4 && m % (int64_t)(64 / sizeof(REAL)) == 0) {
        const int64_t VL = 64 / sizeof(REAL);
        const REAL *w0 = (const REAL *)wr[0], *w1 = (const REAL *)wr[1], *w2 = (const REAL *)wr[2],
                   *w3 = (const REAL *)wr[3];
        for (int64_t b = 0; b < B; ++b) {
            const REAL *xb = x + b * m;
            FN(vline) a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
#if defined(LINE_YMM) && REAL_IS_FLOAT
            /* (AVX2: the lines' halves in 8 registers, as the bf16 rows: GCC's generic 16-lane code ran at a quarter
               of the read rate there; the same lanes and fmas) */
            YMM_ROWS4(_mm256_loadu_ps, m, 0, Q_PF(w0 + j, end[0]); Q_PF(w1 + j, end[1]); Q_PF(w2 + j, end[2]);
                                             Q_PF(w3 + j, end[3]));   /* (a line of each stream per step) */
#else
            for (int64_t j = 0; j < m; j += VL) {
                if (b == 0) {   /* a line of each stream per step */
                    Q_PF(w0 + j, end[0]); Q_PF(w1 + j, end[1]); Q_PF(w2 + j, end[2]); Q_PF(w3 + j, end[3]);
                }
                const FN(vline) xv = *(const FN(vline) *)(xb + j);
                a0 += *(const FN(vline) *)(w0 + j) * xv; a1 += *(const FN(vline) *)(w1 + j) * xv;
                a2 += *(const FN(vline) *)(w2 + j) * xv; a3 += *(const FN(vline) *)(w3 + j) * xv;
            }
#endif
            const REAL acc[4] = {FN(vsum)(a0), FN(vsum)(a1), FN(vsum)(a2), FN(vsum)(a3)};
            for (int k = 0; k < 4; ++k) {
                const int64_t i = i0 + k * stride;
                REAL v = acc[k];
                if (bias) v = v + bias[i];
                y[b * n + i] = add ? add[b * n + i] + v : v;
            }
        }
        return;
    }
#endif
    for (int64_t b = 0; b < B; ++b) {
        const REAL *restrict xb = x + b * m;
        REAL acc[4] = {0, 0, 0, 0};
        if (r == 4) {
            const REAL *restrict w0 = (const REAL *)wr[0], *restrict w1 = (const REAL *)wr[1],
                       *restrict w2 = (const REAL *)wr[2], *restrict w3 = (const REAL *)wr[3];
            REAL a0 = 0, a1 = 0, a2 = 0, a3 = 0;
#pragma omp simd reduction(+:a0,a1,a2,a3)
            for (int64_t j = 0; j < m; ++j) {
                const REAL xj = xb[j];
                a0 += w0[j] * xj; a1 += w1[j] * xj; a2 += w2[j] * xj; a3 += w3[j] * xj;
            }
            acc[0] = a0; acc[1] = a1; acc[2] = a2; acc[3] = a3;
        } else
            for (int k = 0; k < r; ++k) {
                const REAL *restrict w = (const REAL *)wr[k];
                REAL a = 0;
#pragma omp simd reduction(+:a)
                for (int64_t j = 0; j < m; ++j) a += w[j] * xb[j];
                acc[k] = a;
            }
        for (int k = 0; k < r; ++k) {
            const int64_t i = i0 + k * stride;
            REAL v = acc[k];
            if (bias) v = v + bias[i];
            y[b * n + i] = add ? add[b * n + i] + v : v;
        }
    }
}

/* y = add + W x + bias for x [B, m] (the rows above, in rowsched.h's steps); a parallel region only where it pays
   (entering one costs about a microsecond even for one thread, and a decoded token makes ~20 of these calls) */
static void FN(matvec_src)(int64_t B, int64_t n, int64_t m, const mv_src *src, const REAL *bias, const REAL *x,
                           const REAL *add, REAL *y, int nthreads) {
    Q_FOR_STEPS(n, nthreads > 1 && n * m >= PAR_MIN_ELEMS,
                FN(matvec_rows)(B, n, m, i0, stride, r, src, bias, x, add, y));
}

static void FN(matvec)(int64_t B, int64_t n, int64_t m, const REAL *W, const REAL *bias, const REAL *x,
                       const REAL *add, REAL *y, int nthreads) {
    const mv_src src = {W, 0, NULL, NULL};
    FN(matvec_src)(B, n, m, &src, bias, x, add, y, nthreads);
}

/* a fused product (W or Wgu): from its parts when the plan lists them, else as one matrix (weight_product) */
static void FN(fused_product)(int fmt, const void *sc, int64_t grp, int nparts, const void *const *parts,
                              const int64_t *rows, int64_t B, int64_t n, int64_t m, const void *W, const REAL *bias,
                              const REAL *x, const REAL *add, REAL *y, int nthreads) {
    if (nparts <= 0) {
        FN(weight_product)(fmt, sc, grp, B, n, m, W, bias, x, add, y, nthreads);
        return;
    }
    const mv_src src = {W, nparts, parts, rows};
    LT_BYTES(lt_weight_bytes(fmt == WF_BF16 ? WF_BF16 : WF_PLAN, n, m, 0, sizeof(REAL)));
#if REAL_IS_FLOAT
    if (fmt == WF_BF16) {
        matvec_src_bf16(B, n, m, &src, bias, x, add, y, nthreads);
        return;
    }
#endif
    FN(matvec_src)(B, n, m, &src, bias, x, add, y, nthreads);
}

/* RMSNorm of each row of x [B, d] (weight w or NULL) into y, as F.rms_norm */
static void FN(rmsnorm)(int64_t B, int64_t d, const REAL *x, const REAL *w, double eps, REAL *y) {
    for (int64_t b = 0; b < B; ++b) {
        const REAL *xb = x + b * d;
        const REAL r = FN(la_rms_rstd)(xb, d, (REAL)eps);
        for (int64_t j = 0; j < d; ++j) y[b * d + j] = w ? xb[j] * r * w[j] : xb[j] * r;
    }
}


/* one key / value element of the cache, as the plan computes (bf16 or the plan's type) */
static inline REAL FN(kv_get)(int bf, const void *base, int64_t i) {
    return bf ? (REAL)bf16_to_f32(((const uint16_t *)base)[i]) : ((const REAL *)base)[i];
}
static inline void FN(kv_put)(int bf, void *base, int64_t i, REAL x) {
    if (bf)
        ((uint16_t *)base)[i] = f32_to_bf16((float)x);
    else
        ((REAL *)base)[i] = x;
}

#if defined(LINE_YMM) && !defined(KV_SCORES_YMM)
/* kv_scores's vector path on AVX2 (keys from k, their 8 elements at p widened to fp32 by LOAD(p)): the generic
   16-lane code went through the stack there (spills and element shuffles, ~1.7 cycles a multiply-add). Each line's
   two halves in their own registers, 4 keys a step (8 accumulators): the generic lanes, fmas (key times query, onto
   the accumulator) and vsum order, so the same bits. Uses t, nt, stride, D, q, scale, w of kv_scores. */
#define KV_SCORES_YMM(k, LOAD)                                                                                   \
    do {                                                                                                         \
        for (; t + 4 <= nt; t += 4) {                                                                            \
            const __typeof__(*(k)) *k0 = (k) + t * stride, *k1 = k0 + stride, *k2 = k1 + stride,                 \
                                   *k3 = k2 + stride;                                                            \
            YMM_DOT4(LOAD, q, k0, k1, k2, k3, D, 0, (void)0)                                                     \
            w[t] = vsum_ymm(l0, h0) * scale; w[t + 1] = vsum_ymm(l1, h1) * scale;                                \
            w[t + 2] = vsum_ymm(l2, h2) * scale; w[t + 3] = vsum_ymm(l3, h3) * scale;                            \
        }                                                                                                        \
        for (; t < nt; ++t) {                                                                                    \
            const __typeof__(*(k)) *k0 = (k) + t * stride;                                                       \
            __m256 l0 = _mm256_setzero_ps(), h0 = l0;                                                            \
            for (int64_t i = 0; i < D; i += 16) {                                                                \
                l0 = _mm256_fmadd_ps(LOAD(k0 + i), _mm256_loadu_ps(q + i), l0);                                  \
                h0 = _mm256_fmadd_ps(LOAD(k0 + i + 8), _mm256_loadu_ps(q + i + 8), h0);                          \
            }                                                                                                    \
            w[t] = vsum_ymm(l0, h0) * scale;                                                                     \
        }                                                                                                        \
    } while (0)
#endif

/* The scores q . k_t of one query head against nt cached keys (rows `stride` elements apart from element `first` of
   the cache, bf16 when bf, else in the plan's type), times scale, into w[0 .. nt). Each score is summed by 64-byte
   lines into one vector accumulator and its lanes added pairwise (vsum: the products' order) where D is a multiple
   of a line, four keys at a time (four independent chains); else in order, one element after another. On AVX2 the
   same lanes by halves (KV_SCORES_YMM: the same bits, tests/cpu/test_decode_attn_paths.py). */
static void FN(kv_scores)(int bf, const void *kc, int64_t first, int64_t stride, int64_t nt, int64_t D, const REAL *q,
                          REAL scale, REAL *w) {
    int64_t t = 0;
#if defined(HAVE_VLINE)
    const int64_t VL = 64 / sizeof(REAL);
    if (D % VL == 0 && !bf) {
        const REAL *k = (const REAL *)kc + first;
#if defined(LINE_YMM) && REAL_IS_FLOAT
        KV_SCORES_YMM(k, _mm256_loadu_ps);
#else
        for (; t + 4 <= nt; t += 4) {
            const REAL *k0 = k + t * stride, *k1 = k0 + stride, *k2 = k1 + stride, *k3 = k2 + stride;
            FN(vline) a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t i = 0; i < D; i += VL) {
                const FN(vline) qv = *(const FN(vline) *)(q + i);
                a0 += *(const FN(vline) *)(k0 + i) * qv; a1 += *(const FN(vline) *)(k1 + i) * qv;
                a2 += *(const FN(vline) *)(k2 + i) * qv; a3 += *(const FN(vline) *)(k3 + i) * qv;
            }
            w[t] = FN(vsum)(a0) * scale; w[t + 1] = FN(vsum)(a1) * scale;
            w[t + 2] = FN(vsum)(a2) * scale; w[t + 3] = FN(vsum)(a3) * scale;
        }
        for (; t < nt; ++t) {
            const REAL *k0 = k + t * stride;
            FN(vline) a0 = {0};
            for (int64_t i = 0; i < D; i += VL) a0 += *(const FN(vline) *)(k0 + i) * *(const FN(vline) *)(q + i);
            w[t] = FN(vsum)(a0) * scale;
        }
#endif
        return;
    }
#if REAL_IS_FLOAT
    if (D % 16 == 0 && bf) {   /* (bf16 keys widened a line at a time, as the bf16 products' weights) */
        const uint16_t *k = (const uint16_t *)kc + first;
#if defined(LINE_YMM)
        KV_SCORES_YMM(k, bf16_ymm);
#else
        for (; t + 4 <= nt; t += 4) {
            const uint16_t *k0 = k + t * stride, *k1 = k0 + stride, *k2 = k1 + stride, *k3 = k2 + stride;
            vline_f32 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
#if defined(BF16_ZMM)
            __m512 z0 = _mm512_setzero_ps(), z1 = z0, z2 = z0, z3 = z0;
            for (int64_t i = 0; i < D; i += 16) {
                const __m512 qv = _mm512_loadu_ps(q + i);
                z0 = _mm512_fmadd_ps(bf16_zmm(k0 + i), qv, z0); z1 = _mm512_fmadd_ps(bf16_zmm(k1 + i), qv, z1);
                z2 = _mm512_fmadd_ps(bf16_zmm(k2 + i), qv, z2); z3 = _mm512_fmadd_ps(bf16_zmm(k3 + i), qv, z3);
            }
            memcpy(&a0, &z0, sizeof a0); memcpy(&a1, &z1, sizeof a1);
            memcpy(&a2, &z2, sizeof a2); memcpy(&a3, &z3, sizeof a3);
#else
            for (int64_t i = 0; i < D; i += 16) {
                const vline_f32 qv = *(const vline_f32 *)(q + i);
                a0 += bf16_line(k0 + i) * qv; a1 += bf16_line(k1 + i) * qv;
                a2 += bf16_line(k2 + i) * qv; a3 += bf16_line(k3 + i) * qv;
            }
#endif
            w[t] = vsum_f32(a0) * scale; w[t + 1] = vsum_f32(a1) * scale;
            w[t + 2] = vsum_f32(a2) * scale; w[t + 3] = vsum_f32(a3) * scale;
        }
        for (; t < nt; ++t) {
            const uint16_t *k0 = k + t * stride;
            vline_f32 a0 = {0};
            for (int64_t i = 0; i < D; i += 16) a0 += bf16_line(k0 + i) * *(const vline_f32 *)(q + i);
            w[t] = vsum_f32(a0) * scale;
        }
#endif
        return;
    }
#endif
#endif
    for (; t < nt; ++t) {
        REAL s = 0;
        for (int64_t i = 0; i < D; ++i) s += q[i] * FN(kv_get)(bf, kc, first + t * stride + i);
        w[t] = s * scale;
    }
}

/* softmax_mix asks for the KV rows this many rows ahead of the one a KV group's heads read */
#define KV_PF_ROWS 4
#if defined(LINE_YMM) && !defined(KV_SCORES_HEADS4_YMM)
/* KV_SCORES_YMM turned around: one key a step against four query heads q0 .. q3 (a KV group's heads sharing its rows,
   so each key row is read once for the four, not once a head); each (head, key) score the same fmas from zero in the
   same lanes and the same vsum_ymm as there: the same bits. Uses nt, stride, D, q0 .. q3, scale, w0 .. w3. */
#define KV_SCORES_HEADS4_YMM(k, LOAD)                                                                            \
    do {                                                                                                         \
        for (int64_t t = 0; t < nt; ++t) {                                                                       \
            const __typeof__(*(k)) *kt = (k) + t * stride;                                                       \
            if (t + KV_PF_ROWS < nt)   /* (a row at a time: the next rows asked for, so their misses overlap) */ \
                for (int64_t i = 0; i < D; i += 64 / (int64_t)sizeof(*(k)))                                      \
                    __builtin_prefetch(kt + KV_PF_ROWS * stride + i, 0, 3);                                      \
            __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0, l3 = l0, h3 = l0;      \
            for (int64_t i = 0; i < D; i += 16) {                                                                \
                const __m256 kl = LOAD(kt + i), kh = LOAD(kt + i + 8);                                           \
                l0 = _mm256_fmadd_ps(kl, _mm256_loadu_ps(q0 + i), l0);                                           \
                h0 = _mm256_fmadd_ps(kh, _mm256_loadu_ps(q0 + i + 8), h0);                                       \
                l1 = _mm256_fmadd_ps(kl, _mm256_loadu_ps(q1 + i), l1);                                           \
                h1 = _mm256_fmadd_ps(kh, _mm256_loadu_ps(q1 + i + 8), h1);                                       \
                l2 = _mm256_fmadd_ps(kl, _mm256_loadu_ps(q2 + i), l2);                                           \
                h2 = _mm256_fmadd_ps(kh, _mm256_loadu_ps(q2 + i + 8), h2);                                       \
                l3 = _mm256_fmadd_ps(kl, _mm256_loadu_ps(q3 + i), l3);                                           \
                h3 = _mm256_fmadd_ps(kh, _mm256_loadu_ps(q3 + i + 8), h3);                                       \
            }                                                                                                    \
            w0[t] = vsum_ymm(l0, h0) * scale; w1[t] = vsum_ymm(l1, h1) * scale;                                  \
            w2[t] = vsum_ymm(l2, h2) * scale; w3[t] = vsum_ymm(l3, h3) * scale;                                  \
        }                                                                                                        \
    } while (0)
#endif

/* kv_scores of n query heads on one KV head's keys: head h's query at q + h qs, its scores at w + h ws. On AVX2
   (float, D a multiple of 16) four heads a pass over the keys (KV_SCORES_HEADS4_YMM), the rest one head a pass. */
static void FN(kv_scores_heads)(int bf, const void *kc, int64_t first, int64_t stride, int64_t nt, int64_t D,
                                const REAL *q, int64_t qs, int64_t n, REAL scale, REAL *w, int64_t ws) {
    int64_t h = 0;
#if defined(LINE_YMM) && REAL_IS_FLOAT
    if (D % 16 == 0)
        for (; h + 4 <= n; h += 4) {
            const float *q0 = q + h * qs, *q1 = q0 + qs, *q2 = q1 + qs, *q3 = q2 + qs;
            float *w0 = w + h * ws, *w1 = w0 + ws, *w2 = w1 + ws, *w3 = w2 + ws;
            if (bf) {
                const uint16_t *k = (const uint16_t *)kc + first;
                KV_SCORES_HEADS4_YMM(k, bf16_ymm);
            } else {
                const float *k = (const float *)kc + first;
                KV_SCORES_HEADS4_YMM(k, _mm256_loadu_ps);
            }
        }
#endif
    for (; h < n; ++h) FN(kv_scores)(bf, kc, first, stride, nt, D, q + h * qs, scale, w + h * ws);
}

/* kv_scores as an entry point (tests: each build's path against the fp64 scores and the generic path's bits) */
void FN(linattn_decode_kv_scores)(int bf, const void *kc, int64_t first, int64_t stride, int64_t nt, int64_t D,
                                  const REAL *q, double scale, REAL *w) {
    FN(kv_scores)(bf, kc, first, stride, nt, D, q, (REAL)scale, w);
}

/* o[0 .. Dv) += e * v, v the cached row at element `off` (bf16 when bf, else in the plan's type): the softmax
   kind's values and the latent-attention kind's cached latents (decode_mla.h) */
static inline void FN(kv_axpy)(int bf, const void *vc, int64_t off, int64_t Dv, REAL e, REAL *restrict o) {
    if (bf) {
        const uint16_t *restrict v = (const uint16_t *)vc + off;
#pragma omp simd
        for (int64_t i = 0; i < Dv; ++i) o[i] += e * (REAL)bf16_to_f32(v[i]);
    } else {
        const REAL *restrict v = (const REAL *)vc + off;
#pragma omp simd
        for (int64_t i = 0; i < Dv; ++i) o[i] += e * v[i];
    }
}

/* kv_axpy of one value row into n heads' outputs at once (o + h Dv, each with its own weight e[h es]): the row read
   and widened once for the n; each output element the same fma in the same order as kv_axpy's, so the same bits */
static void FN(kv_axpy_heads)(int bf, const void *vc, int64_t off, int64_t Dv, int64_t n, const REAL *e, int64_t es,
                              REAL *o) {
    int64_t h = 0;
    for (; h + 4 <= n; h += 4) {
        const REAL e0 = e[h * es], e1 = e[(h + 1) * es], e2 = e[(h + 2) * es], e3 = e[(h + 3) * es];
        REAL *restrict o0 = o + h * Dv, *restrict o1 = o0 + Dv, *restrict o2 = o1 + Dv, *restrict o3 = o2 + Dv;
        if (bf) {
            const uint16_t *restrict v = (const uint16_t *)vc + off;
#pragma omp simd
            for (int64_t i = 0; i < Dv; ++i) {
                const REAL x = (REAL)bf16_to_f32(v[i]);
                o0[i] += e0 * x; o1[i] += e1 * x; o2[i] += e2 * x; o3[i] += e3 * x;
            }
        } else {
            const REAL *restrict v = (const REAL *)vc + off;
#pragma omp simd
            for (int64_t i = 0; i < Dv; ++i) {
                const REAL x = v[i];
                o0[i] += e0 * x; o1[i] += e1 * x; o2[i] += e2 * x; o3[i] += e3 * x;
            }
        }
    }
    for (; h < n; ++h) FN(kv_axpy)(bf, vc, off, Dv, e[h * es], o + h * Dv);
}

/* the rotation of one head's first R channels (rotate-half form) by cos c / sin s [R/2] */
static void FN(rope_head)(REAL *restrict x, int64_t R, const REAL *c, const REAL *s) {
    const int64_t h = R / 2;
    for (int64_t i = 0; i < h; ++i) {
        const REAL x1 = x[i], x2 = x[i + h];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + h] = x2 * c[i] + x1 * s[i];
    }
}

/* Softmax attention of one token (kind 2) on xn [B, d] (the normed input) into o [B, H * V]: the projections
   into y, per-head q / k norms, RoPE, the new k / v written into the cache at row kv_len, softmax over the
   visible keys lo .. kv_len with the maximum subtracted (in the plan's type, fp32 for bf16 weights), the
   output gate. Returns 0, or 1 when out of memory. */
static int FN(softmax_mix)(const linattn_block_plan *p, const REAL *xn, REAL *y, REAL *o) {
    const int64_t B = p->B, d = p->d, H = p->H, G = p->kvh, D = p->K, Dv = p->V, R = p->rot;
    const int64_t qw = p->att_gate == 2 ? 2 * D : D, nq = H * qw, nk = G * D, nv = G * Dv, grp = H / G;
    const int64_t L = p->kv_len + 1, cap = p->kv_cap, row = p->kv_len;
    const int kb = p->kv_bf16;
    REAL *q = y, *k = q + B * nq, *v = k + B * nk, *g = v + B * nv;
    LT_START(lt);
    FN(weight_product)(WEIGHT_FORMAT(p->wbf16, p->fmt_Wq), p->sc_Wq, p->grp_Wq,
            B, nq, d, p->Wq, (const REAL *)p->bq, xn, NULL, q, p->nthreads);
    FN(weight_product)(WEIGHT_FORMAT(p->wbf16, p->fmt_Wk), p->sc_Wk, p->grp_Wk,
            B, nk, d, p->Wk, (const REAL *)p->bk, xn, NULL, k, p->nthreads);
    FN(weight_product)(WEIGHT_FORMAT(p->wbf16, p->fmt_Wv), p->sc_Wv, p->grp_Wv,
            B, nv, d, p->Wv, (const REAL *)p->bv, xn, NULL, v, p->nthreads);
    if (p->att_gate == 1) FN(weight_product)(WEIGHT_FORMAT(p->wbf16, p->fmt_Wg), p->sc_Wg, p->grp_Wg,
            B, H * Dv, d, p->Wg, NULL, xn, NULL, g, p->nthreads);
    LT_LAP(lt, LT_QKV);
    REAL *ws = (REAL *)malloc(sizeof(REAL) * (size_t)(H * L + R + H + 1));
    if (!ws) return 1;
    REAL *cs = ws + H * L, *sn = cs + R / 2, *dn = sn + R / 2;   /* (dn: each head's softmax denominator) */
    const double *inv = (const double *)p->inv_freq;
    const REAL *qnw = (const REAL *)p->qnw, *knw = (const REAL *)p->knw;
    const REAL scale = (REAL)p->scale;
    for (int64_t b = 0; b < B; ++b) {
        const int64_t pos = p->pos ? p->pos[b] : p->pos0, lo = p->lo ? p->lo[b] : p->lo0;
        if (p->qk_norm == 2) {
            FN(rmsnorm)(1, nq, q + b * nq, qnw, p->qk_eps, q + b * nq);
            FN(rmsnorm)(1, nk, k + b * nk, knw, p->qk_eps, k + b * nk);
        }
        for (int64_t i = 0; i < R / 2; ++i) {
            if (p->rope_f32) {
                const float a = (float)pos * (float)inv[i];
                cs[i] = (REAL)(cosf(a) * (float)p->rope_scale); sn[i] = (REAL)(sinf(a) * (float)p->rope_scale);
            } else {
                const double a = (double)pos * inv[i];
                cs[i] = (REAL)cos(a); sn[i] = (REAL)sin(a);
            }
        }
        for (int64_t h = 0; h < H; ++h) {
            REAL *qh = q + b * nq + h * qw;
            if (p->qk_norm == 1) FN(rmsnorm)(1, D, qh, qnw, p->qk_eps, qh);
            if (R) FN(rope_head)(qh, R, cs, sn);
        }
        for (int64_t j = 0; j < G; ++j) {
            REAL *kh = k + b * nk + j * D;
            if (p->qk_norm == 1) FN(rmsnorm)(1, D, kh, knw, p->qk_eps, kh);
            if (R) FN(rope_head)(kh, R, cs, sn);
            const int64_t ko = ((b * cap + row) * G + j) * D, vo = ((b * cap + row) * G + j) * Dv;
            for (int64_t i = 0; i < D; ++i) FN(kv_put)(kb, p->kc, ko + i, kh[i]);
            for (int64_t i = 0; i < Dv; ++i) FN(kv_put)(kb, p->vc, vo + i, v[b * nv + j * Dv + i]);
        }
        /* the heads in parallel only where the keys they read pay for waking the threads; else a KV group's heads
           together, so that its key and value rows are read once for the group (from memory: the group's other
           heads had read them again from L2, after the first had waited for them) */
        const int par = p->nthreads > 1 && H > 1 && H * (L - lo) * (D + Dv) >= PAR_MIN_ELEMS;
        const int64_t hb = par ? 1 : grp;
#pragma omp parallel for num_threads(p->nthreads) schedule(static) if(par)
        for (int64_t h0 = 0; h0 < H; h0 += hb) {
            const int64_t j = h0 / grp;
            FN(kv_scores_heads)(kb, p->kc, ((b * cap + lo) * G + j) * D, G * D, L - lo, D, q + b * nq + h0 * qw, qw,
                                hb, scale, ws + h0 * L + lo, L);
            /* each head's scores into its exps (in place) and their sum, in the keys' order */
            for (int64_t h = h0; h < h0 + hb; ++h) {
                REAL *restrict w = ws + h * L;
                REAL m = -INFINITY, sum = 0;
                int nan = 0;
                for (int64_t t = lo; t < L; ++t) {
                    const REAL s = w[t];
                    nan |= s != s;
                    if (s > m) m = s;
                }
                for (int64_t t = lo; t < L; ++t) {
                    const REAL e = nan ? (REAL)NAN : MATH(exp)(w[t] - m);
                    sum += e;
                    w[t] = e;
                }
                dn[h] = sum;
            }
            REAL *og = o + b * H * Dv + h0 * Dv;
            for (int64_t i = 0; i < hb * Dv; ++i) og[i] = 0;
            const size_t vsz = kb ? 2 : sizeof(REAL);
            for (int64_t t = lo; t < L; ++t) {
                if (t + KV_PF_ROWS < L) {   /* (the value row KV_PF_ROWS ahead) */
                    const char *ahead = (const char *)p->vc + (size_t)((b * cap + t + KV_PF_ROWS) * G + j) * Dv * vsz;
                    for (size_t i = 0; i < (size_t)Dv * vsz; i += 64) __builtin_prefetch(ahead + i, 0, 3);
                }
                FN(kv_axpy_heads)(kb, p->vc, ((b * cap + t) * G + j) * Dv, Dv, hb, ws + h0 * L + t, L, og);
            }
            for (int64_t h = h0; h < h0 + hb; ++h) {
                const REAL *qh = q + b * nq + h * qw, dh = dn[h];
                REAL *oh = o + b * H * Dv + h * Dv;
                const REAL *gh = p->att_gate == 1 ? g + b * H * Dv + h * Dv : p->att_gate == 2 ? qh + D : NULL;
                /* o / den times the gate, a loop per gate (one loop choosing per element left SiLU's exp scalar) */
                if (!gh)
                    for (int64_t i = 0; i < Dv; ++i) oh[i] = oh[i] / dh;
                else if (p->gate_sig)   /* (libm's exp, as the layer's torch.sigmoid: a call per element) */
                    for (int64_t i = 0; i < Dv; ++i)
                        oh[i] = (oh[i] / dh) * ((REAL)1 / ((REAL)1 + MATH(exp)(-gh[i])));
                else {
                    LA_SIMD
                    for (int64_t i = 0; i < Dv; ++i) oh[i] = (oh[i] / dh) * FN(la_silu)(gh[i]);
                }
            }
        }
        LT_BYTES((double)(kb ? 2 : sizeof(REAL)) * (double)((L - lo) * G * (D + Dv)));
    }
    LT_LAP(lt, LT_ATTN);
    free(ws);
    return 0;
}

/* the FFN's hidden rows g [R, n] from its first product u: silu(a) * b of u = [a | b] [R, 2n] (act 0), or
   relu(u)^2 of u [R, n] (act 1, non-gated: Nemotron-H's relu2; NaN stays NaN, as torch.relu) */
static void FN(ffn_hidden)(int act, int64_t R, int64_t n, const REAL *u, REAL *g) {
    for (int64_t r = 0; r < R; ++r) {
        REAL *restrict gr = g + r * n;
        if (act) {
            const REAL *restrict ur = u + r * n;
            for (int64_t j = 0; j < n; ++j) {
                const REAL v = ur[j] > 0 || ur[j] != ur[j] ? ur[j] : (REAL)0;
                gr[j] = v * v;
            }
        } else {
            const REAL *restrict ua = u + r * 2 * n, *restrict ub = ua + n;
#pragma omp simd
            for (int64_t j = 0; j < n; ++j) gr[j] = FN(la_silu)(ua[j]) * ub[j];
        }
    }
}

/* a scaled residual add (res_scaled): out = a res + b y, elementwise (y may be out). Granite's (a = 1) is
   transformers' `residual + branch * multiplier` to the bit: 1 * res is exact. */
static void FN(scaled_add)(int64_t n, const REAL *res, double a, const REAL *y, double b, REAL *out) {
    const REAL ra = (REAL)a, rb = (REAL)b;
    for (int64_t i = 0; i < n; ++i) out[i] = res[i] * ra + y[i] * rb;
}

#include "decode_kda.h"
#include "decode_mamba2.h"
#include "decode_log.h" /* kind 3: FN(decode_linear_log) */
#include "decode_ela.h" /* kind 6: FN(decode_linear_ela) */
#include "decode_moe.h" /* ffn_kind 1: FN(moe_ffn) */
#include "decode_mla.h" /* kind 7: FN(mla_mix) */
#include "decode_lightning.h" /* kind 8: FN(lightning_mix) */

/* a post-norm block's residual add: out = res + rmsnorm(y) (y [B, d] normed in place) */
static void FN(postnorm_add)(int64_t B, int64_t d, const REAL *res, REAL *y, const REAL *w, double eps, REAL *out) {
    FN(rmsnorm)(B, d, y, w, eps, y);
    for (int64_t i = 0; i < B * d; ++i) out[i] = res[i] + y[i];
}

/* x [B, d] -> x_out [B, d]; the mixer's conv window w_in -> w_out and state S_in -> S_out (S_in, w_in NULL
   before the first token); w_io (kinds 0, 1, 4 and 5 only): the window as transformers keeps it instead, [B, C, KC]
   read and advanced in place (FN(conv_io)). Returns 0, or 1 when out of memory, 3 w_io for another kind. */
static int FN(decode_block_io)(const linattn_block_plan *p, const REAL *x, const REAL *w_in, const REAL *S_in,
                               REAL *w_out, REAL *S_out, REAL *x_out, REAL *w_io) {
    if (w_io && p->kind != 0 && p->kind != 1 && p->kind != 4 && p->kind != 5) return 3;
    const int64_t B = p->B, d = p->d, ny = p->ny, no = p->HV * p->V, hid = p->hid;
    const int64_t nwork = B * (2 * d + ny + no + (p->has_ffn ? 3 * hid : 0));
    LT_START(lt);
    REAL *xn = (REAL *)malloc(sizeof(REAL) * (size_t)(nwork + 1));
    if (!xn) return 1;
    REAL *y = xn + B * d, *o = y + B * ny, *h = o + B * no, *u = h + B * d, *g = u + 2 * B * hid;
    const REAL *cw = (const REAL *)p->cw, *cb = (const REAL *)p->cb, *nw = (const REAL *)p->nw;
    int rc;
    const int scaled = p->postnorm ? 0 : p->res_scaled;   /* (the scaled orders are pre-norm) */
    if (p->ffn_only) {   /* (Nemotron-H's MLP / MoE blocks: no mixer) */
        memcpy(h, x, sizeof(REAL) * (size_t)(B * d));
        goto ffn;
    }
    if (p->postnorm) memcpy(xn, x, sizeof(REAL) * (size_t)(B * d));   /* (the mixer reads x itself) */
    else FN(rmsnorm)(B, d, x, (const REAL *)p->n1w, p->n1eps, xn);
    LT_LAP(lt, LT_NORM);
    if (p->kind != 2) FN(fused_product)(WEIGHT_FORMAT(p->wbf16, p->fmt_W), p->sc_W, p->grp_W, p->nparts_W,
            p->parts_W, p->rows_W, B, ny, d, p->W, (const REAL *)p->Wb, xn, NULL, y, p->nthreads);
    LT_LAP(lt, LT_QKV);
    if (p->kind == 2)
        rc = FN(softmax_mix)(p, xn, y, o);
    else if (p->kind == 4)
        rc = FN(kda_mix)(p, y, w_in, S_in, w_out, S_out, o, w_io);
    else if (p->kind == 5)
        rc = FN(mamba2_mix)(p, y, w_in, S_in, w_out, S_out, o, w_io);
    else if (p->kind == 3)
        rc = FN(decode_linear_log)(p, y, ny, w_in, w_out, S_in, S_out, o);
    else if (p->kind == 6)
        rc = FN(decode_linear_ela)(p, y, ny, w_in, w_out, S_in, S_out, o);
    else if (p->kind == 7)
        rc = FN(mla_mix)(p, y, o);
    else if (p->kind == 8)
        rc = FN(lightning_mix)(p, y, S_in, S_out, o);
    else if (p->kind == 0)
        rc = FN(decode_delta_io)(B, p->H, p->HV, p->K, p->V, y, ny, p->KC, w_in, cw, cb, p->conv_act,
                 w_out, p->dkind, p->l2conv, p->q_l2, p->l2eps, p->scale, p->beta_mode, (const REAL *)p->alpha,
                 p->gated, (const REAL *)p->neg_a, (const REAL *)p->dt_bias, S_in, S_out, p->has_norm, nw,
                 p->norm_eps, p->has_gate, o, p->nthreads, w_io);
    else
        rc = FN(decode_linear_io)(B, p->H, p->HV, p->K, p->V, y, ny, p->KC, w_in, cw, cb, p->conv_act,
                 w_out, p->fmap, p->scale, p->gate_kind, (const REAL *)p->decay, (const REAL *)p->neg_a,
                 (const REAL *)p->dt_bias, S_in, S_out, p->normalize, p->nonneg, p->eps, p->has_norm, nw,
                 p->norm_eps, p->has_gate, o, p->nthreads, w_io);
    if (p->kind == 0 || p->kind == 1 || p->kind == 2) LT_RESTART(lt);   /* (timed their own sections) */
    else LT_LAP(lt, LT_MIXER);
    if (rc) { free(xn); return rc; }
    REAL *hout = p->has_ffn ? h : x_out;
    FN(weight_product)(WEIGHT_FORMAT(p->wbf16, p->fmt_Wo), p->sc_Wo, p->grp_Wo,
            B, d, no, p->Wo, (const REAL *)p->bo, o, p->postnorm || scaled ? NULL : x, p->postnorm ? xn : hout,
            p->nthreads);
    LT_LAP(lt, LT_OUT);
    if (p->postnorm) FN(postnorm_add)(B, d, x, xn, (const REAL *)p->n1w, p->n1eps, hout);
    if (scaled) FN(scaled_add)(B * d, scaled == 1 ? xn : x, p->res_a1, hout, p->res_b1, hout);
    LT_LAP(lt, LT_RESID);
ffn:
    if (p->has_ffn && p->ffn_kind == 1) {   /* (pre-norm only: the builders describe no post-norm MoE) */
        FN(rmsnorm)(B, d, h, (const REAL *)p->n2w, p->n2eps, xn);
        LT_LAP(lt, LT_NORM);
        rc = FN(moe_ffn)(p, xn, h, x_out);
        LT_LAP(lt, LT_MOE);
        free(xn);
        return rc;
    }
    if (p->has_ffn) {
        if (!p->postnorm) FN(rmsnorm)(B, d, h, (const REAL *)p->n2w, p->n2eps, xn);
        LT_LAP(lt, LT_NORM);
        FN(fused_product)(WEIGHT_FORMAT(p->wbf16, p->fmt_Wgu), p->sc_Wgu, p->grp_Wgu, p->nparts_Wgu, p->parts_Wgu,
                p->rows_Wgu, B, (p->ffn_act ? 1 : 2) * hid, d, p->Wgu, (const REAL *)p->bgu, p->postnorm ? h : xn, NULL,
                u, p->nthreads);
        LT_LAP(lt, LT_GATE_UP);
        FN(ffn_hidden)(p->ffn_act, B, hid, u, g);
        LT_LAP(lt, LT_ACT);
        FN(weight_product)(WEIGHT_FORMAT(p->wbf16, p->fmt_Wd), p->sc_Wd, p->grp_Wd,
                B, d, hid, p->Wd, (const REAL *)p->bd, g, p->postnorm || scaled ? NULL : h,
                p->postnorm ? xn : x_out, p->nthreads);
        LT_LAP(lt, LT_DOWN);
        if (p->postnorm) FN(postnorm_add)(B, d, h, xn, (const REAL *)p->n2w, p->n2eps, x_out);
        if (scaled) FN(scaled_add)(B * d, scaled == 1 ? xn : h, p->res_a2, x_out, p->res_b2, x_out);
    }
    free(xn);
    LT_LAP(lt, LT_RESID);
    return 0;
}

int FN(linattn_decode_block)(const linattn_block_plan *p, const REAL *x, const REAL *w_in, const REAL *S_in,
                             REAL *w_out, REAL *S_out, REAL *x_out) {
    return FN(decode_block_io)(p, x, w_in, S_in, w_out, S_out, x_out, NULL);
}

/* ids [B] -> logits [B, vocab] (and 0 into *aux, the model's aux loss, when aux is not NULL: one torch call less
   per token). Returns 0; 1 out of memory; 2 an id outside [0, vocab) (nothing written); 3 a conv state in place
   (w_io_at) for a kind that cannot take it. */
int FN(linattn_decode_model)(const linattn_model_plan *p, const int64_t *ids, const REAL *S_in,
                             const REAL *w_in, REAL *S_out, REAL *w_out, void *logits, float *aux) {
    LT_START(lt_call);   /* (the whole function: "total" is the call less the crossing of ctypes) */
    LT_START(lt);
    const int64_t B = p->B, d = p->d, V = p->vocab;
    for (int64_t b = 0; b < B; ++b)
        if (ids[b] < 0 || ids[b] >= V) return 2;
    /* x: two activation rows per batch row, then (bf16) the fp32 logits before rounding */
    REAL *x = (REAL *)malloc(sizeof(REAL) * (size_t)(2 * B * d + (p->wbf16 ? B * V : 0) + 1));
    if (!x) return 1;
    LT_LAP(lt, LT_SETUP);
    REAL *xa = x, *xb = x + B * d;
    for (int64_t b = 0; b < B; ++b) {
        if (p->wbf16) {
            const uint16_t *E = (const uint16_t *)p->embed + ids[b] * d;
            for (int64_t j = 0; j < d; ++j) xa[b * d + j] = (REAL)bf16_to_f32(E[j]);
        } else
            memcpy(xa + b * d, (const REAL *)p->embed + ids[b] * d, sizeof(REAL) * (size_t)d);
    }
    if (p->emb_scaled)
        for (int64_t i = 0; i < B * d; ++i) xa[i] = xa[i] * (REAL)p->emb_scale;
    LT_BYTES((double)B * (double)d * (p->wbf16 ? 2.0 : (double)sizeof(REAL)));
    LT_LAP(lt, LT_EMBED);
    for (int64_t l = 0; l < p->L; ++l) {
        const int64_t so = p->s_off[l], wo = p->w_off[l];
        const REAL *S_l = p->s_in_at ? (const REAL *)p->s_in_at[l] : S_in ? S_in + so : NULL;
        REAL *io = p->w_io_at ? (REAL *)p->w_io_at[l] : NULL;
        const int rc = FN(decode_block_io)(p->blocks[l], xa, (w_in && wo >= 0 && !io) ? w_in + wo : NULL,
                                            S_l, wo >= 0 && !io ? w_out + wo : NULL, S_out + so, xb, io);
        if (rc) { free(x); return rc; }
        REAL *t = xa; xa = xb; xb = t;
    }
    LT_RESTART(lt);   /* (the blocks timed their own sections) */
    const REAL *h = xa;
    if (p->has_norm) { FN(rmsnorm)(B, d, xa, (const REAL *)p->norm_w, p->norm_eps, xb); h = xb; }
    LT_LAP(lt, LT_NORM);
    REAL *lg = p->wbf16 ? xb + B * d : (REAL *)logits;
    FN(weight_product)(WEIGHT_FORMAT(p->wbf16, p->fmt_head), p->sc_head, p->grp_head,
            B, V, d, p->head, NULL, h, NULL, lg, p->nthreads);
    LT_LAP(lt, LT_HEAD);
    if (p->logits_scaled)
        for (int64_t i = 0; i < B * V; ++i) lg[i] = lg[i] / (REAL)p->logits_div;
    if (p->wbf16)
        for (int64_t i = 0; i < B * V; ++i) ((uint16_t *)logits)[i] = f32_to_bf16((float)lg[i]);
    if (aux) *aux = 0.0f;
    LT_LAP(lt, LT_LOGITS);
    free(x);
    LT_LAP(lt, LT_TEARDOWN);
    LT_LAP(lt_call, LT_TOTAL);
#if defined(LINATTN_DECODE_TIMING)
    ++lt_tokens;
#endif
    return 0;
}

/* the first index of the largest of V logits (bf16 when bf16, else REAL), as torch.argmax picks it: a NaN counts as
   the largest, the first NaN wins; ties go to the first index */
static int64_t FN(argmax_row)(int bf16, const void *lg, int64_t V) {
    int64_t best = 0;
    REAL m = bf16 ? (REAL)bf16_to_f32(((const uint16_t *)lg)[0]) : ((const REAL *)lg)[0];
    if (m != m) return 0;
    for (int64_t i = 1; i < V; ++i) {
        const REAL v = bf16 ? (REAL)bf16_to_f32(((const uint16_t *)lg)[i]) : ((const REAL *)lg)[i];
        if (v != v) return i;
        if (v > m) m = v, best = i;
    }
    return best;
}

/* Greedy decoding of up to n tokens in one call (llama.cpp's loop, without a Python crossing per token): n times the
   whole-model step above, each step's input the last one's greedy pick.

   Step t reads the states / windows S_in / w_in (t = 0; the plan's s_in_at too) or the other buffer of the pair
   (S_a, w_a) / (S_b, w_b) it ping-pongs (step t writes S_a / w_a when t is even, S_b / w_b when odd; S_in / w_in are
   never written), then picks row b's next id as torch.argmax does on the logits the step returns (bf16 logits for a
   bf16 plan: on those), tokens[b n + t]; with eos >= 0 a row is finished once its input id at entry or a pick was
   eos, and a finished row's pick is eos (as the models' `stream` feeds it), and the loop stops after the step where
   every row is finished. The logits of the last step are in logits, as linattn_decode_model writes them.

   The KV blocks (softmax attention, kind 2; latent attention, kind 7) advance their per-call fields between steps
   as the caller sets them for the next token (models/decode_plan.py `_kv_args`): the row kv_len + 1, the position
   pos0 + 1 and, with a window kv_win[l] > 0 (NULL: none), the first visible key max(0, kv_len + 2 - kv_win[l]). The
   caller's plans stay const: those blocks run from copies this call owns (the model plan's block table too), whose
   fields it writes. The caller makes room for n rows in every KV cache (kv_len + n <= kv_cap) and sets pos0 / lo0
   (per-row pos / lo are not advanced here).

   Returns the steps run (1 .. n; 0 for n <= 0), or -1 out of memory, -2 an input id outside [0, vocab), -3 a KV
   block with per-row positions or without room for n rows (-2, -3: nothing run). In the timing build each step
   counts as a token; the picks and the copies count in "logits" / "setup" / "teardown" and in "total". */
int64_t FN(linattn_decode_model_greedy)(const linattn_model_plan *p, const int64_t *ids, const REAL *S_in,
                                        const REAL *w_in, REAL *S_a, REAL *w_a, REAL *S_b, REAL *w_b, void *logits,
                                        float *aux, int64_t n, int64_t eos, const int64_t *kv_win, int64_t *tokens) {
    LT_START(lt);
    const int64_t B = p->B, L = p->L, V = p->vocab;
    if (n <= 0) return 0;
    for (int64_t b = 0; b < B; ++b)
        if (ids[b] < 0 || ids[b] >= V) return -2;
    int64_t nkv = 0;
    for (int64_t l = 0; l < L; ++l) {
        const linattn_block_plan *q = p->blocks[l];
        if (q->kind != 2 && q->kind != 7) continue;
        if (q->pos || q->lo || q->kv_len + n > q->kv_cap) return -3;
        ++nkv;
    }
    const linattn_block_plan **blk = (const linattn_block_plan **)malloc(sizeof(void *) * (size_t)L);
    linattn_block_plan *own = (linattn_block_plan *)malloc(sizeof(linattn_block_plan) * (size_t)(nkv + 1));
    int64_t *cur = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * B + L + 1)), *done = cur + B, *kvl = done + B;
    if (!blk || !own || !cur) { free(blk); free(own); free(cur); return -1; }
    int64_t k = 0;
    for (int64_t l = 0; l < L; ++l) {   /* kvl[l]: the layer's copy in own, or -1 */
        const linattn_block_plan *q = p->blocks[l];
        kvl[l] = -1;
        if (q->kind == 2 || q->kind == 7) own[k] = *q, kvl[l] = k, blk[l] = &own[k++];
        else blk[l] = q;
    }
    linattn_model_plan mp = *p;
    mp.blocks = blk;
    for (int64_t b = 0; b < B; ++b) cur[b] = ids[b], done[b] = eos >= 0 && ids[b] == eos;
    const int bf = p->wbf16;
    const size_t lsize = bf ? sizeof(uint16_t) : sizeof(REAL);
    int64_t t = 0, rc = 0;
    LT_GLUE(lt, LT_SETUP);
    while (t < n) {
        REAL *So = (t & 1) ? S_b : S_a, *wo = (t & 1) ? w_b : w_a;
        const REAL *Si = t == 0 ? S_in : (t & 1) ? S_a : S_b, *wi = t == 0 ? w_in : (t & 1) ? w_a : w_b;
        const int r = FN(linattn_decode_model)(&mp, cur, Si, wi, So, wo, logits, aux);
        if (r) { rc = r == 2 ? -2 : -1; break; }
        LT_RESTART(lt);
        mp.s_in_at = NULL;   /* (the first step's inputs only) */
        int64_t left = 0;
        for (int64_t b = 0; b < B; ++b) {
            int64_t id = FN(argmax_row)(bf, (const char *)logits + (size_t)(b * V) * lsize, V);
            if (done[b]) id = eos;
            else if (eos >= 0 && id == eos) done[b] = 1;
            left += !done[b];
            tokens[b * n + t] = cur[b] = id;
        }
        for (int64_t l = 0; l < L; ++l) {
            if (kvl[l] < 0) continue;
            linattn_block_plan *q = &own[kvl[l]];
            const int64_t w = kv_win ? kv_win[l] : 0;
            q->kv_len += 1, q->pos0 += 1;
            q->lo0 = w > 0 && q->kv_len + 1 - w > 0 ? q->kv_len + 1 - w : 0;
        }
        ++t;
        LT_GLUE(lt, LT_LOGITS);
        if (eos >= 0 && !left) break;
    }
    LT_RESTART(lt);
    free(blk); free(own); free(cur);
    LT_GLUE(lt, LT_TEARDOWN);
    return rc ? rc : t;
}

#endif
