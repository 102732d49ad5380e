/* The one place that turns fastloader's integer codes into Python exceptions. */
#include "fl_common.h"
#include <errno.h>
#include <string.h>

/* Running out of shared memory: tmpfs (/dev/shm, or the kernel's internal mount
 * that holds memfds) is full, a memory cgroup limit was hit, or RLIMIT_FSIZE. */
static int
is_exhaustion(int err)
{
    return err == ENOMEM || err == ENOSPC || err == EFBIG;
}

/* OSError(errno, message[, filename]): the OSError constructor picks the subclass
 * (FileNotFoundError, PermissionError, ...) from errno, so callers can catch those
 * and read e.errno / e.filename, as with any OSError Python raises itself. */
static void
raise_oserror(int err, const char *what, const char *filename)
{
    PyObject *args = NULL, *exc = NULL;
    PyObject *msg = PyUnicode_FromFormat("fastloader: %s: %s", what, strerror(err));
    if (msg == NULL)
        return;
    if (filename != NULL) {
        PyObject *fn = PyUnicode_DecodeFSDefault(filename);
        if (fn != NULL)
            args = Py_BuildValue("(iNN)", err, msg, fn);
        else
            Py_DECREF(msg);
    }
    else
        args = Py_BuildValue("(iN)", err, msg);
    if (args == NULL)
        return;
    exc = PyObject_Call(PyExc_OSError, args, NULL);
    Py_DECREF(args);
    if (exc == NULL)
        return;
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
}

PyObject *
fl_raise_path(int code, int err, const char *what, const char *filename)
{
    if (PyErr_Occurred())
        return NULL;   /* a signal handler or a callee already said what went wrong */
    switch (code) {
    case FL_ERRNO:
        if (is_exhaustion(err)) {
            /* `what` names the segment and its size (see the callers) */
            PyErr_Format(PyExc_MemoryError,
                         "fastloader: %s: %s (shared memory is exhausted: /dev/shm, "
                         "memfd pages or a memory limit; see `python -m fastloader doctor`)",
                         what, strerror(err));
            return NULL;
        }
        raise_oserror(err, what, filename);
        return NULL;
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

PyObject *
fl_raise(int code, int err, const char *what)
{
    return fl_raise_path(code, err, what, NULL);
}

PyObject *
fl_take_exception(void)
{
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL && tb != NULL)
        PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
#endif
}
