/* Helpers of the packed files: exception chaining, strict UTF-8, full pwrite. */
#define _GNU_SOURCE
#include "packed_internal.h"
#include <errno.h>
#include <stdarg.h>
#include <string.h>
#include <unistd.h>

/* Raise exc_type(message) "from" the exception being raised now. */
void
fl_packed_raise_from(PyObject *exc_type, const char *fmt, ...)
{
    PyObject *cause = fl_take_exception();
    PyObject *msg = NULL, *exc = NULL;
    va_list va;
    va_start(va, fmt);
    msg = PyUnicode_FromFormatV(fmt, va);
    va_end(va);
    if (msg == NULL)
        goto done;
    exc = PyObject_CallOneArg(exc_type, msg);
    if (exc == NULL)
        goto done;
    if (cause != NULL) {
        PyException_SetContext(exc, Py_NewRef(cause));
        PyException_SetCause(exc, Py_NewRef(cause));
    }
    PyErr_SetObject(exc_type, exc);
done:
    Py_XDECREF(msg);
    Py_XDECREF(exc);
    Py_XDECREF(cause);
}

int
fl_packed_write_all(int fd, const void *buf, size_t n, uint64_t off, int *err)
{
    const char *p = buf;
    while (n > 0) {
        ssize_t w = pwrite(fd, p, n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n, (off_t)off);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            *err = errno;
            return FL_ERRNO;
        }
        if (w == 0) {
            *err = EIO;
            return FL_ERRNO;
        }
        p += w;
        n -= (size_t)w;
        off += (uint64_t)w;
    }
    return FL_OK;
}

/* Strict UTF-8 (no overlongs, no surrogates, nothing above U+10FFFF). Returns 1
 * when valid, else 0 with *bad set to the offset of the first bad byte. */
int
fl_packed_utf8_valid(const uint8_t *s, size_t n, size_t *bad)
{
    size_t i = 0;
    while (i < n) {
        /* ASCII runs, 8 bytes at a time: file names and most text are ASCII */
        while (i + 8 <= n) {
            uint64_t w;
            memcpy(&w, s + i, 8);
            if (w & 0x8080808080808080ull)
                break;
            i += 8;
        }
        if (i >= n)
            break;
        uint8_t c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t need;
        uint8_t lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF)
            need = 1;
        else if (c >= 0xE0 && c <= 0xEF) {
            need = 2;
            if (c == 0xE0)
                lo = 0xA0;
            else if (c == 0xED)
                hi = 0x9F;   /* U+D800..U+DFFF are not characters */
        }
        else if (c >= 0xF0 && c <= 0xF4) {
            need = 3;
            if (c == 0xF0)
                lo = 0x90;
            else if (c == 0xF4)
                hi = 0x8F;
        }
        else
            goto bad;
        if (i + need >= n)
            goto bad;
        if (s[i + 1] < lo || s[i + 1] > hi)
            goto bad;
        for (size_t k = 2; k <= need; k++)
            if ((s[i + k] & 0xC0) != 0x80)
                goto bad;
        i += need + 1;
    }
    return 1;
bad:
    *bad = i;
    return 0;
}

PyObject *
fl_packed_import_attr(const char *module, const char *name)
{
    PyObject *m = PyImport_ImportModule(module);
    if (m == NULL)
        return NULL;
    PyObject *a = PyObject_GetAttrString(m, name);
    Py_DECREF(m);
    return a;
}
