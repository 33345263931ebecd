/* S3D8 kernel library: 3 weights per byte decoded to channel-scaled INT8 (SPEC sections 1, 2).
 *
 * Kernel names state their contract, KleidiAI style:  s3d8_<op>_<dst>_<lhs>_<rhs>_<isa>
 *   f32     float32
 *   qsi8dx  symmetric int8, one dynamic scale per row (token) of the activations
 *   qsi8cx  symmetric int8, one bf16 scale per output channel (INT8 weights, row-major [n, k])
 *   s3d8cx  S3D8 packed weights, SPEC layout [ceil(n/3), pad16(k)] uint8, one bf16 scale per channel
 *   bf16    bfloat16 weights [n, k] (baseline)
 *
 * Every kernel is stateless and allocates nothing: it computes the block of output channels it is
 * given (pointers already offset to the block), so a caller splits work over threads by channels.
 * `s3d8_ref.c` is the definition of the right answer; every SIMD variant equals it bit for bit
 * (except the float bf16 baseline, whose summation order differs).
 *
 * Activation rows (xq) have a stride of at least S3D8_LHS_STRIDE(k) bytes and hold zeros from k to
 * the stride: kernels may read x in whole 64-byte blocks, never past the stride.
 *
 * Non-finite values (the same policy in every variant and in the Python reference):
 *   - an activation row (token) with any NaN or +-Inf quantises to all zeros with x_scale = NaN and
 *     x_sum = 0, so every product gives an all-NaN output row;
 *   - a weight channel scale (bf16) that is NaN or +-Inf makes that output column NaN (the epilogue
 *     uses NaN in place of any non-finite channel scale).
 *   The NaN written is the canonical quiet NaN 0x7FC00000, so results agree bit for bit.
 *
 * Integer accumulators are int32: a product over k inputs is exact while 127 * 127 * k < 2^31, i.e.
 * k <= S3D8_K_MAX (activations are in [-127, 127]; INT8 weights of -128 lower it to
 * S3D8_K_MAX_INT8_FULL). The drivers refuse a larger k (return -2).
 */
#ifndef S3D8_H
#define S3D8_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define S3D8_PAD16(k) ((((size_t)(k)) + 15) / 16 * 16)
#define S3D8_LHS_STRIDE(k) ((((size_t)(k)) + 63) / 64 * 64)
#define S3D8_GROUPS(n) ((((size_t)(n)) + 2) / 3)
#define S3D8_K_MAX 133144u           /* largest k with 127 * 127 * k < 2^31 */
#define S3D8_K_MAX_INT8_FULL 132104u /* largest k with 128 * 127 * k < 2^31 (a weight of -128) */

/* ---- Scalar helpers (s3d8_ref.c) -------------------------------------------------------------- */

/* float32 -> bfloat16 bits, round to nearest even. */
uint16_t s3d8_bf16_from_f32(float x);
float s3d8_f32_from_bf16(uint16_t b);
/* A weight row's scale, SPEC section 1: bf16(max(absmax(row) / 127, 2^-126)) (an all-zero row gets
 * 2^-126 and decodes to ~0). Activations keep SPEC section 2's rule (absmax 0 -> 1). */
uint16_t s3d8_channel_scale_bf16(const float *row, size_t n);
/* The three signed lookup tables of SPEC section 1: luts[0..63] = L0 (sign-minor),
 * luts[64..127] = L1 (sign-major), luts[128..191] = L2 (sign-minor). table is T[32][3]. */
void s3d8_luts_from_table(const int8_t table[96], int8_t luts[192]);

/* ---- Kernels: one set per variant (suffix _ref, _avx2, _avx512, _neon, _neon_i8mm) ----------- */

/* Per-row dynamic int8 quantisation: xq[i, :k] = clamp(rint(x / scale), -127, 127), zeros from k
 * to S3D8_LHS_STRIDE(k); x_scale[i] = bf16 channel scale (as float); x_sum[i] = sum of xq[i, :]. */
typedef void s3d8_quant_qsi8dx_f32_fn(size_t m, size_t k, const float *x, size_t x_stride,
                                      int8_t *xq, size_t xq_stride, float *x_scale, int32_t *x_sum);

/* Decode n output channels of S3D8 (packed: ceil(n/3) rows of pad16(k) bytes) to int8 w[n, k]. */
typedef void s3d8_decode_qsi8cx_s3d8cx_fn(size_t n, size_t k, const uint8_t *packed,
                                          const int8_t luts[192], int8_t *w, size_t w_stride);

/* Fused decode + product for n output channels (ceil(n/3) packed rows of pad16(k) bytes):
 * y[i, c] = ((float)sum_k xq[i,k] * w[c,k] * x_scale[i]) * w_scale[c]. */
typedef void s3d8_matmul_f32_qsi8dx_s3d8cx_fn(size_t m, size_t n, size_t k, const int8_t *xq,
                                              size_t xq_stride, const float *x_scale,
                                              const int32_t *x_sum, const uint8_t *packed,
                                              const int8_t luts[192], const uint16_t *w_scale,
                                              float *y, size_t y_stride);

/* INT8-weight product, same activations and epilogue: w is int8 [n, k] (row stride w_stride, only
 * the first k bytes of a row are read); any int8 weight, -128 included, is exact (see S3D8_K_MAX). */
typedef void s3d8_matmul_f32_qsi8dx_qsi8cx_fn(size_t m, size_t n, size_t k, const int8_t *xq,
                                              size_t xq_stride, const float *x_scale,
                                              const int32_t *x_sum, const int8_t *w,
                                              size_t w_stride, const uint16_t *w_scale, float *y,
                                              size_t y_stride);

/* bfloat16-weight baseline: y[i, c] = sum_k x[i,k] * w[c,k] in float32 (summation order is the
 * variant's own). */
typedef void s3d8_matmul_f32_f32_bf16_fn(size_t m, size_t n, size_t k, const float *x,
                                         size_t x_stride, const uint16_t *w, size_t w_stride,
                                         float *y, size_t y_stride);

/* Epilogue of an external int32 GEMM: y[i, c] = ((float)acc[i, c] * x_scale[i]) * w_scale[c]. */
typedef void s3d8_dequant_f32_i32_fn(size_t m, size_t n, const int32_t *acc, size_t acc_stride,
                                     const float *x_scale, const uint16_t *w_scale, float *y,
                                     size_t y_stride);

/* Encode output channels [3*g0, 3*g1) of w[d_out, d_in] (float32, row stride w_stride) given the
 * channel scales (bf16 bits, d_out of them) into packed rows g0..g1-1 (row stride pad16(d_in)). */
typedef void s3d8_encode_s3d8cx_f32_fn(size_t d_out, size_t d_in, const float *w, size_t w_stride,
                                       const int8_t table[96], const uint16_t *scale,
                                       uint8_t *packed, size_t g0, size_t g1);

typedef struct s3d8_variant {
    const char *name;
    s3d8_quant_qsi8dx_f32_fn *quant;
    s3d8_decode_qsi8cx_s3d8cx_fn *decode;
    s3d8_matmul_f32_qsi8dx_s3d8cx_fn *matmul_s3d8;
    s3d8_matmul_f32_qsi8dx_qsi8cx_fn *matmul_qsi8;
    s3d8_matmul_f32_f32_bf16_fn *matmul_bf16;
    s3d8_dequant_f32_i32_fn *dequant;
    s3d8_encode_s3d8cx_f32_fn *encode;
} s3d8_variant;

/* The reference encoder (every variant's encoder is this same C compiled for its target). */
void s3d8_encode_s3d8cx_f32_ref(size_t d_out, size_t d_in, const float *w, size_t w_stride,
                                const int8_t table[96], const uint16_t *scale, uint8_t *packed,
                                size_t g0, size_t g1);

/* ---- Variants and threaded drivers (s3d8_dispatch.c) ----------------------------------------- */

int s3d8_variant_count(void);                  /* variants compiled into this build */
const s3d8_variant *s3d8_variant_get(int i);
int s3d8_variant_supported(int i);             /* 1 if this CPU can run variant i */
int s3d8_variant_find(const char *name);       /* index, or -1 */
/* The variant to use: S3D8_VARIANT from the environment if set (-1 if unknown or unsupported),
 * otherwise the fastest supported one. */
int s3d8_variant_default(void);
/* Where the x86 one-token S3D8 products prefetch their next block of packed rows: 1 = L1, 0 = L2
 * (S3D8_NEXT_PREFETCH=l1|l2 from the environment when the library loads, else L1
 * on AMD CPUs and L2 on the others; why: s3d8_dispatch.c); -1 where the variants have no such
 * choice (Arm). */
int s3d8_next_block_to_l1(void);

/* The drivers split output channels (whole groups of 3 for S3D8) into contiguous chunks that
 * `threads` threads take in turn; every channel is computed by one thread with the same
 * arithmetic, so results do not depend on the thread count. They return 0, -1 for an invalid
 * variant, -2 for a product with k > S3D8_K_MAX (int32 accumulators would wrap), or -3 for an
 * S3D8 centroid table with a negative value (decode and S3D8 products); nothing is written then. */
int s3d8_quant(int v, int threads, size_t m, size_t k, const float *x, size_t x_stride, int8_t *xq,
               size_t xq_stride, float *x_scale, int32_t *x_sum);
int s3d8_decode(int v, int threads, size_t n, size_t k, const uint8_t *packed,
                const int8_t table[96], int8_t *w, size_t w_stride);
int s3d8_matmul_s3d8(int v, int threads, size_t m, size_t n, size_t k, const int8_t *xq,
                     size_t xq_stride, const float *x_scale, const int32_t *x_sum,
                     const uint8_t *packed, const int8_t table[96], const uint16_t *w_scale,
                     float *y, size_t y_stride);
int s3d8_matmul_qsi8(int v, int threads, size_t m, size_t n, size_t k, const int8_t *xq,
                     size_t xq_stride, const float *x_scale, const int32_t *x_sum, const int8_t *w,
                     size_t w_stride, const uint16_t *w_scale, float *y, size_t y_stride);
int s3d8_matmul_bf16(int v, int threads, size_t m, size_t n, size_t k, const float *x,
                     size_t x_stride, const uint16_t *w, size_t w_stride, float *y,
                     size_t y_stride);
/* Large m: decode `tile_groups` groups at a time into `work` (threads * 3 * tile_groups rows of
 * S3D8_LHS_STRIDE(k) bytes) and multiply each tile with the variant's INT8 kernel. */
int s3d8_matmul_s3d8_tiled(int v, int threads, size_t m, size_t n, size_t k, const int8_t *xq,
                           size_t xq_stride, const float *x_scale, const int32_t *x_sum,
                           const uint8_t *packed, const int8_t table[96],
                           const uint16_t *w_scale, float *y, size_t y_stride, int8_t *work,
                           size_t tile_groups);
/* A whole linear layer for small m, in one call: quantise x [m, k] (float32, row stride x_stride)
 * per token into `work` (S3D8_LINEAR_WORK(m, k) bytes, 64-byte aligned), then the fused S3D8
 * product (s3d8) or the INT8-weight product (qsi8, w int8 [n, k]) into y [m, n]. */
#define S3D8_LINEAR_WORK(m, k) ((size_t)(m) * (S3D8_LHS_STRIDE(k) + 8))
int s3d8_linear_s3d8(int v, int threads, size_t m, size_t n, size_t k, const float *x,
                     size_t x_stride, const uint8_t *packed, const int8_t table[96],
                     const uint16_t *w_scale, float *y, size_t y_stride, void *work);
int s3d8_linear_qsi8(int v, int threads, size_t m, size_t n, size_t k, const float *x,
                     size_t x_stride, const int8_t *w, size_t w_stride, const uint16_t *w_scale,
                     float *y, size_t y_stride, void *work);

/* Channel scales then encoding, groups split over threads. */
int s3d8_encode(int v, int threads, size_t d_out, size_t d_in, const float *w, size_t w_stride,
                 const int8_t table[96], uint8_t *packed, uint16_t *scale);
/* Encoding with given bf16 channel scales (a searched or trained scale; no clamping of |w / scale|). */
int s3d8_encode_scaled(int v, int threads, size_t d_out, size_t d_in, const float *w, size_t w_stride,
                       const int8_t table[96], const uint16_t *scale, uint8_t *packed);
int s3d8_dequant(int v, int threads, size_t m, size_t n, const int32_t *acc, size_t acc_stride,
                 const float *x_scale, const uint16_t *w_scale, float *y, size_t y_stride);

/* ---- Decode step (s3d8_decoder.c): one token through a Llama / Mllama text decoder ------------ */

/* A weight of the decoder: S3D8 (packed [ceil(n/3), pad16(k)], table T[32][3], bf16 scales [n]),
 * INT8 (int8 [n, k], bf16 scales [n]) or bf16 ([n, k]). */
enum { S3D8_W_S3D8 = 0, S3D8_W_QSI8 = 1, S3D8_W_BF16 = 2 };
typedef struct s3d8_weight {
    int kind;
    size_t n, k;
    const void *data;
    const int8_t *table;
    const uint16_t *scale;
} s3d8_weight;

/* One decoder layer. Self-attention: K/V caches [n_kv_heads, cache_len, head_dim] float32, written
 * at the token's position. Mllama cross-attention (cross = 1): the caches hold the image's keys
 * (after k_norm) and values, cache_len of them; the query is RMS-normalised per head by q_norm,
 * bias [cache_len] is added to the scores (NULL: none), the attention output is scaled by
 * attn_gate and the MLP output by mlp_row_mask * mlp_gate (the gates already through tanh).
 * skip = 1 leaves the layer out (a cross-attention layer when there is no image). */
typedef struct s3d8_layer {
    const float *ln1, *ln2;
    s3d8_weight q, k, v, o, gate, up, down;
    float *k_cache, *v_cache;
    size_t cache_len;
    int cross, skip;
    const float *q_norm, *bias;
    float attn_gate, mlp_gate, mlp_row_mask;
} s3d8_layer;

/* The decoder: RMSNorm eps, RoPE tables cos and sin_rolled [rope_len, head_dim] (sin with its
 * first half negated: x * cos + roll(x, head_dim / 2) * sin_rolled), the embedding rows (S3D8 rows
 * decoded from their group of 3 and scaled, INT8 rows scaled, bf16 rows widened: float32 products
 * of the int8 value and the bf16 scale, as the Python row embeddings) and the work area.
 * stub_products = 1 skips every weight product (their outputs keep what the work area held): the
 * benchmark's measure of the time outside the products. */
typedef struct s3d8_decoder {
    size_t n_layers, hidden, n_heads, n_kv_heads, head_dim;
    float eps;
    s3d8_layer *layers;
    s3d8_weight embed, lm_head;
    const float *norm;
    const float *cos, *sin_rolled;
    size_t rope_len;
    void *work;
    int stub_products;
} s3d8_decoder;

/* Bytes of the work area for d (64-byte aligned by the caller). */
size_t s3d8_decoder_work_bytes(const s3d8_decoder *d);
/* 0 if every weight and size of d is usable, else a negative code as the drivers (-2: a k above
 * S3D8_K_MAX, -3: a negative table value) or -4 for inconsistent sizes; *where names the layer
 * (n_layers for the embedding and lm_head). */
int s3d8_decoder_check(const s3d8_decoder *d, size_t *where);
/* The logits [lm_head.n] of `token` at position `pos`: embedding, every layer (self-attention
 * layers write K/V at pos and attend to positions 0..pos), final norm, lm_head. Returns 0, -1 for
 * an invalid variant, -4 for pos beyond a cache or the RoPE tables, -5 for a token out of range. */
int s3d8_decoder_step(int v, int threads, const s3d8_decoder *d, int64_t token, size_t pos,
                      float *logits);
/* Several sequences in one step: ds[0..count) share their weights (the same data pointers; each its own
 * caches, RoPE tables and work area), tokens[r] at pos[r] of ds[r], logits[r] its output. Each weight is read
 * once for all of them (one product of count rows); the rest is each sequence's step as above, so every row's
 * logits are its one-sequence step's when the kernels give a row the same bits in a product of several rows.
 * batch_work: s3d8_decoder_batch_work_bytes(ds[0], count) bytes, 64-byte aligned (NULL for count 1).
 * Returns as s3d8_decoder_step; -4 also for decoders that do not share their weights. */
size_t s3d8_decoder_batch_work_bytes(const s3d8_decoder *d, size_t count);
int s3d8_decoder_step_batch(int v, int threads, const s3d8_decoder *const *ds, size_t count,
                            const int64_t *tokens, const size_t *pos, float *const *logits,
                            void *batch_work);

/* Benchmark helper: reads n bytes in 64-byte chunks (with the kernels' software prefetch) and
 * returns a checksum, at the speed of the memory system; the bandwidth yardstick for the INT8 GEMV. */
uint64_t s3d8_read_bandwidth_probe(const uint8_t *buf, size_t n);

/* Fitting a centroid table (Lloyd-Max): for each of the n 3-vectors stored as columns of a (a[j * stride + i],
 * j = 0, 1, 2), the first index q of the least float32 ((a0 - c0)^2 + (a1 - c1)^2) + (a2 - c2)^2 over the 32
 * float centroids c[q][3]; the same arithmetic as pipeline.formats.s3d8._nearest_columns, so the same answer. */
int s3d8_nearest_centroids(int threads, size_t n, const float *a, size_t stride, const float c[96],
                           int64_t *out);

#ifdef __cplusplus
}
#endif
#endif
