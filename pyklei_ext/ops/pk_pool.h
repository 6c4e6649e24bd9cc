/* A persistent thread pool: n-1 workers plus the calling thread, created once.
 * Workers spin briefly after each job (decode issues hundreds of small jobs per token, and
 * a futex wake-up costs more than the job) and then sleep on a condition variable. A job's
 * shares are claimed by whichever thread is running, so a worker that the OS has not
 * scheduled (a busy machine) does not hold the job up (pk_pool.c). */
#ifndef PK_POOL_H
#define PK_POOL_H

typedef struct pk_pool pk_pool;

/* fn(arg, ith, nth) runs once for each ith in [0, nth). */
typedef void (*pk_task_fn)(void *arg, int ith, int nth);

pk_pool *pk_pool_create(int n_threads);   /* NULL on failure */
void pk_pool_destroy(pk_pool *pool);
int pk_pool_size(const pk_pool *pool);

/* Runs fn(arg, ith, nth) once for each ith in [0, nth), nth = the pool's size, on the
 * threads that claim them (the caller included; a thread may run several ith, one after the
 * other, never two at once), and returns when all have finished. Calls from different
 * threads are serialised. */
void pk_pool_run(pk_pool *pool, pk_task_fn fn, void *arg);

#endif
