/* moe-tokenize: text in, token ids out (the interface the tokenizer checks use).
 *
 *   moe-tokenize --ranks FILE --pre kimi|o200k|cl100k [--config tokenizer_config.json]
 *                [--special] [--raw-bytes] [FILE]
 *   moe-tokenize -m MODEL [--special] [--raw-bytes] [FILE]
 *   moe-tokenize ... --decode [FILE]
 *
 * Encodes the whole file (or stdin) and prints the ids space-separated on one line. --decode
 * reads whitespace-separated ids instead and writes their bytes to stdout. Exit 0 on success,
 * 1 on any error, 2 on usage errors. */
#include "../moe.h"
#include "files.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int usage(const char *msg) {
    if (msg) fprintf(stderr, "moe-tokenize: %s\n", msg);
    fprintf(stderr,
            "usage: moe-tokenize --ranks FILE --pre kimi|o200k|cl100k [options] [FILE]\n"
            "       moe-tokenize -m MODEL [options] [FILE]\n"
            "  --ranks FILE    tiktoken rank file (base64 bytes and rank per line; tiktoken.model)\n"
            "  --pre NAME      pre-tokenizer: kimi (Kimi K2/Linear/K3), o200k (o200k_base), cl100k (cl100k_base)\n"
            "  --config FILE   kimi: tokenizer_config.json naming the special tokens\n"
            "  --n-special N   kimi: special ids after the ranks (default 256 for K3, 258 for K2/Kimi-Linear)\n"
            "  -m MODEL        use the tokenizer a model ships (tiktoken.model beside config.json, or a GGUF's)\n"
            "  --special       special-token names in the text become their ids (default: plain text)\n"
            "  --raw-bytes     accept invalid UTF-8 (each stray byte is a symbol); default: an error\n"
            "  --decode        read ids, write their bytes\n"
            "  FILE            input (default: stdin)\n");
    return 2;
}


int main(int argc, char **argv) {
    const char *ranks = NULL, *pre = NULL, *config = NULL, *model = NULL, *in = NULL;
    int special = 0, raw = 0, decode = 0, n_special = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int more = i + 1 < argc;
        if (!strcmp(a, "--ranks") && more) ranks = argv[++i];
        else if (!strcmp(a, "--pre") && more) pre = argv[++i];
        else if (!strcmp(a, "--config") && more) config = argv[++i];
        else if (!strcmp(a, "--n-special") && more) n_special = atoi(argv[++i]);
        else if (!strcmp(a, "-m") && more) model = argv[++i];
        else if (!strcmp(a, "--special")) special = 1;
        else if (!strcmp(a, "--raw-bytes")) raw = 1;
        else if (!strcmp(a, "--decode")) decode = 1;
        else if (!strcmp(a, "-h") || !strcmp(a, "--help")) return usage(NULL);
        else if (a[0] == '-' && a[1]) return usage("unknown option or missing value");
        else if (!in) in = a;
        else return usage("more than one input file");
    }
    if (!!ranks == !!model) return usage("give either --ranks FILE --pre NAME or -m MODEL");
    int pretok = -1;
    if (ranks) {
        if (!pre) return usage("--ranks needs --pre");
        pretok = !strcmp(pre, "kimi") ? MOE_PRETOK_KIMI : !strcmp(pre, "o200k") ? MOE_PRETOK_O200K
               : !strcmp(pre, "cl100k") ? MOE_PRETOK_CL100K : -1;
        if (pretok < 0) return usage("--pre must be kimi, o200k or cl100k");
    }
    char err[512];
    moe_tokenizer *tok = NULL;
    moe_model *m = NULL;
    moe_status st;
    if (ranks) {
        st = moe_tokenizer_load(&tok, ranks, pretok, config, n_special, err, sizeof err);
    } else {
        moe_options o = moe_default_options();
        st = moe_model_open(&m, model, &o, err, sizeof err);
        if (!st) st = moe_tokenizer_for_model(&tok, m, err, sizeof err);
    }
    if (st) {
        fprintf(stderr, "moe-tokenize: %s\n", err);
        moe_model_close(m);
        return 1;
    }
    size_t len = 0;
    errno = 0;
    char *text = slurp(in ? in : "-", &len);
    if (!text) {
        fprintf(stderr, "moe-tokenize: %s: %s\n", in ? in : "stdin", errno ? strerror(errno) : "read error");
        moe_tokenizer_free(tok);
        moe_model_close(m);
        return 1;
    }
    int rc = 0;
    if (decode) {
        char *p = text, *end;
        for (;;) {
            while (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r') p++;
            if (!*p) break;
            long id = strtol(p, &end, 10);
            size_t k;
            const char *b = end != p && id >= 0 && id <= INT32_MAX ? moe_token_bytes(tok, (int32_t)id, &k) : NULL;
            if (!b) {
                fprintf(stderr, "moe-tokenize: bad token id near \"%.20s\"\n", p);
                rc = 1;
                break;
            }
            fwrite(b, 1, k, stdout);
            p = end;
        }
    } else {
        int32_t *ids = malloc((len + 1) * sizeof *ids);
        size_t n = 0;
        st = ids ? moe_tokenize(tok, text, len, (special ? MOE_TOK_SPECIAL : 0) | (raw ? MOE_TOK_RAW_BYTES : 0), ids, len + 1, &n, err,
                                sizeof err)
                 : MOE_ERR_NOMEM;
        if (st) {
            fprintf(stderr, "moe-tokenize: %s\n", ids ? err : "out of memory");
            rc = 1;
        } else {
            for (size_t i = 0; i < n; i++) printf(i ? " %d" : "%d", (int)ids[i]);
            printf("\n");
        }
        free(ids);
    }
    if (fflush(stdout) || ferror(stdout)) {
        fprintf(stderr, "moe-tokenize: write error\n");
        rc = 1;
    }
    free(text);
    moe_tokenizer_free(tok);
    moe_model_close(m);
    return rc;
}
