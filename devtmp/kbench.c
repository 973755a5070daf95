/* throwaway: dot kernels' rate over 16384 rows of 2048 values, one thread, best of 20 passes */
#define _POSIX_C_SOURCE 200809L
#define MOE_INTERNAL
#include "../moe.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
    const int R = argc > 1 ? atoi(argv[1]) : 16384, n = 2048;
    moe__kernels lv[8];
    const int nl = moe__kernel_levels(lv, 8);
    const moe__kernels *k = &lv[nl - 1];
    const int types[] = {MOE_T_Q4_0, MOE_T_Q8_0, MOE_T_Q4_K, MOE_T_Q5_K, MOE_T_Q6_K, MOE_T_Q2_K, MOE_T_Q3_K, MOE_T_IQ4_NL, MOE_T_IQ4_XS};
    const char *names[] = {"q4_0", "q8_0", "q4_k", "q5_k", "q6_k", "q2_k", "q3_k", "iq4_nl", "iq4_xs"};
    float *v = malloc(sizeof(float) * n);
    moe__block_q8a *x = malloc(sizeof *x * (n / 32) * 4);
    for (int i = 0; i < n; i++) v[i] = (float)rand() / RAND_MAX - 0.5f;
    for (int t = 0; t < 4; t++) k->quant_q8a(v, x + t * (n / 32), n);
    printf("level %s\n", k->isa);
    for (int ti = 0; ti < 9; ti++) {
        const int type = types[ti];
        const int64_t rb = moe__row_bytes(type, n);
        unsigned char *w = malloc((size_t)rb * R);
        for (int r = 0; r < 64; r++) { for (int i = 0; i < n; i++) v[i] = (float)rand() / RAND_MAX - 0.5f; moe__quantize_row(type, v, w + (size_t)r * rb, n); }
        for (int r = 64; r < R; r++) memcpy(w + (size_t)r * rb, w + (size_t)(r % 64) * rb, (size_t)rb);
        double best = 1e9, best4 = 1e9; float sink = 0;
        for (int p = 0; p < 20; p++) {
            double t0 = now();
            for (int r = 0; r < R; r++) sink += k->dotq[type](w + (size_t)r * rb, x, n);
            double t = now() - t0; if (t < best) best = t;
            if (k->dotq4[type]) {
                float o[4];
                t0 = now();
                for (int r = 0; r < R; r++) { k->dotq4[type](w + (size_t)r * rb, x, n / 32, n, o); sink += o[0]; }
                t = now() - t0; if (t < best4) best4 = t;
            }
        }
        double bx = 0;
        const int xt = moe__x8_of(type);
        if (xt >= 0 && k->dotq8[xt]) {
            const int64_t xb = moe__row_bytes(xt, n) * 8;
            unsigned char *pk = malloc((size_t)xb * (R / 8));
            for (int g = 0; g < R / 8; g++) moe__repack_x8(type, w + (size_t)g * 8 * rb, rb, NULL, pk + (size_t)g * xb, n);
            bx = 1e9;
            for (int p = 0; p < 20; p++) {
                float o[8];
                double t0 = now();
                for (int g = 0; g < R / 8; g++) { k->dotq8[xt](pk + (size_t)g * xb, x, n, o); sink += o[0]; }
                double t = now() - t0; if (t < bx) bx = t;
            }
            bx = (double)xb * (R / 8) / bx / 1e9;
            free(pk);
        }
        printf("x8 %5.1f GB/s  ", bx);
        printf("%-7s %4lld B/row  1 row: %6.1f GB/s  %6.2f Gval/s   4 rows: %6.2f Gval-rows/s (%.0f)\n", names[ti], (long long)rb, (double)rb * R / best / 1e9, (double)n * R / best / 1e9,
               k->dotq4[type] ? 4.0 * n * R / best4 / 1e9 : 0.0, sink * 0);
        free(w);
    }
    return 0;
}
