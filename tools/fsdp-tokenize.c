/*
 * fsdp-tokenize - encodes a text file with GPT-2's byte-level BPE into an
 * llm.c token file (256 int32 header words: magic 20240520, version 1, token
 * count; then uint16 tokens), which fsdp-train --data reads.
 *
 *   fsdp-tokenize --tokenizer DIR IN.txt OUT.bin
 *   fsdp-tokenize --tokenizer DIR --decode IN.bin OUT.txt   (the way back)
 *
 * DIR holds encoder.json and vocab.bpe (GPT-2's), or tokenizer.json (Hugging
 * Face). The input is read in chunks cut where encoding is unaffected
 * (fsdp_bpe_split), with a progress bar on a terminal for inputs of 4 MiB
 * and more. OUT is written as OUT.tmp and renamed when complete; an existing OUT or
 * OUT.tmp that is not a token file (and any existing --decode output) is refused,
 * as is an OUT or OUT.tmp that is IN itself (by another name or a link). IN and
 * the tokenizer's files must be regular files (a FIFO is refused, not waited on).
 * A failed run removes the file it was writing ([Note: what a failed run leaves]).
 * Exit: 0 done, 1 failure (one line naming the file), 2 usage.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "fsdp.h"

#define CHUNK ((size_t)1 << 20)

static const char *usage_text =
    "usage: fsdp-tokenize --tokenizer DIR [--quiet] IN.txt OUT.bin\n"
    "       fsdp-tokenize --tokenizer DIR --decode IN.bin OUT.txt\n"
    "  Encodes IN.txt (any bytes) with GPT-2's byte-level BPE from DIR (encoder.json +\n"
    "  vocab.bpe, or tokenizer.json) into the llm.c token file OUT.bin, or decodes one.\n"
    "  --quiet   no progress bar and no summary line\n";

/* [Note: what a failed run leaves]
 * A writer deletes only what it made. `made` is the file this run is writing:
 * the --decode output, which it created (O_EXCL), or OUT.tmp, which it created
 * or took over as a crashed run's. die() and SIGINT, SIGTERM or SIGHUP remove
 * it, so that a failed run (a truncated input, a full disk) leaves no partial
 * output for a rerun to refuse as not ours. It is cleared once the output is
 * complete; OUT, once renamed into place, is never removed. */
static const char *volatile made;

static void on_signal(int sig) {
    const char *p = made;
    if (p) unlink(p);
    signal(sig, SIG_DFL);
    raise(sig);
}

static _Noreturn void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("fsdp-tokenize: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    const char *p = made;
    made = NULL;
    if (p) unlink(p);
    exit(1);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void progress(size_t done, size_t total, double t0) {
    int width = 40, fill = total ? (int)((double)done / (double)total * width) : width;
    double dt = now_s() - t0;
    fprintf(stderr, "\r[%.*s%*s] %5.1f%%  %.1f / %.1f MB  %.1f MB/s ", fill,
            "========================================", width - fill, "",
            total ? 100.0 * (double)done / (double)total : 100.0, (double)done / 1e6, (double)total / 1e6,
            dt > 0 ? (double)done / 1e6 / dt : 0.0);
    fflush(stderr);
}

/* Opens path to read, refusing a FIFO, a socket or a device at once
 * (fsdp_open_regular). Returns the descriptor; *size (unless NULL) is the
 * file's length. */
static int open_regular(const char *path, size_t *size) {
    uint64_t n;
    const char *kind;
    int fd = fsdp_open_regular(path, &n, &kind);
    if (fd < 0 && kind) die("'%s' is not a regular file (%s)", path, kind);
    if (fd < 0) die("cannot open '%s': %s", path, strerror(errno));
    if (size) *size = (size_t)n;
    return fd;
}

/* Refuses a path the output is written to (OUT, or OUT.tmp for OUT) that
 * names the input file: the same name, a symlink to it or a hard link (the
 * same device and inode), before anything is written; writing it would
 * replace the input with its own encoding. A path that does not exist yet
 * names no file. */
static void refuse_same_file(const char *in, const char *path, const char *out) {
    struct stat si, so;
    if (stat(in, &si) != 0 || stat(path, &so) != 0 || si.st_dev != so.st_dev || si.st_ino != so.st_ino) return;
    if (path == out) die("'%s' and '%s' are the same file: refusing to write the output over the input", in, out);
    die("'%s' and '%s' (where '%s' is written before it is renamed) are the same file: refusing to write "
        "the output over the input", in, path, out);
}

/* A writer replaces only what it made: an existing `path` must be, when
 * token_file, an llm.c token file (what this tool writes) or, for OUT.tmp,
 * empty (a crashed run's); any other existing file, and any existing
 * --decode output, is refused by name. lstat does not block on a FIFO. */
static void check_replaceable(const char *path, int token_file, int may_be_empty) {
    struct stat sb;
    if (lstat(path, &sb) != 0) return;
    int ours = 0;
    if (S_ISREG(sb.st_mode) && token_file) {
        if (sb.st_size == 0) ours = may_be_empty;
        else {
            int32_t h[2] = {0, 0};
            FILE *f = fopen(path, "rb");
            ours = f && fread(h, sizeof h, 1, f) == 1 && h[0] == 20240520 && h[1] == 1;
            if (f) fclose(f);
        }
    }
    if (!ours)
        die("'%s' exists and is not %s: refusing to replace it (choose another name, or move it away)", path,
            token_file ? "an llm.c token file" : "ours to replace");
}

/* --decode: an llm.c token file back to bytes. */
static int decode_file(struct fsdp_ctx *ctx, struct fsdp_bpe *bpe, const char *in, const char *out) {
    size_t bytes;
    FILE *f = fdopen(open_regular(in, &bytes), "rb");
    if (!f) die("cannot read '%s': %s", in, strerror(errno));
    int32_t h[256];
    if (fread(h, sizeof h, 1, f) != 1 || h[0] != 20240520 || h[1] != 1 || h[2] < 0)
        die("'%s' is not an llm.c token file (magic 20240520, version 1)", in);
    /* the size fsdp-train --data requires (src/io/data.c): bytes past the
     * header's count were once left out of the text without a word */
    size_t want = sizeof h + 2 * (size_t)h[2];
    if (bytes != want)
        die("'%s': llm.c header says %d tokens (%zu bytes in all) but the file has %zu bytes", in, h[2], want, bytes);
    check_replaceable(out, 0, 0);
    /* O_EXCL: the file is this run's to remove on failure ([Note: what a failed run leaves]) */
    int ofd = open(out, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (ofd < 0) die("cannot create '%s': %s", out, strerror(errno));
    made = out;
    FILE *o = fdopen(ofd, "wb");
    if (!o) die("cannot write '%s': %s", out, strerror(errno));
    uint16_t t;
    for (int32_t i = 0; i < h[2]; i++) {
        if (fread(&t, 2, 1, f) != 1) die("'%s': the header says %d tokens, the file ends at %d", in, h[2], i);
        size_t len;
        const void *s = fsdp_bpe_token(bpe, t, &len);
        if (!s) die("'%s': token %u at position %d is not in the tokenizer's vocabulary", in, (unsigned)t, i);
        if (fwrite(s, 1, len, o) != len) die("cannot write '%s': %s", out, strerror(errno));
    }
    if (fclose(o) != 0) die("cannot write '%s': %s", out, strerror(errno));
    made = NULL;
    fclose(f);
    fsdp_bpe_free(bpe);
    fsdp_ctx_free(ctx);
    return 0;
}

int main(int argc, char **argv) {
    char env_msg[768];
    if (fsdp_env_check(env_msg, sizeof env_msg) != FSDP_OK) {
        fprintf(stderr, "fsdp-tokenize: error: %s\n", env_msg);
        return 2;
    }
    const char *dir = NULL, *in = NULL, *out = NULL;
    int quiet = 0, decode = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(usage_text, stdout);
            return 0;
        } else if (!strcmp(argv[i], "--tokenizer") && i + 1 < argc) {
            dir = argv[++i];
        } else if (!strcmp(argv[i], "--quiet")) {
            quiet = 1;
        } else if (!strcmp(argv[i], "--decode")) {
            decode = 1;
        } else if (argv[i][0] == '-' && argv[i][1]) {
            fprintf(stderr, "fsdp-tokenize: unknown or incomplete option '%s'\n%s", argv[i], usage_text);
            return 2;
        } else if (!in) {
            in = argv[i];
        } else if (!out) {
            out = argv[i];
        } else {
            fprintf(stderr, "fsdp-tokenize: unexpected argument '%s'\n%s", argv[i], usage_text);
            return 2;
        }
    }
    if (!dir || !in || !out) {
        fprintf(stderr, "fsdp-tokenize: need --tokenizer DIR, IN.txt and OUT.bin\n%s", usage_text);
        return 2;
    }
    size_t tl = strlen(out) + 5;
    char *tmp = malloc(tl);
    if (!tmp) die("out of memory");
    snprintf(tmp, tl, "%s.tmp", out);
    refuse_same_file(in, out, out);
    if (!decode) refuse_same_file(in, tmp, out);
    struct sigaction sa = {.sa_handler = on_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.comm = FSDP_COMM_SELF;
    struct fsdp_ctx *ctx;
    if (fsdp_ctx_create(&co, &ctx) != FSDP_OK) die("cannot create a context");
    struct fsdp_bpe *bpe;
    if (fsdp_bpe_open(ctx, dir, &bpe) != FSDP_OK) die("--tokenizer: %s", fsdp_errmsg(ctx));
    if (fsdp_bpe_vocab_size(bpe) > 65536)
        die("--tokenizer '%s': %d ids do not fit the 16-bit tokens of an llm.c file", dir,
            fsdp_bpe_vocab_size(bpe));
    if (decode) {
        free(tmp);
        return decode_file(ctx, bpe, in, out);
    }

    size_t n;
    int fd = open_regular(in, &n);
    const uint8_t *text = NULL;
    if (n) {
        void *m = mmap(NULL, n, PROT_READ, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED) die("cannot map '%s': %s", in, strerror(errno));
        madvise(m, n, MADV_SEQUENTIAL);
        text = m;
    }
    close(fd);

    check_replaceable(out, 1, 0);
    check_replaceable(tmp, 1, 1);
    FILE *f = fopen(tmp, "wb");
    if (!f) die("cannot create '%s': %s", tmp, strerror(errno));
    made = tmp;
    int32_t header[256] = {20240520, 1, 0};
    if (fwrite(header, sizeof header, 1, f) != 1) die("cannot write '%s': %s", tmp, strerror(errno));

    int bar = !quiet && isatty(2) && n >= ((size_t)4 << 20);
    size_t cap = CHUNK + 4096, ntok = 0;
    int32_t *ids = malloc(cap * sizeof *ids);
    uint16_t *u16 = malloc(cap * sizeof *u16);
    if (!ids || !u16) die("out of memory");
    double t0 = now_s(), last = 0;
    for (size_t p = 0; p < n;) {
        size_t e = p + CHUNK >= n ? n : fsdp_bpe_split(text, n, p + CHUNK);
        if (e - p > cap) { /* no cut point for a long way: one long run */
            cap = e - p;
            free(ids);
            free(u16);
            ids = malloc(cap * sizeof *ids);
            u16 = malloc(cap * sizeof *u16);
            if (!ids || !u16) die("out of memory for a run of %zu bytes without a cut point", cap);
        }
        size_t k;
        if (fsdp_bpe_encode(bpe, text + p, e - p, ids, &k) != FSDP_OK) die("'%s': %s", in, fsdp_errmsg(ctx));
        for (size_t i = 0; i < k; i++) u16[i] = (uint16_t)ids[i];
        if (fwrite(u16, sizeof *u16, k, f) != k) die("cannot write '%s': %s", tmp, strerror(errno));
        ntok += k;
        p = e;
        if (bar && (now_s() - last > 0.1 || p == n)) {
            progress(p, n, t0);
            last = now_s();
        }
    }
    double dt = now_s() - t0;
    if (bar) fputc('\n', stderr);
    if (ntok > 0x7fffffff) die("'%s': %zu tokens do not fit an llm.c header's int32 count", in, ntok);
    header[2] = (int32_t)ntok;
    if (fseek(f, 0, SEEK_SET) != 0 || fwrite(header, sizeof header, 1, f) != 1 || fflush(f) != 0 ||
        fsync(fileno(f)) != 0 || fclose(f) != 0)
        die("cannot write '%s': %s", tmp, strerror(errno));
    if (rename(tmp, out) != 0) die("cannot rename '%s' to '%s': %s", tmp, out, strerror(errno));
    made = NULL;
    if (!quiet)
        printf("%s: %zu bytes -> %zu tokens (%.2f bytes/token) in %.2f s, %.1f MB/s -> %s\n", in, n, ntok,
               ntok ? (double)n / (double)ntok : 0.0, dt, dt > 0 ? (double)n / 1e6 / dt : 0.0, out);
    if (text) munmap((void *)text, n);
    free(ids);
    free(u16);
    free(tmp);
    fsdp_bpe_free(bpe);
    fsdp_ctx_free(ctx);
    return 0;
}
