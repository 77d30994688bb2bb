/* Quantized (4- and 8-bit) weight copies served inside cblas_sgemm (see quant_matmul.c). */
#ifndef VELOXQUANT_QUANT_MATMUL_H
#define VELOXQUANT_QUANT_MATMUL_H

#include <stdint.h>

enum { VQ_ROW_MAJOR = 101, VQ_NO_TRANS = 111, VQ_TRANS = 112 }; /* CBLAS enum values */

/* Return codes of vq_qmm_register / vq_qmm_unregister (0 is success). */
enum {
    VQ_QMM_UNSUPPORTED_CPU = -1, /* no AVX2 + FMA */
    VQ_QMM_BAD_SHAPE = -2,       /* rows < 1, cols not a multiple of 32, bits not 4 or 8,
                                    group not 32 (or 16 with 8 bits) */
    VQ_QMM_NO_MEMORY = -3,
    VQ_QMM_TABLE_FULL = -4,
    VQ_QMM_NOT_FOUND = -5,
};

/* 0 when the forward only passes calls on (VELOXQUANT_NO_SGEMV_FORWARD, sgemv_forward.c):
 * its own paths, this one and the prompt kernels, then report themselves unsupported. */
int vq_forward_routes(void);

int vq_qmm_supported(void);
/* group: columns per scale and bias, 32 (or 16 for 8-bit codes). */
int vq_qmm_register(const float *weight, int rows, int cols, int bits, int group,
                    const uint8_t *codes, const float *scales, const float *biases);
int vq_qmm_unregister(const float *weight);
long vq_qmm_served(void);
void vq_qmm_set_max_rows(int rows);

/* Serve a cblas_sgemm call from a registered quantized copy: 1 when served, 0 to decline. */
int vq_qmm_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                const float *a, int lda, const float *b, int ldb, float beta, float *c,
                int ldc);

#endif
