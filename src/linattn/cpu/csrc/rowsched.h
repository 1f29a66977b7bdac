/* The weight products' row schedule (decode.c's fp32 / fp64 / bf16 products, qmatvec.h's integer products).

   A step reads four rows i, i + q, i + 2q, i + 3q (q = Q_QUARTER(n), about n / 4), sharing its loads of x, so the
   four rows are four sequential streams, each through its own quarter of the matrix, and each stream's line
   Q_PF_BYTES ahead is prefetched as its line is read; then the rows left (q_step_rows). Four neighbouring rows
   share a 4 KiB page when rows are short (an int4 row of 1024 inputs is 512 bytes, a bf16 one 2 KiB), and the
   hardware prefetcher, which follows about one stream per page, then leaves the reads to the software prefetches
   alone, whose fill buffers cap one core near 8-11 GB/s; four neighbouring rows of 4 KiB each restart four streams
   every step. A row's arithmetic does not depend on the rows it is read with (only, in the fp32 / bf16 products, on
   whether it is read in a step of four or alone). Split across threads, each thread's steps are a contiguous range:
   four streams per thread. */
#ifndef LINATTN_ROWSCHED_H
#define LINATTN_ROWSCHED_H

#include <stdint.h>

/* Q_PF(p, end): the line Q_PF_BYTES past a row stream's read at p prefetched (into L2: prefetcht1 on x86), unless
   at or past the matrix's end (addresses as integers: no pointer is formed past the array). 1536 since round 21d:
   the 530M model's int4-a8 products ~2-3 % less CPU time than at 1024 (2048 the same as 1536, 4096 and 512 slower),
   fp32, bf16 and int8-a8 -2 to +0.5 % (2048: fp32 +3.4 %); docs/cpu_kernels.md, round 21d */
#ifndef Q_PF_BYTES   /* (a build may set another distance: bench variants) */
#define Q_PF_BYTES 1536
#endif
/* the prefetches' locality: 2 (prefetcht1, into L2). 0 (prefetchnta, which would leave the LLC to the recurrent
   states) measured 1.4-1.7x slower products on the 530M model's sequence: its lines go to L1 only and each holds one
   of the core's few fill buffers until it arrives, so far fewer lines are in flight (a bench variant only) */
#ifndef Q_PF_HINT
#define Q_PF_HINT 2
#endif
#define Q_PF(p, end)                                                                          \
    do {                                                                                      \
        const uintptr_t a_ = (uintptr_t)(p) + Q_PF_BYTES;                                     \
        if (a_ < (uintptr_t)(end)) __builtin_prefetch((const void *)a_, 0, Q_PF_HINT);        \
    } while (0)

/* the streams' distance in rows, q: n / 4 - 1 from n = 8 (round 21e), so that the streams are not a multiple of
   4 KiB apart where rows of 512 B, 1 KiB or 2 KiB and n a multiple of 4 (every model shape) would put them so (the
   530M model's int4-a8 products ~4.5 % less CPU time, bf16 3-4 %, int8-a8 2-3 %; fp32 rows of 4 KiB are a multiple
   whatever q: unchanged; docs/cpu_kernels.md, round 21e); n / 4 below 8. A rule of n alone, for every product:
   qlayout.step_quarter, which orders int4-a8's group scales by it, sees only [n, ng]. */
#ifndef Q_QUARTER   /* (a build may set another rule: the tests' build of the rule before) */
#define Q_QUARTER(n) ((n) >= 8 ? (n) / 4 - 1 : (n) / 4)
#endif
#define Q_STEPS(n) ((n) / 4 + (n) % 4)

/* step t of a product over n rows (t < Q_STEPS(n)): its first row, the stride to its other rows, its row count.
   Steps t < q: rows t + k q; then, where 4q < 4 (n / 4) (n >= 8), one step of the four neighbouring rows 4q ..
   4q + 3; then the n % 4 last rows one at a time. Every row of the rule before (q = n / 4) in a step of four is in
   one here, the n % 4 last alone as there: the fp32 / bf16 products' one-row loops sum in another order than their
   four-row ones, so this keeps every row's bits. */
static inline int64_t q_step_rows(int64_t n, int64_t t, int64_t *stride, int *r) {
    const int64_t q = Q_QUARTER(n), f = n / 4;
    if (t < q) {
        *stride = q, *r = 4;
        return t;
    }
    if (t < f) {   /* (t == q: the step of neighbouring rows) */
        *stride = 1, *r = 4;
        return 4 * q;
    }
    *stride = 0, *r = 1;
    return 4 * f + (t - f);
}

/* The first Q_PF_BYTES of each row stream a product starts with (the streams of each thread's first step, its steps
   split into nt contiguous ranges as the static schedule splits them), of a matrix of n rows of rowbytes bytes at
   base, prefetched before the product's setup (x rounded or permuted), so that they are on their way while it runs:
   the steps' own prefetches run Q_PF_BYTES ahead, which leaves a stream's first Q_PF_BYTES to demand misses, a
   memory latency every few steps at each product's start (a 1024-row product of 2048 int4 inputs reads 1.1 MB: its
   start is not negligible). A hint only: no bits change. */
static inline void q_prefetch_starts(int64_t n, int64_t rowbytes, const void *base, int nt) {
    const int64_t steps = Q_STEPS(n);
    const uintptr_t end = (uintptr_t)base + (uintptr_t)(n * rowbytes);
    for (int t = 0; t < nt; ++t) {
        int64_t stride;
        int r;
        const int64_t i0 = q_step_rows(n, steps * t / nt, &stride, &r);
        for (int k = 0; k < r; ++k) {
            const uintptr_t a = (uintptr_t)base + (uintptr_t)((i0 + k * stride) * rowbytes);
            for (uintptr_t o = 0; o < Q_PF_BYTES && a + o < end; o += 64)
                __builtin_prefetch((const void *)(a + o), 0, Q_PF_HINT);
        }
    }
}

/* every step of a product over n rows (q_step_rows: i0, stride, r) through `call`, across the scope's `nthreads`
   threads when `par` */
#define Q_FOR_STEPS(n, par, call)                                          \
    do {                                                                             \
        const int64_t steps_ = Q_STEPS(n);                                           \
        if (par) {                                                                   \
            _Pragma("omp parallel for num_threads(nthreads) schedule(static)")       \
            for (int64_t t_ = 0; t_ < steps_; ++t_) {                                \
                int64_t stride;                                                      \
                int r;                                                               \
                const int64_t i0 = q_step_rows(n, t_, &stride, &r);                  \
                call;                                                                \
            }                                                                        \
        } else                                                                       \
            for (int64_t t_ = 0; t_ < steps_; ++t_) {                                \
                int64_t stride;                                                      \
                int r;                                                               \
                const int64_t i0 = q_step_rows(n, t_, &stride, &r);                  \
                call;                                                                \
            }                                                                        \
    } while (0)

/* the steps of a product over n rows as each thread's contiguous range (steps * th / nt up to steps * (th + 1) / nt,
   the split q_prefetch_starts prefetches for): `call` with s0_, s1_ across the scope's `nthreads` threads when
   `par`, else once over every step. For loops that set a product up once per range rather than once per step
   (qmatvec.h's step loops). Without OpenMP the ranges run one after the other. */
#if defined(_OPENMP)
#define Q_FOR_RANGES(n, par, call)                                                                  \
    do {                                                                                            \
        const int64_t steps_ = Q_STEPS(n);                                                          \
        if (par) {                                                                                  \
            _Pragma("omp parallel num_threads(nthreads)")                                           \
            {                                                                                       \
                const int64_t th_ = omp_get_thread_num(), nt_ = omp_get_num_threads();              \
                const int64_t s0_ = steps_ * th_ / nt_, s1_ = steps_ * (th_ + 1) / nt_;             \
                call;                                                                               \
            }                                                                                       \
        } else {                                                                                    \
            const int64_t s0_ = 0, s1_ = steps_;                                                    \
            call;                                                                                   \
        }                                                                                           \
    } while (0)
#else
#define Q_FOR_RANGES(n, par, call)                                                                  \
    do {                                                                                            \
        const int64_t steps_ = Q_STEPS(n), nt_ = (par) ? nthreads : 1;                              \
        for (int64_t th_ = 0; th_ < nt_; ++th_) {                                                   \
            const int64_t s0_ = steps_ * th_ / nt_, s1_ = steps_ * (th_ + 1) / nt_;                 \
            call;                                                                                   \
        }                                                                                           \
    } while (0)
#endif

#endif
