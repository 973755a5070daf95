/* kernels.c - tests of kernels and formats: every number format (decode, quantize, ggml bit compatibility) and every kernel of every
 * level this CPU runs against its scalar reference: dots, activations, convolution, products,
 * KDA and MLA cores. */
#include "test.h"

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

/* Four MXFP4 rows a pass (dot4, both layouts) give each row's dot bit for bit, at every level
 * that has them: rows of random codes with scales over the whole E8M0 range, the zero scale
 * (2^-127, subnormal) and NaN's (255) among them, lengths of 1 to 230 blocks */
static int same_bits(float a, float b) { return !memcmp(&a, &b, sizeof a); }

static void test_dot4_levels(void) {
    moe__kernels lv[MOE_KERNEL_LEVELS_MAX];
    const int nl = moe__kernel_levels(lv, MOE_KERNEL_LEVELS_MAX), lens[] = {32, 64, 96, 2048, 7168, 7360};
    for (int li = 0; li < nl; li++) /* a level without dot4 (scalar, NEON) has nothing to compare */
        for (int a = 0; a < (int)(sizeof lens / sizeof *lens); a++)
            for (int mode = 0; mode < 3; mode++) {
                const int n = lens[a], nb = n / 32;
                const int64_t rb = (int64_t)nb * 17; /* room for either layout's row */
                float *x = malloc(sizeof(float) * (size_t)n);
                uint8_t *w = malloc((size_t)rb * 4), *sc = malloc((size_t)nb * 4);
                for (int i = 0; i < n; i++) x[i] = nrand();
                for (int64_t i = 0; i < rb * 4; i++) w[i] = (uint8_t)(urand() * 256);
                for (int i = 0; i < nb * 4; i++) /* mode 0: typical scales, 1: any byte, 2: any but NaN's */
                    sc[i] = (uint8_t)(mode == 0 ? 110 + urand() * 20 : mode == 1 ? urand() * 256 : urand() * 255);
                if (mode == 2) sc[0] = 0, sc[nb * 4 - 1] = 0;
                for (int t = 0; t < 2; t++) {
                    const int type = t ? MOE_T_MXFP4_GGML : MOE_T_MXFP4;
                    if (!lv[li].dot4[type]) continue;
                    float o[4];
                    lv[li].dot4[type](w, t ? rb : nb * 16, t ? NULL : sc, x, n, o);
                    for (int r = 0; r < 4; r++) {
                        const float d = lv[li].dot[type](t ? w + r * rb : w + r * nb * 16, t ? NULL : sc + r * nb, x, n);
                        CHECKF(same_bits(d, o[r]), "%s %s n %d mode %d row %d: dot4 %g, dot %g", lv[li].isa, t ? "mxfp4 ggml" : "mxfp4", n, mode,
                               r, o[r], d);
                    }
                }
                free(x), free(w), free(sc);
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

/* moe__quantize_row's Q8_0 (SIMD where the CPU has it) against the scalar reference, bit for bit:
 * random rows at many scales, halves that round away from zero (a block whose largest value is
 * 127 has the scale 1, so k + 0.5 stays exact), values just under a half, subnormals, zeros */
static void test_quantize_q8_0(void) {
    enum { N = 32 * 64 };
    float *v = malloc(sizeof(float) * N);
    moe__block_q8_0 *a = malloc(sizeof *a * (N / 32)), *r = malloc(sizeof *r * (N / 32));
    for (int rep = 0; rep < 40; rep++) {
        const float scale = rep < 10 ? powf(10.0f, (float)(rep - 5) * 3) : 1.0f;
        for (int i = 0; i < N; i++) {
            const int kind = rep < 10 ? 0 : (int)(urand() * 5);
            if (kind == 0) v[i] = nrand() * scale;
            else if (kind == 1) v[i] = (float)((int)(urand() * 252) - 125) + (urand() < 0.5 ? 0.5f : -0.5f); /* halves, within 127 */
            else if (kind == 2) v[i] = nextafterf((float)(int)(urand() * 126) + 0.5f, 0.0f); /* just under a half */
            else if (kind == 3) v[i] = (urand() < 0.5 ? -1 : 1) * 1e-39f * urand(); /* subnormal */
            else v[i] = 0;
        }
        for (int b = 0; b < N / 32; b++) /* blocks whose largest magnitude is 127: scale 1 */
            if (rep >= 10 && b % 3 == 0) v[b * 32 + (rep % 32)] = rep % 2 ? 127.0f : -127.0f;
        if (rep == 39) memset(v, 0, sizeof(float) * 64); /* all-zero blocks */
        moe__quantize_row(MOE_T_Q8_0, v, a, N);
        moe__quantize_q8_0_ref(v, r, N);
        int bad = -1;
        for (int b = 0; b < N / 32 && bad < 0; b++)
            if (memcmp(&a[b], &r[b], sizeof a[b])) bad = b;
        CHECKF(bad < 0, "rep %d block %d: d %04x/%04x, q[0] %d/%d", rep, bad, bad < 0 ? 0 : a[bad].d, bad < 0 ? 0 : r[bad].d,
               bad < 0 ? 0 : a[bad].qs[0], bad < 0 ? 0 : r[bad].qs[0]);
    }
    /* BF16 rows decode as moe__bf16_to_f32 does, every bit pattern, at a ragged length */
    uint16_t *h = malloc(sizeof *h * 65536);
    float *f = malloc(sizeof *f * 65536);
    for (int i = 0; i < 65536; i++) h[i] = (uint16_t)(i * 40503u);
    moe__row_to_f32(MOE_T_BF16, h + 1, NULL, f, 65535);
    int wrong = 0;
    for (int i = 0; i < 65535; i++) {
        const float want = moe__bf16_to_f32(h[i + 1]);
        wrong += memcmp(&f[i], &want, 4) != 0;
    }
    CHECKF(!wrong, "%d BF16 values decoded differently", wrong);
    free(h), free(f);
    /* a ragged tail (n not a multiple of 8 blocks) and one block */
    moe__quantize_row(MOE_T_Q8_0, v, a, 32 * 5);
    moe__quantize_q8_0_ref(v, r, 32 * 5);
    CHECK(!memcmp(a, r, sizeof *a * 5));
    free(v), free(a), free(r);
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

static const int iq_types[N_IQ] = {MOE_T_IQ2_XXS, MOE_T_IQ2_XS, MOE_T_IQ2_S, MOE_T_IQ3_XXS, MOE_T_IQ3_S, MOE_T_IQ1_S, MOE_T_IQ1_M};

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

const test_case kernels_tests[] = {
    {"kernels.quantize_q8_0", test_quantize_q8_0, "Q8_0 quantization and BF16 rows (AVX2 where present) equal their references bit for bit: halves, subnormals, scales", 0},
    {"kernels.bf16_f16", test_bf16_f16, "half and bfloat16 conversions round-trip every bit pattern", 0},
    {"kernels.mxfp4_worked_example", test_mxfp4_worked_example, "MXFP4 decode of a real K3 row (golden/README.md's worked example)", 0},
    {"kernels.mxfp4_golden_dequant", test_mxfp4_golden_dequant, "MXFP4 decode matches the golden k3mx case's dequantized weights", 0},
    {"kernels.mxfp4_int8", test_mxfp4_int8_kernels, "MXFP4 times int8 activations: exact reference, every level bit for bit", 0},
    {"kernels.dot_levels", test_dot_levels, "float dot kernels of every level against the scalar reference", 0},
    {"kernels.dot4_levels", test_dot4_levels, "MXFP4 four rows a pass give each row's dot bit for bit, both layouts", 0},
    {"kernels.act_levels", test_act_levels, "activation kernels (sigmoid, silu, softplus, exp) of every level", 0},
    {"kernels.quant_blocks", test_quant_blocks, "Q8_0/Q4_0: ggml's rounding, round-trip bounds, every int8 kernel level", 0},
    {"kernels.kquant_blocks", test_kquant_blocks, "Q4_1 .. Q6_K and IQ4 formats: decode, quantize, every level and x8 layout", 0},
    {"kernels.iq_kernels", test_iq_kernels, "grid-codebook formats (IQ1_S .. IQ3_S): every level on random and extreme rows", 0},
    {"kernels.ggml_blocks", test_ggml_blocks, "our block formats against ggml's own quantize/dequantize (test/ggml)", 0},
    {"kernels.info_kernels", test_info_kernels, "moe_model_info.kernels names the level used; --kernels by name", 0},
    {"kernels.kda_chunked_vs_recurrent", test_kda_chunked_vs_recurrent, "KDA chunked form and each level's recurrence against the scalar one", 0},
#ifdef TEST_MXCSR
    {"kernels.kda_chunked_flush", test_kda_chunked_flush, "KDA's chunked form flushes denormals and restores the caller's MXCSR", 0},
#endif
    {"kernels.mla_kernels", test_mla_kernels, "absorbed-MLA block kernels of every level against the references", 0},
    {"kernels.mla16_kernels", test_mla16_kernels, "bf16-cache MLA kernels of every level against the references", 0},
    {"kernels.mla8_kernels", test_mla8_kernels, "int8-cache MLA kernels of every level against the references", 0},
    {"kernels.matmul_threads", test_matmul_threads, "the parallel product on 2-16 threads gives the one-thread bits", 0},
    {"kernels.matmul_act16", test_matmul_act16, "two-part int8 input through the product: within its rounding bound", 0},
    {"kernels.dwconv_levels", test_dwconv_levels, "KDA's short convolution at every level against the reference", 0},
    {"kernels.gemm_kernels", test_gemm_kernels, "prefill matrix tiles (F32, BF16) of every level against the reference", 0},
    {0}
};
