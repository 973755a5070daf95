/* moe-perplexity: how much a quantized model departs from its original on the same tokens.
 *
 *   moe-perplexity -m MODEL --tokens IDS_FILE [--dense TYPE] [--experts TYPE] [--ref MODEL2]
 *                  [--kv-type f32|bf16|q8] [--mxfp4 int8] [--act 8|16] [-t THREADS] [--json] [--ref-routing]
 *
 * Runs the tokens through the reference (MODEL as stored, or MODEL2) and through the test model
 * (MODEL with its matrices converted at load to TYPE: f32, bf16, q8_0, q4_0), then reports the
 * mean KL divergence KL(ref || test) per token in nats, top-1 agreement, and the perplexity of
 * each on the token stream (position t predicting token t+1). --ref-routing also reports the KL
 * with the test model forced onto the reference's experts: on small random models a tiny
 * numeric change flips near-tie routing decisions, and this separates the two effects.
 * --kv-type gives the test model that MLA latent cache (the reference keeps f32) and runs it one
 * token at a time, as generation does, so that decode's attention over the cache is measured.
 * Exit 0, 1 on errors, 2 on usage. */
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
    fprintf(stderr, "usage: moe-perplexity -m MODEL --tokens IDS_FILE [--dense TYPE] [--experts TYPE]\n"
                    "                      [--ref MODEL2] [--kv-type f32|bf16|q8] [--mxfp4 int8] [--act 8|16] [-t THREADS] [--json]\n"
                    "                      [--ref-routing]\n"
                    "                      [--kernels NAME]\n"
                    "  TYPE: f32, bf16, q8_0, q4_0 (converted at load; default: as stored)\n"
                    "  --kernels NAME: the model under test on that kernel set (avx2, scalar, ...); the reference\n"
                    "  keeps the CPU's best\n");
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

/* logits of every position; routes_out receives the routing (if non-NULL, allocated here),
 * routes_in forces it */
static float *run(const char *path, const moe_options *o, const int32_t *ids, int n, int stepwise, int *V,
                  int32_t **routes_out, const int32_t *routes_in) {
    char err[512];
    moe_model *m;
    moe_session *s;
    moe_status st = moe_model_open(&m, path, o, err, sizeof err);
    if (st) { fprintf(stderr, "moe-perplexity: %s: %s\n", moe_status_str(st), err); return NULL; }
    *V = moe_model_config(m)->vocab_size;
    float *lg = malloc(sizeof(float) * (size_t)*V * (size_t)n);
    if (!lg || moe_session_new(&s, m, n, err, sizeof err)) {
        fprintf(stderr, "moe-perplexity: out of memory\n");
        free(lg);
        moe_model_close(m);
        return NULL;
    }
    const moe_config *c = moe_model_config(m);
    int32_t *routes = NULL;
    if (routes_out && c->n_experts) routes = *routes_out = malloc(sizeof(int32_t) * (size_t)n * c->n_layers * c->n_active);
    const size_t rw = (size_t)c->n_layers * c->n_active; /* routing entries per token */
    for (int t = 0; t < n && !st; t += stepwise ? 1 : n) {
        moe_seq q = {.s = s, .tokens = ids + t, .n = stepwise ? 1 : n, .logits = lg + (size_t)t * *V, .logits_all = 1,
                     .routes = routes ? routes + t * rw : NULL, .force_routes = routes_in ? routes_in + t * rw : NULL};
        st = moe_step(m, &q, 1, NULL, err, sizeof err);
    }
    if (st) {
        fprintf(stderr, "moe-perplexity: %s: %s\n", moe_status_str(st), err);
        free(lg);
        lg = NULL;
    }
    moe_session_free(s);
    moe_model_close(m);
    return lg;
}

int main(int argc, char **argv) {
    const char *model = NULL, *ref = NULL, *tokens = NULL;
    int json = 0, fixed = 0, stepwise = 0;
    moe_options opt = moe_default_options();
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int more = i + 1 < argc;
        if (!strcmp(a, "-m") && more) model = argv[++i];
        else if (!strcmp(a, "--ref") && more) ref = argv[++i];
        else if (!strcmp(a, "--tokens") && more) tokens = argv[++i];
        else if (!strcmp(a, "--dense") && more) {
            if ((opt.dense_type = parse_type(argv[++i])) < 0) return usage("unknown --dense type");
        } else if (!strcmp(a, "--experts") && more) {
            if ((opt.expert_type = parse_type(argv[++i])) < 0) return usage("unknown --experts type");
        } else if (!strcmp(a, "-t") && more) {
            opt.n_threads = atoi(argv[++i]);
            if (opt.n_threads < 1) return usage("-t needs a thread count >= 1");
        } else if (!strcmp(a, "--kv-type") && more) {
            if ((opt.kv_type = parse_kv_type(argv[++i])) < 0) return usage("--kv-type is f32, bf16 or q8");
            stepwise = 1;
        } else if (!strcmp(a, "--mxfp4") && more) { /* the test model's MXFP4 matrices meet int8 input */
            const int int8 = parse_mxfp4(argv[++i]);
            if (int8 < 0) return usage("--mxfp4 is f32 or int8");
            if (int8) opt.flags |= MOE_FLAG_MXFP4_INT8;
        } else if (!strcmp(a, "--act") && more) { /* the test model's integer formats meet two-part input */
            const int act16 = parse_act(argv[++i]);
            if (act16 < 0) return usage("--act is 8 or 16");
            if (act16) opt.flags |= MOE_FLAG_ACT16;
        } else if (!strcmp(a, "--kernels") && more) opt.kernels = argv[++i];
        else if (!strcmp(a, "--json")) json = 1;
        else if (!strcmp(a, "--ref-routing")) fixed = 1;
        else if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(NULL); return 0; }
        else return usage("unknown or incomplete argument");
    }
    if (!model || !tokens) return usage("-m and --tokens are required");
    int32_t *ids;
    const char *why;
    int n = read_ids(tokens, &ids, &why);
    if (n < 2) {
        fprintf(stderr, "moe-perplexity: %s: %s\n", tokens, n < 0 ? why : "need at least two token ids");
        free(ids);
        return 1;
    }
    moe_options ro = opt;
    ro.dense_type = ro.expert_type = MOE_WTYPE_ASIS;
    ro.kv_type = MOE_KV_F32;
    ro.flags &= ~(unsigned)(MOE_FLAG_MXFP4_INT8 | MOE_FLAG_ACT16);
    ro.kernels = NULL;
    int V = 0, V2 = 0, V3 = 0;
    int32_t *routes = NULL;
    float *a = run(ref ? ref : model, &ro, ids, n, 0, &V, fixed ? &routes : NULL, NULL);
    float *b = a ? run(model, &opt, ids, n, stepwise, &V2, NULL, NULL) : NULL;
    float *bf = b && routes ? run(model, &opt, ids, n, stepwise, &V3, NULL, routes) : NULL;
    if (!a || !b || V != V2 || (routes && !bf)) {
        if (a && b && V != V2) fprintf(stderr, "moe-perplexity: the models have different vocabularies\n");
        free(a), free(b), free(bf), free(routes), free(ids);
        return 1;
    }
    double *la = malloc(sizeof(double) * (size_t)V), *lb = malloc(sizeof(double) * (size_t)V);
    double kl = 0, kl_max = 0, nll_a = 0, nll_b = 0, kl_fixed = 0;
    int agree = 0;
    for (int t = 0; t < n; t++) {
        const float *ra = a + (size_t)t * V, *rb = b + (size_t)t * V;
        log_softmax(ra, la, V);
        log_softmax(rb, lb, V);
        double k = 0;
        int ta = 0, tb = 0;
        for (int i = 0; i < V; i++) {
            k += exp(la[i]) * (la[i] - lb[i]);
            if (ra[i] > ra[ta]) ta = i;
            if (rb[i] > rb[tb]) tb = i;
        }
        kl += k;
        kl_max = k > kl_max ? k : kl_max;
        agree += ta == tb;
        if (t + 1 < n) nll_a -= la[ids[t + 1]], nll_b -= lb[ids[t + 1]];
        if (bf) { /* same position, test model forced onto the reference's experts */
            log_softmax(bf + (size_t)t * V, lb, V);
            for (int i = 0; i < V; i++) kl_fixed += exp(la[i]) * (la[i] - lb[i]);
        }
    }
    const double mkl = kl / n, top1 = (double)agree / n, ppl_a = exp(nll_a / (n - 1)), ppl_b = exp(nll_b / (n - 1));
    if (json) {
        printf("{\"tokens\": %d, \"kl_mean\": %.6g, \"kl_max\": %.6g, \"top1_agree\": %.6f, \"ppl_ref\": %.6f, \"ppl\": %.6f",
               n, mkl, kl_max, top1, ppl_a, ppl_b);
        if (bf) printf(", \"kl_mean_ref_routing\": %.6g", kl_fixed / n);
        printf("}\n");
    } else {
        printf("tokens %d\nmean KL(ref||test) %.6g nats/token (max %.6g)\ntop-1 agreement %.4f\n"
               "perplexity ref %.4f, test %.4f\n", n, mkl, kl_max, top1, ppl_a, ppl_b);
        if (bf) printf("mean KL with the reference's routing %.6g nats/token\n", kl_fixed / n);
    }
    free(la), free(lb), free(a), free(b), free(bf), free(routes), free(ids);
    return 0;
}
