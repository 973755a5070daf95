/* hostile.c - tests of inputs that must neither hang, nor be lost, nor run silently: FIFOs and
 * devices where files belong, moe-batch's output shared or equal to its input, one huge input
 * line, moe-convert's output names, NaN and infinity in weights, a dropped tensor, and the lesser
 * parser cases (truncated GGUF headers, duplicate keys, precise batch errors). */
#define _XOPEN_SOURCE 700 /* mknod */
#include "test.h"

#include <sys/file.h>
#include <sys/sysmacros.h> /* makedev */

#include "../examples/http.h"

/* ---- helpers ------------------------------------------------------------------------------ */

/* copies every regular file of directory from into directory to (made) */
static int copy_model_dir(const char *from, const char *to) {
    mkdir(to, 0700);
    DIR *d = opendir(from);
    if (!d) return 0;
    int ok = 1;
    for (struct dirent *e; ok && (e = readdir(d));) {
        char a[800], b[800];
        struct stat sb;
        snprintf(a, sizeof a, "%s/%s", from, e->d_name);
        snprintf(b, sizeof b, "%s/%s", to, e->d_name);
        if (stat(a, &sb) || !S_ISREG(sb.st_mode)) continue;
        size_t n = 0;
        char *p = read_all(a, &n);
        ok = p && write_all(b, p, n);
        free(p);
    }
    closedir(d);
    return ok;
}

/* writes `bytes` (2 or 4 of them) over element `index` of tensor `name` in safetensors file path */
static int poison(const char *path, const char *name, int64_t index, uint32_t bits, int bytes) {
    moe__st_file f;
    char err[256];
    if (moe__st_open(&f, path, err, sizeof err)) return fprintf(stderr, "  %s\n", err), 0;
    const moe__st_tensor *t = moe__st_find(&f, name);
    const long off = t ? (long)((const char *)t->data - (const char *)f.map) + (long)(index * bytes) : -1;
    moe__st_close(&f);
    if (off < 0) return fprintf(stderr, "  (test bug: no tensor %s in %s)\n", name, path), 0;
    const int fd = open(path, O_WRONLY);
    const int ok = fd >= 0 && pwrite(fd, &bits, (size_t)bytes, off) == bytes;
    if (fd >= 0) close(fd);
    return ok;
}

enum { BF16_NAN = 0x7fc0, BF16_INF = 0x7f80 };

static char *find_bytes(char *hay, size_t n, const char *needle, size_t k) {
    for (size_t i = 0; i + k <= n; i++)
        if (!memcmp(hay + i, needle, k)) return hay + i;
    return NULL;
}

static int exists_as(const char *path, mode_t kind) {
    struct stat sb;
    return !lstat(path, &sb) && (sb.st_mode & S_IFMT) == kind;
}

/* the output line answering custom_id id into line (empty when there is none); the number of
 * lines in the file */
static int answer_of(const char *path, const char *id, char *line, size_t ln) {
    size_t n = 0;
    char *text = read_all(path, &n), want[300];
    snprintf(want, sizeof want, "\"custom_id\": \"%s\"", id);
    int lines = 0;
    line[0] = 0;
    for (char *p = text; p && *p;) {
        char *e = strchr(p, '\n');
        const size_t len = e ? (size_t)(e - p) : strlen(p);
        lines++;
        char *hit = strstr(p, want);
        if (hit && hit < p + len) snprintf(line, ln, "%.*s", (int)len, p);
        p += len + (e != NULL);
    }
    free(text);
    return lines;
}

/* ---- special files ---------------------------------------------------------------------- */

/* a FIFO without a writer (or a device) where a file belongs: refused at once, by name; every
 * run is under timeout(1), so a program that blocks fails the test instead of hanging it */
static void test_special_files(void) {
    char dir[600], p[800], fifo[600], err[512];
    tmp_path(dir, sizeof dir, "special");
    CHECK(copy_model_dir(shipped_dir(), dir));
    tmp_path(fifo, sizeof fifo, "a-fifo");
    CHECK(mkfifo(fifo, 0600) == 0);
    alarm(120); /* the library calls below run in this process: a hang ends the suite, not the test */
    /* a shard */
    snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", dir);
    CHECK(remove(p) == 0 && mkfifo(p, 0600) == 0);
    moe_status st = open_dir(dir, err, sizeof err);
    CHECKF(st == MOE_ERR_IO && strstr(err, "FIFO") && strstr(err, "model-00002"), "%d %s", st, err);
    CHECK(remove(p) == 0);
    /* config.json a character device */
    char dir2[600];
    tmp_path(dir2, sizeof dir2, "special2");
    CHECK(copy_model_dir(shipped_dir(), dir2));
    snprintf(p, sizeof p, "%s/config.json", dir2);
    CHECK(remove(p) == 0 && symlink("/dev/zero", p) == 0);
    st = open_dir(dir2, err, sizeof err);
    CHECKF(st == MOE_ERR_IO && strstr(err, "character device"), "%d %s", st, err);
    /* the model path itself, a GGUF by name */
    char gg[600];
    tmp_path(gg, sizeof gg, "fifo.gguf");
    CHECK(mkfifo(gg, 0600) == 0);
    st = open_dir(gg, err, sizeof err);
    CHECKF(st == MOE_ERR_IO && strstr(err, "FIFO"), "%d %s", st, err);
    /* a tokenizer file */
    moe_tokenizer *tk = NULL;
    CHECK(moe_tokenizer_load(&tk, fifo, MOE_PRETOK_KIMI, NULL, 0, err, sizeof err) == MOE_ERR_IO && strstr(err, "FIFO") && !tk);
    CHECK(moe_tokenizer_from_gguf(&tk, fifo, err, sizeof err) == MOE_ERR_IO && !tk);
    /* a part of a split GGUF */
    char split[600], part[700];
    tmp_path(split, sizeof split, "split.gguf");
    if (convert(shipped_dir(), split, "--split-max-size 4M") == 0) {
        char first[700], name[64];
        int parts = 2;
        for (; parts < 100; parts++) { /* how many parts moe-convert made */
            snprintf(name, sizeof name, "split-00001-of-%05d.gguf", parts);
            tmp_path(first, sizeof first, name);
            if (exists_as(first, S_IFREG)) break;
        }
        snprintf(name, sizeof name, "split-00002-of-%05d.gguf", parts);
        tmp_path(part, sizeof part, name);
        CHECK(exists_as(first, S_IFREG) && remove(part) == 0 && mkfifo(part, 0600) == 0);
        st = open_dir(first, err, sizeof err);
        CHECKF(st == MOE_ERR_IO && strstr(err, "FIFO") && strstr(err, "00002-of"), "%d %s", st, err);
    } else {
        CHECK(0);
    }
    /* a config.json over its size limit is refused from its size, without reading it */
    snprintf(p, sizeof p, "%s/config.json", dir2);
    remove(p);
    const int fd = open(p, O_WRONLY | O_CREAT, 0600);
    CHECK(fd >= 0 && ftruncate(fd, 300ll << 20) == 0);
    if (fd >= 0) close(fd);
    st = open_dir(dir2, err, sizeof err);
    CHECKF(st == MOE_ERR_FORMAT && strstr(err, "larger than"), "%d %s", st, err);
    alarm(0);
    /* the programs' file arguments */
    struct {
        const char *args, *prog;
    } runs[] = {
        {"-m %s -i %s -o /dev/null", "moe-batch"}, {"-m %s -f %s -n 2", "moe-cli"}, {"-m %s -f %s", "moe-perplexity"},
        {"-m %s %s", "moe-tokenize"},              {"-m %s --tokens %s", "moe-logits"},
    };
    for (size_t i = 0; i < sizeof runs / sizeof *runs; i++) {
        char args[1600], cmd[2400], out[4096];
        snprintf(args, sizeof args, runs[i].args, shipped_dir(), fifo);
        snprintf(cmd, sizeof cmd, "timeout 60 %s/%s %s 2>&1", exe_dir, runs[i].prog, args);
        const int rc = run_cmd(cmd, out, sizeof out);
        CHECKF(rc != 0 && rc != 124 && strstr(out, "FIFO"), "%s: rc %d: %s", runs[i].prog, rc, out);
    }
    char cmd[1600], out[4096];
    snprintf(cmd, sizeof cmd, "timeout 60 %s/moe-plan --config %s 2>&1", exe_dir, fifo);
    CHECKF(run_cmd(cmd, out, sizeof out) == 1 && strstr(out, "FIFO"), "%s", out);
}

/* ---- moe-batch's output ------------------------------------------------------------------- */

static int batch_run(const char *model, const char *in, const char *out, const char *extra, char *msg, size_t mn) {
    char cmd[2400];
    snprintf(cmd, sizeof cmd, "timeout 120 %s/moe-batch -m %s -i %s -o %s -t 2 %s 2>&1", exe_dir, model, in, out, extra ? extra : "");
    return run_cmd(cmd, msg, mn);
}

/* the output is the input (by name, hard link or symbolic link), a FIFO, or held by another
 * moe-batch: refused, nothing written; a line that is not a whole answer does not count */
static void test_batch_output(void) {
    char model[600], in[600], out[600], lnk[600], msg[8192];
    snprintf(model, sizeof model, "%s/k3mx", golden_dir());
    tmp_path(in, sizeof in, "bo-in.jsonl");
    tmp_path(out, sizeof out, "bo-out.jsonl");
    tmp_path(lnk, sizeof lnk, "bo-link.jsonl");
    const int N = 6;
    write_batch_input(in, N, NULL);
    size_t n0 = 0, n1 = 0;
    char *before = read_all(in, &n0);
    CHECKF(batch_run(model, in, in, NULL, msg, sizeof msg) == 1 && strstr(msg, "the same file"), "%s", msg);
    CHECK(link(in, lnk) == 0);
    CHECKF(batch_run(model, in, lnk, NULL, msg, sizeof msg) == 1 && strstr(msg, "the same file"), "%s", msg);
    CHECK(remove(lnk) == 0 && symlink(in, lnk) == 0);
    CHECKF(batch_run(model, in, lnk, NULL, msg, sizeof msg) == 1 && strstr(msg, "the same file"), "%s", msg);
    char *after = read_all(in, &n1);
    CHECK(before && after && n0 == n1 && !memcmp(before, after, n0)); /* the input untouched */
    free(before), free(after);
    CHECK(remove(lnk) == 0 && mkfifo(lnk, 0600) == 0);
    CHECKF(batch_run(model, in, lnk, NULL, msg, sizeof msg) == 1 && strstr(msg, "regular file"), "%s", msg);
    /* another process holds the output: the second writer stops at once */
    const int fd = open(out, O_RDWR | O_CREAT, 0644);
    struct flock lk = {.l_type = F_WRLCK, .l_whence = SEEK_SET};
    CHECK(fd >= 0 && fcntl(fd, F_SETLK, &lk) == 0);
    CHECKF(batch_run(model, in, out, NULL, msg, sizeof msg) == 1 && strstr(msg, "another moe-batch"), "%s", msg);
    struct stat sb;
    CHECK(stat(out, &sb) == 0 && sb.st_size == 0);
    if (fd >= 0) close(fd); /* the lock goes with it */
    /* lines that are not whole answers: answered (again) */
    const char junk[] = "{\"custom_id\": \"req-3\", \"response\": null}\n{\"custom_id\": \"req-4\", \"response\": {\"status_code\": 200, \"body\": {}}}\n";
    CHECK(write_all(out, junk, sizeof junk - 1));
    CHECKF(batch_run(model, in, out, NULL, msg, sizeof msg) == 0 && strstr(msg, "0 answered before"), "%s", msg);
    size_t len = 0;
    char *text = read_all(out, &len);
    int answers = 0;
    for (char *q = text; q && (q = strstr(q, "\"status_code\": 200, \"request_id\"")); q++) answers++;
    CHECKF(answers == N, "%d answers: %s", answers, text);
    free(text);
}

/* one line of 60 MB of text, one of 3 million token ids, one ordinary request, in an address
 * space of 300 MB: the first two are answered with errors from what they are (before tokenizing
 * or parsing them whole), the third is answered */
static void test_batch_huge_line(void) {
    char in[600], out[600];
    tmp_path(in, sizeof in, "huge-in.jsonl");
    tmp_path(out, sizeof out, "huge-out.jsonl");
    FILE *f = fopen(in, "w");
    if (!f) { CHECK(0); return; }
    fputs("{\"custom_id\": \"text\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"max_tokens\": 4, \"prompt\": \"", f);
    for (int i = 0; i < 60 * 1024; i++) fprintf(f, "%.*s", 1024, "In the beginning God created the heaven and the earth. And the earth was without form, and void; and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. And God said, Let there be light: and there was light. And God saw the light, that it was good: and God divided the light from the darkness. And God called the light Day, and the darkness he called Night. And the evening and the morning were the first day. And God said, Let there be a firmament in the midst of the waters, and let it divide the waters from the waters. And God made the firmament, and divided the waters which were under the firmament from the waters which were above the firmament: and it was so. And God called the firmament Heaven. And the evening and the morning were the second day. And God said, Let the waters under the heaven be gathered together unto one place, and let the dry land appear: and it was so. And God called the dry land Earth; and the gathering together of the waters called he Seas: and God saw that it was good. And God said, Let the earth bring forth grass...");
    fputs("\"}}\n{\"custom_id\": \"ids\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"max_tokens\": 4, \"prompt\": [1", f);
    for (int i = 0; i < 3000000; i++) fputs(",1", f);
    fputs("]}}\n{\"custom_id\": \"ok\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"max_tokens\": 4, \"prompt\": \"Hello\"}}\n", f);
    CHECK(fclose(f) == 0);
    char cmd[2400], msg[8192], a[4096];
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    const char *limit = ""; /* the sanitizers reserve terabytes of address space */
#else
    const char *limit = "ulimit -v 300000; MALLOC_ARENA_MAX=2 ";
#endif
    snprintf(cmd, sizeof cmd, "%stimeout 300 %s/moe-batch -m %s -i %s -o %s -t 2 2>&1", limit, exe_dir, shipped_dir(), in, out);
    const int rc = run_cmd(cmd, msg, sizeof msg);
    CHECKF(rc == 0, "rc %d: %s", rc, msg);
    CHECKF(answer_of(out, "text", a, sizeof a) == 3 && strstr(a, "more than the context"), "%s", a);
    CHECKF(check_batch_output(out, NULL, NULL, 0) == 3, "answers");
    size_t len = 0;
    char *text = read_all(out, &len);
    CHECKF(text && strstr(text, "\"input_line\": 2") && strstr(text, "JSON values"), "%s", text ? text : "");
    CHECKF(text && strstr(text, "\"custom_id\": \"ok\", \"response\": {\"status_code\": 200"), "%s", text ? text : "");
    free(text);
}

/* requests refused with a message that says what is wrong */
static void test_batch_messages(void) {
    char in[600], out[600], msg[8192];
    tmp_path(in, sizeof in, "msg-in.jsonl");
    tmp_path(out, sizeof out, "msg-out.jsonl");
    const char lines[] =
        "{\"custom_id\": \"neg\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [1, -1]}}\n"
        "{\"custom_id\": \"nested\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [[1, 2]]}}\n"
        "{\"custom_id\": \"frac\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": \"Hi\", \"max_tokens\": 3.7}}\n"
        "{\"custom_id\": \"empty\", \"method\": \"POST\", \"url\": \"/v1/chat/completions\", \"body\": {\"messages\": []}}\n"
        "{\"custom_id\": \"dup\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": \"Hi\", \"prompt\": \"Ho\"}}\n";
    CHECK(write_all(in, lines, sizeof lines - 1));
    CHECKF(batch_run(shipped_dir(), in, out, NULL, msg, sizeof msg) == 0, "%s", msg);
    const char *want[][2] = {{"neg", "prompt[1]: a token id is an integer"},
                             {"nested", "a list of prompts is not supported"},
                             {"frac", "max_tokens must be an integer"},
                             {"empty", "messages must be a non-empty list"}};
    for (size_t i = 0; i < sizeof want / sizeof *want; i++) {
        char a[4096] = "";
        answer_of(out, want[i][0], a, sizeof a);
        CHECKF(strstr(a, "\"status_code\": 400") && strstr(a, want[i][1]), "%s: %s", want[i][0], a);
    }
    size_t len = 0;
    char *text = read_all(out, &len);
    CHECKF(text && strstr(text, "\"input_line\": 5") && strstr(text, "appears twice"), "%s", text ? text : ""); /* duplicate key */
    free(text);
}

/* ---- moe-convert's output ----------------------------------------------------------------- */

/* an OUT that is a FIFO, a directory or a symbolic link (or whose partial file is one) is refused
 * and left as it was; a second moe-convert writing the same OUT stops at once */
static void test_convert_output(void) {
    char out[600], target[600], partial[700], cmd[2400], msg[4096];
    char seed[600];
    snprintf(seed, sizeof seed, "%s/seed", golden_dir());
    tmp_path(out, sizeof out, "conv-out.gguf");
    tmp_path(target, sizeof target, "conv-target");
    snprintf(partial, sizeof partial, "%s.partial", out);
    CHECK(mkfifo(out, 0600) == 0);
    CHECK(convert_expect(seed, out, "", 1) == 1 && exists_as(out, S_IFIFO));
    CHECK(remove(out) == 0 && mkdir(out, 0700) == 0);
    CHECK(convert_expect(seed, out, "", 1) == 1 && exists_as(out, S_IFDIR));
    CHECK(rmdir(out) == 0 && write_all(target, "keep", 4) && symlink(target, out) == 0);
    snprintf(cmd, sizeof cmd, "timeout 60 %s/moe-convert %s %s 2>&1", exe_dir, seed, out);
    CHECKF(run_cmd(cmd, msg, sizeof msg) == 1 && strstr(msg, "symbolic link"), "%s", msg);
    size_t n = 0;
    char *t = read_all(target, &n);
    CHECK(exists_as(out, S_IFLNK) && t && n == 4 && !memcmp(t, "keep", 4));
    free(t);
    /* a device node (where this runs as root): left a device, as /dev/null's twin */
    char dev[600];
    tmp_path(dev, sizeof dev, "conv-dev.gguf");
    if (mknod(dev, S_IFCHR | 0600, makedev(1, 3)) == 0) {
        CHECK(convert_expect(seed, dev, "", 1) == 1 && exists_as(dev, S_IFCHR));
        CHECK(remove(dev) == 0);
    }
    CHECK(remove(out) == 0 && mkfifo(partial, 0600) == 0);
    CHECK(convert_expect(seed, out, "", 1) == 1 && exists_as(partial, S_IFIFO) && !exists_as(out, S_IFREG));
    CHECK(remove(partial) == 0);
    /* another moe-convert holds the output */
    const int fd = open(partial, O_RDWR | O_CREAT, 0644);
    CHECK(fd >= 0 && flock(fd, LOCK_EX) == 0);
    CHECKF(run_cmd(cmd, msg, sizeof msg) == 1 && strstr(msg, "another moe-convert"), "%s", msg);
    if (fd >= 0) close(fd);
    CHECK(convert(seed, out, "") == 0 && exists_as(out, S_IFREG) && !exists_as(partial, S_IFREG));
}

/* ---- non-finite weights ------------------------------------------------------------------- */

/* NaN and infinity in weights: refused at load where the loader reads them (vectors, matrices
 * converted at load, --check-tensors), from the step where they are used in place (the logits,
 * per sequence) or read by the expert cache (the unit named), and in the programs */
static void test_nonfinite(void) {
    char seed[600], dir[600], st[800], err[512];
    snprintf(seed, sizeof seed, "%s/seed", golden_dir());
    tmp_path(dir, sizeof dir, "nan");
    snprintf(st, sizeof st, "%s/model.safetensors", dir);
    /* a norm vector: at load */
    CHECK(copy_model_dir(seed, dir) && poison(st, "model.layers.0.input_layernorm.weight", 5, BF16_NAN, 2));
    moe_status s = open_dir(dir, err, sizeof err);
    CHECKF(s == MOE_ERR_NUMERIC && strstr(err, "input_layernorm") && strstr(err, "NaN"), "%d %s", s, err);
    /* a matrix used in place: its first use, by the logits; named at load with the check or when converted */
    CHECK(copy_model_dir(seed, dir) && poison(st, "model.layers.0.self_attn.q_proj.weight", 100, BF16_INF, 2));
    moe_options o = moe_default_options();
    o.n_threads = 1;
    moe_model *m = NULL;
    CHECK(moe_model_open(&m, dir, &o, err, sizeof err) == MOE_OK);
    if (m) {
        moe_session *a = NULL;
        float *lg = malloc(sizeof(float) * (size_t)moe_model_config(m)->vocab_size);
        int32_t ids[3] = {5, 6, 7};
        CHECK(moe_session_new(&a, m, 16, err, sizeof err) == MOE_OK);
        moe_seq q = {.s = a, .tokens = ids, .n = 3, .logits = lg};
        s = moe_step(m, &q, 1, NULL, err, sizeof err);
        CHECKF(s == MOE_ERR_NUMERIC && q.nonfinite && strstr(err, "NaN or an infinity"), "%d %s", s, err);
        moe_session_free(a);
        free(lg);
        moe_model_close(m);
    }
    o.flags = MOE_FLAG_CHECK_TENSORS;
    m = NULL;
    s = moe_model_open(&m, dir, &o, err, sizeof err);
    CHECKF(s == MOE_ERR_NUMERIC && !m && strstr(err, "self_attn.q_proj.weight"), "%d %s", s, err);
    o.flags = 0, o.dense_type = MOE_WTYPE_Q8_0, o.set = MOE_SET_DENSE_TYPE;
    s = moe_model_open(&m, dir, &o, err, sizeof err);
    CHECKF(s == MOE_ERR_NUMERIC && !m && strstr(err, "self_attn.q_proj.weight") && strstr(err, "row"), "%d %s", s, err);
    /* the embedding row of one token: that sequence's logits, not the other's */
    CHECK(copy_model_dir(seed, dir) && poison(st, "model.embed_tokens.weight", 9 * 192 + 3, BF16_NAN, 2));
    o = moe_default_options();
    o.n_threads = 1;
    CHECK(moe_model_open(&m, dir, &o, err, sizeof err) == MOE_OK);
    if (m) {
        const int V = moe_model_config(m)->vocab_size;
        moe_session *a = NULL, *b = NULL;
        float *lg = malloc(sizeof(float) * 2 * (size_t)V);
        int32_t bad[2] = {5, 9}, good[2] = {5, 10};
        CHECK(moe_session_new(&a, m, 16, err, sizeof err) == MOE_OK && moe_session_new(&b, m, 16, err, sizeof err) == MOE_OK);
        moe_seq q[2] = {{.s = a, .tokens = bad, .n = 2, .logits = lg}, {.s = b, .tokens = good, .n = 2, .logits = lg + V}};
        s = moe_step(m, q, 2, NULL, err, sizeof err);
        CHECKF(s == MOE_ERR_NUMERIC && q[0].nonfinite && !q[1].nonfinite && strstr(err, "sequence 0"), "%d %s", s, err);
        int finite = 1;
        for (int i = 0; i < V; i++) finite &= isfinite(lg[V + i]) != 0;
        CHECK(finite && moe_session_pos(b) == 2);
        moe_session_free(a), moe_session_free(b);
        free(lg);
        moe_model_close(m);
    }
    /* moe-batch: the request that meets it is answered with an error, the others normally */
    char in[600], out[600], msg[8192], ans[4096];
    tmp_path(in, sizeof in, "nan-in.jsonl");
    tmp_path(out, sizeof out, "nan-out.jsonl");
    const char lines[] = "{\"custom_id\": \"bad\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [5, 9], \"max_tokens\": 3}}\n"
                         "{\"custom_id\": \"good\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [5, 10], \"max_tokens\": 3, \"n\": 2}}\n"
                         "{\"custom_id\": \"bad2\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [9], \"max_tokens\": 3, \"n\": 3}}\n";
    CHECK(write_all(in, lines, sizeof lines - 1));
    CHECKF(batch_run(dir, in, out, NULL, msg, sizeof msg) == 0 && strstr(msg, "2 failed"), "%s", msg);
    CHECK(answer_of(out, "bad", ans, sizeof ans) == 3 && strstr(ans, "\"status_code\": 500") && strstr(ans, "NaN"));
    CHECK(answer_of(out, "bad2", ans, sizeof ans) == 3 && strstr(ans, "\"status_code\": 500"));
    CHECK(answer_of(out, "good", ans, sizeof ans) == 3 && strstr(ans, "\"status_code\": 200"));
    /* moe-logits refuses to write them */
    char ids[600], cmd[2400];
    tmp_path(ids, sizeof ids, "nan-ids.txt");
    CHECK(write_all(ids, "5 9\n", 4));
    snprintf(cmd, sizeof cmd, "timeout 60 %s/moe-logits -m %s --tokens %s --out /dev/null 2>&1", exe_dir, dir, ids);
    CHECKF(run_cmd(cmd, msg, sizeof msg) == 1 && strstr(msg, "NaN"), "%s", msg);
    /* an expert the cache reads: the step names it */
    CHECK(copy_model_dir(seed, dir) && poison(st, "model.layers.1.block_sparse_moe.experts.3.w2.weight", 7, BF16_INF, 2));
    o = moe_default_options();
    o.n_threads = 1, o.expert_mode = MOE_EXPERTS_CACHE, o.expert_budget = 1 << 20;
    CHECK(moe_model_open(&m, dir, &o, err, sizeof err) == MOE_OK);
    if (m) {
        const moe_config *c = moe_model_config(m);
        moe_session *a = NULL;
        int32_t tok[1] = {5}, *force = calloc((size_t)c->n_layers * (size_t)c->n_active, sizeof *force);
        for (int l = 0; l < c->n_layers; l++)
            for (int k = 0; k < c->n_active; k++) force[l * c->n_active + k] = (3 + k) % c->n_experts;
        CHECK(moe_session_new(&a, m, 16, err, sizeof err) == MOE_OK);
        moe_seq q = {.s = a, .tokens = tok, .n = 1, .force_routes = force};
        s = moe_step(m, &q, 1, NULL, err, sizeof err);
        CHECKF(s == MOE_ERR_NUMERIC && strstr(err, "layer 1, routed expert 3"), "%d %s", s, err);
        moe_session_free(a);
        free(force);
        moe_model_close(m);
    }
}

/* moe-cli on the shipped model with an infinity in its LM head: an error, not NUL bytes */
static void test_nonfinite_cli(void) {
    char dir[600], p[800], cmd[2400], out[8192];
    tmp_path(dir, sizeof dir, "nan-cli");
    CHECK(copy_model_dir(shipped_dir(), dir));
    int done = 0;
    for (int k = 1; k <= 2 && !done; k++) { /* whichever shard holds it */
        snprintf(p, sizeof p, "%s/model-0000%d-of-00002.safetensors", dir, k);
        moe__st_file f;
        char err[256];
        if (moe__st_open(&f, p, err, sizeof err)) continue;
        const moe__st_tensor *t = moe__st_find(&f, "language_model.lm_head.weight");
        if (!t) t = moe__st_find(&f, "lm_head.weight");
        char name[256] = "";
        const int bytes = t ? (t->type == MOE_T_F32 ? 4 : 2) : 0;
        if (t) snprintf(name, sizeof name, "%s", t->name);
        moe__st_close(&f);
        if (bytes) done = poison(p, name, 0, bytes == 4 ? 0x7f800000u : BF16_INF, bytes);
    }
    CHECK(done);
    snprintf(cmd, sizeof cmd, "timeout 60 %s/moe-cli -m %s -p 'In the beginning' -n 4 --temp 0 2>&1", exe_dir, dir);
    const int rc = run_cmd(cmd, out, sizeof out);
    CHECKF(rc == 1 && strstr(out, "NaN or an infinity") && !memchr(out, 0, strlen(out)), "rc %d: %s", rc, out);
}

/* ---- GGUF ---------------------------------------------------------------------------------- */

/* a GGUF without its LM head (output.weight renamed away, or the tensor count lowered so the
 * last tensor is gone) is an error naming what is missing; a header cut short says truncated;
 * a metadata key twice is refused; a bad metadata value names the GGUF file */
static void test_gguf_hostile(void) {
    char seed[600], g[600], h[600], err[512];
    snprintf(seed, sizeof seed, "%s/seed", golden_dir());
    tmp_path(g, sizeof g, "host.gguf");
    tmp_path(h, sizeof h, "host2.gguf");
    if (convert(seed, g, "") != 0) { CHECK(0); return; }
    size_t n = 0;
    char *b = read_all(g, &n);
    if (!b) { CHECK(0); return; }
    /* output.weight renamed */
    char *hit = find_bytes(b, n, "\x0d\0\0\0\0\0\0\0output.weight", 21); /* its tensor info: length, then the name */
    CHECK(hit != NULL);
    if (hit) {
        char *c = malloc(n);
        memcpy(c, b, n);
        c[hit - b + 8 + 7] = 'X'; /* "output.Xeight" */
        CHECK(write_all(h, c, n));
        moe_status s = open_dir(h, err, sizeof err);
        CHECKF(s == MOE_ERR_FORMAT && strstr(err, h) && strstr(err, "missing tensor output.weight"), "%d %s", s, err);
        free(c);
    }
    /* the tensor count lowered by one */
    {
        char *c = malloc(n);
        memcpy(c, b, n);
        uint64_t nt;
        memcpy(&nt, c + 8, 8);
        nt--;
        memcpy(c + 8, &nt, 8);
        CHECK(write_all(h, c, n));
        moe_status s = open_dir(h, err, sizeof err);
        CHECKF(s != MOE_OK && err[0], "lowered count opened: %s", err);
        free(c);
    }
    /* cut inside the header */
    for (size_t cut = 10; cut < 4000 && cut < n; cut = cut * 3) {
        CHECK(write_all(h, b, cut));
        moe_status s = open_dir(h, err, sizeof err);
        CHECKF(s == MOE_ERR_FORMAT && strstr(err, "truncated"), "cut at %zu: %s", cut, err);
    }
    /* a metadata key twice (a hand-made header: key "a", U32, twice) */
    {
        moe__st_file f;
        static const unsigned char two[] = {'G', 'G', 'U', 'F', 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0,
                                            1, 0, 0, 0, 0, 0, 0, 0, 'a', 4, 0, 0, 0, 7, 0, 0, 0,
                                            1, 0, 0, 0, 0, 0, 0, 0, 'a', 4, 0, 0, 0, 8, 0, 0, 0};
        unsigned char *img = malloc(sizeof two + 64);
        memcpy(img, two, sizeof two);
        memset(img + sizeof two, 0, 64);
        moe_status s = moe__weights_parse_mem(&f, img, sizeof two + 64, 1, err, sizeof err);
        CHECKF(s == MOE_ERR_FORMAT && strstr(err, "appears twice"), "%d %s", s, err);
        if (!s) moe__st_close(&f);
        free(img);
    }
    /* a metadata value out of range: the message names the file */
    {
        char *c = malloc(n);
        memcpy(c, b, n);
        char *k = find_bytes(c, n, "expert_used_count", 17);
        CHECK(k != NULL);
        if (k) {
            const uint32_t zero = 0; /* u32 type, then the value */
            memcpy(k + 17 + 4, &zero, 4);
            CHECK(write_all(h, c, n));
            moe_status s = open_dir(h, err, sizeof err);
            CHECKF(s == MOE_ERR_FORMAT && strstr(err, h) && strstr(err, "metadata (as config.json's fields): num_experts_per_token"), "%d %s", s, err);
        }
        free(c);
    }
    free(b);
    /* config.json with a key twice */
    char dir[600], p[800];
    tmp_path(dir, sizeof dir, "dupcfg");
    CHECK(copy_model_dir(seed, dir));
    snprintf(p, sizeof p, "%s/config.json", dir);
    size_t cl = 0;
    char *cfg = read_all(p, &cl);
    char *at = cfg ? strstr(cfg, "\"vocab_size\"") : NULL;
    CHECK(at != NULL);
    if (at) {
        char *d = malloc(cl + 64);
        const size_t pre = (size_t)(at - cfg);
        const int k = snprintf(d, cl + 64, "%.*s\"vocab_size\": 7, %s", (int)pre, cfg, at);
        CHECK(write_all(p, d, (size_t)k));
        moe_status s = open_dir(dir, err, sizeof err);
        CHECKF(s == MOE_ERR_FORMAT && strstr(err, "vocab_size") && strstr(err, "twice"), "%d %s", s, err);
        free(d);
    }
    free(cfg);
}

/* ---- HTTP requests (moe-server's parser) ---------------------------------------------------- */

static int http_of(const char *req, size_t max_header, size_t max_body, http_request *rq, size_t *used) {
    const char *why = NULL;
    const int st = http_parse(req, strlen(req), max_header, max_body, rq, used, &why);
    if (st >= 400 && !why) return -1; /* an error without a reason is itself a failure */
    return st;
}

/* whole, pipelined and partial requests; each kind of malformed one answered with its status */
static void test_http_requests(void) {
    http_request rq;
    size_t used;
    const char *post = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 4\r\n\r\n{\"a\"}";
    CHECK(http_of(post, 8192, 1 << 20, &rq, &used) == HTTP_OK && used == strlen(post) - 1); /* one byte left: the next request's */
    CHECK(rq.method_len == 4 && !memcmp(rq.method, "POST", 4) && rq.target_len == 15 && rq.minor == 1 && rq.keep_alive);
    CHECK(rq.body_len == 4 && !memcmp(rq.body, "{\"a\"", 4) && rq.n_headers == 3);
    size_t vl = 0;
    const char *v = http_get(&rq, "content-type", &vl);
    CHECK(v && vl == 16 && !memcmp(v, "application/json", 16));
    /* every prefix of a request is incomplete, never an error */
    char buf[512];
    const char *get = "GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: keep-alive, close\r\n\r\n";
    for (size_t k = 0; k < strlen(get); k++) {
        memcpy(buf, get, k), buf[k] = 0;
        CHECKF(http_of(buf, 8192, 1 << 20, &rq, &used) == HTTP_INCOMPLETE, "prefix %zu", k);
    }
    CHECK(http_of(get, 8192, 1 << 20, &rq, &used) == HTTP_OK && !rq.keep_alive && !rq.body_len);
    CHECK(http_of("GET / HTTP/1.0\n\n", 8192, 1 << 20, &rq, &used) == HTTP_OK && !rq.keep_alive && rq.minor == 0); /* bare LF; 1.0 closes */
    /* a body not yet all there */
    CHECK(http_of("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n12345", 8192, 1 << 20, &rq, &used) == HTTP_INCOMPLETE);
    const struct { const char *req; int status; } bad[] = {
        {"GET / HTTP/2.0\r\nHost: x\r\n\r\n", 505},
        {"GET / FTP/1.1\r\nHost: x\r\n\r\n", 400},
        {"GET  / HTTP/1.1\r\nHost: x\r\n\r\n", 400},
        {"G(T / HTTP/1.1\r\nHost: x\r\n\r\n", 400},
        {"GET / HTTP/1.1\r\n\r\n", 400},                                          /* no Host */
        {"GET / HTTP/1.1\r\nHost : x\r\n\r\n", 400},                             /* blank before the colon */
        {"GET / HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n  folded\r\n\r\n", 400},           /* obs-fold */
        {"GET / HTTP/1.1\r\nHost: x\x01y\r\n\r\n", 400},                          /* control character */
        {"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nContent-Length: 5\r\n\r\nabcde", 400},
        {"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400},
        {"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999\r\n\r\n", 400},
        {"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", 501},
        {"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n", 413},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        const int st = http_of(bad[i].req, 8192, 1 << 20, &rq, &used);
        CHECKF(st == bad[i].status, "request %zu: %d, want %d", i, st, bad[i].status);
    }
    /* header limits: one too large, complete or not, and too many fields */
    char big[12000];
    int k = snprintf(big, sizeof big, "GET / HTTP/1.1\r\nHost: x\r\nX-Big: ");
    memset(big + k, 'a', 9000), big[k + 9000] = 0;
    CHECK(http_of(big, 8192, 1 << 20, &rq, &used) == 431); /* never ends within the limit */
    k = snprintf(big, sizeof big, "GET / HTTP/1.1\r\nHost: x\r\n");
    for (int i = 0; i < HTTP_MAX_HEADERS; i++) k += snprintf(big + k, sizeof big - (size_t)k, "X-%d: %d\r\n", i, i);
    snprintf(big + k, sizeof big - (size_t)k, "\r\n");
    CHECK(http_of(big, 8192, 1 << 20, &rq, &used) == 431);
}

const test_case hostile_tests[] = {
    {"hostile.http_requests", test_http_requests, "moe-server's HTTP/1.1 parser: whole, partial and pipelined requests; each malformed kind's status", 0},
    {"hostile.special_files", test_special_files, "FIFOs and devices as model, tokenizer and program input files: refused, never waited on", 0},
    {"hostile.batch_output", test_batch_output, "moe-batch's output: not its input, not shared with another moe-batch, only whole answers count", 0},
    {"hostile.batch_huge_line", test_batch_huge_line, "60 MB and 3-million-value input lines refused in 300 MB of address space, the rest answered", 0},
    {"hostile.batch_messages", test_batch_messages, "bad requests refused with the reason: negative ids, fractional max_tokens, empty messages, keys twice", 0},
    {"hostile.convert_output", test_convert_output, "moe-convert never replaces a FIFO, directory or link, nor writes beside another moe-convert", 0},
    {"hostile.nonfinite", test_nonfinite, "NaN and infinity in weights: named at load, or by the step that meets them; other sequences go on", 0},
    {"hostile.nonfinite_cli", test_nonfinite_cli, "moe-cli with an infinity in the LM head exits 1 with a message", 0},
    {"hostile.gguf", test_gguf_hostile, "GGUF without its LM head, cut in its header, with a key twice, with a bad value: named errors", 0},
    {NULL, NULL, NULL, 0},
};
