/* Shared-memory files: anonymous memfd ("file_descriptor" strategy) or named
 * POSIX shm ("file_system" strategy), plus passing their fds over a unix socket.
 * All functions run without the GIL and return fl_code values.
 *
 * Words used across csrc/ (one meaning each):
 *   shm file   a memfd or a named /dev/shm object, held as an fd or a name:
 *              fl_shm_* (this file and shm_names.c for the names)
 *   Segment    a mapping of a shm file in this process, the Python-visible object
 *              SegmentObject / fl_segment_* (segment.c), unmapped when it dies
 *   arena      a worker's shm file split into ring slots, one batch per slot
 *   overflow segment  a worker's shm file holding one batch that fit no slot
 *   control block     a channel's shm file holding its rings (ring.h)
 * Packed arrays map their own shm files or regular files (PackedMapping). */
#ifndef FL_SHM_H
#define FL_SHM_H
#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>

/* Seals every memfd segment carries before its fd leaves the process. */
#define FL_SEG_SEALS (F_SEAL_SHRINK | F_SEAL_GROW)

/* Create a segment of `size` bytes with its first `reserve` bytes (0: none; size or
 * more: all) reserved up front (fallocate), so that memory exhaustion is an
 * ENOSPC/ENOMEM here and never a SIGBUS when those pages are first touched.
 * name == NULL: memfd. Otherwise: shm_open(name, O_CREAT|O_EXCL, 0600). */
int fl_shm_create(const char *name, size_t size, size_t reserve, int *fd_out, int *err);
/* Reserve the pages of [off, off + len) of segment `fd` (fallocate): ENOSPC/ENOMEM
 * here instead of a SIGBUS when the memory is first touched. */
int fl_shm_reserve(int fd, size_t off, size_t len, int *err);
/* Give the pages of [off, off + len) of segment `fd` back to the system (a hole
 * punched, the size kept: every mapping reads zeros there, never a SIGBUS); 0, or
 * -1 where the filesystem cannot (the pages then stay). */
int fl_shm_release(int fd, size_t off, size_t len);
int fl_shm_open(const char *name, int *fd_out, int *err);
int fl_shm_map(int fd, size_t size, void **addr_out, int *err);
/* Do not let later forks inherit this mapping (MADV_DONTFORK): the main process's
 * control blocks and batch mappings, so that another loader's workers or a
 * subprocess do not pin them; segment.c lets a fork inherit the slots live
 * batches point into. */
void fl_shm_dontfork(void *addr, size_t size);

/* The message that travels with a batch shm file's fd (file_descriptor strategy):
 * the main process pairs it with the result that names the same id and size. */
typedef struct {
    uint64_t seg_id;
    uint64_t size;
} fl_fdmsg;

/* Send / receive one fd with its fl_fdmsg over a unix socket; retry on EINTR. */
int fl_send_fd(int sock, int fd, const fl_fdmsg *msg, int *err);
int fl_recv_fd(int sock, int *fd_out, fl_fdmsg *msg, int *err);

/* Write a decimal number without stdio (async-signal-safe); returns chars written. */
size_t fl_fmt_u64(char *dst, unsigned long long v);
#endif
