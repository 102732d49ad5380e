/* This process's pid, without a system call per use (see self_pid.c). */
#ifndef FL_SELF_PID_H
#define FL_SELF_PID_H

#include <sys/types.h>

/* Record the pid and keep it current across fork(); call once at module init.
 * Returns 0, or -1 with errno set. */
int fl_self_pid_init(void);
/* getpid(), read from memory. */
pid_t fl_self_pid(void);

#endif
