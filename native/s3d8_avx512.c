/* x86 AVX-512 variant: VBMI `vpermb` for the 64-entry signed lookups, VNNI `vpdpbusd` for the
 * dot products. Needs AVX512F/BW/VL/VBMI/VNNI (Ice Lake, Sapphire Rapids, Zen 4 and later).
 *
 * vpdpbusd multiplies unsigned by signed bytes, so the weight is the unsigned operand biased by
 * +128 (the lookup tables hold w + 128, which is free) and the activation the signed one:
 *   sum (w + 128) * x = sum w * x + 128 * sum x,
 * and 128 * x_sum is subtracted once per output. Arithmetic wraps mod 2^32 as in the reference.
 *
 * m = 1 is bound by memory bandwidth: the packed matrix is read S3D8_STREAMS rows at a time (a
 * block of that many rows, contiguous in memory), and while one block is read the next one is
 * prefetched front to back (into L1 on AMD CPUs, into L2 on the others: s3d8_next_block_to_l1), S3D8_STREAMS lines per 64-byte step, so that the whole block is
 * on its way before its first load. One core keeps too few DRAM reads in flight from the demand
 * loads and the hardware prefetcher alone, and a prefetch a fixed distance ahead in each row
 * interleaves as many streams as rows (README, "Generating with a packed model"). */
#include <immintrin.h>
#include <string.h>

#include "s3d8.h"
#include "s3d8_internal.h"

/* Prefetch distance per stream; overridable with -D for experiments. */
#ifndef S3D8_PREFETCH_BYTES
#define S3D8_PREFETCH_BYTES 512
#define S3D8_PREFETCH_HINT _MM_HINT_T0
#endif
#ifndef S3D8_STREAMS /* packed rows read at once by the one-token product */
#define S3D8_STREAMS 4
#endif
#ifndef QSI8_PREFETCH_BYTES
#define QSI8_PREFETCH_BYTES 512
#define QSI8_PREFETCH_HINT _MM_HINT_T1 /* into L2: leaves L1 fill buffers to the demand loads */
#endif
#ifndef QSI8_BLOCK_ROWS /* INT8 product for many tokens: rows x tokens accumulators per block */
#define QSI8_BLOCK_ROWS 4
#define QSI8_BLOCK_TOKENS 4
#endif

static inline __m512i bias_lut(const int8_t *lut) {
    return _mm512_xor_si512(_mm512_loadu_si512(lut), _mm512_set1_epi8((char)0x80));
}

/* 64 packed bytes -> three vectors of 64 biased weights (w + 128), for rows 3g, 3g+1, 3g+2.
 * vpermb reads only the low 6 bits of each index, so I0 = b and I1 = b >> 1 (a 16-bit shift that
 * moves a neighbour's bit into bit 7 only) need no mask; I2 = b ^ ((b >> 7) & 1). */
static inline void decode64(__m512i b, __m512i l0, __m512i l1, __m512i l2, __m512i w[3]) {
    w[0] = _mm512_permutexvar_epi8(b, l0);
    w[1] = _mm512_permutexvar_epi8(_mm512_srli_epi16(b, 1), l1);
    __m512i i2 = _mm512_ternarylogic_epi32(b, _mm512_srli_epi16(b, 7), _mm512_set1_epi8(1), 0x78);
    w[2] = _mm512_permutexvar_epi8(i2, l2);
}

/* Sum of the 16 lanes mod 2^32. (GCC's _mm512_reduce_add_epi32 adds as signed int: undefined
 * behaviour, flagged by UBSan, when the biased sums pass 2^31, which they do for large k.) */
static inline uint32_t reduce_add_u32(__m512i v) {
    __m256i a = _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
    __m128i b = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    b = _mm_add_epi32(b, _mm_shuffle_epi32(b, 0x4E));
    b = _mm_add_epi32(b, _mm_shuffle_epi32(b, 0xB1));
    return (uint32_t)_mm_cvtsi128_si32(b);
}

static inline float epilogue(__m512i acc, int32_t x_sum, float x_scale, uint16_t w_scale) {
    uint32_t s = reduce_add_u32(acc) - 128u * (uint32_t)x_sum;
    return ((float)(int32_t)s * x_scale) * s3d8_w_scale_f32(w_scale);
}

static inline __mmask64 tail_mask(size_t len) {
    return len >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << len) - 1);
}

/* Quantisation: 16 floats at a time, division and rounding exactly as rintf(x / scale). */
static void quant_avx512(size_t m, size_t k, const float *x, size_t x_stride, int8_t *xq,
                         size_t xq_stride, float *x_scale, int32_t *x_sum) {
    size_t stride = S3D8_LHS_STRIDE(k);
    for (size_t i = 0; i < m; i++) {
        const float *xr = x + i * x_stride;
        int8_t *qr = xq + i * xq_stride;
        /* absmax as an unsigned max of |x| bits: NaN and Inf show up as >= S3D8_ABS_NONFINITE */
        const __m512i absmask = _mm512_set1_epi32(0x7fffffff);
        __m512i vmax = _mm512_setzero_si512();
        for (size_t j = 0; j < k; j += 16) {
            __mmask16 mk = (__mmask16)tail_mask(k - j < 16 ? k - j : 16);
            vmax = _mm512_max_epu32(vmax, _mm512_and_si512(_mm512_maskz_loadu_epi32(mk, xr + j), absmask));
        }
        uint32_t absmax = (uint32_t)_mm512_reduce_max_epu32(vmax);
        if (absmax >= S3D8_ABS_NONFINITE) {
            s3d8_quant_row_nonfinite(qr, stride, x_scale + i, x_sum + i);
            continue;
        }
        float scale = s3d8_scale_from_absmax(s3d8_f32_from_bits(absmax));
        if (scale == 0.0f) {
            s3d8_quant_row_ref(k, xr, qr, stride, x_scale + i, x_sum + i);
            continue;
        }
        __m512 vs = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
        __m512i vsum = _mm512_setzero_si512();
        for (size_t j = 0; j < k; j += 16) {
            __mmask16 mk = (__mmask16)tail_mask(k - j < 16 ? k - j : 16);
            __m512 q = _mm512_div_ps(_mm512_maskz_loadu_ps(mk, xr + j), vs);
            q = _mm512_roundscale_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m512i qi = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(q, lo), hi));
            vsum = _mm512_add_epi32(vsum, qi);
            _mm_mask_storeu_epi8(qr + j, mk, _mm512_cvtepi32_epi8(qi));
        }
        memset(qr + k, 0, stride - k);
        x_scale[i] = scale;
        x_sum[i] = (int32_t)reduce_add_u32(vsum);
    }
}

static void decode_avx512(size_t n, size_t k, const uint8_t *packed, const int8_t luts[192],
                          int8_t *w, size_t w_stride) {
    __m512i l0 = _mm512_loadu_si512(luts), l1 = _mm512_loadu_si512(luts + 64),
            l2 = _mm512_loadu_si512(luts + 128);
    size_t k16 = S3D8_PAD16(k);
    for (size_t g = 0; g < S3D8_GROUPS(n); g++) {
        const uint8_t *row = packed + g * k16;
        size_t rows = n - 3 * g < 3 ? n - 3 * g : 3;
        for (size_t c = 0; c < k; c += 64) {
            __mmask64 mk = tail_mask(k - c);
            __m512i b = _mm512_maskz_loadu_epi8(mk, row + c), v[3];
            v[0] = _mm512_permutexvar_epi8(b, l0);
            v[1] = _mm512_permutexvar_epi8(_mm512_srli_epi16(b, 1), l1);
            v[2] = _mm512_permutexvar_epi8(
                _mm512_ternarylogic_epi32(b, _mm512_srli_epi16(b, 7), _mm512_set1_epi8(1), 0x78), l2);
            for (size_t j = 0; j < rows; j++)
                _mm512_mask_storeu_epi8(w + (3 * g + j) * w_stride + c, mk, v[j]);
        }
    }
}

/* One packed row (3 output channels) times T tokens, T a compile-time constant at each call:
 * the accumulators stay in registers only when every index into them is a constant. */
static inline __attribute__((always_inline)) void s3d8_group_tokens(
    int T, size_t k16, const uint8_t *row, const int8_t *xq, size_t xq_stride, const float *x_scale,
    const int32_t *x_sum, __m512i l0, __m512i l1, __m512i l2, const uint16_t *w_scale, size_t rows,
    float *y, size_t y_stride) {
    __m512i acc[4][3], w[3];
    for (int t = 0; t < T; t++)
        for (int j = 0; j < 3; j++) acc[t][j] = _mm512_setzero_si512();
    size_t c = 0;
    for (; c + 64 <= k16; c += 64) {
        _mm_prefetch((const char *)row + c + S3D8_PREFETCH_BYTES, S3D8_PREFETCH_HINT);
        decode64(_mm512_loadu_si512(row + c), l0, l1, l2, w);
        for (int t = 0; t < T; t++) {
            __m512i xv = _mm512_loadu_si512(xq + t * xq_stride + c);
            for (int j = 0; j < 3; j++) acc[t][j] = _mm512_dpbusd_epi32(acc[t][j], w[j], xv);
        }
    }
    if (c < k16) { /* 16, 32 or 48 bytes left; x is zero beyond them */
        decode64(_mm512_maskz_loadu_epi8(tail_mask(k16 - c), row + c), l0, l1, l2, w);
        for (int t = 0; t < T; t++) {
            __m512i xv = _mm512_loadu_si512(xq + t * xq_stride + c);
            for (int j = 0; j < 3; j++) acc[t][j] = _mm512_dpbusd_epi32(acc[t][j], w[j], xv);
        }
    }
    for (int t = 0; t < T; t++)
        for (int j = 0; j < 3; j++)
            if ((size_t)j < rows)
                y[t * y_stride + j] = epilogue(acc[t][j], x_sum[t], x_scale[t], w_scale[j]);
}

/* One token times G packed rows (3G output channels) at once: G read streams, as the INT8 product
 * reads several rows. Step s prefetches lines sG .. sG + G - 1 of the next block (the bytes from
 * G k16 on, of the `left` bytes from rows0 on) into L1 if `near`, else into L2; the ceil(k16 / 64)
 * steps cover its G k16 bytes. G and near are compile-time constants at each call. */
static inline __attribute__((always_inline)) void s3d8_groups_token(
    int G, int near, size_t k16, const uint8_t *rows0, size_t left, const int8_t *xq, __m512i l0,
    __m512i l1, __m512i l2, const uint16_t *w_scale, float x_scale, int32_t x_sum, float *y) {
    __m512i acc[S3D8_STREAMS][3], w[3];
    size_t next = (size_t)G * k16;
    for (int g = 0; g < G; g++)
        for (int j = 0; j < 3; j++) acc[g][j] = _mm512_setzero_si512();
    size_t c = 0;
    for (; c < k16; c += 64, next += (size_t)G * 64) {
        __m512i xv = _mm512_loadu_si512(xq + c);
        __mmask64 mk = tail_mask(k16 - c); /* 16, 32 or 48 bytes at the end; x is zero beyond them */
        for (int g = 0; g < G; g++) {
            if (next + 64 * g < left) {
                if (near) _mm_prefetch((const char *)rows0 + next + 64 * g, _MM_HINT_T0);
                else _mm_prefetch((const char *)rows0 + next + 64 * g, _MM_HINT_T1);
            }
            decode64(_mm512_maskz_loadu_epi8(mk, rows0 + g * k16 + c), l0, l1, l2, w);
            for (int j = 0; j < 3; j++) acc[g][j] = _mm512_dpbusd_epi32(acc[g][j], w[j], xv);
        }
    }
    for (int g = 0; g < G; g++)
        for (int j = 0; j < 3; j++) y[3 * g + j] = epilogue(acc[g][j], x_sum, x_scale, w_scale[3 * g + j]);
}

static void matmul_s3d8_avx512(size_t m, size_t n, size_t k, const int8_t *xq, size_t xq_stride,
                               const float *x_scale, const int32_t *x_sum, const uint8_t *packed,
                               const int8_t luts[192], const uint16_t *w_scale, float *y,
                               size_t y_stride) {
    __m512i l0 = bias_lut(luts), l1 = bias_lut(luts + 64), l2 = bias_lut(luts + 128);
    size_t k16 = S3D8_PAD16(k);
    /* start the stream: one token's first block (its loop prefetches each next one), else the first
     * S3D8_PREFETCH_BYTES (the loop below runs that far ahead) */
    size_t start = m == 1 ? S3D8_STREAMS * k16 : S3D8_PREFETCH_BYTES;
    int near = s3d8_next_block_to_l1();
    for (size_t b = 0; b < start && b < S3D8_GROUPS(n) * k16; b += 64) {
        if (m == 1 && !near) _mm_prefetch((const char *)packed + b, _MM_HINT_T1);
        else _mm_prefetch((const char *)packed + b, S3D8_PREFETCH_HINT);
    }
    size_t g = 0;
    if (m == 1) /* whole groups of 3 channels, S3D8_STREAMS packed rows at a time */
        for (; g + S3D8_STREAMS <= n / 3; g += S3D8_STREAMS) {
#define S3D8_CALL(NEAR) s3d8_groups_token(S3D8_STREAMS, NEAR, k16, packed + g * k16,             \
                                          (S3D8_GROUPS(n) - g) * k16, xq, l0, l1, l2,            \
                                          w_scale + 3 * g, x_scale[0], x_sum[0], y + 3 * g)
            if (near) S3D8_CALL(1);
            else S3D8_CALL(0);
#undef S3D8_CALL
        }
    for (; g < S3D8_GROUPS(n); g++) {
        const uint8_t *row = packed + g * k16;
        size_t rows = n - 3 * g < 3 ? n - 3 * g : 3;
        for (size_t i = 0; i < m; i += 4) {
#define S3D8_CALL(T) s3d8_group_tokens(T, k16, row, xq + i * xq_stride, xq_stride, x_scale + i,  \
                                       x_sum + i, l0, l1, l2, w_scale + 3 * g, rows,             \
                                       y + i * y_stride + 3 * g, y_stride)
            switch (m - i < 4 ? m - i : 4) {
            case 1: S3D8_CALL(1); break;
            case 2: S3D8_CALL(2); break;
            case 3: S3D8_CALL(3); break;
            default: S3D8_CALL(4); break;
            }
#undef S3D8_CALL
        }
    }
}

/* R weight rows times T tokens, both compile-time constants at each call. */
static inline __attribute__((always_inline)) void qsi8_block(
    int R, int T, size_t k, const int8_t *w, size_t w_stride, const int8_t *xq, size_t xq_stride,
    const float *x_scale, const int32_t *x_sum, const uint16_t *w_scale, float *y, size_t y_stride) {
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    __m512i acc[QSI8_BLOCK_TOKENS][QSI8_BLOCK_ROWS], wv[QSI8_BLOCK_ROWS];
    for (int t = 0; t < T; t++)
        for (int r = 0; r < R; r++) acc[t][r] = _mm512_setzero_si512();
    size_t c = 0;
    for (; c + 64 <= k; c += 64) {
        for (int r = 0; r < R; r++) {
            _mm_prefetch((const char *)(w + r * w_stride + c) + QSI8_PREFETCH_BYTES, QSI8_PREFETCH_HINT);
            wv[r] = _mm512_xor_si512(_mm512_loadu_si512(w + r * w_stride + c), bias);
        }
        for (int t = 0; t < T; t++) {
            __m512i xv = _mm512_loadu_si512(xq + t * xq_stride + c);
            for (int r = 0; r < R; r++) acc[t][r] = _mm512_dpbusd_epi32(acc[t][r], wv[r], xv);
        }
    }
    if (c < k) { /* masked-off weight bytes read as 0x80 = 0 after the bias; x is zero there */
        for (int r = 0; r < R; r++)
            wv[r] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(tail_mask(k - c), w + r * w_stride + c), bias);
        for (int t = 0; t < T; t++) {
            __m512i xv = _mm512_loadu_si512(xq + t * xq_stride + c);
            for (int r = 0; r < R; r++) acc[t][r] = _mm512_dpbusd_epi32(acc[t][r], wv[r], xv);
        }
    }
    for (int t = 0; t < T; t++)
        for (int r = 0; r < R; r++)
            y[t * y_stride + r] = epilogue(acc[t][r], x_sum[t], x_scale[t], w_scale[r]);
}

static void matmul_qsi8_avx512(size_t m, size_t n, size_t k, const int8_t *xq, size_t xq_stride,
                               const float *x_scale, const int32_t *x_sum, const int8_t *w,
                               size_t w_stride, const uint16_t *w_scale, float *y,
                               size_t y_stride) {
#define QSI8_CALL(R, T, c, i)                                                                  \
    qsi8_block(R, T, k, w + (c) * w_stride, w_stride, xq + (i) * xq_stride, xq_stride,        \
               x_scale + (i), x_sum + (i), w_scale + (c), y + (i) * y_stride + (c), y_stride)
    if (m <= 4) { /* one row at a time: a single linear stream that the prefetcher follows best */
        for (size_t c = 0; c < n; c++) {
            switch (m) {
            case 1: QSI8_CALL(1, 1, c, 0); break;
            case 2: QSI8_CALL(1, 2, c, 0); break;
            case 3: QSI8_CALL(1, 3, c, 0); break;
            default: QSI8_CALL(1, 4, c, 0); break;
            }
        }
        return;
    }
    /* blocks of rows x tokens for register reuse; the remainders row by row, token by token */
    for (size_t c = 0; c < n; c += QSI8_BLOCK_ROWS) {
        for (size_t i = 0; i < m; i += QSI8_BLOCK_TOKENS) {
            size_t R = n - c < QSI8_BLOCK_ROWS ? n - c : QSI8_BLOCK_ROWS;
            size_t T = m - i < QSI8_BLOCK_TOKENS ? m - i : QSI8_BLOCK_TOKENS;
            if (R == QSI8_BLOCK_ROWS && T == QSI8_BLOCK_TOKENS) {
                QSI8_CALL(QSI8_BLOCK_ROWS, QSI8_BLOCK_TOKENS, c, i);
            } else if (R == QSI8_BLOCK_ROWS) {
                for (size_t t = 0; t < T; t++) QSI8_CALL(QSI8_BLOCK_ROWS, 1, c, i + t);
            } else {
                for (size_t r = 0; r < R; r++)
                    for (size_t t = 0; t < T; t++) QSI8_CALL(1, 1, c + r, i + t);
            }
        }
    }
#undef QSI8_CALL
}

static void matmul_bf16_avx512(size_t m, size_t n, size_t k, const float *x, size_t x_stride,
                               const uint16_t *w, size_t w_stride, float *y, size_t y_stride) {
    for (size_t c = 0; c < n; c++) {
        const uint16_t *wr = w + c * w_stride;
        for (size_t i = 0; i < m; i++) {
            const float *xr = x + i * x_stride;
            __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
            size_t j = 0;
            for (; j + 32 <= k; j += 32) {
                _mm_prefetch((const char *)(wr + j) + QSI8_PREFETCH_BYTES, QSI8_PREFETCH_HINT);
                __m512i b = _mm512_loadu_si512(wr + j);
                __m512 w0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(b)), 16));
                __m512 w1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(b, 1)), 16));
                acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(xr + j), w0, acc0);
                acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(xr + j + 16), w1, acc1);
            }
            for (; j < k; j += 16) {
                __mmask16 mk = (__mmask16)tail_mask(k - j < 16 ? k - j : 16);
                __m256i b = _mm256_maskz_loadu_epi16(mk, wr + j);
                __m512 w0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
                acc0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, xr + j), w0, acc0);
            }
            y[i * y_stride + c] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
        }
    }
}

static void dequant_avx512(size_t m, size_t n, const int32_t *acc, size_t acc_stride,
                           const float *x_scale, const uint16_t *w_scale, float *y,
                           size_t y_stride) {
    const __m512i expo = _mm512_set1_epi32(0x7F800000);
    const __m512 nan = _mm512_set1_ps(s3d8_nan());
    for (size_t i = 0; i < m; i++) {
        __m512 xs = _mm512_set1_ps(x_scale[i]);
        for (size_t c = 0; c < n; c += 16) {
            __mmask16 mk = (__mmask16)tail_mask(n - c < 16 ? n - c : 16);
            __m512i wb = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, w_scale + c)), 16);
            __mmask16 bad = _mm512_cmpeq_epi32_mask(_mm512_and_si512(wb, expo), expo); /* Inf or NaN scale */
            __m512 ws = _mm512_mask_mov_ps(_mm512_castsi512_ps(wb), bad, nan);
            __m512 a = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(mk, acc + i * acc_stride + c));
            _mm512_mask_storeu_ps(y + i * y_stride + c, mk, _mm512_mul_ps(_mm512_mul_ps(a, xs), ws));
        }
    }
}

#define ENCODE_FN encode_avx512
#include "s3d8_encode_impl.h"
#undef ENCODE_FN

const s3d8_variant s3d8_variant_avx512 = {
    "avx512", quant_avx512, decode_avx512, matmul_s3d8_avx512, matmul_qsi8_avx512, matmul_bf16_avx512,
    dequant_avx512, encode_avx512,
};
