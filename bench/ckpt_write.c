/*
 * ckpt_write.c - the reference writers for bench/ckpt.sh: plain sequential
 * writes of BYTES bytes from memory into FILE (8 MiB pwrites, one fsync at
 * the end, as `dd conv=fsync` does), and what a checkpoint writer adds to
 * them, each measured alone:
 *   plain      pwrite + fsync                      (the reference)
 *   crc        CRC-32C of the bytes, no I/O        (the checksum cost)
 *   crc+write  CRC-32C then pwrite per chunk + fsync (the writer's old pattern)
 *   crc+kick   the same, starting writeback of each chunk as soon as it is
 *              written (sync_file_range), so the disk works while the CPU
 *              checksums the next chunk and the final fsync has little left
 * Usage: ckpt_write FILE BYTES [ROUNDS]   prints "name MB/s" per pattern
 * (best of ROUNDS, default 1); FILE is removed afterwards.
 */
#include "io/io-impl.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define CHUNK ((size_t)8 << 20)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* One pass; mode 0 plain, 1 crc only, 2 crc+write, 3 crc+write+kick. Returns seconds. */
static double run(const char *path, const uint8_t *buf, size_t bytes, int mode) {
    double t0 = now();
    int fd = -1;
    if (mode != 1) {
        fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (fd < 0) {
            perror(path);
            exit(1);
        }
    }
    uint32_t crc = 0;
    for (size_t off = 0; off < bytes; off += CHUNK) {
        size_t n = bytes - off < CHUNK ? bytes - off : CHUNK;
        const uint8_t *p = buf + off % (CHUNK * 4); /* a 32 MiB source, as a shard would be hot */
        if (mode >= 1) crc ^= fsdp__crc32c(0, p, n);
        if (mode == 1) continue;
        for (size_t done = 0; done < n;) {
            ssize_t w = pwrite(fd, p + done, n - done, (off_t)(off + done));
            if (w <= 0) {
                perror("pwrite");
                exit(1);
            }
            done += (size_t)w;
        }
        if (mode == 3) sync_file_range(fd, (off_t)off, (off_t)n, SYNC_FILE_RANGE_WRITE);
    }
    if (fd >= 0) {
        if (fsync(fd) != 0) perror("fsync");
        close(fd);
        unlink(path);
    }
    double t = now() - t0;
    if (crc == 0x12345678) printf(" "); /* keep the checksum alive */
    return t;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: ckpt_write FILE BYTES [ROUNDS]\n");
        return 2;
    }
    size_t bytes = (size_t)strtoull(argv[2], NULL, 10);
    int rounds = argc > 3 ? atoi(argv[3]) : 1;
    uint8_t *buf = malloc(CHUNK * 5);
    if (!buf) return 1;
    for (size_t i = 0; i < CHUNK * 5; i++) buf[i] = (uint8_t)(i * 2654435761u >> 13);
    static const char *const names[] = {"plain", "crc", "crc+write", "crc+kick"};
    for (int mode = 0; mode < 4; mode++) {
        double best = 1e30;
        for (int r = 0; r < rounds; r++) {
            double t = run(argv[1], buf, bytes, mode);
            best = t < best ? t : best;
        }
        printf("%s %.0f\n", names[mode], (double)bytes / 1e6 / best);
    }
    free(buf);
    return 0;
}
