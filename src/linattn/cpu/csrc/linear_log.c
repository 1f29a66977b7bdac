/* Causal linear attention of the log-space feature maps (ELA's Hadamard Exp, FAVOR+): forward, backward and the
   one-token decoding step, compiled. The features arrive as logarithms (lq = log phi(scale q), lk = log psi(k),
   computed in PyTorch so that autograd differentiates the map), with an optional scalar log-gate g per token and
   head. The true state A_t = exp(g_t) A_{t-1} + exp(lk_t) [v_t | 1]^T is kept in log-scale form, A = exp(mu) S
   per feature, mu the running maximum of the decayed key log-features (ops/linear_recurrent.py's convention and
   ops/linear_chunk_log.py's at block ends), and each output row relative to its own log-scale
   c_t = max_d (lq_td + mu_td):

     num_t = sum_d exp(lq_td + mu_td - c_t) S_t[d, :V],   den_t = sum_d exp(lq_td + mu_td - c_t) S_t[d, V].

   Every exponent the kernels take is <= 0, so features spanning any range of magnitudes (the reason for log
   space) neither overflow nor lose the rows that matter. The state is updated token by token (the rescale of a
   feature's row only when a key raises its maximum: a factor exp(0) = 1 would leave its bits as they are), so a
   row depends only on the tokens up to it, to the bit. The work per token is two passes over the
   [K_phi, V + 1] state, like the state part of a chunk form; there is no intra-chunk matrix to build.

   Backward: the gradient of the true state, G_t = dL/dA_t, is carried backwards in the same log-scale form,
   G = exp(nu) R with nu_d the running maximum of lq_id - c_i (decayed), so every factor of the gradients is again
   exp(<= 0): dv_t = sum_d exp(lk_td + nu_d) R_d[:V], dlk_td = exp(lk_td + nu_d) R_d . [v_t | 1],
   dlq_td = exp(lq_td + mu_td - c_t) dy_t . S_t[d], dg_t = sum_d exp(g_t + mu_{t-1,d} + nu_d) S_{t-1}[d] . R_d.
   The forward keeps the state at the start of each chunk of C tokens; the backward recomputes a chunk's states
   from it (the forward's own arithmetic: the same bits) and walks the chunk backwards.

   Features wider than LL_MAX_FEATURES are refused (return code 2): the backward keeps a chunk's states,
   (C + 1) K_phi (V + 1) values per thread, and the dispatch (ops/linear.py) falls back to PyTorch before that.
   Parallel over (sequence, head) pairs. float and double from one body (this file includes itself per REAL). */
#ifndef LINATTN_LINEAR_LOG_BODY
#define LINATTN_LINEAR_LOG_BODY

#include "common.h"

LA_ABI_VERSION(linear_log, 1)

#define LL_MAX_FEATURES 4096
#define LL_NEG (-1e30) /* the log-scale of an empty state (ops/linear_common.py's NEG) */
/* tokens ahead whose rows are prefetched: a (sequence, head) walks its rows H K apart, a few per page, which the
   hardware prefetchers follow poorly; without it the scan waited on memory at every token (16k tokens) */
#define LL_AHEAD 8

/* the bytes at x into the cache, one 64-byte line at a time */
static inline void ll_prefetch(const void *x, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) LA_PREFETCH((const char *)x + o, 0);
}

/* shapes, sequence offsets (N + 1 rows of packed sequences), the checkpoint interval C (tokens), threads */
typedef struct {
    int64_t N, H, K, V, C;
    const int64_t *starts;
    int32_t nthreads, pad_;
} linattn_linear_log_plan;
LA_EXPORT_SIZEOF(linear_log_plan)

/* index of each sequence's first checkpoint (first[N] = the number of checkpoints) */
static void ll_first_chunks(const linattn_linear_log_plan *p, int64_t *first) {
    int64_t nc = 0;
    for (int64_t s = 0; s < p->N; ++s) {
        first[s] = nc;
        const int64_t len = p->starts[s + 1] - p->starts[s];
        nc += (len + p->C - 1) / p->C;
    }
    first[p->N] = nc;
}

int64_t linattn_linear_log_nchunks(int64_t N, const int64_t *starts, int64_t C) {
    int64_t nc = 0;
    for (int64_t s = 0; s < N; ++s) nc += (starts[s + 1] - starts[s] + C - 1) / C;
    return nc;
}

#define REAL float
#define FN(name) name##_f32
#include "linear_log.c"
#undef REAL
#undef FN

#define REAL double
#define FN(name) name##_f64
#include "linear_log.c"
#undef REAL
#undef FN

#else /* ------------------------------------------------------------------ the body, once per REAL */
#include "common.h"

#include "log_state.h" /* FN(ls_token): the token update, shared with the compiled decode */

/* lq, lk [TT, H, K], v [TT, H, V], g [TT, H] (NULL: no gate), S0 [N, H, K, W] and mu0 [N, H, K] (NULL: empty)
   -> num [TT, H, V], den [TT, H], c [TT, H], S [N, H, K, W], mu [N, H, K]; P [NC, H, K, W] and Pmu [NC, H, K]
   (NULL: not kept) the states at each chunk's start, for the backward. Returns 2 when K > LL_MAX_FEATURES. */
int FN(linattn_linear_log_fwd)(const linattn_linear_log_plan *p, const REAL *lq, const REAL *lk, const REAL *v,
                               const REAL *g, const REAL *S0, const REAL *mu0, REAL *num, REAL *den, REAL *c,
                               REAL *S, REAL *mu, REAL *P, REAL *Pmu) {
    const int64_t N = p->N, H = p->H, K = p->K, V = p->V, C = p->C, W = V + 1;
    if (K > LL_MAX_FEATURES) return 2;
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(N + 1));
    if (!first) return 1;
    ll_first_chunks(p, first);
    int failed = 0;
#pragma omp parallel num_threads(p->nthreads)
    {
        REAL *buf = (REAL *)malloc(sizeof(REAL) * (size_t)(3 * K + 1));
        if (!buf) {
            LA_ATOMIC_WRITE
            failed = 1;
        }
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t s = 0; s < N; ++s)
            for (int64_t h = 0; h < H; ++h) {
                if (!buf) continue;
                REAL *wq = buf, *fk = wq + K, *ek = fk + K;
                REAL *St = S + (s * H + h) * K * W, *mt = mu + (s * H + h) * K;
                if (S0) {
                    memcpy(St, S0 + (s * H + h) * K * W, sizeof(REAL) * (size_t)(K * W));
                } else {
                    memset(St, 0, sizeof(REAL) * (size_t)(K * W));
                }
                for (int64_t d = 0; d < K; ++d) mt[d] = mu0 ? mu0[(s * H + h) * K + d] : (REAL)LL_NEG;
                int64_t chunk = first[s];
                for (int64_t t = p->starts[s]; t < p->starts[s + 1]; ++t) {
                    if (P && (t - p->starts[s]) % C == 0) {
                        memcpy(P + (chunk * H + h) * K * W, St, sizeof(REAL) * (size_t)(K * W));
                        memcpy(Pmu + (chunk * H + h) * K, mt, sizeof(REAL) * (size_t)K);
                        ++chunk;
                    }
                    const int64_t r = t * H + h;
                    if (t + LL_AHEAD < p->starts[s + 1]) {
                        const int64_t ra = r + LL_AHEAD * H;
                        ll_prefetch(lq + ra * K, K * (int64_t)sizeof(REAL));
                        ll_prefetch(lk + ra * K, K * (int64_t)sizeof(REAL));
                        ll_prefetch(v + ra * V, V * (int64_t)sizeof(REAL));
                    }
                    c[r] = FN(ls_token)(St, W, mt, lk + r * K, v + r * V, g ? g[r] : (REAL)0, lq + r * K, fk, ek, wq,
                                        num + r * V, den + r, K, V);
                }
            }
        free(buf);
    }
    free(first);
    return failed;
}

/* The backward of linattn_linear_log_fwd. dnum [TT, H, V], dden [TT, H] (NULL: zero), dS [N, H, K, W] (NULL:
   zero; the gradient of the returned S, its mu held constant) with mu_end [N, H, K] the forward's final mu,
   c [TT, H] the forward's row log-scales -> dlq, dlk [TT, H, K], dv [TT, H, V], dg [TT, H] (with g), dS0
   [N, H, K, W] (the gradient of S0, its mu0 held constant; NULL: not wanted). */
int FN(linattn_linear_log_bwd)(const linattn_linear_log_plan *p, const REAL *lq, const REAL *lk, const REAL *v,
                               const REAL *g, const REAL *mu0, const REAL *c, const REAL *P, const REAL *Pmu,
                               const REAL *mu_end, const REAL *dnum, const REAL *dden, const REAL *dS, REAL *dlq,
                               REAL *dlk, REAL *dv, REAL *dg, REAL *dS0) {
    const int64_t N = p->N, H = p->H, K = p->K, V = p->V, C = p->C, W = V + 1;
    if (K > LL_MAX_FEATURES) return 2;
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(N + 1));
    if (!first) return 1;
    ll_first_chunks(p, first);
    int failed = 0;
#pragma omp parallel num_threads(p->nthreads)
    {
        /* the chunk's states after each token (slot 0: before its first), their mu, R, nu, [v | 1], dy, and the
           token step's scratch */
        const size_t n = (size_t)((C + 1) * K * W + (C + 1) * K + K * W + 4 * K + 3 * W);
        REAL *buf = (REAL *)malloc(sizeof(REAL) * n);
        if (!buf) {
            LA_ATOMIC_WRITE
            failed = 1;
        }
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t s = 0; s < N; ++s)
            for (int64_t h = 0; h < H; ++h) {
                if (!buf) continue;
                REAL *Sc = buf, *mc = Sc + (C + 1) * K * W, *R = mc + (C + 1) * K, *nu = R + K * W, *v1 = nu + K,
                     *dy = v1 + W, *yk = dy + W, *fk = yk + W, *ek = fk + K, *wq = ek + K;
                const int64_t a = p->starts[s], b = p->starts[s + 1], sh = s * H + h;
                /* the gradient of the final state: G = exp(-mu_end) dS, features with no state at all aside */
                for (int64_t d = 0; d < K; ++d) {
                    const REAL me = mu_end[sh * K + d];
                    const int live = dS && me > (REAL)(LL_NEG / 2);
                    nu[d] = live ? -me : (REAL)LL_NEG;
                    for (int64_t w = 0; w < W; ++w) R[d * W + w] = live ? dS[(sh * K + d) * W + w] : (REAL)0;
                }
                const int64_t nch = (b - a + C - 1) / C;
                for (int64_t ci = nch - 1; ci >= 0; --ci) {
                    const int64_t t0 = a + ci * C, t1 = t0 + C < b ? t0 + C : b;
                    memcpy(Sc, P + ((first[s] + ci) * H + h) * K * W, sizeof(REAL) * (size_t)(K * W));
                    memcpy(mc, Pmu + ((first[s] + ci) * H + h) * K, sizeof(REAL) * (size_t)K);
                    for (int64_t t = t0; t < t1; ++t) { /* the forward's states, recomputed */
                        const int64_t r = t * H + h, j = t - t0;
                        memcpy(Sc + (j + 1) * K * W, Sc + j * K * W, sizeof(REAL) * (size_t)(K * W));
                        memcpy(mc + (j + 1) * K, mc + j * K, sizeof(REAL) * (size_t)K);
                        FN(ls_token)(Sc + (j + 1) * K * W, W, mc + (j + 1) * K, lk + r * K, v + r * V,
                                     g ? g[r] : (REAL)0, lq + r * K, fk, ek, wq, yk, yk + V, K, V);
                    }
                    for (int64_t t = t1 - 1; t >= t0; --t) {
                        const int64_t r = t * H + h, j = t - t0;
                        const REAL *St = Sc + (j + 1) * K * W, *mt = mc + (j + 1) * K;
                        const REAL *Sp = Sc + j * K * W, *mp = mc + j * K;
                        const REAL *lqt = lq + r * K, *lkt = lk + r * K, ct = c[r];
                        for (int64_t w = 0; w < V; ++w) dy[w] = dnum[r * V + w];
                        dy[V] = dden ? dden[r] : (REAL)0;
                        memcpy(v1, v + r * V, sizeof(REAL) * (size_t)V);
                        v1[V] = 1;
                        /* this row's own term into G_t, and dlq from the forward state after t */
                        for (int64_t d = 0; d < K; ++d) {
                            const REAL *restrict row = St + d * W;
                            REAL dot = 0;
                            LA_SIMD_SUM(dot)
                            for (int64_t w = 0; w < W; ++w) dot += dy[w] * row[w];
                            dlq[r * K + d] = FN(la_exp)(lqt[d] + mt[d] - ct) * dot;
                            const REAL x = lqt[d] - ct;
                            REAL *restrict Rd = R + d * W;
                            if (x > nu[d]) {
                                const REAL f = FN(la_exp)(nu[d] - x);
                                LA_SIMD
                                for (int64_t w = 0; w < W; ++w) Rd[w] = Rd[w] * f + dy[w];
                                nu[d] = x;
                            } else {
                                const REAL e = FN(la_exp)(x - nu[d]);
                                LA_SIMD
                                for (int64_t w = 0; w < W; ++w) Rd[w] += e * dy[w];
                            }
                        }
                        /* dv, dlk from G_t; dg from the state before t */
                        REAL *restrict dvr = dv + r * V;
                        for (int64_t w = 0; w < V; ++w) dvr[w] = 0;
                        const REAL gt = g ? g[r] : (REAL)0;
                        REAL dgt = 0;
                        for (int64_t d = 0; d < K; ++d) {
                            const REAL *restrict Rd = R + d * W;
                            const REAL e = FN(la_exp)(lkt[d] + nu[d]);
                            REAL dot = 0;
                            LA_SIMD_SUM(dot)
                            for (int64_t w = 0; w < W; ++w) dot += Rd[w] * v1[w];
                            dlk[r * K + d] = e * dot;
                            LA_SIMD
                            for (int64_t w = 0; w < V; ++w) dvr[w] += e * Rd[w];
                            if (g) {
                                const REAL *restrict row = Sp + d * W;
                                REAL sr = 0;
                                LA_SIMD_SUM(sr)
                                for (int64_t w = 0; w < W; ++w) sr += row[w] * Rd[w];
                                dgt += FN(la_exp)(gt + mp[d] + nu[d]) * sr;
                            }
                            nu[d] += gt; /* G_{t-1}'s part from here on: exp(g_t) G_t */
                        }
                        if (g) dg[r] = dgt;
                    }
                }
                if (dS0) {
                    for (int64_t d = 0; d < K; ++d) {
                        const REAL f = FN(la_exp)((mu0 ? mu0[sh * K + d] : (REAL)LL_NEG) + nu[d]);
                        for (int64_t w = 0; w < W; ++w) dS0[(sh * K + d) * W + w] = f * R[d * W + w];
                    }
                }
            }
        free(buf);
    }
    free(first);
    return failed;
}

#endif /* LINATTN_LINEAR_LOG_BODY */
