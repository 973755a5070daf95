/* prefix_cache.h - computed prompt prefixes kept for later prompts that begin with them, for
 * moe-server, moe-cli and moe-batch (not part of the runtime).
 *
 * An entry is a token sequence and the session state after it (KDA states and MLA latents, taken
 * by moe_session_fork), with the logits after its last token when it is a whole prompt. A new
 * prompt restores the longest entry that begins it (pc_lookup) and computes only the rest; an
 * entry as long as the prompt needs its logits, and then nothing is computed.
 *
 * Entries live in RAM within ram_budget and, given a directory, in files there within
 * disk_budget, one file an entry, written whole to a temporary name and renamed, so any number of
 * processes (servers, moe-cli, moe-batch) share a directory and never see half a file. Eviction
 * is least recently used in each: in RAM by this process's use, on disk by the files'
 * modification times, which a use renews. A file says which model it belongs to
 * (moe_model_id: the shape, a sample of the weights and the options that change the numbers),
 * its tokens (with a checksum) and the state (moe_session_save's checks); files of other models
 * are left alone, a damaged one is removed.
 *
 *   file: "MOEPFX01", u64 model id, u32 tokens, u32 has_logits, u64 FNV-1a of the tokens,
 *         int32 tokens[], float logits[vocab] when has_logits, then moe_session_save's state.
 *
 * Single-threaded: one thread uses a cache (moe-server's model thread). */
#ifndef MOE_EXAMPLES_PREFIX_CACHE_H
#define MOE_EXAMPLES_PREFIX_CACHE_H
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct {
    int32_t *tokens;
    int n;
    moe_session *s;  /* in RAM, or NULL */
    float *logits;   /* in RAM: the logits after tokens[n-1], or NULL */
    int file_logits; /* its file holds them */
    size_t ram;      /* bytes s and logits take */
    uint64_t used;   /* last use, by the cache's clock (RAM eviction) */
    char name[48];   /* its file in the directory, or "" */
    size_t disk;     /* that file's bytes */
    double mtime;    /* its modification time (disk eviction) */
} pc_entry;

typedef struct {
    moe_model *m;
    uint64_t id;
    int vocab, n_ctx;
    pc_entry *e;
    int n, cap;
    size_t ram_budget, ram_used;
    char *dir;
    size_t disk_budget, disk_used;
    struct timespec dir_mtime; /* when the directory was read */
    uint64_t clock;
    /* what it did, for reports */
    uint64_t lookups, hits, tokens_reused, stored, evicted, write_errors;
    const char *prog; /* the program's name, for its one message */
    char last_error[300];
} prefix_cache;

static inline uint64_t pc_tokens_hash(const int32_t *t, int n) {
    uint64_t h = 1469598103934665603ull;
    const unsigned char *b = (const unsigned char *)t;
    for (size_t i = 0; i < sizeof *t * (size_t)n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

static inline void pc_drop_ram(prefix_cache *pc, pc_entry *e) {
    if (!e->s) return;
    moe_session_free(e->s);
    free(e->logits);
    e->s = NULL, e->logits = NULL;
    pc->ram_used -= e->ram, e->ram = 0;
}

static inline void pc_path(const prefix_cache *pc, const char *name, char *path, size_t n) { snprintf(path, n, "%s/%s", pc->dir, name); }

static inline void pc_drop_file(prefix_cache *pc, pc_entry *e) {
    if (!e->name[0]) return;
    char path[4200];
    pc_path(pc, e->name, path, sizeof path);
    unlink(path);
    e->name[0] = 0;
    pc->disk_used -= e->disk, e->disk = 0;
}

/* entries neither in RAM nor on disk removed */
static inline void pc_compact(prefix_cache *pc) {
    int k = 0;
    for (int i = 0; i < pc->n; i++) {
        if (!pc->e[i].s && !pc->e[i].name[0]) {
            free(pc->e[i].tokens);
            continue;
        }
        pc->e[k++] = pc->e[i];
    }
    pc->n = k;
}

static inline pc_entry *pc_add(prefix_cache *pc, const int32_t *tokens, int n) {
    if (pc->n == pc->cap) {
        int cap = pc->cap ? 2 * pc->cap : 16;
        pc_entry *ne = realloc(pc->e, sizeof *ne * (size_t)cap);
        if (!ne) return NULL;
        pc->e = ne, pc->cap = cap;
    }
    pc_entry *e = &pc->e[pc->n];
    memset(e, 0, sizeof *e);
    if (!(e->tokens = malloc(sizeof *tokens * (size_t)(n ? n : 1)))) return NULL;
    memcpy(e->tokens, tokens, sizeof *tokens * (size_t)n);
    e->n = n;
    pc->n++;
    return e;
}

static inline pc_entry *pc_find(prefix_cache *pc, const int32_t *tokens, int n) {
    for (int i = 0; i < pc->n; i++)
        if (pc->e[i].n == n && !memcmp(pc->e[i].tokens, tokens, sizeof *tokens * (size_t)n)) return &pc->e[i];
    return NULL;
}

typedef struct {
    char magic[8];
    uint64_t model_id;
    uint32_t n_tokens, has_logits;
    uint64_t tokens_hash;
} pc_header;

static inline int pc_read_all(int fd, void *p, size_t n) {
    for (char *b = p; n;) {
        ssize_t r = read(fd, b, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        b += r, n -= (size_t)r;
    }
    return 0;
}

static inline int pc_write_all(int fd, const void *p, size_t n) {
    for (const char *b = p; n;) {
        ssize_t w = write(fd, b, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        b += w, n -= (size_t)w;
    }
    return 0;
}

/* Opens the file of entry name: its header and tokens read and checked (fd left after them);
 * -1 when it is missing, another model's or damaged */
static inline int pc_open_file(const prefix_cache *pc, const char *name, pc_header *h, int32_t **tokens) {
    char path[4200];
    pc_path(pc, name, path, sizeof path);
    const int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    struct stat sb;
    *tokens = NULL;
    if (fd < 0) return -1;
    if (fstat(fd, &sb) || !S_ISREG(sb.st_mode) || pc_read_all(fd, h, sizeof *h) || memcmp(h->magic, "MOEPFX01", 8) ||
        h->model_id != pc->id || h->n_tokens == 0 || h->n_tokens > (uint32_t)pc->n_ctx ||
        !(*tokens = malloc(sizeof **tokens * h->n_tokens)) || pc_read_all(fd, *tokens, sizeof **tokens * h->n_tokens) ||
        pc_tokens_hash(*tokens, (int)h->n_tokens) != h->tokens_hash) {
        free(*tokens);
        *tokens = NULL;
        close(fd);
        return -1;
    }
    return fd;
}

/* the directory read again when it changed since (another process added or removed a file):
 * every file of this model becomes an entry; entries whose file is gone lose it */
static inline void pc_scan(prefix_cache *pc) {
    struct stat sd;
    if (!pc->dir || stat(pc->dir, &sd)) return;
    if (sd.st_mtim.tv_sec == pc->dir_mtime.tv_sec && sd.st_mtim.tv_nsec == pc->dir_mtime.tv_nsec) return;
    pc->dir_mtime = sd.st_mtim;
    for (int i = 0; i < pc->n; i++) pc->e[i].disk = 0; /* 0 until found again */
    DIR *d = opendir(pc->dir);
    if (!d) return;
    pc->disk_used = 0;
    for (struct dirent *de; (de = readdir(d));) {
        const size_t l = strlen(de->d_name);
        if (l < 11 || l >= sizeof pc->e[0].name || strcmp(de->d_name + l - 10, ".moeprefix")) continue;
        char path[4200];
        struct stat sb;
        pc_path(pc, de->d_name, path, sizeof path);
        if (stat(path, &sb) || !S_ISREG(sb.st_mode)) continue;
        pc_entry *e = NULL;
        for (int i = 0; i < pc->n && !e; i++)
            if (!strcmp(pc->e[i].name, de->d_name)) e = &pc->e[i];
        if (!e) {
            pc_header h;
            int32_t *tokens;
            const int fd = pc_open_file(pc, de->d_name, &h, &tokens);
            if (fd < 0) continue; /* another model's, or not whole: left alone */
            close(fd);
            e = pc_find(pc, tokens, (int)h.n_tokens);
            if (!e) e = pc_add(pc, tokens, (int)h.n_tokens);
            free(tokens);
            if (!e) continue;
            snprintf(e->name, sizeof e->name, "%s", de->d_name);
            e->file_logits = h.has_logits != 0;
        }
        e->disk = (size_t)sb.st_size;
        e->mtime = sb.st_mtim.tv_sec + sb.st_mtim.tv_nsec * 1e-9;
        pc->disk_used += e->disk;
    }
    closedir(d);
    for (int i = 0; i < pc->n; i++)
        if (pc->e[i].name[0] && !pc->e[i].disk) pc->e[i].name[0] = 0; /* its file is gone */
    pc_compact(pc);
}

/* the temporary files of writers that were killed (NAME.moeprefix.PID.tmp whose PID is gone) removed */
static inline void pc_remove_orphans(const prefix_cache *pc) {
    DIR *d = opendir(pc->dir);
    for (struct dirent *de; d && (de = readdir(d));) {
        const char *p = strstr(de->d_name, ".moeprefix.");
        char *end;
        if (!p) continue;
        const long pid = strtol(p + 11, &end, 10);
        if (pid <= 0 || strcmp(end, ".tmp")) continue;
        if (!kill((pid_t)pid, 0) || errno != ESRCH) continue; /* its writer lives (or may: not ours to tell) */
        char path[4200];
        pc_path(pc, de->d_name, path, sizeof path);
        unlink(path);
    }
    if (d) closedir(d);
}

/* A cache for model m's sessions (prog: the program, for messages) of n_ctx tokens: RAM within ram_budget bytes (0: none), and the
 * directory dir (NULL: none; made if missing) within disk_budget. 0, or -1 with err set. */
static inline int pc_open(prefix_cache *pc, const char *prog, moe_model *m, int n_ctx, size_t ram_budget, const char *dir, size_t disk_budget,
                          char *err, size_t en) {
    memset(pc, 0, sizeof *pc);
    pc->prog = prog;
    pc->m = m, pc->id = moe_model_id(m), pc->vocab = moe_model_config(m)->vocab_size, pc->n_ctx = n_ctx;
    pc->ram_budget = ram_budget, pc->disk_budget = disk_budget;
    if (dir) {
        struct stat sb;
        if (mkdir(dir, 0755) && errno != EEXIST) return snprintf(err, en, "%s: %s", dir, strerror(errno)), -1;
        if (stat(dir, &sb) || !S_ISDIR(sb.st_mode)) return snprintf(err, en, "%s: not a directory", dir), -1;
        if (access(dir, W_OK | X_OK)) return snprintf(err, en, "%s: %s", dir, strerror(errno)), -1;
        if (!(pc->dir = strdup(dir))) return snprintf(err, en, "out of memory"), -1;
        pc_remove_orphans(pc);
        pc_scan(pc);
    }
    return 0;
}

static inline void pc_close(prefix_cache *pc) {
    for (int i = 0; i < pc->n; i++) {
        pc_drop_ram(pc, &pc->e[i]);
        free(pc->e[i].tokens);
    }
    free(pc->e);
    free(pc->dir);
    memset(pc, 0, sizeof *pc);
}

/* the longest entry that begins tokens[0..n): a strict prefix, or the whole when it has logits */
static inline pc_entry *pc_best(prefix_cache *pc, const int32_t *tokens, int n) {
    pc_entry *best = NULL;
    for (int i = 0; i < pc->n; i++) {
        pc_entry *e = &pc->e[i];
        const int has_logits = e->logits || (e->name[0] && e->file_logits);
        if (e->n > n || (e->n == n && !has_logits) || (best && e->n <= best->n)) continue;
        if (!memcmp(e->tokens, tokens, sizeof *tokens * (size_t)e->n)) best = e;
    }
    return best;
}

/* Restores into s the longest cached prefix of tokens[0..n); returns its length (0: none).
 * When it is all n tokens, their logits go to logits (vocab floats). A file that fails its checks
 * is removed and the next best tried. */
static inline int pc_lookup(prefix_cache *pc, const int32_t *tokens, int n, moe_session *s, float *logits) {
    pc->lookups++;
    pc_scan(pc);
    for (;;) {
        pc_entry *e = pc_best(pc, tokens, n);
        if (!e) return 0;
        e->used = ++pc->clock;
        if (e->s && (e->n < n || e->logits) && moe_session_restore(s, e->s, NULL, 0) == MOE_OK) {
            if (e->n == n) memcpy(logits, e->logits, sizeof *logits * (size_t)pc->vocab);
        } else if (e->name[0]) {
            pc_header h;
            int32_t *t;
            char path[4200];
            pc_path(pc, e->name, path, sizeof path);
            const int fd = pc_open_file(pc, e->name, &h, &t);
            int ok = fd >= 0 && h.n_tokens == (uint32_t)e->n && !memcmp(t, e->tokens, sizeof *t * (size_t)e->n) && (e->n < n || h.has_logits);
            if (ok && h.has_logits) { /* wanted for a whole prompt, else passed over */
                const size_t lb = sizeof *logits * (size_t)pc->vocab;
                ok = e->n == n ? !pc_read_all(fd, logits, lb) : lseek(fd, (off_t)lb, SEEK_CUR) >= 0;
            }
            ok = ok && moe_session_load(s, fd, pc->last_error, sizeof pc->last_error) == MOE_OK;
            free(t);
            if (fd >= 0) close(fd);
            if (!ok) { /* damaged, cut or replaced: gone */
                pc_drop_file(pc, e);
                pc_drop_ram(pc, e);
                pc_compact(pc);
                continue;
            }
            utimensat(AT_FDCWD, path, NULL, 0); /* used now: the last to be evicted */
        } else {
            pc_drop_ram(pc, e);
            pc_compact(pc);
            continue;
        }
        pc->hits++, pc->tokens_reused += (uint64_t)e->n;
        return e->n;
    }
}

/* the longest run of tokens[0..n) another entry shares, when it is more than `have` + 32 and less
 * than n: a point worth a snapshot of its own (two prompts with the same system prompt make a
 * third one with it find it), else 0 */
static inline int pc_branch_point(const prefix_cache *pc, const int32_t *tokens, int n, int have) {
    int best = 0;
    for (int i = 0; i < pc->n; i++) {
        const pc_entry *e = &pc->e[i];
        int k = 0;
        const int lim = e->n < n ? e->n : n;
        while (k < lim && e->tokens[k] == tokens[k]) k++;
        if (k > best) best = k;
    }
    return best > have + 32 && best < n ? best : 0;
}

/* RAM entries evicted, least recently used first, until `need` more bytes fit the budget */
static inline int pc_make_ram(prefix_cache *pc, size_t need, const pc_entry *keep) {
    if (need > pc->ram_budget) return 0;
    while (pc->ram_used + need > pc->ram_budget) {
        pc_entry *lru = NULL;
        for (int i = 0; i < pc->n; i++)
            if (pc->e[i].s && &pc->e[i] != keep && (!lru || pc->e[i].used < lru->used)) lru = &pc->e[i];
        if (!lru) return 0;
        pc_drop_ram(pc, lru);
        pc->evicted++;
    }
    return 1;
}

/* files removed, oldest first, until `need` more bytes fit the directory's budget */
static inline int pc_make_disk(prefix_cache *pc, size_t need, const pc_entry *keep) {
    if (need > pc->disk_budget) return 0;
    while (pc->disk_used + need > pc->disk_budget) {
        pc_entry *old = NULL;
        for (int i = 0; i < pc->n; i++)
            if (pc->e[i].name[0] && &pc->e[i] != keep && (!old || pc->e[i].mtime < old->mtime)) old = &pc->e[i];
        if (!old) return 0;
        pc_drop_file(pc, old);
        pc->evicted++;
    }
    return 1;
}

/* e's state s and logits (NULL: none) written to its file: a temporary name, then renamed */
static inline void pc_write(prefix_cache *pc, pc_entry *e, const moe_session *s, const float *logits) {
    const size_t bytes = sizeof(pc_header) + sizeof *e->tokens * (size_t)e->n + (logits ? sizeof *logits * (size_t)pc->vocab : 0) +
                         moe_session_state_bytes(s) + 48;
    if (!pc_make_disk(pc, bytes, e)) return;
    char name[48], path[4200], tmp[4300];
    snprintf(name, sizeof name, "%016llx-%d.moeprefix", (unsigned long long)pc_tokens_hash(e->tokens, e->n), e->n);
    pc_path(pc, name, path, sizeof path);
    snprintf(tmp, sizeof tmp, "%s.%ld.tmp", path, (long)getpid());
    pc->last_error[0] = 0;
    const int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    const pc_header h = {{'M', 'O', 'E', 'P', 'F', 'X', '0', '1'}, pc->id, (uint32_t)e->n, logits != NULL, pc_tokens_hash(e->tokens, e->n)};
    int ok = fd >= 0 && !pc_write_all(fd, &h, sizeof h) && !pc_write_all(fd, e->tokens, sizeof *e->tokens * (size_t)e->n) &&
             (!logits || !pc_write_all(fd, logits, sizeof *logits * (size_t)pc->vocab)) &&
             moe_session_save(s, fd, pc->last_error, sizeof pc->last_error) == MOE_OK && !fsync(fd);
    if (!ok && !pc->last_error[0]) snprintf(pc->last_error, sizeof pc->last_error, "%.200s: %s", tmp, strerror(errno));
    if (fd >= 0 && close(fd)) ok = 0;
    if (ok && rename(tmp, path)) ok = 0;
    if (!ok) { /* a full disk, say: the entry stays in RAM only; said once */
        unlink(tmp);
        if (!pc->write_errors++) fprintf(stderr, "%s: prefix cache: %s (prefixes that do not fit stay out of %s)\n", pc->prog, pc->last_error, pc->dir);
        return;
    }
    if (e->name[0]) pc->disk_used -= e->disk; /* replaced: now with its logits */
    snprintf(e->name, sizeof e->name, "%s", name);
    e->disk = bytes, e->file_logits = logits != NULL;
    struct stat sb;
    e->mtime = !stat(path, &sb) ? sb.st_mtim.tv_sec + sb.st_mtim.tv_nsec * 1e-9 : 0;
    pc->disk_used += bytes;
    stat(pc->dir, &sb);
    pc->dir_mtime = sb.st_mtim; /* our own change: no need to read the directory again */
    pc->stored++;
}

/* Keeps s, which holds tokens[0..n), and the logits after them (NULL: none) as an entry: in RAM
 * when it fits the budget, and in the directory when there is one. */
static inline void pc_insert(prefix_cache *pc, const int32_t *tokens, int n, const moe_session *s, const float *logits) {
    if (n <= 0 || (!pc->ram_budget && !pc->dir)) return;
    pc_entry *e = pc_find(pc, tokens, n);
    if (!e && !(e = pc_add(pc, tokens, n))) return;
    const int idx = (int)(e - pc->e);
    e->used = ++pc->clock;
    const size_t ram = moe_session_state_bytes(s) + (logits ? sizeof *logits * (size_t)pc->vocab : 0) + 4096;
    if ((!e->s || (logits && !e->logits)) && pc_make_ram(pc, ram, e)) {
        pc_drop_ram(pc, e);
        if (moe_session_fork(&e->s, s, NULL, 0) == MOE_OK) {
            e->logits = logits ? malloc(sizeof *logits * (size_t)pc->vocab) : NULL;
            if (e->logits) memcpy(e->logits, logits, sizeof *logits * (size_t)pc->vocab);
            if (logits && !e->logits) moe_session_free(e->s), e->s = NULL;
            else e->ram = ram, pc->ram_used += ram;
        }
    }
    e = &pc->e[idx];
    if (pc->dir && (!e->name[0] || (logits && !e->file_logits))) pc_write(pc, e, s, logits);
    pc_compact(pc);
}

/* --prefix-cache DIR and --prefix-cache-size SIZE (parse_size from cache_flags.h), as the
 * programs take them: 1 consumed, -1 with *why on a bad value, 0 not one of them */
static inline int pc_flag(int argc, char **argv, int *i, const char **dir, size_t *disk, const char **why) {
    const char *a = argv[*i], *v = *i + 1 < argc ? argv[*i + 1] : NULL;
    if (strcmp(a, "--prefix-cache") && strcmp(a, "--prefix-cache-size")) return 0;
    if (!v) return *why = !strcmp(a, "--prefix-cache") ? "--prefix-cache needs a directory" : "--prefix-cache-size needs a size", -1;
    ++*i;
    if (!strcmp(a, "--prefix-cache")) *dir = v;
    else if (!parse_size(v, disk)) return *why = "--prefix-cache-size: a size with its unit, such as 20G", -1;
    return 1;
}
#endif
