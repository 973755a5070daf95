/* moe-batch: offline batch inference over OpenAI Batch JSONL files.
 *
 *   moe-batch -m MODEL -i IN.jsonl -o OUT.jsonl [--shard I/N] [-t THREADS] [--parallel P]
 *             [-c CTX] [--max-tokens N]
 *
 * Each input line is {"custom_id", "method": "POST", "url": "/v1/chat/completions" or
 * "/v1/completions", "body": {"messages" | "prompt", "max_tokens", "temperature", "top_p", "seed",
 * "stop", "logprobs", ...}}. Each answer is one output line {"id", "custom_id", "response": {"status_code",
 * "request_id", "body"}, "error"}, appended whole. A malformed line or a failing request gets an
 * error line and the rest go on. Rerunning with the same output file skips the requests already
 * answered (a torn last line left by a crash is cut off first), so a job killed at any moment and
 * rerun answers every request exactly once. --shard I/N keeps the requests whose custom_id hashes
 * to I of N, so N machines can share one job.
 *
 * Up to P requests decode at once in lockstep through one batched step (their rows share every
 * expert loaded for that step), new requests join as others finish, and a prompt prefix shared
 * by all requests is computed once and copied into each sequence. Sampling is seeded from the
 * request's seed, or its custom_id, so a request's draws do not depend on its slot. With
 * "logprobs", each sampled token's log probability (and the best alternatives') is written in
 * OpenAI's form; "n" choices decode as sequences of their own, answered together.
 *
 * Exit 0 when every request of the shard has an answer, 1 on errors (input unreadable, output
 * not writable, a failed step: rerun to finish), 2 on usage errors. Uses the library's internal
 * JSON reader (MOE_INTERNAL). */
#define _POSIX_C_SOURCE 200809L
#define MOE_INTERNAL
#include "../moe.h"
#include "cache_flags.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static int usage(const char *msg) {
    if (msg) fprintf(stderr, "moe-batch: %s\n", msg);
    fprintf(msg ? stderr : stdout,
            "usage: moe-batch -m MODEL -i IN.jsonl -o OUT.jsonl [options]\n"
            "  -m MODEL         checkpoint directory, .safetensors file or .gguf (with its tokenizer)\n"
            "  -i IN.jsonl      OpenAI Batch input: one request per line\n"
            "  -o OUT.jsonl     answers are appended here; rerun to finish an interrupted job\n"
            "  --shard I/N      answer only the requests whose custom_id falls in shard I of N (0 <= I < N)\n"
            "  -t THREADS       worker threads (default 1)\n"
            "  --parallel P     requests decoded at once in lockstep (default 8)\n"
            "  -c CTX           context per request: prompt + max_tokens must fit (default 4096)\n"
            "  --max-tokens N   for requests without max_tokens (default 256)\n"
            "  --model-name S   the \"model\" field of the answers (default: the model path's last part)\n"
            "  --load-mode M, --expert-budget SIZE, --dense-budget SIZE, --io-threads N, --prefetch on|off,\n"
            "  --kv-type f32|bf16|q8, --mxfp4 f32|int8, --act 8|16,\n"
            "  --kernels NAME   as in moe-cli\n");
    return msg ? 2 : 0;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint64_t fnv(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return h;
}

/* ---- growable text ---- */

typedef struct {
    char *s;
    size_t n, cap;
    int oom;
} buf;

static void bput(buf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = realloc(b->s, cap);
        if (!p) { b->oom = 1; return; }
        b->s = p, b->cap = cap;
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = 0;
}

static void bprintf(buf *b, const char *fmt, ...) {
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (k > 0) bput(b, tmp, (size_t)k < sizeof tmp ? (size_t)k : sizeof tmp - 1);
}

/* a JSON string; bytes that are not valid UTF-8 become U+FFFD (as the vendor's decode does) */
static void bjson_str(buf *b, const char *s, size_t n) {
    bput(b, "\"", 1);
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x80) {
            size_t v = moe_utf8_valid_prefix(s + i, n - i < 4 ? n - i : 4);
            size_t len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
            if (v >= len) bput(b, s + i, len), i += len;
            else bput(b, "\xEF\xBF\xBD", 3), i++;
            continue;
        }
        if (c == '"') bput(b, "\\\"", 2);
        else if (c == '\\') bput(b, "\\\\", 2);
        else if (c == '\n') bput(b, "\\n", 2);
        else if (c == '\r') bput(b, "\\r", 2);
        else if (c == '\t') bput(b, "\\t", 2);
        else if (c < 0x20 || c == 0x7F) bprintf(b, "\\u%04x", c);
        else bput(b, (const char *)&c, 1);
        i++;
    }
    bput(b, "\"", 1);
}

/* ---- the output file: whole lines, appended; a failed write is cut back off ---- */

static int out_fd = -1;

static int append_line(const buf *line) {
    off_t at = lseek(out_fd, 0, SEEK_END);
    if (at < 0) return -1;
    for (size_t done = 0; done < line->n;) {
        ssize_t w = write(out_fd, line->s + done, line->n - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            int e = w < 0 ? errno : ENOSPC;
            if (ftruncate(out_fd, at) != 0) { /* keep the file free of a torn line if at all possible */ }
            errno = e;
            return -1;
        }
        done += (size_t)w;
    }
    if (fdatasync(out_fd) != 0 && errno != EINVAL) {
        int e = errno;
        if (ftruncate(out_fd, at) != 0) { /* as above */ }
        errno = e;
        return -1;
    }
    return 0;
}

/* ---- the set of answered keys (custom_ids, or "#line N" for lines that have none) ---- */

typedef struct {
    char **keys;
    size_t cap, n;
} keyset;

static int ks_has(const keyset *k, const char *s) {
    if (!k->cap) return 0;
    for (size_t i = fnv(s, strlen(s)) & (k->cap - 1);; i = (i + 1) & (k->cap - 1)) {
        if (!k->keys[i]) return 0;
        if (!strcmp(k->keys[i], s)) return 1;
    }
}

static int ks_add(keyset *k, const char *s) {
    if (2 * (k->n + 1) > k->cap) {
        size_t cap = k->cap ? 2 * k->cap : 1024;
        char **nk = calloc(cap, sizeof *nk);
        if (!nk) return 0;
        for (size_t i = 0; i < k->cap; i++)
            if (k->keys[i]) {
                size_t j = fnv(k->keys[i], strlen(k->keys[i])) & (cap - 1);
                while (nk[j]) j = (j + 1) & (cap - 1);
                nk[j] = k->keys[i];
            }
        free(k->keys);
        k->keys = nk, k->cap = cap;
    }
    size_t i = fnv(s, strlen(s)) & (k->cap - 1);
    while (k->keys[i]) {
        if (!strcmp(k->keys[i], s)) return 1;
        i = (i + 1) & (k->cap - 1);
    }
    if (!(k->keys[i] = strdup(s))) return 0;
    k->n++;
    return 1;
}

static void ks_free(keyset *k) {
    for (size_t i = 0; i < k->cap; i++) free(k->keys[i]);
    free(k->keys);
}

/* the key of one input line: its custom_id, else its line number */
static void line_key(char *out, size_t n, const char *custom_id, long lineno) {
    if (custom_id) snprintf(out, n, "%s", custom_id);
    else snprintf(out, n, "#line %ld", lineno);
}

/* Reads the answers already in OUT: cuts a torn last line off, and collects their keys. */
static int load_answers(const char *path, keyset *done) {
    struct stat sb;
    if (fstat(out_fd, &sb) != 0) return -1;
    if (sb.st_size == 0) return 0;
    char *text = malloc((size_t)sb.st_size + 1);
    if (!text) return -1;
    size_t got = 0;
    while (got < (size_t)sb.st_size) {
        ssize_t r = pread(out_fd, text + got, (size_t)sb.st_size - got, (off_t)got);
        if (r <= 0) { free(text); return -1; }
        got += (size_t)r;
    }
    text[got] = 0;
    size_t keep = got;
    while (keep > 0 && text[keep - 1] != '\n') keep--;
    if (keep < got) {
        fprintf(stderr, "moe-batch: %s: removing a torn last line (%zu bytes) left by an interrupted run\n", path, got - keep);
        if (ftruncate(out_fd, (off_t)keep) != 0) { free(text); return -1; }
    }
    long lineno = 0;
    for (size_t i = 0; i < keep;) {
        char *e = memchr(text + i, '\n', keep - i);
        size_t len = (size_t)(e - (text + i));
        lineno++;
        moe__json *j = NULL;
        if (moe__json_parse(text + i, len, &j, NULL, 0) == MOE_OK && j->type == MOE_JSON_OBJ) {
            const moe__json *cid = moe__json_get(j, "custom_id"), *ln = moe__json_get(j, "input_line");
            char key[1100];
            if (cid && cid->type == MOE_JSON_STR) line_key(key, sizeof key, cid->str, 0);
            else if (ln && ln->type == MOE_JSON_NUM && ln->num >= 1 && ln->num <= 1e15) line_key(key, sizeof key, NULL, (long)ln->num);
            else key[0] = 0;
            if (key[0] && !ks_add(done, key)) { moe__json_free(j); free(text); return -1; }
        } else {
            fprintf(stderr, "moe-batch: %s:%ld: not an answer line; left as it is\n", path, lineno);
        }
        moe__json_free(j);
        i += len + 1;
    }
    free(text);
    return 0;
}

/* ---- requests ---- */

typedef struct {
    char *custom_id; /* NULL when the line has none */
    long lineno;
    int chat;
    int32_t *prompt;
    int n_prompt;
    int max_tokens;
    moe_sampler sp;
    uint64_t rng;
    char *stop[4];
    int n_stop;
    int logprobs; /* -1: none; else each sampled token's log probability and this many best alternatives */
    moe_chat_options co;
    int n;          /* choices ("n"): each decodes as a sequence of its own */
    int started;    /* choices given a slot so far */
    int done;       /* choices finished */
    int lead;       /* the slot of its first choice, while the others assigned with it wait for its prompt */
    long lead_pass; /* the assignment pass that gave the first choice its slot */
    int gen_total;  /* their sampled tokens */
    buf *choices;   /* each finished choice's JSON object, until the last one finishes */
} request;

static void request_free(request *r) {
    for (int i = 0; r->choices && i < r->n; i++) free(r->choices[i].s);
    free(r->choices);
    free(r->custom_id);
    free(r->prompt);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free((char *)r->co.thinking_effort);
}

static const char *model_name;
static long g_created;

/* {"id", "custom_id", "input_line"?, "response", "error"} for a request that failed */
static void error_line(buf *b, const char *custom_id, long lineno, int status, const char *type, const char *msg) {
    char rid[32];
    snprintf(rid, sizeof rid, "%016llx", (unsigned long long)fnv(custom_id ? custom_id : "", custom_id ? strlen(custom_id) : 0) ^ (unsigned long long)lineno);
    bprintf(b, "{\"id\": \"batch_req_%s\", \"custom_id\": ", rid);
    if (custom_id) bjson_str(b, custom_id, strlen(custom_id));
    else bprintf(b, "null, \"input_line\": %ld", lineno);
    if (status) {
        bprintf(b, ", \"response\": {\"status_code\": %d, \"request_id\": \"req_%s\", \"body\": {\"error\": {\"message\": ", status, rid);
        bjson_str(b, msg, strlen(msg));
        bprintf(b, ", \"type\": \"%s\"}}}, \"error\": null}\n", type);
    } else {
        bprintf(b, ", \"response\": null, \"error\": {\"code\": \"%s\", \"message\": ", type);
        bjson_str(b, msg, strlen(msg));
        bprintf(b, "}}\n");
    }
}

static int num_field(const moe__json *body, const char *key, double lo, double hi, double *out, char *why, size_t wn) {
    const moe__json *v = moe__json_get(body, key);
    if (!v || v->type == MOE_JSON_NULL) return 1;
    if (v->type != MOE_JSON_NUM || !(v->num >= lo && v->num <= hi)) {
        snprintf(why, wn, "%s must be a number in [%g, %g]", key, lo, hi);
        return 0;
    }
    *out = v->num;
    return 1;
}

/* Turns one parsed line into a request; 0 with a message in why when it is not a valid one. */
static int parse_request(request *r, const moe__json *j, const moe_tokenizer *tok, int ctx, int default_max, char *why, size_t wn) {
    const moe__json *method = moe__json_get(j, "method"), *url = moe__json_get(j, "url"), *body = moe__json_get(j, "body");
    if (method && (method->type != MOE_JSON_STR || strcmp(method->str, "POST"))) return snprintf(why, wn, "method must be POST"), 0;
    if (!url || url->type != MOE_JSON_STR) return snprintf(why, wn, "url is missing"), 0;
    if (!strcmp(url->str, "/v1/chat/completions")) r->chat = 1;
    else if (strcmp(url->str, "/v1/completions")) return snprintf(why, wn, "url must be /v1/chat/completions or /v1/completions"), 0;
    if (!body || body->type != MOE_JSON_OBJ) return snprintf(why, wn, "body must be an object"), 0;
    double v;
    r->max_tokens = default_max;
    if (!num_field(body, "max_completion_tokens", 1, 1e9, &v, why, wn) || !num_field(body, "max_tokens", 1, 1e9, &v, why, wn)) return 0;
    if (moe__json_get(body, "max_tokens") || moe__json_get(body, "max_completion_tokens")) r->max_tokens = (int)v;
    r->sp = (moe_sampler){.temperature = 1.0f, .top_p = 1.0f, .repeat_penalty = 1.0f};
    v = 1.0;
    if (!num_field(body, "temperature", 0, 2, &v, why, wn)) return 0;
    r->sp.temperature = (float)v;
    v = 1.0;
    if (!num_field(body, "top_p", 0, 1, &v, why, wn)) return 0;
    r->sp.top_p = (float)v;
    v = 0;
    if (!num_field(body, "top_k", 0, 1e9, &v, why, wn)) return 0;
    r->sp.top_k = (int)v;
    v = 0;
    if (!num_field(body, "min_p", 0, 1, &v, why, wn)) return 0;
    r->sp.min_p = (float)v;
    v = 0;
    if (!num_field(body, "presence_penalty", -2, 2, &v, why, wn)) return 0;
    r->sp.presence_penalty = (float)v;
    v = 0;
    if (!num_field(body, "frequency_penalty", -2, 2, &v, why, wn)) return 0;
    r->sp.frequency_penalty = (float)v;
    v = 1;
    if (!num_field(body, "n", 1, 128, &v, why, wn)) return 0;
    if (v != (int)v) return snprintf(why, wn, "n must be an integer"), 0;
    r->n = (int)v;
    if (!(r->choices = calloc((size_t)r->n, sizeof *r->choices))) return snprintf(why, wn, "out of memory"), 0;
    /* log probabilities: chat's "logprobs": true with "top_logprobs": N, the completions'
     * "logprobs": N (OpenAI allows 5 there, 20 in chat: both take up to 20 here) */
    r->logprobs = -1;
    const moe__json *lp = moe__json_get(body, "logprobs"), *echo = moe__json_get(body, "echo");
    if (r->chat) {
        if (lp && lp->type != MOE_JSON_BOOL && lp->type != MOE_JSON_NULL) return snprintf(why, wn, "logprobs must be true or false"), 0;
        v = -1;
        if (!num_field(body, "top_logprobs", 0, 20, &v, why, wn)) return 0;
        if (v != (int)v) return snprintf(why, wn, "top_logprobs must be an integer"), 0;
        const int on = lp && lp->type == MOE_JSON_BOOL && lp->num != 0;
        if (v >= 0 && !on) return snprintf(why, wn, "top_logprobs needs logprobs: true"), 0;
        if (on) r->logprobs = v >= 0 ? (int)v : 0;
    } else {
        v = -1;
        if (!num_field(body, "logprobs", 0, 20, &v, why, wn)) return 0;
        if (v != (int)v) return snprintf(why, wn, "logprobs must be an integer"), 0;
        r->logprobs = (int)v;
        if (echo && !(echo->type == MOE_JSON_NULL || (echo->type == MOE_JSON_BOOL && echo->num == 0)))
            return snprintf(why, wn, "echo is not supported"), 0;
    }
    const moe__json *seed = moe__json_get(body, "seed");
    if (seed && seed->type == MOE_JSON_NUM) { /* a 64-bit integer: converting anything else to int64_t is undefined */
        if (!(seed->num >= -9.2e18 && seed->num <= 9.2e18) || (double)(int64_t)seed->num != seed->num)
            return snprintf(why, wn, "seed must be a 64-bit integer"), 0;
        r->rng = (uint64_t)(int64_t)seed->num * 0x9E3779B97F4A7C15ull + 1;
    } else if (seed && seed->type != MOE_JSON_NULL) return snprintf(why, wn, "seed must be an integer"), 0;
    else r->rng = fnv(r->custom_id, strlen(r->custom_id)) | 1;
    const moe__json *stop = moe__json_get(body, "stop");
    if (stop && stop->type == MOE_JSON_STR) {
        if (*stop->str) r->stop[r->n_stop++] = strdup(stop->str);
    } else if (stop && stop->type == MOE_JSON_ARR) {
        if (stop->n > 4) return snprintf(why, wn, "stop: at most 4 strings"), 0;
        for (const moe__json *s = stop->child; s; s = s->next) {
            if (s->type != MOE_JSON_STR) return snprintf(why, wn, "stop must be a string or a list of strings"), 0;
            if (*s->str) r->stop[r->n_stop++] = strdup(s->str);
        }
    } else if (stop && stop->type != MOE_JSON_NULL) {
        return snprintf(why, wn, "stop must be a string or a list of strings"), 0;
    }
    for (int i = 0; i < r->n_stop; i++)
        if (!r->stop[i]) return snprintf(why, wn, "out of memory"), 0;
    /* the prompt */
    char err[512];
    size_t n = 0, cap = (size_t)ctx + 1;
    if (!(r->prompt = malloc(cap * sizeof *r->prompt))) return snprintf(why, wn, "out of memory"), 0;
    moe_status st;
    if (r->chat) {
        if (!moe__json_get(body, "messages")) return snprintf(why, wn, "a chat request needs body.messages"), 0;
        if (!tok) return snprintf(why, wn, "the model ships no tokenizer, so chat requests cannot be encoded"), 0;
        r->co = moe_chat_default_options();
        const moe__json *eff = moe__json_get(body, "reasoning_effort");
        if (eff && eff->type == MOE_JSON_STR) {
            if (!strcmp(eff->str, "none")) r->co.thinking = 0;
            else if (!(r->co.thinking_effort = strdup(eff->str))) return snprintf(why, wn, "out of memory"), 0;
        }
        st = moe__chat_encode_tree(tok, body, &r->co, r->prompt, cap, &n, err, sizeof err);
    } else {
        const moe__json *p = moe__json_get(body, "prompt");
        if (p && p->type == MOE_JSON_ARR) { /* token ids */
            st = MOE_OK;
            for (const moe__json *e = p->child; e && !st; e = e->next) {
                if (e->type != MOE_JSON_NUM || e->num < 0 || e->num > 2147483647.0 || e->num != (double)(int32_t)e->num)
                    return snprintf(why, wn, "prompt: a list of prompts is not supported; give a string or one list of token ids"), 0;
                if (n < cap) r->prompt[n] = (int32_t)e->num;
                n++;
            }
            if (n > cap) st = MOE_ERR_RANGE;
        } else if (p && p->type == MOE_JSON_STR) {
            if (!tok) return snprintf(why, wn, "the model ships no tokenizer; give the prompt as token ids"), 0;
            st = moe_tokenize(tok, p->str, strlen(p->str), 0, r->prompt, cap, &n, err, sizeof err);
        } else {
            return snprintf(why, wn, "a completion request needs body.prompt (a string or a list of token ids)"), 0;
        }
    }
    if (st == MOE_ERR_RANGE || (!st && (int)n + r->max_tokens > ctx)) {
        snprintf(why, wn, "the prompt (%zu tokens) and max_tokens (%d) do not fit the context of %d tokens", n, r->max_tokens, ctx);
        return 0;
    }
    if (st) return snprintf(why, wn, "%s", err), 0;
    if (n == 0) return snprintf(why, wn, "the prompt is empty"), 0;
    r->n_prompt = (int)n;
    return 1;
}

/* ---- decoding slots ---- */

typedef struct {
    request *r;
    int choice;         /* which of r's choices */
    /* -1: computes r's prompt itself (its first choice); >= 0: the slot computing it in this step,
     * whose state and logits this one takes after the step; -2: takes them from the copy kept
     * for r's later choices */
    int leader;
    moe_sampler sp;     /* r's sampler, with this sequence's recent tokens */
    uint64_t rng;       /* this choice's generator */
    moe_session *s;
    int fed;            /* prompt tokens already in the session */
    int gen;            /* tokens sampled */
    int32_t last;       /* the token to feed next */
    const float *lrow;  /* the logits it samples from: its row of the step's, or another's */
    int32_t pick;       /* the token sampled from them */
    int32_t *hist;      /* prompt + generated, for penalties */
    /* with logprobs: per sampled token its log probability, its text's offset in content, and
     * the request's logprobs best alternatives (ids and log probabilities) */
    float *lp, *alt_lp;
    int32_t *alt;
    size_t *offset;
    buf content, reasoning;
    moe_chat_reply rep;
    const char *finish; /* set when done */
} slot;

/* Log probabilities of the raw logits l[0..V) (before temperature and penalties, as OpenAI
 * reports them): the pick's into *lp, the n best tokens (highest first, ties by id) into alt and
 * their log probabilities into alt_lp. */
static void logprobs_of(const float *l, int V, int32_t pick, int n, float *lp, int32_t *alt, float *alt_lp) {
    float mx = -INFINITY;
    for (int i = 0; i < V; i++)
        if (l[i] > mx) mx = l[i];
    double sum = 0;
    for (int i = 0; i < V; i++) sum += exp((double)l[i] - mx);
    const double lse = mx + log(sum);
    *lp = (float)(l[pick] - lse);
    int have = 0;
    for (int i = 0; i < V && n > 0; i++) {
        if (have == n && !(l[i] > l[alt[n - 1]])) continue;
        int j = have < n ? have++ : n - 1;
        for (; j > 0 && l[i] > l[alt[j - 1]]; j--) alt[j] = alt[j - 1];
        alt[j] = i;
    }
    for (int j = 0; j < have; j++) alt_lp[j] = (float)(l[alt[j]] - lse);
}

static int slot_check_stop(slot *sl) {
    int stopped = 0;
    if (!sl->r->n_stop || !sl->content.n) return 0;
    size_t cut = moe_text_ready(sl->content.s, sl->content.n, (const char *const *)sl->r->stop, sl->r->n_stop, 1, &stopped);
    if (stopped) sl->content.n = cut, sl->content.s[cut] = 0;
    return stopped;
}

/* a log probability as JSON (-9999 for a token the model rules out, as OpenAI writes it) */
static void blogprob(buf *b, float v) { bprintf(b, "%.9g", isfinite(v) ? (double)v : -9999.0); }

/* token t's text: its bytes, or its id where the model has no tokenizer */
static const char *token_text(const moe_tokenizer *tok, int32_t t, char *idbuf, size_t n, size_t *len) {
    const char *p = tok ? moe_token_bytes(tok, t, len) : NULL;
    if (p) return p;
    *len = (size_t)snprintf(idbuf, n, "%d", (int)t);
    return idbuf;
}

/* chat's {"token", "logprob", "bytes"} of token t (the bytes as numbers: a token may hold part of
 * a character) */
static void chat_token_lp(buf *b, const moe_tokenizer *tok, int32_t t, float lp) {
    char idb[16];
    size_t len = 0;
    const char *p = token_text(tok, t, idb, sizeof idb, &len);
    bprintf(b, "\"token\": ");
    bjson_str(b, p, len);
    bprintf(b, ", \"logprob\": ");
    blogprob(b, lp);
    bprintf(b, ", \"bytes\": [");
    for (size_t i = 0; i < len; i++) bprintf(b, i ? ", %u" : "%u", (unsigned char)p[i]);
    bprintf(b, "]");
}

/* the choice's "logprobs": one entry per sampled token (completion_tokens of them, the reasoning
 * and a closing end-of-turn token included), chat's or the completions' form */
static void logprobs_json(buf *b, const slot *sl, const moe_tokenizer *tok) {
    const request *r = sl->r;
    const int32_t *gen = sl->hist + r->n_prompt;
    const int n = r->logprobs;
    char idb[16];
    size_t len = 0;
    if (r->logprobs < 0) {
        bprintf(b, "\"logprobs\": null, ");
        return;
    }
    if (r->chat) {
        bprintf(b, "\"logprobs\": {\"content\": [");
        for (int i = 0; i < sl->gen; i++) {
            bprintf(b, i ? ", {" : "{");
            chat_token_lp(b, tok, gen[i], sl->lp[i]);
            bprintf(b, ", \"top_logprobs\": [");
            for (int j = 0; j < n; j++) {
                bprintf(b, j ? ", {" : "{");
                chat_token_lp(b, tok, sl->alt[(size_t)i * n + j], sl->alt_lp[(size_t)i * n + j]);
                bprintf(b, "}");
            }
            bprintf(b, "]}");
        }
        bprintf(b, "], \"refusal\": null}, ");
        return;
    }
    bprintf(b, "\"logprobs\": {\"tokens\": [");
    for (int i = 0; i < sl->gen; i++) {
        const char *p = token_text(tok, gen[i], idb, sizeof idb, &len);
        if (i) bprintf(b, ", ");
        bjson_str(b, p, len);
    }
    bprintf(b, "], \"token_logprobs\": [");
    for (int i = 0; i < sl->gen; i++) {
        if (i) bprintf(b, ", ");
        blogprob(b, sl->lp[i]);
    }
    bprintf(b, "], \"top_logprobs\": ");
    if (n > 0) {
        bprintf(b, "[");
        for (int i = 0; i < sl->gen; i++) {
            bprintf(b, i ? ", {" : "{");
            for (int j = 0; j < n; j++) {
                const char *p = token_text(tok, sl->alt[(size_t)i * n + j], idb, sizeof idb, &len);
                if (j) bprintf(b, ", ");
                bjson_str(b, p, len);
                bprintf(b, ": ");
                blogprob(b, sl->alt_lp[(size_t)i * n + j]);
            }
            bprintf(b, "}");
        }
        bprintf(b, "]");
    } else {
        bprintf(b, "null");
    }
    bprintf(b, ", \"text_offset\": [");
    for (int i = 0; i < sl->gen; i++) bprintf(b, i ? ", %zu" : "%zu", sl->offset[i]);
    bprintf(b, "]}, ");
}

/* choice k's generator: the request's own for the first, so that n = 1 draws as before; the
 * others from it by splitmix64's mixing */
static uint64_t choice_rng(uint64_t seed, int k) {
    if (!k) return seed;
    uint64_t z = seed + (uint64_t)k * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (z ^ (z >> 31)) | 1;
}

/* one finished choice as its JSON object, into b */
static void choice_json(buf *b, const slot *sl, const char *tool_calls, const moe_tokenizer *tok) {
    bprintf(b, "{\"index\": %d, ", sl->choice);
    if (sl->r->chat) {
        bprintf(b, "\"message\": {\"role\": \"assistant\", \"content\": ");
        bjson_str(b, sl->content.s ? sl->content.s : "", sl->content.n);
        if (sl->reasoning.n) {
            bprintf(b, ", \"reasoning_content\": ");
            bjson_str(b, sl->reasoning.s, sl->reasoning.n);
        }
        if (tool_calls) {
            bprintf(b, ", \"tool_calls\": ");
            bput(b, tool_calls, strlen(tool_calls));
        }
        bprintf(b, "}, ");
    } else {
        bprintf(b, "\"text\": ");
        bjson_str(b, sl->content.s ? sl->content.s : "", sl->content.n);
        bprintf(b, ", ");
    }
    logprobs_json(b, sl, tok);
    bprintf(b, "\"finish_reason\": \"%s\"}", tool_calls ? "tool_calls" : sl->finish);
}

/* the answer line of request r, every choice finished (the prompt counted once, as OpenAI does) */
static void answer_line(buf *b, const request *r) {
    char rid[32];
    snprintf(rid, sizeof rid, "%016llx", (unsigned long long)fnv(r->custom_id, strlen(r->custom_id)));
    bprintf(b, "{\"id\": \"batch_req_%s\", \"custom_id\": ", rid);
    bjson_str(b, r->custom_id, strlen(r->custom_id));
    bprintf(b, ", \"response\": {\"status_code\": 200, \"request_id\": \"req_%s\", \"body\": {\"id\": \"%s-%s\", \"object\": \"%s\", "
               "\"created\": %ld, \"model\": ", rid, r->chat ? "chatcmpl" : "cmpl", rid, r->chat ? "chat.completion" : "text_completion", g_created);
    bjson_str(b, model_name, strlen(model_name));
    bprintf(b, ", \"choices\": [");
    for (int i = 0; i < r->n; i++) {
        if (i) bprintf(b, ", ");
        bput(b, r->choices[i].s, r->choices[i].n);
    }
    bprintf(b, "], \"usage\": {\"prompt_tokens\": %d, \"completion_tokens\": %d, \"total_tokens\": %d}}}, \"error\": null}\n", r->n_prompt,
            r->gen_total, r->n_prompt + r->gen_total);
}

static int parse_shard(const char *s, int *i, int *n) {
    char *e;
    long a = strtol(s, &e, 10);
    if (e == s || *e != '/') return 0;
    long b = strtol(e + 1, &e, 10);
    if (*e || b < 1 || b > 1000000 || a < 0 || a >= b) return 0;
    *i = (int)a, *n = (int)b;
    return 1;
}


int main(int argc, char **argv) {
    const char *model = NULL, *in_path = NULL, *out_path = NULL;
    int shard_i = 0, shard_n = 1, parallel = 8, ctx = 4096, default_max = 256;
    moe_options opt = moe_default_options();
    for (int i = 1; i < argc; i++) {
        const char *why = NULL;
        int ck;
        const char *a = argv[i];
        int more = i + 1 < argc;
        char *e;
        if (!strcmp(a, "-m") && more) model = argv[++i];
        else if (!strcmp(a, "-i") && more) in_path = argv[++i];
        else if (!strcmp(a, "-o") && more) out_path = argv[++i];
        else if (!strcmp(a, "--shard") && more) { if (!parse_shard(argv[++i], &shard_i, &shard_n)) return usage("--shard is I/N with 0 <= I < N"); }
        else if (!strcmp(a, "-t") && more) { opt.n_threads = (int)strtol(argv[++i], &e, 10); if (*e || opt.n_threads < 1 || opt.n_threads > 1024) return usage("bad -t"); }
        else if (!strcmp(a, "--parallel") && more) { parallel = (int)strtol(argv[++i], &e, 10); if (*e || parallel < 1 || parallel > 1024) return usage("bad --parallel"); }
        else if (!strcmp(a, "-c") && more) { ctx = (int)strtol(argv[++i], &e, 10); if (*e || ctx < 2 || ctx > 100000000) return usage("bad -c"); }
        else if (!strcmp(a, "--max-tokens") && more) { default_max = (int)strtol(argv[++i], &e, 10); if (*e || default_max < 1) return usage("bad --max-tokens"); }
        else if (!strcmp(a, "--model-name") && more) model_name = argv[++i];
        else if ((ck = cache_flag(argc, argv, &i, &opt, &why)) != 0) {
            if (ck < 0) return usage(why);
        } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) return usage(NULL);
        else return usage("unknown, incomplete or out-of-range argument");
    }
    if (!model || !in_path || !out_path) return usage("-m, -i and -o are required");
    if (!model_name) {
        const char *sl = strrchr(model, '/');
        model_name = sl && sl[1] ? sl + 1 : model;
    }
    g_created = (long)time(NULL);

    int rc = 1;
    char err[512];
    moe_model *m = NULL;
    moe_tokenizer *tok = NULL;
    keyset done = {0}, seen = {0};
    request *reqs = NULL;
    slot *slots = NULL;
    moe_session *prefix = NULL;
    /* the state and last logits of the prompt of reqs[next] while it still has choices to start
     * (only that request can), for the choices that get slots in later passes */
    moe_session *kept = NULL;
    float *kept_logits = NULL;
    float *logits = NULL;
    moe_seq *seqs = NULL;
    char *input = NULL;
    buf line = {0};
    size_t n_reqs = 0, cap_reqs = 0;

    /* the input, read whole and checked before anything is written */
    FILE *f = fopen(in_path, "rb");
    if (!f) { fprintf(stderr, "moe-batch: %s: %s\n", in_path, strerror(errno)); return 1; }
    buf inb = {0};
    char chunk[1 << 16];
    size_t r;
    while ((r = fread(chunk, 1, sizeof chunk, f)) > 0) bput(&inb, chunk, r);
    int bad_read = ferror(f) || inb.oom;
    fclose(f);
    input = inb.s;
    if (bad_read) { fprintf(stderr, "moe-batch: %s: read error\n", in_path); goto out; }

    out_fd = open(out_path, O_RDWR | O_CREAT | O_APPEND, 0644);
    if (out_fd < 0) { fprintf(stderr, "moe-batch: %s: %s\n", out_path, strerror(errno)); goto out; }
    if (load_answers(out_path, &done)) { fprintf(stderr, "moe-batch: %s: %s\n", out_path, strerror(errno)); goto out; }

    moe_status st = moe_model_open(&m, model, &opt, err, sizeof err);
    if (st) { fprintf(stderr, "moe-batch: %s: %s\n", moe_status_str(st), err); goto out; }
    if (moe_tokenizer_for_model(&tok, m, err, sizeof err)) {
        fprintf(stderr, "moe-batch: %s: only completion requests with token-id prompts can be answered\n", err);
        tok = NULL;
    }
    const moe_config *c = moe_model_config(m);

    /* pass 1: duplicate custom_ids anywhere in the input are refused before any work */
    long lineno = 0, n_lines = 0, n_before = 0, n_errors = 0;
    for (char *p = input; p && *p;) {
        char *e = strchr(p, '\n');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        lineno++;
        moe__json *j = NULL;
        if (len && moe_utf8_valid_prefix(p, len) == len && moe__json_parse(p, len, &j, NULL, 0) == MOE_OK && j->type == MOE_JSON_OBJ) {
            const moe__json *cid = moe__json_get(j, "custom_id");
            if (cid && cid->type == MOE_JSON_STR) {
                if (ks_has(&seen, cid->str)) {
                    fprintf(stderr, "moe-batch: %s:%ld: custom_id \"%.200s\" appears twice; every request needs its own custom_id\n", in_path,
                            lineno, cid->str);
                    moe__json_free(j);
                    goto out;
                }
                if (!ks_add(&seen, cid->str)) { moe__json_free(j); fprintf(stderr, "moe-batch: out of memory\n"); goto out; }
            }
        }
        moe__json_free(j);
        p = e ? e + 1 : p + len;
    }

    /* pass 2: this shard's requests not yet answered; bad ones are answered with an error now */
    lineno = 0;
    for (char *p = input; p && *p;) {
        char *e = strchr(p, '\n');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        char *text = p;
        p = e ? e + 1 : p + len;
        lineno++;
        while (len && (text[len - 1] == '\r' || text[len - 1] == ' ' || text[len - 1] == '\t')) len--;
        if (!len) continue; /* blank lines are not requests */
        moe__json *j = NULL;
        char why[600] = "", key[1100];
        const char *custom_id = NULL;
        int valid_utf8 = moe_utf8_valid_prefix(text, len) == len;
        if (valid_utf8 && moe__json_parse(text, len, &j, why, sizeof why) == MOE_OK) {
            const moe__json *cid = j->type == MOE_JSON_OBJ ? moe__json_get(j, "custom_id") : NULL;
            if (cid && cid->type == MOE_JSON_STR && *cid->str) custom_id = cid->str;
            else snprintf(why, sizeof why, "the line has no custom_id string");
        } else if (!valid_utf8) {
            snprintf(why, sizeof why, "the line is not valid UTF-8");
        }
        line_key(key, sizeof key, custom_id, lineno);
        const int mine = (int)(fnv(key, strlen(key)) % (uint64_t)shard_n) == shard_i;
        if (mine) n_lines++;
        if (!mine || ks_has(&done, key)) {
            if (mine) n_before++;
            moe__json_free(j);
            continue;
        }
        request rq = {0};
        rq.lineno = lineno;
        int ok = custom_id != NULL;
        if (ok) {
            rq.custom_id = strdup(custom_id);
            ok = rq.custom_id && parse_request(&rq, j, tok, ctx, default_max, why, sizeof why);
            if (rq.logprobs > c->vocab_size) rq.logprobs = c->vocab_size; /* no more alternatives than tokens */
            for (int i = 0; ok && i < rq.n_prompt; i++)
                if (rq.prompt[i] < 0 || rq.prompt[i] >= c->vocab_size) {
                    snprintf(why, sizeof why, "prompt token %d is outside the vocabulary (%d)", (int)rq.prompt[i], c->vocab_size);
                    ok = 0;
                }
        }
        moe__json_free(j);
        if (!ok) {
            line.n = 0;
            if (custom_id) error_line(&line, rq.custom_id ? rq.custom_id : custom_id, lineno, 400, "invalid_request_error", why);
            else error_line(&line, NULL, lineno, 0, "invalid_line", why);
            request_free(&rq);
            if (line.oom || append_line(&line)) { fprintf(stderr, "moe-batch: %s: %s\n", out_path, line.oom ? "out of memory" : strerror(errno)); goto out; }
            n_errors++;
            continue;
        }
        if (n_reqs == cap_reqs) {
            size_t nc = cap_reqs ? 2 * cap_reqs : 64;
            request *nr = realloc(reqs, nc * sizeof *nr);
            if (!nr) { request_free(&rq); fprintf(stderr, "moe-batch: out of memory\n"); goto out; }
            reqs = nr, cap_reqs = nc;
        }
        reqs[n_reqs++] = rq;
    }
    fprintf(stderr, "moe-batch: shard %d/%d: %ld requests: %ld answered before, %ld refused now, %zu to run, %d at a time\n", shard_i,
            shard_n, n_lines, n_before, n_errors, n_reqs, parallel);

    /* a prefix every prompt shares (a common system prompt) is computed once */
    int lcp = 0;
    if (n_reqs >= 2) {
        lcp = reqs[0].n_prompt - 1;
        for (size_t i = 1; i < n_reqs && lcp > 0; i++) {
            int k = 0;
            const int lim = reqs[i].n_prompt - 1 < lcp ? reqs[i].n_prompt - 1 : lcp;
            while (k < lim && reqs[i].prompt[k] == reqs[0].prompt[k]) k++;
            lcp = k;
        }
        if (lcp < 8) lcp = 0;
    }
    if (!(logits = malloc(sizeof(float) * (size_t)c->vocab_size * (size_t)parallel)) || !(seqs = calloc((size_t)parallel, sizeof *seqs)) ||
        !(slots = calloc((size_t)parallel, sizeof *slots))) {
        fprintf(stderr, "moe-batch: out of memory\n");
        goto out;
    }
    moe_step_stats stats;
    if (lcp) {
        if ((st = moe_session_new(&prefix, m, ctx, err, sizeof err))) { fprintf(stderr, "moe-batch: %s\n", err); goto out; }
        moe_seq q = {.s = prefix, .tokens = reqs[0].prompt, .n = lcp};
        if ((st = moe_step(m, &q, 1, &stats, err, sizeof err))) { fprintf(stderr, "moe-batch: %s\n", err); goto out; }
        fprintf(stderr, "moe-batch: the %d-token prefix all prompts share is computed once\n", lcp);
    }
    for (int i = 0; i < parallel; i++)
        if ((st = moe_session_new(&slots[i].s, m, ctx, err, sizeof err))) { fprintf(stderr, "moe-batch: %s\n", err); goto out; }

    /* lockstep decoding; requests join as slots free up */
    size_t next = 0, finished = 0;
    uint64_t tokens = 0, prompt_tokens = (uint64_t)lcp;
    long pass = 0;
    double t0 = now(), last_report = t0;
    for (;; pass++) {
        for (int i = 0; i < parallel && next < n_reqs; i++) {
            slot *sl = &slots[i];
            if (sl->r) continue;
            request *rq = &reqs[next];
            /* a request's prompt is computed once, by its first choice: the choices that get
             * slots in the same pass take its state after the step, later ones a copy of it */
            if (!rq->started) rq->lead = i, rq->lead_pass = pass;
            sl->leader = !rq->started ? -1 : rq->lead_pass == pass ? rq->lead : -2;
            sl->choice = rq->started++;
            if (rq->started == rq->n) next++;
            sl->sp = rq->sp, sl->rng = choice_rng(rq->rng, sl->choice);
            int32_t *h = realloc(sl->hist, sizeof *h * (size_t)(rq->n_prompt + rq->max_tokens + 1));
            if (!h) { fprintf(stderr, "moe-batch: out of memory\n"); goto out; }
            sl->hist = h;
            memcpy(h, rq->prompt, sizeof *h * (size_t)rq->n_prompt);
            if (rq->logprobs >= 0) {
                const size_t nt = (size_t)rq->max_tokens, na = nt * (size_t)rq->logprobs + 1;
                float *lp = realloc(sl->lp, sizeof *lp * nt), *alt_lp = realloc(sl->alt_lp, sizeof *alt_lp * na);
                int32_t *alt = realloc(sl->alt, sizeof *alt * na);
                size_t *off = realloc(sl->offset, sizeof *off * nt);
                if (lp) sl->lp = lp;
                if (alt_lp) sl->alt_lp = alt_lp;
                if (alt) sl->alt = alt;
                if (off) sl->offset = off;
                if (!lp || !alt_lp || !alt || !off) { fprintf(stderr, "moe-batch: out of memory\n"); goto out; }
            }
            sl->r = rq, sl->gen = 0, sl->finish = NULL, sl->content.n = 0, sl->reasoning.n = 0;
            if (sl->content.s) sl->content.s[0] = 0;
            if (sl->reasoning.s) sl->reasoning.s[0] = 0;
            sl->fed = 0;
            moe_session_reset(sl->s);
            if (lcp) {
                if ((st = moe_session_restore(sl->s, prefix, err, sizeof err))) { fprintf(stderr, "moe-batch: %s\n", err); goto out; }
                sl->fed = lcp;
            }
            if (rq->chat && tok) moe_chat_reply_init(&sl->rep, tok, &rq->co);
        }
        /* a request left with choices to start keeps its first choice's state after this step */
        const int keep = next < n_reqs && reqs[next].started && reqs[next].lead_pass == pass ? reqs[next].lead : -1;
        if (keep >= 0 && !kept && ((st = moe_session_new(&kept, m, ctx, err, sizeof err)) ||
                                   !(kept_logits = malloc(sizeof(float) * (size_t)c->vocab_size)))) {
            fprintf(stderr, "moe-batch: %s\n", st ? err : "out of memory");
            goto out;
        }
        int ns = 0, active = 0;
        for (int i = 0; i < parallel; i++) {
            slot *sl = &slots[i];
            active += sl->r != NULL;
            if (!sl->r || sl->leader != -1) continue;
            moe_seq *q = &seqs[ns];
            memset(q, 0, sizeof *q);
            q->s = sl->s;
            q->logits = logits + (size_t)ns++ * (size_t)c->vocab_size;
            sl->lrow = q->logits;
            if (sl->fed < sl->r->n_prompt) q->tokens = sl->r->prompt + sl->fed, q->n = sl->r->n_prompt - sl->fed, prompt_tokens += (uint64_t)q->n;
            else q->tokens = &sl->last, q->n = 1;
        }
        if (!active) break;
        if (ns && (st = moe_step(m, seqs, ns, &stats, err, sizeof err))) {
            fprintf(stderr, "moe-batch: %s (the requests in flight get no answer; rerun to finish)\n", err);
            goto out;
        }
        for (int i = 0; i < parallel; i++) { /* the waiting choices take their first choice's prompt and logits */
            slot *sl = &slots[i];
            if (!sl->r || sl->leader == -1) continue;
            const moe_session *from = sl->leader >= 0 ? slots[sl->leader].s : kept;
            if ((st = moe_session_restore(sl->s, from, err, sizeof err))) { fprintf(stderr, "moe-batch: %s\n", err); goto out; }
            sl->lrow = sl->leader >= 0 ? slots[sl->leader].lrow : kept_logits, sl->leader = -1;
        }
        /* the sequences' tokens sampled side by side (each choice has its own generator, so the
         * picks do not depend on the threads) */
#ifdef _OPENMP
#pragma omp parallel for num_threads(opt.n_threads) schedule(dynamic, 1) if (active > 1 && opt.n_threads > 1)
#endif
        for (int i = 0; i < parallel; i++) {
            slot *sl = &slots[i];
            if (!sl->r) continue;
            request *rq = sl->r;
            sl->sp.recent = sl->hist + (rq->n_prompt + sl->gen > 64 ? rq->n_prompt + sl->gen - 64 : 0);
            sl->sp.n_recent = rq->n_prompt + sl->gen < 64 ? rq->n_prompt + sl->gen : 64;
            const float *row = sl->lrow;
            sl->pick = moe_sample(row, c->vocab_size, &sl->sp, &sl->rng);
            if (rq->logprobs >= 0)
                logprobs_of(row, c->vocab_size, sl->pick, rq->logprobs, &sl->lp[sl->gen], sl->alt + (size_t)sl->gen * rq->logprobs,
                            sl->alt_lp + (size_t)sl->gen * rq->logprobs);
        }
        for (int i = 0; i < parallel; i++) {
            slot *sl = &slots[i];
            if (!sl->r) continue;
            request *rq = sl->r;
            sl->fed = rq->n_prompt;
            int32_t t = sl->pick;
            if (rq->logprobs >= 0) sl->offset[sl->gen] = sl->content.n;
            sl->hist[rq->n_prompt + sl->gen++] = t;
            sl->last = t;
            tokens++;
            int end = t == c->eos_token_id;
            if (tok) {
                size_t bl = 0;
                const char *b = moe_token_bytes(tok, t, &bl);
                int ch = rq->chat ? moe_chat_reply_token(&sl->rep, tok, t)
                       : moe_token_is_special(tok, t) ? MOE_REPLY_HIDDEN : MOE_REPLY_CONTENT;
                if (ch == MOE_REPLY_END) end = 1;
                else if (ch == MOE_REPLY_CONTENT && b) bput(&sl->content, b, bl);
                else if (ch == MOE_REPLY_REASONING && b) bput(&sl->reasoning, b, bl);
                if (!rq->chat && (t == moe_token_id(tok, "[EOS]"))) end = 1;
            } else {
                bprintf(&sl->content, sl->gen > 1 ? " %d" : "%d", (int)t); /* no tokenizer: the ids */
                if (rq->logprobs >= 0 && sl->gen > 1) sl->offset[sl->gen - 1]++; /* past the space */
            }
            if (sl->content.oom || sl->reasoning.oom) { fprintf(stderr, "moe-batch: out of memory\n"); goto out; }
            if (end || slot_check_stop(sl)) sl->finish = "stop";
            else if (sl->gen >= rq->max_tokens) sl->finish = "length";
            if (!sl->finish) continue;
            line.n = 0;
            char *calls = NULL; /* a chat reply's tool calls, when it made any */
            if (rq->chat && tok) {
                size_t cl = 0, cap = 256;
                for (int tries = 0; tries < 8; tries++, cap = cl + 1) {
                    free(calls);
                    if (!(calls = malloc(cap))) break;
                    moe_status ts = moe_chat_tool_calls(tok, sl->hist + rq->n_prompt, (size_t)sl->gen, &rq->co, calls, cap, &cl, err, sizeof err);
                    if (ts != MOE_ERR_RANGE) {
                        if (ts || !strcmp(calls, "[]")) free(calls), calls = NULL;
                        break;
                    }
                }
            }
            buf *ch = &rq->choices[sl->choice];
            choice_json(ch, sl, calls, tok);
            free(calls);
            if (ch->oom) { fprintf(stderr, "moe-batch: out of memory\n"); goto out; }
            rq->done++, rq->gen_total += sl->gen;
            sl->r = NULL;
            if (rq->done < rq->n) continue; /* the line waits for the request's last choice */
            answer_line(&line, rq);
            if (line.oom || append_line(&line)) { fprintf(stderr, "moe-batch: %s: %s\n", out_path, line.oom ? "out of memory" : strerror(errno)); goto out; }
            for (int k = 0; k < rq->n; k++) free(rq->choices[k].s), rq->choices[k] = (buf){0};
            finished++;
        }
        if (keep >= 0) { /* its session still holds just the prompt (the pick goes in next step), its lrow the logits */
            if ((st = moe_session_restore(kept, slots[keep].s, err, sizeof err))) { fprintf(stderr, "moe-batch: %s\n", err); goto out; }
            memcpy(kept_logits, slots[keep].lrow, sizeof(float) * (size_t)c->vocab_size);
        }
        double tn = now();
        if (tn - last_report >= 1.0 || finished == n_reqs) {
            double rate = tokens / (tn - t0 > 1e-9 ? tn - t0 : 1e-9), per_req = finished ? (tn - t0) / finished : 0;
            fprintf(stderr, "\rmoe-batch: %zu/%zu done, %.1f tok/s, ETA %.0f s   ", finished, n_reqs, rate,
                    finished ? per_req * (double)(n_reqs - finished) : 0.0);
            last_report = tn;
        }
    }
    fprintf(stderr, "\nmoe-batch: %zu requests answered by the model, %ld refused, %llu prompt tokens computed, %llu tokens in %.2f s\n",
            finished, n_errors, (unsigned long long)prompt_tokens,
            (unsigned long long)tokens, now() - t0);
    rc = 0;
out:
    if (out_fd >= 0 && close(out_fd) != 0 && !rc) {
        fprintf(stderr, "moe-batch: %s: %s\n", out_path, strerror(errno));
        rc = 1;
    }
    for (int i = 0; slots && i < parallel; i++) {
        moe_session_free(slots[i].s);
        free(slots[i].hist);
        free(slots[i].lp), free(slots[i].alt), free(slots[i].alt_lp), free(slots[i].offset);
        free(slots[i].content.s);
        free(slots[i].reasoning.s);
    }
    for (size_t i = 0; i < n_reqs; i++) request_free(&reqs[i]);
    free(reqs);
    free(slots);
    free(seqs);
    free(logits);
    free(line.s);
    free(input);
    moe_session_free(prefix);
    moe_session_free(kept);
    free(kept_logits);
    ks_free(&done);
    ks_free(&seen);
    moe_tokenizer_free(tok);
    moe_model_close(m);
    return rc;
}
