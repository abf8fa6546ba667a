/* The row-order loops of the decode attention's AVX-512 path (paged_decode_attention.c): one sequence's keys and
 * values read row by row, in address order, for the head counts where that is faster than the head-by-head loops
 * (attend512_*).
 *
 * Not a standalone header: paged_decode_attention.c includes it inside its AVX-512 section, after the helpers these
 * loops use (step_t, softmax_rows, load16_*, narrow_*, reduce16), and calls attend_rows_* through ATTEND_ROWS and
 * attend_rows_any_* from attend_fast_*. Kept apart so that each file holds one way of reading the KV; the build hashes
 * every header beside the source (common/native_build.py), so a change here rebuilds the kernel. */

/* The row-order loops' scores (token-major: by_token[t * Q + h]) turned head-major into `scores` ([Q][n]) and made
 * the values' weights there (softmax_rows). */
static inline __attribute__((always_inline)) void softmax_by_token(const float *restrict by_token,
                                                                   float *restrict scores, int64_t Q, int64_t n,
                                                                   float *restrict sums, int late) {
    for (int64_t t = 0; t < n; t++)
        for (int64_t h = 0; h < Q; h++) scores[h * n + t] = by_token[t * Q + h];
    softmax_rows(scores, Q, n, sums, late);
}

/* One sequence read row by row in address order (the path for Q query heads dividing 16): every token's whole key
 * row, then, after the softmax, every token's whole value row, each as one ascending run of cache lines. Why: on
 * an AMD EPYC (Zen 4) the hardware prefetcher keeps up with a run that ascends line by line (a plain read of a batch-32
 * step's KV: 27 GB/s on one core), but not with the head-by-head order attend512_* reads a block in (a KV head's
 * 256 bytes of each row, then the next head's: 9 GB/s on one core), and software prefetches did not close the gap.
 * A batch-32 step's attention, prism-small-llava in fp32 on 2 threads: 9.7 -> 6.4 ms; the same bits out.
 * Scores: the (token, query head) pairs are taken in row order, 16 at a time (16 / Q tokens), each dot product left
 * as 16 partial sums and the 16 reduced together (reduce16), as attend512_* does; they land token-major and are turned
 * head-major for the softmax. Values: each token's weights (one per query head) scale its row into the fp32 sums of
 * every query head (o[Q][C]: kept in registers where they fit, else the compiler keeps them in L1). Every sum adds
 * the same terms in the same order as attend512_*: the outputs are theirs bit for bit (tested). */
#define DEFINE_ATTEND_ROWS(SUFFIX, T, LOAD, NARROW, LATE)                                                              \
    static inline __attribute__((always_inline)) void attend_rows_##SUFFIX(const step_t *s, int64_t i,                 \
                                                                           float *restrict scores, const int64_t D,    \
                                                                           const int64_t Q) {                          \
        const int64_t bs = s->block_size, group = Q / s->kv_heads, row = s->kv_heads * D, C = D / 16, TP = 16 / Q;     \
        const int64_t n = s->lengths[i];                                                                               \
        const int64_t *table = s->tables + i * s->table_width;                                                         \
        const T *restrict qin = (const T *)s->q + i * Q * D;                                                           \
        T *restrict out = (T *)s->out + i * Q * D;                                                                     \
        float *restrict qf = scores + Q * n, *restrict acc = qf + Q * D, *restrict sums = acc + Q * D;                 \
        float *restrict by_token = sums + Q; /* (n rounded up to TP tokens) x Q scores */                              \
        int64_t head[16]; /* where query head h's KV head starts in a row */                                           \
        for (int64_t h = 0; h < Q; h++) head[h] = (h / group) * D;                                                     \
        for (int64_t j = 0; j < Q * D; j += 16) _mm512_storeu_ps(qf + j, LOAD(qin + j));                               \
        for (int64_t t0 = 0; t0 < n; t0 += TP) {                                                                       \
            __m512 part[16];                                                                                           \
            for (int64_t u = 0; u < TP; u++) {                                                                         \
                const int64_t t = t0 + u;                                                                              \
                const T *restrict r = (const T *)s->k + (table[t / bs] * bs + t % bs) * row;                           \
                for (int64_t h = 0; h < Q; h++) {                                                                      \
                    if (t >= n) {                                                                                      \
                        part[u * Q + h] = _mm512_setzero_ps();                                                         \
                        continue;                                                                                      \
                    }                                                                                                  \
                    const float *restrict qh = qf + h * D;                                                             \
                    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qh), LOAD(r + head[h]));                                  \
                    for (int64_t c = 1; c < C; c++)                                                                    \
                        a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), LOAD(r + head[h] + 16 * c), a);              \
                    part[u * Q + h] = a;                                                                               \
                }                                                                                                      \
            }                                                                                                          \
            _mm512_storeu_ps(by_token + t0 * Q, _mm512_mul_ps(reduce16(part), _mm512_set1_ps(s->scale)));              \
        }                                                                                                              \
        softmax_by_token(by_token, scores, Q, n, sums, LATE);                                                          \
        __m512 o[16][8];                                                                                               \
        for (int64_t h = 0; h < Q; h++)                                                                                \
            for (int64_t c = 0; c < C; c++) o[h][c] = _mm512_setzero_ps();                                             \
        for (int64_t t = 0; t < n; t++) {                                                                              \
            const T *restrict r = (const T *)s->v + (table[t / bs] * bs + t % bs) * row;                               \
            for (int64_t h = 0; h < Q; h++) {                                                                          \
                const __m512 w = _mm512_set1_ps(scores[h * n + t]);                                                    \
                for (int64_t c = 0; c < C; c++) o[h][c] = _mm512_fmadd_ps(w, LOAD(r + head[h] + 16 * c), o[h][c]);     \
            }                                                                                                          \
        }                                                                                                              \
        for (int64_t h = 0; h < Q; h++)                                                                                \
            for (int64_t c = 0; c < C; c++) _mm512_storeu_ps(acc + h * D + 16 * c, o[h][c]);                           \
        for (int64_t j = 0; j < Q * D; j++) out[j] = NARROW(LATE ? acc[j] / sums[j / D] : acc[j]);                     \
    }

DEFINE_ATTEND_ROWS(f32, float, load16_f32, narrow_f32, 0)
DEFINE_ATTEND_ROWS(bf16, bf16_t, load16_bf16, narrow_bf16, 1)

/* The row-order loops for a number of query heads Q that does not divide 16: the (token, head) pairs in row order, 16
 * to a reduction, a reduction's pairs spanning tokens as they fall (its 16 scores land at their token-major places,
 * contiguous); the value sums kept in `acc` (L1) rather than registers. Taken for Q below 16, where it was measured
 * faster than the head-by-head loops (the kernel alone over cold KV, 2 threads, AMD EPYC, same bits): 6 heads of 64
 * over 2 KV heads 4.25 -> 3.31 ms, 12 of 128 over 2 5.81 -> 3.90, 14 of 128 over 2 6.76 -> 5.58 (bf16, 12 over 2: 3.44
 * -> 3.38). Above 16 its value sums, one load and store each per row, cost more than the order saves: 28 over 4
 * 2.30 -> 2.43 ms, 32 over 8 3.08 -> 3.78, 32 over 32 2.47 -> 2.37; those keep the head-by-head loops. Where Q
 * divides 16, attend_rows_* (Q a constant: the sums in registers where they fit, the pairs' places known) is faster
 * still: 8 heads of 64 over 4, fp32, 5.4-5.6 ms against 6.0-6.4 for these loops (bf16 4.0 against 4.0). */
#define DEFINE_ATTEND_ROWS_ANY(SUFFIX, T, LOAD, NARROW, LATE)                                                          \
    static inline __attribute__((always_inline)) void attend_rows_any_##SUFFIX(const step_t *s, int64_t i,             \
                                                                               float *restrict scores,                 \
                                                                               const int64_t D) {                      \
        const int64_t bs = s->block_size, Q = s->q_heads, group = Q / s->kv_heads, row = s->kv_heads * D, C = D / 16;  \
        const int64_t n = s->lengths[i], pairs = n * Q;                                                                \
        const int64_t *table = s->tables + i * s->table_width;                                                         \
        const T *restrict qin = (const T *)s->q + i * Q * D;                                                           \
        T *restrict out = (T *)s->out + i * Q * D;                                                                     \
        float *restrict qf = scores + Q * n, *restrict acc = qf + Q * D, *restrict sums = acc + Q * D;                 \
        float *restrict by_token = sums + Q; /* (n * Q rounded up to 16) scores */                                     \
        for (int64_t j = 0; j < Q * D; j += 16) _mm512_storeu_ps(qf + j, LOAD(qin + j));                               \
        /* the next pair: token t, query head h (its KV head at k_off, read by `group` heads: h is the in_group-th) */ \
        int64_t t = 0, h = 0, k_off = 0, in_group = 0;                                                                 \
        const T *restrict r = (const T *)s->k + table[0] * bs * row;                                                   \
        for (int64_t p0 = 0; p0 < pairs; p0 += 16) {                                                                   \
            __m512 part[16];                                                                                           \
            for (int64_t u = 0; u < 16; u++) {                                                                         \
                if (p0 + u >= pairs) {                                                                                 \
                    part[u] = _mm512_setzero_ps();                                                                     \
                    continue;                                                                                          \
                }                                                                                                      \
                const float *restrict qh = qf + h * D;                                                                 \
                __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qh), LOAD(r + k_off));                                        \
                for (int64_t c = 1; c < C; c++)                                                                        \
                    a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), LOAD(r + k_off + 16 * c), a);                    \
                part[u] = a;                                                                                           \
                if (++in_group == group) in_group = 0, k_off += D;                                                     \
                if (++h == Q && ++t < n) {                                                                             \
                    h = 0, k_off = 0;                                                                                  \
                    r = (const T *)s->k + (table[t / bs] * bs + t % bs) * row;                                         \
                }                                                                                                      \
            }                                                                                                          \
            _mm512_storeu_ps(by_token + p0, _mm512_mul_ps(reduce16(part), _mm512_set1_ps(s->scale)));                  \
        }                                                                                                              \
        softmax_by_token(by_token, scores, Q, n, sums, LATE);                                                          \
        memset(acc, 0, Q * D * sizeof(float));                                                                         \
        for (int64_t tt = 0; tt < n; tt++) {                                                                           \
            const T *restrict vr = (const T *)s->v + (table[tt / bs] * bs + tt % bs) * row;                            \
            for (int64_t hh = 0; hh < Q; hh++) {                                                                       \
                const __m512 w = _mm512_set1_ps(scores[hh * n + tt]);                                                  \
                const T *restrict vh = vr + (hh / group) * D;                                                          \
                float *restrict o = acc + hh * D;                                                                      \
                for (int64_t c = 0; c < C; c++)                                                                        \
                    _mm512_storeu_ps(o + 16 * c, _mm512_fmadd_ps(w, LOAD(vh + 16 * c), _mm512_loadu_ps(o + 16 * c)));  \
            }                                                                                                          \
        }                                                                                                              \
        for (int64_t j = 0; j < Q * D; j++) out[j] = NARROW(LATE ? acc[j] / sums[j / D] : acc[j]);                     \
    }

DEFINE_ATTEND_ROWS_ANY(f32, float, load16_f32, narrow_f32, 0)
DEFINE_ATTEND_ROWS_ANY(bf16, bf16_t, load16_bf16, narrow_bf16, 1)

#ifndef ROW_ORDER /* (built with -DROW_ORDER=0, only the head-by-head loops run: the tests compare the two) */
#define ROW_ORDER 1
#endif

/* One call of attend_rows with the head size D and Q query heads (a divisor of 16) as constants. */
#define ATTEND_ROWS(SUFFIX, D)                                                                                        \
    switch (s->q_heads) {                                                                                             \
    case 1: attend_rows_##SUFFIX(s, i, scores, D, 1); break;                                                          \
    case 2: attend_rows_##SUFFIX(s, i, scores, D, 2); break;                                                          \
    case 4: attend_rows_##SUFFIX(s, i, scores, D, 4); break;                                                          \
    case 8: attend_rows_##SUFFIX(s, i, scores, D, 8); break;                                                          \
    default: attend_rows_##SUFFIX(s, i, scores, D, 16);                                                               \
    }
