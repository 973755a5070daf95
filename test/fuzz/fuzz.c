/* fuzz.c - libFuzzer entry points for the parsers that read untrusted files, one per build:
 * -DFUZZ_JSON, -DFUZZ_SAFETENSORS, -DFUZZ_GGUF, -DFUZZ_CONFIG. `make fuzz` builds them with
 * clang -fsanitize=fuzzer,address,undefined; test/fuzz/main.c is a plain driver that replays
 * files through the same entry point, so this builds without libFuzzer too. A crash, a sanitizer
 * report or a hang is a bug; any status code is an acceptable answer. */
#define MOE_INTERNAL
#include "../../moe.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char err[256];
#if defined(FUZZ_JSON)
    moe__json *j;
    if (moe__json_parse((const char *)data, size, &j, err, sizeof err) == MOE_OK) {
        (void)moe__json_get(j, "weight_map");
        moe__json_free(j);
    }
#elif defined(FUZZ_SAFETENSORS) || defined(FUZZ_GGUF)
#ifdef FUZZ_GGUF
    const int gguf = 1;
#else
    const int gguf = 0;
#endif
    /* a private copy: the parser may keep pointers into it until close */
    uint8_t *copy = malloc(size ? size : 1);
    if (!copy) return 0;
    memcpy(copy, data, size);
    moe__st_file f;
    if (moe__weights_parse_mem(&f, copy, size, gguf, err, sizeof err) == MOE_OK) {
        volatile uint8_t sink = 0;
        for (int i = 0; i < f.n_tensors; i++) /* every tensor it accepted must lie inside the image */
            if (f.tensors[i].nbytes) sink ^= ((const uint8_t *)f.tensors[i].data)[f.tensors[i].nbytes - 1];
        for (int64_t i = 0; i < f.n_kv; i++)
            if (f.kv[i].type == MOE_GGUF_STRING && f.kv[i].n) sink ^= f.kv[i].data[f.kv[i].n - 1];
        (void)sink;
        moe__st_close(&f);
    }
    free(copy);
#elif defined(FUZZ_CONFIG)
    (void)moe__config_check((const char *)data, size, err, sizeof err);
#else
#error "define one of FUZZ_JSON, FUZZ_SAFETENSORS, FUZZ_GGUF, FUZZ_CONFIG"
#endif
    return 0;
}
