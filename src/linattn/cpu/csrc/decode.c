/* Fused single-token decoding step of the delta-rule layers (DeltaNet, Gated DeltaNet, EFLA) and of linear
   attention (linear-space elementwise feature maps), issue 34.

   The layer's projections stay one matrix-vector product in torch (BLAS reads the fused weights at the memory
   rate; nothing to win there) and o_proj another; everything between them is one call here: the short
   convolution (window in, new window out), q/k normalisation, beta / EFLA's coefficient, the decay, the state
   update, the read-out, the output RMSNorm and the SiLU gate. Without this the step is ~40 small torch ops per
   layer whose dispatch costs more than the arithmetic.

   Inputs are raw contiguous buffers. The new state and conv window are written to fresh buffers (never in
   place): a cache copied for beam search may still share the old ones. The arithmetic follows the PyTorch
   fast step (layers/delta.py, layers/linear_attention.py) operation by operation, in the same precisions
   (fp32 model: key norms and EFLA's coefficient in fp64, like ops/delta_core.key_norms); only summation order
   differs. No -ffast-math (the build never passes it): inf/NaN propagate as in torch.

   The file is compiled for float and double from one body (DEFINE_* macros). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=fast")
#elif defined(__clang__)
#pragma clang fp contract(fast)
#endif

/* parallelise over (batch, value head) only when the state is big enough to pay for waking the threads */
#define PAR_MIN_ELEMS 65536
/* rows of a head's state prefetched ahead in the first pass over it */
#define PF_ROWS 8

/* exp(x) in a form the compiler vectorises (libm's exp is one call per element, and a decoded token takes ~7000
   for its SiLUs): x = n ln2 + r with |r| <= ln2 / 2 (Cody-Waite: ln2 in two parts, n rounded by the 1.5 2^k
   trick), e^r from its Taylor series (degree 7 in float, 13 in double: truncation far below half an ulp), times
   2^n as two exact powers of two so that overflow to inf and underflow to 0 come out of the last product. NaN,
   +inf and -inf give NaN, inf and 0, as exp does. Used by SiLU only. */
static inline float vexp_f32(float x) {
    const float xc = x != x ? 0.0f : (x < -110.0f ? -110.0f : (x > 90.0f ? 90.0f : x));
    const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f; p = p * r + 1.0f / 120.0f; p = p * r + 1.0f / 24.0f; p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f; p = p * r + 1.0f; p = p * r + 1.0f;
    const int32_t ni = (int32_t)n, n1 = ni >> 1, n2 = ni - n1;
    const uint32_t b1 = (uint32_t)(n1 + 127) << 23, b2 = (uint32_t)(n2 + 127) << 23;
    float s1, s2;
    memcpy(&s1, &b1, sizeof s1);
    memcpy(&s2, &b2, sizeof s2);
    return x != x ? x : p * s1 * s2;
}

static inline double vexp_f64(double x) {
    const double xc = x != x ? 0.0 : (x < -760.0 ? -760.0 : (x > 720.0 ? 720.0 : x));
    const double n = (xc * 1.44269504088896338700e+00 + 6755399441055744.0) - 6755399441055744.0;
    const double r = (xc - n * 6.93147180369123816490e-01) - n * 1.90821492927058770002e-10;
    double p = 1.0 / 6227020800.0;
    p = p * r + 1.0 / 479001600.0; p = p * r + 1.0 / 39916800.0; p = p * r + 1.0 / 3628800.0;
    p = p * r + 1.0 / 362880.0; p = p * r + 1.0 / 40320.0; p = p * r + 1.0 / 5040.0; p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0; p = p * r + 1.0 / 24.0; p = p * r + 1.0 / 6.0; p = p * r + 0.5; p = p * r + 1.0;
    p = p * r + 1.0;
    const int64_t ni = (int64_t)n, n1 = ni >> 1, n2 = ni - n1;
    const uint64_t b1 = (uint64_t)(n1 + 1023) << 52, b2 = (uint64_t)(n2 + 1023) << 52;
    double s1, s2;
    memcpy(&s1, &b1, sizeof s1);
    memcpy(&s2, &b2, sizeof s2);
    return x != x ? x : p * s1 * s2;
}

#define DEFINE_DECODE(SFX, real, SQRT, EXP, LOG1P, EXPM1)                                                            \
static inline real silu_##SFX(real x) { return x / ((real)1 + vexp_##SFX(-x)); }                               \
static real softplus_##SFX(real x) { return x > (real)20 ? x : LOG1P(EXP(x)); }                                \
                                                                                                                \
/* x[n] normalised in place: conv 0 "rsqrt" x * rsqrt(sum x^2 + eps), 1 "clamp" x / max(||x||, eps); a row   \
   whose sum of squares overflows is scaled by s = max(max |x|, 1) first (ops/l2norm.py, same result). */      \
static void l2norm_##SFX(real *restrict x, int64_t n, int conv, real eps) {                                     \
    real ss = 0, s = 1;                                                                                         \
    for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];                                                          \
    if (!isfinite(ss)) {                                                                                        \
        real m = 1;                                                                                             \
        for (int64_t i = 0; i < n; ++i) { real a = fabs(x[i]); if (a > m) m = a; }                              \
        if (isfinite(m)) {                                                                                      \
            s = m; ss = 0;                                                                                      \
            for (int64_t i = 0; i < n; ++i) { x[i] /= s; ss += x[i] * x[i]; }                                   \
        }                                                                                                       \
    }                                                                                                           \
    if (conv == 0) {                                                                                            \
        real r = (real)1 / SQRT(ss + eps / (s * s));                                                            \
        for (int64_t i = 0; i < n; ++i) x[i] *= r;                                                              \
    } else {                                                                                                    \
        real nrm = SQRT(ss), lo = eps / s;                                                                      \
        real den = nrm > lo ? nrm : (isnan(nrm) ? nrm : lo);                                                    \
        for (int64_t i = 0; i < n; ++i) x[i] /= den;                                                            \
    }                                                                                                           \
}                                                                                                               \
                                                                                                                \
/* the short convolution of one token over the first C channels of y [B, ldy] (q | k | v) into u [B, C]:     \
   window w_in [B, C, KC-1] (NULL: zeros) then the token; new window to w_out [B, C, KC-1]. */                  \
static void conv_##SFX(int64_t B, int64_t C, int64_t KC, const real *y, int64_t ldy, const real *w_in,          \
                       const real *cw, const real *cb, int act, real *w_out, real *u) {                         \
    const int64_t W = KC - 1;                                                                                   \
    if (W == 3 && w_in) {   /* the default kernel size 4, one vectorised pass per row */                        \
        for (int64_t b = 0; b < B; ++b) {                                                                       \
            const real *restrict wi = w_in + b * C * 3, *restrict yb = y + b * ldy;                             \
            real *restrict wo = w_out + b * C * 3, *restrict ub = u + b * C;                                    \
            _Pragma("omp simd")                                                                                 \
            for (int64_t c = 0; c < C; ++c) {                                                                   \
                const real *wc = cw + c * 4, xt = yb[c];                                                        \
                real acc = 0;                                                                                   \
                acc += wi[3 * c] * wc[0]; acc += wi[3 * c + 1] * wc[1]; acc += wi[3 * c + 2] * wc[2];           \
                acc += xt * wc[3];                                                                              \
                if (cb) acc += cb[c];                                                                           \
                ub[c] = act ? silu_##SFX(acc) : acc;                                                            \
                wo[3 * c] = wi[3 * c + 1]; wo[3 * c + 1] = wi[3 * c + 2]; wo[3 * c + 2] = xt;                   \
            }                                                                                                   \
        }                                                                                                       \
        return;                                                                                                 \
    }                                                                                                           \
    for (int64_t b = 0; b < B; ++b)                                                                             \
        for (int64_t c = 0; c < C; ++c) {                                                                       \
            const real *win = w_in ? w_in + (b * C + c) * W : NULL;                                             \
            const real *wc = cw + c * KC;                                                                       \
            real *wo = w_out + (b * C + c) * W;                                                                 \
            real xt = y[b * ldy + c], acc = 0;                                                                  \
            for (int64_t j = 0; j < W; ++j) acc += (win ? win[j] : (real)0) * wc[j];                            \
            acc += xt * wc[W];                                                                                  \
            if (cb) acc += cb[c];                                                                               \
            u[b * C + c] = act ? silu_##SFX(acc) : acc;                                                         \
            for (int64_t j = 0; j + 1 < W; ++j) wo[j] = win ? win[j + 1] : (real)0;                             \
            if (W > 0) wo[W - 1] = xt;                                                                          \
        }                                                                                                       \
}                                                                                                               \
                                                                                                                \
/* RMSNorm over V (weight nw or NULL) and the SiLU gate (g or NULL), in place */                                \
static void outnorm_##SFX(real *restrict o, int64_t V, int has_norm, const real *nw, double eps,                \
                          const real *g) {                                                                      \
    if (has_norm) {                                                                                             \
        real ms = 0;                                                                                            \
        for (int64_t j = 0; j < V; ++j) ms += o[j] * o[j];                                                      \
        real r = (real)1 / SQRT(ms / (real)V + (real)eps);                                                      \
        for (int64_t j = 0; j < V; ++j) o[j] = o[j] * r * (nw ? nw[j] : (real)1);                               \
    }                                                                                                           \
    if (g)                                                                                                      \
        _Pragma("omp simd")                                                                                     \
        for (int64_t j = 0; j < V; ++j) o[j] *= silu_##SFX(g[j]);                                               \
}                                                                                                               \
                                                                                                                \
/* Delta-rule layers. y [B, ldy] = [q H*K | k H*K | v HV*V | b HV | a HV (gated) | gate HV*V (has_gate)]       \
   (q, k, v before the conv when KC > 0). kind 0: DeltaNet / Gated DeltaNet (q, k l2-normalised by l2conv),  \
   1: EFLA (q by "rsqrt" when q_l2, keys kept; exact coefficient). beta_mode 0 sigmoid, 1 adaptive (alpha),   \
   2 loose. neg_a = -exp(A_log), dt_bias [HV] when gated. S_in [B, HV, K, V] or NULL -> S_out; out [B, HV*V]. \
   Returns 0, or 1 when out of memory. */                                                                       \
int linattn_decode_delta_##SFX(int64_t B, int64_t H, int64_t HV, int64_t K, int64_t V, const real *y,          \
        int64_t ldy, int64_t KC, const real *w_in, const real *cw, const real *cb, int conv_act, real *w_out,   \
        int kind, int l2conv, int q_l2, double l2eps, double scale, int beta_mode, const real *alpha,           \
        int gated, const real *neg_a, const real *dt_bias, const real *S_in, real *S_out, int has_norm,         \
        const real *nw, double norm_eps, int has_gate, real *out, int nthreads) {                               \
    const int64_t C = 2 * H * K + HV * V, G = HV / H;                                                           \
    /* work: the prepared q | k | v per batch row [B, C], then d (key rescaling) and lam per (b, h) */          \
    real *u = (real *)malloc(sizeof(real) * (size_t)(B * C + 1));                                               \
    double *dd = (double *)malloc(sizeof(double) * (size_t)(2 * B * H + 1));                                    \
    if (!u || !dd) { free(u); free(dd); return 1; }                                                             \
    if (KC > 0) conv_##SFX(B, C, KC, y, ldy, w_in, cw, cb, conv_act, w_out, u);                                 \
    else for (int64_t b = 0; b < B; ++b) memcpy(u + b * C, y + b * ldy, sizeof(real) * (size_t)C);             \
    for (int64_t b = 0; b < B; ++b)                                                                             \
        for (int64_t h = 0; h < H; ++h) {                                                                       \
            real *q = u + b * C + h * K, *k = u + b * C + H * K + h * K;                                        \
            if (kind == 0) { l2norm_##SFX(q, K, l2conv, (real)l2eps); l2norm_##SFX(k, K, l2conv, (real)l2eps); }\
            else if (q_l2) l2norm_##SFX(q, K, 0, (real)l2eps);                                                  \
            for (int64_t i = 0; i < K; ++i) q[i] = q[i] * (real)scale;                                          \
            /* key norms (ops/delta_core.key_norms): lam = ||k||^2, the fp32 sum unless it overflowed */        \
            real lr = 0;                                                                                        \
            for (int64_t i = 0; i < K; ++i) lr += k[i] * k[i];                                                  \
            double lam = lr;                                                                                    \
            if (!isfinite(lr)) { lam = 0; for (int64_t i = 0; i < K; ++i) lam += (double)k[i] * (double)k[i]; } \
            double d2 = lam > 1.0 ? lam : (isnan(lam) ? lam : 1.0);                                             \
            real d = (real)sqrt(d2);                                                                            \
            for (int64_t i = 0; i < K; ++i) k[i] = k[i] / d;                                                    \
            dd[2 * (b * H + h)] = d2; dd[2 * (b * H + h) + 1] = lam;                                            \
        }                                                                                                       \
    const int64_t nb = B * HV;                                                                                  \
    const int par = nb > 1 && nb * K * V >= PAR_MIN_ELEMS;                                                      \
    _Pragma("omp parallel for num_threads(nthreads) schedule(static) if(par)")                                  \
    for (int64_t t = 0; t < nb; ++t) {                                                                          \
        const int64_t b = t / HV, hv = t % HV, h = hv / G;                                                      \
        const real *q = u + b * C + h * K, *k = u + b * C + H * K + h * K, *v = u + b * C + 2 * H * K + hv * V;  \
        const real *yb = y + b * ldy + C;                                                                       \
        const double d2 = dd[2 * (b * H + h)], lam = dd[2 * (b * H + h) + 1];                                   \
        const real d = (real)sqrt(d2);                                                                          \
        real bt = yb[hv];                                                                                       \
        real beta = beta_mode == 2 ? softplus_##SFX(bt) : (real)1 / ((real)1 + EXP(-bt));                       \
        if (beta_mode == 1) beta = softplus_##SFX(alpha[hv]) * beta;                                            \
        double a = beta;                                                                                        \
        if (kind == 1) {   /* EFLA: (1 - exp(-beta lam)) / lam, its series below x = 1e-3 (delta_core) */      \
            double x = a * lam;                                                                                 \
            a = x < 1e-3 ? a * (1 - x / 2 * (1 - x / 3 * (1 - x / 4))) : -expm1(-a * lam) / lam;                \
        }                                                                                                       \
        const real ar = (real)(a * d2);                                                                         \
        real decay = 1;                                                                                         \
        if (gated) decay = EXP(neg_a[hv] * softplus_##SFX(yb[HV + hv] + dt_bias[hv]));                          \
        const real *S0 = S_in ? S_in + t * K * V : NULL;                                                        \
        real *S = S_out + t * K * V;                                                                            \
        real *o = out + t * V;                                                                                  \
        /* o is scratch for err = a (v / d) - a (k^T (decay S0)) first */                                       \
        for (int64_t j = 0; j < V; ++j) o[j] = 0;                                                               \
        if (S0) {                                                                                               \
            for (int64_t i = 0; i < K; ++i) {                                                                   \
                const real *restrict s0 = S0 + i * V;                                                           \
                real *restrict s = S + i * V;                                                                   \
                const real ki = k[i];                                                                           \
                if (i + PF_ROWS < K)   /* the old state and the fresh output a few rows ahead (not cached) */   \
                    for (int64_t c = 0; c < V; c += 64 / (int64_t)sizeof(real)) {                               \
                        __builtin_prefetch(s0 + PF_ROWS * V + c, 0, 3);                                         \
                        __builtin_prefetch(s + PF_ROWS * V + c, 1, 3);                                          \
                    }                                                                                           \
                _Pragma("omp simd")                                                                             \
                for (int64_t j = 0; j < V; ++j) { real sv = gated ? s0[j] * decay : s0[j]; s[j] = sv;          \
                                                  o[j] += ki * sv; }                                            \
            }                                                                                                   \
        } else memset(S, 0, sizeof(real) * (size_t)(K * V));                                                    \
        for (int64_t j = 0; j < V; ++j) o[j] = (v[j] / d) * ar - ar * o[j];                                     \
        for (int64_t i = 0; i < K; ++i) {                                                                       \
            real *restrict s = S + i * V;                                                                       \
            const real ki = k[i];                                                                               \
            _Pragma("omp simd")                                                                                 \
            for (int64_t j = 0; j < V; ++j) s[j] += ki * o[j];                                                  \
        }                                                                                                       \
        for (int64_t j = 0; j < V; ++j) o[j] = 0;                                                               \
        for (int64_t i = 0; i < K; ++i) {                                                                       \
            const real *restrict s = S + i * V;                                                                 \
            const real qi = q[i];                                                                               \
            _Pragma("omp simd")                                                                                 \
            for (int64_t j = 0; j < V; ++j) o[j] += qi * s[j];                                                  \
        }                                                                                                       \
        outnorm_##SFX(o, V, has_norm, nw, norm_eps, has_gate ? y + b * ldy + ldy - HV * V + hv * V : NULL);     \
    }                                                                                                           \
    free(u); free(dd);                                                                                          \
    return 0;                                                                                                   \
}                                                                                                               \
                                                                                                                \
/* Linear attention, linear-space elementwise map fmap (0 identity, 1 elu+1, 2 relu) applied to q*scale and  \
   k. y [B, ldy] = [q H*K | k H*K | v HV*V | a HV (gate_kind 2) | gate HV*V (has_gate)]. The state is         \
   [kv | z] as one [B, HV, K, V+1]. gate_kind 0 none, 1 retnet (decay [HV] given), 2 scalar (neg_a, dt_bias:  \
   Mamba2's log-decay). normalize: o / floor(den) with the floor eps (nonneg: clamp_min, else sign-keeping). */ \
int linattn_decode_linear_##SFX(int64_t B, int64_t H, int64_t HV, int64_t K, int64_t V, const real *y,         \
        int64_t ldy, int64_t KC, const real *w_in, const real *cw, const real *cb, int conv_act, real *w_out,   \
        int fmap, double scale, int gate_kind, const real *decay_h, const real *neg_a, const real *dt_bias,     \
        const real *S_in, real *S_out, int normalize, int nonneg, double eps, int has_norm, const real *nw,     \
        double norm_eps, int has_gate, real *out, int nthreads) {                                               \
    const int64_t C = 2 * H * K + HV * V, G = HV / H, V1 = V + 1;                                               \
    real *u = (real *)malloc(sizeof(real) * (size_t)(B * C + 1));                                               \
    if (!u) return 1;                                                           \
    if (KC > 0) conv_##SFX(B, C, KC, y, ldy, w_in, cw, cb, conv_act, w_out, u);                                 \
    else for (int64_t b = 0; b < B; ++b) memcpy(u + b * C, y + b * ldy, sizeof(real) * (size_t)C);             \
    for (int64_t b = 0; b < B; ++b)                                                                             \
        for (int64_t i = 0; i < 2 * H * K; ++i) {                                                               \
            real x = u[b * C + i];                                                                              \
            if (i < H * K && scale != 1.0) x = x * (real)scale;                                                 \
            if (fmap == 1) x = x > 0 ? x + (real)1 : EXPM1(x) + (real)1;   /* F.elu(x) + 1 */        \
            else if (fmap == 2) x = x > 0 ? x : (isnan(x) ? x : (real)0);                                       \
            u[b * C + i] = x;                                                                                   \
        }                                                                                                       \
    const int64_t nb = B * HV;                                                                                  \
    const int par = nb > 1 && nb * K * V1 >= PAR_MIN_ELEMS;                                                     \
    _Pragma("omp parallel for num_threads(nthreads) schedule(static) if(par)")                                  \
    for (int64_t t = 0; t < nb; ++t) {                                                                          \
        const int64_t b = t / HV, hv = t % HV, h = hv / G;                                                      \
        const real *fq = u + b * C + h * K, *fk = u + b * C + H * K + h * K, *v = u + b * C + 2 * H * K + hv * V;\
        const real *yb = y + b * ldy + C;                                                                       \
        real decay = 1;                                                                                         \
        if (gate_kind == 1) decay = decay_h[hv];                                                                \
        else if (gate_kind == 2) decay = EXP(neg_a[hv] * softplus_##SFX(yb[hv] + dt_bias[hv]));                 \
        const real *S0 = S_in ? S_in + t * K * V1 : NULL;                                                       \
        real *S = S_out + t * K * V1;                                                                           \
        real *o = out + t * V;                                                                                  \
        real dn = 0;                                                                                            \
        for (int64_t j = 0; j < V; ++j) o[j] = 0;                                                               \
        for (int64_t i = 0; i < K; ++i) {                                                                       \
            const real *restrict s0 = S0 ? S0 + i * V1 : NULL;                                                  \
            real *restrict s = S + i * V1;                                                                      \
            const real ki = fk[i], qi = fq[i];                                                                  \
            if (s0) {                                                                                           \
                _Pragma("omp simd")                                                                             \
                for (int64_t j = 0; j < V; ++j) s[j] = (gate_kind ? decay * s0[j] : s0[j]) + ki * v[j];        \
                s[V] = (gate_kind ? decay * s0[V] : s0[V]) + ki;                                                \
            } else {                                                                                            \
                _Pragma("omp simd")                                                                             \
                for (int64_t j = 0; j < V; ++j) s[j] = ki * v[j];                                               \
                s[V] = ki;                                                                                      \
            }                                                                                                   \
            _Pragma("omp simd")                                                                                 \
            for (int64_t j = 0; j < V; ++j) o[j] += qi * s[j];                                                  \
            dn += qi * s[V];                                                                                    \
        }                                                                                                       \
        if (normalize) {                                                                                        \
            real e = (real)eps;                                                                                 \
            if (nonneg) dn = dn < e ? (isnan(dn) ? dn : e) : dn;                                                \
            else if (dn < 0) dn = dn < -e ? dn : -e;                                                            \
            else dn = dn > e ? dn : (isnan(dn) ? dn : e);                                                       \
            for (int64_t j = 0; j < V; ++j) o[j] = o[j] / dn;                                                   \
        }                                                                                                       \
        outnorm_##SFX(o, V, has_norm, nw, norm_eps, has_gate ? y + b * ldy + ldy - HV * V + hv * V : NULL);     \
    }                                                                                                           \
    free(u);                                                                                         \
    return 0;                                                                                                   \
}

DEFINE_DECODE(f32, float, sqrtf, expf, log1pf, expm1f)
DEFINE_DECODE(f64, double, sqrt, exp, log1p, expm1)

/* A whole pre-norm block of one decoded token in one call (issue 34: the per-op dispatch of ~15 torch calls per
   layer cost more than the weights' memory traffic):

       h = x + o_proj(mixer(rmsnorm1(x))),   x_out = h + w_down(silu(a) * b), [a | b] = w_gate_up(rmsnorm2(h))

   (no FFN: x_out = h). The mixer is the delta or linear step above on the fused projection y = W rmsnorm1(x) + Wb.
   Everything per layer that does not change from token to token is one plan (the struct below, built once in
   cpu/decode.py and checked against the parameters' versions there), so a token costs one call with 6
   buffers. The matrix-vector products read each weight row once, 4 rows at a time (memory-bound at batch 1). */
typedef struct {
    int64_t B, H, HV, K, V, d, ny, KC, hid;
    int32_t kind, conv_act, dkind, l2conv, q_l2, beta_mode, gated, fmap, gate_kind, normalize, nonneg, has_norm,
            has_gate, has_ffn, nthreads, wbf16;   /* wbf16: W, Wo, Wgu, Wd stored as bf16 (f32 compute only) */
    double l2eps, scale, eps, norm_eps, n1eps, n2eps;
    const void *n1w, *W, *Wb, *cw, *cb, *alpha, *neg_a, *dt_bias, *decay, *nw, *Wo, *n2w, *Wgu, *bgu, *Wd, *bd;
    /* softmax attention (kind 2; H query heads, kvh key/value heads of K / V, HV = H): q, k, v (and the gate's)
       projections Wq.. in the weights' storage, per-head q/k RMSNorm weights qnw / knw (qk_norm), RoPE on the
       first rot channels of each head (inv_freq [rot/2] doubles; rope_f32: angles and cos / sin in float, times
       rope_scale, as transformers; else in double, as layers/common.RotaryEmbedding), an output gate (att_gate 1:
       its own projection Wg, 2: the second half of each head's q_proj rows, Qwen3-Next's; gate_sig: sigmoid, else
       SiLU). Set per call: the KV cache kc / vc [B, kv_cap, kvh, K / V] (bf16 when kv_bf16, else the plan's
       type), the new token's row kv_len, its position pos[b] (NULL: pos0 for every row) and its first visible
       key lo[b] (NULL: lo0). */
    int64_t kvh, rot, kv_cap, kv_len, pos0, lo0;
    int32_t att_gate, gate_sig, qk_norm, kv_bf16, rope_f32, pad2_;
    double qk_eps, rope_scale;
    const void *Wq, *bq, *Wk, *bk, *Wv, *bv, *Wg, *qnw, *knw, *inv_freq;
    void *kc, *vc;
    const int64_t *pos, *lo;
    /* the matrices' formats (qmatvec.h WF_*; 0: as wbf16 says), bf16 scales and int4 groups */
    int32_t fmt_W, fmt_Wo, fmt_Wgu, fmt_Wd, fmt_Wq, fmt_Wk, fmt_Wv, fmt_Wg;
    int64_t grp_W, grp_Wo, grp_Wgu, grp_Wd, grp_Wq, grp_Wk, grp_Wv, grp_Wg;
    const void *sc_W, *sc_Wo, *sc_Wgu, *sc_Wd, *sc_Wq, *sc_Wk, *sc_Wv, *sc_Wg;
} linattn_block_plan;

/* The matrix-vector products stream every weight once per token (from memory at batch 1: the model is bigger
   than L2). Four rows are read at once, one 64-byte line of each per step into four vector accumulators (GCC /
   clang vector types; the rows' lengths a multiple of a line), with the weights MV_PF_BYTES ahead prefetched
   into L2 at the pace they are read: the hardware prefetcher follows four interleaved rows of one page poorly,
   and without it the products ran at ~55% of the rate of the same loop with it when the weights sat in L3 (the
   interleaved bench decode, and any model that fits L3), ~4% slower from memory. */
#define MV_PF_BYTES 4096
#if defined(__GNUC__)
#define HAVE_VLINE 1
typedef float vline_f32 __attribute__((vector_size(64), aligned(4)));
typedef double vline_f64 __attribute__((vector_size(64), aligned(8)));
/* the sum of a line's elements, pairwise (the same order everywhere: the per-block and whole-model steps agree
   bit for bit) */
static inline float vsum_f32(vline_f32 a) {
    float t[16];
    memcpy(t, &a, sizeof t);
    for (int h = 8; h >= 1; h /= 2)
        for (int k = 0; k < h; ++k) t[k] += t[k + h];
    return t[0];
}
static inline double vsum_f64(vline_f64 a) {
    double t[8];
    memcpy(t, &a, sizeof t);
    for (int h = 4; h >= 1; h /= 2)
        for (int k = 0; k < h; ++k) t[k] += t[k + h];
    return t[0];
}
#define MV_LINES(SFX, real)                                                                                     \
    if (r == 4 && m % (int64_t)(64 / sizeof(real)) == 0) {                                                      \
        const int64_t VL = 64 / sizeof(real);                                                                   \
        const real *w0 = W + i0 * m, *w1 = w0 + m, *w2 = w1 + m, *w3 = w2 + m;                                  \
        const char *pf = (const char *)w0 + MV_PF_BYTES, *pf_end = (const char *)(W + n * m) - 256;             \
        for (int64_t b = 0; b < B; ++b) {                                                                       \
            const real *xb = x + b * m;                                                                         \
            vline_##SFX a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                                 \
            for (int64_t j = 0; j < m; j += VL) {                                                               \
                if (b == 0 && pf <= pf_end) {   /* four lines ahead for the four read */                        \
                    __builtin_prefetch(pf, 0, 2); __builtin_prefetch(pf + 64, 0, 2);                             \
                    __builtin_prefetch(pf + 128, 0, 2); __builtin_prefetch(pf + 192, 0, 2);                      \
                    pf += 256;                                                                                  \
                }                                                                                               \
                const vline_##SFX xv = *(const vline_##SFX *)(xb + j);                                          \
                a0 += *(const vline_##SFX *)(w0 + j) * xv; a1 += *(const vline_##SFX *)(w1 + j) * xv;           \
                a2 += *(const vline_##SFX *)(w2 + j) * xv; a3 += *(const vline_##SFX *)(w3 + j) * xv;           \
            }                                                                                                   \
            const real acc[4] = {vsum_##SFX(a0), vsum_##SFX(a1), vsum_##SFX(a2), vsum_##SFX(a3)};               \
            for (int64_t rr = 0; rr < 4; ++rr) {                                                                \
                const int64_t i = i0 + rr;                                                                      \
                real v = acc[rr];                                                                               \
                if (bias) v = v + bias[i];                                                                      \
                y[b * n + i] = add ? add[b * n + i] + v : v;                                                    \
            }                                                                                                   \
        }                                                                                                       \
        return;                                                                                                 \
    }
#else
#define MV_LINES(SFX, real)
#endif

/* bf16 weights (the upper half of an fp32: converting is a 16-bit shift, exact), read by the matrix-vector
   products of an f32 plan with wbf16 set: half the bytes per decoded token, fp32 accumulation in the same order
   as the fp32 products over the bf16-rounded weights (one line of 16 weights per row and step, the same vector
   accumulators and pairwise sums), so the two agree to the last bit where both take the vector path. */
static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp32 -> bf16, rounded to nearest even (NaN kept a quiet NaN), as torch's .to(torch.bfloat16) */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if defined(HAVE_VLINE)
typedef uint16_t vhalf_u16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t vline_u32 __attribute__((vector_size(64)));
static inline vline_f32 bf16_line(const uint16_t *w) {
    const vline_u32 u = __builtin_convertvector(*(const vhalf_u16 *)w, vline_u32) << 16;
    vline_f32 f;
    memcpy(&f, &u, sizeof f);
    return f;
}
#endif

/* rows i0 .. i0+3 of y = add + W x + bias, W [n, m] bf16 (matvec_rows_f32's loops on converted weights) */
static void matvec_rows_bf16(int64_t B, int64_t n, int64_t m, int64_t i0, const uint16_t *W, const float *bias,
                             const float *x, const float *add, float *y) {
    const int64_t r = n - i0 < 4 ? n - i0 : 4;
#if defined(HAVE_VLINE)
    if (r == 4 && m % 16 == 0) {
        const uint16_t *w0 = W + i0 * m, *w1 = w0 + m, *w2 = w1 + m, *w3 = w2 + m;
        const char *pf = (const char *)w0 + MV_PF_BYTES, *pf_end = (const char *)(W + n * m) - 128;
        for (int64_t b = 0; b < B; ++b) {
            const float *xb = x + b * m;
            vline_f32 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t j = 0; j < m; j += 16) {
                if (b == 0 && pf <= pf_end) {   /* two lines ahead for the two (4 x 32 bytes) read */
                    __builtin_prefetch(pf, 0, 2); __builtin_prefetch(pf + 64, 0, 2);
                    pf += 128;
                }
                const vline_f32 xv = *(const vline_f32 *)(xb + j);
                a0 += bf16_line(w0 + j) * xv; a1 += bf16_line(w1 + j) * xv;
                a2 += bf16_line(w2 + j) * xv; a3 += bf16_line(w3 + j) * xv;
            }
            const float acc[4] = {vsum_f32(a0), vsum_f32(a1), vsum_f32(a2), vsum_f32(a3)};
            for (int64_t rr = 0; rr < 4; ++rr) {
                const int64_t i = i0 + rr;
                float v = acc[rr];
                if (bias) v = v + bias[i];
                y[b * n + i] = add ? add[b * n + i] + v : v;
            }
        }
        return;
    }
#endif
    for (int64_t b = 0; b < B; ++b) {
        const float *restrict xb = x + b * m;
        float acc[4] = {0, 0, 0, 0};
        if (r == 4) {
            const uint16_t *restrict w0 = W + i0 * m, *restrict w1 = w0 + m, *restrict w2 = w1 + m,
                           *restrict w3 = w2 + m;
            float a0 = 0, a1 = 0, a2 = 0, a3 = 0;
            _Pragma("omp simd reduction(+:a0,a1,a2,a3)")
            for (int64_t j = 0; j < m; ++j) {
                const float xj = xb[j];
                a0 += bf16_to_f32(w0[j]) * xj; a1 += bf16_to_f32(w1[j]) * xj;
                a2 += bf16_to_f32(w2[j]) * xj; a3 += bf16_to_f32(w3[j]) * xj;
            }
            acc[0] = a0; acc[1] = a1; acc[2] = a2; acc[3] = a3;
        } else
            for (int64_t rr = 0; rr < r; ++rr) {
                const uint16_t *restrict w = W + (i0 + rr) * m;
                float a = 0;
                _Pragma("omp simd reduction(+:a)")
                for (int64_t j = 0; j < m; ++j) a += bf16_to_f32(w[j]) * xb[j];
                acc[rr] = a;
            }
        for (int64_t rr = 0; rr < r; ++rr) {
            const int64_t i = i0 + rr;
            float v = acc[rr];
            if (bias) v = v + bias[i];
            y[b * n + i] = add ? add[b * n + i] + v : v;
        }
    }
}

static void matvec_bf16(int64_t B, int64_t n, int64_t m, const uint16_t *W, const float *bias, const float *x,
                        const float *add, float *y, int nthreads) {
    if (nthreads > 1 && n * m >= PAR_MIN_ELEMS) {
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)")
        for (int64_t i0 = 0; i0 < n; i0 += 4) matvec_rows_bf16(B, n, m, i0, W, bias, x, add, y);
    } else
        for (int64_t i0 = 0; i0 < n; i0 += 4) matvec_rows_bf16(B, n, m, i0, W, bias, x, add, y);
}

#include "qmatvec.h"

/* a weight matrix's product in its format (qmatvec.h: f32 plans read fp32, bf16, int8 or int4; f64 plans fp64) */
#define MATVEC_W_f32(fmt, sc, grp, B, n, m, W, bias, x, add, y, nt)                                            \
    matvec_w_f32(fmt, W, sc, grp, B, n, m, bias, x, add, y, nt)
#define MATVEC_W_f64(fmt, sc, grp, B, n, m, W, bias, x, add, y, nt)                                            \
    matvec_f64(B, n, m, (const double *)(W), bias, x, add, y, nt)

/* one key / value element of the cache, as the plan computes (bf16 or the plan's type) */
#define KV_GET(bf, base, i, real) ((bf) ? (real)bf16_to_f32(((const uint16_t *)(base))[i]) : ((const real *)(base))[i])
#define KV_PUT(bf, base, i, x, real) do { if (bf) ((uint16_t *)(base))[i] = f32_to_bf16((float)(x));            \
                                          else ((real *)(base))[i] = (x); } while (0)

#define DEFINE_SOFTMAX(SFX, real, SQRT, EXP)                                                                    \
/* the rotation of one head's first R channels (rotate-half form) by cos c / sin s [R/2] */                   \
static void rope_head_##SFX(real *restrict x, int64_t R, const real *c, const real *s) {                       \
    const int64_t h = R / 2;                                                                                    \
    for (int64_t i = 0; i < h; ++i) {                                                                           \
        const real x1 = x[i], x2 = x[i + h];                                                                    \
        x[i] = x1 * c[i] - x2 * s[i];                                                                           \
        x[i + h] = x2 * c[i] + x1 * s[i];                                                                       \
    }                                                                                                           \
}                                                                                                               \
                                                                                                                \
/* Softmax attention of one token (kind 2) on xn [B, d] (the normed input) into o [B, H * V]: the projections  \
   into y, per-head q / k norms, RoPE, the new k / v written into the cache at row kv_len, softmax over the     \
   visible keys lo .. kv_len with the maximum subtracted (in the plan's type, fp32 for bf16 weights), the       \
   output gate. Returns 0, or 1 when out of memory. */                                                          \
static int softmax_mix_##SFX(const linattn_block_plan *p, const real *xn, real *y, real *o) {                  \
    const int64_t B = p->B, d = p->d, H = p->H, G = p->kvh, D = p->K, Dv = p->V, R = p->rot;                    \
    const int64_t qw = p->att_gate == 2 ? 2 * D : D, nq = H * qw, nk = G * D, nv = G * Dv, grp = H / G;        \
    const int64_t L = p->kv_len + 1, cap = p->kv_cap, row = p->kv_len;                                          \
    const int kb = p->kv_bf16;                                                                                  \
    real *q = y, *k = q + B * nq, *v = k + B * nk, *g = v + B * nv;                                             \
    MATVEC_W_##SFX(WEIGHT_FORMAT(p->wbf16, p->fmt_Wq), p->sc_Wq, p->grp_Wq,                                     \
            B, nq, d, p->Wq, (const real *)p->bq, xn, NULL, q, p->nthreads);                                    \
    MATVEC_W_##SFX(WEIGHT_FORMAT(p->wbf16, p->fmt_Wk), p->sc_Wk, p->grp_Wk,                                     \
            B, nk, d, p->Wk, (const real *)p->bk, xn, NULL, k, p->nthreads);                                    \
    MATVEC_W_##SFX(WEIGHT_FORMAT(p->wbf16, p->fmt_Wv), p->sc_Wv, p->grp_Wv,                                     \
            B, nv, d, p->Wv, (const real *)p->bv, xn, NULL, v, p->nthreads);                                    \
    if (p->att_gate == 1) MATVEC_W_##SFX(WEIGHT_FORMAT(p->wbf16, p->fmt_Wg), p->sc_Wg, p->grp_Wg,               \
            B, H * Dv, d, p->Wg, NULL, xn, NULL, g, p->nthreads);                                               \
    real *ws = (real *)malloc(sizeof(real) * (size_t)(H * L + R + 1));                                          \
    if (!ws) return 1;                                                                                          \
    real *cs = ws + H * L, *sn = cs + R / 2;                                                                    \
    const double *inv = (const double *)p->inv_freq;                                                            \
    const real *qnw = (const real *)p->qnw, *knw = (const real *)p->knw;                                        \
    const real scale = (real)p->scale;                                                                          \
    for (int64_t b = 0; b < B; ++b) {                                                                           \
        const int64_t pos = p->pos ? p->pos[b] : p->pos0, lo = p->lo ? p->lo[b] : p->lo0;                      \
        for (int64_t i = 0; i < R / 2; ++i) {                                                                   \
            if (p->rope_f32) {                                                                                  \
                const float a = (float)pos * (float)inv[i];                                                     \
                cs[i] = (real)(cosf(a) * (float)p->rope_scale); sn[i] = (real)(sinf(a) * (float)p->rope_scale); \
            } else {                                                                                            \
                const double a = (double)pos * inv[i];                                                          \
                cs[i] = (real)cos(a); sn[i] = (real)sin(a);                                                     \
            }                                                                                                   \
        }                                                                                                       \
        for (int64_t h = 0; h < H; ++h) {                                                                       \
            real *qh = q + b * nq + h * qw;                                                                     \
            if (p->qk_norm) rmsnorm_##SFX(1, D, qh, qnw, p->qk_eps, qh);                                        \
            if (R) rope_head_##SFX(qh, R, cs, sn);                                                              \
        }                                                                                                       \
        for (int64_t j = 0; j < G; ++j) {                                                                       \
            real *kh = k + b * nk + j * D;                                                                      \
            if (p->qk_norm) rmsnorm_##SFX(1, D, kh, knw, p->qk_eps, kh);                                        \
            if (R) rope_head_##SFX(kh, R, cs, sn);                                                              \
            const int64_t ko = ((b * cap + row) * G + j) * D, vo = ((b * cap + row) * G + j) * Dv;             \
            for (int64_t i = 0; i < D; ++i) KV_PUT(kb, p->kc, ko + i, kh[i], real);                                   \
            for (int64_t i = 0; i < Dv; ++i) KV_PUT(kb, p->vc, vo + i, v[b * nv + j * Dv + i], real);                 \
        }                                                                                                       \
        /* the heads in parallel only where the keys they read pay for waking the threads */                  \
        const int par = p->nthreads > 1 && H > 1 && H * (L - lo) * (D + Dv) >= PAR_MIN_ELEMS;                  \
        _Pragma("omp parallel for num_threads(p->nthreads) schedule(static) if(par)")                          \
        for (int64_t h = 0; h < H; ++h) {                                                                       \
            const real *qh = q + b * nq + h * qw;                                                               \
            const int64_t j = h / grp;                                                                          \
            real *restrict w = ws + h * L;                                                                      \
            real m = -INFINITY, den = 0;                                                                        \
            int nan = 0;                                                                                        \
            for (int64_t t = lo; t < L; ++t) {                                                                  \
                const int64_t ko = ((b * cap + t) * G + j) * D;                                                 \
                real s = 0;                                                                                     \
                for (int64_t i = 0; i < D; ++i) s += qh[i] * KV_GET(kb, p->kc, ko + i, real);                   \
                s *= scale;                                                                                     \
                w[t] = s;                                                                                       \
                nan |= s != s;                                                                                  \
                if (s > m) m = s;                                                                               \
            }                                                                                                   \
            real *oh = o + b * H * Dv + h * Dv;                                                                 \
            for (int64_t i = 0; i < Dv; ++i) oh[i] = 0;                                                         \
            for (int64_t t = lo; t < L; ++t) {                                                                  \
                const real e = nan ? (real)NAN : EXP(w[t] - m);                                                 \
                const int64_t vo = ((b * cap + t) * G + j) * Dv;                                                \
                den += e;                                                                                       \
                for (int64_t i = 0; i < Dv; ++i) oh[i] += e * KV_GET(kb, p->vc, vo + i, real);                  \
            }                                                                                                   \
            const real *gh = p->att_gate == 1 ? g + b * H * Dv + h * Dv : p->att_gate == 2 ? qh + D : NULL;     \
            for (int64_t i = 0; i < Dv; ++i) {                                                                  \
                real r = oh[i] / den;                                                                           \
                if (gh) r *= p->gate_sig ? (real)1 / ((real)1 + EXP(-gh[i])) : silu_##SFX(gh[i]);              \
                oh[i] = r;                                                                                      \
            }                                                                                                   \
        }                                                                                                       \
    }                                                                                                           \
    free(ws);                                                                                                   \
    return 0;                                                                                                   \
}

#define DEFINE_BLOCK(SFX, real, SQRT, EXP)                                                                      \
/* rows i0 .. i0+3 of y[b, i] = (add ? add[b, i] : 0) + (W x[b])_i + (bias ? bias[i] : 0) for every b, W [n, m]   \
   rows contiguous (at batch > 1 the 4 rows are read from memory once, then from L1) */                        \
static void matvec_rows_##SFX(int64_t B, int64_t n, int64_t m, int64_t i0, const real *W, const real *bias,     \
                              const real *x, const real *add, real *y) {                                        \
    const int64_t r = n - i0 < 4 ? n - i0 : 4;                                                                  \
    MV_LINES(SFX, real)                                                                                         \
    for (int64_t b = 0; b < B; ++b) {                                                                           \
        const real *restrict xb = x + b * m;                                                                    \
        real acc[4] = {0, 0, 0, 0};                                                                             \
        if (r == 4) {                                                                                           \
            const real *restrict w0 = W + i0 * m, *restrict w1 = w0 + m, *restrict w2 = w1 + m,                 \
                       *restrict w3 = w2 + m;                                                                   \
            real a0 = 0, a1 = 0, a2 = 0, a3 = 0;                                                                \
            _Pragma("omp simd reduction(+:a0,a1,a2,a3)")                                                        \
            for (int64_t j = 0; j < m; ++j) {                                                                   \
                const real xj = xb[j];                                                                          \
                a0 += w0[j] * xj; a1 += w1[j] * xj; a2 += w2[j] * xj; a3 += w3[j] * xj;                         \
            }                                                                                                   \
            acc[0] = a0; acc[1] = a1; acc[2] = a2; acc[3] = a3;                                                 \
        } else                                                                                                  \
            for (int64_t rr = 0; rr < r; ++rr) {                                                                \
                const real *restrict w = W + (i0 + rr) * m;                                                     \
                real a = 0;                                                                                     \
                _Pragma("omp simd reduction(+:a)")                                                              \
                for (int64_t j = 0; j < m; ++j) a += w[j] * xb[j];                                              \
                acc[rr] = a;                                                                                    \
            }                                                                                                   \
        for (int64_t rr = 0; rr < r; ++rr) {                                                                    \
            const int64_t i = i0 + rr;                                                                          \
            real v = acc[rr];                                                                                   \
            if (bias) v = v + bias[i];                                                                          \
            y[b * n + i] = add ? add[b * n + i] + v : v;                                                        \
        }                                                                                                       \
    }                                                                                                           \
}                                                                                                               \
                                                                                                                \
/* y = add + W x + bias for x [B, m] (the rows above); a parallel region only where it pays (entering one     \
   costs about a microsecond even for one thread, and a decoded token makes ~20 of these calls) */              \
static void matvec_##SFX(int64_t B, int64_t n, int64_t m, const real *W, const real *bias, const real *x,      \
                         const real *add, real *y, int nthreads) {                                              \
    if (nthreads > 1 && n * m >= PAR_MIN_ELEMS) {                                                               \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                                      \
        for (int64_t i0 = 0; i0 < n; i0 += 4) matvec_rows_##SFX(B, n, m, i0, W, bias, x, add, y);              \
    } else                                                                                                      \
        for (int64_t i0 = 0; i0 < n; i0 += 4) matvec_rows_##SFX(B, n, m, i0, W, bias, x, add, y);              \
}                                                                                                               \
                                                                                                                \
/* RMSNorm of each row of x [B, d] (weight w or NULL) into y, as F.rms_norm */                                 \
static void rmsnorm_##SFX(int64_t B, int64_t d, const real *x, const real *w, double eps, real *y) {           \
    for (int64_t b = 0; b < B; ++b) {                                                                           \
        const real *xb = x + b * d;                                                                             \
        real ms = 0;                                                                                            \
        for (int64_t j = 0; j < d; ++j) ms += xb[j] * xb[j];                                                    \
        const real r = (real)1 / SQRT(ms / (real)d + (real)eps);                                                \
        for (int64_t j = 0; j < d; ++j) y[b * d + j] = w ? xb[j] * r * w[j] : xb[j] * r;                        \
    }                                                                                                           \
}                                                                                                               \
                                                                                                                \
DEFINE_SOFTMAX(SFX, real, SQRT, EXP)                                                                            \
/* x [B, d] -> x_out [B, d]; the mixer's conv window w_in -> w_out and state S_in -> S_out (S_in, w_in NULL     \
   before the first token). Returns 0, or 1 when out of memory. */                                              \
int linattn_decode_block_##SFX(const linattn_block_plan *p, const real *x, const real *w_in, const real *S_in,  \
                               real *w_out, real *S_out, real *x_out) {                                         \
    const int64_t B = p->B, d = p->d, ny = p->ny, no = p->HV * p->V, hid = p->hid;                              \
    const int64_t nwork = B * (2 * d + ny + no + (p->has_ffn ? 3 * hid : 0));                                   \
    real *xn = (real *)malloc(sizeof(real) * (size_t)(nwork + 1));                                              \
    if (!xn) return 1;                                                                                          \
    real *y = xn + B * d, *o = y + B * ny, *h = o + B * no, *u = h + B * d, *g = u + 2 * B * hid;               \
    const real *cw = (const real *)p->cw, *cb = (const real *)p->cb, *nw = (const real *)p->nw;                 \
    int rc;                                                                                                     \
    rmsnorm_##SFX(B, d, x, (const real *)p->n1w, p->n1eps, xn);                                                 \
    if (p->kind != 2) MATVEC_W_##SFX(WEIGHT_FORMAT(p->wbf16, p->fmt_W), p->sc_W, p->grp_W,                      \
            B, ny, d, p->W, (const real *)p->Wb, xn, NULL, y, p->nthreads);                                     \
    if (p->kind == 2)                                                                                           \
        rc = softmax_mix_##SFX(p, xn, y, o);                                                                    \
    else if (p->kind == 0)                                                                                      \
        rc = linattn_decode_delta_##SFX(B, p->H, p->HV, p->K, p->V, y, ny, p->KC, w_in, cw, cb, p->conv_act,    \
                 w_out, p->dkind, p->l2conv, p->q_l2, p->l2eps, p->scale, p->beta_mode, (const real *)p->alpha, \
                 p->gated, (const real *)p->neg_a, (const real *)p->dt_bias, S_in, S_out, p->has_norm, nw,      \
                 p->norm_eps, p->has_gate, o, p->nthreads);                                                     \
    else                                                                                                        \
        rc = linattn_decode_linear_##SFX(B, p->H, p->HV, p->K, p->V, y, ny, p->KC, w_in, cw, cb, p->conv_act,   \
                 w_out, p->fmap, p->scale, p->gate_kind, (const real *)p->decay, (const real *)p->neg_a,         \
                 (const real *)p->dt_bias, S_in, S_out, p->normalize, p->nonneg, p->eps, p->has_norm, nw,       \
                 p->norm_eps, p->has_gate, o, p->nthreads);                                                     \
    if (rc) { free(xn); return rc; }                                                                            \
    real *hout = p->has_ffn ? h : x_out;                                                                        \
    MATVEC_W_##SFX(WEIGHT_FORMAT(p->wbf16, p->fmt_Wo), p->sc_Wo, p->grp_Wo,                                     \
            B, d, no, p->Wo, NULL, o, x, hout, p->nthreads);                                                    \
    if (p->has_ffn) {                                                                                           \
        rmsnorm_##SFX(B, d, h, (const real *)p->n2w, p->n2eps, xn);                                             \
        MATVEC_W_##SFX(WEIGHT_FORMAT(p->wbf16, p->fmt_Wgu), p->sc_Wgu, p->grp_Wgu,                              \
                B, 2 * hid, d, p->Wgu, (const real *)p->bgu, xn, NULL, u, p->nthreads);                         \
        for (int64_t b = 0; b < B; ++b) {                                                                       \
            const real *restrict ua = u + b * 2 * hid, *restrict ub = ua + hid;                                 \
            real *restrict gb = g + b * hid;                                                                    \
            _Pragma("omp simd")                                                                                 \
            for (int64_t j = 0; j < hid; ++j) gb[j] = silu_##SFX(ua[j]) * ub[j];                                \
        }                                                                                                       \
        MATVEC_W_##SFX(WEIGHT_FORMAT(p->wbf16, p->fmt_Wd), p->sc_Wd, p->grp_Wd,                                 \
                B, d, hid, p->Wd, (const real *)p->bd, g, h, x_out, p->nthreads);                               \
    }                                                                                                           \
    free(xn);                                                                                                   \
    return 0;                                                                                                   \
}

DEFINE_BLOCK(f32, float, sqrtf, expf)
DEFINE_BLOCK(f64, double, sqrt, exp)

/* The whole model's decoding step in one call (issue 34: with one call per block, the Python around the calls
   cost more than half the weights' memory traffic): the token embedding, every block (linattn_decode_block, so
   the blocks' arithmetic is the per-block call's, bit for bit), the final RMSNorm and the head.

       x = embed[ids],   x = block_l(x) for l = 0 .. L-1,   logits = head rmsnorm(x)    (no final norm: head x)

   The states and conv windows of all layers live in one buffer each (layer l's at s_off[l] / w_off[l]
   elements; w_off[l] < 0: no short convolution), read from S_in / w_in (NULL before the first token) and
   written to fresh S_out / w_out (never in place). Everything fixed while the parameters are is one plan. */
typedef struct {
    int64_t L, B, d, vocab;
    int32_t has_norm, nthreads, wbf16, pad_;     /* wbf16: embed and head bf16, logits written as bf16 */
    double norm_eps;
    const void *embed, *norm_w, *head;           /* embed [vocab, d], norm_w [d] or NULL, head [vocab, d] */
    const linattn_block_plan *const *blocks;     /* L plans */
    const int64_t *s_off, *w_off;                /* L offsets (elements) into the state / window buffers */
    int32_t fmt_head, pad2_;                     /* the head's format (qmatvec.h WF_*; 0: as wbf16 says) */
    int64_t grp_head;                            /* its int4 group */
    const void *sc_head;                         /* its bf16 scales */
} linattn_model_plan;

#define DEFINE_MODEL(SFX, real)                                                                                 \
/* ids [B] -> logits [B, vocab] (and 0 into *aux, the model's aux loss, when aux is not NULL: one torch call less  \
   per token). Returns 0; 1 out of memory; 2 an id outside [0, vocab) (nothing written). */                       \
int linattn_decode_model_##SFX(const linattn_model_plan *p, const int64_t *ids, const real *S_in,               \
                               const real *w_in, real *S_out, real *w_out, void *logits, float *aux) {          \
    const int64_t B = p->B, d = p->d, V = p->vocab;                                                             \
    for (int64_t b = 0; b < B; ++b)                                                                             \
        if (ids[b] < 0 || ids[b] >= V) return 2;                                                                \
    /* x: two activation rows per batch row, then (bf16) the fp32 logits before rounding */                    \
    real *x = (real *)malloc(sizeof(real) * (size_t)(2 * B * d + (p->wbf16 ? B * V : 0) + 1));                \
    if (!x) return 1;                                                                                           \
    real *xa = x, *xb = x + B * d;                                                                              \
    for (int64_t b = 0; b < B; ++b) {                                                                           \
        if (p->wbf16) {                                                                                         \
            const uint16_t *E = (const uint16_t *)p->embed + ids[b] * d;                                        \
            for (int64_t j = 0; j < d; ++j) xa[b * d + j] = (real)bf16_to_f32(E[j]);                            \
        } else                                                                                                  \
            memcpy(xa + b * d, (const real *)p->embed + ids[b] * d, sizeof(real) * (size_t)d);                  \
    }                                                                                                           \
    for (int64_t l = 0; l < p->L; ++l) {                                                                        \
        const int64_t so = p->s_off[l], wo = p->w_off[l];                                                       \
        const int rc = linattn_decode_block_##SFX(p->blocks[l], xa, (w_in && wo >= 0) ? w_in + wo : NULL,       \
                                                  S_in ? S_in + so : NULL, wo >= 0 ? w_out + wo : NULL,         \
                                                  S_out + so, xb);                                              \
        if (rc) { free(x); return rc; }                                                                         \
        real *t = xa; xa = xb; xb = t;                                                                          \
    }                                                                                                           \
    const real *h = xa;                                                                                         \
    if (p->has_norm) { rmsnorm_##SFX(B, d, xa, (const real *)p->norm_w, p->norm_eps, xb); h = xb; }            \
    real *lg = p->wbf16 ? xb + B * d : (real *)logits;                                                          \
    MATVEC_W_##SFX(WEIGHT_FORMAT(p->wbf16, p->fmt_head), p->sc_head, p->grp_head,                               \
            B, V, d, p->head, NULL, h, NULL, lg, p->nthreads);                                                  \
    if (p->wbf16)                                                                                               \
        for (int64_t i = 0; i < B * V; ++i) ((uint16_t *)logits)[i] = f32_to_bf16((float)lg[i]);                \
    if (aux) *aux = 0.0f;                                                                                       \
    free(x);                                                                                                    \
    return 0;                                                                                                   \
}

DEFINE_MODEL(f32, float)
DEFINE_MODEL(f64, double)

/* the interface version the Python bindings check after loading (cpu/build.py LIBRARIES) */
int linattn_decode_abi_version(void) { return 3; }
