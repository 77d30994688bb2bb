/* Prompt-sized products in float32, from the codes (the codes kernel's VQ_PATH_FLOAT32 on
 * AVX2): out = x w^T with float32 x and the dequantized weights, what a BLAS sgemm on a
 * float32 copy computes (to float rounding), without the copy.
 *
 * Why not the BLAS: it was handed a few dequantized weight rows at a time, and at 64 rows of
 * x OpenBLAS ran at ~100 GFLOP/s of the 228 these two cores peak at (~70 with 8192 columns,
 * where each call packs x again); this runs at ~130-150. Here x is packed once, transposed,
 * and each tile of MR weight rows x NR rows of x keeps its 12 sums in registers: per
 * column, two loads of x, MR broadcasts of dequantized weights and 2 x MR FMAs.
 *
 * Blocking, per thread's chunk of weight rows: NB weight rows and MC rows of x at a time;
 * for each block of KC columns the NB rows are dequantized (48 KiB, in L2), then each tile
 * of x (NR x KC, 16 KiB) stays in L1 while the NB rows pass over it, MR at a time. The sums
 * wait in a small transposed buffer (NB x MC) until the last column block, then go to out.
 *
 * Every result is one FMA chain over the columns in order, whatever tile or thread computes
 * it: a row of x gets the same results whichever rows share its product.
 */
#include "codes_rows.h"

#ifdef HAVE_AVX2_PATH
#include <immintrin.h>
#include <stdlib.h>

#define MR 6   /* weight rows a tile (broadcast) */
#define NR 16  /* rows of x a tile (two vectors); a last tile may be 8 */
#define KC 256 /* columns a block */
#define MC 128 /* rows of x a block */
#define NB 48  /* weight rows whose sums wait in the transposed buffer (a multiple of MR) */

typedef struct {
    const vq_codes *w;
    int m, mp;        /* rows of x, and rounded up to a multiple of 8 */
    const float *xt;  /* x packed: per column block, per tile of rows, [column][row] */
    float *out;       /* m x w->rows */
} gemm_job;

/* How many rows of x the tile at row r0 covers, in a block of x rows ending at end (both
 * multiples of 8): NR, or 8 for a last tile. */
static inline int tile_rows(int r0, int end) { return r0 + NR <= end ? NR : 8; }

/* dequantize_span for 4-bit codes with one float16 scale a group (GGUF's Q4_0, Q4_1): the
 * scales eight groups at a time, no branch inside. */
__attribute__((target("avx2,fma,f16c")))
static void dequantize_span_q4(const vq_codes *w, int n, int k0, int kc, float *dst) {
    const size_t at = ((size_t)n * w->cols + k0) / GROUP;
    const uint16_t *sh = (const uint16_t *)w->scales + at;
    const uint16_t *bh = (const uint16_t *)w->biases + at;
    const uint8_t *qn = w->codes + ((size_t)n * w->cols + k0) / 2;
    const __m128i nibble = _mm_set1_epi8(0x0F);
    float s[KC / GROUP] __attribute__((aligned(32)));
    float b[KC / GROUP] __attribute__((aligned(32)));
    int groups = kc / GROUP, g = 0;
    for (; g + 8 <= groups; g += 8) {
        _mm256_store_ps(s + g, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sh + g))));
        _mm256_store_ps(b + g, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(bh + g))));
    }
    for (; g < groups; g++) {
        s[g] = _cvtsh_ss(sh[g]);
        b[g] = _cvtsh_ss(bh[g]);
    }
    for (g = 0; g < groups; g++) {
        __m128i v = _mm_loadu_si128((const __m128i *)(qn + g * (GROUP / 2)));
        /* columns 0-15 in the low nibbles, 16-31 in the high ones; eight at a time */
        __m128i half[2] = {_mm_and_si128(v, nibble),
                           _mm_and_si128(_mm_srli_epi16(v, 4), nibble)};
        __m256 scale = _mm256_set1_ps(s[g]), bias = _mm256_set1_ps(b[g]);
        for (int e = 0; e < 4; e++) {
            __m128i eight = e & 1 ? _mm_srli_si128(half[e / 2], 8) : half[e / 2];
            __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight));
            _mm256_storeu_ps(dst + g * GROUP + 8 * e, _mm256_fmadd_ps(scale, q, bias));
        }
    }
}

/* Columns [k0, k0 + kc) of weight row n as float32 into dst: scale * code + bias, group by
 * group through codes_avx2.c's dequantization. */
__attribute__((target("avx2,fma,f16c")))
static void dequantize_span(const vq_codes *w, int n, int k0, int kc, float *dst) {
    const size_t at = (size_t)n * (w->cols / w->group) + (size_t)k0 / w->group;
    const uint8_t *qn = w->codes + ((size_t)n * w->cols + k0) * w->bits / 8;
    const float shift = w->bits == 8 ? 128.0f : 0.0f; /* 8-bit codes are stored minus 128 */
    float sn[KC / 16], bn[KC / 16]; /* the span's scales and biases (one a 16 at most) */
    for (int i = 0; i < kc / w->group; i++) {
        sn[i] = w->half ? _cvtsh_ss(((const uint16_t *)w->scales)[at + i])
                        : ((const float *)w->scales)[at + i];
        bn[i] = (w->half ? _cvtsh_ss(((const uint16_t *)w->biases)[at + i])
                         : ((const float *)w->biases)[at + i]) + shift * sn[i];
    }
    for (int g = 0; g < kc / GROUP; g++)
        vq_dequantize_group_avx2(qn, sn, bn, g, w->bits, w->group, dst + g * GROUP);
}

/* ct[i][0..nr) (+)= sum over k < kc of wd[i][k] * xt[k][0..nr), for i < mr: one tile. mr and
 * nr are constants where inlined, so the sums stay in registers. */
__attribute__((target("avx2,fma"), always_inline))
static inline void tile(const float *wd, const float *xt, int kc, float *ct, int ldct,
                        int first, int mr, int nr) {
    __m256 acc[MR][2];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr / 8; j++)
            acc[i][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(ct + i * ldct + 8 * j);
    for (int k = 0; k < kc; k++) {
        __m256 x0 = _mm256_loadu_ps(xt + k * nr), x1 = x0;
        if (nr == 16) x1 = _mm256_loadu_ps(xt + k * nr + 8);
        for (int i = 0; i < mr; i++) {
            __m256 b = _mm256_broadcast_ss(wd + i * KC + k);
            acc[i][0] = _mm256_fmadd_ps(b, x0, acc[i][0]);
            if (nr == 16) acc[i][1] = _mm256_fmadd_ps(b, x1, acc[i][1]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr / 8; j++) _mm256_storeu_ps(ct + i * ldct + 8 * j, acc[i][j]);
}

#define TILE_CASE(R)                                                             \
    case R:                                                                      \
        if (nr == 16) tile(wd, xt, kc, ct, ldct, first, R, 16);                  \
        else tile(wd, xt, kc, ct, ldct, first, R, 8);                            \
        break;

__attribute__((target("avx2,fma")))
static void run_tile(const float *wd, const float *xt, int kc, float *ct, int ldct, int first,
                     int mr, int nr) {
    switch (mr) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6)
    }
}

/* Weight rows [n0, n1) of the product: the unit vq_parallel_for hands a thread. */
__attribute__((target("avx2,fma,f16c")))
static void gemm_rows(void *ctx, int n0, int n1) {
    const gemm_job *job = ctx;
    const vq_codes *w = job->w;
    const int cols = w->cols, q4 = w->bits == 4 && w->group == GROUP && w->half;
    /* 72 KiB of stack: the dequantized rows and the sums (Linux threads get 8 MiB). */
    float wd[NB * KC] __attribute__((aligned(64))), ct[NB * MC] __attribute__((aligned(64)));
    for (int nb0 = n0; nb0 < n1; nb0 += NB) {
        int nb1 = nb0 + NB < n1 ? nb0 + NB : n1;
        for (int mb0 = 0; mb0 < job->mp; mb0 += MC) {
            int mb1 = mb0 + MC < job->mp ? mb0 + MC : job->mp;
            for (int k0 = 0; k0 < cols; k0 += KC) {
                int kc = k0 + KC < cols ? KC : cols - k0;
                const float *xblock = job->xt + (size_t)k0 * job->mp;
                for (int n = nb0; n < nb1; n++)
                    q4 ? dequantize_span_q4(w, n, k0, kc, wd + (n - nb0) * KC)
                       : dequantize_span(w, n, k0, kc, wd + (n - nb0) * KC);
                /* A tile of x (NR x KC, 16 KiB) stays in L1 while the block's weight rows
                 * (NB x KC, 48 KiB, in L2) pass over it. */
                for (int r0 = mb0, nr; r0 < mb1; r0 += nr) {
                    nr = tile_rows(r0, mb1);
                    for (int p0 = nb0; p0 < nb1; p0 += MR)
                        run_tile(wd + (p0 - nb0) * KC, xblock + (size_t)r0 * kc, kc,
                                 ct + (p0 - nb0) * MC + (r0 - mb0), MC, k0 == 0,
                                 p0 + MR < nb1 ? MR : nb1 - p0, nr);
                }
            }
            int rows_here = (job->m < mb1 ? job->m : mb1) - mb0;
            for (int n = nb0; n < nb1; n++)
                for (int r = 0; r < rows_here; r++)
                    job->out[(size_t)(mb0 + r) * w->rows + n] = ct[(n - nb0) * MC + r];
        }
    }
}

/* x (m x cols) into gemm_job's packed layout; the rows past m are zeros. */
static void pack_x(const float *x, int m, int mp, int cols, float *xt) {
    for (int k0 = 0; k0 < cols; k0 += KC) {
        int kc = k0 + KC < cols ? KC : cols - k0;
        float *block = xt + (size_t)k0 * mp;
        for (int r0 = 0, nr; r0 < mp; r0 += nr) {
            int end = r0 - r0 % MC + MC; /* the end of r0's block of x rows */
            nr = tile_rows(r0, end < mp ? end : mp);
            float *t = block + (size_t)r0 * kc;
            for (int r = 0; r < nr; r++) {
                const float *src = x + (size_t)(r0 + r) * cols + k0;
                if (r0 + r >= m) {
                    for (int k = 0; k < kc; k++) t[k * nr + r] = 0.0f;
                } else {
                    for (int k = 0; k < kc; k++) t[k * nr + r] = src[k];
                }
            }
        }
    }
}

int vq_gemm_float32_avx2(const vq_codes *w, int m, const float *x, float *out) {
    int mp = (m + 7) & ~7;
    /* Cache-line aligned: each tile's column of x is then one line, never split. */
    float *xt = aligned_alloc(64, (size_t)mp * w->cols * sizeof(float));
    if (!xt) return -1;
    pack_x(x, m, mp, w->cols, xt);
    gemm_job job = {w, m, mp, xt, out};
    vq_parallel_for(w->rows, (long)m * w->rows * w->cols, gemm_rows, &job);
    free(xt);
    return 0;
}

#endif
