/* Lightning attention (kind 8 of the block plan) for one decoded token, as transformers' MiniMax computes it
   (`MiniMaxLightningAttention`'s cached step), on y = W rmsnorm1(x), the block's fused first product:

       y = [qkv (H 3K: per head q_h | k_h | v_h, K each) | gate (H K)]      (qkv_proj's rows, then output_gate's)
       q_h, k_h, v_h = silu(.)                                              (no scale, no normaliser)
       S_h = decay_h S0_h + k_h v_h^T,   o_h = S_h^T q_h                     (state [K, V] per head, transformers'
                                                                             [B, H, K, V]; decay_h = exp(-slope_h))
       o = rmsnorm(o over all heads together, nw [H V], norm_eps) * sigmoid(gate)

   then o_proj (the block's Wo). The state update and read-out are the linear kind's, without its z column
   (the cache's own tensor is the plan's state). Unlike the other kinds' per-head output norms, the norm here is
   one RMSNorm over the H V outputs of a row. Included by decode.c's body once per REAL. */

static int FN(lightning_mix)(const linattn_block_plan *p, const REAL *y, const REAL *S_in, REAL *S_out, REAL *o) {
    const int64_t B = p->B, H = p->H, K = p->K, V = p->V, ny = p->ny, nb = B * H;
    const REAL *decay = (const REAL *)p->decay;
    const int par = nb > 1 && nb * K * V >= PAR_MIN_ELEMS;
#pragma omp parallel for num_threads(p->nthreads) schedule(static) if(par)
    for (int64_t t = 0; t < nb; ++t) {
        const int64_t b = t / H, h = t % H;
        const REAL *yh = y + b * ny + h * (2 * K + V);
        REAL q[K], k[K], v[V];
        for (int64_t i = 0; i < K; ++i) q[i] = FN(la_silu)(yh[i]);
        for (int64_t i = 0; i < K; ++i) k[i] = FN(la_silu)(yh[K + i]);
        for (int64_t j = 0; j < V; ++j) v[j] = FN(la_silu)(yh[2 * K + j]);
        const REAL *S0 = S_in ? S_in + t * K * V : NULL;
        REAL *S = S_out + t * K * V, *restrict ob = o + t * V;
        const REAL dec = decay[h];
        for (int64_t j = 0; j < V; ++j) ob[j] = 0;
        for (int64_t i = 0; i < K; ++i) {
            const REAL *restrict s0 = S0 ? S0 + i * V : NULL;
            REAL *restrict s = S + i * V;
            const REAL ki = k[i], qi = q[i];
            if (s0) {
#pragma omp simd
                for (int64_t j = 0; j < V; ++j) s[j] = dec * s0[j] + ki * v[j];
            } else {
#pragma omp simd
                for (int64_t j = 0; j < V; ++j) s[j] = ki * v[j];
            }
#pragma omp simd
            for (int64_t j = 0; j < V; ++j) ob[j] += qi * s[j];
        }
    }
    const int64_t no = H * V;
    FN(rmsnorm)(B, no, o, (const REAL *)p->nw, p->norm_eps, o);
    for (int64_t b = 0; b < B; ++b) {
        const REAL *restrict g = y + b * ny + H * (2 * K + V);
        REAL *restrict ob = o + b * no;
        for (int64_t j = 0; j < no; ++j) ob[j] = ob[j] * ((REAL)1 / ((REAL)1 + MATH(exp)(-g[j])));
    }
    return 0;
}
