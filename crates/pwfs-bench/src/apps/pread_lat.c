/*
 * pread_lat.c: the time of one cached 4 KiB pread(2), as a program sees it. Usage:
 * pread_lat FILE N SEED. Reads FILE whole (so that every layer under this process
 * holds it: an LD_PRELOAD shim's, the file system's, the kernel's page cache), preads
 * N/10 random pages untimed, then N random 4 KiB-aligned pages one at a time, each
 * timed with CLOCK_MONOTONIC. Prints "p50_ns=P mean_ns=M n=N"; exits 1 on an error.
 * Built and run by `pwfs bench apps`.
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

#define PAGE 4096

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: pread_lat FILE N SEED\n");
        return 2;
    }
    long n = atol(argv[2]);
    uint64_t rng = strtoull(argv[3], NULL, 10) | 1;
    int fd = open(argv[1], O_RDONLY);
    if (fd < 0 || n <= 0) {
        perror(argv[1]);
        return 1;
    }
    off_t size = lseek(fd, 0, SEEK_END);
    uint64_t pages = (uint64_t)size / PAGE;
    static char buf[1 << 20];
    if (pages == 0) {
        fprintf(stderr, "%s: shorter than a page\n", argv[1]);
        return 1;
    }
    for (off_t off = 0; off < size;) {
        ssize_t r = pread(fd, buf, sizeof buf, off);
        if (r <= 0) {
            perror("warm-up read");
            return 1;
        }
        off += r;
    }
    uint64_t *lat = malloc(sizeof *lat * (size_t)n);
    if (lat == NULL) {
        perror("malloc");
        return 1;
    }
    for (long i = -(n / 10); i < n; i++) {
        off_t off = (off_t)(xorshift(&rng) % pages) * PAGE;
        uint64_t t = now_ns();
        if (pread(fd, buf, PAGE, off) != PAGE) {
            perror("pread");
            return 1;
        }
        uint64_t d = now_ns() - t;
        if (i >= 0)
            lat[i] = d;
    }
    double sum = 0;
    for (long i = 0; i < n; i++)
        sum += (double)lat[i];
    qsort(lat, (size_t)n, sizeof *lat, cmp_u64);
    printf("p50_ns=%llu mean_ns=%.1f n=%ld\n", (unsigned long long)lat[n / 2], sum / (double)n, n);
    close(fd);
    return 0;
}
