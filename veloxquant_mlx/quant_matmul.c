/*
 * 4- and 8-bit weights times int8 activations for small float32 products (x86-64 AVX2).
 *
 * On the CPU backend the server dequantizes a quantized model to float32 so MLX can use
 * OpenBLAS; decode then reads 4 bytes a weight where the checkpoint held ~0.6 (4-bit) or
 * ~1.1 (8-bit). A registered weight keeps its quantized codes here. When MLX asks for
 * x (m x k) times such a weight transposed (the product every Linear, and a tied LM
 * head, makes) and m is small, this file computes it from the codes instead, as
 * llama.cpp does: each row of x is quantized to int8 in groups of 32 (one float scale a
 * group) and the products are integer dot products (vpmaddubsw), scaled per group.
 * Prefill-sized products stay on OpenBLAS, which is faster there; x's int8 rounding is
 * the only difference from the float32 product.
 *
 * Weights are keyed by the address of their float32 buffer, the B that MLX passes to
 * cblas_sgemm. The Python side (veloxquant_mlx/quant_weights.py) keeps each registered
 * array alive, so an address cannot be reused by another array while it is registered.
 *
 * Code layout, per weight row and per group of 32 columns, with w = scale * q + bias:
 *   4-bit: 16 bytes, low nibbles columns 0..15, high nibbles 16..31, q in 0..15;
 *   8-bit: 32 signed bytes in column order, q in -128..127.
 * A matrix has one scale and bias per 32 columns, or (8-bit only) per 16: ggml's Q6_K,
 * Q3_K and Q2_K scale every 16 values. The activations keep one int8 scale per 32 either
 * way; a 16-column weight group only changes the scale of half of each integer sum.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "quant_matmul.h"

#define GROUP 32
#define TABLE_SIZE 8192          /* power of two; far above any model's matrix count */
#define MAX_THREADS 8
/* A helper spins this long for the next product, then sleeps. Short: the Python thread
 * that builds the next step needs the core (served c=1 on 2 cores: 17-18 tok/s at 20 us
 * against 13-16 at 200 us, the same requests). */
#define SPIN_NS 20000
#define MIN_PARALLEL_MACS 65536  /* below this a product runs on the calling thread alone */

typedef struct {
    const float *weight; /* the key: the float32 buffer MLX passes as B */
    int rows, cols, bits;
    int group;           /* columns per scale and bias: 32, or 16 (8-bit only) */
    uint8_t *codes;      /* rows * cols * bits / 8 */
    float *scales;       /* rows * cols / group */
    float *biases;
} qmatrix;

static qmatrix *table[TABLE_SIZE];
static pthread_rwlock_t table_lock = PTHREAD_RWLOCK_INITIALIZER;
static atomic_int registered;
static atomic_long served;
static atomic_int max_rows = 16;

/* ------------------------------------------------------------------ registry */

static size_t slot_of(const float *weight) {
    uintptr_t h = (uintptr_t)weight >> 4;
    h ^= h >> 17;
    h *= 0x9E3779B97F4A7C15ull;
    return (size_t)(h >> 40) & (TABLE_SIZE - 1);
}

/* Index of weight's slot, or of the empty slot where it would go; -1 when full. */
static long find_slot(const float *weight) {
    size_t s = slot_of(weight);
    for (size_t i = 0; i < TABLE_SIZE; i++, s = (s + 1) & (TABLE_SIZE - 1))
        if (table[s] == NULL || table[s]->weight == weight) return (long)s;
    return -1;
}

static void free_matrix(qmatrix *q) {
    if (!q) return;
    free(q->codes);
    free(q->scales);
    free(q->biases);
    free(q);
}

int vq_qmm_supported(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    return vq_forward_routes() && __builtin_cpu_supports("avx2") &&
           __builtin_cpu_supports("fma");
#else
    return 0; /* the kernels below are x86-64 only: nothing registers elsewhere */
#endif
}

int vq_qmm_register(const float *weight, int rows, int cols, int bits, int group,
                    const uint8_t *codes, const float *scales, const float *biases) {
    if (!vq_qmm_supported()) return VQ_QMM_UNSUPPORTED_CPU;
    if (!weight || rows < 1 || cols < GROUP || cols % GROUP || (bits != 4 && bits != 8) ||
        (group != GROUP && !(group == GROUP / 2 && bits == 8)))
        return VQ_QMM_BAD_SHAPE;
    size_t groups = (size_t)rows * (cols / group), code_bytes = (size_t)rows * cols * bits / 8;
    qmatrix *q = calloc(1, sizeof *q);
    if (q) {
        q->codes = malloc(code_bytes);
        q->scales = malloc(groups * sizeof(float));
        q->biases = malloc(groups * sizeof(float));
    }
    if (!q || !q->codes || !q->scales || !q->biases) {
        free_matrix(q);
        return VQ_QMM_NO_MEMORY;
    }
    q->weight = weight;
    q->rows = rows;
    q->cols = cols;
    q->bits = bits;
    q->group = group;
    memcpy(q->codes, codes, code_bytes);
    memcpy(q->scales, scales, groups * sizeof(float));
    memcpy(q->biases, biases, groups * sizeof(float));
    pthread_rwlock_wrlock(&table_lock);
    long s = atomic_load(&registered) < TABLE_SIZE / 2 ? find_slot(weight) : -1;
    if (s < 0) {
        pthread_rwlock_unlock(&table_lock);
        free_matrix(q);
        return VQ_QMM_TABLE_FULL;
    }
    if (table[s]) free_matrix(table[s]); /* re-registration replaces */
    else atomic_fetch_add(&registered, 1);
    table[s] = q;
    pthread_rwlock_unlock(&table_lock);
    return 0;
}

int vq_qmm_unregister(const float *weight) {
    pthread_rwlock_wrlock(&table_lock);
    long s = find_slot(weight);
    if (s < 0 || table[s] == NULL) {
        pthread_rwlock_unlock(&table_lock);
        return VQ_QMM_NOT_FOUND;
    }
    free_matrix(table[s]);
    table[s] = NULL;
    atomic_fetch_sub(&registered, 1);
    /* Re-insert the rest of the probe run so later lookups still find them. */
    for (size_t i = ((size_t)s + 1) & (TABLE_SIZE - 1); table[i]; i = (i + 1) & (TABLE_SIZE - 1)) {
        qmatrix *moved = table[i];
        table[i] = NULL;
        table[find_slot(moved->weight)] = moved;
    }
    pthread_rwlock_unlock(&table_lock);
    return 0;
}

long vq_qmm_served(void) { return atomic_load(&served); }
void vq_qmm_set_max_rows(int rows) { atomic_store(&max_rows, rows < 0 ? 0 : rows); }

/* ------------------------------------------------------------------ kernels */

#if defined(__x86_64__)
#include <immintrin.h>

typedef struct {
    int m, groups;
    const int8_t *xq;   /* m x cols, int8 */
    const float *xd;    /* m x groups: each group's scale */
    const float *xs;    /* m x groups: each group's sum as rounded, for the bias term */
    const float *xs16;  /* m x 2 groups: the sums of each half, for 16-column biases */
} quantized_rows;

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

static inline void store(float *c, float value, float alpha, float beta) {
    *c = beta == 0.0f ? alpha * value : alpha * value + beta * *c;
}

/* Group g's weight scale as a vector for group_dot's 8 sums: sums 0-3 cover columns 0-15
 * and sums 4-7 columns 16-31, so a 16-column matrix puts each half's scale in its lane. */
__attribute__((target("avx2,fma"), always_inline))
static inline __m256 weight_scale(const float *sn, int g, int sub) {
    if (sub == GROUP) return _mm256_set1_ps(sn[g]);
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(sn[2 * g])),
                                _mm_set1_ps(sn[2 * g + 1]), 1);
}

/* Weight rows [n0, n1) against every row of x: C[r][n] for all r. Inlined per bits and per
 * columns a weight scale covers (sub). */
__attribute__((target("avx2,fma"), always_inline))
static inline void block_rows(const qmatrix *w, int n0, int n1, const quantized_rows *x,
                              float alpha, float beta, float *c, int ldc, int bits, int sub) {
    const int groups = x->groups, cols = w->cols, wgroups = cols / sub;
    const float *sums = sub == GROUP ? x->xs : x->xs16;
    for (int n = n0; n < n1; n++) {
        const uint8_t *qn = w->codes + (size_t)n * cols * bits / 8;
        const float *sn = w->scales + (size_t)n * wgroups, *bn = w->biases + (size_t)n * wgroups;
        int r = 0;
        for (; r + 4 <= x->m; r += 4) { /* four rows of x share each loaded group */
            __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
            const int8_t *x0 = x->xq + (size_t)r * cols;
            const float *d0 = x->xd + (size_t)r * groups;
            for (int g = 0; g < groups; g++) {
                __m256i q = load_codes(qn, g, bits);
                __m256 s = weight_scale(sn, g, sub);
                acc0 = _mm256_fmadd_ps(group_dot(q, x0 + g * GROUP, bits),
                                       _mm256_mul_ps(s, _mm256_set1_ps(d0[g])), acc0);
                acc1 = _mm256_fmadd_ps(group_dot(q, x0 + cols + g * GROUP, bits),
                                       _mm256_mul_ps(s, _mm256_set1_ps(d0[groups + g])), acc1);
                acc2 = _mm256_fmadd_ps(group_dot(q, x0 + 2 * cols + g * GROUP, bits),
                                       _mm256_mul_ps(s, _mm256_set1_ps(d0[2 * groups + g])),
                                       acc2);
                acc3 = _mm256_fmadd_ps(group_dot(q, x0 + 3 * cols + g * GROUP, bits),
                                       _mm256_mul_ps(s, _mm256_set1_ps(d0[3 * groups + g])),
                                       acc3);
            }
            __m256 accs[4] = {acc0, acc1, acc2, acc3};
            for (int i = 0; i < 4; i++) {
                float v = hsum(accs[i]) + bias_term(bn, sums + (size_t)(r + i) * wgroups, wgroups);
                store(c + (size_t)(r + i) * ldc + n, v, alpha, beta);
            }
        }
        for (; r < x->m; r++) { /* the rest one at a time, two chains to hide FMA latency */
            __m256 even = _mm256_setzero_ps(), odd = even;
            const int8_t *xr = x->xq + (size_t)r * cols;
            const float *dr = x->xd + (size_t)r * groups;
            int g = 0;
            for (; g + 2 <= groups; g += 2) {
                even = _mm256_fmadd_ps(group_dot(load_codes(qn, g, bits), xr + g * GROUP, bits),
                                       _mm256_mul_ps(weight_scale(sn, g, sub),
                                                     _mm256_set1_ps(dr[g])), even);
                odd = _mm256_fmadd_ps(
                    group_dot(load_codes(qn, g + 1, bits), xr + (g + 1) * GROUP, bits),
                    _mm256_mul_ps(weight_scale(sn, g + 1, sub), _mm256_set1_ps(dr[g + 1])), odd);
            }
            if (g < groups)
                even = _mm256_fmadd_ps(group_dot(load_codes(qn, g, bits), xr + g * GROUP, bits),
                                       _mm256_mul_ps(weight_scale(sn, g, sub),
                                                     _mm256_set1_ps(dr[g])), even);
            float v = hsum(_mm256_add_ps(even, odd)) +
                      bias_term(bn, sums + (size_t)r * wgroups, wgroups);
            store(c + (size_t)r * ldc + n, v, alpha, beta);
        }
    }
}

__attribute__((target("avx2,fma")))
static void block_rows_4bit(const qmatrix *w, int n0, int n1, const quantized_rows *x,
                            float alpha, float beta, float *c, int ldc) {
    block_rows(w, n0, n1, x, alpha, beta, c, ldc, 4, GROUP);
}

__attribute__((target("avx2,fma")))
static void block_rows_8bit(const qmatrix *w, int n0, int n1, const quantized_rows *x,
                            float alpha, float beta, float *c, int ldc) {
    block_rows(w, n0, n1, x, alpha, beta, c, ldc, 8, GROUP);
}

__attribute__((target("avx2,fma")))
static void block_rows_8bit_16(const qmatrix *w, int n0, int n1, const quantized_rows *x,
                               float alpha, float beta, float *c, int ldc) {
    block_rows(w, n0, n1, x, alpha, beta, c, ldc, 8, GROUP / 2);
}

/* ------------------------------------------------------------------ threads */

typedef struct {
    const qmatrix *w;
    const quantized_rows *x;
    float alpha, beta;
    float *c;
    int ldc, parts;
} job_t;

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER; /* one product at a time */
static pthread_mutex_t wake_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static job_t job;
static atomic_uint generation;
static atomic_int pending;
static int helpers = -1; /* threads started besides the caller; -1 until first use */
static unsigned born_at;  /* the generation when the helpers started, before their first job */

static void run_part(const job_t *j, int part) {
    /* Split the weight rows in multiples of 8 so two parts never share a cache line of C. */
    int rows = j->w->rows, per = ((rows + j->parts - 1) / j->parts + 7) & ~7;
    int n0 = part * per, n1 = n0 + per < rows ? n0 + per : rows;
    if (n0 >= n1) return;
    if (j->w->bits == 4) block_rows_4bit(j->w, n0, n1, j->x, j->alpha, j->beta, j->c, j->ldc);
    else if (j->w->group == GROUP)
        block_rows_8bit(j->w, n0, n1, j->x, j->alpha, j->beta, j->c, j->ldc);
    else block_rows_8bit_16(j->w, n0, n1, j->x, j->alpha, j->beta, j->c, j->ldc);
}

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void *helper_main(void *arg) {
    int part = (int)(intptr_t)arg;
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
        run_part(&job, part);
        atomic_fetch_sub_explicit(&pending, 1, memory_order_release);
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
        job_t alone = *j; /* small, or another thread holds the helpers: do it here */
        alone.parts = 1;
        run_part(&alone, 0);
        return;
    }
    if (helpers < 0) start_helpers();
    job = *j;
    job.parts = helpers + 1;
    atomic_store(&pending, helpers);
    pthread_mutex_lock(&wake_lock);
    atomic_fetch_add_explicit(&generation, 1, memory_order_release);
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&wake_lock);
    run_part(&job, 0);
    while (atomic_load_explicit(&pending, memory_order_acquire) > 0) _mm_pause();
    pthread_mutex_unlock(&pool_lock);
}

/* ------------------------------------------------------------------ entry */

int vq_qmm_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                const float *a, int lda, const float *b, int ldb, float beta, float *c,
                int ldc) {
    if (atomic_load_explicit(&registered, memory_order_relaxed) == 0) return 0;
    if (order != VQ_ROW_MAJOR || trans_a != VQ_NO_TRANS || trans_b != VQ_TRANS || m < 1 ||
        m > atomic_load_explicit(&max_rows, memory_order_relaxed) || ldb != k || lda < k ||
        ldc < n)
        return 0;
    pthread_rwlock_rdlock(&table_lock);
    long s = find_slot(b);
    qmatrix *w = s >= 0 ? table[s] : NULL;
    if (!w || w->rows != n || w->cols != k) {
        pthread_rwlock_unlock(&table_lock);
        return 0;
    }
    int groups = k / GROUP;
    void *buffer = malloc((size_t)m * k + 4 * (size_t)m * groups * sizeof(float));
    if (!buffer) {
        pthread_rwlock_unlock(&table_lock);
        return 0; /* OpenBLAS still has the float32 weight */
    }
    float *xd = buffer, *xs = xd + (size_t)m * groups, *xs16 = xs + (size_t)m * groups;
    int8_t *xq = (int8_t *)(xs16 + 2 * (size_t)m * groups);
    quantize_rows(a, lda, m, k, xq, xd, xs, xs16);
    quantized_rows x = {m, groups, xq, xd, xs, xs16};
    job_t j = {w, &x, alpha, beta, c, ldc, 1};
    run_job(&j, (long)m * n * k);
    pthread_rwlock_unlock(&table_lock);
    free(buffer);
    atomic_fetch_add_explicit(&served, 1, memory_order_relaxed);
    return 1;
}

#else /* not x86-64: vq_qmm_register refuses, so there is never a copy to serve from */

int vq_qmm_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                const float *a, int lda, const float *b, int ldb, float beta, float *c,
                int ldc) {
    return 0;
}

#endif
