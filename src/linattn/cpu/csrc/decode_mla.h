/* Multi-head latent attention (kind 7 of the block plan) for one decoded token, as transformers' MLA layers
   compute it (DeepSeek-V3's attention as Kimi Linear's `KimiLinearAttention` and Bailing hybrid's
   `BailingHybridAttention` use it), on y = W rmsnorm1(x), the block's fused first product:

       y = [q (H (dn + R)) | kv_a (r + R) | gate (H, mla_gate)]          (q_lora_rank qr > 0: q is qa (qr) and
                                                                          q = Wqb rmsnorm_qa(qa))
       c = rmsnorm_kv(kv_a[:r]),  k_rot = kv_a[r:]  (interleaved RoPE at the token's position when rot > 0)
       per head h: key_t = [Wkb_h c_t (dn) | k_rot_t (R)],  value_t = Wvb_h c_t (dv)    (kv_b_proj's rows of head h:
                   dn key rows, then dv value rows)
       o_h = softmax_t(scale q_h . key_t) value_t          (times sigmoid(gate_h) with mla_gate)

   The cache is what transformers' cache holds for the layer: the normed latents c [B, cap, 1, r] in kc and the
   (rotated) shared keys k_rot [B, cap, 1, R] in vc; the new token's row is written at kv_len. Keys and values are
   never expanded: q_h's no-position part is taken through the key rows once (q~_h = Wkb_h^T q_nope_h, r values),
   the scores are q~_h . c_t + q_rot_h . k_rot_t, and the value rows are applied once to the weighted latent sum
   (Wvb_h sum_t p_t c_t): the same products in another order (within rounding of transformers' expanded form),
   each weight of kv_b_proj read once per token and the cache read as r + R values per position, not H (dn + R
   + dv). Scores and softmax in the plan's type (fp32 for bf16 weights), the maximum subtracted. kv_b_proj and
   q_b_proj may be stored int8 / int4 (fmt_mla_Wkb, fmt_mla_Wqb: qmatvec.h's formats, read as stored); with int8
   activations kv_b_proj's inputs, the cached latents c_t, are rounded per block of 32 as the layer rounds them.
   Included by decode.c's body once per REAL. */

/* y[j] += sum_i x[i] W[i, j] over the n rows of W [n, m] in format fmt (the plan's type, bf16, or int8 / int4
   rows with their bf16 scales sc: a row's x[i] times its (group's) scale, then times the integers) */
static void FN(mla_product_t)(int fmt, const void *W, const void *sc, int64_t grp, int64_t n, int64_t m,
                              const REAL *x, REAL *restrict y) {
    for (int64_t i = 0; i < n; ++i) {
        const REAL xi = x[i];
#if REAL_IS_FLOAT
        if (fmt == WF_BF16) {
            const uint16_t *restrict w = (const uint16_t *)W + i * m;
#pragma omp simd
            for (int64_t j = 0; j < m; ++j) y[j] += xi * bf16_to_f32(w[j]);
            continue;
        }
        if (fmt == WF_INT8 || fmt == WF_INT8_A8) {
            const int8_t *restrict w = (const int8_t *)W + i * m;
            const REAL c = xi * bf16_to_f32(((const uint16_t *)sc)[i]);
#pragma omp simd
            for (int64_t j = 0; j < m; ++j) y[j] += c * (REAL)w[j];
            continue;
        }
        if (fmt == WF_INT4 || fmt == WF_INT4_A8) {
            const uint8_t *restrict w = (const uint8_t *)W + i * (m / 2);
            const uint16_t *s = (const uint16_t *)sc + i * (m / grp);
            for (int64_t g = 0; g < m / grp; ++g) {
                const REAL c = xi * bf16_to_f32(s[g]);
                REAL *restrict yg = y + g * grp;
                const uint8_t *restrict wg = w + g * grp / 2;
#pragma omp simd
                for (int64_t j = 0; j < grp / 2; ++j) {
                    yg[2 * j] += c * (REAL)((int)(wg[j] & 15) - 8);
                    yg[2 * j + 1] += c * (REAL)((int)(wg[j] >> 4) - 8);
                }
            }
            continue;
        }
#else
        (void)fmt, (void)sc, (void)grp;
#endif
        const REAL *restrict w = (const REAL *)W + i * m;
#pragma omp simd
        for (int64_t j = 0; j < m; ++j) y[j] += xi * w[j];
    }
}

/* where row `row` of a matrix [.., m] in format fmt starts: its bytes (*w) and its scales (*s) */
static inline void FN(mla_rows_at)(int fmt, const void *W, const void *sc, int64_t grp, int64_t row, int64_t m,
                                   const void **w, const void **s) {
    const int int8 = fmt == WF_INT8 || fmt == WF_INT8_A8, int4 = fmt == WF_INT4 || fmt == WF_INT4_A8;
    const size_t rowb = int8 ? (size_t)m : int4 ? (size_t)(m / 2) : (size_t)m * (fmt == WF_BF16 ? 2 : sizeof(REAL));
    *w = (const char *)W + (size_t)row * rowb;
    *s = int8 ? (const void *)((const uint16_t *)sc + row) : int4 ? (const void *)((const uint16_t *)sc + row *
                                                                                       (m / grp)) : NULL;
}

/* sum_i a[i] x_i over n cache elements from element off (bf16 or the plan's type) */
static inline REAL FN(mla_dot)(int kb, const void *base, int64_t off, const REAL *restrict a, int64_t n) {
    REAL s = 0;
    if (kb) {
        const uint16_t *restrict x = (const uint16_t *)base + off;
#pragma omp simd reduction(+:s)
        for (int64_t i = 0; i < n; ++i) s += a[i] * (REAL)bf16_to_f32(x[i]);
    } else {
        const REAL *restrict x = (const REAL *)base + off;
#pragma omp simd reduction(+:s)
        for (int64_t i = 0; i < n; ++i) s += a[i] * x[i];
    }
    return s;
}

/* DeepSeek's interleaved rotation of R channels: pairs (x[2i], x[2i+1]) by angle i, written rotate-half
   ([x0' x2' .. | x1' x3' ..]) into out, as transformers' apply_rotary_pos_emb_interleave */
static void FN(mla_rope)(const REAL *x, int64_t R, const REAL *c, const REAL *s, REAL *out) {
    const int64_t h = R / 2;
    for (int64_t i = 0; i < h; ++i) {
        const REAL x1 = x[2 * i], x2 = x[2 * i + 1];
        out[i] = x1 * c[i] - x2 * s[i];
        out[i + h] = x2 * c[i] + x1 * s[i];
    }
}

/* y [B, ny] (the fused first product) -> o [B, H * dv]. Returns 0, or 1 when out of memory. */
static int FN(mla_mix)(const linattn_block_plan *p, REAL *y, REAL *o) {
    const int64_t B = p->B, H = p->H, r = p->mla_rank, dn = p->mla_nope, R = p->mla_rope, dv = p->V, qr = p->mla_qr;
    const int64_t dq = dn + R, nq = qr ? qr : H * dq, ny = p->ny, kvw = dn + dv;
    const int64_t L = p->kv_len + 1, cap = p->kv_cap, row = p->kv_len;
    const int kb = p->kv_bf16, fq = WEIGHT_FORMAT(p->wbf16, p->fmt_mla_Wqb);
    const int fk = WEIGHT_FORMAT(p->wbf16, p->fmt_mla_Wkb);
    const int64_t gk = p->grp_mla_Wkb;
    /* kv_b_proj with int8 activations: the layer rounds its inputs, the cached latents, per block (qmatvec.h's
       rounding), so the scores and the weighted sum read the rounded latents (lat_a8 [L, r]); the value rows then
       multiply that weighted sum as it is (fv: the same integers with float activations) */
    const int a8 = fk == WF_INT8_A8 || fk == WF_INT4_A8;
    const int fv = fk == WF_INT8_A8 ? WF_INT8 : fk == WF_INT4_A8 ? WF_INT4 : fk;
    /* work: q [H dq] (low-rank q), the rotated q_rot / k_rot [H R + R], cos / sin [R], per head: q~ [r], the
       weighted latents [r], the scores [L]; with a8 the rounded latents [L r] */
    const int64_t per = 2 * r + L;
    REAL *ws = (REAL *)malloc(sizeof(REAL) * (size_t)(H * dq + H * R + 2 * R + H * per + 1 + (a8 ? L * r : 0)));
    if (!ws) return 1;
    REAL *qbuf = ws, *qrot = qbuf + H * dq, *krot = qrot + H * R, *cs = krot + R, *sn = cs + R / 2, *heads = cs + R;
    REAL *lat_a8 = heads + H * per;
    const double *inv = (const double *)p->inv_freq;
    const REAL scale = (REAL)p->scale;
    for (int64_t b = 0; b < B; ++b) {
        REAL *yb = y + b * ny;
        const REAL *q = yb;
        if (qr) {
            FN(rmsnorm)(1, qr, yb, (const REAL *)p->mla_qnw, p->mla_q_eps, yb);
            FN(weight_product)(fq, p->sc_mla_Wqb, p->grp_mla_Wqb, 1, H * dq, qr, p->mla_Wqb, NULL, yb, NULL, qbuf, 1);
            q = qbuf;
        }
        REAL *lat = yb + nq, *kr = lat + r;
        FN(rmsnorm)(1, r, lat, (const REAL *)p->mla_kvnw, p->mla_kv_eps, lat);
        const int64_t pos = p->pos ? p->pos[b] : p->pos0, lo = p->lo ? p->lo[b] : p->lo0;
        if (p->rot) {
            for (int64_t i = 0; i < R / 2; ++i) {
                const float a = (float)pos * (float)inv[i];
                cs[i] = (REAL)(cosf(a) * (float)p->rope_scale); sn[i] = (REAL)(sinf(a) * (float)p->rope_scale);
            }
            FN(mla_rope)(kr, R, cs, sn, krot);
            for (int64_t h = 0; h < H; ++h) FN(mla_rope)(q + h * dq + dn, R, cs, sn, qrot + h * R);
        } else {
            memcpy(krot, kr, sizeof(REAL) * (size_t)R);
            for (int64_t h = 0; h < H; ++h) memcpy(qrot + h * R, q + h * dq + dn, sizeof(REAL) * (size_t)R);
        }
        /* the cache row of this token: what transformers' cache.update receives */
        const int64_t co = (b * cap + row) * r, ro = (b * cap + row) * R;
        for (int64_t i = 0; i < r; ++i) FN(kv_put)(kb, p->kc, co + i, lat[i]);
        for (int64_t i = 0; i < R; ++i) FN(kv_put)(kb, p->vc, ro + i, krot[i]);
        /* the latents the key / value rows take: the cache's, or (a8) their rounded copies */
        const void *lbase = p->kc;
        int lkb = kb;
        int64_t lrow0 = b * cap;
#if REAL_IS_FLOAT
        if (a8) {
            int8_t qi[A8_BLOCK];
            float sb = 0;
            for (int64_t t = lo; t < L; ++t) {
                REAL *ct = lat_a8 + t * r;
                for (int64_t i = 0; i < r; ++i) ct[i] = FN(kv_get)(kb, p->kc, (b * cap + t) * r + i);
                int finite = 1;   /* (a NaN or inf: the row unrounded, as the layer leaves such an input) */
                for (int64_t i = 0; i < r; ++i) finite &= fabsf(ct[i]) <= FLT_MAX;
                for (int64_t j0 = 0; finite && j0 < r; j0 += A8_BLOCK) {
                    const int64_t e = j0 + A8_BLOCK < r ? A8_BLOCK : r - j0;
                    a8_round_block(0, e, ct + j0, qi, &sb);
                    for (int64_t j = 0; j < e; ++j) ct[j0 + j] = (REAL)qi[j] * sb;
                }
            }
            lbase = lat_a8, lkb = 0, lrow0 = 0;
        }
#else
        (void)lat_a8;
#endif
        const int par = p->nthreads > 1 && H > 1 && H * ((L - lo) * (2 * r + R) + 2 * kvw * r) >= PAR_MIN_ELEMS;
#pragma omp parallel for num_threads(p->nthreads) schedule(static) if(par)
        for (int64_t h = 0; h < H; ++h) {
            REAL *qt = heads + h * per, *cbar = qt + r, *w = cbar + r;
            const void *wk, *sk, *wv, *sv;
            FN(mla_rows_at)(fk, p->mla_Wkb, p->sc_mla_Wkb, gk, h * kvw, r, &wk, &sk);
            FN(mla_rows_at)(fk, p->mla_Wkb, p->sc_mla_Wkb, gk, h * kvw + dn, r, &wv, &sv);
            for (int64_t j = 0; j < r; ++j) qt[j] = 0, cbar[j] = 0;
            FN(mla_product_t)(fk, wk, sk, gk, dn, r, q + h * dq, qt);
            const REAL *qrh = qrot + h * R;
            REAL m = -INFINITY, den = 0;
            int nan = 0;
            for (int64_t t = lo; t < L; ++t) {
                const int64_t c0 = (lrow0 + t) * r, r0 = (b * cap + t) * R;
                const REAL s = (FN(mla_dot)(lkb, lbase, c0, qt, r) + FN(mla_dot)(kb, p->vc, r0, qrh, R)) * scale;
                w[t] = s;
                nan |= s != s;
                if (s > m) m = s;
            }
            for (int64_t t = lo; t < L; ++t) {
                const REAL e = nan ? (REAL)NAN : MATH(exp)(w[t] - m);
                den += e;
                FN(kv_axpy)(lkb, lbase, (lrow0 + t) * r, r, e, cbar);
            }
            for (int64_t i = 0; i < r; ++i) cbar[i] /= den;
            REAL *oh = o + b * H * dv + h * dv;
            FN(weight_product)(fv, sv, gk, 1, dv, r, wv, NULL, cbar, NULL, oh, 1);
            if (p->mla_gate) {
                const REAL g = (REAL)1 / ((REAL)1 + MATH(exp)(-yb[nq + r + R + h]));
                for (int64_t i = 0; i < dv; ++i) oh[i] *= g;
            }
        }
    }
    free(ws);
    return 0;
}
