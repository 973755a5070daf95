/* gguf.c - tests of GGUF and checkpoints: the JSON parser, checkpoints converted to GGUF (as stored, quantized, k-quants, grid
 * formats, split), vocabularies in GGUF, the K3 slice layout, model info. */
#include "test.h"

static void test_json(void) {
    const char *good[] = {"{}", "[]", "0", "-1.5e3", "\"a\\u00e9\\ud83d\\ude00\"", "{\"a\":[1,2,{\"b\":null}],\"c\":true}", " [ ] "};
    const char *bad[] = {"", "{", "[1,]", "{\"a\"}", "\"\\x\"", "01", "1.", "tru", "[1] x", "\"\\ud800\"", "{\"a\":1,}", "\"a\nb\"", "-", "[\"\\u12\"]"};
    for (size_t i = 0; i < sizeof good / sizeof *good; i++) {
        moe__json *j;
        CHECKF(moe__json_parse(good[i], strlen(good[i]), &j, NULL, 0) == MOE_OK, "%s", good[i]);
        moe__json_free(j);
    }
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        moe__json *j;
        char err[128];
        CHECKF(moe__json_parse(bad[i], strlen(bad[i]), &j, err, sizeof err) == MOE_ERR_FORMAT, "%s", bad[i]);
    }
    moe__json *j;
    const char *t = "{\"k\":\"a\\u00e9\\ud83d\\ude00\",\"n\":[1,2.5]}";
    CHECK(moe__json_parse(t, strlen(t), &j, NULL, 0) == MOE_OK);
    const moe__json *k = moe__json_get(j, "k"), *n = moe__json_get(j, "n");
    CHECK(k && !strcmp(k->str, "a\xc3\xa9\xf0\x9f\x98\x80"));
    CHECK(n && n->n == 2 && n->child->next->num == 2.5);
    moe__json_free(j);
    /* nesting bomb */
    char deep[3000];
    memset(deep, '[', 2000);
    memset(deep + 2000, ']', 999);
    deep[2999] = 0;
    CHECK(moe__json_parse(deep, strlen(deep), &j, NULL, 0) == MOE_ERR_FORMAT);
}

static void test_model_info(void) {
    moe_model *m = open_model("k3mx", 0, 1), *s = open_model("seed", 0, 1);
    if (!m || !s) { moe_model_close(m); moe_model_close(s); return; }
    const moe_config *c = moe_model_config(m);
    moe_model_info a = moe_model_get_info(m), b = moe_model_get_info(s);
    CHECK(c->n_layers == 8 && c->n_experts == 64 && c->n_active == 6 && c->latent_dim == 64);
    CHECK(c->layer_kind[3] == MOE_LAYER_MLA && c->layer_kind[0] == MOE_LAYER_KDA && !c->layer_moe[0] && c->layer_moe[1]);
    CHECK(c->attn_res_block == 3 && c->kda_gate_bounded && c->hidden_act == MOE_ACT_SITU);
    /* same model, experts BF16 in seed and MXFP4 in k3mx: same parameter count, fewer bytes */
    CHECK(a.n_params == b.n_params + 6 * 125 && b.n_params > 0); /* k3mx pads A_log to 128 */
    CHECK(a.expert_bytes < b.expert_bytes && a.n_files == 11 && b.n_files == 1);
    /* 7 MoE layers x 64 experts x 3 x 32 x 64 values */
    CHECK(b.expert_bytes == 7ull * 64 * 3 * 32 * 64 * 2);
    CHECK(a.expert_bytes == 7ull * 64 * 3 * (32 * 32 + 32 * 2));
    CHECK(b.n_params - b.n_params_active == 7ull * (64 - 6) * 3 * 32 * 64);
    moe_model_close(m);
    moe_model_close(s);
}

/* llama.cpp's gpt2-style BPE over the GGUF's tokens and merges (an independent reading of what
 * moe-convert writes): GPT-2's byte symbols, the adjacent pair listed first in the merges joined
 * until none is listed, each symbol then looked up among the tokens */
typedef struct { const char *p; size_t n; } gstr;

static size_t gstr_hash(const char *p, size_t n) {
    size_t h = 2166136261u;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)p[i]) * 16777619u;
    return h;
}

typedef struct { gstr *s; int *slot; size_t mask; } gtable; /* strings -> their index */

static int gtable_init(gtable *t, const moe__gguf_kv *kv) {
    if (!kv || kv->type != MOE_GGUF_ARRAY || kv->etype != MOE_GGUF_STRING) return 0;
    size_t cap = 16;
    while (cap < 2 * kv->n) cap *= 2;
    t->s = malloc(sizeof *t->s * kv->n), t->slot = malloc(sizeof(int) * cap), t->mask = cap - 1;
    if (!t->s || !t->slot) return 0;
    for (size_t k = 0; k < cap; k++) t->slot[k] = -1;
    const uint8_t *p = kv->data;
    for (uint64_t i = 0; i < kv->n; i++) {
        uint64_t n;
        memcpy(&n, p, 8);
        t->s[i] = (gstr){(const char *)p + 8, (size_t)n};
        p += 8 + n;
        size_t k = gstr_hash(t->s[i].p, t->s[i].n) & t->mask;
        while (t->slot[k] >= 0) k = (k + 1) & t->mask;
        t->slot[k] = (int)i;
    }
    return 1;
}

static int gtable_find(const gtable *t, const char *p, size_t n) {
    for (size_t k = gstr_hash(p, n) & t->mask; t->slot[k] >= 0; k = (k + 1) & t->mask)
        if (t->s[t->slot[k]].n == n && !memcmp(t->s[t->slot[k]].p, p, n)) return t->slot[k];
    return -1;
}

static size_t gpt2_char(unsigned char b, char *out) { /* GPT-2's symbol for byte b, UTF-8 */
    unsigned cp = b;
    if (!((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE)) {
        unsigned k = 0;
        for (unsigned x = 0; x < b; x++) k += !((x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE);
        cp = 256 + k;
    }
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    out[0] = (char)(0xC0 | cp >> 6), out[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
}

/* ids of one piece into ids[]; the count, or -1 where a symbol is no token */
static long merges_bpe(const gtable *tokens, const gtable *merges, const char *piece, size_t n, int32_t *ids) {
    char *sym = malloc(2 * n + 1), *pair = malloc(4 * n + 2);
    size_t *at = malloc(sizeof(size_t) * (n + 1)), m = 0, ns = n;
    for (size_t i = 0; i < n; i++) at[i] = m, m += gpt2_char((unsigned char)piece[i], sym + m);
    at[n] = m;
    for (;;) {
        int best = -1;
        size_t bj = 0;
        for (size_t j = 0; j + 1 < ns; j++) {
            size_t a = at[j + 1] - at[j], b = at[j + 2] - at[j + 1];
            memcpy(pair, sym + at[j], a), pair[a] = ' ', memcpy(pair + a + 1, sym + at[j + 1], b);
            const int r = gtable_find(merges, pair, a + 1 + b);
            if (r >= 0 && (best < 0 || r < best)) best = r, bj = j;
        }
        if (best < 0) break;
        memmove(at + bj + 1, at + bj + 2, sizeof *at * (ns - bj - 1));
        ns--;
    }
    long out = (long)ns;
    for (size_t j = 0; j < ns && out >= 0; j++)
        if ((ids[j] = gtable_find(tokens, sym + at[j], at[j + 1] - at[j])) < 0) out = -1;
    free(sym), free(pair), free(at);
    return out;
}

static void check_gguf_merges(const char *path, const moe_tokenizer *t, const char *text, size_t len) {
    moe__st_file f;
    char err[300];
    CHECKF(moe__gguf_open(&f, path, err, sizeof err) == MOE_OK, "%s", err);
    gtable tokens = {0}, merges = {0};
    CHECK(gtable_init(&tokens, moe__gguf_get(&f, "tokenizer.ggml.tokens")) && gtable_init(&merges, moe__gguf_get(&f, "tokenizer.ggml.merges")));
    size_t *ends = malloc(sizeof(size_t) * (len + 1)), n = 0;
    int32_t *want = malloc(sizeof(int32_t) * (len + 1)), *got = malloc(sizeof(int32_t) * (len + 1));
    const long np = tokens.s && merges.s ? moe__pretokenize(MOE_PRETOK_KIMI, text, len, ends, len + 1) : -1;
    CHECK(np > 0 && moe_tokenize(t, text, len, 0, want, len + 1, &n, err, sizeof err) == MOE_OK);
    size_t k = 0, start = 0, bad = 0;
    for (long i = 0; i < np && !bad; i++) {
        const long m = merges_bpe(&tokens, &merges, text + start, ends[i] - start, got + k);
        if (m < 0) bad = 1;
        else k += (size_t)m;
        start = ends[i];
    }
    CHECKF(!bad && k == n && !memcmp(got, want, n * sizeof *got), "merges BPE: %zu ids against %zu", k, n);
    free(ends), free(want), free(got), free(tokens.s), free(tokens.slot), free(merges.s), free(merges.slot);
    moe__st_close(&f);
}

/* the shipped model converted to GGUF carries its vocabulary: same ids, same greedy text */
static void test_shipped_gguf_vocab(void) {
    char out[600], cmd[2400], a[4096], b[4096], err[300];
    tmp_path(out, sizeof out, "shipped.gguf");
    remove(out);
    snprintf(cmd, sizeof cmd, "%s/moe-convert %s %s 2>&1", exe_dir, shipped_dir(), out);
    CHECKF(run_cmd(cmd, a, sizeof a) == 0, "%s", a);
    moe_model *m1 = NULL, *m2 = NULL;
    moe_tokenizer *t1 = NULL, *t2 = NULL;
    moe_options o = moe_default_options();
    CHECK(moe_model_open(&m1, shipped_dir(), &o, err, sizeof err) == MOE_OK && moe_model_open(&m2, out, &o, err, sizeof err) == MOE_OK);
    if (m1 && m2) {
        CHECK(moe_tokenizer_for_model(&t1, m1, err, sizeof err) == MOE_OK);
        CHECKF(moe_tokenizer_for_model(&t2, m2, err, sizeof err) == MOE_OK, "%s", err);
    }
    size_t len = 0;
    char *text = read_all("test/tokenizer/corpus.txt", &len);
    if (t1 && t2 && text) {
        CHECK(moe_tokenizer_n_ids(t1) == moe_tokenizer_n_ids(t2) && moe_chat_format_of(t2) == MOE_CHAT_K3);
        int32_t *i1 = malloc(len * sizeof *i1), *i2 = malloc(len * sizeof *i2);
        size_t n1 = 0, n2 = 0;
        CHECK(moe_tokenize(t1, text, len, MOE_TOK_SPECIAL, i1, len, &n1, err, sizeof err) == MOE_OK);
        CHECK(moe_tokenize(t2, text, len, MOE_TOK_SPECIAL, i2, len, &n2, err, sizeof err) == MOE_OK);
        CHECK(n1 == n2 && !memcmp(i1, i2, n1 * sizeof *i1));
        free(i1), free(i2);
        check_gguf_merges(out, t1, text, len);
    }
    free(text);
    moe_tokenizer_free(t1), moe_tokenizer_free(t2);
    moe_model_close(m1), moe_model_close(m2);
    snprintf(cmd, sizeof cmd, "%s/moe-cli -m %s -p 'In the beginning' -n 16 --temp 0 2>/dev/null", exe_dir, shipped_dir());
    CHECK(run_cmd(cmd, a, sizeof a) == 0);
    snprintf(cmd, sizeof cmd, "%s/moe-cli -m %s -p 'In the beginning' -n 16 --temp 0 2>/dev/null", exe_dir, out);
    CHECK(run_cmd(cmd, b, sizeof b) == 0 && !strcmp(a, b));
    remove(out);
}

/* golden checkpoints converted to GGUF (F32 dense, experts as stored: MXFP4 repacked) pass the
 * same golden checks as the directories */
static void test_gguf_golden(void) {
    const char *cases[] = {"kimi", "seed", "k3mx"};
    for (int i = 0; i < 3; i++) {
        char dir[600], out[600];
        snprintf(dir, sizeof dir, "%s/%s", golden_dir(), cases[i]);
        snprintf(out, sizeof out, "%s/%s.gguf", tmp_root, cases[i]);
        CHECK(convert(dir, out, "--dense f32") == 0);
        run_golden_path(cases[i], out, 0, 1);
        moe_model *m = open_path(out, 0, 1);
        if (m) CHECK(!strcmp(moe_model_get_info(m).format, "gguf"));
        moe_model_close(m);
        /* no tokenizer in the checkpoint: the file says so as llama.cpp needs to load it */
        moe__st_file f;
        char err[256];
        const moe_status fs = moe__gguf_open(&f, out, err, sizeof err);
        CHECKF(fs == MOE_OK, "%s", err);
        if (fs == MOE_OK) {
            const moe__gguf_kv *kv = moe__gguf_get(&f, "tokenizer.ggml.model");
            CHECK(kv && kv->type == MOE_GGUF_STRING && kv->n == 4 && !memcmp(kv->data, "none", 4));
            moe__st_close(&f);
        }
        remove(out);
    }
    /* --alignment 32 (for files ggml's writer will copy): the key says so and the tensors sit on 32 */
    char dir[600], out[600];
    snprintf(dir, sizeof dir, "%s/kimi", golden_dir());
    snprintf(out, sizeof out, "%s/kimi32.gguf", tmp_root);
    CHECK(convert(dir, out, "--dense f32 --alignment 32") == 0);
    CHECK(convert_expect(dir, out, "--dense f32 --alignment 48", 2) == 2);
    run_golden_path("kimi", out, 0, 1);
    moe__st_file f;
    char err[256];
    const moe_status fs = moe__gguf_open(&f, out, err, sizeof err);
    CHECKF(fs == MOE_OK, "%s", err);
    if (fs == MOE_OK) {
        const moe__gguf_kv *kv = moe__gguf_get(&f, "general.alignment");
        uint32_t al = 0;
        if (kv && kv->type == MOE_GGUF_U32) memcpy(&al, kv->data, 4);
        int off32 = 0;
        for (int t = 0; t < f.n_tensors; t++) off32 += ((const unsigned char *)f.tensors[t].data - (const unsigned char *)f.map) % 4096 != 0;
        CHECKF(al == 32 && off32 > 0, "alignment %u, %d tensors off 4 KB", al, off32);
        moe__st_close(&f);
    }
    remove(out);
}

/* mean |a - b| over n values */
static double mean_abs_diff(const float *a, const float *b, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++) s += fabs(a[i] - b[i]);
    return s / n;
}

/* quantized GGUF files load and run; MXFP4 experts are the same values; an interrupted
 * conversion resumes and produces the same bytes */
static void test_gguf_quant_resume(void) {
    char dir[600], a[600], b[600];
    snprintf(dir, sizeof dir, "%s/k3mx", golden_dir());
    snprintf(a, sizeof a, "%s/a.gguf", tmp_root);
    snprintf(b, sizeof b, "%s/b.gguf", tmp_root);
    CHECK(convert(dir, a, "--dense q8_0") == 0);
    setenv("MOE_CONVERT_STOP_AFTER", "57", 1);
    CHECK(convert_expect(dir, b, "--dense q8_0", 3) == 3); /* "crashed" after 57 tensors */
    unsetenv("MOE_CONVERT_STOP_AFTER");
    char partial[700];
    snprintf(partial, sizeof partial, "%s.partial", b);
    struct stat sb;
    CHECK(stat(partial, &sb) == 0 && stat(b, &sb) != 0);
    CHECK(convert(dir, b, "--dense q8_0") == 0);
    size_t la, lb;
    char *fa = read_all(a, &la), *fb = read_all(b, &lb);
    CHECK(fa && fb && la == lb && !memcmp(fa, fb, la));
    free(fa), free(fb);
    /* interleaved at load (default), used as mapped, or scalar: the kernels agree to float
     * summation order (quant_blocks checks them exactly). Through a model, activation rounding
     * turns 1-ulp differences into occasional one-step int8 differences, so whole-model logits
     * agree only to ~0.02 on average here (measured: 0.016-0.019 mean, 0.14-0.24 max). Checked on
     * the Kimi-Linear model with routing pinned to the first run's (the random models' own
     * routing margins after quantization are unknown; the K3 ones amplify far more). */
    {
        snprintf(dir, sizeof dir, "%s/kimi", golden_dir());
        CHECK(convert(dir, a, "--dense q8_0 --experts q4_0") == 0);
        /* r[3]: a repack budget the experts do not fit in: they stay mapped (row kernels) */
        moe_options ob = moe_default_options();
        ob.repack_budget = 1;
        moe_model *r[4] = {open_path(a, 0, 1), open_path(a, MOE_FLAG_NO_REPACK, 1), open_path(a, MOE_FLAG_FORCE_SCALAR, 2), NULL};
        CHECK(moe_model_open(&r[3], a, &ob, NULL, 0) == MOE_OK);
        CHECK(r[0] && moe_model_get_info(r[0]).experts_kept_mapped == 0);
        CHECK(r[3] && moe_model_get_info(r[3]).experts_kept_mapped == 1);
        int n;
        int32_t *ids = golden_ids("kimi", 2, &n);
        if (r[0] && r[1] && r[2] && r[3]) {
            const moe_config *c = moe_model_config(r[0]);
            const size_t nv = (size_t)n * c->vocab_size;
            float *x[4];
            int32_t *routes = malloc(sizeof(int32_t) * (size_t)n * c->n_layers * c->n_active);
            for (int k = 0; k < 4; k++) x[k] = logits_routed(r[k], ids, n, NULL, k == 0 ? routes : NULL, k == 0 ? NULL : routes);
            const double d1 = max_abs_diff(x[0], x[1], nv), d2 = max_abs_diff(x[0], x[2], nv), d3 = max_abs_diff(x[0], x[3], nv);
            const double m1 = mean_abs_diff(x[0], x[1], nv), m2 = mean_abs_diff(x[0], x[2], nv), m3 = mean_abs_diff(x[0], x[3], nv);
            CHECKF(d1 < 1.0 && d2 < 1.0 && m1 < 0.05 && m2 < 0.05, "repacked vs mapped: max %.3g mean %.3g; vs scalar: max %.3g mean %.3g", d1, m1, d2, m2);
            CHECKF(d3 < 1.0 && m3 < 0.05, "experts left mapped by the repack budget: max %.3g mean %.3g", d3, m3);
            /* the levels between scalar and the best (avx2 on an AVX-512 machine, avxvnni) */
            moe__kernels lv[MOE_KERNEL_LEVELS_MAX];
            const int nl = moe__kernel_levels(lv, MOE_KERNEL_LEVELS_MAX);
            for (int l = 1; l < nl - 1; l++) {
                moe_options ol = moe_default_options();
                ol.kernels = lv[l].isa;
                moe_model *ml = NULL;
                CHECK(moe_model_open(&ml, a, &ol, NULL, 0) == MOE_OK);
                if (ml) {
                    free(x[1]);
                    x[1] = logits_routed(ml, ids, n, NULL, NULL, routes);
                    const double dl = max_abs_diff(x[0], x[1], nv), ml1 = mean_abs_diff(x[0], x[1], nv);
                    CHECKF(dl < 1.0 && ml1 < 0.05, "%s kernels vs %s: max %.3g mean %.3g", lv[l].isa, lv[nl - 1].isa, dl, ml1);
                }
                moe_model_close(ml);
            }
            free(x[0]), free(x[1]), free(x[2]), free(x[3]), free(routes);
        }
        free(ids);
        for (int k = 0; k < 4; k++) moe_model_close(r[k]);
    }
    /* a q8_0 file runs; on the Kimi-Linear golden model, with the reference's routing (random
     * tiny models flip near-tie experts on any change), its KL to the original stays small */
    moe_model *q = NULL, *ref = open_model("kimi", 0, 1);
    snprintf(dir, sizeof dir, "%s/kimi", golden_dir());
    if (convert(dir, a, "--dense q8_0") == 0) q = open_path(a, 0, 1);
    if (q && ref) {
        int n;
        int32_t *ids = golden_ids("kimi", 3, &n);
        const int V = moe_model_config(q)->vocab_size, L = moe_model_config(q)->n_layers, K = moe_model_config(q)->n_active;
        float *l1 = malloc(sizeof(float) * (size_t)V * n), *l2 = malloc(sizeof(float) * (size_t)V * n);
        int32_t *routes = malloc(sizeof(int32_t) * (size_t)n * L * K);
        moe_session *s1 = NULL, *s2 = NULL;
        CHECK(moe_session_new(&s1, ref, n, NULL, 0) == MOE_OK && moe_session_new(&s2, q, n, NULL, 0) == MOE_OK);
        moe_seq q1 = {.s = s1, .tokens = ids, .n = n, .logits = l1, .logits_all = 1, .routes = routes};
        moe_seq q2 = {.s = s2, .tokens = ids, .n = n, .logits = l2, .logits_all = 1, .force_routes = routes};
        CHECK(moe_step(ref, &q1, 1, NULL, NULL, 0) == MOE_OK && moe_step(q, &q2, 1, NULL, NULL, 0) == MOE_OK);
        const double kl = mean_kl(l1, l2, n, V);
        CHECKF(kl < 5e-3, "q8_0 GGUF vs original with the same routing: mean KL %.3g", kl);
        if (getenv("MOE_TEST_VERBOSE")) fprintf(stderr, "  kimi q8_0 GGUF: mean KL with reference routing %.3g\n", kl);
        moe_session_free(s1), moe_session_free(s2);
        free(l1), free(l2), free(routes), free(ids);
    }
    moe_model_close(q);
    moe_model_close(ref);
    remove(a), remove(b);
}

/* GGUF files in the other ggml formats (the shipped model, hidden size 256: Q2_K .. Q6_K and
 * IQ4_XS rows, with llama.cpp's fallbacks where a row is 128 values) load and run: the logits as stored
 * against the same file with every matrix decoded to f32 at load (moe_options dense_type and
 * expert_type F32: the decoder's exact values, f32 activations), routing pinned to the latter's;
 * the same logits bit for bit with the matrices left in the mapping (MOE_FLAG_NO_REPACK; where
 * no Q8_0 is interleaved) and with the experts read from the file by the expert cache */
static void test_gguf_kquants(void) {
    static const char *const mixes[5][2] = {{"--dense q4_k --experts q4_1", "q4_1"}, {"--dense q5_k --experts q5_1", "q5_1"}, {"--dense q6_k --experts q5_0", "q5_0"},
                                            {"--dense q3_k --experts q2_k", "iq4_nl"}, {"--dense iq4_xs --experts iq4_nl", "iq4_nl"}};
    int32_t ids[48];
    for (int i = 0; i < 48; i++) ids[i] = (int32_t)(urand() * 4096);
    for (int k = 0; k < 5; k++) {
        char out[600], err[300];
        tmp_path(out, sizeof out, "kq.gguf");
        CHECK(convert(shipped_dir(), out, mixes[k][0]) == 0);
        moe_options o = moe_default_options();
        o.n_threads = 2;
        moe_model *q = NULL, *f = NULL;
        CHECKF(moe_model_open(&q, out, &o, err, sizeof err) == MOE_OK, "%s", err);
        o.dense_type = MOE_WTYPE_F32, o.expert_type = MOE_WTYPE_F32;
        CHECKF(moe_model_open(&f, out, &o, err, sizeof err) == MOE_OK, "%s", err);
        if (q && f) {
            /* the format holding the most bytes: the experts' (with Q2_K experts their IQ4_NL down
             * rows of 128 values, with the dense matrices' fallbacks) */
            CHECKF(!strcmp(moe_model_get_info(q).weight_type, mixes[k][1]), "%s: weight type %s", mixes[k][0], moe_model_get_info(q).weight_type);
            const moe_config *c = moe_model_config(q);
            const size_t nv = (size_t)48 * c->vocab_size;
            int32_t *routes = malloc(sizeof(int32_t) * 48 * c->n_layers * c->n_active);
            float *lf = logits_routed(f, ids, 48, NULL, routes, NULL), *lq = logits_routed(q, ids, 48, NULL, NULL, routes);
            double spread = 0;
            for (size_t i = 0; i < nv; i++) spread += fabs(lf[i]);
            const double d = max_abs_diff(lf, lq, nv), m = mean_abs_diff(lf, lq, nv);
            printf("  %s: mean |logit| %.3g, against f32-decoded: max %.3g mean %.3g\n", mixes[k][0], spread / nv, d, m);
            CHECKF(m < 0.02 * spread / nv && d < 0.5, "%s: max %.3g mean %.3g", mixes[k][0], d, m);
            for (int v = 0; v < 2; v++) {
                moe_options ov = moe_default_options();
                ov.n_threads = 2;
                if (v == 0) ov.flags = MOE_FLAG_NO_REPACK;
                else ov.expert_mode = MOE_EXPERTS_CACHE, ov.expert_budget = 1 << 20;
                moe_model *mv = NULL;
                CHECKF(moe_model_open(&mv, out, &ov, err, sizeof err) == MOE_OK, "%s", err);
                float *lv = mv ? logits_routed(mv, ids, 48, NULL, NULL, routes) : NULL;
                /* (q6_k's Q8_0 fallbacks are interleaved when repacked: their kernels agree to
                 * float summation order, which int8 activations make up to one step) */
                const double lim = v == 0 && k == 2 ? 0.5 : 0;
                CHECKF(lv && max_abs_diff(lq, lv, nv) <= lim, "%s: %s differs", mixes[k][0], v ? "the expert cache" : "left mapped");
                free(lv), moe_model_close(mv);
            }
            free(routes), free(lf), free(lq);
        }
        moe_model_close(q), moe_model_close(f);
        if (k == 3) { /* the embedding's Q3_K made TQ1_0 (ternary; sized, not read): a clean refusal naming it */
            size_t len;
            char *b = read_all(out, &len);
            const char *nm = "token_embd.weight";
            char *at = NULL;
            for (size_t i = 0; b && !at && i + 17 < len; i++)
                if (!memcmp(b + i, nm, 17)) at = b + i;
            if (at) {
                uint32_t nd, type;
                memcpy(&nd, at + 17, 4);
                char *tp = at + 17 + 4 + 8 * (size_t)nd;
                memcpy(&type, tp, 4);
                CHECK(nd == 2 && type == 11); /* Q3_K */
                type = 34;
                memcpy(tp, &type, 4);
                write_all(out, b, len);
                moe_model *bad = NULL;
                const moe_status st = moe_model_open(&bad, out, NULL, err, sizeof err);
                CHECKF(st == MOE_ERR_UNSUPPORTED && strstr(err, "token_embd") && strstr(err, "IQ4_XS"), "%d: %s", st, err);
                if (!st) moe_model_close(bad);
            }
            CHECK(at != NULL);
            free(b);
        }
        remove(out);
    }
}

/* GGUF files with routed experts (and, once, dense matrices) in the grid formats, written by
 * moe-convert --random as random blocks: mapped and through the expert cache give the same
 * logits; against the same file decoded to F32 at load (routes pinned) they differ only by the
 * int8 activations; the scalar kernels agree with the level's to summation order (which can move
 * an activation across an int8 step, and that step carries on through the layers and tokens:
 * with every dense matrix IQ3_XXS, 1% of the mean logit on average, against 100% for a wrong
 * kernel). */
static void test_gguf_iq(void) {
    char shape[600], out[600], err[300];
    tmp_path(shape, sizeof shape, "iq-shape.json");
    tmp_path(out, sizeof out, "iq-random.gguf");
    CHECK(write_small_shape(shape, 512));
    int32_t ids[20];
    for (int i = 0; i < 20; i++) ids[i] = (int32_t)(urand() * 512);
    const int pieces[] = {12, 1, 1, 1, 1, 1, 1, 1, 1, 0};
    const size_t nv = (size_t)20 * 512;
    for (int t = 0; t <= N_IQ; t++) {
        char model[700], args[100];
        snprintf(model, sizeof model, "--random %s", shape);
        if (t < N_IQ) snprintf(args, sizeof args, "--dense q8_0 --experts %s", iq_names[t]);
        else snprintf(args, sizeof args, "--dense iq3_xxs --experts iq2_s");
        if (convert(model, out, args)) { CHECKF(0, "%s: convert", args); continue; }
        moe_model *m[4] = {NULL, NULL, NULL, NULL};
        for (int v = 0; v < 4; v++) { /* mapped; cached; decoded to F32 at load; scalar kernels */
            moe_options o = moe_default_options();
            o.n_threads = 2;
            if (v == 1) o.expert_mode = MOE_EXPERTS_CACHE, o.expert_budget = 1 << 20;
            if (v == 2) o.dense_type = MOE_WTYPE_F32, o.expert_type = MOE_WTYPE_F32;
            if (v == 3) o.flags = MOE_FLAG_FORCE_SCALAR;
            CHECKF(moe_model_open(&m[v], out, &o, err, sizeof err) == MOE_OK, "%s: %s", args, err);
        }
        if (m[0] && m[1] && m[2] && m[3]) {
            const moe_config *c = moe_model_config(m[0]);
            int32_t *routes = malloc(sizeof(int32_t) * 20 * c->n_layers * c->n_active);
            float *l0 = logits_routed(m[0], ids, 20, pieces, routes, NULL), *l1 = logits_in_pieces(m[1], ids, 20, pieces);
            float *lf = logits_routed(m[2], ids, 20, pieces, NULL, routes), *ls = logits_routed(m[3], ids, 20, pieces, NULL, routes);
            double spread = 0;
            for (size_t i = 0; i < nv; i++) spread += fabs(lf[i]);
            const double dc = max_abs_diff(l0, l1, nv), df = max_abs_diff(l0, lf, nv), mf = mean_abs_diff(l0, lf, nv);
            const double ds = max_abs_diff(l0, ls, nv), ms = mean_abs_diff(l0, ls, nv), mean = spread / nv;
            printf("  %s: mean |logit| %.3g; cache %.3g, f32-decoded max %.3g mean %.3g, scalar max %.3g mean %.3g\n", args, mean, dc, df, mf, ds, ms);
            CHECKF(dc == 0, "%s: the expert cache differs by %.3g", args, dc);
            CHECKF(mf < 0.04 * mean && df < 0.25 * mean, "%s: against f32-decoded max %.3g mean %.3g", args, df, mf);
            CHECKF(ms < 0.02 * mean && ds < 0.15 * mean, "%s: the scalar kernels differ by max %.3g mean %.3g", args, ds, ms);
            free(routes), free(l0), free(l1), free(lf), free(ls);
        }
        for (int v = 0; v < 4; v++) moe_model_close(m[v]);
        remove(out);
    }
    remove(shape);
}

/* a GGUF split into parts (moe-convert --split-max-size: llama.cpp's names and split keys) opens
 * from any part's path, in both expert modes, and passes the golden checks; an interrupted split
 * conversion resumes to the same bytes; a missing, misnamed or inconsistent part is a clean error */
static void split_part(char *out, size_t n, const char *prefix, int k, int parts) {
    snprintf(out, n, "%s-%05d-of-%05d.gguf", prefix, k, parts);
}

static int split_parts(const char *prefix) { /* how many parts were written (0: none) */
    char path[700];
    struct stat sb;
    for (int n = 2; n < 1000; n++) {
        split_part(path, sizeof path, prefix, 1, n);
        if (stat(path, &sb) == 0) return n;
    }
    return 0;
}

static void remove_split(const char *prefix, int parts) {
    char path[700];
    for (int k = 1; k <= parts; k++) split_part(path, sizeof path, prefix, k, parts), remove(path);
}

static void test_gguf_split(void) {
    char dir[600], out[600], prefix[600], first[700], mid[700], other[700], err[400];
    snprintf(dir, sizeof dir, "%s/k3mx", golden_dir());
    snprintf(out, sizeof out, "%s/sp.gguf", tmp_root);
    snprintf(prefix, sizeof prefix, "%s/sp", tmp_root);
    CHECK(convert(dir, out, "--dense f32 --split-max-size 256K") == 0);
    const int parts = split_parts(prefix);
    CHECKF(parts >= 4, "%d parts", parts);
    if (parts < 4) return;
    split_part(first, sizeof first, prefix, 1, parts);
    split_part(mid, sizeof mid, prefix, parts / 2, parts);
    run_golden_path("k3mx", first, 0, 1);
    /* from a middle part's path, and streamed through the expert cache: the same logits */
    moe_options oc = moe_default_options();
    oc.expert_mode = MOE_EXPERTS_CACHE, oc.expert_budget = 1 << 20;
    /* and with the metadata alone in the first part (gguf-split --no-tensor-first-split) */
    char outm[600], prefixm[600], firstm[700];
    snprintf(outm, sizeof outm, "%s/sm.gguf", tmp_root);
    snprintf(prefixm, sizeof prefixm, "%s/sm", tmp_root);
    CHECK(convert(dir, outm, "--dense f32 --no-tensor-first-split") == 0);
    CHECK(split_parts(prefixm) == 2);
    split_part(firstm, sizeof firstm, prefixm, 1, 2);
    moe_model *m[4] = {open_path(first, 0, 1), open_path(mid, 0, 1), NULL, open_path(firstm, 0, 1)};
    CHECK(moe_model_open(&m[2], mid, &oc, NULL, 0) == MOE_OK);
    int n;
    int32_t *ids = golden_ids("k3mx", 2, &n);
    if (m[0] && m[1] && m[2] && m[3] && ids) {
        CHECK(moe_model_get_info(m[1]).n_files == parts);
        const size_t nv = (size_t)n * moe_model_config(m[0])->vocab_size;
        float *x[4];
        for (int i = 0; i < 4; i++) x[i] = logits_in_pieces(m[i], ids, n, NULL);
        CHECK(max_abs_diff(x[0], x[1], nv) == 0);
        CHECKF(max_abs_diff(x[0], x[2], nv) == 0, "cache mode: %.3g", max_abs_diff(x[0], x[2], nv));
        CHECK(max_abs_diff(x[0], x[3], nv) == 0);
        for (int i = 0; i < 4; i++) free(x[i]);
    }
    free(ids);
    for (int i = 0; i < 4; i++) moe_model_close(m[i]);
    remove_split(prefixm, 2);
    /* interrupted after 40 tensors, then resumed: every part the same bytes */
    char out2[600], prefix2[600];
    snprintf(out2, sizeof out2, "%s/sq.gguf", tmp_root);
    snprintf(prefix2, sizeof prefix2, "%s/sq", tmp_root);
    setenv("MOE_CONVERT_STOP_AFTER", "40", 1);
    CHECK(convert_expect(dir, out2, "--dense f32 --split-max-size 256K", 3) == 3);
    unsetenv("MOE_CONVERT_STOP_AFTER");
    CHECK(split_parts(prefix2) == 0); /* nothing renamed before the end */
    CHECK(convert(dir, out2, "--dense f32 --split-max-size 256K") == 0);
    CHECK(split_parts(prefix2) == parts);
    for (int k = 1; k <= parts; k++) {
        size_t la, lb;
        split_part(other, sizeof other, prefix, k, parts);
        char *fa = read_all(other, &la);
        split_part(other, sizeof other, prefix2, k, parts);
        char *fb = read_all(other, &lb);
        CHECKF(fa && fb && la == lb && !memcmp(fa, fb, la), "part %d differs after the resume", k);
        free(fa), free(fb);
    }
    remove_split(prefix2, parts);
    /* a missing part: an error naming it */
    char moved[720];
    split_part(other, sizeof other, prefix, 3, parts);
    snprintf(moved, sizeof moved, "%s.away", other);
    CHECK(rename(other, moved) == 0);
    CHECK(open_dir(first, err, sizeof err) != MOE_OK && strstr(err, other));
    CHECK(rename(moved, other) == 0);
    /* a part under another part's name: its split.no says so */
    char second[700];
    split_part(second, sizeof second, prefix, 2, parts);
    CHECK(rename(second, moved) == 0 && rename(other, second) == 0 && rename(moved, other) == 0);
    CHECKF(open_dir(first, err, sizeof err) == MOE_ERR_FORMAT && strstr(err, "split.no"), "%s", err);
    CHECK(rename(second, moved) == 0 && rename(other, second) == 0 && rename(moved, other) == 0);
    /* the first part copied under a name of another part count */
    char *f1;
    size_t l1;
    CHECK((f1 = read_all(first, &l1)) != NULL);
    snprintf(other, sizeof other, "%s/sx-00001-of-00099.gguf", tmp_root);
    CHECK(f1 && write_all(other, f1, l1));
    CHECKF(open_dir(other, err, sizeof err) == MOE_ERR_FORMAT && strstr(err, "not named"), "%s", err);
    remove(other);
    /* split.tensors.count one off */
    char *k = NULL;
    for (size_t i = 0; f1 && !k && i + 19 + 8 <= l1; i++)
        if (!memcmp(f1 + i, "split.tensors.count", 19)) k = f1 + i;
    CHECK(k != NULL);
    if (k) {
        int32_t v;
        memcpy(&v, k + 19 + 4, 4), v++, memcpy(k + 19 + 4, &v, 4);
        CHECK(write_all(first, f1, l1));
        CHECKF(open_dir(mid, err, sizeof err) == MOE_ERR_FORMAT && strstr(err, "split.tensors.count"), "%s", err);
    }
    free(f1);
    remove_split(prefix, parts);
}

/* moe-convert --k3-slice writes the released K3 layout from a shape file: a tiny one loads, runs,
 * and gives the same tokens through the expert cache */
static void test_k3_slice(void) {
    char dir[600];
    if (!make_k3_slice("k3slice", 8, 32, 32, dir, sizeof dir)) return;
    char err[512];
    moe_model *m = NULL;
    CHECKF(moe_model_open(&m, dir, NULL, err, sizeof err) == MOE_OK, "%s", err);
    if (!m) return;
    const moe_config *c = moe_model_config(m);
    CHECK(c->n_layers == 3 && c->layer_kind[2] == MOE_LAYER_MLA && c->n_experts == 8 && c->latent_dim == 32 && c->attn_res_block == 2);
    moe_model_info info = moe_model_get_info(m);
    CHECK(info.n_files == 4 && info.expert_bytes == 2ull * 8 * 3 * (32 * 16 + 32)); /* 2 MoE layers x 8 experts x 3 x (packed + scales) */
    int32_t ids[6] = {1, 2, 3, 4, 5, 299};
    float *a = logits_in_pieces(m, ids, 6, NULL);
    moe_model_close(m);
    moe_options o = moe_default_options();
    o.expert_mode = MOE_EXPERTS_CACHE, o.expert_budget = 2 * 3 * (32 * 16 + 32);
    CHECK(moe_model_open(&m, dir, &o, err, sizeof err) == MOE_OK);
    float *b = m ? logits_in_pieces(m, ids, 6, NULL) : NULL;
    CHECK(a && b && max_abs_diff(a, b, 6 * 300) == 0);
    for (int i = 0; a && i < 6 * 300; i++) CHECK(isfinite(a[i]));
    free(a), free(b);
    moe_model_close(m);
}

/* A K3 GGUF made by llama.cpp's own converter (test/llama/k3mx.gguf: the golden k3mx case through
 * convert_hf_to_gguf.py of llama.cpp's Kimi-K3 support, test/llama/README.md): its keys and names
 * (fused AttnRes scores, ssm_g, ffn_routed_*, -exp(A_log) cut to attention.head_count entries,
 * split kv_b, MXFP4 experts in ggml's blocks) bound as llama.cpp's loader reads them. The
 * converter drops the case's expert groups (num_expert_group 4, topk_group 2; K3 itself routes
 * without groups), so the file routes without them, as llama.cpp does; with the routing pinned to
 * the golden one, every prompt's logits are the golden ones within the case's tolerance. */
static void test_llama_k3(void) {
    golden g;
    if (!golden_load(&g, "k3mx")) return;
    moe_model *m = open_path("test/llama/k3mx.gguf", 0, 2);
    if (!m) { golden_free(&g); return; }
    const moe_config *c = moe_model_config(m);
    CHECKF(c->n_groups == 1 && c->topk_groups == 1, "groups %d, top-k groups %d", c->n_groups, c->topk_groups);
    CHECK(c->kda_heads == 3 && c->mla_heads == 4 && c->latent_dim == 64 && c->attn_res_block == 3 && c->kda_full_rank_gate);
    const int V = c->vocab_size, L = c->n_layers, K = c->n_active;
    int pinned_prompts = 0;
    for (const moe__json *p = moe__json_get(g.cases, "prompts")->child; p; p = p->next) {
        int32_t *ids;
        const int n = ids_of(moe__json_get(p, "ids"), &ids);
        const char *pname = moe__json_get(p, "name")->str;
        char key[128];
        snprintf(key, sizeof key, "%s.logits", pname);
        const moe__st_tensor *want = moe__st_find(&g.ref, key);
        int32_t *force = malloc(sizeof(int32_t) * (size_t)n * L * K);
        int have = want && force;
        for (int l = 0; have && l < L; l++) {
            snprintf(key, sizeof key, "%s.route.%d.ids", pname, l);
            const moe__st_tensor *rt = moe__st_find(&g.ref, key);
            for (int t = 0; t < n; t++)
                for (int k = 0; k < K; k++) force[((size_t)t * L + l) * K + k] = rt ? ((const int32_t *)rt->data)[(size_t)t * K + k] : -1;
        }
        CHECK(have);
        float *logits = have ? logits_routed(m, ids, n, NULL, NULL, force) : NULL;
        CHECK(logits != NULL);
        if (logits) {
            const double md = max_abs_diff(logits, want->data, (size_t)n * V);
            CHECKF(md <= g.tol, "%s: max |dlogit| %.3g > %.3g with the golden routing", pname, md, g.tol);
            if (getenv("MOE_TEST_VERBOSE")) fprintf(stderr, "  llama.cpp's k3mx %s (%d tokens): max|d| %.2g\n", pname, n, md);
            pinned_prompts++;
        }
        free(logits), free(force), free(ids);
    }
    CHECK(pinned_prompts == 4);
    moe_model_close(m);
    golden_free(&g);
}

/* ids of text by two tokenizers, compared; 1 when equal (with and without special names) */
static int same_ids(const moe_tokenizer *a, const moe_tokenizer *b, const char *text, size_t len) {
    int32_t *ia = malloc((len + 1) * sizeof *ia), *ib = malloc((len + 1) * sizeof *ib);
    int same = ia && ib;
    char err[300];
    for (unsigned flags = 0; same && flags <= MOE_TOK_SPECIAL; flags += MOE_TOK_SPECIAL) {
        size_t na = 0, nb = 0;
        same = moe_tokenize(a, text, len, flags, ia, len + 1, &na, err, sizeof err) == MOE_OK &&
               moe_tokenize(b, text, len, flags, ib, len + 1, &nb, err, sizeof err) == MOE_OK && na == nb && !memcmp(ia, ib, na * sizeof *ia);
    }
    free(ia), free(ib);
    return same;
}

/* the vocabulary llama.cpp's converter writes for the shipped model (test/llama/README.md): the
 * same ids as the model's tiktoken file on the tokenizer corpus and README.md, the same specials,
 * K3's chat format, the configured end of message as eos; a file without a vocabulary is named so */
static void test_llama_k3_vocab(void) {
    char err[400];
    moe_tokenizer *g = NULL, *d = NULL;
    CHECKF(moe_tokenizer_from_gguf(&g, "test/llama/kimi-k3-tiny-vocab.gguf", err, sizeof err) == MOE_OK, "%s", err);
    moe_model *m = open_path(shipped_dir(), 0, 1);
    CHECK(m && moe_tokenizer_for_model(&d, m, err, sizeof err) == MOE_OK);
    if (g && d) {
        CHECKF(moe_tokenizer_n_ids(g) == moe_tokenizer_n_ids(d), "%d ids, the tiktoken file %d", moe_tokenizer_n_ids(g), moe_tokenizer_n_ids(d));
        int differ = 0;
        for (int32_t id = 0; id < moe_tokenizer_n_ids(d); id++) {
            size_t la = 0, lb = 0;
            const char *a = moe_token_bytes(g, id, &la), *b = moe_token_bytes(d, id, &lb);
            differ += !a != !b || la != lb || (a && memcmp(a, b, la)) || moe_token_is_special(g, id) != moe_token_is_special(d, id);
        }
        CHECKF(!differ, "%d ids with other bytes", differ);
        const char *texts[] = {"test/tokenizer/corpus.txt", "README.md"};
        for (int i = 0; i < 2; i++) {
            size_t len = 0;
            char *text = read_all(texts[i], &len);
            CHECKF(text && same_ids(g, d, text, len), "%s", texts[i]);
            free(text);
        }
        CHECK(moe_chat_format_of(g) == MOE_CHAT_K3);
        const char *req = "{\"messages\": [{\"role\": \"user\", \"content\": \"What is 2+2?\"}]}";
        int32_t a[256], b[256];
        size_t na = 0, nb = 0;
        moe_chat_options o = moe_chat_default_options();
        CHECK(moe_chat_encode(g, req, strlen(req), &o, a, 256, &na, err, sizeof err) == MOE_OK);
        CHECK(moe_chat_encode(d, req, strlen(req), &o, b, 256, &nb, err, sizeof err) == MOE_OK && na == nb && !memcmp(a, b, na * sizeof *a));
    }
    moe__st_file f;
    if (moe__gguf_open(&f, "test/llama/kimi-k3-tiny-vocab.gguf", err, sizeof err) == MOE_OK) {
        const moe__gguf_kv *eos = moe__gguf_get(&f, "tokenizer.ggml.eos_token_id");
        uint32_t e = 0;
        if (eos && eos->type == MOE_GGUF_U32) memcpy(&e, eos->data, 4);
        CHECKF(d && (int32_t)e == moe_token_id(d, "<|end_of_msg|>"), "eos %u", e);
        moe__st_close(&f);
    }
    moe_tokenizer_free(g), moe_tokenizer_free(d);
    moe_model_close(m);
    g = NULL;
    CHECK(moe_tokenizer_from_gguf(&g, "test/llama/k3mx.gguf", err, sizeof err) == MOE_ERR_FORMAT && !g && strstr(err, "no vocabulary"));
}

/* A kimi-k3 GGUF in the names moe-convert wrote before it took llama.cpp's (test/moe-v0/README.md)
 * still opens, and gives bit for bit the logits of the same case converted by today's moe-convert */
static void test_k3_earlier_names(void) {
    char now[600], dir[600];
    tmp_path(now, sizeof now, "k3mx-q4_0-now.gguf");
    snprintf(dir, sizeof dir, "%s/k3mx", golden_dir());
    CHECK(convert(dir, now, "--dense q4_0") == 0);
    moe_model *a = open_path("test/moe-v0/k3mx-q4_0.gguf", 0, 2), *b = open_path(now, 0, 2);
    int n = 0;
    int32_t *ids = golden_ids("k3mx", 3, &n);
    if (a && b && ids) {
        const int V = moe_model_config(a)->vocab_size;
        float *la = logits_routed(a, ids, n, NULL, NULL, NULL), *lb = logits_routed(b, ids, n, NULL, NULL, NULL);
        CHECK(la && lb && !memcmp(la, lb, sizeof(float) * (size_t)n * V));
        free(la), free(lb);
    }
    CHECK(a && b && ids);
    free(ids);
    moe_model_close(a), moe_model_close(b);
}

const test_case gguf_tests[] = {
    {"gguf.json", test_json, "the strict JSON parser: valid, invalid and hostile texts", 0},
    {"gguf.vocab", test_shipped_gguf_vocab, "the shipped model as GGUF carries its vocabulary: same ids and text", 0},
    {"gguf.model_info", test_model_info, "moe_model_info's counts and names for each golden case", 0},
    {"gguf.golden", test_gguf_golden, "golden checkpoints converted to GGUF pass the golden checks", 0},
    {"gguf.quant_resume", test_gguf_quant_resume, "quantized GGUF files run; an interrupted conversion resumes", 0},
    {"gguf.split", test_gguf_split, "split GGUF files (llama.cpp naming) load as one", 0},
    {"gguf.iq", test_gguf_iq, "grid-format GGUF files: mapped, cached and decoded to F32 agree", 0},
    {"gguf.kquants", test_gguf_kquants, "k-quant GGUF files load and run against their F32 decode", 0},
    {"gguf.k3_slice", test_k3_slice, "moe-convert --k3-slice writes a K3 layout that loads and runs", 0},
    {"gguf.k3_earlier_names", test_k3_earlier_names, "a K3 GGUF in moe's earlier names gives today's logits bit for bit", 0},
    {"gguf.llama_k3_vocab", test_llama_k3_vocab, "llama.cpp's K3 vocabulary: the tiktoken file's ids, specials and chat format", 0},
    {"gguf.llama_k3", test_llama_k3, "llama.cpp's own K3 GGUF of the k3mx case: its names and keys, golden logits", 0},
    {0}
};
