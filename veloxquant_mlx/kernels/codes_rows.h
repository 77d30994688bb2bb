/* The codes kernel's internals, shared by its C files: codes_kernel.c (checks, threads,
 * the float32 path and vq_codes_matmul), codes_portable.c (plain C) and codes_avx2.c. */
#ifndef VELOXQUANT_CODES_ROWS_H
#define VELOXQUANT_CODES_ROWS_H

#include <stdint.h>

#include "codes_kernel.h"

#define GROUP 32
#define MAX_COLS 65536 /* a row's scales fit a stack buffer (MAX_COLS / 16) */

#if defined(__x86_64__)
#define HAVE_AVX2_PATH 1 /* compiled in; used where the CPU has AVX2, FMA and F16C */
#endif

/* x quantized to int8 in groups of 32, as the products read it. */
typedef struct {
    int m, groups;
    int8_t *xq;   /* m x cols, int8 */
    float *xd;    /* m x groups: each group's scale */
    float *xs;    /* m x groups: each group's sum as rounded, for the bias term */
    float *xs16;  /* m x 2 groups: the sums of each half, for 16-column biases */
    int8_t *xp;   /* 4-bit products on the AVX2 path: xq in pair order (vq_pair_order) */
    float *xd8;   /* with xp: per row and pair of groups, each group's scale four times */
} quantized_rows;

/* Code j of a weight row's group g, as the signed or unsigned integer it stands for. */
static inline int code_at(const uint8_t *row, int g, int j, int bits) {
    if (bits == 8) return (int8_t)row[g * GROUP + j];
    uint8_t byte = row[g * (GROUP / 2) + (j & 15)];
    return j < 16 ? byte & 0x0F : byte >> 4;
}

/* codes_portable.c: the same integer sums in plain C, on one thread. */
void vq_quantize_rows_portable(const float *a, int m, int cols, quantized_rows *x);
void vq_row_params_portable(const vq_codes *w, int n, float *s, float *b);
void vq_matmul_portable(const vq_codes *w, const quantized_rows *x, float *c);

#ifdef HAVE_AVX2_PATH
/* codes_avx2.c: weight rows [n0, n1) of a product against every row of x (the threads
 * share a product's rows out), x's quantization and pair order, and dequantization. */
void vq_quantize_rows_avx2(const float *a, int lda, int m, int cols, int8_t *xq, float *xd,
                           float *xs, float *xs16);
void vq_row_params_avx2(const vq_codes *w, int n, float *s, float *b);
void vq_block_rows_4bit(const vq_codes *w, int n0, int n1, const quantized_rows *x, float *c,
                        int ldc);
void vq_block_rows_8bit(const vq_codes *w, int n0, int n1, const quantized_rows *x, float *c,
                        int ldc);
void vq_block_rows_8bit_16(const vq_codes *w, int n0, int n1, const quantized_rows *x,
                           float *c, int ldc);
int vq_pair_order(quantized_rows *x);
void vq_dequantize_group_avx2(const uint8_t *qn, const float *sn, const float *bn, int g,
                              int bits, int group, float *dst);
/* codes_gemm.c: out = x w^T in float32 from the codes (VQ_PATH_FLOAT32). 0, or -1 when out
 * of memory. */
int vq_gemm_float32_avx2(const vq_codes *w, int m, const float *x, float *out);
#endif

#endif
