/* args.h - command-line manners the programs share (not part of the runtime): an error names the
 * flag and the value at fault, an unknown option gets the nearest one the program's help lists,
 * and both end with a one-line pointer to --help; the full help is printed for --help alone, on
 * stdout, with exit status 0. */
#ifndef MOE_EXAMPLES_ARGS_H
#define MOE_EXAMPLES_ARGS_H
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A program's help text: string parts printed one after the other, NULL last (C compilers need
 * only take literals of 4095 characters). */
typedef const char *const arg_help[];

/* --help: help on stdout, 0; otherwise "PROG: msg" and the pointer to --help on stderr, 2 */
static inline int arg_usage(const char *prog, const char *const *help, const char *msg) {
    if (!msg) {
        for (int k = 0; help[k]; k++) fputs(help[k], stdout);
        return 0;
    }
    fprintf(stderr, "%s: %s\n%s: '%s --help' lists the options\n", prog, msg, prog, prog);
    return 2;
}

/* arg_usage with a formatted message */
static inline int arg_fail(const char *prog, const char *const *help, const char *fmt, ...) {
    char msg[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return arg_usage(prog, help, msg);
}

/* edit distance of a and b (at most 63 characters of each), for suggestions */
static inline int arg_distance(const char *a, const char *b) {
    int la = (int)strlen(a), lb = (int)strlen(b), d[64][64];
    if (la > 63) la = 63;
    if (lb > 63) lb = 63;
    for (int i = 0; i <= la; i++) d[i][0] = i;
    for (int j = 0; j <= lb; j++) d[0][j] = j;
    for (int i = 1; i <= la; i++)
        for (int j = 1; j <= lb; j++) {
            const int sub = d[i - 1][j - 1] + (a[i - 1] != b[j - 1]), del = d[i - 1][j] + 1, ins = d[i][j - 1] + 1;
            d[i][j] = sub < del ? (sub < ins ? sub : ins) : (del < ins ? del : ins);
        }
    return d[la][lb];
}

static inline int arg_word_start(const char *text, const char *p) {
    return p == text || p[-1] == ' ' || p[-1] == '[' || p[-1] == '(' || p[-1] == '\n' || p[-1] == ',' || p[-1] == '|';
}

/* 1 when flag appears in help as an option (a word beginning with '-', whole) */
static inline int arg_in_help(const char *flag, const char *const *help) {
    const size_t n = strlen(flag);
    for (int k = 0; help[k]; k++)
        for (const char *p = strstr(help[k], flag); p; p = strstr(p + 1, flag)) {
            const char e = p[n];
            if (arg_word_start(help[k], p) && (e == ' ' || e == ',' || e == ']' || e == '\n' || e == ')' || e == '|' || e == ':' || e == '=' || !e))
                return 1;
        }
    return 0;
}

/* The command line's argument a, which no rule of the program took: a known flag whose value is
 * missing (value NULL) or bad, or an unknown option, answered with the option of the help that
 * is nearest (the longest shared beginning of at least 4 letters, else at most 2 edits, 3 for a
 * long one). */
static inline int arg_unknown(const char *prog, const char *const *help, const char *a, const char *value) {
    if (a[0] == '-' && arg_in_help(a, help))
        return value ? arg_fail(prog, help, "%s %s: not a value %s takes", a, value, a) : arg_fail(prog, help, "%s needs a value", a);
    if (a[0] != '-') return arg_fail(prog, help, "unexpected argument '%s'", a);
    const char *body = a + strspn(a, "-");
    char best[64] = "", by_prefix[64] = "";
    int bd = 1 << 20, bp = 3;
    for (int k = 0; help[k]; k++)
        for (const char *p = help[k]; (p = strchr(p, '-'));) {
            size_t n = 1;
            while (p[n] == '-' || (p[n] >= 'a' && p[n] <= 'z') || (p[n] >= 'A' && p[n] <= 'Z') || (p[n] >= '0' && p[n] <= '9')) n++;
            if (arg_word_start(help[k], p) && n > 1 && n < sizeof best && p[1] != ' ') {
                char w[64];
                memcpy(w, p, n), w[n] = 0;
                const char *wb = w + strspn(w, "-");
                int cp = 0;
                while (wb[cp] && wb[cp] == body[cp]) cp++;
                if (cp > bp) bp = cp, memcpy(by_prefix, w, n + 1);
                const int d = arg_distance(a, w);
                if (d < bd) bd = d, memcpy(best, w, n + 1);
            }
            p += n;
        }
    const char *near = by_prefix[0] ? by_prefix : best[0] && bd <= (strlen(a) > 6 ? 3 : 2) ? best : NULL;
    return near ? arg_fail(prog, help, "unknown option %s (did you mean %s?)", a, near) : arg_fail(prog, help, "unknown option %s", a);
}

/* A number for flag from the command line: 0 with *v when s is one in [lo, hi] (an integer where
 * integer is set); otherwise arg_usage's status (2) after naming the flag, the value and what is
 * wrong ("-t 0: must be at least 1") */
static inline int arg_num(const char *prog, const char *const *help, const char *flag, const char *s, double lo, double hi, int integer,
                          double *v) {
    char *end;
    const double x = strtod(s, &end);
    *v = 0;
    if (end == s || *end) return arg_fail(prog, help, "%s %s: not a number", flag, s);
    if (integer && x != (double)(long long)x) return arg_fail(prog, help, "%s %s: must be a whole number", flag, s);
    if (x < lo) return arg_fail(prog, help, "%s %s: must be at least %g", flag, s, lo);
    if (x > hi) return arg_fail(prog, help, "%s %s: must be at most %g", flag, s, hi);
    *v = x;
    return 0;
}
#endif
