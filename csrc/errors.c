/* The one place that turns fastloader's integer codes into Python exceptions. */
#include "fl_common.h"
#include <errno.h>
#include <string.h>

PyObject *
fl_raise(int code, int err, const char *what)
{
    if (PyErr_Occurred())
        return NULL;   /* a signal handler or a callee already said what went wrong */
    switch (code) {
    case FL_ERRNO:
        if (err == ENOMEM || err == ENOSPC || err == EFBIG) {
            PyErr_Format(PyExc_MemoryError, "fastloader: %s: %s", what, strerror(err));
            return NULL;
        }
        errno = err;
        return PyErr_Format(PyExc_OSError, "fastloader: %s: [Errno %d] %s", what, err,
                            strerror(err));
    case FL_TIMEOUT:
        return PyErr_Format(PyExc_TimeoutError, "fastloader: %s timed out", what);
    case FL_DEAD:
        return PyErr_Format(PyExc_RuntimeError, "fastloader: %s: peer process is gone", what);
    case FL_CORRUPT:
        return PyErr_Format(PyExc_RuntimeError,
                            "fastloader: %s: shared-memory data failed validation", what);
    case FL_FULL:
        return PyErr_Format(PyExc_RuntimeError, "fastloader: %s: ring is full", what);
    case FL_NOMEM:
        return PyErr_NoMemory();
    default:
        return PyErr_Format(PyExc_SystemError, "fastloader: %s: unexpected code %d", what,
                            code);
    }
}
