/* x86 AVX2 variant (Haswell and later, no AVX-512).
 *
 * S3D8 decode. The three weights of a byte share one magnitude index q = (b >> 1) & 31, so the
 * kernels look up only magnitudes: per lane j a 32-entry table of T[q][j] (values in [0, 127]) as
 * two 16-entry `vpshufb` lookups (q & 15) blended on q bit 4, one blend mask for the three lanes.
 * The sign s_j goes onto the other operand with `vpsignb`, through a byte whose bit 7 is s_j and
 * which is never zero (vpsignb by 0 gives 0); see decode32:
 *   s0 = bit 0            -> (b & 1) + 0x7F      (0x7F or 0x80)
 *   s1 = bit 6            -> (b + b) | 1
 *   s2 = bit 0 ^ bit 7    -> s0 ^ b              (bit 0 is always 1)
 *
 * Products: vpmaddubsw(mag, sign(x, s_j)) multiplies the unsigned magnitude by the signed
 * activation: x in [-127, 127] so sign(x, s) never overflows, and the int16 pair sums stay within
 * 2 * 127 * 127 = 32258 < 2^15 (no saturation); a zero magnitude gives 0 whatever the sign, like
 * the reference's +0 weight. vpmaddwd by 1 widens the pairs to int32, exact.
 *
 * INT8 weights: vpmaddubsw on |w| and sign(x, w). |w| as an unsigned byte is exact for every int8
 * weight (-128 -> 128) and x is in [-127, 127], so sign(x, w) never overflows and the int16 pair
 * sums stay within 2 * 128 * 127 < 2^15. (The other way round, sign(w, x) overflows for w = -128.)
 *
 * m = 1 would be bound by memory bandwidth only at 1/3 byte per weight, so every instruction per
 * packed byte counts: per 32 packed bytes (96 weights) this is 4 shared index ops, 9 lookup ops,
 * 4 sign ops, then 4 ops per lane and token (sign, maddubs, maddwd, add). Its rows are read
 * S3D8_STREAMS at a time with the next block prefetched (s3d8_groups_token; into L1 on AMD CPUs,
 * into L2 on the others: s3d8_next_block_to_l1), as the AVX-512 variant reads them. */
#include <immintrin.h>
#include <string.h>

#include "s3d8.h"
#include "s3d8_internal.h"

#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 1024
#endif
#ifndef S3D8_STREAMS /* packed rows read at once by the one-token product (its block) */
#define S3D8_STREAMS 2
#endif
#ifndef S3D8_TOKENS /* tokens per pass over a packed row in the fused product (1..4) */
#define S3D8_TOKENS 4
#endif
/* INT8 product for m > 4: blocks of weight rows x tokens (1..4 each): each loaded weight vector serves
 * QSI8_BLOCK_TOKENS tokens and each activation vector QSI8_BLOCK_ROWS rows, 9 accumulators of the 16 ymm
 * registers at 3 x 3 (the default; the arm-bench kernel table times the product, reports/bench.md). */
#ifndef QSI8_BLOCK_ROWS
#define QSI8_BLOCK_ROWS 3
#endif
#ifndef QSI8_BLOCK_TOKENS
#define QSI8_BLOCK_TOKENS 3
#endif
#ifndef QSI8_SIGN_ASM /* vpsignb with the weight as a memory operand (GCC; see dot32_abs) */
#define QSI8_SIGN_ASM 1
#endif

/* The magnitudes T[q][j] of the three lanes: lo[j] holds q = 0..15, hi[j] q = 16..31, each
 * 16-entry table in both 128-bit halves (vpshufb looks up within each half). */
typedef struct { __m256i lo[3], hi[3]; } magtab;

/* The drivers build luts with s3d8_luts_from_table from a table they have checked to be >= 0, so
 * the positive-sign entries are the magnitudes: L0[2q] = T[q][0], L1[q] = T[q][1],
 * L2[2q] = T[q][2]. */
static inline magtab load_mags(const int8_t luts[192]) {
    int8_t mag[3][32];
    for (int q = 0; q < 32; q++) {
        mag[0][q] = luts[2 * q];
        mag[1][q] = luts[64 + q];
        mag[2][q] = luts[128 + 2 * q];
    }
    magtab t;
    for (int j = 0; j < 3; j++) {
        t.lo[j] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)mag[j]));
        t.hi[j] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(mag[j] + 16)));
    }
    return t;
}

/* vpblendvb: bytes of b where bit 7 of sel is set, else bytes of a. Written as asm because GCC 12
 * folds the intrinsic into a generic select and then adds a vpcmpgtb to rebuild a mask it already
 * had (one more vector op per call, measurable here). "x" means ymm0-15 in this -mavx2 file. */
static inline __m256i blendv8(__m256i a, __m256i b, __m256i sel) {
#if defined(__GNUC__) && !defined(__clang__) && !defined(S3D8_NO_ASM)
    __m256i r;
    __asm__("vpblendvb %3, %2, %1, %0" : "=x"(r) : "x"(a), "x"(b), "x"(sel));
    return r;
#else
    return _mm256_blendv_epi8(a, b, sel);
#endif
}

/* 32 packed bytes -> the three lanes' magnitudes (unsigned, [0, 127]) and sign bytes (bit 7 the
 * weight's sign, never zero). The vector shift and shuffle units are the busy ones (6 vpshufb per
 * 32 bytes), so the bit moves use byte adds where they can (b + b moves every bit up by one within
 * its byte, bit 7 dropped). */
static inline __attribute__((always_inline)) void decode32(__m256i b, const magtab *t,
                                                           __m256i mag[3], __m256i sgn[3]) {
    const __m256i one = _mm256_set1_epi8(1);
    /* q & 15 (the mask clears the bit that the 16-bit shift brings in from the byte above) */
    __m256i idx = _mm256_and_si256(_mm256_srli_epi16(b, 1), _mm256_set1_epi8(0x0F));
    __m256i b2 = _mm256_add_epi8(b, b);    /* bit 7 = b bit 6 = s1 */
    __m256i sel = _mm256_add_epi8(b2, b2); /* bit 7 = b bit 5 = q bit 4: the upper half */
    for (int j = 0; j < 3; j++)
        mag[j] = blendv8(_mm256_shuffle_epi8(t->lo[j], idx), _mm256_shuffle_epi8(t->hi[j], idx), sel);
    /* s0 = (b & 1) + 0x7F: 0x7F (+) or 0x80 (-).
     * s2 = s0 ^ b: bit 7 = s0 ^ b7 = b0 ^ b7; bit 0 = !b0 ^ b0 = 1, so never zero.
     * s1 = b2 | 1: bit 7 = b6, bit 0 set. */
    sgn[0] = _mm256_add_epi8(_mm256_and_si256(b, one), _mm256_set1_epi8(0x7F));
    sgn[1] = _mm256_or_si256(b2, one);
    sgn[2] = _mm256_xor_si256(sgn[0], b);
}

/* acc += dot(x, w) in 8 int32 lanes for the 32 INT8 weights at w, exact for x in [-127, 127] and
 * any int8 w, given wabs = |w| (computed once by the caller and reused over tokens). The weights
 * only give the signs here, read from memory (L1) by vpsignb: GCC would otherwise keep both w and
 * |w| in registers, and a 3 x 3 block then spills; written as asm for that reason. */
static inline __m256i dot32_abs(__m256i acc, __m256i x, __m256i wabs, const int8_t *w) {
#if QSI8_SIGN_ASM && defined(__GNUC__) && !defined(__clang__) && !defined(S3D8_NO_ASM)
    __m256i s;
    __asm__("vpsignb %2, %1, %0" : "=x"(s) : "x"(x), "m"(*(const __m256i_u *)w));
#else
    __m256i s = _mm256_sign_epi8(x, _mm256_loadu_si256((const __m256i *)w));
#endif
    __m256i p = _mm256_maddubs_epi16(wabs, s);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

/* acc += dot(x, sign * mag) for an S3D8 lane: mag in [0, 127], x in [-127, 127] (see the top). */
static inline __m256i dot32_mag(__m256i acc, __m256i x, __m256i mag, __m256i sgn) {
    __m256i p = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(x, sgn));
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

static void decode_avx2(size_t n, size_t k, const uint8_t *packed, const int8_t luts[192],
                        int8_t *w, size_t w_stride) {
    magtab t = load_mags(luts);
    size_t k16 = S3D8_PAD16(k);
    for (size_t g = 0; g < S3D8_GROUPS(n); g++) {
        const uint8_t *row = packed + g * k16;
        size_t rows = n - 3 * g < 3 ? n - 3 * g : 3;
        int8_t *dst = w + 3 * g * w_stride;
        __m256i mag[3], sgn[3];
        size_t c = 0;
        /* w = sign(mag, s): +-mag, and 0 for a zero magnitude (s is never 0) */
        for (; c + 32 <= k; c += 32) {
            decode32(_mm256_loadu_si256((const __m256i *)(row + c)), &t, mag, sgn);
            for (size_t j = 0; j < rows; j++)
                _mm256_storeu_si256((__m256i *)(dst + j * w_stride + c), _mm256_sign_epi8(mag[j], sgn[j]));
        }
        if (c < k) { /* the last k - c < 32 columns, from the k16 - c packed bytes left */
            uint8_t buf[32] = {0};
            memcpy(buf, row + c, k16 - c < 32 ? k16 - c : 32);
            decode32(_mm256_loadu_si256((const __m256i *)buf), &t, mag, sgn);
            for (size_t j = 0; j < rows; j++) {
                int8_t tmp[32];
                _mm256_storeu_si256((__m256i *)tmp, _mm256_sign_epi8(mag[j], sgn[j]));
                memcpy(dst + j * w_stride + c, tmp, k - c);
            }
        }
    }
}

/* One packed row (3 output channels) times T tokens, T a compile-time constant at each call:
 * the accumulators stay in registers only when every index into them is a constant. */
static inline __attribute__((always_inline)) void s3d8_group_tokens(
    int T, size_t k16, const uint8_t *row, const int8_t *xq, size_t xq_stride, const float *x_scale,
    const magtab *t, const uint16_t *w_scale, size_t rows, float *y, size_t y_stride) {
    __m256i acc[S3D8_TOKENS][3], mag[3], sgn[3];
    for (int a = 0; a < T; a++)
        for (int j = 0; j < 3; j++) acc[a][j] = _mm256_setzero_si256();
    size_t c = 0;
    for (; c + 64 <= k16; c += 64) { /* two 32-byte chunks per prefetched cache line */
        _mm_prefetch((const char *)row + c + PREFETCH_BYTES, _MM_HINT_T0);
        for (size_t h = 0; h < 64; h += 32) {
            decode32(_mm256_loadu_si256((const __m256i *)(row + c + h)), t, mag, sgn);
            for (int a = 0; a < T; a++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + a * xq_stride + c + h));
                for (int j = 0; j < 3; j++) acc[a][j] = dot32_mag(acc[a][j], xv, mag[j], sgn[j]);
            }
        }
    }
    for (; c < k16; c += 32) { /* 16, 32 or 48 bytes left; x is zero beyond k16 (in its stride) */
        __m256i b;
        if (k16 - c >= 32) {
            b = _mm256_loadu_si256((const __m256i *)(row + c));
        } else { /* 16-byte tail: the magnitudes of the zero bytes meet zero activations */
            b = _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(row + c)));
            b = _mm256_inserti128_si256(b, _mm_setzero_si128(), 1);
        }
        decode32(b, t, mag, sgn);
        for (int a = 0; a < T; a++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + a * xq_stride + c));
            for (int j = 0; j < 3; j++) acc[a][j] = dot32_mag(acc[a][j], xv, mag[j], sgn[j]);
        }
    }
    for (int a = 0; a < T; a++)
        for (int j = 0; j < 3; j++)
            if ((size_t)j < rows)
                y[a * y_stride + j] = epilogue(hsum(acc[a][j]), x_scale[a], w_scale[j]);
}

/* One token times G packed rows (3G output channels) read at once, and the next block of G rows
 * prefetched front to back (into L1 if `near`, else L2) while this one is read (G lines a 64-byte step, so that the
 * whole next block is requested before its first load): the one-token product's read pattern of
 * the AVX-512 variant. A row's magnitudes and signs live only while that row is accumulated, so G
 * rows take 3G accumulators (G = 2: 6 of the 16 ymm registers). */
static inline __attribute__((always_inline)) void s3d8_groups_token(
    int G, int near, size_t k16, const uint8_t *rows0, size_t left, const int8_t *xq, const magtab *t,
    const uint16_t *w_scale, float x_scale, float *y) {
    __m256i acc[S3D8_STREAMS][3], mag[3], sgn[3];
    size_t next = (size_t)G * k16;
    for (int g = 0; g < G; g++)
        for (int j = 0; j < 3; j++) acc[g][j] = _mm256_setzero_si256();
    size_t c = 0;
    for (; c + 64 <= k16; c += 64, next += (size_t)G * 64) {
        for (int g = 0; g < G; g++) {
            if (next + 64 * g < left) {
                if (near) _mm_prefetch((const char *)rows0 + next + 64 * g, _MM_HINT_T0);
                else _mm_prefetch((const char *)rows0 + next + 64 * g, _MM_HINT_T1);
            }
            for (size_t h = 0; h < 64; h += 32) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + c + h));
                decode32(_mm256_loadu_si256((const __m256i *)(rows0 + g * k16 + c + h)), t, mag, sgn);
                for (int j = 0; j < 3; j++) acc[g][j] = dot32_mag(acc[g][j], xv, mag[j], sgn[j]);
            }
        }
    }
    for (; c < k16; c += 32) { /* 16, 32 or 48 bytes left; x is zero beyond k16 */
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + c));
        for (int g = 0; g < G; g++) {
            __m256i b;
            if (k16 - c >= 32) {
                b = _mm256_loadu_si256((const __m256i *)(rows0 + g * k16 + c));
            } else {
                b = _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(rows0 + g * k16 + c)));
                b = _mm256_inserti128_si256(b, _mm_setzero_si128(), 1);
            }
            decode32(b, t, mag, sgn);
            for (int j = 0; j < 3; j++) acc[g][j] = dot32_mag(acc[g][j], xv, mag[j], sgn[j]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int j = 0; j < 3; j++) y[3 * g + j] = epilogue(hsum(acc[g][j]), x_scale, w_scale[3 * g + j]);
}

static void matmul_s3d8_avx2(size_t m, size_t n, size_t k, const int8_t *xq, size_t xq_stride,
                             const float *x_scale, const int32_t *x_sum, const uint8_t *packed,
                             const int8_t luts[192], const uint16_t *w_scale, float *y,
                             size_t y_stride) {
    (void)x_sum;
    magtab t = load_mags(luts);
    size_t k16 = S3D8_PAD16(k);
    /* start the stream: one token's first block (its loop prefetches each next one), else the first
     * PREFETCH_BYTES (the loop below runs that far ahead) */
    size_t start = m == 1 ? S3D8_STREAMS * k16 : PREFETCH_BYTES;
    int near = s3d8_next_block_to_l1();
    for (size_t b = 0; b < start && b < S3D8_GROUPS(n) * k16; b += 64) {
        if (m == 1 && !near) _mm_prefetch((const char *)packed + b, _MM_HINT_T1);
        else _mm_prefetch((const char *)packed + b, _MM_HINT_T0);
    }
    size_t g = 0;
    if (m == 1) /* whole groups of 3 channels, S3D8_STREAMS packed rows at a time */
        for (; g + S3D8_STREAMS <= n / 3; g += S3D8_STREAMS) {
#define S3D8_CALL(NEAR) s3d8_groups_token(S3D8_STREAMS, NEAR, k16, packed + g * k16,             \
                                          (S3D8_GROUPS(n) - g) * k16, xq, &t, w_scale + 3 * g,   \
                                          x_scale[0], y + 3 * g)
            if (near) S3D8_CALL(1);
            else S3D8_CALL(0);
#undef S3D8_CALL
        }
    for (; g < S3D8_GROUPS(n); g++) {
        const uint8_t *row = packed + g * k16;
        size_t rows = n - 3 * g < 3 ? n - 3 * g : 3;
        for (size_t i = 0; i < m; i += S3D8_TOKENS) {
#define S3D8_CALL(T) s3d8_group_tokens(T, k16, row, xq + i * xq_stride, xq_stride, x_scale + i,  \
                                       &t, w_scale + 3 * g, rows, y + i * y_stride + 3 * g,      \
                                       y_stride)
            switch (m - i < S3D8_TOKENS ? m - i : S3D8_TOKENS) {
            case 1: S3D8_CALL(1); break;
#if S3D8_TOKENS >= 2
            case 2: S3D8_CALL(2); break;
#endif
#if S3D8_TOKENS >= 3
            case 3: S3D8_CALL(3); break;
#endif
#if S3D8_TOKENS >= 4
            case 4: S3D8_CALL(4); break;
#endif
            default: break;
            }
#undef S3D8_CALL
        }
    }
}

/* R weight rows times T tokens, both compile-time constants at each call. |w| is computed once per
 * weight vector and each activation vector is loaded once for the R rows; sign(x, w) depends on
 * both, so it stays per pair: per 32 inputs, R loads + R abs + T loads, then 4 ops per row and
 * token (sign, maddubs, maddwd, add). The accumulators are named variables, not an array: GCC
 * keeps an array in memory and then stores it on every iteration of the k loop. */
#define QSI8_ACC(t, r) acc##t##r
#define QSI8_DOT(t, r, xv, wp)                                                                     \
    if (T > t && R > r) QSI8_ACC(t, r) = dot32_abs(QSI8_ACC(t, r), xv, wa##r, wp)
#define QSI8_TOKEN(t, xp, WP)                                                                      \
    if (T > t) {                                                                                   \
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xp));                                   \
        QSI8_DOT(t, 0, xv, WP(0)); QSI8_DOT(t, 1, xv, WP(1));                                      \
        QSI8_DOT(t, 2, xv, WP(2)); QSI8_DOT(t, 3, xv, WP(3));                                      \
    }
/* one 32-column step at column c, row r's 32 weight bytes at WP(r) */
#define QSI8_STEP(WP)                                                                              \
    do {                                                                                           \
        if (R > 0) wa0 = _mm256_abs_epi8(_mm256_loadu_si256((const __m256i *)WP(0)));             \
        if (R > 1) wa1 = _mm256_abs_epi8(_mm256_loadu_si256((const __m256i *)WP(1)));             \
        if (R > 2) wa2 = _mm256_abs_epi8(_mm256_loadu_si256((const __m256i *)WP(2)));             \
        if (R > 3) wa3 = _mm256_abs_epi8(_mm256_loadu_si256((const __m256i *)WP(3)));             \
        QSI8_TOKEN(0, xq + c, WP);                                                                 \
        QSI8_TOKEN(1, xq + xq_stride + c, WP);                                                     \
        QSI8_TOKEN(2, xq + 2 * xq_stride + c, WP);                                                 \
        QSI8_TOKEN(3, xq + 3 * xq_stride + c, WP);                                                 \
    } while (0)
static inline __attribute__((always_inline)) void qsi8_block(
    int R, int T, size_t k, const int8_t *w, size_t w_stride, const int8_t *xq, size_t xq_stride,
    const float *x_scale, const uint16_t *w_scale, float *y, size_t y_stride) {
    const __m256i z = _mm256_setzero_si256();
    __m256i acc00 = z, acc01 = z, acc02 = z, acc03 = z, acc10 = z, acc11 = z, acc12 = z, acc13 = z,
            acc20 = z, acc21 = z, acc22 = z, acc23 = z, acc30 = z, acc31 = z, acc32 = z, acc33 = z;
    __m256i wa0 = z, wa1 = z, wa2 = z, wa3 = z;
    size_t k32 = k / 32 * 32, c = 0;
#define QSI8_W(r) (w + (r) * w_stride + c)
    for (; c < k32; c += 32) {
        for (int r = 0; r < R; r++)
            _mm_prefetch((const char *)QSI8_W(r) + PREFETCH_BYTES, _MM_HINT_T0);
        QSI8_STEP(QSI8_W);
    }
#undef QSI8_W
    if (c < k) { /* the last k - c < 32 columns: each row's tail copied to a zeroed buffer (a row
                  * may end at k, the end of the allocation); x is zero from k to its stride */
        int8_t buf[4][32];
        for (int r = 0; r < R; r++) {
            memset(buf[r], 0, 32);
            memcpy(buf[r], w + r * w_stride + c, k - c);
        }
#define QSI8_W(r) (buf[r])
        QSI8_STEP(QSI8_W);
#undef QSI8_W
    }
    __m256i acc[4][4] = {{acc00, acc01, acc02, acc03}, {acc10, acc11, acc12, acc13},
                         {acc20, acc21, acc22, acc23}, {acc30, acc31, acc32, acc33}};
    for (int t = 0; t < T; t++)
        for (int r = 0; r < R; r++)
            y[t * y_stride + r] = epilogue(hsum(acc[t][r]), x_scale[t], w_scale[r]);
}
#undef QSI8_STEP
#undef QSI8_TOKEN
#undef QSI8_DOT
#undef QSI8_ACC

static void matmul_qsi8_avx2(size_t m, size_t n, size_t k, const int8_t *xq, size_t xq_stride,
                             const float *x_scale, const int32_t *x_sum, const int8_t *w,
                             size_t w_stride, const uint16_t *w_scale, float *y, size_t y_stride) {
    (void)x_sum;
#define QSI8_CALL(R, T)                                                                            \
    qsi8_block(R, T, k, w + c * w_stride, w_stride, xq + i * xq_stride, xq_stride, x_scale + i,   \
               w_scale + c, y + i * y_stride + c, y_stride)
#define QSI8_TOKENS(R)                                                                             \
    switch (tb) {                                                                                  \
    case 1: QSI8_CALL(R, 1); break;                                                                \
    case 2: QSI8_CALL(R, 2); break;                                                                \
    case 3: QSI8_CALL(R, 3); break;                                                                \
    default: QSI8_CALL(R, 4); break;                                                               \
    }
    /* m <= 4: one weight row at a time, all tokens at once (a single linear stream); more tokens:
     * blocks of QSI8_BLOCK_ROWS rows x QSI8_BLOCK_TOKENS tokens, the weight block staying in cache
     * while the tokens stream past it */
    size_t rows = m <= 4 ? 1 : QSI8_BLOCK_ROWS, tokens = m <= 4 ? m : QSI8_BLOCK_TOKENS;
    for (size_t c = 0; c < n; c += rows) {
        size_t rb = n - c < rows ? n - c : rows;
        for (size_t i = 0; i < m; i += tokens) {
            size_t tb = m - i < tokens ? m - i : tokens;
            switch (rb) {
            case 1: QSI8_TOKENS(1); break;
#if QSI8_BLOCK_ROWS >= 2
            case 2: QSI8_TOKENS(2); break;
#endif
#if QSI8_BLOCK_ROWS >= 3
            case 3: QSI8_TOKENS(3); break;
#endif
#if QSI8_BLOCK_ROWS >= 4
            case 4: QSI8_TOKENS(4); break;
#endif
            default: break;
            }
        }
    }
#undef QSI8_TOKENS
#undef QSI8_CALL
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
