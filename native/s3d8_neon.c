/* aarch64 NEON variants: `tbl` with four q-registers for the 64-entry signed lookups and `sdot`
 * (dotprod, Armv8.2) for the products, as in the paper's fused mat-vec. The i8mm variant adds an
 * `smmla` INT8 GEMM (2x2 output tiles of 8-deep dot products) for large m, where weights are decoded
 * to INT8 first. Built with -march=armv8.2-a+dotprod; the i8mm functions carry their own target. */
#include <arm_neon.h>
#include <string.h>

#include "s3d8.h"
#include "s3d8_internal.h"

static inline float epilogue(int32_t acc, float x_scale, uint16_t w_scale) {
    return ((float)acc * x_scale) * s3d8_w_scale_f32(w_scale);
}

static void quant_neon(size_t m, size_t k, const float *x, size_t x_stride, int8_t *xq,
                       size_t xq_stride, float *x_scale, int32_t *x_sum) {
    size_t stride = S3D8_LHS_STRIDE(k), k4 = k / 4 * 4;
    for (size_t i = 0; i < m; i++) {
        const float *xr = x + i * x_stride;
        int8_t *qr = xq + i * xq_stride;
        /* absmax as an unsigned max of |x| bits: NaN and Inf show up as >= S3D8_ABS_NONFINITE */
        const uint32x4_t absmask = vdupq_n_u32(0x7fffffffu);
        uint32x4_t vmax = vdupq_n_u32(0);
        for (size_t j = 0; j < k4; j += 4)
            vmax = vmaxq_u32(vmax, vandq_u32(vreinterpretq_u32_f32(vld1q_f32(xr + j)), absmask));
        uint32_t absmax = vmaxvq_u32(vmax);
        for (size_t j = k4; j < k; j++) {
            uint32_t a = s3d8_abs_bits(xr[j]);
            absmax = a > absmax ? a : absmax;
        }
        if (absmax >= S3D8_ABS_NONFINITE) {
            s3d8_quant_row_nonfinite(qr, stride, x_scale + i, x_sum + i);
            continue;
        }
        float scale = s3d8_scale_from_absmax(s3d8_f32_from_bits(absmax));
        if (scale == 0.0f) {
            s3d8_quant_row_ref(k, xr, qr, stride, x_scale + i, x_sum + i);
            continue;
        }
        float32x4_t vs = vdupq_n_f32(scale), lo = vdupq_n_f32(-127.0f), hi = vdupq_n_f32(127.0f);
        int32x4_t vsum = vdupq_n_s32(0);
        for (size_t j = 0; j < k4; j += 4) {
            float32x4_t q = vrndnq_f32(vdivq_f32(vld1q_f32(xr + j), vs));
            int32x4_t qi = vcvtq_s32_f32(vminq_f32(vmaxq_f32(q, lo), hi));
            vsum = vaddq_s32(vsum, qi);
            int8_t tmp[8];
            vst1_s8(tmp, vmovn_s16(vcombine_s16(vmovn_s32(qi), vdup_n_s16(0))));
            memcpy(qr + j, tmp, 4);
        }
        int32_t sum = vaddvq_s32(vsum);
        for (size_t j = k4; j < k; j++) {
            qr[j] = s3d8_quant_value(xr[j], scale);
            sum += qr[j];
        }
        memset(qr + k, 0, stride - k);
        x_scale[i] = scale;
        x_sum[i] = sum;
    }
}

typedef struct { int8x16x4_t l[3]; } luts_neon;

static inline luts_neon load_luts(const int8_t luts[192]) {
    luts_neon t;
    for (int j = 0; j < 3; j++) t.l[j] = vld1q_s8_x4(luts + 64 * j);
    return t;
}

/* The paper's decode: five logical ops and three 64-entry lookups for 48 weights. */
static inline void decode16(uint8x16_t b, const luts_neon *t, int8x16_t w[3]) {
    uint8x16_t i0 = vandq_u8(b, vdupq_n_u8(0x3F));
    uint8x16_t i1 = vandq_u8(vshrq_n_u8(b, 1), vdupq_n_u8(0x3F));
    uint8x16_t i2 = veorq_u8(i0, vshrq_n_u8(b, 7));
    w[0] = vqtbl4q_s8(t->l[0], i0);
    w[1] = vqtbl4q_s8(t->l[1], i1);
    w[2] = vqtbl4q_s8(t->l[2], i2);
}

static void decode_neon(size_t n, size_t k, const uint8_t *packed, const int8_t luts[192],
                        int8_t *w, size_t w_stride) {
    luts_neon t = load_luts(luts);
    size_t k16 = S3D8_PAD16(k);
    for (size_t g = 0; g < S3D8_GROUPS(n); g++) {
        const uint8_t *row = packed + g * k16;
        size_t rows = n - 3 * g < 3 ? n - 3 * g : 3;
        for (size_t c = 0; c < k; c += 16) {
            int8x16_t v[3];
            decode16(vld1q_u8(row + c), &t, v);
            for (size_t j = 0; j < rows; j++) {
                int8_t *dst = w + (3 * g + j) * w_stride + c;
                if (k - c >= 16) {
                    vst1q_s8(dst, v[j]);
                } else {
                    int8_t tmp[16];
                    vst1q_s8(tmp, v[j]);
                    memcpy(dst, tmp, k - c);
                }
            }
        }
    }
}

/* One packed row (3 channels) times T tokens (a compile-time constant at each call). */
static inline __attribute__((always_inline)) void s3d8_group_tokens(
    int T, size_t k16, const uint8_t *row, const int8_t *xq, size_t xq_stride, const luts_neon *t,
    int32x4_t acc[4][3]) {
    for (int a = 0; a < T; a++)
        for (int j = 0; j < 3; j++) acc[a][j] = vdupq_n_s32(0);
    for (size_t c = 0; c < k16; c += 16) {
        __builtin_prefetch(row + c + 512);
        int8x16_t w[3];
        decode16(vld1q_u8(row + c), t, w);
        for (int a = 0; a < T; a++) {
            int8x16_t xv = vld1q_s8(xq + a * xq_stride + c);
            for (int j = 0; j < 3; j++) acc[a][j] = vdotq_s32(acc[a][j], xv, w[j]);
        }
    }
}

static void matmul_s3d8_neon(size_t m, size_t n, size_t k, const int8_t *xq, size_t xq_stride,
                             const float *x_scale, const int32_t *x_sum, const uint8_t *packed,
                             const int8_t luts[192], const uint16_t *w_scale, float *y,
                             size_t y_stride) {
    (void)x_sum;
    luts_neon t = load_luts(luts);
    size_t k16 = S3D8_PAD16(k);
    for (size_t g = 0; g < S3D8_GROUPS(n); g++) {
        const uint8_t *row = packed + g * k16;
        size_t rows = n - 3 * g < 3 ? n - 3 * g : 3;
        for (size_t i = 0; i < m; i += 4) {
            int32x4_t acc[4][3];
            const int8_t *x = xq + i * xq_stride;
            size_t T = m - i < 4 ? m - i : 4;
            switch (T) {
            case 1: s3d8_group_tokens(1, k16, row, x, xq_stride, &t, acc); break;
            case 2: s3d8_group_tokens(2, k16, row, x, xq_stride, &t, acc); break;
            case 3: s3d8_group_tokens(3, k16, row, x, xq_stride, &t, acc); break;
            default: s3d8_group_tokens(4, k16, row, x, xq_stride, &t, acc); break;
            }
            for (size_t a = 0; a < T; a++)
                for (size_t j = 0; j < rows; j++)
                    y[(i + a) * y_stride + 3 * g + j] =
                        epilogue(vaddvq_s32(acc[a][j]), x_scale[i + a], w_scale[3 * g + j]);
        }
    }
}

/* 16 weights of a row from column c; zero past k (rows are not padded). */
static inline int8x16_t load_w16(const int8_t *wr, size_t c, size_t k) {
    if (k - c >= 16) return vld1q_s8(wr + c);
    int8_t buf[16] = {0};
    memcpy(buf, wr + c, k - c);
    return vld1q_s8(buf);
}

static void matmul_qsi8_neon(size_t m, size_t n, size_t k, const int8_t *xq, size_t xq_stride,
                             const float *x_scale, const int32_t *x_sum, const int8_t *w,
                             size_t w_stride, const uint16_t *w_scale, float *y, size_t y_stride) {
    (void)x_sum;
    for (size_t c = 0; c < n; c++) {
        const int8_t *wr = w + c * w_stride;
        for (size_t i = 0; i < m; i += 4) {
            size_t T = m - i < 4 ? m - i : 4;
            int32x4_t acc[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
            for (size_t j = 0; j < k; j += 16) {
                int8x16_t wv = load_w16(wr, j, k);
                for (size_t a = 0; a < T; a++)
                    acc[a] = vdotq_s32(acc[a], vld1q_s8(xq + (i + a) * xq_stride + j), wv);
            }
            for (size_t a = 0; a < T; a++)
                y[(i + a) * y_stride + c] = epilogue(vaddvq_s32(acc[a]), x_scale[i + a], w_scale[c]);
        }
    }
}

/* 8 bytes of two rows (each zero past k) side by side: the operand layout of smmla. */
__attribute__((target("arch=armv8.2-a+dotprod+i8mm")))
static inline int8x16_t load_pair8(const int8_t *r0, const int8_t *r1, size_t c, size_t k) {
    if (k - c >= 8) return vcombine_s8(vld1_s8(r0 + c), vld1_s8(r1 + c));
    int8_t buf[16] = {0};
    memcpy(buf, r0 + c, k - c);
    memcpy(buf + 8, r1 + c, k - c);
    return vld1q_s8(buf);
}

/* smmla: acc[2x2] += A[2x8] * B[2x8]^T. Tiles of 2 tokens x 2 channels; an odd last token or
 * channel repeats its neighbour and the duplicate result is dropped. */
__attribute__((target("arch=armv8.2-a+dotprod+i8mm")))
static void matmul_qsi8_neon_i8mm(size_t m, size_t n, size_t k, const int8_t *xq,
                                  size_t xq_stride, const float *x_scale, const int32_t *x_sum,
                                  const int8_t *w, size_t w_stride, const uint16_t *w_scale,
                                  float *y, size_t y_stride) {
    (void)x_sum;
    for (size_t c = 0; c < n; c += 2) {
        const int8_t *w0 = w + c * w_stride, *w1 = c + 1 < n ? w0 + w_stride : w0;
        for (size_t i = 0; i < m; i += 2) {
            const int8_t *x0 = xq + i * xq_stride, *x1 = i + 1 < m ? x0 + xq_stride : x0;
            int32x4_t acc = vdupq_n_s32(0);
            for (size_t j = 0; j < k; j += 8)
                acc = vmmlaq_s32(acc, vcombine_s8(vld1_s8(x0 + j), vld1_s8(x1 + j)),
                                 load_pair8(w0, w1, j, k));
            int32_t r[4];
            vst1q_s32(r, acc); /* [x0.w0, x0.w1, x1.w0, x1.w1] */
            for (size_t a = 0; a < 2 && i + a < m; a++)
                for (size_t b = 0; b < 2 && c + b < n; b++)
                    y[(i + a) * y_stride + c + b] = epilogue(r[2 * a + b], x_scale[i + a], w_scale[c + b]);
        }
    }
}

static void matmul_bf16_neon(size_t m, size_t n, size_t k, const float *x, size_t x_stride,
                             const uint16_t *w, size_t w_stride, float *y, size_t y_stride) {
    size_t k4 = k / 4 * 4;
    for (size_t c = 0; c < n; c++) {
        const uint16_t *wr = w + c * w_stride;
        for (size_t i = 0; i < m; i++) {
            const float *xr = x + i * x_stride;
            float32x4_t acc = vdupq_n_f32(0.0f);
            for (size_t j = 0; j < k4; j += 4) {
                float32x4_t wv = vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(wr + j), 16));
                acc = vaddq_f32(acc, vmulq_f32(vld1q_f32(xr + j), wv));
            }
            float s = vaddvq_f32(acc);
            for (size_t j = k4; j < k; j++) s += xr[j] * s3d8_f32_from_bf16(wr[j]);
            y[i * y_stride + c] = s;
        }
    }
}

static void dequant_neon(size_t m, size_t n, const int32_t *acc, size_t acc_stride,
                         const float *x_scale, const uint16_t *w_scale, float *y, size_t y_stride) {
    size_t n4 = n / 4 * 4;
    const uint32x4_t expo = vdupq_n_u32(0x7F800000u);
    const float32x4_t nan = vdupq_n_f32(s3d8_nan());
    for (size_t i = 0; i < m; i++) {
        float32x4_t xs = vdupq_n_f32(x_scale[i]);
        const int32_t *a = acc + i * acc_stride;
        float *yr = y + i * y_stride;
        for (size_t c = 0; c < n4; c += 4) {
            uint32x4_t wb = vshll_n_u16(vld1_u16(w_scale + c), 16);
            uint32x4_t bad = vceqq_u32(vandq_u32(wb, expo), expo); /* Inf or NaN scale */
            float32x4_t ws = vbslq_f32(bad, nan, vreinterpretq_f32_u32(wb));
            vst1q_f32(yr + c, vmulq_f32(vmulq_f32(vcvtq_f32_s32(vld1q_s32(a + c)), xs), ws));
        }
        for (size_t c = n4; c < n; c++) yr[c] = epilogue(a[c], x_scale[i], w_scale[c]);
    }
}

#define ENCODE_FN encode_neon
#include "s3d8_encode_impl.h"
#undef ENCODE_FN

const s3d8_variant s3d8_variant_neon = {
    "neon", quant_neon, decode_neon, matmul_s3d8_neon, matmul_qsi8_neon, matmul_bf16_neon, dequant_neon, encode_neon,
};

const s3d8_variant s3d8_variant_neon_i8mm = {
    "neon_i8mm", quant_neon, decode_neon, matmul_s3d8_neon, matmul_qsi8_neon_i8mm, matmul_bf16_neon,
    dequant_neon, encode_neon,
};
