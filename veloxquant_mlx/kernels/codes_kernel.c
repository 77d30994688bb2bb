/*
 * Activations times 4- or 8-bit weight codes, computed from the codes (MLX's CPU backend).
 *
 * A quantized model keeps its weights as codes: ~0.6 bytes a weight at 4 bits, ~1.1 at
 * 8, where a float32 copy reads 4. Each row of x is quantized to int8 in groups of 32 (one
 * float scale a group), as llama.cpp does, and every product is an integer dot product
 * (AVX2 vpmaddubsw), scaled per group. This serves any number of rows: one-row decode
 * steps, batched steps and whole prompts. x's int8 rounding is the only difference from
 * the product of x and the dequantized weights (~0.5% relative error on a random product).
 *
 * Code layout, per weight row and per group of 32 columns, with w = scale * q + bias:
 *   4-bit: 16 bytes, low nibbles columns 0..15, high nibbles 16..31, q in 0..15;
 *   8-bit: 32 signed bytes in column order, each q - 128 for q in 0..255 (maddubs needs
 *   one unsigned operand and the activations are signed); the 128 * scale this moves
 *   into the bias is added when a row's float16 scales and biases are read.
 * A matrix has one scale and bias per 32 columns, or (8-bit only) per 16: ggml's Q6_K,
 * Q3_K and Q2_K scale every 16 values. The activations keep one int8 scale per 32 either
 * way; a 16-column weight group only changes the scale of half of each integer sum.
 *
 * Where AVX2 and FMA are missing (or VQ_PATH_PORTABLE asks for it) a plain C loop computes
 * the same integer sums on one thread. VQ_PATH_FLOAT32 instead multiplies float32 x by the
 * dequantized weights (a few rows at a time, on the BLAS): exact, for prompts.
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "codes_kernel.h"

#define GROUP 32
#define MAX_COLS 65536           /* a row's scales fit a stack buffer (MAX_COLS / 16) */
#define MAX_THREADS 8
/* A helper spins this long for the next product, then sleeps. Short: the Python thread
 * that builds the next step needs the core (served c=1 on 2 cores: 17-18 tok/s at 20 us
 * against 13-16 at 200 us, the same requests). */
#define SPIN_NS 20000
/* One-row products read codes this many bytes ahead of use (a software prefetch): they
 * are bound by reading the codes, and it helped the 1B model's one-row products by ~5-15%
 * in alternating runs here (the hardware prefetchers alone left ~25% of the bandwidth). */
#define PREFETCH_AHEAD 1024
#define MIN_PARALLEL_MACS 65536  /* below this a product runs on the calling thread alone */
#define TILE_FLOATS (1 << 20)    /* float32 path: 4 MiB of dequantized weight rows at a time:
                                    * few BLAS calls, each packing x once, inside L3 */
enum { CBLAS_ROW_MAJOR = 101, CBLAS_NO_TRANS = 111, CBLAS_TRANS = 112 };

typedef struct {
    int m, groups;
    int8_t *xq;   /* m x cols, int8 */
    float *xd;    /* m x groups: each group's scale */
    float *xs;    /* m x groups: each group's sum as rounded, for the bias term */
    float *xs16;  /* m x 2 groups: the sums of each half, for 16-column biases */
    int8_t *xp;   /* set for 4-bit products on the AVX2 path: xq in pair order (pair_order) */
    float *xd8;   /* with xp: per row and pair of groups, each group's scale four times */
} quantized_rows;

const char *vq_codes_check(const vq_codes *w) {
    if (!w || w->rows < 1 || w->cols < GROUP) return "a weight needs at least 1 row and 32 columns";
    if (w->cols % GROUP) return "the weight's columns are not a multiple of 32";
    if (w->cols > MAX_COLS) return "a weight may have at most 65536 columns";
    if (w->bits != 4 && w->bits != 8) return "the codes are neither 4 nor 8 bits";
    if (w->group != GROUP && !(w->group == GROUP / 2 && w->bits == 8))
        return "a scale must cover 32 columns (or 16 with 8-bit codes)";
    return 0;
}

static int rows_buffer(quantized_rows *x, int m, int cols) {
    int groups = cols / GROUP;
    void *buffer = malloc((size_t)m * cols + 4 * (size_t)m * groups * sizeof(float));
    if (!buffer) return -1;
    x->m = m;
    x->groups = groups;
    x->xd = buffer;
    x->xs = x->xd + (size_t)m * groups;
    x->xs16 = x->xs + (size_t)m * groups;
    x->xq = (int8_t *)(x->xs16 + 2 * (size_t)m * groups);
    x->xp = NULL;
    x->xd8 = NULL;
    return 0;
}

/* ------------------------------------------------------------------ portable */

static void quantize_rows_portable(const float *a, int m, int cols, quantized_rows *x) {
    int groups = cols / GROUP;
    for (int r = 0; r < m; r++)
        for (int g = 0; g < groups; g++) {
            const float *v = a + (size_t)r * cols + g * GROUP;
            float amax = 0.0f;
            for (int j = 0; j < GROUP; j++) amax = fmaxf(amax, fabsf(v[j]));
            float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int8_t *q = x->xq + (size_t)r * cols + g * GROUP;
            int low = 0, high = 0;
            for (int j = 0; j < GROUP; j++) {
                q[j] = (int8_t)nearbyintf(v[j] * inv); /* round half to even, as cvtps */
                if (j < GROUP / 2) low += q[j];
                else high += q[j];
            }
            size_t at = (size_t)r * groups + g;
            x->xd[at] = d;
            x->xs[at] = d * (float)low + d * (float)high;
            x->xs16[2 * at] = d * (float)low;
            x->xs16[2 * at + 1] = d * (float)high;
        }
}

/* float16 -> float32 (scales and biases are stored as float16, as GGUF stores them). */
static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        float f = ldexpf((float)man, -24);
        return sign ? -f : f;
    }
    bits = exp == 31 ? sign | 0x7F800000u | (man << 13) : sign | ((exp + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Weight row n's scales and biases as floats, into s and b (MAX_COLS / 16 each). */
static void row_params_portable(const vq_codes *w, int n, float *s, float *b) {
    int wgroups = w->cols / w->group;
    float shift = w->bits == 8 ? 128.0f : 0.0f; /* s q + b = s (q - 128) + (b + 128 s) */
    size_t at = (size_t)n * wgroups;
    for (int g = 0; g < wgroups; g++) {
        if (w->half) {
            s[g] = half_to_float(((const uint16_t *)w->scales)[at + g]);
            b[g] = half_to_float(((const uint16_t *)w->biases)[at + g]);
        } else {
            s[g] = ((const float *)w->scales)[at + g];
            b[g] = ((const float *)w->biases)[at + g];
        }
        b[g] += shift * s[g];
    }
}

/* Code j of a weight row's group g, as the signed or unsigned integer it stands for. */
static inline int code_at(const uint8_t *row, int g, int j, int bits) {
    if (bits == 8) return (int8_t)row[g * GROUP + j];
    uint8_t byte = row[g * (GROUP / 2) + (j & 15)];
    return j < 16 ? byte & 0x0F : byte >> 4;
}

static void matmul_portable(const vq_codes *w, const quantized_rows *x, float *c) {
    int cols = w->cols, sub = w->group;
    float sn[MAX_COLS / 16], bn[MAX_COLS / 16];
    for (int n = 0; n < w->rows; n++) {
        const uint8_t *qn = w->codes + (size_t)n * cols * w->bits / 8;
        row_params_portable(w, n, sn, bn);
        for (int r = 0; r < x->m; r++) {
            const int8_t *xr = x->xq + (size_t)r * cols;
            float acc = 0.0f;
            for (int g = 0; g < x->groups; g++) {
                int halves[2] = {0, 0};
                for (int j = 0; j < GROUP; j++)
                    halves[j >= 16] += code_at(qn, g, j, w->bits) * xr[g * GROUP + j];
                float d = x->xd[(size_t)r * x->groups + g];
                if (sub == GROUP)
                    acc += sn[g] * d * (float)(halves[0] + halves[1]) +
                           bn[g] * x->xs[(size_t)r * x->groups + g];
                else
                    for (int h = 0; h < 2; h++)
                        acc += sn[2 * g + h] * d * (float)halves[h] +
                               bn[2 * g + h] * x->xs16[2 * ((size_t)r * x->groups + g) + h];
            }
            c[(size_t)r * w->rows + n] = acc;
        }
    }
}

/* ------------------------------------------------------------------ AVX2 */

#if defined(__x86_64__)
#include <immintrin.h>
#define HAVE_AVX2_PATH 1


__attribute__((target("avx2,fma"))) static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Each group of 32: scale = max|x| / 127, q = round(x / scale), and the sums of the
 * rounded values (scale * sum q, of the group and of each half) for the bias term. With
 * those, every product is the weights times the rounded x, whatever the codes' offset:
 * with exact sums instead, x's rounding error would come back multiplied by the codes
 * themselves, and codes far from 0 (a 5-bit code widened to a byte sits near -112 once
 * signed) would make it ~10x larger (SmolLM2 Q4_K_M decoded from its codes: perplexity 59.8
 * against 29.4 in float32). */
__attribute__((target("avx2,fma")))
static void quantize_rows(const float *a, int lda, int m, int cols, int8_t *xq, float *xd,
                          float *xs, float *xs16) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    int groups = cols / GROUP;
    for (int r = 0; r < m; r++) {
        for (int g = 0; g < groups; g++) {
            const float *x = a + (size_t)r * lda + g * GROUP;
            __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
            __m256 v2 = _mm256_loadu_ps(x + 16), v3 = _mm256_loadu_ps(x + 24);
            __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0),
                                                    _mm256_andnot_ps(sign, v1)),
                                      _mm256_max_ps(_mm256_andnot_ps(sign, v2),
                                                    _mm256_andnot_ps(sign, v3)));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            float amax = _mm_cvtss_f32(m4);
            float d = amax / 127.0f;
            __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inv));
            __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv));
            __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, inv));
            __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv));
            /* The packs work per 128-bit lane; the permute puts the 32 values back in order. */
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
            p = _mm256_permutevar8x32_epi32(p, order);
            _mm256_storeu_si256((__m256i *)(xq + (size_t)r * cols + g * GROUP), p);
            xd[(size_t)r * groups + g] = d;
            float low = d * hsum(_mm256_cvtepi32_ps(_mm256_add_epi32(i0, i1)));
            float high = d * hsum(_mm256_cvtepi32_ps(_mm256_add_epi32(i2, i3)));
            xs[(size_t)r * groups + g] = low + high;
            xs16[2 * ((size_t)r * groups + g)] = low;
            xs16[2 * ((size_t)r * groups + g) + 1] = high;
        }
    }
}

/* The 32 codes of group g of a weight row, ready for group_dot. */
__attribute__((target("avx2,fma"), always_inline))
static inline __m256i load_codes(const uint8_t *row, int g, int bits) {
    if (bits == 8) return _mm256_loadu_si256((const __m256i *)(row + g * GROUP));
    __m128i raw = _mm_loadu_si128((const __m128i *)(row + g * (GROUP / 2)));
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

/* Integer dot product of one 32-column group, as 8 int32 partial sums in floats. */
__attribute__((target("avx2,fma"), always_inline))
static inline __m256 group_dot(__m256i q, const int8_t *x, int bits) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i xv = _mm256_loadu_si256((const __m256i *)x), pairs;
    if (bits == 4) /* q 0..15 unsigned, x -127..127: a pair sum fits int16 (2*15*127) */
        pairs = _mm256_maddubs_epi16(q, xv);
    else /* signed q: |q| (-128 reads as 128 unsigned) times x with q's sign; 2*128*127 fits */
        pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(xv, q));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
}

__attribute__((target("avx2,fma")))
static float bias_term(const float *bias, const float *sums, int groups) {
    __m256 acc = _mm256_setzero_ps();
    int g = 0;
    for (; g + 8 <= groups; g += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(bias + g), _mm256_loadu_ps(sums + g), acc);
    float s = hsum(acc);
    for (; g < groups; g++) s += bias[g] * sums[g];
    return s;
}


/* Group g's weight scale as a vector for group_dot's 8 sums: sums 0-3 cover columns 0-15
 * and sums 4-7 columns 16-31, so a 16-column matrix puts each half's scale in its lane. */
__attribute__((target("avx2,fma"), always_inline))
static inline __m256 weight_scale(const float *sn, int g, int sub) {
    if (sub == GROUP) return _mm256_set1_ps(sn[g]);
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(sn[2 * g])),
                                _mm_set1_ps(sn[2 * g + 1]), 1);
}

/* One group of one row of x: acc + (its integer dot product) * weight scale * x's scale. */
__attribute__((target("avx2,fma"), always_inline))
static inline __m256 group_step(__m256i q, __m256 s, const int8_t *x, float d, __m256 acc,
                                int bits) {
    return _mm256_fmadd_ps(group_dot(q, x, bits), _mm256_mul_ps(s, _mm256_set1_ps(d)), acc);
}

/* row_params_portable, eight at a time (float16 through F16C). */
__attribute__((target("avx2,fma,f16c")))
static void row_params_avx2(const vq_codes *w, int n, float *s, float *b) {
    int wgroups = w->cols / w->group, g = 0;
    size_t at = (size_t)n * wgroups;
    const uint16_t *sh = (const uint16_t *)w->scales + at, *bh = (const uint16_t *)w->biases + at;
    const float *sf = (const float *)w->scales + at, *bf = (const float *)w->biases + at;
    float shift = w->bits == 8 ? 128.0f : 0.0f;
    __m256 shifts = _mm256_set1_ps(shift);
    for (; g + 8 <= wgroups; g += 8) {
        __m256 scale = w->half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sh + g)))
                               : _mm256_loadu_ps(sf + g);
        __m256 bias = w->half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(bh + g)))
                              : _mm256_loadu_ps(bf + g);
        _mm256_storeu_ps(s + g, scale);
        _mm256_storeu_ps(b + g, _mm256_fmadd_ps(shifts, scale, bias));
    }
    for (; g < wgroups; g++) {
        s[g] = w->half ? _cvtsh_ss(sh[g]) : sf[g];
        b[g] = (w->half ? _cvtsh_ss(bh[g]) : bf[g]) + shift * s[g];
    }
}

/* Weight rows [n0, n1) against every row of x: C[r][n] for all r. Inlined per bits and per
 * columns a weight scale covers (sub). */
__attribute__((target("avx2,fma"), always_inline))
static inline void block_rows(const vq_codes *w, int n0, int n1, const quantized_rows *x,
                              float *c, int ldc, int bits, int sub) {
    const int groups = x->groups, cols = w->cols, wgroups = cols / sub;
    const float *sums = sub == GROUP ? x->xs : x->xs16;
    float sn[MAX_COLS / 16], bn[MAX_COLS / 16];
    for (int n = n0; n < n1; n++) {
        const uint8_t *qn = w->codes + (size_t)n * cols * bits / 8;
        row_params_avx2(w, n, sn, bn);
        int r = 0;
        /* Every row of x is summed in the same order, two chains (even and odd groups) to
         * hide FMA latency, whether it runs in a block of four or alone: a row's result
         * does not depend on which other rows share the product. */
        for (; r + 4 <= x->m; r += 4) { /* four rows of x share each loaded group */
            __m256 even[4], odd[4];
            for (int i = 0; i < 4; i++) even[i] = odd[i] = _mm256_setzero_ps();
            int g = 0;
            for (; g + 2 <= groups; g += 2) {
                __m256i q0 = load_codes(qn, g, bits), q1 = load_codes(qn, g + 1, bits);
                __m256 s0 = weight_scale(sn, g, sub), s1 = weight_scale(sn, g + 1, sub);
                for (int i = 0; i < 4; i++) {
                    const int8_t *xr = x->xq + (size_t)(r + i) * cols;
                    const float *dr = x->xd + (size_t)(r + i) * groups;
                    even[i] = group_step(q0, s0, xr + g * GROUP, dr[g], even[i], bits);
                    odd[i] = group_step(q1, s1, xr + (g + 1) * GROUP, dr[g + 1], odd[i], bits);
                }
            }
            if (g < groups) {
                __m256i q0 = load_codes(qn, g, bits);
                __m256 s0 = weight_scale(sn, g, sub);
                for (int i = 0; i < 4; i++)
                    even[i] = group_step(q0, s0, x->xq + (size_t)(r + i) * cols + g * GROUP,
                                         x->xd[(size_t)(r + i) * groups + g], even[i], bits);
            }
            for (int i = 0; i < 4; i++)
                c[(size_t)(r + i) * ldc + n] =
                    hsum(_mm256_add_ps(even[i], odd[i])) +
                    bias_term(bn, sums + (size_t)(r + i) * wgroups, wgroups);
        }
        for (; r < x->m; r++) { /* the rest one at a time, in the same order */
            __m256 even = _mm256_setzero_ps(), odd = even;
            const int8_t *xr = x->xq + (size_t)r * cols;
            const float *dr = x->xd + (size_t)r * groups;
            int g = 0;
            for (; g + 2 <= groups; g += 2) {
                even = group_step(load_codes(qn, g, bits), weight_scale(sn, g, sub),
                                  xr + g * GROUP, dr[g], even, bits);
                odd = group_step(load_codes(qn, g + 1, bits), weight_scale(sn, g + 1, sub),
                                 xr + (g + 1) * GROUP, dr[g + 1], odd, bits);
            }
            if (g < groups)
                even = group_step(load_codes(qn, g, bits), weight_scale(sn, g, sub),
                                  xr + g * GROUP, dr[g], even, bits);
            c[(size_t)r * ldc + n] = hsum(_mm256_add_ps(even, odd)) +
                                     bias_term(bn, sums + (size_t)r * wgroups, wgroups);
        }
    }
}

/* One pair of 4-bit groups of one row of x: acc + each group's integer dot product times
 * its weight scale and x's. ``lo``/``hi``: the pair's codes, columns 0-15 and 16-31 of
 * each group (group g in the low 128 bits, g + 1 in the high); ``x``: the pair in pair
 * order. Both products of a column pair fit int16 (2 x 15 x 127 each), so their sum does. */
__attribute__((target("avx2,fma"), always_inline))
static inline __m256 pair_step(__m256i lo, __m256i hi, __m256 s8, const int8_t *x,
                               const float *d8, __m256 acc) {
    __m256i sums = _mm256_add_epi16(
        _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)x)),
        _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + GROUP))));
    __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums, _mm256_set1_epi16(1)));
    return _mm256_fmadd_ps(dot, _mm256_mul_ps(s8, _mm256_loadu_ps(d8)), acc);
}

/* The weight scales of pair p as pair_step takes them: group 2p's four times, then 2p + 1's. */
__attribute__((target("avx2,fma"), always_inline))
static inline __m256 pair_scales(const float *sn, int p) {
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(sn[2 * p])),
                                _mm_set1_ps(sn[2 * p + 1]), 1);
}

/* A lone last group (an odd group count) of one row of x, from xq in column order. */
__attribute__((target("avx2,fma"), always_inline))
static inline __m256 lone_group(const uint8_t *qn, int g, const float *sn,
                                const quantized_rows *x, int r, __m256 acc) {
    return group_step(load_codes(qn, g, 4), weight_scale(sn, g, GROUP),
                      x->xq + (size_t)r * x->groups * GROUP + g * GROUP,
                      x->xd[(size_t)r * x->groups + g], acc, 4);
}

/* 4-bit weight rows [n0, n1) against every row of x, two groups at a time: one 32-byte
 * load holds a pair's codes, and one mask and one shift split them into columns 0-15 and
 * 16-31 of both groups, which x's pair order (pair_order) matches. Half the instructions
 * of group by group (block_rows). Every row of x is summed in the same order, in a block
 * of four or alone. */
__attribute__((target("avx2,fma,f16c")))
static void block_rows_4bit(const vq_codes *w, int n0, int n1, const quantized_rows *x,
                            float *c, int ldc) {
    const int groups = x->groups, pairs = groups / 2, cols = w->cols;
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    float sn[MAX_COLS / 16], bn[MAX_COLS / 16];
    for (int n = n0; n < n1; n++) {
        const uint8_t *qn = w->codes + (size_t)n * cols / 2;
        row_params_avx2(w, n, sn, bn);
        int r = 0;
        /* Two chains a row (even and odd pairs) hide the FMA's latency. */
        for (; r + 4 <= x->m; r += 4) { /* four rows of x share each loaded pair */
            __m256 acc[2][4];
            for (int i = 0; i < 4; i++) acc[0][i] = acc[1][i] = _mm256_setzero_ps();
            for (int p = 0; p < pairs; p++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(qn + p * GROUP));
                __m256i lo = _mm256_and_si256(v, nibble);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
                __m256 s8 = pair_scales(sn, p);
                for (int i = 0; i < 4; i++)
                    acc[p & 1][i] = pair_step(lo, hi, s8,
                                              x->xp + ((size_t)(r + i) * pairs + p) * 2 * GROUP,
                                              x->xd8 + ((size_t)(r + i) * pairs + p) * 8,
                                              acc[p & 1][i]);
            }
            for (int i = 0; i < 4; i++) {
                __m256 sum = _mm256_add_ps(acc[0][i], acc[1][i]);
                if (groups % 2) sum = lone_group(qn, groups - 1, sn, x, r + i, sum);
                c[(size_t)(r + i) * ldc + n] =
                    hsum(sum) + bias_term(bn, x->xs + (size_t)(r + i) * groups, groups);
            }
        }
        for (; r < x->m; r++) { /* the rest one at a time, in the same order */
            __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
            for (int p = 0; p < pairs; p++) {
                if (!(p & 1)) /* a cache line every other pair, PREFETCH_AHEAD ahead */
                    _mm_prefetch((const char *)(qn + p * GROUP + PREFETCH_AHEAD), _MM_HINT_T0);
                __m256i v = _mm256_loadu_si256((const __m256i *)(qn + p * GROUP));
                acc[p & 1] = pair_step(_mm256_and_si256(v, nibble),
                                       _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble),
                                       pair_scales(sn, p),
                                       x->xp + ((size_t)r * pairs + p) * 2 * GROUP,
                                       x->xd8 + ((size_t)r * pairs + p) * 8, acc[p & 1]);
            }
            __m256 sum = _mm256_add_ps(acc[0], acc[1]);
            if (groups % 2) sum = lone_group(qn, groups - 1, sn, x, r, sum);
            c[(size_t)r * ldc + n] = hsum(sum) + bias_term(bn, x->xs + (size_t)r * groups, groups);
        }
    }
    _mm256_zeroupper();
}

/* x's int8 rows in pair order for block_rows_4bit: per pair of groups (g, g + 1), g's
 * columns 0-15, g + 1's 0-15, g's 16-31, g + 1's 16-31; and each group's scale four times.
 * A lone last group stays in xq only. Returns -1 when out of memory. */
static int pair_order(quantized_rows *x) {
    int pairs = x->groups / 2;
    size_t rows = (size_t)x->m * pairs;
    x->xd8 = malloc(rows * 8 * sizeof(float) + rows * 2 * GROUP);
    if (!x->xd8) return -1;
    x->xp = (int8_t *)(x->xd8 + rows * 8);
    for (int r = 0; r < x->m; r++)
        for (int p = 0; p < pairs; p++) {
            const int8_t *g0 = x->xq + ((size_t)r * x->groups + 2 * p) * GROUP, *g1 = g0 + GROUP;
            int8_t *dst = x->xp + ((size_t)r * pairs + p) * 2 * GROUP;
            memcpy(dst, g0, 16);
            memcpy(dst + 16, g1, 16);
            memcpy(dst + 32, g0 + 16, 16);
            memcpy(dst + 48, g1 + 16, 16);
            float *d8 = x->xd8 + ((size_t)r * pairs + p) * 8;
            for (int i = 0; i < 8; i++) d8[i] = x->xd[(size_t)r * x->groups + 2 * p + i / 4];
        }
    return 0;
}

__attribute__((target("avx2,fma")))
static void block_rows_8bit(const vq_codes *w, int n0, int n1, const quantized_rows *x,
                            float *c, int ldc) {
    block_rows(w, n0, n1, x, c, ldc, 8, GROUP);
}

__attribute__((target("avx2,fma")))
static void block_rows_8bit_16(const vq_codes *w, int n0, int n1, const quantized_rows *x,
                               float *c, int ldc) {
    block_rows(w, n0, n1, x, c, ldc, 8, GROUP / 2);
}

/* ------------------------------------------------------------------ threads */

typedef struct {
    const vq_codes *w;
    const quantized_rows *x;
    float *c;
    int ldc, parts;  /* parts: the threads that share the product */
    int row0, row1;  /* the weight rows split into chunks among them */
    float *dequant;  /* set: dequantize the rows into it, (row - row0) x cols, instead */
    int per;         /* weight rows a chunk covers (run_job sets it: rows_per_chunk) */
    void (*fn)(void *ctx, int i0, int i1); /* set: a vq_parallel_for job, items as rows */
    void *ctx;
} job_t;


static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER; /* one product at a time */
static pthread_mutex_t wake_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static job_t job;
static atomic_uint generation;
/* The running product's chunks as one word: its generation (bits 40-63), its number of
 * chunks (20-39) and the next chunk to take (0-19). A thread takes a chunk only while the
 * word still names the generation it woke for, so a helper that wakes late never takes a
 * chunk of the next product, nor reads the job before it is complete. */
static _Atomic uint64_t claim;
static atomic_int chunks_done;
static int helpers = -1; /* threads started besides the caller; -1 until first use */
static unsigned born_at;  /* the generation when the helpers started, before their first job */

#define CHUNK_BITS 20
#define MAX_CHUNKS ((1 << CHUNK_BITS) - 1)

static uint64_t claim_word(unsigned gen, int chunks) {
    return ((uint64_t)(gen & 0xFFFFFF) << (2 * CHUNK_BITS)) | ((uint64_t)chunks << CHUNK_BITS);
}

/* Weight rows a chunk covers: a multiple of 8 (two chunks never share a cache line of C),
 * about eight chunks a thread, so a thread that starts late (the other core busy with the
 * Python thread) leaves its share to the others instead of making them wait for it. */
static int rows_per_chunk(const job_t *j) {
    if (j->fn) { /* items of vq_parallel_for: about four chunks a thread */
        int per = (j->row1 - j->row0) / (4 * j->parts);
        return per < 1 ? 1 : per;
    }
    int rows = j->row1 - j->row0, per = (rows / (8 * j->parts) + 7) & ~7;
    if (per < 32) per = 32;
    while ((rows + per - 1) / per > MAX_CHUNKS) per *= 2;
    return per;
}

static void run_rows(const job_t *j, int n0, int n1) {
    if (n0 >= n1) return;
    if (j->fn) {
        j->fn(j->ctx, n0, n1);
        return;
    }
    if (j->dequant)
        vq_codes_dequantize(j->w, n0, n1, j->dequant + (size_t)(n0 - j->row0) * j->w->cols);
    else if (j->w->bits == 4) block_rows_4bit(j->w, n0, n1, j->x, j->c, j->ldc);
    else if (j->w->group == GROUP)
        block_rows_8bit(j->w, n0, n1, j->x, j->c, j->ldc);
    else block_rows_8bit_16(j->w, n0, n1, j->x, j->c, j->ldc);
}

/* Take chunks of generation gen's product and compute them until none is left. */
static void take_chunks(unsigned gen) {
    uint64_t mine = (uint64_t)(gen & 0xFFFFFF), v = atomic_load(&claim);
    for (;;) {
        int chunks = (int)((v >> CHUNK_BITS) & MAX_CHUNKS), next = (int)(v & MAX_CHUNKS);
        if ((v >> (2 * CHUNK_BITS)) != mine || next >= chunks) return;
        if (!atomic_compare_exchange_weak(&claim, &v, v + 1)) continue; /* v reloaded */
        int n0 = job.row0 + next * job.per;
        run_rows(&job, n0, n0 + job.per < job.row1 ? n0 + job.per : job.row1);
        atomic_fetch_add_explicit(&chunks_done, 1, memory_order_release);
        v = atomic_load(&claim);
    }
}

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void *helper_main(void *arg) {
    (void)arg;
    unsigned seen = born_at; /* not a fresh read: the first job may already be posted */
    for (;;) {
        /* Spin briefly: in decode the next product follows within microseconds. */
        long start = now_ns();
        while (atomic_load_explicit(&generation, memory_order_acquire) == seen &&
               now_ns() - start < SPIN_NS)
            for (int i = 0; i < 64; i++) _mm_pause();
        pthread_mutex_lock(&wake_lock);
        while (atomic_load(&generation) == seen) pthread_cond_wait(&wake, &wake_lock);
        pthread_mutex_unlock(&wake_lock);
        seen = atomic_load(&generation);
        take_chunks(seen);
    }
    return NULL;
}

static int thread_count(void) {
    const char *env = getenv("VELOXQUANT_QMM_THREADS");
    long n = env && *env ? strtol(env, NULL, 10) : sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : (int)n;
}

static void start_helpers(void) {
    int wanted = thread_count() - 1;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    helpers = 0;
    born_at = atomic_load(&generation);
    for (int i = 1; i <= wanted; i++) {
        pthread_t t;
        if (pthread_create(&t, &attr, helper_main, (void *)(intptr_t)i) != 0) break;
        helpers++;
    }
    pthread_attr_destroy(&attr);
}

static void run_job(const job_t *j, long macs) {
    if (macs < MIN_PARALLEL_MACS || pthread_mutex_trylock(&pool_lock) != 0) {
        run_rows(j, j->row0, j->row1); /* small, or another thread holds the helpers */
        return;
    }
    if (helpers < 0) start_helpers();
    job = *j;
    job.parts = helpers + 1;
    job.per = rows_per_chunk(&job);
    int chunks = (job.row1 - job.row0 + job.per - 1) / job.per;
    atomic_store(&chunks_done, 0);
    /* The chunks are posted before the generation moves: a helper that sees the new
     * generation finds them (only this thread, holding pool_lock, moves either). */
    unsigned gen = atomic_load(&generation) + 1;
    atomic_store(&claim, claim_word(gen, chunks));
    pthread_mutex_lock(&wake_lock);
    atomic_fetch_add_explicit(&generation, 1, memory_order_release);
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&wake_lock);
    take_chunks(gen);
    /* Only a chunk a helper is computing right now is left to wait for. */
    while (atomic_load_explicit(&chunks_done, memory_order_acquire) < chunks) _mm_pause();
    pthread_mutex_unlock(&pool_lock);
}

/* dequantize_group's AVX2 form: the 32 codes widened to int32 eight at a time. */
__attribute__((target("avx2,fma")))
static void dequantize_group_avx2(const uint8_t *qn, const float *sn, const float *bn, int g,
                                  int bits, int group, float *dst) {
    __m256i q = load_codes(qn, g, bits); /* 32 bytes in column order (4-bit: 0..15) */
    __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
    for (int h = 0; h < 2; h++) {
        int at = group == GROUP ? g : 2 * g + h;
        __m256 scale = _mm256_set1_ps(sn[at]), bias = _mm256_set1_ps(bn[at]);
        for (int e = 0; e < 2; e++) {
            __m128i eight = e ? _mm_srli_si128(halves[h], 8) : halves[h];
            __m256i wide = bits == 8 ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
            _mm256_storeu_ps(dst + 16 * h + 8 * e,
                             _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(wide), bias));
        }
    }
}

#endif /* x86-64 */

static int avx2_available(void) {
#ifdef HAVE_AVX2_PATH
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

const char *vq_codes_path(void) { return avx2_available() ? "avx2" : "portable"; }

void vq_parallel_for(int n, long work, void (*fn)(void *ctx, int i0, int i1), void *ctx) {
    if (n < 1) return;
#ifdef HAVE_AVX2_PATH
    if (avx2_available()) { /* the helpers exist only where the AVX2 path does */
        job_t j = {0};
        j.parts = 1;
        j.row1 = n;
        j.fn = fn;
        j.ctx = ctx;
        run_job(&j, work);
        return;
    }
#endif
    fn(ctx, 0, n);
}

/* The BLAS MLX was handed (the project's forward, loaded globally before MLX), if any:
 * weak, so a process without one simply keeps every product on the codes. */
extern void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                        const float *a, int lda, const float *b, int ldb, float beta, float *c,
                        int ldc) __attribute__((weak));

int vq_codes_float32_available(void) { return cblas_sgemm != 0; }

/* Group g of a weight row as 32 floats: scale * code + bias (one scale a half for 16). */
static void dequantize_group(const vq_codes *w, const uint8_t *qn, const float *sn,
                             const float *bn, int g, float *dst, int avx2) {
#ifdef HAVE_AVX2_PATH
    if (avx2) {
        dequantize_group_avx2(qn, sn, bn, g, w->bits, w->group, dst);
        return;
    }
#endif
    (void)avx2;
    for (int j = 0; j < GROUP; j++) {
        int at = w->group == GROUP ? g : 2 * g + (j >= GROUP / 2);
        dst[j] = sn[at] * (float)code_at(qn, g, j, w->bits) + bn[at];
    }
}

/* Weight rows [n0, n1) as float32, (n1 - n0) x cols, from their codes. */
void vq_codes_dequantize(const vq_codes *w, int n0, int n1, float *dst) {
    int cols = w->cols, groups = cols / GROUP;
    int avx2 = avx2_available();
    float sn[MAX_COLS / 16], bn[MAX_COLS / 16];
    for (int n = n0; n < n1; n++) {
        const uint8_t *qn = w->codes + (size_t)n * cols * w->bits / 8;
#ifdef HAVE_AVX2_PATH
        if (avx2) row_params_avx2(w, n, sn, bn);
        else
#endif
            row_params_portable(w, n, sn, bn);
        for (int g = 0; g < groups; g++)
            dequantize_group(w, qn, sn, bn, g, dst + (size_t)(n - n0) * cols + g * GROUP, avx2);
    }
}

/* x times the weights in float32: a few weight rows at a time are dequantized (by every
 * thread) into a buffer that stays in cache and multiplied there by the BLAS. */
static void dequantize_tile(const vq_codes *w, int n0, int n1, float *dst) {
#ifdef HAVE_AVX2_PATH
    if (avx2_available()) { /* the helpers exist only where the AVX2 path does */
        job_t j = {w, NULL, NULL, 0, 1, n0, n1, dst};
        run_job(&j, (long)(n1 - n0) * w->cols * 16); /* ~ a 16-row product's work */
        return;
    }
#endif
    vq_codes_dequantize(w, n0, n1, dst);
}

static int matmul_float32(const vq_codes *w, int m, const float *x, float *out) {
    int tile = (TILE_FLOATS / w->cols) & ~7;
    if (tile < 8) tile = 8;
    float *buffer = malloc((size_t)tile * w->cols * sizeof(float));
    if (!buffer) return -1;
    for (int n0 = 0; n0 < w->rows; n0 += tile) {
        int n1 = n0 + tile < w->rows ? n0 + tile : w->rows;
        dequantize_tile(w, n0, n1, buffer);
        cblas_sgemm(CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_TRANS, m, n1 - n0, w->cols, 1.0f, x,
                    w->cols, buffer, w->cols, 0.0f, out + n0, w->rows);
    }
    free(buffer);
    return 0;
}

/* q from x (m x cols), on the AVX2 or the portable path. */
static void quantize_into(const float *x, int m, int cols, quantized_rows *q, int avx2) {
#ifdef HAVE_AVX2_PATH
    if (avx2) {
        quantize_rows(x, cols, m, cols, q->xq, q->xd, q->xs, q->xs16);
        return;
    }
#endif
    (void)avx2;
    quantize_rows_portable(x, m, cols, q);
}

static int multiply(const vq_codes *w, const quantized_rows *q, float *out, int avx2) {
#ifdef HAVE_AVX2_PATH
    if (avx2) {
        quantized_rows x = *q;
        if (w->bits == 4 && pair_order(&x) != 0) return -1;
        job_t j = {w, &x, out, w->rows, 1, 0, w->rows, NULL};
        run_job(&j, (long)q->m * w->rows * w->cols);
        free(x.xd8); /* NULL unless pair_order ran */
        return 0;
    }
#endif
    (void)avx2;
    matmul_portable(w, q, out);
    return 0;
}

int vq_codes_matmul(const vq_codes *w, int m, const float *x, float *out, int path,
                    int precise) {
    if (m < 1) return 0;
    if (path == VQ_PATH_FLOAT32 && cblas_sgemm) return matmul_float32(w, m, x, out);
    int avx2 = path != VQ_PATH_PORTABLE && avx2_available();
    quantized_rows q;
    if (rows_buffer(&q, m, w->cols) != 0) return -1;
    quantize_into(x, m, w->cols, &q, avx2);
    int rc = multiply(w, &q, out, avx2);
    free(q.xd);
    return rc == 0 && precise ? vq_codes_exact_top(w, m, x, out) : rc;
}
