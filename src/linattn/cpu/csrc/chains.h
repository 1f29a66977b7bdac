/* Chains: the threads of a kernel share a few long sequential jobs ("units": one (sequence, head) scan each) by
   claiming a unit for one run of its steps at a time, its carried state kept by the kernel in a shared array
   between runs. A thread takes the free unit with the most steps left (the first from the claim cursor on among
   equals: round robin; the delta scan's threads keep to their own blocks of heads within a slack,
   la_chains_claim_own), so the units advance together and end together, and a thread that the system deschedules
   (another process on its core, a CPU quota) holds back one run of one unit while the others take the other units.
   There is no barrier inside the work: a thread that finds every unfinished unit held sleeps briefly and tries
   again (la_wait: its core goes idle, so the system can move a descheduled holder onto it; a spinning or yielding
   thread keeps the core looking busy).

   Placement (la_team_t): the system may put two of a call's threads on one CPU while another CPU runs some other
   process. With no idle CPU a woken thread stays where it is or joins its waker, and the load balancer does not undo
   it (moving one of the two would leave the same imbalance, reversed), so the two take turns on one CPU for the
   whole call: at one thread's speed, minus the switching, beside a 1-thread call that has a CPU to itself. At every
   claim a thread notes its CPU; the higher-numbered of two threads found on one CPU restricts itself to the CPUs of
   its affinity mask on which no other thread of the call was last seen (when there is one), and takes its own mask
   back when it leaves the call (its last claim). It then shares a CPU with the other process, not with a thread of
   its own call. Linux with _GNU_SOURCE only (sched_getcpu, sched_setaffinity); elsewhere threads stay where the
   system puts them.

   The arithmetic of a unit is the same whoever runs which run, so results do not depend on the thread count, nor on
   where the threads run. Without OpenMP the one thread claims every run in turn. Used by linear.c and delta.c. */
#ifndef LINATTN_CHAINS_H
#define LINATTN_CHAINS_H

#if defined(__linux__) && !defined(_DEFAULT_SOURCE)
#define _DEFAULT_SOURCE
#endif
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__unix__) || defined(__APPLE__)
#include <time.h>
#endif
/* A profiling harness defines LA_TRACE(event, unit) before including a kernel to timestamp each thread's claims,
   sleeps and releases (LA_EV_*); in the library it is nothing. */
#ifndef LA_TRACE
#define LA_TRACE(event, unit) ((void)0)
#endif
enum { LA_EV_REGION, LA_EV_CLAIM, LA_EV_GOT, LA_EV_SLEEP, LA_EV_RELEASE, LA_EV_LEAVE };
#if defined(__linux__) && defined(_GNU_SOURCE) && defined(_OPENMP)
#include <sched.h>
#define LA_PLACEMENT 1
#else
#define LA_PLACEMENT 0
#endif

/* a call's threads and the CPU each was last seen on (la_team_check) */
typedef struct {
    int n;            /* threads of the call */
    _Atomic int *cpu; /* per thread: its CPU at its last claim, -1 before the first and after the last */
#if LA_PLACEMENT
    cpu_set_t *saved; /* per thread: its affinity mask before it moved */
    int *moved;       /* per thread: it restricted its mask (and takes `saved` back when it leaves) */
#endif
} la_team_t;

static int la_team_init(la_team_t *t, int threads) {
    t->n = threads > 1 ? threads : 1;
    t->cpu = malloc(sizeof(*t->cpu) * (size_t)t->n);
#if LA_PLACEMENT
    t->saved = malloc(sizeof(*t->saved) * (size_t)t->n);
    t->moved = calloc((size_t)t->n, sizeof(*t->moved));
    if (!t->cpu || !t->saved || !t->moved) {
        free((void *)t->cpu), free(t->saved), free(t->moved);
        t->cpu = NULL, t->saved = NULL, t->moved = NULL;
        return -1;
    }
#else
    if (!t->cpu) return -1;
#endif
    for (int i = 0; i < t->n; i++) atomic_init(&t->cpu[i], -1);
    return 0;
}

static void la_team_free(la_team_t *t) {
    free((void *)t->cpu);
#if LA_PLACEMENT
    free(t->saved), free(t->moved);
#endif
}

/* the caller is about to claim work: note its CPU, and move off a CPU that another thread of the call was seen on */
static void la_team_check(la_team_t *t) {
#if LA_PLACEMENT
    const int me = omp_get_thread_num(), cpu = sched_getcpu();
    if (t->n < 2 || me >= t->n || cpu < 0) return;
    atomic_store_explicit(&t->cpu[me], cpu, memory_order_relaxed);
    int clash = 0;
    for (int i = 0; i < me; i++) clash |= atomic_load_explicit(&t->cpu[i], memory_order_relaxed) == cpu;
#ifdef LA_TEAM_ALWAYS_MOVE /* a test build: every thread but the first moves off the others' CPUs at every claim */
    clash = me > 0;
#endif
    if (!clash || (!t->moved[me] && sched_getaffinity(0, sizeof(cpu_set_t), &t->saved[me]) != 0)) return;
    cpu_set_t to;
    CPU_ZERO(&to);
    int free_cpus = 0;
    for (int c = 0; c < CPU_SETSIZE; c++) {
        if (!CPU_ISSET(c, &t->saved[me])) continue;
        int seen = c == cpu;
#ifdef LA_TEAM_ALWAYS_MOVE
        seen = 0;
#endif
        for (int i = 0; i < t->n && !seen; i++)
            seen = i != me && atomic_load_explicit(&t->cpu[i], memory_order_relaxed) == c;
        if (!seen) CPU_SET(c, &to), free_cpus++;
    }
    if (free_cpus > 0 && sched_setaffinity(0, sizeof(cpu_set_t), &to) == 0) t->moved[me] = 1;
#else
    (void)t;
#endif
}

/* the caller has no more work in this call: forget its CPU and take its own affinity mask back */
static void la_team_leave(la_team_t *t) {
#if LA_PLACEMENT
    const int me = omp_get_thread_num();
    if (me >= t->n) return;
    atomic_store_explicit(&t->cpu[me], -1, memory_order_relaxed);
    if (t->moved[me] && sched_setaffinity(0, sizeof(cpu_set_t), &t->saved[me]) == 0) t->moved[me] = 0;
#else
    (void)t;
#endif
}

typedef struct {
    _Atomic int64_t cursor; /* where the next claim starts looking */
    _Atomic int64_t left;   /* units with steps left */
    _Atomic int *held;      /* per unit: held by a thread (or finished, or never added) */
    int64_t *run;           /* per unit: where its next run starts (read and written by the holder only) */
    _Atomic int64_t *rest;  /* per unit: its steps left (written by the holder, read by every claim) */
    la_team_t team;         /* the call's threads and where they run */
    /* group claims (la_chains_claim_group) */
    _Atomic int waiting; /* threads asleep in a claim, finding every unfinished unit held */
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

/* every unit starts held (not claimable) until la_chains_add; `threads`: the call's thread count; returns -1 when
   memory is missing */
static int la_chains_init(la_chains_t *c, int64_t units, int threads) {
    const size_t n = (size_t)(units > 0 ? units : 1);
    c->held = malloc(sizeof(*c->held) * n);
    c->run = malloc(sizeof(*c->run) * n);
    c->rest = malloc(sizeof(*c->rest) * n);
    if (!c->held || !c->run || !c->rest || la_team_init(&c->team, threads) != 0) {
        free((void *)c->held), free(c->run), free((void *)c->rest);
        c->held = NULL, c->run = NULL, c->rest = NULL;
        return -1;
    }
    atomic_init(&c->cursor, 0);
    atomic_init(&c->left, 0);
    atomic_init(&c->waiting, 0);
    for (int64_t u = 0; u < units; u++) atomic_init(&c->held[u], 1), atomic_init(&c->rest[u], 0), c->run[u] = 0;
    return 0;
}

static void la_chains_free(la_chains_t *c) {
    free((void *)c->held), free(c->run), free((void *)c->rest), la_team_free(&c->team);
}

/* unit u has `steps` (> 0) to run, from `start` (before the threads start) */
static void la_chains_add(la_chains_t *c, int64_t u, int64_t start, int64_t steps) {
    c->run[u] = start;
    atomic_store_explicit(&c->rest[u], steps, memory_order_relaxed);
    atomic_store(&c->held[u], 0);
    atomic_fetch_add(&c->left, 1);
}

/* A unit with steps left that no other thread holds, now held by the caller; -1 when every unit is finished (the
   caller then leaves the call's team: no more claims from it in this call). Of the free units the one with the most
   steps left, the first from the cursor on among equals (round robin): a unit that fell behind (run alone beside a
   waiting thread while the others of its group ran on) catches up, and its group is whole again
   (la_chains_claim_whole_group).

   Kept to its own units (la_chains_claim_own, with thread `me` of the call's `nt`): thread me owns the units u
   with u nt / units == me (a contiguous block: B = 1, H = 4 on 2 threads, heads 0-1 and 2-3) and takes its own
   free unit with the most steps left unless another free unit has more than `slack` steps more (a descheduled
   thread's units fell behind: the others take them) or none of its own is free (finished, or taken by another
   thread). Heads' rows lie side by side in every token's row ([T, H, D]), so a thread that keeps to a block of
   neighbouring heads reads its own part of each page, where one that runs any head pulls the neighbouring lines
   that the other core reads (the hardware prefetchers) into its caches too: a delta forward run beside the other
   thread took ~1.5x the CPU time of the same run on one thread, ~1.2x with each thread on its own heads
   (docs/cpu_kernels.md, round 8). nt = 1: every unit is the caller's (la_chains_claim). */
static int64_t la_chains_claim_own(la_chains_t *c, int64_t units, int me, int nt, int64_t slack) {
    LA_TRACE(LA_EV_CLAIM, -1);
    la_team_check(&c->team);
    while (atomic_load(&c->left) > 0) {
        const int64_t c0 = atomic_fetch_add(&c->cursor, 1);
        int64_t best = -1, most = 0, mine = -1, mine_most = 0;
        for (int64_t i = 0; i < units; i++) {
            const int64_t u = (c0 + i) % units;
            if (atomic_load_explicit(&c->held[u], memory_order_relaxed)) continue;
            const int64_t r = atomic_load_explicit(&c->rest[u], memory_order_relaxed);
            if (best < 0 || r > most) best = u, most = r;
            if (nt > 1 && u * nt / units == me && (mine < 0 || r > mine_most)) mine = u, mine_most = r;
        }
        if (mine >= 0 && mine_most + slack >= most) best = mine;
        if (best >= 0) {
            if (!atomic_exchange_explicit(&c->held[best], 1, memory_order_acquire)) {
                LA_TRACE(LA_EV_GOT, best);
                return best;
            }
            continue; /* another thread took it first: look again */
        }
        atomic_fetch_add_explicit(&c->waiting, 1, memory_order_relaxed);
        LA_TRACE(LA_EV_SLEEP, -1);
        la_wait();
        atomic_fetch_sub_explicit(&c->waiting, 1, memory_order_relaxed);
    }
    la_team_leave(&c->team);
    LA_TRACE(LA_EV_LEAVE, -1);
    return -1;
}

static int64_t la_chains_claim(la_chains_t *c, int64_t units) {
    return la_chains_claim_own(c, units, 0, 1, 0);
}

/* the calling thread's number and its team's size (0 and 1 without OpenMP), for la_chains_claim_own */
static inline int la_thread_num(void) {
#if defined(_OPENMP)
    return omp_get_thread_num();
#else
    return 0;
#endif
}
static inline int la_team_size(void) {
#if defined(_OPENMP)
    return omp_get_num_threads();
#else
    return 1;
#endif
}

/* All g units of an aligned group (units g * i ..., i from the claim cursor on, every group tried once) when every
   one of them is free and they stand at one position (run[] equal); returns 1 and fills got[0 .. g), else 0 (and
   holds nothing). A group is taken whole or not at all: a thread that finds a group half held (its holder is
   releasing it, or another thread is taking it) tries the next group, so a claim does not split a group that is
   about to be free and leave its members drifting apart for the rest of the call. */
static int la_chains_claim_whole_group(la_chains_t *c, int64_t units, int g, int64_t *got) {
    const int64_t groups = units / g;
    if (groups < 1) return 0;
    const int64_t c0 = atomic_fetch_add(&c->cursor, 1);
    for (int64_t i = 0; i < groups; i++) {
        const int64_t g0 = ((c0 + i) % groups) * g;
        int n = 0;
        for (; n < g; n++) {
            if (atomic_load_explicit(&c->held[g0 + n], memory_order_relaxed) ||
                atomic_exchange_explicit(&c->held[g0 + n], 1, memory_order_acquire))
                break;
            got[n] = g0 + n;
        }
        int aligned = n == g;
        for (int j = 1; j < n && aligned; j++) aligned = c->run[got[j]] == c->run[got[0]];
        if (aligned) {
            LA_TRACE(LA_EV_GOT, g0);
            return 1;
        }
        while (n > 0) atomic_store_explicit(&c->held[got[--n]], 0, memory_order_release);
    }
    return 0;
}

/* A claim of g units side by side (all heads of a chunk in turn: their rows share pages and cache lines'
   neighbours) when no thread waits for work: a whole aligned group of g (la_chains_claim_whole_group), else one unit
   (la_chains_claim). A waiting thread means there are fewer free units than threads, and each then claims one unit.
   got[0 .. n) receives the claimed units in ascending order (g values of room); returns n, 0 when every unit is
   finished. */
static int la_chains_claim_group(la_chains_t *c, int64_t units, int g, int64_t *got) {
    int alone = atomic_load_explicit(&c->waiting, memory_order_relaxed) > 0;
#ifdef LA_CHAINS_SPLIT_GROUPS /* a test build: every other claim takes one unit, as beside a waiting thread */
    alone = atomic_load_explicit(&c->cursor, memory_order_relaxed) % 2 == 1;
#endif
    if (g > 1 && !alone && atomic_load_explicit(&c->left, memory_order_relaxed) > 0) {
        LA_TRACE(LA_EV_CLAIM, -1);
        la_team_check(&c->team);
        if (la_chains_claim_whole_group(c, units, g, got)) return g;
    }
    const int64_t u = la_chains_claim(c, units);
    if (u < 0) return 0;
    got[0] = u;
    return 1;
}

/* How many of a unit's `left` steps its holder runs now, with `run` the steps of a claim: a whole run while more
   than two runs' worth are left, then half of what is left (rounded up), so that a unit ends in ever shorter runs (run, run / 2,
   ..., 1). The threads then finish within about a step of each other: a thread that finds every unfinished unit
   held waits for the end of a short run, not of a whole one (at the end of a call every unit is in its tail). */
static inline int64_t la_chains_run(int64_t left, int64_t run) {
    if (left > 2 * run) return run;
    const int64_t half = (left + 1) / 2;
    return half > run ? run : (half < 1 ? left : half);
}

/* the holder of unit u ran it up to `to`, `rest` steps left after it (0: finished, it stays held) */
static void la_chains_release(la_chains_t *c, int64_t u, int64_t to, int64_t rest) {
    LA_TRACE(LA_EV_RELEASE, u);
    c->run[u] = to;
    atomic_store_explicit(&c->rest[u], rest, memory_order_relaxed);
    if (rest == 0) atomic_fetch_sub(&c->left, 1);
    else atomic_store_explicit(&c->held[u], 0, memory_order_release);
}

#endif
