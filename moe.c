/* moe.c - the moe runtime: loading Hugging Face checkpoints (safetensors, validated), the
 * forward pass of the Kimi Linear / Kimi K3 family (spec/MODEL.md), sessions, the batched step
 * and sampling. Kernels and number formats live in quant.c; this file owns model logic only.
 * Not here (yet): GGUF, the streaming expert store beyond plain mmap, the tokenizer.
 *
 * Sections in data-flow order: utilities, JSON, safetensors, config, model binding, matmul,
 * norms and activations, KDA, MLA, FFN and MoE, attention residuals, step, sessions, sampling. */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* madvise */
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
#include <sys/stat.h>
#include <pthread.h>
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
    }
    return "unknown status";
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
    return j;
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
    if (!j) return NULL;
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

static moe_status map_file(moe__st_file *f, const char *path, char *err, size_t errlen) {
    memset(f, 0, sizeof *f);
    if (!(f->path = strdup(path))) return MOE_ERR_NOMEM;
    int fd = open(path, O_RDONLY);
    if (fd < 0) {
        moe_status st = fail(err, errlen, MOE_ERR_IO, "%s: %s", path, strerror(errno));
        moe__st_close(f);
        return st;
    }
    struct stat sb;
    if (fstat(fd, &sb) || !S_ISREG(sb.st_mode)) {
        close(fd);
        moe__st_close(f);
        return fail(err, errlen, MOE_ERR_IO, "%s: not a regular file", path);
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
} gcur;

static int g_take(gcur *c, void *out, size_t k) {
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
    {0, 1, 4, MOE_T_F32},  {1, 1, 2, MOE_T_F16},    {2, 32, 18, MOE_T_Q4_0},  {3, 32, 20, -1},
    {6, 32, 22, -1},       {7, 32, 24, -1},         {8, 32, 34, MOE_T_Q8_0},  {9, 32, 36, -1},
    {10, 256, 84, -1},     {11, 256, 110, -1},      {12, 256, 144, -1},       {13, 256, 176, -1},
    {14, 256, 210, -1},    {15, 256, 292, -1},      {24, 1, 1, -1},           {25, 1, 2, -1},
    {26, 1, 4, MOE_T_I32}, {27, 1, 8, -1},          {28, 1, 8, -1},           {30, 1, 2, MOE_T_BF16},
    {39, 32, 17, MOE_T_MXFP4_GGML},
};

static moe_status gguf_parse(moe__st_file *f, char *err, size_t errlen) {
    const char *path = f->path;
    moe_status st = MOE_OK;
    f->is_gguf = 1;
    f->alignment = 32;
    gcur c = {f->map, f->size, 0, 0};
    uint32_t magic = g_u32(&c), version = g_u32(&c);
    uint64_t n_tensors = g_u64(&c), n_kv = g_u64(&c);
    moe__st_tensor **order = NULL;
    if (c.bad || magic != 0x46554747u) { st = fail(err, errlen, MOE_ERR_FORMAT, "%s: not a GGUF file (bad magic)", path); goto out; }
    if (version < 2 || version > 3) { st = fail(err, errlen, MOE_ERR_FORMAT, "%s: GGUF version %u (2 and 3 are read)", path, version); goto out; }
    /* a key/value needs >= 13 bytes, a tensor info >= 24: counts beyond that are lies */
    if (n_kv > (c.n - c.pos) / 13 || n_tensors > (c.n - c.pos) / 24 || n_tensors > (1u << 24)) {
        st = fail(err, errlen, MOE_ERR_FORMAT, "%s: absurd counts (%llu tensors, %llu keys)", path,
                  (unsigned long long)n_tensors, (unsigned long long)n_kv);
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
            if (c.bad || klen > 65535) { st = fail(err, errlen, MOE_ERR_FORMAT, "%s: metadata key %llu truncated or too long", path, (unsigned long long)i); goto out; }
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
            if (c.bad) { st = fail(err, errlen, MOE_ERR_FORMAT, "%s: metadata %.*s: bad type or truncated", path, (int)klen, (const char *)k); goto out; }
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
    if (data_start > f->size) { st = fail(err, errlen, MOE_ERR_FORMAT, "%s: truncated before the tensor data", path); goto out; }
    const uint64_t data_size = f->size - data_start;
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
    float *q_conv, *k_conv, *v_conv; /* [H_k*D, W] */
    float *A_log, *dt_bias, *o_norm; /* [H_k], [H_k*D], [D] */
    moe__weight q_a, q_b, kv_a, kv_b;
    float *q_a_norm, *kv_a_norm;
    /* FFN */
    moe__weight gate, up, down;          /* dense FFN or fused shared experts */
    moe__weight router, lat_down, lat_up;
    float *router_bias, *lat_norm;
    expert *experts; /* [E] */
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
    char *path;
    void **owned; /* weights converted at load */
    int n_owned, cap_owned;
    struct expert_cache *cache; /* CACHE mode */
};

struct moe_session {
    moe_model *m;
    int n_ctx, pos;
    float **kda_state; /* per layer: [H_k, D, D] or NULL */
    float **conv_tail; /* per layer: [W-1, 3*H_k*D] (pre-convolution q,k,v rows) */
    float **mla_cache; /* per layer: [cap, r + d_r] latents c (normalised) and kr */
    int *mla_cap;
};

/* ==== config ==================================================================================
 * Moonshot's field names (spec/MODEL.md section 1), with transformers' aliases as fallbacks.
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
    g->conv_kernel = la ? cint(&c, la, "short_conv_kernel_size", NULL, 4, 1, 64) : 0;
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
 * its Kimi-K3 support (AttnRes, latent MoE, gates): README lists them. Experts are stored merged
 * per layer (ffn_{gate,up,down}_exps, [E, out, in]) and handled by the binder. */

static const char *const name_map[][2] = {
    {"input_layernorm.weight", "attn_norm.weight"},
    {"post_attention_layernorm.weight", "ffn_norm.weight"},
    {"self_attention_res_norm.weight", "attn_res_norm.weight"},
    {"self_attention_res_proj.weight", "attn_res_proj.weight"},
    {"mlp_res_norm.weight", "ffn_res_norm.weight"},
    {"mlp_res_proj.weight", "ffn_res_proj.weight"},
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
};

int moe__hf_to_gguf(const char *hf, char *out, size_t n) {
    for (size_t i = 0; i < sizeof global_map / sizeof *global_map; i++)
        if (!strcmp(hf, global_map[i][0])) return snprintf(out, n, "%s", global_map[i][1]) < (int)n;
    int layer, used = 0;
    if (sscanf(hf, "model.layers.%d.%n", &layer, &used) != 1 || !used) return 0;
    for (size_t i = 0; i < sizeof name_map / sizeof *name_map; i++)
        if (!strcmp(hf + used, name_map[i][0])) return snprintf(out, n, "blk.%d.%s", layer, name_map[i][1]) < (int)n;
    return 0;
}

/* GGUF metadata -> the HF config.json it stands for, then parsed and validated by parse_config:
 * one set of rules for both formats. */
static int64_t gk_int(const moe__st_file *f, const char *arch, const char *suffix, int64_t def) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
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

static double gk_float(const moe__st_file *f, const char *arch, const char *suffix, double def) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    const moe__gguf_kv *kv = moe__gguf_get(f, key);
    if (!kv) return def;
    if (kv->type == MOE_GGUF_F32) { float v; memcpy(&v, kv->data, 4); return v; }
    if (kv->type == MOE_GGUF_F64) { double v; memcpy(&v, kv->data, 8); return v; }
    return (double)gk_int(f, arch, suffix, (int64_t)def);
}

static const moe__st_tensor *gguf_tensor(const moe__st_file *f, const char *fmt, int i) {
    char name[96];
    snprintf(name, sizeof name, fmt, i);
    for (int k = 0; k < f->n_tensors; k++)
        if (!strcmp(f->tensors[k].name, name)) return &f->tensors[k];
    return NULL;
}

typedef struct {
    char *s;
    size_t n, cap;
} sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...) {
    va_list ap;
    for (;;) {
        va_start(ap, fmt);
        int k = vsnprintf(b->s ? b->s + b->n : NULL, b->s ? b->cap - b->n : 0, fmt, ap);
        va_end(ap);
        if (k < 0) return;
        if (b->s && b->n + (size_t)k < b->cap) { b->n += (size_t)k; return; }
        size_t cap = (b->cap + (size_t)k + 1) * 2;
        char *p = realloc(b->s, cap);
        if (!p) { free(b->s); b->s = NULL; b->cap = b->n = 0; return; }
        b->s = p, b->cap = cap;
    }
}

static moe_status gguf_config_json(const moe__st_file *f, moe__json **out, char *err, size_t errlen) {
    const moe__gguf_kv *a = moe__gguf_get(f, "general.architecture");
    char arch[32];
    if (!a || a->type != MOE_GGUF_STRING || a->n >= sizeof arch)
        return fail(err, errlen, MOE_ERR_FORMAT, "%s: general.architecture missing", f->path);
    memcpy(arch, a->data, a->n);
    arch[a->n] = 0;
    if (strcmp(arch, "kimi-linear") && strcmp(arch, "kimi-k3"))
        return fail(err, errlen, MOE_ERR_UNSUPPORTED, "%s: architecture '%s' (kimi-linear and kimi-k3 are supported)", f->path, arch);
    const int64_t L = gk_int(f, arch, "block_count", -1);
    if (L < 1 || L > 4096) return fail(err, errlen, MOE_ERR_FORMAT, "%s: %s.block_count missing or absurd", f->path, arch);
    char key[96];
    snprintf(key, sizeof key, "%s.attention.head_count_kv", arch);
    const moe__gguf_kv *hkv = moe__gguf_get(f, key);
    const moe__st_tensor *emb = gguf_tensor(f, "token_embd.weight", 0);
    int64_t vocab = gk_int(f, arch, "vocab_size", emb && emb->ndim == 2 ? emb->shape[0] : -1);
    int first_kda = -1, first_mla = -1;
    sbuf b = {0};
    sb_printf(&b, "{\"vocab_size\": %lld, \"hidden_size\": %lld, \"num_hidden_layers\": %lld, \"rms_norm_eps\": %.9g,",
              (long long)vocab, (long long)gk_int(f, arch, "embedding_length", -1), (long long)L,
              gk_float(f, arch, "attention.layer_norm_rms_epsilon", -1));
    double situ = gk_float(f, arch, "situ_beta", 0);
    sb_printf(&b, "\"hidden_act\": \"%s\", \"activation_situ_beta\": %.9g, \"activation_situ_linear_beta\": %.9g,",
              situ > 0 ? "situ" : "silu", situ, gk_float(f, arch, "situ_linear_beta", 0));
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
    sb_printf(&b, "], \"num_heads\": %lld, \"head_dim\": %lld, \"short_conv_kernel_size\": %lld",
              (long long)gk_int(f, arch, "kda.head_count", H), (long long)gk_int(f, arch, "kda.head_dim", first_kda < 0 ? 1 : -1),
              (long long)gk_int(f, arch, "ssm.conv_kernel", 4));
    double lb = gk_float(f, arch, "kda.gate_lower_bound", 0);
    if (lb != 0) sb_printf(&b, ", \"gate_lower_bound\": %.9g", lb);
    sb_printf(&b, ", \"use_full_rank_gate\": %s},", first_kda >= 0 && gguf_tensor(f, "blk.%d.attn_gate.weight", first_kda) ? "true" : "false");
    const int64_t dr = gk_int(f, arch, "rope.dimension_count", 0);
    sb_printf(&b, "\"num_attention_heads\": %lld, \"q_lora_rank\": %lld, \"kv_lora_rank\": %lld, \"qk_nope_head_dim\": %lld, "
                  "\"qk_rope_head_dim\": %lld, \"v_head_dim\": %lld, \"mla_use_output_gate\": %s,",
              (long long)H, (long long)gk_int(f, arch, "attention.q_lora_rank", 0), (long long)gk_int(f, arch, "attention.kv_lora_rank", 1),
              (long long)(gk_int(f, arch, "attention.key_length_mla", dr + 1) - dr), (long long)dr,
              (long long)gk_int(f, arch, "attention.value_length_mla", 1),
              first_mla >= 0 && gguf_tensor(f, "blk.%d.attn_gate.weight", first_mla) ? "true" : "false");
    const int64_t E = gk_int(f, arch, "expert_count", 0), gating = gk_int(f, arch, "expert_gating_func", 2);
    sb_printf(&b, "\"intermediate_size\": %lld, \"num_experts\": %lld, \"num_experts_per_token\": %lld, \"num_shared_experts\": %lld, "
                  "\"moe_intermediate_size\": %lld, \"moe_router_activation_func\": \"%s\", \"moe_renormalize\": %s, "
                  "\"routed_scaling_factor\": %.9g, \"num_expert_group\": %lld, \"topk_group\": %lld, \"first_k_dense_replace\": %lld, "
                  "\"moe_layer_freq\": 1,",
              (long long)gk_int(f, arch, "feed_forward_length", 0), (long long)E, (long long)gk_int(f, arch, "expert_used_count", -1),
              (long long)gk_int(f, arch, "expert_shared_count", 0), (long long)gk_int(f, arch, "expert_feed_forward_length", -1),
              gating == 1 ? "softmax" : gating == 2 ? "sigmoid" : "invalid", gk_int(f, arch, "expert_weights_norm", 1) ? "true" : "false",
              gk_float(f, arch, "expert_weights_scale", 1.0), (long long)gk_int(f, arch, "expert_group_count", 1),
              (long long)gk_int(f, arch, "expert_group_used_count", 1), (long long)gk_int(f, arch, "leading_dense_block_count", 0));
    const int64_t lat = gk_int(f, arch, "moe_latent_size", 0);
    if (lat) sb_printf(&b, "\"routed_expert_hidden_size\": %lld, \"latent_moe_use_norm\": %s,", (long long)lat,
                       gguf_tensor(f, "blk.%d.ffn_latent_norm.weight", (int)gk_int(f, arch, "leading_dense_block_count", 0)) ? "true" : "false");
    const int64_t B = gk_int(f, arch, "attn_res_block_size", 0);
    if (B) sb_printf(&b, "\"attn_res_block_size\": %lld,", (long long)B);
    const moe__gguf_kv *bos = moe__gguf_get(f, "tokenizer.ggml.bos_token_id"), *eos = moe__gguf_get(f, "tokenizer.ggml.eos_token_id");
    uint32_t bv = 0, ev = 0;
    if (bos && bos->type == MOE_GGUF_U32) memcpy(&bv, bos->data, 4);
    if (eos && eos->type == MOE_GGUF_U32) memcpy(&ev, eos->data, 4);
    sb_printf(&b, "\"bos_token_id\": %d, \"eos_token_id\": %d, \"tie_word_embeddings\": %s}", bos ? (int)bv : -1, eos ? (int)ev : -1,
              gguf_tensor(f, "output.weight", 0) ? "false" : "true");
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
    else if (!moe__hf_to_gguf(name, full, n)) snprintf(full, n, "(no GGUF name for %s)", name);
}

static const tensor_ref *bfind(binder *b, const char *name) {
    char full[340];
    bname(b, name, full, sizeof full);
    return lookup(b->m, full);
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
                         "%s: tensor %s: weight type not supported (F32, F16, BF16, Q8_0, Q4_0, MXFP4)", bfile(b, r), t->name);
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
        b->st = fail(b->err, b->errlen, MOE_ERR_FORMAT, "missing tensor %s", full);
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

/* A small vector of n values (any shape with n elements, or >= n with `pad_zero` allowing a zero
 * tail), kept as an f32 copy. */
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
        b->st = fail(b->err, b->errlen, MOE_ERR_FORMAT, "missing tensor %s", full);
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
    for (int64_t i = n; i < count; i++)
        if (v[i] != 0.0f) {
            free(v);
            b->st = fail(b->err, b->errlen, MOE_ERR_FORMAT, "%s: tensor %s: non-zero padding past %lld values",
                         bfile(b, r), t->name, (long long)n);
            return NULL;
        }
    return v;
}

/* AttnRes pseudo-query: norm weight times projection row (bf16*bf16 is exact in f32) */
static float *bind_res(binder *b, int d, const char *pre) {
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
        if (!r) { b->st = fail(b->err, b->errlen, MOE_ERR_FORMAT, "missing tensor %s", nm); return; }
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
        L->q_conv = bind_vec(b, HD * W, 0, "%sself_attn.q_conv1d.weight", p);
        L->k_conv = bind_vec(b, HD * W, 0, "%sself_attn.k_conv1d.weight", p);
        L->v_conv = bind_vec(b, HD * W, 0, "%sself_attn.v_conv1d.weight", p);
        bind_mat(b, &L->f_a, D, d, "%sself_attn.f_a_proj", p);
        bind_mat(b, &L->f_b, HD, D, "%sself_attn.f_b_proj", p);
        L->A_log = bind_vec(b, H, 1, "%sself_attn.A_log", p);
        /* GGUF stores exp(A_log) (K3) or -exp(A_log) (Kimi Linear) as ssm_a: both give |.| = a */
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


/* Converts one weight matrix to `to` (a MOE_WTYPE_*) into memory the model owns. */
static moe_status convert_weight(moe_model *m, moe__weight *w, int to) {
    static const int types[] = {-1, MOE_T_F32, MOE_T_BF16, MOE_T_Q8_0, MOE_T_Q4_0};
    if (!w->data || to <= MOE_WTYPE_ASIS || to > MOE_WTYPE_Q4_0) return MOE_OK;
    const int t = types[to];
    if (t == w->type || (moe__is_quant(t) && w->cols % 32)) return MOE_OK;
    const int64_t rb_in = moe__row_bytes(w->type, w->cols), rb = moe__row_bytes(t, w->cols);
    const int64_t sb = w->type == MOE_T_MXFP4 ? w->cols / 32 : 0;
    unsigned char *dst = malloc((size_t)(rb * w->rows));
    float *tmp = malloc(sizeof(float) * (size_t)w->cols * (size_t)m->opt.n_threads);
    if (!dst || !tmp) { free(dst); free(tmp); return MOE_ERR_NOMEM; }
#ifdef _OPENMP
#pragma omp parallel for num_threads(m->opt.n_threads) schedule(static) if (m->opt.n_threads > 1)
#endif
    for (int64_t r = 0; r < w->rows; r++) {
        float *row = tmp + (size_t)w->cols * (size_t)thread_id();
        moe__row_to_f32(w->type, (const unsigned char *)w->data + r * rb_in, w->scale ? w->scale + r * sb : NULL, row, w->cols);
        unsigned char *o = dst + r * rb;
        if (t == MOE_T_F32) memcpy(o, row, sizeof(float) * (size_t)w->cols);
        else if (t == MOE_T_BF16) for (int64_t i = 0; i < w->cols; i++) ((uint16_t *)o)[i] = moe__f32_to_bf16(row[i]);
        else moe__quantize_row(t, row, o, w->cols);
    }
    free(tmp);
    if (own(m, dst)) { free(dst); return MOE_ERR_NOMEM; }
    *w = (moe__weight){t, w->rows, w->cols, dst, NULL};
    return MOE_OK;
}

/* Interleaves a Q4_0/Q8_0 matrix 8 rows at a time into RAM the model owns (the layout the x8
 * kernels want), then lets the source go: its mapped pages are dropped from our resident set, or
 * its owned buffer freed. Rows not a multiple of 8 stay as they are. */
static moe_status repack_weight(moe_model *m, moe__weight *w) {
    if (!w->data || !moe__is_quant(w->type) || w->rows % 8) return MOE_OK;
    const int to = w->type == MOE_T_Q4_0 ? MOE_T_Q4_0X8 : MOE_T_Q8_0X8;
    const int64_t rb = moe__row_bytes(w->type, w->cols), gb = 8 * moe__row_bytes(to, w->cols), ng = w->rows / 8;
    unsigned char *dst = malloc((size_t)(gb * ng));
    if (!dst) return MOE_ERR_NOMEM;
#ifdef _OPENMP
#pragma omp parallel for num_threads(m->opt.n_threads) schedule(static) if (m->opt.n_threads > 1 && ng > 64)
#endif
    for (int64_t g = 0; g < ng; g++) moe__repack_x8(w->type, (const unsigned char *)w->data + g * 8 * rb, rb, dst + g * gb, w->cols);
    if (own(m, dst)) { free(dst); return MOE_ERR_NOMEM; }
    int owned = 0;
    for (int i = 0; i < m->n_owned - 1 && !owned; i++)
        if (m->owned[i] == w->data) {
            free(m->owned[i]);
            m->owned[i] = m->owned[m->n_owned - 2];
            m->owned[m->n_owned - 2] = dst;
            m->n_owned--;
            owned = 1;
        }
    if (!owned) { /* a mapping: drop the pages we just read (a hint; they stay in the page cache) */
        uintptr_t a = (uintptr_t)w->data & ~(uintptr_t)4095, e = (uintptr_t)w->data + (uintptr_t)(rb * w->rows);
#ifdef MADV_DONTNEED
        madvise((void *)a, e - a, MADV_DONTNEED); /* private read-only mapping: re-read from the file if touched */
#else
        posix_madvise((void *)a, e - a, POSIX_MADV_DONTNEED);
#endif
    }
    *w = (moe__weight){to, w->rows, w->cols, dst, NULL};
    return MOE_OK;
}

static moe_status repack_weights(moe_model *m) {
    moe_status st = repack_weight(m, &m->lm_head);
    for (int i = 0; i < m->cfg.n_layers && !st; i++) {
        layer *L = &m->layers[i];
        moe__weight *dense[] = {&L->q, &L->k, &L->v, &L->f_a, &L->f_b, &L->b, &L->g_a, &L->g_b, &L->g, &L->o, &L->q_a,
                                &L->q_b, &L->kv_a, &L->gate, &L->up, &L->down, &L->router, &L->lat_down, &L->lat_up};
        for (size_t k = 0; k < sizeof dense / sizeof *dense && !st; k++) st = repack_weight(m, dense[k]);
        for (int e = 0; L->experts && !m->opt.expert_mode && e < m->cfg.n_experts && !st; e++) { /* cache mode reads experts as stored */
            st = repack_weight(m, &L->experts[e].w1);
            if (!st) st = repack_weight(m, &L->experts[e].w2);
            if (!st) st = repack_weight(m, &L->experts[e].w3);
        }
    }
    return st;
}

static moe_status convert_weights(moe_model *m) {
    const int dt = m->opt.dense_type, et = m->opt.expert_type;
    moe_status st = MOE_OK;
    if (dt) st = convert_weight(m, &m->lm_head, dt);
    for (int i = 0; i < m->cfg.n_layers && !st; i++) {
        layer *L = &m->layers[i];
        moe__weight *dense[] = {&L->q, &L->k, &L->v, &L->f_a, &L->f_b, &L->b, &L->g_a, &L->g_b, &L->g, &L->o,
                                &L->q_a, &L->q_b, &L->kv_a, &L->gate, &L->up, &L->down, &L->lat_down, &L->lat_up};
        for (size_t k = 0; k < sizeof dense / sizeof *dense && !st && dt; k++) st = convert_weight(m, dense[k], dt);
        for (int e = 0; L->experts && et && e < m->cfg.n_experts && !st; e++) {
            st = convert_weight(m, &L->experts[e].w1, et);
            if (!st) st = convert_weight(m, &L->experts[e].w2, et);
            if (!st) st = convert_weight(m, &L->experts[e].w3, et);
        }
    }
    return st;
}

static void count_dense_bytes(moe_model *m) {
    static const char *names[MOE_T_COUNT] = {"f32", "f16", "bf16", "mxfp4", "mxfp4", "q8_0", "q4_0", "u8", "i32", "q8_0", "q4_0"};
    uint64_t per_type[MOE_T_COUNT] = {0};
    uint64_t b = weight_bytes(&m->lm_head) + (uint64_t)moe__row_bytes(m->embed.type, m->embed.cols);
    per_type[m->lm_head.type] += weight_bytes(&m->lm_head);
    for (int i = 0; i < m->cfg.n_layers; i++) {
        const layer *L = &m->layers[i];
        const moe__weight *w[] = {&L->q, &L->k, &L->v, &L->f_a, &L->f_b, &L->b, &L->g_a, &L->g_b, &L->g, &L->o, &L->q_a,
                                  &L->q_b, &L->kv_a, &L->kv_b, &L->gate, &L->up, &L->down, &L->router, &L->lat_down, &L->lat_up};
        for (size_t k = 0; k < sizeof w / sizeof *w; k++) b += weight_bytes(w[k]), per_type[w[k]->type] += weight_bytes(w[k]);
        for (int e = 0; L->experts && e < m->cfg.n_experts; e++) per_type[L->experts[e].w1.type] += expert_bytes(&L->experts[e]);
    }
    int best = 0;
    for (int t = 1; t < MOE_T_COUNT; t++)
        if (per_type[t] > per_type[best]) best = t;
    m->info.dense_bytes_per_token = b;
    m->info.weight_type = names[best];
}

static moe_status bind_model(moe_model *m, char *err, size_t errlen) {
    const moe_config *c = &m->cfg;
    binder b = {m, err, errlen, MOE_OK};
    const int d = c->hidden_size;
    bind_mat(&b, &m->embed, c->vocab_size, d, "model.embed_tokens");
    if (c->tie_embeddings && !bfind(&b, "lm_head.weight")) m->lm_head = m->embed;
    else bind_mat(&b, &m->lm_head, c->vocab_size, d, "lm_head");
    m->final_norm = bind_vec(&b, d, 0, "model.norm.weight");
    if (c->attn_res_block) m->out_res_w = bind_res(&b, d, "model.output_attn_res");
    if (!b.st && !(m->layers = xcalloc((size_t)c->n_layers, sizeof *m->layers))) b.st = MOE_ERR_NOMEM;
    for (int i = 0; i < c->n_layers && !b.st; i++) bind_layer(&b, i);
    for (int i = 0; i < c->n_layers && !b.st; i++) /* absorbed MLA decodes kv_b rows as floats */
        if (m->layers[i].kind == MOE_LAYER_MLA && !m->k.dot[m->layers[i].kv_b.type]) b.st = convert_weight(m, &m->layers[i].kv_b, MOE_WTYPE_F32);
    if (!b.st && (m->embed.type == MOE_T_MXFP4 || m->embed.type == MOE_T_MXFP4_GGML))
        b.st = fail(err, errlen, MOE_ERR_FORMAT, "embed_tokens must not be MXFP4");
    if (!b.st) count_params(m);
    if (!b.st && (b.st = convert_weights(m))) fail(err, errlen, b.st, "out of memory converting weights at load");
    if (!b.st && !(m->opt.flags & MOE_FLAG_NO_REPACK) && (b.st = repack_weights(m)))
        fail(err, errlen, b.st, "out of memory interleaving weights at load (MOE_FLAG_NO_REPACK keeps them mapped)");
    if (!b.st) count_dense_bytes(m);
    return b.st;
}

/* ==== opening ================================================================================ */

static moe_status read_file(const char *path, char **out, size_t *len, size_t max, char *err,
                            size_t errlen) {
    FILE *f = fopen(path, "rb");
    if (!f) return fail(err, errlen, MOE_ERR_IO, "%s: %s", path, strerror(errno));
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

static moe_status cache_open(moe_model *m, char *err, size_t errlen); /* expert cache section */
static void cache_free(moe_model *m);

moe_options moe_default_options(void) {
    moe_options o;
    memset(&o, 0, sizeof o);
    o.n_threads = 1;
    o.n_batch = 512;
    o.expert_mode = MOE_EXPERTS_MMAP;
    o.prefetch = 1;
    return o;
}

/* by magic, or by name (so a damaged .gguf gets a GGUF error rather than a config.json one) */
static int is_gguf_file(const char *path) {
    size_t l = strlen(path);
    if (l > 5 && !strcmp(path + l - 5, ".gguf")) return 1;
    FILE *f = fopen(path, "rb");
    char magic[4] = {0};
    if (!f) return 0;
    size_t r = fread(magic, 1, 4, f);
    fclose(f);
    return r == 4 && !memcmp(magic, "GGUF", 4);
}

/* One GGUF file holds the config (as metadata) and every tensor. */
static moe_status open_gguf(moe_model *m, const char *path, char *err, size_t errlen) {
    m->gguf = 1;
    if (!(m->files = xcalloc(1, sizeof *m->files))) return MOE_ERR_NOMEM;
    moe_status st = moe__gguf_open(&m->files[0], path, err, errlen);
    if (st) return st;
    m->n_files = 1;
    moe__json *cfg = NULL;
    if ((st = gguf_config_json(&m->files[0], &cfg, err, errlen))) return st;
    char e2[400];
    st = parse_config(m, cfg, e2, sizeof e2);
    moe__json_free(cfg);
    if (st) return fail(err, errlen, st, "%s: %s", path, e2);
    return build_table(m, err, errlen);
}

static moe_status open_files(moe_model *m, const char *path, char *err, size_t errlen) {
    char dir[4096], buf[4400];
    moe_status st;
    if (strlen(path) >= sizeof dir - 1) return fail(err, errlen, MOE_ERR_ARG, "path too long");
    if (!is_dir(path) && is_gguf_file(path)) return open_gguf(m, path, err, errlen);
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
    if ((st = parse_config(m, cfg, err, errlen))) goto out;
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
    m->opt = opt ? *opt : moe_default_options();
    if (m->opt.n_threads < 1) m->opt.n_threads = 1;
    if (m->opt.n_batch < 1) m->opt.n_batch = 512;
    moe__kernels_init(&m->k, m->opt.flags);
    moe_status st = MOE_OK;
    if (!(m->path = strdup(path))) st = MOE_ERR_NOMEM;
    if (!st && m->opt.expert_mode != MOE_EXPERTS_MMAP && m->opt.expert_mode != MOE_EXPERTS_CACHE)
        st = fail(err, errlen, MOE_ERR_ARG, "unknown expert_mode %d", m->opt.expert_mode);
    if (!st && m->opt.expert_mode == MOE_EXPERTS_CACHE && m->opt.expert_type != MOE_WTYPE_ASIS)
        st = fail(err, errlen, MOE_ERR_ARG, "expert_type conversion makes experts resident: it needs the mmap expert mode");
    if (!st) st = open_files(m, path, err, errlen);
    if (!st) st = bind_model(m, err, errlen);
    if (!st && m->opt.expert_mode == MOE_EXPERTS_CACHE && m->cfg.n_experts) st = cache_open(m, err, errlen);
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

/* ==== matmul ==================================================================================
 * y[t, n] = sum_k x[t, k] W[n, k]: threads split the weight rows; each output element is one
 * kernel dot, so results do not depend on the thread count. */

#define MM_ROW_TILE 16 /* weight rows per task: they stay in cache while every token passes */

static moe_status matmul_nt(const moe_model *m, float *y, const float *x, int64_t ldx, int T,
                            const moe__weight *W, int nt) {
    const int64_t N = W->rows, K = W->cols, rb = moe__row_bytes(W->type, K);
    const int64_t sb = W->type == MOE_T_MXFP4 ? K / 32 : 0;
    const unsigned char *base = W->data;
    const int par = nt > 1 && N * T * K > (1 << 18);
    (void)par; /* used by the OpenMP pragmas only */
    const int x8 = W->type == MOE_T_Q4_0X8 || W->type == MOE_T_Q8_0X8;
    if (x8 || moe__is_quant(W->type)) {
        /* integer formats: quantize the activation rows once, then int8 dots */
        const int64_t nb = K / 32;
        moe__block_q8a *xq = malloc(sizeof *xq * (size_t)(nb * T));
        if (!xq) return MOE_ERR_NOMEM;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static) if (par && T > 1)
#endif
        for (int t = 0; t < T; t++) m->k.quant_q8a(x + (int64_t)t * ldx, xq + (int64_t)t * nb, K);
        if (x8) { /* interleaved groups of 8 rows: one kernel call yields 8 outputs */
            const int64_t gb = nb * (W->type == MOE_T_Q4_0X8 ? (int64_t)sizeof(moe__block_q4_0x8) : (int64_t)sizeof(moe__block_q8_0x8));
            const moe__dotq8_fn dotq8 = m->k.dotq8[W->type];
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static) if (par)
#endif
            for (int64_t g = 0; g < N / 8; g++) {
                float o8[8];
                for (int t = 0; t < T; t++) {
                    dotq8(base + g * gb, xq + (int64_t)t * nb, K, o8);
                    memcpy(y + (int64_t)t * N + g * 8, o8, sizeof o8);
                }
            }
        } else {
            const moe__dotq_fn dotq = m->k.dotq[W->type];
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static) if (par)
#endif
            for (int64_t r0 = 0; r0 < N; r0 += MM_ROW_TILE) {
                const int64_t r1 = r0 + MM_ROW_TILE < N ? r0 + MM_ROW_TILE : N;
                for (int t = 0; t < T; t++)
                    for (int64_t n = r0; n < r1; n++) y[(int64_t)t * N + n] = dotq(base + n * rb, xq + (int64_t)t * nb, K);
            }
        }
        free(xq);
        return MOE_OK;
    }
    const moe__dot_fn dot = m->k.dot[W->type];
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static) if (par)
#endif
    for (int64_t r0 = 0; r0 < N; r0 += MM_ROW_TILE) {
        const int64_t r1 = r0 + MM_ROW_TILE < N ? r0 + MM_ROW_TILE : N;
        for (int t = 0; t < T; t++)
            for (int64_t n = r0; n < r1; n++)
                y[(int64_t)t * N + n] = dot(base + n * rb, W->scale ? W->scale + n * sb : NULL, x + (int64_t)t * ldx, K);
    }
    return MOE_OK;
}

/* y[T, rows] = x[T, cols] W^T. Callers chain these through MM so that the first failure sticks
 * and is returned; later products in the same function then run on scratch values that are
 * thrown away with the step. */
static moe_status matmul_ld(const moe_model *m, float *y, const float *x, int64_t ldx, int T, const moe__weight *W) {
    return matmul_nt(m, y, x, ldx, T, W, m->opt.n_threads);
}

static moe_status matmul(const moe_model *m, float *y, const float *x, int T, const moe__weight *W) {
    return matmul_ld(m, y, x, W->cols, T, W);
}
#define MM(y, x, T, W) (st = st ? st : matmul(m, (y), (x), (T), (W)))

/* ==== norms and activations ==================================================================== */

static void rmsnorm(float *y, const float *x, const float *w, int n, float eps) {
    double ss = 0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float inv = (float)(1.0 / sqrt(ss / n + eps));
    for (int i = 0; i < n; i++) y[i] = x[i] * inv * w[i];
}

static void rmsnorm_rows(float *y, const float *x, const float *w, int rows, int n, float eps) {
    for (int t = 0; t < rows; t++) rmsnorm(y + (size_t)t * n, x + (size_t)t * n, w, n, eps);
}

static inline float sigmoidf(float z) { return 1.0f / (1.0f + expf(-z)); }
static inline float siluf(float z) { return z * sigmoidf(z); }
static inline float softplusf(float z) { return z > 20.0f ? z : log1pf(expf(z)); }

/* gate a, up b -> phi(a, b) into a (SwiGLU or SiTU-GLU, spec section 3) */
static void glu(const moe_config *c, float *a, const float *b, int64_t n) {
    if (c->hidden_act == MOE_ACT_SILU) {
        for (int64_t i = 0; i < n; i++) a[i] = siluf(a[i]) * b[i];
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

static moe_status kda_forward(const moe_model *m, const layer *L, moe_session *s, int li,
                              const float *x, int n, float *out) {
    const moe_config *c = &m->cfg;
    const int d = c->hidden_size, H = c->kda_heads, D = c->kda_head_dim, HD = H * D;
    const int W = c->conv_kernel, Wm = W - 1;
    const size_t ext = (size_t)(Wm + n) * HD;
    float *buf = malloc(sizeof(float) * (3 * ext + 5 * (size_t)n * HD + (size_t)n * H + (size_t)n * D));
    if (!buf) return MOE_ERR_NOMEM;
    float *qe = buf, *ke = qe + ext, *ve = ke + ext, *q = ve + ext, *k = q + (size_t)n * HD;
    float *v = k + (size_t)n * HD, *g = v + (size_t)n * HD, *o = g + (size_t)n * HD;
    float *beta = o + (size_t)n * HD, *tmp = beta + (size_t)n * H;
    float *tail = s->conv_tail[li];
    moe_status st = MOE_OK;
    float *exts[3] = {qe, ke, ve}, *outs[3] = {q, k, v};
    const moe__weight *proj[3] = {&L->q, &L->k, &L->v};
    const float *convw[3] = {L->q_conv, L->k_conv, L->v_conv};
    /* 1-2. projections, then the causal depthwise convolution over [tail | new rows] */
    for (int a = 0; a < 3; a++) {
        float *e = exts[a];
        for (int r = 0; r < Wm; r++) memcpy(e + (size_t)r * HD, tail + ((size_t)r * 3 + a) * HD, sizeof(float) * HD);
        MM(e + (size_t)Wm * HD, x, n, proj[a]);
        for (int t = 0; t < n; t++)
            for (int ch = 0; ch < HD; ch++) {
                float acc = 0;
                const float *w = convw[a] + (size_t)ch * W;
                for (int j = 0; j < W; j++) acc += w[j] * e[(size_t)(t + j) * HD + ch];
                outs[a][(size_t)t * HD + ch] = siluf(acc);
            }
        for (int r = 0; r < Wm; r++)
            memcpy(tail + ((size_t)r * 3 + a) * HD, e + (size_t)(n + r) * HD, sizeof(float) * HD);
    }
    /* 3. per-head L2 norm; q also scaled by D^-1/2 */
    const float qscale = 1.0f / sqrtf((float)D);
    for (int t = 0; t < n; t++)
        for (int h = 0; h < H; h++) {
            float *qh = q + (size_t)t * HD + (size_t)h * D, *kh = k + (size_t)t * HD + (size_t)h * D;
            double sq = 0, sk = 0;
            for (int i = 0; i < D; i++) sq += (double)qh[i] * qh[i], sk += (double)kh[i] * kh[i];
            float iq = (float)(1.0 / sqrt(sq + 1e-6)) * qscale, ik = (float)(1.0 / sqrt(sk + 1e-6));
            for (int i = 0; i < D; i++) qh[i] *= iq, kh[i] *= ik;
        }
    /* 4. decay gate: z = (x f_a^T) f_b^T + dt_bias */
    MM(tmp, x, n, &L->f_a);
    MM(g, tmp, n, &L->f_b);
    for (int t = 0; t < n; t++)
        for (int h = 0; h < H; h++) {
            float a = expf(L->A_log[h]);
            for (int i = 0; i < D; i++) {
                size_t idx = (size_t)t * HD + (size_t)h * D + i;
                float z = g[idx] + L->dt_bias[(size_t)h * D + i];
                g[idx] = c->kda_gate_bounded ? c->kda_gate_lower_bound * sigmoidf(a * z) : -a * softplusf(z);
            }
        }
    /* 5. beta */
    MM(beta, x, n, &L->b);
    for (int i = 0; i < n * H; i++) beta[i] = sigmoidf(beta[i]);
    /* 6. the core, per head: chunked for prefill, recurrence for short steps */
    const unsigned fl = m->opt.flags;
    const int chunked = (fl & MOE_FLAG_KDA_CHUNKED) ? 1 : (fl & MOE_FLAG_KDA_RECURRENT) ? 0 : n >= KDA_CHUNK_MIN;
    const int bounded = c->kda_gate_bounded && c->kda_gate_lower_bound >= -5.0f;
    const size_t wsz = moe__kda_chunk_work(D);
    float *work = chunked ? malloc(sizeof(float) * wsz * (size_t)H) : NULL;
    if (chunked && !work) { free(buf); return MOE_ERR_NOMEM; }
#ifdef _OPENMP
#pragma omp parallel for num_threads(m->opt.n_threads) schedule(static) if (m->opt.n_threads > 1 && H > 1)
#endif
    for (int h = 0; h < H; h++) {
        moe__kda_head a = {n, D, HD, H, q + (size_t)h * D, k + (size_t)h * D, v + (size_t)h * D,
                           g + (size_t)h * D, beta + h, o + (size_t)h * D,
                           s->kda_state[li] + (size_t)h * D * D};
        if (chunked) moe__kda_chunked(&a, bounded, work + wsz * (size_t)h, &m->k);
        else m->k.kda_recurrent(&a);
    }
    free(work);
    /* 7. output gate and per-head RMSNorm; 8. output projection (og reuses q's buffer) */
    float *og = q;
    if (c->kda_full_rank_gate) {
        MM(og, x, n, &L->g);
    } else {
        MM(tmp, x, n, &L->g_a);
        MM(og, tmp, n, &L->g_b);
    }
    for (int t = 0; t < n; t++)
        for (int h = 0; h < H; h++) {
            float *oh = o + (size_t)t * HD + (size_t)h * D;
            const float *gh = og + (size_t)t * HD + (size_t)h * D;
            rmsnorm(oh, oh, L->o_norm, D, c->rms_norm_eps);
            for (int i = 0; i < D; i++) oh[i] *= sigmoidf(gh[i]);
        }
    MM(out, o, n, &L->o);
    (void)d;
    free(buf);
    return st;
}

/* ==== MLA layer (spec section 7) ===============================================================
 * The session caches, per token, the normalised latent c (r) and the shared key slice kr (d_r).
 * Attention runs either absorbed (queries mapped into the latent space: cheap when few queries
 * meet a long cache, i.e. decode) or expanded (keys/values rebuilt from the cache: cheaper when
 * many queries share the keys, i.e. prefill); the cost model below picks per call. */

static moe_status mla_cache_reserve(moe_session *s, int li, int rows) {
    const moe_config *c = &s->m->cfg;
    if (rows <= s->mla_cap[li]) return MOE_OK;
    int cap = s->mla_cap[li] ? s->mla_cap[li] : 64;
    while (cap < rows) cap = cap > s->n_ctx / 2 ? s->n_ctx : cap * 2;
    if (cap < rows) cap = rows;
    size_t w = (size_t)c->kv_lora_rank + c->qk_rope_dim;
    float *p = realloc(s->mla_cache[li], sizeof(float) * w * (size_t)cap);
    if (!p) return MOE_ERR_NOMEM;
    s->mla_cache[li] = p;
    s->mla_cap[li] = cap;
    return MOE_OK;
}

#define MLA_KEY_BLOCK 256 /* keys scored at once: per-head online softmax across blocks */

/* Absorbed attention of one query token over `len` cached latents, all heads at once: each
 * cached row c_j is read once per block for every head (the heads share the latent, as in MQA),
 * and the softmax runs online over key blocks, so memory does not grow with the context.
 * q: [H, d_n + d_r]; y: [H, d_v]; w: mla_absorbed_work floats. */
static size_t mla_absorbed_work(const moe_config *c, int nt) {
    return (size_t)c->mla_heads * (2 * (size_t)c->kv_lora_rank + MLA_KEY_BLOCK + 2) + (size_t)nt * c->kv_lora_rank;
}

static void mla_absorbed_token(const moe_model *m, const layer *L, const float *cache, int len, const float *q, float *y,
                               float *w, int nt) {
    const moe_config *c = &m->cfg;
    const int H = c->mla_heads, dn = c->qk_nope_dim, dr = c->qk_rope_dim, dv = c->v_head_dim, r = c->kv_lora_rank;
    const int dq = dn + dr, cw = r + dr, KB = MLA_KEY_BLOCK;
    const float scale = 1.0f / sqrtf((float)dq);
    float *QA = w, *CTX = QA + (size_t)H * r, *SC = CTX + (size_t)H * r, *M = SC + (size_t)H * KB, *LS = M + H, *ROWS = LS + H;
    const int64_t kvrow = moe__row_bytes(L->kv_b.type, r), kvsb = L->kv_b.type == MOE_T_MXFP4 ? r / 32 : 0;
    const moe__dot_fn wdot = m->k.dot[L->kv_b.type];
    (void)nt;
#ifdef _OPENMP
#pragma omp parallel num_threads(nt) if (nt > 1)
#endif
    {
        const int tid = thread_id();
#ifdef _OPENMP
        const int nth = omp_get_num_threads();
#else
        const int nth = 1;
#endif
        const int h0 = H * tid / nth, h1 = H * (tid + 1) / nth; /* this thread's heads */
        float *row = ROWS + (size_t)tid * r;
        /* q^_h = W_UK,h^T qn_h from kv_b rows h*(d_n+d_v) .. +d_n */
        for (int h = h0; h < h1; h++) {
            float *qa = QA + (size_t)h * r;
            memset(qa, 0, sizeof(float) * (size_t)r);
            memset(CTX + (size_t)h * r, 0, sizeof(float) * (size_t)r);
            M[h] = -INFINITY, LS[h] = 0;
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
        for (int j0 = 0; j0 < len; j0 += KB) {
            const int jn = len - j0 < KB ? len - j0 : KB;
            moe__mla_block blk = {H, r, dr, cw, jn, 0, jn, KB, dq, scale, QA, q + dn, cache + (size_t)j0 * cw, SC, CTX};
#ifdef _OPENMP
#pragma omp barrier
#endif
            /* scores: this thread's share of the block's keys, all heads */
            blk.j0 = jn * tid / nth, blk.j1 = jn * (tid + 1) / nth;
            m->k.mla_scores(&blk);
#ifdef _OPENMP
#pragma omp barrier
#endif
            for (int h = h0; h < h1; h++) {
                float *sc = SC + (size_t)h * KB, mx = M[h];
                for (int jj = 0; jj < jn; jj++) mx = sc[jj] > mx ? sc[jj] : mx;
                const float f = expf(M[h] - mx); /* 0 on the first block */
                if (f != 1.0f) {
                    for (int i = 0; i < r; i++) CTX[(size_t)h * r + i] *= f;
                    LS[h] *= f;
                }
                for (int jj = 0; jj < jn; jj++) sc[jj] = expf(sc[jj] - mx), LS[h] += sc[jj];
                M[h] = mx;
            }
            m->k.mla_ctx(&blk, h0, h1); /* this thread's heads, every key of the block */
        }
        for (int h = h0; h < h1; h++) {
            const float inv = 1.0f / LS[h];
            for (int i = 0; i < dv; i++) {
                const int64_t wr = (int64_t)h * (dn + dv) + dn + i;
                y[(size_t)h * dv + i] = inv * wdot((const unsigned char *)L->kv_b.data + wr * kvrow,
                                                   L->kv_b.scale ? L->kv_b.scale + wr * kvsb : NULL, CTX + (size_t)h * r, r);
            }
        }
    }
}

static moe_status mla_forward(const moe_model *m, const layer *L, moe_session *s, int li,
                              const float *x, int n, float *out) {
    const moe_config *c = &m->cfg;
    const int H = c->mla_heads, dn = c->qk_nope_dim, dr = c->qk_rope_dim, dv = c->v_head_dim;
    const int r = c->kv_lora_rank, dq = dn + dr, cw = r + dr, pos = s->pos;
    const int S = pos + n; /* keys after this step */
    moe_status st = mla_cache_reserve(s, li, S);
    if (st) return st;
    /* cost of the two attention forms (multiply-adds), averaged over the causal triangle */
    const double savg = pos + (n + 1) / 2.0;
    const double absorbed = (double)n * H * (savg * (2.0 * r + dr) + (double)(dn + dv) * r);
    const double expanded = (double)S * H * (dn + dv) * r + (double)n * H * savg * (dq + dv);
    int use_expanded = expanded < absorbed;
    if (m->opt.flags & MOE_FLAG_MLA_ABSORBED) use_expanded = 0;
    if (m->opt.flags & MOE_FLAG_MLA_EXPANDED) use_expanded = 1;
#ifdef _OPENMP
    const int nt = m->opt.n_threads;
#else
    const int nt = 1;
#endif
    size_t qn = (size_t)n * H * dq, yn = (size_t)n * H * dv;
    size_t kvn = use_expanded ? (size_t)S * H * (dn + dv) : 0;
    /* scratch: per-thread scores for the expanded form, or the absorbed form's work area */
    size_t scratch = use_expanded ? (size_t)S + 16 : 0, work = use_expanded ? scratch * (size_t)nt : mla_absorbed_work(c, nt);
    size_t qa = c->q_lora_rank ? (size_t)n * c->q_lora_rank : 0;
    size_t gn = c->mla_output_gate ? yn : 0;
    float *buf = malloc(sizeof(float) * (qn + yn + gn + kvn + qa + (size_t)n * cw + work));
    if (!buf) return MOE_ERR_NOMEM;
    float *q = buf, *y = q + qn, *gate = y + yn, *kv = gate + gn, *qa_buf = kv + kvn;
    float *lat = qa_buf + qa, *scr = lat + (size_t)n * cw;
    /* 1. queries */
    if (c->q_lora_rank) {
        MM(qa_buf, x, n, &L->q_a);
        rmsnorm_rows(qa_buf, qa_buf, L->q_a_norm, n, c->q_lora_rank, 1e-6f);
        MM(q, qa_buf, n, &L->q_b);
    } else {
        MM(q, x, n, &L->q);
    }
    /* 2. latents into the cache */
    MM(lat, x, n, &L->kv_a);
    float *cache = s->mla_cache[li];
    for (int t = 0; t < n; t++) {
        float *row = cache + (size_t)(pos + t) * cw;
        rmsnorm(row, lat + (size_t)t * cw, L->kv_a_norm, r, 1e-6f);
        memcpy(row + r, lat + (size_t)t * cw + r, sizeof(float) * dr);
    }
    if (use_expanded && !st) st = matmul_ld(m, kv, cache, cw, S, &L->kv_b); /* [S, H*(dn+dv)] */
    const float scale = 1.0f / sqrtf((float)dq);
    if (!use_expanded) {
        for (int t = 0; t < n; t++)
            mla_absorbed_token(m, L, cache, pos + t + 1, q + (size_t)t * H * dq, y + (size_t)t * H * dv, scr, nt);
    } else {
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1 && n * H > 1)
#endif
        for (int th = 0; th < n * H; th++) {
            const int t = th / H, h = th % H, last = pos + t;
            float *sc = scr + scratch * (size_t)thread_id();
            const float *qh = q + (size_t)t * H * dq + (size_t)h * dq;
            float *yh = y + (size_t)t * H * dv + (size_t)h * dv;
            const moe__dot_fn fdot = m->k.dot[MOE_T_F32];
            const size_t kvw = (size_t)H * (dn + dv);
            float mx = -INFINITY;
            for (int j = 0; j <= last; j++) {
                const float *kn = kv + (size_t)j * kvw + (size_t)h * (dn + dv), *kr = cache + (size_t)j * cw + r;
                sc[j] = (fdot(qh, NULL, kn, dn) + fdot(qh + dn, NULL, kr, dr)) * scale;
                if (sc[j] > mx) mx = sc[j];
            }
            double sum = 0;
            for (int j = 0; j <= last; j++) sum += sc[j] = expf(sc[j] - mx);
            float inv = (float)(1.0 / sum);
            for (int i = 0; i < dv; i++) yh[i] = 0;
            for (int j = 0; j <= last; j++) m->k.axpy(yh, sc[j] * inv, kv + (size_t)j * kvw + (size_t)h * (dn + dv) + dn, dv);
        }
    }
    /* 5. output gate; 6. output projection */
    if (c->mla_output_gate) {
        MM(gate, x, n, &L->g);
        for (size_t i = 0; i < yn; i++) y[i] *= sigmoidf(gate[i]);
    }
    MM(out, y, n, &L->o);
    free(buf);
    return st;
}

/* ==== FFN and MoE (spec section 8) ============================================================= */

static moe_status ffn_forward(const moe_model *m, const moe__weight *gate, const moe__weight *up,
                              const moe__weight *down, const float *x, int n, float *out) {
    const int64_t I = gate->rows;
    float *a = malloc(sizeof(float) * 2 * (size_t)n * (size_t)I);
    if (!a) return MOE_ERR_NOMEM;
    float *b = a + (size_t)n * I;
    moe_status st = MOE_OK;
    MM(a, x, n, gate);
    MM(b, x, n, up);
    glu(&m->cfg, a, b, (int64_t)n * I);
    MM(out, a, n, down);
    free(a);
    return st;
}

/* ==== expert cache (CACHE mode) ===============================================================
 * Experts are read whole with pread into buffers the cache owns, within the caller's budget;
 * an expert in use by a step is pinned, the least recently used unpinned one is evicted to make
 * room. One lock guards the table; reads happen under it (synchronous reading: the I/O threads and
 * prefetch of the streaming design are not here yet). */

typedef struct cache_entry {
    int li, e, pins, loading; /* loading: being read by one thread; the others wait */
    int prefetched;           /* read by the I/O thread and not used yet */
    uint64_t last_use;
    size_t bytes;
    unsigned char *buf;
    expert ex; /* the weights, pointing into buf */
} cache_entry;

struct expert_cache {
    pthread_mutex_t lock;
    pthread_cond_t unpinned; /* signalled when an expert's last pin goes, or a read ends */
    int *fds;               /* one per file */
    cache_entry **slot;     /* [n_layers * n_experts]: resident entry or NULL */
    cache_entry **resident; /* the resident entries, unordered */
    int n_resident, cap_resident;
    size_t budget, used, peak;
    uint64_t clock;
    int fail_after; /* fault injection: the n-th read from now fails (0: never) */
    /* prefetch: one I/O thread reads queued experts into free or evictable room */
    pthread_t io;
    pthread_cond_t work;
    int io_running, io_stop;
    int *queue, qn, qcap; /* expert ids (layer * E + e), oldest first */
};

static void cache_free(moe_model *m) {
    struct expert_cache *c = m->cache;
    if (!c) return;
    if (c->io_running) {
        pthread_mutex_lock(&c->lock);
        c->io_stop = 1;
        pthread_cond_signal(&c->work);
        pthread_mutex_unlock(&c->lock);
        pthread_join(c->io, NULL);
    }
    free(c->queue);
    pthread_cond_destroy(&c->work);
    for (int i = 0; i < c->n_resident; i++) free(c->resident[i]->buf), free(c->resident[i]);
    for (int i = 0; c->fds && i < m->n_files; i++)
        if (c->fds[i] >= 0) close(c->fds[i]);
    free(c->fds), free(c->slot), free(c->resident);
    pthread_mutex_destroy(&c->lock);
    pthread_cond_destroy(&c->unpinned);
    free(c);
    m->cache = NULL;
}

static void *cache_io_main(void *arg);

static moe_status cache_open(moe_model *m, char *err, size_t errlen) {
    const moe_config *c = &m->cfg;
    uint64_t biggest = 0;
    for (int l = 0; l < c->n_layers; l++)
        for (int e = 0; m->layers[l].experts && e < c->n_experts; e++) {
            uint64_t b = expert_bytes(&m->layers[l].experts[e]);
            biggest = b > biggest ? b : biggest;
        }
    /* the experts of one step in flight at once: one per thread (experts run in parallel) */
    const uint64_t need = biggest * (uint64_t)m->opt.n_threads;
    if (m->opt.expert_budget < need)
        return fail(err, errlen, MOE_ERR_ARG, "expert budget of %zu bytes is too small: a step needs %d expert(s) of %llu bytes at once",
                    m->opt.expert_budget, m->opt.n_threads, (unsigned long long)biggest);
    struct expert_cache *k = xcalloc(1, sizeof *k);
    if (!k) return MOE_ERR_NOMEM;
    m->cache = k;
    pthread_mutex_init(&k->lock, NULL);
    pthread_cond_init(&k->unpinned, NULL);
    pthread_cond_init(&k->work, NULL);
    k->budget = m->opt.expert_budget;
    k->fds = malloc(sizeof(int) * (size_t)m->n_files);
    k->slot = xcalloc((size_t)c->n_layers * (size_t)(c->n_experts ? c->n_experts : 1), sizeof *k->slot);
    if (!k->fds || !k->slot) return MOE_ERR_NOMEM;
    for (int i = 0; i < m->n_files; i++) k->fds[i] = -1;
    for (int i = 0; i < m->n_files; i++)
        if ((k->fds[i] = open(m->files[i].path, O_RDONLY)) < 0)
            return fail(err, errlen, MOE_ERR_IO, "%s: %s", m->files[i].path, strerror(errno));
    if (m->opt.prefetch) {
        k->qcap = 4 * c->n_experts;
        if (!(k->queue = malloc(sizeof(int) * (size_t)k->qcap))) return MOE_ERR_NOMEM;
        if (pthread_create(&k->io, NULL, cache_io_main, m)) return fail(err, errlen, MOE_ERR_NOMEM, "cannot start the I/O thread");
        k->io_running = 1;
    }
    return MOE_OK;
}

/* one stretch of a mapped file into dst, with pread (short reads continued, EINTR retried) */
static int cache_read(const moe_model *m, struct expert_cache *k, const void *src, size_t n, unsigned char *dst) {
    int f = -1;
    for (int i = 0; i < m->n_files && f < 0; i++)
        if ((const unsigned char *)src >= (const unsigned char *)m->files[i].map &&
            (const unsigned char *)src + n <= (const unsigned char *)m->files[i].map + m->files[i].size)
            f = i;
    if (f < 0) return EINVAL;
    off_t off = (off_t)((const unsigned char *)src - (const unsigned char *)m->files[f].map);
    for (size_t done = 0; done < n;) {
        ssize_t r = pread(k->fds[f], dst + done, n - done, off + (off_t)done);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return errno;
        if (r == 0) return EIO; /* the file shrank underneath us */
        done += (size_t)r;
    }
    return 0;
}

static uint64_t weight_data_bytes(const moe__weight *w) { return (uint64_t)w->rows * (uint64_t)moe__row_bytes(w->type, w->cols); }

static void cache_evict(struct expert_cache *k, cache_entry *v, int n_experts) {
    k->slot[(size_t)v->li * (size_t)n_experts + (size_t)v->e] = NULL;
    for (int i = 0; i < k->n_resident; i++)
        if (k->resident[i] == v) { k->resident[i] = k->resident[--k->n_resident]; break; }
    k->used -= v->bytes;
    free(v->buf);
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

static cache_entry *cache_lru(struct expert_cache *k) {
    cache_entry *lru = NULL;
    for (int i = 0; i < k->n_resident; i++) {
        cache_entry *v = k->resident[i];
        if (!v->pins && !v->loading && (!lru || v->last_use < lru->last_use)) lru = v;
    }
    return lru;
}

/* reads the tensors of expert src into buf (laid out as in the entry's weights) */
static int cache_fill(const moe_model *m, struct expert_cache *k, const expert *src, cache_entry *v) {
    const moe__weight *w[3] = {&src->w1, &src->w2, &src->w3};
    moe__weight *dst[3] = {&v->ex.w1, &v->ex.w2, &v->ex.w3};
    size_t at = 0;
    int rc = 0;
    for (int i = 0; i < 3 && !rc; i++) {
        *dst[i] = *w[i];
        const size_t nd = (size_t)weight_data_bytes(w[i]);
        rc = cache_read(m, k, w[i]->data, nd, v->buf + at);
        dst[i]->data = v->buf + at;
        at += nd;
        if (!rc && w[i]->scale) {
            const size_t ns = (size_t)(w[i]->rows * (w[i]->cols / 32));
            rc = cache_read(m, k, w[i]->scale, ns, v->buf + at);
            dst[i]->scale = v->buf + at;
            at += ns;
        }
    }
    return rc;
}

/* makes expert (li, e) resident and pinned; *out is valid until cache_put */
static moe_status cache_get(const moe_model *m, int li, int e, const expert **out, moe_step_stats *stats) {
    struct expert_cache *k = m->cache;
    const int E = m->cfg.n_experts;
    const size_t id = (size_t)li * (size_t)E + (size_t)e;
    const expert *src = &m->layers[li].experts[e];
    const moe__weight *w[3] = {&src->w1, &src->w2, &src->w3};
    size_t bytes = 0;
    for (int i = 0; i < 3; i++) bytes += (size_t)weight_bytes(w[i]);
    pthread_mutex_lock(&k->lock);
    cache_entry *v;
    for (;;) {
        if ((v = k->slot[id])) {
            if (v->loading) { /* another thread is reading it: wait for the outcome */
                pthread_cond_wait(&k->unpinned, &k->lock);
                continue;
            }
            v->pins++;
            v->last_use = ++k->clock;
            v->prefetched = 0;
            if (stats) stats->cache_hits++;
            *out = &v->ex;
            pthread_mutex_unlock(&k->lock);
            return MOE_OK;
        }
        if (k->used + bytes <= k->budget) break;
        cache_entry *lru = cache_lru(k); /* evict the least recently used unpinned expert */
        if (lru) cache_evict(k, lru, E);
        /* all pinned by steps running on other threads (each holds at most one while it asks
         * for another, and the budget holds one per thread of a step): wait for one to go */
        else pthread_cond_wait(&k->unpinned, &k->lock);
    }
    if (cache_room(k)) { pthread_mutex_unlock(&k->lock); return MOE_ERR_NOMEM; }
    v = xcalloc(1, sizeof *v);
    unsigned char *buf = v ? malloc(bytes) : NULL;
    if (!buf) {
        free(v);
        pthread_mutex_unlock(&k->lock);
        return MOE_ERR_NOMEM;
    }
    /* reserve the slot and the bytes, then read without the lock: other threads read other
     * experts at the same time, and wait for this one if they want it too */
    v->li = li, v->e = e, v->pins = 1, v->loading = 1, v->last_use = ++k->clock, v->bytes = bytes, v->buf = buf;
    k->slot[id] = v;
    k->resident[k->n_resident++] = v;
    k->used += bytes;
    k->peak = k->used > k->peak ? k->used : k->peak;
    const int inject = k->fail_after > 0 && --k->fail_after == 0;
    pthread_mutex_unlock(&k->lock);

    double t0 = now_sec();
    int rc = inject ? EIO : cache_fill(m, k, src, v);
    const double dt = now_sec() - t0;

    pthread_mutex_lock(&k->lock);
    if (stats) stats->io_seconds += dt;
    if (rc) { /* a failed read leaves nothing behind: the slot is free for a later try */
        cache_evict(k, v, E);
        pthread_cond_broadcast(&k->unpinned);
        pthread_mutex_unlock(&k->lock);
        return MOE_ERR_IO;
    }
    v->loading = 0;
    if (stats) stats->cache_misses++, stats->bytes_read += bytes;
    pthread_cond_broadcast(&k->unpinned);
    *out = &v->ex;
    pthread_mutex_unlock(&k->lock);
    return MOE_OK;
}

static void cache_put(const moe_model *m, int li, int e) {
    struct expert_cache *k = m->cache;
    pthread_mutex_lock(&k->lock);
    cache_entry *v = k->slot[(size_t)li * (size_t)m->cfg.n_experts + (size_t)e];
    if (v && v->pins > 0 && --v->pins == 0) pthread_cond_broadcast(&k->unpinned);
    pthread_mutex_unlock(&k->lock);
}

void moe__fail_expert_read(moe_model *m, int n) {
    if (!m || !m->cache) return;
    pthread_mutex_lock(&m->cache->lock);
    m->cache->fail_after = n > 0 ? n : 0;
    pthread_mutex_unlock(&m->cache->lock);
}

void moe__expert_cache_usage(const moe_model *m, size_t *now, size_t *peak) {
    *now = *peak = 0;
    if (!m || !m->cache) return;
    pthread_mutex_lock(&m->cache->lock);
    *now = m->cache->used, *peak = m->cache->peak;
    pthread_mutex_unlock(&m->cache->lock);
}


/* The I/O thread: takes queued expert ids and reads each into room that is free or can be made
 * by evicting an unused expert (never by waiting: a prefetch that does not fit is dropped). */
static void *cache_io_main(void *arg) {
    const moe_model *m = arg;
    struct expert_cache *k = m->cache;
    const int E = m->cfg.n_experts;
    pthread_mutex_lock(&k->lock);
    for (;;) {
        while (!k->io_stop && !k->qn) pthread_cond_wait(&k->work, &k->lock);
        if (k->io_stop) break;
        const int id = k->queue[0];
        memmove(k->queue, k->queue + 1, sizeof(int) * (size_t)--k->qn);
        if (k->slot[id]) continue;
        const int li = id / E, e = id % E;
        const expert *src = &m->layers[li].experts[e];
        const size_t bytes = (size_t)expert_bytes(src);
        cache_entry *lru;
        while (k->used + bytes > k->budget && (lru = cache_lru(k))) cache_evict(k, lru, E);
        if (k->used + bytes > k->budget || cache_room(k)) continue;
        cache_entry *v = xcalloc(1, sizeof *v);
        unsigned char *buf = v ? malloc(bytes) : NULL;
        if (!buf) { free(v); continue; }
        v->li = li, v->e = e, v->loading = 1, v->prefetched = 1, v->last_use = ++k->clock, v->bytes = bytes, v->buf = buf;
        k->slot[id] = v;
        k->resident[k->n_resident++] = v;
        k->used += bytes;
        k->peak = k->used > k->peak ? k->used : k->peak;
        pthread_mutex_unlock(&k->lock);
        int rc = cache_fill(m, k, src, v);
        pthread_mutex_lock(&k->lock);
        if (rc) cache_evict(k, v, E); /* a failed prefetch leaves nothing: the step reads it itself */
        else v->loading = 0;
        pthread_cond_broadcast(&k->unpinned);
    }
    pthread_mutex_unlock(&k->lock);
    return NULL;
}

/* queues experts of layer li for the I/O thread; returns how many were queued */
static int cache_prefetch(const moe_model *m, int li, const unsigned char *want) {
    struct expert_cache *k = m->cache;
    const int E = m->cfg.n_experts;
    int queued = 0;
    pthread_mutex_lock(&k->lock);
    for (int e = 0; e < E; e++) {
        const int id = li * E + e;
        if (!want[e] || k->slot[id]) continue;
        int dup = 0;
        for (int i = 0; i < k->qn && !dup; i++) dup = k->queue[i] == id;
        if (dup || k->qn == k->qcap) continue;
        k->queue[k->qn++] = id;
        queued++;
    }
    if (queued) pthread_cond_signal(&k->work);
    pthread_mutex_unlock(&k->lock);
    return queued;
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
        int mapped = 0;
        for (int f = 0; f < m->n_files && !mapped; f++)
            mapped = p >= (const unsigned char *)m->files[f].map && p + n <= (const unsigned char *)m->files[f].map + m->files[f].size;
        if (!mapped) return;
        advise_willneed(p, n);
        if (w[i]->scale) advise_willneed(w[i]->scale, (size_t)(w[i]->rows * (w[i]->cols / 32)));
    }
}

/* The one way the forward pass reaches a routed expert: through the mapping (MMAP mode) or the
 * cache (CACHE mode; the expert stays pinned until expert_put). */
static moe_status expert_get(const moe_model *m, int li, int e, const expert **out, moe_step_stats *stats) {
    if (m->cache) return cache_get(m, li, e, out, stats);
    *out = &m->layers[li].experts[e];
    return MOE_OK;
}

static void expert_put(const moe_model *m, int li, int e) {
    if (m->cache) cache_put(m, li, e);
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

/* pred/pred_layer: the experts predicted for layer *pred_layer by the previous MoE layer (CACHE
 * mode prefetch); checked against this layer's routing, then replaced by this layer's guess for
 * the next MoE layer. */
static moe_status moe_ffn_forward(const moe_model *m, int li, const float *x, int n, float *out,
                                  const int32_t *const *forced, int32_t *ids, moe_step_stats *stats,
                                  unsigned char *pred, int *pred_layer) {
    const moe_config *c = &m->cfg;
    const layer *L = &m->layers[li];
    const int d = c->hidden_size, E = c->n_experts, K = c->n_active, Ie = c->moe_intermediate_size;
    const int de = c->latent_dim ? c->latent_dim : d;
    moe_status st = MOE_OK;
    size_t nk = (size_t)n * K;
    float *logits = malloc(sizeof(float) * ((size_t)n * E + 4 * (size_t)E + nk + (size_t)n * de * 2 +
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
    if (pred && m->cache && m->opt.prefetch) {
        /* guess the next MoE layer's experts with its router on this hidden state, and have the
         * I/O thread read them while this layer and the next attention compute */
        int nl = li + 1;
        while (nl < c->n_layers && !m->layer_moe[nl]) nl++;
        int32_t *pids = nl < c->n_layers ? malloc(sizeof(int32_t) * nk) : NULL;
        float *pw = pids ? malloc(sizeof(float) * nk) : NULL;
        *pred_layer = -1;
        if (pw && !matmul(m, logits, x, n, &m->layers[nl].router)) {
            route_rows(c, logits, m->layers[nl].router_bias, n, NULL, pids, pw, work);
            memset(pred, 0, (size_t)E);
            for (size_t i = 0; i < nk; i++) pred[pids[i]] = 1;
            *pred_layer = nl;
            const int q = cache_prefetch(m, nl, pred);
            if (stats) stats->prefetch_issued += (uint64_t)q;
        }
        free(pids), free(pw);
    }
    /* 5. group the rows by expert (counting sort: experts in id order, rows in row order) */
    for (size_t i = 0; i < nk; i++) cnt[ids[i] + 1]++;
    for (int e = 0; e < E; e++) cnt[e + 1] += cnt[e];
    {
        int *fill = malloc(sizeof(int) * (size_t)E);
        if (!fill) { st = MOE_ERR_NOMEM; goto done; }
        memcpy(fill, cnt, sizeof(int) * (size_t)E);
        for (size_t i = 0; i < nk; i++) {
            int slot = fill[ids[i]]++;
            rows[slot] = (int)(i / K);
            rw[slot] = wts[i];
        }
        free(fill);
    }
    if (c->latent_dim) MM(xe, x, n, &L->lat_down);
    else memcpy(xe, x, sizeof(float) * (size_t)n * d);
    memset(ye, 0, sizeof(float) * (size_t)n * de);
    /* Few rows per expert (decode, lockstep decode): the experts run in parallel, one thread
     * each, each product single-threaded; many rows (prefill): one expert at a time with its
     * rows split across threads. Outputs are added in expert order either way, so results do
     * not depend on the path or the thread count. */
    int na = 0, maxce = 0;
    for (int e = 0; e < E; e++) {
        const int ce = cnt[e + 1] - cnt[e];
        na += ce > 0, maxce = ce > maxce ? ce : maxce;
        if (ce) expert_advise(m, li, e);
    }
    const int nt = m->opt.n_threads, by_expert = nt > 1 && na > 1 && maxce <= 8;
    float *eb = by_expert ? malloc(sizeof(float) * nk * (2 * (size_t)de + 2 * (size_t)Ie)) : NULL;
    if (by_expert && !eb) { st = MOE_ERR_NOMEM; goto done; }
    (void)nt;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (by_expert)
#endif
    for (int e = 0; e < E; e++) {
        const int c0 = cnt[e], ce = cnt[e + 1] - c0;
        if (!ce || !by_expert) continue;
        const expert *ex;
        float *bx = eb + (size_t)c0 * (2 * (size_t)de + 2 * (size_t)Ie), *ba = bx + (size_t)ce * de, *bb = ba + (size_t)ce * Ie, *bo = bb + (size_t)ce * Ie;
        moe_status es = expert_get(m, li, e, &ex, stats);
        const int got = !es;
        for (int i = 0; i < ce && !es; i++) memcpy(bx + (size_t)i * de, xe + (size_t)rows[c0 + i] * de, sizeof(float) * de);
        if (!es) es = matmul_nt(m, ba, bx, de, ce, &ex->w1, 1);
        if (!es) es = matmul_nt(m, bb, bx, de, ce, &ex->w3, 1);
        if (!es) glu(c, ba, bb, (int64_t)ce * Ie);
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
            MM(ga, gx, ce, &ux->w1);
            MM(gb, gx, ce, &ux->w3);
            glu(c, ga, gb, (int64_t)ce * Ie);
            MM(go, ga, ce, &ux->w2);
            expert_put(m, li, e);
            if (st) break;
        }
        for (int i = 0; i < ce; i++) {
            float *yr = ye + (size_t)rows[c0 + i] * de, w = rw[c0 + i];
            const float *orow = res + (size_t)i * de;
            for (int j = 0; j < de; j++) yr[j] += w * orow[j];
        }
        if (stats) {
            stats->expert_rows += (uint64_t)ce;
            stats->expert_loads++;
            stats->expert_bytes += expert_bytes(ex);
        }
    }
    free(eb);
    if (st) goto done;
    if (c->latent_dim) {
        if (c->latent_norm) rmsnorm_rows(ye, ye, L->lat_norm, n, de, c->rms_norm_eps);
        MM(out, ye, n, &L->lat_up);
    } else {
        memcpy(out, ye, sizeof(float) * (size_t)n * d);
    }
    /* 6. shared experts on the full-width input */
    if (c->n_shared) {
        float *sh = malloc(sizeof(float) * (size_t)n * d);
        if (!sh) { st = MOE_ERR_NOMEM; goto done; }
        st = ffn_forward(m, &L->gate, &L->up, &L->down, x, n, sh);
        for (size_t i = 0; i < (size_t)n * d; i++) out[i] += sh[i];
        free(sh);
    }
done:
    free(logits);
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

static moe_status forward(moe_model *m, segment *sg, int nsg, int R, moe_step_stats *stats) {
    const moe_config *c = &m->cfg;
    const int d = c->hidden_size, Lc = c->n_layers, B = c->attn_res_block, V = c->vocab_size;
    const int nbmax = B ? Lc / B + 2 : 0, K = c->n_active;
    const size_t Rd = (size_t)R * d;
    moe_status st = MOE_OK;
    float *h = malloc(sizeof(float) * Rd * (4 + (size_t)nbmax));
    int32_t *ids = c->n_experts ? malloc(sizeof(int32_t) * (size_t)R * K) : NULL;
    const int32_t **frc = NULL;
    unsigned char *pred = c->n_experts ? calloc((size_t)c->n_experts, 1) : NULL;
    int pred_layer = -1;
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
        const layer *L = &m->layers[li];
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
            st = L->kind == MOE_LAYER_KDA ? kda_forward(m, L, s, li, xi, sg[i].n, oi)
                                          : mla_forward(m, L, s, li, xi, sg[i].n, oi);
        }
        if (st) goto done;
        if (p_none) memcpy(h, out, sizeof(float) * Rd);
        else for (size_t i = 0; i < Rd; i++) h[i] += out[i];
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
            st = moe_ffn_forward(m, li, x, R, out, frc, ids, stats, pred, &pred_layer);
        }
        else st = ffn_forward(m, &L->gate, &L->up, &L->down, x, R, out);
        if (st) goto done;
        for (size_t i = 0; i < Rd; i++) h[i] += out[i];
        for (int i = 0; i < nsg; i++) { /* routing trace */
            moe_seq *q = sg[i].q;
            if (!q->routes) continue;
            for (int t = 0; t < sg[i].n; t++) {
                int32_t *dst = q->routes + ((size_t)(sg[i].start + t) * Lc + li) * K;
                for (int kk = 0; kk < K; kk++) dst[kk] = L->moe ? ids[(size_t)(sg[i].row0 + t) * K + kk] : -1;
            }
        }
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
    free(h);
    free(ids);
    free(frc);
    free(pred);
    return st;
}

moe_status moe_step(moe_model *m, moe_seq *seqs, int n_seqs, moe_step_stats *stats, char *err,
                    size_t errlen) {
    if (err && errlen) err[0] = 0;
    if (!m || (!seqs && n_seqs) || n_seqs < 0) return fail(err, errlen, MOE_ERR_ARG, "moe_step: NULL model or sequences");
    const moe_config *c = &m->cfg;
    double t0 = now_sec();
    moe_step_stats local;
    memset(&local, 0, sizeof local);
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
    if (st) {
        for (int i = 0; i < n_seqs; i++) moe_session_reset(seqs[i].s);
        fail(err, errlen, st, "moe_step: %s during the forward pass; the sessions were reset", moe_status_str(st));
    }
    free(sg);
    free(done_tok);
    local.n_tokens = total;
    local.seconds = now_sec() - t0;
    if (stats) *stats = local;
    return st;
}

/* ==== sessions ================================================================================ */

void moe_session_free(moe_session *s) {
    if (!s) return;
    const int L = s->m->cfg.n_layers;
    for (int i = 0; i < L; i++) {
        if (s->kda_state) free(s->kda_state[i]);
        if (s->conv_tail) free(s->conv_tail[i]);
        if (s->mla_cache) free(s->mla_cache[i]);
    }
    free(s->kda_state);
    free(s->conv_tail);
    free(s->mla_cache);
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
    s->mla_cap = xcalloc((size_t)L, sizeof *s->mla_cap);
    int ok = s->kda_state && s->conv_tail && s->mla_cache && s->mla_cap;
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
        if (src->mla_cache[i] && src->pos) memcpy(dst->mla_cache[i], src->mla_cache[i], sizeof(float) * cw * (size_t)src->pos);
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

static int cand_desc(const void *a, const void *b) {
    const cand *x = a, *y = b;
    if (x->p != y->p) return x->p > y->p ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
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

static int32_t sample_from(const float *logits, int n_vocab, const moe_sampler *sp, uint64_t *rng) {
    int32_t best = 0;
    for (int i = 1; i < n_vocab; i++)
        if (logits[i] > logits[best]) best = i;
    if (!sp || !(sp->temperature > 0) || !rng) return best;
    cand *cs = malloc(sizeof *cs * (size_t)n_vocab);
    if (!cs) return best; /* no memory: fall back to greedy rather than fail the caller */
    for (int i = 0; i < n_vocab; i++) cs[i] = (cand){logits[i], i};
    qsort(cs, (size_t)n_vocab, sizeof *cs, cand_desc);
    int n = n_vocab;
    if (sp->top_k > 0 && sp->top_k < n) n = sp->top_k;
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
    sum = 0;
    for (int i = 0; i < n; i++) sum += cs[i].p;
    double u = (double)(rng_next(rng) >> 11) / 9007199254740992.0 * sum, acc = 0;
    int32_t pick = cs[n - 1].id;
    for (int i = 0; i < n; i++) {
        acc += cs[i].p;
        if (u < acc) { pick = cs[i].id; break; }
    }
    free(cs);
    return pick;
}
