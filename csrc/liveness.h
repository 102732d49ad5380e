/* Worker liveness: pidfds in the main process; in workers, PR_SET_PDEATHSIG and
 * a watchdog thread that notice the main process's death, remove the worker's
 * named segments (file_system strategy) and exit. */
#ifndef FL_LIVENESS_H
#define FL_LIVENESS_H
#include <sys/types.h>
#include "ring.h"

/* -1 with *err set when the kernel lacks pidfd_open (then fl_proc_dead polls). */
int fl_pidfd_open(pid_t pid, int *err);
/* 1 if the process is gone (exited or zombie), 0 if alive. */
int fl_proc_dead(pid_t pid, int pidfd);

/* Worker side: remember what to clean up and arm PDEATHSIG and the watchdog. */
int fl_worker_arm(fl_ctl *ctl, const char *seg_prefix, pid_t main_pid, int *err);
/* Forget `ctl` before it is unmapped. */
void fl_worker_disarm(fl_ctl *ctl);
/* Where the worker's watch runs on a timer for want of a thread (fl_worker_arm):
 * try the thread again, at most once a second; cheap otherwise. */
void fl_worker_watch_retry(void);
/* Bracket the creation of a named segment (file_system strategy) so that the
 * cleanup after the main process's death cannot miss it: begin returns -1 when
 * the worker is already dying (create nothing then). */
int fl_worker_begin_create(void);
void fl_worker_end_create(void);
/* The main process is gone: unlink every named segment of this worker (all
 * names start with its prefix), nobody will open them. Async-signal-safe. */
void fl_worker_unlink_pending(void);
#endif
