/* files.h - reading whole input files for the example programs (not part of the runtime). */
#ifndef MOE_EXAMPLES_FILES_H
#define MOE_EXAMPLES_FILES_H
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "storage_reads.h"

/* fopen(path, "rb") for an input that must be a regular file. The open does not block, so a FIFO
 * without a writer or a device cannot hang the program, and anything but a regular file is
 * refused. NULL with *why saying why. */
static inline FILE *open_input(const char *path, const char **why) {
    const int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return *why = strerror(errno), NULL;
    struct stat sb;
    FILE *f = NULL;
    if (fstat(fd, &sb)) *why = strerror(errno);
    else if (!S_ISREG(sb.st_mode))
        *why = S_ISDIR(sb.st_mode) ? "a directory, not a file" : S_ISFIFO(sb.st_mode) ? "not a regular file (a FIFO)"
             : S_ISCHR(sb.st_mode) || S_ISBLK(sb.st_mode) ? "not a regular file (a device)" : "not a regular file";
    else if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) || !(f = fdopen(fd, "rb"))) *why = strerror(errno);
    if (!f) close(fd);
    return f;
}

/* The whole of path ("-": standard input, which may be a pipe), NUL-terminated, its length in
 * *len; NULL with *why saying why when it cannot be read. */
static inline char *slurp(const char *path, size_t *len, const char **why) {
    FILE *f = strcmp(path, "-") ? open_input(path, why) : stdin;
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
    if (!b) *why = "out of memory";
    else if (ferror(f)) { free(b); b = NULL; *why = "read error"; }
    if (b) b[n] = 0, *len = n;
    if (f != stdin) fclose(f);
    return b;
}

/* 1 when path is a regular file that begins with GGUF's magic ("GGUF"). */
static inline int is_gguf_file(const char *path) {
    const char *why;
    FILE *f = open_input(path, &why);
    char m[4] = {0};
    const int yes = f && fread(m, 1, 4, f) == 4 && !memcmp(m, "GGUF", 4);
    if (f) fclose(f);
    return yes;
}

/* Reads whitespace-separated token ids (decimal, 0..INT32_MAX) from path into *out (caller
 * frees; NULL when none). Returns how many (0 for an empty file), or -1 with *why saying what
 * went wrong: the open's error, a read error, out of memory, or something not a token id. */
static inline int read_ids(const char *path, int32_t **out, const char **why) {
    *out = NULL;
    FILE *f = open_input(path, why);
    if (!f) return -1;
    int n = 0, cap = 0, len = 0;
    int32_t *ids = NULL;
    char word[64];
    *why = NULL;
    for (int c;;) {
        c = fgetc(f);
        if (c == EOF || c == ' ' || c == '\n' || c == '\t' || c == '\r') {
            if (len) {
                word[len] = 0, len = 0;
                char *end;
                errno = 0;
                const long v = strtol(word, &end, 10);
                if (*end || errno || v < 0 || v > INT32_MAX || word[0] == '+' || word[0] == '-') {
                    *why = "not a list of non-negative token ids";
                    break;
                }
                if (n == cap) {
                    int32_t *nb = realloc(ids, sizeof *ids * (size_t)(cap = cap ? cap * 2 : 1024));
                    if (!nb) {
                        *why = "out of memory";
                        break;
                    }
                    ids = nb;
                }
                ids[n++] = (int32_t)v;
            }
            if (c == EOF) break;
        } else if (len < (int)sizeof word - 1) {
            word[len++] = (char)c;
        } else {
            *why = "not a list of non-negative token ids";
            break;
        }
    }
    if (!*why && ferror(f)) *why = "read error";
    fclose(f);
    if (*why) {
        free(ids);
        return -1;
    }
    *out = ids;
    return n;
}
#endif
