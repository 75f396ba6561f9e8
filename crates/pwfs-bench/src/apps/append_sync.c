/*
 * append_sync.c: small appends, each made durable, as a program sees them. Usage:
 * append_sync PATH SIZE COUNT [LATFILE]. Opens PATH (O_CREAT|O_WRONLY|O_TRUNC), makes
 * it durable (fsync, syncfs), appends WARM untimed records, then COUNT records of SIZE
 * random bytes at the end of the file (write(2)), each followed by fsync(2), each
 * write+fsync timed with CLOCK_MONOTONIC. Prints one line "ops_per_s p50_us p99_us"
 * (ops/s over the COUNT timed operations); exits 1 on an error.
 *
 * LATFILE: every timed operation's latency, us, one a line, written after the line
 * above. With APPEND_SYNC_HANDSHAKE set in the environment it first prints "ready"
 * (after the warm-up) and waits for a line on stdin before the timed operations, and
 * after printing its result waits for the end of stdin before writing LATFILE, closing
 * and exiting: the caller reads its counters exactly around the timed operations.
 * Built and run by `pwfs bench hitchhike` (the shim columns, under LD_PRELOAD).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "lat.h"

/* Untimed write+fsync pairs before the timed ones (as the bench's other columns). */
#define WARM 4

static void fill(unsigned char *buf, size_t n, uint64_t *rng) {
    for (size_t i = 0; i < n; i += 8) {
        uint64_t v = xorshift(rng);
        size_t k = n - i < 8 ? n - i : 8;
        memcpy(buf + i, &v, k);
    }
}

/* One record at the end of the file, then fsync. */
static int append_one(int fd, const unsigned char *buf, size_t size) {
    size_t done = 0;
    while (done < size) {
        ssize_t w = write(fd, buf + done, size - done);
        if (w <= 0) {
            perror("write");
            return -1;
        }
        done += (size_t)w;
    }
    if (fsync(fd) != 0) {
        perror("fsync");
        return -1;
    }
    return 0;
}

/* Reads stdin up to a newline (or its end). */
static void wait_line(void) {
    char c;
    while (read(0, &c, 1) == 1 && c != '\n') {
    }
}

int main(int argc, char **argv) {
    if (argc != 4 && argc != 5) {
        fprintf(stderr, "usage: append_sync PATH SIZE COUNT [LATFILE]\n");
        return 2;
    }
    long size = atol(argv[2]), n = atol(argv[3]);
    int handshake = getenv("APPEND_SYNC_HANDSHAKE") != NULL;
    if (size <= 0 || n <= 0) {
        fprintf(stderr, "append_sync: SIZE and COUNT must be positive\n");
        return 2;
    }
    uint64_t rng = 0x9e3779b97f4a7c15u ^ (uint64_t)size;
    unsigned char *buf = malloc((size_t)size);
    uint64_t *lat = malloc(sizeof *lat * (size_t)n);
    if (buf == NULL || lat == NULL) {
        perror("malloc");
        return 1;
    }
    int fd = open(argv[1], O_CREAT | O_WRONLY | O_TRUNC, 0644);
    if (fd < 0) {
        perror(argv[1]);
        return 1;
    }
    if (fsync(fd) != 0 || syncfs(fd) != 0) {
        perror("fsync/syncfs after create");
        return 1;
    }
    for (int i = 0; i < WARM; i++) {
        fill(buf, (size_t)size, &rng);
        if (append_one(fd, buf, (size_t)size) != 0)
            return 1;
    }
    if (handshake) {
        printf("ready\n");
        fflush(stdout);
        wait_line();
    }
    uint64_t start = now_ns();
    for (long i = 0; i < n; i++) {
        fill(buf, (size_t)size, &rng);
        uint64_t t = now_ns();
        if (append_one(fd, buf, (size_t)size) != 0)
            return 1;
        lat[i] = now_ns() - t;
    }
    double secs = (double)(now_ns() - start) / 1e9;
    uint64_t *sorted = malloc(sizeof *sorted * (size_t)n);
    if (sorted == NULL) {
        perror("malloc");
        return 1;
    }
    memcpy(sorted, lat, sizeof *lat * (size_t)n);
    qsort(sorted, (size_t)n, sizeof *sorted, cmp_u64);
    /* The bench's percentiles: the sample at round((n - 1) * q). */
    long p50 = (long)((double)(n - 1) * 0.5 + 0.5), p99 = (long)((double)(n - 1) * 0.99 + 0.5);
    printf("%.1f %.3f %.3f\n", (double)n / secs, (double)sorted[p50] / 1e3, (double)sorted[p99] / 1e3);
    fflush(stdout);
    if (handshake)
        wait_line();
    if (argc == 5) {
        FILE *f = fopen(argv[4], "w");
        if (f == NULL) {
            perror(argv[4]);
            return 1;
        }
        for (long i = 0; i < n; i++)
            fprintf(f, "%.3f\n", (double)lat[i] / 1e3);
        if (fclose(f) != 0) {
            perror(argv[4]);
            return 1;
        }
    }
    if (close(fd) != 0) {
        perror("close");
        return 1;
    }
    return 0;
}
