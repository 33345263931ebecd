/* Scalar reference: the definition of S3D8 numerics (SPEC sections 1 and 2). Plain C11, no SIMD.
 * Compile with -ffp-contract=off: the float expressions below are the contract, term by term.
 * Integer dot products use uint32 wrap-around, the same as the SIMD accumulators (exact while
 * 127 * 127 * k < 2^31, i.e. k <= S3D8_K_MAX = 133,144; the drivers refuse larger k).
 * Non-finite input follows the policy in s3d8.h: a row with NaN/Inf -> zeros and x_scale = NaN,
 * a non-finite channel scale -> NaN (s3d8_w_scale_f32). */
#include <float.h>
#include <math.h>
#include <string.h>

#include "s3d8.h"
#include "s3d8_internal.h"

uint16_t s3d8_bf16_from_f32(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float s3d8_f32_from_bf16(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

float s3d8_scale_from_absmax(float absmax) {
    return absmax == 0.0f ? 1.0f : s3d8_f32_from_bf16(s3d8_bf16_from_f32(absmax / 127.0f));
}

uint16_t s3d8_channel_scale_bf16(const float *row, size_t n) {
    float absmax = 0.0f;
    for (size_t i = 0; i < n; i++) {
        float a = fabsf(row[i]);
        if (a > absmax) absmax = a;
    }
    float scale = absmax / 127.0f;
    /* SPEC section 1 (the reference packer's rule): never below the smallest normal float, 2^-126 (exact
     * in bf16), so an all-zero row decodes to ~0 rather than to table values */
    return s3d8_bf16_from_f32(scale < FLT_MIN ? FLT_MIN : scale);
}

void s3d8_luts_from_table(const int8_t table[96], int8_t luts[192]) {
    for (int q = 0; q < 32; q++) {
        for (int s = 0; s < 2; s++) {
            int sign = s ? -1 : 1;
            luts[2 * q + s] = (int8_t)(sign * table[3 * q + 0]);
            luts[64 + q + 32 * s] = (int8_t)(sign * table[3 * q + 1]);
            luts[128 + 2 * q + s] = (int8_t)(sign * table[3 * q + 2]);
        }
    }
}

int8_t s3d8_quant_value(float x, float scale) {
    float q = rintf(x / scale);
    if (q != q) return 0; /* 0/0 when a tiny absmax rounds the scale to 0: torch gives 0 too */
    if (q > 127.0f) q = 127.0f;
    if (q < -127.0f) q = -127.0f;
    return (int8_t)q;
}

void s3d8_quant_row_nonfinite(int8_t *xq, size_t xq_len, float *x_scale, int32_t *x_sum) {
    memset(xq, 0, xq_len);
    *x_scale = s3d8_nan();
    *x_sum = 0;
}

void s3d8_quant_row_ref(size_t k, const float *x, int8_t *xq, size_t xq_len, float *x_scale,
                        int32_t *x_sum) {
    uint32_t absmax_bits = 0;
    for (size_t j = 0; j < k; j++) {
        uint32_t a = s3d8_abs_bits(x[j]);
        if (a > absmax_bits) absmax_bits = a;
    }
    if (absmax_bits >= S3D8_ABS_NONFINITE) {
        s3d8_quant_row_nonfinite(xq, xq_len, x_scale, x_sum);
        return;
    }
    float scale = s3d8_scale_from_absmax(s3d8_f32_from_bits(absmax_bits));
    uint32_t sum = 0; /* wraps like the SIMD sums (only for k > 2^31 / 127) */
    for (size_t j = 0; j < k; j++) {
        xq[j] = s3d8_quant_value(x[j], scale);
        sum += (uint32_t)(int32_t)xq[j];
    }
    memset(xq + k, 0, xq_len - k);
    *x_scale = scale;
    *x_sum = (int32_t)sum;
}

static void quant_ref(size_t m, size_t k, const float *x, size_t x_stride, int8_t *xq,
                      size_t xq_stride, float *x_scale, int32_t *x_sum) {
    for (size_t i = 0; i < m; i++)
        s3d8_quant_row_ref(k, x + i * x_stride, xq + i * xq_stride, S3D8_LHS_STRIDE(k),
                           x_scale + i, x_sum + i);
}

/* The three int8 weights of one packed byte. */
static inline void decode_byte(uint8_t b, const int8_t luts[192], int8_t w[3]) {
    unsigned i0 = b & 0x3Fu, i1 = (b >> 1) & 0x3Fu, i2 = i0 ^ (b >> 7);
    w[0] = luts[i0];
    w[1] = luts[64 + i1];
    w[2] = luts[128 + i2];
}

static void decode_ref(size_t n, size_t k, const uint8_t *packed, const int8_t luts[192],
                       int8_t *w, size_t w_stride) {
    size_t k16 = S3D8_PAD16(k);
    for (size_t g = 0; g < S3D8_GROUPS(n); g++) {
        for (size_t c = 0; c < k; c++) {
            int8_t v[3];
            decode_byte(packed[g * k16 + c], luts, v);
            for (size_t j = 0; j < 3 && 3 * g + j < n; j++) w[(3 * g + j) * w_stride + c] = v[j];
        }
    }
}

static inline float epilogue(uint32_t acc, float x_scale, uint16_t w_scale) {
    return ((float)(int32_t)acc * x_scale) * s3d8_w_scale_f32(w_scale);
}

static void matmul_s3d8_ref(size_t m, size_t n, size_t k, const int8_t *xq, size_t xq_stride,
                            const float *x_scale, const int32_t *x_sum, const uint8_t *packed,
                            const int8_t luts[192], const uint16_t *w_scale, float *y,
                            size_t y_stride) {
    (void)x_sum;
    size_t k16 = S3D8_PAD16(k);
    for (size_t i = 0; i < m; i++) {
        const int8_t *x = xq + i * xq_stride;
        for (size_t g = 0; g < S3D8_GROUPS(n); g++) {
            uint32_t acc[3] = {0, 0, 0};
            for (size_t c = 0; c < k; c++) {
                int8_t v[3];
                decode_byte(packed[g * k16 + c], luts, v);
                for (int j = 0; j < 3; j++) acc[j] += (uint32_t)(x[c] * v[j]);
            }
            for (size_t j = 0; j < 3 && 3 * g + j < n; j++)
                y[i * y_stride + 3 * g + j] = epilogue(acc[j], x_scale[i], w_scale[3 * g + j]);
        }
    }
}

static void matmul_qsi8_ref(size_t m, size_t n, size_t k, const int8_t *xq, size_t xq_stride,
                            const float *x_scale, const int32_t *x_sum, const int8_t *w,
                            size_t w_stride, const uint16_t *w_scale, float *y, size_t y_stride) {
    (void)x_sum;
    for (size_t i = 0; i < m; i++) {
        for (size_t c = 0; c < n; c++) {
            uint32_t acc = 0;
            for (size_t j = 0; j < k; j++) acc += (uint32_t)(xq[i * xq_stride + j] * w[c * w_stride + j]);
            y[i * y_stride + c] = epilogue(acc, x_scale[i], w_scale[c]);
        }
    }
}

static void matmul_bf16_ref(size_t m, size_t n, size_t k, const float *x, size_t x_stride,
                            const uint16_t *w, size_t w_stride, float *y, size_t y_stride) {
    for (size_t i = 0; i < m; i++) {
        for (size_t c = 0; c < n; c++) {
            float acc = 0.0f;
            for (size_t j = 0; j < k; j++) acc += x[i * x_stride + j] * s3d8_f32_from_bf16(w[c * w_stride + j]);
            y[i * y_stride + c] = acc;
        }
    }
}

#define ENCODE_FN encode_ref
#include "s3d8_encode_impl.h"
#undef ENCODE_FN

void s3d8_encode_s3d8cx_f32_ref(size_t d_out, size_t d_in, const float *w, size_t w_stride,
                                const int8_t table[96], const uint16_t *scale, uint8_t *packed,
                                size_t g0, size_t g1) {
    encode_ref(d_out, d_in, w, w_stride, table, scale, packed, g0, g1);
}

static void dequant_ref(size_t m, size_t n, const int32_t *acc, size_t acc_stride,
                              const float *x_scale, const uint16_t *w_scale, float *y,
                              size_t y_stride) {
    for (size_t i = 0; i < m; i++)
        for (size_t c = 0; c < n; c++)
            y[i * y_stride + c] = ((float)acc[i * acc_stride + c] * x_scale[i]) * s3d8_w_scale_f32(w_scale[c]);
}

const s3d8_variant s3d8_variant_ref = {
    "scalar", quant_ref, decode_ref, matmul_s3d8_ref, matmul_qsi8_ref, matmul_bf16_ref, dequant_ref,
    encode_ref,
};
