/* moe-bench: speed as a fraction of this machine's own limits, measured in the same run.
 *
 *   moe-bench -m MODEL [-m MODEL...] [-t THREADS[,THREADS...]] [--depth D[,D...]] [-n TOKENS]
 *             [--prefill N] [--reps R]
 *
 * Per model and thread count: prefill tok/s of N tokens against the int8 kernel peak (the
 * interleaved Q8_0 kernel, 4 rows at a time, on cache-resident data: what the integer matmul can do
 * when memory is not the limit; measured before and after the prefill; 2 x active parameters
 * operations per token), and decode tok/s at each depth (depth = tokens already in the context)
 * with the bytes each decoded token reads (weights actually touched: dense matrices, the routed
 * experts chosen, plus KDA states and the MLA latent cache) against the memory read bandwidth (a
 * large buffer summed by every thread), probed every few tokens. One JSON line per configuration.
 *
 *   moe-bench --stream -m DIR [-n TOKENS] [-t THREADS] [--expert-budget SIZE] [--io-threads N]
 *             [--dense TYPE] [--seqs 1,16,64] [--prefill N]
 *
 * Streaming from disk (run it inside a memory cap with a cold page cache: scripts/bench-stream):
 * first the disk's read bandwidth with O_DIRECT (one sequential reader; 16 parallel readers of
 * expert-sized blocks at random offsets), then through the expert cache: decode of one sequence,
 * a prefill chunk, and lockstep decode of several sequences, each a JSON line with seconds per
 * token, bytes read per token, hit rate, the I/O floor (bytes read per token over the parallel
 * bandwidth), the memory floor (weight bytes computed per token over the memory read rate), the
 * serial floor (the I/O floor plus the compute no read can overlap), the share of the time with a
 * read in flight and the rate the reads got then, the fraction of thread time stalled on reads
 * and the prefetch recall. */
#define _POSIX_C_SOURCE 200809L
#define _ISOC11_SOURCE
#define _GNU_SOURCE /* O_DIRECT (glibc declares it only then; other libcs ignore this) */
#define MOE_INTERNAL
#include "../moe.h"
#include "args.h"
#include "cache_flags.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static arg_help help = {
    "usage: moe-bench -m MODEL [-m MODEL...] [-t T[,T...]] [--depth D[,D...]] [-n TOKENS]\n"
    "                 [--prefill N] [--reps R] [--kv-type f32|bf16|q8] [--mxfp4 f32|int8] [--act 8|16] [--batch ROWS]\n"
    "                 [--kernels NAME]\n"
    "       moe-bench --stream -m DIR [-n TOKENS] [-t T] [--expert-budget SIZE] [--io-threads N]\n"
    "                 [--dense bf16|q8_0|q4_0] [--dense-budget SIZE] [--seqs 1,16,64] [--prefill N] [--batch ROWS]\n"
    "                 [--prefetch on|off]\n"
    "  defaults: -t 1,2  --depth 0,4096  -n 16 decoded tokens  --prefill 512  --reps 3\n"
    "  --kernels NAME: a kernel set this CPU runs (avx2, avxvnni, ...; default its best), for the\n"
    "  model and the int8 peak\n", NULL};

static int usage(const char *msg) { return arg_usage("moe-bench", help, msg); }

/* Read bandwidth: each thread streams its share of a large buffer with the widest loads the CPU
 * has (the kernels do), with and without software prefetch 8 KB ahead (on a shared VM
 * either can be the faster from minute to minute), the best of both: the limit the decode
 * fraction is taken against. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
__attribute__((target("avx2"))) static uint64_t sum_avx2(const uint64_t *a, size_t n, int prefetch) {
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
    for (size_t i = 0; i + 16 <= n; i += 16) {
        if (prefetch) __builtin_prefetch((const void *)((uintptr_t)(a + i) + 8192));
        if (prefetch) __builtin_prefetch((const void *)((uintptr_t)(a + i) + 8192 + 64));
        s0 = _mm256_xor_si256(s0, _mm256_load_si256((const __m256i *)(a + i)));
        s1 = _mm256_xor_si256(s1, _mm256_load_si256((const __m256i *)(a + i + 4)));
        s2 = _mm256_xor_si256(s2, _mm256_load_si256((const __m256i *)(a + i + 8)));
        s3 = _mm256_xor_si256(s3, _mm256_load_si256((const __m256i *)(a + i + 12)));
    }
    __m256i s = _mm256_xor_si256(_mm256_xor_si256(s0, s1), _mm256_xor_si256(s2, s3));
    uint64_t out[4];
    _mm256_storeu_si256((__m256i *)out, s);
    return out[0] ^ out[1] ^ out[2] ^ out[3];
}
static int have_avx2(void) { __builtin_cpu_init(); return __builtin_cpu_supports("avx2"); }
#else
static uint64_t sum_avx2(const uint64_t *a, size_t n, int prefetch) { (void)a, (void)n, (void)prefetch; return 0; }
static int have_avx2(void) { return 0; }
#endif

static uint64_t sum_plain(const uint64_t *a, size_t n, int prefetch) {
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t i = 0; i + 4 <= n; i += 4) {
#if defined(__GNUC__) || defined(__clang__)
        if (prefetch && i % 8 == 0) __builtin_prefetch((const void *)((uintptr_t)(a + i) + 8192));
#endif
        s0 ^= a[i], s1 ^= a[i + 1], s2 ^= a[i + 2], s3 ^= a[i + 3];
    }
    (void)prefetch;
    return s0 ^ s1 ^ s2 ^ s3;
}

/* bytes of one cached MLA token of one layer: the latent and kr in the cache's element (int8 rows
 * add their scales and sums) */
static double kv_row_bytes(const moe_config *c, int kv_type) {
    const double cw = c->kv_lora_rank + c->qk_rope_dim;
    return kv_type == MOE_KV_Q8 ? cw + 16 : kv_type == MOE_KV_BF16 ? 2 * cw : 4 * cw;
}

/* A buffer far larger than any cache for the bandwidth probes, kept for the whole run: in huge
 * pages, as the runtime keeps its interleaved weights and latent cache, for the machine's read
 * limit with the fewest TLB misses (on a Zen 4 VM 4 KB pages read 3-20% slower) */
typedef struct { uint64_t *a; size_t n; } bw_buffer;

static int bw_buffer_new(bw_buffer *b, size_t bytes) {
    b->n = bytes / sizeof *b->a;
    b->a = aligned_alloc((size_t)2 << 20, b->n * sizeof *b->a);
    if (!b->a) return -1;
#ifdef MADV_HUGEPAGE
    madvise(b->a, b->n * sizeof *b->a, MADV_HUGEPAGE);
#endif
    for (size_t i = 0; i < b->n; i++) b->a[i] = i * 2654435761u;
    return 0;
}

/* decode tokens between two bandwidth probes, probe size and passes: a probe reads 512 MiB, about
 * 15 ms at 35 GB/s, so stretches of 4 tokens (~100 ms) keep the probes under a fifth of the run */
#define DECODE_STRETCH 4
#define PROBE_BYTES ((size_t)256 << 20)
#define PROBE_PASSES 2

/* the best of `passes` reads of the whole buffer, alternately with and without prefetch, in GB/s */
static double membw(const bw_buffer *b, int threads, int passes) {
    const size_t chunk = 1 << 16;
    const double bytes = (double)(b->n * sizeof *b->a);
    const int wide = have_avx2();
    double best = 0;
    volatile uint64_t sink = 0;
    for (int r = 0; r < passes; r++) {
        const int pf = r % 2;
        double t0 = now();
        uint64_t total = 0;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) reduction(^ : total) schedule(static)
#endif
        for (size_t c = 0; c < b->n; c += chunk) total ^= wide ? sum_avx2(b->a + c, chunk, pf) : sum_plain(b->a + c, chunk, pf);
        double t = now() - t0;
        sink ^= total;
        if (bytes / t / 1e9 > best) best = bytes / t / 1e9;
    }
    (void)sink;
    (void)threads;
    return best;
}

/* int8 peak: the kernel level's interleaved Q8_0 and Q4_0 kernels on cache-resident data (8 rows
 * x 2048 columns, 17 or 9 KB, against 4 activation rows at once where the level has that kernel, as
 * prefill runs it), the faster of the two, in operations (multiply + add) per second: what the
 * integer matmul does when memory is not the limit. Both, because a level can run one format
 * faster than the other (AVX2's Q8_0 needs sign tricks before maddubs: on a 16-core Emerald Rapids Xeon its
 * Q4_0 prefill outran the Q8_0 kernel's rate). */
static double int8_peak_of(const moe__kernels *k, int type, int threads) {
    const int n = 2048, x8 = type == MOE_T_Q8_0 ? MOE_T_Q8_0X8 : MOE_T_Q4_0X8;
    const size_t row = (size_t)moe__row_bytes(type, n);
    unsigned char *w = malloc(row * 8);
    unsigned char *wx = malloc(row * 8 * 2); /* two groups: the 16-row kernel reads both */
    moe__block_q8a *x = malloc(sizeof *x * (size_t)(n / 32) * 4);
    float *xf = malloc(sizeof(float) * n);
    for (int i = 0; i < n; i++) xf[i] = (float)((i * 37) % 101 - 50) / 50.0f;
    for (int r = 0; r < 8; r++) moe__quantize_row(type, xf, w + (size_t)r * row, n);
    moe__repack_x8(type, w, (int64_t)row, NULL, wx, n);
    memcpy(wx + row * 8, wx, row * 8);
    for (int t = 0; t < 4; t++) k->quant_q8a(xf, x + (size_t)t * (n / 32), n);
    /* prefill's kernel: 4 activation rows per pass over the weights (and two row groups at once)
     * where the level has it */
    const int rows = k->dotq8x4[x8] ? 4 : 1, groups = k->dotq8x4x2[x8] ? 2 : 1;
    double best = 0;
    float sink = 0;
    for (int rep = 0; rep < 5; rep++) { /* best of 5: the machine is shared */
        /* batches of 2000 calls (~0.6 ms here) until 20 ms have passed, so a slow machine or an
         * emulator takes as long as a fast one */
        long done = 0;
        double t0 = now(), t;
        do {
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) reduction(+ : sink) schedule(static)
#endif
            for (long it = 0; it < 2000; it++) {
                float o[64];
                if (groups == 2) k->dotq8x4x2[x8](wx, x, n / 32, n, o);
                else if (rows == 4) k->dotq8x4[x8](wx, x, n / 32, n, o);
                else k->dotq8[x8](wx, x, n, o);
                sink += o[it & 7];
            }
            done += 2000;
        } while ((t = now() - t0) < 0.02);
        double ops = 2.0 * 8 * groups * rows * n * done / t;
        best = ops > best ? ops : best;
    }
    (void)threads;
    free(w), free(wx), free(x), free(xf);
    return sink == 12345.0f ? 0 : best;
}

static double int8_peak(const moe__kernels *k, int threads) {
    const double q8 = int8_peak_of(k, MOE_T_Q8_0, threads), q4 = int8_peak_of(k, MOE_T_Q4_0, threads);
    return q8 > q4 ? q8 : q4;
}

static int parse_list(const char *s, int *out, int max) {
    int n = 0;
    while (*s && n < max) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v < 0) return -1;
        out[n++] = (int)v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') return -1;
    }
    return n;
}


/* the next state of a xorshift64 generator (13, 7, 17): token ids and read offsets */
static uint64_t xorshift(uint64_t *s) {
    *s ^= *s << 13, *s ^= *s >> 7, *s ^= *s << 17;
    return *s;
}

/* ---- streaming benchmark ---- */

typedef struct {
    const char *path;
    off_t size;
    size_t block;
    int reads;
    uint64_t seed, bytes;
    int err;
} disk_job;

/* reads `reads` blocks at random aligned offsets with O_DIRECT */
static void *disk_random(void *arg) {
    disk_job *j = arg;
    int fd = open(j->path, O_RDONLY | O_DIRECT);
    void *buf = NULL;
    if (fd < 0 || posix_memalign(&buf, 4096, j->block)) { j->err = errno ? errno : ENOMEM; if (fd >= 0) close(fd); return NULL; }
    for (int i = 0; i < j->reads; i++) {
        off_t off = (off_t)(xorshift(&j->seed) % (uint64_t)(j->size - (off_t)j->block)) & ~(off_t)4095;
        ssize_t r = pread(fd, buf, j->block, off);
        if (r <= 0) { j->err = r < 0 ? errno : EIO; break; }
        j->bytes += (uint64_t)r;
    }
    free(buf);
    close(fd);
    return NULL;
}

/* GB/s of one sequential O_DIRECT reader over up to `limit` bytes of path */
static double disk_sequential(const char *path, uint64_t limit) {
    int fd = open(path, O_RDONLY | O_DIRECT);
    void *buf = NULL;
    const size_t chunk = 16u << 20;
    if (fd < 0 || posix_memalign(&buf, 4096, chunk)) { if (fd >= 0) close(fd); return 0; }
    uint64_t done = 0;
    double t0 = now();
    while (done < limit) {
        ssize_t r = pread(fd, buf, chunk, (off_t)done);
        if (r <= 0) break;
        done += (uint64_t)r;
    }
    double t = now() - t0;
    free(buf);
    close(fd);
    return t > 0 ? done / t / 1e9 : 0;
}

static double disk_parallel(const char *path, off_t size, size_t block, int threads, int reads_each) {
    pthread_t th[64];
    disk_job jobs[64];
    double t0 = now();
    for (int i = 0; i < threads; i++) {
        jobs[i] = (disk_job){path, size, block, reads_each, 0x9E3779B97F4A7C15ull * (uint64_t)(i + 1), 0, 0};
        pthread_create(&th[i], NULL, disk_random, &jobs[i]);
    }
    uint64_t bytes = 0;
    for (int i = 0; i < threads; i++) pthread_join(th[i], NULL), bytes += jobs[i].bytes;
    double t = now() - t0;
    return t > 0 ? bytes / t / 1e9 : 0;
}


/* 16 readers of blocks at random offsets, about 220 MB each: the bandwidth the floors divide by */
static double disk_16(const char *path, off_t size, size_t block) { return disk_parallel(path, size, block, 16, (int)(220e6 / block) + 1); }

/* The disk drifts within minutes: the 16-reader bandwidth measured again right after a run; a
 * run's floor takes the better of that and the measurement before it (*last, then updated), as
 * the memory roofline does */
static double disk_again(const char *path, off_t size, size_t block, double *last) {
    const double now_gbps = disk_16(path, size, block), best = now_gbps > *last ? now_gbps : *last;
    fprintf(stderr, "moe-bench: disk after the run: 16 readers %.2f GB/s (the floor takes %.2f)\n", now_gbps, best);
    *last = now_gbps;
    return best;
}

typedef struct {
    double seconds;
    int tokens;
    moe_step_stats sum;
} run_stats;

static void add_stats(moe_step_stats *a, const moe_step_stats *b) {
    a->cache_hits += b->cache_hits, a->cache_misses += b->cache_misses, a->bytes_read += b->bytes_read, a->io_seconds += b->io_seconds;
    a->prefetch_predicted += b->prefetch_predicted, a->prefetch_routed += b->prefetch_routed, a->expert_loads += b->expert_loads;
    a->expert_bytes += b->expert_bytes, a->dense_reads += b->dense_reads, a->io_busy_seconds += b->io_busy_seconds;
}

/* a / b as a JSON number, or null where b is 0 (nothing read: no I/O floor) */
static void json_ratio(char out[32], double a, double b) {
    if (b > 0) snprintf(out, 32, "%.3f", a / b);
    else snprintf(out, 32, "null");
}

/* A run's floors per token: the I/O floor (bytes read from storage over the disk's parallel read
 * rate), the memory floor (the weight bytes its compute reads, each step's dense matrices in their
 * loaded format plus the routed experts it computes, over the memory read rate), and the serial
 * floor: the I/O floor plus the dense bytes no expert read of the step can overlap
 * (moe_model_info.serial_bytes_per_token: before the first routing and after the last expert)
 * over the memory read rate. A token takes at least the larger of the first two, and at least
 * the serial floor. Both rates are measured beside the run. Beside them, what the run's own reads
 * did: the fraction of its time with a read in flight, and the bytes over that time. */
static void stream_line(const char *mode, int seqs, const run_stats *r, int steps, double disk_gbps, double mem_gbps,
                        const moe_model_info *mi, int threads) {
    const double tok = r->tokens, hr = (double)r->sum.cache_hits / (double)(r->sum.cache_hits + r->sum.cache_misses + 1e-9);
    const double bpt = r->sum.bytes_read / tok, io_floor = bpt / (disk_gbps * 1e9);
    const double mem_bpt = ((double)mi->dense_bytes_per_token * steps + (double)r->sum.expert_bytes) / tok;
    const double mem_floor = mem_gbps > 0 ? mem_bpt / (mem_gbps * 1e9) : 0, floor = io_floor > mem_floor ? io_floor : mem_floor;
    const double serial_bpt = (double)mi->serial_bytes_per_token * steps / tok;
    const double serial_floor = io_floor + (mem_gbps > 0 ? serial_bpt / (mem_gbps * 1e9) : 0);
    char over_io[32], over[32], over_serial[32];
    json_ratio(over_io, r->seconds / tok, io_floor), json_ratio(over, r->seconds / tok, floor);
    json_ratio(over_serial, r->seconds / tok, serial_floor);
    printf("{\"mode\": \"%s\", \"sequences\": %d, \"tokens\": %d, \"s_per_token\": %.4f, \"tok_s\": %.3f, \"bytes_read_per_token\": %.0f, "
           "\"hit_rate\": %.4f, \"disk_read_gbps\": %.3f, \"io_floor_s_per_token\": %.4f, \"weight_bytes_per_token\": %.0f, "
           "\"membw_read_gbps\": %.2f, \"mem_floor_s_per_token\": %.4f, \"over_io_floor\": %s, \"over_floor\": %s, "
           "\"serial_bytes_per_token\": %.0f, \"serial_floor_s_per_token\": %.4f, \"over_serial_floor\": %s, "
           "\"io_busy_frac\": %.3f, \"reads_gbps\": %.3f, \"stall_frac\": %.3f, "
           "\"prefetch_recall\": %.3f, \"expert_loads_per_step\": %.1f, \"dense_layer_reads_per_step\": %.2f}\n",
           mode, seqs, r->tokens, r->seconds / tok, tok / r->seconds, bpt, hr, disk_gbps, io_floor, mem_bpt, mem_gbps, mem_floor,
           over_io, over, serial_bpt, serial_floor, over_serial, r->sum.io_busy_seconds / r->seconds,
           r->sum.io_busy_seconds > 0 ? r->sum.bytes_read / r->sum.io_busy_seconds / 1e9 : 0.0, r->sum.io_seconds / (r->seconds * threads),
           r->sum.prefetch_routed ? (double)r->sum.prefetch_predicted / r->sum.prefetch_routed : 0.0,
           (double)r->sum.expert_loads * seqs / tok, (double)r->sum.dense_reads * seqs / tok);
    fflush(stdout);
}

/* The memory read rate drifts as the disk's does: probed again right after a run, and the
 * run's memory floor takes the better of that and the probe before it (*last, then updated) */
static double membw_again(const bw_buffer *b, int threads, double *last) {
    const double now_gbps = membw(b, threads, 4), best = now_gbps > *last ? now_gbps : *last;
    fprintf(stderr, "moe-bench: memory read after the run: %.1f GB/s (the floor takes %.1f)\n", now_gbps, best);
    *last = now_gbps;
    return best;
}

/* this process's resident memory, as /proc/self/status reports it (Linux; silent elsewhere) */
static void print_rss(const char *when) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256], out[512] = "";
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "VmRSS:", 6) || !strncmp(line, "RssAnon:", 8) || !strncmp(line, "RssFile:", 8) || !strncmp(line, "VmHWM:", 6)) {
            line[strcspn(line, "\n")] = 0;
            snprintf(out + strlen(out), sizeof out - strlen(out), " %s", line);
        }
    if (f) fclose(f), fprintf(stderr, "moe-bench: memory %s:%s\n", when, out);
}

static int stream_bench(const char *model, int argc, char **argv) {
    int n_decode = 8, n_prefill = 64, seqs[8] = {1, 16, 64}, n_seqs = 3;
    /* the expert cache is what this measures; the rest as the resource plan chooses, but what
     * the command line sets */
    moe_options o = moe_default_options();
    o.expert_mode = MOE_EXPERTS_CACHE;
    o.flags |= MOE_FLAG_PLAN, o.set |= MOE_SET_EXPERT_MODE;
    for (int i = 1; i < argc; i++) {
        double v;
        const char *a = argv[i], *why;
        int more = i + 1 < argc, k;
        if (!strcmp(a, "-t") && more) {
            if ((o.n_threads = atoi(argv[++i])) < 1) return usage("-t is a thread count of at least 1");
            o.set |= MOE_SET_THREADS;
        }
        else if (!strcmp(a, "-n") && more) {
            if (arg_num("moe-bench", help, a, argv[++i], 0, 1e+08, 1, &v)) return 2;
            n_decode = (int)v;
        }
        else if (!strcmp(a, "--prefill") && more) {
            if (arg_num("moe-bench", help, a, argv[++i], 0, 1e+08, 1, &v)) return 2;
            n_prefill = (int)v;
        }
        else if (!strcmp(a, "--batch") && more) { if ((o.n_batch = atoi(argv[++i])) < 1) return usage("--batch is a row count of at least 1"); }
        else if (!strcmp(a, "--seqs") && more) { if ((n_seqs = parse_list(argv[++i], seqs, 8)) < 1) return usage("bad --seqs"); }
        else if ((k = cache_flag(argc, argv, &i, &o, &why)) != 0) { if (k < 0) return usage(why); }
        else if (!strcmp(a, "-m") && more) i++;
        else if (strcmp(a, "--stream")) return usage("unknown argument in --stream mode");
    }
    /* the disk, on the biggest file of the checkpoint (or the model file itself: GGUF) */
    char biggest[4400] = "";
    off_t bsize = 0;
    struct stat msb;
    if (!stat(model, &msb) && S_ISREG(msb.st_mode)) bsize = msb.st_size, snprintf(biggest, sizeof biggest, "%s", model);
    for (int i = 1; i < 100 && !bsize; i++) {
        char p[4200];
        struct stat sb;
        snprintf(p, sizeof p, "%s/model-%05d-of-", model, i);
        /* shard names: model-0000i-of-0000N.safetensors (the K3 layout) */
        int found = 0;
        for (int n = i; n < 100 && !found; n++) {
            char q[4300];
            snprintf(q, sizeof q, "%s%06d.safetensors", p, n);
            if (!stat(q, &sb)) found = 1;
            else {
                snprintf(q, sizeof q, "%s%05d.safetensors", p, n);
                if (!stat(q, &sb)) found = 1;
            }
            if (found && sb.st_size > bsize) bsize = sb.st_size, snprintf(biggest, sizeof biggest, "%s", q);
        }
        if (!found) break;
    }
    if (!bsize) { fprintf(stderr, "moe-bench: %s: no model-NNNNN-of-NNNNN.safetensors shards\n", model); return 1; }
    /* the memory read rate, on a buffer held for the whole run: 128 MiB, four times a Zen 4 CCD's
     * L3 (a smaller one reads faster than memory), inside the memory the plan leaves beside the
     * model (plan_choose's reserve, 256 MiB and more) */
    bw_buffer probe;
    if (bw_buffer_new(&probe, (size_t)128 << 20)) { fprintf(stderr, "moe-bench: no memory for the bandwidth probe\n"); return 1; }
    /* the model is opened first (headers, dense weights) to size the random reads as its expert
     * reads are: a whole expert where its tensors are adjacent (K3's layout), a third of one in a
     * GGUF (merged expert tensors: w1, w2 and w3 rows apart) */
    char err[512];
    moe_model *m = NULL;
    double t0 = now();
    moe_status st = moe_model_open(&m, model, &o, err, sizeof err);
    if (st) { fprintf(stderr, "moe-bench: %s\n", err); return 1; }
    const double open_s = now() - t0;
    use_plan("moe-bench", m, &o);
    double mem_gbps = membw(&probe, o.n_threads, 4);
    const moe_config *c = moe_model_config(m);
    const moe_model_info mi = moe_model_get_info(m);
    int n_moe = 0;
    for (int l = 0; l < c->n_layers; l++) n_moe += c->layer_moe[l];
    const double one = n_moe && c->n_experts ? (double)mi.expert_bytes / n_moe / c->n_experts : 18400000.0;
    const size_t block = ((size_t)(one / (strcmp(mi.format, "gguf") ? 1 : 3)) + 4095) & ~(size_t)4095;
    const double seq_gbps = disk_sequential(biggest, (uint64_t)2 << 30);
    double par_gbps = disk_16(biggest, bsize, block);
    fprintf(stderr, "moe-bench: disk (O_DIRECT): sequential %.2f GB/s, 16 readers of %.1f MB blocks %.2f GB/s (%s)\n", seq_gbps,
            block / 1e6, par_gbps, biggest);
    printf("{\"mode\": \"disk\", \"sequential_gbps\": %.3f, \"parallel16_gbps\": %.3f, \"block_bytes\": %zu}\n", seq_gbps, par_gbps, block);
    fflush(stdout);

    print_rss("after open");
    fprintf(stderr, "moe-bench: opened in %.1f s; expert budget %.2f GB, %d I/O threads, %d compute threads\n", open_s,
            o.expert_budget / 1e9, o.io_threads, o.n_threads);
    if (mi.streamed_layers)
        fprintf(stderr, "moe-bench: %d layers stream their dense matrices: %.2f GB read every step\n", mi.streamed_layers, mi.streamed_bytes / 1e9);
    int maxs = 1;
    for (int i = 0; i < n_seqs; i++) maxs = seqs[i] > maxs ? seqs[i] : maxs;
    const int ctx = n_prefill + n_decode + 8;
    moe_session **ss = calloc((size_t)maxs, sizeof *ss);
    moe_seq *q = calloc((size_t)maxs, sizeof *q);
    float *logits = malloc(sizeof(float) * (size_t)c->vocab_size * (size_t)maxs);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(n_prefill + 8) * (size_t)maxs), *next = malloc(sizeof(int32_t) * (size_t)maxs);
    if (!ss || !q || !logits || !ids || !next) { fprintf(stderr, "moe-bench: out of memory\n"); return 1; }
    uint64_t rng = 777;
    for (int i = 0; i < (n_prefill + 8) * maxs; i++) {
        ids[i] = (int32_t)(xorshift(&rng) % (uint64_t)c->vocab_size);
    }
    for (int i = 0; i < maxs; i++)
        if ((st = moe_session_new(&ss[i], m, ctx, err, sizeof err))) { fprintf(stderr, "moe-bench: %s\n", err); return 1; }
    moe_step_stats s1;
    /* prefill: n_prefill tokens in chunks of n_batch rows; every expert a chunk routes to is read
     * at most once for it */
    {
        run_stats r = {0};
        q[0] = (moe_seq){.s = ss[0], .tokens = ids, .n = n_prefill, .logits = logits};
        double t = now();
        if ((st = moe_step(m, q, 1, &s1, err, sizeof err))) { fprintf(stderr, "moe-bench: %s\n", err); return 1; }
        r.seconds = now() - t, r.tokens = n_prefill, r.sum = s1;
        const int chunks = (n_prefill + mi.n_batch - 1) / mi.n_batch;
        stream_line("prefill", 1, &r, chunks, disk_again(biggest, bsize, block, &par_gbps), membw_again(&probe, o.n_threads, &mem_gbps),
                    &mi, o.n_threads);
        fprintf(stderr, "moe-bench: prefill %d tokens: %llu distinct experts routed, %llu read (%.2f GB)\n", n_prefill,
                (unsigned long long)s1.expert_loads, (unsigned long long)s1.cache_misses, s1.bytes_read / 1e9);
        print_rss("after prefill");
    }
    /* decode: one sequence, then lockstep */
    for (int si = 0; si < n_seqs; si++) {
        const int S = seqs[si] < 1 ? 1 : seqs[si];
        for (int i = 0; i < S; i++) moe_session_reset(ss[i]);
        for (int i = 0; i < S; i++) q[i] = (moe_seq){.s = ss[i], .tokens = ids + (size_t)i * (n_prefill + 8), .n = 4, .logits = logits + (size_t)i * c->vocab_size};
        if ((st = moe_step(m, q, S, &s1, err, sizeof err))) { fprintf(stderr, "moe-bench: %s\n", err); return 1; }
        run_stats r = {0};
        double t = 0;
        uint64_t drng = 4242; /* the same ids in every run */
        for (int k = 0; k <= n_decode; k++) {
            if (k == 1) t = now(); /* the first step after the prompt warms the pipeline */
            for (int i = 0; i < S; i++) {
                /* a fresh pseudo-random id each step, text whose tokens do not repeat (4 ids taken
                 * in turn route the same experts every 4 steps and flatter the cache: on the K3
                 * slice at an 8 GB cap 0.69 of the experts hit over 32 tokens so, against
                 * 0.35-0.38 in moe-cli's greedy decoding of it) */
                next[i] = (int32_t)(xorshift(&drng) % (uint64_t)c->vocab_size);
                q[i] = (moe_seq){.s = ss[i], .tokens = &next[i], .n = 1, .logits = logits + (size_t)i * c->vocab_size};
            }
            if ((st = moe_step(m, q, S, &s1, err, sizeof err))) { fprintf(stderr, "moe-bench: %s\n", err); return 1; }
            if (k) add_stats(&r.sum, &s1);
        }
        r.seconds = now() - t, r.tokens = n_decode * S;
        stream_line("decode", S, &r, n_decode, disk_again(biggest, bsize, block, &par_gbps), membw_again(&probe, o.n_threads, &mem_gbps),
                    &mi, o.n_threads);
    }
    for (int i = 0; i < maxs; i++) moe_session_free(ss[i]);
    free(ss), free(q), free(logits), free(ids), free(next), free(probe.a);
    moe_model_close(m);
    return 0;
}

typedef struct {
    const char *models[16];
    int n_models, threads[8], n_threads, depths[8], n_depths;
    int n_decode, n_prefill, reps, kv_type, n_batch;
    unsigned flags;
    const char *kernels;
} options;

/* Parses the command line into o; 0, or usage()'s exit status with *done set. */
static int parse_args(int argc, char **argv, options *o, int *done) {
    *o = (options){.threads = {1, 2}, .n_threads = 2, .depths = {0, 4096}, .n_depths = 2, .n_decode = 16, .n_prefill = 512, .reps = 3,
                   .kv_type = MOE_KV_F32};
    *done = 1;
    for (int i = 1; i < argc; i++) {
        double v;
        const char *a = argv[i];
        int more = i + 1 < argc;
        if (!strcmp(a, "-m") && more && o->n_models < 16) o->models[o->n_models++] = argv[++i];
        else if (!strcmp(a, "-t") && more) { if ((o->n_threads = parse_list(argv[++i], o->threads, 8)) < 1) return usage("bad -t"); }
        else if (!strcmp(a, "--depth") && more) { if ((o->n_depths = parse_list(argv[++i], o->depths, 8)) < 1) return usage("bad --depth"); }
        else if (!strcmp(a, "-n") && more) {
            if (arg_num("moe-bench", help, a, argv[++i], 0, 1e+08, 1, &v)) return 2;
            o->n_decode = (int)v;
        }
        else if (!strcmp(a, "--prefill") && more) {
            if (arg_num("moe-bench", help, a, argv[++i], 0, 1e+08, 1, &v)) return 2;
            o->n_prefill = (int)v;
        }
        else if (!strcmp(a, "--reps") && more) {
            if (arg_num("moe-bench", help, a, argv[++i], 1, 1000, 1, &v)) return 2;
            o->reps = (int)v;
        }
        else if (!strcmp(a, "--kernels") && more) o->kernels = argv[++i];
        else if (!strcmp(a, "--batch") && more) { if ((o->n_batch = atoi(argv[++i])) < 1) return usage("--batch is a row count of at least 1"); }
        else if (!strcmp(a, "--kv-type") && more) {
            if ((o->kv_type = parse_kv_type(argv[++i])) < 0) return usage("--kv-type is f32, bf16 or q8");
        } else if (!strcmp(a, "--mxfp4") && more) {
            const int int8 = parse_mxfp4(argv[++i]);
            if (int8 < 0) return usage("--mxfp4 is f32 or int8");
            o->flags = int8 ? o->flags | MOE_FLAG_MXFP4_INT8 : o->flags & ~(unsigned)MOE_FLAG_MXFP4_INT8;
        } else if (!strcmp(a, "--act") && more) {
            const int act16 = parse_act(argv[++i]);
            if (act16 < 0) return usage("--act is 8 or 16");
            o->flags = act16 ? o->flags | MOE_FLAG_ACT16 : o->flags & ~(unsigned)MOE_FLAG_ACT16;
        } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) return usage(NULL);
        else return arg_unknown("moe-bench", help, a, more ? argv[i + 1] : NULL);
    }
    if (!o->n_models || o->n_decode < 1 || o->n_prefill < 1 || o->reps < 1) return usage("need -m MODEL");
    *done = 0;
    return 0;
}

/* One model on t threads: what every depth's line needs */
typedef struct {
    const options *o;
    moe_model *m;
    const moe_config *c;
    moe_model_info info;
    moe_session *s;
    int32_t *ids; /* random ids, as many as the context */
    float *logits;
    bw_buffer *probe;
    const char *name; /* the model path's last part */
    int t;
    double pf, peak; /* best prefill tok/s; the int8 peak */
    char err[512];
} bench;

/* prefill: the best of reps */
static int best_prefill(bench *b) {
    for (int r = 0; r < b->o->reps; r++) {
        moe_session_reset(b->s);
        moe_seq q = {.s = b->s, .tokens = b->ids, .n = b->o->n_prefill, .logits = b->logits};
        double t0 = now();
        if (moe_step(b->m, &q, 1, NULL, b->err, sizeof b->err)) return fprintf(stderr, "moe-bench: %s\n", b->err), 1;
        double tps = b->o->n_prefill / (now() - t0);
        b->pf = tps > b->pf ? tps : b->pf;
    }
    return 0;
}

/* Decode at context depth `depth`: one JSON line. The bandwidth swings within seconds on a
 * shared VM (30 to 67 GB/s seen), so one figure before a whole decode can be far from the one it
 * ran at. Decode runs in stretches of DECODE_STRETCH tokens with a bandwidth probe between each
 * two; a stretch's roofline time is its bytes over the better probe beside it, and the fraction is
 * the sum of those over the sum of the stretches' times. */
static int decode_at_depth(bench *b, int depth, double ops_per_token, double kda_state_bytes, int n_mla) {
    const options *o = b->o;
    const int t = b->t, n_decode = o->n_decode;
    moe_session_reset(b->s);
    if (depth) {
        moe_seq q = {.s = b->s, .tokens = b->ids, .n = depth};
        if (moe_step(b->m, &q, 1, NULL, b->err, sizeof b->err)) return fprintf(stderr, "moe-bench: %s\n", b->err), 1;
    }
    moe_step_stats ss;
    moe_seq q0 = {.s = b->s, .tokens = b->ids + depth, .n = 1, .logits = b->logits}; /* warm-up token */
    if (moe_step(b->m, &q0, 1, &ss, b->err, sizeof b->err)) return fprintf(stderr, "moe-bench: %s\n", b->err), 1;
    double bw_before = membw(b->probe, t, PROBE_PASSES);
    double roof_s = 0, time_s = 0, bytes = 0, bw_lo = bw_before, bw_hi = bw_before;
    for (int k = 1; k <= n_decode; k += DECODE_STRETCH) {
        const int nk = n_decode - k + 1 < DECODE_STRETCH ? n_decode - k + 1 : DECODE_STRETCH;
        double stretch_bytes = 0;
        const double t0 = now();
        for (int j = 0; j < nk; j++) {
            moe_seq q = {.s = b->s, .tokens = b->ids + depth + k + j, .n = 1, .logits = b->logits};
            if (moe_step(b->m, &q, 1, &ss, b->err, sizeof b->err)) return fprintf(stderr, "moe-bench: %s\n", b->err), 1;
            /* the token at position p reads the KDA states and p + 1 cached MLA rows */
            stretch_bytes += (double)b->info.dense_bytes_per_token + (double)ss.expert_bytes + kda_state_bytes +
                             (double)n_mla * (depth + k + j + 1) * kv_row_bytes(b->c, o->kv_type);
        }
        time_s += now() - t0;
        const double bw_after = membw(b->probe, t, PROBE_PASSES);
        const double bw = bw_after > bw_before ? bw_after : bw_before;
        roof_s += stretch_bytes / (bw * 1e9), bytes += stretch_bytes;
        bw_lo = bw_after < bw_lo ? bw_after : bw_lo, bw_hi = bw_after > bw_hi ? bw_after : bw_hi;
        bw_before = bw_after;
    }
    const double bw = bytes / roof_s / 1e9; /* the bandwidth the whole decode is taken against */
    fprintf(stderr, "moe-bench: %d thread(s), depth %d: memory read %.1f GB/s (probes %.1f to %.1f)\n", t, depth, bw, bw_lo, bw_hi);
    printf("{\"model\": \"%s\", \"format\": \"%s\", \"kernels\": \"%s\", \"kv_type\": \"%s\", \"threads\": %d, \"depth\": %d, \"membw_read_gbps\": %.2f, "
           "\"membw_min_gbps\": %.2f, \"membw_max_gbps\": %.2f, \"decode_tok_s\": %.3f, \"decode_bytes_per_token\": %.0f, \"decode_roofline_frac\": %.3f, "
           "\"prefill_tok_s\": %.2f, \"prefill_tokens\": %d, \"int8_peak_gops\": %.1f, \"prefill_peak_frac\": %.3f}\n",
           b->name, b->info.weight_type, b->info.kernels, o->kv_type == MOE_KV_Q8 ? "q8" : o->kv_type == MOE_KV_BF16 ? "bf16" : "f32", t, depth, bw,
           bw_lo, bw_hi, n_decode / time_s, bytes / n_decode, roof_s / time_s, b->pf, o->n_prefill, b->peak / 1e9, b->pf * ops_per_token / b->peak);
    fflush(stdout);
    return 0;
}

/* Model path on t threads: the int8 peak before and after the prefill (the better counts), the best
 * prefill, then a line per depth. */
static int bench_model(const options *o, const char *path, int t, const moe__kernels *picked, bw_buffer *probe) {
    bench b = {.o = o, .probe = probe, .t = t};
    b.name = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    b.peak = int8_peak(picked, t);
    fprintf(stderr, "moe-bench: %d thread(s): int8 kernel peak %.1f Gop/s\n", t, b.peak / 1e9);
    moe_options mo = moe_default_options();
    mo.n_threads = t;
    mo.kv_type = o->kv_type;
    mo.flags |= o->flags;
    mo.kernels = o->kernels;
    if (o->n_batch) mo.n_batch = o->n_batch;
    moe_status st = moe_model_open(&b.m, path, &mo, b.err, sizeof b.err);
    if (st) return fprintf(stderr, "moe-bench: %s: %s\n", moe_status_str(st), b.err), 1;
    const moe_config *c = b.c = moe_model_config(b.m);
    b.info = moe_model_get_info(b.m);
    int maxd = 0;
    for (int d = 0; d < o->n_depths; d++) maxd = o->depths[d] > maxd ? o->depths[d] : maxd;
    const int ctx = (maxd > o->n_prefill ? maxd : o->n_prefill) + o->n_decode + 1;
    b.ids = malloc(sizeof(int32_t) * (size_t)ctx);
    b.logits = malloc(sizeof(float) * (size_t)c->vocab_size);
    uint64_t rng = 12345;
    for (int i = 0; b.ids && i < ctx; i++) {
        b.ids[i] = (int32_t)(xorshift(&rng) % (uint64_t)c->vocab_size);
    }
    int rc = !b.ids || !b.logits ? fprintf(stderr, "moe-bench: out of memory\n") > 0 : 0;
    if (!rc && moe_session_new(&b.s, b.m, ctx, b.err, sizeof b.err)) rc = fprintf(stderr, "moe-bench: %s\n", b.err) > 0;
    if (!rc) rc = best_prefill(&b);
    if (!rc) {
        /* the peak drifts too (440 to 670 Gop/s within minutes on one VM): the better of the
         * figures before and after the prefill */
        const double peak_after = int8_peak(picked, t);
        fprintf(stderr, "moe-bench: %d thread(s): int8 kernel peak after the prefill %.1f Gop/s\n", t, peak_after / 1e9);
        if (peak_after > b.peak) b.peak = peak_after;
    }
    /* active parameters (2 ops each): everything a token touches but the embedding */
    const double ops_per_token = 2.0 * ((double)b.info.n_params_active - (double)c->vocab_size * c->hidden_size);
    int n_kda = 0, n_mla = 0;
    for (int l = 0; l < c->n_layers; l++) {
        if (c->layer_kind[l] == MOE_LAYER_KDA) n_kda++;
        else n_mla++;
    }
    /* each KDA layer reads and writes its f32 state once a token */
    const double kda_state_bytes = (double)n_kda * c->kda_heads * c->kda_head_dim * c->kda_head_dim * 4 * 2;
    for (int di = 0; di < o->n_depths && !rc; di++) rc = decode_at_depth(&b, o->depths[di], ops_per_token, kda_state_bytes, n_mla);
    moe_session_free(b.s);
    free(b.ids), free(b.logits);
    moe_model_close(b.m);
    return rc;
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--stream")) {
            for (int j = 1; j + 1 < argc; j++)
                if (!strcmp(argv[j], "-m")) return stream_bench(argv[j + 1], argc, argv);
            return usage("--stream needs -m DIR");
        }
    options o;
    int stop, rc = parse_args(argc, argv, &o, &stop);
    if (stop) return rc;
    moe__kernels picked; /* the set the models run: --kernels, or the CPU's best */
    char have[160];
    if (moe__kernels_pick(&picked, 0, o.kernels, have, sizeof have)) {
        fprintf(stderr, "moe-bench: --kernels %s: this CPU runs %s\n", o.kernels, have);
        return 2;
    }
    bw_buffer probe;
    if (bw_buffer_new(&probe, PROBE_BYTES)) { fprintf(stderr, "moe-bench: no memory for the bandwidth probe\n"); return 1; }
    for (int mi = 0; mi < o.n_models && !rc; mi++)
        for (int ti = 0; ti < o.n_threads && !rc; ti++) rc = bench_model(&o, o.models[mi], o.threads[ti] < 1 ? 1 : o.threads[ti], &picked, &probe);
    free(probe.a);
    return rc;
}
