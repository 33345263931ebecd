/* x86 AVX2 variant (Haswell and later, no AVX-512): the 64-entry lookups are four 16-entry
 * `vpshufb` lookups blended on index bits 4 and 5; the dot products use `vpmaddubsw` on |w| and
 * sign(x, w) and `vpmaddwd` to int32. |w| as an unsigned byte is exact for every int8 weight
 * (-128 -> 128) and x is in [-127, 127], so sign(x, w) never overflows and the int16 pair sums stay
 * within 2 * 128 * 127 < 2^15. (The other way round, sign(w, x) overflows for w = -128.) */
#include <immintrin.h>
#include <string.h>

#include "s3d8.h"
#include "s3d8_internal.h"

#define PREFETCH_BYTES 1024

typedef struct { __m256i q[4]; } lut64; /* 64 entries as four 16-byte quarters, in both lanes */

static inline lut64 load_lut(const int8_t *lut) {
    lut64 t;
    for (int i = 0; i < 4; i++)
        t.q[i] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(lut + 16 * i)));
    return t;
}

/* idx holds 6-bit indices (bits 6 and 7 clear). */
static inline __m256i lookup64(const lut64 *t, __m256i idx) {
    __m256i sel4 = _mm256_slli_epi16(idx, 3), sel5 = _mm256_slli_epi16(idx, 2);
    __m256i a = _mm256_blendv_epi8(_mm256_shuffle_epi8(t->q[0], idx), _mm256_shuffle_epi8(t->q[1], idx), sel4);
    __m256i b = _mm256_blendv_epi8(_mm256_shuffle_epi8(t->q[2], idx), _mm256_shuffle_epi8(t->q[3], idx), sel4);
    return _mm256_blendv_epi8(a, b, sel5);
}

static inline void decode32(__m256i b, const lut64 t[3], __m256i w[3]) {
    const __m256i m6 = _mm256_set1_epi8(0x3F), one = _mm256_set1_epi8(1);
    __m256i i0 = _mm256_and_si256(b, m6);
    __m256i i1 = _mm256_and_si256(_mm256_srli_epi16(b, 1), m6);
    __m256i i2 = _mm256_xor_si256(i0, _mm256_and_si256(_mm256_srli_epi16(b, 7), one));
    w[0] = lookup64(&t[0], i0);
    w[1] = lookup64(&t[1], i1);
    w[2] = lookup64(&t[2], i2);
}

/* acc += dot(x, w) in 8 int32 lanes, exact for x in [-127, 127] and any int8 w. */
static inline __m256i dot32(__m256i acc, __m256i x, __m256i w) {
    __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

static inline int32_t hsum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

static inline float epilogue(int32_t acc, float x_scale, uint16_t w_scale) {
    return ((float)acc * x_scale) * s3d8_w_scale_f32(w_scale);
}

static void quant_avx2(size_t m, size_t k, const float *x, size_t x_stride, int8_t *xq,
                       size_t xq_stride, float *x_scale, int32_t *x_sum) {
    size_t stride = S3D8_LHS_STRIDE(k);
    const __m256i absmask = _mm256_set1_epi32(0x7fffffff);
    for (size_t i = 0; i < m; i++) {
        const float *xr = x + i * x_stride;
        int8_t *qr = xq + i * xq_stride;
        size_t k8 = k / 8 * 8;
        /* absmax as an unsigned max of |x| bits: NaN and Inf show up as >= S3D8_ABS_NONFINITE */
        __m256i vmax = _mm256_setzero_si256();
        for (size_t j = 0; j < k8; j += 8)
            vmax = _mm256_max_epu32(vmax, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(xr + j)), absmask));
        uint32_t lanes[8], absmax = 0;
        _mm256_storeu_si256((__m256i *)lanes, vmax);
        for (int l = 0; l < 8; l++) absmax = lanes[l] > absmax ? lanes[l] : absmax;
        for (size_t j = k8; j < k; j++) {
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
        __m256 vs = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
        __m256i vsum = _mm256_setzero_si256();
        for (size_t j = 0; j < k8; j += 8) {
            __m256 q = _mm256_div_ps(_mm256_loadu_ps(xr + j), vs);
            q = _mm256_round_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m256i qi = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(q, lo), hi));
            vsum = _mm256_add_epi32(vsum, qi);
            __m128i p16 = _mm_packs_epi32(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1));
            _mm_storel_epi64((__m128i *)(qr + j), _mm_packs_epi16(p16, p16));
        }
        int32_t sum = hsum(vsum);
        for (size_t j = k8; j < k; j++) {
            qr[j] = s3d8_quant_value(xr[j], scale);
            sum += qr[j];
        }
        memset(qr + k, 0, stride - k);
        x_scale[i] = scale;
        x_sum[i] = sum;
    }
}

static void load_luts(const int8_t luts[192], lut64 t[3]) {
    for (int j = 0; j < 3; j++) t[j] = load_lut(luts + 64 * j);
}

static void decode_avx2(size_t n, size_t k, const uint8_t *packed, const int8_t luts[192],
                        int8_t *w, size_t w_stride) {
    lut64 t[3];
    load_luts(luts, t);
    size_t k16 = S3D8_PAD16(k);
    for (size_t g = 0; g < S3D8_GROUPS(n); g++) {
        const uint8_t *row = packed + g * k16;
        size_t rows = n - 3 * g < 3 ? n - 3 * g : 3;
        for (size_t c = 0; c < k16; c += 32) {
            uint8_t buf[32] = {0};
            size_t len = k16 - c < 32 ? k16 - c : 32, out = k - c < 32 ? k - c : 32;
            memcpy(buf, row + c, len);
            __m256i v[3];
            decode32(_mm256_loadu_si256((const __m256i *)buf), t, v);
            for (size_t j = 0; j < rows && c < k; j++) {
                int8_t *dst = w + (3 * g + j) * w_stride + c;
                if (out == 32) {
                    _mm256_storeu_si256((__m256i *)dst, v[j]);
                } else {
                    int8_t tmp[32];
                    _mm256_storeu_si256((__m256i *)tmp, v[j]);
                    memcpy(dst, tmp, out);
                }
            }
        }
    }
}

static void matmul_s3d8_avx2(size_t m, size_t n, size_t k, const int8_t *xq, size_t xq_stride,
                             const float *x_scale, const int32_t *x_sum, const uint8_t *packed,
                             const int8_t luts[192], const uint16_t *w_scale, float *y,
                             size_t y_stride) {
    (void)x_sum;
    lut64 t[3];
    load_luts(luts, t);
    size_t k16 = S3D8_PAD16(k);
    for (size_t g = 0; g < S3D8_GROUPS(n); g++) {
        const uint8_t *row = packed + g * k16;
        size_t rows = n - 3 * g < 3 ? n - 3 * g : 3;
        for (size_t i = 0; i < m; i += 2) {
            size_t T = m - i < 2 ? 1 : 2;
            const int8_t *x0 = xq + i * xq_stride, *x1 = xq + (i + T - 1) * xq_stride;
            __m256i acc[2][3];
            for (int a = 0; a < 2; a++)
                for (int j = 0; j < 3; j++) acc[a][j] = _mm256_setzero_si256();
            for (size_t c = 0; c < k16; c += 32) {
                _mm_prefetch((const char *)row + c + PREFETCH_BYTES, _MM_HINT_T0);
                __m256i b;
                if (k16 - c >= 32) {
                    b = _mm256_loadu_si256((const __m256i *)(row + c));
                } else { /* 16-byte tail: the x beyond it is zero */
                    b = _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(row + c)));
                    b = _mm256_inserti128_si256(b, _mm_setzero_si128(), 1);
                }
                __m256i w[3];
                decode32(b, t, w);
                __m256i xv0 = _mm256_loadu_si256((const __m256i *)(x0 + c));
                __m256i xv1 = _mm256_loadu_si256((const __m256i *)(x1 + c));
                for (int j = 0; j < 3; j++) {
                    acc[0][j] = dot32(acc[0][j], xv0, w[j]);
                    acc[1][j] = dot32(acc[1][j], xv1, w[j]);
                }
            }
            for (size_t a = 0; a < T; a++)
                for (size_t j = 0; j < rows; j++)
                    y[(i + a) * y_stride + 3 * g + j] = epilogue(hsum(acc[a][j]), x_scale[i + a], w_scale[3 * g + j]);
        }
    }
}

static void matmul_qsi8_avx2(size_t m, size_t n, size_t k, const int8_t *xq, size_t xq_stride,
                             const float *x_scale, const int32_t *x_sum, const int8_t *w,
                             size_t w_stride, const uint16_t *w_scale, float *y, size_t y_stride) {
    (void)x_sum;
    size_t k32 = k / 32 * 32;
    for (size_t c = 0; c < n; c++) {
        const int8_t *wr = w + c * w_stride;
        __m256i tail = _mm256_setzero_si256();
        if (k32 < k) {
            int8_t buf[32] = {0};
            memcpy(buf, wr + k32, k - k32);
            tail = _mm256_loadu_si256((const __m256i *)buf);
        }
        for (size_t i = 0; i < m; i++) {
            const int8_t *xr = xq + i * xq_stride;
            __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
            size_t j = 0;
            for (; j + 64 <= k32; j += 64) {
                _mm_prefetch((const char *)(wr + j) + PREFETCH_BYTES, _MM_HINT_T0);
                acc0 = dot32(acc0, _mm256_loadu_si256((const __m256i *)(xr + j)), _mm256_loadu_si256((const __m256i *)(wr + j)));
                acc1 = dot32(acc1, _mm256_loadu_si256((const __m256i *)(xr + j + 32)), _mm256_loadu_si256((const __m256i *)(wr + j + 32)));
            }
            for (; j < k32; j += 32)
                acc0 = dot32(acc0, _mm256_loadu_si256((const __m256i *)(xr + j)), _mm256_loadu_si256((const __m256i *)(wr + j)));
            if (k32 < k) acc1 = dot32(acc1, _mm256_loadu_si256((const __m256i *)(xr + k32)), tail);
            y[i * y_stride + c] = epilogue(hsum(_mm256_add_epi32(acc0, acc1)), x_scale[i], w_scale[c]);
        }
    }
}

static void matmul_bf16_avx2(size_t m, size_t n, size_t k, const float *x, size_t x_stride,
                             const uint16_t *w, size_t w_stride, float *y, size_t y_stride) {
    size_t k8 = k / 8 * 8;
    for (size_t c = 0; c < n; c++) {
        const uint16_t *wr = w + c * w_stride;
        for (size_t i = 0; i < m; i++) {
            const float *xr = x + i * x_stride;
            __m256 acc = _mm256_setzero_ps();
            for (size_t j = 0; j < k8; j += 8) {
                __m256i wi = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(wr + j))), 16);
                acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(xr + j), _mm256_castsi256_ps(wi)));
            }
            float lanes[8], s = 0.0f;
            _mm256_storeu_ps(lanes, acc);
            for (int l = 0; l < 8; l++) s += lanes[l];
            for (size_t j = k8; j < k; j++) s += xr[j] * s3d8_f32_from_bf16(wr[j]);
            y[i * y_stride + c] = s;
        }
    }
}

static void dequant_avx2(size_t m, size_t n, const int32_t *acc, size_t acc_stride,
                         const float *x_scale, const uint16_t *w_scale, float *y, size_t y_stride) {
    size_t n8 = n / 8 * 8;
    const __m256i expo = _mm256_set1_epi32(0x7F800000);
    const __m256 nan = _mm256_set1_ps(s3d8_nan());
    for (size_t i = 0; i < m; i++) {
        __m256 xs = _mm256_set1_ps(x_scale[i]);
        const int32_t *a = acc + i * acc_stride;
        float *yr = y + i * y_stride;
        for (size_t c = 0; c < n8; c += 8) {
            __m256i wb = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w_scale + c))), 16);
            __m256i bad = _mm256_cmpeq_epi32(_mm256_and_si256(wb, expo), expo); /* Inf or NaN scale */
            __m256 ws = _mm256_blendv_ps(_mm256_castsi256_ps(wb), nan, _mm256_castsi256_ps(bad));
            __m256 v = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(a + c)));
            _mm256_storeu_ps(yr + c, _mm256_mul_ps(_mm256_mul_ps(v, xs), ws));
        }
        for (size_t c = n8; c < n; c++) yr[c] = epilogue(a[c], x_scale[i], w_scale[c]);
    }
}

#define ENCODE_FN encode_avx2
#include "s3d8_encode_impl.h"
#undef ENCODE_FN

const s3d8_variant s3d8_variant_avx2 = {
    "avx2", quant_avx2, decode_avx2, matmul_s3d8_avx2, matmul_qsi8_avx2, matmul_bf16_avx2, dequant_avx2, encode_avx2,
};
