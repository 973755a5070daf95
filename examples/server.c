/* moe-server: an OpenAI-compatible HTTP server.
 *
 *   moe-server -m MODEL [--host 127.0.0.1] [--port 8080] [--parallel N] [-c CTX] [--api-key KEY]
 *
 * Endpoints: POST /v1/chat/completions and POST /v1/completions (the bodies moe-batch takes, with
 * "stream": true answered as server-sent events in OpenAI's chunk format), GET /v1/models,
 * GET /health, GET /metrics (Prometheus text) and a chat page at GET /.
 *
 * Two threads. The network thread owns the sockets: it accepts, reads and parses requests
 * (examples/http.h), answers the small endpoints itself, turns a completion request into a job
 * (examples/openai.h parses its body and tokenizes the prompt) and queues it, and sends what jobs
 * have written. The model thread owns the model: every running job's choices are sequences of
 * one batched moe_step (continuous batching: a new prompt is prefilled, in chunks, beside the
 * others' decoding), and each step's new text is written into its job's output, which the
 * network thread sends. A client that goes away cancels its job; the model thread frees its
 * sequences before the next step. The two meet under one mutex (server.mu): the queue, each job's
 * output and flags, the counters.
 *
 * A slow client holds no thread: each connection has deadlines (a request must arrive whole, and
 * an answer's bytes be taken, within --timeout; an idle keep-alive connection is closed after
 * --idle-timeout), and at most --max-connections are open. Uses the library's internal JSON
 * reader (MOE_INTERNAL). */
#define _POSIX_C_SOURCE 200809L
#define MOE_INTERNAL
#include "../moe.h"
#include "args.h"
#include "cache_flags.h"
#include "http.h"
#include "openai.h"
#include "prefix_cache.h"
#include "chat_html.h" /* build/chat_html.h: examples/chat.html as a C array (made by the Makefile) */

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

static arg_help help = {
    "usage: moe-server -m MODEL [options]\n"
    "  -m MODEL              checkpoint directory, .safetensors file or .gguf (with its tokenizer)\n"
    "  --host ADDR           address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)\n"
    "  --port N              port (default 8080; 0: any free port, printed when listening)\n"
    "  --parallel N          sequences decoded at once: requests, or choices of requests with n > 1 (default 4)\n"
    "  -c CTX                context per sequence: prompt + max_tokens must fit (default 4096)\n"
    "  --api-key KEY         require \"Authorization: Bearer KEY\" on every endpoint but /health and the page\n"
    "  --model-name S        the model's id in answers and /v1/models (default: the model path's last part)\n"
    "  --max-tokens N        for requests without max_tokens (default: what is left of the context)\n"
    "  --queue N             requests waiting for a sequence before new ones get 503 (default 64)\n"
    "  --prefill-chunk N     prompt tokens of one request per step, so that others keep decoding (default 512)\n"
    "  --timeout S           seconds a request may take to arrive, and an answer's bytes to be taken (default 600)\n"
    "  --idle-timeout S      seconds an idle keep-alive connection stays open (default 30)\n"
    "  --max-connections N   open connections at most; more are answered 503 (default 256)\n"
    "  --max-body SIZE       largest request body (default 32M)\n"
    "  --prefix-cache-ram SIZE  RAM for computed prompt prefixes that later prompts reuse (default 1G; 0: none)\n"
    "  --prefix-cache DIR    keep them in DIR too, for restarts and other programs given the same DIR\n"
    "  --prefix-cache-size SIZE  disk for them in DIR; least recently used files go first (default 20G)\n"
    "  -t THREADS            worker threads (default: the physical cores)\n"
    "  --load-mode M, --expert-budget SIZE, --dense TYPE, --dense-budget SIZE, --io-threads N, --prefetch on|off,\n"
    "  --kv-type f32|bf16|q8, --mxfp4 f32|int8, --act 8|16,\n"
    "  --kernels NAME, --check-tensors  as in moe-cli\n", NULL};

static int usage(const char *msg) { return arg_usage("moe-server", help, msg); }

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

enum { MAX_HEADER = 64 * 1024 };

typedef struct {
    const char *model, *host, *api_key, *model_name, *prefix_dir;
    size_t prefix_size, prefix_ram;
    int port, parallel, ctx, default_max, queue, prefill_chunk, max_conns;
    double timeout, idle_timeout;
    size_t max_body;
    moe_options opt;
} options;

/* ---- jobs: one completion request, shared by the two threads ---- */

typedef struct job job;
struct job {
    /* under server.mu */
    int refs;      /* the connection's and the model thread's */
    int cancelled; /* the client went away: the model thread drops it */
    int done;      /* the whole answer is in out */
    buf out;       /* the answer's bytes not yet taken by the network thread */
    job *next;     /* in the queue */
    /* set before it is queued */
    oai_request q;
    int keep_alive;
    uint64_t serial; /* this job's number: a freed job's address may be a new job's */
    char id[48];
    long created;
    /* the model thread's */
    int started;  /* its stream's head is written (an error then goes as an event) */
    int finished, gen_total, cached; /* choices done, their tokens, prompt tokens not computed */
    int failed;
    buf *choices; /* non-streaming: each finished choice's JSON */
};

/* ---- what both threads see ---- */

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;   /* the model thread waits here for work */
    job *queue, *queue_tail;
    int queued, running; /* jobs waiting, jobs with sequences */
    int stopping;
    int wake[2];         /* the model thread (and the signal handler) wake the network thread */
    /* counters for /metrics */
    uint64_t requests[6]; /* by route: chat, completions, models, health, metrics, page */
    uint64_t prompt_tokens, gen_tokens, cached_tokens, steps;
    double step_seconds;
    uint64_t cache_hits, cache_misses, bytes_read;
    prefix_cache pc; /* a copy of the model thread's prefix cache's counters (its pointers not used) */
    double started;
    const char *model_name;
    options o;
    moe_model *m;
    const moe_config *c;
    moe_tokenizer *tok;
} server = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER, .wake = {-1, -1}};

static void wake_net(void) {
    const char b = 1;
    if (write(server.wake[1], &b, 1) < 0) { /* full pipe: a wake-up is already pending */ }
}

/* under server.mu: the job freed when its last holder lets go */
static void job_release(job *j) {
    if (--j->refs > 0) return;
    for (int i = 0; j->choices && i < j->q.n; i++) free(j->choices[i].s);
    free(j->choices);
    free(j->out.s);
    oai_request_free(&j->q);
    free(j);
}

static const char *status_text(int s) {
    switch (s) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 413: return "Content Too Large";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Error";
    }
}

/* responses sent by status code (counted by both threads, so atomically: the model thread answers
 * while it holds server.mu) */
static const int counted_status[] = {200, 400, 401, 404, 405, 408, 413, 431, 500, 501, 503, 505};
#define N_COUNTED (sizeof counted_status / sizeof *counted_status)
static atomic_ullong responses[N_COUNTED + 1];

static void count_status(int status) {
    size_t i = 0;
    while (i < N_COUNTED && counted_status[i] != status) i++;
    atomic_fetch_add(&responses[i], 1);
}

/* a status line and headers; len < 0: a chunked body (server-sent events) */
static void http_head(buf *b, int status, const char *ctype, long long len, int keep_alive, const char *extra) {
    bprintf(b, "HTTP/1.1 %d %s\r\nContent-Type: %s\r\n", status, status_text(status), ctype);
    if (len >= 0) bprintf(b, "Content-Length: %lld\r\n", len);
    else bputs(b, "Transfer-Encoding: chunked\r\nCache-Control: no-cache\r\n");
    bputs(b, keep_alive ? "Connection: keep-alive\r\n" : "Connection: close\r\n");
    if (extra) bputs(b, extra);
    bputs(b, "\r\n");
}

static int http_answer(buf *b, int status, const char *ctype, const char *body, size_t n, int keep_alive, const char *extra) {
    http_head(b, status, ctype, (long long)n, keep_alive, extra);
    bput(b, body, n);
    count_status(status);
    return 0;
}

/* an OpenAI error object: {"error": {"message", "type", "param", "code"}} */
static int http_error(buf *b, int status, const char *msg, int keep_alive, const char *extra) {
    const char *type = status == 401 ? "authentication_error" : status == 404 ? "not_found_error" : status == 503 ? "server_busy"
                     : status >= 500 ? "server_error" : "invalid_request_error";
    buf body = {0};
    bputs(&body, "{\"error\": {\"message\": ");
    bjson_str(&body, msg, strlen(msg));
    bprintf(&body, ", \"type\": \"%s\", \"param\": null, \"code\": %d}}\n", type, status);
    http_answer(b, status, "application/json", body.s ? body.s : "", body.n, keep_alive, extra);
    free(body.s);
    return 0;
}

/* ---- the model thread: slots, steps, answers ---- */

typedef struct {
    job *j;             /* NULL: free */
    oai_choice c;
    moe_session *s;
    int fed;            /* prompt tokens in the session */
    int leader;         /* -1: computes its job's prompt; else the slot that does (its state taken when that one is done) */
    int ready;          /* logits to sample from are in lrow */
    const float *lrow;
    size_t shown, shown_r; /* content and reasoning bytes streamed */
    int lp_sent;        /* tokens whose log probabilities were streamed */
    int fresh;          /* given a job since the last step: its prompt's cached prefix not yet looked up */
    int stop_at;        /* a prefill stops here first to keep a snapshot (pc_branch_point), or 0 */
    int wait_for, wait_at; /* -1, or: the slot computing the first wait_at tokens of this prompt too
                              (prompts started together that share a prefix compute it once) */
    uint64_t wait_serial;  /* the serial of the job that slot held when this one began to wait */
    float *own;         /* [vocab] logits of a prompt found whole in the prefix cache */
} slot;

static prefix_cache pc;

static slot *slots;
static float *step_logits; /* [parallel, vocab] */
static moe_seq *seqs;

/* server-sent event data as one HTTP chunk into out */
static void sse(buf *out, const buf *data) {
    bprintf(out, "%zx\r\ndata: ", data->n + 8);
    bput(out, data->s, data->n);
    bputs(out, "\n\n\r\n");
}

/* the head of a streamed chunk object: {"id", "object", "created", "model", "choices": [ */
static void chunk_head(buf *b, const job *j) {
    bprintf(b, "{\"id\": \"%s\", \"object\": \"%s\", \"created\": %ld, \"model\": ", j->id, j->q.chat ? "chat.completion.chunk" : "text_completion",
            j->created);
    bjson_str(b, server.model_name, strlen(server.model_name));
    bputs(b, ", \"choices\": [");
}

static void usage_json(buf *b, const job *j) {
    bprintf(b, "{\"prompt_tokens\": %d, \"completion_tokens\": %d, \"total_tokens\": %d, \"prompt_tokens_details\": {\"cached_tokens\": %d}}",
            j->q.n_prompt, j->gen_total, j->q.n_prompt + j->gen_total, j->cached);
}

/* Streams what slot sl's choice has that the client has not seen: text ready to show (held back:
 * a possible stop string's beginning, a partial UTF-8 character), the log probabilities of the
 * tokens behind it, and when the choice is done its tool calls and finish_reason. Into out. */
static void stream_choice(buf *out, slot *sl, const char *tool_calls) {
    oai_choice *c = &sl->c;
    const job *j = sl->j;
    const int final = c->finish != NULL;
    int stopped = 0;
    size_t ready = c->content.n - sl->shown, ready_r = c->reasoning.n - sl->shown_r;
    ready = moe_text_ready(c->content.s + sl->shown, ready, (const char *const *)j->q.stop, j->q.n_stop, final, &stopped);
    ready_r = moe_text_ready(c->reasoning.s + sl->shown_r, ready_r, NULL, 0, final, &stopped);
    const int first = sl->shown == 0 && sl->shown_r == 0 && sl->lp_sent == 0;
    if (!ready && !ready_r && !final && !(first && j->q.chat)) return;
    buf b = {0};
    chunk_head(&b, j);
    bprintf(&b, "{\"index\": %d, ", c->index);
    if (j->q.chat) {
        /* OpenAI's deltas: the role in the first, then only the fields with something new */
        const char *sep = "";
        bputs(&b, "\"delta\": {");
        if (first) bputs(&b, "\"role\": \"assistant\""), sep = ", ";
        if (ready || (first && !ready_r)) {
            bprintf(&b, "%s\"content\": ", sep), sep = ", ";
            bjson_str(&b, c->content.s ? c->content.s + sl->shown : "", ready);
        }
        if (ready_r) {
            bprintf(&b, "%s\"reasoning_content\": ", sep), sep = ", ";
            bjson_str(&b, c->reasoning.s + sl->shown_r, ready_r);
        }
        if (tool_calls) bputs(&b, sep), oai_tool_calls_delta(&b, tool_calls);
        bputs(&b, "}, ");
    } else {
        bputs(&b, "\"text\": ");
        bjson_str(&b, c->content.s ? c->content.s + sl->shown : "", ready);
        bputs(&b, ", ");
    }
    bputs(&b, "\"logprobs\": ");
    oai_logprobs_json(&b, c, sl->lp_sent, c->gen, server.tok);
    if (final) bprintf(&b, ", \"finish_reason\": \"%s\"}]", tool_calls ? "tool_calls" : c->finish);
    else bputs(&b, ", \"finish_reason\": null}]");
    if (j->q.include_usage) bputs(&b, ", \"usage\": null");
    bputs(&b, "}");
    sl->shown += ready, sl->shown_r += ready_r, sl->lp_sent = c->gen;
    sse(out, &b);
    free(b.s);
}

/* the end of a stream: the usage chunk when asked for, [DONE] and the last HTTP chunk */
static void stream_end(buf *out, const job *j) {
    if (j->q.include_usage) {
        buf b = {0};
        chunk_head(&b, j);
        bputs(&b, "], \"usage\": ");
        usage_json(&b, j);
        bputs(&b, "}");
        sse(out, &b);
        free(b.s);
    }
    buf d = {0};
    bputs(&d, "[DONE]");
    sse(out, &d);
    free(d.s);
    bputs(out, "0\r\n\r\n");
}

/* the whole non-streamed answer */
static void answer_whole(buf *out, job *j) {
    buf b = {0};
    bprintf(&b, "{\"id\": \"%s\", \"object\": \"%s\", \"created\": %ld, \"model\": ", j->id, j->q.chat ? "chat.completion" : "text_completion",
            j->created);
    bjson_str(&b, server.model_name, strlen(server.model_name));
    bputs(&b, ", \"choices\": [");
    for (int i = 0; i < j->q.n; i++) {
        if (i) bputs(&b, ", ");
        bput(&b, j->choices[i].s, j->choices[i].n);
    }
    bputs(&b, "], \"usage\": ");
    usage_json(&b, j);
    bputs(&b, "}\n");
    http_answer(out, 200, "application/json", b.s, b.n, j->keep_alive, NULL);
    free(b.s);
}

/* under server.mu: the job's output is complete; the model thread lets go of it */
static void job_done(job *j) {
    j->done = 1;
    server.running--;
    job_release(j);
}

/* under server.mu: a job ends with an error (before any streamed byte: an error answer; in a
 * stream: an error event, then its end) */
static void job_fail(job *j, int status, const char *msg) {
    if (j->q.stream && j->started) {
        buf b = {0};
        bputs(&b, "{\"error\": {\"message\": ");
        bjson_str(&b, msg, strlen(msg));
        bputs(&b, ", \"type\": \"server_error\"}}");
        sse(&j->out, &b);
        free(b.s);
        buf d = {0};
        bputs(&d, "[DONE]");
        sse(&j->out, &d);
        free(d.s);
        bputs(&j->out, "0\r\n\r\n");
    } else {
        http_error(&j->out, status, msg, j->keep_alive, NULL);
    }
}

/* under server.mu: a queued job given its slots, one per choice (the model thread's alone: the
 * network thread never reads them); the first choice computes the prompt, the others take its
 * state. 0 out of memory. */
static int start_job(job *j) {
    int k = 0;
    if (!(j->choices = calloc((size_t)j->q.n, sizeof *j->choices))) return 0;
    int lead = -1;
    for (int i = 0; i < server.o.parallel && k < j->q.n; i++) {
        slot *sl = &slots[i];
        if (sl->j) continue;
        if (!oai_choice_begin(&sl->c, &j->q, k++, server.tok)) return 0;
        sl->j = j, sl->fed = 0, sl->ready = 0, sl->shown = sl->shown_r = 0, sl->lp_sent = 0;
        sl->leader = lead, sl->fresh = lead < 0, sl->stop_at = 0, sl->wait_for = -1;
        if (lead < 0) lead = i;
        moe_session_reset(sl->s);
    }
    return 1;
}

/* the slots of job j freed (its choices are done, or it failed or was cancelled) */
static void free_slots_of(const job *j) {
    for (int i = 0; i < server.o.parallel; i++)
        if (slots[i].j == j) slots[i].j = NULL;
}

/* under server.mu: the slots of cancelled jobs freed; queued jobs moved into free slots while they
 * fit (cancelled ones dropped) */
static void admit_jobs(void) {
    for (int i = 0; i < server.o.parallel; i++)
        if (slots[i].j && slots[i].j->cancelled) {
            job *j = slots[i].j;
            free_slots_of(j);
            job_done(j);
        }
    int free_n = 0;
    for (int i = 0; i < server.o.parallel; i++) free_n += !slots[i].j;
    while (server.queue && server.queue->q.n <= free_n) {
        job *j = server.queue;
        server.queue = j->next;
        if (!server.queue) server.queue_tail = NULL;
        server.queued--;
        j->next = NULL;
        if (j->cancelled) {
            job_release(j);
            continue;
        }
        server.running++;
        if (!start_job(j)) {
            free_slots_of(j);
            job_fail(j, 500, "out of memory");
            job_done(j);
            continue;
        }
        free_n -= j->q.n;
    }
}

/* A step over every running sequence: a chunk of each prompt being prefilled, the last token of
 * each decoding one. 0, or -1 after a failed step (its jobs answered with the error). */
static int step(void) {
    const size_t V = (size_t)server.c->vocab_size;
    int ns = 0, prompt = 0;
    for (int i = 0; i < server.o.parallel; i++) {
        slot *sl = &slots[i];
        if (!sl->j || sl->leader >= 0 || sl->ready || sl->wait_for >= 0) continue;
        const oai_request *q = &sl->j->q;
        moe_seq *sq = &seqs[ns];
        memset(sq, 0, sizeof *sq);
        sq->s = sl->s;
        sq->logits = step_logits + (size_t)ns++ * V;
        sl->lrow = sq->logits;
        if (sl->fed < q->n_prompt) {
            int end = sl->stop_at > sl->fed ? sl->stop_at : q->n_prompt;
            for (int w = 0; w < server.o.parallel; w++) /* where a prompt waiting for this one takes its state */
                if (slots[w].j && slots[w].wait_for == i && slots[w].wait_at > sl->fed && slots[w].wait_at < end) end = slots[w].wait_at;
            const int left = end - sl->fed;
            sq->tokens = q->prompt + sl->fed, sq->n = left < server.o.prefill_chunk ? left : server.o.prefill_chunk;
            prompt += sq->n;
        } else {
            sq->tokens = &sl->c.pick, sq->n = 1;
        }
    }
    char err[512];
    moe_step_stats st = {0};
    const moe_status rc = ns ? moe_step(server.m, seqs, ns, &st, err, sizeof err) : MOE_OK;
    pthread_mutex_lock(&server.mu);
    server.steps++, server.step_seconds += st.seconds, server.prompt_tokens += (uint64_t)prompt;
    server.cache_hits += st.cache_hits, server.cache_misses += st.cache_misses, server.bytes_read += st.bytes_read;
    pthread_mutex_unlock(&server.mu);
    for (int k = 0; k < ns; k++) { /* which sequences advanced, and which failed */
        for (int i = 0; i < server.o.parallel; i++) {
            slot *sl = &slots[i];
            if (!sl->j || sl->s != seqs[k].s) continue;
            if (rc && rc != MOE_ERR_NUMERIC) sl->j->failed = 1;
            else if (seqs[k].nonfinite) sl->j->failed = 2;
            else if (sl->fed < sl->j->q.n_prompt) {
                const oai_request *q = &sl->j->q;
                sl->fed += seqs[k].n, sl->ready = sl->fed == q->n_prompt;
                if (sl->stop_at && sl->fed == sl->stop_at) pc_insert(&pc, q->prompt, sl->fed, sl->s, NULL), sl->stop_at = 0;
                if (sl->ready) pc_insert(&pc, q->prompt, q->n_prompt, sl->s, sl->lrow);
            } else {
                sl->ready = 1;
            }
        }
    }
    if (rc && rc != MOE_ERR_NUMERIC) fprintf(stderr, "moe-server: %s\n", err);
    for (int i = 0; i < server.o.parallel; i++) { /* prompts waiting for a shared prefix take it once it is computed */
        slot *sl = &slots[i];
        if (!sl->j || sl->wait_for < 0) continue;
        const slot *from = &slots[sl->wait_for];
        if (!from->j || from->j->serial != sl->wait_serial || from->j->failed || from->fed > sl->wait_at) {
            sl->wait_for = -1; /* it went away, or took a longer prefix from elsewhere: compute the prompt alone */
            continue;
        }
        if (from->fed != sl->wait_at) continue;
        if (moe_session_restore(sl->s, from->s, err, sizeof err)) {
            sl->wait_for = -1;
            continue;
        }
        sl->j->cached += sl->wait_at - sl->fed;
        sl->fed = sl->wait_at, sl->wait_for = -1;
    }
    for (int i = 0; i < server.o.parallel; i++) { /* the other choices of a job take its prompt from its first */
        slot *sl = &slots[i];
        if (!sl->j || sl->leader < 0 || !slots[sl->leader].ready || slots[sl->leader].c.gen) continue;
        if (moe_session_restore(sl->s, slots[sl->leader].s, err, sizeof err)) {
            sl->j->failed = 1;
            continue;
        }
        sl->fed = sl->j->q.n_prompt, sl->lrow = slots[sl->leader].lrow, sl->ready = 1, sl->leader = -1;
    }
    return 0;
}

/* the sequences with logits sample side by side (each choice has its own generator) */
static void sample_ready(void) {
    const int V = server.c->vocab_size, nt = server.o.opt.n_threads;
    (void)nt;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1)
#endif
    for (int i = 0; i < server.o.parallel; i++) {
        slot *sl = &slots[i];
        if (sl->j && sl->ready && !sl->j->failed) oai_choice_sample(&sl->c, sl->lrow, V);
    }
}

/* Each sampled token taken into its choice, what is new written to its job; finished jobs
 * answered. Cancelled and failed jobs dropped. */
static void advance(void) {
    uint64_t gen = 0;
    pthread_mutex_lock(&server.mu);
    for (int i = 0; i < server.o.parallel; i++) {
        slot *sl = &slots[i];
        job *j = sl->j;
        if (!j) continue;
        if (j->cancelled || j->failed) {
            const int failed = j->failed;
            free_slots_of(j);
            if (!j->cancelled)
                job_fail(j, 500, failed == 2 ? "the model's logits held a NaN or an infinity (a non-finite weight or activation)"
                                             : "the step failed (see the server's log)");
            job_done(j);
            continue;
        }
        if (!sl->ready) continue;
        sl->ready = 0;
        if (!oai_choice_take(&sl->c, server.m, server.tok, server.c->eos_token_id)) {
            free_slots_of(j);
            job_fail(j, 500, "out of memory");
            job_done(j);
            continue;
        }
        gen++;
        oai_choice *c = &sl->c;
        char *calls = c->finish ? oai_tool_calls(c, server.tok) : NULL;
        if (j->q.stream) {
            if (!j->started) http_head(&j->out, 200, "text/event-stream", -1, j->keep_alive, NULL), count_status(200);
            j->started = 1;
            stream_choice(&j->out, sl, calls);
        } else if (c->finish) {
            oai_choice_json(&j->choices[c->index], c, calls, server.tok);
        }
        free(calls);
        if (!c->finish) continue;
        j->finished++, j->gen_total += c->gen;
        sl->j = NULL;
        if (j->finished < j->q.n) continue;
        if (j->q.stream) stream_end(&j->out, j);
        else answer_whole(&j->out, j);
        job_done(j);
    }
    server.gen_tokens += gen;
    server.pc = pc;
    pthread_mutex_unlock(&server.mu);
    wake_net();
}

/* The newly started jobs' prompts: the longest prefix the cache holds restored into the first
 * choice's session (a whole prompt: its logits too, and nothing to compute); where the prompt
 * shares more with another cached prompt, its prefill stops there first to keep a snapshot. */
static void restore_prefixes(void) {
    int reused = 0;
    for (int i = 0; i < server.o.parallel; i++) {
        slot *sl = &slots[i];
        if (!sl->j || !sl->fresh) continue;
        sl->fresh = 0;
        const oai_request *q = &sl->j->q;
        const int have = pc_lookup(&pc, q->prompt, q->n_prompt, sl->s, sl->own);
        if (have == q->n_prompt) sl->lrow = sl->own, sl->ready = 1;
        sl->fed = have, sl->j->cached = have, reused += have;
        sl->stop_at = pc_branch_point(&pc, q->prompt, q->n_prompt, have);
        /* a prompt started with it that shares more than 32 tokens beyond what either has: its
         * prefill computes them, and this one takes its state there */
        int best = 0, from = -1;
        for (int k = 0; k < i; k++) {
            const slot *o = &slots[k];
            if (!o->j || o->leader >= 0 || o->ready || o->j == sl->j) continue;
            const oai_request *oq = &o->j->q;
            int n = 0;
            const int lim = (q->n_prompt - 1 < oq->n_prompt ? q->n_prompt - 1 : oq->n_prompt);
            while (n < lim && q->prompt[n] == oq->prompt[n]) n++;
            if (n > best && n > have + 32 && n > o->fed) best = n, from = k;
        }
        if (from >= 0) sl->wait_for = from, sl->wait_at = best, sl->wait_serial = slots[from].j->serial;
    }
    pthread_mutex_lock(&server.mu);
    server.cached_tokens += (uint64_t)reused;
    pthread_mutex_unlock(&server.mu);
}

static void *model_thread(void *arg) {
    (void)arg;
    for (;;) {
        pthread_mutex_lock(&server.mu);
        int busy = 0;
        for (int i = 0; i < server.o.parallel; i++) busy += slots[i].j != NULL;
        while (!server.stopping && !busy && !server.queue) pthread_cond_wait(&server.cv, &server.mu);
        if (server.stopping) {
            pthread_mutex_unlock(&server.mu);
            return NULL;
        }
        admit_jobs();
        pthread_mutex_unlock(&server.mu);
        restore_prefixes();
        step();
        sample_ready();
        advance();
    }
}

/* ---- the network thread ---- */

typedef struct {
    int fd;
    char *in;
    size_t in_n, in_cap;
    buf out;
    size_t out_off;
    job *j;            /* the request in flight */
    double since;      /* the first byte of the request being read, or the last activity */
    double out_since;  /* when out last had bytes taken, or became non-empty */
    int close_after;   /* close once out is sent */
    int eof;           /* the client has closed its side: what it sent whole is answered, a job in
                          flight is cancelled (a client keeps its side open until it has its answer) */
    int continued;     /* 100 Continue sent for the request being read */
} conn;

static conn *conns;
static int n_conns;

static void conn_close(conn *c) {
    if (c->j) {
        pthread_mutex_lock(&server.mu);
        c->j->cancelled = 1;
        job_release(c->j);
        pthread_cond_signal(&server.cv);
        pthread_mutex_unlock(&server.mu);
    }
    close(c->fd);
    free(c->in), free(c->out.s);
    *c = conns[--n_conns];
}

/* constant-time comparison of the Authorization header with "Bearer KEY" */
static int authorized(const http_request *rq) {
    if (!server.o.api_key) return 1;
    size_t n = 0;
    const char *v = http_get(rq, "authorization", &n);
    const size_t kl = strlen(server.o.api_key);
    if (!v || n != kl + 7) return 0;
    unsigned diff = 0;
    for (size_t i = 0; i < 7; i++) diff |= (unsigned)(http_lower((unsigned char)v[i]) ^ http_lower((unsigned char)"bearer "[i]));
    for (size_t i = 0; i < kl; i++) diff |= (unsigned)((unsigned char)v[7 + i] ^ (unsigned char)server.o.api_key[i]);
    return diff == 0;
}

static int target_is(const http_request *rq, const char *path) {
    size_t n = rq->target_len;
    const char *q = memchr(rq->target, '?', n);
    if (q) n = (size_t)(q - rq->target);
    return n == strlen(path) && !memcmp(rq->target, path, n);
}

static int metrics(buf *out, int keep_alive) {
    buf b = {0};
    pthread_mutex_lock(&server.mu);
    const char *routes[] = {"chat_completions", "completions", "models", "health", "metrics", "page"};
    bputs(&b, "# HELP moe_requests_total Requests received, by endpoint.\n# TYPE moe_requests_total counter\n");
    for (int i = 0; i < 6; i++) bprintf(&b, "moe_requests_total{endpoint=\"%s\"} %llu\n", routes[i], (unsigned long long)server.requests[i]);
    bputs(&b, "# HELP moe_responses_total Responses sent, by status code.\n# TYPE moe_responses_total counter\n");
    for (size_t i = 0; i < N_COUNTED; i++)
        bprintf(&b, "moe_responses_total{code=\"%d\"} %llu\n", counted_status[i], (unsigned long long)atomic_load(&responses[i]));
    bprintf(&b, "# HELP moe_prompt_tokens_total Prompt tokens computed.\n# TYPE moe_prompt_tokens_total counter\nmoe_prompt_tokens_total %llu\n",
            (unsigned long long)server.prompt_tokens);
    bprintf(&b, "# HELP moe_prompt_tokens_cached_total Prompt tokens taken from the prefix cache.\n# TYPE moe_prompt_tokens_cached_total counter\n"
                "moe_prompt_tokens_cached_total %llu\n", (unsigned long long)server.cached_tokens);
    bprintf(&b, "# HELP moe_tokens_generated_total Tokens generated.\n# TYPE moe_tokens_generated_total counter\nmoe_tokens_generated_total %llu\n",
            (unsigned long long)server.gen_tokens);
    bprintf(&b, "# HELP moe_steps_total Batched forward steps.\n# TYPE moe_steps_total counter\nmoe_steps_total %llu\n",
            (unsigned long long)server.steps);
    bprintf(&b, "# HELP moe_step_seconds_total Time spent in forward steps.\n# TYPE moe_step_seconds_total counter\nmoe_step_seconds_total %.6f\n",
            server.step_seconds);
    bprintf(&b, "# HELP moe_tokens_per_second Tokens generated per second of stepping.\n# TYPE moe_tokens_per_second gauge\nmoe_tokens_per_second %.3f\n",
            server.step_seconds > 0 ? (double)server.gen_tokens / server.step_seconds : 0.0);
    bprintf(&b, "# HELP moe_requests_queued Requests waiting for a sequence.\n# TYPE moe_requests_queued gauge\nmoe_requests_queued %d\n", server.queued);
    bprintf(&b, "# HELP moe_requests_running Requests being decoded.\n# TYPE moe_requests_running gauge\nmoe_requests_running %d\n", server.running);
    bprintf(&b, "# HELP moe_expert_cache_hits_total Routed experts found resident (cache mode).\n# TYPE moe_expert_cache_hits_total counter\n"
                "moe_expert_cache_hits_total %llu\n", (unsigned long long)server.cache_hits);
    bprintf(&b, "# HELP moe_expert_cache_misses_total Routed experts read from disk (cache mode).\n# TYPE moe_expert_cache_misses_total counter\n"
                "moe_expert_cache_misses_total %llu\n", (unsigned long long)server.cache_misses);
    bprintf(&b, "# HELP moe_bytes_read_total Bytes read from the model's files by the expert cache.\n# TYPE moe_bytes_read_total counter\n"
                "moe_bytes_read_total %llu\n", (unsigned long long)server.bytes_read);
    bprintf(&b, "# HELP moe_prefix_cache_hits_total Prompts that began with a cached prefix.\n# TYPE moe_prefix_cache_hits_total counter\n"
                "moe_prefix_cache_hits_total %llu\n", (unsigned long long)server.pc.hits);
    bprintf(&b, "# HELP moe_prefix_cache_lookups_total Prompts looked up in the prefix cache.\n# TYPE moe_prefix_cache_lookups_total counter\n"
                "moe_prefix_cache_lookups_total %llu\n", (unsigned long long)server.pc.lookups);
    bprintf(&b, "# HELP moe_prefix_cache_entries Prefixes kept.\n# TYPE moe_prefix_cache_entries gauge\nmoe_prefix_cache_entries %d\n", server.pc.n);
    bprintf(&b, "# HELP moe_prefix_cache_ram_bytes RAM the kept prefixes take.\n# TYPE moe_prefix_cache_ram_bytes gauge\nmoe_prefix_cache_ram_bytes %zu\n",
            server.pc.ram_used);
    bprintf(&b, "# HELP moe_prefix_cache_disk_bytes Bytes of prefix files in --prefix-cache DIR.\n# TYPE moe_prefix_cache_disk_bytes gauge\n"
                "moe_prefix_cache_disk_bytes %zu\n", server.pc.disk_used);
    bprintf(&b, "# HELP moe_prefix_cache_evictions_total Prefixes evicted from RAM or disk.\n# TYPE moe_prefix_cache_evictions_total counter\n"
                "moe_prefix_cache_evictions_total %llu\n", (unsigned long long)server.pc.evicted);
    bprintf(&b, "# HELP moe_prefix_cache_write_errors_total Prefix files that could not be written.\n# TYPE moe_prefix_cache_write_errors_total counter\n"
                "moe_prefix_cache_write_errors_total %llu\n", (unsigned long long)server.pc.write_errors);
    bprintf(&b, "# HELP moe_uptime_seconds Seconds since the server started.\n# TYPE moe_uptime_seconds gauge\nmoe_uptime_seconds %.3f\n",
            now() - server.started);
    pthread_mutex_unlock(&server.mu);
    http_answer(out, 200, "text/plain; version=0.0.4; charset=utf-8", b.s ? b.s : "", b.n, keep_alive, NULL);
    free(b.s);
    return 0;
}

static int models(buf *out, int keep_alive) {
    buf b = {0};
    bputs(&b, "{\"object\": \"list\", \"data\": [{\"id\": ");
    bjson_str(&b, server.model_name, strlen(server.model_name));
    bprintf(&b, ", \"object\": \"model\", \"created\": %ld, \"owned_by\": \"moe\", \"meta\": {\"n_ctx\": %d, \"n_vocab\": %d, \"n_parallel\": %d}}]}\n",
            (long)time(NULL), server.o.ctx, server.c->vocab_size, server.o.parallel);
    http_answer(out, 200, "application/json", b.s, b.n, keep_alive, NULL);
    free(b.s);
    return 0;
}

static uint64_t next_seed(void) {
    static uint64_t k;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return oai_choice_rng((uint64_t)ts.tv_sec * 1000000007ull ^ (uint64_t)ts.tv_nsec, (int)(++k & 0x7fffffff)) | 1;
}

/* a completion request: parsed into a job and queued, or answered with an error now */
static int completion(conn *c, const http_request *rq, int chat) {
    char why[600] = "";
    const int ka = rq->keep_alive;
    if (moe_utf8_valid_prefix(rq->body, rq->body_len) != rq->body_len) return http_error(&c->out, 400, "the body is not valid UTF-8", ka, NULL);
    size_t values = oai_count_json_values(rq->body, rq->body_len);
    if (values > (size_t)server.o.ctx + 65536) {
        snprintf(why, sizeof why, "the body holds %zu JSON values: more than any request that fits the context of %d tokens", values, server.o.ctx);
        return http_error(&c->out, 400, why, ka, NULL);
    }
    moe__json *body = NULL;
    if (moe__json_parse(rq->body, rq->body_len, &body, why, sizeof why) != MOE_OK) {
        char msg[700];
        snprintf(msg, sizeof msg, "the body is not JSON: %s", why);
        return http_error(&c->out, 400, msg, ka, NULL);
    }
    job *j = calloc(1, sizeof *j);
    if (!j) {
        moe__json_free(body);
        return http_error(&c->out, 500, "out of memory", ka, NULL);
    }
    /* without max_tokens: --max-tokens, else what is left of the context (at least one token) */
    int ok = oai_parse_body(&j->q, body, chat, server.tok, server.c->vocab_size, server.o.ctx, server.o.default_max ? server.o.default_max : 1,
                            next_seed(), why, sizeof why);
    if (ok && !server.o.default_max && !moe__json_get(body, "max_tokens") && !moe__json_get(body, "max_completion_tokens"))
        j->q.max_tokens = server.o.ctx - j->q.n_prompt;
    moe__json_free(body);
    if (ok && j->q.n > server.o.parallel) {
        snprintf(why, sizeof why, "n (%d) is more than the sequences this server decodes at once (--parallel %d)", j->q.n, server.o.parallel);
        ok = 0;
    }
    if (!ok) {
        oai_request_free(&j->q);
        free(j);
        return http_error(&c->out, 400, why, ka, NULL);
    }
    j->keep_alive = ka;
    j->created = (long)time(NULL);
    snprintf(j->id, sizeof j->id, "%s-%016llx", chat ? "chatcmpl" : "cmpl", (unsigned long long)next_seed());
    pthread_mutex_lock(&server.mu);
    if (server.queued >= server.o.queue) {
        pthread_mutex_unlock(&server.mu);
        oai_request_free(&j->q);
        free(j);
        return http_error(&c->out, 503, "the server is busy: too many requests are waiting; retry later", ka, "Retry-After: 1\r\n");
    }
    static uint64_t serial;
    j->serial = ++serial;
    j->refs = 2;
    if (server.queue_tail) server.queue_tail->next = j;
    else server.queue = j;
    server.queue_tail = j;
    server.queued++;
    pthread_cond_signal(&server.cv);
    pthread_mutex_unlock(&server.mu);
    c->j = j;
    return 0;
}

/* One whole request: routed and answered, or made a job. */
static int handle(conn *c, const http_request *rq) {
    const int ka = rq->keep_alive;
    const int get = rq->method_len == 3 && !memcmp(rq->method, "GET", 3);
    const int post = rq->method_len == 4 && !memcmp(rq->method, "POST", 4);
    static const struct { const char *path; int post; int route; } routes[] = {
        {"/v1/chat/completions", 1, 0}, {"/chat/completions", 1, 0}, {"/v1/completions", 1, 1}, {"/completions", 1, 1},
        {"/v1/models", 0, 2}, {"/models", 0, 2}, {"/health", 0, 3}, {"/metrics", 0, 4}, {"/", 0, 5}, {"/index.html", 0, 5}};
    int r = -1;
    for (size_t i = 0; i < sizeof routes / sizeof *routes && r < 0; i++)
        if (target_is(rq, routes[i].path)) r = (int)i;
    if (r < 0) {
        char msg[300];
        snprintf(msg, sizeof msg, "no such endpoint: %.*s %.*s", (int)(rq->method_len < 16 ? rq->method_len : 16), rq->method,
                 (int)(rq->target_len < 200 ? rq->target_len : 200), rq->target);
        return http_error(&c->out, 404, msg, ka, NULL);
    }
    if (routes[r].post ? !post : !get) {
        char msg[200];
        snprintf(msg, sizeof msg, "%s takes %s", routes[r].path, routes[r].post ? "POST" : "GET");
        return http_error(&c->out, 405, msg, ka, routes[r].post ? "Allow: POST\r\n" : "Allow: GET\r\n");
    }
    const int route = routes[r].route;
    pthread_mutex_lock(&server.mu);
    server.requests[route]++;
    pthread_mutex_unlock(&server.mu);
    if (route == 3) return http_answer(&c->out, 200, "application/json", "{\"status\": \"ok\"}\n", 17, ka, NULL);
    if (route == 5) return http_answer(&c->out, 200, "text/html; charset=utf-8", (const char *)chat_html, sizeof chat_html, ka, NULL);
    if (!authorized(rq)) return http_error(&c->out, 401, "a valid API key is needed: send Authorization: Bearer KEY", ka, "WWW-Authenticate: Bearer\r\n");
    if (route == 2) return models(&c->out, ka);
    if (route == 4) return metrics(&c->out, ka);
    return completion(c, rq, route == 0);
}

/* Parses and handles the requests c has received whole (one at a time: none while a job runs). */
static void serve_input(conn *c, double t) {
    while (!c->j && !c->close_after && c->in_n) {
        http_request rq;
        size_t used;
        const char *why;
        if (c->out.n <= c->out_off) c->out_since = t; /* what is answered now must be taken within --timeout */
        const int st = http_parse(c->in, c->in_n, MAX_HEADER, server.o.max_body, &rq, &used, &why);
        if (st == HTTP_INCOMPLETE) {
            size_t n;
            const char *ex;
            /* a client that waits for 100 Continue before its body (curl does for large ones) */
            if (!c->continued && rq.header_bytes && (ex = http_get(&rq, "expect", &n)) && http_list_has(ex, n, "100-continue")) {
                bputs(&c->out, "HTTP/1.1 100 Continue\r\n\r\n");
                c->continued = 1;
            }
            return;
        }
        if (st != HTTP_OK) {
            http_error(&c->out, st, why, 0, NULL);
            c->close_after = 1;
            return;
        }
        handle(c, &rq);
        if (!rq.keep_alive) c->close_after = 1;
        memmove(c->in, c->in + used, c->in_n - used);
        c->in_n -= used;
        c->continued = 0;
        c->since = t;
    }
}

/* the bytes the job has written moved into c's output; the job let go of once it is done */
static void take_job_output(conn *c) {
    pthread_mutex_lock(&server.mu);
    job *j = c->j;
    if (j->out.n) {
        if (!c->out.n) c->out_since = now();
        bput(&c->out, j->out.s, j->out.n);
        j->out.n = 0;
    }
    if (j->done) {
        if (!j->keep_alive) c->close_after = 1;
        c->since = now(); /* idle from here */
        job_release(j);
        c->j = NULL;
    }
    pthread_mutex_unlock(&server.mu);
}

/* Sends what c can take now; 0, or -1 when the client is gone. */
static int send_output(conn *c, double t) {
    while (c->out_off < c->out.n) {
        ssize_t w = send(c->fd, c->out.s + c->out_off, c->out.n - c->out_off, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
        if (w <= 0) return -1;
        c->out_off += (size_t)w;
        c->out_since = t;
    }
    c->out.n = c->out_off = 0;
    c->since = t; /* idle from here */
    return 0;
}

/* Reads what c has sent; 0, or -1 when the client closed or the connection failed. */
static int read_input(conn *c, double t) {
    const size_t limit = MAX_HEADER + server.o.max_body + 4096;
    for (;;) {
        if (c->in_n == c->in_cap) {
            if (c->in_cap >= limit) return 0; /* full: http_parse answers 413 or 431, or a pipelined request waits */
            size_t cap = c->in_cap ? c->in_cap * 2 : 16384;
            if (cap > limit) cap = limit;
            char *p = realloc(c->in, cap);
            if (!p) return -1;
            c->in = p, c->in_cap = cap;
        }
        ssize_t r = recv(c->fd, c->in + c->in_n, c->in_cap - c->in_n, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
        if (r == 0) return c->eof = 1, 0;
        if (r < 0) return -1;
        if (!c->in_n && !c->j) c->since = t; /* a new request begins */
        c->in_n += (size_t)r;
    }
}

static volatile sig_atomic_t g_stop;
static void on_signal(int sig) {
    (void)sig;
    g_stop = 1;
    const char b = 0;
    if (write(server.wake[1], &b, 1) < 0) { /* nothing to do */ }
}

static int set_nonblock(int fd) { return fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

/* the listening socket on host:port (the port chosen written back) */
static int listen_on(const char *host, int *port) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE}, *res = NULL;
    char ps[16];
    snprintf(ps, sizeof ps, "%d", *port);
    int e = getaddrinfo(host, ps, &hints, &res);
    if (e) return fprintf(stderr, "moe-server: %s: %s\n", host, gai_strerror(e)), -1;
    int fd = -1;
    for (struct addrinfo *a = res; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd < 0) continue;
        const int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, a->ai_addr, a->ai_addrlen) || listen(fd, 128)) {
            fprintf(stderr, "moe-server: %s port %d: %s\n", host, *port, strerror(errno));
            close(fd), fd = -1;
        }
    }
    freeaddrinfo(res);
    if (fd < 0) return -1;
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (!getsockname(fd, (struct sockaddr *)&ss, &sl))
        *port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port : ((struct sockaddr_in *)&ss)->sin_port);
    fcntl(fd, F_SETFD, FD_CLOEXEC);
    set_nonblock(fd);
    return fd;
}

static void accept_all(int lfd, double t) {
    for (;;) {
        int fd = accept(lfd, NULL, NULL);
        if (fd < 0) return;
        fcntl(fd, F_SETFD, FD_CLOEXEC);
        set_nonblock(fd);
        if (n_conns >= server.o.max_conns) { /* answered at once and closed, without waiting to read */
            buf b = {0};
            http_error(&b, 503, "the server has too many open connections; retry later", 0, "Retry-After: 1\r\n");
            if (send(fd, b.s, b.n, MSG_NOSIGNAL) < 0) { /* the client is gone already */ }
            free(b.s);
            close(fd);
            continue;
        }
        conns[n_conns++] = (conn){.fd = fd, .since = t};
    }
}

/* the network loop, until SIGINT or SIGTERM */
static void serve(int lfd) {
    struct pollfd *pfd = malloc(sizeof *pfd * (size_t)(server.o.max_conns + 2));
    conns = calloc((size_t)server.o.max_conns, sizeof *conns);
    if (!pfd || !conns) {
        fprintf(stderr, "moe-server: out of memory\n");
        free(pfd);
        return;
    }
    while (!g_stop) {
        const double t = now();
        for (int i = 0; i < n_conns;) { /* jobs' output, new requests, deadlines */
            conn *c = &conns[i];
            if (c->j) take_job_output(c);
            if (!c->j) serve_input(c, t);
            int expired = 0;
            if (c->out.n > c->out_off) expired = t - c->out_since > server.o.timeout; /* the client takes no bytes */
            else if (!c->j && c->in_n) expired = t - c->since > server.o.timeout; /* the request is not arriving */
            else if (!c->j) expired = t - c->since > server.o.idle_timeout;
            if (expired && c->in_n && !c->j && c->out.n <= c->out_off) {
                http_error(&c->out, 408, "the request did not arrive in time", 0, NULL);
                c->close_after = 1, c->in_n = 0, c->out_since = t;
                expired = 0;
                send_output(c, t);
            }
            if (expired || (c->close_after && !c->j && c->out.n <= c->out_off)) {
                conn_close(c);
                continue;
            }
            i++;
        }
        pfd[0] = (struct pollfd){.fd = lfd, .events = POLLIN};
        pfd[1] = (struct pollfd){.fd = server.wake[0], .events = POLLIN};
        for (int i = 0; i < n_conns; i++) {
            conn *c = &conns[i];
            /* reading goes on while a job runs, to see the client leave (and keep a pipelined request) */
            const int full = c->eof || c->in_n >= MAX_HEADER + server.o.max_body + 4096;
            pfd[i + 2] = (struct pollfd){.fd = c->fd, .events = (short)((c->out.n > c->out_off ? POLLOUT : 0) | (full ? 0 : POLLIN))};
        }
        const int nc = n_conns;
        if (poll(pfd, (nfds_t)nc + 2, 250) < 0 && errno != EINTR) break;
        const double t2 = now();
        if (pfd[1].revents & POLLIN) {
            char b[256];
            while (read(server.wake[0], b, sizeof b) > 0) {}
        }
        for (int i = nc - 1; i >= 0; i--) { /* from the end: conn_close moves the last one into i */
            conn *c = &conns[i];
            const short ev = pfd[i + 2].revents;
            int gone = 0;
            if (ev & (POLLIN | POLLHUP | POLLERR)) gone = read_input(c, t2) < 0;
            if (!gone && (ev & POLLOUT)) gone = send_output(c, t2) < 0;
            if (!gone && !c->j) serve_input(c, t2);
            if (!gone && c->eof) { /* nothing more will come: what is answered is sent, then it closes */
                c->close_after = 1;
                gone = c->j != NULL;
            }
            if (gone) conn_close(c);
            if (!gone && c->out.n > c->out_off && send_output(c, t2) < 0) conn_close(c);
        }
        if (pfd[0].revents & POLLIN) accept_all(lfd, t2);
    }
    while (n_conns) conn_close(&conns[0]);
    free(conns);
    free(pfd);
}

/* ---- start-up ---- */

static int parse_args(int argc, char **argv, options *o, int *done) {
    *o = (options){.host = "127.0.0.1", .port = 8080, .parallel = 4, .ctx = 4096, .queue = 64, .prefill_chunk = 512, .max_conns = 256,
                   .timeout = 600, .idle_timeout = 30, .max_body = 32u << 20, .prefix_ram = (size_t)1 << 30, .prefix_size = (size_t)20 << 30,
                   .opt = moe_default_options()};
    *done = 1;
    o->opt.flags |= MOE_FLAG_PLAN;
    for (int i = 1; i < argc; i++) {
        const char *why = NULL, *a = argv[i];
        const int more = i + 1 < argc;
        double v;
        int ck;
#define NUM(lo, hi) (arg_num("moe-server", help, a, argv[++i], lo, hi, 1, &v) ? 2 : 0)
        if (!strcmp(a, "-m") && more) o->model = argv[++i];
        else if (!strcmp(a, "--host") && more) o->host = argv[++i];
        else if (!strcmp(a, "--api-key") && more) o->api_key = argv[++i];
        else if (!strcmp(a, "--model-name") && more) o->model_name = argv[++i];
        else if (!strcmp(a, "--port") && more) { if (NUM(0, 65535)) return 2; o->port = (int)v; }
        else if (!strcmp(a, "--parallel") && more) { if (NUM(1, 1024)) return 2; o->parallel = (int)v; }
        else if (!strcmp(a, "-c") && more) { if (NUM(2, 1e8)) return 2; o->ctx = (int)v; }
        else if (!strcmp(a, "--max-tokens") && more) { if (NUM(1, 1e9)) return 2; o->default_max = (int)v; }
        else if (!strcmp(a, "--queue") && more) { if (NUM(0, 1e6)) return 2; o->queue = (int)v; }
        else if (!strcmp(a, "--prefill-chunk") && more) { if (NUM(1, 1e8)) return 2; o->prefill_chunk = (int)v; }
        else if (!strcmp(a, "--max-connections") && more) { if (NUM(1, 1e5)) return 2; o->max_conns = (int)v; }
        else if (!strcmp(a, "--timeout") && more) { if (arg_num("moe-server", help, a, argv[++i], 0.1, 1e7, 0, &v)) return 2; o->timeout = v; }
        else if (!strcmp(a, "--idle-timeout") && more) { if (arg_num("moe-server", help, a, argv[++i], 0.1, 1e7, 0, &v)) return 2; o->idle_timeout = v; }
        else if ((ck = pc_flag(argc, argv, &i, &o->prefix_dir, &o->prefix_size, &why)) != 0) { if (ck < 0) return usage(why); }
        else if (!strcmp(a, "--prefix-cache-ram") && more) {
            if (strcmp(argv[++i], "0") && !parse_size(argv[i], &o->prefix_ram)) return usage("--prefix-cache-ram: a size with its unit, such as 1G, or 0");
            if (!strcmp(argv[i], "0")) o->prefix_ram = 0;
        }
        else if (!strcmp(a, "--max-body") && more) { if (!parse_size(argv[++i], &o->max_body)) return usage("--max-body: a size with its unit, such as 32M"); }
        else if (!strcmp(a, "-t") && more) { if (NUM(1, 1024)) return 2; o->opt.n_threads = (int)v, o->opt.set |= MOE_SET_THREADS; }
        else if ((ck = cache_flag(argc, argv, &i, &o->opt, &why)) != 0) { if (ck < 0) return usage(why); }
        else if (!strcmp(a, "-h") || !strcmp(a, "--help")) return usage(NULL);
        else return arg_unknown("moe-server", help, a, more ? argv[i + 1] : NULL);
#undef NUM
    }
    if (!o->model) return usage("-m MODEL is required");
    *done = 0;
    return 0;
}

int main(int argc, char **argv) {
    int stop, rc = parse_args(argc, argv, &server.o, &stop);
    if (stop) return rc;
    options *o = &server.o;
    if (o->api_key && !*o->api_key) return usage("--api-key must not be empty");
    server.model_name = o->model_name;
    if (!server.model_name) {
        const char *sl = strrchr(o->model, '/');
        server.model_name = sl && sl[1] ? sl + 1 : o->model;
    }
    char err[512];
    moe_status st = moe_model_open(&server.m, o->model, &o->opt, err, sizeof err);
    if (st) return fprintf(stderr, "moe-server: %s: %s\n", moe_status_str(st), err), 1;
    use_plan("moe-server", server.m, &o->opt);
    server.c = moe_model_config(server.m);
    if (moe_tokenizer_for_model(&server.tok, server.m, err, sizeof err)) {
        fprintf(stderr, "moe-server: %s: only completion requests with token-id prompts can be answered\n", err);
        server.tok = NULL;
    }
    const size_t V = (size_t)server.c->vocab_size;
    slots = calloc((size_t)o->parallel, sizeof *slots);
    step_logits = malloc(sizeof(float) * V * (size_t)o->parallel);
    seqs = calloc((size_t)o->parallel, sizeof *seqs);
    rc = !slots || !step_logits || !seqs;
    if (rc) fprintf(stderr, "moe-server: out of memory\n");
    for (int i = 0; !rc && i < o->parallel; i++) {
        if (moe_session_new(&slots[i].s, server.m, o->ctx, err, sizeof err)) rc = (fprintf(stderr, "moe-server: %s\n", err), 1);
        else if (!(slots[i].own = malloc(sizeof(float) * V))) rc = (fprintf(stderr, "moe-server: out of memory\n"), 1);
    }
    if (!rc && pc_open(&pc, "moe-server", server.m, o->ctx, o->prefix_ram, o->prefix_dir, o->prefix_size, err, sizeof err))
        rc = (fprintf(stderr, "moe-server: --prefix-cache %s\n", err), 1);
    if (!rc && o->prefix_dir)
        fprintf(stderr, "moe-server: prefix cache: %d prefixes (%.2f GiB) in %s\n", pc.n, pc.disk_used / 1073741824.0, o->prefix_dir);
    int lfd = -1;
    pthread_t mt;
    int have_thread = 0;
    if (!rc && (pipe(server.wake) || set_nonblock(server.wake[0]) || set_nonblock(server.wake[1])))
        rc = (fprintf(stderr, "moe-server: %s\n", strerror(errno)), 1);
    if (!rc && (lfd = listen_on(o->host, &o->port)) < 0) rc = 1;
    if (!rc) {
        struct sigaction sa = {.sa_handler = on_signal};
        sigemptyset(&sa.sa_mask);
        sigaction(SIGINT, &sa, NULL);
        sigaction(SIGTERM, &sa, NULL);
        signal(SIGPIPE, SIG_IGN);
        server.started = now();
        if (pthread_create(&mt, NULL, model_thread, NULL)) rc = (fprintf(stderr, "moe-server: cannot start the model thread\n"), 1);
        else have_thread = 1;
    }
    if (!rc) {
        fprintf(stderr, "moe-server: listening on http://%s%s%s:%d (%d sequences at once, context %d)\n", strchr(o->host, ':') ? "[" : "", o->host,
                strchr(o->host, ':') ? "]" : "", o->port, o->parallel, o->ctx);
        serve(lfd);
        fprintf(stderr, "moe-server: stopping\n");
    }
    if (have_thread) {
        pthread_mutex_lock(&server.mu);
        server.stopping = 1;
        pthread_cond_signal(&server.cv);
        pthread_mutex_unlock(&server.mu);
        pthread_join(mt, NULL);
    }
    if (lfd >= 0) close(lfd);
    pthread_mutex_lock(&server.mu);
    while (server.queue) {
        job *j = server.queue;
        server.queue = j->next;
        j->refs = 1;
        job_release(j);
    }
    for (int i = 0; slots && i < o->parallel; i++) {
        if (slots[i].j && !slots[i].j->done) {
            slots[i].j->done = 1;
            job *j = slots[i].j;
            free_slots_of(j);
            job_release(j);
        }
        moe_session_free(slots[i].s);
        oai_choice_free(&slots[i].c);
        free(slots[i].own);
    }
    pthread_mutex_unlock(&server.mu);
    pc_close(&pc);
    free(slots), free(step_logits), free(seqs);
    moe_tokenizer_free(server.tok);
    moe_model_close(server.m);
    return rc;
}
