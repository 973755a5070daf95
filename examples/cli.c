/* moe-cli: generate text from a prompt, or chat, with llama.cpp-style flags.
 *
 *   moe-cli -m MODEL [-p TEXT | -f FILE] [-n N] [-t THREADS] [-c CTX] [--temp T] [--top-k K]
 *           [--top-p P] [--min-p P] [-s SEED] [--stop STR]... [--chat-template auto|k2|k3|none]
 *           [-sys TEXT] [-cnv] [--ids] [--ignore-eos] [...]
 *
 * Text goes through the tokenizer the model ships (tiktoken.model, or the GGUF's vocabulary);
 * --ids takes the prompt as token ids instead (for models without one) and prints ids. Output
 * is streamed as it is generated and never split inside a UTF-8 character; generation stops at
 * the end-of-turn token, a stop string or -n tokens. Timings and expert statistics go to stderr.
 * Exit 0 on success, 1 on errors, 2 on usage errors. */
#define _POSIX_C_SOURCE 200809L
#include "../moe.h"
#include "files.h"
#include "cache_flags.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int usage(const char *msg) {
    if (msg) fprintf(stderr, "moe-cli: %s\n", msg);
    fprintf(msg ? stderr : stdout,
            "usage: moe-cli -m MODEL [-p TEXT | -f FILE] [options]\n"
            "\n"
            "prompt and output:\n"
            "  -m MODEL        checkpoint directory, .safetensors file (config.json beside it) or .gguf\n"
            "  -p TEXT         the prompt\n"
            "  -f FILE         read the prompt from FILE ('-' = stdin); with neither -p nor -f the prompt\n"
            "                  is read from stdin when it is not a terminal\n"
            "  --ids           the prompt is space-separated token ids, and ids are printed (models\n"
            "                  without a tokenizer)\n"
            "  -n N            tokens to generate (default 128; -1 = until the end token or context)\n"
            "  -c CTX          context size in tokens (default: prompt + n, 4096 in chat mode)\n"
            "  --stop STR      stop when the output contains STR (repeatable; STR is not printed)\n"
            "  --ignore-eos    keep generating after the end-of-turn token\n"
            "  --show-special  print special tokens (markers) by name\n"
            "  --no-display-prompt  do not echo the prompt before the generated text\n"
            "\n"
            "chat:\n"
            "  -cnv, --chat    interactive chat: read user turns from stdin, one per line; empty line or\n"
            "                  EOF ends; /reset starts over\n"
            "  --chat-template NAME  auto (from the vocabulary: K3 XTML when it has <|open|>, else Kimi K2),\n"
            "                  k2, k3, or none (raw completion; default without -cnv)\n"
            "  -sys TEXT       system prompt (chat)\n"
            "  --no-think      K3: thinking off (the reply starts in the response channel)\n"
            "  --effort E      K3: thinking effort low|high|max (default max)\n"
            "\n"
            "sampling:\n"
            "  --temp T        temperature, 0 = greedy (default 0.8)\n"
            "  --top-k K       keep the K most likely tokens (default 40, 0 = off)\n"
            "  --top-p P       nucleus sampling (default 0.95, 1 = off)\n"
            "  --min-p P       drop tokens below P x the top probability (default 0.05, 0 = off)\n"
            "  -s SEED         sampling seed (default: time); the same seed gives the same text\n"
            "  --repeat-penalty P     divide/multiply the logits of recent tokens by P (default 1 = off)\n"
            "  --presence-penalty P   subtract P from recent tokens' logits (default 0)\n"
            "  --frequency-penalty P  subtract P per occurrence among recent tokens (default 0)\n"
            "  --repeat-last-n N      how many recent tokens the penalties look at (default 64)\n"
            "\n"
            "performance:\n"
            "  -t THREADS      worker threads (default 1)\n"
            "  --batch N       rows per internal forward chunk (default 2048; 512 with --load-mode cache)\n"
            "  --load-mode M   routed experts through the file mapping (mmap, default) or read into a\n"
            "                  cache of --expert-budget bytes (cache)\n"
            "  --expert-budget SIZE  cache size, e.g. 512M or 8G (cache mode)\n"
            "  --dense-budget SIZE   cache mode: RAM for the layers' dense matrices; the layers beyond it\n"
            "                        are read from disk every step through the cache (default: all resident)\n"
            "  --io-threads N        cache mode: threads reading experts from disk, in file order (default 4)\n"
            "  --prefetch on|off     cache mode: read the next layer's predicted experts ahead (on)\n"
            "  --kv-type f32|bf16|q8 MLA latent cache element (f32, exact; bf16 halves it, decode attends in bf16\n"
            "                        products; q8 quarters it, int8 products, lossy: README)\n"
            "  --mxfp4 f32|int8      MXFP4 experts times f32 input (exact, default) or int8-quantized input (faster)\n"
            "  --act 8|16            input of the integer formats (Q8_0, Q4_0, ...) quantized to 8 bits (default)\n"
            "                        or to two 8-bit parts, about 16 bits: half Q8_0's KL divergence, twice the\n"
            "                        arithmetic (prefill slower, decode reads the same bytes)\n"
            "  --scalar        the scalar reference kernels instead of the CPU's SIMD ones (the kernel set\n"
            "                  in use is printed after loading)\n"
            "  --kernels NAME  a kernel set this CPU runs by name (scalar, avx2, avxvnni, avx512, avx512vnni,\n"
            "                  amx, neon, neon-dotprod) instead of its best\n"
            "  -h, --help      this text\n");
    return msg ? 2 : 0;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* parses space-separated ids from text; returns count or -1 */
static int parse_ids(const char *text, int32_t **out) {
    int n = 0, cap = 16;
    int32_t *ids = malloc(sizeof *ids * (size_t)cap);
    const char *p = text;
    while (ids) {
        while (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r' || *p == ',') p++;
        if (!*p) break;
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX) { free(ids); return -1; }
        if (n == cap) {
            int32_t *nb = realloc(ids, sizeof *ids * (size_t)(cap *= 2));
            if (!nb) { free(ids); return -1; }
            ids = nb;
        }
        ids[n++] = (int32_t)v;
        p = end;
    }
    if (!ids) return -1;
    *out = ids;
    return n;
}


static int num_arg(const char *s, double lo, double hi, double *out) {
    char *end;
    double v = strtod(s, &end);
    if (*end || !(v >= lo && v <= hi)) return 0;
    *out = v;
    return 1;
}


static void on_progress(void *ud, const char *stage, float frac) {
    (void)ud;
    fprintf(stderr, "\rmoe-cli: loading: %s %3.0f%%", stage, 100.0 * frac);
    fflush(stderr);
}

/* ---- streaming output: whole UTF-8 characters only, stop strings held back until decided ---- */

typedef struct {
    char *buf; /* bytes generated and not yet printed */
    size_t n, cap;
    char **stop;
    int n_stop;
    char *reply; /* everything printed this turn (the assistant message, for chat history) */
    size_t rn, rcap;
    int stopped;
} outq;

static int grow(char **p, size_t *cap, size_t need) {
    if (need <= *cap) return 1;
    size_t c = *cap ? *cap : 256;
    while (c < need) c *= 2;
    char *q = realloc(*p, c);
    if (!q) return 0;
    *p = q, *cap = c;
    return 1;
}

static void emit(outq *q, const char *s, size_t n) {
    fwrite(s, 1, n, stdout);
    if (grow(&q->reply, &q->rcap, q->rn + n + 1)) memcpy(q->reply + q->rn, s, n), q->rn += n, q->reply[q->rn] = 0;
}

/* Appends bytes and prints what moe_text_ready says may be shown; at the end (final) the rest.
 * Sets stopped when a stop string appears (the text is cut before it). */
static void outq_push(outq *q, const char *s, size_t n, int final) {
    if (q->stopped || !grow(&q->buf, &q->cap, q->n + n + 1)) return;
    memcpy(q->buf + q->n, s, n);
    q->n += n;
    size_t cut = moe_text_ready(q->buf, q->n, (const char *const *)q->stop, q->n_stop, final, &q->stopped);
    emit(q, q->buf, cut);
    fflush(stdout);
    memmove(q->buf, q->buf + cut, q->n - cut);
    q->n -= cut;
    if (q->stopped) q->n = 0;
}

/* Appends {"role": ROLE, "content": TEXT[, "reasoning_content": R]} to the JSON messages list
 * in *conv (which ends just before its closing "]}"). */
static int append_msg(char **conv, size_t *n, size_t *cap, int *n_msgs, const char *role, const char *text, size_t len, const char *reasoning,
                      size_t rlen) {
    if (!grow(conv, cap, *n + 6 * (len + rlen) + 96)) return 0;
    char *o = *conv + *n;
    o += sprintf(o, "%s{\"role\": \"%s\", \"content\": \"", *n_msgs ? ", " : "", role);
    for (int part = 0; part < 2; part++) {
        const char *src = part ? reasoning : text;
        size_t sl = part ? rlen : len;
        if (part && !reasoning) break;
        if (part) o += sprintf(o, "\", \"reasoning_content\": \"");
        for (size_t i = 0; i < sl; i++) {
            unsigned char ch = (unsigned char)src[i];
            if (ch == '"' || ch == '\\') *o++ = '\\', *o++ = (char)ch;
            else if (ch < 0x20) o += sprintf(o, "\\u%04x", ch);
            else *o++ = (char)ch;
        }
    }
    o += sprintf(o, "\"}");
    *n = (size_t)(o - *conv);
    (*n_msgs)++;
    memcpy(o, "]}", 3);
    return 1;
}

int main(int argc, char **argv) {
    const char *model = NULL, *prompt = NULL, *file = NULL, *sys = NULL, *tmpl = NULL, *effort = NULL;
    int n_gen = 128, n_ctx = 0, ignore_eos = 0, ids_mode = 0, chat = 0, show_special = 0, display_prompt = 1, think = 1;
    uint64_t seed = (uint64_t)time(NULL);
    moe_sampler sp = {.temperature = 0.8f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f, .repeat_penalty = 1.0f};
    int repeat_last_n = 64;
    char *stops[16];
    int n_stops = 0;
    moe_options opt = moe_default_options();
    for (int i = 1; i < argc; i++) {
        const char *why = NULL;
        int ck;
        const char *a = argv[i];
        double v;
        int more = i + 1 < argc;
        if (!strcmp(a, "-m") && more) model = argv[++i];
        else if (!strcmp(a, "-p") && more) prompt = argv[++i];
        else if (!strcmp(a, "-f") && more) file = argv[++i];
        else if (!strcmp(a, "-n") && more && num_arg(argv[++i], -1, 1e8, &v)) n_gen = (int)v;
        else if (!strcmp(a, "-t") && more && num_arg(argv[++i], 1, 1024, &v)) opt.n_threads = (int)v;
        else if (!strcmp(a, "--scalar")) opt.flags |= MOE_FLAG_FORCE_SCALAR;
        else if (!strcmp(a, "-c") && more && num_arg(argv[++i], 1, 1e9, &v)) n_ctx = (int)v;
        else if (!strcmp(a, "--temp") && more && num_arg(argv[++i], 0, 100, &v)) sp.temperature = (float)v;
        else if (!strcmp(a, "--top-k") && more && num_arg(argv[++i], 0, 1e9, &v)) sp.top_k = (int)v;
        else if (!strcmp(a, "--top-p") && more && num_arg(argv[++i], 0, 1, &v)) sp.top_p = (float)v;
        else if (!strcmp(a, "--min-p") && more && num_arg(argv[++i], 0, 1, &v)) sp.min_p = (float)v;
        else if (!strcmp(a, "-s") && more && num_arg(argv[++i], 0, 1.8e19, &v)) seed = (uint64_t)v;
        else if (!strcmp(a, "--batch") && more && num_arg(argv[++i], 1, 1e6, &v)) opt.n_batch = (int)v;
        else if (!strcmp(a, "--repeat-penalty") && more && num_arg(argv[++i], 0, 10, &v)) sp.repeat_penalty = (float)v;
        else if (!strcmp(a, "--presence-penalty") && more && num_arg(argv[++i], -10, 10, &v)) sp.presence_penalty = (float)v;
        else if (!strcmp(a, "--frequency-penalty") && more && num_arg(argv[++i], -10, 10, &v)) sp.frequency_penalty = (float)v;
        else if (!strcmp(a, "--repeat-last-n") && more && num_arg(argv[++i], 0, 1e6, &v)) repeat_last_n = (int)v;
        else if (!strcmp(a, "--stop") && more) {
            if (n_stops == 16 || !*argv[i + 1]) return usage("--stop: at most 16 non-empty strings");
            stops[n_stops++] = argv[++i];
        } else if (!strcmp(a, "--ignore-eos")) ignore_eos = 1;
        else if (!strcmp(a, "--ids")) ids_mode = 1;
        else if (!strcmp(a, "--show-special")) show_special = 1;
        else if (!strcmp(a, "--no-display-prompt")) display_prompt = 0;
        else if (!strcmp(a, "-cnv") || !strcmp(a, "--chat")) chat = 1;
        else if (!strcmp(a, "--chat-template") && more) tmpl = argv[++i];
        else if ((!strcmp(a, "-sys") || !strcmp(a, "--system-prompt")) && more) sys = argv[++i];
        else if (!strcmp(a, "--no-think")) think = 0;
        else if (!strcmp(a, "--effort") && more) effort = argv[++i];
        else if ((ck = cache_flag(argc, argv, &i, &opt, &why)) != 0) {
            if (ck < 0) return usage(why);
        } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) return usage(NULL);
        else return usage("unknown, incomplete or out-of-range argument");
    }
    int format = MOE_CHAT_AUTO;
    if (tmpl) {
        if (!strcmp(tmpl, "auto")) format = MOE_CHAT_AUTO;
        else if (!strcmp(tmpl, "k2")) format = MOE_CHAT_K2;
        else if (!strcmp(tmpl, "k3")) format = MOE_CHAT_K3;
        else if (!strcmp(tmpl, "none")) format = -1;
        else return usage("--chat-template is auto, k2, k3 or none");
    }
    const int templated = chat || (tmpl && format >= 0);
    if (chat && format < 0) return usage("-cnv needs a chat template");
    if (ids_mode && templated) return usage("--ids works without a chat template only");
    if (!model) return usage("-m MODEL is required");
    if (!chat && !prompt && !file) {
        if (isatty(0)) return usage("give a prompt with -p or -f (or on stdin), or -cnv to chat");
        file = "-";
    }
    if (effort && strcmp(effort, "low") && strcmp(effort, "high") && strcmp(effort, "max")) return usage("--effort is low, high or max");
    size_t plen = prompt ? strlen(prompt) : 0;
    char *text = prompt || chat ? NULL : slurp(file, &plen);
    if (!prompt && !chat && !text) {
        fprintf(stderr, "moe-cli: cannot read %s: %s\n", file, errno ? strerror(errno) : "read error");
        return 1;
    }
    if (prompt) text = strdup(prompt);

    char err[512];
    moe_model *m = NULL;
    moe_session *s = NULL;
    moe_tokenizer *tok = NULL;
    float *logits = NULL;
    int32_t *hist = NULL, *ids = NULL;
    char *conv = NULL, *line = NULL, *think_buf = NULL;
    outq q = {0};
    q.stop = stops, q.n_stop = n_stops;
    int rc = 1;
    double t0 = now();
    if (isatty(2)) opt.progress = on_progress;
    fprintf(stderr, "moe-cli: loading %s\n", model);
    moe_status st = moe_model_open(&m, model, &opt, err, sizeof err);
    if (opt.progress) fprintf(stderr, "\r\033[K");
    if (st) { fprintf(stderr, "moe-cli: %s: %s\n", moe_status_str(st), err); goto out; }
    const moe_config *c = moe_model_config(m);
    moe_model_info info = moe_model_get_info(m);
    fprintf(stderr, "moe-cli: %d layers, %.3g B params (%.3g B active), %d files, loaded in %.2f s; %s kernels, prompt chunks of %d\n",
            c->n_layers, info.n_params / 1e9, info.n_params_active / 1e9, info.n_files, now() - t0, info.kernels, info.n_batch);
    if (info.experts_kept_mapped)
        fprintf(stderr, "moe-cli: the routed experts do not fit in RAM: they stay mapped and are read from disk as needed "
                        "(row kernels; --load-mode cache streams them through a fixed budget instead)\n");
    if (!ids_mode && (st = moe_tokenizer_for_model(&tok, m, err, sizeof err))) {
        fprintf(stderr, "moe-cli: %s (use --ids to give token ids)\n", err);
        goto out;
    }
    /* end-of-turn ids: the config's, and the vocabulary's [EOS] / turn markers */
    int32_t eos[4] = {c->eos_token_id, -1, -1, -1};
    if (tok) eos[1] = moe_token_id(tok, "[EOS]"), eos[2] = moe_token_id(tok, "<|im_end|>"), eos[3] = moe_token_id(tok, "<|end_of_msg|>");
    if (tok && templated) {
        int f = format ? format : moe_chat_format_of(tok);
        if (f < 0) { fprintf(stderr, "moe-cli: the vocabulary has no chat markers; use --chat-template none\n"); goto out; }
        format = f;
    }
    moe_chat_options co = moe_chat_default_options();
    co.format = format > 0 ? format : MOE_CHAT_AUTO;
    co.thinking = think;
    co.thinking_effort = effort;
    moe_chat_reply rep;
    if (!n_ctx) n_ctx = chat ? 4096 : 0;
    if (!(logits = malloc(sizeof(float) * (size_t)c->vocab_size))) { fprintf(stderr, "moe-cli: out of memory\n"); goto out; }

    /* the conversation so far, as a JSON messages list */
    size_t conv_n = 0, conv_cap = 0, think_n = 0, think_cap = 0;
    int n_msgs = 0;
    if (templated) {
        if (!grow(&conv, &conv_cap, 64)) goto oom;
        conv_n = (size_t)sprintf(conv, "{\"messages\": [");
    }
    moe_step_stats tot = {0};
    double t_prompt = 0, t_gen = 0;
    int n_prompt = 0, n_out = 0, nh = 0;
    size_t hist_cap = 0, line_cap = 0;
    for (int turn = 0;; turn++) {
        /* the user's text for this turn */
        size_t ulen = 0;
        const char *utext;
        if (chat) {
            fprintf(stderr, "\n> ");
            fflush(stderr);
            ssize_t r = getline(&line, &line_cap, stdin);
            if (r <= 0) break;
            while (r > 0 && (line[r - 1] == '\n' || line[r - 1] == '\r')) line[--r] = 0;
            if (!r) break;
            if (!strcmp(line, "/reset")) {
                conv_n = (size_t)sprintf(conv, "{\"messages\": [");
                n_msgs = 0;
                moe_session_reset(s);
                nh = 0;
                fprintf(stderr, "moe-cli: conversation reset\n");
                continue;
            }
            utext = line, ulen = (size_t)r;
        } else {
            utext = text, ulen = plen;
        }
        if (moe_utf8_valid_prefix(utext, ulen) != ulen) {
            fprintf(stderr, "moe-cli: the prompt is not valid UTF-8\n");
            if (chat) continue;
            goto out;
        }
        /* the prompt's ids */
        free(ids);
        ids = NULL;
        size_t nid = 0;
        if (ids_mode) {
            int k = parse_ids(utext, &ids);
            if (k <= 0) { fprintf(stderr, "moe-cli: the prompt must be a non-empty list of token ids\n"); goto out; }
            nid = (size_t)k;
        } else if (templated) {
            if (!n_msgs && sys && !append_msg(&conv, &conv_n, &conv_cap, &n_msgs, "system", sys, strlen(sys), NULL, 0)) goto oom;
            if (!append_msg(&conv, &conv_n, &conv_cap, &n_msgs, "user", utext, ulen, NULL, 0)) goto oom;
            size_t cap = conv_n * 2 + 4096;
            ids = malloc(cap * sizeof *ids);
            if (!ids) goto oom;
            st = moe_chat_encode(tok, conv, conv_n + 2, &co, ids, cap, &nid, err, sizeof err);
            if (st) { fprintf(stderr, "moe-cli: %s\n", err); goto out; }
        } else {
            ids = malloc((ulen + 1) * sizeof *ids);
            if (!ids) goto oom;
            if ((st = moe_tokenize(tok, utext, ulen, 0, ids, ulen + 1, &nid, err, sizeof err))) { fprintf(stderr, "moe-cli: %s\n", err); goto out; }
            if (!nid) { fprintf(stderr, "moe-cli: the prompt is empty\n"); goto out; }
        }
        /* the session: keep what it holds when the new prompt extends it, else start over */
        int ctx = n_ctx ? n_ctx : (int)nid + (n_gen >= 0 ? n_gen : 4096);
        if (!s && (st = moe_session_new(&s, m, ctx, err, sizeof err))) { fprintf(stderr, "moe-cli: %s\n", err); goto out; }
        int keep = nh <= (int)nid && (!nh || !memcmp(hist, ids, sizeof *ids * (size_t)nh)) ? nh : 0;
        if (!keep && nh) moe_session_reset(s), nh = 0;
        size_t need = nid + (size_t)(n_gen >= 0 ? n_gen : ctx) + 2;
        if (need > hist_cap) {
            int32_t *nhist = realloc(hist, need * sizeof *hist);
            if (!nhist) goto oom;
            hist = nhist, hist_cap = need;
        }
        memcpy(hist + nh, ids + nh, sizeof *ids * (nid - (size_t)nh));
        int feed = (int)nid - keep;
        if (moe_session_pos(s) + feed >= ctx) { fprintf(stderr, "moe-cli: the prompt (%d tokens) does not fit the context of %d\n", (int)nid, ctx); goto out; }
        if (display_prompt && !chat) {
            if (ids_mode) for (size_t i = 0; i < nid; i++) printf(i ? " %d" : "%d", (int)ids[i]);
            else fwrite(utext, 1, ulen, stdout);
            fflush(stdout);
        }
        moe_step_stats ps;
        double tp = now();
        if (feed > 0) {
            moe_seq sq = {.s = s, .tokens = ids + keep, .n = feed, .logits = logits};
            if ((st = moe_step(m, &sq, 1, &ps, err, sizeof err))) { fprintf(stderr, "moe-cli: %s\n", err); goto out; }
            tot.expert_loads += ps.expert_loads, tot.expert_bytes += ps.expert_bytes, tot.cache_hits += ps.cache_hits;
            tot.cache_misses += ps.cache_misses, tot.bytes_read += ps.bytes_read, tot.io_seconds += ps.io_seconds, tot.dense_reads += ps.dense_reads;
        }
        t_prompt += now() - tp, n_prompt += feed;
        nh = (int)nid;
        /* generate */
        double td = now();
        q.stopped = 0, q.n = 0, q.rn = 0, think_n = 0;
        if (q.reply) q.reply[0] = 0;
        if (templated) moe_chat_reply_init(&rep, tok, &co);
        int was_reasoning = 0;
        int gen = 0;
        for (; n_gen < 0 || gen < n_gen; gen++) {
            sp.recent = hist + (nh > repeat_last_n ? nh - repeat_last_n : 0);
            sp.n_recent = nh < repeat_last_n ? nh : repeat_last_n;
            int32_t t = moe_sample(logits, c->vocab_size, &sp, &seed);
            hist[nh++] = t;
            int end = !ignore_eos && (t == eos[0] || t == eos[1] || t == eos[2] || t == eos[3]);
            if (ids_mode) {
                printf(" %d", (int)t);
                fflush(stdout);
            } else {
                size_t bl;
                const char *b = moe_token_bytes(tok, t, &bl);
                int ch = templated ? moe_chat_reply_token(&rep, tok, t) : moe_token_is_special(tok, t) ? MOE_REPLY_HIDDEN : MOE_REPLY_CONTENT;
                if (ch == MOE_REPLY_REASONING) { /* the think channel goes to stderr */
                    if (!was_reasoning) fprintf(stderr, "[thinking] ");
                    was_reasoning = 1;
                    fwrite(b, 1, bl, stderr);
                    if (grow(&think_buf, &think_cap, think_n + bl + 1)) memcpy(think_buf + think_n, b, bl), think_n += bl;
                } else {
                    if (was_reasoning) fprintf(stderr, "\n[/thinking]\n"), was_reasoning = 0;
                    if (b && (ch == MOE_REPLY_CONTENT || (show_special && (ch != MOE_REPLY_END || !ignore_eos)))) outq_push(&q, b, bl, 0);
                }
            }
            if (end || q.stopped || (n_gen >= 0 && gen + 1 >= n_gen)) { gen++; break; }
            if (moe_session_pos(s) + 1 >= ctx) { fprintf(stderr, "\nmoe-cli: context full\n"); gen++; break; }
            moe_step_stats ds;
            moe_seq d = {.s = s, .tokens = &t, .n = 1, .logits = logits};
            if ((st = moe_step(m, &d, 1, &ds, err, sizeof err))) { fprintf(stderr, "\nmoe-cli: %s\n", err); goto out; }
            tot.expert_rows += ds.expert_rows, tot.expert_loads += ds.expert_loads, tot.expert_bytes += ds.expert_bytes;
            tot.cache_hits += ds.cache_hits, tot.cache_misses += ds.cache_misses, tot.bytes_read += ds.bytes_read, tot.io_seconds += ds.io_seconds;
            tot.dense_reads += ds.dense_reads;
            tot.prefetch_issued += ds.prefetch_issued, tot.prefetch_predicted += ds.prefetch_predicted, tot.prefetch_routed += ds.prefetch_routed;
        }
        outq_push(&q, "", 0, 1);
        printf("\n");
        fflush(stdout);
        t_gen += now() - td, n_out += gen;
        if (!chat) break;
        /* the reply joins the conversation; the session holds the generated tokens, which the
         * next render normally reproduces, so only the new user turn is computed */
        if (!append_msg(&conv, &conv_n, &conv_cap, &n_msgs, "assistant", q.reply ? q.reply : "", q.rn, format == MOE_CHAT_K3 && think ? think_buf : NULL, think_n))
            goto oom;
    }
    fprintf(stderr, "moe-cli: prompt %d tokens in %.3f s (%.1f tok/s); generated %d tokens in %.3f s (%.2f tok/s)\n", n_prompt, t_prompt,
            n_prompt / (t_prompt > 0 ? t_prompt : 1e-9), n_out, t_gen, n_out / (t_gen > 0 ? t_gen : 1e-9));
    fprintf(stderr, "moe-cli: experts: %llu loads, %.1f MB (%.2f MB/token generated)\n", (unsigned long long)tot.expert_loads,
            tot.expert_bytes / 1e6, n_out ? tot.expert_bytes / 1e6 / n_out : 0.0);
    if (opt.expert_mode == MOE_EXPERTS_CACHE) {
        const uint64_t lk = tot.cache_hits + tot.cache_misses;
        fprintf(stderr, "moe-cli: expert cache: %llu hits, %llu misses (hit rate %.1f%%), %.1f MB read in %.3f s (%.0f MB/s)\n",
                (unsigned long long)tot.cache_hits, (unsigned long long)tot.cache_misses, lk ? 100.0 * tot.cache_hits / lk : 0.0,
                tot.bytes_read / 1e6, tot.io_seconds, tot.io_seconds > 0 ? tot.bytes_read / 1e6 / tot.io_seconds : 0.0);
        const moe_model_info mi = moe_model_get_info(m);
        if (mi.streamed_layers)
            fprintf(stderr, "moe-cli: %d layers stream their dense matrices (%.1f MB a step): %llu layer reads\n", mi.streamed_layers,
                    mi.streamed_bytes / 1e6, (unsigned long long)tot.dense_reads);
        if (opt.prefetch && tot.prefetch_routed)
            fprintf(stderr, "moe-cli: prefetch: %llu reads queued, recall %.1f%% of routed experts\n", (unsigned long long)tot.prefetch_issued,
                    100.0 * tot.prefetch_predicted / tot.prefetch_routed);
    }
    rc = ferror(stdout) ? 1 : 0;
    if (rc) fprintf(stderr, "moe-cli: write error on stdout\n");
    goto out;
oom:
    fprintf(stderr, "moe-cli: out of memory\n");
out:
    free(text);
    free(line);
    free(think_buf);
    free(conv);
    free(q.buf);
    free(q.reply);
    free(hist);
    free(ids);
    free(logits);
    moe_session_free(s);
    moe_tokenizer_free(tok);
    moe_model_close(m);
    return rc;
}
