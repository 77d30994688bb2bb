/* A vectorised exp (x86-64 AVX2) for the prompt kernels (../prefill_attention.c,
 * ../swiglu.c) and decode_attention.cpp. */
#ifndef VELOXQUANT_VQ_EXP_H
#define VELOXQUANT_VQ_EXP_H

#if defined(__x86_64__)
#include <immintrin.h>

/* e**x for x <= 0 (a softmax's shifted scores), 8 at a time: x = n ln2 + r with
 * |r| <= ln2/2, e**r from a degree-6 Taylor polynomial (relative error ~1.2e-7), 2**n
 * written into the exponent bits. Below -87 the result is 0 (float32 underflows). */
__attribute__((target("avx2,fma")))
static inline __m256 exp_nonpositive(__m256 x) {
    const __m256 floor_x = _mm256_set1_ps(-87.0f);
    __m256 zero = _mm256_cmp_ps(x, floor_x, _CMP_LT_OQ);
    x = _mm256_max_ps(x, floor_x);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(zero, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

#endif

#endif
