/* Token bitmasks applied to a batch's logits rows in one call (common/grammar/masks.py).
 *
 * A mask row is llguidance's bitmask: one bit per token id, 32 per word, bit j of word w for token 32 w + j; a 0 bit
 * refuses the token. Each refused logit is overwritten with the caller's "refused" bit pattern (the dtype's value of
 * REFUSED, computed by PyTorch); an allowed one keeps its bits exactly (a mixed word may store it back unchanged).
 * Logits are handled as raw 32- or 16-bit patterns: no arithmetic, so fp32, bf16 and fp16 rows all take the same two
 * loops. A word of all ones (inside a JSON string: nearly every token allowed) is skipped; a word of zeros (between
 * values: nearly every token refused) is one store of 32 patterns; only mixed words look at their bits. Tokens past
 * the vocabulary (the last word's padding bits) are never touched.
 *
 * Rows are split over OpenMP threads (PyTorch's own pool: the caller passes torch.get_num_threads()); a row's result
 * does not depend on the thread that writes it.
 */
#include <stdint.h>

#define APPLY(NAME, T)                                                                                               \
    static void NAME##_row(T *logits, const uint32_t *mask, int64_t vocab, T refused) {                           \
        const int64_t whole = vocab / 32;                                                                            \
        for (int64_t w = 0; w < whole; w++) {                                                                        \
            const uint32_t bits = mask[w];                                                                           \
            T *p = logits + 32 * w;                                                                                  \
            if (bits == 0xffffffffu) continue;                                                                       \
            if (bits == 0) {                                                                                         \
                for (int j = 0; j < 32; j++) p[j] = refused;                                                         \
                continue;                                                                                            \
            }                                                                                                        \
            for (int j = 0; j < 32; j++) p[j] = ((bits >> j) & 1u) ? p[j] : refused;                                \
        }                                                                                                            \
        const uint32_t bits = whole * 32 < vocab ? mask[whole] : 0xffffffffu;                                        \
        for (int64_t t = whole * 32; t < vocab; t++)                                                                 \
            if (!((bits >> (t - whole * 32)) & 1u)) logits[t] = refused;                                            \
    }                                                                                                                \
                                                                                                                     \
    void NAME(T *logits, int64_t row_stride, const int64_t *rows, int64_t n_rows, const uint32_t *masks,           \
              int64_t words, int64_t vocab, T refused, int threads) {                                                \
        if (threads > n_rows) threads = (int)n_rows;                                                                 \
        if (threads < 1) threads = 1;                                                                                \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                                           \
        for (int64_t i = 0; i < n_rows; i++)                                                                         \
            NAME##_row(logits + rows[i] * row_stride, masks + i * words, vocab, refused);                            \
    }

APPLY(apply_masks_32, uint32_t)
APPLY(apply_masks_16, uint16_t)
