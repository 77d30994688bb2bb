/*
 * Causal prompt attention over a paged batch's two KV parts (float32, x86-64 AVX2).
 *
 * On MLX's CPU backend the softmax of a long prompt's attention costs several times its
 * two matrix products: MLX runs elementwise ops on one core, one op after another over
 * the whole score block (mask, max, subtract, exp, sum, divide). A 512-token chunk over
 * 2,048 stored tokens spent ~230 ms a layer on SmolLM2 where the products alone take
 * ~80 ms. Here the products stay on BLAS (the cblas_sgemm this library forwards to) and
 * the softmax is one pass a score row, with a vectorised exp, over a tile of queries
 * small enough to stay in the caches.
 *
 * Layout (row-major, contiguous), per batch row b of B:
 *   q, out     (B, Hq,  L,  D)   the call's queries, and what attention returns
 *   k1, v1     (B, Hkv, S1, D)   the stored part (S1 may be 0: no stored part)
 *   m1         (B, S1) bytes     1 where a stored key is visible (NULL: all are)
 *   k2, v2     (B, Hkv, L,  D)   the call's own keys and values
 *   m2         (B, L, L) bytes   1 where own key c' is visible to query c
 * Query c never sees own key c' > c (a causal prompt), so a tile of queries [i0, i1)
 * multiplies only the first i1 own keys. Hq is a multiple of Hkv (grouped queries).
 */
#define _GNU_SOURCE
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "forward.h"
#include "kernels/vq_exp.h"

/* The library's own entry point: products with M > 1 go on to OpenBLAS. */
extern void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                        const float *a, int lda, const float *b, int ldb, float beta, float *c,
                        int ldc);

/* Scores one tile holds at most: ~4 MiB, inside the shared L3 and large enough that
 * BLAS runs each product on every core. */
#define TILE_SCORES (1 << 20)

#if defined(__x86_64__)

/* Hidden scores become -inf; the rest keep their value. mask == NULL: all visible. */
__attribute__((target("avx2,fma")))
static void hide(float *s, const uint8_t *mask, int n) {
    if (!mask) return;
    for (int j = 0; j < n; j++)
        if (!mask[j]) s[j] = -INFINITY;
}

/* One score row in place: exp(s - max) (0 where hidden); returns 1 / their sum
 * (0 when nothing is visible, so that row's output is 0, not NaN). */
__attribute__((target("avx2,fma")))
static float softmax_row(float *s, int n) {
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 8 <= n; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + j));
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    float m = -INFINITY;
    for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    for (; j < n; j++) m = s[j] > m ? s[j] : m;
    if (m == -INFINITY) {
        memset(s, 0, (size_t)n * sizeof(float));
        return 0.0f;
    }
    __m256 shift = _mm256_set1_ps(m), vsum = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) {
        __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift));
        _mm256_storeu_ps(s + j, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    _mm256_storeu_ps(lanes, vsum);
    float sum = 0.0f;
    for (int i = 0; i < 8; i++) sum += lanes[i];
    for (; j < n; j++) {
        s[j] = s[j] == -INFINITY ? 0.0f : expf(s[j] - m);
        sum += s[j];
    }
    return 1.0f / sum;
}

int vq_attention_supported(void) {
    __builtin_cpu_init();
    return vq_forward_routes() && __builtin_cpu_supports("avx2") &&
           __builtin_cpu_supports("fma");
}

/* One (batch row, KV head, query tile): rows = rep heads x queries [i0, i1). */
static void tile(const float *q, const float *k1, const float *v1, const uint8_t *m1,
                 const float *k2, const float *v2, const uint8_t *m2, int L, int S1, int D,
                 int rep, int i0, int i1, float scale, float *out, float *qbuf, float *scores,
                 float *obuf, float *inv) {
    int nq = i1 - i0, rows = rep * nq, keys = S1 + i1;
    for (int h = 0; h < rep; h++) /* the tile's queries, scaled, as one (rows, D) block */
        for (int i = 0; i < nq; i++) {
            const float *src = q + ((size_t)h * L + i0 + i) * D;
            float *dst = qbuf + ((size_t)h * nq + i) * D;
            for (int d = 0; d < D; d++) dst[d] = src[d] * scale;
        }
    if (S1)
        cblas_sgemm(VQ_ROW_MAJOR, VQ_NO_TRANS, VQ_TRANS, rows, S1, D, 1.0f, qbuf, D, k1, D,
                    0.0f, scores, keys);
    cblas_sgemm(VQ_ROW_MAJOR, VQ_NO_TRANS, VQ_TRANS, rows, i1, D, 1.0f, qbuf, D, k2, D, 0.0f,
                scores + S1, keys);
    for (int h = 0; h < rep; h++)
        for (int i = 0; i < nq; i++) {
            float *s = scores + ((size_t)h * nq + i) * keys;
            hide(s, m1, S1);
            hide(s + S1, m2 + (size_t)(i0 + i) * L, i1);
            inv[h * nq + i] = softmax_row(s, keys);
        }
    if (S1)
        cblas_sgemm(VQ_ROW_MAJOR, VQ_NO_TRANS, VQ_NO_TRANS, rows, D, S1, 1.0f, scores, keys, v1,
                    D, 0.0f, obuf, D);
    cblas_sgemm(VQ_ROW_MAJOR, VQ_NO_TRANS, VQ_NO_TRANS, rows, D, i1, 1.0f, scores + S1, keys,
                v2, D, S1 ? 1.0f : 0.0f, obuf, D);
    for (int h = 0; h < rep; h++)
        for (int i = 0; i < nq; i++) {
            const float *src = obuf + ((size_t)h * nq + i) * D;
            float *dst = out + ((size_t)h * L + i0 + i) * D, w = inv[h * nq + i];
            for (int d = 0; d < D; d++) dst[d] = src[d] * w;
        }
}

/* 0 on success, -1 without AVX2 + FMA, -2 on a bad shape, -3 out of memory. */
int vq_attention(const float *q, const float *k1, const float *v1, const uint8_t *m1,
                 const float *k2, const float *v2, const uint8_t *m2, int B, int Hq, int Hkv,
                 int L, int S1, int D, float scale, float *out) {
    if (!vq_attention_supported()) return -1;
    if (B < 1 || Hkv < 1 || Hq % Hkv || L < 1 || S1 < 0 || D < 1) return -2;
    int rep = Hq / Hkv, keys = S1 + L;
    int step = TILE_SCORES / (rep * keys);
    step = step < 1 ? 1 : step > L ? L : step;
    size_t rows = (size_t)rep * step;
    float *qbuf = malloc(rows * D * sizeof(float)), *obuf = malloc(rows * D * sizeof(float));
    float *scores = malloc(rows * keys * sizeof(float)), *inv = malloc(rows * sizeof(float));
    int rc = qbuf && obuf && scores && inv ? 0 : -3;
    for (int b = 0; !rc && b < B; b++)
        for (int g = 0; g < Hkv; g++) {
            size_t kv = (size_t)b * Hkv + g;
            const float *qg = q + (kv * rep) * L * D;
            float *og = out + (kv * rep) * L * D;
            const float *k1g = S1 ? k1 + kv * S1 * D : NULL, *v1g = S1 ? v1 + kv * S1 * D : NULL;
            const uint8_t *m1b = m1 && S1 ? m1 + (size_t)b * S1 : NULL;
            for (int i0 = 0; i0 < L; i0 += step) {
                int i1 = i0 + step < L ? i0 + step : L;
                tile(qg, k1g, v1g, m1b, k2 + kv * L * D, v2 + kv * L * D,
                     m2 + (size_t)b * L * L, L, S1, D, rep, i0, i1, scale, og, qbuf, scores,
                     obuf, inv);
            }
        }
    free(qbuf);
    free(obuf);
    free(scores);
    free(inv);
    return rc;
}

#else /* not x86-64: the caller keeps MLX's attention */

int vq_attention_supported(void) { return 0; }

int vq_attention(const float *q, const float *k1, const float *v1, const uint8_t *m1,
                 const float *k2, const float *v2, const uint8_t *m2, int B, int Hq, int Hkv,
                 int L, int S1, int D, float scale, float *out) {
    return -1;
}

#endif
