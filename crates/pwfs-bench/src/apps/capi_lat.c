/*
 * capi_lat.c: the time of one cached 4 KiB read through Patchwork's C ABI (pwfs.h,
 * libpwfs.so), the engine inside this process. Usage: capi_lat IMAGE SIZE_MIB N SEED.
 * Formats IMAGE (created at SIZE_MIB * 2 + 64 MiB), mounts it with the default options,
 * writes a file of SIZE_MIB MiB, fsyncs it and reads it whole, preads N/10 random pages
 * untimed, then N random 4 KiB-aligned pages one at a time, each timed with
 * CLOCK_MONOTONIC. Prints "p50_ns=P mean_ns=M n=N"; exits 1 on an error. Built and run
 * by `pwfs bench apps`.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "lat.h"
#include "pwfs.h"

#define PAGE 4096
#define CHUNK (1 << 20)

static int fail(const char *what, int err) {
    fprintf(stderr, "capi_lat: %s: %s\n", what, strerror(err));
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: capi_lat IMAGE SIZE_MIB N SEED\n");
        return 2;
    }
    const char *image = argv[1];
    uint64_t mib = strtoull(argv[2], NULL, 10);
    long n = atol(argv[3]);
    uint64_t rng = strtoull(argv[4], NULL, 10) | 1;
    int err = 0;
    static char buf[CHUNK];
    if (mib == 0 || n <= 0)
        return fail("arguments", EINVAL);

    if (pwfs_mkfs(image, strlen(image), (mib * 2 + 64) << 20, "", 0, &err) != 0)
        return fail("pwfs_mkfs", err);
    struct pwfs_fs *fs = pwfs_mount(image, strlen(image), "", 0, &err);
    if (fs == NULL)
        return fail("pwfs_mount", err);
    struct pwfs_file *f = pwfs_open(fs, "/data", 5, O_RDWR | O_CREAT | O_TRUNC, 0644, &err);
    if (f == NULL)
        return fail("pwfs_open", err);
    memset(buf, 0x5a, sizeof buf);
    for (uint64_t i = 0; i < mib; i++)
        if (pwfs_pwrite(f, buf, CHUNK, i * CHUNK, &err) != CHUNK)
            return fail("pwfs_pwrite", err);
    if (pwfs_fsync(f, &err) != 0)
        return fail("pwfs_fsync", err);
    for (uint64_t i = 0; i < mib; i++)
        if (pwfs_pread(f, buf, CHUNK, i * CHUNK, &err) != CHUNK)
            return fail("warm-up pwfs_pread", err);

    uint64_t pages = mib * CHUNK / PAGE;
    uint64_t *lat = malloc(sizeof *lat * (size_t)n);
    if (lat == NULL)
        return fail("malloc", ENOMEM);
    for (long i = -(n / 10); i < n; i++) {
        uint64_t off = (xorshift(&rng) % pages) * PAGE;
        uint64_t t = now_ns();
        if (pwfs_pread(f, buf, PAGE, off, &err) != PAGE)
            return fail("pwfs_pread", err);
        uint64_t d = now_ns() - t;
        if (i >= 0)
            lat[i] = d;
    }
    double sum = 0;
    for (long i = 0; i < n; i++)
        sum += (double)lat[i];
    qsort(lat, (size_t)n, sizeof *lat, cmp_u64);
    printf("p50_ns=%llu mean_ns=%.1f n=%ld\n", (unsigned long long)lat[n / 2], sum / (double)n, n);
    if (pwfs_close(f, &err) != 0)
        return fail("pwfs_close", err);
    if (pwfs_unmount(fs, &err) != 0)
        return fail("pwfs_unmount", err);
    return 0;
}
