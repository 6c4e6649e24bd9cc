/* Memory for the weights' repacked copies (pk_weights.c), on 2 MB pages.
 *
 * A decode step streams every weight from memory once. A copy of 2 MB or more gets its own
 * 2 MB-aligned allocation with transparent huge pages asked for (madvise: where the system
 * leaves it to the program). A smaller one, on 4 KB pages, streamed slower: the hardware
 * prefetchers stop at each page's end and every page costs a TLB miss. One 0.5 MB weight read
 * from memory by a 1-thread GEMV ran at 0.73x the rate of a 15 MB one (15.5 against 21-25
 * GB/s); SmolLM2's layers are all such weights. So the small copies are laid end to end in
 * shared arenas of ARENA_BYTES on huge pages, where the same GEMV ran at 0.93x
 * (docs/KERNELS.md, "Small weights on huge pages").
 *
 * An arena is freed when the last copy in it is: loading and freeing a model returns its
 * memory. Models whose lifetimes overlap can share an arena, which then lives as long as the
 * longest of them. PYKLEI_WEIGHT_ARENA=0 gives every copy its own allocation, and sanitizer
 * builds always do, so that a read past a copy's end is caught rather than landing in the
 * next weight. */
#include "pk_ops_internal.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define HUGE_PAGE ((size_t)2 << 20)
#define ARENA_BYTES ((size_t)32 << 20)
#define COPY_ALIGN 64

typedef struct arena {
    struct arena *next;
    void *map;   /* the mapping, ARENA_BYTES + HUGE_PAGE bytes: base is its first 2 MB boundary */
    char *base;
    size_t used;
    int live;    /* copies in it not yet freed */
} arena;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static arena *arenas;   /* the newest first: the one new copies go into */

static void *huge_alloc(size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, bytes >= HUGE_PAGE ? HUGE_PAGE : COPY_ALIGN, bytes ? bytes : COPY_ALIGN)) return NULL;
#if defined(MADV_HUGEPAGE)
    if (bytes >= HUGE_PAGE) madvise(p, (bytes + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1), MADV_HUGEPAGE);
#endif
    return p;
}

static int arenas_on(void) {
#if defined(__SANITIZE_ADDRESS__)
    return 0;
#else
    static int on = -1;   /* read once; a benign race: every thread reads the same value */
    if (on < 0) {
        const char *e = getenv("PYKLEI_WEIGHT_ARENA");
        on = !(e && !strcmp(e, "0"));
    }
    return on;
#endif
}

void *pk_packed_alloc(size_t bytes) {
    if (bytes >= HUGE_PAGE || !arenas_on()) return huge_alloc(bytes);
    const size_t need = (bytes + COPY_ALIGN - 1) & ~(size_t)(COPY_ALIGN - 1);
    void *p = NULL;
    pthread_mutex_lock(&lock);
    arena *a = arenas;
    if (!a || a->used + need > ARENA_BYTES) {
        /* mapped, not malloc'd: freed, it goes back to the system whatever malloc's state */
        void *map = mmap(NULL, ARENA_BYTES + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        a = map == MAP_FAILED ? NULL : malloc(sizeof *a);
        if (!a) {
            if (map != MAP_FAILED) munmap(map, ARENA_BYTES + HUGE_PAGE);
        } else {
            char *base = (char *)(((uintptr_t)map + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
#if defined(MADV_HUGEPAGE)
            madvise(base, ARENA_BYTES, MADV_HUGEPAGE);
#endif
            *a = (arena){arenas, map, base, 0, 0};
            arenas = a;
        }
    }
    if (a) {
        p = a->base + a->used;
        a->used += need;
        a->live++;
    }
    pthread_mutex_unlock(&lock);
    return p;
}

void pk_packed_free(void *p) {
    if (!p) return;
    pthread_mutex_lock(&lock);
    for (arena **at = &arenas; *at; at = &(*at)->next) {
        arena *a = *at;
        if ((char *)p >= a->base && (char *)p < a->base + ARENA_BYTES) {
            if (--a->live == 0) {
                *at = a->next;
                munmap(a->map, ARENA_BYTES + HUGE_PAGE);
                free(a);
            }
            pthread_mutex_unlock(&lock);
            return;
        }
    }
    pthread_mutex_unlock(&lock);
    free(p);   /* a copy of its own */
}
