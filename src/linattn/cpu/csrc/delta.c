/* The delta family's scan on a CPU: forward and backward, token by token (linattn.cpu.delta).

       S_t = D_t S_{t-1} - a_t k_t ((D_t S_{t-1})^T k_t)^T + a_t k_t v_t^T,     o_t = S_t^T q_t

   with D_t = exp(g_t) (none, one log-gate per head, or one per key channel). This is the delta rule's own
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
   CPU kernels do) and keeps NaN and inf as they are */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=fast")
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

int linattn_delta_abi_version(void) { return 2; }

/* Columns of the state are independent given k, a and g: every step works on blocks of VB value columns
   (256 bytes: 64 floats, 32 doubles) so that the inner loops have a constant trip count, vectorise fully
   and keep their accumulators in registers; the state block [K, VB] stays in L1. The last block may be
   narrower (the same code with a run-time width). */
#define DEFINE_DELTA(real, SFX, EXP)                                                                          \
enum { VB_##SFX = 256 / sizeof(real) };                                                                       \
                                                                                                              \
/* the per-token factors: e_d = exp(g) (1 without a gate), ke_d = k_d e_d (the read key D k), ak_d = a k_d */ \
INLINE void factors_##SFX(int64_t K, const real *restrict k, real a, const real *restrict g, int gate,        \
                          real *restrict e, real *restrict ke, real *restrict ak) {                           \
    const real eh = gate == GATE_HEAD ? EXP(g[0]) : (real)1;                                                  \
    for (int64_t d = 0; d < K; d++) {                                                                         \
        e[d] = gate == GATE_CHANNEL ? EXP(g[d]) : eh;                                                         \
        ke[d] = k[d] * e[d];                                                                                  \
        ak[d] = a * k[d];                                                                                     \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
/* One token on the columns [0, nw) of S (row stride V): w = v - (D S)^T k, S <- D S + a k w^T, o = S^T q    \
   (o may be NULL). */                                                                                        \
INLINE void fwd_cols_##SFX(int64_t K, int64_t V, int64_t nw, real *restrict S, const real *restrict e,        \
                           const real *restrict ke, const real *restrict ak, const real *restrict q,          \
                           const real *restrict v, real *restrict w, real *restrict o) {                      \
    real acc[VB_##SFX];                                                                                       \
    SIMD for (int64_t j = 0; j < nw; j++) acc[j] = 0;                                                         \
    for (int64_t d = 0; d < K; d++) {                                                                         \
        const real *restrict Sd = S + d * V;                                                                  \
        const real c = ke[d];                                                                                 \
        SIMD for (int64_t j = 0; j < nw; j++) acc[j] += c * Sd[j];                                            \
    }                                                                                                         \
    SIMD for (int64_t j = 0; j < nw; j++) { acc[j] = v[j] - acc[j]; w[j] = acc[j]; }                          \
    if (o != NULL) {                                                                                          \
        real out[VB_##SFX];                                                                                   \
        SIMD for (int64_t j = 0; j < nw; j++) out[j] = 0;                                                     \
        for (int64_t d = 0; d < K; d++) {                                                                     \
            real *restrict Sd = S + d * V;                                                                    \
            const real ed = e[d], c = ak[d], qd = q[d];                                                       \
            SIMD for (int64_t j = 0; j < nw; j++) { Sd[j] = ed * Sd[j] + c * acc[j]; out[j] += qd * Sd[j]; }  \
        }                                                                                                     \
        SIMD for (int64_t j = 0; j < nw; j++) o[j] = out[j];                                                  \
    } else {                                                                                                  \
        for (int64_t d = 0; d < K; d++) {                                                                     \
            real *restrict Sd = S + d * V;                                                                    \
            const real ed = e[d], c = ak[d];                                                                  \
            SIMD for (int64_t j = 0; j < nw; j++) Sd[j] = ed * Sd[j] + c * acc[j];                            \
        }                                                                                                     \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
INLINE void fwd_token_##SFX(int64_t K, int64_t V, real *restrict S, const real *restrict e,                   \
                            const real *restrict ke, const real *restrict ak, const real *restrict q,         \
                            const real *restrict v, real *restrict w, real *restrict o) {                     \
    int64_t j0 = 0;                                                                                           \
    for (; j0 + VB_##SFX <= V; j0 += VB_##SFX)                                                                \
        fwd_cols_##SFX(K, V, VB_##SFX, S + j0, e, ke, ak, q, v + j0, w + j0, o != NULL ? o + j0 : NULL);      \
    if (j0 < V)                                                                                               \
        fwd_cols_##SFX(K, V, V - j0, S + j0, e, ke, ak, q, v + j0, w + j0, o != NULL ? o + j0 : NULL);        \
}                                                                                                             \
                                                                                                              \
int linattn_delta_fwd_##SFX(int64_t N, int64_t H, int64_t K, int64_t V, const int64_t *starts,               \
                            const real *q, const real *k, const real *v, const real *a, const real *g,        \
                            int gate, const real *S0, real *o, real *S_out, real *ckpt,                       \
                            const int64_t *ck_off, int64_t chunk, int nthreads) {                             \
    const int64_t KV = K * V, gK = gate == GATE_CHANNEL ? K : 1;                                              \
    int failed = 0;                                                                                           \
    PARALLEL_FOR(nthreads)                                                                                    \
    for (int64_t task = 0; task < N * H; task++) {                                                            \
        const int64_t n = task / H, h = task % H;                                                             \
        real *scratch = (real *)malloc((size_t)(3 * K + V) * sizeof(real));                                  \
        if (scratch == NULL) {                                                                                \
            ATOMIC_WRITE failed = 1;                                                                          \
            continue;                                                                                         \
        }                                                                                                     \
        real *e = scratch, *ke = e + K, *ak = ke + K, *w = ak + K;                                            \
        real *S = S_out + task * KV;                                                                          \
        if (S0 != NULL) memcpy(S, S0 + task * KV, (size_t)KV * sizeof(real));                                 \
        else memset(S, 0, (size_t)KV * sizeof(real));                                                        \
        for (int64_t t = starts[n]; t < starts[n + 1]; t++) {                                                 \
            const int64_t i = t - starts[n], th = t * H + h;                                                  \
            if (ckpt != NULL && i % chunk == 0)                                                               \
                memcpy(ckpt + ((ck_off[n] + i / chunk) * H + h) * KV, S, (size_t)KV * sizeof(real));          \
            factors_##SFX(K, k + th * K, a[th], gate != GATE_NONE ? g + th * gK : NULL, gate, e, ke, ak);     \
            fwd_token_##SFX(K, V, S, e, ke, ak, q + th * K, v + th * V, w, o + th * V);                       \
        }                                                                                                     \
        free(scratch);                                                                                        \
    }                                                                                                         \
    return failed ? -1 : 0;                                                                                   \
}                                                                                                             \
                                                                                                              \
/* The reverse step of one token on the columns [0, nw): dS (row stride V) holds dL/dS_t and leaves holding   \
   dL/dS_{t-1}; St = S_t and Sp = S_{t-1} (row stride V), w = v - (D S_{t-1})^T k. Row sums over the columns  \
   accumulate into dq, dk, dgc ([K], over the blocks), the column sum of derr w into *da.                     \
   With P = D S_{t-1} and S_t = P + a k w^T, o = S_t^T q:                                                     \
     dS_t += q do^T;  derr = dS_t^T k (the gradient of a w);  dq = S_t do;  dv = a derr;  da = <derr, w>;      \
     dpred = -a derr;  dk = a dS_t w + P dpred;  dP = dS_t + k dpred^T;  dg_d = <dP_d, P_d>;  dS_{t-1} = D dP. */\
INLINE void bwd_cols_##SFX(int64_t K, int64_t V, int64_t nw, real *restrict dS, const real *restrict St,      \
                           const real *restrict Sp, const real *restrict w, const real *restrict e,           \
                           const real *restrict q, const real *restrict k, real a, const real *restrict dout, \
                           real *restrict dv, real *restrict dq, real *restrict dk, real *restrict dgc,       \
                           real *restrict da) {                                                               \
    real derr[VB_##SFX], dpred[VB_##SFX], dov[VB_##SFX], wv[VB_##SFX];                                        \
    SIMD for (int64_t j = 0; j < nw; j++) { derr[j] = 0; dov[j] = dout[j]; wv[j] = w[j]; }                    \
    for (int64_t d = 0; d < K; d++) {                                                                         \
        real *restrict dSd = dS + d * V;                                                                      \
        const real *restrict Std = St + d * V;                                                                \
        const real qd = q[d], kd = k[d];                                                                      \
        real sq = 0;                                                                                          \
        SIMD_SUM(sq) for (int64_t j = 0; j < nw; j++) {                                                       \
            sq += Std[j] * dov[j];                                                                            \
            dSd[j] += qd * dov[j];                                                                            \
            derr[j] += kd * dSd[j];                                                                           \
        }                                                                                                     \
        dq[d] += sq;                                                                                          \
    }                                                                                                         \
    real sa = 0;                                                                                              \
    SIMD_SUM(sa) for (int64_t j = 0; j < nw; j++) {                                                           \
        sa += derr[j] * wv[j];                                                                                \
        dv[j] = a * derr[j];                                                                                  \
        dpred[j] = -a * derr[j];                                                                              \
        wv[j] *= a;                                                                                           \
    }                                                                                                         \
    *da += sa;                                                                                                \
    for (int64_t d = 0; d < K; d++) {                                                                         \
        real *restrict dSd = dS + d * V;                                                                      \
        const real *restrict Spd = Sp + d * V;                                                                \
        const real ed = e[d], kd = k[d];                                                                      \
        real sk = 0, sg = 0;                                                                                  \
        SIMD_SUM(sk, sg) for (int64_t j = 0; j < nw; j++) {                                                   \
            const real P = ed * Spd[j];                                                                       \
            const real dP = dSd[j] + kd * dpred[j];                                                           \
            sk += dSd[j] * wv[j] + P * dpred[j];                                                              \
            sg += dP * P;                                                                                     \
            dSd[j] = ed * dP;                                                                                 \
        }                                                                                                     \
        dk[d] += sk;                                                                                          \
        dgc[d] += sg;                                                                                         \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
/* dS [N, H, K, V] enters as dL/dS_final (the caller zero-fills it when the final state has no gradient)      \
   and leaves as dL/dS0. dg may be NULL without a gate. Returns -1 when scratch memory is missing. */         \
int linattn_delta_bwd_##SFX(int64_t N, int64_t H, int64_t K, int64_t V, const int64_t *starts,               \
                            const real *q, const real *k, const real *v, const real *a, const real *g,        \
                            int gate, const real *ckpt, const int64_t *ck_off, int64_t chunk,                 \
                            const real *dout, real *dS_all, real *dq, real *dk, real *dv, real *da,           \
                            real *dg, int nthreads) {                                                         \
    const int64_t KV = K * V, gK = gate == GATE_CHANNEL ? K : 1;                                              \
    int failed = 0;                                                                                           \
    PARALLEL_FOR(nthreads)                                                                                    \
    for (int64_t task = 0; task < N * H; task++) {                                                            \
        const int64_t n = task / H, h = task % H;                                                             \
        const int64_t s = starts[n], L = starts[n + 1] - s;                                                   \
        real *restrict dS = dS_all + task * KV;                                                               \
        /* the states S_{t-1} of a chunk's tokens and its last S_t, the chunk's w, the per-token factors */   \
        real *Sbuf = (real *)malloc((size_t)((chunk + 1) * KV + chunk * (V + K) + 6 * K) * sizeof(real));     \
        if (Sbuf == NULL) {                                                                                   \
            ATOMIC_WRITE failed = 1;                                                                          \
            continue;                                                                                         \
        }                                                                                                     \
        real *wbuf = Sbuf + (chunk + 1) * KV, *ebuf = wbuf + chunk * V, *ke = ebuf + chunk * K;               \
        real *ak = ke + K, *dqt = ak + K, *dkt = dqt + K, *dgt = dkt + K;                                     \
        for (int64_t c = (L + chunk - 1) / chunk - 1; c >= 0; c--) {                                          \
            const int64_t t0 = s + c * chunk, Lc = (L - c * chunk) < chunk ? (L - c * chunk) : chunk;         \
            memcpy(Sbuf, ckpt + ((ck_off[n] + c) * H + h) * KV, (size_t)KV * sizeof(real));                   \
            for (int64_t i = 0; i < Lc; i++) {                                                                \
                const int64_t th = (t0 + i) * H + h;                                                          \
                memcpy(Sbuf + (i + 1) * KV, Sbuf + i * KV, (size_t)KV * sizeof(real));                       \
                factors_##SFX(K, k + th * K, a[th], gate != GATE_NONE ? g + th * gK : NULL, gate,             \
                              ebuf + i * K, ke, ak);                                                          \
                fwd_token_##SFX(K, V, Sbuf + (i + 1) * KV, ebuf + i * K, ke, ak, q + th * K, v + th * V,      \
                                wbuf + i * V, NULL);                                                          \
            }                                                                                                 \
            for (int64_t i = Lc - 1; i >= 0; i--) {                                                           \
                const int64_t th = (t0 + i) * H + h;                                                          \
                const real *St = Sbuf + (i + 1) * KV, *Sp = Sbuf + i * KV, *w = wbuf + i * V;                 \
                const real *e = ebuf + i * K;                                                                 \
                real dat = 0;                                                                                 \
                for (int64_t d = 0; d < K; d++) { dqt[d] = 0; dkt[d] = 0; dgt[d] = 0; }                       \
                int64_t j0 = 0;                                                                               \
                for (; j0 + VB_##SFX <= V; j0 += VB_##SFX)                                                    \
                    bwd_cols_##SFX(K, V, VB_##SFX, dS + j0, St + j0, Sp + j0, w + j0, e, q + th * K,          \
                                   k + th * K, a[th], dout + th * V + j0, dv + th * V + j0, dqt, dkt, dgt,    \
                                   &dat);                                                                     \
                if (j0 < V)                                                                                   \
                    bwd_cols_##SFX(K, V, V - j0, dS + j0, St + j0, Sp + j0, w + j0, e, q + th * K,            \
                                   k + th * K, a[th], dout + th * V + j0, dv + th * V + j0, dqt, dkt, dgt,    \
                                   &dat);                                                                     \
                da[th] = dat;                                                                                 \
                memcpy(dq + th * K, dqt, (size_t)K * sizeof(real));                                           \
                memcpy(dk + th * K, dkt, (size_t)K * sizeof(real));                                           \
                if (gate == GATE_CHANNEL) memcpy(dg + th * K, dgt, (size_t)K * sizeof(real));                 \
                if (gate == GATE_HEAD) {                                                                      \
                    real gs = 0;                                                                              \
                    for (int64_t d = 0; d < K; d++) gs += dgt[d];                                             \
                    dg[th] = gs;                                                                              \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
        free(Sbuf);                                                                                           \
    }                                                                                                         \
    return failed ? -1 : 0;                                                                                   \
}

DEFINE_DELTA(float, f32, expf)
DEFINE_DELTA(double, f64, exp)
