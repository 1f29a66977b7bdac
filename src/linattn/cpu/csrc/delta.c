/* The delta family's scan on a CPU: forward and backward, token by token (linattn.cpu.delta).

       S_t = D_t S_{t-1} - a_t k_t ((D_t S_{t-1})^T k_t)^T + a_t k_t v_t^T,     o_t = S_t^T q_t

   with D_t = exp(g_t) (none, one log-gate per head, or one per key channel). The kernels take the decays
   exp(g) [TT, H] or [TT, H, K] (the argument `g` below), computed by torch's vectorised exp before the call
   (one scalar expf per key channel and token was a third of the per-channel forward); the backward still
   returns dL/dg (= <dP, P>, the chain rule through exp included). This is the delta rule's own
   read (r = None in ops/delta_core.py); q arrives scaled, k, v, a rescaled by the key norm (prepare_delta), or the
   forward prepares them itself from the raw rows (the plan's `prep`: no prepared copy written to memory and read
   back), and so does the backward, which then returns the raw rows' gradients.

   Why token by token and not the chunk (WY/UT) form: per token and head the scan costs 4 K V multiply-adds
   over a state of K x V that stays in L1 (16 KB for K = V = 64); the chunk form costs C (K + V) + 3 K V,
   more for every C >= K, and wins on a GPU only through its parallel matmuls. Here every loop over the value
   axis is contiguous and vectorises, and causality is structural: nothing computed for token t reads a later
   token, so a later inf/NaN never reaches an earlier output and a prefix gives the same bits.

   Layout: tokens flat, [TT, H, D] contiguous; sequence n covers tokens starts[n] .. starts[n+1]-1 (B equal
   sequences or cu_seqlens). States [N, H, K, V]. One OpenMP task per (sequence, head), or runs of tokens of
   each (sequence, head) when there are few of them for the threads (DELTA_UNITS_PER_THREAD).

   Backward: the forward stores the state at the start of every chunk of `chunk` tokens (ckpt [NCK, H, K, V],
   sequence n's first at ck_off[n]); the backward walks the chunks in reverse, recomputes a chunk's states
   from its checkpoint, then runs the reverse recurrence token by token.

   No -ffast-math: the reductions are vectorised through `omp simd reduction` (reassociation only); NaN and
   inf propagate as in the PyTorch forms. Every kernel is compiled for float and for double: the body below is
   compiled once per REAL by including this file into itself (common.h: the shared style). */
#ifndef LINATTN_DELTA_BODY
#define LINATTN_DELTA_BODY

#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* sched_getcpu / sched_setaffinity (chains.h) */
#endif
#include "common.h"
#include "chains.h"

/* The row preparation of the plan's `prep` (deltarow.h, deltaprep.c's rows), compiled here, before the optimisation
   pragmas below, as calls never inlined: with the options deltaprep.c compiles it with, so that the scan prepares
   the bits of the preparation pass (a function under those pragmas could vectorise the rows' sums over other
   lanes). */
#define LA_DELTAROW_OUTLINED
#define REAL float
#define FN(name) name##_f32
#include "common.h"
#include "deltarow.h"
#undef REAL
#undef FN
#define REAL double
#define FN(name) name##_f64
#include "common.h"
#include "deltarow.h"
#undef REAL
#undef FN

/* GCC's unroll-and-jam of the row loops (-O3) kept the column accumulators on the stack: the forward ran 1.5-2x
   slower (measured), so it is off here. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-loop-unroll-and-jam")
#endif
/* GCC's -march=native on CPUs with AVX-512 still prefers 256-bit vectors: a column block of VB = 64 floats was 8 ymm
   registers per array, the backward's five arrays (dpred, aw, do, the previous derr, the head gate's sums) did not
   fit the register file and spilled. In 512-bit vectors they nearly do: the backward ran in ~15 % less CPU time at
   K = V = 64 (measured). The forward's bits are unchanged; the backward's row sums fold other lanes (last bits). */
#if defined(__GNUC__) && !defined(__clang__) && defined(__AVX512F__)
#pragma GCC target("prefer-vector-width=512")
#endif

#define GATE_NONE 0
#define GATE_HEAD 1
#define GATE_CHANNEL 2
#define PREP_NONE 0 /* q, k, v, a prepared (prepare_delta) */
#define PREP_L2 1   /* linattn_dprep_fwd's rows: qk_l2norm="rsqrt", a = beta */
#define PREP_RAW 2  /* linattn_dprep_rawa_fwd's rows: no qk_l2norm, a = beta */
#define PF_AHEAD 4 /* tokens: a head's rows lie H * D apart, which the hardware prefetchers follow poorly */
/* Threads: one task per (sequence, head) unit when there are at least DELTA_UNITS_PER_THREAD per thread; with
   fewer, the units are chains (chains.h), claimed for a run of about DELTA_RUN tokens at a time (a whole number
   of checkpoint chunks; shorter at the unit's end: la_chains_run), so that a descheduled thread holds back one run
   of one unit, not a whole sequence. The scan of a unit is the same either way: a run starts with its first
   token's prediction from the stored state, the same products in the same order as the previous token's pass would
   have made (same bits). */
#ifndef DELTA_UNITS_PER_THREAD
#define DELTA_UNITS_PER_THREAD 4
#endif
#ifndef DELTA_RUN
#define DELTA_RUN 512
#endif
/* A chain thread keeps to its own block of units (neighbouring heads: their rows share each token's row) unless
   another free unit is more than DELTA_SLACK runs further behind (la_chains_claim_own): a descheduled thread holds
   back at most that much before the others take its units. 0: its own only while no other is further behind. */
#ifndef DELTA_SLACK
#define DELTA_SLACK 1
#endif

LA_ABI_VERSION(delta, 4)

/* What a call needs besides its tensors (cpu/bindings.py's DeltaPlan mirrors it; its size is exported and checked).
   Tokens flat, sequence n covering starts[n] .. starts[n + 1] - 1; the forward keeps the state before every
   `chunk`-th token of sequence n at checkpoint ck_off[n] + i (ckpt [NCK, H, K, V]). */
typedef struct {
    int64_t N, H, K, V; /* sequences, heads, key and value sizes */
    int64_t chunk;      /* tokens between the checkpoints */
    const int64_t *starts, *ck_off;
    int32_t gate;       /* GATE_NONE, GATE_HEAD (g [TT, H]) or GATE_CHANNEL (g [TT, H, K]): decays exp(g) */
    int32_t nthreads;
    /* the forward's own preparation (PREP_*): q, k, v, a are then the raw q, k, v and beta, each row prepared as the
       scan reads it (deltarow.h: the bits of deltaprep.c's pass), with scale (and eps: PREP_L2) */
    int32_t prep, pad_;
    double scale, eps;
} linattn_delta_plan;
LA_EXPORT_SIZEOF(delta_plan)

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
/* Without AVX-512 the backward's full column blocks form the previous token's derr (accp) in a second pass over the
   new rows of dS: beside the column arrays, its accumulators (4 of the 16 registers) spilled in the first pass. The
   same products in the same order over the rows: the same bits (callgrind: ~3 % fewer instructions). */
#if !defined(__AVX512F__)
#define DERR_PASS 1
#else
#define DERR_PASS 0
#endif

#define REAL float
#define FN(name) name##_f32
#include "delta.c"
#undef REAL
#undef FN

#define REAL double
#define FN(name) name##_f64
#include "delta.c"
#undef REAL
#undef FN

#else /* ------------------------------------------------------------------ the body, once per REAL */
enum { FN(VB) = VBYTES / sizeof(REAL) };

/* the per-token factors: e_d = exp(g) (1 without a gate), ke_d = k_d e_d (the read key D k), ak_d = a k_d */
LA_INLINE void FN(factors)(int64_t K, const REAL *restrict k, REAL a, const REAL *restrict g, int gate,
                           REAL *restrict e, REAL *restrict ke, REAL *restrict ak) {
    const REAL eh = gate == GATE_HEAD ? g[0] : (REAL)1;
    for (int64_t d = 0; d < K; d++) {
        e[d] = gate == GATE_CHANNEL ? g[d] : eh;
        ke[d] = k[d] * e[d];
        ak[d] = a * k[d];
    }
}

/* x[0] + ... + x[L-1] of L = 64 bytes of lanes, by halving with constant bounds */
LA_INLINE REAL FN(lanes_sum)(REAL *restrict x) {
    enum { L = 64 / sizeof(REAL) };
    LA_SIMD for (int64_t l = 0; l < L / 2; l++) x[l] += x[l + L / 2];
    LA_SIMD for (int64_t l = 0; l < L / 4; l++) x[l] += x[l + L / 4];
    for (int64_t l = 0; l < L / 8; l++) x[l] += x[l + L / 8];
    return L == 16 ? x[0] + x[1] : x[0];
}

/* w = v - (D S)^T k on the columns [0, nw) of S (row stride V): the first token of a stretch */
LA_INLINE void FN(predict_cols)(int64_t K, int64_t V, int64_t nw, const REAL *restrict S,
                                const REAL *restrict ke, const REAL *restrict v, REAL *restrict w) {
    REAL acc[FN(VB)];
    LA_SIMD for (int64_t j = 0; j < nw; j++) acc[j] = 0;
    for (int64_t d = 0; d < K; d++) {
        const REAL *restrict Sd = S + d * V;
        const REAL c = ke[d];
        LA_SIMD for (int64_t j = 0; j < nw; j++) acc[j] += c * Sd[j];
    }
    LA_SIMD for (int64_t j = 0; j < nw; j++) w[j] = v[j] - acc[j];
}

/* Token t on the columns [0, nw): Sout = D Sin + a k w^T (Sin may be Sout: each element is read, then
   written), o = Sout^T q when has_o, and when has_next the next token's wn = vn - (D_{t+1} Sout)^T k_{t+1}. */
LA_INLINE void FN(step_cols)(int64_t K, int64_t V, int64_t nw, const REAL *Sin, REAL *Sout,
                             const REAL *restrict e, const REAL *restrict ak, const REAL *restrict w,
                             const REAL *restrict q, REAL *restrict o, int has_o, const REAL *restrict ken,
                             const REAL *restrict vn, REAL *restrict wn, int has_next) {
    REAL wr[FN(VB)], out[FN(VB)], accn[FN(VB)];
    LA_SIMD for (int64_t j = 0; j < nw; j++) { wr[j] = w[j]; out[j] = 0; accn[j] = 0; }
    for (int64_t d = 0; d < K; d++) {
        const REAL *Sid = Sin + d * V;
        REAL *Sod = Sout + d * V;
        const REAL ed = e[d], c = ak[d], qd = has_o ? q[d] : 0, kn = has_next ? ken[d] : 0;
        LA_SIMD for (int64_t j = 0; j < nw; j++) {
            const REAL s = ed * Sid[j] + c * wr[j];
            Sod[j] = s;
            if (has_o) out[j] += qd * s;
            if (has_next) accn[j] += kn * s;
        }
    }
    if (has_o) { LA_SIMD for (int64_t j = 0; j < nw; j++) o[j] = out[j]; }
    if (has_next) { LA_SIMD for (int64_t j = 0; j < nw; j++) wn[j] = vn[j] - accn[j]; }
}

LA_INLINE void FN(predict)(int64_t K, int64_t V, const REAL *S, const REAL *ke, const REAL *v, REAL *w) {
    int64_t j0 = 0;
    for (; j0 + FN(VB) <= V; j0 += FN(VB)) FN(predict_cols)(K, V, FN(VB), S + j0, ke, v + j0, w + j0);
    if (j0 < V) FN(predict_cols)(K, V, V - j0, S + j0, ke, v + j0, w + j0);
}

/* one token over every column block; has_o and has_next are constants at each call site (specialised) */
LA_INLINE void FN(step)(int64_t K, int64_t V, const REAL *Sin, REAL *Sout, const REAL *e, const REAL *ak,
                        const REAL *w, const REAL *q, REAL *o, int has_o, const REAL *ken, const REAL *vn,
                        REAL *wn, int has_next) {
    int64_t j0 = 0;
    for (; j0 + FN(VB) <= V; j0 += FN(VB))
        FN(step_cols)(K, V, FN(VB), Sin + j0, Sout + j0, e, ak, w + j0, q, has_o ? o + j0 : NULL, has_o,
                      ken, has_next ? vn + j0 : NULL, has_next ? wn + j0 : NULL, has_next);
    if (j0 < V)
        FN(step_cols)(K, V, V - j0, Sin + j0, Sout + j0, e, ak, w + j0, q, has_o ? o + j0 : NULL, has_o,
                      ken, has_next ? vn + j0 : NULL, has_next ? wn + j0 : NULL, has_next);
}

/* Token row th's q, k, v [K, K, V] and a: the inputs' rows, or with prep (the plan's, not PREP_NONE) the raw rows
   prepared into slot [2 K + V] */
LA_INLINE void FN(rows)(int prep, int64_t K, int64_t V, int64_t th, const REAL *q, const REAL *k, const REAL *v,
                        const REAL *a, REAL sc, REAL eps, REAL *slot, const REAL **qt, const REAL **kt,
                        const REAL **vt, REAL *at) {
    if (prep == PREP_NONE) {
        *qt = q + th * K, *kt = k + th * K, *vt = v + th * V, *at = a[th];
        return;
    }
    REAL *qs = slot, *ks = qs + K, *vs = ks + K;
    if (prep == PREP_L2)
        *at = FN(la_dprep_row_a)(K, V, q + th * K, k + th * K, v + th * V, a[th], sc, eps, qs, ks, vs);
    else
        *at = FN(la_dprep_raw_row_a)(K, V, q + th * K, k + th * K, v + th * V, a[th], sc, qs, ks, vs);
    *qt = qs, *kt = ks, *vt = vs;
}

/* Tokens t0 .. t0+L-1 of head h from the state S (updated in place, or written to Sstates[i+1] when
   Sstates is given, with Sstates[0] = S), outputs into o (or none), w_t into wstates[i] (or none), the
   factors e_t into estates[i] (or none). ckpt: the state before every `chunk`-th token (or none). With prep
   (PREP_L2, PREP_RAW) q, k, v, a are the raw q, k, v, beta: each token's row is prepared (scale sc, eps) into one
   of two slots just before the pass of the previous token reads its key (and the pass of its own, its query). */
static int FN(scan)(int64_t H, int64_t K, int64_t V, int64_t h, int64_t t0, int64_t L, const REAL *q,
                    const REAL *k, const REAL *v, const REAL *a, const REAL *g, int gate, REAL *S,
                    REAL *Sstates, REAL *o, REAL *wstates, REAL *estates, REAL *ckpt, int64_t chunk, int prep,
                    REAL sc, REAL eps) {
    if (L <= 0) return 0;
    const int64_t KV = K * V, gK = gate == GATE_CHANNEL ? K : 1, nslot = prep != PREP_NONE ? 2 * K + V : 0;
    REAL *buf = (REAL *)malloc((size_t)(6 * K + 2 * V + 2 * nslot) * sizeof(REAL));
    if (buf == NULL) return -1;
    REAL *e = buf, *ke = e + K, *ak = ke + K, *en = ak + K, *ken = en + K, *akn = ken + K;
    REAL *w = akn + K, *wn = w + V, *slot = wn + V, *slotn = slot + nslot;
    const REAL *qt, *kt, *vt, *qn, *kn, *vn;
    REAL at, an;
    int64_t th = t0 * H + h;
    FN(rows)(prep, K, V, th, q, k, v, a, sc, eps, slot, &qt, &kt, &vt, &at);
    FN(factors)(K, kt, at, gate != GATE_NONE ? g + th * gK : NULL, gate, e, ke, ak);
    FN(predict)(K, V, S, ke, vt, w);
    const REAL *Sin = S;
    for (int64_t i = 0; i < L; i++) {
        th = (t0 + i) * H + h;
        REAL *Sout = Sstates != NULL ? Sstates + (i + 1) * KV : S;
        if (ckpt != NULL && i % chunk == 0) memcpy(ckpt + (i / chunk) * H * KV, Sin, (size_t)KV * sizeof(REAL));
        if (wstates != NULL) memcpy(wstates + i * V, w, (size_t)V * sizeof(REAL));
        if (estates != NULL) memcpy(estates + i * K, e, (size_t)K * sizeof(REAL));
        if (i + PF_AHEAD < L) {
            const int64_t tp = th + PF_AHEAD * H;
            for (int64_t c = 0; c < K; c += 64 / (int64_t)sizeof(REAL)) {
                LA_PREFETCH(q + tp * K + c, 0);
                LA_PREFETCH(k + tp * K + c, 0);
            }
            for (int64_t c = 0; c < V; c += 64 / (int64_t)sizeof(REAL)) {
                LA_PREFETCH(v + tp * V + c, 0);
                if (o != NULL) LA_PREFETCH(o + tp * V + c, 1);
            }
        }
        if (i + 1 < L) {
            const int64_t tn = th + H;
            FN(rows)(prep, K, V, tn, q, k, v, a, sc, eps, slotn, &qn, &kn, &vn, &an);
            FN(factors)(K, kn, an, gate != GATE_NONE ? g + tn * gK : NULL, gate, en, ken, akn);
            if (o != NULL) FN(step)(K, V, Sin, Sout, e, ak, w, qt, o + th * V, 1, ken, vn, wn, 1);
            else FN(step)(K, V, Sin, Sout, e, ak, w, NULL, NULL, 0, ken, vn, wn, 1);
            qt = qn;
        } else {
            if (o != NULL) FN(step)(K, V, Sin, Sout, e, ak, w, qt, o + th * V, 1, NULL, NULL, NULL, 0);
            else FN(step)(K, V, Sin, Sout, e, ak, w, NULL, NULL, 0, NULL, NULL, NULL, 0);
        }
        REAL *tmp;
        tmp = e; e = en; en = tmp;
        tmp = ke; ke = ken; ken = tmp;
        tmp = ak; ak = akn; akn = tmp;
        tmp = w; w = wn; wn = tmp;
        tmp = slot; slot = slotn; slotn = tmp;
        Sin = Sout;
    }
    free(buf);
    return 0;
}

/* The forward: o [TT, H, V], the final states S_out [N, H, K, V] and, when ckpt is given, its checkpoints. With the
   plan's prep, q, k, v, a are the raw q, k, v, beta (every row prepared by the thread that scans it). */
int FN(linattn_delta_fwd)(const linattn_delta_plan *p, const REAL *q, const REAL *k, const REAL *v, const REAL *a,
                          const REAL *g, const REAL *S0, REAL *o, REAL *S_out, REAL *ckpt) {
    const int64_t N = p->N, H = p->H, K = p->K, V = p->V, chunk = p->chunk, *starts = p->starts,
                  *ck_off = p->ck_off;
    const int gate = p->gate, nthreads = p->nthreads, prep = p->prep;
    const REAL sc = (REAL)p->scale, eps = (REAL)p->eps;
    const int64_t KV = K * V;
    int failed = 0;
    if (nthreads > 1 && N * H < DELTA_UNITS_PER_THREAD * (int64_t)nthreads) {
        la_chains_t chn;
        if (la_chains_init(&chn, N * H, nthreads) != 0) return -1;
        const int64_t run = chunk * (DELTA_RUN / chunk > 1 ? DELTA_RUN / chunk : 1); /* whole checkpoint chunks */
        for (int64_t u = 0; u < N * H; u++) {
            if (S0 != NULL) memcpy(S_out + u * KV, S0 + u * KV, (size_t)KV * sizeof(REAL));
            else memset(S_out + u * KV, 0, (size_t)KV * sizeof(REAL));
            if (starts[u / H + 1] > starts[u / H]) la_chains_add(&chn, u, 0, starts[u / H + 1] - starts[u / H]);
        }
#pragma omp parallel num_threads(nthreads)
        { /* each thread keeps to its block of units (heads) while no other falls more than DELTA_SLACK runs behind */
            const int me = la_thread_num(), nt = la_team_size();
            for (int64_t u; (u = la_chains_claim_own(&chn, N * H, me, nt, DELTA_SLACK * run)) >= 0;) {
                const int64_t n = u / H, h = u % H, L = starts[n + 1] - starts[n], i0 = chn.run[u];
                const int64_t take = chunk * la_chains_run((L - i0 + chunk - 1) / chunk, run / chunk); /* chunks */
                const int64_t Lr = L - i0 < take ? L - i0 : take;
                if (FN(scan)(H, K, V, h, starts[n] + i0, Lr, q, k, v, a, g, gate, S_out + u * KV, NULL, o, NULL,
                             NULL, ckpt != NULL ? ckpt + ((ck_off[n] + i0 / chunk) * H + h) * KV : NULL,
                             chunk, prep, sc, eps) != 0) {
                    LA_ATOMIC_WRITE failed = 1;
                }
                la_chains_release(&chn, u, i0 + Lr, L - i0 - Lr);
            }
        }
        la_chains_free(&chn);
        return failed ? -1 : 0;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t task = 0; task < N * H; task++) {
        const int64_t n = task / H, h = task % H;
        REAL *S = S_out + task * KV;
        if (S0 != NULL) memcpy(S, S0 + task * KV, (size_t)KV * sizeof(REAL));
        else memset(S, 0, (size_t)KV * sizeof(REAL));
        if (FN(scan)(H, K, V, h, starts[n], starts[n + 1] - starts[n], q, k, v, a, g, gate, S, NULL, o,
                     NULL, NULL, ckpt != NULL ? ckpt + (ck_off[n] * H + h) * KV : NULL, chunk, prep, sc,
                     eps) != 0) {
            LA_ATOMIC_WRITE failed = 1;
        }
    }
    return failed ? -1 : 0;
}

/* The backward. With P = D_t S_{t-1}, S_t = P + a_t k_t w_t^T and o_t = S_t^T q_t, and dS_t the gradient of
   S_t including o_t's own term q_t do_t^T:
     derr = dS_t^T k_t (the gradient of a_t w_t);  dv_t = a_t derr;  da_t = <derr, w_t>;  dpred = -a_t derr;
     dk_t = dS_t (a_t w_t) + P dpred;  dP = dS_t + k_t dpred^T;  dg_t = <dP, P> (per row for a channel gate);
     dS_{t-1} = D_t dP + q_{t-1} do_{t-1}^T;  dq_{t-1} = S_{t-1} do_{t-1}.
   One pass over the rows per token: the pass that turns dS_t into dS_{t-1} also forms the previous token's
   derr_{t-1} = dS_{t-1}^T k_{t-1} and dq_{t-1}. The sequence's last token starts with its own pass (first).
   Row sums over the columns accumulate into [K] buffers across the column blocks. */
LA_INLINE void FN(bwd_first_cols)(int64_t K, int64_t V, int64_t nw, REAL *restrict dS, const REAL *restrict St,
                                  const REAL *restrict q, const REAL *restrict k, const REAL *restrict dout,
                                  REAL *restrict derr, REAL *restrict dq) {
    REAL dov[FN(VB)], acc[FN(VB)];
    LA_SIMD for (int64_t j = 0; j < nw; j++) { dov[j] = dout[j]; acc[j] = 0; }
    for (int64_t d = 0; d < K; d++) {
        REAL *restrict dSd = dS + d * V;
        const REAL *restrict Std = St + d * V;
        const REAL qd = q[d], kd = k[d];
        REAL sq = 0;
        LA_SIMD_SUM(sq) for (int64_t j = 0; j < nw; j++) {
            dSd[j] += qd * dov[j];
            acc[j] += kd * dSd[j];
            sq += Std[j] * dov[j];
        }
        dq[d] += sq;
    }
    LA_SIMD for (int64_t j = 0; j < nw; j++) derr[j] = acc[j];
}

/* DERR_PASS's second pass of a full column block: accp += sum_d kp[d] dS[d, :], the rows in order (the products and
   the order of the first pass's `accp[j] += kpd * dSn`: the same bits) */
LA_INLINE void FN(derr_pass)(int64_t K, int64_t V, const REAL *restrict dS, const REAL *restrict kp,
                             REAL *restrict accp) {
    for (int64_t d = 0; d < K; d++) {
        const REAL *restrict dSd = dS + d * V;
        const REAL kpd = kp[d];
        LA_SIMD for (int64_t j = 0; j < FN(VB); j++) accp[j] += kpd * dSd[j];
    }
}

/* bwd_cols without a gate or with one decay e per head (the same for every row): then P = e S_{t-1} needs no
   product per element. dk's second term sum_j P dpred = sum_j S_{t-1} (e dpred) reads e dpred, formed once per
   token, and the head gate's <dP, P> = e sum dP S_{t-1} is summed in one lane vector over every row and scaled by
   e once: 8 vector operations per element instead of 9, and no column array for the gate. Without a gate e = 1
   and every product is the general form's (dS_{t-1} = e dP kept as a product for it: the same contraction, the
   same bits). da = <derr, w> is bwd_token's. */
LA_INLINE void FN(bwd_cols_head)(int64_t K, int64_t V, int64_t nw, REAL *restrict dS, const REAL *restrict Sp,
                                 const REAL *restrict w, REAL e, const REAL *restrict k, REAL a,
                                 const REAL *restrict derr, REAL *restrict dv, REAL *restrict dk,
                                 REAL *restrict gsum, int gate, int has_prev, const REAL *restrict qp,
                                 const REAL *restrict kp, const REAL *restrict dop, REAL *restrict derrp,
                                 REAL *restrict dqp) {
    enum { L = 64 / sizeof(REAL) };
    REAL dpred[FN(VB)], dpe[FN(VB)], aw[FN(VB)], dov[FN(VB)], accp[FN(VB)], pg[L];
    LA_SIMD for (int64_t j = 0; j < nw; j++) {
        dv[j] = a * derr[j];
        dpred[j] = -a * derr[j];
        dpe[j] = e * dpred[j];
        aw[j] = a * w[j];
        dov[j] = has_prev ? dop[j] : 0;
        accp[j] = 0;
    }
    LA_SIMD for (int64_t l = 0; l < L; l++) pg[l] = 0;
    REAL sgr = 0; /* the gate's sum over the columns of a narrower last block */
    for (int64_t d = 0; d < K; d++) {
        REAL *restrict dSd = dS + d * V;
        const REAL *restrict Spd = Sp + d * V;
        const REAL kd = k[d], qpd = has_prev ? qp[d] : 0, kpd = has_prev ? kp[d] : 0;
        if (nw == FN(VB)) { /* lane partial sums (L lanes), folded once per row */
            REAL pk[L], pq[L];
            LA_SIMD for (int64_t l = 0; l < L; l++) { pk[l] = 0; pq[l] = 0; }
            for (int64_t c = 0; c < FN(VB); c += L) {
                LA_SIMD for (int64_t l = 0; l < L; l++) {
                    const int64_t j = c + l;
                    const REAL dP = dSd[j] + kd * dpred[j];
                    pk[l] += dSd[j] * aw[j] + Spd[j] * dpe[j];
                    if (gate == GATE_HEAD) pg[l] += dP * Spd[j];
                    REAL dSn = e * dP;
                    if (has_prev) {
                        dSn += qpd * dov[j];
                        if (!DERR_PASS) accp[j] += kpd * dSn;
                        pq[l] += Spd[j] * dov[j];
                    }
                    dSd[j] = dSn;
                }
            }
            dk[d] += FN(lanes_sum)(pk);
            if (has_prev) dqp[d] += FN(lanes_sum)(pq);
            continue;
        }
        REAL sk = 0, sg = 0, sq = 0;
        LA_SIMD_SUM(sk, sg, sq) for (int64_t j = 0; j < nw; j++) {
            const REAL dP = dSd[j] + kd * dpred[j];
            sk += dSd[j] * aw[j] + Spd[j] * dpe[j];
            if (gate == GATE_HEAD) sg += dP * Spd[j];
            REAL dSn = e * dP;
            if (has_prev) {
                dSn += qpd * dov[j];
                accp[j] += kpd * dSn;
                sq += Spd[j] * dov[j];
            }
            dSd[j] = dSn;
        }
        dk[d] += sk;
        sgr += sg;
        if (has_prev) dqp[d] += sq;
    }
    if (DERR_PASS && has_prev && nw == FN(VB)) FN(derr_pass)(K, V, dS, kp, accp);
    if (gate == GATE_HEAD) *gsum += e * (nw == FN(VB) ? FN(lanes_sum)(pg) : sgr);
    if (has_prev) { LA_SIMD for (int64_t j = 0; j < nw; j++) derrp[j] = accp[j]; }
}

LA_INLINE void FN(bwd_cols)(int64_t K, int64_t V, int64_t nw, REAL *restrict dS, const REAL *restrict Sp,
                            const REAL *restrict w, const REAL *restrict e, const REAL *restrict k, REAL a,
                            const REAL *restrict derr, REAL *restrict dv, REAL *restrict dk,
                            REAL *restrict dgc, REAL *restrict da, int has_prev, const REAL *restrict qp,
                            const REAL *restrict kp, const REAL *restrict dop, REAL *restrict derrp,
                            REAL *restrict dqp) {
    REAL dpred[FN(VB)], aw[FN(VB)], dov[FN(VB)], accp[FN(VB)];
    REAL sa = 0;
    LA_SIMD_SUM(sa) for (int64_t j = 0; j < nw; j++) {
        sa += derr[j] * w[j];
        dv[j] = a * derr[j];
        dpred[j] = -a * derr[j];
        aw[j] = a * w[j];
        dov[j] = has_prev ? dop[j] : 0;
        accp[j] = 0;
    }
    *da += sa;
    for (int64_t d = 0; d < K; d++) {
        REAL *restrict dSd = dS + d * V;
        const REAL *restrict Spd = Sp + d * V;
        const REAL ed = e[d], kd = k[d], qpd = has_prev ? qp[d] : 0, kpd = has_prev ? kp[d] : 0;
        if (nw == FN(VB)) { /* lane partial sums (L lanes), folded once per row */
            enum { L = 64 / sizeof(REAL) };
            REAL pk[L], pg[L], pq[L];
            LA_SIMD for (int64_t l = 0; l < L; l++) { pk[l] = 0; pg[l] = 0; pq[l] = 0; }
            for (int64_t c = 0; c < FN(VB); c += L) {
                LA_SIMD for (int64_t l = 0; l < L; l++) {
                    const int64_t j = c + l;
                    const REAL P = ed * Spd[j];
                    const REAL dP = dSd[j] + kd * dpred[j];
                    pk[l] += dSd[j] * aw[j] + P * dpred[j];
                    pg[l] += dP * P;
                    REAL dSn = ed * dP;
                    if (has_prev) {
                        dSn += qpd * dov[j];
                        if (!DERR_PASS) accp[j] += kpd * dSn;
                        pq[l] += Spd[j] * dov[j];
                    }
                    dSd[j] = dSn;
                }
            }
            dk[d] += FN(lanes_sum)(pk);
            dgc[d] += FN(lanes_sum)(pg);
            if (has_prev) dqp[d] += FN(lanes_sum)(pq);
            continue;
        }
        REAL sk = 0, sg = 0, sq = 0;
        LA_SIMD_SUM(sk, sg, sq) for (int64_t j = 0; j < nw; j++) {
            const REAL P = ed * Spd[j];
            const REAL dP = dSd[j] + kd * dpred[j];
            sk += dSd[j] * aw[j] + P * dpred[j];
            sg += dP * P;
            REAL dSn = ed * dP;
            if (has_prev) {
                dSn += qpd * dov[j];
                accp[j] += kpd * dSn;
                sq += Spd[j] * dov[j];
            }
            dSd[j] = dSn;
        }
        dk[d] += sk;
        dgc[d] += sg;
        if (has_prev) dqp[d] += sq;
    }
    if (DERR_PASS && has_prev && nw == FN(VB)) FN(derr_pass)(K, V, dS, kp, accp);
    if (has_prev) { LA_SIMD for (int64_t j = 0; j < nw; j++) derrp[j] = accp[j]; }
}

/* one token over every column block; gate and has_prev are constants at each call site (specialised) */
LA_INLINE void FN(bwd_token)(int64_t K, int64_t V, REAL *dS, const REAL *Sp, const REAL *w, const REAL *e,
                             const REAL *k, REAL a, const REAL *derr, REAL *dv, REAL *dk, REAL *dgc,
                             REAL *gsum, REAL *da, int gate, int has_prev, const REAL *qp, const REAL *kp,
                             const REAL *dop, REAL *derrp, REAL *dqp) {
    int64_t j0 = 0;
    if (gate != GATE_CHANNEL) {
        for (; j0 + FN(VB) <= V; j0 += FN(VB)) { /* da = <derr, w> by blocks of VB, as the general form sums it */
            REAL sa = 0;
            LA_SIMD_SUM(sa) for (int64_t j = 0; j < FN(VB); j++) sa += derr[j0 + j] * w[j0 + j];
            *da += sa;
        }
        if (j0 < V) {
            REAL sa = 0;
            LA_SIMD_SUM(sa) for (int64_t j = j0; j < V; j++) sa += derr[j] * w[j];
            *da += sa;
        }
        for (j0 = 0; j0 + FN(VB) <= V; j0 += FN(VB))
            FN(bwd_cols_head)(K, V, FN(VB), dS + j0, Sp + j0, w + j0, e[0], k, a, derr + j0, dv + j0, dk, gsum, gate,
                              has_prev, qp, kp, has_prev ? dop + j0 : NULL, has_prev ? derrp + j0 : NULL, dqp);
        if (j0 < V)
            FN(bwd_cols_head)(K, V, V - j0, dS + j0, Sp + j0, w + j0, e[0], k, a, derr + j0, dv + j0, dk, gsum, gate,
                              has_prev, qp, kp, has_prev ? dop + j0 : NULL, has_prev ? derrp + j0 : NULL, dqp);
        return;
    }
    for (; j0 + FN(VB) <= V; j0 += FN(VB))
        FN(bwd_cols)(K, V, FN(VB), dS + j0, Sp + j0, w + j0, e, k, a, derr + j0, dv + j0, dk, dgc, da, has_prev,
                     qp, kp, has_prev ? dop + j0 : NULL, has_prev ? derrp + j0 : NULL, dqp);
    if (j0 < V)
        FN(bwd_cols)(K, V, V - j0, dS + j0, Sp + j0, w + j0, e, k, a, derr + j0, dv + j0, dk, dgc, da, has_prev,
                     qp, kp, has_prev ? dop + j0 : NULL, has_prev ? derrp + j0 : NULL, dqp);
}

/* the scratch of one thread's backward: a stretch's states S_{t-1} and its last S_t, its w and e; derr of this and
   the previous token, dq, dk and dg of a token */
static size_t FN(bwd_scratch)(int64_t K, int64_t V, int64_t chunk) {
    return (size_t)((chunk + 1) * K * V + chunk * (V + K) + 2 * V + 4 * K) * sizeof(REAL);
}

/* The stretches c_hi - 1 down to c_lo of unit (n, h) (stretch c: tokens s + c chunk ...), dS = its state gradient,
   carried; dcarry [V]: derr of the token after the first stretch, in and out (c_hi = the last stretch: not read).
   Returns -1 when the recomputing scan found no memory. */
static int FN(bwd_stretches)(int64_t H, int64_t K, int64_t V, const int64_t *starts, const REAL *q, const REAL *k,
                             const REAL *v, const REAL *a, const REAL *g, int gate, const REAL *ckpt,
                             const int64_t *ck_off, int64_t chunk, const REAL *dout, REAL *dq, REAL *dk, REAL *dv,
                             REAL *da, REAL *dg, int64_t n, int64_t h, int64_t c_hi, int64_t c_lo, REAL *restrict dS,
                             REAL *dcarry, REAL *Sbuf) {
    const int64_t KV = K * V, s = starts[n], L = starts[n + 1] - s;
    REAL *wbuf = Sbuf + (chunk + 1) * KV, *ebuf = wbuf + chunk * V, *derr = ebuf + chunk * K;
    REAL *derrp = derr + V, *dqp = derrp + V, *dkt = dqp + K, *dgt = dkt + K;
    if (c_hi < (L + chunk - 1) / chunk) memcpy(derr, dcarry, (size_t)V * sizeof(REAL));
    for (int64_t c = c_hi - 1; c >= c_lo; c--) {
        const int64_t t0 = s + c * chunk, Lc = (L - c * chunk) < chunk ? (L - c * chunk) : chunk;
        memcpy(Sbuf, ckpt + ((ck_off[n] + c) * H + h) * KV, (size_t)KV * sizeof(REAL));
        if (FN(scan)(H, K, V, h, t0, Lc, q, k, v, a, g, gate, Sbuf, Sbuf, NULL, wbuf, ebuf, NULL, chunk, PREP_NONE,
                     0, 0) != 0)
            return -1;
        if (t0 + Lc == s + L) { /* the sequence's last token: its own output's term, derr and dq */
            const int64_t th = (s + L - 1) * H + h;
            const REAL *St = Sbuf + Lc * KV;
            for (int64_t d = 0; d < K; d++) dqp[d] = 0;
            int64_t j0 = 0;
            for (; j0 + FN(VB) <= V; j0 += FN(VB))
                FN(bwd_first_cols)(K, V, FN(VB), dS + j0, St + j0, q + th * K, k + th * K, dout + th * V + j0,
                                   derr + j0, dqp);
            if (j0 < V)
                FN(bwd_first_cols)(K, V, V - j0, dS + j0, St + j0, q + th * K, k + th * K, dout + th * V + j0,
                                   derr + j0, dqp);
            memcpy(dq + th * K, dqp, (size_t)K * sizeof(REAL));
        }
        for (int64_t i = Lc - 1; i >= 0; i--) {
            const int64_t th = (t0 + i) * H + h, tp = th - H;
            const int has_prev = t0 + i > s;
            const REAL *Sp = Sbuf + i * KV, *w = wbuf + i * V, *e = ebuf + i * K, *kt = k + th * K;
            REAL dat = 0, gsum = 0;
            for (int64_t d = 0; d < K; d++) { dqp[d] = 0; dkt[d] = 0; dgt[d] = 0; }
            /* six specialisations: the gate (none, head, channel) x whether a previous token exists */
            if (has_prev) {
                const REAL *qp = q + tp * K, *kp = k + tp * K, *dop = dout + tp * V;
                if (gate == GATE_NONE)
                    FN(bwd_token)(K, V, dS, Sp, w, e, kt, a[th], derr, dv + th * V, dkt, dgt, &gsum,
                                  &dat, GATE_NONE, 1, qp, kp, dop, derrp, dqp);
                else if (gate == GATE_HEAD)
                    FN(bwd_token)(K, V, dS, Sp, w, e, kt, a[th], derr, dv + th * V, dkt, dgt, &gsum,
                                  &dat, GATE_HEAD, 1, qp, kp, dop, derrp, dqp);
                else
                    FN(bwd_token)(K, V, dS, Sp, w, e, kt, a[th], derr, dv + th * V, dkt, dgt, &gsum,
                                  &dat, GATE_CHANNEL, 1, qp, kp, dop, derrp, dqp);
                memcpy(dq + tp * K, dqp, (size_t)K * sizeof(REAL));
            } else {
                if (gate == GATE_NONE)
                    FN(bwd_token)(K, V, dS, Sp, w, e, kt, a[th], derr, dv + th * V, dkt, dgt, &gsum,
                                  &dat, GATE_NONE, 0, NULL, NULL, NULL, NULL, NULL);
                else if (gate == GATE_HEAD)
                    FN(bwd_token)(K, V, dS, Sp, w, e, kt, a[th], derr, dv + th * V, dkt, dgt, &gsum,
                                  &dat, GATE_HEAD, 0, NULL, NULL, NULL, NULL, NULL);
                else
                    FN(bwd_token)(K, V, dS, Sp, w, e, kt, a[th], derr, dv + th * V, dkt, dgt, &gsum,
                                  &dat, GATE_CHANNEL, 0, NULL, NULL, NULL, NULL, NULL);
            }
            da[th] = dat;
            memcpy(dk + th * K, dkt, (size_t)K * sizeof(REAL));
            if (gate == GATE_CHANNEL) memcpy(dg + th * K, dgt, (size_t)K * sizeof(REAL));
            if (gate == GATE_HEAD) dg[th] = gsum;
            REAL *tmp = derr; derr = derrp; derrp = tmp;
        }
    }
    memcpy(dcarry, derr, (size_t)V * sizeof(REAL));
    return 0;
}

/* bwd_stretches with the plan's prep (q, k, v, a the raw rows and beta, as the forward's): stretch by stretch, its
   rows (and the row before it, whose q and k its first token reads) prepared again with the forward's row code (the
   bits of the preparation pass) into rows laid out as the inputs' (token stride H: only head h's written), which
   bwd_stretches itself then reads, unchanged (where two NaN meet, which one an operation passes on depends on the
   registers GCC picks for that code: the same code, the same bits); then each row of the stretch, its gradients
   complete (a row's dq comes with the next token's step), through the preparation's backward (deltarow.h: the bits
   of deltaprep.c's backward pass): dq, dk, dv, da become the raw rows' and beta's gradients. Scratch: the rows
   (chunk + 1) H (2 K + V + 1) and 2 K + V. */
static size_t FN(prep_scratch)(int64_t H, int64_t K, int64_t V, int64_t chunk) {
    return (size_t)((chunk + 1) * H * (2 * K + V + 1) + 3 * K + V) * sizeof(REAL);
}

static int FN(bwd_stretches_prep)(int64_t H, int64_t K, int64_t V, const int64_t *starts, const REAL *q,
                                  const REAL *k, const REAL *v, const REAL *a, const REAL *g, int gate,
                                  const REAL *ckpt, const int64_t *ck_off, int64_t chunk, const REAL *dout, REAL *dq,
                                  REAL *dk, REAL *dv, REAL *da, REAL *dg, int64_t n, int64_t h, int64_t c_hi,
                                  int64_t c_lo, REAL *restrict dS, REAL *dcarry, REAL *Sbuf, int prep, REAL sc,
                                  REAL eps, REAL *pbuf) {
    const int64_t s = starts[n], L = starts[n + 1] - s, W = (chunk + 1) * H;
    REAL *pq = pbuf, *pk = pq + W * K, *pv = pk + W * K, *pa = pv + W * V, *dqo = pa + W, *dko = dqo + K;
    REAL *dvo = dko + K, *G = dvo + V;
    for (int64_t c = c_hi - 1; c >= c_lo; c--) {
        const int64_t t0 = s + c * chunk, Lc = (L - c * chunk) < chunk ? (L - c * chunk) : chunk;
        /* token t0 + i's row at (i + 1) H + h: the inputs' layout from token t0 - 1 on */
        for (int64_t i = t0 > s ? -1 : 0; i < Lc; i++) {
            const int64_t th = (t0 + i) * H + h, r = (i + 1) * H + h;
            if (prep == PREP_L2)
                pa[r] = FN(la_dprep_row_a)(K, V, q + th * K, k + th * K, v + th * V, a[th], sc, eps, pq + r * K,
                                           pk + r * K, pv + r * V);
            else
                pa[r] = FN(la_dprep_raw_row_a)(K, V, q + th * K, k + th * K, v + th * V, a[th], sc, pq + r * K,
                                               pk + r * K, pv + r * V);
        }
        /* bwd_stretches indexes row (t0 + i) H + h: the rows' base moved back by (t0 - 1) H rows (the rows it
           reads all lie in the buffer; the base itself may lie before it, so it is computed on addresses, as GCC
           defines integer-pointer conversion, not by pointer arithmetic, which C leaves undefined there) */
        const int64_t back = (t0 - 1) * H;
#define BACK(ptr, rows) ((REAL *)(void *)((uintptr_t)(ptr) - (uintptr_t)(rows) * sizeof(REAL)))
        if (FN(bwd_stretches)(H, K, V, starts, BACK(pq, back * K), BACK(pk, back * K), BACK(pv, back * V),
                              BACK(pa, back), g, gate, ckpt, ck_off, chunk, dout, dq, dk, dv, da, dg, n, h, c + 1, c,
                              dS, dcarry, Sbuf) != 0)
#undef BACK
            return -1;
        for (int64_t i = 0; i < Lc; i++) {
            const int64_t th = (t0 + i) * H + h;
            const REAL dat = da[th];
            memcpy(dqo, dq + th * K, (size_t)K * sizeof(REAL));
            memcpy(dko, dk + th * K, (size_t)K * sizeof(REAL));
            memcpy(dvo, dv + th * V, (size_t)V * sizeof(REAL));
            if (prep == PREP_L2)
                FN(la_dprep_bwd_row_a)(K, V, q + th * K, k + th * K, sc, eps, dqo, dko, dvo, &dat, dq + th * K,
                                       dk + th * K, dv + th * V, da + th, G);
            else
                FN(la_dprep_raw_bwd_row_a)(K, V, k + th * K, sc, dqo, dko, dvo, &dat, dq + th * K, dk + th * K,
                                           dv + th * V, da + th);
        }
    }
    return 0;
}

/* the stretches c_hi - 1 .. c_lo of a unit: bwd_stretches, or with prep bwd_stretches_prep */
static int FN(bwd_unit)(int64_t H, int64_t K, int64_t V, const int64_t *starts, const REAL *q, const REAL *k,
                        const REAL *v, const REAL *a, const REAL *g, int gate, const REAL *ckpt, const int64_t *ck_off,
                        int64_t chunk, const REAL *dout, REAL *dq, REAL *dk, REAL *dv, REAL *da, REAL *dg, int64_t n,
                        int64_t h, int64_t c_hi, int64_t c_lo, REAL *dS, REAL *dcarry, REAL *Sbuf, int prep, REAL sc,
                        REAL eps, REAL *pbuf) {
    if (prep == PREP_NONE)
        return FN(bwd_stretches)(H, K, V, starts, q, k, v, a, g, gate, ckpt, ck_off, chunk, dout, dq, dk, dv, da, dg,
                                 n, h, c_hi, c_lo, dS, dcarry, Sbuf);
    return FN(bwd_stretches_prep)(H, K, V, starts, q, k, v, a, g, gate, ckpt, ck_off, chunk, dout, dq, dk, dv, da, dg,
                                  n, h, c_hi, c_lo, dS, dcarry, Sbuf, prep, sc, eps, pbuf);
}

/* dS [N, H, K, V] enters as dL/dS_final (the caller zero-fills it when the final state has no gradient)
   and leaves as dL/dS0. dg may be NULL without a gate. With the plan's prep, q, k, v, a are the forward's raw rows
   and beta, and dq, dk, dv, da their gradients (each row prepared again in the thread that scans it, bwd_stretches).
   Returns -1 when scratch memory is missing. */
int FN(linattn_delta_bwd)(const linattn_delta_plan *p, const REAL *q, const REAL *k, const REAL *v, const REAL *a,
                          const REAL *g, const REAL *ckpt, const REAL *dout, REAL *dS_all, REAL *dq, REAL *dk,
                          REAL *dv, REAL *da, REAL *dg) {
    const int64_t N = p->N, H = p->H, K = p->K, V = p->V, chunk = p->chunk, *starts = p->starts,
                  *ck_off = p->ck_off;
    const int gate = p->gate, nthreads = p->nthreads, prep = p->prep;
    const REAL sc = (REAL)p->scale, eps = (REAL)p->eps;
    const int64_t KV = K * V;
    int failed = 0;
    const int chains = nthreads > 1 && N * H < DELTA_UNITS_PER_THREAD * (int64_t)nthreads;
    /* chains: runs of whole stretches, each unit's derr carried between them in dcar */
    const int64_t run = DELTA_RUN / chunk > 1 ? DELTA_RUN / chunk : 1;
    la_chains_t chn = {0};
    REAL *dcar = chains ? (REAL *)malloc((size_t)(N * H * V > 0 ? N * H * V : 1) * sizeof(REAL)) : NULL;
    if (chains && (!dcar || la_chains_init(&chn, N * H, nthreads) != 0)) {
        free(dcar);
        return -1;
    }
    if (chains)
        for (int64_t u = 0; u < N * H; u++) {
            const int64_t L = starts[u / H + 1] - starts[u / H];
            if (L > 0) /* the stretches below run[u] are left */
                la_chains_add(&chn, u, (L + chunk - 1) / chunk, (L + chunk - 1) / chunk);
        }
#pragma omp parallel num_threads(nthreads)
    {
        /* with prep, the rows' scratch in the same block (one allocation per thread and call, as without) */
        const size_t sb = FN(bwd_scratch)(K, V, chunk);
        REAL *Sbuf = (REAL *)malloc(sb + (prep != PREP_NONE ? FN(prep_scratch)(H, K, V, chunk) : 0));
        REAL *dc = (REAL *)malloc((size_t)(V > 0 ? V : 1) * sizeof(REAL));
        REAL *pbuf = prep != PREP_NONE && Sbuf != NULL ? Sbuf + sb / sizeof(REAL) : NULL;
        if (Sbuf == NULL || dc == NULL) {
            LA_ATOMIC_WRITE failed = 1;
        }
        if (chains) {
            const int me = la_thread_num(), nt = la_team_size();
            for (int64_t u; !failed && (u = la_chains_claim_own(&chn, N * H, me, nt, DELTA_SLACK * run)) >= 0;) {
                const int64_t c_hi = chn.run[u], c_lo = c_hi - la_chains_run(c_hi, run);
                if (FN(bwd_unit)(H, K, V, starts, q, k, v, a, g, gate, ckpt, ck_off, chunk, dout, dq, dk, dv, da, dg,
                                 u / H, u % H, c_hi, c_lo, dS_all + u * KV, dcar + u * V, Sbuf, prep, sc, eps,
                                 pbuf) != 0) {
                    LA_ATOMIC_WRITE failed = 1;
                }
                la_chains_release(&chn, u, c_lo, c_lo);
            }
        } else {
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < N * H; task++) {
                const int64_t n = task / H, L = starts[n + 1] - starts[n];
                if (L <= 0 || failed) continue;
                if (FN(bwd_unit)(H, K, V, starts, q, k, v, a, g, gate, ckpt, ck_off, chunk, dout, dq, dk, dv, da, dg,
                                 n, task % H, (L + chunk - 1) / chunk, 0, dS_all + task * KV, dc, Sbuf, prep, sc,
                                 eps, pbuf) != 0) {
                    LA_ATOMIC_WRITE failed = 1;
                }
            }
        }
        free(Sbuf), free(dc);
    }
    if (chains) la_chains_free(&chn);
    free(dcar);
    return failed ? -1 : 0;
}

#endif
