/* RWKV-7's diagonal-plus-rank-one scan on a CPU: forward and backward, token by token (linattn.cpu.rwkv7).

       u_t = S_{t-1}^T a_t,     S_t = Diag(e_t) S_{t-1} + b_t u_t^T + k_t v_t^T,     o_t = scale S_t^T r_t

   with the state S [K, V] per (sequence, head) (fla's layout), e_t = exp(w_t) the per-channel decays (computed
   by torch before the call, as for csrc/delta.c). Every column j of S evolves on its own given the token's
   vectors (u_t[j] reads column j only), so a step works on blocks of VB value columns whose accumulators stay
   in registers while the state stays in L1 (16 KB for K = V = 64 in float).

   Why a scan and not the chunk (WY/UT) form of fla's DPLR kernels: per token and head the scan costs 4 K V
   multiply-adds over a state in cache; the chunk form costs more per token for chunks of C >= K and needs the
   within-chunk decay ratios exp(W_i - W_j) (bounded only by splitting chunks where the decays are strong),
   while the scan multiplies by e_t <= 1 alone: nothing in it can overflow that the recurrence itself does not.
   Causality is structural: nothing computed for token t reads a later token's inputs except the next token's
   read u_{t+1}, which only that token uses; a prefix gives the same bits.

   Layout: tokens flat, [TT, H, D] contiguous; sequence n covers tokens starts[n] .. starts[n+1]-1. States
   [N, H, K, V]. One OpenMP task per (sequence, head).

   Backward: the forward keeps the state before every `chunk`-th token (ckpt [NCK, H, K, V], sequence n's first
   at ck_off[n]); the backward walks the stretches in reverse, recomputes a stretch's states and reads u_t from
   its checkpoint, then runs the reverse recurrence (G = dL/dS_t):
       G += scale r_t do_t^T;  dr_t = scale S_t do_t;  dk_t = G v_t;  dv_t = G^T k_t;  db_t = G u_t;
       du = G^T b_t;  dw_t = e_t * rowsum(G o S_{t-1});  da_t = S_{t-1} du;  G <- Diag(e_t) G + a_t du^T.

   No -ffast-math: the reductions are vectorised through `omp simd reduction` (reassociation only); NaN and inf
   propagate as in the PyTorch forms. The body is compiled for float (_f32) and double (_f64) by including this
   file into itself. */
#ifndef LINATTN_RWKV7_BODY
#define LINATTN_RWKV7_BODY

#include "common.h"
#include "rowsums.h"

/* unroll-and-jam of the column-block loops made the scan slower when measured (register pressure) */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-loop-unroll-and-jam")
#endif

#if defined(_OPENMP)
#define RW_PARALLEL_FOR(n) LA_PRAGMA(omp parallel for schedule(dynamic, 1) num_threads(n))
#else
#define RW_PARALLEL_FOR(n)
#endif
#define RW_AHEAD 4 /* tokens: a head's rows lie H * D apart, which the hardware prefetchers follow poorly */
/* a block of value columns: 256 bytes with AVX-512 (32 registers), 128 without (16) */
#if defined(__AVX512F__)
#define RW_VBYTES 256
#else
#define RW_VBYTES 128
#endif

LA_ABI_VERSION(rwkv7, 1)

#define REAL float
#define FN(name) name##_f32
#include "rwkv7.c"
#undef REAL
#undef FN

#define REAL double
#define FN(name) name##_f64
#include "rwkv7.c"
#undef REAL
#undef FN

#else /* ------------------------------------------------------------------ the body, once per REAL */

enum { FN(RW_VB) = RW_VBYTES / sizeof(REAL) };
/* the backward holds six column vectors per block in registers: half the forward's block */
enum { FN(RW_VBB) = RW_VBYTES / 2 / sizeof(REAL) };

/* u = S^T a on the columns [0, nw) of S (row stride V): the first token of a stretch */
LA_INLINE void FN(rw_read_cols)(int64_t K, int64_t V, int64_t nw, const REAL *restrict S, const REAL *restrict a,
                                REAL *restrict u) {
    REAL acc[FN(RW_VB)];
    LA_SIMD for (int64_t j = 0; j < nw; j++) acc[j] = 0;
    for (int64_t d = 0; d < K; d++) {
        const REAL *restrict Sd = S + d * V;
        const REAL c = a[d];
        LA_SIMD for (int64_t j = 0; j < nw; j++) acc[j] += c * Sd[j];
    }
    LA_SIMD for (int64_t j = 0; j < nw; j++) u[j] = acc[j];
}

/* One token on the columns [0, nw): Sout = Diag(e) Sin + b u^T + k v^T (Sin may be Sout: each element is read,
   then written), o = scale Sout^T r when has_o, un = Sout^T an (the next token's read) when has_next. */
LA_INLINE void FN(rw_step_cols)(int64_t K, int64_t V, int64_t nw, const REAL *Sin, REAL *Sout,
                                const REAL *restrict e, const REAL *restrict b, const REAL *restrict k,
                                const REAL *restrict u, const REAL *restrict v, const REAL *restrict r, REAL scale,
                                REAL *restrict o, int has_o, const REAL *restrict an, REAL *restrict un,
                                int has_next) {
    REAL ur[FN(RW_VB)], vr[FN(RW_VB)], out[FN(RW_VB)], accn[FN(RW_VB)];
    LA_SIMD for (int64_t j = 0; j < nw; j++) { ur[j] = u[j]; vr[j] = v[j]; out[j] = 0; accn[j] = 0; }
    for (int64_t d = 0; d < K; d++) {
        const REAL *Sid = Sin + d * V;
        REAL *Sod = Sout + d * V;
        const REAL ed = e[d], bd = b[d], kd = k[d], rd = has_o ? r[d] : 0, ad = has_next ? an[d] : 0;
        LA_SIMD for (int64_t j = 0; j < nw; j++) {
            const REAL s = ed * Sid[j] + bd * ur[j] + kd * vr[j];
            Sod[j] = s;
            if (has_o) out[j] += rd * s;
            if (has_next) accn[j] += ad * s;
        }
    }
    if (has_o) { LA_SIMD for (int64_t j = 0; j < nw; j++) o[j] = scale * out[j]; }
    if (has_next) { LA_SIMD for (int64_t j = 0; j < nw; j++) un[j] = accn[j]; }
}

LA_INLINE void FN(rw_read)(int64_t K, int64_t V, const REAL *S, const REAL *a, REAL *u) {
    int64_t j0 = 0;
    for (; j0 + FN(RW_VB) <= V; j0 += FN(RW_VB)) FN(rw_read_cols)(K, V, FN(RW_VB), S + j0, a, u + j0);
    if (j0 < V) FN(rw_read_cols)(K, V, V - j0, S + j0, a, u + j0);
}

/* one token over every column block; has_o and has_next are constants at each call site (specialised) */
LA_INLINE void FN(rw_step)(int64_t K, int64_t V, const REAL *Sin, REAL *Sout, const REAL *e, const REAL *b,
                           const REAL *k, const REAL *u, const REAL *v, const REAL *r, REAL scale, REAL *o,
                           int has_o, const REAL *an, REAL *un, int has_next) {
    int64_t j0 = 0;
    for (; j0 + FN(RW_VB) <= V; j0 += FN(RW_VB))
        FN(rw_step_cols)(K, V, FN(RW_VB), Sin + j0, Sout + j0, e, b, k, u + j0, v + j0, r, scale,
                         has_o ? o + j0 : NULL, has_o, an, has_next ? un + j0 : NULL, has_next);
    if (j0 < V)
        FN(rw_step_cols)(K, V, V - j0, Sin + j0, Sout + j0, e, b, k, u + j0, v + j0, r, scale,
                         has_o ? o + j0 : NULL, has_o, an, has_next ? un + j0 : NULL, has_next);
}

/* Tokens t0 .. t0+L-1 of head h from the state S (updated in place, or written to Sstates[i+1] when Sstates is
   given, with Sstates[0] = S), outputs into o (or none), u_t into ustates[i] (or none); ckpt: the state before
   every `chunk`-th token (or none). Returns -1 when scratch memory is missing. */
static int FN(rw_scan)(int64_t H, int64_t K, int64_t V, int64_t h, int64_t t0, int64_t L, const REAL *r,
                       const REAL *e, const REAL *k, const REAL *v, const REAL *a, const REAL *b, REAL scale, REAL *S,
                       REAL *Sstates, REAL *o, REAL *ustates, REAL *ckpt, int64_t chunk) {
    if (L <= 0) return 0;
    const int64_t KV = K * V;
    REAL *buf = (REAL *)malloc((size_t)(2 * V) * sizeof(REAL));
    if (buf == NULL) return -1;
    REAL *u = buf, *un = buf + V;
    FN(rw_read)(K, V, S, a + (t0 * H + h) * K, u);
    const REAL *Sin = S;
    for (int64_t i = 0; i < L; i++) {
        const int64_t th = (t0 + i) * H + h, tn = th + H;
        REAL *Sout = Sstates != NULL ? Sstates + (i + 1) * KV : S;
        if (ckpt != NULL && i % chunk == 0) memcpy(ckpt + (i / chunk) * H * KV, Sin, (size_t)KV * sizeof(REAL));
        if (ustates != NULL) memcpy(ustates + i * V, u, (size_t)V * sizeof(REAL));
        const REAL *et = e + th * K, *bt = b + th * K, *kt = k + th * K, *vt = v + th * V, *rt = r + th * K;
        if (i + RW_AHEAD < L) {
            const int64_t tp = th + RW_AHEAD * H;
            for (int64_t c = 0; c < K; c += 64 / (int64_t)sizeof(REAL)) {
                LA_PREFETCH(e + tp * K + c, 0);
                LA_PREFETCH(b + tp * K + c, 0);
                LA_PREFETCH(k + tp * K + c, 0);
                LA_PREFETCH(a + tp * K + c, 0);
                if (o != NULL) LA_PREFETCH(r + tp * K + c, 0);
            }
            for (int64_t c = 0; c < V; c += 64 / (int64_t)sizeof(REAL)) {
                LA_PREFETCH(v + tp * V + c, 0);
                if (o != NULL) LA_PREFETCH(o + tp * V + c, 1);
            }
        }
        if (i + 1 < L) {
            if (o != NULL)
                FN(rw_step)(K, V, Sin, Sout, et, bt, kt, u, vt, rt, scale, o + th * V, 1, a + tn * K, un, 1);
            else
                FN(rw_step)(K, V, Sin, Sout, et, bt, kt, u, vt, NULL, scale, NULL, 0, a + tn * K, un, 1);
        } else {
            if (o != NULL)
                FN(rw_step)(K, V, Sin, Sout, et, bt, kt, u, vt, rt, scale, o + th * V, 1, NULL, NULL, 0);
            else
                FN(rw_step)(K, V, Sin, Sout, et, bt, kt, u, vt, NULL, scale, NULL, 0, NULL, NULL, 0);
        }
        REAL *tmp = u;
        u = un;
        un = tmp;
        Sin = Sout;
    }
    free(buf);
    return 0;
}

/* S0 may be NULL (zeros); ckpt NULL keeps no checkpoints (no gradient). Returns -1 when scratch memory is
   missing. */
int FN(linattn_rwkv7_fwd)(int64_t N, int64_t H, int64_t K, int64_t V, const int64_t *starts, const REAL *r,
                          const REAL *e, const REAL *k, const REAL *v, const REAL *a, const REAL *b, double scale,
                          const REAL *S0, REAL *o, REAL *S_out, REAL *ckpt, const int64_t *ck_off, int64_t chunk,
                          int nthreads) {
    const int64_t KV = K * V;
    int failed = 0;
    RW_PARALLEL_FOR(nthreads)
    for (int64_t task = 0; task < N * H; task++) {
        const int64_t n = task / H, h = task % H;
        REAL *S = S_out + task * KV;
        if (S0 != NULL) memcpy(S, S0 + task * KV, (size_t)KV * sizeof(REAL));
        else memset(S, 0, (size_t)KV * sizeof(REAL));
        if (FN(rw_scan)(H, K, V, h, starts[n], starts[n + 1] - starts[n], r, e, k, v, a, b, (REAL)scale, S, NULL,
                        o, NULL, ckpt != NULL ? ckpt + (ck_off[n] * H + h) * KV : NULL, chunk) != 0) {
            LA_ATOMIC_WRITE failed = 1;
        }
    }
    return failed ? -1 : 0;
}

/* x[0] + ... + x[L-1] of L = 64 bytes of lanes, by halving with constant bounds */
enum { FN(RW_L) = 64 / sizeof(REAL) };
LA_INLINE REAL FN(rw_lanes_sum)(REAL *restrict x) {
    LA_SIMD for (int64_t l = 0; l < FN(RW_L) / 2; l++) x[l] += x[l + FN(RW_L) / 2];
    LA_SIMD for (int64_t l = 0; l < FN(RW_L) / 4; l++) x[l] += x[l + FN(RW_L) / 4];
    for (int64_t l = 0; l < FN(RW_L) / 8; l++) x[l] += x[l + FN(RW_L) / 8];
    return FN(RW_L) == 16 ? x[0] + x[1] : x[0];
}

#if defined(LA_ROWSUMS_BATCH)
enum { FN(RW_R) = FN(RW_L) / 2 }; /* rows per batch of row sums (rowsums.h): the lanes of a first halving */
/* h = a row's lanes x after the first halving of rw_lanes_sum */
LA_INLINE void FN(rw_half)(const REAL *restrict x, REAL *restrict h) {
    LA_SIMD for (int64_t l = 0; l < FN(RW_R); l++) h[l] = x[l] + x[l + FN(RW_R)];
}
/* the rest of rw_lanes_sum's fold on a first halving h (the rows after the last whole batch) */
LA_INLINE REAL FN(rw_half_sum)(REAL *restrict h) {
    for (int64_t n = FN(RW_R) / 2; n >= 1; n /= 2)
        for (int64_t l = 0; l < n; l++) h[l] += h[l + n];
    return h[0];
}
#endif

/* The reverse recurrence, one token t on the value columns [0, nw) of G = dL/dS (row stride V), fused with the
   second half of token t+1's step when has_next (both walk the same rows and read S_t):
       token t+1 (has_next):  da_{t+1} += S_t du_{t+1};   G <- Diag(e_{t+1}) G + a_{t+1} du_{t+1}^T
       token t:               G += scale r_t do_t^T;  dr_t += scale S_t do_t;  dk_t += G v_t;  db_t += G u_t;
                              dw_t += rowsum(G o S_{t-1});  dv_t = G^T k_t;  du_t = G^T b_t
   The row sums (dr, dk, db, dw, da: [K]) accumulate over the column blocks; dv and du are this block's columns. */
LA_INLINE void FN(rw_back_cols)(int64_t K, int64_t V, int64_t nw, REAL *restrict G, const REAL *restrict St,
                                const REAL *restrict Sp, const REAL *restrict u, const REAL *restrict v,
                                const REAL *restrict dout, const REAL *restrict r, const REAL *restrict k,
                                const REAL *restrict b, REAL scale, const REAL *restrict en,
                                const REAL *restrict an, const REAL *restrict dun, REAL *restrict dan, int has_next,
                                REAL *restrict dr, REAL *restrict dk, REAL *restrict db, REAL *restrict dw,
                                REAL *restrict dv, REAL *restrict du) {
    REAL dva[FN(RW_VBB)], dua[FN(RW_VBB)];
    LA_SIMD for (int64_t j = 0; j < nw; j++) {
        dva[j] = 0;
        dua[j] = 0;
    }
#if defined(LA_ROWSUMS_BATCH)
    REAL hb[5][FN(RW_R)][FN(RW_R)]; /* the first halvings of pa, pr, pk, pb, pw since the last whole batch */
    REAL *const dst[5] = {dan, dr, dk, db, dw};
#endif
    for (int64_t d = 0; d < K; d++) {
        REAL *restrict Gd = G + d * V;
        const REAL *restrict Std = St + d * V, *restrict Spd = Sp + d * V;
        const REAL ed = has_next ? en[d] : 1, ad = has_next ? an[d] : 0;
        const REAL rd = scale * r[d], kd = k[d], bd = b[d];
        REAL sa = 0, sr = 0, sk = 0, sb = 0, sw = 0;
        if (nw % FN(RW_L) == 0) {
            /* the row sums in lanes, summed by halving at the end: a reduction's own horizontal sum is serial */
            REAL pa[FN(RW_L)], pr[FN(RW_L)], pk[FN(RW_L)], pb[FN(RW_L)], pw[FN(RW_L)];
            LA_SIMD for (int64_t l = 0; l < FN(RW_L); l++) pa[l] = pr[l] = pk[l] = pb[l] = pw[l] = 0;
            for (int64_t j0 = 0; j0 < nw; j0 += FN(RW_L)) {
                LA_SIMD for (int64_t l = 0; l < FN(RW_L); l++) {
                    const int64_t j = j0 + l;
                    const REAL s = Std[j];
                    REAL g = Gd[j];
                    if (has_next) {
                        pa[l] += s * dun[j];
                        g = ed * g + ad * dun[j];
                    }
                    g += rd * dout[j];
                    Gd[j] = g;
                    pr[l] += s * dout[j];
                    pk[l] += g * v[j];
                    pb[l] += g * u[j];
                    pw[l] += g * Spd[j];
#if !defined(LA_ROWSUMS_BATCH)
                    dva[j] += kd * g;
                    dua[j] += bd * g;
#endif
                }
            }
#if defined(LA_ROWSUMS_BATCH)
            const int64_t rr = d % FN(RW_R);
            if (has_next) FN(rw_half)(pa, hb[0][rr]);
            FN(rw_half)(pr, hb[1][rr]);
            FN(rw_half)(pk, hb[2][rr]);
            FN(rw_half)(pb, hb[3][rr]);
            FN(rw_half)(pw, hb[4][rr]);
            if (rr == FN(RW_R) - 1) {
                for (int i = has_next ? 0 : 1; i < 5; i++)
                    FN(la_rowsums_add)((const REAL(*)[FN(RW_R)])hb[i], dst[i] + d - rr);
            }
            continue;
#else
            if (has_next) sa = FN(rw_lanes_sum)(pa);
            sr = FN(rw_lanes_sum)(pr);
            sk = FN(rw_lanes_sum)(pk);
            sb = FN(rw_lanes_sum)(pb);
            sw = FN(rw_lanes_sum)(pw);
#endif
        } else {
            LA_SIMD_SUM(sa, sr, sk, sb, sw) for (int64_t j = 0; j < nw; j++) {
                const REAL s = Std[j];
                REAL g = Gd[j];
                if (has_next) {
                    sa += s * dun[j];
                    g = ed * g + ad * dun[j];
                }
                g += rd * dout[j];
                Gd[j] = g;
                sr += s * dout[j];
                sk += g * v[j];
                sb += g * u[j];
                sw += g * Spd[j];
                dva[j] += kd * g;
                dua[j] += bd * g;
            }
        }
        if (has_next) dan[d] += sa;
        dr[d] += sr;
        dk[d] += sk;
        db[d] += sb;
        dw[d] += sw;
    }
#if defined(LA_ROWSUMS_BATCH)
    if (nw % FN(RW_L) == 0) {
        for (int64_t d = K - K % FN(RW_R); d < K; d++) {
            for (int i = has_next ? 0 : 1; i < 5; i++) dst[i][d] += FN(rw_half_sum)(hb[i][d % FN(RW_R)]);
        }
        /* dv and du from the new rows in a second pass (the same products in the same order over d): in the first
           their 4 accumulators did not fit the 16 registers beside the 8 of the columns read */
        for (int64_t d = 0; d < K; d++) {
            const REAL *restrict Gd = G + d * V;
            const REAL kd = k[d], bd = b[d];
            LA_SIMD for (int64_t j = 0; j < nw; j++) {
                dva[j] += kd * Gd[j];
                dua[j] += bd * Gd[j];
            }
        }
    }
#endif
    LA_SIMD for (int64_t j = 0; j < nw; j++) {
        dv[j] = dva[j];
        du[j] = dua[j];
    }
}

/* token t (and t+1's second half when has_next) over every column block; has_next is a constant at each call */
LA_INLINE void FN(rw_back_token)(int64_t K, int64_t V, REAL *G, const REAL *St, const REAL *Sp, const REAL *u,
                                 const REAL *v, const REAL *dout, const REAL *r, const REAL *k, const REAL *b,
                                 REAL scale, const REAL *en, const REAL *an, const REAL *dun, REAL *dan, int has_next,
                                 REAL *dr, REAL *dk, REAL *db, REAL *dw, REAL *dv, REAL *du) {
    int64_t j0 = 0;
    for (; j0 + FN(RW_VBB) <= V; j0 += FN(RW_VBB))
        FN(rw_back_cols)(K, V, FN(RW_VBB), G + j0, St + j0, Sp + j0, u + j0, v + j0, dout + j0, r, k, b, scale, en,
                         an, has_next ? dun + j0 : NULL, dan, has_next, dr, dk, db, dw, dv + j0, du + j0);
    if (j0 < V)
        FN(rw_back_cols)(K, V, V - j0, G + j0, St + j0, Sp + j0, u + j0, v + j0, dout + j0, r, k, b, scale, en, an,
                         has_next ? dun + j0 : NULL, dan, has_next, dr, dk, db, dw, dv + j0, du + j0);
}

/* the second half of a sequence's first token s: da_s = S_{s-1} du_s, G <- Diag(e_s) G + a_s du_s^T (dL/dS0) */
static void FN(rw_back_first)(int64_t K, int64_t V, REAL *restrict G, const REAL *restrict S0,
                              const REAL *restrict e, const REAL *restrict a, const REAL *restrict du,
                              REAL *restrict da) {
    for (int64_t d = 0; d < K; d++) {
        REAL *restrict Gd = G + d * V;
        const REAL *restrict Sd = S0 + d * V;
        const REAL ed = e[d], ad = a[d];
        REAL sa = 0;
        LA_SIMD_SUM(sa) for (int64_t j = 0; j < V; j++) {
            sa += Sd[j] * du[j];
            Gd[j] = ed * Gd[j] + ad * du[j];
        }
        da[d] = sa;
    }
}

/* dS [N, H, K, V] enters as dL/dS_final (zeros when the final state has no gradient) and leaves as dL/dS0; dout
   [TT, H, V] (zeros when the outputs have none). dw is dL/dw (the chain rule through e = exp(w) included).
   Returns -1 when scratch memory is missing. */
int FN(linattn_rwkv7_bwd)(int64_t N, int64_t H, int64_t K, int64_t V, const int64_t *starts, const REAL *r,
                          const REAL *e, const REAL *k, const REAL *v, const REAL *a, const REAL *b, double scale,
                          const REAL *ckpt, const int64_t *ck_off, int64_t chunk, const REAL *dout, REAL *dS_all,
                          REAL *dr, REAL *dk, REAL *dv, REAL *da, REAL *db, REAL *dw, int nthreads) {
    const int64_t KV = K * V;
    const REAL sc = (REAL)scale;
    int failed = 0;
    RW_PARALLEL_FOR(nthreads)
    for (int64_t task = 0; task < N * H; task++) {
        const int64_t n = task / H, h = task % H;
        const int64_t s = starts[n], L = starts[n + 1] - s;
        REAL *restrict G = dS_all + task * KV;
        if (L <= 0) continue;
        /* a stretch's states S_{t0-1} .. S_{t0+Lc-1} and reads u; du of this and the next token ([V] each); the
           row sums of this token (dr, dk, db, dw) and of the next (da) ([K] each) */
        REAL *Sbuf = (REAL *)malloc((size_t)((chunk + 1) * KV + chunk * V + 2 * V + 5 * K) * sizeof(REAL));
        if (Sbuf == NULL) {
            LA_ATOMIC_WRITE failed = 1;
            continue;
        }
        REAL *ubuf = Sbuf + (chunk + 1) * KV, *du = ubuf + chunk * V, *dun = du + V;
        REAL *sr = dun + V, *sk = sr + K, *sb = sk + K, *sw = sb + K, *san = sw + K;
        for (int64_t c = (L + chunk - 1) / chunk - 1; c >= 0; c--) {
            const int64_t t0 = s + c * chunk, Lc = (L - c * chunk) < chunk ? (L - c * chunk) : chunk;
            memcpy(Sbuf, ckpt + ((ck_off[n] + c) * H + h) * KV, (size_t)KV * sizeof(REAL));
            if (FN(rw_scan)(H, K, V, h, t0, Lc, r, e, k, v, a, b, sc, Sbuf, Sbuf, NULL, ubuf, NULL, chunk) != 0) {
                LA_ATOMIC_WRITE failed = 1;
                break;
            }
            for (int64_t i = Lc - 1; i >= 0; i--) {
                const int64_t th = (t0 + i) * H + h, tn = th + H;
                const int64_t tk = th * K, tv = th * V;
                const int has_next = t0 + i + 1 < s + L;
                for (int64_t d = 0; d < K; d++) sr[d] = sk[d] = sb[d] = sw[d] = san[d] = 0;
                REAL *tmp = du; /* the next token's du (written by the previous iteration) becomes dun */
                du = dun;
                dun = tmp;
                const REAL *St = Sbuf + (i + 1) * KV, *Sp = Sbuf + i * KV, *u = ubuf + i * V;
                if (has_next)
                    FN(rw_back_token)(K, V, G, St, Sp, u, v + tv, dout + tv, r + tk, k + tk, b + tk, sc, e + tn * K,
                                      a + tn * K, dun, san, 1, sr, sk, sb, sw, dv + tv, du);
                else
                    FN(rw_back_token)(K, V, G, St, Sp, u, v + tv, dout + tv, r + tk, k + tk, b + tk, sc, NULL, NULL,
                                      NULL, san, 0, sr, sk, sb, sw, dv + tv, du);
                if (has_next) memcpy(da + tn * K, san, (size_t)K * sizeof(REAL));
                for (int64_t d = 0; d < K; d++) {
                    dr[tk + d] = sc * sr[d];
                    dk[tk + d] = sk[d];
                    db[tk + d] = sb[d];
                    dw[tk + d] = e[tk + d] * sw[d];
                }
            }
        }
        if (!failed) { /* Sbuf holds the first stretch: Sbuf[0] = S_{s-1}, the initial state */
            const int64_t ts = (s * H + h) * K;
            FN(rw_back_first)(K, V, G, Sbuf, e + ts, a + ts, du, da + ts);
        }
        free(Sbuf);
    }
    return failed ? -1 : 0;
}

#endif
