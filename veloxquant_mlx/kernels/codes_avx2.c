/* The codes kernel's AVX2 path (codes_kernel.c's header says what it computes): x's int8
 * quantization, the integer dot products of weight rows against every row of x, and
 * dequantization for the float32 path. Compiled on x86-64; run where the CPU has AVX2. */
#include "codes_rows.h"

#ifdef HAVE_AVX2_PATH
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

/* One-row products read codes this many bytes ahead of use (a software prefetch): they
 * are bound by reading the codes, and the hardware prefetchers alone left ~25% of the
 * bandwidth unused. A 1B one-row decode step, alternating runs: none -> 1 KiB 1.07x,
 * 1 KiB -> 2 KiB 1.06x; 4 KiB was no better than 2. */
#define PREFETCH_AHEAD 2048

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
void vq_quantize_rows_avx2(const float *a, int lda, int m, int cols, int8_t *xq, float *xd,
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

/* vq_row_params_portable, eight at a time (float16 through F16C). */
__attribute__((target("avx2,fma,f16c")))
void vq_row_params_avx2(const vq_codes *w, int n, float *s, float *b) {
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
        vq_row_params_avx2(w, n, sn, bn);
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
 * 16-31 of both groups, which x's pair order (vq_pair_order) matches. Half the instructions
 * of group by group (block_rows). Every row of x is summed in the same order, in a block
 * of four or alone. */
__attribute__((target("avx2,fma,f16c")))
void vq_block_rows_4bit(const vq_codes *w, int n0, int n1, const quantized_rows *x,
                            float *c, int ldc) {
    const int groups = x->groups, pairs = groups / 2, cols = w->cols;
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    float sn[MAX_COLS / 16], bn[MAX_COLS / 16];
    for (int n = n0; n < n1; n++) {
        const uint8_t *qn = w->codes + (size_t)n * cols / 2;
        vq_row_params_avx2(w, n, sn, bn);
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

/* x's int8 rows in pair order for vq_block_rows_4bit: per pair of groups (g, g + 1), g's
 * columns 0-15, g + 1's 0-15, g's 16-31, g + 1's 16-31; and each group's scale four times.
 * A lone last group stays in xq only. Returns -1 when out of memory. */
int vq_pair_order(quantized_rows *x) {
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
void vq_block_rows_8bit(const vq_codes *w, int n0, int n1, const quantized_rows *x,
                            float *c, int ldc) {
    block_rows(w, n0, n1, x, c, ldc, 8, GROUP);
}

__attribute__((target("avx2,fma")))
void vq_block_rows_8bit_16(const vq_codes *w, int n0, int n1, const quantized_rows *x,
                               float *c, int ldc) {
    block_rows(w, n0, n1, x, c, ldc, 8, GROUP / 2);
}

/* dequantize_group's AVX2 form: the 32 codes widened to int32 eight at a time. */
__attribute__((target("avx2,fma")))
void vq_dequantize_group_avx2(const uint8_t *qn, const float *sn, const float *bn, int g,
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

#endif /* HAVE_AVX2_PATH */
