/* moe.h - CPU inference for sparse Mixture-of-Experts language models of the Kimi Linear /
 * Kimi K3 family (KDA linear attention, gated MLA, block attention residuals, latent MoE).
 * Copyright (c) 2026 the moe authors. MIT License: see LICENSE (the three runtime files are
 * under it whole; keep this notice in copies).
 *
 * Drop-in: copy moe.h, moe.c and quant.c into your tree and compile them with your own flags
 * (C11, libc + libm; OpenMP used when the compiler has it). Minimal use:
 *
 *     moe_model *m; moe_session *s; char err[256];
 *     moe_options o = moe_default_options();
 *     if (moe_model_open(&m, "Kimi-K3/", &o, err, sizeof err)) { puts(err); return 1; }
 *     if (moe_session_new(&s, m, 4096, err, sizeof err)) { puts(err); return 1; }
 *     int32_t ids[] = {1, 2, 3};
 *     float *logits = malloc(sizeof(float) * moe_model_config(m)->vocab_size);
 *     moe_seq q = {.s = s, .tokens = ids, .n = 3, .logits = logits};   // logits of the last token only
 *     if (moe_step(m, &q, 1, NULL, err, sizeof err)) { puts(err); }
 *     moe_session_free(s); moe_model_close(m); free(logits);
 *
 * Threading: no global mutable state. A moe_model is read-only after moe_model_open and may be
 * shared by any number of threads and sessions. A moe_session is used by one thread at a time;
 * a moe_step call may include several sessions, each at most once. Worker threads (OpenMP) are
 * created per call, sized by moe_options.n_threads; none outlive a call. OpenMP's threads do not
 * survive fork(): a child forked after a multi-threaded call steps with n_threads 1 (or execs).
 *
 * Ownership: every object is created through a `**out` constructor and freed by its *_free or
 * *_close function, which accept NULL. Pointers returned by accessors stay valid until the object
 * they came from is freed. Every fallible call returns a moe_status; when err is non-NULL it also
 * receives a NUL-terminated message (truncated to errlen) naming the file, tensor or argument.
 *
 * Sections (grep the banner): "---- options", "---- model", "---- sessions", "---- stepping",
 * "---- tokenizer", "---- chat formats", "---- sampling" make the API; after them
 * "---- internal:" sections, compiled only under MOE_INTERNAL, hold what moe.c, quant.c and
 * test/ share: number formats and block layouts, the kernel table, parsers, hooks for tests and
 * tools, the KDA and MLA cores. They are not part of the API and may change.
 */
#ifndef MOE_H
#define MOE_H

#include <stddef.h>
#include <stdint.h>

#ifndef MOE_API
#define MOE_API /* the embedding program may define this, e.g. for symbol visibility */
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef struct moe_model moe_model;     /* mapped files, config, weights: read-only, shared */
typedef struct moe_session moe_session; /* one sequence: KDA states, MLA latents, position */

typedef enum {
    MOE_OK = 0,
    MOE_ERR_IO,          /* open/read/mmap failed */
    MOE_ERR_FORMAT,      /* a file is malformed or inconsistent with its config */
    MOE_ERR_UNSUPPORTED, /* valid, but a feature this build does not implement */
    MOE_ERR_NOMEM,       /* allocation failed */
    MOE_ERR_ARG,         /* a bad argument: NULL, token id out of range, wrong model, ... */
    MOE_ERR_CTX_FULL,    /* the step would exceed the session's context size */
    MOE_ERR_RANGE,       /* an output buffer is too small (the size needed is reported) */
    MOE_ERR_NUMERIC      /* a weight or a step's logits hold a NaN or an infinity */
} moe_status;

/* Static string describing a status; never NULL. */
MOE_API const char *moe_status_str(moe_status st);

/* ---- options ---------------------------------------------------------------------------- */

enum {
    MOE_FLAG_FORCE_SCALAR = 1u << 0,  /* use the scalar reference kernels only */
    MOE_FLAG_KDA_RECURRENT = 1u << 1, /* always use the KDA recurrence (default: pick by shape) */
    MOE_FLAG_KDA_CHUNKED = 1u << 2,   /* always use the chunked KDA form for prefill */
    MOE_FLAG_MLA_ABSORBED = 1u << 3,  /* always use absorbed MLA attention */
    MOE_FLAG_MLA_EXPANDED = 1u << 4,  /* always expand MLA keys/values from the latent cache */
    MOE_FLAG_NO_REPACK = 1u << 5,     /* keep Q4_0/Q8_0/Q2_K..Q5_K/IQ4_XS (MXFP4) matrices as stored (mapped) instead
                                         of interleaving them 8 rows at a time into RAM at load, and
                                         the other block formats mapped instead of copied there */
    MOE_FLAG_NO_DIRECT_IO = 1u << 6,  /* CACHE mode: read experts through the page cache instead of
                                         with O_DIRECT (used where the file system allows it) */
    MOE_FLAG_MXFP4_INT8 = 1u << 7,    /* MXFP4 matrices meet their input quantized to 8-bit blocks
                                         (2 E2M1 is an exact int8: integer dot products, as for
                                         Q8_0), instead of f32 input (exact, the default); they
                                         are interleaved like Q4_0 (unless MOE_FLAG_NO_REPACK) */
    MOE_FLAG_ACT16 = 1u << 8,         /* integer-format matrices meet their input as two 8-bit
                                         parts: the blocks as quantized, plus their rounding error
                                         quantized the same way (its scale ~1/254 of the first),
                                         through the same kernels, the two products summed: about
                                         16-bit input for twice the arithmetic (decode still reads
                                         each weight once). On the shipped model it halves Q8_0's
                                         KL divergence (docs/numerics.md) */
    MOE_FLAG_PLAN = 1u << 9,          /* moe_model_open chooses the options the caller did not set
                                         (moe_options.set) by the resource plan (moe_plan_make) */
    MOE_FLAG_CHECK_TENSORS = 1u << 10 /* read every F32/F16/BF16 tensor at open and refuse one that
                                         holds a NaN or an infinity, by name (MOE_ERR_NUMERIC).
                                         Without it the check is where the data is read anyway:
                                         matrices converted at load, vectors, units the expert
                                         cache reads, and every step's logits (moe_step); matrices
                                         used in place from the mapping are not read at open */
};

/* How routed experts reach memory. MMAP: through the files' mapping (the page cache caches).
 * CACHE: the model reads each expert it needs with pread into a cache of at most expert_budget
 * bytes it owns, evicting the least recently used expert not in use; the files are not touched
 * through the mapping for experts then. */
typedef enum { MOE_EXPERTS_MMAP = 0, MOE_EXPERTS_CACHE = 1 } moe_expert_mode;

/* The MLA latent cache element (moe_options.kv_type). F32 keeps the latents as computed (exact);
 * BF16 halves the cache (Kimi K3 at a million tokens: 55 GB -> 28 GB) and what a decode step reads
 * from it, at the price of rounding each latent to 8 significant bits (as a bf16 model's own
 * inference keeps it); attention then runs in f32 on the rounded values. */
/* Q8 quarters the f32 cache (K3 at a million tokens: 14 GB): per token its latent and its key
 * slice kr as int8 with one scale each (and each values' sum), 592 bytes a token at K3's shape.
 * Decode attention then runs in integer products: each head's query quantized the same way, and
 * the softmax weights of a block of keys quantized to 8 bits (per head and block one scale)
 * before they meet the latents; prefill widens the rows to f32. Lossy: see docs/numerics.md for the KL
 * divergence it costs. */
typedef enum { MOE_KV_F32 = 0, MOE_KV_BF16 = 1, MOE_KV_Q8 = 2 } moe_kv_type;

/* Weight formats a model can be converted to at load (moe_options.dense_type/expert_type). */
typedef enum {
    MOE_WTYPE_ASIS = 0, /* keep the stored format (memory-mapped, nothing copied) */
    MOE_WTYPE_F32,
    MOE_WTYPE_BF16,
    MOE_WTYPE_Q8_0, /* ggml Q8_0: int8 x half scale per 32 values */
    MOE_WTYPE_Q4_0  /* ggml Q4_0: 4-bit x half scale per 32 values */
} moe_wtype;

typedef struct {
    int n_threads;          /* worker threads per call (default: the physical cores this process
                               may use, as the resource plan counts them); <= 0 means 1 */
    int n_batch;            /* rows per internal forward chunk (bounds activation memory; larger
                               chunks read each weight, and each routed expert from disk, once for
                               more rows, and rebuild MLA's expanded keys less often); <= 0 (the
                               default): 2048 with mapped experts, 512 in the cache mode, where
                               working memory sits beside the expert budget */
    size_t expert_budget;   /* CACHE mode: RAM for routed experts in bytes; it must hold n_threads
                               experts, plus one layer's dense matrices when dense_budget streams
                               some (checked at open) */
    size_t dense_budget;    /* CACHE mode: RAM for the layers' dense matrices (attention, shared
                               experts, latent projections) in their loaded format; 0: all resident.
                               Layers are kept resident in order while they fit; the matrices of the
                               rest are read from disk as stored, every step, through the expert
                               cache (the next layer's while this one computes). Routers, norms,
                               the embedding and the LM head stay resident. */
    int expert_mode;        /* moe_expert_mode */
    int io_threads;         /* CACHE mode: threads that read experts from disk (default 4; 0: the
                               compute threads read what they need, and there is no prefetch).
                               A layer's experts are queued as soon as it has routed, so reads run
                               in parallel, in file offset order, while earlier experts compute */
    int prefetch;           /* CACHE mode: predict the next MoE layer's experts with its router on
                               the current hidden state and read them on the model's I/O thread
                               while the current layer computes (default 1) */
    int dense_type;         /* moe_wtype for the attention, dense FFN, shared expert and LM-head
                               matrices, converted at load into RAM the model owns */
    int expert_type;        /* moe_wtype for the routed experts (makes them resident) */
    unsigned flags;         /* MOE_FLAG_* */
    int kv_type;            /* moe_kv_type: the element of the sessions' MLA latent caches */
    size_t repack_budget;   /* MMAP mode: mapped routed experts in Q4_0/Q8_0 (MXFP4 under
                               MOE_FLAG_MXFP4_INT8) are interleaved into RAM at load only when
                               every matrix to interleave fits in this many bytes (0: three
                               quarters of the physical RAM); otherwise they stay mapped as stored
                               and run the row kernels (a model larger than RAM streams from disk
                               through the page cache instead of filling RAM and swap) */
    /* called from moe_model_open while weights are converted or interleaved (the slow part of a
     * load): stage names the work, frac runs from 0 to 1; may be NULL */
    void (*progress)(void *ud, const char *stage, float frac);
    void *progress_ud;
    /* the kernel set by name instead of the best this CPU runs (NULL or ""): one of the levels in
     * moe_model_info.kernels' list that this CPU has, e.g. "avx2" to compare with "avxvnni";
     * opening fails with MOE_ERR_ARG, naming the ones it has, for any other. Overrides
     * MOE_FLAG_FORCE_SCALAR. */
    const char *kernels;
    unsigned set;           /* MOE_SET_*: the fields the caller chose, which MOE_FLAG_PLAN keeps */
} moe_options;

enum {
    MOE_SET_THREADS = 1u << 0, MOE_SET_EXPERT_MODE = 1u << 1, MOE_SET_EXPERT_BUDGET = 1u << 2,
    MOE_SET_DENSE_BUDGET = 1u << 3, MOE_SET_DENSE_TYPE = 1u << 4, MOE_SET_IO_THREADS = 1u << 5,
    MOE_SET_PREFETCH = 1u << 6
};

/* The resource plan: what this process may use, and the options that follow for a model. */
typedef struct {
    uint64_t mem_bytes;   /* memory it may use: the smallest of the cgroup's limit (v2 memory.max,
                             v1 memory.limit_in_bytes, the nearest ancestor's too), MemAvailable
                             and RLIMIT_AS */
    const char *mem_from; /* which of them: "cgroup v2", "cgroup v1", "MemAvailable", "RLIMIT_AS" */
    int cpus;             /* CPUs it may run on: its affinity, and the cgroup's CPU quota */
    int cores;            /* physical cores among them (the default thread count) */
    double disk_gbps[2];  /* the model's largest file read with O_DIRECT by 4 and by 16 readers
                             (blocks of 2 MB at random offsets, 64 MB each, once per device and
                             process); 0: not probed (only the cache mode reads the disk itself) */
    uint64_t dense_bytes; /* non-expert bytes a decoded token reads, in the chosen dense_type */
    uint64_t expert_bytes;/* routed experts as stored */
    moe_options opt;      /* the options to open the model with */
    char summary[480];    /* the choices and the figures behind them, one line */
} moe_plan;

/* Plans the options opt did not set (opt->set) for the model at path: threads (the physical
 * cores), the expert mode (mmap where the weights fit in memory, else the expert cache), the
 * dense matrices' format (as stored where mapped; quantized to Q8_0 at load where they are
 * floats and Q8_0 leaves room for the experts a step needs, else Q4_0, with a dense budget when
 * even that does not fit), the expert budget (the rest), I/O threads (16 where 16 readers read
 * the model's disk at least 1.1x faster than 4, else 4) and prefetch (on). Reads the model's
 * headers, and with the cache mode probes its disk. */
MOE_API moe_status moe_plan_make(moe_plan *plan, const char *path, const moe_options *opt, char *err,
                                 size_t errlen);

/* Defaults: 1 thread, n_batch by the expert mode, mmap experts, weights as stored, no flags. The router,
 * the embedding and MLA's kv_b stay as stored whatever dense_type says; so does a matrix whose
 * row length is not a multiple of 32 when a block format is asked for; with dense_type Q4_0 the
 * LM head becomes Q8_0. */
MOE_API moe_options moe_default_options(void);

/* ---- model ------------------------------------------------------------------------------ */

enum { MOE_LAYER_KDA = 0, MOE_LAYER_MLA = 1 };
enum { MOE_ACT_SILU = 0, MOE_ACT_SITU = 1 };

/* The text model's configuration, after defaults are applied (docs/spec/MODEL.md section 1). */
typedef struct {
    int vocab_size, hidden_size, n_layers;
    float rms_norm_eps;
    int hidden_act; /* MOE_ACT_* */
    float situ_beta, situ_linear_beta; /* situ_linear_beta 0: no tanh on the up branch */
    int intermediate_size;
    /* KDA */
    int kda_heads, kda_head_dim, conv_kernel;
    int kda_gate_bounded;      /* 1: g = lb * sigmoid(..); 0: softplus gate */
    float kda_gate_lower_bound;
    int kda_full_rank_gate;
    /* MLA */
    int mla_heads, q_lora_rank, kv_lora_rank, qk_nope_dim, qk_rope_dim, v_head_dim;
    int mla_output_gate;
    /* MoE */
    int n_experts, n_active, n_shared, moe_intermediate_size;
    int router_softmax, renormalize;
    float routed_scaling_factor;
    int n_groups, topk_groups, first_k_dense, moe_layer_freq;
    int latent_dim, latent_norm; /* latent_dim 0: no latent MoE */
    /* residuals */
    int attn_res_block; /* 0: plain residuals */
    int tie_embeddings; /* lm_head shares embed_tokens (only used when lm_head is absent) */
    int bos_token_id, eos_token_id;
    const unsigned char *layer_kind; /* [n_layers] MOE_LAYER_* */
    const unsigned char *layer_moe;  /* [n_layers] 1 if the FFN is MoE */
} moe_config;

typedef struct {
    uint64_t n_params;        /* every weight of the text model */
    uint64_t n_params_active; /* weights touched per token (shared + k routed experts) */
    uint64_t weight_bytes;    /* bytes of text-model weights as stored */
    uint64_t expert_bytes;    /* bytes of routed-expert weights as stored */
    uint64_t dense_bytes_per_token; /* non-expert weight bytes one decoded token reads, in the
                                       formats used after load (one embedding row) */
    uint64_t dense_bytes_as[5];     /* the same were dense_type each moe_wtype (ASIS: as stored) */
    uint64_t serial_bytes_per_token; /* of dense_bytes_per_token, what no expert read of the token
                                        can overlap: the layers before its first MoE layer, that
                                        layer's mixer and router (its routing is not known before
                                        them), the last MoE layer's latent up-projection, the
                                        layers after it, the LM head (its experts are all in) */
    int streamed_layers;      /* CACHE mode: layers whose dense matrices are read every step */
    uint64_t streamed_bytes;  /* bytes of those matrices as stored (read once per step) */
    int n_files;              /* weight files mapped (safetensors shards, GGUF parts) */
    const char *format;       /* "safetensors" or "gguf" */
    const char *weight_type;  /* the format holding most weight bytes after load: "bf16", "q4_0", ... */
    int experts_kept_mapped;  /* 1: MMAP mode kept routed experts that the x8 kernels could take
                                 mapped as stored, as they did not fit in repack_budget */
    const char *kernels;      /* the kernel set chosen for this CPU at load: "scalar" (also under
                                 MOE_FLAG_FORCE_SCALAR or a MOE_NO_SIMD build), "avx2", "avxvnni",
                                 "avx512", "avx512vnni", "amx", "neon" or "neon-dotprod" */
    int n_batch;              /* rows per forward chunk in use (moe_options.n_batch, or its default) */
} moe_model_info;

/* Opens a model: a GGUF file (llama.cpp's converter's or moe-convert's; the first part of a
 * split GGUF, PREFIX-00001-of-0000N.gguf, brings the other parts), a Hugging Face checkpoint
 * directory (config.json + model.safetensors, or shards with model.safetensors.index.json), or a
 * single .safetensors file with config.json beside it. Files must be regular files; they are
 * memory-mapped read-only and validated before use. opt may be NULL (defaults). On success *out
 * owns the model; free it with moe_model_close. On failure *out is NULL and err says what is
 * wrong, naming the path. */
MOE_API moe_status moe_model_open(moe_model **out, const char *path, const moe_options *opt,
                                  char *err, size_t errlen);
MOE_API void moe_model_close(moe_model *m);

/* Valid until moe_model_close. */
MOE_API const moe_config *moe_model_config(const moe_model *m);
MOE_API moe_model_info moe_model_get_info(const moe_model *m);
/* The plan moe_model_open followed under MOE_FLAG_PLAN; NULL without it. */
MOE_API const moe_plan *moe_model_plan(const moe_model *m);

/* ---- sessions --------------------------------------------------------------------------- */

/* A new empty sequence of at most n_ctx tokens. Memory for the MLA latent cache grows with the
 * sequence; the KDA states are allocated here. A session refers to its model: free every session
 * before closing the model. */
MOE_API moe_status moe_session_new(moe_session **out, moe_model *m, int n_ctx, char *err,
                                   size_t errlen);
MOE_API void moe_session_free(moe_session *s);
/* Back to an empty sequence (position 0). */
MOE_API void moe_session_reset(moe_session *s);
/* Number of tokens the session has consumed. */
MOE_API int moe_session_pos(const moe_session *s);
/* A new session with a copy of src's state: a snapshot, or a fork sharing a computed prefix. */
MOE_API moe_status moe_session_fork(moe_session **out, const moe_session *src, char *err,
                                    size_t errlen);
/* Overwrites dst's state with src's (same model); dst's n_ctx must be >= src's position. */
MOE_API moe_status moe_session_restore(moe_session *dst, const moe_session *src, char *err,
                                       size_t errlen);
/* A session's state on disk, for a prefix cache that outlives the process. moe_session_save
 * writes the state (KDA states, MLA latents, position) to fd at its offset, with the model's
 * identity (moe_model_id) and a checksum; moe_session_load reads it back into s, at the end of
 * the same model opened with the same state-shaping options, and refuses, naming why, a state of
 * another model or options, one longer than s's context, a cut or damaged one (s is then reset).
 * The caller owns fd: writing to a temporary file and renaming it makes the file appear whole. */
MOE_API moe_status moe_session_save(const moe_session *s, int fd, char *err, size_t errlen);
MOE_API moe_status moe_session_load(moe_session *s, int fd, char *err, size_t errlen);
/* Bytes of the state moe_session_save writes (its header and checksum aside): also what a copy
 * of the session (moe_session_fork) holds. */
MOE_API size_t moe_session_state_bytes(const moe_session *s);
/* A 64-bit identity of what a session's state depends on: the model's shape and layer kinds, a
 * sample of its weights (the embedding's and LM head's first and last 64 KiB, the final norm,
 * the first KiB of each layer's first dense matrix) and the options that change the numbers
 * (kv_type, MOE_FLAG_MXFP4_INT8, MOE_FLAG_ACT16, dense_type). Two models that differ only in
 * weights outside that sample (a fine-tune of routed experts alone) are not told apart. */
MOE_API uint64_t moe_model_id(const moe_model *m);

/* ---- stepping --------------------------------------------------------------------------- */

/* One sequence's share of a step. tokens[0..n) are appended to session s. logits (may be NULL)
 * receives float32 logits: vocab_size floats for the last token, or n * vocab_size for every
 * token when logits_all is set. routes (may be NULL) receives the routed experts chosen for every
 * token and layer: n * n_layers * n_active int32, -1 for layers without MoE. force_routes (may be
 * NULL, same layout) makes every MoE layer use the given experts instead of its own top-k (the
 * weights still come from the router): a diagnostic that separates numeric error from routing
 * flips, e.g. when comparing a quantized model with its original. */
typedef struct {
    moe_session *s;
    const int32_t *tokens;
    int n;
    float *logits;
    int logits_all;
    int32_t *routes;
    const int32_t *force_routes;
    int nonfinite; /* set by moe_step: 1 when this sequence's logits hold a NaN or an infinity */
} moe_seq;

typedef struct {
    int n_tokens;          /* rows processed */
    int n_chunks;          /* internal forward chunks */
    uint64_t expert_rows;  /* (token, expert) pairs computed */
    uint64_t expert_loads; /* distinct experts reached per chunk and layer, summed */
    uint64_t expert_bytes; /* bytes of expert weights those loads touched */
    uint64_t cache_hits, cache_misses; /* CACHE mode: experts found resident / read from disk */
    uint64_t bytes_read;   /* CACHE mode: bytes read from the files during the step (by any thread,
                              prefetches for later steps included) */
    double io_seconds;     /* CACHE mode: time the step's threads spent reading or waiting for a
                              read (stalled on I/O) */
    uint64_t dense_reads;  /* CACHE mode: streamed layers whose dense matrices were read from disk */
    uint64_t prefetch_issued;  /* CACHE mode: expert reads queued for the I/O thread */
    uint64_t prefetch_predicted, prefetch_routed; /* routed experts that had been predicted /
                                                     all routed experts (recall = ratio) */
    double seconds;        /* wall time of the step */
    double io_busy_seconds; /* CACHE mode: wall time of the step with at least one read from the
                               files in flight (by any thread): bytes_read over it is the rate the
                               reads got, seconds less it the time the disk had nothing to do */
} moe_step_stats;

/* Runs the tokens of n_seqs sequences through the model in one batched forward pass: a prefill
 * chunk of one sequence, one token from each of many sequences, or any mix. Each session may
 * appear once. On error no session has advanced unless the error is MOE_ERR_IO/NOMEM during the
 * forward pass, in which case the sessions involved are reset (their state is undefined), or
 * MOE_ERR_NUMERIC: every session has advanced, and the sequences whose logits hold a NaN or an
 * infinity (a non-finite weight or activation) have nonfinite set; the others' logits are good.
 * stats may be NULL. */
MOE_API moe_status moe_step(moe_model *m, moe_seq *seqs, int n_seqs, moe_step_stats *stats,
                            char *err, size_t errlen);

/* ---- tokenizer (docs/spec/TOKENIZER.md) ------------------------------------------------------
 * tiktoken's rank BPE: a rank file ("base64-bytes rank" per line; a token's id is its rank),
 * special tokens after the ranks, and a pre-tokenizer that cuts text into pieces first. Kimi's
 * pre-tokenizer adds Han runs and the vendor's 400,000 / 25,000 chunking; o200k_base and
 * cl100k_base are OpenAI's (for testing against their public rank files). Text is UTF-8. */

typedef struct moe_tokenizer moe_tokenizer;
typedef enum { MOE_PRETOK_KIMI = 0, MOE_PRETOK_O200K, MOE_PRETOK_CL100K } moe_pretok;

/* Loads a rank file. Kimi: n_special ids follow the ranks (0: 256 when tokenizer_config.json
 * names "<|open|>", i.e. K3, else 258 as Kimi-Linear/K2 do), named from the config's
 * added_tokens_decoder (config_path may be NULL) or "<|reserved_token_ID|>". o200k/cl100k:
 * OpenAI's specials (<|endoftext|>, ...); config_path and n_special are ignored. */
MOE_API moe_status moe_tokenizer_load(moe_tokenizer **out, const char *ranks_path, int pretok,
                                      const char *config_path, int n_special, char *err,
                                      size_t errlen);
/* The tokenizer a model ships: tiktoken.model + tokenizer_config.json beside its config.json,
 * or the vocabulary inside its GGUF (tokenizer.ggml.tokens, rank = id, merges ignored). Ids at
 * or past the model's vocab_size are then refused by moe_tokenize and moe_detokenize. */
MOE_API moe_status moe_tokenizer_for_model(moe_tokenizer **out, const moe_model *m, char *err,
                                           size_t errlen);
/* The vocabulary of a GGUF file alone: a model's, or a vocabulary-only file (llama.cpp's
 * convert_hf_to_gguf.py --vocab-only). It must be a byte-level BPE ("gpt2") vocabulary with
 * Kimi's pre-tokenizer ("kimi-k2"); ids at or past the file's ARCH.vocab_size, when it has
 * one, are refused. */
MOE_API moe_status moe_tokenizer_from_gguf(moe_tokenizer **out, const char *path, char *err,
                                           size_t errlen);
MOE_API void moe_tokenizer_free(moe_tokenizer *t);

enum {
    MOE_TOK_SPECIAL = 1u << 0,  /* special-token names in the text become their ids (otherwise
                                   they are ordinary text) */
    MOE_TOK_RAW_BYTES = 1u << 1 /* accept bytes that are not valid UTF-8 (each one a symbol of
                                   its own), so any byte string round-trips; otherwise invalid
                                   UTF-8 is MOE_ERR_ARG */
};
/* Encodes text[0..len) into ids[0..cap). *n_ids gets the number of ids; when that exceeds cap
 * the first cap are written and MOE_ERR_RANGE returned. cap = len is always enough. */
MOE_API moe_status moe_tokenize(const moe_tokenizer *t, const char *text, size_t len,
                                unsigned flags, int32_t *ids, size_t cap, size_t *n_ids,
                                char *err, size_t errlen);
/* The bytes of one id (a special's name for specials), not NUL-terminated for mergeable
 * tokens; NULL for an id that has none. Valid until moe_tokenizer_free. */
MOE_API const char *moe_token_bytes(const moe_tokenizer *t, int32_t id, size_t *len);
/* Concatenated bytes of ids into buf[0..cap); *len = bytes needed (MOE_ERR_RANGE if > cap). */
MOE_API moe_status moe_detokenize(const moe_tokenizer *t, const int32_t *ids, size_t n,
                                  char *buf, size_t cap, size_t *len, char *err, size_t errlen);
/* The id of a special token by name, or -1. */
MOE_API int32_t moe_token_id(const moe_tokenizer *t, const char *name);
/* 1 when id ends generation: the model's eos_token_id (m may be NULL), or one of the
 * vocabulary's end markers (t may be NULL): "[EOS]" (the base models' end of text),
 * "<|im_end|>" (the end of a K2-format turn), "<|end_of_msg|>" (the end of a K3 message).
 * llama.cpp's llama_vocab_is_eog. */
MOE_API int moe_token_is_eog(const moe_model *m, const moe_tokenizer *t, int32_t id);
MOE_API int moe_token_is_special(const moe_tokenizer *t, int32_t id);
/* One past the largest id. */
MOE_API int32_t moe_tokenizer_n_ids(const moe_tokenizer *t);
/* Length of the longest prefix of s[0..n) that is whole, valid UTF-8 (for streaming output:
 * hold back the rest until the next token completes it). */
MOE_API size_t moe_utf8_valid_prefix(const char *s, size_t n);
/* Streaming output: how many bytes of buf[0..n) (text generated and not yet shown) can be shown
 * now. A stop string ends the text before it (*stopped set); a tail that may be the beginning of a
 * stop string, or of a UTF-8 character, waits for more; final: no more text will come. */
MOE_API size_t moe_text_ready(const char *buf, size_t n, const char *const *stops, int n_stops,
                              int final, int *stopped);

/* ---- chat formats (docs/spec/TOKENIZER.md section 5) ---------------------------------------
 * An OpenAI-style request, {"messages": [...], "tools": [...], "tool_choice": ...,
 * "response_format": ...} (or a bare messages list), rendered as the vendor templates do:
 * Kimi-Linear/K2 (<|im_user|>user<|im_middle|>...<|im_end|>) or K3's XTML (<|open|>message
 * role="user"<|sep|>...). Messages: role system/user/assistant/tool, content a string or a
 * list of text parts, optional name, assistant tool_calls and reasoning_content, tool
 * tool_call_id. Images are refused. */
enum { MOE_CHAT_AUTO = 0, MOE_CHAT_K2 = 1, MOE_CHAT_K3 = 2 };
typedef struct {
    int format;                  /* MOE_CHAT_*; AUTO: K3 when the vocabulary has <|open|> */
    int add_generation_prompt;   /* open the assistant's turn (default 1) */
    int thinking;                /* K3: the think channel (default 1) */
    const char *thinking_effort; /* K3: "low", "high" or "max" (NULL: "max", the vendor default) */
    int safe;                    /* K2: encode message texts with special names as plain text
                                    (the vendor turns "<|im_end|>" typed by a user into the
                                    control token; K3 never does) */
} moe_chat_options;
MOE_API moe_chat_options moe_chat_default_options(void);
/* MOE_CHAT_K3 or MOE_CHAT_K2 from the vocabulary's markers, or -1 when it has neither. */
MOE_API int moe_chat_format_of(const moe_tokenizer *t);
/* The rendered prompt as text (NUL-terminated; *text_len excludes the NUL; MOE_ERR_RANGE when
 * cap is too small, with *text_len the length needed). */
MOE_API moe_status moe_chat_render(const moe_tokenizer *t, const char *request_json, size_t len,
                                   const moe_chat_options *opt, char *text, size_t cap,
                                   size_t *text_len, char *err, size_t errlen);
/* The prompt's ids: each segment encoded on its own (markers as specials, texts with specials
 * as plain text); K2 without safe: the rendered string encoded whole with specials allowed,
 * as transformers does. Same size contract as moe_tokenize. */
MOE_API moe_status moe_chat_encode(const moe_tokenizer *t, const char *request_json, size_t len,
                                   const moe_chat_options *opt, int32_t *ids, size_t cap,
                                   size_t *n_ids, char *err, size_t errlen);

/* Reading a reply as it is generated: each token's bytes belong to the answer (CONTENT), to
 * K3's think channel (REASONING), or to markup that is not shown (HIDDEN: XTML tags, special
 * tokens, tool-call sections); END is the end-of-turn token. Start with the options the prompt
 * was rendered with (thinking decides where a K3 reply starts). */
enum { MOE_REPLY_CONTENT = 0, MOE_REPLY_REASONING, MOE_REPLY_HIDDEN, MOE_REPLY_END };
typedef struct {
    int format, channel, in_tag, closing, ended;
    int32_t open, close, sep, tools, end[2];
    char tag[64];
    size_t tag_len;
} moe_chat_reply;
MOE_API void moe_chat_reply_init(moe_chat_reply *r, const moe_tokenizer *t, const moe_chat_options *opt);
MOE_API int moe_chat_reply_token(moe_chat_reply *r, const moe_tokenizer *t, int32_t id);
/* The tool calls in a finished reply (its generated ids), as the JSON text of an OpenAI
 * "tool_calls" array: [{"id", "type": "function", "function": {"name", "arguments"}}], "[]" when
 * there are none. K3: call/argument elements, arguments typed as written (strings quoted, other
 * values as the JSON text the model wrote), ids "call_1", "call_2", ...; K2: the tool-call section,
 * the name taken from "functions.NAME:K". NUL-terminated; MOE_ERR_RANGE when cap is too small. */
MOE_API moe_status moe_chat_tool_calls(const moe_tokenizer *t, const int32_t *ids, size_t n,
                                       const moe_chat_options *opt, char *json, size_t cap,
                                       size_t *len, char *err, size_t errlen);

/* ---- sampling --------------------------------------------------------------------------- */

typedef struct {
    float temperature; /* <= 0: greedy */
    int top_k;         /* <= 0: off */
    float top_p;       /* >= 1: off */
    float min_p;       /* <= 0: off */
    /* penalties on the tokens of recent[0..n_recent) (the caller's window, e.g. the last 64),
     * applied before everything else, greedy included: */
    float repeat_penalty;    /* 0 or 1: off; p > 1: logit / p if positive, logit * p if not */
    float presence_penalty;  /* subtracted once from each token present */
    float frequency_penalty; /* subtracted once per occurrence */
    const int32_t *recent;   /* may be NULL; ids outside [0, n_vocab) are ignored */
    int n_recent;
} moe_sampler;

/* Picks a token from logits[n_vocab] (not modified). *rng is the caller's generator state (any
 * seed != 0 works; 0 is replaced by a fixed constant); it advances. Deterministic for a given
 * state. Temperature <= 0 (or sp or rng NULL) is greedy. The draw walks the candidates by logit,
 * highest first, where top-k or top-p cuts them by rank or mass, and in id order otherwise (the
 * same distribution, without sorting the vocabulary). Returns -1 only for bad arguments. */
MOE_API int32_t moe_sample(const float *logits, int n_vocab, const moe_sampler *sp,
                           uint64_t *rng);

#ifdef __cplusplus
}
#endif

/* ---- internal: shared by moe.c, quant.c and test/ only; not part of the API ------------- */
#ifdef MOE_INTERNAL
#include <stdbool.h>

#ifndef MOE_ASSERT
#include <assert.h>
#define MOE_ASSERT(x) assert(x) /* our own invariants only, never input validation */
#endif

/* ---- internal: number formats and block layouts (quant.c) ------------------------------ */
enum {
    MOE_T_F32 = 0, MOE_T_F16, MOE_T_BF16,
    MOE_T_MXFP4,      /* compressed-tensors: packed nibbles (low = even column) + separate E8M0 */
    MOE_T_MXFP4_GGML, /* ggml block_mxfp4: {E8M0 e; qs[16]}, low nibbles = values 0..15 */
    MOE_T_Q8_0, MOE_T_Q4_0, MOE_T_U8, MOE_T_I32,
    MOE_T_Q8_0X8, MOE_T_Q4_0X8, /* 8 rows interleaved at load (never in files): see moe__repack_x8 */
    MOE_T_MXFP4X8,              /* MXFP4 (either layout) interleaved so, under MOE_FLAG_MXFP4_INT8 */
    /* more ggml block formats, read from files (llama-quantize's mixes: Q4_K_M is Q4_K + Q6_K,
     * with Q5_0 where a row is not whole 256-value blocks) and multiplied as they are stored */
    MOE_T_Q4_1, MOE_T_Q5_0, MOE_T_Q5_1, MOE_T_Q4_K, MOE_T_Q5_K, MOE_T_Q6_K,
    MOE_T_Q4_KX8, MOE_T_Q5_KX8, /* Q4_K, Q5_K interleaved 8 rows at a time at load, where the level has the kernels */
    /* the low-bit mixes (Q2_K, Q3_K_S/M/L, IQ4_XS; IQ4_NL where a row is not whole 256s) */
    MOE_T_Q2_K, MOE_T_Q3_K, MOE_T_IQ4_NL, MOE_T_IQ4_XS,
    MOE_T_IQ4_XSX8, MOE_T_Q2_KX8, MOE_T_Q3_KX8, /* IQ4_XS, Q2_K, Q3_K interleaved so, where the level has the kernels */
    MOE_T_Q6_KX8, /* Q6_K likewise (the LM head of every k-quant mix) */
    /* the grid-codebook formats (llama-quantize's IQ1_S .. IQ3_M mixes, the smallest files of the
     * largest models), multiplied as stored */
    MOE_T_IQ2_XXS, MOE_T_IQ2_XS, MOE_T_IQ2_S, MOE_T_IQ3_XXS, MOE_T_IQ3_S, MOE_T_IQ1_S, MOE_T_IQ1_M,
    MOE_T_COUNT
};

/* ggml block layouts (bit-compatible): 32 values per block, scale d as IEEE half.
 * Q8_0: x = d * qs[i]. Q4_0: x = d * (q - 8), q = qs[i] & 15 for i < 16, qs[i-16] >> 4 after. */
typedef struct { uint16_t d; int8_t qs[32]; } moe__block_q8_0;
typedef struct { uint16_t d; uint8_t qs[16]; } moe__block_q4_0;
/* Q4_1: x = d q + m, q as Q4_0's. Q5_0: x = d (q - 16) and Q5_1: x = d q + m, q's low 4 bits as
 * Q4_0's, bit 4 of value j in bit j of qh (little-endian 32 bits). */
typedef struct { uint16_t d, m; uint8_t qs[16]; } moe__block_q4_1;
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; } moe__block_q5_0;
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; } moe__block_q5_1;
/* k-quants: 256 values a block. Q4_K/Q5_K: 8 sub-blocks of 32, x = d sc_j q - dmin m_j with 6-bit
 * sc_j, m_j packed in scales[12]; the values of sub-blocks 2c and 2c+1 in the low and high
 * nibbles of qs[32c .. 32c+31], Q5_K's bit 4 of value l of sub-block j in bit j of qh[l]. Q6_K:
 * x = d sc_i (q - 32), a signed 8-bit sc_i per 16 values, q's low 4 bits in ql, high 2 in qh
 * (per 128 values: 64 ql bytes, 32 qh bytes; see moe__row_to_f32). */
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } moe__block_q4_k;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } moe__block_q5_k;
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } moe__block_q6_k;
/* Q2_K: x = d sc_i q - dmin m_i per 16 values (4-bit sc_i low, m_i high nibble of scales[i]), q
 * 2 bits. Q3_K: x = d (sc_i - 32) (q - 4) per 16, 6-bit sc_i packed in scales[12], q's low 2 bits
 * in qs, bit 2 of value v in bit v / 32 of hmask[v % 32]. Both: value v's 2 bits at bit
 * 2 ((v % 128) / 32) of qs[32 (v / 128) + v % 32]. IQ4_NL: x = d k[q], k = moe__iq4nl_values,
 * nibbles as Q4_0's. IQ4_XS: x = d (ls_j - 32) k[q] per 32 values, 6-bit ls_j: low 4 bits in
 * scales_l (nibble j % 2 of byte j / 2), high 2 at bit 2j of scales_h; nibbles per 32 as Q4_0's. */
typedef struct { uint8_t scales[16]; uint8_t qs[64]; uint16_t d, dmin; } moe__block_q2_k;
typedef struct { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; uint16_t d; } moe__block_q3_k;
typedef struct { uint16_t d; uint8_t qs[16]; } moe__block_iq4_nl;
typedef struct { uint16_t d, scales_h; uint8_t scales_l[4]; uint8_t qs[128]; } moe__block_iq4_xs;
/* The grid-codebook formats: 256 values a block, each 8 (IQ3: 4) values one entry of a fixed
 * table of byte vectors (ggml's iq2xxs_grid .. iq1s_grid), x = d sc q with a sign per value
 * (IQ2, IQ3) or a shift of +-1/8 per 8 or 32 values (IQ1). Per 32 values j: IQ2_XXS: 4 grid
 * bytes, then a word of four 7-bit sign indices (the 8th sign is their parity) and the scale
 * (top 4 bits), x = d (ls + 1/2) / 4 g. IQ2_XS: 4 words of a 9-bit grid index and a 7-bit sign
 * index; a nibble scale per 16 values. IQ2_S: qs holds 32 bytes of 8-bit grid indices (2 more
 * bits each in qh[j]), then 32 sign bytes; nibble scales. IQ3_XXS: qs holds 64 one-byte indices
 * (8 per 32 values) into a table of 4-byte entries, then a word per 32 as IQ2_XXS's second,
 * x = d (ls + 1/2) / 2 g. IQ3_S: 9-bit indices (bit 8 in qh[j]), sign bytes, x = d (1 + 2 s) g
 * with s a nibble per 32. IQ1_S: 11-bit indices of entries in {-1, 0, 1} (3 high bits per index
 * in qh[j]), x = d (2 s + 1) (g +- 1/8), s and the shift's sign in qh[j]'s top 4 bits. IQ1_M: the same entries, 3-bit scales per 16, the shift's
 * sign per 8, the half-precision d spread over the scales' top nibbles. See quant.c, iq_sub. */
typedef struct { uint16_t d; uint16_t qs[32]; } moe__block_iq2_xxs;
typedef struct { uint16_t d; uint16_t qs[32]; uint8_t scales[8]; } moe__block_iq2_xs;
typedef struct { uint16_t d; uint8_t qs[64]; uint8_t qh[8]; uint8_t scales[8]; } moe__block_iq2_s;
typedef struct { uint16_t d; uint8_t qs[96]; } moe__block_iq3_xxs;
typedef struct { uint16_t d; uint8_t qs[64]; uint8_t qh[8]; uint8_t signs[32]; uint8_t scales[4]; } moe__block_iq3_s;
typedef struct { uint16_t d; uint8_t qs[32]; uint16_t qh[8]; } moe__block_iq1_s;
typedef struct { uint8_t qs[32]; uint8_t qh[16]; uint8_t scales[8]; } moe__block_iq1_m;
extern const int8_t moe__iq4nl_values[16];
/* activations quantized for the integer kernels: f32 scale, the sum of the 32 int8 values (lets
 * Q4_0 kernels multiply unsigned nibbles and subtract 8 * sum once per block), the values */
typedef struct { float d; int32_t sum; int8_t qs[32]; } moe__block_q8a;
typedef struct { uint8_t e; uint8_t qs[16]; } moe__block_mxfp4;
/* One 32-column block of 8 rows, laid out so one broadcast of 4 activation bytes meets 4 values
 * of each of the 8 rows in a 32-bit lane (dpbusd / maddubs): chunk c (columns 4c..4c+3) holds
 * [row][4] bytes. Q4_0x8 packs chunk c in the low nibbles and chunk c+4 in the high nibbles of
 * the same 32 bytes; Q8_0x8 stores values + 128 as unsigned bytes (the kernels subtract
 * 128 * sum(x), as Q4_0's subtract 8 * sum(x)). */
typedef struct { uint16_t d[8]; uint8_t qs[128]; } moe__block_q4_0x8;
typedef struct { uint16_t d[8]; uint8_t qs[256]; } moe__block_q8_0x8;
/* MXFP4x8: the 8 rows' E8M0 scales, then their E2M1 codes in Q4_0x8's nibble order (the kernels
 * decode a code c to 2 E2M1(c) + 12, unsigned, and subtract 12 * sum(x)); 136 bytes, as 8 ggml
 * MXFP4 blocks, so a group of 8 ggml rows is repacked in place */
typedef struct { uint8_t e[8]; uint8_t qs[128]; } moe__block_mxfp4x8;
/* Q4_KX8: 8 Q4_K rows' blocks of 256 values: their scales and minimum scales, the 6-bit
 * sub-block scales and minimums unpacked to bytes [sub-block][row], then for each pair p of
 * sub-blocks (2p in the low nibbles, 2p + 1 in the high, as Q4_K stores them) 8 chunks c of
 * [row][4 values 4c..4c+3]: 1184 bytes against 8 x 144 */
typedef struct { uint16_t d[8], dmin[8]; uint8_t sc[8][8], m[8][8]; uint8_t qs[1024]; } moe__block_q4_kx8;
/* Q5_KX8: Q4_KX8's fields, then the fifth bits: chunk c's 32 bytes [row][4] are the rows' qh
 * bytes 4c..4c+3 (bit j: sub-block j's value), 1440 bytes against 8 x 176 */
typedef struct { uint16_t d[8], dmin[8]; uint8_t sc[8][8], m[8][8]; uint8_t qs[1024]; uint8_t qh[256]; } moe__block_q5_kx8;
/* IQ4_XSX8: 8 IQ4_XS rows' blocks: their scales, the sub-block scales ls - 32 [sub-block][row],
 * then Q4_KX8's nibble layout (pair p of sub-blocks: 2p low, 2p + 1 high nibbles, 8 chunks c of
 * [row][indices of values 4c..4c+3]): 1104 bytes against 8 x 136 */
typedef struct { uint16_t d[8]; int8_t sc[8][8]; uint8_t qs[1024]; } moe__block_iq4_xsx8;
/* Q2_KX8, Q3_KX8: 8 rows' blocks: their scales (Q2_K's minimum scales), the 16 groups' scale
 * bytes [group][row] (Q2_K's as stored: scale low, minimum high nibble; Q3_K's unpacked to
 * ls - 32), then for each half n of the values 8 chunks c of [row][4]: the rows' qs bytes
 * 32n + 4c .. + 3, which hold values 4c..4c+3 of sub-blocks 4n..4n+3 at bits 0, 2, 4, 6; Q3_K's
 * hmask bytes 4c..4c+3 likewise (bit j: sub-block j). 672 bytes as 8 x 84; 912 against 8 x 110 */
typedef struct { uint16_t d[8], dmin[8]; uint8_t sc[16][8]; uint8_t qs[512]; } moe__block_q2_kx8;
typedef struct { uint16_t d[8]; int8_t sc[16][8]; uint8_t qs[512]; uint8_t hm[256]; } moe__block_q3_kx8;
/* Q6_KX8: 8 Q6_K rows' blocks: their scales, the 16 groups' scales [group][row], then for each
 * half n of the values 16 chunks c of [row][4]: the rows' ql bytes 64n + 4c .. + 3 (c < 8: values
 * 4c..4c+3 of sub-blocks 4n and 4n + 2 in the low and high nibbles; c >= 8: of 4n + 1 and 4n + 3),
 * and 8 chunks c of the rows' qh bytes 32n + 4c .. + 3 (sub-block 4n + k's high 2 bits at bit
 * 2k): the same 1680 bytes as 8 x 210 */
typedef struct { uint16_t d[8]; int8_t sc[16][8]; uint8_t ql[1024]; uint8_t qh[512]; } moe__block_q6_kx8;
/* Interleaves 8 consecutive rows (row stride row_bytes) of a Q4_0/Q8_0/MXFP4/Q4_K matrix with cols
 * columns into cols/32 x8 blocks at dst; scales8: a compressed-tensors MXFP4 matrix's E8M0 scales
 * of the 8 rows (cols/32 bytes a row), NULL for the other types. */
void moe__repack_x8(int type, const void *rows8, int64_t row_bytes, const uint8_t *scales8, void *dst, int64_t cols);
int moe__x8_of(int type); /* the interleaved type of Q4_0, Q8_0, an MXFP4 layout, Q4_K or Q5_K, else -1 */
int moe__is_quant(int type); /* a ggml integer block format: activations go through moe__block_q8a */
int moe__is_iq(int type);    /* one of the grid-codebook formats, IQ1_S .. IQ3_S */
int moe__block_values(int type); /* values per block of a type: 1, 32 or 256 */

/* A weight matrix [rows, cols] (PyTorch [out, in]) in its stored format. MXFP4 rows are cols/2
 * packed bytes plus cols/32 E8M0 scale bytes in a separate array. */
typedef struct {
    int type;
    int64_t rows, cols;
    const void *data;
    const uint8_t *scale; /* MXFP4 only */
} moe__weight;

/* ---- internal: the kernel table (quant.c's kernel levels, chosen by moe__kernels_init) --- */

struct moe__kda_head_s;
struct moe__mla_block_s;
struct moe__mla_block16_s;
struct moe__mla_block8_s;
struct moe__kv8_meta_s;
typedef float (*moe__dot_fn)(const void *w, const uint8_t *scale, const float *x, int64_t n);
/* y[t * ldy + i] = (row i of w) . x_t for nr rows of a float-format weight matrix (ldw elements
 * apart) and nt activation rows (ldx floats apart), K values each */
typedef void (*moe__gemm_fn)(const void *w, int64_t ldw, int nr, const float *x, int64_t ldx, int nt, int64_t K, float *y, int64_t ldy);
/* weight row . quantized activation row (n a multiple of 32) */
typedef float (*moe__dotq_fn)(const void *w, const moe__block_q8a *x, int64_t n);
typedef void (*moe__quant_fn)(const float *x, moe__block_q8a *out, int64_t n);
/* 8 interleaved rows (one x8 row group) . one q8a row -> out[8] */
typedef void (*moe__dotq8_fn)(const void *w, const moe__block_q8a *x, int64_t n, float *out);

typedef struct {
    moe__dot_fn dot[MOE_T_COUNT];   /* weight row . f32 vector, per float weight type */
    /* four weight rows (rb bytes apart; MXFP4's scales n / 32 bytes apart) . one f32 row ->
     * out[4], each bit for bit the level's dot (MXFP4 in both layouts; NULL where a level has none) */
    void (*dot4[MOE_T_COUNT])(const void *w, int64_t rb, const uint8_t *scale, const float *x, int64_t n, float *out);
    moe__gemm_fn gemm[MOE_T_COUNT]; /* F32 and BF16 weights times a batch of rows (moe__gemm_ref) */
    moe__dotq_fn dotq[MOE_T_COUNT]; /* weight row . q8a row, per integer weight type (and MXFP4_GGML) */
    /* one weight row . 4 q8a rows (x + t * xs blocks) -> out[t], each bit for bit the level's
     * dotq (prefill over the formats without an interleaved form; NULL where a level has none) */
    void (*dotq4[MOE_T_COUNT])(const void *w, const moe__block_q8a *x, int64_t xs, int64_t n, float *out);
    /* compressed-tensors MXFP4 row (scales apart) . q8a row: see moe__dotq_mxfp4_ref */
    float (*dotq_mxfp4)(const void *w, const uint8_t *scale, const moe__block_q8a *x, int64_t n);
    moe__quant_fn quant_q8a;        /* f32 row -> q8a blocks */
    moe__dotq8_fn dotq8[MOE_T_COUNT]; /* x8 row group . q8a row, for Q4_0X8 / Q8_0X8 / MXFP4X8 */
    moe__dotq8_fn dotq8x2[MOE_T_COUNT]; /* two adjacent x8 groups (16 rows) . q8a row -> out[16], each dotq8's bit for bit */
    /* x8 row group . 4 q8a rows (x + t * xs blocks) -> out[t * 8 + i], each row bit for bit the
     * level's dotq8 (prefill; NULL where a level has none) */
    void (*dotq8x4[MOE_T_COUNT])(const void *w, const moe__block_q8a *x, int64_t xs, int64_t n, float *out);
    /* the same for two adjacent groups (16 rows) -> out[t * 16 + i] (NULL where a level has none) */
    void (*dotq8x4x2[MOE_T_COUNT])(const void *w, const moe__block_q8a *x, int64_t xs, int64_t n, float *out);
    /* the same for nt activation rows (a multiple of 16) -> y[t * ldy + i], each bit for bit the
     * level's dotq8 (the AMX level's Q4_0X8 / Q8_0X8 / MXFP4X8; NULL elsewhere) */
    void (*dotq8x16x2[MOE_T_COUNT])(const void *w, const moe__block_q8a *x, int64_t xs, int64_t n, int nt, float *y, int64_t ldy);
    void (*axpy)(float *y, float a, const float *x, int64_t n); /* y += a x */
    void (*kda_recurrent)(const struct moe__kda_head_s *a);    /* see moe__kda_recurrent */
    void (*mla_scores)(const struct moe__mla_block_s *b);      /* see moe__mla_scores_ref */
    void (*mla_ctx)(const struct moe__mla_block_s *b, int h0, int h1);
    void (*mla_scores16)(const struct moe__mla_block16_s *b);  /* see moe__mla_scores16_ref */
    void (*mla_ctx16)(const struct moe__mla_block16_s *b, int h0, int h1);
    void (*mla_scores8)(const struct moe__mla_block8_s *b);   /* see moe__mla_scores8_ref */
    void (*mla_ctx8)(const struct moe__mla_block8_s *b, int h0, int h1);
    /* see moe__mla_weights8 (the same bytes and scales at every level) */
    void (*quant8_row)(const float *x, int n, int8_t *q, float *d, int32_t *sum); /* see moe__quant8_row */
    void (*mla_weights8)(const float *p, int ld, const struct moe__kv8_meta_s *meta, int jn, int h0, int h1, uint8_t *w, int lw, float *ws,
                         float *work);
    void (*act)(float *y, const float *x, int64_t n, int kind); /* see moe__act_ref */
    /* see moe__dwconv_ref */
    void (*dwconv)(float *y, const float *const *rows, const float *w, int64_t ldw, int taps, int64_t n);
    float (*exp_sum)(float *y, const float *x, float shift, int64_t n); /* see moe__exp_sum_ref */
    void (*widen_bf16)(float *y, const uint16_t *x, int64_t n); /* bf16 -> f32, exact */
    const char *isa;              /* "scalar", "avx2", ... */
    int dot8;                     /* 1: the int8 attention kernels multiply 4 byte pairs a lane in one
                                     instruction (dpbusd, SDOT): 4x an f32 FMA's multiply-adds */
} moe__kernels;

void moe__kernels_init(moe__kernels *k, unsigned flags);
/* k = this CPU's level named name (NULL or "": as moe__kernels_init); -1 where it has none of
 * that name (k is then moe__kernels_init's choice), and the names it has in have[havelen] */
int moe__kernels_pick(moe__kernels *k, unsigned flags, const char *name, char *have, size_t havelen);
/* y = f(x) elementwise (y may be x): the logistic sigmoid, x sigmoid(x), softplus log(1 + e^x) */
enum { MOE__ACT_SIGMOID, MOE__ACT_SILU, MOE__ACT_SOFTPLUS };
void moe__act_ref(float *y, const float *x, int64_t n, int kind);
/* A depthwise convolution's taps over n channels: y[i] = sum over j < taps of w[j ldw + i]
 * rows[j][i], in the order of j (taps >= 1; the SIMD levels fuse the multiply-adds after the
 * first product). KDA's short convolution: rows the window's rows, w the weights [tap][channel]. */
void moe__dwconv_ref(float *y, const float *const *rows, const float *w, int64_t ldw, int taps, int64_t n);
/* y = e^(x - shift) (y may be x); returns the sum of y (a softmax's denominator) */
float moe__exp_sum_ref(float *y, const float *x, float shift, int64_t n);
void moe__widen_bf16_ref(float *y, const uint16_t *x, int64_t n);
float moe__bf16_to_f32(uint16_t h);
uint16_t moe__f32_to_bf16(float f);
float moe__f16_to_f32(uint16_t h);
uint16_t moe__f32_to_f16(float f);
/* Decodes n values of one row (MXFP4: scale = that row's scale bytes). */
void moe__row_to_f32(int type, const void *row, const uint8_t *scale, float *out, int64_t n);
/* Quantizes n values (whole blocks) to a ggml integer format: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 by
 * ggml's reference rounding; Q4_K, Q5_K, Q6_K by a search of our own for each sub-block's scale
 * (and minimum), in the spirit of ggml's, not bit for bit its output. */
void moe__quantize_row(int type, const float *x, void *out, int64_t n);
void moe__quantize_q8_0_ref(const float *x, void *out, int64_t n); /* the scalar reference of its Q8_0 */
float moe__dotq_ref(int type, const void *w, const moe__block_q8a *x, int64_t n);
float moe__dotq_mxfp4_ref(const void *w, const uint8_t *scale, const moe__block_q8a *x, int64_t n);
void moe__dotq8_ref(int type, const void *w, const moe__block_q8a *x, int64_t n, float *out);
void moe__quant_q8a_ref(const float *x, moe__block_q8a *out, int64_t n);
/* Bytes of one row of n values (MXFP4: packed bytes only). */
int64_t moe__row_bytes(int type, int64_t n);
extern const float moe__e2m1[16];
void moe__gemm_ref(int type, const void *w, int64_t ldw, int nr, const float *x, int64_t ldx, int nt, int64_t K, float *y, int64_t ldy);
float moe__dot_ref(int type, const void *w, const uint8_t *scale, const float *x, int64_t n);
/* Every kernel level this CPU can run (scalar first, the best last); returns how many were written.
 * x86: scalar, avx2, avxvnni, avx512, avx512vnni, amx (Linux); aarch64: scalar, neon, neon-dotprod. */
#define MOE_KERNEL_LEVELS_MAX 6
int moe__kernel_levels(moe__kernels *out, int max);
/* The level's 1-row x8 kernels with software prefetch of the weights into L1 (mode 1) or into L2
 * only (2), or without it (0), where the level has the three builds (AVX-512 VNNI); the levels
 * pick by CPU (quant.c) */
void moe__x8_prefetch(moe__kernels *k, int mode);

/* ---- internal: parsers (JSON, safetensors, GGUF; moe.c PART 1) ------------------------- */

/* JSON (config.json, safetensors headers, index): a tree in one allocation. */
enum { MOE_JSON_NULL, MOE_JSON_BOOL, MOE_JSON_NUM, MOE_JSON_STR, MOE_JSON_ARR, MOE_JSON_OBJ };
typedef struct moe__json moe__json;
struct moe__json {
    int type;
    int n;            /* children (array/object) */
    double num;       /* number; bool as 0/1 */
    const char *str;  /* string value (NUL-terminated, unescaped); a number's literal text */
    const char *key;  /* key when inside an object */
    moe__json *child; /* first child */
    moe__json *next;  /* next sibling */
};
moe_status moe__json_parse(const char *text, size_t len, moe__json **root, char *err,
                           size_t errlen);
void moe__json_free(moe__json *root);
const moe__json *moe__json_get(const moe__json *obj, const char *key);

/* A safetensors file mapped read-only (used by the loader and by tests for golden files). */
typedef struct {
    char name[256];
    int type; /* MOE_T_* */
    int ndim;
    int64_t shape[8];
    const void *data;
    uint64_t nbytes;
} moe__st_tensor;

/* GGUF metadata: scalars at data; arrays hold n elements of etype at data; strings (and string
 * array elements) are u64 length + bytes, as in the file. */
enum { MOE_GGUF_U8, MOE_GGUF_I8, MOE_GGUF_U16, MOE_GGUF_I16, MOE_GGUF_U32, MOE_GGUF_I32, MOE_GGUF_F32,
       MOE_GGUF_BOOL, MOE_GGUF_STRING, MOE_GGUF_ARRAY, MOE_GGUF_U64, MOE_GGUF_I64, MOE_GGUF_F64 };
typedef struct {
    const char *key; /* NUL-terminated copy */
    uint32_t type, etype;
    uint64_t n; /* array length, or string length */
    const uint8_t *data;
} moe__gguf_kv;

/* A mapped weight file: safetensors, or GGUF (is_gguf; tensor shapes are given in PyTorch order,
 * i.e. ggml's ne reversed, and kv holds the metadata). */
typedef struct {
    char *path;
    void *map;
    size_t size;
    moe__st_tensor *tensors;
    int n_tensors;
    int is_gguf;
    moe__gguf_kv *kv;
    int64_t n_kv;
    char *keys;
    uint32_t alignment;
    int borrowed; /* map points at caller memory (moe__weights_parse_mem): not unmapped */
} moe__st_file;

moe_status moe__st_open(moe__st_file *f, const char *path, char *err, size_t errlen);
/* Opens and validates a GGUF v2/v3 file (same struct, same close). */
moe_status moe__gguf_open(moe__st_file *f, const char *path, char *err, size_t errlen);
const moe__gguf_kv *moe__gguf_get(const moe__st_file *f, const char *key);
/* Our weight type of a ggml tensor type id, as the GGUF reader maps it; -1 for types it only
 * sizes or does not know */
int moe__type_of_ggml(uint32_t id);
/* Parses a safetensors (gguf = 0) or GGUF (gguf = 1) image in memory; the bytes stay the
 * caller's and must outlive f. For fuzzing and tests. */
moe_status moe__weights_parse_mem(moe__st_file *f, const void *data, size_t size, int gguf, char *err, size_t errlen);
/* ---- internal: hooks for tests and the example programs (moe.c) ------------------------- */

/* Test hook: moe_plan_make's choices for an open model m (opened as the plan peeks: mapped,
 * nothing converted) on the machine plan->mem_bytes, cpus and cores describe (the caller sets
 * them; mem_from names them); the disk is probed only where the cache mode needs I/O threads. */
moe_status moe__plan_choose(moe_plan *plan, const moe_model *m, const moe_options *given, char *err, size_t errlen);

/* Test hook: how many 2 MB blocks of the file fd (size bytes) lie wholly inside its data, which
 * is where the plan's disk probe reads (a sparse file's holes never reach the disk). */
size_t moe__data_blocks(int fd, long long size);
/* Test hook (fault injection): the n-th expert load from now on fails as with EIO (n >= 1;
 * 0 disables). CACHE mode only. */
void moe__fail_expert_read(moe_model *m, int n);
/* Test hooks, CACHE mode: the I/O threads take nothing from their queue while held (a step then
 * reads what it needs itself); the queued reads, up to max of them (layer, unit: an expert, or the
 * layer's dense matrices as unit n_experts; demand: the layer computing asked for it, else a
 * guess), and how many there are. */
void moe__cache_hold(moe_model *m, int hold);
int moe__cache_queued(const moe_model *m, int *layer, int *unit, int *demand, int max);
/* CACHE mode: units of at least `bytes` are read with O_DIRECT where the file allows (tests: the
 * aligned piece-by-piece reads of small models) */
void moe__set_direct_min(moe_model *m, size_t bytes);
/* Test hook: y[i] = x W[i]^T for n (<= 8) matrices with x's cols, x [T, cols], through the
 * runtime's parallel product on nt threads (the kernels flags selects: 0 or MOE_FLAG_FORCE_SCALAR). */
moe_status moe__matmul(const moe__weight *const *W, float *const *y, int n, const float *x, int T, int nt, unsigned flags);
/* Test hook: keys per block of the expanded MLA form (0: sized by memory, the default). */
void moe__set_mla_key_block(moe_model *m, int keys);
/* Test hook: whether a step's parallel loops run on one team of threads for the whole step: 0
 * when the threads fit the processors (the default), 1 never (each loop an OpenMP region of its
 * own), 2 always. */
void moe__set_step_team(moe_model *m, int mode);
/* CACHE mode: bytes read from the files since open, by every thread. */
uint64_t moe__expert_bytes_read(const moe_model *m);
/* CACHE mode: bytes the expert cache holds now, and the most it ever held. */
void moe__expert_cache_usage(const moe_model *m, size_t *now, size_t *peak);
/* CACHE mode: k-quant and IQ4_XS expert matrices interleaved as they were read, since open. */
uint64_t moe__expert_kx8_count(const moe_model *m);
/* The expert cache's eviction policy (moe.c, section "expert cache"), shared with moe-cachesim:
 * for every unit (layer, expert) a use count decayed by half every half_life routing steps of its
 * layer. new: NULL on bad sizes or no memory; free accepts NULL. route: layer's routing step
 * chose the units u < n with routed[u] set. score: the decayed count now (evicted lowest first).
 * evicts_before: whether the unit (score_a, last used at last_a) goes before (score_b, last_b). */
#define MOE_HISTORY_HALF_LIFE 16.0 /* routing steps: moe-cachesim's best on the shipped model's traces */
typedef struct moe__expert_history moe__expert_history;
moe__expert_history *moe__history_new(int n_layers, int units, double half_life);
void moe__history_free(moe__expert_history *h);
void moe__history_route(moe__expert_history *h, int layer, const unsigned char *routed, int n);
double moe__history_score(const moe__expert_history *h, int layer, int unit);
int moe__history_evicts_before(double score_a, uint64_t last_a, double score_b, uint64_t last_b);
/* Validates a config.json text as moe_model_open would. */
moe_status moe__config_check(const char *text, size_t len, char *err, size_t errlen);
/* The same, keeping the result: layer arrays go to kinds/moe ([4096] each). */
moe_status moe__config_parse(const char *text, size_t len, moe_config *out, unsigned char *kinds, unsigned char *moe, char *err,
                             size_t errlen);
/* GGUF name of an HF tensor name ("model.layers.3.self_attn.q_proj.weight" -> "blk.3.attn_q.weight");
 * 0 when it has none (routed experts are merged per layer: blk.N.ffn_{gate,up,down}_exps). With
 * llama_k3, the names of llama.cpp's Kimi-K3 support where they differ (KDA's ssm_g, the latent
 * MoE's ffn_routed_*); its fused AttnRes scores have no single HF source. */
int moe__hf_to_gguf(const char *hf, char *out, size_t n, int llama_k3);
/* A tensor of an open model's files by its full stored name; NULL if absent (for moe-convert). */
const moe__st_tensor *moe__model_tensor(const moe_model *m, const char *name);
/* The stored-name prefix of the text model ("language_model." for K3's wrapper, else ""). */
const char *moe__model_prefix(const moe_model *m);
void moe__st_close(moe__st_file *f);
/* moe_tokenizer_load on texts in memory (config_json may be NULL): for fuzzing and tests. */
moe_status moe__tokenizer_from_mem(moe_tokenizer **out, const char *ranks, size_t len, int pretok, const char *config_json, size_t clen,
                                   char *err, size_t errlen);
/* moe_chat_encode on an already parsed request (moe-batch: the body of a batch line). */
moe_status moe__chat_encode_tree(const moe_tokenizer *t, const moe__json *req, const moe_chat_options *opt, int32_t *ids, size_t cap,
                                 size_t *n_ids, char *err, size_t errlen);
/* The pre-tokenizer alone (no chunking, no specials) over valid UTF-8: the byte offset where
 * each piece ends goes to ends[0..cap); returns the number of pieces, -1 on bad input. */
long moe__pretokenize(int pretok, const char *text, size_t len, size_t *ends, size_t cap);
const moe__st_tensor *moe__st_find(const moe__st_file *f, const char *name);

/* ---- internal: the KDA and MLA cores (quant.c: scalar references and every level's kernels) -- */

/* The KDA core for one head over n tokens, state S[D,D] (rows = key channels) updated in place.
 * q,k,v,g: [n, stride] rows (head offset already applied), beta[n*beta_stride], o: [n, stride]. */
typedef struct moe__kda_head_s {
    int n, D, stride, beta_stride;
    const float *q, *k, *v, *g, *beta;
    float *o;
    float *S;
} moe__kda_head;
void moe__kda_recurrent(const moe__kda_head *a); /* the scalar reference */
/* Chunked form on 16-token chunks; bounded: gate known to be >= -5 (dense-matmul factorisation),
 * otherwise per-element decays. work: at least moe__kda_chunk_work(D) floats. Inner products
 * and updates go through k's dot/axpy kernels. */
void moe__kda_chunked(const moe__kda_head *a, int bounded, float *work, const moe__kernels *k);
size_t moe__kda_chunk_work(int D);

/* Absorbed MLA attention over one block of cached latents (rows of cw = r + d_r floats: the
 * normalised latent c, then the shared key slice kr), all heads:
 *   scores: sc[h][j] = (qa[h] . c_j + qr[h] . kr_j) * scale        for keys j0 .. j1-1
 *   ctx:    ctx[h] += sum_j p[h][j] c_j                              for heads h0 .. h1-1, all jn keys
 * qa: [H, r]; qr: row h at qr + h * qr_stride; sc / p: [H, ld] (p may alias sc); ctx: [H, r]. */
typedef struct moe__mla_block_s {
    int H, r, dr, cw, jn, j0, j1, ld, qr_stride;
    float scale;
    const float *qa, *qr, *cache; /* cache points at the block's first row */
    float *sc, *ctx;
} moe__mla_block;
void moe__mla_scores_ref(const moe__mla_block *b);
void moe__mla_ctx_ref(const moe__mla_block *b, int h0, int h1);

/* The same over a bf16 latent cache, with the queries and the softmax weights in bf16 too: every
 * product is of two bf16 values (exact in f32) and the sums are f32, as AVX512_BF16's dot product
 * instruction computes them; levels without it widen to f32 and use the f32 kernels.
 *   scores: sc[h][j] = (q[h] . c_j) * scale                           for keys j0 .. j1-1
 *   ctx:    ctx[h][i] += sum_j bf16(p[h][j]) c_j[i], i < r            for heads h0 .. h1-1, all jn keys
 * q: [H, cw] (per head its absorbed query, r values, then its kr query, d_r); p = sc: [H, ld];
 * ctx: [H, r]; work: moe__mla_work16(H, cw, ld) floats (for the levels that widen; one per thread). */
typedef struct moe__mla_block16_s {
    int H, r, cw, jn, j0, j1, ld;
    float scale;
    const uint16_t *q, *cache; /* cache points at the block's first row */
    float *sc, *ctx, *work;
} moe__mla_block16;
size_t moe__mla_work16(int H, int cw, int ld);
void moe__mla_scores16_ref(const moe__mla_block16 *b);
void moe__mla_ctx16_ref(const moe__mla_block16 *b, int h0, int h1);

/* The same over an int8 latent cache (MOE_KV_Q8). A row is cw signed bytes: c quantized with
 * scale dc, then kr with scale dr (moe__quant8_row on each part: values in [-127, 127], x ~ d q),
 * and per row this meta: */
typedef struct moe__kv8_meta_s { float dc, dr; int32_t sc, sr; } moe__kv8_meta; /* scales; sums of c's and kr's bytes */
/* x [n] -> q [n] with q = round(x * 127 / max |x|), *d = max |x| / 127, *sum = the sum of q */
void moe__quant8_row(const float *x, int n, int8_t *q, float *d, int32_t *sum);
/* The queries are quantized per head the same way (q: [H, cw], qd: [H, 2] the two parts' scales),
 * the softmax weights per head and block to unsigned bytes (moe__mla_weights8: w = round(p dc *
 * 255 / max), ws its scale); sums of products are exact in int32, so every level computes
 *   scores: sc[h][j] = ((float)(q_c[h] . c_j) * (qd[2h] * dc_j) + (float)(q_r[h] . kr_j) * (qd[2h+1] * dr_j)) * scale
 *           for keys j0 .. j1-1 (cache and meta point at the block's first key)
 *   ctx:    ctx[h][i] += ws[h] * (float)(sum_j w[h][j] c_j[i])   for heads h0 .. h1-1, all jn keys
 * with the same float steps. qt: the queries transposed by moe__mla_qt8 (16 heads x 4 values per
 * 64 bytes: the SIMD levels broadcast 4 bytes of a key against 16 heads, no horizontal sums).
 * w: [H, lw] (lw >= jn a multiple of 4, zeros after jn). */
typedef struct moe__mla_block8_s {
    int H, r, cw, jn, j0, j1, ld, lw;
    float scale;
    const int8_t *q, *qt;
    const float *qd;
    const int8_t *cache;
    const moe__kv8_meta *meta;
    float *sc, *ctx;
    const uint8_t *w;
    const float *ws;
} moe__mla_block8;
size_t moe__mla_qt8_bytes(int H, int cw);
void moe__mla_qt8(const int8_t *q, int H, int cw, int8_t *qt);
/* work: jn floats */
void moe__mla_weights8(const float *p, int ld, const moe__kv8_meta *meta, int jn, int h0, int h1, uint8_t *w, int lw, float *ws,
                       float *work);
void moe__mla_scores8_ref(const moe__mla_block8 *b);
void moe__mla_ctx8_ref(const moe__mla_block8 *b, int h0, int h1);

#endif /* MOE_INTERNAL */
#endif /* MOE_H */
