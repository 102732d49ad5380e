#define _GNU_SOURCE
#include "fl_common.h"
#include "shm_names.h"
#include "shm.h"
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Tries before a planted name is reported: 64 random bits collide by chance
 * essentially never, so several failures in a row mean the tokens are known. */
#define FL_NAME_TRIES 16

int fl_test_fail_arena_setup;
static uint64_t g_test_tokens[8];
static size_t g_test_ntokens, g_test_next;

void
fl_shm_test_tokens(const uint64_t *tokens, size_t n)
{
    if (n > sizeof(g_test_tokens) / sizeof(g_test_tokens[0]))
        n = sizeof(g_test_tokens) / sizeof(g_test_tokens[0]);
    memcpy(g_test_tokens, tokens, n * sizeof(uint64_t));
    g_test_ntokens = n;
    g_test_next = 0;
}

static int
random_token(uint64_t *out, int *err)
{
    if (g_test_next < g_test_ntokens) {
        *out = g_test_tokens[g_test_next++];
        return FL_OK;
    }
    size_t got = 0;
    while (got < sizeof(*out)) {
        ssize_t n = getrandom((uint8_t *)out + got, sizeof(*out) - got, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            *err = errno;
            return FL_ERRNO;
        }
        got += (size_t)n;
    }
    return FL_OK;
}

void
fl_shm_name(char *dst, const char *prefix, char kind, uint64_t id, uint64_t token)
{
    static const char hex[] = "0123456789abcdef";
    size_t n = 0;
    dst[n++] = '/';
    for (const char *p = prefix; *p; p++)
        dst[n++] = *p;
    dst[n++] = '-';
    dst[n++] = kind;
    n += fl_fmt_u64(dst + n, id);
    dst[n++] = '-';
    for (int shift = 60; shift >= 0; shift -= 4)
        dst[n++] = hex[(token >> shift) & 0xf];
    dst[n] = '\0';
}

int
fl_shm_create_unique(const char *prefix, char kind, uint64_t id, size_t size, size_t reserve,
                     char *name_out, fl_shm_ident *ident, int *fd_out, int *err)
{
    int code = FL_ERRNO;
    *err = EEXIST;
    for (int i = 0; i < FL_NAME_TRIES; i++) {
        uint64_t token;
        code = random_token(&token, err);
        if (code != FL_OK)
            break;
        fl_shm_name(name_out, prefix, kind, id, token);
        code = fl_shm_create(name_out, size, reserve, fd_out, err);
        if (code == FL_OK) {
            struct stat sb;
            if (fstat(*fd_out, &sb) < 0) {
                *err = errno;
                close(*fd_out);
                shm_unlink(name_out);
                code = FL_ERRNO;
                break;
            }
            ident->token = token;
            ident->dev = (uint64_t)sb.st_dev;
            ident->ino = (uint64_t)sb.st_ino;
            return FL_OK;
        }
        if (!(code == FL_ERRNO && *err == EEXIST))
            break;
    }
    name_out[0] = '\0';   /* not ours: the caller must never unlink it */
    return code;
}

int
fl_shm_open_verified(const char *name, const fl_shm_ident *ident, uint64_t min_size,
                     int *fd_out, int *err, char *why, size_t why_len)
{
    char path[FL_SHM_PATH_MAX];
    struct stat sb;
    int fd = -1;
    why[0] = '\0';
    if ((size_t)snprintf(path, sizeof(path), "%s%s", FL_SHM_DIR, name) >= sizeof(path)) {
        snprintf(why, why_len, "name too long");
        return FL_CORRUPT;
    }
    /* O_NOFOLLOW: a planted symlink fails here; O_NONBLOCK: a planted FIFO does not block */
    fd = open(path, O_RDWR | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        *err = errno;
        if (*err == ELOOP)
            snprintf(why, why_len, "it is a symbolic link");
        return *err == ELOOP ? FL_CORRUPT : FL_ERRNO;
    }
    if (fstat(fd, &sb) < 0) {
        *err = errno;
        close(fd);
        return FL_ERRNO;
    }
    if (!S_ISREG(sb.st_mode))
        snprintf(why, why_len, "not a regular file (mode %o)", (unsigned)sb.st_mode);
    else if (sb.st_uid != geteuid())
        snprintf(why, why_len, "owned by uid %u, not by this process's uid %u",
                 (unsigned)sb.st_uid, (unsigned)geteuid());
    else if ((sb.st_mode & 07777) != 0600)
        snprintf(why, why_len, "mode %04o, not 0600", (unsigned)(sb.st_mode & 07777));
    else if ((uint64_t)sb.st_dev != ident->dev || (uint64_t)sb.st_ino != ident->ino)
        snprintf(why, why_len, "not the file the worker created (inode %llu, expected %llu)",
                 (unsigned long long)sb.st_ino, (unsigned long long)ident->ino);
    else if ((uint64_t)sb.st_size < min_size)
        snprintf(why, why_len, "%llu bytes, expected at least %llu",
                 (unsigned long long)sb.st_size, (unsigned long long)min_size);
    if (why[0] != '\0') {
        close(fd);
        return FL_CORRUPT;
    }
    *fd_out = fd;
    return FL_OK;
}

struct fl_dirent64 {
    uint64_t d_ino;
    int64_t d_off;
    unsigned short d_reclen;
    unsigned char d_type;
    char d_name[];
};

void
fl_shm_unlink_prefix(const char *prefix)
{
    /* 8-byte aligned: dirent records are read in place */
    uint64_t buf[1024];
    size_t plen = strlen(prefix);
    uid_t euid = geteuid();
    int dfd = open(FL_SHM_DIR, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0 || plen == 0)
        goto done;
    for (;;) {
        long n = syscall(SYS_getdents64, dfd, buf, sizeof(buf));
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        for (long off = 0; off < n;) {
            struct fl_dirent64 *d = (struct fl_dirent64 *)((char *)buf + off);
            off += d->d_reclen;
            if (d->d_reclen == 0)
                goto done;
            if (strncmp(d->d_name, prefix, plen) != 0 || d->d_name[plen] != '-')
                continue;
            struct stat sb;
            /* only our own regular files: never another user's, never through a link */
            if (fstatat(dfd, d->d_name, &sb, AT_SYMLINK_NOFOLLOW) == 0 &&
                S_ISREG(sb.st_mode) && sb.st_uid == euid)
                (void)unlinkat(dfd, d->d_name, 0);
        }
    }
done:
    if (dfd >= 0)
        close(dfd);
}
