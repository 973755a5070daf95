/* test.c - the moe test runner: kernels against their scalar references, the JSON and
 * safetensors parsers, every golden case (test/golden), chunked against recurrent KDA, absorbed
 * against expanded MLA, cached decode against recompute, batched sessions against each alone,
 * snapshots and forks, hostile files, API misuse, and memory use.
 *
 *   moe-test            run everything
 *   moe-test NAME...    run the named tests
 *   moe-test --list     list the tests
 *
 * Golden data: test/golden (override with MOE_GOLDEN=DIR). Prints "N passed, N failed" last and
 * exits 1 if anything failed. */
#define _POSIX_C_SOURCE 200809L
#define MOE_INTERNAL
#include "../moe.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <time.h>
#include <pthread.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* ---- runner ------------------------------------------------------------------------------ */

static int g_failed_checks; /* the runner's own bookkeeping, not library state */

#define CHECK(expr)                                                                     \
    do {                                                                                \
        if (!(expr)) {                                                                  \
            fprintf(stderr, "  %s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #expr); \
            g_failed_checks++;                                                          \
        }                                                                               \
    } while (0)

#define CHECKF(expr, ...)                                                               \
    do {                                                                                \
        if (!(expr)) {                                                                  \
            fprintf(stderr, "  %s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #expr);  \
            fprintf(stderr, __VA_ARGS__);                                               \
            fprintf(stderr, "\n");                                                      \
            g_failed_checks++;                                                          \
        }                                                                               \
    } while (0)

static const char *golden_dir(void) {
    const char *d = getenv("MOE_GOLDEN");
    return d ? d : "test/golden";
}

static uint64_t rng_state = 88172645463325252ull;
static double urand(void) { /* [0, 1) */
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) / 9007199254740992.0;
}
static float nrand(void) { /* roughly normal */
    return (float)((urand() + urand() + urand() + urand() - 2.0) * 1.7320508);
}

static double max_abs_diff(const float *a, const float *b, size_t n);
static char tmp_root[256];

static void tmp_path(char *out, size_t n, const char *name) { snprintf(out, n, "%s/%s", tmp_root, name); }

static int copy_file(const char *from, const char *to) {
    FILE *a = fopen(from, "rb"), *b = fopen(to, "wb");
    int ok = a && b;
    char buf[1 << 16];
    size_t r;
    while (ok && (r = fread(buf, 1, sizeof buf, a)) > 0) ok = fwrite(buf, 1, r, b) == r;
    if (a) fclose(a);
    if (b && fclose(b)) ok = 0;
    return ok;
}

static char *read_all(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) { free(b); b = NULL; }
    fclose(f);
    if (b) b[n] = 0, *len = (size_t)n;
    return b;
}

static int write_all(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return 0;
    int ok = fwrite(p, 1, n, f) == n;
    return fclose(f) == 0 && ok;
}

/* ---- kernels ------------------------------------------------------------------------------ */

static void test_bf16_f16(void) {
    for (uint32_t h = 0; h < 65536; h++) {
        float f = moe__f16_to_f32((uint16_t)h);
        if (isnan(f)) continue;
        CHECKF(moe__f32_to_f16(f) == h, "f16 %04x", h);
        float b = moe__bf16_to_f32((uint16_t)h);
        if (!isnan(b)) CHECKF(moe__f32_to_bf16(b) == h, "bf16 %04x", h);
    }
    CHECK(moe__f16_to_f32(0x3c00) == 1.0f && moe__f16_to_f32(0xc000) == -2.0f);
    CHECK(moe__f16_to_f32(0x0001) == ldexpf(1, -24)); /* smallest subnormal */
    CHECK(moe__bf16_to_f32(0x3f80) == 1.0f);
    CHECK(moe__f32_to_bf16(1.00390625f) == 0x3f80); /* tie to even */
}

static void test_mxfp4_worked_example(void) {
    /* real K3, layer 1 expert 0 w1 row 0 (golden/README.md): bytes 16 b9 ce 23, scale 121 */
    const uint8_t packed[16] = {0x16, 0xb9, 0xce, 0x23};
    const uint8_t scale[1] = {121};
    const float want[8] = {0.0625f, 0.0078125f, -0.0078125f, -0.0234375f, -0.0625f, -0.03125f, 0.0234375f, 0.015625f};
    float out[32];
    moe__row_to_f32(MOE_T_MXFP4, packed, scale, out, 32);
    for (int i = 0; i < 8; i++) CHECKF(out[i] == want[i], "value %d: %g != %g", i, out[i], want[i]);
    uint8_t neg0 = 0x08, s127 = 127;
    uint8_t row[16] = {0};
    row[0] = neg0;
    moe__row_to_f32(MOE_T_MXFP4, row, &s127, out, 32);
    CHECK(out[0] == 0.0f && signbit(out[0]));
}

static void test_mxfp4_golden_dequant(void) {
    char dir[512], path[600];
    snprintf(dir, sizeof dir, "%s/k3mx", golden_dir());
    snprintf(path, sizeof path, "%s/logits.safetensors", dir);
    moe__st_file ref, shard;
    char err[256];
    CHECKF(moe__st_open(&ref, path, err, sizeof err) == MOE_OK, "%s", err);
    snprintf(path, sizeof path, "%s/model-00002-of-000011.safetensors", dir);
    CHECKF(moe__st_open(&shard, path, err, sizeof err) == MOE_OK, "%s", err);
    if (g_failed_checks) return;
    int checked = 0;
    const int eids[2] = {0, 10};
    const char *ws[3] = {"w1", "w2", "w3"};
    for (int e = 0; e < 2; e++)
        for (int w = 0; w < 3; w++) {
            char n1[200], n2[200], n3[200];
            snprintf(n1, sizeof n1, "dequant.model.layers.1.block_sparse_moe.experts.%d.%s.weight", eids[e], ws[w]);
            snprintf(n2, sizeof n2, "language_model.model.layers.1.block_sparse_moe.experts.%d.%s.weight_packed", eids[e], ws[w]);
            snprintf(n3, sizeof n3, "language_model.model.layers.1.block_sparse_moe.experts.%d.%s.weight_scale", eids[e], ws[w]);
            const moe__st_tensor *want = moe__st_find(&ref, n1), *p = moe__st_find(&shard, n2), *s = moe__st_find(&shard, n3);
            CHECK(want && p && s);
            if (!want || !p || !s) continue;
            int64_t rows = want->shape[0], cols = want->shape[1];
            float *row = malloc(sizeof(float) * (size_t)cols);
            for (int64_t r = 0; r < rows; r++) {
                moe__row_to_f32(MOE_T_MXFP4, (const uint8_t *)p->data + r * cols / 2, (const uint8_t *)s->data + r * cols / 32, row, cols);
                /* bit for bit, -0.0 included */
                CHECKF(!memcmp(row, (const float *)want->data + r * cols, sizeof(float) * (size_t)cols), "%s row %lld", n1, (long long)r);
            }
            free(row);
            checked++;
        }
    CHECK(checked == 6);
    moe__st_close(&ref);
    moe__st_close(&shard);
}

/* MXFP4 times int8 activations (MOE_FLAG_MXFP4_INT8): the reference is exact against the
 * dequantized values (a Q8_0 row holding 2 E2M1 with scale 2^(s-128), which a half can hold for
 * these scales, gives the same float bit for bit); every level against the reference in both
 * layouts; the compressed-tensors and ggml layouts of the same codes agree */
static void test_mxfp4_int8_kernels(void) {
    moe__kernels lv[MOE_KERNEL_LEVELS_MAX];
    int nl = moe__kernel_levels(lv, MOE_KERNEL_LEVELS_MAX);
    const int lens[] = {32, 64, 96, 256, 2048, 7168};
    static const int8_t twice[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    for (size_t a = 0; a < sizeof lens / sizeof *lens; a++)
        for (int mode = 0; mode < 3; mode++) {
            const int n = lens[a], nb = n / 32;
            uint8_t *wq = malloc((size_t)n / 2), *ws = malloc((size_t)nb);
            unsigned char *wg = malloc((size_t)nb * 17);
            moe__block_q8_0 *w8 = malloc(sizeof *w8 * (size_t)nb);
            moe__block_q8a *xq = malloc(sizeof *xq * (size_t)nb);
            float *x = malloc(sizeof(float) * (size_t)n);
            for (int i = 0; i < n / 2; i++) wq[i] = (uint8_t)(urand() * 256);
            for (int b = 0; b < nb; b++) ws[b] = (uint8_t)(mode == 2 ? 104 + b % 40 : 112 + urand() * 16);
            for (int i = 0; i < n; i++) x[i] = nrand() * (mode == 1 ? 1e4f : 1.0f);
            if (mode == 0) x[n / 3] = 80.0f; /* an outlier: its block's other values round small */
            lv[0].quant_q8a(x, xq, n);
            for (int b = 0; b < nb; b++) {
                wg[b * 17] = ws[b];
                for (int i = 0; i < 16; i++) { /* the same codes: column 2i low nibble, 2i+1 high -> ggml's order */
                    const uint8_t v = wq[b * 16 + i];
                    w8[b].qs[2 * i] = twice[v & 15], w8[b].qs[2 * i + 1] = twice[v >> 4];
                }
                for (int i = 0; i < 16; i++)
                    wg[b * 17 + 1 + i] = (uint8_t)(((wq[b * 16 + i / 2] >> (4 * (i & 1))) & 15) | ((wq[b * 16 + 8 + i / 2] >> (4 * (i & 1))) & 15) << 4);
                w8[b].d = moe__f32_to_f16(ldexpf(1.0f, ws[b] - 128));
            }
            const float r = moe__dotq_mxfp4_ref(wq, ws, xq, n), q = moe__dotq_ref(MOE_T_Q8_0, w8, xq, n);
            CHECKF(r == q, "n %d mode %d: mxfp4 %.9g vs its Q8_0 %.9g", n, mode, r, q);
            double ab = 0;
            for (int i = 0; i < n; i++) ab += fabs((double)w8[i / 32].qs[i % 32] * ldexp(1.0, ws[i / 32] - 128) * xq[i / 32].d * xq[i / 32].qs[i % 32]);
            for (int li = 0; li < nl; li++) {
                const float s = lv[li].dotq_mxfp4(wq, ws, xq, n), g = lv[li].dotq[MOE_T_MXFP4_GGML](wg, xq, n);
                CHECKF(fabs((double)r - s) <= 1e-5 * ab + 1e-37 && fabs((double)r - g) <= 1e-5 * ab + 1e-37,
                       "%s n %d mode %d: mxfp4 %g, ggml layout %g, reference %g", lv[li].isa, n, mode, s, g, r);
            }
            free(wq), free(ws), free(wg), free(w8), free(xq), free(x);
        }
}

/* a ggml MXFP4 row of random codes; row 3's scales tiny (one block 2^-127: e = 0), row 5's large */
static void mxfp4_random_row(unsigned char *row, int n, int r) {
    moe__block_mxfp4 *b = (moe__block_mxfp4 *)(void *)row;
    for (int i = 0; i < n / 32; i++) {
        b[i].e = (uint8_t)(r == 3 ? (i == 0 ? 0 : 1 + i % 3) : r == 5 ? 200 + i % 50 : 112 + urand() * 16);
        for (int j = 0; j < 16; j++) b[i].qs[j] = (uint8_t)(urand() * 256);
    }
}

/* MXFP4x8: the scalar x8 kernel gives each row what the row references give bit for bit (the
 * ggml row as stored, and the same codes in the compressed-tensors layout, which repacks to the
 * same bytes) */
static void mxfp4_x8_exact(const unsigned char *rows, const unsigned char *packed, const moe__block_q8a *xq, int n) {
    const int nb = n / 32;
    const int64_t rb = moe__row_bytes(MOE_T_MXFP4_GGML, n);
    uint8_t *ct = malloc((size_t)n / 2 * 8), *sc = malloc((size_t)nb * 8);
    unsigned char *packed_ct = malloc((size_t)rb * 8);
    for (int r = 0; r < 8; r++)
        for (int b = 0; b < nb; b++) {
            const moe__block_mxfp4 *g = (const moe__block_mxfp4 *)(const void *)(rows + r * rb) + b;
            sc[r * nb + b] = g->e;
            for (int i = 0; i < 16; i++) { /* column 2i in the low nibble, 2i+1 in the high */
                const int c0 = 2 * i, c1 = 2 * i + 1;
                const int q0 = c0 < 16 ? g->qs[c0] & 15 : g->qs[c0 - 16] >> 4, q1 = c1 < 16 ? g->qs[c1] & 15 : g->qs[c1 - 16] >> 4;
                ct[(size_t)r * (n / 2) + b * 16 + i] = (uint8_t)(q0 | q1 << 4);
            }
        }
    moe__repack_x8(MOE_T_MXFP4, ct, n / 2, sc, packed_ct, n);
    CHECKF(!memcmp(packed, packed_ct, (size_t)rb * 8), "n %d: the compressed-tensors layout repacks to other bytes", n);
    float out[8];
    moe__dotq8_ref(MOE_T_MXFP4X8, packed, xq, n, out);
    moe__kernels k;
    moe__kernels_init(&k, MOE_FLAG_FORCE_SCALAR);
    int same = 1;
    for (int r = 0; r < 8; r++) {
        const float g = k.dotq[MOE_T_MXFP4_GGML](rows + r * rb, xq, n), c = moe__dotq_mxfp4_ref(ct + (size_t)r * (n / 2), sc + r * nb, xq, n);
        same &= !memcmp(&out[r], &g, 4) && !memcmp(&out[r], &c, 4);
    }
    CHECKF(same, "n %d: the x8 reference differs from the MXFP4 row references", n);
    free(ct), free(sc), free(packed_ct);
}

/* every SIMD level against the scalar reference, ragged lengths and extreme values */
static void test_dot_levels(void) {
    moe__kernels lv[MOE_KERNEL_LEVELS_MAX];
    int nl = moe__kernel_levels(lv, MOE_KERNEL_LEVELS_MAX);
    CHECK(nl >= 1 && !strcmp(lv[0].isa, "scalar"));
    const int lens[] = {1, 3, 7, 8, 15, 16, 17, 31, 32, 33, 64, 100, 255, 256, 257, 1000, 4096, 7168};
    float *x = malloc(sizeof(float) * 8192), *wf = malloc(sizeof(float) * 8192);
    uint16_t *wb = malloc(2 * 8192), *wh = malloc(2 * 8192);
    uint8_t *wq = malloc(4096), *ws = malloc(256);
    for (int li = 1; li < nl; li++)
        for (size_t a = 0; a < sizeof lens / sizeof *lens; a++)
            for (int mode = 0; mode < 3; mode++) { /* normal, large, tiny magnitudes */
                int n = lens[a];
                float mag = mode == 0 ? 1.0f : mode == 1 ? 1e15f : 1e-15f;
                double absdot = 0;
                for (int i = 0; i < n; i++) {
                    x[i] = nrand();
                    wf[i] = nrand() * mag;
                    wb[i] = moe__f32_to_bf16(wf[i]);
                    wh[i] = moe__f32_to_f16(mode == 1 ? nrand() * 6e4f / 4 : wf[i]);
                }
                for (int i = 0; i < n; i++) absdot += fabs((double)wf[i] * x[i]);
                for (int t = 0; t < 3; t++) {
                    int type = t == 0 ? MOE_T_F32 : t == 1 ? MOE_T_BF16 : MOE_T_F16;
                    const void *w = t == 0 ? (const void *)wf : t == 1 ? (const void *)wb : (const void *)wh;
                    float r = lv[0].dot[type](w, NULL, x, n), s = lv[li].dot[type](w, NULL, x, n);
                    double bound = 1e-5 * (type == MOE_T_F16 ? 2e5 : absdot) + 1e-30;
                    if (type == MOE_T_F16) {
                        bound = 0;
                        for (int i = 0; i < n; i++) bound += fabs((double)moe__f16_to_f32(wh[i]) * x[i]);
                        bound = bound * 1e-5 + 1e-30;
                    }
                    CHECKF(fabs((double)r - s) <= bound, "%s type %d n %d: %g vs %g", lv[li].isa, type, n, r, s);
                }
                if (n % 32 == 0) {
                    for (int i = 0; i < n / 2; i++) wq[i] = (uint8_t)(urand() * 256);
                    /* large scales up to 2^103: a sum of 7168 terms stays finite whatever its order */
                    for (int i = 0; i < n / 32; i++) ws[i] = (uint8_t)(mode == 0 ? 110 + urand() * 20 : mode == 1 ? 200 + urand() * 30 : 1 + urand() * 50);
                    /* the ggml layout of the same codes: one block = scale byte + 16 packed bytes */
                    unsigned char *wg = malloc((size_t)n / 32 * 17);
                    for (int b2 = 0; b2 < n / 32; b2++) {
                        wg[b2 * 17] = ws[b2];
                        memcpy(wg + b2 * 17 + 1, wq + b2 * 16, 16);
                    }
                    float rg = lv[0].dot[MOE_T_MXFP4_GGML](wg, NULL, x, n), sg = lv[li].dot[MOE_T_MXFP4_GGML](wg, NULL, x, n);
                    float *rowg = malloc(sizeof(float) * (size_t)n);
                    moe__row_to_f32(MOE_T_MXFP4_GGML, wg, NULL, rowg, n);
                    double adg = 0;
                    for (int i = 0; i < n; i++) adg += fabs((double)rowg[i] * x[i]);
                    CHECKF(fabs((double)rg - sg) <= 1e-5 * adg + 1e-37, "%s mxfp4 ggml n %d: %g vs %g", lv[li].isa, n, rg, sg);
                    free(wg), free(rowg);
                    float r = lv[0].dot[MOE_T_MXFP4](wq, ws, x, n), s = lv[li].dot[MOE_T_MXFP4](wq, ws, x, n);
                    float *row = malloc(sizeof(float) * (size_t)n);
                    moe__row_to_f32(MOE_T_MXFP4, wq, ws, row, n);
                    double ad = 0;
                    for (int i = 0; i < n; i++) ad += fabs((double)row[i] * x[i]);
                    free(row);
                    CHECKF(fabs((double)r - s) <= 1e-5 * ad + 1e-37, "%s mxfp4 n %d: %g vs %g", lv[li].isa, n, r, s);
                }
            }
    free(x), free(wf), free(wb), free(wh), free(wq), free(ws);
    /* axpy, every level, ragged lengths */
    for (int li = 1; li < nl; li++)
        for (int n = 1; n < 100; n += 7) {
            float y0[100], y1[100], xx[100];
            for (int i = 0; i < n; i++) y0[i] = y1[i] = nrand(), xx[i] = nrand();
            lv[0].axpy(y0, 0.37f, xx, n);
            lv[li].axpy(y1, 0.37f, xx, n);
            CHECKF(max_abs_diff(y0, y1, (size_t)n) < 1e-6, "%s axpy n %d", lv[li].isa, n);
        }
}

/* The elementwise functions (sigmoid, silu, softplus, softmax exponentials) of every SIMD level
 * against libm's: random values over the whole range, the thresholds, inf, NaN, results that
 * underflow to subnormals and to 0, ragged lengths (tails) */
static int close_or_same(float a, float b, double rel) {
    if (isnan(a) || isnan(b)) return isnan(a) && isnan(b);
    if (isinf(a) || isinf(b)) return a == b;
    return fabs((double)a - b) <= rel * fabs((double)b) + 1e-44;
}

static void test_act_levels(void) {
    moe__kernels lv[MOE_KERNEL_LEVELS_MAX];
    int nl = moe__kernel_levels(lv, MOE_KERNEL_LEVELS_MAX);
    enum { N = 4099 };
    float *x = malloc(sizeof(float) * N), *r = malloc(sizeof(float) * N), *v = malloc(sizeof(float) * N);
    const float special[] = {0.0f, -0.0f, 1e-30f, -1e-30f, 20.0f, 20.0001f, 19.9999f, -20.0f, 88.0f, 88.7f, 88.73f, 89.5f, 1000.0f,
                             -87.3f, -87.4f, -100.0f, -103.9f, -104.1f, -1000.0f, INFINITY, -INFINITY, NAN, 1.0f, -1.0f};
    const int ns = (int)(sizeof special / sizeof *special);
    for (int i = 0; i < N; i++) x[i] = i < ns ? special[i] : (i % 3 == 0 ? 60.0f * nrand() : i % 3 == 1 ? 4.0f * nrand() : 250.0f * (urand() - 0.5f));
    const int lens[] = {1, 3, 4, 7, 8, 15, 16, 17, 31, 33, N};
    for (int li = 1; li < nl; li++)
        for (size_t a = 0; a < sizeof lens / sizeof *lens; a++) {
            const int n = lens[a];
            for (int kind = MOE__ACT_SIGMOID; kind <= MOE__ACT_SOFTPLUS; kind++) {
                moe__act_ref(r, x, n, kind);
                memcpy(v, x, sizeof(float) * (size_t)n);
                lv[li].act(v, v, n, kind); /* in place, as the forward pass calls it */
                int bad = -1;
                for (int i = 0; i < n && bad < 0; i++)
                    if (!close_or_same(v[i], r[i], 8e-7)) bad = i;
                CHECKF(bad < 0, "%s act %d n %d: f(%g) = %g, libm %g", lv[li].isa, kind, n, bad < 0 ? 0 : x[bad], bad < 0 ? 0 : v[bad], bad < 0 ? 0 : r[bad]);
            }
            for (int sh = 0; sh < 3; sh++) {
                const float shift = sh == 0 ? 0.0f : sh == 1 ? 30.0f : -50.0f;
                float sr = moe__exp_sum_ref(r, x, shift, n), sv = lv[li].exp_sum(v, x, shift, n);
                int bad = -1;
                for (int i = 0; i < n && bad < 0; i++)
                    if (!close_or_same(v[i], r[i], 8e-7)) bad = i;
                CHECKF(bad < 0, "%s exp n %d shift %g: e^(%g) = %g, libm %g", lv[li].isa, n, shift, bad < 0 ? 0 : x[bad], bad < 0 ? 0 : v[bad], bad < 0 ? 0 : r[bad]);
                /* sums in another order: finite ones agree to float rounding */
                CHECKF(close_or_same(sv, sr, 1e-5), "%s exp sum n %d shift %g: %g vs %g", lv[li].isa, n, shift, sv, sr);
            }
        }
    /* bf16 -> f32 widening is exact: every bit pattern, ragged lengths */
    {
        uint16_t *h = malloc(sizeof(uint16_t) * 65536);
        float *w0 = malloc(sizeof(float) * 65536), *w1 = malloc(sizeof(float) * 65536);
        for (int i = 0; i < 65536; i++) h[i] = (uint16_t)i;
        moe__widen_bf16_ref(w0, h, 65536);
        for (int li = 1; li < nl; li++)
            for (size_t a = 0; a < sizeof lens / sizeof *lens; a++) {
                memset(w1, 0, sizeof(float) * 65536);
                lv[li].widen_bf16(w1, h + 65536 - lens[a], lens[a]);
                CHECKF(!memcmp(w1, w0 + 65536 - lens[a], sizeof(float) * (size_t)lens[a]), "%s widen_bf16 n %d", lv[li].isa, lens[a]);
            }
        for (int li = 1; li < nl; li++) {
            lv[li].widen_bf16(w1, h, 65536);
            CHECKF(!memcmp(w1, w0, sizeof(float) * 65536), "%s widen_bf16: all patterns", lv[li].isa);
        }
        free(h), free(w0), free(w1);
    }
    /* values without the specials: the sum is finite and compared as such */
    for (int li = 1; li < nl; li++) {
        float sr = moe__exp_sum_ref(r, x + ns, 10.0f, 1000), sv = lv[li].exp_sum(v, x + ns, 10.0f, 1000);
        CHECKF(isfinite(sr) ? fabs((double)sv - sr) <= 1e-5 * sr : 1, "%s exp sum %g vs %g", lv[li].isa, sv, sr);
    }
    free(x), free(r), free(v);
}

/* KDA's short convolution (moe__dwconv) at every SIMD level against the scalar reference: 1 to
 * 6 taps and the largest, ragged channel counts (tails), weights with a row stride, magnitudes
 * from 1e-20 to 1e20, infinities and NaN in some channels */
static void test_dwconv_levels(void) {
    moe__kernels lv[MOE_KERNEL_LEVELS_MAX];
    const int nl = moe__kernel_levels(lv, MOE_KERNEL_LEVELS_MAX);
    enum { NMAX = 131, TMAX = 64, LDW = 140 };
    float *w = malloc(sizeof(float) * LDW * TMAX), *x = malloc(sizeof(float) * NMAX * TMAX), r[NMAX], v[NMAX];
    const float *rows[TMAX];
    const int taps[] = {1, 2, 3, 4, 5, 6, TMAX}, lens[] = {1, 3, 4, 7, 8, 15, 16, 17, 33, 128, NMAX};
    for (int i = 0; i < LDW * TMAX; i++) w[i] = nrand();
    for (int i = 0; i < NMAX * TMAX; i++) {
        const int c = i % NMAX;
        x[i] = c == 5 ? 1e20f * nrand() : c == 6 ? 1e-20f * nrand() : c == 40 ? INFINITY : c == 41 ? NAN : c == 42 ? -0.0f : nrand();
    }
    for (int j = 0; j < TMAX; j++) rows[j] = x + (size_t)(TMAX - 1 - j) * NMAX; /* rows anywhere, not in order */
    for (int li = 1; li < nl; li++)
        for (size_t ti = 0; ti < sizeof taps / sizeof *taps; ti++)
            for (size_t a = 0; a < sizeof lens / sizeof *lens; a++) {
                const int n = lens[a], k = taps[ti];
                moe__dwconv_ref(r, rows, w, LDW, k, n);
                for (int i = 0; i < NMAX; i++) v[i] = 12345.0f;
                lv[li].dwconv(v, rows, w, LDW, k, n);
                int bad = -1;
                for (int i = 0; i < n && bad < 0; i++) {
                    double mag = 0;
                    for (int j = 0; j < k; j++) mag += fabs((double)w[j * LDW + i] * rows[j][i]);
                    if (isnan(r[i]) || isinf(r[i]) ? !(isnan(v[i]) == isnan(r[i]) && (isnan(r[i]) || v[i] == r[i]))
                                                   : !(fabs((double)v[i] - r[i]) <= 1e-6 * k * mag))
                        bad = i;
                }
                CHECKF(bad < 0, "%s dwconv taps %d n %d: channel %d %g vs %g", lv[li].isa, k, n, bad, bad < 0 ? 0 : v[bad], bad < 0 ? 0 : r[bad]);
                CHECKF(n == NMAX || v[n] == 12345.0f, "%s dwconv taps %d n %d: wrote past n", lv[li].isa, k, n);
            }
    free(w), free(x);
}

/* Q8_0/Q4_0: ggml's rounding (hand-derived known answers), round-trip bounds, and every int8
 * kernel level against the scalar reference; the q8a activation quantizers must agree bit for bit */
static void test_quant_blocks(void) {
    float x[32];
    for (int j = 0; j < 32; j++) x[j] = (float)(j - 16);
    moe__block_q4_0 b4;
    moe__quantize_row(MOE_T_Q4_0, x, &b4, 32);
    /* max-magnitude value is -16: d = -16 / -8 = 2, q = (int)(x / 2 + 8.5) clamped to 15 */
    CHECK(b4.d == 0x4000);
    for (int j = 0; j < 16; j++) {
        int q0 = (int)((j - 16) * 0.5f + 8.5f), q1 = (int)((j) * 0.5f + 8.5f);
        q1 = q1 > 15 ? 15 : q1;
        CHECKF((b4.qs[j] & 15) == q0 && (b4.qs[j] >> 4) == q1, "q4_0 byte %d = %02x", j, b4.qs[j]);
    }
    moe__block_q8_0 b8;
    moe__quantize_row(MOE_T_Q8_0, x, &b8, 32);
    CHECK(moe__f16_to_f32(b8.d) == moe__f16_to_f32(moe__f32_to_f16(16.0f / 127)));
    CHECK(b8.qs[0] == -127 && b8.qs[16] == 0 && b8.qs[31] == (int8_t)roundf(15 * 127.0f / 16));
    /* round trip on random rows: Q8_0 within d/2 (+ the half-precision scale), Q4_0 within d */
    for (int rep = 0; rep < 50; rep++) {
        float v[256], back[256];
        moe__block_q8_0 q8[8];
        moe__block_q4_0 q4[8];
        for (int i = 0; i < 256; i++) v[i] = nrand() * (rep % 5 == 0 ? 1e-3f : 3.0f);
        moe__quantize_row(MOE_T_Q8_0, v, q8, 256);
        moe__row_to_f32(MOE_T_Q8_0, q8, NULL, back, 256);
        for (int i = 0; i < 256; i++) {
            float d = fabsf(moe__f16_to_f32(q8[i / 32].d));
            /* the half scale: relative 2^-11, or absolute 2^-25 per unit of q when subnormal */
            CHECKF(fabsf(back[i] - v[i]) <= 0.5f * d + 1e-3f * fabsf(v[i]) + 128 * 3e-8f, "q8_0 %d: %g vs %g", i, back[i], v[i]);
        }
        moe__quantize_row(MOE_T_Q4_0, v, q4, 256);
        moe__row_to_f32(MOE_T_Q4_0, q4, NULL, back, 256);
        for (int i = 0; i < 256; i++) {
            float d = fabsf(moe__f16_to_f32(q4[i / 32].d));
            /* a value at the top, 8 d' with d' the exact scale, comes back as 7 d with d = d' in
             * half precision (within 2^-11 of it): off by up to d + 8 2^-11 d' */
            CHECKF(fabsf(back[i] - v[i]) <= 1.005f * d + 1e-30f, "q4_0 %d: %g vs %g", i, back[i], v[i]);
        }
    }
    moe__kernels lv[MOE_KERNEL_LEVELS_MAX];
    int nl = moe__kernel_levels(lv, MOE_KERNEL_LEVELS_MAX);
    const int lens[] = {32, 64, 96, 256, 1024, 2048, 7168};
    float *xa = malloc(sizeof(float) * 7168), *w = malloc(sizeof(float) * 7168);
    moe__block_q8a *qa = malloc(sizeof *qa * 224), *qb = malloc(sizeof *qb * 224);
    void *w8 = malloc(34 * 224), *w4 = malloc(18 * 224);
    for (size_t a = 0; a < sizeof lens / sizeof *lens; a++)
        for (int mode = 0; mode < 4; mode++) {
            int n = lens[a];
            for (int i = 0; i < n; i++) {
                xa[i] = mode == 3 ? 0.0f : nrand() * (mode == 1 ? 1e6f : mode == 2 ? 1e-6f : 1.0f);
                w[i] = nrand() * (mode == 1 ? 100.0f : 0.02f);
            }
            if (mode == 0) xa[n / 2] = 50.0f; /* an outlier in one block */
            moe__quantize_row(MOE_T_Q8_0, w, w8, n);
            moe__quantize_row(MOE_T_Q4_0, w, w4, n);
            lv[0].quant_q8a(xa, qa, n);
            for (int li = 1; li < nl; li++) {
                lv[li].quant_q8a(xa, qb, n);
                CHECKF(!memcmp(qa, qb, sizeof *qa * (size_t)(n / 32)), "%s q8a n %d mode %d", lv[li].isa, n, mode);
                for (int t = 0; t < 2; t++) {
                    int type = t ? MOE_T_Q4_0 : MOE_T_Q8_0;
                    const void *wq = t ? w4 : w8;
                    float r = lv[0].dotq[type](wq, qa, n), s = lv[li].dotq[type](wq, qa, n);
                    /* bound: the sum of |terms| at float precision */
                    float *dw = malloc(sizeof(float) * (size_t)n);
                    moe__row_to_f32(type, wq, NULL, dw, n);
                    double ab = 0;
                    for (int i = 0; i < n; i++) ab += fabs((double)dw[i] * qa[i / 32].d * qa[i / 32].qs[i % 32]);
                    free(dw);
                    CHECKF(fabs((double)r - s) <= 1e-5 * ab + 1e-30, "%s dotq type %d n %d mode %d: %g vs %g", lv[li].isa, type, n, mode, r, s);
                }
            }
        }
    free(xa), free(w), free(qa), free(qb), free(w8), free(w4);
    /* interleaved groups: 8 random rows repacked; every level's x8 kernel against the plain
     * per-row reference on the original blocks (same integers, different float summation) */
    const int x8_bases[] = {MOE_T_Q8_0, MOE_T_Q4_0, MOE_T_MXFP4_GGML};
    for (int ti = 0; ti < 3; ti++)
        for (int ni = 0; ni < 4; ni++) {
            const int type = x8_bases[ti], xt = moe__x8_of(type), n = ni == 0 ? 32 : ni == 1 ? 96 : ni == 2 ? 2048 : 7168;
            const int64_t rb = moe__row_bytes(type, n);
            unsigned char *rows = malloc((size_t)rb * 8), *packed = malloc((size_t)moe__row_bytes(xt, n) * 8);
            float *v = malloc(sizeof(float) * (size_t)n);
            moe__block_q8a *xq = malloc(sizeof *xq * (size_t)(n / 32));
            for (int r = 0; r < 8; r++) {
                for (int i = 0; i < n; i++) v[i] = nrand() * (r == 3 ? 1e-4f : 0.05f);
                if (r == 5) v[7] = -40.0f; /* an outlier: q = -127 / 0 */
                if (type != MOE_T_MXFP4_GGML) moe__quantize_row(type, v, rows + r * rb, n);
                else
                    mxfp4_random_row(rows + r * rb, n, r);
            }
            for (int i = 0; i < n; i++) v[i] = nrand();
            lv[0].quant_q8a(v, xq, n);
            moe__repack_x8(type, rows, rb, NULL, packed, n);
            if (type == MOE_T_MXFP4_GGML) mxfp4_x8_exact(rows, packed, xq, n);
            /* four activation rows (the first is xq), blocks 3 rows apart as in a strided batch:
             * the 4-row kernels give each row's dotq8 bit for bit */
            const int64_t nb = n / 32, xs = 3 * nb;
            moe__block_q8a *x4 = malloc(sizeof *x4 * (size_t)(xs * 3 + nb));
            for (int t = 0; t < 4; t++) {
                for (int i = 0; i < n; i++) v[i] = t ? nrand() * (t == 2 ? 30.0f : 1.0f) : v[i];
                if (t) lv[0].quant_q8a(v, x4 + t * xs, n);
                else memcpy(x4, xq, sizeof *xq * (size_t)nb);
            }
            for (int li = 0; li < nl; li++) {
                if (!lv[li].dotq8x4[xt]) continue;
                float o32[32], o8[8];
                lv[li].dotq8x4[xt](packed, x4, xs, n, o32);
                int same = 1;
                for (int t = 0; t < 4; t++) {
                    lv[li].dotq8[xt](packed, x4 + t * xs, n, o8);
                    same &= !memcmp(o8, o32 + 8 * t, sizeof o8);
                }
                CHECKF(same, "%s x8x4 type %d n %d: differs from the 1-row kernel", lv[li].isa, type, n);
            }
            /* two adjacent groups (the second of other random rows): the 2-group kernel gives
             * each group's 4-row outputs bit for bit */
            const int64_t gsz = moe__row_bytes(xt, n) * 8;
            unsigned char *pair = malloc((size_t)gsz * 2), *rows_b = malloc((size_t)rb * 8);
            memcpy(pair, packed, (size_t)gsz);
            for (int r = 0; r < 8; r++) {
                for (int i = 0; i < n; i++) v[i] = nrand() * (r == 6 ? 3.0f : 0.05f);
                if (type != MOE_T_MXFP4_GGML) moe__quantize_row(type, v, rows_b + r * rb, n);
                else
                    mxfp4_random_row(rows_b + r * rb, n, r + 8);
            }
            moe__repack_x8(type, rows_b, rb, NULL, pair + gsz, n);
            free(rows_b);
            for (int li = 0; li < nl; li++) {
                if (!lv[li].dotq8x4x2[xt]) continue;
                float o64[64], oa[32], ob[32];
                lv[li].dotq8x4x2[xt](pair, x4, xs, n, o64);
                lv[li].dotq8x4[xt](pair, x4, xs, n, oa);
                lv[li].dotq8x4[xt](pair + gsz, x4, xs, n, ob);
                int same = 1;
                for (int t = 0; t < 4; t++) same &= !memcmp(o64 + 16 * t, oa + 8 * t, 32) && !memcmp(o64 + 16 * t + 8, ob + 8 * t, 32);
                CHECKF(same, "%s x8x4x2 type %d n %d: differs from the 4-row kernel on each group", lv[li].isa, type, n);
            }
            /* 32 activation rows (zero, huge and tiny rows among them) at another stride: the
             * 16-row kernel gives the 2-group kernel's outputs for each 4 of them bit for bit,
             * into rows of 19 floats */
            const int64_t xs16 = nb + 1;
            moe__block_q8a *x16 = malloc(sizeof *x16 * (size_t)(xs16 * 32));
            for (int t = 0; t < 32; t++) {
                for (int i = 0; i < n; i++) v[i] = t == 5 ? 0.0f : nrand() * (t == 9 ? 1e4f : t == 22 ? 1e-5f : 1.0f);
                lv[0].quant_q8a(v, x16 + t * xs16, n);
            }
            for (int li = 0; li < nl; li++) {
                if (!lv[li].dotq8x16x2[xt]) continue;
                float o608[32 * 19], o64[64];
                memset(o608, 0, sizeof o608);
                lv[li].dotq8x16x2[xt](pair, x16, xs16, n, 32, o608, 19);
                int same = 1;
                for (int t = 0; t < 32; t += 4) {
                    lv[li].dotq8x4x2[xt](pair, x16 + t * xs16, xs16, n, o64);
                    for (int u = 0; u < 4; u++) same &= !memcmp(o608 + 19 * (t + u), o64 + 16 * u, 16 * sizeof(float)) && o608[19 * (t + u) + 16] == 0;
                }
                CHECKF(same, "%s x8x16x2 type %d n %d: differs from the two-group 4-row kernel", lv[li].isa, type, n);
            }
            free(x16);
            free(pair);
            free(x4);
            for (int li = 0; li < nl; li++) { /* the builds without software prefetch, with it into L1, into L2 */
                moe__kernels b[3] = {lv[li], lv[li], lv[li]};
                float o[3][8];
                for (int mode = 0; mode < 3; mode++) moe__x8_prefetch(&b[mode], mode), b[mode].dotq8[xt](packed, xq, n, o[mode]);
                CHECKF(!memcmp(o[1], o[0], sizeof o[0]) && !memcmp(o[2], o[0], sizeof o[0]), "%s x8 type %d n %d: the prefetch builds differ",
                       lv[li].isa, type, n);
            }
            for (int li = 0; li < nl; li++) {
                float out[8];
                lv[li].dotq8[xt](packed, xq, n, out);
                for (int r = 0; r < 8; r++) {
                    float want = lv[0].dotq[type](rows + r * rb, xq, n);
                    float *dw = malloc(sizeof(float) * (size_t)n);
                    moe__row_to_f32(type, rows + r * rb, NULL, dw, n);
                    double ab = 0;
                    for (int i = 0; i < n; i++) ab += fabs((double)dw[i] * xq[i / 32].d * xq[i / 32].qs[i % 32]);
                    free(dw);
                    /* (MXFP4's row 3 sums terms near 2^-127: a slack far below them; random
                     * MXFP4 exponents can overflow a sum to the same infinity in both) */
                    CHECKF(out[r] == want || fabs((double)out[r] - want) <= 2e-5 * ab + (type == MOE_T_MXFP4_GGML ? 1e-42 : 1e-30), "%s x8 type %d n %d row %d: %g vs %g",
                           lv[li].isa, type, n, r, out[r], want);
                }
            }
            free(rows), free(packed), free(v), free(xq);
        }
}

/* ---- the other ggml block formats (Q4_1, Q5_0, Q5_1, Q2_K .. Q6_K, IQ4_NL, IQ4_XS) -------- */

#define N_KQ 10
static const int kq_types[N_KQ] = {MOE_T_Q4_1, MOE_T_Q5_0, MOE_T_Q5_1, MOE_T_Q4_K, MOE_T_Q5_K, MOE_T_Q6_K, MOE_T_Q2_K, MOE_T_Q3_K, MOE_T_IQ4_NL, MOE_T_IQ4_XS};
static const char *const kq_names[N_KQ] = {"q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "q2_k", "q3_k", "iq4_nl", "iq4_xs"};
static const int8_t kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static void k_scale_min(int j, const uint8_t *q, int *d, int *m) {
    if (j < 4) *d = q[j] & 63, *m = q[j + 4] & 63;
    else *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
}

/* a second decoder, in the loop forms of ggml's dequantize_row_* (byte offsets as its structs) */
static void ggml_form_dequant(int type, const unsigned char *p, float *y, int n) {
    if (type == MOE_T_Q2_K) {
        for (int i = 0; i < n / 256; i++, p += 84) {
            uint16_t hd, hm;
            memcpy(&hd, p + 80, 2), memcpy(&hm, p + 82, 2);
            const float d = moe__f16_to_f32(hd), mn = moe__f16_to_f32(hm);
            const uint8_t *sc = p, *q = p + 16;
            int is = 0;
            for (int k = 0; k < 256; k += 128) {
                for (int shift = 0; shift < 8; shift += 2) {
                    float dl = d * (sc[is] & 0xF), ml = mn * (sc[is] >> 4);
                    is++;
                    for (int l = 0; l < 16; l++) *y++ = dl * ((q[l] >> shift) & 3) - ml;
                    dl = d * (sc[is] & 0xF), ml = mn * (sc[is] >> 4);
                    is++;
                    for (int l = 0; l < 16; l++) *y++ = dl * ((q[l + 16] >> shift) & 3) - ml;
                }
                q += 32;
            }
        }
        return;
    }
    if (type == MOE_T_Q3_K) {
        for (int i = 0; i < n / 256; i++, p += 110) {
            uint16_t hd;
            memcpy(&hd, p + 108, 2);
            const float d = moe__f16_to_f32(hd);
            const uint8_t *hm = p, *q = p + 32, *s = p + 96;
            uint32_t aux[4], tmp; /* the 6-bit scales unpacked four words at a time, as ggml does */
            memcpy(aux, s, 12);
            tmp = aux[2];
            aux[2] = ((aux[0] >> 4) & 0x0f0f0f0f) | (((tmp >> 4) & 0x03030303) << 4);
            aux[3] = ((aux[1] >> 4) & 0x0f0f0f0f) | (((tmp >> 6) & 0x03030303) << 4);
            aux[0] = (aux[0] & 0x0f0f0f0f) | (((tmp >> 0) & 0x03030303) << 4);
            aux[1] = (aux[1] & 0x0f0f0f0f) | (((tmp >> 2) & 0x03030303) << 4);
            const int8_t *scales = (const int8_t *)aux;
            int is = 0;
            uint8_t m = 1;
            for (int k = 0; k < 256; k += 128) {
                for (int shift = 0; shift < 8; shift += 2, m <<= 1) {
                    float dl = d * (scales[is++] - 32);
                    for (int l = 0; l < 16; l++) *y++ = dl * (((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4));
                    dl = d * (scales[is++] - 32);
                    for (int l = 0; l < 16; l++) *y++ = dl * (((q[l + 16] >> shift) & 3) - ((hm[l + 16] & m) ? 0 : 4));
                }
                q += 32;
            }
        }
        return;
    }
    if (type == MOE_T_IQ4_NL || type == MOE_T_IQ4_XS) {
        const int xs = type == MOE_T_IQ4_XS, bv = xs ? 256 : 32;
        for (int i = 0; i < n / bv; i++, p += xs ? 136 : 18) {
            uint16_t hd, sh = 0;
            memcpy(&hd, p, 2);
            if (xs) memcpy(&sh, p + 2, 2);
            const float d = moe__f16_to_f32(hd);
            const uint8_t *qs = p + (xs ? 8 : 2);
            for (int ib = 0; ib < bv / 32; ib++) {
                const int ls = xs ? (((p[4 + ib / 2] >> 4 * (ib % 2)) & 0xf) | (((sh >> 2 * ib) & 3) << 4)) : 0;
                const float dl = xs ? d * (ls - 32) : d;
                for (int j = 0; j < 16; j++) y[j] = dl * kvalues_iq4nl[qs[j] & 0xf], y[j + 16] = dl * kvalues_iq4nl[qs[j] >> 4];
                y += 32, qs += 16;
            }
        }
        return;
    }
    if (type == MOE_T_Q4_1 || type == MOE_T_Q5_0 || type == MOE_T_Q5_1) {
        const int bs = type == MOE_T_Q4_1 ? 20 : type == MOE_T_Q5_0 ? 22 : 24;
        for (int i = 0; i < n / 32; i++, p += bs, y += 32) {
            uint16_t hd, hm = 0;
            uint32_t qh = 0;
            memcpy(&hd, p, 2);
            if (type != MOE_T_Q5_0) memcpy(&hm, p + 2, 2);
            if (type != MOE_T_Q4_1) memcpy(&qh, p + (type == MOE_T_Q5_0 ? 2 : 4), 4);
            const uint8_t *qs = p + bs - 16;
            const float d = moe__f16_to_f32(hd), m = moe__f16_to_f32(hm);
            for (int j = 0; j < 16; j++) {
                const int xh0 = ((qh >> j) << 4) & 0x10, xh1 = (qh >> (j + 12)) & 0x10;
                const int x0 = (qs[j] & 0xF) | xh0, x1 = (qs[j] >> 4) | xh1;
                if (type == MOE_T_Q5_0) y[j] = (float)(x0 - 16) * d, y[j + 16] = (float)(x1 - 16) * d;
                else y[j] = (float)x0 * d + m, y[j + 16] = (float)x1 * d + m;
            }
        }
        return;
    }
    if (type == MOE_T_Q6_K) {
        for (int i = 0; i < n / 256; i++, p += 210) {
            uint16_t hd;
            memcpy(&hd, p + 208, 2);
            const float d = moe__f16_to_f32(hd);
            const uint8_t *ql = p, *qh = p + 128;
            const int8_t *sc = (const int8_t *)(p + 192);
            for (int k = 0; k < 256; k += 128) {
                for (int l = 0; l < 32; l++) {
                    const int is = l / 16;
                    const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    y[l] = d * sc[is] * q1, y[l + 32] = d * sc[is + 2] * q2;
                    y[l + 64] = d * sc[is + 4] * q3, y[l + 96] = d * sc[is + 6] * q4;
                }
                y += 128, ql += 64, qh += 32, sc += 8;
            }
        }
        return;
    }
    const int five = type == MOE_T_Q5_K;
    for (int i = 0; i < n / 256; i++, p += five ? 176 : 144) {
        uint16_t hd, hm;
        memcpy(&hd, p, 2), memcpy(&hm, p + 2, 2);
        const float d = moe__f16_to_f32(hd), mn = moe__f16_to_f32(hm);
        const uint8_t *scales = p + 4, *qh = p + 16, *q = p + (five ? 48 : 16);
        int is = 0, u1 = 1, u2 = 2;
        for (int j = 0; j < 256; j += 64) {
            int sc, m;
            k_scale_min(is, scales, &sc, &m);
            const float d1 = d * sc, m1 = mn * m;
            k_scale_min(is + 1, scales, &sc, &m);
            const float d2 = d * sc, m2 = mn * m;
            for (int l = 0; l < 32; l++) *y++ = d1 * ((q[l] & 0xF) + (five && (qh[l] & u1) ? 16 : 0)) - m1;
            for (int l = 0; l < 32; l++) *y++ = d2 * ((q[l] >> 4) + (five && (qh[l] & u2) ? 16 : 0)) - m2;
            q += 32, is += 2, u1 <<= 2, u2 <<= 2;
        }
    }
}

/* random block bytes with sane half-precision scales (the rest of the bits as they fall) */
static void random_kq_row(int type, unsigned char *p, int n) {
    const int64_t rb = moe__row_bytes(type, n), bv = moe__block_values(type), bs = rb / (n / bv);
    for (int64_t i = 0; i < rb; i++) p[i] = (unsigned char)(urand() * 256);
    for (int64_t b = 0; b < n / bv; b++) {
        unsigned char *q = p + b * bs;
        const uint16_t d = moe__f32_to_f16((float)((urand() < 0.5 ? -1 : 1) * (1e-3 + 0.05 * urand())));
        const uint16_t m = moe__f32_to_f16((float)(0.05 * urand()));
        if (type == MOE_T_Q6_K) memcpy(q + 208, &d, 2);
        else if (type == MOE_T_Q2_K) memcpy(q + 80, &d, 2), memcpy(q + 82, &m, 2);
        else if (type == MOE_T_Q3_K) memcpy(q + 108, &d, 2);
        else memcpy(q, &d, 2);
        if (type == MOE_T_Q4_1 || type == MOE_T_Q5_1 || type == MOE_T_Q4_K || type == MOE_T_Q5_K) memcpy(q + 2, &m, 2);
    }
}

/* A row w of n values of an integer format times the q8a row qa, on every kernel level lv[0..nl):
 * the scalar kernel against the decoded weights times the decoded activations (in double: to
 * float summation order) and the reference; every other level against the scalar kernel; with
 * x4, each level's 4-row kernel (qa shifted by 0..3 blocks, so each row sees other activations:
 * qa must hold n / 32 + 3 blocks) against its 1-row kernel, bit for bit. dw: n floats of room.
 * Returns how many levels after the first have a kernel of their own for the format. */
static int check_row_dotq(const moe__kernels *lv, int nl, int type, const char *name, const void *w, const moe__block_q8a *qa, int n, int mode,
                          int x4, float *dw) {
    moe__row_to_f32(type, w, NULL, dw, n);
    double exact = 0, ab = 0;
    for (int i = 0; i < n; i++) {
        const double term = (double)dw[i] * qa[i / 32].d * qa[i / 32].qs[i % 32];
        exact += term, ab += fabs(term);
    }
    const float r = lv[0].dotq[type](w, qa, n);
    CHECKF(fabs(r - exact) <= 1e-5 * ab + 1e-30, "%s scalar n %d mode %d: %g vs %g", name, n, mode, r, exact);
    CHECK(r == moe__dotq_ref(type, w, qa, n));
    int own = 0;
    for (int li = 1; li < nl; li++) {
        const float s = lv[li].dotq[type](w, qa, n);
        CHECKF(fabs((double)r - s) <= 1e-5 * ab + 1e-30, "%s %s n %d mode %d: %g vs %g", lv[li].isa, name, n, mode, s, r);
        own += lv[li].dotq[type] != lv[0].dotq[type];
    }
    for (int li = 0; li < nl && x4; li++) {
        if (!lv[li].dotq4[type]) continue;
        float o[4];
        lv[li].dotq4[type](w, qa, 1, n, o);
        for (int k = 0; k < 4; k++) CHECKF(o[k] == lv[li].dotq[type](w, qa + k, n), "%s %s x4 row %d", lv[li].isa, name, k);
    }
    return own;
}

static void test_kquant_blocks(void) {
    /* 1. the decoder against ggml's loop forms on random bytes, bit for bit */
    for (int t = 0; t < N_KQ; t++) {
        const int type = kq_types[t], n = 1024;
        unsigned char *row = malloc((size_t)moe__row_bytes(type, n));
        float a[1024], b[1024];
        for (int rep = 0; rep < 20; rep++) {
            random_kq_row(type, row, n);
            moe__row_to_f32(type, row, NULL, a, n);
            ggml_form_dequant(type, row, b, n);
            int same = 1;
            for (int i = 0; i < n; i++) same &= a[i] == b[i];
            CHECKF(same, "%s: decoding differs from ggml's loop form", kq_names[t]);
        }
        free(row);
    }
    /* 2. the quantizers: round trip error relative to the row's RMS, against Q4_0's and Q8_0's on
     * the same rows (k-quants and the 5-bit formats must beat Q4_0, Q6_K come near Q8_0); zero
     * rows give zeros; an outlier stays within its block */
    {
        const int n = 2048, rows = 40;
        float *v = malloc(sizeof(float) * n), *back = malloc(sizeof(float) * n);
        unsigned char *q = malloc((size_t)moe__row_bytes(MOE_T_Q8_0, n));
        double err[12] = {0}, ref = 0;
        const int types[12] = {MOE_T_Q4_0, MOE_T_Q8_0, MOE_T_Q4_1, MOE_T_Q5_0, MOE_T_Q5_1, MOE_T_Q4_K, MOE_T_Q5_K, MOE_T_Q6_K, MOE_T_Q2_K, MOE_T_Q3_K, MOE_T_IQ4_NL, MOE_T_IQ4_XS};
        for (int r = 0; r < rows; r++) {
            const float s = r % 4 == 0 ? 1e-3f : r % 4 == 1 ? 30.0f : 0.05f;
            for (int i = 0; i < n; i++) v[i] = nrand() * s + (r % 3 == 0 ? 0.5f * s : 0.0f); /* some rows off zero */
            if (r % 5 == 2) v[r] = 40 * s;
            double rr = 0;
            for (int i = 0; i < n; i++) rr += (double)v[i] * v[i];
            ref += rr / n / ((double)s * s);
            for (int t = 0; t < 12; t++) {
                moe__quantize_row(types[t], v, q, n);
                moe__row_to_f32(types[t], q, NULL, back, n);
                double e = 0;
                for (int i = 0; i < n; i++) e += ((double)back[i] - v[i]) * ((double)back[i] - v[i]);
                err[t] += e / n / ((double)s * s);
            }
        }
        for (int t = 0; t < 12; t++) err[t] = sqrt(err[t] / ref);
        printf("  relative RMS error q4_0 %.4f q8_0 %.4f q4_1 %.4f q5_0 %.4f q5_1 %.4f q4_k %.4f q5_k %.4f q6_k %.4f\n", err[0], err[1], err[2], err[3], err[4],
               err[5], err[6], err[7]);
        printf("  relative RMS error q2_k %.4f q3_k %.4f iq4_nl %.4f iq4_xs %.4f\n", err[8], err[9], err[10], err[11]);
        CHECK(err[2] < err[0] && err[5] < err[0]);            /* Q4_1, Q4_K beat Q4_0 */
        CHECK(err[3] < 0.6 * err[0] && err[4] < 0.6 * err[0]); /* 5 bits: about half the step */
        CHECK(err[6] < 0.6 * err[5] && err[7] < 0.7 * err[6]); /* Q5_K, Q6_K: a bit more, about half the error */
        CHECK(err[7] < 5 * err[1]); /* 6 bits in 16s against 8 in 32s: ~3.3x */
        CHECK(err[10] < err[0] && err[11] < err[0]);           /* IQ4's levels beat Q4_0's even steps */
        CHECK(err[9] < 0.7 * err[8] && err[9] < 2 * err[0]);  /* Q3_K: ~1.7x the error of 4 bits */
        CHECK(err[8] < 3.5 * err[0]);                          /* Q2_K: ~2.7x */
        for (int t = 2; t < 12; t++) {
            memset(v, 0, sizeof(float) * n);
            moe__quantize_row(types[t], v, q, n);
            moe__row_to_f32(types[t], q, NULL, back, n);
            int zero = 1;
            for (int i = 0; i < n; i++) zero &= back[i] == 0;
            CHECKF(zero, "%s: a zero row", kq_names[t - 2]);
        }
        free(v), free(back), free(q);
    }
    /* 3. every level's kernel against the scalar one, and the scalar one against the decoded
     * weights times the decoded activations (in double): to float summation order */
    moe__kernels lv[MOE_KERNEL_LEVELS_MAX];
    const int nl = moe__kernel_levels(lv, MOE_KERNEL_LEVELS_MAX);
    const int lens[] = {32, 96, 256, 512, 2048, 7168};
    float *xa = malloc(sizeof(float) * 7168), *dw = malloc(sizeof(float) * 7168);
    moe__block_q8a *qa = malloc(sizeof *qa * 224);
    unsigned char *w = malloc((size_t)moe__row_bytes(MOE_T_Q8_0, 7168)); /* the largest of them */
    for (int i = 0; i < 7168; i++) xa[i] = nrand();
    lv[0].quant_q8a(xa, qa, 7168); /* every block defined (the 4-row check reads past n) */
    for (int t = 0; t < N_KQ; t++)
        for (size_t a = 0; a < sizeof lens / sizeof *lens; a++)
            for (int mode = 0; mode < 5; mode++) {
                const int type = kq_types[t], n = lens[a];
                if (n % moe__block_values(type)) continue;
                for (int i = 0; i < n; i++) xa[i] = mode == 3 ? 0.0f : nrand() * (mode == 1 ? 1e6f : mode == 2 ? 1e-6f : 1.0f);
                if (mode == 0) xa[n / 2] = 50.0f;
                if (mode == 4) { /* quantized from values, with an outlier */
                    for (int i = 0; i < n; i++) dw[i] = nrand() * 0.02f;
                    dw[n / 3] = 3.0f;
                    moe__quantize_row(type, dw, w, n);
                } else {
                    random_kq_row(type, w, n);
                }
                lv[0].quant_q8a(xa, qa, n);
                check_row_dotq(lv, nl, type, kq_names[t], w, qa, n, mode, n <= 2048, dw);
            }
    free(xa), free(dw), free(qa), free(w);
    /* Q4_K, Q5_K, IQ4_XS, Q2_K, Q3_K and Q6_K interleaved 8 rows at a time: the reference gives
     * each row's reference bit for bit, each level's kernels each row's 1-row kernel of that level
     * bit for bit */
    for (int ti = 0; ti < 18; ti++) {
        static const int x8_types[6] = {3, 4, 9, 6, 7, 5}; /* in kq_types */
        const int ni = ti % 3, kt = kq_types[x8_types[ti / 3]], xt = moe__x8_of(kt);
        const char *nm = kq_names[x8_types[ti / 3]];
        const int n = ni == 0 ? 256 : ni == 1 ? 2048 : 7168;
        const int64_t rb = moe__row_bytes(kt, n);
        unsigned char *rows = malloc((size_t)rb * 8), *packed = malloc((size_t)moe__row_bytes(xt, n) * 8);
        float *v = malloc(sizeof(float) * (size_t)n), out[8];
        moe__block_q8a *xq = malloc(sizeof *xq * (size_t)(n / 32));
        for (int r = 0; r < 8; r++) {
            if (r % 2) random_kq_row(kt, rows + r * rb, n);
            else {
                for (int i = 0; i < n; i++) v[i] = nrand() * (r == 4 ? 1e-4f : 0.05f) + (r == 2 ? 0.03f : 0.0f);
                moe__quantize_row(kt, v, rows + r * rb, n);
            }
        }
        for (int i = 0; i < n; i++) v[i] = nrand();
        v[n / 5] = 60.0f;
        moe__quant_q8a_ref(v, xq, n);
        moe__block_q8a *xq4 = malloc(sizeof *xq4 * (size_t)(4 * (n / 32 + 1)));
        for (int t = 0; t < 4; t++) {
            for (int i = 0; i < n; i++) v[i] = nrand() * (t == 2 ? 1e3f : 1.0f);
            moe__quant_q8a_ref(v, xq4 + t * (n / 32 + 1), n);
        }
        moe__repack_x8(kt, rows, rb, NULL, packed, n);
        moe__dotq8_ref(xt, packed, xq, n, out);
        for (int r = 0; r < 8; r++) CHECKF(out[r] == moe__dotq_ref(kt, rows + r * rb, xq, n), "%s x8 reference row %d n %d", nm, r, n);
        for (int li = 0; li < nl; li++) {
            if (!lv[li].dotq8[xt]) continue;
            lv[li].dotq8[xt](packed, xq, n, out);
            for (int r = 0; r < 8; r++)
                CHECKF(out[r] == lv[li].dotq[kt](rows + r * rb, xq, n), "%s %s x8 row %d n %d: %g vs %g", lv[li].isa, nm, r, n, out[r],
                       lv[li].dotq[kt](rows + r * rb, xq, n));
            if (!lv[li].dotq8x4[xt] || n > 2048) continue;
            float o32[32], o8[8];
            lv[li].dotq8x4[xt](packed, xq4, n / 32 + 1, n, o32); /* 4 activation rows, xs not n / 32 */
            for (int t = 0; t < 4; t++) {
                lv[li].dotq8[xt](packed, xq4 + t * (n / 32 + 1), n, o8);
                CHECKF(!memcmp(o8, o32 + 8 * t, sizeof o8), "%s %s x8 4-row kernel, row %d n %d", lv[li].isa, nm, t, n);
            }
            if (!lv[li].dotq8x4x2[xt]) continue;
            /* two adjacent groups, the second the first's rows in reverse order: the 2-group
             * kernel gives each group's 4-row outputs bit for bit */
            const int64_t gsz = moe__row_bytes(xt, n) * 8;
            unsigned char *rev = malloc((size_t)rb * 8), *pair = malloc((size_t)gsz * 2);
            for (int r = 0; r < 8; r++) memcpy(rev + r * rb, rows + (7 - r) * rb, (size_t)rb);
            memcpy(pair, packed, (size_t)gsz);
            moe__repack_x8(kt, rev, rb, NULL, pair + gsz, n);
            float o64[64], ob[32];
            if (lv[li].dotq8x2[xt]) { /* the one-row two-group kernel: each group's dotq8 */
                float o16[16], oa8[8], ob8[8];
                lv[li].dotq8x2[xt](pair, xq, n, o16);
                lv[li].dotq8[xt](pair, xq, n, oa8);
                lv[li].dotq8[xt](pair + gsz, xq, n, ob8);
                CHECKF(!memcmp(o16, oa8, 32) && !memcmp(o16 + 8, ob8, 32), "%s %s x8 two-group 1-row kernel n %d", lv[li].isa, nm, n);
            }
            lv[li].dotq8x4x2[xt](pair, xq4, n / 32 + 1, n, o64);
            lv[li].dotq8x4[xt](pair + gsz, xq4, n / 32 + 1, n, ob);
            for (int t = 0; t < 4; t++)
                CHECKF(!memcmp(o64 + 16 * t, o32 + 8 * t, 32) && !memcmp(o64 + 16 * t + 8, ob + 8 * t, 32),
                       "%s %s x8 two-group 4-row kernel, row %d n %d", lv[li].isa, nm, t, n);
            free(rev), free(pair);
        }
        free(rows), free(packed), free(v), free(xq), free(xq4);
    }
}

/* ---- the grid-codebook formats (IQ1_S .. IQ3_S), read only ---------------------------------- */

#define N_IQ 7
static const int iq_types[N_IQ] = {MOE_T_IQ2_XXS, MOE_T_IQ2_XS, MOE_T_IQ2_S, MOE_T_IQ3_XXS, MOE_T_IQ3_S, MOE_T_IQ1_S, MOE_T_IQ1_M};
static const char *const iq_names[N_IQ] = {"iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m"};

/* a row of n values of an IQ format: every byte `fill` (0..255) or random (-1), each block's
 * half-precision scale then set to +-(1e-3 .. 0.05) (IQ1_M keeps it in its scales' top nibbles) */
static void iq_row(int type, unsigned char *p, int n, int fill) {
    const int64_t bb = moe__row_bytes(type, 256);
    for (int64_t i = 0; i < n / 256 * bb; i++) p[i] = (unsigned char)(fill >= 0 ? fill : (int)(urand() * 256));
    for (int b = 0; b < n / 256; b++) {
        unsigned char *q = p + b * bb;
        const uint16_t d = moe__f32_to_f16((float)((urand() < 0.5 ? -1 : 1) * (1e-3 + 0.05 * urand())));
        if (type == MOE_T_IQ1_M)
            for (int w = 0; w < 4; w++) q[48 + 2 * w + 1] = (unsigned char)((q[48 + 2 * w + 1] & 15) | ((d >> (4 * w)) & 15) << 4);
        else memcpy(q, &d, 2);
    }
}

/* The grid formats' kernels on every level (check_row_dotq; the decoder they share is checked
 * against ggml's in ggml_blocks): rows of random bytes, all ones (the largest indices, scales and
 * every sign) and all zeros; activations normal, huge, tiny, zero, with an outlier. */
static void test_iq_kernels(void) {
    moe__kernels lv[MOE_KERNEL_LEVELS_MAX];
    const int nl = moe__kernel_levels(lv, MOE_KERNEL_LEVELS_MAX);
    const int lens[] = {256, 512, 2048, 7168};
    float *xa = malloc(sizeof(float) * (7168 + 96)), *dw = malloc(sizeof(float) * 7168);
    moe__block_q8a *qa = malloc(sizeof *qa * 227);
    unsigned char *w = malloc((size_t)moe__row_bytes(MOE_T_IQ3_S, 7168)); /* the largest of them */
    for (int i = 0; i < 7168 + 96; i++) xa[i] = nrand();
    lv[0].quant_q8a(xa, qa, 7168 + 96); /* every block defined (the 4-row check reads 3 blocks past n) */
    int checked = 0;
    for (int t = 0; t < N_IQ; t++)
        for (size_t a = 0; a < sizeof lens / sizeof *lens; a++)
            for (int mode = 0; mode < 6; mode++) {
                const int type = iq_types[t], n = lens[a];
                for (int i = 0; i < n; i++) xa[i] = mode == 3 ? 0.0f : nrand() * (mode == 1 ? 1e6f : mode == 2 ? 1e-6f : 1.0f);
                if (mode == 0) xa[n / 2] = 50.0f;
                iq_row(type, w, n, mode == 4 ? 255 : mode == 5 ? 0 : -1);
                lv[0].quant_q8a(xa, qa, n);
                checked += check_row_dotq(lv, nl, type, iq_names[t], w, qa, n, mode, 1, dw);
            }
    /* every SIMD level has its own kernels for them (none left to the scalar one) */
    CHECKF(nl == 1 || checked == (nl - 1) * N_IQ * 4 * 6, "%d of %d SIMD calls were the level's own", checked, (nl - 1) * N_IQ * 4 * 6);
    free(xa), free(dw), free(qa), free(w);
}

/* Our block formats against ggml's own code: test/ggml/blocks.bin holds, per format, values and
 * ggml's reference quantization of them, ggml's dequantization of that, random bytes and ggml's
 * dequantization of those (scripts/ggml-blocks.c, built against ggml's ggml-quants.c; see
 * test/ggml/README.md). Our decoder must give ggml's values (a zero's sign aside); our quantizer
 * ggml's bytes where we claim its rounding (Q4_0 .. Q8_0), and elsewhere an RMS error on the same
 * values near that of ggml's reference quantizer (no importance matrix): per stretch of 256 values
 * (they differ in scale; one has an outlier) at most 1.15 times it (our Q2_K weighs an outlier
 * less: 1.12 there, 0.92-0.97 on the others), on average over the stretches at most 1.03. */
static void test_ggml_blocks(void) {
    size_t len = 0, at = 0;
    unsigned char *buf = (unsigned char *)read_all("test/ggml/blocks.bin", &len);
    CHECK(buf != NULL);
    if (!buf) return;
    int records = 0;
    while (at + 20 <= len) {
        char name[9] = {0};
        int32_t h[3];
        memcpy(name, buf + at, 8), memcpy(h, buf + at + 8, 12);
        at += 20;
        const int n = h[1], nb = h[2], type = moe__type_of_ggml((uint32_t)h[0]); /* the GGUF reader's mapping */
        const int header_ok = type >= 0 && n > 0 && n % 256 == 0 && at + (size_t)n * 12 + (size_t)nb * 2 <= len;
        CHECKF(header_ok, "%s: record header (ggml type %d)", name, h[0]);
        if (!header_ok) break;
        CHECKF(moe__row_bytes(type, n) == nb, "%s: %d bytes for %d values, ggml %d", name, (int)moe__row_bytes(type, n), n, nb);
        float *x = malloc(sizeof(float) * (size_t)n * 3), *ours = x + n, *deq = x + 2 * n;
        unsigned char *mine = malloc((size_t)nb);
        const unsigned char *q = buf + at + sizeof(float) * (size_t)n, *r = q + nb + sizeof(float) * (size_t)n;
        memcpy(x, buf + at, sizeof(float) * (size_t)n);
        at = (size_t)(r - buf) + (size_t)nb + sizeof(float) * (size_t)n;
        for (int part = 0; part < 2; part++) { /* ggml's quantization of x, then random bytes; each followed by ggml's values */
            const unsigned char *bytes = part ? r : q;
            memcpy(deq, bytes + nb, sizeof(float) * (size_t)n);
            moe__row_to_f32(type, bytes, NULL, ours, n);
            int bad = 0, first = -1;
            for (int i = 0; i < n; i++)
                if (ours[i] != deq[i] && !(isnan(ours[i]) && isnan(deq[i]))) bad++, first = first < 0 ? i : first;
            CHECKF(!bad, "%s: %s: %d values differ from ggml's decoder, first %d: %g vs %g", name, part ? "random bytes" : "ggml's bytes", bad,
                   first, first >= 0 ? ours[first] : 0, first >= 0 ? deq[first] : 0);
        }
        memcpy(deq, q + nb, sizeof(float) * (size_t)n); /* ggml's decode of its own bytes */
        if (type != MOE_T_MXFP4_GGML && !moe__is_iq(type)) { /* (MXFP4 from floats is moe-convert's, not the library's; the grid formats are read only) */
            moe__quantize_row(type, x, mine, n);
            if (type == MOE_T_Q4_0 || type == MOE_T_Q4_1 || type == MOE_T_Q5_0 || type == MOE_T_Q5_1 || type == MOE_T_Q8_0) {
                CHECKF(!memcmp(mine, q, (size_t)nb), "%s: our quantizer's bytes are not ggml's", name);
            } else {
                moe__row_to_f32(type, mine, NULL, ours, n);
                double mean = 0;
                for (int s = 0; s < n / 256; s++) {
                    double eo = 0, eg = 0;
                    for (int i = 256 * s; i < 256 * (s + 1); i++)
                        eo += (double)(ours[i] - x[i]) * (ours[i] - x[i]), eg += (double)(deq[i] - x[i]) * (deq[i] - x[i]);
                    const double ratio = sqrt(eo / (eg + 1e-300));
                    mean += ratio / (n / 256);
                    CHECKF(ratio <= 1.15, "%s: values %d..: RMS error %g against ggml's %g", name, 256 * s, sqrt(eo / 256), sqrt(eg / 256));
                }
                CHECKF(mean <= 1.03, "%s: RMS error %.4f of ggml's reference quantizer's (mean of 4 stretches)", name, mean);
            }
        }
        free(x), free(mine);
        records++;
    }
    CHECKF(records == 20 && at == len, "%d records, %zu of %zu bytes read", records, at, len);
    free(buf);
}

/* ---- JSON ------------------------------------------------------------------------------ */

static void test_json(void) {
    const char *good[] = {"{}", "[]", "0", "-1.5e3", "\"a\\u00e9\\ud83d\\ude00\"", "{\"a\":[1,2,{\"b\":null}],\"c\":true}", " [ ] "};
    const char *bad[] = {"", "{", "[1,]", "{\"a\"}", "\"\\x\"", "01", "1.", "tru", "[1] x", "\"\\ud800\"", "{\"a\":1,}", "\"a\nb\"", "-", "[\"\\u12\"]"};
    for (size_t i = 0; i < sizeof good / sizeof *good; i++) {
        moe__json *j;
        CHECKF(moe__json_parse(good[i], strlen(good[i]), &j, NULL, 0) == MOE_OK, "%s", good[i]);
        moe__json_free(j);
    }
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        moe__json *j;
        char err[128];
        CHECKF(moe__json_parse(bad[i], strlen(bad[i]), &j, err, sizeof err) == MOE_ERR_FORMAT, "%s", bad[i]);
    }
    moe__json *j;
    const char *t = "{\"k\":\"a\\u00e9\\ud83d\\ude00\",\"n\":[1,2.5]}";
    CHECK(moe__json_parse(t, strlen(t), &j, NULL, 0) == MOE_OK);
    const moe__json *k = moe__json_get(j, "k"), *n = moe__json_get(j, "n");
    CHECK(k && !strcmp(k->str, "a\xc3\xa9\xf0\x9f\x98\x80"));
    CHECK(n && n->n == 2 && n->child->next->num == 2.5);
    moe__json_free(j);
    /* nesting bomb */
    char deep[3000];
    memset(deep, '[', 2000);
    memset(deep + 2000, ']', 999);
    deep[2999] = 0;
    CHECK(moe__json_parse(deep, strlen(deep), &j, NULL, 0) == MOE_ERR_FORMAT);
}

/* ---- golden cases ------------------------------------------------------------------------ */

typedef struct {
    moe__json *cases;
    moe__st_file ref;
    double tol;
} golden;

static int golden_load(golden *g, const char *name) {
    char path[600], err[256];
    size_t len;
    snprintf(path, sizeof path, "%s/%s/cases.json", golden_dir(), name);
    char *text = read_all(path, &len);
    CHECKF(text != NULL, "cannot read %s", path);
    if (!text) return 0;
    moe_status st = moe__json_parse(text, len, &g->cases, err, sizeof err);
    free(text);
    CHECKF(st == MOE_OK, "%s", err);
    if (st) return 0;
    snprintf(path, sizeof path, "%s/%s/logits.safetensors", golden_dir(), name);
    st = moe__st_open(&g->ref, path, err, sizeof err);
    CHECKF(st == MOE_OK, "%s", err);
    if (st) { moe__json_free(g->cases); return 0; }
    g->tol = moe__json_get(moe__json_get(g->cases, "recommended_tolerance"), "logits_max_abs")->num;
    return 1;
}

static void golden_free(golden *g) {
    moe__json_free(g->cases);
    moe__st_close(&g->ref);
}

static int ids_of(const moe__json *arr, int32_t **out) {
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(arr->n ? arr->n : 1));
    int n = 0;
    for (const moe__json *e = arr->child; e; e = e->next) ids[n++] = (int32_t)e->num;
    *out = ids;
    return n;
}

static int argmax(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

static double max_abs_diff(const float *a, const float *b, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (!(d <= m)) m = d; /* NaN propagates as failure */
    }
    return m;
}

/* mean over n rows of V logits of KL(softmax(ref row) || softmax(test row)), in nats */
static double mean_kl(const float *ref, const float *test, int n, int V) {
    double kl = 0;
    for (int t = 0; t < n; t++) {
        const float *a = ref + (size_t)t * V, *b = test + (size_t)t * V;
        double ma = a[0], mb = b[0], za = 0, zb = 0;
        for (int i = 1; i < V; i++) ma = a[i] > ma ? a[i] : ma, mb = b[i] > mb ? b[i] : mb;
        for (int i = 0; i < V; i++) za += exp(a[i] - ma), zb += exp(b[i] - mb);
        for (int i = 0; i < V; i++) {
            const double la = a[i] - ma - log(za), lb = b[i] - mb - log(zb);
            kl += exp(la) * (la - lb);
        }
    }
    return kl / n;
}

static moe_options *golden_opts; /* run_golden_path_cache's options; NULL: defaults */

static moe_model *open_path(const char *path, unsigned flags, int threads) {
    char err[512];
    moe_options o = golden_opts ? *golden_opts : moe_default_options();
    o.flags = flags;
    o.n_threads = threads;
    moe_model *m = NULL;
    moe_status st = moe_model_open(&m, path, &o, err, sizeof err);
    CHECKF(st == MOE_OK, "open %s: %s", path, err);
    return m;
}

static moe_model *open_model(const char *sub, unsigned flags, int threads) {
    char path[600];
    snprintf(path, sizeof path, "%s/%s", golden_dir(), sub);
    return open_path(path, flags, threads);
}

/* every prompt: all prefill rows, argmax, routing, 16 greedy tokens and their logit rows;
 * model_path: the case's directory, or another file holding the same model (GGUF) */
static void run_golden_path(const char *name, const char *model_path, unsigned flags, int threads) {
    golden g;
    if (!golden_load(&g, name)) return;
    moe_model *m = model_path ? open_path(model_path, flags, threads) : open_model(name, flags, threads);
    if (!m) { golden_free(&g); return; }
    const moe_config *c = moe_model_config(m);
    const int V = c->vocab_size, L = c->n_layers, K = c->n_active;
    const moe__json *prompts = moe__json_get(g.cases, "prompts");
    for (const moe__json *p = prompts->child; p; p = p->next) {
        int32_t *ids, *greedy;
        int n = ids_of(moe__json_get(p, "ids"), &ids), ng = ids_of(moe__json_get(p, "greedy"), &greedy);
        const char *pname = moe__json_get(p, "name")->str;
        char key[128];
        snprintf(key, sizeof key, "%s.logits", pname);
        const moe__st_tensor *want = moe__st_find(&g.ref, key);
        snprintf(key, sizeof key, "%s.greedy_logits", pname);
        const moe__st_tensor *gwant = moe__st_find(&g.ref, key);
        CHECK(want && gwant && want->shape[0] == n && want->shape[1] == V);
        moe_session *s = NULL;
        CHECK(moe_session_new(&s, m, n + ng, NULL, 0) == MOE_OK);
        float *logits = malloc(sizeof(float) * (size_t)V * (size_t)n);
        int32_t *routes = malloc(sizeof(int32_t) * (size_t)n * L * (K ? K : 1));
        moe_seq q = {.s = s, .tokens = ids, .n = n, .logits = logits, .logits_all = 1, .routes = K ? routes : NULL};
        char err[256];
        CHECKF(moe_step(m, &q, 1, NULL, err, sizeof err) == MOE_OK, "%s", err);
        const float *wl = want->data;
        double md = max_abs_diff(logits, wl, (size_t)n * V);
        CHECKF(md <= g.tol, "%s %s: max |dlogit| %.3g > %.3g", name, pname, md, g.tol);
        int amiss = 0;
        for (int t = 0; t < n; t++) amiss += argmax(logits + (size_t)t * V, V) != argmax(wl + (size_t)t * V, V);
        CHECKF(amiss == 0, "%s %s: argmax differs at %d rows", name, pname, amiss);
        /* routing ids, except the positions listed as fragile */
        const moe__json *fragile = moe__json_get(p, "fragile_routing_below_1e-5");
        int rmiss = 0, rchecked = 0;
        for (int l = 0; K && l < L; l++) {
            snprintf(key, sizeof key, "%s.route.%d.ids", pname, l);
            const moe__st_tensor *rt = moe__st_find(&g.ref, key);
            if (!c->layer_moe[l]) { CHECK(rt == NULL && routes[l * K] == -1); continue; }
            CHECK(rt != NULL);
            if (!rt) continue;
            for (int t = 0; t < n; t++) {
                int is_fragile = 0;
                for (const moe__json *f = fragile ? fragile->child : NULL; f; f = f->next)
                    is_fragile |= (int)f->child->num == t && (int)f->child->next->num == l;
                if (is_fragile) continue;
                rchecked++;
                rmiss += memcmp(routes + ((size_t)t * L + l) * K, (const int32_t *)rt->data + (size_t)t * K, sizeof(int32_t) * K) != 0;
            }
        }
        CHECKF(rmiss == 0, "%s %s: routing differs in %d of %d (token, layer) pairs", name, pname, rmiss, rchecked);
        /* greedy continuation with the caches */
        const float *gl = gwant->data;
        float *row = logits + (size_t)(n - 1) * V;
        double gmd = 0;
        int gmiss = 0;
        for (int j = 0; j < ng; j++) {
            double dd = max_abs_diff(row, gl + (size_t)j * V, (size_t)V);
            if (dd > gmd) gmd = dd;
            int32_t tok = argmax(row, V);
            gmiss += tok != greedy[j];
            if (j + 1 == ng) break;
            moe_seq d = {.s = s, .tokens = &greedy[j], .n = 1, .logits = logits};
            CHECKF(moe_step(m, &d, 1, NULL, err, sizeof err) == MOE_OK, "%s", err);
            row = logits;
        }
        CHECKF(gmiss == 0, "%s %s: %d greedy tokens differ", name, pname, gmiss);
        CHECKF(gmd <= g.tol, "%s %s: greedy rows max |dlogit| %.3g", name, pname, gmd);
        if (getenv("MOE_TEST_VERBOSE"))
            fprintf(stderr, "  %s %s (%d tokens): max|d| %.2g, greedy rows %.2g, routing %d checked\n", name, pname, n, md, gmd, rchecked);
        free(logits), free(routes), free(ids), free(greedy);
        moe_session_free(s);
    }
    moe_model_close(m);
    golden_free(&g);
}

static void run_golden(const char *name, unsigned flags, int threads) { run_golden_path(name, NULL, flags, threads); }

/* the whole golden check of a case with experts read through a two-expert cache */
static void run_golden_path_cache(const char *name) {
    moe_options o = moe_default_options();
    o.expert_mode = MOE_EXPERTS_CACHE;
    o.expert_budget = 2 * 3264; /* k3mx: MXFP4 experts of 3264 bytes */
    golden_opts = &o;
    run_golden_path(name, NULL, 0, 1);
    golden_opts = NULL;
}
static void test_golden_kimi(void) { run_golden("kimi", 0, 1); }
static void test_golden_seed(void) { run_golden("seed", 0, 1); }
static void test_golden_k3mx(void) { run_golden("k3mx", 0, 1); }
static void test_golden_threads_scalar(void) {
    run_golden("seed", MOE_FLAG_FORCE_SCALAR, 2);
    run_golden("k3mx", 0, 2);
}
/* moe_model_info.kernels names the set the model computes with: the CPU's best level, the
 * scalar one when forced, or the one named by moe_options.kernels; an unknown name fails the
 * open and the message lists the levels. The golden check passes through every level between
 * (avx2 on an AVX-512 machine, avxvnni on one with AVX-VNNI). */
static void test_info_kernels(void) {
    moe__kernels lv[MOE_KERNEL_LEVELS_MAX];
    const int nl = moe__kernel_levels(lv, MOE_KERNEL_LEVELS_MAX);
    moe_model *m = open_model("kimi", 0, 1), *s = open_model("kimi", MOE_FLAG_FORCE_SCALAR, 1);
    if (m && s) {
        const char *a = moe_model_get_info(m).kernels, *b = moe_model_get_info(s).kernels;
        CHECKF(a && !strcmp(a, lv[nl - 1].isa), "kernels %s, this CPU's best level %s", a ? a : "(null)", lv[nl - 1].isa);
        CHECKF(b && !strcmp(b, "scalar"), "forced scalar: kernels %s", b ? b : "(null)");
    }
    moe_model_close(m), moe_model_close(s);
    moe_options o = moe_default_options();
    golden_opts = &o;
    for (int i = 0; i < nl; i++) {
        o.kernels = lv[i].isa;
        moe_model *k = open_model("kimi", MOE_FLAG_FORCE_SCALAR, 1); /* the name overrides the flag */
        const char *got = k ? moe_model_get_info(k).kernels : NULL;
        CHECKF(got && !strcmp(got, lv[i].isa), "kernels \"%s\" asked, %s given", lv[i].isa, got ? got : "(null)");
        moe_model_close(k);
        if (i > 0 && i < nl - 1) run_golden("kimi", 0, 2);
    }
    golden_opts = NULL;
    char path[600], err[256] = "";
    snprintf(path, sizeof path, "%s/kimi", golden_dir());
    o.kernels = "avx9000";
    m = NULL;
    CHECK(moe_model_open(&m, path, &o, err, sizeof err) == MOE_ERR_ARG && !m);
    CHECKF(strstr(err, "avx9000") && strstr(err, "scalar"), "unknown kernels: \"%s\"", err);
}
static void test_golden_forced_paths(void) {
    run_golden("kimi", MOE_FLAG_KDA_RECURRENT | MOE_FLAG_MLA_ABSORBED, 1);
    run_golden("seed", MOE_FLAG_KDA_CHUNKED | MOE_FLAG_MLA_EXPANDED, 1);
}

/* ---- KDA chunked vs recurrent -------------------------------------------------------------- */

/* the chunked form (or a level's recurrence: o2, S2) against the scalar recurrence (o1, S1): within
 * 2e-5 of the largest output and state values, plus 2e-5 */
static void kda_check_close(const char *isa, int T, int D, int bounded, const float *o1, const float *o2, size_t n, const float *S1,
                            const float *S2, size_t ns) {
    const double mo = max_abs_diff(o1, o2, n), ms = max_abs_diff(S1, S2, ns);
    double so = 0, ss = 0;
    for (size_t i = 0; i < n; i++) so = fmax(so, fabs(o1[i]));
    for (size_t i = 0; i < ns; i++) ss = fmax(ss, fabs(S1[i]));
    CHECKF(mo <= 2e-5 * (1 + so) && ms <= 2e-5 * (1 + ss), "%s T %d D %d bounded %d: output %.3g (max %.3g), state %.3g (max %.3g)",
           isa, T, D, bounded, mo, so, ms, ss);
}

static void kda_compare(int T, int D, int bounded, const moe__kernels *kl) {
    const int H = 2, st = H * D;
    size_t n = (size_t)T * st;
    float *q = malloc(sizeof(float) * n), *k = malloc(sizeof(float) * n), *v = malloc(sizeof(float) * n);
    float *g = malloc(sizeof(float) * n), *beta = malloc(sizeof(float) * (size_t)T * H);
    float *o1 = malloc(sizeof(float) * n), *o2 = malloc(sizeof(float) * n);
    float *S1 = calloc((size_t)H * D * D, sizeof(float)), *S2 = calloc((size_t)H * D * D, sizeof(float));
    float *work = malloc(sizeof(float) * moe__kda_chunk_work(D));
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++) {
            double sq = 0, sk = 0;
            float *qh = q + (size_t)t * st + h * D, *kh = k + (size_t)t * st + h * D;
            for (int i = 0; i < D; i++) {
                qh[i] = nrand(), kh[i] = nrand();
                sq += qh[i] * qh[i], sk += kh[i] * kh[i];
                v[(size_t)t * st + h * D + i] = nrand();
                /* bounded: (-5, 0); softplus form: mostly small decays, some very large ones */
                float u = (float)urand();
                g[(size_t)t * st + h * D + i] = bounded ? -5.0f * u : (urand() < 0.02 ? -30.0f * u : -0.3f * u);
            }
            for (int i = 0; i < D; i++) qh[i] /= (float)sqrt(sq) * sqrtf((float)D), kh[i] /= (float)sqrt(sk);
            beta[t * H + h] = (float)urand();
        }
    /* start from a non-zero state: chunks must carry it */
    for (size_t i = 0; i < (size_t)H * D * D; i++) S1[i] = S2[i] = nrand() * 0.1f;
    for (int h = 0; h < H; h++) {
        moe__kda_head a = {T, D, st, H, q + h * D, k + h * D, v + h * D, g + h * D, beta + h, o1 + h * D, S1 + (size_t)h * D * D};
        moe__kda_head b = a;
        b.o = o2 + h * D, b.S = S2 + (size_t)h * D * D;
        moe__kda_recurrent(&a);
        if (T % 2) kl->kda_recurrent(&b); /* odd lengths: this level's recurrence against the reference */
        else moe__kda_chunked(&b, bounded, work, kl);
    }
    kda_check_close(kl->isa, T, D, bounded, o1, o2, n, S1, S2, (size_t)H * D * D);
    free(q), free(k), free(v), free(g), free(beta), free(o1), free(o2), free(S1), free(S2), free(work);
}

/* the chunked form (even lengths) and each level's recurrence (odd lengths) against the
 * scalar recurrence, from a non-zero state, every kernel level */
static void test_kda_chunked_vs_recurrent(void) {
    const int Ts[] = {1, 5, 15, 16, 18, 31, 32, 33, 100, 2053, 2054};
    moe__kernels lv[MOE_KERNEL_LEVELS_MAX];
    int nl = moe__kernel_levels(lv, MOE_KERNEL_LEVELS_MAX);
    for (int l = 0; l < nl; l++) {
        for (size_t i = 0; i < sizeof Ts / sizeof *Ts; i++) {
            kda_compare(Ts[i], 32, 1, &lv[l]);
            kda_compare(Ts[i], 32, 0, &lv[l]);
        }
        kda_compare(300, 128, 1, &lv[l]); /* K3's head size */
        kda_compare(301, 128, 0, &lv[l]);
        kda_compare(40, 24, 1, &lv[l]); /* a multiple of 8, not of 16: AVX-512 hands it to AVX2 */
        kda_compare(64, 20, 1, &lv[l]); /* a head size that is not a multiple of 8 */
        kda_compare(65, 20, 0, &lv[l]);
    }
}

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__)) && !defined(MOE_NO_SIMD)
#define TEST_MXCSR 1
#include <xmmintrin.h>
/* the floating-point control word under which each of the chunk's matrix products ran (ANDed) */
static unsigned csr_during;
static moe__gemm_fn gemm_seen;
static void gemm_csr(const void *w, int64_t ldw, int nr, const float *x, int64_t ldx, int nt, int64_t K, float *y, int64_t ldy) {
    csr_during &= _mm_getcsr();
    gemm_seen(w, ldw, nr, x, ldx, nt, K, y, ldy);
}

/* The chunked form flushes denormal numbers (x86's FTZ and DAZ) while it runs, which on Intel
 * cores took prefill from 55 to 125-144 tok/s, and gives the caller back its own setting, with
 * the flush on or off, and keeps any exception flags raised; its decays reach e^-80 here, so
 * results underflow (the flag is checked), and the result still matches the recurrence. */
static void test_kda_chunked_flush(void) {
    const int T = 40, D = 16;
    float *q = malloc(sizeof(float) * T * D), *k = malloc(sizeof(float) * T * D), *v = malloc(sizeof(float) * T * D);
    float *g = malloc(sizeof(float) * T * D), *beta = malloc(sizeof(float) * T), *o1 = malloc(sizeof(float) * T * D);
    float *o2 = malloc(sizeof(float) * T * D), *S1 = malloc(sizeof(float) * D * D), *S2 = malloc(sizeof(float) * D * D);
    float *work = malloc(sizeof(float) * moe__kda_chunk_work(D));
    moe__kernels lv[MOE_KERNEL_LEVELS_MAX];
    const int nl = moe__kernel_levels(lv, MOE_KERNEL_LEVELS_MAX);
    const unsigned saved = _mm_getcsr(), flush = 0x8040u;
    for (int l = 0; l < nl; l++)
        for (int mode = 0; mode < 2; mode++) {
            for (int i = 0; i < T * D; i++) q[i] = (float)nrand(), k[i] = (float)nrand(), v[i] = (float)nrand(), g[i] = -5.0f;
            for (int t = 0; t < T; t++) { /* as the model's: unit keys, queries of norm 1/sqrt(D) */
                double sq = 0, sk = 0;
                for (int i = 0; i < D; i++) sq += q[t * D + i] * q[t * D + i], sk += k[t * D + i] * k[t * D + i];
                for (int i = 0; i < D; i++) q[t * D + i] /= (float)sqrt(sq * D), k[t * D + i] /= (float)sqrt(sk);
            }
            for (int t = 0; t < T; t++) beta[t] = (float)urand();
            for (int i = 0; i < D * D; i++) S1[i] = S2[i] = (float)nrand() * 0.1f;
            moe__kda_head a = {T, D, D, 1, q, k, v, g, beta, o1, S1}, b = a;
            b.o = o2, b.S = S2;
            moe__kda_recurrent(&a);
            moe__kernels kk = lv[l];
            gemm_seen = kk.gemm[MOE_T_F32], kk.gemm[MOE_T_F32] = gemm_csr;
            const unsigned caller = (mode ? saved | flush : saved & ~flush) & ~0x3fu;
            _mm_setcsr(caller | 0x20u); /* a precision flag raised before the call stays */
            csr_during = ~0u;
            moe__kda_chunked(&b, 1, work, &kk);
            const unsigned after = _mm_getcsr();
            _mm_setcsr(saved);
            CHECKF((csr_during & flush) == flush, "%s: the chunk's products ran without FTZ/DAZ (%#x)", lv[l].isa, csr_during);
            CHECKF(after & 0x10u, "%s: no underflow: this test's decays no longer reach the denormal range", lv[l].isa);
            CHECKF((after & ~0x3fu) == caller && (after & 0x20u), "%s: caller's control word %#x, after the chunk %#x", lv[l].isa, caller, after);
            kda_check_close(lv[l].isa, T, D, 1, o1, o2, (size_t)T * D, S1, S2, (size_t)D * D);
        }
    free(q), free(k), free(v), free(g), free(beta), free(o1), free(o2), free(S1), free(S2), free(work);
}
#endif

/* the absorbed-MLA block kernels of every level against their scalar references */
static void test_mla_kernels(void) {
    moe__kernels lv[MOE_KERNEL_LEVELS_MAX];
    int nl = moe__kernel_levels(lv, MOE_KERNEL_LEVELS_MAX);
    const int shapes[][4] = {{16, 512, 64, 256}, {10, 64, 16, 9}, {5, 64, 16, 37}, {3, 96, 32, 20}, {4, 40, 8, 3}, {1, 32, 0, 1}, {8, 128, 16, 300}}; /* H, r, d_r, keys */
    for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
        const int H = shapes[si][0], r = shapes[si][1], dr = shapes[si][2], jn = shapes[si][3], cw = r + dr, dq = 8 + dr;
        float *qa = malloc(sizeof(float) * (size_t)H * r), *qr = malloc(sizeof(float) * (size_t)H * dq + 1);
        float *cache = malloc(sizeof(float) * (size_t)jn * cw), *sc = malloc(sizeof(float) * (size_t)H * jn);
        float *sc2 = malloc(sizeof(float) * (size_t)H * jn), *ctx = malloc(sizeof(float) * (size_t)H * r), *ctx2 = malloc(sizeof(float) * (size_t)H * r);
        for (int i = 0; i < H * r; i++) qa[i] = nrand(), ctx[i] = nrand();
        for (int i = 0; i < H * dq; i++) qr[i] = nrand();
        for (int i = 0; i < jn * cw; i++) cache[i] = nrand();
        moe__mla_block b = {H, r, dr, cw, jn, 0, jn, jn, dq, 0.125f, qa, qr, cache, sc, ctx};
        moe__mla_scores_ref(&b);
        memcpy(ctx2, ctx, sizeof(float) * (size_t)H * r);
        moe__mla_ctx_ref(&b, 0, H);
        for (int l = 1; l < nl; l++) {
            moe__mla_block b2 = b;
            b2.sc = sc2, b2.ctx = malloc(sizeof(float) * (size_t)H * r);
            memcpy(b2.ctx, ctx2, sizeof(float) * (size_t)H * r);
            b2.j0 = 0, b2.j1 = jn / 2; /* two halves, as two threads would */
            lv[l].mla_scores(&b2);
            b2.j0 = jn / 2, b2.j1 = jn;
            lv[l].mla_scores(&b2);
            double ds = max_abs_diff(sc, sc2, (size_t)H * jn);
            lv[l].mla_ctx(&b2, 0, H / 2);
            lv[l].mla_ctx(&b2, H / 2, H);
            double dc = max_abs_diff(ctx, b2.ctx, (size_t)H * r);
            CHECKF(ds < 1e-4 * sqrt(r) && dc < 1e-4 * jn, "%s H %d r %d: scores %.3g, ctx %.3g", lv[l].isa, H, r, ds, dc);
            free(b2.ctx);
        }
        free(qa), free(qr), free(cache), free(sc), free(sc2), free(ctx), free(ctx2);
    }
}

/* the prefill matrix tiles (F32 and BF16 weights) of every level against the reference, with
 * row and token counts that leave partial tiles and lengths that leave partial steps; and each
 * output the same bits however the rows and tokens are grouped into calls */
static void test_gemm_kernels(void) {
    moe__kernels lv[MOE_KERNEL_LEVELS_MAX];
    const int nl = moe__kernel_levels(lv, MOE_KERNEL_LEVELS_MAX);
    /* rows, tokens, K; {5, 37, 4100}: more tokens than one block of activation rows (16 at this K) */
    const int shapes[][3] = {{16, 37, 512}, {16, 4, 2048}, {5, 3, 40}, {4, 4, 16}, {1, 1, 7}, {7, 9, 100}, {3, 6, 33}, {5, 37, 4100}};
    for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++)
        for (int ty = 0; ty < 2; ty++) {
            const int nr = shapes[si][0], nt = shapes[si][1], K = shapes[si][2], type = ty ? MOE_T_BF16 : MOE_T_F32;
            const int64_t ldw = K + 3, ldx = K + 5, ldy = nr + 2;
            float *wf = malloc(sizeof(float) * (size_t)(nr * ldw)), *x = malloc(sizeof(float) * (size_t)(nt * ldx));
            uint16_t *wb = malloc(sizeof(uint16_t) * (size_t)(nr * ldw));
            float *y = calloc((size_t)(nt * ldy), sizeof(float)), *y2 = calloc((size_t)(nt * ldy), sizeof(float)), *y3 = calloc((size_t)(nt * ldy), sizeof(float));
            for (int64_t i = 0; i < nr * ldw; i++) wf[i] = nrand(), wb[i] = moe__f32_to_bf16(wf[i]);
            for (int64_t i = 0; i < nt * ldx; i++) x[i] = nrand() * (i % 97 == 0 ? 1e3f : 1.0f);
            const void *w = ty ? (const void *)wb : (const void *)wf;
            const int64_t esz = ty ? 2 : 4;
            moe__gemm_ref(type, w, ldw, nr, x, ldx, nt, K, y, ldy);
            double scale = 0;
            for (int64_t i = 0; i < nt * ldy; i++) scale = fmax(scale, fabs(y[i]));
            for (int l = 0; l < nl; l++) {
                memset(y2, 0, sizeof(float) * (size_t)(nt * ldy));
                lv[l].gemm[type](w, ldw, nr, x, ldx, nt, K, y2, ldy);
                const double d = max_abs_diff(y, y2, (size_t)(nt * ldy));
                /* the same outputs in other groupings: the first rows / tokens, then the rest */
                const int r1 = nr > 1 ? nr / 2 + 1 : 1, t1 = nt > 1 ? nt / 2 + 1 : 1;
                memset(y3, 0, sizeof(float) * (size_t)(nt * ldy));
                lv[l].gemm[type](w, ldw, r1, x, ldx, t1, K, y3, ldy);
                if (nr > r1) lv[l].gemm[type]((const char *)w + r1 * ldw * esz, ldw, nr - r1, x, ldx, t1, K, y3 + r1, ldy);
                if (nt > t1) lv[l].gemm[type](w, ldw, nr, x + t1 * ldx, ldx, nt - t1, K, y3 + t1 * ldy, ldy);
                CHECKF(d <= 2e-6 * sqrt(K) * (1 + scale) && !memcmp(y2, y3, sizeof(float) * (size_t)(nt * ldy)),
                       "%s %s rows %d tokens %d K %d: %.3g (max %.3g), grouping %s", lv[l].isa, ty ? "bf16" : "f32", nr, nt, K, d, scale,
                       memcmp(y2, y3, sizeof(float) * (size_t)(nt * ldy)) ? "changes the bits" : "same");
            }
            free(wf), free(wb), free(x), free(y), free(y2), free(y3);
        }
}

/* The runtime's parallel product (a contiguous range of row tasks per thread, the rest stolen
 * from the back): on 2, 3, 7 and 16 threads (oversubscribed: threads finish at odd times and
 * steal) every output is the one-thread value bit for bit and none is left unwritten (outputs
 * start as NaN); float, plain and interleaved integer matrices whose task counts do not divide
 * evenly, one and five activation rows */
static void test_matmul_threads(void) {
    enum { NW = 5, K = 256 };
    const int types[NW] = {MOE_T_F32, MOE_T_BF16, MOE_T_Q8_0, MOE_T_Q4_0X8, MOE_T_Q8_0X8};
    const int64_t rows[NW] = {301, 77, 53, 8 * 37, 8 * 41};
    moe__weight w[NW];
    const moe__weight *wp[NW];
    void *data[NW];
    float *v = malloc(sizeof(float) * K);
    for (int i = 0; i < NW; i++) {
        const int t = types[i], x8 = t == MOE_T_Q4_0X8 || t == MOE_T_Q8_0X8, base = t == MOE_T_Q4_0X8 ? MOE_T_Q4_0 : MOE_T_Q8_0;
        const int64_t rb = moe__row_bytes(x8 ? base : t, K);
        unsigned char *d = malloc((size_t)(rb * rows[i])), *p = x8 ? malloc((size_t)(rb * rows[i])) : NULL;
        for (int64_t r = 0; r < rows[i]; r++) {
            for (int k = 0; k < K; k++) v[k] = nrand() * 0.1f;
            if (t == MOE_T_F32) memcpy(d + r * rb, v, sizeof(float) * K);
            else if (t == MOE_T_BF16)
                for (int k = 0; k < K; k++) ((uint16_t *)(void *)(d + r * rb))[k] = moe__f32_to_bf16(v[k]);
            else moe__quantize_row(x8 ? base : t, v, d + r * rb, K);
        }
        for (int64_t g = 0; x8 && g < rows[i] / 8; g++) moe__repack_x8(base, d + g * 8 * rb, rb, NULL, p + g * 8 * rb, K);
        if (x8) free(d), d = p;
        data[i] = d;
        w[i] = (moe__weight){t, rows[i], K, d, NULL};
        wp[i] = &w[i];
    }
    for (int T = 1; T <= 5; T += 4) {
        float *x = malloc(sizeof(float) * T * K), *ref[NW], *y[NW];
        for (int k = 0; k < T * K; k++) x[k] = nrand();
        for (int i = 0; i < NW; i++) {
            ref[i] = malloc(sizeof(float) * (size_t)(T * rows[i])), y[i] = malloc(sizeof(float) * (size_t)(T * rows[i]));
            for (int64_t k = 0; k < T * rows[i]; k++) ref[i][k] = NAN;
        }
        CHECK(moe__matmul(wp, ref, NW, x, T, 1, 0) == MOE_OK);
        const int nts[] = {2, 3, 7, 16};
        for (int ti = 0; ti < 4; ti++) {
            for (int i = 0; i < NW; i++)
                for (int64_t k = 0; k < T * rows[i]; k++) y[i][k] = NAN;
            CHECK(moe__matmul(wp, y, NW, x, T, nts[ti], 0) == MOE_OK);
            for (int i = 0; i < NW; i++) {
                int64_t bad = 0;
                for (int64_t k = 0; k < T * rows[i]; k++) bad += ref[i][k] != y[i][k]; /* NaN: unwritten */
                CHECKF(bad == 0, "matrix %d (type %d) T %d, %d threads: %lld outputs differ from one thread's", i, types[i], T, nts[ti],
                       (long long)bad);
            }
        }
        for (int i = 0; i < NW; i++) free(ref[i]), free(y[i]);
        free(x);
    }
    for (int i = 0; i < NW; i++) free(data[i]);
    free(v);
}

/* MOE_FLAG_ACT16 through the runtime's product: each integer matrix's outputs lie within the
 * bound of the second part's rounding (sum over blocks of |w| times half its step, recomputed
 * here from the reference quantizer) of the exact product of the dequantized weights, where the
 * 8-bit input alone is off by ~250x that; a float matrix in the same call gives its plain
 * outputs bit for bit; 300 rows (two passes of the runtime's 256) on the CPU's kernels and 1 row
 * on the scalar ones; 1 and 3 threads alike. Inputs with an outlier per row (coarse blocks, large
 * rounding errors). */
static void test_matmul_act16(void) {
    enum { NW = 5, K = 256 };
    const int types[NW] = {MOE_T_F32, MOE_T_Q8_0, MOE_T_Q4_0, MOE_T_Q8_0X8, MOE_T_Q4_0X8};
    const int64_t rows[NW] = {19, 53, 21, 8 * 7, 8 * 5};
    moe__weight w[NW];
    const moe__weight *wp[NW];
    void *data[NW];
    float *deq[NW];
    for (int i = 0; i < NW; i++) {
        const int t = types[i], x8 = t == MOE_T_Q4_0X8 || t == MOE_T_Q8_0X8, base = t == MOE_T_Q4_0X8 ? MOE_T_Q4_0 : t == MOE_T_Q8_0X8 ? MOE_T_Q8_0 : t;
        const int64_t rb = moe__row_bytes(base, K);
        unsigned char *d = malloc((size_t)(rb * rows[i]));
        deq[i] = malloc(sizeof(float) * (size_t)(K * rows[i]));
        for (int64_t r = 0; r < rows[i]; r++) {
            float *v = deq[i] + r * K;
            for (int k = 0; k < K; k++) v[k] = nrand() * 0.1f;
            if (t != MOE_T_F32) moe__quantize_row(base, v, d + r * rb, K), moe__row_to_f32(base, d + r * rb, NULL, v, K);
            else memcpy(d + r * rb, v, sizeof(float) * K);
        }
        if (x8) {
            unsigned char *p = malloc((size_t)(rb * rows[i]));
            for (int64_t g = 0; g < rows[i] / 8; g++) moe__repack_x8(base, d + g * 8 * rb, rb, NULL, p + g * 8 * rb, K);
            free(d), d = p;
        }
        data[i] = d;
        w[i] = (moe__weight){t, rows[i], K, d, NULL};
        wp[i] = &w[i];
    }
    const int Ts[] = {1, 300};
    for (int ti = 0; ti < 2; ti++) {
        const int T = Ts[ti];
        float *x = malloc(sizeof(float) * T * K), *bnd = malloc(sizeof(float) * T * K), *e = malloc(sizeof(float) * K);
        moe__block_q8a *q = malloc(sizeof *q * (K / 32)), *q2 = malloc(sizeof *q2 * (K / 32));
        for (int t = 0; t < T; t++) {
            for (int k = 0; k < K; k++) x[t * K + k] = nrand();
            x[t * K + (t * 37) % K] = 40.0f;
            /* the second part's half step at each input value */
            moe__quant_q8a_ref(x + t * K, q, K);
            for (int k = 0; k < K; k++) e[k] = x[t * K + k] - q[k / 32].d * (float)q[k / 32].qs[k % 32];
            moe__quant_q8a_ref(e, q2, K);
            for (int k = 0; k < K; k++) bnd[t * K + k] = q2[k / 32].d * 0.5f;
        }
        float *y16[NW], *y16b[NW], *y8[NW];
        for (int i = 0; i < NW; i++) {
            y16[i] = malloc(sizeof(float) * (size_t)(T * rows[i])), y16b[i] = malloc(sizeof(float) * (size_t)(T * rows[i]));
            y8[i] = malloc(sizeof(float) * (size_t)(T * rows[i]));
            for (int64_t k = 0; k < T * rows[i]; k++) y16[i][k] = y16b[i][k] = NAN;
        }
        const unsigned kset = ti ? 0 : MOE_FLAG_FORCE_SCALAR; /* one row on the scalar kernels, 300 on the CPU's best */
        CHECK(moe__matmul(wp, y16, NW, x, T, 1, MOE_FLAG_ACT16 | kset) == MOE_OK);
        CHECK(moe__matmul(wp, y16b, NW, x, T, 3, MOE_FLAG_ACT16 | kset) == MOE_OK);
        CHECK(moe__matmul(wp, y8, NW, x, T, 1, kset) == MOE_OK);
        for (int i = 0; i < NW; i++) {
            double worst16 = 0, worst8 = 0; /* error over its bound */
            int64_t unequal = 0;
            for (int t = 0; t < T; t++)
                for (int64_t r = 0; r < rows[i]; r++) {
                    const float *wr = deq[i] + r * K, *xt = x + t * K;
                    double exact = 0, b = 0, mag = 0;
                    for (int k = 0; k < K; k++) exact += (double)wr[k] * xt[k], b += fabs(wr[k]) * bnd[t * K + k], mag += fabs(wr[k] * xt[k]);
                    b += 2e-6 * mag; /* the float sums' rounding */
                    worst16 = fmax(worst16, fabs(y16[i][t * rows[i] + r] - exact) / b);
                    worst8 = fmax(worst8, fabs(y8[i][t * rows[i] + r] - exact) / b);
                    unequal += memcmp(&y16[i][t * rows[i] + r], &y16b[i][t * rows[i] + r], sizeof(float)) != 0;
                }
            if (getenv("MOE_TEST_VERBOSE")) printf("  act16 type %d T %d: error / bound %.3g, 8-bit %.3g\n", types[i], T, worst16, worst8);
            if (types[i] == MOE_T_F32) {
                CHECKF(max_abs_diff(y16[i], y8[i], (size_t)(T * rows[i])) == 0, "act16: the float matrix's outputs changed (T %d)", T);
            } else {
                CHECKF(worst16 <= 1 && worst8 > 20, "act16 type %d T %d: error / bound %.3g (8-bit input: %.3g)", types[i], T, worst16, worst8);
            }
            CHECKF(unequal == 0, "act16 type %d T %d: 3 threads change %lld outputs", types[i], T, (long long)unequal);
            free(y16[i]), free(y16b[i]), free(y8[i]);
        }
        free(x), free(bnd), free(e), free(q), free(q2);
    }
    for (int i = 0; i < NW; i++) free(data[i]), free(deq[i]);
}

/* the bf16-cache MLA kernels of every level against their scalar references: queries, rows and
 * weights in bf16 (rows of every width: the AVX512_BF16 kernel's masked tail), a block's keys
 * scored in two halves and its heads summed in two groups, as two threads would */
static void test_mla16_kernels(void) {
    moe__kernels lv[MOE_KERNEL_LEVELS_MAX];
    int nl = moe__kernel_levels(lv, MOE_KERNEL_LEVELS_MAX);
    const int shapes[][4] = {{16, 512, 64, 256}, {16, 512, 64, 37}, {8, 128, 16, 9}, {5, 64, 16, 37}, {3, 96, 32, 20}, {4, 40, 8, 3}, {1, 32, 0, 1}, {6, 64, 7, 4}}; /* H, r, d_r, keys */
    for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
        const int H = shapes[si][0], r = shapes[si][1], dr = shapes[si][2], jn = shapes[si][3], cw = r + dr, ld = jn + 3;
        uint16_t *q = malloc(sizeof(uint16_t) * (size_t)H * cw), *cache = malloc(sizeof(uint16_t) * (size_t)jn * cw);
        float *sc = calloc((size_t)H * ld, sizeof(float)), *sc2 = calloc((size_t)H * ld, sizeof(float)), *p = malloc(sizeof(float) * (size_t)H * ld);
        float *ctx = malloc(sizeof(float) * (size_t)H * r), *ctx2 = malloc(sizeof(float) * (size_t)H * r);
        float *work = malloc(sizeof(float) * moe__mla_work16(H, cw, ld));
        for (int i = 0; i < H * cw; i++) q[i] = moe__f32_to_bf16(nrand());
        for (int i = 0; i < jn * cw; i++) cache[i] = moe__f32_to_bf16(nrand());
        for (int i = 0; i < H * ld; i++) p[i] = (float)urand(); /* softmax weights: in [0, 1] */
        for (int i = 0; i < H * r; i++) ctx[i] = nrand();
        moe__mla_block16 b = {H, r, cw, jn, 0, jn, ld, 0.125f, q, cache, sc, NULL, work};
        moe__mla_scores16_ref(&b);
        memcpy(ctx2, ctx, sizeof(float) * (size_t)H * r);
        b.sc = p, b.ctx = ctx;
        moe__mla_ctx16_ref(&b, 0, H);
        for (int l = 1; l < nl; l++) {
            moe__mla_block16 b2 = b;
            b2.sc = sc2, b2.j1 = jn / 2;
            lv[l].mla_scores16(&b2);
            b2.j0 = jn / 2, b2.j1 = jn;
            lv[l].mla_scores16(&b2);
            const double ds = max_abs_diff(sc, sc2, (size_t)H * ld);
            float *c2 = malloc(sizeof(float) * (size_t)H * r);
            memcpy(c2, ctx2, sizeof(float) * (size_t)H * r);
            b2.sc = p, b2.ctx = c2;
            lv[l].mla_ctx16(&b2, 0, H / 2);
            lv[l].mla_ctx16(&b2, H / 2, H);
            const double dc = max_abs_diff(ctx, c2, (size_t)H * r);
            CHECKF(ds < 1e-4 * sqrt(cw) && dc < 1e-5 * jn + 1e-5, "%s H %d r %d d_r %d keys %d: scores %.3g, ctx %.3g", lv[l].isa, H, r, dr, jn, ds, dc);
            free(c2);
        }
        /* the reference rounds the weights: 0.1 is not a bf16 value, its rounding is */
        if (si == 0) {
            for (int i = 0; i < H * ld; i++) p[i] = 0.1f;
            memcpy(ctx, ctx2, sizeof(float) * (size_t)H * r);
            moe__mla_ctx16_ref(&b, 0, 1);
            double want = ctx2[0];
            for (int j = 0; j < jn; j++) want += (double)moe__bf16_to_f32(moe__f32_to_bf16(0.1f)) * moe__bf16_to_f32(cache[(size_t)j * cw]);
            CHECKF(fabs(ctx[0] - want) < 1e-4, "ctx16 reference %.6g, want %.6g", ctx[0], want);
        }
        free(q), free(cache), free(sc), free(sc2), free(p), free(ctx), free(ctx2), free(work);
    }
}

/* the int8-cache MLA kernels of every level against their scalar references (the same integer
 * sums and float steps: equal unless a compiler fuses a multiply and an add), and the references against
 * the dequantized values in double; rows of every width (the levels' fallbacks for widths they do
 * not tile), key and head tails, zero rows and rows at the int8 extremes */
static void test_mla8_kernels(void) {
    moe__kernels lv[MOE_KERNEL_LEVELS_MAX];
    int nl = moe__kernel_levels(lv, MOE_KERNEL_LEVELS_MAX);
    /* the row quantizer: every level bit for bit the reference (ties of x / d at k + 0.5, zeros,
     * tiny and huge values, tails) */
    {
        const int lens[] = {1, 3, 7, 8, 9, 16, 17, 31, 64, 512, 513};
        float x[513];
        int8_t q0[513], q1[513];
        for (size_t a = 0; a < sizeof lens / sizeof *lens; a++)
            for (int mode = 0; mode < 5; mode++) {
                const int n = lens[a];
                for (int i = 0; i < n; i++)
                    x[i] = mode == 0 ? nrand() : mode == 1 ? (float)(i % 9) - 4.5f : mode == 2 ? 0.0f : nrand() * (mode == 3 ? 1e-39f : 1e37f);
                if (mode == 1) x[n - 1] = 127.0f; /* scale 1: the halves are ties */
                float d0, d1;
                int32_t s0, s1;
                moe__quant8_row(x, n, q0, &d0, &s0);
                for (int li = 1; li < nl; li++) {
                    lv[li].quant8_row(x, n, q1, &d1, &s1);
                    CHECKF(!memcmp(q0, q1, (size_t)n) && !memcmp(&d0, &d1, 4) && s0 == s1, "%s quant8_row n %d mode %d", lv[li].isa, n, mode);
                }
            }
    }
    const int shapes[][4] = {{16, 512, 64, 256}, {16, 512, 64, 37}, {20, 512, 64, 13}, {20, 512, 64, 200}, {96, 512, 64, 160}, {33, 128, 16, 9}, {5, 64, 16, 37},
                             {3, 96, 32, 20}, {4, 40, 8, 3}, {1, 32, 0, 1}, {6, 64, 7, 4}}; /* H, r, d_r, keys */
    for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
        const int H = shapes[si][0], r = shapes[si][1], dr = shapes[si][2], jn = shapes[si][3], cw = r + dr, ld = jn + 3, lw = (jn + 3) / 4 * 4;
        int8_t *q = malloc((size_t)H * cw), *qt = malloc(moe__mla_qt8_bytes(H, cw)), *cache = malloc((size_t)jn * cw);
        float *qd = malloc(sizeof(float) * 2 * (size_t)H), *x = malloc(sizeof(float) * (size_t)cw);
        moe__kv8_meta *meta = malloc(sizeof *meta * (size_t)jn);
        float *sc = calloc((size_t)H * ld, sizeof(float)), *sc2 = calloc((size_t)H * ld, sizeof(float)), *p = malloc(sizeof(float) * (size_t)H * ld);
        float *ctx = malloc(sizeof(float) * (size_t)H * r), *ctx0 = malloc(sizeof(float) * (size_t)H * r), *c2 = malloc(sizeof(float) * (size_t)H * r);
        uint8_t *w = malloc((size_t)H * lw);
        float *ws = malloc(sizeof(float) * (size_t)H);
        int32_t s;
        for (int h = 0; h < H; h++) {
            for (int i = 0; i < cw; i++) x[i] = nrand() * (i < r ? 1.0f : 5.0f);
            moe__quant8_row(x, r, q + (size_t)h * cw, &qd[2 * h], &s);
            moe__quant8_row(x + r, dr, q + (size_t)h * cw + r, &qd[2 * h + 1], &s);
        }
        moe__mla_qt8(q, H, cw, qt);
        for (int j = 0; j < jn; j++) {
            for (int i = 0; i < cw; i++) x[i] = j == 1 ? 0.0f : j == 2 ? (i & 1 ? 3.0f : -3.0f) : nrand() * (i < r ? 0.5f : 2.0f);
            moe__quant8_row(x, r, cache + (size_t)j * cw, &meta[j].dc, &meta[j].sc);
            moe__quant8_row(x + r, dr, cache + (size_t)j * cw + r, &meta[j].dr, &meta[j].sr);
        }
        for (int i = 0; i < H * ld; i++) p[i] = (float)urand(); /* softmax weights: in [0, 1] */
        p[0] = 1.0f;
        if (H > 2) memset(p + (size_t)(H - 1) * ld, 0, sizeof(float) * (size_t)ld); /* a head with no weight */
        for (int i = 0; i < H * r; i++) ctx0[i] = nrand();
        float *wk = malloc(sizeof(float) * (size_t)jn);
        moe__mla_weights8(p, ld, meta, jn, 0, H, w, lw, ws, wk);
        free(wk);
        moe__mla_block8 b = {H, r, cw, jn, 0, jn, ld, lw, 0.125f, q, qt, qd, cache, meta, sc, ctx, w, ws};
        moe__mla_scores8_ref(&b);
        memcpy(ctx, ctx0, sizeof(float) * (size_t)H * r);
        moe__mla_ctx8_ref(&b, 0, H);
        /* the reference against the dequantized values */
        double es = 0, ec = 0;
        for (int h = 0; h < H; h++)
            for (int j = 0; j < jn; j++) {
                double d = 0;
                for (int i = 0; i < cw; i++)
                    d += (double)q[(size_t)h * cw + i] * qd[2 * h + (i >= r)] * cache[(size_t)j * cw + i] * (i < r ? meta[j].dc : meta[j].dr);
                es = fmax(es, fabs(d * 0.125 - sc[(size_t)h * ld + j]) / (1 + fabs(d)));
            }
        for (int h = 0; h < H; h++)
            for (int i = 0; i < r; i++) {
                double d = ctx0[(size_t)h * r + i];
                for (int j = 0; j < jn; j++) d += (double)w[(size_t)h * lw + j] * ws[h] * cache[(size_t)j * cw + i];
                ec = fmax(ec, fabs(d - ctx[(size_t)h * r + i]) / (1 + fabs(d)));
            }
        CHECKF(es < 1e-5 && ec < 1e-5, "int8 MLA reference H %d r %d: scores %.3g, ctx %.3g off the dequantized values", H, r, es, ec);
        /* the quantized weights: the largest of each head's is 255, each within half a step */
        double ew = 0;
        for (int h = 0; h < H; h++) {
            int top = 0;
            for (int j = 0; j < jn; j++) {
                top = w[(size_t)h * lw + j] > top ? w[(size_t)h * lw + j] : top;
                ew = fmax(ew, fabs(w[(size_t)h * lw + j] * (double)ws[h] - (double)p[(size_t)h * ld + j] * meta[j].dc) / ws[h]);
            }
            CHECKF(top == 255 || ws[h] == 0, "head %d: largest weight %d", h, top);
        }
        CHECKF(ew <= 0.5001, "weights off by %.4g steps", ew);
        for (int l = 1; l < nl; l++) {
            moe__mla_block8 b2 = b;
            b2.sc = sc2, b2.j1 = jn / 2;
            lv[l].mla_scores8(&b2);
            b2.j0 = jn / 2, b2.j1 = jn;
            lv[l].mla_scores8(&b2);
            double ds = 0;
            for (int i = 0; i < H * ld; i++) ds = fmax(ds, fabs(sc[i] - sc2[i]) / (1 + fabs(sc[i])));
            memcpy(c2, ctx0, sizeof(float) * (size_t)H * r);
            b2.ctx = c2;
            lv[l].mla_ctx8(&b2, 0, H / 2);
            lv[l].mla_ctx8(&b2, H / 2, H);
            double dc = 0;
            for (int i = 0; i < H * r; i++) dc = fmax(dc, fabs(ctx[i] - c2[i]) / (1 + fabs(ctx[i])));
            CHECKF(ds < 1e-6 && dc < 1e-6, "%s H %d r %d d_r %d keys %d: scores %.3g, ctx %.3g", lv[l].isa, H, r, dr, jn, ds, dc);
            /* the weights' bytes and scales: the reference's exactly (heads in two calls) */
            uint8_t *w2 = malloc((size_t)H * lw);
            float *ws2 = malloc(sizeof(float) * (size_t)H), *wk2 = malloc(sizeof(float) * (size_t)jn);
            memset(w2, 0xAA, (size_t)H * lw);
            lv[l].mla_weights8(p, ld, meta, jn, 0, H / 2, w2, lw, ws2, wk2);
            lv[l].mla_weights8(p, ld, meta, jn, H / 2, H, w2, lw, ws2, wk2);
            CHECKF(!memcmp(w, w2, (size_t)H * lw) && !memcmp(ws, ws2, sizeof(float) * (size_t)H), "%s H %d keys %d: softmax weights' bytes differ",
                   lv[l].isa, H, jn);
            free(w2), free(ws2), free(wk2);
        }
        free(q), free(qt), free(cache), free(qd), free(x), free(meta), free(sc), free(sc2), free(p), free(ctx), free(ctx0), free(c2), free(w), free(ws);
    }
}

/* ---- model-level equivalences --------------------------------------------------------------- */

/* Token ids of golden prompt `pi` followed by its greedy continuation. Those ids were drawn so
 * that no routing decision is within 1e-5 of a tie (cases.json), so two float32 computations
 * that differ only in rounding (chunked vs recurrent, batched vs alone) route identically; on
 * random ids a near-tie can flip an expert and move the logits by whole units. */
static int32_t *golden_ids(const char *name, int pi, int *n) {
    golden g;
    *n = 0;
    if (!golden_load(&g, name)) return NULL;
    const moe__json *p = moe__json_get(g.cases, "prompts")->child;
    for (int i = 0; i < pi && p; i++) p = p->next;
    int32_t *a, *b;
    int na = ids_of(moe__json_get(p, "ids"), &a), nb = ids_of(moe__json_get(p, "greedy"), &b);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(na + nb));
    memcpy(ids, a, sizeof(int32_t) * (size_t)na);
    memcpy(ids + na, b, sizeof(int32_t) * (size_t)nb);
    free(a), free(b);
    golden_free(&g);
    *n = na + nb;
    return ids;
}

/* logits of every position, fed in the given piece sizes (0-terminated list; rest in one piece) */
/* logits of every position, fed in pieces (0-terminated; NULL: all at once), recording or
 * forcing the routing (either may be NULL) */
static float *logits_routed(moe_model *m, const int32_t *ids, int n, const int *pieces, int32_t *routes, const int32_t *force) {
    const moe_config *c = moe_model_config(m);
    const size_t V = (size_t)c->vocab_size, rpt = (size_t)c->n_layers * c->n_active;
    moe_session *s;
    if (moe_session_new(&s, m, n, NULL, 0)) return NULL;
    float *all = malloc(sizeof(float) * V * n);
    for (int done = 0, i = 0; done < n; i++) {
        const int take = pieces && pieces[i] ? pieces[i] : n - done;
        moe_seq q = {.s = s, .tokens = ids + done, .n = take, .logits = all + (size_t)done * V, .logits_all = 1,
                     .routes = routes ? routes + (size_t)done * rpt : NULL, .force_routes = force ? force + (size_t)done * rpt : NULL};
        char err[256];
        CHECKF(moe_step(m, &q, 1, NULL, err, sizeof err) == MOE_OK, "%s", err);
        done += take;
    }
    moe_session_free(s);
    return all;
}

static float *logits_in_pieces(moe_model *m, const int32_t *ids, int n, const int *pieces) {
    return logits_routed(m, ids, n, pieces, NULL, NULL);
}

static moe_model *open_golden_with(const char *name, const moe_options *o);

/* A step's parallel loops on one team of threads for the whole step give the same logits bit
 * for bit as each loop in an OpenMP region of its own: 3 threads (uneven shares of heads, keys
 * and row tasks; the team forced where there are fewer processors), prefill chunks and single tokens, both KDA forms and both MLA forms, every
 * latent cache type (the absorbed form's barriers). */
static void test_step_team(void) {
    const char *cases[] = {"kimi", "seed", "k3mx"};
    const unsigned flags[] = {MOE_FLAG_KDA_RECURRENT | MOE_FLAG_MLA_ABSORBED, MOE_FLAG_KDA_CHUNKED | MOE_FLAG_MLA_EXPANDED};
    const int kv[] = {MOE_KV_F32, MOE_KV_BF16, MOE_KV_Q8};
    const int pieces[] = {7, 1, 1, 5, 1, 2, 1, 1, 0};
    for (int ci = 0; ci < 3; ci++)
        for (int fi = 0; fi < 2; fi++)
            for (int ki = 0; ki < 3; ki++) {
                moe_options o = moe_default_options();
                o.n_threads = 3, o.flags = flags[fi], o.kv_type = kv[ki];
                moe_model *a = open_golden_with(cases[ci], &o), *b = open_golden_with(cases[ci], &o);
                int n;
                int32_t *ids = golden_ids(cases[ci], 1, &n);
                if (a && b && ids && n >= 19) {
                    moe__set_step_team(a, 2), moe__set_step_team(b, 1);
                    const size_t nv = (size_t)19 * moe_model_config(a)->vocab_size;
                    float *la = logits_in_pieces(a, ids, 19, pieces), *lb = logits_in_pieces(b, ids, 19, pieces);
                    CHECKF(la && lb && max_abs_diff(la, lb, nv) == 0, "%s flags %u kv %d: team vs regions %.3g", cases[ci], flags[fi], kv[ki],
                           la && lb ? max_abs_diff(la, lb, nv) : -1.0);
                    free(la), free(lb);
                } else {
                    CHECKF(0, "%s: open or ids (%d tokens)", cases[ci], n);
                }
                free(ids);
                moe_model_close(a), moe_model_close(b);
            }
}

/* Routed experts of short steps through the mapping (the rows of all of a layer's experts split
 * across the threads) and through the cache (one thread per expert) give the same logits bit for
 * bit; steps of 1-3 tokens, so that an expert gets one row (read in place) or several (gathered) */
static int convert(const char *model, const char *out, const char *args);
static void test_expert_paths(void) {
    const char *cases[] = {"kimi", "seed", "k3mx"};
    const int pieces[] = {5, 1, 3, 2, 3, 1, 3, 3, 2, 1, 3, 3, 3, 2, 3, 1, 3, 3, 3, 0};
    for (int ci = 0; ci < 3; ci++) {
        moe_options o = moe_default_options();
        o.n_threads = 2;
        moe_model *a = open_golden_with(cases[ci], &o);
        o.expert_mode = MOE_EXPERTS_CACHE, o.expert_budget = 256 << 20;
        moe_model *b = open_golden_with(cases[ci], &o);
        int n;
        int32_t *ids = golden_ids(cases[ci], 2, &n);
        if (a && b && ids && n >= 48) {
            const size_t nv = (size_t)48 * moe_model_config(a)->vocab_size;
            float *la = logits_in_pieces(a, ids, 48, pieces), *lb = logits_in_pieces(b, ids, 48, pieces);
            CHECKF(la && lb && max_abs_diff(la, lb, nv) == 0, "%s: mapping vs cache %.3g", cases[ci], la && lb ? max_abs_diff(la, lb, nv) : -1.0);
            free(la), free(lb);
        } else {
            CHECKF(0, "%s: open or ids (%d tokens)", cases[ci], n);
        }
        free(ids);
        moe_model_close(a), moe_model_close(b);
    }
    /* Q4_0 / Q8_0 experts: the cache interleaves what it reads as the mapping's load does, so
     * both run the x8 kernels (they differed by 2.2e-6 on kimi and 2.83 on seed, a routing flip,
     * when the cache ran row kernels on the stored layout) */
    const char *qtypes[] = {"--dense q8_0 --experts q8_0", "--dense q4_0 --experts q4_0"};
    for (int ci = 0; ci < 2; ci++)
        for (int ti = 0; ti < 2; ti++) {
            char dir[600], out[600];
            snprintf(dir, sizeof dir, "%s/%s", golden_dir(), cases[ci]);
            snprintf(out, sizeof out, "%s/paths.gguf", tmp_root);
            CHECK(convert(dir, out, qtypes[ti]) == 0);
            moe_options o = moe_default_options();
            o.n_threads = 2;
            moe_model *a = NULL, *b = NULL;
            CHECK(moe_model_open(&a, out, &o, NULL, 0) == MOE_OK);
            o.expert_mode = MOE_EXPERTS_CACHE, o.expert_budget = 256 << 20;
            CHECK(moe_model_open(&b, out, &o, NULL, 0) == MOE_OK);
            int n;
            int32_t *ids = golden_ids(cases[ci], 2, &n);
            if (a && b && ids && n >= 48) {
                const size_t nv = (size_t)48 * moe_model_config(a)->vocab_size;
                float *la = logits_in_pieces(a, ids, 48, pieces), *lb = logits_in_pieces(b, ids, 48, pieces);
                CHECKF(la && lb && max_abs_diff(la, lb, nv) == 0, "%s %s: mapping vs cache %.3g", cases[ci], qtypes[ti],
                       la && lb ? max_abs_diff(la, lb, nv) : -1.0);
                free(la), free(lb);
            }
            free(ids);
            moe_model_close(a), moe_model_close(b);
            remove(out);
        }
    /* MXFP4 experts under MOE_FLAG_MXFP4_INT8, interleaved at load and by the cache's reads: the
     * checkpoint's compressed-tensors layout (codes and then scales rewritten together) and the
     * ggml layout of its GGUF (group by group) */
    for (int gi = 0; gi < 2; gi++) {
        char dir[600], out[600];
        snprintf(dir, sizeof dir, "%s/k3mx", golden_dir());
        snprintf(out, sizeof out, "%s/paths.gguf", tmp_root);
        CHECK(!gi || convert(dir, out, "--dense f32") == 0);
        moe_options o = moe_default_options();
        o.n_threads = 2, o.flags = MOE_FLAG_MXFP4_INT8;
        moe_model *a = NULL, *b = NULL;
        CHECK(moe_model_open(&a, gi ? out : dir, &o, NULL, 0) == MOE_OK);
        o.expert_mode = MOE_EXPERTS_CACHE, o.expert_budget = 256 << 20;
        CHECK(moe_model_open(&b, gi ? out : dir, &o, NULL, 0) == MOE_OK);
        int n;
        int32_t *ids = golden_ids("k3mx", 2, &n);
        if (a && b && ids && n >= 48) {
            const size_t nv = (size_t)48 * moe_model_config(a)->vocab_size;
            float *la = logits_in_pieces(a, ids, 48, pieces), *lb = logits_in_pieces(b, ids, 48, pieces);
            CHECKF(la && lb && max_abs_diff(la, lb, nv) == 0, "k3mx MXFP4 int8 (%s): mapping vs cache %.3g", gi ? "gguf" : "checkpoint",
                   la && lb ? max_abs_diff(la, lb, nv) : -1.0);
            free(la), free(lb);
        }
        free(ids);
        moe_model_close(a), moe_model_close(b);
        if (gi) remove(out);
    }
}

static void test_cached_decode_vs_recompute(void) {
    const char *cases[] = {"seed", "kimi"};
    for (int ci = 0; ci < 2; ci++) {
        moe_model *m = open_model(cases[ci], 0, 1);
        if (!m) return;
        const int V = moe_model_config(m)->vocab_size, n = 150;
        int ng;
        int32_t *ids = golden_ids(cases[ci], 3, &ng);
        CHECK(ids && ng >= n);
        if (!ids) return;
        const int one[] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                           1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0};
        const int mixed[] = {3, 17, 1, 40, 2, 16, 5, 33, 0};
        float *a = logits_in_pieces(m, ids, n, NULL), *b = logits_in_pieces(m, ids, n, one),
              *c = logits_in_pieces(m, ids, n, mixed);
        CHECK(a && b && c);
        if (a && b && c) {
            double d1 = max_abs_diff(a, b, (size_t)n * V), d2 = max_abs_diff(a, c, (size_t)n * V);
            CHECKF(d1 < 1e-3 && d2 < 1e-3, "%s: token-by-token %.3g, mixed pieces %.3g", cases[ci], d1, d2);
        }
        free(a), free(b), free(c), free(ids);
        moe_model_close(m);
    }
}

static int convert(const char *model, const char *out, const char *args);
static moe_model *open_golden_with(const char *name, const moe_options *o);

/* Absorbed MLA decode splits the keys across threads (each with its own online softmax over
 * blocks of keys, merged at the end): a 600-token context on 1, 2 and 3 threads (several key
 * blocks per thread; the first tokens have fewer keys than threads) against the expanded form.
 * The compared runs take the reference's experts (force_routes): the golden model routes on
 * near-ties, and one flipped expert of 14,400 (NEON's rounding, one token order) moved later
 * logits by 1.1 where the attention agreed to 1e-6. */
static void test_mla_split_keys(void) {
    moe_model *ref = open_model("kimi", MOE_FLAG_MLA_EXPANDED, 1);
    if (!ref) return;
    const moe_config *rc = moe_model_config(ref);
    const int V = rc->vocab_size, n = 600;
    int32_t *ids = malloc(sizeof(int32_t) * n), *ref_routes = malloc(sizeof(int32_t) * (size_t)n * rc->n_layers * rc->n_active);
    for (int i = 0; i < n; i++) ids[i] = (int32_t)(urand() * V) % V;
    const int pieces[] = {n - 3, 1, 1, 1, 0};
    float *a = logits_routed(ref, ids, n, NULL, ref_routes, NULL);
    for (int threads = 1; threads <= 3 && a; threads++) {
        moe_model *m = open_model("kimi", MOE_FLAG_MLA_ABSORBED, threads);
        float *b = m ? logits_routed(m, ids, n, pieces, NULL, ref_routes) : NULL;
        CHECK(b != NULL);
        if (b) {
            const double d = max_abs_diff(a, b, (size_t)n * V);
            CHECKF(d < 1e-3, "%d threads: absorbed vs expanded %.3g", threads, d);
        }
        free(b);
        moe_model_close(m);
    }
    /* the expanded form in blocks of 37 and 16 keys (its online softmax across blocks, blocks
     * before, across and after each query block's positions) against one block */
    const int kpieces[] = {250, 250, 97, 1, 1, 1, 0}, kb[2] = {37, 16};
    for (int i = 0; i < 2 && a; i++) {
        moe_model *m = open_model("kimi", MOE_FLAG_MLA_EXPANDED, 1 + i * 2);
        if (m) moe__set_mla_key_block(m, kb[i]);
        float *b = m ? logits_routed(m, ids, n, kpieces, NULL, ref_routes) : NULL;
        CHECK(b != NULL);
        if (b) {
            const double d = max_abs_diff(a, b, (size_t)n * V);
            CHECKF(d < 1e-3, "expanded in blocks of %d keys vs one block: %.3g", kb[i], d);
        }
        free(b);
        moe_model_close(m);
    }
    free(a), free(ref_routes);
    moe_model_close(ref);
    /* a split GGUF: absorbed decode from attn_k_b / attn_v_b as stored (f32: the float dots;
     * q8_0: the integer kernels, query and latent context quantized to int8 as any matmul's
     * input) against the expanded form's kv_b rebuilt from the same values */
    const char *types[2] = {"--dense f32", "--dense q8_0"};
    const double bound[2] = {1e-3, 0.5}; /* q8_0 measured: max 0.14-0.15, mean 0.018 */
    for (int ti = 0; ti < 2; ti++) {
        char dir[600], out[600];
        snprintf(dir, sizeof dir, "%s/kimi", golden_dir());
        snprintf(out, sizeof out, "%s/split.gguf", tmp_root);
        CHECK(convert(dir, out, types[ti]) == 0);
        moe_model *e = open_path(out, MOE_FLAG_MLA_EXPANDED, 1), *m = open_path(out, MOE_FLAG_MLA_ABSORBED, 2);
        float *x = NULL, *y = NULL;
        if (e && m) { /* with the expanded run's routing (tiny random models flip near-tie experts on any change) */
            const moe_config *c = moe_model_config(e);
            int32_t *routes = malloc(sizeof(int32_t) * (size_t)n * c->n_layers * c->n_active);
            x = logits_routed(e, ids, n, NULL, routes, NULL), y = logits_routed(m, ids, n, pieces, NULL, routes);
            free(routes);
        }
        CHECK(x && y);
        if (x && y) {
            double d = max_abs_diff(x, y, (size_t)n * V), mean = 0;
            for (size_t i = 0; i < (size_t)n * V; i++) mean += fabs((double)x[i] - y[i]);
            mean /= (double)n * V;
            if (getenv("MOE_TEST_VERBOSE")) printf("  %s: max %.3g mean %.3g\n", types[ti], d, mean);
            CHECKF(d < bound[ti] && mean < bound[ti] / 10, "%s: absorbed (k_b, v_b) vs expanded %.3g (mean %.3g)", types[ti], d, mean);
        }
        free(x), free(y);
        moe_model_close(e), moe_model_close(m);
        remove(out);
    }
    free(ids);
}

/* A lossy latent cache (bf16 or int8): the expanded and absorbed forms read the same stored
 * latents (the expanded form widens them to f32; the absorbed form also rounds its queries and
 * softmax weights to the cache's element); against the f32 cache only that rounding differs
 * (routing pinned); a fork carries the cache. Limits: the largest and mean differences of the
 * absorbed form against the expanded one (ea_max; its mean at most twice the cache's own mean
 * effect), and of the cache against an f32 one (vf_max, vf_mean). */
static void kv_cache_check(int kv_type, double ea_max, double vf_max, double vf_mean) {
    const char *name = kv_type == MOE_KV_Q8 ? "int8" : "bf16";
    moe_options o = moe_default_options();
    o.n_threads = 2;
    moe_model *f = open_golden_with("kimi", &o);
    o.kv_type = kv_type;
    o.flags = MOE_FLAG_MLA_EXPANDED;
    moe_model *be = open_golden_with("kimi", &o);
    o.flags = MOE_FLAG_MLA_ABSORBED;
    moe_model *ba = open_golden_with("kimi", &o);
    o.flags = 0;
    moe_model *b = open_golden_with("kimi", &o);
    if (!f || !be || !ba || !b) goto out;
    const moe_config *c = moe_model_config(f);
    const int V = c->vocab_size, n = 300;
    const size_t nv = (size_t)n * V;
    int32_t *ids = malloc(sizeof(int32_t) * n), *routes = malloc(sizeof(int32_t) * (size_t)n * c->n_layers * c->n_active);
    for (int i = 0; i < n; i++) ids[i] = (int32_t)(urand() * V) % V;
    const int pieces[] = {n - 3, 1, 1, 1, 0};
    float *xf = logits_routed(f, ids, n, pieces, routes, NULL), *xe = logits_routed(be, ids, n, NULL, NULL, routes);
    float *xa = logits_routed(ba, ids, n, pieces, NULL, routes), *xb = logits_routed(b, ids, n, pieces, NULL, routes);
    if (xf && xe && xa && xb) {
        const double d1 = max_abs_diff(xe, xa, nv), d2 = max_abs_diff(xf, xb, nv);
        double mean = 0, mean1 = 0;
        for (size_t i = 0; i < nv; i++) mean += fabs((double)xf[i] - xb[i]), mean1 += fabs((double)xe[i] - xa[i]);
        mean /= (double)nv, mean1 /= (double)nv;
        if (getenv("MOE_TEST_VERBOSE"))
            printf("  %s expanded vs absorbed max %.3g mean %.3g; %s vs f32 cache max %.3g mean %.3g\n", name, d1, mean1, name, d2, mean);
        CHECKF(d1 < ea_max && mean1 < 2 * mean, "%s cache: expanded vs absorbed max %.3g mean %.3g (vs f32 cache mean %.3g)", name, d1, mean1, mean);
        CHECKF(d2 > 0 && d2 < vf_max && mean < vf_mean, "%s vs f32 cache: max %.3g mean %.3g", name, d2, mean);
    }
    /* fork after the prompt: the copy continues as the original does */
    moe_session *s1 = NULL, *s2 = NULL;
    float *l1 = malloc(sizeof(float) * V), *l2 = malloc(sizeof(float) * V);
    CHECK(moe_session_new(&s1, b, n, NULL, 0) == MOE_OK);
    moe_seq q = {.s = s1, .tokens = ids, .n = n - 1};
    CHECK(moe_step(b, &q, 1, NULL, NULL, 0) == MOE_OK);
    CHECK(moe_session_fork(&s2, s1, NULL, 0) == MOE_OK);
    moe_seq q1 = {.s = s1, .tokens = ids + n - 1, .n = 1, .logits = l1}, q2 = {.s = s2, .tokens = ids + n - 1, .n = 1, .logits = l2};
    CHECK(moe_step(b, &q1, 1, NULL, NULL, 0) == MOE_OK && moe_step(b, &q2, 1, NULL, NULL, 0) == MOE_OK);
    CHECK(!memcmp(l1, l2, sizeof(float) * V));
    moe_session_free(s1), moe_session_free(s2);
    free(l1), free(l2), free(xf), free(xe), free(xa), free(xb), free(ids), free(routes);
out:
    moe_model_close(f), moe_model_close(be), moe_model_close(ba), moe_model_close(b);
}

/* bf16: the absorbed form's bf16 queries and weights move the logits by max 0.0056-0.0089, mean
 * ~5e-4 (measured), of the order of what the bf16 cache itself changes; an unknown element type
 * is refused */
static void test_kv_bf16(void) {
    kv_cache_check(MOE_KV_BF16, 0.03, 0.1, 0.01);
    char path[600], err[256];
    snprintf(path, sizeof path, "%s/kimi", golden_dir());
    moe_options bad = moe_default_options();
    bad.kv_type = 7;
    moe_model *x = NULL;
    CHECK(moe_model_open(&x, path, &bad, err, sizeof err) == MOE_ERR_ARG && !x && strstr(err, "kv_type"));
}

/* int8: the absorbed form's int8 queries and 8-bit softmax weights: max 0.022, mean 0.0018 against the
 * expanded form; the int8 cache against an f32 one max 0.031, mean 0.0017 (measured) */
static void test_kv_q8(void) { kv_cache_check(MOE_KV_Q8, 0.1, 0.2, 0.01); }

static void test_batch_vs_alone(void) {
    moe_model *m = open_model("seed", 0, 1);
    if (!m) return;
    const int V = moe_model_config(m)->vocab_size, ns = 3;
    const int lens[3] = {37, 1, 20}, which[3] = {3, 0, 2};
    int32_t *ids[3];
    float *alone[3], *batched[3];
    moe_session *s[3];
    for (int i = 0; i < ns; i++) {
        int ng;
        ids[i] = golden_ids("seed", which[i], &ng);
        CHECK(ng >= lens[i] + 4);
        alone[i] = logits_in_pieces(m, ids[i], lens[i], NULL);
        batched[i] = malloc(sizeof(float) * (size_t)V * lens[i]);
        CHECK(moe_session_new(&s[i], m, 64, NULL, 0) == MOE_OK);
    }
    moe_seq q[3];
    for (int i = 0; i < ns; i++) q[i] = (moe_seq){.s = s[i], .tokens = ids[i], .n = lens[i], .logits = batched[i], .logits_all = 1};
    moe_step_stats stt;
    CHECK(moe_step(m, q, ns, &stt, NULL, 0) == MOE_OK);
    CHECK(stt.n_tokens == 58 && stt.expert_rows > 0 && stt.expert_loads > 0);
    for (int i = 0; i < ns; i++) {
        double d = max_abs_diff(alone[i], batched[i], (size_t)V * lens[i]);
        CHECKF(d < 1e-4, "sequence %d: %.3g", i, d);
    }
    /* lockstep decode: one token from each sequence per step, against each alone */
    for (int step = 0; step < 4; step++) {
        float *lk = malloc(sizeof(float) * (size_t)V * ns);
        for (int i = 0; i < ns; i++) q[i] = (moe_seq){.s = s[i], .tokens = ids[i] + lens[i] + step, .n = 1, .logits = lk + (size_t)i * V};
        CHECK(moe_step(m, q, ns, NULL, NULL, 0) == MOE_OK);
        for (int i = 0; i < ns; i++) {
            float *ref = logits_in_pieces(m, ids[i], lens[i] + step + 1, NULL);
            double d = max_abs_diff(ref + (size_t)(lens[i] + step) * V, lk + (size_t)i * V, (size_t)V);
            CHECKF(d < 1e-3, "lockstep step %d sequence %d: %.3g", step, i, d);
            free(ref);
        }
        free(lk);
    }
    for (int i = 0; i < ns; i++) {
        free(ids[i]), free(alone[i]), free(batched[i]);
        moe_session_free(s[i]);
    }
    moe_model_close(m);
}

static void test_small_batch_chunks(void) {
    char path[600];
    snprintf(path, sizeof path, "%s/k3mx", golden_dir());
    moe_options o = moe_default_options();
    o.n_batch = 7;
    moe_model *m = NULL, *ref = open_model("k3mx", 0, 1);
    CHECK(moe_model_open(&m, path, &o, NULL, 0) == MOE_OK);
    if (!m || !ref) { moe_model_close(m); moe_model_close(ref); return; }
    const int V = moe_model_config(m)->vocab_size, n = 50;
    int ng;
    int32_t *ids = golden_ids("k3mx", 3, &ng);
    float *a = logits_in_pieces(ref, ids, n, NULL), *b = logits_in_pieces(m, ids, n, NULL);
    double d = max_abs_diff(a, b, (size_t)n * V);
    CHECKF(d < 1e-3, "n_batch 7 vs the default: %.3g", d);
    /* the default: 2048 rows with mapped experts, 512 in the cache mode */
    CHECK(moe_model_get_info(m).n_batch == 7 && moe_model_get_info(ref).n_batch == 2048);
    moe_options oc = moe_default_options();
    oc.expert_mode = MOE_EXPERTS_CACHE, oc.expert_budget = 64 << 20;
    moe_model *mc = NULL;
    CHECK(moe_model_open(&mc, path, &oc, NULL, 0) == MOE_OK && moe_model_get_info(mc).n_batch == 512);
    moe_model_close(mc);
    free(a), free(b), free(ids);
    moe_model_close(m);
    moe_model_close(ref);
}

static void test_snapshot_fork(void) {
    moe_model *m = open_model("seed", 0, 1);
    if (!m) return;
    const int V = moe_model_config(m)->vocab_size;
    int ng;
    int32_t *ids = golden_ids("seed", 3, &ng);
    moe_session *a, *b, *snap;
    float *la = malloc(sizeof(float) * V * 20), *lb = malloc(sizeof(float) * V * 20);
    CHECK(moe_session_new(&a, m, 100, NULL, 0) == MOE_OK);
    moe_seq q = {.s = a, .tokens = ids, .n = 30};
    CHECK(moe_step(m, &q, 1, NULL, NULL, 0) == MOE_OK);
    CHECK(moe_session_fork(&snap, a, NULL, 0) == MOE_OK && moe_session_pos(snap) == 30);
    CHECK(moe_session_fork(&b, a, NULL, 0) == MOE_OK);
    /* a and its fork b continue with the same tokens: same logits */
    q = (moe_seq){.s = a, .tokens = ids + 30, .n = 20, .logits = la, .logits_all = 1};
    CHECK(moe_step(m, &q, 1, NULL, NULL, 0) == MOE_OK);
    q = (moe_seq){.s = b, .tokens = ids + 30, .n = 20, .logits = lb, .logits_all = 1};
    CHECK(moe_step(m, &q, 1, NULL, NULL, 0) == MOE_OK);
    CHECK(max_abs_diff(la, lb, (size_t)V * 20) == 0);
    /* b diverges, then is restored from the snapshot and replays: same as a */
    q = (moe_seq){.s = b, .tokens = ids + 40, .n = 5};
    CHECK(moe_step(m, &q, 1, NULL, NULL, 0) == MOE_OK && moe_session_pos(b) == 55);
    CHECK(moe_session_restore(b, snap, NULL, 0) == MOE_OK && moe_session_pos(b) == 30);
    q = (moe_seq){.s = b, .tokens = ids + 30, .n = 20, .logits = lb, .logits_all = 1};
    CHECK(moe_step(m, &q, 1, NULL, NULL, 0) == MOE_OK);
    CHECK(max_abs_diff(la, lb, (size_t)V * 20) == 0);
    /* reset = a fresh session */
    moe_session_reset(b);
    CHECK(moe_session_pos(b) == 0);
    float *full = logits_in_pieces(m, ids, 20, NULL);
    q = (moe_seq){.s = b, .tokens = ids, .n = 20, .logits = lb, .logits_all = 1};
    CHECK(moe_step(m, &q, 1, NULL, NULL, 0) == MOE_OK);
    CHECK(max_abs_diff(full, lb, (size_t)V * 20) == 0);
    /* restoring into a too-small context is refused */
    moe_session *tiny;
    CHECK(moe_session_new(&tiny, m, 10, NULL, 0) == MOE_OK);
    CHECK(moe_session_restore(tiny, a, NULL, 0) == MOE_ERR_CTX_FULL);
    moe_session_free(tiny);
    free(full), free(la), free(lb), free(ids);
    moe_session_free(a), moe_session_free(b), moe_session_free(snap);
    moe_model_close(m);
}

/* ---- API misuse ------------------------------------------------------------------------------ */

static void test_api_args(void) {
    char err[256];
    moe_model *m = NULL;
    CHECK(moe_model_open(NULL, "x", NULL, err, sizeof err) == MOE_ERR_ARG);
    CHECK(moe_model_open(&m, NULL, NULL, err, sizeof err) == MOE_ERR_ARG && m == NULL);
    CHECK(moe_model_open(&m, "/nonexistent/dir", NULL, err, sizeof err) != MOE_OK && m == NULL);
    moe_model_close(NULL);
    moe_session_free(NULL);
    moe_session_reset(NULL);
    CHECK(strcmp(moe_status_str(MOE_ERR_CTX_FULL), "context full") == 0);
    m = open_model("kimi", 0, 1);
    moe_model *m2 = open_model("kimi", 0, 1);
    if (!m || !m2) return;
    const int V = moe_model_config(m)->vocab_size;
    moe_session *s, *s2;
    CHECK(moe_session_new(NULL, m, 8, err, sizeof err) == MOE_ERR_ARG);
    CHECK(moe_session_new(&s, m, 0, err, sizeof err) == MOE_ERR_ARG);
    CHECK(moe_session_new(&s, m, 8, err, sizeof err) == MOE_OK);
    CHECK(moe_session_new(&s2, m2, 8, err, sizeof err) == MOE_OK);
    int32_t bad[2] = {5, V}, neg[1] = {-1}, ok[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    moe_seq q = {.s = s, .tokens = bad, .n = 2};
    CHECK(moe_step(m, &q, 1, NULL, err, sizeof err) == MOE_ERR_ARG && strstr(err, "outside"));
    q.tokens = neg, q.n = 1;
    CHECK(moe_step(m, &q, 1, NULL, err, sizeof err) == MOE_ERR_ARG);
    CHECK(moe_session_pos(s) == 0);
    q.tokens = ok, q.n = 9;
    CHECK(moe_step(m, &q, 1, NULL, err, sizeof err) == MOE_ERR_CTX_FULL);
    q.n = 8;
    CHECK(moe_step(m, &q, 1, NULL, err, sizeof err) == MOE_OK && moe_session_pos(s) == 8);
    q.n = 1;
    CHECK(moe_step(m, &q, 1, NULL, err, sizeof err) == MOE_ERR_CTX_FULL);
    moe_seq two[2] = {{.s = s2, .tokens = ok, .n = 1}, {.s = s2, .tokens = ok, .n = 1}};
    CHECK(moe_step(m, two, 1, NULL, err, sizeof err) == MOE_ERR_ARG); /* session of another model */
    CHECK(moe_step(m2, two, 2, NULL, err, sizeof err) == MOE_ERR_ARG); /* same session twice */
    CHECK(moe_step(NULL, two, 1, NULL, err, sizeof err) == MOE_ERR_ARG);
    CHECK(moe_step(m, NULL, 1, NULL, err, sizeof err) == MOE_ERR_ARG);
    CHECK(moe_step(m, NULL, 0, NULL, err, sizeof err) == MOE_OK);
    q = (moe_seq){.s = s2, .tokens = NULL, .n = 3};
    CHECK(moe_step(m2, &q, 1, NULL, err, sizeof err) == MOE_ERR_ARG);
    CHECK(moe_session_restore(s, s2, err, sizeof err) == MOE_ERR_ARG);
    moe_session *f;
    CHECK(moe_session_fork(&f, NULL, err, sizeof err) == MOE_ERR_ARG);
    moe_session_free(s);
    moe_session_free(s2);
    moe_model_close(m);
    moe_model_close(m2);
}

static void test_model_info(void) {
    moe_model *m = open_model("k3mx", 0, 1), *s = open_model("seed", 0, 1);
    if (!m || !s) { moe_model_close(m); moe_model_close(s); return; }
    const moe_config *c = moe_model_config(m);
    moe_model_info a = moe_model_get_info(m), b = moe_model_get_info(s);
    CHECK(c->n_layers == 8 && c->n_experts == 64 && c->n_active == 6 && c->latent_dim == 64);
    CHECK(c->layer_kind[3] == MOE_LAYER_MLA && c->layer_kind[0] == MOE_LAYER_KDA && !c->layer_moe[0] && c->layer_moe[1]);
    CHECK(c->attn_res_block == 3 && c->kda_gate_bounded && c->hidden_act == MOE_ACT_SITU);
    /* same model, experts BF16 in seed and MXFP4 in k3mx: same parameter count, fewer bytes */
    CHECK(a.n_params == b.n_params + 6 * 125 && b.n_params > 0); /* k3mx pads A_log to 128 */
    CHECK(a.expert_bytes < b.expert_bytes && a.n_files == 11 && b.n_files == 1);
    /* 7 MoE layers x 64 experts x 3 x 32 x 64 values */
    CHECK(b.expert_bytes == 7ull * 64 * 3 * 32 * 64 * 2);
    CHECK(a.expert_bytes == 7ull * 64 * 3 * (32 * 32 + 32 * 2));
    CHECK(b.n_params - b.n_params_active == 7ull * (64 - 6) * 3 * 32 * 64);
    moe_model_close(m);
    moe_model_close(s);
}

/* moe_sample by the simplest means, as an oracle: every candidate sorted by qsort (logit
 * descending, id ascending) where top-k or top-p cuts them, left in id order where nothing does;
 * probabilities over the top-k's own sum where top-k cuts, else over every token's in id order;
 * then min-p, top-p and the draw */
typedef struct {
    float l, p; /* logit, probability */
    int32_t id;
} ref_cand;
static int ref_cand_desc(const void *a, const void *b) {
    const ref_cand *x = a, *y = b;
    if (x->l != y->l) return x->l > y->l ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}
static uint64_t ref_rng_next(uint64_t *s) {
    if (!*s) *s = 0x9E3779B97F4A7C15ull;
    *s ^= *s >> 12, *s ^= *s << 25, *s ^= *s >> 27;
    return *s * 0x2545F4914F6CDD1Dull;
}
/* cs[0..n).p from their logits; returns the largest */
static float ref_probs(ref_cand *cs, int n, float temperature) {
    double mx = -INFINITY, sum = 0;
    for (int i = 0; i < n; i++) mx = cs[i].l > mx ? cs[i].l : mx;
    for (int i = 0; i < n; i++) sum += cs[i].p = (float)exp((cs[i].l - mx) / temperature);
    float top = 0;
    for (int i = 0; i < n; i++) cs[i].p = (float)(cs[i].p / sum), top = cs[i].p > top ? cs[i].p : top;
    return top;
}
static int32_t ref_sample(const float *logits, int n_vocab, const moe_sampler *sp, uint64_t *rng) {
    ref_cand *cs = malloc(sizeof *cs * (size_t)n_vocab);
    for (int i = 0; i < n_vocab; i++) cs[i] = (ref_cand){logits[i], 0, i};
    const int cut_k = sp->top_k > 0 && sp->top_k < n_vocab, ranked = cut_k || (sp->top_p > 0 && sp->top_p < 1);
    int n = n_vocab;
    float top;
    if (cut_k) {
        qsort(cs, (size_t)n_vocab, sizeof *cs, ref_cand_desc);
        top = ref_probs(cs, n = sp->top_k, sp->temperature);
    } else {
        top = ref_probs(cs, n, sp->temperature);
        if (ranked) qsort(cs, (size_t)n_vocab, sizeof *cs, ref_cand_desc);
    }
    if (sp->min_p > 0) { /* the candidates at or above min_p times the best one's probability */
        int k = 0;
        for (int i = 0; i < n; i++)
            if (cs[i].p >= (sp->min_p < 1 ? sp->min_p * top : top)) cs[k++] = cs[i];
        n = k;
    }
    if (sp->top_p > 0 && sp->top_p < 1) {
        double acc = 0;
        int k = 0;
        while (k < n && acc < sp->top_p) acc += cs[k++].p;
        n = k ? k : 1;
    }
    double sum = 0;
    for (int i = 0; i < n; i++) sum += cs[i].p;
    double u = (double)(ref_rng_next(rng) >> 11) / 9007199254740992.0 * sum, acc = 0;
    int32_t pick = cs[n - 1].id;
    for (int i = 0; i < n; i++) {
        acc += cs[i].p;
        if (u < acc) { pick = cs[i].id; break; }
    }
    free(cs);
    return pick;
}

static void test_sampling(void) {
    float logits[6] = {0.1f, 2.0f, -1.0f, 1.9f, 0.0f, 1.0f};
    moe_sampler greedy = {.top_p = 1}, topk1 = {.temperature = 1.0f, .top_k = 1, .top_p = 1}, hot = {.temperature = 1.0f, .top_p = 1};
    uint64_t r = 42;
    CHECK(moe_sample(logits, 6, &greedy, &r) == 1);
    CHECK(moe_sample(logits, 6, NULL, NULL) == 1);
    CHECK(moe_sample(logits, 6, &topk1, &r) == 1);
    int counts[6] = {0};
    uint64_t r1 = 7, r2 = 7;
    for (int i = 0; i < 4000; i++) {
        int a = moe_sample(logits, 6, &hot, &r1), b = moe_sample(logits, 6, &hot, &r2);
        CHECK(a == b); /* deterministic for a seed */
        counts[a]++;
    }
    /* p(1)/p(3) = e^0.1 = 1.105; both far more frequent than token 2 */
    CHECK(counts[1] > counts[3] * 0.9 && counts[3] > counts[2] * 5 && counts[2] > 0);
    moe_sampler nucleus = {.temperature = 1.0f, .top_p = 0.3f};
    for (int i = 0; i < 100; i++) CHECK(moe_sample(logits, 6, &nucleus, &r) == 1);
    /* penalties: token 1 seen twice, token 3 once */
    const int32_t recent[4] = {1, 1, 3, 99999};
    moe_sampler rep = {0, 0, 1, 0, 1.5f, 0, 0, recent, 4};
    CHECK(moe_sample(logits, 6, &rep, &r) == 5 - 4); /* 2.0/1.5 = 1.33, 1.9/1.5 = 1.27: token 1 still leads */
    moe_sampler pres = {0, 0, 1, 0, 0, 1.05f, 0, recent, 4};
    CHECK(moe_sample(logits, 6, &pres, &r) == 5); /* 0.95, 0.85 against token 5's 1.0 */
    moe_sampler freq = {0, 0, 1, 0, 0, 0, 0.6f, recent, 4};
    CHECK(moe_sample(logits, 6, &freq, &r) == 3); /* 2.0 - 1.2 = 0.8 < 1.9 - 0.6 = 1.3 */
    CHECK(logits[1] == 2.0f); /* the caller's logits are not modified */
    moe_sampler minp = {.temperature = 1.0f, .top_p = 1.0f, .min_p = 0.5f};
    for (int i = 0; i < 200; i++) {
        int t = moe_sample(logits, 6, &minp, &r);
        CHECK(t == 1 || t == 3); /* e^-1 = 0.37 < 0.5 removes token 5 */
    }
    /* large vocabularies, with ties (logits on a coarse grid), -0 beside +0 and -inf: the same
     * picks, and the generator left in the same state, as sorting every candidate with qsort (or
     * none, where no top-k or top-p applies) */
    const int nv[3] = {1000, 70000, 70000};
    float *lg = malloc(sizeof(float) * 70000);
    for (int vi = 0; vi < 3; vi++) {
        const int V = nv[vi];
        /* the third: spread out, so that a few hundred tokens hold most of the probability */
        for (int i = 0; i < V; i++) lg[i] = vi < 2 ? roundf(nrand() * 16.0f) / 8.0f : nrand() * 4.0f;
        lg[V / 7] = -0.0f, lg[V / 5] = 0.0f, lg[V / 3] = -INFINITY, lg[V / 2] = 6.0f, lg[V - 1] = 6.0f;
        const int ks[6] = {0, 1, 40, 256, 257, 5000};
        const float ps[3] = {1.0f, 0.95f, 0.5f}, ms[2] = {0.0f, 0.05f}, ts[2] = {0.8f, 1.5f};
        int same = 1, cases = 0;
        for (int c = 0; c < 6 * 3 * 2 * 2; c += vi ? 5 : 1) { /* the large ones: 15 of the 72 samplers (qsort takes a while) */
            moe_sampler sp = {.temperature = ts[c % 2], .top_k = ks[c / 12], .top_p = ps[c / 4 % 3], .min_p = ms[c / 2 % 2]};
            uint64_t ra = 1234567 + (uint64_t)c, rb = ra;
            for (int d = 0; d < (vi ? 2 : 20); d++, cases++) same &= moe_sample(lg, V, &sp, &ra) == ref_sample(lg, V, &sp, &rb) && ra == rb;
        }
        CHECKF(same, "vocabulary %d: %d draws", V, cases);
    }
    free(lg);
}

/* ---- hostile files ---------------------------------------------------------------------------- */

/* a model dir in tmp: config.json (optionally edited) and model.safetensors (header edited) */
typedef struct {
    char *cfg;
    size_t cfg_len;
    char *st;
    size_t st_len;
} model_files;

static int load_seed_files(model_files *f) {
    char p[600];
    snprintf(p, sizeof p, "%s/seed/config.json", golden_dir());
    f->cfg = read_all(p, &f->cfg_len);
    snprintf(p, sizeof p, "%s/seed/model.safetensors", golden_dir());
    f->st = read_all(p, &f->st_len);
    return f->cfg && f->st;
}

static char *replace_once(const char *s, const char *from, const char *to) {
    const char *at = strstr(s, from);
    if (!at) return NULL;
    size_t a = (size_t)(at - s), fl = strlen(from), tl = strlen(to), n = strlen(s);
    char *r = malloc(n - fl + tl + 1);
    memcpy(r, s, a);
    memcpy(r + a, to, tl);
    memcpy(r + a + tl, at + fl, n - a - fl + 1);
    return r;
}

/* opens and closes a model (a directory or a file): the status, and the message in err */
static moe_status open_dir(const char *dir, char *err, size_t errlen) {
    moe_model *m = NULL;
    moe_status st = moe_model_open(&m, dir, NULL, err, errlen);
    moe_model_close(m);
    return st;
}

/* writes tmp/bad/{config.json, model.safetensors}; header_edit replaces text in the JSON
 * header (the data stays where it was), cfg_edit in config.json; truncate_at < 0: full length */
static moe_status try_open(const model_files *f, const char *cfg_from, const char *cfg_to,
                           const char *hdr_from, const char *hdr_to, long truncate_at, char *err, size_t errlen) {
    char dir[600], p[700];
    tmp_path(dir, sizeof dir, "bad");
    mkdir(dir, 0700);
    char *cfg = cfg_from ? replace_once(f->cfg, cfg_from, cfg_to) : strdup(f->cfg);
    if (!cfg) { fprintf(stderr, "  (test bug: '%s' not in config)\n", cfg_from); return MOE_OK; }
    snprintf(p, sizeof p, "%s/config.json", dir);
    write_all(p, cfg, strlen(cfg));
    free(cfg);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    if (!hdr_from) { /* raw bytes, possibly truncated */
        size_t n = truncate_at >= 0 && (size_t)truncate_at < f->st_len ? (size_t)truncate_at : f->st_len;
        write_all(p, f->st, n);
        return open_dir(dir, err, errlen);
    }
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | (unsigned char)f->st[i];
    char *hdr = malloc(hlen + 1);
    memcpy(hdr, f->st + 8, hlen);
    hdr[hlen] = 0;
    char *nh = replace_once(hdr, hdr_from, hdr_to);
    free(hdr);
    if (!nh) { fprintf(stderr, "  (test bug: '%s' not in header)\n", hdr_from); return MOE_OK; }
    /* keep the data offset: pad the edited header back to the old length with spaces */
    size_t nl = strlen(nh);
    char *out = malloc(f->st_len + nl + 16);
    size_t newh = nl <= hlen ? hlen : nl;
    for (int i = 0; i < 8; i++) out[i] = (char)(newh >> (8 * i));
    memcpy(out + 8, nh, nl);
    memset(out + 8 + nl, ' ', newh - nl);
    memcpy(out + 8 + newh, f->st + 8 + hlen, f->st_len - 8 - hlen);
    write_all(p, out, 8 + newh + (f->st_len - 8 - hlen));
    free(out);
    free(nh);
    return open_dir(dir, err, errlen);
}

static void expect_format(const model_files *f, const char *cf, const char *ct, const char *hf, const char *ht, const char *what) {
    char err[512] = "";
    moe_status st = try_open(f, cf, ct, hf, ht, -1, err, sizeof err);
    CHECKF(st == MOE_ERR_FORMAT && err[0], "%s: status %d (%s)", what, st, err);
    if (getenv("MOE_TEST_VERBOSE")) fprintf(stderr, "  %s -> %s\n", what, err);
}

static void test_bad_files(void) {
    model_files f;
    if (!load_seed_files(&f)) { CHECK(0); return; }
    char err[512];
    /* the unedited copy opens */
    CHECKF(try_open(&f, NULL, NULL, NULL, NULL, -1, err, sizeof err) == MOE_OK, "%s", err);
    /* truncated at many offsets, header and data alike: always a clean format error */
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | (unsigned char)f.st[i];
    long cuts[40];
    int nc = 0;
    const long fixed[] = {0, 1, 7, 8, 9, 100, (long)hlen / 2, (long)hlen + 7, (long)hlen + 8, (long)hlen + 9};
    for (size_t i = 0; i < sizeof fixed / sizeof *fixed; i++) cuts[nc++] = fixed[i];
    for (int i = 1; i <= 20; i++) cuts[nc++] = (long)(hlen + 8 + (f.st_len - hlen - 8) * i / 21);
    cuts[nc++] = (long)f.st_len - 1;
    for (int i = 0; i < nc; i++) {
        moe_status st = try_open(&f, NULL, NULL, NULL, NULL, cuts[i], err, sizeof err);
        CHECKF(st == MOE_ERR_FORMAT, "truncated at %ld: status %d (%s)", cuts[i], st, err);
    }
    /* header length past the end, and absurd */
    {
        char *bad = malloc(f.st_len);
        memcpy(bad, f.st, f.st_len);
        for (int k = 0; k < 2; k++) {
            uint64_t v = k ? ~0ull : (uint64_t)f.st_len;
            for (int i = 0; i < 8; i++) bad[i] = (char)(v >> (8 * i));
            model_files g = f;
            g.st = bad;
            moe_status st = try_open(&g, NULL, NULL, NULL, NULL, -1, err, sizeof err);
            CHECKF(st == MOE_ERR_FORMAT, "header length %llu: %d", (unsigned long long)v, st);
        }
        free(bad);
    }
    const char *qp = "\"model.layers.0.self_attn.q_proj.weight\":{\"dtype\":\"BF16\",\"shape\":[192,192],\"data_offsets\":[";
    /* header text edits (the seed header is compact JSON) */
    expect_format(&f, NULL, NULL, "{\"lm_head.weight\"", "[{\"lm_head.weight\"", "header not JSON");
    expect_format(&f, NULL, NULL, "{\"lm_head.weight\"", "[{\"lm_head.weight\"}]", "header not an object");
    expect_format(&f, NULL, NULL, qp, "\"model.layers.0.self_attn.q_proj.weight\":{\"dtype\":\"BF16\",\"shape\":[192,192],\"data_offsets\":[9", "offsets outside the file");
    expect_format(&f, NULL, NULL, "\"shape\":[192,192],\"data_offsets\":[1706380,", "\"shape\":[192,192],\"data_offsets\":[1780108,", "offsets reversed");
    expect_format(&f, NULL, NULL, "\"shape\":[192,192],\"data_offsets\":[1706380,1780108]", "\"shape\":[192,192],\"data_offsets\":[1629580,1703308]", "tensors overlap");
    expect_format(&f, NULL, NULL, "\"model.layers.0.self_attn.dt_bias\":{\"dtype\":\"F32\"", "\"model.layers.0.self_attn.dt_bias\":{\"dtype\":\"BF16\"", "dtype/byte length mismatch");
    expect_format(&f, NULL, NULL, "\"model.layers.0.self_attn.dt_bias\":{\"dtype\":\"F32\"", "\"model.layers.0.self_attn.dt_bias\":{\"dtype\":\"Q9\"", "unknown dtype");
    expect_format(&f, NULL, NULL, "\"model.layers.0.self_attn.dt_bias\":{\"dtype\":\"F32\"", "\"model.layers.0.self_attn.dt_bias\":{\"dtype\":\"I32\"", "wrong dtype class");
    expect_format(&f, NULL, NULL, "\"shape\":[192,192],\"data_offsets\":[1706380", "\"shape\":[96,384],\"data_offsets\":[1706380", "shape mismatch with config");
    expect_format(&f, NULL, NULL, "\"shape\":[192,192],\"data_offsets\":[1706380", "\"shape\":[4294967296,4294967296,4294967296],\"data_offsets\":[1706380", "overflowing dims");
    expect_format(&f, NULL, NULL, "\"shape\":[192,192],\"data_offsets\":[1706380", "\"shape\":[192,-192],\"data_offsets\":[1706380", "negative dim");
    expect_format(&f, NULL, NULL, "\"model.layers.0.self_attn.q_proj.weight\"", "\"model.layers.0.self_attn.q_prox.weight\"", "missing tensor");
    expect_format(&f, NULL, NULL, "\"model.layers.0.self_attn.q_proj.weight\"", "\"model.layers.0.self_attn.k_proj.weight\"", "duplicate tensor name");
    expect_format(&f, NULL, NULL, "\"model.layers.0.self_attn.A_log\":{\"dtype\":\"F32\",\"shape\":[3]", "\"model.layers.0.self_attn.A_log\":{\"dtype\":\"F32\",\"shape\":[2]", "A_log too short");
    /* inconsistent or absurd config values */
    expect_format(&f, "\"vocab_size\": 1280", "\"vocab_size\": -1", NULL, NULL, "negative vocab");
    expect_format(&f, "\"vocab_size\": 1280", "\"vocab_size\": 1e300", NULL, NULL, "absurd vocab");
    expect_format(&f, "\"vocab_size\": 1280", "\"vocab_size\": 1000", NULL, NULL, "vocab does not match tensors");
    expect_format(&f, "\"hidden_size\": 192", "\"hidden_size\": 0", NULL, NULL, "zero hidden size");
    expect_format(&f, "\"hidden_size\": 192", "\"hidden_size\": \"192\"", NULL, NULL, "hidden size a string");
    expect_format(&f, "\"num_experts_per_token\": 6", "\"num_experts_per_token\": 65", NULL, NULL, "top-k above the expert count");
    expect_format(&f, "\"num_experts_per_token\": 6", "\"num_experts_per_token\": 0", NULL, NULL, "top-k zero");
    expect_format(&f, "\"num_expert_group\": 4", "\"num_expert_group\": 5", NULL, NULL, "groups do not divide experts");
    expect_format(&f, "\"topk_group\": 2", "\"topk_group\": 9", NULL, NULL, "topk_group above groups");
    expect_format(&f, "\"head_dim\": 64", "\"head_dim\": 32", NULL, NULL, "KDA head size does not match tensors");
    expect_format(&f, "\"num_hidden_layers\": 8", "\"num_hidden_layers\": 0", NULL, NULL, "zero layers");
    expect_format(&f, "\"num_hidden_layers\": 8", "\"num_hidden_layers\": 9", NULL, NULL, "more layers than tensors");
    expect_format(&f, "\"rms_norm_eps\": 1e-05", "\"rms_norm_eps\": -1", NULL, NULL, "negative eps");
    expect_format(&f, "\"kda_layers\": [\n      1,", "\"kda_layers\": [\n      99,", NULL, NULL, "kda layer out of range");
    expect_format(&f, "\"gate_lower_bound\": -5.0", "\"gate_lower_bound\": 3.0", NULL, NULL, "positive gate bound");
    expect_format(&f, "{", "[", NULL, NULL, "config not JSON object");
    {
        moe_status st = try_open(&f, "\"hidden_act\": \"situ\"", "\"hidden_act\": \"gelu\"", NULL, NULL, -1, err, sizeof err);
        CHECKF(st == MOE_ERR_UNSUPPORTED, "unknown activation: %d", st);
    }
    free(f.cfg);
    free(f.st);
}

/* a sharded checkpoint whose index names a missing shard, or a tensor the shard lacks */
static void test_bad_index(void) {
    char dir[600], p[800], q[800], err[512];
    tmp_path(dir, sizeof dir, "badidx");
    mkdir(dir, 0700);
    const char *files[] = {"config.json", "model.safetensors.index.json", "model-00001-of-000011.safetensors",
                           "model-00002-of-000011.safetensors", "model-00003-of-000011.safetensors",
                           "model-00004-of-000011.safetensors", "model-00005-of-000011.safetensors",
                           "model-00006-of-000011.safetensors", "model-00007-of-000011.safetensors",
                           "model-00008-of-000011.safetensors", "model-00009-of-000011.safetensors",
                           "model-00010-of-000011.safetensors", "model-00011-of-000011.safetensors"};
    for (size_t i = 0; i < sizeof files / sizeof *files; i++) {
        snprintf(p, sizeof p, "%s/k3mx/%s", golden_dir(), files[i]);
        snprintf(q, sizeof q, "%s/%s", dir, files[i]);
        CHECK(copy_file(p, q));
    }
    moe_model *m = NULL;
    CHECKF(moe_model_open(&m, dir, NULL, err, sizeof err) == MOE_OK, "%s", err);
    moe_model_close(m);
    snprintf(q, sizeof q, "%s/model-00005-of-000011.safetensors", dir);
    remove(q);
    moe_status st = moe_model_open(&m, dir, NULL, err, sizeof err);
    CHECKF(st == MOE_ERR_IO && strstr(err, "model-00005"), "missing shard: %d %s", st, err);
    /* index says a tensor is in another shard than it is */
    snprintf(p, sizeof p, "%s/k3mx/model-00005-of-000011.safetensors", golden_dir());
    CHECK(copy_file(p, q));
    size_t len;
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    char *idx = read_all(p, &len);
    char *ed = replace_once(idx, "\"language_model.model.layers.0.input_layernorm.weight\": \"model-00001-of-000011.safetensors\"",
                            "\"language_model.model.layers.0.input_layernorm.weight\": \"model-00002-of-000011.safetensors\"");
    CHECK(ed != NULL);
    if (ed) {
        write_all(p, ed, strlen(ed));
        st = moe_model_open(&m, dir, NULL, err, sizeof err);
        CHECKF(st == MOE_ERR_FORMAT, "index mismatch: %d %s", st, err);
        free(ed);
    }
    ed = replace_once(idx, "\"model-00001-of-000011.safetensors\"", "\"../etc/passwd\"");
    if (ed) {
        write_all(p, ed, strlen(ed));
        st = moe_model_open(&m, dir, NULL, err, sizeof err);
        CHECKF(st == MOE_ERR_FORMAT, "shard path escape: %d %s", st, err);
        free(ed);
    }
    free(idx);
}

/* ---- moe-logits: the stable command-line interface ------------------------------------------ */

static char exe_dir[512] = ".";

/* runs a shell command (prefixed with $MOE_TEST_RUNNER, e.g. qemu for a cross-built suite) */
static int run_cmd(const char *cmd0, char *out, size_t outlen) {
    char cmd[4200];
    const char *runner = getenv("MOE_TEST_RUNNER");
    snprintf(cmd, sizeof cmd, "%s%s%s", runner ? runner : "", runner ? " " : "", cmd0);
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    size_t n = 0, r;
    while (n + 1 < outlen && (r = fread(out + n, 1, outlen - 1 - n, p)) > 0) n += r;
    out[n] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void test_moe_logits_cli(void) {
    const char *cases[] = {"kimi", "seed", "k3mx"};
    char cmd[2400], out[4096], idsf[600], logf[600];
    tmp_path(idsf, sizeof idsf, "ids.txt");
    tmp_path(logf, sizeof logf, "logits.bin");
    for (int ci = 0; ci < 3; ci++) {
        golden g;
        if (!golden_load(&g, cases[ci])) return;
        const moe__json *p = moe__json_get(g.cases, "prompts")->child->next->next; /* p2, 64 tokens */
        int32_t *ids, *greedy;
        int n = ids_of(moe__json_get(p, "ids"), &ids), ng = ids_of(moe__json_get(p, "greedy"), &greedy);
        FILE *f = fopen(idsf, "w");
        for (int i = 0; i < n; i++) fprintf(f, i % 10 == 9 ? "%d\n" : "%d ", (int)ids[i]);
        fclose(f);
        snprintf(cmd, sizeof cmd, "%s/moe-logits -m %s/%s --tokens %s --out %s --all --greedy %d", exe_dir,
                 golden_dir(), cases[ci], idsf, logf, ng);
        int rc = run_cmd(cmd, out, sizeof out);
        CHECKF(rc == 0, "%s: exit %d", cmd, rc);
        size_t len = 0;
        char *bin = read_all(logf, &len);
        const moe__st_tensor *want = moe__st_find(&g.ref, "p2.logits");
        CHECK(bin && want && len == want->nbytes);
        if (bin && want && len == want->nbytes) {
            double d = max_abs_diff((const float *)bin, want->data, len / 4);
            CHECKF(d <= g.tol, "%s: max |dlogit| %.3g", cases[ci], d);
        }
        free(bin);
        /* the greedy ids are the last line of stdout */
        char want_line[1024] = "";
        for (int i = 0; i < ng; i++) snprintf(want_line + strlen(want_line), sizeof want_line - strlen(want_line), i ? " %d" : "%d", (int)greedy[i]);
        char *last = out + strlen(out);
        while (last > out && last[-1] == '\n') *--last = 0;
        while (last > out && last[-1] != '\n') last--;
        CHECKF(!strcmp(last, want_line), "%s: greedy '%s' want '%s'", cases[ci], last, want_line);
        /* without --all: the last row only */
        snprintf(cmd, sizeof cmd, "%s/moe-logits -m %s/%s --tokens %s --out %s", exe_dir, golden_dir(), cases[ci], idsf, logf);
        CHECK(run_cmd(cmd, out, sizeof out) == 0);
        bin = read_all(logf, &len);
        const int V = (int)want->shape[1];
        CHECK(bin && len == (size_t)V * 4);
        if (bin && len == (size_t)V * 4)
            CHECK(max_abs_diff((const float *)bin, (const float *)want->data + (size_t)(n - 1) * V, (size_t)V) <= g.tol);
        free(bin), free(ids), free(greedy);
        golden_free(&g);
    }
    /* exit codes: 2 usage, 1 errors */
    snprintf(cmd, sizeof cmd, "%s/moe-logits 2>/dev/null", exe_dir);
    CHECK(run_cmd(cmd, out, sizeof out) == 2);
    snprintf(cmd, sizeof cmd, "%s/moe-logits -m x --tokens y --bogus 2>/dev/null", exe_dir);
    CHECK(run_cmd(cmd, out, sizeof out) == 2);
    snprintf(cmd, sizeof cmd, "%s/moe-logits -m /nonexistent --tokens %s 2>/dev/null", exe_dir, idsf);
    CHECK(run_cmd(cmd, out, sizeof out) == 1);
    /* --kernels (the ids file holds k3mx's prompt): a level this CPU has runs; another name is an
     * error naming the ones it has */
    snprintf(cmd, sizeof cmd, "%s/moe-logits -m %s/k3mx --tokens %s --kernels scalar 2>&1", exe_dir, golden_dir(), idsf);
    CHECK(run_cmd(cmd, out, sizeof out) == 0);
    snprintf(cmd, sizeof cmd, "%s/moe-logits -m %s/k3mx --tokens %s --kernels avx9000 2>&1", exe_dir, golden_dir(), idsf);
    CHECK(run_cmd(cmd, out, sizeof out) == 1 && strstr(out, "avx9000") && strstr(out, "this CPU runs scalar"));
    const char *bad_ids[] = {"1 2 x", "1 -2", "99999999", "", "1 2 3.5", "1 +2", "0x10"};
    for (int i = 0; i < 7; i++) {
        FILE *f = fopen(idsf, "w");
        fputs(bad_ids[i], f);
        fclose(f);
        remove(logf);
        snprintf(cmd, sizeof cmd, "%s/moe-logits -m %s/kimi --tokens %s --out %s 2>/dev/null", exe_dir, golden_dir(), idsf, logf);
        CHECKF(run_cmd(cmd, out, sizeof out) == 1, "ids '%s'", bad_ids[i]);
        struct stat sb;
        CHECK(stat(logf, &sb) != 0); /* nothing written on failure */
    }
}

/* ---- tokenizer ------------------------------------------------------------------------------ */

static const char *tok_dir(void) {
    const char *d = getenv("MOE_TOKENIZER_DATA");
    return d ? d : "test/tokenizer";
}

/* checks the pre-tokenizer's pieces of text against a NULL-terminated list */
static void check_pieces(int pretok, const char *text, const char *const *want) {
    size_t ends[128], len = strlen(text);
    long n = moe__pretokenize(pretok, text, len, ends, 128);
    int nw = 0;
    while (want[nw]) nw++;
    int ok = n == nw;
    for (long i = 0, s = 0; ok && i < n; s = (long)ends[i++])
        ok = strlen(want[i]) == ends[i] - (size_t)s && !memcmp(text + s, want[i], ends[i] - (size_t)s);
    if (!ok) {
        fprintf(stderr, "  pretok %d of \"%s\": got", pretok, text);
        for (long i = 0, s = 0; i < n && i < 128; s = (long)ends[i++]) fprintf(stderr, " [%.*s]", (int)(ends[i] - (size_t)s), text + s);
        fprintf(stderr, "\n");
    }
    CHECK(ok);
}

/* spec/TOKENIZER.md 6.1 (Kimi) and 6.2 (o200k, cl100k): verified there against tiktoken */
static void test_tokenizer_spec_pieces(void) {
    enum { K = MOE_PRETOK_KIMI, O = MOE_PRETOK_O200K, C = MOE_PRETOK_CL100K };
#define P(pre, text, ...) do { const char *w_[] = {__VA_ARGS__, NULL}; check_pieces(pre, text, w_); } while (0)
    P(K, "Hello  world\n\n", "Hello", " ", " world", "\n\n");
    P(K, "東京タワーabc", "東京", "タワーabc");
    P(K, "I'M fine", "I'M", " fine");
    P(K, "x   \ny", "x", "   \n", "y");
    P(K, "Hello, world!", "Hello", ",", " world", "!");
    P(K, "getUserName", "get", "User", "Name");
    P(K, "HTMLParser", "HTMLParser");
    P(K, "iPhone 15 Pro", "i", "Phone", " ", "15", " Pro");
    P(K, "don't DON'T we'LL I'mm", "don't", " DON'T", " we'LL", " I'm", "m");
    P(K, "itſs it'ſ", "itſs", " it'ſ");
    P(K, "1234567", "123", "456", "7");
    P(K, "12.5% of $100", "12", ".", "5", "%", " of", " $", "100");
    P(K, "你好世界，欢迎使用Kimi K3！", "你好世界", "，", "欢迎使用", "Kimi", " K", "3", "！");
    P(K, "こんにちは、世界", "こんにちは", "、", "世界");
    P(K, "日本語テスト", "日本語", "テスト");
    P(K, "今日は良い天気ですね。", "今日", "は", "良", "い", "天気", "ですね", "。");
    P(K, "漢字かな交じり文", "漢字", "かな", "交", "じり", "文");
    P(K, "Kimi是月之暗面的助手", "Kimi", "是月之暗面的助手");
    P(K, "中文abc中文", "中文", "abc", "中文");
    P(K, "々y", "々", "y");
    P(K, "〇一二三", "〇一二三");
    P(K, "⺀一x", "⺀一", "x");
    P(K, "!⺀", "!⺀");
    P(K, "(東京)", "(", "東京", ")");
    P(K, "한국어 텍스트", "한국어", " 텍스트");
    P(K, "café naïve", "café", " naïve");
    P(K, "cafe\xcc\x81", "cafe\xcc\x81");
    P(K, "\xcc\x81" "abc", "\xcc\x81" "abc");
    P(K, "ＡＢＣｄｅｆ", "ＡＢＣｄｅｆ");
    P(K, "ǅungla", "ǅungla");
    P(K, "end   ", "end", "   ");
    P(K, "a  b\n\n\nc", "a", " ", " b", "\n\n\n", "c");
    P(K, "foo\n  bar", "foo", "\n", " ", " bar");
    P(K, "\r\n\r\nfoo", "\r\n\r\n", "foo");
    P(K, "x \ty", "x", " ", "\ty");
    P(K, " 123", " ", "123");
    P(K, "\tfoo", "\tfoo");
    P(K, "\xe3\x80\x80" "foo", "\xe3\x80\x80" "foo");
    P(K, "😀😀 hi", "😀😀", " hi");
    P(K, "<|im_end|>", "<|", "im", "_end", "|>");
    P(K, "def foo(x: int) -> bool:\n    return x > 0  # comment", "def", " foo", "(x", ":", " int", ")", " ->", " bool", ":\n", "   ",
      " return", " x", " >", " ", "0", " ", " #", " comment");
    P(K, "a/b//c", "a", "/b", "//", "c");
    P(K, "\xc2\xa0\xc2\xa0x", "\xc2\xa0", "\xc2\xa0x");
    /* 6.2: where the three patterns differ */
    P(O, "東京タワーabc", "東京タワーabc");
    P(C, "東京タワーabc", "東京タワーabc");
    P(C, "I'M fine", "I", "'M", " fine");
    P(C, "getUserName", "getUserName");
    P(O, "getUserName", "get", "User", "Name");
    P(C, "iPhone 15 Pro", "iPhone", " ", "15", " Pro");
    P(C, "don't DON'T we'LL I'mm", "don", "'t", " DON", "'T", " we", "'LL", " I", "'m", "m");
    P(O, "don't DON'T we'LL I'mm", "don't", " DON'T", " we'LL", " I'm", "m");
    P(C, "itſs it'ſ", "itſs", " it", "'ſ");
    P(O, "你好世界，欢迎使用Kimi K3！", "你好世界", "，欢迎使用Kimi", " K", "3", "！");
    P(C, "你好世界，欢迎使用Kimi K3！", "你好世界", "，欢迎使用Kimi", " K", "3", "！");
    P(O, "こんにちは、世界", "こんにちは", "、世界");
    P(O, "今日は良い天気ですね。", "今日は良い天気ですね", "。");
    P(O, "〇一二三", "〇", "一二三");
    P(C, "〇一二三", "〇", "一二三");
    P(O, "(東京)", "(東京", ")");
    P(O, "cafe\xcc\x81", "cafe\xcc\x81");
    P(C, "cafe\xcc\x81", "cafe", "\xcc\x81");
    P(O, ".\n/x", ".\n/", "x"); /* o200k's punctuation run may end in '/' after line breaks */
    P(K, ".\n/x", ".\n", "/x");
#undef P
    CHECK(moe__pretokenize(K, "\xff", 1, NULL, 0) == -1); /* the hook takes valid UTF-8 only */
}

/* Kimi pieces of 3000 random strings against a regex translation run in Node
 * (scripts/tokenizer-reference.mjs kimi-pieces) */
static void test_tokenizer_random_pieces(void) {
    char path[600];
    snprintf(path, sizeof path, "%s/random.jsonl", tok_dir());
    size_t la = 0, lb = 0;
    char *in = read_all(path, &la);
    snprintf(path, sizeof path, "%s/random.kimi.pieces", tok_dir());
    char *want = read_all(path, &lb);
    CHECK(in && want);
    int lines = 0, bad = 0;
    for (char *a = in, *b = want; in && want && *a && *b; lines++) {
        char *ae = strchr(a, '\n'), *be = strchr(b, '\n');
        if (!ae || !be) break;
        moe__json *s = NULL, *w = NULL;
        CHECK(moe__json_parse(a, (size_t)(ae - a), &s, NULL, 0) == MOE_OK && moe__json_parse(b, (size_t)(be - b), &w, NULL, 0) == MOE_OK);
        if (s && w) {
            size_t ends[64], len = strlen(s->str);
            long n = moe__pretokenize(MOE_PRETOK_KIMI, s->str, len, ends, 64);
            int ok = n == w->n;
            const moe__json *p = w->child;
            for (long i = 0, st = 0; ok && i < n; st = (long)ends[i++], p = p->next)
                ok = strlen(p->str) == ends[i] - (size_t)st && !memcmp(s->str + st, p->str, ends[i] - (size_t)st);
            if (!ok && bad++ < 5) fprintf(stderr, "  random line %d: %.*s: pieces differ from %.*s\n", lines + 1, (int)(ae - a), a, (int)(be - b), b);
        }
        moe__json_free(s), moe__json_free(w);
        a = ae + 1, b = be + 1;
    }
    CHECKF(bad == 0, "%d of %d lines differ", bad, lines);
    CHECK(lines == 3000);
    free(in), free(want);
}

/* compares ids with a whitespace-separated id line; returns 1 when equal */
static int ids_equal(const int32_t *ids, size_t n, const char *line, const char *end) {
    size_t i = 0;
    for (const char *p = line; p < end;) {
        char *q;
        long v = strtol(p, &q, 10);
        if (q == p) break;
        if (i >= n || ids[i] != v) return 0;
        i++, p = q;
    }
    return i == n;
}

static moe_tokenizer *load_openai(const char *name, int pretok) {
    char path[600], err[300];
    snprintf(path, sizeof path, "%s/%s_base.tiktoken", tok_dir(), name);
    moe_tokenizer *t = NULL;
    moe_status st = moe_tokenizer_load(&t, path, pretok, NULL, 0, err, sizeof err);
    CHECKF(st == MOE_OK, "%s", err);
    return t;
}

/* o200k_base and cl100k_base ids against npm js-tiktoken 1.0.21 on a multilingual corpus (KJV
 * chapters from Debian's bible-kjv, CJK, Arabic, Devanagari, Cyrillic, emoji sequences, combining
 * marks, CRLF, long whitespace runs, code) and on 3000 random strings, line by line */
static void test_tokenizer_openai_ids(void) {
    const char *names[2] = {"o200k", "cl100k"};
    char path[600], err[300];
    size_t tl = 0;
    snprintf(path, sizeof path, "%s/corpus.txt", tok_dir());
    char *text = read_all(path, &tl);
    snprintf(path, sizeof path, "%s/random.jsonl", tok_dir());
    size_t rl = 0;
    char *rnd = read_all(path, &rl);
    CHECK(text && rnd);
    for (int k = 0; k < 2 && text && rnd; k++) {
        moe_tokenizer *t = load_openai(names[k], k ? MOE_PRETOK_CL100K : MOE_PRETOK_O200K);
        if (!t) continue;
        CHECK(moe_tokenizer_n_ids(t) == (k ? 100277 : 200019));
        CHECK(moe_token_id(t, "<|endoftext|>") == (k ? 100257 : 199999));
        int32_t *ids = malloc((tl + 1) * sizeof *ids);
        size_t n = 0, wl = 0;
        CHECK(moe_tokenize(t, text, tl, 0, ids, tl + 1, &n, err, sizeof err) == MOE_OK);
        snprintf(path, sizeof path, "%s/corpus.%s.ids", tok_dir(), names[k]);
        char *want = read_all(path, &wl);
        CHECKF(want && ids_equal(ids, n, want, want + wl), "%s: corpus ids differ from js-tiktoken", names[k]);
        free(want);
        /* decoding gives the text back */
        char *back = malloc(tl + 1);
        size_t bl = 0;
        CHECK(moe_detokenize(t, ids, n, back, tl + 1, &bl, err, sizeof err) == MOE_OK && bl == tl && !memcmp(back, text, tl));
        free(back), free(ids);
        snprintf(path, sizeof path, "%s/random.%s.ids", tok_dir(), names[k]);
        want = read_all(path, &wl);
        CHECK(want != NULL);
        int lines = 0, bad = 0;
        for (char *a = rnd, *b = want; want && *a && *b; lines++) {
            char *ae = strchr(a, '\n'), *be = strchr(b, '\n');
            if (!ae || !be) break;
            moe__json *s = NULL;
            int32_t lid[128];
            size_t ln = 0;
            if (moe__json_parse(a, (size_t)(ae - a), &s, NULL, 0) != MOE_OK ||
                moe_tokenize(t, s->str, strlen(s->str), 0, lid, 128, &ln, err, sizeof err) != MOE_OK || !ids_equal(lid, ln, b, be)) {
                if (bad++ < 5) fprintf(stderr, "  %s random line %d: %.*s: ids differ from %.*s\n", names[k], lines + 1, (int)(ae - a), a, (int)(be - b), b);
            }
            moe__json_free(s);
            a = ae + 1, b = be + 1;
        }
        CHECKF(bad == 0 && lines == 3000, "%s: %d of %d random lines differ", names[k], bad, lines);
        free(want);
        moe_tokenizer_free(t);
    }
    free(text), free(rnd);
}

/* decode(encode(x)) == x for arbitrary bytes (with MOE_TOK_RAW_BYTES); strict mode refuses
 * invalid UTF-8; the output-size contract */
static void test_tokenizer_roundtrip(void) {
    moe_tokenizer *t = load_openai("o200k", MOE_PRETOK_O200K);
    if (!t) return;
    char err[300], buf[700], back[800];
    int32_t ids[700];
    int bad = 0;
    for (int iter = 0; iter < 2000; iter++) {
        size_t len = (size_t)(urand() * 600);
        for (size_t i = 0; i < len; i++) {
            double u = urand();
            buf[i] = (char)(u < 0.3 ? 0x80 + (int)(urand() * 128) : u < 0.4 ? 0xC0 + (int)(urand() * 64) : u < 0.5 ? ' ' : (int)(urand() * 128));
        }
        size_t n = 0, bl = 0;
        moe_status st = moe_tokenize(t, buf, len, MOE_TOK_RAW_BYTES | (iter & 1 ? MOE_TOK_SPECIAL : 0), ids, 700, &n, err, sizeof err);
        if (st || moe_detokenize(t, ids, n, back, sizeof back, &bl, err, sizeof err) || bl != len || memcmp(back, buf, len)) bad++;
    }
    CHECKF(bad == 0, "%d of 2000 random byte strings did not round-trip", bad);
    size_t n = 0;
    CHECK(moe_tokenize(t, "ab\xff", 3, 0, ids, 10, &n, err, sizeof err) == MOE_ERR_ARG && strstr(err, "UTF-8"));
    CHECK(moe_tokenize(t, "\xed\xa0\x80", 3, 0, ids, 10, &n, err, sizeof err) == MOE_ERR_ARG); /* a surrogate */
    CHECK(moe_tokenize(t, "\xc0\xaf", 2, 0, ids, 10, &n, err, sizeof err) == MOE_ERR_ARG);     /* overlong */
    const char *s = "Hello, world! Hello, world!";
    CHECK(moe_tokenize(t, s, strlen(s), 0, ids, 2, &n, err, sizeof err) == MOE_ERR_RANGE && n == 8);
    CHECK(moe_tokenize(t, s, strlen(s), 0, ids, 8, &n, err, sizeof err) == MOE_OK && n == 8 && ids[0] == 13225);
    CHECK(moe_tokenize(t, "", 0, 0, NULL, 0, &n, err, sizeof err) == MOE_OK && n == 0);
    CHECK(moe_tokenize(t, "<|endoftext|>", 13, MOE_TOK_SPECIAL, ids, 10, &n, err, sizeof err) == MOE_OK && n == 1 && ids[0] == 199999);
    CHECK(moe_tokenize(t, "<|endoftext|>", 13, 0, ids, 10, &n, err, sizeof err) == MOE_OK && n > 1);
    CHECK(moe_token_bytes(t, 300000, NULL) == NULL && moe_token_bytes(t, -1, NULL) == NULL);
    CHECK(moe_detokenize(t, (int32_t[]){199998}, 1, back, sizeof back, &n, err, sizeof err) == MOE_ERR_ARG); /* a hole */
    CHECK(moe_utf8_valid_prefix("ab\xe6\x9d", 4) == 2 && moe_utf8_valid_prefix("\xe6\x9d\xb1", 3) == 3);
    moe_tokenizer_free(t);
}

/* A tiny Kimi-style vocabulary: the 256 bytes, then "aa" and "aaa"; specials named by a
 * tokenizer_config.json. Checks the special-token modes, K2's 258 vs K3's 256 reserved ids, the
 * vendor's 25,000-run chunking, and bad rank files. */
static void write_tiny_ranks(const char *path, const char *extra) {
    static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    FILE *f = fopen(path, "w");
    for (int b = 0; b < 256; b++) fprintf(f, "%c%c== %d\n", b64[b >> 2], b64[(b & 3) << 4], b);
    fputs(extra, f);
    fclose(f);
}

static void test_tokenizer_kimi_specials(void) {
    char ranks[600], cfg[600], err[300];
    tmp_path(ranks, sizeof ranks, "tiny.tiktoken");
    tmp_path(cfg, sizeof cfg, "tokenizer_config.json");
    write_tiny_ranks(ranks, "YWE= 256\nYWFh 257\n"); /* "aa", "aaa" */
    const char *k2 = "{\"added_tokens_decoder\": {\"258\": {\"content\": \"[BOS]\", \"special\": true},"
                     " \"260\": {\"content\": \"<|im_end|>\", \"special\": true}, \"261\": {\"content\": \"<|im_user|>\"}}}";
    CHECK(write_all(cfg, k2, strlen(k2)));
    moe_tokenizer *t = NULL;
    CHECKF(moe_tokenizer_load(&t, ranks, MOE_PRETOK_KIMI, cfg, 0, err, sizeof err) == MOE_OK, "%s", err);
    if (!t) return;
    CHECK(moe_tokenizer_n_ids(t) == 258 + 258); /* K2 / Kimi-Linear: 256 + 2 reserved */
    CHECK(moe_token_id(t, "<|im_end|>") == 260 && moe_token_id(t, "[BOS]") == 258 && moe_token_id(t, "<|reserved_token_259|>") == 259);
    CHECK(moe_token_id(t, "<|reserved_token_515|>") == 515 && moe_token_is_special(t, 260) && !moe_token_is_special(t, 97));
    int32_t ids[30000];
    size_t n = 0;
    CHECK(moe_tokenize(t, "x<|im_end|>y", 12, MOE_TOK_SPECIAL, ids, 100, &n, err, sizeof err) == MOE_OK && n == 3 && ids[0] == 'x' &&
          ids[1] == 260 && ids[2] == 'y');
    CHECK(moe_tokenize(t, "x<|im_end|>y", 12, 0, ids, 100, &n, err, sizeof err) == MOE_OK && n == 12 && ids[1] == '<');
    CHECK(moe_tokenize(t, "[BOS]aaa<|reserved_token_300|>", 30, MOE_TOK_SPECIAL, ids, 100, &n, err, sizeof err) == MOE_OK && n == 3 &&
          ids[0] == 258 && ids[1] == 257 && ids[2] == 300);
    CHECK(moe_tokenize(t, "aaaaa", 5, 0, ids, 100, &n, err, sizeof err) == MOE_OK && n == 2 && ids[0] == 256 && ids[1] == 257);
    /* chunking: 25,001 letters are cut after 25,000 (12,500 "aa" then "a"); one piece would end "aaa" */
    char *run = malloc(25002);
    memset(run, 'a', 25001);
    CHECK(moe_tokenize(t, run, 25001, 0, ids, 30000, &n, err, sizeof err) == MOE_OK && n == 12501 && ids[12499] == 256 && ids[12500] == 'a');
    CHECK(moe_tokenize(t, run, 25000, 0, ids, 30000, &n, err, sizeof err) == MOE_OK && n == 12500);
    free(run);
    moe_tokenizer_free(t);
    /* K3: "<|open|>" among the names -> 256 reserved ids */
    const char *k3 = "{\"added_tokens_decoder\": {\"259\": {\"content\": \"<|open|>\", \"special\": false}}}";
    CHECK(write_all(cfg, k3, strlen(k3)));
    CHECK(moe_tokenizer_load(&t, ranks, MOE_PRETOK_KIMI, cfg, 0, err, sizeof err) == MOE_OK && moe_tokenizer_n_ids(t) == 258 + 256);
    moe_tokenizer_free(t);
    t = NULL;
    /* bad inputs: each a clear error */
    const struct { const char *ranks_extra, *config, *what; } bad[] = {
        {"YWE= 256\nYWE= 257\n", NULL, "same bytes"},
        {"YWE= 256\nYWFh 256\n", NULL, "repeated"},
        {"YWE= 256\nYWFh 258\n", NULL, "missing"},
        {"YWE 256\n", NULL, "base64"},
        {"YW!= 256\n", NULL, "base64"},
        {"YWE=256\n", NULL, "BASE64 RANK"},
        {"YWE= 256 7\n", NULL, "BASE64 RANK"},
        {"YWE= -1\n", NULL, "BASE64 RANK"},
        {"", "{\"added_tokens_decoder\": {\"100\": {\"content\": \"x\"}}}", "outside"},
        {"", "{\"added_tokens_decoder\": {\"258\": {\"content\": 5}}}", "content"},
        {"", "{\"added_tokens_decoder\": {\"258\": {\"content\": \"<|a|>\"}, \"259\": {\"content\": \"<|a|>\"}}}", "twice"},
        {"", "{\"added_tokens_decoder\": [1]}", "not an object"},
        {"", "{\"added_tokens_decoder\": {\"258\": {\"content\": \"\"}}}", "empty"},
        {"", "{\"added_tokens_decoder\":", "JSON"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        write_tiny_ranks(ranks, bad[i].ranks_extra);
        if (bad[i].config) CHECK(write_all(cfg, bad[i].config, strlen(bad[i].config)));
        err[0] = 0;
        moe_status st = moe_tokenizer_load(&t, ranks, MOE_PRETOK_KIMI, bad[i].config ? cfg : NULL, 0, err, sizeof err);
        CHECKF(st == MOE_ERR_FORMAT && t == NULL && strstr(err, bad[i].what), "case %zu: status %d, '%s'", i, (int)st, err);
    }
    FILE *f = fopen(ranks, "w"); /* byte 0x41 missing */
    for (int b = 0; b < 10; b++) fprintf(f, "%c== %d\n", 'A' + b, b);
    fclose(f);
    CHECK(moe_tokenizer_load(&t, ranks, MOE_PRETOK_KIMI, NULL, 0, err, sizeof err) == MOE_ERR_FORMAT);
    CHECK(moe_tokenizer_load(&t, "/nonexistent/x", MOE_PRETOK_KIMI, NULL, 0, err, sizeof err) == MOE_ERR_IO && t == NULL);
    /* found by the ranks fuzz target: a rank at the very end of a buffer with no NUL after it was
     * read past the end (strtol); the buffer here is exactly the text */
    write_tiny_ranks(ranks, "YWE= 256");
    size_t rl = 0;
    char *rt = read_all(ranks, &rl), *exact = malloc(rl);
    memcpy(exact, rt, rl);
    CHECK(moe__tokenizer_from_mem(&t, exact, rl, MOE_PRETOK_KIMI, NULL, 0, err, sizeof err) == MOE_OK && moe_tokenizer_n_ids(t) == 257 + 258);
    moe_tokenizer_free(t);
    t = NULL;
    free(rt), free(exact);
    CHECK(moe_tokenizer_load(&t, ranks, 7, NULL, 0, err, sizeof err) == MOE_ERR_ARG);
}

/* streaming output: whole characters only, stop strings held back until decided */
static void test_text_ready(void) {
    const char *stops[2] = {"</s>", "END"};
    int st = 0;
    CHECK(moe_text_ready("hello", 5, NULL, 0, 0, &st) == 5 && !st);
    CHECK(moe_text_ready("h\xe6\x9d", 3, NULL, 0, 0, &st) == 1);          /* a character cut short waits */
    CHECK(moe_text_ready("h\xe6\x9d", 3, NULL, 0, 1, &st) == 3);          /* ... until the end */
    CHECK(moe_text_ready("h\xe6\x9d\xb1", 4, NULL, 0, 0, &st) == 4);
    CHECK(moe_text_ready("h\xff\xfex", 4, NULL, 0, 0, &st) == 4);         /* stray bytes are passed on */
    CHECK(moe_text_ready("h\xe6x", 3, NULL, 0, 0, &st) == 3);              /* a lead byte never completed */
    CHECK(moe_text_ready("ab</", 4, stops, 2, 0, &st) == 2 && !st);       /* may begin "</s>" */
    CHECK(moe_text_ready("ab</x", 5, stops, 2, 0, &st) == 5 && !st);
    CHECK(moe_text_ready("ab</s>cd", 8, stops, 2, 0, &st) == 2 && st);
    CHECK(moe_text_ready("xEN", 3, stops, 2, 0, &st) == 1 && !st);
    CHECK(moe_text_ready("xENDy</s>", 9, stops, 2, 0, &st) == 1 && st);   /* the earliest stop wins */
    CHECK(moe_text_ready("xEN", 3, stops, 2, 1, &st) == 3 && !st);
    /* byte by byte through a buffer: what is shown is the text up to the stop string */
    const char *text = "caf\xc3\xa9 \xe6\x9d\xb1 ok END tail";
    char buf[64], shown[64];
    size_t n = 0, ns = 0;
    int stopped = 0;
    for (size_t i = 0; text[i] && !stopped; i++) {
        buf[n++] = text[i];
        size_t k = moe_text_ready(buf, n, stops, 2, 0, &stopped);
        CHECK(moe_utf8_valid_prefix(buf, k) == k);
        memcpy(shown + ns, buf, k), ns += k;
        memmove(buf, buf + k, n - k), n -= k;
    }
    shown[ns] = 0;
    CHECKF(stopped && !strcmp(shown, "caf\xc3\xa9 \xe6\x9d\xb1 ok "), "'%s'", shown);
}

/* moe-tokenize: the interface the checks use */
static void test_moe_tokenize_cli(void) {
    char cmd[2400], out[65536], in[600];
    tmp_path(in, sizeof in, "tok-in.txt");
    CHECK(write_all(in, "Hello, world!", 13));
    snprintf(cmd, sizeof cmd, "%s/moe-tokenize --ranks %s/cl100k_base.tiktoken --pre cl100k %s", exe_dir, tok_dir(), in);
    CHECK(run_cmd(cmd, out, sizeof out) == 0 && !strcmp(out, "9906 11 1917 0\n"));
    CHECK(write_all(in, "Hello, world!", 13)); /* stdin (redirected, so that MOE_TEST_RUNNER applies) */
    snprintf(cmd, sizeof cmd, "%s/moe-tokenize --ranks %s/o200k_base.tiktoken --pre o200k < %s", exe_dir, tok_dir(), in);
    CHECK(run_cmd(cmd, out, sizeof out) == 0 && !strcmp(out, "13225 11 2375 0\n"));
    CHECK(write_all(in, "13225 11 2375 0", 15));
    snprintf(cmd, sizeof cmd, "%s/moe-tokenize --ranks %s/o200k_base.tiktoken --pre o200k --decode %s", exe_dir, tok_dir(), in);
    CHECK(run_cmd(cmd, out, sizeof out) == 0 && !strcmp(out, "Hello, world!"));
    CHECK(write_all(in, "a\xff", 2));
    snprintf(cmd, sizeof cmd, "%s/moe-tokenize --ranks %s/o200k_base.tiktoken --pre o200k %s 2>&1", exe_dir, tok_dir(), in);
    CHECK(run_cmd(cmd, out, sizeof out) == 1 && strstr(out, "UTF-8"));
    snprintf(cmd, sizeof cmd, "%s/moe-tokenize --ranks %s/o200k_base.tiktoken --pre o200k --raw-bytes %s", exe_dir, tok_dir(), in);
    CHECK(run_cmd(cmd, out, sizeof out) == 0);
    snprintf(cmd, sizeof cmd, "%s/moe-tokenize --ranks x --pre nope 2>/dev/null", exe_dir);
    CHECK(run_cmd(cmd, out, sizeof out) == 2);
    snprintf(cmd, sizeof cmd, "%s/moe-tokenize -m %s/kimi 2>&1", exe_dir, golden_dir());
    CHECK(run_cmd(cmd, out, sizeof out) == 1 && strstr(out, "tiktoken.model"));
}

/* ---- chat formats ----------------------------------------------------------------------------- */

/* writes a tokenizer_config.json naming Kimi's specials at their offsets from the base ids (the
 * K2 / Kimi-Linear table or the K3 table of spec/TOKENIZER.md 1.3) */
static void write_kimi_config(const char *path, int base, int k3) {
    static const char *k2n[] = {"[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", NULL, "<|start_header_id|>",
                                "<|end_header_id|>", NULL, "[EOT]", "<|im_system|>", "<|tool_calls_section_begin|>",
                                "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
                                NULL, "<|im_middle|>"};
    static const char *k3n[] = {"[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"};
    FILE *f = fopen(path, "w");
    fprintf(f, "{\"added_tokens_decoder\": {");
    const char **names = k3 ? k3n : k2n;
    int n = k3 ? 6 : 18;
    for (int i = 0; i < n; i++)
        if (names[i]) fprintf(f, "\"%d\": {\"content\": \"%s\", \"special\": true}, ", base + i, names[i]);
    fprintf(f, "\"%d\": {\"content\": \"[UNK]\"}, \"%d\": {\"content\": \"[PAD]\"}}}", base + 254, base + 255);
    fclose(f);
}

static moe_tokenizer *kimi_test_tokenizer(const char *ranks, int base, int k3) {
    char cfg[600], err[300];
    tmp_path(cfg, sizeof cfg, k3 ? "k3_config.json" : "k2_config.json");
    write_kimi_config(cfg, base, k3);
    moe_tokenizer *t = NULL;
    CHECKF(moe_tokenizer_load(&t, ranks, MOE_PRETOK_KIMI, cfg, 0, err, sizeof err) == MOE_OK, "%s", err);
    return t;
}

/* the worked examples of spec/TOKENIZER.md 5.2 (KL-1..5, rendered with the K2-Instruct-0905
 * template through transformers) and 5.4 (K3-1..6, the vendor's encoding_k3.py), extracted into
 * test/chat/spec-cases.jsonl: rendered text must be identical */
static void test_chat_spec_cases(void) {
    char ranks[600], path[600], err[400];
    tmp_path(ranks, sizeof ranks, "chat-tiny.tiktoken");
    write_tiny_ranks(ranks, "YWE= 256\nYWFh 257\n");
    moe_tokenizer *k2 = kimi_test_tokenizer(ranks, 258, 0), *k3 = kimi_test_tokenizer(ranks, 258, 1);
    CHECK(moe_chat_format_of(k2) == MOE_CHAT_K2 && moe_chat_format_of(k3) == MOE_CHAT_K3);
    snprintf(path, sizeof path, "test/chat/spec-cases.jsonl");
    size_t len = 0;
    char *all = read_all(path, &len);
    CHECK(all != NULL);
    int n = 0;
    for (char *line = all; all && k2 && k3 && *line; n++) {
        char *end = strchr(line, '\n');
        if (!end) break;
        moe__json *c = NULL;
        CHECK(moe__json_parse(line, (size_t)(end - line), &c, NULL, 0) == MOE_OK);
        const char *name = moe__json_get(c, "name")->str, *want = moe__json_get(c, "rendered")->str;
        const moe__json *args = moe__json_get(c, "args"), *v;
        moe_chat_options o = moe_chat_default_options();
        if ((v = moe__json_get(args, "add_generation_prompt"))) o.add_generation_prompt = (int)v->num;
        if ((v = moe__json_get(args, "thinking"))) o.thinking = (int)v->num;
        if ((v = moe__json_get(args, "thinking_effort"))) o.thinking_effort = v->str;
        /* the input object as text, with tool_choice (an apply_chat_template argument there) in the request */
        const char *in = strstr(line, "\"input\": ") + 9, *in_end = strstr(line, ", \"rendered\": ");
        char req[8192];
        const moe__json *tc = moe__json_get(args, "tool_choice");
        if (tc) snprintf(req, sizeof req, "{\"tool_choice\": \"%s\", %.*s", tc->str, (int)(in_end - in - 1), in + 1);
        else snprintf(req, sizeof req, "%.*s", (int)(in_end - in), in);
        char text[8192];
        size_t tl = 0;
        moe_tokenizer *t = name[1] == 'L' ? k2 : k3;
        moe_status st = moe_chat_render(t, req, strlen(req), &o, text, sizeof text, &tl, err, sizeof err);
        CHECKF(st == MOE_OK && tl == strlen(want) && !strcmp(text, want), "%s: %s\n got  %s\n want %s", name, st ? err : "", st ? "" : text, want);
        /* and the ids decode back to the text */
        int32_t ids[8192];
        size_t ni = 0, bl = 0;
        char back[8192];
        CHECKF(moe_chat_encode(t, req, strlen(req), &o, ids, 8192, &ni, err, sizeof err) == MOE_OK, "%s: %s", name, err);
        CHECK(moe_detokenize(t, ids, ni, back, sizeof back, &bl, err, sizeof err) == MOE_OK && bl == tl && !memcmp(back, text, tl));
        moe__json_free(c);
        line = end + 1;
    }
    CHECK(n == 11);
    free(all);
    /* errors: each names the problem */
    const struct { moe_tokenizer *t; const char *req, *what; } bad[] = {
        {k3, "{\"messages\": [{\"role\": \"robot\", \"content\": \"x\"}]}", "unknown role"},
        {k3, "{\"messages\": [{\"content\": \"x\"}]}", "no role"},
        {k3, "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\"}]}]}", "only text parts"},
        {k3, "{\"messages\": 5}", "messages"},
        {k3, "{\"messages\": [1]}", "object"},
        {k3, "{\"messages\": [", "JSON"},
        {k3, "{\"messages\": [{\"role\": \"user\", \"content\": \"\xff\"}]}", "UTF-8"},
        {k3, "{\"messages\": [{\"role\": \"assistant\", \"tool_calls\": [{\"function\": {\"name\": \"f\", \"arguments\": \"[1]\"}}]}]}", "object"},
        {k2, "{\"messages\": [{\"role\": \"assistant\", \"tool_calls\": [{\"function\": {\"arguments\": \"{}\"}}]}]}", "id"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char text[4096];
        size_t tl;
        err[0] = 0;
        moe_status st = moe_chat_render(bad[i].t, bad[i].req, strlen(bad[i].req), NULL, text, sizeof text, &tl, err, sizeof err);
        CHECKF(st != MOE_OK && strstr(err, bad[i].what), "case %zu: status %d '%s'", i, (int)st, err);
    }
    moe_chat_options eff = moe_chat_default_options();
    eff.thinking_effort = "medium"; /* advertised, but the vendor rejects it */
    char text[4096];
    size_t tl;
    CHECK(moe_chat_render(k3, "[]", 2, &eff, text, sizeof text, &tl, err, sizeof err) == MOE_ERR_ARG && strstr(err, "low, high or max"));
    CHECK(moe_chat_render(k3, "[]", 2, NULL, text, 10, &tl, err, sizeof err) == MOE_ERR_RANGE && tl > 10);
    moe_tokenizer_free(k2), moe_tokenizer_free(k3);
}

/* Ids: K3 encodes segment by segment (spec 5.3.5: K3-2 as segments); K2 encodes the rendered
 * string whole with specials allowed (a user's "<|im_end|>" becomes the control token) unless
 * safe. With o200k's ranks under Kimi's pre-tokenizer, so that piece edges change ids. */
static void test_chat_ids(void) {
    char ranks[600], err[300];
    snprintf(ranks, sizeof ranks, "%s/o200k_base.tiktoken", tok_dir());
    moe_tokenizer *k3 = kimi_test_tokenizer(ranks, 199998, 1), *k2 = kimi_test_tokenizer(ranks, 199998, 0);
    if (!k3 || !k2) return;
    static const char *segs[] = {"S<|open|>", "Tmessage", "T role", "T=\"", "Tsystem", "T\"", "S<|sep|>", "TYou are a terse assistant.",
                                 "S<|close|>", "Tmessage", "S<|sep|>", "S<|end_of_msg|>", "S<|open|>", "Tmessage", "T role", "T=\"", "Tuser",
                                 "T\"", "S<|sep|>", "TWhat is 2+2?", "S<|close|>", "Tmessage", "S<|sep|>", "S<|end_of_msg|>", "S<|open|>",
                                 "Tmessage", "T role", "T=\"", "Tassistant", "T\"", "S<|sep|>", "S<|open|>", "Tresponse", "S<|sep|>"};
    int32_t want[512], got[512];
    size_t nw = 0, ng = 0, k;
    for (size_t i = 0; i < sizeof segs / sizeof segs[0]; i++) {
        CHECK(moe_tokenize(k3, segs[i] + 1, strlen(segs[i] + 1), segs[i][0] == 'S' ? MOE_TOK_SPECIAL : 0, want + nw, 512 - nw, &k, err, sizeof err) == MOE_OK);
        nw += k;
    }
    const char *req = "{\"messages\": [{\"role\": \"system\", \"content\": \"You are a terse assistant.\"}, {\"role\": \"user\", \"content\": \"What is 2+2?\"}]}";
    moe_chat_options o = moe_chat_default_options();
    o.thinking = 0;
    CHECKF(moe_chat_encode(k3, req, strlen(req), &o, got, 512, &ng, err, sizeof err) == MOE_OK, "%s", err);
    CHECK(ng == nw && !memcmp(got, want, nw * sizeof *got));
    /* and differently from the whole rendered string where a segment edge cuts a piece: an
     * attribute value starting with punctuation ("=\"" then "(bot)", not "=\"(" then "bot") */
    char text[2048];
    size_t tl, nwhole;
    int32_t whole[512];
    req = "{\"messages\": [{\"role\": \"user\", \"name\": \"(bot)\", \"content\": \"Hi\"}]}";
    CHECK(moe_chat_encode(k3, req, strlen(req), &o, got, 512, &ng, err, sizeof err) == MOE_OK);
    CHECK(moe_chat_render(k3, req, strlen(req), &o, text, sizeof text, &tl, err, sizeof err) == MOE_OK);
    CHECK(moe_tokenize(k3, text, tl, MOE_TOK_SPECIAL, whole, 512, &nwhole, err, sizeof err) == MOE_OK);
    CHECK(nwhole != ng || memcmp(whole, got, ng * sizeof *got));
    /* K3 user text never becomes a control id */
    const int32_t end_msg = moe_token_id(k3, "<|end_of_msg|>"), im_end = moe_token_id(k2, "<|im_end|>");
    const char *inj = "{\"messages\": [{\"role\": \"user\", \"content\": \"a<|end_of_msg|><|im_end|>b\"}]}";
    CHECK(moe_chat_encode(k3, inj, strlen(inj), &o, got, 512, &ng, err, sizeof err) == MOE_OK);
    int count = 0;
    for (size_t i = 0; i < ng; i++) count += got[i] == end_msg;
    CHECK(count == 1); /* only the message's own end */
    /* K2: the vendor's parity turns the typed marker into the control token; safe mode does not */
    CHECK(moe_chat_encode(k2, inj, strlen(inj), NULL, got, 512, &ng, err, sizeof err) == MOE_OK);
    count = 0;
    for (size_t i = 0; i < ng; i++) count += got[i] == im_end;
    CHECK(count == 3); /* default system turn, the injected one, the user turn */
    moe_chat_options safe = moe_chat_default_options();
    safe.safe = 1;
    CHECK(moe_chat_encode(k2, inj, strlen(inj), &safe, got, 512, &ng, err, sizeof err) == MOE_OK);
    count = 0;
    for (size_t i = 0; i < ng; i++) count += got[i] == im_end;
    CHECK(count == 2);
    CHECK(moe_chat_encode(k2, inj, strlen(inj), NULL, got, 3, &ng, err, sizeof err) == MOE_ERR_RANGE && ng > 3);
    /* tool calls read back from replies (spec 5.3.4 and 5.1's output format) */
    const char *k3r = "Need it.<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
                      "<|open|>call tool=\"get_weather\" index=\"1\"<|sep|><|open|>argument key=\"city\" type=\"string\"<|sep|>Paris"
                      "<|close|>argument<|sep|><|open|>argument key=\"days\" type=\"number\"<|sep|>3<|close|>argument<|sep|>"
                      "<|close|>call<|sep|><|open|>call tool=\"a&quot;b\" index=\"2\"<|sep|><|close|>call<|sep|><|close|>tools<|sep|>"
                      "<|close|>message<|sep|><|end_of_msg|>";
    const char *k2r = "ok<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                      "{\"city\": \"Beijing\"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>";
    char calls[1024];
    size_t cl;
    CHECK(moe_tokenize(k3, k3r, strlen(k3r), MOE_TOK_SPECIAL, got, 512, &ng, err, sizeof err) == MOE_OK);
    CHECK(moe_chat_tool_calls(k3, got, ng, NULL, calls, sizeof calls, &cl, err, sizeof err) == MOE_OK);
    CHECKF(!strcmp(calls, "[{\"id\": \"call_1\", \"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"arguments\": "
                          "\"{\\\"city\\\": \\\"Paris\\\", \\\"days\\\": 3}\"}}, {\"id\": \"call_2\", \"type\": \"function\", "
                          "\"function\": {\"name\": \"a\\\"b\", \"arguments\": \"{}\"}}]"), "%s", calls);
    CHECK(moe_tokenize(k2, k2r, strlen(k2r), MOE_TOK_SPECIAL, got, 512, &ng, err, sizeof err) == MOE_OK);
    CHECK(moe_chat_tool_calls(k2, got, ng, NULL, calls, sizeof calls, &cl, err, sizeof err) == MOE_OK);
    CHECKF(!strcmp(calls, "[{\"id\": \"functions.get_weather:0\", \"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
                          "\"arguments\": \"{\\\"city\\\": \\\"Beijing\\\"}\"}}]"), "%s", calls);
    CHECK(moe_chat_tool_calls(k2, got, 1, NULL, calls, sizeof calls, &cl, err, sizeof err) == MOE_OK && !strcmp(calls, "[]"));
    CHECK(moe_chat_tool_calls(k2, got, ng, NULL, calls, 10, &cl, err, sizeof err) == MOE_ERR_RANGE && cl > 10);
    moe_tokenizer_free(k3), moe_tokenizer_free(k2);
}

/* Python's json.dumps formatting of numbers and strings, as the K2/K3 templates write tool JSON */
static void test_chat_json_dumps(void) {
    char ranks[600], err[300];
    tmp_path(ranks, sizeof ranks, "chat-tiny.tiktoken");
    write_tiny_ranks(ranks, "");
    moe_tokenizer *k3 = kimi_test_tokenizer(ranks, 256, 1);
    if (!k3) return;
    const char *req = "{\"messages\": [{\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"function\": {\"name\": \"f\", "
                      "\"arguments\": {\"a\": 1.0, \"b\": 1e16, \"c\": 0.0001, \"d\": 1e-05, \"e\": -0, \"f\": 123456789012345678901234567890,"
                      " \"g\": [1, {\"z\": \"\\u00e9\\n\\\"\", \"y\": null}], \"h\": 2.50, \"i\": 1E2, \"j\": true, \"k\": 0.1}}}]}]}";
    moe_chat_options o = moe_chat_default_options();
    o.thinking = 0, o.add_generation_prompt = 0;
    char text[4096];
    size_t tl;
    CHECKF(moe_chat_render(k3, req, strlen(req), &o, text, sizeof text, &tl, err, sizeof err) == MOE_OK, "%s", err);
    const char *want[] = {"key=\"a\" type=\"number\"<|sep|>1.0<", "key=\"b\" type=\"number\"<|sep|>1e+16<", "<|sep|>0.0001<", "<|sep|>1e-05<",
                          "key=\"e\" type=\"number\"<|sep|>0<", "<|sep|>123456789012345678901234567890<",
                          "type=\"array\"<|sep|>[1, {\"z\": \"\xc3\xa9\\n\\\"\", \"y\": null}]<", "<|sep|>2.5<", "<|sep|>100.0<",
                          "type=\"boolean\"<|sep|>true<", "<|sep|>0.1<"};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) CHECKF(strstr(text, want[i]) != NULL, "missing %s in %s", want[i], text);
    moe_tokenizer_free(k3);
}

/* ---- moe-batch ------------------------------------------------------------------------------- */

/* n completion requests with token-id prompts (the golden models ship no tokenizer), plus the
 * given extra lines */
static void write_batch_input(const char *path, int n, const char *extra) {
    FILE *f = fopen(path, "w");
    for (int i = 0; i < n; i++)
        fprintf(f, "{\"custom_id\": \"req-%d\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [467, 83, 739, %d, 546, 1030, 1074], "
                   "\"max_tokens\": %d, \"temperature\": %s, \"seed\": %d}}\n", i, i ? 10 + i : 806, 4 + i % 9, i % 3 ? "0.8" : "0", i);
    if (extra) fputs(extra, f);
    fclose(f);
}

/* checks OUT: every line whole JSON, keys (custom_id or input_line) unique; returns the number of
 * lines, or -1 when a check fails; the answer to want_id goes to text when asked */
static int check_batch_output(const char *path, const char *want_id, char *text, size_t tn) {
    size_t len = 0;
    char *all = read_all(path, &len);
    if (!all) return 0;
    int n = 0, bad = 0;
    char seen[256][48];
    for (char *p = all; *p;) {
        char *e = strchr(p, '\n');
        if (!e) { fprintf(stderr, "  %s: torn last line\n", path); bad = 1; break; }
        moe__json *j = NULL;
        if (moe__json_parse(p, (size_t)(e - p), &j, NULL, 0) != MOE_OK) { fprintf(stderr, "  %s: line %d is not JSON\n", path, n + 1); bad = 1; }
        else {
            const moe__json *cid = moe__json_get(j, "custom_id"), *ln = moe__json_get(j, "input_line");
            char key[48];
            snprintf(key, sizeof key, "%s", cid && cid->type == MOE_JSON_STR ? cid->str : "");
            if (ln) snprintf(key, sizeof key, "#%d", (int)ln->num);
            for (int i = 0; i < n && i < 256; i++)
                if (!strcmp(seen[i], key)) { fprintf(stderr, "  %s: %s answered twice\n", path, key); bad = 1; }
            if (n < 256) snprintf(seen[n], sizeof seen[n], "%s", key);
            if (want_id && !strcmp(key, want_id) && text) {
                const moe__json *r = moe__json_get(j, "response"), *b = r ? moe__json_get(r, "body") : NULL, *c = b ? moe__json_get(b, "choices") : NULL;
                const moe__json *t = c && c->child ? moe__json_get(c->child, "text") : NULL;
                snprintf(text, tn, "%s", t && t->type == MOE_JSON_STR ? t->str : "?");
            }
        }
        moe__json_free(j);
        n++;
        p = e + 1;
    }
    free(all);
    return bad ? -1 : n;
}

/* answers, errors for bad lines, rerun skips what is done, a torn last line is repaired,
 * duplicate custom_ids are refused, shards split the work */
/* req-0's golden prompt again, greedy: decoded in whichever slot frees up first */
static const char *shipped_dir(void);

/* the parsed answer to custom_id id in the output file at path (NULL: none); free with moe__json_free */
static moe__json *batch_answer(const char *path, const char *id) {
    size_t len = 0;
    char *all = read_all(path, &len), key[80];
    moe__json *j = NULL;
    snprintf(key, sizeof key, "\"custom_id\": \"%s\"", id);
    char *p = all ? strstr(all, key) : NULL;
    if (p) {
        while (p > all && p[-1] != '\n') p--;
        char *e = strchr(p, '\n');
        if (e && moe__json_parse(p, (size_t)(e - p), &j, NULL, 0) != MOE_OK) j = NULL;
    }
    free(all);
    return j;
}
static const moe__json *json_at(const moe__json *a, int i) {
    const moe__json *e = a && (a->type == MOE_JSON_ARR || a->type == MOE_JSON_OBJ) ? a->child : NULL;
    while (e && i-- > 0) e = e->next;
    return e;
}
/* an answer's body, and its choice i */
static const moe__json *answer_body(const moe__json *a) { return moe__json_get(moe__json_get(a, "response"), "body"); }
static const moe__json *answer_choice(const moe__json *a, int i) { return json_at(moe__json_get(answer_body(a), "choices"), i); }
/* a batch input file: remove out, write text to in */
static void batch_files(const char *in, const char *out, const char *text) {
    remove(out);
    FILE *f = fopen(in, "w");
    if (f) fputs(text, f), fclose(f);
}

/* moe-batch's "n": each choice decodes as a sequence of its own (more choices than slots: they
 * wait for slots like requests) from one computation of the prompt, the answer written once all
 * are done, the prompt counted once; greedy choices are the golden continuation, sampled ones
 * differ from each other, and the first draws as a request without "n" does */
static void test_batch_choices(void) {
    char in[600], out[600], cmd[2400], buf[8192];
    tmp_path(in, sizeof in, "n-in.jsonl");
    tmp_path(out, sizeof out, "n-out.jsonl");
    batch_files(in, out, "{\"custom_id\": \"g\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [467, 83, 739, 806, 546, 1030, 1074], "
                         "\"max_tokens\": 4, \"temperature\": 0, \"n\": 3}}\n"
                         "{\"custom_id\": \"s\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [5, 6], \"max_tokens\": 5, \"seed\": 9, \"n\": 4, \"logprobs\": 1}}\n"
                         "{\"custom_id\": \"zero\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [5, 6], \"n\": 0}}\n"
                         "{\"custom_id\": \"half\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [5, 6], \"n\": 2.5}}\n");
    snprintf(cmd, sizeof cmd, "%s/moe-batch -m %s/k3mx -i %s -o %s --parallel 2 2>&1", exe_dir, golden_dir(), in, out);
    CHECKF(run_cmd(cmd, buf, sizeof buf) == 0, "%s: %s", cmd, buf);
    CHECK(check_batch_output(out, NULL, NULL, 0) == 4);
    /* each prompt computed once, though the choices got their slots in several passes (7 + 2) */
    CHECKF(strstr(buf, " 9 prompt tokens computed"), "%s", buf);
    moe__json *a = batch_answer(out, "g");
    const moe__json *body = answer_body(a), *ch = moe__json_get(body, "choices");
    CHECK(ch && ch->n == 3);
    for (int i = 0; ch && i < ch->n; i++) {
        const moe__json *c = json_at(ch, i);
        CHECK((int)moe__json_get(c, "index")->num == i && !strcmp(moe__json_get(c, "text")->str, "555 1114 583 989"));
    }
    const moe__json *usage = moe__json_get(body, "usage");
    CHECK(usage && moe__json_get(usage, "prompt_tokens")->num == 7 && moe__json_get(usage, "completion_tokens")->num == 12);
    moe__json_free(a);
    a = batch_answer(out, "s");
    ch = moe__json_get(answer_body(a), "choices");
    char first[128] = "";
    int distinct = 0;
    CHECK(ch && ch->n == 4);
    for (int i = 0; ch && i < ch->n; i++) {
        const moe__json *c = json_at(ch, i);
        CHECK(moe__json_get(moe__json_get(c, "logprobs"), "token_logprobs")->n == 5);
        if (!i) snprintf(first, sizeof first, "%s", moe__json_get(c, "text")->str);
        int seen = 0;
        for (int j = 0; j < i; j++) seen |= !strcmp(moe__json_get(json_at(ch, j), "text")->str, moe__json_get(c, "text")->str);
        distinct += !seen;
    }
    CHECKF(distinct == 4, "%d distinct texts of 4", distinct);
    moe__json_free(a);
    size_t len = 0;
    char *all = read_all(out, &len);
    CHECK(all && strstr(all, "n must be a number in [1, 128]") && strstr(all, "n must be an integer"));
    free(all);
    /* g alone with room for its three choices: its prompt computed once */
    batch_files(in, out, "{\"custom_id\": \"g\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [467, 83, 739, 806, 546, 1030, 1074], "
                         "\"max_tokens\": 4, \"temperature\": 0, \"n\": 3}}\n");
    snprintf(cmd, sizeof cmd, "%s/moe-batch -m %s/k3mx -i %s -o %s --parallel 4 2>&1", exe_dir, golden_dir(), in, out);
    CHECKF(run_cmd(cmd, buf, sizeof buf) == 0 && strstr(buf, " 7 prompt tokens computed"), "%s", buf);
    a = batch_answer(out, "g");
    ch = moe__json_get(answer_body(a), "choices");
    for (int i = 0; i < 3; i++) CHECK(ch && ch->n == 3 && !strcmp(moe__json_get(json_at(ch, i), "text")->str, "555 1114 583 989"));
    moe__json_free(a);
    /* the same request without n, alone: choice 0's text */
    batch_files(in, out, "{\"custom_id\": \"s\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [5, 6], \"max_tokens\": 5, \"seed\": 9}}\n");
    snprintf(cmd, sizeof cmd, "%s/moe-batch -m %s/k3mx -i %s -o %s 2>&1", exe_dir, golden_dir(), in, out);
    CHECKF(run_cmd(cmd, buf, sizeof buf) == 0, "%s: %s", cmd, buf);
    char text[128] = "";
    check_batch_output(out, "s", text, sizeof text);
    CHECKF(!strcmp(text, first), "alone %s, first choice %s", text, first);
    remove(in), remove(out);
}

/* moe-batch's log probabilities: a greedy completion on a golden prompt gives each token's log
 * probability under the golden logits (log-softmax of the expected rows, within twice the
 * logits' tolerance), its best alternatives in order with the pick first, and offsets into the
 * text; a chat answer on the shipped model lists every sampled token with its bytes; bad
 * requests are refused; two threads give the same tokens and log probabilities within rounding
 * (the decode attention's split over threads rounds differently) */
static void test_batch_logprobs(void) {
    char in[600], out[600], out2[600], cmd[2400], buf[8192];
    tmp_path(in, sizeof in, "lp-in.jsonl");
    tmp_path(out, sizeof out, "lp-out.jsonl");
    tmp_path(out2, sizeof out2, "lp-out2.jsonl");
    batch_files(in, out, "{\"custom_id\": \"g\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [467, 83, 739, 806, 546, 1030, 1074], "
                         "\"max_tokens\": 4, \"temperature\": 0, \"logprobs\": 3}}\n"
                         "{\"custom_id\": \"h\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [5, 6], \"max_tokens\": 5, \"seed\": 9, \"logprobs\": 0}}\n"
                         "{\"custom_id\": \"echo\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [1], \"echo\": true, \"logprobs\": 1}}\n"
                         "{\"custom_id\": \"big\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [1], \"logprobs\": 21}}\n"
                         "{\"custom_id\": \"half\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [1], \"logprobs\": 1.5}}\n");
    remove(out2);
    snprintf(cmd, sizeof cmd, "%s/moe-batch -m %s/k3mx -i %s -o %s --parallel 2 2>&1", exe_dir, golden_dir(), in, out);
    CHECKF(run_cmd(cmd, buf, sizeof buf) == 0, "%s: %s", cmd, buf);
    golden g;
    if (!golden_load(&g, "k3mx")) return;
    const moe__st_tensor *want = moe__st_find(&g.ref, "p1.greedy_logits");
    moe__json *a = batch_answer(out, "g");
    const moe__json *lp = moe__json_get(answer_choice(a, 0), "logprobs");
    const moe__json *toks = moe__json_get(lp, "tokens"), *tlp = moe__json_get(lp, "token_logprobs"), *top = moe__json_get(lp, "top_logprobs"),
                    *off = moe__json_get(lp, "text_offset");
    CHECK(want && toks && tlp && top && off && toks->n == 4 && tlp->n == 4 && top->n == 4 && off->n == 4);
    if (want && toks && tlp && top && off && toks->n == 4 && tlp->n == 4 && top->n == 4 && off->n == 4) {
        const int V = (int)want->shape[1], greedy[4] = {555, 1114, 583, 989}, offsets[4] = {0, 4, 9, 13};
        double worst = 0;
        for (int i = 0; i < 4; i++) {
            const float *row = (const float *)want->data + (size_t)i * V;
            double mx = -INFINITY, sum = 0;
            for (int v = 0; v < V; v++) mx = row[v] > mx ? row[v] : mx;
            for (int v = 0; v < V; v++) sum += exp(row[v] - mx);
            const double expect = row[greedy[i]] - mx - log(sum), d = fabs(json_at(tlp, i)->num - expect);
            worst = d > worst ? d : worst;
            CHECKF(atoi(json_at(toks, i)->str) == greedy[i], "token %d: %s", i, json_at(toks, i)->str);
            CHECKF((int)json_at(off, i)->num == offsets[i], "offset %d: %g", i, json_at(off, i)->num);
            const moe__json *alts = json_at(top, i);
            CHECK(alts && alts->n == 3);
            for (int j = 0; alts && j < alts->n; j++) { /* the pick first (greedy), then in order, each its golden log probability */
                const moe__json *e = json_at(alts, j);
                CHECK(j > 0 || (atoi(e->key) == greedy[i] && e->num == json_at(tlp, i)->num));
                CHECK(j == 0 || e->num <= json_at(alts, j - 1)->num);
                const double ej = row[atoi(e->key)] - mx - log(sum);
                CHECKF(fabs(e->num - ej) <= 2 * g.tol, "token %d alternative %d: %g against %g", i, j, e->num, ej);
            }
        }
        CHECKF(worst <= 2 * g.tol, "log probabilities %.3g from the golden logits'", worst);
    }
    moe__json_free(a);
    a = batch_answer(out, "h"); /* sampled, no alternatives */
    lp = moe__json_get(answer_choice(a, 0), "logprobs");
    CHECK(lp && moe__json_get(lp, "token_logprobs")->n == 5 && moe__json_get(lp, "top_logprobs")->type == MOE_JSON_NULL);
    for (int i = 0; lp && i < 5; i++) CHECK(json_at(moe__json_get(lp, "token_logprobs"), i)->num <= 0);
    moe__json_free(a);
    size_t len = 0;
    char *all = read_all(out, &len);
    CHECK(all && strstr(all, "echo is not supported") && strstr(all, "logprobs must be a number in [0, 20]") && strstr(all, "logprobs must be an integer"));
    free(all);
    snprintf(cmd, sizeof cmd, "%s/moe-batch -m %s/k3mx -i %s -o %s --parallel 2 -t 2 2>&1", exe_dir, golden_dir(), in, out2);
    CHECKF(run_cmd(cmd, buf, sizeof buf) == 0, "%s: %s", cmd, buf);
    for (int k = 0; k < 2; k++) {
        moe__json *x = batch_answer(out, k ? "h" : "g"), *y = batch_answer(out2, k ? "h" : "g");
        const moe__json *cx = answer_choice(x, 0);
        const moe__json *cy = answer_choice(y, 0);
        CHECK(cx && cy && !strcmp(moe__json_get(cx, "text")->str, moe__json_get(cy, "text")->str));
        const moe__json *lx = moe__json_get(answer_choice(x, 0), "logprobs");
        const moe__json *ly = moe__json_get(answer_choice(y, 0), "logprobs");
        for (int i = 0; lx && ly && i < moe__json_get(lx, "token_logprobs")->n; i++)
            CHECK(fabs(json_at(moe__json_get(lx, "token_logprobs"), i)->num - json_at(moe__json_get(ly, "token_logprobs"), i)->num) < 1e-4);
        CHECK(lx && ly);
        moe__json_free(x), moe__json_free(y);
    }
    golden_free(&g);
    /* chat on the shipped model: an entry per sampled token, its bytes, two alternatives each */
    batch_files(in, out, "{\"custom_id\": \"c\", \"method\": \"POST\", \"url\": \"/v1/chat/completions\", \"body\": {\"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}], "
                         "\"max_tokens\": 6, \"logprobs\": true, \"top_logprobs\": 2, \"seed\": 3}}\n"
                         "{\"custom_id\": \"t\", \"method\": \"POST\", \"url\": \"/v1/chat/completions\", \"body\": {\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], \"top_logprobs\": 2}}\n");
    snprintf(cmd, sizeof cmd, "%s/moe-batch -m %s -i %s -o %s 2>&1", exe_dir, shipped_dir(), in, out);
    CHECKF(run_cmd(cmd, buf, sizeof buf) == 0, "%s: %s", cmd, buf);
    a = batch_answer(out, "c");
    const moe__json *body = answer_body(a);
    const moe__json *content = moe__json_get(moe__json_get(json_at(moe__json_get(body, "choices"), 0), "logprobs"), "content");
    const int gen = (int)moe__json_get(moe__json_get(body, "usage"), "completion_tokens")->num;
    CHECKF(content && content->n == gen && gen > 0, "%d entries for %d tokens", content ? content->n : -1, gen);
    for (int i = 0; content && i < content->n; i++) {
        const moe__json *e = json_at(content, i), *bytes = moe__json_get(e, "bytes"), *alts = moe__json_get(e, "top_logprobs");
        CHECK(moe__json_get(e, "logprob")->num <= 0 && bytes && bytes->n > 0 && alts && alts->n == 2 &&
              json_at(alts, 0)->n == 3 && moe__json_get(json_at(alts, 0), "logprob")->num >= moe__json_get(json_at(alts, 1), "logprob")->num &&
              moe__json_get(e, "logprob")->num <= moe__json_get(json_at(alts, 0), "logprob")->num);
        /* the bytes spell the token where they are whole UTF-8 */
        char tb[64];
        int nb = 0;
        for (const moe__json *x = bytes ? bytes->child : NULL; x && nb < 63; x = x->next) tb[nb++] = (char)(int)x->num;
        tb[nb] = 0;
        if (moe_utf8_valid_prefix(tb, (size_t)nb) == (size_t)nb) CHECKF(!strcmp(tb, moe__json_get(e, "token")->str), "entry %d: %s", i, tb);
    }
    moe__json_free(a);
    all = read_all(out, &len);
    CHECK(all && strstr(all, "top_logprobs needs logprobs: true"));
    free(all);
    remove(in), remove(out), remove(out2);
}

#define AGAIN(id) "{\"custom_id\": \"" id "\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [467, 83, 739, 806, 546, 1030, 1074], \"max_tokens\": 4, \"temperature\": 0}}\n"
static void test_batch_basic(void) {
    char in[600], out[600], cmd[2400], buf[8192], text[512];
    tmp_path(in, sizeof in, "batch-in.jsonl");
    tmp_path(out, sizeof out, "batch-out.jsonl");
    write_batch_input(in, 12,
                      "not json\n"
                      "{\"custom_id\": \"bad-url\", \"method\": \"POST\", \"url\": \"/v1/embeddings\", \"body\": {}}\n"
                      "{\"custom_id\": \"bad-utf8\", \"body\": \"\xff\"}\n"
                      "{\"custom_id\": \"too-long\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [1, 2], \"max_tokens\": 100000}}\n"
                      "{\"custom_id\": \"bad-id\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [1, 99999]}}\n"
                      "{\"custom_id\": \"chat\", \"method\": \"POST\", \"url\": \"/v1/chat/completions\", \"body\": {\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}}\n"
                      "\n"
                      "{\"method\": \"POST\"}\n"
                      "{\"custom_id\": \"big-seed\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [1], \"seed\": 1.5e62}}\n"
                      AGAIN("again-1") AGAIN("again-2") AGAIN("again-3"));
    remove(out);
    snprintf(cmd, sizeof cmd, "%s/moe-batch -m %s/k3mx -i %s -o %s --parallel 4 2>&1", exe_dir, golden_dir(), in, out);
    int rc = run_cmd(cmd, buf, sizeof buf);
    CHECKF(rc == 0, "%s: %d %s", cmd, rc, buf);
    int n = check_batch_output(out, "req-0", text, sizeof text);
    CHECKF(n == 12 + 11, "%d lines", n);
    /* req-0 is greedy on a golden prompt: the golden continuation, decoded among other sequences,
     * and so are its copies, each in the slot it got (each slot samples its own row of logits) */
    CHECKF(!strcmp(text, "555 1114 583 989"), "req-0: %s", text);
    for (int i = 1; i <= 3; i++) {
        char id[24];
        snprintf(id, sizeof id, "again-%d", i);
        check_batch_output(out, id, text, sizeof text);
        CHECKF(!strcmp(text, "555 1114 583 989"), "%s: %s", id, text);
    }
    size_t len = 0;
    char *all = read_all(out, &len);
    CHECK(all && strstr(all, "\"input_line\": 13") && strstr(all, "/v1/embeddings") == NULL && strstr(all, "not valid UTF-8") &&
          strstr(all, "do not fit the context") && strstr(all, "outside the vocabulary") && strstr(all, "no tokenizer") &&
          strstr(all, "\"finish_reason\": \"length\"") && strstr(all, "\"usage\": {\"prompt_tokens\": 7") &&
          strstr(all, "seed must be a 64-bit integer"));
    free(all);
    /* two threads (sampling side by side): the same answers */
    char out2[600], cmd2[2400], t1[512], t2[512];
    tmp_path(out2, sizeof out2, "batch-out-t2.jsonl");
    remove(out2);
    snprintf(cmd2, sizeof cmd2, "%s/moe-batch -m %s/k3mx -i %s -o %s --parallel 4 -t 2 2>&1", exe_dir, golden_dir(), in, out2);
    CHECKF(run_cmd(cmd2, buf, sizeof buf) == 0, "%s: %s", cmd2, buf);
    for (int i = 0; i < 12; i++) {
        char id[16];
        snprintf(id, sizeof id, "req-%d", i);
        t1[0] = t2[0] = 0;
        check_batch_output(out, id, t1, sizeof t1), check_batch_output(out2, id, t2, sizeof t2);
        CHECKF(t1[0] && !strcmp(t1, t2), "%s: %s with one thread, %s with two", id, t1, t2);
    }
    remove(out2);
    /* a rerun has nothing to do; a torn tail is cut off and that request answered again */
    CHECK(run_cmd(cmd, buf, sizeof buf) == 0 && strstr(buf, "0 to run"));
    all = read_all(out, &len);
    FILE *f = fopen(out, "w");
    fwrite(all, 1, len - 40, f); /* the last line loses its end */
    fclose(f);
    free(all);
    CHECK(run_cmd(cmd, buf, sizeof buf) == 0 && strstr(buf, "torn"));
    CHECK(check_batch_output(out, NULL, NULL, 0) == 12 + 11);
    /* shards: disjoint, together everything */
    char o0[600], o1[600];
    tmp_path(o0, sizeof o0, "batch-s0.jsonl");
    tmp_path(o1, sizeof o1, "batch-s1.jsonl");
    remove(o0), remove(o1);
    for (int s = 0; s < 2; s++) {
        snprintf(cmd, sizeof cmd, "%s/moe-batch -m %s/k3mx -i %s -o %s --shard %d/2 2>&1", exe_dir, golden_dir(), in, s ? o1 : o0, s);
        CHECK(run_cmd(cmd, buf, sizeof buf) == 0);
    }
    int a = check_batch_output(o0, NULL, NULL, 0), b = check_batch_output(o1, NULL, NULL, 0);
    CHECKF(a > 0 && b > 0 && a + b == 12 + 11, "shards %d + %d", a, b);
    /* duplicate custom_ids: refused before anything is written */
    write_batch_input(in, 3, "{\"custom_id\": \"req-1\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [1]}}\n");
    remove(out);
    snprintf(cmd, sizeof cmd, "%s/moe-batch -m %s/k3mx -i %s -o %s 2>&1", exe_dir, golden_dir(), in, out);
    CHECK(run_cmd(cmd, buf, sizeof buf) == 1 && strstr(buf, "appears twice"));
    struct stat sb;
    CHECK(stat(out, &sb) != 0 || sb.st_size == 0);
    snprintf(cmd, sizeof cmd, "%s/moe-batch -m %s/k3mx -i /nonexistent -o %s 2>/dev/null", exe_dir, golden_dir(), out);
    CHECK(run_cmd(cmd, buf, sizeof buf) == 1);
    snprintf(cmd, sizeof cmd, "%s/moe-batch -m x -i y 2>/dev/null", exe_dir);
    CHECK(run_cmd(cmd, buf, sizeof buf) == 2);
    snprintf(cmd, sizeof cmd, "%s/moe-batch -m x -i y -o z --shard 2/2 2>/dev/null", exe_dir);
    CHECK(run_cmd(cmd, buf, sizeof buf) == 2);
}

/* runs moe-batch in a child; kill_after_us > 0: SIGKILL it then; fsize > 0: RLIMIT_FSIZE with
 * SIGXFSZ ignored (the disk "fills up"). Returns the exit status, or -9 when killed. */
static int batch_child(const char *in, const char *out, long kill_after_us, long fsize) {
    char model[600];
    snprintf(model, sizeof model, "%s/k3mx", golden_dir());
    char exe[700];
    snprintf(exe, sizeof exe, "%s/moe-batch", exe_dir);
    pid_t pid = fork();
    if (pid == 0) {
        int devnull = open("/dev/null", O_WRONLY);
        if (devnull >= 0) dup2(devnull, 2);
        if (fsize > 0) {
            signal(SIGXFSZ, SIG_IGN);
            struct rlimit rl = {(rlim_t)fsize, (rlim_t)fsize};
            setrlimit(RLIMIT_FSIZE, &rl);
        }
        execl(exe, exe, "-m", model, "-i", in, "-o", out, "--parallel", "3", (char *)NULL);
        _exit(127);
    }
    if (kill_after_us > 0) {
        struct timespec ts = {kill_after_us / 1000000, (kill_after_us % 1000000) * 1000};
        nanosleep(&ts, NULL);
        kill(pid, SIGKILL);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    return WIFSIGNALED(st) ? -WTERMSIG(st) : WEXITSTATUS(st);
}

/* SIGKILL at random moments, then reruns: every request answered exactly once, no torn line;
 * a full disk (RLIMIT_FSIZE) stops the job with an error and no torn line, and a rerun
 * completes it */
static void test_batch_faults(void) {
    if (getenv("MOE_TEST_RUNNER")) return; /* forks the binary directly: not under qemu */
    char in[600], out[600];
    tmp_path(in, sizeof in, "batch-kill-in.jsonl");
    tmp_path(out, sizeof out, "batch-kill-out.jsonl");
    const int N = 40;
    write_batch_input(in, N, NULL);
    int kills = 0, runs = 0, rc = -1;
    for (int round = 0; round < 4; round++) {
        remove(out);
        for (runs = 0; runs < 200; runs++) {
            long delay = 2000 + (long)(urand() * 30000);
            rc = batch_child(in, out, runs < 12 ? delay : 0, 0);
            if (rc == -SIGKILL) kills++;
            CHECK(check_batch_output(out, NULL, NULL, 0) >= 0); /* after every kill: whole lines, no duplicates */
            if (rc == 0) break;
        }
        CHECKF(rc == 0 && check_batch_output(out, NULL, NULL, 0) == N, "round %d: rc %d, %d lines", round, rc, check_batch_output(out, NULL, NULL, 0));
    }
    CHECKF(kills > 0, "no run was killed: %d", kills);
    if (getenv("MOE_TEST_VERBOSE"))
        fprintf(stderr, "  batch faults: 4 jobs of %d requests, %d runs killed by SIGKILL, every request answered exactly once\n", N, kills);
    /* the output "disk" holds only about 3 answers */
    remove(out);
    rc = batch_child(in, out, 0, 1200);
    int n = check_batch_output(out, NULL, NULL, 0);
    CHECKF(rc == 1 && n >= 0 && n < N, "full disk: rc %d, %d lines", rc, n);
    struct stat sb;
    CHECK(stat(out, &sb) == 0 && sb.st_size <= 1200);
    rc = batch_child(in, out, 0, 0);
    CHECK(rc == 0 && check_batch_output(out, NULL, NULL, 0) == N);
}

/* ---- the shipped model (models/kimi-k3-tiny, trained by scripts/train.py) ------------------------ */

static const char *shipped_dir(void) {
    const char *d = getenv("MOE_SHIPPED_MODEL");
    return d ? d : "models/kimi-k3-tiny";
}

/* MOE_FLAG_MXFP4_INT8 on the shipped model (MXFP4 experts, trained: the random golden K3 model
 * amplifies any rounding into whole logits, Q8_0 experts as much as this): on the reference
 * tokens, with the routing pinned to the f32-input run's, the mean KL per token is the 8-bit
 * activations' (2.5e-5 measured on 7,606 tokens of text); the expert cache gives the mapping's
 * logits bit for bit */
static void test_shipped_mxfp4_int8(void) {
    size_t li = 0;
    int32_t *ids = (int32_t *)(void *)read_all("test/shipped/ref_ids.bin", &li);
    moe_options o = moe_default_options();
    o.n_threads = 2;
    moe_model *f = NULL, *q = NULL, *qc = NULL;
    CHECK(moe_model_open(&f, shipped_dir(), &o, NULL, 0) == MOE_OK);
    o.flags = MOE_FLAG_MXFP4_INT8;
    CHECK(moe_model_open(&q, shipped_dir(), &o, NULL, 0) == MOE_OK);
    o.expert_mode = MOE_EXPERTS_CACHE, o.expert_budget = 16 << 20;
    CHECK(moe_model_open(&qc, shipped_dir(), &o, NULL, 0) == MOE_OK);
    /* qd: every unit read with O_DIRECT, piece by piece (this model's w1, w2 and w3 lie apart):
     * each matrix's scales land aligned, away from its codes, and are moved next to them */
    moe_model *qd = NULL;
    CHECK(moe_model_open(&qd, shipped_dir(), &o, NULL, 0) == MOE_OK);
    moe__set_direct_min(qd, 1);
    if (ids && f && q && qc && qd) {
        const moe_config *c = moe_model_config(f);
        const int V = c->vocab_size, n = (int)(li / 4);
        int32_t *routes = malloc(sizeof(int32_t) * (size_t)n * c->n_layers * c->n_active);
        const int pieces[] = {n - 3, 1, 1, 1, 0};
        float *xf = logits_routed(f, ids, n, pieces, routes, NULL), *xq = logits_routed(q, ids, n, pieces, NULL, routes);
        float *xc = logits_routed(qc, ids, n, pieces, NULL, routes), *xd = logits_routed(qd, ids, n, pieces, NULL, routes);
        CHECK(xf && xq && xc && xd);
        if (xf && xq && xc && xd) {
            const double kl = mean_kl(xf, xq, n, V);
            if (getenv("MOE_TEST_VERBOSE")) printf("  MXFP4 int8 input: mean KL %.3g over %d tokens (routing pinned)\n", kl, n);
            CHECKF(kl > 0 && kl < 1e-3, "MXFP4 int8 vs f32 input: mean KL %.3g", kl);
            CHECKF(max_abs_diff(xq, xc, (size_t)n * V) == 0, "MXFP4 int8: cache vs mapping %.3g", max_abs_diff(xq, xc, (size_t)n * V));
            CHECKF(max_abs_diff(xq, xd, (size_t)n * V) == 0, "MXFP4 int8: O_DIRECT cache vs mapping %.3g", max_abs_diff(xq, xd, (size_t)n * V));
        }
        free(xf), free(xq), free(xc), free(xd), free(routes);
    }
    free(ids);
    moe_model_close(f), moe_model_close(q), moe_model_close(qc), moe_model_close(qd);
}

/* MOE_FLAG_ACT16 on the shipped model converted to GGUF with Q8_0 dense matrices (MLA's k_b and
 * v_b among them, which absorbed decode multiplies one head at a time): with the routing pinned
 * to the model as stored, on the reference tokens, in a prefill and single-token steps with
 * absorbed attention, the two-part input takes the mean KL well below the 8-bit input's
 * (measured 7.4e-5 against 2.0e-4 on 8,192 tokens of text, the rest being the weights'
 * rounding); and absorbed decode (k_b and v_b as Q8_0, one head at a time) gives the logits of
 * expanded decode (kv_b rebuilt in f32: exact input) within 1% of the 8-bit input's departure
 * (measured 0.3%; 3% with the single-token products' second part left out) */
static void test_shipped_act16(void) {
    char out[600], cmd[2400], buf[4096], err[300];
    tmp_path(out, sizeof out, "shipped-q8.gguf");
    remove(out);
    snprintf(cmd, sizeof cmd, "%s/moe-convert %s %s --dense q8_0 2>&1", exe_dir, shipped_dir(), out);
    CHECKF(run_cmd(cmd, buf, sizeof buf) == 0, "%s", buf);
    size_t li = 0;
    int32_t *ids = (int32_t *)(void *)read_all("test/shipped/ref_ids.bin", &li);
    moe_options o = moe_default_options();
    o.n_threads = 2, o.flags = MOE_FLAG_MLA_ABSORBED;
    moe_model *f = NULL, *q8 = NULL, *q16 = NULL, *e8 = NULL, *e16 = NULL;
    CHECK(moe_model_open(&f, shipped_dir(), &o, err, sizeof err) == MOE_OK);
    CHECKF(moe_model_open(&q8, out, &o, err, sizeof err) == MOE_OK, "%s", err);
    o.flags |= MOE_FLAG_ACT16;
    CHECKF(moe_model_open(&q16, out, &o, err, sizeof err) == MOE_OK, "%s", err);
    /* expanded attention multiplies the latents by kv_b rebuilt in f32 from k_b and v_b */
    o.flags = MOE_FLAG_MLA_EXPANDED | MOE_FLAG_ACT16;
    CHECKF(moe_model_open(&e16, out, &o, err, sizeof err) == MOE_OK, "%s", err);
    o.flags = MOE_FLAG_MLA_EXPANDED;
    CHECKF(moe_model_open(&e8, out, &o, err, sizeof err) == MOE_OK, "%s", err);
    if (ids && f && q8 && q16 && e8 && e16) {
        const moe_config *c = moe_model_config(f);
        const int V = c->vocab_size, n = (int)(li / 4);
        int32_t *routes = malloc(sizeof(int32_t) * (size_t)n * c->n_layers * c->n_active);
        const int pieces[] = {n - 8, 1, 1, 1, 1, 1, 1, 1, 1, 0};
        float *xf = logits_routed(f, ids, n, pieces, routes, NULL), *x8 = logits_routed(q8, ids, n, pieces, NULL, routes);
        float *x16 = logits_routed(q16, ids, n, pieces, NULL, routes);
        CHECK(xf && x8 && x16);
        if (xf && x8 && x16) {
            const double kl8 = mean_kl(xf, x8, n, V), kl16 = mean_kl(xf, x16, n, V);
            const double d8 = mean_kl(xf + (size_t)(n - 8) * V, x8 + (size_t)(n - 8) * V, 8, V);
            const double d16 = mean_kl(xf + (size_t)(n - 8) * V, x16 + (size_t)(n - 8) * V, 8, V);
            if (getenv("MOE_TEST_VERBOSE"))
                printf("  Q8_0 GGUF, routing pinned: mean KL %.3g with 8-bit input, %.3g with two parts (decode steps %.3g, %.3g)\n", kl8,
                       kl16, d8, d16);
            CHECKF(kl16 > 0 && kl16 < 0.6 * kl8 && d16 < 0.6 * d8, "act16: mean KL %.3g against 8-bit %.3g (decode %.3g, %.3g)", kl16, kl8, d16, d8);
            float *y8 = logits_routed(e8, ids, n, pieces, NULL, routes), *y16 = logits_routed(e16, ids, n, pieces, NULL, routes);
            const size_t off = (size_t)(n - 8) * V;
            const double a8 = y8 ? max_abs_diff(x8 + off, y8 + off, (size_t)8 * V) : -1, a16 = y16 ? max_abs_diff(x16 + off, y16 + off, (size_t)8 * V) : -1;
            if (getenv("MOE_TEST_VERBOSE")) printf("  decode, absorbed against expanded: max |dlogit| %.3g with 8-bit input, %.3g with two parts\n", a8, a16);
            CHECKF(a16 >= 0 && a16 < 0.01 * a8, "act16: absorbed decode off expanded by %.3g (8-bit input: %.3g)", a16, a8);
            free(y8), free(y16);
        }
        free(xf), free(x8), free(x16), free(routes);
    }
    free(ids);
    moe_model_close(f), moe_model_close(q8), moe_model_close(q16), moe_model_close(e8), moe_model_close(e16);
    remove(out);
}

/* The quality targets of the quantized formats, on text the shipped model never saw: the first
 * 2,048 ids of the held-out split (valid.bin of scripts/train-data.py), each model left to its
 * own routing, mean KL per token against the model as shipped (bf16 dense, MXFP4 experts).
 * Measured: Q8_0 dense 1.03e-3 with 8-bit input, 4.7e-4 with MOE_FLAG_ACT16; Q4_0 dense (LM
 * head Q8_0) 1.94e-2; MXFP4 experts on 8-bit input 2.0e-4. The bounds are the targets (Q8_0
 * 1e-3, Q4_0 2e-2) where they are met, and for the 8-bit Q8_0, which misses by 3%, 1.5e-3. */
static void test_shipped_quality(void) {
    size_t li = 0;
    int32_t *ids = (int32_t *)(void *)read_all("test/shipped/heldout_ids.bin", &li);
    const int n = (int)(li / 4);
    struct { const char *name; int dense; unsigned flags; double bound; } runs[] = {
        {"Q8_0 dense, 8-bit input", MOE_WTYPE_Q8_0, 0, 1.5e-3},
        {"Q8_0 dense, two-part input", MOE_WTYPE_Q8_0, MOE_FLAG_ACT16, 1e-3},
        {"Q4_0 dense", MOE_WTYPE_Q4_0, 0, 2e-2},
        {"MXFP4 experts, 8-bit input", MOE_WTYPE_ASIS, MOE_FLAG_MXFP4_INT8, 1e-3},
    };
    moe_options o = moe_default_options();
    o.n_threads = 2;
    moe_model *f = NULL;
    CHECK(n == 2048 && moe_model_open(&f, shipped_dir(), &o, NULL, 0) == MOE_OK);
    float *ref = f ? logits_routed(f, ids, n, NULL, NULL, NULL) : NULL; /* (opened only with the 2,048 ids) */
    moe_model_close(f);
    CHECK(ref != NULL);
    for (size_t r = 0; ref && r < sizeof runs / sizeof *runs; r++) {
        moe_model *q = NULL;
        o.dense_type = runs[r].dense, o.flags = runs[r].flags;
        CHECK(moe_model_open(&q, shipped_dir(), &o, NULL, 0) == MOE_OK);
        float *x = q ? logits_routed(q, ids, n, NULL, NULL, NULL) : NULL;
        CHECK(x != NULL);
        if (x) {
            const double kl = mean_kl(ref, x, n, moe_model_config(q)->vocab_size);
            if (getenv("MOE_TEST_VERBOSE")) printf("  %s: mean KL %.3g over %d held-out tokens\n", runs[r].name, kl, n);
            CHECKF(kl > 0 && kl < runs[r].bound, "%s: mean KL %.3g, bound %.3g", runs[r].name, kl, runs[r].bound);
        }
        free(x);
        moe_model_close(q);
    }
    free(ref), free(ids);
}

/* our logits against the PyTorch reference of the exported checkpoint (bf16 dense, MXFP4
 * experts), written by scripts/train.py into test/shipped */
static void test_shipped_reference(void) {
    size_t li = 0, ll = 0;
    char *ids = read_all("test/shipped/ref_ids.bin", &li), *want = read_all("test/shipped/ref_logits.bin", &ll);
    moe_model *m = NULL;
    char err[400];
    moe_options o = moe_default_options();
    CHECKF(moe_model_open(&m, shipped_dir(), &o, err, sizeof err) == MOE_OK, "%s", err);
    CHECK(ids && want);
    if (!m || !ids || !want) { free(ids), free(want), moe_model_close(m); return; }
    const int n = (int)(li / 4), V = moe_model_config(m)->vocab_size;
    CHECK(ll == (size_t)n * V * 4);
    float *lg = malloc(sizeof(float) * (size_t)n * V);
    moe_session *s = NULL;
    CHECK(moe_session_new(&s, m, n, err, sizeof err) == MOE_OK);
    moe_seq q = {.s = s, .tokens = (const int32_t *)ids, .n = n, .logits = lg, .logits_all = 1};
    CHECKF(moe_step(m, &q, 1, NULL, err, sizeof err) == MOE_OK, "%s", err);
    double d = max_abs_diff(lg, (const float *)want, (size_t)n * V);
    int same = 1;
    for (int t = 0; t < n; t++) {
        int a = 0, b = 0;
        for (int j = 1; j < V; j++) {
            if (lg[(size_t)t * V + j] > lg[(size_t)t * V + a]) a = j;
            if (((const float *)want)[(size_t)t * V + j] > ((const float *)want)[(size_t)t * V + b]) b = j;
        }
        same &= a == b;
    }
    if (getenv("MOE_TEST_VERBOSE")) fprintf(stderr, "  shipped model: max |dlogit| %.3g over %d positions\n", d, n);
    CHECKF(d < 1e-3 && same, "max |dlogit| %.3g, argmax %s", d, same ? "equal" : "differs");
    moe_session_free(s);
    free(lg), free(ids), free(want);
    /* its tokenizer: K3 markers, text round trip */
    moe_tokenizer *t = NULL;
    CHECKF(moe_tokenizer_for_model(&t, m, err, sizeof err) == MOE_OK, "%s", err);
    if (t) {
        CHECK(moe_chat_format_of(t) == MOE_CHAT_K3 && moe_tokenizer_n_ids(t) == V);
        const char *text = "In the beginning God created the heaven and the earth. 東京 ünïcödé";
        int32_t tid[256];
        size_t nt = 0, bl = 0;
        char back[256];
        CHECK(moe_tokenize(t, text, strlen(text), 0, tid, 256, &nt, err, sizeof err) == MOE_OK && nt < strlen(text) / 2);
        CHECK(moe_detokenize(t, tid, nt, back, sizeof back, &bl, err, sizeof err) == MOE_OK && bl == strlen(text) && !memcmp(back, text, bl));
        moe_tokenizer_free(t);
    }
    moe_model_close(m);
}

/* moe-cli on text: the same seed gives the same text, output is valid UTF-8, stop strings end
 * it without being printed, chat mode runs a turn from stdin */
static void test_shipped_cli(void) {
    char cmd[2400], a[8192], b[8192];
    snprintf(cmd, sizeof cmd, "%s/moe-cli -m %s -p 'In the beginning' -n 40 -s 7 --temp 0.9 --top-k 40 2>/dev/null", exe_dir, shipped_dir());
    CHECK(run_cmd(cmd, a, sizeof a) == 0 && run_cmd(cmd, b, sizeof b) == 0);
    CHECKF(!strcmp(a, b) && !strncmp(a, "In the beginning", 16) && strlen(a) > 60, "'%s' vs '%s'", a, b);
    CHECK(moe_utf8_valid_prefix(a, strlen(a)) == strlen(a));
    snprintf(cmd, sizeof cmd, "%s/moe-cli -m %s -p 'In the beginning' -n 40 -s 8 --temp 0.9 2>/dev/null", exe_dir, shipped_dir());
    CHECK(run_cmd(cmd, b, sizeof b) == 0 && strcmp(a, b)); /* another seed, another text */
    snprintf(cmd, sizeof cmd, "%s/moe-cli -m %s -p 'And God said' -n 60 --temp 0 --no-display-prompt --stop ' the' 2>/dev/null", exe_dir, shipped_dir());
    CHECK(run_cmd(cmd, a, sizeof a) == 0 && !strstr(a, " the") && strlen(a) < 200);
    snprintf(cmd, sizeof cmd, "%s/moe-cli -m %s -p 'And God said' -n 60 --temp 0 --no-display-prompt 2>/dev/null", exe_dir, shipped_dir());
    CHECK(run_cmd(cmd, b, sizeof b) == 0 && strstr(b, " the") && !strncmp(a, b, strlen(a) - 1));
    char in[600];
    tmp_path(in, sizeof in, "cli-stdin.txt");
    CHECK(write_all(in, "Hello there\n", 12));
    snprintf(cmd, sizeof cmd, "%s/moe-cli -m %s -cnv -n 8 --temp 0 -sys 'Be brief.' < %s 2>&1", exe_dir, shipped_dir(), in);
    CHECK(run_cmd(cmd, a, sizeof a) == 0 && strstr(a, "generated"));
    CHECK(write_all(in, "x\377y", 3));
    snprintf(cmd, sizeof cmd, "%s/moe-cli -m %s -n 4 < %s 2>&1", exe_dir, shipped_dir(), in);
    CHECK(run_cmd(cmd, a, sizeof a) == 1 && strstr(a, "UTF-8"));
    snprintf(cmd, sizeof cmd, "%s/moe-cli --help", exe_dir);
    CHECK(run_cmd(cmd, a, sizeof a) == 0 && strstr(a, "--chat-template") && strstr(a, "--stop"));
}

/* moe-perplexity on the shipped model against the same figures computed here through the
 * library: windows of 32 of the reference ids (-c 32: fresh sequences, the second halves
 * scored), Q8_0 at load against the model as stored, with the routing pinned too; the same
 * through a saved reference (--save-ref, --ref-logits); the whole stream as one window; text
 * through the model's tokenizer (-f); bad input and bad reference files refused */
static void test_shipped_perplexity(void) {
    char cmd[2400], out[4096], idsf[600], txt[600];
    size_t li = 0;
    int32_t *ids = (int32_t *)(void *)read_all("test/shipped/ref_ids.bin", &li);
    const int n = (int)(li / 4), W = 32;
    tmp_path(idsf, sizeof idsf, "ppl-ids.txt");
    FILE *fp = fopen(idsf, "w");
    for (int i = 0; ids && fp && i < n; i++) fprintf(fp, "%d ", (int)ids[i]);
    if (fp) fclose(fp);
    moe_options o = moe_default_options();
    o.n_threads = 2;
    moe_model *f = NULL, *q = NULL;
    CHECK(moe_model_open(&f, shipped_dir(), &o, NULL, 0) == MOE_OK);
    o.dense_type = MOE_WTYPE_Q8_0;
    CHECK(moe_model_open(&q, shipped_dir(), &o, NULL, 0) == MOE_OK);
    if (!ids || !f || !q || n != 2 * W) {
        CHECKF(0, "shipped model or ids (%d) missing", n);
        free(ids), moe_model_close(f), moe_model_close(q);
        return;
    }
    const moe_config *c = moe_model_config(f);
    const int V = c->vocab_size;
    double kl = 0, klf = 0, nll_r = 0, nll_t = 0;
    int agree = 0, scored = 0, predicted = 0;
    int32_t *routes = malloc(sizeof(int32_t) * (size_t)W * c->n_layers * c->n_active);
    for (int w = 0; w < n / W; w++) { /* each window's second half */
        const int32_t *wi = ids + w * W;
        float *xr = logits_routed(f, wi, W, NULL, routes, NULL), *xt = logits_routed(q, wi, W, NULL, NULL, NULL);
        float *xp = logits_routed(q, wi, W, NULL, NULL, routes);
        const size_t h = (size_t)(W / 2) * V;
        if (xr && xt && xp) kl += mean_kl(xr + h, xt + h, W / 2, V) * (W / 2), klf += mean_kl(xr + h, xp + h, W / 2, V) * (W / 2);
        for (int t = W / 2; xr && xt && xp && t < W; t++) {
            const float *a = xr + (size_t)t * V, *b = xt + (size_t)t * V;
            double ma = a[0], mb = b[0], za = 0, zb = 0;
            int ta = 0, tb = 0;
            for (int i = 1; i < V; i++) ma = fmax(ma, a[i]), mb = fmax(mb, b[i]), ta = a[i] > a[ta] ? i : ta, tb = b[i] > b[tb] ? i : tb;
            for (int i = 0; i < V; i++) za += exp(a[i] - ma), zb += exp(b[i] - mb);
            agree += ta == tb, scored++;
            if (t + 1 < W) nll_r -= a[wi[t + 1]] - ma - log(za), nll_t -= b[wi[t + 1]] - mb - log(zb), predicted++;
        }
        free(xr), free(xt), free(xp);
    }
    snprintf(cmd, sizeof cmd, "%s/moe-perplexity -m %s --tokens %s --dense q8_0 -c %d --ref-routing --json -t 2 2>&1", exe_dir, shipped_dir(),
             idsf, W);
    CHECKF(run_cmd(cmd, out, sizeof out) == 0, "%s", out);
    moe__json *j = NULL;
    CHECKF(moe__json_parse(out, strlen(out), &j, NULL, 0) == MOE_OK, "%s", out);
    const moe__json *jk = moe__json_get(j, "kl_mean"), *jf = moe__json_get(j, "kl_mean_ref_routing"), *jt = moe__json_get(j, "top1_agree");
    const moe__json *jr = moe__json_get(j, "ppl_ref"), *jp = moe__json_get(j, "ppl"), *js = moe__json_get(j, "scored"), *jw = moe__json_get(j, "windows");
    const double want_r = exp(nll_r / predicted), want_p = exp(nll_t / predicted);
    if (getenv("MOE_TEST_VERBOSE")) printf("  perplexity -c %d: %s  here: KL %.6g pinned %.6g top-1 %.6f ppl %.6f / %.6f\n", W, out, kl / scored,
                                           klf / scored, (double)agree / scored, want_r, want_p);
    CHECKF(jk && jf && jt && jr && jp && js && jw && (int)js->num == scored && (int)jw->num == 2 && kl > 0 &&
               fabs(jk->num - kl / scored) <= 1e-5 * kl / scored && fabs(jf->num - klf / scored) <= 1e-5 * klf / scored + 1e-12 &&
               fabs(jt->num - (double)agree / scored) < 1e-6 && fabs(jr->num - want_r) < 1e-5 * want_r && fabs(jp->num - want_p) < 1e-5 * want_p,
           "moe-perplexity %s against KL %.6g pinned %.6g top-1 %.6f ppl %.6f / %.6f over %d", out, kl / scored, klf / scored,
           (double)agree / scored, want_r, want_p, scored);
    moe__json_free(j), j = NULL;
    /* the reference saved, then standing in for the model: the same figures to the digit */
    char reff[600], first[4096];
    tmp_path(reff, sizeof reff, "ppl-ref.bin");
    snprintf(cmd, sizeof cmd, "%s/moe-perplexity -m %s --tokens %s --dense q8_0 -c %d --ref-routing --json -t 2 --save-ref %s 2>&1", exe_dir,
             shipped_dir(), idsf, W, reff);
    CHECKF(run_cmd(cmd, first, sizeof first) == 0, "%s", first);
    snprintf(cmd, sizeof cmd, "%s/moe-perplexity -m %s --ref-logits %s --dense q8_0 --ref-routing --json -t 2 2>&1", exe_dir, shipped_dir(), reff);
    CHECKF(run_cmd(cmd, out, sizeof out) == 0 && !strcmp(out, first), "saved reference: %s against %s", out, first);
    /* refused: a truncated file, one without routing for --ref-routing, another model's vocabulary */
    size_t rl = 0;
    char *rb = read_all(reff, &rl), bad[600];
    tmp_path(bad, sizeof bad, "ppl-bad.bin");
    if (rb) write_all(bad, rb, rl - 5);
    snprintf(cmd, sizeof cmd, "%s/moe-perplexity -m %s --ref-logits %s 2>&1", exe_dir, shipped_dir(), bad);
    CHECKF(run_cmd(cmd, out, sizeof out) == 1 && strstr(out, "truncated"), "%s", out);
    snprintf(cmd, sizeof cmd, "%s/moe-perplexity -m %s --tokens %s -c %d --save-ref %s 2>&1", exe_dir, shipped_dir(), idsf, W, bad);
    CHECKF(run_cmd(cmd, out, sizeof out) == 0, "%s", out);
    snprintf(cmd, sizeof cmd, "%s/moe-perplexity -m %s --ref-logits %s --ref-routing 2>&1", exe_dir, shipped_dir(), bad);
    CHECKF(run_cmd(cmd, out, sizeof out) == 1 && strstr(out, "no routing"), "%s", out);
    snprintf(cmd, sizeof cmd, "%s/moe-perplexity -m %s/kimi --ref-logits %s 2>&1", exe_dir, golden_dir(), reff);
    CHECKF(run_cmd(cmd, out, sizeof out) == 1 && strstr(out, "vocabulary"), "%s", out);
    free(rb), remove(bad), remove(reff);
    /* the whole stream: one window, every position */
    snprintf(cmd, sizeof cmd, "%s/moe-perplexity -m %s --tokens %s --dense q8_0 --json 2>&1", exe_dir, shipped_dir(), idsf);
    CHECKF(run_cmd(cmd, out, sizeof out) == 0 && moe__json_parse(out, strlen(out), &j, NULL, 0) == MOE_OK, "%s", out);
    js = moe__json_get(j, "scored"), jw = moe__json_get(j, "windows");
    CHECKF(js && jw && (int)js->num == n && (int)jw->num == 1, "%s", out);
    moe__json_free(j), j = NULL;
    /* text through the test model's tokenizer */
    tmp_path(txt, sizeof txt, "ppl.txt");
    const char *text = "In the beginning God created the heaven and the earth. And the earth was without form, and void.";
    write_all(txt, text, strlen(text));
    moe_tokenizer *tk = NULL;
    size_t nt = 0;
    int32_t tids[256];
    CHECK(moe_tokenizer_for_model(&tk, f, NULL, 0) == MOE_OK && moe_tokenize(tk, text, strlen(text), 0, tids, 256, &nt, NULL, 0) == MOE_OK);
    moe_tokenizer_free(tk);
    snprintf(cmd, sizeof cmd, "%s/moe-perplexity -m %s -f %s --dense q4_0 --json 2>&1", exe_dir, shipped_dir(), txt);
    CHECKF(run_cmd(cmd, out, sizeof out) == 0 && moe__json_parse(out, strlen(out), &j, NULL, 0) == MOE_OK, "%s", out);
    js = moe__json_get(j, "tokens"), jk = moe__json_get(j, "kl_mean");
    CHECKF(js && jk && (size_t)js->num == nt && jk->num > 0, "%s (%zu ids)", out, nt);
    moe__json_free(j), j = NULL;
    /* bad input: an id past the vocabulary, too few ids for the window, no such file, both inputs */
    fp = fopen(idsf, "w");
    if (fp) fprintf(fp, "1 2 3 %d 5\n", V), fclose(fp);
    snprintf(cmd, sizeof cmd, "%s/moe-perplexity -m %s --tokens %s 2>&1", exe_dir, shipped_dir(), idsf);
    CHECKF(run_cmd(cmd, out, sizeof out) == 1 && strstr(out, "past the vocabulary"), "%s", out);
    snprintf(cmd, sizeof cmd, "%s/moe-perplexity -m %s --tokens %s -c 4 2>&1", exe_dir, shipped_dir(), idsf);
    CHECKF(run_cmd(cmd, out, sizeof out) == 1 && strstr(out, "past the vocabulary"), "%s", out);
    fp = fopen(idsf, "w");
    if (fp) fprintf(fp, "1 2 3 4 5\n"), fclose(fp);
    snprintf(cmd, sizeof cmd, "%s/moe-perplexity -m %s --tokens %s -c 6 2>&1", exe_dir, shipped_dir(), idsf);
    CHECKF(run_cmd(cmd, out, sizeof out) == 1 && strstr(out, "need at least 6"), "%s", out);
    snprintf(cmd, sizeof cmd, "%s/moe-perplexity -m %s --tokens %s.missing 2>&1", exe_dir, shipped_dir(), idsf);
    CHECKF(run_cmd(cmd, out, sizeof out) == 1 && strstr(out, "missing"), "%s", out);
    snprintf(cmd, sizeof cmd, "%s/moe-perplexity -m %s --tokens %s -f %s 2>&1", exe_dir, shipped_dir(), idsf, txt);
    CHECKF(run_cmd(cmd, out, sizeof out) == 2, "%s", out);
    free(ids), free(routes);
    moe_model_close(f), moe_model_close(q);
    remove(idsf), remove(txt);
}

/* moe-bench on the shipped model: one JSON line per depth with every field the README lists, the
 * bandwidth it divides by within its probes' range, a deeper context reading more bytes a token */
static void test_shipped_bench(void) {
    char cmd[2400], out[8192];
    snprintf(cmd, sizeof cmd, "%s/moe-bench -m %s -t 1 --depth 0,6 -n 6 --prefill 4 --reps 1 2>/dev/null", exe_dir, shipped_dir());
    CHECKF(run_cmd(cmd, out, sizeof out) == 0, "%s", out);
    static const char *keys[] = {"model", "format", "threads", "membw_read_gbps", "decode_tok_s", "decode_bytes_per_token",
                                 "decode_roofline_frac", "prefill_tok_s", "prefill_peak_frac"};
    double bytes[2] = {0, 0};
    int lines = 0;
    for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n"), lines++) {
        moe__json *j = NULL;
        CHECKF(lines < 2 && moe__json_parse(line, strlen(line), &j, NULL, 0) == MOE_OK, "%s", line);
        if (!j) continue;
        for (size_t k = 0; k < sizeof keys / sizeof *keys; k++) CHECKF(moe__json_get(j, keys[k]), "%s: no %s", line, keys[k]);
        const moe__json *bw = moe__json_get(j, "membw_read_gbps"), *lo = moe__json_get(j, "membw_min_gbps"),
                        *hi = moe__json_get(j, "membw_max_gbps"), *tok = moe__json_get(j, "decode_tok_s"),
                        *frac = moe__json_get(j, "decode_roofline_frac"), *b = moe__json_get(j, "decode_bytes_per_token"),
                        *d = moe__json_get(j, "depth");
        CHECKF(bw && lo && hi && tok && frac && b && d && lo->num > 0 && lo->num <= bw->num * 1.0001 && bw->num <= hi->num * 1.0001 &&
                   tok->num > 0 && frac->num > 0 && (int)d->num == 6 * lines,
               "%s", line);
        if (b) bytes[lines] = b->num;
        moe__json_free(j);
    }
    CHECKF(lines == 2 && bytes[0] > 0 && bytes[1] > bytes[0], "%d lines, %.0f then %.0f bytes a token", lines, bytes[0], bytes[1]);
    snprintf(cmd, sizeof cmd, "%s/moe-bench -t 1 2>/dev/null", exe_dir);
    CHECK(run_cmd(cmd, out, sizeof out) == 2);
}

/* moe-batch with text and chat requests through the model's tokenizer */
static void test_shipped_batch(void) {
    char in[600], out[600], cmd[2400], buf[8192];
    tmp_path(in, sizeof in, "shipped-in.jsonl");
    tmp_path(out, sizeof out, "shipped-out.jsonl");
    const char *lines =
        "{\"custom_id\": \"c1\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": \"In the beginning\", \"max_tokens\": 12, \"temperature\": 0}}\n"
        "{\"custom_id\": \"c2\", \"method\": \"POST\", \"url\": \"/v1/chat/completions\", \"body\": {\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, "
        "{\"role\": \"user\", \"content\": \"Hello\"}], \"max_tokens\": 16, \"seed\": 1}}\n"
        "{\"custom_id\": \"c3\", \"method\": \"POST\", \"url\": \"/v1/chat/completions\", \"body\": {\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], "
        "\"max_tokens\": 16, \"reasoning_effort\": \"none\", \"stop\": [\"\\n\"]}}\n"
        "{\"custom_id\": \"c4\", \"method\": \"POST\", \"url\": \"/v1/chat/completions\", \"body\": {\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], "
        "\"reasoning_effort\": \"medium\"}}\n";
    CHECK(write_all(in, lines, strlen(lines)));
    remove(out);
    snprintf(cmd, sizeof cmd, "%s/moe-batch -m %s -i %s -o %s 2>&1", exe_dir, shipped_dir(), in, out);
    CHECKF(run_cmd(cmd, buf, sizeof buf) == 0, "%s", buf);
    char text[512];
    CHECK(check_batch_output(out, "c1", text, sizeof text) == 4);
    /* greedy completion = greedy moe-cli continuation */
    char cli[2400], want[4096];
    snprintf(cli, sizeof cli, "%s/moe-cli -m %s -p 'In the beginning' -n 12 --temp 0 --no-display-prompt 2>/dev/null", exe_dir, shipped_dir());
    CHECK(run_cmd(cli, want, sizeof want) == 0);
    size_t wl = strlen(want);
    if (wl && want[wl - 1] == '\n') want[--wl] = 0;
    CHECKF(!strcmp(text, want), "batch '%s' vs cli '%s'", text, want);
    size_t len;
    char *all = read_all(out, &len);
    CHECK(all && strstr(all, "\"object\": \"chat.completion\"") && strstr(all, "\"role\": \"assistant\"") && strstr(all, "low, high or max"));
    free(all);
}

/* llama.cpp's gpt2-style BPE over the GGUF's tokens and merges (an independent reading of what
 * moe-convert writes): GPT-2's byte symbols, the adjacent pair listed first in the merges joined
 * until none is listed, each symbol then looked up among the tokens */
typedef struct { const char *p; size_t n; } gstr;
static size_t gstr_hash(const char *p, size_t n) {
    size_t h = 2166136261u;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)p[i]) * 16777619u;
    return h;
}
typedef struct { gstr *s; int *slot; size_t mask; } gtable; /* strings -> their index */
static int gtable_init(gtable *t, const moe__gguf_kv *kv) {
    if (!kv || kv->type != MOE_GGUF_ARRAY || kv->etype != MOE_GGUF_STRING) return 0;
    size_t cap = 16;
    while (cap < 2 * kv->n) cap *= 2;
    t->s = malloc(sizeof *t->s * kv->n), t->slot = malloc(sizeof(int) * cap), t->mask = cap - 1;
    if (!t->s || !t->slot) return 0;
    for (size_t k = 0; k < cap; k++) t->slot[k] = -1;
    const uint8_t *p = kv->data;
    for (uint64_t i = 0; i < kv->n; i++) {
        uint64_t n;
        memcpy(&n, p, 8);
        t->s[i] = (gstr){(const char *)p + 8, (size_t)n};
        p += 8 + n;
        size_t k = gstr_hash(t->s[i].p, t->s[i].n) & t->mask;
        while (t->slot[k] >= 0) k = (k + 1) & t->mask;
        t->slot[k] = (int)i;
    }
    return 1;
}
static int gtable_find(const gtable *t, const char *p, size_t n) {
    for (size_t k = gstr_hash(p, n) & t->mask; t->slot[k] >= 0; k = (k + 1) & t->mask)
        if (t->s[t->slot[k]].n == n && !memcmp(t->s[t->slot[k]].p, p, n)) return t->slot[k];
    return -1;
}
static size_t gpt2_char(unsigned char b, char *out) { /* GPT-2's symbol for byte b, UTF-8 */
    unsigned cp = b;
    if (!((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE)) {
        unsigned k = 0;
        for (unsigned x = 0; x < b; x++) k += !((x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE);
        cp = 256 + k;
    }
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    out[0] = (char)(0xC0 | cp >> 6), out[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
}
/* ids of one piece into ids[]; the count, or -1 where a symbol is no token */
static long merges_bpe(const gtable *tokens, const gtable *merges, const char *piece, size_t n, int32_t *ids) {
    char *sym = malloc(2 * n + 1), *pair = malloc(4 * n + 2);
    size_t *at = malloc(sizeof(size_t) * (n + 1)), m = 0, ns = n;
    for (size_t i = 0; i < n; i++) at[i] = m, m += gpt2_char((unsigned char)piece[i], sym + m);
    at[n] = m;
    for (;;) {
        int best = -1;
        size_t bj = 0;
        for (size_t j = 0; j + 1 < ns; j++) {
            size_t a = at[j + 1] - at[j], b = at[j + 2] - at[j + 1];
            memcpy(pair, sym + at[j], a), pair[a] = ' ', memcpy(pair + a + 1, sym + at[j + 1], b);
            const int r = gtable_find(merges, pair, a + 1 + b);
            if (r >= 0 && (best < 0 || r < best)) best = r, bj = j;
        }
        if (best < 0) break;
        memmove(at + bj + 1, at + bj + 2, sizeof *at * (ns - bj - 1));
        ns--;
    }
    long out = (long)ns;
    for (size_t j = 0; j < ns && out >= 0; j++)
        if ((ids[j] = gtable_find(tokens, sym + at[j], at[j + 1] - at[j])) < 0) out = -1;
    free(sym), free(pair), free(at);
    return out;
}
static void check_gguf_merges(const char *path, const moe_tokenizer *t, const char *text, size_t len) {
    moe__st_file f;
    char err[300];
    CHECKF(moe__gguf_open(&f, path, err, sizeof err) == MOE_OK, "%s", err);
    gtable tokens = {0}, merges = {0};
    CHECK(gtable_init(&tokens, moe__gguf_get(&f, "tokenizer.ggml.tokens")) && gtable_init(&merges, moe__gguf_get(&f, "tokenizer.ggml.merges")));
    size_t *ends = malloc(sizeof(size_t) * (len + 1)), n = 0;
    int32_t *want = malloc(sizeof(int32_t) * (len + 1)), *got = malloc(sizeof(int32_t) * (len + 1));
    const long np = tokens.s && merges.s ? moe__pretokenize(MOE_PRETOK_KIMI, text, len, ends, len + 1) : -1;
    CHECK(np > 0 && moe_tokenize(t, text, len, 0, want, len + 1, &n, err, sizeof err) == MOE_OK);
    size_t k = 0, start = 0, bad = 0;
    for (long i = 0; i < np && !bad; i++) {
        const long m = merges_bpe(&tokens, &merges, text + start, ends[i] - start, got + k);
        if (m < 0) bad = 1;
        else k += (size_t)m;
        start = ends[i];
    }
    CHECKF(!bad && k == n && !memcmp(got, want, n * sizeof *got), "merges BPE: %zu ids against %zu", k, n);
    free(ends), free(want), free(got), free(tokens.s), free(tokens.slot), free(merges.s), free(merges.slot);
    moe__st_close(&f);
}

/* the shipped model converted to GGUF carries its vocabulary: same ids, same greedy text */
static void test_shipped_gguf_vocab(void) {
    char out[600], cmd[2400], a[4096], b[4096], err[300];
    tmp_path(out, sizeof out, "shipped.gguf");
    remove(out);
    snprintf(cmd, sizeof cmd, "%s/moe-convert %s %s 2>&1", exe_dir, shipped_dir(), out);
    CHECKF(run_cmd(cmd, a, sizeof a) == 0, "%s", a);
    moe_model *m1 = NULL, *m2 = NULL;
    moe_tokenizer *t1 = NULL, *t2 = NULL;
    moe_options o = moe_default_options();
    CHECK(moe_model_open(&m1, shipped_dir(), &o, err, sizeof err) == MOE_OK && moe_model_open(&m2, out, &o, err, sizeof err) == MOE_OK);
    if (m1 && m2) {
        CHECK(moe_tokenizer_for_model(&t1, m1, err, sizeof err) == MOE_OK);
        CHECKF(moe_tokenizer_for_model(&t2, m2, err, sizeof err) == MOE_OK, "%s", err);
    }
    size_t len = 0;
    char *text = read_all("test/tokenizer/corpus.txt", &len);
    if (t1 && t2 && text) {
        CHECK(moe_tokenizer_n_ids(t1) == moe_tokenizer_n_ids(t2) && moe_chat_format_of(t2) == MOE_CHAT_K3);
        int32_t *i1 = malloc(len * sizeof *i1), *i2 = malloc(len * sizeof *i2);
        size_t n1 = 0, n2 = 0;
        CHECK(moe_tokenize(t1, text, len, MOE_TOK_SPECIAL, i1, len, &n1, err, sizeof err) == MOE_OK);
        CHECK(moe_tokenize(t2, text, len, MOE_TOK_SPECIAL, i2, len, &n2, err, sizeof err) == MOE_OK);
        CHECK(n1 == n2 && !memcmp(i1, i2, n1 * sizeof *i1));
        free(i1), free(i2);
        check_gguf_merges(out, t1, text, len);
    }
    free(text);
    moe_tokenizer_free(t1), moe_tokenizer_free(t2);
    moe_model_close(m1), moe_model_close(m2);
    snprintf(cmd, sizeof cmd, "%s/moe-cli -m %s -p 'In the beginning' -n 16 --temp 0 2>/dev/null", exe_dir, shipped_dir());
    CHECK(run_cmd(cmd, a, sizeof a) == 0);
    snprintf(cmd, sizeof cmd, "%s/moe-cli -m %s -p 'In the beginning' -n 16 --temp 0 2>/dev/null", exe_dir, out);
    CHECK(run_cmd(cmd, b, sizeof b) == 0 && !strcmp(a, b));
    remove(out);
}

/* ---- GGUF --------------------------------------------------------------------------------------- */

/* runs moe-convert; prints its output when the exit status is not the expected one */
static int convert_expect(const char *model, const char *out, const char *args, int expect) {
    char cmd[2400], buf[4096];
    snprintf(cmd, sizeof cmd, "%s/moe-convert %s %s %s 2>&1", exe_dir, model, out, args);
    int rc = run_cmd(cmd, buf, sizeof buf);
    if (rc != expect) fprintf(stderr, "  %s -> %d: %s\n", cmd, rc, buf);
    return rc;
}
static int convert(const char *model, const char *out, const char *args) { return convert_expect(model, out, args, 0); }

/* golden checkpoints converted to GGUF (F32 dense, experts as stored: MXFP4 repacked) pass the
 * same golden checks as the directories */
static void test_gguf_golden(void) {
    const char *cases[] = {"kimi", "seed", "k3mx"};
    for (int i = 0; i < 3; i++) {
        char dir[600], out[600];
        snprintf(dir, sizeof dir, "%s/%s", golden_dir(), cases[i]);
        snprintf(out, sizeof out, "%s/%s.gguf", tmp_root, cases[i]);
        CHECK(convert(dir, out, "--dense f32") == 0);
        run_golden_path(cases[i], out, 0, 1);
        moe_model *m = open_path(out, 0, 1);
        if (m) CHECK(!strcmp(moe_model_get_info(m).format, "gguf"));
        moe_model_close(m);
        /* no tokenizer in the checkpoint: the file says so as llama.cpp needs to load it */
        moe__st_file f;
        char err[256];
        const moe_status fs = moe__gguf_open(&f, out, err, sizeof err);
        CHECKF(fs == MOE_OK, "%s", err);
        if (fs == MOE_OK) {
            const moe__gguf_kv *kv = moe__gguf_get(&f, "tokenizer.ggml.model");
            CHECK(kv && kv->type == MOE_GGUF_STRING && kv->n == 4 && !memcmp(kv->data, "none", 4));
            moe__st_close(&f);
        }
        remove(out);
    }
    /* --alignment 32 (for files ggml's writer will copy): the key says so and the tensors sit on 32 */
    char dir[600], out[600];
    snprintf(dir, sizeof dir, "%s/kimi", golden_dir());
    snprintf(out, sizeof out, "%s/kimi32.gguf", tmp_root);
    CHECK(convert(dir, out, "--dense f32 --alignment 32") == 0);
    CHECK(convert_expect(dir, out, "--dense f32 --alignment 48", 2) == 2);
    run_golden_path("kimi", out, 0, 1);
    moe__st_file f;
    char err[256];
    const moe_status fs = moe__gguf_open(&f, out, err, sizeof err);
    CHECKF(fs == MOE_OK, "%s", err);
    if (fs == MOE_OK) {
        const moe__gguf_kv *kv = moe__gguf_get(&f, "general.alignment");
        uint32_t al = 0;
        if (kv && kv->type == MOE_GGUF_U32) memcpy(&al, kv->data, 4);
        int off32 = 0;
        for (int t = 0; t < f.n_tensors; t++) off32 += ((const unsigned char *)f.tensors[t].data - (const unsigned char *)f.map) % 4096 != 0;
        CHECKF(al == 32 && off32 > 0, "alignment %u, %d tensors off 4 KB", al, off32);
        moe__st_close(&f);
    }
    remove(out);
}

/* mean |a - b| over n values */
static double mean_abs_diff(const float *a, const float *b, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++) s += fabs(a[i] - b[i]);
    return s / n;
}

/* quantized GGUF files load and run; MXFP4 experts are the same values; an interrupted
 * conversion resumes and produces the same bytes */
static void test_gguf_quant_resume(void) {
    char dir[600], a[600], b[600];
    snprintf(dir, sizeof dir, "%s/k3mx", golden_dir());
    snprintf(a, sizeof a, "%s/a.gguf", tmp_root);
    snprintf(b, sizeof b, "%s/b.gguf", tmp_root);
    CHECK(convert(dir, a, "--dense q8_0") == 0);
    setenv("MOE_CONVERT_STOP_AFTER", "57", 1);
    CHECK(convert_expect(dir, b, "--dense q8_0", 3) == 3); /* "crashed" after 57 tensors */
    unsetenv("MOE_CONVERT_STOP_AFTER");
    char partial[700];
    snprintf(partial, sizeof partial, "%s.partial", b);
    struct stat sb;
    CHECK(stat(partial, &sb) == 0 && stat(b, &sb) != 0);
    CHECK(convert(dir, b, "--dense q8_0") == 0);
    size_t la, lb;
    char *fa = read_all(a, &la), *fb = read_all(b, &lb);
    CHECK(fa && fb && la == lb && !memcmp(fa, fb, la));
    free(fa), free(fb);
    /* interleaved at load (default), used as mapped, or scalar: the kernels agree to float
     * summation order (quant_blocks checks them exactly). Through a model, activation rounding
     * turns 1-ulp differences into occasional one-step int8 differences, so whole-model logits
     * agree only to ~0.02 on average here (measured: 0.016-0.019 mean, 0.14-0.24 max). Checked on
     * the Kimi-Linear model with routing pinned to the first run's (the random models' own
     * routing margins after quantization are unknown; the K3 ones amplify far more). */
    {
        snprintf(dir, sizeof dir, "%s/kimi", golden_dir());
        CHECK(convert(dir, a, "--dense q8_0 --experts q4_0") == 0);
        /* r[3]: a repack budget the experts do not fit in: they stay mapped (row kernels) */
        moe_options ob = moe_default_options();
        ob.repack_budget = 1;
        moe_model *r[4] = {open_path(a, 0, 1), open_path(a, MOE_FLAG_NO_REPACK, 1), open_path(a, MOE_FLAG_FORCE_SCALAR, 2), NULL};
        CHECK(moe_model_open(&r[3], a, &ob, NULL, 0) == MOE_OK);
        CHECK(r[0] && moe_model_get_info(r[0]).experts_kept_mapped == 0);
        CHECK(r[3] && moe_model_get_info(r[3]).experts_kept_mapped == 1);
        int n;
        int32_t *ids = golden_ids("kimi", 2, &n);
        if (r[0] && r[1] && r[2] && r[3]) {
            const moe_config *c = moe_model_config(r[0]);
            const size_t nv = (size_t)n * c->vocab_size;
            float *x[4];
            int32_t *routes = malloc(sizeof(int32_t) * (size_t)n * c->n_layers * c->n_active);
            for (int k = 0; k < 4; k++) x[k] = logits_routed(r[k], ids, n, NULL, k == 0 ? routes : NULL, k == 0 ? NULL : routes);
            const double d1 = max_abs_diff(x[0], x[1], nv), d2 = max_abs_diff(x[0], x[2], nv), d3 = max_abs_diff(x[0], x[3], nv);
            const double m1 = mean_abs_diff(x[0], x[1], nv), m2 = mean_abs_diff(x[0], x[2], nv), m3 = mean_abs_diff(x[0], x[3], nv);
            CHECKF(d1 < 1.0 && d2 < 1.0 && m1 < 0.05 && m2 < 0.05, "repacked vs mapped: max %.3g mean %.3g; vs scalar: max %.3g mean %.3g", d1, m1, d2, m2);
            CHECKF(d3 < 1.0 && m3 < 0.05, "experts left mapped by the repack budget: max %.3g mean %.3g", d3, m3);
            /* the levels between scalar and the best (avx2 on an AVX-512 machine, avxvnni) */
            moe__kernels lv[MOE_KERNEL_LEVELS_MAX];
            const int nl = moe__kernel_levels(lv, MOE_KERNEL_LEVELS_MAX);
            for (int l = 1; l < nl - 1; l++) {
                moe_options ol = moe_default_options();
                ol.kernels = lv[l].isa;
                moe_model *ml = NULL;
                CHECK(moe_model_open(&ml, a, &ol, NULL, 0) == MOE_OK);
                if (ml) {
                    free(x[1]);
                    x[1] = logits_routed(ml, ids, n, NULL, NULL, routes);
                    const double dl = max_abs_diff(x[0], x[1], nv), ml1 = mean_abs_diff(x[0], x[1], nv);
                    CHECKF(dl < 1.0 && ml1 < 0.05, "%s kernels vs %s: max %.3g mean %.3g", lv[l].isa, lv[nl - 1].isa, dl, ml1);
                }
                moe_model_close(ml);
            }
            free(x[0]), free(x[1]), free(x[2]), free(x[3]), free(routes);
        }
        free(ids);
        for (int k = 0; k < 4; k++) moe_model_close(r[k]);
    }
    /* a q8_0 file runs; on the Kimi-Linear golden model, with the reference's routing (random
     * tiny models flip near-tie experts on any change), its KL to the original stays small */
    moe_model *q = NULL, *ref = open_model("kimi", 0, 1);
    snprintf(dir, sizeof dir, "%s/kimi", golden_dir());
    if (convert(dir, a, "--dense q8_0") == 0) q = open_path(a, 0, 1);
    if (q && ref) {
        int n;
        int32_t *ids = golden_ids("kimi", 3, &n);
        const int V = moe_model_config(q)->vocab_size, L = moe_model_config(q)->n_layers, K = moe_model_config(q)->n_active;
        float *l1 = malloc(sizeof(float) * (size_t)V * n), *l2 = malloc(sizeof(float) * (size_t)V * n);
        int32_t *routes = malloc(sizeof(int32_t) * (size_t)n * L * K);
        moe_session *s1 = NULL, *s2 = NULL;
        CHECK(moe_session_new(&s1, ref, n, NULL, 0) == MOE_OK && moe_session_new(&s2, q, n, NULL, 0) == MOE_OK);
        moe_seq q1 = {.s = s1, .tokens = ids, .n = n, .logits = l1, .logits_all = 1, .routes = routes};
        moe_seq q2 = {.s = s2, .tokens = ids, .n = n, .logits = l2, .logits_all = 1, .force_routes = routes};
        CHECK(moe_step(ref, &q1, 1, NULL, NULL, 0) == MOE_OK && moe_step(q, &q2, 1, NULL, NULL, 0) == MOE_OK);
        const double kl = mean_kl(l1, l2, n, V);
        CHECKF(kl < 5e-3, "q8_0 GGUF vs original with the same routing: mean KL %.3g", kl);
        if (getenv("MOE_TEST_VERBOSE")) fprintf(stderr, "  kimi q8_0 GGUF: mean KL with reference routing %.3g\n", kl);
        moe_session_free(s1), moe_session_free(s2);
        free(l1), free(l2), free(routes), free(ids);
    }
    moe_model_close(q);
    moe_model_close(ref);
    remove(a), remove(b);
}

/* GGUF files in the other ggml formats (the shipped model, hidden size 256: Q2_K .. Q6_K and
 * IQ4_XS rows, with llama.cpp's fallbacks where a row is 128 values) load and run: the logits as stored
 * against the same file with every matrix decoded to f32 at load (moe_options dense_type and
 * expert_type F32: the decoder's exact values, f32 activations), routing pinned to the latter's;
 * the same logits bit for bit with the matrices left in the mapping (MOE_FLAG_NO_REPACK; where
 * no Q8_0 is interleaved) and with the experts read from the file by the expert cache */
static void test_gguf_kquants(void) {
    static const char *const mixes[5][2] = {{"--dense q4_k --experts q4_1", "q4_1"}, {"--dense q5_k --experts q5_1", "q5_1"}, {"--dense q6_k --experts q5_0", "q5_0"},
                                            {"--dense q3_k --experts q2_k", "iq4_nl"}, {"--dense iq4_xs --experts iq4_nl", "iq4_nl"}};
    int32_t ids[48];
    for (int i = 0; i < 48; i++) ids[i] = (int32_t)(urand() * 4096);
    for (int k = 0; k < 5; k++) {
        char out[600], err[300];
        tmp_path(out, sizeof out, "kq.gguf");
        CHECK(convert(shipped_dir(), out, mixes[k][0]) == 0);
        moe_options o = moe_default_options();
        o.n_threads = 2;
        moe_model *q = NULL, *f = NULL;
        CHECKF(moe_model_open(&q, out, &o, err, sizeof err) == MOE_OK, "%s", err);
        o.dense_type = MOE_WTYPE_F32, o.expert_type = MOE_WTYPE_F32;
        CHECKF(moe_model_open(&f, out, &o, err, sizeof err) == MOE_OK, "%s", err);
        if (q && f) {
            /* the format holding the most bytes: the experts' (with Q2_K experts their IQ4_NL down
             * rows of 128 values, with the dense matrices' fallbacks) */
            CHECKF(!strcmp(moe_model_get_info(q).weight_type, mixes[k][1]), "%s: weight type %s", mixes[k][0], moe_model_get_info(q).weight_type);
            const moe_config *c = moe_model_config(q);
            const size_t nv = (size_t)48 * c->vocab_size;
            int32_t *routes = malloc(sizeof(int32_t) * 48 * c->n_layers * c->n_active);
            float *lf = logits_routed(f, ids, 48, NULL, routes, NULL), *lq = logits_routed(q, ids, 48, NULL, NULL, routes);
            double spread = 0;
            for (size_t i = 0; i < nv; i++) spread += fabs(lf[i]);
            const double d = max_abs_diff(lf, lq, nv), m = mean_abs_diff(lf, lq, nv);
            printf("  %s: mean |logit| %.3g, against f32-decoded: max %.3g mean %.3g\n", mixes[k][0], spread / nv, d, m);
            CHECKF(m < 0.02 * spread / nv && d < 0.5, "%s: max %.3g mean %.3g", mixes[k][0], d, m);
            for (int v = 0; v < 2; v++) {
                moe_options ov = moe_default_options();
                ov.n_threads = 2;
                if (v == 0) ov.flags = MOE_FLAG_NO_REPACK;
                else ov.expert_mode = MOE_EXPERTS_CACHE, ov.expert_budget = 1 << 20;
                moe_model *mv = NULL;
                CHECKF(moe_model_open(&mv, out, &ov, err, sizeof err) == MOE_OK, "%s", err);
                float *lv = mv ? logits_routed(mv, ids, 48, NULL, NULL, routes) : NULL;
                /* (q6_k's Q8_0 fallbacks are interleaved when repacked: their kernels agree to
                 * float summation order, which int8 activations make up to one step) */
                const double lim = v == 0 && k == 2 ? 0.5 : 0;
                CHECKF(lv && max_abs_diff(lq, lv, nv) <= lim, "%s: %s differs", mixes[k][0], v ? "the expert cache" : "left mapped");
                free(lv), moe_model_close(mv);
            }
            free(routes), free(lf), free(lq);
        }
        moe_model_close(q), moe_model_close(f);
        if (k == 3) { /* the embedding's Q3_K made TQ1_0 (ternary; sized, not read): a clean refusal naming it */
            size_t len;
            char *b = read_all(out, &len);
            const char *nm = "token_embd.weight";
            char *at = NULL;
            for (size_t i = 0; b && !at && i + 17 < len; i++)
                if (!memcmp(b + i, nm, 17)) at = b + i;
            if (at) {
                uint32_t nd, type;
                memcpy(&nd, at + 17, 4);
                char *tp = at + 17 + 4 + 8 * (size_t)nd;
                memcpy(&type, tp, 4);
                CHECK(nd == 2 && type == 11); /* Q3_K */
                type = 34;
                memcpy(tp, &type, 4);
                write_all(out, b, len);
                moe_model *bad = NULL;
                const moe_status st = moe_model_open(&bad, out, NULL, err, sizeof err);
                CHECKF(st == MOE_ERR_UNSUPPORTED && strstr(err, "token_embd") && strstr(err, "IQ4_XS"), "%d: %s", st, err);
                if (!st) moe_model_close(bad);
            }
            CHECK(at != NULL);
            free(b);
        }
        remove(out);
    }
}


/* a random-model shape for moe-convert --random: 3 layers (one MLA), hidden size 256, 8 experts
 * of n_ff_exp; returns whether it was written */
static int write_small_shape(const char *path, int n_ff_exp) {
    char js[600];
    snprintf(js, sizeof js,
             "{\"n_vocab\": 512, \"n_embd\": 256, \"n_layer\": 3, \"layer_types\": {\"mla_layers\": [2]},"
             " \"kda\": {\"n_head\": 2, \"head_dim\": 128}, \"mla\": {\"n_head\": 2, \"kv_lora_rank\": 128,"
             " \"qk_nope_head_dim\": 64, \"qk_rope_head_dim\": 32, \"v_head_dim\": 64}, \"ffn\": {\"n_layer_dense_lead\": 1,"
             " \"dense_n_ff\": 512, \"n_expert\": 8, \"n_expert_used\": 2, \"n_expert_shared\": 1, \"n_ff_exp\": %d}}",
             n_ff_exp);
    return write_all(path, js, strlen(js));
}

/* Routed experts in the k-quant formats and IQ4_XS read into the expert cache are interleaved as
 * they are read (where the kernel level has the interleaved kernels; all but Q2_K and Q6_K take
 * a little more room so, each matrix of the unit moving along), and give the mapping's logits bit
 * for bit, in prefill and decode, as do the row kernels over the experts as stored
 * (MOE_FLAG_NO_REPACK) */
static void test_cache_kquants(void) {
    char shape[600], out[600], err[300];
    tmp_path(shape, sizeof shape, "kq-shape.json");
    tmp_path(out, sizeof out, "kq-random.gguf");
    CHECK(write_small_shape(shape, 384));
    const char *types[5] = {"q4_k", "q3_k", "iq4_xs", "q2_k", "q6_k"}; /* (Q5_K's layout is Q4_K's, with high bits) */
    const int ttype[5] = {MOE_T_Q4_K, MOE_T_Q3_K, MOE_T_IQ4_XS, MOE_T_Q2_K, MOE_T_Q6_K};
    moe__kernels kn;
    moe__kernels_init(&kn, 0);
    int32_t ids[20];
    for (int i = 0; i < 20; i++) ids[i] = (int32_t)(urand() * 512);
    const int pieces[] = {12, 1, 1, 1, 1, 1, 1, 1, 1, 0}; /* a prompt, then decode steps */
    for (int t = 0; t < 5; t++) {
        char model[700], args[100];
        snprintf(model, sizeof model, "--random %s", shape);
        snprintf(args, sizeof args, "--dense q8_0 --experts %s", types[t]);
        if (convert(model, out, args)) { CHECKF(0, "%s: convert", types[t]); continue; }
        float *l[4] = {NULL, NULL, NULL, NULL};
        uint64_t kx8[4] = {0, 0, 0, 0};
        for (int v = 0; v < 4; v++) { /* mapped (interleaved at load), cached; both as stored */
            moe_options o = moe_default_options();
            o.n_threads = 2;
            if (v % 2) o.expert_mode = MOE_EXPERTS_CACHE, o.expert_budget = 1 << 20; /* a few experts: misses and evictions */
            if (v >= 2) o.flags = MOE_FLAG_NO_REPACK;
            moe_model *m = NULL;
            CHECKF(moe_model_open(&m, out, &o, err, sizeof err) == MOE_OK, "%s: %s", types[t], err);
            if (!m) continue;
            l[v] = logits_in_pieces(m, ids, 20, pieces);
            kx8[v] = moe__expert_kx8_count(m);
            moe_model_close(m);
        }
        const size_t nv = (size_t)20 * 512;
        for (int v = 1; v < 4; v += 2)
            CHECKF(l[v - 1] && l[v] && max_abs_diff(l[v - 1], l[v], nv) == 0, "%s: the cache%s differs by %.3g", types[t], v == 3 ? " as stored" : "",
                   l[v - 1] && l[v] ? max_abs_diff(l[v - 1], l[v], nv) : -1.0);
        const int has = kn.dotq8[moe__x8_of(ttype[t])] != NULL;
        CHECKF(has ? kx8[1] > 0 : kx8[1] == 0, "%s: %llu matrices interleaved in the cache (level %s)", types[t], (unsigned long long)kx8[1], kn.isa);
        CHECK(kx8[3] == 0);
        for (int v = 0; v < 4; v++) free(l[v]);
        remove(out);
    }
    remove(shape);
}

/* GGUF files with routed experts (and, once, dense matrices) in the grid formats, written by
 * moe-convert --random as random blocks: mapped and through the expert cache give the same
 * logits; against the same file decoded to F32 at load (routes pinned) they differ only by the
 * int8 activations; the scalar kernels agree with the level's to summation order (which can move
 * an activation across an int8 step, and that step carries on through the layers and tokens:
 * with every dense matrix IQ3_XXS, 1% of the mean logit on average, against 100% for a wrong
 * kernel). */
static void test_gguf_iq(void) {
    char shape[600], out[600], err[300];
    tmp_path(shape, sizeof shape, "iq-shape.json");
    tmp_path(out, sizeof out, "iq-random.gguf");
    CHECK(write_small_shape(shape, 512));
    int32_t ids[20];
    for (int i = 0; i < 20; i++) ids[i] = (int32_t)(urand() * 512);
    const int pieces[] = {12, 1, 1, 1, 1, 1, 1, 1, 1, 0};
    const size_t nv = (size_t)20 * 512;
    for (int t = 0; t <= N_IQ; t++) {
        char model[700], args[100];
        snprintf(model, sizeof model, "--random %s", shape);
        if (t < N_IQ) snprintf(args, sizeof args, "--dense q8_0 --experts %s", iq_names[t]);
        else snprintf(args, sizeof args, "--dense iq3_xxs --experts iq2_s");
        if (convert(model, out, args)) { CHECKF(0, "%s: convert", args); continue; }
        moe_model *m[4] = {NULL, NULL, NULL, NULL};
        for (int v = 0; v < 4; v++) { /* mapped; cached; decoded to F32 at load; scalar kernels */
            moe_options o = moe_default_options();
            o.n_threads = 2;
            if (v == 1) o.expert_mode = MOE_EXPERTS_CACHE, o.expert_budget = 1 << 20;
            if (v == 2) o.dense_type = MOE_WTYPE_F32, o.expert_type = MOE_WTYPE_F32;
            if (v == 3) o.flags = MOE_FLAG_FORCE_SCALAR;
            CHECKF(moe_model_open(&m[v], out, &o, err, sizeof err) == MOE_OK, "%s: %s", args, err);
        }
        if (m[0] && m[1] && m[2] && m[3]) {
            const moe_config *c = moe_model_config(m[0]);
            int32_t *routes = malloc(sizeof(int32_t) * 20 * c->n_layers * c->n_active);
            float *l0 = logits_routed(m[0], ids, 20, pieces, routes, NULL), *l1 = logits_in_pieces(m[1], ids, 20, pieces);
            float *lf = logits_routed(m[2], ids, 20, pieces, NULL, routes), *ls = logits_routed(m[3], ids, 20, pieces, NULL, routes);
            double spread = 0;
            for (size_t i = 0; i < nv; i++) spread += fabs(lf[i]);
            const double dc = max_abs_diff(l0, l1, nv), df = max_abs_diff(l0, lf, nv), mf = mean_abs_diff(l0, lf, nv);
            const double ds = max_abs_diff(l0, ls, nv), ms = mean_abs_diff(l0, ls, nv), mean = spread / nv;
            printf("  %s: mean |logit| %.3g; cache %.3g, f32-decoded max %.3g mean %.3g, scalar max %.3g mean %.3g\n", args, mean, dc, df, mf, ds, ms);
            CHECKF(dc == 0, "%s: the expert cache differs by %.3g", args, dc);
            CHECKF(mf < 0.04 * mean && df < 0.25 * mean, "%s: against f32-decoded max %.3g mean %.3g", args, df, mf);
            CHECKF(ms < 0.02 * mean && ds < 0.15 * mean, "%s: the scalar kernels differ by max %.3g mean %.3g", args, ds, ms);
            free(routes), free(l0), free(l1), free(lf), free(ls);
        }
        for (int v = 0; v < 4; v++) moe_model_close(m[v]);
        remove(out);
    }
    remove(shape);
}

/* a GGUF split into parts (moe-convert --split-max-size: llama.cpp's names and split keys) opens
 * from any part's path, in both expert modes, and passes the golden checks; an interrupted split
 * conversion resumes to the same bytes; a missing, misnamed or inconsistent part is a clean error */
static void split_part(char *out, size_t n, const char *prefix, int k, int parts) {
    snprintf(out, n, "%s-%05d-of-%05d.gguf", prefix, k, parts);
}
static int split_parts(const char *prefix) { /* how many parts were written (0: none) */
    char path[700];
    struct stat sb;
    for (int n = 2; n < 1000; n++) {
        split_part(path, sizeof path, prefix, 1, n);
        if (stat(path, &sb) == 0) return n;
    }
    return 0;
}
static void remove_split(const char *prefix, int parts) {
    char path[700];
    for (int k = 1; k <= parts; k++) split_part(path, sizeof path, prefix, k, parts), remove(path);
}
static void test_gguf_split(void) {
    char dir[600], out[600], prefix[600], first[700], mid[700], other[700], err[400];
    snprintf(dir, sizeof dir, "%s/k3mx", golden_dir());
    snprintf(out, sizeof out, "%s/sp.gguf", tmp_root);
    snprintf(prefix, sizeof prefix, "%s/sp", tmp_root);
    CHECK(convert(dir, out, "--dense f32 --split-max-size 256K") == 0);
    const int parts = split_parts(prefix);
    CHECKF(parts >= 4, "%d parts", parts);
    if (parts < 4) return;
    split_part(first, sizeof first, prefix, 1, parts);
    split_part(mid, sizeof mid, prefix, parts / 2, parts);
    run_golden_path("k3mx", first, 0, 1);
    /* from a middle part's path, and streamed through the expert cache: the same logits */
    moe_options oc = moe_default_options();
    oc.expert_mode = MOE_EXPERTS_CACHE, oc.expert_budget = 1 << 20;
    /* and with the metadata alone in the first part (gguf-split --no-tensor-first-split) */
    char outm[600], prefixm[600], firstm[700];
    snprintf(outm, sizeof outm, "%s/sm.gguf", tmp_root);
    snprintf(prefixm, sizeof prefixm, "%s/sm", tmp_root);
    CHECK(convert(dir, outm, "--dense f32 --no-tensor-first-split") == 0);
    CHECK(split_parts(prefixm) == 2);
    split_part(firstm, sizeof firstm, prefixm, 1, 2);
    moe_model *m[4] = {open_path(first, 0, 1), open_path(mid, 0, 1), NULL, open_path(firstm, 0, 1)};
    CHECK(moe_model_open(&m[2], mid, &oc, NULL, 0) == MOE_OK);
    int n;
    int32_t *ids = golden_ids("k3mx", 2, &n);
    if (m[0] && m[1] && m[2] && m[3] && ids) {
        CHECK(moe_model_get_info(m[1]).n_files == parts);
        const size_t nv = (size_t)n * moe_model_config(m[0])->vocab_size;
        float *x[4];
        for (int i = 0; i < 4; i++) x[i] = logits_in_pieces(m[i], ids, n, NULL);
        CHECK(max_abs_diff(x[0], x[1], nv) == 0);
        CHECKF(max_abs_diff(x[0], x[2], nv) == 0, "cache mode: %.3g", max_abs_diff(x[0], x[2], nv));
        CHECK(max_abs_diff(x[0], x[3], nv) == 0);
        for (int i = 0; i < 4; i++) free(x[i]);
    }
    free(ids);
    for (int i = 0; i < 4; i++) moe_model_close(m[i]);
    remove_split(prefixm, 2);
    /* interrupted after 40 tensors, then resumed: every part the same bytes */
    char out2[600], prefix2[600];
    snprintf(out2, sizeof out2, "%s/sq.gguf", tmp_root);
    snprintf(prefix2, sizeof prefix2, "%s/sq", tmp_root);
    setenv("MOE_CONVERT_STOP_AFTER", "40", 1);
    CHECK(convert_expect(dir, out2, "--dense f32 --split-max-size 256K", 3) == 3);
    unsetenv("MOE_CONVERT_STOP_AFTER");
    CHECK(split_parts(prefix2) == 0); /* nothing renamed before the end */
    CHECK(convert(dir, out2, "--dense f32 --split-max-size 256K") == 0);
    CHECK(split_parts(prefix2) == parts);
    for (int k = 1; k <= parts; k++) {
        size_t la, lb;
        split_part(other, sizeof other, prefix, k, parts);
        char *fa = read_all(other, &la);
        split_part(other, sizeof other, prefix2, k, parts);
        char *fb = read_all(other, &lb);
        CHECKF(fa && fb && la == lb && !memcmp(fa, fb, la), "part %d differs after the resume", k);
        free(fa), free(fb);
    }
    remove_split(prefix2, parts);
    /* a missing part: an error naming it */
    char moved[720];
    split_part(other, sizeof other, prefix, 3, parts);
    snprintf(moved, sizeof moved, "%s.away", other);
    CHECK(rename(other, moved) == 0);
    CHECK(open_dir(first, err, sizeof err) != MOE_OK && strstr(err, other));
    CHECK(rename(moved, other) == 0);
    /* a part under another part's name: its split.no says so */
    char second[700];
    split_part(second, sizeof second, prefix, 2, parts);
    CHECK(rename(second, moved) == 0 && rename(other, second) == 0 && rename(moved, other) == 0);
    CHECKF(open_dir(first, err, sizeof err) == MOE_ERR_FORMAT && strstr(err, "split.no"), "%s", err);
    CHECK(rename(second, moved) == 0 && rename(other, second) == 0 && rename(moved, other) == 0);
    /* the first part copied under a name of another part count */
    char *f1;
    size_t l1;
    CHECK((f1 = read_all(first, &l1)) != NULL);
    snprintf(other, sizeof other, "%s/sx-00001-of-00099.gguf", tmp_root);
    CHECK(f1 && write_all(other, f1, l1));
    CHECKF(open_dir(other, err, sizeof err) == MOE_ERR_FORMAT && strstr(err, "not named"), "%s", err);
    remove(other);
    /* split.tensors.count one off */
    char *k = NULL;
    for (size_t i = 0; f1 && !k && i + 19 + 8 <= l1; i++)
        if (!memcmp(f1 + i, "split.tensors.count", 19)) k = f1 + i;
    CHECK(k != NULL);
    if (k) {
        int32_t v;
        memcpy(&v, k + 19 + 4, 4), v++, memcpy(k + 19 + 4, &v, 4);
        CHECK(write_all(first, f1, l1));
        CHECKF(open_dir(mid, err, sizeof err) == MOE_ERR_FORMAT && strstr(err, "split.tensors.count"), "%s", err);
    }
    free(f1);
    remove_split(prefix, parts);
}

/* a hand-built GGUF: every truncation and each corrupted field gives a clean error */
typedef struct {
    unsigned char b[8192];
    size_t n;
} gbuf;
static void gb(gbuf *g, const void *p, size_t n) { memcpy(g->b + g->n, p, n), g->n += n; }
static void gb32(gbuf *g, uint32_t v) { gb(g, &v, 4); }
static void gb64(gbuf *g, uint64_t v) { gb(g, &v, 8); }
static void gbs(gbuf *g, const char *s) { gb64(g, strlen(s)), gb(g, s, strlen(s)); }

/* fields: [0] version, [1] n_tensors, [2] n_kv, [3] dim of t0, [4] type of t0, [5] offset of t1,
 * [6] string length of the arch value, [7] alignment */
static size_t build_gguf(gbuf *g, const uint64_t *f) {
    g->n = 0;
    gb(g, "GGUF", 4), gb32(g, (uint32_t)f[0]), gb64(g, f[1]), gb64(g, f[2]);
    gbs(g, "general.architecture"), gb32(g, MOE_GGUF_STRING), gb64(g, f[6]), gb(g, "kimi-linear", 11);
    gbs(g, "general.alignment"), gb32(g, MOE_GGUF_U32), gb32(g, (uint32_t)f[7]);
    gbs(g, "kimi-linear.block_count"), gb32(g, MOE_GGUF_U32), gb32(g, 1);
    gbs(g, "t0"), gb32(g, 2), gb64(g, f[3]), gb64(g, 2), gb32(g, (uint32_t)f[4]), gb64(g, 0);
    gbs(g, "t1"), gb32(g, 1), gb64(g, 32), gb32(g, 0), gb64(g, f[5]);
    while (g->n % 32) g->b[g->n++] = 0;
    memset(g->b + g->n, 0x3c, 512), g->n += 512;
    return g->n;
}

static void test_gguf_bad(void) {
    const uint64_t good[8] = {3, 2, 3, 32, 0, 256, 11, 32};
    gbuf g;
    char path[600], err[256];
    snprintf(path, sizeof path, "%s/t.gguf", tmp_root);
    size_t n = build_gguf(&g, good);
    moe__st_file f;
    write_all(path, g.b, n);
    CHECKF(moe__gguf_open(&f, path, err, sizeof err) == MOE_OK, "%s", err);
    if (!g_failed_checks) {
        CHECK(f.n_tensors == 2 && f.tensors[0].shape[0] == 2 && f.tensors[0].shape[1] == 32 && f.n_kv == 3);
        const moe__gguf_kv *kv = moe__gguf_get(&f, "general.architecture");
        CHECK(kv && kv->type == MOE_GGUF_STRING && kv->n == 11 && !memcmp(kv->data, "kimi-linear", 11));
        moe__st_close(&f);
    }
    for (size_t cut = 0; cut < n - 512 + 300; cut += 3) { /* every truncation through the header, into the data */
        write_all(path, g.b, cut);
        CHECKF(moe__gguf_open(&f, path, err, sizeof err) == MOE_ERR_FORMAT, "truncated at %zu", cut);
    }
    const struct { int field; uint64_t value; moe_status want; const char *what; } bad[] = {
        {0, 1, MOE_ERR_FORMAT, "version 1"},         {0, 4, MOE_ERR_FORMAT, "version 4"},
        {1, 1ull << 40, MOE_ERR_FORMAT, "absurd tensor count"}, {2, 1ull << 40, MOE_ERR_FORMAT, "absurd key count"},
        {2, 4, MOE_ERR_FORMAT, "one key too many"},  {3, 0, MOE_ERR_FORMAT, "zero dimension"},
        {3, 33, MOE_ERR_FORMAT, "partial block"},    {3, 320, MOE_ERR_FORMAT, "tensor past the end"},
        {4, 77, MOE_ERR_UNSUPPORTED, "unknown type"}, {5, 1ull << 50, MOE_ERR_FORMAT, "offset outside"},
        {5, 100, MOE_ERR_FORMAT, "misaligned offset"}, {5, 0, MOE_ERR_FORMAT, "overlapping tensors"},
        {6, 1ull << 62, MOE_ERR_FORMAT, "string length past the end"}, {7, 3, MOE_ERR_FORMAT, "alignment not a power of two"},
        {3, 1ull << 62, MOE_ERR_FORMAT, "dimension overflow"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        uint64_t fl[8];
        memcpy(fl, good, sizeof fl);
        fl[bad[i].field] = bad[i].value;
        n = build_gguf(&g, fl);
        write_all(path, g.b, n);
        moe_status st = moe__gguf_open(&f, path, err, sizeof err);
        CHECKF(st == bad[i].want, "%s: status %d (%s)", bad[i].what, st, err);
        if (!st) moe__st_close(&f);
    }
    /* bad magic through the model API */
    n = build_gguf(&g, good);
    g.b[3] = 'X';
    write_all(path, g.b, n);
    moe_model *m;
    CHECK(moe_model_open(&m, path, NULL, err, sizeof err) != MOE_OK);
    /* a valid container without the model's tensors: a clean error naming what is missing */
    n = build_gguf(&g, good);
    write_all(path, g.b, n);
    moe_status st = moe_model_open(&m, path, NULL, err, sizeof err);
    CHECKF(st == MOE_ERR_FORMAT && err[0], "%d %s", st, err);
    /* truncations of a real converted model */
    char dir[600], out[600];
    snprintf(dir, sizeof dir, "%s/kimi", golden_dir());
    snprintf(out, sizeof out, "%s/kimi.gguf", tmp_root);
    CHECK(convert(dir, out, "--dense q4_0") == 0);
    size_t len;
    char *full = read_all(out, &len);
    for (int i = 0; full && i < 24; i++) {
        size_t cut = i < 12 ? (size_t)i * 997 : len / 24 * (size_t)i;
        write_all(path, full, cut);
        st = moe_model_open(&m, path, NULL, err, sizeof err);
        CHECKF(st == MOE_ERR_FORMAT, "model truncated at %zu: %d (%s)", cut, st, err);
        if (!st) moe_model_close(m);
    }
    free(full);
    remove(out);
}

/* the fuzz seed corpora (test/fuzz/corpus) go through the fuzz targets' parsers: seeds are
 * valid inputs, so every one is accepted (a replay of what `make fuzz` starts from) */
static void test_fuzz_seeds(void) {
    const char *dirs[8] = {"json", "safetensors", "gguf", "config", "ranks", "tokenize", "chat", "batch"};
    int total = 0;
    for (int k = 0; k < 8; k++) {
        char dir[600];
        snprintf(dir, sizeof dir, "%s/../fuzz/corpus/%s", golden_dir(), dirs[k]);
        DIR *d = opendir(dir);
        CHECKF(d != NULL, "%s", dir);
        struct dirent *e;
        while (d && (e = readdir(d))) {
            if (e->d_name[0] == '.') continue;
            char p[1200], err[256];
            size_t len;
            snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
            char *data = read_all(p, &len);
            CHECK(data != NULL);
            if (!data) continue;
            moe_status st;
            if (k == 0) {
                moe__json *j;
                if (!(st = moe__json_parse(data, len, &j, err, sizeof err))) moe__json_free(j);
            } else if (k == 3) {
                st = moe__config_check(data, len, err, sizeof err);
            } else if (k == 4) { /* a rank file, then NUL and a tokenizer_config.json */
                const char *nul = memchr(data, 0, len);
                moe_tokenizer *t = NULL;
                st = moe__tokenizer_from_mem(&t, data, nul ? (size_t)(nul - data) : len, MOE_PRETOK_KIMI, nul ? nul + 1 : NULL,
                                             nul ? len - (size_t)(nul - data) - 1 : 0, err, sizeof err);
                moe_tokenizer_free(t);
            } else if (k >= 5) { /* mode byte + text / chat request / one batch line: all valid here */
                moe__json *j = NULL;
                st = k == 5 ? MOE_OK : moe__json_parse(data + (k == 6), len - (k == 6), &j, err, sizeof err);
                moe__json_free(j);
            } else {
                moe__st_file f;
                if (!(st = moe__weights_parse_mem(&f, data, len, k == 2, err, sizeof err))) moe__st_close(&f);
            }
            CHECKF(st == MOE_OK, "%s: %s", p, err);
            free(data);
            total++;
        }
        if (d) closedir(d);
    }
    CHECK(total >= 30);
}

/* ---- expert cache (CACHE mode) -------------------------------------------------------------------- */

/* prefetch off: the counts some tests check would otherwise depend on the I/O thread's timing */
/* golden case `name` with options o (a failure to open is a failed check) */
static moe_model *open_golden_with(const char *name, const moe_options *o) {
    char path[600], err[512];
    snprintf(path, sizeof path, "%s/%s", golden_dir(), name);
    moe_model *m = NULL;
    moe_status st = moe_model_open(&m, path, o, err, sizeof err);
    CHECKF(st == MOE_OK, "open %s: %s", path, err);
    return m;
}

static moe_model *open_cache_pf(const char *name, size_t budget, int threads, int prefetch) {
    moe_options o = moe_default_options();
    o.expert_mode = MOE_EXPERTS_CACHE;
    o.prefetch = prefetch;
    o.expert_budget = budget;
    o.n_threads = threads;
    return open_golden_with(name, &o);
}
static moe_model *open_cache(const char *name, size_t budget, int threads) { return open_cache_pf(name, budget, threads, 0); }

/* a tiny budget (two experts) gives the same logits as the mapping, in every golden case, and
 * the cache never holds more than its budget */
static void test_cache_equivalence(void) {
    const char *cases[] = {"kimi", "seed", "k3mx"};
    for (int ci = 0; ci < 3; ci++) {
        moe_model *ref = open_model(cases[ci], 0, 2);
        if (!ref) return;
        uint64_t eb = moe_model_get_info(ref).expert_bytes;
        const moe_config *c = moe_model_config(ref);
        int moe_layers = 0;
        for (int l = 0; l < c->n_layers; l++) moe_layers += c->layer_moe[l];
        const size_t one = (size_t)(eb / ((uint64_t)moe_layers * c->n_experts)), budget = 2 * one;
        moe_model *m = open_cache(cases[ci], budget, 2);
        if (!m) { moe_model_close(ref); return; }
        int n;
        int32_t *ids = golden_ids(cases[ci], 2, &n);
        float *a = logits_in_pieces(ref, ids, n, NULL), *b = logits_in_pieces(m, ids, n, NULL);
        CHECKF(a && b && max_abs_diff(a, b, (size_t)n * c->vocab_size) == 0, "%s: cache vs mmap %.3g", cases[ci],
               a && b ? max_abs_diff(a, b, (size_t)n * c->vocab_size) : -1.0);
        size_t now, peak;
        moe__expert_cache_usage(m, &now, &peak);
        CHECKF(peak <= budget && peak > 0, "%s: peak %zu, budget %zu", cases[ci], peak, budget);
        free(a), free(b), free(ids);
        moe_model_close(m), moe_model_close(ref);
    }
    run_golden_path_cache("k3mx");
}

/* statistics, a budget too small, and reads that fail: an error from the step, a usable model */
/* prefetch on the I/O thread: same logits; the guesses are counted and mostly right on a model
 * whose consecutive routers see similar inputs (here: recall is only checked to be a ratio) */
static void test_cache_prefetch(void) {
    moe_model *ref = open_model("seed", 0, 1), *m = open_cache_pf("seed", 40 * 12288, 2, 1);
    if (!ref || !m) { moe_model_close(ref), moe_model_close(m); return; }
    int n;
    int32_t *ids = golden_ids("seed", 2, &n);
    const int V = moe_model_config(m)->vocab_size;
    float *a = logits_in_pieces(ref, ids, n, NULL), *b = malloc(sizeof(float) * (size_t)V * n);
    moe_session *s;
    CHECK(moe_session_new(&s, m, n, NULL, 0) == MOE_OK);
    moe_step_stats st;
    uint64_t issued = 0, pred = 0, routed = 0;
    for (int t = 0; t < n; t++) { /* token by token, as decoding does */
        moe_seq q = {.s = s, .tokens = ids + t, .n = 1, .logits = b + (size_t)t * V};
        CHECK(moe_step(m, &q, 1, &st, NULL, 0) == MOE_OK);
        issued += st.prefetch_issued, pred += st.prefetch_predicted, routed += st.prefetch_routed;
    }
    CHECK(max_abs_diff(a, b, (size_t)V * n) < 1e-3);
    CHECKF(issued > 0 && routed == (uint64_t)n * 6 * 6 && pred <= routed, "issued %llu, predicted %llu of %llu",
           (unsigned long long)issued, (unsigned long long)pred, (unsigned long long)routed);
    if (getenv("MOE_TEST_VERBOSE")) fprintf(stderr, "  prefetch recall %.2f (%llu of %llu)\n", (double)pred / routed,
                                            (unsigned long long)pred, (unsigned long long)routed);
    moe_session_free(s);
    free(a), free(b), free(ids);
    moe_model_close(m), moe_model_close(ref);
}

static void test_cache_faults(void) {
    char path[600], err[512];
    snprintf(path, sizeof path, "%s/k3mx", golden_dir());
    moe_options o = moe_default_options();
    o.expert_mode = MOE_EXPERTS_CACHE;
    o.expert_budget = 1000; /* a k3mx expert is 3 x (1024 + 64) = 3264 bytes */
    moe_model *m = NULL;
    CHECK(moe_model_open(&m, path, &o, err, sizeof err) == MOE_ERR_ARG && m == NULL && strstr(err, "too small"));
    o.expert_type = MOE_WTYPE_Q8_0;
    o.expert_budget = 1 << 30;
    CHECK(moe_model_open(&m, path, &o, err, sizeof err) == MOE_ERR_ARG && m == NULL);
    m = open_cache("k3mx", 4 << 20, 1); /* room for all 7 x 64 experts */
    if (!m) return;
    const int V = moe_model_config(m)->vocab_size;
    int n;
    int32_t *ids = golden_ids("k3mx", 1, &n);
    float *ref = logits_in_pieces(m, ids, n, NULL), *lg = malloc(sizeof(float) * (size_t)V * n);
    moe_session *s;
    CHECK(moe_session_new(&s, m, 64, NULL, 0) == MOE_OK);
    moe_step_stats st1, st2;
    moe_seq q = {.s = s, .tokens = ids, .n = n, .logits = lg, .logits_all = 1};
    CHECK(moe_step(m, &q, 1, &st1, NULL, 0) == MOE_OK); /* everything resident by now: all hits */
    CHECKF(st1.cache_hits > 0 && st1.cache_misses == 0 && st1.bytes_read == 0, "hits %llu misses %llu", (unsigned long long)st1.cache_hits,
           (unsigned long long)st1.cache_misses);
    moe_session_free(s); /* sessions go before their model */
    moe_model_close(m);
    /* three experts: misses on every layer; the step's own thread reads every unit (no I/O
     * threads), or I/O threads read what each layer routes to while the step reads what they
     * have not taken yet: the n-th read from now, whichever thread makes it, is one that step
     * needs, so the injected fault always falls in the step that follows it */
    for (int io = 0; io <= 4; io += 4) {
        o = moe_default_options();
        o.expert_mode = MOE_EXPERTS_CACHE, o.prefetch = 0, o.io_threads = io, o.expert_budget = 3 * 3264, o.n_threads = 1;
        m = open_golden_with("k3mx", &o);
        if (!m) break;
        CHECK(moe_session_new(&s, m, 64, NULL, 0) == MOE_OK);
        q.s = s;
        CHECK(moe_step(m, &q, 1, &st2, NULL, 0) == MOE_OK);
        /* every miss was read (I/O threads may also read ahead experts evicted again before use) */
        CHECK(st2.cache_misses > 0 && st2.bytes_read >= st2.cache_misses * 3264 && max_abs_diff(ref, lg, (size_t)V * n) == 0);
        /* each read from the 1st to the 12th from now fails in turn: the step reports an I/O
         * error, the sessions are reset, and the model works again afterwards, with the same
         * logits */
        for (int nth = 1; nth <= 12; nth++) {
            moe_session_reset(s);
            moe__fail_expert_read(m, nth);
            moe_status r1 = moe_step(m, &q, 1, NULL, err, sizeof err);
            CHECKF(r1 == MOE_ERR_IO && moe_session_pos(s) == 0, "io threads %d, read %d: step %d, position %d", io, nth, (int)r1,
                   moe_session_pos(s));
            moe_status r2 = moe_step(m, &q, 1, NULL, err, sizeof err);
            CHECKF(r2 == MOE_OK && max_abs_diff(ref, lg, (size_t)V * n) == 0, "io threads %d, read %d: next step %d, logits off by %g",
                   io, nth, (int)r2, max_abs_diff(ref, lg, (size_t)V * n));
        }
        moe_session_free(s);
        moe_model_close(m);
    }
    free(ids), free(ref), free(lg);
}

/* Dense matrices streamed through the cache (dense_budget): every layer, or the layers after
 * those that fit, read from disk each step give the mapping's logits in every golden case, with
 * or without I/O threads; a failed dense read is an error from the step and the model works on */
static moe_model *open_streaming(const char *name, size_t dense_budget, int io_threads) {
    moe_options o = moe_default_options();
    o.expert_mode = MOE_EXPERTS_CACHE, o.expert_budget = 64 << 20, o.dense_budget = dense_budget;
    o.io_threads = io_threads, o.n_threads = 2;
    return open_golden_with(name, &o);
}

static void test_dense_streaming(void) {
    const char *cases[] = {"kimi", "seed", "k3mx"};
    for (int ci = 0; ci < 3; ci++) {
        moe_model *ref = open_model(cases[ci], 0, 2);
        if (!ref) return;
        const moe_config *c = moe_model_config(ref);
        const int V = c->vocab_size, L = c->n_layers;
        int n;
        int32_t *ids = golden_ids(cases[ci], 2, &n);
        int *ones = malloc(sizeof(int) * (size_t)n);
        for (int i = 0; i < n; i++) ones[i] = 1;
        float *a = logits_in_pieces(ref, ids, n, ones); /* token by token, as below */
        free(ones);
        /* a budget that keeps some layers resident: grown until not every layer streams */
        size_t part = 1;
        for (;;) {
            moe_model *m = open_streaming(cases[ci], part, 4);
            const int sl = m ? moe_model_get_info(m).streamed_layers : 0;
            moe_model_close(m);
            if (!m || sl < L) break;
            part *= 2;
        }
        const size_t budgets[3] = {1, part, 1};
        for (int v = 0; v < 3; v++) {
            moe_model *m = open_streaming(cases[ci], budgets[v], v == 2 ? 0 : 4);
            if (!m) break;
            const moe_model_info info = moe_model_get_info(m);
            CHECKF(v == 1 ? info.streamed_layers > 0 && info.streamed_layers < L : info.streamed_layers == L,
                   "%s: %d of %d layers stream", cases[ci], info.streamed_layers, L);
            moe_session *s;
            float *b = malloc(sizeof(float) * (size_t)V * n);
            CHECK(moe_session_new(&s, m, n, NULL, 0) == MOE_OK);
            uint64_t reads = 0;
            for (int t = 0; t < n; t++) { /* token by token: each step reads the streamed layers */
                moe_step_stats st;
                moe_seq q = {.s = s, .tokens = ids + t, .n = 1, .logits = b + (size_t)V * t};
                CHECK(moe_step(m, &q, 1, &st, NULL, 0) == MOE_OK);
                reads += st.dense_reads;
            }
            CHECKF(a && max_abs_diff(a, b, (size_t)V * n) == 0, "%s budget %zu io %d: %.3g", cases[ci], budgets[v], v != 2,
                   a ? max_abs_diff(a, b, (size_t)V * n) : -1.0);
            CHECKF(reads > 0 && reads <= (uint64_t)n * info.streamed_layers, "%s: %llu dense reads", cases[ci], (unsigned long long)reads);
            moe_session_free(s);
            free(b);
            moe_model_close(m);
        }
        free(a), free(ids);
        moe_model_close(ref);
    }
    /* fault injection: the first read the step needs (layer 0's dense matrices) fails */
    moe_model *ref = open_model("k3mx", 0, 2), *m = open_streaming("k3mx", 1, 4);
    if (!ref || !m) { moe_model_close(ref), moe_model_close(m); return; }
    int n;
    int32_t *ids = golden_ids("k3mx", 1, &n);
    const int V = moe_model_config(m)->vocab_size;
    float *a = logits_in_pieces(ref, ids, n, NULL), *b = malloc(sizeof(float) * (size_t)V * n);
    moe_session *s;
    CHECK(moe_session_new(&s, m, n, NULL, 0) == MOE_OK);
    moe_seq q = {.s = s, .tokens = ids, .n = n, .logits = b, .logits_all = 1};
    char err[256];
    moe__fail_expert_read(m, 1);
    CHECK(moe_step(m, &q, 1, NULL, err, sizeof err) == MOE_ERR_IO && moe_session_pos(s) == 0);
    CHECK(moe_step(m, &q, 1, NULL, err, sizeof err) == MOE_OK && a && max_abs_diff(a, b, (size_t)V * n) == 0);
    moe_session_free(s);
    free(a), free(b), free(ids);
    moe_model_close(m), moe_model_close(ref);
}

/* several sessions stepping at once from their own threads, one shared model and cache */
typedef struct {
    moe_model *m;
    const int32_t *ids;
    int n;
    float *out;
    int ok, pieces; /* pieces: steps of worker_pieces' sizes (prefill chunks and single tokens) */
} worker;

static const int worker_pieces[] = {9, 1, 1, 4, 1, 1, 1, 2, 1, 0}; /* then the rest at once */

static void *run_worker(void *p) {
    worker *w = p;
    float *x = logits_in_pieces(w->m, w->ids, w->n, w->pieces ? worker_pieces : NULL);
    if (x) memcpy(w->out, x, sizeof(float) * (size_t)w->n * moe_model_config(w->m)->vocab_size), w->ok = 1;
    free(x);
    return NULL;
}

static void test_concurrent_sessions(void) {
    moe_model *m = open_cache("seed", 4 * 6 * 32 * 64 * 2 * 3, 1), *ref = open_model("seed", 0, 1);
    if (!m || !ref) { moe_model_close(m); moe_model_close(ref); return; }
    const int V = moe_model_config(m)->vocab_size;
    int n[3];
    int32_t *ids[3] = {golden_ids("seed", 1, &n[0]), golden_ids("seed", 2, &n[1]), golden_ids("seed", 3, &n[2])};
    n[2] = 100;
    pthread_t th[3];
    worker w[3];
    for (int i = 0; i < 3; i++) {
        w[i] = (worker){m, ids[i], n[i], malloc(sizeof(float) * (size_t)V * n[i]), 0, 0};
        CHECK(pthread_create(&th[i], NULL, run_worker, &w[i]) == 0);
    }
    for (int i = 0; i < 3; i++) {
        pthread_join(th[i], NULL);
        float *want = logits_in_pieces(ref, ids[i], n[i], NULL);
        CHECKF(w[i].ok && want && max_abs_diff(want, w[i].out, (size_t)V * n[i]) == 0, "thread %d", i);
        free(want), free(w[i].out), free(ids[i]);
    }
    moe_model_close(m), moe_model_close(ref);
}

/* several sessions stepping at once from their own threads on one mapped model with 2 threads a
 * step: each step's team of threads (three teams at once, more threads than this machine's
 * cores) gives the logits of the same steps run one after another, bit for bit */
static void test_concurrent_teams(void) {
    moe_model *m = open_model("k3mx", 0, 2);
    if (!m) return;
    moe__set_step_team(m, 2); /* a team whatever the number of processors */
    const int V = moe_model_config(m)->vocab_size;
    int n[3];
    int32_t *ids[3] = {golden_ids("k3mx", 1, &n[0]), golden_ids("k3mx", 2, &n[1]), golden_ids("k3mx", 3, &n[2])};
    float *want[3];
    for (int i = 0; i < 3; i++) {
        if (!ids[i] || n[i] < 22) { CHECKF(0, "k3mx prompt %d: %d tokens", i + 1, n[i]); n[i] = 0; } /* worker_pieces take 21 */
        n[i] = n[i] > 40 ? 40 : n[i];
        want[i] = n[i] ? logits_in_pieces(m, ids[i], n[i], worker_pieces) : NULL;
    }
    pthread_t th[3];
    worker w[3];
    for (int i = 0; i < 3; i++) {
        w[i] = (worker){m, ids[i], n[i], malloc(sizeof(float) * (size_t)V * (n[i] + 1)), 0, 1};
        CHECK(pthread_create(&th[i], NULL, run_worker, &w[i]) == 0);
    }
    for (int i = 0; i < 3; i++) {
        pthread_join(th[i], NULL);
        CHECKF(!n[i] || (w[i].ok && want[i] && max_abs_diff(want[i], w[i].out, (size_t)V * n[i]) == 0), "thread %d", i);
        free(want[i]), free(w[i].out), free(ids[i]);
    }
    moe_model_close(m);
}

/* writes a random-weight checkpoint in the released K3 layout with moe-convert --k3-slice: 3 layers
 * (KDA + dense, KDA + MoE, MLA + MoE), hidden 64, vocab 300, E experts of width ie on a latent of
 * dl; the directory goes to dir. Returns 1 on success. */
static int make_slice(const char *name, const char *js, char *dir, size_t dn) {
    char shape[600], cmd[2400], out[4096];
    snprintf(shape, sizeof shape, "%s/%s.json", tmp_root, name);
    snprintf(dir, dn, "%s/%s", tmp_root, name);
    write_all(shape, js, strlen(js));
    snprintf(cmd, sizeof cmd, "%s/moe-convert --k3-slice %s %s 2>&1", exe_dir, shape, dir);
    const int rc = run_cmd(cmd, out, sizeof out);
    CHECKF(rc == 0, "%s", out);
    return rc == 0;
}

static int make_k3_slice(const char *name, int E, int ie, int dl, char *dir, size_t dn) {
    char js[2048];
    snprintf(js, sizeof js,
             "{\"k3_dims\": {\"hidden_size\": 64, \"vocab_size\": 300, \"intermediate_size\": 96, \"num_attention_heads\": 2,"
             "\"q_lora_rank\": 32, \"kv_lora_rank\": 32, \"qk_nope_head_dim\": 16, \"qk_rope_head_dim\": 8, \"v_head_dim\": 16,"
             "\"kda_heads\": 2, \"kda_head_dim\": 16, \"short_conv_kernel_size\": 4, \"kda_a_log_len\": 4, \"num_experts\": %d,"
             "\"num_experts_per_token\": 2, \"moe_intermediate_size\": %d, \"routed_expert_hidden_size\": %d,"
             "\"num_shared_experts\": 1, \"first_k_dense_replace\": 1, \"attn_res_block_size\": 2},"
             "\"layers\": [{\"attention\": \"kda\", \"ffn\": \"dense\"}, {\"attention\": \"kda\", \"ffn\": \"moe\"},"
             "{\"attention\": \"mla\", \"ffn\": \"moe\"}]}",
             E, ie, dl);
    return make_slice(name, js, dir, dn);
}

/* experts of 1.6 MB (above the O_DIRECT threshold), adjacent in the released K3 layout: each is
 * read with one aligned O_DIRECT read where the file system allows it, giving the mapping's logits */
static void test_cache_direct_io(void) {
    char dir[600], err[512];
    if (!make_k3_slice("bigexperts", 4, 1024, 1024, dir, sizeof dir)) return;
    moe_model *m = NULL;
    CHECKF(moe_model_open(&m, dir, NULL, err, sizeof err) == MOE_OK, "%s", err);
    if (!m) return;
    int32_t ids[8] = {1, 2, 3, 4, 5, 299, 7, 8};
    float *a = logits_in_pieces(m, ids, 8, NULL);
    moe_model_close(m);
    const size_t one = 3 * (1024 * 512 + 1024 * 32);
    for (int direct = 1; direct >= 0; direct--) {
        moe_options o = moe_default_options();
        o.expert_mode = MOE_EXPERTS_CACHE, o.expert_budget = 2 * one + 4 * 4096; /* two experts: misses and evictions */
        o.flags = direct ? 0 : MOE_FLAG_NO_DIRECT_IO;
        m = NULL;
        CHECKF(moe_model_open(&m, dir, &o, err, sizeof err) == MOE_OK, "%s", err);
        float *b = m ? logits_in_pieces(m, ids, 8, NULL) : NULL;
        CHECKF(a && b && max_abs_diff(a, b, 8 * 300) == 0, "direct %d", direct);
        size_t now, peak;
        moe__expert_cache_usage(m, &now, &peak);
        CHECK(peak <= o.expert_budget && moe__expert_bytes_read(m) >= one);
        free(b);
        moe_model_close(m);
    }
    free(a);
}

/* AddressSanitizer keeps freed memory in quarantine: resident-set checks mean nothing there */
#if defined(__SANITIZE_ADDRESS__)
static const int rss_unreliable = 1;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
static const int rss_unreliable = 1;
#else
static const int rss_unreliable = 0;
#endif
#else
static const int rss_unreliable = 0;
#endif

/* reads a field of /proc/self/status such as "RssAnon:" (kB); -1 where /proc is not there */
static long status_kb(const char *field) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long v = -1;
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, field, strlen(field))) v = atol(line + strlen(field));
    if (f) fclose(f);
    return v;
}
static long rss_anon_kb(void) { return status_kb("RssAnon:"); }

/* the process holds what the caller budgeted for experts and no more: decoding through a cache of
 * six 1.6 MB experts with 16 I/O threads, its anonymous memory grows by at most the budget plus
 * 4 MB of step buffers, however many experts are read and evicted. (On the K3 slice, malloc'd
 * 17.5 MB buffers freed by other threads lingered in their arenas, 3x the budget; at this size
 * glibc did not show it, so this checks the accounting, the slice run in bench/RESULTS.md the
 * fix.) */
static void test_rss_cache_budget(void) {
    if (getenv("MOE_TEST_RUNNER")) return; /* under qemu-user the emulator's own memory is in RssAnon */
    char dir[600];
    snprintf(dir, sizeof dir, "%s/bigexperts", tmp_root);
    struct stat sb;
    if (stat(dir, &sb)) test_cache_direct_io(); /* makes the checkpoint */
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        moe_options o = moe_default_options();
        o.expert_mode = MOE_EXPERTS_CACHE, o.expert_budget = 6 * 3 * (1024 * 512 + 1024 * 32) + 12 * 4096, o.io_threads = 16;
        moe_model *m;
        moe_session *s;
        if (moe_model_open(&m, dir, &o, NULL, 0) || moe_session_new(&s, m, 300, NULL, 0)) _exit(2);
        float *lg = malloc(sizeof(float) * 300);
        int32_t t = 1;
        moe_seq q = {.s = s, .tokens = &t, .n = 1, .logits = lg};
        const long before = rss_anon_kb(); /* the model and session, no expert yet */
        if (moe_step(m, &q, 1, NULL, NULL, 0)) _exit(3);
        uint64_t read0 = moe__expert_bytes_read(m);
        for (int i = 0; i < 200; i++) {
            t = (int32_t)((i * 7919) % 300);
            if (moe_step(m, &q, 1, NULL, NULL, 0)) _exit(4);
        }
        const long after = rss_anon_kb();
        if (before < 0) _exit(0); /* no /proc */
        const long grown = after - before, budget_kb = (long)(o.expert_budget / 1024);
        if (getenv("MOE_TEST_VERBOSE"))
            fprintf(stderr, "  cache budget %ld kB: anonymous memory grew %ld kB while %.0f MB of experts were read\n", budget_kb, grown,
                    (moe__expert_bytes_read(m) - read0) / 1e6);
        _exit((rss_unreliable || grown <= budget_kb + 4096) && moe__expert_bytes_read(m) - read0 > 20 * o.expert_budget ? 0 : 5);
    }
    int status = 0;
    CHECK(pid > 0 && waitpid(pid, &status, 0) == pid);
    CHECKF(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child status %d", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
}

/* The whole process stays within the budget when the dense matrices stream: a model of 8
 * layers with 5.8 MB of dense matrices each, decoded through a 14 MB cache; its resident set
 * (anonymous and file pages) grows by at most the cache budget plus 8 MB of step buffers, although
 * every step reads all 47 MB of dense matrices (which the mapping would have made resident).
 * Under AddressSanitizer only the logits and the bytes read are checked. */
static void test_rss_dense_streaming(void) {
    if (getenv("MOE_TEST_RUNNER")) return;
    char dir[600], js[2048];
    snprintf(js, sizeof js,
             "{\"k3_dims\": {\"hidden_size\": 1024, \"vocab_size\": 300, \"intermediate_size\": 64, \"num_attention_heads\": 4,"
             "\"q_lora_rank\": 256, \"kv_lora_rank\": 128, \"qk_nope_head_dim\": 64, \"qk_rope_head_dim\": 32, \"v_head_dim\": 64,"
             "\"kda_heads\": 4, \"kda_head_dim\": 128, \"short_conv_kernel_size\": 4, \"kda_a_log_len\": 4, \"num_experts\": 4,"
             "\"num_experts_per_token\": 2, \"moe_intermediate_size\": 64, \"routed_expert_hidden_size\": 64,"
             "\"num_shared_experts\": 1, \"first_k_dense_replace\": 1, \"attn_res_block_size\": 2},"
             "\"layers\": [{\"attention\": \"kda\", \"ffn\": \"dense\"}, {\"attention\": \"kda\", \"ffn\": \"moe\"},"
             "{\"attention\": \"kda\", \"ffn\": \"moe\"}, {\"attention\": \"kda\", \"ffn\": \"moe\"}, {\"attention\": \"kda\", \"ffn\": \"moe\"},"
             "{\"attention\": \"kda\", \"ffn\": \"moe\"}, {\"attention\": \"kda\", \"ffn\": \"moe\"}, {\"attention\": \"mla\", \"ffn\": \"moe\"}]}");
    if (!make_slice("bigdense", js, dir, sizeof dir)) return;
    int32_t ids[12] = {1, 2, 3, 4, 5, 299, 7, 8, 9, 10, 11, 12};
    moe_model *ref = NULL;
    CHECK(moe_model_open(&ref, dir, NULL, NULL, 0) == MOE_OK);
    int *ones = malloc(sizeof(int) * 12);
    for (int i = 0; i < 12; i++) ones[i] = 1;
    float *a = ref ? logits_in_pieces(ref, ids, 12, ones) : NULL;
    free(ones);
    moe_model_close(ref);
    if (!a) return;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        moe_options o = moe_default_options();
        o.expert_mode = MOE_EXPERTS_CACHE, o.expert_budget = 14 << 20, o.dense_budget = 1, o.io_threads = 4;
        moe_model *m;
        moe_session *s;
        if (moe_model_open(&m, dir, &o, NULL, 0) || moe_session_new(&s, m, 300, NULL, 0)) _exit(2);
        const moe_model_info info = moe_model_get_info(m);
        if (info.streamed_layers != 8 || info.streamed_bytes < (28u << 20)) _exit(3);
        float *lg = malloc(sizeof(float) * 300);
        const long before = status_kb("RssAnon:") + status_kb("RssFile:");
        const uint64_t read0 = moe__expert_bytes_read(m);
        for (int i = 0; i < 40; i++) {
            int32_t t = ids[i % 12];
            moe_seq q = {.s = s, .tokens = &t, .n = 1, .logits = lg};
            if (moe_step(m, &q, 1, NULL, NULL, 0)) _exit(4);
            if (i < 12 && memcmp(lg, a + (size_t)i * 300, sizeof(float) * 300)) _exit(5); /* the mapping's logits */
            if (i == 11) moe_session_reset(s);
        }
        const long grown = status_kb("RssAnon:") + status_kb("RssFile:") - before, budget_kb = (long)(o.expert_budget / 1024);
        const uint64_t read = moe__expert_bytes_read(m) - read0;
        const int ok = before < 0 || rss_unreliable || (grown <= budget_kb + 8192 && read >= 40 * info.streamed_bytes);
        if (getenv("MOE_TEST_VERBOSE") || !ok)
            fprintf(stderr, "  budget %ld kB: resident set grew %ld kB while %.0f MB were read (%.1f MB of dense matrices a step)\n",
                    budget_kb, grown, read / 1e6, info.streamed_bytes / 1e6);
        _exit(ok ? 0 : 6);
    }
    int status = 0;
    CHECK(pid > 0 && waitpid(pid, &status, 0) == pid);
    CHECKF(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child status %d", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    free(a);
}

/* moe-convert --k3-slice writes the released K3 layout from a shape file: a tiny one loads, runs,
 * and gives the same tokens through the expert cache */
static void test_k3_slice(void) {
    char dir[600];
    if (!make_k3_slice("k3slice", 8, 32, 32, dir, sizeof dir)) return;
    char err[512];
    moe_model *m = NULL;
    CHECKF(moe_model_open(&m, dir, NULL, err, sizeof err) == MOE_OK, "%s", err);
    if (!m) return;
    const moe_config *c = moe_model_config(m);
    CHECK(c->n_layers == 3 && c->layer_kind[2] == MOE_LAYER_MLA && c->n_experts == 8 && c->latent_dim == 32 && c->attn_res_block == 2);
    moe_model_info info = moe_model_get_info(m);
    CHECK(info.n_files == 4 && info.expert_bytes == 2ull * 8 * 3 * (32 * 16 + 32)); /* 2 MoE layers x 8 experts x 3 x (packed + scales) */
    int32_t ids[6] = {1, 2, 3, 4, 5, 299};
    float *a = logits_in_pieces(m, ids, 6, NULL);
    moe_model_close(m);
    moe_options o = moe_default_options();
    o.expert_mode = MOE_EXPERTS_CACHE, o.expert_budget = 2 * 3 * (32 * 16 + 32);
    CHECK(moe_model_open(&m, dir, &o, err, sizeof err) == MOE_OK);
    float *b = m ? logits_in_pieces(m, ids, 6, NULL) : NULL;
    CHECK(a && b && max_abs_diff(a, b, 6 * 300) == 0);
    for (int i = 0; a && i < 6 * 300; i++) CHECK(isfinite(a[i]));
    free(a), free(b);
    moe_model_close(m);
}

/* moe-plan from a config alone: the full Kimi K3 (no weights) comes out at its published size
 * (2.8 T parameters, ~104 B active, 17.55 MB MXFP4 experts, 25.8 GB of experts per token), and
 * a checkpoint's exact byte counts agree with its config's estimate */
static void test_plan(void) {
    char cmd[2400], out[8192];
    snprintf(cmd, sizeof cmd, "%s/moe-plan --config %s/../../bench/shapes/kimi-k3-config.json --ram 64G --disk-gbps 7 --dense-bytes-per-value 0.5625 2>&1",
             exe_dir, golden_dir());
    CHECKF(run_cmd(cmd, out, sizeof out) == 0, "%s", out);
    CHECKF(strstr(out, "2779.5 B parameters") && strstr(out, "105.36 B active") && strstr(out, "(17.55 MB each)") &&
           strstr(out, "decode, 1 sequence: 25.") && !strstr(out, "every step"), "%s", out);
    /* in BF16 (113 GB) the dense matrices do not fit 64 GB: those that do not are read every step,
     * on top of the experts; a dense budget given is what stays resident */
    snprintf(cmd, sizeof cmd, "%s/moe-plan --config %s/../../bench/shapes/kimi-k3-config.json --ram 64G --disk-gbps 7 --dense-budget 20G 2>&1",
             exe_dir, golden_dir());
    CHECKF(run_cmd(cmd, out, sizeof out) == 0, "%s", out);
    const char *dl = strstr(out, "decode, 1 sequence: ");
    CHECKF(strstr(out, "dense matrices 21.47 GB resident") && strstr(out, "every step") && dl && atof(dl + 20) > 25.8 + 80, "%s", out);
    char a[8192];
    snprintf(cmd, sizeof cmd, "%s/moe-plan -m %s/k3mx --ram 1G 2>&1 | head -2", exe_dir, golden_dir());
    CHECK(run_cmd(cmd, a, sizeof a) == 0);
    snprintf(cmd, sizeof cmd, "%s/moe-plan --config %s/k3mx/config.json --ram 1G 2>&1 | head -2", exe_dir, golden_dir());
    CHECK(run_cmd(cmd, out, sizeof out) == 0);
    CHECKF(!strcmp(a, out), "from files:\n%s\nfrom config:\n%s", a, out);
    snprintf(cmd, sizeof cmd, "%s/moe-plan 2>/dev/null", exe_dir);
    CHECK(run_cmd(cmd, out, sizeof out) == 2);
}

/* ---- memory ------------------------------------------------------------------------------------ */

/* the seed model with a 600-token prompt stays under 100 MB resident (measured in a child, so
 * the test process's own mappings do not count) */
static void test_rss_seed_600(void) {
    golden g;
    if (!golden_load(&g, "seed")) return;
    const moe__json *p3 = moe__json_get(g.cases, "prompts")->child->next->next->next;
    int32_t *ids;
    int n = ids_of(moe__json_get(p3, "ids"), &ids);
    golden_free(&g);
    CHECK(n == 600);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        char path[600];
        snprintf(path, sizeof path, "%s/seed", golden_dir());
        moe_model *m;
        moe_session *s;
        if (moe_model_open(&m, path, NULL, NULL, 0) || moe_session_new(&s, m, 700, NULL, 0)) _exit(2);
        float *lg = malloc(sizeof(float) * moe_model_config(m)->vocab_size);
        moe_seq q = {.s = s, .tokens = ids, .n = n, .logits = lg};
        if (moe_step(m, &q, 1, NULL, NULL, 0)) _exit(3);
        _exit(0);
    }
    int status = 0;
    CHECK(pid > 0 && waitpid(pid, &status, 0) == pid);
    CHECKF(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child status %d", status);
    struct rusage ru;
    getrusage(RUSAGE_CHILDREN, &ru);
    CHECKF(ru.ru_maxrss < 100 * 1024, "max RSS %ld kB", ru.ru_maxrss);
    if (getenv("MOE_TEST_VERBOSE")) fprintf(stderr, "  seed 600 tokens: max RSS %ld kB\n", ru.ru_maxrss);
    free(ids);
}

/* ---- table and main ---------------------------------------------------------------------------- */

static const struct {
    const char *name;
    void (*fn)(void);
} tests[] = {
    {"rss_seed_600", test_rss_seed_600}, /* first: fork before this process grows */
    {"bf16_f16", test_bf16_f16},
    {"mxfp4_worked_example", test_mxfp4_worked_example},
    {"mxfp4_golden_dequant", test_mxfp4_golden_dequant},
    {"mxfp4_int8_kernels", test_mxfp4_int8_kernels},
    {"dot_levels", test_dot_levels},
    {"act_levels", test_act_levels},
    {"quant_blocks", test_quant_blocks},
    {"kquant_blocks", test_kquant_blocks},
    {"iq_kernels", test_iq_kernels},
    {"ggml_blocks", test_ggml_blocks},
    {"json", test_json},
    {"tokenizer_spec_pieces", test_tokenizer_spec_pieces},
    {"tokenizer_random_pieces", test_tokenizer_random_pieces},
    {"tokenizer_openai_ids", test_tokenizer_openai_ids},
    {"tokenizer_roundtrip", test_tokenizer_roundtrip},
    {"tokenizer_kimi_specials", test_tokenizer_kimi_specials},
    {"moe_tokenize_cli", test_moe_tokenize_cli},
    {"text_ready", test_text_ready},
    {"chat_spec_cases", test_chat_spec_cases},
    {"chat_ids", test_chat_ids},
    {"chat_json_dumps", test_chat_json_dumps},
    {"batch_basic", test_batch_basic},
    {"batch_logprobs", test_batch_logprobs},
    {"batch_choices", test_batch_choices},
    {"batch_faults", test_batch_faults},
    {"shipped_reference", test_shipped_reference},
    {"shipped_mxfp4_int8", test_shipped_mxfp4_int8},
    {"shipped_act16", test_shipped_act16},
    {"shipped_quality", test_shipped_quality},
    {"shipped_perplexity", test_shipped_perplexity},
    {"shipped_cli", test_shipped_cli},
    {"shipped_bench", test_shipped_bench},
    {"shipped_batch", test_shipped_batch},
    {"shipped_gguf_vocab", test_shipped_gguf_vocab},
    {"info_kernels", test_info_kernels},
    {"kda_chunked_vs_recurrent", test_kda_chunked_vs_recurrent},
#ifdef TEST_MXCSR
    {"kda_chunked_flush", test_kda_chunked_flush},
#endif
    {"mla_kernels", test_mla_kernels},
    {"mla16_kernels", test_mla16_kernels},
    {"mla8_kernels", test_mla8_kernels},
    {"matmul_threads", test_matmul_threads},
    {"matmul_act16", test_matmul_act16},
    {"dwconv_levels", test_dwconv_levels},
    {"expert_paths", test_expert_paths},
    {"gemm_kernels", test_gemm_kernels},
    {"golden_kimi", test_golden_kimi},
    {"golden_seed", test_golden_seed},
    {"golden_k3mx", test_golden_k3mx},
    {"golden_threads_scalar", test_golden_threads_scalar},
    {"mla_split_keys", test_mla_split_keys},
    {"kv_bf16", test_kv_bf16},
    {"kv_q8", test_kv_q8},
    {"golden_forced_paths", test_golden_forced_paths},
    {"cached_decode_vs_recompute", test_cached_decode_vs_recompute},
    {"batch_vs_alone", test_batch_vs_alone},
    {"small_batch_chunks", test_small_batch_chunks},
    {"snapshot_fork", test_snapshot_fork},
    {"api_args", test_api_args},
    {"model_info", test_model_info},
    {"sampling", test_sampling},
    {"bad_files", test_bad_files},
    {"bad_index", test_bad_index},
    {"moe_logits_cli", test_moe_logits_cli},
    {"gguf_golden", test_gguf_golden},
    {"gguf_quant_resume", test_gguf_quant_resume},
    {"gguf_split", test_gguf_split},
    {"gguf_iq", test_gguf_iq},
    {"gguf_kquants", test_gguf_kquants},
    {"cache_kquants", test_cache_kquants},
    {"gguf_bad", test_gguf_bad},
    {"fuzz_seeds", test_fuzz_seeds},
    {"cache_equivalence", test_cache_equivalence},
    {"cache_faults", test_cache_faults},
    {"cache_prefetch", test_cache_prefetch},
    {"concurrent_sessions", test_concurrent_sessions},
    {"step_team", test_step_team},
    {"concurrent_teams", test_concurrent_teams},
    {"cache_direct_io", test_cache_direct_io},
    {"rss_cache_budget", test_rss_cache_budget},
    {"dense_streaming", test_dense_streaming},
    {"rss_dense_streaming", test_rss_dense_streaming},
    {"k3_slice", test_k3_slice},
    {"plan", test_plan},
};

static void rm_tree(const char *dir) {
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd)) fprintf(stderr, "warning: could not remove %s\n", dir);
}

int main(int argc, char **argv) {
    const int nt = (int)(sizeof tests / sizeof *tests);
    if (argc > 1 && !strcmp(argv[1], "--list")) {
        for (int i = 0; i < nt; i++) printf("%s\n", tests[i].name);
        return 0;
    }
    const char *slash = strrchr(argv[0], '/');
    if (slash) snprintf(exe_dir, sizeof exe_dir, "%.*s", (int)(slash - argv[0]), argv[0]);
    snprintf(tmp_root, sizeof tmp_root, "/tmp/moe-test-XXXXXX");
    if (!mkdtemp(tmp_root)) {
        perror("mkdtemp");
        return 1;
    }
    int passed = 0, failed = 0;
    for (int i = 0; i < nt; i++) {
        int want = argc == 1;
        for (int a = 1; a < argc; a++) want |= !strcmp(argv[a], tests[i].name);
        if (!want) continue;
        int before = g_failed_checks;
        fprintf(stderr, "%-28s ", tests[i].name);
        tests[i].fn();
        if (g_failed_checks == before) {
            fprintf(stderr, "ok\n");
            passed++;
        } else {
            fprintf(stderr, "FAILED\n");
            failed++;
        }
    }
    rm_tree(tmp_root);
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
