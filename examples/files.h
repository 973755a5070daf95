/* files.h - reading whole input files for the example programs (not part of the runtime). */
#ifndef MOE_EXAMPLES_FILES_H
#define MOE_EXAMPLES_FILES_H
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The whole of path ("-": stdin), NUL-terminated, its length in *len; NULL when it cannot be
 * read (errno says why when it could not be opened). */
static inline char *slurp(const char *path, size_t *len) {
    FILE *f = strcmp(path, "-") ? fopen(path, "rb") : stdin;
    if (!f) return NULL;
    size_t n = 0, cap = 4096;
    char *b = malloc(cap);
    while (b) {
        if (n + 1 >= cap) {
            char *nb = realloc(b, cap *= 2);
            if (!nb) { free(b); b = NULL; break; }
            b = nb;
        }
        size_t r = fread(b + n, 1, cap - n - 1, f);
        if (!r) break;
        n += r;
    }
    if (b && ferror(f)) { free(b); b = NULL; }
    if (b) b[n] = 0, *len = n;
    if (f != stdin) fclose(f);
    return b;
}

/* Returns the number of ids read into *out (caller frees), or -1 when the file cannot be read,
 * is empty, or holds something that is not a token id in 0..INT32_MAX. */
static inline int read_ids(const char *path, int32_t **out) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    int n = 0, cap = 1024;
    int32_t *ids = malloc(sizeof *ids * (size_t)cap);
    long v;
    int r;
    while (ids && (r = fscanf(f, "%ld", &v)) == 1) {
        if (v < 0 || v > INT32_MAX) { n = -1; break; }
        if (n == cap) {
            int32_t *nb = realloc(ids, sizeof *ids * (size_t)(cap *= 2));
            if (!nb) { n = -1; break; }
            ids = nb;
        }
        ids[n++] = (int32_t)v;
    }
    if (n >= 0 && !feof(f)) n = -1; /* stopped on something that is not a number */
    fclose(f);
    if (n <= 0) { free(ids); return -1; }
    *out = ids;
    return n;
}
#endif
