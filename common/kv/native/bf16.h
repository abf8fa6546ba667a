/* bf16 for Prism's C sources: the high half of an fp32. Widening is exact; narrowing rounds to nearest even, as
 * PyTorch rounds an fp32 result to bf16, and keeps a NaN a NaN. The fp32 pair is the identity, so one macro-generated
 * function serves both element types. (common/native_build.py's cache key holds this header too: a change here
 * rebuilds.)
 */
#ifndef PRISM_BF16_H
#define PRISM_BF16_H

#include <stdint.h>

typedef uint16_t bf16_t;

static inline float widen_f32(float x) { return x; }
static inline float narrow_f32(float x) { return x; }
static inline float widen_bf16(bf16_t x) {
    union { uint32_t u; float f; } c = {.u = (uint32_t)x << 16};
    return c.f;
}
static inline bf16_t narrow_bf16(float x) {
    union { float f; uint32_t u; } c = {.f = x};
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((c.u >> 16) | 0x40u); /* NaN stays NaN */
    return (bf16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);                 /* round to nearest even */
}

#endif
