/* quant.c - weight formats and math kernels of moe: number formats and their block layouts
 * (decode, quantize, interleave), dot products and matrix tiles of a stored weight row with
 * activation rows, the elementwise functions, and the KDA and MLA cores. No model logic and no
 * threads here: callers split rows across threads.
 * Copyright (c) 2026 the moe authors. MIT License: see LICENSE (the three runtime files are
 * under it whole; keep this notice in copies).
 *
 * Every kernel has a scalar reference (*_ref, always compiled). The SIMD kernels of each level
 * are compiled with per-function target attributes and chosen at run time (moe__kernels_init),
 * so a plain -O2 build runs on any CPU and uses what it has; test/kernels.c checks each level
 * against the references. The file reads front to back; grep a part's exact banner string:
 *
 *   "PART 1: NUMBER FORMATS"      conversions, block layouts, decode, quantize, x8 interleaving
 *   "PART 2: SCALAR REFERENCES"   every kernel's reference: dots, tiles, elementwise, MLA, KDA
 *   "PART 3: X86 TEMPLATES"       macros that stamp one kernel for several x86 levels
 *   "PART 4: AVX2"                the avx2 level (AVX2, FMA, F16C)
 *   "PART 5: AVX-VNNI"            the avxvnni level: avx2 with VEX-encoded VPDPBUSD
 *   "PART 6: AVX-512"             the avx512 and avx512vnni levels (and AVX512_BF16 attention)
 *   "PART 7: AMX"                 the amx level: Intel's tile unit
 *   "PART 8: NEON"                the neon and neon-dotprod levels (AArch64)
 *   "PART 9: KERNEL LEVELS"       CPU features, the table of each level's kernels, the choice
 *   "APPENDIX: CODEBOOKS"         the grid formats' fixed tables (ggml's)
 *
 * How to add a weight format: its type in moe.h's enum (and block struct), its decode in
 * moe__row_to_f32 and size in moe__row_bytes (PART 1), its reference dot (PART 2, a dotq_*_ref
 * or dot_*_ref), its entry in kernels_scalar (PART 9); then SIMD kernels level by level, each
 * added to its level's table and checked by test/kernels.c against the reference. */
#define MOE_INTERNAL
#include "moe.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#if !defined(MOE_NO_SIMD) && (defined(__GNUC__) || defined(__clang__)) && \
    (defined(__x86_64__) || defined(_M_X64))
#define MOE_X86 1
#include <cpuid.h>
#include <immintrin.h>
#define MOE_TARGET(s) __attribute__((target(s)))
/* AMX kernels: Linux x86-64 (the tile state is asked for by a system call), GCC 11 or clang 12 on */
#if defined(__linux__) && ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define MOE_AMX_BUILD 1
#endif
#endif

/* full unrolling of the k-quant kernels' loops over tokens and chunks (fixed, small counts), so
 * their per-token vectors stay in registers: asked of GCC only (clang unrolls such loops on its
 * own, and with the hints a sanitizer build of this file took 7 minutes instead of 17 s) */
#if defined(__GNUC__) && !defined(__clang__)
#define MOE_UNROLL4 _Pragma("GCC unroll 4")
#define MOE_UNROLL8 _Pragma("GCC unroll 8")
#else
#define MOE_UNROLL4
#define MOE_UNROLL8
#endif
#if defined(__GNUC__) || defined(__clang__)
#define MOE_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define MOE_ALWAYS_INLINE inline
#endif

#if !defined(MOE_NO_SIMD) && (defined(__GNUC__) || defined(__clang__)) && defined(__aarch64__)
#define MOE_NEON 1 /* NEON is part of every AArch64 CPU; the dot-product extension is checked */
#include <arm_neon.h>
#if defined(__linux__)
#include <sys/auxv.h>
#endif
#endif

#if defined(MOE_X86) || defined(MOE_NEON)
/* Software prefetch of the weight stream, PREFETCH_AHEAD bytes ahead of the block being read.
 * Decode reads each weight once; with the hardware prefetcher alone one core's Q4_0 kernel
 * streamed at 0.8 of the read bandwidth, with this at the read bandwidth (bench/RESULTS.md).
 * Past the end of a row it fetches the rows the same thread reads next (threads take contiguous
 * ranges of rows). A prefetch never faults; the address is formed as an integer, so no pointer
 * past an object is made. */
#define PREFETCH_AHEAD 8192
/* the address bytes past p, formed as an integer (it may lie past the end of p's object) */
static inline const void *bytes_past(const void *p, size_t bytes) { return (const void *)((uintptr_t)p + bytes); }
/* the lines of bytes at p (which may lie past the end of the data: never dereferenced), with
 * __builtin_prefetch's locality (a constant): 3 into L1, 2 into L2 */
#define PREFETCH_LINES(p, bytes, locality) \
    for (int o_ = 0; o_ < (bytes); o_ += 64) __builtin_prefetch(bytes_past(p, (size_t)o_), 0, locality)
static inline void prefetch_row(const void *p, int bytes) { PREFETCH_LINES(p, bytes, 3); }
/* prefetch_row into L2 only (prefetcht1, PLDL2KEEP): on Zen 4 a burst of prefetches into L1 (8 keys of
 * the int8 latent cache, 72 lines) left the scores kernel reading its keys from memory at half
 * the speed of keys already in L3; into L2 it ran as fast as from L3 (bench/RESULTS.md) */
static inline void prefetch_row_l2(const void *p, int bytes) { PREFETCH_LINES(p, bytes, 2); }
static inline void prefetch_ahead(const void *p, int bytes) { prefetch_row(bytes_past(p, PREFETCH_AHEAD), bytes); }
static inline void prefetch_ahead_l2(const void *p, int bytes) { prefetch_row_l2(bytes_past(p, PREFETCH_AHEAD), bytes); }
#endif

#if defined(MOE_X86) || defined(MOE_NEON)
/* Activation rows per pass over a call's weight rows: about 256 KB of them, so that they stay in
 * L2 while each group of 4 weight rows meets them (all T rows at once ran from L3/memory: 4x
 * slower); a multiple of 4 */
static inline int gemm_token_block(int64_t K) {
    const int64_t t = 65536 / K / 4 * 4;
    return t > 4 ? (int)t : 4;
}
#endif

/* =================================================================================================
 * PART 1: NUMBER FORMATS
 * =================================================================================================
 * The weight formats as stored: BF16, F16, MXFP4 (OCP MX, in the compressed-tensors layout and
 * ggml's), and ggml's block formats (Q8_0 .. Q6_K, IQ4, the grid codebooks), bit for bit as
 * ggml writes them. Here: conversions, bytes per row, decoding a row to f32 (moe__row_to_f32),
 * quantizing f32 rows (moe__quantize_row, ggml's rounding), and interleaving 8 rows at load into
 * the x8 layouts the SIMD levels read (moe__repack_x8). Relies on moe.h's block structs only. */

/* ---- number formats -------------------------------------------------------------------- */

float moe__bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t moe__f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

float moe__f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            u = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t moe__f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000;
    int32_t exp = (int32_t)((u >> 23) & 0xff) - 127 + 15;
    uint32_t man = u & 0x7fffff;
    if (((u >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (man ? 0x200 : 0));
    if (exp >= 31) return (uint16_t)(sign | 0x7c00);
    if (exp <= 0) {
        if (exp < -10) return (uint16_t)sign;
        man |= 0x800000;
        uint32_t shift = (uint32_t)(14 - exp), half = 1u << (shift - 1);
        uint32_t r = man >> shift, rem = man & ((1u << shift) - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = ((uint32_t)exp << 10) | (man >> 13), rem = man & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) r++; /* may carry into the exponent: ok */
    return (uint16_t)(sign | r);
}

/* OCP MX E2M1 code -> value; bit 3 is the sign (code 8 is -0.0). */
const float moe__e2m1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* 2 x E2M1 as int8 (exact: |v| <= 12), the integer kernels' decoding */
static const int8_t e2m1x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* E8M0 scale byte -> 2^(s-127), built from bits (exact); 255 is NaN in the MX spec. The bits of
 * all 256 in a table, for kernels that load a block's scale rather than compute it. */
#define E8M0_BITS(s) ((s) == 0 ? 0x00400000u : (s) == 255 ? 0x7fc00000u : (uint32_t)(s) << 23)
#define E8M0_BITS4(s) E8M0_BITS(s), E8M0_BITS((s) + 1), E8M0_BITS((s) + 2), E8M0_BITS((s) + 3)
#define E8M0_BITS16(s) E8M0_BITS4(s), E8M0_BITS4((s) + 4), E8M0_BITS4((s) + 8), E8M0_BITS4((s) + 12)
#define E8M0_BITS64(s) E8M0_BITS16(s), E8M0_BITS16((s) + 16), E8M0_BITS16((s) + 32), E8M0_BITS16((s) + 48)
static const uint32_t e8m0_bits[256] = {E8M0_BITS64(0), E8M0_BITS64(64), E8M0_BITS64(128), E8M0_BITS64(192)};

static inline float e8m0(uint8_t s) {
    float f;
    memcpy(&f, &e8m0_bits[s], 4);
    return f;
}

_Static_assert(sizeof(moe__block_q8_0) == 34, "ggml block_q8_0 is 34 bytes");
_Static_assert(sizeof(moe__block_q4_0) == 18, "ggml block_q4_0 is 18 bytes");
_Static_assert(sizeof(moe__block_q8a) == 40, "q8a block is 40 bytes");
_Static_assert(sizeof(moe__block_mxfp4) == 17, "ggml block_mxfp4 is 17 bytes");
_Static_assert(sizeof(moe__block_q4_0x8) == 144, "q4_0x8 block is 144 bytes");
_Static_assert(sizeof(moe__block_q8_0x8) == 272, "q8_0x8 block is 272 bytes");
_Static_assert(sizeof(moe__block_mxfp4x8) == 8 * sizeof(moe__block_mxfp4), "an mxfp4x8 block is 8 ggml blocks");
_Static_assert(sizeof(moe__block_q4_1) == 20 && sizeof(moe__block_q5_0) == 22 && sizeof(moe__block_q5_1) == 24, "ggml Q4_1/Q5_0/Q5_1 blocks");
_Static_assert(sizeof(moe__block_q4_k) == 144 && sizeof(moe__block_q5_k) == 176 && sizeof(moe__block_q6_k) == 210, "ggml k-quant blocks");
_Static_assert(sizeof(moe__block_q2_k) == 84 && sizeof(moe__block_q3_k) == 110, "ggml Q2_K, Q3_K blocks");
_Static_assert(sizeof(moe__block_iq4_nl) == 18 && sizeof(moe__block_iq4_xs) == 136, "ggml IQ4_NL, IQ4_XS blocks");
_Static_assert(sizeof(moe__block_iq2_xxs) == 66 && sizeof(moe__block_iq2_xs) == 74 && sizeof(moe__block_iq2_s) == 82, "ggml IQ2 blocks");
_Static_assert(sizeof(moe__block_iq3_xxs) == 98 && sizeof(moe__block_iq3_s) == 110, "ggml IQ3 blocks");
_Static_assert(sizeof(moe__block_iq1_s) == 50 && sizeof(moe__block_iq1_m) == 56, "ggml IQ1 blocks");
_Static_assert(sizeof(moe__block_iq4_xsx8) == 1104 && sizeof(moe__block_q2_kx8) == 672 && sizeof(moe__block_q3_kx8) == 912, "iq4_xs, q2_k, q3_k x8 blocks");
_Static_assert(sizeof(moe__block_q4_kx8) == 1184 && sizeof(moe__block_q5_kx8) == 1440 && sizeof(moe__block_q6_kx8) == 1680, "q4_kx8, q5_kx8, q6_kx8 blocks");

int moe__is_quant(int type) {
    switch (type) {
    case MOE_T_Q8_0: case MOE_T_Q4_0: case MOE_T_Q4_1: case MOE_T_Q5_0: case MOE_T_Q5_1: case MOE_T_Q4_K: case MOE_T_Q5_K: case MOE_T_Q6_K:
    case MOE_T_Q2_K: case MOE_T_Q3_K: case MOE_T_IQ4_NL: case MOE_T_IQ4_XS: return 1;
    default: return moe__is_iq(type);
    }
}

int moe__block_values(int type) {
    switch (type) {
    case MOE_T_Q4_K: case MOE_T_Q5_K: case MOE_T_Q6_K: case MOE_T_Q2_K: case MOE_T_Q3_K: case MOE_T_IQ4_XS: return 256;
    case MOE_T_IQ2_XXS: case MOE_T_IQ2_XS: case MOE_T_IQ2_S: case MOE_T_IQ3_XXS: case MOE_T_IQ3_S: case MOE_T_IQ1_S: case MOE_T_IQ1_M: return 256;
    case MOE_T_F32: case MOE_T_F16: case MOE_T_BF16: case MOE_T_U8: case MOE_T_I32: return 1;
    default: return 32;
    }
}

int64_t moe__row_bytes(int type, int64_t n) {
    switch (type) {
    case MOE_T_Q8_0: return n / 32 * (int64_t)sizeof(moe__block_q8_0);
    case MOE_T_MXFP4_GGML: return n / 32 * (int64_t)sizeof(moe__block_mxfp4);
    case MOE_T_Q4_0X8: return n / 32 * (int64_t)sizeof(moe__block_q4_0x8) / 8; /* per row, on average */
    case MOE_T_Q8_0X8: return n / 32 * (int64_t)sizeof(moe__block_q8_0x8) / 8;
    case MOE_T_MXFP4X8: return n / 32 * (int64_t)sizeof(moe__block_mxfp4x8) / 8;
    case MOE_T_Q4_0: return n / 32 * (int64_t)sizeof(moe__block_q4_0);
    case MOE_T_Q4_1: return n / 32 * (int64_t)sizeof(moe__block_q4_1);
    case MOE_T_Q5_0: return n / 32 * (int64_t)sizeof(moe__block_q5_0);
    case MOE_T_Q5_1: return n / 32 * (int64_t)sizeof(moe__block_q5_1);
    case MOE_T_Q4_K: return n / 256 * (int64_t)sizeof(moe__block_q4_k);
    case MOE_T_Q5_K: return n / 256 * (int64_t)sizeof(moe__block_q5_k);
    case MOE_T_Q6_K: return n / 256 * (int64_t)sizeof(moe__block_q6_k);
    case MOE_T_Q2_K: return n / 256 * (int64_t)sizeof(moe__block_q2_k);
    case MOE_T_Q3_K: return n / 256 * (int64_t)sizeof(moe__block_q3_k);
    case MOE_T_IQ4_NL: return n / 32 * (int64_t)sizeof(moe__block_iq4_nl);
    case MOE_T_IQ4_XS: return n / 256 * (int64_t)sizeof(moe__block_iq4_xs);
    case MOE_T_IQ2_XXS: return n / 256 * (int64_t)sizeof(moe__block_iq2_xxs);
    case MOE_T_IQ2_XS: return n / 256 * (int64_t)sizeof(moe__block_iq2_xs);
    case MOE_T_IQ2_S: return n / 256 * (int64_t)sizeof(moe__block_iq2_s);
    case MOE_T_IQ3_XXS: return n / 256 * (int64_t)sizeof(moe__block_iq3_xxs);
    case MOE_T_IQ3_S: return n / 256 * (int64_t)sizeof(moe__block_iq3_s);
    case MOE_T_IQ1_S: return n / 256 * (int64_t)sizeof(moe__block_iq1_s);
    case MOE_T_IQ1_M: return n / 256 * (int64_t)sizeof(moe__block_iq1_m);
    case MOE_T_Q4_KX8: return n / 256 * (int64_t)sizeof(moe__block_q4_kx8) / 8;
    case MOE_T_Q5_KX8: return n / 256 * (int64_t)sizeof(moe__block_q5_kx8) / 8;
    case MOE_T_IQ4_XSX8: return n / 256 * (int64_t)sizeof(moe__block_iq4_xsx8) / 8;
    case MOE_T_Q2_KX8: return n / 256 * (int64_t)sizeof(moe__block_q2_kx8) / 8;
    case MOE_T_Q3_KX8: return n / 256 * (int64_t)sizeof(moe__block_q3_kx8) / 8;
    case MOE_T_Q6_KX8: return n / 256 * (int64_t)sizeof(moe__block_q6_kx8) / 8;
    case MOE_T_F32: case MOE_T_I32: return 4 * n;
    case MOE_T_F16: case MOE_T_BF16: return 2 * n;
    case MOE_T_MXFP4: return n / 2;
    default: return n;
    }
}

/* Q4_K/Q5_K: the 6-bit scale and minimum of sub-block j (j < 4: low 6 bits of bytes j and j + 4;
 * after: a nibble of byte j + 4 and the top 2 bits of byte j - 4 or j) */
static void k4_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) *sc = s[j] & 63, *m = s[j + 4] & 63;
    else *sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4, *m = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
}

#if defined(MOE_X86) || defined(MOE_NEON)
/* Q4_K/Q5_K's 12 scale bytes -> the 8 scales (bytes 0..7) and 8 minimums (8..15) */
static inline void k4_unpack_scales(const uint8_t *s, uint8_t out[16]) {
    uint32_t a, b, c, v[4];
    memcpy(&a, s, 4), memcpy(&b, s + 4, 4), memcpy(&c, s + 8, 4);
    v[0] = a & 0x3f3f3f3fu;                                          /* scales 0..3 */
    v[1] = (c & 0x0f0f0f0fu) | ((a >> 6) & 0x03030303u) << 4;        /* scales 4..7 */
    v[2] = b & 0x3f3f3f3fu;                                          /* minimums 0..3 */
    v[3] = ((c >> 4) & 0x0f0f0f0fu) | ((b >> 6) & 0x03030303u) << 4; /* minimums 4..7 */
    memcpy(out, v, 16);
}
#endif

/* a Q4_1 / Q5_0 / Q5_1 block's fields (block i of a row): half-precision scale and minimum (0 for
 * Q5_0), the fifth bits (0 for Q4_1), the nibbles */
typedef struct { uint16_t d, m; uint32_t qh; const uint8_t *qs; } q32_fields;
static inline q32_fields q32_block(int type, const void *row, int64_t i) {
    const unsigned char *b = (const unsigned char *)row + i * moe__row_bytes(type, 32);
    q32_fields f = {0, 0, 0, NULL};
    memcpy(&f.d, b, 2);
    if (type == MOE_T_Q5_0) memcpy(&f.qh, b + 2, 4), f.qs = b + 6;
    else if (type == MOE_T_Q5_1) memcpy(&f.m, b + 2, 2), memcpy(&f.qh, b + 4, 4), f.qs = b + 8;
    else memcpy(&f.m, b + 2, 2), f.qs = b + 4;
    return f;
}

/* IQ4_NL's and IQ4_XS's 16 levels (ggml's kvalues_iq4nl), ascending */
const int8_t moe__iq4nl_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* ---- the grid-codebook formats (IQ1_S .. IQ3_S) -------------------------------------------
 * Each block's bits index fixed codebooks of 8 (IQ3: 4) values (the appendix at the end of
 * this file holds them, as ggml has them). */
static const uint64_t iq2xxs_grid[256]; /* appendix */
static const uint64_t iq2xs_grid[512]; /* appendix */
static const uint64_t iq2s_grid[1024]; /* appendix */
static const uint32_t iq3xxs_grid[256]; /* appendix */
static const uint32_t iq3s_grid[512]; /* appendix */
static const uint64_t iq1s_grid[2048]; /* appendix */

/* byte k of v, k = 0..7 (the tables' value order whatever the host's byte order) */
static inline void grid_bytes(int8_t *q, uint64_t v) {
    for (int k = 0; k < 8; k++) q[k] = (int8_t)(uint8_t)(v >> (8 * k));
}

/* 8 positive grid bytes with value k negated where bit k of s is set */
static inline uint64_t grid_signed(uint64_t g, unsigned s) {
    uint64_t m = ((uint64_t)(s & 255) * 0x0101010101010101ULL) & 0x8040201008040201ULL; /* byte k: bit k of s */
    m = (((m + 0x7f7f7f7f7f7f7f7fULL) | m) & 0x8080808080808080ULL) >> 7;            /* byte k: 1 where set */
    return (g ^ (m * 0xff)) + m; /* -g per byte: no carry between bytes, no grid byte is 0 */
}

static const uint8_t signs_of7[128]; /* appendix */
#if defined(MOE_X86) || defined(MOE_NEON)
static const uint64_t sign_masks7[128]; /* appendix */
#endif

static inline uint32_t le32_of(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }

/* Values 32 s .. 32 s + 31 of a row of an IQ1_S .. IQ3_S matrix as value = dc sc[l / 16] q[l]:
 * q the integers, sc the two 16s' odd integer scales, dc the block's common factor (ggml's
 * d (ls + 1/2) / 4 = (d / 8) (2 ls + 1), exactly, as only powers of two differ; IQ1's g +- 1/8
 * as q = 8 g +- 1 with d / 8, likewise exact). Returns dc. */
static MOE_ALWAYS_INLINE float iq_sub(int type, const void *row, int64_t s, int8_t q[32], int sc[2]) {
    const int j = (int)(s % 8);
    switch (type) {
    case MOE_T_IQ2_XXS: {
        const moe__block_iq2_xxs *b = (const moe__block_iq2_xxs *)row + s / 8;
        const uint32_t idx = b->qs[4 * j] | (uint32_t)b->qs[4 * j + 1] << 16, aux = b->qs[4 * j + 2] | (uint32_t)b->qs[4 * j + 3] << 16;
        for (int l = 0; l < 4; l++) grid_bytes(q + 8 * l, grid_signed(iq2xxs_grid[(idx >> (8 * l)) & 255], signs_of7[(aux >> (7 * l)) & 127]));
        sc[0] = sc[1] = 2 * (int)(aux >> 28) + 1;
        return moe__f16_to_f32(b->d) * 0.125f;
    }
    case MOE_T_IQ2_XS: {
        const moe__block_iq2_xs *b = (const moe__block_iq2_xs *)row + s / 8;
        for (int l = 0; l < 4; l++) {
            const unsigned v = b->qs[4 * j + l];
            grid_bytes(q + 8 * l, grid_signed(iq2xs_grid[v & 511], signs_of7[v >> 9]));
        }
        sc[0] = 2 * (b->scales[j] & 15) + 1, sc[1] = 2 * (b->scales[j] >> 4) + 1;
        return moe__f16_to_f32(b->d) * 0.125f;
    }
    case MOE_T_IQ2_S: {
        const moe__block_iq2_s *b = (const moe__block_iq2_s *)row + s / 8;
        for (int l = 0; l < 4; l++) {
            const unsigned idx = b->qs[4 * j + l] | ((unsigned)b->qh[j] << (8 - 2 * l) & 0x300);
            grid_bytes(q + 8 * l, grid_signed(iq2s_grid[idx], b->qs[32 + 4 * j + l]));
        }
        sc[0] = 2 * (b->scales[j] & 15) + 1, sc[1] = 2 * (b->scales[j] >> 4) + 1;
        return moe__f16_to_f32(b->d) * 0.125f;
    }
    case MOE_T_IQ3_XXS: {
        const moe__block_iq3_xxs *b = (const moe__block_iq3_xxs *)row + s / 8;
        const uint8_t *qs = b->qs + 8 * j;
        const uint32_t aux = le32_of(b->qs + 64 + 4 * j);
        for (int l = 0; l < 4; l++) {
            const uint64_t g = iq3xxs_grid[qs[2 * l]] | (uint64_t)iq3xxs_grid[qs[2 * l + 1]] << 32;
            grid_bytes(q + 8 * l, grid_signed(g, signs_of7[(aux >> (7 * l)) & 127]));
        }
        sc[0] = sc[1] = 2 * (int)(aux >> 28) + 1;
        return moe__f16_to_f32(b->d) * 0.25f;
    }
    case MOE_T_IQ3_S: {
        const moe__block_iq3_s *b = (const moe__block_iq3_s *)row + s / 8;
        const uint8_t *qs = b->qs + 8 * j;
        const unsigned h = b->qh[j];
        for (int l = 0; l < 4; l++) {
            const uint64_t g = iq3s_grid[qs[2 * l] | (h << (8 - 2 * l) & 256)] | (uint64_t)iq3s_grid[qs[2 * l + 1] | (h << (7 - 2 * l) & 256)] << 32;
            grid_bytes(q + 8 * l, grid_signed(g, b->signs[4 * j + l]));
        }
        sc[0] = sc[1] = 2 * ((b->scales[j / 2] >> (4 * (j % 2))) & 15) + 1;
        return moe__f16_to_f32(b->d);
    }
    case MOE_T_IQ1_S: {
        const moe__block_iq1_s *b = (const moe__block_iq1_s *)row + s / 8;
        const unsigned h = b->qh[j];
        const int e = (h & 0x8000) ? -1 : 1;
        for (int l = 0; l < 4; l++) {
            grid_bytes(q + 8 * l, iq1s_grid[b->qs[4 * j + l] | ((h >> (3 * l)) & 7) << 8]);
            for (int k = 0; k < 8; k++) q[8 * l + k] = (int8_t)(8 * q[8 * l + k] + e);
        }
        sc[0] = sc[1] = 2 * (int)((h >> 12) & 7) + 1;
        return moe__f16_to_f32(b->d) * 0.125f;
    }
    case MOE_T_IQ1_M: {
        const moe__block_iq1_m *b = (const moe__block_iq1_m *)row + s / 8;
        unsigned w[4];
        for (int k = 0; k < 4; k++) w[k] = b->scales[2 * k] | (unsigned)b->scales[2 * k + 1] << 8;
        const uint16_t dh = (uint16_t)((w[0] >> 12) | ((w[1] >> 8) & 0xf0) | ((w[2] >> 4) & 0xf00) | (w[3] & 0xf000));
        for (int l = 0; l < 4; l++) {
            const unsigned h = b->qh[2 * j + l / 2] >> (4 * (l % 2)); /* this 8's 3 index bits, then its shift's sign */
            grid_bytes(q + 8 * l, iq1s_grid[b->qs[4 * j + l] | (h & 7) << 8]);
            const int e = (h & 8) ? -1 : 1;
            for (int k = 0; k < 8; k++) q[8 * l + k] = (int8_t)(8 * q[8 * l + k] + e);
        }
        const unsigned sw = w[j / 2] >> (6 * (j % 2));
        sc[0] = 2 * (int)(sw & 7) + 1, sc[1] = 2 * (int)((sw >> 3) & 7) + 1;
        return moe__f16_to_f32(dh) * 0.125f;
    }
    default: MOE_ASSERT(0 && "not a grid-codebook format");
    }
    return 0;
}

static inline int iq_type(int type) {
    return type == MOE_T_IQ2_XXS || type == MOE_T_IQ2_XS || type == MOE_T_IQ2_S || type == MOE_T_IQ3_XXS || type == MOE_T_IQ3_S ||
           type == MOE_T_IQ1_S || type == MOE_T_IQ1_M;
}
int moe__is_iq(int type) { return iq_type(type); }

/* Q3_K's 6-bit scale i (0..15) from its 12 bytes: low 4 bits in byte i % 8 (low nibble for i < 8),
 * high 2 bits at bit 2 (i / 4) of byte 8 + i % 4 */
static int q3k_scale(const uint8_t *s, int i) {
    const int lo = i < 8 ? s[i] & 15 : s[i - 8] >> 4;
    return lo | ((s[8 + i % 4] >> (2 * (i / 4))) & 3) << 4;
}

/* stores u (0..63) as Q3_K's scale i, into bytes that start zeroed */
static void q3k_put_scale(uint8_t *s, int i, int u) {
    s[i % 8] |= (uint8_t)((u & 15) << (4 * (i / 8)));
    s[8 + i % 4] |= (uint8_t)((u >> 4) << (2 * (i / 4)));
}

/* IQ4_XS's 6-bit scale of sub-block j (0..7) */
static int iq4xs_scale(const moe__block_iq4_xs *b, int j) {
    return ((b->scales_l[j / 2] >> (4 * (j % 2))) & 15) | ((b->scales_h >> (2 * j)) & 3) << 4;
}

/* stores ls (0..63) as IQ4_XS's scale of sub-block j, into fields that start zeroed */
static void iq4xs_put_scale(moe__block_iq4_xs *b, int j, int ls) {
    b->scales_l[j / 2] |= (uint8_t)((ls & 15) << (4 * (j % 2)));
    b->scales_h |= (uint16_t)((ls >> 4) << (2 * j));
}

#if defined(MOE_X86)
/* all 8 of them in the bytes of a 64-bit word (the nibbles and 2-bit fields spread by shifts) */
static inline uint64_t iq4xs_scales8(const moe__block_iq4_xs *b) {
    uint32_t l32;
    memcpy(&l32, b->scales_l, 4);
    uint64_t lo = l32, hi = b->scales_h;
    lo = (lo | lo << 16) & 0x0000ffff0000ffffULL, lo = (lo | lo << 8) & 0x00ff00ff00ff00ffULL, lo = (lo | lo << 4) & 0x0f0f0f0f0f0f0f0fULL;
    hi = (hi | hi << 24) & 0x000000ff000000ffULL, hi = (hi | hi << 12) & 0x000f000f000f000fULL, hi = (hi | hi << 6) & 0x0303030303030303ULL;
    return lo | hi << 4;
}
#endif

/* 32 values of Q4_1 .. IQ4_XS as integers: value l = D[l / 16] q[l] + M[l / 16] (M = 0: a
 * symmetric format; M[0] = M[1] but for Q2_K, whose minimums are per 16 values) */
typedef struct { int q[32]; float D[2], M[2]; } kq_sub;

/* sub-block s (values 32 s .. 32 s + 31) of a row of one of those formats, as ggml decodes it */
static void kq_decode(int type, const void *row, int64_t s, kq_sub *o) {
    o->M[0] = o->M[1] = 0;
    switch (type) {
    case MOE_T_Q4_1: case MOE_T_Q5_0: case MOE_T_Q5_1: {
        const q32_fields f = q32_block(type, row, s);
        for (int j = 0; j < 16; j++) {
            o->q[j] = (f.qs[j] & 15) | (int)((f.qh >> j) & 1) << 4;
            o->q[j + 16] = (f.qs[j] >> 4) | (int)((f.qh >> (j + 16)) & 1) << 4;
        }
        if (type == MOE_T_Q5_0)
            for (int j = 0; j < 32; j++) o->q[j] -= 16;
        o->D[0] = o->D[1] = moe__f16_to_f32(f.d), o->M[0] = o->M[1] = moe__f16_to_f32(f.m);
        break;
    }
    case MOE_T_Q4_K: case MOE_T_Q5_K: {
        const int j = (int)(s % 8), c = j / 2;
        const uint16_t *dd;
        const uint8_t *sc, *qs, *qh = NULL;
        if (type == MOE_T_Q4_K) {
            const moe__block_q4_k *b = (const moe__block_q4_k *)row + s / 8;
            dd = &b->d, sc = b->scales, qs = b->qs;
        } else {
            const moe__block_q5_k *b = (const moe__block_q5_k *)row + s / 8;
            dd = &b->d, sc = b->scales, qs = b->qs, qh = b->qh;
        }
        int ls, lm;
        k4_scale_min(sc, j, &ls, &lm);
        for (int l = 0; l < 32; l++) {
            const uint8_t v = qs[32 * c + l];
            o->q[l] = ((j & 1) ? v >> 4 : v & 15) | (qh ? ((qh[l] >> j) & 1) << 4 : 0);
        }
        o->D[0] = o->D[1] = moe__f16_to_f32(dd[0]) * (float)ls;
        o->M[0] = o->M[1] = -(moe__f16_to_f32(dd[1]) * (float)lm);
        break;
    }
    case MOE_T_Q6_K: {
        const moe__block_q6_k *b = (const moe__block_q6_k *)row + s / 8;
        const int h = (int)(s % 8) / 4, k = (int)(s % 4);
        const uint8_t *ql = b->ql + 64 * h + (k & 1) * 32, *qh = b->qh + 32 * h;
        for (int l = 0; l < 32; l++) o->q[l] = ((k < 2 ? ql[l] & 15 : ql[l] >> 4) | ((qh[l] >> (2 * k)) & 3) << 4) - 32;
        const float d = moe__f16_to_f32(b->d);
        o->D[0] = d * (float)b->scales[8 * h + 2 * k], o->D[1] = d * (float)b->scales[8 * h + 2 * k + 1];
        break;
    }
    case MOE_T_Q2_K: case MOE_T_Q3_K: { /* the 2 low bits of sub-block j of a block: bits 2 (j % 4) of qs[32 (j / 4) ..] */
        const int j = (int)(s % 8);
        const uint8_t *qs;
        if (type == MOE_T_Q2_K) {
            const moe__block_q2_k *b = (const moe__block_q2_k *)row + s / 8;
            const float d = moe__f16_to_f32(b->d), dmin = moe__f16_to_f32(b->dmin);
            qs = b->qs + 32 * (j / 4);
            for (int l = 0; l < 32; l++) o->q[l] = (qs[l] >> (2 * (j % 4))) & 3;
            for (int h = 0; h < 2; h++) {
                const uint8_t sc = b->scales[2 * j + h];
                o->D[h] = d * (float)(sc & 15), o->M[h] = -(dmin * (float)(sc >> 4));
            }
        } else {
            const moe__block_q3_k *b = (const moe__block_q3_k *)row + s / 8;
            const float d = moe__f16_to_f32(b->d);
            qs = b->qs + 32 * (j / 4);
            for (int l = 0; l < 32; l++) o->q[l] = (((qs[l] >> (2 * (j % 4))) & 3) | ((b->hmask[l] >> j) & 1) << 2) - 4;
            for (int h = 0; h < 2; h++) o->D[h] = d * (float)(q3k_scale(b->scales, 2 * j + h) - 32);
        }
        break;
    }
    case MOE_T_IQ4_NL: case MOE_T_IQ4_XS: {
        const uint8_t *qs;
        float D;
        if (type == MOE_T_IQ4_NL) {
            const moe__block_iq4_nl *b = (const moe__block_iq4_nl *)row + s;
            qs = b->qs, D = moe__f16_to_f32(b->d);
        } else {
            const moe__block_iq4_xs *b = (const moe__block_iq4_xs *)row + s / 8;
            const int j = (int)(s % 8);
            qs = b->qs + 16 * j, D = moe__f16_to_f32(b->d) * (float)(iq4xs_scale(b, j) - 32);
        }
        for (int l = 0; l < 16; l++) o->q[l] = moe__iq4nl_values[qs[l] & 15], o->q[l + 16] = moe__iq4nl_values[qs[l] >> 4];
        o->D[0] = o->D[1] = D;
        break;
    }
    default: {
        int8_t q8[32];
        int sc[2];
        const float dc = iq_sub(type, row, s, q8, sc);
        for (int l = 0; l < 32; l++) o->q[l] = q8[l];
        o->D[0] = dc * (float)sc[0], o->D[1] = dc * (float)sc[1];
        break;
    }
    }
}

#ifdef MOE_X86
static int cpu_has_avx2(void);

/* whether the load-time conversions (bf16_row, quantize_q8_0) take their AVX2 forms: asked of the
 * CPU once (a race only stores the same answer twice) */
static int conversions_avx2(void) {
    static int avx2 = -1;
    if (avx2 < 0) avx2 = cpu_has_avx2();
    return avx2;
}

/* BF16 to f32 on AVX2: each value's 16 bits become the top half of its float, as
 * moe__bf16_to_f32 does one at a time (a model's BF16 matrices are decoded so at load) */
MOE_TARGET("avx2") static void bf16_row_avx2(const uint16_t *p, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(const void *)(p + i)));
        _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
    for (; i < n; i++) out[i] = moe__bf16_to_f32(p[i]);
}
#endif

static void bf16_row(const uint16_t *p, float *out, int64_t n) {
#ifdef MOE_X86
    if (conversions_avx2()) {
        bf16_row_avx2(p, out, n);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) out[i] = moe__bf16_to_f32(p[i]);
}

void moe__row_to_f32(int type, const void *row, const uint8_t *scale, float *out, int64_t n) {
    switch (type) {
    case MOE_T_F32: memcpy(out, row, (size_t)n * 4); break;
    case MOE_T_BF16: bf16_row(row, out, n); break;
    case MOE_T_F16: {
        const uint16_t *p = row;
        for (int64_t i = 0; i < n; i++) out[i] = moe__f16_to_f32(p[i]);
        break;
    }
    case MOE_T_MXFP4: {
        const uint8_t *p = row;
        for (int64_t i = 0; i < n; i++) {
            uint8_t b = p[i / 2], q = (i & 1) ? b >> 4 : b & 15;
            out[i] = moe__e2m1[q] * e8m0(scale[i / 32]);
        }
        break;
    }
    case MOE_T_MXFP4_GGML: {
        const moe__block_mxfp4 *b = row;
        for (int64_t i = 0; i < n / 32; i++) {
            float d = e8m0(b[i].e);
            for (int j = 0; j < 16; j++) {
                out[i * 32 + j] = moe__e2m1[b[i].qs[j] & 15] * d;
                out[i * 32 + j + 16] = moe__e2m1[b[i].qs[j] >> 4] * d;
            }
        }
        break;
    }
    case MOE_T_Q8_0: {
        const moe__block_q8_0 *b = row;
        for (int64_t i = 0; i < n / 32; i++) {
            float d = moe__f16_to_f32(b[i].d);
            for (int j = 0; j < 32; j++) out[i * 32 + j] = d * b[i].qs[j];
        }
        break;
    }
    case MOE_T_Q4_0: {
        const moe__block_q4_0 *b = row;
        for (int64_t i = 0; i < n / 32; i++) {
            float d = moe__f16_to_f32(b[i].d);
            for (int j = 0; j < 16; j++) {
                out[i * 32 + j] = d * ((b[i].qs[j] & 15) - 8);
                out[i * 32 + j + 16] = d * ((b[i].qs[j] >> 4) - 8);
            }
        }
        break;
    }
    case MOE_T_Q4_1: case MOE_T_Q5_0: case MOE_T_Q5_1: case MOE_T_Q4_K: case MOE_T_Q5_K: case MOE_T_Q6_K:
    case MOE_T_Q2_K: case MOE_T_Q3_K: case MOE_T_IQ4_NL: case MOE_T_IQ4_XS:
    case MOE_T_IQ2_XXS: case MOE_T_IQ2_XS: case MOE_T_IQ2_S: case MOE_T_IQ3_XXS: case MOE_T_IQ3_S: case MOE_T_IQ1_S: case MOE_T_IQ1_M:
        for (int64_t i = 0; i < n / 32; i++) {
            kq_sub u;
            kq_decode(type, row, i, &u);
            for (int j = 0; j < 32; j++) out[i * 32 + j] = u.D[j / 16] * (float)u.q[j] + u.M[j / 16];
        }
        break;
    default: MOE_ASSERT(0 && "not a weight type");
    }
}

/* ggml's reference rounding for Q4_1 (step (max - min) / 15 from the minimum), Q5_1 (/ 31) and
 * Q5_0 (as Q4_0 with 16 steps each side) */
static void quantize_q4_1_q5(int type, const float *v, void *out) {
    float lo = v[0], hi = v[0], amax = 0, max = 0;
    for (int j = 0; j < 32; j++) {
        lo = fminf(lo, v[j]), hi = fmaxf(hi, v[j]);
        if (fabsf(v[j]) > amax) amax = fabsf(v[j]), max = v[j];
    }
    const int top = type == MOE_T_Q4_1 ? 15 : 31;
    float d, off;
    if (type == MOE_T_Q5_0) d = max / -16, off = 16.5f;
    else d = (hi - lo) / (float)top, off = 0.5f;
    const float id = d ? 1.0f / d : 0.0f;
    int q[32];
    for (int j = 0; j < 32; j++) {
        q[j] = type == MOE_T_Q5_0 ? (int)(v[j] * id + off) : (int)((v[j] - lo) * id + off);
        q[j] = q[j] > top ? top : q[j] < 0 ? 0 : q[j];
    }
    uint8_t *qs;
    uint32_t qh = 0;
    if (type == MOE_T_Q4_1) {
        moe__block_q4_1 *b = out;
        b->d = moe__f32_to_f16(d), b->m = moe__f32_to_f16(lo), qs = b->qs;
    } else if (type == MOE_T_Q5_0) {
        moe__block_q5_0 *b = out;
        b->d = moe__f32_to_f16(d), qs = b->qs;
    } else {
        moe__block_q5_1 *b = out;
        b->d = moe__f32_to_f16(d), b->m = moe__f32_to_f16(lo), qs = b->qs;
    }
    for (int j = 0; j < 16; j++) {
        qs[j] = (uint8_t)((q[j] & 15) | (q[j + 16] & 15) << 4);
        qh |= (uint32_t)(q[j] >> 4) << j | (uint32_t)(q[j + 16] >> 4) << (j + 16);
    }
    if (type == MOE_T_Q5_0) memcpy(((moe__block_q5_0 *)out)->qh, &qh, 4);
    if (type == MOE_T_Q5_1) memcpy(((moe__block_q5_1 *)out)->qh, &qh, 4);
}

/* n values as q = clamp(round(x / d + off), 0, top) */
static void round_levels(const float *x, int n, float d, float off, int top, int *q) {
    const float id = d ? 1.0f / d : 0.0f;
    for (int j = 0; j < n; j++) {
        const int l = (int)lrintf(x[j] * id + off);
        q[j] = l < 0 ? 0 : l > top ? top : l;
    }
}

/* x ~ a q - b (b >= 0) for n values with levels 0..top: tries grids of scales between the range's
 * and slightly wider or narrower ones, fits a and b to each grid's levels by weighted least
 * squares (weights w), keeps the best; returns a, sets *b (ggml's make_qkx2_quants does the same
 * kind of search) */
static float fit_scale_min(const float *x, const float *w, int n, int top, float *b) {
    float lo = x[0], hi = x[0];
    for (int j = 1; j < n; j++) lo = fminf(lo, x[j]), hi = fmaxf(hi, x[j]);
    if (lo > 0) lo = 0;
    *b = -lo;
    if (hi <= lo) return 0;
    float best_a = (hi - lo) / (float)top, best_b = -lo, best_err = INFINITY;
    int q[256];
    for (int is = -4; is <= 16; is++) {
        const float a0 = (hi - lo) / ((float)top + 0.1f * (float)is);
        round_levels(x, n, a0, -lo / a0, top, q);
        double sw = 0, sl = 0, sll = 0, sx = 0, slx = 0;
        for (int j = 0; j < n; j++) sw += w[j], sl += w[j] * q[j], sll += w[j] * q[j] * q[j], sx += w[j] * x[j], slx += w[j] * q[j] * x[j];
        const double det = sw * sll - sl * sl;
        if (det <= 0) continue;
        double a = (sw * slx - sl * sx) / det, bb = (sl * slx - sll * sx) / det; /* x ~ a q - bb */
        if (bb < 0) a = slx / sll, bb = 0; /* the minimum may not go above zero */
        double err = 0;
        for (int j = 0; j < n; j++) {
            const double e = a * q[j] - bb - x[j];
            err += w[j] * e * e;
        }
        if (err < best_err) best_err = (float)err, best_a = (float)a, best_b = (float)bb;
    }
    *b = best_b;
    return best_a;
}

/* Q4_K / Q5_K: each sub-block's scale and minimum fitted, then both sets quantized to 6 bits
 * against the block's largest, the values rounded to the stored ones */
static void quantize_k4(int type, const float *x, void *out) {
    const int top = type == MOE_T_Q4_K ? 15 : 31;
    float a[8], bm[8], w[32], amax = 0, bmax = 0;
    for (int j = 0; j < 8; j++) {
        const float *v = x + 32 * j;
        float s2 = 0;
        for (int l = 0; l < 32; l++) s2 += v[l] * v[l];
        const float av = sqrtf(s2 / 32);
        for (int l = 0; l < 32; l++) w[l] = av + fabsf(v[l]);
        a[j] = fit_scale_min(v, w, 32, top, &bm[j]);
        if (a[j] < 0) a[j] = 0;
        amax = fmaxf(amax, a[j]), bmax = fmaxf(bmax, bm[j]);
    }
    uint8_t sc[12] = {0};
    const float d = amax / 63, dmin = bmax / 63;
    int ls[8], lm[8];
    for (int j = 0; j < 8; j++) {
        ls[j] = d > 0 ? (int)lrintf(a[j] / d) : 0, lm[j] = dmin > 0 ? (int)lrintf(bm[j] / dmin) : 0;
        ls[j] = ls[j] > 63 ? 63 : ls[j], lm[j] = lm[j] > 63 ? 63 : lm[j];
        if (j < 4) {
            sc[j] |= (uint8_t)ls[j], sc[j + 4] |= (uint8_t)lm[j];
        } else {
            sc[j + 4] = (uint8_t)((ls[j] & 15) | (lm[j] & 15) << 4);
            sc[j - 4] |= (uint8_t)((ls[j] >> 4) << 6), sc[j] |= (uint8_t)((lm[j] >> 4) << 6);
        }
    }
    uint16_t hd = moe__f32_to_f16(d), hm = moe__f32_to_f16(dmin);
    int q[256];
    for (int j = 0; j < 8; j++) { /* the levels against the scales as stored */
        const float D = moe__f16_to_f32(hd) * (float)ls[j], M = moe__f16_to_f32(hm) * (float)lm[j];
        if (D > 0) round_levels(x + 32 * j, 32, D, M / D, top, q + 32 * j);
        else memset(q + 32 * j, 0, sizeof(int) * 32);
    }
    uint8_t *qs, *qh = NULL;
    if (type == MOE_T_Q4_K) {
        moe__block_q4_k *b = out;
        b->d = hd, b->dmin = hm, memcpy(b->scales, sc, 12), qs = b->qs;
    } else {
        moe__block_q5_k *b = out;
        b->d = hd, b->dmin = hm, memcpy(b->scales, sc, 12), qs = b->qs, qh = b->qh;
        memset(qh, 0, 32);
    }
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            const int lo = q[64 * c + l], hi = q[64 * c + 32 + l];
            qs[32 * c + l] = (uint8_t)((lo & 15) | (hi & 15) << 4);
            if (qh) qh[l] |= (uint8_t)((lo >> 4) << (2 * c) | (hi >> 4) << (2 * c + 1));
        }
}

/* the scale of 16 values on the levels -top .. top - 1 (the largest-magnitude value toward
 * -top, as ggml's symmetric k-quants): a search around max / -top (weights x^2), each candidate's
 * scale fitted to its levels by least squares */
static float fit_sym_scale(const float *v, int top) {
    float amax = 0, max = 0, sc = 0;
    for (int l = 0; l < 16; l++)
        if (fabsf(v[l]) > amax) amax = fabsf(v[l]), max = v[l];
    if (amax == 0) return 0;
    double best = -1;
    for (int is = -9; is <= 9; is++) {
        const float id = -((float)top + 0.1f * (float)is) / max;
        double sxl = 0, sll = 0;
        for (int l = 0; l < 16; l++) {
            int q = (int)lrintf(id * v[l]);
            q = q < -top ? -top : q > top - 1 ? top - 1 : q;
            const double wl = (double)v[l] * v[l];
            sxl += wl * v[l] * q, sll += wl * q * q;
        }
        if (sll > 0 && sxl * sxl / sll > best) best = sxl * sxl / sll, sc = (float)(sxl / sll);
    }
    return sc;
}

/* Q6_K and Q3_K: each 16 values' scale by fit_sym_scale (levels -top .. top - 1), the 16 scales
 * to signed levels l[g] against the largest (which maps to -lmax), the block scale as stored
 * returned; the values rounded to the stored scales, as q + top (0 .. 2 top - 1) */
static uint16_t sym_k_levels(const float *x, int top, int lmax, int l[16], int q[256]) {
    float sc[16], smax = 0;
    for (int g = 0; g < 16; g++) {
        sc[g] = fit_sym_scale(x + 16 * g, top);
        if (fabsf(sc[g]) > fabsf(smax)) smax = sc[g];
    }
    const float id = smax != 0 ? -(float)lmax / smax : 0;
    const uint16_t hd = moe__f32_to_f16(smax != 0 ? 1 / id : 0);
    const float d = moe__f16_to_f32(hd);
    for (int g = 0; g < 16; g++) {
        const int lg = (int)lrintf(id * sc[g]);
        l[g] = lg > lmax - 1 ? lmax - 1 : lg < -lmax ? -lmax : lg;
        const float D = d * (float)l[g];
        if (D != 0) round_levels(x + 16 * g, 16, D, (float)top, 2 * top - 1, q + 16 * g);
        else for (int k = 0; k < 16; k++) q[16 * g + k] = top;
    }
    return hd;
}

static void quantize_q6_k(const float *x, moe__block_q6_k *b) {
    int lv[16], q[256];
    memset(b, 0, sizeof *b);
    b->d = sym_k_levels(x, 32, 128, lv, q);
    for (int g = 0; g < 16; g++) b->scales[g] = (int8_t)lv[g];
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++) {
            const int *p = q + 128 * h;
            b->ql[64 * h + l] = (uint8_t)((p[l] & 15) | (p[l + 64] & 15) << 4);
            b->ql[64 * h + 32 + l] = (uint8_t)((p[l + 32] & 15) | (p[l + 96] & 15) << 4);
            b->qh[32 * h + l] = (uint8_t)((p[l] >> 4) | (p[l + 32] >> 4) << 2 | (p[l + 64] >> 4) << 4 | (p[l + 96] >> 4) << 6);
        }
}

/* Q2_K: each 16 values' scale and minimum fitted (levels 0..3), both sets to 4 bits against their
 * largest, the values rounded to the stored ones */
static void quantize_q2_k(const float *x, moe__block_q2_k *b) {
    float a[16], bm[16], w[16], amax = 0, bmax = 0;
    for (int g = 0; g < 16; g++) {
        const float *v = x + 16 * g;
        float s2 = 0;
        for (int l = 0; l < 16; l++) s2 += v[l] * v[l];
        const float av = sqrtf(s2 / 16);
        for (int l = 0; l < 16; l++) w[l] = av + fabsf(v[l]);
        a[g] = fit_scale_min(v, w, 16, 3, &bm[g]);
        if (a[g] < 0) a[g] = 0;
        amax = fmaxf(amax, a[g]), bmax = fmaxf(bmax, bm[g]);
    }
    memset(b, 0, sizeof *b);
    b->d = moe__f32_to_f16(amax / 15), b->dmin = moe__f32_to_f16(bmax / 15);
    const float d = moe__f16_to_f32(b->d), dmin = moe__f16_to_f32(b->dmin);
    int q[256];
    for (int g = 0; g < 16; g++) {
        int ls = d > 0 ? (int)lrintf(a[g] / d) : 0, lm = dmin > 0 ? (int)lrintf(bm[g] / dmin) : 0;
        ls = ls > 15 ? 15 : ls, lm = lm > 15 ? 15 : lm;
        b->scales[g] = (uint8_t)(ls | lm << 4);
        const float D = d * (float)ls, M = dmin * (float)lm;
        if (D > 0) round_levels(x + 16 * g, 16, D, M / D, 3, q + 16 * g);
        else memset(q + 16 * g, 0, sizeof(int) * 16);
    }
    for (int v = 0; v < 256; v++) b->qs[32 * (v / 128) + v % 32] |= (uint8_t)(q[v] << (2 * ((v % 128) / 32)));
}

/* Q3_K: as Q6_K with levels -4..3 and 6-bit scales (stored + 32) */
static void quantize_q3_k(const float *x, moe__block_q3_k *b) {
    int lv[16], q[256];
    memset(b, 0, sizeof *b);
    b->d = sym_k_levels(x, 4, 32, lv, q);
    for (int g = 0; g < 16; g++) q3k_put_scale(b->scales, g, lv[g] + 32);
    for (int v = 0; v < 256; v++) {
        b->qs[32 * (v / 128) + v % 32] |= (uint8_t)((q[v] & 3) << (2 * ((v % 128) / 32)));
        b->hmask[v % 32] |= (uint8_t)((q[v] >> 2) << (v / 32));
    }
}

/* the index of IQ4's level nearest to x (levels ascending: x past the midpoint of two moves up) */
static int iq4_index(float x) {
    int i = 0;
    for (int step = 8; step; step >>= 1)
        if (2 * x >= (float)(moe__iq4nl_values[i + step - 1] + moe__iq4nl_values[i + step])) i += step;
    return i;
}

/* the scale of 32 values on IQ4's levels: candidates mapping the largest-magnitude value near
 * either end (within 5%), each refitted to its levels by least squares; the one with the least
 * error (17 candidates a side instead of 5 gave the same round-trip error in the tests) */
static float fit_iq4_scale(const float *v) {
    float amax = 0, max = 0;
    for (int l = 0; l < 32; l++)
        if (fabsf(v[l]) > amax) amax = fabsf(v[l]), max = v[l];
    if (amax == 0) return 0;
    float best_d = 0;
    double best = -1;
    for (int end = 0; end < 2; end++)
        for (int is = -2; is <= 2; is++) {
            const float top = end ? -127.0f : 113.0f;
            const float id = (top + 0.2f * top * (float)is / 8) / max;
            double sxk = 0, skk = 0;
            for (int l = 0; l < 32; l++) {
                const int k = moe__iq4nl_values[iq4_index(v[l] * id)];
                sxk += (double)v[l] * k, skk += (double)k * k;
            }
            if (skk > 0 && sxk * sxk / skk > best) best = sxk * sxk / skk, best_d = (float)(sxk / skk);
        }
    return best_d;
}

/* 32 values to IQ4 nibbles against the stored scale D (low nibbles values 0..15) */
static void iq4_nibbles(const float *v, float D, uint8_t *qs) {
    for (int l = 0; l < 16; l++) {
        const int a = D != 0 ? iq4_index(v[l] / D) : 8, c = D != 0 ? iq4_index(v[l + 16] / D) : 8;
        qs[l] = (uint8_t)(a | c << 4);
    }
}

static void quantize_iq4_nl(const float *x, moe__block_iq4_nl *b) {
    b->d = moe__f32_to_f16(fit_iq4_scale(x));
    iq4_nibbles(x, moe__f16_to_f32(b->d), b->qs);
}

/* IQ4_XS: each 32 values' scale by fit_iq4_scale, the 8 scales to signed 6 bits against the
 * largest (which maps to -32) */
static void quantize_iq4_xs(const float *x, moe__block_iq4_xs *b) {
    float sc[8], smax = 0;
    for (int j = 0; j < 8; j++) {
        sc[j] = fit_iq4_scale(x + 32 * j);
        if (fabsf(sc[j]) > fabsf(smax)) smax = sc[j];
    }
    memset(b, 0, sizeof *b);
    const float id = smax != 0 ? -32.0f / smax : 0;
    b->d = moe__f32_to_f16(smax != 0 ? 1 / id : 0);
    const float d = moe__f16_to_f32(b->d);
    for (int j = 0; j < 8; j++) {
        int l = (int)lrintf(id * sc[j]);
        l = l > 31 ? 31 : l < -32 ? -32 : l;
        iq4xs_put_scale(b, j, l + 32);
        iq4_nibbles(x + 32 * j, d * (float)l, b->qs + 16 * j);
    }
}

/* ggml's quantize_row_q8_0_ref: each block's scale is its largest magnitude / 127, each value
 * rounded half away from zero (roundf) */
void moe__quantize_q8_0_ref(const float *x, void *out, int64_t n) {
    for (int64_t i = 0; i < n / 32; i++) {
        const float *v = x + i * 32;
        moe__block_q8_0 *b = (moe__block_q8_0 *)out + i;
        float amax = 0;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(v[j]));
        float d = amax / 127, id = d ? 1.0f / d : 0.0f;
        b->d = moe__f32_to_f16(d);
        for (int j = 0; j < 32; j++) b->qs[j] = (int8_t)roundf(v[j] * id);
    }
}

#ifdef MOE_X86
/* moe__quantize_q8_0_ref's bytes on AVX2 (a model's BF16 matrices become Q8_0 at load through
 * this): the largest magnitude by lanes (max is exact in any order), the same float product, and
 * roundf's halves away from zero from truncation and the remainder (the CPU's own rounding takes
 * ties to even). A block holding a NaN or an infinity goes through the reference, whose fmaxf
 * skips NaNs as max_ps does not. */
MOE_TARGET("avx2") static void quantize_q8_0_avx2(const float *x, void *out, int64_t n) {
    const __m256 sign = _mm256_set1_ps(-0.0f), half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f), inf = _mm256_set1_ps(INFINITY);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* the two packs interleave 128-bit lanes */
    for (int64_t i = 0; i < n / 32; i++) {
        const float *v = x + i * 32;
        moe__block_q8_0 *b = (moe__block_q8_0 *)out + i;
        __m256 a[4], m = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            a[k] = _mm256_loadu_ps(v + 8 * k);
            const __m256 mag = _mm256_andnot_ps(sign, a[k]);
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(mag, inf, _CMP_NLT_UQ)); /* NaN or infinite */
            m = _mm256_max_ps(m, mag);
        }
        if (_mm256_movemask_ps(bad)) {
            moe__quantize_q8_0_ref(v, b, 32);
            continue;
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        const float amax = _mm_cvtss_f32(h), d = amax / 127, id = d ? 1.0f / d : 0.0f;
        b->d = moe__f32_to_f16(d);
        const __m256 vid = _mm256_set1_ps(id);
        __m256i q[4];
        for (int k = 0; k < 4; k++) {
            const __m256 p = _mm256_mul_ps(a[k], vid), t = _mm256_round_ps(p, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            /* |p| >= |t| + 0.5 (exact: t is a small integer), never p - t, which a compiler told to
             * contract (-ffp-contract=fast with FMA) could fuse with the product and round once */
            const __m256 away = _mm256_cmp_ps(_mm256_andnot_ps(sign, p), _mm256_add_ps(_mm256_andnot_ps(sign, t), half), _CMP_GE_OQ);
            const __m256 step = _mm256_and_ps(away, _mm256_or_ps(one, _mm256_and_ps(sign, p))); /* +-1 where the remainder is >= 0.5 */
            q[k] = _mm256_cvttps_epi32(_mm256_add_ps(t, step));
        }
        const __m256i q16 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(void *)b->qs, _mm256_permutevar8x32_epi32(q16, order));
    }
}
#endif

/* Q8_0 rows: on AVX2 where the CPU has it, else the reference; the same bytes either way */
static void quantize_q8_0(const float *x, void *out, int64_t n) {
#ifdef MOE_X86
    if (conversions_avx2()) {
        quantize_q8_0_avx2(x, out, n);
        return;
    }
#endif
    moe__quantize_q8_0_ref(x, out, n);
}

/* ggml's reference quantizers for Q8_0 and Q4_0 (quantize_row_q8_0_ref / quantize_row_q4_0_ref),
 * so files and results match llama.cpp's bit for bit; the others as above. */
void moe__quantize_row(int type, const float *x, void *out, int64_t n) {
    if (type == MOE_T_Q8_0) {
        quantize_q8_0(x, out, n);
        return;
    }
    if (type == MOE_T_Q4_1 || type == MOE_T_Q5_0 || type == MOE_T_Q5_1) {
        for (int64_t i = 0; i < n / 32; i++) quantize_q4_1_q5(type, x + i * 32, (unsigned char *)out + i * moe__row_bytes(type, 32));
        return;
    }
    if (type == MOE_T_Q4_K || type == MOE_T_Q5_K) {
        for (int64_t i = 0; i < n / 256; i++) quantize_k4(type, x + i * 256, (unsigned char *)out + i * moe__row_bytes(type, 256));
        return;
    }
    if (type == MOE_T_Q6_K) {
        for (int64_t i = 0; i < n / 256; i++) quantize_q6_k(x + i * 256, (moe__block_q6_k *)out + i);
        return;
    }
    if (type == MOE_T_Q2_K || type == MOE_T_Q3_K || type == MOE_T_IQ4_XS) {
        for (int64_t i = 0; i < n / 256; i++) {
            if (type == MOE_T_Q2_K) quantize_q2_k(x + i * 256, (moe__block_q2_k *)out + i);
            else if (type == MOE_T_Q3_K) quantize_q3_k(x + i * 256, (moe__block_q3_k *)out + i);
            else quantize_iq4_xs(x + i * 256, (moe__block_iq4_xs *)out + i);
        }
        return;
    }
    if (type == MOE_T_IQ4_NL) {
        for (int64_t i = 0; i < n / 32; i++) quantize_iq4_nl(x + i * 32, (moe__block_iq4_nl *)out + i);
        return;
    }
    for (int64_t i = 0; i < n / 32; i++) { /* Q4_0 */
        const float *v = x + i * 32;
        moe__block_q4_0 *b = (moe__block_q4_0 *)out + i;
        float amax = 0, max = 0;
        for (int j = 0; j < 32; j++)
            if (fabsf(v[j]) > amax) amax = fabsf(v[j]), max = v[j];
        float d = max / -8, id = d ? 1.0f / d : 0.0f;
        b->d = moe__f32_to_f16(d);
        for (int j = 0; j < 16; j++) {
            int q0 = (int)(v[j] * id + 8.5f), q1 = (int)(v[j + 16] * id + 8.5f);
            q0 = q0 > 15 ? 15 : q0, q1 = q1 > 15 ? 15 : q1;
            b->qs[j] = (uint8_t)(q0 | q1 << 4);
        }
    }
}

/* activation blocks: symmetric int8 with an f32 scale (more precise than Q8_0's half scale) */
void moe__quant_q8a_ref(const float *x, moe__block_q8a *out, int64_t n) {
    for (int64_t i = 0; i < n / 32; i++) {
        const float *v = x + i * 32;
        float amax = 0;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(v[j]));
        float d = amax / 127, id = d ? 127.0f / amax : 0.0f;
        out[i].d = d;
        int sum = 0;
        for (int j = 0; j < 32; j++) sum += out[i].qs[j] = (int8_t)lrintf(v[j] * id);
        out[i].sum = sum;
    }
}

int moe__x8_of(int type) {
    switch (type) {
    case MOE_T_Q4_0: return MOE_T_Q4_0X8;
    case MOE_T_Q8_0: return MOE_T_Q8_0X8;
    case MOE_T_MXFP4: case MOE_T_MXFP4_GGML: return MOE_T_MXFP4X8;
    case MOE_T_Q4_K: return MOE_T_Q4_KX8;
    case MOE_T_Q5_K: return MOE_T_Q5_KX8;
    case MOE_T_IQ4_XS: return MOE_T_IQ4_XSX8;
    case MOE_T_Q2_K: return MOE_T_Q2_KX8;
    case MOE_T_Q3_K: return MOE_T_Q3_KX8;
    case MOE_T_Q6_K: return MOE_T_Q6_KX8;
    default: return -1;
    }
}

/* a compressed-tensors block's 16 bytes (column 2i in byte i's low nibble, 2i+1 in its high) in
 * ggml's order (column j in byte j's low nibble, j + 16 in its high): the codes split by nibble,
 * interleaved back into column order one per byte, and columns j and j + 16 joined */
#if defined(MOE_X86)
static void mxfp4_block_to_ggml(const uint8_t *ct, uint8_t *g) { /* SSE2: every x86-64 CPU */
    const __m128i v = _mm_loadu_si128((const __m128i *)(const void *)ct), m4 = _mm_set1_epi8(15);
    const __m128i even = _mm_and_si128(v, m4), odd = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
    const __m128i c0 = _mm_unpacklo_epi8(even, odd), c16 = _mm_unpackhi_epi8(even, odd); /* columns 0-15, 16-31 */
    _mm_storeu_si128((__m128i *)(void *)g, _mm_or_si128(c0, _mm_slli_epi16(c16, 4)));
}
#elif defined(MOE_NEON)
static void mxfp4_block_to_ggml(const uint8_t *ct, uint8_t *g) {
    const uint8x16_t v = vld1q_u8(ct), m4 = vdupq_n_u8(15);
    const uint8x16x2_t c = vzipq_u8(vandq_u8(v, m4), vshrq_n_u8(v, 4)); /* columns 0-15, 16-31 */
    vst1q_u8(g, vorrq_u8(c.val[0], vshlq_n_u8(c.val[1], 4)));
}
#else
/* 8 packed codes (a 32-bit word, code k at bits 4k) -> one per byte, in the low nibbles */
static uint64_t nibbles_to_bytes(uint32_t x) {
    uint64_t v = x;
    v = (v | v << 16) & 0x0000FFFF0000FFFFull;
    v = (v | v << 8) & 0x00FF00FF00FF00FFull;
    return (v | v << 4) & 0x0F0F0F0F0F0F0F0Full;
}
static void mxfp4_block_to_ggml(const uint8_t *ct, uint8_t *g) {
    uint32_t w[4];
    memcpy(w, ct, 16); /* columns 0-7, 8-15, 16-23, 24-31 (little-endian) */
    const uint64_t lo = nibbles_to_bytes(w[0]) | nibbles_to_bytes(w[2]) << 4, hi = nibbles_to_bytes(w[1]) | nibbles_to_bytes(w[3]) << 4;
    memcpy(g, &lo, 8);
    memcpy(g + 8, &hi, 8);
}
#endif

/* block b of a Q4_KX8 or Q5_KX8 matrix, field by field (qh: NULL for Q4_KX8) */
typedef struct { uint16_t *d, *dmin; uint8_t (*sc)[8], (*m)[8]; uint8_t *qs, *qh; } kx8_view;
static kx8_view kx8_at(int type, const void *base, int64_t b) {
    if (type == MOE_T_Q5_KX8) {
        moe__block_q5_kx8 *o = (moe__block_q5_kx8 *)(uintptr_t)base + b;
        return (kx8_view){o->d, o->dmin, o->sc, o->m, o->qs, o->qh};
    }
    moe__block_q4_kx8 *o = (moe__block_q4_kx8 *)(uintptr_t)base + b;
    return (kx8_view){o->d, o->dmin, o->sc, o->m, o->qs, NULL};
}

/* sub-block b of a row of Q4_1 .. IQ4_XS times its q8a block xb: the exact int32 sums of q x
 * over each 16, then xb.d (D0 acc0 + D1 acc1 + M sum(x)) in float (Q2_K: M0 sum(x first 16) +
 * M1 sum(x last 16)) */
static float kq_term(int type, const void *w, int64_t b, const moe__block_q8a *xb) {
    kq_sub u;
    kq_decode(type, w, b, &u);
    int a0 = 0, a1 = 0, h0 = 0;
    for (int l = 0; l < 16; l++) a0 += u.q[l] * xb->qs[l], a1 += u.q[l + 16] * xb->qs[l + 16], h0 += xb->qs[l];
    const float m = type == MOE_T_Q2_K ? u.M[0] * (float)h0 + u.M[1] * (float)(xb->sum - h0) : u.M[0] * (float)xb->sum;
    return xb->d * (u.D[0] * (float)a0 + u.D[1] * (float)a1 + m);
}

/* IQ4_XS sub-block j's index of value l (0..31): low nibbles of its 16 bytes hold values 0..15 */
static inline int iq4xs_index(const moe__block_iq4_xs *b, int j, int l) { return l < 16 ? b->qs[16 * j + l] & 15 : b->qs[16 * j + l - 16] >> 4; }

/* row r's IQ4_XS block back out of an IQ4_XSX8 block */
static void iq4_xsx8_row(const moe__block_iq4_xsx8 *o, int r, moe__block_iq4_xs *b) {
    memset(b, 0, sizeof *b);
    b->d = o->d[r];
    for (int j = 0; j < 8; j++) {
        iq4xs_put_scale(b, j, o->sc[j][r] + 32);
        for (int l = 0; l < 32; l++) {
            const uint8_t byte = o->qs[(j / 2) * 256 + (l / 4) * 32 + r * 4 + l % 4];
            const int q = (j % 2) ? byte >> 4 : byte & 15;
            b->qs[16 * j + l % 16] |= (uint8_t)(l < 16 ? q : q << 4);
        }
    }
}

/* The x8 layout of Q2_K, Q3_K and Q6_K bytes kept as stored: 4-byte chunk c of a row's field
 * (bytes 4c .. 4c + 3) sits at 32c + 4r of the interleaved field, r the row (0..7) */
static void chunks_to_x8(uint8_t *x8, const uint8_t *row, int r, int chunks) {
    for (int c = 0; c < chunks; c++) memcpy(x8 + 32 * c + 4 * r, row + 4 * c, 4);
}
static void chunks_from_x8(uint8_t *row, const uint8_t *x8, int r, int chunks) {
    for (int c = 0; c < chunks; c++) memcpy(row + 4 * c, x8 + 32 * c + 4 * r, 4);
}

/* row r's block back out of block b of an IQ4_XSX8, Q2_KX8, Q3_KX8 or Q6_KX8 matrix (the
 * reference multiplies rows as stored) */
static void x8_row_block(int type, const void *w, int64_t b, int r, void *out) {
    if (type == MOE_T_Q6_KX8) {
        const moe__block_q6_kx8 *o = (const moe__block_q6_kx8 *)w + b;
        moe__block_q6_k *k = out;
        k->d = o->d[r];
        for (int g = 0; g < 16; g++) k->scales[g] = o->sc[g][r];
        chunks_from_x8(k->ql, o->ql, r, 32);
        chunks_from_x8(k->qh, o->qh, r, 16);
        return;
    }
    if (type == MOE_T_Q2_KX8 || type == MOE_T_Q3_KX8) {
        const uint8_t *qs;
        uint8_t *to;
        if (type == MOE_T_Q2_KX8) {
            const moe__block_q2_kx8 *o = (const moe__block_q2_kx8 *)w + b;
            moe__block_q2_k *k = out;
            k->d = o->d[r], k->dmin = o->dmin[r], qs = o->qs, to = k->qs;
            for (int g = 0; g < 16; g++) k->scales[g] = o->sc[g][r];
        } else {
            const moe__block_q3_kx8 *o = (const moe__block_q3_kx8 *)w + b;
            moe__block_q3_k *k = out;
            memset(k->scales, 0, 12);
            k->d = o->d[r], qs = o->qs, to = k->qs;
            for (int g = 0; g < 16; g++) q3k_put_scale(k->scales, g, o->sc[g][r] + 32);
            chunks_from_x8(k->hmask, o->hm, r, 8);
        }
        chunks_from_x8(to, qs, r, 16);
        return;
    }
    iq4_xsx8_row((const moe__block_iq4_xsx8 *)w + b, r, out);
}

void moe__repack_x8(int type, const void *rows8, int64_t row_bytes, const uint8_t *scales8, void *dst, int64_t cols) {
    const unsigned char *src = rows8;
    if (type == MOE_T_Q6_K) { /* ql and qh in 4-byte chunks, as stored */
        for (int64_t b = 0; b < cols / 256; b++) {
            moe__block_q6_kx8 *o = (moe__block_q6_kx8 *)dst + b;
            for (int r = 0; r < 8; r++) {
                const moe__block_q6_k *k = (const moe__block_q6_k *)(const void *)(src + r * row_bytes) + b;
                o->d[r] = k->d;
                for (int g = 0; g < 16; g++) o->sc[g][r] = k->scales[g];
                chunks_to_x8(o->ql, k->ql, r, 32);
                chunks_to_x8(o->qh, k->qh, r, 16);
            }
        }
        return;
    }
    if (type == MOE_T_Q2_K || type == MOE_T_Q3_K) { /* qs (and hmask) in 4-byte chunks, as stored */
        for (int64_t b = 0; b < cols / 256; b++) {
            for (int r = 0; r < 8; r++) {
                const unsigned char *in = src + r * row_bytes + b * moe__row_bytes(type, 256);
                uint8_t *qs;
                const uint8_t *from;
                if (type == MOE_T_Q2_K) {
                    const moe__block_q2_k *k = (const moe__block_q2_k *)(const void *)in;
                    moe__block_q2_kx8 *o = (moe__block_q2_kx8 *)dst + b;
                    o->d[r] = k->d, o->dmin[r] = k->dmin, qs = o->qs, from = k->qs;
                    for (int g = 0; g < 16; g++) o->sc[g][r] = k->scales[g];
                } else {
                    const moe__block_q3_k *k = (const moe__block_q3_k *)(const void *)in;
                    moe__block_q3_kx8 *o = (moe__block_q3_kx8 *)dst + b;
                    o->d[r] = k->d, qs = o->qs, from = k->qs;
                    for (int g = 0; g < 16; g++) o->sc[g][r] = (int8_t)(q3k_scale(k->scales, g) - 32);
                    chunks_to_x8(o->hm, k->hmask, r, 8);
                }
                chunks_to_x8(qs, from, r, 16);
            }
        }
        return;
    }
    if (type == MOE_T_IQ4_XS) { /* chunk c of pair p: values 4c..4c+3 of sub-blocks 2p (low nibbles) and 2p + 1 (high) */
        for (int64_t b = 0; b < cols / 256; b++) {
            moe__block_iq4_xsx8 *o = (moe__block_iq4_xsx8 *)dst + b;
            for (int r = 0; r < 8; r++) {
                const moe__block_iq4_xs *in = (const moe__block_iq4_xs *)(src + r * row_bytes) + b;
                o->d[r] = in->d;
                for (int j = 0; j < 8; j++) o->sc[j][r] = (int8_t)(iq4xs_scale(in, j) - 32);
                for (int p = 0; p < 4; p++)
                    for (int l = 0; l < 32; l++)
                        o->qs[p * 256 + (l / 4) * 32 + r * 4 + l % 4] = (uint8_t)(iq4xs_index(in, 2 * p, l) | iq4xs_index(in, 2 * p + 1, l) << 4);
            }
        }
        return;
    }
    if (type == MOE_T_Q4_K || type == MOE_T_Q5_K) { /* chunk c of pair p: bytes 32p + 4c .. + 3 of a row's qs, as stored */
        const int five = type == MOE_T_Q5_K;
        for (int64_t b = 0; b < cols / 256; b++) {
            const kx8_view o = kx8_at(moe__x8_of(type), dst, b);
            for (int r = 0; r < 8; r++) {
                const unsigned char *in = src + r * row_bytes + b * moe__row_bytes(type, 256);
                const uint8_t *scales = in + 4, *qs = in + (five ? 48 : 16);
                memcpy(&o.d[r], in, 2), memcpy(&o.dmin[r], in + 2, 2);
                for (int j = 0; j < 8; j++) {
                    int ls, lm;
                    k4_scale_min(scales, j, &ls, &lm);
                    o.sc[j][r] = (uint8_t)ls, o.m[j][r] = (uint8_t)lm;
                }
                for (int p = 0; p < 4; p++)
                    for (int c = 0; c < 8; c++) memcpy(o.qs + p * 256 + c * 32 + r * 4, qs + 32 * p + 4 * c, 4);
                if (five) /* qh bytes 4c .. 4c+3 of the row: chunk c's fifth bits */
                    for (int c = 0; c < 8; c++) memcpy(o.qh + c * 32 + r * 4, in + 16 + 4 * c, 4);
            }
        }
        return;
    }
    for (int64_t b = 0; b < cols / 32; b++) {
        /* Q4_0 byte j holds values j (low nibble) and j + 16 (high): chunk c's low nibbles are
         * values 4c..4c+3 and its high ones 4c+16..4c+19, exactly bytes 4c..4c+3 as stored, so
         * the interleave moves whole 4-byte groups (Q8_0's also flip the sign bit: + 128); ggml
         * MXFP4 nibbles are in Q4_0's order, compressed-tensors ones are brought to it first */
        if (type == MOE_T_Q4_0) {
            moe__block_q4_0x8 *o = (moe__block_q4_0x8 *)dst + b;
            for (int r = 0; r < 8; r++) {
                const moe__block_q4_0 *in = (const moe__block_q4_0 *)(src + r * row_bytes) + b;
                o->d[r] = in->d;
                for (int c = 0; c < 4; c++) memcpy(o->qs + c * 32 + r * 4, in->qs + 4 * c, 4);
            }
        } else if (type == MOE_T_MXFP4_GGML || type == MOE_T_MXFP4) {
            moe__block_mxfp4x8 *o = (moe__block_mxfp4x8 *)dst + b;
            for (int r = 0; r < 8; r++) {
                uint8_t g[16];
                if (type == MOE_T_MXFP4) {
                    o->e[r] = scales8[r * (cols / 32) + b];
                    mxfp4_block_to_ggml(src + r * row_bytes + b * 16, g);
                } else {
                    const moe__block_mxfp4 *in = (const moe__block_mxfp4 *)(src + r * row_bytes) + b;
                    o->e[r] = in->e;
                    memcpy(g, in->qs, 16);
                }
                for (int c = 0; c < 4; c++) memcpy(o->qs + c * 32 + r * 4, g + 4 * c, 4);
            }
        } else {
            moe__block_q8_0x8 *o = (moe__block_q8_0x8 *)dst + b;
            for (int r = 0; r < 8; r++) {
                const moe__block_q8_0 *in = (const moe__block_q8_0 *)(src + r * row_bytes) + b;
                o->d[r] = in->d;
                for (int c = 0; c < 8; c++) {
                    uint32_t v;
                    memcpy(&v, in->qs + 4 * c, 4);
                    v ^= 0x80808080u;
                    memcpy(o->qs + c * 32 + r * 4, &v, 4);
                }
            }
        }
    }
}

/* =================================================================================================
 * PART 2: SCALAR REFERENCES
 * =================================================================================================
 * What every kernel computes, in plain C, always compiled: the scalar level's kernels and the
 * definition every SIMD kernel is tested against. Weight row . f32 row (dot_*_ref), weight row .
 * int8 activation blocks (dotq_*_ref; activations quantized by moe__quant_q8a_ref), interleaved
 * groups (moe__dotq8_ref), matrix tiles (moe__gemm_ref), elementwise functions, the absorbed MLA
 * attention over f32, bf16 and int8 latent caches (moe__mla_*_ref), and the KDA core: the
 * recurrence (moe__kda_recurrent) and the chunked form (moe__kda_chunked), which every level
 * runs with its own products. Integer sums are exact, so SIMD kernels match these bit for bit. */

/* ---- scalar reference dots: y = w[0..n) . x[0..n) ------------------------------------- */

static float dot_f32_ref(const void *w, const uint8_t *sc, const float *x, int64_t n) {
    (void)sc;
    const float *p = w;
    float s = 0;
    for (int64_t i = 0; i < n; i++) s += p[i] * x[i];
    return s;
}

static float dot_bf16_ref(const void *w, const uint8_t *sc, const float *x, int64_t n) {
    (void)sc;
    const uint16_t *p = w;
    float s = 0;
    for (int64_t i = 0; i < n; i++) s += moe__bf16_to_f32(p[i]) * x[i];
    return s;
}

static float dot_f16_ref(const void *w, const uint8_t *sc, const float *x, int64_t n) {
    (void)sc;
    const uint16_t *p = w;
    float s = 0;
    for (int64_t i = 0; i < n; i++) s += moe__f16_to_f32(p[i]) * x[i];
    return s;
}

/* n is a multiple of 32 (checked at load). The block sum is scaled once: exact, since the
 * scale is a power of two. */
static float dot_mxfp4_ref(const void *w, const uint8_t *sc, const float *x, int64_t n) {
    const uint8_t *p = w;
    float s = 0;
    for (int64_t b = 0; b < n / 32; b++) {
        float bs = 0;
        for (int i = 0; i < 16; i++) {
            uint8_t v = p[b * 16 + i];
            bs += moe__e2m1[v & 15] * x[b * 32 + 2 * i] + moe__e2m1[v >> 4] * x[b * 32 + 2 * i + 1];
        }
        s += bs * e8m0(sc[b]);
    }
    return s;
}

static float dotq_q8_0_ref(const void *w, const moe__block_q8a *x, int64_t n) {
    const moe__block_q8_0 *b = w;
    float s = 0;
    for (int64_t i = 0; i < n / 32; i++) {
        int acc = 0;
        for (int j = 0; j < 32; j++) acc += b[i].qs[j] * x[i].qs[j];
        s += moe__f16_to_f32(b[i].d) * x[i].d * (float)acc;
    }
    return s;
}

static float dotq_q4_0_ref(const void *w, const moe__block_q8a *x, int64_t n) {
    const moe__block_q4_0 *b = w;
    float s = 0;
    for (int64_t i = 0; i < n / 32; i++) {
        int acc = 0;
        for (int j = 0; j < 16; j++)
            acc += ((b[i].qs[j] & 15) - 8) * x[i].qs[j] + ((b[i].qs[j] >> 4) - 8) * x[i].qs[j + 16];
        s += moe__f16_to_f32(b[i].d) * x[i].d * (float)acc;
    }
    return s;
}

/* out[r] = sum_b d_r d_x (sum_j q[r][j] x[j] - off * sum(x)): q unsigned, off 8 (Q4_0) or 128.
 * MXFP4x8: per row the float steps of moe__dotq_mxfp4_ref (each row's result is bit for bit that
 * reference's on the row as stored) */
void moe__dotq8_ref(int type, const void *w, const moe__block_q8a *x, int64_t n, float *out) {
    for (int r = 0; r < 8; r++) out[r] = 0;
    if (type == MOE_T_IQ4_XSX8 || type == MOE_T_Q2_KX8 || type == MOE_T_Q3_KX8 || type == MOE_T_Q6_KX8) { /* each row un-interleaved, block by block, through the row reference's steps */
        const int rt = type == MOE_T_IQ4_XSX8 ? MOE_T_IQ4_XS : type == MOE_T_Q2_KX8 ? MOE_T_Q2_K : type == MOE_T_Q3_KX8 ? MOE_T_Q3_K : MOE_T_Q6_K;
        for (int r = 0; r < 8; r++) {
            float s = 0;
            for (int64_t b = 0; b < n / 256; b++) {
                union { moe__block_iq4_xs a; moe__block_q2_k b; moe__block_q3_k c; moe__block_q6_k d; } row;
                x8_row_block(type, w, b, r, &row);
                for (int j = 0; j < 8; j++) s += kq_term(rt, &row, j, &x[8 * b + j]);
            }
            out[r] = s;
        }
        return;
    }
    if (type == MOE_T_Q4_KX8 || type == MOE_T_Q5_KX8) { /* per row the float steps of the Q4_K/Q5_K reference */
        const int five = type == MOE_T_Q5_KX8;
        for (int64_t b = 0; b < n / 32; b++) {
            const kx8_view o = kx8_at(type, w, b / 8);
            const int j = (int)(b % 8), p = j / 2;
            for (int r = 0; r < 8; r++) {
                int a0 = 0, a1 = 0;
                for (int c = 0; c < 8; c++)
                    for (int k = 0; k < 4; k++) {
                        const uint8_t v = o.qs[p * 256 + c * 32 + r * 4 + k];
                        const int h = five ? (o.qh[c * 32 + r * 4 + k] >> j & 1) << 4 : 0;
                        const int q = ((j & 1) ? v >> 4 : v & 15) | h, l = 4 * c + k;
                        if (l < 16) a0 += q * x[b].qs[l];
                        else a1 += q * x[b].qs[l];
                    }
                const float D = moe__f16_to_f32(o.d[r]) * (float)o.sc[j][r], M = -(moe__f16_to_f32(o.dmin[r]) * (float)o.m[j][r]);
                out[r] += x[b].d * (D * (float)a0 + D * (float)a1 + M * (float)x[b].sum);
            }
        }
        return;
    }
    if (type == MOE_T_MXFP4X8) {
        for (int64_t b = 0; b < n / 32; b++) {
            const moe__block_mxfp4x8 *o = (const moe__block_mxfp4x8 *)w + b;
            for (int r = 0; r < 8; r++) {
                int acc = 0;
                for (int c = 0; c < 4; c++)
                    for (int k = 0; k < 4; k++) {
                        const uint8_t v = o->qs[c * 32 + r * 4 + k];
                        acc += e2m1x2[v & 15] * x[b].qs[4 * c + k] + e2m1x2[v >> 4] * x[b].qs[4 * (c + 4) + k];
                    }
                out[r] += 0.5f * e8m0(o->e[r]) * x[b].d * (float)acc;
            }
        }
        return;
    }
    for (int64_t b = 0; b < n / 32; b++) {
        int acc[8] = {0};
        const uint16_t *d;
        if (type == MOE_T_Q4_0X8) {
            const moe__block_q4_0x8 *o = (const moe__block_q4_0x8 *)w + b;
            d = o->d;
            for (int c = 0; c < 4; c++)
                for (int r = 0; r < 8; r++)
                    for (int k = 0; k < 4; k++) {
                        uint8_t v = o->qs[c * 32 + r * 4 + k];
                        acc[r] += (v & 15) * x[b].qs[4 * c + k] + (v >> 4) * x[b].qs[4 * (c + 4) + k];
                    }
            for (int r = 0; r < 8; r++) acc[r] -= 8 * x[b].sum;
        } else {
            const moe__block_q8_0x8 *o = (const moe__block_q8_0x8 *)w + b;
            d = o->d;
            for (int c = 0; c < 8; c++)
                for (int r = 0; r < 8; r++)
                    for (int k = 0; k < 4; k++) acc[r] += o->qs[c * 32 + r * 4 + k] * x[b].qs[4 * c + k];
            for (int r = 0; r < 8; r++) acc[r] -= 128 * x[b].sum;
        }
        for (int r = 0; r < 8; r++) out[r] += moe__f16_to_f32(d[r]) * x[b].d * (float)acc[r];
    }
}

/* MXFP4 row . q8a row (MOE_FLAG_MXFP4_INT8): per block the exact int32 sum of 2 E2M1 times the
 * activations' int8, times 2^(s-127)/2 and the activation scale, the float steps of the Q8_0
 * reference: a row of MXFP4 gives what a Q8_0 row holding its values (where the half-precision
 * scale can hold 2^(s-128)) gives. Compressed-tensors layout: low nibble = even column. */
float moe__dotq_mxfp4_ref(const void *w, const uint8_t *sc, const moe__block_q8a *x, int64_t n) {
    const uint8_t *p = w;
    float s = 0;
    for (int64_t b = 0; b < n / 32; b++) {
        int acc = 0;
        for (int i = 0; i < 16; i++) {
            const uint8_t v = p[b * 16 + i];
            acc += e2m1x2[v & 15] * x[b].qs[2 * i] + e2m1x2[v >> 4] * x[b].qs[2 * i + 1];
        }
        s += 0.5f * e8m0(sc[b]) * x[b].d * (float)acc;
    }
    return s;
}

/* the same for ggml's block_mxfp4 (low nibbles = values 0..15) */
static float dotq_mxfp4g_ref(const void *w, const moe__block_q8a *x, int64_t n) {
    const moe__block_mxfp4 *b = w;
    float s = 0;
    for (int64_t i = 0; i < n / 32; i++) {
        int acc = 0;
        for (int j = 0; j < 16; j++) acc += e2m1x2[b[i].qs[j] & 15] * x[i].qs[j] + e2m1x2[b[i].qs[j] >> 4] * x[i].qs[j + 16];
        s += 0.5f * e8m0(b[i].e) * x[i].d * (float)acc;
    }
    return s;
}

/* Q4_1 .. IQ4_XS row . q8a row: kq_term's per 32 values, summed in order */
static float dotq_kq_ref(int type, const void *w, const moe__block_q8a *x, int64_t n) {
    float s = 0;
    for (int64_t b = 0; b < n / 32; b++) s += kq_term(type, w, b, &x[b]);
    return s;
}
static float dotq_q4_1_ref(const void *w, const moe__block_q8a *x, int64_t n) { return dotq_kq_ref(MOE_T_Q4_1, w, x, n); }
static float dotq_q5_0_ref(const void *w, const moe__block_q8a *x, int64_t n) { return dotq_kq_ref(MOE_T_Q5_0, w, x, n); }
static float dotq_q5_1_ref(const void *w, const moe__block_q8a *x, int64_t n) { return dotq_kq_ref(MOE_T_Q5_1, w, x, n); }
static float dotq_q4_k_ref(const void *w, const moe__block_q8a *x, int64_t n) { return dotq_kq_ref(MOE_T_Q4_K, w, x, n); }
static float dotq_q5_k_ref(const void *w, const moe__block_q8a *x, int64_t n) { return dotq_kq_ref(MOE_T_Q5_K, w, x, n); }
static float dotq_q6_k_ref(const void *w, const moe__block_q8a *x, int64_t n) { return dotq_kq_ref(MOE_T_Q6_K, w, x, n); }
static float dotq_q2_k_ref(const void *w, const moe__block_q8a *x, int64_t n) { return dotq_kq_ref(MOE_T_Q2_K, w, x, n); }
static float dotq_q3_k_ref(const void *w, const moe__block_q8a *x, int64_t n) { return dotq_kq_ref(MOE_T_Q3_K, w, x, n); }
static float dotq_iq4_nl_ref(const void *w, const moe__block_q8a *x, int64_t n) { return dotq_kq_ref(MOE_T_IQ4_NL, w, x, n); }
static float dotq_iq4_xs_ref(const void *w, const moe__block_q8a *x, int64_t n) { return dotq_kq_ref(MOE_T_IQ4_XS, w, x, n); }
static float dotq_iq2_xxs_ref(const void *w, const moe__block_q8a *x, int64_t n) { return dotq_kq_ref(MOE_T_IQ2_XXS, w, x, n); }
static float dotq_iq2_xs_ref(const void *w, const moe__block_q8a *x, int64_t n) { return dotq_kq_ref(MOE_T_IQ2_XS, w, x, n); }
static float dotq_iq2_s_ref(const void *w, const moe__block_q8a *x, int64_t n) { return dotq_kq_ref(MOE_T_IQ2_S, w, x, n); }
static float dotq_iq3_xxs_ref(const void *w, const moe__block_q8a *x, int64_t n) { return dotq_kq_ref(MOE_T_IQ3_XXS, w, x, n); }
static float dotq_iq3_s_ref(const void *w, const moe__block_q8a *x, int64_t n) { return dotq_kq_ref(MOE_T_IQ3_S, w, x, n); }
static float dotq_iq1_s_ref(const void *w, const moe__block_q8a *x, int64_t n) { return dotq_kq_ref(MOE_T_IQ1_S, w, x, n); }
static float dotq_iq1_m_ref(const void *w, const moe__block_q8a *x, int64_t n) { return dotq_kq_ref(MOE_T_IQ1_M, w, x, n); }

float moe__dotq_ref(int type, const void *w, const moe__block_q8a *x, int64_t n) {
    if (type == MOE_T_Q8_0) return dotq_q8_0_ref(w, x, n);
    if (type == MOE_T_Q4_0) return dotq_q4_0_ref(w, x, n);
    return moe__is_quant(type) ? dotq_kq_ref(type, w, x, n) : 0;
}

static float dot_mxfp4g_ref(const void *w, const uint8_t *sc, const float *x, int64_t n) {
    (void)sc;
    const moe__block_mxfp4 *b = w;
    float s = 0;
    for (int64_t i = 0; i < n / 32; i++) {
        float bs = 0;
        for (int j = 0; j < 16; j++)
            bs += moe__e2m1[b[i].qs[j] & 15] * x[i * 32 + j] + moe__e2m1[b[i].qs[j] >> 4] * x[i * 32 + j + 16];
        s += bs * e8m0(b[i].e);
    }
    return s;
}

float moe__dot_ref(int type, const void *w, const uint8_t *scale, const float *x, int64_t n) {
    switch (type) {
    case MOE_T_MXFP4_GGML: return dot_mxfp4g_ref(w, scale, x, n);
    case MOE_T_F32: return dot_f32_ref(w, scale, x, n);
    case MOE_T_BF16: return dot_bf16_ref(w, scale, x, n);
    case MOE_T_F16: return dot_f16_ref(w, scale, x, n);
    case MOE_T_MXFP4: return dot_mxfp4_ref(w, scale, x, n);
    default: return 0;
    }
}

/* y[t * ldy + i] = (row i of w) . x_t through a level's dot kernel: the reference (with the
 * scalar dots), and the levels without matrix tiles */
static void gemm_by_dot(moe__dot_fn dot, int64_t row_bytes, const void *w, int nr, const float *x, int64_t ldx, int nt, int64_t K, float *y, int64_t ldy) {
    for (int t = 0; t < nt; t++)
        for (int i = 0; i < nr; i++) y[(int64_t)t * ldy + i] = dot((const unsigned char *)w + i * row_bytes, NULL, x + (int64_t)t * ldx, K);
}

void moe__gemm_ref(int type, const void *w, int64_t ldw, int nr, const float *x, int64_t ldx, int nt, int64_t K, float *y, int64_t ldy) {
    gemm_by_dot(type == MOE_T_BF16 ? dot_bf16_ref : dot_f32_ref, ldw * (type == MOE_T_BF16 ? 2 : 4), w, nr, x, ldx, nt, K, y, ldy);
}

static void gemm_f32_ref(const void *w, int64_t ldw, int nr, const float *x, int64_t ldx, int nt, int64_t K, float *y, int64_t ldy) {
    moe__gemm_ref(MOE_T_F32, w, ldw, nr, x, ldx, nt, K, y, ldy);
}
static void gemm_bf16_ref(const void *w, int64_t ldw, int nr, const float *x, int64_t ldx, int nt, int64_t K, float *y, int64_t ldy) {
    moe__gemm_ref(MOE_T_BF16, w, ldw, nr, x, ldx, nt, K, y, ldy);
}

/* ---- elementwise functions: activations and softmax exponentials ------------------------ */

/* The scalar references, as the forward pass always computed them (libm). The SIMD versions
 * evaluate e^x as 2^n e^r (|r| <= ln2/2, Cephes' degree-6 polynomial) and log1p(u) on (0, 1] as
 * 2 atanh(u / (2 + u)) by its odd series (7 terms, < 2e-9 relative). Measured against these on
 * 2 M points over [-110, 90] (a one-off program; act_levels checks 8e-7 relative): e^x within
 * 2 ulp, sigmoid 4.6, silu 3.8, softplus 5.9 ulp; inf / 0 / NaN as libm. */
void moe__act_ref(float *y, const float *x, int64_t n, int kind) {
    for (int64_t i = 0; i < n; i++) {
        const float z = x[i];
        if (kind == MOE__ACT_SOFTPLUS) y[i] = z > 20.0f ? z : log1pf(expf(z));
        else if (kind == MOE__ACT_SILU) y[i] = z * (1.0f / (1.0f + expf(-z)));
        else y[i] = 1.0f / (1.0f + expf(-z));
    }
}

void moe__widen_bf16_ref(float *y, const uint16_t *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = moe__bf16_to_f32(x[i]);
}

void moe__dwconv_ref(float *y, const float *const *rows, const float *w, int64_t ldw, int taps, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float acc = w[i] * rows[0][i];
        for (int j = 1; j < taps; j++) acc += w[j * ldw + i] * rows[j][i];
        y[i] = acc;
    }
}

#if defined(MOE_X86) || defined(MOE_NEON)
/* the SIMD levels' channels i0 .. n-1 past their last whole vector, as their lanes take them */
static inline void dwconv_tail(float *y, const float *const *rows, const float *w, int64_t ldw, int taps, int64_t i0, int64_t n) {
    for (int64_t i = i0; i < n; i++) {
        float acc = w[i] * rows[0][i];
        for (int j = 1; j < taps; j++) acc = fmaf(w[j * ldw + i], rows[j][i], acc);
        y[i] = acc;
    }
}
#endif

float moe__exp_sum_ref(float *y, const float *x, float shift, int64_t n) {
    float sum = 0;
    for (int64_t i = 0; i < n; i++) sum += y[i] = expf(x[i] - shift);
    return sum;
}

/* exp polynomial on the reduced argument (Cephes expf) and the log1p series in t = s^2 */
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
#define EXP_LO -104.0f /* e^x rounds to 0 below about -103.97 */
#define EXP_HI 89.0f   /* and to inf above 88.72 */

/* ---- absorbed MLA attention -------------------------------------------------------------- */

void moe__mla_scores_ref(const moe__mla_block *b) {
    for (int j = b->j0; j < b->j1; j++) {
        const float *c = b->cache + (size_t)j * b->cw;
        for (int h = 0; h < b->H; h++) {
            const float *qa = b->qa + (size_t)h * b->r, *qr = b->qr + (size_t)h * b->qr_stride;
            float s = 0, t = 0;
            for (int i = 0; i < b->r; i++) s += qa[i] * c[i];
            for (int i = 0; i < b->dr; i++) t += qr[i] * c[b->r + i];
            b->sc[(size_t)h * b->ld + j] = (s + t) * b->scale;
        }
    }
}

void moe__mla_ctx_ref(const moe__mla_block *b, int h0, int h1) {
    for (int j = 0; j < b->jn; j++) {
        const float *c = b->cache + (size_t)j * b->cw;
        for (int h = h0; h < h1; h++) {
            const float p = b->sc[(size_t)h * b->ld + j];
            float *ctx = b->ctx + (size_t)h * b->r;
            for (int i = 0; i < b->r; i++) ctx[i] += p * c[i];
        }
    }
}

size_t moe__mla_work16(int H, int cw, int ld) {
    /* widened queries [H, cw], rows [ld, cw], rounded weights [H, ld + 32] (the AVX512_BF16
     * kernel keeps its bf16 weight pairs there) */
    return (size_t)H * cw + (size_t)ld * cw + (size_t)H * ((size_t)ld + 32);
}

static float round_bf16(float x) { return moe__bf16_to_f32(moe__f32_to_bf16(x)); }

void moe__mla_scores16_ref(const moe__mla_block16 *b) {
    for (int j = b->j0; j < b->j1; j++) {
        const uint16_t *c = b->cache + (size_t)j * b->cw;
        for (int h = 0; h < b->H; h++) {
            const uint16_t *q = b->q + (size_t)h * b->cw;
            float s = 0;
            for (int i = 0; i < b->cw; i++) s += moe__bf16_to_f32(q[i]) * moe__bf16_to_f32(c[i]);
            b->sc[(size_t)h * b->ld + j] = s * b->scale;
        }
    }
}

void moe__mla_ctx16_ref(const moe__mla_block16 *b, int h0, int h1) {
    for (int j = 0; j < b->jn; j++) {
        const uint16_t *c = b->cache + (size_t)j * b->cw;
        for (int h = h0; h < h1; h++) {
            const float p = round_bf16(b->sc[(size_t)h * b->ld + j]);
            float *ctx = b->ctx + (size_t)h * b->r;
            for (int i = 0; i < b->r; i++) ctx[i] += p * moe__bf16_to_f32(c[i]);
        }
    }
}

/* Elementwise loops in groups of 8 independent statements on restrict pointers, which gcc's
 * straight-line vectorizer turns into vector instructions at -O2 (its loop vectorizer does not
 * take loops of run-time length at -O2); STMT uses the index c. */
#define EACH8(n, STMT)                                                                         \
    do {                                                                                       \
        int c_ = 0;                                                                            \
        for (; c_ + 8 <= (n); c_ += 8)                                                         \
            for (int k_ = 0; k_ < 8; k_++) {                                                   \
                const int c = c_ + k_;                                                         \
                STMT;                                                                          \
            }                                                                                  \
        for (; c_ < (n); c_++) {                                                               \
            const int c = c_;                                                                  \
            STMT;                                                                              \
        }                                                                                      \
    } while (0)

/* ---- int8 latent cache (MOE_KV_Q8) --------------------------------------------------------- */

/* the steps of moe__quant8_row from value i0 on, which the SIMD versions leave to it: the
 * largest |x| (m: the largest before i0; a NaN is passed over), and the rounding of values i0 ..
 * n-1 into q, whose sum it returns */
static float quant8_absmax_tail(const float *x, int i0, int n, float m) {
    for (int i = i0; i < n; i++) m = fabsf(x[i]) > m ? fabsf(x[i]) : m;
    return m;
}
static int32_t quant8_round_tail(const float *x, float inv, int i0, int n, int8_t *q) {
    int32_t s = 0;
    for (int i = i0; i < n; i++) {
        long v = lrintf(x[i] * inv);
        v = v > 127 ? 127 : v < -127 ? -127 : v;
        q[i] = (int8_t)v;
        s += (int32_t)v;
    }
    return s;
}

void moe__quant8_row(const float *x, int n, int8_t *q, float *d, int32_t *sum) {
    const float amax = quant8_absmax_tail(x, 0, n, 0.0f), inv = amax > 0 ? 127.0f / amax : 0.0f;
    *sum = quant8_round_tail(x, inv, 0, n, q);
    *d = amax / 127.0f;
}

size_t moe__mla_qt8_bytes(int H, int cw) { return (size_t)(H + 15) / 16 * 16 * (size_t)cw; }

void moe__mla_qt8(const int8_t *q, int H, int cw, int8_t *qt) {
    const int ng = (H + 15) / 16, nq = cw / 4;
    for (int g = 0; g < ng; g++)
        for (int i = 0; i < nq; i++)
            for (int l = 0; l < 16; l++)
                for (int t = 0; t < 4; t++) {
                    const int h = g * 16 + l;
                    qt[(((size_t)g * nq + i) * 16 + l) * 4 + t] = h < H ? q[(size_t)h * cw + 4 * i + t] : 0;
                }
}

/* the largest p_j d_j (at least 0), and each p_j d_j * inv rounded into bytes, in groups of 8
 * statements (as EACH8) so that they vectorize */
static MOE_ALWAYS_INLINE float max_prod(const float *restrict p, const float *restrict d, int n) {
    float m[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int j = 0;
    for (; j + 8 <= n; j += 8)
        for (int k = 0; k < 8; k++) {
            const float v = p[j + k] * d[j + k];
            m[k] = v > m[k] ? v : m[k];
        }
    for (; j < n; j++) m[0] = p[j] * d[j] > m[0] ? p[j] * d[j] : m[0];
    for (int k = 1; k < 8; k++) m[0] = m[k] > m[0] ? m[k] : m[0];
    return m[0];
}

/* clamped as floats: the int-side clamp kept the loop scalar */
static void round_u8(const float *restrict p, const float *restrict d, float inv, int n, uint8_t *restrict w) {
    EACH8(n, const float v = p[c] * d[c] * inv + 0.5f; w[c] = (uint8_t)(int)(v < 255.0f ? v : 255.0f));
}

#if defined(MOE_X86) || defined(MOE_NEON)
/* the steps of moe__mla_weights8 from key j0 on, which the SIMD versions leave to it: the
 * largest product (m: the largest before j0), and the rounding of keys j0 .. jn-1 with zeros up
 * to lw (a maximum is exact in any order, so the bytes are the reference's). Inlined, so that it
 * is compiled for the caller's level: called from AVX-512 code with the upper halves of the
 * registers in use, its SSE instructions cost about 180 cycles a call on an Intel Xeon (Granite
 * Rapids class, 2026-12: the AVX-512 weights took 5.5 us per 16 heads x 256 keys, the scalar 4.0) */
static MOE_ALWAYS_INLINE float weights8_max_tail(const float *p, const float *d, int j0, int jn, float m) {
    const float t = max_prod(p + j0, d + j0, jn - j0);
    return t > m ? t : m;
}
#endif
static void weights8_round_tail(const float *p, const float *d, float inv, int j0, int jn, int lw, uint8_t *w) {
    round_u8(p + j0, d + j0, inv, jn - j0, w + j0);
    for (int j = jn; j < lw; j++) w[j] = 0;
}

/* moe__mla_weights8 with a level's two steps for a head's row p of jn weights (d: the keys'
 * scales): the largest product, and the products times inv rounded into bytes, zeros up to lw */
typedef float (*weights8_max_fn)(const float *p, const float *d, int jn);
typedef void (*weights8_round_fn)(const float *p, const float *d, float inv, int jn, int lw, uint8_t *w);
static void weights8_heads(const float *p, int ld, const moe__kv8_meta *meta, int jn, int h0, int h1, uint8_t *w, int lw, float *ws,
                           float *work, weights8_max_fn max, weights8_round_fn round) {
    for (int j = 0; j < jn; j++) work[j] = meta[j].dc;
    for (int h = h0; h < h1; h++) {
        const float wmax = max(p + (size_t)h * ld, work, jn), inv = wmax > 0 ? 255.0f / wmax : 0.0f;
        round(p + (size_t)h * ld, work, inv, jn, lw, w + (size_t)h * lw);
        ws[h] = wmax / 255.0f;
    }
}

static void weights8_round_ref(const float *p, const float *d, float inv, int jn, int lw, uint8_t *w) {
    weights8_round_tail(p, d, inv, 0, jn, lw, w);
}

void moe__mla_weights8(const float *p, int ld, const moe__kv8_meta *meta, int jn, int h0, int h1, uint8_t *w, int lw, float *ws,
                       float *work) {
    weights8_heads(p, ld, meta, jn, h0, h1, w, lw, ws, work, max_prod, weights8_round_ref);
}

/* the score of key j (row c, meta mt) for head h from the two integer dot products */
static inline float score8(const moe__mla_block8 *b, int h, int32_t dc, int32_t dr, const moe__kv8_meta *mt) {
    return ((float)dc * (b->qd[2 * h] * mt->dc) + (float)dr * (b->qd[2 * h + 1] * mt->dr)) * b->scale;
}

void moe__mla_scores8_ref(const moe__mla_block8 *b) {
    for (int j = b->j0; j < b->j1; j++) {
        const int8_t *c = b->cache + (size_t)j * b->cw;
        for (int h = 0; h < b->H; h++) {
            const int8_t *q = b->q + (size_t)h * b->cw;
            int32_t dc = 0, dr = 0;
            for (int i = 0; i < b->r; i++) dc += q[i] * c[i];
            for (int i = b->r; i < b->cw; i++) dr += q[i] * c[i];
            b->sc[(size_t)h * b->ld + j] = score8(b, h, dc, dr, b->meta + j);
        }
    }
}

void moe__mla_ctx8_ref(const moe__mla_block8 *b, int h0, int h1) {
    for (int h = h0; h < h1; h++) {
        const uint8_t *w = b->w + (size_t)h * b->lw;
        float *ctx = b->ctx + (size_t)h * b->r;
        for (int i = 0; i < b->r; i++) {
            int32_t s = 0;
            for (int j = 0; j < b->jn; j++) s += w[j] * b->cache[(size_t)j * b->cw + i];
            ctx[i] += b->ws[h] * (float)s;
        }
    }
}

#if defined(MOE_X86) || defined(MOE_NEON) /* (for the SIMD levels only) */
/* Levels without bf16 dot products: the block widened to f32 (exact), the weights rounded to
 * bf16, through the level's f32 kernels: the same products, summed in another order. */
typedef void (*mla_scores_fn)(const moe__mla_block *b);
typedef void (*mla_ctx_fn)(const moe__mla_block *b, int h0, int h1);
typedef void (*widen_fn)(float *y, const uint16_t *x, int64_t n);

static void mla_scores16_widened(const moe__mla_block16 *b, mla_scores_fn scores, widen_fn widen) {
    const int n = b->j1 - b->j0;
    const int r = b->r, dr = b->cw - b->r;
    float *qa = b->work, *qr = qa + (size_t)b->H * r, *rows = qa + (size_t)b->H * b->cw; /* qa [H, r], qr [H, d_r] */
    for (int h = 0; h < b->H; h++) {
        widen(qa + (size_t)h * r, b->q + (size_t)h * b->cw, r);
        widen(qr + (size_t)h * dr, b->q + (size_t)h * b->cw + r, dr);
    }
    widen(rows, b->cache + (size_t)b->j0 * b->cw, (int64_t)n * b->cw);
    const moe__mla_block f = {b->H, r, dr, b->cw, n, 0, n, b->ld, dr, b->scale, qa, qr, rows, b->sc + b->j0, NULL};
    scores(&f);
}

static void mla_ctx16_widened(const moe__mla_block16 *b, int h0, int h1, mla_ctx_fn ctx, widen_fn widen) {
    float *rows = b->work + (size_t)b->H * b->cw, *p = rows + (size_t)b->ld * b->cw;
    widen(rows, b->cache, (int64_t)b->jn * b->cw);
    for (int h = h0; h < h1; h++)
        for (int j = 0; j < b->jn; j++) p[(size_t)h * b->ld + j] = round_bf16(b->sc[(size_t)h * b->ld + j]);
    const moe__mla_block f = {b->H, b->r, b->cw - b->r, b->cw, b->jn, 0, b->jn, b->ld, b->cw, 1.0f, NULL, NULL, rows, p, b->ctx};
    ctx(&f, h0, h1);
}
#endif

static void dotq8_q4_0_ref(const void *w, const moe__block_q8a *x, int64_t n, float *out) { moe__dotq8_ref(MOE_T_Q4_0X8, w, x, n, out); }
static void dotq8_q8_0_ref(const void *w, const moe__block_q8a *x, int64_t n, float *out) { moe__dotq8_ref(MOE_T_Q8_0X8, w, x, n, out); }
static void dotq8_mxfp4_ref(const void *w, const moe__block_q8a *x, int64_t n, float *out) { moe__dotq8_ref(MOE_T_MXFP4X8, w, x, n, out); }

static void axpy_ref(float *y, float a, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

/* ---- KDA core (docs/spec/MODEL.md section 6) ------------------------------------------------ */

/* Per token: S <- diag(e^g) S; u = beta (v - S^T k); S <- S + k u^T; o = S^T q.
 * S is [D key rows, D value columns]. */
void moe__kda_recurrent(const moe__kda_head *a) {
    const int D = a->D;
    float *S = a->S;
    float pred[512], u[512];
    MOE_ASSERT(D <= 512);
    for (int t = 0; t < a->n; t++) {
        const float *q = a->q + (size_t)t * a->stride, *k = a->k + (size_t)t * a->stride;
        const float *v = a->v + (size_t)t * a->stride, *g = a->g + (size_t)t * a->stride;
        float beta = a->beta[(size_t)t * a->beta_stride], *o = a->o + (size_t)t * a->stride;
        for (int j = 0; j < D; j++) pred[j] = 0;
        for (int i = 0; i < D; i++) {
            float d = expf(g[i]), ki = k[i], *row = S + (size_t)i * D;
            for (int j = 0; j < D; j++) {
                row[j] *= d;
                pred[j] += row[j] * ki;
            }
        }
        for (int j = 0; j < D; j++) u[j] = beta * (v[j] - pred[j]);
        for (int j = 0; j < D; j++) o[j] = 0;
        for (int i = 0; i < D; i++) {
            float ki = k[i], qi = q[i], *row = S + (size_t)i * D;
            for (int j = 0; j < D; j++) {
                row[j] += ki * u[j];
                o[j] += row[j] * qi;
            }
        }
    }
}

#define KDA_C 16 /* chunk length: with g >= -5 a chunk decays by at most e^-80 */

size_t moe__kda_chunk_work(int D) {
    /* G, Kt (k e^{G-R}), Kh (k e^{R-G}), Qt (q e^{G-R}), U: [C,D] each (R = 0 with the softplus
     * gate); A, P: [C,C]; gn (R, then e^R), X: [D]; St (the state transposed), Y (also Sr): [D,D]; Ut, Ft: [D,C] */
    return (size_t)5 * KDA_C * D + 2 * KDA_C * KDA_C + 2 * (size_t)D + 2 * (size_t)D * D + 2 * (size_t)D * KDA_C;
}

/* One chunk of n <= 16 tokens from state S0 (updated to S_next in place):
 *   A_ij = beta_i sum_c k_ic k_jc e^{G_ic-G_jc} (j<i);  (I+A) U = diag(beta)(V - K~ S0)
 *   P_ij = sum_c q_ic k_jc e^{G_ic-G_jc} (j<=i);       O = Q~ S0 + P U
 *   S_next = diag(e^{G_n}) S0 + sum_j (k_j e^{G_n-G_j}) u_j^T
 * bounded: the decays factor as e^{G_i-R} e^{R-G_j}, making A, P and the state update plain
 * matrix products; otherwise (softplus gate, unbounded step) each factor is formed per element.
 * R = G_n / 2 centres the factors within e^-40 .. e^40: factored from the chunk's start (e^{G_i}
 * down to e^-80), a key or query element under 6.5e-4 fell below FLT_MIN, lost its precision
 * as a denormal (or all of it where denormals are flushed), and then met e^{+80}. The two
 * products with S0 take the state's columns times e^{R} (Sr) instead. */
/* Elementwise loops of the chunked form (EACH8: the same results as one element at a time) */
static void kda_add(float *restrict o, const float *restrict a, const float *restrict b, int n) { EACH8(n, o[c] = a[c] + b[c]); }
static void kda_mul(float *restrict o, const float *restrict a, const float *restrict b, int n) { EACH8(n, o[c] = a[c] * b[c]); }
static void kda_div(float *restrict o, const float *restrict a, const float *restrict b, int n) { EACH8(n, o[c] = a[c] / b[c]); }
static void kda_scale(float *restrict o, const float *restrict a, int n) { EACH8(n, o[c] *= a[c]); }
/* o = o * a + b */
static void kda_scale_add(float *restrict o, const float *restrict a, const float *restrict b, int n) { EACH8(n, o[c] = o[c] * a[c] + b[c]); }
/* u = beta (v - u) */
static void kda_rhs(float *restrict u, float beta, const float *restrict v, int n) { EACH8(n, u[c] = beta * (v[c] - u[c])); }

/* The chunked form's decays e^{G} reach e^-80 within a chunk (and lower with the softplus gate),
 * and their products with the state and the keys fall below FLT_MIN: denormal numbers, which cost
 * an Intel core a microcode assist per operation (over a hundred cycles). Prefill of the
 * benchmark shape ran 2.2x faster on an Emerald Rapids Xeon with them flushed to zero (x86's FTZ
 * and DAZ bits; bench/RESULTS.md, "2026-12-01: denormals in KDA's chunked form"). The chunk flushes them while it runs, then gives
 * the caller back its own setting (keeping any exception flags raised meanwhile). With the
 * factors centred (below) no factor exceeds e^40, so a flushed value (under 1.2e-38) moves a
 * result by less than 3e-21. */
static unsigned denormals_flush_begin(void) {
#ifdef MOE_X86
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040u); /* FTZ (bit 15), DAZ (bit 6) */
    return csr;
#else
    return 0;
#endif
}

static void denormals_flush_end(unsigned csr) {
#ifdef MOE_X86
    _mm_setcsr(csr | (_mm_getcsr() & 0x3fu)); /* the caller's modes, the exception flags of both */
#else
    (void)csr;
#endif
}

void moe__kda_chunked(const moe__kda_head *a, int bounded, float *work, const moe__kernels *kk) {
    const unsigned csr = denormals_flush_begin();
    const int D = a->D, C = KDA_C;
    float *G = work, *Kt = G + C * D, *Kh = Kt + C * D, *Qt = Kh + C * D, *U = Qt + C * D;
    float *A = U + C * D, *P = A + C * C, *gn = P + C * C, *X = gn + D;
    float *St = X + D, *Y = St + (size_t)D * D, *Ut = Y + (size_t)D * D, *Ft = Ut + (size_t)D * C;
    float *S = a->S;
    const moe__dot_fn dot = kk->dot[MOE_T_F32];
    const moe__gemm_fn gemm = kk->gemm[MOE_T_F32];
    /* The three products per chunk (K~ S0, Q~ S0 and the state update) go through the matrix
     * kernel, which takes its right-hand factor as rows along the summed index: the state is kept
     * transposed (St[j][c] = S[c][j]) while the chunks run. */
    for (int c = 0; c < D; c++)
        for (int j = 0; j < D; j++) St[(size_t)j * D + c] = S[(size_t)c * D + j];
    for (int t0 = 0; t0 < a->n; t0 += C) {
        const int n = a->n - t0 < C ? a->n - t0 : C;
#define ROW(p, t) ((p) + (size_t)(t0 + (t)) * a->stride)
        for (int i = 0; i < n; i++) {
            if (i) kda_add(G + i * D, G + (i - 1) * D, ROW(a->g, i), D);
            else
                for (int c = 0; c < D; c++) G[c] = 0.0f + ROW(a->g, 0)[c];
        }
        /* bounded: gn holds the centre R, e^R once the rows are formed */
        for (int c = 0; bounded && c < D; c++) gn[c] = 0.5f * G[(n - 1) * D + c];
        for (int i = 0; i < n; i++) {
            const float *k = ROW(a->k, i), *q = ROW(a->q, i);
            if (bounded) {
                for (int c = 0; c < D; c++) X[c] = G[i * D + c] - gn[c];
                kk->exp_sum(X, X, 0.0f, D);
            } else {
                kk->exp_sum(X, G + i * D, 0.0f, D);
            }
            kda_mul(Kt + i * D, k, X, D);
            kda_mul(Qt + i * D, q, X, D);
            if (bounded) kda_div(Kh + i * D, k, X, D);
            else memset(Kh + i * D, 0, sizeof(float) * (size_t)D);
        }
        const float *S0 = St; /* the factor of K~ S0 and Q~ S0: St, or Sr = St diag(e^R) in Y */
        if (bounded) {
            kk->exp_sum(gn, gn, 0.0f, D);
            for (int j = 0; j < D; j++) kda_mul(Y + (size_t)j * D, St + (size_t)j * D, gn, D);
            S0 = Y;
        }
        /* A and P: with the bounded gate plain dot products of the factored rows */
        for (int i = 0; i < n; i++) {
            const float *qi = ROW(a->q, i), *ki = ROW(a->k, i);
            float beta = a->beta[(size_t)(t0 + i) * a->beta_stride];
            for (int j = 0; j <= i; j++) {
                float sa = 0, sp = 0;
                if (bounded) {
                    sa = dot(Kt + i * D, NULL, Kh + j * D, D);
                    sp = dot(Qt + i * D, NULL, Kh + j * D, D);
                } else { /* X = k_j e^{G_i - G_j} */
                    const float *kj = ROW(a->k, j);
                    for (int c = 0; c < D; c++) X[c] = G[i * D + c] - G[j * D + c];
                    kk->exp_sum(X, X, 0.0f, D);
                    for (int c = 0; c < D; c++) X[c] *= kj[c];
                    sa = dot(ki, NULL, X, D);
                    sp = dot(qi, NULL, X, D);
                }
                A[i * C + j] = j < i ? beta * sa : 0.0f;
                P[i * C + j] = sp;
            }
        }
        /* rhs = beta (V - K~ S0), then forward substitution U_i = rhs_i - sum_{j<i} A_ij U_j */
        gemm(S0, D, D, Kt, D, n, D, U, D);
        for (int i = 0; i < n; i++) {
            float beta = a->beta[(size_t)(t0 + i) * a->beta_stride], *u = U + i * D;
            const float *v = ROW(a->v, i);
            kda_rhs(u, beta, v, D);
            for (int m = 0; m < i; m++) kk->axpy(u, -A[i * C + m], U + m * D, D);
        }
        /* O = Q~ S0 + P U */
        gemm(S0, D, D, Qt, D, n, D, ROW(a->o, 0), a->stride);
        for (int i = 0; i < n; i++)
            for (int m = 0; m <= i; m++) kk->axpy(ROW(a->o, i), P[i * C + m], U + m * D, D);
        /* S_next = diag(e^{G_n}) S0 + F^T U, F_m = k_m e^{G_n - G_m}; transposed:
         * St[j][c] = e^{G_n,c} St[j][c] + sum_m U[m][j] F[m][c] */
        kk->exp_sum(X, G + (n - 1) * D, 0.0f, D); /* the chunk's decay e^{G_n} */
        for (int m = 0; m < n; m++) {
            float *f = Kh + m * D;
            if (bounded) { /* Kh_m = k_m e^{R-G_m}: times e^{G_n-R} = e^R (G_n - G_n/2 is exact) */
                kda_scale(f, gn, D);
            } else {
                for (int c = 0; c < D; c++) f[c] = G[(n - 1) * D + c] - G[m * D + c];
                kk->exp_sum(f, f, 0.0f, D);
                for (int c = 0; c < D; c++) f[c] *= ROW(a->k, m)[c];
            }
            for (int c = 0; c < D; c++) Ft[(size_t)c * C + m] = f[c];
            for (int j = 0; j < D; j++) Ut[(size_t)j * C + m] = U[m * D + j];
        }
        gemm(Ft, C, D, Ut, C, D, n, Y, D);
        for (int j = 0; j < D; j++) {
            float *row = St + (size_t)j * D;
            const float *y = Y + (size_t)j * D;
            kda_scale_add(row, X, y, D);
        }
#undef ROW
    }
    for (int c = 0; c < D; c++)
        for (int j = 0; j < D; j++) S[(size_t)c * D + j] = St[(size_t)j * D + c];
    denormals_flush_end(csr);
}

/* =================================================================================================
 * PART 3: X86 TEMPLATES
 * =================================================================================================
 * Kernels whose body is the same at several x86 levels but for the instruction that multiplies
 * (VPMADDUBSW + VPMADDWD at avx2, VPDPBUSD as VEX at avxvnni or as EVEX at avx512vnni) or the
 * vector width, written once as macros. Each macro is stamped in the parts that follow, one line
 * per kernel, and each such line is followed by a comment naming the functions it defines, so
 * grep finds them. They stay defined to the end of PART 7. */

#ifdef MOE_X86

/* Q4_K/Q5_K: the 8 sub-blocks' integer sums in one vector, then in float
 * x.d (d sc_j sum_j - dmin m_j sum(x)) for the 8 at once. One function per format and level
 * (DPB: 32 unsigned bytes times 32 signed ones, summed in fours into int32). Q5_K: bit j of
 * qh[l] moved to bit 4 of sub-block j's value l. */
#define K4_DECODE(c, lo, hi, FIVE)                                                                                        \
    do {                                                                                                                  \
        const __m256i r = _mm256_loadu_si256((const __m256i *)(const void *)(qs + 32 * (c)));                            \
        lo = _mm256_and_si256(r, m4), hi = _mm256_and_si256(_mm256_srli_epi16(r, 4), m4);                                \
        if (FIVE) {                                                                                                       \
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * (c)), one), 4));        \
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * (c) + 1), one), 4));    \
        }                                                                                                                 \
    } while (0)

/* sub-blocks 2c and 2c+1 of token t: their products pairwise summed (the first step of the sums) */
#define K4_PAIR(c, t, DPB)                                                                                                \
    _mm256_hadd_epi32(DPB(lo, _mm256_loadu_si256((const __m256i *)(const void *)x[(t) * xs + 8 * i + 2 * (c)].qs)),      \
                      DPB(hi, _mm256_loadu_si256((const __m256i *)(const void *)x[(t) * xs + 8 * i + 2 * (c) + 1].qs)))

/* NT (1 or 4) activation rows x + t xs blocks against one weight row: out[t], each row's float
 * steps the same whatever NT (the integer sums are exact in any order) */
#define K4_KERNEL(name, name4, TGT, FIVE, DPB)                                                                            \
    MOE_TARGET(TGT) static inline __attribute__((always_inline)) void name##_rows(const void *w, const moe__block_q8a *x, int64_t xs, \
                                                                                  int64_t n, float *out, const int NT) { \
        const int64_t bs = FIVE ? (int64_t)sizeof(moe__block_q5_k) : (int64_t)sizeof(moe__block_q4_k);                  \
        const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1), ones = _mm256_set1_epi16(1);                  \
        (void)ones, (void)one;                                                                                            \
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};             \
        for (int64_t i = 0; i < n / 256; i++) {                                                                           \
            const unsigned char *b = (const unsigned char *)w + i * bs, *qs = b + (FIVE ? 48 : 16);                        \
            const __m256i hb = FIVE ? _mm256_loadu_si256((const __m256i *)(const void *)(b + 16)) : _mm256_setzero_si256(); \
            (void)hb;                                                                                                     \
            __m256i lo, hi, h0[4], h1, s0[4], s1[4];                                                                      \
            K4_DECODE(0, lo, hi, FIVE);                                                                                   \
            MOE_UNROLL4 for (int t = 0; t < NT; t++) h0[t] = K4_PAIR(0, t, DPB);                              \
            K4_DECODE(1, lo, hi, FIVE);                                                                                   \
            MOE_UNROLL4 for (int t = 0; t < NT; t++) h1 = K4_PAIR(1, t, DPB), s0[t] = _mm256_hadd_epi32(h0[t], h1); \
            K4_DECODE(2, lo, hi, FIVE);                                                                                   \
            MOE_UNROLL4 for (int t = 0; t < NT; t++) h0[t] = K4_PAIR(2, t, DPB);                              \
            K4_DECODE(3, lo, hi, FIVE);                                                                                   \
            MOE_UNROLL4 for (int t = 0; t < NT; t++) h1 = K4_PAIR(3, t, DPB), s1[t] = _mm256_hadd_epi32(h0[t], h1); \
            uint8_t sm[16];                                                                                               \
            uint16_t hd[2];                                                                                               \
            memcpy(hd, b, 4);                                                                                             \
            k4_unpack_scales(b + 4, sm);                                                                                  \
            const __m128i smv = _mm_loadu_si128((const __m128i *)(const void *)sm);                                      \
            const __m256 sc = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(smv)), _mm256_set1_ps(f16_avx(hd[0]))); \
            const __m256 mn = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(smv, 8))), _mm256_set1_ps(f16_avx(hd[1]))); \
            MOE_UNROLL4 for (int t = 0; t < NT; t++) {                                                        \
                const __m256i S = _mm256_add_epi32(_mm256_permute2x128_si256(s0[t], s1[t], 0x20), _mm256_permute2x128_si256(s0[t], s1[t], 0x31)); \
                __m256 xd, xm;                                                                                            \
                q8a_heads8_avx2(x + t * xs + 8 * i, &xd, &xm);                                                            \
                acc[t] = _mm256_fmadd_ps(xd, _mm256_fmsub_ps(sc, _mm256_cvtepi32_ps(S), _mm256_mul_ps(mn, xm)), acc[t]);  \
            }                                                                                                             \
        }                                                                                                                 \
        MOE_UNROLL4 for (int t = 0; t < NT; t++) out[t] = hsum_avx2(acc[t]);                                  \
    }                                                                                                                     \
    MOE_TARGET(TGT) static float name(const void *w, const moe__block_q8a *x, int64_t n) {                              \
        float r;                                                                                                          \
        name##_rows(w, x, 0, n, &r, 1);                                                                                   \
        return r;                                                                                                         \
    }                                                                                                                     \
    MOE_TARGET(TGT) static void name4(const void *w, const moe__block_q8a *x, int64_t xs, int64_t n, float *out) {      \
        name##_rows(w, x, xs, n, out, 4);                                                                                 \
    }

/* Q4_KX8: 8 rows a call, a row a lane: each chunk's nibbles of the 8 rows against a broadcast
 * of 4 activation bytes at p (DPBA(acc, u, p) adds their products in fours to acc), the exact int32 sums of each sub-block, then
 * per lane the float steps the 1-row kernel takes for that sub-block (its lane j), accumulated
 * per sub-block and summed at the end in hsum_avx2's order: each row bit for bit the level's
 * dotq[Q4_K] on the row as stored */
/* Q5_KX8: sub-block 2p's and 2p + 1's fifth bits of chunk c (from field QH) to bit 4 of lo and hi */
#define K5X8_BITS(FIVE, QH, c)                                                                                                \
    if (FIVE) {                                                                                                           \
        const __m256i hb = _mm256_loadu_si256((const __m256i *)(const void *)(o->QH + 32 * (c)));                        \
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * p), one), 4));             \
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * p + 1), one), 4));         \
    }

#define K4X8_KERNEL(name, TGT, DPBA, SUMS, BLK, FIVE, QH)                                                               \
    MOE_TARGET(TGT) static void name(const void *w, const moe__block_q8a *x, int64_t n, float *out) {                   \
        const BLK *o = w;                                                                                                 \
        const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1), one = _mm256_set1_epi8(1);                  \
        (void)ones, (void)one;                                                                                            \
        __m256 acc[8];                                                                                                    \
        for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();                                                         \
        for (int64_t i = 0; i < n / 256; i++, o++, x += 8) {                                                              \
            prefetch_ahead_l2(o, sizeof *o);                                                                              \
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)o->d));                      \
            const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)o->dmin));                  \
            for (int p = 0; p < 4; p++) {                                                                                 \
                __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();                                         \
                const uint8_t *q = o->qs + p * 256;                                                                       \
                const int8_t *x0 = x[2 * p].qs, *x1 = x[2 * p + 1].qs;                                                                                 \
                MOE_UNROLL8 for (int c = 0; c < 8; c++) {                                                     \
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(q + 32 * c));                   \
                    __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);            \
                    K5X8_BITS(FIVE, QH, c);                                                                                   \
                    DPBA(s0, lo, x0 + 4 * c);                                                                             \
                    DPBA(s1, hi, x1 + 4 * c);                                                                             \
                }                                                                                                         \
                MOE_UNROLL4 for (int h = 0; h < 2; h++) {                                                                 \
                    const int j = 2 * p + h;                                                                              \
                    const __m256 sc = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)o->sc[j]))), d); \
                    const __m256 mn = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)o->m[j]))), dm); \
                    const __m256 t = _mm256_fmsub_ps(sc, _mm256_cvtepi32_ps(SUMS(h ? s1 : s0)), _mm256_mul_ps(mn, _mm256_set1_ps((float)x[j].sum))); \
                    acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(x[j].d), t, acc[j]);                                          \
                }                                                                                                         \
            }                                                                                                             \
        }                                                                                                                 \
        _mm256_storeu_ps(out, sum8_hsum_order_avx2(acc));                                                                 \
    }

/* the same for 4 activation rows (x + t xs blocks) -> out[t * 8 + r], each row's float steps
 * those of the 1-row kernel (the weights decoded once for the 4; accumulators in memory) */
#define K4X8X4_KERNEL(name, TGT, DPBA, SUMS, BLK, FIVE, QH)                                                             \
    MOE_TARGET(TGT) static void name(const void *w, const moe__block_q8a *x, int64_t xs, int64_t n, float *out) {       \
        const BLK *o = w;                                                                                                 \
        const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1), one = _mm256_set1_epi8(1);                  \
        (void)ones, (void)one;                                                                                            \
        __m256 acc[4][8];                                                                                                 \
        for (int t = 0; t < 4; t++)                                                                                       \
            for (int j = 0; j < 8; j++) acc[t][j] = _mm256_setzero_ps();                                                  \
        for (int64_t i = 0; i < n / 256; i++, o++) {                                                                      \
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)o->d));                      \
            const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)o->dmin));                  \
            for (int p = 0; p < 4; p++) {                                                                                 \
                __m256i s[4][2];                                                                                          \
                MOE_UNROLL4 for (int t = 0; t < 4; t++) s[t][0] = s[t][1] = _mm256_setzero_si256();          \
                const uint8_t *q = o->qs + p * 256;                                                                       \
                MOE_UNROLL8 for (int c = 0; c < 8; c++) {                                                     \
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(q + 32 * c));                   \
                    __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);            \
                    K5X8_BITS(FIVE, QH, c);                                                                                   \
                    MOE_UNROLL4 for (int t = 0; t < 4; t++) {                                                 \
                        const moe__block_q8a *xt = x + t * xs + 8 * i;                                                    \
                        DPBA(s[t][0], lo, xt[2 * p].qs + 4 * c);                                                          \
                        DPBA(s[t][1], hi, xt[2 * p + 1].qs + 4 * c);                                                      \
                    }                                                                                                     \
                }                                                                                                         \
                MOE_UNROLL4 for (int h = 0; h < 2; h++) {                                                                 \
                    const int j = 2 * p + h;                                                                              \
                    const __m256 sc = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)o->sc[j]))), d); \
                    const __m256 mn = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)o->m[j]))), dm); \
                    MOE_UNROLL4 for (int t = 0; t < 4; t++) {                                                 \
                        const moe__block_q8a *xj = x + t * xs + 8 * i + j;                                                \
                        const __m256 tt = _mm256_fmsub_ps(sc, _mm256_cvtepi32_ps(SUMS(s[t][h])), _mm256_mul_ps(mn, _mm256_set1_ps((float)xj->sum))); \
                        acc[t][j] = _mm256_fmadd_ps(_mm256_set1_ps(xj->d), tt, acc[t][j]);                                \
                    }                                                                                                     \
                }                                                                                                         \
            }                                                                                                             \
        }                                                                                                                 \
        for (int t = 0; t < 4; t++) _mm256_storeu_ps(out + 8 * t, sum8_hsum_order_avx2(acc[t]));                        \
    }

#define SUMS32(s) (s)

#define MOE_VNNI "avx2,fma,f16c,avx512f,avx512vl,avx512vnni"

/* the AVX-VNNI level's target and its 256-bit dpbusd; a test build (make test-avxvnni-evex) takes
 * the EVEX encoding instead and offers the level on AVX-512 VNNI CPUs, so that a machine without
 * AVX-VNNI (and qemu, which lacks it) still checks these kernels' logic */
#ifdef MOE_AVXVNNI_AS_EVEX
#define MOE_AVXVNNI MOE_VNNI
#define AVXVNNI_DPBUSD _mm256_dpbusd_epi32
#else
#define MOE_AVXVNNI "avx2,fma,f16c,avxvnni"
#define AVXVNNI_DPBUSD _mm256_dpbusd_avx_epi32
#endif

/* the 1- and 4-activation-row kernels of an interleaved format, from its name##_rows(..., NT) */
#define X8_ROW_FORMS(name, name4, TGT)                                                                                   \
    MOE_TARGET(TGT) static void name(const void *w, const moe__block_q8a *x, int64_t n, float *out) { name##_rows(w, x, 0, n, out, 1); } \
    MOE_TARGET(TGT) static void name4(const void *w, const moe__block_q8a *x, int64_t xs, int64_t n, float *out) { name##_rows(w, x, xs, n, out, 4); }

/* IQ4_XSX8: the nibbles of a chunk to levels by one byte shuffle each, 4 values of 8 rows a 32-bit
 * lane; AVX2 multiplies the signed levels as mul_i8_avx2 does, the VNNI levels take them + 128
 * unsigned and subtract 128 sum(x). Per sub-block and row the exact int32 dot times ls - 32
 * (mullo), then x.d d times that in float, summed in hsum_avx2's order: each row bit for bit
 * the level's IQ4_XS row kernel. NT (1 or 4) activation rows x + t xs blocks -> out[t * 8 + r]. */
#define IQ4X8_KERNEL(name, name4, TGT, DOT, OFF)                                                                          \
    MOE_TARGET(TGT) static inline __attribute__((always_inline)) void name##_rows(const void *w, const moe__block_q8a *x, int64_t xs, \
                                                                                  int64_t n, float *out, const int NT) { \
        const moe__block_iq4_xsx8 *o = w;                                                                                 \
        const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);                                            \
        const __m256i kv = _mm256_add_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)moe__iq4nl_values)), \
                                           _mm256_set1_epi8((char)(OFF)));                                                \
        (void)ones;                                                                                                       \
        __m256 acc[4][8];                                                                                                 \
        for (int t = 0; t < 4; t++)                                                                                       \
            for (int j = 0; j < 8; j++) acc[t][j] = _mm256_setzero_ps();                                                  \
        for (int64_t i = 0; i < n / 256; i++, o++) {                                                                      \
            if (NT == 1) prefetch_ahead_l2(o, sizeof *o);                                                                 \
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)o->d));                      \
            for (int p = 0; p < 4; p++) {                                                                                 \
                __m256i s[4][2];                                                                                          \
                for (int t = 0; t < 4; t++) s[t][0] = s[t][1] = _mm256_setzero_si256();                                   \
                const uint8_t *q = o->qs + p * 256;                                                                       \
                MOE_UNROLL8 for (int c = 0; c < 8; c++) {                                                                 \
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(q + 32 * c));                   \
                    const __m256i lo = _mm256_shuffle_epi8(kv, _mm256_and_si256(v, m4));                                  \
                    const __m256i hi = _mm256_shuffle_epi8(kv, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));            \
                    MOE_UNROLL4 for (int t = 0; t < NT; t++) {                                                            \
                        DOT(s[t][0], lo, x[t * xs + 8 * i + 2 * p].qs + 4 * c);                                           \
                        DOT(s[t][1], hi, x[t * xs + 8 * i + 2 * p + 1].qs + 4 * c);                                       \
                    }                                                                                                     \
                }                                                                                                         \
                MOE_UNROLL4 for (int h = 0; h < 2; h++) {                                                                 \
                    const int j = 2 * p + h;                                                                              \
                    const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)o->sc[j]));  \
                    MOE_UNROLL4 for (int t = 0; t < NT; t++) {                                                            \
                        const moe__block_q8a *xb = &x[t * xs + 8 * i + j];                                                \
                        const __m256i dot = (OFF) ? _mm256_sub_epi32(s[t][h], _mm256_set1_epi32((OFF) * xb->sum)) : s[t][h]; \
                        acc[t][j] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(xb->d), d), _mm256_cvtepi32_ps(_mm256_mullo_epi32(dot, sc)), acc[t][j]); \
                    }                                                                                                     \
                }                                                                                                         \
            }                                                                                                             \
        }                                                                                                                 \
        MOE_UNROLL4 for (int t = 0; t < NT; t++) _mm256_storeu_ps(out + 8 * t, sum8_hsum_order_avx2(acc[t]));          \
    }                                                                                                                     \
    X8_ROW_FORMS(name, name4, TGT)

/* Q2_KX8, Q3_KX8: per sub-block j, its 8 chunks' 2-bit values (Q3_K: + 4 where its bit is set
 * in hmask, so 0..7) as unsigned bytes, 4 values of 8 rows a 32-bit lane, into two int32 sums per
 * row (values 0..15 and 16..31 of the sub-block); then exactly as the row kernels: Q3_K's
 * sums less 4 sum(x) over each 16 times the 16s' scales, Q2_K's times its scales, its minimums
 * times the 16s' sums of x, and the row kernel's float steps, summed in hsum_avx2's order: each
 * row bit for bit the level's row kernel. NT (1 or 4) activation rows -> out[t * 8 + r]. */
static inline int sum16_i8(const int8_t *p) { /* SSE2: bytes + 128 summed by psadbw */
    const __m128i s = _mm_sad_epu8(_mm_xor_si128(_mm_loadu_si128((const __m128i *)(const void *)p), _mm_set1_epi8((char)0x80)), _mm_setzero_si128());
    return _mm_cvtsi128_si32(s) + _mm_extract_epi16(s, 4) - 16 * 128;
}

#define K2X8_KERNEL(name, name4, TGT, DPBA, SUMS, THREE)                                                                              \
    MOE_TARGET(TGT) static inline __attribute__((always_inline)) void name##_rows(const void *w, const moe__block_q8a *x, int64_t xs, \
                                                                                  int64_t n, float *out, const int NT) { \
        const __m256i m3 = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4), ones = _mm256_set1_epi16(1);                 \
        (void)ones, (void)four;                                                                                           \
        __m256 acc[4][8];                                                                                                 \
        for (int t = 0; t < 4; t++)                                                                                       \
            for (int j = 0; j < 8; j++) acc[t][j] = _mm256_setzero_ps();                                                  \
        for (int64_t i = 0; i < n / 256; i++) {                                                                           \
            const moe__block_q2_kx8 *o2 = (const moe__block_q2_kx8 *)w + i;                                               \
            const moe__block_q3_kx8 *o3 = (const moe__block_q3_kx8 *)w + i;                                               \
            if (NT == 1) { if (THREE) prefetch_ahead_l2(o3, sizeof *o3); else prefetch_ahead_l2(o2, sizeof *o2); }                 \
            const uint8_t *qs = THREE ? o3->qs : o2->qs;                                                                  \
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(THREE ? o3->d : o2->d)));  \
            const __m256 dmin = THREE ? d : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)o2->dmin));  \
            MOE_UNROLL8 for (int j = 0; j < 8; j++) {                                                                     \
                __m256i s[4][2];                                                                                          \
                for (int t = 0; t < 4; t++) s[t][0] = s[t][1] = _mm256_setzero_si256();                                   \
                MOE_UNROLL8 for (int c = 0; c < 8; c++) {                                                                 \
                    __m256i v = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(const void *)(qs + 256 * (j / 4) + 32 * c)), 2 * (j % 4)), m3); \
                    if (THREE) { /* bit j of the hmask byte to bit 2 */                                                   \
                        const __m256i hm = _mm256_loadu_si256((const __m256i *)(const void *)(o3->hm + 32 * c));         \
                        v = _mm256_or_si256(v, _mm256_and_si256(j < 2 ? _mm256_slli_epi16(hm, 2 - j) : j > 2 ? _mm256_srli_epi16(hm, j - 2) : hm, four)); \
                    }                                                                                                     \
                    MOE_UNROLL4 for (int t = 0; t < NT; t++) DPBA(s[t][c / 4], v, x[t * xs + 8 * i + j].qs + 4 * c);     \
                }                                                                                                         \
                __m256i sc0, sc1, mn0 = _mm256_setzero_si256(), mn1 = mn0;                                                \
                if (THREE) {                                                                                              \
                    sc0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)o3->sc[2 * j]));           \
                    sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)o3->sc[2 * j + 1]));       \
                } else {                                                                                                  \
                    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)o2->sc[2 * j])); \
                    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)o2->sc[2 * j + 1])); \
                    const __m256i m15 = _mm256_set1_epi32(15);                                                            \
                    sc0 = _mm256_and_si256(b0, m15), sc1 = _mm256_and_si256(b1, m15);                                     \
                    mn0 = _mm256_srli_epi32(b0, 4), mn1 = _mm256_srli_epi32(b1, 4);                                       \
                }                                                                                                         \
                MOE_UNROLL4 for (int t = 0; t < NT; t++) {                                                                \
                    const moe__block_q8a *xb = &x[t * xs + 8 * i + j];                                                    \
                    const int h0 = sum16_i8(xb->qs), h1 = xb->sum - h0;                                                   \
                    __m256i a0 = SUMS(s[t][0]), a1 = SUMS(s[t][1]);                                                                   \
                    if (THREE) a0 = _mm256_sub_epi32(a0, _mm256_set1_epi32(4 * h0)), a1 = _mm256_sub_epi32(a1, _mm256_set1_epi32(4 * h1)); \
                    const __m256i S = _mm256_add_epi32(_mm256_mullo_epi32(a0, sc0), _mm256_mullo_epi32(a1, sc1));         \
                    if (THREE) {                                                                                          \
                        acc[t][j] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(xb->d), d), _mm256_cvtepi32_ps(S), acc[t][j]); \
                    } else {                                                                                              \
                        const __m256i Sm = _mm256_add_epi32(_mm256_mullo_epi32(mn0, _mm256_set1_epi32(h0)), _mm256_mullo_epi32(mn1, _mm256_set1_epi32(h1))); \
                        acc[t][j] = _mm256_fmadd_ps(_mm256_set1_ps(xb->d), _mm256_fmsub_ps(d, _mm256_cvtepi32_ps(S), _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(Sm))), acc[t][j]); \
                    }                                                                                                     \
                }                                                                                                         \
            }                                                                                                             \
        }                                                                                                                 \
        MOE_UNROLL4 for (int t = 0; t < NT; t++) _mm256_storeu_ps(out + 8 * t, sum8_hsum_order_avx2(acc[t]));          \
    }                                                                                                                     \
    X8_ROW_FORMS(name, name4, TGT)

/* Q6_KX8: per half of a block and chunk c, one qh load serves its 4 sub-blocks and one ql load
 * two of them (as the row kernel's q[0..3]): values 0..63 unsigned, 4 of 8 rows a 32-bit lane, into
 * two int32 sums per row and sub-block (values 0..15, 16..31); then as Q3_KX8: less 32 sum(x) over
 * each 16, times the 16s' scales, and the row kernel's float steps in hsum_avx2's order: each row
 * bit for bit the Q6_K row kernel. One activation row takes a half's 4 sub-blocks in one pass over
 * its chunks (8 int32 sums), 4 rows one sub-block a pass (the 4 rows' sums would not fit in the
 * registers). NT (1 or 4) activation rows x + t xs blocks -> out[t * 8 + r]. */
#define K6X8_KERNEL(name, name4, TGT, DPBA)                                                                                \
    MOE_TARGET(TGT) static inline __attribute__((always_inline)) void name##_rows(const void *w, const moe__block_q8a *x, int64_t xs, \
                                                                                  int64_t n, float *out, const int NT) { \
        const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);               \
        (void)ones;                                                                                                       \
        const int KG = NT == 1 ? 4 : 1; /* sub-blocks of a half per pass */                                               \
        __m256 acc[4][8];                                                                                                 \
        for (int t = 0; t < 4; t++)                                                                                       \
            for (int j = 0; j < 8; j++) acc[t][j] = _mm256_setzero_ps();                                                  \
        for (int64_t i = 0; i < n / 256; i++) {                                                                           \
            const moe__block_q6_kx8 *o = (const moe__block_q6_kx8 *)w + i;                                                \
            if (NT == 1) prefetch_ahead_l2(o, sizeof *o);                                                                 \
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)o->d));                      \
            MOE_UNROLL4 for (int h = 0; h < 2; h++)                                                                       \
                MOE_UNROLL4 for (int k0 = 0; k0 < 4; k0 += KG) {                                                          \
                    __m256i s[4][4][2];                                                                                   \
                    MOE_UNROLL4 for (int t = 0; t < NT; t++)                                                              \
                        MOE_UNROLL4 for (int k = 0; k < KG; k++) s[t][k][0] = s[t][k][1] = _mm256_setzero_si256();        \
                    MOE_UNROLL8 for (int c = 0; c < 8; c++) {                                                             \
                        const __m256i qh = _mm256_loadu_si256((const __m256i *)(const void *)(o->qh + 256 * h + 32 * c)); \
                        MOE_UNROLL4 for (int kk = 0; kk < KG; kk++) {                                                     \
                            const int k = k0 + kk;                                                                        \
                            const __m256i l = _mm256_loadu_si256((const __m256i *)(const void *)(o->ql + 512 * h + 256 * (k & 1) + 32 * c)); \
                            const __m256i lo = _mm256_and_si256(k < 2 ? l : _mm256_srli_epi16(l, 4), m4);                \
                            const __m256i hi = k == 0 ? _mm256_slli_epi16(qh, 4) : k == 1 ? _mm256_slli_epi16(qh, 2) : k == 2 ? qh : _mm256_srli_epi16(qh, 2); \
                            const __m256i v = _mm256_or_si256(lo, _mm256_and_si256(hi, m30));                             \
                            MOE_UNROLL4 for (int t = 0; t < NT; t++) DPBA(s[t][kk][c / 4], v, x[t * xs + 8 * i + 4 * h + k].qs + 4 * c); \
                        }                                                                                                 \
                    }                                                                                                     \
                    MOE_UNROLL4 for (int kk = 0; kk < KG; kk++) {                                                         \
                        const int j = 4 * h + k0 + kk;                                                                    \
                        const __m256i sc0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)o->sc[2 * j])); \
                        const __m256i sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)o->sc[2 * j + 1])); \
                        MOE_UNROLL4 for (int t = 0; t < NT; t++) {                                                        \
                            const moe__block_q8a *xb = &x[t * xs + 8 * i + j];                                            \
                            const int h0 = sum16_i8(xb->qs), h1 = xb->sum - h0;                                           \
                            const __m256i a0 = _mm256_sub_epi32(s[t][kk][0], _mm256_set1_epi32(32 * h0));                 \
                            const __m256i a1 = _mm256_sub_epi32(s[t][kk][1], _mm256_set1_epi32(32 * h1));                 \
                            const __m256i S = _mm256_add_epi32(_mm256_mullo_epi32(a0, sc0), _mm256_mullo_epi32(a1, sc1));     \
                            acc[t][j] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(xb->d), d), _mm256_cvtepi32_ps(S), acc[t][j]); \
                        }                                                                                                 \
                    }                                                                                                     \
                }                                                                                                         \
        }                                                                                                                 \
        MOE_UNROLL4 for (int t = 0; t < NT; t++) _mm256_storeu_ps(out + 8 * t, sum8_hsum_order_avx2(acc[t]));          \
    }                                                                                                                     \
    X8_ROW_FORMS(name, name4, TGT)

/* Block b of x8 weights in W-bit registers (256: one group; 512: two groups side by side) against
 * one activation block XB: the block's 8 chunks U(0) .. U(7) (unsigned bytes, in the order of the
 * activation's 4-byte groups) in four dpbusd chains with bias * sum(x) folded into the first,
 * then the block's sum times DW (the rows' scales) and the activation's scale into the even (A0)
 * or odd (A1) float accumulator. HI scales the sum of the chunks 4-7 (chains s1, s3) before it
 * joins the sum of chunks 0-3: VNNI_SAME, or X16_DOWN where those chunks are 16 times their
 * values (Q4_0's high nibbles masked in place). dpbusd has a latency of several cycles: four
 * independent sums per block and two float accumulators keep the chains short, so the
 * instructions issued (loads among them), not the latencies, set the pace. The 1-row, 4-row and
 * two-group kernels all take these steps, so each of their outputs is the same bits. */
#define VNNI_BLOCK(W, DPB, XB, U, HI, bias, DW, A0, A1)                                                                 \
    do {                                                                                                           \
        const moe__block_q8a *xb_ = (XB);                                                                          \
        const int32_t *xq = (const int32_t *)xb_->qs;                                                              \
        __m##W##i s0 = _mm##W##_set1_epi32((bias) * xb_->sum), s1 = _mm##W##_setzero_si##W(), s2 = s1, s3 = s1;    \
        DPB(s0, U(0), xq + 0); DPB(s1, U(4), xq + 4); DPB(s2, U(1), xq + 1); DPB(s3, U(5), xq + 5);              \
        DPB(s0, U(2), xq + 2); DPB(s1, U(6), xq + 6); DPB(s2, U(3), xq + 3); DPB(s3, U(7), xq + 7);              \
        const __m##W##i s = _mm##W##_add_epi32(_mm##W##_add_epi32(s0, s2), HI(W, _mm##W##_add_epi32(s1, s3)));    \
        const __m##W d = _mm##W##_mul_ps(DW, _mm##W##_set1_ps(xb_->d));                                            \
        if (b & 1) A1 = _mm##W##_fmadd_ps(d, _mm##W##_cvtepi32_ps(s), A1);                                         \
        else A0 = _mm##W##_fmadd_ps(d, _mm##W##_cvtepi32_ps(s), A0);                                               \
    } while (0)

/* the chunks of the 4-row and two-group kernels, unpacked into u0 .. u7 beforehand */
#define VNNI_UREG(c) u##c

/* the sum of chunks 4-7 as it is (VNNI_SAME) or divided by 16 (X16_DOWN: exact, the chunks were
 * high nibbles masked in place, 16 times their values) */
#define VNNI_SAME(W, s) (s)

#define X16_DOWN(W, s) _mm##W##_srai_epi32(s, 4)

/* The 1-row kernels load each 32 bytes of a 4-bit block once, into v0 .. v3 (X8_LOAD): the empty
 * asm statement keeps each load in a register, where GCC otherwise folds it into both of its
 * uses. The kernel is limited by how many vector instructions a cycle the core issues, loads
 * about two a cycle among them (Zen 4), and the 8 activation broadcasts per block are loads too
 * (folded into the dpbusd, VNNI_DPB_BCST): this and masking Q4_0's high nibbles
 * in place (no shift) took the Q4_0 kernel from 45 to 50-52 GB/s from L2 on one Zen 4 core
 * (bench/RESULTS.md, "2026-12-01: what limits the Q4_0 decode kernel on Zen 4"). */
#define X8_LOAD(c) _mm256_loadu_si256((const __m256i *)(o[b].qs + 32 * (c)))

#define X8_PIN(v) __asm__("" : "+x"(v))

#define X8_LOADS                                                                                                   \
    __m256i v0 = X8_LOAD(0), v1 = X8_LOAD(1), v2 = X8_LOAD(2), v3 = X8_LOAD(3);                                     \
    X8_PIN(v0); X8_PIN(v1); X8_PIN(v2); X8_PIN(v3);

/* chunk c of a 4-bit block: the 32 bytes holding it (chunks c and c + 4 share them) */
#define X8_V(c) (((c) & 3) == 0 ? v0 : ((c) & 3) == 1 ? v1 : ((c) & 3) == 2 ? v2 : v3)

/* Q4_0: chunk c < 4 in the low nibbles, c + 4 in the high nibbles, 16 times (X16_DOWN) */
#define Q4_0_NIBBLES(c) _mm256_and_si256(X8_V(c), (c) < 4 ? m4 : m4h)

/* MXFP4: codes looked up from the low or high nibbles */
#define MXFP4_CODES(c) _mm256_shuffle_epi8(lut, _mm256_and_si256((c) < 4 ? X8_V(c) : _mm256_srli_epi16(X8_V(c), 4), m4))

#define Q8_CHUNK(c) X8_LOAD(c)

#define X8_FP16_SCALES _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)o[b].d))

/* The three 1-row VNNI kernels come in three builds: with the software prefetch of the weights
 * (PREFETCH_AHEAD) into L1, the same into L2 only, and without it, leaving the stream to the
 * hardware prefetchers. moe__kernel_levels takes the third on Zen 4, where it was 5% faster for
 * a whole decode token (2 threads, tokens alternating between the builds in one process), as
 * prefetching to L2 was 7-8% slower; the second elsewhere: 2 threads of a Xeon (Emerald Rapids)
 * decoded at 0.859 of the roofline against 0.823 with the first (30 alternating runs, the L2
 * build ahead in 26), and on Zen 5 a Q4_0 decode token took 5-6% less time than with the first
 * (3-4% for Q8_0; the first had replaced no prefetch there, taking one core from 28-30 to 40
 * GB/s). bench/RESULTS.md has the figures. Same products, bit for bit (quant_blocks runs all
 * three). */
/* one 1-row kernel: block type BT, set-up declarations SETUP, per-block loads LOADS, chunk
 * decoder U, high-chunk scaling HI, bias, scales DW */
#define VNNI_X1_KERNEL(fname, TGT, DPB, BT, SETUP, LOADS, U, HI, bias, DW, PF)                                     \
    MOE_TARGET(TGT) static void fname(const void *w, const moe__block_q8a *x, int64_t n, float *out) {            \
        const BT *o = w;                                                                                           \
        SETUP                                                                                                      \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                                             \
        for (int64_t b = 0; b < n / 32; b++) {                                                                     \
            PF(o + b, sizeof *o);                                                                                  \
            LOADS                                                                                                  \
            VNNI_BLOCK(256, DPB, x + b, U, HI, bias, DW, acc0, acc1);                                              \
        }                                                                                                          \
        _mm256_storeu_ps(out, _mm256_add_ps(acc0, acc1));                                                          \
    }

/* Q4_0 and Q8_0 with their fp16 scales; MXFP4x8 with codes looked up as 2 E2M1 + 12 (bias -12) */
#define VNNI_X1_KERNELS(name, TGT, DPB, PF)                                                                        \
    VNNI_X1_KERNEL(dotq8_q4_0_##name, TGT, DPB, moe__block_q4_0x8, const __m256i m4 = _mm256_set1_epi8(15); const __m256i m4h = _mm256_set1_epi8((char)0xf0);, \
                   X8_LOADS, Q4_0_NIBBLES, X16_DOWN, -8, X8_FP16_SCALES, PF)                                       \
    VNNI_X1_KERNEL(dotq8_q8_0_##name, TGT, DPB, moe__block_q8_0x8, , , Q8_CHUNK, VNNI_SAME, -128, X8_FP16_SCALES, PF) \
    VNNI_X1_KERNEL(dotq8_mxfp4_##name, TGT, DPB, moe__block_mxfp4x8, const __m256i m4 = _mm256_set1_epi8(15); const __m256i lut = mxfp4x8_lut_avx2();, \
                   X8_LOADS, MXFP4_CODES, VNNI_SAME, -12, mxfp4x8_scales_avx2(o[b].e), PF)

/* Prefill: one x8 row group against 4 activation rows (x, x + xs, ... in blocks): the weights
 * are loaded (and unpacked) once for the 4 rows, and each row's sums are formed as the 1-row
 * VNNI kernels form theirs (exact integer sums, then the same float steps in the same order),
 * so out[t * 8 ..] is bit for bit that kernel's result for row t. u0..u7: the block's 8 weight
 * vectors in the order of the activation's 4-byte groups; bias: -8 (Q4_0) or -128 (Q8_0) times
 * the activation sum. */
/* the block's 4 activation rows in W-bit registers, into a00/a01 .. a30/a31 */
#define VNNI_ROWS4(W, DPB, bias)                                                                                   \
    VNNI_BLOCK(W, DPB, x + b, VNNI_UREG, VNNI_SAME, bias, dw, a00, a01);                                           \
    VNNI_BLOCK(W, DPB, x + xs + b, VNNI_UREG, VNNI_SAME, bias, dw, a10, a11);                                      \
    VNNI_BLOCK(W, DPB, x + 2 * xs + b, VNNI_UREG, VNNI_SAME, bias, dw, a20, a21);                                  \
    VNNI_BLOCK(W, DPB, x + 3 * xs + b, VNNI_UREG, VNNI_SAME, bias, dw, a30, a31)

/* after the last block: the sums of each row's even and odd blocks */
#define VNNI_X4_STORE()                                                                                            \
    _mm256_storeu_ps(out, _mm256_add_ps(a00, a01)), _mm256_storeu_ps(out + 8, _mm256_add_ps(a10, a11)),             \
        _mm256_storeu_ps(out + 16, _mm256_add_ps(a20, a21)), _mm256_storeu_ps(out + 24, _mm256_add_ps(a30, a31))

/* a 4-bit x8 block's 8 chunks u0..u7 in the order of the activation's 4-byte groups: chunk c in
 * the low nibbles of the block's 32-byte row c, chunk c + 4 in its high ones, each decoded by
 * DEC (masked: Q4_0; looked up: MXFP4) */
#define VNNI_X4_NIBBLE_CHUNKS(DEC)                                                                                 \
    const __m256i v0 = _mm256_loadu_si256((const __m256i *)(o[b].qs)), v1 = _mm256_loadu_si256((const __m256i *)(o[b].qs + 32)); \
    const __m256i v2 = _mm256_loadu_si256((const __m256i *)(o[b].qs + 64)), v3 = _mm256_loadu_si256((const __m256i *)(o[b].qs + 96)); \
    const __m256i u0 = DEC(v0), u4 = DEC(_mm256_srli_epi16(v0, 4)), u1 = DEC(v1), u5 = DEC(_mm256_srli_epi16(v1, 4)); \
    const __m256i u2 = DEC(v2), u6 = DEC(_mm256_srli_epi16(v2, 4)), u3 = DEC(v3), u7 = DEC(_mm256_srli_epi16(v3, 4))

/* the three 4-row kernels for a level: target TGT, dpbusd form DPB */
#define X4_Q4_0_DEC(v) _mm256_and_si256(v, m4)

#define X4_MXFP4_DEC(v) _mm256_shuffle_epi8(lut, _mm256_and_si256(v, m4))

#define X4_Q8_CHUNK(c) _mm256_loadu_si256((const __m256i *)(o[b].qs + 32 * (c)))

#define VNNI_X4_KERNELS(name, TGT, DPB)                                                                            \
    MOE_TARGET(TGT) static void dotq8x4_q4_0_##name(const void *w, const moe__block_q8a *x, int64_t xs, int64_t n, float *out) { \
        const moe__block_q4_0x8 *o = w;                                                                            \
        const __m256i m4 = _mm256_set1_epi8(15);                                                                   \
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00; \
        for (int64_t b = 0; b < n / 32; b++) {                                                                     \
            prefetch_ahead(o + b, sizeof *o);                                                                      \
            VNNI_X4_NIBBLE_CHUNKS(X4_Q4_0_DEC);                                                                    \
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)o[b].d));                           \
            VNNI_ROWS4(256, DPB, -8);                                                                              \
        }                                                                                                          \
        VNNI_X4_STORE();                                                                                           \
    }                                                                                                              \
    MOE_TARGET(TGT) static void dotq8x4_q8_0_##name(const void *w, const moe__block_q8a *x, int64_t xs, int64_t n, float *out) { \
        const moe__block_q8_0x8 *o = w;                                                                            \
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00; \
        for (int64_t b = 0; b < n / 32; b++) {                                                                     \
            prefetch_ahead(o + b, sizeof *o);                                                                      \
            const __m256i u0 = X4_Q8_CHUNK(0), u1 = X4_Q8_CHUNK(1), u2 = X4_Q8_CHUNK(2), u3 = X4_Q8_CHUNK(3);     \
            const __m256i u4 = X4_Q8_CHUNK(4), u5 = X4_Q8_CHUNK(5), u6 = X4_Q8_CHUNK(6), u7 = X4_Q8_CHUNK(7);     \
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)o[b].d));                           \
            VNNI_ROWS4(256, DPB, -128);                                                                            \
        }                                                                                                          \
        VNNI_X4_STORE();                                                                                           \
    }                                                                                                              \
    MOE_TARGET(TGT) static void dotq8x4_mxfp4_##name(const void *w, const moe__block_q8a *x, int64_t xs, int64_t n, float *out) { \
        const moe__block_mxfp4x8 *o = w;                                                                           \
        const __m256i m4 = _mm256_set1_epi8(15), lut = mxfp4x8_lut_avx2();                                         \
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00; \
        for (int64_t b = 0; b < n / 32; b++) {                                                                     \
            prefetch_ahead(o + b, sizeof *o);                                                                      \
            VNNI_X4_NIBBLE_CHUNKS(X4_MXFP4_DEC);                                                                   \
            const __m256 dw = mxfp4x8_scales_avx2(o[b].e);                                                         \
            VNNI_ROWS4(256, DPB, -12);                                                                             \
        }                                                                                                          \
        VNNI_X4_STORE();                                                                                           \
    }

/* 32 bytes at p (group A) and q (group B) as one register */
#define PAIR256(p, q) _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p))), _mm256_loadu_si256((const __m256i *)(q)), 1)

/* the two groups' 8 fp16 values at pa and pb (their scales) as 16 floats */
#define PAIR_F16(pa, pb) _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)(pa))), \
                                                                 _mm_loadu_si128((const __m128i *)(const void *)(pb)), 1))

/* Float kernels written once for both x86 vector widths, W = 256 (AVX2: 8 floats) or 512
 * (AVX-512: 16): VEC(W) is the float vector type, VOP(W, op) the intrinsic _mm<W>_<op>, and a
 * *_KERNEL macro makes the function of one width (AVX2's here, AVX-512's in its section). */
#define VEC(W) __m##W

#define VOP(W, op) _mm##W##_##op

#define LANES(W) ((W) / 32)

#define AXPY_KERNEL(name, target, W)                                                                         \
    MOE_TARGET(target) static void name(float *y, float a, const float *x, int64_t n) {                      \
        const VEC(W) va = VOP(W, set1_ps)(a);                                                                \
        int64_t i = 0;                                                                                       \
        for (; i + LANES(W) <= n; i += LANES(W))                                                             \
            VOP(W, storeu_ps)(y + i, VOP(W, fmadd_ps)(va, VOP(W, loadu_ps)(x + i), VOP(W, loadu_ps)(y + i))); \
        for (; i < n; i++) y[i] += a * x[i];                                                                 \
    }

/* moe__dwconv_ref: each lane's taps in order, the first a product, the rest fused multiply-adds */
#define DWCONV_KERNEL(name, target, W)                                                                                     \
    MOE_TARGET(target) static void name(float *y, const float *const *rows, const float *w, int64_t ldw, int taps, int64_t n) { \
        int64_t i = 0;                                                                                                     \
        for (; i + LANES(W) <= n; i += LANES(W)) {                                                                         \
            VEC(W) acc = VOP(W, mul_ps)(VOP(W, loadu_ps)(w + i), VOP(W, loadu_ps)(rows[0] + i));                           \
            for (int j = 1; j < taps; j++)                                                                                 \
                acc = VOP(W, fmadd_ps)(VOP(W, loadu_ps)(w + j * ldw + i), VOP(W, loadu_ps)(rows[j] + i), acc);             \
            VOP(W, storeu_ps)(y + i, acc);                                                                                 \
        }                                                                                                                  \
        dwconv_tail(y, rows, w, ldw, taps, i, n);                                                                          \
    }

/* log1p(u) for u in [0, 1]: 2 s (1 + t/3 + t^2/5 + ... + t^7/15), s = u / (2 + u), t = s^2 <= 1/9 */
#define LOG1P01_KERNEL(name, target, W)                                                                   \
    MOE_TARGET(target) static inline VEC(W) name(VEC(W) u) {                                              \
        const VEC(W) sv = VOP(W, div_ps)(u, VOP(W, add_ps)(u, VOP(W, set1_ps)(2.0f))), t = VOP(W, mul_ps)(sv, sv); \
        VEC(W) p = VOP(W, fmadd_ps)(VOP(W, set1_ps)(1.0f / 15), t, VOP(W, set1_ps)(1.0f / 13));          \
        p = VOP(W, fmadd_ps)(p, t, VOP(W, set1_ps)(1.0f / 11));                                            \
        p = VOP(W, fmadd_ps)(p, t, VOP(W, set1_ps)(1.0f / 9));                                             \
        p = VOP(W, fmadd_ps)(p, t, VOP(W, set1_ps)(1.0f / 7));                                             \
        p = VOP(W, fmadd_ps)(p, t, VOP(W, set1_ps)(1.0f / 5));                                             \
        p = VOP(W, fmadd_ps)(p, t, VOP(W, set1_ps)(1.0f / 3));                                             \
        p = VOP(W, fmadd_ps)(p, t, VOP(W, set1_ps)(1.0f));                                                 \
        return VOP(W, mul_ps)(VOP(W, add_ps)(sv, sv), p);                                                  \
    }

/* y = e^(x - shift) and its sum; the tail (n % LANES) through `tail` */
#define EXP_SUM_KERNEL(name, target, W, exp, hsum, tail)                                 \
    MOE_TARGET(target) static float name(float *y, const float *x, float shift, int64_t n) { \
        const VEC(W) sh = VOP(W, set1_ps)(shift);                                        \
        VEC(W) acc = VOP(W, setzero_ps)();                                               \
        int64_t i = 0;                                                                   \
        for (; i + LANES(W) <= n; i += LANES(W)) {                                       \
            const VEC(W) e = exp(VOP(W, sub_ps)(VOP(W, loadu_ps)(x + i), sh));           \
            VOP(W, storeu_ps)(y + i, e);                                                 \
            acc = VOP(W, add_ps)(acc, e);                                                \
        }                                                                                \
        return hsum(acc) + tail(y + i, x + i, shift, n - i);                             \
    }

/* bf16 -> f32 (exact); the tail through `tail` */
#define WIDEN_BF16_KERNEL(name, target, W, load_bf16, tail)                                         \
    MOE_TARGET(target) static void name(float *y, const uint16_t *x, int64_t n) {                   \
        int64_t i = 0;                                                                              \
        for (; i + LANES(W) <= n; i += LANES(W)) VOP(W, storeu_ps)(y + i, load_bf16(x + i));        \
        tail(y + i, x + i, n - i);                                                                  \
    }

/* The recurrence with the state rows in registers' reach: two passes over S per token (decay +
 * prediction, then update + output), D/LANES vectors per row. Other D go to `fallback`. */
#define KDA_RECURRENT_KERNEL(name, target, W, fallback, exp_sum)                                                         \
    MOE_TARGET(target) static void name(const moe__kda_head *a) {                                                        \
        const int D = a->D;                                                                                              \
        if (D % LANES(W) || D > 512) { fallback(a); return; }                                                            \
        float *S = a->S;                                                                                                 \
        __attribute__((aligned(W / 8))) float pred[512], u[512], o[512], decay[512];                                     \
        for (int t = 0; t < a->n; t++) {                                                                                 \
            const float *q = a->q + (size_t)t * a->stride, *k = a->k + (size_t)t * a->stride;                            \
            const float *v = a->v + (size_t)t * a->stride, *g = a->g + (size_t)t * a->stride;                            \
            const float beta = a->beta[(size_t)t * a->beta_stride];                                                      \
            for (int j = 0; j < D; j += LANES(W)) VOP(W, store_ps)(pred + j, VOP(W, setzero_ps)());                      \
            exp_sum(decay, g, 0.0f, D);                                                                                  \
            for (int i = 0; i < D; i++) {                                                                                \
                const VEC(W) dec = VOP(W, set1_ps)(decay[i]), ki = VOP(W, set1_ps)(k[i]);                                \
                float *row = S + (size_t)i * D;                                                                          \
                for (int j = 0; j < D; j += LANES(W)) {                                                                  \
                    VEC(W) r = VOP(W, mul_ps)(VOP(W, loadu_ps)(row + j), dec);                                           \
                    VOP(W, storeu_ps)(row + j, r);                                                                       \
                    VOP(W, store_ps)(pred + j, VOP(W, fmadd_ps)(r, ki, VOP(W, load_ps)(pred + j)));                      \
                }                                                                                                        \
            }                                                                                                            \
            const VEC(W) vb = VOP(W, set1_ps)(beta);                                                                     \
            for (int j = 0; j < D; j += LANES(W)) {                                                                      \
                VOP(W, store_ps)(u + j, VOP(W, mul_ps)(vb, VOP(W, sub_ps)(VOP(W, loadu_ps)(v + j), VOP(W, load_ps)(pred + j)))); \
                VOP(W, store_ps)(o + j, VOP(W, setzero_ps)());                                                           \
            }                                                                                                            \
            for (int i = 0; i < D; i++) {                                                                                \
                const VEC(W) ki = VOP(W, set1_ps)(k[i]), qi = VOP(W, set1_ps)(q[i]);                                     \
                float *row = S + (size_t)i * D;                                                                          \
                for (int j = 0; j < D; j += LANES(W)) {                                                                  \
                    VEC(W) r = VOP(W, fmadd_ps)(ki, VOP(W, load_ps)(u + j), VOP(W, loadu_ps)(row + j));                  \
                    VOP(W, storeu_ps)(row + j, r);                                                                       \
                    VOP(W, store_ps)(o + j, VOP(W, fmadd_ps)(r, qi, VOP(W, load_ps)(o + j)));                            \
                }                                                                                                        \
            }                                                                                                            \
            memcpy(a->o + (size_t)t * a->stride, o, sizeof(float) * (size_t)D);                                          \
        }                                                                                                                \
    }

#define MOE_AVX512 "avx2,fma,f16c,avx512f,avx512bw,avx512vl"

/* Row-at-a-time integer dots with VNNI (dpbusd: unsigned x signed bytes, 4 products per int32
 * lane). Q8_0 weights are made unsigned by w + 128 (xor 0x80); the surplus 128 sum(x) is taken
 * back with the activation block sum. Q4_0 nibbles are unsigned already: q - 8 likewise. The two
 * for a level: target TGT, dpbusd intrinsic DPBUSD (EVEX, or VEX for AVX-VNNI). */
#define DOTQ_VNNI_KERNELS(name, TGT, DPBUSD)                                                                                  \
    MOE_TARGET(TGT) static float dotq_q8_0_##name(const void *w, const moe__block_q8a *x, int64_t n) {                        \
        const moe__block_q8_0 *b = w;                                                                                         \
        const __m256i flip = _mm256_set1_epi8((char)0x80);                                                                    \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                                                        \
        float corr = 0;                                                                                                       \
        int64_t i = 0, nb = n / 32;                                                                                           \
        for (; i + 2 <= nb; i += 2) {                                                                                         \
            __m256i a0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)b[i].qs), flip);                                \
            __m256i a1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)b[i + 1].qs), flip);                            \
            __m256i p0 = DPBUSD(_mm256_setzero_si256(), a0, _mm256_loadu_si256((const __m256i *)x[i].qs));                    \
            __m256i p1 = DPBUSD(_mm256_setzero_si256(), a1, _mm256_loadu_si256((const __m256i *)x[i + 1].qs));                \
            const float d0 = f16_avx(b[i].d) * x[i].d, d1 = f16_avx(b[i + 1].d) * x[i + 1].d;                                 \
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d0), _mm256_cvtepi32_ps(p0), acc0);                                         \
            acc1 = _mm256_fmadd_ps(_mm256_set1_ps(d1), _mm256_cvtepi32_ps(p1), acc1);                                         \
            corr += d0 * (float)x[i].sum + d1 * (float)x[i + 1].sum;                                                          \
        }                                                                                                                     \
        for (; i < nb; i++) {                                                                                                 \
            __m256i a0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)b[i].qs), flip);                                \
            __m256i p0 = DPBUSD(_mm256_setzero_si256(), a0, _mm256_loadu_si256((const __m256i *)x[i].qs));                    \
            const float d0 = f16_avx(b[i].d) * x[i].d;                                                                        \
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d0), _mm256_cvtepi32_ps(p0), acc0);                                         \
            corr += d0 * (float)x[i].sum;                                                                                     \
        }                                                                                                                     \
        return hsum_avx2(_mm256_add_ps(acc0, acc1)) - 128.0f * corr;                                                          \
    }                                                                                                                         \
    MOE_TARGET(TGT) static float dotq_q4_0_##name(const void *w, const moe__block_q8a *x, int64_t n) {                        \
        const moe__block_q4_0 *b = w;                                                                                         \
        const __m256i m4 = _mm256_set1_epi8(15);                                                                              \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                                                        \
        float corr = 0;                                                                                                       \
        int64_t i = 0, nb = n / 32;                                                                                           \
        for (; i + 2 <= nb; i += 2) {                                                                                         \
            __m128i r0 = _mm_loadu_si128((const __m128i *)b[i].qs), r1 = _mm_loadu_si128((const __m128i *)b[i + 1].qs);       \
            __m256i q0 = _mm256_and_si256(_mm256_insertf128_si256(_mm256_castsi128_si256(r0), _mm_srli_epi16(r0, 4), 1), m4); \
            __m256i q1 = _mm256_and_si256(_mm256_insertf128_si256(_mm256_castsi128_si256(r1), _mm_srli_epi16(r1, 4), 1), m4); \
            __m256i p0 = DPBUSD(_mm256_setzero_si256(), q0, _mm256_loadu_si256((const __m256i *)x[i].qs));                    \
            __m256i p1 = DPBUSD(_mm256_setzero_si256(), q1, _mm256_loadu_si256((const __m256i *)x[i + 1].qs));                \
            const float d0 = f16_avx(b[i].d) * x[i].d, d1 = f16_avx(b[i + 1].d) * x[i + 1].d;                                 \
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d0), _mm256_cvtepi32_ps(p0), acc0);                                         \
            acc1 = _mm256_fmadd_ps(_mm256_set1_ps(d1), _mm256_cvtepi32_ps(p1), acc1);                                         \
            corr += d0 * (float)x[i].sum + d1 * (float)x[i + 1].sum;                                                          \
        }                                                                                                                     \
        for (; i < nb; i++) {                                                                                                 \
            __m128i r0 = _mm_loadu_si128((const __m128i *)b[i].qs);                                                           \
            __m256i q0 = _mm256_and_si256(_mm256_insertf128_si256(_mm256_castsi128_si256(r0), _mm_srli_epi16(r0, 4), 1), m4); \
            __m256i p0 = DPBUSD(_mm256_setzero_si256(), q0, _mm256_loadu_si256((const __m256i *)x[i].qs));                    \
            const float d0 = f16_avx(b[i].d) * x[i].d;                                                                        \
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d0), _mm256_cvtepi32_ps(p0), acc0);                                         \
            corr += d0 * (float)x[i].sum;                                                                                     \
        }                                                                                                                     \
        return hsum_avx2(_mm256_add_ps(acc0, acc1)) - 8.0f * corr;                                                            \
    }

/* the scores of key j for heads h0 .. H-1: 4 heads at a time share each load of c_j */
/* scores of key j for heads h0.. : 4 heads at a time, then one (the tails of the kernels below) */
#define MLA_SCORES1_KERNEL(name, target, W, hsum)                                                                          \
    MOE_TARGET(target) static void name(const moe__mla_block *b, int j, int h0) {                                          \
        const int r = b->r, dr = b->dr;                                                                                    \
        const size_t qs = (size_t)b->qr_stride;                                                                            \
        const float *c = b->cache + (size_t)j * b->cw;                                                                     \
        int h = h0;                                                                                                        \
        for (; h + 4 <= b->H; h += 4) {                                                                                    \
            const float *a0 = b->qa + (size_t)h * r, *a1 = a0 + r, *a2 = a1 + r, *a3 = a2 + r;                             \
            const float *q0 = b->qr + (size_t)h * qs, *q1 = q0 + qs, *q2 = q1 + qs, *q3 = q2 + qs;                         \
            VEC(W) s0 = VOP(W, setzero_ps)(), s1 = s0, s2 = s0, s3 = s0;                                                   \
            for (int i = 0; i < r; i += LANES(W)) {                                                                        \
                VEC(W) cv = VOP(W, loadu_ps)(c + i);                                                                       \
                s0 = VOP(W, fmadd_ps)(VOP(W, loadu_ps)(a0 + i), cv, s0), s1 = VOP(W, fmadd_ps)(VOP(W, loadu_ps)(a1 + i), cv, s1); \
                s2 = VOP(W, fmadd_ps)(VOP(W, loadu_ps)(a2 + i), cv, s2), s3 = VOP(W, fmadd_ps)(VOP(W, loadu_ps)(a3 + i), cv, s3); \
            }                                                                                                              \
            for (int i = 0; i < dr; i += LANES(W)) {                                                                       \
                VEC(W) cv = VOP(W, loadu_ps)(c + r + i);                                                                   \
                s0 = VOP(W, fmadd_ps)(VOP(W, loadu_ps)(q0 + i), cv, s0), s1 = VOP(W, fmadd_ps)(VOP(W, loadu_ps)(q1 + i), cv, s1); \
                s2 = VOP(W, fmadd_ps)(VOP(W, loadu_ps)(q2 + i), cv, s2), s3 = VOP(W, fmadd_ps)(VOP(W, loadu_ps)(q3 + i), cv, s3); \
            }                                                                                                              \
            b->sc[(size_t)h * b->ld + j] = hsum(s0) * b->scale;                                                            \
            b->sc[(size_t)(h + 1) * b->ld + j] = hsum(s1) * b->scale;                                                      \
            b->sc[(size_t)(h + 2) * b->ld + j] = hsum(s2) * b->scale;                                                      \
            b->sc[(size_t)(h + 3) * b->ld + j] = hsum(s3) * b->scale;                                                      \
        }                                                                                                                  \
        for (; h < b->H; h++) {                                                                                            \
            VEC(W) s0 = VOP(W, setzero_ps)();                                                                              \
            for (int i = 0; i < r; i += LANES(W)) s0 = VOP(W, fmadd_ps)(VOP(W, loadu_ps)(b->qa + (size_t)h * r + i), VOP(W, loadu_ps)(c + i), s0); \
            for (int i = 0; i < dr; i += LANES(W)) s0 = VOP(W, fmadd_ps)(VOP(W, loadu_ps)(b->qr + (size_t)h * qs + i), VOP(W, loadu_ps)(c + r + i), s0); \
            b->sc[(size_t)h * b->ld + j] = hsum(s0) * b->scale;                                                            \
        }                                                                                                                  \
    }

/* dpbusd through asm: around the intrinsic gcc 12 copies every accumulator on each pass of the
 * loop (a register-allocation quirk: the int8 scores kernel ran 16% slower) */
#define MOE_AVX512VNNI MOE_AVX512 ",avx512vnni"

/* 8 keys at a time, each head group's two halves of 8 heads through the level's PART (the latent
 * part, then kr's), the scores formed as the reference forms them; the last keys by the reference */
#define MLA_SCORES8_256(name, TGT, PART)                                                                            \
    MOE_TARGET(TGT) static void name(const moe__mla_block8 *b) {                                                    \
        const int r = b->r, cw = b->cw, ng = (b->H + 15) / 16, nq = cw / 4;                                         \
        if (cw % 4 || r % 4) { moe__mla_scores8_ref(b); return; }                                                   \
        int j = b->j0;                                                                                              \
        for (; j + 8 <= b->j1; j += 8) {                                                                            \
            const int8_t *c = b->cache + (size_t)j * cw;                                                            \
            const moe__kv8_meta *mt = b->meta + j;                                                                  \
            const int32_t oc[8] = {mt[0].sc, mt[1].sc, mt[2].sc, mt[3].sc, mt[4].sc, mt[5].sc, mt[6].sc, mt[7].sc}; \
            const int32_t orp[8] = {mt[0].sr, mt[1].sr, mt[2].sr, mt[3].sr, mt[4].sr, mt[5].sr, mt[6].sr, mt[7].sr}; \
            for (int g = 0; g < ng; g++)                                                                            \
                for (int half = 0; half < 2 && g * 16 + half * 8 < b->H; half++) {                                  \
                    const int8_t *qt = b->qt + (size_t)g * nq * 64 + half * 32;                                     \
                    int32_t dc[8][8], dr[8][8]; /* [key][head] */                                                   \
                    PART(b, c, qt, 0, r, oc, dc);                                                                   \
                    PART(b, c, qt, r, cw, orp, dr);                                                                 \
                    for (int l = 0; l < 8 && g * 16 + half * 8 + l < b->H; l++) {                                   \
                        const int h = g * 16 + half * 8 + l;                                                        \
                        for (int n = 0; n < 8; n++) b->sc[(size_t)h * b->ld + j + n] = score8(b, h, dc[n][l], dr[n][l], mt + n); \
                    }                                                                                               \
                }                                                                                                   \
        }                                                                                                           \
        if (j < b->j1) { /* the last keys: the reference */                                                         \
            moe__mla_block8 t = *b;                                                                                 \
            t.j0 = j;                                                                                               \
            moe__mla_scores8_ref(&t);                                                                               \
        }                                                                                                           \
    }

#endif /* MOE_X86 */

/* =================================================================================================
 * PART 4: AVX2
 * =================================================================================================
 * The avx2 level (AVX2, FMA and F16C: every x86-64 CPU since Haswell and Zen 1): float dots and
 * tiles on 8 lanes, int8 products by VPMADDUBSW/VPMADDWD, every block format's row and x8 kernels,
 * the elementwise functions, KDA's recurrence, and MLA attention over every latent cache type. */

#ifdef MOE_X86

MOE_TARGET("avx2,fma") static inline float hsum_avx2(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* a[0] + ... + a[7] lane by lane, in the order hsum_avx2 adds a vector's 8 lanes: the interleaved
 * kernels keep one accumulator per sub-block where the row kernels keep a lane, so each row's sum
 * comes out as the row kernel's */
MOE_TARGET("avx2,fma") static inline __m256 sum8_hsum_order_avx2(const __m256 *a) {
    const __m256 w0 = _mm256_add_ps(_mm256_add_ps(a[0], a[4]), _mm256_add_ps(a[2], a[6]));
    const __m256 w1 = _mm256_add_ps(_mm256_add_ps(a[1], a[5]), _mm256_add_ps(a[3], a[7]));
    return _mm256_add_ps(w0, w1);
}

/* four vectors of pairwise sums h[k] = hadd(p[2k], p[2k + 1]) of 8 vectors p -> one vector of
 * the 8 vectors' lane sums, in p's order */
MOE_TARGET("avx2,fma") static inline __m256i sum_pairs8_avx2(const __m256i *h) {
    const __m256i s0 = _mm256_hadd_epi32(h[0], h[1]), s1 = _mm256_hadd_epi32(h[2], h[3]);
    return _mm256_add_epi32(_mm256_permute2x128_si256(s0, s1, 0x20), _mm256_permute2x128_si256(s0, s1, 0x31));
}

MOE_TARGET("avx2,fma") static float dot_f32_avx2(const void *w, const uint8_t *sc,
                                                 const float *x, int64_t n) {
    (void)sc;
    const float *p = w;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        prefetch_ahead(p + i, 64);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(p + i), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(p + i + 8), _mm256_loadu_ps(x + i + 8), a1);
    }
    for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(p + i), _mm256_loadu_ps(x + i), a0);
    float s = hsum_avx2(_mm256_add_ps(a0, a1));
    for (; i < n; i++) s += p[i] * x[i];
    return s;
}

MOE_TARGET("avx2,fma") static inline __m256 load_bf16_avx2(const uint16_t *p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

MOE_TARGET("avx2,fma") static float dot_bf16_avx2(const void *w, const uint8_t *sc,
                                                  const float *x, int64_t n) {
    (void)sc;
    const uint16_t *p = w;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        a0 = _mm256_fmadd_ps(load_bf16_avx2(p + i), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(load_bf16_avx2(p + i + 8), _mm256_loadu_ps(x + i + 8), a1);
    }
    for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(load_bf16_avx2(p + i), _mm256_loadu_ps(x + i), a0);
    float s = hsum_avx2(_mm256_add_ps(a0, a1));
    for (; i < n; i++) s += moe__bf16_to_f32(p[i]) * x[i];
    return s;
}

/* matrix tiles for prefill, 4 weight rows x 2 activation rows in 8 accumulators (the AVX2
 * kernel of GEMM_AVX512 below: same scheme, 8 lanes; a partial step at the end of a row through
 * zero-padded copies) */
#define GEMM_AVX2(NAME, WT, LW)                                                                                  \
    MOE_TARGET("avx2,fma") static void NAME(const void *wv, int64_t ldw, int nr, const float *x, int64_t ldx, int nt, int64_t K, float *y, int64_t ldy) { \
        const WT *w = wv;                                                                                        \
        const int64_t full = K / 8 * 8;                                                                          \
        for (int tb = 0; tb < nt; tb += gemm_token_block(K))                                                    \
        for (int i = 0; i < nr; i += 4) {                                                                        \
            const int ri = nr - i < 4 ? nr - i : 4, te = nt - tb < gemm_token_block(K) ? nt : tb + gemm_token_block(K); \
            const WT *w0 = w + (int64_t)i * ldw, *w1 = w0 + (ri > 1 ? ldw : 0), *w2 = w0 + (ri > 2 ? 2 * ldw : 0), *w3 = w0 + (ri > 3 ? 3 * ldw : 0); \
            for (int t = tb; t < te; t += 2) {                                                                   \
                const float *x0 = x + (int64_t)t * ldx, *x1 = x0 + (te - t > 1 ? ldx : 0);                       \
                __m256 t00 = _mm256_setzero_ps(), t01 = t00, t10 = t00, t11 = t00, t20 = t00, t21 = t00, t30 = t00, t31 = t00; \
                for (int64_t k = 0; k < full; k += 8) {                                                          \
                    const __m256 v0 = _mm256_loadu_ps(x0 + k), v1 = _mm256_loadu_ps(x1 + k);                    \
                    __m256 a = LW(w0 + k);                                                                       \
                    t00 = _mm256_fmadd_ps(a, v0, t00), t01 = _mm256_fmadd_ps(a, v1, t01);                         \
                    a = LW(w1 + k), t10 = _mm256_fmadd_ps(a, v0, t10), t11 = _mm256_fmadd_ps(a, v1, t11);         \
                    a = LW(w2 + k), t20 = _mm256_fmadd_ps(a, v0, t20), t21 = _mm256_fmadd_ps(a, v1, t21);         \
                    a = LW(w3 + k), t30 = _mm256_fmadd_ps(a, v0, t30), t31 = _mm256_fmadd_ps(a, v1, t31);         \
                }                                                                                                \
                if (full < K) {                                                                                  \
                    const int n = (int)(K - full);                                                               \
                    WT wp[4][8] = {{0}};                                                                         \
                    float xp[2][8] = {{0}};                                                                      \
                    memcpy(wp[0], w0 + full, sizeof(WT) * (size_t)n), memcpy(wp[1], w1 + full, sizeof(WT) * (size_t)n); \
                    memcpy(wp[2], w2 + full, sizeof(WT) * (size_t)n), memcpy(wp[3], w3 + full, sizeof(WT) * (size_t)n); \
                    memcpy(xp[0], x0 + full, sizeof(float) * (size_t)n), memcpy(xp[1], x1 + full, sizeof(float) * (size_t)n); \
                    const __m256 v0 = _mm256_loadu_ps(xp[0]), v1 = _mm256_loadu_ps(xp[1]);                      \
                    __m256 a = LW(wp[0]);                                                                        \
                    t00 = _mm256_fmadd_ps(a, v0, t00), t01 = _mm256_fmadd_ps(a, v1, t01);                         \
                    a = LW(wp[1]), t10 = _mm256_fmadd_ps(a, v0, t10), t11 = _mm256_fmadd_ps(a, v1, t11);          \
                    a = LW(wp[2]), t20 = _mm256_fmadd_ps(a, v0, t20), t21 = _mm256_fmadd_ps(a, v1, t21);          \
                    a = LW(wp[3]), t30 = _mm256_fmadd_ps(a, v0, t30), t31 = _mm256_fmadd_ps(a, v1, t31);          \
                }                                                                                                \
                const float o0[4] = {hsum_avx2(t00), hsum_avx2(t10), hsum_avx2(t20), hsum_avx2(t30)};            \
                const float o1[4] = {hsum_avx2(t01), hsum_avx2(t11), hsum_avx2(t21), hsum_avx2(t31)};            \
                memcpy(y + (int64_t)t * ldy + i, o0, sizeof(float) * (size_t)ri);                                \
                if (te - t > 1) memcpy(y + (int64_t)(t + 1) * ldy + i, o1, sizeof(float) * (size_t)ri);          \
            }                                                                                                    \
        }                                                                                                        \
    }

#define LW_F32(p) _mm256_loadu_ps(p)

#define LW_BF16(p) load_bf16_avx2(p)

GEMM_AVX2(gemm_f32_avx2, float, LW_F32)
/* defines gemm_f32_avx2() */

GEMM_AVX2(gemm_bf16_avx2, uint16_t, LW_BF16)
/* defines gemm_bf16_avx2() */

#undef LW_F32

#undef LW_BF16

#undef GEMM_AVX2

MOE_TARGET("avx2,fma,f16c") static float dot_f16_avx2(const void *w, const uint8_t *sc,
                                                      const float *x, int64_t n) {
    (void)sc;
    const uint16_t *p = w;
    __m256 a0 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        a0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + i))),
                             _mm256_loadu_ps(x + i), a0);
    float s = hsum_avx2(a0);
    for (; i < n; i++) s += moe__f16_to_f32(p[i]) * x[i];
    return s;
}

/* MXFP4: 2*E2M1 is an exact int8 (0,1,2,3,4,6,8,12 with sign), so one byte shuffle decodes 16
 * codes: 16 packed bytes -> the values of their low nibbles (*lo) and high nibbles (*hi) */
MOE_TARGET("avx2,fma") static inline void mxfp4_decode16(__m128i raw, __m128i *lo, __m128i *hi) {
    const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12), m4 = _mm_set1_epi8(15);
    *lo = _mm_shuffle_epi8(lut, _mm_and_si128(raw, m4));
    *hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(raw, 4), m4));
}

/* the block sum is scaled by 2^(s-127)/2 afterwards. Low nibble = even column. */
MOE_TARGET("avx2,fma") static float dot_mxfp4_avx2(const void *w, const uint8_t *sc,
                                                   const float *x, int64_t n) {
    const uint8_t *p = w;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / 32; b++) {
        __m128i lo, hi;
        mxfp4_decode16(_mm_loadu_si128((const __m128i *)(p + b * 16)), &lo, &hi);
        __m128i v0 = _mm_unpacklo_epi8(lo, hi), v1 = _mm_unpackhi_epi8(lo, hi); /* column order */
        const float *xb = x + b * 32;
        __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v0)), _mm256_loadu_ps(xb));
        s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v0, 8))),
                            _mm256_loadu_ps(xb + 8), s);
        s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v1)), _mm256_loadu_ps(xb + 16), s);
        s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v1, 8))),
                            _mm256_loadu_ps(xb + 24), s);
        acc = _mm256_fmadd_ps(s, _mm256_set1_ps(0.5f * e8m0(sc[b])), acc);
    }
    return hsum_avx2(acc);
}

/* int8 x int8 -> 8 x int32 partial sums (maddubs needs one unsigned operand: |a| and sign(b,a)) */
MOE_TARGET("avx2,fma") static inline __m256 mul_i8_avx2(__m256i a, __m256i b) {
    __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

MOE_TARGET("avx2,fma,f16c") static inline float f16_avx(uint16_t h) {
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

MOE_TARGET("avx2,fma,f16c") static float dotq_q8_0_avx2(const void *w, const moe__block_q8a *x, int64_t n) {
    const moe__block_q8_0 *b = w;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / 32; i++) {
        __m256i a = _mm256_loadu_si256((const __m256i *)b[i].qs), v = _mm256_loadu_si256((const __m256i *)x[i].qs);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_avx(b[i].d) * x[i].d), mul_i8_avx2(a, v), acc);
    }
    return hsum_avx2(acc);
}

/* MXFP4 . q8a: 16 codes decoded by one byte shuffle (2 E2M1 as int8), then as Q8_0 */
MOE_TARGET("avx2,fma") static float dotq_mxfp4_avx2(const void *w, const uint8_t *sc, const moe__block_q8a *x, int64_t n) {
    const uint8_t *p = w;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / 32; b++) {
        __m128i lo, hi;
        mxfp4_decode16(_mm_loadu_si128((const __m128i *)(const void *)(p + b * 16)), &lo, &hi);
        const __m256i a = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi)); /* column order */
        acc = _mm256_fmadd_ps(_mm256_set1_ps(0.5f * e8m0(sc[b]) * x[b].d), mul_i8_avx2(a, _mm256_loadu_si256((const __m256i *)(const void *)x[b].qs)), acc);
    }
    return hsum_avx2(acc);
}

MOE_TARGET("avx2,fma") static float dotq_mxfp4g_avx2(const void *w, const moe__block_q8a *x, int64_t n) {
    const moe__block_mxfp4 *b = w;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / 32; i++) {
        __m128i lo, hi;
        mxfp4_decode16(_mm_loadu_si128((const __m128i *)(const void *)b[i].qs), &lo, &hi);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(0.5f * e8m0(b[i].e) * x[i].d), mul_i8_avx2(_mm256_set_m128i(hi, lo), _mm256_loadu_si256((const __m256i *)(const void *)x[i].qs)), acc);
    }
    return hsum_avx2(acc);
}

/* Q4_0: the nibbles q are unsigned, so maddubs takes them as they are; sum((q-8) x) is
 * sum(q x) - 8 sum(x), the second term precomputed per activation block. Two blocks a turn. */
MOE_TARGET("avx2,fma,f16c") static float dotq_q4_0_avx2(const void *w, const moe__block_q8a *x, int64_t n) {
    const moe__block_q4_0 *b = w;
    const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float corr = 0;
    int64_t i = 0, nb = n / 32;
    for (; i + 2 <= nb; i += 2) {
        __m128i r0 = _mm_loadu_si128((const __m128i *)b[i].qs), r1 = _mm_loadu_si128((const __m128i *)b[i + 1].qs);
        __m256i q0 = _mm256_and_si256(_mm256_insertf128_si256(_mm256_castsi128_si256(r0), _mm_srli_epi16(r0, 4), 1), m4);
        __m256i q1 = _mm256_and_si256(_mm256_insertf128_si256(_mm256_castsi128_si256(r1), _mm_srli_epi16(r1, 4), 1), m4);
        __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(q0, _mm256_loadu_si256((const __m256i *)x[i].qs)), ones);
        __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(q1, _mm256_loadu_si256((const __m256i *)x[i + 1].qs)), ones);
        const float d0 = f16_avx(b[i].d) * x[i].d, d1 = f16_avx(b[i + 1].d) * x[i + 1].d;
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d0), _mm256_cvtepi32_ps(p0), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(d1), _mm256_cvtepi32_ps(p1), acc1);
        corr += d0 * (float)x[i].sum + d1 * (float)x[i + 1].sum;
    }
    for (; i < nb; i++) {
        __m128i r0 = _mm_loadu_si128((const __m128i *)b[i].qs);
        __m256i q0 = _mm256_and_si256(_mm256_insertf128_si256(_mm256_castsi128_si256(r0), _mm_srli_epi16(r0, 4), 1), m4);
        __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(q0, _mm256_loadu_si256((const __m256i *)x[i].qs)), ones);
        const float d0 = f16_avx(b[i].d) * x[i].d;
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d0), _mm256_cvtepi32_ps(p0), acc0);
        corr += d0 * (float)x[i].sum;
    }
    return hsum_avx2(_mm256_add_ps(acc0, acc1)) - 8.0f * corr;
}

/* Q4_1 .. Q6_K: the values decoded to unsigned bytes (Q5_0 and Q6_K shift them by +16 / +32),
 * products by maddubs as Q4_0's. 32-value formats: a block a turn, the minimum (or the shift)
 * times sum(x) apart. */
MOE_TARGET("avx2,fma") static inline __m256i bits_to_bytes_avx2(uint32_t bits) { /* bit j -> 0xff in byte j */
    const __m256i pick = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), pick), bit), bit);
}

MOE_TARGET("avx2,fma") static inline __m256i nibbles32_avx2(const uint8_t *qs) { /* 16 bytes -> values 0..15, 16..31 */
    const __m128i r = _mm_loadu_si128((const __m128i *)(const void *)qs);
    return _mm256_and_si256(_mm256_insertf128_si256(_mm256_castsi128_si256(r), _mm_srli_epi16(r, 4), 1), _mm256_set1_epi8(15));
}

/* NT (1 or 4) activation rows x + t xs blocks -> out[t]: each block's values decoded once for
 * the NT rows, each row's float steps those of the 1-row form (so the 4-row form gives each row
 * bit for bit: prefill takes it) */
MOE_TARGET("avx2,fma,f16c") static inline __attribute__((always_inline)) void q4_1_q5_rows_avx2(int type, const void *w, const moe__block_q8a *x,
                                                                                                int64_t xs, int64_t n, float *out, const int NT) {
    const __m256i ones = _mm256_set1_epi16(1), b4 = _mm256_set1_epi8(16);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    float corr[4] = {0, 0, 0, 0};
    for (int64_t i = 0; i < n / 32; i++) {
        const q32_fields f = q32_block(type, w, i);
        __m256i q = nibbles32_avx2(f.qs);
        if (type != MOE_T_Q4_1) q = _mm256_or_si256(q, _mm256_and_si256(bits_to_bytes_avx2(f.qh), b4));
        if (type == MOE_T_Q5_0) q = _mm256_sub_epi8(q, b4);
        const float d = f16_avx(f.d), m = type == MOE_T_Q5_0 ? 0.0f : f16_avx(f.m);
        MOE_UNROLL4 for (int t = 0; t < NT; t++) {
            const moe__block_q8a *xt = x + t * xs + i;
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(const void *)xt->qs);
            const float dx = d * xt->d;
            if (type == MOE_T_Q5_0) { /* q - 16 signed (as Q8_0's): the lanes hold the true partial sums, so terms that cancel leave no rounding */
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dx), mul_i8_avx2(q, xv), acc[t]);
                continue;
            }
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), ones);
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dx), _mm256_cvtepi32_ps(p), acc[t]);
            corr[t] += m * xt->d * (float)xt->sum;
        }
    }
    MOE_UNROLL4 for (int t = 0; t < NT; t++) out[t] = hsum_avx2(acc[t]) + corr[t];
}

#define Q4_1_Q5_FORMS(name, T)                                                                                     \
    MOE_TARGET("avx2,fma,f16c") static float dotq_##name##_avx2(const void *w, const moe__block_q8a *x, int64_t n) { \
        float r;                                                                                                   \
        q4_1_q5_rows_avx2(T, w, x, 0, n, &r, 1);                                                                   \
        return r;                                                                                                  \
    }                                                                                                              \
    MOE_TARGET("avx2,fma,f16c") static void dotq4_##name##_avx2(const void *w, const moe__block_q8a *x, int64_t xs, int64_t n, float *out) { \
        q4_1_q5_rows_avx2(T, w, x, xs, n, out, 4);                                                                 \
    }

Q4_1_Q5_FORMS(q4_1, MOE_T_Q4_1)
/* defines dotq4_q4_1_avx2(), dotq_q4_1_avx2() */

Q4_1_Q5_FORMS(q5_0, MOE_T_Q5_0)
/* defines dotq4_q5_0_avx2(), dotq_q5_0_avx2() */

Q4_1_Q5_FORMS(q5_1, MOE_T_Q5_1)
/* defines dotq4_q5_1_avx2(), dotq_q5_1_avx2() */

#undef Q4_1_Q5_FORMS

/* the 8 activation blocks' scales and sums of a 256-value block: each block's first 8 bytes
 * (d, sum) loaded as one, then the pairs split into two vectors in block order */
MOE_TARGET("avx2,fma") static inline void q8a_heads8_avx2(const moe__block_q8a *x, __m256 *d, __m256 *sum) {
#define PAIRS(i, j) _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(const void *)&x[i]), _mm_loadl_epi64((const __m128i *)(const void *)&x[j]))
    const __m256 a = _mm256_castsi256_ps(_mm256_setr_m128i(PAIRS(0, 1), PAIRS(4, 5)));
    const __m256 b = _mm256_castsi256_ps(_mm256_setr_m128i(PAIRS(2, 3), PAIRS(6, 7)));
#undef PAIRS
    *d = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
    *sum = _mm256_cvtepi32_ps(_mm256_castps_si256(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1))));
}

#define DPB_AVX2(u, v) _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), ones)

K4_KERNEL(dotq_q4_k_avx2, dotq4_q4_k_avx2, "avx2,fma,f16c", 0, DPB_AVX2)
/* defines dotq4_q4_k_avx2(), dotq_q4_k_avx2(), dotq_q4_k_avx2_rows() */

K4_KERNEL(dotq_q5_k_avx2, dotq4_q5_k_avx2, "avx2,fma,f16c", 1, DPB_AVX2)
/* defines dotq4_q5_k_avx2(), dotq_q5_k_avx2(), dotq_q5_k_avx2_rows() */

#undef DPB_AVX2

/* AVX2's stand-in for dpbusd (the interleaved kernels' unsigned values times the broadcast
 * activation dword at p): maddubs + madd, for values whose pair products fit int16 unsaturated */
#define DPBA_AVX2(acc, u, p) ((acc) = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_set1_epi32(*(const int32_t *)(const void *)(p))), ones)))

/* the same summed in int16 lanes (SUMS16_AVX2 widens them to int32 once, after the sub-block's
 * chunks): exact where no lane can pass 32767, as in Q4_K's 8 chunks of values 0..15 (8 x 2 x 15 x
 * 128 = 30720) and Q2_K/Q3_K's 4 of 0..7; one instruction fewer per chunk than DPBA_AVX2.
 * SUMS32: the int32 sums of the other forms as they are. */
#define DPBA16_AVX2(acc, u, p) ((acc) = _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, _mm256_set1_epi32(*(const int32_t *)(const void *)(p)))))

#define SUMS16_AVX2(s) _mm256_madd_epi16(s, ones)

K4X8_KERNEL(dotq8_q4_k_avx2, "avx2,fma,f16c", DPBA16_AVX2, SUMS16_AVX2, moe__block_q4_kx8, 0, qs)
/* defines dotq8_q4_k_avx2() */

K4X8X4_KERNEL(dotq8x4_q4_k_avx2, "avx2,fma,f16c", DPBA16_AVX2, SUMS16_AVX2, moe__block_q4_kx8, 0, qs)
/* defines dotq8x4_q4_k_avx2() */

K4X8_KERNEL(dotq8_q5_k_avx2, "avx2,fma,f16c", DPBA_AVX2, SUMS32, moe__block_q5_kx8, 1, qh)
/* defines dotq8_q5_k_avx2() */

K4X8X4_KERNEL(dotq8x4_q5_k_avx2, "avx2,fma,f16c", DPBA_AVX2, SUMS32, moe__block_q5_kx8, 1, qh)
/* defines dotq8x4_q5_k_avx2() */

/* Q6_K: values q - 32 signed, products by maddubs with |q - 32| and the activations' signs moved
 * (as mul_i8_avx2), each 16's pair sums times its 8-bit scale (madd) into int32: per sub-block
 * sc0 acc0 + sc1 acc1 exactly, then x.d d times that in float. NT (1 or 4) activation rows
 * x + t xs blocks, each row's float steps the same whatever NT. */
MOE_TARGET("avx2,fma,f16c") static inline __attribute__((always_inline)) void q6_k_rows_avx2(const void *w, const moe__block_q8a *x, int64_t xs,
                                                                                               int64_t n, float *out, const int NT) {
    const moe__block_q6_k *b = w;
    const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30), b32 = _mm256_set1_epi8(32);
    const __m256i half = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < n / 256; i++) {
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)b[i].scales));
        __m256i h[4][4]; /* [token][pair of sub-blocks] */
        for (int hh = 0; hh < 2; hh++) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(const void *)(b[i].ql + 64 * hh));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(const void *)(b[i].ql + 64 * hh + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(const void *)(b[i].qh + 32 * hh));
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
            q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m30));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
            for (int k = 0; k < 4; k += 2) {
                const int s = 4 * hh + k;
                const __m256i v0 = _mm256_sub_epi8(q[k], b32), v1 = _mm256_sub_epi8(q[k + 1], b32);
                const __m256i a0 = _mm256_sign_epi8(v0, v0), a1 = _mm256_sign_epi8(v1, v1);
                /* [scale 2s as 8 words | scale 2s + 1 as 8 words]: dword s of sc16, then its halves */
                const __m256i c0 = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(sc16, _mm256_set1_epi32(s)), half);
                const __m256i c1 = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(sc16, _mm256_set1_epi32(s + 1)), half);
                MOE_UNROLL4 for (int t = 0; t < NT; t++) {
                    const moe__block_q8a *xt = x + t * xs + 8 * i;
                    const __m256i x0 = _mm256_loadu_si256((const __m256i *)(const void *)xt[s].qs);
                    const __m256i x1 = _mm256_loadu_si256((const __m256i *)(const void *)xt[s + 1].qs);
                    h[t][s / 2] = _mm256_hadd_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(x0, v0)), c0),
                                                    _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(x1, v1)), c1));
                }
            }
        }
        const float d = f16_avx(b[i].d);
        MOE_UNROLL4 for (int t = 0; t < NT; t++) {
            const __m256i S = sum_pairs8_avx2(h[t]);
            __m256 xd, xm;
            q8a_heads8_avx2(x + t * xs + 8 * i, &xd, &xm);
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(xd, _mm256_set1_ps(d)), _mm256_cvtepi32_ps(S), acc[t]);
        }
    }
    MOE_UNROLL4 for (int t = 0; t < NT; t++) out[t] = hsum_avx2(acc[t]);
}

MOE_TARGET("avx2,fma,f16c") static float dotq_q6_k_avx2(const void *w, const moe__block_q8a *x, int64_t n) {
    float r;
    q6_k_rows_avx2(w, x, 0, n, &r, 1);
    return r;
}

MOE_TARGET("avx2,fma,f16c") static void dotq4_q6_k_avx2(const void *w, const moe__block_q8a *x, int64_t xs, int64_t n, float *out) {
    q6_k_rows_avx2(w, x, xs, n, out, 4);
}

/* The grid formats' 256-value block i as 8 vectors of bytes, value = d sw[g] v sign (g the 16
 * within the block: sw[j] for the first 16 of sub-block j, sw[8 + j] for its second), as iq_sub
 * decodes them: IQ2/IQ3 as the grid's positive bytes in v and their signs as -1/+1 bytes in sg
 * (the dot takes the signs onto the activations); IQ1 as the signed values in v. Grid entries
 * are gathered by scalar loads; 7-bit sign indices by a table of byte masks, sign bytes by a
 * shuffle and a compare. Returns d. */
MOE_TARGET("avx2,fma,f16c") static inline __m256i iq_sign_bytes_avx2(uint32_t signs) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    const __m256i m = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)signs), spread), bit), bit);
    return _mm256_or_si256(m, _mm256_set1_epi8(1));
}

#define GRID4(t, a, b, c, d) _mm256_set_epi64x((long long)(t)[d], (long long)(t)[c], (long long)(t)[b], (long long)(t)[a])

#define GRID8(t, i0, i1, i2, i3, i4, i5, i6, i7) \
    _mm256_set_epi32((int)(t)[i7], (int)(t)[i6], (int)(t)[i5], (int)(t)[i4], (int)(t)[i3], (int)(t)[i2], (int)(t)[i1], (int)(t)[i0])

#define SIGNS7(a) _mm256_or_si256(GRID4(sign_masks7, (a) & 127, ((a) >> 7) & 127, ((a) >> 14) & 127, ((a) >> 21) & 127), _mm256_set1_epi8(1))

MOE_TARGET("avx2,fma,f16c") static inline __attribute__((always_inline)) float iq_block_avx2(const int type, const void *w, int64_t i, __m256i v[8],
                                                                                               __m256i sg[8], int16_t sw[16]) {
    switch (type) {
    case MOE_T_IQ2_XXS: {
        const moe__block_iq2_xxs *b = (const moe__block_iq2_xxs *)w + i;
        for (int j = 0; j < 8; j++) {
            const uint32_t x = b->qs[4 * j] | (uint32_t)b->qs[4 * j + 1] << 16, a = b->qs[4 * j + 2] | (uint32_t)b->qs[4 * j + 3] << 16;
            v[j] = GRID4(iq2xxs_grid, x & 255, (x >> 8) & 255, (x >> 16) & 255, x >> 24), sg[j] = SIGNS7(a);
            sw[j] = sw[8 + j] = (int16_t)(2 * (a >> 28) + 1);
        }
        return f16_avx(b->d) * 0.125f;
    }
    case MOE_T_IQ2_XS: {
        const moe__block_iq2_xs *b = (const moe__block_iq2_xs *)w + i;
        for (int j = 0; j < 8; j++) {
            const uint16_t *q = b->qs + 4 * j;
            v[j] = GRID4(iq2xs_grid, q[0] & 511, q[1] & 511, q[2] & 511, q[3] & 511);
            sg[j] = _mm256_or_si256(GRID4(sign_masks7, q[0] >> 9, q[1] >> 9, q[2] >> 9, q[3] >> 9), _mm256_set1_epi8(1));
            sw[j] = (int16_t)(2 * (b->scales[j] & 15) + 1), sw[8 + j] = (int16_t)(2 * (b->scales[j] >> 4) + 1);
        }
        return f16_avx(b->d) * 0.125f;
    }
    case MOE_T_IQ2_S: {
        const moe__block_iq2_s *b = (const moe__block_iq2_s *)w + i;
        for (int j = 0; j < 8; j++) {
            const uint8_t *q = b->qs + 4 * j;
            const unsigned h = b->qh[j];
            v[j] = GRID4(iq2s_grid, q[0] | (h << 8 & 0x300), q[1] | (h << 6 & 0x300), q[2] | (h << 4 & 0x300), q[3] | (h << 2 & 0x300));
            sg[j] = iq_sign_bytes_avx2(le32_of(b->qs + 32 + 4 * j));
            sw[j] = (int16_t)(2 * (b->scales[j] & 15) + 1), sw[8 + j] = (int16_t)(2 * (b->scales[j] >> 4) + 1);
        }
        return f16_avx(b->d) * 0.125f;
    }
    case MOE_T_IQ3_XXS: {
        const moe__block_iq3_xxs *b = (const moe__block_iq3_xxs *)w + i;
        for (int j = 0; j < 8; j++) {
            const uint8_t *q = b->qs + 8 * j;
            const uint32_t a = le32_of(b->qs + 64 + 4 * j);
            v[j] = GRID8(iq3xxs_grid, q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7]), sg[j] = SIGNS7(a);
            sw[j] = sw[8 + j] = (int16_t)(2 * (a >> 28) + 1);
        }
        return f16_avx(b->d) * 0.25f;
    }
    case MOE_T_IQ3_S: {
        const moe__block_iq3_s *b = (const moe__block_iq3_s *)w + i;
        for (int j = 0; j < 8; j++) {
            const uint8_t *q = b->qs + 8 * j;
            const unsigned h = b->qh[j];
            v[j] = GRID8(iq3s_grid, q[0] | (h << 8 & 256), q[1] | (h << 7 & 256), q[2] | (h << 6 & 256), q[3] | (h << 5 & 256), q[4] | (h << 4 & 256),
                         q[5] | (h << 3 & 256), q[6] | (h << 2 & 256), q[7] | (h << 1 & 256));
            sg[j] = iq_sign_bytes_avx2(le32_of(b->signs + 4 * j));
            sw[j] = sw[8 + j] = (int16_t)(2 * ((b->scales[j / 2] >> (4 * (j % 2))) & 15) + 1);
        }
        return f16_avx(b->d);
    }
    case MOE_T_IQ1_S: case MOE_T_IQ1_M: {
        const int m1 = type == MOE_T_IQ1_M;
        const moe__block_iq1_s *bs = (const moe__block_iq1_s *)w + i;
        const moe__block_iq1_m *bm = (const moe__block_iq1_m *)w + i;
        const uint8_t *qs = m1 ? bm->qs : bs->qs;
        unsigned sc[4] = {0, 0, 0, 0};
        if (m1)
            for (int k = 0; k < 4; k++) sc[k] = bm->scales[2 * k] | (unsigned)bm->scales[2 * k + 1] << 8;
        const __m256i one = _mm256_set1_epi8(1);
        for (int j = 0; j < 8; j++) {
            const uint8_t *q = qs + 4 * j;
            __m256i g, e;
            if (m1) { /* 3 index bits and the shift's sign per 8, in the nibbles of qh[2j], qh[2j + 1] */
                const unsigned h = bm->qh[2 * j] | (unsigned)bm->qh[2 * j + 1] << 8;
                g = GRID4(iq1s_grid, q[0] | (h & 7) << 8, q[1] | (h >> 4 & 7) << 8, q[2] | (h >> 8 & 7) << 8, q[3] | (h >> 12 & 7) << 8);
                e = _mm256_or_si256(_mm256_set_epi64x(h & 0x8000 ? -1 : 0, h & 0x800 ? -1 : 0, h & 0x80 ? -1 : 0, h & 0x8 ? -1 : 0), one);
                const unsigned sk = sc[j / 2] >> (6 * (j % 2));
                sw[j] = (int16_t)(2 * (sk & 7) + 1), sw[8 + j] = (int16_t)(2 * (sk >> 3 & 7) + 1);
            } else {
                const unsigned h = bs->qh[j];
                g = GRID4(iq1s_grid, q[0] | (h & 7) << 8, q[1] | (h >> 3 & 7) << 8, q[2] | (h >> 6 & 7) << 8, q[3] | (h >> 9 & 7) << 8);
                e = _mm256_set1_epi8(h & 0x8000 ? -1 : 1);
                sw[j] = sw[8 + j] = (int16_t)(2 * (h >> 12 & 7) + 1);
            }
            const __m256i g2 = _mm256_add_epi8(g, g), g4 = _mm256_add_epi8(g2, g2);
            v[j] = _mm256_add_epi8(_mm256_add_epi8(g4, g4), e); /* 8 g +- 1 */
        }
        if (!m1) return f16_avx(bs->d) * 0.125f;
        return f16_avx((uint16_t)((sc[0] >> 12) | (sc[1] >> 8 & 0xf0) | (sc[2] >> 4 & 0xf00) | (sc[3] & 0xf000))) * 0.125f;
    }
    default: return 0;
    }
}

#undef SIGNS7

#undef GRID4

#undef GRID8

/* Q2_K, Q3_K, IQ4_XS and the grid formats: a block's 8 sub-blocks of 32 values as bytes (signed
 * but for Q2_K's; IQ2/IQ3's magnitudes, their signs apart), its 16 scales (one per 16 values;
 * IQ4_XS's in pairs) as 16-bit words, even-numbered in the low
 * half and odd in the high one, so one byte shuffle gives sub-block s its pair; then as Q6_K's
 * kernel: per sub-block sc0 acc0 + sc1 acc1 exactly in int32, x.d d times that in float. Q2_K's
 * minimums: per sub-block m0 sum(x first 16) + m1 sum(x last 16) (maddubs of the minimums'
 * bytes with x), and x.d (d S - dmin Sm). NT (1 or 4) activation rows x + t xs blocks, each
 * row's float steps the same whatever NT. */
MOE_TARGET("avx2,fma,f16c") static inline __attribute__((always_inline)) void k16_rows_avx2(const int type, const void *w, const moe__block_q8a *x,
                                                                                              int64_t xs, int64_t n, float *out, const int NT) {
    const __m256i three = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4), ones = _mm256_set1_epi16(1);
    const __m128i even_odd = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m256i kv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)moe__iq4nl_values));
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < n / 256; i++) {
        __m256i v[8], sg[8], sc16, mb = _mm256_setzero_si256();
        float d, dmin = 0;
        /* the values' magnitudes in v and their signs apart in sg (IQ2, IQ3) */
        const int apart = iq_type(type) && type != MOE_T_IQ1_S && type != MOE_T_IQ1_M;
        if (iq_type(type)) { /* the grid formats */
            int16_t sw[16];
            d = iq_block_avx2(type, w, i, v, sg, sw);
            sc16 = _mm256_loadu_si256((const __m256i *)(const void *)sw);
        } else if (type == MOE_T_IQ4_XS) {
            const moe__block_iq4_xs *b = (const moe__block_iq4_xs *)w + i;
            const __m128i s8 = _mm_sub_epi8(_mm_cvtsi64_si128((long long)iq4xs_scales8(b)), _mm_set1_epi8(32));
            sc16 = _mm256_cvtepi8_epi16(_mm_unpacklo_epi64(s8, s8)); /* sub-block j's scale as group 2j's and 2j + 1's */
            for (int j = 0; j < 8; j++) v[j] = _mm256_shuffle_epi8(kv, nibbles32_avx2(b->qs + 16 * j));
            d = f16_avx(b->d);
        } else {
            const uint8_t *qs;
            if (type == MOE_T_Q2_K) {
                const moe__block_q2_k *b = (const moe__block_q2_k *)w + i;
                const __m128i s8 = _mm_loadu_si128((const __m128i *)(const void *)b->scales);
                sc16 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_and_si128(s8, _mm_set1_epi8(15)), even_odd));
                mb = _mm256_broadcastsi128_si256(_mm_and_si128(_mm_srli_epi16(s8, 4), _mm_set1_epi8(15)));
                qs = b->qs, d = f16_avx(b->d), dmin = f16_avx(b->dmin);
            } else {
                const moe__block_q3_k *b = (const moe__block_q3_k *)w + i;
                uint32_t a3[3];
                memcpy(a3, b->scales, 12);
                const __m128i lo = _mm_setr_epi32((int)a3[0], (int)a3[1], (int)(a3[0] >> 4), (int)(a3[1] >> 4));
                /* dword k: scales 4k .. 4k + 3, low 4 bits from bytes 0..7 (low, then high nibbles), high 2 bits
                 * from bits 2k, 2k + 1 of bytes 8..11 (as q3k_scale; kept in registers: written to memory
                 * and read back as one load the scales cost this kernel 40% of its speed) */
                const __m128i hi = _mm_srlv_epi32(_mm_set1_epi32((int)a3[2]), _mm_setr_epi32(0, 2, 4, 6));
                const __m128i s8 = _mm_sub_epi8(_mm_or_si128(_mm_and_si128(lo, _mm_set1_epi8(15)), _mm_slli_epi32(_mm_and_si128(hi, _mm_set1_epi8(3)), 4)), _mm_set1_epi8(32));
                sc16 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(s8, even_odd));
                qs = b->qs, d = f16_avx(b->d);
            }
            for (int c = 0; c < 2; c++) {
                const __m256i r = _mm256_loadu_si256((const __m256i *)(const void *)(qs + 32 * c));
                for (int k = 0; k < 4; k++) v[4 * c + k] = _mm256_and_si256(_mm256_srli_epi16(r, 2 * k), three);
            }
            if (type == MOE_T_Q3_K) { /* bit j of hmask[l] is bit 2 of value l of sub-block j: 4 off where it is clear */
                const __m256i hm = _mm256_loadu_si256((const __m256i *)(const void *)((const moe__block_q3_k *)w + i)->hmask);
                MOE_UNROLL8 for (int j = 0; j < 8; j++) {
                    const __m256i at2 = j < 2 ? _mm256_slli_epi16(hm, 2 - j) : j > 2 ? _mm256_srli_epi16(hm, j - 2) : hm;
                    v[j] = _mm256_sub_epi8(v[j], _mm256_andnot_si256(at2, four));
                }
            }
        }
        __m256i h[4][4], hm4[4][4]; /* [token][pair of sub-blocks] */
        MOE_UNROLL4 for (int s = 0; s < 8; s += 2) {
            /* [scale 2s as 8 words | scale 2s + 1 as 8 words] */
            const __m256i c0 = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short)((2 * s) | (2 * s + 1) << 8)));
            const __m256i c1 = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short)((2 * s + 2) | (2 * s + 3) << 8)));
            /* Q2_K's values 0..3 and IQ2/IQ3's magnitudes taken by maddubs as they are; the signs moved onto x */
            const __m256i a0 = type == MOE_T_Q2_K || apart ? v[s] : _mm256_sign_epi8(v[s], v[s]);
            const __m256i a1 = type == MOE_T_Q2_K || apart ? v[s + 1] : _mm256_sign_epi8(v[s + 1], v[s + 1]);
            /* Q2_K: [minimum 2s as 16 bytes | minimum 2s + 1 as 16 bytes] */
            const __m256i m0 = _mm256_shuffle_epi8(mb, _mm256_setr_m128i(_mm_set1_epi8((char)(2 * s)), _mm_set1_epi8((char)(2 * s + 1))));
            const __m256i m1 = _mm256_shuffle_epi8(mb, _mm256_setr_m128i(_mm_set1_epi8((char)(2 * s + 2)), _mm_set1_epi8((char)(2 * s + 3))));
            (void)m0, (void)m1;
            MOE_UNROLL4 for (int t = 0; t < NT; t++) {
                const moe__block_q8a *xt = x + t * xs + 8 * i;
                const __m256i x0 = _mm256_loadu_si256((const __m256i *)(const void *)xt[s].qs);
                const __m256i x1 = _mm256_loadu_si256((const __m256i *)(const void *)xt[s + 1].qs);
                const __m256i y0 = type == MOE_T_Q2_K ? x0 : _mm256_sign_epi8(x0, apart ? sg[s] : v[s]);
                const __m256i y1 = type == MOE_T_Q2_K ? x1 : _mm256_sign_epi8(x1, apart ? sg[s + 1] : v[s + 1]);
                h[t][s / 2] = _mm256_hadd_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(a0, y0), c0), _mm256_madd_epi16(_mm256_maddubs_epi16(a1, y1), c1));
                if (type == MOE_T_Q2_K)
                    hm4[t][s / 2] = _mm256_hadd_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(m0, x0), ones), _mm256_madd_epi16(_mm256_maddubs_epi16(m1, x1), ones));
            }
        }
        MOE_UNROLL4 for (int t = 0; t < NT; t++) {
            const __m256i S = sum_pairs8_avx2(h[t]);
            __m256 xd, xm;
            q8a_heads8_avx2(x + t * xs + 8 * i, &xd, &xm);
            if (type == MOE_T_Q2_K) {
                const __m256i Sm = sum_pairs8_avx2(hm4[t]);
                acc[t] = _mm256_fmadd_ps(xd, _mm256_fmsub_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(S), _mm256_mul_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(Sm))), acc[t]);
            } else {
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(xd, _mm256_set1_ps(d)), _mm256_cvtepi32_ps(S), acc[t]);
            }
        }
    }
    MOE_UNROLL4 for (int t = 0; t < NT; t++) out[t] = hsum_avx2(acc[t]);
}

#define K16_AVX2(type, name, name4)                                                                                   \
    MOE_TARGET("avx2,fma,f16c") static float name(const void *w, const moe__block_q8a *x, int64_t n) {              \
        float r;                                                                                                      \
        k16_rows_avx2(type, w, x, 0, n, &r, 1);                                                                       \
        return r;                                                                                                     \
    }                                                                                                                 \
    MOE_TARGET("avx2,fma,f16c") static void name4(const void *w, const moe__block_q8a *x, int64_t xs, int64_t n, float *out) { \
        k16_rows_avx2(type, w, x, xs, n, out, 4);                                                                     \
    }

K16_AVX2(MOE_T_Q2_K, dotq_q2_k_avx2, dotq4_q2_k_avx2)
/* defines dotq4_q2_k_avx2(), dotq_q2_k_avx2() */

K16_AVX2(MOE_T_Q3_K, dotq_q3_k_avx2, dotq4_q3_k_avx2)
/* defines dotq4_q3_k_avx2(), dotq_q3_k_avx2() */

K16_AVX2(MOE_T_IQ4_XS, dotq_iq4_xs_avx2, dotq4_iq4_xs_avx2)
/* defines dotq4_iq4_xs_avx2(), dotq_iq4_xs_avx2() */

K16_AVX2(MOE_T_IQ2_XXS, dotq_iq2_xxs_avx2, dotq4_iq2_xxs_avx2)
/* defines dotq4_iq2_xxs_avx2(), dotq_iq2_xxs_avx2() */

K16_AVX2(MOE_T_IQ2_XS, dotq_iq2_xs_avx2, dotq4_iq2_xs_avx2)
/* defines dotq4_iq2_xs_avx2(), dotq_iq2_xs_avx2() */

K16_AVX2(MOE_T_IQ2_S, dotq_iq2_s_avx2, dotq4_iq2_s_avx2)
/* defines dotq4_iq2_s_avx2(), dotq_iq2_s_avx2() */

K16_AVX2(MOE_T_IQ3_XXS, dotq_iq3_xxs_avx2, dotq4_iq3_xxs_avx2)
/* defines dotq4_iq3_xxs_avx2(), dotq_iq3_xxs_avx2() */

K16_AVX2(MOE_T_IQ3_S, dotq_iq3_s_avx2, dotq4_iq3_s_avx2)
/* defines dotq4_iq3_s_avx2(), dotq_iq3_s_avx2() */

K16_AVX2(MOE_T_IQ1_S, dotq_iq1_s_avx2, dotq4_iq1_s_avx2)
/* defines dotq4_iq1_s_avx2(), dotq_iq1_s_avx2() */

K16_AVX2(MOE_T_IQ1_M, dotq_iq1_m_avx2, dotq4_iq1_m_avx2)
/* defines dotq4_iq1_m_avx2(), dotq_iq1_m_avx2() */

#undef K16_AVX2

/* IQ4_NL: 16 bytes of nibbles to the levels by one byte shuffle, then as Q8_0 */
MOE_TARGET("avx2,fma,f16c") static inline __attribute__((always_inline)) void iq4_nl_rows_avx2(const void *w, const moe__block_q8a *x, int64_t xs,
                                                                                                 int64_t n, float *out, const int NT) {
    const moe__block_iq4_nl *b = w;
    const __m256i kv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)moe__iq4nl_values));
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < n / 32; i++) {
        const __m256i v = _mm256_shuffle_epi8(kv, nibbles32_avx2(b[i].qs));
        const float d = f16_avx(b[i].d);
        MOE_UNROLL4 for (int t = 0; t < NT; t++) {
            const moe__block_q8a *xt = x + t * xs + i;
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * xt->d), mul_i8_avx2(v, _mm256_loadu_si256((const __m256i *)(const void *)xt->qs)), acc[t]);
        }
    }
    MOE_UNROLL4 for (int t = 0; t < NT; t++) out[t] = hsum_avx2(acc[t]);
}

MOE_TARGET("avx2,fma,f16c") static float dotq_iq4_nl_avx2(const void *w, const moe__block_q8a *x, int64_t n) {
    float r;
    iq4_nl_rows_avx2(w, x, 0, n, &r, 1);
    return r;
}

MOE_TARGET("avx2,fma,f16c") static void dotq4_iq4_nl_avx2(const void *w, const moe__block_q8a *x, int64_t xs, int64_t n, float *out) {
    iq4_nl_rows_avx2(w, x, xs, n, out, 4);
}

MOE_TARGET("avx2,fma") static void quant_q8a_avx2(const float *x, moe__block_q8a *out, int64_t n) {
    const __m256 signbit = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < n / 32; i++) {
        const float *v = x + i * 32;
        __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16), v3 = _mm256_loadu_ps(v + 24);
        __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(signbit, v0), _mm256_andnot_ps(signbit, v1)),
                                  _mm256_max_ps(_mm256_andnot_ps(signbit, v2), _mm256_andnot_ps(signbit, v3)));
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        float amax = _mm_cvtss_f32(m);
        out[i].d = amax / 127;
        __m256 id = _mm256_set1_ps(amax ? 127.0f / amax : 0.0f);
        /* cvtps rounds to nearest even, as lrintf does in the reference */
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, id)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, id));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, id)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, id));
        __m256i p01 = _mm256_packs_epi32(i0, i1), p23 = _mm256_packs_epi32(i2, i3);
        __m256i p = _mm256_packs_epi16(p01, p23);
        /* packs interleave 128-bit lanes: restore the order */
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)out[i].qs, p);
        /* sum of the 32 int8: widen to 16-bit pairs, then to 32-bit, then horizontally */
        __m256i s16 = _mm256_maddubs_epi16(_mm256_set1_epi8(1), p);
        __m256i s32 = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
        out[i].sum = _mm_cvtsi128_si32(s);
    }
}

/* ggml block_mxfp4: the same shuffle decode; low nibbles are values 0..15, high 16..31 */
MOE_TARGET("avx2,fma") static float dot_mxfp4g_avx2(const void *w, const uint8_t *sc, const float *x, int64_t n) {
    (void)sc;
    const moe__block_mxfp4 *b = w;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / 32; i++) {
        __m128i lo, hi;
        mxfp4_decode16(_mm_loadu_si128((const __m128i *)b[i].qs), &lo, &hi);
        const float *xb = x + i * 32;
        __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), _mm256_loadu_ps(xb));
        s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), _mm256_loadu_ps(xb + 8), s);
        s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), _mm256_loadu_ps(xb + 16), s);
        s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), _mm256_loadu_ps(xb + 24), s);
        acc = _mm256_fmadd_ps(s, _mm256_set1_ps(0.5f * e8m0(b[i].e)), acc);
    }
    return hsum_avx2(acc);
}

/* x8 groups, AVX2: maddubs(unsigned weights, broadcast activation bytes) gives per row pairs,
 * madd adds pairs into the row's 32-bit lane. Q4_0 products (<= 15 x 128 x 2) let 8 chunks add up
 * in 16 bits first; Q8_0's (<= 255 x 128 x 2) need the 32-bit step per chunk. */
MOE_TARGET("avx2,fma,f16c") static void dotq8_q4_0_avx2(const void *w, const moe__block_q8a *x, int64_t n, float *out) {
    const moe__block_q4_0x8 *o = w;
    const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / 32; b++) {
        prefetch_ahead(o + b, sizeof *o);
        const int32_t *xq = (const int32_t *)x[b].qs;
        __m256i s16 = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(o[b].qs + 32 * c));
            __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xq[c])));
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xq[c + 4])));
        }
        __m256i s32 = _mm256_sub_epi32(_mm256_madd_epi16(s16, ones), _mm256_set1_epi32(8 * x[b].sum));
        __m256 d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)o[b].d)), _mm256_set1_ps(x[b].d));
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s32), acc);
    }
    _mm256_storeu_ps(out, acc);
}

/* Prefill: one x8 row group against 4 activation rows, each row bit for bit the 1-row AVX2
 * kernel's result (the same integer and float steps), each chunk of weights loaded and unpacked
 * once and met by the 4 rows in turn (holding all 8 unpacked chunks needs more than AVX2's 16
 * registers: it spilled and ran slower than the 1-row kernel); integer sums wrap, so their order
 * does not change them. */
/* the 4 rows' block b: x0..x3, their 4-byte groups q0..q3, integer sums s0..s3 */
#define AVX2_X4_ROWS                                                                                               \
    const moe__block_q8a *x0 = x + b, *x1 = x0 + xs, *x2 = x1 + xs, *x3 = x2 + xs;                                 \
    const int32_t *q0 = (const int32_t *)x0->qs, *q1 = (const int32_t *)x1->qs, *q2 = (const int32_t *)x2->qs;     \
    const int32_t *q3 = (const int32_t *)x3->qs;                                                                   \
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0

/* the block's int32 sums S(s) into the 4 rows' float sums */
#define AVX2_X4_ACC(S) AVX2_X4_ACC_DW(S, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)o[b].d)))

/* the same with the weights' scales DW */
#define AVX2_X4_ACC_DW(S, DW)                                                                                      \
    do {                                                                                                           \
        const __m256 dw = DW;                                                                                      \
        a0 = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(x0->d)), _mm256_cvtepi32_ps(S(s0, x0)), a0);        \
        a1 = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(x1->d)), _mm256_cvtepi32_ps(S(s1, x1)), a1);        \
        a2 = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(x2->d)), _mm256_cvtepi32_ps(S(s2, x2)), a2);        \
        a3 = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(x3->d)), _mm256_cvtepi32_ps(S(s3, x3)), a3);        \
    } while (0)

#define AVX2_X4_STORE() \
    _mm256_storeu_ps(out, a0), _mm256_storeu_ps(out + 8, a1), _mm256_storeu_ps(out + 16, a2), _mm256_storeu_ps(out + 24, a3)

MOE_TARGET("avx2,fma,f16c") static void dotq8x4_q4_0_avx2(const void *w, const moe__block_q8a *x, int64_t xs, int64_t n, float *out) {
    const moe__block_q4_0x8 *o = w;
    const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t b = 0; b < n / 32; b++) {
        prefetch_ahead(o + b, sizeof *o);
        AVX2_X4_ROWS; /* int16 sums here */
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(o[b].qs + 32 * c));
            const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
#define ROW(S, Q) S = _mm256_add_epi16(_mm256_add_epi16(S, _mm256_maddubs_epi16(lo, _mm256_set1_epi32(Q[c]))), _mm256_maddubs_epi16(hi, _mm256_set1_epi32(Q[c + 4])))
            ROW(s0, q0);
            ROW(s1, q1);
            ROW(s2, q2);
            ROW(s3, q3);
#undef ROW
        }
#define S32(S, X) _mm256_sub_epi32(_mm256_madd_epi16(S, ones), _mm256_set1_epi32(8 * X->sum))
        AVX2_X4_ACC(S32);
#undef S32
    }
    AVX2_X4_STORE();
}

/* MXFP4x8 helpers: 16 codes per 128-bit lane -> 2 E2M1 + 12 (0..24, unsigned for maddubs and
 * dpbusd: the kernels subtract 12 * sum(x)); the 8 rows' E8M0 scales as 0.5 * 2^(e-127) in
 * floats, as e8m0() makes them (e = 0: 2^-127, e = 255: NaN) */
MOE_TARGET("avx2,fma") static inline __m256i mxfp4x8_lut_avx2(void) {
    return _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0, 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
}

MOE_TARGET("avx2,fma") static inline __m256 mxfp4x8_scales_avx2(const uint8_t *e) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)e));
    __m256i bits = _mm256_slli_epi32(v, 23);
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x00400000), _mm256_cmpeq_epi32(v, _mm256_setzero_si256()));
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7fc00000), _mm256_cmpeq_epi32(v, _mm256_set1_epi32(255)));
    return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0.5f));
}

/* as dotq8_q4_0_avx2 with the codes looked up; products up to 24 x 127 x 2 let only 4 chunk
 * products add up in 16 bits, so two int16 sums */
MOE_TARGET("avx2,fma") static void dotq8_mxfp4_avx2(const void *w, const moe__block_q8a *x, int64_t n, float *out) {
    const moe__block_mxfp4x8 *o = w;
    const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1), lut = mxfp4x8_lut_avx2();
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / 32; b++) {
        prefetch_ahead(o + b, sizeof *o);
        const int32_t *xq = (const int32_t *)x[b].qs;
        __m256i s16[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(o[b].qs + 32 * c));
            const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, m4)), hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
            s16[c >> 1] = _mm256_add_epi16(s16[c >> 1], _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xq[c])), _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xq[c + 4]))));
        }
        const __m256i s32 = _mm256_sub_epi32(_mm256_add_epi32(_mm256_madd_epi16(s16[0], ones), _mm256_madd_epi16(s16[1], ones)), _mm256_set1_epi32(12 * x[b].sum));
        acc = _mm256_fmadd_ps(_mm256_mul_ps(mxfp4x8_scales_avx2(o[b].e), _mm256_set1_ps(x[b].d)), _mm256_cvtepi32_ps(s32), acc);
    }
    _mm256_storeu_ps(out, acc);
}

MOE_TARGET("avx2,fma,f16c") static void dotq8_q8_0_avx2(const void *w, const moe__block_q8a *x, int64_t n, float *out) {
    const moe__block_q8_0x8 *o = w;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / 32; b++) {
        prefetch_ahead(o + b, sizeof *o);
        const int32_t *xq = (const int32_t *)x[b].qs;
        __m256i s32 = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {
            /* 255 x 127 x 2 overflows int16: split the unsigned weight into (w - 128) via signs */
            __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(o[b].qs + 32 * c)), _mm256_set1_epi8((char)0x80));
            __m256i xb = _mm256_set1_epi32(xq[c]);
            __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(v, v), _mm256_sign_epi8(xb, v));
            s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(p, ones));
        }
        __m256 d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)o[b].d)), _mm256_set1_ps(x[b].d));
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s32), acc);
    }
    _mm256_storeu_ps(out, acc);
}

#define IQ4_DOT_AVX2(acc, v, p)                                                                                           \
    ((acc) = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(v, v),                          \
                                                                          _mm256_sign_epi8(_mm256_set1_epi32(*(const int32_t *)(const void *)(p)), v)), ones)))

IQ4X8_KERNEL(dotq8_iq4_xs_avx2, dotq8x4_iq4_xs_avx2, "avx2,fma,f16c", IQ4_DOT_AVX2, 0)
/* defines dotq8_iq4_xs_avx2(), dotq8x4_iq4_xs_avx2(), dotq8_iq4_xs_avx2_rows() */

#undef IQ4_DOT_AVX2

K2X8_KERNEL(dotq8_q2_k_avx2, dotq8x4_q2_k_avx2, "avx2,fma,f16c", DPBA16_AVX2, SUMS16_AVX2, 0)
/* defines dotq8_q2_k_avx2(), dotq8x4_q2_k_avx2(), dotq8_q2_k_avx2_rows() */

K2X8_KERNEL(dotq8_q3_k_avx2, dotq8x4_q3_k_avx2, "avx2,fma,f16c", DPBA16_AVX2, SUMS16_AVX2, 1)
/* defines dotq8_q3_k_avx2(), dotq8x4_q3_k_avx2(), dotq8_q3_k_avx2_rows() */

K6X8_KERNEL(dotq8_q6_k_avx2, dotq8x4_q6_k_avx2, "avx2,fma,f16c", DPBA_AVX2)
/* defines dotq8_q6_k_avx2(), dotq8x4_q6_k_avx2(), dotq8_q6_k_avx2_rows() */

/* the same for Q8_0x8, each chunk loaded once for the 4 rows */
MOE_TARGET("avx2,fma,f16c") static void dotq8x4_q8_0_avx2(const void *w, const moe__block_q8a *x, int64_t xs, int64_t n, float *out) {
    const moe__block_q8_0x8 *o = w;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t b = 0; b < n / 32; b++) {
        prefetch_ahead(o + b, sizeof *o);
        AVX2_X4_ROWS;
        for (int c = 0; c < 8; c++) {
            const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(o[b].qs + 32 * c)), _mm256_set1_epi8((char)0x80));
            const __m256i av = _mm256_sign_epi8(v, v);
#define ROW(S, Q) S = _mm256_add_epi32(S, _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(_mm256_set1_epi32(Q[c]), v)), ones))
            ROW(s0, q0);
            ROW(s1, q1);
            ROW(s2, q2);
            ROW(s3, q3);
#undef ROW
        }
#define S32(S, X) S
        AVX2_X4_ACC(S32);
#undef S32
    }
    AVX2_X4_STORE();
}

/* MXFP4x8 for 4 rows: signed codes (|w| <= 12) through maddubs(|w|, x with w's sign), so all 8
 * chunk products (<= 12 x 127 x 2 each) add up in one int16 sum per row; the integer sums are
 * dotq8_mxfp4_avx2's, the float steps too */
MOE_TARGET("avx2,fma,f16c") static void dotq8x4_mxfp4_avx2(const void *w, const moe__block_q8a *x, int64_t xs, int64_t n, float *out) {
    const moe__block_mxfp4x8 *o = w;
    const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const __m256i lut = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12, 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t b = 0; b < n / 32; b++) {
        prefetch_ahead(o + b, sizeof *o);
        AVX2_X4_ROWS; /* int16 sums here */
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(o[b].qs + 32 * c));
            const __m256i ls = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, m4)), hs = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
            const __m256i la = _mm256_abs_epi8(ls), ha = _mm256_abs_epi8(hs);
#define ROW(S, Q)                                                                                                  \
    S = _mm256_add_epi16(S, _mm256_add_epi16(_mm256_maddubs_epi16(la, _mm256_sign_epi8(_mm256_set1_epi32(Q[c]), ls)),          \
                                             _mm256_maddubs_epi16(ha, _mm256_sign_epi8(_mm256_set1_epi32(Q[c + 4]), hs))))
            ROW(s0, q0);
            ROW(s1, q1);
            ROW(s2, q2);
            ROW(s3, q3);
#undef ROW
        }
#define S32(S, X) _mm256_madd_epi16(S, ones)
        AVX2_X4_ACC_DW(S32, mxfp4x8_scales_avx2(o[b].e));
#undef S32
    }
    AVX2_X4_STORE();
}

#undef AVX2_X4_ROWS

#undef AVX2_X4_ACC

#undef AVX2_X4_ACC_DW

#undef AVX2_X4_STORE

AXPY_KERNEL(axpy_avx2, "avx2,fma", 256)
/* defines axpy_avx2() */

DWCONV_KERNEL(dwconv_avx2, "avx2,fma", 256)
/* defines dwconv_avx2() */

/* e^x at 8 lanes: 2^n applied in two halves (each a normal float) so that results down to the
 * subnormal range round once, as expf's do */
MOE_TARGET("avx2,fma") static inline __m256 exp_avx2(__m256 x) {
    const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
    const __m256 nf = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504089f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(nf, _mm256_set1_ps(LN2_HI), xc);
    r = _mm256_fnmadd_ps(nf, _mm256_set1_ps(LN2_LO), r);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(EXP_P0), r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i n = _mm256_cvtps_epi32(nf), n1 = _mm256_srai_epi32(n, 1), n2 = _mm256_sub_epi32(n, n1);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, _mm256_set1_epi32(127)), 23));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, _mm256_set1_epi32(127)), 23));
    const __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)); /* NaN stays NaN */
}

LOG1P01_KERNEL(log1p01_avx2, "avx2,fma", 256)

MOE_TARGET("avx2,fma") static void act_avx2(float *y, const float *x, int64_t n, int kind) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 z = _mm256_loadu_ps(x + i);
        __m256 r;
        if (kind == MOE__ACT_SOFTPLUS) { /* max(z, 0) + log1p(e^-|z|); z itself above 20 */
            const __m256 l = log1p01_avx2(exp_avx2(_mm256_or_ps(z, sign)));
            r = _mm256_add_ps(_mm256_max_ps(z, _mm256_setzero_ps()), l);
            r = _mm256_blendv_ps(r, z, _mm256_cmp_ps(z, _mm256_set1_ps(20.0f), _CMP_GT_OQ));
            r = _mm256_blendv_ps(r, z, _mm256_cmp_ps(z, z, _CMP_UNORD_Q));
        } else {
            r = _mm256_div_ps(one, _mm256_add_ps(one, exp_avx2(_mm256_xor_ps(z, sign))));
            if (kind == MOE__ACT_SILU) r = _mm256_mul_ps(z, r);
        }
        _mm256_storeu_ps(y + i, r);
    }
    moe__act_ref(y + i, x + i, n - i, kind);
}

EXP_SUM_KERNEL(exp_sum_avx2, "avx2,fma", 256, exp_avx2, hsum_avx2, moe__exp_sum_ref)
/* defines exp_sum_avx2() */

WIDEN_BF16_KERNEL(widen_bf16_avx2, "avx2,fma", 256, load_bf16_avx2, moe__widen_bf16_ref)
/* defines widen_bf16_avx2() */

KDA_RECURRENT_KERNEL(kda_recurrent_avx2, "avx2,fma", 256, moe__kda_recurrent, exp_sum_avx2)
/* defines kda_recurrent_avx2() */

MLA_SCORES1_KERNEL(mla_scores1_avx2, "avx2,fma", 256, hsum_avx2)
/* defines mla_scores1_avx2() */

/* scores, 4 heads x 2 keys at a time: 8 independent sums (enough to cover the FMA latency) and
 * 6 loads per 8 FMAs; the keys' rows are prefetched four keys ahead (a decode step reads the
 * latent cache from memory, once) */
MOE_TARGET("avx2,fma") static void mla_scores_avx2(const moe__mla_block *b) {
    const int r = b->r, dr = b->dr, cw = b->cw;
    if (r % 8 || dr % 8) { moe__mla_scores_ref(b); return; }
    const size_t qs = (size_t)b->qr_stride;
    int j = b->j0;
    for (; j + 2 <= b->j1; j += 2) {
        const float *c0 = b->cache + (size_t)j * cw, *c1 = c0 + cw;
        int h = 0;
        if (b->H < 8) prefetch_row_l2(bytes_past(c0, sizeof(float) * 4 * (size_t)cw), cw * 8); /* keys j+4 and j+5 */
        for (; h + 4 <= b->H; h += 4) {
            if (b->H >= 8 && h < 8) prefetch_row_l2(bytes_past(c0, sizeof(float) * (size_t)(4 + h / 4) * cw), cw * 4); /* one of them per head group */
            const float *a0 = b->qa + (size_t)h * r, *a1 = a0 + r, *a2 = a1 + r, *a3 = a2 + r;
            const float *q0 = b->qr + (size_t)h * qs, *q1 = q0 + qs, *q2 = q1 + qs, *q3 = q2 + qs;
            __m256 t00 = _mm256_setzero_ps(), t01 = t00, t10 = t00, t11 = t00, t20 = t00, t21 = t00, t30 = t00, t31 = t00;
#define PAIR_STEP(p0, p1, p2, p3, x0, x1)                                                                            \
    do {                                                                                                             \
        const __m256 v0 = _mm256_loadu_ps(x0), v1 = _mm256_loadu_ps(x1);                                             \
        __m256 w = _mm256_loadu_ps(p0);                                                                              \
        t00 = _mm256_fmadd_ps(w, v0, t00), t01 = _mm256_fmadd_ps(w, v1, t01);                                         \
        w = _mm256_loadu_ps(p1), t10 = _mm256_fmadd_ps(w, v0, t10), t11 = _mm256_fmadd_ps(w, v1, t11);                \
        w = _mm256_loadu_ps(p2), t20 = _mm256_fmadd_ps(w, v0, t20), t21 = _mm256_fmadd_ps(w, v1, t21);                \
        w = _mm256_loadu_ps(p3), t30 = _mm256_fmadd_ps(w, v0, t30), t31 = _mm256_fmadd_ps(w, v1, t31);                \
    } while (0)
            for (int i = 0; i < r; i += 8) PAIR_STEP(a0 + i, a1 + i, a2 + i, a3 + i, c0 + i, c1 + i);
            for (int i = 0; i < dr; i += 8) PAIR_STEP(q0 + i, q1 + i, q2 + i, q3 + i, c0 + r + i, c1 + r + i);
#undef PAIR_STEP
            float *s0 = b->sc + (size_t)h * b->ld + j, *s1 = s0 + b->ld, *s2 = s1 + b->ld, *s3 = s2 + b->ld;
            const float k = b->scale;
            s0[0] = hsum_avx2(t00) * k, s0[1] = hsum_avx2(t01) * k, s1[0] = hsum_avx2(t10) * k, s1[1] = hsum_avx2(t11) * k;
            s2[0] = hsum_avx2(t20) * k, s2[1] = hsum_avx2(t21) * k, s3[0] = hsum_avx2(t30) * k, s3[1] = hsum_avx2(t31) * k;
        }
        if (h < b->H) mla_scores1_avx2(b, j, h), mla_scores1_avx2(b, j + 1, h);
    }
    for (; j < b->j1; j++) {
        prefetch_row_l2(bytes_past(b->cache, sizeof(float) * (size_t)(j + 4) * cw), cw * 4);
        mla_scores1_avx2(b, j, 0);
    }
}

/* ctx: 2 heads x 32 latent floats stay in 8 registers while every key of the block passes */
MOE_TARGET("avx2,fma") static void mla_ctx_avx2(const moe__mla_block *b, int h0, int h1) {
    /* key chunks, slices outside, head pairs inside, as mla_ctx_avx512: a chunk's 32-float slice
     * (16 KB) stays in L1 while the head pairs pass over it */
    const int r = b->r, hn = h0 + (h1 - h0) / 2 * 2;
    if (r % 32) { moe__mla_ctx_ref(b, h0, h1); return; }
    for (int j0 = 0; j0 < b->jn; j0 += 128) {
        const int j1 = b->jn - j0 < 128 ? b->jn : j0 + 128;
        for (int i = 0; i < r; i += 32)
            for (int h = h0; h < hn; h += 2) {
                const float *p0 = b->sc + (size_t)h * b->ld, *p1 = p0 + b->ld;
                float *c0 = b->ctx + (size_t)h * r, *c1 = c0 + r;
                __m256 x0 = _mm256_loadu_ps(c0 + i), x1 = _mm256_loadu_ps(c0 + i + 8), x2 = _mm256_loadu_ps(c0 + i + 16), x3 = _mm256_loadu_ps(c0 + i + 24);
                __m256 y0 = _mm256_loadu_ps(c1 + i), y1 = _mm256_loadu_ps(c1 + i + 8), y2 = _mm256_loadu_ps(c1 + i + 16), y3 = _mm256_loadu_ps(c1 + i + 24);
                for (int j = j0; j < j1; j++) {
                    const float *c = b->cache + (size_t)j * b->cw + i;
                    const __m256 a = _mm256_set1_ps(p0[j]), bb = _mm256_set1_ps(p1[j]);
                    const __m256 v0 = _mm256_loadu_ps(c), v1 = _mm256_loadu_ps(c + 8), v2 = _mm256_loadu_ps(c + 16), v3 = _mm256_loadu_ps(c + 24);
                    x0 = _mm256_fmadd_ps(a, v0, x0), x1 = _mm256_fmadd_ps(a, v1, x1), x2 = _mm256_fmadd_ps(a, v2, x2), x3 = _mm256_fmadd_ps(a, v3, x3);
                    y0 = _mm256_fmadd_ps(bb, v0, y0), y1 = _mm256_fmadd_ps(bb, v1, y1), y2 = _mm256_fmadd_ps(bb, v2, y2), y3 = _mm256_fmadd_ps(bb, v3, y3);
                }
                _mm256_storeu_ps(c0 + i, x0), _mm256_storeu_ps(c0 + i + 8, x1), _mm256_storeu_ps(c0 + i + 16, x2), _mm256_storeu_ps(c0 + i + 24, x3);
                _mm256_storeu_ps(c1 + i, y0), _mm256_storeu_ps(c1 + i + 8, y1), _mm256_storeu_ps(c1 + i + 16, y2), _mm256_storeu_ps(c1 + i + 24, y3);
            }
    }
    if (hn < h1) moe__mla_ctx_ref(b, hn, h1);
}

static void mla_scores16_avx2(const moe__mla_block16 *b) { mla_scores16_widened(b, mla_scores_avx2, widen_bf16_avx2); }

static void mla_ctx16_avx2(const moe__mla_block16 *b, int h0, int h1) { mla_ctx16_widened(b, h0, h1, mla_ctx_avx2, widen_bf16_avx2); }

/* AVX2: the same orders at 8 heads a register, without VNNI: the queries' signs moved onto the
 * keys' bytes (maddubs multiplies unsigned by signed bytes: |q| x sign(q) c, pairs within int16),
 * pairs summed into int32 by madd. 8 keys x 8 heads in named accumulators (in an array indexed
 * by a run-time key count gcc kept them in memory: 1.6x slower), stored through a small table. */
MOE_TARGET("avx2,fma") static void scores8_part_avx2(const moe__mla_block8 *b, const int8_t *c, const int8_t *qt, int i0, int i1,
                                                     const int32_t *offs, int32_t d[8][8]) {
    const int cw = b->cw;
    (void)offs;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int i = i0; i < i1; i += 4) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(const void *)(qt + (size_t)i * 16)), aq = _mm256_abs_epi8(q);
#define KEY(n)                                                                                                 \
    a##n = _mm256_add_epi32(a##n, _mm256_madd_epi16(_mm256_maddubs_epi16(aq, _mm256_sign_epi8(                     \
                                      _mm256_set1_epi32(*(const int32_t *)(const void *)(c + (size_t)(n) * cw + i)), q)), ones))
        KEY(0), KEY(1), KEY(2), KEY(3), KEY(4), KEY(5), KEY(6), KEY(7);
#undef KEY
    }
    _mm256_storeu_si256((__m256i *)(void *)d[0], a0), _mm256_storeu_si256((__m256i *)(void *)d[1], a1);
    _mm256_storeu_si256((__m256i *)(void *)d[2], a2), _mm256_storeu_si256((__m256i *)(void *)d[3], a3);
    _mm256_storeu_si256((__m256i *)(void *)d[4], a4), _mm256_storeu_si256((__m256i *)(void *)d[5], a5);
    _mm256_storeu_si256((__m256i *)(void *)d[6], a6), _mm256_storeu_si256((__m256i *)(void *)d[7], a7);
}

MLA_SCORES8_256(mla_scores8_avx2, "avx2,fma", scores8_part_avx2)
/* defines mla_scores8_avx2() */

/* ctx at 16 latent values a slice: two keys' int8 values widened to int16 and interleaved, times
 * the two keys' weights of a head (madd: w_j c_j + w_j+1 c_j+1 in int32); 4 heads at a time in
 * named accumulators, a last group of fewer heads one by one */
#define CTX8_PAIR_AVX2(lo, hi, hh)                                                                             \
    do {                                                                                                        \
        const uint8_t *w_ = b->w + (size_t)(hh) * b->lw + j; /* w_[1] is 0 past jn (lw is a multiple of 4) */   \
        const __m256i wp_ = _mm256_set1_epi32((int32_t)((uint32_t)w_[0] | (uint32_t)w_[1] << 16));               \
        lo = _mm256_add_epi32(lo, _mm256_madd_epi16(vl, wp_)), hi = _mm256_add_epi32(hi, _mm256_madd_epi16(vh, wp_)); \
    } while (0)

/* lo holds values 0-3 and 8-11, hi 4-7 and 12-15 */
#define CTX8_OUT_AVX2(lo, hi, hh)                                                                              \
    do {                                                                                                        \
        float *o_ = b->ctx + (size_t)(hh) * r + i;                                                              \
        const __m256 s_ = _mm256_set1_ps(b->ws[hh]);                                                            \
        const __m256i y0_ = _mm256_permute2x128_si256(lo, hi, 0x20), y1_ = _mm256_permute2x128_si256(lo, hi, 0x31); \
        _mm256_storeu_ps(o_, _mm256_add_ps(_mm256_loadu_ps(o_), _mm256_mul_ps(s_, _mm256_cvtepi32_ps(y0_))));        \
        _mm256_storeu_ps(o_ + 8, _mm256_add_ps(_mm256_loadu_ps(o_ + 8), _mm256_mul_ps(s_, _mm256_cvtepi32_ps(y1_)))); \
    } while (0)

/* moe__mla_weights8 in 8 lanes: the same products, maximum and rounding steps, so the same bytes */
/* moe__quant8_row: the largest |x| in 8 lanes (max(v, m) keeps m where v is NaN, as the
 * reference's compare does), the same scale, cvtps2dq rounding as lrintf does (to nearest even,
 * the default mode), the same clamp; bit for bit the reference */
MOE_TARGET("avx2,fma") static void quant8_row_avx2(const float *x, int n, int8_t *q, float *d, int32_t *sum) {
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 mv = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), abs), mv);
    float m8[8], amax = 0;
    _mm256_storeu_ps(m8, mv);
    for (int k = 0; k < 8; k++) amax = m8[k] > amax ? m8[k] : amax;
    amax = quant8_absmax_tail(x, i, n, amax);
    const float inv = amax > 0 ? 127.0f / amax : 0.0f;
    const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
    __m256i s8 = _mm256_setzero_si256();
    for (i = 0; i + 8 <= n; i += 8) {
        __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(inv)));
        v = _mm256_max_epi32(_mm256_min_epi32(v, hi), lo); /* out of range and NaN: INT_MIN, -> -127 */
        s8 = _mm256_add_epi32(s8, v);
        const __m128i v16 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        _mm_storel_epi64((__m128i *)(void *)(q + i), _mm_packs_epi16(v16, v16));
    }
    int32_t s[8], total = quant8_round_tail(x, inv, i, n, q);
    _mm256_storeu_si256((__m256i *)(void *)s, s8);
    for (int k = 0; k < 8; k++) total += s[k];
    *d = amax / 127.0f;
    *sum = total;
}

MOE_TARGET("avx2,fma") static float weights8_max_avx2(const float *p, const float *d, int jn) {
    __m256 mv = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= jn; j += 8) mv = _mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(p + j), _mm256_loadu_ps(d + j)), mv);
    float m8[8], m = 0;
    _mm256_storeu_ps(m8, mv);
    for (int k = 0; k < 8; k++) m = m8[k] > m ? m8[k] : m;
    return weights8_max_tail(p, d, j, jn, m);
}

MOE_TARGET("avx2,fma") static void weights8_round_avx2(const float *p, const float *d, float inv, int jn, int lw, uint8_t *w) {
    const __m256 vi = _mm256_set1_ps(inv), half = _mm256_set1_ps(0.5f), top = _mm256_set1_ps(255.0f);
    int j = 0;
    for (; j + 8 <= jn; j += 8) {
        const __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(p + j), _mm256_loadu_ps(d + j)), vi), half);
        const __m256i q = _mm256_cvttps_epi32(_mm256_min_ps(v, top)); /* 0..255 */
        const __m128i s = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        _mm_storel_epi64((__m128i *)(w + j), _mm_packus_epi16(s, s));
    }
    weights8_round_tail(p, d, inv, j, jn, lw, w);
}

static void mla_weights8_avx2(const float *p, int ld, const moe__kv8_meta *meta, int jn, int h0, int h1, uint8_t *w, int lw, float *ws,
                              float *work) {
    weights8_heads(p, ld, meta, jn, h0, h1, w, lw, ws, work, weights8_max_avx2, weights8_round_avx2);
}

MOE_TARGET("avx2,fma") static void mla_ctx8_avx2(const moe__mla_block8 *b, int h0, int h1) {
    const int r = b->r, cw = b->cw, jn = b->jn;
    if (r % 16) { moe__mla_ctx8_ref(b, h0, h1); return; }
    for (int i = 0; i < r; i += 16)
        for (int h = h0; h < h1;) {
            const int four = h1 - h >= 4;
            __m256i l0 = _mm256_setzero_si256(), l1 = l0, l2 = l0, l3 = l0, u0 = l0, u1 = l0, u2 = l0, u3 = l0;
            for (int j = 0; j < jn; j += 2) {
                const int8_t *c = b->cache + (size_t)j * cw + i;
                const __m256i x0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)c));
                const __m256i x1 = j + 1 < jn ? _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)(c + cw))) : _mm256_setzero_si256();
                const __m256i vl = _mm256_unpacklo_epi16(x0, x1), vh = _mm256_unpackhi_epi16(x0, x1);
                CTX8_PAIR_AVX2(l0, u0, h);
                if (four) {
                    CTX8_PAIR_AVX2(l1, u1, h + 1);
                    CTX8_PAIR_AVX2(l2, u2, h + 2);
                    CTX8_PAIR_AVX2(l3, u3, h + 3);
                }
            }
            CTX8_OUT_AVX2(l0, u0, h);
            if (four) {
                CTX8_OUT_AVX2(l1, u1, h + 1);
                CTX8_OUT_AVX2(l2, u2, h + 2);
                CTX8_OUT_AVX2(l3, u3, h + 3);
            }
            h += four ? 4 : 1;
        }
}

#undef CTX8_PAIR_AVX2

#undef CTX8_OUT_AVX2

#endif /* MOE_X86 */

/* =================================================================================================
 * PART 5: AVX-VNNI
 * =================================================================================================
 * The avxvnni level: the avx2 level with its int8 products through VEX-encoded VPDPBUSD (Alder
 * Lake and later Intel cores, Zen 5). Everything it does not list here is avx2's. Built in the
 * EVEX encoding with -DMOE_AVXVNNI_AS_EVEX, so an AVX-512 VNNI CPU can check it (make
 * test-avxvnni-evex). */

#ifdef MOE_X86

/* VEX has no embedded broadcast: the activation dword is broadcast into a register first */
#define VNNI_DPB_VEX(acc, u, p) ((acc) = AVXVNNI_DPBUSD(acc, u, _mm256_set1_epi32(*(const int32_t *)(p))))

K4X8_KERNEL(dotq8_q4_k_avxvnni, MOE_AVXVNNI, VNNI_DPB_VEX, SUMS32, moe__block_q4_kx8, 0, qs)
/* defines dotq8_q4_k_avxvnni() */

K4X8X4_KERNEL(dotq8x4_q4_k_avxvnni, MOE_AVXVNNI, VNNI_DPB_VEX, SUMS32, moe__block_q4_kx8, 0, qs)
/* defines dotq8x4_q4_k_avxvnni() */

K4X8_KERNEL(dotq8_q5_k_avxvnni, MOE_AVXVNNI, VNNI_DPB_VEX, SUMS32, moe__block_q5_kx8, 1, qh)
/* defines dotq8_q5_k_avxvnni() */

K4X8X4_KERNEL(dotq8x4_q5_k_avxvnni, MOE_AVXVNNI, VNNI_DPB_VEX, SUMS32, moe__block_q5_kx8, 1, qh)
/* defines dotq8x4_q5_k_avxvnni() */

IQ4X8_KERNEL(dotq8_iq4_xs_avxvnni, dotq8x4_iq4_xs_avxvnni, MOE_AVXVNNI, VNNI_DPB_VEX, 128)
/* defines dotq8_iq4_xs_avxvnni(), dotq8x4_iq4_xs_avxvnni(), dotq8_iq4_xs_avxvnni_rows() */

K2X8_KERNEL(dotq8_q2_k_avxvnni, dotq8x4_q2_k_avxvnni, MOE_AVXVNNI, VNNI_DPB_VEX, SUMS32, 0)
/* defines dotq8_q2_k_avxvnni(), dotq8x4_q2_k_avxvnni(), dotq8_q2_k_avxvnni_rows() */

K2X8_KERNEL(dotq8_q3_k_avxvnni, dotq8x4_q3_k_avxvnni, MOE_AVXVNNI, VNNI_DPB_VEX, SUMS32, 1)
/* defines dotq8_q3_k_avxvnni(), dotq8x4_q3_k_avxvnni(), dotq8_q3_k_avxvnni_rows() */

K6X8_KERNEL(dotq8_q6_k_avxvnni, dotq8x4_q6_k_avxvnni, MOE_AVXVNNI, VNNI_DPB_VEX)
/* defines dotq8_q6_k_avxvnni(), dotq8x4_q6_k_avxvnni(), dotq8_q6_k_avxvnni_rows() */

#define DPB_AVXVNNI(u, v) AVXVNNI_DPBUSD(_mm256_setzero_si256(), u, v)

K4_KERNEL(dotq_q4_k_avxvnni, dotq4_q4_k_avxvnni, MOE_AVXVNNI, 0, DPB_AVXVNNI)
/* defines dotq4_q4_k_avxvnni(), dotq_q4_k_avxvnni(), dotq_q4_k_avxvnni_rows() */

K4_KERNEL(dotq_q5_k_avxvnni, dotq4_q5_k_avxvnni, MOE_AVXVNNI, 1, DPB_AVXVNNI)
/* defines dotq4_q5_k_avxvnni(), dotq_q5_k_avxvnni(), dotq_q5_k_avxvnni_rows() */

#undef DPB_AVXVNNI

/* AVX-VNNI (the VEX dpbusd of Intel's client cores without AVX-512): the same kernels, each
 * activation dword broadcast into a register first (VEX has no embedded broadcast), and the
 * weights prefetched into L2 as on the Intel server cores (no AVX-VNNI core measured: the Xeon
 * measured has both sets, bench/RESULTS.md "2026-12-01: the AVX-VNNI kernel level"). */
VNNI_X1_KERNELS(avxvnni, MOE_AVXVNNI, VNNI_DPB_VEX, prefetch_ahead_l2)
/* defines dotq8_mxfp4_avxvnni(), dotq8_q4_0_avxvnni(), dotq8_q8_0_avxvnni() */

VNNI_X4_KERNELS(avxvnni, MOE_AVXVNNI, VNNI_DPB_VEX)
/* defines dotq8x4_mxfp4_avxvnni(), dotq8x4_q4_0_avxvnni(), dotq8x4_q8_0_avxvnni() */

#undef VNNI_DPB_VEX

DOTQ_VNNI_KERNELS(avxvnni, MOE_AVXVNNI, AVXVNNI_DPBUSD)
/* defines dotq_q4_0_avxvnni(), dotq_q8_0_avxvnni() */

/* AVX-VNNI: the same order with dpbusd, which multiplies unsigned by signed bytes: the queries
 * made unsigned (+ 128, one xor), each key's 4 bytes broadcast, and 128 x (the key's byte sum
 * over the part: offs[n]) taken off after: the same integers as the AVX2 part's */
MOE_TARGET(MOE_AVXVNNI) static void scores8_part_avxvnni(const moe__mla_block8 *b, const int8_t *c, const int8_t *qt, int i0, int i1,
                                                         const int32_t *offs, int32_t d[8][8]) {
    const int cw = b->cw;
    const __m256i x80 = _mm256_set1_epi8((char)0x80);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int i = i0; i < i1; i += 4) {
        const __m256i q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(const void *)(qt + (size_t)i * 16)), x80);
#define KEY(n) a##n = AVXVNNI_DPBUSD(a##n, q, _mm256_set1_epi32(*(const int32_t *)(const void *)(c + (size_t)(n) * cw + i)))
        KEY(0), KEY(1), KEY(2), KEY(3), KEY(4), KEY(5), KEY(6), KEY(7);
#undef KEY
    }
#define OUT(n) _mm256_storeu_si256((__m256i *)(void *)d[n], _mm256_sub_epi32(a##n, _mm256_set1_epi32(128 * offs[n])))
    OUT(0), OUT(1), OUT(2), OUT(3), OUT(4), OUT(5), OUT(6), OUT(7);
#undef OUT
}

MLA_SCORES8_256(mla_scores8_avxvnni, MOE_AVXVNNI, scores8_part_avxvnni)
/* defines mla_scores8_avxvnni() */

/* AVX-VNNI: mla_ctx8_vnni's scheme at 256 bits: 4 keys' bytes of one latent value in a 32-bit
 * lane (byte then word unpacks of 4 rows within each 128-bit lane) meet the 4 keys' weights of a
 * head, broadcast; 32 values a slice, 2 heads at a time (8 accumulators: VEX has 16 registers),
 * the integer sums exact, then the reference's float steps */
MOE_TARGET(MOE_AVXVNNI) static void mla_ctx8_avxvnni(const moe__mla_block8 *b, int h0, int h1) {
    const int r = b->r, cw = b->cw, jn = b->jn;
    if (r % 32) { moe__mla_ctx8_ref(b, h0, h1); return; }
    const __m256i zero = _mm256_setzero_si256();
    for (int i = 0; i < r; i += 32)
        for (int h = h0; h < h1; h += 2) {
            const int two = h + 1 < h1; /* a last single head reuses its weights, unstored */
            const uint8_t *p0 = b->w + (size_t)h * b->lw, *p1 = two ? p0 + b->lw : p0;
            __m256i a0 = zero, a1 = zero, a2 = zero, a3 = zero, e0 = zero, e1 = zero, e2 = zero, e3 = zero;
            for (int j = 0; j < jn; j += 4) {
                const int8_t *c = b->cache + (size_t)j * cw + i;
                const __m256i x0 = _mm256_loadu_si256((const __m256i *)(const void *)c);
                const __m256i x1 = j + 1 < jn ? _mm256_loadu_si256((const __m256i *)(const void *)(c + cw)) : zero;
                const __m256i x2 = j + 2 < jn ? _mm256_loadu_si256((const __m256i *)(const void *)(c + 2 * (size_t)cw)) : zero;
                const __m256i x3 = j + 3 < jn ? _mm256_loadu_si256((const __m256i *)(const void *)(c + 3 * (size_t)cw)) : zero;
                const __m256i l01 = _mm256_unpacklo_epi8(x0, x1), h01 = _mm256_unpackhi_epi8(x0, x1);
                const __m256i l23 = _mm256_unpacklo_epi8(x2, x3), h23 = _mm256_unpackhi_epi8(x2, x3);
                const __m256i v0 = _mm256_unpacklo_epi16(l01, l23), v1 = _mm256_unpackhi_epi16(l01, l23);
                const __m256i v2 = _mm256_unpacklo_epi16(h01, h23), v3 = _mm256_unpackhi_epi16(h01, h23);
#define DP4(x, p)                                                                                         \
    do {                                                                                                  \
        const __m256i w_ = _mm256_set1_epi32(*(const int32_t *)(const void *)((p) + j));                  \
        x##0 = AVXVNNI_DPBUSD(x##0, w_, v0), x##1 = AVXVNNI_DPBUSD(x##1, w_, v1);                         \
        x##2 = AVXVNNI_DPBUSD(x##2, w_, v2), x##3 = AVXVNNI_DPBUSD(x##3, w_, v3);                         \
    } while (0)
                DP4(a, p0);
                DP4(e, p1);
#undef DP4
            }
            /* accumulator k's 128-bit lane L holds latent values 16L + 4k .. 16L + 4k + 3 */
#define ADD2(x, hh)                                                                                       \
    do {                                                                                                  \
        float *o_ = b->ctx + (size_t)(hh) * r + i;                                                        \
        const __m256 s_ = _mm256_set1_ps(b->ws[hh]);                                                      \
        const __m256i y_[4] = {_mm256_permute2x128_si256(x##0, x##1, 0x20), _mm256_permute2x128_si256(x##2, x##3, 0x20), \
                               _mm256_permute2x128_si256(x##0, x##1, 0x31), _mm256_permute2x128_si256(x##2, x##3, 0x31)}; \
        for (int q_ = 0; q_ < 4; q_++)                                                                    \
            _mm256_storeu_ps(o_ + 8 * q_, _mm256_add_ps(_mm256_loadu_ps(o_ + 8 * q_), _mm256_mul_ps(s_, _mm256_cvtepi32_ps(y_[q_])))); \
    } while (0)
            ADD2(a, h);
            if (two) ADD2(e, h + 1);
#undef ADD2
        }
}

#endif /* MOE_X86 */

/* =================================================================================================
 * PART 6: AVX-512
 * =================================================================================================
 * The avx512 level (F, BW, VL: float kernels on 16 lanes, KDA's recurrence, MLA attention) and on
 * CPUs with VNNI the avx512vnni level (int8 products by VPDPBUSD, two interleaved groups a call
 * for decode and 4 or 16 activation rows for prefill), with the AVX512_BF16 attention kernels
 * where the CPU has them. Builds on avxvnni where the CPU has it, else on avx2. */

#ifdef MOE_X86

#define DPB_AVX512VNNI(u, v) _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, v)

K4_KERNEL(dotq_q4_k_vnni, dotq4_q4_k_vnni, "avx2,fma,f16c,avx512f,avx512vl,avx512vnni", 0, DPB_AVX512VNNI)
/* defines dotq4_q4_k_vnni(), dotq_q4_k_vnni(), dotq_q4_k_vnni_rows() */

K4_KERNEL(dotq_q5_k_vnni, dotq4_q5_k_vnni, "avx2,fma,f16c,avx512f,avx512vl,avx512vnni", 1, DPB_AVX512VNNI)
/* defines dotq4_q5_k_vnni(), dotq_q5_k_vnni(), dotq_q5_k_vnni_rows() */

#undef DPB_AVX512VNNI

/* x8 groups, AVX-512 VNNI: dpbusd does maddubs + madd + add in one instruction and cannot
 * saturate, so every format uses the unsigned form and subtracts off * sum(x) */
/* acc += dpbusd(u, the activation dword at p in every 32-bit lane): the instruction broadcasts the
 * dword from memory itself ({1to8}, {1to16}). GCC 12 loads it with a separate broadcast instead,
 * one more instruction per dpbusd: with the broadcast folded the 1-row Q4_0 kernel ran 12% faster
 * from L2 on one Zen 4 core (bench/RESULTS.md, "2026-12-01: on Intel the decode kernels prefetch
 * into L2"). AT&T and Intel operand orders. */
#define VNNI_DPB_BCST(acc, u, p, n) \
    __asm__("vpdpbusd {%2%{1to" n "%}, %1, %0|%0, %1, %2%{1to" n "%}}" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)(p)))

#define VNNI_DPB_256(acc, u, p) VNNI_DPB_BCST(acc, u, p, "8")

#define VNNI_DPB_512(acc, u, p) VNNI_DPB_BCST(acc, u, p, "16")

/* Q4_KX8 on the VNNI levels: the activation bytes broadcast from memory by the dpbusd itself
 * (EVEX) or by a broadcast before it (VEX) */
K4X8_KERNEL(dotq8_q4_k_vnni, MOE_VNNI, VNNI_DPB_256, SUMS32, moe__block_q4_kx8, 0, qs)
/* defines dotq8_q4_k_vnni() */

K4X8X4_KERNEL(dotq8x4_q4_k_vnni, MOE_VNNI, VNNI_DPB_256, SUMS32, moe__block_q4_kx8, 0, qs)
/* defines dotq8x4_q4_k_vnni() */

K4X8_KERNEL(dotq8_q5_k_vnni, MOE_VNNI, VNNI_DPB_256, SUMS32, moe__block_q5_kx8, 1, qh)
/* defines dotq8_q5_k_vnni() */

K4X8X4_KERNEL(dotq8x4_q5_k_vnni, MOE_VNNI, VNNI_DPB_256, SUMS32, moe__block_q5_kx8, 1, qh)
/* defines dotq8x4_q5_k_vnni() */

IQ4X8_KERNEL(dotq8_iq4_xs_vnni, dotq8x4_iq4_xs_vnni, MOE_VNNI, VNNI_DPB_256, 128)
/* defines dotq8_iq4_xs_vnni(), dotq8x4_iq4_xs_vnni(), dotq8_iq4_xs_vnni_rows() */

K2X8_KERNEL(dotq8_q2_k_vnni, dotq8x4_q2_k_vnni, MOE_VNNI, VNNI_DPB_256, SUMS32, 0)
/* defines dotq8_q2_k_vnni(), dotq8x4_q2_k_vnni(), dotq8_q2_k_vnni_rows() */

K2X8_KERNEL(dotq8_q3_k_vnni, dotq8x4_q3_k_vnni, MOE_VNNI, VNNI_DPB_256, SUMS32, 1)
/* defines dotq8_q3_k_vnni(), dotq8x4_q3_k_vnni(), dotq8_q3_k_vnni_rows() */

K6X8_KERNEL(dotq8_q6_k_vnni, dotq8x4_q6_k_vnni, MOE_VNNI, VNNI_DPB_256)
/* defines dotq8_q6_k_vnni(), dotq8x4_q6_k_vnni(), dotq8_q6_k_vnni_rows() */

#define NO_PREFETCH(p, bytes) ((void)(p), (void)(bytes))

VNNI_X1_KERNELS(vnni, MOE_VNNI, VNNI_DPB_256, prefetch_ahead)
/* defines dotq8_mxfp4_vnni(), dotq8_q4_0_vnni(), dotq8_q8_0_vnni() */

VNNI_X1_KERNELS(vnni_l2, MOE_VNNI, VNNI_DPB_256, prefetch_ahead_l2)
/* defines dotq8_mxfp4_vnni_l2(), dotq8_q4_0_vnni_l2(), dotq8_q8_0_vnni_l2() */

VNNI_X1_KERNELS(vnni_hw, MOE_VNNI, VNNI_DPB_256, NO_PREFETCH)
/* defines dotq8_mxfp4_vnni_hw(), dotq8_q4_0_vnni_hw(), dotq8_q8_0_vnni_hw() */

#undef NO_PREFETCH

VNNI_X4_KERNELS(vnni, MOE_VNNI, VNNI_DPB_256)
/* defines dotq8x4_mxfp4_vnni(), dotq8x4_q4_0_vnni(), dotq8x4_q8_0_vnni() */

/* Two adjacent x8 groups (16 weight rows) times 4 activation rows in 512-bit registers: group A in
 * the low half of each register, B in the high half, so one dpbusd serves both groups. Each
 * lane does what the 256-bit kernel's lane does (same integer sums, same float operations), so
 * every output is bit for bit the level's dotq8: out[t * 16 + i], rows 0-7 of A then 0-7 of B. */
#define VNNI_X4X2_STORE()                                                                                          \
    _mm512_storeu_ps(out, _mm512_add_ps(a00, a01)), _mm512_storeu_ps(out + 16, _mm512_add_ps(a10, a11)),          \
        _mm512_storeu_ps(out + 32, _mm512_add_ps(a20, a21)), _mm512_storeu_ps(out + 48, _mm512_add_ps(a30, a31))

/* as VNNI_X4_NIBBLE_CHUNKS for the two groups, A in the low halves and B in the high */
#define VNNI_X4X2_NIBBLE_CHUNKS(DEC)                                                                               \
    const __m512i v0 = PAIR256(oa[b].qs, ob[b].qs), v1 = PAIR256(oa[b].qs + 32, ob[b].qs + 32);                    \
    const __m512i v2 = PAIR256(oa[b].qs + 64, ob[b].qs + 64), v3 = PAIR256(oa[b].qs + 96, ob[b].qs + 96);          \
    const __m512i u0 = DEC(v0), u4 = DEC(_mm512_srli_epi16(v0, 4)), u1 = DEC(v1), u5 = DEC(_mm512_srli_epi16(v1, 4)); \
    const __m512i u2 = DEC(v2), u6 = DEC(_mm512_srli_epi16(v2, 4)), u3 = DEC(v3), u7 = DEC(_mm512_srli_epi16(v3, 4))

MOE_TARGET("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni") static void dotq8x4x2_q4_0_vnni(const void *w, const moe__block_q8a *x, int64_t xs, int64_t n, float *out) {
    const moe__block_q4_0x8 *oa = w, *ob = oa + n / 32;
    const __m512i m4 = _mm512_set1_epi8(15);
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    for (int64_t b = 0; b < n / 32; b++) {
        prefetch_ahead(oa + b, sizeof *oa);
        prefetch_ahead(ob + b, sizeof *ob);
#define NIBBLES(v) _mm512_and_si512(v, m4)
        VNNI_X4X2_NIBBLE_CHUNKS(NIBBLES);
#undef NIBBLES
        const __m512 dw = PAIR_F16(oa[b].d, ob[b].d);
        VNNI_ROWS4(512, VNNI_DPB_512, -8);
    }
    VNNI_X4X2_STORE();
}

MOE_TARGET("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni") static void dotq8x4x2_q8_0_vnni(const void *w, const moe__block_q8a *x, int64_t xs, int64_t n, float *out) {
    const moe__block_q8_0x8 *oa = w, *ob = oa + n / 32;
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    for (int64_t b = 0; b < n / 32; b++) {
        prefetch_ahead(oa + b, sizeof *oa);
        prefetch_ahead(ob + b, sizeof *ob);
#define QV(c) PAIR256(oa[b].qs + 32 * (c), ob[b].qs + 32 * (c))
        const __m512i u0 = QV(0), u1 = QV(1), u2 = QV(2), u3 = QV(3), u4 = QV(4), u5 = QV(5), u6 = QV(6), u7 = QV(7);
#undef QV
        const __m512 dw = PAIR_F16(oa[b].d, ob[b].d);
        VNNI_ROWS4(512, VNNI_DPB_512, -128);
    }
    VNNI_X4X2_STORE();
}

MOE_TARGET("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni") static void dotq8x4x2_mxfp4_vnni(const void *w, const moe__block_q8a *x, int64_t xs, int64_t n, float *out) {
    const moe__block_mxfp4x8 *oa = w, *ob = oa + n / 32;
    const __m512i m4 = _mm512_set1_epi8(15), lut = _mm512_broadcast_i32x4(_mm256_castsi256_si128(mxfp4x8_lut_avx2()));
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    for (int64_t b = 0; b < n / 32; b++) {
        prefetch_ahead(oa + b, sizeof *oa);
        prefetch_ahead(ob + b, sizeof *ob);
#define CODES(v) _mm512_shuffle_epi8(lut, _mm512_and_si512(v, m4))
        VNNI_X4X2_NIBBLE_CHUNKS(CODES);
#undef CODES
        const __m512 dw = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(mxfp4x8_scales_avx2(oa[b].e))),
                                                              _mm256_castps_pd(mxfp4x8_scales_avx2(ob[b].e)), 1));
        VNNI_ROWS4(512, VNNI_DPB_512, -12);
    }
    VNNI_X4X2_STORE();
}

/* a two-group kernel's entry points from name##_rows: 4 activation rows (prefill) and 1 (decode,
 * where one group a call streams these formats below the memory's speed: name##_rows prefetches
 * each group 8 KB ahead into L2 then) */
#define X4X2_FORMS(name, name1)                                                                                    \
    MOE_TARGET("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni") static void name(const void *w, const moe__block_q8a *x, int64_t xs, int64_t n, float *out) { \
        name##_rows(w, x, xs, n, out, 4);                                                                          \
    }                                                                                                              \
    MOE_TARGET("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni") static void name1(const void *w, const moe__block_q8a *x, int64_t n, float *out) { \
        name##_rows(w, x, 0, n, out, 1);                                                                           \
    }

/* Q4_KX8 and Q5_KX8, two adjacent groups (16 rows) times NT (4 or 1) activation rows in 512-bit registers,
 * group A in the low half and B in the high half: each lane takes the 4-row kernel's steps
 * (K4X8X4_KERNEL: the same integer sums, scales, float operations and final order of sums), so
 * out[t * 16 + i] is bit for bit the level's dotq8 for row i of A (i < 8) or B */
/* the two groups' 8 bytes at pa and pb as one 16-byte vector */
#define PAIR64(pa, pb) _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(const void *)(pa)), _mm_loadl_epi64((const __m128i *)(const void *)(pb)))

/* the two groups' 8 unsigned bytes at pa and pb as 16 floats */
#define PAIR_U8(pa, pb) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(PAIR64(pa, pb)))

/* the lane sums of the 8 sub-block accumulators in sum8_hsum_order_avx2's order */
#define SUM8_HSUM_ORDER_512(a)                                                                                     \
    _mm512_add_ps(_mm512_add_ps(_mm512_add_ps((a)[0], (a)[4]), _mm512_add_ps((a)[2], (a)[6])),                      \
                  _mm512_add_ps(_mm512_add_ps((a)[1], (a)[5]), _mm512_add_ps((a)[3], (a)[7])))

#define K4X8X4X2_KERNEL(name, name1, BLK, FIVE)                                                                           \
    MOE_TARGET("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni") static inline __attribute__((always_inline)) void name##_rows(const void *w, const moe__block_q8a *x, int64_t xs, int64_t n, float *out, const int NT) { \
        const BLK *oa = w, *ob = oa + n / 256;                                                                     \
        const __m512i m4 = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1);                                        \
        (void)one;                                                                                                 \
        __m512 acc[4][8];                                                                                          \
        for (int t = 0; t < NT; t++)                                                                               \
            for (int j = 0; j < 8; j++) acc[t][j] = _mm512_setzero_ps();                                           \
        for (int64_t i = 0; i < n / 256; i++) {                                                                    \
            const BLK *a = oa + i, *b = ob + i;                                                                    \
            const __m512 d = PAIR_F16(a->d, b->d), dm = PAIR_F16(a->dmin, b->dmin);                                \
            if (NT == 1) prefetch_ahead_l2(a, sizeof *a), prefetch_ahead_l2(b, sizeof *b);                                \
            MOE_UNROLL4 for (int p = 0; p < 4; p++) {                                                              \
                __m512i s[4][2];                                                                                   \
                MOE_UNROLL4 for (int t = 0; t < NT; t++) s[t][0] = s[t][1] = _mm512_setzero_si512();                \
                MOE_UNROLL8 for (int c = 0; c < 8; c++) {                                                          \
                    const __m512i v = PAIR256(a->qs + p * 256 + 32 * c, b->qs + p * 256 + 32 * c);                 \
                    __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);      \
                    if (FIVE) {                                                                                    \
                        const __m512i hb = PAIR256(((const moe__block_q5_kx8 *)(const void *)a)->qh + 32 * c,      \
                                                   ((const moe__block_q5_kx8 *)(const void *)b)->qh + 32 * c);     \
                        lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 2 * p), one), 4)); \
                        hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 2 * p + 1), one), 4)); \
                    }                                                                                              \
                    MOE_UNROLL4 for (int t = 0; t < NT; t++) {                                                     \
                        const moe__block_q8a *xt = x + t * xs + 8 * i;                                             \
                        VNNI_DPB_512(s[t][0], lo, xt[2 * p].qs + 4 * c);                                           \
                        VNNI_DPB_512(s[t][1], hi, xt[2 * p + 1].qs + 4 * c);                                       \
                    }                                                                                              \
                }                                                                                                  \
                MOE_UNROLL4 for (int h = 0; h < 2; h++) {                                                          \
                    const int j = 2 * p + h;                                                                       \
                    const __m512 sc = _mm512_mul_ps(PAIR_U8(a->sc[j], b->sc[j]), d);                               \
                    const __m512 mn = _mm512_mul_ps(PAIR_U8(a->m[j], b->m[j]), dm);                                \
                    MOE_UNROLL4 for (int t = 0; t < NT; t++) {                                                     \
                        const moe__block_q8a *xj = x + t * xs + 8 * i + j;                                         \
                        const __m512 tt = _mm512_fmsub_ps(sc, _mm512_cvtepi32_ps(s[t][h]), _mm512_mul_ps(mn, _mm512_set1_ps((float)xj->sum))); \
                        acc[t][j] = _mm512_fmadd_ps(_mm512_set1_ps(xj->d), tt, acc[t][j]);                         \
                    }                                                                                              \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
        for (int t = 0; t < NT; t++) _mm512_storeu_ps(out + 16 * t, SUM8_HSUM_ORDER_512(acc[t]));                 \
    }                                                                                                              \
    X4X2_FORMS(name, name1)

K4X8X4X2_KERNEL(dotq8x4x2_q4_k_vnni, dotq8x2_q4_k_vnni, moe__block_q4_kx8, 0)
/* defines dotq8x2_q4_k_vnni(), dotq8x4x2_q4_k_vnni(), dotq8x4x2_q4_k_vnni_rows() */

K4X8X4X2_KERNEL(dotq8x4x2_q5_k_vnni, dotq8x2_q5_k_vnni, moe__block_q5_kx8, 1)
/* defines dotq8x2_q5_k_vnni(), dotq8x4x2_q5_k_vnni(), dotq8x4x2_q5_k_vnni_rows() */

/* IQ4_XSX8 likewise, each lane the steps of IQ4X8_KERNEL's 4-row form (levels + 128 as unsigned
 * bytes, 128 sum(x) taken off, times ls - 32 by mullo, then the float steps) */
MOE_TARGET("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni") static inline __attribute__((always_inline)) void dotq8x4x2_iq4_xs_vnni_rows(const void *w, const moe__block_q8a *x, int64_t xs,
                                                                                                   int64_t n, float *out, const int NT) {
    const moe__block_iq4_xsx8 *oa = w, *ob = oa + n / 256;
    const __m512i m4 = _mm512_set1_epi8(15);
    const __m512i kv = _mm512_add_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(const void *)moe__iq4nl_values)), _mm512_set1_epi8((char)128));
    __m512 acc[4][8];
    for (int t = 0; t < NT; t++)
        for (int j = 0; j < 8; j++) acc[t][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n / 256; i++) {
        const moe__block_iq4_xsx8 *a = oa + i, *b = ob + i;
        if (NT == 1) prefetch_ahead_l2(a, sizeof *a), prefetch_ahead_l2(b, sizeof *b);
        const __m512 d = PAIR_F16(a->d, b->d);
        MOE_UNROLL4 for (int p = 0; p < 4; p++) {
            __m512i s[4][2];
            MOE_UNROLL4 for (int t = 0; t < NT; t++) s[t][0] = s[t][1] = _mm512_setzero_si512();
            MOE_UNROLL8 for (int c = 0; c < 8; c++) {
                const __m512i v = PAIR256(a->qs + p * 256 + 32 * c, b->qs + p * 256 + 32 * c);
                const __m512i lo = _mm512_shuffle_epi8(kv, _mm512_and_si512(v, m4));
                const __m512i hi = _mm512_shuffle_epi8(kv, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
                MOE_UNROLL4 for (int t = 0; t < NT; t++) {
                    VNNI_DPB_512(s[t][0], lo, x[t * xs + 8 * i + 2 * p].qs + 4 * c);
                    VNNI_DPB_512(s[t][1], hi, x[t * xs + 8 * i + 2 * p + 1].qs + 4 * c);
                }
            }
            MOE_UNROLL4 for (int h = 0; h < 2; h++) {
                const int j = 2 * p + h;
                const __m512i sc = _mm512_cvtepi8_epi32(PAIR64(a->sc[j], b->sc[j]));
                MOE_UNROLL4 for (int t = 0; t < NT; t++) {
                    const moe__block_q8a *xb = &x[t * xs + 8 * i + j];
                    const __m512i dot = _mm512_sub_epi32(s[t][h], _mm512_set1_epi32(128 * xb->sum));
                    acc[t][j] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(xb->d), d), _mm512_cvtepi32_ps(_mm512_mullo_epi32(dot, sc)), acc[t][j]);
                }
            }
        }
    }
    for (int t = 0; t < NT; t++) _mm512_storeu_ps(out + 16 * t, SUM8_HSUM_ORDER_512(acc[t]));
}

X4X2_FORMS(dotq8x4x2_iq4_xs_vnni, dotq8x2_iq4_xs_vnni)
/* defines dotq8x2_iq4_xs_vnni(), dotq8x4x2_iq4_xs_vnni() */

/* Q2_KX8 and Q3_KX8 likewise, each lane the steps of K2X8_KERNEL's 4-row form */
#define K2X8X4X2_KERNEL(name, name1, THREE)                                                                        \
    MOE_TARGET("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni") static inline __attribute__((always_inline)) void name##_rows(const void *w, const moe__block_q8a *x, int64_t xs, int64_t n, float *out, const int NT) { \
        const moe__block_q2_kx8 *a2 = w, *b2 = a2 + n / 256;                                                       \
        const moe__block_q3_kx8 *a3 = w, *b3 = a3 + n / 256;                                                       \
        const __m512i m3 = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4), m15 = _mm512_set1_epi32(15);            \
        (void)four, (void)m15;                                                                                     \
        __m512 acc[4][8];                                                                                          \
        for (int t = 0; t < 4; t++)                                                                                \
            for (int j = 0; j < 8; j++) acc[t][j] = _mm512_setzero_ps();                                           \
        for (int64_t i = 0; i < n / 256; i++) {                                                                    \
            const uint8_t *qa = THREE ? a3[i].qs : a2[i].qs, *qb = THREE ? b3[i].qs : b2[i].qs;                    \
            const __m512 d = THREE ? PAIR_F16(a3[i].d, b3[i].d) : PAIR_F16(a2[i].d, b2[i].d);                      \
            if (NT == 1) {                                                                                         \
                if (THREE) prefetch_ahead_l2(a3 + i, sizeof *a3), prefetch_ahead_l2(b3 + i, sizeof *b3);           \
                else prefetch_ahead_l2(a2 + i, sizeof *a2), prefetch_ahead_l2(b2 + i, sizeof *b2);                 \
            }                                                                                                      \
            const __m512 dmin = THREE ? d : PAIR_F16(a2[i].dmin, b2[i].dmin);                                      \
            MOE_UNROLL8 for (int j = 0; j < 8; j++) {                                                              \
                __m512i s[4][2];                                                                                   \
                MOE_UNROLL4 for (int t = 0; t < NT; t++) s[t][0] = s[t][1] = _mm512_setzero_si512();                \
                MOE_UNROLL8 for (int c = 0; c < 8; c++) {                                                          \
                    const int at = 256 * (j / 4) + 32 * c;                                                         \
                    __m512i v = _mm512_and_si512(_mm512_srli_epi16(PAIR256(qa + at, qb + at), 2 * (j % 4)), m3);   \
                    if (THREE) { /* bit j of the hmask byte to bit 2 */                                            \
                        const __m512i hm = PAIR256(a3[i].hm + 32 * c, b3[i].hm + 32 * c);                          \
                        v = _mm512_or_si512(v, _mm512_and_si512(j < 2 ? _mm512_slli_epi16(hm, 2 - j) : j > 2 ? _mm512_srli_epi16(hm, j - 2) : hm, four)); \
                    }                                                                                              \
                    MOE_UNROLL4 for (int t = 0; t < NT; t++) VNNI_DPB_512(s[t][c / 4], v, x[t * xs + 8 * i + j].qs + 4 * c); \
                }                                                                                                  \
                __m512i sc0, sc1, mn0 = _mm512_setzero_si512(), mn1 = mn0;                                         \
                if (THREE) {                                                                                       \
                    sc0 = _mm512_cvtepi8_epi32(PAIR64(a3[i].sc[2 * j], b3[i].sc[2 * j]));                          \
                    sc1 = _mm512_cvtepi8_epi32(PAIR64(a3[i].sc[2 * j + 1], b3[i].sc[2 * j + 1]));                  \
                } else {                                                                                           \
                    const __m512i e0 = _mm512_cvtepu8_epi32(PAIR64(a2[i].sc[2 * j], b2[i].sc[2 * j]));             \
                    const __m512i e1 = _mm512_cvtepu8_epi32(PAIR64(a2[i].sc[2 * j + 1], b2[i].sc[2 * j + 1]));     \
                    sc0 = _mm512_and_si512(e0, m15), sc1 = _mm512_and_si512(e1, m15);                              \
                    mn0 = _mm512_srli_epi32(e0, 4), mn1 = _mm512_srli_epi32(e1, 4);                                \
                }                                                                                                  \
                MOE_UNROLL4 for (int t = 0; t < NT; t++) {                                                         \
                    const moe__block_q8a *xb = &x[t * xs + 8 * i + j];                                             \
                    const int h0 = sum16_i8(xb->qs), h1 = xb->sum - h0;                                            \
                    __m512i e0 = s[t][0], e1 = s[t][1];                                                            \
                    if (THREE) e0 = _mm512_sub_epi32(e0, _mm512_set1_epi32(4 * h0)), e1 = _mm512_sub_epi32(e1, _mm512_set1_epi32(4 * h1)); \
                    const __m512i S = _mm512_add_epi32(_mm512_mullo_epi32(e0, sc0), _mm512_mullo_epi32(e1, sc1));  \
                    if (THREE) {                                                                                   \
                        acc[t][j] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(xb->d), d), _mm512_cvtepi32_ps(S), acc[t][j]); \
                    } else {                                                                                       \
                        const __m512i Sm = _mm512_add_epi32(_mm512_mullo_epi32(mn0, _mm512_set1_epi32(h0)), _mm512_mullo_epi32(mn1, _mm512_set1_epi32(h1))); \
                        acc[t][j] = _mm512_fmadd_ps(_mm512_set1_ps(xb->d), _mm512_fmsub_ps(d, _mm512_cvtepi32_ps(S), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(Sm))), acc[t][j]); \
                    }                                                                                              \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
        MOE_UNROLL4 for (int t = 0; t < NT; t++) _mm512_storeu_ps(out + 16 * t, SUM8_HSUM_ORDER_512(acc[t]));      \
    }                                                                                                              \
    X4X2_FORMS(name, name1)

K2X8X4X2_KERNEL(dotq8x4x2_q2_k_vnni, dotq8x2_q2_k_vnni, 0)
/* defines dotq8x2_q2_k_vnni(), dotq8x4x2_q2_k_vnni(), dotq8x4x2_q2_k_vnni_rows() */

K2X8X4X2_KERNEL(dotq8x4x2_q3_k_vnni, dotq8x2_q3_k_vnni, 1)
/* defines dotq8x2_q3_k_vnni(), dotq8x4x2_q3_k_vnni(), dotq8x4x2_q3_k_vnni_rows() */

#undef K2X8X4X2_KERNEL

/* Q6_KX8 likewise, each lane the steps of K6X8_KERNEL's 4-row form (one sub-block a pass; 6-bit
 * values as unsigned bytes, 32 sum(x) over each 16 taken off, times the 16s' scales by mullo, then
 * the float steps) */
MOE_TARGET("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni") static void dotq8x4x2_q6_k_vnni(const void *w, const moe__block_q8a *x, int64_t xs,
                                                                                                 int64_t n, float *out) {
    const moe__block_q6_kx8 *oa = w, *ob = oa + n / 256;
    const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
    __m512 acc[4][8];
    for (int t = 0; t < 4; t++)
        for (int j = 0; j < 8; j++) acc[t][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n / 256; i++) {
        const moe__block_q6_kx8 *a = oa + i, *b = ob + i;
        const __m512 d = PAIR_F16(a->d, b->d);
        MOE_UNROLL4 for (int h = 0; h < 2; h++)
            MOE_UNROLL4 for (int k = 0; k < 4; k++) {
                const int j = 4 * h + k;
                __m512i s[4][2];
                MOE_UNROLL4 for (int t = 0; t < 4; t++) s[t][0] = s[t][1] = _mm512_setzero_si512();
                MOE_UNROLL8 for (int c = 0; c < 8; c++) {
                    const __m512i qh = PAIR256(a->qh + 256 * h + 32 * c, b->qh + 256 * h + 32 * c);
                    const __m512i l = PAIR256(a->ql + 512 * h + 256 * (k & 1) + 32 * c, b->ql + 512 * h + 256 * (k & 1) + 32 * c);
                    const __m512i lo = _mm512_and_si512(k < 2 ? l : _mm512_srli_epi16(l, 4), m4);
                    const __m512i hi = k == 0 ? _mm512_slli_epi16(qh, 4) : k == 1 ? _mm512_slli_epi16(qh, 2) : k == 2 ? qh : _mm512_srli_epi16(qh, 2);
                    const __m512i v = _mm512_or_si512(lo, _mm512_and_si512(hi, m30));
                    MOE_UNROLL4 for (int t = 0; t < 4; t++) VNNI_DPB_512(s[t][c / 4], v, x[t * xs + 8 * i + j].qs + 4 * c);
                }
                const __m512i sc0 = _mm512_cvtepi8_epi32(PAIR64(a->sc[2 * j], b->sc[2 * j]));
                const __m512i sc1 = _mm512_cvtepi8_epi32(PAIR64(a->sc[2 * j + 1], b->sc[2 * j + 1]));
                MOE_UNROLL4 for (int t = 0; t < 4; t++) {
                    const moe__block_q8a *xb = &x[t * xs + 8 * i + j];
                    const int h0 = sum16_i8(xb->qs), h1 = xb->sum - h0;
                    const __m512i a0 = _mm512_sub_epi32(s[t][0], _mm512_set1_epi32(32 * h0));
                    const __m512i a1 = _mm512_sub_epi32(s[t][1], _mm512_set1_epi32(32 * h1));
                    const __m512i S = _mm512_add_epi32(_mm512_mullo_epi32(a0, sc0), _mm512_mullo_epi32(a1, sc1));
                    acc[t][j] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(xb->d), d), _mm512_cvtepi32_ps(S), acc[t][j]);
                }
            }
    }
    for (int t = 0; t < 4; t++) _mm512_storeu_ps(out + 16 * t, SUM8_HSUM_ORDER_512(acc[t]));
}

#undef K4X8X4X2_KERNEL

#undef SUM8_HSUM_ORDER_512

#undef PAIR_U8

#undef PAIR64

#undef VNNI_DPB_256

#undef VNNI_DPB_512

#undef VNNI_DPB_BCST

#undef VNNI_X4X2_STORE

#undef VNNI_X4X2_NIBBLE_CHUNKS

MOE_TARGET(MOE_AVX512) static float dot_f32_avx512(const void *w, const uint8_t *sc, const float *x, int64_t n) {
    (void)sc;
    const float *p = w;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        prefetch_ahead(p + i, 128);
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(p + i), _mm512_loadu_ps(x + i), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(p + i + 16), _mm512_loadu_ps(x + i + 16), a1);
    }
    if (i + 16 <= n) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(p + i), _mm512_loadu_ps(x + i), a0), i += 16;
    float s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    for (; i < n; i++) s += p[i] * x[i];
    return s;
}

MOE_TARGET(MOE_AVX512) static inline __m512 load_bf16_avx512(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* the sums of four vectors' lanes, [sum a, sum b, sum c, sum d]: 13 instructions, against 32
 * for four separate reductions */
MOE_TARGET(MOE_AVX512) static inline __m128 hsum4_avx512(__m512 a, __m512 b, __m512 c, __m512 d) {
#define HALVES(x) _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)))
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(HALVES(a), HALVES(b)), _mm256_hadd_ps(HALVES(c), HALVES(d)));
#undef HALVES
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

MOE_TARGET(MOE_AVX512) static float dot_bf16_avx512(const void *w, const uint8_t *sc, const float *x, int64_t n) {
    (void)sc;
    const uint16_t *p = w;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        prefetch_ahead(p + i, 64);
        a0 = _mm512_fmadd_ps(load_bf16_avx512(p + i), _mm512_loadu_ps(x + i), a0);
        a1 = _mm512_fmadd_ps(load_bf16_avx512(p + i + 16), _mm512_loadu_ps(x + i + 16), a1);
    }
    if (i + 16 <= n) a0 = _mm512_fmadd_ps(load_bf16_avx512(p + i), _mm512_loadu_ps(x + i), a0), i += 16;
    float s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    for (; i < n; i++) s += moe__bf16_to_f32(p[i]) * x[i];
    return s;
}

/* Matrix tiles for prefill (moe__gemm_ref): 4 weight rows x 4 activation rows in 16
 * accumulators, each step's 8 loads feeding 16 FMAs (a row-by-row dot product loads both
 * operands for every FMA). Every output, in a tile or not, is one 16-lane sum over K in the same
 * order, reduced by hsum4: the results do not depend on how the rows fall into tiles. */
#define GEMM_TILE_STEP(LW, LX)                                                                                   \
    do {                                                                                                         \
        const __m512 x0_ = LX(x0 + k), x1_ = LX(x1 + k), x2_ = LX(x2 + k), x3_ = LX(x3 + k);                     \
        __m512 w_ = LW(w0 + k);                                                                                  \
        t00 = _mm512_fmadd_ps(w_, x0_, t00), t01 = _mm512_fmadd_ps(w_, x1_, t01), t02 = _mm512_fmadd_ps(w_, x2_, t02), t03 = _mm512_fmadd_ps(w_, x3_, t03); \
        w_ = LW(w1 + k);                                                                                         \
        t10 = _mm512_fmadd_ps(w_, x0_, t10), t11 = _mm512_fmadd_ps(w_, x1_, t11), t12 = _mm512_fmadd_ps(w_, x2_, t12), t13 = _mm512_fmadd_ps(w_, x3_, t13); \
        w_ = LW(w2 + k);                                                                                         \
        t20 = _mm512_fmadd_ps(w_, x0_, t20), t21 = _mm512_fmadd_ps(w_, x1_, t21), t22 = _mm512_fmadd_ps(w_, x2_, t22), t23 = _mm512_fmadd_ps(w_, x3_, t23); \
        w_ = LW(w3 + k);                                                                                         \
        t30 = _mm512_fmadd_ps(w_, x0_, t30), t31 = _mm512_fmadd_ps(w_, x1_, t31), t32 = _mm512_fmadd_ps(w_, x2_, t32), t33 = _mm512_fmadd_ps(w_, x3_, t33); \
    } while (0)

/* the kernel for weights of element WT, loaded as 16 floats by LW (LWM: masked) */
#define GEMM_AVX512(NAME, WT, LW, LWM)                                                                           \
    MOE_TARGET(MOE_AVX512) static void NAME(const void *wv, int64_t ldw, int nr, const float *x, int64_t ldx, int nt, int64_t K, float *y, int64_t ldy) { \
        const WT *w = wv;                                                                                        \
        const int64_t full = K / 16 * 16;                                                                        \
        const __mmask16 tail = (__mmask16)((1u << (K - full)) - 1);                                              \
        for (int tb = 0; tb < nt; tb += gemm_token_block(K))                                                    \
        for (int i = 0; i < nr; i += 4) {                                                                        \
            const int ri = nr - i < 4 ? nr - i : 4, te = nt - tb < gemm_token_block(K) ? nt : tb + gemm_token_block(K); \
            for (int t = tb; t < te; t += 4) {                                                                   \
                const int tj = te - t < 4 ? te - t : 4;                                                          \
                /* a partial tile repeats its last row / token (computed, not stored) */                         \
                const WT *w0 = w + (int64_t)i * ldw, *w1 = w0 + (ri > 1 ? ldw : 0), *w2 = w0 + (ri > 2 ? 2 * ldw : 0), *w3 = w0 + (ri > 3 ? 3 * ldw : 0); \
                const float *x0 = x + (int64_t)t * ldx, *x1 = x0 + (tj > 1 ? ldx : 0), *x2 = x0 + (tj > 2 ? 2 * ldx : 0), *x3 = x0 + (tj > 3 ? 3 * ldx : 0); \
                __m512 t00 = _mm512_setzero_ps(), t01 = t00, t02 = t00, t03 = t00, t10 = t00, t11 = t00, t12 = t00, t13 = t00; \
                __m512 t20 = t00, t21 = t00, t22 = t00, t23 = t00, t30 = t00, t31 = t00, t32 = t00, t33 = t00;   \
                int64_t k = 0;                                                                                   \
                for (; k < full; k += 16) GEMM_TILE_STEP(LW, _mm512_loadu_ps);                                   \
                if (k < K) GEMM_TILE_STEP(LWM, GEMM_LXM);                                                        \
                const __m128 c_[4] = {hsum4_avx512(t00, t10, t20, t30), hsum4_avx512(t01, t11, t21, t31),              \
                                hsum4_avx512(t02, t12, t22, t32), hsum4_avx512(t03, t13, t23, t33)};              \
                for (int b = 0; b < tj; b++) {                                                                   \
                    float o_[4];                                                                                 \
                    _mm_storeu_ps(o_, c_[b]);                                                                    \
                    memcpy(y + (int64_t)(t + b) * ldy + i, o_, sizeof(float) * (size_t)ri);                      \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
    }

#define GEMM_LXM(p) _mm512_maskz_loadu_ps(tail, p)

#define LW_F32(p) _mm512_loadu_ps(p)

#define LWM_F32(p) _mm512_maskz_loadu_ps(tail, p)

#define LW_BF16(p) load_bf16_avx512(p)

#define LWM_BF16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(tail, p)), 16))

GEMM_AVX512(gemm_f32_avx512, float, LW_F32, LWM_F32)
/* defines gemm_f32_avx512() */

GEMM_AVX512(gemm_bf16_avx512, uint16_t, LW_BF16, LWM_BF16)
/* defines gemm_bf16_avx512() */

#undef GEMM_LXM

#undef LW_F32

#undef LWM_F32

#undef LW_BF16

#undef LWM_BF16

#undef GEMM_AVX512

#undef GEMM_TILE_STEP

/* MXFP4 times float activations, both layouts, 1 or 4 rows a pass. A block's 16 code bytes are
 * widened to 16 lanes; one 16-entry table lookup (vpermps reads an index's low 4 bits) gives the
 * E2M1 values of the low nibbles, a second after a shift those of the high nibbles. The
 * activations they meet: compressed-tensors packs columns 2j and 2j + 1 in byte j, so the
 * block's 32 activations are split into even and odd columns once for every row of the pass;
 * ggml packs columns j and j + 16, the block's two halves as they are. A row's block sum
 * (low . first + high . second) is scaled by the block's power of two into its accumulator:
 * the 4-row kernels give each row's dot bit for bit (the same operations per row). */
typedef struct {
    const uint8_t *codes, *scales; /* row r's block b: codes + r rs + b cs (16 bytes), its scale scales + r rss + b ss */
    int64_t rs, cs, rss, ss;
    int even_odd; /* compressed-tensors: columns 2j, 2j + 1 in byte j */
} mxfp4_rows;

MOE_TARGET(MOE_AVX512) static inline __m512 mxfp4_row_block_avx512(const mxfp4_rows *w, int r, int64_t b, __m512 lut, __m512 xa, __m512 xb,
                                                                 __m512 acc) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w->codes + r * w->rs + b * w->cs)));
    __m512 s = _mm512_mul_ps(_mm512_permutexvar_ps(c, lut), xa);
    s = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), lut), xb, s);
    const __m512 scale = _mm512_castsi512_ps(_mm512_set1_epi32((int)e8m0_bits[w->scales[r * w->rss + b * w->ss]]));
    return _mm512_fmadd_ps(s, scale, acc);
}

/* block b's activations as the low (*xa) and high (*xb) nibbles meet them */
MOE_TARGET(MOE_AVX512) static inline void mxfp4_block_x_avx512(const mxfp4_rows *w, const float *x, int64_t b, __m512 *xa, __m512 *xb) {
    const __m512 x0 = _mm512_loadu_ps(x + b * 32), x1 = _mm512_loadu_ps(x + b * 32 + 16);
    if (!w->even_odd) {
        *xa = x0, *xb = x1;
        return;
    }
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    *xa = _mm512_permutex2var_ps(x0, even, x1);
    *xb = _mm512_permutex2var_ps(x0, _mm512_add_epi32(even, _mm512_set1_epi32(1)), x1);
}

/* rows 0 .. nr-1 (1 or 4) of w . x -> out[r] */
MOE_TARGET(MOE_AVX512) static inline void mxfp4_rows_avx512(const mxfp4_rows *w, int nr, const float *x, int64_t n, float *out) {
    const __m512 lut = _mm512_loadu_ps(moe__e2m1);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t b = 0; b < n / 32; b++) {
        __m512 xa, xb;
        mxfp4_block_x_avx512(w, x, b, &xa, &xb);
        if (nr == 4) {
            acc[0] = mxfp4_row_block_avx512(w, 0, b, lut, xa, xb, acc[0]);
            acc[1] = mxfp4_row_block_avx512(w, 1, b, lut, xa, xb, acc[1]);
            acc[2] = mxfp4_row_block_avx512(w, 2, b, lut, xa, xb, acc[2]);
            acc[3] = mxfp4_row_block_avx512(w, 3, b, lut, xa, xb, acc[3]);
        } else
            acc[0] = mxfp4_row_block_avx512(w, 0, b, lut, xa, xb, acc[0]);
    }
    for (int r = 0; r < nr; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
}

/* the layouts' rows: compressed-tensors rows of rb code bytes, scales n / 32 bytes a row apart;
 * ggml rows of rb bytes of 17-byte blocks (scale, then 16 code bytes) */
static mxfp4_rows mxfp4_ct_rows(const void *w, int64_t rb, const uint8_t *sc, int64_t n) {
    return (mxfp4_rows){.codes = w, .scales = sc, .rs = rb, .cs = 16, .rss = n / 32, .ss = 1, .even_odd = 1};
}
static mxfp4_rows mxfp4_ggml_rows(const void *w, int64_t rb) {
    const uint8_t *p = w;
    return (mxfp4_rows){.codes = p + 1, .scales = p, .rs = rb, .cs = 17, .rss = rb, .ss = 17, .even_odd = 0};
}

MOE_TARGET(MOE_AVX512) static float dot_mxfp4_avx512(const void *w, const uint8_t *sc, const float *x, int64_t n) {
    const mxfp4_rows r = mxfp4_ct_rows(w, 0, sc, n);
    float out;
    mxfp4_rows_avx512(&r, 1, x, n, &out);
    return out;
}

MOE_TARGET(MOE_AVX512) static float dot_mxfp4g_avx512(const void *w, const uint8_t *sc, const float *x, int64_t n) {
    (void)sc;
    const mxfp4_rows r = mxfp4_ggml_rows(w, 0);
    float out;
    mxfp4_rows_avx512(&r, 1, x, n, &out);
    return out;
}

MOE_TARGET(MOE_AVX512) static void dot4_mxfp4_avx512(const void *w, int64_t rb, const uint8_t *sc, const float *x, int64_t n, float *out) {
    const mxfp4_rows r = mxfp4_ct_rows(w, rb, sc, n);
    mxfp4_rows_avx512(&r, 4, x, n, out);
}

MOE_TARGET(MOE_AVX512) static void dot4_mxfp4g_avx512(const void *w, int64_t rb, const uint8_t *sc, const float *x, int64_t n, float *out) {
    (void)sc;
    const mxfp4_rows r = mxfp4_ggml_rows(w, rb);
    mxfp4_rows_avx512(&r, 4, x, n, out);
}

MOE_TARGET(MOE_AVX512) static float dot_f16_avx512(const void *w, const uint8_t *sc, const float *x, int64_t n) {
    (void)sc;
    const uint16_t *p = w;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        prefetch_ahead(p + i, 64);
        a0 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + i))), _mm512_loadu_ps(x + i), a0);
        a1 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + i + 16))), _mm512_loadu_ps(x + i + 16), a1);
    }
    if (i + 16 <= n) a0 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + i))), _mm512_loadu_ps(x + i), a0), i += 16;
    float s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    for (; i < n; i++) s += moe__f16_to_f32(p[i]) * x[i];
    return s;
}

DOTQ_VNNI_KERNELS(vnni, MOE_VNNI, _mm256_dpbusd_epi32)
/* defines dotq_q4_0_vnni(), dotq_q8_0_vnni() */

/* activation blocks at 16 lanes: as moe__quant_q8a_ref (cvtps rounds to nearest even like
 * lrintf; |q| <= 127, so the narrowing never saturates) */
MOE_TARGET(MOE_AVX512) static void quant_q8a_avx512(const float *x, moe__block_q8a *out, int64_t n) {
    for (int64_t i = 0; i < n / 32; i++) {
        const __m512 v0 = _mm512_loadu_ps(x + i * 32), v1 = _mm512_loadu_ps(x + i * 32 + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        out[i].d = amax / 127;
        const __m512 id = _mm512_set1_ps(amax ? 127.0f / amax : 0.0f);
        const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
        _mm_storeu_si128((__m128i *)out[i].qs, _mm512_cvtsepi32_epi8(i0));
        _mm_storeu_si128((__m128i *)(out[i].qs + 16), _mm512_cvtsepi32_epi8(i1));
        out[i].sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
    }
}

AXPY_KERNEL(axpy_avx512, MOE_AVX512, 512)
/* defines axpy_avx512() */

DWCONV_KERNEL(dwconv_avx512, MOE_AVX512, 512)
/* defines dwconv_avx512() */

/* e^x at 16 lanes; scalef applies 2^n in one step, subnormal results included */
MOE_TARGET(MOE_AVX512) static inline __m512 exp_avx512(__m512 x) {
    const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI));
    const __m512 nf = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504089f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(nf, _mm512_set1_ps(LN2_HI), xc);
    r = _mm512_fnmadd_ps(nf, _mm512_set1_ps(LN2_LO), r);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(EXP_P0), r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512 y = _mm512_scalef_ps(p, nf);
    return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}

LOG1P01_KERNEL(log1p01_avx512, MOE_AVX512, 512)

MOE_TARGET(MOE_AVX512) static void act_avx512(float *y, const float *x, int64_t n, int kind) {
    const __m512 one = _mm512_set1_ps(1.0f);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 z = _mm512_loadu_ps(x + i);
        __m512 r;
        if (kind == MOE__ACT_SOFTPLUS) {
            const __m512 l = log1p01_avx512(exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(z))));
            r = _mm512_add_ps(_mm512_max_ps(z, _mm512_setzero_ps()), l);
            r = _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(z, _mm512_set1_ps(20.0f), _CMP_GT_OQ) | _mm512_cmp_ps_mask(z, z, _CMP_UNORD_Q), z);
        } else {
            r = _mm512_div_ps(one, _mm512_add_ps(one, exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), z))));
            if (kind == MOE__ACT_SILU) r = _mm512_mul_ps(z, r);
        }
        _mm512_storeu_ps(y + i, r);
    }
    act_avx2(y + i, x + i, n - i, kind);
}

EXP_SUM_KERNEL(exp_sum_avx512, MOE_AVX512, 512, exp_avx512, _mm512_reduce_add_ps, exp_sum_avx2)
/* defines exp_sum_avx512() */

WIDEN_BF16_KERNEL(widen_bf16_avx512, MOE_AVX512, 512, load_bf16_avx512, widen_bf16_avx2)
/* defines widen_bf16_avx512() */

KDA_RECURRENT_KERNEL(kda_recurrent_avx512, MOE_AVX512, 512, kda_recurrent_avx2, exp_sum_avx512)
/* defines kda_recurrent_avx512() */

MLA_SCORES1_KERNEL(mla_scores1_avx512, MOE_AVX512, 512, _mm512_reduce_add_ps)
/* defines mla_scores1_avx512() */

/* a 4 heads x 4 keys tile's sums t<head><key>, times the scale, into rows sc, sc + ld, ... */
#define MLA_TILE_STORE(sc, ld, scale)                                                                     \
    do {                                                                                                \
        const __m128 k_ = _mm_set1_ps(scale);                                                           \
        _mm_storeu_ps((sc), _mm_mul_ps(hsum4_avx512(t00, t01, t02, t03), k_));                          \
        _mm_storeu_ps((sc) + (ld), _mm_mul_ps(hsum4_avx512(t10, t11, t12, t13), k_));                   \
        _mm_storeu_ps((sc) + 2 * (size_t)(ld), _mm_mul_ps(hsum4_avx512(t20, t21, t22, t23), k_));       \
        _mm_storeu_ps((sc) + 3 * (size_t)(ld), _mm_mul_ps(hsum4_avx512(t30, t31, t32, t33), k_));       \
    } while (0)

/* one 16-float step of a 4 heads x 4 keys tile: 8 loads feed 16 FMAs */
#define MLA_TILE_STEP(A0, A1, A2, A3, C0, C1, C2, C3)                                                                       \
    do {                                                                                                                     \
        const __m512 c0_ = _mm512_loadu_ps(C0), c1_ = _mm512_loadu_ps(C1), c2_ = _mm512_loadu_ps(C2), c3_ = _mm512_loadu_ps(C3); \
        __m512 a_ = _mm512_loadu_ps(A0);                                                                                     \
        t00 = _mm512_fmadd_ps(a_, c0_, t00), t01 = _mm512_fmadd_ps(a_, c1_, t01), t02 = _mm512_fmadd_ps(a_, c2_, t02), t03 = _mm512_fmadd_ps(a_, c3_, t03); \
        a_ = _mm512_loadu_ps(A1);                                                                                            \
        t10 = _mm512_fmadd_ps(a_, c0_, t10), t11 = _mm512_fmadd_ps(a_, c1_, t11), t12 = _mm512_fmadd_ps(a_, c2_, t12), t13 = _mm512_fmadd_ps(a_, c3_, t13); \
        a_ = _mm512_loadu_ps(A2);                                                                                            \
        t20 = _mm512_fmadd_ps(a_, c0_, t20), t21 = _mm512_fmadd_ps(a_, c1_, t21), t22 = _mm512_fmadd_ps(a_, c2_, t22), t23 = _mm512_fmadd_ps(a_, c3_, t23); \
        a_ = _mm512_loadu_ps(A3);                                                                                            \
        t30 = _mm512_fmadd_ps(a_, c0_, t30), t31 = _mm512_fmadd_ps(a_, c1_, t31), t32 = _mm512_fmadd_ps(a_, c2_, t32), t33 = _mm512_fmadd_ps(a_, c3_, t33); \
    } while (0)

/* scores in tiles of 4 heads x 4 keys: 16 accumulators, each key and query vector loaded once
 * per tile step (at long context this is the decode step's arithmetic: 2 x heads x depth x r) */
MOE_TARGET(MOE_AVX512) static void mla_scores_avx512(const moe__mla_block *b) {
    const int r = b->r, dr = b->dr, cw = b->cw;
    if (r % 16 || dr % 16) { mla_scores_avx2(b); return; }
    const size_t qs = (size_t)b->qr_stride;
    int j = b->j0;
    /* keys 8 at a time (two tiles per head group): the 8 keys' rows (18 KB at r = 512) stay in
     * L1 while the head groups' queries pass, and the queries of all heads (37 KB) are read once
     * per 8 keys instead of once per 4 */
    if (b->H >= 4)
        for (int jg; j + 4 <= b->j1; j += jg) {
            jg = b->j1 - j >= 8 ? 8 : 4;
            int h = 0;
            for (; h + 4 <= b->H; h += 4)
                for (int jq = j; jq < j + jg; jq += 4) {
                    const float *c0 = b->cache + (size_t)jq * cw, *c1 = c0 + cw, *c2 = c1 + cw, *c3 = c2 + cw;
                    /* the first four head groups prefetch one row each of the next jg keys per tile (a
                     * decode step reads the latent cache from memory, once), a line per step */
                    const char *pf = h < 16 ? bytes_past(b->cache, sizeof(float) * (size_t)(j + jg + h / 4 * (jg / 4) + (jq - j) / 4) * cw) : NULL;
                    const float *a0 = b->qa + (size_t)h * r, *a1 = a0 + r, *a2 = a1 + r, *a3 = a2 + r;
                    const float *q0 = b->qr + (size_t)h * qs, *q1 = q0 + qs, *q2 = q1 + qs, *q3 = q2 + qs;
                    __m512 t00 = _mm512_setzero_ps(), t01 = t00, t02 = t00, t03 = t00, t10 = t00, t11 = t00, t12 = t00, t13 = t00;
                    __m512 t20 = t00, t21 = t00, t22 = t00, t23 = t00, t30 = t00, t31 = t00, t32 = t00, t33 = t00;
                    for (int i = 0; i < r; i += 16) {
                        if (pf) prefetch_row_l2(bytes_past(pf, 4 * (size_t)i), 64);
                        MLA_TILE_STEP(a0 + i, a1 + i, a2 + i, a3 + i, c0 + i, c1 + i, c2 + i, c3 + i);
                    }
                    for (int i = 0; i < dr; i += 16) {
                        if (pf) prefetch_row_l2(bytes_past(pf, 4 * (size_t)(r + i)), 64);
                        MLA_TILE_STEP(q0 + i, q1 + i, q2 + i, q3 + i, c0 + r + i, c1 + r + i, c2 + r + i, c3 + r + i);
                    }
                    MLA_TILE_STORE(b->sc + (size_t)h * b->ld + jq, b->ld, b->scale);
                }
            if (h < b->H) { /* the last heads of these keys */
                moe__mla_block t = *b;
                t.qa += (size_t)h * r, t.qr += (size_t)h * qs, t.sc += (size_t)h * b->ld, t.H -= h;
                for (int jj = j; jj < j + jg; jj++) mla_scores1_avx512(&t, jj, 0);
            }
        }
    for (; j < b->j1; j++) mla_scores1_avx512(b, j, 0);
}

#undef MLA_TILE_STEP

/* ctx: 4 heads x 64 latent floats in 16 registers while every key of the block passes (4 loads
 * and 4 broadcasts feed 16 FMAs); the remaining heads through the AVX2 kernel */
MOE_TARGET(MOE_AVX512) static void mla_ctx_avx512(const moe__mla_block *b, int h0, int h1) {
    /* 16 named accumulators (4 heads x 64 floats): held in an array, gcc kept them in memory
     * (a load, FMA and store per product: 37 against 100+ GMAC/s). Keys in chunks of 128, slices
     * outside, heads inside: a chunk's 64-float slice (32 KB) stays in L1 while the head groups
     * pass over it (heads outside read each slice from L2 once per group: 5.6 -> 4.2 ms for the
     * ctx products of 6 layers at 16384 keys, 2 threads); the sums go through memory between
     * chunks, the same floats, so results are as with all keys at once */
    const int r = b->r, hn = h0 + (h1 - h0) / 4 * 4;
    if (r % 64) { mla_ctx_avx2(b, h0, h1); return; }
    for (int j0 = 0; j0 < b->jn; j0 += 128) {
        const int j1 = b->jn - j0 < 128 ? b->jn : j0 + 128;
        for (int i = 0; i < r; i += 64)
            for (int h = h0; h < hn; h += 4) {
                const float *p0 = b->sc + (size_t)h * b->ld, *p1 = p0 + b->ld, *p2 = p1 + b->ld, *p3 = p2 + b->ld;
                float *c0 = b->ctx + (size_t)h * r, *c1 = c0 + r, *c2 = c1 + r, *c3 = c2 + r;
#define LD4(x, c) __m512 x##0 = _mm512_loadu_ps(c + i), x##1 = _mm512_loadu_ps(c + i + 16), x##2 = _mm512_loadu_ps(c + i + 32), x##3 = _mm512_loadu_ps(c + i + 48)
#define FMA4(x, w) x##0 = _mm512_fmadd_ps(w, v0, x##0), x##1 = _mm512_fmadd_ps(w, v1, x##1), x##2 = _mm512_fmadd_ps(w, v2, x##2), x##3 = _mm512_fmadd_ps(w, v3, x##3)
#define ST4(x, c) _mm512_storeu_ps(c + i, x##0), _mm512_storeu_ps(c + i + 16, x##1), _mm512_storeu_ps(c + i + 32, x##2), _mm512_storeu_ps(c + i + 48, x##3)
                LD4(a, c0);
                LD4(e, c1);
                LD4(f, c2);
                LD4(g, c3);
                for (int j = j0; j < j1; j++) {
                    const float *c = b->cache + (size_t)j * b->cw + i;
                    const __m512 v0 = _mm512_loadu_ps(c), v1 = _mm512_loadu_ps(c + 16), v2 = _mm512_loadu_ps(c + 32), v3 = _mm512_loadu_ps(c + 48);
                    const __m512 w0 = _mm512_set1_ps(p0[j]), w1 = _mm512_set1_ps(p1[j]), w2 = _mm512_set1_ps(p2[j]), w3 = _mm512_set1_ps(p3[j]);
                    FMA4(a, w0);
                    FMA4(e, w1);
                    FMA4(f, w2);
                    FMA4(g, w3);
                }
                ST4(a, c0);
                ST4(e, c1);
                ST4(f, c2);
                ST4(g, c3);
#undef LD4
#undef FMA4
#undef ST4
            }
    }
    if (hn < h1) mla_ctx_avx2(b, hn, h1);
}

static void mla_scores16_avx512(const moe__mla_block16 *b) { mla_scores16_widened(b, mla_scores_avx512, widen_bf16_avx512); }

static void mla_ctx16_avx512(const moe__mla_block16 *b, int h0, int h1) { mla_ctx16_widened(b, h0, h1, mla_ctx_avx512, widen_bf16_avx512); }

#define MOE_AVX512BF16 MOE_AVX512 ",avx512bf16"

/* the score of key j for head h (tails of the tiled kernel) */
MOE_TARGET(MOE_AVX512BF16) static void mla_score16_one(const moe__mla_block16 *b, int h, int j) {
    const uint16_t *q = b->q + (size_t)h * b->cw, *c = b->cache + (size_t)j * b->cw;
    __m512 s = _mm512_setzero_ps();
    for (int i = 0; i < b->cw; i += 32) {
        const __mmask32 m = b->cw - i >= 32 ? ~(__mmask32)0 : (__mmask32)((1u << (b->cw - i)) - 1);
        s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_maskz_loadu_epi16(m, q + i), (__m512bh)_mm512_maskz_loadu_epi16(m, c + i));
    }
    b->sc[(size_t)h * b->ld + j] = _mm512_reduce_add_ps(s) * b->scale;
}

/* one 32-value step of a 4 heads x 4 keys tile: 8 loads feed 16 dot products of 32 pairs */
#define MLA_TILE16_STEP(LD)                                                                                      \
    do {                                                                                                         \
        const __m512bh c0_ = (__m512bh)LD(c0 + i), c1_ = (__m512bh)LD(c1 + i), c2_ = (__m512bh)LD(c2 + i), c3_ = (__m512bh)LD(c3 + i); \
        __m512bh a_ = (__m512bh)LD(a0 + i);                                                                      \
        t00 = _mm512_dpbf16_ps(t00, a_, c0_), t01 = _mm512_dpbf16_ps(t01, a_, c1_), t02 = _mm512_dpbf16_ps(t02, a_, c2_), t03 = _mm512_dpbf16_ps(t03, a_, c3_); \
        a_ = (__m512bh)LD(a1 + i);                                                                               \
        t10 = _mm512_dpbf16_ps(t10, a_, c0_), t11 = _mm512_dpbf16_ps(t11, a_, c1_), t12 = _mm512_dpbf16_ps(t12, a_, c2_), t13 = _mm512_dpbf16_ps(t13, a_, c3_); \
        a_ = (__m512bh)LD(a2 + i);                                                                               \
        t20 = _mm512_dpbf16_ps(t20, a_, c0_), t21 = _mm512_dpbf16_ps(t21, a_, c1_), t22 = _mm512_dpbf16_ps(t22, a_, c2_), t23 = _mm512_dpbf16_ps(t23, a_, c3_); \
        a_ = (__m512bh)LD(a3 + i);                                                                               \
        t30 = _mm512_dpbf16_ps(t30, a_, c0_), t31 = _mm512_dpbf16_ps(t31, a_, c1_), t32 = _mm512_dpbf16_ps(t32, a_, c2_), t33 = _mm512_dpbf16_ps(t33, a_, c3_); \
    } while (0)

/* scores in tiles of 4 heads x 4 keys, as mla_scores_avx512, at twice the products per
 * instruction; the last partial step of a row through masked loads */
MOE_TARGET(MOE_AVX512BF16) static void mla_scores16_avx512bf16(const moe__mla_block16 *b) {
    const int cw = b->cw, full = cw / 32 * 32;
    const __mmask32 tail = (__mmask32)((1u << (cw - full)) - 1);
    int j = b->j0;
    if (b->H >= 4)
        for (; j + 4 <= b->j1; j += 4) {
            const uint16_t *c0 = b->cache + (size_t)j * cw, *c1 = c0 + cw, *c2 = c1 + cw, *c3 = c2 + cw;
            int h = 0;
            for (; h + 4 <= b->H; h += 4) {
                /* keys j+8 .. j+11, one per head group (measured best; 4 ahead: 10% slower), a line per step */
                const char *pf = h < 16 ? bytes_past(c0, sizeof(uint16_t) * (size_t)(8 + h / 4) * cw) : NULL;
                const uint16_t *a0 = b->q + (size_t)h * cw, *a1 = a0 + cw, *a2 = a1 + cw, *a3 = a2 + cw;
                __m512 t00 = _mm512_setzero_ps(), t01 = t00, t02 = t00, t03 = t00, t10 = t00, t11 = t00, t12 = t00, t13 = t00;
                __m512 t20 = t00, t21 = t00, t22 = t00, t23 = t00, t30 = t00, t31 = t00, t32 = t00, t33 = t00;
                int i = 0;
                for (; i < full; i += 32) {
                    if (pf) prefetch_row_l2(bytes_past(pf, 2 * (size_t)i), 64);
                    MLA_TILE16_STEP(_mm512_loadu_si512);
                }
#define LD_TAIL(p) _mm512_maskz_loadu_epi16(tail, p)
                if (i < cw) {
                    if (pf) prefetch_row_l2(bytes_past(pf, 2 * (size_t)i), 64);
                    MLA_TILE16_STEP(LD_TAIL);
                }
#undef LD_TAIL
                MLA_TILE_STORE(b->sc + (size_t)h * b->ld + j, b->ld, b->scale);
            }
            for (; h < b->H; h++)
                for (int jj = j; jj < j + 4; jj++) mla_score16_one(b, h, jj);
        }
    for (; j < b->j1; j++)
        for (int h = 0; h < b->H; h++) mla_score16_one(b, h, j);
}

#undef MLA_TILE16_STEP

/* ctx: the weights of two consecutive keys form one bf16 pair, and so do the two keys' rows,
 * interleaved (vpunpck{l,h}wd: pairs per 128-bit lane, so the sums come out in a fixed lane
 * order, put back at the end); 4 heads x 64 latent values in 16 registers while the block's
 * keys pass, two at a time: 4 loads, 4 interleaves and 4 broadcasts feed 16 dot products */
MOE_TARGET(MOE_AVX512BF16) static void mla_ctx16_avx512bf16(const moe__mla_block16 *b, int h0, int h1) {
    const int r = b->r, cw = b->cw, jn = b->jn, ps = (jn + 31) / 32 * 32;
    if (r % 64) { mla_ctx16_avx512(b, h0, h1); return; }
    /* the weights rounded to bf16, ps per head (zeros after jn) */
    uint16_t *P = (uint16_t *)(b->work + (size_t)b->H * cw + (size_t)b->ld * cw);
    for (int h = h0; h < h1; h++)
        for (int j = 0; j < ps; j += 32) {
            const float *p = b->sc + (size_t)h * b->ld + j;
            const int n = jn - j;
            const __mmask16 m0 = n >= 16 ? 0xffff : (__mmask16)((1u << (n > 0 ? n : 0)) - 1);
            const __mmask16 m1 = n >= 32 ? 0xffff : (__mmask16)((1u << (n > 16 ? n - 16 : 0)) - 1);
            const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m1, p + 16), _mm512_maskz_loadu_ps(m0, p));
            _mm512_storeu_si512(P + (size_t)(h - h0) * ps + j, (__m512i)w);
        }
    const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi_idx = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const int hn = h0 + (h1 - h0) / 4 * 4;
    /* slices outside, heads inside: a 64-value slice of the block's keys (256 keys: 32 KB) stays
     * in L1 while the head groups pass over it (heads outside read the block from L2 once per
     * group: 2.3-2.6 -> 2.0-2.2 ms for the ctx products of 6 layers at 16384 keys, 2 threads) */
    for (int i = 0; i < r; i += 64)
        for (int h = h0; h < hn; h += 4) {
            const uint16_t *p0 = P + (size_t)(h - h0) * ps, *p1 = p0 + ps, *p2 = p1 + ps, *p3 = p2 + ps;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, e0 = a0, e1 = a0, e2 = a0, e3 = a0;
            __m512 f0 = a0, f1 = a0, f2 = a0, f3 = a0, g0 = a0, g1 = a0, g2 = a0, g3 = a0;
            for (int j = 0; j < jn; j += 2) {
                const uint16_t *c = b->cache + (size_t)j * cw + i;
                const __m512i x0 = _mm512_loadu_si512(c), x1 = _mm512_loadu_si512(c + 32);
                const __m512i y0 = j + 1 < jn ? _mm512_loadu_si512(c + cw) : _mm512_setzero_si512();
                const __m512i y1 = j + 1 < jn ? _mm512_loadu_si512(c + cw + 32) : _mm512_setzero_si512();
                const __m512bh v0 = (__m512bh)_mm512_unpacklo_epi16(x0, y0), v1 = (__m512bh)_mm512_unpackhi_epi16(x0, y0);
                const __m512bh v2 = (__m512bh)_mm512_unpacklo_epi16(x1, y1), v3 = (__m512bh)_mm512_unpackhi_epi16(x1, y1);
                uint32_t u0, u1, u2, u3;
                memcpy(&u0, p0 + j, 4), memcpy(&u1, p1 + j, 4), memcpy(&u2, p2 + j, 4), memcpy(&u3, p3 + j, 4);
#define DP4(x, u)                                                                                                  \
    do {                                                                                                           \
        const __m512bh w_ = (__m512bh)_mm512_set1_epi32((int)(u));                                                 \
        x##0 = _mm512_dpbf16_ps(x##0, v0, w_), x##1 = _mm512_dpbf16_ps(x##1, v1, w_);                             \
        x##2 = _mm512_dpbf16_ps(x##2, v2, w_), x##3 = _mm512_dpbf16_ps(x##3, v3, w_);                             \
    } while (0)
                DP4(a, u0);
                DP4(e, u1);
                DP4(f, u2);
                DP4(g, u3);
#undef DP4
            }
            /* lanes back in latent order, added to the heads' context rows */
#define ADD4(x, hh)                                                                                                \
    do {                                                                                                           \
        float *o_ = b->ctx + (size_t)(hh) * r + i;                                                                 \
        _mm512_storeu_ps(o_, _mm512_add_ps(_mm512_loadu_ps(o_), _mm512_permutex2var_ps(x##0, lo_idx, x##1)));      \
        _mm512_storeu_ps(o_ + 16, _mm512_add_ps(_mm512_loadu_ps(o_ + 16), _mm512_permutex2var_ps(x##0, hi_idx, x##1))); \
        _mm512_storeu_ps(o_ + 32, _mm512_add_ps(_mm512_loadu_ps(o_ + 32), _mm512_permutex2var_ps(x##2, lo_idx, x##3))); \
        _mm512_storeu_ps(o_ + 48, _mm512_add_ps(_mm512_loadu_ps(o_ + 48), _mm512_permutex2var_ps(x##2, hi_idx, x##3))); \
    } while (0)
            ADD4(a, h);
            ADD4(e, h + 1);
            ADD4(f, h + 2);
            ADD4(g, h + 3);
#undef ADD4
        }
    if (hn < h1) mla_ctx16_avx512(b, hn, h1);
}

#define DPBUSD512(acc, a, b) __asm__("vpdpbusd {%2, %1, %0|%0, %1, %2}" : "+v"(acc) : "v"(a), "v"(b)) /* AT&T | Intel */

/* the scores of 8 keys (f0..f7: lanes = the 16 heads of group g) stored as sc[h][j .. j+7]: a
 * transpose in 128-bit lanes (heads 4L .. 4L+3 of lane L), then two 4-key halves per head */
#define SCORES8_STORE(L)                                                                                      \
    for (int m_ = 0; m_ < 4; m_++) {                                                                         \
        const int h_ = g * 16 + 4 * (L) + m_;                                                                \
        if (h_ < b->H) {                                                                                     \
            _mm_storeu_ps(b->sc + (size_t)h_ * b->ld + j, _mm512_extractf32x4_ps(u[m_], (L)));              \
            _mm_storeu_ps(b->sc + (size_t)h_ * b->ld + j + 4, _mm512_extractf32x4_ps(u[m_ + 4], (L)));      \
        }                                                                                                    \
    }

/* head group g's two query scales (latent part, kr part) in 16 lanes; lanes past the last head
 * repeat its scales (their scores are not stored) */
MOE_TARGET(MOE_AVX512) static inline void query_scales16(const moe__mla_block8 *b, int g, __m512 *qc, __m512 *qr) {
    float c[16], r[16];
    for (int l = 0; l < 16; l++) {
        const int h = g * 16 + l < b->H ? g * 16 + l : b->H - 1;
        c[l] = b->qd[2 * h], r[l] = b->qd[2 * h + 1];
    }
    *qc = _mm512_loadu_ps(c), *qr = _mm512_loadu_ps(r);
}

/* heads in lanes: each step loads 4 query values of 16 heads (moe__mla_qt8's layout, + 128 as
 * unsigned bytes by one xor) and meets 4 bytes of each of 8 keys, broadcast; one accumulator per
 * key, no horizontal sums (a 4 heads x 4 keys tile spent half its time in them). The offset's
 * 128 * (sum of the key's bytes) is taken off after. 8 keys' rows (4.6 KB at K3's width) stay in
 * L1 across the head groups. Keys SCORES8_AHEAD .. +7 ahead are prefetched into L2 two lines per
 * 16 bytes of the current keys, spread through the pass: one burst of their 72 lines per 8 keys
 * (as before) read a depth-16384 cache at 130 G multiply-adds/s on a Zen 4 core, spread at
 * 170-190, about its speed from L2 (bench/RESULTS.md). */
#define SCORES8_AHEAD 12

MOE_TARGET(MOE_AVX512VNNI) static void mla_scores8_vnni(const moe__mla_block8 *b) {
    const int r = b->r, cw = b->cw, ng = (b->H + 15) / 16, nq = cw / 4;
    if (cw % 4 || r % 4) { moe__mla_scores8_ref(b); return; }
    const int wide = r % 16 == 0 && cw % 16 == 0; /* 4 chunks of a key per load */
    const __m512i x80 = _mm512_set1_epi8((char)0x80);
    const __m512 k = _mm512_set1_ps(b->scale);
    int j = b->j0;
    for (; j + 8 <= b->j1; j += 8) {
        const int8_t *c = b->cache + (size_t)j * cw;
        if (!wide) prefetch_row_l2(bytes_past(c, (size_t)8 * cw), 8 * cw);
        const moe__kv8_meta *mt = b->meta + j;
        for (int g = 0; g < ng; g++) {
            const int8_t *qt = b->qt + (size_t)g * nq * 64;
            __m512 vqc, vqr;
            query_scales16(b, g, &vqc, &vqr);
            __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
#define BC(n, i) _mm512_set1_epi32(*(const int32_t *)(const void *)(c + (size_t)(n) * cw + (i)))
#define STEP8(i)                                                                                            \
    do {                                                                                                    \
        const __m512i q_ = _mm512_xor_si512(_mm512_loadu_si512(qt + (size_t)(i) * 16), x80);               \
        DPBUSD512(a0, q_, BC(0, i)); DPBUSD512(a1, q_, BC(1, i)); DPBUSD512(a2, q_, BC(2, i));              \
        DPBUSD512(a3, q_, BC(3, i)); DPBUSD512(a4, q_, BC(4, i)); DPBUSD512(a5, q_, BC(5, i));              \
        DPBUSD512(a6, q_, BC(6, i)); DPBUSD512(a7, q_, BC(7, i));                                          \
    } while (0)
/* 16 bytes of each key at a time: the first two 4-byte chunks picked in registers by vpshufd from
 * one load into every 128-bit lane, the other two broadcast from memory. Picking all four was
 * the fastest on Zen 5 (full-width 512-bit units: about 425 G multiply-adds/s on one core against
 * 320 with a broadcast load per dpbusd) and the slowest on Zen 4 (double-pumped: 148 against 177,
 * the shuffles queue for the vector units while the load units idle); two and two ran at 172 on
 * Zen 4 (256 keys of 576 bytes in L2; bench/RESULTS.md) */
#define KEY16(n, i) _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(const void *)(c + (size_t)(n) * cw + (i))))
#define STEP8_PICK(i, s, imm)                                                                               \
    do {                                                                                                    \
        const __m512i q_ = _mm512_xor_si512(_mm512_loadu_si512(qt + (size_t)((i) + 4 * (s)) * 16), x80);  \
        DPBUSD512(a0, q_, _mm512_shuffle_epi32(k0, imm)); DPBUSD512(a1, q_, _mm512_shuffle_epi32(k1, imm)); \
        DPBUSD512(a2, q_, _mm512_shuffle_epi32(k2, imm)); DPBUSD512(a3, q_, _mm512_shuffle_epi32(k3, imm)); \
        DPBUSD512(a4, q_, _mm512_shuffle_epi32(k4, imm)); DPBUSD512(a5, q_, _mm512_shuffle_epi32(k5, imm)); \
        DPBUSD512(a6, q_, _mm512_shuffle_epi32(k6, imm)); DPBUSD512(a7, q_, _mm512_shuffle_epi32(k7, imm)); \
    } while (0)
#define STEP8X4(i)                                                                                          \
    do {                                                                                                    \
        if (g == 0) prefetch_row_l2(bytes_past(c, (size_t)SCORES8_AHEAD * cw + 8 * (size_t)(i)), 128);         \
        const __m512i k0 = KEY16(0, i), k1 = KEY16(1, i), k2 = KEY16(2, i), k3 = KEY16(3, i);               \
        const __m512i k4 = KEY16(4, i), k5 = KEY16(5, i), k6 = KEY16(6, i), k7 = KEY16(7, i);               \
        STEP8_PICK(i, 0, _MM_PERM_AAAA);                                                                    \
        STEP8_PICK(i, 1, _MM_PERM_BBBB);                                                                    \
        STEP8((i) + 8);                                                                                     \
        STEP8((i) + 12);                                                                                    \
    } while (0)
            if (wide)
                for (int i = 0; i < r; i += 16) STEP8X4(i);
            else
                for (int i = 0; i < r; i += 4) STEP8(i);
            /* the latent part's float terms, then the same accumulators for kr */
#define PART(n, s, d, vq) _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a##n, _mm512_set1_epi32(mt[n].s * 128))), _mm512_mul_ps(vq, _mm512_set1_ps(mt[n].d)))
            __m512 f[8] = {PART(0, sc, dc, vqc), PART(1, sc, dc, vqc), PART(2, sc, dc, vqc), PART(3, sc, dc, vqc),
                           PART(4, sc, dc, vqc), PART(5, sc, dc, vqc), PART(6, sc, dc, vqc), PART(7, sc, dc, vqc)};
            a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = _mm512_setzero_si512();
            if (wide)
                for (int i = r; i < cw; i += 16) STEP8X4(i);
            else
                for (int i = r; i < cw; i += 4) STEP8(i);
#undef STEP8
#undef STEP8X4
#undef STEP8_PICK
#undef KEY16
            f[0] = _mm512_mul_ps(_mm512_add_ps(f[0], PART(0, sr, dr, vqr)), k);
            f[1] = _mm512_mul_ps(_mm512_add_ps(f[1], PART(1, sr, dr, vqr)), k);
            f[2] = _mm512_mul_ps(_mm512_add_ps(f[2], PART(2, sr, dr, vqr)), k);
            f[3] = _mm512_mul_ps(_mm512_add_ps(f[3], PART(3, sr, dr, vqr)), k);
            f[4] = _mm512_mul_ps(_mm512_add_ps(f[4], PART(4, sr, dr, vqr)), k);
            f[5] = _mm512_mul_ps(_mm512_add_ps(f[5], PART(5, sr, dr, vqr)), k);
            f[6] = _mm512_mul_ps(_mm512_add_ps(f[6], PART(6, sr, dr, vqr)), k);
            f[7] = _mm512_mul_ps(_mm512_add_ps(f[7], PART(7, sr, dr, vqr)), k);
#undef PART
            const __m512 t0 = _mm512_unpacklo_ps(f[0], f[1]), t1 = _mm512_unpackhi_ps(f[0], f[1]);
            const __m512 t2 = _mm512_unpacklo_ps(f[2], f[3]), t3 = _mm512_unpackhi_ps(f[2], f[3]);
            const __m512 t4 = _mm512_unpacklo_ps(f[4], f[5]), t5 = _mm512_unpackhi_ps(f[4], f[5]);
            const __m512 t6 = _mm512_unpacklo_ps(f[6], f[7]), t7 = _mm512_unpackhi_ps(f[6], f[7]);
            const __m512 u[8] = {_mm512_shuffle_ps(t0, t2, 0x44), _mm512_shuffle_ps(t0, t2, 0xee), _mm512_shuffle_ps(t1, t3, 0x44),
                                 _mm512_shuffle_ps(t1, t3, 0xee), _mm512_shuffle_ps(t4, t6, 0x44), _mm512_shuffle_ps(t4, t6, 0xee),
                                 _mm512_shuffle_ps(t5, t7, 0x44), _mm512_shuffle_ps(t5, t7, 0xee)};
            SCORES8_STORE(0)
            SCORES8_STORE(1)
            SCORES8_STORE(2)
            SCORES8_STORE(3)
        }
    }
#undef BC
    /* the last keys one at a time, the same steps */
    for (; j < b->j1; j++) {
        const int8_t *c = b->cache + (size_t)j * cw;
        const moe__kv8_meta *mt = b->meta + j;
        for (int g = 0; g < ng; g++) {
            const int8_t *qt = b->qt + (size_t)g * nq * 64;
            float out[16];
            __m512 vqc, vqr;
            query_scales16(b, g, &vqc, &vqr);
            __m512i a0 = _mm512_setzero_si512(), a1 = a0;
            for (int i = 0; i < cw; i += 4) {
                const __m512i q = _mm512_xor_si512(_mm512_loadu_si512(qt + (size_t)i * 16), x80);
                const __m512i x = _mm512_set1_epi32(*(const int32_t *)(const void *)(c + i));
                if (i < r) DPBUSD512(a0, q, x);
                else DPBUSD512(a1, q, x);
            }
            const __m512 fc = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a0, _mm512_set1_epi32(mt->sc * 128))), _mm512_mul_ps(vqc, _mm512_set1_ps(mt->dc)));
            const __m512 fr = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a1, _mm512_set1_epi32(mt->sr * 128))), _mm512_mul_ps(vqr, _mm512_set1_ps(mt->dr)));
            _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_add_ps(fc, fr), k));
            for (int l = 0; l < 16 && g * 16 + l < b->H; l++) b->sc[(size_t)(g * 16 + l) * b->ld + j] = out[l];
        }
    }
}

#undef SCORES8_STORE

/* ctx: 4 keys' bytes of one latent value form a 32-bit lane (two rounds of byte/word unpacks of
 * 4 rows, in a fixed lane order put back at the end) and meet the 4 keys' weights of a head,
 * broadcast: 4 heads x 64 latent values in 16 accumulators; slices of 64 values outside, so the
 * block's slice stays in L1 while the head groups pass */
/* moe__mla_weights8 in 16 lanes: the same products, maximum and rounding steps, so the same bytes */
MOE_TARGET(MOE_AVX512) static float weights8_max_avx512(const float *p, const float *d, int jn) {
    __m512 mv = _mm512_setzero_ps();
    int j = 0;
    for (; j + 16 <= jn; j += 16) mv = _mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(p + j), _mm512_loadu_ps(d + j)), mv);
    return weights8_max_tail(p, d, j, jn, _mm512_reduce_max_ps(mv));
}

MOE_TARGET(MOE_AVX512) static void weights8_round_avx512(const float *p, const float *d, float inv, int jn, int lw, uint8_t *w) {
    const __m512 vi = _mm512_set1_ps(inv), half = _mm512_set1_ps(0.5f), top = _mm512_set1_ps(255.0f);
    int j = 0;
    for (; j + 16 <= jn; j += 16) {
        const __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(p + j), _mm512_loadu_ps(d + j)), vi), half);
        _mm_storeu_si128((__m128i *)(w + j), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(_mm512_min_ps(v, top))));
    }
    weights8_round_tail(p, d, inv, j, jn, lw, w);
}

static void mla_weights8_avx512(const float *p, int ld, const moe__kv8_meta *meta, int jn, int h0, int h1, uint8_t *w, int lw, float *ws,
                                float *work) {
    weights8_heads(p, ld, meta, jn, h0, h1, w, lw, ws, work, weights8_max_avx512, weights8_round_avx512);
}

MOE_TARGET(MOE_AVX512VNNI) static void mla_ctx8_vnni(const moe__mla_block8 *b, int h0, int h1) {
    const int r = b->r, cw = b->cw, jn = b->jn;
    if (r % 64) { moe__mla_ctx8_ref(b, h0, h1); return; }
    const __m512i zero = _mm512_setzero_si512();
    for (int i = 0; i < r; i += 64)
        for (int h = h0; h < h1; h += 4) {
            const int nh = h1 - h < 4 ? h1 - h : 4; /* heads past h1 use head h's weights, unstored */
            const uint8_t *p0 = b->w + (size_t)h * b->lw, *p1 = nh > 1 ? p0 + b->lw : p0, *p2 = nh > 2 ? p0 + 2 * (size_t)b->lw : p0,
                          *p3 = nh > 3 ? p0 + 3 * (size_t)b->lw : p0;
            __m512i a0 = zero, a1 = zero, a2 = zero, a3 = zero, e0 = zero, e1 = zero, e2 = zero, e3 = zero;
            __m512i f0 = zero, f1 = zero, f2 = zero, f3 = zero, g0 = zero, g1 = zero, g2 = zero, g3 = zero;
            for (int j = 0; j < jn; j += 4) {
                const int8_t *c = b->cache + (size_t)j * cw + i;
                const __m512i x0 = _mm512_loadu_si512(c);
                const __m512i x1 = j + 1 < jn ? _mm512_loadu_si512(c + cw) : zero;
                const __m512i x2 = j + 2 < jn ? _mm512_loadu_si512(c + 2 * (size_t)cw) : zero;
                const __m512i x3 = j + 3 < jn ? _mm512_loadu_si512(c + 3 * (size_t)cw) : zero;
                const __m512i l01 = _mm512_unpacklo_epi8(x0, x1), h01 = _mm512_unpackhi_epi8(x0, x1);
                const __m512i l23 = _mm512_unpacklo_epi8(x2, x3), h23 = _mm512_unpackhi_epi8(x2, x3);
                const __m512i v0 = _mm512_unpacklo_epi16(l01, l23), v1 = _mm512_unpackhi_epi16(l01, l23);
                const __m512i v2 = _mm512_unpacklo_epi16(h01, h23), v3 = _mm512_unpackhi_epi16(h01, h23);
#define DP4(x, p)                                                                                   \
    do {                                                                                            \
        const __m512i w_ = _mm512_set1_epi32(*(const int32_t *)(const void *)((p) + j));            \
        DPBUSD512(x##0, w_, v0); DPBUSD512(x##1, w_, v1); DPBUSD512(x##2, w_, v2); DPBUSD512(x##3, w_, v3); \
    } while (0)
                DP4(a, p0);
                DP4(e, p1);
                DP4(f, p2);
                DP4(g, p3);
#undef DP4
            }
            /* accumulator k's lane 4L + m holds latent value 16L + 4k + m: a 4x4 transpose of
             * 128-bit lanes puts them back in order */
#define ADD4(x, hh)                                                                                                   \
    do {                                                                                                              \
        float *o_ = b->ctx + (size_t)(hh) * r + i;                                                                    \
        const __m512 s_ = _mm512_set1_ps(b->ws[hh]);                                                                  \
        const __m512i t0_ = _mm512_shuffle_i32x4(x##0, x##1, 0x44), t1_ = _mm512_shuffle_i32x4(x##0, x##1, 0xee);   \
        const __m512i t2_ = _mm512_shuffle_i32x4(x##2, x##3, 0x44), t3_ = _mm512_shuffle_i32x4(x##2, x##3, 0xee);   \
        const __m512i y_[4] = {_mm512_shuffle_i32x4(t0_, t2_, 0x88), _mm512_shuffle_i32x4(t0_, t2_, 0xdd),          \
                               _mm512_shuffle_i32x4(t1_, t3_, 0x88), _mm512_shuffle_i32x4(t1_, t3_, 0xdd)};         \
        for (int q_ = 0; q_ < 4; q_++)                                                                                \
            _mm512_storeu_ps(o_ + 16 * q_, _mm512_add_ps(_mm512_loadu_ps(o_ + 16 * q_), _mm512_mul_ps(s_, _mm512_cvtepi32_ps(y_[q_])))); \
    } while (0)
            ADD4(a, h);
            if (nh > 1) ADD4(e, h + 1);
            if (nh > 2) ADD4(f, h + 2);
            if (nh > 3) ADD4(g, h + 3);
#undef ADD4
        }
}

#endif /* MOE_X86 */

/* =================================================================================================
 * PART 7: AMX
 * =================================================================================================
 * The amx level (Intel Sapphire Rapids and later, Linux): the avx512vnni level with the int8
 * latent cache's attention and prefill's Q8_0/Q4_0/MXFP4 products on the tile unit (TDPBUSD,
 * TDPBSSD), bit for bit the avx512vnni kernels' results. */

#ifdef MOE_X86

/* AMX (Intel's tile unit, from Sapphire Rapids on): TDPBSSD / TDPBUSD multiply a tile of 16 rows x
 * 64 bytes by one of 16 rows x 16 four-byte groups (B's row k holds 4 consecutive k of 16
 * columns) into 16 x 16 int32 sums, 16384 multiply-adds an instruction. The sums are exact, so
 * the float steps after them are the reference's and the results the same bits. GCC 11 and
 * clang 12 know the instructions; Linux hands a process the tile state on request (cpu_has_amx). */
#ifdef MOE_AMX_BUILD
#define MOE_AMX MOE_AVX512VNNI ",amx-tile,amx-int8"
/* GCC's tileloadd is an asm without a memory operand: a barrier first where the tile's bytes were
 * written just before, so that the writes are not moved past it */
#define AMX_BARRIER() __asm__ volatile("" ::: "memory")

/* the tile configuration (palette 1): all eight tiles 16 rows of 64 bytes */
typedef struct {
    uint8_t palette, start, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

MOE_TARGET(MOE_AMX) static void amx_config_16x64(void) {
    _Alignas(64) amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = 16;
    AMX_BARRIER(); /* GCC's ldtilecfg names 8 bytes of c as its operand: the rest must be stored */
    _tile_loadconfig(&c);
}

/* r[0..15] (16 rows of 16 floats) transposed in place */
MOE_TARGET(MOE_AMX) static inline void transpose16_ps(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; i++) t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]), t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    /* u[4i + m], 128-bit lane L: column 4L + m of rows 4i .. 4i+3 */
    for (int i = 0; i < 4; i++) {
        u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44), u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
        u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44), u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
    }
    for (int m = 0; m < 4; m++) {
        const __m512 a = _mm512_shuffle_f32x4(u[m], u[4 + m], 0x88), b = _mm512_shuffle_f32x4(u[m], u[4 + m], 0xdd);
        const __m512 c = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0x88), d = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0xdd);
        r[m] = _mm512_shuffle_f32x4(a, c, 0x88), r[8 + m] = _mm512_shuffle_f32x4(a, c, 0xdd);
        r[4 + m] = _mm512_shuffle_f32x4(b, d, 0x88), r[12 + m] = _mm512_shuffle_f32x4(b, d, 0xdd);
    }
}

/* scores: 64 keys x 16 heads a pass, keys as A (16 rows of a key's 64 bytes, read in place at the
 * row stride) and the transposed queries as B (moe__mla_qt8's layout is AMX's B layout), signed by
 * signed: the latent part into tiles 0-3, then the kr part into the same; a 16 x 16 transpose puts
 * the scores back in head rows. Widths that are not whole 64s, and the last keys short of 64,
 * go to the AVX-512 kernel. */
/* keys ahead whose rows each step prefetches into L2, a 9th of a 64-key pass a step: the next
 * pass (cold rows of a depth-16384 cache: 2.2-2.5 ms a token per thread without it, 1.9 with it;
 * 128 ahead 2.0-2.1, 512 ahead 2.5; devtmp harness, bench/RESULTS.md) */
#define SCORES8_AMX_AHEAD 64
MOE_TARGET(MOE_AMX) static void mla_scores8_amx(const moe__mla_block8 *b) {
    const int r = b->r, cw = b->cw, nq = cw / 4, ng = (b->H + 15) / 16;
    if (r % 64 || cw % 64 || b->j1 - b->j0 < 64) { mla_scores8_vnni(b); return; }
    const __m512 k = _mm512_set1_ps(b->scale);
    _Alignas(64) int32_t dc[64][16], dr[64][16];
    amx_config_16x64();
    int j = b->j0;
    for (; j + 64 <= b->j1; j += 64) {
        const int8_t *c = b->cache + (size_t)j * cw;
        const moe__kv8_meta *mt = b->meta + j;
        for (int g = 0; g < ng; g++) {
            const int8_t *qt = b->qt + (size_t)g * nq * 64;
            __m512 vqc, vqr;
            query_scales16(b, g, &vqc, &vqr);
            for (int part = 0; part < 2; part++) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
/* 64 values of the 64 keys from i on; the queries' tile alternates (6, 7), so that its next load
 * need not wait for the last product reading it (tiles are not renamed) */
#define SCORES8_AMX_STEP(BT, i)                                                                         \
    do {                                                                                                \
        if (g == 0) prefetch_row_l2(bytes_past(c, (size_t)SCORES8_AMX_AHEAD * cw + (size_t)(i) * 64), 4096); \
        _tile_loadd(BT, qt + (size_t)(i) * 16, 64);          \
        _tile_loadd(4, c + (i), cw);                         \
        _tile_dpbssd(0, 4, BT);                              \
        _tile_loadd(5, c + (size_t)16 * cw + (i), cw);       \
        _tile_dpbssd(1, 5, BT);                              \
        _tile_loadd(4, c + (size_t)32 * cw + (i), cw);       \
        _tile_dpbssd(2, 4, BT);                              \
        _tile_loadd(5, c + (size_t)48 * cw + (i), cw);       \
        _tile_dpbssd(3, 5, BT);                              \
    } while (0)
                const int i1 = part ? cw : r;
                int i = part ? r : 0;
                for (; i + 128 <= i1; i += 128) {
                    SCORES8_AMX_STEP(6, i);
                    SCORES8_AMX_STEP(7, i + 64);
                }
                if (i < i1) SCORES8_AMX_STEP(6, i);
#undef SCORES8_AMX_STEP
                int32_t(*d)[16] = part ? dr : dc;
                _tile_stored(0, d[0], 64);
                _tile_stored(1, d[16], 64);
                _tile_stored(2, d[32], 64);
                _tile_stored(3, d[48], 64);
            }
            for (int kb = 0; kb < 64; kb += 16) {
                __m512 f[16];
                for (int n = 0; n < 16; n++) {
                    const moe__kv8_meta *m = mt + kb + n;
                    const __m512 fc = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dc[kb + n])), _mm512_mul_ps(vqc, _mm512_set1_ps(m->dc)));
                    const __m512 fr = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dr[kb + n])), _mm512_mul_ps(vqr, _mm512_set1_ps(m->dr)));
                    f[n] = _mm512_mul_ps(_mm512_add_ps(fc, fr), k);
                }
                transpose16_ps(f); /* f[l]: head g*16 + l, 16 keys */
                for (int l = 0; l < 16 && g * 16 + l < b->H; l++) _mm512_storeu_ps(b->sc + (size_t)(g * 16 + l) * b->ld + j + kb, f[l]);
            }
        }
    }
    _tile_release();
    if (j < b->j1) {
        moe__mla_block8 t = *b;
        t.j0 = j;
        mla_scores8_vnni(&t);
    }
}

/* ctx: the softmax weights as A (16 heads x 64 keys, unsigned, read in place) and the keys'
 * bytes as B, unsigned by signed. B wants 4 keys' bytes of a latent value in each 4-byte group:
 * mla_ctx8_vnni's unpacks of 4 rows make exactly those rows, for 4 sets of 16 latent values of a
 * slice of 64 (set s, lane L: values 16L + 4s .. +3), once per slice for every head group. Slices of
 * 64 values outside; blocks of more than 256 keys (the B rows would not fit the 16 KB buffer) and
 * widths that are not whole 64s go to the AVX-512 kernel. */
MOE_TARGET(MOE_AMX) static void mla_ctx8_amx(const moe__mla_block8 *b, int h0, int h1) {
    const int r = b->r, cw = b->cw, jn = b->jn, lw = b->lw, nc = (jn + 63) / 64;
    if (r % 64 || jn > 256 || jn < 1) { mla_ctx8_vnni(b, h0, h1); return; }
    _Alignas(64) int8_t kb[4][4][16][64]; /* [set][64 keys][4 keys][16 values x 4 keys] */
    _Alignas(64) int32_t acc[4][16][16];
    _Alignas(64) uint8_t pad[16][64];
    const __m512i zero = _mm512_setzero_si512();
    amx_config_16x64();
    for (int i = 0; i < r; i += 64) {
        for (int q = 0; q < nc * 16; q++) {
            const int j = 4 * q;
            const int8_t *c = b->cache + (size_t)j * cw + i;
            const __m512i x0 = j < jn ? _mm512_loadu_si512(c) : zero;
            const __m512i x1 = j + 1 < jn ? _mm512_loadu_si512(c + cw) : zero;
            const __m512i x2 = j + 2 < jn ? _mm512_loadu_si512(c + 2 * (size_t)cw) : zero;
            const __m512i x3 = j + 3 < jn ? _mm512_loadu_si512(c + 3 * (size_t)cw) : zero;
            const __m512i l01 = _mm512_unpacklo_epi8(x0, x1), h01 = _mm512_unpackhi_epi8(x0, x1);
            const __m512i l23 = _mm512_unpacklo_epi8(x2, x3), h23 = _mm512_unpackhi_epi8(x2, x3);
            _mm512_store_si512(kb[0][q / 16][q % 16], _mm512_unpacklo_epi16(l01, l23));
            _mm512_store_si512(kb[1][q / 16][q % 16], _mm512_unpackhi_epi16(l01, l23));
            _mm512_store_si512(kb[2][q / 16][q % 16], _mm512_unpacklo_epi16(h01, h23));
            _mm512_store_si512(kb[3][q / 16][q % 16], _mm512_unpackhi_epi16(h01, h23));
        }
        AMX_BARRIER();
        for (int h = h0; h < h1; h += 16) {
            const int nh = h1 - h < 16 ? h1 - h : 16;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int ci = 0; ci < nc; ci++) {
                const uint8_t *a = b->w + (size_t)h * lw + 64 * ci;
                size_t stride = (size_t)lw;
                if (nh < 16 || 64 * ci + 64 > lw) { /* rows or bytes past w's end: a zero-padded copy */
                    const int n = lw - 64 * ci < 64 ? lw - 64 * ci : 64;
                    memset(pad, 0, sizeof pad);
                    for (int l = 0; l < nh; l++) memcpy(pad[l], a + (size_t)l * lw, (size_t)n);
                    AMX_BARRIER();
                    a = pad[0], stride = 64;
                }
                _tile_loadd(4, a, stride);
                _tile_loadd(5, kb[0][ci][0], 64);
                _tile_dpbusd(0, 4, 5);
                _tile_loadd(6, kb[1][ci][0], 64);
                _tile_dpbusd(1, 4, 6);
                _tile_loadd(5, kb[2][ci][0], 64);
                _tile_dpbusd(2, 4, 5);
                _tile_loadd(6, kb[3][ci][0], 64);
                _tile_dpbusd(3, 4, 6);
            }
            _tile_stored(0, acc[0], 64);
            _tile_stored(1, acc[1], 64);
            _tile_stored(2, acc[2], 64);
            _tile_stored(3, acc[3], 64);
            /* set s's column 4L + m is latent value 16L + 4s + m: a 4x4 transpose of 128-bit lanes */
            for (int l = 0; l < nh; l++) {
                float *o = b->ctx + (size_t)(h + l) * r + i;
                const __m512 s = _mm512_set1_ps(b->ws[h + l]);
                const __m512i x0 = _mm512_load_si512(acc[0][l]), x1 = _mm512_load_si512(acc[1][l]);
                const __m512i x2 = _mm512_load_si512(acc[2][l]), x3 = _mm512_load_si512(acc[3][l]);
                const __m512i t0 = _mm512_shuffle_i32x4(x0, x1, 0x44), t1 = _mm512_shuffle_i32x4(x0, x1, 0xee);
                const __m512i t2 = _mm512_shuffle_i32x4(x2, x3, 0x44), t3 = _mm512_shuffle_i32x4(x2, x3, 0xee);
                const __m512i y[4] = {_mm512_shuffle_i32x4(t0, t2, 0x88), _mm512_shuffle_i32x4(t0, t2, 0xdd), _mm512_shuffle_i32x4(t1, t3, 0x88),
                                      _mm512_shuffle_i32x4(t1, t3, 0xdd)};
                for (int n = 0; n < 4; n++) _mm512_storeu_ps(o + 16 * n, _mm512_add_ps(_mm512_loadu_ps(o + 16 * n), _mm512_mul_ps(s, _mm512_cvtepi32_ps(y[n]))));
            }
        }
    }
    _tile_release();
}

/* Prefill on tiles: two adjacent x8 groups (16 weight rows) times 16 activation rows, one block
 * of 32 values a product: the activations' block as A (16 rows of 32 bytes, read in place at the
 * batch stride), the two groups' block as B (8 rows of 16 x 4 bytes: row c is the groups' chunk c
 * side by side, the nibbles spread into bytes for Q4_0X8 and MXFP4X8), signed by unsigned
 * (TDPBSUD). Each block's 16 x 16 sums then take the VNNI kernels' float steps (plus bias times
 * the activations' sum, times the weights' and activations' scales, into even- and odd-block sums
 * added at the end), so out[t * 16 + i] is bit for bit the level's dotq8. Even and odd blocks
 * use their own tiles (tiles are not renamed); block b's sums are stored after block b+1's
 * product is issued and read back a block later still, so the tile unit, the tile stores and the
 * vector units overlap. */
MOE_TARGET(MOE_AMX) static void amx_config_x16x2(void) {
    _Alignas(64) amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 2; t++) {
        c.colsb[t] = 64, c.rows[t] = 16;         /* sums: 16 activation rows x 16 weight rows (even, odd block) */
        c.colsb[2 + t] = 32, c.rows[2 + t] = 16; /* activations: 16 rows x 32 bytes */
        c.colsb[4 + t] = 64, c.rows[4 + t] = 8;  /* weights: 8 chunks x 16 rows x 4 bytes */
    }
    AMX_BARRIER(); /* GCC's ldtilecfg names 8 bytes of c as its operand: the rest must be stored */
    _tile_loadconfig(&c);
}

/* B for a 4-bit x8 block pair: chunk c < 4 in the low nibbles of the block's row c, c + 4 in the
 * high ones, each nibble through DEC; row c of out = group A's chunk c, then group B's */
#define X8_SPREAD2(qa, qb, out, DEC)                                                                          \
    do {                                                                                                      \
        for (int r_ = 0; r_ < 4; r_++) {                                                                      \
            const __m512i v_ = PAIR256((qa) + 32 * r_, (qb) + 32 * r_);                                       \
            _mm512_store_si512((out) + 64 * r_, DEC(_mm512_and_si512(v_, m4)));                               \
            _mm512_store_si512((out) + 64 * (r_ + 4), DEC(_mm512_and_si512(_mm512_srli_epi16(v_, 4), m4)));   \
        }                                                                                                     \
    } while (0)
#define X16X2_AS_IS(v) (v)
#define X16X2_MXFP4(v) _mm512_shuffle_epi8(lut, v)
/* name, block type, B's rows for block q into wp (PACK_B), the two groups' scales (DW), bias */
#define AMX_X16X2_KERNEL(name, BT, PACK_B, DW, bias)                                                              \
    MOE_TARGET(MOE_AMX) static void name(const void *w, const moe__block_q8a *x0, int64_t xs, int64_t n, int nt, float *y, int64_t ldy) { \
        const BT *oa = w, *ob = oa + n / 32;                                                                     \
        const __m512i m4 = _mm512_set1_epi8(15);                                                                 \
        const __m512i lut = _mm512_broadcast_i32x4(_mm256_castsi256_si128(mxfp4x8_lut_avx2()));                 \
        const int64_t nb = n / 32, ldx = xs * (int64_t)sizeof *x0;                                               \
        _Alignas(64) int32_t c[2][16][16];                                                                       \
        _Alignas(64) float acc[2][16][16];                                                                       \
        _Alignas(64) uint8_t wb[2][512];                                                                         \
        (void)m4, (void)lut;                                                                                     \
        amx_config_x16x2(); /* (once for all the rows: loading a configuration took 7% of a prefill) */          \
        for (int g = 0; g + 16 <= nt; g += 16) {                                                                 \
        const moe__block_q8a *x = x0 + g * xs;                                                                   \
        memset(acc, 0, sizeof acc);                                                                              \
        if (nb > 0) {                                                                                            \
            uint8_t *wp = wb[0];                                                                                 \
            PACK_B(0);                                                                                           \
            _tile_loadd(2, x[0].qs, ldx);                                                                        \
        }                                                                                                        \
        for (int64_t b = 0; b <= nb + 1; b++) {                                                                  \
            if (b < nb) { /* block b's product, issued, its B rows packed an iteration before */                 \
                if (b + 1 < nb) {                                                                                \
                    const int64_t q = b + 1;                                                                     \
                    uint8_t *wp = wb[q & 1];                                                                     \
                    prefetch_ahead(oa + q, sizeof *oa);                                                          \
                    prefetch_ahead(ob + q, sizeof *ob);                                                          \
                    AMX_BARRIER();                                                                               \
                    PACK_B(q);                                                                                   \
                }                                                                                                \
                AMX_BARRIER();                                                                                   \
                if (b & 1) { /* (A for block b + 1 loaded after the product: its rows' lines arrive meanwhile) */ \
                    _tile_zero(1);                                                                               \
                    _tile_loadd(5, wb[1], 64);                                                                   \
                    _tile_dpbsud(1, 3, 5);                                                                       \
                    if (b + 1 < nb) _tile_loadd(2, x[b + 1].qs, ldx);                                            \
                } else {                                                                                         \
                    _tile_zero(0);                                                                               \
                    _tile_loadd(4, wb[0], 64);                                                                   \
                    _tile_dpbsud(0, 2, 4);                                                                       \
                    if (b + 1 < nb) _tile_loadd(3, x[b + 1].qs, ldx);                                            \
                }                                                                                                \
            }                                                                                                    \
            if (b >= 1 && b <= nb) { /* block b - 1's sums out of their tiles */                                \
                if ((b - 1) & 1) _tile_stored(1, c[1][0], 64);                                                   \
                else _tile_stored(0, c[0][0], 64);                                                               \
            }                                                                                                    \
            if (b < 2) continue;                                                                                 \
            const int64_t p = b - 2; /* block p's float steps, a block after its sums were stored */             \
            const __m512 dw = DW(p);                                                                             \
            for (int t = 0; t < 16; t++) {                                                                       \
                const moe__block_q8a *xb = x + t * xs + p;                                                       \
                const __m512i s = _mm512_add_epi32(_mm512_load_si512(c[p & 1][t]), _mm512_set1_epi32((bias) * xb->sum)); \
                const __m512 d = _mm512_mul_ps(dw, _mm512_set1_ps(xb->d));                                       \
                float *a = acc[p & 1][t];                                                                        \
                _mm512_store_ps(a, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(s), _mm512_load_ps(a)));                \
            }                                                                                                    \
        }                                                                                                        \
        for (int t = 0; t < 16; t++) _mm512_storeu_ps(y + (g + t) * ldy, _mm512_add_ps(_mm512_load_ps(acc[0][t]), _mm512_load_ps(acc[1][t]))); \
        }                                                                                                        \
        _tile_release();                                                                                         \
    }
#define PACK_B_Q8(q)                                                                                             \
    for (int c_ = 0; c_ < 8; c_++) _mm512_store_si512(wp + 64 * c_, PAIR256(oa[q].qs + 32 * c_, ob[q].qs + 32 * c_))
#define PACK_B_Q4_0(q) X8_SPREAD2(oa[q].qs, ob[q].qs, wp, X16X2_AS_IS)
#define PACK_B_MXFP4(q) X8_SPREAD2(oa[q].qs, ob[q].qs, wp, X16X2_MXFP4)
#define DW_F16(p) PAIR_F16(oa[p].d, ob[p].d)
#define DW_MXFP4(p)                                                                                              \
    _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(mxfp4x8_scales_avx2(oa[p].e))), \
                                        _mm256_castps_pd(mxfp4x8_scales_avx2(ob[p].e)), 1))
AMX_X16X2_KERNEL(dotq8x16x2_q8_0_amx, moe__block_q8_0x8, PACK_B_Q8, DW_F16, -128)
/* defines dotq8x16x2_q8_0_amx() */
AMX_X16X2_KERNEL(dotq8x16x2_q4_0_amx, moe__block_q4_0x8, PACK_B_Q4_0, DW_F16, -8)
/* defines dotq8x16x2_q4_0_amx() */
AMX_X16X2_KERNEL(dotq8x16x2_mxfp4_amx, moe__block_mxfp4x8, PACK_B_MXFP4, DW_MXFP4, -12)
/* defines dotq8x16x2_mxfp4_amx() */
#undef AMX_X16X2_KERNEL
#undef PACK_B_Q8
#undef PACK_B_Q4_0
#undef PACK_B_MXFP4
#undef DW_F16
#undef DW_MXFP4
#undef X8_SPREAD2
#undef X16X2_AS_IS
#undef X16X2_MXFP4
#undef PAIR_F16
#undef PAIR256
#endif

/* the end of the x86 parts: the templates of PART 3 */
#undef VNNI_X1_KERNELS

#undef VNNI_X1_KERNEL

#undef X8_FP16_SCALES

#undef Q8_CHUNK

#undef MXFP4_CODES

#undef Q4_0_NIBBLES

#undef X8_LOAD

#undef X8_PIN

#undef X8_LOADS

#undef X8_V

#undef X16_DOWN

#undef VNNI_X4_KERNELS

#undef X4_Q4_0_DEC

#undef X4_MXFP4_DEC

#undef X4_Q8_CHUNK

#undef VNNI_X4_NIBBLE_CHUNKS

#undef VNNI_X4_STORE

#undef VNNI_BLOCK

#undef VNNI_UREG

#undef VNNI_SAME

#undef VNNI_ROWS4

#undef DOTQ_VNNI_KERNELS

/* the last width-generic kernel: the generators and their helpers end here */
#undef AXPY_KERNEL

#undef LOG1P01_KERNEL

#undef EXP_SUM_KERNEL

#undef WIDEN_BF16_KERNEL

#undef KDA_RECURRENT_KERNEL

#undef MLA_SCORES1_KERNEL

#undef VEC

#undef VOP

#undef LANES

#undef MLA_SCORES8_256

#endif /* MOE_X86 */

/* =================================================================================================
 * PART 8: NEON
 * =================================================================================================
 * The neon level (every AArch64 CPU) and neon-dotprod (with the SDOT instruction, checked at run
 * time): float dots and tiles on 4 lanes, every block format, elementwise functions, KDA's
 * recurrence and MLA attention. make test-neon runs the suite under qemu. */

#ifdef MOE_NEON

/* activation blocks, as moe__quant_q8a_ref: vcvtnq rounds to nearest even like lrintf */
static void quant_q8a_neon(const float *x, moe__block_q8a *out, int64_t n) {
    for (int64_t i = 0; i < n / 32; i++) {
        const float *v = x + i * 32;
        float32x4_t q[8], mx = vdupq_n_f32(0);
        for (int j = 0; j < 8; j++) q[j] = vld1q_f32(v + 4 * j), mx = vmaxq_f32(mx, vabsq_f32(q[j]));
        const float amax = vmaxvq_f32(mx);
        out[i].d = amax / 127;
        const float32x4_t id = vdupq_n_f32(amax ? 127.0f / amax : 0.0f);
        int32_t sum = 0;
        for (int j = 0; j < 8; j += 2) {
            const int32x4_t a = vcvtnq_s32_f32(vmulq_f32(q[j], id)), b = vcvtnq_s32_f32(vmulq_f32(q[j + 1], id));
            const int16x8_t h = vcombine_s16(vqmovn_s32(a), vqmovn_s32(b));
            const int8x8_t c = vqmovn_s16(h);
            vst1_s8(out[i].qs + 4 * j, c);
            sum += vaddlvq_s16(h);
        }
        out[i].sum = sum;
    }
}

static float dot_f32_neon(const void *w, const uint8_t *sc, const float *x, int64_t n) {
    (void)sc;
    const float *p = w;
    float32x4_t a0 = vdupq_n_f32(0), a1 = vdupq_n_f32(0);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        a0 = vfmaq_f32(a0, vld1q_f32(p + i), vld1q_f32(x + i));
        a1 = vfmaq_f32(a1, vld1q_f32(p + i + 4), vld1q_f32(x + i + 4));
    }
    float s = vaddvq_f32(vaddq_f32(a0, a1));
    for (; i < n; i++) s += p[i] * x[i];
    return s;
}

static float dot_bf16_neon(const void *w, const uint8_t *sc, const float *x, int64_t n) {
    (void)sc;
    const uint16_t *p = w;
    float32x4_t a0 = vdupq_n_f32(0), a1 = vdupq_n_f32(0);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint16x8_t v = vld1q_u16(p + i);
        a0 = vfmaq_f32(a0, vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(v), 16)), vld1q_f32(x + i));
        a1 = vfmaq_f32(a1, vreinterpretq_f32_u32(vshll_n_u16(vget_high_u16(v), 16)), vld1q_f32(x + i + 4));
    }
    float s = vaddvq_f32(vaddq_f32(a0, a1));
    for (; i < n; i++) s += moe__bf16_to_f32(p[i]) * x[i];
    return s;
}

static float dot_f16_neon(const void *w, const uint8_t *sc, const float *x, int64_t n) {
    (void)sc;
    const uint16_t *p = w;
    float32x4_t a0 = vdupq_n_f32(0);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) a0 = vfmaq_f32(a0, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + i))), vld1q_f32(x + i));
    float s = vaddvq_f32(a0);
    for (; i < n; i++) s += moe__f16_to_f32(p[i]) * x[i];
    return s;
}

/* 16 int8 values (2 x E2M1) times 16 floats, added to acc */
static inline float32x4_t fma_i8x16(float32x4_t acc, int8x16_t v, const float *x) {
    int16x8_t lo = vmovl_s8(vget_low_s8(v)), hi = vmovl_s8(vget_high_s8(v));
    acc = vfmaq_f32(acc, vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), vld1q_f32(x));
    acc = vfmaq_f32(acc, vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo))), vld1q_f32(x + 4));
    acc = vfmaq_f32(acc, vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), vld1q_f32(x + 8));
    return vfmaq_f32(acc, vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi))), vld1q_f32(x + 12));
}

/* 16 packed MXFP4 bytes -> 2 E2M1 as int8 of their low nibbles (*lo) and high nibbles (*hi), by
 * table lookup */
static inline void mxfp4_decode16_neon(uint8x16_t raw, int8x16_t *lo, int8x16_t *hi) {
    const int8x16_t lut = vld1q_s8(e2m1x2);
    *lo = vqtbl1q_s8(lut, vandq_u8(raw, vdupq_n_u8(15)));
    *hi = vqtbl1q_s8(lut, vshrq_n_u8(raw, 4));
}

static float dot_mxfp4_neon(const void *w, const uint8_t *sc, const float *x, int64_t n) {
    const uint8_t *p = w;
    float s = 0;
    for (int64_t b = 0; b < n / 32; b++) {
        int8x16_t lo, hi;
        mxfp4_decode16_neon(vld1q_u8(p + b * 16), &lo, &hi);
        int8x16x2_t z = vzipq_s8(lo, hi); /* column order: low nibble = even column */
        float32x4_t acc = fma_i8x16(vdupq_n_f32(0), z.val[0], x + b * 32);
        acc = fma_i8x16(acc, z.val[1], x + b * 32 + 16);
        s += vaddvq_f32(acc) * 0.5f * e8m0(sc[b]);
    }
    return s;
}

static float dot_mxfp4g_neon(const void *w, const uint8_t *sc, const float *x, int64_t n) {
    (void)sc;
    const moe__block_mxfp4 *b = w;
    float s = 0;
    for (int64_t i = 0; i < n / 32; i++) {
        int8x16_t lo, hi;
        mxfp4_decode16_neon(vld1q_u8(b[i].qs), &lo, &hi);
        float32x4_t acc = fma_i8x16(vdupq_n_f32(0), lo, x + i * 32);
        acc = fma_i8x16(acc, hi, x + i * 32 + 16);
        s += vaddvq_f32(acc) * 0.5f * e8m0(b[i].e);
    }
    return s;
}

static void axpy_neon(float *y, float a, const float *x, int64_t n) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(y + i, vfmaq_n_f32(vld1q_f32(y + i), vld1q_f32(x + i), a));
    for (; i < n; i++) y[i] += a * x[i];
}

/* moe__dwconv_ref: the first tap a product, the rest fused multiply-adds */
static void dwconv_neon(float *y, const float *const *rows, const float *w, int64_t ldw, int taps, int64_t n) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        float32x4_t acc = vmulq_f32(vld1q_f32(w + i), vld1q_f32(rows[0] + i));
        for (int j = 1; j < taps; j++) acc = vfmaq_f32(acc, vld1q_f32(w + j * ldw + i), vld1q_f32(rows[j] + i));
        vst1q_f32(y + i, acc);
    }
    dwconv_tail(y, rows, w, ldw, taps, i, n);
}

/* e^x at 4 lanes, 2^n in two halves as on AVX2 */
static inline float32x4_t exp_neon(float32x4_t x) {
    const float32x4_t xc = vminq_f32(vmaxq_f32(x, vdupq_n_f32(EXP_LO)), vdupq_n_f32(EXP_HI));
    const float32x4_t nf = vrndnq_f32(vmulq_n_f32(xc, 1.44269504089f));
    float32x4_t r = vfmsq_f32(xc, nf, vdupq_n_f32(LN2_HI));
    r = vfmsq_f32(r, nf, vdupq_n_f32(LN2_LO));
    float32x4_t p = vfmaq_f32(vdupq_n_f32(EXP_P1), vdupq_n_f32(EXP_P0), r);
    p = vfmaq_f32(vdupq_n_f32(EXP_P2), p, r);
    p = vfmaq_f32(vdupq_n_f32(EXP_P3), p, r);
    p = vfmaq_f32(vdupq_n_f32(EXP_P4), p, r);
    p = vfmaq_f32(vdupq_n_f32(EXP_P5), p, r);
    p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0f)), p, vmulq_f32(r, r));
    const int32x4_t n = vcvtnq_s32_f32(nf), n1 = vshrq_n_s32(n, 1), n2 = vsubq_s32(n, n1);
    const float32x4_t s1 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n1, vdupq_n_s32(127)), 23));
    const float32x4_t s2 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n2, vdupq_n_s32(127)), 23));
    const float32x4_t y = vmulq_f32(vmulq_f32(p, s1), s2);
    return vbslq_f32(vceqq_f32(x, x), y, x); /* NaN stays NaN */
}

static inline float32x4_t log1p01_neon(float32x4_t u) {
    const float32x4_t sv = vdivq_f32(u, vaddq_f32(u, vdupq_n_f32(2.0f))), t = vmulq_f32(sv, sv);
    float32x4_t p = vfmaq_f32(vdupq_n_f32(1.0f / 13), vdupq_n_f32(1.0f / 15), t);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 11), p, t);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 9), p, t);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 7), p, t);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 5), p, t);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 3), p, t);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, t);
    return vmulq_f32(vaddq_f32(sv, sv), p);
}

static void act_neon(float *y, const float *x, int64_t n, int kind) {
    const float32x4_t one = vdupq_n_f32(1.0f);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const float32x4_t z = vld1q_f32(x + i);
        float32x4_t r;
        if (kind == MOE__ACT_SOFTPLUS) {
            const float32x4_t l = log1p01_neon(exp_neon(vnegq_f32(vabsq_f32(z))));
            r = vaddq_f32(vmaxq_f32(z, vdupq_n_f32(0.0f)), l);
            r = vbslq_f32(vcgtq_f32(z, vdupq_n_f32(20.0f)), z, r);
            r = vbslq_f32(vceqq_f32(z, z), r, z);
        } else {
            r = vdivq_f32(one, vaddq_f32(one, exp_neon(vnegq_f32(z))));
            if (kind == MOE__ACT_SILU) r = vmulq_f32(z, r);
        }
        vst1q_f32(y + i, r);
    }
    moe__act_ref(y + i, x + i, n - i, kind);
}

static float exp_sum_neon(float *y, const float *x, float shift, int64_t n) {
    float32x4_t acc = vdupq_n_f32(0);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const float32x4_t e = exp_neon(vsubq_f32(vld1q_f32(x + i), vdupq_n_f32(shift)));
        vst1q_f32(y + i, e);
        acc = vaddq_f32(acc, e);
    }
    return vaddvq_f32(acc) + moe__exp_sum_ref(y + i, x + i, shift, n - i);
}

static void widen_bf16_neon(float *y, const uint16_t *x, int64_t n) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(y + i, vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(x + i), 16)));
    moe__widen_bf16_ref(y + i, x + i, n - i);
}

static void kda_recurrent_neon(const moe__kda_head *a) {
    const int D = a->D;
    if (D % 4 || D > 512) { moe__kda_recurrent(a); return; }
    float *S = a->S;
    float pred[512], u[512], o[512], decay[512];
    for (int t = 0; t < a->n; t++) {
        const float *q = a->q + (size_t)t * a->stride, *k = a->k + (size_t)t * a->stride;
        const float *v = a->v + (size_t)t * a->stride, *g = a->g + (size_t)t * a->stride;
        const float beta = a->beta[(size_t)t * a->beta_stride];
        for (int j = 0; j < D; j += 4) vst1q_f32(pred + j, vdupq_n_f32(0));
        exp_sum_neon(decay, g, 0.0f, D);
        for (int i = 0; i < D; i++) {
            const float dec = decay[i], ki = k[i];
            float *row = S + (size_t)i * D;
            for (int j = 0; j < D; j += 4) {
                float32x4_t r = vmulq_n_f32(vld1q_f32(row + j), dec);
                vst1q_f32(row + j, r);
                vst1q_f32(pred + j, vfmaq_n_f32(vld1q_f32(pred + j), r, ki));
            }
        }
        for (int j = 0; j < D; j += 4) {
            vst1q_f32(u + j, vmulq_n_f32(vsubq_f32(vld1q_f32(v + j), vld1q_f32(pred + j)), beta));
            vst1q_f32(o + j, vdupq_n_f32(0));
        }
        for (int i = 0; i < D; i++) {
            const float ki = k[i], qi = q[i];
            float *row = S + (size_t)i * D;
            for (int j = 0; j < D; j += 4) {
                float32x4_t r = vfmaq_n_f32(vld1q_f32(row + j), vld1q_f32(u + j), ki);
                vst1q_f32(row + j, r);
                vst1q_f32(o + j, vfmaq_n_f32(vld1q_f32(o + j), r, qi));
            }
        }
        memcpy(a->o + (size_t)t * a->stride, o, sizeof(float) * (size_t)D);
    }
}

/* Integer kernels for cores without the dot-product extension (Cortex-A72, as in the Raspberry
 * Pi 4): 8 byte products widened to int16 (vmull), pairwise into int32. */
static inline int32x4_t dot16_neon(int32x4_t acc, int8x16_t a, int8x16_t b) {
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
    return vpadalq_s16(acc, vmull_s8(vget_high_s8(a), vget_high_s8(b)));
}

static float dotq_q8_0_neon(const void *w, const moe__block_q8a *x, int64_t n) {
    const moe__block_q8_0 *b = w;
    float32x4_t acc = vdupq_n_f32(0);
    for (int64_t i = 0; i < n / 32; i++) {
        int32x4_t s = dot16_neon(vdupq_n_s32(0), vld1q_s8(b[i].qs), vld1q_s8(x[i].qs));
        s = dot16_neon(s, vld1q_s8(b[i].qs + 16), vld1q_s8(x[i].qs + 16));
        acc = vfmaq_n_f32(acc, vcvtq_f32_s32(s), moe__f16_to_f32(b[i].d) * x[i].d);
    }
    return vaddvq_f32(acc);
}

/* MXFP4 . q8a: codes decoded by a table lookup (2 E2M1 as int8), then as Q8_0 */
static float dotq_mxfp4_neon(const void *w, const uint8_t *sc, const moe__block_q8a *x, int64_t n) {
    const uint8_t *p = w;
    float32x4_t acc = vdupq_n_f32(0);
    for (int64_t b = 0; b < n / 32; b++) {
        int8x16_t lo, hi;
        mxfp4_decode16_neon(vld1q_u8(p + b * 16), &lo, &hi);
        const int8x16x2_t z = vzipq_s8(lo, hi); /* column order: low nibble = even column */
        const int32x4_t s = dot16_neon(dot16_neon(vdupq_n_s32(0), z.val[0], vld1q_s8(x[b].qs)), z.val[1], vld1q_s8(x[b].qs + 16));
        acc = vfmaq_n_f32(acc, vcvtq_f32_s32(s), 0.5f * e8m0(sc[b]) * x[b].d);
    }
    return vaddvq_f32(acc);
}

static float dotq_mxfp4g_neon(const void *w, const moe__block_q8a *x, int64_t n) {
    const moe__block_mxfp4 *b = w;
    float32x4_t acc = vdupq_n_f32(0);
    for (int64_t i = 0; i < n / 32; i++) {
        int8x16_t lo, hi;
        mxfp4_decode16_neon(vld1q_u8(b[i].qs), &lo, &hi);
        const int32x4_t s = dot16_neon(dot16_neon(vdupq_n_s32(0), lo, vld1q_s8(x[i].qs)), hi, vld1q_s8(x[i].qs + 16));
        acc = vfmaq_n_f32(acc, vcvtq_f32_s32(s), 0.5f * e8m0(b[i].e) * x[i].d);
    }
    return vaddvq_f32(acc);
}

static float dotq_q4_0_neon(const void *w, const moe__block_q8a *x, int64_t n) {
    const moe__block_q4_0 *b = w;
    float32x4_t acc = vdupq_n_f32(0);
    for (int64_t i = 0; i < n / 32; i++) {
        uint8x16_t raw = vld1q_u8(b[i].qs);
        int8x16_t lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(raw, vdupq_n_u8(15))), vdupq_n_s8(8));
        int8x16_t hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(raw, 4)), vdupq_n_s8(8));
        int32x4_t s = dot16_neon(dot16_neon(vdupq_n_s32(0), lo, vld1q_s8(x[i].qs)), hi, vld1q_s8(x[i].qs + 16));
        acc = vfmaq_n_f32(acc, vcvtq_f32_s32(s), moe__f16_to_f32(b[i].d) * x[i].d);
    }
    return vaddvq_f32(acc);
}

/* Q4_1 .. IQ4_XS: values decoded to bytes (signed), each 16's products summed exactly (dot32:
 * dot32_neon here, dot32_sdot on the dot-product level, which builds the same bodies with it),
 * then the reference's float steps per sub-block */
typedef int (*dot32_fn)(uint8x16_t lo, uint8x16_t hi, const int8_t *x, int *a1);
#define KQ_NEON_BODY static inline __attribute__((always_inline))
static inline int dot32_neon(uint8x16_t lo, uint8x16_t hi, const int8_t *x, int *a1) {
    const int32x4_t s0 = dot16_neon(vdupq_n_s32(0), vreinterpretq_s8_u8(lo), vld1q_s8(x));
    const int32x4_t s1 = dot16_neon(vdupq_n_s32(0), vreinterpretq_s8_u8(hi), vld1q_s8(x + 16));
    *a1 = vaddvq_s32(s1);
    return vaddvq_s32(s0);
}

static inline uint8x16_t bits_to_bytes_neon(uint16_t bits) { /* bit j -> 0xff in byte j */
    static const uint8_t bit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t v = vcombine_u8(vdup_n_u8((uint8_t)bits), vdup_n_u8((uint8_t)(bits >> 8)));
    return vtstq_u8(v, vld1q_u8(bit));
}

KQ_NEON_BODY float q4_1_q5_neon_body(int type, const void *w, const moe__block_q8a *x, int64_t n, dot32_fn dot32) {
    float s = 0;
    for (int64_t i = 0; i < n / 32; i++) {
        const q32_fields f = q32_block(type, w, i);
        const uint8x16_t r = vld1q_u8(f.qs), b4 = vdupq_n_u8(16);
        uint8x16_t lo = vandq_u8(r, vdupq_n_u8(15)), hi = vshrq_n_u8(r, 4);
        if (type != MOE_T_Q4_1) {
            lo = vorrq_u8(lo, vandq_u8(bits_to_bytes_neon((uint16_t)f.qh), b4));
            hi = vorrq_u8(hi, vandq_u8(bits_to_bytes_neon((uint16_t)(f.qh >> 16)), b4));
        }
        int a1, a0 = dot32(lo, hi, x[i].qs, &a1);
        const int acc = a0 + a1 - (type == MOE_T_Q5_0 ? 16 * x[i].sum : 0);
        s += x[i].d * (moe__f16_to_f32(f.d) * (float)acc + moe__f16_to_f32(f.m) * (float)x[i].sum);
    }
    return s;
}
KQ_NEON_BODY float k4_neon_body(int type, const void *w, const moe__block_q8a *x, int64_t n, dot32_fn dot32) {
    const int64_t bs = moe__row_bytes(type, 256);
    float s = 0;
    for (int64_t i = 0; i < n / 256; i++, x += 8) {
        const unsigned char *b = (const unsigned char *)w + i * bs;
        const uint8_t *qs = b + (type == MOE_T_Q4_K ? 16 : 48);
        uint8x16_t h0 = vdupq_n_u8(0), h1 = h0;
        if (type == MOE_T_Q5_K) h0 = vld1q_u8(b + 16), h1 = vld1q_u8(b + 32);
        uint8_t sm[16];
        uint16_t hd[2];
        memcpy(hd, b, 4);
        k4_unpack_scales(b + 4, sm);
        const float d = moe__f16_to_f32(hd[0]), dmin = moe__f16_to_f32(hd[1]);
        for (int j = 0; j < 8; j++) {
            const uint8x16_t r0 = vld1q_u8(qs + 32 * (j / 2)), r1 = vld1q_u8(qs + 32 * (j / 2) + 16);
            uint8x16_t lo = (j & 1) ? vshrq_n_u8(r0, 4) : vandq_u8(r0, vdupq_n_u8(15));
            uint8x16_t hi = (j & 1) ? vshrq_n_u8(r1, 4) : vandq_u8(r1, vdupq_n_u8(15));
            if (type == MOE_T_Q5_K) { /* bit j of qh[l] */
                const uint8x16_t bj = vdupq_n_u8((uint8_t)(1u << j)), b4 = vdupq_n_u8(16);
                lo = vorrq_u8(lo, vandq_u8(vtstq_u8(h0, bj), b4)), hi = vorrq_u8(hi, vandq_u8(vtstq_u8(h1, bj), b4));
            }
            int a1, a0 = dot32(lo, hi, x[j].qs, &a1);
            s += x[j].d * (d * (float)sm[j] * (float)(a0 + a1) - dmin * (float)sm[8 + j] * (float)x[j].sum);
        }
    }
    return s;
}
KQ_NEON_BODY float q6_k_neon_body(const void *w, const moe__block_q8a *x, int64_t n, dot32_fn dot32) {
    const moe__block_q6_k *b = w;
    float s = 0;
    for (int64_t i = 0; i < n / 256; i++, x += 8) {
        const float d = moe__f16_to_f32(b[i].d);
        for (int t = 0; t < 8; t++) {
            const int h = t / 4, k = t % 4;
            const uint8_t *ql = b[i].ql + 64 * h + (k & 1) * 32, *qhp = b[i].qh + 32 * h;
            uint8x16_t v[2];
            for (int u = 0; u < 2; u++) {
                const uint8x16_t l = vld1q_u8(ql + 16 * u), qh = vld1q_u8(qhp + 16 * u);
                const uint8x16_t low = k < 2 ? vandq_u8(l, vdupq_n_u8(15)) : vshrq_n_u8(l, 4);
                const uint8x16_t top = vandq_u8(k == 0 ? vshlq_n_u8(qh, 4) : k == 1 ? vshlq_n_u8(qh, 2) : k == 2 ? qh : vshrq_n_u8(qh, 2), vdupq_n_u8(0x30));
                v[u] = vreinterpretq_u8_s8(vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(low, top)), vdupq_n_s8(32)));
            }
            int a1, a0 = dot32(v[0], v[1], x[t].qs, &a1);
            s += x[t].d * (d * (float)(b[i].scales[2 * t] * a0 + b[i].scales[2 * t + 1] * a1));
        }
    }
    return s;
}

/* The grid formats' sub-block s (32 values) as two vectors of signed bytes, value = dc sc[l / 16]
 * v, as iq_sub decodes them: grid entries by scalar loads, signs by byte masks (7-bit indices
 * through sign_masks7, sign bytes by a bit test), IQ1's 8 g +- 1 by a shift. Returns dc. */
static inline int8x16_t iq_pair_neon(uint64_t a, uint64_t b) { return vreinterpretq_s8_u64(vcombine_u64(vcreate_u64(a), vcreate_u64(b))); }
static inline int8x16_t iq_negate_neon(int8x16_t g, int8x16_t m) { return vsubq_s8(veorq_s8(g, m), m); }
static inline int8x16_t iq_sign_bytes_neon(uint8_t s0, uint8_t s1) {
    static const uint8_t bit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    return vreinterpretq_s8_u8(vtstq_u8(vcombine_u8(vdup_n_u8(s0), vdup_n_u8(s1)), vld1q_u8(bit)));
}
KQ_NEON_BODY float iq_sub_neon(int type, const void *row, int64_t s, int8x16_t v[2], int sc[2]) {
    const int j = (int)(s % 8);
    switch (type) {
    case MOE_T_IQ2_XXS: {
        const moe__block_iq2_xxs *b = (const moe__block_iq2_xxs *)row + s / 8;
        const uint32_t x = b->qs[4 * j] | (uint32_t)b->qs[4 * j + 1] << 16, a = b->qs[4 * j + 2] | (uint32_t)b->qs[4 * j + 3] << 16;
        for (int h = 0; h < 2; h++)
            v[h] = iq_negate_neon(iq_pair_neon(iq2xxs_grid[(x >> (16 * h)) & 255], iq2xxs_grid[(x >> (16 * h + 8)) & 255]),
                                  iq_pair_neon(sign_masks7[(a >> (14 * h)) & 127], sign_masks7[(a >> (14 * h + 7)) & 127]));
        sc[0] = sc[1] = 2 * (int)(a >> 28) + 1;
        return moe__f16_to_f32(b->d) * 0.125f;
    }
    case MOE_T_IQ2_XS: {
        const moe__block_iq2_xs *b = (const moe__block_iq2_xs *)row + s / 8;
        const uint16_t *q = b->qs + 4 * j;
        for (int h = 0; h < 2; h++)
            v[h] = iq_negate_neon(iq_pair_neon(iq2xs_grid[q[2 * h] & 511], iq2xs_grid[q[2 * h + 1] & 511]),
                                  iq_pair_neon(sign_masks7[q[2 * h] >> 9], sign_masks7[q[2 * h + 1] >> 9]));
        sc[0] = 2 * (b->scales[j] & 15) + 1, sc[1] = 2 * (b->scales[j] >> 4) + 1;
        return moe__f16_to_f32(b->d) * 0.125f;
    }
    case MOE_T_IQ2_S: {
        const moe__block_iq2_s *b = (const moe__block_iq2_s *)row + s / 8;
        const uint8_t *q = b->qs + 4 * j, *sg = b->qs + 32 + 4 * j;
        const unsigned hb = b->qh[j];
        for (int h = 0; h < 2; h++)
            v[h] = iq_negate_neon(iq_pair_neon(iq2s_grid[q[2 * h] | (hb << (8 - 4 * h) & 0x300)], iq2s_grid[q[2 * h + 1] | (hb << (6 - 4 * h) & 0x300)]),
                                  iq_sign_bytes_neon(sg[2 * h], sg[2 * h + 1]));
        sc[0] = 2 * (b->scales[j] & 15) + 1, sc[1] = 2 * (b->scales[j] >> 4) + 1;
        return moe__f16_to_f32(b->d) * 0.125f;
    }
    case MOE_T_IQ3_XXS: {
        const moe__block_iq3_xxs *b = (const moe__block_iq3_xxs *)row + s / 8;
        const uint8_t *q = b->qs + 8 * j;
        const uint32_t a = le32_of(b->qs + 64 + 4 * j);
        for (int h = 0; h < 2; h++)
            v[h] = iq_negate_neon(iq_pair_neon(iq3xxs_grid[q[4 * h]] | (uint64_t)iq3xxs_grid[q[4 * h + 1]] << 32,
                                               iq3xxs_grid[q[4 * h + 2]] | (uint64_t)iq3xxs_grid[q[4 * h + 3]] << 32),
                                  iq_pair_neon(sign_masks7[(a >> (14 * h)) & 127], sign_masks7[(a >> (14 * h + 7)) & 127]));
        sc[0] = sc[1] = 2 * (int)(a >> 28) + 1;
        return moe__f16_to_f32(b->d) * 0.25f;
    }
    case MOE_T_IQ3_S: {
        const moe__block_iq3_s *b = (const moe__block_iq3_s *)row + s / 8;
        const uint8_t *q = b->qs + 8 * j, *sg = b->signs + 4 * j;
        const unsigned hb = b->qh[j];
        uint64_t g[4];
        for (int k = 0; k < 4; k++)
            g[k] = iq3s_grid[q[2 * k] | (hb << (8 - 2 * k) & 256)] | (uint64_t)iq3s_grid[q[2 * k + 1] | (hb << (7 - 2 * k) & 256)] << 32;
        for (int h = 0; h < 2; h++) v[h] = iq_negate_neon(iq_pair_neon(g[2 * h], g[2 * h + 1]), iq_sign_bytes_neon(sg[2 * h], sg[2 * h + 1]));
        sc[0] = sc[1] = 2 * ((b->scales[j / 2] >> (4 * (j % 2))) & 15) + 1;
        return moe__f16_to_f32(b->d);
    }
    case MOE_T_IQ1_S: {
        const moe__block_iq1_s *b = (const moe__block_iq1_s *)row + s / 8;
        const uint8_t *q = b->qs + 4 * j;
        const unsigned hb = b->qh[j];
        const int8x16_t e = vdupq_n_s8(hb & 0x8000 ? -1 : 1);
        for (int h = 0; h < 2; h++)
            v[h] = vaddq_s8(vshlq_n_s8(iq_pair_neon(iq1s_grid[q[2 * h] | (hb >> (6 * h) & 7) << 8], iq1s_grid[q[2 * h + 1] | (hb >> (6 * h + 3) & 7) << 8]), 3), e);
        sc[0] = sc[1] = 2 * (int)((hb >> 12) & 7) + 1;
        return moe__f16_to_f32(b->d) * 0.125f;
    }
    case MOE_T_IQ1_M: {
        const moe__block_iq1_m *b = (const moe__block_iq1_m *)row + s / 8;
        const uint8_t *q = b->qs + 4 * j;
        unsigned wd[4];
        for (int k = 0; k < 4; k++) wd[k] = b->scales[2 * k] | (unsigned)b->scales[2 * k + 1] << 8;
        for (int h = 0; h < 2; h++) {
            const unsigned hb = b->qh[2 * j + h]; /* this pair of 8s' index bits and shift signs, a nibble each */
            const int8x16_t e = vcombine_s8(vdup_n_s8(hb & 0x08 ? -1 : 1), vdup_n_s8(hb & 0x80 ? -1 : 1));
            v[h] = vaddq_s8(vshlq_n_s8(iq_pair_neon(iq1s_grid[q[2 * h] | (hb & 7) << 8], iq1s_grid[q[2 * h + 1] | (hb >> 4 & 7) << 8]), 3), e);
        }
        const unsigned sk = wd[j / 2] >> (6 * (j % 2));
        sc[0] = 2 * (int)(sk & 7) + 1, sc[1] = 2 * (int)((sk >> 3) & 7) + 1;
        return moe__f16_to_f32((uint16_t)((wd[0] >> 12) | ((wd[1] >> 8) & 0xf0) | ((wd[2] >> 4) & 0xf00) | (wd[3] & 0xf000))) * 0.125f;
    }
    default: return 0;
    }
}

/* Q2_K, Q3_K, IQ4_NL, IQ4_XS: each sub-block's values decoded to signed bytes (IQ4 by one table
 * lookup), its two 16s' products summed exactly, then d (sc0 a0 + sc1 a1) in float (Q2_K: minus
 * dmin (m0 sum(x first 16) + m1 sum(x last 16))) */
KQ_NEON_BODY float k16_neon_body(int type, const void *w, const moe__block_q8a *x, int64_t n, dot32_fn dot32) {
    const int8x16_t kv = vld1q_s8(moe__iq4nl_values);
    float s = 0;
    if (type == MOE_T_IQ4_NL) {
        const moe__block_iq4_nl *b = w;
        for (int64_t i = 0; i < n / 32; i++) {
            const uint8x16_t r = vld1q_u8(b[i].qs);
            const int8x16_t lo = vqtbl1q_s8(kv, vandq_u8(r, vdupq_n_u8(15))), hi = vqtbl1q_s8(kv, vshrq_n_u8(r, 4));
            int a1, a0 = dot32(vreinterpretq_u8_s8(lo), vreinterpretq_u8_s8(hi), x[i].qs, &a1);
            s += x[i].d * (moe__f16_to_f32(b[i].d) * (float)(a0 + a1));
        }
        return s;
    }
    for (int64_t i = 0; i < n / 256; i++, x += 8) {
        for (int j = 0; j < 8; j++) {
            int8x16_t v[2];
            int sc0, sc1, m0 = 0, m1 = 0;
            float d, dmin = 0;
            if (iq_type(type)) { /* the grid formats */
                int sc[2];
                d = iq_sub_neon(type, w, 8 * i + j, v, sc);
                sc0 = sc[0], sc1 = sc[1];
            } else if (type == MOE_T_IQ4_XS) {
                const moe__block_iq4_xs *b = (const moe__block_iq4_xs *)w + i;
                const uint8x16_t r = vld1q_u8(b->qs + 16 * j);
                v[0] = vqtbl1q_s8(kv, vandq_u8(r, vdupq_n_u8(15))), v[1] = vqtbl1q_s8(kv, vshrq_n_u8(r, 4));
                sc0 = sc1 = iq4xs_scale(b, j) - 32, d = moe__f16_to_f32(b->d);
            } else {
                const uint8_t *qs;
                const int8x16_t sh = vdupq_n_s8((int8_t)(-2 * (j % 4)));
                if (type == MOE_T_Q2_K) {
                    const moe__block_q2_k *b = (const moe__block_q2_k *)w + i;
                    qs = b->qs, d = moe__f16_to_f32(b->d), dmin = moe__f16_to_f32(b->dmin);
                    sc0 = b->scales[2 * j] & 15, sc1 = b->scales[2 * j + 1] & 15, m0 = b->scales[2 * j] >> 4, m1 = b->scales[2 * j + 1] >> 4;
                } else {
                    const moe__block_q3_k *b = (const moe__block_q3_k *)w + i;
                    qs = b->qs, d = moe__f16_to_f32(b->d);
                    sc0 = q3k_scale(b->scales, 2 * j) - 32, sc1 = q3k_scale(b->scales, 2 * j + 1) - 32;
                }
                for (int u = 0; u < 2; u++) {
                    uint8x16_t q = vandq_u8(vshlq_u8(vld1q_u8(qs + 32 * (j / 4) + 16 * u), sh), vdupq_n_u8(3));
                    if (type == MOE_T_Q3_K) { /* bit j of hmask[l] */
                        const uint8x16_t hm = vld1q_u8(((const moe__block_q3_k *)w + i)->hmask + 16 * u);
                        q = vorrq_u8(q, vandq_u8(vtstq_u8(hm, vdupq_n_u8((uint8_t)(1u << j))), vdupq_n_u8(4)));
                        v[u] = vsubq_s8(vreinterpretq_s8_u8(q), vdupq_n_s8(4));
                    } else {
                        v[u] = vreinterpretq_s8_u8(q);
                    }
                }
            }
            int a1, a0 = dot32(vreinterpretq_u8_s8(v[0]), vreinterpretq_u8_s8(v[1]), x[j].qs, &a1);
            float t = d * (float)(sc0 * a0 + sc1 * a1);
            if (type == MOE_T_Q2_K) {
                const int h0 = vaddlvq_s8(vld1q_s8(x[j].qs)), h1 = vaddlvq_s8(vld1q_s8(x[j].qs + 16));
                t -= dmin * (float)(m0 * h0 + m1 * h1);
            }
            s += x[j].d * t;
        }
    }
    return s;
}
/* the row kernels of one NEON level: SFX names them, ATTR is its target, DOT32 its 32-value dot */
#define KQ_NEON_KERNELS(SFX, ATTR, DOT32)                                                                                               \
    ATTR static float dotq_q4_1_##SFX(const void *w, const moe__block_q8a *x, int64_t n) { return q4_1_q5_neon_body(MOE_T_Q4_1, w, x, n, DOT32); } \
    ATTR static float dotq_q5_0_##SFX(const void *w, const moe__block_q8a *x, int64_t n) { return q4_1_q5_neon_body(MOE_T_Q5_0, w, x, n, DOT32); } \
    ATTR static float dotq_q5_1_##SFX(const void *w, const moe__block_q8a *x, int64_t n) { return q4_1_q5_neon_body(MOE_T_Q5_1, w, x, n, DOT32); } \
    ATTR static float dotq_q4_k_##SFX(const void *w, const moe__block_q8a *x, int64_t n) { return k4_neon_body(MOE_T_Q4_K, w, x, n, DOT32); }      \
    ATTR static float dotq_q5_k_##SFX(const void *w, const moe__block_q8a *x, int64_t n) { return k4_neon_body(MOE_T_Q5_K, w, x, n, DOT32); }      \
    ATTR static float dotq_q6_k_##SFX(const void *w, const moe__block_q8a *x, int64_t n) { return q6_k_neon_body(w, x, n, DOT32); }                \
    ATTR static float dotq_q2_k_##SFX(const void *w, const moe__block_q8a *x, int64_t n) { return k16_neon_body(MOE_T_Q2_K, w, x, n, DOT32); }     \
    ATTR static float dotq_q3_k_##SFX(const void *w, const moe__block_q8a *x, int64_t n) { return k16_neon_body(MOE_T_Q3_K, w, x, n, DOT32); }     \
    ATTR static float dotq_iq4_nl_##SFX(const void *w, const moe__block_q8a *x, int64_t n) { return k16_neon_body(MOE_T_IQ4_NL, w, x, n, DOT32); } \
    ATTR static float dotq_iq4_xs_##SFX(const void *w, const moe__block_q8a *x, int64_t n) { return k16_neon_body(MOE_T_IQ4_XS, w, x, n, DOT32); } \
    ATTR static float dotq_iq2_xxs_##SFX(const void *w, const moe__block_q8a *x, int64_t n) { return k16_neon_body(MOE_T_IQ2_XXS, w, x, n, DOT32); } \
    ATTR static float dotq_iq2_xs_##SFX(const void *w, const moe__block_q8a *x, int64_t n) { return k16_neon_body(MOE_T_IQ2_XS, w, x, n, DOT32); } \
    ATTR static float dotq_iq2_s_##SFX(const void *w, const moe__block_q8a *x, int64_t n) { return k16_neon_body(MOE_T_IQ2_S, w, x, n, DOT32); } \
    ATTR static float dotq_iq3_xxs_##SFX(const void *w, const moe__block_q8a *x, int64_t n) { return k16_neon_body(MOE_T_IQ3_XXS, w, x, n, DOT32); } \
    ATTR static float dotq_iq3_s_##SFX(const void *w, const moe__block_q8a *x, int64_t n) { return k16_neon_body(MOE_T_IQ3_S, w, x, n, DOT32); } \
    ATTR static float dotq_iq1_s_##SFX(const void *w, const moe__block_q8a *x, int64_t n) { return k16_neon_body(MOE_T_IQ1_S, w, x, n, DOT32); } \
    ATTR static float dotq_iq1_m_##SFX(const void *w, const moe__block_q8a *x, int64_t n) { return k16_neon_body(MOE_T_IQ1_M, w, x, n, DOT32); }
KQ_NEON_KERNELS(neon, , dot32_neon)
/* defines dotq_iq1_m_neon(), dotq_iq1_s_neon(), dotq_iq2_s_neon(), dotq_iq2_xs_neon(),
 * dotq_iq2_xxs_neon(), dotq_iq3_s_neon(), dotq_iq3_xxs_neon(), dotq_iq4_nl_neon(),
 * dotq_iq4_xs_neon(), dotq_q2_k_neon(), dotq_q3_k_neon(), dotq_q4_1_neon(), dotq_q4_k_neon(),
 * dotq_q5_0_neon(), dotq_q5_1_neon(), dotq_q5_k_neon(), dotq_q6_k_neon() */

/* x8 groups without SDOT: 16 bytes = 4 rows x 4 values against the same 4 activations; products
 * in int16 (|w x| <= 128 * 127), then summed per row: two pairwise steps into int32 */
static inline int32x4_t rows4_neon(int32x4_t acc, int8x16_t w, int8x16_t xb) {
    int32x4_t lo = vpaddlq_s16(vmull_s8(vget_low_s8(w), vget_low_s8(xb)));   /* r0 r0 r1 r1 */
    int32x4_t hi = vpaddlq_s16(vmull_s8(vget_high_s8(w), vget_high_s8(xb))); /* r2 r2 r3 r3 */
    return vaddq_s32(acc, vpaddq_s32(lo, hi));
}

/* 4 rows' fp16 scales of a Q4_0X8/Q8_0X8 block in floats */
static inline float32x4_t x8_fp16_scales_neon(const uint16_t *d) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(d))); }

/* x8 groups of Q4_0 (Q4_0X8): chunk c holds [row][4] bytes, rows 0-3 in the first 16 bytes, 4-7
 * in the next; ROWS4 sums each row's 4 products into its lane (rows4_neon, or SDOT) */
#define Q4_0X8_NEON_BODY(ROWS4)                                                                                    \
    const moe__block_q4_0x8 *o = w;                                                                                \
    float32x4_t acc0 = vdupq_n_f32(0), acc1 = vdupq_n_f32(0);                                                      \
    for (int64_t b = 0; b < n / 32; b++) {                                                                         \
        prefetch_ahead(o + b, sizeof *o);                                                                          \
        const int32_t *xq = (const int32_t *)x[b].qs;                                                              \
        int32x4_t s0 = vdupq_n_s32(-8 * x[b].sum), s1 = s0;                                                        \
        for (int c = 0; c < 4; c++) {                                                                              \
            uint8x16_t v0 = vld1q_u8(o[b].qs + 32 * c), v1 = vld1q_u8(o[b].qs + 32 * c + 16);                      \
            int8x16_t xl = vreinterpretq_s8_s32(vdupq_n_s32(xq[c])), xh = vreinterpretq_s8_s32(vdupq_n_s32(xq[c + 4])); \
            s0 = ROWS4(s0, vreinterpretq_s8_u8(vandq_u8(v0, vdupq_n_u8(15))), xl);                                 \
            s1 = ROWS4(s1, vreinterpretq_s8_u8(vandq_u8(v1, vdupq_n_u8(15))), xl);                                 \
            s0 = ROWS4(s0, vreinterpretq_s8_u8(vshrq_n_u8(v0, 4)), xh);                                            \
            s1 = ROWS4(s1, vreinterpretq_s8_u8(vshrq_n_u8(v1, 4)), xh);                                            \
        }                                                                                                          \
        acc0 = vfmaq_f32(acc0, vmulq_n_f32(x8_fp16_scales_neon(o[b].d), x[b].d), vcvtq_f32_s32(s0));              \
        acc1 = vfmaq_f32(acc1, vmulq_n_f32(x8_fp16_scales_neon(o[b].d + 4), x[b].d), vcvtq_f32_s32(s1));          \
    }                                                                                                              \
    vst1q_f32(out, acc0);                                                                                          \
    vst1q_f32(out + 4, acc1)

static void dotq8_q4_0_neon(const void *w, const moe__block_q8a *x, int64_t n, float *out) { Q4_0X8_NEON_BODY(rows4_neon); }

/* MXFP4x8: codes looked up as signed 2 E2M1 (no bias); the 4 rows' E8M0 scales at e as
 * 0.5 * 2^(e-127) in floats, as e8m0() makes them */
static inline float32x4_t mxfp4x8_scales_neon(const uint8_t *e) {
    const uint32x4_t v = {e[0], e[1], e[2], e[3]};
    uint32x4_t bits = vshlq_n_u32(v, 23);
    bits = vbslq_u32(vceqq_u32(v, vdupq_n_u32(0)), vdupq_n_u32(0x00400000), bits);
    bits = vbslq_u32(vceqq_u32(v, vdupq_n_u32(255)), vdupq_n_u32(0x7fc00000), bits);
    return vmulq_n_f32(vreinterpretq_f32_u32(bits), 0.5f);
}

/* ROWS4(acc, codes, activations): rows4_neon here, SDOT in the dotprod kernel */
#define MXFP4X8_NEON_BODY(ROWS4)                                                                                   \
    const moe__block_mxfp4x8 *o = w;                                                                               \
    const int8x16_t lut = vld1q_s8(e2m1x2);                                                                        \
    float32x4_t acc0 = vdupq_n_f32(0), acc1 = vdupq_n_f32(0);                                                      \
    for (int64_t b = 0; b < n / 32; b++) {                                                                         \
        prefetch_ahead(o + b, sizeof *o);                                                                          \
        const int32_t *xq = (const int32_t *)x[b].qs;                                                              \
        int32x4_t s0 = vdupq_n_s32(0), s1 = s0;                                                                    \
        for (int c = 0; c < 4; c++) {                                                                              \
            const uint8x16_t v0 = vld1q_u8(o[b].qs + 32 * c), v1 = vld1q_u8(o[b].qs + 32 * c + 16);                \
            const int8x16_t xl = vreinterpretq_s8_s32(vdupq_n_s32(xq[c])), xh = vreinterpretq_s8_s32(vdupq_n_s32(xq[c + 4])); \
            s0 = ROWS4(s0, vqtbl1q_s8(lut, vandq_u8(v0, vdupq_n_u8(15))), xl);                                     \
            s1 = ROWS4(s1, vqtbl1q_s8(lut, vandq_u8(v1, vdupq_n_u8(15))), xl);                                     \
            s0 = ROWS4(s0, vqtbl1q_s8(lut, vshrq_n_u8(v0, 4)), xh);                                                \
            s1 = ROWS4(s1, vqtbl1q_s8(lut, vshrq_n_u8(v1, 4)), xh);                                                \
        }                                                                                                          \
        acc0 = vfmaq_f32(acc0, vmulq_n_f32(mxfp4x8_scales_neon(o[b].e), x[b].d), vcvtq_f32_s32(s0));              \
        acc1 = vfmaq_f32(acc1, vmulq_n_f32(mxfp4x8_scales_neon(o[b].e + 4), x[b].d), vcvtq_f32_s32(s1));          \
    }                                                                                                              \
    vst1q_f32(out, acc0);                                                                                          \
    vst1q_f32(out + 4, acc1)

static void dotq8_mxfp4_neon(const void *w, const moe__block_q8a *x, int64_t n, float *out) { MXFP4X8_NEON_BODY(rows4_neon); }

/* x8 groups of Q8_0 (Q8_0X8), stored as w + 128 */
#define Q8_0X8_NEON_BODY(ROWS4)                                                                                    \
    const moe__block_q8_0x8 *o = w;                                                                                \
    float32x4_t acc0 = vdupq_n_f32(0), acc1 = vdupq_n_f32(0);                                                      \
    const uint8x16_t flip = vdupq_n_u8(0x80); /* back to signed w */                                               \
    for (int64_t b = 0; b < n / 32; b++) {                                                                         \
        prefetch_ahead(o + b, sizeof *o);                                                                          \
        const int32_t *xq = (const int32_t *)x[b].qs;                                                              \
        int32x4_t s0 = vdupq_n_s32(0), s1 = s0;                                                                    \
        for (int c = 0; c < 8; c++) {                                                                              \
            int8x16_t xb = vreinterpretq_s8_s32(vdupq_n_s32(xq[c]));                                               \
            s0 = ROWS4(s0, vreinterpretq_s8_u8(veorq_u8(vld1q_u8(o[b].qs + 32 * c), flip)), xb);                   \
            s1 = ROWS4(s1, vreinterpretq_s8_u8(veorq_u8(vld1q_u8(o[b].qs + 32 * c + 16), flip)), xb);              \
        }                                                                                                          \
        acc0 = vfmaq_f32(acc0, vmulq_n_f32(x8_fp16_scales_neon(o[b].d), x[b].d), vcvtq_f32_s32(s0));              \
        acc1 = vfmaq_f32(acc1, vmulq_n_f32(x8_fp16_scales_neon(o[b].d + 4), x[b].d), vcvtq_f32_s32(s1));          \
    }                                                                                                              \
    vst1q_f32(out, acc0);                                                                                          \
    vst1q_f32(out + 4, acc1)

static void dotq8_q8_0_neon(const void *w, const moe__block_q8a *x, int64_t n, float *out) { Q8_0X8_NEON_BODY(rows4_neon); }

/* absorbed MLA, 4 lanes: scores 4 heads at a time, ctx 2 heads x 16 latent floats */
static void mla_scores_neon(const moe__mla_block *b) {
    const int r = b->r, dr = b->dr;
    if (r % 4 || dr % 4) { moe__mla_scores_ref(b); return; }
    const size_t qs = (size_t)b->qr_stride;
    for (int j = b->j0; j < b->j1; j++) {
        const float *c = b->cache + (size_t)j * b->cw;
        prefetch_row(bytes_past(c, sizeof(float) * 4 * (size_t)b->cw), b->cw * 4); /* the key four rows on, from memory */
        int h = 0;
        for (; h + 4 <= b->H; h += 4) {
            const float *a0 = b->qa + (size_t)h * r, *a1 = a0 + r, *a2 = a1 + r, *a3 = a2 + r;
            const float *q0 = b->qr + (size_t)h * qs, *q1 = q0 + qs, *q2 = q1 + qs, *q3 = q2 + qs;
            float32x4_t s0 = vdupq_n_f32(0), s1 = s0, s2 = s0, s3 = s0;
            for (int i = 0; i < r; i += 4) {
                float32x4_t cv = vld1q_f32(c + i);
                s0 = vfmaq_f32(s0, vld1q_f32(a0 + i), cv), s1 = vfmaq_f32(s1, vld1q_f32(a1 + i), cv);
                s2 = vfmaq_f32(s2, vld1q_f32(a2 + i), cv), s3 = vfmaq_f32(s3, vld1q_f32(a3 + i), cv);
            }
            for (int i = 0; i < dr; i += 4) {
                float32x4_t cv = vld1q_f32(c + r + i);
                s0 = vfmaq_f32(s0, vld1q_f32(q0 + i), cv), s1 = vfmaq_f32(s1, vld1q_f32(q1 + i), cv);
                s2 = vfmaq_f32(s2, vld1q_f32(q2 + i), cv), s3 = vfmaq_f32(s3, vld1q_f32(q3 + i), cv);
            }
            b->sc[(size_t)h * b->ld + j] = vaddvq_f32(s0) * b->scale;
            b->sc[(size_t)(h + 1) * b->ld + j] = vaddvq_f32(s1) * b->scale;
            b->sc[(size_t)(h + 2) * b->ld + j] = vaddvq_f32(s2) * b->scale;
            b->sc[(size_t)(h + 3) * b->ld + j] = vaddvq_f32(s3) * b->scale;
        }
        for (; h < b->H; h++) {
            float32x4_t s0 = vdupq_n_f32(0);
            for (int i = 0; i < r; i += 4) s0 = vfmaq_f32(s0, vld1q_f32(b->qa + (size_t)h * r + i), vld1q_f32(c + i));
            for (int i = 0; i < dr; i += 4) s0 = vfmaq_f32(s0, vld1q_f32(b->qr + (size_t)h * qs + i), vld1q_f32(c + r + i));
            b->sc[(size_t)h * b->ld + j] = vaddvq_f32(s0) * b->scale;
        }
    }
}

static void mla_ctx_neon(const moe__mla_block *b, int h0, int h1) {
    const int r = b->r;
    if (r % 16) { moe__mla_ctx_ref(b, h0, h1); return; }
    int h = h0;
    for (; h + 2 <= h1; h += 2) {
        const float *p0 = b->sc + (size_t)h * b->ld, *p1 = p0 + b->ld;
        float *c0 = b->ctx + (size_t)h * r, *c1 = c0 + r;
        for (int i = 0; i < r; i += 16) {
            float32x4_t x0 = vld1q_f32(c0 + i), x1 = vld1q_f32(c0 + i + 4), x2 = vld1q_f32(c0 + i + 8), x3 = vld1q_f32(c0 + i + 12);
            float32x4_t y0 = vld1q_f32(c1 + i), y1 = vld1q_f32(c1 + i + 4), y2 = vld1q_f32(c1 + i + 8), y3 = vld1q_f32(c1 + i + 12);
            for (int j = 0; j < b->jn; j++) {
                const float *c = b->cache + (size_t)j * b->cw + i;
                const float a = p0[j], bb = p1[j];
                const float32x4_t v0 = vld1q_f32(c), v1 = vld1q_f32(c + 4), v2 = vld1q_f32(c + 8), v3 = vld1q_f32(c + 12);
                x0 = vfmaq_n_f32(x0, v0, a), x1 = vfmaq_n_f32(x1, v1, a), x2 = vfmaq_n_f32(x2, v2, a), x3 = vfmaq_n_f32(x3, v3, a);
                y0 = vfmaq_n_f32(y0, v0, bb), y1 = vfmaq_n_f32(y1, v1, bb), y2 = vfmaq_n_f32(y2, v2, bb), y3 = vfmaq_n_f32(y3, v3, bb);
            }
            vst1q_f32(c0 + i, x0), vst1q_f32(c0 + i + 4, x1), vst1q_f32(c0 + i + 8, x2), vst1q_f32(c0 + i + 12, x3);
            vst1q_f32(c1 + i, y0), vst1q_f32(c1 + i + 4, y1), vst1q_f32(c1 + i + 8, y2), vst1q_f32(c1 + i + 12, y3);
        }
    }
    if (h < h1) moe__mla_ctx_ref(b, h, h1);
}

/* integer kernels with the dot-product extension (SDOT: 4 int8 products into each int32 lane) */
#define MOE_DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))

MOE_DOTPROD static inline int dot32_sdot(uint8x16_t lo, uint8x16_t hi, const int8_t *x, int *a1) {
    *a1 = vaddvq_s32(vdotq_s32(vdupq_n_s32(0), vreinterpretq_s8_u8(hi), vld1q_s8(x + 16)));
    return vaddvq_s32(vdotq_s32(vdupq_n_s32(0), vreinterpretq_s8_u8(lo), vld1q_s8(x)));
}
KQ_NEON_KERNELS(sdot, MOE_DOTPROD, dot32_sdot)
/* defines dotq_iq1_m_sdot(), dotq_iq1_s_sdot(), dotq_iq2_s_sdot(), dotq_iq2_xs_sdot(),
 * dotq_iq2_xxs_sdot(), dotq_iq3_s_sdot(), dotq_iq3_xxs_sdot(), dotq_iq4_nl_sdot(),
 * dotq_iq4_xs_sdot(), dotq_q2_k_sdot(), dotq_q3_k_sdot(), dotq_q4_1_sdot(), dotq_q4_k_sdot(),
 * dotq_q5_0_sdot(), dotq_q5_1_sdot(), dotq_q5_k_sdot(), dotq_q6_k_sdot() */

MOE_DOTPROD static float dotq_q8_0_dotprod(const void *w, const moe__block_q8a *x, int64_t n) {
    const moe__block_q8_0 *b = w;
    float32x4_t acc = vdupq_n_f32(0);
    for (int64_t i = 0; i < n / 32; i++) {
        int32x4_t s = vdotq_s32(vdupq_n_s32(0), vld1q_s8(b[i].qs), vld1q_s8(x[i].qs));
        s = vdotq_s32(s, vld1q_s8(b[i].qs + 16), vld1q_s8(x[i].qs + 16));
        acc = vfmaq_n_f32(acc, vcvtq_f32_s32(s), moe__f16_to_f32(b[i].d) * x[i].d);
    }
    return vaddvq_f32(acc);
}

MOE_DOTPROD static float dotq_q4_0_dotprod(const void *w, const moe__block_q8a *x, int64_t n) {
    const moe__block_q4_0 *b = w;
    float32x4_t acc = vdupq_n_f32(0);
    for (int64_t i = 0; i < n / 32; i++) {
        uint8x16_t raw = vld1q_u8(b[i].qs);
        int8x16_t lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(raw, vdupq_n_u8(15))), vdupq_n_s8(8));
        int8x16_t hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(raw, 4)), vdupq_n_s8(8));
        int32x4_t s = vdotq_s32(vdotq_s32(vdupq_n_s32(0), lo, vld1q_s8(x[i].qs)), hi, vld1q_s8(x[i].qs + 16));
        acc = vfmaq_n_f32(acc, vcvtq_f32_s32(s), moe__f16_to_f32(b[i].d) * x[i].d);
    }
    return vaddvq_f32(acc);
}

MOE_DOTPROD static void dotq8_q4_0_dotprod(const void *w, const moe__block_q8a *x, int64_t n, float *out) { Q4_0X8_NEON_BODY(vdotq_s32); }
MOE_DOTPROD static void dotq8_mxfp4_dotprod(const void *w, const moe__block_q8a *x, int64_t n, float *out) { MXFP4X8_NEON_BODY(vdotq_s32); }
#undef MXFP4X8_NEON_BODY

MOE_DOTPROD static void dotq8_q8_0_dotprod(const void *w, const moe__block_q8a *x, int64_t n, float *out) { Q8_0X8_NEON_BODY(vdotq_s32); }
#undef Q4_0X8_NEON_BODY
#undef Q8_0X8_NEON_BODY

/* prefill: one x8 row group against 4 activation rows (x + t * xs), each row bit for bit the
 * 1-row dotprod kernel's result (exact integer sums, the same float steps), each chunk of
 * weights loaded and unpacked once. Named sums and accumulators: in arrays gcc kept them on the
 * stack. */
/* the 4 rows' block b: x0..x3, their 4-byte groups q0..q3, the integer sums s<row><half> set to
 * INIT(row's block) */
#define DOTPROD_X4_ROWS(INIT)                                                                                      \
    const moe__block_q8a *x0 = x + b, *x1 = x0 + xs, *x2 = x1 + xs, *x3 = x2 + xs;                                 \
    const int32_t *q0 = (const int32_t *)x0->qs, *q1 = (const int32_t *)x1->qs, *q2 = (const int32_t *)x2->qs;     \
    const int32_t *q3 = (const int32_t *)x3->qs;                                                                   \
    int32x4_t s00 = vdupq_n_s32(INIT(x0)), s01 = s00, s10 = vdupq_n_s32(INIT(x1)), s11 = s10;                      \
    int32x4_t s20 = vdupq_n_s32(INIT(x2)), s21 = s20, s30 = vdupq_n_s32(INIT(x3)), s31 = s30
/* the block's sums into the 4 rows' float sums a<row><half> */
#define DOTPROD_X4_ACC() DOTPROD_X4_ACC_DW(x8_fp16_scales_neon(o[b].d), x8_fp16_scales_neon(o[b].d + 4))
/* the same with the weights' scales DW0 (rows 0-3) and DW1 (rows 4-7) */
#define DOTPROD_X4_ACC_DW(DW0, DW1)                                                                                \
    do {                                                                                                           \
        const float32x4_t dw0 = DW0, dw1 = DW1;                                                                    \
        a00 = vfmaq_f32(a00, vmulq_n_f32(dw0, x0->d), vcvtq_f32_s32(s00));                                         \
        a01 = vfmaq_f32(a01, vmulq_n_f32(dw1, x0->d), vcvtq_f32_s32(s01));                                         \
        a10 = vfmaq_f32(a10, vmulq_n_f32(dw0, x1->d), vcvtq_f32_s32(s10));                                         \
        a11 = vfmaq_f32(a11, vmulq_n_f32(dw1, x1->d), vcvtq_f32_s32(s11));                                         \
        a20 = vfmaq_f32(a20, vmulq_n_f32(dw0, x2->d), vcvtq_f32_s32(s20));                                         \
        a21 = vfmaq_f32(a21, vmulq_n_f32(dw1, x2->d), vcvtq_f32_s32(s21));                                         \
        a30 = vfmaq_f32(a30, vmulq_n_f32(dw0, x3->d), vcvtq_f32_s32(s30));                                         \
        a31 = vfmaq_f32(a31, vmulq_n_f32(dw1, x3->d), vcvtq_f32_s32(s31));                                         \
    } while (0)
#define DOTPROD_X4_STORE()                                                                                         \
    vst1q_f32(out, a00), vst1q_f32(out + 4, a01), vst1q_f32(out + 8, a10), vst1q_f32(out + 12, a11),               \
        vst1q_f32(out + 16, a20), vst1q_f32(out + 20, a21), vst1q_f32(out + 24, a30), vst1q_f32(out + 28, a31)
/* the block's 4 nibble chunks of both halves (rows 0-3, 4-7) decoded by LO / HI into signed
 * bytes, chunk c against activation group c (low nibbles) and c + 4 (high), into the 4 rows' sums */
#define DOTPROD_X4_NIBBLES(LO, HI)                                                                                 \
    for (int c = 0; c < 4; c++) {                                                                                  \
        const uint8x16_t v0 = vld1q_u8(o[b].qs + 32 * c), v1 = vld1q_u8(o[b].qs + 32 * c + 16);                    \
        const int8x16_t l0 = LO(v0), l1 = LO(v1), h0 = HI(v0), h1 = HI(v1);                                        \
        DOTPROD_X4_NIBBLE_ROW(s00, s01, q0);                                                                       \
        DOTPROD_X4_NIBBLE_ROW(s10, s11, q1);                                                                       \
        DOTPROD_X4_NIBBLE_ROW(s20, s21, q2);                                                                       \
        DOTPROD_X4_NIBBLE_ROW(s30, s31, q3);                                                                       \
    }
#define DOTPROD_X4_NIBBLE_ROW(S0, S1, Q)                                                                           \
    do {                                                                                                           \
        const int8x16_t xl = vreinterpretq_s8_s32(vdupq_n_s32(Q[c])), xh = vreinterpretq_s8_s32(vdupq_n_s32(Q[c + 4])); \
        S0 = vdotq_s32(vdotq_s32(S0, l0, xl), h0, xh);                                                             \
        S1 = vdotq_s32(vdotq_s32(S1, l1, xl), h1, xh);                                                             \
    } while (0)

MOE_DOTPROD static void dotq8x4_q4_0_dotprod(const void *w, const moe__block_q8a *x, int64_t xs, int64_t n, float *out) {
    const moe__block_q4_0x8 *o = w;
    float32x4_t a00 = vdupq_n_f32(0), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    for (int64_t b = 0; b < n / 32; b++) {
        prefetch_ahead(o + b, sizeof *o);
#define BIAS(X) -8 * (X)->sum
        DOTPROD_X4_ROWS(BIAS);
#undef BIAS
#define LO(v) vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(15)))
#define HI(v) vreinterpretq_s8_u8(vshrq_n_u8(v, 4))
        DOTPROD_X4_NIBBLES(LO, HI);
#undef LO
#undef HI
        DOTPROD_X4_ACC();
    }
    DOTPROD_X4_STORE();
}

MOE_DOTPROD static void dotq8x4_q8_0_dotprod(const void *w, const moe__block_q8a *x, int64_t xs, int64_t n, float *out) {
    const moe__block_q8_0x8 *o = w;
    const uint8x16_t flip = vdupq_n_u8(0x80);
    float32x4_t a00 = vdupq_n_f32(0), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    for (int64_t b = 0; b < n / 32; b++) {
        prefetch_ahead(o + b, sizeof *o);
#define ZERO(X) 0
        DOTPROD_X4_ROWS(ZERO);
#undef ZERO
        for (int c = 0; c < 8; c++) {
            const int8x16_t v0 = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(o[b].qs + 32 * c), flip));
            const int8x16_t v1 = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(o[b].qs + 32 * c + 16), flip));
#define ROW(S0, S1, Q)                                                                                             \
    do {                                                                                                           \
        const int8x16_t xb = vreinterpretq_s8_s32(vdupq_n_s32(Q[c]));                                              \
        S0 = vdotq_s32(S0, v0, xb);                                                                                \
        S1 = vdotq_s32(S1, v1, xb);                                                                                \
    } while (0)
            ROW(s00, s01, q0);
            ROW(s10, s11, q1);
            ROW(s20, s21, q2);
            ROW(s30, s31, q3);
#undef ROW
        }
        DOTPROD_X4_ACC();
    }
    DOTPROD_X4_STORE();
}

MOE_DOTPROD static void dotq8x4_mxfp4_dotprod(const void *w, const moe__block_q8a *x, int64_t xs, int64_t n, float *out) {
    const moe__block_mxfp4x8 *o = w;
    const int8x16_t lut = vld1q_s8(e2m1x2);
    float32x4_t a00 = vdupq_n_f32(0), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    for (int64_t b = 0; b < n / 32; b++) {
        prefetch_ahead(o + b, sizeof *o);
#define ZERO(X) 0
        DOTPROD_X4_ROWS(ZERO);
#undef ZERO
#define LO(v) vqtbl1q_s8(lut, vandq_u8(v, vdupq_n_u8(15)))
#define HI(v) vqtbl1q_s8(lut, vshrq_n_u8(v, 4))
        DOTPROD_X4_NIBBLES(LO, HI);
#undef LO
#undef HI
        DOTPROD_X4_ACC_DW(mxfp4x8_scales_neon(o[b].e), mxfp4x8_scales_neon(o[b].e + 4));
    }
    DOTPROD_X4_STORE();
}
#undef DOTPROD_X4_ROWS
#undef DOTPROD_X4_ACC
#undef DOTPROD_X4_ACC_DW
#undef DOTPROD_X4_NIBBLES
#undef DOTPROD_X4_NIBBLE_ROW
#undef DOTPROD_X4_STORE

static int cpu_has_dotprod(void) {
#if defined(__linux__) && defined(HWCAP_ASIMDDP)
    return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#else
    return 0;
#endif
}

/* matrix tiles for prefill: 4 weight rows x 4 activation rows in 16 named accumulators (the
 * scheme of GEMM_AVX512 at 4 lanes: in an array gcc kept them in memory; a partial step at the
 * end of a row through zero-padded copies; a partial tile repeats its last row / token, computed
 * and not stored) */
#define GEMM_NEON_STEP(W0, W1, W2, W3, X0, X1, X2, X3)                                                             \
    do {                                                                                                           \
        const float32x4_t x0_ = X0, x1_ = X1, x2_ = X2, x3_ = X3;                                                  \
        float32x4_t w_ = W0;                                                                                       \
        t00 = vfmaq_f32(t00, w_, x0_), t01 = vfmaq_f32(t01, w_, x1_), t02 = vfmaq_f32(t02, w_, x2_), t03 = vfmaq_f32(t03, w_, x3_); \
        w_ = W1;                                                                                                   \
        t10 = vfmaq_f32(t10, w_, x0_), t11 = vfmaq_f32(t11, w_, x1_), t12 = vfmaq_f32(t12, w_, x2_), t13 = vfmaq_f32(t13, w_, x3_); \
        w_ = W2;                                                                                                   \
        t20 = vfmaq_f32(t20, w_, x0_), t21 = vfmaq_f32(t21, w_, x1_), t22 = vfmaq_f32(t22, w_, x2_), t23 = vfmaq_f32(t23, w_, x3_); \
        w_ = W3;                                                                                                   \
        t30 = vfmaq_f32(t30, w_, x0_), t31 = vfmaq_f32(t31, w_, x1_), t32 = vfmaq_f32(t32, w_, x2_), t33 = vfmaq_f32(t33, w_, x3_); \
    } while (0)
#define GEMM_NEON(NAME, WT, LW)                                                                                    \
    static void NAME(const void *wv, int64_t ldw, int nr, const float *x, int64_t ldx, int nt, int64_t K, float *y, int64_t ldy) { \
        const WT *w = wv;                                                                                          \
        const int64_t full = K / 4 * 4;                                                                            \
        for (int tb = 0; tb < nt; tb += gemm_token_block(K))                                                      \
            for (int i = 0; i < nr; i += 4) {                                                                      \
                const int ri = nr - i < 4 ? nr - i : 4, te = nt - tb < gemm_token_block(K) ? nt : tb + gemm_token_block(K); \
                const WT *w0 = w + (int64_t)i * ldw, *w1 = w0 + (ri > 1 ? ldw : 0), *w2 = w0 + (ri > 2 ? 2 * ldw : 0), *w3 = w0 + (ri > 3 ? 3 * ldw : 0); \
                for (int t = tb; t < te; t += 4) {                                                                 \
                    const int tj = te - t < 4 ? te - t : 4;                                                        \
                    const float *x0 = x + (int64_t)t * ldx, *x1 = x0 + (tj > 1 ? ldx : 0), *x2 = x0 + (tj > 2 ? 2 * ldx : 0), *x3 = x0 + (tj > 3 ? 3 * ldx : 0); \
                    float32x4_t t00 = vdupq_n_f32(0), t01 = t00, t02 = t00, t03 = t00, t10 = t00, t11 = t00, t12 = t00, t13 = t00; \
                    float32x4_t t20 = t00, t21 = t00, t22 = t00, t23 = t00, t30 = t00, t31 = t00, t32 = t00, t33 = t00; \
                    for (int64_t k = 0; k < full; k += 4)                                                          \
                        GEMM_NEON_STEP(LW(w0 + k), LW(w1 + k), LW(w2 + k), LW(w3 + k), vld1q_f32(x0 + k), vld1q_f32(x1 + k), vld1q_f32(x2 + k), vld1q_f32(x3 + k)); \
                    if (full < K) { /* the last K - full values, zero-padded */                                     \
                        const size_t n_ = (size_t)(K - full);                                                      \
                        WT wp[4][4] = {{0}};                                                                       \
                        float xp[4][4] = {{0}};                                                                    \
                        memcpy(wp[0], w0 + full, sizeof(WT) * n_), memcpy(wp[1], w1 + full, sizeof(WT) * n_);     \
                        memcpy(wp[2], w2 + full, sizeof(WT) * n_), memcpy(wp[3], w3 + full, sizeof(WT) * n_);     \
                        memcpy(xp[0], x0 + full, sizeof(float) * n_), memcpy(xp[1], x1 + full, sizeof(float) * n_); \
                        memcpy(xp[2], x2 + full, sizeof(float) * n_), memcpy(xp[3], x3 + full, sizeof(float) * n_); \
                        GEMM_NEON_STEP(LW(wp[0]), LW(wp[1]), LW(wp[2]), LW(wp[3]), vld1q_f32(xp[0]), vld1q_f32(xp[1]), vld1q_f32(xp[2]), vld1q_f32(xp[3])); \
                    }                                                                                              \
                    const float o_[4][4] = {{vaddvq_f32(t00), vaddvq_f32(t10), vaddvq_f32(t20), vaddvq_f32(t30)},  \
                                            {vaddvq_f32(t01), vaddvq_f32(t11), vaddvq_f32(t21), vaddvq_f32(t31)},  \
                                            {vaddvq_f32(t02), vaddvq_f32(t12), vaddvq_f32(t22), vaddvq_f32(t32)},  \
                                            {vaddvq_f32(t03), vaddvq_f32(t13), vaddvq_f32(t23), vaddvq_f32(t33)}}; \
                    for (int c = 0; c < tj; c++) memcpy(y + (int64_t)(t + c) * ldy + i, o_[c], sizeof(float) * (size_t)ri); \
                }                                                                                                  \
            }                                                                                                      \
    }
#define LW_F32(p) vld1q_f32(p)
#define LW_BF16(p) vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16))
GEMM_NEON(gemm_f32_neon, float, LW_F32)
/* defines gemm_f32_neon() */
GEMM_NEON(gemm_bf16_neon, uint16_t, LW_BF16)
/* defines gemm_bf16_neon() */
#undef LW_F32
#undef LW_BF16
#undef GEMM_NEON
#undef GEMM_NEON_STEP
static void mla_scores16_neon(const moe__mla_block16 *b) { mla_scores16_widened(b, mla_scores_neon, widen_bf16_neon); }
static void mla_ctx16_neon(const moe__mla_block16 *b, int h0, int h1) { mla_ctx16_widened(b, h0, h1, mla_ctx_neon, widen_bf16_neon); }

/* int8 cache, NEON: the scores with the dot product, heads in lanes as on x86 (4 a register):
 * SDOT by element meets 4 bytes of a key with 4 heads' 4 query values, signed by signed (no
 * offset); the sums are exact, the float steps those of the reference */
MOE_DOTPROD static void mla_scores8_dotprod(const moe__mla_block8 *b) {
    const int r = b->r, cw = b->cw, ng = (b->H + 15) / 16, nq = cw / 4;
    if (cw % 16 || r % 16) { moe__mla_scores8_ref(b); return; }
    for (int j = b->j0; j < b->j1; j++) {
        const int8_t *c = b->cache + (size_t)j * cw;
        const moe__kv8_meta *mt = b->meta + j;
        for (int g = 0; g < ng; g++) {
            const int8_t *qt = b->qt + (size_t)g * nq * 64;
            int32x4_t d[2][4];
            for (int part = 0; part < 2; part++) {
                int32x4_t a0 = vdupq_n_s32(0), a1 = a0, a2 = a0, a3 = a0;
                for (int i = part ? r : 0; i < (part ? cw : r); i += 16) {
                    const int8x16_t x = vld1q_s8(c + i);
                    const int8_t *qq = qt + (size_t)i * 16; /* dims i .. i+15: 4 quads x 4 head quads */
#define QUAD(t)                                                                                       \
    a0 = vdotq_laneq_s32(a0, vld1q_s8(qq + (t) * 64), x, t), a1 = vdotq_laneq_s32(a1, vld1q_s8(qq + (t) * 64 + 16), x, t); \
    a2 = vdotq_laneq_s32(a2, vld1q_s8(qq + (t) * 64 + 32), x, t), a3 = vdotq_laneq_s32(a3, vld1q_s8(qq + (t) * 64 + 48), x, t)
                    QUAD(0);
                    QUAD(1);
                    QUAD(2);
                    QUAD(3);
#undef QUAD
                }
                d[part][0] = a0, d[part][1] = a1, d[part][2] = a2, d[part][3] = a3;
            }
            for (int hq = 0; hq < 4; hq++) {
                int32_t dc[4], dr[4];
                vst1q_s32(dc, d[0][hq]);
                vst1q_s32(dr, d[1][hq]);
                for (int l = 0; l < 4; l++) {
                    const int h = g * 16 + 4 * hq + l;
                    if (h < b->H) b->sc[(size_t)h * b->ld + j] = score8(b, h, dc[l], dr[l], mt);
                }
            }
        }
    }
}

/* ctx: a key's 16 latent values widened to int16, times the head's weight of the key into four
 * int32 accumulators (multiply-accumulate long by scalar); heads one at a time */
/* moe__mla_weights8 in 4 lanes: the same products, maximum (selects, as the reference's
 * comparisons) and rounding steps, so the same bytes */
/* moe__quant8_row: vmaxnm ignores a NaN as the reference's compare does; vcvtn rounds to
 * nearest even as lrintf does in the default mode */
static void quant8_row_neon(const float *x, int n, int8_t *q, float *d, int32_t *sum) {
    float32x4_t mv = vdupq_n_f32(0);
    int i = 0;
    for (; i + 4 <= n; i += 4) mv = vmaxnmq_f32(vabsq_f32(vld1q_f32(x + i)), mv);
    const float amax = quant8_absmax_tail(x, i, n, vmaxnmvq_f32(mv));
    const float inv = amax > 0 ? 127.0f / amax : 0.0f;
    int32x4_t s4 = vdupq_n_s32(0);
    for (i = 0; i + 4 <= n; i += 4) {
        int32x4_t v = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(x + i), inv));
        v = vmaxq_s32(vminq_s32(v, vdupq_n_s32(127)), vdupq_n_s32(-127));
        s4 = vaddq_s32(s4, v);
        const int16x4_t v16 = vmovn_s32(v);
        const int8x8_t v8 = vmovn_s16(vcombine_s16(v16, v16));
        memcpy(q + i, &v8, 4);
    }
    const int32_t total = vaddvq_s32(s4) + quant8_round_tail(x, inv, i, n, q);
    *d = amax / 127.0f;
    *sum = total;
}

static float weights8_max_neon(const float *p, const float *d, int jn) {
    float32x4_t mv = vdupq_n_f32(0);
    int j = 0;
    for (; j + 4 <= jn; j += 4) {
        const float32x4_t v = vmulq_f32(vld1q_f32(p + j), vld1q_f32(d + j));
        mv = vbslq_f32(vcgtq_f32(v, mv), v, mv);
    }
    float m4[4], m = 0;
    vst1q_f32(m4, mv);
    for (int k = 0; k < 4; k++) m = m4[k] > m ? m4[k] : m;
    return weights8_max_tail(p, d, j, jn, m);
}
static void weights8_round_neon(const float *p, const float *d, float inv, int jn, int lw, uint8_t *w) {
    const float32x4_t vi = vdupq_n_f32(inv), half = vdupq_n_f32(0.5f), top = vdupq_n_f32(255.0f);
    int j = 0;
    for (; j + 8 <= jn; j += 8) {
        const float32x4_t a = vaddq_f32(vmulq_f32(vmulq_f32(vld1q_f32(p + j), vld1q_f32(d + j)), vi), half);
        const float32x4_t b = vaddq_f32(vmulq_f32(vmulq_f32(vld1q_f32(p + j + 4), vld1q_f32(d + j + 4)), vi), half);
        const uint32x4_t ia = vcvtq_u32_f32(vbslq_f32(vcltq_f32(a, top), a, top)), ib = vcvtq_u32_f32(vbslq_f32(vcltq_f32(b, top), b, top));
        vst1_u8(w + j, vmovn_u16(vcombine_u16(vmovn_u32(ia), vmovn_u32(ib))));
    }
    weights8_round_tail(p, d, inv, j, jn, lw, w);
}
static void mla_weights8_neon(const float *p, int ld, const moe__kv8_meta *meta, int jn, int h0, int h1, uint8_t *w, int lw, float *ws,
                              float *work) {
    weights8_heads(p, ld, meta, jn, h0, h1, w, lw, ws, work, weights8_max_neon, weights8_round_neon);
}

static void mla_ctx8_neon(const moe__mla_block8 *b, int h0, int h1) {
    const int r = b->r, cw = b->cw, jn = b->jn;
    if (r % 16) { moe__mla_ctx8_ref(b, h0, h1); return; }
    for (int i = 0; i < r; i += 16)
        for (int h = h0; h < h1; h++) {
            const uint8_t *w = b->w + (size_t)h * b->lw;
            int32x4_t a0 = vdupq_n_s32(0), a1 = a0, a2 = a0, a3 = a0;
            for (int j = 0; j < jn; j++) {
                const int8x16_t x = vld1q_s8(b->cache + (size_t)j * cw + i);
                const int16x8_t lo = vmovl_s8(vget_low_s8(x)), hi = vmovl_high_s8(x);
                const int16_t wj = (int16_t)w[j];
                a0 = vmlal_n_s16(a0, vget_low_s16(lo), wj), a1 = vmlal_high_n_s16(a1, lo, wj);
                a2 = vmlal_n_s16(a2, vget_low_s16(hi), wj), a3 = vmlal_high_n_s16(a3, hi, wj);
            }
            float *o = b->ctx + (size_t)h * r + i;
            const float s = b->ws[h];
            vst1q_f32(o, vaddq_f32(vld1q_f32(o), vmulq_n_f32(vcvtq_f32_s32(a0), s)));
            vst1q_f32(o + 4, vaddq_f32(vld1q_f32(o + 4), vmulq_n_f32(vcvtq_f32_s32(a1), s)));
            vst1q_f32(o + 8, vaddq_f32(vld1q_f32(o + 8), vmulq_n_f32(vcvtq_f32_s32(a2), s)));
            vst1q_f32(o + 12, vaddq_f32(vld1q_f32(o + 12), vmulq_n_f32(vcvtq_f32_s32(a3), s)));
        }
}

#endif /* MOE_NEON */

/* =================================================================================================
 * PART 9: KERNEL LEVELS
 * =================================================================================================
 * Which levels this CPU runs (CPU features through CPUID and the OS), each level's table of
 * kernels, and the choice: moe__kernel_levels lists them from scalar to the best,
 * moe__kernels_init takes the best (or scalar with MOE_FLAG_FORCE_SCALAR), moe__kernels_pick one
 * by name (moe_options.kernels). */

#ifdef MOE_X86

static int cpu_has_avx512(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}

static int cpu_has_vnni(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

/* AVX512_BF16: CPUID.(EAX=7,ECX=1):EAX bit 5 (not a __builtin_cpu_supports name in older compilers) */
static int cpu_has_avx512bf16(void) {
    unsigned a, b, c, d;
    return cpu_has_avx512() && __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5));
}

/* whether CPUID's vendor string (EBX, EDX, ECX of leaf 0) is name */
static int cpu_vendor_is(const char *name) {
    unsigned a, r[3];
    char v[13];
    if (!__get_cpuid(0, &a, &r[0], &r[2], &r[1])) return 0;
    memcpy(v, r, 12), v[12] = 0;
    return !strcmp(v, name);
}

/* AMD family 19h: Zen 3 and Zen 4 (the ones with AVX-512 are Zen 4) */
static int cpu_is_amd_family19(void) {
    unsigned a, b, c, d;
    if (!cpu_vendor_is("AuthenticAMD") || !__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const unsigned base = (a >> 8) & 0xf;
    return (base == 0xf ? base + ((a >> 20) & 0xff) : base) == 0x19;
}

static int cpu_has_avx2(void) {
    unsigned a, b, c, d;
    __builtin_cpu_init();
    /* F16C (CPUID.1:ECX bit 29): clang 14 does not know it as a __builtin_cpu_supports name */
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 29))) return 0;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* AVX-VNNI, the VEX dpbusd: CPUID.(EAX=7,ECX=1):EAX bit 4 (Intel's cores from Alder Lake and
 * Sapphire Rapids on, AMD's from Zen 5); it needs the same register state as AVX2 */
static int cpu_has_avxvnni(void) {
#ifdef MOE_AVXVNNI_AS_EVEX
    return cpu_has_vnni();
#else
    unsigned a, b, c, d;
    return cpu_has_avx2() && __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 4));
#endif
}

#ifdef MOE_AMX_BUILD
/* AMX-TILE and AMX-INT8 (CPUID.(EAX=7,ECX=0):EDX bits 24, 25), their state enabled by the OS in
 * XCR0 (bits 17, 18: the tile configuration and data), and this process allowed to use it: Linux
 * gives the tile data (8 KB of state a thread) only on request, by arch_prctl(ARCH_REQ_XCOMP_PERM,
 * XFEATURE_XTILEDATA) (0x1023, 18; system call 158), which every thread of the process then has.
 * The request is a raw system call so that no feature macro is needed for syscall(). */
static int cpu_has_amx(void) {
    unsigned a, b, c, d, lo, hi;
    if (!cpu_has_vnni() || !__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0; /* OSXSAVE: xgetbv may run */
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    (void)hi;
    if ((lo & (3u << 17)) != (3u << 17)) return 0;
    long ret;
    __asm__ volatile("syscall" : "=a"(ret) : "0"(158L), "D"(0x1023L), "S"(18L) : "rcx", "r11", "memory");
    return ret == 0;
}
#endif

#endif /* MOE_X86 */

/* the scalar level: every kernel is its reference (PART 2); the other levels start from it */
static const moe__kernels level_scalar = {
    .dot =
        {
            [MOE_T_F32] = dot_f32_ref,
            [MOE_T_BF16] = dot_bf16_ref,
            [MOE_T_F16] = dot_f16_ref,
            [MOE_T_MXFP4] = dot_mxfp4_ref,
            [MOE_T_MXFP4_GGML] = dot_mxfp4g_ref,
        },
    .gemm = {[MOE_T_F32] = gemm_f32_ref, [MOE_T_BF16] = gemm_bf16_ref},
    .dotq =
        {
            [MOE_T_Q8_0] = dotq_q8_0_ref,
            [MOE_T_Q4_0] = dotq_q4_0_ref,
            [MOE_T_Q4_1] = dotq_q4_1_ref,
            [MOE_T_Q5_0] = dotq_q5_0_ref,
            [MOE_T_Q5_1] = dotq_q5_1_ref,
            [MOE_T_Q4_K] = dotq_q4_k_ref,
            [MOE_T_Q5_K] = dotq_q5_k_ref,
            [MOE_T_Q6_K] = dotq_q6_k_ref,
            [MOE_T_Q2_K] = dotq_q2_k_ref,
            [MOE_T_Q3_K] = dotq_q3_k_ref,
            [MOE_T_IQ4_NL] = dotq_iq4_nl_ref,
            [MOE_T_IQ4_XS] = dotq_iq4_xs_ref,
            [MOE_T_IQ2_XXS] = dotq_iq2_xxs_ref,
            [MOE_T_IQ2_XS] = dotq_iq2_xs_ref,
            [MOE_T_IQ2_S] = dotq_iq2_s_ref,
            [MOE_T_IQ3_XXS] = dotq_iq3_xxs_ref,
            [MOE_T_IQ3_S] = dotq_iq3_s_ref,
            [MOE_T_IQ1_S] = dotq_iq1_s_ref,
            [MOE_T_IQ1_M] = dotq_iq1_m_ref,
            [MOE_T_MXFP4_GGML] = dotq_mxfp4g_ref,
        },
    .dotq_mxfp4 = moe__dotq_mxfp4_ref,
    .quant_q8a = moe__quant_q8a_ref,
    .dotq8 =
        {
            [MOE_T_Q4_0X8] = dotq8_q4_0_ref,
            [MOE_T_Q8_0X8] = dotq8_q8_0_ref,
            [MOE_T_MXFP4X8] = dotq8_mxfp4_ref,
        },
    .axpy = axpy_ref,
    .kda_recurrent = moe__kda_recurrent,
    .mla_scores = moe__mla_scores_ref,
    .mla_ctx = moe__mla_ctx_ref,
    .mla_scores16 = moe__mla_scores16_ref,
    .mla_ctx16 = moe__mla_ctx16_ref,
    .mla_scores8 = moe__mla_scores8_ref,
    .mla_ctx8 = moe__mla_ctx8_ref,
    .quant8_row = moe__quant8_row,
    .mla_weights8 = moe__mla_weights8,
    .act = moe__act_ref,
    .dwconv = moe__dwconv_ref,
    .exp_sum = moe__exp_sum_ref,
    .widen_bf16 = moe__widen_bf16_ref,
    .isa = "scalar",
};

#ifdef MOE_X86
/* the avx2 level (PART 4), over the scalar one */
static const moe__kernels level_avx2 = {
    .dot =
        {
            [MOE_T_F32] = dot_f32_avx2,
            [MOE_T_BF16] = dot_bf16_avx2,
            [MOE_T_F16] = dot_f16_avx2,
            [MOE_T_MXFP4] = dot_mxfp4_avx2,
            [MOE_T_MXFP4_GGML] = dot_mxfp4g_avx2,
        },
    .gemm = {[MOE_T_F32] = gemm_f32_avx2, [MOE_T_BF16] = gemm_bf16_avx2},
    .dotq =
        {
            [MOE_T_Q8_0] = dotq_q8_0_avx2,
            [MOE_T_Q4_0] = dotq_q4_0_avx2,
            [MOE_T_Q4_1] = dotq_q4_1_avx2,
            [MOE_T_Q5_0] = dotq_q5_0_avx2,
            [MOE_T_Q5_1] = dotq_q5_1_avx2,
            [MOE_T_Q4_K] = dotq_q4_k_avx2,
            [MOE_T_Q5_K] = dotq_q5_k_avx2,
            [MOE_T_Q6_K] = dotq_q6_k_avx2,
            [MOE_T_Q2_K] = dotq_q2_k_avx2,
            [MOE_T_Q3_K] = dotq_q3_k_avx2,
            [MOE_T_IQ4_NL] = dotq_iq4_nl_avx2,
            [MOE_T_IQ4_XS] = dotq_iq4_xs_avx2,
            [MOE_T_IQ2_XXS] = dotq_iq2_xxs_avx2,
            [MOE_T_IQ2_XS] = dotq_iq2_xs_avx2,
            [MOE_T_IQ2_S] = dotq_iq2_s_avx2,
            [MOE_T_IQ3_XXS] = dotq_iq3_xxs_avx2,
            [MOE_T_IQ3_S] = dotq_iq3_s_avx2,
            [MOE_T_IQ1_S] = dotq_iq1_s_avx2,
            [MOE_T_IQ1_M] = dotq_iq1_m_avx2,
            [MOE_T_MXFP4_GGML] = dotq_mxfp4g_avx2,
        },
    .dotq4 =
        {
            [MOE_T_Q4_1] = dotq4_q4_1_avx2,
            [MOE_T_Q5_0] = dotq4_q5_0_avx2,
            [MOE_T_Q5_1] = dotq4_q5_1_avx2,
            [MOE_T_Q4_K] = dotq4_q4_k_avx2,
            [MOE_T_Q5_K] = dotq4_q5_k_avx2,
            [MOE_T_Q6_K] = dotq4_q6_k_avx2,
            [MOE_T_Q2_K] = dotq4_q2_k_avx2,
            [MOE_T_Q3_K] = dotq4_q3_k_avx2,
            [MOE_T_IQ4_NL] = dotq4_iq4_nl_avx2,
            [MOE_T_IQ4_XS] = dotq4_iq4_xs_avx2,
            [MOE_T_IQ2_XXS] = dotq4_iq2_xxs_avx2,
            [MOE_T_IQ2_XS] = dotq4_iq2_xs_avx2,
            [MOE_T_IQ2_S] = dotq4_iq2_s_avx2,
            [MOE_T_IQ3_XXS] = dotq4_iq3_xxs_avx2,
            [MOE_T_IQ3_S] = dotq4_iq3_s_avx2,
            [MOE_T_IQ1_S] = dotq4_iq1_s_avx2,
            [MOE_T_IQ1_M] = dotq4_iq1_m_avx2,
        },
    .dotq_mxfp4 = dotq_mxfp4_avx2,
    .quant_q8a = quant_q8a_avx2,
    .dotq8 =
        {
            [MOE_T_Q4_KX8] = dotq8_q4_k_avx2,
            [MOE_T_Q5_KX8] = dotq8_q5_k_avx2,
            [MOE_T_IQ4_XSX8] = dotq8_iq4_xs_avx2,
            [MOE_T_Q2_KX8] = dotq8_q2_k_avx2,
            [MOE_T_Q3_KX8] = dotq8_q3_k_avx2,
            [MOE_T_Q6_KX8] = dotq8_q6_k_avx2,
            [MOE_T_Q4_0X8] = dotq8_q4_0_avx2,
            [MOE_T_Q8_0X8] = dotq8_q8_0_avx2,
            [MOE_T_MXFP4X8] = dotq8_mxfp4_avx2,
        },
    .dotq8x4 =
        {
            [MOE_T_Q4_KX8] = dotq8x4_q4_k_avx2,
            [MOE_T_Q5_KX8] = dotq8x4_q5_k_avx2,
            [MOE_T_IQ4_XSX8] = dotq8x4_iq4_xs_avx2,
            [MOE_T_Q2_KX8] = dotq8x4_q2_k_avx2,
            [MOE_T_Q3_KX8] = dotq8x4_q3_k_avx2,
            [MOE_T_Q6_KX8] = dotq8x4_q6_k_avx2,
            [MOE_T_Q4_0X8] = dotq8x4_q4_0_avx2,
            [MOE_T_Q8_0X8] = dotq8x4_q8_0_avx2,
            [MOE_T_MXFP4X8] = dotq8x4_mxfp4_avx2,
        },
    .axpy = axpy_avx2,
    .kda_recurrent = kda_recurrent_avx2,
    .mla_scores = mla_scores_avx2,
    .mla_ctx = mla_ctx_avx2,
    .mla_scores16 = mla_scores16_avx2,
    .mla_ctx16 = mla_ctx16_avx2,
    .mla_scores8 = mla_scores8_avx2,
    .mla_ctx8 = mla_ctx8_avx2,
    .quant8_row = quant8_row_avx2,
    .mla_weights8 = mla_weights8_avx2,
    .act = act_avx2,
    .dwconv = dwconv_avx2,
    .exp_sum = exp_sum_avx2,
    .widen_bf16 = widen_bf16_avx2,
    .isa = "avx2",
};

/* the avxvnni level (PART 5), over avx2 */
static const moe__kernels level_avxvnni = {
    .dotq =
        {
            [MOE_T_Q8_0] = dotq_q8_0_avxvnni,
            [MOE_T_Q4_0] = dotq_q4_0_avxvnni,
            [MOE_T_Q4_K] = dotq_q4_k_avxvnni,
            [MOE_T_Q5_K] = dotq_q5_k_avxvnni,
        },
    .dotq4 = {[MOE_T_Q4_K] = dotq4_q4_k_avxvnni, [MOE_T_Q5_K] = dotq4_q5_k_avxvnni},
    .dotq8 =
        {
            [MOE_T_Q4_KX8] = dotq8_q4_k_avxvnni,
            [MOE_T_Q5_KX8] = dotq8_q5_k_avxvnni,
            [MOE_T_IQ4_XSX8] = dotq8_iq4_xs_avxvnni,
            [MOE_T_Q2_KX8] = dotq8_q2_k_avxvnni,
            [MOE_T_Q3_KX8] = dotq8_q3_k_avxvnni,
            [MOE_T_Q6_KX8] = dotq8_q6_k_avxvnni,
            [MOE_T_Q4_0X8] = dotq8_q4_0_avxvnni,
            [MOE_T_Q8_0X8] = dotq8_q8_0_avxvnni,
            [MOE_T_MXFP4X8] = dotq8_mxfp4_avxvnni,
        },
    .dotq8x4 =
        {
            [MOE_T_Q4_KX8] = dotq8x4_q4_k_avxvnni,
            [MOE_T_Q5_KX8] = dotq8x4_q5_k_avxvnni,
            [MOE_T_IQ4_XSX8] = dotq8x4_iq4_xs_avxvnni,
            [MOE_T_Q2_KX8] = dotq8x4_q2_k_avxvnni,
            [MOE_T_Q3_KX8] = dotq8x4_q3_k_avxvnni,
            [MOE_T_Q6_KX8] = dotq8x4_q6_k_avxvnni,
            [MOE_T_Q4_0X8] = dotq8x4_q4_0_avxvnni,
            [MOE_T_Q8_0X8] = dotq8x4_q8_0_avxvnni,
            [MOE_T_MXFP4X8] = dotq8x4_mxfp4_avxvnni,
        },
    .mla_scores8 = mla_scores8_avxvnni,
    .mla_ctx8 = mla_ctx8_avxvnni,
    .isa = "avxvnni",
    .dot8 = 1,
};

/* the avx512 level (PART 6), over avxvnni where the CPU has it, else over avx2 */
static const moe__kernels level_avx512 = {
    .dot =
        {
            [MOE_T_F32] = dot_f32_avx512,
            [MOE_T_BF16] = dot_bf16_avx512,
            [MOE_T_MXFP4] = dot_mxfp4_avx512,
            [MOE_T_MXFP4_GGML] = dot_mxfp4g_avx512,
            [MOE_T_F16] = dot_f16_avx512,
        },
    .dot4 = {[MOE_T_MXFP4] = dot4_mxfp4_avx512, [MOE_T_MXFP4_GGML] = dot4_mxfp4g_avx512},
    .gemm = {[MOE_T_F32] = gemm_f32_avx512, [MOE_T_BF16] = gemm_bf16_avx512},
    .quant_q8a = quant_q8a_avx512,
    .axpy = axpy_avx512,
    .kda_recurrent = kda_recurrent_avx512,
    .mla_scores = mla_scores_avx512,
    .mla_ctx = mla_ctx_avx512,
    .mla_scores16 = mla_scores16_avx512,
    .mla_ctx16 = mla_ctx16_avx512,
    .mla_weights8 = mla_weights8_avx512,
    .act = act_avx512,
    .dwconv = dwconv_avx512,
    .exp_sum = exp_sum_avx512,
    .widen_bf16 = widen_bf16_avx512,
    .isa = "avx512",
};

/* with VNNI the avx512 level becomes avx512vnni (PART 6) */
static const moe__kernels level_avx512vnni = {
    .dotq =
        {
            [MOE_T_Q8_0] = dotq_q8_0_vnni,
            [MOE_T_Q4_0] = dotq_q4_0_vnni,
            [MOE_T_Q4_K] = dotq_q4_k_vnni,
            [MOE_T_Q5_K] = dotq_q5_k_vnni,
        },
    .dotq4 = {[MOE_T_Q4_K] = dotq4_q4_k_vnni, [MOE_T_Q5_K] = dotq4_q5_k_vnni},
    .dotq8 =
        {
            [MOE_T_Q4_KX8] = dotq8_q4_k_vnni,
            [MOE_T_Q5_KX8] = dotq8_q5_k_vnni,
            [MOE_T_IQ4_XSX8] = dotq8_iq4_xs_vnni,
            [MOE_T_Q2_KX8] = dotq8_q2_k_vnni,
            [MOE_T_Q3_KX8] = dotq8_q3_k_vnni,
            [MOE_T_Q6_KX8] = dotq8_q6_k_vnni,
            [MOE_T_Q4_0X8] = dotq8_q4_0_vnni,
            [MOE_T_Q8_0X8] = dotq8_q8_0_vnni,
            [MOE_T_MXFP4X8] = dotq8_mxfp4_vnni,
        },
    .dotq8x2 =
        {
            [MOE_T_Q4_KX8] = dotq8x2_q4_k_vnni,
            [MOE_T_Q5_KX8] = dotq8x2_q5_k_vnni,
            [MOE_T_IQ4_XSX8] = dotq8x2_iq4_xs_vnni,
            [MOE_T_Q2_KX8] = dotq8x2_q2_k_vnni,
            [MOE_T_Q3_KX8] = dotq8x2_q3_k_vnni,
        },
    .dotq8x4 =
        {
            [MOE_T_Q4_KX8] = dotq8x4_q4_k_vnni,
            [MOE_T_Q5_KX8] = dotq8x4_q5_k_vnni,
            [MOE_T_IQ4_XSX8] = dotq8x4_iq4_xs_vnni,
            [MOE_T_Q2_KX8] = dotq8x4_q2_k_vnni,
            [MOE_T_Q3_KX8] = dotq8x4_q3_k_vnni,
            [MOE_T_Q6_KX8] = dotq8x4_q6_k_vnni,
            [MOE_T_Q4_0X8] = dotq8x4_q4_0_vnni,
            [MOE_T_Q8_0X8] = dotq8x4_q8_0_vnni,
            [MOE_T_MXFP4X8] = dotq8x4_mxfp4_vnni,
        },
    .dotq8x4x2 =
        {
            [MOE_T_Q4_KX8] = dotq8x4x2_q4_k_vnni,
            [MOE_T_Q5_KX8] = dotq8x4x2_q5_k_vnni,
            [MOE_T_IQ4_XSX8] = dotq8x4x2_iq4_xs_vnni,
            [MOE_T_Q2_KX8] = dotq8x4x2_q2_k_vnni,
            [MOE_T_Q3_KX8] = dotq8x4x2_q3_k_vnni,
            [MOE_T_Q6_KX8] = dotq8x4x2_q6_k_vnni,
            [MOE_T_Q4_0X8] = dotq8x4x2_q4_0_vnni,
            [MOE_T_Q8_0X8] = dotq8x4x2_q8_0_vnni,
            [MOE_T_MXFP4X8] = dotq8x4x2_mxfp4_vnni,
        },
    .mla_scores8 = mla_scores8_vnni,
    .mla_ctx8 = mla_ctx8_vnni,
    .isa = "avx512vnni",
    .dot8 = 1,
};

/* with AVX512_BF16, the bf16-cache attention of the avx512 levels (PART 6) */
static const moe__kernels level_avx512bf16 = {
    .mla_scores16 = mla_scores16_avx512bf16,
    .mla_ctx16 = mla_ctx16_avx512bf16,
};

#ifdef MOE_AMX_BUILD
/* the amx level (PART 7), over avx512vnni */
static const moe__kernels level_amx = {
    .dotq8x16x2 =
        {
            [MOE_T_Q8_0X8] = dotq8x16x2_q8_0_amx,
            [MOE_T_Q4_0X8] = dotq8x16x2_q4_0_amx,
            [MOE_T_MXFP4X8] = dotq8x16x2_mxfp4_amx,
        },
    .mla_scores8 = mla_scores8_amx,
    .mla_ctx8 = mla_ctx8_amx,
    .isa = "amx",
};
#endif
#endif /* MOE_X86 */

#ifdef MOE_NEON
/* the neon level (PART 8), over the scalar one */
static const moe__kernels level_neon = {
    .dot =
        {
            [MOE_T_F32] = dot_f32_neon,
            [MOE_T_BF16] = dot_bf16_neon,
            [MOE_T_F16] = dot_f16_neon,
            [MOE_T_MXFP4] = dot_mxfp4_neon,
            [MOE_T_MXFP4_GGML] = dot_mxfp4g_neon,
        },
    .gemm = {[MOE_T_F32] = gemm_f32_neon, [MOE_T_BF16] = gemm_bf16_neon},
    .dotq =
        {
            [MOE_T_Q8_0] = dotq_q8_0_neon,
            [MOE_T_Q4_0] = dotq_q4_0_neon,
            [MOE_T_Q4_1] = dotq_q4_1_neon,
            [MOE_T_Q5_0] = dotq_q5_0_neon,
            [MOE_T_Q5_1] = dotq_q5_1_neon,
            [MOE_T_Q4_K] = dotq_q4_k_neon,
            [MOE_T_Q5_K] = dotq_q5_k_neon,
            [MOE_T_Q6_K] = dotq_q6_k_neon,
            [MOE_T_Q2_K] = dotq_q2_k_neon,
            [MOE_T_Q3_K] = dotq_q3_k_neon,
            [MOE_T_IQ4_NL] = dotq_iq4_nl_neon,
            [MOE_T_IQ4_XS] = dotq_iq4_xs_neon,
            [MOE_T_IQ2_XXS] = dotq_iq2_xxs_neon,
            [MOE_T_IQ2_XS] = dotq_iq2_xs_neon,
            [MOE_T_IQ2_S] = dotq_iq2_s_neon,
            [MOE_T_IQ3_XXS] = dotq_iq3_xxs_neon,
            [MOE_T_IQ3_S] = dotq_iq3_s_neon,
            [MOE_T_IQ1_S] = dotq_iq1_s_neon,
            [MOE_T_IQ1_M] = dotq_iq1_m_neon,
            [MOE_T_MXFP4_GGML] = dotq_mxfp4g_neon,
        },
    .dotq_mxfp4 = dotq_mxfp4_neon,
    .quant_q8a = quant_q8a_neon,
    .dotq8 =
        {
            [MOE_T_Q4_0X8] = dotq8_q4_0_neon,
            [MOE_T_Q8_0X8] = dotq8_q8_0_neon,
            [MOE_T_MXFP4X8] = dotq8_mxfp4_neon,
        },
    .axpy = axpy_neon,
    .kda_recurrent = kda_recurrent_neon,
    .mla_scores = mla_scores_neon,
    .mla_ctx = mla_ctx_neon,
    .mla_scores16 = mla_scores16_neon,
    .mla_ctx16 = mla_ctx16_neon,
    .mla_ctx8 = mla_ctx8_neon,
    .quant8_row = quant8_row_neon,
    .mla_weights8 = mla_weights8_neon,
    .act = act_neon,
    .dwconv = dwconv_neon,
    .exp_sum = exp_sum_neon,
    .widen_bf16 = widen_bf16_neon,
    .isa = "neon",
};

/* the neon-dotprod level (PART 8), over neon */
static const moe__kernels level_neon_dotprod = {
    .dotq =
        {
            [MOE_T_Q8_0] = dotq_q8_0_dotprod,
            [MOE_T_Q4_1] = dotq_q4_1_sdot,
            [MOE_T_Q5_0] = dotq_q5_0_sdot,
            [MOE_T_Q5_1] = dotq_q5_1_sdot,
            [MOE_T_Q4_K] = dotq_q4_k_sdot,
            [MOE_T_Q5_K] = dotq_q5_k_sdot,
            [MOE_T_Q6_K] = dotq_q6_k_sdot,
            [MOE_T_Q2_K] = dotq_q2_k_sdot,
            [MOE_T_Q3_K] = dotq_q3_k_sdot,
            [MOE_T_IQ4_NL] = dotq_iq4_nl_sdot,
            [MOE_T_IQ4_XS] = dotq_iq4_xs_sdot,
            [MOE_T_IQ2_XXS] = dotq_iq2_xxs_sdot,
            [MOE_T_IQ2_XS] = dotq_iq2_xs_sdot,
            [MOE_T_IQ2_S] = dotq_iq2_s_sdot,
            [MOE_T_IQ3_XXS] = dotq_iq3_xxs_sdot,
            [MOE_T_IQ3_S] = dotq_iq3_s_sdot,
            [MOE_T_IQ1_S] = dotq_iq1_s_sdot,
            [MOE_T_IQ1_M] = dotq_iq1_m_sdot,
            [MOE_T_Q4_0] = dotq_q4_0_dotprod,
        },
    .dotq8 =
        {
            [MOE_T_Q4_0X8] = dotq8_q4_0_dotprod,
            [MOE_T_Q8_0X8] = dotq8_q8_0_dotprod,
            [MOE_T_MXFP4X8] = dotq8_mxfp4_dotprod,
        },
    .dotq8x4 =
        {
            [MOE_T_Q4_0X8] = dotq8x4_q4_0_dotprod,
            [MOE_T_Q8_0X8] = dotq8x4_q8_0_dotprod,
            [MOE_T_MXFP4X8] = dotq8x4_mxfp4_dotprod,
        },
    .mla_scores8 = mla_scores8_dotprod,
    .isa = "neon-dotprod",
    .dot8 = 1,
};
#endif /* MOE_NEON */

/* k takes o's entries where o has one: a level's table lists what it adds to or replaces in the
 * level it builds on, and leaves the rest NULL (0) */
static void overlay(moe__kernels *k, const moe__kernels *o) {
#define OVERLAY(f) \
    if (o->f) k->f = o->f
#define OVERLAY_TYPES(f) \
    for (int t = 0; t < MOE_T_COUNT; t++) OVERLAY(f[t])
    OVERLAY_TYPES(dot);
    OVERLAY_TYPES(dot4);
    OVERLAY_TYPES(gemm);
    OVERLAY_TYPES(dotq);
    OVERLAY_TYPES(dotq4);
    OVERLAY(dotq_mxfp4);
    OVERLAY(quant_q8a);
    OVERLAY_TYPES(dotq8);
    OVERLAY_TYPES(dotq8x2);
    OVERLAY_TYPES(dotq8x4);
    OVERLAY_TYPES(dotq8x4x2);
    OVERLAY_TYPES(dotq8x16x2);
    OVERLAY(axpy);
    OVERLAY(kda_recurrent);
    OVERLAY(mla_scores);
    OVERLAY(mla_ctx);
    OVERLAY(mla_scores16);
    OVERLAY(mla_ctx16);
    OVERLAY(mla_scores8);
    OVERLAY(mla_ctx8);
    OVERLAY(quant8_row);
    OVERLAY(mla_weights8);
    OVERLAY(act);
    OVERLAY(dwconv);
    OVERLAY(exp_sum);
    OVERLAY(widen_bf16);
    OVERLAY(isa);
    OVERLAY(dot8);
#undef OVERLAY_TYPES
#undef OVERLAY
}
/* a field added to moe__kernels needs its line in overlay: 10 per-type arrays, then 17 pointers */
_Static_assert(offsetof(moe__kernels, dot8) == (10 * MOE_T_COUNT + 17) * sizeof(void *), "overlay() lists every field of moe__kernels");

void moe__x8_prefetch(moe__kernels *k, int mode) {
#ifdef MOE_X86
    static const moe__dotq8_fn builds[3][3] = {/* [mode][Q4_0X8, Q8_0X8, MXFP4X8] */
                                               {dotq8_q4_0_vnni_hw, dotq8_q8_0_vnni_hw, dotq8_mxfp4_vnni_hw},
                                               {dotq8_q4_0_vnni, dotq8_q8_0_vnni, dotq8_mxfp4_vnni},
                                               {dotq8_q4_0_vnni_l2, dotq8_q8_0_vnni_l2, dotq8_mxfp4_vnni_l2}};
    const moe__dotq8_fn q4 = k->dotq8[MOE_T_Q4_0X8];
    if (q4 != builds[0][0] && q4 != builds[1][0] && q4 != builds[2][0]) return;
    const moe__dotq8_fn *f = builds[mode == 1 || mode == 2 ? mode : 0];
    k->dotq8[MOE_T_Q4_0X8] = f[0], k->dotq8[MOE_T_Q8_0X8] = f[1], k->dotq8[MOE_T_MXFP4X8] = f[2];
#else
    (void)k, (void)mode;
#endif
}

/* Every level this CPU runs, from scalar to the best: each starts from the one before it and
 * overlays its own table. */
int moe__kernel_levels(moe__kernels *out, int max) {
    int n = 0;
    moe__kernels k = level_scalar;
    if (n < max) out[n++] = k;
#ifdef MOE_X86
    if (n < max && cpu_has_avx2()) {
        overlay(&k, &level_avx2);
        out[n++] = k;
        if (n < max && cpu_has_avxvnni()) {
            overlay(&k, &level_avxvnni);
            out[n++] = k; /* the AVX-512 levels build on it */
        }
        if (n < max && cpu_has_avx512()) {
            overlay(&k, &level_avx512);
            if (cpu_has_vnni()) {
                overlay(&k, &level_avx512vnni);
                moe__x8_prefetch(&k, cpu_is_amd_family19() ? 0 : 2);
            }
            if (cpu_has_avx512bf16()) overlay(&k, &level_avx512bf16);
            out[n++] = k;
#ifdef MOE_AMX_BUILD
            if (n < max && k.dot8 && cpu_has_amx()) { /* the avx512vnni level, with tile kernels where they are faster */
                overlay(&k, &level_amx);
                out[n++] = k;
            }
#endif
        }
    }
#endif
#ifdef MOE_NEON
    if (n < max) {
        overlay(&k, &level_neon);
        out[n++] = k;
        if (n < max && cpu_has_dotprod()) {
            overlay(&k, &level_neon_dotprod);
            out[n++] = k;
        }
    }
#endif
    return n;
}

void moe__kernels_init(moe__kernels *k, unsigned flags) { moe__kernels_pick(k, flags, NULL, NULL, 0); }

int moe__kernels_pick(moe__kernels *k, unsigned flags, const char *name, char *have, size_t havelen) {
    moe__kernels levels[MOE_KERNEL_LEVELS_MAX];
    const int n = moe__kernel_levels(levels, MOE_KERNEL_LEVELS_MAX);
    *k = levels[(flags & MOE_FLAG_FORCE_SCALAR) ? 0 : n - 1];
    if (!name || !*name) return 0;
    size_t used = 0;
    if (have && havelen) have[0] = 0;
    for (int i = 0; i < n; i++) {
        if (!strcmp(levels[i].isa, name)) {
            *k = levels[i];
            return 0;
        }
        if (have && used < havelen) used += (size_t)snprintf(have + used, havelen - used, "%s%s", i ? ", " : "", levels[i].isa);
    }
    return -1;
}

/* =================================================================================================
 * APPENDIX: CODEBOOKS
 * =================================================================================================
 * The grid-codebook formats' fixed tables, declared in PART 1 where they are read. */

/* ---- the grid-codebook formats (IQ1_S .. IQ3_S) -------------------------------------------
 * The tables below are ggml's (ggml-common.h, MIT licence, "Copyright (c) 2023-2024 The ggml
 * authors"), copied entry for entry: a format's bits are indices into them, so files decode only
 * with these exact values. Each uint64_t holds 8 values (IQ3's uint32_t 4), value k in byte k
 * (little-endian): IQ2's bytes 8, 25 or 43; IQ3's 4 .. 62; IQ1's -1, 0 or 1 as int8. */

static const uint64_t iq2xxs_grid[256] = {
    0x0808080808080808, 0x080808080808082b, 0x0808080808081919, 0x0808080808082b08, 0x0808080808082b2b, 0x0808080808190819,
    0x0808080808191908, 0x08080808082b0808, 0x08080808082b082b, 0x08080808082b2b08, 0x08080808082b2b2b, 0x0808080819080819,
    0x0808080819081908, 0x0808080819190808, 0x0808080819192b08, 0x08080808192b0819, 0x08080808192b1908, 0x080808082b080808,
    0x080808082b08082b, 0x080808082b082b2b, 0x080808082b2b082b, 0x0808081908080819, 0x0808081908081908, 0x0808081908190808,
    0x0808081908191919, 0x0808081919080808, 0x080808192b081908, 0x080808192b192b08, 0x0808082b08080808, 0x0808082b0808082b,
    0x0808082b082b082b, 0x0808082b2b08082b, 0x0808190808080819, 0x0808190808081908, 0x0808190808190808, 0x08081908082b0819,
    0x08081908082b1908, 0x0808190819080808, 0x080819081908082b, 0x0808190819082b08, 0x08081908192b0808, 0x080819082b080819,
    0x080819082b081908, 0x080819082b190808, 0x080819082b2b1908, 0x0808191908080808, 0x080819190808082b, 0x0808191908082b08,
    0x08081919082b0808, 0x080819191908192b, 0x08081919192b2b19, 0x080819192b080808, 0x080819192b190819, 0x0808192b08082b19,
    0x0808192b08190808, 0x0808192b19080808, 0x0808192b2b081908, 0x0808192b2b2b1908, 0x08082b0808080808, 0x08082b0808081919,
    0x08082b0808082b08, 0x08082b0808191908, 0x08082b08082b2b08, 0x08082b0819080819, 0x08082b0819081908, 0x08082b0819190808,
    0x08082b081919082b, 0x08082b082b082b08, 0x08082b1908081908, 0x08082b1919080808, 0x08082b2b0808082b, 0x08082b2b08191908,
    0x0819080808080819, 0x0819080808081908, 0x0819080808190808, 0x08190808082b0819, 0x0819080819080808, 0x08190808192b0808,
    0x081908082b081908, 0x081908082b190808, 0x081908082b191919, 0x0819081908080808, 0x0819081908082b08, 0x08190819082b0808,
    0x0819081919190808, 0x0819081919192b2b, 0x081908192b080808, 0x0819082b082b1908, 0x0819082b19081919, 0x0819190808080808,
    0x0819190808082b08, 0x08191908082b0808, 0x08191908082b1919, 0x0819190819082b19, 0x081919082b080808, 0x0819191908192b08,
    0x08191919192b082b, 0x0819192b08080808, 0x0819192b0819192b, 0x08192b0808080819, 0x08192b0808081908, 0x08192b0808190808,
    0x08192b0819080808, 0x08192b082b080819, 0x08192b1908080808, 0x08192b1908081919, 0x08192b192b2b0808, 0x08192b2b19190819,
    0x082b080808080808, 0x082b08080808082b, 0x082b080808082b2b, 0x082b080819081908, 0x082b0808192b0819, 0x082b08082b080808,
    0x082b08082b08082b, 0x082b0819082b2b19, 0x082b081919082b08, 0x082b082b08080808, 0x082b082b0808082b, 0x082b190808080819,
    0x082b190808081908, 0x082b190808190808, 0x082b190819080808, 0x082b19081919192b, 0x082b191908080808, 0x082b191919080819,
    0x082b1919192b1908, 0x082b192b2b190808, 0x082b2b0808082b08, 0x082b2b08082b0808, 0x082b2b082b191908, 0x082b2b2b19081908,
    0x1908080808080819, 0x1908080808081908, 0x1908080808190808, 0x1908080808192b08, 0x19080808082b0819, 0x19080808082b1908,
    0x1908080819080808, 0x1908080819082b08, 0x190808081919192b, 0x19080808192b0808, 0x190808082b080819, 0x190808082b081908,
    0x190808082b190808, 0x1908081908080808, 0x19080819082b0808, 0x19080819192b0819, 0x190808192b080808, 0x190808192b081919,
    0x1908082b08080819, 0x1908082b08190808, 0x1908082b19082b08, 0x1908082b1919192b, 0x1908082b192b2b08, 0x1908190808080808,
    0x1908190808082b08, 0x19081908082b0808, 0x190819082b080808, 0x190819082b192b19, 0x190819190819082b, 0x19081919082b1908,
    0x1908192b08080808, 0x19082b0808080819, 0x19082b0808081908, 0x19082b0808190808, 0x19082b0819080808, 0x19082b0819081919,
    0x19082b1908080808, 0x19082b1919192b08, 0x19082b19192b0819, 0x19082b192b08082b, 0x19082b2b19081919, 0x19082b2b2b190808,
    0x1919080808080808, 0x1919080808082b08, 0x1919080808190819, 0x1919080808192b19, 0x19190808082b0808, 0x191908082b080808,
    0x191908082b082b08, 0x1919081908081908, 0x191908191908082b, 0x191908192b2b1908, 0x1919082b2b190819, 0x191919082b190808,
    0x191919082b19082b, 0x1919191908082b2b, 0x1919192b08080819, 0x1919192b19191908, 0x19192b0808080808, 0x19192b0808190819,
    0x19192b0808192b19, 0x19192b08192b1908, 0x19192b1919080808, 0x19192b2b08082b08, 0x192b080808081908, 0x192b080808190808,
    0x192b080819080808, 0x192b0808192b2b08, 0x192b081908080808, 0x192b081919191919, 0x192b082b08192b08, 0x192b082b192b0808,
    0x192b190808080808, 0x192b190808081919, 0x192b191908190808, 0x192b19190819082b, 0x192b19192b081908, 0x192b2b081908082b,
    0x2b08080808080808, 0x2b0808080808082b, 0x2b08080808082b2b, 0x2b08080819080819, 0x2b0808082b08082b, 0x2b08081908081908,
    0x2b08081908192b08, 0x2b08081919080808, 0x2b08082b08190819, 0x2b08190808080819, 0x2b08190808081908, 0x2b08190808190808,
    0x2b08190808191919, 0x2b08190819080808, 0x2b081908192b0808, 0x2b08191908080808, 0x2b0819191908192b, 0x2b0819192b191908,
    0x2b08192b08082b19, 0x2b08192b19080808, 0x2b08192b192b0808, 0x2b082b080808082b, 0x2b082b1908081908, 0x2b082b2b08190819,
    0x2b19080808081908, 0x2b19080808190808, 0x2b190808082b1908, 0x2b19080819080808, 0x2b1908082b2b0819, 0x2b1908190819192b,
    0x2b1908192b080808, 0x2b19082b19081919, 0x2b19190808080808, 0x2b191908082b082b, 0x2b19190819081908, 0x2b19191919190819,
    0x2b192b082b080819, 0x2b192b19082b0808, 0x2b2b08080808082b, 0x2b2b080819190808, 0x2b2b08082b081919, 0x2b2b081908082b19,
    0x2b2b082b08080808, 0x2b2b190808192b08, 0x2b2b2b0819190808, 0x2b2b2b1908081908,
};

static const uint64_t iq2xs_grid[512] = {
    0x0808080808080808, 0x080808080808082b, 0x0808080808081919, 0x0808080808082b08, 0x0808080808082b2b, 0x0808080808190819,
    0x0808080808191908, 0x080808080819192b, 0x0808080808192b19, 0x08080808082b0808, 0x08080808082b082b, 0x08080808082b1919,
    0x08080808082b2b08, 0x0808080819080819, 0x0808080819081908, 0x080808081908192b, 0x0808080819082b19, 0x0808080819190808,
    0x080808081919082b, 0x0808080819191919, 0x0808080819192b08, 0x08080808192b0819, 0x08080808192b1908, 0x080808082b080808,
    0x080808082b08082b, 0x080808082b081919, 0x080808082b082b08, 0x080808082b190819, 0x080808082b191908, 0x080808082b192b19,
    0x080808082b2b0808, 0x0808081908080819, 0x0808081908081908, 0x080808190808192b, 0x0808081908082b19, 0x0808081908190808,
    0x080808190819082b, 0x0808081908191919, 0x0808081908192b08, 0x0808081908192b2b, 0x08080819082b0819, 0x08080819082b1908,
    0x0808081919080808, 0x080808191908082b, 0x0808081919081919, 0x0808081919082b08, 0x0808081919190819, 0x0808081919191908,
    0x08080819192b0808, 0x08080819192b2b08, 0x080808192b080819, 0x080808192b081908, 0x080808192b190808, 0x0808082b08080808,
    0x0808082b0808082b, 0x0808082b08081919, 0x0808082b08082b08, 0x0808082b08190819, 0x0808082b08191908, 0x0808082b082b0808,
    0x0808082b19080819, 0x0808082b19081908, 0x0808082b19190808, 0x0808082b19191919, 0x0808082b2b080808, 0x0808082b2b082b2b,
    0x0808190808080819, 0x0808190808081908, 0x080819080808192b, 0x0808190808082b19, 0x0808190808190808, 0x080819080819082b,
    0x0808190808191919, 0x0808190808192b08, 0x08081908082b0819, 0x08081908082b1908, 0x0808190819080808, 0x080819081908082b,
    0x0808190819081919, 0x0808190819082b08, 0x0808190819190819, 0x0808190819191908, 0x080819081919192b, 0x08081908192b0808,
    0x080819082b080819, 0x080819082b081908, 0x080819082b190808, 0x0808191908080808, 0x080819190808082b, 0x0808191908081919,
    0x0808191908082b08, 0x0808191908190819, 0x0808191908191908, 0x08081919082b0808, 0x0808191919080819, 0x0808191919081908,
    0x0808191919190808, 0x08081919192b0819, 0x080819192b080808, 0x0808192b08080819, 0x0808192b08081908, 0x0808192b08190808,
    0x0808192b082b192b, 0x0808192b19080808, 0x0808192b1908082b, 0x0808192b2b081908, 0x08082b0808080808, 0x08082b080808082b,
    0x08082b0808081919, 0x08082b0808082b08, 0x08082b0808082b2b, 0x08082b0808190819, 0x08082b0808191908, 0x08082b08082b0808,
    0x08082b08082b1919, 0x08082b0819080819, 0x08082b0819081908, 0x08082b0819190808, 0x08082b0819192b08, 0x08082b082b080808,
    0x08082b082b2b0808, 0x08082b082b2b2b2b, 0x08082b1908080819, 0x08082b1908081908, 0x08082b1908190808, 0x08082b1919080808,
    0x08082b192b080819, 0x08082b192b082b19, 0x08082b2b08080808, 0x08082b2b082b0808, 0x08082b2b082b2b08, 0x08082b2b2b19192b,
    0x08082b2b2b2b0808, 0x0819080808080819, 0x0819080808081908, 0x081908080808192b, 0x0819080808082b19, 0x0819080808190808,
    0x081908080819082b, 0x0819080808191919, 0x0819080808192b08, 0x08190808082b0819, 0x08190808082b1908, 0x0819080819080808,
    0x081908081908082b, 0x0819080819081919, 0x0819080819082b08, 0x0819080819190819, 0x0819080819191908, 0x08190808192b0808,
    0x08190808192b2b2b, 0x081908082b080819, 0x081908082b081908, 0x081908082b190808, 0x0819081908080808, 0x081908190808082b,
    0x0819081908081919, 0x0819081908082b08, 0x0819081908190819, 0x0819081908191908, 0x08190819082b0808, 0x0819081919080819,
    0x0819081919081908, 0x0819081919190808, 0x081908192b080808, 0x081908192b191908, 0x081908192b19192b, 0x0819082b08080819,
    0x0819082b08081908, 0x0819082b0808192b, 0x0819082b08190808, 0x0819082b19080808, 0x0819082b192b0808, 0x0819190808080808,
    0x081919080808082b, 0x0819190808081919, 0x0819190808082b08, 0x0819190808190819, 0x0819190808191908, 0x08191908082b0808,
    0x0819190819080819, 0x0819190819081908, 0x0819190819082b19, 0x0819190819190808, 0x08191908192b1908, 0x081919082b080808,
    0x0819191908080819, 0x0819191908081908, 0x0819191908190808, 0x0819191919080808, 0x0819192b08080808, 0x0819192b08191908,
    0x0819192b19082b19, 0x08192b0808080819, 0x08192b0808081908, 0x08192b0808190808, 0x08192b080819082b, 0x08192b0819080808,
    0x08192b0819191908, 0x08192b082b08192b, 0x08192b1908080808, 0x08192b1908081919, 0x08192b19192b192b, 0x08192b2b19190819,
    0x08192b2b2b2b2b19, 0x082b080808080808, 0x082b08080808082b, 0x082b080808081919, 0x082b080808082b08, 0x082b080808082b2b,
    0x082b080808190819, 0x082b080808191908, 0x082b0808082b0808, 0x082b080819080819, 0x082b080819081908, 0x082b080819190808,
    0x082b08082b080808, 0x082b08082b2b0808, 0x082b081908080819, 0x082b081908081908, 0x082b081908190808, 0x082b081919080808,
    0x082b081919082b08, 0x082b0819192b1919, 0x082b082b08080808, 0x082b082b082b082b, 0x082b082b2b080808, 0x082b082b2b2b2b08,
    0x082b190808080819, 0x082b190808081908, 0x082b190808190808, 0x082b1908082b2b19, 0x082b190819080808, 0x082b191908080808,
    0x082b191919080819, 0x082b19191919082b, 0x082b19192b192b19, 0x082b192b08080819, 0x082b192b08192b2b, 0x082b192b2b2b192b,
    0x082b2b0808080808, 0x082b2b0808082b08, 0x082b2b0808082b2b, 0x082b2b08082b0808, 0x082b2b0819191919, 0x082b2b082b082b08,
    0x082b2b082b2b082b, 0x082b2b19192b2b08, 0x082b2b192b190808, 0x082b2b2b08082b08, 0x082b2b2b082b0808, 0x082b2b2b2b08082b,
    0x082b2b2b2b082b08, 0x082b2b2b2b082b2b, 0x1908080808080819, 0x1908080808081908, 0x190808080808192b, 0x1908080808082b19,
    0x1908080808190808, 0x190808080819082b, 0x1908080808191919, 0x1908080808192b08, 0x19080808082b0819, 0x19080808082b1908,
    0x1908080819080808, 0x190808081908082b, 0x1908080819081919, 0x1908080819082b08, 0x1908080819082b2b, 0x1908080819190819,
    0x1908080819191908, 0x19080808192b0808, 0x19080808192b1919, 0x190808082b080819, 0x190808082b081908, 0x190808082b190808,
    0x1908081908080808, 0x190808190808082b, 0x1908081908081919, 0x1908081908082b08, 0x1908081908190819, 0x1908081908191908,
    0x19080819082b0808, 0x1908081919080819, 0x1908081919081908, 0x1908081919190808, 0x190808192b080808, 0x190808192b081919,
    0x190808192b2b082b, 0x1908082b08080819, 0x1908082b08081908, 0x1908082b08190808, 0x1908082b0819082b, 0x1908082b082b2b19,
    0x1908082b19080808, 0x1908190808080808, 0x190819080808082b, 0x1908190808081919, 0x1908190808082b08, 0x1908190808190819,
    0x1908190808191908, 0x1908190808192b19, 0x19081908082b0808, 0x1908190819080819, 0x1908190819081908, 0x1908190819190808,
    0x190819082b080808, 0x190819082b191908, 0x1908191908080819, 0x1908191908081908, 0x1908191908190808, 0x19081919082b1908,
    0x1908191919080808, 0x190819192b192b2b, 0x1908192b08080808, 0x1908192b08082b2b, 0x1908192b19081908, 0x1908192b19190808,
    0x19082b0808080819, 0x19082b0808081908, 0x19082b0808190808, 0x19082b0819080808, 0x19082b0819081919, 0x19082b0819191908,
    0x19082b08192b082b, 0x19082b1908080808, 0x19082b1908190819, 0x19082b1919081908, 0x19082b1919190808, 0x19082b19192b2b19,
    0x19082b2b08081908, 0x1919080808080808, 0x191908080808082b, 0x1919080808081919, 0x1919080808082b08, 0x1919080808190819,
    0x1919080808191908, 0x19190808082b0808, 0x19190808082b2b08, 0x1919080819080819, 0x1919080819081908, 0x1919080819190808,
    0x191908082b080808, 0x1919081908080819, 0x1919081908081908, 0x1919081908190808, 0x1919081908191919, 0x1919081919080808,
    0x191908191908082b, 0x1919082b08080808, 0x1919082b19081908, 0x1919082b2b2b2b2b, 0x1919190808080819, 0x1919190808081908,
    0x1919190808190808, 0x19191908082b0819, 0x1919190819080808, 0x19191908192b0808, 0x191919082b080819, 0x191919082b2b0819,
    0x1919191908080808, 0x1919191908082b08, 0x191919192b080808, 0x191919192b082b08, 0x1919192b082b0819, 0x1919192b192b2b08,
    0x1919192b2b2b0819, 0x19192b0808080808, 0x19192b0808191908, 0x19192b0819080819, 0x19192b0819190808, 0x19192b082b192b19,
    0x19192b1908192b2b, 0x19192b1919080808, 0x19192b191908082b, 0x19192b2b2b081919, 0x192b080808080819, 0x192b080808081908,
    0x192b080808190808, 0x192b080819080808, 0x192b080819191908, 0x192b0808192b082b, 0x192b08082b08192b, 0x192b08082b2b2b19,
    0x192b081908080808, 0x192b082b082b1908, 0x192b082b19082b2b, 0x192b082b2b19082b, 0x192b190808080808, 0x192b19080819192b,
    0x192b191908190808, 0x192b191919080808, 0x192b191919081919, 0x192b19192b2b1908, 0x192b2b0808080819, 0x192b2b08192b2b2b,
    0x192b2b19082b1919, 0x192b2b2b0808192b, 0x192b2b2b19191908, 0x192b2b2b192b082b, 0x2b08080808080808, 0x2b0808080808082b,
    0x2b08080808081919, 0x2b08080808082b08, 0x2b08080808190819, 0x2b08080808191908, 0x2b080808082b0808, 0x2b080808082b2b2b,
    0x2b08080819080819, 0x2b08080819081908, 0x2b08080819190808, 0x2b0808082b080808, 0x2b0808082b08082b, 0x2b0808082b2b2b08,
    0x2b0808082b2b2b2b, 0x2b08081908080819, 0x2b08081908081908, 0x2b0808190808192b, 0x2b08081908190808, 0x2b08081919080808,
    0x2b08081919190819, 0x2b08081919192b19, 0x2b08082b08080808, 0x2b08082b082b0808, 0x2b08082b2b080808, 0x2b08082b2b08082b,
    0x2b08082b2b2b0808, 0x2b08082b2b2b2b08, 0x2b08190808080819, 0x2b08190808081908, 0x2b08190808190808, 0x2b0819080819082b,
    0x2b08190808191919, 0x2b08190819080808, 0x2b081908192b0808, 0x2b0819082b082b19, 0x2b08191908080808, 0x2b08191919081908,
    0x2b0819192b2b1919, 0x2b08192b08192b08, 0x2b08192b192b2b2b, 0x2b082b0808080808, 0x2b082b0808082b08, 0x2b082b08082b1919,
    0x2b082b0819192b2b, 0x2b082b082b080808, 0x2b082b082b08082b, 0x2b082b082b2b2b08, 0x2b082b190808192b, 0x2b082b2b082b082b,
    0x2b082b2b2b080808, 0x2b082b2b2b082b08, 0x2b082b2b2b19192b, 0x2b082b2b2b2b2b08, 0x2b19080808080819, 0x2b19080808081908,
    0x2b19080808190808, 0x2b19080819080808, 0x2b1908081919192b, 0x2b1908082b081908, 0x2b19081908080808, 0x2b190819082b082b,
    0x2b190819192b1908, 0x2b19082b1919192b, 0x2b19082b2b082b19, 0x2b19190808080808, 0x2b19190808081919, 0x2b19190819081908,
    0x2b19190819190808, 0x2b19190819192b08, 0x2b191919082b2b19, 0x2b1919192b190808, 0x2b1919192b19082b, 0x2b19192b19080819,
    0x2b192b0819190819, 0x2b192b082b2b192b, 0x2b192b1919082b19, 0x2b192b2b08191919, 0x2b192b2b192b0808, 0x2b2b080808080808,
    0x2b2b08080808082b, 0x2b2b080808082b08, 0x2b2b080808082b2b, 0x2b2b0808082b0808, 0x2b2b0808082b2b2b, 0x2b2b08082b2b0808,
    0x2b2b081919190819, 0x2b2b081919192b19, 0x2b2b08192b2b192b, 0x2b2b082b08080808, 0x2b2b082b0808082b, 0x2b2b082b08082b08,
    0x2b2b082b082b2b2b, 0x2b2b082b2b080808, 0x2b2b082b2b2b0808, 0x2b2b190819080808, 0x2b2b19082b191919, 0x2b2b192b192b1919,
    0x2b2b192b2b192b08, 0x2b2b2b0808082b2b, 0x2b2b2b08082b0808, 0x2b2b2b08082b082b, 0x2b2b2b08082b2b08, 0x2b2b2b082b2b0808,
    0x2b2b2b082b2b2b08, 0x2b2b2b1908081908, 0x2b2b2b192b081908, 0x2b2b2b192b08192b, 0x2b2b2b2b082b2b08, 0x2b2b2b2b082b2b2b,
    0x2b2b2b2b2b190819, 0x2b2b2b2b2b2b2b2b,
};

static const uint64_t iq2s_grid[1024] = {
    0x0808080808080808, 0x080808080808082b, 0x0808080808081919, 0x0808080808082b08, 0x0808080808082b2b, 0x0808080808190819,
    0x0808080808191908, 0x080808080819192b, 0x0808080808192b19, 0x08080808082b0808, 0x08080808082b082b, 0x08080808082b1919,
    0x08080808082b2b08, 0x0808080819080819, 0x0808080819081908, 0x080808081908192b, 0x0808080819082b19, 0x0808080819190808,
    0x080808081919082b, 0x0808080819191919, 0x0808080819192b08, 0x08080808192b0819, 0x08080808192b1908, 0x08080808192b192b,
    0x08080808192b2b19, 0x080808082b080808, 0x080808082b08082b, 0x080808082b081919, 0x080808082b082b08, 0x080808082b190819,
    0x080808082b191908, 0x080808082b2b0808, 0x080808082b2b1919, 0x080808082b2b2b2b, 0x0808081908080819, 0x0808081908081908,
    0x080808190808192b, 0x0808081908082b19, 0x0808081908190808, 0x080808190819082b, 0x0808081908191919, 0x0808081908192b08,
    0x08080819082b0819, 0x08080819082b1908, 0x0808081919080808, 0x080808191908082b, 0x0808081919081919, 0x0808081919082b08,
    0x0808081919190819, 0x0808081919191908, 0x080808191919192b, 0x0808081919192b19, 0x08080819192b0808, 0x08080819192b1919,
    0x08080819192b2b08, 0x080808192b080819, 0x080808192b081908, 0x080808192b190808, 0x080808192b19082b, 0x080808192b191919,
    0x080808192b2b0819, 0x080808192b2b1908, 0x0808082b08080808, 0x0808082b0808082b, 0x0808082b08081919, 0x0808082b08082b08,
    0x0808082b08190819, 0x0808082b08191908, 0x0808082b082b0808, 0x0808082b082b2b2b, 0x0808082b19080819, 0x0808082b19081908,
    0x0808082b1908192b, 0x0808082b19082b19, 0x0808082b19190808, 0x0808082b19191919, 0x0808082b2b080808, 0x0808082b2b081919,
    0x0808082b2b082b2b, 0x0808082b2b191908, 0x0808082b2b2b082b, 0x0808190808080819, 0x0808190808081908, 0x080819080808192b,
    0x0808190808082b19, 0x0808190808190808, 0x080819080819082b, 0x0808190808191919, 0x0808190808192b08, 0x08081908082b0819,
    0x08081908082b1908, 0x08081908082b192b, 0x08081908082b2b19, 0x0808190819080808, 0x080819081908082b, 0x0808190819081919,
    0x0808190819082b08, 0x0808190819082b2b, 0x0808190819190819, 0x0808190819191908, 0x080819081919192b, 0x0808190819192b19,
    0x08081908192b0808, 0x08081908192b082b, 0x08081908192b1919, 0x080819082b080819, 0x080819082b081908, 0x080819082b08192b,
    0x080819082b082b19, 0x080819082b190808, 0x080819082b191919, 0x080819082b192b08, 0x080819082b2b0819, 0x080819082b2b1908,
    0x0808191908080808, 0x080819190808082b, 0x0808191908081919, 0x0808191908082b08, 0x0808191908082b2b, 0x0808191908190819,
    0x0808191908191908, 0x080819190819192b, 0x0808191908192b19, 0x08081919082b0808, 0x08081919082b1919, 0x08081919082b2b08,
    0x0808191919080819, 0x0808191919081908, 0x080819191908192b, 0x0808191919082b19, 0x0808191919190808, 0x080819191919082b,
    0x0808191919191919, 0x0808191919192b08, 0x08081919192b0819, 0x08081919192b1908, 0x080819192b080808, 0x080819192b08082b,
    0x080819192b081919, 0x080819192b082b08, 0x080819192b190819, 0x080819192b191908, 0x080819192b2b0808, 0x0808192b08080819,
    0x0808192b08081908, 0x0808192b0808192b, 0x0808192b08082b19, 0x0808192b08190808, 0x0808192b08191919, 0x0808192b19080808,
    0x0808192b19081919, 0x0808192b19082b08, 0x0808192b19190819, 0x0808192b19191908, 0x0808192b192b0808, 0x0808192b2b080819,
    0x0808192b2b081908, 0x0808192b2b190808, 0x08082b0808080808, 0x08082b080808082b, 0x08082b0808081919, 0x08082b0808082b08,
    0x08082b0808190819, 0x08082b0808191908, 0x08082b080819192b, 0x08082b0808192b19, 0x08082b08082b0808, 0x08082b08082b1919,
    0x08082b08082b2b2b, 0x08082b0819080819, 0x08082b0819081908, 0x08082b081908192b, 0x08082b0819082b19, 0x08082b0819190808,
    0x08082b081919082b, 0x08082b0819191919, 0x08082b0819192b08, 0x08082b08192b0819, 0x08082b08192b1908, 0x08082b082b080808,
    0x08082b082b081919, 0x08082b082b191908, 0x08082b082b2b2b2b, 0x08082b1908080819, 0x08082b1908081908, 0x08082b1908190808,
    0x08082b190819082b, 0x08082b1908191919, 0x08082b1908192b08, 0x08082b19082b0819, 0x08082b1919080808, 0x08082b1919081919,
    0x08082b1919082b08, 0x08082b1919190819, 0x08082b1919191908, 0x08082b19192b0808, 0x08082b192b080819, 0x08082b192b190808,
    0x08082b2b08080808, 0x08082b2b08190819, 0x08082b2b08191908, 0x08082b2b082b082b, 0x08082b2b082b2b08, 0x08082b2b082b2b2b,
    0x08082b2b19190808, 0x08082b2b2b192b19, 0x0819080808080819, 0x0819080808081908, 0x081908080808192b, 0x0819080808082b19,
    0x0819080808190808, 0x081908080819082b, 0x0819080808191919, 0x0819080808192b08, 0x08190808082b0819, 0x08190808082b1908,
    0x08190808082b192b, 0x0819080819080808, 0x081908081908082b, 0x0819080819081919, 0x0819080819082b08, 0x0819080819190819,
    0x0819080819191908, 0x081908081919192b, 0x0819080819192b19, 0x08190808192b0808, 0x08190808192b082b, 0x08190808192b1919,
    0x08190808192b2b08, 0x081908082b080819, 0x081908082b081908, 0x081908082b08192b, 0x081908082b190808, 0x081908082b191919,
    0x081908082b192b08, 0x081908082b2b0819, 0x081908082b2b1908, 0x0819081908080808, 0x081908190808082b, 0x0819081908081919,
    0x0819081908082b08, 0x0819081908082b2b, 0x0819081908190819, 0x0819081908191908, 0x081908190819192b, 0x0819081908192b19,
    0x08190819082b0808, 0x08190819082b082b, 0x08190819082b1919, 0x08190819082b2b08, 0x0819081919080819, 0x0819081919081908,
    0x081908191908192b, 0x0819081919082b19, 0x0819081919190808, 0x081908191919082b, 0x0819081919191919, 0x0819081919192b08,
    0x08190819192b0819, 0x08190819192b1908, 0x081908192b080808, 0x081908192b08082b, 0x081908192b081919, 0x081908192b082b08,
    0x081908192b190819, 0x081908192b191908, 0x0819082b08080819, 0x0819082b08081908, 0x0819082b08082b19, 0x0819082b08190808,
    0x0819082b08191919, 0x0819082b082b0819, 0x0819082b082b1908, 0x0819082b19080808, 0x0819082b19081919, 0x0819082b19190819,
    0x0819082b19191908, 0x0819082b2b080819, 0x0819082b2b081908, 0x0819082b2b190808, 0x0819190808080808, 0x081919080808082b,
    0x0819190808081919, 0x0819190808082b08, 0x0819190808190819, 0x0819190808191908, 0x081919080819192b, 0x0819190808192b19,
    0x08191908082b0808, 0x08191908082b1919, 0x08191908082b2b08, 0x0819190819080819, 0x0819190819081908, 0x081919081908192b,
    0x0819190819082b19, 0x0819190819190808, 0x081919081919082b, 0x0819190819191919, 0x0819190819192b08, 0x08191908192b0819,
    0x08191908192b1908, 0x081919082b080808, 0x081919082b08082b, 0x081919082b081919, 0x081919082b082b08, 0x081919082b190819,
    0x081919082b191908, 0x081919082b2b0808, 0x0819191908080819, 0x0819191908081908, 0x081919190808192b, 0x0819191908082b19,
    0x0819191908190808, 0x081919190819082b, 0x0819191908191919, 0x0819191908192b08, 0x08191919082b0819, 0x08191919082b1908,
    0x0819191919080808, 0x081919191908082b, 0x0819191919081919, 0x0819191919082b08, 0x0819191919190819, 0x0819191919191908,
    0x08191919192b0808, 0x081919192b080819, 0x081919192b081908, 0x081919192b190808, 0x0819192b08080808, 0x0819192b08081919,
    0x0819192b08082b08, 0x0819192b08190819, 0x0819192b08191908, 0x0819192b082b0808, 0x0819192b19080819, 0x0819192b19081908,
    0x0819192b19190808, 0x0819192b2b080808, 0x0819192b2b2b2b2b, 0x08192b0808080819, 0x08192b0808081908, 0x08192b080808192b,
    0x08192b0808082b19, 0x08192b0808190808, 0x08192b0808191919, 0x08192b0808192b08, 0x08192b08082b0819, 0x08192b0819080808,
    0x08192b081908082b, 0x08192b0819081919, 0x08192b0819082b08, 0x08192b0819190819, 0x08192b0819191908, 0x08192b08192b0808,
    0x08192b082b080819, 0x08192b082b081908, 0x08192b1908080808, 0x08192b190808082b, 0x08192b1908081919, 0x08192b1908082b08,
    0x08192b1908190819, 0x08192b1908191908, 0x08192b19082b0808, 0x08192b1919080819, 0x08192b1919081908, 0x08192b1919190808,
    0x08192b19192b2b19, 0x08192b192b2b082b, 0x08192b2b08081908, 0x08192b2b08190808, 0x08192b2b19080808, 0x08192b2b1919192b,
    0x082b080808080808, 0x082b08080808082b, 0x082b080808081919, 0x082b080808082b08, 0x082b080808190819, 0x082b080808191908,
    0x082b08080819192b, 0x082b080808192b19, 0x082b0808082b0808, 0x082b0808082b1919, 0x082b0808082b2b2b, 0x082b080819080819,
    0x082b080819081908, 0x082b080819190808, 0x082b08081919082b, 0x082b080819191919, 0x082b0808192b1908, 0x082b08082b080808,
    0x082b08082b082b2b, 0x082b08082b191908, 0x082b08082b2b2b2b, 0x082b081908080819, 0x082b081908081908, 0x082b081908190808,
    0x082b08190819082b, 0x082b081908191919, 0x082b0819082b0819, 0x082b081919080808, 0x082b08191908082b, 0x082b081919081919,
    0x082b081919190819, 0x082b081919191908, 0x082b0819192b0808, 0x082b08192b080819, 0x082b08192b081908, 0x082b08192b190808,
    0x082b082b08080808, 0x082b082b08082b2b, 0x082b082b082b082b, 0x082b082b082b2b08, 0x082b082b082b2b2b, 0x082b082b19081908,
    0x082b082b19190808, 0x082b082b2b082b08, 0x082b082b2b082b2b, 0x082b082b2b2b2b08, 0x082b190808080819, 0x082b190808081908,
    0x082b19080808192b, 0x082b190808082b19, 0x082b190808190808, 0x082b190808191919, 0x082b190808192b08, 0x082b1908082b0819,
    0x082b1908082b1908, 0x082b190819080808, 0x082b19081908082b, 0x082b190819081919, 0x082b190819082b08, 0x082b190819190819,
    0x082b190819191908, 0x082b1908192b0808, 0x082b19082b080819, 0x082b19082b081908, 0x082b19082b190808, 0x082b191908080808,
    0x082b191908081919, 0x082b191908082b08, 0x082b191908190819, 0x082b191908191908, 0x082b1919082b0808, 0x082b191919080819,
    0x082b191919081908, 0x082b191919190808, 0x082b1919192b192b, 0x082b19192b080808, 0x082b192b08080819, 0x082b192b08081908,
    0x082b192b08190808, 0x082b192b19080808, 0x082b192b19192b19, 0x082b2b0808080808, 0x082b2b0808081919, 0x082b2b0808190819,
    0x082b2b0808191908, 0x082b2b0819080819, 0x082b2b0819081908, 0x082b2b0819190808, 0x082b2b082b082b2b, 0x082b2b082b2b2b2b,
    0x082b2b1908080819, 0x082b2b1908081908, 0x082b2b1908190808, 0x082b2b192b191919, 0x082b2b2b08082b2b, 0x082b2b2b082b082b,
    0x082b2b2b192b1908, 0x082b2b2b2b082b08, 0x082b2b2b2b082b2b, 0x1908080808080819, 0x1908080808081908, 0x190808080808192b,
    0x1908080808082b19, 0x1908080808190808, 0x190808080819082b, 0x1908080808191919, 0x1908080808192b08, 0x1908080808192b2b,
    0x19080808082b0819, 0x19080808082b1908, 0x19080808082b192b, 0x1908080819080808, 0x190808081908082b, 0x1908080819081919,
    0x1908080819082b08, 0x1908080819082b2b, 0x1908080819190819, 0x1908080819191908, 0x190808081919192b, 0x1908080819192b19,
    0x19080808192b0808, 0x19080808192b082b, 0x19080808192b1919, 0x190808082b080819, 0x190808082b081908, 0x190808082b190808,
    0x190808082b191919, 0x190808082b192b08, 0x190808082b2b0819, 0x190808082b2b1908, 0x1908081908080808, 0x190808190808082b,
    0x1908081908081919, 0x1908081908082b08, 0x1908081908190819, 0x1908081908191908, 0x190808190819192b, 0x1908081908192b19,
    0x19080819082b0808, 0x19080819082b082b, 0x19080819082b1919, 0x1908081919080819, 0x1908081919081908, 0x190808191908192b,
    0x1908081919082b19, 0x1908081919190808, 0x190808191919082b, 0x1908081919191919, 0x1908081919192b08, 0x19080819192b0819,
    0x19080819192b1908, 0x190808192b080808, 0x190808192b08082b, 0x190808192b081919, 0x190808192b082b08, 0x190808192b190819,
    0x190808192b191908, 0x190808192b2b0808, 0x1908082b08080819, 0x1908082b08081908, 0x1908082b08190808, 0x1908082b0819082b,
    0x1908082b08191919, 0x1908082b08192b08, 0x1908082b082b1908, 0x1908082b19080808, 0x1908082b19081919, 0x1908082b19082b08,
    0x1908082b19190819, 0x1908082b19191908, 0x1908082b192b0808, 0x1908082b2b080819, 0x1908082b2b081908, 0x1908190808080808,
    0x190819080808082b, 0x1908190808081919, 0x1908190808082b08, 0x1908190808082b2b, 0x1908190808190819, 0x1908190808191908,
    0x190819080819192b, 0x1908190808192b19, 0x19081908082b0808, 0x19081908082b082b, 0x19081908082b1919, 0x19081908082b2b08,
    0x1908190819080819, 0x1908190819081908, 0x190819081908192b, 0x1908190819082b19, 0x1908190819190808, 0x190819081919082b,
    0x1908190819191919, 0x1908190819192b08, 0x19081908192b0819, 0x19081908192b1908, 0x190819082b080808, 0x190819082b08082b,
    0x190819082b081919, 0x190819082b082b08, 0x190819082b190819, 0x190819082b191908, 0x190819082b2b0808, 0x1908191908080819,
    0x1908191908081908, 0x190819190808192b, 0x1908191908082b19, 0x1908191908190808, 0x190819190819082b, 0x1908191908191919,
    0x1908191908192b08, 0x19081919082b0819, 0x19081919082b1908, 0x1908191919080808, 0x190819191908082b, 0x1908191919081919,
    0x1908191919082b08, 0x1908191919190819, 0x1908191919191908, 0x19081919192b0808, 0x19081919192b2b2b, 0x190819192b080819,
    0x190819192b081908, 0x190819192b190808, 0x1908192b08080808, 0x1908192b0808082b, 0x1908192b08081919, 0x1908192b08082b08,
    0x1908192b08190819, 0x1908192b08191908, 0x1908192b082b0808, 0x1908192b19080819, 0x1908192b19081908, 0x1908192b19190808,
    0x1908192b2b080808, 0x1908192b2b2b1919, 0x19082b0808080819, 0x19082b0808081908, 0x19082b0808082b19, 0x19082b0808190808,
    0x19082b080819082b, 0x19082b0808191919, 0x19082b0808192b08, 0x19082b08082b0819, 0x19082b08082b1908, 0x19082b0819080808,
    0x19082b081908082b, 0x19082b0819081919, 0x19082b0819082b08, 0x19082b0819190819, 0x19082b0819191908, 0x19082b08192b0808,
    0x19082b082b081908, 0x19082b082b190808, 0x19082b1908080808, 0x19082b190808082b, 0x19082b1908081919, 0x19082b1908082b08,
    0x19082b1908190819, 0x19082b1908191908, 0x19082b19082b0808, 0x19082b1919080819, 0x19082b1919081908, 0x19082b1919190808,
    0x19082b192b080808, 0x19082b192b19192b, 0x19082b2b08080819, 0x19082b2b08081908, 0x19082b2b08190808, 0x19082b2b19080808,
    0x1919080808080808, 0x191908080808082b, 0x1919080808081919, 0x1919080808082b08, 0x1919080808190819, 0x1919080808191908,
    0x191908080819192b, 0x1919080808192b19, 0x19190808082b0808, 0x19190808082b082b, 0x19190808082b1919, 0x19190808082b2b08,
    0x1919080819080819, 0x1919080819081908, 0x191908081908192b, 0x1919080819082b19, 0x1919080819190808, 0x191908081919082b,
    0x1919080819191919, 0x1919080819192b08, 0x19190808192b0819, 0x19190808192b1908, 0x191908082b080808, 0x191908082b08082b,
    0x191908082b081919, 0x191908082b082b08, 0x191908082b190819, 0x191908082b191908, 0x1919081908080819, 0x1919081908081908,
    0x191908190808192b, 0x1919081908082b19, 0x1919081908190808, 0x191908190819082b, 0x1919081908191919, 0x1919081908192b08,
    0x19190819082b0819, 0x19190819082b1908, 0x1919081919080808, 0x191908191908082b, 0x1919081919081919, 0x1919081919082b08,
    0x1919081919190819, 0x1919081919191908, 0x19190819192b0808, 0x191908192b080819, 0x191908192b081908, 0x191908192b190808,
    0x1919082b08080808, 0x1919082b08081919, 0x1919082b08082b08, 0x1919082b08190819, 0x1919082b08191908, 0x1919082b082b0808,
    0x1919082b19080819, 0x1919082b19081908, 0x1919082b19190808, 0x1919082b192b2b19, 0x1919082b2b080808, 0x1919190808080819,
    0x1919190808081908, 0x191919080808192b, 0x1919190808082b19, 0x1919190808190808, 0x191919080819082b, 0x1919190808191919,
    0x1919190808192b08, 0x19191908082b0819, 0x19191908082b1908, 0x1919190819080808, 0x191919081908082b, 0x1919190819081919,
    0x1919190819082b08, 0x1919190819190819, 0x1919190819191908, 0x19191908192b0808, 0x191919082b080819, 0x191919082b081908,
    0x191919082b190808, 0x1919191908080808, 0x191919190808082b, 0x1919191908081919, 0x1919191908082b08, 0x1919191908190819,
    0x1919191908191908, 0x19191919082b0808, 0x1919191919080819, 0x1919191919081908, 0x1919191919190808, 0x191919192b080808,
    0x1919192b08080819, 0x1919192b08081908, 0x1919192b08190808, 0x1919192b082b192b, 0x1919192b19080808, 0x19192b0808080808,
    0x19192b080808082b, 0x19192b0808081919, 0x19192b0808082b08, 0x19192b0808190819, 0x19192b0808191908, 0x19192b08082b0808,
    0x19192b0819080819, 0x19192b0819081908, 0x19192b0819190808, 0x19192b0819192b2b, 0x19192b082b080808, 0x19192b1908080819,
    0x19192b1908081908, 0x19192b1908190808, 0x19192b1919080808, 0x19192b2b08080808, 0x19192b2b08192b19, 0x19192b2b2b081919,
    0x19192b2b2b2b2b08, 0x192b080808080819, 0x192b080808081908, 0x192b08080808192b, 0x192b080808190808, 0x192b08080819082b,
    0x192b080808191919, 0x192b080808192b08, 0x192b0808082b0819, 0x192b0808082b1908, 0x192b080819080808, 0x192b080819081919,
    0x192b080819082b08, 0x192b080819190819, 0x192b080819191908, 0x192b0808192b0808, 0x192b08082b081908, 0x192b08082b190808,
    0x192b081908080808, 0x192b08190808082b, 0x192b081908081919, 0x192b081908082b08, 0x192b081908190819, 0x192b081908191908,
    0x192b0819082b0808, 0x192b081919080819, 0x192b081919081908, 0x192b081919190808, 0x192b08192b080808, 0x192b08192b192b19,
    0x192b082b08081908, 0x192b082b08190808, 0x192b082b19080808, 0x192b082b1919192b, 0x192b082b2b2b0819, 0x192b190808080808,
    0x192b190808081919, 0x192b190808082b08, 0x192b190808190819, 0x192b190808191908, 0x192b1908082b0808, 0x192b190819080819,
    0x192b190819081908, 0x192b190819190808, 0x192b19082b080808, 0x192b191908080819, 0x192b191908081908, 0x192b191908190808,
    0x192b191919080808, 0x192b191919082b2b, 0x192b1919192b2b08, 0x192b19192b19082b, 0x192b192b08080808, 0x192b192b2b191908,
    0x192b2b0808080819, 0x192b2b0808081908, 0x192b2b0808190808, 0x192b2b08192b1919, 0x192b2b082b192b08, 0x192b2b1908080808,
    0x192b2b19082b2b2b, 0x192b2b2b1908082b, 0x192b2b2b2b2b0819, 0x2b08080808080808, 0x2b0808080808082b, 0x2b08080808081919,
    0x2b08080808082b08, 0x2b08080808190819, 0x2b08080808191908, 0x2b08080808192b19, 0x2b080808082b0808, 0x2b080808082b1919,
    0x2b08080819080819, 0x2b08080819081908, 0x2b08080819190808, 0x2b0808081919082b, 0x2b08080819191919, 0x2b08080819192b08,
    0x2b080808192b0819, 0x2b0808082b080808, 0x2b0808082b081919, 0x2b0808082b190819, 0x2b0808082b191908, 0x2b08081908080819,
    0x2b08081908081908, 0x2b08081908082b19, 0x2b08081908190808, 0x2b0808190819082b, 0x2b08081908191919, 0x2b08081908192b08,
    0x2b080819082b0819, 0x2b080819082b1908, 0x2b08081919080808, 0x2b0808191908082b, 0x2b08081919081919, 0x2b08081919082b08,
    0x2b08081919190819, 0x2b08081919191908, 0x2b0808192b080819, 0x2b0808192b081908, 0x2b0808192b190808, 0x2b0808192b2b2b19,
    0x2b08082b08080808, 0x2b08082b08081919, 0x2b08082b08082b2b, 0x2b08082b08190819, 0x2b08082b08191908, 0x2b08082b19080819,
    0x2b08082b19081908, 0x2b08082b19190808, 0x2b08190808080819, 0x2b08190808081908, 0x2b0819080808192b, 0x2b08190808082b19,
    0x2b08190808190808, 0x2b0819080819082b, 0x2b08190808191919, 0x2b08190808192b08, 0x2b081908082b0819, 0x2b08190819080808,
    0x2b0819081908082b, 0x2b08190819081919, 0x2b08190819082b08, 0x2b08190819190819, 0x2b08190819191908, 0x2b081908192b0808,
    0x2b0819082b080819, 0x2b0819082b081908, 0x2b0819082b190808, 0x2b08191908080808, 0x2b0819190808082b, 0x2b08191908081919,
    0x2b08191908082b08, 0x2b08191908190819, 0x2b08191908191908, 0x2b081919082b0808, 0x2b08191919080819, 0x2b08191919081908,
    0x2b08191919190808, 0x2b0819192b080808, 0x2b0819192b082b2b, 0x2b08192b08080819, 0x2b08192b08081908, 0x2b08192b08190808,
    0x2b08192b082b2b19, 0x2b08192b19080808, 0x2b082b0808080808, 0x2b082b0808081919, 0x2b082b0808190819, 0x2b082b0808191908,
    0x2b082b0819080819, 0x2b082b0819081908, 0x2b082b0819190808, 0x2b082b082b2b082b, 0x2b082b1908080819, 0x2b082b1908081908,
    0x2b082b1919080808, 0x2b082b19192b1919, 0x2b082b2b082b082b, 0x2b082b2b19192b08, 0x2b082b2b19192b2b, 0x2b082b2b2b08082b,
    0x2b082b2b2b2b082b, 0x2b19080808080819, 0x2b19080808081908, 0x2b19080808082b19, 0x2b19080808190808, 0x2b1908080819082b,
    0x2b19080808191919, 0x2b19080808192b08, 0x2b190808082b1908, 0x2b19080819080808, 0x2b1908081908082b, 0x2b19080819081919,
    0x2b19080819082b08, 0x2b19080819190819, 0x2b19080819191908, 0x2b190808192b0808, 0x2b1908082b080819, 0x2b1908082b081908,
    0x2b1908082b190808, 0x2b19081908080808, 0x2b19081908081919, 0x2b19081908190819, 0x2b19081908191908, 0x2b19081919080819,
    0x2b19081919081908, 0x2b19081919190808, 0x2b19081919192b2b, 0x2b19082b08080819, 0x2b19082b08081908, 0x2b19082b08190808,
    0x2b19082b19080808, 0x2b19082b2b2b192b, 0x2b19190808080808, 0x2b1919080808082b, 0x2b19190808081919, 0x2b19190808082b08,
    0x2b19190808190819, 0x2b19190808191908, 0x2b191908082b0808, 0x2b19190819080819, 0x2b19190819081908, 0x2b19190819190808,
    0x2b1919082b080808, 0x2b1919082b19192b, 0x2b19191908080819, 0x2b19191908081908, 0x2b19191908190808, 0x2b19191919080808,
    0x2b1919192b192b08, 0x2b1919192b2b0819, 0x2b19192b08080808, 0x2b19192b1908192b, 0x2b19192b192b1908, 0x2b192b0808080819,
    0x2b192b0808081908, 0x2b192b0808190808, 0x2b192b08082b192b, 0x2b192b0819080808, 0x2b192b082b2b2b19, 0x2b192b1908080808,
    0x2b192b1919082b19, 0x2b192b191919082b, 0x2b192b2b2b190808, 0x2b2b080808080808, 0x2b2b080808081919, 0x2b2b080808082b2b,
    0x2b2b080808191908, 0x2b2b0808082b082b, 0x2b2b0808082b2b2b, 0x2b2b080819080819, 0x2b2b080819081908, 0x2b2b080819190808,
    0x2b2b08082b2b082b, 0x2b2b08082b2b2b2b, 0x2b2b081919080808, 0x2b2b0819192b1919, 0x2b2b082b0808082b, 0x2b2b082b08082b2b,
    0x2b2b082b082b082b, 0x2b2b082b082b2b08, 0x2b2b082b082b2b2b, 0x2b2b082b2b08082b, 0x2b2b082b2b082b08, 0x2b2b082b2b082b2b,
    0x2b2b082b2b2b2b08, 0x2b2b190808080819, 0x2b2b190808081908, 0x2b2b190808190808, 0x2b2b190819080808, 0x2b2b19082b082b19,
    0x2b2b19082b2b1908, 0x2b2b191908080808, 0x2b2b191908192b19, 0x2b2b192b19190819, 0x2b2b2b0808082b2b, 0x2b2b2b08082b2b08,
    0x2b2b2b082b2b082b, 0x2b2b2b1919191908, 0x2b2b2b192b08192b, 0x2b2b2b2b08082b08, 0x2b2b2b2b08082b2b, 0x2b2b2b2b082b0808,
    0x2b2b2b2b082b082b, 0x2b2b2b2b082b2b08, 0x2b2b2b2b2b082b08, 0x2b2b2b2b2b2b2b2b,
};

static const uint32_t iq3xxs_grid[256] = {
    0x04040404, 0x04040414, 0x04040424, 0x04040c0c, 0x04040c1c, 0x04040c3e, 0x04041404, 0x04041414, 0x04041c0c, 0x04042414,
    0x04043e1c, 0x04043e2c, 0x040c040c, 0x040c041c, 0x040c0c04, 0x040c0c14, 0x040c140c, 0x040c142c, 0x040c1c04, 0x040c1c14,
    0x040c240c, 0x040c2c24, 0x040c3e04, 0x04140404, 0x04140414, 0x04140424, 0x04140c0c, 0x04141404, 0x04141414, 0x04141c0c,
    0x04141c1c, 0x04141c3e, 0x04142c0c, 0x04142c3e, 0x04143e2c, 0x041c040c, 0x041c043e, 0x041c0c04, 0x041c0c14, 0x041c142c,
    0x041c3e04, 0x04240c1c, 0x04241c3e, 0x04242424, 0x04242c3e, 0x04243e1c, 0x04243e2c, 0x042c040c, 0x042c043e, 0x042c1c14,
    0x042c2c14, 0x04341c2c, 0x04343424, 0x043e0c04, 0x043e0c24, 0x043e0c34, 0x043e241c, 0x043e340c, 0x0c04040c, 0x0c04041c,
    0x0c040c04, 0x0c040c14, 0x0c04140c, 0x0c04141c, 0x0c041c04, 0x0c041c14, 0x0c041c24, 0x0c04243e, 0x0c042c04, 0x0c0c0404,
    0x0c0c0414, 0x0c0c0c0c, 0x0c0c1404, 0x0c0c1414, 0x0c14040c, 0x0c14041c, 0x0c140c04, 0x0c140c14, 0x0c14140c, 0x0c141c04,
    0x0c143e14, 0x0c1c0404, 0x0c1c0414, 0x0c1c1404, 0x0c1c1c0c, 0x0c1c2434, 0x0c1c3434, 0x0c24040c, 0x0c24042c, 0x0c242c04,
    0x0c2c1404, 0x0c2c1424, 0x0c2c2434, 0x0c2c3e0c, 0x0c34042c, 0x0c3e1414, 0x0c3e2404, 0x14040404, 0x14040414, 0x14040c0c,
    0x14040c1c, 0x14041404, 0x14041414, 0x14041434, 0x14041c0c, 0x14042414, 0x140c040c, 0x140c041c, 0x140c042c, 0x140c0c04,
    0x140c0c14, 0x140c140c, 0x140c1c04, 0x140c341c, 0x140c343e, 0x140c3e04, 0x14140404, 0x14140414, 0x14140c0c, 0x14140c3e,
    0x14141404, 0x14141414, 0x14141c3e, 0x14142404, 0x14142c2c, 0x141c040c, 0x141c0c04, 0x141c0c24, 0x141c3e04, 0x141c3e24,
    0x14241c2c, 0x14242c1c, 0x142c041c, 0x142c143e, 0x142c240c, 0x142c3e24, 0x143e040c, 0x143e041c, 0x143e0c34, 0x143e242c,
    0x1c04040c, 0x1c040c04, 0x1c040c14, 0x1c04140c, 0x1c04141c, 0x1c042c04, 0x1c04342c, 0x1c043e14, 0x1c0c0404, 0x1c0c0414,
    0x1c0c1404, 0x1c0c1c0c, 0x1c0c2424, 0x1c0c2434, 0x1c14040c, 0x1c14041c, 0x1c140c04, 0x1c14142c, 0x1c142c14, 0x1c143e14,
    0x1c1c0c0c, 0x1c1c1c1c, 0x1c241c04, 0x1c24243e, 0x1c243e14, 0x1c2c0404, 0x1c2c0434, 0x1c2c1414, 0x1c2c2c2c, 0x1c340c24,
    0x1c341c34, 0x1c34341c, 0x1c3e1c1c, 0x1c3e3404, 0x24040424, 0x24040c3e, 0x24041c2c, 0x24041c3e, 0x24042c1c, 0x24042c3e,
    0x240c3e24, 0x24141404, 0x24141c3e, 0x24142404, 0x24143404, 0x24143434, 0x241c043e, 0x241c242c, 0x24240424, 0x24242c0c,
    0x24243424, 0x242c142c, 0x242c241c, 0x242c3e04, 0x243e042c, 0x243e0c04, 0x243e0c14, 0x243e1c04, 0x2c040c14, 0x2c04240c,
    0x2c043e04, 0x2c0c0404, 0x2c0c0434, 0x2c0c1434, 0x2c0c2c2c, 0x2c140c24, 0x2c141c14, 0x2c143e14, 0x2c1c0414, 0x2c1c2c1c,
    0x2c240c04, 0x2c24141c, 0x2c24143e, 0x2c243e14, 0x2c2c0414, 0x2c2c1c0c, 0x2c342c04, 0x2c3e1424, 0x2c3e2414, 0x34041424,
    0x34042424, 0x34042434, 0x34043424, 0x340c140c, 0x340c340c, 0x34140c3e, 0x34143424, 0x341c1c04, 0x341c1c34, 0x34242424,
    0x342c042c, 0x342c2c14, 0x34341c1c, 0x343e041c, 0x343e140c, 0x3e04041c, 0x3e04042c, 0x3e04043e, 0x3e040c04, 0x3e041c14,
    0x3e042c14, 0x3e0c1434, 0x3e0c2404, 0x3e140c14, 0x3e14242c, 0x3e142c14, 0x3e1c0404, 0x3e1c0c2c, 0x3e1c1c1c, 0x3e1c3404,
    0x3e24140c, 0x3e24240c, 0x3e2c0404, 0x3e2c0414, 0x3e2c1424, 0x3e341c04,
};

static const uint32_t iq3s_grid[512] = {
    0x01010101, 0x01010103, 0x01010105, 0x0101010b, 0x0101010f, 0x01010301, 0x01010303, 0x01010305, 0x01010309, 0x0101030d,
    0x01010501, 0x01010503, 0x0101050b, 0x01010707, 0x01010901, 0x01010905, 0x0101090b, 0x0101090f, 0x01010b03, 0x01010b07,
    0x01010d01, 0x01010d05, 0x01010f03, 0x01010f09, 0x01010f0f, 0x01030101, 0x01030103, 0x01030105, 0x01030109, 0x01030301,
    0x01030303, 0x0103030b, 0x01030501, 0x01030507, 0x0103050f, 0x01030703, 0x0103070b, 0x01030909, 0x01030d03, 0x01030d0b,
    0x01030f05, 0x01050101, 0x01050103, 0x0105010b, 0x0105010f, 0x01050301, 0x01050307, 0x0105030d, 0x01050503, 0x0105050b,
    0x01050701, 0x01050709, 0x01050905, 0x0105090b, 0x0105090f, 0x01050b03, 0x01050b07, 0x01050f01, 0x01050f07, 0x01070107,
    0x01070303, 0x0107030b, 0x01070501, 0x01070505, 0x01070703, 0x01070707, 0x0107070d, 0x01070909, 0x01070b01, 0x01070b05,
    0x01070d0f, 0x01070f03, 0x01070f0b, 0x01090101, 0x01090307, 0x0109030f, 0x01090503, 0x01090509, 0x01090705, 0x01090901,
    0x01090907, 0x01090b03, 0x01090f01, 0x010b0105, 0x010b0109, 0x010b0501, 0x010b0505, 0x010b050d, 0x010b0707, 0x010b0903,
    0x010b090b, 0x010b090f, 0x010b0d0d, 0x010b0f07, 0x010d010d, 0x010d0303, 0x010d0307, 0x010d0703, 0x010d0b05, 0x010d0f03,
    0x010f0101, 0x010f0105, 0x010f0109, 0x010f0501, 0x010f0505, 0x010f050d, 0x010f0707, 0x010f0b01, 0x010f0b09, 0x03010101,
    0x03010103, 0x03010105, 0x03010109, 0x03010301, 0x03010303, 0x03010307, 0x0301030b, 0x0301030f, 0x03010501, 0x03010505,
    0x03010703, 0x03010709, 0x0301070d, 0x03010b09, 0x03010b0d, 0x03010d03, 0x03010f05, 0x03030101, 0x03030103, 0x03030107,
    0x0303010d, 0x03030301, 0x03030309, 0x03030503, 0x03030701, 0x03030707, 0x03030903, 0x03030b01, 0x03030b05, 0x03030f01,
    0x03030f0d, 0x03050101, 0x03050305, 0x0305030b, 0x0305030f, 0x03050501, 0x03050509, 0x03050705, 0x03050901, 0x03050907,
    0x03050b0b, 0x03050d01, 0x03050f05, 0x03070103, 0x03070109, 0x0307010f, 0x03070301, 0x03070307, 0x03070503, 0x0307050f,
    0x03070701, 0x03070709, 0x03070903, 0x03070d05, 0x03070f01, 0x03090107, 0x0309010b, 0x03090305, 0x03090309, 0x03090703,
    0x03090707, 0x03090905, 0x0309090d, 0x03090b01, 0x03090b09, 0x030b0103, 0x030b0301, 0x030b0307, 0x030b0503, 0x030b0701,
    0x030b0705, 0x030b0b03, 0x030d0501, 0x030d0509, 0x030d050f, 0x030d0909, 0x030d090d, 0x030f0103, 0x030f0107, 0x030f0301,
    0x030f0305, 0x030f0503, 0x030f070b, 0x030f0903, 0x030f0d05, 0x030f0f01, 0x05010101, 0x05010103, 0x05010107, 0x0501010b,
    0x0501010f, 0x05010301, 0x05010305, 0x05010309, 0x0501030d, 0x05010503, 0x05010507, 0x0501050f, 0x05010701, 0x05010705,
    0x05010903, 0x05010907, 0x0501090b, 0x05010b01, 0x05010b05, 0x05010d0f, 0x05010f01, 0x05010f07, 0x05010f0b, 0x05030101,
    0x05030105, 0x05030301, 0x05030307, 0x0503030f, 0x05030505, 0x0503050b, 0x05030703, 0x05030709, 0x05030905, 0x05030b03,
    0x05050103, 0x05050109, 0x0505010f, 0x05050503, 0x05050507, 0x05050701, 0x0505070f, 0x05050903, 0x05050b07, 0x05050b0f,
    0x05050f03, 0x05050f09, 0x05070101, 0x05070105, 0x0507010b, 0x05070303, 0x05070505, 0x05070509, 0x05070703, 0x05070707,
    0x05070905, 0x05070b01, 0x05070d0d, 0x05090103, 0x0509010f, 0x05090501, 0x05090507, 0x05090705, 0x0509070b, 0x05090903,
    0x05090f05, 0x05090f0b, 0x050b0109, 0x050b0303, 0x050b0505, 0x050b070f, 0x050b0901, 0x050b0b07, 0x050b0f01, 0x050d0101,
    0x050d0105, 0x050d010f, 0x050d0503, 0x050d0b0b, 0x050d0d03, 0x050f010b, 0x050f0303, 0x050f050d, 0x050f0701, 0x050f0907,
    0x050f0b01, 0x07010105, 0x07010303, 0x07010307, 0x0701030b, 0x0701030f, 0x07010505, 0x07010703, 0x07010707, 0x0701070b,
    0x07010905, 0x07010909, 0x0701090f, 0x07010b03, 0x07010d07, 0x07010f03, 0x07030103, 0x07030107, 0x0703010b, 0x07030309,
    0x07030503, 0x07030507, 0x07030901, 0x07030d01, 0x07030f05, 0x07030f0d, 0x07050101, 0x07050305, 0x07050501, 0x07050705,
    0x07050709, 0x07050b01, 0x07070103, 0x07070301, 0x07070309, 0x07070503, 0x07070507, 0x0707050f, 0x07070701, 0x07070903,
    0x07070907, 0x0707090f, 0x07070b0b, 0x07070f07, 0x07090107, 0x07090303, 0x0709030d, 0x07090505, 0x07090703, 0x07090b05,
    0x07090d01, 0x07090d09, 0x070b0103, 0x070b0301, 0x070b0305, 0x070b050b, 0x070b0705, 0x070b0909, 0x070b0b0d, 0x070b0f07,
    0x070d030d, 0x070d0903, 0x070f0103, 0x070f0107, 0x070f0501, 0x070f0505, 0x070f070b, 0x09010101, 0x09010109, 0x09010305,
    0x09010501, 0x09010509, 0x0901050f, 0x09010705, 0x09010903, 0x09010b01, 0x09010f01, 0x09030105, 0x0903010f, 0x09030303,
    0x09030307, 0x09030505, 0x09030701, 0x0903070b, 0x09030907, 0x09030b03, 0x09030b0b, 0x09050103, 0x09050107, 0x09050301,
    0x0905030b, 0x09050503, 0x09050707, 0x09050901, 0x09050b0f, 0x09050d05, 0x09050f01, 0x09070109, 0x09070303, 0x09070307,
    0x09070501, 0x09070505, 0x09070703, 0x0907070b, 0x09090101, 0x09090105, 0x09090509, 0x0909070f, 0x09090901, 0x09090f03,
    0x090b010b, 0x090b010f, 0x090b0503, 0x090b0d05, 0x090d0307, 0x090d0709, 0x090d0d01, 0x090f0301, 0x090f030b, 0x090f0701,
    0x090f0907, 0x090f0b03, 0x0b010105, 0x0b010301, 0x0b010309, 0x0b010505, 0x0b010901, 0x0b010909, 0x0b01090f, 0x0b010b05,
    0x0b010d0d, 0x0b010f09, 0x0b030103, 0x0b030107, 0x0b03010b, 0x0b030305, 0x0b030503, 0x0b030705, 0x0b030f05, 0x0b050101,
    0x0b050303, 0x0b050507, 0x0b050701, 0x0b05070d, 0x0b050b07, 0x0b070105, 0x0b07010f, 0x0b070301, 0x0b07050f, 0x0b070909,
    0x0b070b03, 0x0b070d0b, 0x0b070f07, 0x0b090103, 0x0b090109, 0x0b090501, 0x0b090705, 0x0b09090d, 0x0b0b0305, 0x0b0b050d,
    0x0b0b0b03, 0x0b0b0b07, 0x0b0d0905, 0x0b0f0105, 0x0b0f0109, 0x0b0f0505, 0x0d010303, 0x0d010307, 0x0d01030b, 0x0d010703,
    0x0d010707, 0x0d010d01, 0x0d030101, 0x0d030501, 0x0d03050f, 0x0d030d09, 0x0d050305, 0x0d050709, 0x0d050905, 0x0d050b0b,
    0x0d050d05, 0x0d050f01, 0x0d070101, 0x0d070309, 0x0d070503, 0x0d070901, 0x0d09050b, 0x0d090907, 0x0d090d05, 0x0d0b0101,
    0x0d0b0107, 0x0d0b0709, 0x0d0b0d01, 0x0d0d010b, 0x0d0d0901, 0x0d0f0303, 0x0d0f0307, 0x0f010101, 0x0f010109, 0x0f01010f,
    0x0f010501, 0x0f010505, 0x0f01070d, 0x0f010901, 0x0f010b09, 0x0f010d05, 0x0f030105, 0x0f030303, 0x0f030509, 0x0f030907,
    0x0f03090b, 0x0f050103, 0x0f050109, 0x0f050301, 0x0f05030d, 0x0f050503, 0x0f050701, 0x0f050b03, 0x0f070105, 0x0f070705,
    0x0f07070b, 0x0f070b07, 0x0f090103, 0x0f09010b, 0x0f090307, 0x0f090501, 0x0f090b01, 0x0f0b0505, 0x0f0b0905, 0x0f0d0105,
    0x0f0d0703, 0x0f0f0101,
};

static const uint64_t iq1s_grid[2048] = {
    0xffffffffffffffff, 0xffffffffffffff01, 0xffffffffffff0000, 0xffffffffffff01ff, 0xffffffffffff0101, 0xffffffffff00ff00,
    0xffffffffff000000, 0xffffffffff01ffff, 0xffffffffff01ff01, 0xffffffffff0101ff, 0xffffffffff010101, 0xffffffff00ff0000,
    0xffffffff0000ff00, 0xffffffff000000ff, 0xffffffff00000001, 0xffffffff00010000, 0xffffffff01ffffff, 0xffffffff01ffff01,
    0xffffffff01ff01ff, 0xffffffff01ff0101, 0xffffffff01000000, 0xffffffff0101ffff, 0xffffffff0101ff01, 0xffffffff010101ff,
    0xffffffff01010101, 0xffffff00ffff00ff, 0xffffff00ffff0000, 0xffffff00ff00ff00, 0xffffff00ff0000ff, 0xffffff00ff000001,
    0xffffff00ff000100, 0xffffff00ff000101, 0xffffff00ff010000, 0xffffff0000ffff00, 0xffffff0000ff0001, 0xffffff0000ff0100,
    0xffffff000000ff01, 0xffffff0000000000, 0xffffff0000000101, 0xffffff000001ff00, 0xffffff00000100ff, 0xffffff0000010001,
    0xffffff00000101ff, 0xffffff0001ff0000, 0xffffff000100ff00, 0xffffff00010000ff, 0xffffff0001000001, 0xffffff0001010000,
    0xffffff01ffffffff, 0xffffff01ffffff01, 0xffffff01ffff01ff, 0xffffff01ffff0101, 0xffffff01ff000000, 0xffffff01ff01ffff,
    0xffffff01ff01ff01, 0xffffff01ff0101ff, 0xffffff01ff010101, 0xffffff0100ff0000, 0xffffff010000ff00, 0xffffff0100000100,
    0xffffff01000100ff, 0xffffff0100010100, 0xffffff0101ffffff, 0xffffff0101ffff01, 0xffffff0101ff01ff, 0xffffff0101ff0101,
    0xffffff010100ff00, 0xffffff0101000000, 0xffffff0101000100, 0xffffff010101ffff, 0xffffff010101ff01, 0xffffff01010101ff,
    0xffffff0101010101, 0xffff00ffff00ff00, 0xffff00ffff0000ff, 0xffff00ffff000001, 0xffff00ffff010000, 0xffff00ff00ffff00,
    0xffff00ff00ff0100, 0xffff00ff00000000, 0xffff00ff00000101, 0xffff00ff000100ff, 0xffff00ff00010000, 0xffff00ff0100ff00,
    0xffff00ff01000100, 0xffff00ff01010000, 0xffff0000ffffff00, 0xffff0000ffff00ff, 0xffff0000ffff0000, 0xffff0000ffff0001,
    0xffff0000ff000000, 0xffff0000ff0001ff, 0xffff0000ff000101, 0xffff0000ff010100, 0xffff000000ffffff, 0xffff000000ff0000,
    0xffff000000ff0101, 0xffff00000000ffff, 0xffff00000000ff00, 0xffff0000000000ff, 0xffff000000000000, 0xffff000000000001,
    0xffff000000000100, 0xffff00000001ffff, 0xffff00000001ff01, 0xffff000000010000, 0xffff0000000101ff, 0xffff000000010101,
    0xffff000001ffff00, 0xffff00000100ff00, 0xffff000001000000, 0xffff0000010001ff, 0xffff000001000101, 0xffff00000101ff00,
    0xffff0000010100ff, 0xffff000001010000, 0xffff000001010001, 0xffff000001010100, 0xffff0001ff0000ff, 0xffff0001ff000100,
    0xffff000100ffff00, 0xffff000100ff00ff, 0xffff00010000ffff, 0xffff00010000ff01, 0xffff000100000000, 0xffff0001000001ff,
    0xffff00010001ffff, 0xffff00010001ff00, 0xffff000100010001, 0xffff000100010100, 0xffff000101ff0000, 0xffff00010100ff00,
    0xffff0001010000ff, 0xffff000101000100, 0xffff01ffffffffff, 0xffff01ffffffff01, 0xffff01ffffff01ff, 0xffff01ffffff0101,
    0xffff01ffff000000, 0xffff01ffff01ffff, 0xffff01ffff01ff01, 0xffff01ffff0101ff, 0xffff01ffff010101, 0xffff01ff00ff0000,
    0xffff01ff0000ff00, 0xffff01ff00000001, 0xffff01ff00010000, 0xffff01ff01ffffff, 0xffff01ff01ffff01, 0xffff01ff01ff01ff,
    0xffff01ff01ff0101, 0xffff01ff01000000, 0xffff01ff0101ffff, 0xffff01ff0101ff01, 0xffff01ff010101ff, 0xffff01ff01010101,
    0xffff0100ffff0000, 0xffff0100ff00ff00, 0xffff0100ff0000ff, 0xffff0100ff000100, 0xffff0100ff0100ff, 0xffff0100ff010000,
    0xffff010000ffff00, 0xffff01000000ffff, 0xffff01000000ff00, 0xffff010000000000, 0xffff01000001ff00, 0xffff0100000100ff,
    0xffff010000010100, 0xffff01000100ff00, 0xffff0100010000ff, 0xffff010001000001, 0xffff010001000100, 0xffff010001010000,
    0xffff0101ffffffff, 0xffff0101ffffff01, 0xffff0101ffff01ff, 0xffff0101ffff0101, 0xffff0101ff000000, 0xffff0101ff01ffff,
    0xffff0101ff01ff01, 0xffff0101ff0101ff, 0xffff0101ff010101, 0xffff010100ff0000, 0xffff01010000ff00, 0xffff010100000100,
    0xffff01010001ff00, 0xffff010100010000, 0xffff010101ffffff, 0xffff010101ffff01, 0xffff010101ff0000, 0xffff010101ff01ff,
    0xffff010101ff0101, 0xffff010101000000, 0xffff01010101ffff, 0xffff01010101ff01, 0xffff0101010101ff, 0xffff010101010101,
    0xff00ffffff00ffff, 0xff00ffffff00ff00, 0xff00ffffff0000ff, 0xff00ffffff000100, 0xff00ffffff0100ff, 0xff00ffffff010000,
    0xff00ffff00ffff00, 0xff00ffff00ff00ff, 0xff00ffff0000ffff, 0xff00ffff00000000, 0xff00ffff000001ff, 0xff00ffff0001ff00,
    0xff00ffff000100ff, 0xff00ffff00010000, 0xff00ffff00010100, 0xff00ffff0100ff00, 0xff00ffff010000ff, 0xff00ffff01000001,
    0xff00ffff0101ff00, 0xff00ffff01010000, 0xff00ff00ffffff00, 0xff00ff00ffff00ff, 0xff00ff00ffff0001, 0xff00ff00ffff0100,
    0xff00ff00ff00ffff, 0xff00ff00ff00ff01, 0xff00ff00ff000000, 0xff00ff00ff0001ff, 0xff00ff00ff01ff00, 0xff00ff00ff0100ff,
    0xff00ff00ff010100, 0xff00ff0000ff0000, 0xff00ff0000ff0101, 0xff00ff000000ffff, 0xff00ff000000ff00, 0xff00ff000000ff01,
    0xff00ff00000000ff, 0xff00ff0000000000, 0xff00ff0000000001, 0xff00ff0000000100, 0xff00ff000001ffff, 0xff00ff0000010000,
    0xff00ff0001ff00ff, 0xff00ff000100ff01, 0xff00ff0001000000, 0xff00ff000101ff00, 0xff00ff00010100ff, 0xff00ff01ff00ff00,
    0xff00ff01ff0000ff, 0xff00ff01ff000001, 0xff00ff01ff010000, 0xff00ff0100ffffff, 0xff00ff0100ff0001, 0xff00ff0100ff0100,
    0xff00ff010000ff01, 0xff00ff0100000000, 0xff00ff01000001ff, 0xff00ff0100000101, 0xff00ff01000100ff, 0xff00ff0100010001,
    0xff00ff0101ff0000, 0xff00ff010100ff00, 0xff00ff01010000ff, 0xff00ff0101000001, 0xff00ff0101010000, 0xff0000ffffffff00,
    0xff0000ffffff0001, 0xff0000ffffff0100, 0xff0000ffff0000ff, 0xff0000ffff000000, 0xff0000ffff0001ff, 0xff0000ffff000100,
    0xff0000ffff01ff00, 0xff0000ffff010001, 0xff0000ff00ffff00, 0xff0000ff00ff0000, 0xff0000ff00ff0001, 0xff0000ff00ff01ff,
    0xff0000ff00ff0101, 0xff0000ff0000ff00, 0xff0000ff000000ff, 0xff0000ff00000000, 0xff0000ff00000001, 0xff0000ff00000100,
    0xff0000ff0001ff01, 0xff0000ff00010000, 0xff0000ff000101ff, 0xff0000ff01ff00ff, 0xff0000ff01ff0100, 0xff0000ff0100ffff,
    0xff0000ff010000ff, 0xff0000ff01000000, 0xff0000ff010001ff, 0xff0000ff01000100, 0xff0000ff01000101, 0xff0000ff0101ff00,
    0xff0000ff010100ff, 0xff0000ff01010000, 0xff0000ff01010100, 0xff000000ffffff01, 0xff000000ffff0000, 0xff000000ffff0101,
    0xff000000ff00ff00, 0xff000000ff0000ff, 0xff000000ff000000, 0xff000000ff000001, 0xff000000ff000100, 0xff000000ff01ffff,
    0xff000000ff01ff01, 0xff000000ff010000, 0xff000000ff0101ff, 0xff000000ff010101, 0xff00000000ffff00, 0xff00000000ff00ff,
    0xff00000000ff0000, 0xff00000000ff0001, 0xff0000000000ff00, 0xff0000000000ff01, 0xff000000000000ff, 0xff00000000000000,
    0xff00000000000001, 0xff00000000000100, 0xff00000000000101, 0xff0000000001ff00, 0xff000000000100ff, 0xff00000000010000,
    0xff00000000010001, 0xff00000000010100, 0xff00000001ffffff, 0xff00000001ffff01, 0xff00000001ff00ff, 0xff00000001ff0000,
    0xff00000001ff01ff, 0xff00000001ff0101, 0xff0000000100ffff, 0xff0000000100ff00, 0xff000000010000ff, 0xff00000001000000,
    0xff00000001000001, 0xff00000001000100, 0xff00000001000101, 0xff0000000101ffff, 0xff0000000101ff01, 0xff00000001010000,
    0xff000001ffffff00, 0xff000001ffff00ff, 0xff000001ffff0000, 0xff000001ffff0001, 0xff000001ff000000, 0xff000001ff000001,
    0xff000001ff0001ff, 0xff000001ff000101, 0xff000001ff01ff00, 0xff000001ff010001, 0xff00000100ffffff, 0xff00000100ffff01,
    0xff00000100ff00ff, 0xff00000100ff0000, 0xff00000100ff01ff, 0xff00000100ff0101, 0xff0000010000ff00, 0xff00000100000000,
    0xff00000100000001, 0xff000001000001ff, 0xff00000100000100, 0xff0000010001ff00, 0xff000001000100ff, 0xff00000100010000,
    0xff000001000101ff, 0xff00000100010100, 0xff00000100010101, 0xff00000101ff0001, 0xff00000101ff0101, 0xff0000010100ff01,
    0xff00000101000000, 0xff000001010100ff, 0xff00000101010100, 0xff0001ffff00ff00, 0xff0001ffff000001, 0xff0001ffff010000,
    0xff0001ff00ffff00, 0xff0001ff00ff00ff, 0xff0001ff00ff0001, 0xff0001ff00ff0100, 0xff0001ff0000ffff, 0xff0001ff00000000,
    0xff0001ff000001ff, 0xff0001ff00000101, 0xff0001ff0001ffff, 0xff0001ff0001ff00, 0xff0001ff000100ff, 0xff0001ff00010001,
    0xff0001ff00010100, 0xff0001ff01ff0000, 0xff0001ff0100ff00, 0xff0001ff010000ff, 0xff0001ff01010000, 0xff000100ff00ffff,
    0xff000100ff00ff01, 0xff000100ff000000, 0xff000100ff000101, 0xff000100ff01ff00, 0xff000100ff010000, 0xff00010000ffff01,
    0xff00010000ff00ff, 0xff00010000ff0000, 0xff00010000ff01ff, 0xff0001000000ff00, 0xff000100000000ff, 0xff00010000000000,
    0xff00010000000001, 0xff00010000000100, 0xff00010000000101, 0xff0001000001ffff, 0xff00010000010000, 0xff00010000010101,
    0xff00010001ff0100, 0xff0001000100ff00, 0xff0001000100ff01, 0xff00010001000000, 0xff000100010001ff, 0xff0001000101ff00,
    0xff00010001010001, 0xff00010001010100, 0xff000101ffff0100, 0xff000101ff000001, 0xff000101ff0100ff, 0xff000101ff010001,
    0xff00010100ff00ff, 0xff00010100ff0001, 0xff00010100ff0100, 0xff0001010000ffff, 0xff0001010000ff01, 0xff00010100000000,
    0xff000101000001ff, 0xff0001010001ff00, 0xff00010100010001, 0xff00010100010100, 0xff00010101ff0000, 0xff0001010100ff00,
    0xff00010101000001, 0xff00010101000101, 0xff01ffffffffffff, 0xff01ffffffffff01, 0xff01ffffffff01ff, 0xff01ffffffff0101,
    0xff01ffffff000000, 0xff01ffffff01ffff, 0xff01ffffff01ff01, 0xff01ffffff010000, 0xff01ffffff0101ff, 0xff01ffffff010101,
    0xff01ffff00ff0000, 0xff01ffff0000ff00, 0xff01ffff00000100, 0xff01ffff0001ff00, 0xff01ffff00010000, 0xff01ffff01ffffff,
    0xff01ffff01ffff01, 0xff01ffff01ff01ff, 0xff01ffff01ff0101, 0xff01ffff01000000, 0xff01ffff0101ffff, 0xff01ffff0101ff01,
    0xff01ffff01010000, 0xff01ffff010101ff, 0xff01ffff01010101, 0xff01ff00ffff0000, 0xff01ff00ff00ff00, 0xff01ff00ff0000ff,
    0xff01ff00ff000100, 0xff01ff00ff010000, 0xff01ff0000ffff01, 0xff01ff0000ff00ff, 0xff01ff0000ff0100, 0xff01ff0000000000,
    0xff01ff00000001ff, 0xff01ff0000000101, 0xff01ff000001ff00, 0xff01ff00000100ff, 0xff01ff0000010000, 0xff01ff0000010001,
    0xff01ff0001ff0000, 0xff01ff000100ffff, 0xff01ff0001000001, 0xff01ff0001000100, 0xff01ff0001010000, 0xff01ff01ffffff00,
    0xff01ff01ffff01ff, 0xff01ff01ffff0101, 0xff01ff01ff00ff00, 0xff01ff01ff000000, 0xff01ff01ff01ffff, 0xff01ff01ff01ff01,
    0xff01ff01ff0101ff, 0xff01ff01ff010101, 0xff01ff0100ff0000, 0xff01ff010000ff00, 0xff01ff0100000001, 0xff01ff0100000100,
    0xff01ff0100010000, 0xff01ff0101ffff00, 0xff01ff0101ff01ff, 0xff01ff0101ff0101, 0xff01ff010100ff00, 0xff01ff0101000000,
    0xff01ff010101ffff, 0xff01ff010101ff01, 0xff01ff01010101ff, 0xff01ff0101010101, 0xff0100ffffff0000, 0xff0100ffff0000ff,
    0xff0100ffff000001, 0xff0100ffff000100, 0xff0100ffff010000, 0xff0100ff00ff00ff, 0xff0100ff00ff0000, 0xff0100ff00ff0001,
    0xff0100ff00ff0100, 0xff0100ff0000ff01, 0xff0100ff00000000, 0xff0100ff000001ff, 0xff0100ff00000101, 0xff0100ff00010001,
    0xff0100ff01ff0000, 0xff0100ff0100ff00, 0xff0100ff010000ff, 0xff0100ff01000100, 0xff0100ff0101ff00, 0xff0100ff01010000,
    0xff010000ffff0100, 0xff010000ff000000, 0xff010000ff01ff00, 0xff010000ff010100, 0xff01000000ffffff, 0xff01000000ff0000,
    0xff01000000ff01ff, 0xff0100000000ff00, 0xff010000000000ff, 0xff01000000000000, 0xff01000000000100, 0xff0100000001ff01,
    0xff01000000010000, 0xff010000000101ff, 0xff01000001ff0100, 0xff0100000100ffff, 0xff010000010000ff, 0xff01000001000000,
    0xff010000010001ff, 0xff01000001000101, 0xff0100000101ff00, 0xff010000010100ff, 0xff01000001010001, 0xff01000001010100,
    0xff010001ffff0000, 0xff010001ff00ffff, 0xff010001ff00ff01, 0xff010001ff000100, 0xff010001ff010000, 0xff01000100ffff00,
    0xff01000100ff0100, 0xff01000100000000, 0xff0100010001ffff, 0xff0100010001ff00, 0xff01000100010100, 0xff01000101ff00ff,
    0xff01000101ff0001, 0xff0100010100ffff, 0xff01000101000101, 0xff0101ffffffffff, 0xff0101ffffffff01, 0xff0101ffffff01ff,
    0xff0101ffffff0101, 0xff0101ffff000000, 0xff0101ffff01ffff, 0xff0101ffff01ff01, 0xff0101ffff0101ff, 0xff0101ffff010101,
    0xff0101ff00ff0000, 0xff0101ff0000ff00, 0xff0101ff000000ff, 0xff0101ff00010000, 0xff0101ff01ffffff, 0xff0101ff01ffff01,
    0xff0101ff01ff01ff, 0xff0101ff01ff0101, 0xff0101ff0101ffff, 0xff0101ff0101ff01, 0xff0101ff010101ff, 0xff0101ff01010101,
    0xff010100ffff0100, 0xff010100ff00ff00, 0xff010100ff0000ff, 0xff010100ff000100, 0xff010100ff010000, 0xff01010000ff0001,
    0xff01010000ff0100, 0xff0101000000ff01, 0xff01010000000000, 0xff0101000001ff00, 0xff010100000100ff, 0xff01010000010001,
    0xff01010000010100, 0xff01010001ff0000, 0xff0101000100ffff, 0xff01010001000001, 0xff01010001000100, 0xff010100010100ff,
    0xff01010001010000, 0xff010101ffffffff, 0xff010101ffffff01, 0xff010101ffff01ff, 0xff010101ffff0101, 0xff010101ff01ffff,
    0xff010101ff01ff01, 0xff010101ff0101ff, 0xff010101ff010101, 0xff01010100ff0000, 0xff0101010000ff00, 0xff01010100000001,
    0xff01010100000100, 0xff01010100010000, 0xff01010101ffffff, 0xff01010101ffff01, 0xff01010101ff01ff, 0xff01010101ff0101,
    0xff01010101000000, 0xff0101010101ffff, 0xff0101010101ff01, 0xff010101010101ff, 0xff01010101010101, 0x00ffffffffff0000,
    0x00ffffffff00ff00, 0x00ffffffff000001, 0x00ffffffff010000, 0x00ffffff00ff0100, 0x00ffffff0000ff01, 0x00ffffff00000000,
    0x00ffffff000001ff, 0x00ffffff00000101, 0x00ffffff0001ff00, 0x00ffffff000100ff, 0x00ffffff00010001, 0x00ffffff010000ff,
    0x00ffffff01000100, 0x00ffffff0101ff00, 0x00ffffff01010001, 0x00ffff00ffffffff, 0x00ffff00ffffff00, 0x00ffff00ffff00ff,
    0x00ffff00ffff0001, 0x00ffff00ffff0100, 0x00ffff00ff00ff01, 0x00ffff00ff000000, 0x00ffff00ff000001, 0x00ffff00ff0001ff,
    0x00ffff00ff000101, 0x00ffff00ff01ff00, 0x00ffff00ff010001, 0x00ffff00ff010100, 0x00ffff0000ff0000, 0x00ffff0000ff01ff,
    0x00ffff0000ff0101, 0x00ffff000000ff00, 0x00ffff00000000ff, 0x00ffff0000000000, 0x00ffff0000000001, 0x00ffff0000000100,
    0x00ffff0000000101, 0x00ffff0000010000, 0x00ffff00000101ff, 0x00ffff0000010101, 0x00ffff0001ffff00, 0x00ffff0001ff00ff,
    0x00ffff0001ff0001, 0x00ffff000100ffff, 0x00ffff000100ff01, 0x00ffff0001000000, 0x00ffff000101ffff, 0x00ffff000101ff00,
    0x00ffff000101ff01, 0x00ffff01ffff0000, 0x00ffff01ff00ff00, 0x00ffff01ff0000ff, 0x00ffff01ff000001, 0x00ffff01ff010000,
    0x00ffff0100ffff00, 0x00ffff010000ff01, 0x00ffff0100000000, 0x00ffff0100000101, 0x00ffff01000100ff, 0x00ffff0100010100,
    0x00ffff0101ff0100, 0x00ffff01010000ff, 0x00ffff0101010000, 0x00ff00ffffffff00, 0x00ff00ffff000000, 0x00ff00ffff000100,
    0x00ff00ffff010100, 0x00ff00ff00ff0000, 0x00ff00ff00ff01ff, 0x00ff00ff00ff0101, 0x00ff00ff0000ff00, 0x00ff00ff000000ff,
    0x00ff00ff00000000, 0x00ff00ff00000001, 0x00ff00ff0001ff00, 0x00ff00ff0001ff01, 0x00ff00ff00010000, 0x00ff00ff000101ff,
    0x00ff00ff00010101, 0x00ff00ff01ffff00, 0x00ff00ff01ff0001, 0x00ff00ff01ff0100, 0x00ff00ff0100ffff, 0x00ff00ff0100ff01,
    0x00ff00ff01000000, 0x00ff00ff0101ffff, 0x00ff00ff0101ff00, 0x00ff00ff01010100, 0x00ff0000ffffff00, 0x00ff0000ffffff01,
    0x00ff0000ffff0000, 0x00ff0000ffff0101, 0x00ff0000ff00ff00, 0x00ff0000ff0000ff, 0x00ff0000ff000000, 0x00ff0000ff000001,
    0x00ff0000ff000100, 0x00ff0000ff01ffff, 0x00ff0000ff010000, 0x00ff0000ff010101, 0x00ff000000ffff00, 0x00ff000000ff00ff,
    0x00ff000000ff0000, 0x00ff000000ff0001, 0x00ff000000ff0100, 0x00ff00000000ffff, 0x00ff00000000ff00, 0x00ff0000000000ff,
    0x00ff000000000000, 0x00ff000000000001, 0x00ff0000000001ff, 0x00ff000000000100, 0x00ff00000001ff00, 0x00ff0000000100ff,
    0x00ff000000010000, 0x00ff000000010001, 0x00ff000000010100, 0x00ff000001ffff01, 0x00ff000001ff00ff, 0x00ff000001ff0000,
    0x00ff000001ff01ff, 0x00ff00000100ff00, 0x00ff0000010000ff, 0x00ff000001000000, 0x00ff000001000001, 0x00ff000001000100,
    0x00ff000001000101, 0x00ff000001010000, 0x00ff0000010101ff, 0x00ff000001010101, 0x00ff0001ffffff00, 0x00ff0001ffff0000,
    0x00ff0001ffff0100, 0x00ff0001ff0000ff, 0x00ff0001ff000000, 0x00ff0001ff0001ff, 0x00ff0001ff000101, 0x00ff0001ff01ff00,
    0x00ff0001ff0100ff, 0x00ff0001ff010100, 0x00ff000100ffffff, 0x00ff000100ffff01, 0x00ff000100ff0000, 0x00ff000100ff01ff,
    0x00ff00010000ffff, 0x00ff00010000ff00, 0x00ff00010000ff01, 0x00ff000100000000, 0x00ff000100000001, 0x00ff000100000100,
    0x00ff00010001ff01, 0x00ff000100010000, 0x00ff0001000101ff, 0x00ff000101ffff00, 0x00ff000101ff0000, 0x00ff000101ff0101,
    0x00ff0001010000ff, 0x00ff000101000000, 0x00ff00010101ff00, 0x00ff0001010100ff, 0x00ff000101010001, 0x00ff01ffffff0000,
    0x00ff01ffff00ff00, 0x00ff01ffff000000, 0x00ff01ffff000101, 0x00ff01ffff010000, 0x00ff01ff00ffff01, 0x00ff01ff00ff0100,
    0x00ff01ff0000ffff, 0x00ff01ff00000000, 0x00ff01ff000001ff, 0x00ff01ff0001ff00, 0x00ff01ff000100ff, 0x00ff01ff00010001,
    0x00ff01ff00010100, 0x00ff01ff01ff0000, 0x00ff01ff0100ff00, 0x00ff01ff010000ff, 0x00ff01ff01000001, 0x00ff01ff01000100,
    0x00ff01ff01010000, 0x00ff0100ffffff00, 0x00ff0100ffff0000, 0x00ff0100ffff0001, 0x00ff0100ffff0101, 0x00ff0100ff00ffff,
    0x00ff0100ff0000ff, 0x00ff0100ff000000, 0x00ff0100ff0001ff, 0x00ff0100ff01ff00, 0x00ff0100ff0100ff, 0x00ff0100ff010001,
    0x00ff010000ffffff, 0x00ff010000ff0000, 0x00ff010000ff0101, 0x00ff01000000ff00, 0x00ff01000000ff01, 0x00ff0100000000ff,
    0x00ff010000000000, 0x00ff010000000001, 0x00ff010000000100, 0x00ff01000001ffff, 0x00ff01000001ff01, 0x00ff010000010000,
    0x00ff010000010001, 0x00ff010000010101, 0x00ff010001ff0001, 0x00ff010001ff0100, 0x00ff01000100ff01, 0x00ff010001000000,
    0x00ff010001000001, 0x00ff0100010001ff, 0x00ff01000101ff00, 0x00ff0100010100ff, 0x00ff010001010001, 0x00ff010001010100,
    0x00ff0101ff000001, 0x00ff010100ff00ff, 0x00ff010100ff0001, 0x00ff010100ff0100, 0x00ff010100000000, 0x00ff0101000001ff,
    0x00ff010100000101, 0x00ff0101000100ff, 0x00ff010100010100, 0x00ff0101010000ff, 0x00ff010101010000, 0x0000ffffffffff00,
    0x0000ffffffff00ff, 0x0000ffffffff0000, 0x0000ffffffff0001, 0x0000ffffffff0100, 0x0000ffffff00ff01, 0x0000ffffff000000,
    0x0000ffffff000101, 0x0000ffffff01ff00, 0x0000ffffff0100ff, 0x0000ffffff010100, 0x0000ffff00ffffff, 0x0000ffff00ff0000,
    0x0000ffff00ff01ff, 0x0000ffff0000ff00, 0x0000ffff000000ff, 0x0000ffff00000000, 0x0000ffff00000001, 0x0000ffff00000100,
    0x0000ffff00010000, 0x0000ffff000101ff, 0x0000ffff01ff0001, 0x0000ffff01ff0100, 0x0000ffff01000000, 0x0000ffff010001ff,
    0x0000ffff0101ffff, 0x0000ffff0101ff00, 0x0000ffff01010001, 0x0000ffff01010100, 0x0000ff00ffff0000, 0x0000ff00ffff01ff,
    0x0000ff00ffff0100, 0x0000ff00ffff0101, 0x0000ff00ff00ff00, 0x0000ff00ff0000ff, 0x0000ff00ff000000, 0x0000ff00ff000001,
    0x0000ff00ff0001ff, 0x0000ff00ff000100, 0x0000ff00ff01ffff, 0x0000ff00ff010000, 0x0000ff00ff010001, 0x0000ff00ff0101ff,
    0x0000ff00ff010101, 0x0000ff0000ffff00, 0x0000ff0000ff00ff, 0x0000ff0000ff0000, 0x0000ff0000ff0001, 0x0000ff0000ff0100,
    0x0000ff000000ffff, 0x0000ff000000ff00, 0x0000ff000000ff01, 0x0000ff00000000ff, 0x0000ff0000000000, 0x0000ff0000000001,
    0x0000ff00000001ff, 0x0000ff0000000100, 0x0000ff0000000101, 0x0000ff000001ff00, 0x0000ff00000100ff, 0x0000ff0000010000,
    0x0000ff0000010001, 0x0000ff0000010100, 0x0000ff0001ffff01, 0x0000ff0001ff0000, 0x0000ff000100ff00, 0x0000ff00010000ff,
    0x0000ff0001000000, 0x0000ff0001000001, 0x0000ff0001000100, 0x0000ff000101ffff, 0x0000ff0001010000, 0x0000ff0001010101,
    0x0000ff01ffffff00, 0x0000ff01ffff0001, 0x0000ff01ff00ff01, 0x0000ff01ff000000, 0x0000ff01ff000101, 0x0000ff01ff01ff00,
    0x0000ff01ff0100ff, 0x0000ff0100ffff01, 0x0000ff0100ff0000, 0x0000ff0100ff0101, 0x0000ff010000ff00, 0x0000ff01000000ff,
    0x0000ff0100000000, 0x0000ff0100000001, 0x0000ff0100000100, 0x0000ff010001ff01, 0x0000ff0100010000, 0x0000ff0101ff0000,
    0x0000ff010100ffff, 0x0000ff010100ff01, 0x0000ff0101000000, 0x0000ff0101000100, 0x0000ff0101000101, 0x0000ff01010100ff,
    0x000000ffffff00ff, 0x000000ffffff0000, 0x000000ffff00ff00, 0x000000ffff0000ff, 0x000000ffff000000, 0x000000ffff000001,
    0x000000ffff0001ff, 0x000000ffff000100, 0x000000ffff01ff00, 0x000000ffff010000, 0x000000ffff0101ff, 0x000000ffff010101,
    0x000000ff00ffff00, 0x000000ff00ff00ff, 0x000000ff00ff0000, 0x000000ff00ff0001, 0x000000ff00ff0100, 0x000000ff00ff0101,
    0x000000ff0000ffff, 0x000000ff0000ff00, 0x000000ff000000ff, 0x000000ff00000000, 0x000000ff00000001, 0x000000ff000001ff,
    0x000000ff00000100, 0x000000ff00000101, 0x000000ff0001ff00, 0x000000ff0001ff01, 0x000000ff000100ff, 0x000000ff00010000,
    0x000000ff00010001, 0x000000ff00010100, 0x000000ff01ffffff, 0x000000ff01ff01ff, 0x000000ff01ff0101, 0x000000ff0100ff00,
    0x000000ff010000ff, 0x000000ff01000000, 0x000000ff01000001, 0x000000ff01000100, 0x000000ff0101ff00, 0x000000ff010100ff,
    0x000000ff01010000, 0x000000ff01010101, 0x00000000ffffff00, 0x00000000ffffff01, 0x00000000ffff00ff, 0x00000000ffff0000,
    0x00000000ffff0001, 0x00000000ffff0100, 0x00000000ff00ffff, 0x00000000ff00ff00, 0x00000000ff00ff01, 0x00000000ff0000ff,
    0x00000000ff000000, 0x00000000ff000001, 0x00000000ff000100, 0x00000000ff000101, 0x00000000ff01ff00, 0x00000000ff0100ff,
    0x00000000ff010000, 0x00000000ff010001, 0x00000000ff010100, 0x0000000000ffffff, 0x0000000000ffff00, 0x0000000000ffff01,
    0x0000000000ff00ff, 0x0000000000ff0000, 0x0000000000ff0001, 0x0000000000ff01ff, 0x0000000000ff0100, 0x000000000000ffff,
    0x000000000000ff00, 0x000000000000ff01, 0x00000000000000ff, 0x0000000000000000, 0x0000000000000001, 0x00000000000001ff,
    0x0000000000000100, 0x0000000000000101, 0x000000000001ffff, 0x000000000001ff00, 0x00000000000100ff, 0x0000000000010000,
    0x0000000000010001, 0x00000000000101ff, 0x0000000000010100, 0x0000000000010101, 0x0000000001ffff00, 0x0000000001ff00ff,
    0x0000000001ff0000, 0x0000000001ff0100, 0x0000000001ff0101, 0x000000000100ffff, 0x000000000100ff00, 0x00000000010000ff,
    0x0000000001000000, 0x0000000001000001, 0x00000000010001ff, 0x0000000001000100, 0x000000000101ff00, 0x00000000010100ff,
    0x0000000001010000, 0x0000000001010001, 0x0000000001010100, 0x00000001ffffffff, 0x00000001ffffff00, 0x00000001ffffff01,
    0x00000001ffff00ff, 0x00000001ffff0001, 0x00000001ffff01ff, 0x00000001ffff0100, 0x00000001ff00ff00, 0x00000001ff0000ff,
    0x00000001ff000000, 0x00000001ff0001ff, 0x00000001ff000100, 0x00000001ff01ffff, 0x00000001ff01ff00, 0x00000001ff01ff01,
    0x00000001ff0100ff, 0x00000001ff010000, 0x00000001ff010001, 0x00000001ff0101ff, 0x00000001ff010100, 0x0000000100ffff00,
    0x0000000100ff0000, 0x0000000100ff0001, 0x0000000100ff01ff, 0x0000000100ff0100, 0x0000000100ff0101, 0x000000010000ffff,
    0x000000010000ff00, 0x000000010000ff01, 0x00000001000000ff, 0x0000000100000000, 0x0000000100000001, 0x00000001000001ff,
    0x0000000100000100, 0x0000000100000101, 0x000000010001ff00, 0x00000001000100ff, 0x0000000100010000, 0x0000000100010100,
    0x0000000101ffff01, 0x0000000101ff0000, 0x0000000101ff0001, 0x0000000101ff01ff, 0x0000000101ff0100, 0x0000000101ff0101,
    0x000000010100ff00, 0x0000000101000000, 0x0000000101000101, 0x000000010101ff01, 0x0000000101010000, 0x0000000101010001,
    0x00000001010101ff, 0x0000000101010100, 0x000001ffffff00ff, 0x000001ffffff0000, 0x000001ffffff0001, 0x000001ffffff0100,
    0x000001ffff00ffff, 0x000001ffff000000, 0x000001ffff0001ff, 0x000001ffff01ff00, 0x000001ffff010101, 0x000001ff00ff0000,
    0x000001ff00ff01ff, 0x000001ff00ff0101, 0x000001ff0000ff00, 0x000001ff000000ff, 0x000001ff00000000, 0x000001ff00000001,
    0x000001ff000001ff, 0x000001ff00000100, 0x000001ff0001ffff, 0x000001ff0001ff01, 0x000001ff000100ff, 0x000001ff00010000,
    0x000001ff01ffff01, 0x000001ff01ff0100, 0x000001ff0100ffff, 0x000001ff0100ff01, 0x000001ff01000000, 0x000001ff010001ff,
    0x000001ff0101ff00, 0x000001ff01010100, 0x00000100ffffff00, 0x00000100ffffff01, 0x00000100ffff0000, 0x00000100ffff0101,
    0x00000100ff00ff00, 0x00000100ff0000ff, 0x00000100ff000000, 0x00000100ff000001, 0x00000100ff000100, 0x00000100ff010000,
    0x0000010000ffff00, 0x0000010000ff00ff, 0x0000010000ff0000, 0x0000010000ff0001, 0x0000010000ff0100, 0x000001000000ffff,
    0x000001000000ff00, 0x000001000000ff01, 0x00000100000000ff, 0x0000010000000000, 0x0000010000000001, 0x00000100000001ff,
    0x0000010000000100, 0x0000010000000101, 0x000001000001ff00, 0x00000100000100ff, 0x0000010000010000, 0x0000010000010001,
    0x0000010000010100, 0x0000010001ffff00, 0x0000010001ff0000, 0x0000010001ff0100, 0x000001000100ff00, 0x00000100010000ff,
    0x0000010001000000, 0x0000010001000001, 0x00000100010001ff, 0x0000010001000100, 0x0000010001010000, 0x00000101ffff00ff,
    0x00000101ffff01ff, 0x00000101ff000000, 0x00000101ff000101, 0x00000101ff01ffff, 0x00000101ff010000, 0x00000101ff010001,
    0x00000101ff010100, 0x0000010100ff0000, 0x0000010100ff01ff, 0x0000010100ff0100, 0x000001010000ff00, 0x0000010100000000,
    0x0000010100000001, 0x00000101000001ff, 0x0000010100000100, 0x000001010001ff01, 0x0000010100010000, 0x00000101000101ff,
    0x0000010100010101, 0x0000010101ffff00, 0x0000010101ff0101, 0x000001010100ff01, 0x0000010101000000, 0x0000010101000001,
    0x00000101010001ff, 0x0000010101000101, 0x000001010101ff00, 0x0001ffffffff0000, 0x0001ffffff0000ff, 0x0001ffffff000001,
    0x0001ffffff000100, 0x0001ffffff010000, 0x0001ffff00ff00ff, 0x0001ffff0000ffff, 0x0001ffff00000000, 0x0001ffff00000001,
    0x0001ffff000001ff, 0x0001ffff00000101, 0x0001ffff0001ff00, 0x0001ffff000100ff, 0x0001ffff00010001, 0x0001ffff00010100,
    0x0001ffff01ffff00, 0x0001ffff01000001, 0x0001ffff01010000, 0x0001ff00ffffff00, 0x0001ff00ffff00ff, 0x0001ff00ffff0001,
    0x0001ff00ffff0100, 0x0001ff00ff00ff01, 0x0001ff00ff000000, 0x0001ff00ff01ff00, 0x0001ff00ff01ff01, 0x0001ff00ff010001,
    0x0001ff00ff010100, 0x0001ff0000ff0000, 0x0001ff0000ff0100, 0x0001ff000000ff00, 0x0001ff0000000000, 0x0001ff0000000001,
    0x0001ff0000000100, 0x0001ff0000010000, 0x0001ff0000010001, 0x0001ff0000010101, 0x0001ff0001ff00ff, 0x0001ff0001ff0101,
    0x0001ff000100ff01, 0x0001ff0001000000, 0x0001ff000101ff00, 0x0001ff0001010001, 0x0001ff0001010100, 0x0001ff01ff00ff00,
    0x0001ff01ff000001, 0x0001ff01ff000100, 0x0001ff0100ffffff, 0x0001ff0100ffff00, 0x0001ff0100ff0001, 0x0001ff0100000000,
    0x0001ff0100000001, 0x0001ff01000001ff, 0x0001ff010001ffff, 0x0001ff0101ff0000, 0x0001ff010100ff00, 0x0001ff0101000001,
    0x0001ff0101010000, 0x000100ffff00ff00, 0x000100ffff00ff01, 0x000100ffff000000, 0x000100ffff000001, 0x000100ffff000101,
    0x000100ffff01ff00, 0x000100ffff010001, 0x000100ffff010100, 0x000100ff00ffffff, 0x000100ff00ffff01, 0x000100ff00ff0000,
    0x000100ff00ff01ff, 0x000100ff00ff0101, 0x000100ff0000ff00, 0x000100ff000000ff, 0x000100ff00000000, 0x000100ff00000001,
    0x000100ff00000100, 0x000100ff00000101, 0x000100ff0001ffff, 0x000100ff0001ff01, 0x000100ff00010000, 0x000100ff01ff00ff,
    0x000100ff01ff0000, 0x000100ff01ff0100, 0x000100ff0100ffff, 0x000100ff0100ff01, 0x000100ff010000ff, 0x000100ff01000000,
    0x000100ff01000001, 0x000100ff010001ff, 0x000100ff01000101, 0x000100ff0101ff00, 0x000100ff010100ff, 0x000100ff01010100,
    0x00010000ffff0000, 0x00010000ffff01ff, 0x00010000ffff0101, 0x00010000ff00ff00, 0x00010000ff000000, 0x00010000ff000001,
    0x00010000ff000100, 0x0001000000ff00ff, 0x0001000000ff0000, 0x0001000000ff0001, 0x0001000000ff0100, 0x000100000000ffff,
    0x000100000000ff00, 0x00010000000000ff, 0x0001000000000000, 0x0001000000000001, 0x0001000000000100, 0x000100000001ff00,
    0x00010000000100ff, 0x0001000000010000, 0x0001000000010001, 0x0001000000010100, 0x0001000001ff0001, 0x0001000001ff0100,
    0x0001000001ff0101, 0x000100000100ff00, 0x0001000001000000, 0x0001000001000001, 0x0001000001000100, 0x0001000001000101,
    0x000100000101ff01, 0x0001000001010000, 0x0001000001010001, 0x00010000010101ff, 0x00010001ffffff01, 0x00010001ffff0100,
    0x00010001ff000000, 0x00010001ff01ffff, 0x00010001ff010001, 0x00010001ff0101ff, 0x00010001ff010100, 0x0001000100ffffff,
    0x0001000100ff0000, 0x0001000100ff01ff, 0x0001000100ff0101, 0x000100010000ff00, 0x00010001000000ff, 0x0001000100000000,
    0x0001000100000001, 0x00010001000001ff, 0x0001000100000101, 0x000100010001ffff, 0x0001000100010000, 0x00010001000101ff,
    0x0001000101ffffff, 0x0001000101ffff01, 0x0001000101ff0000, 0x0001000101ff0101, 0x00010001010000ff, 0x0001000101000001,
    0x00010001010001ff, 0x0001000101000100, 0x000100010101ffff, 0x00010001010100ff, 0x0001000101010001, 0x0001000101010101,
    0x000101ffff000001, 0x000101ffff000100, 0x000101ffff010000, 0x000101ff00ffff00, 0x000101ff0000ff01, 0x000101ff00000000,
    0x000101ff00000101, 0x000101ff0001ff00, 0x000101ff00010100, 0x000101ff01ff0000, 0x000101ff0100ff00, 0x000101ff010001ff,
    0x000101ff01010001, 0x00010100ffffff00, 0x00010100ffff00ff, 0x00010100ff00ffff, 0x00010100ff000000, 0x00010100ff01ff00,
    0x00010100ff0100ff, 0x00010100ff010001, 0x00010100ff010100, 0x0001010000ffffff, 0x0001010000ffff00, 0x0001010000ff0000,
    0x0001010000ff0001, 0x0001010000ff01ff, 0x000101000000ff00, 0x00010100000000ff, 0x0001010000000000, 0x0001010000000001,
    0x0001010000000100, 0x000101000001ffff, 0x0001010000010000, 0x0001010000010101, 0x0001010001ffff01, 0x0001010001ff00ff,
    0x0001010001ff0101, 0x0001010001000000, 0x000101000101ff00, 0x00010100010100ff, 0x0001010001010000, 0x0001010001010100,
    0x00010101ff00ff00, 0x00010101ff000001, 0x00010101ff0001ff, 0x0001010100ffff00, 0x0001010100ff00ff, 0x0001010100ff0100,
    0x000101010000ffff, 0x0001010100000000, 0x00010101000001ff, 0x0001010100000101, 0x00010101000100ff, 0x0001010100010000,
    0x0001010100010100, 0x0001010101ff0001, 0x00010101010000ff, 0x00010101010001ff, 0x0001010101000101, 0x0001010101010001,
    0x01ffffffffffffff, 0x01ffffffffffff01, 0x01ffffffffff01ff, 0x01ffffffffff0101, 0x01ffffffff01ffff, 0x01ffffffff01ff01,
    0x01ffffffff0101ff, 0x01ffffffff010101, 0x01ffffff00ff0000, 0x01ffffff0000ffff, 0x01ffffff0000ff00, 0x01ffffff000000ff,
    0x01ffffff00000001, 0x01ffffff00000100, 0x01ffffff00010000, 0x01ffffff01ffffff, 0x01ffffff01ffff01, 0x01ffffff01ff01ff,
    0x01ffffff01ff0101, 0x01ffffff01000000, 0x01ffffff0101ffff, 0x01ffffff0101ff01, 0x01ffffff010101ff, 0x01ffffff01010101,
    0x01ffff00ffff0000, 0x01ffff00ff00ff00, 0x01ffff00ff0000ff, 0x01ffff00ff000001, 0x01ffff00ff000100, 0x01ffff00ff010000,
    0x01ffff0000ffff00, 0x01ffff0000ff00ff, 0x01ffff0000ff0100, 0x01ffff000000ffff, 0x01ffff000000ff01, 0x01ffff0000000000,
    0x01ffff0000000001, 0x01ffff00000001ff, 0x01ffff0000000100, 0x01ffff00000100ff, 0x01ffff0000010001, 0x01ffff0000010100,
    0x01ffff0001ff0000, 0x01ffff0001ff0100, 0x01ffff00010000ff, 0x01ffff0001000001, 0x01ffff0001000100, 0x01ffff0001010000,
    0x01ffff01ffffffff, 0x01ffff01ffffff01, 0x01ffff01ffff01ff, 0x01ffff01ffff0101, 0x01ffff01ff000000, 0x01ffff01ff01ffff,
    0x01ffff01ff01ff01, 0x01ffff01ff0101ff, 0x01ffff01ff010101, 0x01ffff010000ff00, 0x01ffff01000000ff, 0x01ffff0100000100,
    0x01ffff0100010000, 0x01ffff0101ffffff, 0x01ffff0101ffff01, 0x01ffff0101ff01ff, 0x01ffff0101ff0101, 0x01ffff0101000000,
    0x01ffff010101ffff, 0x01ffff010101ff01, 0x01ffff01010101ff, 0x01ffff0101010101, 0x01ff00ffff0000ff, 0x01ff00ffff000100,
    0x01ff00ff00ffff00, 0x01ff00ff00ff00ff, 0x01ff00ff0000ff00, 0x01ff00ff00000000, 0x01ff00ff00000101, 0x01ff00ff0001ff00,
    0x01ff00ff000100ff, 0x01ff00ff00010100, 0x01ff00ff010000ff, 0x01ff00ff01000100, 0x01ff0000ffffff00, 0x01ff0000ffff0100,
    0x01ff0000ff00ff01, 0x01ff0000ff000000, 0x01ff0000ff000101, 0x01ff0000ff010001, 0x01ff0000ff010100, 0x01ff000000ffffff,
    0x01ff000000ffff00, 0x01ff000000ff0000, 0x01ff000000ff01ff, 0x01ff00000000ff00, 0x01ff0000000000ff, 0x01ff000000000000,
    0x01ff000000000001, 0x01ff000000000100, 0x01ff000000000101, 0x01ff000000010000, 0x01ff000000010001, 0x01ff0000000101ff,
    0x01ff000000010101, 0x01ff000001ffff00, 0x01ff000001ff00ff, 0x01ff000001ff0001, 0x01ff000001ff0100, 0x01ff00000100ffff,
    0x01ff00000100ff01, 0x01ff000001000000, 0x01ff0000010001ff, 0x01ff000001010001, 0x01ff0001ff00ff00, 0x01ff0001ff000001,
    0x01ff0001ff000100, 0x01ff0001ff010000, 0x01ff000100ffff00, 0x01ff000100ff00ff, 0x01ff000100ff0100, 0x01ff000100ff0101,
    0x01ff00010000ffff, 0x01ff000100000000, 0x01ff000100000100, 0x01ff000100000101, 0x01ff00010001ff00, 0x01ff000100010001,
    0x01ff000100010101, 0x01ff000101ff0000, 0x01ff00010100ff00, 0x01ff000101000101, 0x01ff0001010100ff, 0x01ff01ffffffffff,
    0x01ff01ffffffff01, 0x01ff01ffffff01ff, 0x01ff01ffffff0101, 0x01ff01ffff000000, 0x01ff01ffff01ffff, 0x01ff01ffff01ff01,
    0x01ff01ffff0101ff, 0x01ff01ffff010101, 0x01ff01ff00ffff00, 0x01ff01ff00ff0000, 0x01ff01ff0000ff00, 0x01ff01ff000000ff,
    0x01ff01ff00000100, 0x01ff01ff00010000, 0x01ff01ff00010100, 0x01ff01ff01ffffff, 0x01ff01ff01ffff01, 0x01ff01ff01ff01ff,
    0x01ff01ff01ff0101, 0x01ff01ff01000000, 0x01ff01ff0101ffff, 0x01ff01ff0101ff01, 0x01ff01ff010101ff, 0x01ff01ff01010101,
    0x01ff0100ffff0000, 0x01ff0100ffff0001, 0x01ff0100ff00ff00, 0x01ff0100ff0000ff, 0x01ff0100ff000001, 0x01ff0100ff010000,
    0x01ff010000ffff00, 0x01ff010000ff00ff, 0x01ff010000ff0001, 0x01ff010000ff0100, 0x01ff01000000ffff, 0x01ff01000000ff01,
    0x01ff010000000000, 0x01ff010000000101, 0x01ff01000001ff00, 0x01ff0100000100ff, 0x01ff010001ff0000, 0x01ff010001000001,
    0x01ff010001000100, 0x01ff010001010000, 0x01ff0101ffffffff, 0x01ff0101ffffff01, 0x01ff0101ffff01ff, 0x01ff0101ffff0101,
    0x01ff0101ff000000, 0x01ff0101ff01ffff, 0x01ff0101ff01ff01, 0x01ff0101ff0101ff, 0x01ff0101ff010101, 0x01ff010100ff0000,
    0x01ff01010000ff00, 0x01ff0101000000ff, 0x01ff010100000001, 0x01ff010101ffffff, 0x01ff010101ffff01, 0x01ff010101ff01ff,
    0x01ff010101ff0101, 0x01ff010101000000, 0x01ff01010101ffff, 0x01ff01010101ff01, 0x01ff0101010101ff, 0x01ff010101010101,
    0x0100ffffffff0000, 0x0100ffffff00ff00, 0x0100ffffff000001, 0x0100ffffff0001ff, 0x0100ffffff000100, 0x0100ffffff010000,
    0x0100ffff00ffff00, 0x0100ffff00ff0001, 0x0100ffff00ff0100, 0x0100ffff00000000, 0x0100ffff000001ff, 0x0100ffff00000101,
    0x0100ffff00010100, 0x0100ffff00010101, 0x0100ffff01ff0000, 0x0100ffff0100ff00, 0x0100ffff010000ff, 0x0100ffff01000001,
    0x0100ffff01000100, 0x0100ffff01010000, 0x0100ff00ffffff00, 0x0100ff00ffff00ff, 0x0100ff00ffff0001, 0x0100ff00ffff0100,
    0x0100ff00ff00ffff, 0x0100ff00ff000000, 0x0100ff00ff0001ff, 0x0100ff00ff000101, 0x0100ff00ff01ff00, 0x0100ff00ff0100ff,
    0x0100ff00ff010001, 0x0100ff00ff010100, 0x0100ff0000ffffff, 0x0100ff0000ff0000, 0x0100ff000000ffff, 0x0100ff000000ff00,
    0x0100ff00000000ff, 0x0100ff0000000000, 0x0100ff0000000001, 0x0100ff0000000100, 0x0100ff000001ff01, 0x0100ff0000010000,
    0x0100ff0001ff00ff, 0x0100ff0001ff0001, 0x0100ff000100ff01, 0x0100ff0001000000, 0x0100ff00010001ff, 0x0100ff000101ff00,
    0x0100ff00010100ff, 0x0100ff0001010001, 0x0100ff0001010100, 0x0100ff01ffff0000, 0x0100ff01ff00ff00, 0x0100ff01ff0000ff,
    0x0100ff01ff000100, 0x0100ff01ff010000, 0x0100ff0100ff00ff, 0x0100ff0100ff0001, 0x0100ff0100ff0100, 0x0100ff010000ffff,
    0x0100ff010000ff01, 0x0100ff0100000000, 0x0100ff01000001ff, 0x0100ff0100010001, 0x0100ff0100010100, 0x0100ff0101ff0000,
    0x0100ff01010000ff, 0x0100ff0101000001, 0x0100ff0101010100, 0x010000ffffffff00, 0x010000ffffff00ff, 0x010000ffffff0001,
    0x010000ffff00ffff, 0x010000ffff000000, 0x010000ffff0001ff, 0x010000ffff010001, 0x010000ff00ffffff, 0x010000ff00ff0101,
    0x010000ff0000ff00, 0x010000ff000000ff, 0x010000ff00000000, 0x010000ff00000001, 0x010000ff000001ff, 0x010000ff00000100,
    0x010000ff0001ffff, 0x010000ff0001ff00, 0x010000ff0001ff01, 0x010000ff00010000, 0x010000ff01ff00ff, 0x010000ff01ff0001,
    0x010000ff0100ff01, 0x010000ff010000ff, 0x010000ff01000000, 0x010000ff010001ff, 0x010000ff0101ff00, 0x010000ff01010100,
    0x01000000ffffffff, 0x01000000ffff0000, 0x01000000ffff01ff, 0x01000000ffff0101, 0x01000000ff00ffff, 0x01000000ff00ff00,
    0x01000000ff0000ff, 0x01000000ff000000, 0x01000000ff000001, 0x01000000ff000100, 0x01000000ff01ff00, 0x01000000ff010000,
    0x01000000ff010100, 0x01000000ff010101, 0x0100000000ffff00, 0x0100000000ff00ff, 0x0100000000ff0000, 0x0100000000ff0001,
    0x0100000000ff0100, 0x010000000000ffff, 0x010000000000ff00, 0x010000000000ff01, 0x01000000000000ff, 0x0100000000000000,
    0x0100000000000001, 0x01000000000001ff, 0x0100000000000100, 0x0100000000000101, 0x010000000001ff00, 0x01000000000100ff,
    0x0100000000010000, 0x0100000000010001, 0x0100000000010100, 0x0100000001ffff00, 0x0100000001ff0000, 0x0100000001ff01ff,
    0x010000000100ff00, 0x010000000100ff01, 0x01000000010000ff, 0x0100000001000000, 0x0100000001000001, 0x0100000001000100,
    0x0100000001000101, 0x010000000101ffff, 0x010000000101ff01, 0x0100000001010000, 0x01000000010101ff, 0x0100000001010101,
    0x01000001ffffff00, 0x01000001ffff00ff, 0x01000001ff00ffff, 0x01000001ff000000, 0x01000001ff000100, 0x01000001ff01ffff,
    0x01000001ff010001, 0x01000001ff010100, 0x0100000100ff0000, 0x0100000100ff01ff, 0x0100000100ff0100, 0x010000010000ff00,
    0x010000010000ff01, 0x0100000100000000, 0x0100000100000001, 0x0100000100000100, 0x0100000100010000, 0x01000001000101ff,
    0x0100000101ffff01, 0x0100000101ff00ff, 0x0100000101ff0100, 0x0100000101ff0101, 0x010000010100ff01, 0x01000001010000ff,
    0x0100000101000000, 0x01000001010100ff, 0x0100000101010001, 0x0100000101010100, 0x010001ffffff0000, 0x010001ffff000001,
    0x010001ffff000100, 0x010001ffff010000, 0x010001ff00ffff00, 0x010001ff00ff0001, 0x010001ff0000ffff, 0x010001ff0000ff01,
    0x010001ff00000000, 0x010001ff00000001, 0x010001ff00000101, 0x010001ff000100ff, 0x010001ff00010000, 0x010001ff01ff0000,
    0x010001ff0100ff00, 0x010001ff01000001, 0x010001ff01000100, 0x010001ff01010000, 0x01000100ffff00ff, 0x01000100ffff0001,
    0x01000100ffff0100, 0x01000100ff00ffff, 0x01000100ff00ff01, 0x01000100ff000000, 0x01000100ff0001ff, 0x01000100ff000101,
    0x01000100ff01ffff, 0x01000100ff01ff00, 0x01000100ff0100ff, 0x01000100ff010001, 0x0100010000ffffff, 0x0100010000ffff01,
    0x0100010000ff0000, 0x0100010000ff01ff, 0x0100010000ff0101, 0x010001000000ff00, 0x01000100000000ff, 0x0100010000000000,
    0x0100010000000001, 0x0100010000000100, 0x010001000001ff01, 0x0100010000010000, 0x0100010000010001, 0x0100010000010101,
    0x0100010001ffff00, 0x0100010001ff00ff, 0x010001000100ffff, 0x010001000100ff01, 0x0100010001000000, 0x0100010001000101,
    0x010001000101ff00, 0x0100010001010001, 0x01000101ffff0000, 0x01000101ff000000, 0x01000101ff010000, 0x0100010100ff00ff,
    0x0100010100ff0001, 0x0100010100ff0100, 0x010001010000ffff, 0x0100010100000000, 0x01000101000001ff, 0x010001010001ff00,
    0x0100010101ff0000, 0x010001010100ff00, 0x01000101010000ff, 0x0100010101000000, 0x0100010101000001, 0x0101ffffffffffff,
    0x0101ffffffffff01, 0x0101ffffffff01ff, 0x0101ffffffff0101, 0x0101ffffff000000, 0x0101ffffff01ffff, 0x0101ffffff01ff01,
    0x0101ffffff0101ff, 0x0101ffffff010101, 0x0101ffff00ff0000, 0x0101ffff0000ff00, 0x0101ffff000000ff, 0x0101ffff00000001,
    0x0101ffff00000100, 0x0101ffff01ffffff, 0x0101ffff01ffff01, 0x0101ffff01ff01ff, 0x0101ffff01ff0101, 0x0101ffff01000000,
    0x0101ffff0101ffff, 0x0101ffff0101ff01, 0x0101ffff010101ff, 0x0101ffff01010101, 0x0101ff00ffff0000, 0x0101ff00ffff0100,
    0x0101ff00ff00ff00, 0x0101ff00ff0000ff, 0x0101ff00ff000001, 0x0101ff00ff000100, 0x0101ff00ff000101, 0x0101ff0000ff0001,
    0x0101ff0000ff0100, 0x0101ff000000ff00, 0x0101ff0000000000, 0x0101ff00000001ff, 0x0101ff0000000101, 0x0101ff000001ff00,
    0x0101ff00000100ff, 0x0101ff0001ff0000, 0x0101ff000100ffff, 0x0101ff000100ff01, 0x0101ff0001000001, 0x0101ff0001000100,
    0x0101ff01ffffff01, 0x0101ff01ffff01ff, 0x0101ff01ffff0101, 0x0101ff01ff00ffff, 0x0101ff01ff000100, 0x0101ff01ff01ff01,
    0x0101ff01ff0101ff, 0x0101ff01ff010101, 0x0101ff0100ff0000, 0x0101ff010000ff00, 0x0101ff0100000001, 0x0101ff0100000100,
    0x0101ff0100010000, 0x0101ff0101ffffff, 0x0101ff0101ffff01, 0x0101ff0101ff01ff, 0x0101ff0101ff0101, 0x0101ff0101000000,
    0x0101ff010101ffff, 0x0101ff010101ff01, 0x0101ff01010101ff, 0x0101ff0101010101, 0x010100ffff000100, 0x010100ffff010000,
    0x010100ff00ffff00, 0x010100ff00ff00ff, 0x010100ff0000ffff, 0x010100ff000000ff, 0x010100ff00000000, 0x010100ff000001ff,
    0x010100ff00000101, 0x010100ff0001ff00, 0x010100ff00010000, 0x010100ff00010001, 0x010100ff000101ff, 0x010100ff00010100,
    0x010100ff01ff0000, 0x01010000ffff0001, 0x01010000ffff0100, 0x01010000ff00ffff, 0x01010000ff00ff01, 0x01010000ff000000,
    0x01010000ff0001ff, 0x01010000ff010001, 0x01010000ff010100, 0x0101000000ffff01, 0x0101000000ff0000, 0x010100000000ff00,
    0x01010000000000ff, 0x0101000000000000, 0x0101000000000001, 0x0101000000000100, 0x0101000000010000, 0x0101000000010101,
    0x0101000001ffff00, 0x0101000001ff00ff, 0x0101000001ff0000, 0x0101000001ff0001, 0x0101000001ff0100, 0x010100000100ff01,
    0x0101000001000000, 0x01010000010001ff, 0x01010001ffff0000, 0x01010001ff00ff00, 0x01010001ff000001, 0x01010001ff000101,
    0x01010001ff01ff00, 0x01010001ff010000, 0x0101000100ff00ff, 0x0101000100ff0001, 0x0101000100ff0101, 0x010100010000ff01,
    0x0101000100000000, 0x0101000100000001, 0x01010001000001ff, 0x010100010001ffff, 0x010100010001ff01, 0x0101000101ff0001,
    0x010100010100ffff, 0x0101000101000000, 0x0101000101000001, 0x0101000101000100, 0x010100010101ff00, 0x01010001010100ff,
    0x0101000101010001, 0x010101ffffffffff, 0x010101ffffffff01, 0x010101ffffff01ff, 0x010101ffffff0101, 0x010101ffff01ffff,
    0x010101ffff01ff01, 0x010101ffff0101ff, 0x010101ffff010101, 0x010101ff0000ff00, 0x010101ff000000ff, 0x010101ff00000001,
    0x010101ff00000100, 0x010101ff01ffffff, 0x010101ff01ffff01, 0x010101ff01ff01ff, 0x010101ff01ff0101, 0x010101ff01000000,
    0x010101ff0101ffff, 0x010101ff0101ff01, 0x010101ff010101ff, 0x010101ff01010101, 0x01010100ffff0000, 0x01010100ff0000ff,
    0x01010100ff000100, 0x01010100ff01ff00, 0x01010100ff010000, 0x0101010000ffff00, 0x010101000000ffff, 0x0101010000000000,
    0x0101010000000101, 0x010101000001ff00, 0x0101010000010001, 0x0101010000010100, 0x010101000100ffff, 0x0101010001000001,
    0x01010101ffffffff, 0x01010101ffffff01, 0x01010101ffff01ff, 0x01010101ffff0101, 0x01010101ff01ffff, 0x01010101ff01ff01,
    0x01010101ff0101ff, 0x01010101ff010101, 0x010101010000ff00, 0x01010101000000ff, 0x0101010100000001, 0x0101010101ffffff,
    0x0101010101ffff01, 0x0101010101ff01ff, 0x0101010101ff0101, 0x0101010101000000, 0x010101010101ffff, 0x010101010101ff01,
    0x01010101010101ff, 0x0101010101010101,
};

/* IQ2_XXS / IQ2_XS / IQ3_XXS's 7 stored sign bits and the 8th, their parity (ggml's ksigns_iq2xs) */
static const uint8_t signs_of7[128] = {
    0,   129, 130, 3,   132, 5,   6,   135, 136, 9,   10,  139, 12,  141, 142, 15,  144, 17,  18,  147, 20,  149, 150, 23,  24,  153, 154, 27,  156, 29,  30,  159,
    160, 33,  34,  163, 36,  165, 166, 39,  40,  169, 170, 43,  172, 45,  46,  175, 48,  177, 178, 51,  180, 53,  54,  183, 184, 57,  58,  187, 60,  189, 190, 63,
    192, 65,  66,  195, 68,  197, 198, 71,  72,  201, 202, 75,  204, 77,  78,  207, 80,  209, 210, 83,  212, 85,  86,  215, 216, 89,  90,  219, 92,  221, 222, 95,
    96,  225, 226, 99,  228, 101, 102, 231, 232, 105, 106, 235, 108, 237, 238, 111, 240, 113, 114, 243, 116, 245, 246, 119, 120, 249, 250, 123, 252, 125, 126, 255};

#if defined(MOE_X86) || defined(MOE_NEON) /* (for the SIMD decoders) */
/* signs_of7 as byte masks: byte k 0xff where value k is negative */
static const uint64_t sign_masks7[128] = {
    0x0000000000000000, 0xff000000000000ff, 0xff0000000000ff00, 0x000000000000ffff, 0xff00000000ff0000, 0x0000000000ff00ff,
    0x0000000000ffff00, 0xff00000000ffffff, 0xff000000ff000000, 0x00000000ff0000ff, 0x00000000ff00ff00, 0xff000000ff00ffff,
    0x00000000ffff0000, 0xff000000ffff00ff, 0xff000000ffffff00, 0x00000000ffffffff, 0xff0000ff00000000, 0x000000ff000000ff,
    0x000000ff0000ff00, 0xff0000ff0000ffff, 0x000000ff00ff0000, 0xff0000ff00ff00ff, 0xff0000ff00ffff00, 0x000000ff00ffffff,
    0x000000ffff000000, 0xff0000ffff0000ff, 0xff0000ffff00ff00, 0x000000ffff00ffff, 0xff0000ffffff0000, 0x000000ffffff00ff,
    0x000000ffffffff00, 0xff0000ffffffffff, 0xff00ff0000000000, 0x0000ff00000000ff, 0x0000ff000000ff00, 0xff00ff000000ffff,
    0x0000ff0000ff0000, 0xff00ff0000ff00ff, 0xff00ff0000ffff00, 0x0000ff0000ffffff, 0x0000ff00ff000000, 0xff00ff00ff0000ff,
    0xff00ff00ff00ff00, 0x0000ff00ff00ffff, 0xff00ff00ffff0000, 0x0000ff00ffff00ff, 0x0000ff00ffffff00, 0xff00ff00ffffffff,
    0x0000ffff00000000, 0xff00ffff000000ff, 0xff00ffff0000ff00, 0x0000ffff0000ffff, 0xff00ffff00ff0000, 0x0000ffff00ff00ff,
    0x0000ffff00ffff00, 0xff00ffff00ffffff, 0xff00ffffff000000, 0x0000ffffff0000ff, 0x0000ffffff00ff00, 0xff00ffffff00ffff,
    0x0000ffffffff0000, 0xff00ffffffff00ff, 0xff00ffffffffff00, 0x0000ffffffffffff, 0xffff000000000000, 0x00ff0000000000ff,
    0x00ff00000000ff00, 0xffff00000000ffff, 0x00ff000000ff0000, 0xffff000000ff00ff, 0xffff000000ffff00, 0x00ff000000ffffff,
    0x00ff0000ff000000, 0xffff0000ff0000ff, 0xffff0000ff00ff00, 0x00ff0000ff00ffff, 0xffff0000ffff0000, 0x00ff0000ffff00ff,
    0x00ff0000ffffff00, 0xffff0000ffffffff, 0x00ff00ff00000000, 0xffff00ff000000ff, 0xffff00ff0000ff00, 0x00ff00ff0000ffff,
    0xffff00ff00ff0000, 0x00ff00ff00ff00ff, 0x00ff00ff00ffff00, 0xffff00ff00ffffff, 0xffff00ffff000000, 0x00ff00ffff0000ff,
    0x00ff00ffff00ff00, 0xffff00ffff00ffff, 0x00ff00ffffff0000, 0xffff00ffffff00ff, 0xffff00ffffffff00, 0x00ff00ffffffffff,
    0x00ffff0000000000, 0xffffff00000000ff, 0xffffff000000ff00, 0x00ffff000000ffff, 0xffffff0000ff0000, 0x00ffff0000ff00ff,
    0x00ffff0000ffff00, 0xffffff0000ffffff, 0xffffff00ff000000, 0x00ffff00ff0000ff, 0x00ffff00ff00ff00, 0xffffff00ff00ffff,
    0x00ffff00ffff0000, 0xffffff00ffff00ff, 0xffffff00ffffff00, 0x00ffff00ffffffff, 0xffffffff00000000, 0x00ffffff000000ff,
    0x00ffffff0000ff00, 0xffffffff0000ffff, 0x00ffffff00ff0000, 0xffffffff00ff00ff, 0xffffffff00ffff00, 0x00ffffff00ffffff,
    0x00ffffffff000000, 0xffffffffff0000ff, 0xffffffffff00ff00, 0x00ffffffff00ffff, 0xffffffffffff0000, 0x00ffffffffff00ff,
    0x00ffffffffffff00, 0xffffffffffffffff,
};
#endif
