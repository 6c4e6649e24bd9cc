/* placeholder table: kernels land here (work in progress) */
#include "../ops/pk_matmul.h"
#if defined(__aarch64__)
const pk_kernel pk_kernels_arm_neon[] = {{0}};
const int pk_kernels_arm_neon_count = 0;
#endif
