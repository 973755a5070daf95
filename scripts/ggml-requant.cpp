// ggml-requant: an F32 GGUF rewritten with its matrices quantized by ggml's own quantizers
// (lm_ggml_quantize_chunk, no importance matrix) and written by ggml's GGUF writer, in
// moe-convert's mix for --dense TYPE --experts TYPE: every matrix TYPE, the LM head HEAD, rows that
// are not whole blocks falling back as moe-convert (and llama-quantize) fall back; norms,
// convolutions, routers, biases and 1-D tensors stay F32. To set our quantizers against ggml's
// on the same model (bench/RESULTS.md, "2026-12-02: llama.cpp built and run here"). Built by scripts/llama-compare's Makefile
// (make -C build-llama ggml-requant) against llama.rn's copy of ggml (symbols lm_ggml_*).
//   ggml-requant IN.gguf OUT.gguf TYPE HEAD      (TYPE, HEAD: q2_k q3_k q4_k q5_k q6_k iq4_xs q4_0 q8_0)
#include "ggml.h"
#include "gguf.h"
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

static int parse(const char *s, lm_ggml_type *t) {
    static const struct { const char *name; lm_ggml_type type; } types[] = {
        {"q2_k", LM_GGML_TYPE_Q2_K}, {"q3_k", LM_GGML_TYPE_Q3_K}, {"q4_k", LM_GGML_TYPE_Q4_K}, {"q5_k", LM_GGML_TYPE_Q5_K},
        {"q6_k", LM_GGML_TYPE_Q6_K}, {"iq4_xs", LM_GGML_TYPE_IQ4_XS}, {"q4_0", LM_GGML_TYPE_Q4_0}, {"q8_0", LM_GGML_TYPE_Q8_0}};
    for (const auto &e : types)
        if (!strcmp(s, e.name)) return *t = e.type, 1;
    return 0;
}

// what moe-convert writes where a row is not whole blocks of t
static lm_ggml_type fallback(lm_ggml_type t) {
    switch (t) {
    case LM_GGML_TYPE_Q2_K: case LM_GGML_TYPE_Q3_K: case LM_GGML_TYPE_IQ4_XS: return LM_GGML_TYPE_IQ4_NL;
    case LM_GGML_TYPE_Q4_K: return LM_GGML_TYPE_Q5_0;
    case LM_GGML_TYPE_Q5_K: return LM_GGML_TYPE_Q5_1;
    default: return LM_GGML_TYPE_Q8_0;
    }
}

int main(int argc, char **argv) {
    lm_ggml_type type, head;
    if (argc != 5 || !parse(argv[3], &type) || !parse(argv[4], &head)) {
        fprintf(stderr, "usage: ggml-requant IN.gguf OUT.gguf TYPE HEAD\n");
        return 2;
    }
    lm_ggml_context *ctx = nullptr;
    lm_gguf_init_params ip = {false, &ctx};
    lm_gguf_context *in = lm_gguf_init_from_file(argv[1], ip);
    if (!in) { fprintf(stderr, "%s: ggml could not read it\n", argv[1]); return 1; }
    lm_gguf_context *out = lm_gguf_init_empty();
    lm_gguf_set_kv(out, in);
    // ggml's writer pads tensors to 32 bytes whatever general.alignment says: drop moe-convert's
    // 4096 so that the file says what it holds
    lm_gguf_remove_key(out, "general.alignment");
    std::vector<std::vector<char>> data;
    int quantized = 0;
    for (int64_t i = 0; i < lm_gguf_get_n_tensors(in); i++) {
        const char *name = lm_gguf_get_tensor_name(in, i);
        lm_ggml_tensor *t = lm_ggml_get_tensor(ctx, name);
        lm_gguf_add_tensor(out, t);
        const std::string n(name);
        const bool matrix = t->type == LM_GGML_TYPE_F32 && lm_ggml_n_dims(t) >= 2 && n.find("norm") == std::string::npos &&
                            n.find("conv1d") == std::string::npos && n.find("ffn_gate_inp") == std::string::npos &&
                            n.find("ssm_a") == std::string::npos && n.find(".bias") == std::string::npos;
        if (!matrix) continue;
        lm_ggml_type ty = n == "output.weight" ? head : type;
        if (t->ne[0] % lm_ggml_blck_size(ty)) ty = fallback(ty);
        if (t->ne[0] % lm_ggml_blck_size(ty)) continue; // stays F32, as moe-convert keeps such rows
        const int64_t rows = lm_ggml_nrows(t), cols = t->ne[0];
        data.emplace_back(lm_ggml_row_size(ty, cols) * rows);
        lm_ggml_quantize_chunk(ty, (const float *)t->data, data.back().data(), 0, rows, cols, nullptr);
        lm_gguf_set_tensor_type(out, name, ty);
        lm_gguf_set_tensor_data(out, name, data.back().data());
        quantized++;
    }
    if (!lm_gguf_write_to_file(out, argv[2], false)) { fprintf(stderr, "%s: write failed\n", argv[2]); return 1; }
    fprintf(stderr, "ggml-requant: %d of %lld tensors quantized\n", quantized, (long long)lm_gguf_get_n_tensors(out));
    return 0;
}
