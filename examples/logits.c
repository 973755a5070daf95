/* moe-logits: token ids in, float32 logits out. The interface tests and comparisons use:
 *
 *   moe-logits -m MODEL_DIR_OR_FILE --tokens IDS_FILE [--out LOGITS_FILE] [--all] [--greedy N]
 *              [-t THREADS] [--scalar] [--kernels NAME]
 *
 * Reads whitespace-separated token ids, runs one prefill over them and writes little-endian
 * float32 logits (rows x vocab): every position with --all, else the last one. With --greedy N
 * it then decodes N tokens greedily with the caches and prints their ids, space-separated, as the
 * last line of stdout. Exit 0 on success, 1 on any error, 2 on usage errors. */
#define _POSIX_C_SOURCE 200809L /* open, fstat, fcntl (files.h) */
#include "../moe.h"
#include "args.h"
#include "cache_flags.h"
#include "files.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static arg_help help = {
    "usage: moe-logits -m MODEL --tokens IDS_FILE [--out LOGITS_FILE] [--all] [--greedy N]\n"
    "                  [-t THREADS] [--scalar] [--kernels NAME] [--load-mode mmap|cache] [--expert-budget SIZE] [--dense TYPE] [--dense-budget SIZE] [--io-threads N] [--prefetch on|off]\n"
    "  -m MODEL        checkpoint directory, .safetensors file (config.json beside it) or .gguf\n"
    "  --tokens FILE   whitespace-separated token ids\n"
    "  --out FILE      write float32 little-endian logits, rows x vocab\n"
    "  --all           logits for every prompt position (default: the last one)\n"
    "  --greedy N      then decode N tokens greedily; ids printed on the last stdout line\n"
    "  -t THREADS      worker threads (default: the physical cores)\n"
    "  --scalar        use the scalar reference kernels\n"
    "  --kernels NAME  a kernel set this CPU runs by name (avx2, avxvnni, ...) instead of its best\n"
    "  --load-mode M, --expert-budget SIZE, --dense TYPE, --dense-budget SIZE, --io-threads N,\n"
    "  --prefetch on|off, --check-tensors: as in moe-cli (by default the resource plan's choices)\n"
    "  --kv-type f32|bf16|q8  MLA latent cache element (default f32)\n"
    "  --mxfp4 f32|int8  MXFP4 matrices times f32 input (default) or int8-quantized input\n"
    "  --act 8|16        integer formats' input in 8 bits (default) or two 8-bit parts (moe-cli --help)\n", NULL};

static int usage(const char *msg) { return arg_usage("moe-logits", help, msg); }

static int write_floats(FILE *f, const float *x, size_t n) {
    const unsigned one = 1;
    if (*(const unsigned char *)&one) return fwrite(x, sizeof *x, n, f) == n;
    for (size_t i = 0; i < n; i++) { /* big-endian host: swap to little-endian */
        unsigned char b[4], r[4];
        memcpy(b, &x[i], 4);
        r[0] = b[3], r[1] = b[2], r[2] = b[1], r[3] = b[0];
        if (fwrite(r, 1, 4, f) != 4) return 0;
    }
    return 1;
}


typedef struct {
    const char *model, *tokens, *out;
    int all, greedy;
    moe_options opt;
} options;

/* Parses the command line into o; 0, or usage()'s exit status with *done set. */
static int parse_args(int argc, char **argv, options *o, int *done) {
    *o = (options){.opt = moe_default_options()};
    *done = 1;
    o->opt.flags |= MOE_FLAG_PLAN; /* what the command line does not set, the resource plan does */
    for (int i = 1; i < argc; i++) {
        const char *why = NULL;
        int ck;
        const char *a = argv[i];
        int more = i + 1 < argc;
        if (!strcmp(a, "-m") && more) o->model = argv[++i];
        else if (!strcmp(a, "--tokens") && more) o->tokens = argv[++i];
        else if (!strcmp(a, "--out") && more) o->out = argv[++i];
        else if (!strcmp(a, "--all")) o->all = 1;
        else if (!strcmp(a, "--greedy") && more) {
            char *end;
            long v = strtol(argv[++i], &end, 10);
            if (*end || v < 0 || v > 1000000) return usage("--greedy needs a count >= 0");
            o->greedy = (int)v;
        } else if (!strcmp(a, "-t") && more) {
            char *end;
            long v = strtol(argv[++i], &end, 10);
            if (*end || v < 1 || v > 1024) return usage("-t needs a thread count >= 1");
            o->opt.n_threads = (int)v, o->opt.set |= MOE_SET_THREADS;
        } else if (!strcmp(a, "--scalar")) o->opt.flags |= MOE_FLAG_FORCE_SCALAR;
        else if ((ck = cache_flag(argc, argv, &i, &o->opt, &why)) != 0) {
            if (ck < 0) return usage(why);
        } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) return usage(NULL);
        else return arg_unknown("moe-logits", help, a, more ? argv[i + 1] : NULL);
    }
    if (!o->model || !o->tokens) return usage("-m and --tokens are required");
    *done = 0;
    return 0;
}

/* the logits to a temporary name, then renamed: a failed run never leaves a partial file */
static int write_logits(const char *path, const float *logits, size_t n) {
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    int ok = f && write_floats(f, logits, n);
    if (f && fclose(f)) ok = 0;
    if (!ok || rename(tmp, path)) {
        fprintf(stderr, "moe-logits: cannot write %s: %s\n", path, strerror(errno));
        remove(tmp);
        return 1;
    }
    return 0;
}

/* greedy tokens after the prompt, their ids on one line of stdout */
static int decode_greedy(moe_model *m, moe_session *s, float *logits, const float *last, int V, int greedy) {
    char err[512];
    int32_t tok = moe_sample(last, V, NULL, NULL);
    for (int j = 0; j < greedy; j++) {
        printf(j ? " %d" : "%d", (int)tok);
        if (j + 1 == greedy) break;
        moe_seq d = {.s = s, .tokens = &tok, .n = 1, .logits = logits};
        moe_status st = moe_step(m, &d, 1, NULL, err, sizeof err);
        if (st) return printf("\n"), fprintf(stderr, "moe-logits: %s: %s\n", moe_status_str(st), err), 1;
        tok = moe_sample(logits, V, NULL, NULL);
    }
    printf("\n");
    return 0;
}

/* one prefill over the n ids, its logits written, then the greedy tokens */
static int run(const options *o, const int32_t *ids, int n) {
    char err[512];
    moe_model *m = NULL;
    moe_session *s = NULL;
    float *logits = NULL;
    int rc = 1;
    moe_status st = moe_model_open(&m, o->model, &o->opt, err, sizeof err);
    if (!st) use_plan("moe-logits", m, NULL);
    const int V = st ? 0 : moe_model_config(m)->vocab_size;
    const size_t rows = (size_t)(o->all ? n : 1);
    if (!st) st = moe_session_new(&s, m, n + o->greedy + 1, err, sizeof err);
    if (!st && !(logits = malloc(sizeof(float) * (size_t)V * rows))) st = MOE_ERR_NOMEM, snprintf(err, sizeof err, "no room for the logits");
    if (!st) {
        moe_seq q = {.s = s, .tokens = ids, .n = n, .logits = logits, .logits_all = o->all};
        st = moe_step(m, &q, 1, NULL, err, sizeof err);
    }
    if (st) fprintf(stderr, "moe-logits: %s: %s\n", moe_status_str(st), err);
    else if (!(o->out && write_logits(o->out, logits, (size_t)V * rows)))
        rc = o->greedy ? decode_greedy(m, s, logits, logits + (o->all ? (size_t)(n - 1) * V : 0), V, o->greedy) : 0;
    free(logits);
    moe_session_free(s);
    moe_model_close(m);
    return rc;
}

int main(int argc, char **argv) {
    options o;
    int stop, rc = parse_args(argc, argv, &o, &stop);
    if (stop) return rc;
    int32_t *ids = NULL;
    const char *why;
    int n = read_ids(o.tokens, &ids, &why);
    if (n <= 0) {
        fprintf(stderr, "moe-logits: %s: %s\n", o.tokens, n < 0 ? why : "no token ids");
        free(ids);
        return 1;
    }
    rc = run(&o, ids, n);
    free(ids);
    return rc;
}
