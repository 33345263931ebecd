/* Standalone benchmark (no Python): the paper's kernel table (SPEC section 8) on any machine this
 * library builds for, e.g. an Arm phone or a Graviton (see native/build.py for cross builds).
 *
 *   s3d8_bench [--shapes 1x4096x14336,128x4096x4096] [--threads 1] [--variant NAME]
 *              [--ops s3d8,int8,bf16] [--rotate-mb 512] [--repeats 15] [--hot]
 *
 * Weights rotate through copies totalling at least --rotate-mb (default 512 MB) so that they come
 * from memory, not cache (--hot: one copy). Each measurement is the median of --repeats calls, and
 * includes the per-token activation quantisation. Before timing, every op is checked against the
 * scalar reference on the first 48 output channels; a mismatch fails the run (exit status 1).
 * Output: one line per measurement, key=value, with the variant that ran. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "s3d8.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static uint32_t next_u32(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 11);
}

static void *xmalloc(size_t n) {
    void *p = aligned_alloc(64, (n + 63) / 64 * 64);
    if (!p) { fprintf(stderr, "s3d8_bench: out of memory (%zu bytes)\n", n); exit(2); }
    return p;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

typedef struct {
    const char *op;
    size_t m, k, n;
    int v, threads, repeats, hot;
    size_t rotate_bytes;
} config;

/* Weights and activations for one shape; `copies` weight copies to rotate through. */
typedef struct {
    size_t copies, wbytes;
    uint8_t **w;
    uint16_t *w_scale;
    int8_t table[96];
    float *x, *y, *y_ref;
    int8_t *xq, *work;
    float *x_scale;
    int32_t *x_sum;
} data;

static size_t weight_bytes(const char *op, size_t k, size_t n) {
    if (!strcmp(op, "s3d8")) return S3D8_GROUPS(n) * S3D8_PAD16(k);
    if (!strcmp(op, "int8")) return n * k;
    return n * k * 2; /* bf16 */
}

/* One product with variant v over output channels [0, n) of copy c. */
static void run_op(const config *cf, data *d, int v, size_t c, size_t n, float *y) {
    size_t m = cf->m, k = cf->k, ls = S3D8_LHS_STRIDE(k);
    if (!strcmp(cf->op, "bf16")) {
        s3d8_matmul_bf16(v, cf->threads, m, n, k, d->x, k, (const uint16_t *)d->w[c], k, y, cf->n);
        return;
    }
    s3d8_quant(v, cf->threads, m, k, d->x, k, d->xq, ls, d->x_scale, d->x_sum);
    if (!strcmp(cf->op, "int8"))
        s3d8_matmul_qsi8(v, cf->threads, m, n, k, d->xq, ls, d->x_scale, d->x_sum,
                         (const int8_t *)d->w[c], k, d->w_scale, y, cf->n);
    else if (m <= 16)
        s3d8_matmul_s3d8(v, cf->threads, m, n, k, d->xq, ls, d->x_scale, d->x_sum, d->w[c],
                         d->table, d->w_scale, y, cf->n);
    else
        s3d8_matmul_s3d8_tiled(v, cf->threads, m, n, k, d->xq, ls, d->x_scale, d->x_sum, d->w[c],
                               d->table, d->w_scale, y, cf->n, d->work, 128);
}

static int bench(const config *cf) {
    data d = {0};
    size_t m = cf->m, k = cf->k, n = cf->n;
    d.wbytes = weight_bytes(cf->op, k, n);
    d.copies = cf->hot ? 1 : (cf->rotate_bytes + d.wbytes - 1) / d.wbytes;
    if (d.copies < 1) d.copies = 1;
    d.w = xmalloc(d.copies * sizeof *d.w);
    for (size_t c = 0; c < d.copies; c++) {
        d.w[c] = xmalloc(d.wbytes);
        for (size_t i = 0; i < d.wbytes; i++) d.w[c][i] = (uint8_t)next_u32();
        if (!strcmp(cf->op, "int8"))
            for (size_t i = 0; i < d.wbytes; i++) if (d.w[c][i] == 0x80) d.w[c][i] = 0x81; /* no -128 */
        if (!strcmp(cf->op, "bf16"))
            for (size_t i = 1; i < d.wbytes; i += 2) d.w[c][i] = (uint8_t)(0x3C + (d.w[c][i] & 1) * 0x80);
    }
    d.w_scale = xmalloc(n * sizeof(uint16_t));
    for (size_t i = 0; i < n; i++) d.w_scale[i] = s3d8_bf16_from_f32(0.01f);
    for (int i = 0; i < 96; i++) d.table[i] = (int8_t)(next_u32() % 128);
    d.x = xmalloc(m * k * sizeof(float));
    for (size_t i = 0; i < m * k; i++) d.x[i] = (float)((int)(next_u32() % 2001) - 1000) * 1e-3f;
    d.y = xmalloc(m * n * sizeof(float));
    d.y_ref = xmalloc(m * n * sizeof(float));
    d.xq = xmalloc(m * S3D8_LHS_STRIDE(k));
    d.x_scale = xmalloc(m * sizeof(float));
    d.x_sum = xmalloc(m * sizeof(int32_t));
    d.work = xmalloc((size_t)cf->threads * 3 * 128 * S3D8_LHS_STRIDE(k));

    /* correctness first: the first 48 channels against the scalar reference */
    size_t nc = n < 48 ? n : 48;
    int ref = s3d8_variant_find("scalar");
    config one = *cf;
    one.threads = 1;
    run_op(&one, &d, ref, 0, nc, d.y_ref);
    run_op(cf, &d, cf->v, 0, n, d.y);
    int ok = 1;
    for (size_t i = 0; i < m; i++)
        for (size_t c = 0; c < nc; c++) {
            float a = d.y[i * n + c], b = d.y_ref[i * n + c];
            float tol = strcmp(cf->op, "bf16") ? 0.0f : 1e-3f * (b < 0 ? -b : b) + 1e-3f;
            if ((a > b ? a - b : b - a) > tol) ok = 0;
        }

    double *t = xmalloc((size_t)cf->repeats * sizeof(double));
    for (int r = 0; r < cf->repeats; r++) {
        double t0 = now();
        run_op(cf, &d, cf->v, (size_t)(r + 1) % d.copies, n, d.y);
        t[r] = now() - t0;
    }
    qsort(t, (size_t)cf->repeats, sizeof(double), cmp_double);
    double med = t[cf->repeats / 2], macs = (double)m * (double)k * (double)n;
    printf("op=%s m=%zu k=%zu n=%zu variant=%s threads=%d mode=%s copies=%zu check=%s "
           "ms=%.4f gmacs=%.2f weight_gbps=%.2f\n",
           cf->op, m, k, n, s3d8_variant_get(cf->v)->name, cf->threads, cf->hot ? "hot" : "cold",
           d.copies, ok ? "ok" : "MISMATCH", med * 1e3, macs / med * 1e-9,
           (double)d.wbytes / med * 1e-9);
    fflush(stdout);
    for (size_t c = 0; c < d.copies; c++) free(d.w[c]);
    free(d.w); free(d.w_scale); free(d.x); free(d.y); free(d.y_ref); free(d.xq); free(d.x_scale);
    free(d.x_sum); free(d.work); free(t);
    return ok;
}

static void usage(void) {
    fprintf(stderr, "usage: s3d8_bench [--shapes MxKxN,...] [--threads N] [--variant NAME] "
                    "[--ops s3d8,int8,bf16] [--rotate-mb MB] [--repeats R] [--hot]\n");
    exit(2);
}

int main(int argc, char **argv) {
    const char *shapes = "1x4096x4096,1x4096x14336,1x14336x4096,128x4096x4096,1601x1280x5120";
    const char *ops = "s3d8,int8,bf16", *vname = NULL;
    config cf = {.threads = 1, .repeats = 15, .rotate_bytes = (size_t)512 << 20};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--hot")) { cf.hot = 1; continue; }
        if (!val) usage();
        i++;
        if (!strcmp(a, "--shapes")) shapes = val;
        else if (!strcmp(a, "--threads")) cf.threads = atoi(val);
        else if (!strcmp(a, "--variant")) vname = val;
        else if (!strcmp(a, "--ops")) ops = val;
        else if (!strcmp(a, "--rotate-mb")) cf.rotate_bytes = (size_t)atol(val) << 20;
        else if (!strcmp(a, "--repeats")) cf.repeats = atoi(val);
        else usage();
    }
    if (cf.threads < 1 || cf.repeats < 1) usage();
    cf.v = vname ? s3d8_variant_find(vname) : s3d8_variant_default();
    if (!s3d8_variant_supported(cf.v)) {
        fprintf(stderr, "s3d8_bench: variant %s is not available on this CPU\n", vname ? vname : "$S3D8_VARIANT");
        return 2;
    }
    int ok = 1;
    char *shape_list = strdup(shapes), *save = NULL;
    for (char *s = strtok_r(shape_list, ",", &save); s; s = strtok_r(NULL, ",", &save)) {
        if (sscanf(s, "%zux%zux%zu", &cf.m, &cf.k, &cf.n) != 3 || !cf.m || !cf.k || !cf.n) usage();
        char *op_list = strdup(ops), *save2 = NULL;
        for (char *o = strtok_r(op_list, ",", &save2); o; o = strtok_r(NULL, ",", &save2)) {
            if (strcmp(o, "s3d8") && strcmp(o, "int8") && strcmp(o, "bf16")) usage();
            cf.op = o;
            ok &= bench(&cf);
        }
        free(op_list);
    }
    free(shape_list);
    return ok ? 0 : 1;
}
