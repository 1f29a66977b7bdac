/* Causal linear attention, chunk form, forward and backward, for linear-space features (phi(q), psi(k) given)
   with no gate or a scalar log-gate per token and head (gamma and Mamba2-style g). Portable C11 + OpenMP.

   Layout: tokens of all sequences in rows, q, k [TT, H, K], v [TT, H, V], g [TT, H] (or NULL), num [TT, H, V],
   den [TT, H]; sequence s holds rows starts[s] .. starts[s+1]. W = V + 1 when the normaliser is computed (a
   column of ones beside V: the state is [kv | z]), else W = V. States [N, H, K, W]; chunk-start states
   P [NC, H, K, W] (NC chunks of at most C rows, never crossing a sequence boundary, in row order).

   Per chunk (G the gate's cumulative sum inside the chunk, GL its last value, decay D_ij = exp(G_i - G_j)):
     A_ij = (q_i . k_j) D_ij (j <= i),   o_i = sum_{j<=i} A_ij v_j + exp(G_i) q_i^T P_c,
     P_{c+1} = exp(GL) P_c + sum_j exp(GL - G_j) k_j v_j^T.
   Threads (OpenMP, num_threads from the caller): one pass per (sequence, head) when there is one per thread;
   else every chunk's own state update U_c, the running sum over the chunks of each (sequence, head), then every
   chunk's outputs, claimed as tasks without a barrier (lin_flow_t says how the work is shared). The backward
   pass mirrors them with the reverse running sum of the state gradients.

   Causality: a row's output uses only rows <= it (triangular products by selection, never a multiply by 0) and
   chunk states summed in a fixed order over earlier chunks; a chunk is always computed on C rows (the tail
   zero-padded), so a row's bits do not depend on how many rows follow it. No -ffast-math: inf and NaN propagate
   as in the PyTorch forms.

   The body below is compiled twice, for float (_f32) and double (_f64), by including this file into itself. */
#ifndef LINATTN_LINEAR_BODY
#define LINATTN_LINEAR_BODY

#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* madvise (sys/mman.h) under -std=c11; sched_getcpu / sched_setaffinity (chains.h) */
#endif
#include "common.h"
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "chains.h"

/* Ask for transparent huge pages on the 2 MiB-aligned part of a large output buffer that the kernel is about to
   write: torch's CPU allocator hands fresh allocations of this size straight from the OS, and the first write to
   each 4 KiB page is a page fault (~1.6 us each on the VM measured: ~6 ms for one 16 MiB output at T = 16384, a
   fifth of the forward); with huge pages it is a few faults. A hint only (nothing changes where THP is off, the
   memory is already touched or madvise is missing); the data and the results are not affected. */
static void lin_hugepages(void *p, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)1 << 21;
    if (!p || bytes < 4 * (int64_t)huge) return;
    const uintptr_t a = ((uintptr_t)p + huge - 1) & ~(huge - 1), e = ((uintptr_t)p + (uintptr_t)bytes) & ~(huge - 1);
    if (e > a) (void)madvise((void *)a, e - a, MADV_HUGEPAGE);
#else
    (void)p, (void)bytes;
#endif
}

typedef struct {
    int64_t seq, t0, len;
} lin_chunk_t;

/* the chunks of every sequence, in row order; first[s] = index of sequence s's first chunk (first[N] = NC) */
static int64_t lin_chunks(int64_t N, const int64_t *starts, int64_t C, lin_chunk_t *out, int64_t *first) {
    int64_t nc = 0;
    for (int64_t s = 0; s < N; s++) {
        first[s] = nc;
        for (int64_t t = starts[s]; t < starts[s + 1]; t += C) {
            if (out) {
                out[nc].seq = s;
                out[nc].t0 = t;
                out[nc].len = (starts[s + 1] - t < C) ? starts[s + 1] - t : C;
            }
            nc++;
        }
    }
    first[N] = nc;
    return nc;
}

/* How the threads share the work (OpenMP, num_threads from the caller), by the number of (sequence, head) units:

   * many units (>= LIN_UNITS_PER_THREAD per thread): one pass per unit (or per sequence, all its heads), units
     claimed dynamically; the tail (the last units) is short beside the whole.
   * at least one unit per thread, fewer than that (B = 1, H = 4 on 2 threads): still one pass per unit, the same
     arithmetic, as chains (chains.h): a unit is claimed for a run of LIN_CHAIN_RUN chunks at a time (shorter at its
     end: la_chains_run), its state kept in a shared array between runs, so that the units advance together and a
     descheduled thread holds back one run of one unit. A claim takes a whole aligned group of heads (lin_group: two
     pairs at B = 1, H = 4 on 2 threads) when all of them are free and stand at one position, and runs them side by
     side, every chunk's heads in turn, as one thread's pass runs all of them: one head's rows are 256 of every
     H * 256 bytes (K = 64, fp32), and a thread that reads them alone pays for the pages and neighbouring lines of
     rows it does not use (measured at 1 thread: 4-15 % more CPU time than all heads in turn). Beside a waiting
     thread a claim takes one head (la_chains_claim_group), so a descheduled thread still holds back one run of one
     head.
   * fewer units than threads: each chunk's work in two halves, every (unit, chunk) task claimed from one
     counter in the order: every chunk's first half (the forward's state update, the backward's state-gradient
     part), unit by unit, then every chunk's second half (outputs, input gradients). The thread that finishes a
     unit's last first half runs that unit's running sum over its chunks at once; a second half waits only for
     its own unit's sum. It loads every chunk twice (1.7-1.9x the work of one pass, measured), so it is used
     only where one pass cannot use every thread.

   No barrier inside a call: a waiting thread sleeps briefly (la_wait). Every path runs the same per-chunk
   arithmetic in the same order per unit, so the results do not depend on the thread count. */
typedef struct {
    _Atomic int64_t next;  /* the next task to claim */
    _Atomic int64_t *done; /* per unit: first halves finished */
    _Atomic int *ready;    /* per unit: its running sum is written */
} lin_flow_t;

static int lin_flow_init(lin_flow_t *f, int64_t units) {
    const size_t n = (size_t)(units > 0 ? units : 1);
    f->done = malloc(sizeof(*f->done) * n);
    f->ready = malloc(sizeof(*f->ready) * n);
    if (!f->done || !f->ready) {
        free((void *)f->done), free((void *)f->ready);
        f->done = NULL, f->ready = NULL;
        return -1;
    }
    atomic_init(&f->next, 0);
    for (int64_t u = 0; u < units; u++) atomic_init(&f->done[u], 0), atomic_init(&f->ready[u], 0);
    return 0;
}

static void lin_flow_free(lin_flow_t *f) { free((void *)f->done), free((void *)f->ready); }

/* chains (chains.h) of (sequence, head) units: every unit with chunks, from its first chunk (reverse: from past its
   last, the chunks below run[u] left) */
static int lin_chains(la_chains_t *ch, int64_t N, int64_t H, const int64_t *first, int reverse, int threads) {
    if (la_chains_init(ch, N * H, threads) != 0) return -1;
    for (int64_t u = 0; u < N * H; u++)
        if (first[u / H + 1] > first[u / H])
            la_chains_add(ch, u, reverse ? first[u / H + 1] : first[u / H], first[u / H + 1] - first[u / H]);
    return 0;
}

/* split: task j < NC * H of the unit-major order (sequence s, head h, then its chunks) -> its chunk c and head h */
static inline void lin_flow_task(int64_t j, int64_t H, const lin_chunk_t *ch, const int64_t *first, int64_t *c,
                                 int64_t *h) {
    const int64_t s = ch[j / H].seq, n = first[s + 1] - first[s], r = j - first[s] * H;
    *h = r / n;
    *c = first[s] + r % n;
}

/* split: a first half of unit u is finished: 1 when it was the unit's last (the caller then runs the sum) */
static inline int lin_flow_finish(lin_flow_t *f, int64_t u, int64_t n) {
    return atomic_fetch_add(&f->done[u], 1) + 1 == n;
}

static inline void lin_flow_wait(lin_flow_t *f, int64_t u) {
    while (!atomic_load_explicit(&f->ready[u], memory_order_acquire)) la_wait(); /* the holder may need the core */
}

#ifndef LIN_CHAIN_RUN
#define LIN_CHAIN_RUN 8 /* chunks per claim of a unit */
#endif
#ifndef LIN_UNITS_PER_THREAD
#define LIN_UNITS_PER_THREAD 4 /* fewer (sequence, head) units per thread: chains */
#endif

/* chains: the heads claimed side by side (la_chains_claim_group): the largest divisor of H up to the units per
   thread, so that B = 1, H = 4 on 2 threads runs two pairs of heads, each pair's rows read as the one-thread pass
   reads all heads' (adjacent lines of the same pages), not one head's 256 bytes of every 1 KiB row */
static int lin_group(int64_t N, int64_t H, int threads) {
    const int64_t per = threads > 0 ? N * H / threads : 1;
    int g = 1;
    for (int d = 2; d <= per && d <= H && d <= LIN_UNITS_PER_THREAD; d++)
        if (H % d == 0) g = d;
    return g;
}

/* Memory that two threads write side by side, laid out in whole cache lines: a line that two cores write in turn
   moves between their caches at each write (false sharing). n values of `size` bytes rounded up to a multiple of
   64 bytes (lin_lines), and an allocation of that many on a 64-byte boundary (NULL when memory is missing). */
static int64_t lin_lines(int64_t n, size_t size) {
    const int64_t per = 64 / (int64_t)size;
    return (n + per - 1) / per * per;
}
static void *lin_alloc_lines(int64_t n, size_t size) {
    const int64_t m = lin_lines(n > 0 ? n : 1, size);
    return aligned_alloc(64, (size_t)m * size);
}

/* the forward's `nonfinite` flags, ORed over every row it writes (cpu/linear.py reads them): num held inf / NaN
   (or den' was NaN) where the kernel divided, so the caller's lean backward does not apply; a value written to the
   output (o, or num undivided) is inf / NaN, so the caller's output check has work to do (else it is skipped) */
#define LIN_NUM_NONFINITE 1
#define LIN_OUT_NONFINITE 2

/* the interface version the Python bindings check after loading (cpu/bindings.py; linear.c includes itself once
   per REAL, so this lives in the part compiled once) */
LA_ABI_VERSION(linear, 3)

/* What a call needs besides its tensors (cpu/bindings.py's LinearPlan mirrors it; its size is exported and
   checked): N sequences at row offsets starts [N + 1], H heads, K key / V value columns, chunks of C rows; norm:
   the normaliser column (W = V + 1); fmap: a feature map applied in the kernel (common.h's LA_FMAP_*); q is
   scaled by `scale` before its map; eps >= 0 with norm: the forward divides num by den' and the backward takes
   the division's backward (eps < 0: neither). */
typedef struct {
    int64_t N, H, K, V, C;
    const int64_t *starts;
    int32_t norm, fmap, nthreads, pad_;
    double scale, eps;
} linattn_linear_plan;
LA_EXPORT_SIZEOF(linear_plan)

#ifndef PF_PER_BWD
#define PF_PER_BWD 24
#endif
#ifndef PF_PER
#define PF_PER 12
#endif

/* A queue of cache lines to prefetch (the next unit's rows), issued a few at a time between the register-blocked
   products of this unit: a burst of hundreds of prefetches stalls on the few line-fill buffers, while a few per
   product block overlap with the arithmetic. Hints only: no effect on any result. */
#define LIN_PF_MAX 10
typedef struct {
    const char *base[LIN_PF_MAX];
    int64_t stride[LIN_PF_MAX]; /* bytes between rows */
    int rows[LIN_PF_MAX], lines[LIN_PF_MAX], rw[LIN_PF_MAX]; /* rw: rows to be written (prefetched for writing) */
    int nt, t, r, l; /* tensors queued; the cursor (tensor, row, line) */
} lin_pf_t;

static void lin_pf_init(lin_pf_t *pf) { pf->nt = pf->t = pf->r = pf->l = 0; }

static void lin_pf_add(lin_pf_t *pf, const void *first_row, int rows, int64_t stride, int64_t row_bytes, int rw) {
    if (pf->nt >= LIN_PF_MAX || rows <= 0 || !first_row) return;
    pf->base[pf->nt] = (const char *)first_row;
    pf->stride[pf->nt] = stride;
    pf->rows[pf->nt] = rows;
    pf->lines[pf->nt] = (int)((row_bytes + 63) / 64);
    pf->rw[pf->nt] = rw;
    pf->nt++;
}

/* issue the next n lines of the queue (n < 0: all); the cursor in locals (the struct's fields would otherwise be
   stored and reloaded for every line) */
static inline void lin_pf_step(lin_pf_t *pf, int n) {
    if (!pf || pf->t >= pf->nt) return;
    int t = pf->t, r = pf->r, l = pf->l;
    while (n-- != 0 && t < pf->nt) {
#if defined(__GNUC__)
        const char *a = pf->base[t] + r * pf->stride[t] + 64 * l;
        if (pf->rw[t]) __builtin_prefetch(a, 1, 3);
        else __builtin_prefetch(a, 0, 3);
#endif
        if (++l == pf->lines[t]) {
            l = 0;
            if (++r == pf->rows[t]) r = 0, t++;
        }
    }
    pf->t = t, pf->r = r, pf->l = l;
}

/* elu(y) + 1 = y + 1 for y > 0, exp(y) otherwise; NaN stays NaN. For float, exp on y <= 0 only, in fewer
   operations than la_expf (common.h; the features are a large part of the forward's arithmetic) and with the same bits:
   the same reduction and polynomial, y clamped to [-104, 0] (exp(-104) rounds to 0 in float), and 2^n applied
   as 2^(n + 64) 2^-64 (n >= -150: one exponent field, then one rounding into the subnormals, as la_expf's two
   halves give). The magic-number rounding leaves n + 0x4B400000 in tm's bits, so 2^(n + 64) is built from them
   directly. Written as plain selections and arithmetic so that the loops around it vectorise. */
static inline float lin_elu1_f32(float y) {
    const float z = y < 0.0f ? y : 0.0f;        /* NaN -> 0 (the result is then y + 1 = NaN) */
    const float zc = z > LA_EXPF_LO ? z : LA_EXPF_LO; /* -inf -> -104 -> 0 */
    const float tm = zc * LA_LOG2E_F + LA_ROUND_F;
    const float n = tm - LA_ROUND_F; /* round(zc / ln2) */
    const float r = (zc - n * LA_LN2_HI_F) - n * LA_LN2_LO_F;
    const float p = la_expf_poly(r);
    union {
        float f;
        int32_t i;
    } u, s;
    u.f = tm;
    s.i = (u.i + 191) << 23; /* 2^(n + 64): the low bits of tm's pattern hold n (the high ones shift out) */
    const float e = (p * s.f) * 5.42101086242752217e-20f; /* * 2^-64 */
    return y <= 0.0f ? e : y + 1.0f;
}
static inline double lin_elu1_f64(double y) { return y > 0 ? y + 1 : la_exp(y > 0 ? 0 : y); }

int64_t linattn_linear_nchunks(int64_t N, const int64_t *starts, int64_t C) {
    int64_t nc = 0;
    for (int64_t s = 0; s < N; s++) nc += (starts[s + 1] - starts[s] + C - 1) / C;
    return nc;
}

#define REAL float
#define IREAL int32_t
#define FN(name) name##_f32
#include "gemm.h"
#include "linear.c"
#undef REAL
#undef IREAL
#undef FN

#define REAL double
#define IREAL int64_t
#define FN(name) name##_f64
#include "gemm.h"
#include "linear.c"
#undef REAL
#undef IREAL
#undef FN

#else /* ------------------------------------------------------------------ the body, once per REAL */

#include "common.h" /* its per-REAL part: la_exp */

/* the in-kernel feature maps (lin_load_feat applies them), by common.h's codes: identity (features given), relu,
   elu+1 (= x + 1 for x > 0, exp(x) otherwise); the queries are scaled first (phi(scale q)). NaN stays NaN. */

/* dx = dphi * phi'(x) * sc from the features phi alone, in place on dx */
static void FN(lin_map_grad)(REAL *restrict dx, const REAL *restrict phi, int D, int fmap, REAL sc) {
    if (fmap == LA_FMAP_RELU) {
        for (int d = 0; d < D; d++) dx[d] = phi[d] > 0 ? dx[d] : 0;
    } else if (fmap == LA_FMAP_ELU1) { /* slope 1 where phi > 1 (x > 0), phi = exp(x) otherwise */
#pragma omp simd
        for (int d = 0; d < D; d++) dx[d] *= phi[d] > 1 ? 1 : phi[d];
    }
    if (sc != 1)
        for (int d = 0; d < D; d++) dx[d] *= sc;
}

/* rows of x [TT, H, D] into buf [C][D] as features (lin_load + lin_map on the real rows) */
static void FN(lin_load)(const REAL *x, int64_t t0, int64_t H, int64_t h, int D, int len, int C, REAL *buf, int ld);
static void FN(lin_load_feat)(const REAL *x, int64_t t0, int64_t H, int64_t h, int D, int len, int C, REAL *buf,
                              int fmap, REAL sc) {
    if (fmap == LA_FMAP_IDENTITY && sc == 1) {
        FN(lin_load)(x, t0, H, h, D, len, C, buf, D);
        return;
    }
    for (int i = 0; i < len; i++) { /* one pass: load, scale, map (the arithmetic of lin_map) */
        const REAL *restrict src = x + ((t0 + i) * H + h) * D;
        REAL *restrict dst = buf + (int64_t)i * D;
        if (fmap == LA_FMAP_ELU1) {
#pragma omp simd
            for (int d = 0; d < D; d++) dst[d] = FN(lin_elu1)(sc * src[d]);
        } else if (fmap == LA_FMAP_RELU) {
#pragma omp simd
            for (int d = 0; d < D; d++) {
                const REAL y = sc * src[d];
                dst[d] = y < 0 ? 0 : y;
            }
        } else {
#pragma omp simd
            for (int d = 0; d < D; d++) dst[d] = sc * src[d];
        }
    }
    for (int i = len; i < C; i++) memset(buf + (int64_t)i * D, 0, sizeof(REAL) * D);
}

/* G[i] = cumulative log-gate of the chunk's row i (rows >= len repeat the last value); returns G[len-1]. In double
   for both REALs: with strong decays (Mamba2's dt A) |G| reaches ~1e3 inside a chunk, and the decays exp(G_i - G_j)
   would lose |G| * 6e-8 of every exponent to float sums; only the differences are rounded to REAL */
static double FN(lin_cumgate)(const REAL *g, int64_t t0, int64_t H, int64_t h, int len, int C, double *G) {
    double s = 0;
    for (int i = 0; i < len; i++) {
        s += (double)g[(t0 + i) * H + h];
        G[i] = s;
    }
    for (int i = len; i < C; i++) G[i] = s;
    return s;
}

/* rows t0 .. t0+len of x [TT, H, D] (head h) into buf [C][ld] (columns 0..D), zero-padding rows len..C */
/* dst[0..n) = src[0..n) for short rows: inline vector moves (a memcpy call per row of 64 values costs as much as
   the copy); no arithmetic, so the bits are the source's */
static inline void FN(copy_row)(REAL *restrict dst, const REAL *restrict src, int n) {
    int d = 0;
#if defined(__GNUC__)
    typedef REAL vec __attribute__((vector_size(64), aligned(sizeof(REAL))));
    const int vl = (int)(64 / sizeof(REAL));
    for (; d + vl <= n; d += vl) *(vec *)(dst + d) = *(const vec *)(src + d);
#endif
    for (; d < n; d++) dst[d] = src[d];
}

static void FN(lin_load)(const REAL *x, int64_t t0, int64_t H, int64_t h, int D, int len, int C, REAL *buf, int ld) {
    for (int i = 0; i < len; i++) FN(copy_row)(buf + (int64_t)i * ld, x + ((t0 + i) * H + h) * D, D);
    for (int i = len; i < C; i++) memset(buf + (int64_t)i * ld, 0, sizeof(REAL) * ld);
}

/* v rows into Vb [C][W] with the ones column (W = V + 1) for real rows */
static void FN(lin_load_v)(const REAL *v, int64_t t0, int64_t H, int64_t h, int V, int W, int len, int C, REAL *Vb) {
    FN(lin_load)(v, t0, H, h, V, len, C, Vb, W);
    if (W > V)
        for (int i = 0; i < len; i++) Vb[(int64_t)i * W + V] = 1;
}


/* The chunk's products from gemm.h's register blocks, issuing `per` queued prefetches after each 4-row block:
   pgemm C[M][N] += A[M][Kd] B[Kd][N] (zero: C = A B, C need not be zeroed first); pgemm_lo the same with row i
   using k <= i (A lower triangular); pgemm_up with row i using k >= i */
static void FN(pgemm)(int M, int N, int Kd, const REAL *restrict A, int lda, const REAL *restrict B, int ldb,
                      REAL *restrict Cm, int ldc, lin_pf_t *pf, int per, int zero) {
    const int Nv = N - N % (int)(64 / sizeof(REAL));
    int i0 = 0;
    for (; i0 + 4 <= M; i0 += 4) {
        FN(block4)(0, Kd, A + (int64_t)i0 * lda, lda, B, ldb, Cm + (int64_t)i0 * ldc, ldc, Nv, zero);
        lin_pf_step(pf, per);
    }
    for (; i0 < M; i0++) {
        if (zero) memset(Cm + (int64_t)i0 * ldc, 0, sizeof(REAL) * Nv);
        FN(kern1)(0, Kd, A + (int64_t)i0 * lda, B, ldb, Cm + (int64_t)i0 * ldc, Nv);
    }
    if (zero)
        for (int i = 0; i < M; i++)
            for (int n = Nv; n < N; n++) Cm[(int64_t)i * ldc + n] = 0;
    FN(tail)(M, N, Nv, Kd, A, lda, B, ldb, Cm, ldc, 0);
}

static void FN(pgemm_lo)(int M, int N, const REAL *restrict A, int lda, const REAL *restrict B, int ldb,
                         REAL *restrict Cm, int ldc, lin_pf_t *pf, int per) {
    const int Nv = N - N % (int)(64 / sizeof(REAL));
    int i0 = 0;
    for (; i0 + 4 <= M; i0 += 4) {
        FN(block4)(0, i0, A + (int64_t)i0 * lda, lda, B, ldb, Cm + (int64_t)i0 * ldc, ldc, Nv, 0);
        for (int r = 0; r < 4; r++)
            FN(kern1)(i0, i0 + r + 1, A + (int64_t)(i0 + r) * lda, B, ldb, Cm + (int64_t)(i0 + r) * ldc, Nv);
        lin_pf_step(pf, per);
    }
    for (; i0 < M; i0++) FN(kern1)(0, i0 + 1, A + (int64_t)i0 * lda, B, ldb, Cm + (int64_t)i0 * ldc, Nv);
    FN(tail)(M, N, Nv, M, A, lda, B, ldb, Cm, ldc, 1);
}

static void FN(pgemm_up)(int M, int N, int Kd, const REAL *restrict A, int lda, const REAL *restrict B, int ldb,
                         REAL *restrict Cm, int ldc, lin_pf_t *pf, int per) {
    const int Nv = N - N % (int)(64 / sizeof(REAL));
    int i0 = 0;
    for (; i0 + 4 <= M; i0 += 4) {
        for (int r = 0; r < 3; r++)
            FN(kern1)(i0 + r, FN(imin)(i0 + 3, Kd), A + (int64_t)(i0 + r) * lda, B, ldb,
                      Cm + (int64_t)(i0 + r) * ldc, Nv);
        FN(block4)(i0 + 3, Kd, A + (int64_t)i0 * lda, lda, B, ldb, Cm + (int64_t)i0 * ldc, ldc, Nv, 0);
        lin_pf_step(pf, per);
    }
    for (; i0 < M; i0++) FN(kern1)(i0, Kd, A + (int64_t)i0 * lda, B, ldb, Cm + (int64_t)i0 * ldc, Nv);
    FN(tail)(M, N, Nv, Kd, A, lda, B, ldb, Cm, ldc, 2);
}

/* ---- forward, per chunk: the same arithmetic on every path (one pass per sequence and head, or three passes
   over all chunks), so the result never depends on the thread count or on the batch around a sequence */

/* the chunk's features and values: Q (when asked), Km, Kt = Km^T, Vb, G; returns GL (0 without a gate) */
static double FN(fl_load)(const REAL *q, const REAL *k, const REAL *v, const REAL *g, int64_t t0, int len,
                          int64_t H, int64_t h, int K, int V, int W, int C, int fmap, REAL sc, REAL *Q, REAL *Km,
                          REAL *Kt, REAL *Vb, double *G) {
    if (Q) FN(lin_load_feat)(q, t0, H, h, K, len, C, Q, fmap, sc);
    FN(lin_load_feat)(k, t0, H, h, K, len, C, Km, fmap, 1);
    FN(transpose)(C, K, Km, K, Kt);
    FN(lin_load_v)(v, t0, H, h, V, W, len, C, Vb);
    return g ? FN(lin_cumgate)(g, t0, H, h, len, C, G) : 0;
}

/* U = sum_j exp(GL - G_j) k_j [v_j | 1]^T (decays Kt's columns in place); tmp: K values of scratch */
static void FN(fl_update)(int len, int K, int V, int W, int C, int has_g, const double *G, double GL, REAL *Kt,
                          const REAL *Km, const REAL *Vb, REAL *U, REAL *tmp, lin_pf_t *pf, int per) {
    if (has_g)
        for (int i = 0; i < len; i++) {
            const REAL e = FN(la_exp)((REAL)(GL - G[i]));
            for (int d = 0; d < K; d++) Kt[(int64_t)d * C + i] *= e;
        }
    if (has_g || W == V) {
        FN(pgemm)(K, W, len, Kt, C, Vb, W, U, W, pf, per, 1);
        return;
    }
    /* no gate: the normaliser's column is the sum of the key rows (vector adds, no dot products) */
    FN(pgemm)(K, V, len, Kt, C, Vb, W, U, W, pf, per, 1);
    memset(tmp, 0, sizeof(REAL) * K);
    for (int i = 0; i < len; i++) {
        const REAL *restrict kr = Km + (int64_t)i * K;
#pragma omp simd
        for (int d = 0; d < K; d++) tmp[d] += kr[d];
    }
    for (int d = 0; d < K; d++) U[(int64_t)d * W + V] = tmp[d];
}

/* o = num / den' for one row (den = src[V]), the arithmetic of `finish` in ops/linear.py: den' = den floored to
   |den| >= eps keeping its sign (NaN stays NaN, like torch.minimum/maximum), then the division; a non-finite
   num n gives 0 / den' + n as `_divide_finite_part` does. IEEE division: the same bits as PyTorch's. Returns
   LIN_NUM_NONFINITE when num held inf / NaN or den' is NaN, LIN_OUT_NONFINITE when a written o is inf / NaN. */
static inline int FN(lin_divide)(REAL *restrict dst, const REAL *restrict src, int V, REAL eps) {
    REAL d = src[V];
    d = d != d ? d : (d < 0 ? (d < -eps ? d : -eps) : (d > eps ? d : eps));
    int bad = d != d, out_bad = 0; /* the caller's backward takes another way on bad; out_bad: the output check */
#pragma omp simd reduction(| : bad, out_bad)
    for (int j = 0; j < V; j++) {
        const REAL n = src[j];
        const int fin = n - n == 0; /* else n is inf or NaN */
        const REAL o = fin ? n / d : (REAL)0 / d + n;
        dst[j] = o;
        bad |= !fin;
        out_bad |= !(o - o == 0);
    }
    return (bad ? LIN_NUM_NONFINITE : 0) | (out_bad ? LIN_OUT_NONFINITE : 0);
}

/* copy_row, returning LIN_OUT_NONFINITE when a copied value is inf / NaN */
static inline int FN(copy_row_checked)(REAL *restrict dst, const REAL *restrict src, int n) {
    int out_bad = 0;
#pragma omp simd reduction(| : out_bad)
    for (int d = 0; d < n; d++) {
        dst[d] = src[d];
        out_bad |= !(src[d] - src[d] == 0);
    }
    return out_bad ? LIN_OUT_NONFINITE : 0;
}

/* den [TT, H] from the chains' head-major normalisers denh [H][TT]: each thread wrote its heads' rows of denh (H
   values of a token share a cache line of den, which two threads running neighbouring heads would write in turn at
   every row); a copy, the same bits */
static void FN(lin_den_rows)(REAL *restrict den, const REAL *restrict denh, int64_t TT, int64_t H) {
    for (int64_t t = 0; t < TT; t++)
        for (int64_t h = 0; h < H; h++) den[t * H + h] = denh[h * TT + t];
}

/* the chunk's outputs from its start state Pc (Kt undecayed); returns the LIN_*_NONFINITE flags of its rows. den:
   head h's normaliser of row 0 (NULL: not kept), its rows ds apart */
static int FN(fl_out)(int64_t t0, int len, int64_t H, int64_t h, int K, int V, int W, int C, int norm, int has_g,
                       REAL eps, const REAL *Q, REAL *Qd, const REAL *Km, const REAL *Kt, const REAL *Vb, const double *G,
                       const REAL *Pc, REAL *A, REAL *O, REAL *num, REAL *den, int64_t ds, lin_pf_t *pf, int per) {
    FN(pgemm)(C, C, K, Q, K, Kt, C, A, C, pf, per, 1);
    const REAL *Qs = Q;
    if (has_g) {
        for (int i = 0; i < C; i++) {
            for (int j = 0; j <= i; j++) A[(int64_t)i * C + j] *= FN(la_exp)((REAL)(G[i] - G[j]));
            const REAL e = FN(la_exp)((REAL)G[i]);
            for (int d = 0; d < K; d++) Qd[(int64_t)i * K + d] = e * Q[(int64_t)i * K + d];
        }
        Qs = Qd;
    }
    if (has_g || W == V) {
        FN(pgemm)(C, W, K, Qs, K, Pc, W, O, W, pf, per, 1);
        FN(pgemm_lo)(C, W, A, C, Vb, W, O, W, pf, per);
    } else { /* no gate: den_i = q_i . (z + sum_{j <= i} k_j), one dot per row in place of the column of ones' two */
        FN(pgemm)(C, V, K, Qs, K, Pc, W, O, W, pf, per, 1);
        FN(pgemm_lo)(C, V, A, C, Vb, W, O, W, pf, per);
        REAL *restrict zc = Qd; /* free without a gate */
        for (int d = 0; d < K; d++) zc[d] = Pc[(int64_t)d * W + V];
        for (int i = 0; i < len; i++) {
            const REAL *restrict kr = Km + (int64_t)i * K;
#pragma omp simd
            for (int d = 0; d < K; d++) zc[d] += kr[d];
            O[(int64_t)i * W + V] = FN(dot16)(Q + (int64_t)i * K, zc, K);
        }
    }
    int bad = 0;
    for (int i = 0; i < len; i++) {
        const REAL *src = O + (int64_t)i * W;
        if (norm && den) den[(t0 + i) * ds] = src[V];
        if (norm && eps >= 0) {
            bad |= FN(lin_divide)(num + ((t0 + i) * H + h) * V, src, V, eps);
        } else {
            bad |= FN(copy_row_checked)(num + ((t0 + i) * H + h) * V, src, V);
        }
    }
    return bad;
}

/* S = exp(GL) S + U (in place), the carried state's update */
static void FN(carry)(int64_t n, int has_g, REAL GL, REAL *S, const REAL *U) {
    if (has_g) {
        const REAL d = FN(la_exp)(GL);
        for (int64_t e = 0; e < n; e++) S[e] = d * S[e] + U[e];
    } else {
        for (int64_t e = 0; e < n; e++) S[e] = S[e] + U[e];
    }
}

/* one pass over chunk c of head h: outputs from the carried state Sh, then Sh carried past the chunk; the next
   unit's rows (chunk t1, head h1, l1 rows; l1 = 0: none) are prefetched between the products */
typedef struct {
    const REAL *q, *k, *v, *g;
    REAL *num, *den, *P;
    int64_t H;
    int K, V, W, C, norm, has_g, fmap;
    REAL sc, ep;
    REAL *denh; /* the chains' normalisers head-major [H][TT] (lin_den_rows), else NULL: den [TT, H] directly */
    int64_t TT;
} FN(fargs);

typedef struct {
    REAL *Q, *Qd, *Km, *Kt, *Vb, *A, *O, *U;
    double *G;
} FN(fws);

static int FN(fl_chunk)(const FN(fargs) *a, FN(fws) *w, int64_t c, int64_t t0, int len, int64_t h, REAL *Sh,
                        int64_t t1, int64_t h1, int l1) {
    const int64_t H = a->H, KW = (int64_t)a->K * a->W;
    const int K = a->K, V = a->V, W = a->W, C = a->C;
    const double GL = FN(fl_load)(a->q, a->k, a->v, a->g, t0, len, H, h, K, V, W, C, a->fmap, a->sc, w->Q, w->Km,
                                  w->Kt, w->Vb, w->G);
    lin_pf_t pf;
    lin_pf_init(&pf);
    if (l1 > 0) {
        const int64_t sb = H * (int64_t)sizeof(REAL);
        lin_pf_add(&pf, a->q + (t1 * H + h1) * K, l1, sb * K, (int64_t)sizeof(REAL) * K, 0);
        lin_pf_add(&pf, a->k + (t1 * H + h1) * K, l1, sb * K, (int64_t)sizeof(REAL) * K, 0);
        lin_pf_add(&pf, a->v + (t1 * H + h1) * V, l1, sb * V, (int64_t)sizeof(REAL) * V, 0);
#ifndef PF_NOW
        lin_pf_add(&pf, a->num + (t1 * H + h1) * V, l1, sb * V, (int64_t)sizeof(REAL) * V, 1);
#endif
    }
    const int per = PF_PER;
    const REAL *Pc = Sh;
    if (a->P) {
        memcpy(a->P + (c * H + h) * KW, Sh, sizeof(REAL) * KW);
        Pc = a->P + (c * H + h) * KW;
    }
    REAL *den = a->denh ? a->denh + h * a->TT : (a->den ? a->den + h : NULL);
    const int bad = FN(fl_out)(t0, len, H, h, K, V, W, C, a->norm, a->has_g, a->ep, w->Q, w->Qd, w->Km, w->Kt, w->Vb,
                               w->G, Pc, w->A, w->O, a->num, den, a->denh ? 1 : H, &pf, per);
    FN(fl_update)(len, K, V, W, C, a->has_g, w->G, GL, w->Kt, w->Km, w->Vb, w->U, w->Qd, &pf, per);
    lin_pf_step(&pf, -1);
    FN(carry)(KW, a->has_g, (REAL)GL, Sh, w->U);
    return bad;
}

int FN(linattn_linear_fwd)(const linattn_linear_plan *p, const REAL *q, const REAL *k, const REAL *v, const REAL *g,
                           const REAL *S0, REAL *num, REAL *den, REAL *P, REAL *S_out, int32_t *nonfinite) {
    const int64_t N = p->N, H = p->H, K64 = p->K, V64 = p->V, C64 = p->C, *starts = p->starts;
    const int norm = p->norm, fmap = p->fmap, nthreads = p->nthreads;
    const double scale = p->scale, eps = p->eps;
    const int K = (int)K64, V = (int)V64, C = (int)C64, W = V + (norm ? 1 : 0), has_g = g != NULL;
    const int64_t KW = (int64_t)K * W;
    const REAL sc = (REAL)scale, ep = (REAL)eps; /* eps >= 0 (with norm): num receives num / den' (`lin_divide`) */
    int64_t *first = malloc(sizeof(int64_t) * (N + 1));
    if (!first) return -1;
    const int64_t NC = lin_chunks(N, starts, C, NULL, first);
    lin_chunk_t *ch = malloc(sizeof(lin_chunk_t) * (NC > 0 ? NC : 1));
    REAL *gl = malloc(sizeof(REAL) * (NC * H > 0 ? NC * H : 1));
    if (!ch || !gl) {
        free(first), free(ch), free(gl);
        return -1;
    }
    lin_chunks(N, starts, C, ch, first);
    /* one pass per (sequence, head) unit, the state carried in cache, when there is a unit per thread; else the
       chunks' work in two halves split over the threads within each sequence (lin_flow_t) */
    const int one_pass = nthreads <= 1 || N * H >= (int64_t)nthreads;
    const int chains = one_pass && nthreads > 1 && N * H < LIN_UNITS_PER_THREAD * (int64_t)nthreads;
    /* one pass over whole sequences when there are enough of them: all heads of a chunk in turn, so the rows
       read form one contiguous block (rows of one head lie H * D apart, which the prefetchers follow poorly) and
       the H carried states stay in cache; the arithmetic per (chunk, head) is the same either way */
    const int seq_major = one_pass && !chains && (nthreads <= 1 || N >= 2 * (int64_t)nthreads);
    const int64_t nh = seq_major && H > 0 ? H : 1; /* heads per one-pass task */
    /* P == NULL: the chunk states are not kept (no backward); the split path still needs them. Su: the chains'
       carried states, KWp apart (whole cache lines: lin_lines); denh: their normalisers, head-major (lin_den_rows) */
    REAL *P_own = NULL, *Su = NULL, *denh = NULL;
    const int64_t KWp = lin_lines(KW, sizeof(REAL)), TT = starts[N];
    lin_flow_t flow = {0};
    la_chains_t chn = {0};
    if (chains || !one_pass) {
        if (!P && !one_pass) P = P_own = malloc(sizeof(REAL) * (NC * H * KW > 0 ? NC * H * KW : 1));
        if (chains) Su = lin_alloc_lines(N * H * KWp, sizeof(REAL));
        if (chains && norm && den) denh = lin_alloc_lines(TT * H, sizeof(REAL));
        if ((!one_pass && (!P || lin_flow_init(&flow, N * H) != 0)) ||
            (chains && (!Su || lin_chains(&chn, N, H, first, 0, nthreads) != 0)) || (chains && norm && den && !denh)) {
            if (flow.done) lin_flow_free(&flow);
            free(first), free(ch), free(gl), free(P_own), free(Su), free(denh);
            return -1;
        }
        for (int64_t u = 0; Su && u < N * H; u++) {
            if (S0) memcpy(Su + u * KWp, S0 + u * KW, sizeof(REAL) * KW);
            else memset(Su + u * KWp, 0, sizeof(REAL) * KW);
        }
        for (int64_t u = 0; u < N * H; u++) /* a unit without chunks (an empty sequence): its final state only */
            if (first[u / H + 1] == first[u / H] && S_out) {
                if (S0) memcpy(S_out + u * KW, S0 + u * KW, sizeof(REAL) * KW);
                else memset(S_out + u * KW, 0, sizeof(REAL) * KW);
            }
    }
    const FN(fargs) fa = {q, k, v, g, num, den, P, H, K, V, W, C, norm, has_g, fmap, sc, ep, denh, TT};
    lin_hugepages(num, (int64_t)sizeof(REAL) * starts[N] * H * V);
    if (P != P_own) lin_hugepages(P, (int64_t)sizeof(REAL) * NC * H * KW);
    const int group = chains ? lin_group(N, H, nthreads) : 1;
    int failed = 0, any_bad = 0;
    const size_t scratch = (size_t)(3 * C * K + K * C + 2 * C * W + C * C + C + (nh + 1) * KW);
#pragma omp parallel num_threads(nthreads)
    {
        LA_TRACE(LA_EV_REGION, 0);
        int bad = 0;
        REAL *buf = malloc(sizeof(REAL) * scratch);
        double *G = malloc(sizeof(double) * C); /* the chunk's cumulative gate (lin_cumgate) */
        if (!G) free(buf), buf = NULL;
        REAL *Q = buf, *Qd = Q + C * K, *Km = Qd + C * K, *Kt = Km + C * K, *Vb = Kt + K * C, *A = Vb + C * W,
             *O = A + C * C, *S = O + C * W + C, *U = S + nh * KW;
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
        FN(fws) ws = {Q, Qd, Km, Kt, Vb, A, O, U, G};
        if (chains) {
            int64_t got[LIN_UNITS_PER_THREAD]; /* the units claimed side by side: heads of one sequence */
            for (int n; buf && (n = la_chains_claim_group(&chn, N * H, group, got)) > 0;) {
                const int64_t s = got[0] / H, cb = chn.run[got[0]], end = first[s + 1];
                const int64_t ce = cb + la_chains_run(end - cb, LIN_CHAIN_RUN);
                for (int64_t c = cb; c < ce; c++)
                    for (int j = 0; j < n; j++) {
                        /* the next unit's rows: the next claimed head of this chunk, else the first of the next */
                        const int nxt_h = j + 1 < n, nxt = nxt_h || c + 1 < end;
                        const int64_t c1 = nxt_h ? c : c + 1;
                        bad |= FN(fl_chunk)(&fa, &ws, c, ch[c].t0, (int)ch[c].len, got[j] % H, Su + got[j] * KWp,
                                            nxt ? ch[c1].t0 : 0, got[nxt_h ? j + 1 : 0] % H, nxt ? (int)ch[c1].len : 0);
                    }
                for (int j = 0; j < n; j++) {
                    if (ce == end && S_out) memcpy(S_out + got[j] * KW, Su + got[j] * KWp, sizeof(REAL) * KW);
                    la_chains_release(&chn, got[j], ce, end - ce);
                }
            }
        } else if (one_pass) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < N * H / nh; task++) {
                if (!buf) continue;
                const int64_t s = seq_major ? task : task / H, h0 = seq_major ? 0 : task % H;
                if (S0) memcpy(S, S0 + (s * H + h0) * KW, sizeof(REAL) * nh * KW);
                else memset(S, 0, sizeof(REAL) * nh * KW);
                for (int64_t c = first[s]; c < first[s + 1]; c++)
                    for (int64_t h = h0; h < h0 + nh; h++) {
                        /* the next unit's rows: the next head of this chunk, else the first head of the next */
                        const int nxt_h = h + 1 < h0 + nh, nxt_c = c + 1 < first[s + 1];
                        const int64_t c1 = nxt_h ? c : c + 1;
                        bad |= FN(fl_chunk)(&fa, &ws, c, ch[c].t0, (int)ch[c].len, h, S + (h - h0) * KW,
                                            nxt_h || nxt_c ? ch[c1].t0 : 0, nxt_h ? h + 1 : h0,
                                            nxt_h || nxt_c ? (int)ch[c1].len : 0);
                    }
                if (S_out) memcpy(S_out + (s * H + h0) * KW, S, sizeof(REAL) * nh * KW);
            }
        } else if (buf) { /* a thread without scratch claims nothing: the others take every task */
            const int64_t NT = NC * H;
            for (;;) {
                const int64_t i = atomic_fetch_add(&flow.next, 1);
                if (i >= 2 * NT) break;
                int64_t c, h;
                lin_flow_task(i < NT ? i : i - NT, H, ch, first, &c, &h);
                const int64_t s = ch[c].seq, u = s * H + h, t0 = ch[c].t0, task = c * H + h;
                const int len = (int)ch[c].len;
                if (i < NT) { /* the chunk's state update U_c, into P[c] for now */
                    const double GL =
                        FN(fl_load)(q, k, v, g, t0, len, H, h, K, V, W, C, fmap, sc, NULL, Km, Kt, Vb, G);
                    gl[task] = (REAL)GL;
                    FN(fl_update)(len, K, V, W, C, has_g, G, GL, Kt, Km, Vb, P + task * KW, Qd, NULL, 0);
                    if (!lin_flow_finish(&flow, u, first[s + 1] - first[s])) continue;
                    /* the unit's running sum: P[c] = the state before chunk c */
                    if (S0) memcpy(S, S0 + u * KW, sizeof(REAL) * KW);
                    else memset(S, 0, sizeof(REAL) * KW);
                    for (int64_t c1 = first[s]; c1 < first[s + 1]; c1++) {
                        REAL *Pc = P + (c1 * H + h) * KW;
                        memcpy(U, Pc, sizeof(REAL) * KW);
                        memcpy(Pc, S, sizeof(REAL) * KW);
                        FN(carry)(KW, has_g, gl[c1 * H + h], S, U);
                    }
                    if (S_out) memcpy(S_out + u * KW, S, sizeof(REAL) * KW);
                    atomic_store_explicit(&flow.ready[u], 1, memory_order_release);
                } else { /* the chunk's outputs */
                    lin_flow_wait(&flow, u);
                    FN(fl_load)(q, k, v, g, t0, len, H, h, K, V, W, C, fmap, sc, Q, Km, Kt, Vb, G);
                    bad |= FN(fl_out)(t0, len, H, h, K, V, W, C, norm, has_g, ep, Q, Qd, Km, Kt, Vb, G,
                                      P + task * KW, A, O, num, den ? den + h : NULL, H, NULL, 0);
                }
            }
        }
        if (bad) {
#pragma omp atomic
            any_bad |= bad;
        }
        free(buf), free(G);
    }
    if (denh) FN(lin_den_rows)(den, denh, TT, H);
    if (!one_pass) lin_flow_free(&flow);
    if (chains) la_chains_free(&chn);
    free(first), free(ch), free(gl), free(P_own), free(Su), free(denh);
    if (nonfinite) *nonfinite = any_bad;
    return failed ? -1 : 0;
}

/* ---- backward, per chunk (same rule: identical arithmetic on both paths) */

typedef struct {
    REAL *Q, *Km, *Qd, *Vb, *dO, *Pt, *dPt, *A, *D, *dA, *T2, *X, *Y, *Z, *dG, *Tr;
    double *G; /* the chunk's cumulative gate (lin_cumgate) */
    lin_pf_t *pf; /* the next unit's rows, prefetched `per` lines per product block (NULL: none) */
    int per;
} FN(bws);

/* the chunk's features, values, output gradients (rows >= len zero) and G; returns GL. o (with den, eps): the
   forward divided by the normaliser (o = num / den', finite num), and dnum is the gradient of o: the division's
   backward is taken here, as `_FlooredDivide` in ops/linear.py does (W = V + 1) */
static double FN(bl_load)(const REAL *q, const REAL *k, const REAL *v, const REAL *g, const REAL *dnum,
                        const REAL *dden, const REAL *o, const REAL *den, REAL eps, int64_t t0, int len, int64_t H,
                        int64_t h, int K, int V, int W, int C, int fmap, REAL sc, FN(bws) *b) {
    FN(lin_load_feat)(q, t0, H, h, K, len, C, b->Q, fmap, sc);
    FN(lin_load_feat)(k, t0, H, h, K, len, C, b->Km, fmap, 1);
    FN(lin_load_v)(v, t0, H, h, V, W, len, C, b->Vb);
    for (int i = 0; i < C; i++) {
        const int64_t row = (t0 + i) * H + h;
        REAL *restrict dOi = b->dO + (int64_t)i * W;
        if (i < len && dnum && o) { /* dnum = do / den', dden = -(dnum . o) where |den| > eps (the floor's slope) */
            const REAL dr = den[row], dp = dr < 0 ? (dr < -eps ? dr : -eps) : (dr > eps ? dr : eps);
            const REAL *restrict doi = dnum + row * V, *restrict oi = o + row * V;
            REAL acc = 0;
#pragma omp simd reduction(+ : acc)
            for (int w = 0; w < V; w++) {
                const REAL x = doi[w] / dp;
                dOi[w] = x;
                acc += x * oi[w];
            }
            dOi[V] = (dr > eps || dr < -eps ? -acc : 0) + (dden ? dden[row] : 0);
            continue;
        }
        for (int w = 0; w < V; w++) dOi[w] = (i < len && dnum) ? dnum[row * V + w] : 0;
        if (W > V) dOi[V] = (i < len && dden) ? dden[row] : 0;
    }
    return g ? FN(lin_cumgate)(g, t0, H, h, len, C, b->G) : 0;
}

/* R = sum_i exp(G_i) q_i dO_i^T: the chunk's part of the gradient of its start state (qt_ready: Tr holds Q^T) */
static void FN(bl_R)(int len, int K, int W, int C, int has_g, int qt_ready, FN(bws) *b, REAL *R) {
    if (!qt_ready) FN(transpose)(C, K, b->Q, K, b->Tr); /* Tr [K][C] (bl_grads leaves it there) */
    if (has_g)
        for (int i = 0; i < len; i++) {
            const REAL e = FN(la_exp)((REAL)b->G[i]);
            for (int d = 0; d < K; d++) b->Tr[(int64_t)d * C + i] *= e;
        }
    FN(pgemm)(K, W, len, b->Tr, C, b->dO, W, R, W, b->pf, b->per, 1);
}

/* the chunk's input gradients, from its start state Pc and the gradient dPn of its end state */
static void FN(bl_grads)(int64_t t0, int len, int64_t H, int64_t h, int K, int V, int W, int C, int has_g, int fmap,
                         REAL sc, double GL, const REAL *Pc, const REAL *dPn, FN(bws) *b, REAL *dq, REAL *dk, REAL *dv,
                         REAL *dg) {
    const int64_t KW = (int64_t)K * W;
    REAL *Q = b->Q, *Km = b->Km, *Vb = b->Vb, *dO = b->dO, *A = b->A, *D = b->D, *dA = b->dA, *T2 = b->T2,
         *X = b->X, *dG = b->dG, *Tr = b->Tr;
    const double *G = b->G;
    if (has_g) memset(dG, 0, sizeof(REAL) * C);
    /* At = ((Q K^T) * D)^T directly, as K Q^T: At[j][i] = k_j . q_i, the same products in the same order as
       A[i][j] (the same bits), and no transposes of K and A; Q^T stays in Tr for bl_R */
    FN(transpose)(C, K, Q, K, Tr); /* Tr [K][C] */
    REAL *At = A;
    FN(pgemm)(C, C, K, Km, K, Tr, C, At, C, b->pf, b->per, 1);
    if (has_g)
        for (int i = 0; i < C; i++)
            for (int j = 0; j <= i; j++) {
                D[(int64_t)i * C + j] = FN(la_exp)((REAL)(G[i] - G[j]));
                At[(int64_t)j * C + i] *= D[(int64_t)i * C + j];
            }
    /* dA = dO Vb^T (rows j <= i used); the gate's part; dM = dA * D, in place */
    FN(transpose)(C, W, Vb, W, X); /* X [W][C] */
    FN(pgemm)(C, C, W, dO, W, X, C, dA, C, b->pf, b->per, 1);
    if (has_g)
        for (int i = 0; i < C; i++)
            for (int j = 0; j <= i; j++) {
                const REAL e = dA[(int64_t)i * C + j] * At[(int64_t)j * C + i];
                dG[i] += e;
                dG[j] -= e;
                dA[(int64_t)i * C + j] *= D[(int64_t)i * C + j];
            }
    /* dq = dM K + exp(G_i) P_c dO_i */
    REAL *dQ = b->Qd;
    memset(dQ, 0, sizeof(REAL) * C * K);
    FN(pgemm_lo)(C, K, dA, C, Km, K, dQ, K, b->pf, b->per);
    FN(transpose)(K, W, Pc, W, b->Pt); /* Pt [W][K] */
    if (has_g) {
        FN(pgemm)(C, K, W, dO, W, b->Pt, K, X, K, b->pf, b->per, 1);
        for (int i = 0; i < len; i++) {
            const REAL e = FN(la_exp)((REAL)G[i]);
            REAL s = 0;
            for (int d = 0; d < K; d++) {
                const REAL x = e * X[(int64_t)i * K + d];
                dQ[(int64_t)i * K + d] += x;
                s += Q[(int64_t)i * K + d] * x;
            }
            dG[i] += s;
        }
    } else {
        FN(pgemm)(C, K, W, dO, W, b->Pt, K, dQ, K, b->pf, b->per, 0);
    }
    /* dk = dM^T Q + exp(GL - G_j) dPn v_j */
    FN(transpose)(C, C, dA, C, T2); /* T2 = dM^T */
    REAL *dK = b->Y;
    memset(dK, 0, sizeof(REAL) * C * K);
    FN(pgemm_up)(C, K, C, T2, C, Q, K, dK, K, b->pf, b->per);
    FN(transpose)(K, W, dPn, W, b->dPt); /* dPt [W][K] */
    if (has_g) {
        FN(pgemm)(C, K, W, Vb, W, b->dPt, K, X, K, b->pf, b->per, 1);
        REAL tot = 0;
        for (int j = 0; j < len; j++) {
            const REAL e = FN(la_exp)((REAL)(GL - G[j]));
            REAL s = 0;
            for (int d = 0; d < K; d++) {
                const REAL x = e * X[(int64_t)j * K + d];
                dK[(int64_t)j * K + d] += x;
                s += Km[(int64_t)j * K + d] * x;
            }
            dG[j] -= s;
            tot += s;
        }
        REAL pp = 0; /* <dPn, P_c>: the carried state's decay */
        for (int64_t e = 0; e < KW; e++) pp += dPn[e] * Pc[e];
        if (len > 0) dG[len - 1] += tot + FN(la_exp)((REAL)GL) * pp;
    } else {
        FN(pgemm)(C, K, W, Vb, W, b->dPt, K, dK, K, b->pf, b->per, 0);
    }
    /* dv = A^T dO + exp(GL - G_j) dPn^T k_j (V columns: the normaliser's would be dropped) */
    REAL *dV = b->Z;
    memset(dV, 0, sizeof(REAL) * C * W);
    FN(pgemm_up)(C, V, C, At, C, dO, W, dV, W, b->pf, b->per);
    if (has_g) {
        FN(pgemm)(C, V, K, Km, K, dPn, W, X, W, b->pf, b->per, 1);
        for (int j = 0; j < len; j++) {
            const REAL e = FN(la_exp)((REAL)(GL - G[j]));
            for (int w = 0; w < V; w++) dV[(int64_t)j * W + w] += e * X[(int64_t)j * W + w];
        }
    } else {
        FN(pgemm)(C, V, K, Km, K, dPn, W, dV, W, b->pf, b->per, 0);
    }
    for (int i = 0; i < len; i++) {
        const int64_t row = (t0 + i) * H + h;
        FN(lin_map_grad)(dQ + (int64_t)i * K, Q + (int64_t)i * K, K, fmap, sc);
        FN(lin_map_grad)(dK + (int64_t)i * K, Km + (int64_t)i * K, K, fmap, 1);
        FN(copy_row)(dq + row * K, dQ + (int64_t)i * K, K);
        FN(copy_row)(dk + row * K, dK + (int64_t)i * K, K);
        FN(copy_row)(dv + row * V, dV + (int64_t)i * W, V);
    }
    if (has_g && dg) { /* dg_t = sum_{i >= t} dG_i inside the chunk */
        REAL s = 0;
        for (int i = len - 1; i >= 0; i--) {
            s += dG[i];
            dg[(t0 + i) * H + h] = s;
        }
    }
}

/* the backward's call constants */
typedef struct {
    const REAL *q, *k, *v, *g, *P, *dnum, *dden, *o, *den;
    REAL *dq, *dk, *dv, *dg;
    int64_t H;
    int K, V, W, C, has_g, fmap;
    REAL sc, ep;
} FN(bargs);

/* one pass over chunk c of head h, in reverse: its input gradients from the carried gradient Dh of its end state,
   then Dh carried to its start (R: KW values of scratch); the rows of chunk c1 (-1: none), head h1, are
   prefetched between the products */
static void FN(bl_chunk)(const FN(bargs) *a, FN(bws) *b, int64_t c, int64_t t0, int len, int64_t h, REAL *Dh,
                         REAL *R, int64_t c1, int64_t h1, const lin_chunk_t *ch) {
    const int64_t H = a->H, KW = (int64_t)a->K * a->W;
    const int K = a->K, V = a->V, W = a->W, C = a->C;
    const double GL = FN(bl_load)(a->q, a->k, a->v, a->g, a->dnum, a->dden, a->o, a->den, a->ep, t0, len, H, h, K, V,
                                  W, C, a->fmap, a->sc, b);
    lin_pf_t pf;
    lin_pf_init(&pf);
    if (c1 >= 0) {
        const int64_t t1 = ch[c1].t0;
        const int l1 = (int)ch[c1].len;
        const int64_t sk = H * K * (int64_t)sizeof(REAL), sv = H * V * (int64_t)sizeof(REAL);
        const int64_t rk = K * (int64_t)sizeof(REAL), rv = V * (int64_t)sizeof(REAL);
        lin_pf_add(&pf, a->q + (t1 * H + h1) * K, l1, sk, rk, 0);
        lin_pf_add(&pf, a->k + (t1 * H + h1) * K, l1, sk, rk, 0);
        lin_pf_add(&pf, a->v + (t1 * H + h1) * V, l1, sv, rv, 0);
        if (a->dnum) lin_pf_add(&pf, a->dnum + (t1 * H + h1) * V, l1, sv, rv, 0);
        if (a->o) lin_pf_add(&pf, a->o + (t1 * H + h1) * V, l1, sv, rv, 0);
        lin_pf_add(&pf, a->P + (c1 * H + h1) * KW, 1, 0, KW * (int64_t)sizeof(REAL), 0);
        lin_pf_add(&pf, a->dq + (t1 * H + h1) * K, l1, sk, rk, 1);
        lin_pf_add(&pf, a->dk + (t1 * H + h1) * K, l1, sk, rk, 1);
        lin_pf_add(&pf, a->dv + (t1 * H + h1) * V, l1, sv, rv, 1);
    }
    b->pf = &pf, b->per = PF_PER_BWD;
    FN(bl_grads)(t0, len, H, h, K, V, W, C, a->has_g, a->fmap, a->sc, GL, a->P + (c * H + h) * KW, Dh, b, a->dq,
                 a->dk, a->dv, a->dg);
    FN(bl_R)(len, K, W, C, a->has_g, 1, b, R);
    lin_pf_step(&pf, -1);
    b->pf = NULL;
    FN(carry)(KW, a->has_g, (REAL)GL, Dh, R);
}

int FN(linattn_linear_bwd)(const linattn_linear_plan *p, const REAL *q, const REAL *k, const REAL *v, const REAL *g,
                           const REAL *P, const REAL *dnum, const REAL *dden, const REAL *o, const REAL *den,
                           const REAL *dS, REAL *dq, REAL *dk, REAL *dv, REAL *dg, REAL *dS0) {
    const int64_t N = p->N, H = p->H, K64 = p->K, V64 = p->V, C64 = p->C, *starts = p->starts;
    const int norm = p->norm, fmap = p->fmap, nthreads = p->nthreads;
    const double scale = p->scale, eps = p->eps;
    const int K = (int)K64, V = (int)V64, C = (int)C64, W = V + (norm ? 1 : 0), has_g = g != NULL;
    const int64_t KW = (int64_t)K * W;
    const REAL sc = (REAL)scale, ep = (REAL)eps;
    int64_t *first = malloc(sizeof(int64_t) * (N + 1));
    if (!first) return -1;
    const int64_t NC = lin_chunks(N, starts, C, NULL, first);
    /* as in the forward pass: one pass per unit (chains with few units per thread), else the split */
    const int one_pass = nthreads <= 1 || N * H >= (int64_t)nthreads;
    const int chains = one_pass && nthreads > 1 && N * H < LIN_UNITS_PER_THREAD * (int64_t)nthreads;
    /* whole sequences per one-pass task when there are enough (all heads of a chunk in turn: contiguous rows),
       as in the forward pass */
    const int seq_major = one_pass && !chains && (nthreads <= 1 || N >= 2 * (int64_t)nthreads);
    const int64_t nh = seq_major && H > 0 ? H : 1;
    lin_chunk_t *ch = malloc(sizeof(lin_chunk_t) * (NC > 0 ? NC : 1));
    REAL *gl = malloc(sizeof(REAL) * (NC * H > 0 ? NC * H : 1));
    /* the gradient of each chunk's end state (split path only); Du: the chains' carried state gradients, KWp apart
       (whole cache lines, as the forward's states) */
    const int64_t KWp = lin_lines(KW, sizeof(REAL));
    REAL *dP = one_pass ? NULL : malloc(sizeof(REAL) * (NC * H * KW > 0 ? NC * H * KW : 1));
    REAL *Du = chains ? lin_alloc_lines(N * H * KWp, sizeof(REAL)) : NULL;
    lin_flow_t flow = {0};
    la_chains_t chn = {0};
    if (!ch || !gl || (!one_pass && (!dP || lin_flow_init(&flow, N * H) != 0)) ||
        (chains && (!Du || lin_chains(&chn, N, H, first, 1, nthreads) != 0))) {
        if (flow.done) lin_flow_free(&flow);
        free(first), free(ch), free(gl), free(dP), free(Du);
        return -1;
    }
    lin_chunks(N, starts, C, ch, first);
    for (int64_t u = 0; Du && u < N * H; u++) {
        if (dS) memcpy(Du + u * KWp, dS + u * KW, sizeof(REAL) * KW);
        else memset(Du + u * KWp, 0, sizeof(REAL) * KW);
    }
    if ((chains || !one_pass) && dS0) /* a unit without chunks (an empty sequence): its initial state's gradient */
        for (int64_t u = 0; u < N * H; u++)
            if (first[u / H + 1] == first[u / H]) {
                if (dS) memcpy(dS0 + u * KW, dS + u * KW, sizeof(REAL) * KW);
                else memset(dS0 + u * KW, 0, sizeof(REAL) * KW);
            }
    lin_hugepages(dq, (int64_t)sizeof(REAL) * starts[N] * H * K);
    lin_hugepages(dk, (int64_t)sizeof(REAL) * starts[N] * H * K);
    lin_hugepages(dv, (int64_t)sizeof(REAL) * starts[N] * H * V);
    const int group = chains ? lin_group(N, H, nthreads) : 1;
    const FN(bargs) ba = {q, k, v, g, P, dnum, dden, o, den, dq, dk, dv, dg, H, K, V, W, C, has_g, fmap, sc, ep};
    int failed = 0;
    const int MX = K > W ? K : W;
    const size_t scratch = (size_t)(3 * C * K + 2 * C * W + 2 * W * K + 4 * C * C + 3 * C * MX + 2 * C + MX * C + (nh + 1) * KW);
#pragma omp parallel num_threads(nthreads)
    {
        LA_TRACE(LA_EV_REGION, 0);
        REAL *buf = malloc(sizeof(REAL) * scratch);
        FN(bws) b;
        b.G = malloc(sizeof(double) * C);
        if (!b.G) free(buf), buf = NULL;
        b.Q = buf, b.Km = b.Q + C * K, b.Qd = b.Km + C * K, b.Vb = b.Qd + C * K, b.dO = b.Vb + C * W;
        b.Pt = b.dO + C * W, b.dPt = b.Pt + W * K, b.A = b.dPt + W * K, b.D = b.A + C * C, b.dA = b.D + C * C;
        b.T2 = b.dA + C * C, b.X = b.T2 + C * C, b.Y = b.X + C * MX, b.Z = b.Y + C * MX;
        b.dG = b.Z + C * MX + C, b.Tr = b.dG + C, b.pf = NULL, b.per = 0;
        REAL *Dg = b.Tr + MX * C, *R = Dg + nh * KW;
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
        if (chains) {
            int64_t got[LIN_UNITS_PER_THREAD]; /* the units claimed side by side: heads of one sequence */
            for (int n; buf && (n = la_chains_claim_group(&chn, N * H, group, got)) > 0;) {
                const int64_t s = got[0] / H, cb = chn.run[got[0]], end = first[s];
                const int64_t ce = cb - la_chains_run(cb - end, LIN_CHAIN_RUN);
                for (int64_t c = cb - 1; c >= ce; c--)
                    for (int j = 0; j < n; j++) {
                        /* the next unit's rows: the next claimed head of this chunk, else the first of the previous */
                        const int nxt_h = j + 1 < n;
                        const int64_t c1 = nxt_h ? c : (c > end ? c - 1 : -1);
                        FN(bl_chunk)(&ba, &b, c, ch[c].t0, (int)ch[c].len, got[j] % H, Du + got[j] * KWp, R, c1,
                                     got[nxt_h ? j + 1 : 0] % H, ch);
                    }
                for (int j = 0; j < n; j++) {
                    if (ce == end && dS0) memcpy(dS0 + got[j] * KW, Du + got[j] * KWp, sizeof(REAL) * KW);
                    la_chains_release(&chn, got[j], ce, ce - end);
                }
            }
        } else if (one_pass) { /* each task: the chunks in reverse, the state gradients carried */
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < N * H / nh; task++) {
                if (!buf) continue;
                const int64_t s = seq_major ? task : task / H, h0 = seq_major ? 0 : task % H;
                if (dS) memcpy(Dg, dS + (s * H + h0) * KW, sizeof(REAL) * nh * KW);
                else memset(Dg, 0, sizeof(REAL) * nh * KW);
                for (int64_t c = first[s + 1] - 1; c >= first[s]; c--) {
                    const int64_t t0 = ch[c].t0;
                    const int len = (int)ch[c].len;
                    for (int64_t h = h0; h < h0 + nh; h++) {
                        /* the next unit's rows: the next head of this chunk, else the first head of the previous */
                        const int nxt_h = h + 1 < h0 + nh, nxt_c = c > first[s];
                        const int64_t c1 = nxt_h ? c : (nxt_c ? c - 1 : -1);
                        FN(bl_chunk)(&ba, &b, c, t0, len, h, Dg + (h - h0) * KW, R, c1, nxt_h ? h + 1 : h0, ch);
                    }
                }
                if (dS0) memcpy(dS0 + (s * H + h0) * KW, Dg, sizeof(REAL) * nh * KW);
            }
        } else if (buf) { /* a thread without scratch claims nothing: the others take every task */
            const int64_t NT = NC * H;
            for (;;) {
                const int64_t i = atomic_fetch_add(&flow.next, 1);
                if (i >= 2 * NT) break;
                int64_t c, h;
                lin_flow_task(i < NT ? i : i - NT, H, ch, first, &c, &h);
                const int64_t s = ch[c].seq, u = s * H + h, t0 = ch[c].t0, task = c * H + h;
                const int len = (int)ch[c].len;
                if (i < NT) { /* the chunk's R_c, into dP[c] for now */
                    gl[task] =
                        FN(bl_load)(q, k, v, g, dnum, dden, o, den, ep, t0, len, H, h, K, V, W, C, fmap, sc, &b);
                    FN(bl_R)(len, K, W, C, has_g, 0, &b, dP + task * KW);
                    if (!lin_flow_finish(&flow, u, first[s + 1] - first[s])) continue;
                    /* the unit's reverse running sum: dP[c] = the gradient of the state after chunk c */
                    if (dS) memcpy(Dg, dS + u * KW, sizeof(REAL) * KW);
                    else memset(Dg, 0, sizeof(REAL) * KW);
                    for (int64_t c1 = first[s + 1] - 1; c1 >= first[s]; c1--) {
                        REAL *Rc = dP + (c1 * H + h) * KW;
                        memcpy(R, Rc, sizeof(REAL) * KW);
                        memcpy(Rc, Dg, sizeof(REAL) * KW);
                        FN(carry)(KW, has_g, gl[c1 * H + h], Dg, R);
                    }
                    if (dS0) memcpy(dS0 + u * KW, Dg, sizeof(REAL) * KW);
                    atomic_store_explicit(&flow.ready[u], 1, memory_order_release);
                } else { /* the chunk's input gradients */
                    lin_flow_wait(&flow, u);
                    const double GL =
                        FN(bl_load)(q, k, v, g, dnum, dden, o, den, ep, t0, len, H, h, K, V, W, C, fmap, sc, &b);
                    FN(bl_grads)(t0, len, H, h, K, V, W, C, has_g, fmap, sc, GL, P + task * KW, dP + task * KW, &b,
                                 dq, dk, dv, dg);
                }
            }
        }
        free(buf), free(b.G);
    }
    if (!one_pass) lin_flow_free(&flow);
    if (chains) la_chains_free(&chn);
    free(first), free(ch), free(gl), free(dP), free(Du);
    return failed ? -1 : 0;
}

#endif
