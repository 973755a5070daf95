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
#include "args.h"
#include "cache_flags.h"
#include "files.h"
#include "openai.h"
#include "prefix_cache.h"

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

static arg_help help = {
    "usage: moe-batch -m MODEL -i IN.jsonl -o OUT.jsonl [options]\n"
    "  -m MODEL         checkpoint directory, .safetensors file or .gguf (with its tokenizer)\n"
    "  -i IN.jsonl      OpenAI Batch input: one request per line\n"
    "  -o OUT.jsonl     answers are appended here; rerun to finish an interrupted job\n"
    "  --shard I/N      answer only the requests whose custom_id falls in shard I of N (0 <= I < N)\n"
    "  -t THREADS       worker threads (default: the physical cores)\n"
    "  --parallel P     requests decoded at once in lockstep (default 8)\n"
    "  -c CTX           context per request: prompt + max_tokens must fit (default 4096)\n"
    "  --max-tokens N   for requests without max_tokens (default 256)\n"
    "  --model-name S   the \"model\" field of the answers (default: the model path's last part)\n"
    "  --prefix-cache DIR  take each prompt's longest prefix computed before (by moe-batch, moe-cli or\n"
    "                   moe-server given DIR) from DIR, and keep each prompt's state there\n"
    "  --prefix-cache-size SIZE  disk for DIR; least recently used files go first (default 20G)\n"
    "  --load-mode M, --expert-budget SIZE, --dense TYPE, --dense-budget SIZE, --io-threads N, --prefetch on|off,\n"
    "  --kv-type f32|bf16|q8, --mxfp4 f32|int8, --act 8|16,\n"
    "  --kernels NAME, --check-tensors  as in moe-cli\n", NULL};

static int usage(const char *msg) { return arg_usage("moe-batch", help, msg); }

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
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
/* 1 when j is a whole answer line as moe-batch writes them, with its request's key: a custom_id
 * and a response {"status_code", "body"} whose body holds "choices" (200) or an "error" (others),
 * or (a line without a custom_id string) its input_line and an error {"message"} */
static int answer_key(const moe__json *j, char *key, size_t kn) {
    if (j->type != MOE_JSON_OBJ) return 0;
    const moe__json *cid = moe__json_get(j, "custom_id"), *ln = moe__json_get(j, "input_line");
    const moe__json *resp = moe__json_get(j, "response"), *error = moe__json_get(j, "error");
    if (cid && cid->type == MOE_JSON_STR && *cid->str) {
        const moe__json *code = resp && resp->type == MOE_JSON_OBJ ? moe__json_get(resp, "status_code") : NULL;
        const moe__json *body = resp && resp->type == MOE_JSON_OBJ ? moe__json_get(resp, "body") : NULL;
        if (!code || code->type != MOE_JSON_NUM || !body || body->type != MOE_JSON_OBJ) return 0;
        const moe__json *part = moe__json_get(body, code->num == 200 ? "choices" : "error");
        if (!part || part->type != (code->num == 200 ? MOE_JSON_ARR : MOE_JSON_OBJ)) return 0;
        line_key(key, kn, cid->str, 0);
        return 1;
    }
    const moe__json *msg = error && error->type == MOE_JSON_OBJ ? moe__json_get(error, "message") : NULL;
    if (!ln || ln->type != MOE_JSON_NUM || !(ln->num >= 1 && ln->num <= 1e15) || ln->num != (double)(long)ln->num || !msg ||
        msg->type != MOE_JSON_STR)
        return 0;
    line_key(key, kn, NULL, (long)ln->num);
    return 1;
}

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
        char key[1100];
        if (moe__json_parse(text + i, len, &j, NULL, 0) == MOE_OK && answer_key(j, key, sizeof key)) {
            if (!ks_add(done, key)) { moe__json_free(j); free(text); return -1; }
        } else {
            fprintf(stderr, "moe-batch: %s:%ld: not a complete answer line; left as it is, and its request (if any) answered again\n", path,
                    lineno);
        }
        moe__json_free(j);
        i += len + 1;
    }
    free(text);
    return 0;
}

/* ---- requests ---- */

typedef struct {
    oai_request q;   /* the body */
    char *custom_id; /* NULL when the line has none */
    long lineno;
    int started;    /* choices given a slot so far */
    int done;       /* choices finished */
    int lead;       /* the slot of its first choice, while the others assigned with it wait for its prompt */
    long lead_pass; /* the assignment pass that gave the first choice its slot */
    int gen_total;  /* their sampled tokens */
    int failed;     /* a step gave one of its choices logits that are not finite: answered with an error */
    buf *choices;   /* each finished choice's JSON object, until the last one finishes */
} request;

static void request_free(request *r) {
    for (int i = 0; r->choices && i < r->q.n; i++) free(r->choices[i].s);
    free(r->choices);
    free(r->custom_id);
    oai_request_free(&r->q);
}

/* Turns one parsed line into a request; 0 with a message in why when it is not a valid one. */
static int parse_request(request *r, const moe__json *j, const moe_tokenizer *tok, int vocab_size, int ctx, int default_max, char *why,
                         size_t wn) {
    const moe__json *method = moe__json_get(j, "method"), *url = moe__json_get(j, "url"), *body = moe__json_get(j, "body");
    if (method && (method->type != MOE_JSON_STR || strcmp(method->str, "POST"))) return snprintf(why, wn, "method must be POST"), 0;
    if (!url || url->type != MOE_JSON_STR) return snprintf(why, wn, "url is missing"), 0;
    const int chat = !strcmp(url->str, "/v1/chat/completions");
    if (!chat && strcmp(url->str, "/v1/completions")) return snprintf(why, wn, "url must be /v1/chat/completions or /v1/completions"), 0;
    if (!oai_parse_body(&r->q, body, chat, tok, vocab_size, ctx, default_max, fnv(r->custom_id, strlen(r->custom_id)) | 1, why, wn)) return 0;
    if (!(r->choices = calloc((size_t)r->q.n, sizeof *r->choices))) return snprintf(why, wn, "out of memory"), 0;
    return 1;
}

/* ---- decoding slots ---- */

typedef struct {
    request *r;
    oai_choice c;       /* the choice it decodes */
    /* -1: computes r's prompt itself (its first choice); >= 0: the slot computing it in this step,
     * whose state and logits this one takes after the step; -2: takes them from the copy kept
     * for r's later choices */
    int leader;
    moe_session *s;
    int fed;            /* prompt tokens already in the session */
    const float *lrow;  /* the logits it samples from: its row of the step's, or another's */
    float *own;         /* with --prefix-cache: [vocab] the logits of a prompt found there whole */
    int cached;         /* its prompt and logits came from the prefix cache: nothing to compute */
    int prefilling;     /* its prompt is computed in this step */
} slot;

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

/* the answer line of request r, every choice finished (the prompt counted once, as OpenAI does) */
static void answer_line(buf *b, const request *r) {
    char rid[32];
    snprintf(rid, sizeof rid, "%016llx", (unsigned long long)fnv(r->custom_id, strlen(r->custom_id)));
    bprintf(b, "{\"id\": \"batch_req_%s\", \"custom_id\": ", rid);
    bjson_str(b, r->custom_id, strlen(r->custom_id));
    bprintf(b, ", \"response\": {\"status_code\": 200, \"request_id\": \"req_%s\", \"body\": {\"id\": \"%s-%s\", \"object\": \"%s\", "
               "\"created\": %ld, \"model\": ", rid, r->q.chat ? "chatcmpl" : "cmpl", rid, r->q.chat ? "chat.completion" : "text_completion", g_created);
    bjson_str(b, model_name, strlen(model_name));
    bprintf(b, ", \"choices\": [");
    for (int i = 0; i < r->q.n; i++) {
        if (i) bprintf(b, ", ");
        bput(b, r->choices[i].s, r->choices[i].n);
    }
    bprintf(b, "], \"usage\": {\"prompt_tokens\": %d, \"completion_tokens\": %d, \"total_tokens\": %d}}}, \"error\": null}\n", r->q.n_prompt,
            r->gen_total, r->q.n_prompt + r->gen_total);
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

/* ---- the job ---- */

typedef struct {
    const char *model, *in_path, *out_path, *prefix_dir;
    size_t prefix_size;
    int shard_i, shard_n, parallel, ctx, default_max;
    moe_options opt;
} options;

/* Parses the command line into o; 0, or usage()'s exit status (2, or 0 for --help) with *done set. */
static int parse_args(int argc, char **argv, options *o, int *done) {
    *o = (options){.shard_n = 1, .prefix_size = (size_t)20 << 30, .parallel = 8, .ctx = 4096, .default_max = 256, .opt = moe_default_options()};
    *done = 1;
    o->opt.flags |= MOE_FLAG_PLAN; /* what the command line does not set, the resource plan does */
    for (int i = 1; i < argc; i++) {
        const char *why = NULL;
        int ck;
        const char *a = argv[i];
        int more = i + 1 < argc;
        double v;
        if (!strcmp(a, "-m") && more) o->model = argv[++i];
        else if (!strcmp(a, "-i") && more) o->in_path = argv[++i];
        else if (!strcmp(a, "-o") && more) o->out_path = argv[++i];
        else if (!strcmp(a, "--shard") && more) { if (!parse_shard(argv[++i], &o->shard_i, &o->shard_n)) return usage("--shard is I/N with 0 <= I < N"); }
        else if (!strcmp(a, "-t") && more) {
            if (arg_num("moe-batch", help, a, argv[++i], 1, 1024, 1, &v)) return 2;
            o->opt.n_threads = (int)v, o->opt.set |= MOE_SET_THREADS;
        } else if (!strcmp(a, "--parallel") && more) {
            if (arg_num("moe-batch", help, a, argv[++i], 1, 1024, 1, &v)) return 2;
            o->parallel = (int)v;
        } else if (!strcmp(a, "-c") && more) {
            if (arg_num("moe-batch", help, a, argv[++i], 2, 1e8, 1, &v)) return 2;
            o->ctx = (int)v;
        } else if (!strcmp(a, "--max-tokens") && more) {
            if (arg_num("moe-batch", help, a, argv[++i], 1, 1e9, 1, &v)) return 2;
            o->default_max = (int)v;
        }
        else if (!strcmp(a, "--model-name") && more) model_name = argv[++i];
        else if ((ck = pc_flag(argc, argv, &i, &o->prefix_dir, &o->prefix_size, &why)) != 0) {
            if (ck < 0) return usage(why);
        } else if ((ck = cache_flag(argc, argv, &i, &o->opt, &why)) != 0) {
            if (ck < 0) return usage(why);
        } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) return usage(NULL);
        else return arg_unknown("moe-batch", help, a, more ? argv[i + 1] : NULL);
    }
    if (!o->model || !o->in_path || !o->out_path) return usage("-m, -i and -o are required");
    *done = 0;
    return 0;
}

/* Everything one run holds. Functions below return 0, or 1 after printing what went wrong. */
typedef struct {
    options o;
    moe_model *m;
    const moe_config *c;
    moe_tokenizer *tok; /* NULL: the model has none (token-id prompts only) */
    char *input;        /* the input file, whole */
    keyset done, seen;  /* keys answered before; custom_ids in the input */
    request *reqs;      /* this shard's requests still to answer */
    size_t n_reqs, cap_reqs;
    long n_lines, n_before, n_errors, n_failed; /* n_failed: answered with an error after running */
    int lcp;             /* tokens of the prefix every prompt shares (0: none worth sharing) */
    moe_session *prefix; /* its state */
    slot *slots;         /* [parallel] */
    /* the state and last logits of the prompt of reqs[next] while it still has choices to start
     * (only that request can), for the choices that get slots in later passes */
    moe_session *kept;
    float *kept_logits;
    float *logits; /* [parallel, vocab]: the step's rows */
    moe_seq *seqs;
    buf line;
    size_t next, finished; /* reqs[next] is the next to get a slot; requests answered */
    uint64_t tokens, prompt_tokens;
    moe_step_stats stats;
    double t_start;  /* when the slots began: the prefix all prompts share, then decoding */
    prefix_cache pc; /* with --prefix-cache */
    uint64_t cached_tokens;
    char err[512];
} job;

static int oom(void) { return fprintf(stderr, "moe-batch: out of memory\n"), 1; }

/* the library's message for a failed call */
static int failed(const job *jb) { return fprintf(stderr, "moe-batch: %s\n", jb->err), 1; }

/* the input, read whole and checked before anything is written */
static int read_input(job *jb) {
    const char *why;
    FILE *f = open_input(jb->o.in_path, &why);
    if (!f) return fprintf(stderr, "moe-batch: %s: %s\n", jb->o.in_path, why), 1;
    buf inb = {0};
    char chunk[1 << 16];
    size_t r;
    while ((r = fread(chunk, 1, sizeof chunk, f)) > 0) bput(&inb, chunk, r);
    int bad_read = ferror(f) || inb.oom;
    fclose(f);
    jb->input = inb.s;
    if (bad_read) return fprintf(stderr, "moe-batch: %s: read error\n", jb->o.in_path), 1;
    return 0;
}

/* The output opened for appending and locked for this run: a regular file (made if missing) that
 * is not the input, which no other moe-batch holds. */
static int open_output(job *jb) {
    const char *out = jb->o.out_path;
    out_fd = open(out, O_RDWR | O_CREAT | O_APPEND | O_NONBLOCK | O_CLOEXEC, 0644);
    if (out_fd < 0) return fprintf(stderr, "moe-batch: %s: %s\n", out, strerror(errno)), 1;
    struct stat so, si;
    if (fstat(out_fd, &so) || fcntl(out_fd, F_SETFL, fcntl(out_fd, F_GETFL) & ~O_NONBLOCK))
        return fprintf(stderr, "moe-batch: %s: %s\n", out, strerror(errno)), 1;
    if (!S_ISREG(so.st_mode)) return fprintf(stderr, "moe-batch: %s: the output must be a regular file\n", out), 1;
    if (!stat(jb->o.in_path, &si) && si.st_dev == so.st_dev && si.st_ino == so.st_ino)
        return fprintf(stderr, "moe-batch: %s is the input file %s (the same file); answers go to a file of their own\n", out,
                       jb->o.in_path), 1;
    /* a POSIX write lock on the whole file, held until exit (also over NFS, unlike flock) */
    struct flock lk = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 0};
    if (fcntl(out_fd, F_SETLK, &lk)) {
        if (errno == EACCES || errno == EAGAIN)
            return fprintf(stderr, "moe-batch: %s: another moe-batch is writing this output (it holds the file's lock); wait for it "
                           "to end, or give another -o\n", out), 1;
        fprintf(stderr, "moe-batch: %s: cannot lock the output (%s); make sure no other moe-batch writes it\n", out, strerror(errno));
    }
    return 0;
}

/* the output opened, the answers already in it collected; then the model */
static int open_output_and_model(job *jb) {
    if (open_output(jb)) return 1;
    if (load_answers(jb->o.out_path, &jb->done)) return fprintf(stderr, "moe-batch: %s: %s\n", jb->o.out_path, strerror(errno)), 1;
    moe_status st = moe_model_open(&jb->m, jb->o.model, &jb->o.opt, jb->err, sizeof jb->err);
    if (st) return fprintf(stderr, "moe-batch: %s: %s\n", moe_status_str(st), jb->err), 1;
    use_plan("moe-batch", jb->m, &jb->o.opt);
    if (moe_tokenizer_for_model(&jb->tok, jb->m, jb->err, sizeof jb->err)) {
        fprintf(stderr, "moe-batch: %s: only completion requests with token-id prompts can be answered\n", jb->err);
        jb->tok = NULL;
    }
    jb->c = moe_model_config(jb->m);
    return 0;
}

/* Parses one input line (0 with j set), or says in why why it is not a request: not UTF-8, not
 * JSON, or more JSON values than a request can need: a line is parsed only when it holds at most
 * the context's worth of token ids and 65,536 more values (oai_count_json_values), so the memory
 * one line takes is bounded by the line and ctx. */
static int parse_line(const char *text, size_t len, int ctx, moe__json **j, char *why, size_t wn) {
    *j = NULL;
    if (moe_utf8_valid_prefix(text, len) != len) return snprintf(why, wn, "the line is not valid UTF-8"), 1;
    const size_t values = oai_count_json_values(text, len);
    if (values > (size_t)ctx + 65536)
        return snprintf(why, wn, "the line holds %zu JSON values: more than any request that fits the context of %d tokens", values, ctx), 1;
    return moe__json_parse(text, len, j, why, wn) != MOE_OK;
}

/* pass 1: duplicate custom_ids anywhere in the input are refused before any work */
static int check_unique_ids(job *jb) {
    long lineno = 0;
    for (char *p = jb->input; p && *p;) {
        char *e = strchr(p, '\n');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        lineno++;
        moe__json *j = NULL;
        int rc = 0;
        char why[600];
        if (len && !parse_line(p, len, jb->o.ctx, &j, why, sizeof why) && j->type == MOE_JSON_OBJ) {
            const moe__json *cid = moe__json_get(j, "custom_id");
            if (cid && cid->type == MOE_JSON_STR && ks_has(&jb->seen, cid->str)) {
                fprintf(stderr, "moe-batch: %s:%ld: custom_id \"%.200s\" appears twice; every request needs its own custom_id\n", jb->o.in_path,
                        lineno, cid->str);
                rc = 1;
            } else if (cid && cid->type == MOE_JSON_STR && !ks_add(&jb->seen, cid->str)) {
                rc = oom();
            }
        }
        moe__json_free(j);
        if (rc) return rc;
        p = e ? e + 1 : p + len;
    }
    return 0;
}

/* Input line lineno of this shard, not answered before, parsed into j (NULL if it is not JSON;
 * custom_id NULL if it has none, why saying what is wrong): a request added to jb->reqs, or an
 * error line written for it now. */
static int take_request(job *jb, const char *custom_id, moe__json *j, long lineno, char *why, size_t wn) {
    const moe_config *c = jb->c;
    request rq = {0};
    rq.lineno = lineno;
    int ok = custom_id != NULL;
    if (ok) {
        rq.custom_id = strdup(custom_id);
        ok = rq.custom_id && parse_request(&rq, j, jb->tok, c->vocab_size, jb->o.ctx, jb->o.default_max, why, wn);
    }
    if (!ok) {
        buf *line = &jb->line;
        line->n = 0;
        if (custom_id) error_line(line, rq.custom_id ? rq.custom_id : custom_id, lineno, 400, "invalid_request_error", why);
        else error_line(line, NULL, lineno, 0, "invalid_line", why);
        request_free(&rq);
        if (line->oom || append_line(line)) return fprintf(stderr, "moe-batch: %s: %s\n", jb->o.out_path, line->oom ? "out of memory" : strerror(errno)), 1;
        jb->n_errors++;
        return 0;
    }
    if (jb->n_reqs == jb->cap_reqs) {
        size_t nc = jb->cap_reqs ? 2 * jb->cap_reqs : 64;
        request *nr = realloc(jb->reqs, nc * sizeof *nr);
        if (!nr) return request_free(&rq), oom();
        jb->reqs = nr, jb->cap_reqs = nc;
    }
    jb->reqs[jb->n_reqs++] = rq;
    return 0;
}

/* pass 2: this shard's requests not yet answered; bad ones are answered with an error now */
static int collect_requests(job *jb) {
    long lineno = 0;
    for (char *p = jb->input; p && *p;) {
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
        if (!parse_line(text, len, jb->o.ctx, &j, why, sizeof why)) {
            const moe__json *cid = j->type == MOE_JSON_OBJ ? moe__json_get(j, "custom_id") : NULL;
            if (cid && cid->type == MOE_JSON_STR && *cid->str) custom_id = cid->str;
            else snprintf(why, sizeof why, "the line has no custom_id string");
        }
        line_key(key, sizeof key, custom_id, lineno);
        const int mine = (int)(fnv(key, strlen(key)) % (uint64_t)jb->o.shard_n) == jb->o.shard_i;
        jb->n_lines += mine;
        jb->n_before += mine && ks_has(&jb->done, key);
        int rc = mine && !ks_has(&jb->done, key) ? take_request(jb, custom_id, j, lineno, why, sizeof why) : 0;
        moe__json_free(j);
        if (rc) return rc;
    }
    fprintf(stderr, "moe-batch: shard %d/%d: %ld requests: %ld answered before, %ld refused now, %zu to run, %d at a time\n", jb->o.shard_i,
            jb->o.shard_n, jb->n_lines, jb->n_before, jb->n_errors, jb->n_reqs, jb->o.parallel);
    return 0;
}

/* the buffers and sessions of the decoding slots; a prefix every prompt shares (a common system
 * prompt) computed once */
static int start_slots(job *jb) {
    const int P = jb->o.parallel;
    jb->t_start = now();
    if (jb->n_reqs >= 2) {
        int lcp = jb->reqs[0].q.n_prompt - 1;
        for (size_t i = 1; i < jb->n_reqs && lcp > 0; i++) {
            int k = 0;
            const int lim = jb->reqs[i].q.n_prompt - 1 < lcp ? jb->reqs[i].q.n_prompt - 1 : lcp;
            while (k < lim && jb->reqs[i].q.prompt[k] == jb->reqs[0].q.prompt[k]) k++;
            lcp = k;
        }
        jb->lcp = lcp < 8 ? 0 : lcp;
    }
    jb->prompt_tokens = (uint64_t)jb->lcp;
    if (!(jb->logits = malloc(sizeof(float) * (size_t)jb->c->vocab_size * (size_t)P)) || !(jb->seqs = calloc((size_t)P, sizeof *jb->seqs)) ||
        !(jb->slots = calloc((size_t)P, sizeof *jb->slots)))
        return oom();
    if (jb->lcp) {
        if (moe_session_new(&jb->prefix, jb->m, jb->o.ctx, jb->err, sizeof jb->err)) return failed(jb);
        moe_seq q = {.s = jb->prefix, .tokens = jb->reqs[0].q.prompt, .n = jb->lcp};
        if (moe_step(jb->m, &q, 1, &jb->stats, jb->err, sizeof jb->err)) return failed(jb);
        fprintf(stderr, "moe-batch: the %d-token prefix all prompts share is computed once\n", jb->lcp);
    }
    for (int i = 0; i < P; i++) {
        if (moe_session_new(&jb->slots[i].s, jb->m, jb->o.ctx, jb->err, sizeof jb->err)) return failed(jb);
        if (jb->o.prefix_dir && !(jb->slots[i].own = malloc(sizeof(float) * (size_t)jb->c->vocab_size))) return oom();
    }
    if (jb->o.prefix_dir && pc_open(&jb->pc, "moe-batch", jb->m, jb->o.ctx, 0, jb->o.prefix_dir, jb->o.prefix_size, jb->err, sizeof jb->err))
        return fprintf(stderr, "moe-batch: --prefix-cache %s\n", jb->err), 1;
    return 0;
}

/* Gives slot sl the next choice of reqs[next] (assignment pass `pass`). */
static int start_choice(job *jb, int i, long pass) {
    slot *sl = &jb->slots[i];
    request *rq = &jb->reqs[jb->next];
    /* a request's prompt is computed once, by its first choice: the choices that get slots in
     * the same pass take its state after the step, later ones a copy of it */
    if (!rq->started) rq->lead = i, rq->lead_pass = pass;
    sl->leader = !rq->started ? -1 : rq->lead_pass == pass ? rq->lead : -2;
    if (!oai_choice_begin(&sl->c, &rq->q, rq->started++, jb->tok)) return oom();
    if (rq->started == rq->q.n) jb->next++;
    sl->r = rq;
    sl->fed = 0;
    moe_session_reset(sl->s);
    sl->cached = 0;
    const int have = jb->pc.dir && sl->leader == -1 ? pc_lookup(&jb->pc, rq->q.prompt, rq->q.n_prompt, sl->s, sl->own) : 0;
    if (have > jb->lcp) { /* from the prefix cache */
        sl->fed = have, jb->cached_tokens += (uint64_t)have;
        if (have == rq->q.n_prompt) sl->cached = 1, sl->lrow = sl->own;
    } else if (jb->lcp) {
        if (moe_session_restore(sl->s, jb->prefix, jb->err, sizeof jb->err)) return failed(jb);
        sl->fed = jb->lcp;
    }
    return 0;
}

/* One batched step over the slots that compute (prompts, or the last token of each); then the
 * slots waiting for another's prompt take its state and logits. *active: slots in use. */
static int step_slots(job *jb, int *active) {
    const size_t V = (size_t)jb->c->vocab_size;
    int ns = 0;
    *active = 0;
    for (int i = 0; i < jb->o.parallel; i++) {
        slot *sl = &jb->slots[i];
        *active += sl->r != NULL;
        if (!sl->r || sl->leader != -1 || sl->cached) continue;
        const oai_request *q = &sl->r->q;
        moe_seq *sq = &jb->seqs[ns];
        memset(sq, 0, sizeof *sq);
        sq->s = sl->s;
        sq->logits = jb->logits + (size_t)ns++ * V;
        sl->lrow = sq->logits;
        sl->prefilling = sl->fed < q->n_prompt;
        if (sl->prefilling) sq->tokens = q->prompt + sl->fed, sq->n = q->n_prompt - sl->fed, jb->prompt_tokens += (uint64_t)sq->n;
        else sq->tokens = &sl->c.pick, sq->n = 1;
    }
    if (!*active) return 0;
    const moe_status st = ns ? moe_step(jb->m, jb->seqs, ns, &jb->stats, jb->err, sizeof jb->err) : MOE_OK;
    if (st == MOE_ERR_NUMERIC) { /* only those requests fail; the others' logits are good */
        for (int k = 0; k < ns; k++)
            for (int i = 0; jb->seqs[k].nonfinite && i < jb->o.parallel; i++)
                if (jb->slots[i].r && jb->slots[i].s == jb->seqs[k].s) jb->slots[i].r->failed = 1;
    } else if (st) {
        return fprintf(stderr, "moe-batch: %s (the requests in flight get no answer; rerun to finish)\n", jb->err), 1;
    }
    for (int i = 0; jb->pc.dir && i < jb->o.parallel; i++) { /* each prompt computed now kept for later runs */
        slot *sl = &jb->slots[i];
        if (sl->r && sl->prefilling && !sl->r->failed) pc_insert(&jb->pc, sl->r->q.prompt, sl->r->q.n_prompt, sl->s, sl->lrow);
        sl->prefilling = 0;
    }
    for (int i = 0; i < jb->o.parallel; i++) { /* the waiting choices take their first choice's prompt and logits */
        slot *sl = &jb->slots[i];
        if (!sl->r || sl->leader == -1) continue;
        const moe_session *from = sl->leader >= 0 ? jb->slots[sl->leader].s : jb->kept;
        if (moe_session_restore(sl->s, from, jb->err, sizeof jb->err)) return failed(jb);
        sl->lrow = sl->leader >= 0 ? jb->slots[sl->leader].lrow : jb->kept_logits, sl->leader = -1;
    }
    return 0;
}

/* the sequences' tokens sampled side by side (each choice has its own generator, so the picks do
 * not depend on the threads) */
static void sample_slots(job *jb, int active) {
    const int V = jb->c->vocab_size, nt = jb->o.opt.n_threads;
    (void)active, (void)nt;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (active > 1 && nt > 1)
#endif
    for (int i = 0; i < jb->o.parallel; i++) {
        slot *sl = &jb->slots[i];
        if (sl->r && !sl->r->failed) oai_choice_sample(&sl->c, sl->lrow, V);
    }
}

/* slot sl's choice is finished: its JSON kept; the request's answer line written once its last
 * choice is */
static int finish_choice(job *jb, slot *sl) {
    request *rq = sl->r;
    char *calls = oai_tool_calls(&sl->c, jb->tok);
    buf *ch = &rq->choices[sl->c.index];
    oai_choice_json(ch, &sl->c, calls, jb->tok);
    free(calls);
    if (ch->oom) return oom();
    rq->done++, rq->gen_total += sl->c.gen;
    sl->r = NULL;
    if (rq->done < rq->q.n) return 0; /* the line waits for the request's last choice */
    buf *line = &jb->line;
    line->n = 0;
    answer_line(line, rq);
    if (line->oom || append_line(line)) return fprintf(stderr, "moe-batch: %s: %s\n", jb->o.out_path, line->oom ? "out of memory" : strerror(errno)), 1;
    for (int k = 0; k < rq->q.n; k++) free(rq->choices[k].s), rq->choices[k] = (buf){0};
    jb->finished++;
    return 0;
}

/* slot sl's request failed (its logits were not finite): the slot freed, the choices not started
 * given up, and once no choice of it runs, an error line written for it */
static int fail_choice(job *jb, slot *sl) {
    request *rq = sl->r;
    sl->r = NULL;
    rq->done++;
    if (rq->started < rq->q.n) { /* only reqs[next] has choices waiting for a slot */
        rq->done += rq->q.n - rq->started, rq->started = rq->q.n;
        jb->next++;
    }
    if (rq->done < rq->q.n) return 0;
    buf *line = &jb->line;
    line->n = 0;
    error_line(line, rq->custom_id, rq->lineno, 500, "server_error",
               "the model's logits held a NaN or an infinity (a non-finite weight or activation); no answer was generated");
    if (line->oom || append_line(line)) return fprintf(stderr, "moe-batch: %s: %s\n", jb->o.out_path, line->oom ? "out of memory" : strerror(errno)), 1;
    fprintf(stderr, "\nmoe-batch: %s: non-finite logits; answered with an error\n", rq->custom_id);
    jb->n_failed++;
    jb->finished++;
    return 0;
}

/* each slot's pick appended to its text; finished choices written */
static int advance_slots(job *jb) {
    for (int i = 0; i < jb->o.parallel; i++) {
        slot *sl = &jb->slots[i];
        if (!sl->r) continue;
        if (sl->r->failed) {
            if (fail_choice(jb, sl)) return 1;
            continue;
        }
        sl->fed = sl->r->q.n_prompt, sl->cached = 0;
        jb->tokens++;
        if (!oai_choice_take(&sl->c, jb->m, jb->tok, jb->c->eos_token_id)) return oom();
        if (sl->c.finish && finish_choice(jb, sl)) return 1;
    }
    return 0;
}

/* Lockstep decoding; requests join as slots free up. */
static int decode(job *jb) {
    const size_t V = (size_t)jb->c->vocab_size;
    const double t0 = jb->t_start; /* the shared prefix's computing counts too */
    double last_report = t0;
    for (long pass = 0;; pass++) {
        for (int i = 0; i < jb->o.parallel && jb->next < jb->n_reqs; i++)
            if (!jb->slots[i].r && start_choice(jb, i, pass)) return 1;
        /* a request left with choices to start keeps its first choice's state after this step */
        const request *nx = jb->next < jb->n_reqs ? &jb->reqs[jb->next] : NULL;
        const int keep = nx && nx->started && nx->lead_pass == pass ? nx->lead : -1;
        if (keep >= 0 && !jb->kept) {
            if (moe_session_new(&jb->kept, jb->m, jb->o.ctx, jb->err, sizeof jb->err)) return failed(jb);
            if (!(jb->kept_logits = malloc(sizeof(float) * V))) return oom();
        }
        int active;
        if (step_slots(jb, &active)) return 1;
        if (!active) break;
        sample_slots(jb, active);
        if (advance_slots(jb)) return 1;
        if (keep >= 0) { /* its session still holds just the prompt (the pick goes in next step), its lrow the logits */
            if (moe_session_restore(jb->kept, jb->slots[keep].s, jb->err, sizeof jb->err)) return failed(jb);
            memcpy(jb->kept_logits, jb->slots[keep].lrow, sizeof(float) * V);
        }
        double tn = now();
        if (tn - last_report >= 1.0 || jb->finished == jb->n_reqs) {
            double rate = jb->tokens / (tn - t0 > 1e-9 ? tn - t0 : 1e-9), per_req = jb->finished ? (tn - t0) / jb->finished : 0;
            fprintf(stderr, "\rmoe-batch: %zu/%zu done, %.1f tok/s, ETA %.0f s   ", jb->finished, jb->n_reqs, rate,
                    jb->finished ? per_req * (double)(jb->n_reqs - jb->finished) : 0.0);
            last_report = tn;
        }
    }
    fprintf(stderr, "\nmoe-batch: %zu requests answered by the model, %ld failed, %ld refused, %llu prompt tokens computed, %llu tokens in %.2f s\n",
            jb->finished - (size_t)jb->n_failed, jb->n_failed, jb->n_errors, (unsigned long long)jb->prompt_tokens, (unsigned long long)jb->tokens, now() - t0);
    if (jb->pc.dir)
        fprintf(stderr, "moe-batch: prefix cache: %llu prompt tokens taken from %s\n", (unsigned long long)jb->cached_tokens, jb->o.prefix_dir);
    return 0;
}

/* closes the output (its error counts when the run had none) and frees everything */
static int job_end(job *jb, int rc) {
    if (out_fd >= 0 && close(out_fd) != 0 && !rc) {
        fprintf(stderr, "moe-batch: %s: %s\n", jb->o.out_path, strerror(errno));
        rc = 1;
    }
    for (int i = 0; jb->slots && i < jb->o.parallel; i++) {
        moe_session_free(jb->slots[i].s);
        oai_choice_free(&jb->slots[i].c);
        free(jb->slots[i].own);
    }
    for (size_t i = 0; i < jb->n_reqs; i++) request_free(&jb->reqs[i]);
    free(jb->reqs), free(jb->slots), free(jb->seqs), free(jb->logits), free(jb->line.s), free(jb->input);
    moe_session_free(jb->prefix);
    moe_session_free(jb->kept);
    free(jb->kept_logits);
    pc_close(&jb->pc);
    ks_free(&jb->done);
    ks_free(&jb->seen);
    moe_tokenizer_free(jb->tok);
    moe_model_close(jb->m);
    return rc;
}

int main(int argc, char **argv) {
    static job jb; /* zeroed */
    int stop, rc = parse_args(argc, argv, &jb.o, &stop);
    if (stop) return rc;
    if (!model_name) {
        const char *sl = strrchr(jb.o.model, '/');
        model_name = sl && sl[1] ? sl + 1 : jb.o.model;
    }
    g_created = (long)time(NULL);
    if (read_input(&jb)) return job_end(&jb, 1);
    rc = open_output_and_model(&jb) || check_unique_ids(&jb) || collect_requests(&jb) || start_slots(&jb) || decode(&jb);
    return job_end(&jb, rc);
}
