/*
 * smoke.c: the C ABI end to end, from C. Usage: smoke DIR (a scratch directory).
 * mkfs an image, mount, make a directory and files, write, fsync, read back, stat,
 * readdir, fallocate, truncate, rename, unlink, the error paths (err out-parameter),
 * pwrite from several threads on one handle, unmount, mount again, check the data.
 * Exits 0 with "smoke: N checks passed", 1 at the first failed check.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/falloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pwfs.h"

static int checks;

#define CHECK(cond)                                                                        \
    do {                                                                                   \
        checks++;                                                                          \
        if (!(cond)) {                                                                     \
            fprintf(stderr, "smoke.c:%d: check failed: %s (err %d: %s)\n", __LINE__, #cond, \
                    err, strerror(err));                                                   \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

/* Paths as pointer+length pairs from string literals. */
#define P(s) s, strlen(s)

#define THREADS 4
#define CHUNK 65536

struct job {
    struct pwfs_file *f;
    int id;
    int ok;
};

static void *writer(void *arg) {
    struct job *j = arg;
    static char bufs[THREADS][CHUNK];
    char *buf = bufs[j->id];
    int err = 0;
    memset(buf, 'A' + j->id, CHUNK);
    j->ok = pwfs_pwrite(j->f, buf, CHUNK, (uint64_t)j->id * CHUNK, &err) == CHUNK && err == 0;
    return NULL;
}

int main(int argc, char **argv) {
    int err = -1;
    char image[4096];
    char buf[8192];
    struct pwfs_stat st;
    struct pwfs_dirent de;
    const char *hello = "hello, pwfs";
    size_t n = strlen(hello);

    if (argc != 2) {
        fprintf(stderr, "usage: smoke DIR\n");
        return 2;
    }
    snprintf(image, sizeof image, "%s/smoke.img", argv[1]);

    CHECK(pwfs_mkfs(P(image), 64 << 20, P(""), &err) == 0 && err == 0);
    CHECK(pwfs_mount(P(image), P("cache=bogus"), &err) == NULL && err == EINVAL);
    CHECK(pwfs_mount(P("/nonexistent/pwfs.img"), P(""), &err) == NULL && err == ENOENT);
    struct pwfs_fs *fs = pwfs_mount(P(image), P("cache=16M,fetch=async-bg"), &err);
    CHECK(fs != NULL && err == 0);
    /* The image is locked while mounted. */
    CHECK(pwfs_mount(P(image), P(""), &err) == NULL && err != 0);

    CHECK(pwfs_mkdir(fs, P("/docs"), 0755, &err) == 0);
    CHECK(pwfs_mkdir(fs, P("/docs"), 0755, &err) == -1 && err == EEXIST);
    struct pwfs_file *f = pwfs_open(fs, P("/docs/a.txt"), O_RDWR | O_CREAT | O_EXCL, 0640, &err);
    CHECK(f != NULL && err == 0);
    CHECK(pwfs_open(fs, P("/docs/a.txt"), O_RDWR | O_CREAT | O_EXCL, 0640, &err) == NULL && err == EEXIST);
    CHECK(pwfs_write(f, hello, n, &err) == (ssize_t)n);
    CHECK(pwfs_pwrite(f, hello, n, 4096, &err) == (ssize_t)n);
    CHECK(pwfs_fsync(f, &err) == 0 && err == 0);
    CHECK(pwfs_fdatasync(f, &err) == 0);
    memset(buf, 0, sizeof buf);
    CHECK(pwfs_pread(f, buf, sizeof buf, 0, &err) == (ssize_t)(4096 + n));
    CHECK(memcmp(buf, hello, n) == 0 && buf[n] == 0 && memcmp(buf + 4096, hello, n) == 0);
    CHECK(pwfs_lseek(f, 4096, SEEK_SET, &err) == 4096);
    memset(buf, 0, sizeof buf);
    CHECK(pwfs_read(f, buf, sizeof buf, &err) == (ssize_t)n && memcmp(buf, hello, n) == 0);
    CHECK(pwfs_read(f, buf, sizeof buf, &err) == 0 && err == 0);
    CHECK(pwfs_lseek(f, -1, SEEK_SET, &err) == -1 && err == EINVAL);
    CHECK(pwfs_lseek(f, 0, SEEK_END, &err) == (int64_t)(4096 + n));
    CHECK(pwfs_fstat(f, &st, &err) == 0);
    CHECK(st.size == 4096 + n && S_ISREG(st.mode) && (st.mode & 07777) == 0640 && st.nlink == 1);
    uint64_t ino = st.ino;

    /* fallocate: preallocation past the end keeps the size; truncate sets it. */
    CHECK(pwfs_fallocate(f, FALLOC_FL_KEEP_SIZE, 8192, 65536, &err) == 0);
    CHECK(pwfs_fstat(f, &st, &err) == 0 && st.size == 4096 + n && st.blocks >= 65536 / 512);
    CHECK(pwfs_fallocate(f, 0x4000, 0, 4096, &err) == -1 && err == EOPNOTSUPP);
    CHECK(pwfs_ftruncate(f, 20000, &err) == 0);
    CHECK(pwfs_stat(fs, P("docs/a.txt"), &st, &err) == 0 && st.size == 20000 && st.ino == ino);

    /* Errors through err. */
    CHECK(pwfs_open(fs, P("/docs/missing"), O_RDONLY, 0, &err) == NULL && err == ENOENT);
    CHECK(pwfs_open(fs, P("/docs"), O_RDWR, 0, &err) == NULL && err == EISDIR);
    CHECK(pwfs_open(fs, P("/docs/a.txt"), O_RDONLY | O_DIRECTORY, 0, &err) == NULL && err == ENOTDIR);
    /* ... and before O_TRUNC could touch the file. */
    CHECK(pwfs_open(fs, P("/docs/a.txt"), O_WRONLY | O_TRUNC | O_DIRECTORY, 0, &err) == NULL && err == ENOTDIR);
    CHECK(pwfs_stat(fs, P("docs/a.txt"), &st, &err) == 0 && st.size == 20000);
    CHECK(pwfs_open(fs, P("/docs/a.txt"), O_RDWR | O_SYNC, 0, &err) == NULL && err == EINVAL);
    CHECK(pwfs_stat(fs, P("/nowhere/x"), &st, &err) == -1 && err == ENOENT);
    CHECK(pwfs_write(f, NULL, 10, &err) == -1 && err == EFAULT);
    CHECK(pwfs_write(NULL, hello, n, &err) == -1 && err == EINVAL);
    CHECK(pwfs_stat(fs, "/docs\0x", 7, &st, &err) == -1 && err == EINVAL);
    struct pwfs_file *ro = pwfs_open(fs, P("/docs/a.txt"), O_RDONLY, 0, &err);
    CHECK(ro != NULL);
    CHECK(pwfs_write(ro, hello, n, &err) == -1 && err == EBADF);
    CHECK(pwfs_close(ro, &err) == 0);
    /* A NULL err is allowed. */
    CHECK(pwfs_open(fs, P("/docs/missing"), O_RDONLY, 0, NULL) == NULL);

    /* Several threads on one handle. */
    struct pwfs_file *shared = pwfs_open(fs, P("/docs/shared"), O_RDWR | O_CREAT | O_TRUNC, 0600, &err);
    CHECK(shared != NULL);
    pthread_t tid[THREADS];
    struct job jobs[THREADS];
    for (int i = 0; i < THREADS; i++) {
        jobs[i] = (struct job){shared, i, 0};
        CHECK(pthread_create(&tid[i], NULL, writer, &jobs[i]) == 0);
    }
    for (int i = 0; i < THREADS; i++) {
        CHECK(pthread_join(tid[i], NULL) == 0 && jobs[i].ok);
    }
    CHECK(pwfs_fstat(shared, &st, &err) == 0 && st.size == THREADS * CHUNK);
    CHECK(pwfs_close(shared, &err) == 0);

    /* Unmount waits for handles to be closed. */
    CHECK(pwfs_unmount(fs, &err) == -1 && err == EBUSY);
    CHECK(pwfs_close(f, &err) == 0 && err == 0);

    /* Names. */
    CHECK(pwfs_rename(fs, P("/docs/a.txt"), P("/docs/b.txt"), &err) == 0);
    CHECK(pwfs_stat(fs, P("/docs/a.txt"), &st, &err) == -1 && err == ENOENT);
    struct pwfs_file *t = pwfs_open(fs, P("/docs/tmp"), O_WRONLY | O_CREAT, 0600, &err);
    CHECK(t != NULL && pwfs_close(t, &err) == 0);
    CHECK(pwfs_unlink(fs, P("/docs/tmp"), &err) == 0);
    CHECK(pwfs_unlink(fs, P("/docs/tmp"), &err) == -1 && err == ENOENT);
    CHECK(pwfs_unlink(fs, P("/docs"), &err) == -1 && err == EISDIR);
    CHECK(pwfs_rmdir(fs, P("/docs"), &err) == -1 && err == ENOTEMPTY);
    CHECK(pwfs_mkdir(fs, P("/empty"), 0700, &err) == 0);
    CHECK(pwfs_rmdir(fs, P("/empty"), &err) == 0);

    /* Listing. */
    struct pwfs_dir *d = pwfs_opendir(fs, P("/docs"), &err);
    CHECK(d != NULL);
    int seen_b = 0, seen_shared = 0, entries = 0, r;
    while ((r = pwfs_readdir(d, &de, &err)) == 1) {
        entries++;
        CHECK(strlen(de.name) == de.name_len);
        if (strcmp(de.name, "b.txt") == 0) {
            seen_b = de.ino == ino && de.type == DT_REG;
        }
        if (strcmp(de.name, "shared") == 0) {
            seen_shared = de.type == DT_REG;
        }
    }
    CHECK(r == 0 && err == 0 && entries == 2 && seen_b && seen_shared);
    CHECK(pwfs_unmount(fs, &err) == -1 && err == EBUSY);
    CHECK(pwfs_closedir(d, &err) == 0);
    CHECK(pwfs_opendir(fs, P("/docs/b.txt"), &err) == NULL && err == ENOTDIR);

    CHECK(pwfs_sync(fs, &err) == 0);
    CHECK(pwfs_unmount(fs, &err) == 0 && err == 0);

    /* Mount again: everything is there. */
    fs = pwfs_mount(P(image), P(""), &err);
    CHECK(fs != NULL);
    f = pwfs_open(fs, P("/docs/b.txt"), O_RDONLY, 0, &err);
    CHECK(f != NULL);
    memset(buf, 0, sizeof buf);
    CHECK(pwfs_pread(f, buf, sizeof buf, 0, &err) == (ssize_t)sizeof buf);
    CHECK(memcmp(buf, hello, n) == 0 && memcmp(buf + 4096, hello, n) == 0 && buf[4096 + n] == 0);
    CHECK(pwfs_fstat(f, &st, &err) == 0 && st.size == 20000 && st.ino == ino);
    CHECK(pwfs_close(f, &err) == 0);
    f = pwfs_open(fs, P("/docs/shared"), O_RDONLY, 0, &err);
    CHECK(f != NULL);
    for (int i = 0; i < THREADS; i++) {
        CHECK(pwfs_pread(f, buf, 1, (uint64_t)i * CHUNK + CHUNK - 1, &err) == 1 && buf[0] == 'A' + i);
    }
    CHECK(pwfs_close(f, &err) == 0);
    CHECK(pwfs_stat(fs, P("/docs/tmp"), &st, &err) == -1 && err == ENOENT);
    CHECK(pwfs_unmount(fs, &err) == 0);

    printf("smoke: %d checks passed\n", checks);
    return 0;
}
