/* moe-plan: what fits where, and what speed to expect, before anything is downloaded or run.
 *
 *   moe-plan (-m MODEL | --config CONFIG.json) [--ram SIZE] [--disk-gbps X] [--membw-gbps Y]
 *            [--gflops Z] [-t THREADS] [--ctx N] [--seqs N] [--expert-bytes-per-value B]
 *            [--dense-bytes-per-value B] [--dense-budget SIZE] [--kv-type T] [--batch N]
 *
 * With -m the byte counts come from the files (exact); with --config only from the configuration
 * (BF16 dense weights, and MXFP4 experts when the config carries an MXFP4 quantization_config,
 * else BF16: the released checkpoints' formats), so a plan for full Kimi K3 needs no weights.
 * The machine: RAM (default: this machine's), disk read bandwidth, memory bandwidth and matmul
 * throughput (defaults: 2 GB/s, 20 GB/s, 50 GFLOP/s per thread; measure yours with moe-bench).
 *
 * The model of the run: the LM head, routers, per-sequence state and working buffers stay
 * resident, and the layers' dense matrices as far as they fit (--dense-budget, or by default all
 * of RAM but a reserve and the smallest expert cache a step needs: a byte of dense matrices is
 * read every step, a byte of experts only when routed to); the rest of the dense matrices is read
 * from disk every step (moe_options.dense_budget). The rest of RAM caches experts; with routing
 * spread evenly, a cache holding a fraction f of the experts hits with probability f. A decode
 * step of N sequences needs, per MoE layer, E (1 - (1 - k/E)^N) distinct experts; the misses are
 * read from disk. Time = reading (misses / disk bandwidth) + compute (the longer of bytes touched
 * / memory bandwidth and 2 x active parameters x N / throughput; 2 x parameters / throughput for
 * prefill), reported both as the sum (reads not overlapped, as the expert cache
 * does today) and as the larger of the two (fully overlapped). */
#define _POSIX_C_SOURCE 200809L
#define MOE_INTERNAL
#include "../moe.h"
#include "args.h"
#include "cache_flags.h"
#include "files.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static arg_help help = {
    "usage: moe-plan (-m MODEL | --config CONFIG.json) [--ram SIZE] [--disk-gbps X] [--membw-gbps Y]\n"
    "                [--gflops Z] [-t THREADS] [--ctx N] [--seqs N] [--expert-bytes-per-value B]\n"
    "                [--dense-bytes-per-value B]   (2 = BF16, 1.0625 = Q8_0, 0.5625 = Q4_0)\n"
    "                [--dense-budget SIZE]         (RAM for the layers' dense matrices; default: what fits)\n"
    "                [--kv-type f32|bf16|q8]          (MLA latent cache element, as the runtime's option)\n"
    "                [--batch N]                   (prompt rows per forward chunk, as moe_options.n_batch; default 512,\n"
    "                                               the cache mode's)\n", NULL};

static int usage(const char *msg) { return arg_usage("moe-plan", help, msg); }

/* sizes are read and printed in binary units (GiB, MiB), rates in GB/s */
#define GIB 1073741824.0
#define MIB 1048576.0

typedef struct {
    const char *model, *config;
    double ram, disk, membw, gflops, ebv, dbv, dense_budget; /* dense_budget -1: what fits */
    int dbv_given, threads, ctx, seqs, batch;
    int disk_measured; /* the runtime's plan timed the model's own files */
    int ram_given, disk_given, threads_given, membw_given, gflops_given, ctx_given, seqs_given, ebv_given;
    double kv_bytes; /* per cached latent value: f32, 2 with --kv-type bf16, 1 with q8 (and a 16-byte row meta) */
    int kv_q8;
} options;

/* Parses the command line into o; 0, or usage()'s exit status with *done set. */
static int parse_args(int argc, char **argv, options *o, int *done) {
    *o = (options){.ram = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE), .disk = 2.0, .membw = 20.0, .dbv = 2.0,
                   .dense_budget = -1, .threads = 1, .ctx = 4096, .seqs = 16,
                   .batch = 512, /* the runtime's chunk in the cache mode planned here */
                   .kv_bytes = 4};
    *done = 1;
    for (int i = 1; i < argc; i++) {
        double v;
        const char *a = argv[i];
        int more = i + 1 < argc;
        if (!strcmp(a, "-m") && more) o->model = argv[++i];
        else if (!strcmp(a, "--config") && more) o->config = argv[++i];
        else if (!strcmp(a, "--ram") && more) {
            size_t v;
            if (!parse_size(argv[++i], &v)) return usage("--ram needs a size with its unit, such as 256G (GiB)");
            o->ram = (double)v, o->ram_given = 1;
        } else if (!strcmp(a, "--dense-budget") && more) {
            size_t v;
            if (!parse_size(argv[++i], &v)) return usage("--dense-budget needs a size with its unit, such as 20G (GiB)");
            o->dense_budget = (double)v;
        }
        else if (!strcmp(a, "--disk-gbps") && more) {
            if (arg_num("moe-plan", help, a, argv[++i], 0.001, 10000, 0, &v)) return 2;
            o->disk = v, o->disk_given = 1;
        }
        else if (!strcmp(a, "--membw-gbps") && more) {
            if (arg_num("moe-plan", help, a, argv[++i], 0.001, 100000, 0, &v)) return 2;
            o->membw = v, o->membw_given = 1;
        }
        else if (!strcmp(a, "--gflops") && more) {
            if (arg_num("moe-plan", help, a, argv[++i], 0.001, 1e+07, 0, &v)) return 2;
            o->gflops = v, o->gflops_given = 1;
        }
        else if (!strcmp(a, "--expert-bytes-per-value") && more) {
            if (arg_num("moe-plan", help, a, argv[++i], 0.001, 8, 0, &v)) return 2;
            o->ebv = v, o->ebv_given = 1;
        }
        else if (!strcmp(a, "--dense-bytes-per-value") && more) {
            if (arg_num("moe-plan", help, a, argv[++i], 0.001, 8, 0, &v)) return 2;
            o->dbv = v, o->dbv_given = 1;
        }
        else if (!strcmp(a, "-t") && more) {
            if (arg_num("moe-plan", help, a, argv[++i], 1, 1024, 1, &v)) return 2;
            o->threads = (int)v, o->threads_given = 1;
        }
        else if (!strcmp(a, "--ctx") && more) {
            if (arg_num("moe-plan", help, a, argv[++i], 1, 1e+09, 1, &v)) return 2;
            o->ctx = (int)v, o->ctx_given = 1;
        }
        else if (!strcmp(a, "--seqs") && more) {
            if (arg_num("moe-plan", help, a, argv[++i], 1, 1e+06, 1, &v)) return 2;
            o->seqs = (int)v, o->seqs_given = 1;
        }
        else if (!strcmp(a, "--batch") && more) {
            if (arg_num("moe-plan", help, a, argv[++i], 1, 1e+06, 1, &v)) return 2;
            o->batch = (int)v;
        }
        else if (!strcmp(a, "--kv-type") && more) {
            const char *v = argv[++i];
            if (strcmp(v, "f32") && strcmp(v, "bf16") && strcmp(v, "q8")) return usage("--kv-type is f32, bf16 or q8");
            o->kv_bytes = !strcmp(v, "bf16") ? 2 : !strcmp(v, "q8") ? 1 : 4;
            o->kv_q8 = !strcmp(v, "q8");
        }
        else if (!strcmp(a, "-h") || !strcmp(a, "--help")) return usage(NULL);
        else return arg_unknown("moe-plan", help, a, more ? argv[i + 1] : NULL);
    }
    if (!!o->model == !!o->config) return usage("give exactly one of -m and --config");
    if (!(o->disk > 0) || !(o->membw > 0) || o->threads < 1 || o->ctx < 1 || o->seqs < 1 || o->batch < 1) return usage("bad machine description");
    *done = 0;
    return 0;
}

/* what the plan needs of the model */
typedef struct {
    moe_config c;
    double dense_bytes, expert_total, n_params, n_active;
    double stored_per_dense; /* bytes of the dense matrices as stored per byte of dense_bytes: streamed
                                layers are read from disk as stored, not as converted */
} model_sizes;

/* the exact byte counts of a checkpoint's files; the model stays open (*mp) while z->c is used,
 * as its layer arrays are the model's */
static int sizes_of_model(const options *o, model_sizes *z, moe_model **mp) {
    char err[512];
    moe_model *m = NULL;
    moe_options mo = moe_default_options();
    mo.flags |= MOE_FLAG_NO_REPACK; /* planning reads no weights */
    moe_status st = moe_model_open(&m, o->model, &mo, err, sizeof err);
    if (st) return fprintf(stderr, "moe-plan: %s: %s\n", moe_status_str(st), err), 1;
    z->c = *moe_model_config(m);
    moe_model_info info = moe_model_get_info(m);
    z->expert_total = (double)info.expert_bytes;
    z->dense_bytes = (double)info.weight_bytes - z->expert_total;
    z->n_params = (double)info.n_params, z->n_active = (double)info.n_params_active;
    /* weights converted at load (--dense-bytes-per-value with -m: the stored dense values are
     * BF16 in the released checkpoints, 2 bytes each) */
    const double stored = z->dense_bytes;
    if (o->dbv_given) z->dense_bytes = z->dense_bytes / 2.0 * o->dbv;
    z->stored_per_dense = z->dense_bytes > 0 ? stored / z->dense_bytes : 1.0;
    *mp = m;
    return 0;
}

/* parameter counts from a config alone, by the shapes of docs/spec/MODEL.md section 2 */
static int sizes_of_config(options *o, model_sizes *z) {
    static unsigned char kinds[4096], moes[4096];
    char err[512];
    const char *why;
    FILE *f = open_input(o->config, &why);
    if (!f) return fprintf(stderr, "moe-plan: %s: %s\n", o->config, why), 1;
    char *text = malloc(1 << 22);
    size_t n = text ? fread(text, 1, (1 << 22) - 1, f) : 0;
    fclose(f);
    moe_status st = text ? moe__config_parse(text, n, &z->c, kinds, moes, err, sizeof err) : MOE_ERR_NOMEM;
    int mxfp4 = text && strstr(text, "mxfp4") != NULL;
    free(text);
    if (st) return fprintf(stderr, "moe-plan: %s: %s\n", o->config, err), 1;
    const moe_config c = z->c;
    const double d = c.hidden_size, V = c.vocab_size, HD = (double)c.kda_heads * c.kda_head_dim, D = c.kda_head_dim;
    const double de = c.latent_dim ? c.latent_dim : d, Ie = c.moe_intermediate_size, E = c.n_experts;
    double dense = 2 * V * d + d, experts = 0;
    for (int l = 0; l < c.n_layers; l++) {
        dense += 2 * d + (c.attn_res_block ? 4 * d : 0);
        if (c.layer_kind[l] == MOE_LAYER_KDA)
            dense += 3 * HD * d + 3 * HD * c.conv_kernel + D * d + HD * D + c.kda_heads * d + 2 * HD + D + d * HD +
                     (c.kda_full_rank_gate ? HD * d : D * d + HD * D);
        else {
            const double H = c.mla_heads, dq = c.qk_nope_dim + c.qk_rope_dim;
            dense += (c.q_lora_rank ? c.q_lora_rank * d + c.q_lora_rank + H * dq * c.q_lora_rank : H * dq * d) +
                     (c.kv_lora_rank + c.qk_rope_dim) * d + c.kv_lora_rank + H * (c.qk_nope_dim + c.v_head_dim) * c.kv_lora_rank +
                     (c.mla_output_gate ? H * c.v_head_dim * d : 0) + d * H * c.v_head_dim;
        }
        if (!c.layer_moe[l]) { dense += 3.0 * c.intermediate_size * d; continue; }
        dense += E * d + E + (c.latent_dim ? 2 * de * d + de : 0) + 3.0 * c.n_shared * Ie * d;
        experts += E * 3 * Ie * de;
    }
    if (!(o->ebv > 0)) o->ebv = mxfp4 ? 17.0 / 32.0 : 2.0;
    z->n_params = dense + experts;
    z->n_active = dense + (E ? experts / E * c.n_active : 0);
    z->dense_bytes = dense * o->dbv;
    z->stored_per_dense = 2.0 / o->dbv; /* the released checkpoints store BF16 */
    z->expert_total = experts * o->ebv;
    return 0;
}

/* what stays resident, what streams and what caches experts, and the speed that follows */
static void print_plan(const options *o, const model_sizes *z) {
    const moe_config c = z->c;
    const double ram = o->ram, dense_bytes = z->dense_bytes, expert_total = z->expert_total, dbv = o->dbv, kv_bytes = o->kv_bytes;
    const int threads = o->threads, ctx = o->ctx, seqs = o->seqs, batch = o->batch, kv_q8 = o->kv_q8;
    int n_moe = 0, n_kda = 0, n_mla = 0;
    for (int l = 0; l < c.n_layers; l++) n_moe += c.layer_moe[l], n_kda += c.layer_kind[l] == MOE_LAYER_KDA, n_mla += c.layer_kind[l] != MOE_LAYER_KDA;
    const double E = c.n_experts, k = c.n_active, one_expert = n_moe && E ? expert_total / (n_moe * E) : 0;
    const double state_per_seq = (double)n_kda * c.kda_heads * c.kda_head_dim * c.kda_head_dim * 4 +
                                 (double)n_kda * (c.conv_kernel - 1) * 3.0 * c.kda_heads * c.kda_head_dim * 4 +
                                 (double)n_mla * ((c.kv_lora_rank + c.qk_rope_dim) * kv_bytes + (kv_q8 ? 16 : 0)) * ctx;
    /* one prompt chunk: about 16 f32 hidden-size vectors a row, and the block attention
     * residuals' partial sums (n_layers / block + 2 more); logits come one row at a time */
    const double blocks = c.attn_res_block ? c.n_layers / c.attn_res_block + 2 : 0;
    const double working = (double)batch * c.hidden_size * 4 * (16 + blocks);
    const double reserve = 1073741824.0 + 0.05 * ram;
    /* the embedding stays in the file mapping whatever the dense type: only the rows of the tokens
     * seen are read, so it is not counted resident (its bytes are in dense_bytes at the dense
     * type's size) */
    const double embed = (double)c.vocab_size * c.hidden_size * dbv;
    /* always resident: the LM head and the routers; the layers' other matrices may stream */
    const double fixed = (double)c.vocab_size * c.hidden_size * dbv + (double)n_moe * c.n_experts * c.hidden_size * dbv;
    const double layer_dense = dense_bytes - embed - fixed > 0 ? dense_bytes - embed - fixed : 0;
    const double min_cache = threads * one_expert + 2 * layer_dense / c.n_layers; /* a step's experts, this layer and the next */
    double dense_res = o->dense_budget >= 0 ? o->dense_budget : ram - reserve - fixed - state_per_seq * seqs - working - min_cache;
    dense_res = dense_res < 0 ? 0 : dense_res > layer_dense ? layer_dense : dense_res;
    const double streamed = layer_dense - dense_res, streamed_read = streamed * z->stored_per_dense;
    const double resident = fixed + dense_res + state_per_seq * seqs + working;
    const double cache = ram - reserve - resident > 0 ? ram - reserve - resident : 0;
    const double f = expert_total > 0 ? (cache < expert_total ? cache / expert_total : 1.0) : 1.0;

    /* what the figures rest on that the command line did not say */
    char assumed[600] = "";
    size_t an = 0;
#define ASSUME(...) (an += (size_t)snprintf(assumed + an, an < sizeof assumed ? sizeof assumed - an : 0, __VA_ARGS__))
    if (!o->ram_given) ASSUME(", RAM %.1f GiB (%s; --ram)", ram / GIB, o->model ? "the runtime's plan" : "this machine's");
    if (!o->disk_given) ASSUME(", disk %.2f GB/s (%s; --disk-gbps)", o->disk, o->disk_measured ? "measured on the model's files" : "a guess");
    if (!o->membw_given) ASSUME(", memory %.1f GB/s (--membw-gbps)", o->membw);
    if (!o->gflops_given) ASSUME(", %.0f GFLOP/s (50 a thread; --gflops)", o->gflops);
    if (!o->threads_given) ASSUME(", %d thread%s (-t)", threads, threads == 1 ? "" : "s");
    if (!o->ctx_given) ASSUME(", context %d (--ctx)", ctx);
    if (!o->seqs_given) ASSUME(", %d sequences (--seqs)", seqs);
    if (!o->dbv_given) ASSUME(", dense matrices as stored%s (--dense-bytes-per-value)", o->model ? "" : ", BF16");
    if (!o->ebv_given && !o->model) ASSUME(", experts as the config says (--expert-bytes-per-value)");
#undef ASSUME
    if (an) printf("assumed: %s\n", assumed + 2);
    printf("model: %d layers (%d KDA, %d MLA), %d MoE layers, %d experts top-%d; %.1f B parameters, %.2f B active per token\n",
           c.n_layers, n_kda, n_mla, n_moe, c.n_experts, c.n_active, z->n_params / 1e9, z->n_active / 1e9);
    printf("bytes: dense %.2f GiB, experts %.2f GiB (%.2f MiB each), state %.3f GiB per sequence at %d tokens\n", dense_bytes / GIB,
           expert_total / GIB, one_expert / MIB, state_per_seq / GIB, ctx);
    printf("machine: RAM %.1f GiB, disk %.2f GB/s, memory %.1f GB/s, %.0f GFLOP/s (%d threads)\n", ram / GIB, o->disk, o->membw, o->gflops, threads);
    if (resident + reserve + min_cache > ram)
        printf("plan: what stays resident (%.1f GiB) leaves no room for a step's expert cache: not planned further\n", resident / GIB);
    printf("plan: resident %.2f GiB (dense weights but the mapped embedding and streamed layers, %d sequence states, buffers); reserve %.2f GiB; expert cache %.2f GiB = %.1f%% of the experts\n",
           resident / GIB, seqs, reserve / GIB, cache / GIB, 100 * f);
    if (streamed > 0)
        printf("plan: layers' dense matrices %.2f GiB resident, about %d of %d layers read from disk every step as stored, %.2f GiB (--dense-budget %.2fG)\n",
               dense_res / GIB, (int)ceil(streamed / (layer_dense / c.n_layers)), c.n_layers, streamed_read / GIB, dense_res / GIB);
    /* a decode token at position ctx: absorbed MLA reads the latent cache and does per head
     * (2 r + d_r) multiply-adds per cached token (scores and context); KDA reads and writes its state */
    const double cw = c.kv_lora_rank + c.qk_rope_dim;
    const double attn_bytes = (double)n_mla * ctx * (cw * kv_bytes + (kv_q8 ? 16 : 0)) + 2.0 * n_kda * c.kda_heads * c.kda_head_dim * c.kda_head_dim * 4;
    const double attn_flops = 2.0 * n_mla * c.mla_heads * (double)ctx * (2.0 * c.kv_lora_rank + c.qk_rope_dim);
    const int ns[2] = {1, seqs};
    for (int i = 0; i < (seqs > 1 ? 2 : 1); i++) {
        const double N = ns[i], distinct = E ? E * (1 - pow(1 - k / E, N)) : 0;
        const double read = n_moe * distinct * one_expert * (1 - f) + streamed_read;
        const double touched = dense_bytes - embed + n_moe * distinct * one_expert + N * attn_bytes;
        /* compute: the bytes touched at memory speed, or the multiply-adds of N tokens (weights
         * and attention at position ctx) at the machine's throughput when that is longer */
        const double io = read / (o->disk * 1e9), comp = fmax(touched / (o->membw * 1e9), (2 * z->n_active + attn_flops) * N / (o->gflops * 1e9));
        printf("decode, %d sequence%s: %.2f GiB read per step (%.0f experts per MoE layer), io %.3f s + compute %.3f s: "
               "%.3f s/token serial, %.3f s/token overlapped (%.2f / %.2f tok/s aggregate)\n",
               ns[i], N > 1 ? "s in lockstep" : "", read / GIB, distinct, io, comp, (io + comp) / N, (io > comp ? io : comp) / N,
               N / (io + comp), N / (io > comp ? io : comp));
    }
    const double T = batch, dT = E ? E * (1 - pow(1 - k / E, T)) : 0;
    const double pread = n_moe * dT * one_expert * (1 - f) + streamed_read;
    const double pio = pread / (o->disk * 1e9), pcomp = 2 * z->n_active * T / (o->gflops * 1e9);
    printf("prefill, %d-token chunk: %.2f GiB read (%.0f experts per MoE layer), io %.2f s + compute %.2f s: %.1f tok/s serial, %.1f overlapped\n",
           batch, pread / GIB, dT, pio, pcomp, T / (pio + pcomp), T / (pio > pcomp ? pio : pcomp));
}

/* With -m: the runtime's own resource plan for the model on this machine (moe_plan_make, what
 * moe-cli and the other programs do with no flags), printed, and its memory, threads, disk speed
 * and dense format taken for what the command line does not give. */
static int runtime_plan(options *o) {
    moe_options mo = moe_default_options();
    if (o->threads_given) mo.n_threads = o->threads, mo.set |= MOE_SET_THREADS;
    if (o->dense_budget >= 0) mo.dense_budget = (size_t)o->dense_budget, mo.set |= MOE_SET_DENSE_BUDGET;
    moe_plan p;
    char err[512];
    moe_status st = moe_plan_make(&p, o->model, &mo, err, sizeof err);
    if (!st && o->ram_given) { /* the same choices for the memory --ram gives */
        moe_options peek = moe_default_options();
        peek.flags |= MOE_FLAG_NO_REPACK;
        moe_model *m = NULL;
        p.mem_bytes = (uint64_t)o->ram, p.mem_from = "--ram";
        if (!(st = moe_model_open(&m, o->model, &peek, err, sizeof err))) st = moe__plan_choose(&p, m, &mo, err, sizeof err);
        moe_model_close(m);
    }
    if (st) return fprintf(stderr, "moe-plan: %s: %s\n", moe_status_str(st), err), 1;
    printf("runtime plan (no flags): %s\n", p.summary);
    if (!o->ram_given) o->ram = (double)p.mem_bytes;
    if (!o->threads_given) o->threads = p.opt.n_threads;
    const double disk = p.disk_gbps[0] > p.disk_gbps[1] ? p.disk_gbps[0] : p.disk_gbps[1];
    if (!o->disk_given && disk > 0) o->disk = disk, o->disk_measured = 1;
    if (!o->dbv_given && (p.opt.dense_type == MOE_WTYPE_Q8_0 || p.opt.dense_type == MOE_WTYPE_Q4_0))
        o->dbv = p.opt.dense_type == MOE_WTYPE_Q8_0 ? 1.0625 : 0.5625, o->dbv_given = 1;
    if (o->dense_budget < 0 && p.opt.dense_budget) o->dense_budget = (double)p.opt.dense_budget;
    return 0;
}

int main(int argc, char **argv) {
    options o;
    int stop, rc = parse_args(argc, argv, &o, &stop);
    if (stop) return rc;
    if (o.model && runtime_plan(&o)) return 1;
    if (!(o.gflops > 0)) o.gflops = 50.0 * o.threads;
    model_sizes z;
    moe_model *m = NULL;
    if (o.model ? sizes_of_model(&o, &z, &m) : sizes_of_config(&o, &z)) return 1;
    print_plan(&o, &z);
    moe_model_close(m);
    return 0;
}
