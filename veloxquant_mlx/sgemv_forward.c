/*
 * MLX's cblas_sgemm on Linux: the optimized BLAS behind it, one-row products as sgemv.
 *
 * MLX's CPU backend sends every float32 matmul to cblas_sgemm, including the
 * one-row products of single-stream decode: x (1 x K) times a weight matrix.
 * OpenBLAS's sgemm packs its operands for a blocked kernel, which for one row
 * reads the weights at about half the memory bandwidth that its sgemv reaches
 * (SmolLM2's 49,152 x 576 head on 2 cores: ~10 ms as sgemm, ~5 ms as sgemv).
 * Decode of one stream is bound by reading the weights, so this matters.
 *
 * This library defines cblas_sgemm and is loaded into the global scope before MLX
 * (veloxquant_mlx/cpu_backend.py), so MLX's calls land here. The BLAS behind it is
 * handed over by vq_blas_bind: its sgemm and sgemv by address, whatever their names
 * (scipy-openblas32 exports them as scipy_cblas_*, Debian's OpenBLAS as cblas_*).
 * Row-major calls with M == 1 go to that sgemv, every other call unchanged to that sgemm.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "forward.h"

enum { ROW_MAJOR = VQ_ROW_MAJOR, NO_TRANS = VQ_NO_TRANS, TRANS = VQ_TRANS };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);

static sgemm_fn blas_sgemm;
static sgemv_fn blas_sgemv;
static int routes = 1;
static long calls;

int vq_blas_bind(void *sgemm, void *sgemv, int with_routes) {
    if (!sgemm || !sgemv) return -1;
    blas_sgemm = (sgemm_fn)sgemm;
    blas_sgemv = (sgemv_fn)sgemv;
    routes = with_routes != 0;
    return 0;
}

/* The bound sgemm (NULL before vq_blas_bind): dladdr names the library behind us. */
void *vq_blas_bound(void) { return (void *)blas_sgemm; }

int vq_forward_routes(void) { return routes; }

/* Calls that reached this cblas_sgemm: shows that MLX's products come here. */
long vq_blas_calls(void) { return __atomic_load_n(&calls, __ATOMIC_RELAXED); }

/* Preloaded by hand ahead of a BLAS, nothing binds us: take the next definitions. */
static void bind_next(void) {
    sgemm_fn sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
    sgemv_fn sgemv = (sgemv_fn)dlsym(RTLD_NEXT, "cblas_sgemv");
    if (!sgemm || !sgemv) { /* nothing to forward to: a broken set-up, never a wrong answer */
        fprintf(stderr, "sgemv_forward: no BLAS bound (vq_blas_bind) and none after us\n");
        abort();
    }
    blas_sgemv = sgemv;
    blas_sgemm = sgemm;
}

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c,
                 int ldc) {
    __atomic_fetch_add(&calls, 1, __ATOMIC_RELAXED);
    if (!blas_sgemm) bind_next();
    if (!routes || order != ROW_MAJOR || m != 1 || n < 1 || k < 1) {
        blas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
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
        blas_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, inc_x, beta, c, 1);
    else /* B is n x k, used as B^T: C = x B^T, i.e. B x */
        blas_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, inc_x, beta, c, 1);
}
