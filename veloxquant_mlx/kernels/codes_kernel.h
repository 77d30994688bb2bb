/* Activations times 4- or 8-bit weight codes, int8 dot products (see codes_kernel.c). */
#ifndef VELOXQUANT_CODES_KERNEL_H
#define VELOXQUANT_CODES_KERNEL_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One weight matrix, rows x cols, in the kernel's layout (codes_kernel.c's header). */
typedef struct {
    int rows, cols, bits; /* bits: 4 or 8 */
    int group;            /* columns per scale and bias: 32, or 16 with 8 bits */
    const uint8_t *codes;    /* rows * cols * bits / 8 */
    const void *scales;      /* rows * cols / group: float16 when half, else float32 */
    const void *biases;      /* the same type; w = scale * unsigned code + bias */
    int half;
} vq_codes;

/* AUTO: int8 activations, AVX2 where the CPU has it; PORTABLE: int8 activations, plain C;
 * FLOAT32: float32 activations times the dequantized weights (codes_gemm.c with AVX2, else
 * the BLAS loaded before MLX; AUTO where neither is, see vq_codes_float32_available);
 * FLOAT32_BLAS: the same on the BLAS, what a CPU without AVX2 runs (PORTABLE where none). */
enum { VQ_PATH_AUTO = 0, VQ_PATH_PORTABLE = 1, VQ_PATH_FLOAT32 = 2, VQ_PATH_FLOAT32_BLAS = 3 };

/* 1 when VQ_PATH_FLOAT32 can run: AVX2, or a loaded cblas_sgemm. */
int vq_codes_float32_available(void);

/* 1 when VQ_PATH_FLOAT32_BLAS can run: a cblas_sgemm is loaded. */
int vq_codes_blas_available(void);

/* Which path VQ_PATH_AUTO takes on this CPU: "avx2" or "portable". */
const char *vq_codes_path(void);

/* 0 when w's shape is one the kernel serves, else a message saying what is wrong. */
const char *vq_codes_check(const vq_codes *w);

/* out (m x w->rows) = x (m x w->cols, row-major) times w transposed. precise: on the int8
 * paths each row's VQ_EXACT_TOP largest results are then recomputed in float32
 * (vq_codes_exact_top). 0, or -1 when out of memory. */
int vq_codes_matmul(const vq_codes *w, int m, const float *x, float *out, int path,
                    int precise);

/* How many of a row's largest results the precise pass recomputes. */
#define VQ_EXACT_TOP 64

/* Rows [n0, n1) of w as float32 ((n1 - n0) x w->cols into dst): scale * code + bias. */
void vq_codes_dequantize(const vq_codes *w, int n0, int n1, float *dst);

/* After an int8 product out = x w^T: each row's VQ_EXACT_TOP largest results recomputed
 * from float32 x and the dequantized weight rows (exact_top.c). 0, or -1 out of memory. */
int vq_codes_exact_top(const vq_codes *w, int m, const float *x, float *out);

/* fn(ctx, i0, i1) over the items [0, n), in chunks taken by the product threads (the
 * caller among them), as a product's weight rows are; on the caller alone when ``work``
 * (about the multiply-adds) is small, or another product holds the threads. */
void vq_parallel_for(int n, long work, void (*fn)(void *ctx, int i0, int i1), void *ctx);

#ifdef __cplusplus
}
#endif

#endif
