/* A few rows (a decode step's) times a linear layer's fp32 weight, packed once: out = x · Wᵀ (+ bias).
 *
 * Why: a batched decode step multiplies 1 to 32 rows by every weight of the model, so its GEMMs are as much a
 * stream of weights out of memory as arithmetic, and oneDNN's kernels, shaped for many rows, ran them at about half
 * the machine's FMA rate on the 2-core Xeon (common/model/row_gemm.py has the figures). Here the weight is packed
 * once into panels of 32 output columns, k-major ([panel][k][32]: one 128-byte line pair per k), and each panel is
 * read from memory once per call, while the next panels are prefetched into L2, by up to 14 rows at a time held in
 * 28 AVX-512 accumulators.
 *
 * Exactness: every output element is one chain of fused multiply-adds over k = 0, 1, … K-1 from zero, then the bias
 * added once. That order does not depend on how many rows share the call, how rows are tiled, which columns sit
 * beside it, or how many threads split the panels: a row's product is the same bits in any call this kernel takes
 * (at most 32 rows: a batched decode step computes what each sequence alone would) and a fused q|k|v or gate|up
 * weight gives each projection's own bits. Threads: PyTorch's OpenMP pool (the same libgomp), each taking a contiguous run of panels.
 *
 * A gated MLP's gate|up product can end in its activation (row_gemm_f32_silu_mul): the weight packed so that each
 * panel holds 16 gate columns and the same 16 up columns, each tile stores silu(gate) * up for its 16 columns — no
 * gate|up output, no separate activation pass. silu is PyTorch's own expression, x / (1 + exp(-x)), with exp the very
 * function PyTorch's kernels of the build's width call (SLEEF's, from libtorch: the caller passes it), each op rounded
 * as PyTorch rounds it; the caller checks the bits against PyTorch's before it uses this.
 *
 * Without AVX-512, on a CPU with AVX2 and FMA, the same panels go through 256-bit registers (3 rows a tile, each
 * element the same chain of FMAs: the same bits), and the gated product's exp is the 8-lane one PyTorch's AVX2
 * kernels call (row_gemm_exp_lanes() says which the build takes). With neither, the library builds but
 * row_gemm_fast_path() returns 0 and the caller keeps oneDNN.
 */
#include <stdint.h>

/* The rows of the next tile: what is left, in tiles of near-equal size of at most max rows (the order inside a tile
 * never depends on its size). */
static inline int tile_rows(int64_t left, int max) {
    const int64_t tiles = (left + max - 1) / max;
    return (int)((left + tiles - 1) / tiles);
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#include <omp.h>

#define NR 32 /* output columns per panel: two zmm registers, or four ymm */
#define PF_PANELS 1

/* At input k of a tile, prefetch into L2 the next lpk lines of the later panel pf (pf_bytes long) from byte pf_from
 * on, so that its read from memory overlaps the tile's arithmetic. */
static inline __attribute__((always_inline)) void prefetch_k(const char *pf, int64_t pf_from, int64_t k, int lpk,
                                                             int64_t pf_bytes) {
    if (!pf) return;
    const int64_t line = pf_from + k * lpk * 64; /* (offsets, not pointers, are compared: none formed past the panel) */
    if (line < pf_bytes) _mm_prefetch(pf + line, _MM_HINT_T1);
    if (lpk > 1 && line + 64 < pf_bytes) _mm_prefetch(pf + line + 64, _MM_HINT_T1);
}
#endif

#if defined(__AVX512F__)
#define MR_MAX 14 /* rows per tile: 28 accumulators + 2 weight vectors of the 32 registers */

#define EXP_LANES 16
typedef __m512 (*exp_fn)(__m512); /* 16 lanes' exp (SLEEF's Sleef_expf16_u10, as PyTorch calls it) */

/* silu(g) * u for 16 lanes: g / (1 + exp(-g)) (PyTorch's silu, op by op), then times u. */
static inline __m512 silu_mul(__m512 g, __m512 u, exp_fn exp16) {
    /* (-g as a sign flip, as PyTorch's neg(); in integer lanes: the float xor is AVX-512DQ, the rest needs only F) */
    const __m512i minus = _mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32(INT32_MIN));
    const __m512 e = exp16(_mm512_castsi512_ps(minus));
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)), u);
}

/* One tile of mr rows against one panel. pf: a later panel (pf_bytes long) whose lines from byte pf_from on this tile
 * prefetches into L2, lpk per k, so that its read from memory overlaps this tile's arithmetic. Inlined with mr a
 * constant, so the accumulators stay in registers. With exp16, the panel is 16 gate and 16 up columns and the tile
 * stores silu(gate) * up: 16 columns a row (full panels only). */
static inline __attribute__((always_inline)) void tile(int mr, int64_t K, const float *x, int64_t ldx,
                                                       const float *panel, float *out, int64_t ldo, const float *bias,
                                                       __mmask16 m0, __mmask16 m1, const char *pf, int64_t pf_from,
                                                       int lpk, int64_t pf_bytes, exp_fn exp16) {
    __m512 acc[MR_MAX][2];
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m512 w0 = _mm512_loadu_ps(panel + k * NR), w1 = _mm512_loadu_ps(panel + k * NR + 16);
        prefetch_k(pf, pf_from, k, lpk, pf_bytes);
        for (int r = 0; r < mr; r++) {
            const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
            acc[r][0] = _mm512_fmadd_ps(a, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(a, w1, acc[r][1]);
        }
    }
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
    if (exp16) {
        for (int r = 0; r < mr; r++) {
            const __m512 g = bias ? _mm512_add_ps(acc[r][0], b0) : acc[r][0];
            _mm512_storeu_ps(out + r * ldo, silu_mul(g, bias ? _mm512_add_ps(acc[r][1], b1) : acc[r][1], exp16));
        }
        return;
    }
    for (int r = 0; r < mr; r++) {
        /* (the bias added after the whole sum, as F.linear's epilogue does; no bias: the sum as it is) */
        _mm512_mask_storeu_ps(out + r * ldo, m0, bias ? _mm512_add_ps(acc[r][0], b0) : acc[r][0]);
        _mm512_mask_storeu_ps(out + r * ldo + 16, m1, bias ? _mm512_add_ps(acc[r][1], b1) : acc[r][1]);
    }
}

/* Every row against one panel, in tiles of near-equal size (the order inside a tile never depends on its size). With
 * exp16, out is [M, N / 2] and the panel's 16 activations land at col / 2. */
static void panel_rows(int64_t M, int64_t N, int64_t K, const float *x, const float *panel, float *out,
                       const float *bias, int64_t col, const char *pf, exp_fn exp16) {
    const int64_t cols = N - col < NR ? N - col : NR;
    const __mmask16 m0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
    const __mmask16 m1 = cols <= 16 ? 0 : cols >= 32 ? 0xFFFF : (__mmask16)((1u << (cols - 16)) - 1);
    const int lpk = M <= MR_MAX ? 2 : 1; /* (one tile prefetches a panel's 2·K lines, several share them) */
    const int64_t pf_bytes = K * NR * (int64_t)sizeof(float);
    int t = 0;
    for (int64_t m = 0; m < M; t++) {
        const int mr = tile_rows(M - m, MR_MAX);
        const int64_t pf_from = (int64_t)t * K * lpk * 64;
        const float *b = bias ? bias + col : 0;
        const int64_t ldo = exp16 ? N / 2 : N;
        float *o = out + m * ldo + (exp16 ? col / 2 : col);
        /* (exp16 a constant 0 in the plain tiles: their code is the plain GEMM's, with no activation branch) */
#define TILE(R, E) \
    case R: tile(R, K, x + m * K, K, panel, o, ldo, b, m0, m1, pf, pf_from, lpk, pf_bytes, E); break;
#define TILES(E) \
    switch (mr) { \
        TILE(1, E) TILE(2, E) TILE(3, E) TILE(4, E) TILE(5, E) TILE(6, E) TILE(7, E) \
        TILE(8, E) TILE(9, E) TILE(10, E) TILE(11, E) TILE(12, E) TILE(13, E) TILE(14, E) \
    }
        if (exp16) {
            TILES(exp16)
        } else {
            TILES((exp_fn)0)
        }
#undef TILES
#undef TILE
        m += mr;
    }
}

#define ROW_GEMM_SIMD 1

#elif defined(__AVX2__) && defined(__FMA__)
/* The same panels, the same order of every sum, in 256-bit registers: a row's product is the bits the AVX-512 path
 * gives (each FMA rounds once either way). 16 registers: 3 rows of 4 accumulators, 3 broadcast inputs and a weight
 * vector. The gated product takes the exp PyTorch's AVX2 silu calls: SLEEF's 8-lane Sleef_expf8_u10. */
#define MR_MAX 3
#define EXP_LANES 8

typedef __m256 (*exp_fn)(__m256); /* 8 lanes' exp (SLEEF's Sleef_expf8_u10, as PyTorch's AVX2 kernels call it) */

/* silu(g) * u for 8 lanes: g / (1 + exp(-g)) (PyTorch's silu, op by op: neg() is a sign flip), then times u. */
static inline __m256 silu_mul(__m256 g, __m256 u, exp_fn exp8) {
    const __m256 e = exp8(_mm256_xor_ps(g, _mm256_set1_ps(-0.f)));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)), u);
}

static inline __attribute__((always_inline)) void tile(int mr, int64_t K, const float *x, int64_t ldx,
                                                       const float *panel, float *out, int64_t ldo, const float *bias,
                                                       const __m256i *masks, int64_t cols, const char *pf,
                                                       int64_t pf_from, int lpk, int64_t pf_bytes, exp_fn exp8) {
    __m256 acc[MR_MAX][4];
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        prefetch_k(pf, pf_from, k, lpk, pf_bytes);
        __m256 a[MR_MAX];
        for (int r = 0; r < mr; r++) a[r] = _mm256_broadcast_ss(x + r * ldx + k);
        for (int j = 0; j < 4; j++) {
            const __m256 w = _mm256_loadu_ps(panel + k * NR + 8 * j);
            for (int r = 0; r < mr; r++) acc[r][j] = _mm256_fmadd_ps(a[r], w, acc[r][j]);
        }
    }
    if (exp8) { /* (a full panel: groups 0-1 are 16 gate columns, 2-3 the same 16 up columns) */
        /* The sums go to the stack before the first exp call: every vector register is the callee's to clobber, so a
         * sum still in a register across a call would be kept in memory for the whole K loop above (measured: the
         * gated product at 32 rows 40 % slower than the plain one). */
        float sums[MR_MAX][NR];
        for (int r = 0; r < mr; r++)
            for (int j = 0; j < 4; j++) {
                const __m256 v = bias ? _mm256_add_ps(acc[r][j], _mm256_loadu_ps(bias + 8 * j)) : acc[r][j];
                _mm256_storeu_ps(sums[r] + 8 * j, v);
            }
        for (int r = 0; r < mr; r++)
            for (int j = 0; j < 2; j++) {
                const __m256 g = _mm256_loadu_ps(sums[r] + 8 * j), u = _mm256_loadu_ps(sums[r] + 16 + 8 * j);
                _mm256_storeu_ps(out + r * ldo + 8 * j, silu_mul(g, u, exp8));
            }
        return;
    }
    for (int j = 0; j < 4; j++) { /* (a constant trip count: unrolled, so the accumulators stay in registers) */
        if (8 * j >= cols) continue; /* (no pointer formed past a partial panel's last group) */
        /* (the bias added after the whole sum, as F.linear's epilogue does; no bias: the sum as it is) */
        const int whole = 8 * j + 8 <= cols; /* (masked stores only where the group is partial: slower on Zen 2) */
        __m256 b = _mm256_setzero_ps();
        if (bias) b = whole ? _mm256_loadu_ps(bias + 8 * j) : _mm256_maskload_ps(bias + 8 * j, masks[j]);
        for (int r = 0; r < mr; r++) {
            const __m256 v = bias ? _mm256_add_ps(acc[r][j], b) : acc[r][j];
            if (whole)
                _mm256_storeu_ps(out + r * ldo + 8 * j, v);
            else
                _mm256_maskstore_ps(out + r * ldo + 8 * j, masks[j], v);
        }
    }
}

static void panel_rows(int64_t M, int64_t N, int64_t K, const float *x, const float *panel, float *out,
                       const float *bias, int64_t col, const char *pf, exp_fn exp8) {
    const int64_t cols = N - col < NR ? N - col : NR;
    __m256i masks[4];
    for (int j = 0; j < 4; j++) { /* (lane l of group j is stored where 8j + l < cols) */
        const __m256i lane = _mm256_add_epi32(_mm256_set1_epi32(8 * j), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        masks[j] = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)cols), lane);
    }
    const int lpk = M <= MR_MAX ? 2 : 1; /* (one tile prefetches a panel's 2·K lines, several share them) */
    const int64_t pf_bytes = K * NR * (int64_t)sizeof(float);
    int t = 0;
    for (int64_t m = 0; m < M; t++) {
        const int mr = tile_rows(M - m, MR_MAX);
        const int64_t pf_from = (int64_t)t * K * lpk * 64;
        const float *b = bias ? bias + col : 0;
        const int64_t ldo = exp8 ? N / 2 : N;
        float *o = out + m * ldo + (exp8 ? col / 2 : col);
        /* (exp8 a constant 0 in the plain tiles: their code is the plain GEMM's, with no activation branch) */
#define TILE(R, E) \
    case R: tile(R, K, x + m * K, K, panel, o, ldo, b, masks, cols, pf, pf_from, lpk, pf_bytes, E); break;
        if (exp8) {
            switch (mr) { TILE(1, exp8) TILE(2, exp8) TILE(3, exp8) }
        } else {
            switch (mr) { TILE(1, (exp_fn)0) TILE(2, (exp_fn)0) TILE(3, (exp_fn)0) }
        }
#undef TILE
        m += mr;
    }
}

#define ROW_GEMM_SIMD 1
#endif

#if defined(ROW_GEMM_SIMD)

/* Every panel, split over the threads in contiguous runs (see the top of the file). */
static int run_panels(const float *x, const float *packed, const float *bias, float *out, int64_t M, int64_t N,
                      int64_t K, int threads, exp_fn exp) {
    if (M < 0 || N < 0 || K <= 0) return 1; /* (no inputs: the caller's other path gives the bias) */
    if (M == 0 || N == 0) return 0;
    const int64_t panels = (N + NR - 1) / NR;
    if (threads < 1) threads = 1;
    if (threads > panels) threads = (int)panels;
#pragma omp parallel num_threads(threads)
    {
        const int64_t n = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t lo = panels * t / n, hi = panels * (t + 1) / n;
        for (int64_t p = lo; p < hi; p++) {
            const char *pf = p + PF_PANELS < hi ? (const char *)(packed + (p + PF_PANELS) * K * NR) : 0;
            panel_rows(M, N, K, x, packed + p * K * NR, out, bias, p * NR, pf, exp);
        }
    }
    return 0;
}

int row_gemm_fast_path(void) { return 1; }

/* The lanes of the exp row_gemm_f32_silu_mul takes: 16 (SLEEF's Sleef_expf16_u10) or 8 (Sleef_expf8_u10). */
int row_gemm_exp_lanes(void) { return EXP_LANES; }

/* x [M, K] row-major, packed [ceil(N/32)][K][32] (columns past N zero), bias [N] or NULL, out [M, N]. */
int row_gemm_f32(const float *x, const float *packed, const float *bias, float *out, int64_t M, int64_t N,
                 int64_t K, int threads) {
    return run_panels(x, packed, bias, out, M, N, K, threads, 0);
}

/* As row_gemm_f32 on a gate|up weight packed 16 gate and 16 up columns to a panel (N a multiple of 32; bias in the
 * same order), storing silu(gate) * up: out [M, N / 2]. exp: SLEEF's exp of row_gemm_exp_lanes() lanes. */
int row_gemm_f32_silu_mul(const float *x, const float *packed, const float *bias, float *out, int64_t M, int64_t N,
                          int64_t K, int threads, exp_fn exp) {
    if (!exp || N % NR) return 1;
    return run_panels(x, packed, bias, out, M, N, K, threads, exp);
}

#else

int row_gemm_fast_path(void) { return 0; }

int row_gemm_exp_lanes(void) { return 0; }

int row_gemm_f32(const float *x, const float *packed, const float *bias, float *out, int64_t M, int64_t N,
                 int64_t K, int threads) {
    (void)x, (void)packed, (void)bias, (void)out, (void)M, (void)N, (void)K, (void)threads;
    return 1;
}

int row_gemm_f32_silu_mul(const float *x, const float *packed, const float *bias, float *out, int64_t M, int64_t N,
                          int64_t K, int threads, void *exp) {
    (void)x, (void)packed, (void)bias, (void)out, (void)M, (void)N, (void)K, (void)threads, (void)exp;
    return 1;
}

#endif
