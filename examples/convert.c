/* moe-convert: a Hugging Face checkpoint directory (or a benchmark shape) to one GGUF file, or to
 * a GGUF split into parts as llama.cpp splits them.
 *
 *   moe-convert MODEL_DIR OUT.gguf [--dense TYPE] [--experts TYPE] [--split-max-size SIZE] [--alignment N]
 *   moe-convert --random SHAPE.json OUT.gguf [--dense TYPE] [--experts TYPE] [--seed N] [--split-max-size SIZE]
 *
 * TYPE: f32, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl, iq4_xs
 * (dense default: bf16), and with --random only iq1_s, iq1_m, iq2_xxs, iq2_xs, iq2_s, iq3_xxs,
 * iq3_s (random blocks: moe has no quantizer for the grid formats); experts
 * also "mxfp4" and "asis" (default: keep the stored format; MXFP4 experts are repacked into ggml's
 * block_mxfp4 bit for bit). A row that is not whole blocks of the type falls back as llama.cpp's
 * quantizer does (q2_k, q3_k, iq4_xs and the grid formats -> iq4_nl; q4_k -> q5_0, q5_k -> q5_1, q6_k -> q8_0; to f32
 * where not whole 32s).
 * Norms, biases, convolutions and the router stay F32. Tensor and key names follow llama.cpp's
 * kimi-linear architecture, or its Kimi-K3 support's kimi-k3 when the model has K3 features (fused
 * AttnRes score vectors, ssm_g, ffn_routed_*); general.alignment is 4096.
 *
 * Streaming and resumable: the header is planned and written first; then tensor by tensor, each
 * converted row by row through a bounded buffer and written at its offset, followed by an fsync
 * and a progress record (OUT.gguf.partial.done). An interrupted run restarts after the last
 * tensor recorded; the result is renamed to OUT.gguf only when complete. Progress (bytes, rate,
 * ETA) goes to stderr. Exit 0 on success, 1 on errors, 2 on usage errors.
 *
 * With --split-max-size the tensors are cut, in order, into parts of at most SIZE of data each
 * (OUT-00001-of-0000N.gguf ...; the metadata in the first part, split.no / split.count /
 * split.tensors.count in every part, as llama.cpp's gguf-split writes them; with
 * --no-tensor-first-split the first part holds only the metadata), each written and resumed as
 * above. */
#define _DEFAULT_SOURCE
#define MOE_INTERNAL
#include "../moe.h"
#include "args.h"
#include "cache_flags.h"
#include "files.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* general.alignment: 4096 by default (tensors start on page boundaries, for the expert cache's
 * O_DIRECT reads); --alignment 32 for files that ggml's GGUF writer will copy (its writer pads
 * to 32 bytes whatever the key says, so it would keep our 4096 and break the file) */
#define ALIGN_MAX 4096
static uint32_t gguf_align = ALIGN_MAX;
#define CHUNK (64u << 20) /* output bytes buffered before a write */

enum { SRC_MAT, SRC_VEC, SRC_ALOG, SRC_EXPERTS, SRC_K_B, SRC_V_B, SRC_RES };

typedef struct {
    char name[96];   /* GGUF name */
    int type;        /* MOE_T_* written */
    int nd;
    int64_t ne[4];   /* ggml order */
    uint64_t offset; /* relative to the data section */
    uint64_t nbytes;
    int kind;         /* SRC_* */
    char src[200];    /* HF name (experts: base with %d for the expert id) */
    int64_t rows, cols, n_mats;
    float rmean, rstd; /* --random: mean + std * normal */
    int64_t dn, dv;    /* SRC_K_B/SRC_V_B: head sizes inside kv_b */
    int part;          /* the file it goes into (a split GGUF's part; 0 otherwise) */
} out_tensor;

typedef struct {
    out_tensor *t;
    int n, cap;
} plan;

typedef struct {
    moe_model *m; /* checkpoint mode */
    const char *prefix;
    uint64_t seed; /* random mode when m is NULL */
} source;

static int die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "moe-convert: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    return 1;
}

/* An output name must be free or hold a regular file (which the conversion replaces); a symbolic
 * link (its target would be replaced or written through), a directory, a device, a FIFO or a
 * socket is refused. */
static int check_output_name(const char *path) {
    struct stat sb;
    if (lstat(path, &sb)) return errno == ENOENT ? 0 : die("%s: %s", path, strerror(errno));
    if (S_ISLNK(sb.st_mode)) return die("%s is a symbolic link: moe-convert neither replaces links nor writes through them; give the real path", path);
    if (!S_ISREG(sb.st_mode))
        return die("%s exists and is not a regular file (%s); give another output name", path,
                   S_ISDIR(sb.st_mode) ? "a directory" : S_ISFIFO(sb.st_mode) ? "a FIFO" : S_ISCHR(sb.st_mode) || S_ISBLK(sb.st_mode) ? "a device" : "a socket");
    return 0;
}

static arg_help help = {
    "usage: moe-convert MODEL_DIR OUT.gguf [--dense TYPE] [--experts TYPE]\n"
    "       moe-convert --random SHAPE.json OUT.gguf [--dense TYPE] [--experts TYPE] [--seed N]\n"
    "       moe-convert --k3-slice SHAPE.json OUT_DIR [--seed N] [--sparse]   (random, released K3 layout;\n"
    "                      --sparse: only vectors, routers and the embedding written, the rest holes)\n"
    "  --dense TYPE    attention, dense FFN, shared experts, embedding, LM head: f32 bf16 q8_0 q4_0\n"
    "                  q4_1 q5_0 q5_1 q2_k q3_k q4_k q5_k q6_k iq4_nl iq4_xs (bf16); with --random also\n"
    "                  iq1_s iq1_m iq2_xxs iq2_xs iq2_s iq3_xxs iq3_s (random blocks)\n"
    "  --experts TYPE  routed experts: asis mxfp4 or any of those (asis)\n"
    "  --split-max-size SIZE  parts of at most SIZE of tensor data (e.g. 48G, binary units), written as\n"
    "                  OUT-00001-of-0000N.gguf ... as llama.cpp splits GGUF files (a larger tensor gets a part alone)\n"
    "  --no-tensor-first-split  the first part holds only the metadata (as llama.cpp's gguf-split option)\n"
    "  --alignment N   general.alignment (4096): 32 for a file that llama-quantize or another tool\n"
    "                  writing through ggml's GGUF writer will copy (that writer pads to 32 whatever the key says)\n", NULL};

static int usage(const char *msg) { return arg_usage("moe-convert", help, msg); }

static int parse_type(const char *s, int experts) {
    if (!strcmp(s, "f32")) return MOE_T_F32;
    if (!strcmp(s, "bf16")) return MOE_T_BF16;
    if (!strcmp(s, "q8_0")) return MOE_T_Q8_0;
    if (!strcmp(s, "q4_0")) return MOE_T_Q4_0;
    if (!strcmp(s, "q4_1")) return MOE_T_Q4_1;
    if (!strcmp(s, "q5_0")) return MOE_T_Q5_0;
    if (!strcmp(s, "q5_1")) return MOE_T_Q5_1;
    if (!strcmp(s, "q4_k")) return MOE_T_Q4_K;
    if (!strcmp(s, "q5_k")) return MOE_T_Q5_K;
    if (!strcmp(s, "q6_k")) return MOE_T_Q6_K;
    if (!strcmp(s, "q2_k")) return MOE_T_Q2_K;
    if (!strcmp(s, "q3_k")) return MOE_T_Q3_K;
    if (!strcmp(s, "iq4_nl")) return MOE_T_IQ4_NL;
    if (!strcmp(s, "iq4_xs")) return MOE_T_IQ4_XS;
    if (!strcmp(s, "iq2_xxs")) return MOE_T_IQ2_XXS; /* the grid formats: --random only (see random_iq_row) */
    if (!strcmp(s, "iq2_xs")) return MOE_T_IQ2_XS;
    if (!strcmp(s, "iq2_s")) return MOE_T_IQ2_S;
    if (!strcmp(s, "iq3_xxs")) return MOE_T_IQ3_XXS;
    if (!strcmp(s, "iq3_s")) return MOE_T_IQ3_S;
    if (!strcmp(s, "iq1_s")) return MOE_T_IQ1_S;
    if (!strcmp(s, "iq1_m")) return MOE_T_IQ1_M;
    if (experts && !strcmp(s, "mxfp4")) return MOE_T_MXFP4_GGML;
    if (experts && !strcmp(s, "asis")) return -1;
    return -2;
}

static int ggml_id(int type) {
    switch (type) {
    case MOE_T_F32: return 0;
    case MOE_T_F16: return 1;
    case MOE_T_Q4_0: return 2;
    case MOE_T_Q4_1: return 3;
    case MOE_T_Q5_0: return 6;
    case MOE_T_Q5_1: return 7;
    case MOE_T_Q8_0: return 8;
    case MOE_T_Q2_K: return 10;
    case MOE_T_Q3_K: return 11;
    case MOE_T_Q4_K: return 12;
    case MOE_T_Q5_K: return 13;
    case MOE_T_Q6_K: return 14;
    case MOE_T_IQ4_NL: return 20;
    case MOE_T_IQ4_XS: return 23;
    case MOE_T_IQ2_XXS: return 16;
    case MOE_T_IQ2_XS: return 17;
    case MOE_T_IQ3_XXS: return 18;
    case MOE_T_IQ1_S: return 19;
    case MOE_T_IQ3_S: return 21;
    case MOE_T_IQ2_S: return 22;
    case MOE_T_IQ1_M: return 29;
    case MOE_T_BF16: return 30;
    case MOE_T_MXFP4_GGML: return 39;
    default: return -1;
    }
}

static out_tensor *add(plan *p, const char *name, int type, int kind, const char *src) {
    if (p->n == p->cap) {
        p->cap = p->cap ? 2 * p->cap : 256;
        out_tensor *t = realloc(p->t, sizeof *t * (size_t)p->cap);
        if (!t) { fprintf(stderr, "moe-convert: out of memory\n"); exit(1); }
        p->t = t;
    }
    out_tensor *t = &p->t[p->n++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    snprintf(t->src, sizeof t->src, "%s", src);
    t->type = type, t->kind = kind, t->rstd = 0.02f;
    return t;
}

/* the type a row of cols values takes: block formats need whole blocks; a k-quant falls back to
 * the 32-value format llama.cpp's quantizer takes instead, any block format to F32 */
static int fit_type(int type, int64_t cols) {
    if (type == MOE_T_MXFP4_GGML || moe__is_quant(type)) {
        if (cols % moe__block_values(type) == 0) return type;
        if (cols % 32) return MOE_T_F32;
        switch (type) {
        case MOE_T_Q2_K: case MOE_T_Q3_K: case MOE_T_IQ4_XS: return MOE_T_IQ4_NL;
        case MOE_T_IQ2_XXS: case MOE_T_IQ2_XS: case MOE_T_IQ2_S: case MOE_T_IQ3_XXS: case MOE_T_IQ3_S: case MOE_T_IQ1_S: case MOE_T_IQ1_M:
            return MOE_T_IQ4_NL; /* as llama.cpp's quantizer */
        case MOE_T_Q4_K: return MOE_T_Q5_0;
        case MOE_T_Q5_K: return MOE_T_Q5_1;
        case MOE_T_Q6_K: return MOE_T_Q8_0;
        default: return type;
        }
    }
    return type;
}

/* matrix [rows, cols] */
static void add_mat(plan *p, const char *gg, const char *hf, int64_t rows, int64_t cols, int type) {
    type = fit_type(type, cols);
    out_tensor *t = add(p, gg, type, SRC_MAT, hf);
    t->nd = 2, t->ne[0] = cols, t->ne[1] = rows, t->rows = rows, t->cols = cols, t->n_mats = 1;
}

static out_tensor *add_vec(plan *p, const char *gg, const char *hf, int nd, const int64_t *ne, float mean, float std) {
    out_tensor *t = add(p, gg, MOE_T_F32, SRC_VEC, hf);
    t->nd = nd;
    int64_t n = 1;
    for (int i = 0; i < nd; i++) t->ne[i] = ne[i], n *= ne[i];
    t->rows = 1, t->cols = n, t->n_mats = 1, t->rmean = mean, t->rstd = std;
    return t;
}

/* whether the model needs the kimi-k3 architecture (any K3 feature), else kimi-linear */
static int is_k3(const moe_config *c) {
    return c->attn_res_block || c->latent_dim || c->hidden_act == MOE_ACT_SITU || c->kda_full_rank_gate || c->mla_output_gate;
}

/* an AttnRes site's score vector as llama.cpp's K3 converter stores it: the norm weight times the
 * projection row, one F32 vector (hfnorm: the site's "..._norm.weight"; the projection is read
 * beside it) */
static void add_res(plan *p, const char *gg, const char *hfnorm, int64_t d) {
    out_tensor *t = add_vec(p, gg, hfnorm, 1, (int64_t[]){d}, 0.0f, 0.02f);
    t->kind = SRC_RES;
}

/* the tensors of the model, in the order the runtime reads them; kimi-k3 under the names and
 * layouts of llama.cpp's Kimi-K3 support (docs/spec/GGUF-KIMI.md section 2) */
static void build_plan(plan *p, const moe_config *c, int dense, int experts, int expert_src_type) {
    char hf[200], gg[96];
    const int64_t d = c->hidden_size, V = c->vocab_size;
    const int k3 = is_k3(c);
#define HF(...) (snprintf(hf, sizeof hf, __VA_ARGS__), hf)
#define MAT(hfname, rows, cols, type) (moe__hf_to_gguf(hfname, gg, sizeof gg, k3), add_mat(p, gg, hfname, rows, cols, type))
#define VEC1(hfname, n, mean, std) (moe__hf_to_gguf(hfname, gg, sizeof gg, k3), add_vec(p, gg, hfname, 1, (int64_t[]){n}, mean, std))
    MAT("model.embed_tokens.weight", V, d, dense);
    for (int i = 0; i < c->n_layers; i++) {
        VEC1(HF("model.layers.%d.input_layernorm.weight", i), d, 1.0f, 0.02f);
        VEC1(HF("model.layers.%d.post_attention_layernorm.weight", i), d, 1.0f, 0.02f);
        if (c->attn_res_block) {
            snprintf(gg, sizeof gg, "blk.%d.attn_res_score.weight", i);
            add_res(p, gg, HF("model.layers.%d.self_attention_res_norm.weight", i), d);
            snprintf(gg, sizeof gg, "blk.%d.ffn_res_score.weight", i);
            add_res(p, gg, HF("model.layers.%d.mlp_res_norm.weight", i), d);
        }
        if (c->layer_kind[i] == MOE_LAYER_KDA) {
            const int64_t H = c->kda_heads, D = c->kda_head_dim, HD = H * D, W = c->conv_kernel;
            MAT(HF("model.layers.%d.self_attn.q_proj.weight", i), HD, d, dense);
            MAT(HF("model.layers.%d.self_attn.k_proj.weight", i), HD, d, dense);
            MAT(HF("model.layers.%d.self_attn.v_proj.weight", i), HD, d, dense);
            const char *cv[3] = {"q", "k", "v"};
            for (int a = 0; a < 3; a++) {
                HF("model.layers.%d.self_attn.%s_conv1d.weight", i, cv[a]);
                moe__hf_to_gguf(hf, gg, sizeof gg, k3);
                add_vec(p, gg, hf, 4, (int64_t[]){W, 1, HD, 1}, 0.0f, 0.3f);
            }
            MAT(HF("model.layers.%d.self_attn.f_a_proj.weight", i), D, d, dense);
            MAT(HF("model.layers.%d.self_attn.f_b_proj.weight", i), HD, D, dense);
            MAT(HF("model.layers.%d.self_attn.b_proj.weight", i), H, d, dense);
            HF("model.layers.%d.self_attn.A_log", i);
            moe__hf_to_gguf(hf, gg, sizeof gg, k3);
            /* -exp(A_log): [1, H, 1, 1] in kimi-linear, 1-D [H] in K3 */
            out_tensor *a = k3 ? add_vec(p, gg, hf, 1, (int64_t[]){H}, 0.0f, 1.0f) : add_vec(p, gg, hf, 4, (int64_t[]){1, H, 1, 1}, 0.0f, 1.0f);
            a->kind = SRC_ALOG;
            VEC1(HF("model.layers.%d.self_attn.dt_bias", i), HD, 0.0f, 0.5f);
            if (c->kda_full_rank_gate) {
                MAT(HF("model.layers.%d.self_attn.g_proj.weight", i), HD, d, dense);
            } else {
                MAT(HF("model.layers.%d.self_attn.g_a_proj.weight", i), D, d, dense);
                MAT(HF("model.layers.%d.self_attn.g_b_proj.weight", i), HD, D, dense);
            }
            VEC1(HF("model.layers.%d.self_attn.o_norm.weight", i), D, 1.0f, 0.02f);
            MAT(HF("model.layers.%d.self_attn.o_proj.weight", i), d, HD, dense);
        } else {
            const int64_t H = c->mla_heads, dq = c->qk_nope_dim + c->qk_rope_dim, r = c->kv_lora_rank;
            if (c->q_lora_rank) {
                MAT(HF("model.layers.%d.self_attn.q_a_proj.weight", i), c->q_lora_rank, d, dense);
                VEC1(HF("model.layers.%d.self_attn.q_a_layernorm.weight", i), c->q_lora_rank, 1.0f, 0.02f);
                MAT(HF("model.layers.%d.self_attn.q_b_proj.weight", i), H * dq, c->q_lora_rank, dense);
            } else {
                MAT(HF("model.layers.%d.self_attn.q_proj.weight", i), H * dq, d, dense);
            }
            MAT(HF("model.layers.%d.self_attn.kv_a_proj_with_mqa.weight", i), r + c->qk_rope_dim, d, dense);
            VEC1(HF("model.layers.%d.self_attn.kv_a_layernorm.weight", i), r, 1.0f, 0.02f);
            /* kv_b split per head as llama.cpp's MLA cache wants it: attn_k_b [H, r, d_n] holds
             * W_UK^T, attn_v_b [H, d_v, r] holds W_UV */
            HF("model.layers.%d.self_attn.kv_b_proj.weight", i);
            const int64_t dn = c->qk_nope_dim, dv = c->v_head_dim;
            for (int kb = 0; kb < 2; kb++) {
                const int64_t cols = kb == 0 ? dn : r;
                const int type = fit_type(dense, cols);
                snprintf(gg, sizeof gg, "blk.%d.attn_%s_b.weight", i, kb == 0 ? "k" : "v");
                out_tensor *t = add(p, gg, type, kb == 0 ? SRC_K_B : SRC_V_B, hf);
                t->nd = 3, t->ne[0] = cols, t->ne[1] = kb == 0 ? r : dv, t->ne[2] = H;
                t->rows = t->ne[1], t->cols = cols, t->n_mats = H, t->dn = dn, t->dv = dv;
            }
            if (c->mla_output_gate) { /* attn_gate in both namings (ssm_g is KDA's gate) */
                HF("model.layers.%d.self_attn.g_proj.weight", i);
                moe__hf_to_gguf(hf, gg, sizeof gg, 0);
                add_mat(p, gg, hf, H * c->v_head_dim, d, dense);
            }
            MAT(HF("model.layers.%d.self_attn.o_proj.weight", i), d, H * c->v_head_dim, dense);
        }
        if (!c->layer_moe[i]) {
            MAT(HF("model.layers.%d.mlp.gate_proj.weight", i), c->intermediate_size, d, dense);
            MAT(HF("model.layers.%d.mlp.up_proj.weight", i), c->intermediate_size, d, dense);
            MAT(HF("model.layers.%d.mlp.down_proj.weight", i), d, c->intermediate_size, dense);
            continue;
        }
        const int64_t E = c->n_experts, Ie = c->moe_intermediate_size, de = c->latent_dim ? c->latent_dim : d;
        MAT(HF("model.layers.%d.block_sparse_moe.gate.weight", i), E, d, MOE_T_F32); /* the router stays f32 */
        VEC1(HF("model.layers.%d.block_sparse_moe.gate.e_score_correction_bias", i), E, 0.0f, 0.01f);
        if (c->latent_dim) {
            MAT(HF("model.layers.%d.block_sparse_moe.routed_expert_down_proj.weight", i), de, d, dense);
            if (c->latent_norm) VEC1(HF("model.layers.%d.block_sparse_moe.routed_expert_norm.weight", i), de, 1.0f, 0.02f);
            MAT(HF("model.layers.%d.block_sparse_moe.routed_expert_up_proj.weight", i), d, de, dense);
        }
        if (c->n_shared) {
            const int64_t S = (int64_t)c->n_shared * Ie;
            MAT(HF("model.layers.%d.block_sparse_moe.shared_experts.gate_proj.weight", i), S, d, dense);
            MAT(HF("model.layers.%d.block_sparse_moe.shared_experts.up_proj.weight", i), S, d, dense);
            MAT(HF("model.layers.%d.block_sparse_moe.shared_experts.down_proj.weight", i), d, S, dense);
        }
        static const char *wn[3] = {"w1", "w3", "w2"}, *gn[3] = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"};
        for (int w = 0; w < 3; w++) {
            int64_t rows = w == 2 ? de : Ie, cols = w == 2 ? Ie : de;
            const int type = fit_type(experts >= 0 ? experts : expert_src_type, cols);
            snprintf(gg, sizeof gg, "blk.%d.%s.weight", i, gn[w]);
            out_tensor *t = add(p, gg, type, SRC_EXPERTS, HF("model.layers.%d.block_sparse_moe.experts.%%d.%s", i, wn[w]));
            t->nd = 3, t->ne[0] = cols, t->ne[1] = rows, t->ne[2] = E;
            t->rows = rows, t->cols = cols, t->n_mats = E;
        }
    }
    VEC1("model.norm.weight", d, 1.0f, 0.02f);
    if (c->attn_res_block) add_res(p, "output_res_score.weight", "model.output_attn_res_norm.weight", d);
    /* the output matrix at higher precision when the rest is 2- to 5-bit (Q8_0 for the 32-value
     * formats, as the runtime converts Q4_0 at load; Q6_K for the 256-value ones, as llama.cpp's
     * k-quant and IQ4_XS mixes) */
    int head = dense;
    switch (dense) {
    case MOE_T_Q4_0: case MOE_T_Q4_1: case MOE_T_Q5_0: case MOE_T_Q5_1: case MOE_T_IQ4_NL: head = MOE_T_Q8_0; break;
    case MOE_T_Q2_K: case MOE_T_Q3_K: case MOE_T_Q4_K: case MOE_T_Q5_K: case MOE_T_IQ4_XS: head = MOE_T_Q6_K; break;
    default: head = moe__is_iq(dense) ? MOE_T_Q6_K : dense; break;
    }
    MAT("lm_head.weight", V, d, head);
#undef HF
#undef MAT
#undef VEC1
}

/* ---- GGUF header ----------------------------------------------------------------------------- */

typedef struct {
    unsigned char *b;
    size_t n, cap;
    int oom;
} buf;

static void put(buf *b, const void *p, size_t n) {
    if (b->oom) return;
    if (b->n + n > b->cap) {
        size_t cap = (b->cap + n) * 2;
        unsigned char *q = realloc(b->b, cap);
        if (!q) { b->oom = 1; return; }
        b->b = q, b->cap = cap;
    }
    memcpy(b->b + b->n, p, n);
    b->n += n;
}
static void put_u32(buf *b, uint32_t v) { put(b, &v, 4); }
static void put_u64(buf *b, uint64_t v) { put(b, &v, 8); }
static void put_str(buf *b, const char *s) { put_u64(b, strlen(s)); put(b, s, strlen(s)); }
static void kv_u16(buf *b, const char *k, uint16_t v) { put_str(b, k); put_u32(b, MOE_GGUF_U16); put(b, &v, 2); }
static void kv_i32(buf *b, const char *k, int32_t v) { put_str(b, k); put_u32(b, MOE_GGUF_I32); put(b, &v, 4); }
static void kv_u32(buf *b, const char *k, uint32_t v) { put_str(b, k); put_u32(b, MOE_GGUF_U32); put_u32(b, v); }
static void kv_f32(buf *b, const char *k, float v) { put_str(b, k); put_u32(b, MOE_GGUF_F32); put(b, &v, 4); }
static void kv_bool(buf *b, const char *k, int v) { uint8_t x = (uint8_t)!!v; put_str(b, k); put_u32(b, MOE_GGUF_BOOL); put(b, &x, 1); }
static void kv_str(buf *b, const char *k, const char *v) { put_str(b, k); put_u32(b, MOE_GGUF_STRING); put_str(b, v); }

typedef struct {
    int n_kv;
    buf b;
    char arch[16];
} meta;

#define K(suffix) (snprintf(key, sizeof key, "%s." suffix, mt->arch), mt->n_kv++, key)

/* GPT-2's byte-level alphabet (what GGUF vocabularies store): printable bytes stand for
 * themselves, the other 68 for U+0100 + k in byte order; appends the UTF-8 of byte b's symbol */
static size_t gpt2_symbol(unsigned char b, char *out) {
    int printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    unsigned cp = b;
    if (!printable) {
        unsigned k = 0;
        for (unsigned x = 0; x < b; x++) k += !((x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE));
        cp = 0x100 + k;
    }
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    out[0] = (char)(0xC0 | cp >> 6), out[1] = (char)(0x80 | (cp & 63));
    return 2;
}

/* The model's tiktoken vocabulary as llama.cpp stores one: tokenizer.ggml.tokens (byte-level
 * strings for the ranks, names for the specials; id = rank), token_type (1 normal, 3 control,
 * 5 unused), pre "kimi-k2". No merges list: moe rebuilds bytes -> rank from the tokens (merges
 * reconstructed from ranks are lossy), so llama.cpp itself cannot use this vocabulary. */
/* bytes as GPT-2 byte symbols (UTF-8) */
static void put_symbols(buf *b, const char *p, size_t n) {
    char tmp[8];
    for (size_t j = 0; j < n; j++) put(b, tmp, gpt2_symbol((unsigned char)p[j], tmp));
}

static void write_vocab(meta *mt, const moe_config *c, const moe_tokenizer *tok) {
    buf *b = &mt->b;
    kv_str(b, "tokenizer.ggml.model", "gpt2"), mt->n_kv++;
    kv_str(b, "tokenizer.ggml.pre", "kimi-k2"), mt->n_kv++;
    put_str(b, "tokenizer.ggml.tokens"), mt->n_kv++;
    put_u32(b, MOE_GGUF_ARRAY), put_u32(b, MOE_GGUF_STRING), put_u64(b, (uint64_t)c->vocab_size);
    for (int32_t i = 0; i < c->vocab_size; i++) {
        size_t n = 0;
        const char *t = moe_token_bytes(tok, i, &n);
        char tmp[64];
        if (!t) {
            snprintf(tmp, sizeof tmp, "<|unused_%d|>", (int)i);
            put_str(b, tmp);
        } else if (moe_token_is_special(tok, i)) {
            put_u64(b, n), put(b, t, n);
        } else {
            size_t len = 0;
            for (size_t j = 0; j < n; j++) len += gpt2_symbol((unsigned char)t[j], tmp);
            put_u64(b, len);
            put_symbols(b, t, n);
        }
    }
    put_str(b, "tokenizer.ggml.token_type"), mt->n_kv++;
    put_u32(b, MOE_GGUF_ARRAY), put_u32(b, MOE_GGUF_I32), put_u64(b, (uint64_t)c->vocab_size);
    for (int32_t i = 0; i < c->vocab_size; i++) {
        int32_t ty = !moe_token_bytes(tok, i, NULL) ? 5 : moe_token_is_special(tok, i) ? 3 : 1;
        put(b, &ty, 4);
    }
}

/* A tiktoken vocabulary has ranks (rank = id), not merges; llama.cpp's "gpt2" tokenizer wants
 * the merge list. Token k's merge joins the two parts that byte-pair encoding of k's bytes,
 * allowed only ranks below k, ends with: the derivation llama.cpp's own converter applies to
 * such vocabularies. Tokens of one byte, and any that do not end in two parts, have none. */
typedef struct {
    const moe_tokenizer *tok;
    int32_t *slot; /* ids by hash of their bytes, -1: empty */
    size_t mask;
} vocab_index;

static uint64_t bytes_hash(const char *p, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)p[i]) * 1099511628211ull;
    return h;
}

/* the id of the mergeable token with these bytes, or -1 */
static int32_t vocab_find(const vocab_index *v, const char *p, size_t n) {
    for (size_t k = bytes_hash(p, n) & v->mask;; k = (k + 1) & v->mask) {
        const int32_t id = v->slot[k];
        if (id < 0) return -1;
        size_t len;
        const char *t = moe_token_bytes(v->tok, id, &len);
        if (len == n && !memcmp(t, p, n)) return id;
    }
}

/* appends tokenizer.ggml.merges; 0 when out of memory */
static int write_merges(meta *mt, const moe_config *c, const moe_tokenizer *tok) {
    vocab_index v = {tok, NULL, 0};
    size_t cap = 16;
    while (cap < 2 * (size_t)c->vocab_size) cap *= 2;
    v.mask = cap - 1;
    buf list = {0}, one = {0};
    if (!(v.slot = malloc(sizeof(int32_t) * cap))) return 0;
    for (size_t k = 0; k < cap; k++) v.slot[k] = -1;
    size_t longest = 1;
    for (int32_t i = 0; i < c->vocab_size; i++) {
        size_t n;
        const char *t = moe_token_bytes(tok, i, &n);
        if (!t || moe_token_is_special(tok, i)) continue;
        size_t k = bytes_hash(t, n) & v.mask;
        while (v.slot[k] >= 0) k = (k + 1) & v.mask;
        v.slot[k] = i;
        longest = n > longest ? n : longest;
    }
    size_t *at = malloc(sizeof(size_t) * (longest + 1)); /* part starts while a token is merged */
    if (!at) { free(v.slot); return 0; }
    uint64_t count = 0;
    for (int32_t i = 0; i < c->vocab_size; i++) {
        size_t n;
        const char *t = moe_token_bytes(tok, i, &n);
        if (!t || moe_token_is_special(tok, i) || n < 2) continue;
        size_t np = n;
        for (size_t j = 0; j <= n; j++) at[j] = j; /* part j is t[at[j] .. at[j+1]) */
        for (;;) {
            int32_t best = -1;
            size_t bj = 0;
            for (size_t j = 0; j + 1 < np; j++) {
                const int32_t r = vocab_find(&v, t + at[j], at[j + 2] - at[j]);
                if (r >= 0 && r < i && (best < 0 || r < best)) best = r, bj = j;
            }
            if (best < 0) break;
            memmove(at + bj + 1, at + bj + 2, sizeof *at * (np - bj - 1));
            np--;
        }
        if (np != 2) continue;
        one.n = 0; /* "A B" in GPT-2's byte symbols, a GGUF string: its length, then its bytes */
        put_symbols(&one, t, at[1]);
        put(&one, " ", 1);
        put_symbols(&one, t + at[1], n - at[1]);
        put_u64(&list, one.n), put(&list, one.b, one.n);
        count++;
    }
    const int ok = !list.oom && !one.oom;
    if (ok) {
        put_str(&mt->b, "tokenizer.ggml.merges"), mt->n_kv++;
        put_u32(&mt->b, MOE_GGUF_ARRAY), put_u32(&mt->b, MOE_GGUF_STRING), put_u64(&mt->b, count);
        put(&mt->b, list.b, list.n);
    }
    free(v.slot), free(at), free(list.b), free(one.b);
    return ok;
}

static void write_meta(meta *mt, const moe_config *c, const char *name, int ctx, int random_vocab, const moe_tokenizer *tok) {
    char key[128];
    buf *b = &mt->b;
    strcpy(mt->arch, is_k3(c) ? "kimi-k3" : "kimi-linear");
    kv_str(b, "general.architecture", mt->arch), mt->n_kv++;
    kv_str(b, "general.name", name), mt->n_kv++;
    kv_u32(b, "general.alignment", gguf_align), mt->n_kv++;
    kv_u32(b, K("block_count"), (uint32_t)c->n_layers);
    kv_u32(b, K("context_length"), (uint32_t)ctx);
    kv_u32(b, K("embedding_length"), (uint32_t)c->hidden_size);
    kv_u32(b, K("vocab_size"), (uint32_t)c->vocab_size);
    kv_u32(b, K("feed_forward_length"), (uint32_t)c->intermediate_size);
    kv_f32(b, K("attention.layer_norm_rms_epsilon"), c->rms_norm_eps);
    kv_u32(b, K("attention.head_count"), (uint32_t)c->mla_heads);
    if (c->kda_heads && c->kda_heads != c->mla_heads) kv_u32(b, K("kda.head_count"), (uint32_t)c->kda_heads); /* ours */
    /* per-layer KV heads: 0 marks a KDA (recurrent) layer, 1 an MLA layer (one latent KV head) */
    put_str(b, K("attention.head_count_kv"));
    put_u32(b, MOE_GGUF_ARRAY), put_u32(b, MOE_GGUF_U32), put_u64(b, (uint64_t)c->n_layers);
    for (int i = 0; i < c->n_layers; i++) put_u32(b, c->layer_kind[i] == MOE_LAYER_MLA ? 1u : 0u);
    if (c->q_lora_rank) kv_u32(b, K("attention.q_lora_rank"), (uint32_t)c->q_lora_rank);
    kv_u32(b, K("attention.kv_lora_rank"), (uint32_t)c->kv_lora_rank);
    kv_u32(b, K("attention.key_length"), (uint32_t)(c->kv_lora_rank + c->qk_rope_dim));
    kv_u32(b, K("attention.value_length"), (uint32_t)c->kv_lora_rank);
    kv_u32(b, K("attention.key_length_mla"), (uint32_t)(c->qk_nope_dim + c->qk_rope_dim));
    kv_u32(b, K("attention.value_length_mla"), (uint32_t)c->v_head_dim);
    kv_u32(b, K("rope.dimension_count"), (uint32_t)c->qk_rope_dim);
    kv_u32(b, K("ssm.conv_kernel"), (uint32_t)c->conv_kernel);
    kv_u32(b, K("kda.head_dim"), (uint32_t)c->kda_head_dim);
    if (c->kda_gate_bounded) {
        kv_f32(b, K("kda.gate_lower_bound"), c->kda_gate_lower_bound);
        kv_bool(b, K("kda.safe_gate"), c->kda_gate_lower_bound >= -5.0f);
    }
    if (c->n_experts) {
        kv_u32(b, K("expert_count"), (uint32_t)c->n_experts);
        kv_u32(b, K("expert_used_count"), (uint32_t)c->n_active);
        kv_u32(b, K("expert_shared_count"), (uint32_t)c->n_shared);
        kv_u32(b, K("expert_feed_forward_length"), (uint32_t)c->moe_intermediate_size);
        kv_u32(b, K("leading_dense_block_count"), (uint32_t)c->first_k_dense);
        kv_f32(b, K("expert_weights_scale"), c->routed_scaling_factor);
        kv_bool(b, K("expert_weights_norm"), c->renormalize);
        kv_u32(b, K("expert_gating_func"), c->router_softmax ? 1u : 2u);
        kv_u32(b, K("expert_group_count"), (uint32_t)c->n_groups);
        kv_u32(b, K("expert_group_used_count"), (uint32_t)c->topk_groups);
        if (c->latent_dim) kv_u32(b, K("expert_latent_length"), (uint32_t)c->latent_dim);
    }
    if (c->hidden_act == MOE_ACT_SITU) {
        kv_f32(b, K("activation.situ_beta"), c->situ_beta);
        kv_f32(b, K("activation.situ_linear_beta"), c->situ_linear_beta);
    }
    if (c->attn_res_block) kv_u32(b, K("attn_res.block_size"), (uint32_t)c->attn_res_block);
    if (c->bos_token_id >= 0) kv_u32(b, "tokenizer.ggml.bos_token_id", (uint32_t)c->bos_token_id), mt->n_kv++;
    if (c->eos_token_id >= 0) kv_u32(b, "tokenizer.ggml.eos_token_id", (uint32_t)c->eos_token_id), mt->n_kv++;
    if (tok) write_vocab(mt, c, tok);
    if (!tok && !random_vocab) /* no tokenizer: llama.cpp loads such a file only when told so ("none": ids only) */
        kv_str(b, "tokenizer.ggml.model", "none"), mt->n_kv++;
    if (tok && !write_merges(mt, c, tok)) mt->b.oom = 1;
    else if (random_vocab) {
        /* a placeholder SPM ("llama") vocabulary, so other engines can load the benchmark file:
         * <unk>, <s>, </s>, 256 byte tokens, then filler pieces */
        kv_str(b, "tokenizer.ggml.model", "llama"), mt->n_kv++;
        put_str(b, "tokenizer.ggml.tokens"), mt->n_kv++;
        put_u32(b, MOE_GGUF_ARRAY), put_u32(b, MOE_GGUF_STRING), put_u64(b, (uint64_t)c->vocab_size);
        for (int i = 0; i < c->vocab_size; i++) {
            char tok[32];
            if (i < 3) snprintf(tok, sizeof tok, "%s", i == 0 ? "<unk>" : i == 1 ? "<s>" : "</s>");
            else if (i < 259) snprintf(tok, sizeof tok, "<0x%02X>", i - 3);
            else snprintf(tok, sizeof tok, "\xe2\x96\x81t%d", i); /* "\u2581t<i>" */
            put_str(b, tok);
        }
        put_str(b, "tokenizer.ggml.scores"), mt->n_kv++;
        put_u32(b, MOE_GGUF_ARRAY), put_u32(b, MOE_GGUF_F32), put_u64(b, (uint64_t)c->vocab_size);
        for (int i = 0; i < c->vocab_size; i++) { float s = -(float)i; put(b, &s, 4); }
        put_str(b, "tokenizer.ggml.token_type"), mt->n_kv++;
        put_u32(b, MOE_GGUF_ARRAY), put_u32(b, MOE_GGUF_I32), put_u64(b, (uint64_t)c->vocab_size);
        for (int i = 0; i < c->vocab_size; i++) { int32_t t = i == 0 ? 2 : i < 3 ? 3 : i < 259 ? 6 : 1; put(b, &t, 4); }
        if (c->bos_token_id < 0) kv_u32(b, "tokenizer.ggml.bos_token_id", 1), mt->n_kv++;
        if (c->eos_token_id < 0) kv_u32(b, "tokenizer.ggml.eos_token_id", 2), mt->n_kv++;
    }
}
#undef K

/* one output file: the whole GGUF, or a part of a split one */
typedef struct {
    char path[4200], partial[4300];
    buf hdr;
    uint64_t data_bytes;
    int fd;
} part;

/* tensors into parts of at most max_bytes of data each (0: one file), in plan order as llama.cpp's
 * gguf-split cuts them (a tensor larger than max_bytes gets a part of its own), from part 1 on
 * with no_tensor_first (part 0 then holds only the metadata); the part count */
static int assign_parts(plan *p, uint64_t max_bytes, int no_tensor_first) {
    int part = no_tensor_first ? 1 : 0;
    uint64_t used = 0;
    for (int i = 0; i < p->n; i++) {
        out_tensor *t = &p->t[i];
        int64_t rows = 1;
        for (int k = 1; k < t->nd; k++) rows *= t->ne[k];
        t->nbytes = (uint64_t)rows * (uint64_t)moe__row_bytes(t->type, t->ne[0]);
        const uint64_t padded = (t->nbytes + gguf_align - 1) / gguf_align * gguf_align;
        if (max_bytes && used && used + padded > max_bytes) part++, used = 0;
        t->part = part;
        used += padded;
    }
    return part + 1;
}

/* the header of part `part` of nparts: magic, version, counts, metadata (all of it in part 0; the
 * alignment in the others) and split.no / split.count / split.tensors.count when nparts > 1, the
 * part's tensor infos (offsets within its data section), padding to gguf_align */
static int build_header(buf *h, const meta *mt, plan *p, int part, int nparts, uint64_t *data_bytes) {
    uint64_t off = 0, n = 0;
    for (int i = 0; i < p->n; i++) {
        out_tensor *t = &p->t[i];
        if (t->part != part) continue;
        t->offset = off;
        off = (off + t->nbytes + gguf_align - 1) / gguf_align * gguf_align;
        n++;
    }
    *data_bytes = off;
    put(h, "GGUF", 4);
    put_u32(h, 3);
    put_u64(h, n);
    put_u64(h, (uint64_t)(part == 0 ? mt->n_kv : 1) + (nparts > 1 ? 3 : 0));
    if (part == 0) put(h, mt->b.b, mt->b.n);
    else kv_u32(h, "general.alignment", gguf_align);
    if (nparts > 1) {
        kv_u16(h, "split.no", (uint16_t)part);
        kv_u16(h, "split.count", (uint16_t)nparts);
        kv_i32(h, "split.tensors.count", p->n);
    }
    for (int i = 0; i < p->n; i++) {
        const out_tensor *t = &p->t[i];
        if (t->part != part) continue;
        put_str(h, t->name);
        put_u32(h, (uint32_t)t->nd);
        for (int k = 0; k < t->nd; k++) put_u64(h, (uint64_t)t->ne[k]);
        put_u32(h, (uint32_t)ggml_id(t->type));
        put_u64(h, t->offset);
    }
    static const unsigned char zero[ALIGN_MAX];
    put(h, zero, (gguf_align - h->n % gguf_align) % gguf_align);
    return !h->oom && !mt->b.oom;
}

/* ---- tensor data ------------------------------------------------------------------------------ */

static uint64_t mix64(uint64_t x) {
    x ^= x >> 30, x *= 0xbf58476d1ce4e5b9ull, x ^= x >> 27, x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* random row: mean + std * (sum of 4 uniforms, centred and scaled: near-normal, never exactly 0
 * for std > 0 in practice), deterministic per (seed, tensor, row) so a resumed run matches */
static void random_row(float *out, int64_t n, uint64_t seed, float mean, float std) {
    uint64_t s = mix64(seed) | 1;
    for (int64_t i = 0; i < n; i++) {
        float u = 0;
        for (int k = 0; k < 4; k++) {
            s ^= s << 13, s ^= s >> 7, s ^= s << 17;
            u += (float)(s >> 40) * (1.0f / 16777216.0f);
        }
        float v = mean + std * (u - 2.0f) * 1.7320508f;
        out[i] = v != 0.0f ? v : std; /* never an exact zero */
    }
}

/* A random row in one of the grid formats (IQ1_S .. IQ3_S), which moe-convert cannot quantize
 * to (llama.cpp's quantizers search the grids with an importance matrix): random bytes, every
 * block's scale then set so its values' RMS is std. For benchmark and test files (--random) only. */
static void random_iq_row(int type, unsigned char *dst, int64_t n, uint64_t seed, float std) {
    const int64_t bb = moe__row_bytes(type, 256);
    uint64_t s = mix64(seed) | 1;
    for (int64_t i = 0; i < n / 256 * bb; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        dst[i] = (unsigned char)(s >> 56);
    }
    float v[256];
    for (int64_t b = 0; b < n / 256; b++) {
        unsigned char *blk = dst + b * bb;
        for (int k = 0; k < 2; k++) { /* k = 0: the RMS at scale 1; k = 1: the scale that makes it std */
            double ss = 0;
            uint16_t h = 0x3c00; /* 1.0 */
            if (k) {
                moe__row_to_f32(type, blk, NULL, v, 256);
                for (int i = 0; i < 256; i++) ss += (double)v[i] * v[i];
                h = moe__f32_to_f16(ss > 0 ? std / (float)sqrt(ss / 256) : 1.0f);
            }
            if (type == MOE_T_IQ1_M) { /* the half-precision scale in the top nibbles of the 4 scale words */
                moe__block_iq1_m *q = (moe__block_iq1_m *)(void *)blk;
                for (int w = 0; w < 4; w++) q->scales[2 * w + 1] = (uint8_t)((q->scales[2 * w + 1] & 0x0f) | ((h >> (4 * w)) & 15) << 4);
            } else {
                memcpy(blk, &h, 2);
            }
        }
    }
}

static uint64_t name_hash(const char *s) {
    uint64_t h = 1469598103934665603ull;
    while (*s) h = (h ^ (unsigned char)*s++) * 1099511628211ull;
    return h;
}

/* one logical row of a source matrix as f32, or (MXFP4 -> MXFP4) repacked bytes directly */
typedef struct {
    const moe__st_tensor *w, *packed, *scale;
} src_mat;

static int find_src(const source *s, const char *hf, src_mat *out, int64_t rows, int64_t cols) {
    char full[320];
    memset(out, 0, sizeof *out);
    snprintf(full, sizeof full, "%s%s", s->prefix, hf);
    out->w = moe__model_tensor(s->m, full);
    if (out->w) {
        int64_t n = 1;
        for (int i = 0; i < out->w->ndim; i++) n *= out->w->shape[i];
        return n == rows * cols && (out->w->type == MOE_T_F32 || out->w->type == MOE_T_F16 || out->w->type == MOE_T_BF16);
    }
    size_t l = strlen(full);
    if (l > 7 && !strcmp(full + l - 7, ".weight")) {
        char pn[330], sn[330];
        snprintf(pn, sizeof pn, "%.*s.weight_packed", (int)(l - 7), full);
        snprintf(sn, sizeof sn, "%.*s.weight_scale", (int)(l - 7), full);
        out->packed = moe__model_tensor(s->m, pn);
        out->scale = moe__model_tensor(s->m, sn);
        return out->packed && out->scale && cols % 32 == 0 && out->packed->nbytes == (uint64_t)(rows * cols / 2) &&
               out->scale->nbytes == (uint64_t)(rows * cols / 32);
    }
    return 0;
}

/* writes row r of matrix src (rows x cols) in type `type` into dst */
static void convert_row(const src_mat *sm, int64_t r, int64_t cols, int type, unsigned char *dst, float *tmp) {
    if (sm->packed && type == MOE_T_MXFP4_GGML) { /* exact repack: same codes and scales */
        const uint8_t *p = (const uint8_t *)sm->packed->data + r * cols / 2, *sc = (const uint8_t *)sm->scale->data + r * cols / 32;
        moe__block_mxfp4 *o = (moe__block_mxfp4 *)dst;
        for (int64_t b = 0; b < cols / 32; b++) {
            uint8_t code[32];
            for (int j = 0; j < 32; j++) {
                uint8_t byte = p[b * 16 + j / 2];
                code[j] = (j & 1) ? byte >> 4 : byte & 15;
            }
            o[b].e = sc[b];
            for (int j = 0; j < 16; j++) o[b].qs[j] = (uint8_t)(code[j] | code[j + 16] << 4);
        }
        return;
    }
    if (sm->packed) moe__row_to_f32(MOE_T_MXFP4, (const uint8_t *)sm->packed->data + r * cols / 2,
                                    (const uint8_t *)sm->scale->data + r * cols / 32, tmp, cols);
    else moe__row_to_f32(sm->w->type, (const unsigned char *)sm->w->data + r * moe__row_bytes(sm->w->type, cols), NULL, tmp, cols);
    if (type == MOE_T_F32) memcpy(dst, tmp, sizeof(float) * (size_t)cols);
    else if (type == MOE_T_BF16) for (int64_t i = 0; i < cols; i++) ((uint16_t *)dst)[i] = moe__f32_to_bf16(tmp[i]);
    else if (type == MOE_T_MXFP4_GGML) { /* from floats: nearest E2M1 with a shared power-of-two scale */
        moe__block_mxfp4 *o = (moe__block_mxfp4 *)dst;
        for (int64_t b = 0; b < cols / 32; b++) {
            float amax = 0;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(tmp[b * 32 + j]));
            int e = amax > 0 ? (int)floorf(log2f(amax)) - 2 + 127 : 0; /* 6 = 1.5 * 2^2 is the top code */
            e = e < 1 ? 1 : e > 254 ? 254 : e;
            float sc = ldexpf(1.0f, e - 127);
            uint8_t code[32];
            for (int j = 0; j < 32; j++) {
                float v = tmp[b * 32 + j] / sc, best = INFINITY;
                int q = 0;
                for (int k = 0; k < 16; k++)
                    if (fabsf(moe__e2m1[k] - v) < best) best = fabsf(moe__e2m1[k] - v), q = k;
                code[j] = (uint8_t)q;
            }
            o[b].e = (uint8_t)e;
            for (int j = 0; j < 16; j++) o[b].qs[j] = (uint8_t)(code[j] | code[j + 16] << 4);
        }
    } else moe__quantize_row(type, tmp, dst, cols);
}

static void drop_pages(const moe__st_tensor *t) {
    if (!t) return;
    uintptr_t a = (uintptr_t)t->data & ~(uintptr_t)4095, e = (uintptr_t)t->data + t->nbytes;
    madvise((void *)a, e - a, MADV_DONTNEED); /* a hint: keeps the resident set bounded */
}

/* the projection row beside an AttnRes site's norm weight t->src (checked by vec_ok) */
static const moe__st_tensor *res_proj(const source *s, const out_tensor *t) {
    char full[320];
    const size_t n = strlen(t->src) - strlen("_norm.weight");
    snprintf(full, sizeof full, "%s%.*s_proj.weight", s->prefix, (int)n, t->src);
    return moe__model_tensor(s->m, full);
}

/* row r of matrix mi of tensor t, converted into dst (tmp: 4 x the widest row of floats) */
static void produce_row(const out_tensor *t, const source *s, const src_mat *sm, int64_t mi, int64_t r, unsigned char *dst, float *tmp) {
    if (!s->m && moe__is_iq(t->type)) {
        random_iq_row(t->type, dst, t->cols, s->seed ^ name_hash(t->name) ^ mix64((uint64_t)(mi * t->rows + r + 1)), t->rstd);
        return;
    }
    if (!s->m) {
        random_row(tmp, t->cols, s->seed ^ name_hash(t->name) ^ mix64((uint64_t)(mi * t->rows + r + 1)), t->rmean, t->rstd);
        if (t->kind == SRC_ALOG) /* a = exp(A_log), A_log ~ log U(1, 16) */
            for (int64_t i = 0; i < t->cols; i++) tmp[i] = -(1.0f + 15.0f * fabsf(tmp[i]) / 2.0f);
        if (t->type == MOE_T_F32) memcpy(dst, tmp, sizeof(float) * (size_t)t->cols);
        else {
            src_mat fake = {0};
            moe__st_tensor ft = {.type = MOE_T_F32, .data = tmp};
            fake.w = &ft;
            convert_row(&fake, 0, t->cols, t->type, dst, tmp + t->cols);
        }
        return;
    }
    if (t->kind == SRC_V_B) { /* kv_b row h*(dn+dv) + dn + r */
        convert_row(sm, mi * (t->dn + t->dv) + t->dn + r, t->cols, t->type, dst, tmp);
        return;
    }
    if (t->kind == SRC_K_B) { /* column r of head mi's d_n key rows */
        const int64_t R = t->rows;
        float *col = tmp + R;
        for (int64_t i = 0; i < t->cols; i++) {
            if (sm->packed) moe__row_to_f32(MOE_T_MXFP4, (const uint8_t *)sm->packed->data + (mi * (t->dn + t->dv) + i) * R / 2,
                                            (const uint8_t *)sm->scale->data + (mi * (t->dn + t->dv) + i) * R / 32, tmp, R);
            else moe__row_to_f32(sm->w->type, (const unsigned char *)sm->w->data + (mi * (t->dn + t->dv) + i) * moe__row_bytes(sm->w->type, R), NULL, tmp, R);
            col[i] = tmp[r];
        }
        src_mat fake = {0};
        moe__st_tensor ft = {.type = MOE_T_F32, .data = col};
        fake.w = &ft;
        convert_row(&fake, 0, t->cols, t->type, dst, col + t->cols);
        return;
    }
    if (t->kind == SRC_RES) { /* norm weight times projection row, as llama.cpp's K3 converter fuses them */
        moe__row_to_f32(sm->w->type, sm->w->data, NULL, tmp, t->cols);
        const moe__st_tensor *pw = res_proj(s, t);
        moe__row_to_f32(pw->type, pw->data, NULL, tmp + t->cols, t->cols);
        for (int64_t i = 0; i < t->cols; i++) tmp[i] *= tmp[t->cols + i];
        memcpy(dst, tmp, sizeof(float) * (size_t)t->cols);
        return;
    }
    if (t->kind == SRC_ALOG || t->kind == SRC_VEC) {
        /* vectors: any stored shape with the right count (A_log may be zero-padded) */
        moe__row_to_f32(sm->w->type, sm->w->data, NULL, tmp, t->cols);
        if (t->kind == SRC_ALOG) for (int64_t i = 0; i < t->cols; i++) tmp[i] = -expf(tmp[i]); /* llama.cpp: -exp(A_log) */
        memcpy(dst, tmp, sizeof(float) * (size_t)t->cols);
        return;
    }
    convert_row(sm, r, t->cols, t->type, dst, tmp);
}

/* produces and writes one tensor at its offset; returns 0 on success. The rows of a chunk are
 * converted by the OpenMP threads where there are any (tmp: tmp_floats for each), each into its
 * own place: the bytes do not depend on the thread count. */
static int write_tensor(int fd, uint64_t data_start, const out_tensor *t, const source *s, unsigned char *obuf, float *tmp, size_t tmp_floats) {
    const int64_t rb = moe__row_bytes(t->type, t->cols);
    const int64_t rows_per_chunk = (int64_t)CHUNK / (rb > 0 ? rb : 1) > 0 ? (int64_t)CHUNK / rb : 1;
    uint64_t pos = data_start + t->offset;
    for (int64_t mi = 0; mi < t->n_mats; mi++) {
        src_mat sm = {0};
        char hf[220];
        if (t->kind == SRC_EXPERTS) snprintf(hf, sizeof hf, t->src, (int)mi), strcat(hf, ".weight");
        else snprintf(hf, sizeof hf, "%s", t->src);
        if (s->m && (t->kind == SRC_K_B || t->kind == SRC_V_B)) {
            const int64_t r = t->kind == SRC_K_B ? t->rows : t->cols;
            if (!find_src(s, hf, &sm, t->n_mats * (t->dn + t->dv), r))
                return die("%s: source tensor %s%s missing or of another size", t->name, s->prefix, hf);
        } else if (s->m && (t->kind == SRC_VEC || t->kind == SRC_ALOG || t->kind == SRC_RES)) {
            char full[320]; /* checked by vec_ok before anything was written */
            snprintf(full, sizeof full, "%s%s", s->prefix, hf);
            sm.w = moe__model_tensor(s->m, full);
        } else if (s->m && !find_src(s, hf, &sm, t->rows, t->cols)) {
            return die("%s: source tensor %s%s missing or of another size", t->name, s->prefix, hf);
        }
        for (int64_t r0 = 0; r0 < t->rows; r0 += rows_per_chunk) {
            const int64_t r1 = r0 + rows_per_chunk < t->rows ? r0 + rows_per_chunk : t->rows;
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 4) if (r1 - r0 >= 16 && t->kind != SRC_VEC && t->kind != SRC_ALOG && t->kind != SRC_RES)
#endif
            for (int64_t r = r0; r < r1; r++) {
#ifdef _OPENMP
                float *mine = tmp + (size_t)omp_get_thread_num() * tmp_floats;
#else
                float *mine = tmp;
                (void)tmp_floats;
#endif
                produce_row(t, s, &sm, mi, r, obuf + (r - r0) * rb, mine);
            }
            const size_t n = (size_t)((r1 - r0) * rb);
            for (size_t done = 0; done < n;) {
                ssize_t w = pwrite(fd, obuf + done, n - done, (off_t)(pos + done));
                if (w < 0 && errno == EINTR) continue;
                if (w <= 0) return die("write %s: %s", t->name, w < 0 ? strerror(errno) : "no progress");
                done += (size_t)w;
            }
            pos += n;
        }
        drop_pages(sm.w), drop_pages(sm.packed), drop_pages(sm.scale);
    }
    return 0;
}

/* A_log vectors may be stored longer (K3 pads to 128 with zeros): find_src wants the exact count,
 * so vectors are looked up with a relaxed count. */
static int vec_ok(const source *s, const out_tensor *t) {
    char full[320];
    snprintf(full, sizeof full, "%s%s", s->prefix, t->src);
    const moe__st_tensor *w = moe__model_tensor(s->m, full);
    if (!w || (w->type != MOE_T_F32 && w->type != MOE_T_F16 && w->type != MOE_T_BF16)) return 0;
    int64_t n = 1;
    for (int i = 0; i < w->ndim; i++) n *= w->shape[i];
    if (t->kind == SRC_RES) { /* the projection row too */
        const moe__st_tensor *pw = res_proj(s, t);
        int64_t np = 1;
        for (int i = 0; pw && i < pw->ndim; i++) np *= pw->shape[i];
        if (!pw || (pw->type != MOE_T_F32 && pw->type != MOE_T_F16 && pw->type != MOE_T_BF16) || np != t->cols) return 0;
    }
    return t->kind == SRC_ALOG ? n >= t->cols : n == t->cols;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---- random-shape models ---------------------------------------------------------------------- */

/* a moe_config from a benchmark shape file (shared/bench/kimi-linear-bench.json format) */
static int config_from_shape(const char *path, moe_config *c, unsigned char **kinds, unsigned char **moe) {
    const char *why;
    FILE *f = open_input(path, &why);
    if (!f) return die("%s: %s", path, why);
    char *text = malloc(1 << 20);
    size_t n = text ? fread(text, 1, (1 << 20) - 1, f) : 0;
    fclose(f);
    moe__json *j;
    char err[200];
    if (!text || moe__json_parse(text, n, &j, err, sizeof err)) { free(text); return die("%s: %s", path, text ? err : "out of memory"); }
    free(text);
#define NUM(obj, key, def) (moe__json_get(obj, key) && moe__json_get(obj, key)->type == MOE_JSON_NUM ? (int)moe__json_get(obj, key)->num : (def))
    const moe__json *kda = moe__json_get(j, "kda"), *mla = moe__json_get(j, "mla"), *ffn = moe__json_get(j, "ffn"), *lt = moe__json_get(j, "layer_types");
    memset(c, 0, sizeof *c);
    c->vocab_size = NUM(j, "n_vocab", 0);
    c->hidden_size = NUM(j, "n_embd", 0);
    c->n_layers = NUM(j, "n_layer", 0);
    c->rms_norm_eps = moe__json_get(j, "rms_norm_eps") ? (float)moe__json_get(j, "rms_norm_eps")->num : 1e-5f;
    c->hidden_act = MOE_ACT_SILU;
    c->situ_beta = 1;
    c->kda_heads = NUM(kda, "n_head", NUM(j, "n_head", 0));
    c->kda_head_dim = NUM(kda, "head_dim", 128);
    c->conv_kernel = NUM(kda, "short_conv_kernel", 4);
    c->mla_heads = NUM(mla, "n_head", NUM(j, "n_head", 0));
    c->q_lora_rank = NUM(mla, "q_lora_rank", 0);
    c->kv_lora_rank = NUM(mla, "kv_lora_rank", 512);
    c->qk_nope_dim = NUM(mla, "qk_nope_head_dim", 128);
    c->qk_rope_dim = NUM(mla, "qk_rope_head_dim", 64);
    c->v_head_dim = NUM(mla, "v_head_dim", 128);
    c->intermediate_size = NUM(ffn, "dense_n_ff", 0);
    c->n_experts = NUM(ffn, "n_expert", 0);
    c->n_active = NUM(ffn, "n_expert_used", 0);
    c->n_shared = NUM(ffn, "n_expert_shared", 0);
    c->moe_intermediate_size = NUM(ffn, "n_ff_exp", 0);
    c->renormalize = 1;
    c->routed_scaling_factor = ffn && moe__json_get(ffn, "expert_weights_scale") ? (float)moe__json_get(ffn, "expert_weights_scale")->num : 1.0f;
    c->n_groups = c->topk_groups = 1;
    c->first_k_dense = NUM(ffn, "n_layer_dense_lead", 0);
    c->moe_layer_freq = 1;
    c->bos_token_id = 1, c->eos_token_id = 2;
    if (c->vocab_size < 1 || c->hidden_size < 1 || c->n_layers < 1 || c->n_layers > 4096 || c->kda_heads < 1 || c->mla_heads < 1 ||
        c->n_active > c->n_experts) {
        moe__json_free(j);
        return die("%s: incomplete or inconsistent shape", path);
    }
    *kinds = calloc((size_t)c->n_layers, 1);
    *moe = calloc((size_t)c->n_layers, 1);
    const moe__json *ml = moe__json_get(lt, "mla_layers");
    for (const moe__json *e = ml ? ml->child : NULL; e; e = e->next)
        if (e->num >= 0 && e->num < c->n_layers) (*kinds)[(int)e->num] = MOE_LAYER_MLA;
    for (int i = 0; i < c->n_layers; i++) (*moe)[i] = c->n_experts && i >= c->first_k_dense;
    c->layer_kind = *kinds;
    c->layer_moe = *moe;
    moe__json_free(j);
#undef NUM
    return 0;
}


/* ---- --k3-slice: a random checkpoint in the released Kimi K3 layout ------------------------------
 * From a shape file's k3_dims and layer list (bench/shapes/k3slice.json): config.json with the
 * text model under text_config, one safetensors shard per layer plus a head shard, tensors named
 * language_model.*, F32 then BF16 then U8 (MXFP4 experts as weight_packed + weight_scale), each
 * group sorted by name as the safetensors writer orders them (so an expert's six tensors are
 * adjacent and experts come in string order of their ids), and model.safetensors.index.json.
 * Shard sizes are checked against the shape file's data_bytes where it gives them. */

typedef struct {
    char name[200];
    int dtype; /* 0 F32, 1 BF16, 2 U8 */
    int nd;
    int64_t shape[3];
} kt;

typedef struct {
    kt *t;
    int n, cap;
} klist;

static void kadd(klist *l, int dtype, int nd, int64_t a, int64_t b, int64_t c, const char *fmt, ...) {
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 512;
        kt *p = realloc(l->t, sizeof *p * (size_t)l->cap);
        if (!p) { fprintf(stderr, "moe-convert: out of memory\n"); exit(1); }
        l->t = p;
    }
    kt *t = &l->t[l->n++];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->name, sizeof t->name, fmt, ap);
    va_end(ap);
    t->dtype = dtype, t->nd = nd, t->shape[0] = a, t->shape[1] = b, t->shape[2] = c;
}

static int kcmp(const void *a, const void *b) {
    const kt *x = a, *y = b;
    return x->dtype != y->dtype ? x->dtype - y->dtype : strcmp(x->name, y->name);
}

static uint64_t kbytes(const kt *t) {
    uint64_t n = 1;
    for (int i = 0; i < t->nd; i++) n *= (uint64_t)t->shape[i];
    return n * (t->dtype == 0 ? 4 : t->dtype == 1 ? 2 : 1);
}

typedef struct {
    int64_t d, V, I, H, ql, kvr, dn, dr, dv, kh, kd, W, alog, E, k, Ie, dl, S, dense, B;
    double eps;
} k3dims;

static void k3_layer(klist *l, const k3dims *k, int i, int kda, int moe) {
    const char *p = "language_model.model.layers";
    const int64_t HD = k->kh * k->kd;
    kadd(l, 1, 1, k->d, 0, 0, "%s.%d.input_layernorm.weight", p, i);
    kadd(l, 1, 1, k->d, 0, 0, "%s.%d.post_attention_layernorm.weight", p, i);
    kadd(l, 1, 1, k->d, 0, 0, "%s.%d.self_attention_res_norm.weight", p, i);
    kadd(l, 1, 2, 1, k->d, 0, "%s.%d.self_attention_res_proj.weight", p, i);
    kadd(l, 1, 1, k->d, 0, 0, "%s.%d.mlp_res_norm.weight", p, i);
    kadd(l, 1, 2, 1, k->d, 0, "%s.%d.mlp_res_proj.weight", p, i);
    if (kda) {
        kadd(l, 0, 1, k->alog, 0, 0, "%s.%d.self_attn.A_log", p, i);
        kadd(l, 0, 1, HD, 0, 0, "%s.%d.self_attn.dt_bias", p, i);
        const char *cv[3] = {"q", "k", "v"};
        for (int a = 0; a < 3; a++) {
            kadd(l, 0, 3, HD, 1, k->W, "%s.%d.self_attn.%s_conv1d.weight", p, i, cv[a]);
            kadd(l, 1, 2, HD, k->d, 0, "%s.%d.self_attn.%s_proj.weight", p, i, cv[a]);
        }
        kadd(l, 0, 1, k->kd, 0, 0, "%s.%d.self_attn.o_norm.weight", p, i);
        kadd(l, 1, 2, k->kh, k->d, 0, "%s.%d.self_attn.b_proj.weight", p, i);
        kadd(l, 1, 2, k->kd, k->d, 0, "%s.%d.self_attn.f_a_proj.weight", p, i);
        kadd(l, 1, 2, HD, k->kd, 0, "%s.%d.self_attn.f_b_proj.weight", p, i);
        kadd(l, 1, 2, HD, k->d, 0, "%s.%d.self_attn.g_proj.weight", p, i);
        kadd(l, 1, 2, k->d, HD, 0, "%s.%d.self_attn.o_proj.weight", p, i);
    } else {
        kadd(l, 1, 2, k->H * k->dv, k->d, 0, "%s.%d.self_attn.g_proj.weight", p, i);
        kadd(l, 1, 1, k->kvr, 0, 0, "%s.%d.self_attn.kv_a_layernorm.weight", p, i);
        kadd(l, 1, 2, k->kvr + k->dr, k->d, 0, "%s.%d.self_attn.kv_a_proj_with_mqa.weight", p, i);
        kadd(l, 1, 2, k->H * (k->dn + k->dv), k->kvr, 0, "%s.%d.self_attn.kv_b_proj.weight", p, i);
        kadd(l, 1, 2, k->d, k->H * k->dv, 0, "%s.%d.self_attn.o_proj.weight", p, i);
        kadd(l, 1, 1, k->ql, 0, 0, "%s.%d.self_attn.q_a_layernorm.weight", p, i);
        kadd(l, 1, 2, k->ql, k->d, 0, "%s.%d.self_attn.q_a_proj.weight", p, i);
        kadd(l, 1, 2, k->H * (k->dn + k->dr), k->ql, 0, "%s.%d.self_attn.q_b_proj.weight", p, i);
    }
    if (!moe) {
        kadd(l, 1, 2, k->d, k->I, 0, "%s.%d.mlp.down_proj.weight", p, i);
        kadd(l, 1, 2, k->I, k->d, 0, "%s.%d.mlp.gate_proj.weight", p, i);
        kadd(l, 1, 2, k->I, k->d, 0, "%s.%d.mlp.up_proj.weight", p, i);
        return;
    }
    kadd(l, 0, 1, k->E, 0, 0, "%s.%d.block_sparse_moe.gate.e_score_correction_bias", p, i);
    kadd(l, 1, 2, k->E, k->d, 0, "%s.%d.block_sparse_moe.gate.weight", p, i);
    kadd(l, 1, 2, k->dl, k->d, 0, "%s.%d.block_sparse_moe.routed_expert_down_proj.weight", p, i);
    kadd(l, 1, 1, k->dl, 0, 0, "%s.%d.block_sparse_moe.routed_expert_norm.weight", p, i);
    kadd(l, 1, 2, k->d, k->dl, 0, "%s.%d.block_sparse_moe.routed_expert_up_proj.weight", p, i);
    kadd(l, 1, 2, k->d, k->S * k->Ie, 0, "%s.%d.block_sparse_moe.shared_experts.down_proj.weight", p, i);
    kadd(l, 1, 2, k->S * k->Ie, k->d, 0, "%s.%d.block_sparse_moe.shared_experts.gate_proj.weight", p, i);
    kadd(l, 1, 2, k->S * k->Ie, k->d, 0, "%s.%d.block_sparse_moe.shared_experts.up_proj.weight", p, i);
    for (int64_t e = 0; e < k->E; e++) {
        const char *wn[3] = {"w1", "w2", "w3"};
        for (int w = 0; w < 3; w++) {
            const int64_t rows = w == 1 ? k->dl : k->Ie, cols = w == 1 ? k->Ie : k->dl;
            kadd(l, 2, 2, rows, cols / 2, 0, "%s.%d.block_sparse_moe.experts.%lld.%s.weight_packed", p, i, (long long)e, wn[w]);
            kadd(l, 2, 2, rows, cols / 32, 0, "%s.%d.block_sparse_moe.experts.%lld.%s.weight_scale", p, i, (long long)e, wn[w]);
        }
    }
}

/* random contents by name: norms near 1, A_log = log U(1,16) then zero padding, MXFP4 codes any
 * nibble with scale bytes 118..123 (real K3 uses 110..123), the rest normal x std */
static void k3_fill(const kt *t, unsigned char *out, uint64_t n_el, uint64_t first, uint64_t seed, int64_t kda_heads) {
    const char *nm = t->name;
    uint64_t s = mix64(seed ^ name_hash(nm) ^ mix64(first + 1)) | 1;
    const int is_norm = strstr(nm, "norm.weight") != NULL, is_scale = strstr(nm, "weight_scale") != NULL;
    const int is_alog = strstr(nm, "A_log") != NULL;
    const float std = strstr(nm, "dt_bias") ? 0.5f : strstr(nm, "conv1d") ? 0.3f : strstr(nm, "correction_bias") ? 0.01f : 0.02f;
    for (uint64_t i = 0; i < n_el; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        if (t->dtype == 2) { out[i] = is_scale ? (unsigned char)(118 + (s >> 32) % 6) : (unsigned char)(s >> 24); continue; }
        float u = ((float)((s >> 40) & 0xffff) + (float)((s >> 16) & 0xffff)) / 65536.0f - 1.0f; /* triangular, mean 0 */
        float v = is_norm ? 1.0f + 0.05f * u : std * 2.4f * u;
        if (is_alog) v = first + i < (uint64_t)kda_heads ? logf(1.0f + 7.5f * (u + 1.0f)) : 0.0f;
        if (v == 0.0f && !is_alog) v = std;
        if (t->dtype == 0) memcpy(out + 4 * i, &v, 4);
        else { uint16_t b = moe__f32_to_bf16(v); memcpy(out + 2 * i, &b, 2); }
    }
}

/* --sparse keeps real (random) bytes only where the routing needs them to vary: the vectors, the
 * routers and the embedding; every other matrix and every expert is a hole of zeros */
static int k3_sparse_hole(const kt *t, int sparse) {
    return sparse && t->nd >= 2 && !strstr(t->name, "embed_tokens") && !strstr(t->name, ".gate.weight") &&
           !(t->nd == 2 && t->shape[0] == 1); /* AttnRes projections [1, d] */
}

static int k3_write_shard(const char *dir, const char *file, kt *t, int n, uint64_t seed, int64_t kda_heads, int sparse,
                          uint64_t *data_bytes) {
    qsort(t, (size_t)n, sizeof *t, kcmp);
    buf h = {0};
    const char *dn[3] = {"F32", "BF16", "U8"};
    char tmp[512];
    put(&h, "{\"__metadata__\":{\"format\":\"pt\"}", 31);
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        int k = snprintf(tmp, sizeof tmp, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[", t[i].name, dn[t[i].dtype]);
        for (int d = 0; d < t[i].nd; d++) k += snprintf(tmp + k, sizeof tmp - (size_t)k, d ? ",%lld" : "%lld", (long long)t[i].shape[d]);
        k += snprintf(tmp + k, sizeof tmp - (size_t)k, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off, (unsigned long long)(off + kbytes(&t[i])));
        put(&h, tmp, (size_t)k);
        off += kbytes(&t[i]);
    }
    put(&h, "}", 1);
    while (h.n % 8) put(&h, " ", 1);
    if (h.oom) return die("out of memory");
    *data_bytes = off;
    char path[4400];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    if (check_output_name(path)) return 1;
    FILE *f = fopen(path, "wb");
    if (!f) return die("%s: %s", path, strerror(errno));
    uint64_t hl = h.n;
    int ok = fwrite(&hl, 8, 1, f) == 1 && fwrite(h.b, 1, h.n, f) == h.n;
    unsigned char *chunk = malloc(CHUNK);
    for (int i = 0; ok && chunk && i < n; i++) {
        const uint64_t es = t[i].dtype == 0 ? 4 : t[i].dtype == 1 ? 2 : 1, total = kbytes(&t[i]) / es;
        if (k3_sparse_hole(&t[i], sparse)) { /* skipped: the file's size is set at the end */
            ok = !fseeko(f, (off_t)kbytes(&t[i]), SEEK_CUR);
            continue;
        }
        for (uint64_t at = 0; ok && at < total; at += CHUNK / es) {
            const uint64_t m = total - at < CHUNK / es ? total - at : CHUNK / es;
            k3_fill(&t[i], chunk, m, at, seed, kda_heads);
            ok = fwrite(chunk, es, m, f) == m;
        }
    }
    free(chunk);
    free(h.b);
    if (ok && sparse) ok = !fflush(f) && !ftruncate(fileno(f), (off_t)(8 + hl + off)); /* a trailing hole */
    if (fclose(f) || !ok) return die("%s: write failed: %s", path, strerror(errno));
    fprintf(stderr, "moe-convert: wrote %s (%d tensors, %.2f GB%s)\n", path, n, (8 + hl + off) / 1e9, sparse ? ", sparse" : "");
    return 0;
}

static int k3_slice(const char *shape, const char *dir, uint64_t seed, int sparse) {
    const char *why;
    FILE *f = open_input(shape, &why);
    if (!f) return die("%s: %s", shape, why);
    char *text = malloc(1 << 22);
    size_t n = text ? fread(text, 1, (1 << 22) - 1, f) : 0;
    fclose(f);
    moe__json *j;
    char err[200];
    if (!text || moe__json_parse(text, n, &j, err, sizeof err)) { free(text); return die("%s: %s", shape, text ? err : "out of memory"); }
    free(text);
    const moe__json *kd = moe__json_get(j, "k3_dims"), *layers = moe__json_get(j, "layers"), *shards = moe__json_get(j, "shards");
#define D(key, def) (moe__json_get(kd, key) && moe__json_get(kd, key)->type == MOE_JSON_NUM ? (int64_t)moe__json_get(kd, key)->num : (def))
    k3dims k = {D("hidden_size", 0), D("vocab_size", 0), D("intermediate_size", 0), D("num_attention_heads", 0), D("q_lora_rank", 0),
                D("kv_lora_rank", 0), D("qk_nope_head_dim", 0), D("qk_rope_head_dim", 0), D("v_head_dim", 0), D("kda_heads", 0),
                D("kda_head_dim", 0), D("short_conv_kernel_size", 4), D("kda_a_log_len", 0), D("num_experts", 0),
                D("num_experts_per_token", 0), D("moe_intermediate_size", 0), D("routed_expert_hidden_size", 0),
                D("num_shared_experts", 0), D("first_k_dense_replace", 1), D("attn_res_block_size", 0), 1e-5};
#undef D
    if (!kd || !layers || layers->type != MOE_JSON_ARR || layers->n < 1 || k.d < 32 || k.d % 32 || k.dl % 32 || k.Ie % 32 || k.E < k.k ||
        k.k < 1 || k.alog < k.kh || k.ql < 1) {
        moe__json_free(j);
        return die("%s: k3_dims and layers incomplete or inconsistent", shape);
    }
    if (mkdir(dir, 0755) && errno != EEXIST) return die("%s: %s", dir, strerror(errno));
    const int L = layers->n;
    char **files = calloc((size_t)L + 1, sizeof *files);
    buf idx = {0};
    put(&idx, "{\n  \"weight_map\": {", strlen("{\n  \"weight_map\": {"));
    uint64_t total = 0;
    int li = 0, first_entry = 1, rc = 0;
    char kda_list[4096] = "", mla_list[4096] = "";
    for (const moe__json *ly = layers->child; ly && !rc; ly = ly->next, li++) {
        const moe__json *att = moe__json_get(ly, "attention"), *ffn = moe__json_get(ly, "ffn");
        const int kda = att && att->str && !strcmp(att->str, "kda"), moe = ffn && ffn->str && !strcmp(ffn->str, "moe");
        char *lst = kda ? kda_list : mla_list;
        snprintf(lst + strlen(lst), 4096 - strlen(lst), "%s%d", lst[0] ? ", " : "", li + 1);
        klist l = {0};
        k3_layer(&l, &k, li, kda, moe);
        files[li] = malloc(64);
        snprintf(files[li], 64, "model-%05d-of-%06d.safetensors", li + 1, L + 1);
        uint64_t db;
        if ((rc = k3_write_shard(dir, files[li], l.t, l.n, seed, k.kh, sparse, &db))) break;
        for (const moe__json *sh = shards ? shards->child : NULL; sh; sh = sh->next) {
            const moe__json *fn = moe__json_get(sh, "file"), *by = moe__json_get(sh, "data_bytes");
            if (fn && fn->str && by && !strcmp(fn->str, files[li]) && (double)db != by->num) {
                rc = die("%s: %llu data bytes, the shape file says %.17g", files[li], (unsigned long long)db, by->num);
            }
        }
        for (int i = 0; i < l.n; i++) {
            char e[512];
            int m = snprintf(e, sizeof e, "%s\n    \"%s\": \"%s\"", first_entry ? "" : ",", l.t[i].name, files[li]);
            put(&idx, e, (size_t)m);
            first_entry = 0;
        }
        total += db;
        free(l.t);
    }
    if (!rc) { /* the head shard: embedding, LM head, final norm and aggregation */
        klist h = {0};
        kadd(&h, 1, 2, k.V, k.d, 0, "language_model.lm_head.weight");
        kadd(&h, 1, 2, k.V, k.d, 0, "language_model.model.embed_tokens.weight");
        kadd(&h, 1, 1, k.d, 0, 0, "language_model.model.norm.weight");
        kadd(&h, 1, 1, k.d, 0, 0, "language_model.model.output_attn_res_norm.weight");
        kadd(&h, 1, 2, 1, k.d, 0, "language_model.model.output_attn_res_proj.weight");
        files[L] = malloc(64);
        snprintf(files[L], 64, "model-%05d-of-%06d.safetensors", L + 1, L + 1);
        uint64_t db;
        rc = k3_write_shard(dir, files[L], h.t, h.n, seed, k.kh, sparse, &db);
        for (int i = 0; !rc && i < h.n; i++) {
            char e[512];
            int m = snprintf(e, sizeof e, ",\n    \"%s\": \"%s\"", h.t[i].name, files[L]);
            put(&idx, e, (size_t)m);
        }
        total += db;
        free(h.t);
    }
    if (!rc) {
        char e[256];
        int m = snprintf(e, sizeof e, "\n  },\n  \"metadata\": {\"total_size\": %llu}\n}\n", (unsigned long long)total);
        put(&idx, e, (size_t)m);
        char path[4400];
        snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
        FILE *o = check_output_name(path) ? NULL : fopen(path, "wb");
        if (!o || fwrite(idx.b, 1, idx.n, o) != idx.n || fclose(o)) rc = die("%s: write failed", path);
        snprintf(path, sizeof path, "%s/config.json", dir);
        o = check_output_name(path) ? NULL : fopen(path, "wb");
        if (!rc && o) {
            fprintf(o, "{\n  \"architectures\": [\"KimiK3ForConditionalGeneration\"],\n  \"model_type\": \"kimi_k3\",\n"
                       "  \"bos_token_id\": 1, \"eos_token_id\": 2, \"pad_token_id\": 0, \"tie_word_embeddings\": false,\n"
                       "  \"text_config\": {\n    \"model_type\": \"kimi_linear\", \"architectures\": [\"KimiLinearForCausalLM\"],\n"
                       "    \"vocab_size\": %lld, \"hidden_size\": %lld, \"intermediate_size\": %lld, \"num_hidden_layers\": %d,\n"
                       "    \"max_position_embeddings\": 1048576, \"rms_norm_eps\": %g, \"hidden_act\": \"situ\", \"activation_situ_beta\": 4.0, \"activation_situ_linear_beta\": 25.0,\n"
                       "    \"num_attention_heads\": %lld, \"num_key_value_heads\": %lld, \"q_lora_rank\": %lld, \"kv_lora_rank\": %lld,\n"
                       "    \"qk_nope_head_dim\": %lld, \"qk_rope_head_dim\": %lld, \"v_head_dim\": %lld, \"mla_use_nope\": true, \"mla_use_output_gate\": true,\n"
                       "    \"linear_attn_config\": {\"kda_layers\": [%s], \"full_attn_layers\": [%s], \"num_heads\": %lld, \"head_dim\": %lld,\n"
                       "      \"short_conv_kernel_size\": %lld, \"gate_lower_bound\": -5.0, \"use_full_rank_gate\": true},\n"
                       "    \"num_experts\": %lld, \"num_experts_per_token\": %lld, \"num_shared_experts\": %lld, \"moe_intermediate_size\": %lld,\n"
                       "    \"routed_expert_hidden_size\": %lld, \"latent_moe_use_norm\": true, \"moe_router_activation_func\": \"sigmoid\",\n"
                       "    \"moe_renormalize\": true, \"routed_scaling_factor\": 2.5, \"num_expert_group\": 1, \"topk_group\": 1,\n"
                       "    \"first_k_dense_replace\": %lld, \"moe_layer_freq\": 1, \"attn_res_block_size\": %lld,\n"
                       "    \"bos_token_id\": 1, \"eos_token_id\": 2, \"tie_word_embeddings\": false,\n"
                       "    \"quantization_config\": {\"quant_method\": \"compressed-tensors\", \"format\": \"mxfp4-pack-quantized\",\n"
                       "      \"quantization_status\": \"compressed\", \"config_groups\": {\"group_0\": {\"format\": \"mxfp4-pack-quantized\",\n"
                       "        \"targets\": [\"Linear\"], \"input_activations\": null, \"output_activations\": null, \"weights\": {\"num_bits\": 4,\n"
                       "        \"type\": \"float\", \"group_size\": 32, \"strategy\": \"group\", \"symmetric\": true, \"scale_dtype\": \"torch.uint8\",\n"
                       "        \"dynamic\": false, \"observer\": \"minmax\"}}},\n"
                       "      \"ignore\": [\"re:.*self_attn.*\", \"re:.*shared_experts.*\", \"re:.*mlp\\\\.(gate|up|gate_up|down)_proj.*\",\n"
                       "        \"re:.*lm_head.*\", \"re:.*vision_tower.*\", \"re:.*mm_projector.*\"]}\n  }\n}\n",
                    (long long)k.V, (long long)k.d, (long long)k.I, L, k.eps, (long long)k.H, (long long)k.H, (long long)k.ql,
                    (long long)k.kvr, (long long)k.dn, (long long)k.dr, (long long)k.dv, kda_list, mla_list, (long long)k.kh,
                    (long long)k.kd, (long long)k.W, (long long)k.E, (long long)k.k, (long long)k.S, (long long)k.Ie,
                    (long long)k.dl, (long long)k.dense, (long long)k.B);
            if (fclose(o)) rc = die("%s: write failed", path);
        } else if (!rc) {
            rc = die("%s: %s", path, strerror(errno));
        }
    }
    for (int i = 0; i <= L; i++) free(files[i]);
    free(files), free(idx.b);
    moe__json_free(j);
    if (!rc) fprintf(stderr, "moe-convert: K3-layout slice in %s: %d layers, %.2f GB of tensor data\n", dir, L, total / 1e9);
    return rc;
}

/* ---- main ------------------------------------------------------------------------------------- */

typedef struct {
    const char *in, *out, *shape, *k3shape;
    int dense, experts, ctx, no_tensor_first, sparse;
    uint64_t seed;
    size_t split_max;
} options;

/* Parses the command line into o; 0, or usage()'s exit status with *done set. */
static int parse_args(int argc, char **argv, options *o, int *done) {
    *o = (options){.dense = MOE_T_BF16, .experts = -1, .ctx = 131072, .seed = 42};
    *done = 1;
    for (int i = 1; i < argc; i++) {
        double v;
        const char *a = argv[i];
        int more = i + 1 < argc;
        if (!strcmp(a, "--random") && more) o->shape = argv[++i];
        else if (!strcmp(a, "--k3-slice") && more) o->k3shape = argv[++i];
        else if (!strcmp(a, "--dense") && more) {
            if ((o->dense = parse_type(argv[++i], 0)) < 0) return usage("unknown --dense type");
        } else if (!strcmp(a, "--experts") && more) {
            if ((o->experts = parse_type(argv[++i], 1)) < -1) return usage("unknown --experts type");
        } else if (!strcmp(a, "--seed") && more) o->seed = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(a, "--sparse")) o->sparse = 1;
        else if (!strcmp(a, "--ctx") && more) {
            if (arg_num("moe-convert", help, a, argv[++i], 1, 1e+09, 1, &v)) return 2;
            o->ctx = (int)v;
        }
        else if (!strcmp(a, "--no-tensor-first-split")) o->no_tensor_first = 1;
        else if (!strcmp(a, "--alignment") && more) {
            const long v = strtol(argv[++i], NULL, 10);
            if (v < 32 || v > ALIGN_MAX || (v & (v - 1))) return usage("--alignment needs a power of two from 32 to 4096");
            gguf_align = (uint32_t)v;
        } else if (!strcmp(a, "--split-max-size") && more) {
            if (!parse_size(argv[++i], &o->split_max) || o->split_max < gguf_align) return usage("--split-max-size needs a size such as 48G");
        }
        else if (!strcmp(a, "-h") || !strcmp(a, "--help")) return usage(NULL);
        else if (a[0] == '-') return arg_unknown("moe-convert", help, a, more ? argv[i + 1] : NULL);
        else if (!o->in && !o->shape && !o->k3shape) o->in = a;
        else if (!o->out) o->out = a;
        else return usage("too many arguments");
    }
    *done = 0;
    return 0;
}

/* The model to convert: a shape file's config (random weights), or a checkpoint opened into src;
 * its config into cfg, its name into name, the stored type of its routed experts. */
static int open_source(options *o, source *src, moe_config *cfg, unsigned char **kinds, unsigned char **moes, char *name, size_t nn,
                       int *expert_src_type) {
    *expert_src_type = MOE_T_BF16;
    if (o->shape) {
        if (config_from_shape(o->shape, cfg, kinds, moes)) return 1;
        if (o->experts < 0) o->experts = o->dense;
        snprintf(name, nn, "random %s", o->shape);
        return 0;
    }
    char err[512];
    moe_options mo = moe_default_options();
    moe_status st = moe_model_open(&src->m, o->in, &mo, err, sizeof err);
    if (st) return die("%s: %s", moe_status_str(st), err);
    if (!strcmp(moe_model_get_info(src->m).format, "gguf")) return die("%s is already GGUF", o->in);
    *cfg = *moe_model_config(src->m);
    src->prefix = moe__model_prefix(src->m);
    /* experts kept as stored: MXFP4 stays MXFP4 (repacked), floats stay BF16 */
    char probe[200];
    for (int i = 0; i < cfg->n_layers; i++)
        if (cfg->layer_moe[i]) {
            snprintf(probe, sizeof probe, "%smodel.layers.%d.block_sparse_moe.experts.0.w1.weight_packed", src->prefix, i);
            if (moe__model_tensor(src->m, probe)) *expert_src_type = MOE_T_MXFP4_GGML;
            break;
        }
    snprintf(name, nn, "%s", o->in);
    return 0;
}

/* the output files: each part's path, header and data size; *total and *hdr_bytes summed */
static part *make_parts(const options *o, const meta *mt, plan *p, int nparts, uint64_t *total, uint64_t *data_bytes, uint64_t *hdr_bytes) {
    part *parts = calloc((size_t)nparts, sizeof *parts);
    if (!parts) return die("out of memory"), NULL;
    const size_t olen = strlen(o->out), plen = olen > 5 && !strcmp(o->out + olen - 5, ".gguf") ? olen - 5 : olen;
    for (int k = 0; k < nparts; k++) {
        part *pt = &parts[k];
        if (!build_header(&pt->hdr, mt, p, k, nparts, &pt->data_bytes)) return die("out of memory"), NULL;
        if (nparts == 1) snprintf(pt->path, sizeof pt->path, "%s", o->out);
        else snprintf(pt->path, sizeof pt->path, "%.*s-%05d-of-%05d.gguf", (int)plen, o->out, k + 1, nparts);
        snprintf(pt->partial, sizeof pt->partial, "%s.partial", pt->path);
        *total += pt->hdr.n + pt->data_bytes, *data_bytes += pt->data_bytes, *hdr_bytes += pt->hdr.n;
    }
    return parts;
}

/* Every output name checked (check_output_name); each part's partial file opened (made if
 * missing, kept as it is), the first one locked for the run so that a second moe-convert writing
 * the same output stops at once. */
static int open_parts(part *parts, int nparts, const char *donef, const char *out) {
    char tmpd[4400];
    snprintf(tmpd, sizeof tmpd, "%s.tmp", donef);
    if (check_output_name(donef) || check_output_name(tmpd)) return 1;
    for (int k = 0; k < nparts; k++) {
        part *pt = &parts[k];
        if (check_output_name(pt->path) || check_output_name(pt->partial)) return 1;
        pt->fd = open(pt->partial, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644);
        if (pt->fd < 0) return die("%s: %s", pt->partial, strerror(errno));
        if (k == 0 && flock(pt->fd, LOCK_EX | LOCK_NB))
            return errno == EWOULDBLOCK ? die("%s: another moe-convert is writing this output; wait for it to end", out)
                                        : die("%s: cannot lock %s: %s", out, pt->partial, strerror(errno));
    }
    return 0;
}

/* Where an interrupted conversion resumes: the tensor count its progress file records, when
 * every part's partial file starts with exactly its header; else 0. */
static int resume_point(const char *donef, const part *parts, int nparts, uint64_t hdr_bytes, const plan *p, const char *out) {
    const char *why;
    FILE *df = open_input(donef, &why);
    if (!df) return 0;
    int start = 0, k, np;
    unsigned long long hn;
    if (fscanf(df, "%d %llu %d", &k, &hn, &np) == 3 && np == nparts && hn == hdr_bytes && k >= 0 && k <= p->n) {
        start = k;
        for (int i = 0; i < nparts && start; i++) {
            unsigned char *old = malloc(parts[i].hdr.n);
            if (!(old && pread(parts[i].fd, old, parts[i].hdr.n, 0) == (ssize_t)parts[i].hdr.n && !memcmp(old, parts[i].hdr.b, parts[i].hdr.n)))
                start = 0;
            free(old);
        }
    }
    fclose(df);
    if (start) fprintf(stderr, "moe-convert: resuming %s after %d of %d tensors\n", nparts > 1 ? out : parts[0].partial, start, p->n);
    return start;
}

/* the partial files, when not resuming, emptied, sized and given their headers */
static int start_parts(part *parts, int nparts, int resuming) {
    for (int k = 0; k < nparts && !resuming; k++) {
        part *pt = &parts[k];
        const uint64_t size = pt->hdr.n + pt->data_bytes;
        if (ftruncate(pt->fd, 0) || ftruncate(pt->fd, (off_t)size)) return die("%s: cannot size to %llu bytes: %s", pt->partial, (unsigned long long)size, strerror(errno));
        if (pwrite(pt->fd, pt->hdr.b, pt->hdr.n, 0) != (ssize_t)pt->hdr.n) return die("%s: header write failed: %s", pt->partial, strerror(errno));
    }
    return 0;
}

/* Writes tensors start .. p->n - 1, each synced and recorded in donef (written anew and renamed
 * over the old record), with progress on stderr. */
static int write_tensors(const plan *p, const part *parts, int start, source *src, const char *donef, uint64_t hdr_bytes, int nparts,
                         uint64_t data_bytes) {
    int64_t maxcols = 1;
    uint64_t maxrow = 1;
    for (int i = 0; i < p->n; i++) {
        if (p->t[i].cols > maxcols) maxcols = p->t[i].cols;
        if (p->t[i].rows > maxcols) maxcols = p->t[i].rows;
        uint64_t rb = (uint64_t)moe__row_bytes(p->t[i].type, p->t[i].cols);
        if (rb > maxrow) maxrow = rb;
    }
    unsigned char *obuf = malloc(CHUNK > maxrow ? CHUNK : maxrow);
#ifdef _OPENMP
    const size_t nthreads = (size_t)omp_get_max_threads();
#else
    const size_t nthreads = 1;
#endif
    const size_t tmp_floats = (size_t)maxcols * 4;
    float *tmp = malloc(sizeof(float) * tmp_floats * nthreads);
    int rc = !obuf || !tmp ? die("out of memory") : 0;
    double t0 = now(), last = 0;
    uint64_t done_bytes = 0, resumed_bytes = 0;
    for (int i = 0; i < start; i++) resumed_bytes += p->t[i].nbytes;
    for (int i = start; i < p->n && !rc; i++) {
        const part *pt = &parts[p->t[i].part];
        if ((rc = write_tensor(pt->fd, pt->hdr.n, &p->t[i], src, obuf, tmp, tmp_floats))) break;
        if (fdatasync(pt->fd)) { rc = die("%s: sync failed: %s", pt->partial, strerror(errno)); break; }
        char tmpd[4400];
        snprintf(tmpd, sizeof tmpd, "%s.tmp", donef);
        FILE *w = fopen(tmpd, "w");
        if (!w || fprintf(w, "%d %llu %d\n", i + 1, (unsigned long long)hdr_bytes, nparts) < 0 || fclose(w) || rename(tmpd, donef)) {
            rc = die("%s: cannot record progress", donef);
            break;
        }
        done_bytes += p->t[i].nbytes;
        /* test hook: simulate a crash after N tensors (the resume test uses it) */
        const char *stop = getenv("MOE_CONVERT_STOP_AFTER");
        if (stop && i + 1 == atoi(stop)) _exit(3);
        double t = now();
        if (t - last > 1.0 || i + 1 == p->n) {
            double rate = done_bytes / (t - t0 + 1e-9);
            uint64_t left = data_bytes - done_bytes - resumed_bytes;
            fprintf(stderr, "\rmoe-convert: %d/%d tensors, %.2f/%.2f GB, %.1f MB/s, ETA %.0f s   ", i + 1, p->n,
                    (done_bytes + resumed_bytes) / 1e9, data_bytes / 1e9, rate / 1e6, rate > 0 ? left / rate : 0.0);
            last = t;
        }
    }
    free(obuf), free(tmp);
    if (!rc) fprintf(stderr, "\n");
    return rc;
}

/* the parts synced, closed and renamed to their names; the progress record removed */
static int finish_parts(part *parts, int nparts, const char *donef) {
    for (int k = 0; k < nparts; k++)
        if (fsync(parts[k].fd) || close(parts[k].fd)) return die("%s: %s", parts[k].partial, strerror(errno));
    for (int k = 0; k < nparts; k++)
        if (rename(parts[k].partial, parts[k].path)) return die("rename %s -> %s: %s", parts[k].partial, parts[k].path, strerror(errno));
    remove(donef);
    return 0;
}

int main(int argc, char **argv) {
    options o;
    int stop, rc = parse_args(argc, argv, &o, &stop);
    if (stop) return rc;
    if (o.k3shape) return o.out ? k3_slice(o.k3shape, o.out, o.seed, o.sparse) : usage("--k3-slice SHAPE.json needs OUT_DIR");
    if (!o.out || (!o.in && !o.shape)) return usage("need MODEL_DIR (or --random SHAPE.json) and OUT.gguf");
    if (!o.shape && (moe__is_iq(o.dense) || moe__is_iq(o.experts)))
        return usage("the IQ1_S .. IQ3_S formats are written with --random only: quantizing to them takes llama.cpp's grid search "
                     "with an importance matrix (llama-quantize --imatrix); moe reads such files");
    source src = {NULL, "", o.seed};
    moe_config cfg;
    unsigned char *kinds = NULL, *moes = NULL;
    int expert_src_type;
    char name[256];
    if (open_source(&o, &src, &cfg, &kinds, &moes, name, sizeof name, &expert_src_type)) return 1;
    plan p = {0};
    meta mt = {0};
    part *parts = NULL;
    int nparts = 0;
    rc = 0;
    build_plan(&p, &cfg, o.dense, o.experts, expert_src_type);
    for (int i = 0; src.m && i < p.n && !rc; i++)
        if ((p.t[i].kind == SRC_VEC || p.t[i].kind == SRC_ALOG || p.t[i].kind == SRC_RES) && !vec_ok(&src, &p.t[i]))
            rc = die("%s: source tensor %s%s missing or of another size", p.t[i].name, src.prefix, p.t[i].src);
    if (rc) goto done;
    moe_tokenizer *tok = NULL;
    char terr[300];
    if (src.m && moe_tokenizer_for_model(&tok, src.m, terr, sizeof terr) == MOE_OK)
        fprintf(stderr, "moe-convert: writing the vocabulary (%d ids) into the GGUF\n", (int)moe_tokenizer_n_ids(tok));
    write_meta(&mt, &cfg, name, o.ctx, o.shape != NULL, tok);
    moe_tokenizer_free(tok);
    nparts = assign_parts(&p, o.split_max, o.no_tensor_first);
    if (nparts > 65535) {
        rc = die("--split-max-size %zu makes %d parts (GGUF's split.count is 16 bits)", o.split_max, nparts);
        goto done;
    }
    uint64_t total = 0, data_bytes = 0, hdr_bytes = 0;
    if (!(parts = make_parts(&o, &mt, &p, nparts, &total, &data_bytes, &hdr_bytes))) {
        rc = 1;
        goto done;
    }
    char donef[4300];
    snprintf(donef, sizeof donef, "%s.partial.done", o.out);
    if (open_parts(parts, nparts, donef, o.out)) {
        rc = 1;
        goto done;
    }
    const int start = resume_point(donef, parts, nparts, hdr_bytes, &p, o.out);
    const double t0 = now();
    if (start_parts(parts, nparts, start) || write_tensors(&p, parts, start, &src, donef, hdr_bytes, nparts, data_bytes) ||
        finish_parts(parts, nparts, donef)) {
        rc = 1;
        goto done;
    }
    if (nparts > 1)
        fprintf(stderr, "moe-convert: wrote %s .. %s (%d parts, %.3f GB, %d tensors, %s) in %.1f s\n", parts[0].path,
                parts[nparts - 1].path, nparts, total / 1e9, p.n, mt.arch, now() - t0);
    else
        fprintf(stderr, "moe-convert: wrote %s (%.3f GB, %d tensors, %s) in %.1f s\n", o.out, total / 1e9, p.n, mt.arch, now() - t0);
done:
    for (int k = 0; parts && k < nparts; k++) free(parts[k].hdr.b);
    free(parts), free(mt.b.b), free(p.t), free(kinds), free(moes);
    moe_model_close(src.m);
    return rc;
}
