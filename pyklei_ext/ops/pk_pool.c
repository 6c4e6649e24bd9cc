#include "pk_pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>

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
    pthread_t tid;
} worker;

/* A job's shares are claimed, not assigned: `claim` packs the job's generation (high 32 bits)
 * and the next unclaimed share (low 32), and every thread, the caller included, takes shares
 * until none is left. On a busy machine a worker that the OS has not scheduled yet then costs
 * nothing: the caller (or a faster worker) runs its share instead of waiting a time slice for
 * it, at every one of the hundreds of jobs of a decoded token. fn(arg, ith, nth) still runs
 * once for each ith, so the jobs' results do not depend on who ran which share. */
struct pk_pool {
    int n;
    worker *workers;
    pthread_mutex_t run_lock;     /* serialises pk_pool_run callers */
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int generation;               /* bumped for each job (atomic) */
    uint64_t claim;               /* generation << 32 | next share to claim (atomic) */
    int done;                     /* shares finished (atomic) */
    int stop;
    pk_task_fn fn;
    void *arg;
};

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
        int g = __atomic_load_n(&pool->generation, __ATOMIC_ACQUIRE);
        for (int spin = 0; g == seen && spin < SPIN_ROUNDS; spin++) {
            cpu_relax();
            g = __atomic_load_n(&pool->generation, __ATOMIC_ACQUIRE);
        }
        if (g == seen) {
            pthread_mutex_lock(&pool->lock);
            while ((g = __atomic_load_n(&pool->generation, __ATOMIC_ACQUIRE)) == seen && !pool->stop)
                pthread_cond_wait(&pool->wake, &pool->lock);
            pthread_mutex_unlock(&pool->lock);
        }
        if (__atomic_load_n(&pool->stop, __ATOMIC_ACQUIRE)) break;
        seen = g;
        run_shares(pool, (uint32_t)g);
    }
    return NULL;
}

pk_pool *pk_pool_create(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    pk_pool *pool = calloc(1, sizeof *pool);
    if (!pool) return NULL;
    pool->n = n_threads;
    pool->workers = calloc((size_t)n_threads, sizeof(worker));
    if (!pool->workers) { free(pool); return NULL; }
    pthread_mutex_init(&pool->run_lock, NULL);
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->wake, NULL);
    for (int i = 1; i < n_threads; i++) {
        pool->workers[i].pool = pool;
        pool->workers[i].ith = i;
        if (pthread_create(&pool->workers[i].tid, NULL, worker_main, &pool->workers[i]) != 0) {
            pool->n = i;              /* keep the threads that did start, then tear down */
            pk_pool_destroy(pool);
            return NULL;
        }
    }
    return pool;
}

int pk_pool_size(const pk_pool *pool) { return pool->n; }

void pk_pool_run(pk_pool *pool, pk_task_fn fn, void *arg) {
    if (pool->n == 1) { fn(arg, 0, 1); return; }
    pthread_mutex_lock(&pool->run_lock);
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
    pthread_mutex_unlock(&pool->lock);
    for (int i = 1; i < pool->n; i++) pthread_join(pool->workers[i].tid, NULL);
    pthread_cond_destroy(&pool->wake);
    pthread_mutex_destroy(&pool->lock);
    pthread_mutex_destroy(&pool->run_lock);
    free(pool->workers);
    free(pool);
}
