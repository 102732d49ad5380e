/* Shared-memory segments: anonymous memfd ("file_descriptor" strategy) or named
 * POSIX shm ("file_system" strategy), plus passing fds over a unix socket.
 * All functions run without the GIL and return fl_code values. */
#ifndef FL_SHM_H
#define FL_SHM_H
#include <fcntl.h>
#include <stddef.h>

/* Seals every memfd segment carries before its fd leaves the process. */
#define FL_SEG_SEALS (F_SEAL_SHRINK | F_SEAL_GROW)

/* Create a segment of `size` bytes with every page reserved up front (fallocate),
 * so that memory exhaustion is an ENOSPC/ENOMEM here and never a SIGBUS later.
 * name == NULL: memfd. Otherwise: shm_open(name, O_CREAT|O_EXCL, 0600). */
int fl_seg_create(const char *name, size_t size, int reserve, int *fd_out, int *err);
/* Reserve the pages of [off, off + len) of segment `fd` (fallocate): ENOSPC/ENOMEM
 * here instead of a SIGBUS when the memory is first touched. */
int fl_seg_reserve(int fd, size_t off, size_t len, int *err);
int fl_seg_open(const char *name, int *fd_out, int *err);
int fl_seg_map(int fd, size_t size, void **addr_out, int *err);
/* Mappings made in the main process are not inherited by later forks
 * (MADV_DONTFORK); see segment.c for the batches a fork does inherit. */
void fl_seg_dontfork(void *addr, size_t size);

/* One fd plus a small fixed-size message; retries on EINTR. */
int fl_send_fd(int sock, int fd, const void *msg, size_t len, int *err);
int fl_recv_fd(int sock, int *fd_out, void *msg, size_t len, int *err);

/* Write a decimal number without stdio (async-signal-safe); returns chars written. */
size_t fl_fmt_u64(char *dst, unsigned long long v);
#endif
