/* The decode step's residual adds and RMSNorms (common/kv/native/norm.py), rounded as PyTorch rounds them, op by op.
 *
 * transformers' LlamaRMSNorm / Qwen2VLRMSNorm of a row x (widened to fp32 in bf16) is
 *     weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)
 * which PyTorch runs as seven ops: x*x, a sum over the row, a division by its length, the eps added, 1/sqrt, the
 * multiply, the weight's multiply (each rounded to fp32, the last two to bf16 in bf16). Every op but the sum is one
 * IEEE operation per element, the same in C; the sum is PyTorch's CPU sum of a contiguous row (ATen's SumKernel.cpp:
 * vectorized_inner_sum → row_sum → multi_row_sum): vectors of W lanes summed in 4 interleaved accumulators with a
 * 4-level cascade, the 4 combined, the row's scalar tail summed, then the lanes one by one. W is the vector width of
 * the ATen kernels this process runs (16 with AVX-512, 8 with AVX2, 4 with 128-bit vectors): the caller tries each
 * against PyTorch once and uses the one that agrees bit for bit, or none. Built without fast-math and without fused
 * multiply-adds (common/native_build.py's EXACT): the compiler may neither reorder the sums nor turn a division into a
 * reciprocal.
 *
 * rms_norm_*: rows of h (with `add` not NULL, h + add first, written to `sum`: the residual stream) normed into out,
 * on up to `threads` threads. Returns 0; -1 without scratch memory (some rows may then be unwritten: the caller
 * computes them all again), -2 for a width it does not take (nothing is written then).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

enum { ILP = 4, LEVELS = 4, MAX_LANES = 16 };

/* c10's CeilLog2: 1 for x <= 2, else the bit length of x - 1. */
static int64_t ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    int64_t bits = 0;
    for (uint64_t v = (uint64_t)(x - 1); v; v >>= 1) bits++;
    return bits;
}

/* The sum of sq[0, n) in PyTorch's order for vectors of `lanes` lanes (see the top of the file). */
static float torch_row_sum(const float *restrict sq, int64_t n, int64_t lanes) {
    float acc[LEVELS][ILP][MAX_LANES];
    memset(acc, 0, sizeof acc);
    const int64_t vectors = n / lanes, size = vectors / ILP;
    int64_t power = ceil_log2(size) / LEVELS;
    power = power < 4 ? 4 : power;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    int64_t i = 0;
    while (i + step <= size) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int64_t k = 0; k < ILP; k++)
                for (int64_t l = 0; l < lanes; l++) acc[0][k][l] += sq[(i * ILP + k) * lanes + l];
        for (int64_t j = 1; j < LEVELS; j++) {
            for (int64_t k = 0; k < ILP; k++)
                for (int64_t l = 0; l < lanes; l++) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.f;
                }
            if ((i & (mask << (j * power))) != 0) break;
        }
    }
    for (; i < size; i++)
        for (int64_t k = 0; k < ILP; k++)
            for (int64_t l = 0; l < lanes; l++) acc[0][k][l] += sq[(i * ILP + k) * lanes + l];
    for (int64_t j = 1; j < LEVELS; j++)
        for (int64_t k = 0; k < ILP; k++)
            for (int64_t l = 0; l < lanes; l++) acc[0][k][l] += acc[j][k][l];
    for (int64_t v = size * ILP; v < vectors; v++)
        for (int64_t l = 0; l < lanes; l++) acc[0][0][l] += sq[v * lanes + l];
    for (int64_t k = 1; k < ILP; k++)
        for (int64_t l = 0; l < lanes; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0.f;
    for (int64_t t = vectors * lanes; t < n; t++) total += sq[t];
    for (int64_t l = 0; l < lanes; l++) total += acc[0][0][l];
    return total;
}

/* One element type: T, and WIDEN/NARROW to and from fp32 (identity in fp32). The rows are split over `threads` OpenMP
 * threads (PyTorch's pool, as the attention kernel's), each with its own scratch of 2n floats: a row's bits do not
 * depend on which thread takes it. Why threads for a few rows: a decode step's rows arrive from a GEMM whose columns
 * both cores wrote, so a row's read is half misses to the other core's cache — one thread took ~38 us a norm of a
 * batch-32 step where the same rows hot in its cache take 10. */
#define DEFINE_RMS_NORM(SUFFIX, T, WIDEN, NARROW)                                                                      \
    static void rows_##SUFFIX(const T *h, const T *add, T *sum, const T *weight, T *out, int64_t lo, int64_t hi,      \
                              int64_t n, float eps, int64_t lanes, float *restrict x, float *restrict sq) {          \
        for (int64_t r = lo; r < hi; r++) {                                                                          \
            const T *row = h + r * n;                                                                                \
            if (add) {                                                                                               \
                for (int64_t j = 0; j < n; j++) sum[r * n + j] = NARROW(WIDEN(row[j]) + WIDEN(add[r * n + j]));       \
                row = sum + r * n;                                                                                   \
            }                                                                                                        \
            for (int64_t j = 0; j < n; j++) {                                                                        \
                x[j] = WIDEN(row[j]);                                                                                \
                sq[j] = x[j] * x[j];                                                                                 \
            }                                                                                                        \
            const float scale = 1.f / sqrtf(torch_row_sum(sq, n, lanes) / (float)n + eps);                           \
            for (int64_t j = 0; j < n; j++) out[r * n + j] = NARROW(WIDEN(weight[j]) * WIDEN(NARROW(x[j] * scale))); \
        }                                                                                                            \
    }                                                                                                                \
                                                                                                                     \
    int rms_norm_##SUFFIX(const T *h, const T *add, T *sum, const T *weight, T *out, int64_t rows, int64_t n,        \
                          float eps, int64_t lanes, int threads) {                                                   \
        if (lanes < 1 || lanes > MAX_LANES || n < 1) return -2;                                                      \
        if (threads > rows) threads = (int)rows;                                                                     \
        if (threads < 1) threads = 1;                                                                                \
        int status = 0;                                                                                              \
        _Pragma("omp parallel num_threads(threads) reduction(| : status)") {                                         \
            const int64_t t = omp_get_thread_num(), k = omp_get_num_threads();                                       \
            float *scratch = malloc(2 * n * sizeof(float));                                                          \
            if (scratch)                                                                                             \
                rows_##SUFFIX(h, add, sum, weight, out, rows * t / k, rows * (t + 1) / k, n, eps, lanes, scratch,    \
                              scratch + n);                                                                          \
            else                                                                                                     \
                status = 1;                                                                                          \
            free(scratch);                                                                                           \
        }                                                                                                            \
        return status ? -1 : 0;                                                                                      \
    }

DEFINE_RMS_NORM(f32, float, widen_f32, narrow_f32)
DEFINE_RMS_NORM(bf16, bf16_t, widen_bf16, narrow_bf16)
