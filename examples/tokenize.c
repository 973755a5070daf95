/* moe-tokenize: text in, token ids out (the interface the tokenizer checks use).
 *
 *   moe-tokenize --ranks FILE --pre kimi|o200k|cl100k [--config tokenizer_config.json]
 *                [--special] [--raw-bytes] [FILE]
 *   moe-tokenize -m MODEL|FILE.gguf [--special] [--raw-bytes] [FILE]
 *   moe-tokenize ... --decode [FILE]
 *
 * Encodes the whole file (or stdin) and prints the ids space-separated on one line. --decode
 * reads whitespace-separated ids instead and writes their bytes to stdout. Exit 0 on success,
 * 1 on any error, 2 on usage errors. */
#define _POSIX_C_SOURCE 200809L /* open, fstat, fcntl (files.h) */
#include "../moe.h"
#include "args.h"
#include "files.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static arg_help help = {
    "usage: moe-tokenize --ranks FILE --pre kimi|o200k|cl100k [options] [FILE]\n"
    "       moe-tokenize -m MODEL [options] [FILE]\n"
    "  --ranks FILE    tiktoken rank file (base64 bytes and rank per line; tiktoken.model)\n"
    "  --pre NAME      pre-tokenizer: kimi (Kimi K2/Linear/K3), o200k (o200k_base), cl100k (cl100k_base)\n"
    "  --config FILE   kimi: tokenizer_config.json naming the special tokens\n"
    "  --n-special N   kimi: special ids after the ranks (default 256 for K3, 258 for K2/Kimi-Linear)\n"
    "  -m MODEL        use the tokenizer a model ships (tiktoken.model beside config.json), or a GGUF's\n"
    "                  vocabulary (a model's, or a vocabulary-only file)\n"
    "  --special       special-token names in the text become their ids (default: plain text)\n"
    "  --raw-bytes     accept invalid UTF-8 (each stray byte is a symbol); default: an error\n"
    "  --decode        read ids, write their bytes\n"
    "  FILE            input (default: stdin)\n", NULL};

static int usage(const char *msg) { return arg_usage("moe-tokenize", help, msg); }


typedef struct {
    const char *ranks, *config, *model, *in;
    int special, raw, decode, n_special, pretok;
} options;

/* Parses the command line into o; 0, or usage()'s exit status with *done set. */
static int parse_args(int argc, char **argv, options *o, int *done) {
    *o = (options){.pretok = -1};
    const char *pre = NULL;
    *done = 1;
    for (int i = 1; i < argc; i++) {
        double v;
        const char *a = argv[i];
        int more = i + 1 < argc;
        if (!strcmp(a, "--ranks") && more) o->ranks = argv[++i];
        else if (!strcmp(a, "--pre") && more) pre = argv[++i];
        else if (!strcmp(a, "--config") && more) o->config = argv[++i];
        else if (!strcmp(a, "--n-special") && more) {
            if (arg_num("moe-tokenize", help, a, argv[++i], 0, 65536, 1, &v)) return 2;
            o->n_special = (int)v;
        }
        else if (!strcmp(a, "-m") && more) o->model = argv[++i];
        else if (!strcmp(a, "--special")) o->special = 1;
        else if (!strcmp(a, "--raw-bytes")) o->raw = 1;
        else if (!strcmp(a, "--decode")) o->decode = 1;
        else if (!strcmp(a, "-h") || !strcmp(a, "--help")) return usage(NULL);
        else if (a[0] == '-' && a[1]) return arg_unknown("moe-tokenize", help, a, more ? argv[i + 1] : NULL);
        else if (!o->in) o->in = a;
        else return usage("more than one input file");
    }
    if (!!o->ranks == !!o->model) return usage("give either --ranks FILE --pre NAME or -m MODEL");
    if (o->ranks) {
        if (!pre) return usage("--ranks needs --pre");
        o->pretok = !strcmp(pre, "kimi") ? MOE_PRETOK_KIMI : !strcmp(pre, "o200k") ? MOE_PRETOK_O200K
                  : !strcmp(pre, "cl100k") ? MOE_PRETOK_CL100K : -1;
        if (o->pretok < 0) return usage("--pre must be kimi, o200k or cl100k");
    }
    *done = 0;
    return 0;
}

/* whitespace-separated ids in text to their bytes on stdout */
static int decode_ids(const moe_tokenizer *tok, const char *text) {
    const char *p = text;
    char *end;
    for (;;) {
        while (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r') p++;
        if (!*p) return 0;
        long id = strtol(p, &end, 10);
        size_t k;
        const char *b = end != p && id >= 0 && id <= INT32_MAX ? moe_token_bytes(tok, (int32_t)id, &k) : NULL;
        if (!b) return fprintf(stderr, "moe-tokenize: bad token id near \"%.20s\"\n", p), 1;
        fwrite(b, 1, k, stdout);
        p = end;
    }
}

/* text's ids on one line of stdout */
static int encode_text(const moe_tokenizer *tok, const options *o, const char *text, size_t len) {
    char err[512];
    int32_t *ids = malloc((len + 1) * sizeof *ids);
    size_t n = 0;
    const unsigned flags = (o->special ? MOE_TOK_SPECIAL : 0) | (o->raw ? MOE_TOK_RAW_BYTES : 0);
    moe_status st = ids ? moe_tokenize(tok, text, len, flags, ids, len + 1, &n, err, sizeof err) : MOE_ERR_NOMEM;
    if (st) fprintf(stderr, "moe-tokenize: %s\n", ids ? err : "out of memory");
    for (size_t i = 0; !st && i < n; i++) printf(i ? " %d" : "%d", (int)ids[i]);
    if (!st) printf("\n");
    free(ids);
    return st != MOE_OK;
}

int main(int argc, char **argv) {
    options o;
    int stop, rc = parse_args(argc, argv, &o, &stop);
    if (stop) return rc;
    char err[512];
    moe_tokenizer *tok = NULL;
    moe_model *m = NULL;
    moe_status st;
    if (o.ranks) {
        st = moe_tokenizer_load(&tok, o.ranks, o.pretok, o.config, o.n_special, err, sizeof err);
    } else if (is_gguf_file(o.model)) { /* a model's or a vocabulary-only file: no weights needed */
        st = moe_tokenizer_from_gguf(&tok, o.model, err, sizeof err);
    } else {
        moe_options mo = moe_default_options();
        st = moe_model_open(&m, o.model, &mo, err, sizeof err);
        if (!st) st = moe_tokenizer_for_model(&tok, m, err, sizeof err);
    }
    size_t len = 0;
    char *text = NULL;
    if (st) fprintf(stderr, "moe-tokenize: %s\n", err);
    else {
        const char *why = NULL;
        if (!(text = slurp(o.in ? o.in : "-", &len, &why))) fprintf(stderr, "moe-tokenize: %s: %s\n", o.in ? o.in : "stdin", why);
    }
    rc = !text ? 1 : o.decode ? decode_ids(tok, text) : encode_text(tok, &o, text, len);
    if (text && (fflush(stdout) || ferror(stdout))) {
        fprintf(stderr, "moe-tokenize: write error\n");
        rc = 1;
    }
    free(text);
    moe_tokenizer_free(tok);
    moe_model_close(m);
    return rc;
}
