/* Chains: the threads of a kernel share a few long sequential jobs ("units": one (sequence, head) scan each) by
   claiming a unit for one run of its steps at a time, its carried state kept by the kernel in a shared array
   between runs. A thread takes the free unit the claim cursor reaches next (round robin), so the units advance
   together and end together, and a thread that the system deschedules (another process on its core, a CPU quota)
   holds back one run of one unit while the others take the other units. There is no barrier inside the work: a
   thread that finds every unfinished unit held sleeps briefly and tries again (la_wait: its core goes idle, so the
   system can move a descheduled holder onto it; a spinning or yielding thread keeps the core looking busy).

   The arithmetic of a unit is the same whoever runs which run, so results do not depend on the thread count.
   Without OpenMP the one thread claims every run in turn. Used by linear.c and delta.c. */
#ifndef LINATTN_CHAINS_H
#define LINATTN_CHAINS_H

#if defined(__linux__) && !defined(_DEFAULT_SOURCE)
#define _DEFAULT_SOURCE
#endif
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__unix__) || defined(__APPLE__)
#include <time.h>
#endif

typedef struct {
    _Atomic int64_t cursor; /* where the next claim starts looking */
    _Atomic int64_t left;   /* units with steps left */
    _Atomic int *held;      /* per unit: held by a thread (or finished, or never added) */
    int64_t *run;           /* per unit: where its next run starts (read and written by the holder only) */
} la_chains_t;

#ifndef LA_WAIT_NS
#define LA_WAIT_NS 20000 /* a wait's sleep: short beside a run (a millisecond or so), long enough to idle the core */
#endif

/* a thread with nothing to do until another thread's run ends: sleep (not spin, not sched_yield) */
static inline void la_wait(void) {
#if defined(__unix__) || defined(__APPLE__)
    const struct timespec ts = {0, LA_WAIT_NS};
    nanosleep(&ts, NULL);
#endif
}

/* every unit starts held (not claimable) until la_chains_add; returns -1 when memory is missing */
static int la_chains_init(la_chains_t *c, int64_t units) {
    const size_t n = (size_t)(units > 0 ? units : 1);
    c->held = malloc(sizeof(*c->held) * n);
    c->run = malloc(sizeof(*c->run) * n);
    if (!c->held || !c->run) {
        free((void *)c->held), free(c->run);
        c->held = NULL, c->run = NULL;
        return -1;
    }
    atomic_init(&c->cursor, 0);
    atomic_init(&c->left, 0);
    for (int64_t u = 0; u < units; u++) atomic_init(&c->held[u], 1), c->run[u] = 0;
    return 0;
}

static void la_chains_free(la_chains_t *c) { free((void *)c->held), free(c->run); }

/* unit u has steps to run, from `start` (before the threads start) */
static void la_chains_add(la_chains_t *c, int64_t u, int64_t start) {
    c->run[u] = start;
    atomic_store(&c->held[u], 0);
    atomic_fetch_add(&c->left, 1);
}

/* a unit with steps left that no other thread holds, now held by the caller; -1 when every unit is finished */
static int64_t la_chains_claim(la_chains_t *c, int64_t units) {
    while (atomic_load(&c->left) > 0) {
        const int64_t c0 = atomic_fetch_add(&c->cursor, 1);
        for (int64_t i = 0; i < units; i++) {
            const int64_t u = (c0 + i) % units;
            if (!atomic_exchange_explicit(&c->held[u], 1, memory_order_acquire)) return u;
        }
        la_wait();
    }
    return -1;
}

/* the holder of unit u ran it up to `to`; finished: the unit had no steps left after it (it stays held) */
static void la_chains_release(la_chains_t *c, int64_t u, int64_t to, int finished) {
    c->run[u] = to;
    if (finished) atomic_fetch_sub(&c->left, 1);
    else atomic_store_explicit(&c->held[u], 0, memory_order_release);
}

#endif
