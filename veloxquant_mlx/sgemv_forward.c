/*
 * Single-row float32 products as matrix-vector calls (Linux, preloaded before OpenBLAS).
 *
 * MLX's CPU backend sends every float32 matmul to cblas_sgemm, including the
 * one-row products of single-stream decode: x (1 x K) times a weight matrix.
 * OpenBLAS's sgemm packs its operands for a blocked kernel, which for one row
 * reads the weights at about half the memory bandwidth that its sgemv reaches
 * (SmolLM2's 49,152 x 576 head on 2 cores: ~10 ms as sgemm, ~5 ms as sgemv).
 * Decode of one stream is bound by reading the weights, so this matters.
 *
 * This library defines cblas_sgemm. Preloaded ahead of OpenBLAS
 * (LD_PRELOAD=<this>:<openblas>, see veloxquant_mlx/cpu_backend.py), it serves
 * row-major calls with M == 1 through OpenBLAS's cblas_sgemv and hands every
 * other call, unchanged, to the next cblas_sgemm in the search order.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "quant_matmul.h"

enum { ROW_MAJOR = VQ_ROW_MAJOR, NO_TRANS = VQ_NO_TRANS, TRANS = VQ_TRANS };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);

/* Resolved from the global scope at load time: OpenBLAS, preloaded right after us. */
extern void cblas_sgemv(int order, int trans, int m, int n, float alpha, const float *a,
                        int lda, const float *x, int incx, float beta, float *y, int incy);

static sgemm_fn next_sgemm(void) {
    static sgemm_fn next;
    if (!next) {
        next = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
        if (!next) { /* nothing to forward to: a broken preload, never a wrong answer */
            fprintf(stderr, "sgemv_forward: no cblas_sgemm after this library\n");
            abort();
        }
    }
    return next;
}

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c,
                 int ldc) {
    /* A weight with a registered quantized copy, times a few rows (quant_matmul.c). */
    if (vq_qmm_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc))
        return;
    if (order != ROW_MAJOR || m != 1 || n < 1 || k < 1) {
        next_sgemm()(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    /* C (1 x n) = alpha * x op(B) + beta * C, where x is A's one row: contiguous,
     * or, when A is given transposed (k x 1, row-major), one element per lda. */
    int inc_x = trans_a == NO_TRANS ? 1 : lda;
    if (beta == 0.0f) {
        /* BLAS leaves C unread when beta is 0, but some OpenBLAS releases scale y by
         * beta in sgemv, and 0 * NaN from uninitialised memory would stay NaN. */
        memset(c, 0, (size_t)n * sizeof(float));
    }
    if (trans_b == NO_TRANS) /* B is k x n: C = x B, i.e. B^T x */
        cblas_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, inc_x, beta, c, 1);
    else /* B is n x k, used as B^T: C = x B^T, i.e. B x */
        cblas_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, inc_x, beta, c, 1);
}
