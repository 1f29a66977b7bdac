/* Cache lines asked for ahead of a pass that will read them in order (the decode plans' guard,
   models/decode_plan.PlanGuard): after a decoded token has streamed every weight through the caches, each object
   the guard reads is a miss, and Python reads them one after the other, so each miss waits for the one before.
   Here every line is asked for at once and the memory system overlaps them.

   linattn_prefetch_lines(n, lines): a prefetch of each of the n addresses, in order. A prefetch never faults: an
   address whose object was freed or moved costs a useless line, nothing else; nothing is read or written. */
#include "common.h"

LA_ABI_VERSION(prefetch, 1)

void linattn_prefetch_lines(int64_t n, const uint64_t *lines) {
    for (int64_t i = 0; i < n; i++) __builtin_prefetch((const void *)(uintptr_t)lines[i], 0, 3);
}
