/* This process's pid, read from memory.
 *
 * glibc stopped caching getpid() in 2.25, so each call is a system call, and the
 * per-batch paths ask "is this the process that made the channel/segment?" (fork
 * safety) several times per batch: strace -c counted 5 getpid calls per batch in
 * the main process. The pid is recorded at module init and refreshed in the child
 * of every fork() by a pthread_atfork handler, which glibc runs for os.fork() and
 * so for multiprocessing's fork and forkserver children. A child made without
 * fork()'s handlers (posix_spawn, vfork) runs no code of ours before it execs. */
#include "self_pid.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

static _Atomic pid_t self_pid;
static int registered;   /* set under the GIL: module init */

static void
refresh(void)
{
    atomic_store_explicit(&self_pid, getpid(), memory_order_relaxed);
}

int
fl_self_pid_init(void)
{
    refresh();
    if (registered)
        return 0;   /* a second module init (another interpreter): one handler is enough */
    int rc = pthread_atfork(NULL, NULL, refresh);
    if (rc != 0) {
        errno = rc;
        return -1;
    }
    registered = 1;
    return 0;
}

pid_t
fl_self_pid(void)
{
    return atomic_load_explicit(&self_pid, memory_order_relaxed);
}
