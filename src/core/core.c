/*
 * core.c - status strings, the context's error message, logging, accounted
 * allocation, dtype facts and the clock. The bottom of the dependency graph:
 * knows nothing of models or communication.
 * Invariant: every fsdp__alloc block carries a header with its size and kind,
 * so fsdp__free can keep fsdp_mem_stats exact.
 */
#include "core/core-impl.h"

#include <cJSON.h>
#include <pthread.h>
#include <stdalign.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

const char *fsdp_status_str(enum fsdp_status st) {
    static const char *const names[] = {
#define FSDP_X_STR(name, str) str,
        FSDP_STATUS_LIST(FSDP_X_STR)
#undef FSDP_X_STR
    };
    if ((int)st < 0 || st >= FSDP_STATUS_COUNT) return "unknown status";
    return names[st];
}

size_t fsdp_dtype_size(enum fsdp_dtype dt) {
    switch (dt) {
    case FSDP_F32: case FSDP_I32: return 4;
    case FSDP_BF16: case FSDP_F16: case FSDP_U16: return 2;
    case FSDP_U8: return 1;
    case FSDP_I64: return 8;
    }
    return 0;
}

const char *fsdp_dtype_name(enum fsdp_dtype dt) {
    switch (dt) {
    case FSDP_F32: return "F32";
    case FSDP_BF16: return "BF16";
    case FSDP_F16: return "F16";
    case FSDP_I32: return "I32";
    case FSDP_U16: return "U16";
    case FSDP_U8: return "U8";
    case FSDP_I64: return "I64";
    }
    return "?";
}

int64_t fsdp_rows16_stride(int64_t n) { return (n + 15) / 16 * 16; }

int64_t fsdp_tensor_numel(const struct fsdp_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

/* ---- Context ---- */

enum fsdp_status fsdp__ctx_alloc(struct fsdp_ctx **out) {
    fsdp__json_hooks();
    struct fsdp_ctx *ctx = fsdp__zalloc(1, sizeof *ctx);
    if (!ctx) return FSDP_ERR_NOMEM;
    ctx->world = 1;
    *out = ctx;
    return FSDP_OK;
}

void fsdp__ctx_release(struct fsdp_ctx *ctx) {
    if (!ctx) return;
    fsdp__arena_free_all(ctx);
    free(ctx);
}

int fsdp_ctx_measuring(const struct fsdp_ctx *ctx) { return ctx && ctx->measure; }

/* [Note: measure mode] (src/fsdp/plan.c): names the module whose forward or backward failed in measure mode (the
 * innermost: the first to see the failure), once per run. */
enum fsdp_status fsdp__measure_failed(struct fsdp_ctx *ctx, const struct fsdp_module *m, const char *pass,
                                      enum fsdp_status st) {
    if (!ctx->measure || ctx->measure == 2) return st;
    char msg[sizeof ctx->errmsg];
    snprintf(msg, sizeof msg, "%s", ctx->errmsg);
    fsdp__err(ctx, st, "module '%s' (%s) cannot run its %s in measure mode: %s",
              !m->fqn ? m->name : m->fqn[0] ? m->fqn : "(root)", m->ops->type, pass, msg);
    ctx->measure = 2; /* named */
    return st;
}

int fsdp_ctx_rank(const struct fsdp_ctx *ctx) { return ctx->rank; }
int fsdp_ctx_world(const struct fsdp_ctx *ctx) { return ctx->world; }
const char *fsdp_errmsg(const struct fsdp_ctx *ctx) { return ctx ? ctx->errmsg : ""; }

/* ---- Errors ---- */

enum fsdp_status fsdp__err(struct fsdp_ctx *ctx, enum fsdp_status st, const char *fmt, ...) {
    if (ctx) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(ctx->errmsg, sizeof ctx->errmsg, fmt, ap);
        va_end(ap);
    }
    return st;
}

void (*fsdp__abort_hook)(int code);
int fsdp__global_rank;

_Noreturn void fsdp__assert_fail(const char *file, int line, const char *cond, const char *fmt, ...) {
    fprintf(stderr, "rank %d: %s:%d: assertion failed: %s: ", fsdp__global_rank, file, line, cond);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n");
    fflush(stderr);
    if (fsdp__abort_hook) fsdp__abort_hook(134);
    abort();
}

void fsdp__log(const struct fsdp_ctx *ctx, int level, const char *fmt, ...) {
    if (ctx && level > ctx->verbose) return;
    char buf[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (ctx && ctx->world > 1) fprintf(stderr, "[rank %d] %s\n", ctx->rank, buf);
    else fprintf(stderr, "%s\n", buf);
}

/* ---- Accounted allocation ----
 * Each block: [header (64 bytes): size, kind][payload, 64-byte aligned].
 *
 * [Note: large blocks are mapped]
 * Blocks of ALLOC_MAP_MIN bytes and more get pages of their own (mmap) and
 * return them at fsdp__free (munmap). Through malloc, glibc raises its mmap
 * threshold to the size of each mapped block freed (up to 32 MiB), so that
 * later blocks below that size land on the heap, where a free chunk below the
 * top stays resident: GPT-2 124M at 2 ranks peaked at 1.13x the accounted
 * bytes in RSS (bench/mem_plan.sh), within the plan with this. Sanitized
 * builds keep malloc, so that AddressSanitizer still guards and leak-checks
 * every block. */
#define MAP_MIN ((size_t)1 << 20)
#if defined(__SANITIZE_ADDRESS__)
#define ALLOC_MAP_MIN SIZE_MAX
#else
#define ALLOC_MAP_MIN MAP_MIN
#endif
#define COMMIT_PAGE ((size_t)4096) /* fsdp__commit's unit: a page the first write makes resident */

/* [Note: huge pages] A mapped block of THP_MIN bytes and more asks the
 * kernel for transparent huge pages (madvise MADV_HUGEPAGE; most kernels
 * give them only when asked: "madvise" in
 * /sys/kernel/mm/transparent_hugepage/enabled). Its first touch then faults
 * 2 MiB at a time instead of 4 KiB: fewer faults where faults are dear (a
 * VM that backs guest memory lazily paid about 25 us per 4 KiB page, the
 * activation arena's first steps and every fresh shard) and fewer TLB misses
 * in the products and element-wise passes over large tensors. What a block
 * costs in memory moves by at most a huge page at its ends. FSDP_THP=0
 * turns it off (the plain pages, for comparisons). */
#define THP_MIN ((size_t)2 << 20)
static int thp_wanted(void) {
    static int on = -1; /* read once; fsdp_ctx_create has checked the value */
    if (on < 0) on = (int)fsdp__env_checked("FSDP_THP", 1);
    return on;
}

struct alloc_hdr {
    size_t bytes;  /* accounted: the payload, or what fsdp__commit counted of a reserved block */
    size_t size;   /* the payload */
    int kind;
    int mapped;    /* pages of its own (munmap at free), else a malloc block */
    char pad[64 - 2 * sizeof(size_t) - 2 * sizeof(int)];
};

/* A measuring context's large blocks are always mapped, reserved and never
 * touched ([Note: measure mode] in src/fsdp/plan.c), sanitized builds too:
 * through malloc, AddressSanitizer's allocator would commit (and calloc
 * zero) every byte of a plan that may be far larger than the host. */
static int alloc_mapped(const struct fsdp_ctx *ctx, size_t bytes) {
    return bytes >= ALLOC_MAP_MIN || (ctx && ctx->measure && bytes >= MAP_MIN);
}

static void mem_add(struct fsdp_ctx *ctx, int kind, size_t bytes) {
    struct fsdp_mem_stats *m = &ctx->mem;
    m->cur[kind] += bytes;
    if (m->cur[kind] > m->peak[kind]) m->peak[kind] = m->cur[kind];
    m->cur_total += bytes;
    if (m->cur_total > m->peak_total) m->peak_total = m->cur_total;
}

static void mem_sub(struct fsdp_ctx *ctx, int kind, size_t bytes) {
    ctx->mem.cur[kind] -= bytes;
    ctx->mem.cur_total -= bytes;
}

_Thread_local long fsdp__alloc_count, fsdp__alloc_fail_at;
long fsdp__alloc_failures;
int fsdp__measuring;

/* Counts one library allocation of this thread; 1 if failure injection
 * fails it (core-impl.h). */
static int alloc_tick(void) { return ++fsdp__alloc_count == fsdp__alloc_fail_at; }

static void *failed(void) {
    __atomic_add_fetch(&fsdp__alloc_failures, 1, __ATOMIC_RELAXED);
    return NULL;
}

static const char *mem_kind_name(enum fsdp_mem_kind kind) {
    static const char *const names[FSDP_MEM_KIND_COUNT] = {"shards", "full buffers", "activations",
                                                           "unsharded parameters", "other"};
    return (int)kind >= 0 && kind < FSDP_MEM_KIND_COUNT ? names[kind] : "?";
}

/* 0 if `bytes` more fit under ctx's memory limit, else -1 with the error set. */
static int within_limit(struct fsdp_ctx *ctx, size_t bytes, enum fsdp_mem_kind kind, const char *what) {
    if (!ctx || !ctx->mem_limit || (bytes <= ctx->mem_limit && ctx->mem.cur_total <= ctx->mem_limit - bytes))
        return 0;
    fsdp__err(ctx, FSDP_ERR_NOMEM,
              "memory limit of %zu bytes per rank exceeded allocating %zu bytes for %s (%s); "
              "%zu bytes in use", ctx->mem_limit, bytes, what ? what : "?", mem_kind_name(kind),
              ctx->mem.cur_total);
    return -1;
}

/* fsdp__alloc, accounting the payload (reserve == 0) or nothing yet (a
 * reserved block: fsdp__commit accounts it as it is used). */
static void *alloc_block(struct fsdp_ctx *ctx, size_t bytes, enum fsdp_mem_kind kind, const char *what,
                         int reserve) {
    void *raw = NULL;
    int inject = alloc_tick();
    if (!reserve && within_limit(ctx, bytes, kind, what)) return NULL;
    int map = alloc_mapped(ctx, bytes);
    if (inject || bytes > SIZE_MAX - 128) {
        raw = NULL;
    } else if (map) { /* [Note: large blocks are mapped] */
        raw = mmap(NULL, sizeof(struct alloc_hdr) + bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | (ctx && ctx->measure ? MAP_NORESERVE : 0), -1, 0);
        if (raw == MAP_FAILED) raw = NULL;
#ifdef MADV_HUGEPAGE
        else if (bytes >= THP_MIN && !(ctx && ctx->measure) && thp_wanted()) /* [Note: huge pages] */
            (void)madvise(raw, sizeof(struct alloc_hdr) + bytes, MADV_HUGEPAGE); /* a hint: refused is fine */
#endif
    } else if (posix_memalign(&raw, 64, sizeof(struct alloc_hdr) + bytes) != 0) {
        raw = NULL;
    }
    if (!raw) {
        fsdp__err(ctx, FSDP_ERR_NOMEM, "out of memory allocating %zu bytes for %s", bytes,
                  what ? what : "?");
        return failed();
    }
    struct alloc_hdr *h = raw;
    h->bytes = reserve ? 0 : bytes;
    h->size = bytes;
    h->mapped = map;
    h->kind = (int)kind;
    if (ctx) mem_add(ctx, (int)kind, h->bytes);
    return h + 1;
}

void *fsdp__alloc(struct fsdp_ctx *ctx, size_t bytes, enum fsdp_mem_kind kind, const char *what) {
    return alloc_block(ctx, bytes, kind, what, 0);
}

void *fsdp__reserve(struct fsdp_ctx *ctx, size_t bytes, enum fsdp_mem_kind kind, const char *what) {
    return alloc_block(ctx, bytes, kind, what, 1);
}

void *fsdp__reserve_span(struct fsdp_ctx *ctx, enum fsdp_mem_kind kind, size_t min, size_t *bytes) {
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    size_t span = pages > 0 && psz > 0 ? (size_t)pages * (size_t)psz : 0;
    if (ctx && ctx->mem_limit && ctx->mem_limit < span) span = ctx->mem_limit;
    /* mapped in sanitized builds too: a chunk is one block to AddressSanitizer
     * either way (no guards between the arena's allocations) */
    if (span < min || !span || !fsdp__env_checked("FSDP_ARENA_SPAN", 1)) return NULL; /* chunks asked for */
    void *raw = mmap(NULL, sizeof(struct alloc_hdr) + span, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) return NULL;
#ifdef MADV_HUGEPAGE
    if (!(ctx && ctx->measure) && thp_wanted()) /* [Note: huge pages] */
        (void)madvise(raw, sizeof(struct alloc_hdr) + span, MADV_HUGEPAGE);
#endif
    struct alloc_hdr *h = raw;
    h->bytes = 0;
    h->size = span;
    h->mapped = 1;
    h->kind = (int)kind;
    *bytes = span;
    return h + 1;
}

int fsdp__commit(struct fsdp_ctx *ctx, void *p, size_t upto, const char *what) {
    struct alloc_hdr *h = (struct alloc_hdr *)p - 1;
    size_t want = (upto + COMMIT_PAGE - 1) & ~(COMMIT_PAGE - 1);
    if (want > h->size) want = h->size; /* the block's last page */
    if (want <= h->bytes) return 0;
    if (within_limit(ctx, want - h->bytes, (enum fsdp_mem_kind)h->kind, what)) return -1;
    if (ctx) mem_add(ctx, h->kind, want - h->bytes);
    h->bytes = want;
    return 0;
}

int fsdp__mem_count(struct fsdp_ctx *ctx, enum fsdp_mem_kind kind, size_t bytes, int add, const char *what) {
    if (!ctx) return 0;
    if (!add) {
        mem_sub(ctx, (int)kind, bytes);
        return 0;
    }
    if (within_limit(ctx, bytes, kind, what)) return -1;
    mem_add(ctx, (int)kind, bytes);
    return 0;
}

void *fsdp__calloc(struct fsdp_ctx *ctx, size_t bytes, enum fsdp_mem_kind kind, const char *what) {
    void *p = fsdp__alloc(ctx, bytes, kind, what);
    if (p && !((struct alloc_hdr *)p - 1)->mapped) memset(p, 0, bytes); /* fresh pages are zero */
    return p;
}

void fsdp__free(struct fsdp_ctx *ctx, void *p) {
    if (!p) return;
    struct alloc_hdr *h = (struct alloc_hdr *)p - 1;
    if (ctx) mem_sub(ctx, h->kind, h->bytes);
    if (h->mapped) munmap(h, sizeof *h + h->size);
    else free(h);
}

/* ---- Unaccounted allocation ----
 * Names, pointer arrays, parser output and other bookkeeping: plain malloc
 * blocks (freed with free), not accounted per kind, but counted and failed
 * by the injection hook like fsdp__alloc, so that the allocation-failure
 * tests reach every allocation of the library. cJSON allocates through
 * fsdp__malloc too (fsdp__json_hooks). */
void *fsdp__malloc(size_t n) {
    if (alloc_tick()) return failed();
    void *p = malloc(n ? n : 1);
    return p ? p : failed();
}

void *fsdp__zalloc(size_t n, size_t size) {
    if (alloc_tick()) return failed();
    void *p = calloc(n ? n : 1, size ? size : 1);
    return p ? p : failed();
}

void *fsdp__realloc(void *p, size_t n) {
    if (alloc_tick()) return failed();
    void *q = realloc(p, n ? n : 1);
    return q ? q : failed();
}

char *fsdp__strdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = fsdp__malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

const char *fsdp__shown(const void *v, size_t n, char *buf, size_t cap) {
    const uint8_t *s = v;
    size_t o = 0;
    for (size_t i = 0; i < n && o + 8 < cap; i++) {
        if (i >= 40) {
            memcpy(buf + o, "...", 3);
            o += 3;
            break;
        }
        if (s[i] >= 0x20 && s[i] < 0x7F && s[i] != '"' && s[i] != '\\') buf[o++] = (char)s[i];
        else o += (size_t)snprintf(buf + o, cap - o, "\\x%02X", s[i]);
    }
    buf[o] = 0;
    return buf;
}

static void *json_malloc(size_t n) { return fsdp__malloc(n); }

static void json_hooks_once(void) {
    cJSON_Hooks h = {json_malloc, free};
    cJSON_InitHooks(&h);
}

void fsdp__json_hooks(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, json_hooks_once);
}

void fsdp_mem_get(const struct fsdp_ctx *ctx, struct fsdp_mem_stats *out) { *out = ctx->mem; }

void fsdp_mem_set_limit(struct fsdp_ctx *ctx, size_t bytes) { ctx->mem_limit = bytes; }
size_t fsdp_mem_limit(const struct fsdp_ctx *ctx) { return ctx->mem_limit; }

void fsdp_mem_reset_peak(struct fsdp_ctx *ctx) {
    for (int k = 0; k < FSDP_MEM_KIND_COUNT; k++) ctx->mem.peak[k] = ctx->mem.cur[k];
    ctx->mem.peak_total = ctx->mem.cur_total;
}

size_t fsdp_peak_rss_bytes(void) {
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0) return 0;
    return (size_t)ru.ru_maxrss * 1024u;
}

size_t fsdp_shared_rss_bytes(void) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return 0;
    char line[256];
    unsigned long long kb = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "RssShmem: %llu kB", &kb) == 1) break;
    fclose(f);
    return (size_t)kb * 1024u;
}

double fsdp__now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
