/* A persistent thread pool: n-1 workers plus the calling thread, created once.
 * Workers spin briefly after each job (decode issues hundreds of small jobs per token, and
 * a futex wake-up costs more than the job) and then sleep on a condition variable. A job's
 * shares are claimed by whichever thread is running, so a worker that the OS has not
 * scheduled (a busy machine) does not hold the job up; and when the workers wait for a CPU
 * (another process holds a core), fewer of them take shares, down to the caller alone, until
 * a later trial finds the cores free (pk_pool.c; PYKLEI_POOL_ADAPT=0 turns that off,
 * PYKLEI_LOG=pool logs each change). */
#ifndef PK_POOL_H
#define PK_POOL_H

typedef struct pk_pool pk_pool;

/* fn(arg, ith, nth) runs once for each ith in [0, nth). */
typedef void (*pk_task_fn)(void *arg, int ith, int nth);

pk_pool *pk_pool_create(int n_threads);   /* NULL on failure */
void pk_pool_destroy(pk_pool *pool);
int pk_pool_size(const pk_pool *pool);
int pk_pool_active(const pk_pool *pool);  /* threads taking shares now, the caller included */

/* Runs fn(arg, ith, nth) once for each ith in [0, nth), nth = the pool's size, on the
 * threads that claim them (the caller included; a thread may run several ith, one after the
 * other, never two at once), and returns when all have finished. Calls from different
 * threads are serialised. */
void pk_pool_run(pk_pool *pool, pk_task_fn fn, void *arg);

/* Share ith of nth of n items: one contiguous range [*lo, *hi) whose bounds are multiples of
 * `align` (or n) where that leaves each thread at least 4 blocks, else of 1 (a few decode
 * rows stay spread over the threads). Rows handed out round-robin (t = ith, ith + nth, ...)
 * put neighbouring rows on different threads, which then write the same cache lines: the KV
 * cache holds 16 positions' K values (and a bf16 cache two positions' V values) in one line,
 * and SmolLM2's RoPE and cache store took 1.6x the time on 2 threads that it took on one. */
static inline void pk_pool_share(int n, int align, int ith, int nth, int *lo, int *hi) {
    if (n < 4 * align * nth) align = 1;
    const long long blocks = (n + align - 1) / align;
    const int b0 = (int)(blocks * ith / nth), b1 = (int)(blocks * (ith + 1) / nth);
    *lo = b0 * align < n ? b0 * align : n;
    *hi = b1 * align < n ? b1 * align : n;
}

/* The contention policy (pk_pool.c), apart from the clock and /proc so that tests can drive it:
 * each verdict takes the workers' time on a CPU and time runnable but waiting for one, in ns,
 * since the current window began. */
typedef struct {
    int n;              /* the pool's threads */
    int active;         /* threads that take shares now, the caller included */
    int fit;            /* threads the last busy verdict found room for */
    long long due;      /* when the current window's verdict, or the hold, ends (ns) */
    long long hold;     /* the next hold's length (ns) */
    double waited;      /* the last verdict's waiting share of runnable time */
} pk_pool_policy;

void pk_pool_policy_init(pk_pool_policy *p, int n, long long now);
/* At `now` >= p->due: updates p. Returns 1 when a new window begins (take a new baseline of
 * the times), 0 when the current one goes on (too little was seen for a verdict). */
int pk_pool_policy_verdict(pk_pool_policy *p, long long now, unsigned long long on_cpu,
                           unsigned long long waited);

#endif
