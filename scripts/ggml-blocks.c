/* Writes test/ggml/blocks.bin: for each GGUF block format moe reads, values and bytes made by
 * ggml's own reference code, so that `make test` (ggml_blocks) checks our decoders and quantizers
 * against ggml itself rather than against our reading of it. Needs ggml's ggml-quants.c; see
 * test/ggml/README.md for how it was built (ggml's copy in the llama.rn npm package).
 *
 * Record per format (little-endian): char name[8]; int32 ggml type; int32 n values; int32 bytes
 * for n values; float x[n] (inputs); uint8 q[bytes] (ggml's quantization of x, no importance
 * matrix); float y[n] (ggml's dequantization of q); uint8 r[bytes] (random bytes; MXFP4 scale
 * bytes below 255); float z[n] (ggml's dequantization of r). The grid-codebook formats (IQ2_XXS ..
 * IQ1_M) come last, quantized with an importance matrix of ones (ggml asks for one). */
#include "ggml-quants.h"
#include "ggml.h"
#ifdef LM_GGML_API /* llama.rn's copy renames ggml's own symbols */
#define ggml_quantize_init lm_ggml_quantize_init
#define ggml_type lm_ggml_type
#endif
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef void (*deq_fn)(const void *, float *, int64_t);
typedef void (*qref_fn)(const float *, void *, int64_t);
typedef size_t (*qimat_fn)(const float *, void *, int64_t, int64_t, const float *);
struct fmt { const char *name; int type, block_values, block_bytes; deq_fn deq; qref_fn qref; qimat_fn qim; };

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t next(void) { rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17; return (uint32_t)(rng >> 16); }
static float nrand(void) {
    const float u = (next() % 1000000 + 1) / 1000001.0f, v = (next() % 1000000) / 1000000.0f;
    return sqrtf(-2 * logf(u)) * cosf(6.2831853f * v);
}

int main(int argc, char **argv) {
    if (argc != 2) { fprintf(stderr, "usage: ggml-blocks OUT.bin\n"); return 2; }
    const struct fmt F[] = {
        {"q4_0", 2, 32, 18, (deq_fn)dequantize_row_q4_0, (qref_fn)quantize_row_q4_0_ref, NULL},
        {"q4_1", 3, 32, 20, (deq_fn)dequantize_row_q4_1, (qref_fn)quantize_row_q4_1_ref, NULL},
        {"q5_0", 6, 32, 22, (deq_fn)dequantize_row_q5_0, (qref_fn)quantize_row_q5_0_ref, NULL},
        {"q5_1", 7, 32, 24, (deq_fn)dequantize_row_q5_1, (qref_fn)quantize_row_q5_1_ref, NULL},
        {"q8_0", 8, 32, 34, (deq_fn)dequantize_row_q8_0, (qref_fn)quantize_row_q8_0_ref, NULL},
        {"q2_k", 10, 256, 84, (deq_fn)dequantize_row_q2_K, (qref_fn)quantize_row_q2_K_ref, NULL},
        {"q3_k", 11, 256, 110, (deq_fn)dequantize_row_q3_K, (qref_fn)quantize_row_q3_K_ref, NULL},
        {"q4_k", 12, 256, 144, (deq_fn)dequantize_row_q4_K, (qref_fn)quantize_row_q4_K_ref, NULL},
        {"q5_k", 13, 256, 176, (deq_fn)dequantize_row_q5_K, (qref_fn)quantize_row_q5_K_ref, NULL},
        {"q6_k", 14, 256, 210, (deq_fn)dequantize_row_q6_K, (qref_fn)quantize_row_q6_K_ref, NULL},
        {"iq4_nl", 20, 32, 18, (deq_fn)dequantize_row_iq4_nl, NULL, (qimat_fn)quantize_iq4_nl},
        {"iq4_xs", 23, 256, 136, (deq_fn)dequantize_row_iq4_xs, NULL, (qimat_fn)quantize_iq4_xs},
        {"mxfp4", 39, 32, 17, (deq_fn)dequantize_row_mxfp4, (qref_fn)quantize_row_mxfp4_ref, NULL},
        {"iq2_xxs", 16, 256, 66, (deq_fn)dequantize_row_iq2_xxs, NULL, (qimat_fn)quantize_iq2_xxs},
        {"iq2_xs", 17, 256, 74, (deq_fn)dequantize_row_iq2_xs, NULL, (qimat_fn)quantize_iq2_xs},
        {"iq2_s", 22, 256, 82, (deq_fn)dequantize_row_iq2_s, NULL, (qimat_fn)quantize_iq2_s},
        {"iq3_xxs", 18, 256, 98, (deq_fn)dequantize_row_iq3_xxs, NULL, (qimat_fn)quantize_iq3_xxs},
        {"iq3_s", 21, 256, 110, (deq_fn)dequantize_row_iq3_s, NULL, (qimat_fn)quantize_iq3_s},
        {"iq1_s", 19, 256, 50, (deq_fn)dequantize_row_iq1_s, NULL, (qimat_fn)quantize_iq1_s},
        {"iq1_m", 29, 256, 56, (deq_fn)dequantize_row_iq1_m, NULL, (qimat_fn)quantize_iq1_m},
    };
    const int n = 1024;
    FILE *f = fopen(argv[1], "wb");
    if (!f) { perror(argv[1]); return 1; }
    float x[1024], y[1024], ones[1024];
    for (int i = 0; i < n; i++) ones[i] = 1.0f;
    unsigned char q[1024 * 2];
    for (size_t k = 0; k < sizeof F / sizeof *F; k++) {
        const int32_t hdr[3] = {F[k].type, n, n / F[k].block_values * F[k].block_bytes};
        char name[8] = {0};
        strncpy(name, F[k].name, 7);
        /* 4 stretches of 256 values: small, unit, large with an outlier, offset (Q4_1/Q5_1/K minimums) */
        for (int i = 0; i < n; i++) {
            const int s = i / 256;
            x[i] = nrand() * (s == 0 ? 1e-3f : s == 1 ? 1.0f : s == 2 ? 30.0f : 0.02f) + (s == 3 ? 0.01f : 0.0f);
        }
        x[600] = 900.0f;
        memset(x + 64, 0, sizeof(float) * 32); /* an all-zero block */
        if (F[k].qref) F[k].qref(x, q, n);
        else if (F[k].block_values == 256 && F[k].type != 23) ggml_quantize_init((enum ggml_type)F[k].type), F[k].qim(x, q, 1, n, ones);
        else F[k].qim(x, q, 1, n, NULL);
        F[k].deq(q, y, n);
        fwrite(name, 1, 8, f), fwrite(hdr, 4, 3, f), fwrite(x, 4, (size_t)n, f), fwrite(q, 1, (size_t)hdr[2], f), fwrite(y, 4, (size_t)n, f);
        for (int i = 0; i < hdr[2]; i++) q[i] = (unsigned char)next();
        if (F[k].type == 39) /* E8M0 255 is NaN in the OCP format; ggml reads it as 2^128 */
            for (int b = 0; b < n / 32; b++) q[b * 17] = (unsigned char)(q[b * 17] % 255);
        F[k].deq(q, y, n);
        fwrite(q, 1, (size_t)hdr[2], f), fwrite(y, 4, (size_t)n, f);
    }
    return fclose(f) ? 1 : 0;
}
