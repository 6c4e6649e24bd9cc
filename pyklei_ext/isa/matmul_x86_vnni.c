/* placeholder table: kernels land here (work in progress) */
#include "../ops/pk_matmul.h"
#if defined(__x86_64__)
const pk_kernel pk_kernels_x86_vnni[] = {{0}};
const int pk_kernels_x86_vnni_count = 0;
#endif
