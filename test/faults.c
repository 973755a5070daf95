/* faults.c - tests of faults: hostile files and indexes, API misuse, the fuzz seeds, injected read errors, moe-batch
 * killed and out of disk. */
#include "test.h"
#include "../examples/http.h"

static int copy_file(const char *from, const char *to) {
    FILE *a = fopen(from, "rb"), *b = fopen(to, "wb");
    int ok = a && b;
    char buf[1 << 16];
    size_t r;
    while (ok && (r = fread(buf, 1, sizeof buf, a)) > 0) ok = fwrite(buf, 1, r, b) == r;
    if (a) fclose(a);
    if (b && fclose(b)) ok = 0;
    return ok;
}

static void test_api_args(void) {
    char err[256];
    moe_model *m = NULL;
    CHECK(moe_model_open(NULL, "x", NULL, err, sizeof err) == MOE_ERR_ARG);
    CHECK(moe_model_open(&m, NULL, NULL, err, sizeof err) == MOE_ERR_ARG && m == NULL);
    CHECK(moe_model_open(&m, "/nonexistent/dir", NULL, err, sizeof err) != MOE_OK && m == NULL);
    moe_model_close(NULL);
    moe_session_free(NULL);
    moe_session_reset(NULL);
    CHECK(strcmp(moe_status_str(MOE_ERR_CTX_FULL), "context full") == 0);
    m = open_model("kimi", 0, 1);
    moe_model *m2 = open_model("kimi", 0, 1);
    if (!m || !m2) return;
    const int V = moe_model_config(m)->vocab_size;
    moe_session *s, *s2;
    CHECK(moe_session_new(NULL, m, 8, err, sizeof err) == MOE_ERR_ARG);
    CHECK(moe_session_new(&s, m, 0, err, sizeof err) == MOE_ERR_ARG);
    CHECK(moe_session_new(&s, m, 8, err, sizeof err) == MOE_OK);
    CHECK(moe_session_new(&s2, m2, 8, err, sizeof err) == MOE_OK);
    int32_t bad[2] = {5, V}, neg[1] = {-1}, ok[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    moe_seq q = {.s = s, .tokens = bad, .n = 2};
    CHECK(moe_step(m, &q, 1, NULL, err, sizeof err) == MOE_ERR_ARG && strstr(err, "outside"));
    q.tokens = neg, q.n = 1;
    CHECK(moe_step(m, &q, 1, NULL, err, sizeof err) == MOE_ERR_ARG);
    CHECK(moe_session_pos(s) == 0);
    q.tokens = ok, q.n = 9;
    CHECK(moe_step(m, &q, 1, NULL, err, sizeof err) == MOE_ERR_CTX_FULL);
    q.n = 8;
    CHECK(moe_step(m, &q, 1, NULL, err, sizeof err) == MOE_OK && moe_session_pos(s) == 8);
    q.n = 1;
    CHECK(moe_step(m, &q, 1, NULL, err, sizeof err) == MOE_ERR_CTX_FULL);
    moe_seq two[2] = {{.s = s2, .tokens = ok, .n = 1}, {.s = s2, .tokens = ok, .n = 1}};
    CHECK(moe_step(m, two, 1, NULL, err, sizeof err) == MOE_ERR_ARG); /* session of another model */
    CHECK(moe_step(m2, two, 2, NULL, err, sizeof err) == MOE_ERR_ARG); /* same session twice */
    CHECK(moe_step(NULL, two, 1, NULL, err, sizeof err) == MOE_ERR_ARG);
    CHECK(moe_step(m, NULL, 1, NULL, err, sizeof err) == MOE_ERR_ARG);
    CHECK(moe_step(m, NULL, 0, NULL, err, sizeof err) == MOE_OK);
    q = (moe_seq){.s = s2, .tokens = NULL, .n = 3};
    CHECK(moe_step(m2, &q, 1, NULL, err, sizeof err) == MOE_ERR_ARG);
    CHECK(moe_session_restore(s, s2, err, sizeof err) == MOE_ERR_ARG);
    moe_session *f;
    CHECK(moe_session_fork(&f, NULL, err, sizeof err) == MOE_ERR_ARG);
    moe_session_free(s);
    moe_session_free(s2);
    moe_model_close(m);
    moe_model_close(m2);
}

/* a model dir in tmp: config.json (optionally edited) and model.safetensors (header edited) */
typedef struct {
    char *cfg;
    size_t cfg_len;
    char *st;
    size_t st_len;
} model_files;

static int load_seed_files(model_files *f) {
    char p[600];
    snprintf(p, sizeof p, "%s/seed/config.json", golden_dir());
    f->cfg = read_all(p, &f->cfg_len);
    snprintf(p, sizeof p, "%s/seed/model.safetensors", golden_dir());
    f->st = read_all(p, &f->st_len);
    return f->cfg && f->st;
}

static char *replace_once(const char *s, const char *from, const char *to) {
    const char *at = strstr(s, from);
    if (!at) return NULL;
    size_t a = (size_t)(at - s), fl = strlen(from), tl = strlen(to), n = strlen(s);
    char *r = malloc(n - fl + tl + 1);
    memcpy(r, s, a);
    memcpy(r + a, to, tl);
    memcpy(r + a + tl, at + fl, n - a - fl + 1);
    return r;
}

/* writes tmp/bad/{config.json, model.safetensors}; header_edit replaces text in the JSON
 * header (the data stays where it was), cfg_edit in config.json; truncate_at < 0: full length */
static moe_status try_open(const model_files *f, const char *cfg_from, const char *cfg_to,
                           const char *hdr_from, const char *hdr_to, long truncate_at, char *err, size_t errlen) {
    char dir[600], p[700];
    tmp_path(dir, sizeof dir, "bad");
    mkdir(dir, 0700);
    char *cfg = cfg_from ? replace_once(f->cfg, cfg_from, cfg_to) : strdup(f->cfg);
    if (!cfg) { fprintf(stderr, "  (test bug: '%s' not in config)\n", cfg_from); return MOE_OK; }
    snprintf(p, sizeof p, "%s/config.json", dir);
    write_all(p, cfg, strlen(cfg));
    free(cfg);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    if (!hdr_from) { /* raw bytes, possibly truncated */
        size_t n = truncate_at >= 0 && (size_t)truncate_at < f->st_len ? (size_t)truncate_at : f->st_len;
        write_all(p, f->st, n);
        return open_dir(dir, err, errlen);
    }
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | (unsigned char)f->st[i];
    char *hdr = malloc(hlen + 1);
    memcpy(hdr, f->st + 8, hlen);
    hdr[hlen] = 0;
    char *nh = replace_once(hdr, hdr_from, hdr_to);
    free(hdr);
    if (!nh) { fprintf(stderr, "  (test bug: '%s' not in header)\n", hdr_from); return MOE_OK; }
    /* keep the data offset: pad the edited header back to the old length with spaces */
    size_t nl = strlen(nh);
    char *out = malloc(f->st_len + nl + 16);
    size_t newh = nl <= hlen ? hlen : nl;
    for (int i = 0; i < 8; i++) out[i] = (char)(newh >> (8 * i));
    memcpy(out + 8, nh, nl);
    memset(out + 8 + nl, ' ', newh - nl);
    memcpy(out + 8 + newh, f->st + 8 + hlen, f->st_len - 8 - hlen);
    write_all(p, out, 8 + newh + (f->st_len - 8 - hlen));
    free(out);
    free(nh);
    return open_dir(dir, err, errlen);
}

static void expect_format(const model_files *f, const char *cf, const char *ct, const char *hf, const char *ht, const char *what) {
    char err[512] = "";
    moe_status st = try_open(f, cf, ct, hf, ht, -1, err, sizeof err);
    CHECKF(st == MOE_ERR_FORMAT && err[0], "%s: status %d (%s)", what, st, err);
    if (getenv("MOE_TEST_VERBOSE")) fprintf(stderr, "  %s -> %s\n", what, err);
}

static void test_bad_files(void) {
    model_files f;
    if (!load_seed_files(&f)) { CHECK(0); return; }
    char err[512];
    /* the unedited copy opens */
    CHECKF(try_open(&f, NULL, NULL, NULL, NULL, -1, err, sizeof err) == MOE_OK, "%s", err);
    /* truncated at many offsets, header and data alike: always a clean format error */
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | (unsigned char)f.st[i];
    long cuts[40];
    int nc = 0;
    const long fixed[] = {0, 1, 7, 8, 9, 100, (long)hlen / 2, (long)hlen + 7, (long)hlen + 8, (long)hlen + 9};
    for (size_t i = 0; i < sizeof fixed / sizeof *fixed; i++) cuts[nc++] = fixed[i];
    for (int i = 1; i <= 20; i++) cuts[nc++] = (long)(hlen + 8 + (f.st_len - hlen - 8) * i / 21);
    cuts[nc++] = (long)f.st_len - 1;
    for (int i = 0; i < nc; i++) {
        moe_status st = try_open(&f, NULL, NULL, NULL, NULL, cuts[i], err, sizeof err);
        CHECKF(st == MOE_ERR_FORMAT, "truncated at %ld: status %d (%s)", cuts[i], st, err);
    }
    /* header length past the end, and absurd */
    {
        char *bad = malloc(f.st_len);
        memcpy(bad, f.st, f.st_len);
        for (int k = 0; k < 2; k++) {
            uint64_t v = k ? ~0ull : (uint64_t)f.st_len;
            for (int i = 0; i < 8; i++) bad[i] = (char)(v >> (8 * i));
            model_files g = f;
            g.st = bad;
            moe_status st = try_open(&g, NULL, NULL, NULL, NULL, -1, err, sizeof err);
            CHECKF(st == MOE_ERR_FORMAT, "header length %llu: %d", (unsigned long long)v, st);
        }
        free(bad);
    }
    const char *qp = "\"model.layers.0.self_attn.q_proj.weight\":{\"dtype\":\"BF16\",\"shape\":[192,192],\"data_offsets\":[";
    /* header text edits (the seed header is compact JSON) */
    expect_format(&f, NULL, NULL, "{\"lm_head.weight\"", "[{\"lm_head.weight\"", "header not JSON");
    expect_format(&f, NULL, NULL, "{\"lm_head.weight\"", "[{\"lm_head.weight\"}]", "header not an object");
    expect_format(&f, NULL, NULL, qp, "\"model.layers.0.self_attn.q_proj.weight\":{\"dtype\":\"BF16\",\"shape\":[192,192],\"data_offsets\":[9", "offsets outside the file");
    expect_format(&f, NULL, NULL, "\"shape\":[192,192],\"data_offsets\":[1706380,", "\"shape\":[192,192],\"data_offsets\":[1780108,", "offsets reversed");
    expect_format(&f, NULL, NULL, "\"shape\":[192,192],\"data_offsets\":[1706380,1780108]", "\"shape\":[192,192],\"data_offsets\":[1629580,1703308]", "tensors overlap");
    expect_format(&f, NULL, NULL, "\"model.layers.0.self_attn.dt_bias\":{\"dtype\":\"F32\"", "\"model.layers.0.self_attn.dt_bias\":{\"dtype\":\"BF16\"", "dtype/byte length mismatch");
    expect_format(&f, NULL, NULL, "\"model.layers.0.self_attn.dt_bias\":{\"dtype\":\"F32\"", "\"model.layers.0.self_attn.dt_bias\":{\"dtype\":\"Q9\"", "unknown dtype");
    expect_format(&f, NULL, NULL, "\"model.layers.0.self_attn.dt_bias\":{\"dtype\":\"F32\"", "\"model.layers.0.self_attn.dt_bias\":{\"dtype\":\"I32\"", "wrong dtype class");
    expect_format(&f, NULL, NULL, "\"shape\":[192,192],\"data_offsets\":[1706380", "\"shape\":[96,384],\"data_offsets\":[1706380", "shape mismatch with config");
    expect_format(&f, NULL, NULL, "\"shape\":[192,192],\"data_offsets\":[1706380", "\"shape\":[4294967296,4294967296,4294967296],\"data_offsets\":[1706380", "overflowing dims");
    expect_format(&f, NULL, NULL, "\"shape\":[192,192],\"data_offsets\":[1706380", "\"shape\":[192,-192],\"data_offsets\":[1706380", "negative dim");
    expect_format(&f, NULL, NULL, "\"model.layers.0.self_attn.q_proj.weight\"", "\"model.layers.0.self_attn.q_prox.weight\"", "missing tensor");
    expect_format(&f, NULL, NULL, "\"model.layers.0.self_attn.q_proj.weight\"", "\"model.layers.0.self_attn.k_proj.weight\"", "duplicate tensor name");
    expect_format(&f, NULL, NULL, "\"model.layers.0.self_attn.A_log\":{\"dtype\":\"F32\",\"shape\":[3]", "\"model.layers.0.self_attn.A_log\":{\"dtype\":\"F32\",\"shape\":[2]", "A_log too short");
    /* inconsistent or absurd config values */
    expect_format(&f, "\"vocab_size\": 1280", "\"vocab_size\": -1", NULL, NULL, "negative vocab");
    expect_format(&f, "\"vocab_size\": 1280", "\"vocab_size\": 1e300", NULL, NULL, "absurd vocab");
    expect_format(&f, "\"vocab_size\": 1280", "\"vocab_size\": 1000", NULL, NULL, "vocab does not match tensors");
    expect_format(&f, "\"hidden_size\": 192", "\"hidden_size\": 0", NULL, NULL, "zero hidden size");
    expect_format(&f, "\"hidden_size\": 192", "\"hidden_size\": \"192\"", NULL, NULL, "hidden size a string");
    expect_format(&f, "\"num_experts_per_token\": 6", "\"num_experts_per_token\": 65", NULL, NULL, "top-k above the expert count");
    expect_format(&f, "\"num_experts_per_token\": 6", "\"num_experts_per_token\": 0", NULL, NULL, "top-k zero");
    expect_format(&f, "\"num_expert_group\": 4", "\"num_expert_group\": 5", NULL, NULL, "groups do not divide experts");
    expect_format(&f, "\"topk_group\": 2", "\"topk_group\": 9", NULL, NULL, "topk_group above groups");
    expect_format(&f, "\"head_dim\": 64", "\"head_dim\": 32", NULL, NULL, "KDA head size does not match tensors");
    expect_format(&f, "\"num_hidden_layers\": 8", "\"num_hidden_layers\": 0", NULL, NULL, "zero layers");
    expect_format(&f, "\"num_hidden_layers\": 8", "\"num_hidden_layers\": 9", NULL, NULL, "more layers than tensors");
    expect_format(&f, "\"rms_norm_eps\": 1e-05", "\"rms_norm_eps\": -1", NULL, NULL, "negative eps");
    expect_format(&f, "\"kda_layers\": [\n      1,", "\"kda_layers\": [\n      99,", NULL, NULL, "kda layer out of range");
    expect_format(&f, "\"gate_lower_bound\": -5.0", "\"gate_lower_bound\": 3.0", NULL, NULL, "positive gate bound");
    expect_format(&f, "{", "[", NULL, NULL, "config not JSON object");
    {
        moe_status st = try_open(&f, "\"hidden_act\": \"situ\"", "\"hidden_act\": \"gelu\"", NULL, NULL, -1, err, sizeof err);
        CHECKF(st == MOE_ERR_UNSUPPORTED, "unknown activation: %d", st);
    }
    free(f.cfg);
    free(f.st);
}

/* a sharded checkpoint whose index names a missing shard, or a tensor the shard lacks */
static void test_bad_index(void) {
    char dir[600], p[800], q[800], err[512];
    tmp_path(dir, sizeof dir, "badidx");
    mkdir(dir, 0700);
    const char *files[] = {"config.json", "model.safetensors.index.json", "model-00001-of-000011.safetensors",
                           "model-00002-of-000011.safetensors", "model-00003-of-000011.safetensors",
                           "model-00004-of-000011.safetensors", "model-00005-of-000011.safetensors",
                           "model-00006-of-000011.safetensors", "model-00007-of-000011.safetensors",
                           "model-00008-of-000011.safetensors", "model-00009-of-000011.safetensors",
                           "model-00010-of-000011.safetensors", "model-00011-of-000011.safetensors"};
    for (size_t i = 0; i < sizeof files / sizeof *files; i++) {
        snprintf(p, sizeof p, "%s/k3mx/%s", golden_dir(), files[i]);
        snprintf(q, sizeof q, "%s/%s", dir, files[i]);
        CHECK(copy_file(p, q));
    }
    moe_model *m = NULL;
    CHECKF(moe_model_open(&m, dir, NULL, err, sizeof err) == MOE_OK, "%s", err);
    moe_model_close(m);
    snprintf(q, sizeof q, "%s/model-00005-of-000011.safetensors", dir);
    remove(q);
    moe_status st = moe_model_open(&m, dir, NULL, err, sizeof err);
    CHECKF(st == MOE_ERR_IO && strstr(err, "model-00005"), "missing shard: %d %s", st, err);
    /* index says a tensor is in another shard than it is */
    snprintf(p, sizeof p, "%s/k3mx/model-00005-of-000011.safetensors", golden_dir());
    CHECK(copy_file(p, q));
    size_t len;
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    char *idx = read_all(p, &len);
    char *ed = replace_once(idx, "\"language_model.model.layers.0.input_layernorm.weight\": \"model-00001-of-000011.safetensors\"",
                            "\"language_model.model.layers.0.input_layernorm.weight\": \"model-00002-of-000011.safetensors\"");
    CHECK(ed != NULL);
    if (ed) {
        write_all(p, ed, strlen(ed));
        st = moe_model_open(&m, dir, NULL, err, sizeof err);
        CHECKF(st == MOE_ERR_FORMAT, "index mismatch: %d %s", st, err);
        free(ed);
    }
    ed = replace_once(idx, "\"model-00001-of-000011.safetensors\"", "\"../etc/passwd\"");
    if (ed) {
        write_all(p, ed, strlen(ed));
        st = moe_model_open(&m, dir, NULL, err, sizeof err);
        CHECKF(st == MOE_ERR_FORMAT, "shard path escape: %d %s", st, err);
        free(ed);
    }
    free(idx);
}

/* runs moe-batch in a child; kill_after_us > 0: SIGKILL it then; fsize > 0: RLIMIT_FSIZE with
 * SIGXFSZ ignored (the disk "fills up"). Returns the exit status, or -9 when killed. */
static int batch_child(const char *in, const char *out, long kill_after_us, long fsize) {
    char model[600];
    snprintf(model, sizeof model, "%s/k3mx", golden_dir());
    char exe[700];
    snprintf(exe, sizeof exe, "%s/moe-batch", exe_dir);
    pid_t pid = fork();
    if (pid == 0) {
        int devnull = open("/dev/null", O_WRONLY);
        if (devnull >= 0) dup2(devnull, 2);
        if (fsize > 0) {
            signal(SIGXFSZ, SIG_IGN);
            struct rlimit rl = {(rlim_t)fsize, (rlim_t)fsize};
            setrlimit(RLIMIT_FSIZE, &rl);
        }
        execl(exe, exe, "-m", model, "-i", in, "-o", out, "--parallel", "3", (char *)NULL);
        _exit(127);
    }
    if (kill_after_us > 0) {
        struct timespec ts = {kill_after_us / 1000000, (kill_after_us % 1000000) * 1000};
        nanosleep(&ts, NULL);
        kill(pid, SIGKILL);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    return WIFSIGNALED(st) ? -WTERMSIG(st) : WEXITSTATUS(st);
}

/* SIGKILL at random moments, then reruns: every request answered exactly once, no torn line;
 * a full disk (RLIMIT_FSIZE) stops the job with an error and no torn line, and a rerun
 * completes it */
static void test_batch_faults(void) {
    if (getenv("MOE_TEST_RUNNER")) return; /* forks the binary directly: not under qemu */
    char in[600], out[600];
    tmp_path(in, sizeof in, "batch-kill-in.jsonl");
    tmp_path(out, sizeof out, "batch-kill-out.jsonl");
    const int N = 40;
    write_batch_input(in, N, NULL);
    int kills = 0, runs = 0, rc = -1;
    for (int round = 0; round < 4; round++) {
        remove(out);
        for (runs = 0; runs < 200; runs++) {
            long delay = 2000 + (long)(urand() * 30000);
            rc = batch_child(in, out, runs < 12 ? delay : 0, 0);
            if (rc == -SIGKILL) kills++;
            CHECK(check_batch_output(out, NULL, NULL, 0) >= 0); /* after every kill: whole lines, no duplicates */
            if (rc == 0) break;
        }
        CHECKF(rc == 0 && check_batch_output(out, NULL, NULL, 0) == N, "round %d: rc %d, %d lines", round, rc, check_batch_output(out, NULL, NULL, 0));
    }
    CHECKF(kills > 0, "no run was killed: %d", kills);
    if (getenv("MOE_TEST_VERBOSE"))
        fprintf(stderr, "  batch faults: 4 jobs of %d requests, %d runs killed by SIGKILL, every request answered exactly once\n", N, kills);
    /* the output "disk" holds only about 3 answers */
    remove(out);
    rc = batch_child(in, out, 0, 1200);
    int n = check_batch_output(out, NULL, NULL, 0);
    CHECKF(rc == 1 && n >= 0 && n < N, "full disk: rc %d, %d lines", rc, n);
    struct stat sb;
    CHECK(stat(out, &sb) == 0 && sb.st_size <= 1200);
    rc = batch_child(in, out, 0, 0);
    CHECK(rc == 0 && check_batch_output(out, NULL, NULL, 0) == N);
}

/* a hand-built GGUF: every truncation and each corrupted field gives a clean error */
typedef struct {
    unsigned char b[8192];
    size_t n;
} gbuf;

static void gb(gbuf *g, const void *p, size_t n) { memcpy(g->b + g->n, p, n), g->n += n; }

static void gb32(gbuf *g, uint32_t v) { gb(g, &v, 4); }

static void gb64(gbuf *g, uint64_t v) { gb(g, &v, 8); }

static void gbs(gbuf *g, const char *s) { gb64(g, strlen(s)), gb(g, s, strlen(s)); }

/* fields: [0] version, [1] n_tensors, [2] n_kv, [3] dim of t0, [4] type of t0, [5] offset of t1,
 * [6] string length of the arch value, [7] alignment */
static size_t build_gguf(gbuf *g, const uint64_t *f) {
    g->n = 0;
    gb(g, "GGUF", 4), gb32(g, (uint32_t)f[0]), gb64(g, f[1]), gb64(g, f[2]);
    gbs(g, "general.architecture"), gb32(g, MOE_GGUF_STRING), gb64(g, f[6]), gb(g, "kimi-linear", 11);
    gbs(g, "general.alignment"), gb32(g, MOE_GGUF_U32), gb32(g, (uint32_t)f[7]);
    gbs(g, "kimi-linear.block_count"), gb32(g, MOE_GGUF_U32), gb32(g, 1);
    gbs(g, "t0"), gb32(g, 2), gb64(g, f[3]), gb64(g, 2), gb32(g, (uint32_t)f[4]), gb64(g, 0);
    gbs(g, "t1"), gb32(g, 1), gb64(g, 32), gb32(g, 0), gb64(g, f[5]);
    while (g->n % 32) g->b[g->n++] = 0;
    memset(g->b + g->n, 0x3c, 512), g->n += 512;
    return g->n;
}

static void test_gguf_bad(void) {
    const uint64_t good[8] = {3, 2, 3, 32, 0, 256, 11, 32};
    gbuf g;
    char path[600], err[256];
    snprintf(path, sizeof path, "%s/t.gguf", tmp_root);
    size_t n = build_gguf(&g, good);
    moe__st_file f;
    write_all(path, g.b, n);
    CHECKF(moe__gguf_open(&f, path, err, sizeof err) == MOE_OK, "%s", err);
    if (!g_failed_checks) {
        CHECK(f.n_tensors == 2 && f.tensors[0].shape[0] == 2 && f.tensors[0].shape[1] == 32 && f.n_kv == 3);
        const moe__gguf_kv *kv = moe__gguf_get(&f, "general.architecture");
        CHECK(kv && kv->type == MOE_GGUF_STRING && kv->n == 11 && !memcmp(kv->data, "kimi-linear", 11));
        moe__st_close(&f);
    }
    for (size_t cut = 0; cut < n - 512 + 300; cut += 3) { /* every truncation through the header, into the data */
        write_all(path, g.b, cut);
        CHECKF(moe__gguf_open(&f, path, err, sizeof err) == MOE_ERR_FORMAT, "truncated at %zu", cut);
    }
    const struct { int field; uint64_t value; moe_status want; const char *what; } bad[] = {
        {0, 1, MOE_ERR_FORMAT, "version 1"},         {0, 4, MOE_ERR_FORMAT, "version 4"},
        {1, 1ull << 40, MOE_ERR_FORMAT, "absurd tensor count"}, {2, 1ull << 40, MOE_ERR_FORMAT, "absurd key count"},
        {2, 4, MOE_ERR_FORMAT, "one key too many"},  {3, 0, MOE_ERR_FORMAT, "zero dimension"},
        {3, 33, MOE_ERR_FORMAT, "partial block"},    {3, 320, MOE_ERR_FORMAT, "tensor past the end"},
        {4, 77, MOE_ERR_UNSUPPORTED, "unknown type"}, {5, 1ull << 50, MOE_ERR_FORMAT, "offset outside"},
        {5, 100, MOE_ERR_FORMAT, "misaligned offset"}, {5, 0, MOE_ERR_FORMAT, "overlapping tensors"},
        {6, 1ull << 62, MOE_ERR_FORMAT, "string length past the end"}, {7, 3, MOE_ERR_FORMAT, "alignment not a power of two"},
        {3, 1ull << 62, MOE_ERR_FORMAT, "dimension overflow"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        uint64_t fl[8];
        memcpy(fl, good, sizeof fl);
        fl[bad[i].field] = bad[i].value;
        n = build_gguf(&g, fl);
        write_all(path, g.b, n);
        moe_status st = moe__gguf_open(&f, path, err, sizeof err);
        CHECKF(st == bad[i].want, "%s: status %d (%s)", bad[i].what, st, err);
        if (!st) moe__st_close(&f);
    }
    /* bad magic through the model API */
    n = build_gguf(&g, good);
    g.b[3] = 'X';
    write_all(path, g.b, n);
    moe_model *m;
    CHECK(moe_model_open(&m, path, NULL, err, sizeof err) != MOE_OK);
    /* a valid container without the model's tensors: a clean error naming what is missing */
    n = build_gguf(&g, good);
    write_all(path, g.b, n);
    moe_status st = moe_model_open(&m, path, NULL, err, sizeof err);
    CHECKF(st == MOE_ERR_FORMAT && err[0], "%d %s", st, err);
    /* truncations of a real converted model */
    char dir[600], out[600];
    snprintf(dir, sizeof dir, "%s/kimi", golden_dir());
    snprintf(out, sizeof out, "%s/kimi.gguf", tmp_root);
    CHECK(convert(dir, out, "--dense q4_0") == 0);
    size_t len;
    char *full = read_all(out, &len);
    for (int i = 0; full && i < 24; i++) {
        size_t cut = i < 12 ? (size_t)i * 997 : len / 24 * (size_t)i;
        write_all(path, full, cut);
        st = moe_model_open(&m, path, NULL, err, sizeof err);
        CHECKF(st == MOE_ERR_FORMAT, "model truncated at %zu: %d (%s)", cut, st, err);
        if (!st) moe_model_close(m);
    }
    free(full);
    remove(out);
}

/* the fuzz seed corpora (test/fuzz/corpus) go through the fuzz targets' parsers: seeds are
 * valid inputs, so every one is accepted (a replay of what `make fuzz` starts from) */
static void test_fuzz_seeds(void) {
    const char *dirs[9] = {"json", "safetensors", "gguf", "config", "ranks", "tokenize", "chat", "batch", "http"};
    int total = 0;
    for (int k = 0; k < 9; k++) {
        char dir[600];
        snprintf(dir, sizeof dir, "%s/../fuzz/corpus/%s", golden_dir(), dirs[k]);
        DIR *d = opendir(dir);
        CHECKF(d != NULL, "%s", dir);
        struct dirent *e;
        while (d && (e = readdir(d))) {
            if (e->d_name[0] == '.') continue;
            char p[1200], err[256] = "";
            size_t len;
            snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
            char *data = read_all(p, &len);
            CHECK(data != NULL);
            if (!data) continue;
            moe_status st;
            if (k == 0) {
                moe__json *j;
                if (!(st = moe__json_parse(data, len, &j, err, sizeof err))) moe__json_free(j);
            } else if (k == 3) {
                st = moe__config_check(data, len, err, sizeof err);
            } else if (k == 4) { /* a rank file, then NUL and a tokenizer_config.json */
                const char *nul = memchr(data, 0, len);
                moe_tokenizer *t = NULL;
                st = moe__tokenizer_from_mem(&t, data, nul ? (size_t)(nul - data) : len, MOE_PRETOK_KIMI, nul ? nul + 1 : NULL,
                                             nul ? len - (size_t)(nul - data) - 1 : 0, err, sizeof err);
                moe_tokenizer_free(t);
            } else if (k == 8) { /* the bytes of a connection: whole requests, one after the other */
                size_t at = 0, used = 0;
                const char *why = NULL;
                http_request rq;
                int r = HTTP_OK;
                while (at < len && (r = http_parse(data + at, len - at, 8192, 1 << 20, &rq, &used, &why)) == HTTP_OK) at += used;
                st = at == len ? MOE_OK : MOE_ERR_FORMAT;
                if (st) snprintf(err, sizeof err, "http_parse %d at %zu: %s", r, at, why ? why : "incomplete");
            } else if (k >= 5) { /* mode byte + text / chat request / one batch line: all valid here */
                moe__json *j = NULL;
                st = k == 5 ? MOE_OK : moe__json_parse(data + (k == 6), len - (k == 6), &j, err, sizeof err);
                moe__json_free(j);
            } else {
                moe__st_file f;
                if (!(st = moe__weights_parse_mem(&f, data, len, k == 2, err, sizeof err))) moe__st_close(&f);
            }
            /* seeds named bad-* are malformed on purpose: a named error */
            const int bad = !strncmp(e->d_name, "bad-", 4);
            CHECKF(bad ? st != MOE_OK && err[0] : st == MOE_OK, "%s: %s", p, err);
            free(data);
            total++;
        }
        if (d) closedir(d);
    }
    CHECK(total >= 30);
}

static void test_cache_faults(void) {
    char path[600], err[512];
    snprintf(path, sizeof path, "%s/k3mx", golden_dir());
    moe_options o = moe_default_options();
    o.expert_mode = MOE_EXPERTS_CACHE;
    o.expert_budget = 1000; /* a k3mx expert is 3 x (1024 + 64) = 3264 bytes */
    moe_model *m = NULL;
    CHECK(moe_model_open(&m, path, &o, err, sizeof err) == MOE_ERR_ARG && m == NULL && strstr(err, "too small"));
    o.expert_type = MOE_WTYPE_Q8_0;
    o.expert_budget = 1 << 30;
    CHECK(moe_model_open(&m, path, &o, err, sizeof err) == MOE_ERR_ARG && m == NULL);
    m = open_cache("k3mx", 4 << 20, 1); /* room for all 7 x 64 experts */
    if (!m) return;
    const int V = moe_model_config(m)->vocab_size;
    int n;
    int32_t *ids = golden_ids("k3mx", 1, &n);
    float *ref = logits_in_pieces(m, ids, n, NULL), *lg = malloc(sizeof(float) * (size_t)V * n);
    moe_session *s;
    CHECK(moe_session_new(&s, m, 64, NULL, 0) == MOE_OK);
    moe_step_stats st1, st2;
    moe_seq q = {.s = s, .tokens = ids, .n = n, .logits = lg, .logits_all = 1};
    CHECK(moe_step(m, &q, 1, &st1, NULL, 0) == MOE_OK); /* everything resident by now: all hits */
    CHECKF(st1.cache_hits > 0 && st1.cache_misses == 0 && st1.bytes_read == 0, "hits %llu misses %llu", (unsigned long long)st1.cache_hits,
           (unsigned long long)st1.cache_misses);
    moe_session_free(s); /* sessions go before their model */
    moe_model_close(m);
    /* three experts: misses on every layer; the step's own thread reads every unit (no I/O
     * threads), or I/O threads read what each layer routes to while the step reads what they
     * have not taken yet: the n-th read from now, whichever thread makes it, is one that step
     * needs, so the injected fault always falls in the step that follows it */
    for (int io = 0; io <= 4; io += 4) {
        o = moe_default_options();
        o.expert_mode = MOE_EXPERTS_CACHE, o.prefetch = 0, o.io_threads = io, o.expert_budget = 3 * 3264, o.n_threads = 1;
        m = open_golden_with("k3mx", &o);
        if (!m) break;
        CHECK(moe_session_new(&s, m, 64, NULL, 0) == MOE_OK);
        q.s = s;
        CHECK(moe_step(m, &q, 1, &st2, NULL, 0) == MOE_OK);
        /* every miss was read (I/O threads may also read ahead experts evicted again before use) */
        CHECK(st2.cache_misses > 0 && st2.bytes_read >= st2.cache_misses * 3264 && max_abs_diff(ref, lg, (size_t)V * n) == 0);
        /* each read from the 1st to the 12th from now fails in turn: the step reports an I/O
         * error, the sessions are reset, and the model works again afterwards, with the same
         * logits */
        for (int nth = 1; nth <= 12; nth++) {
            moe_session_reset(s);
            moe__fail_expert_read(m, nth);
            moe_status r1 = moe_step(m, &q, 1, NULL, err, sizeof err);
            CHECKF(r1 == MOE_ERR_IO && moe_session_pos(s) == 0, "io threads %d, read %d: step %d, position %d", io, nth, (int)r1,
                   moe_session_pos(s));
            moe_status r2 = moe_step(m, &q, 1, NULL, err, sizeof err);
            CHECKF(r2 == MOE_OK && max_abs_diff(ref, lg, (size_t)V * n) == 0, "io threads %d, read %d: next step %d, logits off by %g",
                   io, nth, (int)r2, max_abs_diff(ref, lg, (size_t)V * n));
        }
        moe_session_free(s);
        moe_model_close(m);
    }
    free(ids), free(ref), free(lg);
}

const test_case faults_tests[] = {
    {"faults.batch_kill", test_batch_faults, "moe-batch under SIGKILL and a full disk: every request answered once", 0},
    {"faults.api_args", test_api_args, "API misuse: NULL arguments, bad tokens, context overflow", 0},
    {"faults.bad_files", test_bad_files, "hostile checkpoints: every truncation and corruption is an error", 0},
    {"faults.bad_index", test_bad_index, "a shard index naming a missing shard or a tensor the shard lacks", 0},
    {"faults.gguf_bad", test_gguf_bad, "hostile GGUF files: every truncation and bad field is an error", 0},
    {"faults.fuzz_seeds", test_fuzz_seeds, "the fuzz seed corpora go through the fuzz targets' parsers", 0},
    {"faults.cache_reads", test_cache_faults, "expert reads that fail: an error from the step, a usable model", 0},
    {0}
};
