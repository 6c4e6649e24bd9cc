#include "pk_pool.h"

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/syscall.h>
#endif

#if defined(__x86_64__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ volatile("yield")
#else
#define cpu_relax() ((void)0)
#endif

#define SPIN_ROUNDS (1 << 15)   /* ~0.1-0.5 ms of polling before a worker sleeps */

typedef struct {
    pk_pool *pool;
    int ith;
    int stat_fd;                  /* this thread's /proc schedstat, -1 if none */
    pthread_t tid;
} worker;

/* A job's shares are claimed, not assigned: `claim` packs the job's generation (high 32 bits)
 * and the next unclaimed share (low 32), and every thread, the caller included, takes shares
 * until none is left. On a busy machine a worker that the OS has not scheduled yet then costs
 * nothing: the caller (or a faster worker) runs its share instead of waiting a time slice for
 * it. fn(arg, ith, nth) still runs once for each ith, so the jobs' results do not depend on who
 * ran which share. */
struct pk_pool {
    int n;
    worker *workers;
    pthread_mutex_t run_lock;     /* serialises pk_pool_run callers */
    pthread_mutex_t lock;
    pthread_cond_t wake;          /* a new job, for the active workers */
    pthread_cond_t park;          /* a change of `active`, for the others */
    int generation;               /* bumped for each job (atomic) */
    uint64_t claim;               /* generation << 32 | next share to claim (atomic) */
    int done;                     /* shares finished (atomic) */
    int stop;
    int active;                   /* threads that take shares, the caller included (atomic) */
    pk_task_fn fn;
    void *arg;
    /* the contention watch (pk_pool_policy), under run_lock */
    int watch;                    /* 0: PYKLEI_POOL_ADAPT=0, or no schedstat to read */
    int log;                      /* PYKLEI_LOG=pool: a stderr line at each change */
    pk_pool_policy policy;
    uint64_t on_cpu0, waited0;    /* the workers' schedstat at the window's start */
};

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* The workers' summed time on a CPU and time runnable but waiting for one (ns). */
static void read_schedstat(const pk_pool *pool, uint64_t *on_cpu, uint64_t *waited) {
    *on_cpu = *waited = 0;
    for (int i = 1; i < pool->n; i++) {
        char buf[96];
        const int fd = pool->workers[i].stat_fd;
        const ssize_t got = fd >= 0 ? pread(fd, buf, sizeof buf - 1, 0) : -1;
        if (got <= 0) continue;
        buf[got] = 0;
        unsigned long long c = 0, w = 0;
        if (sscanf(buf, "%llu %llu", &c, &w) == 2) { *on_cpu += c; *waited += w; }
    }
}

/* Contention. With another process busy on a core, a pool has more runnable threads than the
 * cores it gets: the OS preempts a worker in the middle of its share for a scheduler slice
 * (milliseconds) and the job waits for it, at each of the hundreds of jobs of a decoded token.
 * Measured on 2 cores with one busy loop beside: 2 threads decoded SmolLM2 at 135 tok/s, 1
 * thread at 232. So the pool watches how long its workers wait for a CPU while runnable (Linux
 * schedstat: run_delay against time on a CPU) and, when that is more than CONTENDED of their
 * runnable time, gives jobs fewer threads: as many as the workers' share of CPU time says the
 * pool really gets, down to the caller alone. After a hold it tries all of them again; the hold
 * doubles while the machine stays busy. fn(arg, ith, nth) still runs once for each ith of the
 * same nth, so results do not change with the number of threads that ran them. */
#define WINDOW_NS     (100 * 1000000LL)  /* a verdict at most this often */
#define MIN_SAMPLE_NS (40 * 1000000LL)   /* of the workers' runnable time, for a verdict */
/* A trial of all threads on a busy machine runs at the busy speed: it is kept short. */
#define TRIAL_NS      (50 * 1000000LL)
#define MIN_TRIAL_NS  (20 * 1000000LL)
#define HOLD_MIN_NS   (250 * 1000000LL)
#define HOLD_MAX_NS   (4000 * 1000000LL)
/* On the shared 2-core VM two threads spinning alone waited up to 10% of a 100 ms window (up
 * to 21% of a 50 ms one); with one busy loop beside, a pool of 2's worker waited 42-57%. */
#define CONTENDED     0.25

void pk_pool_policy_init(pk_pool_policy *p, int n, long long now) {
    p->n = p->active = p->fit = n;
    p->due = now + WINDOW_NS;
    p->hold = HOLD_MIN_NS;
    p->waited = 0.0;
}

int pk_pool_policy_verdict(pk_pool_policy *p, long long now, unsigned long long on_cpu,
                           unsigned long long waited) {
    if (p->active == 1) {              /* the hold on the caller alone ends: all on trial */
        p->active = p->n;
        p->due = now + TRIAL_NS;
        return 1;
    }
    const int trial = p->active == p->n && p->fit < p->n;
    if (on_cpu + waited < (uint64_t)(trial ? MIN_TRIAL_NS : MIN_SAMPLE_NS)) {
        p->due = now + (trial ? TRIAL_NS : WINDOW_NS);   /* too little seen: the window goes on */
        return 0;
    }
    p->waited = (double)waited / (double)(on_cpu + waited);
    if (p->waited > CONTENDED) {
        /* the active threads got about active * (1 - waited) CPUs' worth of time */
        int fit = (int)(p->active * (1.0 - p->waited) + 0.5);
        if (fit >= p->active) fit = p->active - 1;
        p->fit = p->active = fit < 1 ? 1 : fit;
        p->due = now + p->hold;
        p->hold = p->hold * 2 < HOLD_MAX_NS ? p->hold * 2 : HOLD_MAX_NS;
    } else if (p->active == p->n) {    /* all threads run freely (a trial passed, or as ever) */
        p->fit = p->n;
        p->hold = HOLD_MIN_NS;
        p->due = now + WINDOW_NS;
    } else {                           /* the fewer ran freely through their hold: all on trial */
        p->active = p->n;
        p->due = now + TRIAL_NS;
    }
    return 1;
}

/* Called before each job: a verdict when one is due; the workers follow `active`. */
static void watch_contention(pk_pool *pool) {
    const int64_t now = now_ns();
    if (now < pool->policy.due) return;
    uint64_t on_cpu, waited;
    read_schedstat(pool, &on_cpu, &waited);
    if (on_cpu < pool->on_cpu0 || waited < pool->waited0) {   /* a read failed: start afresh */
        pool->on_cpu0 = on_cpu;
        pool->waited0 = waited;
        pool->policy.due = now + WINDOW_NS;
        return;
    }
    const int before = pool->policy.active;
    if (!pk_pool_policy_verdict(&pool->policy, now, on_cpu - pool->on_cpu0, waited - pool->waited0)) return;
    pool->on_cpu0 = on_cpu;
    pool->waited0 = waited;
    const int active = pool->policy.active;
    if (active == before) return;
    if (pool->log) {
        if (active < before)
            fprintf(stderr, "pyklei: pool: the workers waited %.0f%% of their runnable time for a CPU: "
                    "%d of %d threads take shares for %.0f ms\n", 100.0 * pool->policy.waited, active,
                    pool->n, (pool->policy.due - now) / 1e6);
        else
            fprintf(stderr, "pyklei: pool: trying all %d threads again\n", pool->n);
    }
    pthread_mutex_lock(&pool->lock);
    __atomic_store_n(&pool->active, active, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&pool->park);
    pthread_mutex_unlock(&pool->lock);
}

/* Runs shares of job `gen` until none is left unclaimed (or another job is current). */
static void run_shares(pk_pool *pool, uint32_t gen) {
    uint64_t c = __atomic_load_n(&pool->claim, __ATOMIC_ACQUIRE);
    for (;;) {
        if ((uint32_t)(c >> 32) != gen || (int)(uint32_t)c >= pool->n) return;
        /* fn and arg belong to job gen while one of its shares is unclaimed: the caller
         * waits for all of them before it writes the next job's */
        const pk_task_fn fn = pool->fn;
        void *const arg = pool->arg;
        if (!__atomic_compare_exchange_n(&pool->claim, &c, c + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue;   /* c now holds the current value */
        fn(arg, (int)(uint32_t)c, pool->n);
        __atomic_fetch_add(&pool->done, 1, __ATOMIC_RELEASE);
        c = __atomic_load_n(&pool->claim, __ATOMIC_ACQUIRE);
    }
}

static void *worker_main(void *p) {
    worker *w = p;
    pk_pool *pool = w->pool;
    int seen = 0;
    for (;;) {
        if (w->ith >= __atomic_load_n(&pool->active, __ATOMIC_ACQUIRE)) {
            /* not needed: off the CPU until the pool wants this thread again */
            pthread_mutex_lock(&pool->lock);
            while (w->ith >= __atomic_load_n(&pool->active, __ATOMIC_ACQUIRE) && !pool->stop)
                pthread_cond_wait(&pool->park, &pool->lock);
            pthread_mutex_unlock(&pool->lock);
            seen = __atomic_load_n(&pool->generation, __ATOMIC_ACQUIRE);
            if (__atomic_load_n(&pool->stop, __ATOMIC_ACQUIRE)) break;
        }
        int g = __atomic_load_n(&pool->generation, __ATOMIC_ACQUIRE);
        for (int spin = 0; g == seen && spin < SPIN_ROUNDS; spin++) {
            cpu_relax();
            g = __atomic_load_n(&pool->generation, __ATOMIC_ACQUIRE);
        }
        if (g == seen) {
            pthread_mutex_lock(&pool->lock);
            while ((g = __atomic_load_n(&pool->generation, __ATOMIC_ACQUIRE)) == seen && !pool->stop
                   && w->ith < __atomic_load_n(&pool->active, __ATOMIC_ACQUIRE))
                pthread_cond_wait(&pool->wake, &pool->lock);
            pthread_mutex_unlock(&pool->lock);
        }
        if (__atomic_load_n(&pool->stop, __ATOMIC_ACQUIRE)) break;
        if (g == seen) continue;   /* no new job: woken to park (`active` fell) */
        seen = g;
        run_shares(pool, (uint32_t)g);
    }
    return NULL;
}

/* The calling thread's schedstat, opened by the thread itself (Linux; -1 elsewhere). */
static int open_own_schedstat(void) {
#if defined(__linux__)
    char path[64];
    snprintf(path, sizeof path, "/proc/self/task/%ld/schedstat", (long)syscall(SYS_gettid));
    return open(path, O_RDONLY | O_CLOEXEC);
#else
    return -1;
#endif
}

static void *worker_start(void *p) {
    worker *w = p;
    __atomic_store_n(&w->stat_fd, open_own_schedstat(), __ATOMIC_RELEASE);
    return worker_main(p);
}

pk_pool *pk_pool_create(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    pk_pool *pool = calloc(1, sizeof *pool);
    if (!pool) return NULL;
    pool->n = n_threads;
    pool->active = n_threads;
    pool->claim = (uint64_t)n_threads;   /* generation 0: no job, every share taken */
    pool->workers = calloc((size_t)n_threads, sizeof(worker));
    if (!pool->workers) { free(pool); return NULL; }
    pthread_mutex_init(&pool->run_lock, NULL);
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pthread_cond_init(&pool->park, NULL);
    for (int i = 0; i < n_threads; i++) pool->workers[i].stat_fd = -2;   /* -2: not opened yet */
    for (int i = 1; i < n_threads; i++) {
        pool->workers[i].pool = pool;
        pool->workers[i].ith = i;
        if (pthread_create(&pool->workers[i].tid, NULL, worker_start, &pool->workers[i]) != 0) {
            pool->n = i;              /* keep the threads that did start, then tear down */
            pk_pool_destroy(pool);
            return NULL;
        }
    }
    const char *adapt = getenv("PYKLEI_POOL_ADAPT");
    const char *lv = getenv("PYKLEI_LOG");
    pool->log = lv && (strstr(lv, "pool") || !strcmp(lv, "1"));
    pool->watch = n_threads > 1 && !(adapt && !strcmp(adapt, "0"));
    for (int i = 1; i < n_threads; i++) {
        int fd;
        while ((fd = __atomic_load_n(&pool->workers[i].stat_fd, __ATOMIC_ACQUIRE)) == -2) sched_yield();
        if (fd < 0) pool->watch = 0;
    }
    pk_pool_policy_init(&pool->policy, n_threads, now_ns());
    if (pool->watch) read_schedstat(pool, &pool->on_cpu0, &pool->waited0);
    return pool;
}

int pk_pool_size(const pk_pool *pool) { return pool->n; }

int pk_pool_active(const pk_pool *pool) { return __atomic_load_n(&pool->active, __ATOMIC_ACQUIRE); }

void pk_pool_run(pk_pool *pool, pk_task_fn fn, void *arg) {
    if (pool->n == 1) { fn(arg, 0, 1); return; }
    pthread_mutex_lock(&pool->run_lock);
    if (pool->watch) watch_contention(pool);
    if (pool->active == 1) {          /* the caller alone: no hand-off at all */
        for (int i = 0; i < pool->n; i++) fn(arg, i, pool->n);
        pthread_mutex_unlock(&pool->run_lock);
        return;
    }
    pool->fn = fn;
    pool->arg = arg;
    __atomic_store_n(&pool->done, 0, __ATOMIC_RELAXED);
    pthread_mutex_lock(&pool->lock);
    /* the shares first, then the generation that wakes the workers to them */
    const uint32_t gen = (uint32_t)__atomic_load_n(&pool->generation, __ATOMIC_RELAXED) + 1;
    __atomic_store_n(&pool->claim, (uint64_t)gen << 32, __ATOMIC_RELEASE);   /* publishes fn, arg */
    __atomic_store_n(&pool->generation, (int)gen, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->lock);
    run_shares(pool, gen);
    /* Every share is claimed; wait for the ones still running: poll, then yield the core,
     * which matters when the machine is oversubscribed and a worker waits for this very core
     * to finish its share. */
    for (int spin = 0; __atomic_load_n(&pool->done, __ATOMIC_ACQUIRE) < pool->n; spin++) {
        if (spin < 4096) cpu_relax();
        else sched_yield();
    }
    pthread_mutex_unlock(&pool->run_lock);
}

void pk_pool_destroy(pk_pool *pool) {
    if (!pool) return;
    pthread_mutex_lock(&pool->lock);
    __atomic_store_n(&pool->stop, 1, __ATOMIC_RELEASE);
    __atomic_fetch_add(&pool->generation, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&pool->wake);
    pthread_cond_broadcast(&pool->park);
    pthread_mutex_unlock(&pool->lock);
    for (int i = 1; i < pool->n; i++) {
        pthread_join(pool->workers[i].tid, NULL);
        if (pool->workers[i].stat_fd >= 0) close(pool->workers[i].stat_fd);
    }
    pthread_cond_destroy(&pool->park);
    pthread_cond_destroy(&pool->wake);
    pthread_mutex_destroy(&pool->lock);
    pthread_mutex_destroy(&pool->run_lock);
    free(pool->workers);
    free(pool);
}
