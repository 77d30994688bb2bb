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
 * dequantized weights: exact, for prompts (codes_gemm.c; without AVX2, a few rows at a
 * time on the BLAS).
 *
 * This file: the shape check, the threads that share a product's weight rows, the BLAS
 * float32 path and vq_codes_matmul. The AVX2 loops are codes_avx2.c's, the AVX2 float32
 * product codes_gemm.c's, the plain C ones codes_portable.c's, the LM head's exact pass
 * exact_top.c's (shared types: codes_rows.h).
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

#include "codes_rows.h"

#define MAX_THREADS 8
/* A helper spins this long for the next product, then sleeps. Short: the Python thread
 * that builds the next step needs the core (served c=1 on 2 cores: 17-18 tok/s at 20 us
 * against 13-16 at 200 us, the same requests). */
#define SPIN_NS 20000
#define MIN_PARALLEL_MACS 65536  /* below this a product runs on the calling thread alone */
#define TILE_FLOATS (1 << 20)    /* BLAS float32 path: 4 MiB of dequantized weight rows at a time:
                                    * few BLAS calls, each packing x once, inside L3 */
enum { CBLAS_ROW_MAJOR = 101, CBLAS_NO_TRANS = 111, CBLAS_TRANS = 112 };


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

/* ------------------------------------------------------------------ threads */

#ifdef HAVE_AVX2_PATH
#include <immintrin.h>

typedef struct {
    const vq_codes *w;
    const quantized_rows *x;
    float *c;
    int ldc, parts;  /* parts: the threads that share the product */
    int row0, row1;  /* the weight rows split into chunks among them */
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
    if (j->w->bits == 4) vq_block_rows_4bit(j->w, n0, n1, j->x, j->c, j->ldc);
    else if (j->w->group == GROUP)
        vq_block_rows_8bit(j->w, n0, n1, j->x, j->c, j->ldc);
    else vq_block_rows_8bit_16(j->w, n0, n1, j->x, j->c, j->ldc);
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

#endif /* HAVE_AVX2_PATH */

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

/* The AVX2 path computes float32 products itself (codes_gemm.c); elsewhere the BLAS does. */
int vq_codes_float32_available(void) { return avx2_available() || cblas_sgemm != 0; }

int vq_codes_blas_available(void) { return cblas_sgemm != 0; }

/* Group g of a weight row as 32 floats: scale * code + bias (one scale a half for 16). */
static void dequantize_group(const vq_codes *w, const uint8_t *qn, const float *sn,
                             const float *bn, int g, float *dst, int avx2) {
#ifdef HAVE_AVX2_PATH
    if (avx2) {
        vq_dequantize_group_avx2(qn, sn, bn, g, w->bits, w->group, dst);
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
        if (avx2) vq_row_params_avx2(w, n, sn, bn);
        else
#endif
            vq_row_params_portable(w, n, sn, bn);
        for (int g = 0; g < groups; g++)
            dequantize_group(w, qn, sn, bn, g, dst + (size_t)(n - n0) * cols + g * GROUP, avx2);
    }
}

/* x times the weights in float32: codes_gemm.c on AVX2; elsewhere a few weight rows at a
 * time are dequantized into a buffer that stays in cache and multiplied there by the BLAS. */
static int matmul_float32(const vq_codes *w, int m, const float *x, float *out, int blas) {
#ifdef HAVE_AVX2_PATH
    if (!blas && avx2_available()) return vq_gemm_float32_avx2(w, m, x, out);
#endif
    int tile = (TILE_FLOATS / w->cols) & ~7;
    if (tile < 8) tile = 8;
    float *buffer = malloc((size_t)tile * w->cols * sizeof(float));
    if (!buffer) return -1;
    for (int n0 = 0; n0 < w->rows; n0 += tile) {
        int n1 = n0 + tile < w->rows ? n0 + tile : w->rows;
        vq_codes_dequantize(w, n0, n1, buffer);
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
        vq_quantize_rows_avx2(x, cols, m, cols, q->xq, q->xd, q->xs, q->xs16);
        return;
    }
#endif
    (void)avx2;
    vq_quantize_rows_portable(x, m, cols, q);
}

static int multiply(const vq_codes *w, const quantized_rows *q, float *out, int avx2) {
#ifdef HAVE_AVX2_PATH
    if (avx2) {
        quantized_rows x = *q;
        if (w->bits == 4 && vq_pair_order(&x) != 0) return -1;
        job_t j = {w, &x, out, w->rows, 1, 0, w->rows};
        run_job(&j, (long)q->m * w->rows * w->cols);
        free(x.xd8); /* NULL unless vq_pair_order ran */
        return 0;
    }
#endif
    (void)avx2;
    vq_matmul_portable(w, q, out);
    return 0;
}

int vq_codes_matmul(const vq_codes *w, int m, const float *x, float *out, int path,
                    int precise) {
    if (m < 1) return 0;
    if (path == VQ_PATH_FLOAT32 && vq_codes_float32_available())
        return matmul_float32(w, m, x, out, !avx2_available());
    if (path == VQ_PATH_FLOAT32_BLAS && cblas_sgemm) return matmul_float32(w, m, x, out, 1);
    int avx2 = path != VQ_PATH_PORTABLE && path != VQ_PATH_FLOAT32_BLAS && avx2_available();
    quantized_rows q;
    if (rows_buffer(&q, m, w->cols) != 0) return -1;
    quantize_into(x, m, w->cols, &q, avx2);
    int rc = multiply(w, &q, out, avx2);
    free(q.xd);
    return rc == 0 && precise ? vq_codes_exact_top(w, m, x, out) : rc;
}
