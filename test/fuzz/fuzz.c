/* fuzz.c - libFuzzer entry points for the parsers that read untrusted input, one per build:
 * -DFUZZ_JSON, -DFUZZ_SAFETENSORS, -DFUZZ_GGUF, -DFUZZ_CONFIG, -DFUZZ_RANKS (tokenizer rank file,
 * then "\0" and a tokenizer_config.json), -DFUZZ_TOKENIZE (text through the three pre-tokenizers
 * and rank BPE; decode must give the text back), -DFUZZ_CHAT (a chat request rendered and encoded
 * in the K2 and K3 formats), -DFUZZ_BATCH (one moe-batch input line, also read as an answer line of
 * its output), -DFUZZ_HTTP (the bytes of an HTTP connection, through moe-server's request parser).
 * `make fuzz` builds them with
 * clang -fsanitize=fuzzer,address,undefined; test/fuzz/main.c is a plain driver that replays
 * files through the same entry point, so this builds without libFuzzer too. A crash, a sanitizer
 * report or a hang is a bug; any status code is an acceptable answer. */
#define _POSIX_C_SOURCE 200809L
#define MOE_INTERNAL
#include "../../moe.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(FUZZ_HTTP)
#include "../../examples/http.h"
#endif

#if defined(FUZZ_BATCH)
#define main moe_batch_main /* the batch program's own request parser, compiled in */
#include "../../examples/batch.c"
#undef main
#endif

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#if defined(FUZZ_TOKENIZE) || defined(FUZZ_CHAT) || defined(FUZZ_BATCH)
/* A small vocabulary: the 256 bytes and a few merges; K3 (k3 = 1) or K2 special names. Built
 * once per process; never freed (the fuzzer's process ends). */
static moe_tokenizer *fixed_tokenizer(int pretok, int k3) {
    static moe_tokenizer *cache[3][2];
    if (cache[pretok][k3]) return cache[pretok][k3];
    static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    static const char *merges[] = {"IHQ=", "aGU=", "IHRoZQ==", "aW4=", "YWE=", "YWFh", "CiA=", "ICA=", "5p2x"};
    char *ranks = malloc(256 * 6 + 64 * 16), *o = ranks;
    int n = 0;
    for (int b = 0; b < 256; b++, n++) o += sprintf(o, "%c%c== %d\n", b64[b >> 2], b64[(b & 3) << 4], n);
    for (size_t i = 0; i < sizeof merges / sizeof *merges; i++, n++) o += sprintf(o, "%s %d\n", merges[i], n);
    char cfg[1024];
    if (k3)
        snprintf(cfg, sizeof cfg, "{\"added_tokens_decoder\": {\"%d\": {\"content\": \"[BOS]\"}, \"%d\": {\"content\": \"[EOS]\"}, "
                 "\"%d\": {\"content\": \"<|end_of_msg|>\"}, \"%d\": {\"content\": \"<|open|>\"}, \"%d\": {\"content\": \"<|close|>\"}, "
                 "\"%d\": {\"content\": \"<|sep|>\"}}}", n, n + 1, n + 2, n + 3, n + 4, n + 5);
    else
        snprintf(cfg, sizeof cfg, "{\"added_tokens_decoder\": {\"%d\": {\"content\": \"<|im_end|>\"}, \"%d\": {\"content\": \"<|im_user|>\"}, "
                 "\"%d\": {\"content\": \"<|im_assistant|>\"}, \"%d\": {\"content\": \"<|im_system|>\"}, \"%d\": {\"content\": \"<|im_middle|>\"}, "
                 "\"%d\": {\"content\": \"<|tool_calls_section_begin|>\"}, \"%d\": {\"content\": \"<|tool_calls_section_end|>\"}, "
                 "\"%d\": {\"content\": \"<|tool_call_begin|>\"}, \"%d\": {\"content\": \"<|tool_call_argument_begin|>\"}, "
                 "\"%d\": {\"content\": \"<|tool_call_end|>\"}}}", n + 2, n + 3, n + 4, n + 10, n + 17, n + 11, n + 12, n + 13, n + 14, n + 15);
    char err[256];
    if (moe__tokenizer_from_mem(&cache[pretok][k3], ranks, (size_t)(o - ranks), pretok, pretok == MOE_PRETOK_KIMI ? cfg : NULL,
                                strlen(cfg), err, sizeof err) != MOE_OK) {
        fprintf(stderr, "fuzz: fixed tokenizer: %s\n", err);
        abort();
    }
    free(ranks);
    return cache[pretok][k3];
}
#endif

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char err[256];
#if defined(FUZZ_JSON)
    moe__json *j;
    if (moe__json_parse((const char *)data, size, &j, err, sizeof err) == MOE_OK) {
        (void)moe__json_get(j, "weight_map");
        moe__json_free(j);
    }
#elif defined(FUZZ_SAFETENSORS) || defined(FUZZ_GGUF)
#ifdef FUZZ_GGUF
    const int gguf = 1;
#else
    const int gguf = 0;
#endif
    /* a private copy: the parser may keep pointers into it until close */
    uint8_t *copy = malloc(size ? size : 1);
    if (!copy) return 0;
    memcpy(copy, data, size);
    moe__st_file f;
    if (moe__weights_parse_mem(&f, copy, size, gguf, err, sizeof err) == MOE_OK) {
        volatile uint8_t sink = 0;
        for (int i = 0; i < f.n_tensors; i++) /* every tensor it accepted must lie inside the image */
            if (f.tensors[i].nbytes) sink ^= ((const uint8_t *)f.tensors[i].data)[f.tensors[i].nbytes - 1];
        for (int64_t i = 0; i < f.n_kv; i++)
            if (f.kv[i].type == MOE_GGUF_STRING && f.kv[i].n) sink ^= f.kv[i].data[f.kv[i].n - 1];
        (void)sink;
        moe__st_close(&f);
    }
    free(copy);
#elif defined(FUZZ_CONFIG)
    (void)moe__config_check((const char *)data, size, err, sizeof err);
#elif defined(FUZZ_RANKS)
    const uint8_t *nul = memchr(data, 0, size);
    size_t rl = nul ? (size_t)(nul - data) : size;
    moe_tokenizer *t = NULL;
    if (moe__tokenizer_from_mem(&t, (const char *)data, rl, MOE_PRETOK_KIMI, nul ? (const char *)nul + 1 : NULL, nul ? size - rl - 1 : 0, err,
                                sizeof err) == MOE_OK) {
        /* whatever it accepted must encode and decode */
        static const char text[] = "Hello, world! <|im_end|> \xe6\x9d\xb1\xe4\xba\xac 12345 \r\n  x";
        int32_t ids[128];
        char back[128];
        size_t n = 0, bl = 0;
        if (moe_tokenize(t, text, sizeof text - 1, MOE_TOK_SPECIAL, ids, 128, &n, err, sizeof err) != MOE_OK ||
            moe_detokenize(t, ids, n, back, sizeof back, &bl, err, sizeof err) != MOE_OK || bl != sizeof text - 1 || memcmp(back, text, bl))
            abort();
        moe_tokenizer_free(t);
    }
#elif defined(FUZZ_TOKENIZE)
    /* first byte: pre-tokenizer and flags; the rest is the text */
    if (!size) return 0;
    const int pretok = data[0] % 3;
    const unsigned flags = (data[0] & 4 ? MOE_TOK_SPECIAL : 0) | (data[0] & 8 ? MOE_TOK_RAW_BYTES : 0);
    moe_tokenizer *t = fixed_tokenizer(pretok, 1);
    const char *text = (const char *)data + 1;
    size_t len = size - 1, n = 0, bl = 0;
    int32_t *ids = malloc((len + 1) * sizeof *ids);
    char *back = malloc(len + 1);
    if (ids && back) {
        moe_status st = moe_tokenize(t, text, len, flags, ids, len + 1, &n, err, sizeof err);
        if (st == MOE_OK) {
            if (moe_detokenize(t, ids, n, back, len + 1, &bl, err, sizeof err) != MOE_OK || bl != len || memcmp(back, text, len)) abort();
        } else if (st != MOE_ERR_ARG || (flags & MOE_TOK_RAW_BYTES)) {
            abort(); /* only invalid UTF-8 in strict mode may be refused */
        }
        if (len && moe__pretokenize(pretok, text, len, NULL, 0) >= 0 && moe_utf8_valid_prefix(text, len) != len) abort();
    }
    free(ids);
    free(back);
#elif defined(FUZZ_CHAT)
    if (!size) return 0;
    moe_chat_options o = moe_chat_default_options();
    o.add_generation_prompt = data[0] & 1, o.thinking = (data[0] >> 1) & 1, o.safe = (data[0] >> 2) & 1;
    o.thinking_effort = data[0] & 8 ? "low" : NULL;
    for (int k3 = 0; k3 < 2; k3++) {
        moe_tokenizer *t = fixed_tokenizer(MOE_PRETOK_KIMI, k3);
        char text[4096];
        size_t tl = 0, n = 0;
        int32_t ids[4096];
        (void)moe_chat_render(t, (const char *)data + 1, size - 1, &o, text, sizeof text, &tl, err, sizeof err);
        (void)moe_chat_encode(t, (const char *)data + 1, size - 1, &o, ids, 4096, &n, err, sizeof err);
        moe_chat_reply r;
        moe_chat_reply_init(&r, t, &o);
        for (size_t i = 0; i < n && i < 4096; i++) (void)moe_chat_reply_token(&r, t, ids[i]);
        /* the rendered prompt read as if it were a reply: tool-call parsing of arbitrary markup */
        char calls[8192];
        size_t cl = 0;
        (void)moe_chat_tool_calls(t, ids, n < 4096 ? n : 4096, &o, calls, sizeof calls, &cl, err, sizeof err);
    }
#elif defined(FUZZ_BATCH)
    moe__json *j = NULL;
    char line_why[600];
    if (!parse_line((const char *)data, size, 512, &j, line_why, sizeof line_why)) {
        char key[1100]; /* the line read as an answer line of an earlier run's output */
        (void)answer_key(j, key, sizeof key);
        const moe__json *cid = j->type == MOE_JSON_OBJ ? moe__json_get(j, "custom_id") : NULL;
        if (cid && cid->type == MOE_JSON_STR && *cid->str) {
            request rq = {0};
            char why[600];
            rq.custom_id = strdup(cid->str);
            const moe_tokenizer *tok = fixed_tokenizer(MOE_PRETOK_KIMI, 1);
            if (rq.custom_id) (void)parse_request(&rq, j, tok, moe_tokenizer_n_ids(tok), 512, 16, why, sizeof why);
            request_free(&rq);
        }
        moe__json_free(j);
    }
#elif defined(FUZZ_HTTP)
    /* the bytes a connection received: every request parsed in turn, as a server loop would */
    size_t at = 0;
    for (int k = 0; k < 64 && at < size; k++) {
        http_request rq;
        size_t used = 0;
        const char *why;
        const int st = http_parse((const char *)data + at, size - at, 8192, 1 << 20, &rq, &used, &why);
        if (st != HTTP_OK) {
            if (st != HTTP_INCOMPLETE && (st < 400 || st > 505 || !why)) abort(); /* an error always says why */
            break;
        }
        /* everything it points to lies within the request it consumed */
        const char *lo = (const char *)data + at, *hi = lo + used;
        if (!used || used > size - at || rq.method < lo || rq.target + rq.target_len > hi || rq.body + rq.body_len != hi) abort();
        for (int i = 0; i < rq.n_headers; i++)
            if (rq.headers[i].name < lo || rq.headers[i].value + rq.headers[i].value_len > hi) abort();
        at += used;
    }
#else
#error "define one of FUZZ_JSON, FUZZ_SAFETENSORS, FUZZ_GGUF, FUZZ_CONFIG, FUZZ_RANKS, FUZZ_TOKENIZE, FUZZ_CHAT, FUZZ_BATCH, FUZZ_HTTP"
#endif
    return 0;
}
