/* The codes kernel's plain C path (codes_kernel.c's header says what it computes): where
 * AVX2 is missing, or VQ_PATH_PORTABLE asks for it. One thread. */
#include <math.h>
#include <string.h>

#include "codes_rows.h"

void vq_quantize_rows_portable(const float *a, int m, int cols, quantized_rows *x) {
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
void vq_row_params_portable(const vq_codes *w, int n, float *s, float *b) {
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

void vq_matmul_portable(const vq_codes *w, const quantized_rows *x, float *c) {
    int cols = w->cols, sub = w->group;
    float sn[MAX_COLS / 16], bn[MAX_COLS / 16];
    for (int n = 0; n < w->rows; n++) {
        const uint8_t *qn = w->codes + (size_t)n * cols * w->bits / 8;
        vq_row_params_portable(w, n, sn, bn);
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
