/* main.c - replays files through a fuzz target without libFuzzer:
 *   fuzz-TARGET FILE_OR_DIR...   runs every file (directories: every file inside, not recursive)
 * Prints how many inputs ran; a crash or sanitizer report is the failure signal. */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int run_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    size_t cap = 1 << 16, n = 0, r;
    uint8_t *b = malloc(cap);
    while (b && (r = fread(b + n, 1, cap - n, f)) > 0) {
        n += r;
        if (n == cap) {
            uint8_t *nb = realloc(b, cap *= 2);
            if (!nb) { free(b); b = NULL; }
            b = nb;
        }
    }
    fclose(f);
    if (!b) return 0;
    LLVMFuzzerTestOneInput(b, n);
    free(b);
    return 1;
}

int main(int argc, char **argv) {
    int runs = 0;
    for (int i = 1; i < argc; i++) {
        struct stat sb;
        if (stat(argv[i], &sb)) continue;
        if (!S_ISDIR(sb.st_mode)) { runs += run_file(argv[i]); continue; }
        DIR *d = opendir(argv[i]);
        struct dirent *e;
        while (d && (e = readdir(d))) {
            if (e->d_name[0] == '.') continue;
            char p[4096];
            snprintf(p, sizeof p, "%s/%s", argv[i], e->d_name);
            runs += run_file(p);
        }
        if (d) closedir(d);
    }
    printf("%d inputs\n", runs);
    return 0;
}
