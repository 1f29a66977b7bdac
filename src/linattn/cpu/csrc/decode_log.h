/* The whole-block / whole-model decode of linear attention with a log-space feature map (block kind 3): ELA's
   Hadamard Exp (ela_map 0: phi(q) = scale q, psi(k) = k as log-features, K_phi = K). Included by decode.c inside
   its body, once per REAL; its mixer step is FN(decode_linear_log), which linattn_decode_block dispatches to.

   The state of a value head is [K, V + 2]: the kv columns, z, then the per-feature log-scale mu (the true state is
   exp(mu) [kv | z], ops/linear_recurrent.py's convention), so a layer's state is one [B, HV, K, V + 2] block of the
   step's buffer. The token update is log_state.h's (the chunk kernels' own: the same bits as linear_attention's
   compiled forms and the per-layer step, layers/fast_decode_log.py); mu is read into a contiguous row for it and
   written back. Gates: none, RetNet's constant one (log_decay [HV], log gamma: gate_kind 1) and Mamba2's scalar one
   (gate_kind 2: neg_a, dt_bias, as the linear kind). normalize: num / max(den, eps) (den is the stabilised
   denominator, >= 1 for these positive kernels); else num exp(c) in double, as the operator. Then the output
   RMSNorm and SiLU gate (outnorm), as every kind. The new state goes to S_out (S_in is never written). */
#include "log_state.h"

/* y [B, ldy] = [q H*K | k H*K | v HV*V | a HV (gate_kind 2) | gate HV*V (has_gate)] -> out [B, HV*V]; S_in
   [B, HV, K, V + 2] (NULL: empty) -> S_out. Returns 0, or 1 when out of memory. */
static int FN(decode_linear_log)(const linattn_block_plan *p, const REAL *y, int64_t ldy, const REAL *w_in,
                                 REAL *w_out, const REAL *S_in, REAL *S_out, REAL *out) {
    const int64_t B = p->B, H = p->H, HV = p->HV, K = p->K, V = p->V, KC = p->KC;
    const int64_t C = 2 * H * K + HV * V, G = HV / H, ld = V + 2;
    REAL *u = (REAL *)malloc(sizeof(REAL) * (size_t)(B * C + 1));
    if (!u) return 1;
    if (KC > 0) FN(conv)(B, C, KC, y, ldy, w_in, (const REAL *)p->cw, (const REAL *)p->cb, p->conv_act, w_out, u);
    else for (int64_t b = 0; b < B; ++b) memcpy(u + b * C, y + b * ldy, sizeof(REAL) * (size_t)C);
    if (p->scale != 1.0)
        for (int64_t b = 0; b < B; ++b)
            for (int64_t i = 0; i < H * K; ++i) u[b * C + i] = u[b * C + i] * (REAL)p->scale;
    const REAL *log_decay = (const REAL *)p->log_decay, *neg_a = (const REAL *)p->neg_a;
    const REAL *dt_bias = (const REAL *)p->dt_bias, *nw = (const REAL *)p->nw;
    const int64_t nb = B * HV;
    const int par = nb > 1 && nb * K * ld >= PAR_MIN_ELEMS;
    int failed = 0;
#pragma omp parallel num_threads(p->nthreads) if(par)
    {
        REAL *scr = (REAL *)malloc(sizeof(REAL) * (size_t)(4 * K + 1)); /* mu, then the token's f, e, wq */
        if (!scr) {
            LA_ATOMIC_WRITE
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < nb; ++t) {
            if (!scr) continue;
            const int64_t b = t / HV, hv = t % HV, h = hv / G;
            const REAL *lq = u + b * C + h * K, *lk = u + b * C + H * K + h * K, *v = u + b * C + 2 * H * K + hv * V;
            REAL g = 0;
            if (p->gate_kind == 1) g = log_decay[hv];
            else if (p->gate_kind == 2) g = neg_a[hv] * FN(softplus)(y[b * ldy + C + hv] + dt_bias[hv]);
            REAL *S = S_out + t * K * ld, *mu = scr;
            if (S_in) {
                memcpy(S, S_in + t * K * ld, sizeof(REAL) * (size_t)(K * ld));
                for (int64_t d = 0; d < K; ++d) mu[d] = S[d * ld + V + 1];
            } else {
                memset(S, 0, sizeof(REAL) * (size_t)(K * ld));
                for (int64_t d = 0; d < K; ++d) mu[d] = (REAL)-1e30; /* an empty state's log-scale */
            }
            REAL *o = out + t * V, den;
            const REAL c = FN(ls_token)(S, ld, mu, lk, v, g, lq, scr + K, scr + 2 * K, scr + 3 * K, o, &den, K, V);
            for (int64_t d = 0; d < K; ++d) S[d * ld + V + 1] = mu[d];
            if (p->normalize) {
                const REAL e = (REAL)p->eps, dn = den < e ? e : den; /* (NaN stays NaN) */
                for (int64_t j = 0; j < V; ++j) o[j] = o[j] / dn;
            } else {
                const double s = exp((double)c); /* exp(c) alone may overflow where the product does not */
                for (int64_t j = 0; j < V; ++j) o[j] = (REAL)((double)o[j] * s);
            }
            FN(outnorm)(o, V, p->has_norm, nw, p->norm_eps, p->has_gate ? y + b * ldy + ldy - HV * V + hv * V : NULL);
        }
        free(scr);
    }
    free(u);
    return failed;
}
