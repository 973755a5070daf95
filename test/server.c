/* server.c - tests of moe-server: servers started on the shipped model on a port of the kernel's
 * choosing (--port 0), spoken to over raw sockets as curl would: every endpoint, streamed and
 * whole answers, many clients at once, clients that leave, hostile and slow requests. */
#include "test.h"
#include "../examples/openai.h"

#include <netinet/in.h>
#include <ctype.h>
#include <poll.h>
#include <sys/socket.h>

typedef struct {
    pid_t pid;
    int port;
    char log[512];
} server_proc;

/* moe-server -m the shipped model with args, on a free port: 1 when it listens (else a failed
 * check) */
static int server_start(server_proc *s, const char *args) {
    static int n;
    char name[64];
    snprintf(name, sizeof name, "server-%d.log", n++);
    tmp_path(s->log, sizeof s->log, name);
    unlink(s->log);
    char cmd[2048];
    const char *runner = getenv("MOE_TEST_RUNNER");
    snprintf(cmd, sizeof cmd, "exec %s %s/moe-server -m %s --port 0 -t 1 %s 2>%s", runner ? runner : "", exe_dir, shipped_dir(), args, s->log);
    s->port = 0;
    if ((s->pid = fork()) == 0) {
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    if (s->pid < 0) return 0;
    for (int tries = 0; tries < 1200 && !s->port; tries++) { /* up to 60 s */
        struct timespec ts = {0, 50 * 1000000};
        nanosleep(&ts, NULL);
        FILE *f = fopen(s->log, "r");
        char line[512];
        while (f && fgets(line, sizeof line, f)) {
            const char *p = strstr(line, "listening on http://127.0.0.1:");
            if (p) s->port = atoi(p + strlen("listening on http://127.0.0.1:"));
        }
        if (f) fclose(f);
        int status;
        if (!s->port && waitpid(s->pid, &status, WNOHANG) == s->pid) {
            s->pid = -1;
            break;
        }
    }
    CHECKF(s->port > 0, "moe-server did not start (%s)", s->log);
    return s->port > 0;
}

/* 1 when the server's log holds a sanitizer's report (its stderr goes there, not to ours), which
 * is printed */
static int log_has_report(const server_proc *s) {
    FILE *f = fopen(s->log, "r");
    char line[1024];
    int found = 0;
    while (f && fgets(line, sizeof line, f)) {
        if (strstr(line, "Sanitizer") || strstr(line, "runtime error:")) found = 1;
        if (found) fprintf(stderr, "  %s: %s", s->log, line);
    }
    if (f) fclose(f);
    return found;
}

/* SIGTERM: 1 when it ends by itself with status 0, its log free of sanitizer reports */
static int server_stop(server_proc *s) {
    if (s->pid <= 0) return 0;
    kill(s->pid, SIGTERM);
    int status = 0;
    for (int tries = 0; tries < 400; tries++) {
        if (waitpid(s->pid, &status, WNOHANG) == s->pid) return s->pid = -1, WIFEXITED(status) && WEXITSTATUS(status) == 0 && !log_has_report(s);
        struct timespec ts = {0, 25 * 1000000};
        nanosleep(&ts, NULL);
    }
    kill(s->pid, SIGKILL);
    waitpid(s->pid, &status, 0);
    s->pid = -1;
    return 0;
}

static int connect_to(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port), .sin_addr.s_addr = htonl(0x7f000001)};
    if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a)) close(fd), fd = -1;
    return fd;
}

static int send_all(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w <= 0) return -1;
        p += w, n -= (size_t)w;
    }
    return 0;
}

/* what fd sends until it closes or `seconds` pass, into a malloc'd NUL-terminated string */
static char *read_until_close(int fd, double seconds, size_t *len) {
    size_t n = 0, cap = 1 << 16;
    char *out = malloc(cap);
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        struct timespec t1;
        clock_gettime(CLOCK_MONOTONIC, &t1);
        const double left = seconds - ((t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9);
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (left <= 0 || poll(&p, 1, (int)(left * 1000) + 1) <= 0) break;
        if (n + 4096 > cap) out = realloc(out, cap *= 2);
        ssize_t r = recv(fd, out + n, cap - n - 1, 0);
        if (r <= 0) break;
        n += (size_t)r;
    }
    out[n] = 0;
    if (len) *len = n;
    return out;
}

typedef struct {
    int status;
    char *raw;  /* the whole response */
    char *body; /* the body, de-chunked */
    size_t body_len;
} response;

static void response_free(response *r) { free(r->raw), free(r->body); }

/* the status and de-chunked body of the raw response in r->raw */
static void response_parse(response *r) {
    r->status = -1;
    r->body = calloc(1, 1), r->body_len = 0;
    if (strncmp(r->raw, "HTTP/1.1 ", 9)) return;
    r->status = atoi(r->raw + 9);
    char *h = strstr(r->raw, "\r\n\r\n");
    if (!h) return;
    *h = 0; /* the headers as one string, for strstr */
    char *b = h + 4;
    if (!strstr(r->raw, "Transfer-Encoding: chunked")) {
        r->body_len = strlen(b);
        r->body = realloc(r->body, r->body_len + 1);
        memcpy(r->body, b, r->body_len + 1);
        return;
    }
    for (;;) {
        char *e;
        size_t k = strtoul(b, &e, 16);
        if (e == b || strncmp(e, "\r\n", 2) || k == 0) break;
        b = e + 2;
        r->body = realloc(r->body, r->body_len + k + 1);
        memcpy(r->body + r->body_len, b, k);
        r->body_len += k, r->body[r->body_len] = 0;
        b += k + 2;
    }
}

/* one request on a connection of its own (Connection: close), its answer read whole */
static response request(int port, const char *method, const char *path, const char *body, const char *headers) {
    response r = {0};
    char head[1024];
    snprintf(head, sizeof head, "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n%sContent-Type: application/json\r\nContent-Length: %zu\r\n\r\n",
             method, path, headers ? headers : "", body ? strlen(body) : 0);
    int fd = connect_to(port);
    if (fd < 0 || send_all(fd, head, strlen(head)) || (body && send_all(fd, body, strlen(body)))) {
        if (fd >= 0) close(fd);
        r.raw = calloc(1, 1), r.body = calloc(1, 1), r.status = -1;
        return r;
    }
    r.raw = read_until_close(fd, 60, NULL);
    close(fd);
    response_parse(&r);
    return r;
}

/* the text of a streamed answer: each data event's delta content (chat) or text, and its
 * reasoning, concatenated; *done set by a [DONE] event; the usage chunk's object kept */
static void stream_text(const char *body, char *text, size_t tn, char *reasoning, size_t rn, int *done, moe__json **usage, int *events) {
    size_t t = 0, rr = 0;
    *done = 0, *events = 0;
    text[0] = 0, reasoning[0] = 0;
    for (const char *p = body; (p = strstr(p, "data: "));) {
        const char *e = strstr(p, "\n\n");
        if (!e) break;
        p += 6;
        if (!strncmp(p, "[DONE]", 6)) *done = 1;
        moe__json *j = NULL;
        if (!*done && moe__json_parse(p, (size_t)(e - p), &j, NULL, 0) == MOE_OK) {
            (*events)++;
            const moe__json *ch = moe__json_get(j, "choices"), *u = moe__json_get(j, "usage");
            const moe__json *c0 = ch && ch->child ? ch->child : NULL;
            const moe__json *d = c0 ? moe__json_get(c0, "delta") : NULL;
            const moe__json *tx = d ? moe__json_get(d, "content") : c0 ? moe__json_get(c0, "text") : NULL;
            const moe__json *rs = d ? moe__json_get(d, "reasoning_content") : NULL;
            if (tx && tx->type == MOE_JSON_STR) t += (size_t)snprintf(text + t, tn - t, "%s", tx->str);
            if (rs && rs->type == MOE_JSON_STR) rr += (size_t)snprintf(reasoning + rr, rn - rr, "%s", rs->str);
            if (t >= tn) t = tn - 1;
            if (rr >= rn) rr = rn - 1;
            if (u && u->type == MOE_JSON_OBJ && usage) {
                moe__json_free(*usage);
                moe__json_parse(p, (size_t)(e - p), usage, NULL, 0);
            }
        }
        moe__json_free(j);
        p = e;
    }
}

/* a whole answer's first choice: its message content and reasoning (chat) or text */
static int answer_text(const char *body, char *text, size_t tn, char *reasoning, size_t rn) {
    moe__json *j = NULL;
    text[0] = reasoning[0] = 0;
    if (moe__json_parse(body, strlen(body), &j, NULL, 0) != MOE_OK) return 0;
    const moe__json *ch = moe__json_get(j, "choices");
    const moe__json *c0 = ch && ch->child ? ch->child : NULL;
    const moe__json *msg = c0 ? moe__json_get(c0, "message") : NULL;
    const moe__json *tx = msg ? moe__json_get(msg, "content") : c0 ? moe__json_get(c0, "text") : NULL;
    const moe__json *rs = msg ? moe__json_get(msg, "reasoning_content") : NULL;
    if (tx && tx->type == MOE_JSON_STR) snprintf(text, tn, "%s", tx->str);
    if (rs && rs->type == MOE_JSON_STR) snprintf(reasoning, rn, "%s", rs->str);
    moe__json_free(j);
    return tx != NULL;
}

/* the value of a metric line "NAME VALUE" in a /metrics body; -1 if absent */
static double metric(const char *body, const char *name) {
    char key[200];
    snprintf(key, sizeof key, "\n%s ", name);
    const char *p = strstr(body, key);
    return p ? atof(p + strlen(key)) : -1;
}

/* polls /metrics until metric `name` is `want`, for up to 5 s: 1 when it got there */
static int wait_metric(int port, const char *name, double want) {
    for (int tries = 0; tries < 100; tries++) {
        response r = request(port, "GET", "/metrics", NULL, NULL);
        const double v = metric(r.body, name);
        response_free(&r);
        if (v == want) return 1;
        struct timespec ts = {0, 50 * 1000000};
        nanosleep(&ts, NULL);
    }
    return 0;
}

static void test_endpoints(void) {
    server_proc s;
    if (!server_start(&s, "--api-key sekrit --parallel 2 -c 512")) return;
    const char *auth = "Authorization: Bearer sekrit\r\n";
    response r = request(s.port, "GET", "/health", NULL, NULL); /* /health needs no key */
    CHECKF(r.status == 200 && strstr(r.body, "\"ok\""), "%d %s", r.status, r.body);
    response_free(&r);
    r = request(s.port, "GET", "/v1/models", NULL, NULL);
    CHECKF(r.status == 401 && strstr(r.body, "\"authentication_error\""), "%d %s", r.status, r.body);
    response_free(&r);
    r = request(s.port, "GET", "/v1/models", NULL, "Authorization: Bearer sekrix\r\n");
    CHECK(r.status == 401);
    response_free(&r);
    r = request(s.port, "GET", "/v1/models", NULL, auth);
    CHECKF(r.status == 200 && strstr(r.body, "\"id\": \"kimi-k3-tiny\"") && strstr(r.body, "\"object\": \"list\""), "%d %s", r.status, r.body);
    response_free(&r);
    r = request(s.port, "GET", "/", NULL, NULL); /* the page: static, served without the key */
    CHECK(r.status == 200 && strstr(r.raw, "text/html") && strstr(r.body, "v1/chat/completions"));
    response_free(&r);
    r = request(s.port, "GET", "/v2/nothing", NULL, auth);
    CHECKF(r.status == 404 && strstr(r.body, "\"not_found_error\""), "%d", r.status);
    response_free(&r);
    r = request(s.port, "GET", "/../../etc/passwd", NULL, auth);
    CHECK(r.status == 404);
    response_free(&r);
    r = request(s.port, "DELETE", "/v1/chat/completions", NULL, auth);
    CHECKF(r.status == 405 && strstr(r.raw, "Allow: POST"), "%d", r.status);
    response_free(&r);
    r = request(s.port, "POST", "/health", "{}", auth);
    CHECK(r.status == 405);
    response_free(&r);
    /* bad bodies: 400 with a message naming what is wrong */
    static const struct { const char *body, *says; } bad[] = {
        {"{\"messages\": [", "not JSON"},
        {"[1, 2]", "body must be an object"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"temperature\": \"hot\"}", "temperature must be a number"},
        {"{\"messages\": []}", "non-empty list"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 100000}", "do not fit the context of 512"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"n\": 3}", "--parallel 2"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"stream\": \"yes\"}", "stream must be true or false"},
        {"{\"prompt\": \"x\", \"stream_options\": 5}", "stream_options must be an object"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        r = request(s.port, "POST", i == 7 ? "/v1/completions" : "/v1/chat/completions", bad[i].body, auth);
        CHECKF(r.status == 400 && strstr(r.body, bad[i].says) && strstr(r.body, "\"invalid_request_error\""), "%s -> %d %s", bad[i].body, r.status, r.body);
        response_free(&r);
    }
    /* a whole chat answer and a whole text completion, and their usage */
    r = request(s.port, "POST", "/v1/chat/completions",
                "{\"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}], \"max_tokens\": 12, \"temperature\": 0, \"logprobs\": true, \"top_logprobs\": 2}", auth);
    CHECKF(r.status == 200 && strstr(r.body, "\"object\": \"chat.completion\"") && strstr(r.body, "\"completion_tokens\": 12") &&
               strstr(r.body, "\"cached_tokens\": ") && strstr(r.body, "\"top_logprobs\": [{"),
           "%d %s", r.status, r.body);
    response_free(&r);
    r = request(s.port, "POST", "/v1/completions", "{\"prompt\": \"Once upon a time\", \"max_tokens\": 8, \"temperature\": 0, \"n\": 2}", auth);
    CHECKF(r.status == 200 && strstr(r.body, "\"object\": \"text_completion\"") && strstr(r.body, "\"index\": 1") &&
               strstr(r.body, "\"completion_tokens\": 16"),
           "%d %s", r.status, r.body);
    response_free(&r);
    r = request(s.port, "GET", "/metrics", NULL, auth);
    CHECKF(r.status == 200 && metric(r.body, "moe_requests_total{endpoint=\"chat_completions\"}") == 8 &&
               metric(r.body, "moe_tokens_generated_total") == 12 + 16 && metric(r.body, "moe_requests_running") == 0 &&
               metric(r.body, "moe_responses_total{code=\"401\"}") == 2 && metric(r.body, "moe_expert_cache_hits_total") >= 0,
           "%s", r.body);
    response_free(&r);
    CHECK(server_stop(&s));
}

/* a streamed answer is the whole answer in pieces: the same text, the usage, [DONE]; the
 * completions form too; and a stop string never shows */
static void test_stream(void) {
    server_proc s;
    if (!server_start(&s, "--parallel 2")) return;
    static char t1[8192], r1[8192], t2[8192], r2[8192];
    const char *chat = "{\"messages\": [{\"role\": \"user\", \"content\": \"Tell me a story\"}], \"max_tokens\": 60, \"temperature\": 0%s}";
    char body[512];
    snprintf(body, sizeof body, chat, "");
    response r = request(s.port, "POST", "/v1/chat/completions", body, NULL);
    CHECK(r.status == 200 && answer_text(r.body, t1, sizeof t1, r1, sizeof r1));
    response_free(&r);
    snprintf(body, sizeof body, chat, ", \"stream\": true, \"stream_options\": {\"include_usage\": true}");
    r = request(s.port, "POST", "/v1/chat/completions", body, NULL);
    int done, events;
    moe__json *usage = NULL;
    stream_text(r.body, t2, sizeof t2, r2, sizeof r2, &done, &usage, &events);
    CHECKF(r.status == 200 && strstr(r.raw, "text/event-stream") && done && events > 10, "%d done %d events %d", r.status, done, events);
    CHECKF(!strcmp(t1, t2) && !strcmp(r1, r2), "whole [%s|%s] streamed [%s|%s]", r1, t1, r2, t2);
    const moe__json *u = usage ? moe__json_get(usage, "usage") : NULL;
    const moe__json *ct = u ? moe__json_get(u, "completion_tokens") : NULL;
    CHECK(ct && ct->num == 60);
    moe__json_free(usage), usage = NULL;
    response_free(&r);
    /* streamed log probabilities: one entry per generated token over all chunks, as whole */
    snprintf(body, sizeof body, chat, ", \"stream\": true, \"logprobs\": true, \"top_logprobs\": 2");
    r = request(s.port, "POST", "/v1/chat/completions", body, NULL);
    int entries = 0, tops = 0;
    for (const char *p = r.body; (p = strstr(p, "\"logprob\": ")); p++) entries++;
    for (const char *p = r.body; (p = strstr(p, "\"top_logprobs\": [{")); p++) tops++;
    CHECKF(r.status == 200 && entries == 60 * 3 && tops == 60, "%d logprob entries, %d top lists", entries, tops);
    response_free(&r);
    /* completions, with a stop string cut out of the text; streamed the same */
    const char *comp = "{\"prompt\": \"Once upon a time\", \"max_tokens\": 40, \"temperature\": 0%s}";
    snprintf(body, sizeof body, comp, "");
    r = request(s.port, "POST", "/v1/completions", body, NULL);
    CHECK(r.status == 200 && answer_text(r.body, t1, sizeof t1, r1, sizeof r1));
    response_free(&r);
    CHECKF(strlen(t1) > 8, "%s", t1);
    char stop[8] = {0}; /* three letters from its second half */
    for (size_t i = strlen(t1) / 2; i + 3 <= strlen(t1) && !stop[0]; i++)
        if (islower((unsigned char)t1[i]) && islower((unsigned char)t1[i + 1]) && islower((unsigned char)t1[i + 2])) memcpy(stop, t1 + i, 3);
    CHECKF(stop[0], "no three letters in the second half of [%s]", t1);
    char extra[128];
    snprintf(extra, sizeof extra, ", \"stop\": [\"%s\"]", stop);
    for (int streamed = 0; streamed < 2 && stop[0]; streamed++) {
        char e2[200];
        snprintf(e2, sizeof e2, "%s%s", extra, streamed ? ", \"stream\": true" : "");
        snprintf(body, sizeof body, comp, e2);
        r = request(s.port, "POST", "/v1/completions", body, NULL);
        if (streamed) stream_text(r.body, t2, sizeof t2, r2, sizeof r2, &done, NULL, &events);
        else answer_text(r.body, t2, sizeof t2, r2, sizeof r2);
        const char *at = strstr(t1, stop);
        CHECKF(r.status == 200 && at && strlen(t2) == (size_t)(at - t1) && !strncmp(t1, t2, strlen(t2)) && strstr(r.body, "\"finish_reason\": \"stop\""),
               "stop [%s]: [%s] then [%s]", stop, t1, t2);
        response_free(&r);
    }
    CHECK(server_stop(&s));
}

typedef struct {
    int port;
    char body[512];
    char text[4096], reasoning[4096];
    int status, done;
} client;

static void *client_run(void *arg) {
    client *c = arg;
    response r = request(c->port, "POST", "/v1/chat/completions", c->body, NULL);
    int events;
    c->status = r.status;
    stream_text(r.body, c->text, sizeof c->text, c->reasoning, sizeof c->reasoning, &c->done, NULL, &events);
    response_free(&r);
    return NULL;
}

/* 16 clients streaming at once through 4 sequences: every answer whole, and each the same as
 * the same request run alone */
static void test_concurrent(void) {
    server_proc s;
    if (!server_start(&s, "--parallel 4")) return;
    enum { N = 16 };
    static client cl[N];
    static char alone[N][4096], alone_r[N][4096];
    const char *subjects[] = {"cats", "the sea", "trains", "winter", "bread", "music", "stars", "rivers"};
    for (int i = 0; i < N; i++) {
        cl[i].port = s.port;
        snprintf(cl[i].body, sizeof cl[i].body,
                 "{\"messages\": [{\"role\": \"user\", \"content\": \"Say something about %s, number %d\"}], \"max_tokens\": %d, \"temperature\": 0, \"stream\": %s}",
                 subjects[i % 8], i, 8 + 3 * i, "%s");
        char b[512];
        snprintf(b, sizeof b, cl[i].body, "false");
        response r = request(s.port, "POST", "/v1/chat/completions", b, NULL);
        CHECK(r.status == 200 && answer_text(r.body, alone[i], sizeof alone[i], alone_r[i], sizeof alone_r[i]));
        response_free(&r);
        snprintf(b, sizeof b, cl[i].body, "true");
        snprintf(cl[i].body, sizeof cl[i].body, "%s", b);
    }
    pthread_t th[N];
    for (int i = 0; i < N; i++) pthread_create(&th[i], NULL, client_run, &cl[i]);
    for (int i = 0; i < N; i++) pthread_join(th[i], NULL);
    int same = 0;
    for (int i = 0; i < N; i++) {
        CHECKF(cl[i].status == 200 && cl[i].done, "client %d: %d, done %d", i, cl[i].status, cl[i].done);
        same += !strcmp(cl[i].text, alone[i]) && !strcmp(cl[i].reasoning, alone_r[i]);
        if (strcmp(cl[i].text, alone[i]) || strcmp(cl[i].reasoning, alone_r[i]))
            fprintf(stderr, "  client %d: alone [%s|%s], beside others [%s|%s]\n", i, alone_r[i], alone[i], cl[i].reasoning, cl[i].text);
    }
    CHECKF(same == N, "%d of %d the same", same, N);
    response r = request(s.port, "GET", "/metrics", NULL, NULL);
    CHECKF(metric(r.body, "moe_requests_total{endpoint=\"chat_completions\"}") == 2 * N && metric(r.body, "moe_requests_running") == 0 &&
               metric(r.body, "moe_requests_queued") == 0, "%s", r.body);
    response_free(&r);
    CHECK(server_stop(&s));
}

/* a client that leaves mid-stream frees its sequence: with one sequence, the request queued
 * behind it is answered long before the first could have finished; a full queue answers 503 */
static void test_disconnect(void) {
    server_proc s;
    if (!server_start(&s, "--parallel 1 --queue 1 -c 65536")) return;
    const char *body = "{\"prompt\": \"Once upon a time\", \"max_tokens\": 60000, \"temperature\": 0, \"stream\": true}";
    char head[512];
    snprintf(head, sizeof head, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %zu\r\n\r\n", strlen(body));
    int fd = connect_to(s.port);
    CHECK(fd >= 0 && !send_all(fd, head, strlen(head)) && !send_all(fd, body, strlen(body)));
    char got[4096];
    ssize_t n = 0;
    for (int tries = 0; tries < 200 && !strstr(got, "data: "); tries++) { /* the first event */
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 100) > 0) {
            ssize_t r = recv(fd, got + n, sizeof got - 1 - (size_t)n, 0);
            if (r <= 0) break;
            n += r;
        }
        got[n] = 0;
    }
    CHECK(strstr(got, "data: ") != NULL);
    /* a second request waits in the queue (--queue 1); a third finds it full: 503 */
    const char *small = "{\"prompt\": \"Hello\", \"max_tokens\": 4, \"temperature\": 0}";
    char req2[512];
    snprintf(req2, sizeof req2, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %zu\r\n\r\n%s", strlen(small), small);
    int fd2 = connect_to(s.port);
    CHECK(fd2 >= 0 && !send_all(fd2, req2, strlen(req2)));
    CHECK(wait_metric(s.port, "moe_requests_queued", 1));
    response r = request(s.port, "POST", "/v1/completions", small, NULL);
    CHECKF(r.status == 503 && strstr(r.raw, "Retry-After: 1") && strstr(r.body, "\"server_busy\""), "%d %s", r.status, r.body);
    response_free(&r);
    close(fd); /* the first client leaves: the queued request runs */
    size_t len;
    char *second = read_until_close(fd2, 30, &len);
    close(fd2);
    CHECKF(!strncmp(second, "HTTP/1.1 200", 12) && strstr(second, "\"completion_tokens\": 4"), "%s", second);
    free(second);
    r = request(s.port, "POST", "/v1/completions", small, NULL);
    CHECKF(r.status == 200 && strstr(r.body, "\"completion_tokens\": 4"), "%d %s", r.status, r.body);
    response_free(&r);
    r = request(s.port, "GET", "/metrics", NULL, NULL);
    const double gen = metric(r.body, "moe_tokens_generated_total");
    CHECKF(metric(r.body, "moe_requests_running") == 0 && gen > 8 && gen < 30000, "%s", r.body);
    response_free(&r);
    CHECK(server_stop(&s));
}

/* raw bytes on a connection of their own: the status of the answer, read within `seconds` */
static int raw_status(int port, const char *bytes, size_t n, double seconds, char *out, size_t on) {
    int fd = connect_to(port);
    if (fd < 0) return -1;
    if (send_all(fd, bytes, n)) { /* the server may answer and close before all is sent */ }
    size_t len;
    char *resp = read_until_close(fd, seconds, &len);
    close(fd);
    const int st = !strncmp(resp, "HTTP/1.1 ", 9) ? atoi(resp + 9) : -1;
    if (out) snprintf(out, on, "%s", resp);
    free(resp);
    return st;
}

/* truncated, oversized, malformed and slow requests: each answered with its status (or the
 * connection just closed), and the server goes on answering */
static void test_hostile(void) {
    server_proc s;
    if (!server_start(&s, "--timeout 1 --idle-timeout 1 --max-body 4K --max-connections 8")) return;
    char out[2048];
    static const struct { const char *req; int status; } cases[] = {
        {"GET /health HTTP/1.1\r\n\r\n", 400},                                    /* no Host */
        {"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", 505},
        {"GET  /health HTTP/1.1\r\nHost: x\r\n\r\n", 400},
        {"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", 501},
        {"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999\r\n\r\n", 413},
        {"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", 400},
        {"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n{\"a\":", 400}, /* bad JSON */
        {"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\n\xff\xfe{}", 400}, /* not UTF-8 */
        {"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 20\r\n\r\n{\"prompt\"", 408},       /* truncated: times out */
        {"BREW /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", 405},
        {"GET /health HTTP/1.1\r\nHost: x\r\nX: a\r\n folded\r\n\r\n", 400},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        const int st = raw_status(s.port, cases[i].req, strlen(cases[i].req), 5, out, sizeof out);
        CHECKF(st == cases[i].status, "case %zu: %d, wanted %d: %.200s", i, st, cases[i].status, out);
    }
    /* a header larger than 64 KiB */
    char *big = malloc(80000);
    int k = snprintf(big, 80000, "GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ");
    memset(big + k, 'a', 70000);
    memcpy(big + k + 70000, "\r\n\r\n", 5);
    CHECK(raw_status(s.port, big, strlen(big), 5, out, sizeof out) == 431);
    free(big);
    /* a slow drip: one byte at a time, never whole within --timeout; the server answers others meanwhile */
    int fd = connect_to(s.port);
    const char *drip = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{\"prompt\": \"a\", ";
    double t0 = (double)time(NULL);
    int answered = 0, status = -1;
    for (size_t i = 0; drip[i] && fd >= 0; i++) {
        if (send(fd, drip + i, 1, MSG_NOSIGNAL) != 1) break;
        struct timespec ts = {0, 100 * 1000000};
        nanosleep(&ts, NULL);
        if (i == 5) {
            response r = request(s.port, "GET", "/health", NULL, NULL);
            answered = r.status == 200;
            response_free(&r);
        }
    }
    if (fd >= 0) {
        size_t len;
        char *resp = read_until_close(fd, 5, &len);
        status = !strncmp(resp, "HTTP/1.1 ", 9) ? atoi(resp + 9) : -1;
        free(resp);
        close(fd);
    }
    CHECKF(answered && status == 408, "answered %d, drip %d after %.0f s", answered, status, (double)time(NULL) - t0);
    /* more connections than --max-connections: the ninth is answered 503; idle ones closed after --idle-timeout */
    int idle[8];
    for (int i = 0; i < 8; i++) idle[i] = connect_to(s.port);
    struct timespec ts = {0, 200 * 1000000};
    nanosleep(&ts, NULL);
    CHECK(raw_status(s.port, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n", 34, 5, out, sizeof out) == 503);
    size_t len;
    char *gone = read_until_close(idle[0], 5, &len); /* closed by the server, nothing sent */
    CHECK(len == 0);
    free(gone);
    for (int i = 0; i < 8; i++) close(idle[i]);
    nanosleep(&ts, NULL);
    /* keep-alive: two requests on one connection, then a pipelined pair */
    fd = connect_to(s.port);
    const char *two = "GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    CHECK(!send_all(fd, two, strlen(two)));
    char *both = read_until_close(fd, 5, &len);
    CHECKF(strstr(both, "\"status\": \"ok\"") && strstr(both, "\"object\": \"list\""), "%s", both);
    free(both);
    close(fd);
    response r = request(s.port, "GET", "/health", NULL, NULL);
    CHECK(r.status == 200);
    response_free(&r);
    CHECK(server_stop(&s));
}

/* a chat request's body: a system prompt long enough to matter, one user turn (and an earlier
 * exchange when `before` is given) */
static void chat_body(char *b, size_t n, const char *user, const char *before) {
    char sys[2048] = "";
    for (int i = 0; i < 20; i++) strcat(sys, "The rules of the game are simple and every player must follow them. ");
    snprintf(b, n, "{\"messages\": [{\"role\": \"system\", \"content\": \"%s\"}, %s{\"role\": \"user\", \"content\": \"%s\"}], \"max_tokens\": 10, \"temperature\": 0}",
             sys, before ? before : "", user);
}

/* an answer's usage: prompt tokens and cached ones; its text into text */
static int cached_of(const response *r, int *prompt, char *text, size_t tn) {
    moe__json *j = NULL;
    *prompt = -1;
    int cached = -1;
    char rs[4096];
    answer_text(r->body, text, tn, rs, sizeof rs);
    strncat(text, rs, tn - strlen(text) - 1);
    if (moe__json_parse(r->body, strlen(r->body), &j, NULL, 0) != MOE_OK) return -1;
    const moe__json *u = moe__json_get(j, "usage"), *pt = u ? moe__json_get(u, "prompt_tokens") : NULL;
    const moe__json *d = u ? moe__json_get(u, "prompt_tokens_details") : NULL, *ct = d ? moe__json_get(d, "cached_tokens") : NULL;
    if (pt) *prompt = (int)pt->num;
    if (ct) cached = (int)ct->num;
    moe__json_free(j);
    return cached;
}

/* the prefix cache: a repeated prompt computes nothing, a conversation's next turn reuses the
 * last, a third prompt with a shared system prompt reuses it; the answers equal a server's
 * without the cache; a restarted server, moe-cli and moe-batch given the directory reuse what
 * is there; a damaged file is dropped; the directory stays within its size */
static void test_prefix_cache(void) {
    char dir[600], cmd[2400], out[8192], body[4096];
    tmp_path(dir, sizeof dir, "prefix-cache");
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0);
    server_proc s, ref;
    char args[800];
    snprintf(args, sizeof args, "--parallel 2 --prefix-cache %s", dir);
    if (!server_start(&s, args) || !server_start(&ref, "--parallel 2 --prefix-cache-ram 0")) return;
    static char text[5][4096], want[4096];
    int prompt[5], cached[5];
    const char *users[] = {"What is one?", "What is one?", "What is two?", "What is three?", "And four?"};
    for (int i = 0; i < 5; i++) {
        chat_body(body, sizeof body, users[i], i == 4 ? "{\"role\": \"user\", \"content\": \"What is one?\"}, {\"role\": \"assistant\", \"content\": \"One.\"}, " : NULL);
        response r = request(s.port, "POST", "/v1/chat/completions", body, NULL);
        CHECK(r.status == 200);
        cached[i] = cached_of(&r, &prompt[i], text[i], sizeof text[i]);
        response_free(&r);
        r = request(ref.port, "POST", "/v1/chat/completions", body, NULL);
        int p2;
        CHECK(cached_of(&r, &p2, want, sizeof want) == 0 && p2 == prompt[i]);
        CHECKF(!strcmp(want, text[i]), "request %d: [%s] with the cache, [%s] without", i, text[i], want);
        response_free(&r);
    }
    CHECKF(cached[0] == 0 && cached[1] == prompt[1] && cached[2] == 0 && cached[3] > 100 && cached[3] < prompt[3] && cached[4] >= prompt[0] - 8,
           "cached %d %d %d %d %d of %d %d %d %d %d", cached[0], cached[1], cached[2], cached[3], cached[4], prompt[0], prompt[1], prompt[2], prompt[3],
           prompt[4]);
    response r = request(s.port, "GET", "/metrics", NULL, NULL);
    CHECKF(metric(r.body, "moe_prefix_cache_hits_total") == 3 && metric(r.body, "moe_prompt_tokens_cached_total") == cached[1] + cached[3] + cached[4],
           "%s", r.body);
    response_free(&r);
    CHECK(server_stop(&s) && server_stop(&ref));
    /* a restarted server finds the first prompt on disk, and removes what a killed writer left */
    pid_t dead = fork();
    if (dead == 0) _exit(0);
    waitpid(dead, NULL, 0);
    char orphan[1200];
    snprintf(orphan, sizeof orphan, "%s/0123456789abcdef-7.moeprefix.%ld.tmp", dir, (long)dead);
    CHECK(write_all(orphan, "partial", 7));
    if (!server_start(&s, args)) return;
    chat_body(body, sizeof body, users[0], NULL);
    r = request(s.port, "POST", "/v1/chat/completions", body, NULL);
    int p;
    CHECK(cached_of(&r, &p, want, sizeof want) == prompt[0] && !strcmp(want, text[0]));
    CHECK(access(orphan, F_OK) != 0);
    response_free(&r);
    /* a completion the server computed, then the same prompt from moe-cli and moe-batch */
    const char *story = "Once upon a time there was a small village by the sea, and in it lived an old fisherman";
    snprintf(body, sizeof body, "{\"prompt\": \"%s\", \"max_tokens\": 6, \"temperature\": 0}", story);
    r = request(s.port, "POST", "/v1/completions", body, NULL);
    int story_tokens;
    CHECK(cached_of(&r, &story_tokens, want, sizeof want) == 0);
    response_free(&r);
    CHECK(server_stop(&s));
    snprintf(cmd, sizeof cmd, "%s/moe-cli -m %s -p '%s' -n 6 --temp 0 -t 1 --prefix-cache %s 2>&1", exe_dir, shipped_dir(), story, dir);
    CHECK(run_cmd(cmd, out, sizeof out) == 0);
    char expect[200];
    snprintf(expect, sizeof expect, "prefix cache: %d of the prompt's %d tokens taken", story_tokens, story_tokens);
    CHECKF(strstr(out, expect) && strstr(out, want), "%s (wanted %s and [%s])", out, expect, want);
    char in[600], bout[600];
    tmp_path(in, sizeof in, "prefix-batch.jsonl");
    tmp_path(bout, sizeof bout, "prefix-batch-out.jsonl");
    unlink(bout);
    FILE *f = fopen(in, "w");
    fprintf(f, "{\"custom_id\": \"a\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": %s}\n", body);
    fclose(f);
    snprintf(cmd, sizeof cmd, "%s/moe-batch -m %s -i %s -o %s -t 1 --prefix-cache %s 2>&1", exe_dir, shipped_dir(), in, bout, dir);
    CHECK(run_cmd(cmd, out, sizeof out) == 0);
    snprintf(expect, sizeof expect, "prefix cache: %d prompt tokens taken", story_tokens);
    CHECKF(strstr(out, expect), "%s", out);
    char answer[600];
    CHECK(check_batch_output(bout, "a", answer, sizeof answer) == 1 && !strcmp(answer, want));
    /* every file damaged in its last byte: dropped when used, the prompt computed again, the same answer */
    DIR *d = opendir(dir);
    int damaged = 0;
    for (struct dirent *de; d && (de = readdir(d));) {
        if (!strstr(de->d_name, ".moeprefix")) continue;
        char path[1200];
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        int fd = open(path, O_RDWR);
        struct stat sb;
        unsigned char byte;
        if (fd >= 0 && !fstat(fd, &sb) && pread(fd, &byte, 1, sb.st_size - 9) == 1) {
            byte ^= 0x40;
            damaged += pwrite(fd, &byte, 1, sb.st_size - 9) == 1;
        }
        if (fd >= 0) close(fd);
    }
    if (d) closedir(d);
    CHECK(damaged >= 5);
    snprintf(args, sizeof args, "--parallel 2 --prefix-cache %s --prefix-cache-ram 0 --prefix-cache-size 2M", dir);
    if (!server_start(&s, args)) return;
    chat_body(body, sizeof body, users[0], NULL);
    r = request(s.port, "POST", "/v1/chat/completions", body, NULL);
    CHECK(cached_of(&r, &p, want, sizeof want) == 0 && !strcmp(want, text[0]));
    response_free(&r);
    /* within 2 MiB: the oldest files go */
    for (int i = 0; i < 4; i++) {
        char u[64];
        snprintf(u, sizeof u, "Question number %d?", i);
        chat_body(body, sizeof body, u, NULL);
        r = request(s.port, "POST", "/v1/chat/completions", body, NULL);
        CHECK(r.status == 200);
        response_free(&r);
    }
    r = request(s.port, "GET", "/metrics", NULL, NULL);
    CHECKF(metric(r.body, "moe_prefix_cache_disk_bytes") <= 2 << 20 && metric(r.body, "moe_prefix_cache_disk_bytes") > 0 &&
               metric(r.body, "moe_prefix_cache_evictions_total") >= 1, "%s", r.body);
    response_free(&r);
    CHECK(server_stop(&s));
    snprintf(cmd, sizeof cmd, "du -sb %s | cut -f1", dir);
    CHECK(run_cmd(cmd, out, sizeof out) == 0 && atol(out) <= (2 << 20) + 8192);
}

/* the client tests' packages (test/clients/package-lock.json) installed through npm when they are
 * missing; 0 with a failed check when node or npm is not there */
static int clients_ready(void) {
    char out[4096];
    if (run_cmd("node --version 2>&1", out, sizeof out) != 0 || run_cmd("npm --version 2>&1", out, sizeof out) != 0) {
        CHECKF(0, "node and npm are needed for this test (apt-get install nodejs npm)");
        return 0;
    }
    struct stat sb;
    if (stat("test/clients/node_modules/openai/package.json", &sb) || stat("test/clients/node_modules/puppeteer-core/package.json", &sb)) {
        if (run_cmd("npm ci --prefix test/clients --no-audit --no-fund 2>&1", out, sizeof out) != 0) {
            CHECKF(0, "npm ci --prefix test/clients failed:\n%s", out);
            return 0;
        }
    }
    return 1;
}

/* the official openai package as the client: models, chat whole and streamed, tools,
 * completions, and its error classes for 401 and 400 */
static void test_openai_client(void) {
    if (!clients_ready()) return;
    server_proc s;
    if (!server_start(&s, "--api-key sekrit --parallel 2")) return;
    char cmd[600], out[16384];
    snprintf(cmd, sizeof cmd, "node test/clients/openai-client.mjs http://127.0.0.1:%d sekrit kimi-k3-tiny 2>&1", s.port);
    const int rc = run_cmd(cmd, out, sizeof out);
    CHECKF(rc == 0 && strstr(out, " checks, 0 failed"), "%s", out);
    CHECK(server_stop(&s));
}

/* the chat page in headless Chromium: a message sent, the streamed reply and its tokens/s seen,
 * a screenshot (build/test-logs/chat-page.png); a second reply stopped with the Stop button */
static void test_chat_page(void) {
    const char *chromium = getenv("CHROMIUM") ? getenv("CHROMIUM") : "/usr/bin/chromium";
    if (access(chromium, X_OK)) {
        CHECKF(0, "%s: not found (apt-get install chromium, or set CHROMIUM)", chromium);
        return;
    }
    if (!clients_ready()) return;
    server_proc s;
    if (!server_start(&s, "--parallel 2 -c 16384")) return;
    char dir[600], shot[700], cmd[2000], out[16384];
    snprintf(dir, sizeof dir, "%s/test-logs", exe_dir);
    mkdir(dir, 0755);
    snprintf(shot, sizeof shot, "%s/chat-page.png", dir);
    unlink(shot);
    snprintf(cmd, sizeof cmd, "node test/clients/chat-page.mjs http://127.0.0.1:%d %s %s 2>&1", s.port, shot, chromium);
    const int rc = run_cmd(cmd, out, sizeof out);
    CHECKF(rc == 0 && strstr(out, " checks, 0 failed"), "%s", out);
    struct stat sb;
    unsigned char png[8] = {0};
    FILE *f = fopen(shot, "rb");
    if (f) {
        CHECK(fread(png, 1, 8, f) == 8);
        fclose(f);
    }
    CHECKF(!stat(shot, &sb) && sb.st_size > 5000 && !memcmp(png, "\x89PNG", 4), "%s", shot);
    CHECK(wait_metric(s.port, "moe_requests_running", 0)); /* the stopped reply's sequence is freed */
    response r = request(s.port, "GET", "/metrics", NULL, NULL);
    CHECKF(metric(r.body, "moe_requests_running") == 0 && metric(r.body, "moe_requests_total{endpoint=\"page\"}") == 1, "%s", r.body);
    response_free(&r);
    CHECK(server_stop(&s));
}

/* a reply that calls tools, as the shipped model's format writes it: the choice's tool calls
 * (oai_tool_calls), its whole message (finish_reason "tool_calls") and a stream's delta form
 * with each call's index (oai_tool_calls_delta) */
static void test_tool_call_answers(void) {
    moe_model *m = NULL;
    moe_tokenizer *tok = NULL;
    if (moe_model_open(&m, shipped_dir(), NULL, NULL, 0) || moe_tokenizer_for_model(&tok, m, NULL, 0)) {
        CHECK(0);
        moe_model_close(m);
        return;
    }
    const char *reply = "Need it.<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
                        "<|open|>call tool=\"get_weather\" index=\"1\"<|sep|><|open|>argument key=\"city\" type=\"string\"<|sep|>Paris"
                        "<|close|>argument<|sep|><|close|>call<|sep|><|open|>call tool=\"now\" index=\"2\"<|sep|><|close|>call<|sep|>"
                        "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>";
    int32_t ids[256];
    size_t n = 0;
    CHECK(moe_tokenize(tok, reply, strlen(reply), MOE_TOK_SPECIAL, ids, 256, &n, NULL, 0) == MOE_OK);
    oai_request q = {.chat = 1, .max_tokens = 256, .n = 1, .logprobs = -1, .co = moe_chat_default_options()};
    int32_t prompt[1] = {0};
    q.prompt = prompt, q.n_prompt = 1;
    oai_choice c = {0};
    CHECK(oai_choice_begin(&c, &q, 0, tok));
    for (size_t i = 0; i < n && !c.finish; i++) {
        c.pick = ids[i];
        CHECK(oai_choice_take(&c, m, tok, moe_model_config(m)->eos_token_id));
    }
    CHECKF(c.finish && !strcmp(c.finish, "stop") && c.gen == (int)n, "finish %s after %d of %zu", c.finish ? c.finish : "(none)", c.gen, n);
    char *calls = oai_tool_calls(&c, tok);
    CHECKF(calls && !strcmp(calls, "[{\"id\": \"call_1\", \"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"arguments\": "
                                   "\"{\\\"city\\\": \\\"Paris\\\"}\"}}, {\"id\": \"call_2\", \"type\": \"function\", \"function\": {\"name\": "
                                   "\"now\", \"arguments\": \"{}\"}}]"), "%s", calls ? calls : "(none)");
    buf b = {0};
    oai_choice_json(&b, &c, calls, tok);
    moe__json *j = NULL;
    CHECKF(moe__json_parse(b.s, b.n, &j, NULL, 0) == MOE_OK, "%s", b.s);
    const moe__json *fr = j ? moe__json_get(j, "finish_reason") : NULL, *msg = j ? moe__json_get(j, "message") : NULL;
    const moe__json *tc = msg ? moe__json_get(msg, "tool_calls") : NULL, *ct = msg ? moe__json_get(msg, "content") : NULL;
    CHECK(fr && fr->type == MOE_JSON_STR && !strcmp(fr->str, "tool_calls") && tc && tc->n == 2 && ct && !strcmp(ct->str, ""));
    moe__json_free(j);
    b.n = 0;
    bputs(&b, "{");
    if (calls) oai_tool_calls_delta(&b, calls);
    bputs(&b, "}");
    CHECKF(!strcmp(b.s, "{\"tool_calls\": [{\"index\": 0, \"id\": \"call_1\", \"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
                        "\"arguments\": \"{\\\"city\\\": \\\"Paris\\\"}\"}}, {\"index\": 1, \"id\": \"call_2\", \"type\": \"function\", "
                        "\"function\": {\"name\": \"now\", \"arguments\": \"{}\"}}]}"), "%s", b.s);
    free(b.s), free(calls);
    oai_choice_free(&c);
    moe_tokenizer_free(tok);
    moe_model_close(m);
}

const test_case server_tests[] = {
    {"server.endpoints", test_endpoints, "moe-server's endpoints: health, models, metrics, page, 401/404/405/400 with OpenAI error objects", 0},
    {"server.stream", test_stream, "a streamed answer equals the whole one (chat and completions), with usage and [DONE]; stop strings never show", 0},
    {"server.concurrent", test_concurrent, "16 clients streaming at once through 4 sequences: each answer whole and equal to it run alone", 0},
    {"server.disconnect", test_disconnect, "a client that leaves mid-stream frees its sequence for the queued request; a full queue is 503", 0},
    {"server.prefix_cache", test_prefix_cache, "prefix reuse: repeats, next turns, shared system prompts, restarts, moe-cli and moe-batch; damage; size", 0},
    {"server.tool_calls", test_tool_call_answers, "a reply with tool calls: the choice's calls, its message (finish_reason tool_calls), a stream's deltas", 0},
    {"server.openai_client", test_openai_client, "the official openai npm package as the client: models, chat and completions whole and streamed, tools, errors", 0},
    {"server.chat_page", test_chat_page, "the chat page in headless Chromium: a streamed reply with its tokens/s, a screenshot, Stop", 0},
    {"server.hostile", test_hostile, "malformed, oversized, truncated, slow and too many requests: each its status, the server goes on", 0},
    {NULL, NULL, NULL, 0},
};
