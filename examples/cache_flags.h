/* cache_flags.h - the expert-store and latent-cache flags every program takes, parsed one way
 * (included by the examples; not part of the runtime):
 *   --load-mode mmap|cache   --expert-budget SIZE   --dense-budget SIZE   --io-threads N
 *   --prefetch on|off   --dense auto|asis|f32|bf16|q8_0|q4_0   --kv-type f32|bf16|q8
 *   --mxfp4 f32|int8   --act 8|16   --kernels NAME
 * Each of the first six it is given is marked in moe_options.set, so that the resource plan
 * (MOE_FLAG_PLAN, which the programs set) keeps it; "auto" leaves the choice to the plan. */
#ifndef MOE_EXAMPLES_CACHE_FLAGS_H
#define MOE_EXAMPLES_CACHE_FLAGS_H
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A size with its unit, binary: "8G" (or "8GiB", "8GB") is 8 GiB, "512M", "64K", "1T", "4096B".
 * 0 when it is not a positive size or has no unit. */
static inline int parse_size(const char *s, size_t *out) {
    char *end;
    const double v = strtod(s, &end);
    const double mul = *end == 'K' || *end == 'k' ? 1024.0 : *end == 'M' || *end == 'm' ? 1048576.0 : *end == 'G' || *end == 'g' ? 1073741824.0
                     : *end == 'T' || *end == 't' ? 1099511627776.0 : *end == 'B' ? 1.0 : 0.0;
    if (!mul || end == s) return 0; /* a size needs its unit: a bare 256 is not taken as bytes */
    end++;
    if (mul > 1.0 && (!strcmp(end, "iB") || !strcmp(end, "B"))) end += strlen(end); /* 8G, 8GiB and 8GB all mean 8 GiB */
    if (*end || !(v > 0) || v * mul > 1e18) return 0;
    *out = (size_t)(v * mul);
    return 1;
}

/* "f32" / "bf16" / "q8": the moe_kv_type; -1 otherwise */
static inline int parse_kv_type(const char *s) {
    return !strcmp(s, "f32") ? MOE_KV_F32 : !strcmp(s, "bf16") ? MOE_KV_BF16 : !strcmp(s, "q8") ? MOE_KV_Q8 : -1;
}

/* --mxfp4 "f32" / "int8": 0 or 1, whether MXFP4 matrices meet int8-quantized input
 * (MOE_FLAG_MXFP4_INT8); -1 otherwise */
static inline int parse_mxfp4(const char *s) { return !strcmp(s, "int8") ? 1 : !strcmp(s, "f32") ? 0 : -1; }

/* --act "8" / "16": 0 or 1, whether the integer formats meet their input as two 8-bit parts
 * (MOE_FLAG_ACT16); -1 otherwise */
static inline int parse_act(const char *s) { return !strcmp(s, "16") ? 1 : !strcmp(s, "8") ? 0 : -1; }

/* If argv[*i] is one of the flags, consumes it (and its value) into o and returns 1; returns -1
 * with *why set when its value is bad (a message naming the flag and the value); 0 when it is not
 * one of them. */
static inline int cache_flag(int argc, char **argv, int *i, moe_options *o, const char **why) {
    const char *a = argv[*i], *v = *i + 1 < argc ? argv[*i + 1] : NULL;
    if (!strcmp(a, "--check-tensors")) { /* llama.cpp's name for it */
        o->flags |= MOE_FLAG_CHECK_TENSORS;
        return 1;
    }
    if (strcmp(a, "--load-mode") && strcmp(a, "--expert-budget") && strcmp(a, "--dense-budget") && strcmp(a, "--io-threads") &&
        strcmp(a, "--prefetch") && strcmp(a, "--dense") && strcmp(a, "--kv-type") && strcmp(a, "--mxfp4") && strcmp(a, "--act") &&
        strcmp(a, "--kernels"))
        return 0;
    static char msg[300]; /* "FLAG VALUE: what it takes" (the programs are single-threaded here) */
#define CACHE_FLAG_BAD(what) return snprintf(msg, sizeof msg, "%s %s: %s", a, v, what), *why = msg, -1
    if (!v) return snprintf(msg, sizeof msg, "%s needs a value", a), *why = msg, -1;
    ++*i;
    if (!strcmp(a, "--load-mode")) {
        if (!strcmp(v, "mmap")) o->expert_mode = MOE_EXPERTS_MMAP;
        else if (!strcmp(v, "cache")) o->expert_mode = MOE_EXPERTS_CACHE;
        else CACHE_FLAG_BAD("must be mmap or cache");
        o->set |= MOE_SET_EXPERT_MODE;
    } else if (!strcmp(a, "--expert-budget")) {
        if (!parse_size(v, &o->expert_budget)) CACHE_FLAG_BAD("not a size with its unit, such as 8G");
        o->set |= MOE_SET_EXPERT_BUDGET;
    } else if (!strcmp(a, "--dense-budget")) {
        if (!parse_size(v, &o->dense_budget)) CACHE_FLAG_BAD("not a size with its unit, such as 20G");
        o->set |= MOE_SET_DENSE_BUDGET;
    } else if (!strcmp(a, "--io-threads")) {
        char *e;
        long n = strtol(v, &e, 10);
        if (*e || e == v || n < 0 || n > 256) CACHE_FLAG_BAD("must be a whole number from 0 to 256");
        o->io_threads = (int)n;
        o->set |= MOE_SET_IO_THREADS;
    } else if (!strcmp(a, "--dense")) {
        const int t = !strcmp(v, "asis") ? MOE_WTYPE_ASIS : !strcmp(v, "f32") ? MOE_WTYPE_F32 : !strcmp(v, "bf16") ? MOE_WTYPE_BF16
                    : !strcmp(v, "q8_0") ? MOE_WTYPE_Q8_0 : !strcmp(v, "q4_0") ? MOE_WTYPE_Q4_0 : !strcmp(v, "auto") ? -1 : -2;
        if (t == -2) CACHE_FLAG_BAD("must be auto, asis, f32, bf16, q8_0 or q4_0");
        if (t >= 0) o->dense_type = t, o->set |= MOE_SET_DENSE_TYPE;
        else o->dense_type = MOE_WTYPE_ASIS, o->set &= ~(unsigned)MOE_SET_DENSE_TYPE;
    } else if (!strcmp(a, "--kernels")) {
        o->kernels = v; /* a name moe_model_open checks against the CPU's levels */
    } else if (!strcmp(a, "--kv-type")) {
        if ((o->kv_type = parse_kv_type(v)) < 0) CACHE_FLAG_BAD("must be f32, bf16 or q8");
    } else if (!strcmp(a, "--mxfp4")) {
        const int int8 = parse_mxfp4(v);
        if (int8 < 0) CACHE_FLAG_BAD("must be f32 or int8");
        o->flags = int8 ? o->flags | MOE_FLAG_MXFP4_INT8 : o->flags & ~(unsigned)MOE_FLAG_MXFP4_INT8;
    } else if (!strcmp(a, "--act")) {
        const int act16 = parse_act(v);
        if (act16 < 0) CACHE_FLAG_BAD("must be 8 or 16");
        o->flags = act16 ? o->flags | MOE_FLAG_ACT16 : o->flags & ~(unsigned)MOE_FLAG_ACT16;
    } else {
        if (strcmp(v, "on") && strcmp(v, "off")) CACHE_FLAG_BAD("must be on or off");
        o->prefetch = !strcmp(v, "on");
        o->set |= MOE_SET_PREFETCH;
    }
#undef CACHE_FLAG_BAD
    return 1;
}
/* The plan a model was opened with (nothing without MOE_FLAG_PLAN): one line on stderr, and the
 * options it chose into *o where o is not NULL, so that the program sees what it runs with. */
static inline void use_plan(const char *prog, const moe_model *m, moe_options *o) {
    const moe_plan *p = moe_model_plan(m);
    if (!p) return;
    fprintf(stderr, "%s: plan: %s\n", prog, p->summary);
    if (o) *o = p->opt;
}
#endif
