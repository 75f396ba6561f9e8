/*
 * lat.h: what the bench's C programs share: a monotonic clock in ns, a xorshift
 * generator, and the comparison qsort needs to sort latencies. Written beside each
 * program's source by `programs::compile_c`.
 */
#ifndef PWFS_BENCH_LAT_H
#define PWFS_BENCH_LAT_H

#include <stdint.h>
#include <time.h>

static inline uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static inline uint64_t xorshift(uint64_t *x) {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

static inline int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

#endif
