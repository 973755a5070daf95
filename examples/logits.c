/* moe-logits: token ids in, float32 logits out. The interface tests and comparisons use:
 *
 *   moe-logits -m MODEL_DIR_OR_FILE --tokens IDS_FILE [--out LOGITS_FILE] [--all] [--greedy N]
 *              [-t THREADS] [--scalar] [--kernels NAME]
 *
 * Reads whitespace-separated token ids, runs one prefill over them and writes little-endian
 * float32 logits (rows x vocab): every position with --all, else the last one. With --greedy N
 * it then decodes N tokens greedily with the caches and prints their ids, space-separated, as the
 * last line of stdout. Exit 0 on success, 1 on any error, 2 on usage errors. */
#include "../moe.h"
#include "cache_flags.h"
#include "files.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int usage(const char *msg) {
    if (msg) fprintf(stderr, "moe-logits: %s\n", msg);
    fprintf(stderr,
            "usage: moe-logits -m MODEL --tokens IDS_FILE [--out LOGITS_FILE] [--all] [--greedy N]\n"
            "                  [-t THREADS] [--scalar] [--kernels NAME] [--load-mode mmap|cache] [--expert-budget SIZE] [--dense-budget SIZE] [--io-threads N] [--prefetch on|off]\n"
            "  -m MODEL        checkpoint directory, .safetensors file (config.json beside it) or .gguf\n"
            "  --tokens FILE   whitespace-separated token ids\n"
            "  --out FILE      write float32 little-endian logits, rows x vocab\n"
            "  --all           logits for every prompt position (default: the last one)\n"
            "  --greedy N      then decode N tokens greedily; ids printed on the last stdout line\n"
            "  -t THREADS      worker threads (default 1)\n"
            "  --scalar        use the scalar reference kernels\n"
            "  --kernels NAME  a kernel set this CPU runs by name (avx2, avxvnni, ...) instead of its best\n"
            "  --load-mode M   mmap (default) or cache: routed experts read into a cache of\n"
            "  --expert-budget SIZE bytes (e.g. 512M); --io-threads N reading threads (default 4);\n"
            "  --prefetch on|off (cache mode, default on)\n"
            "  --kv-type f32|bf16|q8  MLA latent cache element (default f32)\n"
            "  --mxfp4 f32|int8  MXFP4 matrices times f32 input (default) or int8-quantized input\n"
            "  --act 8|16        integer formats' input in 8 bits (default) or two 8-bit parts (moe-cli --help)\n");
    return 2;
}

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


int main(int argc, char **argv) {
    const char *model = NULL, *tokens = NULL, *outp = NULL;
    int all = 0, greedy = 0;
    moe_options opt = moe_default_options();
    for (int i = 1; i < argc; i++) {
        const char *why = NULL;
        int ck;
        const char *a = argv[i];
        int more = i + 1 < argc;
        if (!strcmp(a, "-m") && more) model = argv[++i];
        else if (!strcmp(a, "--tokens") && more) tokens = argv[++i];
        else if (!strcmp(a, "--out") && more) outp = argv[++i];
        else if (!strcmp(a, "--all")) all = 1;
        else if (!strcmp(a, "--greedy") && more) {
            char *end;
            long v = strtol(argv[++i], &end, 10);
            if (*end || v < 0 || v > 1000000) return usage("--greedy needs a count >= 0");
            greedy = (int)v;
        } else if (!strcmp(a, "-t") && more) {
            char *end;
            long v = strtol(argv[++i], &end, 10);
            if (*end || v < 1 || v > 1024) return usage("-t needs a thread count >= 1");
            opt.n_threads = (int)v;
        } else if (!strcmp(a, "--scalar")) opt.flags |= MOE_FLAG_FORCE_SCALAR;
        else if ((ck = cache_flag(argc, argv, &i, &opt, &why)) != 0) {
            if (ck < 0) return usage(why);
        } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(NULL); return 0; }
        else return usage("unknown or incomplete argument");
    }
    if (!model || !tokens) return usage("-m and --tokens are required");

    int32_t *ids = NULL;
    const char *why;
    int n = read_ids(tokens, &ids, &why);
    if (n < 0) {
        fprintf(stderr, "moe-logits: %s: %s\n", tokens, why);
        return 1;
    }
    if (n == 0) {
        fprintf(stderr, "moe-logits: %s: no token ids\n", tokens);
        return 1;
    }
    char err[512];
    moe_model *m = NULL;
    moe_session *s = NULL;
    float *logits = NULL;
    FILE *f = NULL;
    int rc = 1;
    moe_status st = moe_model_open(&m, model, &opt, err, sizeof err);
    if (st) {
        fprintf(stderr, "moe-logits: %s: %s\n", moe_status_str(st), err);
        goto out;
    }
    const int V = moe_model_config(m)->vocab_size;
    if ((st = moe_session_new(&s, m, n + greedy + 1, err, sizeof err))) {
        fprintf(stderr, "moe-logits: %s: %s\n", moe_status_str(st), err);
        goto out;
    }
    logits = malloc(sizeof(float) * (size_t)V * (size_t)(all ? n : 1));
    if (!logits) {
        fprintf(stderr, "moe-logits: out of memory\n");
        goto out;
    }
    moe_seq q = {.s = s, .tokens = ids, .n = n, .logits = logits, .logits_all = all};
    if ((st = moe_step(m, &q, 1, NULL, err, sizeof err))) {
        fprintf(stderr, "moe-logits: %s: %s\n", moe_status_str(st), err);
        goto out;
    }
    if (outp) {
        /* write to a temporary name and rename: a failed run never leaves a partial file */
        char tmp[4200];
        snprintf(tmp, sizeof tmp, "%s.tmp", outp);
        f = fopen(tmp, "wb");
        int ok = f && write_floats(f, logits, (size_t)V * (size_t)(all ? n : 1));
        if (f && fclose(f)) ok = 0;
        f = NULL;
        if (!ok || rename(tmp, outp)) {
            fprintf(stderr, "moe-logits: cannot write %s: %s\n", outp, strerror(errno));
            remove(tmp);
            goto out;
        }
    }
    if (greedy) {
        const float *last = logits + (all ? (size_t)(n - 1) * V : 0);
        int32_t tok = moe_sample(last, V, NULL, NULL);
        for (int j = 0; j < greedy; j++) {
            printf(j ? " %d" : "%d", (int)tok);
            if (j + 1 == greedy) break;
            moe_seq d = {.s = s, .tokens = &tok, .n = 1, .logits = logits};
            if ((st = moe_step(m, &d, 1, NULL, err, sizeof err))) {
                printf("\n");
                fprintf(stderr, "moe-logits: %s: %s\n", moe_status_str(st), err);
                goto out;
            }
            tok = moe_sample(logits, V, NULL, NULL);
        }
        printf("\n");
    }
    rc = 0;
out:
    free(logits);
    free(ids);
    moe_session_free(s);
    moe_model_close(m);
    return rc;
}
