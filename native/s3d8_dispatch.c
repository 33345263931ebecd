/* Variant table, CPU feature detection and the threaded drivers.
 *
 * Threads split output channels (whole groups of 3 for S3D8) into contiguous chunks, so every
 * output is computed by one thread with the same arithmetic whatever the thread count. OpenMP is
 * optional: without it the drivers run on the calling thread. */
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

#include "s3d8.h"
#include "s3d8_internal.h"

static const s3d8_variant *const VARIANTS[] = {
    &s3d8_variant_ref,
#if defined(__x86_64__) || defined(_M_X64)
    &s3d8_variant_avx2,
    &s3d8_variant_avx512,
#endif
#if defined(__aarch64__)
    &s3d8_variant_neon,
    &s3d8_variant_neon_i8mm,
#endif
};
#define N_VARIANTS ((int)(sizeof VARIANTS / sizeof VARIANTS[0]))

int s3d8_variant_count(void) { return N_VARIANTS; }

const s3d8_variant *s3d8_variant_get(int i) {
    return i >= 0 && i < N_VARIANTS ? VARIANTS[i] : NULL;
}

static int cpu_has(const char *name) {
    if (strcmp(name, "scalar") == 0) return 1;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    if (strcmp(name, "avx2") == 0) return __builtin_cpu_supports("avx2");
    if (strcmp(name, "avx512") == 0)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi") &&
               __builtin_cpu_supports("avx512vnni");
#endif
#if defined(__aarch64__)
#if defined(__linux__)
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1 << 13)
#endif
    int dot = (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
    if (strcmp(name, "neon") == 0) return dot;
    if (strcmp(name, "neon_i8mm") == 0) return dot && (getauxval(AT_HWCAP2) & HWCAP2_I8MM) != 0;
#else
    if (strcmp(name, "neon") == 0) return 1; /* no portable probe: assume an Armv8.2+ core */
#endif
#endif
    return 0;
}

/* Where the one-token S3D8 products prefetch their next block (s3d8.h). Measured with s3d8_bench,
 * weights from memory, one thread: on an AMD EPYC (Zen 4) the L2 hint halves the product (AVX-512
 * 16-32 against 30-70 GMAC/s, AVX2 10-18 against 23-36; reports/kernels-next-prefetch/); on an
 * Intel Xeon L1 was no better than the L2 block prefetch it was tuned with (commit 787e787). */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
static int next_block_l1;

__attribute__((constructor)) static void choose_next_block_prefetch(void) {
    const char *forced = getenv("S3D8_NEXT_PREFETCH");
    __builtin_cpu_init();
    if (forced && strcmp(forced, "l1") == 0) next_block_l1 = 1;
    else if (forced && strcmp(forced, "l2") == 0) next_block_l1 = 0;
    else next_block_l1 = __builtin_cpu_is("amd");
}

int s3d8_next_block_to_l1(void) { return next_block_l1; }
#else
int s3d8_next_block_to_l1(void) { return -1; }
#endif

int s3d8_variant_supported(int i) {
    return i >= 0 && i < N_VARIANTS && cpu_has(VARIANTS[i]->name);
}

int s3d8_variant_find(const char *name) {
    for (int i = 0; i < N_VARIANTS; i++)
        if (strcmp(VARIANTS[i]->name, name) == 0) return i;
    return -1;
}

int s3d8_variant_default(void) {
    const char *forced = getenv("S3D8_VARIANT");
    if (forced && *forced) {
        int i = s3d8_variant_find(forced);
        return s3d8_variant_supported(i) ? i : -1;
    }
    int best = 0;
    for (int i = 0; i < N_VARIANTS; i++)
        if (s3d8_variant_supported(i)) best = i; /* the table is ordered slowest to fastest */
    return best;
}

/* Block `part` of `parts` when `total` items are split as evenly as possible. */
static void block_of(size_t total, int parts, int part, size_t *begin, size_t *end) {
    size_t q = total / (size_t)parts, r = total % (size_t)parts, p = (size_t)part;
    *begin = p * q + (p < r ? p : r);
    *end = *begin + q + (p < r ? 1 : 0);
}

/* Run body(ctx, part, begin, end) over [0, total) with `threads` threads; `part` is the calling
 * thread's number (for per-thread workspaces). The range is cut into CHUNKS_PER_THREAD contiguous
 * chunks per thread, handed out dynamically: on a shared machine a thread that is descheduled
 * leaves its chunks to the others instead of holding everyone up. */
typedef void range_fn(const void *ctx, int part, size_t begin, size_t end);
#define CHUNKS_PER_THREAD 8

static void parallel_for(int threads, size_t total, range_fn *body, const void *ctx) {
    if (threads > (int)total) threads = total > 0 ? (int)total : 1;
#ifdef _OPENMP
    if (threads > 1) {
        size_t chunks = (size_t)threads * CHUNKS_PER_THREAD < total ? (size_t)threads * CHUNKS_PER_THREAD : total;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
        for (size_t c = 0; c < chunks; c++) {
            size_t b, e;
            block_of(total, (int)chunks, (int)c, &b, &e);
            if (b < e) body(ctx, omp_get_thread_num(), b, e);
        }
        return;
    }
#endif
    body(ctx, 0, 0, total);
}

typedef struct {
    const s3d8_variant *v;
    size_t m, n, k;
    const void *x;
    size_t x_stride;
    const int8_t *xq;
    size_t xq_stride;
    const float *x_scale;
    const int32_t *x_sum;
    const void *w;
    size_t w_stride;
    const uint16_t *w_scale;
    int8_t luts[192];
    const int8_t *table;
    void *out;
    size_t out_stride;
    float *out_scale;
    int32_t *out_sum;
    uint16_t *out_bf16;
    int8_t *work;
    size_t tile_groups;
} job;

static const s3d8_variant *variant_or_null(int v) {
    return s3d8_variant_supported(v) ? VARIANTS[v] : NULL;
}

/* S3D8 centroids are in [0, 127]: a negative one would make -T overflow int8 in the lookup tables. */
static int table_ok(const int8_t table[96]) {
    int8_t low = 0;
    for (int i = 0; i < 96; i++) low = table[i] < low ? table[i] : low;
    return low >= 0;
}

static void quant_rows(const void *p, int part, size_t b, size_t e) {
    const job *j = p;
    j->v->quant(e - b, j->k, (const float *)j->x + b * j->x_stride, j->x_stride,
                (int8_t *)j->out + b * j->out_stride, j->out_stride, j->out_scale + b,
                j->out_sum + b);
}

int s3d8_quant(int v, int threads, size_t m, size_t k, const float *x, size_t x_stride, int8_t *xq,
               size_t xq_stride, float *x_scale, int32_t *x_sum) {
    job j = {.v = variant_or_null(v), .k = k, .x = x, .x_stride = x_stride, .out = xq,
             .out_stride = xq_stride, .out_scale = x_scale, .out_sum = x_sum};
    if (!j.v) return -1;
    parallel_for(threads, m, quant_rows, &j);
    return 0;
}

static void decode_groups(const void *p, int part, size_t b, size_t e) {
    const job *j = p;
    size_t n = (3 * e < j->n ? 3 * e : j->n) - 3 * b;
    j->v->decode(n, j->k, (const uint8_t *)j->w + b * S3D8_PAD16(j->k), j->luts,
                 (int8_t *)j->out + 3 * b * j->out_stride, j->out_stride);
}

int s3d8_decode(int v, int threads, size_t n, size_t k, const uint8_t *packed,
                const int8_t table[96], int8_t *w, size_t w_stride) {
    job j = {.v = variant_or_null(v), .n = n, .k = k, .w = packed, .out = w, .out_stride = w_stride};
    if (!j.v) return -1;
    if (!table_ok(table)) return -3;
    s3d8_luts_from_table(table, j.luts);
    parallel_for(threads, S3D8_GROUPS(n), decode_groups, &j);
    return 0;
}

static void matmul_s3d8_groups(const void *p, int part, size_t b, size_t e) {
    const job *j = p;
    size_t n = (3 * e < j->n ? 3 * e : j->n) - 3 * b;
    j->v->matmul_s3d8(j->m, n, j->k, j->xq, j->xq_stride, j->x_scale, j->x_sum,
                      (const uint8_t *)j->w + b * S3D8_PAD16(j->k), j->luts, j->w_scale + 3 * b,
                      (float *)j->out + 3 * b, j->out_stride);
}

int s3d8_matmul_s3d8(int v, int threads, size_t m, size_t n, size_t k, const int8_t *xq,
                     size_t xq_stride, const float *x_scale, const int32_t *x_sum,
                     const uint8_t *packed, const int8_t table[96], const uint16_t *w_scale,
                     float *y, size_t y_stride) {
    job j = {.v = variant_or_null(v), .m = m, .n = n, .k = k, .xq = xq, .xq_stride = xq_stride,
             .x_scale = x_scale, .x_sum = x_sum, .w = packed, .w_scale = w_scale, .out = y,
             .out_stride = y_stride};
    if (!j.v) return -1;
    if (k > S3D8_K_MAX) return -2;
    if (!table_ok(table)) return -3;
    s3d8_luts_from_table(table, j.luts);
    parallel_for(threads, S3D8_GROUPS(n), matmul_s3d8_groups, &j);
    return 0;
}

static void matmul_qsi8_rows(const void *p, int part, size_t b, size_t e) {
    const job *j = p;
    j->v->matmul_qsi8(j->m, e - b, j->k, j->xq, j->xq_stride, j->x_scale, j->x_sum,
                      (const int8_t *)j->w + b * j->w_stride, j->w_stride, j->w_scale + b,
                      (float *)j->out + b, j->out_stride);
}

int s3d8_matmul_qsi8(int v, int threads, size_t m, size_t n, size_t k, const int8_t *xq,
                     size_t xq_stride, const float *x_scale, const int32_t *x_sum, const int8_t *w,
                     size_t w_stride, const uint16_t *w_scale, float *y, size_t y_stride) {
    job j = {.v = variant_or_null(v), .m = m, .n = n, .k = k, .xq = xq, .xq_stride = xq_stride,
             .x_scale = x_scale, .x_sum = x_sum, .w = w, .w_stride = w_stride,
             .w_scale = w_scale, .out = y, .out_stride = y_stride};
    if (!j.v) return -1;
    if (k > S3D8_K_MAX) return -2;
    parallel_for(threads, n, matmul_qsi8_rows, &j);
    return 0;
}

static void matmul_bf16_rows(const void *p, int part, size_t b, size_t e) {
    const job *j = p;
    j->v->matmul_bf16(j->m, e - b, j->k, j->x, j->x_stride,
                      (const uint16_t *)j->w + b * j->w_stride, j->w_stride,
                      (float *)j->out + b, j->out_stride);
}

int s3d8_matmul_bf16(int v, int threads, size_t m, size_t n, size_t k, const float *x,
                     size_t x_stride, const uint16_t *w, size_t w_stride, float *y,
                     size_t y_stride) {
    job j = {.v = variant_or_null(v), .m = m, .n = n, .k = k, .x = x, .x_stride = x_stride,
             .w = w, .w_stride = w_stride, .out = y, .out_stride = y_stride};
    if (!j.v) return -1;
    parallel_for(threads, n, matmul_bf16_rows, &j);
    return 0;
}

static void matmul_tiled_groups(const void *p, int part, size_t b, size_t e) {
    const job *j = p;
    size_t k16 = S3D8_PAD16(j->k), stride = S3D8_LHS_STRIDE(j->k);
    int8_t *tile = j->work + (size_t)part * 3 * j->tile_groups * stride;
    for (size_t g = b; g < e; g += j->tile_groups) {
        size_t ge = g + j->tile_groups < e ? g + j->tile_groups : e;
        size_t n = (3 * ge < j->n ? 3 * ge : j->n) - 3 * g;
        j->v->decode(n, j->k, (const uint8_t *)j->w + g * k16, j->luts, tile, stride);
        j->v->matmul_qsi8(j->m, n, j->k, j->xq, j->xq_stride, j->x_scale, j->x_sum, tile, stride,
                          j->w_scale + 3 * g, (float *)j->out + 3 * g, j->out_stride);
    }
}

int s3d8_matmul_s3d8_tiled(int v, int threads, size_t m, size_t n, size_t k, const int8_t *xq,
                           size_t xq_stride, const float *x_scale, const int32_t *x_sum,
                           const uint8_t *packed, const int8_t table[96],
                           const uint16_t *w_scale, float *y, size_t y_stride, int8_t *work,
                           size_t tile_groups) {
    job j = {.v = variant_or_null(v), .m = m, .n = n, .k = k, .xq = xq, .xq_stride = xq_stride,
             .x_scale = x_scale, .x_sum = x_sum, .w = packed, .w_scale = w_scale, .out = y,
             .out_stride = y_stride, .work = work, .tile_groups = tile_groups ? tile_groups : 1};
    if (!j.v) return -1;
    if (k > S3D8_K_MAX) return -2;
    if (!table_ok(table)) return -3;
    s3d8_luts_from_table(table, j.luts);
    parallel_for(threads, S3D8_GROUPS(n), matmul_tiled_groups, &j);
    return 0;
}

/* work = xq [m][stride] | x_scale [m] | x_sum [m] */
static void split_work(void *work, size_t m, size_t k, int8_t **xq, float **xs, int32_t **xsum) {
    *xq = work;
    *xs = (float *)(void *)(*xq + m * S3D8_LHS_STRIDE(k));
    *xsum = (int32_t *)(void *)(*xs + m);
}

int s3d8_linear_s3d8(int v, int threads, size_t m, size_t n, size_t k, const float *x,
                     size_t x_stride, const uint8_t *packed, const int8_t table[96],
                     const uint16_t *w_scale, float *y, size_t y_stride, void *work) {
    int8_t *xq;
    float *xs;
    int32_t *xsum;
    if (k > S3D8_K_MAX) return -2;
    if (!table_ok(table)) return -3;
    split_work(work, m, k, &xq, &xs, &xsum);
    if (s3d8_quant(v, threads, m, k, x, x_stride, xq, S3D8_LHS_STRIDE(k), xs, xsum)) return -1;
    return s3d8_matmul_s3d8(v, threads, m, n, k, xq, S3D8_LHS_STRIDE(k), xs, xsum, packed, table,
                            w_scale, y, y_stride);
}

int s3d8_linear_qsi8(int v, int threads, size_t m, size_t n, size_t k, const float *x,
                     size_t x_stride, const int8_t *w, size_t w_stride, const uint16_t *w_scale,
                     float *y, size_t y_stride, void *work) {
    int8_t *xq;
    float *xs;
    int32_t *xsum;
    if (k > S3D8_K_MAX) return -2;
    split_work(work, m, k, &xq, &xs, &xsum);
    if (s3d8_quant(v, threads, m, k, x, x_stride, xq, S3D8_LHS_STRIDE(k), xs, xsum)) return -1;
    return s3d8_matmul_qsi8(v, threads, m, n, k, xq, S3D8_LHS_STRIDE(k), xs, xsum, w, w_stride,
                            w_scale, y, y_stride);
}

static void encode_scales(const void *p, int part, size_t b, size_t e) {
    const job *j = p;
    for (size_t r = b; r < e; r++)
        j->out_bf16[r] = s3d8_channel_scale_bf16((const float *)j->x + r * j->x_stride, j->k);
}

static void encode_groups(const void *p, int part, size_t b, size_t e) {
    const job *j = p;
    j->v->encode(j->n, j->k, j->x, j->x_stride, j->table, j->w_scale, j->out, b, e);
}

int s3d8_encode(int v, int threads, size_t d_out, size_t d_in, const float *w, size_t w_stride,
                const int8_t table[96], uint8_t *packed, uint16_t *scale) {
    job j = {.v = variant_or_null(v), .n = d_out, .k = d_in, .x = w, .x_stride = w_stride,
             .table = table, .out_bf16 = scale, .w_scale = scale, .out = packed};
    if (!j.v) return -1;
    parallel_for(threads, d_out, encode_scales, &j);
    parallel_for(threads, S3D8_GROUPS(d_out), encode_groups, &j);
    return 0;
}

static void dequant_rows(const void *p, int part, size_t b, size_t e) {
    const job *j = p;
    j->v->dequant(e - b, j->n, (const int32_t *)j->w + b * j->w_stride, j->w_stride, j->x_scale + b,
                  j->w_scale, (float *)j->out + b * j->out_stride, j->out_stride);
}

int s3d8_encode_scaled(int v, int threads, size_t d_out, size_t d_in, const float *w, size_t w_stride,
                       const int8_t table[96], const uint16_t *scale, uint8_t *packed) {
    job j = {.v = variant_or_null(v), .n = d_out, .k = d_in, .x = w, .x_stride = w_stride,
             .table = table, .w_scale = scale, .out = packed};
    if (!j.v) return -1;
    parallel_for(threads, S3D8_GROUPS(d_out), encode_groups, &j);
    return 0;
}

int s3d8_dequant(int v, int threads, size_t m, size_t n, const int32_t *acc, size_t acc_stride,
                 const float *x_scale, const uint16_t *w_scale, float *y, size_t y_stride) {
    job j = {.v = variant_or_null(v), .m = m, .n = n, .w = acc, .w_stride = acc_stride,
             .x_scale = x_scale, .w_scale = w_scale, .out = y, .out_stride = y_stride};
    if (!j.v) return -1;
    parallel_for(threads, m, dequant_rows, &j);
    return 0;
}

typedef struct {
    const float *a, *c;
    size_t stride;
    int64_t *out;
} nearest_job;

static void nearest_range(const void *p, int part, size_t b, size_t e) {
    const nearest_job *j = p;
    const float *a0 = j->a, *a1 = j->a + j->stride, *a2 = j->a + 2 * j->stride, *c = j->c;
    for (size_t i = b; i < e; i++) {
        float best = 0.0f;
        int64_t arg = 0;
        for (int q = 0; q < 32; q++) {
            float d0 = a0[i] - c[3 * q], d1 = a1[i] - c[3 * q + 1], d2 = a2[i] - c[3 * q + 2];
            float d = d0 * d0;
            d = d + d1 * d1;
            d = d + d2 * d2;
            if (q == 0 || d < best) {
                best = d;
                arg = q;
            }
        }
        j->out[i] = arg;
    }
}

int s3d8_nearest_centroids(int threads, size_t n, const float *a, size_t stride, const float c[96],
                           int64_t *out) {
    if (n > stride) return -1;
    nearest_job j = {.a = a, .c = c, .stride = stride, .out = out};
    parallel_for(threads, n, nearest_range, &j);
    return 0;
}

/* The read loop of the bandwidth yardstick: whole cache lines in one vector load where the CPU has
 * AVX-512 (as the kernels read them), the kernels' software prefetch distance. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
__attribute__((target("avx512f"))) static uint64_t read_probe_avx512(const uint8_t *buf, size_t n) {
    __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        _mm_prefetch((const char *)buf + i + 512, _MM_HINT_T1);
        _mm_prefetch((const char *)buf + i + 576, _MM_HINT_T1);
        acc0 = _mm512_add_epi64(acc0, _mm512_loadu_si512(buf + i));
        acc1 = _mm512_add_epi64(acc1, _mm512_loadu_si512(buf + i + 64));
    }
    uint64_t lanes[8], sum = 0; /* unsigned: _mm512_reduce_add_epi64 adds as signed (UB on overflow) */
    _mm512_storeu_si512(lanes, _mm512_add_epi64(acc0, acc1));
    for (int l = 0; l < 8; l++) sum += lanes[l];
    return sum;
}
#endif

uint64_t s3d8_read_bandwidth_probe(const uint8_t *buf, size_t n) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (__builtin_cpu_supports("avx512f")) return read_probe_avx512(buf, n);
#endif
    uint64_t acc[8] = {0};
    for (size_t i = 0; i + 64 <= n; i += 64) {
        __builtin_prefetch(buf + i + 512, 0, 2);
        uint64_t v[8];
        memcpy(v, buf + i, 64);
        for (int l = 0; l < 8; l++) acc[l] += v[l];
    }
    return acc[0] ^ acc[1] ^ acc[2] ^ acc[3] ^ acc[4] ^ acc[5] ^ acc[6] ^ acc[7];
}
