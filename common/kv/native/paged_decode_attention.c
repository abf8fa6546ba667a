/* Decode attention over the paged KV pool on the CPU, fp32 or bf16: one query token per sequence; every sequence's
 * keys and values read once, through its block table, where they lie in the pool (no gather, no padding, no mask).
 * In bf16 (paged_decode_attention_bf16) the query, keys and values are read as bf16 and widened to fp32 (exact: a
 * bf16 is the high half of an fp32) and every sum runs in fp32, rounding where PyTorch's CPU flash attention rounds
 * in bf16: each exp(score - max) is rounded to bf16 before it weights the values, the weighted sum is divided by the
 * fp32 sum of the unrounded exps after, and the output is rounded to bf16 (nearest even) once. Measured against
 * PyTorch's bf16 SDPA, that order gives the same bf16 output element for 87-97 % of elements (60-70 % for plain
 * fp32 math rounded once); the rest differ by its blocked GEMM's summation order.
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
 * Built with AVX-512F (-march=native on a CPU that has it), head sizes 64 and 128 with 1 to 8 query heads per KV head
 * take the loops below arranged for the vector registers (attend_fast_*): with fewer than 16 query heads, or 16, the
 * loops that read each key and value row whole, in address order (attend_rows_*, attend_rows_any_*); otherwise the
 * loops that read a block head by head (attend512_*; all give the same bits). Every other shape, and every build
 * without AVX-512, takes the portable loops (attend_any_*), which the compiler vectorises as it can. Same passes, same
 * rounding points; the fp32 sums are added in another order (outputs within 2e-7 of the portable loops' on unit
 * inputs).
 *
 * Returns 0; -1 when scratch memory could not be had, -2 for inputs it does not take (query heads not a multiple of KV
 * heads; with the prologue, an odd head size or a sequence of no tokens) — the output is then not to be trusted: the
 * caller takes its own path.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* Each query head's scores (a row of n) turned into the weights of the values, in place: an exact two-pass softmax
 * (max, then exp and sum), the sum kept in sums[h]. late (bf16): each exp rounded to bf16 and the rows left
 * unnormalised (the weighted sum is divided by sums[h] after); otherwise the rows are normalised here. */
static inline __attribute__((always_inline)) void softmax_rows(float *restrict scores, int64_t Q, int64_t n,
                                                              float *restrict sums, int late) {
    for (int64_t h = 0; h < Q; h++) {
        float *restrict p = scores + h * n, top = p[0], sum = 0.f;
        for (int64_t t = 1; t < n; t++) top = p[t] > top ? p[t] : top;
        for (int64_t t = 0; t < n; t++) {
            const float e = expf(p[t] - top);
            sum += e;
            p[t] = late ? widen_bf16(narrow_bf16(e)) : e;
        }
        sums[h] = sum;
        if (!late) {
            const float inv = 1.f / sum;
            for (int64_t t = 0; t < n; t++) p[t] *= inv;
        }
    }
}

typedef struct {
    const void *q, *k, *v;
    void *out;
    const int64_t *tables, *lengths;
    int64_t table_width, q_heads, kv_heads, dim, block_size;
    float scale;
    const void *qkv, *cos, *sin; /* the prologue's inputs (paged_decode_rope_attention*); NULL: none */
} step_t;

/* The step's prologue (paged_decode_rope_attention*), per sequence, by the thread that then attends it: its new token's
 * query and key heads rotated from the fused q|k|v projection row ([q_heads + 2 * kv_heads, dim]) — the query into
 * s->q, the keys into the sequence's slot of the pool (token lengths[i] - 1: block tables[i][t / block_size], row
 * t % block_size) — and its value heads copied to the slot. A sequence only reads its own new row, so no thread waits
 * for another. The rotation is transformers' apply_rotary_pos_emb, (x * cos) + (rotate_half(x) * sin), each product
 * and the sum rounded to the element type one op at a time as PyTorch's ops round them; built without fused
 * multiply-adds (fp-contract off, whatever the file's flags), the rotated heads are PyTorch's bit for bit (tested, and
 * checked once per process before the engine uses it: common/kv/native/__init__.py). */
#ifdef __clang__ /* (clang ignores GCC's optimize attribute: its own pragma, at the top of the function's body) */
#define NO_CONTRACT _Pragma("clang fp contract(off)")
#else
#define NO_CONTRACT
#endif
#define DEFINE_PROLOGUE(SUFFIX, T, WIDEN, NARROW)                                                                        \
    static __attribute__((noinline, optimize("fp-contract=off"))) void rotate_##SUFFIX(                \
        const T *restrict x, const T *restrict c, const T *restrict sn, T *restrict out, int64_t D) {                  \
        NO_CONTRACT                                                                                                    \
        const int64_t half = D / 2;                                                                                    \
        for (int64_t j = 0; j < half; j++) { /* rotate_half: -x2 here, x1 in the second half */                         \
            const float a = WIDEN(NARROW(WIDEN(x[j]) * WIDEN(c[j])));                                                  \
            out[j] = NARROW(a + WIDEN(NARROW(-WIDEN(x[j + half]) * WIDEN(sn[j]))));                                    \
        }                                                                                                              \
        for (int64_t j = half; j < D; j++) {                                                                           \
            const float a = WIDEN(NARROW(WIDEN(x[j]) * WIDEN(c[j])));                                                  \
            out[j] = NARROW(a + WIDEN(NARROW(WIDEN(x[j - half]) * WIDEN(sn[j]))));                                     \
        }                                                                                                              \
    }                                                                                                                  \
                                                                                                                       \
    static void prologue_##SUFFIX(const step_t *s, int64_t i) {                                                        \
        const int64_t D = s->dim, Q = s->q_heads, K = s->kv_heads, bs = s->block_size;                                 \
        const T *row = (const T *)s->qkv + i * (Q + 2 * K) * D;                                                        \
        const T *c = (const T *)s->cos + i * D, *sn = (const T *)s->sin + i * D;                                      \
        const int64_t t = s->lengths[i] - 1, slot = s->tables[i * s->table_width + t / bs] * bs + t % bs;             \
        T *q = (T *)s->q + i * Q * D, *k = (T *)s->k + slot * K * D, *v = (T *)s->v + slot * K * D;                   \
        for (int64_t h = 0; h < Q; h++) rotate_##SUFFIX(row + h * D, c, sn, q + h * D, D);                             \
        for (int64_t h = 0; h < K; h++) rotate_##SUFFIX(row + (Q + h) * D, c, sn, k + h * D, D);                       \
        memcpy(v, row + (Q + K) * D, K * D * sizeof(T));                                                               \
    }

DEFINE_PROLOGUE(f32, float, widen_f32, narrow_f32)
DEFINE_PROLOGUE(bf16, bf16_t, widen_bf16, narrow_bf16)

/* One sequence: T is the element type, WIDEN/NARROW convert to and from fp32 (identity in fp32). The query is widened
 * once into `qf`; the output accumulates in fp32 in `acc`, then is narrowed once. LATE: the bf16 order above (exps
 * rounded through NARROW, normalised after the weighted sum); fp32 normalises the weights first. */
#define DEFINE_ATTEND(SUFFIX, T, WIDEN, NARROW, LATE)                                                                      \
    static inline __attribute__((always_inline)) void attend_##SUFFIX(const step_t *s, int64_t i,                    \
                                                                      float *restrict scores, const int64_t D) {     \
        const int64_t bs = s->block_size, Q = s->q_heads, group = Q / s->kv_heads, row = s->kv_heads * D;          \
        const int64_t n = s->lengths[i];                                                                             \
        const int64_t *table = s->tables + i * s->table_width;                                                      \
        const T *restrict qin = (const T *)s->q + i * Q * D;                                                         \
        T *restrict out = (T *)s->out + i * Q * D;                                                                   \
        float *restrict qf = scores + Q * n, *restrict acc = qf + Q * D, *restrict sums = acc + Q * D;              \
        for (int64_t j = 0; j < Q * D; j++) qf[j] = WIDEN(qin[j]);                                                   \
        for (int64_t t0 = 0; t0 < n; t0 += bs) {                                                                     \
            const T *restrict block = (const T *)s->k + table[t0 / bs] * bs * row;                                  \
            const int64_t rows = n - t0 < bs ? n - t0 : bs;                                                          \
            for (int64_t u = 0; u < rows; u++) {                                                                     \
                for (int64_t h = 0; h < Q; h++) {                                                                    \
                    const float *restrict qh = qf + h * D;                                                           \
                    const T *restrict kh = block + u * row + (h / group) * D;                                        \
                    float dot = 0.f;                                                                                 \
                    for (int64_t d = 0; d < D; d++) dot += qh[d] * WIDEN(kh[d]);                                     \
                    scores[h * n + t0 + u] = dot * s->scale;                                                         \
                }                                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
        softmax_rows(scores, Q, n, sums, LATE);                                                                      \
        memset(acc, 0, Q * D * sizeof(float));                                                                      \
        for (int64_t t0 = 0; t0 < n; t0 += bs) {                                                                     \
            const T *restrict block = (const T *)s->v + table[t0 / bs] * bs * row;                                  \
            const int64_t rows = n - t0 < bs ? n - t0 : bs;                                                          \
            for (int64_t u = 0; u < rows; u++) {                                                                     \
                for (int64_t h = 0; h < Q; h++) {                                                                    \
                    const float p = scores[h * n + t0 + u];                                                          \
                    const T *restrict vh = block + u * row + (h / group) * D;                                        \
                    float *restrict oh = acc + h * D;                                                                \
                    for (int64_t d = 0; d < D; d++) oh[d] += p * WIDEN(vh[d]);                                       \
                }                                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
        for (int64_t j = 0; j < Q * D; j++) out[j] = NARROW(LATE ? acc[j] / sums[j / D] : acc[j]);                  \
    }                                                                                                                \
                                                                                                                     \
    /* The usual head sizes as compile-time constants, so the inner loops become whole vectors. */                   \
    static void attend_any_##SUFFIX(const step_t *s, int64_t i, float *scores) {                                     \
        switch (s->dim) {                                                                                            \
        case 64: attend_##SUFFIX(s, i, scores, 64); break;                                                           \
        case 128: attend_##SUFFIX(s, i, scores, 128); break;                                                         \
        default: attend_##SUFFIX(s, i, scores, s->dim);                                                              \
        }                                                                                                            \
    }

DEFINE_ATTEND(f32, float, widen_f32, narrow_f32, 0)
DEFINE_ATTEND(bf16, bf16_t, widen_bf16, narrow_bf16, 1)

#ifdef __AVX512F__
#include <immintrin.h>

/* The AVX-512 path (x86-64 CPUs with AVX-512F, head size 64 or 128, 1 to 8 query heads per KV head): the same two
 * passes and the same rounding points, with the loops arranged for the registers.
 * Scores: keys are read per tile of 16 tokens; each (token, query head) dot product is left as 16 partial sums (one
 * register) and the tile's 16 registers are reduced together by one transpose-and-add tree — 45 instructions for 16
 * dot products, where reducing each alone takes about 8 — then scaled and stored as one vector.
 * Values: block by block, the query heads that read one KV head keep their fp32 sums in registers across the
 * block's tokens (each value row loaded once for them; the sums loaded and stored once a block, not once a token).
 * Both passes ask for their next rows ahead (prefetch_l2). */
static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const bf16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* Asks for bytes [0, n) at p in L2 (whole 64-byte lines), ahead of their use. Why: a sequence's KV lies in blocks
 * of block_size tokens scattered over the pool, and the hardware prefetcher follows a stream only within a 4 KiB page
 * (a key row is 1 KiB in fp32 at 4 heads of 64): each block's first rows, and each page's, were fetched on demand.
 * Asked for one tile (keys) or one block (values) ahead, more of the loads find them in L2: a batch-32 step's
 * attention 7.88 -> 7.57 ms, the step 18.09 -> 17.76 ms (prism-small-llava, fp32, 2 threads, medians of 5 runs with
 * the two builds alternating in one engine process; 2026-12-06). The sums are untouched: same bits. */
static inline void prefetch_l2(const void *p, int64_t n) {
    for (int64_t b = 0; b < n; b += 64) _mm_prefetch((const char *)p + b, _MM_HINT_T1);
}

/* The query heads a pass of the values takes together: the most that divide the group and whose fp32 sums (C registers
 * each) stay within half the 32 vector registers — the value row and the weights take the rest. */
static inline __attribute__((always_inline)) int64_t heads_per_pass(int64_t group, int64_t C) {
    int64_t best = 1;
    for (int64_t h = 1; h <= group && h * C <= 16; h++)
        if (group % h == 0) best = h;
    return best;
}

/* One call of attend512 with the head size D and each group size 1..8 as constants. */
#define ATTEND_GROUPS(SUFFIX, D)                                                                                      \
    switch (group) {                                                                                                  \
    case 1: attend512_##SUFFIX(s, i, scores, D, 1); break;                                                            \
    case 2: attend512_##SUFFIX(s, i, scores, D, 2); break;                                                            \
    case 3: attend512_##SUFFIX(s, i, scores, D, 3); break;                                                            \
    case 4: attend512_##SUFFIX(s, i, scores, D, 4); break;                                                            \
    case 5: attend512_##SUFFIX(s, i, scores, D, 5); break;                                                            \
    case 6: attend512_##SUFFIX(s, i, scores, D, 6); break;                                                            \
    case 7: attend512_##SUFFIX(s, i, scores, D, 7); break;                                                            \
    default: attend512_##SUFFIX(s, i, scores, D, 8);                                                                  \
    }

/* r[j] = the sum of v[j]'s 16 lanes, for j < 16. */
static inline __m512 reduce16(const __m512 *v) {
    __m512 w[8], x[4];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 u01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xdd));
    const __m512 u23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, 0x88), _mm512_shuffle_f32x4(u01, u23, 0xdd));
}

#include "decode_rows.h" /* attend_rows_*, attend_rows_any_*: KV read row by row (ATTEND_ROWS) */

/* One sequence, with the head size D and the query heads per KV head GROUP known at compile time. */
#define DEFINE_ATTEND_512(SUFFIX, T, LOAD, NARROW, LATE)                                                               \
    static inline __attribute__((always_inline)) void attend512_##SUFFIX(const step_t *s, int64_t i,                 \
                                                                         float *restrict scores, const int64_t D,     \
                                                                         const int64_t GROUP) {                       \
        const int64_t bs = s->block_size, Q = s->q_heads, G = Q / GROUP, row = G * D, C = D / 16;                    \
        /* query heads per pass of the values: their sums and one value row stay within the 32 registers */          \
        const int64_t HB = heads_per_pass(GROUP, C);                                                                \
        const int64_t n = s->lengths[i];                                                                              \
        const int64_t *table = s->tables + i * s->table_width;                                                       \
        const T *restrict qin = (const T *)s->q + i * Q * D;                                                          \
        T *restrict out = (T *)s->out + i * Q * D;                                                                    \
        float *restrict qf = scores + Q * n, *restrict acc = qf + Q * D, *restrict sums = acc + Q * D;               \
        for (int64_t j = 0; j < Q * D; j += 16) _mm512_storeu_ps(qf + j, LOAD(qin + j));                             \
        for (int64_t t0 = 0; t0 < n; t0 += 16) {                                                                      \
            const int64_t rows = n - t0 < 16 ? n - t0 : 16;                                                           \
            const T *tok[16];                                                                                         \
            for (int64_t u = 0; u < rows; u++) {                                                                      \
                const int64_t t = t0 + u, ahead = t + 16; /* (the same row of the next tile) */                       \
                tok[u] = (const T *)s->k + (table[t / bs] * bs + t % bs) * row;                                      \
                if (ahead < n)                                                                                        \
                    prefetch_l2((const T *)s->k + (table[ahead / bs] * bs + ahead % bs) * row, row * sizeof(T));     \
            }                                                                                                         \
            for (int64_t h = 0; h < Q; h++) {                                                                         \
                const float *restrict qh = qf + h * D;                                                                \
                const int64_t off = (h / GROUP) * D;                                                                  \
                __m512 part[16];                                                                                      \
                for (int64_t u = 0; u < 16; u++) {                                                                    \
                    if (u >= rows) {                                                                                  \
                        part[u] = _mm512_setzero_ps();                                                                \
                        continue;                                                                                     \
                    }                                                                                                 \
                    const T *restrict kh = tok[u] + off;                                                              \
                    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qh), LOAD(kh));                                          \
                    for (int64_t c = 1; c < C; c++)                                                                   \
                        a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), LOAD(kh + 16 * c), a);                      \
                    part[u] = a;                                                                                      \
                }                                                                                                     \
                const __m512 dots = _mm512_mul_ps(reduce16(part), _mm512_set1_ps(s->scale));                          \
                _mm512_mask_storeu_ps(scores + h * n + t0, (__mmask16)((1u << rows) - 1u), dots);                     \
            }                                                                                                         \
        }                                                                                                             \
        softmax_rows(scores, Q, n, sums, LATE);                                                                       \
        memset(acc, 0, Q * D * sizeof(float));                                                                        \
        for (int64_t t0 = 0; t0 < n; t0 += bs) {                                                                      \
            const T *restrict block = (const T *)s->v + table[t0 / bs] * bs * row;                                   \
            const int64_t rows = n - t0 < bs ? n - t0 : bs;                                                           \
            if (t0 + bs < n) /* (the next block's rows) */                                                            \
                prefetch_l2((const T *)s->v + table[t0 / bs + 1] * bs * row,                                         \
                            (n - t0 - bs < bs ? n - t0 - bs : bs) * row * (int64_t)sizeof(T));                        \
            for (int64_t h0 = 0; h0 < Q; h0 += HB) {                                                                  \
                const T *restrict vg = block + (h0 / GROUP) * D;                                                      \
                __m512 o[8][8];                                                                                       \
                for (int64_t h = 0; h < HB; h++)                                                                      \
                    for (int64_t c = 0; c < C; c++) o[h][c] = _mm512_loadu_ps(acc + (h0 + h) * D + 16 * c);           \
                for (int64_t u = 0; u < rows; u++) {                                                                  \
                    __m512 w[8];                                                                                      \
                    for (int64_t h = 0; h < HB; h++) w[h] = _mm512_set1_ps(scores[(h0 + h) * n + t0 + u]);            \
                    for (int64_t c = 0; c < C; c++) {                                                                 \
                        const __m512 x = LOAD(vg + u * row + 16 * c);                                                 \
                        for (int64_t h = 0; h < HB; h++) o[h][c] = _mm512_fmadd_ps(w[h], x, o[h][c]);                 \
                    }                                                                                                 \
                }                                                                                                     \
                for (int64_t h = 0; h < HB; h++)                                                                      \
                    for (int64_t c = 0; c < C; c++) _mm512_storeu_ps(acc + (h0 + h) * D + 16 * c, o[h][c]);           \
            }                                                                                                         \
        }                                                                                                             \
        for (int64_t j = 0; j < Q * D; j++) out[j] = NARROW(LATE ? acc[j] / sums[j / D] : acc[j]);                   \
    }                                                                                                                 \
                                                                                                                      \
    /* The shapes the AVX-512 path takes as constants; any other goes to the portable loops. */                      \
    static void attend_fast_##SUFFIX(const step_t *s, int64_t i, float *scores) {                                    \
        const int64_t group = s->q_heads / s->kv_heads;                                                               \
        if (group < 1 || group > 8 || (s->dim != 64 && s->dim != 128)) {                                             \
            attend_any_##SUFFIX(s, i, scores);                                                                        \
            return;                                                                                                   \
        }                                                                                                             \
        if (ROW_ORDER && 16 % s->q_heads == 0) { /* (the row-order loops: decode_rows.h) */                          \
            if (s->dim == 64) ATTEND_ROWS(SUFFIX, 64) else ATTEND_ROWS(SUFFIX, 128)                                  \
        } else if (ROW_ORDER && s->q_heads < 16) {                                                                   \
            if (s->dim == 64) attend_rows_any_##SUFFIX(s, i, scores, 64);                                            \
            else attend_rows_any_##SUFFIX(s, i, scores, 128);                                                        \
        } else if (s->dim == 64)                                                                                      \
            ATTEND_GROUPS(SUFFIX, 64) else ATTEND_GROUPS(SUFFIX, 128)                                                 \
    }

DEFINE_ATTEND_512(f32, float, load16_f32, narrow_f32, 0)
DEFINE_ATTEND_512(bf16, bf16_t, load16_bf16, narrow_bf16, 1)
#define ATTEND_F32 attend_fast_f32
#define ATTEND_BF16 attend_fast_bf16
#define FAST_PATH 1
#else
#define ATTEND_F32 attend_any_f32
#define ATTEND_BF16 attend_any_bf16
#define FAST_PATH 0
#endif

typedef void (*attend_fn)(const step_t *, int64_t, float *);
typedef void (*prologue_fn)(const step_t *, int64_t);

/* Sequences [begin, end), each after its prologue (if any); 0, or -1 without scratch memory (scores, the widened
 * query, the fp32 output, the sums) — before this range's prologues ran (other threads' may have: the caller's own
 * path then writes the same rows again). */
static int attend_range(const step_t *s, attend_fn attend_one, prologue_fn prologue, int64_t begin, int64_t end) {
    int64_t longest = 1;
    for (int64_t i = begin; i < end; i++) longest = s->lengths[i] > longest ? s->lengths[i] : longest;
    /* per query head: the scores, the widened query, the fp32 output, the sum, and the scores by token (attend_rows) */
    float *scores = malloc((((longest + 16) * 2 + 2 * s->dim + 1) * s->q_heads + 16) * sizeof(float));
    if (!scores) return -1;
    for (int64_t i = begin; i < end; i++) {
        if (prologue) prologue(s, i);
        attend_one(s, i, scores);
    }
    free(scores);
    return 0;
}

static int run(attend_fn attend_one, prologue_fn prologue, const step_t step, int64_t batch, int threads) {
    if (step.kv_heads < 1 || step.q_heads % step.kv_heads != 0 || (prologue && step.dim % 2)) return -2;
    const int64_t *lengths = step.lengths;
    for (int64_t i = 0; prologue && i < batch; i++)
        if (lengths[i] < 1) return -2; /* (a prologue writes token lengths[i] - 1) */
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
        status |= attend_range(&step, attend_one, prologue, begin, end);
    }
    return status;
}

int paged_decode_attention(const float *q, const float *k, const float *v, float *out, const int64_t *tables,
                           int64_t table_width, const int64_t *lengths, int64_t batch, int64_t q_heads,
                           int64_t kv_heads, int64_t dim, int64_t block_size, float scale, int threads) {
    const step_t step = {q, k, v, out, tables, lengths, table_width, q_heads, kv_heads, dim, block_size, scale};
    return run(ATTEND_F32, NULL, step, batch, threads);
}

int paged_decode_attention_bf16(const bf16_t *q, const bf16_t *k, const bf16_t *v, bf16_t *out, const int64_t *tables,
                                int64_t table_width, const int64_t *lengths, int64_t batch, int64_t q_heads,
                                int64_t kv_heads, int64_t dim, int64_t block_size, float scale, int threads) {
    const step_t step = {q, k, v, out, tables, lengths, table_width, q_heads, kv_heads, dim, block_size, scale};
    return run(ATTEND_BF16, NULL, step, batch, threads);
}

/* The whole attention of one layer's decode step from its fused q|k|v projection (qkv [batch, q_heads + 2 * kv_heads,
 * dim]) and the rotary cos/sin of each sequence's new position ([batch, dim]): the prologue above (the rotated query
 * into q [batch, q_heads, dim], the new key and value rows into the pool k/v), then attention as above. */
int paged_decode_rope_attention(const float *qkv, const float *cos, const float *sin, float *q, float *k, float *v,
                                float *out, const int64_t *tables, int64_t table_width, const int64_t *lengths,
                                int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                                float scale, int threads) {
    const step_t step = {q,   k,          v,     out, tables, lengths, table_width, q_heads, kv_heads,
                         dim, block_size, scale, qkv, cos,    sin};
    return run(ATTEND_F32, prologue_f32, step, batch, threads);
}

int paged_decode_rope_attention_bf16(const bf16_t *qkv, const bf16_t *cos, const bf16_t *sin, bf16_t *q, bf16_t *k,
                                     bf16_t *v, bf16_t *out, const int64_t *tables, int64_t table_width,
                                     const int64_t *lengths, int64_t batch, int64_t q_heads, int64_t kv_heads,
                                     int64_t dim, int64_t block_size, float scale, int threads) {
    const step_t step = {q,   k,          v,     out, tables, lengths, table_width, q_heads, kv_heads,
                         dim, block_size, scale, qkv, cos,    sin};
    return run(ATTEND_BF16, prologue_bf16, step, batch, threads);
}

/* 1 where this build has the AVX-512 path (head sizes 64 and 128, 1 to 8 query heads per KV head), else 0. */
int paged_decode_attention_fast_path(void) { return FAST_PATH; }
