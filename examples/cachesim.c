/* moe-cachesim: expert-cache eviction policies replayed on a real routing trace.
 *
 *   moe-cachesim -m MODEL --tokens IDS_FILE [--cache 0.05,0.1,0.2,0.4] [--seqs N] [-t THREADS]
 *                [--half-life H]
 *
 * Decodes the ids token by token (N sequences in lockstep take consecutive slices of the ids),
 * records which experts every MoE layer routes to at each step (the routing trace), then replays
 * the trace through caches holding the given fractions of all routed experts under several
 * policies and prints the hit rate of each as a JSON line:
 *   lru      least recently used
 *   lfu      least frequently used so far (ties: least recent)
 *   lrfu     the runtime's own policy, through the library (moe__history_*): least by a use count
 *            decayed by half every H routing steps of its layer, which survives eviction (the
 *            router's history); H defaults to the runtime's MOE_HISTORY_HALF_LIFE
 *   belady   the offline optimum (evicts the expert used furthest in the future): an upper bound
 * A step's experts are all needed at once (pinned), as in the runtime; the history of each MoE
 * layer is updated with its routing before the step's lookups, as the runtime does when a layer
 * queues its experts. */
#define _POSIX_C_SOURCE 200809L
#define MOE_INTERNAL
#include "../moe.h"
#include "args.h"
#include "files.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static arg_help help = {
    "usage: moe-cachesim -m MODEL --tokens IDS_FILE [--cache F,F,...] [--seqs N] [-t THREADS] [--half-life H]\n", NULL};

static int usage(const char *msg) { return arg_usage("moe-cachesim", help, msg); }

typedef struct {
    const char *model, *tokens;
    double fracs[16], half_life;
    int n_fracs, seqs;
    moe_options opt;
} options;

typedef struct {
    int n_layers, n_experts;
    int n_steps, n_ids; /* ids per step: distinct (layer * E + e), in layer order */
    int *start, *ids;   /* step s: ids[start[s] .. start[s+1]) */
} trace;

enum { LRU, LFU, LRFU, BELADY, N_POLICIES };
static const char *names[N_POLICIES] = {"lru", "lfu", "lrfu", "belady"};

/* next_use[j]: the step of the next use of the expert of occurrence j (n_steps + 1: none) */
static int *next_uses(const trace *tr) {
    const int n_exp = tr->n_layers * tr->n_experts;
    int *next_use = malloc(sizeof(int) * (size_t)tr->n_ids), *seen = malloc(sizeof(int) * (size_t)n_exp);
    if (!next_use || !seen) return free(next_use), free(seen), NULL;
    for (int i = 0; i < n_exp; i++) seen[i] = tr->n_steps + 1;
    for (int s = tr->n_steps - 1; s >= 0; s--)
        for (int j = tr->start[s]; j < tr->start[s + 1]; j++) next_use[j] = seen[tr->ids[j]], seen[tr->ids[j]] = s;
    free(seen);
    return next_use;
}

/* the runtime's history brought up to step s: each layer's routing of that step */
static void route_step(moe__expert_history *h, const trace *tr, int s, unsigned char *routed) {
    const int E = tr->n_experts;
    for (int j = tr->start[s]; j < tr->start[s + 1];) {
        const int l = tr->ids[j] / E;
        memset(routed, 0, (size_t)E);
        for (; j < tr->start[s + 1] && tr->ids[j] / E == l; j++) routed[tr->ids[j] % E] = 1;
        moe__history_route(h, l, routed, E);
    }
}

typedef struct {
    int policy;
    const long *last, *count;
    const int *future;
    const moe__expert_history *hist;
    int n_experts;
} policy_view;

/* whether the policy evicts resident expert a before b */
static int evicts_before(const policy_view *p, int a, int b, int n_steps) {
    switch (p->policy) {
    case LRU: return p->last[a] < p->last[b];
    case LFU: {
        const double va = p->count[a] + p->last[a] / (n_steps + 1.0), vb = p->count[b] + p->last[b] / (n_steps + 1.0);
        return va < vb;
    }
    case LRFU: {
        const int E = p->n_experts;
        return moe__history_evicts_before(moe__history_score(p->hist, a / E, a % E), (uint64_t)p->last[a],
                                          moe__history_score(p->hist, b / E, b % E), (uint64_t)p->last[b]);
    }
    default: return p->future[a] > p->future[b];
    }
}

/* replays the trace through a cache of cap experts; returns hits / lookups (-1: out of memory) */
static double simulate(const trace *tr, int cap, int policy, double half_life) {
    const int n_exp = tr->n_layers * tr->n_experts;
    char *in = calloc((size_t)n_exp, 1), *pinned = calloc((size_t)n_exp, 1);
    long *last = calloc((size_t)n_exp, sizeof *last), *count = calloc((size_t)n_exp, sizeof *count);
    int *resident = malloc(sizeof(int) * (size_t)(cap + 1)), *future = calloc((size_t)n_exp, sizeof *future);
    int *next_use = policy == BELADY ? next_uses(tr) : NULL;
    unsigned char *routed = malloc((size_t)tr->n_experts);
    moe__expert_history *hist = moe__history_new(tr->n_layers, tr->n_experts, half_life);
    double rate = -1;
    if (!in || !pinned || !last || !count || !resident || !future || !routed || !hist || (policy == BELADY && !next_use)) goto done;
    const policy_view pv = {policy, last, count, future, hist, tr->n_experts};
    long hits = 0, lookups = 0;
    int nr = 0;
    for (int s = 0; s < tr->n_steps; s++) {
        route_step(hist, tr, s, routed);
        for (int j = tr->start[s]; j < tr->start[s + 1]; j++) pinned[tr->ids[j]] = 1;
        for (int j = tr->start[s]; j < tr->start[s + 1]; j++) {
            const int x = tr->ids[j];
            lookups++;
            if (in[x]) hits++;
            else {
                if (nr >= cap) { /* evict one unpinned resident by the policy */
                    int best = -1;
                    for (int i = 0; i < nr; i++)
                        if (!pinned[resident[i]] && (best < 0 || evicts_before(&pv, resident[i], resident[best], tr->n_steps))) best = i;
                    if (best >= 0) in[resident[best]] = 0, resident[best] = resident[--nr];
                }
                if (nr < cap) in[x] = 1, resident[nr++] = x;
            }
            last[x] = s;
            count[x]++;
            if (next_use) future[x] = next_use[j];
        }
        for (int j = tr->start[s]; j < tr->start[s + 1]; j++) pinned[tr->ids[j]] = 0;
    }
    rate = lookups ? (double)hits / lookups : 0;
done:
    free(in), free(pinned), free(last), free(count), free(resident), free(future), free(next_use), free(routed);
    moe__history_free(hist);
    return rate;
}

static int parse_args(int argc, char **argv, options *o) {
    *o = (options){.fracs = {0.05, 0.1, 0.2, 0.4}, .n_fracs = 4, .seqs = 1, .half_life = MOE_HISTORY_HALF_LIFE,
                   .opt = moe_default_options()};
    for (int i = 1; i < argc; i++) {
        double v;
        const char *a = argv[i];
        int more = i + 1 < argc;
        if (!strcmp(a, "-m") && more) o->model = argv[++i];
        else if (!strcmp(a, "--tokens") && more) o->tokens = argv[++i];
        else if (!strcmp(a, "--seqs") && more) {
            if (arg_num("moe-cachesim", help, a, argv[++i], 1, 1e+06, 1, &v)) return 2;
            o->seqs = (int)v;
        }
        else if (!strcmp(a, "-t") && more) {
            if (arg_num("moe-cachesim", help, a, argv[++i], 1, 1024, 1, &v)) return 2;
            o->opt.n_threads = (int)v;
        }
        else if (!strcmp(a, "--half-life") && more) {
            if (arg_num("moe-cachesim", help, a, argv[++i], 0.001, 1e+09, 0, &v)) return 2;
            o->half_life = v;
        }
        else if (!strcmp(a, "--cache") && more) {
            char *p = argv[++i], *e;
            for (o->n_fracs = 0; *p && o->n_fracs < 16; p = *e ? e + 1 : e) {
                o->fracs[o->n_fracs++] = strtod(p, &e);
                if (e == p) return usage("bad --cache");
            }
        } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) return usage(NULL), -1; /* -1: the help printed, exit 0 */
        else return arg_unknown("moe-cachesim", help, a, more ? argv[i + 1] : NULL);
    }
    if (!o->model || !o->tokens) return usage("-m and --tokens are required");
    if (o->seqs < 1 || o->opt.n_threads < 1 || !(o->half_life > 0)) return usage("--seqs and -t are at least 1, --half-life above 0");
    return 0;
}

/* Decodes per ids of each of seqs sequences (ids + i * per) in lockstep, recording the distinct
 * experts of each step, layer by layer, into tr (allocated here). 0, or 1 with a message. */
static int record_trace(moe_model *m, const int32_t *ids, int per, int seqs, trace *tr) {
    const moe_config *c = moe_model_config(m);
    const int L = c->n_layers, E = c->n_experts, K = c->n_active;
    char err[512];
    moe_session **ss = calloc((size_t)seqs, sizeof *ss);
    moe_seq *q = calloc((size_t)seqs, sizeof *q);
    int32_t *routes = malloc(sizeof(int32_t) * (size_t)seqs * L * K);
    char *mark = calloc((size_t)L * E, 1);
    *tr = (trace){L, E, per, 0, malloc(sizeof(int) * (size_t)(per + 1)), malloc(sizeof(int) * (size_t)per * seqs * L * K)};
    int rc = !ss || !q || !routes || !mark || !tr->start || !tr->ids;
    if (rc) fprintf(stderr, "moe-cachesim: out of memory\n");
    for (int i = 0; i < seqs && !rc; i++)
        if (moe_session_new(&ss[i], m, per + 1, err, sizeof err)) rc = fprintf(stderr, "moe-cachesim: %s\n", err) > 0;
    for (int t = 0; t < per && !rc; t++) {
        for (int i = 0; i < seqs; i++)
            q[i] = (moe_seq){.s = ss[i], .tokens = ids + (size_t)i * per + t, .n = 1, .routes = routes + (size_t)i * L * K};
        if (moe_step(m, q, seqs, NULL, err, sizeof err)) rc = fprintf(stderr, "moe-cachesim: %s\n", err) > 0;
        tr->start[t] = tr->n_ids;
        for (int l = 0; l < L && !rc; l++) /* layer by layer, as the step uses them */
            for (int i = 0; i < seqs; i++)
                for (int k = 0; k < K; k++) {
                    const int32_t e = routes[((size_t)i * L + l) * K + k];
                    if (e < 0 || mark[(size_t)l * E + e]) continue;
                    mark[(size_t)l * E + e] = 1;
                    tr->ids[tr->n_ids++] = l * E + e;
                }
        for (int j = tr->start[t]; j < tr->n_ids; j++) mark[tr->ids[j]] = 0;
    }
    if (tr->start) tr->start[per] = tr->n_ids;
    for (int i = 0; ss && i < seqs; i++) moe_session_free(ss[i]);
    free(ss), free(q), free(routes), free(mark);
    return rc;
}

/* one JSON line per cache size: each policy's hit rate */
static int report(const options *o, const char *name, const trace *tr, int moe_layers, int K) {
    const int per = tr->n_steps, E = tr->n_experts;
    for (int fi = 0; fi < o->n_fracs; fi++) {
        int cap = (int)(o->fracs[fi] * moe_layers * E + 0.5);
        const int need = tr->n_ids / per + 1;
        if (cap < K * o->seqs) cap = K * o->seqs; /* a step must fit */
        printf("{\"model\": \"%s\", \"sequences\": %d, \"steps\": %d, \"cache_frac\": %.3f, \"cache_experts\": %d", name, o->seqs, per,
               (double)cap / (moe_layers * E), cap);
        for (int p = 0; p < N_POLICIES; p++) {
            const double rate = simulate(tr, cap > need ? cap : need, p, o->half_life);
            if (rate < 0) return fprintf(stderr, "moe-cachesim: out of memory\n"), 1;
            printf(", \"%s\": %.4f", names[p], rate);
        }
        printf("}\n");
    }
    return 0;
}

int main(int argc, char **argv) {
    options o;
    int rc = parse_args(argc, argv, &o);
    if (rc) return rc < 0 ? 0 : rc;
    int32_t *ids;
    const char *why;
    const int n = read_ids(o.tokens, &ids, &why);
    if (n < o.seqs * 2) {
        fprintf(stderr, "moe-cachesim: %s: %s\n", o.tokens, n < 0 ? why : "too few ids");
        free(ids);
        return 1;
    }
    char err[512];
    moe_model *m = NULL;
    if (moe_model_open(&m, o.model, &o.opt, err, sizeof err)) {
        fprintf(stderr, "moe-cachesim: %s\n", err);
        free(ids);
        return 1;
    }
    const moe_config *c = moe_model_config(m);
    int moe_layers = 0;
    for (int l = 0; l < c->n_layers; l++) moe_layers += c->layer_moe[l];
    trace tr = {0};
    const char *name = strrchr(o.model, '/') ? strrchr(o.model, '/') + 1 : o.model;
    if (!c->n_experts) rc = fprintf(stderr, "moe-cachesim: the model has no routed experts\n") > 0;
    if (!rc) rc = record_trace(m, ids, n / o.seqs, o.seqs, &tr);
    if (!rc) {
        fprintf(stderr, "moe-cachesim: %s: %d steps x %d sequence(s), %d MoE layers x %d experts, %.1f distinct experts per step\n",
                name, tr.n_steps, o.seqs, moe_layers, c->n_experts, (double)tr.n_ids / tr.n_steps);
        rc = report(&o, name, &tr, moe_layers, c->n_active);
    }
    free(tr.start), free(tr.ids), free(ids);
    moe_model_close(m);
    return rc;
}
