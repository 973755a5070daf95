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
#include "prefix_cache.h"
#include "args.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static arg_help help = {
    "usage: moe-cli -m MODEL [-p TEXT | -f FILE] [options]\n"
    "\n"
    "prompt and output:\n"
    "  -m MODEL        checkpoint directory, .safetensors file (config.json beside it) or .gguf\n"
    "  -p TEXT         the prompt\n"
    "  -f FILE         read the prompt from FILE ('-' = stdin); with neither -p nor -f the prompt\n"
    "                  is read from stdin when it is not a terminal\n"
    "  --ids           the prompt is space-separated token ids, and ids are printed (models\n"
    "                  without a tokenizer)\n"
    "  -n N            tokens to generate (default 128; -1 = until the end token or context; 0 = the\n"
    "                  prompt only, for its timing)\n"
    "  -c CTX          context size in tokens (default: prompt + n, 4096 in chat mode)\n"
    "  --prefix-cache DIR  take the longest prompt prefix computed before (by moe-cli, moe-batch or\n"
    "                  moe-server given DIR) from DIR, and keep each prompt's state there\n"
    "  --prefix-cache-size SIZE  disk for DIR; least recently used files go first (default 20G)\n"
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
    "\n",
    "performance (what is not given, the resource plan chooses from the memory, CPUs and disk this\n"
    "process may use and the model's size; its choices are printed in one line, \"plan:\"):\n"
    "  -t THREADS      worker threads (default: the physical cores)\n"
    "  --batch N       rows per internal forward chunk (default 2048; 512 with --load-mode cache)\n"
    "  --load-mode M   routed experts through the file mapping (mmap) or read into a cache of\n"
    "                  --expert-budget bytes (cache); default mmap where the weights fit in memory\n"
    "  --expert-budget SIZE  cache size, e.g. 512M or 8G (cache mode; default what the rest leaves)\n"
    "  --dense TYPE    the dense matrices (attention, shared experts, LM head) converted at load: asis,\n"
    "                  f32, bf16, q8_0, q4_0, or auto (default: as stored where the weights fit, else\n"
    "                  floats quantized to q8_0, or q4_0 where q8_0 leaves too little for experts)\n"
    "  --dense-budget SIZE   cache mode: RAM for the layers' dense matrices; the layers beyond it\n"
    "                        are read from disk every step through the cache (default: all resident\n"
    "                        where they fit)\n"
    "  --io-threads N        cache mode: threads reading experts from disk, in file order (default\n"
    "                        16 where 16 readers beat 4 on the model's disk, else 4)\n"
    "  --prefetch on|off     cache mode: read the next layer's predicted experts ahead (on)\n"
    "  --kv-type f32|bf16|q8 MLA latent cache element (f32, exact; bf16 halves it, decode attends in bf16\n"
    "                        products; q8 quarters it, int8 products, lossy: docs/numerics.md)\n"
    "  --mxfp4 f32|int8      MXFP4 experts times f32 input (exact, default) or int8-quantized input (faster)\n"
    "  --act 8|16            input of the integer formats (Q8_0, Q4_0, ...) quantized to 8 bits (default)\n"
    "                        or to two 8-bit parts, about 16 bits: half Q8_0's KL divergence, twice the\n"
    "                        arithmetic (prefill slower, decode reads the same bytes)\n"
    "  --scalar        the scalar reference kernels instead of the CPU's SIMD ones (the kernel set\n"
    "                  in use is printed after loading)\n"
    "  --kernels NAME  a kernel set this CPU runs by name (scalar, avx2, avxvnni, avx512, avx512vnni,\n"
    "                  amx, neon, neon-dotprod) instead of its best\n"
    "  --check-tensors read every float tensor at load and refuse a NaN or an infinity by name\n"
    "                  (without it: the ones converted or read at load, and every step's logits)\n"
    "  -h, --help      this text\n", NULL};

static int usage(const char *msg) { return arg_usage("moe-cli", help, msg); }

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

typedef struct {
    const char *model, *prompt, *file, *sys, *effort, *prefix_dir;
    size_t prefix_size;
    int n_gen, n_ctx, ignore_eos, ids_mode, chat, show_special, display_prompt, think, repeat_last_n;
    int format;    /* MOE_CHAT_AUTO, _K2, _K3, or -1: none */
    int templated; /* prompts go through a chat template */
    uint64_t seed;
    moe_sampler sp;
    char *stops[16];
    int n_stops;
    moe_options opt;
} options;

/* The options checked together once all are read: the chat template named by --chat-template,
 * the model, where the prompt comes from, --effort; 0 or usage()'s status */
static int check_options(options *o, const char *tmpl) {
    o->format = MOE_CHAT_AUTO;
    if (tmpl) {
        if (!strcmp(tmpl, "auto")) o->format = MOE_CHAT_AUTO;
        else if (!strcmp(tmpl, "k2")) o->format = MOE_CHAT_K2;
        else if (!strcmp(tmpl, "k3")) o->format = MOE_CHAT_K3;
        else if (!strcmp(tmpl, "none")) o->format = -1;
        else return usage("--chat-template is auto, k2, k3 or none");
    }
    o->templated = o->chat || (tmpl && o->format >= 0);
    if (o->chat && o->format < 0) return usage("-cnv needs a chat template");
    if (o->ids_mode && o->templated) return usage("--ids works without a chat template only");
    if (!o->model) return usage("-m MODEL is required");
    if (!o->chat && !o->prompt && !o->file) {
        if (isatty(0)) return usage("give a prompt with -p or -f (or on stdin), or -cnv to chat");
        o->file = "-";
    }
    if (o->effort && strcmp(o->effort, "low") && strcmp(o->effort, "high") && strcmp(o->effort, "max")) return usage("--effort is low, high or max");
    return 0;
}

/* Parses the command line into o; 0, or usage()'s exit status with *done set. */
static int parse_args(int argc, char **argv, options *o, int *done) {
    *o = (options){.n_gen = 128, .prefix_size = (size_t)20 << 30, .display_prompt = 1, .think = 1, .repeat_last_n = 64, .seed = (uint64_t)time(NULL),
                   .sp = {.temperature = 0.8f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f, .repeat_penalty = 1.0f},
                   .opt = moe_default_options()};
    const char *tmpl = NULL;
    o->opt.flags |= MOE_FLAG_PLAN; /* what the command line does not set, the resource plan does */
    *done = 1;
    for (int i = 1; i < argc; i++) {
        const char *why = NULL;
        int ck;
        const char *a = argv[i];
        double v;
        int more = i + 1 < argc;
        if (!strcmp(a, "-m") && more) o->model = argv[++i];
        else if (!strcmp(a, "-p") && more) o->prompt = argv[++i];
        else if (!strcmp(a, "-f") && more) o->file = argv[++i];
        else if (!strcmp(a, "-n") && more) {
            if (arg_num("moe-cli", help, a, argv[++i], -1, 1e8, 1, &v)) return 2;
            o->n_gen = (int)v;
        }
        else if (!strcmp(a, "-t") && more) {
            if (arg_num("moe-cli", help, a, argv[++i], 1, 1024, 1, &v)) return 2;
            o->opt.n_threads = (int)v, o->opt.set |= MOE_SET_THREADS;
        }
        else if (!strcmp(a, "--scalar")) o->opt.flags |= MOE_FLAG_FORCE_SCALAR;
        else if (!strcmp(a, "-c") && more) {
            if (arg_num("moe-cli", help, a, argv[++i], 1, 1e9, 1, &v)) return 2;
            o->n_ctx = (int)v;
        }
        else if (!strcmp(a, "--temp") && more) {
            if (arg_num("moe-cli", help, a, argv[++i], 0, 100, 0, &v)) return 2;
            o->sp.temperature = (float)v;
        }
        else if (!strcmp(a, "--top-k") && more) {
            if (arg_num("moe-cli", help, a, argv[++i], 0, 1e9, 1, &v)) return 2;
            o->sp.top_k = (int)v;
        }
        else if (!strcmp(a, "--top-p") && more) {
            if (arg_num("moe-cli", help, a, argv[++i], 0, 1, 0, &v)) return 2;
            o->sp.top_p = (float)v;
        }
        else if (!strcmp(a, "--min-p") && more) {
            if (arg_num("moe-cli", help, a, argv[++i], 0, 1, 0, &v)) return 2;
            o->sp.min_p = (float)v;
        }
        else if (!strcmp(a, "-s") && more) {
            if (arg_num("moe-cli", help, a, argv[++i], 0, 1.8e19, 1, &v)) return 2;
            o->seed = (uint64_t)v;
        }
        else if (!strcmp(a, "--batch") && more) {
            if (arg_num("moe-cli", help, a, argv[++i], 1, 1e6, 1, &v)) return 2;
            o->opt.n_batch = (int)v;
        }
        else if (!strcmp(a, "--repeat-penalty") && more) {
            if (arg_num("moe-cli", help, a, argv[++i], 0, 10, 0, &v)) return 2;
            o->sp.repeat_penalty = (float)v;
        }
        else if (!strcmp(a, "--presence-penalty") && more) {
            if (arg_num("moe-cli", help, a, argv[++i], -10, 10, 0, &v)) return 2;
            o->sp.presence_penalty = (float)v;
        }
        else if (!strcmp(a, "--frequency-penalty") && more) {
            if (arg_num("moe-cli", help, a, argv[++i], -10, 10, 0, &v)) return 2;
            o->sp.frequency_penalty = (float)v;
        }
        else if (!strcmp(a, "--repeat-last-n") && more) {
            if (arg_num("moe-cli", help, a, argv[++i], 0, 1e6, 1, &v)) return 2;
            o->repeat_last_n = (int)v;
        }
        else if (!strcmp(a, "--stop") && more) {
            if (o->n_stops == 16 || !*argv[i + 1]) return usage("--stop: at most 16 non-empty strings");
            o->stops[o->n_stops++] = argv[++i];
        } else if (!strcmp(a, "--ignore-eos")) o->ignore_eos = 1;
        else if (!strcmp(a, "--ids")) o->ids_mode = 1;
        else if (!strcmp(a, "--show-special")) o->show_special = 1;
        else if (!strcmp(a, "--no-display-prompt")) o->display_prompt = 0;
        else if (!strcmp(a, "-cnv") || !strcmp(a, "--chat")) o->chat = 1;
        else if (!strcmp(a, "--chat-template") && more) tmpl = argv[++i];
        else if ((!strcmp(a, "-sys") || !strcmp(a, "--system-prompt")) && more) o->sys = argv[++i];
        else if (!strcmp(a, "--no-think")) o->think = 0;
        else if (!strcmp(a, "--effort") && more) o->effort = argv[++i];
        else if ((ck = pc_flag(argc, argv, &i, &o->prefix_dir, &o->prefix_size, &why)) != 0) {
            if (ck < 0) return usage(why);
        } else if ((ck = cache_flag(argc, argv, &i, &o->opt, &why)) != 0) {
            if (ck < 0) return usage(why);
        } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) return usage(NULL);
        else return arg_unknown("moe-cli", help, a, more ? argv[i + 1] : NULL);
    }
    int rc = check_options(o, tmpl);
    *done = rc != 0;
    return rc;
}

/* Everything a run holds. Functions below return 0, or 1 after printing what went wrong. */
typedef struct {
    options o;
    char *text; /* the prompt (not in chat mode) */
    size_t plen;
    moe_model *m;
    const moe_config *c;
    moe_session *s;
    moe_tokenizer *tok;
    moe_chat_options co;
    moe_chat_reply rep;
    float *logits;
    int32_t *hist; /* the session's tokens: prompt and generated */
    int nh;
    size_t hist_cap;
    int32_t *ids; /* this turn's prompt */
    char *conv;   /* the conversation so far, as a JSON messages list */
    size_t conv_n, conv_cap;
    int n_msgs;
    char *line; /* the user's line (chat) */
    size_t line_cap;
    char *think_buf; /* this turn's reasoning */
    size_t think_n, think_cap;
    outq q;
    moe_step_stats tot;
    double t_prompt, t_gen;
    long long read_prompt, read_gen; /* bytes read from storage in each; -1: not known */
    int n_prompt, n_out;
    prefix_cache pc; /* with --prefix-cache */
    int cached;      /* prompt tokens it gave */
    char err[512];
} cli;

/* adds the storage reads since since_bytes (storage_read_bytes() then) to *total */
static void add_read(long long *total, long long since_bytes) {
    const long long now_bytes = storage_read_bytes();
    if (*total >= 0 && since_bytes >= 0 && now_bytes >= since_bytes) *total += now_bytes - since_bytes;
    else *total = -1;
}

static int oom(void) { return fprintf(stderr, "moe-cli: out of memory\n"), 1; }

static void add_stats(moe_step_stats *t, const moe_step_stats *s, int decode) {
    t->expert_loads += s->expert_loads, t->expert_bytes += s->expert_bytes, t->cache_hits += s->cache_hits;
    t->cache_misses += s->cache_misses, t->bytes_read += s->bytes_read, t->io_seconds += s->io_seconds, t->dense_reads += s->dense_reads;
    if (!decode) return;
    t->expert_rows += s->expert_rows;
    t->prefetch_issued += s->prefetch_issued, t->prefetch_predicted += s->prefetch_predicted, t->prefetch_routed += s->prefetch_routed;
}

/* the model and its tokenizer; the chat format settled */
static int open_model(cli *r) {
    options *o = &r->o;
    double t0 = now();
    const long long r0 = storage_read_bytes();
    if (isatty(2)) o->opt.progress = on_progress;
    fprintf(stderr, "moe-cli: loading %s\n", o->model);
    moe_status st = moe_model_open(&r->m, o->model, &o->opt, r->err, sizeof r->err);
    if (o->opt.progress) fprintf(stderr, "\r\033[K");
    if (st) return fprintf(stderr, "moe-cli: %s: %s\n", moe_status_str(st), r->err), 1;
    use_plan("moe-cli", r->m, &o->opt);
    const moe_config *c = r->c = moe_model_config(r->m);
    moe_model_info info = moe_model_get_info(r->m);
    const long long r1 = storage_read_bytes();
    char read_mb[48] = "";
    if (r0 >= 0 && r1 >= r0) snprintf(read_mb, sizeof read_mb, " (%.1f MB read from storage)", (r1 - r0) / 1e6);
    fprintf(stderr, "moe-cli: %d layers, %.3g B params (%.3g B active), %d files, loaded in %.2f s%s; %s kernels, prompt chunks of %d\n",
            c->n_layers, info.n_params / 1e9, info.n_params_active / 1e9, info.n_files, now() - t0, read_mb, info.kernels, info.n_batch);
    if (info.experts_kept_mapped)
        fprintf(stderr, "moe-cli: the routed experts do not fit in RAM: they stay mapped and are read from disk as needed "
                        "(row kernels; --load-mode cache streams them through a fixed budget instead)\n");
    if (!o->ids_mode && moe_tokenizer_for_model(&r->tok, r->m, r->err, sizeof r->err))
        return fprintf(stderr, "moe-cli: %s (use --ids to give token ids)\n", r->err), 1;
    if (r->tok && o->templated) {
        int f = o->format ? o->format : moe_chat_format_of(r->tok);
        if (f < 0) return fprintf(stderr, "moe-cli: the vocabulary has no chat markers; use --chat-template none\n"), 1;
        o->format = f;
    }
    r->co = moe_chat_default_options();
    r->co.format = o->format > 0 ? o->format : MOE_CHAT_AUTO;
    r->co.thinking = o->think;
    r->co.thinking_effort = o->effort;
    if (!o->n_ctx) o->n_ctx = o->chat ? 4096 : 0;
    if (!(r->logits = malloc(sizeof(float) * (size_t)c->vocab_size))) return oom();
    if (o->prefix_dir && pc_open(&r->pc, "moe-cli", r->m, 1 << 30, 0, o->prefix_dir, o->prefix_size, r->err, sizeof r->err))
        return fprintf(stderr, "moe-cli: --prefix-cache %s\n", r->err), 1;
    if (o->templated) {
        if (!grow(&r->conv, &r->conv_cap, 64)) return oom();
        r->conv_n = (size_t)sprintf(r->conv, "{\"messages\": [");
    }
    return 0;
}

/* The user's text for this turn into *text: 1 a turn, 0 the end (chat: an empty line or EOF), 2
 * nothing to compute (/reset). */
/* Ctrl-C (SIGINT) while a reply is computed stops it: the flag is checked between tokens, and the
 * handler runs once (SA_RESETHAND), so a second Ctrl-C ends the program at once. At the chat
 * prompt Ctrl-C ends the program, as Ctrl-D does. */
static volatile sig_atomic_t interrupted;

static void on_interrupt(int sig) {
    (void)sig;
    interrupted = 1;
}

/* stop = 1: Ctrl-C stops the reply from now on; 0: it ends the program (the default action) */
static void ctrl_c_stops_reply(int stop) {
    static int ignored = -1; /* started with SIGINT ignored (a background job): left so */
    if (ignored < 0) {
        struct sigaction was;
        ignored = !sigaction(SIGINT, NULL, &was) && was.sa_handler == SIG_IGN;
    }
    if (ignored) return;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sigemptyset(&sa.sa_mask);
    sa.sa_handler = stop ? on_interrupt : SIG_DFL;
    sa.sa_flags = stop ? SA_RESETHAND : 0;
    interrupted = 0;
    sigaction(SIGINT, &sa, NULL);
}

static int next_turn(cli *r, const char **text, size_t *len) {
    if (!r->o.chat) return *text = r->text, *len = r->plen, 1;
    fprintf(stderr, "\n> ");
    fflush(stderr);
    ssize_t n = getline(&r->line, &r->line_cap, stdin);
    if (n <= 0) return 0;
    while (n > 0 && (r->line[n - 1] == '\n' || r->line[n - 1] == '\r')) r->line[--n] = 0;
    if (!n) return 0;
    if (!strcmp(r->line, "/reset")) {
        r->conv_n = (size_t)sprintf(r->conv, "{\"messages\": [");
        r->n_msgs = 0;
        moe_session_reset(r->s);
        r->nh = 0;
        fprintf(stderr, "moe-cli: conversation reset\n");
        return 2;
    }
    *text = r->line, *len = (size_t)n;
    return 1;
}

/* the prompt's ids into r->ids, *nid of them: parsed (--ids), rendered by the chat template with
 * the conversation so far, or tokenized */
static int prompt_ids(cli *r, const char *text, size_t len, size_t *nid) {
    free(r->ids);
    r->ids = NULL;
    *nid = 0;
    if (r->o.ids_mode) {
        int k = parse_ids(text, &r->ids);
        if (k <= 0) return fprintf(stderr, "moe-cli: the prompt must be a non-empty list of token ids\n"), 1;
        *nid = (size_t)k;
    } else if (r->o.templated) {
        const char *sys = r->o.sys;
        if (!r->n_msgs && sys && !append_msg(&r->conv, &r->conv_n, &r->conv_cap, &r->n_msgs, "system", sys, strlen(sys), NULL, 0)) return oom();
        if (!append_msg(&r->conv, &r->conv_n, &r->conv_cap, &r->n_msgs, "user", text, len, NULL, 0)) return oom();
        size_t cap = r->conv_n * 2 + 4096;
        if (!(r->ids = malloc(cap * sizeof *r->ids))) return oom();
        if (moe_chat_encode(r->tok, r->conv, r->conv_n + 2, &r->co, r->ids, cap, nid, r->err, sizeof r->err))
            return fprintf(stderr, "moe-cli: %s\n", r->err), 1;
    } else {
        if (!(r->ids = malloc((len + 1) * sizeof *r->ids))) return oom();
        if (moe_tokenize(r->tok, text, len, 0, r->ids, len + 1, nid, r->err, sizeof r->err)) return fprintf(stderr, "moe-cli: %s\n", r->err), 1;
        if (!*nid) return fprintf(stderr, "moe-cli: the prompt is empty\n"), 1;
    }
    return 0;
}

/* The prompt's ids computed into the session: it keeps what it holds when the new prompt extends
 * it, else starts over. *ctx: the turn's context size. */
static int feed_prompt(cli *r, const char *text, size_t len, size_t nid, int *ctx) {
    const options *o = &r->o;
    *ctx = o->n_ctx ? o->n_ctx : (int)nid + (o->n_gen >= 0 ? o->n_gen : 4096);
    if (!r->s && moe_session_new(&r->s, r->m, *ctx, r->err, sizeof r->err)) return fprintf(stderr, "moe-cli: %s\n", r->err), 1;
    int keep = r->nh <= (int)nid && (!r->nh || !memcmp(r->hist, r->ids, sizeof *r->ids * (size_t)r->nh)) ? r->nh : 0;
    if (!keep && r->nh) moe_session_reset(r->s), r->nh = 0;
    if (!keep && r->pc.dir) { /* a prompt computed before, by this run or another program, is not computed again */
        keep = pc_lookup(&r->pc, r->ids, (int)nid, r->s, r->logits);
        if (keep) fprintf(stderr, "moe-cli: prefix cache: %d of the prompt's %d tokens taken from %s\n", keep, (int)nid, o->prefix_dir);
    }
    size_t need = nid + (size_t)(o->n_gen >= 0 ? o->n_gen : *ctx) + 2;
    if (need > r->hist_cap) {
        int32_t *nhist = realloc(r->hist, need * sizeof *r->hist);
        if (!nhist) return oom();
        r->hist = nhist, r->hist_cap = need;
    }
    memcpy(r->hist + r->nh, r->ids + r->nh, sizeof *r->ids * (nid - (size_t)r->nh));
    int feed = (int)nid - keep;
    /* the prompt must fit, and leave room for a generated token unless none is asked for (-n 0) */
    if (moe_session_pos(r->s) + feed > *ctx || (o->n_gen != 0 && moe_session_pos(r->s) + feed >= *ctx))
        return fprintf(stderr, "moe-cli: the prompt (%d tokens) does not fit the context of %d\n", (int)nid, *ctx), 1;
    if (o->display_prompt && !o->chat) {
        if (o->ids_mode)
            for (size_t i = 0; i < nid; i++) printf(i ? " %d" : "%d", (int)r->ids[i]);
        else fwrite(text, 1, len, stdout);
        fflush(stdout);
    }
    moe_step_stats ps;
    const long long rp = storage_read_bytes();
    double tp = now();
    if (feed > 0) {
        moe_seq sq = {.s = r->s, .tokens = r->ids + keep, .n = feed, .logits = r->logits};
        if (moe_step(r->m, &sq, 1, &ps, r->err, sizeof r->err)) return fprintf(stderr, "moe-cli: %s\n", r->err), 1;
        add_stats(&r->tot, &ps, 0);
        if (r->pc.dir) pc_insert(&r->pc, r->ids, (int)nid, r->s, r->logits);
    }
    r->t_prompt += now() - tp, r->n_prompt += feed;
    add_read(&r->read_prompt, rp);
    r->nh = (int)nid;
    return 0;
}

/* sampled token t's text: to stdout (content), stderr (K3's reasoning), or hidden (markers) */
static void show_token(cli *r, int32_t t, int *was_reasoning) {
    const options *o = &r->o;
    if (o->ids_mode) {
        printf(" %d", (int)t);
        fflush(stdout);
        return;
    }
    size_t bl;
    const char *b = moe_token_bytes(r->tok, t, &bl);
    int ch = o->templated ? moe_chat_reply_token(&r->rep, r->tok, t) : moe_token_is_special(r->tok, t) ? MOE_REPLY_HIDDEN : MOE_REPLY_CONTENT;
    if (ch == MOE_REPLY_REASONING) { /* the think channel goes to stderr */
        if (!*was_reasoning) fprintf(stderr, "[thinking] ");
        *was_reasoning = 1;
        fwrite(b, 1, bl, stderr);
        if (grow(&r->think_buf, &r->think_cap, r->think_n + bl + 1)) memcpy(r->think_buf + r->think_n, b, bl), r->think_n += bl;
    } else {
        if (*was_reasoning) fprintf(stderr, "\n[/thinking]\n"), *was_reasoning = 0;
        if (b && (ch == MOE_REPLY_CONTENT || (o->show_special && (ch != MOE_REPLY_END || !o->ignore_eos)))) outq_push(&r->q, b, bl, 0);
    }
}

/* samples and decodes up to -n tokens, printing them as they come */
static int generate(cli *r, int ctx) {
    options *o = &r->o;
    double td = now();
    const long long rd = storage_read_bytes();
    r->q.stopped = 0, r->q.n = 0, r->q.rn = 0, r->think_n = 0;
    if (r->q.reply) r->q.reply[0] = 0;
    if (o->templated) moe_chat_reply_init(&r->rep, r->tok, &r->co);
    int was_reasoning = 0, gen = 0;
    for (; (o->n_gen < 0 || gen < o->n_gen) && !interrupted; gen++) {
        o->sp.recent = r->hist + (r->nh > o->repeat_last_n ? r->nh - o->repeat_last_n : 0);
        o->sp.n_recent = r->nh < o->repeat_last_n ? r->nh : o->repeat_last_n;
        int32_t t = moe_sample(r->logits, r->c->vocab_size, &o->sp, &o->seed);
        r->hist[r->nh++] = t;
        int end = !o->ignore_eos && moe_token_is_eog(r->m, r->tok, t);
        show_token(r, t, &was_reasoning);
        if (end || r->q.stopped || (o->n_gen >= 0 && gen + 1 >= o->n_gen)) { gen++; break; }
        if (moe_session_pos(r->s) + 1 >= ctx) { fprintf(stderr, "\nmoe-cli: context full\n"); gen++; break; }
        moe_step_stats ds;
        moe_seq d = {.s = r->s, .tokens = &t, .n = 1, .logits = r->logits};
        if (moe_step(r->m, &d, 1, &ds, r->err, sizeof r->err)) return fprintf(stderr, "\nmoe-cli: %s\n", r->err), 1;
        add_stats(&r->tot, &ds, 1);
    }
    outq_push(&r->q, "", 0, 1);
    printf("\n");
    fflush(stdout);
    if (interrupted) fprintf(stderr, "moe-cli: interrupted (Ctrl-C)%s\n", o->chat ? "; Ctrl-C or Ctrl-D at the prompt ends the chat" : "");
    r->t_gen += now() - td, r->n_out += gen;
    add_read(&r->read_gen, rd);
    return 0;
}

static void print_summary(const cli *r) {
    const moe_step_stats *tot = &r->tot;
    fprintf(stderr, "moe-cli: prompt %d tokens in %.3f s (%.1f tok/s); generated %d tokens in %.3f s (%.2f tok/s)\n", r->n_prompt, r->t_prompt,
            r->n_prompt / (r->t_prompt > 0 ? r->t_prompt : 1e-9), r->n_out, r->t_gen, r->n_out / (r->t_gen > 0 ? r->t_gen : 1e-9));
    if (r->read_prompt >= 0 && r->read_gen >= 0)
        fprintf(stderr, "moe-cli: read from storage: %.1f MB for the prompt, %.1f MB generating (%.1f MB/token)\n", r->read_prompt / 1e6,
                r->read_gen / 1e6, r->n_out ? r->read_gen / 1e6 / r->n_out : 0.0);
    fprintf(stderr, "moe-cli: experts: %llu loads, %.1f MB (%.2f MB/token generated)\n", (unsigned long long)tot->expert_loads,
            tot->expert_bytes / 1e6, r->n_out ? tot->expert_bytes / 1e6 / r->n_out : 0.0);
    if (r->o.opt.expert_mode != MOE_EXPERTS_CACHE) return;
    const uint64_t lk = tot->cache_hits + tot->cache_misses;
    fprintf(stderr, "moe-cli: expert cache: %llu hits, %llu misses (hit rate %.1f%%), %.1f MB read in %.3f s (%.0f MB/s)\n",
            (unsigned long long)tot->cache_hits, (unsigned long long)tot->cache_misses, lk ? 100.0 * tot->cache_hits / lk : 0.0,
            tot->bytes_read / 1e6, tot->io_seconds, tot->io_seconds > 0 ? tot->bytes_read / 1e6 / tot->io_seconds : 0.0);
    const moe_model_info mi = moe_model_get_info(r->m);
    if (mi.streamed_layers)
        fprintf(stderr, "moe-cli: %d layers stream their dense matrices (%.1f MB a step): %llu layer reads\n", mi.streamed_layers,
                mi.streamed_bytes / 1e6, (unsigned long long)tot->dense_reads);
    if (r->o.opt.prefetch && tot->prefetch_routed)
        fprintf(stderr, "moe-cli: prefetch: %llu reads queued, recall %.1f%% of routed experts\n", (unsigned long long)tot->prefetch_issued,
                100.0 * tot->prefetch_predicted / tot->prefetch_routed);
}

/* the turns: one for a prompt, or a chat read from stdin */
static int run(cli *r) {
    if (open_model(r)) return 1;
    int was_interrupted = 0;
    for (;;) {
        const char *text;
        size_t len, nid;
        int ctx, turn = next_turn(r, &text, &len);
        if (!turn) break;
        if (turn == 2) continue;
        if (moe_utf8_valid_prefix(text, len) != len) {
            fprintf(stderr, "moe-cli: the prompt is not valid UTF-8\n");
            if (r->o.chat) continue;
            return 1;
        }
        ctrl_c_stops_reply(1);
        if (prompt_ids(r, text, len, &nid) || feed_prompt(r, text, len, nid, &ctx) || generate(r, ctx)) return 1;
        was_interrupted = interrupted;
        ctrl_c_stops_reply(0);
        if (!r->o.chat) break;
        /* the reply joins the conversation; the session holds the generated tokens, which the
         * next render normally reproduces, so only the new user turn is computed */
        const char *reasoning = r->o.format == MOE_CHAT_K3 && r->o.think ? r->think_buf : NULL;
        if (!append_msg(&r->conv, &r->conv_n, &r->conv_cap, &r->n_msgs, "assistant", r->q.reply ? r->q.reply : "", r->q.rn, reasoning, r->think_n))
            return oom();
    }
    print_summary(r);
    if (ferror(stdout)) return fprintf(stderr, "moe-cli: write error on stdout\n"), 1;
    return was_interrupted && !r->o.chat ? 130 : 0; /* 128 + SIGINT, as a shell reports it */
}

int main(int argc, char **argv) {
    static cli r; /* zeroed */
    int stop, rc = parse_args(argc, argv, &r.o, &stop);
    if (stop) return rc;
    r.plen = r.o.prompt ? strlen(r.o.prompt) : 0;
    const char *why = NULL;
    r.text = r.o.prompt || r.o.chat ? NULL : slurp(r.o.file, &r.plen, &why);
    if (!r.o.prompt && !r.o.chat && !r.text) {
        fprintf(stderr, "moe-cli: cannot read %s: %s\n", r.o.file, why);
        return 1;
    }
    if (r.o.prompt) r.text = strdup(r.o.prompt);
    r.q.stop = r.o.stops, r.q.n_stop = r.o.n_stops;
    rc = run(&r);
    free(r.text), free(r.line), free(r.think_buf), free(r.conv), free(r.q.buf), free(r.q.reply), free(r.hist), free(r.ids), free(r.logits);
    pc_close(&r.pc);
    moe_session_free(r.s);
    moe_tokenizer_free(r.tok);
    moe_model_close(r.m);
    return rc;
}
