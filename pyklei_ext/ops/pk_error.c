/* Per-thread error messages of the kernel layer and the layers above it (pk_set_error,
 * pk_last_error: ops/pk_matmul.h). A file of its own at the bottom of ops/, so that every
 * other file may report an error without calling up. */
#include "pk_ops_internal.h"

#include <stdarg.h>
#include <stdio.h>

static __thread char last_error[512];

const char *pk_last_error(void) { return last_error; }

int pk_set_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return -1;
}
