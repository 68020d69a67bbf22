/* LD_PRELOAD shim for power-loss tests (tests/support/powerloss.py): before each
   fsync or fdatasync of a RocksDB write-ahead log (a file named *.log), append
   "<path>\t<size>\n" to the file named by STRATAMQ_TEST_SYNC_JOURNAL. After the
   process is killed, cutting each log back to its last synced size leaves what a
   power loss may leave: everything synced, nothing else. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static void note(int fd) {
    const char *journal = getenv("STRATAMQ_TEST_SYNC_JOURNAL");
    char link[64], path[4096], line[4200];
    struct stat st;
    ssize_t n;
    int out, length;
    if (journal == NULL) return;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    n = readlink(link, path, sizeof path - 1);
    if (n <= 4) return;
    path[n] = '\0';
    if (strcmp(path + n - 4, ".log") != 0 || fstat(fd, &st) != 0) return;
    length = snprintf(line, sizeof line, "%s\t%lld\n", path, (long long)st.st_size);
    out = open(journal, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (out < 0) return;
    if (write(out, line, (size_t)length) < 0) { /* the test then sees less synced */ }
    close(out);
}

int fsync(int fd) {
    static int (*real)(int);
    if (real == NULL) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    note(fd);
    return real(fd);
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (real == NULL) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    note(fd);
    return real(fd);
}
