/* One decode token through a Llama (or Mllama text) decoder, the whole layer loop in C.
 *
 * The weight products are the variants' kernels, called as the drivers call them (one activation
 * quantisation per input vector, output channels in contiguous chunks, so the bits do not depend on
 * the thread count); the products that share an input (q, k, v; gate, up) run in one parallel
 * region. Everything else is plain float32 C in the order the Python runtime computes it: RoPE and
 * the residual and gate arithmetic are bit-identical to it, while the RMSNorm mean, the SiLU's exp,
 * the softmax (a polynomial exp, within 2 ulp) and the attention sums may differ from torch's in the
 * last bits (their summation order and exp are torch's own). The attention reads each cached key and
 * value once for all the query heads that share it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "s3d8.h"
#include "s3d8_internal.h"

#define CHUNK_ALIGN 4     /* chunk edges at multiples of this many units: the one-token S3D8 product's row blocks */
#define ALIGN(x) (((x) + 63) / 64 * 64)
#define MAX(a, b) ((a) > (b) ? (a) : (b))
#define MIN(a, b) ((a) < (b) ? (a) : (b))

/* ---- the work area ------------------------------------------------------------------------- */

typedef struct {
    float *x, *h, *q, *k, *v, *att, *y, *gate, *up, *scores;
    int8_t *xq, *rows;
    size_t bytes;
} areas;

static size_t max_k(const s3d8_decoder *d) {
    size_t k = MAX(d->lm_head.k, d->hidden);
    for (size_t i = 0; i < d->n_layers; i++) {
        const s3d8_layer *L = &d->layers[i];
        k = MAX(k, MAX(L->o.k, L->down.k));
    }
    return k;
}

static areas layout(const s3d8_decoder *d, char *base) {
    size_t inter = 0, cache = 1, heads = d->n_heads * d->head_dim, kv = d->n_kv_heads * d->head_dim;
    for (size_t i = 0; i < d->n_layers; i++) {
        inter = MAX(inter, d->layers[i].gate.n);
        cache = MAX(cache, d->layers[i].cache_len);
    }
    areas a;
    size_t off = 0;
#define TAKE(field, type, count) \
    a.field = (type *)(void *)(base ? base + off : NULL); off += ALIGN((count) * sizeof(type));
    TAKE(x, float, d->hidden)
    TAKE(h, float, d->hidden)
    TAKE(q, float, heads)
    TAKE(k, float, kv)
    TAKE(v, float, kv)
    TAKE(att, float, heads)
    TAKE(y, float, d->hidden)
    TAKE(gate, float, inter)
    TAKE(up, float, inter)
    TAKE(scores, float, d->n_heads * cache)
    TAKE(xq, int8_t, S3D8_LINEAR_WORK(1, max_k(d)))
    TAKE(rows, int8_t, 3 * S3D8_LHS_STRIDE(d->hidden))
#undef TAKE
    a.bytes = off;
    return a;
}

size_t s3d8_decoder_work_bytes(const s3d8_decoder *d) { return layout(d, NULL).bytes; }

/* ---- checks ---------------------------------------------------------------------------------- */

static int weight_ok(const s3d8_weight *w, size_t n, size_t k) {
    if ((n && w->n != n) || (k && w->k != k) || !w->n || !w->k || !w->data) return -4;
    if (w->kind == S3D8_W_S3D8) {
        if (!w->table || !w->scale) return -4;
        if (w->k > S3D8_K_MAX) return -2;
        for (int i = 0; i < 96; i++)
            if (w->table[i] < 0) return -3;
        return 0;
    }
    if (w->kind == S3D8_W_QSI8) {
        if (!w->scale) return -4;
        return w->k > S3D8_K_MAX_INT8_FULL ? -2 : 0;
    }
    return w->kind == S3D8_W_BF16 ? 0 : -4;
}

int s3d8_decoder_check(const s3d8_decoder *d, size_t *where) {
    size_t hd = d->head_dim, heads = d->n_heads * hd, kv = d->n_kv_heads * hd;
    int rc = 0;
    *where = d->n_layers;
    if (!d->hidden || !hd || hd % 2 || !d->n_kv_heads || d->n_heads % d->n_kv_heads || !d->norm ||
        !d->cos || !d->sin_rolled || !d->work)
        return -4;
    if ((rc = weight_ok(&d->embed, 0, d->hidden)) || (rc = weight_ok(&d->lm_head, 0, d->hidden)))
        return rc;
    for (size_t i = 0; i < d->n_layers; i++) {
        const s3d8_layer *L = &d->layers[i];
        *where = i;
        if (L->skip) continue;
        if (!L->ln1 || !L->ln2 || !L->k_cache || !L->v_cache || !L->cache_len) return -4;
        if ((rc = weight_ok(&L->q, heads, d->hidden)) || (rc = weight_ok(&L->o, d->hidden, heads)) ||
            (rc = weight_ok(&L->gate, 0, d->hidden)) || (rc = weight_ok(&L->up, L->gate.n, d->hidden)) ||
            (rc = weight_ok(&L->down, d->hidden, L->gate.n)))
            return rc;
        if (L->cross ? !L->q_norm
                     : ((rc = weight_ok(&L->k, kv, d->hidden)) || (rc = weight_ok(&L->v, kv, d->hidden))))
            return rc ? rc : -4;
    }
    *where = 0;
    return 0;
}

/* ---- products -------------------------------------------------------------------------------- */

typedef struct {
    const s3d8_variant *var;
    const s3d8_weight *w;
    size_t m;                /* input rows: 1, or a batch's sequences */
    const float *x;          /* bf16 weights: the float input */
    const int8_t *xq;        /* the others: the quantised input */
    const float *xs;
    const int32_t *xsum;
    float *y;
    size_t units;            /* groups of 3 (S3D8) or channels */
    int8_t luts[192];
} product;

static void product_init(product *p, const s3d8_variant *var, const s3d8_weight *w, const float *x,
                         const int8_t *xq, float *y) {
    p->var = var, p->w = w, p->x = x, p->xq = xq, p->y = y, p->m = 1;
    p->xs = (const float *)(const void *)(xq + S3D8_LHS_STRIDE(w->k));
    p->xsum = (const int32_t *)(const void *)(p->xs + 1);
    p->units = w->kind == S3D8_W_S3D8 ? S3D8_GROUPS(w->n) : w->n;
    if (w->kind == S3D8_W_S3D8) s3d8_luts_from_table(w->table, p->luts);
}

static void product_range(const product *p, size_t b, size_t e) {
    const s3d8_weight *w = p->w;
    size_t k = w->k;
    if (w->kind == S3D8_W_S3D8) {
        size_t n = MIN(3 * e, w->n) - 3 * b;
        p->var->matmul_s3d8(p->m, n, k, p->xq, S3D8_LHS_STRIDE(k), p->xs, p->xsum,
                            (const uint8_t *)w->data + b * S3D8_PAD16(k), p->luts, w->scale + 3 * b,
                            p->y + 3 * b, w->n);
    } else if (w->kind == S3D8_W_QSI8) {
        p->var->matmul_qsi8(p->m, e - b, k, p->xq, S3D8_LHS_STRIDE(k), p->xs, p->xsum,
                            (const int8_t *)w->data + b * k, k, w->scale + b, p->y + b, w->n);
    } else {
        p->var->matmul_bf16(p->m, e - b, k, p->x, k, (const uint16_t *)w->data + b * k, k, p->y + b, w->n);
    }
}

/* The products of one input, their output channels cut into one contiguous chunk per thread (edges at multiples
 * of CHUNK_ALIGN units); products smaller than PARALLEL_MACS in all stay on the calling thread (waking the others
 * costs more than they save). One chunk a thread, not several taken dynamically: each chunk's start is a cold
 * read stream (its first block is not prefetched by a previous one), and on the 1B's products eight chunks a
 * thread decoded ~5 % slower than one. */
#define PARALLEL_MACS 131072
static void run_products(int threads, const product *ps, int count) {
    size_t total = 0, macs = 0;
    for (int i = 0; i < count; i++) total += ps[i].units, macs += ps[i].w->n * ps[i].w->k;
#ifdef _OPENMP
    if (threads > 1 && total > 1 && macs >= PARALLEL_MACS) {
        size_t blocks = (total + CHUNK_ALIGN - 1) / CHUNK_ALIGN, chunks = MIN((size_t)threads, blocks);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
        for (size_t c = 0; c < chunks; c++) {
            size_t b = MIN(total, c * blocks / chunks * CHUNK_ALIGN), base = 0;
            size_t e = MIN(total, (c + 1) * blocks / chunks * CHUNK_ALIGN);
            for (int i = 0; i < count; i++) {
                size_t lo = MAX(b, base), hi = MIN(e, base + ps[i].units);
                if (lo < hi) product_range(&ps[i], lo - base, hi - base);
                base += ps[i].units;
            }
        }
        return;
    }
#endif
    for (int i = 0; i < count; i++) product_range(&ps[i], 0, ps[i].units);
}

/* y_i = W_i x for the weights w[0..count): x quantised once (unless bf16). */
static void products(const s3d8_decoder *d, const s3d8_variant *var, int threads, const areas *a,
                     const float *x, const s3d8_weight *const *w, float *const *y, int count) {
    product ps[3];
    int quantised = 0;
    if (d->stub_products) return;
    for (int i = 0; i < count; i++) quantised |= w[i]->kind != S3D8_W_BF16;
    if (quantised)
        var->quant(1, w[0]->k, x, w[0]->k, a->xq, S3D8_LHS_STRIDE(w[0]->k),
                   (float *)(void *)(a->xq + S3D8_LHS_STRIDE(w[0]->k)),
                   (int32_t *)(void *)(a->xq + S3D8_LHS_STRIDE(w[0]->k) + sizeof(float)));
    for (int i = 0; i < count; i++) product_init(&ps[i], var, w[i], x, a->xq, y[i]);
    run_products(threads, ps, count);
}

/* ---- the float parts --------------------------------------------------------------------------- */

/* out = w * (x * rsqrt(mean(x^2) + eps)) */
static void rms_norm(size_t n, const float *x, const float *w, float eps, float *out) {
    double sum = 0.0;
    for (size_t i = 0; i < n; i++) sum += (double)x[i] * x[i];
    float r = 1.0f / sqrtf((float)(sum / (double)n) + eps);
    for (size_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* x * cos + roll(x, hd / 2) * sin_rolled for each of `heads` heads, in place. */
static void rope(float *x, size_t heads, size_t hd, const float *cos, const float *sin_rolled) {
    float tmp[hd];
    size_t half = hd / 2;
    for (size_t h = 0; h < heads; h++, x += hd) {
        for (size_t i = 0; i < hd; i++) tmp[i] = x[i] * cos[i] + x[(i + half) % hd] * sin_rolled[i];
        memcpy(x, tmp, hd * sizeof(float));
    }
}

/* The float loops are compiled for the widest vectors the CPU has (x86: function clones chosen at load time).
 * Their arithmetic is the same in every clone: with -ffp-contract=off each partial sum below is its own
 * sequence of roundings whatever the vector width, so the bits do not depend on the CPU. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define WIDE __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define WIDE
#endif

/* sum_i a[i] * b[i] in 16 partial sums (vectorisable; a single running sum is one add per cycle). */
static inline float dot(const float *a, const float *b, size_t n) {
    float part[16] = {0};
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) part[j] += a[i + j] * b[i + j];
    for (; i < n; i++) part[i % 16] += a[i] * b[i];
    for (int j = 0; j < 8; j++) part[j] += part[j + 8];
    for (int j = 0; j < 4; j++) part[j] += part[j + 4];
    part[0] += part[2], part[1] += part[3];
    return part[0] + part[1];
}

/* 16 floats as one vector (GCC/Clang vector extensions: one AVX-512 register, two AVX2 or four SSE / NEON
 * ones); the arithmetic is lane by lane, so the same on every CPU. */
typedef float v16f __attribute__((vector_size(64)));
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi" /* v16f passed between static inline functions only: no ABI */
#endif
#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int32_t v16i __attribute__((vector_size(64)));
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (v16i){__VA_ARGS__})
#endif

static inline v16f load16(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The sums of 16 vectors' lanes, as one vector: p[x] holds dot()'s 16 partial sums of product x, and the result's
 * lane x is dot()'s value for it, to the bit (lanes l and l + 8 added first, then l and l + 4, l and l + 2, l and
 * l + 1), four rounds of pairwise shuffles and adds instead of 15 scalar additions per product. */
static inline v16f lane_sums(const v16f p[16]) {
    v16f r1[8], r2[4], r3[2];
    for (int i = 0; i < 8; i++)
        r1[i] = SHUFFLE(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                SHUFFLE(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        r2[i] = SHUFFLE(r1[2 * i], r1[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                SHUFFLE(r1[2 * i], r1[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        r3[i] = SHUFFLE(r2[2 * i], r2[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                SHUFFLE(r2[2 * i], r2[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SHUFFLE(r3[0], r3[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SHUFFLE(r3[0], r3[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* s[x] = dot(q, keys + x * hd, hd) for 16 keys, hd a multiple of 16: the same values as dot(), to the bit. */
static inline v16f dot16(const float *q, const float *keys, size_t hd) {
    v16f p[16];
    for (int x = 0; x < 16; x++) {
        v16f part = {0};
        for (size_t i = 0; i < hd; i += 16) part += load16(q + i) * load16(keys + x * hd + i);
        p[x] = part;
    }
    return lane_sums(p);
}

/* exp(x) for x <= 0 (scores minus their maximum), vectorisable: x = k ln2 + r with |r| <= ln2 / 2 (Cody-Waite),
 * exp(r) by Cephes' degree-6 polynomial, 2^k from the exponent bits; within 2 ulp of expf, 0 below -87. The same
 * float operations on every CPU, so the same bits. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;   /* round to nearest */
    float r = (x - k * 0.693359375f) - k * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = (p * (r * r) + r) + 1.0f;
    union { uint32_t u; float f; } two = {(uint32_t)((int32_t)k + 127) << 23};
    return x <= -87.0f ? 0.0f : p * two.f;
}

/* exp(x) for any x, vectorisable: exp(-|x|) as above, its reciprocal for x > 0 (within 3 ulp of expf up to
 * x = 87, +Inf from there on where expf overflows only above 88.72). For the SiLU. */
static inline float exp_any(float x) {
    float e = exp_nonpositive(-fabsf(x));
    return x > 0.0f ? 1.0f / e : e;
}

/* The query heads of kv head `g` over `len` cached keys/values: softmax(q k^T * scale + bias) v, each key and
 * value read once for all the group's heads (from L1 for all but the first). Scores of 16 keys at a time in one
 * vector when head_dim is a multiple of 16; the same values as dot() key by key. */
WIDE static void attend_group(const s3d8_decoder *d, const s3d8_layer *L, size_t g, size_t len, const areas *a) {
    size_t hd = d->head_dim, per = d->n_heads / d->n_kv_heads;
    const float *kc = L->k_cache + g * L->cache_len * hd, *vc = L->v_cache + g * L->cache_len * hd;
    const float *q = a->q + g * per * hd;
    float *scores = a->scores + g * per * len, *out = a->att + g * per * hd;
    float scale = (float)(1.0 / sqrt((double)hd));
    size_t t0 = 0;
    if (hd % 16 == 0)
        for (; t0 + 16 <= len; t0 += 16)
            for (size_t j = 0; j < per; j++) {
                v16f s = dot16(q + j * hd, kc + t0 * hd, hd) * scale;
                if (L->bias) s += load16(L->bias + t0);
                memcpy(scores + j * len + t0, &s, sizeof s);
            }
    for (size_t t = t0; t < len; t++)
        for (size_t j = 0; j < per; j++) {
            float s = dot(q + j * hd, kc + t * hd, hd) * scale;
            scores[j * len + t] = L->bias ? s + L->bias[t] : s;
        }
    for (size_t j = 0; j < per; j++) {
        float *sj = scores + j * len, top = -INFINITY, tops[16], part[16] = {0};
        size_t t = 0;
        for (int i = 0; i < 16; i++) tops[i] = -INFINITY;
        for (; t + 16 <= len; t += 16)
            for (int i = 0; i < 16; i++) tops[i] = sj[t + i] > tops[i] ? sj[t + i] : tops[i];
        for (; t < len; t++) top = sj[t] > top ? sj[t] : top;
        for (int i = 0; i < 16; i++) top = tops[i] > top ? tops[i] : top;   /* a maximum in any order */
        for (t = 0; t < len; t++) sj[t] = exp_nonpositive(sj[t] - top);
        for (t = 0; t + 16 <= len; t += 16)   /* 16 partial sums, as dot() */
            for (int i = 0; i < 16; i++) part[i] += sj[t + i];
        for (; t < len; t++) part[t % 16] += sj[t];
        for (int i = 0; i < 8; i++) part[i] += part[i + 8];
        for (int i = 0; i < 4; i++) part[i] += part[i + 4];
        float sum = (part[0] + part[2]) + (part[1] + part[3]);
        for (t = 0; t < len; t++) sj[t] = sj[t] / sum;
    }
    for (size_t j = 0; j < per; j++) {
        const float *p = scores + j * len;
        float *o = out + j * hd;
        size_t i0 = 0;
        for (; i0 + 64 <= hd; i0 += 64) {     /* 64 outputs at a time: four independent vector sums over t */
            v16f acc[4] = {{0}, {0}, {0}, {0}};
            for (size_t t = 0; t < len; t++)
                for (int c = 0; c < 4; c++) acc[c] += p[t] * load16(vc + t * hd + i0 + 16 * c);
            memcpy(o + i0, acc, sizeof acc);
        }
        for (size_t i = i0; i < hd; i++) {
            float acc = 0.0f;
            for (size_t t = 0; t < len; t++) acc += p[t] * vc[t * hd + i];
            o[i] = acc;
        }
    }
}

static void attention(const s3d8_decoder *d, const s3d8_layer *L, int threads, const areas *a, size_t len) {
    size_t nkv = d->n_kv_heads;
#ifdef _OPENMP
    if (threads > 1 && nkv > 1 && 2 * d->n_heads * len * d->head_dim >= PARALLEL_MACS) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (size_t g = 0; g < nkv; g++) attend_group(d, L, g, len, a);
        return;
    }
#endif
    for (size_t g = 0; g < nkv; g++) attend_group(d, L, g, len, a);
}

static void embed(const s3d8_decoder *d, const s3d8_variant *var, const areas *a, size_t token) {
    const s3d8_weight *w = &d->embed;
    size_t k = w->k;
    if (w->kind == S3D8_W_S3D8) {
        int8_t luts[192];
        size_t g = token / 3, rows = MIN(3, w->n - 3 * g);
        s3d8_luts_from_table(w->table, luts);
        var->decode(rows, k, (const uint8_t *)w->data + g * S3D8_PAD16(k), luts, a->rows, S3D8_LHS_STRIDE(k));
        const int8_t *row = a->rows + (token % 3) * S3D8_LHS_STRIDE(k);
        float s = s3d8_f32_from_bf16(w->scale[token]);
        for (size_t i = 0; i < k; i++) a->x[i] = (float)row[i] * s;
    } else if (w->kind == S3D8_W_QSI8) {
        const int8_t *row = (const int8_t *)w->data + token * k;
        float s = s3d8_f32_from_bf16(w->scale[token]);
        for (size_t i = 0; i < k; i++) a->x[i] = (float)row[i] * s;
    } else {
        const uint16_t *row = (const uint16_t *)w->data + token * k;
        for (size_t i = 0; i < k; i++) a->x[i] = s3d8_f32_from_bf16(row[i]);
    }
}

/* gate = silu(gate) * up = gate / (1 + exp(-gate)) * up. */
WIDE static void silu_gate(size_t n, float *gate, const float *up) {
    for (size_t i = 0; i < n; i++) gate[i] = gate[i] / (1.0f + exp_any(-gate[i])) * up[i];
}

/* ---- several sequences at once ----------------------------------------------------------------
 *
 * A batch is `count` decoders over the same weights (the same data pointers), each with its own caches and
 * work area; their products run as one product of `count` rows (each weight read once for all of them), the
 * rest per sequence exactly as one sequence alone. One sequence takes products() on its own work area: the
 * one-token step is the batch of one. */

typedef struct {
    const s3d8_decoder *const *ds;
    areas *a;                 /* each sequence's work area */
    size_t count;
    float *rows_x;            /* the batch's inputs [count, max k] and outputs [3][count, max n] */
    float *rows_y;
    int8_t *xq;               /* the quantised inputs: S3D8_LINEAR_WORK(count, max k) */
    size_t max_n;
} batch;

static size_t max_n(const s3d8_decoder *d) {
    size_t n = MAX(d->lm_head.n, d->hidden);
    for (size_t i = 0; i < d->n_layers; i++) {
        const s3d8_layer *L = &d->layers[i];
        n = MAX(n, MAX(L->q.n, L->gate.n));
    }
    return n;
}

size_t s3d8_decoder_batch_work_bytes(const s3d8_decoder *d, size_t count) {
    return ALIGN(count * max_k(d) * sizeof(float)) + ALIGN(3 * count * max_n(d) * sizeof(float)) +
           ALIGN(S3D8_LINEAR_WORK(count, max_k(d)));
}

/* y[i][b] = W_i x[b] for the weights w[0..count) (selected: the sequences `sel`). */
static void products_batch(const batch *B, const s3d8_variant *var, int threads, const size_t *sel, size_t m,
                           float *const *x, const s3d8_weight *const *w, float *const *const *y, int count) {
    const s3d8_decoder *d = B->ds[sel[0]];
    if (m == 1) {
        float *yy[3];
        for (int i = 0; i < count; i++) yy[i] = y[i][0];
        products(d, var, threads, &B->a[sel[0]], x[0], w, yy, count);
        return;
    }
    if (d->stub_products) return;
    size_t k = w[0]->k;
    product ps[3];
    int quantised = 0;
    for (size_t r = 0; r < m; r++) memcpy(B->rows_x + r * k, x[r], k * sizeof(float));
    for (int i = 0; i < count; i++) quantised |= w[i]->kind != S3D8_W_BF16;
    float *xs = (float *)(void *)(B->xq + m * S3D8_LHS_STRIDE(k));
    if (quantised) var->quant(m, k, B->rows_x, k, B->xq, S3D8_LHS_STRIDE(k), xs, (int32_t *)(void *)(xs + m));
    for (int i = 0; i < count; i++) {
        product_init(&ps[i], var, w[i], B->rows_x, B->xq, B->rows_y + (size_t)i * m * B->max_n);
        ps[i].m = m;
        ps[i].xs = xs;
        ps[i].xsum = (const int32_t *)(const void *)(xs + m);
    }
    run_products(threads, ps, count);
    for (int i = 0; i < count; i++)
        for (size_t r = 0; r < m; r++)
            memcpy(y[i][r], ps[i].y + r * w[i]->n, w[i]->n * sizeof(float));
}

#define EACH(r) for (size_t r = 0; r < m; r++)
#define SEQ(r) const s3d8_decoder *d_##r = B->ds[sel[r]]; const areas *a_##r = &B->a[sel[r]]; \
    const s3d8_layer *L_##r = &d_##r->layers[layer]; (void)L_##r;

static void mlp(const batch *B, const size_t *sel, size_t m, size_t layer, const s3d8_variant *var, int threads) {
    const s3d8_layer *L = &B->ds[sel[0]]->layers[layer];
    const s3d8_weight *gu[2] = {&L->gate, &L->up}, *down[1] = {&L->down};
    float *h[m], *gate[m], *up[m], *y[m];
    EACH(r) {
        SEQ(r)
        rms_norm(d_r->hidden, a_r->x, L_r->ln2, d_r->eps, a_r->h);
        h[r] = a_r->h, gate[r] = a_r->gate, up[r] = a_r->up, y[r] = a_r->y;
    }
    float *const *gu_out[2] = {gate, up}, *const *down_out[1] = {y};
    products_batch(B, var, threads, sel, m, h, gu, gu_out, 2);
    EACH(r) silu_gate(L->gate.n, gate[r], up[r]);
    products_batch(B, var, threads, sel, m, gate, down, down_out, 1);
}

static void self_layer(const batch *B, const size_t *sel, size_t m, size_t layer, const s3d8_variant *var,
                       int threads, const size_t *pos) {
    const s3d8_decoder *d = B->ds[sel[0]];
    const s3d8_layer *L = &d->layers[layer];
    size_t hd = d->head_dim, nkv = d->n_kv_heads;
    const s3d8_weight *qkv[3] = {&L->q, &L->k, &L->v}, *o[1] = {&L->o};
    float *h[m], *q[m], *k[m], *v[m], *att[m], *y[m];
    EACH(r) {
        SEQ(r)
        rms_norm(d_r->hidden, a_r->x, L_r->ln1, d_r->eps, a_r->h);
        h[r] = a_r->h, q[r] = a_r->q, k[r] = a_r->k, v[r] = a_r->v, att[r] = a_r->att, y[r] = a_r->y;
    }
    float *const *qkv_out[3] = {q, k, v}, *const *o_out[1] = {y};
    products_batch(B, var, threads, sel, m, h, qkv, qkv_out, 3);
    EACH(r) {
        SEQ(r)
        size_t p = pos[sel[r]];
        rope(a_r->q, d_r->n_heads, hd, d_r->cos + p * hd, d_r->sin_rolled + p * hd);
        rope(a_r->k, nkv, hd, d_r->cos + p * hd, d_r->sin_rolled + p * hd);
        for (size_t g = 0; g < nkv; g++) {
            memcpy(L_r->k_cache + (g * L_r->cache_len + p) * hd, a_r->k + g * hd, hd * sizeof(float));
            memcpy(L_r->v_cache + (g * L_r->cache_len + p) * hd, a_r->v + g * hd, hd * sizeof(float));
        }
        attention(d_r, L_r, threads, a_r, p + 1);
    }
    products_batch(B, var, threads, sel, m, att, o, o_out, 1);
    EACH(r) {
        SEQ(r)
        for (size_t i = 0; i < d_r->hidden; i++) a_r->x[i] = a_r->x[i] + a_r->y[i];
    }
    mlp(B, sel, m, layer, var, threads);
    EACH(r) {
        SEQ(r)
        for (size_t i = 0; i < d_r->hidden; i++) a_r->x[i] = a_r->x[i] + a_r->y[i];
    }
}

static void cross_layer(const batch *B, const size_t *sel, size_t m, size_t layer, const s3d8_variant *var,
                        int threads) {
    const s3d8_decoder *d = B->ds[sel[0]];
    const s3d8_layer *L = &d->layers[layer];
    size_t hd = d->head_dim;
    const s3d8_weight *qw[1] = {&L->q}, *o[1] = {&L->o};
    float *h[m], *q[m], *att[m], *y[m];
    EACH(r) {
        SEQ(r)
        rms_norm(d_r->hidden, a_r->x, L_r->ln1, d_r->eps, a_r->h);
        h[r] = a_r->h, q[r] = a_r->q, att[r] = a_r->att, y[r] = a_r->y;
    }
    float *const *q_out[1] = {q}, *const *o_out[1] = {y};
    products_batch(B, var, threads, sel, m, h, qw, q_out, 1);
    EACH(r) {
        SEQ(r)
        for (size_t hh = 0; hh < d_r->n_heads; hh++)
            rms_norm(hd, a_r->q + hh * hd, L_r->q_norm, d_r->eps, a_r->q + hh * hd);
        attention(d_r, L_r, threads, a_r, L_r->cache_len);
    }
    products_batch(B, var, threads, sel, m, att, o, o_out, 1);
    EACH(r) {
        SEQ(r)
        for (size_t i = 0; i < d_r->hidden; i++) a_r->x[i] = a_r->x[i] + L_r->attn_gate * a_r->y[i];
    }
    mlp(B, sel, m, layer, var, threads);
    EACH(r) {
        SEQ(r)
        for (size_t i = 0; i < d_r->hidden; i++)
            a_r->x[i] = a_r->x[i] + L_r->mlp_gate * (L_r->mlp_row_mask * a_r->y[i]);
    }
}

/* ---- the step ---------------------------------------------------------------------------------- */

static int same_weight(const s3d8_weight *a, const s3d8_weight *b) {
    return a->kind == b->kind && a->n == b->n && a->k == b->k && a->data == b->data && a->table == b->table &&
           a->scale == b->scale;
}

/* 0 when ds[r] may join ds[0]'s batch: its position and token in range, the same shape and weights. */
static int joins(const s3d8_decoder *d0, const s3d8_decoder *d, int64_t token, size_t pos) {
    if (token < 0 || (size_t)token >= d->embed.n) return -5;
    if (pos >= d->rope_len) return -4;
    if (d->n_layers != d0->n_layers || d->hidden != d0->hidden || d->n_heads != d0->n_heads ||
        d->n_kv_heads != d0->n_kv_heads || d->head_dim != d0->head_dim || d->stub_products != d0->stub_products ||
        !same_weight(&d->embed, &d0->embed) || !same_weight(&d->lm_head, &d0->lm_head))
        return -4;
    for (size_t i = 0; i < d->n_layers; i++) {
        const s3d8_layer *L = &d->layers[i], *L0 = &d0->layers[i];
        if (!L->skip && !L->cross && pos >= L->cache_len) return -4;
        if (L->skip || L0->skip) continue;
        if (L->cross != L0->cross || !same_weight(&L->q, &L0->q) || !same_weight(&L->o, &L0->o) ||
            !same_weight(&L->gate, &L0->gate) || !same_weight(&L->up, &L0->up) ||
            !same_weight(&L->down, &L0->down) ||
            (!L->cross && (!same_weight(&L->k, &L0->k) || !same_weight(&L->v, &L0->v))))
            return -4;
    }
    return 0;
}

static int step(int v, int threads, const s3d8_decoder *const *ds, size_t count, const int64_t *tokens,
                const size_t *pos, float *const *logits, void *batch_work) {
    const s3d8_variant *var = s3d8_variant_supported(v) ? s3d8_variant_get(v) : NULL;
    if (!var) return -1;
    if (!count) return 0;
    for (size_t r = 0; r < count; r++) {
        int rc = joins(ds[0], ds[r], tokens[r], pos[r]);
        if (rc) return rc;
    }
    areas a[count];
    size_t all[count], sel[count];
    char *bw = batch_work;
    size_t mk = max_k(ds[0]);
    batch B = {.ds = ds, .a = a, .count = count, .max_n = max_n(ds[0])};
    if (count > 1) {
        B.rows_x = (float *)(void *)bw;
        B.rows_y = (float *)(void *)(bw + ALIGN(count * mk * sizeof(float)));
        B.xq = (int8_t *)(bw + ALIGN(count * mk * sizeof(float)) + ALIGN(3 * count * B.max_n * sizeof(float)));
    }
    for (size_t r = 0; r < count; r++) {
        a[r] = layout(ds[r], ds[r]->work);
        all[r] = r;
        embed(ds[r], var, &a[r], (size_t)tokens[r]);
    }
    for (size_t i = 0; i < ds[0]->n_layers; i++) {
        size_t m = 0;
        for (size_t r = 0; r < count; r++)
            if (!ds[r]->layers[i].skip) sel[m++] = r;
        if (!m) continue;
        if (ds[sel[0]]->layers[i].cross) cross_layer(&B, sel, m, i, var, threads);
        else self_layer(&B, sel, m, i, var, threads, pos);
    }
    const s3d8_weight *head[1] = {&ds[0]->lm_head};
    float *h[count];
    for (size_t r = 0; r < count; r++) {
        rms_norm(ds[r]->hidden, a[r].x, ds[r]->norm, ds[r]->eps, a[r].h);
        h[r] = a[r].h;
    }
    float *const *head_out[1] = {logits};
    products_batch(&B, var, threads, all, count, h, head, head_out, 1);
    return 0;
}

int s3d8_decoder_step(int v, int threads, const s3d8_decoder *d, int64_t token, size_t pos, float *logits) {
    const s3d8_decoder *ds[1] = {d};
    float *out[1] = {logits};
    return step(v, threads, ds, 1, &token, &pos, out, NULL);
}

int s3d8_decoder_step_batch(int v, int threads, const s3d8_decoder *const *ds, size_t count, const int64_t *tokens,
                            const size_t *pos, float *const *logits, void *batch_work) {
    if (count > 1 && !batch_work) return -4;
    return step(v, threads, ds, count, tokens, pos, logits, batch_work);
}
