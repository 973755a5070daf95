/* main.c - the moe test runner. The tests are grouped by area, one file each (test/test.h says
 * how a test is written):
 *
 *   kernels   number formats and every kernel level against its scalar reference
 *   gguf      parsers, GGUF files written and read, conversion, split files
 *   model     the forward pass against the goldens and against itself by other paths
 *   cache     the expert cache, streamed dense layers, memory held, concurrency
 *   text      tokenizer, chat formats, streaming text, sampling
 *   programs  the example programs run as a user runs them, moe-batch
 *   faults    hostile files, API misuse, injected I/O errors, kill -9, full disks
 *   hostile   hostile inputs: special files, huge lines, bad requests, NaN weights
 *   server    moe-server over sockets: endpoints, streaming, many clients, hostile requests
 *
 *   moe-test               run everything
 *   moe-test ARG...        run the tests named: an area ("cache"), a test ("cache.prefetch"), or a
 *                          test's name without its area ("prefetch")
 *   moe-test --list [ARG...]  list the tests, grouped by area, with a line each
 *
 * Golden data: test/golden (override with MOE_GOLDEN=DIR); MOE_TEST_VERBOSE=1 prints the figures
 * tests measure. Prints "N passed, N failed" last and exits 1 if anything failed, 2 on an
 * argument that names no test. */
#include "test.h"

int g_failed_checks;

static const struct {
    const char *name, *title;
    const test_case *tests;
} areas[] = {
    {"kernels", "kernels and formats", kernels_tests},
    {"gguf", "GGUF and checkpoints", gguf_tests},
    {"model", "model equivalence and goldens", model_tests},
    {"cache", "cache and streaming", cache_tests},
    {"text", "text and chat", text_tests},
    {"programs", "programs and batch", programs_tests},
    {"faults", "faults", faults_tests},
    {"hostile", "hostile inputs", hostile_tests},
    {"server", "moe-server", server_tests},
};
#define N_AREAS (int)(sizeof areas / sizeof *areas)

/* whether arg names test t of area a: the area, the full name, or the name after "area." */
static int names(const char *arg, int a, const test_case *t) {
    const char *dot = strchr(t->name, '.');
    return !strcmp(arg, areas[a].name) || !strcmp(arg, t->name) || (dot && !strcmp(arg, dot + 1));
}

/* whether test t of area a is selected by args (none: every test) */
static int selected(int argc, char **argv, int a, const test_case *t) {
    if (argc == 0) return 1;
    for (int i = 0; i < argc; i++)
        if (names(argv[i], a, t)) return 1;
    return 0;
}

/* the first argument that names no test, or NULL */
static const char *unknown_arg(int argc, char **argv) {
    for (int i = 0; i < argc; i++) {
        int hit = 0;
        for (int a = 0; a < N_AREAS && !hit; a++)
            for (const test_case *t = areas[a].tests; t->name && !hit; t++) hit = names(argv[i], a, t);
        if (!hit) return argv[i];
    }
    return NULL;
}

static void list(int argc, char **argv) {
    for (int a = 0; a < N_AREAS; a++) {
        int shown = 0;
        for (const test_case *t = areas[a].tests; t->name; t++) {
            if (!selected(argc, argv, a, t)) continue;
            if (!shown++) printf("%s: %s\n", areas[a].name, areas[a].title);
            printf("  %-34s %s\n", t->name, t->desc);
        }
    }
}

static void rm_tree(const char *dir) {
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd)) fprintf(stderr, "warning: could not remove %s\n", dir);
}

/* runs t, counting it as passed or failed */
static void run(const test_case *t, int *passed, int *failed) {
    int before = g_failed_checks;
    fprintf(stderr, "%-34s ", t->name);
    t->fn();
    if (g_failed_checks == before) {
        fprintf(stderr, "ok\n");
        (*passed)++;
    } else {
        fprintf(stderr, "FAILED\n");
        (*failed)++;
    }
}

int main(int argc, char **argv) {
    const int listing = argc > 1 && !strcmp(argv[1], "--list");
    const int nargs = argc - 1 - listing;
    char **args = argv + 1 + listing;
    const char *bad = unknown_arg(nargs, args);
    if (bad) {
        fprintf(stderr, "moe-test: no test or area named '%s' (moe-test --list shows them)\n", bad);
        return 2;
    }
    if (listing) {
        list(nargs, args);
        return 0;
    }
    const char *slash = strrchr(argv[0], '/');
    if (slash) snprintf(exe_dir, sizeof exe_dir, "%.*s", (int)(slash - argv[0]), argv[0]);
    snprintf(tmp_root, sizeof tmp_root, "/tmp/moe-test-XXXXXX");
    if (!mkdtemp(tmp_root)) {
        perror("mkdtemp");
        return 1;
    }
    int passed = 0, failed = 0;
    for (int pass = 0; pass < 2; pass++) /* the tests marked first, then the others */
        for (int a = 0; a < N_AREAS; a++)
            for (const test_case *t = areas[a].tests; t->name; t++)
                if ((t->first ? 0 : 1) == pass && selected(nargs, args, a, t)) run(t, &passed, &failed);
    rm_tree(tmp_root);
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
