/* test.h - what the test files share: the runner (CHECK, CHECKF, the test table), the golden and
 * shipped data, and helpers several areas use (defined in test/util.c).
 *
 * A test is a void function in the file of its area (test/kernels.c, test/gguf.c, test/model.c,
 * test/cache.c, test/text.c, test/programs.c, test/faults.c, test/hostile.c, test/server.c), listed in that file's table
 * AREA_tests[] as {"area.name", fn, "what it checks, in one line"}; test/main.c runs the tables.
 * A test passes when none of its CHECKs failed; a CHECK records file:line and goes on. */
#ifndef MOE_TEST_H
#define MOE_TEST_H
#define _POSIX_C_SOURCE 200809L
#define MOE_INTERNAL
#include "../moe.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <time.h>
#include <pthread.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* ---- runner ------------------------------------------------------------------------------ */

typedef struct {
    const char *name; /* "area.name" */
    void (*fn)(void);
    const char *desc; /* one line for --list */
    int first;        /* run before every other test (it forks before this process grows) */
} test_case;

/* each area's table, ended by an entry whose name is NULL (test/AREA.c) */
extern const test_case kernels_tests[];
extern const test_case gguf_tests[];
extern const test_case model_tests[];
extern const test_case cache_tests[];
extern const test_case text_tests[];
extern const test_case programs_tests[];
extern const test_case faults_tests[];
extern const test_case hostile_tests[];
extern const test_case server_tests[];

extern int g_failed_checks; /* the runner's own bookkeeping, not library state */

#define CHECK(expr)                                                                     \
    do {                                                                                \
        if (!(expr)) {                                                                  \
            fprintf(stderr, "  %s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #expr); \
            g_failed_checks++;                                                          \
        }                                                                               \
    } while (0)

#define CHECKF(expr, ...)                                                               \
    do {                                                                                \
        if (!(expr)) {                                                                  \
            fprintf(stderr, "  %s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #expr);  \
            fprintf(stderr, __VA_ARGS__);                                               \
            fprintf(stderr, "\n");                                                      \
            g_failed_checks++;                                                          \
        }                                                                               \
    } while (0)

/* ---- shared helpers (test/util.c) ---------------------------------------------------------- */

#define N_IQ 7
typedef struct {
    moe__json *cases;
    moe__st_file ref;
    double tol;
} golden;

extern uint64_t rng_state;
extern char tmp_root[256];
extern const char *const iq_names[N_IQ];
extern moe_options *golden_opts;
extern char exe_dir[512];

const char *golden_dir(void);
double urand(void);
float nrand(void);
void tmp_path(char *out, size_t n, const char *name);
char *read_all(const char *path, size_t *len);
int write_all(const char *path, const void *p, size_t n);
int golden_load(golden *g, const char *name);
void golden_free(golden *g);
int ids_of(const moe__json *arr, int32_t **out);
int argmax(const float *x, int n);
double max_abs_diff(const float *a, const float *b, size_t n);
double mean_kl(const float *ref, const float *test, int n, int V);
moe_model *open_path(const char *path, unsigned flags, int threads);
moe_model *open_model(const char *sub, unsigned flags, int threads);
void run_golden_path(const char *name, const char *model_path, unsigned flags, int threads);
void run_golden(const char *name, unsigned flags, int threads);
int32_t *golden_ids(const char *name, int pi, int *n);
float *logits_routed(moe_model *m, const int32_t *ids, int n, const int *pieces, int32_t *routes, const int32_t *force);
float *logits_in_pieces(moe_model *m, const int32_t *ids, int n, const int *pieces);
moe_status open_dir(const char *dir, char *err, size_t errlen);
int run_cmd(const char *cmd0, char *out, size_t outlen);
const char *tok_dir(void);
void write_batch_input(const char *path, int n, const char *extra);
int check_batch_output(const char *path, const char *want_id, char *text, size_t tn);
const char *shipped_dir(void);
int convert_expect(const char *model, const char *out, const char *args, int expect);
int convert(const char *model, const char *out, const char *args);
int write_small_shape(const char *path, int n_ff_exp);
moe_model *open_golden_with(const char *name, const moe_options *o);
moe_model *open_cache_pf(const char *name, size_t budget, int threads, int prefetch);
moe_model *open_cache(const char *name, size_t budget, int threads);
int make_slice(const char *name, const char *js, char *dir, size_t dn);
int make_k3_slice(const char *name, int E, int ie, int dl, char *dir, size_t dn);

#endif /* MOE_TEST_H */
