/* The decode plans' guard in one call (models/decode_plan.PlanGuard, cpu/guard.py): after a decoded token has
   streamed every weight through the caches, the guard's Python reads ~900 tensors' data pointers and versions and
   ~660 dicts' version tags, each a chain of dependent cache misses and a method call. Here every word those reads
   depend on is compared with the value recorded when the guard was built, all lines asked for first so the misses
   overlap.

   linattn_guard_same(lay, nd, dicts, dvers, nt, rec, nv, vrec) -> 1 when every word equals its record, else 0
   (the caller then runs the Python check: this call only ever says "nothing changed").
     lay: the byte offsets (cpu/guard.py, found and verified on tensors of our own): [0] a dict's version tag,
          [1] a tensor object's TensorImpl pointer, [2] a TensorImpl's StorageImpl pointer, [3] a StorageImpl's
          data pointer, [4] a TensorImpl's storage offset, [5] its numel, [6] its dtype (uint16), [7] its version
          counter's pointer, [8] the counter's count (uint32).
     dicts, dvers: nd dicts' addresses and version tags.
     rec: nt tensors, GUARD_WORDS each: the Python object, its TensorImpl, StorageImpl, data pointer, storage offset,
          numel, dtype.
     vrec: nv copied tensors, 3 each: the index of its record in rec, its version counter, its count.

   Nothing is read through an address that was not first compared equal to its record: the objects (the guard
   holds them), then the TensorImpl the object holds now, then the StorageImpl and version counter the TensorImpl
   holds now (the guard's detached aliases keep the recorded ones alive). A stale record reads as a mismatch. */
#include "common.h"

LA_ABI_VERSION(guard, 1)

#define GUARD_WORDS 7

static inline uint64_t word_at(uint64_t a) { return *(const uint64_t *)(uintptr_t)a; }

int64_t linattn_guard_same(const int64_t *lay, int64_t nd, const uint64_t *dicts, const uint64_t *dvers,
                           int64_t nt, const uint64_t *rec, int64_t nv, const uint64_t *vrec) {
    /* every line the compares read, asked for at once (a prefetch never faults: a freed address costs a line) */
    for (int64_t i = 0; i < nd; i++) __builtin_prefetch((const void *)(uintptr_t)(dicts[i] + lay[0]), 0, 3);
    for (int64_t i = 0; i < nt; i++) {
        const uint64_t *r = rec + i * GUARD_WORDS;
        __builtin_prefetch((const void *)(uintptr_t)(r[0] + lay[1]), 0, 3);
        __builtin_prefetch((const void *)(uintptr_t)(r[1] + lay[2]), 0, 3);
        __builtin_prefetch((const void *)(uintptr_t)(r[1] + lay[4]), 0, 3);
        __builtin_prefetch((const void *)(uintptr_t)(r[1] + lay[6]), 0, 3);
        __builtin_prefetch((const void *)(uintptr_t)(r[2] + lay[3]), 0, 3);
    }
    for (int64_t i = 0; i < nv; i++) {
        __builtin_prefetch((const void *)(uintptr_t)(rec[vrec[3 * i] * GUARD_WORDS + 1] + lay[7]), 0, 3);
        __builtin_prefetch((const void *)(uintptr_t)(vrec[3 * i + 1] + lay[8]), 0, 3);
    }
    for (int64_t i = 0; i < nd; i++)
        if (word_at(dicts[i] + lay[0]) != dvers[i]) return 0;
    for (int64_t i = 0; i < nt; i++) {
        const uint64_t *r = rec + i * GUARD_WORDS;
        if (word_at(r[0] + lay[1]) != r[1]) return 0;   /* the object holds another TensorImpl (swapped) */
        if (word_at(r[1] + lay[2]) != r[2]) return 0;   /* another storage (`.data =`, `set_`) */
        if (word_at(r[2] + lay[3]) != r[3]) return 0;   /* the storage's memory moved (a resize) */
        if (word_at(r[1] + lay[4]) != r[4] || word_at(r[1] + lay[5]) != r[5]) return 0;
        if (*(const uint16_t *)(uintptr_t)(r[1] + lay[6]) != (uint16_t)r[6]) return 0;
    }
    for (int64_t i = 0; i < nv; i++) {
        const uint64_t *v = vrec + 3 * i;
        if (word_at(rec[v[0] * GUARD_WORDS + 1] + lay[7]) != v[1]) return 0;   /* its TensorImpl compared above */
        if (*(const uint32_t *)(uintptr_t)(v[1] + lay[8]) != (uint32_t)v[2]) return 0;
    }
    return 1;
}
