/* Shared between the .c files of the kernel layer (ops/); not for the ISA files (they see
 * contract/pk_kernel.h) nor for the layers above (ops/pk_matmul.h). */
#ifndef PK_OPS_INTERNAL_H
#define PK_OPS_INTERNAL_H

#include "../contract/pk_kv.h"
#include "pk_matmul.h"

#define fail pk_set_error

/* Plain C loops the compiler vectorizes (attention, SwiGLU, the rotation's element-wise
 * steps): on x86 with GCC, an AVX-512 and an AVX2 clone beside the baseline one, picked at
 * load time. Element-wise code gives the same bits in every clone; the attention keeps the
 * reference's order of operations. PK_NO_CLONES: one ISA's code (-march=...), for benchmarks. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(PK_NO_CLONES)
#define PK_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define PK_CLONES_ON 1
#else
#define PK_CLONES
#endif

/* ---- attention (pk_attention_reference.c) ------------------------------------------------ */

/* The (query heads per K/V head, head size) pairs with compiled kernels; larger groups that
 * are multiples of 4 run by fours, and any other shape takes the reference (correct, 50x
 * slower). The family's shapes: SmolLM2 135M / 360M (3, 64), 1.7B (1, 64); Llama 3.2 1B (4,
 * 64), 3B (3, 128); Llama 3.1 8B (4, 128); Llama 2 7B (1, 128); TinyLlama (8, 64). (3, 128)
 * was missing until Llama 3.2 3B's attention was found on the reference: tests/kernels/c/test_matmul.c
 * now asks pk_attend_is_fast for each of these.
 * The other families (issue 42): Gemma 3 270M and 1B (4, 256), 4B (2, 256); Qwen2.5 0.5B (7, 64:
 * 4 + 3), 1.5B (6, 128: 4 + 2); Qwen3 0.6B / 1.7B (2, 128); Phi-4-mini (3, 128); SmolLM3 3B and
 * Ministral 8B (4, 128). */
#define PK_ATTEND_SHAPES(X) X(1, 64) X(2, 64) X(3, 64) X(4, 64) X(1, 128) X(2, 128) X(3, 128) X(4, 128) \
    X(2, 256) X(4, 256)

/* The bf16 path (pk_attention_bf16.c) of pk_attend_rows' partials, kv->dot_bf16 set: rows <=
 * PK_ATTEND_ROWS rows of a partial ([0, n_pos[r]) of kv, n_pos[r] <= PK_ATTEND_CHUNK), out + r * ldo
 * and ml + r * 2 * group as pk_attend_part's; 1 when it ran, 0 where it has no kernel (no AVX-512
 * BF16, or not a PK_ATTEND_SHAPES shape): then the reference's bf16 arithmetic runs instead. */
int pk_attend_rows_bf16(int rows, const int *n_pos, int group, int hd, const float *q, size_t ldq,
                        const pk_kv_head *kv, float scale, float *scores, size_t ld_scores, float *out, size_t ldo,
                        float *ml);


/* The reference partial over positions [0, n) of kv for `group` query heads q [group][hd]:
 * out [group][hd] and ml [group][2] as pk_attend_part's (pk_nn.h); scores: [n] scratch. */
void pk_attend_part_reference(int group, int hd, int n, const float *q, const pk_kv_head *kv, float scale,
                              float *scores, float *out, float *ml);
/* The same over positions [j0, j0 + n) of kv, j0 any position (a sliding window's start). */
void pk_attend_span_reference(int group, int hd, int j0, int n, const float *q, const pk_kv_head *kv, float scale,
                              float *scores, float *out, float *ml);

/* ---- the dispatch table (pk_dispatch.c), built once by pk_dispatch_init ------------------ */
/* Written only by pk_dispatch.c, inside its pthread_once; read-only everywhere after. */

#define PK_MAX_KERNELS 64
extern const pk_kernel *pk_usable[PK_FMT_QUANT_COUNT][PK_MAX_KERNELS];   /* best first */
extern int pk_n_usable[PK_FMT_QUANT_COUNT];
extern int pk_log_kernels;   /* PYKLEI_LOG=kernels */

/* One stderr line per distinct (kernel, activations, m, n, k) when pk_log_kernels; d32: the
 * call ran the kernel's run_d32 (qsi8d32 activations). */
void pk_log_call(const pk_kernel *kern, int d32, int m, int n, int k);

/* Whether the PYKLEI_KERNEL list names ISA tag isa (as a tag or a kernel name's suffix). */
int pk_force_names_isa(const char *list, const char *isa);

/* ---- registry (pk_registry.c), a constant table ------------------------------------------ */

/* The row helpers (pk_isa_helpers), widest first; the last one is the generic versions
 * (isa "scalar", no features). Whether the CPU runs record i: its features bits. */
int pk_isa_helpers_count(void);
const pk_isa_helpers *pk_isa_helpers_at(int i);
/* The record of ISA tag isa if this CPU runs it, else NULL. */
const pk_isa_helpers *pk_isa_helpers_for(const char *isa);

/* The scalar kernel of fmt: the reference the self-check compares with, and the kernel a
 * format falls back to when every other one failed. */
const pk_kernel *pk_kernel_scalar_for(pk_format fmt);

/* ---- self-check (pk_selfcheck.c), run once while the table is built ----------------------- */

#define PK_SELFCHECK_MAX (PK_FMT_QUANT_COUNT * PK_MAX_KERNELS)

/* Checks kernels[0..n) (n <= PK_SELFCHECK_MAX, any formats) against the scalar kernel of their
 * format on small cases: failed[i] = 1, with a warning on stderr, for each that disagrees, else
 * 0. log: one stderr line listing those that passed. Writes no table. */
void pk_self_check(int n, const pk_kernel *const *kernels, int *failed, int log);

/* ---- test hook (tests/kernels/c/pk_testhook.c), test builds only ------------------------- */

/* checked[i] = the kernel record the self-check runs for kernels[i], where PYKLEI_TEST_BREAK_KERNEL
 * names one to corrupt. Defined only in test builds, which link tests/kernels/c/pk_testhook.c (the C
 * test programs; the extension built with PYKLEI_TEST_HOOKS=1): a weak reference, NULL in
 * the library itself, so that the product holds no test code and the dispatcher no #ifdef. */
void pk_test_hook_kernels_to_check(int n, const pk_kernel *const *kernels, const pk_kernel **checked)
    __attribute__((weak));

/* ---- weights (pk_rhs.c: the canonical weight; pk_weights.c: the repacked copies) ---------- */

/* pk_rhs_prepare without the dispatch table: checks the shape, fills rhs and computes the row
 * sums; no repacked copy (the self-check calls it while the table is being built). */
int pk_rhs_prepare_canonical(pk_rhs *rhs, pk_format fmt, int n, int k, int bl, const void *qs,
                             const void *scales);
/* The copy of rhs repacked for kern, or NULL (kern reads the canonical layout, or none made). */
const void *pk_rhs_packed_for(const pk_rhs *rhs, const pk_kernel *kern);
/* Memory for a repacked copy, 64-byte aligned, on 2 MB pages where the system allows
 * (pk_arena.c); freed by pk_packed_free (NULL: nothing), never by free(). */
void *pk_packed_alloc(size_t bytes);
void pk_packed_free(void *p);

#endif
