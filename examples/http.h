/* http.h - HTTP/1.1 request parsing for moe-server (not part of the runtime): one request from the
 * bytes a connection has received so far, checked as RFC 9112 asks of a server, with limits on
 * the header and the body. No allocation, no I/O: the caller owns the buffer, and the parsed
 * request points into it. A fuzz target (test/fuzz/fuzz.c, FUZZ_HTTP) drives http_parse. */
#ifndef MOE_EXAMPLES_HTTP_H
#define MOE_EXAMPLES_HTTP_H
#include <stddef.h>
#include <string.h>

enum { HTTP_MAX_HEADERS = 64 };

typedef struct {
    const char *name, *value; /* not NUL-terminated; value without surrounding blanks */
    size_t name_len, value_len;
} http_header;

typedef struct {
    const char *method, *target; /* not NUL-terminated */
    size_t method_len, target_len;
    int minor;                   /* HTTP/1.minor */
    http_header headers[HTTP_MAX_HEADERS];
    int n_headers;
    size_t header_bytes; /* the request line and the headers, through the blank line */
    const char *body;    /* Content-Length bytes right after the headers */
    size_t body_len;
    int keep_alive;      /* the connection may carry another request after this one */
} http_request;

enum {
    HTTP_OK = 0,       /* a whole request is in the buffer: http_parse's *used bytes of it */
    HTTP_INCOMPLETE = 1 /* the buffer holds the beginning of one: read more */
    /* otherwise the HTTP status code to answer with, and close: 400, 413, 431, 501, 505 */
};

static inline int http_tchar(unsigned char c) { /* a token character (RFC 9110 5.6.2) */
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c && strchr("!#$%&'*+-.^_`|~", c));
}

static inline int http_lower(int c) { return c >= 'A' && c <= 'Z' ? c + 32 : c; }

/* 1 when the n bytes at s are name, ignoring case */
static inline int http_is(const char *s, size_t n, const char *name) {
    if (strlen(name) != n) return 0;
    for (size_t i = 0; i < n; i++)
        if (http_lower((unsigned char)s[i]) != http_lower((unsigned char)name[i])) return 0;
    return 1;
}

/* the value of header name (first of them), or NULL; *len its length */
static inline const char *http_get(const http_request *rq, const char *name, size_t *len) {
    for (int i = 0; i < rq->n_headers; i++)
        if (http_is(rq->headers[i].name, rq->headers[i].name_len, name)) return *len = rq->headers[i].value_len, rq->headers[i].value;
    return NULL;
}

/* 1 when the comma-separated list value holds token t (e.g. Connection: close), ignoring case */
static inline int http_list_has(const char *v, size_t n, const char *t) {
    for (size_t i = 0; i < n;) {
        while (i < n && (v[i] == ' ' || v[i] == '\t' || v[i] == ',')) i++;
        size_t j = i;
        while (j < n && v[j] != ',') j++;
        size_t e = j;
        while (e > i && (v[e - 1] == ' ' || v[e - 1] == '\t')) e--;
        if (e > i && http_is(v + i, e - i, t)) return 1;
        i = j;
    }
    return 0;
}

/* The request at the start of buf[0..n), given at most max_header bytes of request line and
 * headers and max_body bytes of body: HTTP_OK with *rq filled and *used its bytes,
 * HTTP_INCOMPLETE, or the status code of what is wrong with *why saying it (400 malformed; 413
 * body too large; 431 header too large or too many fields; 501 a body sent chunked or otherwise
 * transfer-coded; 505 not HTTP/1.x). */
static inline int http_parse(const char *buf, size_t n, size_t max_header, size_t max_body, http_request *rq, size_t *used,
                             const char **why) {
    memset(rq, 0, sizeof *rq);
    *used = 0;
    *why = NULL;
    /* the header ends at the first blank line: CRLF CRLF (a bare LF is accepted as a line end) */
    size_t end = 0;
    for (size_t i = 0; i < n && !end; i++)
        if (buf[i] == '\n' && ((i >= 1 && buf[i - 1] == '\n') || (i >= 2 && buf[i - 1] == '\r' && buf[i - 2] == '\n'))) end = i + 1;
    if (!end) {
        if (n > max_header) return *why = "the request line and headers are too large", 431;
        return HTTP_INCOMPLETE;
    }
    if (end > max_header) return *why = "the request line and headers are too large", 431;
    size_t p = 0;
    while (p + 1 < end && buf[p] == '\r' && buf[p + 1] == '\n') p += 2; /* empty lines before a request are ignored */
    /* request line: method SP target SP HTTP/1.x */
    rq->method = buf + p;
    while (p < end && http_tchar((unsigned char)buf[p])) p++;
    rq->method_len = (size_t)(buf + p - rq->method);
    if (!rq->method_len || p >= end || buf[p] != ' ') return *why = "malformed request line (method)", 400;
    rq->target = buf + ++p;
    while (p < end && (unsigned char)buf[p] > ' ' && buf[p] != 0x7f) p++;
    rq->target_len = (size_t)(buf + p - rq->target);
    if (!rq->target_len || p >= end || buf[p] != ' ') return *why = "malformed request line (target)", 400;
    p++;
    if (end - p < 9 || memcmp(buf + p, "HTTP/", 5)) return *why = "malformed request line (version)", 400;
    if (buf[p + 5] != '1' || buf[p + 6] != '.' || buf[p + 7] < '0' || buf[p + 7] > '9') return *why = "only HTTP/1.x is served", 505;
    rq->minor = buf[p + 7] - '0';
    p += 8;
    if (buf[p] == '\r') p++;
    if (buf[p] != '\n') return *why = "malformed request line", 400;
    p++;
    /* header fields: name ":" OWS value OWS, no folding, no blank before the colon */
    long long content_length = -1;
    int close = 0, keep = 0;
    while (p < end && buf[p] != '\r' && buf[p] != '\n') {
        if (rq->n_headers == HTTP_MAX_HEADERS) return *why = "too many header fields", 431;
        http_header *h = &rq->headers[rq->n_headers++];
        h->name = buf + p;
        while (p < end && http_tchar((unsigned char)buf[p])) p++;
        h->name_len = (size_t)(buf + p - h->name);
        if (!h->name_len || buf[p] != ':') return *why = "malformed header field", 400;
        p++;
        while (buf[p] == ' ' || buf[p] == '\t') p++;
        h->value = buf + p;
        while (p < end && buf[p] != '\r' && buf[p] != '\n') {
            const unsigned char c = (unsigned char)buf[p];
            if ((c < ' ' && c != '\t') || c == 0x7f) return *why = "control character in a header value", 400;
            p++;
        }
        const char *ve = buf + p;
        while (ve > h->value && (ve[-1] == ' ' || ve[-1] == '\t')) ve--;
        h->value_len = (size_t)(ve - h->value);
        if (buf[p] == '\r') p++;
        if (buf[p] != '\n') return *why = "malformed header line", 400;
        p++;
        if (p < end && (buf[p] == ' ' || buf[p] == '\t')) return *why = "folded header lines are not accepted", 400;
        if (http_is(h->name, h->name_len, "content-length")) {
            long long v = 0;
            if (!h->value_len) return *why = "bad Content-Length", 400;
            for (size_t i = 0; i < h->value_len; i++) {
                if (h->value[i] < '0' || h->value[i] > '9' || v > (1LL << 50)) return *why = "bad Content-Length", 400;
                v = v * 10 + (h->value[i] - '0');
            }
            if (content_length >= 0 && content_length != v) return *why = "Content-Length given twice, differently", 400;
            content_length = v;
        } else if (http_is(h->name, h->name_len, "transfer-encoding")) {
            return *why = "a transfer-coded (chunked) request body is not accepted; send Content-Length", 501;
        } else if (http_is(h->name, h->name_len, "connection")) {
            close |= http_list_has(h->value, h->value_len, "close");
            keep |= http_list_has(h->value, h->value_len, "keep-alive");
        }
    }
    rq->header_bytes = end;
    if (rq->minor >= 1) {
        size_t hl;
        if (!http_get(rq, "host", &hl)) return *why = "an HTTP/1.1 request needs a Host header", 400;
    }
    rq->keep_alive = rq->minor >= 1 ? !close : keep && !close;
    if (content_length > (long long)max_body) return *why = "the request body is too large", 413;
    const size_t body = content_length > 0 ? (size_t)content_length : 0;
    if (n - end < body) return HTTP_INCOMPLETE;
    rq->body = buf + end, rq->body_len = body;
    *used = end + body;
    return HTTP_OK;
}
#endif
