#define _GNU_SOURCE
#include "fl_common.h"
#include "shm.h"
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

int
fl_shm_create(const char *name, size_t size, size_t reserve, int *fd_out, int *err)
{
    int fd = -1;
    if (name == NULL)
        fd = memfd_create("fastloader", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    else
        fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0)
        goto fail;
    if (name != NULL && fchmod(fd, 0600) < 0)   /* umask may not loosen it, but be sure */
        goto fail;
    if (ftruncate(fd, (off_t)size) < 0)
        goto fail;
    if (reserve && fl_shm_reserve(fd, 0, reserve < size ? reserve : size, err) != FL_OK) {
        errno = *err;
        goto fail;
    }
    /* The size is final: sealed, no process holding the fd (a worker, or anything
     * it hands the fd to) can shrink it under another's mapping (SIGBUS there).
     * Reserving later within the size is still allowed. Named segments cannot be
     * sealed; their readers check the size when they open them. */
    if (name == NULL && fcntl(fd, F_ADD_SEALS, FL_SEG_SEALS) < 0)
        goto fail;
    *fd_out = fd;
    return FL_OK;
fail:
    *err = errno;
    if (fd >= 0) {
        close(fd);
        if (name != NULL)
            shm_unlink(name);
    }
    return FL_ERRNO;
}

int
fl_shm_reserve(int fd, size_t off, size_t len, int *err)
{
    int rc;
    if (len == 0)
        return FL_OK;
    /* posix_fallocate returns the error instead of setting errno */
    do {
        rc = posix_fallocate(fd, (off_t)off, (off_t)len);
    } while (rc == EINTR);
    /* EOPNOTSUPP: a filesystem that cannot reserve (tmpfs and memfd can): the
     * pages stay lazy there, as they would be without us. */
    if (rc != 0 && rc != EOPNOTSUPP) {
        *err = rc;
        return FL_ERRNO;
    }
    return FL_OK;
}

int
fl_shm_release(int fd, size_t off, size_t len)
{
    int rc;
    do {
        rc = fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)off,
                       (off_t)len);
    } while (rc < 0 && errno == EINTR);
    return rc < 0 ? -1 : 0;
}

int
fl_shm_open(const char *name, int *fd_out, int *err)
{
    int fd = shm_open(name, O_RDWR | O_CLOEXEC, 0);
    if (fd < 0) {
        *err = errno;
        return FL_ERRNO;
    }
    *fd_out = fd;
    return FL_OK;
}

int
fl_shm_map(int fd, size_t size, void **addr_out, int *err)
{
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        *err = errno;
        return FL_ERRNO;
    }
    *addr_out = p;
    return FL_OK;
}

void
fl_shm_dontfork(void *addr, size_t size)
{
    (void)madvise(addr, size, MADV_DONTFORK);
}

int
fl_send_fd(int sock, int fd, const fl_fdmsg *msg, int *err)
{
    const size_t len = sizeof(*msg);
    struct iovec iov = {.iov_base = (void *)msg, .iov_len = len};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } u;
    struct msghdr mh;
    memset(&mh, 0, sizeof(mh));
    memset(&u, 0, sizeof(u));
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = u.buf;
    mh.msg_controllen = sizeof(u.buf);
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof(int));
    ssize_t n;
    do {
        n = sendmsg(sock, &mh, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    if (n != (ssize_t)len) {
        *err = n < 0 ? errno : EPROTO;
        return FL_ERRNO;
    }
    return FL_OK;
}

#define FL_RECV_FDS_MAX 8

int
fl_recv_fd(int sock, int *fd_out, fl_fdmsg *msg, int *err)
{
    const size_t len = sizeof(*msg);
    struct iovec iov = {.iov_base = msg, .iov_len = len};
    /* Room for more fds than one: the kernel fills what the buffer holds without
     * flagging a truncation, so a message that carried two in a one-fd buffer
     * would leave the second open here, unseen. Every fd received is taken, and
     * a message with more than one is refused. */
    union {
        char buf[CMSG_SPACE(FL_RECV_FDS_MAX * sizeof(int))];
        struct cmsghdr align;
    } u;
    struct msghdr mh;
    memset(&mh, 0, sizeof(mh));
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = u.buf;
    mh.msg_controllen = sizeof(u.buf);
    ssize_t n;
    /* The worker sends a segment's fd before it publishes the result naming it,
     * so it is there already: never wait for it (with the GIL held, a wait for an
     * fd that will not come would freeze the process). */
    do {
        n = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    } while (n < 0 && errno == EINTR);
    if (n < 0) {
        *err = errno;
        return FL_ERRNO;
    }
    int fd = -1, nfds = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c != NULL; c = CMSG_NXTHDR(&mh, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS ||
            c->cmsg_len < CMSG_LEN(0))
            continue;
        size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < k; i++) {
            int got;
            memcpy(&got, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
            if (nfds++ == 0)
                fd = got;
            else
                close(got);
        }
    }
    if (n == 0 && nfds == 0) {   /* the worker's end is closed */
        *err = EPIPE;
        return FL_ERRNO;
    }
    if (nfds > 1) {   /* not a message of ours (nor is an empty one with an fd, below) */
        close(fd);
        *err = EPROTO;
        return FL_ERRNO;
    }
    if (fd < 0 || (size_t)n != len || (mh.msg_flags & (MSG_CTRUNC | MSG_TRUNC))) {
        if (fd >= 0)
            close(fd);
        /* no fd and a truncated control message: the kernel could not install
           the fd here, this process is out of them (ulimit -n) */
        *err = (fd < 0 && (mh.msg_flags & MSG_CTRUNC)) ? EMFILE : EPROTO;
        return FL_ERRNO;
    }
    *fd_out = fd;
    return FL_OK;
}

size_t
fl_fmt_u64(char *dst, unsigned long long v)
{
    char tmp[24];
    size_t n = 0;
    do {
        tmp[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    for (size_t i = 0; i < n; i++)
        dst[i] = tmp[n - 1 - i];
    return n;
}
