/* Shared between the reference, the SIMD variants and the dispatcher; not part of the API. */
#ifndef S3D8_INTERNAL_H
#define S3D8_INTERNAL_H

#include "s3d8.h"

/* bf16(absmax / 127) as a float, or 1.0 for absmax 0. */
float s3d8_scale_from_absmax(float absmax);
/* clamp(rint(x / scale), -127, 127); NaN (from a scale that underflowed to 0) gives 0. */
int8_t s3d8_quant_value(float x, float scale);
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
