/* moe.c - the moe runtime: loading checkpoints (safetensors, GGUF), keeping their weights in
 * memory or streaming them from disk, the forward pass of the Kimi Linear / Kimi K3 family
 * (docs/spec/MODEL.md), sessions, and text (tokenizer, chat formats, sampling). Kernels and number
 * formats live in quant.c; this file owns model logic only and calls the kernels through the
 * model's kernel table (m->k). It prints nothing and never exits: every failure is a moe_status
 * with a message in the caller's buffer.
 * Copyright (c) 2026 the moe authors. MIT License: see LICENSE (the three runtime files are
 * under it whole; keep this notice in copies).
 *
 * The file reads front to back in the order data flows. Each part opens with a banner; grep
 * for its exact string:
 *
 *   "PART 1: LOADING"           JSON, safetensors, GGUF, config, tensor names, binding, opening
 *   "PART 2: WEIGHT RESIDENCY"  mapped files, load-time conversion, streamed dense layers, the
 *                               expert cache and its I/O threads
 *   "PART 3: THREADS AND MATMUL" the step's thread team, y = x W^T over every weight format
 *   "PART 4: THE FORWARD PASS"  norms, KDA, MLA, FFN and MoE, attention residuals, the step
 *   "PART 5: SESSIONS"          one sequence's state: create, reset, snapshot, fork
 *   "PART 6: TEXT"              tokenizer, chat formats, sampling
 *
 * Within a part, sections open with a "==== NAME" banner line (utilities come first, before
 * PART 1). docs/CODE.md walks through the layout. Where to start reading:
 *   one token's forward pass   moe_step -> forward -> forward_layers (PART 4, section "step")
 *   an expert read from disk   moe_ffn_forward -> expert_get -> cache_get -> unit_fill ->
 *                              span_read (PART 2, section "expert cache")
 *   a new weight format        quant.c's opening comment; here only st_dtypes / gguf types
 *                              (PART 1) and count_dense_bytes' names */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* madvise */
#define _GNU_SOURCE /* O_DIRECT (glibc declares it only then; other libcs ignore this) */
#define MOE_INTERNAL
#include "moe.h"

#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* ==== utilities ============================================================================
 * Errors go to a caller-owned buffer; nothing here keeps error text. */

static moe_status fail(char *err, size_t errlen, moe_status st, const char *fmt, ...) {
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return st;
}

const char *moe_status_str(moe_status st) {
    switch (st) {
    case MOE_OK: return "ok";
    case MOE_ERR_IO: return "I/O error";
    case MOE_ERR_FORMAT: return "bad model file";
    case MOE_ERR_UNSUPPORTED: return "unsupported";
    case MOE_ERR_NOMEM: return "out of memory";
    case MOE_ERR_ARG: return "bad argument";
    case MOE_ERR_CTX_FULL: return "context full";
    case MOE_ERR_RANGE: return "output buffer too small";
    case MOE_ERR_NUMERIC: return "not a finite number";
    }
    return "unknown status";
}

/* 1 when x[0..n) holds a NaN or an infinity (by the exponent bits: immune to -ffast-math) */
static int has_nonfinite(const float *x, size_t n) {
    uint32_t any = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t b;
        memcpy(&b, &x[i], 4);
        any |= (b & 0x7f800000u) == 0x7f800000u;
    }
    return any != 0;
}

/* 1 when n 16-bit floats (exponent mask: F16 0x7c00, BF16 0x7f80) hold a NaN or an infinity */
static int has_nonfinite16(const uint16_t *x, size_t n, uint16_t mask) {
    uint32_t any = 0;
    for (size_t i = 0; i < n; i++) any |= (x[i] & mask) == mask;
    return any != 0;
}

/* 1 when n values of MOE_T_F32, F16 or BF16 at data hold a NaN or an infinity (other types: 0) */
static int values_nonfinite(int type, const void *data, size_t n) {
    if (type == MOE_T_F32) return has_nonfinite(data, n);
    if (type == MOE_T_F16 || type == MOE_T_BF16) return has_nonfinite16(data, n, type == MOE_T_F16 ? 0x7c00 : 0x7f80);
    return 0;
}

/* a*b (and a*b*c) with overflow detection against INT64_MAX/2 */
static int mul_ok(int64_t a, int64_t b, int64_t *out) {
    if (a < 0 || b < 0) return 0;
    if (a && b > (INT64_MAX / 2) / a) return 0;
    *out = a * b;
    return 1;
}

static double now_sec(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int thread_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static void *xcalloc(size_t n, size_t sz) { return n && sz ? calloc(n, sz) : calloc(1, 1); }

/* =================================================================================================
 * PART 1: LOADING
 * =================================================================================================
 * From files to a bound model. A checkpoint is a directory of safetensors shards (config.json,
 * model.safetensors.index.json) or one or more GGUF files; every file is mapped read-only whole
 * and every header is parsed through bounded reads (JSON, safetensors, GGUF), so a hostile file
 * gives an error and never a read out of bounds. The config is read and range-checked once
 * (moe__config_check), so later parts rely on its dimensions. Binding looks up each tensor the
 * model needs by its Hugging Face name (GGUF names are mapped to those), checks type, shape and
 * alignment, and keeps a pointer into the mapping (matrices) or an f32 copy (small vectors).
 * moe_model_open ties it together, then hands the weights to PART 2 (choose_streamed,
 * convert_weights, repack_weights, cache_open) to decide where each one lives. */

/* ==== JSON ===================================================================================
 * A strict RFC 8259 parser for config.json, safetensors headers and the shard index. The whole
 * tree lives in an arena freed at once. Depth and sizes are bounded; every read is checked
 * against the text length, so a hostile header can only produce an error. */

typedef struct jarena {
    struct jarena *next;
    size_t used, cap;
    double data[]; /* double: keeps every allocation suitably aligned */
} jarena;

typedef struct {
    const char *s;
    size_t n, pos;
    jarena *head, *cur;
    int depth;
    char *err;
    size_t errlen;
    moe_status st;
} jparser;

#define JSON_MAX_DEPTH 64

static void *jalloc(jparser *p, size_t sz) {
    sz = (sz + 7) & ~(size_t)7;
    if (!p->cur || p->cur->cap - p->cur->used < sz) {
        size_t cap = sz > 65536 ? sz : 65536;
        jarena *a = malloc(sizeof(jarena) + cap);
        if (!a) { p->st = MOE_ERR_NOMEM; return NULL; }
        a->next = NULL, a->used = 0, a->cap = cap;
        if (p->cur) p->cur->next = a; else p->head = a;
        p->cur = a;
    }
    void *r = (char *)p->cur->data + p->cur->used;
    p->cur->used += sz;
    return r;
}

static void *jerr(jparser *p, const char *what) {
    if (p->st == MOE_OK)
        p->st = fail(p->err, p->errlen, MOE_ERR_FORMAT, "JSON: %s at byte %zu", what, p->pos);
    return NULL;
}

static void jws(jparser *p) {
    while (p->pos < p->n && (p->s[p->pos] == ' ' || p->s[p->pos] == '\t' ||
                             p->s[p->pos] == '\n' || p->s[p->pos] == '\r'))
        p->pos++;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static int jhex4(jparser *p, unsigned *out) {
    if (p->n - p->pos < 4) return 0;
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        int h = hexval(p->s[p->pos + i]);
        if (h < 0) return 0;
        v = v * 16 + (unsigned)h;
    }
    p->pos += 4;
    *out = v;
    return 1;
}

/* at the opening quote; returns the unescaped NUL-terminated string */
static char *jstring(jparser *p) {
    size_t start = ++p->pos, end = start;
    while (end < p->n && p->s[end] != '"') end += p->s[end] == '\\' ? 2 : 1;
    if (end >= p->n) return jerr(p, "unterminated string");
    char *out = jalloc(p, end - start + 1), *o = out;
    if (!out) return NULL;
    while (p->pos < end) {
        unsigned char c = (unsigned char)p->s[p->pos++];
        if (c < 0x20) return jerr(p, "control character in string");
        if (c != '\\') { *o++ = (char)c; continue; }
        char e = p->s[p->pos++];
        switch (e) {
        case '"': *o++ = '"'; break;
        case '\\': *o++ = '\\'; break;
        case '/': *o++ = '/'; break;
        case 'b': *o++ = '\b'; break;
        case 'f': *o++ = '\f'; break;
        case 'n': *o++ = '\n'; break;
        case 'r': *o++ = '\r'; break;
        case 't': *o++ = '\t'; break;
        case 'u': {
            unsigned cp, lo;
            if (!jhex4(p, &cp)) return jerr(p, "bad \\u escape");
            if (cp >= 0xD800 && cp < 0xDC00) {
                if (p->n - p->pos < 6 || p->s[p->pos] != '\\' || p->s[p->pos + 1] != 'u')
                    return jerr(p, "lone surrogate");
                p->pos += 2;
                if (!jhex4(p, &lo) || lo < 0xDC00 || lo > 0xDFFF) return jerr(p, "bad surrogate");
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            } else if (cp >= 0xDC00 && cp < 0xE000) {
                return jerr(p, "lone surrogate");
            }
            if (cp == 0) return jerr(p, "NUL in string");
            if (cp < 0x80) *o++ = (char)cp;
            else if (cp < 0x800) *o++ = (char)(0xC0 | cp >> 6), *o++ = (char)(0x80 | (cp & 63));
            else if (cp < 0x10000)
                *o++ = (char)(0xE0 | cp >> 12), *o++ = (char)(0x80 | ((cp >> 6) & 63)),
                *o++ = (char)(0x80 | (cp & 63));
            else
                *o++ = (char)(0xF0 | cp >> 18), *o++ = (char)(0x80 | ((cp >> 12) & 63)),
                *o++ = (char)(0x80 | ((cp >> 6) & 63)), *o++ = (char)(0x80 | (cp & 63));
            break;
        }
        default: return jerr(p, "bad escape");
        }
    }
    *o = 0;
    p->pos = end + 1;
    return out;
}

static moe__json *jvalue(jparser *p);

static moe__json *jnode(jparser *p, int type) {
    moe__json *j = jalloc(p, sizeof *j);
    if (j) memset(j, 0, sizeof *j), j->type = type;
    return j;
}

static int jkey_cmp(const void *a, const void *b) { return strcmp(*(const char *const *)a, *(const char *const *)b); }

/* 1 (the parse failed) when object j has a key twice: which value was meant is ambiguous
 * (Python's json takes the last, a first-match lookup the first), so such a document is refused */
static int jdup_key(jparser *p, const moe__json *j) {
    if (j->n < 2) return 0;
    const char *dup = NULL;
    if (j->n <= 16) {
        for (const moe__json *a = j->child; a && !dup; a = a->next)
            for (const moe__json *b = a->next; b && !dup; b = b->next)
                if (!strcmp(a->key, b->key)) dup = a->key;
    } else {
        const char **keys = malloc(sizeof *keys * (size_t)j->n);
        if (!keys) return p->st = MOE_ERR_NOMEM, 1;
        size_t n = 0;
        for (const moe__json *a = j->child; a; a = a->next) keys[n++] = a->key;
        qsort(keys, n, sizeof *keys, jkey_cmp);
        for (size_t i = 1; i < n && !dup; i++)
            if (!strcmp(keys[i - 1], keys[i])) dup = keys[i];
        free(keys);
    }
    if (!dup) return 0;
    char what[160];
    snprintf(what, sizeof what, "key \"%.100s\" appears twice in one object (ambiguous)", dup);
    jerr(p, what);
    return 1;
}

static moe__json *jcontainer(jparser *p, int obj) {
    if (++p->depth > JSON_MAX_DEPTH) return jerr(p, "nesting too deep");
    moe__json *j = jnode(p, obj ? MOE_JSON_OBJ : MOE_JSON_ARR), *last = NULL;
    if (!j) return NULL;
    p->pos++;
    jws(p);
    if (p->pos < p->n && p->s[p->pos] == (obj ? '}' : ']')) {
        p->pos++;
        p->depth--;
        return j;
    }
    for (;;) {
        const char *key = NULL;
        jws(p);
        if (obj) {
            if (p->pos >= p->n || p->s[p->pos] != '"') return jerr(p, "expected key");
            if (!(key = jstring(p))) return NULL;
            jws(p);
            if (p->pos >= p->n || p->s[p->pos] != ':') return jerr(p, "expected ':'");
            p->pos++;
        }
        moe__json *v = jvalue(p);
        if (!v) return NULL;
        v->key = key;
        if (last) last->next = v; else j->child = v;
        last = v;
        j->n++;
        jws(p);
        if (p->pos >= p->n) return jerr(p, "unexpected end");
        char c = p->s[p->pos++];
        if (c == ',') continue;
        if (c == (obj ? '}' : ']')) break;
        return jerr(p, obj ? "expected ',' or '}'" : "expected ',' or ']'");
    }
    p->depth--;
    return obj && jdup_key(p, j) ? NULL : j;
}

static moe__json *jnumber(jparser *p) {
    size_t s = p->pos, i = s;
    if (i < p->n && p->s[i] == '-') i++;
    if (i >= p->n || p->s[i] < '0' || p->s[i] > '9') return jerr(p, "bad value");
    if (p->s[i] == '0') i++;
    else while (i < p->n && p->s[i] >= '0' && p->s[i] <= '9') i++;
    if (i < p->n && p->s[i] == '.') {
        i++;
        if (i >= p->n || p->s[i] < '0' || p->s[i] > '9') return jerr(p, "bad number");
        while (i < p->n && p->s[i] >= '0' && p->s[i] <= '9') i++;
    }
    if (i < p->n && (p->s[i] == 'e' || p->s[i] == 'E')) {
        i++;
        if (i < p->n && (p->s[i] == '+' || p->s[i] == '-')) i++;
        if (i >= p->n || p->s[i] < '0' || p->s[i] > '9') return jerr(p, "bad number");
        while (i < p->n && p->s[i] >= '0' && p->s[i] <= '9') i++;
    }
    char buf[64];
    if (i - s >= sizeof buf) return jerr(p, "number too long");
    memcpy(buf, p->s + s, i - s);
    buf[i - s] = 0;
    moe__json *j = jnode(p, MOE_JSON_NUM);
    char *lit = jalloc(p, i - s + 1);
    if (!j || !lit) return NULL;
    memcpy(lit, buf, i - s + 1);
    j->str = lit; /* the literal, for re-serialising it as Python would */
    j->num = strtod(buf, NULL);
    p->pos = i;
    return j;
}

static moe__json *jliteral(jparser *p, const char *lit, int type, double v) {
    size_t l = strlen(lit);
    if (p->n - p->pos < l || memcmp(p->s + p->pos, lit, l)) return jerr(p, "bad literal");
    p->pos += l;
    moe__json *j = jnode(p, type);
    if (j) j->num = v;
    return j;
}

static moe__json *jvalue(jparser *p) {
    jws(p);
    if (p->pos >= p->n) return jerr(p, "unexpected end");
    switch (p->s[p->pos]) {
    case '{': return jcontainer(p, 1);
    case '[': return jcontainer(p, 0);
    case '"': {
        moe__json *j = jnode(p, MOE_JSON_STR);
        if (j && !(j->str = jstring(p))) return NULL;
        return j;
    }
    case 't': return jliteral(p, "true", MOE_JSON_BOOL, 1);
    case 'f': return jliteral(p, "false", MOE_JSON_BOOL, 0);
    case 'n': return jliteral(p, "null", MOE_JSON_NULL, 0);
    default: return jnumber(p);
    }
}

static void jarena_free(jarena *a) {
    while (a) {
        jarena *n = a->next;
        free(a);
        a = n;
    }
}

moe_status moe__json_parse(const char *text, size_t len, moe__json **root, char *err,
                           size_t errlen) {
    jparser p = {text, len, 0, NULL, NULL, 0, err, errlen, MOE_OK};
    *root = NULL;
    /* the root is the first allocation of the first arena, so free() can find the arena */
    moe__json *r = jvalue(&p);
    if (r) {
        jws(&p);
        if (p.pos != p.n) r = jerr(&p, "trailing characters");
    }
    if (!r) {
        jarena_free(p.head);
        return p.st ? p.st : MOE_ERR_FORMAT;
    }
    *root = r;
    return MOE_OK;
}

void moe__json_free(moe__json *root) {
    if (root) jarena_free((jarena *)((char *)root - offsetof(jarena, data)));
}

const moe__json *moe__json_get(const moe__json *obj, const char *key) {
    if (!obj || obj->type != MOE_JSON_OBJ) return NULL;
    for (const moe__json *c = obj->child; c; c = c->next)
        if (!strcmp(c->key, key)) return c;
    return NULL;
}

/* ==== safetensors ============================================================================
 * u64 header length, JSON header {name: {dtype, shape, data_offsets}}, data. Each file is mapped
 * read-only whole; every offset and size is checked against the file before a pointer is made. */

static const struct { const char *name; int type, size; } st_dtypes[] = {
    {"F32", MOE_T_F32, 4}, {"F16", MOE_T_F16, 2}, {"BF16", MOE_T_BF16, 2}, {"U8", MOE_T_U8, 1},
    {"I32", MOE_T_I32, 4}, {"I8", -1, 1},         {"BOOL", -1, 1},        {"I16", -1, 2},
    {"U16", -1, 2},        {"U32", -1, 4},        {"F64", -1, 8},         {"I64", -1, 8},
    {"U64", -1, 8},        {"F8_E4M3", -1, 1},    {"F8_E5M2", -1, 1},     {"F8_E8M0", -1, 1},
};

#define KDA_CONV_MAX 64 /* the longest KDA short convolution a config may ask for */
#define ST_MAX_HEADER (512ull << 20)
#define ST_MAX_DIM (1ll << 40)

static int cmp_tensor_offset(const void *a, const void *b) {
    const moe__st_tensor *x = *(moe__st_tensor *const *)a, *y = *(moe__st_tensor *const *)b;
    return x->data < y->data ? -1 : x->data > y->data;
}

/* Tensors may not overlap: a hostile file could alias one region under two names. order: the
 * f->n_tensors tensors, sorted here by offset. */
static moe_status check_overlaps(const moe__st_file *f, moe__st_tensor **order, char *err, size_t errlen) {
    qsort(order, (size_t)f->n_tensors, sizeof *order, cmp_tensor_offset);
    for (int i = 1; i < f->n_tensors; i++)
        if ((const unsigned char *)order[i]->data < (const unsigned char *)order[i - 1]->data + order[i - 1]->nbytes)
            return fail(err, errlen, MOE_ERR_FORMAT, "%s: tensors %s and %s overlap", f->path, order[i - 1]->name, order[i]->name);
    return MOE_OK;
}

static int st_elem_size(const char *dtype, int *type) {
    for (size_t i = 0; i < sizeof st_dtypes / sizeof *st_dtypes; i++)
        if (!strcmp(dtype, st_dtypes[i].name)) {
            *type = st_dtypes[i].type;
            return st_dtypes[i].size;
        }
    return 0;
}

static int json_int(const moe__json *j, int64_t lo, int64_t hi, int64_t *out) {
    if (!j || j->type != MOE_JSON_NUM || j->num != floor(j->num) || j->num < (double)lo ||
        j->num > (double)hi)
        return 0;
    *out = (int64_t)j->num;
    return 1;
}

static moe_status st_parse(moe__st_file *f, char *err, size_t errlen) {
    const unsigned char *b = f->map;
    if (f->size < 8) return fail(err, errlen, MOE_ERR_FORMAT, "%s: truncated (%zu bytes)", f->path, f->size);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | b[i];
    if (hlen > f->size - 8 || hlen > ST_MAX_HEADER)
        return fail(err, errlen, MOE_ERR_FORMAT, "%s: header length %llu exceeds file size %zu",
                    f->path, (unsigned long long)hlen, f->size);
    moe__json *root;
    char jerrbuf[160];
    moe_status st = moe__json_parse((const char *)b + 8, hlen, &root, jerrbuf, sizeof jerrbuf);
    if (st) return fail(err, errlen, st, "%s: header: %s", f->path, jerrbuf);
    if (root->type != MOE_JSON_OBJ) {
        moe__json_free(root);
        return fail(err, errlen, MOE_ERR_FORMAT, "%s: header is not a JSON object", f->path);
    }
    const unsigned char *data = b + 8 + hlen;
    uint64_t data_size = f->size - 8 - hlen;
    f->tensors = xcalloc((size_t)root->n, sizeof *f->tensors);
    moe__st_tensor **order = xcalloc((size_t)root->n, sizeof *order);
    if (!f->tensors || !order) { st = MOE_ERR_NOMEM; goto done; }
    for (const moe__json *e = root->child; e; e = e->next) {
        if (!strcmp(e->key, "__metadata__")) continue;
        moe__st_tensor *t = &f->tensors[f->n_tensors];
        if (strlen(e->key) >= sizeof t->name) {
            st = fail(err, errlen, MOE_ERR_FORMAT, "%s: tensor name too long", f->path);
            goto done;
        }
        strcpy(t->name, e->key);
        const moe__json *dt = moe__json_get(e, "dtype"), *sh = moe__json_get(e, "shape"),
                        *off = moe__json_get(e, "data_offsets");
        int esize;
        if (!dt || dt->type != MOE_JSON_STR || !(esize = st_elem_size(dt->str, &t->type))) {
            st = fail(err, errlen, MOE_ERR_FORMAT, "%s: tensor %s: missing or unknown dtype",
                      f->path, t->name);
            goto done;
        }
        if (!sh || sh->type != MOE_JSON_ARR || sh->n > 8) {
            st = fail(err, errlen, MOE_ERR_FORMAT, "%s: tensor %s: bad shape", f->path, t->name);
            goto done;
        }
        int64_t count = 1, o0, o1;
        t->ndim = 0;
        for (const moe__json *d = sh->child; d; d = d->next) {
            int64_t v;
            if (!json_int(d, 0, ST_MAX_DIM, &v) || !mul_ok(count, v, &count)) {
                st = fail(err, errlen, MOE_ERR_FORMAT, "%s: tensor %s: bad or overflowing shape",
                          f->path, t->name);
                goto done;
            }
            t->shape[t->ndim++] = v;
        }
        if (!off || off->type != MOE_JSON_ARR || off->n != 2 ||
            !json_int(off->child, 0, INT64_MAX / 4, &o0) ||
            !json_int(off->child->next, 0, INT64_MAX / 4, &o1) || o0 > o1 ||
            (uint64_t)o1 > data_size) {
            st = fail(err, errlen, MOE_ERR_FORMAT,
                      "%s: tensor %s: data_offsets missing or outside the file (data size %llu)",
                      f->path, t->name, (unsigned long long)data_size);
            goto done;
        }
        int64_t nbytes;
        if (!mul_ok(count, esize, &nbytes) || nbytes != o1 - o0) {
            st = fail(err, errlen, MOE_ERR_FORMAT,
                      "%s: tensor %s: %lld bytes for its dtype and shape, but offsets span %lld",
                      f->path, t->name, (long long)(mul_ok(count, esize, &nbytes) ? nbytes : -1),
                      (long long)(o1 - o0));
            goto done;
        }
        t->data = data + o0;
        t->nbytes = (uint64_t)nbytes;
        order[f->n_tensors] = t;
        f->n_tensors++;
    }
    st = check_overlaps(f, order, err, errlen);
done:
    free(order);
    moe__json_free(root);
    return st;
}

static const char *file_kind(mode_t mode) {
    return S_ISDIR(mode) ? "a directory" : S_ISFIFO(mode) ? "a FIFO" : S_ISCHR(mode) ? "a character device"
         : S_ISBLK(mode) ? "a block device" : S_ISSOCK(mode) ? "a socket" : "not a regular file";
}

/* Opens path read-only (plus flags) only if it is a regular file. The open is non-blocking, so a
 * FIFO without a writer or a device cannot hang it; fstat then refuses anything but a regular
 * file, and the descriptor is made blocking again. *fd, or an error naming the path and why. */
static moe_status open_regular(const char *path, int flags, int *fd, char *err, size_t errlen) {
    *fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC | flags);
    if (*fd < 0) return fail(err, errlen, MOE_ERR_IO, "%s: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(*fd, &sb) || !S_ISREG(sb.st_mode) || fcntl(*fd, F_SETFL, fcntl(*fd, F_GETFL) & ~O_NONBLOCK)) {
        const int was_reg = S_ISREG(sb.st_mode);
        close(*fd);
        *fd = -1;
        return was_reg ? fail(err, errlen, MOE_ERR_IO, "%s: %s", path, strerror(errno))
                       : fail(err, errlen, MOE_ERR_IO, "%s: not a regular file (%s)", path, file_kind(sb.st_mode));
    }
    return MOE_OK;
}

static moe_status map_file(moe__st_file *f, const char *path, char *err, size_t errlen) {
    memset(f, 0, sizeof *f);
    if (!(f->path = strdup(path))) return MOE_ERR_NOMEM;
    int fd;
    moe_status st = open_regular(path, 0, &fd, err, errlen);
    if (st) {
        moe__st_close(f);
        return st;
    }
    struct stat sb;
    if (fstat(fd, &sb)) {
        st = fail(err, errlen, MOE_ERR_IO, "%s: %s", path, strerror(errno));
        close(fd);
        moe__st_close(f);
        return st;
    }
    f->size = (size_t)sb.st_size;
    if (f->size) {
        f->map = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (f->map == MAP_FAILED) {
            f->map = NULL;
            moe_status st = fail(err, errlen, MOE_ERR_IO, "%s: mmap: %s", path, strerror(errno));
            close(fd);
            moe__st_close(f);
            return st;
        }
    }
    close(fd);
    return MOE_OK;
}

static moe_status gguf_parse(moe__st_file *f, char *err, size_t errlen);

/* maps a file and parses it as safetensors or GGUF; nothing stays open on failure */
static moe_status open_weights(moe__st_file *f, const char *path, int gguf, char *err, size_t errlen) {
    moe_status st = map_file(f, path, err, errlen);
    if (st) return st;
    if ((st = gguf ? gguf_parse(f, err, errlen) : st_parse(f, err, errlen))) moe__st_close(f);
    return st;
}

moe_status moe__st_open(moe__st_file *f, const char *path, char *err, size_t errlen) {
    return open_weights(f, path, 0, err, errlen);
}

void moe__st_close(moe__st_file *f) {
    if (!f) return;
    if (f->map && !f->borrowed) munmap(f->map, f->size);
    free(f->kv);
    free(f->keys);
    free(f->tensors);
    free(f->path);
    memset(f, 0, sizeof *f);
}

const moe__st_tensor *moe__st_find(const moe__st_file *f, const char *name) {
    for (int i = 0; i < f->n_tensors; i++)
        if (!strcmp(f->tensors[i].name, name)) return &f->tensors[i];
    return NULL;
}

/* ==== GGUF ====================================================================================
 * GGUF v2/v3 (llama.cpp's container): magic, version, counts, key/value metadata, tensor infos,
 * aligned data. Read through a bounded cursor: every length and count is checked against the
 * bytes left before it is used, and a tensor's extent against the file. Tensors become
 * moe__st_tensor entries with PyTorch-order shapes, so the binder treats both formats alike. */

typedef struct {
    const uint8_t *b;
    size_t n, pos;
    int bad;
    int cut; /* a read ran past the end: the file is truncated */
} gcur;

static int g_take(gcur *c, void *out, size_t k) {
    if (!c->bad && k > c->n - c->pos) c->cut = 1;
    if (c->bad || k > c->n - c->pos) { c->bad = 1; return 0; }
    if (out) memcpy(out, c->b + c->pos, k);
    c->pos += k;
    return 1;
}

static uint32_t g_u32(gcur *c) { uint32_t v = 0; g_take(c, &v, 4); return v; } /* little-endian hosts */
static uint64_t g_u64(gcur *c) { uint64_t v = 0; g_take(c, &v, 8); return v; }

static const uint8_t *g_str(gcur *c, uint64_t *len) {
    *len = g_u64(c);
    const uint8_t *p = c->b + c->pos;
    if (!g_take(c, NULL, *len)) return NULL;
    return p;
}

static size_t gguf_scalar_size(uint32_t t) {
    static const size_t sz[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    return t < sizeof sz / sizeof *sz ? sz[t] : 0;
}

/* ggml tensor types: block length, block bytes, our type (-1: sized for validation only) */
static const struct { uint32_t id; int blk, bytes, type; } ggml_types[] = {
    {0, 1, 4, MOE_T_F32},    {1, 1, 2, MOE_T_F16},    {2, 32, 18, MOE_T_Q4_0},  {3, 32, 20, MOE_T_Q4_1},
    {6, 32, 22, MOE_T_Q5_0}, {7, 32, 24, MOE_T_Q5_1}, {8, 32, 34, MOE_T_Q8_0},  {9, 32, 36, -1},
    {10, 256, 84, MOE_T_Q2_K}, {11, 256, 110, MOE_T_Q3_K},      {12, 256, 144, MOE_T_Q4_K}, {13, 256, 176, MOE_T_Q5_K},
    {14, 256, 210, MOE_T_Q6_K},    {15, 256, 292, -1},      {20, 32, 18, MOE_T_IQ4_NL}, {23, 256, 136, MOE_T_IQ4_XS},
    /* the grid-codebook types (IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ3_S, IQ2_S, IQ1_M); the ternary TQ1_0 and TQ2_0 */
    {16, 256, 66, MOE_T_IQ2_XXS}, {17, 256, 74, MOE_T_IQ2_XS}, {18, 256, 98, MOE_T_IQ3_XXS}, {19, 256, 50, MOE_T_IQ1_S},
    {21, 256, 110, MOE_T_IQ3_S},  {22, 256, 82, MOE_T_IQ2_S},  {29, 256, 56, MOE_T_IQ1_M},  {34, 256, 54, -1},       {35, 256, 66, -1},
    {24, 1, 1, -1},           {25, 1, 2, -1},
    {26, 1, 4, MOE_T_I32}, {27, 1, 8, -1},          {28, 1, 8, -1},           {30, 1, 2, MOE_T_BF16},
    {39, 32, 17, MOE_T_MXFP4_GGML},
};

int moe__type_of_ggml(uint32_t id) {
    for (size_t k = 0; k < sizeof ggml_types / sizeof *ggml_types; k++)
        if (ggml_types[k].id == id) return ggml_types[k].type;
    return -1;
}

/* a metadata key twice is ambiguous (a first-match lookup takes one, other readers the other):
 * refused */
static moe_status gguf_dup_keys(const moe__st_file *f, char *err, size_t errlen) {
    if (f->n_kv < 2) return MOE_OK;
    const char **keys = malloc(sizeof *keys * (size_t)f->n_kv);
    if (!keys) return MOE_ERR_NOMEM;
    for (int64_t i = 0; i < f->n_kv; i++) keys[i] = f->kv[i].key;
    qsort(keys, (size_t)f->n_kv, sizeof *keys, jkey_cmp);
    const char *dup = NULL;
    for (int64_t i = 1; i < f->n_kv && !dup; i++)
        if (!strcmp(keys[i - 1], keys[i])) dup = keys[i];
    moe_status st = dup ? fail(err, errlen, MOE_ERR_FORMAT, "%s: metadata key %.200s appears twice (ambiguous)", f->path, dup) : MOE_OK;
    free(keys);
    return st;
}

static moe_status gguf_parse(moe__st_file *f, char *err, size_t errlen) {
    const char *path = f->path;
    moe_status st = MOE_OK;
    f->is_gguf = 1;
    f->alignment = 32;
    gcur c = {f->map, f->size, 0, 0, 0};
    uint32_t magic = g_u32(&c), version = g_u32(&c);
    uint64_t n_tensors = g_u64(&c), n_kv = g_u64(&c);
    moe__st_tensor **order = NULL;
    if (f->size >= 4 && !memcmp(f->map, "GGUF", 4) && c.bad) {
        st = fail(err, errlen, MOE_ERR_FORMAT, "%s: truncated: %zu bytes, less than a GGUF header", path, f->size);
        goto out;
    }
    if (c.bad || magic != 0x46554747u) { st = fail(err, errlen, MOE_ERR_FORMAT, "%s: not a GGUF file (bad magic)", path); goto out; }
    if (version < 2 || version > 3) { st = fail(err, errlen, MOE_ERR_FORMAT, "%s: GGUF version %u (2 and 3 are read)", path, version); goto out; }
    if (n_tensors > (1u << 24) || n_kv > (1u << 24)) {
        st = fail(err, errlen, MOE_ERR_FORMAT, "%s: absurd counts (%llu tensors, %llu keys)", path,
                  (unsigned long long)n_tensors, (unsigned long long)n_kv);
        goto out;
    }
    /* a key/value needs >= 13 bytes, a tensor info >= 24: counts that the rest cannot hold mean
     * the file was cut short (or its counts are wrong) */
    if (n_kv > (c.n - c.pos) / 13 || n_tensors > (c.n - c.pos) / 24 || n_kv * 13 + n_tensors * 24 > c.n - c.pos) {
        st = fail(err, errlen, MOE_ERR_FORMAT, "%s: truncated: %llu tensors and %llu keys cannot fit in the %zu bytes after the header", path,
                  (unsigned long long)n_tensors, (unsigned long long)n_kv, c.n - c.pos);
        goto out;
    }
    f->kv = xcalloc((size_t)n_kv, sizeof *f->kv);
    f->tensors = xcalloc((size_t)n_tensors, sizeof *f->tensors);
    order = xcalloc((size_t)n_tensors, sizeof *order);
    size_t keybytes = 0;
    if (!f->kv || !f->tensors || !order) { st = MOE_ERR_NOMEM; goto out; }
    /* keys are copied NUL-terminated into one buffer; first pass measures it */
    const size_t kv_start = c.pos;
    for (int pass = 0; pass < 2; pass++) {
        c.pos = kv_start;
        size_t kp = 0;
        for (uint64_t i = 0; i < n_kv; i++) {
            uint64_t klen;
            const uint8_t *k = g_str(&c, &klen);
            uint32_t t = g_u32(&c);
            if (c.cut) { st = fail(err, errlen, MOE_ERR_FORMAT, "%s: truncated in metadata key %llu of %llu", path, (unsigned long long)i, (unsigned long long)n_kv); goto out; }
            if (c.bad || klen > 65535) { st = fail(err, errlen, MOE_ERR_FORMAT, "%s: metadata key %llu too long", path, (unsigned long long)i); goto out; }
            moe__gguf_kv kv = {NULL, t, 0, 0, c.b + c.pos};
            if (t == MOE_GGUF_STRING) {
                kv.data = g_str(&c, &kv.n);
            } else if (t == MOE_GGUF_ARRAY) {
                kv.etype = g_u32(&c);
                kv.n = g_u64(&c);
                kv.data = c.b + c.pos;
                size_t es = gguf_scalar_size(kv.etype);
                if (kv.etype == MOE_GGUF_STRING) {
                    if (kv.n > (c.n - c.pos) / 8) c.bad = 1;
                    for (uint64_t j = 0; j < kv.n && !c.bad; j++) { uint64_t l; g_str(&c, &l); }
                } else if (!es || kv.n > (c.n - c.pos) / es) {
                    c.bad = 1; /* nested arrays are not used by any model we read */
                } else {
                    g_take(&c, NULL, (size_t)kv.n * es);
                }
            } else if (gguf_scalar_size(t)) {
                g_take(&c, NULL, gguf_scalar_size(t));
            } else {
                c.bad = 1;
            }
            if (c.cut) { st = fail(err, errlen, MOE_ERR_FORMAT, "%s: truncated in the value of metadata %.*s", path, (int)klen, (const char *)k); goto out; }
            if (c.bad) { st = fail(err, errlen, MOE_ERR_FORMAT, "%s: metadata %.*s: bad type or count", path, (int)klen, (const char *)k); goto out; }
            if (pass == 0) {
                keybytes += klen + 1;
            } else {
                memcpy(f->keys + kp, k, klen);
                f->keys[kp + klen] = 0;
                kv.key = f->keys + kp;
                kp += klen + 1;
                f->kv[i] = kv;
            }
        }
        if (pass == 0 && !(f->keys = malloc(keybytes + 1))) { st = MOE_ERR_NOMEM; goto out; }
    }
    f->n_kv = (int64_t)n_kv;
    if ((st = gguf_dup_keys(f, err, errlen))) goto out;
    const moe__gguf_kv *al = moe__gguf_get(f, "general.alignment");
    if (al) {
        uint32_t a = 0;
        if (al->type == MOE_GGUF_U32) memcpy(&a, al->data, 4);
        if (!a || (a & (a - 1)) || a > (1u << 20)) { st = fail(err, errlen, MOE_ERR_FORMAT, "%s: bad general.alignment", path); goto out; }
        f->alignment = a;
    }
    for (uint64_t i = 0; i < n_tensors; i++) {
        moe__st_tensor *t = &f->tensors[i];
        uint64_t nlen;
        const uint8_t *nm = g_str(&c, &nlen);
        uint32_t nd = g_u32(&c);
        if (c.cut) { st = fail(err, errlen, MOE_ERR_FORMAT, "%s: truncated in tensor info %llu of %llu", path, (unsigned long long)i, (unsigned long long)n_tensors); goto out; }
        if (c.bad || nlen >= sizeof t->name || nd < 1 || nd > 4) { st = fail(err, errlen, MOE_ERR_FORMAT, "%s: tensor info %llu: bad name or dimension count", path, (unsigned long long)i); goto out; }
        memcpy(t->name, nm, nlen);
        t->name[nlen] = 0;
        int64_t ne[4] = {1, 1, 1, 1}, count = 1;
        for (uint32_t d = 0; d < nd; d++) {
            uint64_t v = g_u64(&c);
            if (v < 1 || v > (uint64_t)ST_MAX_DIM || !mul_ok(count, (int64_t)v, &count)) c.bad = 1;
            ne[d] = (int64_t)v;
        }
        uint32_t gt = g_u32(&c);
        uint64_t off = g_u64(&c);
        if (c.cut) { st = fail(err, errlen, MOE_ERR_FORMAT, "%s: truncated in the tensor info of %s", path, t->name); goto out; }
        if (c.bad) { st = fail(err, errlen, MOE_ERR_FORMAT, "%s: tensor %s: bad or overflowing dimensions", path, t->name); goto out; }
        int ti = -1;
        for (size_t k = 0; k < sizeof ggml_types / sizeof *ggml_types; k++)
            if (ggml_types[k].id == gt) ti = (int)k;
        if (ti < 0) { st = fail(err, errlen, MOE_ERR_UNSUPPORTED, "%s: tensor %s: unknown ggml type %u", path, t->name, gt); goto out; }
        if (ne[0] % ggml_types[ti].blk) { st = fail(err, errlen, MOE_ERR_FORMAT, "%s: tensor %s: row of %lld values is not whole blocks", path, t->name, (long long)ne[0]); goto out; }
        int64_t nbytes;
        if (!mul_ok(count / ggml_types[ti].blk, ggml_types[ti].bytes, &nbytes)) { st = fail(err, errlen, MOE_ERR_FORMAT, "%s: tensor %s: size overflows", path, t->name); goto out; }
        t->type = ggml_types[ti].type;
        t->ndim = (int)nd;
        for (uint32_t d = 0; d < nd; d++) t->shape[d] = ne[nd - 1 - d];
        t->nbytes = (uint64_t)nbytes;
        t->data = (const void *)(uintptr_t)off; /* relative until the data start is known */
        order[i] = t;
    }
    const uint64_t data_start = ((uint64_t)c.pos + f->alignment - 1) / f->alignment * f->alignment;
    /* (a file without tensors, such as a split GGUF's metadata-only first part, needs no data section) */
    if (data_start > f->size && n_tensors) { st = fail(err, errlen, MOE_ERR_FORMAT, "%s: truncated before the tensor data", path); goto out; }
    const uint64_t data_size = data_start > f->size ? 0 : f->size - data_start;
    for (uint64_t i = 0; i < n_tensors; i++) {
        moe__st_tensor *t = &f->tensors[i];
        uint64_t off = (uint64_t)(uintptr_t)t->data;
        if (off % f->alignment || off > data_size || t->nbytes > data_size - off) {
            st = fail(err, errlen, MOE_ERR_FORMAT, "%s: tensor %s: offset %llu + %llu bytes is misaligned or outside the file",
                      path, t->name, (unsigned long long)off, (unsigned long long)t->nbytes);
            goto out;
        }
        t->data = (const unsigned char *)f->map + data_start + off;
    }
    f->n_tensors = (int)n_tensors;
    st = check_overlaps(f, order, err, errlen);
out:
    free(order);
    return st;
}

moe_status moe__gguf_open(moe__st_file *f, const char *path, char *err, size_t errlen) {
    return open_weights(f, path, 1, err, errlen);
}

/* Parses a file image already in memory (fuzzing, tests): the bytes are borrowed, not mapped;
 * release with moe__st_close as usual. */
moe_status moe__weights_parse_mem(moe__st_file *f, const void *data, size_t size, int gguf, char *err, size_t errlen) {
    memset(f, 0, sizeof *f);
    if (!(f->path = strdup("(memory)"))) return MOE_ERR_NOMEM;
    f->map = (void *)data, f->size = size, f->borrowed = 1;
    moe_status st = gguf ? gguf_parse(f, err, errlen) : st_parse(f, err, errlen);
    if (st) moe__st_close(f);
    return st;
}

const moe__gguf_kv *moe__gguf_get(const moe__st_file *f, const char *key) {
    for (int64_t i = 0; i < f->n_kv; i++)
        if (!strcmp(f->kv[i].key, key)) return &f->kv[i];
    return NULL;
}

/* ==== model structures ====================================================================== */

typedef struct {
    moe__weight w1, w2, w3; /* gate [I_e, d_e], down [d_e, I_e], up [I_e, d_e] */
} expert;

typedef struct {
    int kind, moe;
    float *attn_norm, *ffn_norm;   /* [d] */
    float *attn_res_w, *mlp_res_w; /* AttnRes pseudo-queries: norm weight * proj row, [d] */
    /* mixer projections (KDA and MLA share q, g, o slots) */
    moe__weight q, k, v, f_a, f_b, b, g_a, g_b, g, o;
    float *q_conv, *k_conv, *v_conv; /* [W, H_k*D]: by tap (conv_by_tap) */
    float *A_log, *dt_bias, *o_norm; /* [H_k], [H_k*D], [D] */
    moe__weight q_a, q_b, kv_a, kv_b;
    /* a split GGUF's attn_k_b (W_UK^T per head, [H*r, d_n]) and attn_v_b (W_UV, [H*d_v, r]) as
     * stored: absorbed MLA decodes from these (fewer bytes than kv_b rebuilt in f32); data NULL
     * otherwise */
    moe__weight k_b, v_b;
    float *q_a_norm, *kv_a_norm;
    /* FFN */
    moe__weight gate, up, down;          /* dense FFN or fused shared experts */
    moe__weight router, lat_down, lat_up;
    float *router_bias, *lat_norm;
    expert *experts; /* [E] */
    int stream;      /* CACHE mode: the dense matrices are read from disk every step (dense_budget) */
} layer;

typedef struct {
    const moe__st_tensor *t;
    int file;
} tensor_ref;

struct moe_model {
    moe_options opt;
    moe__kernels k;
    moe_config cfg;
    unsigned char *layer_kind, *layer_moe;
    moe__st_file *files;
    int n_files;
    tensor_ref *table; /* open-addressed hash of every tensor name */
    size_t table_cap;
    char prefix[32]; /* "language_model." for K3's multimodal wrapper */
    int gguf;        /* tensors use GGUF names (moe__hf_to_gguf) */
    layer *layers;
    moe__weight embed, lm_head;
    float *final_norm, *out_res_w;
    moe_model_info info;
    moe_plan plan; /* under MOE_FLAG_PLAN: what moe_model_open followed */
    int planned;
    char *path;
    void **owned; /* weights converted at load */
    int n_owned, cap_owned;
    struct expert_cache *cache; /* CACHE mode */
    int mla_key_block; /* test hook: keys per block of the expanded MLA form (0: by MLA_EXPANDED_BLOCK_BYTES) */
    int step_team;     /* test hook (par_run): 0 a team for the step when the threads fit the
                          processors, 1 never (each loop its own OpenMP region), 2 always */
};

struct moe_session {
    moe_model *m;
    int n_ctx, pos;
    float **kda_state; /* per layer: [H_k, D, D] or NULL */
    float **conv_tail; /* per layer: [H_k, W-1, 3, D] (each head's last pre-convolution q, k, v
                          rows, together so that a head reads its tail as one short stream) */
    void **mla_cache; /* per layer: [cap, r + d_r] latents c (normalised) and kr, f32, bf16 or int8 (kv_type) */
    moe__kv8_meta **mla_meta; /* per layer with an int8 cache: [cap] the rows' scales and sums */
    int *mla_cap;
};


/* where a layer keeps the dense matrices it can stream (kv_b only while it is still as stored:
 * absorbed MLA needs it in a float format and converts it at load otherwise) */
static const size_t dense_fields[] = {
    offsetof(layer, q), offsetof(layer, k), offsetof(layer, v), offsetof(layer, f_a), offsetof(layer, f_b),
    offsetof(layer, b), offsetof(layer, g_a), offsetof(layer, g_b), offsetof(layer, g), offsetof(layer, o),
    offsetof(layer, q_a), offsetof(layer, q_b), offsetof(layer, kv_a), offsetof(layer, kv_b), offsetof(layer, gate),
    offsetof(layer, up), offsetof(layer, down), offsetof(layer, lat_down), offsetof(layer, lat_up)};

/* a layer's matrix number i of dense_fields */
static moe__weight *layer_matrix(layer *L, size_t i) { return (moe__weight *)(void *)((char *)L + dense_fields[i]); }
#define N_DENSE_FIELDS (sizeof dense_fields / sizeof *dense_fields)

/* ==== config ==================================================================================
 * Moonshot's field names (docs/spec/MODEL.md section 1), with transformers' aliases as fallbacks.
 * Unknown keys of any type are ignored; every value we use is range-checked. */

typedef struct {
    const moe__json *j;
    char *err;
    size_t errlen;
    moe_status st;
} cfgp;

static const moe__json *cget(const moe__json *j, const char *key, const char *alias) {
    const moe__json *v = moe__json_get(j, key);
    if ((!v || v->type == MOE_JSON_NULL) && alias) v = moe__json_get(j, alias);
    return v && v->type != MOE_JSON_NULL ? v : NULL;
}

static int cint(cfgp *c, const moe__json *j, const char *key, const char *alias, int64_t def,
                int64_t lo, int64_t hi) {
    const moe__json *v = cget(j, key, alias);
    int64_t r;
    if (!v) r = def;
    else if (v->type == MOE_JSON_BOOL) r = (int64_t)v->num;
    else if (!json_int(v, INT32_MIN, INT32_MAX, &r)) r = lo - 1;
    if (r < lo || r > hi) {
        if (!c->st)
            c->st = fail(c->err, c->errlen, MOE_ERR_FORMAT,
                         "config.json: %s must be an integer in [%lld, %lld]", key, (long long)lo,
                         (long long)hi);
        return (int)lo;
    }
    return (int)r;
}

static float cfloat(cfgp *c, const moe__json *j, const char *key, double def, double lo,
                    double hi) {
    const moe__json *v = cget(j, key, NULL);
    double r = v ? (v->type == MOE_JSON_NUM ? v->num : NAN) : def;
    if (!(r >= lo && r <= hi)) {
        if (!c->st)
            c->st = fail(c->err, c->errlen, MOE_ERR_FORMAT,
                         "config.json: %s must be a number in [%g, %g]", key, lo, hi);
        return (float)lo;
    }
    return (float)r;
}

static int cstr_is(const moe__json *j, const char *key, const char *val, const char *def) {
    const moe__json *v = cget(j, key, NULL);
    const char *s = v && v->type == MOE_JSON_STR ? v->str : def;
    return s && !strcmp(s, val);
}

static moe_status parse_config(moe_model *m, const moe__json *root, char *err, size_t errlen) {
    cfgp c = {root, err, errlen, MOE_OK};
    const moe__json *j = root;
    const moe__json *tc = moe__json_get(root, "text_config");
    if (tc && tc->type == MOE_JSON_OBJ) {
        j = tc;
        strcpy(m->prefix, "language_model.");
    }
    /* the family moe runs: Kimi Linear ("kimi_linear", also the model_type of K3's text_config)
     * under K3's wrapper ("kimi_k3"); a config without model_type is read as one */
    const moe__json *mt = moe__json_get(j, "model_type");
    if (mt && mt->type == MOE_JSON_STR && strcmp(mt->str, "kimi_linear") && strcmp(mt->str, "kimi_k3"))
        return fail(err, errlen, MOE_ERR_UNSUPPORTED, "config.json: model_type \"%.60s\" is not a model moe runs (kimi_linear: Kimi Linear and "
                    "Kimi K3)", mt->str);
    moe_config *g = &m->cfg;
    g->vocab_size = cint(&c, j, "vocab_size", NULL, -1, 1, 1 << 24);
    g->hidden_size = cint(&c, j, "hidden_size", NULL, -1, 1, 1 << 16);
    g->n_layers = cint(&c, j, "num_hidden_layers", NULL, -1, 1, 4096);
    g->rms_norm_eps = cfloat(&c, j, "rms_norm_eps", 1e-6, 1e-30, 1.0);
    if (cstr_is(j, "hidden_act", "silu", "silu")) g->hidden_act = MOE_ACT_SILU;
    else if (cstr_is(j, "hidden_act", "situ", NULL)) g->hidden_act = MOE_ACT_SITU;
    else if (!c.st) c.st = fail(err, errlen, MOE_ERR_UNSUPPORTED, "config.json: hidden_act must be \"silu\" or \"situ\"");
    double beta = cfloat(&c, j, "activation_situ_beta", 0.0, 0.0, 1e6);
    g->situ_beta = beta > 0 ? (float)beta : 1.0f;
    g->situ_linear_beta = cfloat(&c, j, "activation_situ_linear_beta", 0.0, 0.0, 1e6);
    g->tie_embeddings = cint(&c, j, "tie_word_embeddings", NULL, 0, 0, 1);
    if (!g->tie_embeddings) g->tie_embeddings = cint(&c, root, "tie_word_embeddings", NULL, 0, 0, 1);
    g->bos_token_id = cint(&c, j, "bos_token_id", NULL, -1, -1, INT32_MAX);
    g->eos_token_id = cint(&c, j, "eos_token_id", NULL, -1, -1, INT32_MAX);

    const moe__json *la = cget(j, "linear_attn_config", NULL);
    if (la && la->type != MOE_JSON_OBJ) la = NULL;
    g->kda_heads = la ? cint(&c, la, "num_heads", NULL, -1, 1, 4096) : 0;
    g->kda_head_dim = la ? cint(&c, la, "head_dim", NULL, -1, 1, 512) : 0;
    g->conv_kernel = la ? cint(&c, la, "short_conv_kernel_size", NULL, 4, 1, KDA_CONV_MAX) : 0;
    const moe__json *lb = la ? cget(la, "gate_lower_bound", NULL) : NULL;
    g->kda_gate_bounded = lb != NULL;
    g->kda_gate_lower_bound = lb ? cfloat(&c, la, "gate_lower_bound", 0, -1e4, -1e-6) : 0.0f;
    g->kda_full_rank_gate = la ? cint(&c, la, "use_full_rank_gate", NULL, 0, 0, 1) : 0;

    g->mla_heads = cint(&c, j, "num_attention_heads", NULL, 1, 1, 4096);
    g->q_lora_rank = cint(&c, j, "q_lora_rank", NULL, 0, 0, 1 << 16);
    g->kv_lora_rank = cint(&c, j, "kv_lora_rank", NULL, 1, 1, 1 << 16);
    g->qk_nope_dim = cint(&c, j, "qk_nope_head_dim", NULL, 0, 0, 4096);
    g->qk_rope_dim = cint(&c, j, "qk_rope_head_dim", NULL, 0, 0, 4096);
    g->v_head_dim = cint(&c, j, "v_head_dim", NULL, 1, 1, 4096);
    g->mla_output_gate = cint(&c, j, "mla_use_output_gate", NULL, 0, 0, 1);
    if (!cint(&c, j, "mla_use_nope", NULL, 1, 0, 1) && !c.st)
        c.st = fail(err, errlen, MOE_ERR_UNSUPPORTED,
                    "config.json: mla_use_nope false (rotary MLA) is not supported");

    g->n_experts = cint(&c, j, "num_experts", "n_routed_experts", 0, 0, 1 << 16);
    g->intermediate_size = cint(&c, j, "intermediate_size", NULL, 0, 0, 1 << 22);
    if (g->n_experts) {
        g->n_active = cint(&c, j, "num_experts_per_token", "num_experts_per_tok", -1, 1, g->n_experts);
        g->n_shared = cint(&c, j, "num_shared_experts", "n_shared_experts", 0, 0, 64);
        g->moe_intermediate_size = cint(&c, j, "moe_intermediate_size", NULL, -1, 1, 1 << 22);
        if (cstr_is(j, "moe_router_activation_func", "sigmoid", "sigmoid")) g->router_softmax = 0;
        else if (cstr_is(j, "moe_router_activation_func", "softmax", NULL)) g->router_softmax = 1;
        else if (!c.st) c.st = fail(err, errlen, MOE_ERR_UNSUPPORTED, "config.json: moe_router_activation_func must be sigmoid or softmax");
        g->renormalize = cint(&c, j, "moe_renormalize", "norm_topk_prob", 1, 0, 1);
        g->routed_scaling_factor = cfloat(&c, j, "routed_scaling_factor", 1.0, -1e6, 1e6);
        g->n_groups = cint(&c, j, "num_expert_group", "n_group", 1, 1, g->n_experts);
        g->topk_groups = cint(&c, j, "topk_group", NULL, 1, 1, g->n_groups);
        if (g->n_experts % g->n_groups && !c.st)
            c.st = fail(err, errlen, MOE_ERR_FORMAT, "config.json: num_experts %% num_expert_group != 0");
        g->first_k_dense = cint(&c, j, "first_k_dense_replace", NULL, 0, 0, 1 << 20);
        g->moe_layer_freq = cint(&c, j, "moe_layer_freq", NULL, 1, 1, 1 << 20);
        g->latent_dim = cint(&c, j, "routed_expert_hidden_size", NULL, 0, 0, 1 << 16);
        g->latent_norm = cint(&c, j, "latent_moe_use_norm", NULL, 0, 0, 1);
        /* grouped selection keeps whole groups; it must still be able to fill k slots */
        if (g->n_groups > 1 && g->n_groups > g->topk_groups &&
            (int64_t)g->topk_groups * (g->n_experts / g->n_groups) < g->n_active && !c.st)
            c.st = fail(err, errlen, MOE_ERR_FORMAT, "config.json: topk_group groups hold fewer than num_experts_per_token experts");
    }
    g->attn_res_block = cint(&c, j, "attn_res_block_size", NULL, 0, 0, 1 << 20);
    if (c.st) return c.st;

    /* layer kinds: KDA iff (i+1) in kda_layers; MoE per first_k_dense_replace / moe_layer_freq */
    int L = g->n_layers;
    m->layer_kind = xcalloc((size_t)L, 1);
    m->layer_moe = xcalloc((size_t)L, 1);
    if (!m->layer_kind || !m->layer_moe) return MOE_ERR_NOMEM;
    for (int i = 0; i < L; i++) m->layer_kind[i] = MOE_LAYER_MLA;
    const moe__json *kl = la ? cget(la, "kda_layers", NULL) : NULL, *fl = la ? cget(la, "full_attn_layers", NULL) : NULL;
    if (la && (!kl || kl->type != MOE_JSON_ARR))
        return fail(err, errlen, MOE_ERR_FORMAT, "config.json: linear_attn_config.kda_layers missing");
    for (const moe__json *e = kl ? kl->child : NULL; e; e = e->next) {
        int64_t v;
        if (!json_int(e, 1, L, &v))
            return fail(err, errlen, MOE_ERR_FORMAT, "config.json: kda_layers entry out of range [1, %d]", L);
        m->layer_kind[v - 1] = MOE_LAYER_KDA;
    }
    if (fl && fl->type == MOE_JSON_ARR)
        for (const moe__json *e = fl->child; e; e = e->next) {
            int64_t v;
            if (!json_int(e, 1, L, &v) || m->layer_kind[v - 1] == MOE_LAYER_KDA)
                return fail(err, errlen, MOE_ERR_FORMAT,
                            "config.json: full_attn_layers entry out of range or also in kda_layers");
        }
    int any_dense = 0, any_mla = 0;
    for (int i = 0; i < L; i++) {
        m->layer_moe[i] = g->n_experts && i >= g->first_k_dense && i % g->moe_layer_freq == 0;
        any_dense |= !m->layer_moe[i];
        any_mla |= m->layer_kind[i] == MOE_LAYER_MLA;
    }
    if (any_dense && g->intermediate_size < 1)
        return fail(err, errlen, MOE_ERR_FORMAT, "config.json: intermediate_size missing for dense layers");
    if (any_mla && g->qk_nope_dim + g->qk_rope_dim < 1)
        return fail(err, errlen, MOE_ERR_FORMAT, "config.json: MLA query/key head size is 0");
    g->layer_kind = m->layer_kind;
    g->layer_moe = m->layer_moe;
    return MOE_OK;
}

/* ==== HF <-> GGUF tensor names ===============================================================
 * llama.cpp's names for its kimi-linear architecture, and for K3's extra tensors the names of
 * its Kimi-K3 support (AttnRes, latent MoE, gates): docs/formats.md lists them. Experts are stored merged
 * per layer (ffn_{gate,up,down}_exps, [E, out, in]) and handled by the binder. */

static const char *const name_map[][2] = {
    {"input_layernorm.weight", "attn_norm.weight"},
    {"post_attention_layernorm.weight", "ffn_norm.weight"},
    {"self_attention_res_norm.weight", "attn_res_norm.weight"},
    {"self_attention_res_proj.weight", "attn_res_proj.weight"},
    {"mlp_res_norm.weight", "ffn_res_norm.weight"},
    {"mlp_res_proj.weight", "ffn_res_proj.weight"},
    /* llama.cpp's K3 converter stores each AttnRes site's norm weight times its projection row as
     * one score vector; "<site>_score" names it here (no HF tensor has that name: bind_res) */
    {"self_attention_res_score.weight", "attn_res_score.weight"},
    {"mlp_res_score.weight", "ffn_res_score.weight"},
    {"self_attn.q_proj.weight", "attn_q.weight"},
    {"self_attn.k_proj.weight", "attn_k.weight"},
    {"self_attn.v_proj.weight", "attn_v.weight"},
    {"self_attn.q_conv1d.weight", "ssm_conv1d_q.weight"},
    {"self_attn.k_conv1d.weight", "ssm_conv1d_k.weight"},
    {"self_attn.v_conv1d.weight", "ssm_conv1d_v.weight"},
    {"self_attn.f_a_proj.weight", "ssm_f_a.weight"},
    {"self_attn.f_b_proj.weight", "ssm_f_b.weight"},
    {"self_attn.b_proj.weight", "ssm_beta.weight"},
    {"self_attn.A_log", "ssm_a"},
    {"self_attn.dt_bias", "ssm_dt.bias"},
    {"self_attn.g_a_proj.weight", "ssm_g_a.weight"},
    {"self_attn.g_b_proj.weight", "ssm_g_b.weight"},
    {"self_attn.g_proj.weight", "attn_gate.weight"},
    {"self_attn.o_norm.weight", "ssm_norm.weight"},
    {"self_attn.o_proj.weight", "attn_output.weight"},
    {"self_attn.q_a_proj.weight", "attn_q_a.weight"},
    {"self_attn.q_a_layernorm.weight", "attn_q_a_norm.weight"},
    {"self_attn.q_b_proj.weight", "attn_q_b.weight"},
    {"self_attn.kv_a_proj_with_mqa.weight", "attn_kv_a_mqa.weight"},
    {"self_attn.kv_a_layernorm.weight", "attn_kv_a_norm.weight"},
    {"self_attn.kv_b_proj.weight", "attn_kv_b.weight"},
    {"mlp.gate_proj.weight", "ffn_gate.weight"},
    {"mlp.up_proj.weight", "ffn_up.weight"},
    {"mlp.down_proj.weight", "ffn_down.weight"},
    {"block_sparse_moe.gate.weight", "ffn_gate_inp.weight"},
    {"block_sparse_moe.gate.e_score_correction_bias", "exp_probs_b.bias"},
    {"block_sparse_moe.shared_experts.gate_proj.weight", "ffn_gate_shexp.weight"},
    {"block_sparse_moe.shared_experts.up_proj.weight", "ffn_up_shexp.weight"},
    {"block_sparse_moe.shared_experts.down_proj.weight", "ffn_down_shexp.weight"},
    {"block_sparse_moe.routed_expert_down_proj.weight", "ffn_latent_down.weight"},
    {"block_sparse_moe.routed_expert_up_proj.weight", "ffn_latent_up.weight"},
    {"block_sparse_moe.routed_expert_norm.weight", "ffn_latent_norm.weight"},
};

static const char *const global_map[][2] = {
    {"model.embed_tokens.weight", "token_embd.weight"},
    {"lm_head.weight", "output.weight"},
    {"model.norm.weight", "output_norm.weight"},
    {"model.output_attn_res_norm.weight", "output_res_norm.weight"},
    {"model.output_attn_res_proj.weight", "output_res_proj.weight"},
    {"model.output_attn_res_score.weight", "output_res_score.weight"},
};

/* The names llama.cpp's Kimi-K3 converter gives some of those tensors (docs/spec/GGUF-KIMI.md section
 * 2), tried where the name above is absent: its full-rank KDA gate, its latent MoE projections. */
static const char *const llama_k3_map[][2] = {
    {"self_attn.g_proj.weight", "ssm_g.weight"},
    {"block_sparse_moe.routed_expert_down_proj.weight", "ffn_routed_down.weight"},
    {"block_sparse_moe.routed_expert_up_proj.weight", "ffn_routed_up.weight"},
    {"block_sparse_moe.routed_expert_norm.weight", "ffn_routed_norm.weight"},
};

/* the GGUF name of layer tensor hf ("model.layers.N.<suffix>") by the suffix table map[n_map];
 * 0 when hf is not a layer tensor or its suffix is not in the table */
static int layer_name(const char *const (*map)[2], size_t n_map, const char *hf, char *out, size_t n) {
    int layer, used = 0;
    if (sscanf(hf, "model.layers.%d.%n", &layer, &used) != 1 || !used) return 0;
    for (size_t i = 0; i < n_map; i++)
        if (!strcmp(hf + used, map[i][0])) return snprintf(out, n, "blk.%d.%s", layer, map[i][1]) < (int)n;
    return 0;
}

/* the llama.cpp Kimi-K3 name of HF tensor hf where it differs from moe__hf_to_gguf's; 0 if none */
static int hf_to_llama_k3(const char *hf, char *out, size_t n) {
    return layer_name(llama_k3_map, sizeof llama_k3_map / sizeof *llama_k3_map, hf, out, n);
}

int moe__hf_to_gguf(const char *hf, char *out, size_t n, int llama_k3) {
    if (llama_k3 && hf_to_llama_k3(hf, out, n)) return 1;
    for (size_t i = 0; i < sizeof global_map / sizeof *global_map; i++)
        if (!strcmp(hf, global_map[i][0])) return snprintf(out, n, "%s", global_map[i][1]) < (int)n;
    return layer_name(name_map, sizeof name_map / sizeof *name_map, hf, out, n);
}

/* GGUF metadata -> the HF config.json it stands for, then parsed and validated by parse_config:
 * one set of rules for both formats. */
/* an integer key's value (def where absent; -1 for another type, out of every range) */
static int64_t gguf_int(const moe__st_file *f, const char *key, int64_t def) {
    const moe__gguf_kv *kv = moe__gguf_get(f, key);
    if (!kv) return def;
    switch (kv->type) {
    case MOE_GGUF_U8: case MOE_GGUF_BOOL: return *(const uint8_t *)kv->data;
    case MOE_GGUF_I8: return *(const int8_t *)kv->data;
    case MOE_GGUF_U16: { uint16_t v; memcpy(&v, kv->data, 2); return v; }
    case MOE_GGUF_I16: { int16_t v; memcpy(&v, kv->data, 2); return v; }
    case MOE_GGUF_U32: { uint32_t v; memcpy(&v, kv->data, 4); return v; }
    case MOE_GGUF_I32: { int32_t v; memcpy(&v, kv->data, 4); return v; }
    case MOE_GGUF_U64: { uint64_t v; memcpy(&v, kv->data, 8); return v > INT32_MAX ? -1 : (int64_t)v; }
    case MOE_GGUF_I64: { int64_t v; memcpy(&v, kv->data, 8); return v; }
    default: return -1; /* wrong type: out of every range, so validation names it */
    }
}

/* A GGUF string value as a NUL-terminated copy in buf[0..cap); "" when the key is absent, not a
 * string, or too long. */
static const char *gguf_str(const moe__st_file *f, const char *key, char *buf, size_t cap) {
    const moe__gguf_kv *kv = moe__gguf_get(f, key);
    buf[0] = 0;
    if (kv && kv->type == MOE_GGUF_STRING && kv->n < cap) memcpy(buf, kv->data, kv->n), buf[kv->n] = 0;
    return buf;
}

static int64_t gk_int(const moe__st_file *f, const char *arch, const char *suffix, int64_t def) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    return gguf_int(f, key, def);
}

static double gk_float(const moe__st_file *f, const char *arch, const char *suffix, double def) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    const moe__gguf_kv *kv = moe__gguf_get(f, key);
    if (!kv) return def;
    if (kv->type == MOE_GGUF_F32) { float v; memcpy(&v, kv->data, 4); return v; }
    if (kv->type == MOE_GGUF_F64) { double v; memcpy(&v, kv->data, 8); return v; }
    return (double)gk_int(f, arch, suffix, (int64_t)def);
}

/* the tensor of that name in any of the n files (the parts of a split GGUF) */
static const moe__st_tensor *gguf_tensor(const moe__st_file *files, int n, const char *fmt, int i) {
    char name[96];
    snprintf(name, sizeof name, fmt, i);
    for (int p = 0; p < n; p++)
        for (int k = 0; k < files[p].n_tensors; k++)
            if (!strcmp(files[p].tensors[k].name, name)) return &files[p].tensors[k];
    return NULL;
}

typedef struct {
    char *s;
    size_t n, cap;
    int oom; /* an append failed: the text is incomplete */
} sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...) {
    va_list ap;
    if (b->oom) return;
    for (;;) {
        va_start(ap, fmt);
        int k = vsnprintf(b->s ? b->s + b->n : NULL, b->s ? b->cap - b->n : 0, fmt, ap);
        va_end(ap);
        if (k < 0) return;
        if (b->s && b->n + (size_t)k < b->cap) { b->n += (size_t)k; return; }
        size_t cap = (b->cap + (size_t)k + 1) * 2;
        char *p = realloc(b->s, cap);
        if (!p) { free(b->s); b->s = NULL; b->cap = b->n = 0; b->oom = 1; return; }
        b->s = p, b->cap = cap;
    }
}

/* the metadata of files[0]; the tensors of all n files */
static moe_status gguf_config_json(const moe__st_file *files, int nf, moe__json **out, char *err, size_t errlen) {
    const moe__st_file *f = &files[0];
    char arch[32];
    if (!gguf_str(f, "general.architecture", arch, sizeof arch)[0])
        return fail(err, errlen, MOE_ERR_FORMAT, "%s: general.architecture missing", f->path);
    if (strcmp(arch, "kimi-linear") && strcmp(arch, "kimi-k3"))
        return fail(err, errlen, MOE_ERR_UNSUPPORTED, "%s: architecture '%s' (kimi-linear and kimi-k3 are supported)", f->path, arch);
    const int64_t L = gk_int(f, arch, "block_count", -1);
    if (L < 1 || L > 4096) return fail(err, errlen, MOE_ERR_FORMAT, "%s: %s.block_count missing or absurd", f->path, arch);
    char key[96];
    snprintf(key, sizeof key, "%s.attention.head_count_kv", arch);
    const moe__gguf_kv *hkv = moe__gguf_get(f, key);
    const moe__st_tensor *emb = gguf_tensor(files, nf, "token_embd.weight", 0);
    int64_t vocab = gk_int(f, arch, "vocab_size", emb && emb->ndim == 2 ? emb->shape[0] : -1);
    int first_kda = -1, first_mla = -1;
    sbuf b = {0};
    sb_printf(&b, "{\"vocab_size\": %lld, \"hidden_size\": %lld, \"num_hidden_layers\": %lld, \"rms_norm_eps\": %.9g,",
              (long long)vocab, (long long)gk_int(f, arch, "embedding_length", -1), (long long)L,
              gk_float(f, arch, "attention.layer_norm_rms_epsilon", -1));
    /* llama.cpp's Kimi-K3 keys first (docs/spec/GGUF-KIMI.md 1.1), then the ones moe-convert wrote
     * before it wrote llama.cpp's */
    double situ = gk_float(f, arch, "activation.situ_beta", gk_float(f, arch, "situ_beta", 0));
    sb_printf(&b, "\"hidden_act\": \"%s\", \"activation_situ_beta\": %.9g, \"activation_situ_linear_beta\": %.9g,",
              situ > 0 ? "situ" : "silu", situ, gk_float(f, arch, "activation.situ_linear_beta", gk_float(f, arch, "situ_linear_beta", 0)));
    sb_printf(&b, "\"linear_attn_config\": {\"kda_layers\": [");
    for (int64_t i = 0, k = 0; i < L; i++) {
        int64_t kvh = 1;
        if (hkv && hkv->type == MOE_GGUF_ARRAY && hkv->etype == MOE_GGUF_U32 && (int64_t)hkv->n == L) {
            uint32_t v;
            memcpy(&v, hkv->data + 4 * i, 4);
            kvh = v;
        } else if (hkv && hkv->type == MOE_GGUF_ARRAY && hkv->etype == MOE_GGUF_I32 && (int64_t)hkv->n == L) {
            int32_t v;
            memcpy(&v, hkv->data + 4 * i, 4);
            kvh = v;
        }
        if (kvh == 0) {
            sb_printf(&b, "%s%lld", k++ ? "," : "", (long long)(i + 1));
            if (first_kda < 0) first_kda = (int)i;
        } else if (first_mla < 0) {
            first_mla = (int)i;
        }
    }
    const int64_t H = gk_int(f, arch, "attention.head_count", -1);
    /* KDA heads: the key, else the rows of the first KDA layer's beta projection (llama.cpp's K3
     * loader takes attention.head_count for both mixers, so its files of a model whose KDA and MLA
     * head counts differ carry the count only in that shape), else the MLA count */
    const moe__st_tensor *beta = first_kda >= 0 ? gguf_tensor(files, nf, "blk.%d.ssm_beta.weight", first_kda) : NULL;
    const int64_t kda_heads = gk_int(f, arch, "kda.head_count", beta && beta->ndim == 2 ? beta->shape[0] : H);
    sb_printf(&b, "], \"num_heads\": %lld, \"head_dim\": %lld, \"short_conv_kernel_size\": %lld",
              (long long)kda_heads, (long long)gk_int(f, arch, "kda.head_dim", first_kda < 0 ? 1 : -1),
              (long long)gk_int(f, arch, "ssm.conv_kernel", 4));
    double lb = gk_float(f, arch, "kda.gate_lower_bound", 0);
    if (lb != 0) sb_printf(&b, ", \"gate_lower_bound\": %.9g", lb);
    const int full_gate = first_kda >= 0 && (gguf_tensor(files, nf, "blk.%d.ssm_g.weight", first_kda) ||
                                             gguf_tensor(files, nf, "blk.%d.attn_gate.weight", first_kda));
    sb_printf(&b, ", \"use_full_rank_gate\": %s},", full_gate ? "true" : "false");
    const int64_t dr = gk_int(f, arch, "rope.dimension_count", 0);
    sb_printf(&b, "\"num_attention_heads\": %lld, \"q_lora_rank\": %lld, \"kv_lora_rank\": %lld, \"qk_nope_head_dim\": %lld, "
                  "\"qk_rope_head_dim\": %lld, \"v_head_dim\": %lld, \"mla_use_output_gate\": %s,",
              (long long)H, (long long)gk_int(f, arch, "attention.q_lora_rank", 0), (long long)gk_int(f, arch, "attention.kv_lora_rank", 1),
              (long long)(gk_int(f, arch, "attention.key_length_mla", dr + 1) - dr), (long long)dr,
              (long long)gk_int(f, arch, "attention.value_length_mla", 1),
              first_mla >= 0 && gguf_tensor(files, nf, "blk.%d.attn_gate.weight", first_mla) ? "true" : "false");
    const int64_t E = gk_int(f, arch, "expert_count", 0), gating = gk_int(f, arch, "expert_gating_func", 2);
    /* groups: llama.cpp uses expert_group_used_count only with expert_group_count, which its K3
     * converter does not write (K3 routes without groups): without the count, no groups */
    const int64_t groups = gk_int(f, arch, "expert_group_count", 1), groups_used = groups == 1 ? 1 : gk_int(f, arch, "expert_group_used_count", 1);
    sb_printf(&b, "\"intermediate_size\": %lld, \"num_experts\": %lld, \"num_experts_per_token\": %lld, \"num_shared_experts\": %lld, "
                  "\"moe_intermediate_size\": %lld, \"moe_router_activation_func\": \"%s\", \"moe_renormalize\": %s, "
                  "\"routed_scaling_factor\": %.9g, \"num_expert_group\": %lld, \"topk_group\": %lld, \"first_k_dense_replace\": %lld, "
                  "\"moe_layer_freq\": 1,",
              (long long)gk_int(f, arch, "feed_forward_length", 0), (long long)E, (long long)gk_int(f, arch, "expert_used_count", -1),
              (long long)gk_int(f, arch, "expert_shared_count", 0), (long long)gk_int(f, arch, "expert_feed_forward_length", -1),
              gating == 1 ? "softmax" : gating == 2 ? "sigmoid" : "invalid", gk_int(f, arch, "expert_weights_norm", 1) ? "true" : "false",
              gk_float(f, arch, "expert_weights_scale", 1.0), (long long)groups, (long long)groups_used,
              (long long)gk_int(f, arch, "leading_dense_block_count", 0));
    const int64_t lat = gk_int(f, arch, "expert_latent_length", gk_int(f, arch, "moe_latent_size", 0));
    const int first_moe = (int)gk_int(f, arch, "leading_dense_block_count", 0);
    if (lat) sb_printf(&b, "\"routed_expert_hidden_size\": %lld, \"latent_moe_use_norm\": %s,", (long long)lat,
                       gguf_tensor(files, nf, "blk.%d.ffn_routed_norm.weight", first_moe) || gguf_tensor(files, nf, "blk.%d.ffn_latent_norm.weight", first_moe)
                           ? "true" : "false");
    const int64_t B = gk_int(f, arch, "attn_res.block_size", gk_int(f, arch, "attn_res_block_size", 0));
    if (B) sb_printf(&b, "\"attn_res_block_size\": %lld,", (long long)B);
    const moe__gguf_kv *bos = moe__gguf_get(f, "tokenizer.ggml.bos_token_id"), *eos = moe__gguf_get(f, "tokenizer.ggml.eos_token_id");
    uint32_t bv = 0, ev = 0;
    if (bos && bos->type == MOE_GGUF_U32) memcpy(&bv, bos->data, 4);
    if (eos && eos->type == MOE_GGUF_U32) memcpy(&ev, eos->data, 4);
    /* never tied: the Kimi models' LM head is a matrix of its own (docs/spec/MODEL.md section 2), so a
     * file without output.weight is refused by name rather than run on the embedding */
    sb_printf(&b, "\"bos_token_id\": %d, \"eos_token_id\": %d, \"tie_word_embeddings\": false}", bos ? (int)bv : -1, eos ? (int)ev : -1);
    if (!b.s) return MOE_ERR_NOMEM;
    char e2[200];
    moe_status st = moe__json_parse(b.s, b.n, out, e2, sizeof e2);
    free(b.s);
    if (st) return fail(err, errlen, MOE_ERR_FORMAT, "%s: metadata does not form a valid config (%s)", f->path, e2);
    return MOE_OK;
}

/* Parses and validates a config.json text the way moe_model_open does; with out non-NULL the
 * result is copied there, its layer arrays into kinds/moe ([4096] each, the layer limit). */
moe_status moe__config_parse(const char *text, size_t len, moe_config *out, unsigned char *kinds, unsigned char *moe, char *err,
                             size_t errlen) {
    moe__json *root;
    moe_status st = moe__json_parse(text, len, &root, err, errlen);
    if (st) return st;
    moe_model *m = xcalloc(1, sizeof *m);
    if (!m) st = MOE_ERR_NOMEM;
    else if (root->type != MOE_JSON_OBJ) st = fail(err, errlen, MOE_ERR_FORMAT, "config.json: not an object");
    else st = parse_config(m, root, err, errlen);
    if (!st && out) {
        *out = m->cfg;
        memcpy(kinds, m->layer_kind, (size_t)m->cfg.n_layers);
        memcpy(moe, m->layer_moe, (size_t)m->cfg.n_layers);
        out->layer_kind = kinds, out->layer_moe = moe;
    }
    if (m) free(m->layer_kind), free(m->layer_moe), free(m);
    moe__json_free(root);
    return st;
}

moe_status moe__config_check(const char *text, size_t len, char *err, size_t errlen) {
    return moe__config_parse(text, len, NULL, NULL, NULL, err, errlen);
}

/* ==== model binding ===========================================================================
 * All tensors of all files go into one hash table by full name; the model then looks up every
 * tensor it needs (prefix + spec name), checks dtype, shape and alignment against the config,
 * and keeps either a pointer into the mapping (matrices) or an f32 copy (small vectors). */

/* Registers memory the model frees at close; 0 on success. */
static int own(moe_model *m, void *p) {
    if (m->n_owned == m->cap_owned) {
        int cap = m->cap_owned ? 2 * m->cap_owned : 256;
        void **q = realloc(m->owned, sizeof *q * (size_t)cap);
        if (!q) return 1;
        m->owned = q, m->cap_owned = cap;
    }
    m->owned[m->n_owned++] = p;
    return 0;
}

static uint64_t fnv1a(const char *s) {
    uint64_t h = 1469598103934665603ull;
    while (*s) h = (h ^ (unsigned char)*s++) * 1099511628211ull;
    return h;
}

static const tensor_ref *lookup(const moe_model *m, const char *name) {
    size_t mask = m->table_cap - 1;
    for (size_t i = fnv1a(name) & mask;; i = (i + 1) & mask) {
        if (!m->table[i].t) return NULL;
        if (!strcmp(m->table[i].t->name, name)) return &m->table[i];
    }
}

static moe_status build_table(moe_model *m, char *err, size_t errlen) {
    size_t n = 0;
    for (int f = 0; f < m->n_files; f++) n += (size_t)m->files[f].n_tensors;
    m->table_cap = 16;
    while (m->table_cap < 2 * n + 16) m->table_cap *= 2;
    if (!(m->table = xcalloc(m->table_cap, sizeof *m->table))) return MOE_ERR_NOMEM;
    for (int f = 0; f < m->n_files; f++)
        for (int i = 0; i < m->files[f].n_tensors; i++) {
            const moe__st_tensor *t = &m->files[f].tensors[i];
            const tensor_ref *dup = lookup(m, t->name);
            if (dup)
                return fail(err, errlen, MOE_ERR_FORMAT, "tensor %s appears twice (%s and %s)",
                            t->name, m->files[dup->file].path, m->files[f].path);
            size_t mask = m->table_cap - 1, k = fnv1a(t->name) & mask;
            while (m->table[k].t) k = (k + 1) & mask;
            m->table[k].t = t;
            m->table[k].file = f;
        }
    return MOE_OK;
}

typedef struct {
    moe_model *m;
    char *err;
    size_t errlen;
    moe_status st;
} binder;

/* the name a tensor has in the files: prefix + HF name, or its GGUF name */
static void bname(const binder *b, const char *name, char *full, size_t n) {
    if (!b->m->gguf) snprintf(full, n, "%s%s", b->m->prefix, name);
    else if (!moe__hf_to_gguf(name, full, n, 0)) snprintf(full, n, "(no GGUF name for %s)", name);
}

static const tensor_ref *bfind(binder *b, const char *name) {
    char full[340];
    bname(b, name, full, sizeof full);
    const tensor_ref *r = lookup(b->m, full);
    if (!r && b->m->gguf && hf_to_llama_k3(name, full, sizeof full)) r = lookup(b->m, full);
    return r;
}

static const char *bfile(binder *b, const tensor_ref *r) { return b->m->files[r->file].path; }

static int aligned_for(const moe__st_tensor *t) {
    size_t a = t->type == MOE_T_F32 || t->type == MOE_T_I32 ? 4 : t->type == MOE_T_U8 ? 1 : 2;
    return ((uintptr_t)t->data % a) == 0;
}

/* A matrix [rows, cols]: "X.weight" as F32/F16/BF16, or MXFP4 as X.weight_packed + X.weight_scale
 * (decided by the tensors present, never by the quantization config's regexes). */
static void bind_mat(binder *b, moe__weight *w, int64_t rows, int64_t cols, const char *fmt, ...) {
    if (b->st) return;
    char base[256], name[300];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(base, sizeof base, fmt, ap);
    va_end(ap);
    snprintf(name, sizeof name, "%s.weight", base);
    const tensor_ref *r = bfind(b, name);
    if (r) {
        const moe__st_tensor *t = r->t;
        if (t->type != MOE_T_F32 && t->type != MOE_T_F16 && t->type != MOE_T_BF16 && !moe__is_quant(t->type) &&
            t->type != MOE_T_MXFP4_GGML) {
            b->st = fail(b->err, b->errlen, MOE_ERR_UNSUPPORTED,
                         "%s: tensor %s: weight type not supported (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS, MXFP4)", bfile(b, r), t->name);
            return;
        }
        if (t->ndim != 2 || t->shape[0] != rows || t->shape[1] != cols) {
            b->st = fail(b->err, b->errlen, MOE_ERR_FORMAT,
                         "%s: tensor %s: shape does not match the config (want [%lld, %lld])",
                         bfile(b, r), t->name, (long long)rows, (long long)cols);
            return;
        }
        if (!aligned_for(t)) {
            b->st = fail(b->err, b->errlen, MOE_ERR_FORMAT, "%s: tensor %s: misaligned data", bfile(b, r), t->name);
            return;
        }
        *w = (moe__weight){t->type, rows, cols, t->data, NULL};
        return;
    }
    char pn[300], sn[300];
    snprintf(pn, sizeof pn, "%s.weight_packed", base);
    snprintf(sn, sizeof sn, "%s.weight_scale", base);
    const tensor_ref *rp = bfind(b, pn), *rs = bfind(b, sn);
    if (!rp || !rs) {
        char full[340];
        bname(b, name, full, sizeof full);
        b->st = fail(b->err, b->errlen, MOE_ERR_FORMAT, "%s: missing tensor %s", b->m->path, full);
        return;
    }
    const moe__st_tensor *p = rp->t, *s = rs->t;
    if (p->type != MOE_T_U8 || s->type != MOE_T_U8 || cols % 32 || p->ndim != 2 || s->ndim != 2 ||
        p->shape[0] != rows || p->shape[1] != cols / 2 || s->shape[0] != rows ||
        s->shape[1] != cols / 32) {
        b->st = fail(b->err, b->errlen, MOE_ERR_FORMAT,
                     "%s: MXFP4 tensor %s: want U8 weight_packed [%lld, %lld] and weight_scale "
                     "[%lld, %lld]", bfile(b, rp), pn, (long long)rows, (long long)cols / 2,
                     (long long)rows, (long long)cols / 32);
        return;
    }
    *w = (moe__weight){MOE_T_MXFP4, rows, cols, p->data, s->data};
}

/* a short convolution's weights as bound, [channel][tap], reordered to [tap][channel] for
 * moe__dwconv (w is freed); NULL (and b's error) when w is NULL or there is no memory */
static float *conv_by_tap(binder *b, float *w, int64_t channels, int64_t taps) {
    float *t = w ? malloc(sizeof(float) * (size_t)(channels * taps)) : NULL;
    if (w && !t) b->st = MOE_ERR_NOMEM;
    for (int64_t c = 0; t && c < channels; c++)
        for (int64_t j = 0; j < taps; j++) t[j * channels + c] = w[c * taps + j];
    free(w);
    return t;
}

/* A small vector of n values (any shape with n elements, or >= n with `pad_zero` allowing a zero
 * tail, 2: any tail), kept as an f32 copy. */
static float *bind_vec(binder *b, int64_t n, int pad_zero, const char *fmt, ...) {
    if (b->st) return NULL;
    char name[300];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    const tensor_ref *r = bfind(b, name);
    if (!r) {
        char full[340];
        bname(b, name, full, sizeof full);
        b->st = fail(b->err, b->errlen, MOE_ERR_FORMAT, "%s: missing tensor %s", b->m->path, full);
        return NULL;
    }
    const moe__st_tensor *t = r->t;
    int64_t count = 1;
    for (int i = 0; i < t->ndim; i++) count *= t->shape[i]; /* checked at parse */
    if ((t->type != MOE_T_F32 && t->type != MOE_T_F16 && t->type != MOE_T_BF16) ||
        (pad_zero ? count < n : count != n) || !aligned_for(t)) {
        b->st = fail(b->err, b->errlen, MOE_ERR_FORMAT,
                     "%s: tensor %s: want %lld values of F32, F16 or BF16; found %lld values of "
                     "another dtype, a different count, or misaligned data",
                     bfile(b, r), t->name, (long long)n, (long long)count);
        return NULL;
    }
    float *v = malloc((size_t)count * sizeof *v);
    if (!v) { b->st = MOE_ERR_NOMEM; return NULL; }
    moe__row_to_f32(t->type, t->data, NULL, v, count);
    if (has_nonfinite(v, (size_t)count)) {
        free(v);
        b->st = fail(b->err, b->errlen, MOE_ERR_NUMERIC, "%s: tensor %s holds a NaN or an infinity", bfile(b, r), t->name);
        return NULL;
    }
    for (int64_t i = n; pad_zero != 2 && i < count; i++)
        if (v[i] != 0.0f) {
            free(v);
            b->st = fail(b->err, b->errlen, MOE_ERR_FORMAT, "%s: tensor %s: non-zero padding past %lld values",
                         bfile(b, r), t->name, (long long)n);
            return NULL;
        }
    return v;
}

/* AttnRes pseudo-query: norm weight times projection row (bf16*bf16 is exact in f32), or the
 * product llama.cpp's K3 converter stored as one score vector */
static float *bind_res(binder *b, int d, const char *pre) {
    char score[128];
    snprintf(score, sizeof score, "%s_score.weight", pre);
    if (b->m->gguf && bfind(b, score)) return bind_vec(b, d, 0, "%s", score);
    float *nw = bind_vec(b, d, 0, "%s_norm.weight", pre), *pw = bind_vec(b, d, 0, "%s_proj.weight", pre);
    if (nw && pw)
        for (int i = 0; i < d; i++) nw[i] *= pw[i];
    free(pw);
    return nw;
}

/* GGUF: experts of a layer are three [E, out, in] tensors; expert e is the e-th slab */
static void bind_merged_experts(binder *b, layer *L, int li, int64_t E, int64_t Ie, int64_t de) {
    static const char *names[3] = {"ffn_gate_exps", "ffn_down_exps", "ffn_up_exps"};
    for (int w = 0; w < 3 && !b->st; w++) {
        char nm[96];
        snprintf(nm, sizeof nm, "blk.%d.%s.weight", li, names[w]);
        const tensor_ref *r = lookup(b->m, nm);
        const int64_t rows = w == 1 ? de : Ie, cols = w == 1 ? Ie : de;
        if (!r) { b->st = fail(b->err, b->errlen, MOE_ERR_FORMAT, "%s: missing tensor %s", b->m->path, nm); return; }
        const moe__st_tensor *t = r->t;
        if (t->ndim != 3 || t->shape[0] != E || t->shape[1] != rows || t->shape[2] != cols ||
            (t->type != MOE_T_F32 && t->type != MOE_T_F16 && t->type != MOE_T_BF16 && !moe__is_quant(t->type) &&
             t->type != MOE_T_MXFP4_GGML) || !aligned_for(t)) {
            b->st = fail(b->err, b->errlen, MOE_ERR_FORMAT, "%s: tensor %s: want [%lld, %lld, %lld] of a supported type",
                         bfile(b, r), nm, (long long)E, (long long)rows, (long long)cols);
            return;
        }
        const int64_t slab = rows * moe__row_bytes(t->type, cols);
        for (int64_t e = 0; e < E; e++) {
            moe__weight *dst = w == 0 ? &L->experts[e].w1 : w == 1 ? &L->experts[e].w2 : &L->experts[e].w3;
            *dst = (moe__weight){t->type, rows, cols, (const unsigned char *)t->data + e * slab, NULL};
        }
    }
}

/* GGUF files made for llama.cpp's MLA cache split kv_b into attn_k_b [H, r, d_n] (W_UK^T per head)
 * and attn_v_b [H, d_v, r]; rebuild kv_b [H*(d_n+d_v), r] as f32 owned by the model. */
static void bind_split_kv_b(binder *b, layer *L, int li) {
    moe_model *m = b->m;
    const moe_config *c = &m->cfg;
    const int64_t H = c->mla_heads, dn = c->qk_nope_dim, dv = c->v_head_dim, r = c->kv_lora_rank;
    char kn[64], vn[64];
    snprintf(kn, sizeof kn, "blk.%d.attn_k_b.weight", li);
    snprintf(vn, sizeof vn, "blk.%d.attn_v_b.weight", li);
    const tensor_ref *rk = lookup(m, kn), *rv = lookup(m, vn);
    if (!rk || !rv) { b->st = fail(b->err, b->errlen, MOE_ERR_FORMAT, "missing tensor blk.%d.attn_kv_b.weight (or attn_k_b + attn_v_b)", li); return; }
    const moe__st_tensor *k = rk->t, *v = rv->t;
    int ok_types = (k->type == MOE_T_F32 || k->type == MOE_T_F16 || k->type == MOE_T_BF16 || moe__is_quant(k->type)) &&
                   (v->type == MOE_T_F32 || v->type == MOE_T_F16 || v->type == MOE_T_BF16 || moe__is_quant(v->type));
    if (!ok_types || k->ndim != 3 || k->shape[0] != H || k->shape[1] != r || k->shape[2] != dn || v->ndim != 3 ||
        v->shape[0] != H || v->shape[1] != dv || v->shape[2] != r || !aligned_for(k) || !aligned_for(v)) {
        b->st = fail(b->err, b->errlen, MOE_ERR_FORMAT, "%s: attn_k_b/attn_v_b of layer %d: want [%lld, %lld, %lld] and [%lld, %lld, %lld]",
                     bfile(b, rk), li, (long long)H, (long long)r, (long long)dn, (long long)H, (long long)dv, (long long)r);
        return;
    }
    float *kv = malloc(sizeof(float) * (size_t)(H * (dn + dv) * r)), *row = malloc(sizeof(float) * (size_t)(r > dn ? r : dn));
    if (!kv || !row || own(m, kv)) { free(kv); free(row); b->st = MOE_ERR_NOMEM; return; }
    const int64_t krb = moe__row_bytes(k->type, dn), vrb = moe__row_bytes(v->type, r);
    for (int64_t h = 0; h < H; h++) {
        for (int64_t cc = 0; cc < r; cc++) { /* k_b row (h, cc) holds W_UK[h][:, cc] */
            moe__row_to_f32(k->type, (const unsigned char *)k->data + (h * r + cc) * krb, NULL, row, dn);
            for (int64_t i = 0; i < dn; i++) kv[(h * (dn + dv) + i) * r + cc] = row[i];
        }
        for (int64_t j = 0; j < dv; j++)
            moe__row_to_f32(v->type, (const unsigned char *)v->data + (h * dv + j) * vrb, NULL, kv + (h * (dn + dv) + dn + j) * r, r);
    }
    free(row);
    L->kv_b = (moe__weight){MOE_T_F32, H * (dn + dv), r, kv, NULL};
    /* integer kernels take whole 32-value blocks of activations */
    if (!moe__is_quant(k->type) || (dn % 32 == 0 && r % 32 == 0)) {
        L->k_b = (moe__weight){k->type, H * r, dn, k->data, NULL};
        L->v_b = (moe__weight){v->type, H * dv, r, v->data, NULL};
    }
}

static void bind_layer(binder *b, int i) {
    moe_model *m = b->m;
    const moe_config *c = &m->cfg;
    layer *L = &m->layers[i];
    const int d = c->hidden_size;
    char p[64];
    snprintf(p, sizeof p, "model.layers.%d.", i);
    L->kind = m->layer_kind[i];
    L->moe = m->layer_moe[i];
    L->attn_norm = bind_vec(b, d, 0, "%sinput_layernorm.weight", p);
    L->ffn_norm = bind_vec(b, d, 0, "%spost_attention_layernorm.weight", p);
    if (c->attn_res_block) {
        char q[96];
        snprintf(q, sizeof q, "%sself_attention_res", p);
        L->attn_res_w = bind_res(b, d, q);
        snprintf(q, sizeof q, "%smlp_res", p);
        L->mlp_res_w = bind_res(b, d, q);
    }
    if (L->kind == MOE_LAYER_KDA) {
        const int64_t H = c->kda_heads, D = c->kda_head_dim, HD = H * D, W = c->conv_kernel;
        bind_mat(b, &L->q, HD, d, "%sself_attn.q_proj", p);
        bind_mat(b, &L->k, HD, d, "%sself_attn.k_proj", p);
        bind_mat(b, &L->v, HD, d, "%sself_attn.v_proj", p);
        L->q_conv = conv_by_tap(b, bind_vec(b, HD * W, 0, "%sself_attn.q_conv1d.weight", p), HD, W);
        L->k_conv = conv_by_tap(b, bind_vec(b, HD * W, 0, "%sself_attn.k_conv1d.weight", p), HD, W);
        L->v_conv = conv_by_tap(b, bind_vec(b, HD * W, 0, "%sself_attn.v_conv1d.weight", p), HD, W);
        bind_mat(b, &L->f_a, D, d, "%sself_attn.f_a_proj", p);
        bind_mat(b, &L->f_b, HD, D, "%sself_attn.f_b_proj", p);
        /* GGUF stores exp(A_log) (moe-convert's K3) or -exp(A_log) (llama.cpp's converters) as
         * ssm_a: both give |.| = a. llama.cpp's K3 converter keeps the first attention.head_count
         * entries of a zero-padded A_log, so past the KDA heads it may hold -exp(0). */
        L->A_log = bind_vec(b, H, m->gguf ? 2 : 1, "%sself_attn.A_log", p);
        for (int64_t h = 0; m->gguf && L->A_log && h < H; h++) L->A_log[h] = logf(fabsf(L->A_log[h]));
        L->dt_bias = bind_vec(b, HD, 0, "%sself_attn.dt_bias", p);
        bind_mat(b, &L->b, H, d, "%sself_attn.b_proj", p);
        if (c->kda_full_rank_gate) {
            bind_mat(b, &L->g, HD, d, "%sself_attn.g_proj", p);
        } else {
            bind_mat(b, &L->g_a, D, d, "%sself_attn.g_a_proj", p);
            bind_mat(b, &L->g_b, HD, D, "%sself_attn.g_b_proj", p);
        }
        L->o_norm = bind_vec(b, D, 0, "%sself_attn.o_norm.weight", p);
        bind_mat(b, &L->o, d, HD, "%sself_attn.o_proj", p);
    } else {
        const int64_t H = c->mla_heads, dq = c->qk_nope_dim + c->qk_rope_dim, r = c->kv_lora_rank;
        if (c->q_lora_rank) {
            bind_mat(b, &L->q_a, c->q_lora_rank, d, "%sself_attn.q_a_proj", p);
            L->q_a_norm = bind_vec(b, c->q_lora_rank, 0, "%sself_attn.q_a_layernorm.weight", p);
            bind_mat(b, &L->q_b, H * dq, c->q_lora_rank, "%sself_attn.q_b_proj", p);
        } else {
            bind_mat(b, &L->q, H * dq, d, "%sself_attn.q_proj", p);
        }
        bind_mat(b, &L->kv_a, r + c->qk_rope_dim, d, "%sself_attn.kv_a_proj_with_mqa", p);
        L->kv_a_norm = bind_vec(b, r, 0, "%sself_attn.kv_a_layernorm.weight", p);
        char kvb[128];
        snprintf(kvb, sizeof kvb, "%sself_attn.kv_b_proj.weight", p);
        if (m->gguf && !bfind(b, kvb)) bind_split_kv_b(b, L, i);
        else bind_mat(b, &L->kv_b, H * (c->qk_nope_dim + c->v_head_dim), r, "%sself_attn.kv_b_proj", p);
        if (c->mla_output_gate) bind_mat(b, &L->g, H * c->v_head_dim, d, "%sself_attn.g_proj", p);
        bind_mat(b, &L->o, d, H * c->v_head_dim, "%sself_attn.o_proj", p);
    }
    if (!L->moe) {
        bind_mat(b, &L->gate, c->intermediate_size, d, "%smlp.gate_proj", p);
        bind_mat(b, &L->up, c->intermediate_size, d, "%smlp.up_proj", p);
        bind_mat(b, &L->down, d, c->intermediate_size, "%smlp.down_proj", p);
        return;
    }
    const int64_t E = c->n_experts, Ie = c->moe_intermediate_size, de = c->latent_dim ? c->latent_dim : d;
    bind_mat(b, &L->router, E, d, "%sblock_sparse_moe.gate", p);
    L->router_bias = bind_vec(b, E, 0, "%sblock_sparse_moe.gate.e_score_correction_bias", p);
    if (c->latent_dim) {
        bind_mat(b, &L->lat_down, de, d, "%sblock_sparse_moe.routed_expert_down_proj", p);
        bind_mat(b, &L->lat_up, d, de, "%sblock_sparse_moe.routed_expert_up_proj", p);
        if (c->latent_norm) L->lat_norm = bind_vec(b, de, 0, "%sblock_sparse_moe.routed_expert_norm.weight", p);
    }
    if (c->n_shared) {
        int64_t S = (int64_t)c->n_shared * Ie;
        bind_mat(b, &L->gate, S, d, "%sblock_sparse_moe.shared_experts.gate_proj", p);
        bind_mat(b, &L->up, S, d, "%sblock_sparse_moe.shared_experts.up_proj", p);
        bind_mat(b, &L->down, d, S, "%sblock_sparse_moe.shared_experts.down_proj", p);
    }
    if (b->st) return;
    if (!(L->experts = xcalloc((size_t)E, sizeof *L->experts))) { b->st = MOE_ERR_NOMEM; return; }
    if (m->gguf) {
        bind_merged_experts(b, L, i, E, Ie, de);
        return;
    }
    for (int e = 0; e < E && !b->st; e++) {
        bind_mat(b, &L->experts[e].w1, Ie, de, "%sblock_sparse_moe.experts.%d.w1", p, e);
        bind_mat(b, &L->experts[e].w2, de, Ie, "%sblock_sparse_moe.experts.%d.w2", p, e);
        bind_mat(b, &L->experts[e].w3, Ie, de, "%sblock_sparse_moe.experts.%d.w3", p, e);
    }
}

static uint64_t weight_bytes(const moe__weight *w) {
    if (!w->data) return 0;
    uint64_t n = (uint64_t)w->rows * (uint64_t)moe__row_bytes(w->type, w->cols);
    return w->type == MOE_T_MXFP4 ? n + (uint64_t)w->rows * (uint64_t)(w->cols / 32) : n;
}

static uint64_t expert_bytes(const expert *e) {
    return weight_bytes(&e->w1) + weight_bytes(&e->w2) + weight_bytes(&e->w3);
}

static void count_params(moe_model *m) {
    const moe_config *c = &m->cfg;
    uint64_t total = 0, bytes = 0, ebytes = 0, eparams = 0, eparams_active = 0;
    size_t pl = strlen(m->prefix);
    for (size_t i = 0; i < m->table_cap; i++) {
        const moe__st_tensor *t = m->table[i].t;
        if (!t || strncmp(t->name, m->prefix, pl)) continue; /* vision tower etc. */
        int64_t n = 1;
        for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
        const char *nm = t->name + pl;
        size_t len = strlen(nm);
        if (len > 13 && !strcmp(nm + len - 13, ".weight_scale")) n = 0; /* MXFP4 scales */
        else if (len > 14 && !strcmp(nm + len - 14, ".weight_packed")) n *= 2;
        total += (uint64_t)n;
        bytes += t->nbytes;
    }
    for (int l = 0; l < c->n_layers; l++) {
        if (!m->layers[l].experts) continue;
        for (int e = 0; e < c->n_experts; e++) {
            const expert *x = &m->layers[l].experts[e];
            uint64_t p = (uint64_t)(x->w1.rows * x->w1.cols + x->w2.rows * x->w2.cols + x->w3.rows * x->w3.cols);
            eparams += p;
            ebytes += expert_bytes(x);
            if (e < c->n_active) eparams_active += p; /* experts of one layer share a shape */
        }
    }
    m->info.n_params = total;
    m->info.n_params_active = total - eparams + eparams_active;
    m->info.weight_bytes = bytes;
    m->info.expert_bytes = ebytes;
    m->info.n_files = m->n_files;
    m->info.format = m->gguf ? "gguf" : "safetensors";
}

/* PART 2 decides where the bound weights live (binding calls these last) */
static void choose_streamed(moe_model *m);
static moe_status convert_weight(moe_model *m, moe__weight *w, int to, char *err, size_t errlen);
static int converted_type(const moe__weight *w, int to);
static moe_status convert_weights(moe_model *m, char *err, size_t errlen);
static moe_status repack_weights(moe_model *m);

/* the part of its layer that matrix f (a dense_fields offset) belongs to, in the order a decoded
 * token meets them: the mixer (LAYER_MIXER); the FFN that needs no routed expert's output
 * (LAYER_FFN: the dense or shared experts' gate, up and down, the latent down-projection); the
 * latent up-projection of the routed experts' outputs (LAYER_LAT_UP) */
enum { LAYER_MIXER, LAYER_FFN, LAYER_LAT_UP };
static int layer_part(size_t f) {
    if (f == offsetof(layer, lat_up)) return LAYER_LAT_UP;
    return f == offsetof(layer, gate) || f == offsetof(layer, up) || f == offsetof(layer, down) || f == offsetof(layer, lat_down)
               ? LAYER_FFN
               : LAYER_MIXER;
}

/* the bytes a decoded token reads of part of layer L's matrices were its dense matrices converted
 * to to (count_dense_bytes) */
static uint64_t layer_bytes_as(layer *L, int part, int to) {
    uint64_t b = 0;
    for (size_t k = 0; k < N_DENSE_FIELDS; k++) {
        const size_t f = dense_fields[k];
        const moe__weight *w = layer_matrix(L, k);
        if (layer_part(f) != part || !w->data) continue;
        b += (uint64_t)w->rows * (uint64_t)moe__row_bytes(f == offsetof(layer, kv_b) ? w->type : converted_type(w, to), w->cols);
    }
    if (part == LAYER_MIXER && L->k_b.data) /* decode reads these in place of kv_b (absorbed MLA) */
        b += weight_bytes(&L->k_b) + weight_bytes(&L->v_b) - weight_bytes(&L->kv_b);
    return b;
}

static void count_dense_bytes(moe_model *m) {
    static const char *names[MOE_T_COUNT] = {"f32", "f16", "bf16", "mxfp4", "mxfp4", "q8_0", "q4_0", "u8", "i32", "q8_0", "q4_0", "mxfp4",
                                             "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "q4_k", "q5_k",
                                             "q2_k", "q3_k", "iq4_nl", "iq4_xs", "iq4_xs", "q2_k", "q3_k", "q6_k",
                                             "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m"};
    _Static_assert(MOE_T_COUNT == 35, "a name for each weight type");
    uint64_t per_type[MOE_T_COUNT] = {0};
    per_type[m->lm_head.type] += weight_bytes(&m->lm_head);
    for (int i = 0; i < m->cfg.n_layers; i++) {
        layer *L = &m->layers[i];
        per_type[L->router.type] += weight_bytes(&L->router);
        for (size_t k = 0; k < N_DENSE_FIELDS; k++) per_type[layer_matrix(L, k)->type] += weight_bytes(layer_matrix(L, k));
        for (int e = 0; L->experts && e < m->cfg.n_experts; e++) per_type[L->experts[e].w1.type] += expert_bytes(&L->experts[e]);
    }
    int best = 0;
    for (int t = 1; t < MOE_T_COUNT; t++)
        if (per_type[t] > per_type[best]) best = t;
    m->info.weight_type = names[best];
    /* what a decoded token reads of them for each dense_type, as convert_weights converts: the
     * LM head (Q8_0 under Q4_0) and the layers' matrices but kv_b; the router, one embedding row,
     * kv_b and the absorbed k_b/v_b as they are. Of those, the serial part: the layers before the
     * first MoE layer and that layer's mixer and router (the token's routing is not known before
     * them), the last MoE layer's latent up-projection, the layers after it and the LM head (the
     * token's experts are all in by then): no expert read of the token can overlap them. */
    const int used = m->opt.dense_type >= MOE_WTYPE_ASIS && m->opt.dense_type <= MOE_WTYPE_Q4_0 ? m->opt.dense_type : 0;
    int first = 0, last = m->cfg.n_layers - 1;
    while (first < m->cfg.n_layers && !m->layer_moe[first]) first++;
    while (last >= 0 && !m->layer_moe[last]) last--;
    for (int to = MOE_WTYPE_ASIS; to <= MOE_WTYPE_Q4_0; to++) {
        const int head_to = to == MOE_WTYPE_Q4_0 ? MOE_WTYPE_Q8_0 : to;
        uint64_t b = (uint64_t)m->lm_head.rows * (uint64_t)moe__row_bytes(converted_type(&m->lm_head, head_to), m->lm_head.cols) +
                     (uint64_t)moe__row_bytes(m->embed.type, m->embed.cols);
        uint64_t serial = b;
        for (int i = 0; i < m->cfg.n_layers; i++) {
            layer *L = &m->layers[i];
            const uint64_t mixer = weight_bytes(&L->router) + layer_bytes_as(L, LAYER_MIXER, to),
                           ffn = layer_bytes_as(L, LAYER_FFN, to), lat_up = layer_bytes_as(L, LAYER_LAT_UP, to);
            b += mixer + ffn + lat_up;
            if (i < first || i > last) serial += mixer + ffn + lat_up;
            else serial += (i == first ? mixer : 0) + (i == last ? lat_up : 0);
        }
        m->info.dense_bytes_as[to] = b;
        if (to == used) m->info.serial_bytes_per_token = serial;
    }
    m->info.dense_bytes_per_token = m->info.dense_bytes_as[used];
}

/* MOE_FLAG_CHECK_TENSORS: every float tensor of the files read once, in parallel; the first
 * (in file order) holding a NaN or an infinity is named */
static moe_status check_tensors(const moe_model *m, char *err, size_t errlen) {
    for (int f = 0; f < m->n_files; f++) {
        const moe__st_file *F = &m->files[f];
        int bad = F->n_tensors;
#ifdef _OPENMP
#pragma omp parallel for num_threads(m->opt.n_threads) schedule(dynamic) reduction(min : bad)
#endif
        for (int i = 0; i < F->n_tensors; i++) {
            const moe__st_tensor *t = &F->tensors[i];
            if (values_nonfinite(t->type, t->data, t->type == MOE_T_F32 ? t->nbytes / 4 : t->nbytes / 2) && i < bad) bad = i;
        }
        if (bad < F->n_tensors) return fail(err, errlen, MOE_ERR_NUMERIC, "%s: tensor %s holds a NaN or an infinity", F->path, F->tensors[bad].name);
    }
    return MOE_OK;
}

static moe_status bind_model(moe_model *m, char *err, size_t errlen) {
    const moe_config *c = &m->cfg;
    binder b = {m, err, errlen, MOE_OK};
    if (m->opt.flags & MOE_FLAG_CHECK_TENSORS) b.st = check_tensors(m, err, errlen);
    const int d = c->hidden_size;
    bind_mat(&b, &m->embed, c->vocab_size, d, "model.embed_tokens");
    if (c->tie_embeddings && !bfind(&b, "lm_head.weight")) m->lm_head = m->embed;
    else bind_mat(&b, &m->lm_head, c->vocab_size, d, "lm_head");
    m->final_norm = bind_vec(&b, d, 0, "model.norm.weight");
    if (c->attn_res_block) m->out_res_w = bind_res(&b, d, "model.output_attn_res");
    if (!b.st && !(m->layers = xcalloc((size_t)c->n_layers, sizeof *m->layers))) b.st = MOE_ERR_NOMEM;
    for (int i = 0; i < c->n_layers && !b.st; i++) bind_layer(&b, i);
    for (int i = 0; i < c->n_layers && !b.st; i++) /* absorbed MLA decodes kv_b rows as floats */
        if (m->layers[i].kind == MOE_LAYER_MLA && !m->k.dot[m->layers[i].kv_b.type]) b.st = convert_weight(m, &m->layers[i].kv_b, MOE_WTYPE_F32, err, errlen);
    if (!b.st && (m->embed.type == MOE_T_MXFP4 || m->embed.type == MOE_T_MXFP4_GGML))
        b.st = fail(err, errlen, MOE_ERR_FORMAT, "embed_tokens must not be MXFP4");
    if (!b.st) count_params(m);
    if (!b.st) count_dense_bytes(m); /* as stored: what the resource plan weighs */
    return b.st;
}

/* The bound weights placed as the options say: streamed layers chosen, matrices converted and
 * interleaved into RAM, the per-token byte counts taken again. */
static moe_status place_weights(moe_model *m, char *err, size_t errlen) {
    moe_status st = MOE_OK;
    choose_streamed(m);
    if ((st = convert_weights(m, err, errlen)) == MOE_ERR_NOMEM) fail(err, errlen, st, "out of memory converting weights at load");
    if (!st && !(m->opt.flags & MOE_FLAG_NO_REPACK) && (st = repack_weights(m)))
        fail(err, errlen, st, "out of memory interleaving weights at load (MOE_FLAG_NO_REPACK keeps them mapped)");
    if (!st) count_dense_bytes(m);
    return st;
}

/* ==== opening ================================================================================ */

static moe_status read_file(const char *path, char **out, size_t *len, size_t max, char *err,
                            size_t errlen) {
    int fd;
    moe_status st = open_regular(path, 0, &fd, err, errlen);
    if (st) return st;
    struct stat sb;
    if (!fstat(fd, &sb) && (uint64_t)sb.st_size > max) { /* refused before reading any of it */
        close(fd);
        return fail(err, errlen, MOE_ERR_FORMAT, "%s: %llu bytes, larger than the %zu allowed", path,
                    (unsigned long long)sb.st_size, max);
    }
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        close(fd);
        return fail(err, errlen, MOE_ERR_NOMEM, "%s: %s", path, strerror(errno));
    }
    char *buf = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (n == cap) {
            if (cap >= max) {
                fclose(f);
                free(buf);
                return fail(err, errlen, MOE_ERR_FORMAT, "%s: larger than %zu bytes", path, max);
            }
            cap = cap ? cap * 2 : 65536;
            char *nb = realloc(buf, cap + 1);
            if (!nb) { fclose(f); free(buf); return MOE_ERR_NOMEM; }
            buf = nb;
        }
        size_t r = fread(buf + n, 1, cap - n, f);
        n += r;
        if (r == 0) break;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) { free(buf); return fail(err, errlen, MOE_ERR_IO, "%s: read error", path); }
    buf[n] = 0;
    *out = buf;
    *len = n;
    return MOE_OK;
}

static moe_status parse_json_file(const char *path, moe__json **root, char *err, size_t errlen) {
    char *text = NULL;
    size_t len = 0;
    moe_status st = read_file(path, &text, &len, 256u << 20, err, errlen);
    if (st) return st;
    char e2[200];
    st = moe__json_parse(text, len, root, e2, sizeof e2);
    free(text);
    if (st) return fail(err, errlen, st, "%s: %s", path, e2);
    return MOE_OK;
}

static int is_dir(const char *path) {
    struct stat sb;
    return !stat(path, &sb) && S_ISDIR(sb.st_mode);
}

static int file_exists(const char *path) {
    struct stat sb;
    return !stat(path, &sb);
}

/* The shard list from model.safetensors.index.json: distinct plain file names in first-seen
 * order. A name with a path separator is refused (the index must not reach outside the dir). */
static moe_status index_shards(const char *dir, const char *index_path, char ***names, int *n,
                               moe__json **idx, char *err, size_t errlen) {
    moe_status st = parse_json_file(index_path, idx, err, errlen);
    if (st) return st;
    const moe__json *wm = moe__json_get(*idx, "weight_map");
    if (!wm || wm->type != MOE_JSON_OBJ || wm->n == 0)
        return fail(err, errlen, MOE_ERR_FORMAT, "%s: no weight_map", index_path);
    char **list = xcalloc((size_t)wm->n, sizeof *list);
    if (!list) return MOE_ERR_NOMEM;
    int cnt = 0;
    for (const moe__json *e = wm->child; e; e = e->next) {
        if (e->type != MOE_JSON_STR || !*e->str || strchr(e->str, '/') || !strcmp(e->str, "..") ||
            strlen(e->str) > 255) {
            free(list);
            return fail(err, errlen, MOE_ERR_FORMAT, "%s: bad shard name for tensor %s", index_path, e->key);
        }
        int seen = 0;
        for (int i = 0; i < cnt && !seen; i++) seen = !strcmp(list[i], e->str);
        if (!seen) list[cnt++] = (char *)e->str;
    }
    (void)dir;
    *names = list;
    *n = cnt;
    return MOE_OK;
}

static moe_status cache_open(moe_model *m, char *err, size_t errlen); /* PART 2, section "expert cache" */
static void cache_free(moe_model *m);

static void plan_cpus(int *cpus, int *cores); /* PART 2, section "the resource plan" */
static moe_status plan_of_model(moe_plan *p, const moe_model *m, const moe_options *given, char *err, size_t errlen);

/* the physical cores this process may use, found once */
static int default_threads = 1;
static void find_default_threads(void) {
    int cpus, cores;
    plan_cpus(&cpus, &cores);
    default_threads = cores > 0 ? cores : 1;
}

moe_options moe_default_options(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, find_default_threads);
    moe_options o;
    memset(&o, 0, sizeof o);
    o.n_threads = default_threads;
    o.n_batch = 0; /* by the expert mode, at open */
    o.expert_mode = MOE_EXPERTS_MMAP;
    o.io_threads = 4;
    o.prefetch = 1;
    return o;
}

/* What a model path that is not a directory holds, by its first bytes (or, for a damaged .gguf,
 * its name, so that it gets a GGUF error rather than a config.json one): 'g' GGUF, 's' a
 * safetensors file (8-byte header length, then '{'), 0 anything else; MOE_ERR_IO when it cannot
 * be opened or is not a regular file. */
static moe_status model_file_kind(const char *path, int *kind, char *err, size_t errlen) {
    int fd;
    moe_status st = open_regular(path, 0, &fd, err, errlen);
    if (st) return st;
    unsigned char head[9] = {0};
    const ssize_t r = pread(fd, head, sizeof head, 0);
    close(fd);
    const size_t l = strlen(path);
    if ((r >= 4 && !memcmp(head, "GGUF", 4)) || (l > 5 && !strcmp(path + l - 5, ".gguf"))) *kind = 'g';
    else if (r == 9 && head[8] == '{') *kind = 's';
    else *kind = 0;
    return MOE_OK;
}

/* PREFIX-NNNNN-of-MMMMM.gguf, the names of a split GGUF's parts (llama.cpp's gguf-split and
 * converter): 1 with the prefix's length, the part's number and the count */
static int split_name(const char *path, size_t *prefix_len, int *no, int *count) {
    static const char tail[] = "-00000-of-00000.gguf";
    const size_t l = strlen(path), k = sizeof tail - 1;
    if (l < k) return 0;
    const char *t = path + l - k;
    for (size_t i = 0; i < k; i++)
        if (tail[i] == '0' ? (t[i] < '0' || t[i] > '9') : t[i] != tail[i]) return 0;
    *prefix_len = l - k, *no = atoi(t + 1), *count = atoi(t + 10);
    return 1;
}

/* the split keys of a GGUF part (no: 0-based; a file that is not split: part 0 of 1) */
static moe_status split_keys(const moe__st_file *f, int64_t *no, int64_t *count, char *err, size_t errlen) {
    *count = gguf_int(f, "split.count", 1), *no = gguf_int(f, "split.no", 0);
    if (*count < 1 || *count > 99999 || *no < 0 || *no >= *count)
        return fail(err, errlen, MOE_ERR_FORMAT, "%s: split.no %lld and split.count %lld do not name a part", f->path, (long long)*no,
                    (long long)*count);
    return MOE_OK;
}

/* A GGUF holds the config (as metadata) and every tensor: in one file, or split into parts
 * PREFIX-00001-of-0000N.gguf .. -0000N-of-0000N.gguf as llama.cpp writes them, each a GGUF with
 * its own tensors and the keys split.no (0-based), split.count and split.tensors.count (the
 * whole model's), the metadata in the first. The path of any part opens them all. */
static moe_status open_gguf(moe_model *m, const char *path, char *err, size_t errlen) {
    m->gguf = 1;
    if (!(m->files = xcalloc(1, sizeof *m->files))) return MOE_ERR_NOMEM;
    moe_status st = moe__gguf_open(&m->files[0], path, err, errlen);
    if (st) return st;
    m->n_files = 1;
    int64_t no, count;
    if ((st = split_keys(&m->files[0], &no, &count, err, errlen))) return st;
    if (count > 1) {
        char part[4200];
        size_t plen;
        int nno, ncount;
        if (!split_name(path, &plen, &nno, &ncount) || nno != no + 1 || ncount != count)
            return fail(err, errlen, MOE_ERR_FORMAT, "%s: part %lld of a %lld-part GGUF, but not named PREFIX-%05lld-of-%05lld.gguf",
                        path, (long long)no + 1, (long long)count, (long long)no + 1, (long long)count);
        moe__st_file *fs = xcalloc((size_t)count, sizeof *fs);
        if (!fs) return MOE_ERR_NOMEM;
        fs[no] = m->files[0];
        free(m->files);
        m->files = fs, m->n_files = (int)count;
        uint64_t tensors = 0;
        for (int i = 0; i < count; i++) {
            if (i != no) {
                snprintf(part, sizeof part, "%.*s-%05d-of-%05lld.gguf", (int)plen, path, i + 1, (long long)count);
                if ((st = moe__gguf_open(&m->files[i], part, err, errlen))) return st;
            }
            int64_t pno, pcount;
            if ((st = split_keys(&m->files[i], &pno, &pcount, err, errlen))) return st;
            if (pno != i || pcount != count)
                return fail(err, errlen, MOE_ERR_FORMAT, "%s: split.no %lld of %lld, but named part %d of %lld", m->files[i].path,
                            (long long)pno, (long long)pcount, i + 1, (long long)count);
            tensors += (uint64_t)m->files[i].n_tensors;
        }
        const int64_t want = gguf_int(&m->files[0], "split.tensors.count", (int64_t)tensors);
        if (want != (int64_t)tensors)
            return fail(err, errlen, MOE_ERR_FORMAT, "%s: split.tensors.count says %lld tensors, the %lld parts hold %llu", m->files[0].path,
                        (long long)want, (long long)count, (unsigned long long)tensors);
    }
    moe__json *cfg = NULL;
    if ((st = gguf_config_json(m->files, m->n_files, &cfg, err, errlen))) return st;
    char e2[400];
    st = parse_config(m, cfg, e2, sizeof e2);
    moe__json_free(cfg);
    /* parse_config names config.json's fields; here they came from the file's metadata */
    if (st) return fail(err, errlen, st, "%s: metadata (as config.json's fields): %s", m->files[0].path, strncmp(e2, "config.json: ", 13) ? e2 : e2 + 13);
    return build_table(m, err, errlen);
}

static moe_status open_files(moe_model *m, const char *path, char *err, size_t errlen) {
    char dir[4096], buf[4400];
    moe_status st;
    if (strlen(path) >= sizeof dir - 1) return fail(err, errlen, MOE_ERR_ARG, "path too long");
    if (!is_dir(path)) {
        int kind;
        if ((st = model_file_kind(path, &kind, err, errlen))) return st;
        if (kind == 'g') return open_gguf(m, path, err, errlen);
        if (!kind)
            return fail(err, errlen, MOE_ERR_FORMAT, "%s: not a model (a model is a directory with config.json, a GGUF file, "
                        "or a .safetensors file with config.json beside it)", path);
    }
    moe__json *cfg = NULL, *idx = NULL;
    char **shards = NULL, *single[1];
    int n_shards = 0;
    if (is_dir(path)) {
        snprintf(dir, sizeof dir, "%s", path);
        snprintf(buf, sizeof buf, "%s/model.safetensors.index.json", dir);
        if (file_exists(buf)) {
            if ((st = index_shards(dir, buf, &shards, &n_shards, &idx, err, errlen))) goto out;
        } else {
            single[0] = "model.safetensors";
            shards = single, n_shards = 1;
        }
    } else {
        /* a single .safetensors file: config.json beside it */
        const char *slash = strrchr(path, '/');
        if (slash) snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
        else strcpy(dir, ".");
        single[0] = (char *)(slash ? slash + 1 : path);
        shards = single, n_shards = 1;
    }
    snprintf(buf, sizeof buf, "%s/config.json", dir);
    if ((st = parse_json_file(buf, &cfg, err, errlen))) goto out;
    if (cfg->type != MOE_JSON_OBJ) { st = fail(err, errlen, MOE_ERR_FORMAT, "%s: not an object", buf); goto out; }
    char e2[400];
    if ((st = parse_config(m, cfg, e2, sizeof e2))) { /* its messages name config.json: give the path */
        fail(err, errlen, st, "%s: %s", buf, strncmp(e2, "config.json: ", 13) ? e2 : e2 + 13);
        goto out;
    }
    if (!(m->files = xcalloc((size_t)n_shards, sizeof *m->files))) { st = MOE_ERR_NOMEM; goto out; }
    for (int i = 0; i < n_shards; i++) {
        snprintf(buf, sizeof buf, "%s/%s", dir, shards[i]);
        if ((st = moe__st_open(&m->files[i], buf, err, errlen))) goto out;
        m->n_files++;
    }
    if ((st = build_table(m, err, errlen))) goto out;
    if (idx) { /* every tensor the index names must be in the shard it names */
        const moe__json *wm = moe__json_get(idx, "weight_map");
        for (const moe__json *e = wm->child; e; e = e->next) {
            const tensor_ref *r = lookup(m, e->key);
            const char *base = r ? strrchr(m->files[r->file].path, '/') + 1 : NULL;
            if (!r || strcmp(base, e->str)) {
                st = fail(err, errlen, MOE_ERR_FORMAT, "index lists tensor %s in %s, but it is not there",
                          e->key, e->str);
                goto out;
            }
        }
    }
out:
    if (shards != single) free(shards);
    moe__json_free(cfg);
    moe__json_free(idx);
    return st;
}

moe_status moe_model_open(moe_model **out, const char *path, const moe_options *opt, char *err,
                          size_t errlen) {
    if (err && errlen) err[0] = 0;
    if (!out) return fail(err, errlen, MOE_ERR_ARG, "moe_model_open: out is NULL");
    *out = NULL;
    if (!path) return fail(err, errlen, MOE_ERR_ARG, "moe_model_open: path is NULL");
    moe_model *m = xcalloc(1, sizeof *m);
    if (!m) return MOE_ERR_NOMEM;
    const moe_options given = opt ? *opt : moe_default_options();
    m->opt = given;
    m->opt.flags &= ~(unsigned)MOE_FLAG_PLAN;
    char levels[160];
    moe_status st = MOE_OK;
    if (moe__kernels_pick(&m->k, m->opt.flags, m->opt.kernels, levels, sizeof levels))
        st = fail(err, errlen, MOE_ERR_ARG, "kernels \"%s\": this CPU runs %s", m->opt.kernels, levels);
    m->info.kernels = m->k.isa;
    if (!st && !(m->path = strdup(path))) st = MOE_ERR_NOMEM;
    if (!st) st = open_files(m, path, err, errlen);
    if (!st) st = bind_model(m, err, errlen);
    /* MOE_FLAG_PLAN: the plan weighs the files just read (opened once, whatever the plan says) */
    if (!st && (given.flags & MOE_FLAG_PLAN) && !(st = plan_of_model(&m->plan, m, &given, err, errlen))) {
        m->opt = m->plan.opt, m->planned = 1;
        m->opt.flags &= ~(unsigned)MOE_FLAG_PLAN;
    }
    m->opt.kernels = NULL; /* the caller's string: used only for the pick */
    if (m->opt.n_threads < 1) m->opt.n_threads = 1;
    /* long chunks rebuild MLA's expanded keys less often and serve more rows per weight read (a
     * 16384-token prompt 1.34x faster at 2048 rows than at 512), but their working memory (about
     * 0.2 GB more on the benchmark shape) sits beside the cache mode's expert budget */
    if (m->opt.n_batch < 1) m->opt.n_batch = m->opt.expert_mode == MOE_EXPERTS_CACHE ? 512 : 2048;
    m->info.n_batch = m->opt.n_batch;
    if (!st && m->opt.expert_mode != MOE_EXPERTS_MMAP && m->opt.expert_mode != MOE_EXPERTS_CACHE)
        st = fail(err, errlen, MOE_ERR_ARG, "unknown expert_mode %d", m->opt.expert_mode);
    if (!st && m->opt.kv_type != MOE_KV_F32 && m->opt.kv_type != MOE_KV_BF16 && m->opt.kv_type != MOE_KV_Q8)
        st = fail(err, errlen, MOE_ERR_ARG, "unknown kv_type %d", m->opt.kv_type);
    if (!st && m->opt.expert_mode == MOE_EXPERTS_CACHE && m->opt.expert_type != MOE_WTYPE_ASIS)
        st = fail(err, errlen, MOE_ERR_ARG, "expert_type conversion makes experts resident: it needs the mmap expert mode");
    if (!st) st = place_weights(m, err, errlen);
    int streams = 0;
    for (int i = 0; !st && i < m->cfg.n_layers; i++) streams |= m->layers[i].stream;
    if (!st && m->opt.expert_mode == MOE_EXPERTS_CACHE && (m->cfg.n_experts || streams)) st = cache_open(m, err, errlen);
    if (st) {
        if (st == MOE_ERR_NOMEM && err && errlen && !err[0]) fail(err, errlen, st, "out of memory loading %s", path);
        moe_model_close(m);
        return st;
    }
    *out = m;
    return MOE_OK;
}

void moe_model_close(moe_model *m) {
    if (!m) return;
    cache_free(m);
    if (m->layers)
        for (int i = 0; i < m->cfg.n_layers; i++) {
            layer *L = &m->layers[i];
            float *vecs[] = {L->attn_norm, L->ffn_norm, L->attn_res_w, L->mlp_res_w, L->q_conv,
                             L->k_conv, L->v_conv, L->A_log, L->dt_bias, L->o_norm, L->q_a_norm,
                             L->kv_a_norm, L->router_bias, L->lat_norm};
            for (size_t k = 0; k < sizeof vecs / sizeof *vecs; k++) free(vecs[k]);
            free(L->experts);
        }
    for (int i = 0; i < m->n_owned; i++) free(m->owned[i]);
    free(m->owned);
    free(m->layers);
    free(m->final_norm);
    free(m->out_res_w);
    free(m->table);
    for (int i = 0; i < m->n_files; i++) moe__st_close(&m->files[i]);
    free(m->files);
    free(m->layer_kind);
    free(m->layer_moe);
    free(m->path);
    free(m);
}

const moe__st_tensor *moe__model_tensor(const moe_model *m, const char *name) {
    const tensor_ref *r = m ? lookup(m, name) : NULL;
    return r ? r->t : NULL;
}

const char *moe__model_prefix(const moe_model *m) { return m ? m->prefix : ""; }

const moe_config *moe_model_config(const moe_model *m) { return m ? &m->cfg : NULL; }

moe_model_info moe_model_get_info(const moe_model *m) {
    moe_model_info z;
    memset(&z, 0, sizeof z);
    return m ? m->info : z;
}

/* =================================================================================================
 * PART 2: WEIGHT RESIDENCY
 * =================================================================================================
 * Where each weight lives while the model runs: in the file mapping (MOE_EXPERTS_MMAP, the
 * default, with paging hints), converted or interleaved into RAM at load (dense_type,
 * repack_weights), or read on demand from disk into the expert cache (MOE_EXPERTS_CACHE): routed
 * experts, and with a dense budget whole layers' dense matrices (streamed layers). The forward
 * pass asks for weights only through expert_get/expert_put and dense_get/dense_put, so it does
 * not know which of these holds them. Relies on PART 1's bound model (every matrix's file and
 * offset) and on pread/O_DIRECT and pthreads; nothing here runs the model's math. */

/* ==== mapped files, load-time conversion, streamed layers ======================================
 * Paging hints over the mappings; dense matrices converted (dense_type) or interleaved into
 * huge-page RAM at load, their file pages then dropped; which layers' dense matrices stream
 * through the cache when a dense budget is set (choose_streamed). */

/* the 4 KB pages wholly inside [p, p + n): [*a, *e); 0 if there are none */
static int whole_pages(const void *p, size_t n, uintptr_t *a, uintptr_t *e) {
    *a = ((uintptr_t)p + 4095) & ~(uintptr_t)4095, *e = ((uintptr_t)p + n) & ~(uintptr_t)4095;
    return *e > *a;
}

/* Asks for transparent huge pages over the pages wholly inside [p, p + n) before they are first
 * written (a hint: where the system has none, nothing changes) */
static void advise_huge(const void *p, size_t n) {
    uintptr_t a, e;
    if (!whole_pages(p, n, &a, &e)) return;
#ifdef MADV_HUGEPAGE
    madvise((void *)a, e - a, MADV_HUGEPAGE);
#endif
}

/* A weight converted into RAM no longer needs its file pages: unmap them from this process (the
 * page cache keeps clean pages that the kernel, or a memory cgroup, reclaims first). Only pages
 * wholly inside the range; a hint. */
static void drop_mapped(const void *p, size_t n) {
    uintptr_t a, e;
    if (!whole_pages(p, n, &a, &e)) return;
#ifdef MADV_DONTNEED
    madvise((void *)a, e - a, MADV_DONTNEED); /* private read-only mapping: re-read from the file if touched */
#else
    posix_madvise((void *)a, e - a, POSIX_MADV_DONTNEED);
#endif
}

/* the file whose mapping holds the n >= 1 bytes at p, or -1 */
static int mapped_file(const moe_model *m, const void *p, uint64_t n) {
    const unsigned char *a = p;
    for (int f = 0; f < m->n_files; f++) {
        const unsigned char *b = m->files[f].map, *e = b + m->files[f].size;
        if (a >= b && a < e && n <= (uint64_t)(e - a)) return f;
    }
    return -1;
}

static int in_mapping(const moe_model *m, const void *p) { return mapped_file(m, p, 1) >= 0; }

/* ---- streamed layers (CACHE mode, dense_budget) ---- */

static uint64_t weight_data_bytes(const moe__weight *w) { return (uint64_t)w->rows * (uint64_t)moe__row_bytes(w->type, w->cols); }

/* 1 when an F32, F16 or BF16 matrix holds a NaN or an infinity (other types: 0) */
static int weight_nonfinite(const moe__weight *w) { return values_nonfinite(w->type, w->data, (size_t)w->rows * (size_t)w->cols); }
static uint64_t weight_scale_bytes(const moe__weight *w) { return w->scale ? (uint64_t)(w->rows * (w->cols / 32)) : 0; }

#define UNIT_MAX 20 /* matrices in one cache unit: an expert's 3, or a layer's dense ones */


/* The matrices of cache unit e of layer li: expert e's w1, w2, w3, or (e == n_experts) the
 * layer's dense matrices still in the files' mapping; field[i] (if asked) gets where the layer
 * struct keeps each of those. */
static int unit_weights(const moe_model *m, int li, int e, const moe__weight **w, size_t *field) {
    const layer *L = &m->layers[li];
    if (e < m->cfg.n_experts) {
        w[0] = &L->experts[e].w1, w[1] = &L->experts[e].w2, w[2] = &L->experts[e].w3;
        return 3;
    }
    int n = 0;
    for (size_t i = 0; i < N_DENSE_FIELDS; i++) {
        const moe__weight *x = layer_matrix((layer *)L, i);
        if (!x->data || !in_mapping(m, x->data)) continue;
        if (field) field[n] = dense_fields[i];
        w[n++] = x;
    }
    return n;
}

/* The format conversion to moe_wtype `to` gives w: its own type where it is kept as stored
 * (no conversion asked, or a block format for rows that are not a multiple of 32). */
static int converted_type(const moe__weight *w, int to) {
    static const int types[] = {-1, MOE_T_F32, MOE_T_BF16, MOE_T_Q8_0, MOE_T_Q4_0};
    if (to <= MOE_WTYPE_ASIS || to > MOE_WTYPE_Q4_0 || (moe__is_quant(types[to]) && w->cols % 32)) return w->type;
    return types[to];
}

/* bytes of w once dense_type has converted it */
static uint64_t loaded_bytes(const moe_model *m, const moe__weight *w) {
    const int t = converted_type(w, m->opt.dense_type);
    return t == w->type ? weight_bytes(w) : (uint64_t)w->rows * (uint64_t)moe__row_bytes(t, w->cols);
}

/* CACHE mode with a dense budget: layers stay resident, in order, while their dense matrices
 * fit; every layer after the first that does not fit streams. */
static void choose_streamed(moe_model *m) {
    if (m->opt.expert_mode != MOE_EXPERTS_CACHE || !m->opt.dense_budget) return;
    uint64_t used = 0;
    int streaming = 0;
    for (int li = 0; li < m->cfg.n_layers; li++) {
        const moe__weight *w[UNIT_MAX];
        const int n = unit_weights(m, li, m->cfg.n_experts, w, NULL);
        uint64_t b = 0;
        for (int i = 0; i < n; i++) b += loaded_bytes(m, w[i]);
        if (!streaming && used + b <= m->opt.dense_budget) {
            used += b;
        } else if (n > 0) {
            streaming = m->layers[li].stream = 1;
            m->info.streamed_layers++;
            for (int i = 0; i < n; i++) m->info.streamed_bytes += weight_bytes(w[i]);
        }
    }
}

/* The name of the file tensor a matrix was bound from (found by its data), for messages */
static const char *weight_name(const moe_model *m, const moe__weight *w) {
    for (int f = 0; f < m->n_files; f++)
        for (int i = 0; i < m->files[f].n_tensors; i++)
            if (m->files[f].tensors[i].data == w->data) return m->files[f].tensors[i].name;
    return "a weight matrix";
}

/* Converts one weight matrix to `to` (a MOE_WTYPE_*) into memory the model owns; a matrix holding
 * a NaN or an infinity is refused (MOE_ERR_NUMERIC, naming it and the row). */
static moe_status convert_weight(moe_model *m, moe__weight *w, int to, char *err, size_t errlen) {
    const int t = converted_type(w, to);
    if (!w->data || t == w->type) return MOE_OK;
    const int64_t rb_in = moe__row_bytes(w->type, w->cols), rb = moe__row_bytes(t, w->cols);
    const int64_t sb = w->type == MOE_T_MXFP4 ? w->cols / 32 : 0;
    unsigned char *dst = malloc((size_t)(rb * w->rows));
    float *tmp = malloc(sizeof(float) * (size_t)w->cols * (size_t)m->opt.n_threads);
    if (!dst || !tmp) { free(dst); free(tmp); return MOE_ERR_NOMEM; }
    int64_t bad_row = w->rows; /* the first row holding a NaN or an infinity */
#ifdef _OPENMP
#pragma omp parallel for num_threads(m->opt.n_threads) schedule(static) if (m->opt.n_threads > 1)
#endif
    for (int64_t r = 0; r < w->rows; r++) {
        float *row = tmp + (size_t)w->cols * (size_t)thread_id();
        moe__row_to_f32(w->type, (const unsigned char *)w->data + r * rb_in, w->scale ? w->scale + r * sb : NULL, row, w->cols);
        if (has_nonfinite(row, (size_t)w->cols) && r < bad_row) {
#ifdef _OPENMP
#pragma omp critical(moe_bad_row)
#endif
            if (r < bad_row) bad_row = r;
        }
        unsigned char *o = dst + r * rb;
        if (t == MOE_T_F32) memcpy(o, row, sizeof(float) * (size_t)w->cols);
        else if (t == MOE_T_BF16) for (int64_t i = 0; i < w->cols; i++) ((uint16_t *)o)[i] = moe__f32_to_bf16(row[i]);
        else moe__quantize_row(t, row, o, w->cols);
    }
    free(tmp);
    if (bad_row < w->rows) {
        free(dst);
        return fail(err, errlen, MOE_ERR_NUMERIC, "%s: row %lld holds a NaN or an infinity", weight_name(m, w), (long long)bad_row);
    }
    if (own(m, dst)) { free(dst); return MOE_ERR_NOMEM; }
    if (in_mapping(m, w->data)) {
        drop_mapped(w->data, (size_t)(rb_in * w->rows));
        if (w->scale) drop_mapped(w->scale, (size_t)(sb * w->rows));
    }
    *w = (moe__weight){t, w->rows, w->cols, dst, NULL};
    return MOE_OK;
}

/* the interleaved k-quant and IQ4_XS types (never repacked in place: all but Q2_KX8 and Q6_KX8
 * are larger than the rows they hold) */
static int is_kx8(int type) {
    return type == MOE_T_Q4_KX8 || type == MOE_T_Q5_KX8 || type == MOE_T_IQ4_XSX8 || type == MOE_T_Q2_KX8 || type == MOE_T_Q3_KX8 ||
           type == MOE_T_Q6_KX8;
}

/* The interleaved type a matrix is repacked to (Q4_0/Q8_0, MXFP4 when its products take
 * quantized activations, Q2_K..Q6_K/IQ4_XS where the level has the kernels; rows a multiple of
 * 8), or -1 */
static int x8_type(const moe_model *m, const moe__weight *w) {
    const int to = moe__x8_of(w->type);
    if (to < 0 || w->rows % 8 || w->cols % 32) return -1;
    if (is_kx8(to)) return m->k.dotq8[to] ? to : -1; /* where the level has its kernel (x86) */
    return to != MOE_T_MXFP4X8 || (m->opt.flags & MOE_FLAG_MXFP4_INT8) ? to : -1;
}

/* What repack_weights makes of a matrix: its interleaved type; for the block formats that have
 * none (Q4_1, Q5_0, Q5_1, IQ4_NL; the k-quants and IQ4_XS where the level has no
 * interleaved kernels) their own, a plain copy into the same huge-page RAM
 * (read through the file mapping's 4 KB pages, a Q4_0 decode token took 2.6x as long as
 * interleaved: bench/RESULTS.md, "2026-12-01: GGUF files in llama-quantize's formats"); -1: it stays where it is */
static int placed_type(const moe_model *m, const moe__weight *w) {
    const int to = x8_type(m, w);
    if (to >= 0) return to;
    return moe__is_quant(w->type) && w->type != MOE_T_Q4_0 && w->type != MOE_T_Q8_0 ? w->type : -1;
}

/* Where repack_weights puts the interleaved matrices: one allocation for all of them, filled in
 * load order, in transparent huge pages where the system gives them (Linux, THP not "never").
 * On a Zen 4 virtual machine (where every TLB miss walks two page tables)
 * a decode token over weights in such a block ran 9% faster than over the same weights in one
 * allocation per matrix, 5% faster than in one block of 4 KB pages (the same process, tokens
 * alternating between copies; bench/RESULTS.md). */
typedef struct { unsigned char *p; size_t left; } repack_arena;
#define REPACK_ALIGN 64
#define REPACK_HUGE ((size_t)2 << 20) /* the arena's alignment: x86-64's and AArch64's (4 KB granule) huge page */
static size_t repack_round(size_t bytes) { return (bytes + REPACK_ALIGN - 1) / REPACK_ALIGN * REPACK_ALIGN; }

/* Frees p if the model owns it (a matrix converted at load); 0 if it does not */
static int free_owned(moe_model *m, const void *p) {
    for (int i = 0; i < m->n_owned; i++)
        if (m->owned[i] == p) {
            free(m->owned[i]);
            m->owned[i] = m->owned[--m->n_owned];
            return 1;
        }
    return 0;
}

/* Interleaves a Q4_0/Q8_0 (or MXFP4) matrix 8 rows at a time into RAM the model owns (the layout
 * the x8 kernels want): the arena's next bytes, or its own allocation when the arena has no room.
 * Then lets the source go: its mapped pages are dropped from our resident set, or its owned
 * buffer freed. Rows not a multiple of 8 stay as they are. */
static moe_status repack_weight(moe_model *m, moe__weight *w, repack_arena *a) {
    const int to = placed_type(m, w), copy = to == w->type;
    if (!w->data || to < 0) return MOE_OK;
    const int64_t rb = moe__row_bytes(w->type, w->cols), gb = 8 * moe__row_bytes(to, w->cols), ng = w->rows / 8, sb = w->cols / 32;
    const size_t bytes = copy ? (size_t)(rb * w->rows) : (size_t)(gb * ng);
    unsigned char *dst;
    if (a->p && repack_round(bytes) <= a->left) {
        dst = a->p;
        a->p += repack_round(bytes), a->left -= repack_round(bytes);
    } else {
        if (!(dst = malloc(bytes))) return MOE_ERR_NOMEM;
        if (own(m, dst)) { free(dst); return MOE_ERR_NOMEM; }
    }
#ifdef _OPENMP
#pragma omp parallel for num_threads(m->opt.n_threads) schedule(static) if (m->opt.n_threads > 1 && ng > 64)
#endif
    for (int64_t g = 0; g < (copy ? 0 : ng); g++)
        moe__repack_x8(w->type, (const unsigned char *)w->data + g * 8 * rb, rb, w->scale ? w->scale + g * 8 * sb : NULL, dst + g * gb, w->cols);
    if (copy) memcpy(dst, w->data, bytes);
    if (!free_owned(m, w->data)) {
        drop_mapped(w->data, (size_t)(rb * w->rows));
        if (w->scale) drop_mapped(w->scale, (size_t)(sb * w->rows));
    }
    *w = (moe__weight){to, w->rows, w->cols, dst, NULL};
    return MOE_OK;
}

static void progress(const moe_model *m, const char *stage, int i, int n) {
    if (m->opt.progress) m->opt.progress(m->opt.progress_ud, stage, n > 0 ? (float)i / (float)n : 1.0f);
}

/* The matrices repack_weights may interleave, each given to fn with whether it is a routed
 * expert's (none in cache mode: the cache interleaves each as it reads it); stage: the
 * progress stage to report per layer, or NULL. */
typedef moe_status (*repack_fn)(moe_model *m, moe__weight *w, int expert, void *ud);
static moe_status each_repackable(moe_model *m, repack_fn fn, void *ud, const char *stage) {
    moe_status st = fn(m, &m->lm_head, 0, ud);
    for (int i = 0; i < m->cfg.n_layers && !st; i++) {
        layer *L = &m->layers[i];
        if (stage) progress(m, stage, i, m->cfg.n_layers);
        st = fn(m, &L->router, 0, ud);
        for (size_t k = 0; k < N_DENSE_FIELDS && !st && !L->stream; k++) st = fn(m, layer_matrix(L, k), 0, ud);
        /* absorbed MLA takes k_b and v_b a head at a time: interleaved where a head's rows are
         * whole groups (rows_times) */
        if (!st && L->k_b.data && !L->stream && m->cfg.kv_lora_rank % 8 == 0 && m->cfg.v_head_dim % 8 == 0) {
            st = fn(m, &L->k_b, 0, ud);
            if (!st) st = fn(m, &L->v_b, 0, ud);
        }
        /* gate (w1) and up (w3) side by side: decode's first expert loop reads them one after the
         * other, so a thread's share streams on from one into the next without a new start (0.98-1.0
         * of the time a token against w1, w2, w3: bench/RESULTS.md, "2026-12-01: on Intel the decode kernels
         * prefetch into L2") */
        for (int e = 0; L->experts && !m->opt.expert_mode && e < m->cfg.n_experts && !st; e++) {
            st = fn(m, &L->experts[e].w1, 1, ud);
            if (!st) st = fn(m, &L->experts[e].w3, 1, ud);
            if (!st) st = fn(m, &L->experts[e].w2, 1, ud);
        }
    }
    return st;
}

/* the bytes everything to interleave takes, those of it in routed experts, and those of these
 * read from the files; with the arena's rounding (repack_round) */
typedef struct { uint64_t all, experts, mapped; } repack_count;
static moe_status count_repack(moe_model *m, moe__weight *w, int expert, void *ud) {
    repack_count *c = ud;
    const int to = w->data ? placed_type(m, w) : -1;
    const uint64_t b = to < 0 ? 0 : repack_round((size_t)(to == w->type ? weight_bytes(w) : (uint64_t)w->rows * (uint64_t)moe__row_bytes(to, w->cols)));
    c->all += b;
    if (expert) c->experts += b;
    if (expert && in_mapping(m, w->data)) c->mapped += b;
    return MOE_OK;
}

typedef struct { int experts; repack_arena arena; } repack_plan;
static moe_status repack_one(moe_model *m, moe__weight *w, int expert, void *ud) {
    repack_plan *p = ud;
    return expert && !p->experts ? MOE_OK : repack_weight(m, w, &p->arena);
}

/* Interleaves what the x8 kernels take; the routed experts read from the files only when
 * everything to interleave fits in repack_budget (0: three quarters of the physical RAM;
 * unknown: they do), so a model bigger than RAM is not copied into RAM. */
static moe_status repack_weights(moe_model *m) {
    repack_count c = {0, 0, 0};
    each_repackable(m, count_repack, &c, NULL);
    uint64_t budget = m->opt.repack_budget;
    if (!budget) {
        const long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
        budget = pages > 0 && psz > 0 ? (uint64_t)pages / 4 * 3 * (uint64_t)psz : UINT64_MAX;
    }
    repack_plan p = {!c.mapped || c.all <= budget, {NULL, 0}};
    m->info.experts_kept_mapped = !p.experts;
    const uint64_t bytes = p.experts ? c.all : c.all - c.experts;
    /* without the arena (no room for it in one piece) each matrix gets its own allocation */
    void *arena = NULL;
    if (bytes && bytes <= SIZE_MAX - REPACK_HUGE && !posix_memalign(&arena, REPACK_HUGE, (size_t)bytes)) {
        if (own(m, arena)) { free(arena); return MOE_ERR_NOMEM; }
        p.arena = (repack_arena){arena, (size_t)bytes};
        advise_huge(arena, (size_t)bytes);
    }
    return each_repackable(m, repack_one, &p, "interleaving");
}

static moe_status convert_weights(moe_model *m, char *err, size_t errlen) {
    const int dt = m->opt.dense_type, et = m->opt.expert_type;
    moe_status st = MOE_OK;
    /* the LM head gets Q8_0 when the rest is Q4_0 (as llama.cpp keeps output.weight at higher
     * precision): on the shipped model it takes Q4_0's KL from 2.6e-2 to 1.9e-2 nats/token */
    if (dt) st = convert_weight(m, &m->lm_head, dt == MOE_WTYPE_Q4_0 ? MOE_WTYPE_Q8_0 : dt, err, errlen);
    for (int i = 0; i < m->cfg.n_layers && !st && (dt || et); i++) {
        layer *L = &m->layers[i];
        progress(m, "converting", i, m->cfg.n_layers);
        for (size_t k = 0; k < N_DENSE_FIELDS && !st && dt && !L->stream; k++) /* kv_b stays as stored (moe.h) */
            if (dense_fields[k] != offsetof(layer, kv_b)) st = convert_weight(m, layer_matrix(L, k), dt, err, errlen);
        for (int e = 0; L->experts && et && e < m->cfg.n_experts && !st; e++) {
            st = convert_weight(m, &L->experts[e].w1, et, err, errlen);
            if (!st) st = convert_weight(m, &L->experts[e].w2, et, err, errlen);
            if (!st) st = convert_weight(m, &L->experts[e].w3, et, err, errlen);
        }
    }
    return st;
}

/* ==== expert cache (CACHE mode) ===============================================================
 * Units are read whole with pread into buffers the cache owns, within the caller's budget: a
 * routed expert (its three matrices), or a streamed layer's dense matrices (dense_budget). A unit
 * a step uses is pinned; eviction takes an unpinned one the router's history values least. I/O
 * threads read queued units (the experts the computing layer routed to, guesses for the next MoE
 * layer, the next streamed layer's dense matrices) while the compute threads work. One lock
 * guards the table; reads run without it. */

/* ---- the eviction policy ----
 * The router's history, kept for every routed expert whether resident or not: a use count decayed
 * by half every half_life routing steps of its layer. The cache evicts the unit with the lowest
 * count (LRFU), the least recently used among equals (moe__history_evicts_before). moe-cachesim
 * replays routing traces through these same functions, so what it measures is this policy. */
struct moe__expert_history {
    int units;        /* per layer */
    double half_life; /* routing steps */
    float *count;     /* [n_layers * units]: the decayed count as of at[] */
    uint32_t *at;     /* [n_layers * units]: its layer's step when count was brought up to date */
    uint32_t *steps;  /* [n_layers]: routing steps of each layer so far */
};

moe__expert_history *moe__history_new(int n_layers, int units, double half_life) {
    moe__expert_history *h = xcalloc(1, sizeof *h);
    if (!h || n_layers < 1 || units < 1 || !(half_life > 0)) return free(h), NULL;
    const size_t n = (size_t)n_layers * (size_t)units;
    h->units = units, h->half_life = half_life;
    h->count = xcalloc(n, sizeof *h->count);
    h->at = xcalloc(n, sizeof *h->at);
    h->steps = xcalloc((size_t)n_layers, sizeof *h->steps);
    if (!h->count || !h->at || !h->steps) return moe__history_free(h), NULL;
    return h;
}

void moe__history_free(moe__expert_history *h) {
    if (!h) return;
    free(h->count), free(h->at), free(h->steps), free(h);
}

void moe__history_route(moe__expert_history *h, int layer, const unsigned char *routed, int n) {
    const uint32_t now = ++h->steps[layer];
    for (int u = 0; u < n; u++) {
        if (!routed[u]) continue;
        const size_t id = (size_t)layer * (size_t)h->units + (size_t)u;
        h->count[id] = (float)(h->count[id] * pow(0.5, (double)(now - h->at[id]) / h->half_life) + 1.0);
        h->at[id] = now;
    }
}

double moe__history_score(const moe__expert_history *h, int layer, int unit) {
    const size_t id = (size_t)layer * (size_t)h->units + (size_t)unit;
    return h->count[id] * pow(0.5, (double)(h->steps[layer] - h->at[id]) / h->half_life);
}

int moe__history_evicts_before(double score_a, uint64_t last_a, double score_b, uint64_t last_b) {
    return score_a < score_b || (score_a == score_b && last_a < last_b);
}

typedef struct {
    int id;        /* layer * units + unit */
    int demand;    /* 1: the layer being computed needs it; 0: read ahead */
    int file;
    uint64_t off;  /* where its first tensor starts in that file */
} io_req;

#define SPARE_MAX 8

typedef struct cache_entry {
    int li, e, pins, loading; /* e: an expert, or units - 1 for the layer's dense matrices;
                                 loading: being read by one thread, the others wait */
    int prefetched;           /* read by an I/O thread and not used yet (2: for the layer computing) */
    int failed;               /* an I/O thread's read of it failed (its errno value, EDOM: non-finite
                                 weights): the step that asks gets the error */
    int kx8;                  /* its k-quant/IQ4_XS matrices interleaved as read (unit_repack_kx8) */
    uint64_t last_use;
    size_t bytes;
    unsigned char *buf;
    moe__weight w[UNIT_MAX];  /* the unit's matrices, pointing into buf */
    expert ex;                /* an expert's w[0..2], as the forward pass names them */
} cache_entry;

struct expert_cache {
    pthread_mutex_t lock;
    pthread_cond_t unpinned; /* signalled when a unit's last pin goes, or a read ends */
    int *fds;               /* one per file */
    int *dfds;              /* the same files opened with O_DIRECT, or -1 */
    int units;              /* per layer: n_experts + 1 (the last: the layer's dense matrices) */
    cache_entry **slot;     /* [n_layers * units]: resident entry or NULL */
    cache_entry **resident; /* the resident entries, unordered */
    int n_resident, cap_resident;
    size_t budget, used, peak;
    uint64_t clock;
    /* buffers of evicted units kept for the next unit of the same size (counted in used): a unit
     * read into a fresh mapping first faults in and zeroes every page, and unmapping one interrupts
     * every thread of the process to flush its TLB */
    unsigned char *spare[SPARE_MAX];
    size_t spare_bytes[SPARE_MAX];
    int n_spare;
    int fail_after; /* fault injection: the n-th read from now fails (0: never) */
    int io_hold;    /* tests: the I/O threads take nothing from the queue (moe__cache_hold) */
    size_t direct_min; /* units of at least this many bytes are read with O_DIRECT (DIRECT_MIN) */
    uint64_t bytes_read; /* by every thread since open */
    int reading;         /* reads in flight (I/O threads and steps) */
    double busy_since, busy_total; /* when reading last became nonzero; seconds with reads in flight */
    uint64_t kx8_count;  /* k-quant/IQ4_XS expert matrices interleaved as read, since open */
    /* I/O threads read queued units into free or evictable room, most urgent first (what the
     * current layer needs, then read-ahead), in file and offset order within each class */
    pthread_t *io;
    int n_io, io_stop;
    pthread_cond_t work;
    io_req *queue;
    int qn, qcap;
    int cur_layer, next_layer; /* expert read-ahead for these: unused, it is not evicted by I/O threads */
    moe__expert_history *hist; /* the eviction policy's view of the router */
    int nonfinite_li, nonfinite_e; /* the last unit whose read met a NaN or an infinity (EDOM) */
};


/* Unit buffers: big ones are their own anonymous mappings, returned to the system when they
 * leave the cache (evicted and not kept as a spare), so the budget is what the process really
 * holds (malloc'd blocks of many megabytes freed by other threads linger in per-thread arenas);
 * 4096-aligned for O_DIRECT. */
#define HUGE_PAGE ((size_t)2 << 20) /* x86-64's and AArch64's (4 KB granule) transparent huge page */

static unsigned char *entry_alloc(size_t bytes) {
    if (bytes >= HUGE_PAGE) { /* 2 MB-aligned, so that transparent huge pages can back it */
        const size_t span = bytes + HUGE_PAGE;
        unsigned char *p = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return NULL;
        unsigned char *a = (unsigned char *)(((uintptr_t)p + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
        if (a > p) munmap(p, (size_t)(a - p));
        munmap(a + bytes, (size_t)(p + span - (a + bytes)));
        advise_huge(a, bytes);
        return a;
    }
    if (bytes >= (1u << 20)) {
        void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        return p == MAP_FAILED ? NULL : p;
    }
    void *p = NULL;
    return posix_memalign(&p, 4096, bytes ? bytes : 1) ? NULL : p;
}

static void entry_free(unsigned char *p, size_t bytes) {
    if (!p) return;
    if (bytes >= (1u << 20)) munmap(p, bytes);
    else free(p);
}

/* a spare buffer of exactly bytes, or -1 */
static int spare_find(const struct expert_cache *k, size_t bytes) {
    for (int i = 0; i < k->n_spare; i++)
        if (k->spare_bytes[i] == bytes) return i;
    return -1;
}

/* spare i out of the list (its bytes still in used) */
static unsigned char *spare_take(struct expert_cache *k, int i) {
    unsigned char *p = k->spare[i];
    k->n_spare--;
    k->spare[i] = k->spare[k->n_spare], k->spare_bytes[i] = k->spare_bytes[k->n_spare];
    return p;
}

/* gives back spare i: its bytes leave the budget */
static void spare_release(struct expert_cache *k, int i) {
    const size_t bytes = k->spare_bytes[i];
    entry_free(spare_take(k, i), bytes);
    k->used -= bytes;
}

/* whether a unit of bytes can have a buffer now: a spare of its size, or room in the budget once
 * spares of other sizes are given back */
static int spare_or_room(struct expert_cache *k, size_t bytes) {
    if (spare_find(k, bytes) >= 0) return 1;
    while (k->n_spare && k->used + bytes > k->budget) spare_release(k, 0);
    return k->used + bytes <= k->budget;
}

/* a buffer for a unit of bytes (after spare_or_room): a spare of its size, else a new one whose
 * bytes join used */
static unsigned char *entry_get(struct expert_cache *k, size_t bytes) {
    const int i = spare_find(k, bytes);
    if (i >= 0) return spare_take(k, i);
    unsigned char *p = entry_alloc(bytes);
    if (p) k->used += bytes;
    return p;
}

static void cache_free(moe_model *m) {
    struct expert_cache *c = m->cache;
    if (!c) return;
    if (c->n_io) {
        pthread_mutex_lock(&c->lock);
        c->io_stop = 1;
        pthread_cond_broadcast(&c->work);
        pthread_mutex_unlock(&c->lock);
        for (int i = 0; i < c->n_io; i++) pthread_join(c->io[i], NULL);
    }
    free(c->io);
    free(c->queue);
    pthread_cond_destroy(&c->work);
    for (int i = 0; i < c->n_resident; i++) entry_free(c->resident[i]->buf, c->resident[i]->bytes), free(c->resident[i]);
    for (int i = 0; i < c->n_spare; i++) entry_free(c->spare[i], c->spare_bytes[i]);
    for (int i = 0; c->fds && i < m->n_files; i++)
        if (c->fds[i] >= 0) close(c->fds[i]);
    for (int i = 0; c->dfds && i < m->n_files; i++)
        if (c->dfds[i] >= 0) close(c->dfds[i]);
    free(c->fds), free(c->dfds), free(c->slot), free(c->resident);
    moe__history_free(c->hist);
    pthread_mutex_destroy(&c->lock);
    pthread_cond_destroy(&c->unpinned);
    free(c);
    m->cache = NULL;
}

#define IO_ALIGN 4096
#define DIRECT_MIN (1u << 20) /* smaller units are read through the page cache, unaligned */

static void *cache_io_main(void *arg);
static void queue_drop(struct expert_cache *k, size_t id);
static size_t unit_bytes(const moe_model *m, const moe__weight *const *w, int nw, int expert);

static size_t unit_id(const struct expert_cache *k, int li, int e) { return (size_t)li * (size_t)k->units + (size_t)e; }

static moe_status cache_open(moe_model *m, char *err, size_t errlen) {
    const moe_config *c = &m->cfg;
    struct expert_cache *k = xcalloc(1, sizeof *k);
    if (!k) return MOE_ERR_NOMEM;
    m->cache = k;
    k->direct_min = DIRECT_MIN;
    pthread_mutex_init(&k->lock, NULL);
    pthread_cond_init(&k->unpinned, NULL);
    pthread_cond_init(&k->work, NULL);
    k->budget = m->opt.expert_budget;
    k->units = c->n_experts + 1;
    k->fds = malloc(sizeof(int) * (size_t)m->n_files);
    const size_t n_ids = (size_t)c->n_layers * (size_t)k->units;
    k->slot = xcalloc(n_ids, sizeof *k->slot);
    k->hist = moe__history_new(c->n_layers, k->units, MOE_HISTORY_HALF_LIFE);
    if (!k->fds || !k->slot || !k->hist) return MOE_ERR_NOMEM;
    for (int i = 0; i < m->n_files; i++) k->fds[i] = -1;
    for (int i = 0; i < m->n_files; i++) {
        moe_status st = open_regular(m->files[i].path, 0, &k->fds[i], err, errlen);
        if (st) return st;
    }
    /* O_DIRECT where the file system allows it: unit reads bypass the page cache, so the cache
     * the caller budgeted is the only copy (no double caching) */
    if (!(k->dfds = malloc(sizeof(int) * (size_t)m->n_files))) return MOE_ERR_NOMEM;
    for (int i = 0; i < m->n_files; i++) {
        k->dfds[i] = -1;
#ifdef O_DIRECT
        if (!(m->opt.flags & MOE_FLAG_NO_DIRECT_IO) && open_regular(m->files[i].path, O_DIRECT, &k->dfds[i], NULL, 0)) k->dfds[i] = -1;
#endif
    }
    /* what one step holds at once: an expert per compute thread (experts run in parallel) and
     * the computing layer's dense matrices when that layer streams */
    uint64_t biggest = 0, dense = 0;
    for (int l = 0; l < c->n_layers; l++) {
        const moe__weight *w[UNIT_MAX];
        for (int e = 0; m->layers[l].experts && e < c->n_experts; e++) {
            const int nw = unit_weights(m, l, e, w, NULL);
            const uint64_t b = unit_bytes(m, w, nw, 1);
            biggest = b > biggest ? b : biggest;
        }
        if (m->layers[l].stream) {
            const int nw = unit_weights(m, l, c->n_experts, w, NULL);
            const uint64_t b = unit_bytes(m, w, nw, 0);
            dense = b > dense ? b : dense;
        }
    }
    const uint64_t need = biggest * (uint64_t)m->opt.n_threads + dense;
    if (m->opt.expert_budget < need)
        return fail(err, errlen, MOE_ERR_ARG, "expert budget of %zu bytes is too small: a step needs %d expert(s) of %llu bytes%s at once",
                    m->opt.expert_budget, m->opt.n_threads, (unsigned long long)biggest,
                    dense ? " and a streamed layer's dense matrices" : "");
    k->cur_layer = k->next_layer = -1;
    const int nio = m->opt.io_threads < 0 ? 4 : m->opt.io_threads;
    if (nio > 0) {
        k->qcap = 4 * c->n_experts + 16;
        if (!(k->queue = malloc(sizeof *k->queue * (size_t)k->qcap)) || !(k->io = calloc((size_t)nio, sizeof *k->io))) return MOE_ERR_NOMEM;
        for (int i = 0; i < nio; i++) {
            if (pthread_create(&k->io[i], NULL, cache_io_main, m)) return fail(err, errlen, MOE_ERR_NOMEM, "cannot start I/O thread %d", i);
            k->n_io++;
        }
    }
    return MOE_OK;
}


static void cache_evict(struct expert_cache *k, cache_entry *v) {
    k->slot[unit_id(k, v->li, v->e)] = NULL;
    for (int i = 0; i < k->n_resident; i++)
        if (k->resident[i] == v) { k->resident[i] = k->resident[--k->n_resident]; break; }
    if (v->buf && k->n_spare < SPARE_MAX) { /* kept, still counted in used */
        k->spare[k->n_spare] = v->buf, k->spare_bytes[k->n_spare++] = v->bytes;
    } else {
        k->used -= v->bytes;
        entry_free(v->buf, v->bytes);
    }
    free(v);
}

static int cache_room(struct expert_cache *k) { /* one more resident entry; 0 on success */
    if (k->n_resident < k->cap_resident) return 0;
    int cap = k->cap_resident ? 2 * k->cap_resident : 64;
    cache_entry **r = realloc(k->resident, sizeof *r * (size_t)cap);
    if (!r) return 1;
    k->resident = r, k->cap_resident = cap;
    return 0;
}

/* The unit that may go. A streamed layer's dense matrices once used go first: every other
 * layer comes before their next use (what the offline optimum would evict). Then experts, the
 * lowest by the router's decayed history (LRFU; moe-cachesim measured it against LRU, LFU and the
 * offline optimum), the least recently used among equals. Read-ahead not used yet goes last
 * (dense matrices, and experts for the layer being computed or, for an I/O thread, the next MoE
 * layer): an I/O thread never evicts it (read-ahead must not evict read-ahead that is about to be
 * used), a compute thread only when nothing else can go. */
static cache_entry *cache_lru(struct expert_cache *k, int io) {
    cache_entry *best = NULL, *ahead = NULL;
    double bs = 0, as = 0;
    for (int i = 0; i < k->n_resident; i++) {
        cache_entry *v = k->resident[i];
        if (v->pins || v->loading || v->failed) continue;
        const int dense = v->e == k->units - 1;
        const double sc = dense ? -1.0 : moe__history_score(k->hist, v->li, v->e);
        if (v->prefetched && (dense || v->li == k->cur_layer || (io && v->li == k->next_layer))) {
            if (!io && (!ahead || moe__history_evicts_before(sc, v->last_use, as, ahead->last_use))) ahead = v, as = sc;
            continue;
        }
        if (!best || moe__history_evicts_before(sc, v->last_use, bs, best->last_use)) best = v, bs = sc;
    }
    return best ? best : ahead;
}

/* The file stretch [start, end) holding all of a unit's tensors, for one read per unit when they
 * are adjacent in one file (an expert in K3's layout; GGUF's merged experts are not: their w1, w2
 * and w3 rows lie far apart); 0 when they are not. Widened to IO_ALIGN (*direct = 1) when the unit
 * is big enough to be worth an O_DIRECT read and the file was opened for one. */
static int unit_span(const moe_model *m, const moe__weight *const *w, int nw, int *file, uint64_t *start, uint64_t *end, int *direct) {
    const unsigned char *lo = NULL, *hi = NULL;
    uint64_t bytes = 0;
    for (int i = 0; i < nw; i++) {
        const unsigned char *p[2] = {w[i]->data, w[i]->scale};
        const size_t n[2] = {(size_t)weight_data_bytes(w[i]), (size_t)weight_scale_bytes(w[i])};
        for (int j = 0; j < 2; j++) {
            if (!p[j]) continue;
            bytes += n[j];
            if (!lo || p[j] < lo) lo = p[j];
            if (!hi || p[j] + n[j] > hi) hi = p[j] + n[j];
        }
    }
    const int f = lo ? mapped_file(m, lo, (uint64_t)(hi - lo)) : -1;
    if (f < 0 || (uint64_t)(hi - lo) > bytes + bytes / 8 + IO_ALIGN) return 0; /* not in one file, or not adjacent */
    for (int i = 0; i < nw; i++) /* unit_repack rewrites an interleaved MXFP4 matrix over its codes and then its scales */
        if (w[i]->scale && x8_type(m, w[i]) >= 0 && w[i]->scale != (const unsigned char *)w[i]->data + weight_data_bytes(w[i])) return 0;
    const unsigned char *b = m->files[f].map;
    *file = f, *start = (uint64_t)(lo - b), *end = (uint64_t)(hi - b);
    *direct = m->cache && bytes >= m->cache->direct_min && m->cache->dfds && m->cache->dfds[f] >= 0;
    if (*direct) *start &= ~(uint64_t)(IO_ALIGN - 1), *end = (*end + IO_ALIGN - 1) & ~(uint64_t)(IO_ALIGN - 1);
    return 1;
}

/* A unit whose tensors are not adjacent is read piece by piece (each matrix's data, then its
 * MXFP4 scales); with O_DIRECT, each piece as the IO_ALIGN-aligned stretch around it, placed at
 * an aligned offset of the buffer. */
typedef struct {
    int file, direct;
    uint64_t start, end, need; /* the file stretch read; need: how much of it must exist */
    size_t at, skip;           /* it lands at buf + at; the piece's first byte is at buf + at + skip */
} unit_piece;

static int unit_pieces(const moe_model *m, const moe__weight *const *w, int nw, unit_piece *pc, size_t *bytes) {
    uint64_t total = 0;
    for (int i = 0; i < nw; i++) total += weight_bytes(w[i]);
    int np = 0;
    size_t at = 0;
    for (int i = 0; i < nw; i++)
        for (int j = 0; j < 2; j++) {
            const unsigned char *p = j ? w[i]->scale : w[i]->data;
            const uint64_t n = j ? weight_scale_bytes(w[i]) : weight_data_bytes(w[i]);
            if (!p) continue;
            const int f = mapped_file(m, p, n);
            if (f < 0) return -1;
            unit_piece *q = &pc[np++];
            q->file = f, q->start = (uint64_t)(p - (const unsigned char *)m->files[f].map), q->end = q->start + n, q->need = n, q->skip = 0;
            q->direct = m->cache && total >= m->cache->direct_min && m->cache->dfds && m->cache->dfds[f] >= 0;
            if (q->direct) {
                const uint64_t a = q->start & ~(uint64_t)(IO_ALIGN - 1);
                q->skip = (size_t)(q->start - a), q->need = q->skip + n;
                q->start = a, q->end = (q->end + IO_ALIGN - 1) & ~(uint64_t)(IO_ALIGN - 1);
                at = (at + IO_ALIGN - 1) & ~(size_t)(IO_ALIGN - 1);
            }
            q->at = at;
            at += (size_t)(q->end - q->start);
        }
    *bytes = at;
    return np;
}

/* where each matrix's data lands in a unit's buffer as read (off[i]), and how many bytes are read;
 * -1 when the unit cannot be read */
static int unit_read_layout(const moe_model *m, const moe__weight *const *w, int nw, size_t *off, size_t *bytes) {
    int f, direct;
    uint64_t a, b;
    if (unit_span(m, w, nw, &f, &a, &b, &direct)) {
        for (int i = 0; i < nw; i++) off[i] = (size_t)((const unsigned char *)w[i]->data - ((const unsigned char *)m->files[f].map + a));
        *bytes = (size_t)(b - a);
        return 0;
    }
    unit_piece pc[2 * UNIT_MAX];
    const int np = unit_pieces(m, w, nw, pc, bytes);
    if (np < 0) return -1;
    for (int i = 0, p = 0; i < nw; i++) {
        off[i] = pc[p].at + pc[p].skip;
        p += w[i]->scale ? 2 : 1;
    }
    return 0;
}

/* An expert unit's matrices once interleaved: the k-quant and IQ4_XS ones where the level has the
 * kernels (all but Q2_K and Q6_K take a little more room interleaved, so each matrix moves to
 * new_off[i] >= off[i], in offset order, clear of the one before); to[i] the interleaved type of
 * each such matrix (-1: the others), order[] the matrices by offset. Returns the end of that
 * layout, or 0 when no matrix is interleaved this way (a unit with MXFP4 scales apart is left to
 * unit_repack's in-place path). */
static size_t unit_kx8_layout(const moe_model *m, const moe__weight *const *w, int nw, const size_t *off, size_t *new_off, int *to,
                              int *order) {
    int any = 0;
    for (int i = 0; i < nw; i++) {
        const int t = m->opt.flags & MOE_FLAG_NO_REPACK ? -1 : x8_type(m, w[i]);
        to[i] = t >= 0 && is_kx8(t) ? t : -1;
        any |= to[i] >= 0;
        if (w[i]->scale) return 0;
        order[i] = i;
    }
    if (!any) return 0;
    for (int i = 1; i < nw; i++) /* by offset */
        for (int j = i; j > 0 && off[order[j]] < off[order[j - 1]]; j--) {
            const int t = order[j];
            order[j] = order[j - 1], order[j - 1] = t;
        }
    size_t end = 0;
    for (int k = 0; k < nw; k++) {
        const int i = order[k];
        const size_t n = to[i] >= 0 ? (size_t)(w[i]->rows * moe__row_bytes(to[i], w[i]->cols)) : (size_t)weight_data_bytes(w[i]);
        new_off[i] = off[i] > end ? off[i] : end;
        end = new_off[i] + n;
    }
    return end;
}

/* the buffer size an entry for the unit needs (expert: a routed expert's, which unit_repack
 * interleaves): what is read, or the interleaved layout where larger, rounded up to whole huge
 * pages when that adds at most an eighth (the kernels streamed a cached expert 13-15% faster from
 * huge pages, bench/RESULTS.md "2026-12-02: sampling without a full sort"; a unit's 4 KB-page tail still costs TLB misses) */
static size_t unit_bytes(const moe_model *m, const moe__weight *const *w, int nw, int expert) {
    size_t off[UNIT_MAX], new_off[UNIT_MAX], bytes = 0;
    int to[UNIT_MAX], order[UNIT_MAX];
    if (unit_read_layout(m, w, nw, off, &bytes)) return 0;
    if (expert) {
        const size_t end = unit_kx8_layout(m, w, nw, off, new_off, to, order);
        bytes = end > bytes ? end : bytes;
    }
    const size_t whole = (bytes + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
    return bytes >= HUGE_PAGE && whole - bytes <= bytes / 8 ? whole : bytes;
}

/* [start, end) of file f into dst, with O_DIRECT when asked and the file has it (then dst,
 * start and end are IO_ALIGN-aligned and the last block may run past the end of the file: need
 * is what must be there) */
static int span_read(struct expert_cache *k, int f, uint64_t start, uint64_t end, uint64_t need, int direct, unsigned char *dst) {
    int fd = direct ? k->dfds[f] : k->fds[f];
    for (uint64_t done = 0; done < end - start;) {
        ssize_t r = pread(fd, dst + done, (size_t)(end - start - done), (off_t)(start + done));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && errno == EINVAL && fd != k->fds[f]) { fd = k->fds[f]; continue; } /* no O_DIRECT here after all */
        if (r < 0) return errno;
        if (r == 0) return done >= need ? 0 : EIO; /* end of file: fine past the last tensor, else it shrank */
        done += (uint64_t)r;
    }
    return 0;
}

/* The k-quant and IQ4_XS matrices of an expert read into v->buf, interleaved where
 * unit_kx8_layout puts them (unit_bytes sized the buffer for it): from the last matrix to the
 * first, and within one from its last row group to its first, so that nothing is overwritten
 * before it is read (every matrix and group moves to the same place or further on); matrices that
 * stay as stored move with them. 0, or ENOMEM. */
static int unit_repack_kx8(const moe_model *m, cache_entry *v, int nw) {
    size_t off[UNIT_MAX], new_off[UNIT_MAX];
    int to[UNIT_MAX], order[UNIT_MAX];
    const moe__weight *w[UNIT_MAX];
    for (int i = 0; i < nw; i++) w[i] = &v->w[i], off[i] = (size_t)((const unsigned char *)v->w[i].data - v->buf);
    const size_t end = unit_kx8_layout(m, w, nw, off, new_off, to, order);
    if (!end || end > v->bytes) return 0; /* nothing to interleave so (or no room: kept as stored) */
    for (int k = nw - 1; k >= 0; k--) { /* the matrix with the highest offset first */
        const int i = order[k];
        moe__weight *x = &v->w[i];
        unsigned char *src = v->buf + off[i], *dst = v->buf + new_off[i];
        if (to[i] >= 0) {
            const int64_t rb = moe__row_bytes(x->type, x->cols), gb = 8 * rb, gx = 8 * moe__row_bytes(to[i], x->cols);
            unsigned char *tmp = malloc((size_t)gb);
            if (!tmp) return ENOMEM;
            for (int64_t g = x->rows / 8 - 1; g >= 0; g--) {
                memcpy(tmp, src + g * gb, (size_t)gb);
                moe__repack_x8(x->type, tmp, rb, NULL, dst + g * gx, x->cols);
            }
            free(tmp);
            *x = (moe__weight){to[i], x->rows, x->cols, dst, NULL};
            v->kx8++;
        } else if (dst != src) {
            memmove(dst, src, (size_t)weight_data_bytes(x));
            x->data = dst;
        }
    }
    return 0;
}

/* Interleaves the matrices of a unit just read 8 rows at a time, as repack_weight does at load
 * for what stays mapped or resident, so a cached expert runs the same x8 kernels as a mapped
 * one: the same sums in the same order, the same logits whichever mode loads it. The k-quants and
 * IQ4_XS first (unit_repack_kx8), then in place the rest: a group of 8 Q4_0/Q8_0/ggml MXFP4 rows
 * takes the same bytes in either layout. A compressed-tensors
 * MXFP4 matrix becomes x8 blocks over its codes and, right after them, as many bytes again as
 * its scales take: its scales themselves when the unit was read in one stretch (unit_span asks
 * for that), else alignment padding and the scales' own piece (unit_pieces puts it after the
 * codes').
 * Its scales are set aside first, then its row groups are rewritten from the last: group g's
 * blocks start no earlier than its own codes (copied aside too), so the codes of the groups
 * before it are still in place when their turn comes. Rows not a multiple of 8 stay as they
 * are. */
static int unit_repack(const moe_model *m, cache_entry *v, int nw) {
    if (unit_repack_kx8(m, v, nw)) return ENOMEM;
    for (int i = 0; i < nw; i++) {
        moe__weight *w = &v->w[i];
        const int to = x8_type(m, w);
        if (to < 0 || is_kx8(to)) continue; /* (a k-quant left as stored: its row kernels give the same sums) */
        const int64_t rb = moe__row_bytes(w->type, w->cols), gb = 8 * moe__row_bytes(to, w->cols), ng = w->rows / 8, sb = w->cols / 32;
        const size_t scales = (size_t)weight_scale_bytes(w);
        unsigned char *tmp = malloc((size_t)(8 * rb) + scales), *p = (unsigned char *)w->data;
        if (!tmp) return ENOMEM;
        if (scales) { /* compressed-tensors: codes [rows, cols/2], then scales [rows, cols/32] */
            uint8_t *sc = tmp + 8 * rb;
            memcpy(sc, w->scale, scales);
            for (int64_t g = ng - 1; g >= 0; g--) {
                memcpy(tmp, p + g * 8 * rb, (size_t)(8 * rb));
                moe__repack_x8(w->type, tmp, rb, sc + g * 8 * sb, p + g * gb, w->cols);
            }
        } else
            for (int64_t g = 0; g < ng; g++) {
                moe__repack_x8(w->type, p + g * gb, rb, NULL, tmp, w->cols);
                memcpy(p + g * gb, tmp, (size_t)gb);
            }
        free(tmp);
        *w = (moe__weight){to, w->rows, w->cols, p, NULL};
    }
    return 0;
}

/* reads the unit's tensors into v->buf (one read of the whole stretch when they are adjacent,
 * else piece by piece); the entry's matrices point into the buffer */
static int unit_fill(const moe_model *m, struct expert_cache *k, const moe__weight *const *w, int nw, cache_entry *v) {
    int f, direct, rc = 0;
    uint64_t start, end;
    if (unit_span(m, w, nw, &f, &start, &end, &direct)) {
        const unsigned char *base = (const unsigned char *)m->files[f].map + start;
        uint64_t need = 0;
        for (int i = 0; i < nw; i++) {
            v->w[i] = *w[i];
            v->w[i].data = v->buf + ((const unsigned char *)w[i]->data - base);
            uint64_t e = (uint64_t)((const unsigned char *)w[i]->data - base) + weight_data_bytes(w[i]);
            if (w[i]->scale) {
                v->w[i].scale = v->buf + ((const unsigned char *)w[i]->scale - base);
                const uint64_t es = (uint64_t)((const unsigned char *)w[i]->scale - base) + weight_scale_bytes(w[i]);
                e = es > e ? es : e;
            }
            need = e > need ? e : need;
        }
        rc = span_read(k, f, start, end, need, direct, v->buf);
    } else {
        unit_piece pc[2 * UNIT_MAX];
        size_t bytes;
        const int np = unit_pieces(m, w, nw, pc, &bytes);
        if (np < 0) return EINVAL;
        for (int i = 0, p = 0; i < nw && !rc; i++) {
            v->w[i] = *w[i];
            rc = span_read(k, pc[p].file, pc[p].start, pc[p].end, pc[p].need, pc[p].direct, v->buf + pc[p].at);
            v->w[i].data = v->buf + pc[p].at + pc[p].skip;
            p++;
            if (!rc && w[i]->scale) {
                rc = span_read(k, pc[p].file, pc[p].start, pc[p].end, pc[p].need, pc[p].direct, v->buf + pc[p].at);
                v->w[i].scale = v->buf + pc[p].at + pc[p].skip;
                p++;
            }
        }
    }
    /* a routed expert's matrices (a streamed layer's dense ones stay as stored, as at load, where
     * the absorbed MLA reads kv_b's rows) */
    /* a unit's float matrices are checked as they arrive, so a NaN or an infinity on disk is
     * reported by the read that meets it (EDOM), like a failed read, not computed with */
    for (int i = 0; i < nw && !rc; i++)
        if (weight_nonfinite(&v->w[i])) rc = EDOM;
    if (!rc && v->e < m->cfg.n_experts && !(m->opt.flags & MOE_FLAG_NO_REPACK)) rc = unit_repack(m, v, nw);
    if (nw == 3) v->ex = (expert){v->w[0], v->w[1], v->w[2]};
    return rc;
}

/* what a failed unit read (unit_fill's errno value) reports */
static moe_status unit_status(int rc) { return rc == EDOM ? MOE_ERR_NUMERIC : MOE_ERR_IO; }

/* a read from the files starts or ends (the caller holds the lock): the time with at least one in
 * flight is summed (moe_step_stats.io_busy_seconds) */
static void reads_begin(struct expert_cache *k) {
    if (k->reading++ == 0) k->busy_since = now_sec();
}

static void reads_end(struct expert_cache *k) {
    if (--k->reading == 0) k->busy_total += now_sec() - k->busy_since;
}

/* seconds with reads in flight since open, the current stretch included */
static double cache_busy_seconds(const moe_model *m) {
    if (!m->cache) return 0;
    struct expert_cache *k = m->cache;
    pthread_mutex_lock(&k->lock);
    const double b = k->busy_total + (k->reading ? now_sec() - k->busy_since : 0);
    pthread_mutex_unlock(&k->lock);
    return b;
}

/* makes unit (li, e) resident and pinned; *out is valid until cache_put. Counted in stats: an
 * expert as a hit or a miss, dense matrices as a read when they came from disk for this use. */
static moe_status cache_get(const moe_model *m, int li, int e, cache_entry **out, moe_step_stats *stats) {
    struct expert_cache *k = m->cache;
    const size_t id = unit_id(k, li, e);
    const int dense = e == k->units - 1;
    const moe__weight *src[UNIT_MAX];
    const int nw = unit_weights(m, li, e, src, NULL);
    const size_t bytes = unit_bytes(m, src, nw, !dense);
    pthread_mutex_lock(&k->lock);
    cache_entry *v;
    int waited = 0; /* it was being read when this step asked for it: a miss, partly hidden */
    for (;;) {
        if ((v = k->slot[id])) {
            if (v->loading) { /* another thread is reading it: wait for the outcome */
                const double t0 = now_sec();
                pthread_cond_wait(&k->unpinned, &k->lock);
                if (stats) stats->io_seconds += now_sec() - t0;
                waited = 1;
                continue;
            }
            if (v->failed) { /* read by an I/O thread, which failed: this step reports it */
                const int rc = v->failed;
                if (rc == EDOM) k->nonfinite_li = li, k->nonfinite_e = e;
                cache_evict(k, v);
                pthread_mutex_unlock(&k->lock);
                return unit_status(rc);
            }
            v->pins++;
            v->last_use = ++k->clock;
            if (stats && dense) stats->dense_reads += waited || v->prefetched;
            else if (stats) {
                if (waited || v->prefetched == 2) stats->cache_misses++; /* read because this layer asked */
                else stats->cache_hits++;
            }
            v->prefetched = 0;
            *out = v;
            pthread_mutex_unlock(&k->lock);
            return MOE_OK;
        }
        if (spare_or_room(k, bytes)) break;
        cache_entry *lru = cache_lru(k, 0);
        if (lru) cache_evict(k, lru);
        /* all pinned by steps running on other threads (each holds at most one expert while it
         * asks for another, and the budget holds one per thread of a step): wait for one to go */
        else pthread_cond_wait(&k->unpinned, &k->lock);
    }
    if (cache_room(k)) { pthread_mutex_unlock(&k->lock); return MOE_ERR_NOMEM; }
    v = xcalloc(1, sizeof *v);
    unsigned char *buf = v ? entry_get(k, bytes) : NULL;
    if (!buf) {
        free(v);
        pthread_mutex_unlock(&k->lock);
        return MOE_ERR_NOMEM;
    }
    /* reserve the slot and the bytes, then read without the lock: other threads read other
     * units at the same time, and wait for this one if they want it too */
    v->li = li, v->e = e, v->pins = 1, v->loading = 1, v->last_use = ++k->clock, v->bytes = bytes, v->buf = buf;
    k->slot[id] = v;
    k->resident[k->n_resident++] = v;
    k->peak = k->used > k->peak ? k->used : k->peak;
    /* a queued read of it is done here: left queued, an I/O thread would read it again after its
     * eviction, for no one, and a failure of that read would go to whichever later step asked for
     * the unit (the test's injected faults landed there: tests cache_faults) */
    queue_drop(k, id);
    const int inject = k->fail_after > 0 && --k->fail_after == 0;
    reads_begin(k);
    pthread_mutex_unlock(&k->lock);

    double t0 = now_sec();
    int rc = inject ? EIO : unit_fill(m, k, src, nw, v);
    const double dt = now_sec() - t0;

    pthread_mutex_lock(&k->lock);
    reads_end(k);
    if (stats) stats->io_seconds += dt;
    if (!rc) k->bytes_read += bytes, k->kx8_count += (uint64_t)v->kx8;
    if (rc) { /* a failed read leaves nothing behind: the slot is free for a later try */
        if (rc == EDOM) k->nonfinite_li = li, k->nonfinite_e = e;
        cache_evict(k, v);
        pthread_cond_broadcast(&k->unpinned);
        pthread_mutex_unlock(&k->lock);
        return unit_status(rc);
    }
    v->loading = 0;
    if (stats && dense) stats->dense_reads++;
    else if (stats) stats->cache_misses++;
    pthread_cond_broadcast(&k->unpinned);
    *out = v;
    pthread_mutex_unlock(&k->lock);
    return MOE_OK;
}

static void cache_put(const moe_model *m, int li, int e) {
    struct expert_cache *k = m->cache;
    pthread_mutex_lock(&k->lock);
    cache_entry *v = k->slot[unit_id(k, li, e)];
    if (v && v->pins > 0 && --v->pins == 0) pthread_cond_broadcast(&k->unpinned);
    pthread_mutex_unlock(&k->lock);
}

void moe__set_direct_min(moe_model *m, size_t bytes) {
    if (m && m->cache) m->cache->direct_min = bytes;
}

void moe__fail_expert_read(moe_model *m, int n) {
    if (!m || !m->cache) return;
    pthread_mutex_lock(&m->cache->lock);
    m->cache->fail_after = n > 0 ? n : 0;
    pthread_mutex_unlock(&m->cache->lock);
}

void moe__cache_hold(moe_model *m, int hold) {
    if (!m || !m->cache) return;
    pthread_mutex_lock(&m->cache->lock);
    m->cache->io_hold = hold;
    pthread_cond_broadcast(&m->cache->work);
    pthread_mutex_unlock(&m->cache->lock);
}

int moe__cache_queued(const moe_model *m, int *layer, int *unit, int *demand, int max) {
    if (!m || !m->cache) return 0;
    struct expert_cache *k = m->cache;
    pthread_mutex_lock(&k->lock);
    const int n = k->qn;
    for (int i = 0; i < n && i < max; i++)
        layer[i] = (int)(k->queue[i].id / k->units), unit[i] = (int)(k->queue[i].id % k->units), demand[i] = k->queue[i].demand;
    pthread_mutex_unlock(&k->lock);
    return n;
}

uint64_t moe__expert_kx8_count(const moe_model *m) {
    if (!m || !m->cache) return 0;
    pthread_mutex_lock(&m->cache->lock);
    const uint64_t n = m->cache->kx8_count;
    pthread_mutex_unlock(&m->cache->lock);
    return n;
}

void moe__expert_cache_usage(const moe_model *m, size_t *now, size_t *peak) {
    *now = *peak = 0;
    if (!m || !m->cache) return;
    pthread_mutex_lock(&m->cache->lock);
    *now = m->cache->used, *peak = m->cache->peak;
    pthread_mutex_unlock(&m->cache->lock);
}

/* The file and offset of a unit's first matrix (for ordering reads). */
static void unit_where(const moe_model *m, int li, int e, int *file, uint64_t *off) {
    const moe__weight *w[UNIT_MAX];
    const unsigned char *p = unit_weights(m, li, e, w, NULL) ? w[0]->data : NULL;
    const int f = p ? mapped_file(m, p, 1) : -1;
    *file = f < 0 ? m->n_files : f;
    *off = f < 0 ? 0 : (uint64_t)(p - (const unsigned char *)m->files[f].map);
}

/* the most urgent queued read: demand before read-ahead, then file, then offset */
static io_req cache_take(struct expert_cache *k) {
    int best = 0;
    for (int i = 1; i < k->qn; i++) {
        const io_req *a = &k->queue[i], *b = &k->queue[best];
        if (a->demand != b->demand ? a->demand > b->demand : a->file != b->file ? a->file < b->file : a->off < b->off) best = i;
    }
    io_req r = k->queue[best];
    k->queue[best] = k->queue[--k->qn];
    return r;
}

/* An I/O thread: takes the most urgent queued unit and reads it into room that is free or can
 * be made by evicting a unit nobody is about to use (never by waiting: a read that does not fit
 * is dropped, and the step reads that unit itself when it gets there). */
static void *cache_io_main(void *arg) {
    const moe_model *m = arg;
    struct expert_cache *k = m->cache;
    pthread_mutex_lock(&k->lock);
    for (;;) {
        while (!k->io_stop && (!k->qn || k->io_hold)) pthread_cond_wait(&k->work, &k->lock);
        if (k->io_stop) break;
        const io_req rq = cache_take(k);
        if (k->slot[rq.id]) continue;
        const int li = rq.id / k->units, e = rq.id % k->units;
        const moe__weight *src[UNIT_MAX];
        const int nw = unit_weights(m, li, e, src, NULL);
        const size_t bytes = unit_bytes(m, src, nw, e < k->units - 1);
        cache_entry *lru;
        int room;
        while (!(room = spare_or_room(k, bytes)) && (lru = cache_lru(k, 1))) cache_evict(k, lru);
        if (!room || cache_room(k)) continue;
        cache_entry *v = xcalloc(1, sizeof *v);
        unsigned char *buf = v ? entry_get(k, bytes) : NULL;
        if (!buf) { free(v); continue; }
        v->li = li, v->e = e, v->loading = 1, v->prefetched = rq.demand ? 2 : 1, v->last_use = ++k->clock, v->bytes = bytes, v->buf = buf;
        k->slot[rq.id] = v;
        k->resident[k->n_resident++] = v;
        k->peak = k->used > k->peak ? k->used : k->peak;
        /* fault injection counts the reads a step needs (its own and demand reads), not guesses */
        const int inject = rq.demand && k->fail_after > 0 && --k->fail_after == 0;
        reads_begin(k);
        pthread_mutex_unlock(&k->lock);
        int rc = inject ? EIO : unit_fill(m, k, src, nw, v);
        pthread_mutex_lock(&k->lock);
        reads_end(k);
        v->loading = 0;
        if (rc) { /* kept as an empty marker (no budget), so that the step that wants it reports the error */
            entry_free(v->buf, v->bytes);
            v->buf = NULL, v->failed = rc, v->prefetched = 0;
            k->used -= v->bytes;
            v->bytes = 0;
        } else {
            k->bytes_read += bytes, k->kx8_count += (uint64_t)v->kx8;
        }
        pthread_cond_broadcast(&k->unpinned);
    }
    pthread_mutex_unlock(&k->lock);
    return NULL;
}

/* where unit id's read waits in the queue, or -1. The caller holds the lock. */
static int queue_find(const struct expert_cache *k, size_t id) {
    for (int i = 0; i < k->qn; i++)
        if (k->queue[i].id == (int)id) return i;
    return -1;
}

/* Queues a read of unit (li, e) unless it is resident or queued (then its urgency is raised
 * to demand if asked); 1 when queued. The caller holds the lock. */
static int queue_push(const moe_model *m, struct expert_cache *k, int li, int e, int demand) {
    const int id = (int)unit_id(k, li, e);
    if (k->slot[id]) return 0;
    const int q = queue_find(k, (size_t)id);
    if (q >= 0) { k->queue[q].demand |= demand; return 0; }
    if (k->qn == k->qcap) { /* full: drop the oldest guess (the queue holds at most a few layers' worth) */
        int drop = -1;
        for (int i = 0; i < k->qn && drop < 0; i++)
            if (!k->queue[i].demand) drop = i;
        if (drop < 0) return 0;
        k->queue[drop] = k->queue[--k->qn];
    }
    io_req r = {id, demand, 0, 0};
    unit_where(m, li, e, &r.file, &r.off);
    k->queue[k->qn++] = r;
    return 1;
}

/* Takes unit id's read out of the queue, if queued. The caller holds the lock. */
static void queue_drop(struct expert_cache *k, size_t id) {
    const int q = queue_find(k, id);
    if (q >= 0) k->queue[q] = k->queue[--k->qn];
}

/* Takes the reads of layer li's experts ids[0..n-1] out of the queue: a step that failed will not
 * use them. */
static void cache_unqueue(const moe_model *m, int li, const int32_t *ids, size_t n) {
    struct expert_cache *k = m->cache;
    pthread_mutex_lock(&k->lock);
    for (size_t i = 0; i < n; i++) queue_drop(k, unit_id(k, li, ids[i]));
    pthread_mutex_unlock(&k->lock);
}

/* Queues reads of the experts of layer li marked in want (demand: the layer about to compute
 * routed to them; else a guess for the next MoE layer); returns how many were queued. */
static int cache_queue(const moe_model *m, int li, const unsigned char *want, int demand) {
    struct expert_cache *k = m->cache;
    const int E = m->cfg.n_experts;
    int queued = 0;
    pthread_mutex_lock(&k->lock);
    if (demand) moe__history_route(k->hist, li, want, E);
    if (!k->n_io) { pthread_mutex_unlock(&k->lock); return 0; }
    if (demand) k->cur_layer = li;
    else k->next_layer = li;
    if (demand) /* the layer's routing is known: guesses for it still queued are wrong ones */
        for (int i = k->qn - 1; i >= 0; i--) {
            const io_req *r = &k->queue[i];
            const int rl = (int)(r->id / k->units), re = (int)(r->id % k->units);
            if (!r->demand && rl == li && re < E && !want[re]) k->queue[i] = k->queue[--k->qn];
        }
    for (int e = 0; e < E; e++)
        if (want[e]) queued += queue_push(m, k, li, e, demand);
    if (queued) pthread_cond_broadcast(&k->work);
    pthread_mutex_unlock(&k->lock);
    return queued;
}

/* Queues the dense matrices of streamed layer li as read-ahead. */
static void cache_queue_dense(const moe_model *m, int li) {
    struct expert_cache *k = m->cache;
    pthread_mutex_lock(&k->lock);
    if (k->n_io && queue_push(m, k, li, k->units - 1, 0)) pthread_cond_broadcast(&k->work);
    pthread_mutex_unlock(&k->lock);
}

uint64_t moe__expert_bytes_read(const moe_model *m) {
    if (!m || !m->cache) return 0;
    pthread_mutex_lock(&m->cache->lock);
    uint64_t b = m->cache->bytes_read;
    pthread_mutex_unlock(&m->cache->lock);
    return b;
}

/* MMAP mode: tell the kernel which experts this step is about to use, so that their pages are
 * read ahead while earlier experts compute (a hint; experts interleaved into RAM at load are
 * skipped: they are not in a mapping). */
static void advise_willneed(const void *p, size_t n) {
    uintptr_t a = (uintptr_t)p & ~(uintptr_t)4095;
#ifdef MADV_WILLNEED
    madvise((void *)a, (uintptr_t)p + n - a, MADV_WILLNEED);
#else
    posix_madvise((void *)a, (uintptr_t)p + n - a, POSIX_MADV_WILLNEED);
#endif
}

static void expert_advise(const moe_model *m, int li, int e) {
    if (m->cache) return;
    const expert *x = &m->layers[li].experts[e];
    const moe__weight *w[3] = {&x->w1, &x->w2, &x->w3};
    for (int i = 0; i < 3; i++) {
        const unsigned char *p = w[i]->data;
        const size_t n = (size_t)weight_data_bytes(w[i]);
        if (mapped_file(m, p, n) < 0) return;
        advise_willneed(p, n);
        if (w[i]->scale) advise_willneed(w[i]->scale, (size_t)(w[i]->rows * (w[i]->cols / 32)));
    }
}

/* The one way the forward pass reaches a routed expert: through the mapping (MMAP mode) or the
 * cache (CACHE mode; the expert stays pinned until expert_put). */
static moe_status expert_get(const moe_model *m, int li, int e, const expert **out, moe_step_stats *stats) {
    if (!m->cache) {
        *out = &m->layers[li].experts[e];
        return MOE_OK;
    }
    cache_entry *v;
    moe_status st = cache_get(m, li, e, &v, stats);
    if (!st) *out = &v->ex;
    return st;
}

static void expert_put(const moe_model *m, int li, int e) {
    if (m->cache) cache_put(m, li, e);
}

/* The layer as the forward pass uses it: layer li itself, or for a streamed layer a copy whose
 * dense matrices point into a pinned cache entry (until dense_put). The next streamed layer
 * (after the last: the first, for the next step) is queued for the I/O threads first, so that it
 * is read while this one computes. */
static moe_status dense_get(const moe_model *m, int li, layer *view, moe_step_stats *stats) {
    *view = m->layers[li];
    if (!m->cache || !view->stream) return MOE_OK;
    const int Lc = m->cfg.n_layers, E = m->cfg.n_experts;
    for (int i = 1; i <= Lc; i++)
        if (m->layers[(li + i) % Lc].stream) {
            if ((li + i) % Lc != li) cache_queue_dense(m, (li + i) % Lc);
            break;
        }
    cache_entry *v;
    moe_status st = cache_get(m, li, E, &v, stats);
    if (st) return st;
    const moe__weight *w[UNIT_MAX];
    size_t field[UNIT_MAX];
    const int n = unit_weights(m, li, E, w, field);
    for (int i = 0; i < n; i++) *(moe__weight *)(void *)((char *)view + field[i]) = v->w[i];
    return MOE_OK;
}

static void dense_put(const moe_model *m, int li) {
    if (m->cache && m->layers[li].stream) cache_put(m, li, m->cfg.n_experts);
}

/* ==== the resource plan ========================================================================
 * What this process may use (memory, CPUs, the disk under the model) and, from that and the
 * model's byte counts, the options the caller did not choose: moe_plan_make, which
 * moe_model_open follows under MOE_FLAG_PLAN and moe-plan prints. */

/* A number from the first line of a small file; 0 when it cannot be read or says "max". */
static uint64_t file_u64(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    unsigned long long v = 0;
    if (fscanf(f, "%llu", &v) != 1) v = 0;
    fclose(f);
    return v;
}

/* This process's cgroup path for a v1 controller (or the v2 hierarchy when controller is "")
 * from /proc/self/cgroup, e.g. "/moe-bench.123"; 0 when it has none. */
static int cgroup_of(const char *controller, char *out, size_t n) {
    FILE *f = fopen("/proc/self/cgroup", "r");
    if (!f) return 0;
    char line[1024];
    int found = 0;
    while (!found && fgets(line, sizeof line, f)) {
        char *a = strchr(line, ':'), *b = a ? strchr(a + 1, ':') : NULL;
        if (!b) continue;
        *b = 0;
        const char *ctl = a + 1;
        int match = !*controller ? !*ctl : 0;
        for (const char *c = ctl; *controller && *c;) { /* "cpu,cpuacct" lists several */
            size_t l = strcspn(c, ",");
            if (l == strlen(controller) && !strncmp(c, controller, l)) match = 1;
            c += l + (c[l] == ',');
        }
        if (match) {
            b[1 + strcspn(b + 1, "\n")] = 0;
            snprintf(out, n, "%s", b + 1);
            found = 1;
        }
    }
    fclose(f);
    return found;
}

/* The smallest value of FILE in the cgroup at ROOT + path and its ancestors (limits nest); 0: none. */
static uint64_t cgroup_limit(const char *root, const char *path, const char *file) {
    char dir[1024], full[1200];
    snprintf(dir, sizeof dir, "%s", path);
    uint64_t best = 0;
    for (;;) {
        snprintf(full, sizeof full, "%s%s/%s", root, strcmp(dir, "/") ? dir : "", file);
        const uint64_t v = file_u64(full);
        if (v && v < (1ull << 60) && (!best || v < best)) best = v; /* v1 says "no limit" as ~2^63 */
        char *slash = strrchr(dir, '/');
        if (!slash || slash == dir) {
            if (!strcmp(dir, "/")) break;
            strcpy(dir, "/");
        } else {
            *slash = 0;
        }
    }
    return best;
}

/* the memory this process may use, and which limit says so */
static uint64_t plan_memory(const char **from) {
    uint64_t best = 0;
    *from = "MemAvailable";
    FILE *f = fopen("/proc/meminfo", "r");
    char line[256];
    while (f && fgets(line, sizeof line, f)) {
        unsigned long long kb;
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) best = (uint64_t)kb * 1024;
    }
    if (f) fclose(f);
    if (!best) best = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE);
    char cg[1024];
    uint64_t v;
    if (cgroup_of("", cg, sizeof cg) && (v = cgroup_limit("/sys/fs/cgroup", cg, "memory.max")) && v < best) best = v, *from = "cgroup v2";
    if (cgroup_of("memory", cg, sizeof cg) && (v = cgroup_limit("/sys/fs/cgroup/memory", cg, "memory.limit_in_bytes")) && v < best)
        best = v, *from = "cgroup v1";
    struct rlimit rl;
    if (!getrlimit(RLIMIT_AS, &rl) && rl.rlim_cur != RLIM_INFINITY && (uint64_t)rl.rlim_cur < best) best = rl.rlim_cur, *from = "RLIMIT_AS";
    return best;
}

/* the CPUs this process may use (affinity, cgroup CPU quota) and the physical cores among them */
static void plan_cpus(int *cpus, int *cores) {
    int n = 0, nc = 0;
    int core_key[1024];
#ifdef CPU_SETSIZE
    cpu_set_t set;
    if (!sched_getaffinity(0, sizeof set, &set))
        for (int c = 0; c < CPU_SETSIZE; c++) {
            if (!CPU_ISSET(c, &set)) continue;
            n++;
            char p[128];
            snprintf(p, sizeof p, "/sys/devices/system/cpu/cpu%d/topology/core_id", c);
            FILE *f = fopen(p, "r");
            int core = -1, pkg = 0;
            if (f) { if (fscanf(f, "%d", &core) != 1) core = -1; fclose(f); }
            snprintf(p, sizeof p, "/sys/devices/system/cpu/cpu%d/topology/physical_package_id", c);
            if ((f = fopen(p, "r"))) { if (fscanf(f, "%d", &pkg) != 1) pkg = 0; fclose(f); }
            const int key = core < 0 ? -1 - c : pkg * 65536 + core; /* no topology: each CPU a core */
            int seen = 0;
            for (int i = 0; i < nc && !seen; i++) seen = core_key[i] == key;
            if (!seen && nc < 1024) core_key[nc++] = key;
        }
#endif
    if (n < 1) n = nc = (int)sysconf(_SC_NPROCESSORS_ONLN) > 0 ? (int)sysconf(_SC_NPROCESSORS_ONLN) : 1;
    char cg[1024], path[1200];
    long quota = 0, period = 0;
    if (cgroup_of("", cg, sizeof cg)) { /* v2: "max 100000" or "200000 100000" */
        snprintf(path, sizeof path, "/sys/fs/cgroup%s/cpu.max", strcmp(cg, "/") ? cg : "");
        FILE *f = fopen(path, "r");
        if (f) { if (fscanf(f, "%ld %ld", &quota, &period) != 2) quota = 0; fclose(f); }
    }
    if (!quota && cgroup_of("cpu", cg, sizeof cg)) {
        snprintf(path, sizeof path, "/sys/fs/cgroup/cpu%s/cpu.cfs_quota_us", strcmp(cg, "/") ? cg : "");
        FILE *f = fopen(path, "r");
        if (f) { if (fscanf(f, "%ld", &quota) != 1) quota = 0; fclose(f); }
        snprintf(path, sizeof path, "/sys/fs/cgroup/cpu%s/cpu.cfs_period_us", strcmp(cg, "/") ? cg : "");
        period = (long)file_u64(path);
    }
    if (quota > 0 && period > 0) {
        const int q = (int)((quota + period - 1) / period);
        n = q < n ? q : n;
    }
    *cpus = n, *cores = nc < 1 ? 1 : nc > n ? n : nc;
}

/* the 2 MB blocks of a file that hold data: where a sparse file's holes are, reading returns
 * zeros without touching the disk, so the probe reads only blocks wholly inside data extents */
typedef struct {
    off_t *at; /* block offsets */
    size_t n;
} data_blocks;

enum { PROBE_BLOCK = 2 << 20 };

static void find_data_blocks(int fd, off_t size, data_blocks *b) {
    b->at = NULL, b->n = 0;
    size_t cap = 0;
    for (off_t pos = 0; pos < size;) {
        off_t start = pos, end = size;
#if defined(SEEK_DATA) && defined(SEEK_HOLE)
        start = lseek(fd, pos, SEEK_DATA);
        if (start < 0) break; /* no more data (ENXIO), or no SEEK_DATA: the blocks so far */
        end = lseek(fd, start, SEEK_HOLE);
        if (end < 0) end = size;
#endif
        for (off_t a = (start + PROBE_BLOCK - 1) / PROBE_BLOCK * PROBE_BLOCK; a + PROBE_BLOCK <= end; a += PROBE_BLOCK) {
            if (b->n == cap) {
                cap = cap ? 2 * cap : 1024;
                off_t *na = realloc(b->at, cap * sizeof *na);
                if (!na) return;
                b->at = na;
            }
            b->at[b->n++] = a;
        }
        pos = end > start ? end : start + 1;
    }
}

size_t moe__data_blocks(int fd, long long size) {
    data_blocks b;
    find_data_blocks(fd, (off_t)size, &b);
    free(b.at);
    return b.n;
}

typedef struct {
    int fd, seed;
    const data_blocks *blocks;
    size_t bytes;
    int failed;
} disk_reader;

static void *disk_read_blocks(void *arg) {
    disk_reader *r = arg;
    void *buf = NULL;
    if (posix_memalign(&buf, 4096, PROBE_BLOCK)) { r->failed = 1; return NULL; }
    uint64_t x = 0x9E3779B97F4A7C15ull * (uint64_t)(r->seed + 1);
    for (size_t done = 0; done < r->bytes; done += PROBE_BLOCK) {
        x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
        const off_t at = r->blocks->at[(x * 0x2545F4914F6CDD1Dull >> 11) % r->blocks->n];
        if (pread(r->fd, buf, PROBE_BLOCK, at) != PROBE_BLOCK) { r->failed = 1; break; }
    }
    free(buf);
    return NULL;
}

/* GB/s of `readers` threads reading 64 MB of path in 2 MB blocks at random offsets with
 * O_DIRECT, only where the file holds data; 0 where that cannot be done (no O_DIRECT, under 64 MB
 * of data, as a sparse file's mostly holes may be, a read failing) */
static double disk_probe(const char *path, int readers) {
#ifdef O_DIRECT
    int fd;
    struct stat sb;
    data_blocks blocks = {0};
    if (open_regular(path, O_DIRECT, &fd, NULL, 0)) return 0;
    if (!fstat(fd, &sb)) find_data_blocks(fd, sb.st_size, &blocks);
    if (blocks.n < (64 << 20) / PROBE_BLOCK) {
        free(blocks.at);
        close(fd);
        return 0;
    }
    disk_reader r[16];
    pthread_t th[16];
    const double t0 = now_sec();
    int started = 0, failed = 0;
    for (int i = 0; i < readers && i < 16; i++) {
        r[i] = (disk_reader){fd, i, &blocks, (size_t)(64 << 20) / (size_t)readers, 0};
        if (!pthread_create(&th[i], NULL, disk_read_blocks, &r[i])) started++;
        else failed = 1;
    }
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL), failed |= r[i].failed;
    const double dt = now_sec() - t0;
    close(fd);
    free(blocks.at);
    return failed || dt <= 0 ? 0 : (64 << 20) / dt / 1e9;
#else
    (void)path, (void)readers;
    return 0;
#endif
}

/* disk_probe by 4 and 16 readers, once per device in this process */
static void plan_disk(const char *path, double gbps[2]) {
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    static struct { dev_t dev; double gbps[2]; } seen[8];
    static int n_seen;
    struct stat sb;
    gbps[0] = gbps[1] = 0;
    if (stat(path, &sb)) return;
    pthread_mutex_lock(&lock);
    int i = 0;
    while (i < n_seen && seen[i].dev != sb.st_dev) i++;
    if (i == n_seen) {
        gbps[0] = disk_probe(path, 4), gbps[1] = disk_probe(path, 16);
        if (n_seen < 8) seen[n_seen].dev = sb.st_dev, seen[n_seen].gbps[0] = gbps[0], seen[n_seen].gbps[1] = gbps[1], n_seen++;
    } else {
        gbps[0] = seen[i].gbps[0], gbps[1] = seen[i].gbps[1];
    }
    pthread_mutex_unlock(&lock);
}

/* the largest of a model's mapped files (the disk probe reads it) */
static const char *largest_file(const moe_model *m) {
    int best = 0;
    for (int i = 1; i < m->n_files; i++)
        if (m->files[i].size > m->files[best].size) best = i;
    return m->n_files ? m->files[best].path : NULL;
}

static const char *wtype_name(int t) {
    static const char *names[] = {"as stored", "F32", "BF16", "Q8_0", "Q4_0"};
    return t >= 0 && t <= MOE_WTYPE_Q4_0 ? names[t] : "?";
}

/* The choices from the machine (p's memory and cores) and the open model m's byte counts. */
static moe_status plan_choose(moe_plan *p, const moe_model *m, const moe_options *given, char *err, size_t errlen) {
    const moe_config *c = &m->cfg;
    const moe_model_info *in = &m->info;
    moe_options *o = &p->opt;
    const unsigned set = given->set;
    int n_moe = 0, n_kda = 0;
    for (int l = 0; l < c->n_layers; l++) n_moe += c->layer_moe[l], n_kda += c->layer_kind[l] == MOE_LAYER_KDA;
    const double G = 1073741824.0, /* sizes in GiB, as moe-plan prints them */ mem = (double)p->mem_bytes;
    const double one_expert = n_moe && c->n_experts ? (double)in->expert_bytes / ((double)n_moe * c->n_experts) : 0;
    if (!(set & MOE_SET_THREADS)) o->n_threads = p->cores;
    /* one prompt chunk's working memory (moe-plan's estimate) and one sequence's state at 4096 tokens */
    const double blocks = c->attn_res_block ? c->n_layers / c->attn_res_block + 2 : 0;
    const double work_cache = 512.0 * c->hidden_size * 4 * (16 + blocks), work_mmap = 4 * work_cache;
    const double state = (double)n_kda * c->kda_heads * (double)c->kda_head_dim * c->kda_head_dim * 4 +
                         (double)(c->n_layers - n_kda) * (c->kv_lora_rank + c->qk_rope_dim) * 4.0 * 4096;
    const double reserve = 256.0 * 1048576 + mem / 32;
    const double all = (double)in->dense_bytes_as[MOE_WTYPE_ASIS] + (double)in->expert_bytes;
    if (!(set & MOE_SET_EXPERT_MODE))
        o->expert_mode = all + work_mmap + state + reserve <= mem || !in->expert_bytes ? MOE_EXPERTS_MMAP : MOE_EXPERTS_CACHE;
    char disk[96] = "";
    if (o->expert_mode == MOE_EXPERTS_MMAP) {
        if (!(set & MOE_SET_DENSE_TYPE)) o->dense_type = given->dense_type;
        p->dense_bytes = in->dense_bytes_as[o->dense_type >= 0 && o->dense_type <= MOE_WTYPE_Q4_0 ? o->dense_type : 0];
        snprintf(p->summary, sizeof p->summary,
                 "%.2f GiB of memory (%s), %d CPUs, %d cores: the weights (%.2f GiB) fit, so they are used where they are mapped; "
                 "dense %s, %d threads", mem / G, p->mem_from, p->cpus, p->cores, all / G, wtype_name(o->dense_type), o->n_threads);
        return MOE_OK;
    }
    const double avail = mem - reserve - work_cache - state;
    const double min_cache = ((double)o->n_threads + 2.0 * c->n_active) * one_expert; /* a step's experts and the next layer's */
    /* floats shrink by quantizing them at load; quantized files stay as they are (mapped, and
     * then the page cache must hold them beside the expert cache) */
    const int floats = in->dense_bytes_as[MOE_WTYPE_Q8_0] < in->dense_bytes_as[MOE_WTYPE_ASIS];
    if (!(set & MOE_SET_DENSE_TYPE))
        o->dense_type = !floats ? MOE_WTYPE_ASIS
                      : (double)in->dense_bytes_as[MOE_WTYPE_Q8_0] + min_cache <= avail ? MOE_WTYPE_Q8_0 : MOE_WTYPE_Q4_0;
    const int dt = o->dense_type >= 0 && o->dense_type <= MOE_WTYPE_Q4_0 ? o->dense_type : 0;
    p->dense_bytes = in->dense_bytes_as[dt];
    double dense_ram = (double)p->dense_bytes;
    if (!(set & MOE_SET_DENSE_BUDGET)) {
        o->dense_budget = 0;
        if (dense_ram + min_cache > avail) {
            /* the LM head and routers stay resident; the layers' matrices get what is left, and
             * the cache must also hold two streamed layers as stored */
            const double head = (double)c->vocab_size * c->hidden_size * (dt == MOE_WTYPE_Q4_0 || dt == MOE_WTYPE_Q8_0 ? 1.0625 : 2.0);
            const double layer_stored = ((double)in->dense_bytes_as[MOE_WTYPE_ASIS] - head) / c->n_layers;
            const double budget = avail - min_cache - 2 * layer_stored - head;
            if (budget <= 0)
                return fail(err, errlen, MOE_ERR_NOMEM, "%.2f GiB of memory (%s) cannot hold the LM head, two layers and a step's experts "
                            "(%.2f GiB)", mem / G, p->mem_from, (head + 2 * layer_stored + min_cache + reserve) / G);
            o->dense_budget = (size_t)budget;
            dense_ram = head + budget; /* the streamed layers pass through the expert cache */
        }
    }
    if (!(set & MOE_SET_EXPERT_BUDGET)) {
        const double budget = avail - dense_ram;
        if (budget < min_cache)
            return fail(err, errlen, MOE_ERR_NOMEM, "%.2f GiB of memory (%s) leave %.2f GiB for experts after the dense matrices (%.2f GiB "
                        "%s); a step needs %.2f GiB: set --dense-budget or a smaller --dense type", mem / G, p->mem_from,
                        budget > 0 ? budget / G : 0.0, dense_ram / G, wtype_name(dt), min_cache / G);
        o->expert_budget = (size_t)budget;
    }
    if (!(set & MOE_SET_IO_THREADS)) {
        const char *f = largest_file(m);
        if (f) plan_disk(f, p->disk_gbps);
        o->io_threads = p->disk_gbps[1] > 0 && p->disk_gbps[1] >= 1.1 * p->disk_gbps[0] ? 16 : 4;
        if (p->disk_gbps[0] > 0) snprintf(disk, sizeof disk, ", disk %.2f GB/s by 4 readers and %.2f by 16", p->disk_gbps[0], p->disk_gbps[1]);
        else snprintf(disk, sizeof disk, ", disk not measured (no O_DIRECT, or under 64 MB of data in the file)");
    }
    if (!(set & MOE_SET_PREFETCH)) o->prefetch = 1;
    char streamed[96] = "";
    if (o->dense_budget) snprintf(streamed, sizeof streamed, " (%.2f GiB of layers resident, the rest read every step)", o->dense_budget / G);
    snprintf(p->summary, sizeof p->summary,
             "%.2f GiB of memory (%s), %d CPUs, %d cores%s: the weights (%.2f GiB) do not fit, so experts (%.2f GiB) stream through a "
             "%.2f GiB cache; dense %s, %.2f GiB%s; %d I/O threads, prefetch %s, %d threads",
             mem / G, p->mem_from, p->cpus, p->cores, disk, all / G, (double)in->expert_bytes / G, o->expert_budget / G,
             wtype_name(dt), (double)p->dense_bytes / G, streamed, o->io_threads, o->prefetch ? "on" : "off", o->n_threads);
    return MOE_OK;
}

/* The plan for model m (its weights bound, not yet placed) and what the process may use */
static moe_status plan_of_model(moe_plan *p, const moe_model *m, const moe_options *given, char *err, size_t errlen) {
    memset(p, 0, sizeof *p);
    p->opt = *given;
    p->opt.flags &= ~(unsigned)MOE_FLAG_PLAN;
    p->mem_bytes = plan_memory(&p->mem_from);
    plan_cpus(&p->cpus, &p->cores);
    p->expert_bytes = m->info.expert_bytes;
    return plan_choose(p, m, given, err, errlen);
}

moe_status moe_plan_make(moe_plan *p, const char *path, const moe_options *opt, char *err, size_t errlen) {
    if (!p || !path) return fail(err, errlen, MOE_ERR_ARG, "moe_plan_make: bad argument");
    memset(p, 0, sizeof *p);
    const moe_options given = opt ? *opt : moe_default_options();
    /* the headers alone: mapped, nothing converted or repacked */
    moe_options peek = moe_default_options();
    peek.flags |= MOE_FLAG_NO_REPACK;
    moe_model *m = NULL;
    moe_status st = moe_model_open(&m, path, &peek, err, errlen);
    if (!st) st = plan_of_model(p, m, &given, err, errlen);
    moe_model_close(m);
    return st;
}

moe_status moe__plan_choose(moe_plan *p, const moe_model *m, const moe_options *given, char *err, size_t errlen) {
    p->opt = *given;
    p->opt.flags &= ~(unsigned)MOE_FLAG_PLAN;
    p->expert_bytes = m->info.expert_bytes;
    return plan_choose(p, m, given, err, errlen);
}

const moe_plan *moe_model_plan(const moe_model *m) { return m && m->planned ? &m->plan : NULL; }

/* =================================================================================================
 * PART 3: THREADS AND MATMUL
 * =================================================================================================
 * The step's team of threads (par_run, par_barrier) and the matrix products every layer uses:
 * y[t, n] = sum_k x[t, k] W[n, k] for a weight in any format, the input quantized once per call
 * for the integer formats, threads splitting weight rows so that results do not depend on the
 * thread count. Relies on the kernel table (m->k, chosen in quant.c's moe__kernels_init). */

/* ==== the step's threads ========================================================================
 * Work is split across threads by par_run(nt, fn, arg): fn(arg, p) runs once on each of the
 * threads, p giving its number (p->me) and their count (p->nth), and par_barrier(p) waits for
 * all of them. A decode step runs ~270 such loops a token (products, KDA heads, MLA), each tens
 * of microseconds long, and opening and closing an OpenMP region costs 0.6 us with 2 threads and
 * 5 us with 16 (libgomp on a Zen 4 and a Xeon VM, bench/RESULTS.md "2026-12-01: one team of
 * threads a step"). So forward() opens one region for the whole step (step_team): thread 0 runs
 * the step and posts each loop to the others, which poll for it (as libgomp's own threads do
 * between regions) and report when their share is done: 0.1-0.3 us with 2 threads, 2-3 us with 16. Decode tokens were 3-4% faster with
 * 16 threads, 2% with 8, about 1% with 2 (in-process A/B, same logits). Without a team (the
 * expert cache's steps, more threads than processors, no OpenMP or no C11 atomics) each par_run
 * is an OpenMP region of its own, or a plain call. A par_run inside another's fn runs on its
 * calling thread alone, as a nested OpenMP region did. Which thread runs which share never
 * changes a result. */

typedef struct step_team step_team;
typedef struct {
    int me, nth;     /* this thread's number and the number of threads sharing the work */
    step_team *team; /* the step's team running it, else NULL */
} par_ctx;
typedef void (*par_fn)(void *arg, const par_ctx *p);

#if defined(_OPENMP) && !defined(__STDC_NO_ATOMICS__)
#include <stdatomic.h>
#define STEP_TEAM 1
#define STEP_TEAM_MAX 64 /* the most threads a step's team (and the task stealer) serves */

struct step_team {
    _Alignas(64) _Atomic unsigned posted;   /* loops posted so far; each helper runs each once */
    _Alignas(64) _Atomic unsigned finished; /* helpers' runs of them finished so far */
    _Alignas(64) _Atomic unsigned arrived, passed; /* par_barrier: threads arrived, barriers passed */
    par_fn fn;
    void *arg;
    int nth;  /* threads in the team, thread 0 included */
    int stop; /* posted last: the helpers leave */
};

static _Thread_local step_team *team_led; /* the team this thread leads (thread 0 of a step) */
static _Thread_local int par_depth;       /* > 0 while this thread runs a par_run's fn */

/* A waiting thread of the team spins TEAM_SPINS times, then gives its core away between looks
 * (sched_yield): another thread of the team, or of another program, may be waiting for that
 * core. With 3 threads on 2 cores (forced; forward() does not start a team larger than the
 * processors) pure spinning took decode tokens from 34 ms to 1 s, and 2^14 spins before
 * yielding to 141 ms; 2^8 spins ran as fast as OpenMP regions (32 ms, Zen 4 VM), and a yield
 * between looks costs a system call of well under a microsecond when no one else wants the
 * core. */
#define TEAM_SPINS (1 << 8)
static void team_pause(int *spins) {
    if (*spins < TEAM_SPINS) {
        ++*spins;
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
        __builtin_ia32_pause();
#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
        __asm__ __volatile__("yield");
#endif
    } else {
        sched_yield();
    }
}

/* posts fn to the helpers, runs thread 0's share, waits for theirs */
static void team_run(step_team *t, par_fn fn, void *arg) {
    t->fn = fn, t->arg = arg;
    const unsigned target = atomic_load_explicit(&t->finished, memory_order_relaxed) + (unsigned)t->nth - 1;
    atomic_fetch_add_explicit(&t->posted, 1, memory_order_release);
    const par_ctx p = {0, t->nth, t};
    par_depth++;
    fn(arg, &p);
    par_depth--;
    for (int sp = 0; atomic_load_explicit(&t->finished, memory_order_acquire) != target;) team_pause(&sp);
}

/* a helper: runs every posted loop until the step ends */
static void team_serve(step_team *t, int me) {
    for (unsigned seen = 0;; seen++) {
        for (int sp = 0; atomic_load_explicit(&t->posted, memory_order_acquire) == seen;) team_pause(&sp);
        if (t->stop) return;
        const par_ctx p = {me, t->nth, t};
        par_depth++;
        t->fn(t->arg, &p);
        par_depth--;
        atomic_fetch_add_explicit(&t->finished, 1, memory_order_release);
    }
}

static void team_barrier(step_team *t) {
    const unsigned g = atomic_load_explicit(&t->passed, memory_order_acquire);
    if (atomic_fetch_add_explicit(&t->arrived, 1, memory_order_acq_rel) == (unsigned)t->nth - 1) {
        atomic_store_explicit(&t->arrived, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&t->passed, 1, memory_order_release);
    } else {
        for (int sp = 0; atomic_load_explicit(&t->passed, memory_order_acquire) == g;) team_pause(&sp);
    }
}
#endif

static void par_run(int nt, par_fn fn, void *arg) {
#ifdef STEP_TEAM
    if (par_depth) nt = 1;
    step_team *t = team_led;
    if (nt > 1 && t && t->nth > 1) {
        team_run(t, fn, arg);
        return;
    }
#endif
#ifdef _OPENMP
    if (nt > 1) {
#pragma omp parallel num_threads(nt)
        {
            const par_ctx p = {omp_get_thread_num(), omp_get_num_threads(), NULL};
#ifdef STEP_TEAM
            par_depth++;
            fn(arg, &p);
            par_depth--;
#else
            fn(arg, &p);
#endif
        }
        return;
    }
#endif
    (void)nt;
    const par_ctx p = {0, 1, NULL};
    fn(arg, &p);
}

/* waits until every thread of p's loop has reached this point */
static void par_barrier(const par_ctx *p) {
    if (p->nth < 2) return;
#ifdef STEP_TEAM
    if (p->team) {
        team_barrier(p->team);
        return;
    }
#endif
#ifdef _OPENMP
#pragma omp barrier
#endif
}

/* items [i0, i1) of n that thread p takes in a static split */
static void par_share(const par_ctx *p, int64_t n, int64_t *i0, int64_t *i1) {
    *i0 = n * p->me / p->nth;
    *i1 = n * (p->me + 1) / p->nth;
}

/* ==== matmul ==================================================================================
 * y[t, n] = sum_k x[t, k] W[n, k]: threads split the weight rows; each output element is one
 * kernel dot, so results do not depend on the thread count. */

#define MM_ROW_TILE 16 /* weight rows per task: they stay in cache while every token passes */

/* Tasks split with stealing. Each thread owns a contiguous range of a loop's tasks and takes them
 * from its front, a quarter of what is left at a time (at least OWN_TASKS), so that its weight
 * stream stays sequential for the prefetchers and it pays few atomic operations (each drains
 * the core's pending loads: taking 4 tasks at a time, they were 5% of a 2-thread decode); a
 * thread done with its own range takes tasks from the back of the range with the most left.
 * The threads of a step then finish together even when one is slowed (the other core's memory
 * traffic, an interrupt): with a static split the master spent ~9% of a decode step's samples
 * waiting at closing barriers for the other thread. Which thread runs a task does not change
 * its result. Needs C11 atomics; without them (or OpenMP) loops split statically. */
#ifdef STEP_TEAM
#define TASK_STEALING 1
#define OWN_TASKS 4 /* the fewest tasks a thread takes from its own range at a time */

typedef struct {
    _Alignas(64) _Atomic uint64_t fb; /* front << 32 | back: tasks front .. back-1 are left */
} task_range;

/* ranges[0..nr-1]: n tasks in nr contiguous ranges */
static void task_ranges_init(task_range *rg, int nr, int64_t n) {
    for (int i = 0; i < nr; i++) {
        const uint64_t f = (uint64_t)(n * i / nr), b = (uint64_t)(n * (i + 1) / nr);
        atomic_init(&rg[i].fb, f << 32 | b);
    }
}

/* up to want tasks from the back of r, or from its front the larger of want and a quarter of
 * what is left: how many, the first in *first */
static int range_take(task_range *r, int from_back, uint32_t want, int64_t *first) {
    uint64_t v = atomic_load_explicit(&r->fb, memory_order_relaxed);
    for (;;) {
        const uint32_t f = (uint32_t)(v >> 32), b = (uint32_t)v, w = from_back || (b - f) / 4 < want ? want : (b - f) / 4;
        const uint32_t n = b - f < w ? b - f : w;
        if (f >= b) return 0;
        const uint64_t nv = from_back ? v - n : v + ((uint64_t)n << 32);
        if (atomic_compare_exchange_weak_explicit(&r->fb, &v, nv, memory_order_relaxed, memory_order_relaxed)) {
            *first = from_back ? (int64_t)(b - n) : (int64_t)f;
            return (int)n;
        }
    }
}

/* thread me's next tasks: from its own range, else stolen; 0 when every range is empty */
static int task_next(task_range *rg, int nr, int me, int64_t *first) {
    int n = me < nr ? range_take(&rg[me], 0, OWN_TASKS, first) : 0;
    while (!n) {
        int victim = -1;
        uint32_t most = 0;
        for (int i = 0; i < nr; i++) {
            const uint64_t v = atomic_load_explicit(&rg[i].fb, memory_order_relaxed);
            const uint32_t left = (uint32_t)v > (uint32_t)(v >> 32) ? (uint32_t)v - (uint32_t)(v >> 32) : 0;
            if (left > most) most = left, victim = i;
        }
        if (victim < 0) return 0;
        n = range_take(&rg[victim], 1, most > 2 * OWN_TASKS ? OWN_TASKS : (most + 1) / 2, first);
    }
    return n;
}
#endif

/* One product of a group: y[T, W->rows] = x[T, K] W^T. */
typedef struct {
    float *y;
    const moe__weight *W;
} mm_out;

/* One product with its own input: y[T, W->rows] = x[T, K] W^T, x with row stride ldx, and xq:
 * x quantized by quant_q8a (needed when W is an integer format) */
typedef struct {
    float *y;
    const moe__weight *W;
    const float *x;
    int64_t ldx;
    const moe__block_q8a *xq;
    int T;
} mm_job;

/* rows per task: an interleaved row group, or a tile */
static int mm_per(const moe__weight *W) {
    return W->type == MOE_T_Q4_0X8 || W->type == MOE_T_Q8_0X8 || W->type == MOE_T_MXFP4X8 || is_kx8(W->type) ? 8 : MM_ROW_TILE;
}

/* weight rows per task of job j: an interleaved row group (two where the level has the two-group
 * kernel for the job's rows: 4 activation rows a pass for prefill, one for decode), or a tile */
static int mm_task_rows(const moe_model *m, const mm_job *j) {
    if (mm_per(j->W) != 8) return MM_ROW_TILE;
    return (j->T >= 4 ? m->k.dotq8x4x2[j->W->type] != NULL : m->k.dotq8x2[j->W->type] != NULL) ? 16 : 8;
}

/* whether W is MXFP4 to be multiplied with quantized activations (MOE_FLAG_MXFP4_INT8) */
static int mm_mxfp4_int8(const moe_model *m, const moe__weight *W) {
    return (m->opt.flags & MOE_FLAG_MXFP4_INT8) && (W->type == MOE_T_MXFP4 || W->type == MOE_T_MXFP4_GGML);
}

/* whether W's kernels read the activations quantized to 8-bit blocks */
static int mm_quantized(const moe_model *m, const moe__weight *W) { return mm_per(W) == 8 || moe__is_quant(W->type) || mm_mxfp4_int8(m, W); }

/* the x8 groups g0 .. g1-1 of interleaved W times one activation row xq (x quantized by
 * quant_q8a), one kernel call each: group g's 8 outputs at y[8 (g - g0)] */
static void x8_groups(const moe_model *m, const moe__weight *W, int64_t g0, int64_t g1, const moe__block_q8a *xq, float *y) {
    const int64_t gb = 8 * moe__row_bytes(W->type, W->cols);
    const unsigned char *base = W->data;
    const moe__dotq8_fn two = m->k.dotq8x2[W->type]; /* two groups a call where the level has it */
    int64_t g = g0;
    for (; two && g + 2 <= g1; g += 2) two(base + g * gb, xq, W->cols, y + 8 * (g - g0));
    for (; g < g1; g++) m->k.dotq8[W->type](base + g * gb, xq, W->cols, y + 8 * (g - g0));
}

/* y[i] = scale * (row row0 + i of W) . x for n rows: x as f32 for the float formats, as xq (x
 * quantized by quant_q8a) for Q8_0/Q4_0, interleaved or not (and MXFP4 under
 * MOE_FLAG_MXFP4_INT8); for an interleaved W, row0 and n are multiples of 8 */
static void rows_times(const moe_model *m, const moe__weight *W, int64_t row0, int64_t n, const float *x, const moe__block_q8a *xq,
                       float *y, float scale) {
    const int64_t K = W->cols, rb = moe__row_bytes(W->type, K), sb = W->type == MOE_T_MXFP4 ? K / 32 : 0;
    const unsigned char *base = W->data;
    if (mm_per(W) == 8) { /* interleaved (row0 and n whole groups): 8 rows a call */
        x8_groups(m, W, row0 / 8, (row0 + n) / 8, xq, y);
        for (int64_t i = 0; scale != 1.0f && i < n; i++) y[i] *= scale;
        return;
    }
    if (moe__is_quant(W->type) || (W->type == MOE_T_MXFP4_GGML && mm_mxfp4_int8(m, W))) {
        for (int64_t i = 0; i < n; i++) y[i] = scale * m->k.dotq[W->type](base + (row0 + i) * rb, xq, K);
        return;
    }
    if (W->type == MOE_T_MXFP4 && mm_mxfp4_int8(m, W)) {
        for (int64_t i = 0; i < n; i++) y[i] = scale * m->k.dotq_mxfp4(base + (row0 + i) * rb, W->scale + (row0 + i) * sb, xq, K);
        return;
    }
    int64_t i = 0;
    if (m->k.dot4[W->type]) /* four rows a pass over x (MXFP4), each as dot would give it */
        for (; i + 4 <= n; i += 4) {
            float o[4];
            m->k.dot4[W->type](base + (row0 + i) * rb, rb, W->scale ? W->scale + (row0 + i) * sb : NULL, x, K, o);
            for (int r = 0; r < 4; r++) y[i + r] = scale * o[r];
        }
    for (; i < n; i++)
        y[i] = scale * m->k.dot[W->type](base + (row0 + i) * rb, W->scale ? W->scale + (row0 + i) * sb : NULL, x, K);
}

/* MOE_FLAG_ACT16: the T rows of x (row stride ldx, K values) quantized in xq, then their
 * rounding errors x - d q quantized the same way, into xr[2T] (e: K floats of work) */
static void act16_rows(const moe_model *m, const float *x, int64_t ldx, const moe__block_q8a *xq, int T, int64_t K,
                       moe__block_q8a *xr, float *e) {
    const int64_t nb = K / 32;
    memcpy(xr, xq, sizeof *xq * (size_t)(nb * T));
    for (int t = 0; t < T; t++) {
        const float *xt = x + t * ldx;
        const moe__block_q8a *q = xq + t * nb;
        for (int64_t b = 0; b < nb; b++)
            for (int i = 0; i < 32; i++) e[b * 32 + i] = xt[b * 32 + i] - q[b].d * (float)q[b].qs[i];
        m->k.quant_q8a(e, xr + (T + t) * nb, K);
    }
}

/* rows_times, and under MOE_FLAG_ACT16 for an integer-format W plus the same rows times x's
 * rounding error in xq (act16_rows), as mm_run_act16 sums them; work: 2 K + n floats */
static void rows_times_q(const moe_model *m, const moe__weight *W, int64_t row0, int64_t n, const float *x, const moe__block_q8a *xq,
                         float *y, float scale, float *work) {
    rows_times(m, W, row0, n, x, xq, y, scale);
    if (!(m->opt.flags & MOE_FLAG_ACT16) || !mm_quantized(m, W)) return;
    const int64_t K = W->cols;
    float *e = work, *lo = e + K;
    moe__block_q8a *xr = (moe__block_q8a *)(void *)(lo + n); /* 2 K / 32 blocks of 40 bytes: within K floats */
    act16_rows(m, x, K, xq, 1, K, xr, e);
    rows_times(m, W, row0, n, x, xr + K / 32, lo, scale);
    for (int64_t i = 0; i < n; i++) y[i] += lo[i];
}

/* The rows of one task (an x8 row group, or MM_ROW_TILE rows) of job j, for every token. */
static void mm_task(const moe_model *m, const mm_job *j, int64_t r0) {
    const moe__weight *W = j->W;
    const int64_t N = W->rows, K = W->cols, nb = K / 32;
    const unsigned char *base = W->data;
    const int T = j->T;
    if (mm_per(W) == 8) { /* interleaved: one call yields 8 outputs per group */
        const int64_t gb = 8 * moe__row_bytes(W->type, K);
        const int64_t per = mm_task_rows(m, j), ng = (N - r0 < per ? N - r0 : per) / 8; /* groups in this task */
        int t = 0;
        if (ng == 2) { /* a two-group kernel's task (mm_task_rows): 16 rows per pass where the level has
                        * the kernel (AMX), 4, then the rows left (decode's one) */
            if (m->k.dotq8x16x2[W->type] && T >= 16) {
                m->k.dotq8x16x2[W->type](base + r0 / 8 * gb, j->xq, nb, K, T / 16 * 16, j->y + r0, N);
                t = T / 16 * 16;
            }
            for (; t + 4 <= T; t += 4) {
                float o64[64];
                m->k.dotq8x4x2[W->type](base + r0 / 8 * gb, j->xq + (int64_t)t * nb, nb, K, o64);
                for (int i = 0; i < 4; i++) memcpy(j->y + (int64_t)(t + i) * N + r0, o64 + 16 * i, sizeof(float) * 16);
            }
            for (; t < T; t++) x8_groups(m, W, r0 / 8, r0 / 8 + 2, j->xq + (int64_t)t * nb, j->y + (int64_t)t * N + r0);
        }
        for (int64_t g = 0; g < ng; g++) {
            const int64_t rg = r0 + 8 * g;
            int tg = t;
            if (m->k.dotq8x4[W->type]) /* prefill: 4 rows per pass over the group's weights */
                for (; tg + 4 <= T; tg += 4) {
                    float o32[32];
                    m->k.dotq8x4[W->type](base + rg / 8 * gb, j->xq + (int64_t)tg * nb, nb, K, o32);
                    for (int i = 0; i < 4; i++) memcpy(j->y + (int64_t)(tg + i) * N + rg, o32 + 8 * i, sizeof(float) * 8);
                }
            for (; tg < T; tg++) /* decode: the 8 outputs straight into y */
                x8_groups(m, W, rg / 8, rg / 8 + 1, j->xq + (int64_t)tg * nb, j->y + (int64_t)tg * N + rg);
        }
        return;
    }
    const int64_t r1 = r0 + MM_ROW_TILE < N ? r0 + MM_ROW_TILE : N;
    if (T >= 4 && m->k.gemm[W->type]) { /* prefill, float weights: the kernel's register tiles */
        m->k.gemm[W->type](base + r0 * moe__row_bytes(W->type, K), K, (int)(r1 - r0), j->x, j->ldx, T, K, j->y + r0, N);
        return;
    }
    int t = 0;
    if (T >= 4 && m->k.dotq4[W->type]) { /* prefill, a format without an interleaved form: each weight row meets 4 activation rows a pass */
        const int64_t rb = moe__row_bytes(W->type, K);
        for (; t + 4 <= T; t += 4)
            for (int64_t r = r0; r < r1; r++) {
                float o[4];
                m->k.dotq4[W->type](base + r * rb, j->xq + (int64_t)t * nb, nb, K, o);
                for (int i = 0; i < 4; i++) j->y[(int64_t)(t + i) * N + r] = o[i];
            }
    }
    for (; t < T; t++)
        rows_times(m, W, r0, r1 - r0, j->x + (int64_t)t * j->ldx, j->xq ? j->xq + (int64_t)t * nb : NULL, j->y + (int64_t)t * N + r0, 1.0f);
}

/* tasks u0 .. u0+n-1 of the jobs whose tasks start at start[0..] (job i: start[i] .. start[i+1]-1) */
static void mm_tasks(const moe_model *m, const mm_job *j, const int64_t *start, int64_t u0, int64_t n) {
    int i = 0;
    for (int64_t u = u0; u < u0 + n;) {
        while (u >= start[i + 1]) i++;
        const moe__weight *W = j[i].W;
        if (j[i].T == 1 && mm_per(W) == 8) { /* decode over an interleaved matrix: this job's groups in one loop (the calls mm_task makes) */
            const int64_t end = start[i + 1] < u0 + n ? start[i + 1] : u0 + n, per = mm_task_rows(m, &j[i]) / 8; /* groups a task */
            const int64_t g0 = (u - start[i]) * per, g1 = (end - start[i]) * per < W->rows / 8 ? (end - start[i]) * per : W->rows / 8;
            x8_groups(m, W, g0, g1, j[i].xq, j[i].y + 8 * g0);
            u = end;
        } else
            mm_task(m, &j[i], (u - start[i]) * mm_task_rows(m, &j[i])), u++;
    }
}

/* Whether products of `macs` multiply-adds over `bytes` of weights are worth a fork and join:
 * by arithmetic (prefill), or by the weights' bytes (decode: a thread alone streams only part of
 * the machine's bandwidth; one core of a 16-core Xeon read a 512 KB f32 router at ~11 GB/s, 47 us,
 * against a few us to start and join the team). */
#define MM_PAR_MACS (1 << 18)
#define MM_PAR_BYTES (128 << 10)
static int mm_parallel(int nt, int64_t macs, int64_t bytes) { return nt > 1 && (macs > MM_PAR_MACS || bytes > MM_PAR_BYTES); }

/* one parallel loop's products: the jobs, where each one's tasks start, their number */
typedef struct {
    const moe_model *m;
    const mm_job *j;
    const int64_t *start;
    int64_t tasks;
#ifdef TASK_STEALING
    task_range *rg;
    int nr;
#endif
} mm_loop;

#ifdef TASK_STEALING
static void mm_steal_share(void *arg, const par_ctx *p) {
    const mm_loop *l = arg;
    int64_t u0;
    for (int got; (got = task_next(l->rg, l->nr, p->me, &u0));) mm_tasks(l->m, l->j, l->start, u0, got);
}
#endif

static void mm_static_share(void *arg, const par_ctx *p) {
    const mm_loop *l = arg;
    int64_t u0, u1;
    par_share(p, l->tasks, &u0, &u1);
    if (u1 > u0) mm_tasks(l->m, l->j, l->start, u0, u1 - u0);
}

/* n products in one parallel loop: the threads split the row tasks of all of them (with stealing
 * where available), so that a step pays one fork and join for them instead of one each. Each
 * output is the same kernel call on the same data whatever the grouping and thread count. */
static moe_status mm_run_jobs(const moe_model *m, const mm_job *j, int n, int nt) {
    int64_t start_small[17], *start = n < 17 ? start_small : malloc(sizeof(int64_t) * ((size_t)n + 1)), work = 0, bytes = 0;
    if (!start) return MOE_ERR_NOMEM;
    start[0] = 0;
    for (int i = 0; i < n; i++) {
        start[i + 1] = start[i] + (j[i].W->rows + mm_task_rows(m, &j[i]) - 1) / mm_task_rows(m, &j[i]);
        work += j[i].W->rows * (int64_t)j[i].T * j[i].W->cols;
        bytes += (int64_t)weight_bytes(j[i].W);
    }
    mm_loop l = {m, j, start, start[n]
#ifdef TASK_STEALING
                 , NULL, 0
#endif
    };
    if (!mm_parallel(nt, work, bytes)) {
        mm_tasks(m, j, start, 0, l.tasks);
#ifdef TASK_STEALING
    } else if (nt <= STEP_TEAM_MAX && l.tasks < UINT32_MAX) {
        task_range rg[STEP_TEAM_MAX];
        task_ranges_init(rg, nt, l.tasks);
        l.rg = rg, l.nr = nt;
        par_run(nt, mm_steal_share, &l);
#endif
    } else {
        par_run(nt, mm_static_share, &l);
    }
    if (start != start_small) free(start);
    return MOE_OK;
}

/* whether job j's product takes its input in two parts (MOE_FLAG_ACT16: an integer format) */
static int act16_job(const moe_model *m, const mm_job *j) { return (m->opt.flags & MOE_FLAG_ACT16) && j->xq && mm_quantized(m, j->W); }

/* activation rows a pass of mm_run_act16: bounds its buffers (the quantized rows and products
 * twice over) whatever the batch */
#define ACT16_ROWS 256

/* how many of job j's rows from t0 on one pass of mm_run_act16 takes (0 or less: none left) */
static int act16_pass_rows(const mm_job *j, int t0) { return j->T - t0 < ACT16_ROWS ? j->T - t0 : ACT16_ROWS; }

/* rows t0 .. t0 + ACT16_ROWS - 1 of the jobs j[0..n) under MOE_FLAG_ACT16: each quantized job
 * runs on twice its rows (act16_rows) into a buffer of its own, in one parallel loop with the
 * others (a task reads its weights once for both parts), then y = first part + second */
static moe_status mm_run_act16(const moe_model *m, const mm_job *j, int n, int nt, int t0) {
    mm_job *c = malloc(sizeof *c * (size_t)n);
    size_t nq = 0, ny = 0, ne = 0;
    for (int i = 0; i < n; i++) {
        const int T = act16_pass_rows(&j[i], t0);
        if (T <= 0 || !act16_job(m, &j[i])) continue;
        nq += 2 * (size_t)T * (size_t)(j[i].W->cols / 32), ny += 2 * (size_t)T * (size_t)j[i].W->rows;
        ne = (size_t)j[i].W->cols > ne ? (size_t)j[i].W->cols : ne;
    }
    moe__block_q8a *qb = malloc(sizeof *qb * nq + 1);
    float *yb = malloc(sizeof(float) * (ny + ne) + 1);
    if (!c || !qb || !yb) { free(c), free(qb), free(yb); return MOE_ERR_NOMEM; }
    int k = 0;
    size_t oq = 0, oy = 0;
    for (int i = 0; i < n; i++) {
        const int T = act16_pass_rows(&j[i], t0);
        if (T <= 0) continue;
        const int64_t K = j[i].W->cols, N = j[i].W->rows;
        const float *x = j[i].x + (int64_t)t0 * j[i].ldx;
        if (!act16_job(m, &j[i])) {
            c[k++] = (mm_job){j[i].y + (int64_t)t0 * N, j[i].W, x, j[i].ldx, j[i].xq ? j[i].xq + (int64_t)t0 * (K / 32) : NULL, T};
            continue;
        }
        act16_rows(m, x, j[i].ldx, j[i].xq + (int64_t)t0 * (K / 32), T, K, qb + oq, yb + ny);
        c[k++] = (mm_job){yb + oy, j[i].W, x, j[i].ldx, qb + oq, 2 * T};
        oq += 2 * (size_t)T * (size_t)(K / 32), oy += 2 * (size_t)T * (size_t)N;
    }
    moe_status st = mm_run_jobs(m, c, k, nt);
    oy = 0;
    for (int i = 0; i < n && !st; i++) {
        const int T = act16_pass_rows(&j[i], t0);
        if (T <= 0 || !act16_job(m, &j[i])) continue;
        const int64_t N = j[i].W->rows;
        const float *lo = yb + oy + (size_t)T * (size_t)N;
        float *y = j[i].y + (int64_t)t0 * N;
        for (int64_t u = 0; u < T * N; u++) y[u] = yb[oy + (size_t)u] + lo[u];
        oy += 2 * (size_t)T * (size_t)N;
    }
    free(c), free(qb), free(yb);
    return st;
}

/* the products of jobs j[0..n) in one parallel loop (mm_run_jobs), under MOE_FLAG_ACT16 with
 * the integer formats' input in two parts, ACT16_ROWS rows at a time */
static moe_status mm_run(const moe_model *m, const mm_job *j, int n, int nt) {
    int act16 = 0, T = 0;
    for (int i = 0; i < n; i++) act16 |= act16_job(m, &j[i]), T = j[i].T > T ? j[i].T : T;
    if (!act16) return mm_run_jobs(m, j, n, nt);
    moe_status st = MOE_OK;
    for (int t0 = 0; t0 < T && !st; t0 += ACT16_ROWS) st = mm_run_act16(m, j, n, nt, t0);
    return st;
}

/* quantized_rows' arguments, shared by the threads that split its rows */
typedef struct {
    const moe_model *m;
    const float *x;
    int64_t ldx, K;
    int T;
    moe__block_q8a *xq;
} quant_loop;

static void quant_share(void *arg, const par_ctx *p) {
    const quant_loop *l = arg;
    const int64_t nb = l->K / 32;
    int64_t t0, t1;
    par_share(p, l->T, &t0, &t1);
    for (int64_t t = t0; t < t1; t++) l->m->k.quant_q8a(l->x + t * l->ldx, l->xq + t * nb, l->K);
}

/* x[T, K] (row stride ldx) quantized by quant_q8a into a new array (NULL: out of memory) */
static moe__block_q8a *quantized_rows(const moe_model *m, const float *x, int64_t ldx, int T, int64_t K, int nt) {
    moe__block_q8a *xq = malloc(sizeof *xq * (size_t)(K / 32 * T) + 1);
    if (!xq) return NULL;
    quant_loop l = {m, x, ldx, K, T, xq};
    par_run(T > 1 && (int64_t)T * K > MM_PAR_MACS / 64 ? nt : 1, quant_share, &l);
    return xq;
}

/* Several products of one input x[T, K] (row stride ldx) in one parallel loop (mm_run), the
 * activations quantized to 8-bit blocks once if any matrix is an integer format. */
static moe_status matmul_multi(const moe_model *m, const float *x, int64_t ldx, int T, const mm_out *o, int n, int nt) {
    mm_job j[8];
    int quant = 0;
    if (n < 1 || n > 8) return MOE_ERR_ARG;
    const int64_t K = o[0].W->cols;
    for (int i = 0; i < n; i++) {
        if (o[i].W->cols != K) return MOE_ERR_ARG;
        quant |= mm_quantized(m, o[i].W);
    }
    moe__block_q8a *xq = NULL;
    if (quant && !(xq = quantized_rows(m, x, ldx, T, K, nt))) return MOE_ERR_NOMEM;
    for (int i = 0; i < n; i++) j[i] = (mm_job){o[i].y, o[i].W, x, ldx, xq, T};
    const moe_status st = mm_run(m, j, n, nt);
    free(xq);
    return st;
}

/* Products with inputs of their own (j[i].x, j[i].T; xq filled here where a matrix needs it) in
 * one parallel loop: the small second factors of KDA's gates, each too small to split alone. */
static moe_status matmul_each(const moe_model *m, mm_job *j, int n, int nt) {
    moe_status st = MOE_OK;
    for (int i = 0; i < n && !st; i++)
        if (mm_quantized(m, j[i].W) && !(j[i].xq = quantized_rows(m, j[i].x, j[i].ldx, j[i].T, j[i].W->cols, nt))) st = MOE_ERR_NOMEM;
    if (!st) st = mm_run(m, j, n, nt);
    for (int i = 0; i < n; i++) free((void *)j[i].xq), j[i].xq = NULL;
    return st;
}

static moe_status matmul_nt(const moe_model *m, float *y, const float *x, int64_t ldx, int T,
                            const moe__weight *W, int nt) {
    const mm_out o = {y, W};
    return matmul_multi(m, x, ldx, T, &o, 1, nt);
}

static moe_status matmul_ld(const moe_model *m, float *y, const float *x, int64_t ldx, int T, const moe__weight *W) {
    return matmul_nt(m, y, x, ldx, T, W, m->opt.n_threads);
}

static moe_status matmul(const moe_model *m, float *y, const float *x, int T, const moe__weight *W) {
    return matmul_ld(m, y, x, W->cols, T, W);
}
#define MM(y, x, T, W) (st = st ? st : matmul(m, (y), (x), (T), (W)))

/* =================================================================================================
 * PART 4: THE FORWARD PASS
 * =================================================================================================
 * docs/spec/MODEL.md in code order: norms and activations, the two token mixers (KDA linear attention,
 * section 6; MLA latent attention, section 7), the FFN and the routed MoE (section 8), attention
 * residuals (section 5.2), and the step that runs the layers over the rows of several sequences
 * at once (forward_layers). Mixers read and update their session's state; the FFN and MoE run on
 * all rows together so that an expert chosen by many rows is read once. Relies on PART 2 for
 * weights (expert_get, dense_get) and PART 3 for products and threads. */

/* ==== norms and activations ==================================================================== */

/* sum of squares in double, in four interleaved partial sums (one chain of dependent adds was
 * ~1% of a decode step) */
static double sum_squares(const float *x, int n) {
    double s[4] = {0, 0, 0, 0};
    int i = 0;
    for (; i + 4 <= n; i += 4)
        for (int k = 0; k < 4; k++) s[k] += (double)x[i + k] * x[i + k];
    for (; i < n; i++) s[0] += (double)x[i] * x[i];
    return (s[0] + s[1]) + (s[2] + s[3]);
}

static void rmsnorm(float *y, const float *x, const float *w, int n, float eps) {
    const double ss = sum_squares(x, n);
    float inv = (float)(1.0 / sqrt(ss / n + eps));
    for (int i = 0; i < n; i++) y[i] = x[i] * inv * w[i];
}

static void rmsnorm_rows(float *y, const float *x, const float *w, int rows, int n, float eps) {
    for (int t = 0; t < rows; t++) rmsnorm(y + (size_t)t * n, x + (size_t)t * n, w, n, eps);
}

static inline float sigmoidf(float z) { return 1.0f / (1.0f + expf(-z)); }

/* gate a, up b -> phi(a, b) into a (SwiGLU or SiTU-GLU, spec section 3) */
static void glu(const moe_model *m, float *a, const float *b, int64_t n) {
    const moe_config *c = &m->cfg;
    if (c->hidden_act == MOE_ACT_SILU) {
        m->k.act(a, a, n, MOE__ACT_SILU);
        for (int64_t i = 0; i < n; i++) a[i] *= b[i];
        return;
    }
    const float be = c->situ_beta, bl = c->situ_linear_beta;
    for (int64_t i = 0; i < n; i++) {
        float up = bl > 0 ? bl * tanhf(b[i] / bl) : b[i];
        a[i] = be * tanhf(a[i] / be) * sigmoidf(a[i]) * up;
    }
}

/* ==== KDA layer (spec section 6) ===============================================================
 * One sequence segment of n rows. The session keeps the last W-1 pre-convolution rows of q, k, v
 * and the per-head state S; both are updated here. */

#define KDA_CHUNK_MIN 16 /* below this many tokens the recurrence is used */

/* Work memory of one step that each layer's attention and MoE take in turn: a prefill chunk's
 * per-layer buffers are tens of MB (KDA: 42 MB for 512 rows on the benchmark shape), and a fresh
 * allocation that size came as new zeroed pages from the kernel in every layer (page faults and
 * clearing were ~7% of a 512-token prefill). The routed experts' buffers of a decode step have
 * their own (160 KB on the benchmark shape: allocated and freed per layer, glibc gave the heap's
 * top back and took it again each time, 23 times a token). Freed when the step ends. */
typedef struct {
    void *p;
    size_t cap;
} work_buf;

typedef struct {
    work_buf layer, experts;
} step_work;

/* at least `bytes` of w's memory (contents not kept); NULL if out of memory */
static void *work_get(work_buf *w, size_t bytes) {
    if (bytes > w->cap) {
        free(w->p);
        w->p = malloc(bytes);
        w->cap = w->p ? bytes : 0;
    }
    return w->p;
}

/* one KDA layer's per-head work (steps 2-7 of kda_forward) for n rows: the arrays and the
 * session's tail and state of kda_forward, shared by the heads */
typedef struct {
    const moe_model *m;
    const layer *L;
    int n, chunked, bounded;
    float qscale;
    float *tail, *state, *work;
    float *pre[3], *outs[3];
    const float *convw[3];
    float *q, *k, *v, *g, *o, *beta, *gate;
} kda_heads;

/* head h: everything from the convolution to the output gate touches only its channels */
static void kda_head(const kda_heads *kw, int h) {
    const moe_model *m = kw->m;
    const layer *L = kw->L;
    const moe_config *c = &m->cfg;
    const int H = c->kda_heads, D = c->kda_head_dim, HD = H * D, W = c->conv_kernel, Wm = W - 1, n = kw->n;
    const int chunked = kw->chunked, bounded = kw->bounded;
    const float qscale = kw->qscale;
    const size_t wsz = moe__kda_chunk_work(D);
    float *tail = kw->tail, *work = kw->work, *const *pre = kw->pre, *const *outs = kw->outs;
    const float *const *convw = kw->convw;
    float *q = kw->q, *k = kw->k, *v = kw->v, *g = kw->g, *o = kw->o, *beta = kw->beta, *gate = kw->gate;
    const size_t c0 = (size_t)h * D;
    /* 2. the causal depthwise convolution over the window [tail | new rows], this head's
     * channels: window row r < Wm is the session's tail row r, row Wm + t the new row t */
    float *th = tail + (size_t)h * Wm * 3 * D; /* this head's tail: [row][q, k, v][D] */
    for (int a = 0; a < 3; a++) {
        const float *nw = pre[a] + c0;
#define WINDOW_ROW(r) ((r) < Wm ? th + ((size_t)(r) * 3 + a) * D : nw + (size_t)((r) - Wm) * HD)
        for (int t = 0; t < n; t++) {
            const float *rows[KDA_CONV_MAX];
            for (int j = 0; j < W; j++) rows[j] = WINDOW_ROW(t + j);
            float *o = outs[a] + (size_t)t * HD + c0;
            m->k.dwconv(o, rows, convw[a] + c0, HD, W, D);
            m->k.act(o, o, D, MOE__ACT_SILU);
        }
        /* the window's last Wm rows become the tail (rows move up: row n + r > r is read
         * before it is overwritten) */
        for (int r = 0; r < Wm; r++) memmove(th + ((size_t)r * 3 + a) * D, WINDOW_ROW(n + r), sizeof(float) * D);
#undef WINDOW_ROW
    }
    const float ga = expf(L->A_log[h]);
    for (int t = 0; t < n; t++) {
        /* 3. L2 norm of q and k; q also scaled by D^-1/2 */
        float *qh = q + (size_t)t * HD + c0, *kh = k + (size_t)t * HD + c0;
        const double sq = sum_squares(qh, D), sk = sum_squares(kh, D);
        const float iq = (float)(1.0 / sqrt(sq + 1e-6)) * qscale, ik = (float)(1.0 / sqrt(sk + 1e-6));
        for (int i = 0; i < D; i++) qh[i] *= iq, kh[i] *= ik;
        /* 4. decay gate from z = (x f_a^T) f_b^T + dt_bias; 5. beta */
        float *gh = g + (size_t)t * HD + c0;
        const int bgate = c->kda_gate_bounded;
        for (int i = 0; i < D; i++) gh[i] = (gh[i] + L->dt_bias[c0 + (size_t)i]) * (bgate ? ga : 1.0f);
        m->k.act(gh, gh, D, bgate ? MOE__ACT_SIGMOID : MOE__ACT_SOFTPLUS);
        const float gs = bgate ? c->kda_gate_lower_bound : -ga; /* lb sigmoid(a z), or -a softplus(z) */
        for (int i = 0; i < D; i++) gh[i] *= gs;
        beta[(size_t)t * H + h] = sigmoidf(beta[(size_t)t * H + h]);
    }
    /* 6. the core: chunked for prefill, the recurrence for short steps */
    moe__kda_head a = {n, D, HD, H, q + c0, k + c0, v + c0, g + c0, beta + h, o + c0, kw->state + c0 * D};
    if (chunked) moe__kda_chunked(&a, bounded, work + wsz * (size_t)h, &m->k);
    else m->k.kda_recurrent(&a);
    /* 7. per-head RMSNorm and the output gate */
    for (int t = 0; t < n; t++) {
        float *oh = o + (size_t)t * HD + c0;
        float *gt = gate + (size_t)t * HD + c0;
        rmsnorm(oh, oh, L->o_norm, D, c->rms_norm_eps);
        m->k.act(gt, gt, D, MOE__ACT_SIGMOID);
        for (int i = 0; i < D; i++) oh[i] *= gt[i];
    }
}

static void kda_heads_share(void *arg, const par_ctx *p) {
    int64_t h0, h1;
    par_share(p, ((const kda_heads *)arg)->m->cfg.kda_heads, &h0, &h1);
    for (int64_t h = h0; h < h1; h++) kda_head(arg, (int)h);
}

static moe_status kda_forward(const moe_model *m, const layer *L, moe_session *s, int li,
                              const float *x, int n, float *out, step_work *wk) {
    const moe_config *c = &m->cfg;
    const int d = c->hidden_size, H = c->kda_heads, D = c->kda_head_dim, HD = H * D;
    const unsigned fl = m->opt.flags;
    const int chunked = (fl & MOE_FLAG_KDA_CHUNKED) ? 1 : (fl & MOE_FLAG_KDA_RECURRENT) ? 0 : n >= KDA_CHUNK_MIN;
    const size_t wsz = moe__kda_chunk_work(D), nbuf = 10 * (size_t)n * HD + (size_t)n * H + (size_t)n * D;
    float *buf = work_get(&wk->layer, sizeof(float) * (nbuf + (chunked ? wsz * (size_t)H : 0)));
    if (!buf) return MOE_ERR_NOMEM;
    float *work = chunked ? buf + nbuf : NULL;
    /* qp, kp, vp: the new rows of q, k, v before the convolution; q, k, v after it */
    float *qp = buf, *kp = qp + (size_t)n * HD, *vp = kp + (size_t)n * HD, *q = vp + (size_t)n * HD, *k = q + (size_t)n * HD;
    float *v = k + (size_t)n * HD, *g = v + (size_t)n * HD, *o = g + (size_t)n * HD, *og = o + (size_t)n * HD;
    float *gl = og + (size_t)n * HD, *beta = gl + (size_t)n * HD, *tmp = beta + (size_t)n * H;
    float *tail = s->conv_tail[li];
    moe_status st = MOE_OK;
    /* 1, 4, 5, 7. every projection of x in one pass: q, k, v, the decay gate's first factor,
     * beta, and the output gate (full rank, or its first factor) */
    {
        const mm_out proj[6] = {{qp, &L->q}, {kp, &L->k}, {vp, &L->v},
                                {tmp, &L->f_a}, {beta, &L->b}, {og, c->kda_full_rank_gate ? &L->g : &L->g_a}};
        st = matmul_multi(m, x, d, n, proj, 6, m->opt.n_threads);
    }
    /* 4, 7. the second factors of the decay gate and of a low-rank output gate */
    float *gate = c->kda_full_rank_gate ? og : gl; /* turned into the sigmoid gate in place */
    if (!st) {
        mm_job second[2] = {{g, &L->f_b, tmp, L->f_b.cols, NULL, n}, {gl, &L->g_b, og, L->g_b.cols, NULL, n}};
        st = matmul_each(m, second, c->kda_full_rank_gate ? 1 : 2, m->opt.n_threads);
    }
    if (st) return st;
    const int bounded = c->kda_gate_bounded && c->kda_gate_lower_bound >= -5.0f;
    const float qscale = 1.0f / sqrtf((float)D);
    /* 2-7 per head, the heads in parallel (a decode step has no serial part left) */
    kda_heads kh = {m, L, n, chunked, bounded, qscale, tail, s->kda_state[li], work, {qp, kp, vp}, {q, k, v},
                    {L->q_conv, L->k_conv, L->v_conv}, q, k, v, g, o, beta, gate};
    par_run(H > 1 ? m->opt.n_threads : 1, kda_heads_share, &kh);
    /* 8. output projection */
    MM(out, o, n, &L->o);
    return st;
}

/* ==== MLA layer (spec section 7) ===============================================================
 * The session caches, per token, the normalised latent c (r) and the shared key slice kr (d_r).
 * Attention runs either absorbed (queries mapped into the latent space: cheap when few queries
 * meet a long cache, i.e. decode) or expanded (keys/values rebuilt from the cache: cheaper when
 * many queries share the keys, i.e. prefill); the cost model below picks per call. */

/* bytes of one latent cache element (an int8 cache adds a moe__kv8_meta per row) */
static size_t kv_elem(const moe_model *m) { return m->opt.kv_type == MOE_KV_Q8 ? 1 : m->opt.kv_type == MOE_KV_BF16 ? 2 : 4; }

/* rows [j0, j0 + n) of a latent cache as f32 into out (a bf16 cache is widened: exact; an int8
 * one dequantized, c_i = dc q_i and kr_i = dr q_i) */
static const float *kv_rows_f32(const moe_model *m, const void *cache, const moe__kv8_meta *meta, int64_t j0, int64_t n, int64_t cw,
                                float *out) {
    if (m->opt.kv_type == MOE_KV_F32) return (const float *)cache + j0 * cw;
    if (m->opt.kv_type == MOE_KV_BF16) {
        m->k.widen_bf16(out, (const uint16_t *)cache + j0 * cw, n * cw);
        return out;
    }
    const int64_t r = m->cfg.kv_lora_rank;
    for (int64_t j = 0; j < n; j++) {
        const int8_t *q = (const int8_t *)cache + (j0 + j) * cw;
        const moe__kv8_meta *mt = meta + j0 + j;
        for (int64_t i = 0; i < cw; i++) out[j * cw + i] = (float)q[i] * (i < r ? mt->dc : mt->dr);
    }
    return out;
}

static moe_status mla_cache_reserve(moe_session *s, int li, int rows) {
    const moe_config *c = &s->m->cfg;
    if (rows <= s->mla_cap[li]) return MOE_OK;
    int cap = s->mla_cap[li] ? s->mla_cap[li] : 64;
    while (cap < rows) cap = cap > s->n_ctx / 2 ? s->n_ctx : cap * 2;
    if (cap < rows) cap = rows;
    size_t w = (size_t)c->kv_lora_rank + c->qk_rope_dim;
    const size_t bytes = kv_elem(s->m) * w * (size_t)cap;
    void *p = realloc(s->mla_cache[li], bytes);
    if (!p) return MOE_ERR_NOMEM;
    s->mla_cache[li] = p;
    /* huge pages for the rows not yet written: a decode step reads the whole cache from memory,
     * and with 4 KB pages the int8 scores of 6 layers x 8192 keys took 3.8 ms, with THP 3.1
     * (Zen 4, one thread; bench/RESULTS.md) */
    advise_huge(p, bytes);
    if (s->m->opt.kv_type == MOE_KV_Q8) {
        moe__kv8_meta *mp = realloc(s->mla_meta[li], sizeof *mp * (size_t)cap);
        if (!mp) return MOE_ERR_NOMEM; /* the larger cache is kept; its capacity is not raised */
        s->mla_meta[li] = mp;
    }
    s->mla_cap[li] = cap;
    return MOE_OK;
}

#define MLA_KEY_BLOCK 256 /* keys scored at once: per-head online softmax across blocks */
#define MLA_QUERY_BLOCK 64 /* query rows of one head whose scores the expanded form holds at once */
#define MLA_EXPANDED_BLOCK_BYTES (256.0 * 1024 * 1024) /* one key block's keys and values (all heads), at most */

/* rows_times_q's work in a thread's part of the absorbed attention's work area: under
 * MOE_FLAG_ACT16 three times the longest input or output of the absorbed products (k_b: d_n in,
 * r out; v_b: r in, d_v out), else none */
static size_t mla_act16_work(const moe_model *m) {
    const moe_config *c = &m->cfg;
    const int a = c->kv_lora_rank > c->qk_nope_dim ? c->kv_lora_rank : c->qk_nope_dim;
    return m->opt.flags & MOE_FLAG_ACT16 ? 3 * (size_t)(a > c->v_head_dim ? a : c->v_head_dim) : 0;
}

/* Absorbed attention of one query token over `len` cached latents, all heads at once (the heads
 * share the latent, as in MQA). The keys are split across the threads (split-K, as in flash
 * decoding): each thread streams its contiguous share of the cache once, in blocks of
 * MLA_KEY_BLOCK rows that stay in its own cache while every head is scored against them and
 * added to the thread's context sums, under the thread's own online softmax (running max and
 * sum per head, rescaled when the max grows). The threads' partial results are then merged
 * per head at the common max. Two barriers per token whatever the length; memory does not grow
 * with the context. The head's query is mapped into the latent space, and its latent context
 * back out, with a split GGUF's k_b / v_b as stored (integer kernels for Q8_0/Q4_0, activations
 * quantized like any matmul's) where the layer has them, else with kv_b's rows in floats.
 * With a bf16 cache the queries are rounded to bf16 and the block kernels take bf16 products
 * (moe__mla_block16: AVX512_BF16's dot product where the CPU has it), summed in f32. With an
 * int8 cache the queries are quantized per head like the rows (the latent part and the kr part
 * each with its scale) and the block's softmax weights per head to bytes (moe__mla_block8).
 * q: [H, d_n + d_r]; y: [H, d_v]; w: mla_absorbed_work floats: QA [H, r] (and with a bf16
 * cache the bf16 queries [H, r + d_r]; with an int8 one the int8 queries [H, r + d_r], their
 * transposed copy and their scales [H, 2]), then per thread SC [H, KB], CTX [H, r], M [H],
 * LS [H], one row [r], room for r quantized values [r] and, with a bf16 cache, the bf16 kernels'
 * work area (moe__mla_work16); with an int8 one the weights in bytes [H, KB], their scales [H] and
 * moe__mla_weights8's work [KB]; then rows_times_q's work (mla_act16_work). */
static size_t mla_absorbed_part(const moe_model *m) {
    const moe_config *c = &m->cfg;
    const size_t H = (size_t)c->mla_heads, r = (size_t)c->kv_lora_rank, cw = r + (size_t)c->qk_rope_dim;
    const size_t kv = m->opt.kv_type == MOE_KV_BF16 ? moe__mla_work16((int)H, (int)cw, MLA_KEY_BLOCK)
                      : m->opt.kv_type == MOE_KV_Q8 ? H * MLA_KEY_BLOCK / 4 + H + MLA_KEY_BLOCK
                                                    : 0;
    return H * MLA_KEY_BLOCK + H * r + 2 * H + 2 * r + kv + mla_act16_work(m);
}

/* the shared part (QA, and the queries in the cache's element), then each thread's */
static size_t mla_absorbed_shared(const moe_model *m) {
    const moe_config *c = &m->cfg;
    const size_t H = (size_t)c->mla_heads, cw = (size_t)c->kv_lora_rank + c->qk_rope_dim;
    const size_t kv = m->opt.kv_type == MOE_KV_BF16 ? (H * cw + 1) / 2
                      : m->opt.kv_type == MOE_KV_Q8 ? (H * cw + moe__mla_qt8_bytes((int)H, (int)cw) + 3) / 4 + 2 * H
                                                    : 0;
    return H * (size_t)c->kv_lora_rank + kv;
}

static size_t mla_absorbed_work(const moe_model *m, int nt) {
    return mla_absorbed_shared(m) + (size_t)nt * mla_absorbed_part(m);
}

/* the largest of x[0..n-1] (-inf for none), in 8 independent chains: one chain of compares was
 * 1.7% of a decode step at depth 16384 (a block's 256 scores per head) */
static float max_of(const float *x, int n) {
    float m[8] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    int j = 0;
    for (; j + 8 <= n; j += 8)
        for (int k = 0; k < 8; k++) m[k] = x[j + k] > m[k] ? x[j + k] : m[k];
    for (; j < n; j++) m[0] = x[j] > m[0] ? x[j] : m[0];
    for (int k = 1; k < 8; k++) m[0] = m[k] > m[0] ? m[k] : m[0];
    return m[0];
}

/* one token's absorbed attention (mla_absorbed_token's arguments) */
typedef struct {
    const moe_model *m;
    const layer *L;
    const void *cache;
    const moe__kv8_meta *meta;
    int len;
    const float *q;
    float *y, *w;
} mla_token;

/* thread p's share of mla_absorbed_token: its heads' queries, its keys, its heads' merge */
static void mla_token_share(void *arg, const par_ctx *p) {
    const mla_token *a = arg;
    const moe_model *m = a->m;
    const layer *L = a->L;
    const void *cache = a->cache;
    const moe__kv8_meta *meta = a->meta;
    const int len = a->len;
    const float *q = a->q;
    float *y = a->y, *w = a->w;
    const moe_config *c = &m->cfg;
    const int H = c->mla_heads, dn = c->qk_nope_dim, dr = c->qk_rope_dim, dv = c->v_head_dim, r = c->kv_lora_rank;
    const int dq = dn + dr, cw = r + dr, KB = MLA_KEY_BLOCK;
    const float scale = 1.0f / sqrtf((float)dq);
    const size_t per = mla_absorbed_part(m);
    float *QA = w;
    uint16_t *Q16 = (uint16_t *)(QA + (size_t)H * r); /* a bf16 cache: the queries in bf16 [H, cw] */
    int8_t *Q8 = (int8_t *)(QA + (size_t)H * r), *QT8 = Q8 + (size_t)H * cw; /* an int8 cache: [H, cw], transposed */
    float *QD = (float *)(void *)(QA + (size_t)H * r + ((size_t)H * cw + moe__mla_qt8_bytes(H, cw) + 3) / 4); /* their scales [H, 2] */
    const int bf16 = m->opt.kv_type == MOE_KV_BF16, q8 = m->opt.kv_type == MOE_KV_Q8;
    const int64_t kvrow = moe__row_bytes(L->kv_b.type, r), kvsb = L->kv_b.type == MOE_T_MXFP4 ? r / 32 : 0;
    const int split = L->k_b.data && !L->stream; /* a streamed layer reads only its cache unit */
    const int tid = p->me, nth = p->nth;
    const int h0 = H * tid / nth, h1 = H * (tid + 1) / nth; /* this thread's heads */
    float *SC = w + mla_absorbed_shared(m) + (size_t)tid * per, *CTX = SC + (size_t)H * KB, *M = CTX + (size_t)H * r, *LS = M + H;
    float *row = LS + H;
    moe__block_q8a *xq = (moe__block_q8a *)(void *)(row + r);
    float *wide = row + 2 * (size_t)r;
    uint8_t *W8 = (uint8_t *)wide; /* an int8 cache: the block's weights in bytes [H, KB], their scales [H], work */
    float *WS8 = wide + (size_t)H * KB / 4;
    float *A16 = SC + per - mla_act16_work(m); /* rows_times_q's work */
    /* q^_h = W_UK,h^T qn_h, this thread's heads: k_b rows h*r .. +r, or kv_b rows
     * h*(d_n+d_v) .. +d_n taken as columns */
    for (int h = h0; h < h1 && split; h++) {
        if (mm_quantized(m, &L->k_b)) m->k.quant_q8a(q + (size_t)h * dq, xq, dn);
        rows_times_q(m, &L->k_b, (int64_t)h * r, r, q + (size_t)h * dq, xq, QA + (size_t)h * r, 1.0f, A16);
    }
    for (int h = h0; h < h1 && !split; h++) {
        float *qa = QA + (size_t)h * r;
        memset(qa, 0, sizeof(float) * (size_t)r);
        for (int i = 0; i < dn; i++) {
            const int64_t wr = (int64_t)h * (dn + dv) + i;
            const unsigned char *wp = (const unsigned char *)L->kv_b.data + wr * kvrow;
            const float *rw = (const float *)wp;
            if (L->kv_b.type != MOE_T_F32) {
                moe__row_to_f32(L->kv_b.type, wp, L->kv_b.scale ? L->kv_b.scale + wr * kvsb : NULL, row, r);
                rw = row;
            }
            m->k.axpy(qa, q[(size_t)h * dq + i], rw, r);
        }
    }
    for (int h = h0; h < h1 && bf16; h++) /* [q^_h | q_r,h] rounded to bf16 */
        for (int i = 0; i < cw; i++) Q16[(size_t)h * cw + i] = moe__f32_to_bf16(i < r ? QA[(size_t)h * r + i] : q[(size_t)h * dq + dn + i - r]);
    for (int h = h0; h < h1 && q8; h++) { /* q^_h and q_r,h in int8, each with its scale */
        int32_t sum;
        m->k.quant8_row(QA + (size_t)h * r, r, Q8 + (size_t)h * cw, &QD[2 * h], &sum);
        m->k.quant8_row(q + (size_t)h * dq + dn, dr, Q8 + (size_t)h * cw + r, &QD[2 * h + 1], &sum);
    }
    memset(CTX, 0, sizeof(float) * (size_t)H * r);
    for (int h = 0; h < H; h++) M[h] = -INFINITY, LS[h] = 0;
    par_barrier(p);
    if (q8 && tid == 0) moe__mla_qt8(Q8, H, cw, QT8); /* every head's int8 query, transposed */
    par_barrier(p);
    /* this thread's keys, every head */
    const int jb = (int)((int64_t)len * tid / nth), je = (int)((int64_t)len * (tid + 1) / nth);
    for (int j0 = jb; j0 < je; j0 += KB) {
        const int jn = je - j0 < KB ? je - j0 : KB;
        const moe__mla_block blk = {H, r, dr, cw, jn, 0, jn, KB, dq, scale, QA, q + dn, bf16 ? NULL : (const float *)cache + (size_t)j0 * cw, SC, CTX};
        const moe__mla_block16 b16 = {H, r, cw, jn, 0, jn, KB, scale, Q16, bf16 ? (const uint16_t *)cache + (size_t)j0 * cw : NULL, SC, CTX, wide};
        const moe__mla_block8 b8 = {H, r, cw, jn, 0, jn, KB, KB, scale, Q8, QT8, QD, q8 ? (const int8_t *)cache + (size_t)j0 * cw : NULL,
                                    q8 ? meta + j0 : NULL, SC, CTX, W8, WS8};
        if (bf16) m->k.mla_scores16(&b16);
        else if (q8) m->k.mla_scores8(&b8);
        else m->k.mla_scores(&blk);
        for (int h = 0; h < H; h++) {
            float *sc = SC + (size_t)h * KB, mx = max_of(sc, jn);
            mx = M[h] > mx ? M[h] : mx;
            const float f = expf(M[h] - mx); /* 0 on the first block */
            if (f != 1.0f) {
                for (int i = 0; i < r; i++) CTX[(size_t)h * r + i] *= f;
                LS[h] *= f;
            }
            LS[h] += m->k.exp_sum(sc, sc, mx, jn);
            M[h] = mx;
        }
        if (bf16) m->k.mla_ctx16(&b16, 0, H);
        else if (q8) {
            m->k.mla_weights8(SC, KB, b8.meta, jn, 0, H, W8, KB, WS8, WS8 + H);
            m->k.mla_ctx8(&b8, 0, H);
        } else
            m->k.mla_ctx(&blk, 0, H);
    }
    par_barrier(p);
    /* merge the threads' partial sums at the common max, this thread's heads; then
     * y_h = W_UV,h ctx_h / sum */
    for (int h = h0; h < h1; h++) {
        /* thread t's CTX, M and LS, at the offsets of this thread's own */
#define PART(t, p) (w + mla_absorbed_shared(m) + (size_t)(t) * per + ((p) - SC))
        float mx = -INFINITY, ls = 0;
        for (int t = 0; t < nth; t++) mx = PART(t, M)[h] > mx ? PART(t, M)[h] : mx;
        memset(row, 0, sizeof(float) * (size_t)r);
        for (int t = 0; t < nth; t++) {
            const float mt = PART(t, M)[h];
            if (mt == -INFINITY) continue; /* a thread without keys (len < threads) */
            const float f = expf(mt - mx);
            ls += f * PART(t, LS)[h];
            m->k.axpy(row, f, PART(t, CTX) + (size_t)h * r, r);
        }
#undef PART
        const moe__weight *uv = split ? &L->v_b : &L->kv_b; /* W_UV,h: v_b rows h*d_v.., or kv_b rows h*(d_n+d_v)+d_n.. */
        if (mm_quantized(m, uv)) m->k.quant_q8a(row, xq, r);
        rows_times_q(m, uv, split ? (int64_t)h * dv : (int64_t)h * (dn + dv) + dn, dv, row, xq, y + (size_t)h * dv, 1.0f / ls, A16);
    }
}

static void mla_absorbed_token(const moe_model *m, const layer *L, const void *cache, const moe__kv8_meta *meta, int len,
                               const float *q, float *y, float *w, int nt) {
    mla_token a = {m, L, cache, meta, len, q, y, w};
    par_run(nt, mla_token_share, &a);
}

moe_status moe__matmul(const moe__weight *const *W, float *const *y, int n, const float *x, int T, int nt, unsigned flags) {
    if (n < 1 || n > 8 || nt < 1 || T < 1) return MOE_ERR_ARG;
    moe_model *m = calloc(1, sizeof *m);
    if (!m) return MOE_ERR_NOMEM;
    moe__kernels_init(&m->k, flags);
    m->opt.flags = flags; /* MOE_FLAG_MXFP4_INT8 */
    mm_out o[8];
    for (int i = 0; i < n; i++) o[i] = (mm_out){y[i], W[i]};
    const moe_status st = matmul_multi(m, x, W[0]->cols, T, o, n, nt);
    free(m);
    return st;
}

void moe__set_mla_key_block(moe_model *m, int keys) {
    if (m) m->mla_key_block = keys > 0 ? keys : 0;
}

void moe__set_step_team(moe_model *m, int mode) {
    if (m) m->step_team = mode;
}

/* one key block of mla_expanded, shared by the heads: the block's keys k0 .. k0+kn-1 (latents in
 * rows, keys and values through kv_b in kv), the query rows, outputs and running softmax state */
typedef struct {
    const moe_model *m;
    const float *q, *rows, *kv;
    float *y, *scr, *MX;
    double *LS;
    size_t scratch, kvw;
    int pos, n, k0, kn, KB;
    float scale;
} mla_key_block;

/* head h of the block, in thread me's scratch */
static void mla_expanded_head(const mla_key_block *b, int h, int me) {
    const moe_model *m = b->m;
    const moe_config *c = &m->cfg;
    const int H = c->mla_heads, dn = c->qk_nope_dim, dr = c->qk_rope_dim, dv = c->v_head_dim;
    const int r = c->kv_lora_rank, dq = dn + dr, cw = r + dr, QB = MLA_QUERY_BLOCK;
    const int pos = b->pos, n = b->n, k0 = b->k0, kn = b->kn, KB = b->KB;
    const size_t scratch = b->scratch, kvw = b->kvw;
    const float scale = b->scale, *q = b->q, *rows = b->rows, *kv = b->kv;
    float *y = b->y, *scr = b->scr, *MX = b->MX;
    double *LS = b->LS;
    float *K = scr + scratch * (size_t)me, *V = K + (size_t)KB * dq, *QN = V + (size_t)KB * dv;
    float *QR = QN + (size_t)n * dn, *SC = QR + (size_t)n * dr, *CT = SC + (size_t)QB * KB, *F = CT + (size_t)QB * dv;
    for (int j = 0; j < kn; j++) {
        const float *src = kv + (size_t)j * kvw + (size_t)h * (dn + dv);
        memcpy(K + (size_t)j * dq, src, sizeof(float) * dn);
        memcpy(K + (size_t)j * dq + dn, rows + (size_t)j * cw + r, sizeof(float) * dr);
        memcpy(V + (size_t)j * dv, src + dn, sizeof(float) * dv);
    }
    for (int t = 0; t < n; t++) {
        memcpy(QN + (size_t)t * dn, q + (size_t)t * H * dq + (size_t)h * dq, sizeof(float) * dn);
        memcpy(QR + (size_t)t * dr, q + (size_t)t * H * dq + (size_t)h * dq + dn, sizeof(float) * dr);
    }
    for (int t0 = 0; t0 < n; t0 += QB) {
        const int nq = n - t0 < QB ? n - t0 : QB, last = pos + t0 + nq - 1; /* the query block's last position */
        if (k0 > last) continue;                                            /* it sees no key of this block */
        const int keys = last + 1 - k0 < kn ? last + 1 - k0 : kn;
        moe__mla_block b = {nq, dn, dr, dq, keys, 0, keys, KB, dr, scale, QN + (size_t)t0 * dn, QR + (size_t)t0 * dr, K, SC, CT};
        m->k.mla_scores(&b);
        for (int i = 0; i < nq; i++) { /* row t0 + i sees keys up to position pos + t0 + i */
            float *sc = SC + (size_t)i * KB, mx = -INFINITY;
            const int vis = pos + t0 + i + 1 - k0 < keys ? pos + t0 + i + 1 - k0 : keys;
            const size_t at = (size_t)(t0 + i) * H + h;
            mx = max_of(sc, vis);
            const float mnew = mx > MX[at] ? mx : MX[at];
            F[i] = vis > 0 && MX[at] != -INFINITY ? expf(MX[at] - mnew) : 1.0f; /* the old sums' rescale */
            if (vis > 0) {
                LS[at] = LS[at] * F[i] + m->k.exp_sum(sc, sc, mnew, vis);
                MX[at] = mnew;
            }
            for (int j = vis > 0 ? vis : 0; j < keys; j++) sc[j] = 0;
        }
        memset(CT, 0, sizeof(float) * (size_t)nq * dv);
        moe__mla_block bv = {nq, dv, 0, dv, keys, 0, keys, KB, 0, 1.0f, NULL, NULL, V, SC, CT};
        m->k.mla_ctx(&bv, 0, nq);
        for (int i = 0; i < nq; i++) {
            float *yo = y + (size_t)(t0 + i) * H * dv + (size_t)h * dv;
            for (int d = 0; d < dv; d++) yo[d] = yo[d] * F[i] + CT[(size_t)i * dv + d];
        }
    }
}

static void mla_expanded_share(void *arg, const par_ctx *p) {
    int64_t h0, h1;
    par_share(p, ((const mla_key_block *)arg)->m->cfg.mla_heads, &h0, &h1);
    for (int64_t h = h0; h < h1; h++) mla_expanded_head(arg, (int)h, p->me);
}

/* Expanded attention of the n query rows at positions pos .. pos+n-1 over the pos+n cached
 * latents, in blocks of keys: each block's keys and values are rebuilt from its latents through
 * kv_b for all heads (at most MLA_EXPANDED_BLOCK_BYTES of them), then the heads in parallel: the
 * head's keys and values of the block made contiguous, its query rows scored against them in
 * blocks of MLA_QUERY_BLOCK through the absorbed form's register-tiled kernels (the rows standing
 * in for its heads), keys after a row's position masked out, and the row's context sums updated
 * under an online softmax (running max and sum, rescaled when the max grows), as the absorbed
 * form does across its key blocks. Memory does not grow with the context.
 * q: [n, H, d_n + d_r]; y: [n, H, d_v]. */
static moe_status mla_expanded(const moe_model *m, const layer *L, const void *cache, const moe__kv8_meta *meta, int pos, int n,
                               const float *q, float *y, int nt) {
    const moe_config *c = &m->cfg;
    const int H = c->mla_heads, dn = c->qk_nope_dim, dr = c->qk_rope_dim, dv = c->v_head_dim;
    const int r = c->kv_lora_rank, dq = dn + dr, cw = r + dr, S = pos + n, QB = MLA_QUERY_BLOCK;
    const size_t kvw = (size_t)H * (dn + dv);
    const float scale = 1.0f / sqrtf((float)dq);
    int KB = m->mla_key_block ? m->mla_key_block : (int)(MLA_EXPANDED_BLOCK_BYTES / (kvw * sizeof(float)));
    KB = KB < 16 ? 16 : KB > S ? S : KB;
    /* the block's latents in f32 [KB, cw] (copied from a bf16 cache) and keys/values [KB, H(d_n +
     * d_v)]; per query row and head the running max and sum [n, H]; per thread one head's block
     * keys [KB, d_q] and values [KB, d_v], its query rows [n, d_n] and [n, d_r], one query block's
     * scores [QB, KB], context [QB, d_v] and rescale factors [QB] */
    const size_t scratch = (size_t)KB * (dq + dv) + (size_t)n * dq + (size_t)QB * ((size_t)KB + dv + 1) + 16;
    float *buf = malloc(sizeof(float) * ((size_t)KB * cw + (size_t)KB * kvw + (size_t)n * H + scratch * (size_t)nt));
    double *LS = malloc(sizeof(double) * (size_t)n * H);
    if (!buf || !LS) {
        free(buf), free(LS);
        return MOE_ERR_NOMEM;
    }
    float *wide = buf, *kv = wide + (size_t)KB * cw, *MX = kv + (size_t)KB * kvw, *scr = MX + (size_t)n * H;
    for (size_t i = 0; i < (size_t)n * H; i++) MX[i] = -INFINITY, LS[i] = 0;
    memset(y, 0, sizeof(float) * (size_t)n * H * dv);
    moe_status st = MOE_OK;
    for (int k0 = 0; k0 < S && !st; k0 += KB) {
        const int kn = S - k0 < KB ? S - k0 : KB;
        const float *rows = kv_rows_f32(m, cache, meta, k0, kn, cw, wide);
        if ((st = matmul_ld(m, kv, rows, cw, kn, &L->kv_b))) break; /* [kn, H (d_n + d_v)] */
        mla_key_block b = {m, q, rows, kv, y, scr, MX, LS, scratch, kvw, pos, n, k0, kn, KB, scale};
        par_run(H > 1 ? nt : 1, mla_expanded_share, &b);
    }
    for (int t = 0; t < n && !st; t++) /* every row saw at least its own key */
        for (int h = 0; h < H; h++) {
            const float inv = (float)(1.0 / LS[(size_t)t * H + h]);
            float *yo = y + (size_t)t * H * dv + (size_t)h * dv;
            for (int d = 0; d < dv; d++) yo[d] *= inv;
        }
    free(buf), free(LS);
    return st;
}

static moe_status mla_forward(const moe_model *m, const layer *L, moe_session *s, int li,
                              const float *x, int n, float *out, step_work *wk) {
    const moe_config *c = &m->cfg;
    const int H = c->mla_heads, dn = c->qk_nope_dim, dr = c->qk_rope_dim, dv = c->v_head_dim;
    const int r = c->kv_lora_rank, dq = dn + dr, cw = r + dr, pos = s->pos;
    const int S = pos + n; /* keys after this step */
    moe_status st = mla_cache_reserve(s, li, S);
    if (st) return st;
    /* cost of the two attention forms (multiply-adds), averaged over the causal triangle */
    const double savg = pos + (n + 1) / 2.0;
    double absorbed = (double)n * H * (savg * (2.0 * r + dr) + (double)(dn + dv) * r);
    const double expanded = (double)S * H * (dn + dv) * r + (double)n * H * savg * (dq + dv);
    /* with an int8 cache the absorbed products are integer ones: one dpbusd or SDOT does 4x the
     * multiply-adds of an f32 FMA of the same width, the AVX2 and plain NEON forms (2-3
     * instructions) about 2x. Filling 8192 tokens of the benchmark shape (Zen 4, AVX-512 VNNI, 2
     * threads): in 512-row chunks 62.0 s absorbed against 72.2 expanded; in 2048-row chunks, where
     * a factor of 2 picked the expanded form for the later chunks, 66.9 s absorbed against 76.4 */
    if (m->opt.kv_type == MOE_KV_Q8) absorbed /= m->k.dot8 ? 4 : 2;
    int use_expanded = expanded < absorbed;
    if (m->opt.flags & MOE_FLAG_MLA_ABSORBED) use_expanded = 0;
    if (m->opt.flags & MOE_FLAG_MLA_EXPANDED) use_expanded = 1;
#ifdef _OPENMP
    const int nt = m->opt.n_threads;
#else
    const int nt = 1;
#endif
    size_t qn = (size_t)n * H * dq, yn = (size_t)n * H * dv;
    size_t work = use_expanded ? 0 : mla_absorbed_work(m, nt); /* the expanded form allocates its own */
    const int bf16 = m->opt.kv_type == MOE_KV_BF16;
    size_t qa = c->q_lora_rank ? (size_t)n * c->q_lora_rank : 0;
    size_t gn = c->mla_output_gate ? yn : 0;
    float *buf = work_get(&wk->layer, sizeof(float) * (qn + yn + gn + qa + (size_t)n * cw + work));
    if (!buf) return MOE_ERR_NOMEM;
    float *q = buf, *y = q + qn, *gate = y + yn, *qa_buf = gate + gn;
    float *lat = qa_buf + qa, *scr = lat + (size_t)n * cw;
    /* 1, 2, 5. the projections of x in one pass: queries (or their LoRA's first factor), the
     * latents, the output gate */
    {
        const mm_out proj[3] = {{c->q_lora_rank ? qa_buf : q, c->q_lora_rank ? &L->q_a : &L->q}, {lat, &L->kv_a}, {gate, &L->g}};
        st = matmul_multi(m, x, c->hidden_size, n, proj, c->mla_output_gate ? 3 : 2, m->opt.n_threads);
    }
    if (c->q_lora_rank) {
        rmsnorm_rows(qa_buf, qa_buf, L->q_a_norm, n, c->q_lora_rank, 1e-6f);
        MM(q, qa_buf, n, &L->q_b);
    }
    /* 2. latents into the cache (normalised c, then kr), rounded to bf16 for a bf16 cache,
     * quantized (each part with its scale) for an int8 one */
    void *cache = s->mla_cache[li];
    moe__kv8_meta *meta = s->mla_meta[li];
    for (int t = 0; t < n; t++) {
        float *l = lat + (size_t)t * cw;
        rmsnorm(l, l, L->kv_a_norm, r, 1e-6f);
        if (m->opt.kv_type == MOE_KV_Q8) {
            int8_t *row = (int8_t *)cache + (size_t)(pos + t) * cw;
            moe__kv8_meta *mt = meta + pos + t;
            m->k.quant8_row(l, r, row, &mt->dc, &mt->sc);
            m->k.quant8_row(l + r, dr, row + r, &mt->dr, &mt->sr);
        } else if (bf16)
            for (int i = 0; i < cw; i++) ((uint16_t *)cache)[(size_t)(pos + t) * cw + i] = moe__f32_to_bf16(l[i]);
        else
            memcpy((float *)cache + (size_t)(pos + t) * cw, l, sizeof(float) * cw);
    }
    if (!st && use_expanded) st = mla_expanded(m, L, cache, meta, pos, n, q, y, nt);
    for (int t = 0; t < n && !st && !use_expanded; t++)
        mla_absorbed_token(m, L, cache, meta, pos + t + 1, q + (size_t)t * H * dq, y + (size_t)t * H * dv, scr, nt);
    /* 5. output gate; 6. output projection */
    if (c->mla_output_gate) {
        m->k.act(gate, gate, (int64_t)yn, MOE__ACT_SIGMOID);
        for (size_t i = 0; i < yn; i++) y[i] *= gate[i];
    }
    MM(out, y, n, &L->o);
    return st;
}

/* ==== FFN and MoE (spec section 8) ============================================================= */

static moe_status ffn_forward(const moe_model *m, const moe__weight *gate, const moe__weight *up,
                              const moe__weight *down, const float *x, int n, float *out) {
    const int64_t I = gate->rows;
    float *a = malloc(sizeof(float) * 2 * (size_t)n * (size_t)I);
    if (!a) return MOE_ERR_NOMEM;
    float *b = a + (size_t)n * I;
    const mm_out proj[2] = {{a, gate}, {b, up}};
    moe_status st = matmul_multi(m, x, gate->cols, n, proj, 2, m->opt.n_threads);
    glu(m, a, b, (int64_t)n * I);
    MM(out, a, n, down);
    free(a);
    return st;
}

/* Top-k selection per row on s' = s + bias (grouped when G > 1 and G > G_k); weights from the
 * unbiased s. ids come out sorted ascending. */
static void route_rows(const moe_config *c, const float *logits, const float *bias, int n,
                       const int32_t *const *forced, int32_t *ids, float *wts, float *work) {
    const int E = c->n_experts, K = c->n_active, G = c->n_groups, Gk = c->topk_groups;
    float *s = work, *sel = work + E; /* work: 4E floats */
    for (int t = 0; t < n; t++) {
        const float *l = logits + (size_t)t * E;
        if (c->router_softmax) {
            float mx = -INFINITY;
            for (int e = 0; e < E; e++) mx = l[e] > mx ? l[e] : mx;
            double sum = 0;
            for (int e = 0; e < E; e++) sum += s[e] = expf(l[e] - mx);
            for (int e = 0; e < E; e++) s[e] = (float)(s[e] / sum);
        } else {
            for (int e = 0; e < E; e++) s[e] = sigmoidf(l[e]);
        }
        for (int e = 0; e < E; e++) sel[e] = s[e] + bias[e];
        if (G > 1 && G > Gk) {
            const int per = E / G;
            float *gscore = sel + E;
            unsigned char *keep = (unsigned char *)(gscore + G);
            for (int gi = 0; gi < G; gi++) {
                float b1 = -INFINITY, b2 = -INFINITY;
                for (int e = gi * per; e < (gi + 1) * per; e++) {
                    if (sel[e] > b1) b2 = b1, b1 = sel[e];
                    else if (sel[e] > b2) b2 = sel[e];
                }
                gscore[gi] = per > 1 ? b1 + b2 : b1;
                keep[gi] = 0;
            }
            for (int kk = 0; kk < Gk; kk++) {
                int best = -1;
                for (int gi = 0; gi < G; gi++)
                    if (!keep[gi] && (best < 0 || gscore[gi] > gscore[best])) best = gi;
                keep[best] = 1;
            }
            for (int gi = 0; gi < G; gi++)
                if (!keep[gi])
                    for (int e = gi * per; e < (gi + 1) * per; e++) sel[e] = -INFINITY;
        }
        int32_t *id = ids + (size_t)t * K;
        float *w = wts + (size_t)t * K;
        if (forced && forced[t]) {
            memcpy(id, forced[t], sizeof(int32_t) * (size_t)K);
            goto weights;
        }
        unsigned char *taken = (unsigned char *)(sel + E);
        /* (taken reuses the group-score space: grouping is done by now) */
        memset(taken, 0, (size_t)E);
        for (int kk = 0; kk < K; kk++) { /* k passes: K is small (<= 16 in the family) */
            int best = -1;
            for (int e = 0; e < E; e++)
                if (!taken[e] && (best < 0 || sel[e] > sel[best])) best = e;
            id[kk] = best;
            taken[best] = 1;
        }
    weights:
        /* sort ids ascending (insertion sort; K is small) */
        for (int i = 1; i < K; i++) {
            int32_t v = id[i];
            int j = i - 1;
            while (j >= 0 && id[j] > v) id[j + 1] = id[j], j--;
            id[j + 1] = v;
        }
        double sum = 0;
        for (int kk = 0; kk < K; kk++) sum += w[kk] = s[id[kk]];
        for (int kk = 0; kk < K; kk++) {
            if (K > 1 && c->renormalize) w[kk] = (float)(w[kk] / (sum + 1e-20));
            w[kk] *= c->routed_scaling_factor;
        }
    }
}

/* The few rows of each routed expert (decode) through the mapping, as two parallel products for
 * the whole layer: the gate and up rows of every routed expert split across the threads, then
 * their down rows. One thread per expert (what the cache needs: each thread pins its expert)
 * leaves one thread waiting for the other's last expert; this way they finish together. Same
 * kernel calls on the same data as one expert at a time. Expert e's rows cnt[e] .. cnt[e+1]-1
 * (positions rows[] in xe) get their buffers at eb + cnt[e] * (2 de + 2 Ie): inputs, gate, up,
 * output. With sh, the shared experts' products on the full-width rows x join those two loops
 * (5 fork/joins per MoE layer -> 3: 4% of a decode step at 16 threads) and their output goes to
 * sh, as ffn_forward would compute it. */
static moe_status experts_by_rows(const moe_model *m, const layer *L, const int *cnt, const int *rows, const float *xe, int n, int de,
                                  int Ie, float *eb, const float *x, float *sh) {
    const int E = m->cfg.n_experts, d = m->cfg.hidden_size;
    const int64_t nk = cnt[E], per = 2 * (int64_t)de + 2 * (int64_t)Ie, nb = de / 32;
    const int64_t Is = sh ? L->gate.rows : 0, sq = mm_quantized(m, &L->gate) || mm_quantized(m, &L->up), dq = sh && mm_quantized(m, &L->down);
    int na = 0, quant = 0;
    for (int e = 0; e < E; e++)
        if (cnt[e + 1] > cnt[e]) na++, quant |= mm_quantized(m, &L->experts[e].w1) || mm_quantized(m, &L->experts[e].w3);
    mm_job *j = malloc(sizeof *j * (2 * (size_t)na + 2));
    /* the n input rows quantized once; the gathered rows of experts with several; their down
     * inputs; the shared experts' inputs (full width) and down inputs */
    moe__block_q8a *xq = malloc(sizeof *xq * (size_t)((n + nk) * nb + nk * (Ie / 32) + n * (d / 32 + Is / 32) + 1));
    moe__block_q8a *xqg = xq + n * nb, *xqd = xqg + nk * nb, *xqs = xqd + nk * (Ie / 32), *xqsd = xqs + n * (d / 32);
    float *sa = sh ? malloc(sizeof(float) * 2 * (size_t)n * (size_t)Is) : NULL, *sb = sa ? sa + (size_t)n * Is : NULL;
    moe_status st = j && xq && (sa || !sh) ? MOE_OK : MOE_ERR_NOMEM;
    for (int t = 0; t < n && quant && !st; t++) m->k.quant_q8a(xe + (size_t)t * de, xq + t * nb, de);
    /* without a latent projection xe holds x's values: its quantized rows serve the shared experts */
    const moe__block_q8a *xsq = sh && sq ? (!m->cfg.latent_dim && quant ? xq : xqs) : NULL;
    for (int t = 0; t < n && xsq == xqs && !st; t++) m->k.quant_q8a(x + (size_t)t * d, xqs + t * (d / 32), d);
    int nj = 0;
    if (sh) { /* the shared experts' products join the routed experts' (one parallel loop each) */
        j[nj++] = (mm_job){sa, &L->gate, x, d, xsq, n};
        j[nj++] = (mm_job){sb, &L->up, x, d, xsq, n};
    }
    for (int e = 0; e < E && !st; e++) {
        const int c0 = cnt[e], ce = cnt[e + 1] - c0;
        if (!ce) continue;
        const expert *ex = &L->experts[e];
        float *bx = eb + c0 * per, *ba = bx + (size_t)ce * de, *bb = ba + (size_t)ce * Ie;
        const int q = mm_quantized(m, &ex->w1) || mm_quantized(m, &ex->w3);
        const float *in = xe + (size_t)rows[c0] * de; /* one row: read in place */
        const moe__block_q8a *xqe = q ? xq + rows[c0] * nb : NULL;
        if (ce > 1) { /* several: gathered into the expert's buffer */
            for (int i = 0; i < ce; i++) {
                memcpy(bx + (size_t)i * de, xe + (size_t)rows[c0 + i] * de, sizeof(float) * de);
                if (q) memcpy(xqg + (c0 + i) * nb, xq + rows[c0 + i] * nb, sizeof *xq * (size_t)nb);
            }
            in = bx, xqe = q ? xqg + c0 * nb : NULL;
        }
        j[nj++] = (mm_job){ba, &ex->w1, in, de, xqe, ce};
        j[nj++] = (mm_job){bb, &ex->w3, in, de, xqe, ce};
    }
    if (!st) st = mm_run(m, j, nj, m->opt.n_threads);
    nj = 0;
    if (sh && !st) {
        glu(m, sa, sb, (int64_t)n * Is);
        for (int t = 0; t < n && dq; t++) m->k.quant_q8a(sa + (size_t)t * Is, xqsd + t * (Is / 32), Is);
        j[nj++] = (mm_job){sh, &L->down, sa, Is, dq ? xqsd : NULL, n};
    }
    for (int e = 0; e < E && !st; e++) {
        const int c0 = cnt[e], ce = cnt[e + 1] - c0;
        if (!ce) continue;
        const expert *ex = &L->experts[e];
        float *ba = eb + c0 * per + (size_t)ce * de, *bb = ba + (size_t)ce * Ie, *bo = bb + (size_t)ce * Ie;
        moe__block_q8a *q = mm_quantized(m, &ex->w2) ? xqd + (int64_t)c0 * (Ie / 32) : NULL;
        glu(m, ba, bb, (int64_t)ce * Ie);
        for (int i = 0; i < ce && q; i++) m->k.quant_q8a(ba + (size_t)i * Ie, q + (int64_t)i * (Ie / 32), Ie);
        j[nj++] = (mm_job){bo, &ex->w2, ba, Ie, q, ce};
    }
    if (!st) st = mm_run(m, j, nj, m->opt.n_threads);
    free(j), free(xq), free(sa);
    return st;
}

/* CACHE mode read-ahead: guesses the next MoE layer's experts with its router on this layer's
 * input x [n, d] and queues them for the I/O threads, which read them while this layer and the
 * next attention compute; pred[e] = 1 for each guessed expert and *pred_layer = that layer (-1
 * if there is none or the guess failed). logits [n, E] and work (4E floats) are scratch. */
static void predict_next_layer(const moe_model *m, int li, const float *x, int n, float *logits, float *work,
                               unsigned char *pred, int *pred_layer, moe_step_stats *stats) {
    const moe_config *c = &m->cfg;
    const size_t nk = (size_t)n * c->n_active;
    int nl = li + 1;
    while (nl < c->n_layers && !m->layer_moe[nl]) nl++;
    int32_t *pids = nl < c->n_layers ? malloc(sizeof(int32_t) * nk) : NULL;
    float *pw = pids ? malloc(sizeof(float) * nk) : NULL;
    *pred_layer = -1;
    if (pw && !matmul(m, logits, x, n, &m->layers[nl].router)) {
        route_rows(c, logits, m->layers[nl].router_bias, n, NULL, pids, pw, work);
        memset(pred, 0, (size_t)c->n_experts);
        for (size_t i = 0; i < nk; i++) pred[pids[i]] = 1;
        *pred_layer = nl;
        const int q = cache_queue(m, nl, pred, 0);
        if (stats) stats->prefetch_issued += (uint64_t)q;
    }
    free(pids), free(pw);
}

/* Groups the n * K routed (row, expert) pairs by expert with a counting sort: experts in id
 * order, rows in row order within each. cnt [E + 1] (zeroed) gets the prefix sums: expert e's
 * pairs are slots cnt[e] .. cnt[e + 1] - 1 of rows (the row) and rw (its routing weight). */
static moe_status group_rows(const int32_t *ids, const float *wts, int n, int K, int E, int *cnt, int *rows, float *rw) {
    const size_t nk = (size_t)n * K;
    for (size_t i = 0; i < nk; i++) cnt[ids[i] + 1]++;
    for (int e = 0; e < E; e++) cnt[e + 1] += cnt[e];
    int *fill = malloc(sizeof(int) * (size_t)E);
    if (!fill) return MOE_ERR_NOMEM;
    memcpy(fill, cnt, sizeof(int) * (size_t)E);
    for (size_t i = 0; i < nk; i++) {
        int slot = fill[ids[i]]++;
        rows[slot] = (int)(i / K);
        rw[slot] = wts[i];
    }
    free(fill);
    return MOE_OK;
}

/* pred/pred_layer: the experts predicted for layer *pred_layer by the previous MoE layer (CACHE
 * mode prefetch); checked against this layer's routing, then replaced by this layer's guess for
 * the next MoE layer. */
static moe_status moe_ffn_forward(const moe_model *m, const layer *L, int li, const float *x, int n, float *out,
                                  const int32_t *const *forced, int32_t *ids, moe_step_stats *stats,
                                  unsigned char *pred, int *pred_layer, step_work *wk) {
    const moe_config *c = &m->cfg;
    const int d = c->hidden_size, E = c->n_experts, K = c->n_active, Ie = c->moe_intermediate_size;
    const int de = c->latent_dim ? c->latent_dim : d;
    moe_status st = MOE_OK;
    size_t nk = (size_t)n * K;
    int queued = 0; /* ids' experts were queued for the I/O threads */
    float *logits = work_get(&wk->layer, sizeof(float) * ((size_t)n * E + 4 * (size_t)E + nk + (size_t)n * de * 2 +
                                            (size_t)n * (2 * (size_t)Ie + de) + (size_t)n * de));
    int *cnt = xcalloc((size_t)E + 1, sizeof *cnt), *rows = malloc(sizeof(int) * nk);
    float *rw = malloc(sizeof(float) * nk);
    if (!logits || !cnt || !rows || !rw) { st = MOE_ERR_NOMEM; goto done; }
    float *work = logits + (size_t)n * E, *wts = work + 4 * (size_t)E, *xe = wts + nk;
    float *ye = xe + (size_t)n * de, *gx = ye + (size_t)n * de, *ga = gx + (size_t)n * de;
    float *gb = ga + (size_t)n * Ie, *go = gb + (size_t)n * Ie;
    /* 1-4. router in f32, selection, weights */
    if ((st = matmul(m, logits, x, n, &L->router))) goto done;
    route_rows(c, logits, L->router_bias, n, forced, ids, wts, work);
    if (pred && *pred_layer == li && stats) /* how good was the previous layer's guess */
        for (size_t i = 0; i < nk; i++) stats->prefetch_routed++, stats->prefetch_predicted += pred[ids[i]];
    if (m->cache) { /* the I/O threads start reading this layer's experts now, in file order */
        unsigned char *want = xcalloc((size_t)E, 1);
        if (!want) { st = MOE_ERR_NOMEM; goto done; }
        for (size_t i = 0; i < nk; i++) want[ids[i]] = 1;
        cache_queue(m, li, want, 1);
        queued = 1;
        free(want);
    }
    if (pred && m->cache && m->opt.prefetch) predict_next_layer(m, li, x, n, logits, work, pred, pred_layer, stats);
    /* 5. group the rows by expert */
    if ((st = group_rows(ids, wts, n, K, E, cnt, rows, rw))) goto done;
    if (c->latent_dim) MM(xe, x, n, &L->lat_down);
    else memcpy(xe, x, sizeof(float) * (size_t)n * d);
    memset(ye, 0, sizeof(float) * (size_t)n * de);
    /* Few rows per expert (decode, lockstep decode): through the mapping, the weight rows of all
     * the routed experts split across the threads (experts_by_rows); through the cache, the
     * experts in parallel, one thread each (each pins its own), each product single-threaded.
     * Many rows (prefill): one expert at a time with its rows split across threads. Outputs are
     * added in expert order in every case, so results do not depend on the path or the thread
     * count. */
    int na = 0, maxce = 0;
    for (int e = 0; e < E; e++) {
        const int ce = cnt[e + 1] - cnt[e];
        na += ce > 0, maxce = ce > maxce ? ce : maxce;
        if (ce) expert_advise(m, li, e);
    }
    const int nt = m->opt.n_threads, by_expert = nt > 1 && na > 1 && maxce <= 8;
    float *eb = by_expert ? work_get(&wk->experts, sizeof(float) * nk * (2 * (size_t)de + 2 * (size_t)Ie)) : NULL;
    if (by_expert && !eb) { st = MOE_ERR_NOMEM; goto done; }
    (void)nt;
    const int rows_split = by_expert && !m->cache;
    /* the shared experts' output: with the routed experts' products on the rows_split path, else
     * first, while the I/O threads (CACHE mode) or the kernel's read-ahead (expert_advise) bring
     * the routed experts in; added after them either way (step 6) */
    float *sh = c->n_shared ? malloc(sizeof(float) * (size_t)n * d) : NULL;
    if (c->n_shared && !sh) { st = MOE_ERR_NOMEM; goto done; }
    if (rows_split) st = experts_by_rows(m, L, cnt, rows, xe, n, de, Ie, eb, x, sh);
    else if (c->n_shared) st = ffn_forward(m, &L->gate, &L->up, &L->down, x, n, sh);
    if (st) {
        free(sh);
        goto done;
    }
    /* On the rows_split path this loop does nothing, yet on a Zen 4 VM taking it out
     * of that path (no OpenMP region there) made decode tokens 25-28% slower in-process: about
     * 230 us a MoE layer passed before the next loop's first instruction, with no CPU samples
     * there; a 1-2 us delay or a malloc/free in its place restored the speed. Cause not found
     * (bench/RESULTS.md, "2026-11-30: attention keys prefetched a line per step"): measure
     * before changing it. */
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (by_expert && !rows_split)
#endif
    for (int e = 0; e < E; e++) {
        const int c0 = cnt[e], ce = cnt[e + 1] - c0;
        if (!ce || !by_expert || rows_split) continue;
        const expert *ex;
        float *bx = eb + (size_t)c0 * (2 * (size_t)de + 2 * (size_t)Ie), *ba = bx + (size_t)ce * de, *bb = ba + (size_t)ce * Ie, *bo = bb + (size_t)ce * Ie;
        moe_status es = expert_get(m, li, e, &ex, stats);
        const int got = !es;
        for (int i = 0; i < ce && !es; i++) memcpy(bx + (size_t)i * de, xe + (size_t)rows[c0 + i] * de, sizeof(float) * de);
        if (!es) {
            const mm_out gu[2] = {{ba, &ex->w1}, {bb, &ex->w3}};
            es = matmul_multi(m, bx, de, ce, gu, 2, 1);
        }
        if (!es) glu(m, ba, bb, (int64_t)ce * Ie);
        if (!es) es = matmul_nt(m, bo, ba, Ie, ce, &ex->w2, 1);
        if (got) expert_put(m, li, e);
        if (es) {
#ifdef _OPENMP
#pragma omp critical(moe_expert_status)
#endif
            st = st ? st : es;
        }
    }
    for (int e = 0; e < E && !st; e++) {
        const int c0 = cnt[e], ce = cnt[e + 1] - c0;
        if (!ce) continue;
        const expert *ex = &L->experts[e]; /* as stored: for the statistics */
        const float *res = go;
        if (by_expert) {
            res = eb + (size_t)c0 * (2 * (size_t)de + 2 * (size_t)Ie) + (size_t)ce * (de + 2 * (size_t)Ie);
        } else {
            const expert *ux;
            if ((st = expert_get(m, li, e, &ux, stats))) break;
            for (int i = 0; i < ce; i++) memcpy(gx + (size_t)i * de, xe + (size_t)rows[c0 + i] * de, sizeof(float) * de);
            const mm_out gu[2] = {{ga, &ux->w1}, {gb, &ux->w3}};
            st = st ? st : matmul_multi(m, gx, de, ce, gu, 2, m->opt.n_threads);
            glu(m, ga, gb, (int64_t)ce * Ie);
            MM(go, ga, ce, &ux->w2);
            expert_put(m, li, e);
            if (st) break;
        }
        for (int i = 0; i < ce; i++) {
            float *yr = ye + (size_t)rows[c0 + i] * de, w = rw[c0 + i];
            m->k.axpy(yr, w, res + (size_t)i * de, de);
        }
        if (stats) {
            stats->expert_rows += (uint64_t)ce;
            stats->expert_loads++;
            stats->expert_bytes += expert_bytes(ex);
        }
    }
    if (c->latent_dim && !st) {
        if (c->latent_norm) rmsnorm_rows(ye, ye, L->lat_norm, n, de, c->rms_norm_eps);
        MM(out, ye, n, &L->lat_up);
    } else if (!st) {
        memcpy(out, ye, sizeof(float) * (size_t)n * d);
    }
    /* 6. shared experts on the full-width input (computed above) */
    if (c->n_shared && !st) m->k.axpy(out, 1.0f, sh, (int64_t)n * d);
    free(sh);
done:
    if (st && queued) cache_unqueue(m, li, ids, nk);
    free(cnt);
    free(rows);
    free(rw);
    return st;
}

/* ==== attention residuals (spec section 5.2) ==================================================
 * Per token: softmax over depth of (RMS-normalised source . pseudo-query), mixing the raw
 * sources. In f32 with double accumulation: the mix logits are close together. */

#define MAX_SOURCES 4100 /* blocks + partial: n_layers <= 4096 is checked at load */

static void attnres_row(float *y, const float *const *src, int ns, const float *w, int d, float eps) {
    double sc[MAX_SOURCES], mx = -INFINITY;
    for (int s = 0; s < ns; s++) {
        double ss = 0, dot = 0;
        for (int j = 0; j < d; j++) ss += (double)src[s][j] * src[s][j], dot += (double)src[s][j] * w[j];
        sc[s] = dot / sqrt(ss / d + eps);
        if (sc[s] > mx) mx = sc[s];
    }
    double sum = 0;
    for (int s = 0; s < ns; s++) sum += sc[s] = exp(sc[s] - mx);
    for (int j = 0; j < d; j++) {
        double a = 0;
        for (int s = 0; s < ns; s++) a += sc[s] * src[s][j];
        y[j] = (float)(a / sum);
    }
}

/* y[rows] = AttnRes over [blocks..., p] for every row */
static void attnres(float *y, const float *p, float *const *blocks, int nb, const float *w, int rows, int d, float eps) {
    for (int t = 0; t < rows; t++) {
        const float *src[MAX_SOURCES];
        for (int b = 0; b < nb; b++) src[b] = blocks[b] + (size_t)t * d;
        src[nb] = p + (size_t)t * d;
        attnres_row(y + (size_t)t * d, src, nb + 1, w, d, eps);
    }
}

/* ==== step ====================================================================================
 * One forward pass over the rows of several sequence segments. Mixers run per segment (each
 * has its own state); norms, FFN and MoE run on all rows together, so an expert chosen by many
 * rows is read once. */

typedef struct {
    moe_seq *q;
    int start, n, row0; /* tokens [start, start+n) of q, at rows [row0, row0+n) */
} segment;

static moe_status forward_layers(moe_model *m, segment *sg, int nsg, int R, moe_step_stats *stats) {
    const moe_config *c = &m->cfg;
    const int d = c->hidden_size, Lc = c->n_layers, B = c->attn_res_block, V = c->vocab_size;
    const int nbmax = B ? Lc / B + 2 : 0, K = c->n_active;
    const size_t Rd = (size_t)R * d;
    moe_status st = MOE_OK;
    step_work wk = {{NULL, 0}, {NULL, 0}};
    float *h = malloc(sizeof(float) * Rd * (4 + (size_t)nbmax));
    int32_t *ids = c->n_experts ? malloc(sizeof(int32_t) * (size_t)R * K) : NULL;
    const int32_t **frc = NULL;
    unsigned char *pred = c->n_experts ? calloc((size_t)c->n_experts, 1) : NULL;
    int pred_layer = -1, pinned = -1; /* pinned: a streamed layer whose matrices this step holds */
    for (int i = 0; i < nsg; i++)
        if (sg[i].q->force_routes && !frc && !(frc = malloc(sizeof *frc * (size_t)R))) st = MOE_ERR_NOMEM;
    float *blocks[MAX_SOURCES];
    if (st || !h || (c->n_experts && !ids)) { st = MOE_ERR_NOMEM; goto done; }
    float *x = h + Rd, *mix = x + Rd, *out = mix + Rd;
    for (int b = 0; b < nbmax; b++) blocks[b] = out + Rd * (size_t)(b + 1);
    int nb = 0;
    const int64_t erb = moe__row_bytes(m->embed.type, d);
    for (int i = 0; i < nsg; i++)
        for (int t = 0; t < sg[i].n; t++)
            moe__row_to_f32(m->embed.type, (const unsigned char *)m->embed.data + (int64_t)sg[i].q->tokens[sg[i].start + t] * erb,
                            NULL, h + (size_t)(sg[i].row0 + t) * d, d);
    for (int li = 0; li < Lc; li++) {
        layer Lv; /* the layer, its dense matrices in a pinned cache entry when it streams */
        if ((st = dense_get(m, li, &Lv, stats))) goto done;
        pinned = li;
        const layer *L = &Lv;
        int p_none = 0;
        /* mixer input: plain h, or AttnRes over the blocks (h holds the partial sum p) */
        const float *xa = h;
        if (B && nb > 0) {
            attnres(mix, h, blocks, nb, L->attn_res_w, R, d, c->rms_norm_eps);
            xa = mix;
        }
        rmsnorm_rows(x, xa, L->attn_norm, R, d, c->rms_norm_eps);
        if (B && li % B == 0) { /* close the block: p becomes a source of its own */
            memcpy(blocks[nb++], h, sizeof(float) * Rd);
            p_none = 1;
        }
        for (int i = 0; i < nsg && !st; i++) {
            moe_session *s = sg[i].q->s;
            const float *xi = x + (size_t)sg[i].row0 * d;
            float *oi = out + (size_t)sg[i].row0 * d;
            st = L->kind == MOE_LAYER_KDA ? kda_forward(m, L, s, li, xi, sg[i].n, oi, &wk)
                                          : mla_forward(m, L, s, li, xi, sg[i].n, oi, &wk);
        }
        if (st) goto done;
        if (p_none) memcpy(h, out, sizeof(float) * Rd);
        else m->k.axpy(h, 1.0f, out, (int64_t)Rd); /* h += out, exactly */
        const float *xm = h;
        if (B) {
            attnres(mix, h, blocks, nb, L->mlp_res_w, R, d, c->rms_norm_eps);
            xm = mix;
        }
        rmsnorm_rows(x, xm, L->ffn_norm, R, d, c->rms_norm_eps);
        if (L->moe) {
            for (int i = 0; frc && i < nsg; i++)
                for (int t = 0; t < sg[i].n; t++)
                    frc[sg[i].row0 + t] = sg[i].q->force_routes ? sg[i].q->force_routes + ((size_t)(sg[i].start + t) * Lc + li) * K : NULL;
            st = moe_ffn_forward(m, L, li, x, R, out, frc, ids, stats, pred, &pred_layer, &wk);
        }
        else st = ffn_forward(m, &L->gate, &L->up, &L->down, x, R, out);
        if (st) goto done;
        m->k.axpy(h, 1.0f, out, (int64_t)Rd);
        for (int i = 0; i < nsg; i++) { /* routing trace */
            moe_seq *q = sg[i].q;
            if (!q->routes) continue;
            for (int t = 0; t < sg[i].n; t++) {
                int32_t *dst = q->routes + ((size_t)(sg[i].start + t) * Lc + li) * K;
                for (int kk = 0; kk < K; kk++) dst[kk] = L->moe ? ids[(size_t)(sg[i].row0 + t) * K + kk] : -1;
            }
        }
        dense_put(m, li);
        pinned = -1;
    }
    /* logits, only for the rows asked for */
    for (int i = 0; i < nsg; i++) {
        moe_seq *q = sg[i].q;
        if (!q->logits) continue;
        for (int t = 0; t < sg[i].n; t++) {
            const int tok = sg[i].start + t;
            if (!q->logits_all && tok != q->n - 1) continue;
            const size_t row = (size_t)(sg[i].row0 + t) * d;
            float *xr = x, *fin = mix;
            if (B) {
                const float *src[MAX_SOURCES];
                for (int b = 0; b < nb; b++) src[b] = blocks[b] + row;
                src[nb] = h + row;
                attnres_row(fin, src, nb + 1, m->out_res_w, d, c->rms_norm_eps);
            } else {
                memcpy(fin, h + row, sizeof(float) * d);
            }
            rmsnorm(xr, fin, m->final_norm, d, c->rms_norm_eps);
            if ((st = matmul(m, q->logits + (q->logits_all ? (size_t)tok * V : 0), xr, 1, &m->lm_head))) goto done;
        }
    }
    for (int i = 0; i < nsg; i++) sg[i].q->s->pos += sg[i].n;
done:
    if (pinned >= 0) dense_put(m, pinned);
    free(wk.layer.p), free(wk.experts.p);
    free(h);
    free(ids);
    free(frc);
    free(pred);
    return st;
}

/* The step through forward_layers, its parallel loops run by one team of threads for the whole
 * step (see par_run), except with the expert cache (thread 0 may wait for disk reads while the
 * helpers poll) and with more threads than processors (OpenMP's own waiting handles that). */
static moe_status forward(moe_model *m, segment *sg, int nsg, int R, moe_step_stats *stats) {
#ifdef STEP_TEAM
    const int nt = m->opt.n_threads;
    if (nt > 1 && nt <= STEP_TEAM_MAX && (nt <= omp_get_num_procs() || m->step_team == 2) && m->step_team != 1 && !m->cache && !team_led &&
        !par_depth) {
        step_team t;
        memset(&t, 0, sizeof t);
        atomic_init(&t.posted, 0), atomic_init(&t.finished, 0), atomic_init(&t.arrived, 0), atomic_init(&t.passed, 0);
        moe_status st = MOE_OK;
#pragma omp parallel num_threads(nt)
        {
            if (omp_get_thread_num() == 0) {
                t.nth = omp_get_num_threads();
                team_led = &t;
                st = forward_layers(m, sg, nsg, R, stats);
                team_led = NULL;
                t.stop = 1;
                atomic_fetch_add_explicit(&t.posted, 1, memory_order_release);
            } else {
                team_serve(&t, omp_get_thread_num());
            }
        }
        return st;
    }
#endif
    return forward_layers(m, sg, nsg, R, stats);
}

/* moe_step's last check: each sequence's logits are finite numbers (a NaN or an infinity in a
 * weight or an activation reaches them), marked per sequence */
static moe_status check_logits(const moe_model *m, moe_seq *seqs, int n_seqs, char *err, size_t errlen) {
    const size_t V = (size_t)m->cfg.vocab_size;
    int first = -1;
    for (int i = 0; i < n_seqs; i++) {
        moe_seq *q = &seqs[i];
        q->nonfinite = q->logits && q->n > 0 && has_nonfinite(q->logits, (q->logits_all ? (size_t)q->n : 1) * V);
        if (q->nonfinite && first < 0) first = i;
    }
    if (first < 0) return MOE_OK;
    return fail(err, errlen, MOE_ERR_NUMERIC, "moe_step: sequence %d (at position %d): the logits hold a NaN or an infinity "
                "(a non-finite weight or activation)", first, moe_session_pos(seqs[first].s));
}

moe_status moe_step(moe_model *m, moe_seq *seqs, int n_seqs, moe_step_stats *stats, char *err,
                    size_t errlen) {
    if (err && errlen) err[0] = 0;
    if (!m || (!seqs && n_seqs) || n_seqs < 0) return fail(err, errlen, MOE_ERR_ARG, "moe_step: NULL model or sequences");
    const moe_config *c = &m->cfg;
    double t0 = now_sec();
    moe_step_stats local;
    memset(&local, 0, sizeof local);
    const uint64_t read0 = moe__expert_bytes_read(m);
    const double busy0 = cache_busy_seconds(m);
    int total = 0;
    for (int i = 0; i < n_seqs; i++) {
        moe_seq *q = &seqs[i];
        if (!q->s || q->s->m != m) return fail(err, errlen, MOE_ERR_ARG, "moe_step: sequence %d: session missing or from another model", i);
        if (q->n < 0 || (q->n && !q->tokens)) return fail(err, errlen, MOE_ERR_ARG, "moe_step: sequence %d: bad token array", i);
        for (int j = 0; j < i; j++)
            if (seqs[j].s == q->s) return fail(err, errlen, MOE_ERR_ARG, "moe_step: session appears twice in one step");
        for (int t = 0; t < q->n; t++)
            if (q->tokens[t] < 0 || q->tokens[t] >= c->vocab_size)
                return fail(err, errlen, MOE_ERR_ARG, "moe_step: sequence %d: token %d is %d, outside [0, %d)", i, t,
                            (int)q->tokens[t], c->vocab_size);
        for (int t = 0; q->force_routes && t < q->n; t++)
            for (int li = 0; li < c->n_layers; li++) {
                const int32_t *r = q->force_routes + ((size_t)t * c->n_layers + li) * c->n_active;
                for (int k = 0; m->layer_moe[li] && k < c->n_active; k++) {
                    int dup = 0;
                    for (int j = 0; j < k; j++) dup |= r[j] == r[k];
                    if (r[k] < 0 || r[k] >= c->n_experts || dup)
                        return fail(err, errlen, MOE_ERR_ARG, "moe_step: sequence %d: force_routes token %d layer %d: bad expert list", i, t, li);
                }
            }
        if (q->n > q->s->n_ctx - q->s->pos)
            return fail(err, errlen, MOE_ERR_CTX_FULL, "moe_step: sequence %d: %d + %d tokens exceed the context of %d", i,
                        q->s->pos, q->n, q->s->n_ctx);
        total += q->n;
    }
    /* reserve the MLA caches now, so running out of memory cannot leave a half-advanced session */
    for (int i = 0; i < n_seqs; i++)
        for (int li = 0; li < c->n_layers; li++)
            if (m->layer_kind[li] == MOE_LAYER_MLA && mla_cache_reserve(seqs[i].s, li, seqs[i].s->pos + seqs[i].n))
                return fail(err, errlen, MOE_ERR_NOMEM, "moe_step: out of memory for the attention cache");
    segment *sg = xcalloc((size_t)n_seqs, sizeof *sg);
    int *done_tok = xcalloc((size_t)n_seqs, sizeof *done_tok);
    if (!sg || !done_tok) { free(sg); free(done_tok); return fail(err, errlen, MOE_ERR_NOMEM, "moe_step: out of memory"); }
    moe_status st = MOE_OK;
    /* rounds of at most n_batch rows, shared fairly among the sequences with tokens left */
    int left = total;
    while (left > 0 && !st) {
        int active = 0;
        for (int i = 0; i < n_seqs; i++) active += done_tok[i] < seqs[i].n;
        int share = m->opt.n_batch / active;
        if (share < 1) share = 1;
        int nsg = 0, R = 0;
        for (int i = 0; i < n_seqs && R < m->opt.n_batch; i++) {
            int rem = seqs[i].n - done_tok[i];
            if (rem <= 0) continue;
            int take = rem < share ? rem : share;
            if (take > m->opt.n_batch - R) take = m->opt.n_batch - R;
            sg[nsg++] = (segment){&seqs[i], done_tok[i], take, R};
            R += take;
        }
        st = forward(m, sg, nsg, R, &local);
        for (int i = 0; i < nsg; i++) done_tok[sg[i].q - seqs] += sg[i].n;
        left -= R;
        local.n_chunks++;
    }
    if (st == MOE_ERR_NUMERIC && m->cache) {
        const int li = m->cache->nonfinite_li, e = m->cache->nonfinite_e;
        for (int i = 0; i < n_seqs; i++) moe_session_reset(seqs[i].s);
        if (e < m->cfg.n_experts) fail(err, errlen, st, "moe_step: layer %d, routed expert %d: its weights (read from disk) hold a NaN or an infinity; the sessions were reset", li, e);
        else fail(err, errlen, st, "moe_step: layer %d: its dense weights (read from disk) hold a NaN or an infinity; the sessions were reset", li);
    } else if (st) {
        for (int i = 0; i < n_seqs; i++) moe_session_reset(seqs[i].s);
        fail(err, errlen, st, "moe_step: %s during the forward pass; the sessions were reset", moe_status_str(st));
    }
    free(sg);
    free(done_tok);
    if (!st) st = check_logits(m, seqs, n_seqs, err, errlen);
    local.n_tokens = total;
    local.bytes_read = moe__expert_bytes_read(m) - read0;
    local.io_busy_seconds = cache_busy_seconds(m) - busy0;
    local.seconds = now_sec() - t0;
    if (stats) *stats = local;
    return st;
}

/* =================================================================================================
 * PART 5: SESSIONS
 * =================================================================================================
 * A session is one sequence: the KDA layers' recurrent states and convolution tails, the MLA
 * layers' latent caches, and its position. Sessions share the model and nothing else, so any
 * number run at once; snapshot/restore and fork copy a session's state. */

/* ==== sessions ================================================================================ */

void moe_session_free(moe_session *s) {
    if (!s) return;
    const int L = s->m->cfg.n_layers;
    for (int i = 0; i < L; i++) {
        if (s->kda_state) free(s->kda_state[i]);
        if (s->conv_tail) free(s->conv_tail[i]);
        if (s->mla_cache) free(s->mla_cache[i]);
        if (s->mla_meta) free(s->mla_meta[i]);
    }
    free(s->kda_state);
    free(s->conv_tail);
    free(s->mla_cache);
    free(s->mla_meta);
    free(s->mla_cap);
    free(s);
}

static size_t kda_state_floats(const moe_config *c) { return (size_t)c->kda_heads * c->kda_head_dim * c->kda_head_dim; }
static size_t conv_tail_floats(const moe_config *c) {
    return (size_t)(c->conv_kernel - 1) * 3 * c->kda_heads * c->kda_head_dim;
}

moe_status moe_session_new(moe_session **out, moe_model *m, int n_ctx, char *err, size_t errlen) {
    if (!out) return fail(err, errlen, MOE_ERR_ARG, "moe_session_new: out is NULL");
    *out = NULL;
    if (!m || n_ctx < 1) return fail(err, errlen, MOE_ERR_ARG, "moe_session_new: need a model and n_ctx >= 1");
    const moe_config *c = &m->cfg;
    moe_session *s = xcalloc(1, sizeof *s);
    if (!s) return MOE_ERR_NOMEM;
    s->m = m;
    s->n_ctx = n_ctx;
    const int L = c->n_layers;
    s->kda_state = xcalloc((size_t)L, sizeof *s->kda_state);
    s->conv_tail = xcalloc((size_t)L, sizeof *s->conv_tail);
    s->mla_cache = xcalloc((size_t)L, sizeof *s->mla_cache);
    s->mla_meta = xcalloc((size_t)L, sizeof *s->mla_meta);
    s->mla_cap = xcalloc((size_t)L, sizeof *s->mla_cap);
    int ok = s->kda_state && s->conv_tail && s->mla_cache && s->mla_meta && s->mla_cap;
    for (int i = 0; i < L && ok; i++)
        if (m->layer_kind[i] == MOE_LAYER_KDA) {
            s->kda_state[i] = xcalloc(kda_state_floats(c), sizeof(float));
            s->conv_tail[i] = xcalloc(conv_tail_floats(c), sizeof(float));
            ok = s->kda_state[i] && s->conv_tail[i];
        }
    if (!ok) {
        moe_session_free(s);
        return fail(err, errlen, MOE_ERR_NOMEM, "moe_session_new: out of memory");
    }
    *out = s;
    return MOE_OK;
}

void moe_session_reset(moe_session *s) {
    if (!s) return;
    const moe_config *c = &s->m->cfg;
    for (int i = 0; i < c->n_layers; i++) {
        if (s->kda_state[i]) memset(s->kda_state[i], 0, sizeof(float) * kda_state_floats(c));
        if (s->conv_tail[i]) memset(s->conv_tail[i], 0, sizeof(float) * conv_tail_floats(c));
    }
    s->pos = 0;
}

int moe_session_pos(const moe_session *s) { return s ? s->pos : 0; }

moe_status moe_session_restore(moe_session *dst, const moe_session *src, char *err, size_t errlen) {
    if (!dst || !src || dst->m != src->m)
        return fail(err, errlen, MOE_ERR_ARG, "moe_session_restore: sessions missing or of different models");
    if (src->pos > dst->n_ctx)
        return fail(err, errlen, MOE_ERR_CTX_FULL, "moe_session_restore: %d tokens do not fit a context of %d", src->pos, dst->n_ctx);
    if (dst == src) return MOE_OK;
    const moe_config *c = &src->m->cfg;
    const size_t cw = (size_t)c->kv_lora_rank + c->qk_rope_dim;
    for (int i = 0; i < c->n_layers; i++)
        if (src->m->layer_kind[i] == MOE_LAYER_MLA && src->pos && mla_cache_reserve(dst, i, src->pos))
            return fail(err, errlen, MOE_ERR_NOMEM, "moe_session_restore: out of memory");
    for (int i = 0; i < c->n_layers; i++) {
        if (src->kda_state[i]) memcpy(dst->kda_state[i], src->kda_state[i], sizeof(float) * kda_state_floats(c));
        if (src->conv_tail[i]) memcpy(dst->conv_tail[i], src->conv_tail[i], sizeof(float) * conv_tail_floats(c));
        if (src->mla_cache[i] && src->pos) memcpy(dst->mla_cache[i], src->mla_cache[i], kv_elem(src->m) * cw * (size_t)src->pos);
        if (src->mla_meta[i] && src->pos) memcpy(dst->mla_meta[i], src->mla_meta[i], sizeof(moe__kv8_meta) * (size_t)src->pos);
    }
    dst->pos = src->pos;
    return MOE_OK;
}

moe_status moe_session_fork(moe_session **out, const moe_session *src, char *err, size_t errlen) {
    if (!out) return fail(err, errlen, MOE_ERR_ARG, "moe_session_fork: out is NULL");
    *out = NULL;
    if (!src) return fail(err, errlen, MOE_ERR_ARG, "moe_session_fork: src is NULL");
    moe_session *s;
    moe_status st = moe_session_new(&s, src->m, src->n_ctx, err, errlen);
    if (st) return st;
    if ((st = moe_session_restore(s, src, err, errlen))) {
        moe_session_free(s);
        return st;
    }
    *out = s;
    return MOE_OK;
}

/* ==== session state on disk ====================================================================
 * moe_session_save's layout, little-endian as the machine writes it (the identity check refuses a
 * file from a machine of the other byte order, whose model id differs):
 *   "MOESTAT1", u64 moe_model_id, u32 n_layers, u32 latent element bytes, u32 position,
 *   u64 state bytes; then per layer in order: a KDA layer's state [H, D, D] and convolution tail
 *   (f32), an MLA layer's latent rows [pos, r + d_r] (and with int8 latents their [pos] scales
 *   and sums); then u64 a checksum of the state bytes (state_sum). */

/* a 64-bit checksum of n bytes, 8 at a time (FNV-1a is a byte at a time: too slow for GBs) */
static uint64_t state_sum(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, b + i, 8);
        h = (h ^ w) * 0x9E3779B97F4A7C15ull;
        h ^= h >> 29;
    }
    for (; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

static uint64_t fnv_bytes(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* the first and last 64 KiB of a weight's data (all of it when smaller), with its format */
static uint64_t weight_id(uint64_t h, const moe__weight *w) {
    const int64_t d[3] = {w->type, w->rows, w->cols};
    h = fnv_bytes(h, d, sizeof d);
    if (!w->data || w->type < 0) return h;
    const size_t n = moe__row_bytes(w->type, w->cols) * (size_t)w->rows, k = n < 65536 ? n : 65536;
    h = state_sum(h, w->data, k);
    return state_sum(h, (const char *)w->data + n - k, k);
}

uint64_t moe_model_id(const moe_model *m) {
    const moe_config *c = &m->cfg;
    const int32_t shape[] = {c->n_layers, c->hidden_size, c->vocab_size, c->n_experts, c->kv_lora_rank, c->qk_rope_dim, c->kda_heads,
                             c->kda_head_dim, c->conv_kernel, m->opt.kv_type, (int32_t)(m->opt.flags & (MOE_FLAG_MXFP4_INT8 | MOE_FLAG_ACT16)),
                             m->opt.dense_type};
    uint64_t h = fnv_bytes(1469598103934665603ull, shape, sizeof shape);
    h = fnv_bytes(h, m->layer_kind, (size_t)c->n_layers);
    h = fnv_bytes(h, m->layer_moe, (size_t)c->n_layers);
    h = weight_id(h, &m->embed);
    h = weight_id(h, &m->lm_head);
    if (m->final_norm) h = state_sum(h, m->final_norm, sizeof(float) * (size_t)c->hidden_size);
    for (int i = 0; i < c->n_layers; i++) /* each layer's first dense matrix in memory: its first KiB */
        for (size_t f = 0; f < N_DENSE_FIELDS; f++) {
            const moe__weight *w = layer_matrix(&m->layers[i], f);
            if (!w->data || w->rows <= 0) continue;
            const size_t n = moe__row_bytes(w->type, w->cols) * (size_t)w->rows;
            h = state_sum(h, w->data, n < 1024 ? n : 1024);
            break;
        }
    return h;
}

/* each piece of a session's state in file order: fn(ctx, pointer, bytes) */
static int session_pieces(const moe_session *s, int (*fn)(void *ctx, void *p, size_t n), void *ctx) {
    const moe_model *m = s->m;
    const moe_config *c = &m->cfg;
    const size_t cw = (size_t)c->kv_lora_rank + c->qk_rope_dim;
    for (int i = 0; i < c->n_layers; i++) {
        if (s->kda_state[i] && (fn(ctx, s->kda_state[i], sizeof(float) * kda_state_floats(c)) ||
                                fn(ctx, s->conv_tail[i], sizeof(float) * conv_tail_floats(c))))
            return -1;
        if (m->layer_kind[i] == MOE_LAYER_MLA && s->pos) {
            if (fn(ctx, s->mla_cache[i], kv_elem(m) * cw * (size_t)s->pos)) return -1;
            if (s->mla_meta[i] && fn(ctx, s->mla_meta[i], sizeof(moe__kv8_meta) * (size_t)s->pos)) return -1;
        }
    }
    return 0;
}

static int count_piece(void *ctx, void *p, size_t n) {
    (void)p;
    *(size_t *)ctx += n;
    return 0;
}

size_t moe_session_state_bytes(const moe_session *s) {
    size_t n = 0;
    if (s) session_pieces(s, count_piece, &n);
    return n;
}

typedef struct {
    int fd;
    uint64_t sum;
    int err; /* errno of a failed read or write; -1: the file ended early */
} state_io;

static int write_piece(void *ctx, void *p, size_t n) {
    state_io *io = ctx;
    io->sum = state_sum(io->sum, p, n);
    for (const char *b = p; n;) {
        ssize_t w = write(io->fd, b, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return io->err = w < 0 ? errno : ENOSPC, -1;
        b += w, n -= (size_t)w;
    }
    return 0;
}

static int read_piece(void *ctx, void *p, size_t n) {
    state_io *io = ctx;
    for (char *b = p; n;) {
        ssize_t r = read(io->fd, b, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return io->err = r < 0 ? errno : -1, -1;
        b += r, n -= (size_t)r;
    }
    return 0;
}

typedef struct {
    char magic[8];
    uint64_t model_id;
    uint32_t n_layers, elem, pos, pad;
    uint64_t bytes;
} state_header;

moe_status moe_session_save(const moe_session *s, int fd, char *err, size_t errlen) {
    if (!s || fd < 0) return fail(err, errlen, MOE_ERR_ARG, "moe_session_save: no session or no file");
    state_header h = {{'M', 'O', 'E', 'S', 'T', 'A', 'T', '1'}, moe_model_id(s->m), (uint32_t)s->m->cfg.n_layers, (uint32_t)kv_elem(s->m),
                      (uint32_t)s->pos, 0, moe_session_state_bytes(s)};
    state_io io = {fd, 0, 0};
    if (write_piece(&io, &h, sizeof h)) goto failed;
    io.sum = 0;
    if (session_pieces(s, write_piece, &io)) goto failed;
    uint64_t sum = io.sum;
    if (write_piece(&io, &sum, sizeof sum)) goto failed;
    return MOE_OK;
failed:
    return fail(err, errlen, MOE_ERR_IO, "moe_session_save: %s", strerror(io.err > 0 ? io.err : EIO));
}

/* reads a piece and adds it to the checksum */
static int read_sum_piece(void *ctx, void *p, size_t n) {
    state_io *io = ctx;
    if (read_piece(ctx, p, n)) return -1;
    io->sum = state_sum(io->sum, p, n);
    return 0;
}

moe_status moe_session_load(moe_session *s, int fd, char *err, size_t errlen) {
    if (!s || fd < 0) return fail(err, errlen, MOE_ERR_ARG, "moe_session_load: no session or no file");
    state_header h;
    state_io io = {fd, 0, 0};
    if (read_piece(&io, &h, sizeof h)) goto short_read;
    if (memcmp(h.magic, "MOESTAT1", 8)) return fail(err, errlen, MOE_ERR_FORMAT, "moe_session_load: not a session state (no MOESTAT1 header)");
    if (h.model_id != moe_model_id(s->m) || h.n_layers != (uint32_t)s->m->cfg.n_layers || h.elem != (uint32_t)kv_elem(s->m))
        return fail(err, errlen, MOE_ERR_FORMAT, "moe_session_load: the state is of another model, or of other --kv-type, --mxfp4, --act or --dense choices");
    if (h.pos > (uint32_t)s->n_ctx)
        return fail(err, errlen, MOE_ERR_CTX_FULL, "moe_session_load: the state holds %u tokens, more than the context of %d", h.pos, s->n_ctx);
    moe_session_reset(s);
    const moe_config *c = &s->m->cfg;
    for (int i = 0; i < c->n_layers; i++)
        if (s->m->layer_kind[i] == MOE_LAYER_MLA && h.pos && mla_cache_reserve(s, i, (int)h.pos))
            return fail(err, errlen, MOE_ERR_NOMEM, "moe_session_load: out of memory");
    s->pos = (int)h.pos;
    if (moe_session_state_bytes(s) != h.bytes) {
        moe_session_reset(s);
        return fail(err, errlen, MOE_ERR_FORMAT, "moe_session_load: the state's size (%llu bytes) is not what %u tokens of this model take",
                    (unsigned long long)h.bytes, h.pos);
    }
    if (session_pieces(s, read_sum_piece, &io)) goto short_read;
    uint64_t sum, got = io.sum;
    if (read_piece(&io, &sum, sizeof sum)) goto short_read;
    if (sum != got) {
        moe_session_reset(s);
        return fail(err, errlen, MOE_ERR_FORMAT, "moe_session_load: the state's checksum does not match (the file is damaged)");
    }
    return MOE_OK;
short_read:
    moe_session_reset(s);
    if (io.err < 0) return fail(err, errlen, MOE_ERR_FORMAT, "moe_session_load: the state is cut short (the file ends early)");
    return fail(err, errlen, MOE_ERR_IO, "moe_session_load: %s", strerror(io.err));
}

/* =================================================================================================
 * PART 6: TEXT
 * =================================================================================================
 * What turns text into token ids and back, and logits into tokens: the tiktoken-compatible
 * tokenizer (docs/spec/TOKENIZER.md), the vendors' chat templates and the parsing of replies (tool
 * calls, channels), and sampling. Independent of the weights: a tokenizer can be opened alone. */

/* ==== tokenizer ================================================================================
 * tiktoken's rank BPE (docs/spec/TOKENIZER.md section 2): text -> (Kimi: chunks) -> special-token scan
 * -> pre-tokenizer pieces -> byte-pair merge by lowest rank of the concatenation, leftmost on
 * ties, with the whole-piece shortcut. The pre-tokenizers are hand-written matchers that follow
 * the regex engine's leftmost-first semantics (spec section 3.3) over the class table below. */

/* BEGIN GENERATED UNICODE TABLE (scripts/gen-unicode-tables.py; UCD 15.0.0) */
#define MOE_UNI_RUNS 3131
static const uint32_t moe__uni_run_start[MOE_UNI_RUNS] = {
    0x0,0x9,0xE,0x20,0x21,0x30,0x3A,0x41,0x5B,0x61,
    0x7B,0x85,0x86,0xA0,0xA1,0xAA,0xAB,0xB2,0xB4,0xB5,
    0xB6,0xB9,0xBA,0xBB,0xBC,0xBF,0xC0,0xD7,0xD8,0xDF,
    0xF7,0xF8,0x100,0x101,0x102,0x103,0x104,0x105,0x106,0x107,
    0x108,0x109,0x10A,0x10B,0x10C,0x10D,0x10E,0x10F,0x110,0x111,
    0x112,0x113,0x114,0x115,0x116,0x117,0x118,0x119,0x11A,0x11B,
    0x11C,0x11D,0x11E,0x11F,0x120,0x121,0x122,0x123,0x124,0x125,
    0x126,0x127,0x128,0x129,0x12A,0x12B,0x12C,0x12D,0x12E,0x12F,
    0x130,0x131,0x132,0x133,0x134,0x135,0x136,0x137,0x139,0x13A,
    0x13B,0x13C,0x13D,0x13E,0x13F,0x140,0x141,0x142,0x143,0x144,
    0x145,0x146,0x147,0x148,0x14A,0x14B,0x14C,0x14D,0x14E,0x14F,
    0x150,0x151,0x152,0x153,0x154,0x155,0x156,0x157,0x158,0x159,
    0x15A,0x15B,0x15C,0x15D,0x15E,0x15F,0x160,0x161,0x162,0x163,
    0x164,0x165,0x166,0x167,0x168,0x169,0x16A,0x16B,0x16C,0x16D,
    0x16E,0x16F,0x170,0x171,0x172,0x173,0x174,0x175,0x176,0x177,
    0x178,0x17A,0x17B,0x17C,0x17D,0x17E,0x181,0x183,0x184,0x185,
    0x186,0x188,0x189,0x18C,0x18E,0x192,0x193,0x195,0x196,0x199,
    0x19C,0x19E,0x19F,0x1A1,0x1A2,0x1A3,0x1A4,0x1A5,0x1A6,0x1A8,
    0x1A9,0x1AA,0x1AC,0x1AD,0x1AE,0x1B0,0x1B1,0x1B4,0x1B5,0x1B6,
    0x1B7,0x1B9,0x1BB,0x1BC,0x1BD,0x1C0,0x1C4,0x1C6,0x1C7,0x1C9,
    0x1CA,0x1CC,0x1CD,0x1CE,0x1CF,0x1D0,0x1D1,0x1D2,0x1D3,0x1D4,
    0x1D5,0x1D6,0x1D7,0x1D8,0x1D9,0x1DA,0x1DB,0x1DC,0x1DE,0x1DF,
    0x1E0,0x1E1,0x1E2,0x1E3,0x1E4,0x1E5,0x1E6,0x1E7,0x1E8,0x1E9,
    0x1EA,0x1EB,0x1EC,0x1ED,0x1EE,0x1EF,0x1F1,0x1F3,0x1F4,0x1F5,
    0x1F6,0x1F9,0x1FA,0x1FB,0x1FC,0x1FD,0x1FE,0x1FF,0x200,0x201,
    0x202,0x203,0x204,0x205,0x206,0x207,0x208,0x209,0x20A,0x20B,
    0x20C,0x20D,0x20E,0x20F,0x210,0x211,0x212,0x213,0x214,0x215,
    0x216,0x217,0x218,0x219,0x21A,0x21B,0x21C,0x21D,0x21E,0x21F,
    0x220,0x221,0x222,0x223,0x224,0x225,0x226,0x227,0x228,0x229,
    0x22A,0x22B,0x22C,0x22D,0x22E,0x22F,0x230,0x231,0x232,0x233,
    0x23A,0x23C,0x23D,0x23F,0x241,0x242,0x243,0x247,0x248,0x249,
    0x24A,0x24B,0x24C,0x24D,0x24E,0x24F,0x294,0x295,0x2B0,0x2C2,
    0x2C6,0x2D2,0x2E0,0x2E5,0x2EC,0x2ED,0x2EE,0x2EF,0x300,0x370,
    0x371,0x372,0x373,0x374,0x375,0x376,0x377,0x378,0x37A,0x37B,
    0x37E,0x37F,0x380,0x386,0x387,0x388,0x38B,0x38C,0x38D,0x38E,
    0x390,0x391,0x3A2,0x3A3,0x3AC,0x3CF,0x3D0,0x3D2,0x3D5,0x3D8,
    0x3D9,0x3DA,0x3DB,0x3DC,0x3DD,0x3DE,0x3DF,0x3E0,0x3E1,0x3E2,
    0x3E3,0x3E4,0x3E5,0x3E6,0x3E7,0x3E8,0x3E9,0x3EA,0x3EB,0x3EC,
    0x3ED,0x3EE,0x3EF,0x3F4,0x3F5,0x3F6,0x3F7,0x3F8,0x3F9,0x3FB,
    0x3FD,0x430,0x460,0x461,0x462,0x463,0x464,0x465,0x466,0x467,
    0x468,0x469,0x46A,0x46B,0x46C,0x46D,0x46E,0x46F,0x470,0x471,
    0x472,0x473,0x474,0x475,0x476,0x477,0x478,0x479,0x47A,0x47B,
    0x47C,0x47D,0x47E,0x47F,0x480,0x481,0x482,0x483,0x48A,0x48B,
    0x48C,0x48D,0x48E,0x48F,0x490,0x491,0x492,0x493,0x494,0x495,
    0x496,0x497,0x498,0x499,0x49A,0x49B,0x49C,0x49D,0x49E,0x49F,
    0x4A0,0x4A1,0x4A2,0x4A3,0x4A4,0x4A5,0x4A6,0x4A7,0x4A8,0x4A9,
    0x4AA,0x4AB,0x4AC,0x4AD,0x4AE,0x4AF,0x4B0,0x4B1,0x4B2,0x4B3,
    0x4B4,0x4B5,0x4B6,0x4B7,0x4B8,0x4B9,0x4BA,0x4BB,0x4BC,0x4BD,
    0x4BE,0x4BF,0x4C0,0x4C2,0x4C3,0x4C4,0x4C5,0x4C6,0x4C7,0x4C8,
    0x4C9,0x4CA,0x4CB,0x4CC,0x4CD,0x4CE,0x4D0,0x4D1,0x4D2,0x4D3,
    0x4D4,0x4D5,0x4D6,0x4D7,0x4D8,0x4D9,0x4DA,0x4DB,0x4DC,0x4DD,
    0x4DE,0x4DF,0x4E0,0x4E1,0x4E2,0x4E3,0x4E4,0x4E5,0x4E6,0x4E7,
    0x4E8,0x4E9,0x4EA,0x4EB,0x4EC,0x4ED,0x4EE,0x4EF,0x4F0,0x4F1,
    0x4F2,0x4F3,0x4F4,0x4F5,0x4F6,0x4F7,0x4F8,0x4F9,0x4FA,0x4FB,
    0x4FC,0x4FD,0x4FE,0x4FF,0x500,0x501,0x502,0x503,0x504,0x505,
    0x506,0x507,0x508,0x509,0x50A,0x50B,0x50C,0x50D,0x50E,0x50F,
    0x510,0x511,0x512,0x513,0x514,0x515,0x516,0x517,0x518,0x519,
    0x51A,0x51B,0x51C,0x51D,0x51E,0x51F,0x520,0x521,0x522,0x523,
    0x524,0x525,0x526,0x527,0x528,0x529,0x52A,0x52B,0x52C,0x52D,
    0x52E,0x52F,0x530,0x531,0x557,0x559,0x55A,0x560,0x589,0x591,
    0x5BE,0x5BF,0x5C0,0x5C1,0x5C3,0x5C4,0x5C6,0x5C7,0x5C8,0x5D0,
    0x5EB,0x5EF,0x5F3,0x610,0x61B,0x620,0x64B,0x660,0x66A,0x66E,
    0x670,0x671,0x6D4,0x6D5,0x6D6,0x6DD,0x6DF,0x6E5,0x6E7,0x6E9,
    0x6EA,0x6EE,0x6F0,0x6FA,0x6FD,0x6FF,0x700,0x710,0x711,0x712,
    0x730,0x74B,0x74D,0x7A6,0x7B1,0x7B2,0x7C0,0x7CA,0x7EB,0x7F4,
    0x7F6,0x7FA,0x7FB,0x7FD,0x7FE,0x800,0x816,0x81A,0x81B,0x824,
    0x825,0x828,0x829,0x82E,0x840,0x859,0x85C,0x860,0x86B,0x870,
    0x888,0x889,0x88F,0x898,0x8A0,0x8CA,0x8E2,0x8E3,0x904,0x93A,
    0x93D,0x93E,0x950,0x951,0x958,0x962,0x964,0x966,0x970,0x971,
    0x981,0x984,0x985,0x98D,0x98F,0x991,0x993,0x9A9,0x9AA,0x9B1,
    0x9B2,0x9B3,0x9B6,0x9BA,0x9BC,0x9BD,0x9BE,0x9C5,0x9C7,0x9C9,
    0x9CB,0x9CE,0x9CF,0x9D7,0x9D8,0x9DC,0x9DE,0x9DF,0x9E2,0x9E4,
    0x9E6,0x9F0,0x9F2,0x9F4,0x9FA,0x9FC,0x9FD,0x9FE,0x9FF,0xA01,
    0xA04,0xA05,0xA0B,0xA0F,0xA11,0xA13,0xA29,0xA2A,0xA31,0xA32,
    0xA34,0xA35,0xA37,0xA38,0xA3A,0xA3C,0xA3D,0xA3E,0xA43,0xA47,
    0xA49,0xA4B,0xA4E,0xA51,0xA52,0xA59,0xA5D,0xA5E,0xA5F,0xA66,
    0xA70,0xA72,0xA75,0xA76,0xA81,0xA84,0xA85,0xA8E,0xA8F,0xA92,
    0xA93,0xAA9,0xAAA,0xAB1,0xAB2,0xAB4,0xAB5,0xABA,0xABC,0xABD,
    0xABE,0xAC6,0xAC7,0xACA,0xACB,0xACE,0xAD0,0xAD1,0xAE0,0xAE2,
    0xAE4,0xAE6,0xAF0,0xAF9,0xAFA,0xB00,0xB01,0xB04,0xB05,0xB0D,
    0xB0F,0xB11,0xB13,0xB29,0xB2A,0xB31,0xB32,0xB34,0xB35,0xB3A,
    0xB3C,0xB3D,0xB3E,0xB45,0xB47,0xB49,0xB4B,0xB4E,0xB55,0xB58,
    0xB5C,0xB5E,0xB5F,0xB62,0xB64,0xB66,0xB70,0xB71,0xB72,0xB78,
    0xB82,0xB83,0xB84,0xB85,0xB8B,0xB8E,0xB91,0xB92,0xB96,0xB99,
    0xB9B,0xB9C,0xB9D,0xB9E,0xBA0,0xBA3,0xBA5,0xBA8,0xBAB,0xBAE,
    0xBBA,0xBBE,0xBC3,0xBC6,0xBC9,0xBCA,0xBCE,0xBD0,0xBD1,0xBD7,
    0xBD8,0xBE6,0xBF3,0xC00,0xC05,0xC0D,0xC0E,0xC11,0xC12,0xC29,
    0xC2A,0xC3A,0xC3C,0xC3D,0xC3E,0xC45,0xC46,0xC49,0xC4A,0xC4E,
    0xC55,0xC57,0xC58,0xC5B,0xC5D,0xC5E,0xC60,0xC62,0xC64,0xC66,
    0xC70,0xC78,0xC7F,0xC80,0xC81,0xC84,0xC85,0xC8D,0xC8E,0xC91,
    0xC92,0xCA9,0xCAA,0xCB4,0xCB5,0xCBA,0xCBC,0xCBD,0xCBE,0xCC5,
    0xCC6,0xCC9,0xCCA,0xCCE,0xCD5,0xCD7,0xCDD,0xCDF,0xCE0,0xCE2,
    0xCE4,0xCE6,0xCF0,0xCF1,0xCF3,0xCF4,0xD00,0xD04,0xD0D,0xD0E,
    0xD11,0xD12,0xD3B,0xD3D,0xD3E,0xD45,0xD46,0xD49,0xD4A,0xD4E,
    0xD4F,0xD54,0xD57,0xD58,0xD5F,0xD62,0xD64,0xD66,0xD79,0xD7A,
    0xD80,0xD81,0xD84,0xD85,0xD97,0xD9A,0xDB2,0xDB3,0xDBC,0xDBD,
    0xDBE,0xDC0,0xDC7,0xDCA,0xDCB,0xDCF,0xDD5,0xDD6,0xDD7,0xDD8,
    0xDE0,0xDE6,0xDF0,0xDF2,0xDF4,0xE01,0xE31,0xE32,0xE34,0xE3B,
    0xE40,0xE47,0xE4F,0xE50,0xE5A,0xE81,0xE83,0xE84,0xE85,0xE86,
    0xE8B,0xE8C,0xEA4,0xEA5,0xEA6,0xEA7,0xEB1,0xEB2,0xEB4,0xEBD,
    0xEBE,0xEC0,0xEC5,0xEC6,0xEC7,0xEC8,0xECF,0xED0,0xEDA,0xEDC,
    0xEE0,0xF00,0xF01,0xF18,0xF1A,0xF20,0xF34,0xF35,0xF36,0xF37,
    0xF38,0xF39,0xF3A,0xF3E,0xF40,0xF48,0xF49,0xF6D,0xF71,0xF85,
    0xF86,0xF88,0xF8D,0xF98,0xF99,0xFBD,0xFC6,0xFC7,0x1000,0x102B,
    0x103F,0x1040,0x104A,0x1050,0x1056,0x105A,0x105E,0x1061,0x1062,0x1065,
    0x1067,0x106E,0x1071,0x1075,0x1082,0x108E,0x108F,0x1090,0x109A,0x109E,
    0x10A0,0x10C6,0x10C7,0x10C8,0x10CD,0x10CE,0x10D0,0x10FB,0x10FC,0x10FD,
    0x1100,0x1249,0x124A,0x124E,0x1250,0x1257,0x1258,0x1259,0x125A,0x125E,
    0x1260,0x1289,0x128A,0x128E,0x1290,0x12B1,0x12B2,0x12B6,0x12B8,0x12BF,
    0x12C0,0x12C1,0x12C2,0x12C6,0x12C8,0x12D7,0x12D8,0x1311,0x1312,0x1316,
    0x1318,0x135B,0x135D,0x1360,0x1369,0x137D,0x1380,0x1390,0x13A0,0x13F6,
    0x13F8,0x13FE,0x1401,0x166D,0x166F,0x1680,0x1681,0x169B,0x16A0,0x16EB,
    0x16EE,0x16F1,0x16F9,0x1700,0x1712,0x1716,0x171F,0x1732,0x1735,0x1740,
    0x1752,0x1754,0x1760,0x176D,0x176E,0x1771,0x1772,0x1774,0x1780,0x17B4,
    0x17D4,0x17D7,0x17D8,0x17DC,0x17DD,0x17DE,0x17E0,0x17EA,0x17F0,0x17FA,
    0x180B,0x180E,0x180F,0x1810,0x181A,0x1820,0x1879,0x1880,0x1885,0x1887,
    0x18A9,0x18AA,0x18AB,0x18B0,0x18F6,0x1900,0x191F,0x1920,0x192C,0x1930,
    0x193C,0x1946,0x1950,0x196E,0x1970,0x1975,0x1980,0x19AC,0x19B0,0x19CA,
    0x19D0,0x19DB,0x1A00,0x1A17,0x1A1C,0x1A20,0x1A55,0x1A5F,0x1A60,0x1A7D,
    0x1A7F,0x1A80,0x1A8A,0x1A90,0x1A9A,0x1AA7,0x1AA8,0x1AB0,0x1ACF,0x1B00,
    0x1B05,0x1B34,0x1B45,0x1B4D,0x1B50,0x1B5A,0x1B6B,0x1B74,0x1B80,0x1B83,
    0x1BA1,0x1BAE,0x1BB0,0x1BBA,0x1BE6,0x1BF4,0x1C00,0x1C24,0x1C38,0x1C40,
    0x1C4A,0x1C4D,0x1C50,0x1C5A,0x1C7E,0x1C80,0x1C89,0x1C90,0x1CBB,0x1CBD,
    0x1CC0,0x1CD0,0x1CD3,0x1CD4,0x1CE9,0x1CED,0x1CEE,0x1CF4,0x1CF5,0x1CF7,
    0x1CFA,0x1CFB,0x1D00,0x1D2C,0x1D6B,0x1D78,0x1D79,0x1D9B,0x1DC0,0x1E00,
    0x1E01,0x1E02,0x1E03,0x1E04,0x1E05,0x1E06,0x1E07,0x1E08,0x1E09,0x1E0A,
    0x1E0B,0x1E0C,0x1E0D,0x1E0E,0x1E0F,0x1E10,0x1E11,0x1E12,0x1E13,0x1E14,
    0x1E15,0x1E16,0x1E17,0x1E18,0x1E19,0x1E1A,0x1E1B,0x1E1C,0x1E1D,0x1E1E,
    0x1E1F,0x1E20,0x1E21,0x1E22,0x1E23,0x1E24,0x1E25,0x1E26,0x1E27,0x1E28,
    0x1E29,0x1E2A,0x1E2B,0x1E2C,0x1E2D,0x1E2E,0x1E2F,0x1E30,0x1E31,0x1E32,
    0x1E33,0x1E34,0x1E35,0x1E36,0x1E37,0x1E38,0x1E39,0x1E3A,0x1E3B,0x1E3C,
    0x1E3D,0x1E3E,0x1E3F,0x1E40,0x1E41,0x1E42,0x1E43,0x1E44,0x1E45,0x1E46,
    0x1E47,0x1E48,0x1E49,0x1E4A,0x1E4B,0x1E4C,0x1E4D,0x1E4E,0x1E4F,0x1E50,
    0x1E51,0x1E52,0x1E53,0x1E54,0x1E55,0x1E56,0x1E57,0x1E58,0x1E59,0x1E5A,
    0x1E5B,0x1E5C,0x1E5D,0x1E5E,0x1E5F,0x1E60,0x1E61,0x1E62,0x1E63,0x1E64,
    0x1E65,0x1E66,0x1E67,0x1E68,0x1E69,0x1E6A,0x1E6B,0x1E6C,0x1E6D,0x1E6E,
    0x1E6F,0x1E70,0x1E71,0x1E72,0x1E73,0x1E74,0x1E75,0x1E76,0x1E77,0x1E78,
    0x1E79,0x1E7A,0x1E7B,0x1E7C,0x1E7D,0x1E7E,0x1E7F,0x1E80,0x1E81,0x1E82,
    0x1E83,0x1E84,0x1E85,0x1E86,0x1E87,0x1E88,0x1E89,0x1E8A,0x1E8B,0x1E8C,
    0x1E8D,0x1E8E,0x1E8F,0x1E90,0x1E91,0x1E92,0x1E93,0x1E94,0x1E95,0x1E9E,
    0x1E9F,0x1EA0,0x1EA1,0x1EA2,0x1EA3,0x1EA4,0x1EA5,0x1EA6,0x1EA7,0x1EA8,
    0x1EA9,0x1EAA,0x1EAB,0x1EAC,0x1EAD,0x1EAE,0x1EAF,0x1EB0,0x1EB1,0x1EB2,
    0x1EB3,0x1EB4,0x1EB5,0x1EB6,0x1EB7,0x1EB8,0x1EB9,0x1EBA,0x1EBB,0x1EBC,
    0x1EBD,0x1EBE,0x1EBF,0x1EC0,0x1EC1,0x1EC2,0x1EC3,0x1EC4,0x1EC5,0x1EC6,
    0x1EC7,0x1EC8,0x1EC9,0x1ECA,0x1ECB,0x1ECC,0x1ECD,0x1ECE,0x1ECF,0x1ED0,
    0x1ED1,0x1ED2,0x1ED3,0x1ED4,0x1ED5,0x1ED6,0x1ED7,0x1ED8,0x1ED9,0x1EDA,
    0x1EDB,0x1EDC,0x1EDD,0x1EDE,0x1EDF,0x1EE0,0x1EE1,0x1EE2,0x1EE3,0x1EE4,
    0x1EE5,0x1EE6,0x1EE7,0x1EE8,0x1EE9,0x1EEA,0x1EEB,0x1EEC,0x1EED,0x1EEE,
    0x1EEF,0x1EF0,0x1EF1,0x1EF2,0x1EF3,0x1EF4,0x1EF5,0x1EF6,0x1EF7,0x1EF8,
    0x1EF9,0x1EFA,0x1EFB,0x1EFC,0x1EFD,0x1EFE,0x1EFF,0x1F08,0x1F10,0x1F16,
    0x1F18,0x1F1E,0x1F20,0x1F28,0x1F30,0x1F38,0x1F40,0x1F46,0x1F48,0x1F4E,
    0x1F50,0x1F58,0x1F59,0x1F5A,0x1F5B,0x1F5C,0x1F5D,0x1F5E,0x1F5F,0x1F60,
    0x1F68,0x1F70,0x1F7E,0x1F80,0x1F88,0x1F90,0x1F98,0x1FA0,0x1FA8,0x1FB0,
    0x1FB5,0x1FB6,0x1FB8,0x1FBD,0x1FBE,0x1FBF,0x1FC2,0x1FC5,0x1FC6,0x1FC8,
    0x1FCD,0x1FD0,0x1FD4,0x1FD6,0x1FD8,0x1FDC,0x1FE0,0x1FE8,0x1FED,0x1FF2,
    0x1FF5,0x1FF6,0x1FF8,0x1FFD,0x2000,0x200B,0x2028,0x202A,0x202F,0x2030,
    0x205F,0x2060,0x2070,0x2071,0x2072,0x2074,0x207A,0x207F,0x2080,0x208A,
    0x2090,0x209D,0x20D0,0x20F1,0x2102,0x2103,0x2107,0x2108,0x210A,0x210B,
    0x210E,0x2110,0x2113,0x2114,0x2115,0x2116,0x2119,0x211E,0x2124,0x2125,
    0x2126,0x2127,0x2128,0x2129,0x212A,0x212E,0x212F,0x2130,0x2134,0x2135,
    0x2139,0x213A,0x213C,0x213E,0x2140,0x2145,0x2146,0x214A,0x214E,0x214F,
    0x2150,0x2183,0x2184,0x2185,0x218A,0x2460,0x249C,0x24EA,0x2500,0x2776,
    0x2794,0x2C00,0x2C30,0x2C60,0x2C61,0x2C62,0x2C65,0x2C67,0x2C68,0x2C69,
    0x2C6A,0x2C6B,0x2C6C,0x2C6D,0x2C71,0x2C72,0x2C73,0x2C75,0x2C76,0x2C7C,
    0x2C7E,0x2C81,0x2C82,0x2C83,0x2C84,0x2C85,0x2C86,0x2C87,0x2C88,0x2C89,
    0x2C8A,0x2C8B,0x2C8C,0x2C8D,0x2C8E,0x2C8F,0x2C90,0x2C91,0x2C92,0x2C93,
    0x2C94,0x2C95,0x2C96,0x2C97,0x2C98,0x2C99,0x2C9A,0x2C9B,0x2C9C,0x2C9D,
    0x2C9E,0x2C9F,0x2CA0,0x2CA1,0x2CA2,0x2CA3,0x2CA4,0x2CA5,0x2CA6,0x2CA7,
    0x2CA8,0x2CA9,0x2CAA,0x2CAB,0x2CAC,0x2CAD,0x2CAE,0x2CAF,0x2CB0,0x2CB1,
    0x2CB2,0x2CB3,0x2CB4,0x2CB5,0x2CB6,0x2CB7,0x2CB8,0x2CB9,0x2CBA,0x2CBB,
    0x2CBC,0x2CBD,0x2CBE,0x2CBF,0x2CC0,0x2CC1,0x2CC2,0x2CC3,0x2CC4,0x2CC5,
    0x2CC6,0x2CC7,0x2CC8,0x2CC9,0x2CCA,0x2CCB,0x2CCC,0x2CCD,0x2CCE,0x2CCF,
    0x2CD0,0x2CD1,0x2CD2,0x2CD3,0x2CD4,0x2CD5,0x2CD6,0x2CD7,0x2CD8,0x2CD9,
    0x2CDA,0x2CDB,0x2CDC,0x2CDD,0x2CDE,0x2CDF,0x2CE0,0x2CE1,0x2CE2,0x2CE3,
    0x2CE5,0x2CEB,0x2CEC,0x2CED,0x2CEE,0x2CEF,0x2CF2,0x2CF3,0x2CF4,0x2CFD,
    0x2CFE,0x2D00,0x2D26,0x2D27,0x2D28,0x2D2D,0x2D2E,0x2D30,0x2D68,0x2D6F,
    0x2D70,0x2D7F,0x2D80,0x2D97,0x2DA0,0x2DA7,0x2DA8,0x2DAF,0x2DB0,0x2DB7,
    0x2DB8,0x2DBF,0x2DC0,0x2DC7,0x2DC8,0x2DCF,0x2DD0,0x2DD7,0x2DD8,0x2DDF,
    0x2DE0,0x2E00,0x2E2F,0x2E30,0x2E80,0x2E9A,0x2E9B,0x2EF4,0x2F00,0x2FD6,
    0x3000,0x3001,0x3005,0x3006,0x3007,0x3008,0x3021,0x302A,0x3030,0x3031,
    0x3036,0x3038,0x303B,0x303C,0x303D,0x3041,0x3097,0x3099,0x309B,0x309D,
    0x30A0,0x30A1,0x30FB,0x30FC,0x3100,0x3105,0x3130,0x3131,0x318F,0x3192,
    0x3196,0x31A0,0x31C0,0x31F0,0x3200,0x3220,0x322A,0x3248,0x3250,0x3251,
    0x3260,0x3280,0x328A,0x32B1,0x32C0,0x3400,0x4DC0,0x4E00,0xA000,0xA48D,
    0xA4D0,0xA4FE,0xA500,0xA60D,0xA610,0xA620,0xA62A,0xA62C,0xA640,0xA641,
    0xA642,0xA643,0xA644,0xA645,0xA646,0xA647,0xA648,0xA649,0xA64A,0xA64B,
    0xA64C,0xA64D,0xA64E,0xA64F,0xA650,0xA651,0xA652,0xA653,0xA654,0xA655,
    0xA656,0xA657,0xA658,0xA659,0xA65A,0xA65B,0xA65C,0xA65D,0xA65E,0xA65F,
    0xA660,0xA661,0xA662,0xA663,0xA664,0xA665,0xA666,0xA667,0xA668,0xA669,
    0xA66A,0xA66B,0xA66C,0xA66D,0xA66E,0xA66F,0xA673,0xA674,0xA67E,0xA67F,
    0xA680,0xA681,0xA682,0xA683,0xA684,0xA685,0xA686,0xA687,0xA688,0xA689,
    0xA68A,0xA68B,0xA68C,0xA68D,0xA68E,0xA68F,0xA690,0xA691,0xA692,0xA693,
    0xA694,0xA695,0xA696,0xA697,0xA698,0xA699,0xA69A,0xA69B,0xA69C,0xA69E,
    0xA6A0,0xA6E6,0xA6F0,0xA6F2,0xA717,0xA720,0xA722,0xA723,0xA724,0xA725,
    0xA726,0xA727,0xA728,0xA729,0xA72A,0xA72B,0xA72C,0xA72D,0xA72E,0xA72F,
    0xA732,0xA733,0xA734,0xA735,0xA736,0xA737,0xA738,0xA739,0xA73A,0xA73B,
    0xA73C,0xA73D,0xA73E,0xA73F,0xA740,0xA741,0xA742,0xA743,0xA744,0xA745,
    0xA746,0xA747,0xA748,0xA749,0xA74A,0xA74B,0xA74C,0xA74D,0xA74E,0xA74F,
    0xA750,0xA751,0xA752,0xA753,0xA754,0xA755,0xA756,0xA757,0xA758,0xA759,
    0xA75A,0xA75B,0xA75C,0xA75D,0xA75E,0xA75F,0xA760,0xA761,0xA762,0xA763,
    0xA764,0xA765,0xA766,0xA767,0xA768,0xA769,0xA76A,0xA76B,0xA76C,0xA76D,
    0xA76E,0xA76F,0xA770,0xA771,0xA779,0xA77A,0xA77B,0xA77C,0xA77D,0xA77F,
    0xA780,0xA781,0xA782,0xA783,0xA784,0xA785,0xA786,0xA787,0xA788,0xA789,
    0xA78B,0xA78C,0xA78D,0xA78E,0xA78F,0xA790,0xA791,0xA792,0xA793,0xA796,
    0xA797,0xA798,0xA799,0xA79A,0xA79B,0xA79C,0xA79D,0xA79E,0xA79F,0xA7A0,
    0xA7A1,0xA7A2,0xA7A3,0xA7A4,0xA7A5,0xA7A6,0xA7A7,0xA7A8,0xA7A9,0xA7AA,
    0xA7AF,0xA7B0,0xA7B5,0xA7B6,0xA7B7,0xA7B8,0xA7B9,0xA7BA,0xA7BB,0xA7BC,
    0xA7BD,0xA7BE,0xA7BF,0xA7C0,0xA7C1,0xA7C2,0xA7C3,0xA7C4,0xA7C8,0xA7C9,
    0xA7CA,0xA7CB,0xA7D0,0xA7D1,0xA7D2,0xA7D3,0xA7D4,0xA7D5,0xA7D6,0xA7D7,
    0xA7D8,0xA7D9,0xA7DA,0xA7F2,0xA7F5,0xA7F6,0xA7F7,0xA7FA,0xA7FB,0xA802,
    0xA803,0xA806,0xA807,0xA80B,0xA80C,0xA823,0xA828,0xA82C,0xA82D,0xA830,
    0xA836,0xA840,0xA874,0xA880,0xA882,0xA8B4,0xA8C6,0xA8D0,0xA8DA,0xA8E0,
    0xA8F2,0xA8F8,0xA8FB,0xA8FC,0xA8FD,0xA8FF,0xA900,0xA90A,0xA926,0xA92E,
    0xA930,0xA947,0xA954,0xA960,0xA97D,0xA980,0xA984,0xA9B3,0xA9C1,0xA9CF,
    0xA9D0,0xA9DA,0xA9E0,0xA9E5,0xA9E6,0xA9F0,0xA9FA,0xA9FF,0xAA00,0xAA29,
    0xAA37,0xAA40,0xAA43,0xAA44,0xAA4C,0xAA4E,0xAA50,0xAA5A,0xAA60,0xAA77,
    0xAA7A,0xAA7B,0xAA7E,0xAAB0,0xAAB1,0xAAB2,0xAAB5,0xAAB7,0xAAB9,0xAABE,
    0xAAC0,0xAAC1,0xAAC2,0xAAC3,0xAADB,0xAADE,0xAAE0,0xAAEB,0xAAF0,0xAAF2,
    0xAAF5,0xAAF7,0xAB01,0xAB07,0xAB09,0xAB0F,0xAB11,0xAB17,0xAB20,0xAB27,
    0xAB28,0xAB2F,0xAB30,0xAB5B,0xAB5C,0xAB60,0xAB69,0xAB6A,0xAB70,0xABC0,
    0xABE3,0xABEB,0xABEC,0xABEE,0xABF0,0xABFA,0xAC00,0xD7A4,0xD7B0,0xD7C7,
    0xD7CB,0xD7FC,0xF900,0xFA6E,0xFA70,0xFADA,0xFB00,0xFB07,0xFB13,0xFB18,
    0xFB1D,0xFB1E,0xFB1F,0xFB29,0xFB2A,0xFB37,0xFB38,0xFB3D,0xFB3E,0xFB3F,
    0xFB40,0xFB42,0xFB43,0xFB45,0xFB46,0xFBB2,0xFBD3,0xFD3E,0xFD50,0xFD90,
    0xFD92,0xFDC8,0xFDF0,0xFDFC,0xFE00,0xFE10,0xFE20,0xFE30,0xFE70,0xFE75,
    0xFE76,0xFEFD,0xFF10,0xFF1A,0xFF21,0xFF3B,0xFF41,0xFF5B,0xFF66,0xFFBF,
    0xFFC2,0xFFC8,0xFFCA,0xFFD0,0xFFD2,0xFFD8,0xFFDA,0xFFDD,0x10000,0x1000C,
    0x1000D,0x10027,0x10028,0x1003B,0x1003C,0x1003E,0x1003F,0x1004E,0x10050,0x1005E,
    0x10080,0x100FB,0x10107,0x10134,0x10140,0x10179,0x1018A,0x1018C,0x101FD,0x101FE,
    0x10280,0x1029D,0x102A0,0x102D1,0x102E0,0x102E1,0x102FC,0x10300,0x10320,0x10324,
    0x1032D,0x10341,0x10342,0x1034A,0x1034B,0x10350,0x10376,0x1037B,0x10380,0x1039E,
    0x103A0,0x103C4,0x103C8,0x103D0,0x103D1,0x103D6,0x10400,0x10428,0x10450,0x1049E,
    0x104A0,0x104AA,0x104B0,0x104D4,0x104D8,0x104FC,0x10500,0x10528,0x10530,0x10564,
    0x10570,0x1057B,0x1057C,0x1058B,0x1058C,0x10593,0x10594,0x10596,0x10597,0x105A2,
    0x105A3,0x105B2,0x105B3,0x105BA,0x105BB,0x105BD,0x10600,0x10737,0x10740,0x10756,
    0x10760,0x10768,0x10780,0x10786,0x10787,0x107B1,0x107B2,0x107BB,0x10800,0x10806,
    0x10808,0x10809,0x1080A,0x10836,0x10837,0x10839,0x1083C,0x1083D,0x1083F,0x10856,
    0x10858,0x10860,0x10877,0x10879,0x10880,0x1089F,0x108A7,0x108B0,0x108E0,0x108F3,
    0x108F4,0x108F6,0x108FB,0x10900,0x10916,0x1091C,0x10920,0x1093A,0x10980,0x109B8,
    0x109BC,0x109BE,0x109C0,0x109D0,0x109D2,0x10A00,0x10A01,0x10A04,0x10A05,0x10A07,
    0x10A0C,0x10A10,0x10A14,0x10A15,0x10A18,0x10A19,0x10A36,0x10A38,0x10A3B,0x10A3F,
    0x10A40,0x10A49,0x10A60,0x10A7D,0x10A7F,0x10A80,0x10A9D,0x10AA0,0x10AC0,0x10AC8,
    0x10AC9,0x10AE5,0x10AE7,0x10AEB,0x10AF0,0x10B00,0x10B36,0x10B40,0x10B56,0x10B58,
    0x10B60,0x10B73,0x10B78,0x10B80,0x10B92,0x10BA9,0x10BB0,0x10C00,0x10C49,0x10C80,
    0x10CB3,0x10CC0,0x10CF3,0x10CFA,0x10D00,0x10D24,0x10D28,0x10D30,0x10D3A,0x10E60,
    0x10E7F,0x10E80,0x10EAA,0x10EAB,0x10EAD,0x10EB0,0x10EB2,0x10EFD,0x10F00,0x10F1D,
    0x10F27,0x10F28,0x10F30,0x10F46,0x10F51,0x10F55,0x10F70,0x10F82,0x10F86,0x10FB0,
    0x10FC5,0x10FCC,0x10FE0,0x10FF7,0x11000,0x11003,0x11038,0x11047,0x11052,0x11070,
    0x11071,0x11073,0x11075,0x11076,0x1107F,0x11083,0x110B0,0x110BB,0x110C2,0x110C3,
    0x110D0,0x110E9,0x110F0,0x110FA,0x11100,0x11103,0x11127,0x11135,0x11136,0x11140,
    0x11144,0x11145,0x11147,0x11148,0x11150,0x11173,0x11174,0x11176,0x11177,0x11180,
    0x11183,0x111B3,0x111C1,0x111C5,0x111C9,0x111CD,0x111CE,0x111D0,0x111DA,0x111DB,
    0x111DC,0x111DD,0x111E1,0x111F5,0x11200,0x11212,0x11213,0x1122C,0x11238,0x1123E,
    0x1123F,0x11241,0x11242,0x11280,0x11287,0x11288,0x11289,0x1128A,0x1128E,0x1128F,
    0x1129E,0x1129F,0x112A9,0x112B0,0x112DF,0x112EB,0x112F0,0x112FA,0x11300,0x11304,
    0x11305,0x1130D,0x1130F,0x11311,0x11313,0x11329,0x1132A,0x11331,0x11332,0x11334,
    0x11335,0x1133A,0x1133B,0x1133D,0x1133E,0x11345,0x11347,0x11349,0x1134B,0x1134E,
    0x11350,0x11351,0x11357,0x11358,0x1135D,0x11362,0x11364,0x11366,0x1136D,0x11370,
    0x11375,0x11400,0x11435,0x11447,0x1144B,0x11450,0x1145A,0x1145E,0x1145F,0x11462,
    0x11480,0x114B0,0x114C4,0x114C6,0x114C7,0x114C8,0x114D0,0x114DA,0x11580,0x115AF,
    0x115B6,0x115B8,0x115C1,0x115D8,0x115DC,0x115DE,0x11600,0x11630,0x11641,0x11644,
    0x11645,0x11650,0x1165A,0x11680,0x116AB,0x116B8,0x116B9,0x116C0,0x116CA,0x11700,
    0x1171B,0x1171D,0x1172C,0x11730,0x1173C,0x11740,0x11747,0x11800,0x1182C,0x1183B,
    0x118A0,0x118C0,0x118E0,0x118F3,0x118FF,0x11907,0x11909,0x1190A,0x1190C,0x11914,
    0x11915,0x11917,0x11918,0x11930,0x11936,0x11937,0x11939,0x1193B,0x1193F,0x11940,
    0x11941,0x11942,0x11944,0x11950,0x1195A,0x119A0,0x119A8,0x119AA,0x119D1,0x119D8,
    0x119DA,0x119E1,0x119E2,0x119E3,0x119E4,0x119E5,0x11A00,0x11A01,0x11A0B,0x11A33,
    0x11A3A,0x11A3B,0x11A3F,0x11A47,0x11A48,0x11A50,0x11A51,0x11A5C,0x11A8A,0x11A9A,
    0x11A9D,0x11A9E,0x11AB0,0x11AF9,0x11C00,0x11C09,0x11C0A,0x11C2F,0x11C37,0x11C38,
    0x11C40,0x11C41,0x11C50,0x11C6D,0x11C72,0x11C90,0x11C92,0x11CA8,0x11CA9,0x11CB7,
    0x11D00,0x11D07,0x11D08,0x11D0A,0x11D0B,0x11D31,0x11D37,0x11D3A,0x11D3B,0x11D3C,
    0x11D3E,0x11D3F,0x11D46,0x11D47,0x11D48,0x11D50,0x11D5A,0x11D60,0x11D66,0x11D67,
    0x11D69,0x11D6A,0x11D8A,0x11D8F,0x11D90,0x11D92,0x11D93,0x11D98,0x11D99,0x11DA0,
    0x11DAA,0x11EE0,0x11EF3,0x11EF7,0x11F00,0x11F02,0x11F03,0x11F04,0x11F11,0x11F12,
    0x11F34,0x11F3B,0x11F3E,0x11F43,0x11F50,0x11F5A,0x11FB0,0x11FB1,0x11FC0,0x11FD5,
    0x12000,0x1239A,0x12400,0x1246F,0x12480,0x12544,0x12F90,0x12FF1,0x13000,0x13430,
    0x13440,0x13441,0x13447,0x13456,0x14400,0x14647,0x16800,0x16A39,0x16A40,0x16A5F,
    0x16A60,0x16A6A,0x16A70,0x16ABF,0x16AC0,0x16ACA,0x16AD0,0x16AEE,0x16AF0,0x16AF5,
    0x16B00,0x16B30,0x16B37,0x16B40,0x16B44,0x16B50,0x16B5A,0x16B5B,0x16B62,0x16B63,
    0x16B78,0x16B7D,0x16B90,0x16E40,0x16E60,0x16E80,0x16E97,0x16F00,0x16F4B,0x16F4F,
    0x16F50,0x16F51,0x16F88,0x16F8F,0x16F93,0x16FA0,0x16FE0,0x16FE2,0x16FE3,0x16FE4,
    0x16FE5,0x16FF0,0x16FF2,0x16FF7,0x17000,0x187F8,0x18800,0x18CD6,0x18D00,0x18D09,
    0x1AFF0,0x1AFF4,0x1AFF5,0x1AFFC,0x1AFFD,0x1AFFF,0x1B000,0x1B123,0x1B132,0x1B133,
    0x1B150,0x1B153,0x1B155,0x1B156,0x1B164,0x1B168,0x1B170,0x1B2FC,0x1BC00,0x1BC6B,
    0x1BC70,0x1BC7D,0x1BC80,0x1BC89,0x1BC90,0x1BC9A,0x1BC9D,0x1BC9F,0x1CF00,0x1CF2E,
    0x1CF30,0x1CF47,0x1D165,0x1D16A,0x1D16D,0x1D173,0x1D17B,0x1D183,0x1D185,0x1D18C,
    0x1D1AA,0x1D1AE,0x1D242,0x1D245,0x1D2C0,0x1D2D4,0x1D2E0,0x1D2F4,0x1D360,0x1D379,
    0x1D400,0x1D41A,0x1D434,0x1D44E,0x1D455,0x1D456,0x1D468,0x1D482,0x1D49C,0x1D49D,
    0x1D49E,0x1D4A0,0x1D4A2,0x1D4A3,0x1D4A5,0x1D4A7,0x1D4A9,0x1D4AD,0x1D4AE,0x1D4B6,
    0x1D4BA,0x1D4BB,0x1D4BC,0x1D4BD,0x1D4C4,0x1D4C5,0x1D4D0,0x1D4EA,0x1D504,0x1D506,
    0x1D507,0x1D50B,0x1D50D,0x1D515,0x1D516,0x1D51D,0x1D51E,0x1D538,0x1D53A,0x1D53B,
    0x1D53F,0x1D540,0x1D545,0x1D546,0x1D547,0x1D54A,0x1D551,0x1D552,0x1D56C,0x1D586,
    0x1D5A0,0x1D5BA,0x1D5D4,0x1D5EE,0x1D608,0x1D622,0x1D63C,0x1D656,0x1D670,0x1D68A,
    0x1D6A6,0x1D6A8,0x1D6C1,0x1D6C2,0x1D6DB,0x1D6DC,0x1D6E2,0x1D6FB,0x1D6FC,0x1D715,
    0x1D716,0x1D71C,0x1D735,0x1D736,0x1D74F,0x1D750,0x1D756,0x1D76F,0x1D770,0x1D789,
    0x1D78A,0x1D790,0x1D7A9,0x1D7AA,0x1D7C3,0x1D7C4,0x1D7CA,0x1D7CB,0x1D7CC,0x1D7CE,
    0x1D800,0x1DA00,0x1DA37,0x1DA3B,0x1DA6D,0x1DA75,0x1DA76,0x1DA84,0x1DA85,0x1DA9B,
    0x1DAA0,0x1DAA1,0x1DAB0,0x1DF00,0x1DF0A,0x1DF0B,0x1DF1F,0x1DF25,0x1DF2B,0x1E000,
    0x1E007,0x1E008,0x1E019,0x1E01B,0x1E022,0x1E023,0x1E025,0x1E026,0x1E02B,0x1E030,
    0x1E06E,0x1E08F,0x1E090,0x1E100,0x1E12D,0x1E130,0x1E137,0x1E13E,0x1E140,0x1E14A,
    0x1E14E,0x1E14F,0x1E290,0x1E2AE,0x1E2AF,0x1E2C0,0x1E2EC,0x1E2F0,0x1E2FA,0x1E4D0,
    0x1E4EC,0x1E4F0,0x1E4FA,0x1E7E0,0x1E7E7,0x1E7E8,0x1E7EC,0x1E7ED,0x1E7EF,0x1E7F0,
    0x1E7FF,0x1E800,0x1E8C5,0x1E8C7,0x1E8D0,0x1E8D7,0x1E900,0x1E922,0x1E944,0x1E94B,
    0x1E94C,0x1E950,0x1E95A,0x1EC71,0x1ECAC,0x1ECAD,0x1ECB0,0x1ECB1,0x1ECB5,0x1ED01,
    0x1ED2E,0x1ED2F,0x1ED3E,0x1EE00,0x1EE04,0x1EE05,0x1EE20,0x1EE21,0x1EE23,0x1EE24,
    0x1EE25,0x1EE27,0x1EE28,0x1EE29,0x1EE33,0x1EE34,0x1EE38,0x1EE39,0x1EE3A,0x1EE3B,
    0x1EE3C,0x1EE42,0x1EE43,0x1EE47,0x1EE48,0x1EE49,0x1EE4A,0x1EE4B,0x1EE4C,0x1EE4D,
    0x1EE50,0x1EE51,0x1EE53,0x1EE54,0x1EE55,0x1EE57,0x1EE58,0x1EE59,0x1EE5A,0x1EE5B,
    0x1EE5C,0x1EE5D,0x1EE5E,0x1EE5F,0x1EE60,0x1EE61,0x1EE63,0x1EE64,0x1EE65,0x1EE67,
    0x1EE6B,0x1EE6C,0x1EE73,0x1EE74,0x1EE78,0x1EE79,0x1EE7D,0x1EE7E,0x1EE7F,0x1EE80,
    0x1EE8A,0x1EE8B,0x1EE9C,0x1EEA1,0x1EEA4,0x1EEA5,0x1EEAA,0x1EEAB,0x1EEBC,0x1F100,
    0x1F10D,0x1FBF0,0x1FBFA,0x20000,0x2A6E0,0x2A700,0x2B81E,0x2B820,0x2CEAE,0x2CEB0,
    0x2EBE1,0x2EBF0,0x2EE5E,0x2F800,0x2FA1E,0x30000,0x3134B,0x31350,0x3347A,0xE0100,
    0xE01F0,
};
static const uint8_t moe__uni_run_class[MOE_UNI_RUNS] = {
    0,16,0,16,0,5,0,1,0,2,0,16,0,16,0,3,0,5,0,2,0,5,3,0,
    5,0,1,0,1,2,0,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,
    1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,
    1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,
    1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,
    1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,
    1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,
    1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,
    3,1,2,3,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,
    1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,
    1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,
    1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,
    1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,
    1,2,1,2,3,2,3,0,3,0,3,0,3,0,3,0,4,1,2,1,2,3,0,1,
    2,0,3,2,0,1,0,1,0,1,0,1,0,1,2,1,0,1,2,1,2,1,2,1,
    2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,
    2,0,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,
    1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,0,4,1,2,1,2,
    1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,
    1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,
    1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,
    1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,
    1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,
    1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,
    1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,0,1,0,3,0,2,0,4,
    0,4,0,4,0,4,0,4,0,3,0,3,0,4,0,3,4,5,0,3,4,3,0,3,
    4,0,4,3,4,0,4,3,5,3,0,3,0,3,4,3,4,0,3,4,3,0,5,3,
    4,3,0,3,0,4,0,3,4,3,4,3,4,3,4,0,3,4,0,3,0,3,0,3,
    0,4,3,4,0,4,3,4,3,4,3,4,3,4,0,5,0,3,4,0,3,0,3,0,
    3,0,3,0,3,0,3,0,4,3,4,0,4,0,4,3,0,4,0,3,0,3,4,0,
    5,3,0,5,0,3,0,4,0,4,0,3,0,3,0,3,0,3,0,3,0,3,0,3,
    0,4,0,4,0,4,0,4,0,4,0,3,0,3,0,5,4,3,4,0,4,0,3,0,
    3,0,3,0,3,0,3,0,3,0,4,3,4,0,4,0,4,0,3,0,3,4,0,5,
    0,3,4,0,4,0,3,0,3,0,3,0,3,0,3,0,3,0,4,3,4,0,4,0,
    4,0,4,0,3,0,3,4,0,5,0,3,5,0,4,3,0,3,0,3,0,3,0,3,
    0,3,0,3,0,3,0,3,0,3,0,4,0,4,0,4,0,3,0,4,0,5,0,4,
    3,0,3,0,3,0,3,0,4,3,4,0,4,0,4,0,4,0,3,0,3,0,3,4,
    0,5,0,5,0,3,4,0,3,0,3,0,3,0,3,0,3,0,4,3,4,0,4,0,
    4,0,4,0,3,0,3,4,0,5,0,3,4,0,4,3,0,3,0,3,4,3,4,0,
    4,0,4,3,0,3,4,5,3,4,0,5,0,3,0,4,0,3,0,3,0,3,0,3,
    0,3,0,4,0,4,0,4,0,4,0,5,0,4,0,3,4,3,4,0,3,4,0,5,
    0,3,0,3,0,3,0,3,0,3,0,3,4,3,4,3,0,3,0,3,0,4,0,5,
    0,3,0,3,0,4,0,5,0,4,0,4,0,4,0,4,3,0,3,0,4,0,4,3,
    4,0,4,0,4,0,3,4,3,5,0,3,4,3,4,3,4,3,4,3,4,3,4,3,
    4,5,4,0,1,0,1,0,1,0,2,0,3,2,3,0,3,0,3,0,3,0,3,0,
    3,0,3,0,3,0,3,0,3,0,3,0,3,0,3,0,3,0,3,0,3,0,4,0,
    5,0,3,0,1,0,2,0,3,0,3,16,3,0,3,0,5,3,0,3,4,0,3,4,
    0,3,4,0,3,0,3,0,4,0,3,4,0,3,0,3,4,0,5,0,5,0,4,0,
    4,5,0,3,0,3,4,3,4,3,0,3,0,3,0,4,0,4,0,5,3,0,3,0,
    3,0,3,0,5,0,3,4,0,3,4,0,4,0,4,5,0,5,0,3,0,4,0,4,
    3,4,3,0,5,0,4,0,4,3,4,3,5,3,4,0,3,4,0,5,0,3,5,3,
    0,2,0,1,0,1,0,4,0,4,3,4,3,4,3,4,3,0,2,3,2,3,2,3,
    4,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,
    2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,
    2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,
    2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,
    2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,
    2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,
    2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,
    2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,
    2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,
    2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,
    2,1,2,1,2,1,2,1,2,1,2,0,1,0,2,1,2,1,2,0,1,0,2,0,
    1,0,1,0,1,0,1,2,1,2,0,2,1,2,1,2,1,2,0,2,1,0,2,0,
    2,0,2,1,0,2,0,2,1,0,2,1,0,2,0,2,1,0,16,0,16,0,16,0,
    16,0,5,3,0,5,0,3,5,0,3,0,4,0,1,0,1,0,2,1,2,1,2,0,
    1,0,1,0,1,0,1,0,1,0,1,0,2,1,2,3,2,0,2,1,0,1,2,0,
    2,0,5,1,2,5,0,5,0,5,0,5,0,1,2,1,2,1,2,1,2,1,2,1,
    2,1,2,1,2,1,2,3,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,
    1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,
    1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,
    1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,
    1,2,1,2,1,2,1,2,1,2,1,2,0,1,2,1,2,4,1,2,0,5,0,2,
    0,2,0,2,0,3,0,3,0,4,3,0,3,0,3,0,3,0,3,0,3,0,3,0,
    3,0,3,0,4,0,3,0,8,0,8,0,8,0,16,0,11,3,13,0,13,4,0,3,
    0,13,11,3,0,3,0,4,0,3,0,3,0,3,0,3,0,3,0,5,0,3,0,3,
    0,5,0,5,0,5,0,5,0,5,0,11,0,11,3,0,3,0,3,0,3,5,3,0,
    1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,
    1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,3,4,
    0,4,0,3,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,
    1,2,1,2,1,2,1,2,3,4,3,5,4,0,3,0,1,2,1,2,1,2,1,2,
    1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,
    1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,
    1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,3,2,1,2,
    1,2,1,2,1,2,1,2,1,2,1,2,3,0,1,2,1,2,3,1,2,1,2,1,
    2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,
    2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,1,2,0,1,2,0,2,0,2,
    1,2,1,2,0,3,1,2,3,2,3,4,3,4,3,4,3,4,0,4,0,5,0,3,
    0,4,3,4,0,5,0,4,3,0,3,0,3,4,5,3,4,0,3,4,0,3,0,4,
    3,4,0,3,5,0,3,4,3,5,3,0,3,4,0,3,4,3,4,0,5,0,3,0,
    3,4,3,4,3,4,3,4,3,4,3,4,3,0,3,0,3,4,0,3,4,0,3,0,
    3,0,3,0,3,0,3,0,2,0,3,2,3,0,2,3,4,0,4,0,5,0,3,0,
    3,0,3,0,11,0,11,0,2,0,2,0,3,4,3,0,3,0,3,0,3,0,3,0,
    3,0,3,0,3,0,3,0,3,0,3,0,4,0,4,0,3,0,3,0,5,0,1,0,
    2,0,3,0,3,0,3,0,3,0,3,0,3,0,3,0,3,0,3,0,3,0,3,0,
    3,0,5,0,5,0,5,0,4,0,3,0,3,0,4,5,0,3,5,0,3,5,3,5,
    0,3,4,0,3,0,3,0,3,0,5,0,1,2,3,0,5,0,1,0,2,0,3,0,
    3,0,1,0,1,0,1,0,1,0,2,0,2,0,2,0,2,0,3,0,3,0,3,0,
    3,0,3,0,3,0,3,0,3,0,3,0,3,0,3,0,3,0,5,3,0,5,3,0,
    5,0,3,0,3,0,5,3,5,0,3,0,3,0,5,3,5,0,5,3,4,0,4,0,
    4,3,0,3,0,3,0,4,0,4,5,0,3,5,0,3,5,0,3,0,3,4,0,5,
    0,3,0,3,0,5,3,0,5,3,0,5,0,3,0,1,0,2,0,5,3,4,0,5,
    0,5,0,3,0,4,0,3,0,4,3,5,3,0,3,4,5,0,3,4,0,3,5,0,
    3,0,4,3,4,0,5,4,3,4,3,0,4,3,4,0,4,0,3,0,5,0,4,3,
    4,0,5,0,3,4,3,0,3,4,0,3,0,4,3,4,3,0,4,0,4,5,3,0,
    3,0,5,0,3,0,3,4,0,4,3,4,0,3,0,3,0,3,0,3,0,3,0,3,
    4,0,5,0,4,0,3,0,3,0,3,0,3,0,3,0,3,0,4,3,4,0,4,0,
    4,0,3,0,4,0,3,4,0,4,0,4,0,3,4,3,0,5,0,4,3,0,3,4,
    3,0,3,0,5,0,3,4,0,4,0,3,4,0,3,4,0,3,0,5,0,3,4,3,
    0,5,0,3,0,4,0,5,0,3,0,3,4,0,1,2,5,0,3,0,3,0,3,0,
    3,0,3,4,0,4,0,4,3,4,3,4,0,5,0,3,0,3,4,0,4,3,0,3,
    4,0,3,4,3,4,3,4,0,4,0,3,4,3,4,0,3,0,3,0,3,0,3,4,
    0,4,3,0,5,0,3,0,4,0,4,0,3,0,3,0,3,4,0,4,0,4,0,4,
    3,4,0,5,0,3,0,3,0,3,4,0,4,0,4,3,0,5,0,3,4,0,4,3,
    4,3,0,3,4,0,4,0,5,0,3,0,5,0,3,0,5,0,3,0,3,0,3,0,
    4,3,4,0,3,0,3,0,3,0,5,0,3,0,5,0,3,0,4,0,3,4,0,3,
    0,5,0,5,0,3,0,3,0,1,2,5,0,3,0,4,3,4,0,4,3,0,3,8,
    11,4,0,12,11,0,3,0,3,0,3,0,3,0,3,0,3,0,3,0,3,0,3,0,
    3,0,3,0,3,0,3,0,3,0,3,0,3,0,4,0,4,0,4,0,4,0,4,0,
    4,0,4,0,4,0,4,0,5,0,5,0,5,0,1,2,1,2,0,2,1,2,1,0,
    1,0,1,0,1,0,1,0,1,2,0,2,0,2,0,2,1,2,1,0,1,0,1,0,
    1,0,2,1,0,1,0,1,0,1,0,1,0,2,1,2,1,2,1,2,1,2,1,2,
    1,2,0,1,0,2,0,2,1,0,2,0,2,1,0,2,0,2,1,0,2,0,2,1,
    0,2,0,2,1,2,0,5,0,4,0,4,0,4,0,4,0,4,0,4,0,2,3,2,
    0,2,0,4,0,4,0,4,0,4,0,4,0,3,0,4,0,3,0,4,3,0,5,0,
    3,0,3,4,0,3,4,5,0,3,4,5,0,3,0,3,0,3,0,3,0,3,0,5,
    4,0,1,2,4,3,0,5,0,5,0,5,0,5,0,5,0,5,0,3,0,3,0,3,
    0,3,0,3,0,3,0,3,0,3,0,3,0,3,0,3,0,3,0,3,0,3,0,3,
    0,3,0,3,0,3,0,3,0,3,0,3,0,3,0,3,0,3,0,3,0,3,0,3,
    0,3,0,3,0,3,0,3,0,3,0,3,0,5,0,5,0,11,0,11,0,11,0,11,
    0,11,0,11,0,11,0,11,0,4,0,
};
/* END GENERATED UNICODE TABLE */

enum { UC_OTHER, UC_UPPER, UC_LOWER, UC_OLETTER, UC_MARK, UC_NUMBER };
#define UC_CAT 7
#define UC_HAN 8
#define UC_WS 16

static unsigned uni_class(uint32_t c) {
    if (c >= 0x110000) return UC_OTHER; /* a byte that is not valid UTF-8: a symbol */
    int lo = 0, hi = MOE_UNI_RUNS - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (moe__uni_run_start[mid] <= c) lo = mid; else hi = mid - 1;
    }
    return moe__uni_run_class[lo];
}

/* Python's str.isspace(), which the vendor's chunking uses (not White_Space: adds U+001C-001F). */
static int py_isspace(uint32_t c) {
    return (c >= 0x1C && c <= 0x1F) || (c < 0x110000 && (uni_class(c) & UC_WS));
}

/* Decodes one UTF-8 sequence at s[0..n); returns its length, or 0 when it is not valid UTF-8
 * (overlong, surrogate, above U+10FFFF, truncated). */
static int utf8_decode(const unsigned char *s, size_t n, uint32_t *cp) {
    unsigned c = s[0];
    if (c < 0x80) { *cp = c; return 1; }
    int len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC2 ? 2 : 0;
    if (!len || c > 0xF4 || (size_t)len > n) return 0;
    uint32_t v = c & (0x3F >> (len - 1));
    for (int i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        v = v << 6 | (s[i] & 0x3F);
    }
    if ((len == 3 && v < 0x800) || (len == 4 && (v < 0x10000 || v > 0x10FFFF)) || (v >= 0xD800 && v < 0xE000)) return 0;
    *cp = v;
    return len;
}

size_t moe_utf8_valid_prefix(const char *s, size_t n) {
    size_t i = 0;
    uint32_t cp;
    while (i < n) {
        int k = utf8_decode((const unsigned char *)s + i, n - i, &cp);
        if (!k) break;
        i += (size_t)k;
    }
    return i;
}

size_t moe_text_ready(const char *buf, size_t n, const char *const *stops, int n_stops, int final, int *stopped) {
    size_t cut = n;
    if (stopped) *stopped = 0;
    for (int i = 0; i < n_stops; i++) { /* the earliest stop string ends the text before it */
        size_t ls = stops[i] ? strlen(stops[i]) : 0;
        for (size_t p = 0; ls && p + ls <= cut; p++)
            if (!memcmp(buf + p, stops[i], ls)) {
                cut = p;
                if (stopped) *stopped = 1;
                break;
            }
    }
    if ((stopped && *stopped) || final) return cut;
    for (int i = 0; i < n_stops; i++) { /* a tail that may begin a stop string waits */
        size_t ls = stops[i] ? strlen(stops[i]) : 0;
        for (size_t k = ls ? ls - 1 : 0; k > 0; k--)
            if (k <= n && !memcmp(buf + n - k, stops[i], k)) {
                if (n - k < cut) cut = n - k;
                break;
            }
    }
    /* an incomplete character at the end waits; invalid bytes (never completed) do not */
    size_t v = moe_utf8_valid_prefix(buf, cut);
    while (v < cut) {
        size_t tail = cut - v;
        unsigned char c = (unsigned char)buf[v];
        size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC2 ? 2 : 0;
        int could_complete = need > tail;
        for (size_t j = 1; could_complete && j < tail; j++) could_complete = ((unsigned char)buf[v + j] & 0xC0) == 0x80;
        if (could_complete && c <= 0xF4) return v; /* a character cut short by the end of the text */
        v += 1;                                   /* a stray byte: pass it on */
        v += moe_utf8_valid_prefix(buf + v, cut - v);
    }
    return cut;
}

typedef struct {
    char *name;
    size_t len;
    int32_t id;
    int hf_special; /* tokenizer_config.json's "special" flag (decides skip_special_tokens) */
} tok_special;

struct moe_tokenizer {
    int pretok;            /* moe_pretok */
    int32_t n_base;        /* mergeable tokens: ids 0 .. n_base-1, id = rank */
    int32_t n_ids;         /* one past the largest id */
    int32_t model_vocab;   /* ids >= this are refused (the embedding has no row); 0: no limit */
    unsigned char *pool;   /* the mergeable tokens' bytes */
    uint32_t *off;         /* [n_base + 1]: token i is pool[off[i] .. off[i+1]) */
    int32_t *slots;        /* open-addressing hash: bytes -> rank; -1 empty */
    size_t mask;
    tok_special *sp;       /* sorted by id */
    int n_sp;
    int first_byte[256];   /* some special name starts with this byte */
};

static uint64_t bytes_hash(const unsigned char *s, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ s[i]) * 1099511628211ull;
    return h ^ (h >> 29);
}

static int32_t tok_rank(const moe_tokenizer *t, const unsigned char *s, size_t n) {
    for (size_t i = bytes_hash(s, n) & t->mask;; i = (i + 1) & t->mask) {
        int32_t id = t->slots[i];
        if (id < 0) return -1;
        if (t->off[id + 1] - t->off[id] == n && !memcmp(t->pool + t->off[id], s, n)) return id;
    }
}

/* ---- rank-file and vocabulary loading ---- */

static int b64val(unsigned char c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

/* Strict RFC 4648 base64 (padding required to a multiple of 4); returns the decoded length or -1. */
static long b64_decode(const char *s, size_t n, unsigned char *out) {
    if (n == 0 || n % 4) return -1;
    long o = 0;
    for (size_t i = 0; i < n; i += 4) {
        int v[4], pad = 0;
        for (int k = 0; k < 4; k++) {
            if (s[i + k] == '=' && i + 4 == n && k >= 2) { v[k] = 0, pad++; continue; }
            if (pad || (v[k] = b64val((unsigned char)s[i + k])) < 0) return -1;
        }
        uint32_t w = (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
        out[o++] = (unsigned char)(w >> 16);
        if (pad < 2) out[o++] = (unsigned char)(w >> 8);
        if (pad < 1) out[o++] = (unsigned char)w;
    }
    return o;
}

/* Builds the hash and checks the table: unique byte strings, all 256 single bytes present. */
static moe_status tok_index(moe_tokenizer *t, const char *what, char *err, size_t errlen) {
    size_t cap = 1;
    while (cap < (size_t)t->n_base * 2 + 2) cap <<= 1;
    t->mask = cap - 1;
    if (!(t->slots = malloc(cap * sizeof *t->slots))) return MOE_ERR_NOMEM;
    memset(t->slots, 0xFF, cap * sizeof *t->slots);
    for (int32_t id = 0; id < t->n_base; id++) {
        const unsigned char *s = t->pool + t->off[id];
        size_t n = t->off[id + 1] - t->off[id], i = bytes_hash(s, n) & t->mask;
        if (n == 0) return fail(err, errlen, MOE_ERR_FORMAT, "%s: token %d is empty", what, (int)id);
        for (; t->slots[i] >= 0; i = (i + 1) & t->mask) {
            int32_t o = t->slots[i];
            if (t->off[o + 1] - t->off[o] == n && !memcmp(t->pool + t->off[o], s, n))
                return fail(err, errlen, MOE_ERR_FORMAT, "%s: tokens %d and %d have the same bytes", what, (int)o, (int)id);
        }
        t->slots[i] = id;
    }
    for (int b = 0; b < 256; b++) {
        unsigned char c = (unsigned char)b;
        if (tok_rank(t, &c, 1) < 0) return fail(err, errlen, MOE_ERR_FORMAT, "%s: no token for the single byte 0x%02X", what, b);
    }
    t->n_ids = t->n_base;
    return MOE_OK;
}

/* A tiktoken rank file: "base64 rank" per line, empty lines skipped; ranks must be 0..n-1. */
static moe_status tok_parse_ranks(moe_tokenizer *t, const char *text, size_t len, const char *path, char *err, size_t errlen) {
    size_t lines = 0;
    for (size_t i = 0; i < len; i++) lines += text[i] == '\n';
    lines++;
    if (lines > 16u << 20) return fail(err, errlen, MOE_ERR_FORMAT, "%s: too many lines", path);
    uint32_t *tlen = calloc(lines, sizeof *tlen), *tpos = calloc(lines, sizeof *tpos);
    t->pool = malloc(len + 1);
    moe_status st = MOE_OK;
    if (!tlen || !tpos || !t->pool) { st = MOE_ERR_NOMEM; goto done; }
    size_t used = 0, lineno = 0;
    int32_t n = 0;
    for (size_t i = 0; i < len;) {
        size_t e = i;
        while (e < len && text[e] != '\n') e++;
        lineno++;
        size_t a = i, b;
        i = e + 1;
        if (e > a && text[e - 1] == '\r') e--;
        if (a == e) continue;
        for (b = a; b < e && text[b] != ' ' && text[b] != '\t'; b++) {}
        size_t c = b;
        while (c < e && (text[c] == ' ' || text[c] == '\t')) c++;
        size_t d = c;
        while (d < e && text[d] >= '0' && text[d] <= '9') d++;
        if (c == b || d == c || d != e || d - c > 9) {
            st = fail(err, errlen, MOE_ERR_FORMAT, "%s:%zu: expected \"BASE64 RANK\"", path, lineno);
            goto done;
        }
        long rank = 0;
        for (size_t k = c; k < d; k++) rank = rank * 10 + (text[k] - '0'); /* at most 9 digits: the text need not end in NUL */
        long k = b64_decode(text + a, b - a, t->pool + used);
        if (k <= 0) { st = fail(err, errlen, MOE_ERR_FORMAT, "%s:%zu: bad base64", path, lineno); goto done; }
        if (rank >= (long)lines || tlen[rank]) {
            st = fail(err, errlen, MOE_ERR_FORMAT, "%s:%zu: rank %ld is %s", path, lineno, rank,
                      rank >= (long)lines ? "larger than the number of entries" : "repeated");
            goto done;
        }
        tlen[rank] = (uint32_t)k, tpos[rank] = (uint32_t)used;
        used += (size_t)k;
        n++;
    }
    for (int32_t r = 0; r < n; r++)
        if (!tlen[r]) { st = fail(err, errlen, MOE_ERR_FORMAT, "%s: rank %d is missing (ranks must be 0..%d)", path, (int)r, (int)n - 1); goto done; }
    if (n < 256) { st = fail(err, errlen, MOE_ERR_FORMAT, "%s: %d entries; a byte-level vocabulary has at least 256", path, (int)n); goto done; }
    /* tokens in rank order, so off[] describes them */
    unsigned char *pool = malloc(used + 1);
    if (!pool || !(t->off = malloc(((size_t)n + 1) * sizeof *t->off))) { free(pool); st = MOE_ERR_NOMEM; goto done; }
    size_t o = 0;
    for (int32_t r = 0; r < n; r++) {
        memcpy(pool + o, t->pool + tpos[r], tlen[r]);
        t->off[r] = (uint32_t)o;
        o += tlen[r];
    }
    t->off[n] = (uint32_t)o;
    free(t->pool);
    t->pool = pool;
    t->n_base = n;
    st = tok_index(t, path, err, errlen);
done:
    free(tlen);
    free(tpos);
    return st;
}

static int cmp_special(const void *a, const void *b) {
    const tok_special *x = a, *y = b;
    return (x->id > y->id) - (x->id < y->id);
}

static moe_status tok_add_special(moe_tokenizer *t, const char *name, size_t len, int32_t id, int hf_special) {
    tok_special *sp = realloc(t->sp, ((size_t)t->n_sp + 1) * sizeof *sp);
    if (!sp) return MOE_ERR_NOMEM;
    t->sp = sp;
    char *s = malloc(len + 1);
    if (!s) return MOE_ERR_NOMEM;
    memcpy(s, name, len);
    s[len] = 0;
    t->sp[t->n_sp++] = (tok_special){s, len, id, hf_special};
    return MOE_OK;
}

/* Sorts the specials, checks names and ids are unique and not mergeable ids, sets n_ids. */
static moe_status tok_finish_specials(moe_tokenizer *t, char *err, size_t errlen) {
    qsort(t->sp, (size_t)t->n_sp, sizeof *t->sp, cmp_special);
    for (int i = 0; i < t->n_sp; i++) {
        const tok_special *s = &t->sp[i];
        if (s->id < t->n_base || (i && s->id == t->sp[i - 1].id))
            return fail(err, errlen, MOE_ERR_FORMAT, "special token %s: id %d is taken", s->name, (int)s->id);
        if (!s->len) return fail(err, errlen, MOE_ERR_FORMAT, "special token %d has an empty name", (int)s->id);
        for (int j = 0; j < i; j++)
            if (t->sp[j].len == s->len && !memcmp(t->sp[j].name, s->name, s->len))
                return fail(err, errlen, MOE_ERR_FORMAT, "special token name %s is used twice", s->name);
        t->first_byte[(unsigned char)s->name[0]] = 1;
        if (s->id + 1 > t->n_ids) t->n_ids = s->id + 1;
    }
    return MOE_OK;
}

/* Kimi's specials (spec 1.2): R ids after the base ranks, named from tokenizer_config.json's
 * added_tokens_decoder where it has the id, else "<|reserved_token_ID|>". R = 256 for K3 (the
 * vocabulary has "<|open|>") and 256 + 2 for Kimi-Linear/K2, whose last two lie past vocab_size. */
static moe_status tok_kimi_specials(moe_tokenizer *t, const moe__json *added, int n_special, char *err, size_t errlen) {
    if (added && added->type != MOE_JSON_OBJ) return fail(err, errlen, MOE_ERR_FORMAT, "tokenizer_config.json: added_tokens_decoder is not an object");
    int k3 = 0;
    for (const moe__json *e = added ? added->child : NULL; e; e = e->next) {
        const moe__json *c = moe__json_get(e, "content");
        if (c && c->type == MOE_JSON_STR && !strcmp(c->str, "<|open|>")) k3 = 1;
    }
    int R = n_special > 0 ? n_special : k3 ? 256 : 258;
    for (int i = 0; i < R; i++) {
        int32_t id = t->n_base + i;
        char key[16], name[48];
        snprintf(key, sizeof key, "%d", (int)id);
        const moe__json *e = added ? moe__json_get(added, key) : NULL, *c = e ? moe__json_get(e, "content") : NULL;
        const moe__json *f = e ? moe__json_get(e, "special") : NULL;
        if (e && (!c || c->type != MOE_JSON_STR))
            return fail(err, errlen, MOE_ERR_FORMAT, "tokenizer_config.json: added_tokens_decoder[%s] has no string content", key);
        if (!c) snprintf(name, sizeof name, "<|reserved_token_%d|>", (int)id);
        moe_status st = tok_add_special(t, c ? c->str : name, strlen(c ? c->str : name), id, f && f->type == MOE_JSON_BOOL && f->num != 0);
        if (st) return st;
    }
    for (const moe__json *e = added ? added->child : NULL; e; e = e->next) {
        char *end;
        long id = strtol(e->key, &end, 10);
        if (*end || id < t->n_base || id >= (long)t->n_base + R)
            return fail(err, errlen, MOE_ERR_FORMAT, "tokenizer_config.json: added token id %s is outside %d..%d", e->key, (int)t->n_base,
                        (int)t->n_base + R - 1);
    }
    return tok_finish_specials(t, err, errlen);
}

static moe_status tok_openai_specials(moe_tokenizer *t) {
    static const struct { const char *name; int32_t o200k, cl100k; } tab[] = {
        {"<|endoftext|>", 199999, 100257}, {"<|fim_prefix|>", -1, 100258}, {"<|fim_middle|>", -1, 100259},
        {"<|fim_suffix|>", -1, 100260},    {"<|endofprompt|>", 200018, 100276},
    };
    for (size_t i = 0; i < sizeof tab / sizeof tab[0]; i++) {
        int32_t id = t->pretok == MOE_PRETOK_O200K ? tab[i].o200k : tab[i].cl100k;
        if (id < 0) continue;
        moe_status st = tok_add_special(t, tab[i].name, strlen(tab[i].name), id, 1);
        if (st) return st;
    }
    return tok_finish_specials(t, NULL, 0);
}

void moe_tokenizer_free(moe_tokenizer *t) {
    if (!t) return;
    for (int i = 0; i < t->n_sp; i++) free(t->sp[i].name);
    free(t->sp);
    free(t->pool);
    free(t->off);
    free(t->slots);
    free(t);
}

/* The loader on texts already in memory (config_json may be NULL); what is names the source in
 * messages. */
static moe_status tok_build(moe_tokenizer **out, const char *ranks, size_t len, int pretok, const moe__json *cfg, int n_special,
                            const char *what, char *err, size_t errlen) {
    *out = NULL;
    moe_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return MOE_ERR_NOMEM;
    t->pretok = pretok;
    moe_status st = tok_parse_ranks(t, ranks, len, what, err, errlen);
    if (!st) {
        if (pretok == MOE_PRETOK_KIMI) st = tok_kimi_specials(t, cfg ? moe__json_get(cfg, "added_tokens_decoder") : NULL, n_special, err, errlen);
        else st = tok_openai_specials(t);
    }
    if (st) {
        if (st == MOE_ERR_NOMEM) fail(err, errlen, st, "%s: out of memory", what);
        moe_tokenizer_free(t);
        return st;
    }
    *out = t;
    return MOE_OK;
}

moe_status moe_tokenizer_load(moe_tokenizer **out, const char *ranks_path, int pretok, const char *config_path, int n_special,
                              char *err, size_t errlen) {
    if (!out || !ranks_path || pretok < MOE_PRETOK_KIMI || pretok > MOE_PRETOK_CL100K || n_special < 0 || n_special > 65536)
        return fail(err, errlen, MOE_ERR_ARG, "moe_tokenizer_load: bad argument");
    *out = NULL;
    char *text = NULL;
    size_t len = 0;
    moe__json *cfg = NULL;
    moe_status st = read_file(ranks_path, &text, &len, 64u << 20, err, errlen);
    if (!st && config_path) st = parse_json_file(config_path, &cfg, err, errlen);
    if (!st && cfg && cfg->type != MOE_JSON_OBJ) st = fail(err, errlen, MOE_ERR_FORMAT, "%s: not a JSON object", config_path);
    if (!st) st = tok_build(out, text, len, pretok, cfg, n_special, ranks_path, err, errlen);
    free(text);
    moe__json_free(cfg);
    return st;
}

moe_status moe__tokenizer_from_mem(moe_tokenizer **out, const char *ranks, size_t len, int pretok, const char *config_json, size_t clen,
                                   char *err, size_t errlen) {
    moe__json *cfg = NULL;
    if (config_json) {
        moe_status st = moe__json_parse(config_json, clen, &cfg, err, errlen);
        if (st) return st;
        if (cfg->type != MOE_JSON_OBJ) { moe__json_free(cfg); return fail(err, errlen, MOE_ERR_FORMAT, "tokenizer config: not an object"); }
    }
    moe_status st = tok_build(out, ranks, len, pretok, cfg, 0, "ranks", err, errlen);
    moe__json_free(cfg);
    return st;
}

/* GPT-2's byte-level alphabet, which GGUF vocabularies use: printable bytes stand for themselves,
 * the other 68 bytes for U+0100 + k in byte order. Returns the byte or -1. */
static int gpt2_byte_of(uint32_t cp) {
    static int16_t map[0x144];
    static int ready;
    if (!ready) {
        int k = 0;
        for (int i = 0; i < 0x144; i++) map[i] = -1;
        for (int b = 0; b < 256; b++) {
            int printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
            map[printable ? b : 0x100 + k++] = (int16_t)b;
        }
        ready = 1; /* idempotent: racing threads write the same values */
    }
    return cp < 0x144 ? map[cp] : -1;
}

/* The vocabulary inside a GGUF (llama.cpp's tokenizer.ggml.* keys): a byte-level BPE ("gpt2")
 * vocabulary cut by Kimi's pre-tokenizer ("kimi-k2"), as llama.cpp's converter and moe-convert
 * write Kimi's. Normal tokens (type 1) must be ids 0..n-1 and are byte-level strings (id = rank;
 * the merges list is ignored, it is lossy: spec 2.3); control and user-defined tokens are
 * specials, unused ones (type 5, llama.cpp's "[PADn]" fillers) are skipped. */
static moe_status tok_from_gguf(moe_tokenizer *t, const moe__st_file *f, char *err, size_t errlen) {
    char model[64], pre[64];
    gguf_str(f, "tokenizer.ggml.model", model, sizeof model);
    gguf_str(f, "tokenizer.ggml.pre", pre, sizeof pre);
    if (!model[0] || !strcmp(model, "none"))
        return fail(err, errlen, MOE_ERR_FORMAT, "%s: the file has no vocabulary (tokenizer.ggml.model %s): give token ids, or the "
                    "checkpoint's tiktoken.model", f->path, model[0] ? "is \"none\"" : "is missing");
    if (strcmp(model, "gpt2"))
        return fail(err, errlen, MOE_ERR_UNSUPPORTED, "%s: tokenizer.ggml.model is \"%s\"; moe reads byte-level BPE (\"gpt2\") vocabularies",
                    f->path, model);
    if (strcmp(pre, "kimi-k2"))
        return fail(err, errlen, MOE_ERR_UNSUPPORTED, "%s: tokenizer.ggml.pre is %s%s%s; moe pre-tokenizes GGUF vocabularies as Kimi's (\"kimi-k2\")",
                    f->path, pre[0] ? "\"" : "", pre[0] ? pre : "missing", pre[0] ? "\"" : "");
    const moe__gguf_kv *tk = moe__gguf_get(f, "tokenizer.ggml.tokens"), *ty = moe__gguf_get(f, "tokenizer.ggml.token_type");
    if (!tk || tk->type != MOE_GGUF_ARRAY || tk->etype != MOE_GGUF_STRING || tk->n == 0 || tk->n > (1u << 24))
        return fail(err, errlen, MOE_ERR_FORMAT, "%s: no tokenizer.ggml.tokens string array", f->path);
    if (ty && (ty->type != MOE_GGUF_ARRAY || ty->etype != MOE_GGUF_I32 || ty->n != tk->n))
        return fail(err, errlen, MOE_ERR_FORMAT, "%s: tokenizer.ggml.token_type does not match the tokens", f->path);
    const uint8_t *p = tk->data, *end = (const uint8_t *)f->map + f->size;
    size_t n = (size_t)tk->n, total = 0;
    const uint8_t **str = malloc(n * sizeof *str);
    uint64_t *slen = malloc(n * sizeof *slen);
    moe_status st = MOE_OK;
    if (!str || !slen) { st = MOE_ERR_NOMEM; goto done; }
    for (size_t i = 0; i < n; i++) { /* the GGUF reader checked these bounds; check again, cheaply */
        uint64_t l;
        if ((size_t)(end - p) < 8) { st = fail(err, errlen, MOE_ERR_FORMAT, "%s: token %zu truncated", f->path, i); goto done; }
        memcpy(&l, p, 8);
        if (l > (uint64_t)(end - p - 8)) { st = fail(err, errlen, MOE_ERR_FORMAT, "%s: token %zu truncated", f->path, i); goto done; }
        str[i] = p + 8, slen[i] = l, total += l;
        p += 8 + l;
    }
    int32_t nb = 0;
    while ((size_t)nb < n) {
        int32_t type = 1;
        if (ty) memcpy(&type, ty->data + 4 * (size_t)nb, 4);
        if (type != 1) break;
        nb++;
    }
    if (!(t->pool = malloc(total + 1)) || !(t->off = malloc(((size_t)nb + 1) * sizeof *t->off))) { st = MOE_ERR_NOMEM; goto done; }
    size_t o = 0;
    for (int32_t i = 0; i < nb; i++) {
        t->off[i] = (uint32_t)o;
        for (size_t j = 0; j < slen[i];) {
            uint32_t cp;
            int k = utf8_decode(str[i] + j, (size_t)slen[i] - j, &cp), b = k ? gpt2_byte_of(cp) : -1;
            if (b < 0) { st = fail(err, errlen, MOE_ERR_FORMAT, "%s: token %d is not a byte-level string", f->path, (int)i); goto done; }
            t->pool[o++] = (unsigned char)b;
            j += (size_t)k;
        }
    }
    t->off[nb] = (uint32_t)o;
    t->n_base = nb;
    if ((st = tok_index(t, f->path, err, errlen))) goto done;
    for (size_t i = (size_t)nb; i < n; i++) {
        int32_t type = 1;
        if (ty) memcpy(&type, ty->data + 4 * i, 4);
        if (type == 1) { st = fail(err, errlen, MOE_ERR_FORMAT, "%s: normal token %zu after the special ones", f->path, i); goto done; }
        if (type == 5 || slen[i] == 0) continue; /* unused slot */
        if ((st = tok_add_special(t, (const char *)str[i], (size_t)slen[i], (int32_t)i, type == 3))) goto done;
    }
    st = tok_finish_specials(t, err, errlen);
done:
    free(str);
    free(slen);
    return st;
}

/* The tokenizer of an open GGUF; ids at or past model_vocab (0: none) are refused. */
static moe_status tok_of_gguf_file(moe_tokenizer **out, const moe__st_file *f, int32_t model_vocab, char *err, size_t errlen) {
    moe_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return MOE_ERR_NOMEM;
    t->pretok = MOE_PRETOK_KIMI;
    moe_status st = tok_from_gguf(t, f, err, errlen);
    if (st) { moe_tokenizer_free(t); return st; }
    t->model_vocab = model_vocab;
    *out = t;
    return MOE_OK;
}

moe_status moe_tokenizer_from_gguf(moe_tokenizer **out, const char *path, char *err, size_t errlen) {
    if (!out || !path) return fail(err, errlen, MOE_ERR_ARG, "moe_tokenizer_from_gguf: bad argument");
    *out = NULL;
    moe__st_file f;
    moe_status st = moe__gguf_open(&f, path, err, errlen);
    if (st) return st;
    char arch[32];
    const int64_t V = gk_int(&f, gguf_str(&f, "general.architecture", arch, sizeof arch), "vocab_size", 0);
    st = tok_of_gguf_file(out, &f, V > 0 && V <= INT32_MAX ? (int32_t)V : 0, err, errlen);
    moe__st_close(&f);
    return st;
}

moe_status moe_tokenizer_for_model(moe_tokenizer **out, const moe_model *m, char *err, size_t errlen) {
    if (!out || !m) return fail(err, errlen, MOE_ERR_ARG, "moe_tokenizer_for_model: bad argument");
    *out = NULL;
    moe_status st;
    if (m->files[0].is_gguf) return tok_of_gguf_file(out, &m->files[0], m->cfg.vocab_size, err, errlen);
    char dir[4096], ranks[4200], cfg[4200];
    const char *slash = strrchr(m->path, '/');
    if (is_dir(m->path)) snprintf(dir, sizeof dir, "%s", m->path);
    else if (slash) snprintf(dir, sizeof dir, "%.*s", (int)(slash - m->path), m->path);
    else strcpy(dir, ".");
    snprintf(ranks, sizeof ranks, "%s/tiktoken.model", dir);
    snprintf(cfg, sizeof cfg, "%s/tokenizer_config.json", dir);
    if (!file_exists(ranks)) return fail(err, errlen, MOE_ERR_IO, "%s: the model ships no tokenizer (tiktoken.model)", dir);
    st = moe_tokenizer_load(out, ranks, MOE_PRETOK_KIMI, file_exists(cfg) ? cfg : NULL, 0, err, errlen);
    if (!st) (*out)->model_vocab = m->cfg.vocab_size;
    return st;
}

/* ---- pre-tokenizers (spec 3.3; o200k and cl100k per spec 4) ---- */

typedef struct {
    const uint32_t *cp;
    const uint8_t *cls;
    int n, pretok;
} ptext;

static int pt_cat(const ptext *x, int i) { return x->cls[i] & UC_CAT; }
static int pt_letter(const ptext *x, int i) { int c = pt_cat(x, i); return c >= UC_UPPER && c <= UC_OLETTER; }
static int pt_crlf(const ptext *x, int i) { return x->cp[i] == '\r' || x->cp[i] == '\n'; }
static int pt_ws(const ptext *x, int i) { return (x->cls[i] & UC_WS) != 0; }
/* [^\r\n\p{L}\p{N}] */
static int pt_prefix(const ptext *x, int i) { return !pt_crlf(x, i) && !pt_letter(x, i) && pt_cat(x, i) != UC_NUMBER; }
/* [^\s\p{L}\p{N}] */
static int pt_punct(const ptext *x, int i) { return !pt_ws(x, i) && !pt_letter(x, i) && pt_cat(x, i) != UC_NUMBER; }
static int pt_han(const ptext *x, int i) { return x->pretok == MOE_PRETOK_KIMI && (x->cls[i] & UC_HAN); }
/* U = [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] and W = [\p{Ll}\p{Lm}\p{Lo}\p{M}], Kimi: minus Han */
static int pt_U(const ptext *x, int i) { int c = pt_cat(x, i); return (c == UC_UPPER || c == UC_OLETTER || c == UC_MARK) && !pt_han(x, i); }
static int pt_W(const ptext *x, int i) { int c = pt_cat(x, i); return (c == UC_LOWER || c == UC_OLETTER || c == UC_MARK) && !pt_han(x, i); }

static int fold_is(uint32_t c, char a) { /* simple case folding, ASCII plus U+017F (long s) for 's' */
    return c == (uint32_t)a || c == (uint32_t)(a - 32) || (a == 's' && c == 0x17F);
}

/* (?i:'s|'t|'re|'ve|'m|'ll|'d) at i: the end, or i when there is none. */
static int pt_contraction(const ptext *x, int i) {
    if (i + 1 >= x->n || x->cp[i] != '\'') return i;
    uint32_t a = x->cp[i + 1];
    if (fold_is(a, 's') || fold_is(a, 't') || fold_is(a, 'm') || fold_is(a, 'd')) return i + 2;
    if (i + 2 < x->n) {
        uint32_t b = x->cp[i + 2];
        if ((fold_is(a, 'r') && fold_is(b, 'e')) || (fold_is(a, 'v') && fold_is(b, 'e')) || (fold_is(a, 'l') && fold_is(b, 'l'))) return i + 3;
    }
    return i;
}

/* Alternative 2, U*W+ with the word starting at p: the end, or -1. */
static int pt_word_lower(const ptext *x, int p) {
    int r = p;
    while (r < x->n && pt_U(x, r)) r++;
    if (r < x->n && pt_W(x, r)) {
        while (r < x->n && pt_W(x, r)) r++;
        return r;
    }
    for (int q = r - 1; q >= p; q--) /* backtrack: give back trailing U-only characters */
        if (pt_W(x, q)) return q + 1;
    return -1;
}

/* Alternative 3, U+W* at p (W* is empty whenever alternative 2 failed at p). */
static int pt_word_upper(const ptext *x, int p) {
    int r = p;
    while (r < x->n && pt_U(x, r)) r++;
    return r > p ? r : -1;
}

/* The whitespace alternatives \s*[\r\n]+ | \s+(?!\S) | \s+ at i (x->cp[i] is White_Space). */
static int pt_space(const ptext *x, int i) {
    int e = i, last_nl = -1;
    while (e < x->n && pt_ws(x, e)) {
        if (pt_crlf(x, e)) last_nl = e;
        e++;
    }
    if (last_nl >= 0) return last_nl + 1;
    if (e == x->n) return e;
    if (e - i >= 2) return e - 1;
    return i + 1;
}

/* ` ?[^\s\p{L}\p{N}]+[\r\n]*` (o200k: `[\r\n/]*`) at i: the end, or -1. */
static int pt_punct_run(const ptext *x, int i) {
    int q = x->cp[i] == ' ' && i + 1 < x->n && pt_punct(x, i + 1) ? i + 1 : i;
    if (!pt_punct(x, q)) return -1;
    while (q < x->n && pt_punct(x, q)) q++;
    while (q < x->n && (pt_crlf(x, q) || (x->pretok == MOE_PRETOK_O200K && x->cp[q] == '/'))) q++;
    return q;
}

/* The end of the piece that starts at i. */
static int pt_next(const ptext *x, int i) {
    int e;
    if (x->pretok == MOE_PRETOK_CL100K) {
        if ((e = pt_contraction(x, i)) > i) return e;
        for (int p = pt_prefix(x, i) ? i + 1 : i;; p = i) { /* [^\r\n\p{L}\p{N}]?\p{L}+ */
            int r = p;
            while (r < x->n && pt_letter(x, r)) r++;
            if (r > p) return r;
            if (p == i) break;
        }
    } else {
        if (pt_han(x, i)) {
            for (e = i + 1; e < x->n && pt_han(x, e);) e++;
            return e;
        }
        for (int alt = 0; alt < 2; alt++)
            for (int p = pt_prefix(x, i) ? i + 1 : i;; p = i) {
                if (p < x->n && (e = alt ? pt_word_upper(x, p) : pt_word_lower(x, p)) >= 0) return pt_contraction(x, e);
                if (p == i) break;
            }
    }
    if (pt_cat(x, i) == UC_NUMBER) {
        for (e = i + 1; e < x->n && e < i + 3 && pt_cat(x, e) == UC_NUMBER;) e++;
        return e;
    }
    if ((e = pt_punct_run(x, i)) >= 0) return e;
    return pt_space(x, i); /* every other code point is White_Space */
}

/* Test hook: the pre-tokenizer alone (no chunking, no specials) over valid UTF-8; writes the
 * byte offset where each piece ends; returns the number of pieces, or -1. */
long moe__pretokenize(int pretok, const char *text, size_t len, size_t *ends, size_t cap) {
    uint32_t *cp = malloc((len + 1) * sizeof *cp), *bo = malloc((len + 1) * sizeof *bo);
    uint8_t *cls = malloc(len + 1);
    long np = -1;
    int n = 0;
    if (!cp || !bo || !cls) goto done;
    for (size_t i = 0; i < len; n++) {
        int k = utf8_decode((const unsigned char *)text + i, len - i, &cp[n]);
        if (!k) goto done;
        cls[n] = (uint8_t)uni_class(cp[n]);
        bo[n] = (uint32_t)i;
        i += (size_t)k;
    }
    bo[n] = (uint32_t)len;
    ptext x = {cp, cls, n, pretok};
    np = 0;
    for (int i = 0; i < n; np++) {
        i = pt_next(&x, i);
        if ((size_t)np < cap) ends[np] = bo[i];
    }
done:
    free(cp);
    free(bo);
    free(cls);
    return np;
}

/* ---- byte-pair merge ---- */

typedef struct {
    int32_t rank, pos;
} bpe_item;

static int bpe_less(bpe_item a, bpe_item b) { return a.rank < b.rank || (a.rank == b.rank && a.pos < b.pos); }

static void heap_push(bpe_item *h, int *n, bpe_item v) {
    int i = (*n)++;
    while (i && bpe_less(v, h[(i - 1) / 2])) h[i] = h[(i - 1) / 2], i = (i - 1) / 2;
    h[i] = v;
}

static bpe_item heap_pop(bpe_item *h, int *n) {
    bpe_item top = h[0], v = h[--*n];
    int i = 0;
    for (;;) {
        int c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && bpe_less(h[c + 1], h[c])) c++;
        if (!bpe_less(h[c], v)) break;
        h[i] = h[c], i = c;
    }
    if (*n) h[i] = v;
    return top;
}

typedef struct {
    int32_t *ids;
    size_t n, cap;
    int32_t *next, *prev, *rank; /* per byte position of the piece being merged */
    bpe_item *heap;
    size_t work; /* bytes the work arrays hold */
} tok_out;

static void out_id(tok_out *o, int32_t id) {
    if (o->n < o->cap) o->ids[o->n] = id;
    o->n++;
}

/* Rank of the pair of parts starting at i (part i joined with the next one), or INT32_MAX. */
static int32_t bpe_pair(const moe_tokenizer *t, const unsigned char *s, int L, const int32_t *next, int i) {
    int j = next[i];
    if (j >= L) return INT32_MAX;
    int end = next[j];
    int32_t r = tok_rank(t, s + i, (size_t)(end - i));
    return r < 0 ? INT32_MAX : r;
}

static moe_status bpe_piece(const moe_tokenizer *t, const unsigned char *s, int L, tok_out *o) {
    int32_t whole = tok_rank(t, s, (size_t)L);
    if (whole >= 0) { out_id(o, whole); return MOE_OK; }
    if ((size_t)L + 1 > o->work) {
        size_t w = (size_t)L + 1 > 2 * o->work ? (size_t)L + 1 : 2 * o->work;
        int32_t *nx = realloc(o->next, w * sizeof *nx), *pv = nx ? realloc(o->prev, w * sizeof *pv) : NULL;
        if (nx) o->next = nx;
        if (pv) o->prev = pv;
        int32_t *rk = pv ? realloc(o->rank, w * sizeof *rk) : NULL;
        if (rk) o->rank = rk;
        bpe_item *hp = rk ? realloc(o->heap, 2 * w * sizeof *hp) : NULL;
        if (hp) o->heap = hp;
        if (!hp) return MOE_ERR_NOMEM;
        o->work = w;
    }
    int32_t *next = o->next, *prev = o->prev, *rank = o->rank;
    bpe_item *heap = o->heap;
    int hn = 0;
    for (int i = 0; i <= L; i++) next[i] = i + 1, prev[i] = i - 1;
    for (int i = 0; i + 1 < L; i++) {
        rank[i] = bpe_pair(t, s, L, next, i);
        if (rank[i] != INT32_MAX) heap_push(heap, &hn, (bpe_item){rank[i], i});
    }
    rank[L - 1] = INT32_MAX;
    /* lazy deletion: an item is current when its part still starts a pair of that rank; the heap
     * never holds more than 2L items (L initial pushes, at most 2 per merge, L-1 merges; stale
     * ones are popped before the pushes that replace them would overflow it) */
    while (hn) {
        bpe_item it = heap_pop(heap, &hn);
        int i = it.pos;
        if (rank[i] != it.rank || next[i] >= L) continue;
        int j = next[i];
        next[i] = next[j];
        if (next[j] <= L) prev[next[j]] = i;
        rank[j] = INT32_MAX;
        next[j] = L + 1; /* dead */
        rank[i] = bpe_pair(t, s, L, next, i);
        if (rank[i] != INT32_MAX) heap_push(heap, &hn, (bpe_item){rank[i], i});
        int p = prev[i];
        if (p >= 0) {
            rank[p] = bpe_pair(t, s, L, next, p);
            if (rank[p] != INT32_MAX) heap_push(heap, &hn, (bpe_item){rank[p], p});
        }
    }
    for (int i = 0; i < L; i = next[i]) {
        int32_t r = tok_rank(t, s + i, (size_t)(next[i] - i));
        if (r < 0) return MOE_ERR_FORMAT; /* impossible: single bytes are present, merges are ranks */
        out_id(o, r);
    }
    return MOE_OK;
}

/* Pre-tokenizes cps [a, b) of the decoded text and byte-pair encodes each piece. */
static moe_status tok_stretch(const moe_tokenizer *t, const unsigned char *bytes, const uint32_t *bo, const ptext *x, int a, int b,
                              tok_out *o) {
    ptext y = {x->cp + a, x->cls + a, b - a, x->pretok};
    for (int i = 0; i < y.n;) {
        int e = pt_next(&y, i);
        moe_status st = bpe_piece(t, bytes + bo[a + i], (int)(bo[a + e] - bo[a + i]), o);
        if (st) return st;
        i = e;
    }
    return MOE_OK;
}

/* One chunk: specials (when allowed) split it into stretches. */
static moe_status tok_chunk(const moe_tokenizer *t, const unsigned char *bytes, const uint32_t *bo, const ptext *x, int a, int b,
                            int allow_special, tok_out *o) {
    int s = a;
    for (int i = a; allow_special && i < b; i++) {
        unsigned char c = bytes[bo[i]];
        if (!t->first_byte[c]) continue;
        const tok_special *hit = NULL;
        for (int k = 0; k < t->n_sp && !hit; k++) {
            const tok_special *sp = &t->sp[k];
            if (sp->name[0] == (char)c && bo[b] - bo[i] >= sp->len && !memcmp(bytes + bo[i], sp->name, sp->len)) hit = sp;
        }
        if (!hit) continue;
        int e = i; /* the name ends on a code point boundary: it is valid UTF-8 text */
        while (e < b && bo[e] < bo[i] + hit->len) e++;
        if (bo[e] != bo[i] + hit->len) continue;
        moe_status st = tok_stretch(t, bytes, bo, x, s, i, o);
        if (st) return st;
        out_id(o, hit->id);
        s = e, i = e - 1;
    }
    return tok_stretch(t, bytes, bo, x, s, b, o);
}

moe_status moe_tokenize(const moe_tokenizer *t, const char *text, size_t len, unsigned flags, int32_t *ids, size_t cap, size_t *n_ids,
                        char *err, size_t errlen) {
    if (n_ids) *n_ids = 0;
    if (!t || (!text && len) || (!ids && cap) || !n_ids || len > (size_t)INT32_MAX / 2)
        return fail(err, errlen, MOE_ERR_ARG, "moe_tokenize: bad argument");
    const unsigned char *s = (const unsigned char *)text;
    /* The vendor cuts the text into windows of 400,000 code points and tokenizes each on its own
     * (spec 2.1 step 2), so a window at a time is decoded: the work arrays (9 bytes a code point)
     * stay the size of a window however long the text. The other pre-tokenizers take the text whole. */
    const size_t W = t->pretok == MOE_PRETOK_KIMI && len > 400000 ? 400000 : len;
    uint32_t *cp = malloc((W + 1) * sizeof *cp), *bo = malloc((W + 1) * sizeof *bo);
    uint8_t *cls = malloc(W + 1);
    tok_out o = {ids, 0, cap, NULL, NULL, NULL, NULL, 0};
    moe_status st = MOE_OK;
    if (!cp || !bo || !cls) { st = MOE_ERR_NOMEM; goto done; }
    const int allow = (flags & MOE_TOK_SPECIAL) != 0;
    for (size_t i = 0; i < len && !st;) {
        int n = 0;
        for (; i < len && (size_t)n < W; n++) {
            int k = utf8_decode(s + i, len - i, &cp[n]);
            if (!k) {
                if (!(flags & MOE_TOK_RAW_BYTES)) {
                    st = fail(err, errlen, MOE_ERR_ARG, "text is not valid UTF-8 at byte %zu", i);
                    goto done;
                }
                cp[n] = 0x110000u + s[i], k = 1; /* a stray byte: a symbol of its own */
            }
            cls[n] = (uint8_t)uni_class(cp[n]);
            bo[n] = (uint32_t)i;
            i += (size_t)k;
        }
        bo[n] = (uint32_t)i;
        ptext x = {cp, cls, n, t->pretok};
        if (t->pretok != MOE_PRETOK_KIMI) {
            st = tok_chunk(t, s, bo, &x, 0, n, allow, &o);
            continue;
        }
        /* the window cut again so no run of (Python) whitespace or non-whitespace is longer than
         * 25,000 */
        int start = 0, run = 0, prev_space = -1;
        for (int j = 0; j < n && !st; j++) {
            int sp = py_isspace(cp[j] < 0x110000 ? cp[j] : 0x21);
            run = sp == prev_space ? run + 1 : 1;
            prev_space = sp;
            if (run > 25000) {
                st = tok_chunk(t, s, bo, &x, start, j, allow, &o);
                start = j, run = 1;
            }
        }
        if (!st) st = tok_chunk(t, s, bo, &x, start, n, allow, &o);
    }
    if (!st && t->model_vocab > 0)
        for (size_t i = 0; i < o.n && i < cap; i++)
            if (ids[i] >= t->model_vocab) {
                st = fail(err, errlen, MOE_ERR_ARG, "token %d (%s) is outside the model's vocabulary of %d", (int)ids[i],
                          moe_token_is_special(t, ids[i]) ? moe_token_bytes(t, ids[i], NULL) : "a mergeable token", (int)t->model_vocab);
                break;
            }
    *n_ids = o.n;
    if (!st && o.n > cap) st = fail(err, errlen, MOE_ERR_RANGE, "moe_tokenize: %zu ids, room for %zu", o.n, cap);
done:
    if (st == MOE_ERR_NOMEM) fail(err, errlen, st, "moe_tokenize: out of memory");
    free(cp);
    free(bo);
    free(cls);
    free(o.next);
    free(o.prev);
    free(o.rank);
    free(o.heap);
    return st;
}

static const tok_special *tok_find_special(const moe_tokenizer *t, int32_t id) {
    int lo = 0, hi = t->n_sp - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (t->sp[mid].id == id) return &t->sp[mid];
        if (t->sp[mid].id < id) lo = mid + 1; else hi = mid - 1;
    }
    return NULL;
}

const char *moe_token_bytes(const moe_tokenizer *t, int32_t id, size_t *len) {
    if (len) *len = 0;
    if (!t || id < 0) return NULL;
    if (id < t->n_base) {
        if (len) *len = t->off[id + 1] - t->off[id];
        return (const char *)t->pool + t->off[id];
    }
    const tok_special *s = tok_find_special(t, id);
    if (!s) return NULL;
    if (len) *len = s->len;
    return s->name;
}

int moe_token_is_special(const moe_tokenizer *t, int32_t id) { return t && id >= t->n_base && tok_find_special(t, id) != NULL; }

int32_t moe_token_id(const moe_tokenizer *t, const char *name) {
    if (!t || !name) return -1;
    size_t n = strlen(name);
    for (int i = 0; i < t->n_sp; i++)
        if (t->sp[i].len == n && !memcmp(t->sp[i].name, name, n)) return t->sp[i].id;
    return -1;
}

int moe_token_is_eog(const moe_model *m, const moe_tokenizer *t, int32_t id) {
    static const char *const ends[] = {"[EOS]", "<|im_end|>", "<|end_of_msg|>"};
    if (id < 0) return 0;
    if (m && id == m->cfg.eos_token_id) return 1;
    for (size_t i = 0; t && i < sizeof ends / sizeof *ends; i++)
        if (id == moe_token_id(t, ends[i])) return 1;
    return 0;
}

int32_t moe_tokenizer_n_ids(const moe_tokenizer *t) { return t ? t->n_ids : 0; }

moe_status moe_detokenize(const moe_tokenizer *t, const int32_t *ids, size_t n, char *buf, size_t cap, size_t *len, char *err,
                          size_t errlen) {
    if (len) *len = 0;
    if (!t || (!ids && n) || (!buf && cap) || !len) return fail(err, errlen, MOE_ERR_ARG, "moe_detokenize: bad argument");
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        size_t k;
        const char *b = moe_token_bytes(t, ids[i], &k);
        if (!b || (t->model_vocab > 0 && ids[i] >= t->model_vocab))
            return fail(err, errlen, MOE_ERR_ARG, "token id %d is not in the vocabulary", (int)ids[i]);
        if (o + k <= cap) memcpy(buf + o, b, k);
        o += k;
    }
    *len = o;
    if (o > cap) return fail(err, errlen, MOE_ERR_RANGE, "moe_detokenize: %zu bytes, room for %zu", o, cap);
    return MOE_OK;
}

/* ==== chat formats =============================================================================
 * OpenAI-style requests ({"messages": [...], "tools": [...], ...}) rendered as the vendor
 * templates do (docs/spec/TOKENIZER.md section 5): Kimi-Linear/K2 (the K2-Instruct-0905 template,
 * "T1") and K3's XTML (encoding_k3.py's build_chat_segments). A prompt is a list of segments,
 * each encoded on its own: control markers with specials allowed, text with specials as plain
 * text. JSON inside prompts is written as Python's json.dumps writes it. */

typedef struct {
    char *text;
    size_t len;
    int control; /* a marker: encoded with specials allowed */
} chat_seg;

typedef struct {
    chat_seg *seg;
    int n, cap;
    sbuf sb; /* scratch for building one text */
    moe_status st;
    char *err;
    size_t errlen;
} chat_out;

static void seg_add(chat_out *o, const char *text, size_t len, int control) {
    if (o->st || !len) return; /* empty texts are dropped (vendor) */
    if (o->n == o->cap) {
        int cap = o->cap ? 2 * o->cap : 64;
        chat_seg *ns = realloc(o->seg, (size_t)cap * sizeof *ns);
        if (!ns) { o->st = MOE_ERR_NOMEM; return; }
        o->seg = ns, o->cap = cap;
    }
    char *t = malloc(len + 1);
    if (!t) { o->st = MOE_ERR_NOMEM; return; }
    memcpy(t, text, len);
    t[len] = 0;
    o->seg[o->n++] = (chat_seg){t, len, control};
}
static void seg_text(chat_out *o, const char *s) {
    if (s) seg_add(o, s, strlen(s), 0);
    else if (!o->st) o->st = MOE_ERR_NOMEM;
}
static void seg_mark(chat_out *o, const char *s) { seg_add(o, s, strlen(s), 1); }

static moe_status chat_fail(chat_out *o, const char *fmt, ...) {
    if (!o->st) {
        o->st = MOE_ERR_ARG;
        if (o->err && o->errlen) {
            va_list ap;
            va_start(ap, fmt);
            int k = snprintf(o->err, o->errlen, "chat: ");
            vsnprintf(o->err + k, o->errlen - (size_t)k, fmt, ap);
            va_end(ap);
        }
    }
    return o->st;
}

/* ---- JSON output as Python's json.dumps(x, ensure_ascii=False[, separators], sort_keys) ---- */

static void py_str(sbuf *b, const char *s) {
    sb_printf(b, "\"");
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        switch (c) {
        case '"': sb_printf(b, "\\\""); break;
        case '\\': sb_printf(b, "\\\\"); break;
        case '\n': sb_printf(b, "\\n"); break;
        case '\r': sb_printf(b, "\\r"); break;
        case '\t': sb_printf(b, "\\t"); break;
        case '\b': sb_printf(b, "\\b"); break;
        case '\f': sb_printf(b, "\\f"); break;
        default:
            if (c < 0x20) sb_printf(b, "\\u%04x", c);
            else sb_printf(b, "%c", c);
        }
    }
    sb_printf(b, "\"");
}

/* A number as Python prints what json.loads made of the literal: integers keep their digits,
 * other literals become floats printed with repr() (shortest round trip; exponent form below
 * 1e-4 and from 1e16). */
static void py_num(sbuf *b, const char *lit, double v) {
    if (!strpbrk(lit, ".eE")) {
        sb_printf(b, "%s", strcmp(lit, "-0") ? lit : "0");
        return;
    }
    if (isinf(v)) { sb_printf(b, v > 0 ? "Infinity" : "-Infinity"); return; }
    char e[40];
    for (int p = 1; p <= 17; p++) {
        snprintf(e, sizeof e, "%.*e", p - 1, v);
        if (strtod(e, NULL) == v) break;
    }
    /* e = [-]d[.ddd]e[+-]XX: split into digits and exponent */
    char digits[24], *o = digits;
    const char *q = e;
    int neg = *q == '-';
    if (neg) q++;
    for (; *q != 'e'; q++)
        if (*q != '.') *o++ = *q;
    *o = 0;
    int ex = atoi(q + 1), nd = (int)strlen(digits);
    while (nd > 1 && digits[nd - 1] == '0') digits[--nd] = 0;
    if (neg) sb_printf(b, "-");
    if (ex >= -5 + 1 && ex < 16) { /* repr uses fixed notation for 1e-4 <= |v| < 1e16 */
        if (ex < 0) {
            sb_printf(b, "0.");
            for (int i = 0; i < -ex - 1; i++) sb_printf(b, "0");
            sb_printf(b, "%s", digits);
        } else if (nd <= ex + 1) {
            sb_printf(b, "%s", digits);
            for (int i = nd; i < ex + 1; i++) sb_printf(b, "0");
            sb_printf(b, ".0");
        } else {
            sb_printf(b, "%.*s.%s", ex + 1, digits, digits + ex + 1);
        }
    } else {
        sb_printf(b, "%c", digits[0]);
        if (nd > 1) sb_printf(b, ".%s", digits + 1);
        sb_printf(b, "e%c%02d", ex < 0 ? '-' : '+', ex < 0 ? -ex : ex);
    }
}

static int cmp_json_key(const void *a, const void *b) {
    return strcmp((*(const moe__json *const *)a)->key, (*(const moe__json *const *)b)->key);
}

/* compact: separators (",", ":"), else (", ", ": "); sorted: keys of every object sorted */
static int py_json(sbuf *b, const moe__json *j, int compact, int sorted) {
    switch (j->type) {
    case MOE_JSON_NULL: sb_printf(b, "null"); return 1;
    case MOE_JSON_BOOL: sb_printf(b, j->num != 0 ? "true" : "false"); return 1;
    case MOE_JSON_NUM: py_num(b, j->str ? j->str : "0", j->num); return 1;
    case MOE_JSON_STR: py_str(b, j->str); return 1;
    case MOE_JSON_ARR:
        sb_printf(b, "[");
        for (const moe__json *c = j->child; c; c = c->next) {
            if (c != j->child) sb_printf(b, compact ? "," : ", ");
            if (!py_json(b, c, compact, sorted)) return 0;
        }
        sb_printf(b, "]");
        return 1;
    default: {
        const moe__json **kids = malloc(((size_t)j->n + 1) * sizeof *kids);
        if (!kids) return 0;
        int n = 0;
        for (const moe__json *c = j->child; c; c = c->next) kids[n++] = c;
        if (sorted) qsort(kids, (size_t)n, sizeof *kids, cmp_json_key);
        sb_printf(b, "{");
        int ok = 1;
        for (int i = 0; i < n && ok; i++) {
            if (i) sb_printf(b, compact ? "," : ", ");
            py_str(b, kids[i]->key);
            sb_printf(b, compact ? ":" : ": ");
            ok = py_json(b, kids[i], compact, sorted);
        }
        sb_printf(b, "}");
        free(kids);
        return ok;
    }
    }
}

/* sb's text, taken (the buffer is reset); NULL when it ran out of memory */
static char *sb_take(sbuf *b) {
    char *s = b->oom ? NULL : b->s ? b->s : calloc(1, 1);
    if (b->oom) free(b->s);
    b->s = NULL, b->n = b->cap = 0, b->oom = 0;
    return s;
}

static char *chat_take(chat_out *o) {
    char *s = sb_take(&o->sb);
    if (!s && !o->st) o->st = MOE_ERR_NOMEM;
    return s;
}

static const char *jstr(const moe__json *obj, const char *key) {
    const moe__json *v = obj ? moe__json_get(obj, key) : NULL;
    return v && v->type == MOE_JSON_STR ? v->str : NULL;
}

/* A message's content: a string, null/absent (empty), or a list of parts whose text parts are
 * concatenated; anything else (images) is refused by this text-only runtime. */
static char *chat_content(chat_out *o, const moe__json *msg, const char *key, int idx) {
    const moe__json *c = moe__json_get(msg, key);
    sbuf *b = &o->sb;
    if (!c || c->type == MOE_JSON_NULL) {
        char *r = calloc(1, 1);
        if (!r) o->st = MOE_ERR_NOMEM;
        return r;
    }
    if (c->type == MOE_JSON_STR) {
        char *r = strdup(c->str);
        if (!r) o->st = MOE_ERR_NOMEM;
        return r;
    }
    if (c->type != MOE_JSON_ARR) { chat_fail(o, "message %d: %s must be a string or a list of parts", idx, key); return NULL; }
    for (const moe__json *p = c->child; p; p = p->next) {
        const char *type = jstr(p, "type"), *text = jstr(p, "text");
        if (!type || strcmp(type, "text") || !text) {
            chat_fail(o, "message %d: only text parts are supported (got %s)", idx, type ? type : "a part without a type");
            free(sb_take(b));
            return NULL;
        }
        sb_printf(b, "%s", text);
    }
    return chat_take(o);
}

/* Python str.strip() */
static void py_strip(const char *s, size_t *a, size_t *e) {
    size_t i = 0, n = strlen(s);
    uint32_t cp;
    for (;;) {
        int k = i < n ? utf8_decode((const unsigned char *)s + i, n - i, &cp) : 0;
        if (!k || !py_isspace(cp)) break;
        i += (size_t)k;
    }
    size_t j = n;
    while (j > i) {
        size_t k = j - 1;
        while (k > i && ((unsigned char)s[k] & 0xC0) == 0x80) k--;
        if (utf8_decode((const unsigned char *)s + k, j - k, &cp) != (int)(j - k) || !py_isspace(cp)) break;
        j = k;
    }
    *a = i, *e = j;
}

/* ---- Kimi-Linear / K2 (spec 5.1, template T1) ---- */

static void k2_render(chat_out *o, const moe__json *req, const moe__json *msgs, int add_gen) {
    const moe__json *tools = moe__json_get(req, "tools");
    sbuf *b = &o->sb;
    if (tools && tools->type == MOE_JSON_ARR && tools->n > 0) {
        seg_mark(o, "<|im_system|>");
        seg_text(o, "tool_declare");
        seg_mark(o, "<|im_middle|>");
        sb_printf(b, "\n  # Tools\n  ");
        if (!py_json(b, tools, 0, 1)) o->st = MOE_ERR_NOMEM;
        char *t = chat_take(o);
        seg_text(o, t);
        free(t);
        seg_mark(o, "<|im_end|>");
    }
    const char *first = msgs->child ? jstr(msgs->child, "role") : NULL;
    if (!first || strcmp(first, "system")) {
        seg_mark(o, "<|im_system|>");
        seg_text(o, "system");
        seg_mark(o, "<|im_middle|>");
        seg_text(o, "You are Kimi, an AI assistant created by Moonshot AI.");
        seg_mark(o, "<|im_end|>");
    }
    int idx = 0;
    for (const moe__json *m = msgs->child; m && !o->st; m = m->next, idx++) {
        const char *role = jstr(m, "role"), *name = jstr(m, "name");
        if (!role) { chat_fail(o, "message %d has no role", idx); return; }
        seg_mark(o, !strcmp(role, "user") ? "<|im_user|>" : !strcmp(role, "assistant") ? "<|im_assistant|>" : "<|im_system|>");
        seg_text(o, name && *name ? name : role);
        seg_mark(o, "<|im_middle|>");
        const moe__json *calls = moe__json_get(m, "tool_calls");
        char *content = chat_content(o, m, "content", idx);
        if (!content) return;
        if (!strcmp(role, "assistant") && calls && calls->type == MOE_JSON_ARR && calls->n > 0) {
            seg_text(o, content);
            seg_mark(o, "<|tool_calls_section_begin|>");
            for (const moe__json *c = calls->child; c; c = c->next) {
                const moe__json *fn = moe__json_get(c, "function"), *args = fn ? moe__json_get(fn, "arguments") : NULL;
                const char *id = jstr(c, "id");
                if (!id || !args) { free(content); chat_fail(o, "message %d: a tool call needs an id and function.arguments", idx); return; }
                seg_mark(o, "<|tool_call_begin|>");
                seg_text(o, id);
                seg_mark(o, "<|tool_call_argument_begin|>");
                if (args->type == MOE_JSON_STR) seg_text(o, args->str);
                else {
                    if (!py_json(b, args, 0, 0)) o->st = MOE_ERR_NOMEM;
                    char *t = chat_take(o);
                    seg_text(o, t);
                    free(t);
                }
                seg_mark(o, "<|tool_call_end|>");
            }
            seg_mark(o, "<|tool_calls_section_end|>");
        } else if (!strcmp(role, "tool")) {
            const char *id = jstr(m, "tool_call_id");
            sb_printf(b, "## Return of %s\n    %s", id ? id : "", content);
            char *t = chat_take(o);
            seg_text(o, t);
            free(t);
        } else {
            seg_text(o, content);
        }
        free(content);
        if (add_gen || m->next) seg_mark(o, "<|im_end|>"); /* T1 leaves the last turn open */
    }
    if (add_gen) {
        seg_mark(o, "<|im_assistant|>");
        seg_text(o, "assistant");
        seg_mark(o, "<|im_middle|>");
    }
}

/* ---- K3 XTML (spec 5.3) ---- */

typedef struct {
    const char *key, *value;
} xattr;

static void x_open(chat_out *o, const char *tag, const xattr *a, int na) {
    seg_mark(o, "<|open|>");
    seg_text(o, tag);
    for (int i = 0; i < na; i++) {
        if (!a[i].value) continue;
        sbuf *b = &o->sb;
        sb_printf(b, " %s", a[i].key);
        char *k = chat_take(o);
        seg_text(o, k);
        free(k);
        seg_text(o, "=\"");
        for (const char *v = a[i].value; *v; v++) /* & first, then " */
            sb_printf(b, "%s", *v == '&' ? "&amp;" : *v == '"' ? "&quot;" : (char[2]){*v, 0});
        char *v = chat_take(o);
        seg_text(o, v);
        free(v);
        seg_text(o, "\"");
    }
    seg_mark(o, "<|sep|>");
}

static void x_close(chat_out *o, const char *tag) {
    seg_mark(o, "<|close|>");
    seg_text(o, tag);
    seg_mark(o, "<|sep|>");
}

static void x_message(chat_out *o, const xattr *a, int na, const char *body) {
    x_open(o, "message", a, na);
    seg_text(o, body);
    x_close(o, "message");
    seg_mark(o, "<|end_of_msg|>");
}

static void x_note(chat_out *o, const char *type, const char *body) {
    size_t s, e;
    if (!body) return;
    py_strip(body, &s, &e);
    char *t = strndup(body + s, e - s);
    if (!t) { o->st = MOE_ERR_NOMEM; return; }
    x_message(o, (xattr[]){{"role", "system"}, {"type", type}}, 2, t);
    free(t);
}

#define K3_TOOLS_HEAD "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
#define K3_DYN_TOOLS_HEAD                                                                                                    \
    "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\nYou have access to all existing " \
    "and extended tools.\nHere are the specs for the extended tools.\n\n```json\n"
#define K3_TOOLS_TAIL "\n```"
#define K3_EFFORT_HEAD                                                                                                      \
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), "       \
    "supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort="
#define K3_EFFORT_TAIL "`."
#define K3_RF_HEAD                                                                                                           \
    "The system is invoked with `response_format=json_object`.\nYour response must be raw JSON data without markdown code " \
    "blocks (```json) or any additional formatting."
#define K3_RF_SCHEMA_HEAD                                                                                                   \
    "The system is invoked with `response_format=json_schema`.\nYour response must be raw JSON data without markdown code " \
    "blocks (```json) or any additional formatting.\nThe JSON data must match the following schema:\n```json\n"

static void x_tools_message(chat_out *o, const char *head, const moe__json *tools) {
    sbuf *b = &o->sb;
    sb_printf(b, "%s", head);
    if (!py_json(b, tools, 1, 1)) o->st = MOE_ERR_NOMEM;
    sb_printf(b, K3_TOOLS_TAIL);
    char *t = chat_take(o);
    x_message(o, (xattr[]){{"role", "system"}, {"type", "tool-declare"}}, 2, t);
    free(t);
}

/* Name of the k-th (0-based) call of an assistant message, or NULL. */
static const char *call_name(const moe__json *calls, int k) {
    for (const moe__json *c = calls ? calls->child : NULL; c; c = c->next, k--)
        if (!k) return jstr(moe__json_get(c, "function"), "name");
    return NULL;
}

static int call_position(const moe__json *calls, const char *id) {
    int k = 0;
    for (const moe__json *c = calls ? calls->child : NULL; c; c = c->next, k++) {
        const char *cid = jstr(c, "id");
        if (id && cid && !strcmp(cid, id)) return k;
    }
    return -1;
}

static void x_assistant(chat_out *o, const moe__json *m, int idx, int thinking) {
    const char *name = jstr(m, "name");
    x_open(o, "message", (xattr[]){{"role", "assistant"}, {"name", name && *name ? name : NULL}}, 2);
    if (thinking) {
        x_open(o, "think", NULL, 0);
        const char *r = jstr(m, "reasoning_content");
        if (!r) r = jstr(m, "reasoning");
        size_t s = 0, e = 0;
        if (r) py_strip(r, &s, &e);
        if (r && e > s) seg_text(o, r); /* whitespace-only reasoning is omitted */
        x_close(o, "think");
    }
    char *content = chat_content(o, m, "content", idx);
    if (!content) return;
    x_open(o, "response", NULL, 0);
    seg_text(o, content);
    x_close(o, "response");
    free(content);
    const moe__json *calls = moe__json_get(m, "tool_calls");
    if (calls && calls->type == MOE_JSON_ARR && calls->n > 0) {
        x_open(o, "tools", NULL, 0);
        int k = 1;
        for (const moe__json *c = calls->child; c && !o->st; c = c->next, k++) {
            const moe__json *fn = moe__json_get(c, "function"), *args = fn ? moe__json_get(fn, "arguments") : NULL;
            const char *fname = jstr(fn, "name");
            if (!fname) { chat_fail(o, "message %d: tool call %d has no function.name", idx, k); return; }
            char index[16];
            snprintf(index, sizeof index, "%d", k);
            x_open(o, "call", (xattr[]){{"tool", fname}, {"index", index}}, 2);
            moe__json *parsed = NULL;
            const moe__json *obj = args;
            if (args && args->type == MOE_JSON_STR) {
                obj = NULL;
                if (moe__json_parse(args->str, strlen(args->str), &parsed, NULL, 0) == MOE_OK) obj = parsed;
            }
            if (args && !obj) { /* unparseable argument text is kept raw */
                x_open(o, "json", (xattr[]){{"type", "object"}}, 1);
                seg_text(o, args->str);
                x_close(o, "json");
            } else if (obj && obj->type != MOE_JSON_OBJ) {
                chat_fail(o, "message %d: tool call %d: arguments must be a JSON object", idx, k);
            } else {
                for (const moe__json *a = obj ? obj->child : NULL; a; a = a->next) {
                    static const char *types[] = {"null", "boolean", "number", "string", "array", "object"};
                    x_open(o, "argument", (xattr[]){{"key", a->key}, {"type", types[a->type]}}, 2);
                    if (a->type == MOE_JSON_STR) seg_text(o, a->str);
                    else {
                        if (!py_json(&o->sb, a, 0, 0)) o->st = MOE_ERR_NOMEM;
                        char *t = chat_take(o);
                        seg_text(o, t);
                        free(t);
                    }
                    x_close(o, "argument");
                }
            }
            moe__json_free(parsed);
            x_close(o, "call");
        }
        x_close(o, "tools");
    }
    x_close(o, "message");
    seg_mark(o, "<|end_of_msg|>");
}

static void k3_render(chat_out *o, const moe__json *req, const moe__json *msgs, const moe_chat_options *opt) {
    const moe__json *tools = moe__json_get(req, "tools");
    if (tools && tools->type == MOE_JSON_ARR && tools->n > 0) x_tools_message(o, K3_TOOLS_HEAD, tools);
    if (opt->thinking) {
        const char *effort = opt->thinking_effort ? opt->thinking_effort : "max";
        if (strcmp(effort, "low") && strcmp(effort, "high") && strcmp(effort, "max")) {
            chat_fail(o, "thinking_effort must be low, high or max (got %s)", effort);
            return;
        }
        sb_printf(&o->sb, K3_EFFORT_HEAD "%s" K3_EFFORT_TAIL, effort);
        char *t = chat_take(o);
        x_note(o, "thinking-effort", t);
        free(t);
    }
    /* each run of tool messages answers the assistant message before it */
    const moe__json *calls = NULL, *m = msgs->child;
    int idx = 0;
    while (m && !o->st) {
        const char *role = jstr(m, "role");
        if (!role) { chat_fail(o, "message %d has no role", idx); return; }
        if (!strcmp(role, "tool")) {
            /* the run: reorder into call order when every tool_call_id matches a call */
            const moe__json *run[256];
            int nr = 0, matched = 1;
            for (const moe__json *r = m; r; r = r->next) {
                const char *rr = jstr(r, "role");
                if (!rr || strcmp(rr, "tool")) break;
                if (nr == 256) { chat_fail(o, "message %d: more than 256 tool results in a row", idx); return; }
                run[nr++] = r;
                matched &= call_position(calls, jstr(r, "tool_call_id")) >= 0;
            }
            if (matched)
                for (int i = 1; i < nr; i++) /* insertion sort by call position: stable, tiny */
                    for (int j = i; j > 0 && call_position(calls, jstr(run[j], "tool_call_id")) <
                                                  call_position(calls, jstr(run[j - 1], "tool_call_id")); j--) {
                        const moe__json *t = run[j];
                        run[j] = run[j - 1], run[j - 1] = t;
                    }
            for (int i = 0; i < nr && !o->st; i++) {
                const moe__json *r = run[i];
                const char *tool = jstr(r, "tool");
                if (!tool && matched) tool = call_name(calls, call_position(calls, jstr(r, "tool_call_id")));
                if (!tool) tool = jstr(r, "name");
                if (!tool) tool = call_name(calls, i);
                char index[16];
                snprintf(index, sizeof index, "%d", i + 1);
                char *content = chat_content(o, r, "content", idx + i);
                if (!content) return;
                x_message(o, (xattr[]){{"role", "tool"}, {"tool", tool}, {"index", index}}, 3, content);
                free(content);
            }
            for (int i = 0; i < nr; i++) m = m->next, idx++;
            continue;
        }
        if (!strcmp(role, "assistant")) {
            x_assistant(o, m, idx, opt->thinking);
            calls = moe__json_get(m, "tool_calls");
        } else if (!strcmp(role, "user") || !strcmp(role, "system")) {
            const moe__json *mt = moe__json_get(m, "tools");
            if (!strcmp(role, "system") && mt) {
                if (mt->type != MOE_JSON_ARR) { chat_fail(o, "message %d: tools must be a list", idx); return; }
                x_tools_message(o, K3_DYN_TOOLS_HEAD, mt);
            } else {
                const char *name = jstr(m, "name");
                char *content = chat_content(o, m, "content", idx);
                if (!content) return;
                x_message(o, (xattr[]){{"role", role}, {"name", name && *name ? name : NULL}}, 2, content);
                free(content);
            }
        } else {
            chat_fail(o, "message %d: unknown role %s", idx, role);
            return;
        }
        m = m->next, idx++;
    }
    const moe__json *tc = moe__json_get(req, "tool_choice");
    if (tc && tc->type == MOE_JSON_STR && !strcmp(tc->str, "required"))
        x_note(o, "tool-choice", "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.");
    else if (tc && tc->type == MOE_JSON_STR && !strcmp(tc->str, "none"))
        x_note(o, "tool-choice", "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.");
    const moe__json *rf = moe__json_get(req, "response_format");
    const char *rft = jstr(rf, "type");
    if (rft && !strcmp(rft, "json_object")) x_note(o, "response-format", K3_RF_HEAD);
    else if (rft && !strcmp(rft, "json_schema")) {
        const moe__json *js = moe__json_get(rf, "json_schema"), *schema = moe__json_get(req, "response_schema");
        if (!schema && js) schema = moe__json_get(js, "schema");
        if (!schema && js) schema = moe__json_get(js, "json_schema");
        if (!schema) schema = js;
        if (!schema) { chat_fail(o, "response_format json_schema without a schema"); return; }
        sb_printf(&o->sb, K3_RF_SCHEMA_HEAD);
        if (!py_json(&o->sb, schema, 1, 1)) o->st = MOE_ERR_NOMEM;
        sb_printf(&o->sb, K3_TOOLS_TAIL);
        char *t = chat_take(o);
        x_note(o, "response-format", t);
        free(t);
    }
    if (opt->add_generation_prompt) {
        x_open(o, "message", (xattr[]){{"role", "assistant"}}, 1);
        x_open(o, opt->thinking ? "think" : "response", NULL, 0);
    }
}

moe_chat_options moe_chat_default_options(void) {
    moe_chat_options o = {0};
    o.add_generation_prompt = 1;
    o.thinking = 1;
    return o;
}

int moe_chat_format_of(const moe_tokenizer *t) {
    if (moe_token_id(t, "<|open|>") >= 0 && moe_token_id(t, "<|end_of_msg|>") >= 0) return MOE_CHAT_K3;
    if (moe_token_id(t, "<|im_user|>") >= 0 && moe_token_id(t, "<|im_end|>") >= 0) return MOE_CHAT_K2;
    return -1;
}

static void chat_free(chat_out *o) {
    for (int i = 0; i < o->n; i++) free(o->seg[i].text);
    free(o->seg);
    free(o->sb.s);
}

/* Builds the segments of a parsed request. */
static moe_status chat_build_tree(chat_out *o, const moe_tokenizer *t, const moe__json *req, const moe_chat_options *opt, int *format) {
    moe_chat_options d = moe_chat_default_options();
    if (!opt) opt = &d;
    if (!t || !req) return chat_fail(o, "bad argument");
    int f = opt->format ? opt->format : moe_chat_format_of(t);
    if (f != MOE_CHAT_K2 && f != MOE_CHAT_K3) return chat_fail(o, "the vocabulary has no chat markers (<|im_user|> or <|open|>)");
    *format = f;
    const moe__json *msgs = req->type == MOE_JSON_OBJ ? moe__json_get(req, "messages") : req->type == MOE_JSON_ARR ? req : NULL;
    if (!msgs || msgs->type != MOE_JSON_ARR) return chat_fail(o, "request needs a \"messages\" list");
    for (const moe__json *m = msgs->child; m; m = m->next)
        if (m->type != MOE_JSON_OBJ) return chat_fail(o, "every message must be an object");
    if (f == MOE_CHAT_K2) k2_render(o, req->type == MOE_JSON_OBJ ? req : NULL, msgs, opt->add_generation_prompt);
    else k3_render(o, req->type == MOE_JSON_OBJ ? req : NULL, msgs, opt);
    return o->st;
}

/* Parses the request text and builds the segments. */
static moe_status chat_build(chat_out *o, const moe_tokenizer *t, const char *json, size_t len, const moe_chat_options *opt, int *format) {
    if (!t || !json) return chat_fail(o, "bad argument");
    if (len != moe_utf8_valid_prefix(json, len)) return chat_fail(o, "request is not valid UTF-8");
    moe__json *req = NULL;
    char e2[200];
    if (moe__json_parse(json, len, &req, e2, sizeof e2)) return chat_fail(o, "request: %s", e2);
    chat_build_tree(o, t, req, opt, format);
    moe__json_free(req);
    return o->st;
}

moe_status moe_chat_render(const moe_tokenizer *t, const char *json, size_t len, const moe_chat_options *opt, char *text, size_t cap,
                           size_t *text_len, char *err, size_t errlen) {
    chat_out o = {0};
    o.err = err, o.errlen = errlen;
    int format;
    if (text_len) *text_len = 0;
    if ((!text && cap) || !text_len) return fail(err, errlen, MOE_ERR_ARG, "moe_chat_render: bad argument");
    moe_status st = chat_build(&o, t, json, len, opt, &format);
    size_t n = 0;
    for (int i = 0; !st && i < o.n; i++) {
        if (n + o.seg[i].len < cap) memcpy(text + n, o.seg[i].text, o.seg[i].len);
        n += o.seg[i].len;
    }
    if (!st) {
        *text_len = n;
        if (n < cap) text[n] = 0;
        else st = fail(err, errlen, MOE_ERR_RANGE, "moe_chat_render: %zu bytes, room for %zu", n + 1, cap);
    }
    if (st == MOE_ERR_NOMEM) fail(err, errlen, st, "chat: out of memory");
    chat_free(&o);
    return st;
}

/* Encodes built segments (see moe_chat_encode); frees them. */
static moe_status chat_encode_segments(chat_out *o, moe_status st, int format, const moe_tokenizer *t, const moe_chat_options *opt,
                                       int32_t *ids, size_t cap, size_t *n_ids, char *err, size_t errlen) {
    size_t n = 0;
    if (!st && format == MOE_CHAT_K2 && !(opt && opt->safe)) {
        /* the vendor path: the rendered string encoded as a whole, specials allowed */
        size_t total = 0, k = 0;
        for (int i = 0; i < o->n; i++) total += o->seg[i].len;
        char *all = malloc(total + 1);
        if (!all) st = MOE_ERR_NOMEM;
        for (int i = 0; all && i < o->n; i++) memcpy(all + k, o->seg[i].text, o->seg[i].len), k += o->seg[i].len;
        if (all) st = moe_tokenize(t, all, total, MOE_TOK_SPECIAL, ids, cap, &n, err, errlen);
        free(all);
    } else {
        for (int i = 0; !st && i < o->n; i++) {
            size_t got = 0;
            st = moe_tokenize(t, o->seg[i].text, o->seg[i].len, o->seg[i].control ? MOE_TOK_SPECIAL : 0, ids ? ids + (n < cap ? n : cap) : NULL,
                              n < cap ? cap - n : 0, &got, err, errlen);
            if (st == MOE_ERR_RANGE) st = MOE_OK; /* keep counting */
            if (!st && o->seg[i].control && (got != 1 || !moe_token_is_special(t, ids && n < cap ? ids[n] : -1)) && n < cap)
                st = fail(err, errlen, MOE_ERR_FORMAT, "chat: the vocabulary has no token %s", o->seg[i].text);
            n += got;
        }
        if (!st && n > cap) st = fail(err, errlen, MOE_ERR_RANGE, "moe_chat_encode: %zu ids, room for %zu", n, cap);
    }
    *n_ids = n;
    if (st == MOE_ERR_NOMEM) fail(err, errlen, st, "chat: out of memory");
    chat_free(o);
    return st;
}

moe_status moe_chat_encode(const moe_tokenizer *t, const char *json, size_t len, const moe_chat_options *opt, int32_t *ids, size_t cap,
                           size_t *n_ids, char *err, size_t errlen) {
    chat_out o = {0};
    o.err = err, o.errlen = errlen;
    int format = 0;
    if (n_ids) *n_ids = 0;
    if ((!ids && cap) || !n_ids) return fail(err, errlen, MOE_ERR_ARG, "moe_chat_encode: bad argument");
    moe_status st = chat_build(&o, t, json, len, opt, &format);
    return chat_encode_segments(&o, st, format, t, opt, ids, cap, n_ids, err, errlen);
}

moe_status moe__chat_encode_tree(const moe_tokenizer *t, const moe__json *req, const moe_chat_options *opt, int32_t *ids, size_t cap,
                                 size_t *n_ids, char *err, size_t errlen) {
    chat_out o = {0};
    o.err = err, o.errlen = errlen;
    int format = 0;
    if (n_ids) *n_ids = 0;
    if ((!ids && cap) || !n_ids) return fail(err, errlen, MOE_ERR_ARG, "moe_chat_encode: bad argument");
    moe_status st = chat_build_tree(&o, t, req, opt, &format);
    return chat_encode_segments(&o, st, format, t, opt, ids, cap, n_ids, err, errlen);
}

/* ---- model replies: which channel each generated token belongs to (spec 5.3.4) ---- */

void moe_chat_reply_init(moe_chat_reply *r, const moe_tokenizer *t, const moe_chat_options *opt) {
    memset(r, 0, sizeof *r);
    moe_chat_options d = moe_chat_default_options();
    if (!opt) opt = &d;
    r->format = opt->format ? opt->format : t ? moe_chat_format_of(t) : -1;
    r->channel = r->format == MOE_CHAT_K3 && opt->thinking ? MOE_REPLY_REASONING : MOE_REPLY_CONTENT;
    r->open = moe_token_id(t, "<|open|>"), r->close = moe_token_id(t, "<|close|>"), r->sep = moe_token_id(t, "<|sep|>");
    r->tools = moe_token_id(t, "<|tool_calls_section_begin|>");
    r->end[0] = moe_token_id(t, r->format == MOE_CHAT_K3 ? "<|end_of_msg|>" : "<|im_end|>");
    r->end[1] = moe_token_id(t, "[EOS]");
}

int moe_chat_reply_token(moe_chat_reply *r, const moe_tokenizer *t, int32_t id) {
    if (r->ended || id == r->end[0] || id == r->end[1]) {
        r->ended = 1;
        return MOE_REPLY_END;
    }
    if (r->format == MOE_CHAT_K3) {
        if (id == r->open || id == r->close) {
            r->in_tag = 1, r->closing = id == r->close, r->tag_len = 0;
            return MOE_REPLY_HIDDEN;
        }
        if (r->in_tag) {
            size_t n;
            const char *b = id == r->sep ? NULL : moe_token_bytes(t, id, &n);
            if (id != r->sep) {
                for (size_t i = 0; b && i < n && r->tag_len + 1 < sizeof r->tag; i++) r->tag[r->tag_len++] = b[i];
                return MOE_REPLY_HIDDEN;
            }
            r->tag[r->tag_len] = 0, r->in_tag = 0;
            /* the tag name is the first word of the header */
            char *sp = strchr(r->tag, ' ');
            if (sp) *sp = 0;
            if (!strcmp(r->tag, "think")) r->channel = r->closing ? MOE_REPLY_HIDDEN : MOE_REPLY_REASONING;
            else if (!strcmp(r->tag, "response")) r->channel = r->closing ? MOE_REPLY_HIDDEN : MOE_REPLY_CONTENT;
            else if (!r->closing) r->channel = MOE_REPLY_HIDDEN; /* tools, calls, arguments: not shown as text */
            return MOE_REPLY_HIDDEN;
        }
    } else if (id == r->tools) {
        r->channel = MOE_REPLY_HIDDEN; /* a K2 tool-call section runs to the end of the turn */
    }
    if (moe_token_is_special(t, id)) return MOE_REPLY_HIDDEN;
    return r->channel;
}

/* ---- tool calls in a finished reply (spec 5.1 K2 output, 5.3.4 K3 output) ---- */

/* the value of attribute key in an XTML tag header ("call tool=\"f\" index=\"1\""), unescaped
 * (&quot; before &amp;); 0 when absent */
static int xtml_attr(const char *hdr, const char *key, char *out, size_t n) {
    size_t kl = strlen(key);
    for (const char *p = strchr(hdr, ' '); p; p = strchr(p + 1, ' ')) {
        if (strncmp(p + 1, key, kl) || p[1 + kl] != '=' || p[2 + kl] != '"') continue;
        const char *v = p + 3 + kl, *e = strchr(v, '"');
        if (!e) return 0;
        size_t o = 0;
        for (const char *q = v; q < e && o + 1 < n;) {
            if (!strncmp(q, "&quot;", 6)) out[o++] = '"', q += 6;
            else if (!strncmp(q, "&amp;", 5)) out[o++] = '&', q += 5;
            else out[o++] = *q++;
        }
        out[o] = 0;
        return 1;
    }
    return 0;
}

/* appends one OpenAI tool call {"id", "type": "function", "function": {"name", "arguments"}} */
static void tool_call_json(sbuf *out, int first, const char *id, const char *name, const char *args) {
    sb_printf(out, "%s{\"id\": ", first ? "" : ", ");
    py_str(out, id);
    sb_printf(out, ", \"type\": \"function\", \"function\": {\"name\": ");
    py_str(out, name);
    sb_printf(out, ", \"arguments\": ");
    py_str(out, args);
    sb_printf(out, "}}");
}

/* empties b (an empty string, not NULL); a failed append stays recorded */
static void sb_reset(sbuf *b) {
    const int oom = b->oom;
    free(b->s);
    *b = (sbuf){0};
    sb_printf(b, "%s", "");
    b->oom |= oom;
}

moe_status moe_chat_tool_calls(const moe_tokenizer *t, const int32_t *ids, size_t n, const moe_chat_options *opt, char *json, size_t cap,
                               size_t *len, char *err, size_t errlen) {
    if (len) *len = 0;
    if (!t || (!ids && n) || (!json && cap) || !len) return fail(err, errlen, MOE_ERR_ARG, "moe_chat_tool_calls: bad argument");
    const int format = opt && opt->format ? opt->format : moe_chat_format_of(t);
    sbuf out = {0}, cur = {0}, hdr = {0}, args = {0};
    int calls = 0;
    sb_printf(&out, "[");
    if (format == MOE_CHAT_K3) {
        const int32_t open = moe_token_id(t, "<|open|>"), close = moe_token_id(t, "<|close|>"), sep = moe_token_id(t, "<|sep|>");
        int in_hdr = 0, closing = 0, in_call = 0, in_arg = 0;
        char name[256] = "", akey[256] = "", atype[32] = "";
        for (size_t i = 0; i < n; i++) {
            const int32_t id = ids[i];
            if (id == open || id == close) {
                in_hdr = 1, closing = id == close;
                sb_reset(&hdr);
                continue;
            }
            if (id == sep && in_hdr) {
                in_hdr = 0;
                const char *h = hdr.s ? hdr.s : "";
                size_t tl = strcspn(h, " ");
                if (!closing && tl == 4 && !strncmp(h, "call", 4)) {
                    in_call = 1;
                    if (!xtml_attr(h, "tool", name, sizeof name)) name[0] = 0;
                    sb_reset(&args);
                    sb_printf(&args, "{");
                } else if (!closing && tl == 8 && !strncmp(h, "argument", 8) && in_call) {
                    in_arg = 1;
                    if (!xtml_attr(h, "key", akey, sizeof akey)) akey[0] = 0;
                    if (!xtml_attr(h, "type", atype, sizeof atype)) strcpy(atype, "string");
                    sb_reset(&cur);
                } else if (closing && tl == 8 && !strncmp(h, "argument", 8) && in_arg) {
                    in_arg = 0;
                    if (args.n > 1) sb_printf(&args, ", ");
                    py_str(&args, akey);
                    sb_printf(&args, ": ");
                    if (!strcmp(atype, "string")) py_str(&args, cur.s ? cur.s : "");
                    else sb_printf(&args, "%s", cur.s && *cur.s ? cur.s : "null");
                } else if (closing && tl == 4 && !strncmp(h, "call", 4) && in_call) {
                    in_call = 0;
                    sb_printf(&args, "}");
                    char cid[32];
                    snprintf(cid, sizeof cid, "call_%d", calls + 1);
                    tool_call_json(&out, !calls, cid, name, args.s ? args.s : "{}");
                    calls++;
                }
                continue;
            }
            size_t bl;
            const char *b = moe_token_bytes(t, id, &bl);
            if (!b || moe_token_is_special(t, id)) continue;
            sbuf *dst = in_hdr ? &hdr : in_arg ? &cur : NULL;
            if (dst) sb_printf(dst, "%.*s", (int)bl, b);
        }
    } else if (format == MOE_CHAT_K2) {
        const int32_t begin = moe_token_id(t, "<|tool_call_begin|>"), argb = moe_token_id(t, "<|tool_call_argument_begin|>"),
                      end = moe_token_id(t, "<|tool_call_end|>");
        int part = 0; /* 1: in the call id, 2: in the arguments */
        for (size_t i = 0; i < n; i++) {
            const int32_t id = ids[i];
            if (id == begin) { part = 1; sb_reset(&hdr); continue; }
            if (id == argb && part == 1) { part = 2; sb_reset(&args); continue; }
            if (id == end && part == 2) {
                part = 0;
                const char *cid = hdr.s ? hdr.s : "", *dot = strchr(cid, '.'), *colon = strrchr(cid, ':');
                char name[256] = "";
                if (dot && colon && colon > dot) snprintf(name, sizeof name, "%.*s", (int)(colon - dot - 1), dot + 1);
                tool_call_json(&out, !calls, cid, name, args.s ? args.s : "");
                calls++;
                continue;
            }
            size_t bl;
            const char *b = moe_token_bytes(t, id, &bl);
            if (!b || moe_token_is_special(t, id) || !part) continue;
            sb_printf(part == 1 ? &hdr : &args, "%.*s", (int)bl, b);
        }
    }
    sb_printf(&out, "]");
    moe_status st = out.oom || cur.oom || hdr.oom || args.oom ? fail(err, errlen, MOE_ERR_NOMEM, "moe_chat_tool_calls: out of memory") : MOE_OK;
    if (!st) {
        *len = out.n;
        if (out.n < cap) memcpy(json, out.s, out.n + 1);
        else st = fail(err, errlen, MOE_ERR_RANGE, "moe_chat_tool_calls: %zu bytes, room for %zu", out.n + 1, cap);
    }
    free(out.s), free(cur.s), free(hdr.s), free(args.s);
    return st;
}

/* ==== sampling ================================================================================= */

static uint64_t rng_next(uint64_t *s) { /* xorshift64* */
    if (!*s) *s = 0x9E3779B97F4A7C15ull;
    *s ^= *s >> 12, *s ^= *s << 25, *s ^= *s >> 27;
    return *s * 0x2545F4914F6CDD1Dull;
}

typedef struct {
    float p;
    int32_t id;
} cand;

static int32_t sample_from(const float *logits, int n_vocab, const moe_sampler *sp, uint64_t *rng);

/* The candidates' order: logit descending, then id ascending (-0 and +0 equal, NaN last), through
 * an unsigned key that ascends as the logit descends. */
static uint32_t cand_key(float p) {
    if (p != p) return UINT32_MAX;
    if (p == 0) p = 0; /* -0 as +0 */
    uint32_t b;
    memcpy(&b, &p, sizeof b);
    return ~(b & 0x80000000u ? ~b : b | 0x80000000u); /* (the inner form ascends with the float) */
}
static int cand_before(cand a, cand b) {
    const uint32_t ka = cand_key(a.p), kb = cand_key(b.p);
    return ka != kb ? ka < kb : a.id < b.id;
}

/* cs[0..n) = the tokens ids[0..n) (ascending; NULL: 0 .. n-1) in the candidates' order by their
 * logits: a stable radix sort of key << 32 | id made in id order (a byte a pass, passes where
 * every item has the same byte skipped), so equal logits stay in id order. A vocabulary of 65536
 * took ~11 ms a token with qsort. tmp holds 2 n. */
static void cand_sort(const float *logits, const int32_t *ids, int n, cand *cs, uint64_t *tmp) {
    uint64_t *a = tmp, *b = tmp + n;
    int count[4][257];
    memset(count, 0, sizeof count);
    for (int i = 0; i < n; i++) {
        const int32_t id = ids ? ids[i] : i;
        const uint32_t k = cand_key(logits[id]);
        a[i] = (uint64_t)k << 32 | (uint32_t)id;
        for (int d = 0; d < 4; d++) count[d][(k >> 8 * d & 255) + 1]++;
    }
    for (int d = 0; d < 4 && n > 0; d++) {
        int *c = count[d];
        if (c[(a[0] >> (32 + 8 * d) & 255) + 1] == n) continue; /* one bucket: already in order */
        for (int v = 0; v < 256; v++) c[v + 1] += c[v];
        for (int i = 0; i < n; i++) b[c[a[i] >> (32 + 8 * d) & 255]++] = a[i];
        uint64_t *t = a;
        a = b, b = t;
    }
    for (int i = 0; i < n; i++) cs[i] = (cand){logits[(uint32_t)a[i]], (int32_t)(uint32_t)a[i]};
}

/* the first k of logits[0..n) in the candidates' order into cs[0..k), for k small against n: a
 * sorted list that a candidate joins only when it beats the last */
static void cand_top(const float *logits, int n, int k, cand *cs) {
    int have = 0;
    float last = 0; /* cs[k - 1]'s logit once the list is full: a later id must exceed it */
    for (int i = 0; i < n; i++) {
        const cand c = {logits[i], i};
        if (have == k && !(c.p > last) && last == last) continue; /* (a NaN last: the full test) */
        if (have == k && !cand_before(c, cs[k - 1])) continue;
        int j = have < k ? have++ : k - 1;
        for (; j > 0 && cand_before(c, cs[j - 1]); j--) cs[j] = cs[j - 1];
        cs[j] = c;
        if (have == k) last = cs[k - 1].p;
    }
}

int32_t moe_sample(const float *logits, int n_vocab, const moe_sampler *sp, uint64_t *rng) {
    if (!logits || n_vocab <= 0) return -1;
    float *pen = NULL; /* penalised copy of the logits, when a penalty applies */
    if (sp && sp->recent && sp->n_recent > 0 &&
        ((sp->repeat_penalty != 0 && sp->repeat_penalty != 1) || sp->presence_penalty != 0 || sp->frequency_penalty != 0) &&
        (pen = malloc(sizeof *pen * (size_t)n_vocab))) {
        memcpy(pen, logits, sizeof *pen * (size_t)n_vocab);
        for (int i = 0; i < sp->n_recent; i++) {
            const int32_t t = sp->recent[i];
            int seen = 0, count = 0;
            if (t < 0 || t >= n_vocab) continue;
            for (int j = 0; j < sp->n_recent; j++) {
                seen |= j < i && sp->recent[j] == t;
                count += sp->recent[j] == t;
            }
            if (seen) continue; /* each distinct token once */
            float *l = &pen[t];
            if (sp->repeat_penalty != 0 && sp->repeat_penalty != 1) *l = *l > 0 ? *l / sp->repeat_penalty : *l * sp->repeat_penalty;
            *l -= sp->presence_penalty + sp->frequency_penalty * (float)count;
        }
        logits = pen;
    }
    int32_t r = sample_from(logits, n_vocab, sp, rng);
    free(pen);
    return r;
}

/* p[i] = token i's probability at the sampler's temperature: exp of its logit less the largest,
 * over their sum in id order; returns the best token's */
static float token_probs(const float *logits, int n, const moe_sampler *sp, float *p) {
    double mx = -INFINITY, sum = 0;
    for (int i = 0; i < n; i++)
        if (logits[i] > mx) mx = logits[i];
    for (int i = 0; i < n; i++) sum += p[i] = (float)exp((logits[i] - mx) / sp->temperature);
    float top = 0;
    for (int i = 0; i < n; i++) {
        p[i] = (float)(p[i] / sum);
        if (p[i] > top) top = p[i];
    }
    return top;
}

/* whether min-p keeps a token of probability p, the best one's being top (the best always stays) */
static int min_p_keeps(const moe_sampler *sp, float p, float top) {
    return !(sp->min_p > 0) || p >= (sp->min_p < 1 ? sp->min_p * top : top);
}

/* a draw from cs[0..n), n >= 1, in their order: the first whose running sum passes u in [0, sum) */
static int32_t draw_from(const cand *cs, int n, uint64_t *rng) {
    double sum = 0, acc = 0;
    for (int i = 0; i < n; i++) sum += cs[i].p;
    const double u = (double)(rng_next(rng) >> 11) / 9007199254740992.0 * sum;
    for (int i = 0; i < n; i++) {
        acc += cs[i].p;
        if (u < acc) return cs[i].id;
    }
    return cs[n - 1].id; /* rounding left u past the end */
}

/* A draw from every token, none cut by rank (top-k) or by the mass before it (top-p): the walk
 * over [0, sum) goes in id order, since any fixed order gives each token its share, so nothing is
 * sorted (sorting 65,536 logits took half of such a draw, ~1 ms). min-p keeps the tokens at or
 * above min_p times the best one's probability, wherever they lie. */
static int32_t sample_all(const float *logits, int n, const moe_sampler *sp, uint64_t *rng) {
    float *p = malloc(sizeof *p * (size_t)n);
    if (!p) return sample_from(logits, n, NULL, NULL); /* no memory: greedy rather than fail the caller */
    const float top = token_probs(logits, n, sp, p);
    int32_t pick = n - 1; /* the last token kept, where rounding leaves u past the end */
    double kept = 0;
    for (int i = 0; i < n; i++)
        if (!min_p_keeps(sp, p[i], top)) p[i] = 0; /* a zero share is never drawn */
        else kept += p[i], pick = i;
    const double u = (double)(rng_next(rng) >> 11) / 9007199254740992.0 * kept;
    double acc = 0;
    for (int i = 0; i < n; i++) {
        acc += p[i];
        if (u < acc) { pick = i; break; }
    }
    free(p);
    return pick;
}

/* Top-p without top-k: the nucleus is the fewest tokens, best first, whose probabilities reach
 * top_p, so only the tokens that may be in it are sorted. A pass sums the probabilities by the
 * top 12 bits of their floats (buckets in the order of the values; 1.0 is in bucket 1016); the
 * tokens of the buckets from the top down to the one where that sum reaches top_p are sorted and
 * walked. Where rounding leaves their sum short of top_p, every token min-p keeps is sorted. */
#define NUCLEUS_BUCKETS 1024
static int nucleus_bucket(float p) {
    uint32_t bits;
    memcpy(&bits, &p, sizeof bits);
    return (int)(bits >> 20 & (NUCLEUS_BUCKETS - 1));
}
static int32_t sample_nucleus(const float *logits, int n, const moe_sampler *sp, uint64_t *rng) {
    float *p = malloc((sizeof *p + sizeof(int32_t) + sizeof(cand) + 2 * sizeof(uint64_t)) * (size_t)n);
    if (!p) return sample_from(logits, n, NULL, NULL); /* no memory: greedy rather than fail the caller */
    int32_t *ids = (int32_t *)(void *)(p + n);
    cand *cs = (cand *)(void *)(ids + n);
    uint64_t *tmp = (uint64_t *)(void *)(cs + n);
    const float top = token_probs(logits, n, sp, p);
    double mass[NUCLEUS_BUCKETS] = {0};
    for (int i = 0; i < n; i++)
        if (min_p_keeps(sp, p[i], top)) mass[nucleus_bucket(p[i])] += p[i];
    int lo = NUCLEUS_BUCKETS - 1; /* the lowest bucket sorted */
    for (double acc = mass[lo]; lo > 0 && acc < sp->top_p;) acc += mass[--lo];
    int m, k;
    for (;;) {
        m = 0;
        for (int i = 0; i < n; i++)
            if (min_p_keeps(sp, p[i], top) && nucleus_bucket(p[i]) >= lo) ids[m++] = i;
        cand_sort(logits, ids, m, cs, tmp);
        double acc = 0;
        for (k = 0; k < m && acc < sp->top_p; k++) acc += cs[k].p = p[cs[k].id];
        if (acc >= sp->top_p || lo == 0) break;
        lo = 0;
    }
    const int32_t pick = k ? draw_from(cs, k, rng) : (int32_t)(n - 1);
    free(p);
    return pick;
}

static int32_t sample_from(const float *logits, int n_vocab, const moe_sampler *sp, uint64_t *rng) {
    int32_t best = 0; /* the greedy pick: the first largest logit */
    if (!sp || !(sp->temperature > 0) || !rng) {
        float top = logits[0];
        for (int i = 1; i < n_vocab; i++)
            if (logits[i] > top) top = logits[i], best = i;
        return best;
    }
    if (!(sp->top_k > 0 && sp->top_k < n_vocab))
        return sp->top_p > 0 && sp->top_p < 1 ? sample_nucleus(logits, n_vocab, sp, rng) : sample_all(logits, n_vocab, sp, rng);
    /* top-k: the k best in order (picked in one pass where k is small, else every token sorted),
     * their probabilities over their own sum */
    int n = sp->top_k;
    const int few = n <= 256;
    cand *cs = malloc(few ? sizeof *cs * (size_t)n : (sizeof *cs + 2 * sizeof(uint64_t)) * (size_t)n_vocab);
    if (!cs) return sample_from(logits, n_vocab, NULL, NULL); /* no memory: greedy rather than fail the caller */
    if (few) cand_top(logits, n_vocab, n, cs);
    else cand_sort(logits, NULL, n_vocab, cs, (uint64_t *)(void *)(cs + n_vocab));
    double mx = cs[0].p, sum = 0;
    for (int i = 0; i < n; i++) sum += cs[i].p = (float)exp((cs[i].p - mx) / sp->temperature);
    for (int i = 0; i < n; i++) cs[i].p = (float)(cs[i].p / sum);
    if (sp->min_p > 0) {
        int k = 1;
        while (k < n && cs[k].p >= sp->min_p * cs[0].p) k++;
        n = k;
    }
    if (sp->top_p > 0 && sp->top_p < 1) {
        double acc = 0;
        int k = 0;
        while (k < n && acc < sp->top_p) acc += cs[k++].p;
        n = k ? k : 1;
    }
    const int32_t pick = draw_from(cs, n, rng);
    free(cs);
    return pick;
}
