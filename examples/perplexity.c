/* moe-perplexity: how much a quantized model departs from its original on the same tokens.
 *
 *   moe-perplexity -m MODEL (--tokens IDS_FILE | -f TEXT_FILE) [--dense TYPE] [--experts TYPE]
 *                  [--ref MODEL2] [-c CTX] [--chunks N] [--save-ref FILE] [--kv-type f32|bf16|q8]
 *                  [--mxfp4 int8] [--act 8|16] [-t THREADS] [--json] [--ref-routing] [expert-cache flags]
 *   moe-perplexity -m MODEL --ref-logits FILE [the same options but the input's]
 *
 * Runs the tokens through the reference (MODEL as stored, or MODEL2) and through the test model
 * (MODEL with its matrices converted at load to TYPE: f32, bf16, q8_0, q4_0), then reports the
 * mean KL divergence KL(ref || test) per token in nats, top-1 agreement, and the perplexity of
 * each (position t predicting token t+1). Without -c the whole stream is one sequence and every
 * position counts; with -c CTX it is cut into windows of CTX tokens, each a fresh sequence, and
 * as llama-perplexity does only the second half of each window counts (the first half is its
 * context). Both models are open at once and a window's logits are compared as they come, so
 * memory holds one window's logits per model, whatever the stream's length.
 * --ref-routing also reports the KL with the test model forced onto the reference's experts: on
 * small random models a tiny numeric change flips near-tie routing decisions, and this separates
 * the two effects. --kv-type gives the test model that MLA latent cache (the reference keeps f32)
 * and runs it one token at a time, as generation does, so that decode's attention over the cache
 * is measured. -f tokenizes a text file with the test model's tokenizer (no special tokens, no
 * BOS). --save-ref FILE also writes the reference's ids, windows and scored logits (and routing,
 * with --ref-routing) to FILE; --ref-logits FILE then stands in for the reference model, so a
 * large original runs once for many quantized files (as llama-perplexity's
 * --kl-divergence-base). Exit 0, 1 on errors, 2 on usage. */
#include "../moe.h"
#include "cache_flags.h"
#include "files.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int usage(const char *msg) {
    if (msg) fprintf(stderr, "moe-perplexity: %s\n", msg);
    fprintf(stderr, "usage: moe-perplexity -m MODEL (--tokens IDS_FILE | -f TEXT_FILE) [--dense TYPE] [--experts TYPE]\n"
                    "                      [--ref MODEL2] [-c CTX] [--chunks N] [--save-ref FILE] [--kv-type f32|bf16|q8]\n"
                    "                      [--mxfp4 int8] [--act 8|16] [-t THREADS] [--json] [--ref-routing] [--kernels NAME]\n"
                    "                      [--load-mode mmap|cache] [--expert-budget SIZE] [--dense-budget SIZE]\n"
                    "                      [--io-threads N] [--prefetch on|off]\n"
                    "       moe-perplexity -m MODEL --ref-logits FILE [the same options but the input's and the reference's]\n"
                    "  TYPE: f32, bf16, q8_0, q4_0 (converted at load; default: as stored)\n"
                    "  -c CTX: windows of CTX tokens, each a fresh sequence, the second half of each scored\n"
                    "  (default: the whole stream as one sequence, every position scored); --chunks N: the first N\n"
                    "  --save-ref FILE: also write the reference's ids, windows and scored logits (and routing, with\n"
                    "  --ref-routing); --ref-logits FILE: take them from such a file instead of running the reference\n"
                    "  --kv-type, --mxfp4, --act, --kernels: the model under test only (the reference keeps f32\n"
                    "  caches and input and the CPU's best kernels); the expert-cache flags apply to both\n");
    return 2;
}

static int parse_type(const char *s) {
    const char *names[] = {"asis", "f32", "bf16", "q8_0", "q4_0"};
    for (int i = 0; i < 5; i++)
        if (!strcmp(s, names[i])) return i;
    return -1;
}

/* log-softmax in double */
static void log_softmax(const float *x, double *out, int n) {
    double mx = x[0], s = 0;
    for (int i = 1; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    for (int i = 0; i < n; i++) s += exp(x[i] - mx);
    double l = mx + log(s);
    for (int i = 0; i < n; i++) out[i] = x[i] - l;
}

static moe_model *open_model(const char *path, const moe_options *o) {
    char err[512];
    moe_model *m = NULL;
    moe_status st = moe_model_open(&m, path, o, err, sizeof err);
    if (st) fprintf(stderr, "moe-perplexity: %s: %s: %s\n", path, moe_status_str(st), err);
    return st ? NULL : m;
}

/* the logits of every position of ids[0..n) as a fresh sequence of m into lg[n, V], one token a
 * step when stepwise; routes_out receives the routing (if non-NULL), routes_in forces it */
static int window_logits(moe_model *m, const int32_t *ids, int n, int stepwise, float *lg, int32_t *routes_out,
                         const int32_t *routes_in) {
    char err[512];
    moe_session *s = NULL;
    moe_status st = moe_session_new(&s, m, n, err, sizeof err);
    const moe_config *c = moe_model_config(m);
    const size_t V = (size_t)c->vocab_size, rw = (size_t)c->n_layers * c->n_active; /* routing entries per token */
    for (int t = 0; t < n && !st; t += stepwise ? 1 : n) {
        moe_seq q = {.s = s, .tokens = ids + t, .n = stepwise ? 1 : n, .logits = lg + (size_t)t * V, .logits_all = 1,
                     .routes = routes_out ? routes_out + t * rw : NULL, .force_routes = routes_in ? routes_in + t * rw : NULL};
        st = moe_step(m, &q, 1, NULL, err, sizeof err);
    }
    if (st) fprintf(stderr, "moe-perplexity: %s: %s\n", moe_status_str(st), err);
    moe_session_free(s);
    return st ? -1 : 0;
}

/* running sums over the scored positions */
typedef struct {
    double kl, kl_max, nll_ref, nll, kl_fixed;
    long scored, predicted, agree;
} tally;

/* adds positions s0 .. n-1 of one window (ref and test logits [n, V], fixed: the test model on
 * the reference's routing or NULL); position t predicts ids[t + 1] when t + 1 < n */
static void score_window(tally *y, const float *ref, const float *test, const float *fixed, const int32_t *ids, int n, int s0, int V,
                         double *la, double *lb) {
    for (int t = s0; t < n; t++) {
        const float *ra = ref + (size_t)t * V, *rb = test + (size_t)t * V;
        log_softmax(ra, la, V);
        log_softmax(rb, lb, V);
        double k = 0;
        int ta = 0, tb = 0;
        for (int i = 0; i < V; i++) {
            k += exp(la[i]) * (la[i] - lb[i]);
            if (ra[i] > ra[ta]) ta = i;
            if (rb[i] > rb[tb]) tb = i;
        }
        y->kl += k;
        y->kl_max = k > y->kl_max ? k : y->kl_max;
        y->agree += ta == tb;
        y->scored++;
        if (t + 1 < n) y->nll_ref -= la[ids[t + 1]], y->nll -= lb[ids[t + 1]], y->predicted++;
        if (fixed) { /* same position, test model forced onto the reference's experts */
            log_softmax(fixed + (size_t)t * V, lb, V);
            for (int i = 0; i < V; i++) y->kl_fixed += exp(la[i]) * (la[i] - lb[i]);
        }
    }
}

/* the ids of a text file by m's tokenizer (caller frees), their count in *n; NULL on errors */
static int32_t *tokenize_file(const moe_model *m, const char *path, int *n) {
    char err[512];
    size_t len = 0, got = 0;
    errno = 0; /* slurp sets it only when the open fails */
    char *text = slurp(path, &len);
    if (!text) {
        fprintf(stderr, "moe-perplexity: %s: %s\n", path, errno ? strerror(errno) : "read error");
        return NULL;
    }
    moe_tokenizer *tk = NULL;
    int32_t *ids = malloc(sizeof *ids * (len + 1));
    moe_status st = ids ? moe_tokenizer_for_model(&tk, m, err, sizeof err) : MOE_ERR_NOMEM;
    if (!st) st = moe_tokenize(tk, text, len, 0, ids, len + 1, &got, err, sizeof err);
    if (!st && got > 0x7fffffff) st = MOE_ERR_RANGE, snprintf(err, sizeof err, "more than 2^31 tokens");
    if (st) fprintf(stderr, "moe-perplexity: %s: %s: %s\n", path, moe_status_str(st), st == MOE_ERR_NOMEM ? "out of memory" : err);
    moe_tokenizer_free(tk);
    free(text);
    if (st) { free(ids); return NULL; }
    *n = (int)got;
    return ids;
}

/* ---- the reference's logits in a file (--save-ref / --ref-logits) ----
 * "MOEREF01", then int32s: 0x01020304 (the writer's byte order), vocab, window, windows, the
 * first scored position of a window, routing entries per token (0: none); the ids [windows x
 * window]; then for each window the logits of its scored positions [window - first, vocab] (f32)
 * and its routing [window, entries] (int32). Written to FILE.tmp and renamed when complete. */
typedef struct {
    int32_t vocab, win, nwin, first, rpt;
} ref_header;

static const char REF_MAGIC[8] = {'M', 'O', 'E', 'R', 'E', 'F', '0', '1'};

static int write_ref_header(FILE *f, const ref_header *h, const int32_t *ids) {
    const int32_t v[6] = {0x01020304, h->vocab, h->win, h->nwin, h->first, h->rpt};
    return fwrite(REF_MAGIC, 8, 1, f) == 1 && fwrite(v, sizeof v, 1, f) == 1 &&
           fwrite(ids, sizeof *ids, (size_t)h->win * h->nwin, f) == (size_t)h->win * h->nwin;
}

/* opens a reference file, checks its header against its size (a truncated or foreign file is
 * refused), reads its ids (caller frees); NULL with a message on errors */
static FILE *open_ref(const char *path, ref_header *h, int32_t **ids) {
    FILE *f = fopen(path, "rb");
    int32_t v[6];
    char magic[8];
    const char *why = NULL;
    if (!f) { fprintf(stderr, "moe-perplexity: %s: %s\n", path, strerror(errno)); return NULL; }
    if (fread(magic, 8, 1, f) != 1 || memcmp(magic, REF_MAGIC, 8) || fread(v, sizeof v, 1, f) != 1) why = "not a moe-perplexity reference file";
    else if (v[0] != 0x01020304) why = "written on a machine of the other byte order";
    *h = (ref_header){v[1], v[2], v[3], v[4], v[5]};
    if (!why && (h->vocab < 1 || h->win < 2 || h->nwin < 1 || h->first < 0 || h->first >= h->win || h->rpt < 0 || h->rpt > (1 << 20) ||
                 h->vocab > (1 << 26) || (int64_t)h->win * h->nwin > (1 << 30)))
        why = "bad header";
    const uint64_t rows = (uint64_t)(h->win - h->first), body = (rows * (uint64_t)h->vocab * 4 + (uint64_t)h->win * (uint64_t)h->rpt * 4);
    const uint64_t want = 32 + 4 * (uint64_t)h->win * (uint64_t)h->nwin + body * (uint64_t)h->nwin;
    if (!why && (fseek(f, 0, SEEK_END) || (uint64_t)ftell(f) != want || fseek(f, 32, SEEK_SET))) why = "truncated, or longer than its header says";
    *ids = why ? NULL : malloc(sizeof **ids * (size_t)h->win * (size_t)h->nwin);
    if (!why && !*ids) why = "out of memory";
    if (!why && fread(*ids, sizeof **ids, (size_t)h->win * h->nwin, f) != (size_t)h->win * h->nwin) why = "read error";
    if (why) {
        fprintf(stderr, "moe-perplexity: %s: %s\n", path, why);
        free(*ids), *ids = NULL;
        fclose(f);
        return NULL;
    }
    return f;
}

/* one window's scored logits (into lg at position first) and routing from a reference file */
static int read_ref_window(FILE *f, const ref_header *h, float *lg, int32_t *routes) {
    const size_t nl = (size_t)(h->win - h->first) * h->vocab, nr = (size_t)h->win * h->rpt;
    if (fread(lg + (size_t)h->first * h->vocab, sizeof *lg, nl, f) != nl) return -1;
    if (nr && routes && fread(routes, sizeof *routes, nr, f) != nr) return -1;
    if (nr && !routes && fseek(f, (long)(nr * sizeof *routes), SEEK_CUR)) return -1;
    return 0;
}

static int write_ref_window(FILE *f, const ref_header *h, const float *lg, const int32_t *routes) {
    const size_t nl = (size_t)(h->win - h->first) * h->vocab, nr = (size_t)h->win * h->rpt;
    return fwrite(lg + (size_t)h->first * h->vocab, sizeof *lg, nl, f) == nl && (!nr || fwrite(routes, sizeof *routes, nr, f) == nr) ? 0 : -1;
}

/* the ids to score: a file of ids, or a text file by mt's tokenizer; their count in *n */
static int32_t *input_ids(moe_model *mt, const char *tokens, const char *text, int *n) {
    int32_t *ids = NULL;
    if (text) return tokenize_file(mt, text, n);
    const char *why;
    if ((*n = read_ids(tokens, &ids, &why)) < 0) fprintf(stderr, "moe-perplexity: %s: %s\n", tokens, why), *n = 0;
    return ids;
}

static void report(const tally *y, int json, int nwin, int win, int routed) {
    const double mkl = y->kl / (double)y->scored, top1 = (double)y->agree / (double)y->scored;
    const double ppl_a = exp(y->nll_ref / (double)y->predicted), ppl_b = exp(y->nll / (double)y->predicted);
    if (json) {
        printf("{\"tokens\": %d, \"windows\": %d, \"ctx\": %d, \"scored\": %ld, \"kl_mean\": %.6g, \"kl_max\": %.6g, \"top1_agree\": %.6f, "
               "\"ppl_ref\": %.6f, \"ppl\": %.6f",
               nwin * win, nwin, win, y->scored, mkl, y->kl_max, top1, ppl_a, ppl_b);
        if (routed) printf(", \"kl_mean_ref_routing\": %.6g", y->kl_fixed / (double)y->scored);
        printf("}\n");
    } else {
        printf("tokens %d (%d window%s of %d, %ld positions scored)\nmean KL(ref||test) %.6g nats/token (max %.6g)\n"
               "top-1 agreement %.4f\nperplexity ref %.4f, test %.4f\n",
               nwin * win, nwin, nwin == 1 ? "" : "s", win, y->scored, mkl, y->kl_max, top1, ppl_a, ppl_b);
        if (routed) printf("mean KL with the reference's routing %.6g nats/token\n", y->kl_fixed / (double)y->scored);
    }
}

int main(int argc, char **argv) {
    const char *model = NULL, *ref = NULL, *tokens = NULL, *text = NULL, *save = NULL, *load = NULL;
    int json = 0, fixed = 0, stepwise = 0, ctx = 0, chunks = 0;
    moe_options opt = moe_default_options();
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *why = NULL;
        int more = i + 1 < argc, ck;
        if (!strcmp(a, "-m") && more) model = argv[++i];
        else if (!strcmp(a, "--ref") && more) ref = argv[++i];
        else if (!strcmp(a, "--tokens") && more) tokens = argv[++i];
        else if (!strcmp(a, "-f") && more) text = argv[++i];
        else if (!strcmp(a, "--save-ref") && more) save = argv[++i];
        else if (!strcmp(a, "--ref-logits") && more) load = argv[++i];
        else if (!strcmp(a, "--dense") && more) {
            if ((opt.dense_type = parse_type(argv[++i])) < 0) return usage("unknown --dense type");
        } else if (!strcmp(a, "--experts") && more) {
            if ((opt.expert_type = parse_type(argv[++i])) < 0) return usage("unknown --experts type");
        } else if (!strcmp(a, "-t") && more) {
            opt.n_threads = atoi(argv[++i]);
            if (opt.n_threads < 1) return usage("-t needs a thread count >= 1");
        } else if (!strcmp(a, "-c") && more) {
            if ((ctx = atoi(argv[++i])) < 2) return usage("-c needs a window of at least 2 tokens");
        } else if (!strcmp(a, "--chunks") && more) {
            if ((chunks = atoi(argv[++i])) < 1) return usage("--chunks needs a count >= 1");
        } else if (!strcmp(a, "--kv-type") && more) {
            if ((opt.kv_type = parse_kv_type(argv[++i])) < 0) return usage("--kv-type is f32, bf16 or q8");
            stepwise = 1;
        } else if (!strcmp(a, "--json")) json = 1;
        else if (!strcmp(a, "--ref-routing")) fixed = 1;
        else if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(NULL); return 0; }
        else if ((ck = cache_flag(argc, argv, &i, &opt, &why)) != 0) { if (ck < 0) return usage(why); }
        else return usage("unknown or incomplete argument");
    }
    if (!model) return usage("-m is required");
    if (load && (tokens || text || ref || save || ctx || chunks)) return usage("--ref-logits brings its own ids and windows: no --tokens, -f, --ref, --save-ref, -c or --chunks");
    if (!load && !tokens == !text) return usage("one of --tokens, -f and --ref-logits is required");
    if (chunks && !ctx) return usage("--chunks needs -c");
    moe_options ro = opt; /* the reference: as stored, f32 cache and input, the CPU's best kernels */
    ro.dense_type = ro.expert_type = MOE_WTYPE_ASIS;
    ro.kv_type = MOE_KV_F32;
    ro.flags &= ~(unsigned)(MOE_FLAG_MXFP4_INT8 | MOE_FLAG_ACT16);
    ro.kernels = NULL;
    moe_model *mt = open_model(model, &opt), *mr = NULL;
    FILE *rf = NULL, *sf = NULL; /* the reference file read, the one written */
    char tmp[4200];
    int32_t *ids = NULL, *routes = NULL;
    float *a = NULL, *b = NULL, *bf = NULL;
    double *la = NULL, *lb = NULL;
    int n = 0, rc = 1;
    ref_header h = {0};
    if (!mt) goto out;
    const moe_config *ct = moe_model_config(mt);
    const int V = ct->vocab_size, rpt = ct->n_experts ? ct->n_layers * ct->n_active : 0;
    if (load) { /* the ids, windows and reference logits from the file */
        if (!(rf = open_ref(load, &h, &ids))) goto out;
        n = h.win * h.nwin;
        if (h.vocab != V) { fprintf(stderr, "moe-perplexity: %s: vocabulary %d, the model's %d\n", load, h.vocab, V); goto out; }
        if (fixed && (!h.rpt || h.rpt != rpt)) { fprintf(stderr, "moe-perplexity: %s: no routing of this model's shape (saved without --ref-routing?)\n", load); goto out; }
    } else {
        if (!(mr = open_model(ref ? ref : model, &ro)) || !(ids = input_ids(mt, tokens, text, &n))) goto out;
        const moe_config *cr = moe_model_config(mr);
        if (cr->vocab_size != V) { fprintf(stderr, "moe-perplexity: the models have different vocabularies\n"); goto out; }
        const int win = ctx ? ctx : n, nwin = n >= 2 && n >= win ? (chunks && chunks < n / win ? chunks : n / win) : 0;
        if (nwin < 1) { fprintf(stderr, "moe-perplexity: need at least %d token ids, got %d\n", ctx ? ctx : 2, n); goto out; }
        if (fixed && cr->n_experts && (cr->n_layers * cr->n_active != rpt)) { fprintf(stderr, "moe-perplexity: the models route differently\n"); goto out; }
        h = (ref_header){V, win, nwin, ctx ? win / 2 : 0, fixed && cr->n_experts ? rpt : 0};
    }
    for (int t = 0; t < h.win * h.nwin; t++)
        if (ids[t] < 0 || ids[t] >= V) { fprintf(stderr, "moe-perplexity: token id %d at %d is past the vocabulary (%d)\n", ids[t], t, V); goto out; }
    const int routed = fixed && h.rpt && rpt;
    const size_t per = (size_t)h.win * V;
    a = malloc(sizeof(float) * per), b = malloc(sizeof(float) * per), bf = routed ? malloc(sizeof(float) * per) : NULL;
    routes = h.rpt ? malloc(sizeof(int32_t) * (size_t)h.win * h.rpt) : NULL;
    la = malloc(sizeof(double) * (size_t)V), lb = malloc(sizeof(double) * (size_t)V);
    if (!a || !b || !la || !lb || (routed && !bf) || (h.rpt && !routes)) {
        fprintf(stderr, "moe-perplexity: out of memory for a window's logits (%d tokens x %d)\n", h.win, V);
        goto out;
    }
    if (save) {
        snprintf(tmp, sizeof tmp, "%s.tmp", save);
        if (!(sf = fopen(tmp, "wb")) || !write_ref_header(sf, &h, ids)) { fprintf(stderr, "moe-perplexity: %s: %s\n", tmp, strerror(errno)); goto out; }
    }
    tally y = {0};
    for (int w = 0; w < h.nwin; w++) {
        const int32_t *wi = ids + (size_t)w * h.win;
        if (rf ? read_ref_window(rf, &h, a, routed ? routes : NULL) : window_logits(mr, wi, h.win, 0, a, routes, NULL)) {
            if (rf) fprintf(stderr, "moe-perplexity: %s: read error\n", load);
            goto out;
        }
        if (sf && write_ref_window(sf, &h, a, routes)) { fprintf(stderr, "moe-perplexity: %s: %s\n", tmp, strerror(errno)); goto out; }
        if (window_logits(mt, wi, h.win, stepwise, b, NULL, NULL) || (routed && window_logits(mt, wi, h.win, stepwise, bf, NULL, routes))) goto out;
        score_window(&y, a, b, routed ? bf : NULL, wi, h.win, h.first, V, la, lb);
        if (!json && h.nwin > 1)
            fprintf(stderr, "\rwindow %d/%d: perplexity ref %.4f, test %.4f", w + 1, h.nwin, exp(y.nll_ref / (double)y.predicted),
                    exp(y.nll / (double)y.predicted));
    }
    if (!json && h.nwin > 1) fprintf(stderr, "\n");
    if (sf) {
        const int bad = fclose(sf) != 0 || rename(tmp, save) != 0;
        sf = NULL;
        if (bad) { fprintf(stderr, "moe-perplexity: %s: %s\n", save, strerror(errno)); goto out; }
    }
    report(&y, json, h.nwin, h.win, routed);
    rc = fflush(stdout) ? 1 : 0;
out:
    if (sf) fclose(sf), remove(tmp);
    if (rf) fclose(rf);
    free(a), free(b), free(bf), free(routes), free(la), free(lb), free(ids);
    moe_model_close(mt), moe_model_close(mr);
    return rc;
}
