/* The S3D8 encoder, included by s3d8_ref.c and by each SIMD file with ENCODE_FN set to a name: the
 * same C compiled for another target, so the variants agree bit for bit (no FMA: -ffp-contract=off;
 * division, subtraction, multiplication and the compare-select are exact IEEE operations). */
#include <math.h>

#include "s3d8.h"

static void ENCODE_FN(size_t d_out, size_t d_in, const float *w, size_t w_stride,
                      const int8_t table[96], const uint16_t *scale, uint8_t *packed, size_t g0,
                      size_t g1) {
    enum { CHUNK = 64 };
    size_t k16 = S3D8_PAD16(d_in);
    float t[3][32];
    for (int i = 0; i < 32; i++)
        for (int j = 0; j < 3; j++) t[j][i] = (float)table[3 * i + j];
    for (size_t g = g0; g < g1; g++) {
        float s[3];
        const float *row[3];
        for (int j = 0; j < 3; j++) {
            size_t r = 3 * g + (size_t)j;
            s[j] = r < d_out ? s3d8_f32_from_bf16(scale[r]) : 1.0f;
            /* padded rows are 0 with scale 1; so is a row whose scale underflowed to 0 (absmax below
             * about 5.8e-39): it decodes to 0 whatever its bytes, and its normalised values (w / 0,
             * infinite or NaN) must not steer the centroid its two neighbours share */
            row[j] = r < d_out && s[j] != 0.0f ? w + r * w_stride : NULL;
        }
        for (size_t c0 = 0; c0 < k16; c0 += CHUNK) {
            size_t len = k16 - c0 < CHUNK ? k16 - c0 : CHUNK;
            /* int32 flags and indices, the width of a float, so that the loops vectorise */
            float a[3][CHUNK], best[CHUNK];
            int32_t neg[3][CHUNK], q[CHUNK];
            for (int j = 0; j < 3; j++) {
                size_t valid = row[j] && d_in > c0 ? (d_in - c0 < len ? d_in - c0 : len) : 0;
                for (size_t c = 0; c < valid; c++) {
                    float v = row[j][c0 + c] / s[j];
                    a[j][c] = fabsf(v);
                    neg[j][c] = v < 0.0f;
                }
                for (size_t c = valid; c < len; c++) {
                    a[j][c] = 0.0f;
                    neg[j][c] = 0;
                }
            }
            for (size_t c = 0; c < len; c++) {
                float e0 = a[0][c] - t[0][0], e1 = a[1][c] - t[1][0], e2 = a[2][c] - t[2][0];
                best[c] = (e0 * e0 + e1 * e1) + e2 * e2;
                q[c] = 0;
            }
            for (int32_t i = 1; i < 32; i++) { /* strict <: the first minimum wins */
                float t0 = t[0][i], t1 = t[1][i], t2 = t[2][i];
                for (size_t c = 0; c < len; c++) {
                    float e0 = a[0][c] - t0, e1 = a[1][c] - t1, e2 = a[2][c] - t2;
                    float d = (e0 * e0 + e1 * e1) + e2 * e2, b = best[c];
                    int32_t better = -(int32_t)(d < b); /* a mask: the loop vectorises */
                    best[c] = d < b ? d : b;
                    q[c] = (q[c] & ~better) | (i & better);
                }
            }
            uint8_t *out = packed + g * k16 + c0;
            for (size_t c = 0; c < len; c++)
                out[c] = (uint8_t)((q[c] << 1) | neg[0][c] | (neg[1][c] << 6) |
                                   ((neg[0][c] ^ neg[2][c]) << 7));
        }
    }
}

