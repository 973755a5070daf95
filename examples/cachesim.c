/* moe-cachesim: expert-cache eviction policies replayed on a real routing trace.
 *
 *   moe-cachesim -m MODEL --tokens IDS_FILE [--cache 0.05,0.1,0.2,0.4] [--seqs N] [-t THREADS]
 *
 * Decodes the ids token by token (N sequences in lockstep take consecutive slices of the ids),
 * records which experts every MoE layer routes to at each step (the routing trace), then replays
 * the trace through caches holding the given fractions of all routed experts under several
 * policies and prints the hit rate of each as a JSON line:
 *   lru      least recently used (the runtime's policy before this tool)
 *   lfu      least frequently used so far (ties: least recent)
 *   lrfu     least by an exponentially decayed use count that survives eviction (the router's
 *            history: an expert that layer l keeps choosing keeps its score), half-life H steps
 *   belady   the offline optimum (evicts the expert used furthest in the future): an upper bound
 * A step's experts are all needed at once (pinned), as in the runtime. */
#define _POSIX_C_SOURCE 200809L
#include "../moe.h"
#include "files.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int usage(const char *msg) {
    if (msg) fprintf(stderr, "moe-cachesim: %s\n", msg);
    fprintf(stderr, "usage: moe-cachesim -m MODEL --tokens IDS_FILE [--cache F,F,...] [--seqs N] [-t THREADS] [--half-life H]\n");
    return 2;
}

typedef struct {
    int n_steps, n_ids; /* ids per step: distinct (layer * E + e) */
    int *start, *ids;   /* step s: ids[start[s] .. start[s+1]) */
} trace;

enum { LRU, LFU, LRFU, BELADY, N_POLICIES };
static const char *names[N_POLICIES] = {"lru", "lfu", "lrfu", "belady"};

/* replays the trace through a cache of cap experts; returns hits / lookups */
static double simulate(const trace *tr, int n_exp, int cap, int policy, double half_life) {
    char *in = calloc((size_t)n_exp, 1), *pinned = calloc((size_t)n_exp, 1);
    double *score = calloc((size_t)n_exp, sizeof *score);
    long *last = calloc((size_t)n_exp, sizeof *last), *count = calloc((size_t)n_exp, sizeof *count);
    int *next_use = NULL, *resident = malloc(sizeof(int) * (size_t)(cap + 1));
    if (policy == BELADY) { /* for each occurrence, the step of the next use of the same expert */
        next_use = malloc(sizeof(int) * (size_t)tr->n_ids);
        int *seen = malloc(sizeof(int) * (size_t)n_exp);
        for (int i = 0; i < n_exp; i++) seen[i] = tr->n_steps + 1;
        for (int s = tr->n_steps - 1; s >= 0; s--)
            for (int j = tr->start[s]; j < tr->start[s + 1]; j++) next_use[j] = seen[tr->ids[j]], seen[tr->ids[j]] = s;
        free(seen);
    }
    int *future = next_use ? malloc(sizeof(int) * (size_t)n_exp) : NULL; /* per resident expert: its next use */
    const double decay = pow(0.5, 1.0 / half_life);
    long hits = 0, lookups = 0;
    int nr = 0;
    for (int s = 0; s < tr->n_steps; s++) {
        for (int j = tr->start[s]; j < tr->start[s + 1]; j++) pinned[tr->ids[j]] = 1;
        for (int j = tr->start[s]; j < tr->start[s + 1]; j++) {
            const int x = tr->ids[j];
            lookups++;
            if (in[x]) hits++;
            else {
                if (nr >= cap) { /* evict one unpinned resident by the policy */
                    int best = -1;
                    double bv = 0;
                    for (int i = 0; i < nr; i++) {
                        const int y = resident[i];
                        if (pinned[y]) continue;
                        double v = policy == LRU ? (double)last[y]
                                 : policy == LFU ? (double)count[y] + (double)last[y] / (tr->n_steps + 1.0)
                                 : policy == LRFU ? score[y] * pow(decay, (double)(s - last[y]))
                                                  : -(double)future[y];
                        if (best < 0 || v < bv) best = i, bv = v;
                    }
                    if (best >= 0) {
                        in[resident[best]] = 0;
                        resident[best] = resident[--nr];
                    }
                }
                if (nr < cap) in[x] = 1, resident[nr++] = x;
            }
            score[x] = score[x] * pow(decay, (double)(s - last[x])) + 1.0;
            last[x] = s;
            count[x]++;
            if (future) future[x] = next_use[j];
        }
        for (int j = tr->start[s]; j < tr->start[s + 1]; j++) pinned[tr->ids[j]] = 0;
    }
    free(in), free(pinned), free(score), free(last), free(count), free(next_use), free(resident), free(future);
    return lookups ? (double)hits / lookups : 0;
}


int main(int argc, char **argv) {
    const char *model = NULL, *tokens = NULL;
    double fracs[16] = {0.05, 0.1, 0.2, 0.4}, half_life = 8;
    int n_fracs = 4, seqs = 1;
    moe_options o = moe_default_options();
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int more = i + 1 < argc;
        if (!strcmp(a, "-m") && more) model = argv[++i];
        else if (!strcmp(a, "--tokens") && more) tokens = argv[++i];
        else if (!strcmp(a, "--seqs") && more) seqs = atoi(argv[++i]);
        else if (!strcmp(a, "-t") && more) o.n_threads = atoi(argv[++i]);
        else if (!strcmp(a, "--half-life") && more) half_life = atof(argv[++i]);
        else if (!strcmp(a, "--cache") && more) {
            char *p = argv[++i], *e;
            for (n_fracs = 0; *p && n_fracs < 16; p = *e ? e + 1 : e) {
                fracs[n_fracs++] = strtod(p, &e);
                if (e == p) return usage("bad --cache");
            }
        } else return usage("unknown or incomplete argument");
    }
    if (!model || !tokens || seqs < 1 || o.n_threads < 1 || !(half_life > 0)) return usage("-m and --tokens are required");
    int32_t *ids;
    const char *why;
    int n = read_ids(tokens, &ids, &why);
    if (n < seqs * 2) {
        fprintf(stderr, "moe-cachesim: %s: %s\n", tokens, n < 0 ? why : "too few ids");
        free(ids);
        return 1;
    }
    char err[512];
    moe_model *m = NULL;
    if (moe_model_open(&m, model, &o, err, sizeof err)) { fprintf(stderr, "moe-cachesim: %s\n", err); return 1; }
    const moe_config *c = moe_model_config(m);
    const int L = c->n_layers, E = c->n_experts, K = c->n_active, per = n / seqs;
    if (!E) { fprintf(stderr, "moe-cachesim: the model has no routed experts\n"); return 1; }
    moe_session **ss = calloc((size_t)seqs, sizeof *ss);
    moe_seq *q = calloc((size_t)seqs, sizeof *q);
    int32_t *routes = malloc(sizeof(int32_t) * (size_t)seqs * L * K);
    trace tr = {0, 0, malloc(sizeof(int) * (size_t)(per + 1)), malloc(sizeof(int) * (size_t)per * seqs * L * K)};
    char *mark = calloc((size_t)L * E, 1);
    for (int i = 0; i < seqs; i++)
        if (moe_session_new(&ss[i], m, per + 1, err, sizeof err)) { fprintf(stderr, "moe-cachesim: %s\n", err); return 1; }
    int moe_layers = 0;
    for (int l = 0; l < L; l++) moe_layers += c->layer_moe[l];
    for (int t = 0; t < per; t++) {
        for (int i = 0; i < seqs; i++)
            q[i] = (moe_seq){.s = ss[i], .tokens = ids + (size_t)i * per + t, .n = 1, .routes = routes + (size_t)i * L * K};
        if (moe_step(m, q, seqs, NULL, err, sizeof err)) { fprintf(stderr, "moe-cachesim: %s\n", err); return 1; }
        tr.start[t] = tr.n_ids;
        for (int l = 0; l < L; l++) /* layer by layer, as the step uses them */
            for (int i = 0; i < seqs; i++)
                for (int k = 0; k < K; k++) {
                    const int32_t e = routes[((size_t)i * L + l) * K + k];
                    if (e < 0 || mark[(size_t)l * E + e]) continue;
                    mark[(size_t)l * E + e] = 1;
                    tr.ids[tr.n_ids++] = l * E + e;
                }
        for (int j = tr.start[t]; j < tr.n_ids; j++) mark[tr.ids[j]] = 0;
    }
    tr.n_steps = per;
    tr.start[per] = tr.n_ids;
    const char *name = strrchr(model, '/') ? strrchr(model, '/') + 1 : model;
    fprintf(stderr, "moe-cachesim: %s: %d steps x %d sequence(s), %d MoE layers x %d experts, %.1f distinct experts per step\n", name,
            per, seqs, moe_layers, E, (double)tr.n_ids / per);
    for (int fi = 0; fi < n_fracs; fi++) {
        int cap = (int)(fracs[fi] * moe_layers * E + 0.5);
        const int need = tr.n_ids / per + 1;
        if (cap < K * seqs) cap = K * seqs; /* a step must fit */
        printf("{\"model\": \"%s\", \"sequences\": %d, \"steps\": %d, \"cache_frac\": %.3f, \"cache_experts\": %d", name, seqs, per,
               (double)cap / (moe_layers * E), cap);
        for (int p = 0; p < N_POLICIES; p++) printf(", \"%s\": %.4f", names[p], simulate(&tr, L * E, cap > need ? cap : need, p, half_life));
        printf("}\n");
    }
    for (int i = 0; i < seqs; i++) moe_session_free(ss[i]);
    free(ss), free(q), free(routes), free(tr.start), free(tr.ids), free(mark), free(ids);
    moe_model_close(m);
    return 0;
}
