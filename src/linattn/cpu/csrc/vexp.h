/* exp for float in plain arithmetic (shared by the kernels that include it: linear.c, conv.c). */
#ifndef LINATTN_VEXP_H
#define LINATTN_VEXP_H
#include <stdint.h>

/* exp(x) for float in plain arithmetic, so that loops over it vectorise (libm's expf is a call per element) and
   every element gets the same bits wherever it sits in a vector (prefix runs reproduce the full run's features).
   x = n ln2 + r, |r| <= ln2 / 2; exp(r) by its degree-7 Taylor polynomial (error < 1e-8 relative); 2^n applied in
   two halves so that results down to the subnormals and up to the overflow to inf come out right. NaN stays NaN,
   exp(-inf) = 0, exp(inf) = inf. */
static inline float lin_expf(float x) {
    float xc = x < -104.0f ? -104.0f : (x > 100.0f ? 100.0f : x);
    xc = x == x ? xc : 0.0f; /* NaN: computed on 0 (no float-to-int conversion of NaN), then NaN returned */
    const float t = xc * 1.44269504088896341f;
    const float n = (t + 12582912.0f) - 12582912.0f; /* round to nearest (|t| < 2^22) */
    const float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t ni = (int32_t)n, n1 = ni / 2, n2 = ni - n1;
    union {
        int32_t i;
        float f;
    } s1, s2; /* 2^n1, 2^n2 by their bits (a union, not memcpy: the loops around stay vectorisable) */
    s1.i = (n1 + 127) << 23;
    s2.i = (n2 + 127) << 23;
    const float y = (p * s1.f) * s2.f;
    return x < -104.0f ? 0.0f : (x != x ? x : y);
}

#endif
