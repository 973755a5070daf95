// Runs token ids through llama.cpp's CPU path, for scripts/llama-compare: the logits of every
// position (--all) or the last, written as float32 rows to OUT, then N greedy decode steps;
// prefill and decode timings and the bytes read from storage on stderr. Built against llama.h
// (llama.cpp's public API). --no-repack: no weight repacking (llama-cli's --no-repack), the
// weights used where they are mapped.
//   llama-compare-run MODEL.gguf IDS_FILE OUT.bin THREADS [N_DECODE] [--all] [--no-repack]
//   llama-compare-run --tokenize VOCAB.gguf TEXT_FILE
#include "llama.h"
#include "../examples/storage_reads.h"
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

static double secs(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
}

// --tokenize VOCAB.gguf TEXT_FILE: the ids of the file's bytes by llama.cpp's tokenizer (no
// specials), space-separated on one line; VOCAB.gguf is loaded vocab_only
static int tokenize(const char *vocab_path, const char *text_path) {
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    llama_model *model = llama_model_load_from_file(vocab_path, mp);
    if (!model) { fprintf(stderr, "%s: llama.cpp could not load it\n", vocab_path); return 1; }
    FILE *f = fopen(text_path, "rb");
    if (!f) { perror(text_path); return 1; }
    std::vector<char> text;
    char buf[65536];
    for (size_t r; (r = fread(buf, 1, sizeof buf, f)) > 0;) text.insert(text.end(), buf, buf + r);
    fclose(f);
    std::vector<llama_token> ids(text.size() + 16);
    const int n = llama_tokenize(llama_model_get_vocab(model), text.data(), (int32_t)text.size(), ids.data(), (int32_t)ids.size(), false, false);
    if (n < 0) { fprintf(stderr, "llama_tokenize failed\n"); return 1; }
    for (int i = 0; i < n; i++) printf("%d%c", ids[i], i + 1 == n ? '\n' : ' ');
    llama_model_free(model);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 4 && !strcmp(argv[1], "--tokenize")) return tokenize(argv[2], argv[3]);
    bool all = false, no_repack = false;
    int n_pos = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--all")) all = true;
        else if (!strcmp(argv[i], "--no-repack")) no_repack = true;
        else argv[++n_pos] = argv[i];
    }
    if (n_pos < 4) {
        fprintf(stderr, "usage: llama-compare-run MODEL.gguf IDS_FILE OUT.bin THREADS [N_DECODE] [--all] [--no-repack]\n");
        return 2;
    }
    const int threads = atoi(argv[4]), n_decode = n_pos > 4 ? atoi(argv[5]) : 0;
    std::vector<llama_token> ids;
    FILE *f = fopen(argv[2], "r");
    if (!f) { perror(argv[2]); return 1; }
    for (int v; fscanf(f, "%d", &v) == 1;) ids.push_back(v);
    fclose(f);
    if (ids.empty()) { fprintf(stderr, "%s: no token ids\n", argv[2]); return 1; }
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.use_extra_bufts = !no_repack;
    const auto tl = std::chrono::steady_clock::now();
    llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "%s: llama.cpp could not load it\n", argv[1]); return 1; }
    fprintf(stderr, "llama.cpp: loaded in %.3f s\n", secs(tl, std::chrono::steady_clock::now()));
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t)(ids.size() + n_decode + 16);
    cp.n_batch = (uint32_t)ids.size();
    cp.n_threads = cp.n_threads_batch = threads;
    llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "llama.cpp could not make a context\n"); return 1; }
    const int nv = llama_vocab_n_tokens(llama_model_get_vocab(model));
    llama_batch b = llama_batch_init((int32_t)ids.size(), 0, 1);
    for (size_t i = 0; i < ids.size(); i++) {
        b.token[i] = ids[i], b.pos[i] = (llama_pos)i, b.n_seq_id[i] = 1, b.seq_id[i][0] = 0;
        b.logits[i] = all || i + 1 == ids.size();
    }
    b.n_tokens = (int32_t)ids.size();
    const long long r0 = storage_read_bytes();
    const auto t0 = std::chrono::steady_clock::now();
    if (llama_decode(ctx, b)) { fprintf(stderr, "llama_decode failed\n"); return 1; }
    const auto t1 = std::chrono::steady_clock::now();
    FILE *o = fopen(argv[3], "wb");
    if (!o) { perror(argv[3]); return 1; }
    for (size_t i = all ? 0 : ids.size() - 1; i < ids.size(); i++) fwrite(llama_get_logits_ith(ctx, (int32_t)i), 4, (size_t)nv, o);
    if (fclose(o)) { perror(argv[3]); return 1; }
    const long long r1 = storage_read_bytes();
    fprintf(stderr, "llama.cpp: prefill %zu tokens %.3f s = %.2f tok/s, %lld bytes read from storage (%lld while loading)\n", ids.size(),
            secs(t0, t1), ids.size() / secs(t0, t1), r1 - r0, r0);
    if (n_decode > 0) {
        llama_token tok = 0;
        const auto t2 = std::chrono::steady_clock::now();
        for (int k = 0; k < n_decode; k++) {
            const float *lg = llama_get_logits_ith(ctx, -1);
            int best = 0;
            for (int j = 1; j < nv; j++) best = lg[j] > lg[best] ? j : best;
            tok = best;
            printf("%d%c", best, k + 1 == n_decode ? '\n' : ' ');
            llama_batch one = llama_batch_get_one(&tok, 1);
            if (llama_decode(ctx, one)) { fprintf(stderr, "llama_decode failed\n"); return 1; }
        }
        const auto t3 = std::chrono::steady_clock::now();
        fprintf(stderr, "llama.cpp: decode %d tokens %.3f s = %.2f tok/s, %lld bytes read from storage\n", n_decode, secs(t2, t3),
                n_decode / secs(t2, t3), storage_read_bytes() - r1);
    }
    llama_batch_free(b);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
