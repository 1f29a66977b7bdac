/* The weight products' row schedule (decode.c's fp32 / fp64 / bf16 products, qmatvec.h's integer products).

   A step reads four rows i, i + q, i + 2q, i + 3q (q = n / 4), sharing its loads of x, so the four rows are four
   sequential streams, each through its own quarter of the matrix, and each stream's line Q_PF_BYTES ahead is
   prefetched as its line is read; the n % 4 last rows one at a time. Four neighbouring rows share a 4 KiB page when
   rows are short (an int4 row of 1024 inputs is 512 bytes, a bf16 one 2 KiB), and the hardware prefetcher, which
   follows about one stream per page, then leaves the reads to the software prefetches alone, whose fill buffers cap
   one core near 8-11 GB/s; four neighbouring rows of 4 KiB each restart four streams every step. Each row's
   arithmetic does not depend on the rows it is read with: the schedule changes no bits. Split across threads, each
   thread's steps are a contiguous range: four streams per thread. */
#ifndef LINATTN_ROWSCHED_H
#define LINATTN_ROWSCHED_H

#include <stdint.h>

/* Q_PF(p, end): the line Q_PF_BYTES past a row stream's read at p prefetched (into L2: prefetcht1 on x86), unless
   at or past the matrix's end (addresses as integers: no pointer is formed past the array) */
#ifndef Q_PF_BYTES   /* (a build may set another distance: bench variants) */
#define Q_PF_BYTES 1024
#endif
#define Q_PF(p, end)                                                                          \
    do {                                                                                      \
        const uintptr_t a_ = (uintptr_t)(p) + Q_PF_BYTES;                                     \
        if (a_ < (uintptr_t)(end)) __builtin_prefetch((const void *)a_, 0, 2);                \
    } while (0)

/* step t of a product over n rows (t < n / 4 + n % 4): its first row, the stride to its other rows, its row count */
static inline int64_t q_step_rows(int64_t n, int64_t t, int64_t *stride, int *r) {
    const int64_t q = n / 4;
    if (t < q) {
        *stride = q, *r = 4;
        return t;
    }
    *stride = 0, *r = 1;
    return 4 * q + (t - q);
}
#define Q_STEPS(n) ((n) / 4 + (n) % 4)

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

#endif
