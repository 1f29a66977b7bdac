/* A mixture-of-experts feed-forward (ffn_kind 1 of the block plan) for one decoded token, as transformers'
   Qwen3-Next / Qwen3.5-MoE sparse block computes it (Qwen3NextSparseMoeBlock, Qwen3NextTopKRouter):

       r = Wr xn                                  router logits [E], in the plan's type
       p = softmax(r)                             in float, as transformers' softmax(dtype=torch.float)
       (i_1..i_k, v_1..v_k) = topk(p, k)          the set torch.topk picks on the CPU, ties included (below)
       w_j = v_j / sum v  (norm_topk)             in float, then cast to the plan's type
       moe = sum_j w_j Wed[i_j] (silu(a) * b), [a | b] = Weg[i_j] xn      (experts in increasing index, as
                                                                            transformers' index_add_ loop)
       moe += sigmoid(Wsg xn) * Wd (silu(a) * b), [a | b] = Wgu xn        (the shared expert, hid > 0)
       x_out = h + moe

   The experts' weights are read in place from transformers' fused 3-D parameters: Weg [E, 2 I, d] (gate rows,
   then up rows), Wed [E, d, I]; a token reads only its k experts' rows. Rows of a batch that chose the same
   expert share one product (the expert's weights read once per token). bf16 weights: the router logits are
   rounded to bf16 before the softmax and the routing weights after it, as a bf16 model's router produces them
   (which experts a token takes is discrete: the same rounding keeps the same choices).

   Which of several tied experts torch.topk keeps is not the lowest index: ATen's CPU top-k runs libstdc++'s
   std::nth_element (k * 64 > E) or std::partial_sort (a heap select, k * 64 <= E) with "a NaN or a larger value
   first" as the order, and the set of the first k after it is what is chosen. The same steps are written out
   below (introselect with median-of-three pivots and an insertion sort below 4 elements, the heap select); the
   order within the set does not matter (the experts are summed in index order), only the set.
   Included by decode.c once before its body (the routing, float only) and by the body once per REAL. */

#ifndef LINATTN_DECODE_MOE_ROUTE
#define LINATTN_DECODE_MOE_ROUTE

typedef struct { float v; int64_t i; } moe_elem;

/* the order of ATen's CPU top-k (largest): a NaN before any number, then larger first */
static inline int moe_before(moe_elem x, moe_elem y) { return (isnan(x.v) && !isnan(y.v)) || x.v > y.v; }

static void moe_insertion_sort(moe_elem *a, int64_t f, int64_t l) {
    if (f == l) return;
    for (int64_t i = f + 1; i < l; ++i) {
        const moe_elem v = a[i];
        if (moe_before(v, a[f])) {
            memmove(a + f + 1, a + f, sizeof(moe_elem) * (size_t)(i - f));
            a[f] = v;
        } else {
            int64_t j = i;
            while (moe_before(v, a[j - 1])) { a[j] = a[j - 1]; --j; }
            a[j] = v;
        }
    }
}

static inline void moe_swap(moe_elem *a, int64_t i, int64_t j) { const moe_elem t = a[i]; a[i] = a[j]; a[j] = t; }

static void moe_push_heap(moe_elem *a, int64_t hole, int64_t top, moe_elem v) {
    int64_t parent = (hole - 1) / 2;
    while (hole > top && moe_before(a[parent], v)) { a[hole] = a[parent]; hole = parent; parent = (hole - 1) / 2; }
    a[hole] = v;
}

static void moe_adjust_heap(moe_elem *a, int64_t hole, int64_t n, moe_elem v) {
    const int64_t top = hole;
    int64_t c = hole;
    while (c < (n - 1) / 2) {
        c = 2 * (c + 1);
        if (moe_before(a[c], a[c - 1])) --c;
        a[hole] = a[c]; hole = c;
    }
    if ((n & 1) == 0 && c == (n - 2) / 2) { c = 2 * (c + 1); a[hole] = a[c - 1]; hole = c - 1; }
    moe_push_heap(a, hole, top, v);
}

/* the first m - f elements of [f, l) become the "largest" m - f of it (std::__heap_select) */
static void moe_heap_select(moe_elem *a, int64_t f, int64_t m, int64_t l) {
    moe_elem *h = a + f;
    const int64_t n = m - f;
    if (n >= 2)
        for (int64_t p = (n - 2) / 2;; --p) {
            moe_adjust_heap(h, p, n, h[p]);
            if (p == 0) break;
        }
    for (int64_t i = m; i < l; ++i)
        if (moe_before(a[i], h[0])) { const moe_elem v = a[i]; a[i] = h[0]; moe_adjust_heap(h, 0, n, v); }
}

/* std::nth_element(a, a + nth, a + n) (libstdc++'s __introselect) */
static void moe_nth_element(moe_elem *a, int64_t nth, int64_t n) {
    int64_t f = 0, l = n, depth = 0;
    for (int64_t m = n; m > 1; m >>= 1) ++depth;
    depth *= 2;
    while (l - f > 3) {
        if (depth == 0) { moe_heap_select(a, f, nth + 1, l); moe_swap(a, f, nth); return; }
        --depth;
        const int64_t mid = f + (l - f) / 2, x = f + 1, z = l - 1;   /* median of three to the front */
        int64_t s;
        if (moe_before(a[x], a[mid])) s = moe_before(a[mid], a[z]) ? mid : moe_before(a[x], a[z]) ? z : x;
        else s = moe_before(a[x], a[z]) ? x : moe_before(a[mid], a[z]) ? z : mid;
        moe_swap(a, f, s);
        int64_t lo = f + 1, hi = l;                                  /* unguarded partition around a[f] */
        for (;;) {
            while (moe_before(a[lo], a[f])) ++lo;
            --hi;
            while (moe_before(a[f], a[hi])) --hi;
            if (!(lo < hi)) break;
            moe_swap(a, lo, hi);
            ++lo;
        }
        if (lo <= nth) f = lo; else l = lo;
    }
    moe_insertion_sort(a, f, l);
}

/* One row's routing: softmax of the E logits lg (float), the k experts torch.topk picks into idx (increasing),
   their probabilities (renormalised over the k when norm) into w. buf: E elements of work. */
static void moe_route_row(int64_t E, int64_t k, int norm, const float *lg, moe_elem *buf, int64_t *idx, float *w) {
    float mx = -INFINITY;
    int nan = 0;
    for (int64_t e = 0; e < E; ++e) { nan |= isnan(lg[e]); if (lg[e] > mx) mx = lg[e]; }
    float s = 0;
    for (int64_t e = 0; e < E; ++e) { buf[e].v = nan ? NAN : expf(lg[e] - mx); buf[e].i = e; s += buf[e].v; }
    const float rs = 1.0f / s;
    for (int64_t e = 0; e < E; ++e) buf[e].v *= rs;
    if (k * 64 <= E) moe_heap_select(buf, 0, k, E); else moe_nth_element(buf, k - 1, E);
    /* the chosen set by index; the renormalising sum over the values largest first (torch.topk's order) */
    moe_insertion_sort(buf, 0, k);
    float t = 0;
    for (int64_t j = 0; j < k; ++j) t += buf[j].v;
    for (int64_t j = 0; j < k; ++j) {   /* insertion by index (k is small) */
        int64_t pos = j;
        while (pos > 0 && idx[pos - 1] > buf[j].i) { idx[pos] = idx[pos - 1]; w[pos] = w[pos - 1]; --pos; }
        idx[pos] = buf[j].i;
        w[pos] = norm ? buf[j].v / t : buf[j].v;
    }
}

/* Router mode 2, DeepSeek-V3's (Kimi Linear's, Bailing hybrid's `<Model>TopkRouter`), for one row of E float
   logits lg:
       s = sigmoid(lg);  c = s + bias                       (the correction bias: for the choice only)
       group g's score = the sum of its two largest c       (G groups of E / G experts, in order)
       the kg groups torch.topk(sorted=False) keeps; c of the other groups -inf
       the k experts torch.topk(sorted=False) keeps of c;  w = s of them (/ (their sum + 1e-20) when norm), * scale
   Both choices through the selections above (ATen's, ties included). idx increasing; the renormalising sum in
   the order torch.topk returns them (the buffer's order after the selection). buf: E + 1 elements, gs: G floats,
   sc: E floats of work. */
static void moe_route_grouped_row(int64_t E, int64_t k, int64_t G, int64_t kg, int norm, float scale,
                                  const float *lg, const float *bias, moe_elem *buf, float *gs, float *sc,
                                  int64_t *idx, float *w) {
    const int64_t n = E / G;
    for (int64_t e = 0; e < E; ++e) sc[e] = 1.0f / (1.0f + expf(-lg[e]));
    for (int64_t g = 0; g < G; ++g) {
        float a = -INFINITY, b = -INFINITY;   /* the two largest of the group (a NaN first, as the order says) */
        for (int64_t e = g * n; e < (g + 1) * n; ++e) {
            const moe_elem x = {sc[e] + bias[e], e}, ea = {a, 0}, eb = {b, 0};
            if (moe_before(x, ea)) { b = a; a = x.v; } else if (moe_before(x, eb)) b = x.v;
        }
        gs[g] = a + b;
    }
    for (int64_t g = 0; g < G; ++g) { buf[g].v = gs[g]; buf[g].i = g; }
    if (kg * 64 <= G) moe_heap_select(buf, 0, kg, G); else moe_nth_element(buf, kg - 1, G);
    for (int64_t g = 0; g < G; ++g) gs[g] = 0;
    for (int64_t j = 0; j < kg; ++j) gs[buf[j].i] = 1;
    for (int64_t e = 0; e < E; ++e) { buf[e].v = gs[e / n] != 0 ? sc[e] + bias[e] : -INFINITY; buf[e].i = e; }
    if (k * 64 <= E) moe_heap_select(buf, 0, k, E); else moe_nth_element(buf, k - 1, E);
    if (k * 64 <= E) moe_insertion_sort(buf, 0, k);   /* (std::partial_sort sorts what it selects) */
    float t = 0;
    for (int64_t j = 0; j < k; ++j) t += sc[buf[j].i];
    t += 1e-20f;
    for (int64_t j = 0; j < k; ++j) {   /* insertion by index (k is small) */
        int64_t pos = j;
        while (pos > 0 && idx[pos - 1] > buf[j].i) { idx[pos] = idx[pos - 1]; w[pos] = w[pos - 1]; --pos; }
        idx[pos] = buf[j].i;
        w[pos] = (norm ? sc[buf[j].i] / t : sc[buf[j].i]) * scale;
    }
}

#endif /* LINATTN_DECODE_MOE_ROUTE */

#ifdef FN /* the feed-forward, once per REAL */

/* xn [B, d] (the normed input of the FFN), h [B, d] (the residual) -> x_out = h + moe(xn). Returns 0, or 1 when
   out of memory. */
static int FN(moe_ffn)(const linattn_block_plan *p, const REAL *xn, const REAL *h, REAL *x_out) {
    const int64_t B = p->B, d = p->d, E = p->n_experts, k = p->top_k, I = p->moe_hid, Is = p->hid;
    const int fmt = WEIGHT_FORMAT(p->wbf16, 0);
    const size_t esz = p->wbf16 ? 2 : sizeof(REAL);
    const int64_t wide = I > Is ? I : Is;
    /* work: logits [B, E], the experts' sum [B, d], gathered rows [B, d], gate|up [B, 2 wide], silu(a) b [B, wide],
       a product's rows [B, d], the routing weights of the gathered rows [B], the shared gate [B] */
    REAL *lg = (REAL *)malloc(sizeof(REAL) * (size_t)(B * (E + 4 * d + 3 * wide + 2) + 1));
    float *lgf = (float *)malloc(sizeof(float) * (size_t)(B * (E + k) + 1));
    int64_t *idx = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B * (k + 1) + 1));
    moe_elem *buf = (moe_elem *)malloc(sizeof(moe_elem) * (size_t)(E + 1));
    if (!lg || !lgf || !idx || !buf) { free(lg); free(lgf); free(idx); free(buf); return 1; }
    REAL *acc = lg + B * E, *X = acc + B * d, *U = X + B * d, *G = U + 2 * B * wide, *Y = G + B * wide;
    REAL *wts = Y + B * d, *sg = wts + B;
    float *wf = lgf + B * E;
    int64_t *rows = idx + B * k;
    if (p->router == 2) {   /* router mode 2 (above): in float, the input as a bf16 model's router reads it */
        float *gsc = (float *)malloc(sizeof(float) * (size_t)(E + p->moe_groups + 1));
        if (!gsc) { free(lg); free(lgf); free(idx); free(buf); return 1; }
        for (int64_t i = 0; i < B * d; ++i) X[i] = p->wbf16 ? (REAL)bf16_to_f32(f32_to_bf16((float)xn[i])) : xn[i];
        FN(weight_product)(p->router_wbf16 ? WF_BF16 : WF_PLAN, NULL, 0, B, E, d, p->Wr, NULL, X, NULL, lg,
                           p->nthreads);
        for (int64_t i = 0; i < B * E; ++i) lgf[i] = (float)lg[i];
        for (int64_t b = 0; b < B; ++b)
            moe_route_grouped_row(E, k, p->moe_groups, p->moe_topk_groups, p->norm_topk, (float)p->routed_scale,
                                  lgf + b * E, (const float *)p->e_bias, buf, gsc + E, gsc, idx + b * k, wf + b * k);
        free(gsc);
    } else {
    FN(weight_product)(fmt, NULL, 0, B, E, d, p->Wr, NULL, xn, NULL, lg, p->nthreads);
    for (int64_t i = 0; i < B * E; ++i) {
        const float v = (float)lg[i];
        lgf[i] = p->wbf16 ? bf16_to_f32(f32_to_bf16(v)) : v;
    }
    for (int64_t b = 0; b < B; ++b) moe_route_row(E, k, p->norm_topk, lgf + b * E, buf, idx + b * k, wf + b * k);
    if (p->wbf16)
        for (int64_t i = 0; i < B * k; ++i) wf[i] = bf16_to_f32(f32_to_bf16(wf[i]));
    }
    for (int64_t i = 0; i < B * d; ++i) acc[i] = 0;
    for (int64_t e = 0; e < E; ++e) {
        int64_t nb = 0;
        for (int64_t b = 0; b < B; ++b)
            for (int64_t j = 0; j < k; ++j)
                if (idx[b * k + j] == e) {
                    rows[nb] = b, wts[nb] = (REAL)wf[b * k + j];
                    memcpy(X + nb * d, xn + b * d, sizeof(REAL) * (size_t)d);
                    ++nb;
                }
        if (!nb) continue;
        const int64_t nu = (p->ffn_act ? 1 : 2) * I;   /* (ffn_act: non-gated relu^2 experts, Nemotron-H's) */
        const char *Wgu = (const char *)p->Weg + (size_t)(e * nu * d) * esz;
        const char *Wdn = (const char *)p->Wed + (size_t)(e * d * I) * esz;
        FN(weight_product)(fmt, NULL, 0, nb, nu, d, Wgu, NULL, X, NULL, U, p->nthreads);
        FN(ffn_hidden)(p->ffn_act, nb, I, U, G);
        FN(weight_product)(fmt, NULL, 0, nb, d, I, Wdn, NULL, G, NULL, Y, p->nthreads);
        for (int64_t r = 0; r < nb; ++r) {
            REAL *ab = acc + rows[r] * d;
            for (int64_t j = 0; j < d; ++j) ab[j] += Y[r * d + j] * wts[r];
        }
    }
    if (Is > 0) {
        FN(fused_product)(WEIGHT_FORMAT(p->wbf16, p->fmt_Wgu), p->sc_Wgu, p->grp_Wgu, p->nparts_Wgu, p->parts_Wgu,
                p->rows_Wgu, B, (p->ffn_act ? 1 : 2) * Is, d, p->Wgu, (const REAL *)p->bgu, xn, NULL, U, p->nthreads);
        FN(ffn_hidden)(p->ffn_act, B, Is, U, G);
        FN(weight_product)(WEIGHT_FORMAT(p->wbf16, p->fmt_Wd), p->sc_Wd, p->grp_Wd,
                B, d, Is, p->Wd, (const REAL *)p->bd, G, NULL, Y, p->nthreads);
        if (p->Wsg)
            FN(weight_product)(WEIGHT_FORMAT(p->wbf16, p->fmt_Wsg), p->sc_Wsg, p->grp_Wsg, B, 1, d, p->Wsg, NULL, xn,
                               NULL, sg, p->nthreads);
        for (int64_t b = 0; b < B; ++b) {
            const REAL s = p->Wsg ? (REAL)1 / ((REAL)1 + MATH(exp)(-sg[b])) : (REAL)1;
            for (int64_t j = 0; j < d; ++j) acc[b * d + j] += s * Y[b * d + j];
        }
    }
    if (p->res_scaled)   /* (the scaled residual orders: MiniMax's residual is the normed input xn) */
        FN(scaled_add)(B * d, p->res_scaled == 1 ? xn : h, p->res_a2, acc, p->res_b2, x_out);
    else
        for (int64_t i = 0; i < B * d; ++i) x_out[i] = h[i] + acc[i];
    free(lg); free(lgf); free(idx); free(buf);
    return 0;
}
#endif /* FN */
