/* Chains: the threads of a kernel share a few long sequential jobs ("units": one (sequence, head) scan each) by
   claiming a unit for one short run of its steps at a time, its carried state kept by the kernel in a shared
   array between runs. There is no barrier inside the work, and no thread owns a fixed share of it:

   * a thread keeps the unit it just ran (its state is in that thread's cache) while it is free, else takes the
     free unit with the most steps left (so the units end together and the last claims are short runs);
   * each thread's pace (nanoseconds per step of its last run) is kept. A thread that finds no free unit sleeps
     briefly and tries again (la_wait: its core goes idle, so the system can move a descheduled holder onto it;
     a spinning or yielding thread keeps the core looking busy), marked as waiting. A thread that ends a run
     while a clearly faster thread waits hands its unit over: it leaves the unit free for one wait and takes it
     back only if the faster thread did not. So when one core is shared with another process, the thread on it
     gives the last unit to the thread that runs at full speed instead of finishing it at its own pace.

   The arithmetic of a unit is the same whoever runs which run, so results do not depend on the thread count or
   on who claimed what. The threads are la_team_run's (below), not an OpenMP region's; without OpenMP the one
   thread claims every run in turn. Used by linear.c and delta.c. */
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
/* the chains' own team of POSIX threads (la_team_run), under the OpenMP build (which links the thread library) */
#if defined(_OPENMP) && (defined(__unix__) || defined(__APPLE__))
#include <pthread.h>
#define LA_TEAM 1
#else
#define LA_TEAM 0
#endif

typedef struct {
    _Atomic int64_t left;     /* units with steps left */
    _Atomic int *held;        /* per unit: held by a thread (or finished, or never added) */
    _Atomic int64_t *run;     /* per unit: where its next run starts (written by the holder only) */
    int64_t *end;             /* per unit: where its steps end (a run goes from run[u] towards end[u]) */
    _Atomic int64_t *pace;    /* per thread: nanoseconds per step of its last run (0: none yet) */
    _Atomic int *waiting;     /* per thread: 1 while it sleeps for want of a free unit */
    int64_t *since, *from;    /* per thread, its own slot only: when and where its current run started */
    int threads;
} la_chains_t;

#ifndef LA_WAIT_NS
#define LA_WAIT_NS 20000 /* a wait's sleep: short beside a run (a millisecond or so), long enough to idle the core */
#endif
/* a waiting thread counts as clearly faster at under 3/4 of the releasing thread's time per step: equal threads
   never hand units back and forth */
#define LA_FASTER_NUM 3
#define LA_FASTER_DEN 4

/* a thread with nothing to do until another thread's run ends: sleep (not spin, not sched_yield) */
static inline void la_wait(void) {
#if defined(__unix__) || defined(__APPLE__)
    const struct timespec ts = {0, LA_WAIT_NS};
    nanosleep(&ts, NULL);
#endif
}

/* wall-clock nanoseconds (0 where no monotonic clock: then no thread is ever faster, nothing is handed over) */
static inline int64_t la_now_ns(void) {
#if defined(CLOCK_MONOTONIC)
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) == 0) return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
#endif
    return 0;
}

static void la_chains_free(la_chains_t *c) {
    free((void *)c->held), free((void *)c->run), free(c->end), free((void *)c->pace), free((void *)c->waiting);
    free(c->since), free(c->from);
    c->held = NULL, c->run = NULL, c->end = NULL, c->pace = NULL, c->waiting = NULL, c->since = NULL, c->from = NULL;
}

/* every unit starts held (not claimable) until la_chains_add; `threads`: the team's size; -1 when memory is
   missing (everything freed) */
static int la_chains_init(la_chains_t *c, int64_t units, int threads) {
    const size_t n = (size_t)(units > 0 ? units : 1), t = (size_t)(threads > 0 ? threads : 1);
    c->held = malloc(sizeof(*c->held) * n);
    c->run = malloc(sizeof(*c->run) * n);
    c->end = malloc(sizeof(*c->end) * n);
    c->pace = malloc(sizeof(*c->pace) * t);
    c->waiting = malloc(sizeof(*c->waiting) * t);
    c->since = malloc(sizeof(*c->since) * t);
    c->from = malloc(sizeof(*c->from) * t);
    if (!c->held || !c->run || !c->end || !c->pace || !c->waiting || !c->since || !c->from) {
        la_chains_free(c);
        return -1;
    }
    c->threads = (int)t;
    atomic_init(&c->left, 0);
    for (int64_t u = 0; u < units; u++) atomic_init(&c->held[u], 1), atomic_init(&c->run[u], 0), c->end[u] = 0;
    for (size_t i = 0; i < t; i++) atomic_init(&c->pace[i], 0), atomic_init(&c->waiting[i], 0);
    return 0;
}

/* unit u has steps to run from `start` to `end` (either direction), added before the threads start */
static void la_chains_add(la_chains_t *c, int64_t u, int64_t start, int64_t end) {
    atomic_store(&c->run[u], start);
    c->end[u] = end;
    atomic_store(&c->held[u], 0);
    atomic_fetch_add(&c->left, 1);
}

static inline int64_t la_chains_steps_left(la_chains_t *c, int64_t u) {
    const int64_t d = c->end[u] - atomic_load_explicit(&c->run[u], memory_order_relaxed);
    return d < 0 ? -d : d;
}

/* whether a thread clearly faster than thread `me` waits for a unit */
static int la_chains_faster_waits(la_chains_t *c, int me) {
    const int64_t mine = atomic_load_explicit(&c->pace[me], memory_order_relaxed);
    if (mine <= 0) return 0;
    for (int t = 0; t < c->threads; t++) {
        if (t == me || !atomic_load_explicit(&c->waiting[t], memory_order_relaxed)) continue;
        const int64_t p = atomic_load_explicit(&c->pace[t], memory_order_relaxed);
        if (p > 0 && p * LA_FASTER_DEN < mine * LA_FASTER_NUM) return 1;
    }
    return 0;
}

static inline int la_chains_take(la_chains_t *c, int64_t u, int me) {
    if (atomic_exchange_explicit(&c->held[u], 1, memory_order_acquire)) return 0;
    atomic_store_explicit(&c->waiting[me], 0, memory_order_relaxed);
    c->since[me] = la_now_ns();
    c->from[me] = atomic_load_explicit(&c->run[u], memory_order_relaxed);
    return 1;
}

/* a unit with steps left that no other thread holds, now held by thread `me` (its index in la_team_run's team), which last ran
   unit `prev` (-1: none); -1 when every unit is finished */
static int64_t la_chains_claim(la_chains_t *c, int64_t units, int me, int64_t prev) {
    int handing = prev >= 0 && la_chains_faster_waits(c, me);
    while (atomic_load(&c->left) > 0) {
        if (prev >= 0 && !handing && !atomic_load_explicit(&c->held[prev], memory_order_relaxed) &&
            la_chains_take(c, prev, me))
            return prev;
        int64_t best = -1, most = -1;
        for (int64_t u = 0; u < units; u++) {
            if (u == prev || atomic_load_explicit(&c->held[u], memory_order_relaxed)) continue;
            const int64_t n = la_chains_steps_left(c, u);
            if (n > most) best = u, most = n;
        }
        if (best >= 0) {
            if (la_chains_take(c, best, me)) return best;
            continue; /* another thread took it first: look again */
        }
        atomic_store_explicit(&c->waiting[me], 1, memory_order_relaxed);
        la_wait();
        handing = 0; /* the faster thread had one wait to take the unit left to it */
    }
    atomic_store_explicit(&c->waiting[me], 0, memory_order_relaxed);
    return -1;
}

/* the holder `me` of unit u ran it up to `to`; finished: the unit had no steps left after it (it stays held) */
static void la_chains_release(la_chains_t *c, int64_t u, int64_t to, int finished, int me) {
    const int64_t steps = to > c->from[me] ? to - c->from[me] : c->from[me] - to, t = la_now_ns();
    if (steps > 0 && t > 0) atomic_store_explicit(&c->pace[me], (t - c->since[me]) / steps, memory_order_relaxed);
    atomic_store_explicit(&c->run[u], to, memory_order_relaxed);
    if (finished) atomic_fetch_sub(&c->left, 1);
    else atomic_store_explicit(&c->held[u], 0, memory_order_release);
}

/* A team for chains without OpenMP's barrier: the caller runs work(ctx, 0) itself and nthreads - 1 helper threads
   (created per call, detached) run work(ctx, i). An OpenMP parallel region ends only when every team thread has
   been scheduled at least once and has reached its barrier, and its idle threads spin before they sleep: on a
   machine whose cores are shared with other processes, a thread that never got a core in time still holds the
   call, and a spinning one takes the core of the thread that works. Here the caller returns once `work` returns
   (every unit finished) and no helper is inside `work`; a helper that starts after that leaves without touching
   ctx. The block is freed by whoever leaves it last. Without the thread library, the caller runs alone. */
typedef void (*la_team_fn)(void *ctx, int me);

typedef struct {
    _Atomic int closed; /* the caller is done: a helper starting now must not enter work */
    _Atomic int inside; /* helpers inside work (or deciding whether to enter) */
    _Atomic int refs;   /* the caller and the helpers not yet gone */
    _Atomic int next;   /* the next helper's index */
    la_team_fn work;
    void *ctx;
} la_team_t;

static inline void la_team_leave(la_team_t *t) {
    if (atomic_fetch_sub(&t->refs, 1) == 1) free(t);
}

#if LA_TEAM
static void *la_team_helper(void *p) {
    la_team_t *t = p;
    atomic_fetch_add(&t->inside, 1); /* before reading closed: the caller waits for inside == 0 after closing */
    if (!atomic_load(&t->closed)) t->work(t->ctx, atomic_fetch_add(&t->next, 1));
    atomic_fetch_sub(&t->inside, 1);
    la_team_leave(t);
    return NULL;
}
#endif

static void la_team_run(int nthreads, la_team_fn work, void *ctx) {
    la_team_t *t = LA_TEAM && nthreads > 1 ? malloc(sizeof(*t)) : NULL;
    if (!t) {
        work(ctx, 0);
        return;
    }
    atomic_init(&t->closed, 0), atomic_init(&t->inside, 0), atomic_init(&t->refs, 1), atomic_init(&t->next, 1);
    t->work = work, t->ctx = ctx;
#if LA_TEAM
    pthread_attr_t attr;
    const int attr_ok =
        pthread_attr_init(&attr) == 0 && pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED) == 0;
    for (int i = 1; attr_ok && i < nthreads; i++) {
        pthread_t th;
        atomic_fetch_add(&t->refs, 1);
        if (pthread_create(&th, &attr, la_team_helper, t) != 0) atomic_fetch_sub(&t->refs, 1); /* fewer helpers */
    }
    if (attr_ok) pthread_attr_destroy(&attr);
#endif
    work(ctx, 0);
    atomic_store(&t->closed, 1);
    while (atomic_load(&t->inside) > 0) la_wait(); /* a helper inside work: it finds nothing left and leaves */
    la_team_leave(t);
}

#endif
