/* moe-perplexity: how much a quantized model departs from its original on the same tokens.
 *
 *   moe-perplexity -m MODEL (--tokens IDS_FILE | -f TEXT_FILE) [--dense TYPE] [--experts TYPE]
 *                  [--ref MODEL2] [-c CTX] [--chunks N] [--save-ref FILE] [--kv-type f32|bf16|q8]
 *                  [--mxfp4 int8] [--act 8|16] [-t THREADS] [--json] [--ref-routing] [expert-cache flags]
 *   moe-perplexity -m MODEL --ref-logits FILE [the same options but the input's]
 *
 * Alone (`moe-perplexity -m MODEL -f TEXT`, nothing converted, no reference) it runs the model
 * once and reports its perplexity, as llama-perplexity does. Otherwise it
 * runs the tokens through the reference (MODEL as stored, or MODEL2) and through the test model
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
#define _POSIX_C_SOURCE 200809L /* open, fstat, fcntl (files.h) */
#include "../moe.h"
#include "args.h"
#include "cache_flags.h"
#include "files.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static arg_help help = {
    "usage: moe-perplexity -m MODEL (--tokens IDS_FILE | -f TEXT_FILE) [--dense TYPE] [--experts TYPE]\n"
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
    "  caches and input and the CPU's best kernels); the expert-cache flags apply to both\n", NULL};

static int usage(const char *msg) { return arg_usage("moe-perplexity", help, msg); }

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
    const char *why = NULL;
    char *text = slurp(path, &len, &why);
    if (!text) {
        fprintf(stderr, "moe-perplexity: %s: %s\n", path, why);
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
    const char *why = NULL;
    FILE *f = open_input(path, &why);
    int32_t v[6];
    char magic[8];
    if (!f) { fprintf(stderr, "moe-perplexity: %s: %s\n", path, why); return NULL; }
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

static void report(const tally *y, int json, int nwin, int win, int routed, int alone) {
    const double mkl = y->kl / (double)y->scored, top1 = (double)y->agree / (double)y->scored;
    const double ppl_a = exp(y->nll_ref / (double)y->predicted), ppl_b = exp(y->nll / (double)y->predicted);
    if (alone && json) {
        printf("{\"tokens\": %d, \"windows\": %d, \"ctx\": %d, \"scored\": %ld, \"ppl\": %.6f}\n", nwin * win, nwin, win, y->scored, ppl_b);
    } else if (alone) {
        printf("tokens %d (%d window%s of %d, %ld positions scored)\nperplexity %.4f\n", nwin * win, nwin, nwin == 1 ? "" : "s", win,
               y->scored, ppl_b);
    } else if (json) {
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

typedef struct {
    const char *model, *ref, *tokens, *text, *save, *load;
    int json, fixed, stepwise, ctx, chunks;
    moe_options opt;
} options;

/* Parses the command line into o; 0, or usage()'s exit status with *done set. */
static int parse_args(int argc, char **argv, options *o, int *done) {
    *o = (options){.opt = moe_default_options()};
    *done = 1;
    for (int i = 1; i < argc; i++) {
        double v;
        const char *a = argv[i], *why = NULL;
        int more = i + 1 < argc, ck;
        if (!strcmp(a, "-m") && more) o->model = argv[++i];
        else if (!strcmp(a, "--ref") && more) o->ref = argv[++i];
        else if (!strcmp(a, "--tokens") && more) o->tokens = argv[++i];
        else if (!strcmp(a, "-f") && more) o->text = argv[++i];
        else if (!strcmp(a, "--save-ref") && more) o->save = argv[++i];
        else if (!strcmp(a, "--ref-logits") && more) o->load = argv[++i];
        else if (!strcmp(a, "--dense") && more) {
            if ((o->opt.dense_type = parse_type(argv[++i])) < 0) return arg_fail("moe-perplexity", help, "--dense %s: must be asis, f32, bf16, q8_0 or q4_0", argv[i]);
        } else if (!strcmp(a, "--experts") && more) {
            if ((o->opt.expert_type = parse_type(argv[++i])) < 0) return arg_fail("moe-perplexity", help, "--experts %s: must be asis, f32, bf16, q8_0 or q4_0", argv[i]);
        } else if (!strcmp(a, "-t") && more) {
            if (arg_num("moe-perplexity", help, a, argv[++i], 1, 1024, 1, &v)) return 2;
            o->opt.n_threads = (int)v;
        } else if (!strcmp(a, "-c") && more) {
            if (arg_num("moe-perplexity", help, a, argv[++i], 2, 1e9, 1, &v)) return 2;
            o->ctx = (int)v;
        } else if (!strcmp(a, "--chunks") && more) {
            if (arg_num("moe-perplexity", help, a, argv[++i], 1, 1e9, 1, &v)) return 2;
            o->chunks = (int)v;
        } else if (!strcmp(a, "--kv-type") && more) {
            if ((o->opt.kv_type = parse_kv_type(argv[++i])) < 0) return arg_fail("moe-perplexity", help, "--kv-type %s: must be f32, bf16 or q8", argv[i]);
            o->stepwise = 1;
        } else if (!strcmp(a, "--json")) o->json = 1;
        else if (!strcmp(a, "--ref-routing")) o->fixed = 1;
        else if (!strcmp(a, "-h") || !strcmp(a, "--help")) return usage(NULL);
        else if ((ck = cache_flag(argc, argv, &i, &o->opt, &why)) != 0) { if (ck < 0) return usage(why); }
        else return arg_unknown("moe-perplexity", help, a, more ? argv[i + 1] : NULL);
    }
    if (!o->model) return usage("-m is required");
    if (o->load && (o->tokens || o->text || o->ref || o->save || o->ctx || o->chunks))
        return usage("--ref-logits brings its own ids and windows: no --tokens, -f, --ref, --save-ref, -c or --chunks");
    if (!o->load && !o->tokens == !o->text) return usage("one of --tokens, -f and --ref-logits is required");
    if (o->chunks && !o->ctx) return usage("--chunks needs -c");
    *done = 0;
    return 0;
}

/* 1 when the command asks for no comparison: no second model or reference file, the model
 * as stored with the reference's caches, input and kernels; then it runs once, for its perplexity */
static int alone(const options *o) {
    return !o->ref && !o->load && !o->save && !o->fixed && !o->stepwise && o->opt.dense_type == MOE_WTYPE_ASIS &&
           o->opt.expert_type == MOE_WTYPE_ASIS && !o->opt.kernels && !(o->opt.flags & (MOE_FLAG_MXFP4_INT8 | MOE_FLAG_ACT16));
}

/* Everything a run holds. Functions below return 0, or 1 after printing what went wrong. */
typedef struct {
    const options *o;
    moe_model *mt, *mr; /* the model under test; the reference (NULL with --ref-logits) */
    int V, rpt;         /* vocabulary; routing ids per token (0: no routed experts) */
    FILE *rf, *sf;      /* the reference file read, the one written (as tmp) */
    char tmp[4200];
    int32_t *ids, *routes;
    float *a, *b, *bf; /* a window's logits: reference, test, test on the reference's routing */
    double *la, *lb;
    ref_header h;
    int routed; /* the pinned-routing figures are computed */
} run;

/* the ids, windows and (with --ref-logits) reference logits' file; the models opened */
static int open_inputs(run *r) {
    const options *o = r->o;
    moe_options ro = o->opt; /* the reference: as stored, f32 cache and input, the CPU's best kernels */
    ro.dense_type = ro.expert_type = MOE_WTYPE_ASIS;
    ro.kv_type = MOE_KV_F32;
    ro.flags &= ~(unsigned)(MOE_FLAG_MXFP4_INT8 | MOE_FLAG_ACT16);
    ro.kernels = NULL;
    if (!(r->mt = open_model(o->model, &o->opt))) return 1;
    const moe_config *ct = moe_model_config(r->mt);
    r->V = ct->vocab_size, r->rpt = ct->n_experts ? ct->n_layers * ct->n_active : 0;
    const int V = r->V, rpt = r->rpt;
    if (o->load) { /* the ids, windows and reference logits from the file */
        if (!(r->rf = open_ref(o->load, &r->h, &r->ids))) return 1;
        if (r->h.vocab != V) return fprintf(stderr, "moe-perplexity: %s: vocabulary %d, the model's %d\n", o->load, r->h.vocab, V), 1;
        if (o->fixed && (!r->h.rpt || r->h.rpt != rpt))
            return fprintf(stderr, "moe-perplexity: %s: no routing of this model's shape (saved without --ref-routing?)\n", o->load), 1;
    } else {
        int n = 0;
        if ((!alone(o) && !(r->mr = open_model(o->ref ? o->ref : o->model, &ro))) || !(r->ids = input_ids(r->mt, o->tokens, o->text, &n)))
            return 1;
        const moe_config *cr = moe_model_config(r->mr ? r->mr : r->mt);
        if (cr->vocab_size != V) return fprintf(stderr, "moe-perplexity: the models have different vocabularies\n"), 1;
        const int win = o->ctx ? o->ctx : n, nwin = n >= 2 && n >= win ? (o->chunks && o->chunks < n / win ? o->chunks : n / win) : 0;
        if (nwin < 1) return fprintf(stderr, "moe-perplexity: need at least %d token ids, got %d\n", o->ctx ? o->ctx : 2, n), 1;
        if (o->fixed && cr->n_experts && (cr->n_layers * cr->n_active != rpt)) return fprintf(stderr, "moe-perplexity: the models route differently\n"), 1;
        r->h = (ref_header){V, win, nwin, o->ctx ? win / 2 : 0, o->fixed && cr->n_experts ? rpt : 0};
    }
    for (int t = 0; t < r->h.win * r->h.nwin; t++)
        if (r->ids[t] < 0 || r->ids[t] >= V)
            return fprintf(stderr, "moe-perplexity: token id %d at %d is past the vocabulary (%d)\n", r->ids[t], t, V), 1;
    return 0;
}

/* one window's logits for each model, and the saved reference file begun */
static int alloc_windows(run *r) {
    const ref_header *h = &r->h;
    r->routed = r->o->fixed && h->rpt && r->rpt;
    const size_t per = (size_t)h->win * r->V;
    r->a = malloc(sizeof(float) * per), r->b = malloc(sizeof(float) * per), r->bf = r->routed ? malloc(sizeof(float) * per) : NULL;
    r->routes = h->rpt ? malloc(sizeof(int32_t) * (size_t)h->win * h->rpt) : NULL;
    r->la = malloc(sizeof(double) * (size_t)r->V), r->lb = malloc(sizeof(double) * (size_t)r->V);
    if (!r->a || !r->b || !r->la || !r->lb || (r->routed && !r->bf) || (h->rpt && !r->routes))
        return fprintf(stderr, "moe-perplexity: out of memory for a window's logits (%d tokens x %d)\n", h->win, r->V), 1;
    if (r->o->save) {
        snprintf(r->tmp, sizeof r->tmp, "%s.tmp", r->o->save);
        if (!(r->sf = fopen(r->tmp, "wb")) || !write_ref_header(r->sf, h, r->ids))
            return fprintf(stderr, "moe-perplexity: %s: %s\n", r->tmp, strerror(errno)), 1;
    }
    return 0;
}

/* every window through both models (or the reference file), compared as it comes */
static int score_windows(run *r, tally *y) {
    const options *o = r->o;
    const ref_header *h = &r->h;
    for (int w = 0; w < h->nwin; w++) {
        const int32_t *wi = r->ids + (size_t)w * h->win;
        if (!r->rf && !r->mr) { /* alone: the model's own perplexity, one run */
            if (window_logits(r->mt, wi, h->win, 0, r->b, NULL, NULL)) return 1;
            score_window(y, r->b, r->b, NULL, wi, h->win, h->first, r->V, r->la, r->lb);
            continue;
        }
        if (r->rf ? read_ref_window(r->rf, h, r->a, r->routed ? r->routes : NULL) : window_logits(r->mr, wi, h->win, 0, r->a, r->routes, NULL)) {
            if (r->rf) fprintf(stderr, "moe-perplexity: %s: read error\n", o->load);
            return 1;
        }
        if (r->sf && write_ref_window(r->sf, h, r->a, r->routes)) return fprintf(stderr, "moe-perplexity: %s: %s\n", r->tmp, strerror(errno)), 1;
        if (window_logits(r->mt, wi, h->win, o->stepwise, r->b, NULL, NULL) ||
            (r->routed && window_logits(r->mt, wi, h->win, o->stepwise, r->bf, NULL, r->routes)))
            return 1;
        score_window(y, r->a, r->b, r->routed ? r->bf : NULL, wi, h->win, h->first, r->V, r->la, r->lb);
        if (!o->json && h->nwin > 1)
            fprintf(stderr, "\rwindow %d/%d: perplexity ref %.4f, test %.4f", w + 1, h->nwin, exp(y->nll_ref / (double)y->predicted),
                    exp(y->nll / (double)y->predicted));
    }
    if (!o->json && h->nwin > 1) fprintf(stderr, "\n");
    if (r->sf) {
        const int bad = fclose(r->sf) != 0 || rename(r->tmp, o->save) != 0;
        r->sf = NULL;
        if (bad) return fprintf(stderr, "moe-perplexity: %s: %s\n", o->save, strerror(errno)), 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    options o;
    int stop, rc = parse_args(argc, argv, &o, &stop);
    if (stop) return rc;
    run r = {.o = &o};
    tally y = {0};
    rc = open_inputs(&r) || alloc_windows(&r) || score_windows(&r, &y);
    if (!rc) {
        report(&y, o.json, r.h.nwin, r.h.win, r.routed, !r.mr && !r.rf);
        rc = fflush(stdout) ? 1 : 0;
    }
    if (r.sf) fclose(r.sf), remove(r.tmp);
    if (r.rf) fclose(r.rf);
    free(r.a), free(r.b), free(r.bf), free(r.routes), free(r.la), free(r.lb), free(r.ids);
    moe_model_close(r.mt), moe_model_close(r.mr);
    return rc;
}
