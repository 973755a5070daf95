/* openai.h - OpenAI-style requests and answers for moe-batch and moe-server (not part of the
 * runtime): a growable text buffer with JSON strings, a request body parsed into a prompt and
 * sampling settings (oai_parse_body), one choice's decoding (oai_choice: sample, take the token,
 * finish) and the JSON of a finished choice. Uses the library's internal JSON reader
 * (MOE_INTERNAL must be defined before moe.h). */
#ifndef MOE_EXAMPLES_OPENAI_H
#define MOE_EXAMPLES_OPENAI_H
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static inline uint64_t fnv(const char *s, size_t n) {
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

static inline void bput(buf *b, const char *s, size_t n) {
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

static inline void bputs(buf *b, const char *s) { bput(b, s, strlen(s)); }

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
static inline void bprintf(buf *b, const char *fmt, ...) {
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (k > 0) bput(b, tmp, (size_t)k < sizeof tmp ? (size_t)k : sizeof tmp - 1);
}

/* a JSON string; bytes that are not valid UTF-8 become U+FFFD (as the vendor's decode does) */
static inline void bjson_str(buf *b, const char *s, size_t n) {
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

/* The JSON values in text[0..len), counted from its commas and brackets outside strings without
 * parsing it: each value costs a parse node (about 50 bytes, where "1," is 2), so a caller bounds
 * what parsing a request may take by refusing more values than a request can need. */
static inline size_t oai_count_json_values(const char *text, size_t len) {
    size_t values = 1;
    for (size_t i = 0, in_str = 0; i < len; i++) {
        const char c = text[i];
        if (in_str) {
            if (c == '\\') i++;
            else if (c == '"') in_str = 0;
        } else if (c == '"') {
            in_str = 1;
        } else {
            values += c == ',' || c == '[' || c == '{';
        }
    }
    return values;
}

/* ---- a request's body ---- */

enum { OAI_MAX_STOP = 4 };

typedef struct {
    int chat;        /* /v1/chat/completions (else /v1/completions) */
    int32_t *prompt; /* the prompt's token ids */
    int n_prompt;
    int max_tokens;
    moe_sampler sp;
    uint64_t rng;    /* the first choice's generator (from "seed", else the caller's) */
    char *stop[OAI_MAX_STOP];
    int n_stop;
    int logprobs;    /* -1: none; else each sampled token's log probability and this many best alternatives */
    moe_chat_options co;
    int n;           /* choices ("n"): each decodes as a sequence of its own */
    int stream;      /* "stream": true (moe-server answers with server-sent events) */
    int include_usage; /* "stream_options": {"include_usage": true} */
} oai_request;

static inline void oai_request_free(oai_request *r) {
    free(r->prompt);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free((char *)r->co.thinking_effort);
    memset(r, 0, sizeof *r);
}

static inline int oai_num_field(const moe__json *body, const char *key, double lo, double hi, double *out, char *why, size_t wn) {
    const moe__json *v = moe__json_get(body, key);
    if (!v || v->type == MOE_JSON_NULL) return 1;
    if (v->type != MOE_JSON_NUM || !(v->num >= lo && v->num <= hi)) {
        snprintf(why, wn, "%s must be a number in [%g, %g]", key, lo, hi);
        return 0;
    }
    *out = v->num;
    return 1;
}

/* The longest token's bytes (a special's name included): a text of B bytes is at least
 * B / longest tokens, so a prompt longer than ctx times that cannot fit and is refused before it
 * is tokenized (what one request can cost in memory is then bounded by the context) */
static inline size_t oai_longest_token(const moe_tokenizer *tok) {
    static const moe_tokenizer *of;
    static size_t longest;
    if (tok != of) {
        size_t l = 1;
        for (int32_t id = 0; id < moe_tokenizer_n_ids(tok); id++) {
            size_t k = 0;
            if (moe_token_bytes(tok, id, &k) && k > l) l = k;
        }
        longest = l, of = tok;
    }
    return longest;
}

/* the bytes of the texts a chat request's messages hold (string contents and text parts): all of
 * them are in the rendered prompt */
static inline size_t oai_message_bytes(const moe__json *msgs) {
    size_t b = 0;
    for (const moe__json *m = msgs->child; m; m = m->next) {
        const moe__json *c = moe__json_get(m, "content");
        if (c && c->type == MOE_JSON_STR) b += strlen(c->str);
        for (const moe__json *part = c && c->type == MOE_JSON_ARR ? c->child : NULL; part; part = part->next) {
            const moe__json *t = moe__json_get(part, "text");
            if (t && t->type == MOE_JSON_STR) b += strlen(t->str);
        }
    }
    return b;
}

/* 0 with a message when a text of `bytes` bytes cannot fit the context in any tokenization */
static inline int oai_text_may_fit(const moe_tokenizer *tok, size_t bytes, int ctx, char *why, size_t wn) {
    const size_t longest = oai_longest_token(tok);
    if (bytes / longest <= (size_t)ctx) return 1;
    snprintf(why, wn, "the prompt's %zu bytes are at least %zu tokens (no token is longer than %zu bytes), more than the context of %d",
             bytes, bytes / longest, longest, ctx);
    return 0;
}

/* the sampling fields of body into r (defaults where absent); 0 with a message in why */
static inline int oai_parse_sampling(oai_request *r, const moe__json *body, char *why, size_t wn) {
    double temperature = 1, top_p = 1, top_k = 0, min_p = 0, presence = 0, frequency = 0; /* oai_num_field leaves absent ones */
    if (!oai_num_field(body, "temperature", 0, 2, &temperature, why, wn) || !oai_num_field(body, "top_p", 0, 1, &top_p, why, wn) ||
        !oai_num_field(body, "top_k", 0, 1e9, &top_k, why, wn) || !oai_num_field(body, "min_p", 0, 1, &min_p, why, wn) ||
        !oai_num_field(body, "presence_penalty", -2, 2, &presence, why, wn) ||
        !oai_num_field(body, "frequency_penalty", -2, 2, &frequency, why, wn))
        return 0;
    r->sp = (moe_sampler){.temperature = (float)temperature, .top_p = (float)top_p, .top_k = (int)top_k, .min_p = (float)min_p,
                          .presence_penalty = (float)presence, .frequency_penalty = (float)frequency, .repeat_penalty = 1.0f};
    return 1;
}

/* "logprobs": chat's "logprobs": true with "top_logprobs": N, the completions' "logprobs": N
 * (OpenAI allows 5 there, 20 in chat: both take up to 20 here) */
static inline int oai_parse_logprobs(oai_request *r, const moe__json *body, char *why, size_t wn) {
    double v = -1;
    const moe__json *lp = moe__json_get(body, "logprobs"), *echo = moe__json_get(body, "echo");
    r->logprobs = -1;
    if (r->chat) {
        if (lp && lp->type != MOE_JSON_BOOL && lp->type != MOE_JSON_NULL) return snprintf(why, wn, "logprobs must be true or false"), 0;
        if (!oai_num_field(body, "top_logprobs", 0, 20, &v, why, wn)) return 0;
        if (v != (int)v) return snprintf(why, wn, "top_logprobs must be an integer"), 0;
        const int on = lp && lp->type == MOE_JSON_BOOL && lp->num != 0;
        if (v >= 0 && !on) return snprintf(why, wn, "top_logprobs needs logprobs: true"), 0;
        if (on) r->logprobs = v >= 0 ? (int)v : 0;
        return 1;
    }
    if (!oai_num_field(body, "logprobs", 0, 20, &v, why, wn)) return 0;
    if (v != (int)v) return snprintf(why, wn, "logprobs must be an integer"), 0;
    r->logprobs = (int)v;
    if (echo && !(echo->type == MOE_JSON_NULL || (echo->type == MOE_JSON_BOOL && echo->num == 0)))
        return snprintf(why, wn, "echo is not supported"), 0;
    return 1;
}

/* "stop": a string or up to four */
static inline int oai_parse_stop(oai_request *r, const moe__json *body, char *why, size_t wn) {
    const moe__json *stop = moe__json_get(body, "stop");
    if (stop && stop->type == MOE_JSON_STR) {
        if (*stop->str) r->stop[r->n_stop++] = strdup(stop->str);
    } else if (stop && stop->type == MOE_JSON_ARR) {
        if (stop->n > OAI_MAX_STOP) return snprintf(why, wn, "stop: at most %d strings", OAI_MAX_STOP), 0;
        for (const moe__json *s = stop->child; s; s = s->next) {
            if (s->type != MOE_JSON_STR) return snprintf(why, wn, "stop must be a string or a list of strings"), 0;
            if (*s->str) r->stop[r->n_stop++] = strdup(s->str);
        }
    } else if (stop && stop->type != MOE_JSON_NULL) {
        return snprintf(why, wn, "stop must be a string or a list of strings"), 0;
    }
    for (int i = 0; i < r->n_stop; i++)
        if (!r->stop[i]) return snprintf(why, wn, "out of memory"), 0;
    return 1;
}

/* the prompt: a chat's messages rendered in the model's chat format, or a completion's text or
 * token ids; it and max_tokens must fit ctx */
static inline int oai_parse_prompt(oai_request *r, const moe__json *body, const moe_tokenizer *tok, int ctx, char *why, size_t wn) {
    char err[512];
    size_t n = 0, cap = (size_t)ctx + 1;
    if (!(r->prompt = malloc(cap * sizeof *r->prompt))) return snprintf(why, wn, "out of memory"), 0;
    moe_status st;
    if (r->chat) {
        const moe__json *msgs = moe__json_get(body, "messages");
        if (!msgs) return snprintf(why, wn, "a chat request needs body.messages"), 0;
        if (msgs->type != MOE_JSON_ARR || !msgs->n) return snprintf(why, wn, "messages must be a non-empty list of messages"), 0;
        if (!tok) return snprintf(why, wn, "the model ships no tokenizer, so chat requests cannot be encoded"), 0;
        if (!oai_text_may_fit(tok, oai_message_bytes(msgs), ctx, why, wn)) return 0;
        r->co = moe_chat_default_options();
        const moe__json *eff = moe__json_get(body, "reasoning_effort");
        if (eff && eff->type == MOE_JSON_STR) {
            if (!strcmp(eff->str, "none")) r->co.thinking = 0;
            else if (!(r->co.thinking_effort = strdup(eff->str))) return snprintf(why, wn, "out of memory"), 0;
        } else if (eff && eff->type != MOE_JSON_NULL) {
            return snprintf(why, wn, "reasoning_effort must be a string"), 0;
        }
        st = moe__chat_encode_tree(tok, body, &r->co, r->prompt, cap, &n, err, sizeof err);
    } else {
        const moe__json *p = moe__json_get(body, "prompt");
        if (p && p->type == MOE_JSON_ARR) { /* token ids */
            st = MOE_OK;
            for (const moe__json *e = p->child; e && !st; e = e->next) {
                if (e->type == MOE_JSON_ARR || e->type == MOE_JSON_STR)
                    return snprintf(why, wn, "prompt: a list of prompts is not supported; give a string or one list of token ids"), 0;
                if (e->type != MOE_JSON_NUM || e->num < 0 || e->num > 2147483647.0 || e->num != (double)(int32_t)e->num)
                    return snprintf(why, wn, "prompt[%zu]: a token id is an integer >= 0", n), 0;
                if (n < cap) r->prompt[n] = (int32_t)e->num;
                n++;
            }
            if (n > cap) st = MOE_ERR_RANGE;
        } else if (p && p->type == MOE_JSON_STR) {
            if (!tok) return snprintf(why, wn, "the model ships no tokenizer; give the prompt as token ids"), 0;
            if (!oai_text_may_fit(tok, strlen(p->str), ctx, why, wn)) return 0;
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

/* Turns a request body into r (chat: the /v1/chat/completions form, else /v1/completions); 0
 * with a message in why when it is not a valid one (r then holds what was allocated: free it).
 * default_rng seeds the first choice when the body has no "seed"; vocab_size bounds the prompt's
 * ids and the alternatives asked for. */
static inline int oai_parse_body(oai_request *r, const moe__json *body, int chat, const moe_tokenizer *tok, int vocab_size, int ctx,
                                 int default_max, uint64_t default_rng, char *why, size_t wn) {
    memset(r, 0, sizeof *r);
    r->chat = chat;
    if (!body || body->type != MOE_JSON_OBJ) return snprintf(why, wn, "body must be an object"), 0;
    double v = 0;
    r->max_tokens = default_max;
    if (!oai_num_field(body, "max_completion_tokens", 1, 1e9, &v, why, wn) || !oai_num_field(body, "max_tokens", 1, 1e9, &v, why, wn)) return 0;
    if (moe__json_get(body, "max_tokens") || moe__json_get(body, "max_completion_tokens")) {
        if (v != (double)(int)v) return snprintf(why, wn, "max_tokens must be an integer"), 0;
        r->max_tokens = (int)v;
    }
    if (!oai_parse_sampling(r, body, why, wn)) return 0;
    v = 1;
    if (!oai_num_field(body, "n", 1, 128, &v, why, wn)) return 0;
    if (v != (int)v) return snprintf(why, wn, "n must be an integer"), 0;
    r->n = (int)v;
    if (!oai_parse_logprobs(r, body, why, wn)) return 0;
    if (r->logprobs > vocab_size) r->logprobs = vocab_size; /* no more alternatives than tokens */
    const moe__json *seed = moe__json_get(body, "seed");
    if (seed && seed->type == MOE_JSON_NUM) { /* a 64-bit integer: converting anything else to int64_t is undefined */
        if (!(seed->num >= -9.2e18 && seed->num <= 9.2e18) || (double)(int64_t)seed->num != seed->num)
            return snprintf(why, wn, "seed must be a 64-bit integer"), 0;
        r->rng = (uint64_t)(int64_t)seed->num * 0x9E3779B97F4A7C15ull + 1;
    } else if (seed && seed->type != MOE_JSON_NULL) return snprintf(why, wn, "seed must be an integer"), 0;
    else r->rng = default_rng;
    const moe__json *stream = moe__json_get(body, "stream"), *so = moe__json_get(body, "stream_options");
    if (stream && stream->type != MOE_JSON_BOOL && stream->type != MOE_JSON_NULL) return snprintf(why, wn, "stream must be true or false"), 0;
    r->stream = stream && stream->type == MOE_JSON_BOOL && stream->num != 0;
    if (so && so->type != MOE_JSON_NULL) {
        const moe__json *iu = so->type == MOE_JSON_OBJ ? moe__json_get(so, "include_usage") : NULL;
        if (so->type != MOE_JSON_OBJ || (iu && iu->type != MOE_JSON_BOOL && iu->type != MOE_JSON_NULL))
            return snprintf(why, wn, "stream_options must be an object such as {\"include_usage\": true}"), 0;
        r->include_usage = iu && iu->type == MOE_JSON_BOOL && iu->num != 0;
    }
    if (!oai_parse_stop(r, body, why, wn) || !oai_parse_prompt(r, body, tok, ctx, why, wn)) return 0;
    for (int i = 0; i < r->n_prompt; i++)
        if (r->prompt[i] < 0 || r->prompt[i] >= vocab_size)
            return snprintf(why, wn, "prompt token %d is outside the vocabulary (%d)", (int)r->prompt[i], vocab_size), 0;
    return 1;
}

/* choice k's generator: the request's own for the first, so that n = 1 draws as before; the
 * others from it by splitmix64's mixing */
static inline uint64_t oai_choice_rng(uint64_t seed, int k) {
    if (!k) return seed;
    uint64_t z = seed + (uint64_t)k * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (z ^ (z >> 31)) | 1;
}

/* ---- one choice's decoding ---- */

typedef struct {
    const oai_request *r;
    int index;          /* which of r's choices */
    moe_sampler sp;     /* r's sampler, with this sequence's recent tokens */
    uint64_t rng;       /* this choice's generator */
    int gen;            /* tokens sampled */
    int32_t pick;       /* the token sampled last */
    int32_t *hist;      /* prompt + generated, for penalties */
    /* with logprobs: per sampled token its log probability, its text's offset in content, and
     * the request's logprobs best alternatives (ids and log probabilities) */
    float *lp, *alt_lp;
    int32_t *alt;
    size_t *offset;
    buf content, reasoning;
    moe_chat_reply rep;
    const char *finish; /* set when done: "stop" or "length" */
} oai_choice;

static inline void oai_choice_free(oai_choice *c) {
    free(c->hist), free(c->lp), free(c->alt), free(c->alt_lp), free(c->offset);
    free(c->content.s), free(c->reasoning.s);
    memset(c, 0, sizeof *c);
}

/* c made ready to decode choice k of r (its buffers kept from an earlier use); 0 out of memory */
static inline int oai_choice_begin(oai_choice *c, const oai_request *r, int k, const moe_tokenizer *tok) {
    c->r = r, c->index = k;
    c->sp = r->sp, c->rng = oai_choice_rng(r->rng, k);
    int32_t *h = realloc(c->hist, sizeof *h * (size_t)(r->n_prompt + r->max_tokens + 1));
    if (!h) return 0;
    c->hist = h;
    memcpy(h, r->prompt, sizeof *h * (size_t)r->n_prompt);
    if (r->logprobs >= 0) {
        const size_t nt = (size_t)r->max_tokens, na = nt * (size_t)r->logprobs + 1;
        float *lp = realloc(c->lp, sizeof *lp * nt), *alt_lp = realloc(c->alt_lp, sizeof *alt_lp * na);
        int32_t *alt = realloc(c->alt, sizeof *alt * na);
        size_t *off = realloc(c->offset, sizeof *off * nt);
        if (lp) c->lp = lp;
        if (alt_lp) c->alt_lp = alt_lp;
        if (alt) c->alt = alt;
        if (off) c->offset = off;
        if (!lp || !alt_lp || !alt || !off) return 0;
    }
    c->gen = 0, c->finish = NULL, c->content.n = 0, c->reasoning.n = 0, c->content.oom = c->reasoning.oom = 0;
    if (c->content.s) c->content.s[0] = 0;
    if (c->reasoning.s) c->reasoning.s[0] = 0;
    if (r->chat && tok) moe_chat_reply_init(&c->rep, tok, &r->co);
    return 1;
}

/* Log probabilities of the raw logits l[0..V) (before temperature and penalties, as OpenAI
 * reports them): the pick's into *lp, the n best tokens (highest first, ties by id) into alt and
 * their log probabilities into alt_lp. */
static inline void oai_logprobs_of(const float *l, int V, int32_t pick, int n, float *lp, int32_t *alt, float *alt_lp) {
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

/* c's next token sampled from the logits row[0..V) into c->pick (with its log probabilities
 * when asked for); safe to run for many choices at once */
static inline void oai_choice_sample(oai_choice *c, const float *row, int V) {
    const oai_request *r = c->r;
    const int have = r->n_prompt + c->gen;
    c->sp.recent = c->hist + (have > 64 ? have - 64 : 0);
    c->sp.n_recent = have < 64 ? have : 64;
    c->pick = moe_sample(row, V, &c->sp, &c->rng);
    if (r->logprobs >= 0)
        oai_logprobs_of(row, V, c->pick, r->logprobs, &c->lp[c->gen], c->alt + (size_t)c->gen * r->logprobs,
                        c->alt_lp + (size_t)c->gen * r->logprobs);
}

static inline int oai_choice_check_stop(oai_choice *c) {
    int stopped = 0;
    if (!c->r->n_stop || !c->content.n) return 0;
    size_t cut = moe_text_ready(c->content.s, c->content.n, (const char *const *)c->r->stop, c->r->n_stop, 1, &stopped);
    if (stopped) c->content.n = cut, c->content.s[cut] = 0;
    return stopped;
}

/* c's pick appended to its history and its text (the channel the chat format puts it in); sets
 * c->finish when the choice is done: an end token, a stop string, or max_tokens. 0 out of memory. */
static inline int oai_choice_take(oai_choice *c, const moe_model *m, const moe_tokenizer *tok, int32_t eos) {
    const oai_request *r = c->r;
    const int32_t t = c->pick;
    if (r->logprobs >= 0) c->offset[c->gen] = c->content.n;
    c->hist[r->n_prompt + c->gen++] = t;
    int end = r->chat ? t == eos : moe_token_is_eog(m, tok, t);
    if (tok) {
        size_t bl = 0;
        const char *b = moe_token_bytes(tok, t, &bl);
        int ch = r->chat ? moe_chat_reply_token(&c->rep, tok, t) : moe_token_is_special(tok, t) ? MOE_REPLY_HIDDEN : MOE_REPLY_CONTENT;
        if (ch == MOE_REPLY_END) end = 1;
        else if (ch == MOE_REPLY_CONTENT && b) bput(&c->content, b, bl);
        else if (ch == MOE_REPLY_REASONING && b) bput(&c->reasoning, b, bl);
    } else {
        bprintf(&c->content, c->gen > 1 ? " %d" : "%d", (int)t); /* no tokenizer: the ids */
        if (r->logprobs >= 0 && c->gen > 1) c->offset[c->gen - 1]++; /* past the space */
    }
    if (c->content.oom || c->reasoning.oom) return 0;
    if (end || oai_choice_check_stop(c)) c->finish = "stop";
    else if (c->gen >= r->max_tokens) c->finish = "length";
    return 1;
}

/* a chat reply's tool calls as JSON (caller frees), or NULL when it made none */
static inline char *oai_tool_calls(const oai_choice *c, const moe_tokenizer *tok) {
    const oai_request *r = c->r;
    char *calls = NULL, err[256];
    size_t cl = 0, cap = 256;
    if (!r->chat || !tok) return NULL;
    for (int tries = 0; tries < 8; tries++, cap = cl + 1) {
        free(calls);
        if (!(calls = malloc(cap))) break;
        moe_status ts = moe_chat_tool_calls(tok, c->hist + r->n_prompt, (size_t)c->gen, &r->co, calls, cap, &cl, err, sizeof err);
        if (ts != MOE_ERR_RANGE) {
            if (ts || !strcmp(calls, "[]")) free(calls), calls = NULL;
            break;
        }
    }
    return calls;
}

/* ---- answers ---- */

/* a log probability as JSON (-9999 for a token the model rules out, as OpenAI writes it) */
static inline void oai_blogprob(buf *b, float v) { bprintf(b, "%.9g", isfinite(v) ? (double)v : -9999.0); }

/* token t's text: its bytes, or its id where the model has no tokenizer */
static inline const char *oai_token_text(const moe_tokenizer *tok, int32_t t, char *idbuf, size_t n, size_t *len) {
    const char *p = tok ? moe_token_bytes(tok, t, len) : NULL;
    if (p) return p;
    *len = (size_t)snprintf(idbuf, n, "%d", (int)t);
    return idbuf;
}

/* chat's {"token", "logprob", "bytes"} of token t (the bytes as numbers: a token may hold part of
 * a character) */
static inline void oai_chat_token_lp(buf *b, const moe_tokenizer *tok, int32_t t, float lp) {
    char idb[16];
    size_t len = 0;
    const char *p = oai_token_text(tok, t, idb, sizeof idb, &len);
    bprintf(b, "\"token\": ");
    bjson_str(b, p, len);
    bprintf(b, ", \"logprob\": ");
    oai_blogprob(b, lp);
    bprintf(b, ", \"bytes\": [");
    for (size_t i = 0; i < len; i++) bprintf(b, i ? ", %u" : "%u", (unsigned char)p[i]);
    bprintf(b, "]");
}

/* the "logprobs" of c's sampled tokens [from, to) (the reasoning and a closing end-of-turn token
 * included), chat's or the completions' form; "null" without logprobs */
static inline void oai_logprobs_json(buf *b, const oai_choice *c, int from, int to, const moe_tokenizer *tok) {
    const oai_request *r = c->r;
    const int32_t *gen = c->hist + r->n_prompt;
    const int n = r->logprobs;
    char idb[16];
    size_t len = 0;
    if (r->logprobs < 0) {
        bprintf(b, "null");
        return;
    }
    if (r->chat) {
        bprintf(b, "{\"content\": [");
        for (int i = from; i < to; i++) {
            bprintf(b, i > from ? ", {" : "{");
            oai_chat_token_lp(b, tok, gen[i], c->lp[i]);
            bprintf(b, ", \"top_logprobs\": [");
            for (int j = 0; j < n; j++) {
                bprintf(b, j ? ", {" : "{");
                oai_chat_token_lp(b, tok, c->alt[(size_t)i * n + j], c->alt_lp[(size_t)i * n + j]);
                bprintf(b, "}");
            }
            bprintf(b, "]}");
        }
        bprintf(b, "], \"refusal\": null}");
        return;
    }
    bprintf(b, "{\"tokens\": [");
    for (int i = from; i < to; i++) {
        const char *p = oai_token_text(tok, gen[i], idb, sizeof idb, &len);
        if (i > from) bprintf(b, ", ");
        bjson_str(b, p, len);
    }
    bprintf(b, "], \"token_logprobs\": [");
    for (int i = from; i < to; i++) {
        if (i > from) bprintf(b, ", ");
        oai_blogprob(b, c->lp[i]);
    }
    bprintf(b, "], \"top_logprobs\": ");
    if (n > 0) {
        bprintf(b, "[");
        for (int i = from; i < to; i++) {
            bprintf(b, i > from ? ", {" : "{");
            for (int j = 0; j < n; j++) {
                const char *p = oai_token_text(tok, c->alt[(size_t)i * n + j], idb, sizeof idb, &len);
                if (j) bprintf(b, ", ");
                bjson_str(b, p, len);
                bprintf(b, ": ");
                oai_blogprob(b, c->alt_lp[(size_t)i * n + j]);
            }
            bprintf(b, "}");
        }
        bprintf(b, "]");
    } else {
        bprintf(b, "null");
    }
    bprintf(b, ", \"text_offset\": [");
    for (int i = from; i < to; i++) bprintf(b, i > from ? ", %zu" : "%zu", c->offset[i]);
    bprintf(b, "]}");
}

/* "tool_calls": the calls of oai_tool_calls's array in a stream's delta form, each with its
 * "index" (OpenAI's clients put a call's pieces together by it; here each comes whole) */
static inline void oai_tool_calls_delta(buf *b, const char *tool_calls) {
    moe__json *arr = NULL;
    bputs(b, "\"tool_calls\": [");
    if (moe__json_parse(tool_calls, strlen(tool_calls), &arr, NULL, 0) == MOE_OK && arr->type == MOE_JSON_ARR) {
        int k = 0;
        for (const moe__json *call = arr->child; call; call = call->next, k++) {
            const moe__json *id = moe__json_get(call, "id"), *fn = moe__json_get(call, "function");
            const moe__json *name = fn ? moe__json_get(fn, "name") : NULL, *args = fn ? moe__json_get(fn, "arguments") : NULL;
            const char *ids = id && id->type == MOE_JSON_STR ? id->str : "", *names = name && name->type == MOE_JSON_STR ? name->str : "";
            const char *argss = args && args->type == MOE_JSON_STR ? args->str : "";
            bprintf(b, "%s{\"index\": %d, \"id\": ", k ? ", " : "", k);
            bjson_str(b, ids, strlen(ids));
            bputs(b, ", \"type\": \"function\", \"function\": {\"name\": ");
            bjson_str(b, names, strlen(names));
            bputs(b, ", \"arguments\": ");
            bjson_str(b, argss, strlen(argss));
            bputs(b, "}}");
        }
    }
    moe__json_free(arr);
    bputs(b, "]");
}

/* one finished choice as its JSON object, into b (tool_calls: oai_tool_calls's, or NULL) */
static inline void oai_choice_json(buf *b, const oai_choice *c, const char *tool_calls, const moe_tokenizer *tok) {
    bprintf(b, "{\"index\": %d, ", c->index);
    if (c->r->chat) {
        bprintf(b, "\"message\": {\"role\": \"assistant\", \"content\": ");
        bjson_str(b, c->content.s ? c->content.s : "", c->content.n);
        if (c->reasoning.n) {
            bprintf(b, ", \"reasoning_content\": ");
            bjson_str(b, c->reasoning.s, c->reasoning.n);
        }
        if (tool_calls) {
            bprintf(b, ", \"tool_calls\": ");
            bput(b, tool_calls, strlen(tool_calls));
        }
        bprintf(b, "}, ");
    } else {
        bprintf(b, "\"text\": ");
        bjson_str(b, c->content.s ? c->content.s : "", c->content.n);
        bprintf(b, ", ");
    }
    bprintf(b, "\"logprobs\": ");
    oai_logprobs_json(b, c, 0, c->gen, tok);
    bprintf(b, ", \"finish_reason\": \"%s\"}", tool_calls ? "tool_calls" : c->finish);
}
#endif
