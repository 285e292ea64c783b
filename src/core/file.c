/*
 * file.c - opening the files the library reads (token files, model configs,
 * safetensors files, meta.json) so that no path can hang the reader.
 * [Note: regular files only]: a path may name a FIFO, a socket or a device.
 * A blocking open of a FIFO waits for a writer that may never come, and a
 * read of a character device may never end, so every reader opens with
 * O_NONBLOCK (which returns at once for all of these), refuses what fstat
 * says is not a regular file, naming the path and what it is, and only then
 * makes the descriptor blocking again. fsdp_open_regular (public: the tools
 * open their inputs with it too) is that open; fsdp__open_regular words its
 * failures for the context.
 */
#include "core/core-impl.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *file_kind(mode_t m) {
    return S_ISDIR(m) ? "a directory" : S_ISFIFO(m) ? "a FIFO" : S_ISSOCK(m) ? "a socket"
           : S_ISCHR(m) ? "a character device" : S_ISBLK(m) ? "a block device" : "not a plain file";
}

int fsdp_open_regular(const char *path, uint64_t *size, const char **kind) {
    if (kind) *kind = NULL;
    if (size) *size = 0;
    int f = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY), e = 0;
    struct stat sb;
    if (f < 0) return -1;
    if (fstat(f, &sb) != 0) {
        e = errno;
    } else if (!S_ISREG(sb.st_mode)) {
        if (kind) *kind = file_kind(sb.st_mode);
        e = EINVAL;
    } else {
        int fl = fcntl(f, F_GETFL);
        if (fl < 0 || fcntl(f, F_SETFL, fl & ~O_NONBLOCK) != 0) e = errno;
    }
    if (e) {
        close(f);
        errno = e;
        return -1;
    }
    if (size) *size = (uint64_t)sb.st_size;
    return f;
}

enum fsdp_status fsdp__open_regular(struct fsdp_ctx *ctx, const char *what, const char *path, int *fd,
                                    uint64_t *size) {
    const char *sp = what ? " '" : "", *ep = what ? "'" : "", *kind;
    if (!what) what = "";
    *fd = fsdp_open_regular(path, size, &kind);
    if (*fd >= 0) return FSDP_OK;
    if (kind)
        return fsdp__err(ctx, FSDP_ERR_IO, "%s%s%s%s: not a regular file (%s)", what, sp, path, ep, kind);
    return fsdp__err(ctx, FSDP_ERR_IO, "%s%s%s%s: cannot open: %s", what, sp, path, ep, strerror(errno));
}

enum fsdp_status fsdp__read_file(struct fsdp_ctx *ctx, const char *what, const char *path, size_t max,
                                 char **out, size_t *len) {
    *out = NULL;
    if (len) *len = 0;
    int fd;
    uint64_t size;
    FSDP_TRY(fsdp__open_regular(ctx, what, path, &fd, &size));
    const char *sp = what ? " '" : "", *ep = what ? "'" : "";
    if (!what) what = "";
    /* one byte more than the limit: a file that grew past it shows */
    size_t cap = size <= max ? (size_t)size + 1 : max + 1;
    char *buf = fsdp__malloc(cap + 1);
    if (!buf) {
        close(fd);
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "%s%s%s%s: out of memory reading it", what, sp, path, ep);
    }
    size_t n = 0;
    while (n < cap) {
        ssize_t r = read(fd, buf + n, cap - n);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            int e = errno;
            close(fd);
            free(buf);
            return fsdp__err(ctx, FSDP_ERR_IO, "%s%s%s%s: cannot read: %s", what, sp, path, ep, strerror(e));
        }
        if (r == 0) break;
        n += (size_t)r;
        if (n == cap && cap <= max) { /* grew since fstat: take up to max + 1 */
            size_t ncap = max + 1;
            char *nb = fsdp__realloc(buf, ncap + 1);
            if (!nb) break;
            buf = nb;
            cap = ncap;
        }
    }
    close(fd);
    if (n > max) {
        free(buf);
        return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s%s%s%s: larger than %zu bytes", what, sp, path, ep, max);
    }
    buf[n] = 0;
    *out = buf;
    if (len) *len = n;
    return FSDP_OK;
}
