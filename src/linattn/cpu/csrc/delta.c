/* The delta family's scan on a CPU: forward and backward, token by token (linattn.cpu.delta).

       S_t = D_t S_{t-1} - a_t k_t ((D_t S_{t-1})^T k_t)^T + a_t k_t v_t^T,     o_t = S_t^T q_t

   with D_t = exp(g_t) (none, one log-gate per head, or one per key channel). The kernels take the decays
   exp(g) [TT, H] or [TT, H, K] (the argument `g` below), computed by torch's vectorised exp before the call
   (one scalar expf per key channel and token was a third of the per-channel forward); the backward still
   returns dL/dg (= <dP, P>, the chain rule through exp included). This is the delta rule's own
   read (r = None in ops/delta_core.py); q arrives scaled, k, v, a rescaled by the key norm (prepare_delta).

   Why token by token and not the chunk (WY/UT) form: per token and head the scan costs 4 K V multiply-adds
   over a state of K x V that stays in L1 (16 KB for K = V = 64); the chunk form costs C (K + V) + 3 K V,
   more for every C >= K, and wins on a GPU only through its parallel matmuls. Here every loop over the value
   axis is contiguous and vectorises, and causality is structural: nothing computed for token t reads a later
   token, so a later inf/NaN never reaches an earlier output and a prefix gives the same bits.

   Layout: tokens flat, [TT, H, D] contiguous; sequence n covers tokens starts[n] .. starts[n+1]-1 (B equal
   sequences or cu_seqlens). States [N, H, K, V]. One OpenMP task per (sequence, head).

   Backward: the forward stores the state at the start of every chunk of `chunk` tokens (ckpt [NCK, H, K, V],
   sequence n's first at ck_off[n]); the backward walks the chunks in reverse, recomputes a chunk's states
   from its checkpoint, then runs the reverse recurrence token by token.

   No -ffast-math: the reductions are vectorised through `omp simd reduction` (reassociation only); NaN and
   inf propagate as in the PyTorch forms. Every kernel is compiled for float and for double (DEFINE_DELTA). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* -std=c11 turns floating-point contraction off; a fused multiply-add only rounds once (as PyTorch's own
   CPU kernels do) and keeps NaN and inf as they are. GCC's unroll-and-jam of the row loops (-O3) kept the
   column accumulators on the stack: the forward ran 1.5-2x slower (measured), so it is off here. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=fast", "no-loop-unroll-and-jam")
#elif defined(__clang__)
#pragma clang fp contract(fast)
#endif

#define GATE_NONE 0
#define GATE_HEAD 1
#define GATE_CHANNEL 2

/* simd pragmas always (honoured under -fopenmp or -fopenmp-simd, ignored otherwise); threads under OpenMP */
#define PRAGMA(x) _Pragma(#x)
#define SIMD PRAGMA(omp simd)
#define SIMD_SUM(...) PRAGMA(omp simd reduction(+ : __VA_ARGS__))
#if defined(_OPENMP)
#define PARALLEL_FOR(n) PRAGMA(omp parallel for schedule(dynamic, 1) num_threads(n))
#define ATOMIC_WRITE PRAGMA(omp atomic write)
#else
#define PARALLEL_FOR(n)
#define ATOMIC_WRITE
#endif
#define INLINE static inline __attribute__((always_inline))
#if defined(__GNUC__)
#define PREFETCH(p, w) __builtin_prefetch((p), (w))
#else
#define PREFETCH(p, w) ((void)0)
#endif
#define PF_AHEAD 4 /* tokens: a head's rows lie H * D apart, which the hardware prefetchers follow poorly */

int linattn_delta_abi_version(void) { return 2; }

/* Columns of the state are independent given k, a and g: every step works on blocks of VB value columns
   (256 bytes: 64 floats, 32 doubles; 128 bytes without AVX-512, which has half the registers) so that the
   inner loops have a constant trip count, vectorise fully and keep their accumulators in registers; the
   state block [K, VB] stays in L1. The last block may be narrower (the same code with a run-time width).
   One pass over the state per token: the pass that writes S_t also accumulates the next token's prediction
   (D_{t+1} S_t)^T k_{t+1} (it reads only token t+1's key and gate, never an output's input). */
#if defined(__AVX512F__)
#define VBYTES 256
#else
#define VBYTES 128
#endif
#define DEFINE_DELTA(real, SFX)                                                                          \
enum { VB_##SFX = VBYTES / sizeof(real) };                                                                    \
                                                                                                              \
/* the per-token factors: e_d = exp(g) (1 without a gate), ke_d = k_d e_d (the read key D k), ak_d = a k_d */ \
INLINE void factors_##SFX(int64_t K, const real *restrict k, real a, const real *restrict g, int gate,        \
                          real *restrict e, real *restrict ke, real *restrict ak) {                           \
    const real eh = gate == GATE_HEAD ? g[0] : (real)1;                                                       \
    for (int64_t d = 0; d < K; d++) {                                                                         \
        e[d] = gate == GATE_CHANNEL ? g[d] : eh;                                                              \
        ke[d] = k[d] * e[d];                                                                                  \
        ak[d] = a * k[d];                                                                                     \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
/* x[0] + ... + x[L-1] of L = 64 bytes of lanes, by halving with constant bounds */                            \
INLINE real lanes_sum_##SFX(real *restrict x) {                                                               \
    enum { L = 64 / sizeof(real) };                                                                           \
    SIMD for (int64_t l = 0; l < L / 2; l++) x[l] += x[l + L / 2];                                            \
    SIMD for (int64_t l = 0; l < L / 4; l++) x[l] += x[l + L / 4];                                            \
    for (int64_t l = 0; l < L / 8; l++) x[l] += x[l + L / 8];                                                 \
    return L == 16 ? x[0] + x[1] : x[0];                                                                      \
}                                                                                                             \
                                                                                                              \
/* w = v - (D S)^T k on the columns [0, nw) of S (row stride V): the first token of a stretch */              \
INLINE void predict_cols_##SFX(int64_t K, int64_t V, int64_t nw, const real *restrict S,                      \
                               const real *restrict ke, const real *restrict v, real *restrict w) {           \
    real acc[VB_##SFX];                                                                                       \
    SIMD for (int64_t j = 0; j < nw; j++) acc[j] = 0;                                                         \
    for (int64_t d = 0; d < K; d++) {                                                                         \
        const real *restrict Sd = S + d * V;                                                                  \
        const real c = ke[d];                                                                                 \
        SIMD for (int64_t j = 0; j < nw; j++) acc[j] += c * Sd[j];                                            \
    }                                                                                                         \
    SIMD for (int64_t j = 0; j < nw; j++) w[j] = v[j] - acc[j];                                               \
}                                                                                                             \
                                                                                                              \
/* Token t on the columns [0, nw): Sout = D Sin + a k w^T (Sin may be Sout: each element is read, then         \
   written), o = Sout^T q when has_o, and when has_next the next token's wn = vn - (D_{t+1} Sout)^T k_{t+1}. */ \
INLINE void step_cols_##SFX(int64_t K, int64_t V, int64_t nw, const real *Sin, real *Sout,                    \
                            const real *restrict e, const real *restrict ak, const real *restrict w,          \
                            const real *restrict q, real *restrict o, int has_o, const real *restrict ken,    \
                            const real *restrict vn, real *restrict wn, int has_next) {                       \
    real wr[VB_##SFX], out[VB_##SFX], accn[VB_##SFX];                                                         \
    SIMD for (int64_t j = 0; j < nw; j++) { wr[j] = w[j]; out[j] = 0; accn[j] = 0; }                          \
    for (int64_t d = 0; d < K; d++) {                                                                         \
        const real *Sid = Sin + d * V;                                                                        \
        real *Sod = Sout + d * V;                                                                             \
        const real ed = e[d], c = ak[d], qd = has_o ? q[d] : 0, kn = has_next ? ken[d] : 0;                   \
        SIMD for (int64_t j = 0; j < nw; j++) {                                                               \
            const real s = ed * Sid[j] + c * wr[j];                                                           \
            Sod[j] = s;                                                                                       \
            if (has_o) out[j] += qd * s;                                                                      \
            if (has_next) accn[j] += kn * s;                                                                  \
        }                                                                                                     \
    }                                                                                                         \
    if (has_o) { SIMD for (int64_t j = 0; j < nw; j++) o[j] = out[j]; }                                       \
    if (has_next) { SIMD for (int64_t j = 0; j < nw; j++) wn[j] = vn[j] - accn[j]; }                          \
}                                                                                                             \
                                                                                                              \
INLINE void predict_##SFX(int64_t K, int64_t V, const real *S, const real *ke, const real *v, real *w) {      \
    int64_t j0 = 0;                                                                                           \
    for (; j0 + VB_##SFX <= V; j0 += VB_##SFX) predict_cols_##SFX(K, V, VB_##SFX, S + j0, ke, v + j0, w + j0); \
    if (j0 < V) predict_cols_##SFX(K, V, V - j0, S + j0, ke, v + j0, w + j0);                                 \
}                                                                                                             \
                                                                                                              \
/* one token over every column block; has_o and has_next are constants at each call site (specialised) */     \
INLINE void step_##SFX(int64_t K, int64_t V, const real *Sin, real *Sout, const real *e, const real *ak,      \
                       const real *w, const real *q, real *o, int has_o, const real *ken, const real *vn,     \
                       real *wn, int has_next) {                                                              \
    int64_t j0 = 0;                                                                                           \
    for (; j0 + VB_##SFX <= V; j0 += VB_##SFX)                                                                \
        step_cols_##SFX(K, V, VB_##SFX, Sin + j0, Sout + j0, e, ak, w + j0, q, has_o ? o + j0 : NULL, has_o,  \
                        ken, has_next ? vn + j0 : NULL, has_next ? wn + j0 : NULL, has_next);                 \
    if (j0 < V)                                                                                               \
        step_cols_##SFX(K, V, V - j0, Sin + j0, Sout + j0, e, ak, w + j0, q, has_o ? o + j0 : NULL, has_o,    \
                        ken, has_next ? vn + j0 : NULL, has_next ? wn + j0 : NULL, has_next);                 \
}                                                                                                             \
                                                                                                              \
/* Tokens t0 .. t0+L-1 of head h from the state S (updated in place, or written to Sstates[i+1] when          \
   Sstates is given, with Sstates[0] = S), outputs into o (or none), w_t into wstates[i] (or none), the        \
   factors e_t into estates[i] (or none). ckpt: the state before every `chunk`-th token (or none). */          \
static int scan_##SFX(int64_t H, int64_t K, int64_t V, int64_t h, int64_t t0, int64_t L, const real *q,       \
                      const real *k, const real *v, const real *a, const real *g, int gate, real *S,           \
                      real *Sstates, real *o, real *wstates, real *estates, real *ckpt, int64_t chunk) {       \
    if (L <= 0) return 0;                                                                                     \
    const int64_t KV = K * V, gK = gate == GATE_CHANNEL ? K : 1;                                              \
    real *buf = (real *)malloc((size_t)(6 * K + 2 * V) * sizeof(real));                                       \
    if (buf == NULL) return -1;                                                                               \
    real *e = buf, *ke = e + K, *ak = ke + K, *en = ak + K, *ken = en + K, *akn = ken + K;                    \
    real *w = akn + K, *wn = w + V;                                                                           \
    int64_t th = t0 * H + h;                                                                                  \
    factors_##SFX(K, k + th * K, a[th], gate != GATE_NONE ? g + th * gK : NULL, gate, e, ke, ak);             \
    predict_##SFX(K, V, S, ke, v + th * V, w);                                                                \
    const real *Sin = S;                                                                                      \
    for (int64_t i = 0; i < L; i++) {                                                                         \
        th = (t0 + i) * H + h;                                                                                \
        real *Sout = Sstates != NULL ? Sstates + (i + 1) * KV : S;                                            \
        if (ckpt != NULL && i % chunk == 0) memcpy(ckpt + (i / chunk) * H * KV, Sin, (size_t)KV * sizeof(real)); \
        if (wstates != NULL) memcpy(wstates + i * V, w, (size_t)V * sizeof(real));                           \
        if (estates != NULL) memcpy(estates + i * K, e, (size_t)K * sizeof(real));                           \
        if (i + PF_AHEAD < L) {                                                                               \
            const int64_t tp = th + PF_AHEAD * H;                                                             \
            for (int64_t c = 0; c < K; c += 64 / (int64_t)sizeof(real)) {                                     \
                PREFETCH(q + tp * K + c, 0);                                                                  \
                PREFETCH(k + tp * K + c, 0);                                                                  \
            }                                                                                                 \
            for (int64_t c = 0; c < V; c += 64 / (int64_t)sizeof(real)) {                                     \
                PREFETCH(v + tp * V + c, 0);                                                                  \
                if (o != NULL) PREFETCH(o + tp * V + c, 1);                                                   \
            }                                                                                                 \
        }                                                                                                     \
        if (i + 1 < L) {                                                                                      \
            const int64_t tn = th + H;                                                                        \
            factors_##SFX(K, k + tn * K, a[tn], gate != GATE_NONE ? g + tn * gK : NULL, gate, en, ken, akn);  \
            if (o != NULL) step_##SFX(K, V, Sin, Sout, e, ak, w, q + th * K, o + th * V, 1, ken, v + tn * V, wn, 1); \
            else step_##SFX(K, V, Sin, Sout, e, ak, w, NULL, NULL, 0, ken, v + tn * V, wn, 1);                 \
        } else {                                                                                              \
            if (o != NULL) step_##SFX(K, V, Sin, Sout, e, ak, w, q + th * K, o + th * V, 1, NULL, NULL, NULL, 0); \
            else step_##SFX(K, V, Sin, Sout, e, ak, w, NULL, NULL, 0, NULL, NULL, NULL, 0);                    \
        }                                                                                                     \
        real *tmp;                                                                                            \
        tmp = e; e = en; en = tmp;                                                                            \
        tmp = ke; ke = ken; ken = tmp;                                                                        \
        tmp = ak; ak = akn; akn = tmp;                                                                        \
        tmp = w; w = wn; wn = tmp;                                                                            \
        Sin = Sout;                                                                                           \
    }                                                                                                         \
    free(buf);                                                                                                \
    return 0;                                                                                                 \
}                                                                                                             \
                                                                                                              \
int linattn_delta_fwd_##SFX(int64_t N, int64_t H, int64_t K, int64_t V, const int64_t *starts,               \
                            const real *q, const real *k, const real *v, const real *a, const real *g,        \
                            int gate, const real *S0, real *o, real *S_out, real *ckpt,                       \
                            const int64_t *ck_off, int64_t chunk, int nthreads) {                             \
    const int64_t KV = K * V;                                                                                 \
    int failed = 0;                                                                                           \
    PARALLEL_FOR(nthreads)                                                                                    \
    for (int64_t task = 0; task < N * H; task++) {                                                            \
        const int64_t n = task / H, h = task % H;                                                             \
        real *S = S_out + task * KV;                                                                          \
        if (S0 != NULL) memcpy(S, S0 + task * KV, (size_t)KV * sizeof(real));                                 \
        else memset(S, 0, (size_t)KV * sizeof(real));                                                        \
        if (scan_##SFX(H, K, V, h, starts[n], starts[n + 1] - starts[n], q, k, v, a, g, gate, S, NULL, o,    \
                       NULL, NULL, ckpt != NULL ? ckpt + (ck_off[n] * H + h) * KV : NULL, chunk) != 0) {      \
            ATOMIC_WRITE failed = 1;                                                                          \
        }                                                                                                     \
    }                                                                                                         \
    return failed ? -1 : 0;                                                                                   \
}                                                                                                             \
                                                                                                              \
/* The backward. With P = D_t S_{t-1}, S_t = P + a_t k_t w_t^T and o_t = S_t^T q_t, and dS_t the gradient of  \
   S_t including o_t's own term q_t do_t^T:                                                                    \
     derr = dS_t^T k_t (the gradient of a_t w_t);  dv_t = a_t derr;  da_t = <derr, w_t>;  dpred = -a_t derr;    \
     dk_t = dS_t (a_t w_t) + P dpred;  dP = dS_t + k_t dpred^T;  dg_t = <dP, P> (per row for a channel gate);   \
     dS_{t-1} = D_t dP + q_{t-1} do_{t-1}^T;  dq_{t-1} = S_{t-1} do_{t-1}.                                     \
   One pass over the rows per token: the pass that turns dS_t into dS_{t-1} also forms the previous token's    \
   derr_{t-1} = dS_{t-1}^T k_{t-1} and dq_{t-1}. The sequence's last token starts with its own pass (first).  \
   Row sums over the columns accumulate into [K] buffers across the column blocks. */                         \
INLINE void bwd_first_cols_##SFX(int64_t K, int64_t V, int64_t nw, real *restrict dS, const real *restrict St,\
                                 const real *restrict q, const real *restrict k, const real *restrict dout,    \
                                 real *restrict derr, real *restrict dq) {                                     \
    real dov[VB_##SFX], acc[VB_##SFX];                                                                        \
    SIMD for (int64_t j = 0; j < nw; j++) { dov[j] = dout[j]; acc[j] = 0; }                                   \
    for (int64_t d = 0; d < K; d++) {                                                                         \
        real *restrict dSd = dS + d * V;                                                                      \
        const real *restrict Std = St + d * V;                                                                \
        const real qd = q[d], kd = k[d];                                                                      \
        real sq = 0;                                                                                          \
        SIMD_SUM(sq) for (int64_t j = 0; j < nw; j++) {                                                       \
            dSd[j] += qd * dov[j];                                                                            \
            acc[j] += kd * dSd[j];                                                                            \
            sq += Std[j] * dov[j];                                                                            \
        }                                                                                                     \
        dq[d] += sq;                                                                                          \
    }                                                                                                         \
    SIMD for (int64_t j = 0; j < nw; j++) derr[j] = acc[j];                                                   \
}                                                                                                             \
                                                                                                              \
INLINE void bwd_cols_##SFX(int64_t K, int64_t V, int64_t nw, real *restrict dS, const real *restrict Sp,      \
                           const real *restrict w, const real *restrict e, const real *restrict k, real a,    \
                           const real *restrict derr, real *restrict dv, real *restrict dk,                   \
                           real *restrict dgc, real *restrict gsum, real *restrict da, int gate, int has_prev, \
                           const real *restrict qp, const real *restrict kp, const real *restrict dop,        \
                           real *restrict derrp, real *restrict dqp) {                                        \
    real dpred[VB_##SFX], aw[VB_##SFX], dov[VB_##SFX], accp[VB_##SFX], gacc[VB_##SFX];                        \
    real sa = 0;                                                                                              \
    SIMD_SUM(sa) for (int64_t j = 0; j < nw; j++) {                                                           \
        sa += derr[j] * w[j];                                                                                 \
        dv[j] = a * derr[j];                                                                                  \
        dpred[j] = -a * derr[j];                                                                              \
        aw[j] = a * w[j];                                                                                     \
        dov[j] = has_prev ? dop[j] : 0;                                                                       \
        accp[j] = 0;                                                                                          \
        gacc[j] = 0;                                                                                          \
    }                                                                                                         \
    *da += sa;                                                                                                \
    for (int64_t d = 0; d < K; d++) {                                                                         \
        real *restrict dSd = dS + d * V;                                                                      \
        const real *restrict Spd = Sp + d * V;                                                                \
        const real ed = e[d], kd = k[d], qpd = has_prev ? qp[d] : 0, kpd = has_prev ? kp[d] : 0;              \
        if (nw == VB_##SFX) { /* lane partial sums (L lanes), folded once per row */                         \
            enum { L = 64 / sizeof(real) };                                                                   \
            real pk[L], pg[L], pq[L];                                                                         \
            SIMD for (int64_t l = 0; l < L; l++) { pk[l] = 0; pg[l] = 0; pq[l] = 0; }                         \
            for (int64_t c = 0; c < VB_##SFX; c += L) {                                                       \
                SIMD for (int64_t l = 0; l < L; l++) {                                                        \
                    const int64_t j = c + l;                                                                  \
                    const real P = ed * Spd[j];                                                               \
                    const real dP = dSd[j] + kd * dpred[j];                                                   \
                    pk[l] += dSd[j] * aw[j] + P * dpred[j];                                                   \
                    if (gate == GATE_CHANNEL) pg[l] += dP * P;                                                \
                    if (gate == GATE_HEAD) gacc[j] += dP * P;                                                 \
                    real dSn = ed * dP;                                                                       \
                    if (has_prev) {                                                                           \
                        dSn += qpd * dov[j];                                                                  \
                        accp[j] += kpd * dSn;                                                                 \
                        pq[l] += Spd[j] * dov[j];                                                             \
                    }                                                                                         \
                    dSd[j] = dSn;                                                                             \
                }                                                                                             \
            }                                                                                                 \
            dk[d] += lanes_sum_##SFX(pk);                                                                     \
            if (gate == GATE_CHANNEL) dgc[d] += lanes_sum_##SFX(pg);                                          \
            if (has_prev) dqp[d] += lanes_sum_##SFX(pq);                                                      \
            continue;                                                                                         \
        }                                                                                                     \
        real sk = 0, sg = 0, sq = 0;                                                                          \
        SIMD_SUM(sk, sg, sq) for (int64_t j = 0; j < nw; j++) {                                               \
            const real P = ed * Spd[j];                                                                       \
            const real dP = dSd[j] + kd * dpred[j];                                                           \
            sk += dSd[j] * aw[j] + P * dpred[j];                                                              \
            if (gate == GATE_CHANNEL) sg += dP * P;                                                           \
            if (gate == GATE_HEAD) gacc[j] += dP * P;                                                         \
            real dSn = ed * dP;                                                                               \
            if (has_prev) {                                                                                   \
                dSn += qpd * dov[j];                                                                          \
                accp[j] += kpd * dSn;                                                                         \
                sq += Spd[j] * dov[j];                                                                        \
            }                                                                                                 \
            dSd[j] = dSn;                                                                                     \
        }                                                                                                     \
        dk[d] += sk;                                                                                          \
        if (gate == GATE_CHANNEL) dgc[d] += sg;                                                               \
        if (has_prev) dqp[d] += sq;                                                                           \
    }                                                                                                         \
    if (gate == GATE_HEAD) {                                                                                  \
        real sgh = 0;                                                                                         \
        SIMD_SUM(sgh) for (int64_t j = 0; j < nw; j++) sgh += gacc[j];                                        \
        *gsum += sgh;                                                                                         \
    }                                                                                                         \
    if (has_prev) { SIMD for (int64_t j = 0; j < nw; j++) derrp[j] = accp[j]; }                               \
}                                                                                                             \
                                                                                                              \
/* one token over every column block; gate and has_prev are constants at each call site (specialised) */      \
INLINE void bwd_token_##SFX(int64_t K, int64_t V, real *dS, const real *Sp, const real *w, const real *e,     \
                            const real *k, real a, const real *derr, real *dv, real *dk, real *dgc,           \
                            real *gsum, real *da, int gate, int has_prev, const real *qp, const real *kp,     \
                            const real *dop, real *derrp, real *dqp) {                                        \
    int64_t j0 = 0;                                                                                           \
    for (; j0 + VB_##SFX <= V; j0 += VB_##SFX)                                                                \
        bwd_cols_##SFX(K, V, VB_##SFX, dS + j0, Sp + j0, w + j0, e, k, a, derr + j0, dv + j0, dk, dgc, gsum,  \
                       da, gate, has_prev, qp, kp, has_prev ? dop + j0 : NULL, has_prev ? derrp + j0 : NULL,  \
                       dqp);                                                                                  \
    if (j0 < V)                                                                                               \
        bwd_cols_##SFX(K, V, V - j0, dS + j0, Sp + j0, w + j0, e, k, a, derr + j0, dv + j0, dk, dgc, gsum,    \
                       da, gate, has_prev, qp, kp, has_prev ? dop + j0 : NULL, has_prev ? derrp + j0 : NULL,  \
                       dqp);                                                                                  \
}                                                                                                             \
                                                                                                              \
/* dS [N, H, K, V] enters as dL/dS_final (the caller zero-fills it when the final state has no gradient)      \
   and leaves as dL/dS0. dg may be NULL without a gate. Returns -1 when scratch memory is missing. */         \
int linattn_delta_bwd_##SFX(int64_t N, int64_t H, int64_t K, int64_t V, const int64_t *starts,               \
                            const real *q, const real *k, const real *v, const real *a, const real *g,        \
                            int gate, const real *ckpt, const int64_t *ck_off, int64_t chunk,                 \
                            const real *dout, real *dS_all, real *dq, real *dk, real *dv, real *da,           \
                            real *dg, int nthreads) {                                                         \
    const int64_t KV = K * V;                                                                                 \
    int failed = 0;                                                                                           \
    PARALLEL_FOR(nthreads)                                                                                    \
    for (int64_t task = 0; task < N * H; task++) {                                                            \
        const int64_t n = task / H, h = task % H;                                                             \
        const int64_t s = starts[n], L = starts[n + 1] - s;                                                   \
        real *restrict dS = dS_all + task * KV;                                                               \
        if (L <= 0) continue;                                                                                 \
        /* a stretch's states S_{t-1} and its last S_t, its w and e; derr of this and the previous token */   \
        real *Sbuf = (real *)malloc((size_t)((chunk + 1) * KV + chunk * (V + K) + 2 * V + 4 * K) * sizeof(real)); \
        if (Sbuf == NULL) {                                                                                   \
            ATOMIC_WRITE failed = 1;                                                                          \
            continue;                                                                                         \
        }                                                                                                     \
        real *wbuf = Sbuf + (chunk + 1) * KV, *ebuf = wbuf + chunk * V, *derr = ebuf + chunk * K;             \
        real *derrp = derr + V, *dqp = derrp + V, *dkt = dqp + K, *dgt = dkt + K;                             \
        for (int64_t c = (L + chunk - 1) / chunk - 1; c >= 0; c--) {                                          \
            const int64_t t0 = s + c * chunk, Lc = (L - c * chunk) < chunk ? (L - c * chunk) : chunk;         \
            memcpy(Sbuf, ckpt + ((ck_off[n] + c) * H + h) * KV, (size_t)KV * sizeof(real));                   \
            if (scan_##SFX(H, K, V, h, t0, Lc, q, k, v, a, g, gate, Sbuf, Sbuf, NULL, wbuf, ebuf, NULL,       \
                           chunk) != 0) {                                                                     \
                ATOMIC_WRITE failed = 1;                                                                      \
                break;                                                                                        \
            }                                                                                                 \
            if (t0 + Lc == s + L) { /* the sequence's last token: its own output's term, derr and dq */      \
                const int64_t th = (s + L - 1) * H + h;                                                       \
                const real *St = Sbuf + Lc * KV;                                                              \
                for (int64_t d = 0; d < K; d++) dqp[d] = 0;                                                   \
                int64_t j0 = 0;                                                                               \
                for (; j0 + VB_##SFX <= V; j0 += VB_##SFX)                                                    \
                    bwd_first_cols_##SFX(K, V, VB_##SFX, dS + j0, St + j0, q + th * K, k + th * K,            \
                                         dout + th * V + j0, derr + j0, dqp);                                 \
                if (j0 < V)                                                                                   \
                    bwd_first_cols_##SFX(K, V, V - j0, dS + j0, St + j0, q + th * K, k + th * K,              \
                                         dout + th * V + j0, derr + j0, dqp);                                 \
                memcpy(dq + th * K, dqp, (size_t)K * sizeof(real));                                           \
            }                                                                                                 \
            for (int64_t i = Lc - 1; i >= 0; i--) {                                                           \
                const int64_t th = (t0 + i) * H + h, tp = th - H;                                             \
                const int has_prev = t0 + i > s;                                                              \
                const real *Sp = Sbuf + i * KV, *w = wbuf + i * V, *e = ebuf + i * K, *kt = k + th * K;       \
                real dat = 0, gsum = 0;                                                                       \
                for (int64_t d = 0; d < K; d++) { dqp[d] = 0; dkt[d] = 0; dgt[d] = 0; }                       \
                /* six specialisations: the gate (none, head, channel) x whether a previous token exists */    \
                if (has_prev) {                                                                               \
                    const real *qp = q + tp * K, *kp = k + tp * K, *dop = dout + tp * V;                      \
                    if (gate == GATE_NONE)                                                                    \
                        bwd_token_##SFX(K, V, dS, Sp, w, e, kt, a[th], derr, dv + th * V, dkt, dgt, &gsum,    \
                                        &dat, GATE_NONE, 1, qp, kp, dop, derrp, dqp);                         \
                    else if (gate == GATE_HEAD)                                                               \
                        bwd_token_##SFX(K, V, dS, Sp, w, e, kt, a[th], derr, dv + th * V, dkt, dgt, &gsum,    \
                                        &dat, GATE_HEAD, 1, qp, kp, dop, derrp, dqp);                         \
                    else                                                                                      \
                        bwd_token_##SFX(K, V, dS, Sp, w, e, kt, a[th], derr, dv + th * V, dkt, dgt, &gsum,    \
                                        &dat, GATE_CHANNEL, 1, qp, kp, dop, derrp, dqp);                      \
                    memcpy(dq + tp * K, dqp, (size_t)K * sizeof(real));                                       \
                } else {                                                                                      \
                    if (gate == GATE_NONE)                                                                    \
                        bwd_token_##SFX(K, V, dS, Sp, w, e, kt, a[th], derr, dv + th * V, dkt, dgt, &gsum,    \
                                        &dat, GATE_NONE, 0, NULL, NULL, NULL, NULL, NULL);                    \
                    else if (gate == GATE_HEAD)                                                               \
                        bwd_token_##SFX(K, V, dS, Sp, w, e, kt, a[th], derr, dv + th * V, dkt, dgt, &gsum,    \
                                        &dat, GATE_HEAD, 0, NULL, NULL, NULL, NULL, NULL);                    \
                    else                                                                                      \
                        bwd_token_##SFX(K, V, dS, Sp, w, e, kt, a[th], derr, dv + th * V, dkt, dgt, &gsum,    \
                                        &dat, GATE_CHANNEL, 0, NULL, NULL, NULL, NULL, NULL);                 \
                }                                                                                             \
                da[th] = dat;                                                                                 \
                memcpy(dk + th * K, dkt, (size_t)K * sizeof(real));                                           \
                if (gate == GATE_CHANNEL) memcpy(dg + th * K, dgt, (size_t)K * sizeof(real));                 \
                if (gate == GATE_HEAD) dg[th] = gsum;                                                         \
                real *tmp = derr; derr = derrp; derrp = tmp;                                                  \
            }                                                                                                 \
        }                                                                                                     \
        free(Sbuf);                                                                                           \
    }                                                                                                         \
    return failed ? -1 : 0;                                                                                   \
}

DEFINE_DELTA(float, f32)
DEFINE_DELTA(double, f64)
