/* The whole-block / whole-model decode of linear attention with ELA's linear-space kernels (block kind 6): the
   squared-Euclidean sum / sub kernels ||a +- b||^2 (ela_map 1 / 2: phi(a) = [a, |a|^2, 1], psi(b) = [+-2 b, 1,
   |b|^2], K_phi = K + 2) and magnitude-direction (a.b + 1)(|a|^2 + 1)(|b|^2 + 1) (ela_map 3: phi = psi =
   (|a|^2 + 1) [a, 1], K_phi = K + 1), as ops/feature_maps.py defines them. Included by decode.c inside its body,
   once per REAL; FN(decode_linear_ela) is dispatched by linattn_decode_block.

   The features are built per (row, q/k head) from q scale and k, then the linear kind's recurrence on the [K_phi,
   V + 1] state [kv | z] (the step's "linear" layout): S = decay S + psi(k) [v | 1]^T, o = phi(q) S, the normaliser
   floored keeping its sign (these kernels' weights may be negative or zero: magnitude-direction's a.b + 1 < 0).
   Gates none, RetNet (decay [HV]) and Mamba2's scalar gate (neg_a, dt_bias), as the linear kind. */

/* x [K] (already scaled for a query) -> f [K_phi] */
static void FN(ela_features)(int map, int query, const REAL *restrict x, int64_t K, REAL *restrict f) {
    REAL ss = 0;
    for (int64_t i = 0; i < K; ++i) ss += x[i] * x[i];
    if (map == 3) {
        const REAL m = ss + (REAL)1;
        for (int64_t i = 0; i < K; ++i) f[i] = m * x[i];
        f[K] = m;
        return;
    }
    const REAL s = query ? (REAL)1 : (map == 1 ? (REAL)2 : (REAL)-2);
    for (int64_t i = 0; i < K; ++i) f[i] = s * x[i];
    f[K] = query ? ss : (REAL)1;
    f[K + 1] = query ? (REAL)1 : ss;
}

/* y [B, ldy] = [q H*K | k H*K | v HV*V | a HV (gate_kind 2) | gate HV*V (has_gate)] -> out [B, HV*V]; S_in
   [B, HV, K_phi, V + 1] (NULL: zeros) -> S_out. Returns 0, or 1 when out of memory. */
static int FN(decode_linear_ela)(const linattn_block_plan *p, const REAL *y, int64_t ldy, const REAL *w_in,
                                 REAL *w_out, const REAL *S_in, REAL *S_out, REAL *out) {
    const int64_t B = p->B, H = p->H, HV = p->HV, K = p->K, V = p->V, KC = p->KC;
    const int64_t C = 2 * H * K + HV * V, G = HV / H, V1 = V + 1, Kf = K + (p->ela_map == 3 ? 1 : 2);
    /* u: the conv's outputs [B, C], then the features phi(q), psi(k) [B, 2 H, K_phi] */
    REAL *u = (REAL *)malloc(sizeof(REAL) * (size_t)(B * C + 2 * B * H * Kf + 1));
    if (!u) return 1;
    REAL *feat = u + B * C;
    if (KC > 0) FN(conv)(B, C, KC, y, ldy, w_in, (const REAL *)p->cw, (const REAL *)p->cb, p->conv_act, w_out, u);
    else for (int64_t b = 0; b < B; ++b) memcpy(u + b * C, y + b * ldy, sizeof(REAL) * (size_t)C);
    for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < 2 * H; ++h) {
            REAL *x = u + b * C + h * K;
            if (h < H && p->scale != 1.0)
                for (int64_t i = 0; i < K; ++i) x[i] = x[i] * (REAL)p->scale;
            FN(ela_features)(p->ela_map, h < H, x, K, feat + (b * 2 * H + h) * Kf);
        }
    const REAL *decay_h = (const REAL *)p->decay, *neg_a = (const REAL *)p->neg_a, *dt_bias = (const REAL *)p->dt_bias;
    const int64_t nb = B * HV;
    const int par = nb > 1 && nb * Kf * V1 >= PAR_MIN_ELEMS;
#pragma omp parallel for num_threads(p->nthreads) schedule(static) if(par)
    for (int64_t t = 0; t < nb; ++t) {
        const int64_t b = t / HV, hv = t % HV, h = hv / G;
        const REAL *fq = feat + (b * 2 * H + h) * Kf, *fk = feat + (b * 2 * H + H + h) * Kf;
        const REAL *v = u + b * C + 2 * H * K + hv * V;
        REAL decay = 1;
        if (p->gate_kind == 1) decay = decay_h[hv];
        else if (p->gate_kind == 2) decay = MATH(exp)(neg_a[hv] * FN(softplus)(y[b * ldy + C + hv] + dt_bias[hv]));
        const REAL *S0 = S_in ? S_in + t * Kf * V1 : NULL;
        REAL *S = S_out + t * Kf * V1, *o = out + t * V;
        const REAL dn = FN(kv_z_step)(Kf, V, fq, fk, v, p->gate_kind, decay, S0, S, o);
        if (p->normalize) { /* a floor on |den| that keeps its sign, as the operator */
            const REAL den = FN(den_floor)(dn, (REAL)p->eps, 0);
            for (int64_t j = 0; j < V; ++j) o[j] = o[j] / den;
        }
        FN(outnorm)(o, V, p->has_norm, (const REAL *)p->nw, p->norm_eps,
                    p->has_gate ? y + b * ldy + ldy - HV * V + hv * V : NULL);
    }
    free(u);
    return 0;
}
