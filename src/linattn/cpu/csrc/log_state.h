/* One token of the log-space linear-attention state (ELA's Hadamard Exp, FAVOR+), shared by the chunk kernels
   (linear_log.c: forward, the backward's recomputation) and the compiled decode (decode_log.h), so that the three
   leave the same bits in a state.

   The state is [K, W] rows S (the kv columns and the normaliser z, W = V + 1) with a per-feature log-scale mu [K]
   (the true state is exp(mu) S). A token: mu_d <- max(mu_d + g, lk_d), a row rescaled only when the key raises
   its mu (a factor exp(0) = 1 would leave its bits as they are), and the output row y [W] = sum_d exp(lq_d + mu_d
   - c) S[d] relative to c = max_d (lq_d + mu_d). Every exponent is <= 0.

   Speed: the pass over the state walks column blocks of 4 vector lines (64 floats / 32 doubles with AVX-512, half
   that without; then single lines) and, inside one, every row, so the block's output stays in vector registers for
   the whole pass (one load and one store of each state element, no store-to-load chain through the output row); the
   z column rides along the first block's pass as a scalar chain, and the columns that remain take the same
   arithmetic in scalars. Each element's operations are those of the plain loop (rows * f + [v | 1] or
   rows + e [v | 1], y += w r), in the same order over d, so the bits do not depend on the blocking. The values are
   read and the outputs written in place (no [v | 1] copy, no output copy per token). Once per REAL (FN). */
#ifndef LINATTN_LOG_STATE_ONCE
#define LINATTN_LOG_STATE_ONCE
#define LS_LINES 4 /* vector lines per column block */
/* a line: 64 bytes with AVX-512; 32 without, where a 64-byte vector is two registers and the block's 12 lines of
   values, rows and sums (24 registers of 16) spilled on every row (the bits do not depend on the line) */
#if defined(__AVX512F__)
#define LS_VBYTES 64
#else
#define LS_VBYTES 32
#endif
#endif

/* S [K, ld] rows (ld >= V + 1: V kv columns, then z), mu [K], lk, lq [K], v [V], g the token's log-gate; f, e,
   wq [K] scratch -> y [V] (the numerator row) and *yz (the denominator). Returns c. */
LA_INLINE REAL FN(ls_token)(REAL *restrict S, int64_t ld, REAL *restrict mu, const REAL *restrict lk,
                            const REAL *restrict v, REAL g, const REAL *restrict lq, REAL *restrict f,
                            REAL *restrict e, REAL *restrict wq, REAL *restrict y, REAL *restrict yz, int64_t K,
                            int64_t V) {
    /* the scalars in vector loops (one exp per feature for the key, one for the query) */
    LA_SIMD
    for (int64_t d = 0; d < K; ++d) {
        const REAL m = mu[d] + g, x = lk[d];
        const int up = x > m;
        const REAL ex = FN(la_exp)(up ? m - x : x - m);
        f[d] = up ? ex : (REAL)1; /* the old rows' factor (1: untouched) */
        e[d] = up ? (REAL)1 : ex; /* the new key's weight */
        mu[d] = up ? x : m;
        wq[d] = lq[d] + mu[d];
    }
    REAL c = (REAL)-INFINITY;
    int bad = 0;
    LA_PRAGMA(omp simd reduction(max : c) reduction(| : bad))
    for (int64_t d = 0; d < K; ++d) {
        const REAL a = wq[d];
        c = a > c ? a : c;
        bad |= a != a;
    }
    if (bad) c = (REAL)NAN; /* a NaN among the logits: every weight NaN, as in the PyTorch forms */
    LA_SIMD
    for (int64_t d = 0; d < K; ++d) wq[d] = FN(la_exp)(wq[d] - c);
    int64_t w0 = 0;
    REAL az = 0;  /* the z column's output */
    int zleft = 1; /* z rides along the first vector pass (its own scalar chain, hidden under the vector work) */
#if defined(__GNUC__)
    typedef REAL line __attribute__((vector_size(LS_VBYTES), aligned(sizeof(REAL))));
    enum { NL = LS_VBYTES / sizeof(REAL), BW = LS_LINES * NL };
    for (; w0 + BW <= V; w0 += BW) {
        const line *vl = (const line *)(v + w0);
        const line v0 = vl[0], vb1 = vl[1], vb2 = vl[2], vb3 = vl[3];
        line a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        const int z = zleft;
        for (int64_t d = 0; d < K; ++d) {
            line *row = (line *)(S + d * ld + w0);
            line r0 = row[0], r1 = row[1], r2 = row[2], r3 = row[3];
            const REAL fd = f[d], ed = e[d], qd = wq[d];
            REAL *zr = S + d * ld + V;
            if (fd != (REAL)1) {
                r0 = r0 * fd + v0, r1 = r1 * fd + vb1, r2 = r2 * fd + vb2, r3 = r3 * fd + vb3;
                if (z) *zr = *zr * fd + (REAL)1;
            } else {
                r0 = r0 + ed * v0, r1 = r1 + ed * vb1, r2 = r2 + ed * vb2, r3 = r3 + ed * vb3;
                if (z) *zr = *zr + ed;
            }
            row[0] = r0, row[1] = r1, row[2] = r2, row[3] = r3;
            a0 += qd * r0, a1 += qd * r1, a2 += qd * r2, a3 += qd * r3;
            if (z) az += qd * *zr;
        }
        zleft = 0;
        line *yl = (line *)(y + w0);
        yl[0] = a0, yl[1] = a1, yl[2] = a2, yl[3] = a3;
    }
    for (; w0 + NL <= V; w0 += NL) { /* single lines */
        const line v0 = *(const line *)(v + w0);
        line a0 = {0};
        const int z = zleft;
        for (int64_t d = 0; d < K; ++d) {
            line *row = (line *)(S + d * ld + w0);
            line r0 = row[0];
            const REAL fd = f[d], ed = e[d], qd = wq[d];
            REAL *zr = S + d * ld + V;
            if (fd != (REAL)1) {
                r0 = r0 * fd + v0;
                if (z) *zr = *zr * fd + (REAL)1;
            } else {
                r0 = r0 + ed * v0;
                if (z) *zr = *zr + ed;
            }
            row[0] = r0;
            a0 += qd * r0;
            if (z) az += qd * *zr;
        }
        zleft = 0;
        *(line *)(y + w0) = a0;
    }
#endif
    /* the remaining columns in scalars, each its own chain over d (the same order, the same operations) */
    for (int64_t w = w0; w <= V; ++w) {
        if (w == V && !zleft) break;
        const REAL vw = w < V ? v[w] : (REAL)1;
        REAL acc = 0;
        for (int64_t d = 0; d < K; ++d) {
            REAL *rw = S + d * ld + w;
            const REAL fd = f[d], ed = e[d], qd = wq[d];
            const REAL r = fd != (REAL)1 ? *rw * fd + vw : *rw + ed * vw;
            *rw = r;
            acc += qd * r;
        }
        if (w < V) y[w] = acc;
        else az = acc;
    }
    *yz = az;
    return c;
}
