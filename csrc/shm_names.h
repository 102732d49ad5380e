/* Named segments (file_system strategy), treated as hostile input: /dev/shm is
 * world-writable, so other users can list it and create any name that is not
 * taken yet. Names carry a random token (unpredictable, a collision retries with
 * a fresh one); the main process opens a name only to check that the file is the
 * one its worker made (regular, owner == euid, mode 0600, same device and inode
 * as announced in the result descriptor); a sweep removes our own leftovers.
 * Everything here runs without the GIL and returns fl_code values. */
#ifndef FL_SHM_NAMES_H
#define FL_SHM_NAMES_H
#include <stddef.h>
#include <stdint.h>

#define FL_SHM_DIR "/dev/shm"
/* room for FL_SHM_DIR and a whole segment name */
#define FL_SHM_PATH_MAX 320

/* Identity of a segment, as its creator saw it. */
typedef struct {
    uint64_t token;
    uint64_t dev;
    uint64_t ino;
} fl_shm_ident;

/* "/<prefix>-<kind><id>-<16 hex token>" into dst (FL_NAME_MAX bytes). Signal-safe. */
void fl_shm_name(char *dst, const char *prefix, char kind, uint64_t id, uint64_t token);

/* Create a fresh name for `size` bytes (see fl_shm_create): a name that exists
 * already (someone planted it) is never an error, another random token is drawn.
 * Fills the name and the identity the opener must find. */
int fl_shm_create_unique(const char *prefix, char kind, uint64_t id, size_t size, size_t reserve,
                         char *name_out, fl_shm_ident *ident, int *fd_out, int *err);

/* Open a name and check it is exactly `ident` (and at least min_size bytes).
 * FL_CORRUPT: it is not (why[] says what differs, and nothing was mapped). */
int fl_shm_open_verified(const char *name, const fl_shm_ident *ident, uint64_t min_size,
                         int *fd_out, int *err, char *why, size_t why_len);

/* Unlink every entry of /dev/shm whose name starts with "<prefix>-" and that is a
 * regular file owned by our euid. Async-signal-safe (raw getdents64). */
void fl_shm_unlink_prefix(const char *prefix);

/* Test seams, process-wide: the next name tokens to use before random ones, and
 * a number of arena set-ups that fail as if memory ran out at their last step. */
void fl_shm_test_tokens(const uint64_t *tokens, size_t n);
extern int fl_test_fail_arena_setup;
#endif
