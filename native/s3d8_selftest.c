/* Self-test driver: every variant this CPU supports against the scalar reference, bit for bit, on
 * random and edge shapes (n not a multiple of 3, k not a multiple of 16 or 64, m = 1..17, all-zero
 * rows, extreme values), for 1 and 3 threads. Buffers are allocated to their exact size so that
 * AddressSanitizer sees any out-of-bounds access. Used by the tests natively, under ASan, and
 * cross-compiled for aarch64 under qemu. Prints one line per variant; exit status 0 when all pass.
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
        for (size_t m = 1; m <= 17; m += quick ? 8 : 1)
            for (size_t a = 0; a < sizeof ns / sizeof ns[0]; a++)
                for (size_t b = 0; b < sizeof ks / sizeof ks[0]; b++)
                    if (!quick || (a + b + m) % 3 == 0) test_shape(v, m, ns[a], ks[b]);
        printf("%s %s\n", failures == before ? "OK" : "FAIL", s3d8_variant_get(v)->name);
    }
    printf(failures ? "FAILED %d checks\n" : "ALL OK\n", failures);
    return failures ? 1 : 0;
}
