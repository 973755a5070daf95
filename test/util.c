/* util.c - helpers more than one test area uses: random numbers, temporary files, the golden
 * cases (loading, running, comparing), opening models, running the example programs, converting
 * checkpoints, batch files. Declared in test/test.h. */
#include "test.h"

const char *golden_dir(void) {
    const char *d = getenv("MOE_GOLDEN");
    return d ? d : "test/golden";
}

uint64_t rng_state = 88172645463325252ull;

double urand(void) { /* [0, 1) */
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) / 9007199254740992.0;
}

float nrand(void) { /* roughly normal */
    return (float)((urand() + urand() + urand() + urand() - 2.0) * 1.7320508);
}

char tmp_root[256];

void tmp_path(char *out, size_t n, const char *name) { snprintf(out, n, "%s/%s", tmp_root, name); }

char *read_all(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) { free(b); b = NULL; }
    fclose(f);
    if (b) b[n] = 0, *len = (size_t)n;
    return b;
}

int write_all(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return 0;
    int ok = fwrite(p, 1, n, f) == n;
    return fclose(f) == 0 && ok;
}

const char *const iq_names[N_IQ] = {"iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m"};

int golden_load(golden *g, const char *name) {
    char path[600], err[256];
    size_t len;
    snprintf(path, sizeof path, "%s/%s/cases.json", golden_dir(), name);
    char *text = read_all(path, &len);
    CHECKF(text != NULL, "cannot read %s", path);
    if (!text) return 0;
    moe_status st = moe__json_parse(text, len, &g->cases, err, sizeof err);
    free(text);
    CHECKF(st == MOE_OK, "%s", err);
    if (st) return 0;
    snprintf(path, sizeof path, "%s/%s/logits.safetensors", golden_dir(), name);
    st = moe__st_open(&g->ref, path, err, sizeof err);
    CHECKF(st == MOE_OK, "%s", err);
    if (st) { moe__json_free(g->cases); return 0; }
    g->tol = moe__json_get(moe__json_get(g->cases, "recommended_tolerance"), "logits_max_abs")->num;
    return 1;
}

void golden_free(golden *g) {
    moe__json_free(g->cases);
    moe__st_close(&g->ref);
}

int ids_of(const moe__json *arr, int32_t **out) {
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(arr->n ? arr->n : 1));
    int n = 0;
    for (const moe__json *e = arr->child; e; e = e->next) ids[n++] = (int32_t)e->num;
    *out = ids;
    return n;
}

int argmax(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

double max_abs_diff(const float *a, const float *b, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (!(d <= m)) m = d; /* NaN propagates as failure */
    }
    return m;
}

/* mean over n rows of V logits of KL(softmax(ref row) || softmax(test row)), in nats */
double mean_kl(const float *ref, const float *test, int n, int V) {
    double kl = 0;
    for (int t = 0; t < n; t++) {
        const float *a = ref + (size_t)t * V, *b = test + (size_t)t * V;
        double ma = a[0], mb = b[0], za = 0, zb = 0;
        for (int i = 1; i < V; i++) ma = a[i] > ma ? a[i] : ma, mb = b[i] > mb ? b[i] : mb;
        for (int i = 0; i < V; i++) za += exp(a[i] - ma), zb += exp(b[i] - mb);
        for (int i = 0; i < V; i++) {
            const double la = a[i] - ma - log(za), lb = b[i] - mb - log(zb);
            kl += exp(la) * (la - lb);
        }
    }
    return kl / n;
}

moe_options *golden_opts; /* run_golden_path_cache's options; NULL: defaults */

moe_model *open_path(const char *path, unsigned flags, int threads) {
    char err[512];
    moe_options o = golden_opts ? *golden_opts : moe_default_options();
    o.flags = flags;
    o.n_threads = threads;
    moe_model *m = NULL;
    moe_status st = moe_model_open(&m, path, &o, err, sizeof err);
    CHECKF(st == MOE_OK, "open %s: %s", path, err);
    return m;
}

moe_model *open_model(const char *sub, unsigned flags, int threads) {
    char path[600];
    snprintf(path, sizeof path, "%s/%s", golden_dir(), sub);
    return open_path(path, flags, threads);
}

/* every prompt: all prefill rows, argmax, routing, 16 greedy tokens and their logit rows;
 * model_path: the case's directory, or another file holding the same model (GGUF) */
void run_golden_path(const char *name, const char *model_path, unsigned flags, int threads) {
    golden g;
    if (!golden_load(&g, name)) return;
    moe_model *m = model_path ? open_path(model_path, flags, threads) : open_model(name, flags, threads);
    if (!m) { golden_free(&g); return; }
    const moe_config *c = moe_model_config(m);
    const int V = c->vocab_size, L = c->n_layers, K = c->n_active;
    const moe__json *prompts = moe__json_get(g.cases, "prompts");
    for (const moe__json *p = prompts->child; p; p = p->next) {
        int32_t *ids, *greedy;
        int n = ids_of(moe__json_get(p, "ids"), &ids), ng = ids_of(moe__json_get(p, "greedy"), &greedy);
        const char *pname = moe__json_get(p, "name")->str;
        char key[128];
        snprintf(key, sizeof key, "%s.logits", pname);
        const moe__st_tensor *want = moe__st_find(&g.ref, key);
        snprintf(key, sizeof key, "%s.greedy_logits", pname);
        const moe__st_tensor *gwant = moe__st_find(&g.ref, key);
        CHECK(want && gwant && want->shape[0] == n && want->shape[1] == V);
        moe_session *s = NULL;
        CHECK(moe_session_new(&s, m, n + ng, NULL, 0) == MOE_OK);
        float *logits = malloc(sizeof(float) * (size_t)V * (size_t)n);
        int32_t *routes = malloc(sizeof(int32_t) * (size_t)n * L * (K ? K : 1));
        moe_seq q = {.s = s, .tokens = ids, .n = n, .logits = logits, .logits_all = 1, .routes = K ? routes : NULL};
        char err[256];
        CHECKF(moe_step(m, &q, 1, NULL, err, sizeof err) == MOE_OK, "%s", err);
        const float *wl = want->data;
        double md = max_abs_diff(logits, wl, (size_t)n * V);
        CHECKF(md <= g.tol, "%s %s: max |dlogit| %.3g > %.3g", name, pname, md, g.tol);
        int amiss = 0;
        for (int t = 0; t < n; t++) amiss += argmax(logits + (size_t)t * V, V) != argmax(wl + (size_t)t * V, V);
        CHECKF(amiss == 0, "%s %s: argmax differs at %d rows", name, pname, amiss);
        /* routing ids, except the positions listed as fragile */
        const moe__json *fragile = moe__json_get(p, "fragile_routing_below_1e-5");
        int rmiss = 0, rchecked = 0;
        for (int l = 0; K && l < L; l++) {
            snprintf(key, sizeof key, "%s.route.%d.ids", pname, l);
            const moe__st_tensor *rt = moe__st_find(&g.ref, key);
            if (!c->layer_moe[l]) { CHECK(rt == NULL && routes[l * K] == -1); continue; }
            CHECK(rt != NULL);
            if (!rt) continue;
            for (int t = 0; t < n; t++) {
                int is_fragile = 0;
                for (const moe__json *f = fragile ? fragile->child : NULL; f; f = f->next)
                    is_fragile |= (int)f->child->num == t && (int)f->child->next->num == l;
                if (is_fragile) continue;
                rchecked++;
                rmiss += memcmp(routes + ((size_t)t * L + l) * K, (const int32_t *)rt->data + (size_t)t * K, sizeof(int32_t) * K) != 0;
            }
        }
        CHECKF(rmiss == 0, "%s %s: routing differs in %d of %d (token, layer) pairs", name, pname, rmiss, rchecked);
        /* greedy continuation with the caches */
        const float *gl = gwant->data;
        float *row = logits + (size_t)(n - 1) * V;
        double gmd = 0;
        int gmiss = 0;
        for (int j = 0; j < ng; j++) {
            double dd = max_abs_diff(row, gl + (size_t)j * V, (size_t)V);
            if (dd > gmd) gmd = dd;
            int32_t tok = argmax(row, V);
            gmiss += tok != greedy[j];
            if (j + 1 == ng) break;
            moe_seq d = {.s = s, .tokens = &greedy[j], .n = 1, .logits = logits};
            CHECKF(moe_step(m, &d, 1, NULL, err, sizeof err) == MOE_OK, "%s", err);
            row = logits;
        }
        CHECKF(gmiss == 0, "%s %s: %d greedy tokens differ", name, pname, gmiss);
        CHECKF(gmd <= g.tol, "%s %s: greedy rows max |dlogit| %.3g", name, pname, gmd);
        if (getenv("MOE_TEST_VERBOSE"))
            fprintf(stderr, "  %s %s (%d tokens): max|d| %.2g, greedy rows %.2g, routing %d checked\n", name, pname, n, md, gmd, rchecked);
        free(logits), free(routes), free(ids), free(greedy);
        moe_session_free(s);
    }
    moe_model_close(m);
    golden_free(&g);
}

void run_golden(const char *name, unsigned flags, int threads) { run_golden_path(name, NULL, flags, threads); }

/* Token ids of golden prompt `pi` followed by its greedy continuation. Those ids were drawn so
 * that no routing decision is within 1e-5 of a tie (cases.json), so two float32 computations
 * that differ only in rounding (chunked vs recurrent, batched vs alone) route identically; on
 * random ids a near-tie can flip an expert and move the logits by whole units. */
int32_t *golden_ids(const char *name, int pi, int *n) {
    golden g;
    *n = 0;
    if (!golden_load(&g, name)) return NULL;
    const moe__json *p = moe__json_get(g.cases, "prompts")->child;
    for (int i = 0; i < pi && p; i++) p = p->next;
    int32_t *a, *b;
    int na = ids_of(moe__json_get(p, "ids"), &a), nb = ids_of(moe__json_get(p, "greedy"), &b);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(na + nb));
    memcpy(ids, a, sizeof(int32_t) * (size_t)na);
    memcpy(ids + na, b, sizeof(int32_t) * (size_t)nb);
    free(a), free(b);
    golden_free(&g);
    *n = na + nb;
    return ids;
}

/* logits of every position, fed in the given piece sizes (0-terminated list; rest in one piece) */
/* logits of every position, fed in pieces (0-terminated; NULL: all at once), recording or
 * forcing the routing (either may be NULL) */
float *logits_routed(moe_model *m, const int32_t *ids, int n, const int *pieces, int32_t *routes, const int32_t *force) {
    const moe_config *c = moe_model_config(m);
    const size_t V = (size_t)c->vocab_size, rpt = (size_t)c->n_layers * c->n_active;
    moe_session *s;
    if (moe_session_new(&s, m, n, NULL, 0)) return NULL;
    float *all = malloc(sizeof(float) * V * n);
    for (int done = 0, i = 0; done < n; i++) {
        const int take = pieces && pieces[i] ? pieces[i] : n - done;
        moe_seq q = {.s = s, .tokens = ids + done, .n = take, .logits = all + (size_t)done * V, .logits_all = 1,
                     .routes = routes ? routes + (size_t)done * rpt : NULL, .force_routes = force ? force + (size_t)done * rpt : NULL};
        char err[256];
        CHECKF(moe_step(m, &q, 1, NULL, err, sizeof err) == MOE_OK, "%s", err);
        done += take;
    }
    moe_session_free(s);
    return all;
}

float *logits_in_pieces(moe_model *m, const int32_t *ids, int n, const int *pieces) {
    return logits_routed(m, ids, n, pieces, NULL, NULL);
}

/* opens and closes a model (a directory or a file): the status, and the message in err */
moe_status open_dir(const char *dir, char *err, size_t errlen) {
    moe_model *m = NULL;
    moe_status st = moe_model_open(&m, dir, NULL, err, errlen);
    moe_model_close(m);
    return st;
}

char exe_dir[512] = ".";

/* runs a shell command (prefixed with $MOE_TEST_RUNNER, e.g. qemu for a cross-built suite) */
int run_cmd(const char *cmd0, char *out, size_t outlen) {
    char cmd[4200];
    const char *runner = getenv("MOE_TEST_RUNNER");
    snprintf(cmd, sizeof cmd, "%s%s%s", runner ? runner : "", runner ? " " : "", cmd0);
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    size_t n = 0, r;
    while (n + 1 < outlen && (r = fread(out + n, 1, outlen - 1 - n, p)) > 0) n += r;
    out[n] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

const char *tok_dir(void) {
    const char *d = getenv("MOE_TOKENIZER_DATA");
    return d ? d : "test/tokenizer";
}

/* n completion requests with token-id prompts (the golden models ship no tokenizer), plus the
 * given extra lines */
void write_batch_input(const char *path, int n, const char *extra) {
    FILE *f = fopen(path, "w");
    for (int i = 0; i < n; i++)
        fprintf(f, "{\"custom_id\": \"req-%d\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [467, 83, 739, %d, 546, 1030, 1074], "
                   "\"max_tokens\": %d, \"temperature\": %s, \"seed\": %d}}\n", i, i ? 10 + i : 806, 4 + i % 9, i % 3 ? "0.8" : "0", i);
    if (extra) fputs(extra, f);
    fclose(f);
}

/* checks OUT: every line whole JSON, keys (custom_id or input_line) unique; returns the number of
 * lines, or -1 when a check fails; the answer to want_id goes to text when asked */
int check_batch_output(const char *path, const char *want_id, char *text, size_t tn) {
    size_t len = 0;
    char *all = read_all(path, &len);
    if (!all) return 0;
    int n = 0, bad = 0;
    char seen[256][48];
    for (char *p = all; *p;) {
        char *e = strchr(p, '\n');
        if (!e) { fprintf(stderr, "  %s: torn last line\n", path); bad = 1; break; }
        moe__json *j = NULL;
        if (moe__json_parse(p, (size_t)(e - p), &j, NULL, 0) != MOE_OK) { fprintf(stderr, "  %s: line %d is not JSON\n", path, n + 1); bad = 1; }
        else {
            const moe__json *cid = moe__json_get(j, "custom_id"), *ln = moe__json_get(j, "input_line");
            char key[48];
            snprintf(key, sizeof key, "%s", cid && cid->type == MOE_JSON_STR ? cid->str : "");
            if (ln) snprintf(key, sizeof key, "#%d", (int)ln->num);
            for (int i = 0; i < n && i < 256; i++)
                if (!strcmp(seen[i], key)) { fprintf(stderr, "  %s: %s answered twice\n", path, key); bad = 1; }
            if (n < 256) snprintf(seen[n], sizeof seen[n], "%s", key);
            if (want_id && !strcmp(key, want_id) && text) {
                const moe__json *r = moe__json_get(j, "response"), *b = r ? moe__json_get(r, "body") : NULL, *c = b ? moe__json_get(b, "choices") : NULL;
                const moe__json *t = c && c->child ? moe__json_get(c->child, "text") : NULL;
                snprintf(text, tn, "%s", t && t->type == MOE_JSON_STR ? t->str : "?");
            }
        }
        moe__json_free(j);
        n++;
        p = e + 1;
    }
    free(all);
    return bad ? -1 : n;
}

const char *shipped_dir(void) {
    const char *d = getenv("MOE_SHIPPED_MODEL");
    return d ? d : "models/kimi-k3-tiny";
}

/* runs moe-convert; prints its output when the exit status is not the expected one */
int convert_expect(const char *model, const char *out, const char *args, int expect) {
    char cmd[2400], buf[4096];
    snprintf(cmd, sizeof cmd, "%s/moe-convert %s %s %s 2>&1", exe_dir, model, out, args);
    int rc = run_cmd(cmd, buf, sizeof buf);
    if (rc != expect) fprintf(stderr, "  %s -> %d: %s\n", cmd, rc, buf);
    return rc;
}

int convert(const char *model, const char *out, const char *args) { return convert_expect(model, out, args, 0); }

/* a random-model shape for moe-convert --random: 3 layers (one MLA), hidden size 256, 8 experts
 * of n_ff_exp; returns whether it was written */
int write_small_shape(const char *path, int n_ff_exp) {
    char js[600];
    snprintf(js, sizeof js,
             "{\"n_vocab\": 512, \"n_embd\": 256, \"n_layer\": 3, \"layer_types\": {\"mla_layers\": [2]},"
             " \"kda\": {\"n_head\": 2, \"head_dim\": 128}, \"mla\": {\"n_head\": 2, \"kv_lora_rank\": 128,"
             " \"qk_nope_head_dim\": 64, \"qk_rope_head_dim\": 32, \"v_head_dim\": 64}, \"ffn\": {\"n_layer_dense_lead\": 1,"
             " \"dense_n_ff\": 512, \"n_expert\": 8, \"n_expert_used\": 2, \"n_expert_shared\": 1, \"n_ff_exp\": %d}}",
             n_ff_exp);
    return write_all(path, js, strlen(js));
}

/* prefetch off: the counts some tests check would otherwise depend on the I/O thread's timing */
/* golden case `name` with options o (a failure to open is a failed check) */
moe_model *open_golden_with(const char *name, const moe_options *o) {
    char path[600], err[512];
    snprintf(path, sizeof path, "%s/%s", golden_dir(), name);
    moe_model *m = NULL;
    moe_status st = moe_model_open(&m, path, o, err, sizeof err);
    CHECKF(st == MOE_OK, "open %s: %s", path, err);
    return m;
}

moe_model *open_cache_pf(const char *name, size_t budget, int threads, int prefetch) {
    moe_options o = moe_default_options();
    o.expert_mode = MOE_EXPERTS_CACHE;
    o.prefetch = prefetch;
    o.expert_budget = budget;
    o.n_threads = threads;
    return open_golden_with(name, &o);
}

moe_model *open_cache(const char *name, size_t budget, int threads) { return open_cache_pf(name, budget, threads, 0); }

/* writes a random-weight checkpoint in the released K3 layout with moe-convert --k3-slice: 3 layers
 * (KDA + dense, KDA + MoE, MLA + MoE), hidden 64, vocab 300, E experts of width ie on a latent of
 * dl; the directory goes to dir. Returns 1 on success. */
int make_slice(const char *name, const char *js, char *dir, size_t dn) {
    char shape[600], cmd[2400], out[4096];
    snprintf(shape, sizeof shape, "%s/%s.json", tmp_root, name);
    snprintf(dir, dn, "%s/%s", tmp_root, name);
    write_all(shape, js, strlen(js));
    snprintf(cmd, sizeof cmd, "%s/moe-convert --k3-slice %s %s 2>&1", exe_dir, shape, dir);
    const int rc = run_cmd(cmd, out, sizeof out);
    CHECKF(rc == 0, "%s", out);
    return rc == 0;
}

int make_k3_slice(const char *name, int E, int ie, int dl, char *dir, size_t dn) {
    char js[2048];
    snprintf(js, sizeof js,
             "{\"k3_dims\": {\"hidden_size\": 64, \"vocab_size\": 300, \"intermediate_size\": 96, \"num_attention_heads\": 2,"
             "\"q_lora_rank\": 32, \"kv_lora_rank\": 32, \"qk_nope_head_dim\": 16, \"qk_rope_head_dim\": 8, \"v_head_dim\": 16,"
             "\"kda_heads\": 2, \"kda_head_dim\": 16, \"short_conv_kernel_size\": 4, \"kda_a_log_len\": 4, \"num_experts\": %d,"
             "\"num_experts_per_token\": 2, \"moe_intermediate_size\": %d, \"routed_expert_hidden_size\": %d,"
             "\"num_shared_experts\": 1, \"first_k_dense_replace\": 1, \"attn_res_block_size\": 2},"
             "\"layers\": [{\"attention\": \"kda\", \"ffn\": \"dense\"}, {\"attention\": \"kda\", \"ffn\": \"moe\"},"
             "{\"attention\": \"mla\", \"ffn\": \"moe\"}]}",
             E, ie, dl);
    return make_slice(name, js, dir, dn);
}
