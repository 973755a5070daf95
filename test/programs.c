/* programs.c - tests of programs and batch: the example programs run as a user runs them: moe-logits, moe-tokenize, moe-cli,
 * moe-perplexity, moe-bench, moe-plan, moe-batch. */
#include "test.h"

static void test_moe_logits_cli(void) {
    const char *cases[] = {"kimi", "seed", "k3mx"};
    char cmd[2400], out[4096], idsf[600], logf[600];
    tmp_path(idsf, sizeof idsf, "ids.txt");
    tmp_path(logf, sizeof logf, "logits.bin");
    for (int ci = 0; ci < 3; ci++) {
        golden g;
        if (!golden_load(&g, cases[ci])) return;
        const moe__json *p = moe__json_get(g.cases, "prompts")->child->next->next; /* p2, 64 tokens */
        int32_t *ids, *greedy;
        int n = ids_of(moe__json_get(p, "ids"), &ids), ng = ids_of(moe__json_get(p, "greedy"), &greedy);
        FILE *f = fopen(idsf, "w");
        for (int i = 0; i < n; i++) fprintf(f, i % 10 == 9 ? "%d\n" : "%d ", (int)ids[i]);
        fclose(f);
        snprintf(cmd, sizeof cmd, "%s/moe-logits -m %s/%s --tokens %s --out %s --all --greedy %d", exe_dir,
                 golden_dir(), cases[ci], idsf, logf, ng);
        int rc = run_cmd(cmd, out, sizeof out);
        CHECKF(rc == 0, "%s: exit %d", cmd, rc);
        size_t len = 0;
        char *bin = read_all(logf, &len);
        const moe__st_tensor *want = moe__st_find(&g.ref, "p2.logits");
        CHECK(bin && want && len == want->nbytes);
        if (bin && want && len == want->nbytes) {
            double d = max_abs_diff((const float *)bin, want->data, len / 4);
            CHECKF(d <= g.tol, "%s: max |dlogit| %.3g", cases[ci], d);
        }
        free(bin);
        /* the greedy ids are the last line of stdout */
        char want_line[1024] = "";
        for (int i = 0; i < ng; i++) snprintf(want_line + strlen(want_line), sizeof want_line - strlen(want_line), i ? " %d" : "%d", (int)greedy[i]);
        char *last = out + strlen(out);
        while (last > out && last[-1] == '\n') *--last = 0;
        while (last > out && last[-1] != '\n') last--;
        CHECKF(!strcmp(last, want_line), "%s: greedy '%s' want '%s'", cases[ci], last, want_line);
        /* without --all: the last row only */
        snprintf(cmd, sizeof cmd, "%s/moe-logits -m %s/%s --tokens %s --out %s", exe_dir, golden_dir(), cases[ci], idsf, logf);
        CHECK(run_cmd(cmd, out, sizeof out) == 0);
        bin = read_all(logf, &len);
        const int V = (int)want->shape[1];
        CHECK(bin && len == (size_t)V * 4);
        if (bin && len == (size_t)V * 4)
            CHECK(max_abs_diff((const float *)bin, (const float *)want->data + (size_t)(n - 1) * V, (size_t)V) <= g.tol);
        free(bin), free(ids), free(greedy);
        golden_free(&g);
    }
    /* exit codes: 2 usage, 1 errors */
    snprintf(cmd, sizeof cmd, "%s/moe-logits 2>/dev/null", exe_dir);
    CHECK(run_cmd(cmd, out, sizeof out) == 2);
    snprintf(cmd, sizeof cmd, "%s/moe-logits -m x --tokens y --bogus 2>/dev/null", exe_dir);
    CHECK(run_cmd(cmd, out, sizeof out) == 2);
    snprintf(cmd, sizeof cmd, "%s/moe-logits -m /nonexistent --tokens %s 2>/dev/null", exe_dir, idsf);
    CHECK(run_cmd(cmd, out, sizeof out) == 1);
    /* --kernels (the ids file holds k3mx's prompt): a level this CPU has runs; another name is an
     * error naming the ones it has */
    snprintf(cmd, sizeof cmd, "%s/moe-logits -m %s/k3mx --tokens %s --kernels scalar 2>&1", exe_dir, golden_dir(), idsf);
    CHECK(run_cmd(cmd, out, sizeof out) == 0);
    snprintf(cmd, sizeof cmd, "%s/moe-logits -m %s/k3mx --tokens %s --kernels avx9000 2>&1", exe_dir, golden_dir(), idsf);
    CHECK(run_cmd(cmd, out, sizeof out) == 1 && strstr(out, "avx9000") && strstr(out, "this CPU runs scalar"));
    const char *bad_ids[] = {"1 2 x", "1 -2", "99999999", "", "1 2 3.5", "1 +2", "0x10"};
    for (int i = 0; i < 7; i++) {
        FILE *f = fopen(idsf, "w");
        fputs(bad_ids[i], f);
        fclose(f);
        remove(logf);
        snprintf(cmd, sizeof cmd, "%s/moe-logits -m %s/kimi --tokens %s --out %s 2>/dev/null", exe_dir, golden_dir(), idsf, logf);
        CHECKF(run_cmd(cmd, out, sizeof out) == 1, "ids '%s'", bad_ids[i]);
        struct stat sb;
        CHECK(stat(logf, &sb) != 0); /* nothing written on failure */
    }
}

/* moe-tokenize: the interface the checks use */
static void test_moe_tokenize_cli(void) {
    char cmd[2400], out[65536], in[600];
    tmp_path(in, sizeof in, "tok-in.txt");
    CHECK(write_all(in, "Hello, world!", 13));
    snprintf(cmd, sizeof cmd, "%s/moe-tokenize --ranks %s/cl100k_base.tiktoken --pre cl100k %s", exe_dir, tok_dir(), in);
    CHECK(run_cmd(cmd, out, sizeof out) == 0 && !strcmp(out, "9906 11 1917 0\n"));
    CHECK(write_all(in, "Hello, world!", 13)); /* stdin (redirected, so that MOE_TEST_RUNNER applies) */
    snprintf(cmd, sizeof cmd, "%s/moe-tokenize --ranks %s/o200k_base.tiktoken --pre o200k < %s", exe_dir, tok_dir(), in);
    CHECK(run_cmd(cmd, out, sizeof out) == 0 && !strcmp(out, "13225 11 2375 0\n"));
    CHECK(write_all(in, "13225 11 2375 0", 15));
    snprintf(cmd, sizeof cmd, "%s/moe-tokenize --ranks %s/o200k_base.tiktoken --pre o200k --decode %s", exe_dir, tok_dir(), in);
    CHECK(run_cmd(cmd, out, sizeof out) == 0 && !strcmp(out, "Hello, world!"));
    CHECK(write_all(in, "a\xff", 2));
    snprintf(cmd, sizeof cmd, "%s/moe-tokenize --ranks %s/o200k_base.tiktoken --pre o200k %s 2>&1", exe_dir, tok_dir(), in);
    CHECK(run_cmd(cmd, out, sizeof out) == 1 && strstr(out, "UTF-8"));
    snprintf(cmd, sizeof cmd, "%s/moe-tokenize --ranks %s/o200k_base.tiktoken --pre o200k --raw-bytes %s", exe_dir, tok_dir(), in);
    CHECK(run_cmd(cmd, out, sizeof out) == 0);
    snprintf(cmd, sizeof cmd, "%s/moe-tokenize --ranks x --pre nope 2>/dev/null", exe_dir);
    CHECK(run_cmd(cmd, out, sizeof out) == 2);
    snprintf(cmd, sizeof cmd, "%s/moe-tokenize -m %s/kimi 2>&1", exe_dir, golden_dir());
    CHECK(run_cmd(cmd, out, sizeof out) == 1 && strstr(out, "tiktoken.model"));
}

/* the parsed answer to custom_id id in the output file at path (NULL: none); free with moe__json_free */
static moe__json *batch_answer(const char *path, const char *id) {
    size_t len = 0;
    char *all = read_all(path, &len), key[80];
    moe__json *j = NULL;
    snprintf(key, sizeof key, "\"custom_id\": \"%s\"", id);
    char *p = all ? strstr(all, key) : NULL;
    if (p) {
        while (p > all && p[-1] != '\n') p--;
        char *e = strchr(p, '\n');
        if (e && moe__json_parse(p, (size_t)(e - p), &j, NULL, 0) != MOE_OK) j = NULL;
    }
    free(all);
    return j;
}

static const moe__json *json_at(const moe__json *a, int i) {
    const moe__json *e = a && (a->type == MOE_JSON_ARR || a->type == MOE_JSON_OBJ) ? a->child : NULL;
    while (e && i-- > 0) e = e->next;
    return e;
}

/* an answer's body, and its choice i */
static const moe__json *answer_body(const moe__json *a) { return moe__json_get(moe__json_get(a, "response"), "body"); }

static const moe__json *answer_choice(const moe__json *a, int i) { return json_at(moe__json_get(answer_body(a), "choices"), i); }

/* a batch input file: remove out, write text to in */
static void batch_files(const char *in, const char *out, const char *text) {
    remove(out);
    FILE *f = fopen(in, "w");
    if (f) fputs(text, f), fclose(f);
}

/* moe-batch's "n": each choice decodes as a sequence of its own (more choices than slots: they
 * wait for slots like requests) from one computation of the prompt, the answer written once all
 * are done, the prompt counted once; greedy choices are the golden continuation, sampled ones
 * differ from each other, and the first draws as a request without "n" does */
static void test_batch_choices(void) {
    char in[600], out[600], cmd[2400], buf[8192];
    tmp_path(in, sizeof in, "n-in.jsonl");
    tmp_path(out, sizeof out, "n-out.jsonl");
    batch_files(in, out, "{\"custom_id\": \"g\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [467, 83, 739, 806, 546, 1030, 1074], "
                         "\"max_tokens\": 4, \"temperature\": 0, \"n\": 3}}\n"
                         "{\"custom_id\": \"s\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [5, 6], \"max_tokens\": 5, \"seed\": 9, \"n\": 4, \"logprobs\": 1}}\n"
                         "{\"custom_id\": \"zero\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [5, 6], \"n\": 0}}\n"
                         "{\"custom_id\": \"half\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [5, 6], \"n\": 2.5}}\n");
    snprintf(cmd, sizeof cmd, "%s/moe-batch -m %s/k3mx -i %s -o %s --parallel 2 2>&1", exe_dir, golden_dir(), in, out);
    CHECKF(run_cmd(cmd, buf, sizeof buf) == 0, "%s: %s", cmd, buf);
    CHECK(check_batch_output(out, NULL, NULL, 0) == 4);
    /* each prompt computed once, though the choices got their slots in several passes (7 + 2) */
    CHECKF(strstr(buf, " 9 prompt tokens computed"), "%s", buf);
    moe__json *a = batch_answer(out, "g");
    const moe__json *body = answer_body(a), *ch = moe__json_get(body, "choices");
    CHECK(ch && ch->n == 3);
    for (int i = 0; ch && i < ch->n; i++) {
        const moe__json *c = json_at(ch, i);
        CHECK((int)moe__json_get(c, "index")->num == i && !strcmp(moe__json_get(c, "text")->str, "555 1114 583 989"));
    }
    const moe__json *usage = moe__json_get(body, "usage");
    CHECK(usage && moe__json_get(usage, "prompt_tokens")->num == 7 && moe__json_get(usage, "completion_tokens")->num == 12);
    moe__json_free(a);
    a = batch_answer(out, "s");
    ch = moe__json_get(answer_body(a), "choices");
    char first[128] = "";
    int distinct = 0;
    CHECK(ch && ch->n == 4);
    for (int i = 0; ch && i < ch->n; i++) {
        const moe__json *c = json_at(ch, i);
        CHECK(moe__json_get(moe__json_get(c, "logprobs"), "token_logprobs")->n == 5);
        if (!i) snprintf(first, sizeof first, "%s", moe__json_get(c, "text")->str);
        int seen = 0;
        for (int j = 0; j < i; j++) seen |= !strcmp(moe__json_get(json_at(ch, j), "text")->str, moe__json_get(c, "text")->str);
        distinct += !seen;
    }
    CHECKF(distinct == 4, "%d distinct texts of 4", distinct);
    moe__json_free(a);
    size_t len = 0;
    char *all = read_all(out, &len);
    CHECK(all && strstr(all, "n must be a number in [1, 128]") && strstr(all, "n must be an integer"));
    free(all);
    /* g alone with room for its three choices: its prompt computed once */
    batch_files(in, out, "{\"custom_id\": \"g\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [467, 83, 739, 806, 546, 1030, 1074], "
                         "\"max_tokens\": 4, \"temperature\": 0, \"n\": 3}}\n");
    snprintf(cmd, sizeof cmd, "%s/moe-batch -m %s/k3mx -i %s -o %s --parallel 4 2>&1", exe_dir, golden_dir(), in, out);
    CHECKF(run_cmd(cmd, buf, sizeof buf) == 0 && strstr(buf, " 7 prompt tokens computed"), "%s", buf);
    a = batch_answer(out, "g");
    ch = moe__json_get(answer_body(a), "choices");
    for (int i = 0; i < 3; i++) CHECK(ch && ch->n == 3 && !strcmp(moe__json_get(json_at(ch, i), "text")->str, "555 1114 583 989"));
    moe__json_free(a);
    /* the same request without n, alone: choice 0's text */
    batch_files(in, out, "{\"custom_id\": \"s\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [5, 6], \"max_tokens\": 5, \"seed\": 9}}\n");
    snprintf(cmd, sizeof cmd, "%s/moe-batch -m %s/k3mx -i %s -o %s 2>&1", exe_dir, golden_dir(), in, out);
    CHECKF(run_cmd(cmd, buf, sizeof buf) == 0, "%s: %s", cmd, buf);
    char text[128] = "";
    check_batch_output(out, "s", text, sizeof text);
    CHECKF(!strcmp(text, first), "alone %s, first choice %s", text, first);
    remove(in), remove(out);
}

/* moe-batch's log probabilities: a greedy completion on a golden prompt gives each token's log
 * probability under the golden logits (log-softmax of the expected rows, within twice the
 * logits' tolerance), its best alternatives in order with the pick first, and offsets into the
 * text; a chat answer on the shipped model lists every sampled token with its bytes; bad
 * requests are refused; two threads give the same tokens and log probabilities within rounding
 * (the decode attention's split over threads rounds differently) */
static void test_batch_logprobs(void) {
    char in[600], out[600], out2[600], cmd[2400], buf[8192];
    tmp_path(in, sizeof in, "lp-in.jsonl");
    tmp_path(out, sizeof out, "lp-out.jsonl");
    tmp_path(out2, sizeof out2, "lp-out2.jsonl");
    batch_files(in, out, "{\"custom_id\": \"g\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [467, 83, 739, 806, 546, 1030, 1074], "
                         "\"max_tokens\": 4, \"temperature\": 0, \"logprobs\": 3}}\n"
                         "{\"custom_id\": \"h\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [5, 6], \"max_tokens\": 5, \"seed\": 9, \"logprobs\": 0}}\n"
                         "{\"custom_id\": \"echo\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [1], \"echo\": true, \"logprobs\": 1}}\n"
                         "{\"custom_id\": \"big\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [1], \"logprobs\": 21}}\n"
                         "{\"custom_id\": \"half\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [1], \"logprobs\": 1.5}}\n");
    remove(out2);
    snprintf(cmd, sizeof cmd, "%s/moe-batch -m %s/k3mx -i %s -o %s --parallel 2 2>&1", exe_dir, golden_dir(), in, out);
    CHECKF(run_cmd(cmd, buf, sizeof buf) == 0, "%s: %s", cmd, buf);
    golden g;
    if (!golden_load(&g, "k3mx")) return;
    const moe__st_tensor *want = moe__st_find(&g.ref, "p1.greedy_logits");
    moe__json *a = batch_answer(out, "g");
    const moe__json *lp = moe__json_get(answer_choice(a, 0), "logprobs");
    const moe__json *toks = moe__json_get(lp, "tokens"), *tlp = moe__json_get(lp, "token_logprobs"), *top = moe__json_get(lp, "top_logprobs"),
                    *off = moe__json_get(lp, "text_offset");
    CHECK(want && toks && tlp && top && off && toks->n == 4 && tlp->n == 4 && top->n == 4 && off->n == 4);
    if (want && toks && tlp && top && off && toks->n == 4 && tlp->n == 4 && top->n == 4 && off->n == 4) {
        const int V = (int)want->shape[1], greedy[4] = {555, 1114, 583, 989}, offsets[4] = {0, 4, 9, 13};
        double worst = 0;
        for (int i = 0; i < 4; i++) {
            const float *row = (const float *)want->data + (size_t)i * V;
            double mx = -INFINITY, sum = 0;
            for (int v = 0; v < V; v++) mx = row[v] > mx ? row[v] : mx;
            for (int v = 0; v < V; v++) sum += exp(row[v] - mx);
            const double expect = row[greedy[i]] - mx - log(sum), d = fabs(json_at(tlp, i)->num - expect);
            worst = d > worst ? d : worst;
            CHECKF(atoi(json_at(toks, i)->str) == greedy[i], "token %d: %s", i, json_at(toks, i)->str);
            CHECKF((int)json_at(off, i)->num == offsets[i], "offset %d: %g", i, json_at(off, i)->num);
            const moe__json *alts = json_at(top, i);
            CHECK(alts && alts->n == 3);
            for (int j = 0; alts && j < alts->n; j++) { /* the pick first (greedy), then in order, each its golden log probability */
                const moe__json *e = json_at(alts, j);
                CHECK(j > 0 || (atoi(e->key) == greedy[i] && e->num == json_at(tlp, i)->num));
                CHECK(j == 0 || e->num <= json_at(alts, j - 1)->num);
                const double ej = row[atoi(e->key)] - mx - log(sum);
                CHECKF(fabs(e->num - ej) <= 2 * g.tol, "token %d alternative %d: %g against %g", i, j, e->num, ej);
            }
        }
        CHECKF(worst <= 2 * g.tol, "log probabilities %.3g from the golden logits'", worst);
    }
    moe__json_free(a);
    a = batch_answer(out, "h"); /* sampled, no alternatives */
    lp = moe__json_get(answer_choice(a, 0), "logprobs");
    CHECK(lp && moe__json_get(lp, "token_logprobs")->n == 5 && moe__json_get(lp, "top_logprobs")->type == MOE_JSON_NULL);
    for (int i = 0; lp && i < 5; i++) CHECK(json_at(moe__json_get(lp, "token_logprobs"), i)->num <= 0);
    moe__json_free(a);
    size_t len = 0;
    char *all = read_all(out, &len);
    CHECK(all && strstr(all, "echo is not supported") && strstr(all, "logprobs must be a number in [0, 20]") && strstr(all, "logprobs must be an integer"));
    free(all);
    snprintf(cmd, sizeof cmd, "%s/moe-batch -m %s/k3mx -i %s -o %s --parallel 2 -t 2 2>&1", exe_dir, golden_dir(), in, out2);
    CHECKF(run_cmd(cmd, buf, sizeof buf) == 0, "%s: %s", cmd, buf);
    for (int k = 0; k < 2; k++) {
        moe__json *x = batch_answer(out, k ? "h" : "g"), *y = batch_answer(out2, k ? "h" : "g");
        const moe__json *cx = answer_choice(x, 0);
        const moe__json *cy = answer_choice(y, 0);
        CHECK(cx && cy && !strcmp(moe__json_get(cx, "text")->str, moe__json_get(cy, "text")->str));
        const moe__json *lx = moe__json_get(answer_choice(x, 0), "logprobs");
        const moe__json *ly = moe__json_get(answer_choice(y, 0), "logprobs");
        for (int i = 0; lx && ly && i < moe__json_get(lx, "token_logprobs")->n; i++)
            CHECK(fabs(json_at(moe__json_get(lx, "token_logprobs"), i)->num - json_at(moe__json_get(ly, "token_logprobs"), i)->num) < 1e-4);
        CHECK(lx && ly);
        moe__json_free(x), moe__json_free(y);
    }
    golden_free(&g);
    /* chat on the shipped model: an entry per sampled token, its bytes, two alternatives each */
    batch_files(in, out, "{\"custom_id\": \"c\", \"method\": \"POST\", \"url\": \"/v1/chat/completions\", \"body\": {\"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}], "
                         "\"max_tokens\": 6, \"logprobs\": true, \"top_logprobs\": 2, \"seed\": 3}}\n"
                         "{\"custom_id\": \"t\", \"method\": \"POST\", \"url\": \"/v1/chat/completions\", \"body\": {\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], \"top_logprobs\": 2}}\n");
    snprintf(cmd, sizeof cmd, "%s/moe-batch -m %s -i %s -o %s 2>&1", exe_dir, shipped_dir(), in, out);
    CHECKF(run_cmd(cmd, buf, sizeof buf) == 0, "%s: %s", cmd, buf);
    a = batch_answer(out, "c");
    const moe__json *body = answer_body(a);
    const moe__json *content = moe__json_get(moe__json_get(json_at(moe__json_get(body, "choices"), 0), "logprobs"), "content");
    const int gen = (int)moe__json_get(moe__json_get(body, "usage"), "completion_tokens")->num;
    CHECKF(content && content->n == gen && gen > 0, "%d entries for %d tokens", content ? content->n : -1, gen);
    for (int i = 0; content && i < content->n; i++) {
        const moe__json *e = json_at(content, i), *bytes = moe__json_get(e, "bytes"), *alts = moe__json_get(e, "top_logprobs");
        CHECK(moe__json_get(e, "logprob")->num <= 0 && bytes && bytes->n > 0 && alts && alts->n == 2 &&
              json_at(alts, 0)->n == 3 && moe__json_get(json_at(alts, 0), "logprob")->num >= moe__json_get(json_at(alts, 1), "logprob")->num &&
              moe__json_get(e, "logprob")->num <= moe__json_get(json_at(alts, 0), "logprob")->num);
        /* the bytes spell the token where they are whole UTF-8 */
        char tb[64];
        int nb = 0;
        for (const moe__json *x = bytes ? bytes->child : NULL; x && nb < 63; x = x->next) tb[nb++] = (char)(int)x->num;
        tb[nb] = 0;
        if (moe_utf8_valid_prefix(tb, (size_t)nb) == (size_t)nb) CHECKF(!strcmp(tb, moe__json_get(e, "token")->str), "entry %d: %s", i, tb);
    }
    moe__json_free(a);
    all = read_all(out, &len);
    CHECK(all && strstr(all, "top_logprobs needs logprobs: true"));
    free(all);
    remove(in), remove(out), remove(out2);
}

#define AGAIN(id) "{\"custom_id\": \"" id "\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [467, 83, 739, 806, 546, 1030, 1074], \"max_tokens\": 4, \"temperature\": 0}}\n"

static void test_batch_basic(void) {
    char in[600], out[600], cmd[2400], buf[8192], text[512];
    tmp_path(in, sizeof in, "batch-in.jsonl");
    tmp_path(out, sizeof out, "batch-out.jsonl");
    write_batch_input(in, 12,
                      "not json\n"
                      "{\"custom_id\": \"bad-url\", \"method\": \"POST\", \"url\": \"/v1/embeddings\", \"body\": {}}\n"
                      "{\"custom_id\": \"bad-utf8\", \"body\": \"\xff\"}\n"
                      "{\"custom_id\": \"too-long\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [1, 2], \"max_tokens\": 100000}}\n"
                      "{\"custom_id\": \"bad-id\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [1, 99999]}}\n"
                      "{\"custom_id\": \"chat\", \"method\": \"POST\", \"url\": \"/v1/chat/completions\", \"body\": {\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}}\n"
                      "\n"
                      "{\"method\": \"POST\"}\n"
                      "{\"custom_id\": \"big-seed\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [1], \"seed\": 1.5e62}}\n"
                      AGAIN("again-1") AGAIN("again-2") AGAIN("again-3"));
    remove(out);
    snprintf(cmd, sizeof cmd, "%s/moe-batch -m %s/k3mx -i %s -o %s --parallel 4 2>&1", exe_dir, golden_dir(), in, out);
    int rc = run_cmd(cmd, buf, sizeof buf);
    CHECKF(rc == 0, "%s: %d %s", cmd, rc, buf);
    int n = check_batch_output(out, "req-0", text, sizeof text);
    CHECKF(n == 12 + 11, "%d lines", n);
    /* req-0 is greedy on a golden prompt: the golden continuation, decoded among other sequences,
     * and so are its copies, each in the slot it got (each slot samples its own row of logits) */
    CHECKF(!strcmp(text, "555 1114 583 989"), "req-0: %s", text);
    for (int i = 1; i <= 3; i++) {
        char id[24];
        snprintf(id, sizeof id, "again-%d", i);
        check_batch_output(out, id, text, sizeof text);
        CHECKF(!strcmp(text, "555 1114 583 989"), "%s: %s", id, text);
    }
    size_t len = 0;
    char *all = read_all(out, &len);
    CHECK(all && strstr(all, "\"input_line\": 13") && strstr(all, "/v1/embeddings") == NULL && strstr(all, "not valid UTF-8") &&
          strstr(all, "do not fit the context") && strstr(all, "outside the vocabulary") && strstr(all, "no tokenizer") &&
          strstr(all, "\"finish_reason\": \"length\"") && strstr(all, "\"usage\": {\"prompt_tokens\": 7") &&
          strstr(all, "seed must be a 64-bit integer"));
    free(all);
    /* two threads (sampling side by side): the same answers */
    char out2[600], cmd2[2400], t1[512], t2[512];
    tmp_path(out2, sizeof out2, "batch-out-t2.jsonl");
    remove(out2);
    snprintf(cmd2, sizeof cmd2, "%s/moe-batch -m %s/k3mx -i %s -o %s --parallel 4 -t 2 2>&1", exe_dir, golden_dir(), in, out2);
    CHECKF(run_cmd(cmd2, buf, sizeof buf) == 0, "%s: %s", cmd2, buf);
    for (int i = 0; i < 12; i++) {
        char id[16];
        snprintf(id, sizeof id, "req-%d", i);
        t1[0] = t2[0] = 0;
        check_batch_output(out, id, t1, sizeof t1), check_batch_output(out2, id, t2, sizeof t2);
        CHECKF(t1[0] && !strcmp(t1, t2), "%s: %s with one thread, %s with two", id, t1, t2);
    }
    remove(out2);
    /* a rerun has nothing to do; a torn tail is cut off and that request answered again */
    CHECK(run_cmd(cmd, buf, sizeof buf) == 0 && strstr(buf, "0 to run"));
    all = read_all(out, &len);
    FILE *f = fopen(out, "w");
    fwrite(all, 1, len - 40, f); /* the last line loses its end */
    fclose(f);
    free(all);
    CHECK(run_cmd(cmd, buf, sizeof buf) == 0 && strstr(buf, "torn"));
    CHECK(check_batch_output(out, NULL, NULL, 0) == 12 + 11);
    /* shards: disjoint, together everything */
    char o0[600], o1[600];
    tmp_path(o0, sizeof o0, "batch-s0.jsonl");
    tmp_path(o1, sizeof o1, "batch-s1.jsonl");
    remove(o0), remove(o1);
    for (int s = 0; s < 2; s++) {
        snprintf(cmd, sizeof cmd, "%s/moe-batch -m %s/k3mx -i %s -o %s --shard %d/2 2>&1", exe_dir, golden_dir(), in, s ? o1 : o0, s);
        CHECK(run_cmd(cmd, buf, sizeof buf) == 0);
    }
    int a = check_batch_output(o0, NULL, NULL, 0), b = check_batch_output(o1, NULL, NULL, 0);
    CHECKF(a > 0 && b > 0 && a + b == 12 + 11, "shards %d + %d", a, b);
    /* duplicate custom_ids: refused before anything is written */
    write_batch_input(in, 3, "{\"custom_id\": \"req-1\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [1]}}\n");
    remove(out);
    snprintf(cmd, sizeof cmd, "%s/moe-batch -m %s/k3mx -i %s -o %s 2>&1", exe_dir, golden_dir(), in, out);
    CHECK(run_cmd(cmd, buf, sizeof buf) == 1 && strstr(buf, "appears twice"));
    struct stat sb;
    CHECK(stat(out, &sb) != 0 || sb.st_size == 0);
    snprintf(cmd, sizeof cmd, "%s/moe-batch -m %s/k3mx -i /nonexistent -o %s 2>/dev/null", exe_dir, golden_dir(), out);
    CHECK(run_cmd(cmd, buf, sizeof buf) == 1);
    snprintf(cmd, sizeof cmd, "%s/moe-batch -m x -i y 2>/dev/null", exe_dir);
    CHECK(run_cmd(cmd, buf, sizeof buf) == 2);
    snprintf(cmd, sizeof cmd, "%s/moe-batch -m x -i y -o z --shard 2/2 2>/dev/null", exe_dir);
    CHECK(run_cmd(cmd, buf, sizeof buf) == 2);
}

/* moe-cli on text: the same seed gives the same text, output is valid UTF-8, stop strings end
 * it without being printed, chat mode runs a turn from stdin */
static void test_shipped_cli(void) {
    char cmd[2400], a[8192], b[8192];
    snprintf(cmd, sizeof cmd, "%s/moe-cli -m %s -p 'In the beginning' -n 40 -s 7 --temp 0.9 --top-k 40 2>/dev/null", exe_dir, shipped_dir());
    CHECK(run_cmd(cmd, a, sizeof a) == 0 && run_cmd(cmd, b, sizeof b) == 0);
    CHECKF(!strcmp(a, b) && !strncmp(a, "In the beginning", 16) && strlen(a) > 60, "'%s' vs '%s'", a, b);
    CHECK(moe_utf8_valid_prefix(a, strlen(a)) == strlen(a));
    snprintf(cmd, sizeof cmd, "%s/moe-cli -m %s -p 'In the beginning' -n 40 -s 8 --temp 0.9 2>/dev/null", exe_dir, shipped_dir());
    CHECK(run_cmd(cmd, b, sizeof b) == 0 && strcmp(a, b)); /* another seed, another text */
    snprintf(cmd, sizeof cmd, "%s/moe-cli -m %s -p 'And God said' -n 60 --temp 0 --no-display-prompt --stop ' the' 2>/dev/null", exe_dir, shipped_dir());
    CHECK(run_cmd(cmd, a, sizeof a) == 0 && !strstr(a, " the") && strlen(a) < 200);
    snprintf(cmd, sizeof cmd, "%s/moe-cli -m %s -p 'And God said' -n 60 --temp 0 --no-display-prompt 2>/dev/null", exe_dir, shipped_dir());
    CHECK(run_cmd(cmd, b, sizeof b) == 0 && strstr(b, " the") && !strncmp(a, b, strlen(a) - 1));
    char in[600];
    tmp_path(in, sizeof in, "cli-stdin.txt");
    CHECK(write_all(in, "Hello there\n", 12));
    snprintf(cmd, sizeof cmd, "%s/moe-cli -m %s -cnv -n 8 --temp 0 -sys 'Be brief.' < %s 2>&1", exe_dir, shipped_dir(), in);
    CHECK(run_cmd(cmd, a, sizeof a) == 0 && strstr(a, "generated"));
    CHECK(write_all(in, "x\377y", 3));
    snprintf(cmd, sizeof cmd, "%s/moe-cli -m %s -n 4 < %s 2>&1", exe_dir, shipped_dir(), in);
    CHECK(run_cmd(cmd, a, sizeof a) == 1 && strstr(a, "UTF-8"));
    snprintf(cmd, sizeof cmd, "%s/moe-cli --help", exe_dir);
    CHECK(run_cmd(cmd, a, sizeof a) == 0 && strstr(a, "--chat-template") && strstr(a, "--stop"));
    /* the resource plan's line, with the flags given kept in it */
    snprintf(cmd, sizeof cmd, "%s/moe-cli -m %s -p 'And God said' -n 4 --temp 0 2>&1 >/dev/null", exe_dir, shipped_dir());
    CHECKF(run_cmd(cmd, a, sizeof a) == 0 && strstr(a, "moe-cli: plan: ") && strstr(a, "used where they are mapped"), "%s", a);
    snprintf(cmd, sizeof cmd, "%s/moe-cli -m %s -p 'And God said' -n 4 --temp 0 -t 1 --dense q8_0 2>&1 >/dev/null", exe_dir, shipped_dir());
    CHECKF(run_cmd(cmd, a, sizeof a) == 0 && strstr(a, "dense Q8_0, 1 threads"), "%s", a);
    snprintf(cmd, sizeof cmd, "%s/moe-cli -m %s -p x --dense q5_0 2>&1", exe_dir, shipped_dir());
    CHECKF(run_cmd(cmd, a, sizeof a) == 2 && strstr(a, "--dense q5_0: must be"), "%s", a);
}

/* moe-perplexity on the shipped model against the same figures computed here through the
 * library: windows of 32 of the reference ids (-c 32: fresh sequences, the second halves
 * scored), Q8_0 at load against the model as stored, with the routing pinned too; the same
 * through a saved reference (--save-ref, --ref-logits); the whole stream as one window; text
 * through the model's tokenizer (-f); bad input and bad reference files refused */
static void test_shipped_perplexity(void) {
    char cmd[2400], out[4096], idsf[600], txt[600];
    size_t li = 0;
    int32_t *ids = (int32_t *)(void *)read_all("test/shipped/ref_ids.bin", &li);
    const int n = (int)(li / 4), W = 32;
    tmp_path(idsf, sizeof idsf, "ppl-ids.txt");
    FILE *fp = fopen(idsf, "w");
    for (int i = 0; ids && fp && i < n; i++) fprintf(fp, "%d ", (int)ids[i]);
    if (fp) fclose(fp);
    moe_options o = moe_default_options();
    o.n_threads = 2;
    moe_model *f = NULL, *q = NULL;
    CHECK(moe_model_open(&f, shipped_dir(), &o, NULL, 0) == MOE_OK);
    o.dense_type = MOE_WTYPE_Q8_0;
    CHECK(moe_model_open(&q, shipped_dir(), &o, NULL, 0) == MOE_OK);
    if (!ids || !f || !q || n != 2 * W) {
        CHECKF(0, "shipped model or ids (%d) missing", n);
        free(ids), moe_model_close(f), moe_model_close(q);
        return;
    }
    const moe_config *c = moe_model_config(f);
    const int V = c->vocab_size;
    double kl = 0, klf = 0, nll_r = 0, nll_t = 0;
    int agree = 0, scored = 0, predicted = 0;
    int32_t *routes = malloc(sizeof(int32_t) * (size_t)W * c->n_layers * c->n_active);
    for (int w = 0; w < n / W; w++) { /* each window's second half */
        const int32_t *wi = ids + w * W;
        float *xr = logits_routed(f, wi, W, NULL, routes, NULL), *xt = logits_routed(q, wi, W, NULL, NULL, NULL);
        float *xp = logits_routed(q, wi, W, NULL, NULL, routes);
        const size_t h = (size_t)(W / 2) * V;
        if (xr && xt && xp) kl += mean_kl(xr + h, xt + h, W / 2, V) * (W / 2), klf += mean_kl(xr + h, xp + h, W / 2, V) * (W / 2);
        for (int t = W / 2; xr && xt && xp && t < W; t++) {
            const float *a = xr + (size_t)t * V, *b = xt + (size_t)t * V;
            double ma = a[0], mb = b[0], za = 0, zb = 0;
            int ta = 0, tb = 0;
            for (int i = 1; i < V; i++) ma = fmax(ma, a[i]), mb = fmax(mb, b[i]), ta = a[i] > a[ta] ? i : ta, tb = b[i] > b[tb] ? i : tb;
            for (int i = 0; i < V; i++) za += exp(a[i] - ma), zb += exp(b[i] - mb);
            agree += ta == tb, scored++;
            if (t + 1 < W) nll_r -= a[wi[t + 1]] - ma - log(za), nll_t -= b[wi[t + 1]] - mb - log(zb), predicted++;
        }
        free(xr), free(xt), free(xp);
    }
    snprintf(cmd, sizeof cmd, "%s/moe-perplexity -m %s --tokens %s --dense q8_0 -c %d --ref-routing --json -t 2 2>&1", exe_dir, shipped_dir(),
             idsf, W);
    CHECKF(run_cmd(cmd, out, sizeof out) == 0, "%s", out);
    moe__json *j = NULL;
    CHECKF(moe__json_parse(out, strlen(out), &j, NULL, 0) == MOE_OK, "%s", out);
    const moe__json *jk = moe__json_get(j, "kl_mean"), *jf = moe__json_get(j, "kl_mean_ref_routing"), *jt = moe__json_get(j, "top1_agree");
    const moe__json *jr = moe__json_get(j, "ppl_ref"), *jp = moe__json_get(j, "ppl"), *js = moe__json_get(j, "scored"), *jw = moe__json_get(j, "windows");
    const double want_r = exp(nll_r / predicted), want_p = exp(nll_t / predicted);
    if (getenv("MOE_TEST_VERBOSE")) printf("  perplexity -c %d: %s  here: KL %.6g pinned %.6g top-1 %.6f ppl %.6f / %.6f\n", W, out, kl / scored,
                                           klf / scored, (double)agree / scored, want_r, want_p);
    CHECKF(jk && jf && jt && jr && jp && js && jw && (int)js->num == scored && (int)jw->num == 2 && kl > 0 &&
               fabs(jk->num - kl / scored) <= 1e-5 * kl / scored && fabs(jf->num - klf / scored) <= 1e-5 * klf / scored + 1e-12 &&
               fabs(jt->num - (double)agree / scored) < 1e-6 && fabs(jr->num - want_r) < 1e-5 * want_r && fabs(jp->num - want_p) < 1e-5 * want_p,
           "moe-perplexity %s against KL %.6g pinned %.6g top-1 %.6f ppl %.6f / %.6f over %d", out, kl / scored, klf / scored,
           (double)agree / scored, want_r, want_p, scored);
    moe__json_free(j), j = NULL;
    /* the reference saved, then standing in for the model: the same figures to the digit */
    char reff[600], first[4096];
    tmp_path(reff, sizeof reff, "ppl-ref.bin");
    snprintf(cmd, sizeof cmd, "%s/moe-perplexity -m %s --tokens %s --dense q8_0 -c %d --ref-routing --json -t 2 --save-ref %s 2>&1", exe_dir,
             shipped_dir(), idsf, W, reff);
    CHECKF(run_cmd(cmd, first, sizeof first) == 0, "%s", first);
    snprintf(cmd, sizeof cmd, "%s/moe-perplexity -m %s --ref-logits %s --dense q8_0 --ref-routing --json -t 2 2>&1", exe_dir, shipped_dir(), reff);
    CHECKF(run_cmd(cmd, out, sizeof out) == 0 && !strcmp(out, first), "saved reference: %s against %s", out, first);
    /* refused: a truncated file, one without routing for --ref-routing, another model's vocabulary */
    size_t rl = 0;
    char *rb = read_all(reff, &rl), bad[600];
    tmp_path(bad, sizeof bad, "ppl-bad.bin");
    if (rb) write_all(bad, rb, rl - 5);
    snprintf(cmd, sizeof cmd, "%s/moe-perplexity -m %s --ref-logits %s 2>&1", exe_dir, shipped_dir(), bad);
    CHECKF(run_cmd(cmd, out, sizeof out) == 1 && strstr(out, "truncated"), "%s", out);
    snprintf(cmd, sizeof cmd, "%s/moe-perplexity -m %s --tokens %s -c %d --save-ref %s 2>&1", exe_dir, shipped_dir(), idsf, W, bad);
    CHECKF(run_cmd(cmd, out, sizeof out) == 0, "%s", out);
    snprintf(cmd, sizeof cmd, "%s/moe-perplexity -m %s --ref-logits %s --ref-routing 2>&1", exe_dir, shipped_dir(), bad);
    CHECKF(run_cmd(cmd, out, sizeof out) == 1 && strstr(out, "no routing"), "%s", out);
    snprintf(cmd, sizeof cmd, "%s/moe-perplexity -m %s/kimi --ref-logits %s 2>&1", exe_dir, golden_dir(), reff);
    CHECKF(run_cmd(cmd, out, sizeof out) == 1 && strstr(out, "vocabulary"), "%s", out);
    free(rb), remove(bad), remove(reff);
    /* the whole stream: one window, every position */
    snprintf(cmd, sizeof cmd, "%s/moe-perplexity -m %s --tokens %s --dense q8_0 --json 2>&1", exe_dir, shipped_dir(), idsf);
    CHECKF(run_cmd(cmd, out, sizeof out) == 0 && moe__json_parse(out, strlen(out), &j, NULL, 0) == MOE_OK, "%s", out);
    js = moe__json_get(j, "scored"), jw = moe__json_get(j, "windows");
    CHECKF(js && jw && (int)js->num == n && (int)jw->num == 1, "%s", out);
    moe__json_free(j), j = NULL;
    /* text through the test model's tokenizer */
    tmp_path(txt, sizeof txt, "ppl.txt");
    const char *text = "In the beginning God created the heaven and the earth. And the earth was without form, and void.";
    write_all(txt, text, strlen(text));
    moe_tokenizer *tk = NULL;
    size_t nt = 0;
    int32_t tids[256];
    CHECK(moe_tokenizer_for_model(&tk, f, NULL, 0) == MOE_OK && moe_tokenize(tk, text, strlen(text), 0, tids, 256, &nt, NULL, 0) == MOE_OK);
    moe_tokenizer_free(tk);
    snprintf(cmd, sizeof cmd, "%s/moe-perplexity -m %s -f %s --dense q4_0 --json 2>&1", exe_dir, shipped_dir(), txt);
    CHECKF(run_cmd(cmd, out, sizeof out) == 0 && moe__json_parse(out, strlen(out), &j, NULL, 0) == MOE_OK, "%s", out);
    js = moe__json_get(j, "tokens"), jk = moe__json_get(j, "kl_mean");
    CHECKF(js && jk && (size_t)js->num == nt && jk->num > 0, "%s (%zu ids)", out, nt);
    const moe__json *pr = moe__json_get(j, "ppl_ref");
    const double ppl_ref = pr ? pr->num : -1;
    moe__json_free(j), j = NULL;
    /* alone: the model's own perplexity, the reference's figure above, and no KL */
    snprintf(cmd, sizeof cmd, "%s/moe-perplexity -m %s -f %s --json 2>&1", exe_dir, shipped_dir(), txt);
    CHECKF(run_cmd(cmd, out, sizeof out) == 0 && moe__json_parse(out, strlen(out), &j, NULL, 0) == MOE_OK, "%s", out);
    pr = moe__json_get(j, "ppl");
    CHECKF(pr && fabs(pr->num - ppl_ref) <= 1e-4 * ppl_ref && !moe__json_get(j, "kl_mean"), "%s against %g", out, ppl_ref);
    moe__json_free(j), j = NULL;
    /* bad input: an id past the vocabulary, too few ids for the window, no such file, both inputs */
    fp = fopen(idsf, "w");
    if (fp) fprintf(fp, "1 2 3 %d 5\n", V), fclose(fp);
    snprintf(cmd, sizeof cmd, "%s/moe-perplexity -m %s --tokens %s 2>&1", exe_dir, shipped_dir(), idsf);
    CHECKF(run_cmd(cmd, out, sizeof out) == 1 && strstr(out, "past the vocabulary"), "%s", out);
    snprintf(cmd, sizeof cmd, "%s/moe-perplexity -m %s --tokens %s -c 4 2>&1", exe_dir, shipped_dir(), idsf);
    CHECKF(run_cmd(cmd, out, sizeof out) == 1 && strstr(out, "past the vocabulary"), "%s", out);
    fp = fopen(idsf, "w");
    if (fp) fprintf(fp, "1 2 3 4 5\n"), fclose(fp);
    snprintf(cmd, sizeof cmd, "%s/moe-perplexity -m %s --tokens %s -c 6 2>&1", exe_dir, shipped_dir(), idsf);
    CHECKF(run_cmd(cmd, out, sizeof out) == 1 && strstr(out, "need at least 6"), "%s", out);
    snprintf(cmd, sizeof cmd, "%s/moe-perplexity -m %s --tokens %s.missing 2>&1", exe_dir, shipped_dir(), idsf);
    CHECKF(run_cmd(cmd, out, sizeof out) == 1 && strstr(out, "missing"), "%s", out);
    snprintf(cmd, sizeof cmd, "%s/moe-perplexity -m %s --tokens %s -f %s 2>&1", exe_dir, shipped_dir(), idsf, txt);
    CHECKF(run_cmd(cmd, out, sizeof out) == 2, "%s", out);
    free(ids), free(routes);
    moe_model_close(f), moe_model_close(q);
    remove(idsf), remove(txt);
}

/* moe-bench on the shipped model: one JSON line per depth with every field the README lists, the
 * bandwidth it divides by within its probes' range, a deeper context reading more bytes a token */
static void test_shipped_bench(void) {
    char cmd[2400], out[8192];
    snprintf(cmd, sizeof cmd, "%s/moe-bench -m %s -t 1 --depth 0,6 -n 6 --prefill 4 --reps 1 2>/dev/null", exe_dir, shipped_dir());
    CHECKF(run_cmd(cmd, out, sizeof out) == 0, "%s", out);
    static const char *keys[] = {"model", "format", "threads", "membw_read_gbps", "decode_tok_s", "decode_bytes_per_token",
                                 "decode_roofline_frac", "prefill_tok_s", "prefill_peak_frac"};
    double bytes[2] = {0, 0};
    int lines = 0;
    for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n"), lines++) {
        moe__json *j = NULL;
        CHECKF(lines < 2 && moe__json_parse(line, strlen(line), &j, NULL, 0) == MOE_OK, "%s", line);
        if (!j) continue;
        for (size_t k = 0; k < sizeof keys / sizeof *keys; k++) CHECKF(moe__json_get(j, keys[k]), "%s: no %s", line, keys[k]);
        const moe__json *bw = moe__json_get(j, "membw_read_gbps"), *lo = moe__json_get(j, "membw_min_gbps"),
                        *hi = moe__json_get(j, "membw_max_gbps"), *tok = moe__json_get(j, "decode_tok_s"),
                        *frac = moe__json_get(j, "decode_roofline_frac"), *b = moe__json_get(j, "decode_bytes_per_token"),
                        *d = moe__json_get(j, "depth");
        CHECKF(bw && lo && hi && tok && frac && b && d && lo->num > 0 && lo->num <= bw->num * 1.0001 && bw->num <= hi->num * 1.0001 &&
                   tok->num > 0 && frac->num > 0 && (int)d->num == 6 * lines,
               "%s", line);
        if (b) bytes[lines] = b->num;
        moe__json_free(j);
    }
    CHECKF(lines == 2 && bytes[0] > 0 && bytes[1] > bytes[0], "%d lines, %.0f then %.0f bytes a token", lines, bytes[0], bytes[1]);
    snprintf(cmd, sizeof cmd, "%s/moe-bench -t 1 2>/dev/null", exe_dir);
    CHECK(run_cmd(cmd, out, sizeof out) == 2);
}

/* moe-batch with text and chat requests through the model's tokenizer */
static void test_shipped_batch(void) {
    char in[600], out[600], cmd[2400], buf[8192];
    tmp_path(in, sizeof in, "shipped-in.jsonl");
    tmp_path(out, sizeof out, "shipped-out.jsonl");
    const char *lines =
        "{\"custom_id\": \"c1\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": \"In the beginning\", \"max_tokens\": 12, \"temperature\": 0}}\n"
        "{\"custom_id\": \"c2\", \"method\": \"POST\", \"url\": \"/v1/chat/completions\", \"body\": {\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, "
        "{\"role\": \"user\", \"content\": \"Hello\"}], \"max_tokens\": 16, \"seed\": 1}}\n"
        "{\"custom_id\": \"c3\", \"method\": \"POST\", \"url\": \"/v1/chat/completions\", \"body\": {\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], "
        "\"max_tokens\": 16, \"reasoning_effort\": \"none\", \"stop\": [\"\\n\"]}}\n"
        "{\"custom_id\": \"c4\", \"method\": \"POST\", \"url\": \"/v1/chat/completions\", \"body\": {\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], "
        "\"reasoning_effort\": \"medium\"}}\n";
    CHECK(write_all(in, lines, strlen(lines)));
    remove(out);
    snprintf(cmd, sizeof cmd, "%s/moe-batch -m %s -i %s -o %s 2>&1", exe_dir, shipped_dir(), in, out);
    CHECKF(run_cmd(cmd, buf, sizeof buf) == 0, "%s", buf);
    char text[512];
    CHECK(check_batch_output(out, "c1", text, sizeof text) == 4);
    /* greedy completion = greedy moe-cli continuation */
    char cli[2400], want[4096];
    snprintf(cli, sizeof cli, "%s/moe-cli -m %s -p 'In the beginning' -n 12 --temp 0 --no-display-prompt 2>/dev/null", exe_dir, shipped_dir());
    CHECK(run_cmd(cli, want, sizeof want) == 0);
    size_t wl = strlen(want);
    if (wl && want[wl - 1] == '\n') want[--wl] = 0;
    CHECKF(!strcmp(text, want), "batch '%s' vs cli '%s'", text, want);
    size_t len;
    char *all = read_all(out, &len);
    CHECK(all && strstr(all, "\"object\": \"chat.completion\"") && strstr(all, "\"role\": \"assistant\"") && strstr(all, "low, high or max"));
    free(all);
}

/* moe-plan from a config alone: the full Kimi K3 (no weights) comes out at its published size
 * (2.8 T parameters, ~104 B active, 17.55 MB = 16.73 MiB MXFP4 experts, 25.8 GB = 24.0 GiB of experts per
 * token), and
 * a checkpoint's exact byte counts agree with its config's estimate */
static void test_plan(void) {
    char cmd[2400], out[8192];
    snprintf(cmd, sizeof cmd, "%s/moe-plan --config %s/../../bench/shapes/kimi-k3-config.json --ram 64G --disk-gbps 7 --dense-bytes-per-value 0.5625 2>&1",
             exe_dir, golden_dir());
    CHECKF(run_cmd(cmd, out, sizeof out) == 0, "%s", out);
    CHECKF(strstr(out, "2779.5 B parameters") && strstr(out, "105.36 B active") && strstr(out, "(16.73 MiB each)") &&
           strstr(out, "decode, 1 sequence: 23.") && !strstr(out, "every step"), "%s", out); /* 25.4 GB = 23.7 GiB */
    /* in BF16 (113 GB) the dense matrices do not fit 64 GB: those that do not are read every step,
     * on top of the experts; a dense budget given is what stays resident */
    snprintf(cmd, sizeof cmd, "%s/moe-plan --config %s/../../bench/shapes/kimi-k3-config.json --ram 64G --disk-gbps 7 --dense-budget 20G 2>&1",
             exe_dir, golden_dir());
    CHECKF(run_cmd(cmd, out, sizeof out) == 0, "%s", out);
    const char *dl = strstr(out, "decode, 1 sequence: ");
    CHECKF(strstr(out, "dense matrices 20.00 GiB resident") && strstr(out, "every step") && dl && atof(dl + 20) > 24.0 + 75, "%s", out);
    /* sizes need their unit; what was not given is said */
    snprintf(cmd, sizeof cmd, "%s/moe-plan --config %s/../../bench/shapes/kimi-k3-config.json --ram 256 2>&1", exe_dir, golden_dir());
    CHECKF(run_cmd(cmd, out, sizeof out) == 2 && strstr(out, "--ram needs a size with its unit"), "%s", out);
    snprintf(cmd, sizeof cmd, "%s/moe-plan --config %s/../../bench/shapes/kimi-k3-config.json --ram 256G 2>&1", exe_dir, golden_dir());
    CHECKF(run_cmd(cmd, out, sizeof out) == 0 && strstr(out, "RAM 256.0 GiB") && strstr(out, "assumed: disk 2.00 GB/s (a guess") &&
           !strstr(out, "(--ram)"), "%s", out);
    char a[8192];
    /* with -m it first prints the runtime's own plan (the choices of moe-cli with no flags) */
    snprintf(cmd, sizeof cmd, "%s/moe-plan -m %s/k3mx --ram 1G 2>&1 | head -1", exe_dir, golden_dir());
    CHECK(run_cmd(cmd, a, sizeof a) == 0);
    CHECKF(!strncmp(a, "runtime plan (no flags): ", 25) && strstr(a, "GiB of memory") && strstr(a, "threads"), "%s", a);
    snprintf(cmd, sizeof cmd, "%s/moe-plan -m %s/k3mx --ram 1G 2>&1 | grep -E '^(model|bytes):'", exe_dir, golden_dir());
    CHECK(run_cmd(cmd, a, sizeof a) == 0);
    snprintf(cmd, sizeof cmd, "%s/moe-plan --config %s/k3mx/config.json --ram 1G 2>&1 | grep -E '^(model|bytes):'", exe_dir, golden_dir());
    CHECK(run_cmd(cmd, out, sizeof out) == 0);
    CHECKF(!strcmp(a, out), "from files:\n%s\nfrom config:\n%s", a, out);
    snprintf(cmd, sizeof cmd, "%s/moe-plan 2>/dev/null", exe_dir);
    CHECK(run_cmd(cmd, out, sizeof out) == 2);
}

/* moe-cachesim on the shipped model's routing: one JSON line per cache size with a hit rate per
 * policy in [0, 1], the offline optimum (belady) the best; a cache that holds every expert makes
 * the policies equal; the runtime's policy is replayed with the runtime's half-life by default
 * (the same line as --half-life MOE_HISTORY_HALF_LIFE), and another half-life changes it */
static void test_cachesim(void) {
    char ids[600], cmd[2400], a[4096], b[4096], c[4096];
    tmp_path(ids, sizeof ids, "cachesim-ids.txt");
    size_t len = 0;
    int32_t *held = (int32_t *)(void *)read_all("test/shipped/heldout_ids.bin", &len);
    CHECK(held && len >= 4 * 300);
    if (!held || len < 4 * 300) { free(held); return; }
    FILE *f = fopen(ids, "w");
    for (int i = 0; i < 300; i++) fprintf(f, "%d\n", (int)held[i]);
    fclose(f);
    free(held);
    const char *fmt = "%s/moe-cachesim -m %s --tokens %s --cache 0.1,0.3,1 -t 2 %s 2>/dev/null";
    snprintf(cmd, sizeof cmd, fmt, exe_dir, shipped_dir(), ids, "");
    CHECKF(run_cmd(cmd, a, sizeof a) == 0, "%s", a);
    char hl[64];
    snprintf(hl, sizeof hl, "--half-life %g", MOE_HISTORY_HALF_LIFE);
    snprintf(cmd, sizeof cmd, fmt, exe_dir, shipped_dir(), ids, hl);
    CHECK(run_cmd(cmd, b, sizeof b) == 0 && !strcmp(a, b));
    snprintf(cmd, sizeof cmd, fmt, exe_dir, shipped_dir(), ids, "--half-life 1");
    CHECK(run_cmd(cmd, c, sizeof c) == 0 && strcmp(a, c));
    int lines = 0;
    for (char *l = a; (l = strstr(l, "{\"model\"")); l++, lines++) {
        double r[4];
        const char *keys[4] = {"\"lru\": ", "\"lfu\": ", "\"lrfu\": ", "\"belady\": "};
        for (int p = 0; p < 4; p++) {
            const char *k = strstr(l, keys[p]);
            r[p] = k ? atof(k + strlen(keys[p])) : -1;
            CHECKF(r[p] >= 0 && r[p] <= 1, "%s", l);
        }
        for (int p = 0; p < 3; p++) CHECKF(r[p] <= r[3], "line %d: %s", lines, l);
        if (lines == 2) CHECKF(r[0] == r[1] && r[1] == r[2] && r[2] == r[3], "%s", l); /* every expert fits */
        if (lines == 0) CHECKF(r[3] > r[0], "%s", l);
    }
    CHECKF(lines == 3, "%s", a);
}

/* polls every 0.1 s, up to a minute, until done(ud) */
static void wait_until(int (*done)(void *), void *ud) {
    for (int waited = 0; waited < 600 && !done(ud); waited++) {
        struct timespec ts = {0, 100000000};
        nanosleep(&ts, NULL);
    }
}

typedef struct { char out[600], err[600]; } cli_files;

/* the reply is printing: the answer on stdout, K3's thinking on stderr (past the loading lines) */
static int reply_printing(void *ud) {
    const cli_files *f = ud;
    struct stat so, se;
    return !stat(f->out, &so) && !stat(f->err, &se) && (so.st_size >= 200 || se.st_size >= 2000);
}

static int reply_stopped(void *ud) {
    size_t n = 0;
    char *e = read_all(((const cli_files *)ud)->err, &n);
    const int yes = e && strstr(e, "interrupted (Ctrl-C)");
    free(e);
    return yes;
}

/* moe-cli on a long generation, sent SIGINT once its reply is printing: a prompt (chat 0), or a
 * chat (-cnv) whose one turn comes through a pipe that is closed (Ctrl-D) once the reply has
 * stopped. The exit status; stderr in err. */
static int cli_interrupted(int chat, char *err, size_t en) {
    cli_files f;
    char exe[700];
    tmp_path(f.out, sizeof f.out, chat ? "chat-sigint-out.txt" : "sigint-out.txt");
    tmp_path(f.err, sizeof f.err, chat ? "chat-sigint-err.txt" : "sigint-err.txt");
    snprintf(exe, sizeof exe, "%s/moe-cli", exe_dir);
    int in[2];
    if (chat && pipe(in)) return -1;
    fflush(NULL);
    const pid_t pid = fork();
    if (pid == 0) {
        const int o = open(f.out, O_WRONLY | O_CREAT | O_TRUNC, 0600), e = open(f.err, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (o < 0 || e < 0 || dup2(o, 1) < 0 || dup2(e, 2) < 0 || (chat && (dup2(in[0], 0) < 0 || close(in[1])))) _exit(127);
        signal(SIGINT, SIG_DFL);
        if (chat) execl(exe, exe, "-m", shipped_dir(), "-cnv", "-n", "1000000", "-c", "1000000", "--ignore-eos", "-t", "1", (char *)NULL);
        else execl(exe, exe, "-m", shipped_dir(), "-p", "In the beginning", "-n", "1000000", "--ignore-eos", "-t", "1", (char *)NULL);
        _exit(127);
    }
    if (chat) {
        close(in[0]);
        CHECK(write(in[1], "Hello\n", 6) == 6);
    }
    wait_until(reply_printing, &f);
    kill(pid, SIGINT);
    if (chat) {
        wait_until(reply_stopped, &f); /* the reply stops and the prompt comes back */
        close(in[1]);                   /* Ctrl-D at the prompt */
    }
    int st = 0;
    waitpid(pid, &st, 0);
    size_t n = 0;
    char *e = read_all(f.err, &n);
    snprintf(err, en, "%s", e ? e : "");
    free(e);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* what every program does with a bad command line: the flag and the value named, the nearest
 * option suggested, one line pointing at --help (the help itself only for --help, on stdout,
 * exit 0); model paths that are not models; -n 0; Ctrl-C stopping generation with the timings */
static void test_cli_manners(void) {
    char cmd[2400], a[8192];
    const struct { const char *prog, *args, *want; } bad[] = {
        {"moe-cli", "-m M -p x --temprature 0.5", "unknown option --temprature (did you mean --temp?)"},
        {"moe-cli", "-m M -p x -n abc", "-n abc: not a number"},
        {"moe-cli", "-m M -p x -t 0", "-t 0: must be at least 1"},
        {"moe-cli", "-m M -p x --dense q5_0", "--dense q5_0: must be auto, asis"},
        {"moe-cli", "-m M -p x -c", "-c needs a value"},
        {"moe-batch", "-m M -i x -o y --paralel 2", "unknown option --paralel (did you mean --parallel?)"},
        {"moe-batch", "-m M -i x -o y -t 0", "-t 0: must be at least 1"},
        {"moe-plan", "--config x --ram 256", "--ram needs a size with its unit"},
        {"moe-perplexity", "-m M --tokns x", "unknown option --tokns (did you mean --tokens?)"},
        {"moe-tokenize", "--spcial", "unknown option --spcial (did you mean --special?)"},
        {"moe-convert", "a b --dnse q8_0", "unknown option --dnse (did you mean --dense?)"},
        {"moe-logits", "-m M --tokens x --expert-budget 3", "--expert-budget 3: not a size with its unit"},
        {"moe-server", "-m M --prot 8080", "unknown option --prot (did you mean --port?)"},
        {"moe-server", "-m M --port 70000", "--port 70000: must be at most 65535"},
        {"moe-server", "-m M --prefix-cache-size 3", "--prefix-cache-size: a size with its unit"},
        {"moe-server", "-m M --api-key ''", "--api-key must not be empty"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        snprintf(cmd, sizeof cmd, "%s/%s %s 2>&1 >/dev/null", exe_dir, bad[i].prog, bad[i].args);
        const int rc = run_cmd(cmd, a, sizeof a);
        int lines = 0;
        for (const char *p = a; *p; p++) lines += *p == '\n';
        CHECKF(rc == 2 && strstr(a, bad[i].want) && strstr(a, "--help' lists the options") && lines == 2, "%s %s: rc %d:\n%s", bad[i].prog, bad[i].args, rc, a);
    }
    const char *progs[] = {"moe-cli", "moe-batch", "moe-plan", "moe-perplexity", "moe-tokenize", "moe-convert", "moe-logits", "moe-bench", "moe-cachesim",
                           "moe-server"};
    for (size_t i = 0; i < sizeof progs / sizeof *progs; i++) {
        snprintf(cmd, sizeof cmd, "%s/%s --help 2>&1 >/dev/null | wc -c; %s/%s --help | grep -c usage", exe_dir, progs[i], exe_dir, progs[i]);
        CHECKF(run_cmd(cmd, a, sizeof a) == 0 && atoi(a) == 0 && atoi(strchr(a, '\n') + 1) >= 1, "%s --help: %s", progs[i], a);
    }
    /* model paths */
    snprintf(cmd, sizeof cmd, "%s/moe-cli -m models/nope -p x 2>&1", exe_dir);
    CHECKF(run_cmd(cmd, a, sizeof a) == 1 && strstr(a, "models/nope: No such file or directory"), "%s", a);
    snprintf(cmd, sizeof cmd, "%s/moe-cli -m README.md -p x 2>&1", exe_dir);
    CHECKF(run_cmd(cmd, a, sizeof a) == 1 && strstr(a, "README.md: not a model"), "%s", a);
    char dir[600], cfg[700];
    tmp_path(dir, sizeof dir, "llama");
    mkdir(dir, 0700);
    snprintf(cfg, sizeof cfg, "%s/config.json", dir);
    CHECK(write_all(cfg, "{\"model_type\": \"llama\", \"vocab_size\": 32000}", 44));
    snprintf(cmd, sizeof cmd, "%s/moe-cli -m %s -p x 2>&1", exe_dir, dir);
    CHECKF(run_cmd(cmd, a, sizeof a) == 1 && strstr(a, cfg) && strstr(a, "model_type \"llama\" is not a model moe runs"), "%s", a);
    /* -n 0: the prompt alone */
    snprintf(cmd, sizeof cmd, "%s/moe-cli -m %s -p 'In the beginning' -n 0 2>&1", exe_dir, shipped_dir());
    CHECKF(run_cmd(cmd, a, sizeof a) == 0 && strstr(a, "generated 0 tokens"), "%s", a);
    /* Ctrl-C: generation stops, the timings are printed, exit status 130 */
    if (getenv("MOE_TEST_RUNNER")) return;
    int rc = cli_interrupted(0, a, sizeof a);
    CHECKF(rc == 130 && strstr(a, "interrupted (Ctrl-C)") && strstr(a, "tokens in"), "rc %d: %s", rc, a);
    /* in a chat: the reply stops, the prompt comes back, Ctrl-D ends it normally */
    rc = cli_interrupted(1, a, sizeof a);
    const char *stop = strstr(a, "interrupted (Ctrl-C); Ctrl-C or Ctrl-D at the prompt ends the chat");
    CHECKF(rc == 0 && stop && strstr(stop, "> ") && strstr(a, "tokens in"), "rc %d: %s", rc, a);
}

/* examples/simple.c gives moe-cli's greedy text; `make install` puts the header, both libraries,
 * moe.pc and the programs under PREFIX, simple.c built from them through pkg-config runs against
 * the shared library (its soname), and `make uninstall` takes all of it away */
static void test_simple_install(void) {
    char cmd[8000], a[8192], b[8192], prefix[600];
    snprintf(cmd, sizeof cmd, "%s/simple %s 'In the beginning' 2>/dev/null", exe_dir, shipped_dir());
    CHECK(run_cmd(cmd, a, sizeof a) == 0);
    snprintf(cmd, sizeof cmd, "%s/moe-cli -m %s -p 'In the beginning' -n 64 --temp 0 2>/dev/null", exe_dir, shipped_dir());
    CHECKF(run_cmd(cmd, b, sizeof b) == 0 && !strcmp(a, b), "simple '%s' vs moe-cli '%s'", a, b);
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    return; /* a sanitized libmoe needs the sanitizer's runtime at link time: not what pkg-config says */
#endif
    if (getenv("MOE_TEST_RUNNER")) return; /* cross-built: the host's compiler cannot link it */
    tmp_path(prefix, sizeof prefix, "inst");
    snprintf(cmd, sizeof cmd, "make -s install PREFIX=%s BUILD=%s >/dev/null 2>&1 && PKG_CONFIG_PATH=%s/lib/pkgconfig "
             "cc -O2 examples/simple.c $(PKG_CONFIG_PATH=%s/lib/pkgconfig pkg-config --cflags --libs moe) -o %s/simple-installed 2>&1 && "
             "LD_LIBRARY_PATH=%s/lib %s/simple-installed %s 'In the beginning' 2>/dev/null",
             prefix, exe_dir, prefix, prefix, prefix, prefix, prefix, shipped_dir());
    CHECKF(run_cmd(cmd, b, sizeof b) == 0 && !strcmp(a, b), "installed: '%s'", b);
    snprintf(cmd, sizeof cmd, "readelf -d %s/simple-installed | grep -c 'NEEDED.*libmoe.so.0'", prefix);
    CHECKF(run_cmd(cmd, b, sizeof b) == 0 && atoi(b) == 1, "%s", b);
    snprintf(cmd, sizeof cmd, "make -s uninstall PREFIX=%s BUILD=%s >/dev/null 2>&1; find %s -type f -o -type l | wc -l", prefix, exe_dir, prefix);
    CHECKF(run_cmd(cmd, b, sizeof b) == 0 && atoi(b) == 1, "left after uninstall: %s", b); /* simple-installed */
}

const test_case programs_tests[] = {
    {"programs.cli_manners", test_cli_manners, "bad flags named with the value and the nearest option; --help; model paths; -n 0; Ctrl-C alone and in a chat", 0},
    {"programs.simple_install", test_simple_install, "examples/simple.c, and built through pkg-config against make install's library", 0},
    {"programs.moe_tokenize", test_moe_tokenize_cli, "moe-tokenize: the interface the checks use", 0},
    {"programs.batch_basic", test_batch_basic, "moe-batch: requests answered once each, in any order, resumable", 0},
    {"programs.batch_logprobs", test_batch_logprobs, "moe-batch's log probabilities against the golden logits", 0},
    {"programs.batch_choices", test_batch_choices, "moe-batch \"n\": choices decoded as sequences of their own", 0},
    {"programs.perplexity", test_shipped_perplexity, "moe-perplexity's figures against the library's on the same windows", 0},
    {"programs.cli", test_shipped_cli, "moe-cli on text: seeds, UTF-8, stop strings, a chat turn", 0},
    {"programs.bench", test_shipped_bench, "moe-bench: JSON fields, bandwidth within its probes, depth reads more", 0},
    {"programs.batch_text", test_shipped_batch, "moe-batch with text and chat requests through the tokenizer", 0},
    {"programs.moe_logits", test_moe_logits_cli, "moe-logits: the stable command-line interface", 0},
    {"programs.plan", test_plan, "moe-plan: full K3 from a config, exact counts from a checkpoint", 0},
    {"programs.cachesim", test_cachesim, "moe-cachesim replays the runtime's eviction policy with its half-life", 0},
    {0}
};
