/* Mamba2's mixer (layers/mamba2.Mamba2Block) as block kind 5 of the compiled decode. Included by decode.c's body
   once per REAL (its FN / MATH / REAL and the body's conv and softplus).

   y [B, ny] = in_proj(rmsnorm1(x)) = [z DI | xBC DI + 2 G N | dt H] (DI = H * P; the plan's HV = H, K = N,
   V = P, n_groups = G). Per token, as Mamba2Block.forward with a cache:

       xBC = silu(conv(xBC))  (no conv: silu(xBC));  x [H, P] | B [G, N] | C [G, N]
       dt = clamp(softplus(dt + dt_bias), dt_lo, dt_hi),  decay = exp(dt neg_a)   (neg_a = -exp(A_log), per head)
       S = decay S + B_g [dt x | 1]^T                     (S [N, P + 1]: linear attention's [kv | z] state, head h
                                                           reading group g = h / (H / G))
       y = S[:, :P]^T C_g + D x
       o = RMSNorm_groups(y silu(z)) (norm_mode 1), RMSNorm_groups(y) silu(z) (2) or y silu(z) (0)

   The state [B, H, N, P + 1] is the general path's `LinearAttentionState` (kv | z) and the window [B, DI + 2 G N,
   KC - 1] its "conv" entry. With state_pn the state is [B, H, P, N] instead (transformers' ssm state: its cache
   tensor is read and written as it is, no per-token transpose), with the same arithmetic in the same order: the
   same bits. Returns 0, or 1 when out of memory. */

/* The same step in the [P, N] layout: the update row by row (contiguous in n, vectorised; elementwise, so the
   order does not matter), then C_g S[p, :] summed over n in order (the [N, P + 1] loop's order, so the same bits)
   for M2_ROWS rows at a time, each in its own accumulator: independent chains over rows just written (in cache).
   A layer's heads (32, P 64, N 128, fp32) cost 0.07-0.3 ms more than in the [N, P + 1] layout; the per-token
   transposes in torch that this layout replaces cost 2.8-3.0 ms (both at load 7-10 on 2 cores). */
#define M2_ROWS 16

static void FN(mamba2_head_pn)(int64_t N, int64_t P, REAL decay, REAL dt, const REAL *x, const REAL *Bg,
                               const REAL *Cg, const REAL *S0, REAL *S, REAL *o) {
    for (int64_t p = 0; p < P; ++p) {
        const REAL xd = x[p] * dt;
        REAL *restrict s = S + p * N;
        if (S0) {
            const REAL *restrict s0 = S0 + p * N;
#pragma omp simd
            for (int64_t n = 0; n < N; ++n) s[n] = decay * s0[n] + Bg[n] * xd;
        } else {
#pragma omp simd
            for (int64_t n = 0; n < N; ++n) s[n] = Bg[n] * xd;
        }
    }
    for (int64_t p0 = 0; p0 < P; p0 += M2_ROWS) {
        const int64_t nr = P - p0 < M2_ROWS ? P - p0 : M2_ROWS;
        const REAL *s = S + p0 * N;
        REAL acc[M2_ROWS] = {0};
        for (int64_t n = 0; n < N; ++n) {
            const REAL cn = Cg[n];
            for (int64_t k = 0; k < nr; ++k) acc[k] += cn * s[k * N + n];
        }
        for (int64_t k = 0; k < nr; ++k) o[p0 + k] = acc[k];
    }
}

/* one head's step in the [N, P + 1] layout (S0 NULL: a zero state) */
static void FN(mamba2_head_np)(int64_t N, int64_t P, REAL decay, REAL dt, const REAL *x, const REAL *Bg,
                               const REAL *Cg, const REAL *S0, REAL *S, REAL *o) {
    const int64_t P1 = P + 1;
    for (int64_t j = 0; j < P; ++j) o[j] = 0;
    for (int64_t n = 0; n < N; ++n) {
        const REAL *restrict s0 = S0 ? S0 + n * P1 : NULL;
        REAL *restrict s = S + n * P1;
        const REAL bn = Bg[n], cn = Cg[n];
        if (s0) {
#pragma omp simd
            for (int64_t j = 0; j < P; ++j) s[j] = decay * s0[j] + bn * (x[j] * dt);
            s[P] = decay * s0[P] + bn;
        } else {
#pragma omp simd
            for (int64_t j = 0; j < P; ++j) s[j] = bn * (x[j] * dt);
            s[P] = bn;
        }
#pragma omp simd
        for (int64_t j = 0; j < P; ++j) o[j] += cn * s[j];
    }
}

static int FN(mamba2_mix)(const linattn_block_plan *p, const REAL *y, const REAL *w_in, const REAL *S_in,
                          REAL *w_out, REAL *S_out, REAL *out, REAL *w_io) {
    const int64_t B = p->B, H = p->H, N = p->K, P = p->V, G = p->n_groups, ny = p->ny;
    const int64_t DI = H * P, CD = DI + 2 * G * N, HG = H / G, P1 = P + 1, GS = DI / G;
    REAL *u = (REAL *)malloc(sizeof(REAL) * (size_t)(B * CD + 1));
    if (!u) return 1;
    if (p->KC > 0 && w_io)   /* (transformers' conv state read and advanced in place: decode.c conv_io) */
        FN(conv_io)(B, CD, p->KC, y + DI, ny, w_io, (const REAL *)p->cw, (const REAL *)p->cb, p->conv_act, u);
    else if (p->KC > 0)
        FN(conv)(B, CD, p->KC, y + DI, ny, w_in, (const REAL *)p->cw, (const REAL *)p->cb, p->conv_act, w_out,
                u);
    else
        for (int64_t b = 0; b < B; ++b)
            for (int64_t c = 0; c < CD; ++c) u[b * CD + c] = FN(la_silu)(y[b * ny + DI + c]);
    const REAL *neg_a = (const REAL *)p->neg_a, *dt_bias = (const REAL *)p->dt_bias, *Dsk = (const REAL *)p->Dsk;
    const REAL lo = (REAL)p->dt_lo, hi = (REAL)p->dt_hi;
    const int64_t nb = B * H;
    const int par = nb > 1 && nb * N * P1 >= PAR_MIN_ELEMS;
#pragma omp parallel for num_threads(p->nthreads) schedule(static) if(par)
    for (int64_t t = 0; t < nb; ++t) {
        const int64_t b = t / H, h = t % H, g = h / HG;
        const REAL *x = u + b * CD + h * P, *Bg = u + b * CD + DI + g * N, *Cg = u + b * CD + DI + G * N + g * N;
        REAL dt = FN(softplus)(y[b * ny + DI + CD + h] + dt_bias[h]);
        dt = dt < lo ? lo : (dt > hi ? hi : dt);   /* (NaN stays NaN, as torch.clamp) */
        const REAL decay = MATH(exp)(dt * neg_a[h]);
        const int64_t ns = p->state_pn ? N * P : N * P1;
        REAL *o = out + t * P;
        (p->state_pn ? FN(mamba2_head_pn) : FN(mamba2_head_np))(N, P, decay, dt, x, Bg, Cg,
                                                                S_in ? S_in + t * ns : NULL, S_out + t * ns, o);
        for (int64_t j = 0; j < P; ++j) o[j] = o[j] + Dsk[p->d_per_channel ? h * P + j : h] * x[j];
    }
    /* the gated norm over each group of GS channels (its heads all done above) */
    const REAL *nw = (const REAL *)p->nw;
    for (int64_t b = 0; b < B; ++b)
        for (int64_t gi = 0; gi < G; ++gi) {
            REAL *o = out + b * DI + gi * GS;
            const REAL *z = y + b * ny + gi * GS, *w = nw ? nw + gi * GS : NULL;
            if (p->norm_mode == 1)
                for (int64_t j = 0; j < GS; ++j) o[j] = o[j] * FN(la_silu)(z[j]);
            if (p->norm_mode) {
                const REAL r = FN(la_rms_rstd)(o, GS, (REAL)p->norm_eps);
                for (int64_t j = 0; j < GS; ++j) o[j] = w ? o[j] * r * w[j] : o[j] * r;
            }
            if (p->norm_mode != 1)
                for (int64_t j = 0; j < GS; ++j) o[j] = o[j] * FN(la_silu)(z[j]);
        }
    free(u);
    return 0;
}
