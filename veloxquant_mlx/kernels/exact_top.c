/*
 * The precise pass of a product whose largest results matter most (an LM head's logits):
 * after the int8 pass, each row's VQ_EXACT_TOP largest results are recomputed in float32,
 * from x as given and the dequantized weight rows. Those logits decide greedy tokens, the
 * top log-probabilities and nearly all of a softmax's mass; the rest keep int8's ~0.5%.
 *
 * It replaces a second int8 pass over the whole matrix (x's rounding error, quantized
 * again): that one doubled the head's arithmetic, and at 16 rows it was a quarter of a
 * SmolLM2 decode step. Here the extra work is VQ_EXACT_TOP weight rows a row of x.
 * Which results are recomputed depends on the row's own int8 results only, so a row's
 * logits still do not depend on the other rows of the batch.
 */
#include <stdlib.h>

#include "codes_kernel.h"

typedef struct {
    float value;
    int index;
} entry;

/* Restore the min-heap order of h[0..k) below position at. */
static void sift_down(entry *h, int k, int at) {
    for (;;) {
        int least = at, left = 2 * at + 1, right = left + 1;
        if (left < k && h[left].value < h[least].value) least = left;
        if (right < k && h[right].value < h[least].value) least = right;
        if (least == at) return;
        entry t = h[at];
        h[at] = h[least];
        h[least] = t;
        at = least;
    }
}

/* The k largest of v[0, n) (k <= n) into heap, in no particular order; NaN never enters
 * once the heap is full. Ties keep the earlier index. */
static void largest(const float *v, int n, int k, entry *heap) {
    for (int i = 0; i < k; i++) heap[i] = (entry){v[i], i};
    for (int i = k / 2 - 1; i >= 0; i--) sift_down(heap, k, i);
    for (int i = k; i < n; i++)
        if (v[i] > heap[0].value) {
            heap[0] = (entry){v[i], i};
            sift_down(heap, k, 0);
        }
}

/* Eight partial sums: a fixed order the compiler may keep in registers. */
static float dot(const float *a, const float *b, int n) {
    float s[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) s[j] += a[i + j] * b[i + j];
    for (; i < n; i++) s[0] += a[i] * b[i];
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

int vq_codes_exact_top(const vq_codes *w, int m, const float *x, float *out) {
    int k = w->rows < VQ_EXACT_TOP ? w->rows : VQ_EXACT_TOP;
    entry *heap = malloc((size_t)k * sizeof(entry));
    float *weight_row = malloc((size_t)w->cols * sizeof(float));
    if (!heap || !weight_row) {
        free(heap);
        free(weight_row);
        return -1;
    }
    for (int r = 0; r < m; r++) {
        float *row_out = out + (size_t)r * w->rows;
        largest(row_out, w->rows, k, heap);
        for (int i = 0; i < k; i++) {
            vq_codes_dequantize(w, heap[i].index, heap[i].index + 1, weight_row);
            row_out[heap[i].index] = dot(x + (size_t)r * w->cols, weight_row, w->cols);
        }
    }
    free(heap);
    free(weight_row);
    return 0;
}
