/* Decode attention over the paged KV pool, fp32, on the CPU: one query token per sequence; every sequence's keys and
 * values read once, through its block table, where they lie in the pool (no gather, no padding, no mask).
 *
 * Layout (common/kv/pool.py): one layer of the pool is [blocks, block_size, kv_heads, dim], token-major, so a token's
 * keys for all KV heads are one contiguous row and a block's rows follow each other. Token t of a sequence lives in
 * block table[t / block_size], row t % block_size. Query head h reads KV head h / group (grouped-query attention,
 * as transformers' repeat_kv), so a row is read once for all query heads.
 *
 * Per sequence: scores = scale * q . k for every token, an exact two-pass softmax per query head (max, then exp and
 * sum), out = sum p * v. Sequences are split over `threads` OpenMP threads in contiguous ranges of about equal token
 * counts. OpenMP rather than threads of our own: the library is loaded into a process where PyTorch's libgomp
 * already runs (same soname, so the loader reuses it); sharing its pool keeps the two from fighting over the cores
 * (a pthread of ours running while PyTorch's workers spin-waited after a matmul made the kernel ~1.7x slower). The
 * caller (Python, through ctypes) does not hold the GIL here.
 *
 * Returns 0; -1 when scratch memory could not be had, -2 for head counts it does not take (query heads not a
 * multiple of KV heads) — the output is then not to be trusted: the caller takes its own path.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const float *q, *k, *v;
    float *out;
    const int64_t *tables, *lengths;
    int64_t table_width, q_heads, kv_heads, dim, block_size;
    float scale;
} step_t;

static inline __attribute__((always_inline)) void attend(const step_t *s, int64_t i, float *restrict scores,
                                                         const int64_t D) {
    const int64_t bs = s->block_size, Q = s->q_heads, group = Q / s->kv_heads, row = s->kv_heads * D;
    const int64_t n = s->lengths[i];
    const int64_t *table = s->tables + i * s->table_width;
    const float *restrict q = s->q + i * Q * D;
    float *restrict out = s->out + i * Q * D;
    for (int64_t t0 = 0; t0 < n; t0 += bs) {
        const float *restrict block = s->k + table[t0 / bs] * bs * row;
        const int64_t rows = n - t0 < bs ? n - t0 : bs;
        for (int64_t u = 0; u < rows; u++) {
            for (int64_t h = 0; h < Q; h++) {
                const float *restrict qh = q + h * D, *restrict kh = block + u * row + (h / group) * D;
                float dot = 0.f;
                for (int64_t d = 0; d < D; d++) dot += qh[d] * kh[d];
                scores[h * n + t0 + u] = dot * s->scale;
            }
        }
    }
    for (int64_t h = 0; h < Q; h++) {
        float *restrict p = scores + h * n, top = p[0], sum = 0.f;
        for (int64_t t = 1; t < n; t++) top = p[t] > top ? p[t] : top;
        for (int64_t t = 0; t < n; t++) {
            p[t] = expf(p[t] - top);
            sum += p[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < n; t++) p[t] *= inv;
    }
    memset(out, 0, Q * D * sizeof(float));
    for (int64_t t0 = 0; t0 < n; t0 += bs) {
        const float *restrict block = s->v + table[t0 / bs] * bs * row;
        const int64_t rows = n - t0 < bs ? n - t0 : bs;
        for (int64_t u = 0; u < rows; u++) {
            for (int64_t h = 0; h < Q; h++) {
                const float p = scores[h * n + t0 + u];
                const float *restrict vh = block + u * row + (h / group) * D;
                float *restrict oh = out + h * D;
                for (int64_t d = 0; d < D; d++) oh[d] += p * vh[d];
            }
        }
    }
}

/* The usual head sizes as compile-time constants, so the inner loops become whole vectors. */
static void attend_any(const step_t *s, int64_t i, float *scores) {
    switch (s->dim) {
    case 64: attend(s, i, scores, 64); break;
    case 128: attend(s, i, scores, 128); break;
    default: attend(s, i, scores, s->dim);
    }
}

/* Sequences [begin, end); 0, or -1 without scratch memory. */
static int attend_range(const step_t *s, int64_t begin, int64_t end) {
    int64_t longest = 1;
    for (int64_t i = begin; i < end; i++) longest = s->lengths[i] > longest ? s->lengths[i] : longest;
    float *scores = malloc(longest * s->q_heads * sizeof(float));
    if (!scores) return -1;
    for (int64_t i = begin; i < end; i++) attend_any(s, i, scores);
    free(scores);
    return 0;
}

int paged_decode_attention(const float *q, const float *k, const float *v, float *out, const int64_t *tables,
                           int64_t table_width, const int64_t *lengths, int64_t batch, int64_t q_heads,
                           int64_t kv_heads, int64_t dim, int64_t block_size, float scale, int threads) {
    if (kv_heads < 1 || q_heads % kv_heads != 0) return -2;
    const step_t step = {q, k, v, out, tables, lengths, table_width, q_heads, kv_heads, dim, block_size, scale};
    int64_t total = 0;
    for (int64_t i = 0; i < batch; i++) total += lengths[i];
    if (threads > batch) threads = (int)batch;
    if (threads < 1) threads = 1;
    int status = 0;
#pragma omp parallel num_threads(threads) reduction(| : status)
    {
        /* this thread's range: the sequences whose middle token falls in its share of all tokens */
        const int n = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t from = total * t / n, to = total * (t + 1) / n;
        int64_t seen = 0, begin = batch, end = batch;
        for (int64_t i = 0; i < batch; i++) {
            const int64_t middle = seen + lengths[i] / 2;
            if (begin == batch && middle >= from) begin = i;
            if (end == batch && middle >= to) end = i;
            seen += lengths[i];
        }
        if (t == n - 1) end = batch;
        status |= attend_range(&step, begin, end);
    }
    return status;
}
