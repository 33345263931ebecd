/* Self-test driver: every variant this CPU supports against the scalar reference, bit for bit, on
 * random and edge shapes (n not a multiple of 3, k not a multiple of 16 or 64, m = 1..17, all-zero
 * rows, extreme values), for 1 and 3 threads. Buffers are allocated to their exact size so that
 * AddressSanitizer sees any out-of-bounds access. Used by the tests natively, under ASan, and
 * cross-compiled for aarch64 under qemu. Prints one line per variant; exit status 0 when all pass.
 *
 * Edge inputs (test_nonfinite, test_k_bound): activation rows with NaN / +-Inf (in the vector body
 * and in the scalar tail), non-finite channel scales (NaN, +-Inf, signalling and negative NaN), the
 * policy of s3d8.h checked directly (NaN rows and columns, canonical NaN bits) and every variant
 * equal to the reference bit for bit; INT8 weights of -128; k = S3D8_K_MAX with the largest possible
 * dot product (exact), and k = S3D8_K_MAX + 1 refused by every driver; a negative centroid refused.
 *
 *   s3d8_selftest [--quick]
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "s3d8.h"

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t next_u32(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 11);
}
static float next_normal(void) { /* a cheap bell shape: sum of uniforms */
    float s = 0;
    for (int i = 0; i < 4; i++) s += (float)(next_u32() & 0xFFFF) / 65536.0f - 0.5f;
    return s;
}

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) { fprintf(stderr, "out of memory\n"); exit(2); }
    return p;
}

static int failures = 0;
static void check(int ok, const char *variant, const char *what, size_t m, size_t n, size_t k, int threads) {
    if (!ok) {
        failures++;
        printf("FAIL %s %s m=%zu n=%zu k=%zu threads=%d\n", variant, what, m, n, k, threads);
    }
}

/* x rows: random, with an all-zero row, an extreme row and a row of one spike. */
static void fill_x(float *x, size_t m, size_t k) {
    for (size_t i = 0; i < m; i++)
        for (size_t j = 0; j < k; j++) {
            float v = next_normal() * 3.0f;
            if (i % 5 == 1) v = 0.0f;
            if (i % 5 == 2) v = (j % 2 ? 1e6f : -1e6f);
            if (i % 5 == 3) v = (j == k / 2) ? -7.5f : next_normal() * 1e-3f;
            x[i * k + j] = v;
        }
}

static void test_shape(int v, size_t m, size_t n, size_t k) {
    const char *name = s3d8_variant_get(v)->name;
    size_t ls = S3D8_LHS_STRIDE(k), k16 = S3D8_PAD16(k), groups = S3D8_GROUPS(n);
    float *x = xmalloc(m * k * sizeof(float));
    int8_t *xq_ref = xmalloc(m * ls), *xq = xmalloc(m * ls);
    float *xs_ref = xmalloc(m * sizeof(float)), *xs = xmalloc(m * sizeof(float));
    int32_t *xsum_ref = xmalloc(m * sizeof(int32_t)), *xsum = xmalloc(m * sizeof(int32_t));
    uint8_t *packed = xmalloc(groups * k16);
    int8_t table[96], *w8 = xmalloc(n * k), *w_ref = xmalloc(n * k), *w_out = xmalloc(n * k);
    uint16_t *w_scale = xmalloc(n * sizeof(uint16_t)), *w_bf16 = xmalloc(n * k * sizeof(uint16_t));
    float *y_ref = xmalloc(m * n * sizeof(float)), *y = xmalloc(m * n * sizeof(float));
    int8_t *work = xmalloc(3 * 3 * 4 * ls);

    fill_x(x, m, k);
    for (int i = 0; i < 96; i++) table[i] = (int8_t)(i < 3 ? 127 : next_u32() % 128);
    for (size_t i = 0; i < groups * k16; i++) packed[i] = (uint8_t)next_u32();
    for (size_t i = 0; i < k16 && groups; i++) packed[i] = (uint8_t)(i % 2 ? 0x00 : 0xC1); /* +-127 */
    for (size_t i = 0; i < n * k; i++) w8[i] = (int8_t)((int)(next_u32() % 255) - 127);
    for (size_t i = 0; i < k; i++) w8[i] = (int8_t)(i % 2 ? 127 : -127);
    for (size_t i = 0; i < n; i++) w_scale[i] = s3d8_bf16_from_f32(0.01f + (float)(next_u32() % 100) * 1e-3f);
    for (size_t i = 0; i < n * k; i++) w_bf16[i] = s3d8_bf16_from_f32(next_normal());

    int ref = s3d8_variant_find("scalar");
    s3d8_quant(ref, 1, m, k, x, k, xq_ref, ls, xs_ref, xsum_ref);
    for (int threads = 1; threads <= 3; threads += 2) {
        memset(xq, 0x55, m * ls);
        s3d8_quant(v, threads, m, k, x, k, xq, ls, xs, xsum);
        check(!memcmp(xq, xq_ref, m * ls) && !memcmp(xs, xs_ref, m * sizeof(float)) &&
              !memcmp(xsum, xsum_ref, m * sizeof(int32_t)), name, "quant", m, n, k, threads);

        s3d8_decode(ref, 1, n, k, packed, table, w_ref, k);
        s3d8_decode(v, threads, n, k, packed, table, w_out, k);
        check(!memcmp(w_out, w_ref, n * k), name, "decode", m, n, k, threads);

        s3d8_matmul_s3d8(ref, 1, m, n, k, xq_ref, ls, xs_ref, xsum_ref, packed, table, w_scale, y_ref, n);
        s3d8_matmul_s3d8(v, threads, m, n, k, xq_ref, ls, xs_ref, xsum_ref, packed, table, w_scale, y, n);
        check(!memcmp(y, y_ref, m * n * sizeof(float)), name, "matmul_s3d8", m, n, k, threads);

        s3d8_matmul_s3d8_tiled(v, threads, m, n, k, xq_ref, ls, xs_ref, xsum_ref, packed, table, w_scale, y, n, work, 4);
        check(!memcmp(y, y_ref, m * n * sizeof(float)), name, "matmul_s3d8_tiled", m, n, k, threads);

        /* the decoded weights through the INT8 kernel give the same product */
        s3d8_matmul_qsi8(v, threads, m, n, k, xq_ref, ls, xs_ref, xsum_ref, w_ref, k, w_scale, y, n);
        check(!memcmp(y, y_ref, m * n * sizeof(float)), name, "matmul_qsi8(decoded)", m, n, k, threads);

        s3d8_matmul_qsi8(ref, 1, m, n, k, xq_ref, ls, xs_ref, xsum_ref, w8, k, w_scale, y_ref, n);
        s3d8_matmul_qsi8(v, threads, m, n, k, xq_ref, ls, xs_ref, xsum_ref, w8, k, w_scale, y, n);
        check(!memcmp(y, y_ref, m * n * sizeof(float)), name, "matmul_qsi8", m, n, k, threads);

        int32_t *acc = xmalloc(m * n * sizeof(int32_t));
        for (size_t i = 0; i < m * n; i++) acc[i] = (int32_t)(next_u32() >> 1) - (1 << 30);
        s3d8_dequant(ref, 1, m, n, acc, n, xs_ref, w_scale, y_ref, n);
        s3d8_dequant(v, threads, m, n, acc, n, xs_ref, w_scale, y, n);
        check(!memcmp(y, y_ref, m * n * sizeof(float)), name, "dequant", m, n, k, threads);
        free(acc);

        s3d8_matmul_bf16(ref, 1, m, n, k, x, k, w_bf16, k, y_ref, n);
        s3d8_matmul_bf16(v, threads, m, n, k, x, k, w_bf16, k, y, n);
        int close = 1;
        for (size_t i = 0; i < m; i++) {
            float mag = 0;
            for (size_t j = 0; j < k; j++) mag += fabsf(x[i * k + j]) * 4.0f;
            for (size_t c = 0; c < n; c++)
                close &= fabsf(y[i * n + c] - y_ref[i * n + c]) <= 1e-5f * mag + 1e-30f;
        }
        check(close, name, "matmul_bf16 (tolerance)", m, n, k, threads);
    }
    free(x); free(xq_ref); free(xq); free(xs_ref); free(xs); free(xsum_ref); free(xsum);
    free(packed); free(w8); free(w_ref); free(w_out); free(w_scale); free(w_bf16); free(y_ref);
    free(y); free(work);
}

static void test_encode(int v) {
    /* every variant's encoder (the same C for another target) equals the reference, any thread count */
    size_t shapes[][2] = {{1, 1}, {7, 33}, {10, 100}, {64, 80}, {5, 300}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        size_t n = shapes[s][0], k = shapes[s][1], bytes = S3D8_GROUPS(n) * S3D8_PAD16(k);
        float *w = xmalloc(n * k * sizeof(float));
        uint8_t *p1 = xmalloc(bytes), *p3 = xmalloc(bytes);
        uint16_t *s1 = xmalloc(n * 2), *s3 = xmalloc(n * 2);
        int8_t table[96];
        for (int i = 0; i < 96; i++) table[i] = (int8_t)(next_u32() % 128);
        for (size_t i = 0; i < n * k; i++) w[i] = (i / k) % 4 == 2 ? 0.0f : next_normal();
        s3d8_encode(s3d8_variant_find("scalar"), 1, n, k, w, k, table, p1, s1);
        s3d8_encode(v, 3, n, k, w, k, table, p3, s3);
        check(!memcmp(p1, p3, bytes) && !memcmp(s1, s3, n * 2), s3d8_variant_get(v)->name, "encode", 0, n, k, 3);
        free(w); free(p1); free(p3); free(s1); free(s3);
    }
}

static uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* Non-finite activations and channel scales: the policy of s3d8.h, the same in every variant. */
static void test_nonfinite(int v, size_t m, size_t n, size_t k) {
    const char *name = s3d8_variant_get(v)->name;
    int ref = s3d8_variant_find("scalar");
    size_t ls = S3D8_LHS_STRIDE(k), k16 = S3D8_PAD16(k), groups = S3D8_GROUPS(n);
    float *x = xmalloc(m * k * sizeof(float));
    int8_t *xq_ref = xmalloc(m * ls), *xq = xmalloc(m * ls), *w8 = xmalloc(n * k);
    float *xs_ref = xmalloc(m * sizeof(float)), *xs = xmalloc(m * sizeof(float));
    int32_t *xsum_ref = xmalloc(m * sizeof(int32_t)), *xsum = xmalloc(m * sizeof(int32_t));
    uint8_t *packed = xmalloc(groups * k16);
    uint16_t *w_scale = xmalloc(n * sizeof(uint16_t));
    float *y_ref = xmalloc(m * n * sizeof(float)), *y = xmalloc(m * n * sizeof(float));
    int32_t *acc = xmalloc(m * n * sizeof(int32_t));
    int8_t table[96], *work = xmalloc(3 * 3 * 2 * ls), *lin = xmalloc(S3D8_LINEAR_WORK(m, k));
    const uint16_t bad_scales[] = {0x7FC0, 0x7F80, 0xFF80, 0x7F81, 0xFFC0}; /* NaN, +Inf, -Inf, sNaN, -NaN */
    int *row_bad = xmalloc(m * sizeof(int)), *col_bad = xmalloc(n * sizeof(int));

    for (size_t i = 0; i < m; i++) {
        for (size_t j = 0; j < k; j++) x[i * k + j] = next_normal() * 5.0f;
        size_t at = (i * 7) % k;                  /* body or tail, by row */
        row_bad[i] = 1;
        switch (i % 6) {
        case 0: x[i * k + at] = NAN; break;
        case 1: x[i * k + at] = INFINITY; break;
        case 2: x[i * k + k - 1] = -INFINITY; break;   /* the last element: a scalar tail */
        case 3: row_bad[i] = 0; break;
        case 4: x[i * k] = NAN; x[i * k + k - 1] = INFINITY; break;
        default: x[i * k] = 1e30f; x[i * k + k - 1 - at / 2] = -NAN; break; /* NaN after a huge value */
        }
    }
    for (int i = 0; i < 96; i++) table[i] = (int8_t)(next_u32() % 128);
    for (size_t i = 0; i < groups * k16; i++) packed[i] = (uint8_t)next_u32();
    for (size_t i = 0; i < n * k; i++) w8[i] = (int8_t)(next_u32() & 0xFF); /* -128 included */
    for (size_t c = 0; c < n; c++) {
        col_bad[c] = c % 3 == 1;
        w_scale[c] = col_bad[c] ? bad_scales[(c / 3) % 5] : s3d8_bf16_from_f32(0.01f + (float)c * 1e-3f);
    }

    s3d8_quant(ref, 1, m, k, x, k, xq_ref, ls, xs_ref, xsum_ref);
    int policy = 1;
    for (size_t i = 0; i < m; i++) {
        if (!row_bad[i]) { policy &= xs_ref[i] == xs_ref[i]; continue; }
        policy &= bits_of(xs_ref[i]) == 0x7FC00000u && xsum_ref[i] == 0;
        for (size_t j = 0; j < ls; j++) policy &= xq_ref[i * ls + j] == 0;
    }
    check(policy, name, "nonfinite quant policy (reference)", m, n, k, 1);

    for (int threads = 1; threads <= 3; threads += 2) {
        memset(xq, 0x55, m * ls);
        s3d8_quant(v, threads, m, k, x, k, xq, ls, xs, xsum);
        check(!memcmp(xq, xq_ref, m * ls) && !memcmp(xs, xs_ref, m * sizeof(float)) &&
              !memcmp(xsum, xsum_ref, m * sizeof(int32_t)), name, "nonfinite quant", m, n, k, threads);

        s3d8_matmul_s3d8(ref, 1, m, n, k, xq_ref, ls, xs_ref, xsum_ref, packed, table, w_scale, y_ref, n);
        int ok = 1;
        for (size_t i = 0; i < m; i++)
            for (size_t c = 0; c < n; c++) {
                float r = y_ref[i * n + c];
                ok &= (row_bad[i] || col_bad[c]) ? bits_of(r) == 0x7FC00000u : r == r;
            }
        check(ok, name, "nonfinite matmul policy (reference)", m, n, k, threads);

        memset(y, 0, m * n * sizeof(float));
        s3d8_matmul_s3d8(v, threads, m, n, k, xq_ref, ls, xs_ref, xsum_ref, packed, table, w_scale, y, n);
        check(!memcmp(y, y_ref, m * n * sizeof(float)), name, "nonfinite matmul_s3d8", m, n, k, threads);
        memset(y, 0, m * n * sizeof(float));
        s3d8_matmul_s3d8_tiled(v, threads, m, n, k, xq_ref, ls, xs_ref, xsum_ref, packed, table, w_scale, y, n, work, 2);
        check(!memcmp(y, y_ref, m * n * sizeof(float)), name, "nonfinite matmul_s3d8_tiled", m, n, k, threads);
        memset(y, 0, m * n * sizeof(float));
        s3d8_linear_s3d8(v, threads, m, n, k, x, k, packed, table, w_scale, y, n, lin);
        check(!memcmp(y, y_ref, m * n * sizeof(float)), name, "nonfinite linear_s3d8", m, n, k, threads);

        s3d8_matmul_qsi8(ref, 1, m, n, k, xq_ref, ls, xs_ref, xsum_ref, w8, k, w_scale, y_ref, n);
        memset(y, 0, m * n * sizeof(float));
        s3d8_matmul_qsi8(v, threads, m, n, k, xq_ref, ls, xs_ref, xsum_ref, w8, k, w_scale, y, n);
        check(!memcmp(y, y_ref, m * n * sizeof(float)), name, "nonfinite matmul_qsi8 (w -128)", m, n, k, threads);
        memset(y, 0, m * n * sizeof(float));
        s3d8_linear_qsi8(v, threads, m, n, k, x, k, w8, k, w_scale, y, n, lin);
        check(!memcmp(y, y_ref, m * n * sizeof(float)), name, "nonfinite linear_qsi8", m, n, k, threads);
        /* the INT8 product with weights of -128 is exact: the reference against int64 arithmetic */
        ok = 1;
        for (size_t i = 0; i < m; i++)
            for (size_t c = 0; c < n && !row_bad[i]; c++) {
                int64_t dot = 0;
                for (size_t j = 0; j < k; j++) dot += (int64_t)xq_ref[i * ls + j] * w8[c * k + j];
                float e = ((float)(int32_t)dot * xs_ref[i]) * s3d8_f32_from_bf16(w_scale[c]);
                ok &= col_bad[c] ? bits_of(y_ref[i * n + c]) == 0x7FC00000u : bits_of(e) == bits_of(y_ref[i * n + c]);
            }
        check(ok, name, "matmul_qsi8 reference exact for w = -128", m, n, k, threads);

        for (size_t i = 0; i < m * n; i++) acc[i] = (int32_t)(next_u32() >> 1) - (1 << 30);
        s3d8_dequant(ref, 1, m, n, acc, n, xs_ref, w_scale, y_ref, n);
        memset(y, 0, m * n * sizeof(float));
        s3d8_dequant(v, threads, m, n, acc, n, xs_ref, w_scale, y, n);
        check(!memcmp(y, y_ref, m * n * sizeof(float)), name, "nonfinite dequant", m, n, k, threads);
    }
    free(x); free(xq_ref); free(xq); free(w8); free(xs_ref); free(xs); free(xsum_ref); free(xsum);
    free(packed); free(w_scale); free(y_ref); free(y); free(acc); free(work); free(lin);
    free(row_bad); free(col_bad);
}

/* k at the int32 bound: the largest possible dot products are exact in every variant and path;
 * one more input is refused (-2) by every product driver. */
static void test_k_bound(int v) {
    const char *name = s3d8_variant_get(v)->name;
    int ref = s3d8_variant_find("scalar");
    const size_t m = 2, n = 4;
    for (int variant_case = 0; variant_case < 2; variant_case++) {
        /* case 0: S3D8 / INT8 weights +-127 at S3D8_K_MAX; case 1: INT8 weights -128 at S3D8_K_MAX_INT8_FULL */
        size_t k = variant_case ? S3D8_K_MAX_INT8_FULL : S3D8_K_MAX;
        size_t ls = S3D8_LHS_STRIDE(k + 1), k16 = S3D8_PAD16(k + 1), groups = S3D8_GROUPS(n);
        float *x = xmalloc(m * (k + 1) * sizeof(float));
        int8_t *xq = xmalloc(m * ls), *w8 = xmalloc(n * (k + 1)), *work = xmalloc(3 * 3 * 1 * ls);
        float *xs = xmalloc(m * sizeof(float)), *y = xmalloc(m * n * sizeof(float));
        int32_t *xsum = xmalloc(m * sizeof(int32_t));
        uint8_t *packed = xmalloc(groups * k16);
        uint16_t w_scale[4];
        int8_t table[96], *lin = xmalloc(S3D8_LINEAR_WORK(m, k + 1));
        for (size_t j = 0; j < k + 1; j++) { x[j] = 1000.0f; x[(k + 1) + j] = -1000.0f; }
        for (int i = 0; i < 96; i++) table[i] = i < 3 ? 127 : 0;
        memset(packed, 0, groups * k16);                      /* q = 0, signs + : w = +127 */
        memset(w8, variant_case ? -128 : 127, n * (k + 1));
        for (size_t c = 0; c < n; c++) w_scale[c] = s3d8_bf16_from_f32(1.0f / 64.0f);
        int64_t wv = variant_case ? -128 : 127;
        int ok = 1;
        for (int threads = 1; threads <= 3; threads += 2) {
            s3d8_quant(v, threads, m, k, x, k + 1, xq, ls, xs, xsum);
            ok &= xq[0] == 127 && xq[ls] == -127;
            for (size_t i = 0; i < m; i++) {
                int64_t dot = (i ? -127 : 127) * wv * (int64_t)k;
                ok &= dot <= INT32_MAX && dot >= INT32_MIN;
                float e = ((float)(int32_t)dot * xs[i]) * (1.0f / 64.0f);
                for (int path = 0; path < 4; path++) {
                    if (variant_case && path != 2) continue;     /* -128 is an INT8 weight only */
                    memset(y, 0, m * n * sizeof(float));
                    int rc = path == 0 ? s3d8_matmul_s3d8(v, threads, m, n, k, xq, ls, xs, xsum, packed, table, w_scale, y, n)
                           : path == 1 ? s3d8_matmul_s3d8_tiled(v, threads, m, n, k, xq, ls, xs, xsum, packed, table, w_scale, y, n, work, 1)
                           : path == 2 ? s3d8_matmul_qsi8(v, threads, m, n, k, xq, ls, xs, xsum, w8, k + 1, w_scale, y, n)
                                       : s3d8_matmul_qsi8(ref, 1, m, n, k, xq, ls, xs, xsum, w8, k + 1, w_scale, y, n);
                    ok &= rc == 0;
                    for (size_t c = 0; c < n; c++) ok &= bits_of(y[i * n + c]) == bits_of(e) || (path == 3 && variant_case == 0);
                }
            }
            check(ok, name, variant_case ? "k bound, INT8 weights -128" : "k bound (S3D8_K_MAX)", m, n, k, threads);
        }
        if (!variant_case) { /* one more input: refused, nothing written */
            size_t k1 = S3D8_K_MAX + 1;
            s3d8_quant(v, 1, m, k1, x, k1, xq, ls, xs, xsum);
            int refused = s3d8_matmul_s3d8(v, 1, m, n, k1, xq, ls, xs, xsum, packed, table, w_scale, y, n) == -2 &&
                          s3d8_matmul_qsi8(v, 1, m, n, k1, xq, ls, xs, xsum, w8, k1, w_scale, y, n) == -2 &&
                          s3d8_matmul_s3d8_tiled(v, 1, m, n, k1, xq, ls, xs, xsum, packed, table, w_scale, y, n, work, 1) == -2 &&
                          s3d8_linear_s3d8(v, 1, m, n, k1, x, k1, packed, table, w_scale, y, n, lin) == -2 &&
                          s3d8_linear_qsi8(v, 1, m, n, k1, x, k1, w8, k1, w_scale, y, n, lin) == -2;
            check(refused, name, "k = S3D8_K_MAX + 1 refused", m, n, k1, 1);
        }
        free(x); free(xq); free(w8); free(work); free(xs); free(y); free(xsum); free(packed); free(lin);
    }
}

/* A centroid table with a negative value is refused (-3) before any kernel writes. */
static void test_bad_table(int v) {
    const size_t m = 2, n = 5, k = 20, ls = S3D8_LHS_STRIDE(k);
    int8_t table[96], xq[2 * 64] = {0}, w[5 * 20], work[3 * 3 * 64], lin[S3D8_LINEAR_WORK(2, 20)];
    uint8_t packed[2 * 32] = {0};
    float x[2 * 20] = {0}, xs[2] = {1, 1}, y[2 * 5];
    int32_t xsum[2] = {0, 0};
    uint16_t ws[5] = {0x3F80, 0x3F80, 0x3F80, 0x3F80, 0x3F80};
    memset(table, 1, sizeof table);
    table[50] = -128;
    memset(w, 0x55, sizeof w);
    memset(y, 0x55, sizeof y);
    int ok = s3d8_decode(v, 1, n, k, packed, table, w, k) == -3 &&
             s3d8_matmul_s3d8(v, 1, m, n, k, xq, ls, xs, xsum, packed, table, ws, y, n) == -3 &&
             s3d8_matmul_s3d8_tiled(v, 1, m, n, k, xq, ls, xs, xsum, packed, table, ws, y, n, work, 1) == -3 &&
             s3d8_linear_s3d8(v, 1, m, n, k, x, k, packed, table, ws, y, n, lin) == -3;
    for (size_t i = 0; i < sizeof w; i++) ok &= w[i] == 0x55;
    for (size_t i = 0; i < m * n; i++) ok &= bits_of(y[i]) == 0x55555555u;
    check(ok, s3d8_variant_get(v)->name, "negative centroid refused", m, n, k, 1);
}

/* ---- the decode step: every variant and thread count gives the reference's logits ------------- */

/* D_HD = 32 and D_POS = 40: the attention's 16-keys-a-vector path and its scalar tail both run */
enum { D_HID = 40, D_NH = 4, D_NKV = 2, D_HD = 32, D_INTER = 70, D_VOCAB = 31, D_POS = 40, D_CROSS = 21 };

static uint16_t small_scale(void) { return s3d8_bf16_from_f32(0.002f + 0.01f * (float)(next_u32() % 100) / 100.0f); }

static s3d8_weight random_weight(int kind, size_t n, size_t k, const int8_t *table) {
    size_t bytes = kind == S3D8_W_S3D8 ? S3D8_GROUPS(n) * S3D8_PAD16(k) : n * k * (kind == S3D8_W_BF16 ? 2 : 1);
    uint8_t *data = xmalloc(bytes);
    uint16_t *scale = xmalloc(n * sizeof *scale);
    for (size_t i = 0; i < bytes; i++) data[i] = (uint8_t)next_u32();
    if (kind == S3D8_W_BF16)
        for (size_t i = 0; i < n * k; i++) ((uint16_t *)data)[i] = s3d8_bf16_from_f32(0.05f * next_normal());
    for (size_t i = 0; i < n; i++) scale[i] = small_scale();
    return (s3d8_weight){kind, n, k, data, table, scale};
}

static float *random_floats(size_t n, float centre, float spread) {
    float *f = xmalloc(n * sizeof *f);
    for (size_t i = 0; i < n; i++) f[i] = centre + spread * next_normal();
    return f;
}

static void free_weight(s3d8_weight *w) { free((void *)w->data); free((void *)w->scale); }

/* Two layers (self-attention, then a live cross-attention layer) of `kind` weights, D_POS tokens. */
static void test_decoder(int v, int kind) {
    int8_t table[96];
    for (int i = 0; i < 96; i++) table[i] = (int8_t)(next_u32() % 128);
    s3d8_layer layers[2];
    memset(layers, 0, sizeof layers);
    float *caches[2][2];
    for (int l = 0; l < 2; l++) {
        s3d8_layer *L = &layers[l];
        L->ln1 = random_floats(D_HID, 1.0f, 0.1f), L->ln2 = random_floats(D_HID, 1.0f, 0.1f);
        L->q = random_weight(kind, D_NH * D_HD, D_HID, table);
        L->k = random_weight(kind, D_NKV * D_HD, D_HID, table);
        L->v = random_weight(kind, D_NKV * D_HD, D_HID, table);
        L->o = random_weight(kind, D_HID, D_NH * D_HD, table);
        L->gate = random_weight(kind, D_INTER, D_HID, table);
        L->up = random_weight(kind, D_INTER, D_HID, table);
        L->down = random_weight(kind, D_HID, D_INTER, table);
        L->cache_len = l ? D_CROSS : D_POS;
        for (int c = 0; c < 2; c++) caches[l][c] = random_floats(D_NKV * L->cache_len * D_HD, 0.0f, 0.5f);
        L->k_cache = caches[l][0], L->v_cache = caches[l][1];
    }
    float bias[D_CROSS] = {0.0f, -3.0f, 0.0f, -3.4e38f, 0.5f};
    layers[1].cross = 1, layers[1].q_norm = random_floats(D_HD, 1.0f, 0.1f), layers[1].bias = bias;
    layers[1].attn_gate = 0.7f, layers[1].mlp_gate = -0.4f, layers[1].mlp_row_mask = 1.0f;
    s3d8_decoder d = {.n_layers = 2, .hidden = D_HID, .n_heads = D_NH, .n_kv_heads = D_NKV, .head_dim = D_HD,
                      .eps = 1e-5f, .layers = layers, .norm = random_floats(D_HID, 1.0f, 0.1f),
                      .cos = random_floats(D_POS * D_HD, 0.5f, 0.3f), .sin_rolled = random_floats(D_POS * D_HD, 0.0f, 0.5f),
                      .rope_len = D_POS};
    d.embed = random_weight(kind, D_VOCAB, D_HID, table), d.lm_head = random_weight(kind, D_VOCAB, D_HID, table);
    void *work = xmalloc(s3d8_decoder_work_bytes(&d) + 64);
    d.work = (void *)(((uintptr_t)work + 63) / 64 * 64);
    size_t where;
    const char *name = s3d8_variant_get(v)->name;
    check(s3d8_decoder_check(&d, &where) == 0, name, "decoder check", 1, D_VOCAB, D_HID, 1);
    float *self_k = xmalloc(sizeof(float) * D_NKV * D_POS * D_HD), *want = xmalloc(sizeof(float) * D_POS * D_VOCAB);
    memcpy(self_k, caches[0][0], sizeof(float) * D_NKV * D_POS * D_HD);
    for (int run = 0; run < 3; run++) {       /* the reference on 1 thread, the variant on 1 and on 2 */
        int var = run ? v : 0, threads = run == 2 ? 2 : 1, ok = 1;
        memcpy(caches[0][0], self_k, sizeof(float) * D_NKV * D_POS * D_HD);
        for (size_t pos = 0; pos < D_POS; pos++) {
            float logits[D_VOCAB];
            ok &= s3d8_decoder_step(var, threads, &d, (int64_t)(pos * 7 % D_VOCAB), pos, logits) == 0;
            for (int i = 0; i < D_VOCAB; i++) {
                if (!run) want[pos * D_VOCAB + i] = logits[i];
                ok &= isfinite(logits[i]) && (kind == S3D8_W_BF16 || bits_of(logits[i]) == bits_of(want[pos * D_VOCAB + i]));
            }
        }
        check(ok, name, kind == S3D8_W_S3D8 ? "decoder step s3d8 = reference" : "decoder step qsi8/bf16 = reference",
              1, D_VOCAB, D_HID, threads);
    }
    check(s3d8_decoder_step(v, 1, &d, D_VOCAB, 0, want) == -5 && s3d8_decoder_step(v, 1, &d, 0, D_POS, want) == -4,
          name, "decoder step refuses a bad token or position", 1, D_VOCAB, D_HID, 1);
    for (int l = 0; l < 2; l++) {
        s3d8_layer *L = &layers[l];
        s3d8_weight *ws[] = {&L->q, &L->k, &L->v, &L->o, &L->gate, &L->up, &L->down};
        for (int i = 0; i < 7; i++) free_weight(ws[i]);
        free((void *)L->ln1); free((void *)L->ln2); free(caches[l][0]); free(caches[l][1]);
    }
    free((void *)layers[1].q_norm); free((void *)d.norm); free((void *)d.cos); free((void *)d.sin_rolled);
    free_weight(&d.embed); free_weight(&d.lm_head); free(self_k); free(want); free(work);
}

int main(int argc, char **argv) {
    int quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    size_t ns[] = {1, 2, 3, 4, 7, 13, 48, 100};
    size_t ks[] = {1, 15, 16, 17, 63, 64, 65, 100, 130, 257};
    for (int v = 0; v < s3d8_variant_count(); v++) {
        if (!s3d8_variant_supported(v)) {
            printf("SKIP %s (not supported by this CPU)\n", s3d8_variant_get(v)->name);
            continue;
        }
        int before = failures;
        test_encode(v);
        test_bad_table(v);
        test_k_bound(v);
        test_decoder(v, S3D8_W_S3D8);
        test_decoder(v, S3D8_W_QSI8);
        test_decoder(v, S3D8_W_BF16);
        {
            size_t nf_m[] = {1, 2, 5, 6, 7, 17}, nf_n[] = {1, 4, 7, 13}, nf_k[] = {1, 7, 16, 17, 65, 130};
            for (size_t a = 0; a < 6; a++)
                for (size_t b = 0; b < 4; b++)
                    for (size_t c = 0; c < 6; c++)
                        if (!quick || (a + b + c) % 2 == 0) test_nonfinite(v, nf_m[a], nf_n[b], nf_k[c]);
        }
        for (size_t m = 1; m <= 17; m += quick ? 8 : 1)
            for (size_t a = 0; a < sizeof ns / sizeof ns[0]; a++)
                for (size_t b = 0; b < sizeof ks / sizeof ks[0]; b++)
                    if (!quick || (a + b + m) % 3 == 0) test_shape(v, m, ns[a], ks[b]);
        printf("%s %s\n", failures == before ? "OK" : "FAIL", s3d8_variant_get(v)->name);
    }
    printf(failures ? "FAILED %d checks\n" : "ALL OK\n", failures);
    return failures ? 1 : 0;
}
