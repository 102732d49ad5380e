/* Shared definitions for the fastloader C core.
 *
 * Code that runs without the GIL returns one of these integer codes and never
 * touches Python objects; fl_raise() (errors.c) is the single place that turns a
 * code into a Python exception. */
#ifndef FL_COMMON_H
#define FL_COMMON_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stddef.h>

enum fl_code {
    FL_OK = 0,
    FL_ERRNO = -1,     /* errno holds the cause */
    FL_TIMEOUT = -2,   /* the caller's deadline passed */
    FL_DEAD = -3,      /* the peer process is gone */
    FL_SIGNAL = -4,    /* a Python signal handler raised (exception already set) */
    FL_CORRUPT = -5,   /* shared data failed validation */
    FL_FULL = -6,      /* a ring had no room */
    FL_NOMEM = -7,     /* malloc failed */
};

enum fl_strategy { FL_STRATEGY_FD = 0, FL_STRATEGY_FS = 1 };

#define FL_ALIGN_UP(x, a) (((x) + ((a) - 1)) & ~((size_t)(a) - 1))

/* Raise the exception that matches `code`; `what` names the operation and, for
 * FL_ERRNO, `err` is the saved errno. Always returns NULL. */
PyObject *fl_raise(int code, int err, const char *what);

/* The exception being raised (cleared), normalised, with its traceback attached;
 * NULL if none. */
PyObject *fl_take_exception(void);
/* The same, for an operation on a named file or segment: an OSError then carries
 * errno and `filename` (NULL: none) and is of the matching subclass. Running out
 * of memory or shared memory (ENOMEM, ENOSPC, EFBIG) is a MemoryError: put the
 * size in `what`. */
PyObject *fl_raise_path(int code, int err, const char *what, const char *filename);

#endif
