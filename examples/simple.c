/* simple.c - the smallest moe program: `simple MODEL [PROMPT]` prints the prompt and its greedy
 * continuation (at most 64 tokens). It uses moe.h alone:
 *     cc -O2 simple.c moe.c quant.c -lm -lpthread            (one thread)
 *     cc -O2 -fopenmp simple.c moe.c quant.c -lm -lpthread   (all cores) */
#include "moe.h" /* the repository's, or the installed one (pkg-config --cflags moe) */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
    if (argc < 2) return fprintf(stderr, "usage: simple MODEL [PROMPT]\n"), 2;
    const char *prompt = argc > 2 ? argv[2] : "Once upon a time";
    char err[512];
    moe_model *m = NULL;
    moe_tokenizer *t = NULL;
    moe_session *s = NULL;
    moe_options o = moe_default_options();
    o.flags |= MOE_FLAG_PLAN; /* memory, threads and streaming as the machine allows */
    if (moe_model_open(&m, argv[1], &o, err, sizeof err) || moe_tokenizer_for_model(&t, m, err, sizeof err) ||
        moe_session_new(&s, m, 4096, err, sizeof err))
        return fprintf(stderr, "simple: %s\n", err), 1;
    const int V = moe_model_config(m)->vocab_size;
    size_t n = 0, cap = strlen(prompt) + 1; /* a token is at least one byte */
    int32_t *ids = malloc(cap * sizeof *ids), next;
    float *logits = malloc((size_t)V * sizeof *logits);
    int rc = !ids || !logits || moe_tokenize(t, prompt, strlen(prompt), 0, ids, cap, &n, err, sizeof err);
    moe_seq q = {.s = s, .tokens = ids, .n = (int)n, .logits = logits};
    if (!rc) printf("%s", prompt);
    for (int i = 0; i < 64 && !rc; i++) {
        if ((rc = moe_step(m, &q, 1, NULL, err, sizeof err))) break;
        next = moe_sample(logits, V, NULL, NULL); /* greedy: the most likely token */
        if (moe_token_is_eog(m, t, next)) break;
        size_t len = 0;
        const char *bytes = moe_token_bytes(t, next, &len);
        fwrite(bytes, 1, bytes ? len : 0, stdout);
        fflush(stdout);
        q.tokens = &next, q.n = 1; /* the next step feeds the token just chosen */
    }
    printf("\n");
    if (rc) fprintf(stderr, "simple: %s\n", err[0] ? err : "out of memory");
    free(ids), free(logits);
    moe_session_free(s), moe_tokenizer_free(t), moe_model_close(m);
    return rc ? 1 : 0;
}
