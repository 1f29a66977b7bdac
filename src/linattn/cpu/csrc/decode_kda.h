/* KDA (Kimi Delta Attention, layers/delta_family.KDA) as block kind 4 of the compiled decode: the delta rule with
   a decay per key channel. Included by decode.c's body once per REAL (its FN / MATH / REAL and the body's
   helpers: conv, delta_prepare_qk, delta_write_read, weight_product).

   y [B, ny] = W rmsnorm1(x) + Wb = [q H*K | k H*K | v HV*V | b HV | f1 rank_f | gate: HV*V, or g1 rank_g]
   (q, k, v before the short convolution; rank_f 0: a full-rank gate, f1 is f itself, HV*K wide, Bailing's). Per
   token, as the layer's general path (DeltaNet._mix with KDA's log_gate, then AttentionBase._out):

       f = Wf f1 + dt_bias    (full rank: f1 + dt_bias)     [HV, K]
       g = neg_a softplus(f), or gate_lb sigmoid(-neg_a f)  (neg_a = -exp(A_log) per value head)
       S = diag(exp(g)) S;  S += a k (v / d - k^T S)^T      (q, k l2-normalised, the key-norm rescaling d, a =
                                                             sigmoid(b) d^2, as the delta kind 0)
       o = RMSNorm(S^T q) * act(gate)                       (gate = Wg2 g1 + bg2 when low-rank; act silu / sigmoid)

   The state [B, HV, K, V] is the general path's cache entry as it is. Returns 0, or 1 when out of memory. */

static int FN(kda_mix)(const linattn_block_plan *p, const REAL *y, const REAL *w_in, const REAL *S_in,
                       REAL *w_out, REAL *S_out, REAL *out, REAL *w_io) {
    const int64_t B = p->B, H = p->H, HV = p->HV, K = p->K, V = p->V, ny = p->ny, G = HV / H;
    const int64_t C = 2 * H * K + HV * V, rf = p->rank_f, rg = p->rank_g;
    const int64_t off_b = C, off_f = C + HV, off_g = off_f + (rf ? rf : HV * K);
    /* work: u (q | k | v prepared) [B, C], the gate's inputs and outputs, then d2 / lam per (b, h) */
    const int64_t nwork = B * (C + rf + HV * K + rg + (rg ? HV * V : 0));
    REAL *u = (REAL *)malloc(sizeof(REAL) * (size_t)(nwork + 1));
    double *dd = (double *)malloc(sizeof(double) * (size_t)(2 * B * H + 1));
    if (!u || !dd) { free(u); free(dd); return 1; }
    REAL *xf = u + B * C, *f = xf + B * rf, *xg = f + B * HV * K, *gg = xg + B * rg;
    if (p->KC > 0 && w_io)   /* (transformers' conv state read and advanced in place: decode.c conv_io) */
        FN(conv_io)(B, C, p->KC, y, ny, w_io, (const REAL *)p->cw, (const REAL *)p->cb, p->conv_act, u);
    else if (p->KC > 0)
        FN(conv)(B, C, p->KC, y, ny, w_in, (const REAL *)p->cw, (const REAL *)p->cb, p->conv_act, w_out, u);
    else for (int64_t b = 0; b < B; ++b) memcpy(u + b * C, y + b * ny, sizeof(REAL) * (size_t)C);
    FN(delta_prepare_qk)(B, H, K, C, u, 0, p->l2conv, 0, p->l2eps, p->scale, dd);
    /* the low-rank second stages read contiguous rows (a full-rank gate: f's rows as they are) */
    for (int64_t b = 0; b < B; ++b) {
        if (rf) memcpy(xf + b * rf, y + b * ny + off_f, sizeof(REAL) * (size_t)rf);
        else memcpy(f + b * HV * K, y + b * ny + off_f, sizeof(REAL) * (size_t)(HV * K));
        if (rg) memcpy(xg + b * rg, y + b * ny + off_g, sizeof(REAL) * (size_t)rg);
    }
    if (rf) FN(weight_product)(WEIGHT_FORMAT(p->wbf16, p->fmt_Wf), p->sc_Wf, p->grp_Wf,
            B, HV * K, rf, p->Wf, NULL, xf, NULL, f, p->nthreads);
    if (rg) FN(weight_product)(WEIGHT_FORMAT(p->wbf16, p->fmt_Wg2), p->sc_Wg2, p->grp_Wg2,
            B, HV * V, rg, p->Wg2, (const REAL *)p->bg2, xg, NULL, gg, p->nthreads);
    const REAL *neg_a = (const REAL *)p->neg_a, *dt_bias = (const REAL *)p->dt_bias, *nw = (const REAL *)p->nw;
    const REAL lb = (REAL)p->gate_lb;
    const int64_t nb = B * HV;
    const int par = nb > 1 && nb * K * V >= PAR_MIN_ELEMS;
#pragma omp parallel for num_threads(p->nthreads) schedule(static) if(par)
    for (int64_t t = 0; t < nb; ++t) {
        const int64_t b = t / HV, hv = t % HV, h = hv / G;
        const REAL *q = u + b * C + h * K, *k = u + b * C + H * K + h * K, *v = u + b * C + 2 * H * K + hv * V;
        const REAL *ft = f + t * K, *bt = dt_bias + hv * K;
        const double d2 = dd[2 * (b * H + h)];
        const REAL d = (REAL)sqrt(d2), na = neg_a[hv];
        const REAL beta = (REAL)1 / ((REAL)1 + MATH(exp)(-y[b * ny + off_b + hv]));
        const REAL ar = (REAL)((double)beta * d2);
        const REAL *S0 = S_in ? S_in + t * K * V : NULL;
        REAL *S = S_out + t * K * V;
        REAL *o = out + t * V;
        /* o is scratch for err = a (v / d) - a (k^T (diag(decay) S0)) first */
        for (int64_t j = 0; j < V; ++j) o[j] = 0;
        if (S0) {
            for (int64_t i = 0; i < K; ++i) {
                const REAL fv = ft[i] + bt[i];
                const REAL g = p->gate_lb_on ? lb * ((REAL)1 / ((REAL)1 + MATH(exp)(-(-na * fv))))
                                             : na * FN(softplus)(fv);
                const REAL decay = MATH(exp)(g), ki = k[i];
                const REAL *restrict s0 = S0 + i * V;
                REAL *restrict s = S + i * V;
#pragma omp simd
                for (int64_t j = 0; j < V; ++j) { const REAL sv = s0[j] * decay; s[j] = sv; o[j] += ki * sv; }
            }
        } else memset(S, 0, sizeof(REAL) * (size_t)(K * V));
        FN(delta_write_read)(K, V, q, k, v, d, ar, S, o);
        if (p->has_norm) {
            const REAL r = FN(la_rms_rstd)(o, V, (REAL)p->norm_eps);
            for (int64_t j = 0; j < V; ++j) o[j] = o[j] * r * (nw ? nw[j] : (REAL)1);
        }
        const REAL *gate = rg ? gg + t * V : p->has_gate ? y + b * ny + off_g + hv * V : NULL;
        if (gate)
            for (int64_t j = 0; j < V; ++j) o[j] *= p->gate_sig ? FN(la_sigmoid)(gate[j]) : FN(la_silu)(gate[j]);
    }
    free(u); free(dd);
    return 0;
}
