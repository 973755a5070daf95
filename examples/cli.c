/* moe-cli: generate from a prompt of token ids (the tokenizer is not in the runtime yet).
 *
 *   moe-cli -m MODEL (-p "IDS" | -f IDS_FILE) [-n N] [-t THREADS] [-c CTX] [--temp T]
 *           [--top-k K] [--top-p P] [--min-p P] [-s SEED] [--ignore-eos] [--batch N]
 *
 * Prints generated token ids as they are produced, one line, then timings and expert
 * statistics on stderr. Exit 0 on success, 1 on errors, 2 on usage errors. */
#define _POSIX_C_SOURCE 200809L
#include "../moe.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int usage(const char *msg) {
    if (msg) fprintf(stderr, "moe-cli: %s\n", msg);
    fprintf(stderr,
            "usage: moe-cli -m MODEL (-p \"IDS\" | -f IDS_FILE) [options]\n"
            "  -m MODEL        checkpoint directory, .safetensors file (config.json beside it) or .gguf\n"
            "  -p \"IDS\"        prompt as space-separated token ids\n"
            "  -f FILE         prompt token ids from a file ('-' = stdin)\n"
            "  -n N            tokens to generate (default 32)\n"
            "  -t THREADS      worker threads (default 1)\n"
            "  -c CTX          context size (default: prompt + n)\n"
            "  --temp T        temperature, 0 = greedy (default 0.8)\n"
            "  --top-k K       keep the K most likely tokens (default 40, 0 = off)\n"
            "  --top-p P       nucleus sampling (default 0.95, 1 = off)\n"
            "  --min-p P       drop tokens below P x the top probability (default 0.05)\n"
            "  -s SEED         sampling seed (default: time)\n"
            "  --batch N       rows per internal forward chunk (default 512)\n"
            "  --repeat-penalty P     divide/multiply the logits of recent tokens by P (default 1 = off)\n"
            "  --presence-penalty P   subtract P from recent tokens' logits (default 0)\n"
            "  --frequency-penalty P  subtract P per occurrence among recent tokens (default 0)\n"
            "  --repeat-last-n N      how many recent tokens the penalties look at (default 64)\n"
            "  --ignore-eos    keep generating after the end-of-sequence token\n"
            "  --load-mode M   routed experts through the file mapping (mmap, default) or read into a\n"
            "                  cache of --expert-budget bytes (cache)\n"
            "  --expert-budget SIZE  cache size, e.g. 512M or 8G (cache mode)\n"
            "  --prefetch on|off     cache mode: read the next layer's predicted experts ahead (on)\n");
    return 2;
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

static char *slurp(const char *path) {
    FILE *f = strcmp(path, "-") ? fopen(path, "r") : stdin;
    if (!f) return NULL;
    size_t n = 0, cap = 4096;
    char *b = malloc(cap);
    while (b) {
        if (n + 1 >= cap) {
            char *nb = realloc(b, cap *= 2);
            if (!nb) { free(b); b = NULL; break; }
            b = nb;
        }
        size_t r = fread(b + n, 1, cap - n - 1, f);
        if (!r) break;
        n += r;
    }
    if (b) b[n] = 0;
    if (f != stdin) fclose(f);
    return b;
}

static int num_arg(const char *s, double lo, double hi, double *out) {
    char *end;
    double v = strtod(s, &end);
    if (*end || !(v >= lo && v <= hi)) return 0;
    *out = v;
    return 1;
}

/* "8G", "512M", "65536": bytes */
static int parse_size(const char *s, size_t *out) {
    char *end;
    double v = strtod(s, &end);
    double mul = *end == 'K' || *end == 'k' ? 1024.0 : *end == 'M' || *end == 'm' ? 1048576.0 : *end == 'G' || *end == 'g' ? 1073741824.0
               : *end == 'T' || *end == 't' ? 1099511627776.0 : 1.0;
    if (mul != 1.0) end++;
    if (*end || !(v > 0) || v * mul > 1e18) return 0;
    *out = (size_t)(v * mul);
    return 1;
}

int main(int argc, char **argv) {
    const char *model = NULL, *prompt = NULL, *file = NULL;
    int n_gen = 32, n_ctx = 0, ignore_eos = 0;
    uint64_t seed = (uint64_t)time(NULL);
    moe_sampler sp = {.temperature = 0.8f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f, .repeat_penalty = 1.0f};
    int repeat_last_n = 64;
    moe_options opt = moe_default_options();
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        double v;
        int more = i + 1 < argc;
        if (!strcmp(a, "-m") && more) model = argv[++i];
        else if (!strcmp(a, "-p") && more) prompt = argv[++i];
        else if (!strcmp(a, "-f") && more) file = argv[++i];
        else if (!strcmp(a, "-n") && more && num_arg(argv[++i], 0, 1e8, &v)) n_gen = (int)v;
        else if (!strcmp(a, "-t") && more && num_arg(argv[++i], 1, 1024, &v)) opt.n_threads = (int)v;
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
        else if (!strcmp(a, "--ignore-eos")) ignore_eos = 1;
        else if (!strcmp(a, "--load-mode") && more) {
            const char *v = argv[++i];
            if (!strcmp(v, "mmap")) opt.expert_mode = MOE_EXPERTS_MMAP;
            else if (!strcmp(v, "cache")) opt.expert_mode = MOE_EXPERTS_CACHE;
            else return usage("--load-mode is mmap or cache");
        } else if (!strcmp(a, "--prefetch") && more) {
            const char *v = argv[++i];
            if (!strcmp(v, "on")) opt.prefetch = 1;
            else if (!strcmp(v, "off")) opt.prefetch = 0;
            else return usage("--prefetch is on or off");
        } else if (!strcmp(a, "--expert-budget") && more) {
            if (!parse_size(argv[++i], &opt.expert_budget)) return usage("--expert-budget needs a size such as 8G");
        }
        else if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(NULL); return 0; }
        else return usage("unknown, incomplete or out-of-range argument");
    }
    if (!model || (!prompt && !file)) return usage("-m and one of -p/-f are required");
    char *text = prompt ? NULL : slurp(file);
    if (!prompt && !text) {
        fprintf(stderr, "moe-cli: cannot read %s: %s\n", file, strerror(errno));
        return 1;
    }
    int32_t *ids = NULL;
    int n = parse_ids(prompt ? prompt : text, &ids);
    free(text);
    if (n <= 0) {
        fprintf(stderr, "moe-cli: the prompt must be a non-empty list of token ids\n");
        free(ids);
        return 1;
    }
    char err[512];
    moe_model *m = NULL;
    moe_session *s = NULL;
    float *logits = NULL;
    int32_t *hist = NULL;
    int rc = 1;
    double t0 = now();
    moe_status st = moe_model_open(&m, model, &opt, err, sizeof err);
    if (st) { fprintf(stderr, "moe-cli: %s: %s\n", moe_status_str(st), err); goto out; }
    const moe_config *c = moe_model_config(m);
    moe_model_info info = moe_model_get_info(m);
    fprintf(stderr, "moe-cli: %s: %d layers, %.3g B params (%.3g B active), %d files, load %.2f s\n",
            model, c->n_layers, info.n_params / 1e9, info.n_params_active / 1e9, info.n_files, now() - t0);
    if (!n_ctx) n_ctx = n + n_gen;
    if ((st = moe_session_new(&s, m, n_ctx, err, sizeof err))) { fprintf(stderr, "moe-cli: %s\n", err); goto out; }
    if (!(logits = malloc(sizeof(float) * (size_t)c->vocab_size))) { fprintf(stderr, "moe-cli: out of memory\n"); goto out; }
    moe_step_stats ps, ds, tot = {0};
    double tp = now();
    moe_seq q = {.s = s, .tokens = ids, .n = n, .logits = logits};
    if ((st = moe_step(m, &q, 1, &ps, err, sizeof err))) { fprintf(stderr, "moe-cli: %s\n", err); goto out; }
    tp = now() - tp;
    int gen = 0;
    double td = now();
    hist = malloc(sizeof(int32_t) * (size_t)(n + n_gen + 1)); /* prompt + generated, for penalties */
    if (!hist) { fprintf(stderr, "moe-cli: out of memory\n"); goto out; }
    memcpy(hist, ids, sizeof(int32_t) * (size_t)n);
    int nh = n;
    for (; gen < n_gen; gen++) {
        sp.recent = hist + (nh > repeat_last_n ? nh - repeat_last_n : 0);
        sp.n_recent = nh < repeat_last_n ? nh : repeat_last_n;
        int32_t tok = moe_sample(logits, c->vocab_size, &sp, &seed);
        hist[nh++] = tok;
        printf(gen ? " %d" : "%d", (int)tok);
        fflush(stdout);
        if (!ignore_eos && tok == c->eos_token_id) { gen++; break; }
        if (gen + 1 == n_gen) { gen++; break; }
        if (moe_session_pos(s) >= n_ctx) { fprintf(stderr, "\nmoe-cli: context full\n"); gen++; break; }
        moe_seq d = {.s = s, .tokens = &tok, .n = 1, .logits = logits};
        if ((st = moe_step(m, &d, 1, &ds, err, sizeof err))) { fprintf(stderr, "\nmoe-cli: %s\n", err); goto out; }
        tot.expert_rows += ds.expert_rows, tot.expert_loads += ds.expert_loads, tot.expert_bytes += ds.expert_bytes;
        tot.cache_hits += ds.cache_hits, tot.cache_misses += ds.cache_misses, tot.bytes_read += ds.bytes_read, tot.io_seconds += ds.io_seconds;
        tot.prefetch_issued += ds.prefetch_issued, tot.prefetch_predicted += ds.prefetch_predicted, tot.prefetch_routed += ds.prefetch_routed;
    }
    td = now() - td;
    printf("\n");
    fprintf(stderr, "moe-cli: prompt %d tokens in %.3f s (%.1f tok/s); generated %d tokens in %.3f s (%.2f tok/s)\n",
            n, tp, n / (tp > 0 ? tp : 1e-9), gen, td, gen / (td > 0 ? td : 1e-9));
    fprintf(stderr, "moe-cli: experts: prefill %llu loads, %.1f MB; decode %llu loads, %.1f MB (%.2f MB/token)\n",
            (unsigned long long)ps.expert_loads, ps.expert_bytes / 1e6, (unsigned long long)tot.expert_loads,
            tot.expert_bytes / 1e6, gen > 1 ? tot.expert_bytes / 1e6 / (gen - 1) : 0.0);
    if (opt.expert_mode == MOE_EXPERTS_CACHE) {
        const uint64_t lk = ps.cache_hits + ps.cache_misses + tot.cache_hits + tot.cache_misses;
        fprintf(stderr, "moe-cli: expert cache: %llu hits, %llu misses (hit rate %.1f%%), %.1f MB read in %.3f s (%.0f MB/s)\n",
                (unsigned long long)(ps.cache_hits + tot.cache_hits), (unsigned long long)(ps.cache_misses + tot.cache_misses),
                lk ? 100.0 * (ps.cache_hits + tot.cache_hits) / lk : 0.0, (ps.bytes_read + tot.bytes_read) / 1e6,
                ps.io_seconds + tot.io_seconds, (ps.io_seconds + tot.io_seconds) > 0 ? (ps.bytes_read + tot.bytes_read) / 1e6 / (ps.io_seconds + tot.io_seconds) : 0.0);
        const uint64_t routed = ps.prefetch_routed + tot.prefetch_routed;
        if (opt.prefetch && routed)
            fprintf(stderr, "moe-cli: prefetch: %llu reads queued, recall %.1f%% of routed experts\n",
                    (unsigned long long)(ps.prefetch_issued + tot.prefetch_issued), 100.0 * (ps.prefetch_predicted + tot.prefetch_predicted) / routed);
    }
    rc = 0;
out:
    free(hist);
    free(logits);
    free(ids);
    moe_session_free(s);
    moe_model_close(m);
    return rc;
}
