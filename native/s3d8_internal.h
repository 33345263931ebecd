/* Shared between the reference, the SIMD variants and the dispatcher; not part of the API. */
#ifndef S3D8_INTERNAL_H
#define S3D8_INTERNAL_H

#include "s3d8.h"

/* bf16(absmax / 127) as a float, or 1.0 for absmax 0. */
float s3d8_scale_from_absmax(float absmax);
/* clamp(rint(x / scale), -127, 127); NaN (from a scale that underflowed to 0) gives 0. */
int8_t s3d8_quant_value(float x, float scale);
/* The canonical quiet NaN, 0x7FC00000 (the bits every variant writes for non-finite input). */
static inline float s3d8_nan(void) {
    union { uint32_t u; float f; } v = {0x7FC00000u};
    return v.f;
}
/* Bits of |x| as an unsigned integer: ordered like |x| for finite values, and at least
 * S3D8_ABS_NONFINITE for +-Inf and NaN, so an integer max over a row finds both the absmax and
 * any non-finite value (a float max would drop NaN). */
#define S3D8_ABS_NONFINITE 0x7F800000u
static inline uint32_t s3d8_abs_bits(float x) {
    union { float f; uint32_t u; } v = {x};
    return v.u & 0x7FFFFFFFu;
}
static inline float s3d8_f32_from_bits(uint32_t u) {
    union { uint32_t u; float f; } v = {u};
    return v.f;
}
/* A channel scale as used by every epilogue: the bf16 value, or NaN when it is +-Inf or NaN. */
static inline float s3d8_w_scale_f32(uint16_t b) {
    return (b & 0x7F80u) == 0x7F80u ? s3d8_nan() : s3d8_f32_from_bits((uint32_t)b << 16);
}
/* The quantised form of a row holding NaN or +-Inf: zeros, x_scale = NaN, x_sum = 0. */
void s3d8_quant_row_nonfinite(int8_t *xq, size_t xq_len, float *x_scale, int32_t *x_sum);
/* One activation row, reference arithmetic; zeros xq[k .. xq_len). SIMD variants use it for rows
 * whose scale underflowed to 0, where their fast path would differ. */
void s3d8_quant_row_ref(size_t k, const float *x, int8_t *xq, size_t xq_len, float *x_scale,
                        int32_t *x_sum);

extern const s3d8_variant s3d8_variant_ref;
#if defined(__x86_64__) || defined(_M_X64)
extern const s3d8_variant s3d8_variant_avx2;
extern const s3d8_variant s3d8_variant_avx512;
#endif
#if defined(__aarch64__)
extern const s3d8_variant s3d8_variant_neon;
extern const s3d8_variant s3d8_variant_neon_i8mm;
#endif

#endif
