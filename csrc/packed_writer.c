/* PackedWriter: streams items (extend) or text lines (feed_lines) into a segment
 * or file through pwrite(), then writes the offsets and the header (finish). */
#define _GNU_SOURCE
#include "packed_internal.h"
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

PyDoc_STRVAR(writer_doc,
"PackedWriter(fd, kind)\n--\n\n"
"Streams items into the empty file or memfd `fd` (not owned; written with pwrite,\n"
"so a full disk or /dev/shm is an error, never a SIGBUS). kind: PACKED_STR (str\n"
"items, stored as UTF-8) or PACKED_PICKLE (any picklable items). Call finish()\n"
"once at the end; until then the file is not a valid packed array.");

static PyObject *
writer_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"fd", "kind", NULL};
    int fd, kind;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "ii", kwlist, &fd, &kind))
        return NULL;
    if (kind != FL_PACKED_STR && kind != FL_PACKED_PICKLE)
        return PyErr_Format(PyExc_ValueError, "unknown packed kind %d", kind);
    PackedWriterObject *w = (PackedWriterObject *)type->tp_alloc(type, 0);
    if (w == NULL)
        return NULL;
    w->fd = fd;
    w->kind = kind;
    w->offsets_cap = 1024;
    w->offsets = PyMem_RawMalloc(w->offsets_cap * sizeof(int64_t));
    w->buf = PyMem_RawMalloc(WRITER_BUF);
    if (w->offsets == NULL || w->buf == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    w->offsets[0] = 0;
    w->noffsets = 1;
    if (kind == FL_PACKED_PICKLE) {
        w->dumps = fl_packed_import_attr("pickle", "dumps");
        w->pickling_error = fl_packed_import_attr("pickle", "PicklingError");
        w->protocol = PyLong_FromLong(5);
        if (w->dumps == NULL || w->pickling_error == NULL || w->protocol == NULL)
            goto fail;
    }
    return (PyObject *)w;
fail:
    Py_DECREF(w);
    return NULL;
}

static int
writer_traverse(PyObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(WRITER(self)->dumps);
    Py_VISIT(WRITER(self)->pickling_error);
    return 0;
}

static void
writer_free_buffers(PackedWriterObject *w)
{
    PyMem_RawFree(w->buf);
    PyMem_RawFree(w->offsets);
    PyMem_RawFree(w->carry);
    w->buf = NULL;
    w->offsets = NULL;
    w->carry = NULL;
}

void
fl_packed_writer_dealloc(PyObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PackedWriterObject *w = WRITER(self);
    PyObject_GC_UnTrack(self);
    Py_CLEAR(w->dumps);
    Py_CLEAR(w->protocol);
    Py_CLEAR(w->pickling_error);
    writer_free_buffers(w);
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* -- the GIL-free core: fl_code results, no Python objects -- */

static int
wr_flush(PackedWriterObject *w, int *err)
{
    if (w->buf_len == 0)
        return FL_OK;
    int code = fl_packed_write_all(w->fd, w->buf, w->buf_len, FL_PACKED_HDR_SIZE + w->flushed, err);
    if (code == FL_OK) {
        w->flushed += w->buf_len;
        w->buf_len = 0;
    }
    return code;
}

static inline int
wr_needs_io(PackedWriterObject *w, size_t n)
{
    return w->buf_len + n > WRITER_BUF;
}

int
fl_packed_writer_append(PackedWriterObject *w, const void *p, size_t n, int *err)
{
    int code;
    if (w->noffsets == w->offsets_cap) {
        size_t cap = w->offsets_cap * 2;
        int64_t *o = PyMem_RawRealloc(w->offsets, cap * sizeof(int64_t));
        if (o == NULL)
            return FL_NOMEM;
        w->offsets = o;
        w->offsets_cap = cap;
    }
    if (wr_needs_io(w, n)) {
        if ((code = wr_flush(w, err)) != FL_OK)
            return code;
        if (n > WRITER_BUF) {
            code = fl_packed_write_all(w->fd, p, n, FL_PACKED_HDR_SIZE + w->flushed, err);
            if (code != FL_OK)
                return code;
            w->flushed += n;
            goto done;
        }
    }
    memcpy(w->buf + w->buf_len, p, n);
    w->buf_len += n;
done:
    w->offsets[w->noffsets] = w->offsets[w->noffsets - 1] + (int64_t)n;
    w->noffsets++;
    return FL_OK;
}

/* -- with the GIL -- */

int
fl_packed_writer_enter(PackedWriterObject *w)
{
    if (w->finished) {
        PyErr_SetString(PyExc_ValueError, "fastloader: PackedWriter already finished");
        return -1;
    }
    if (w->busy) {
        PyErr_SetString(PyExc_RuntimeError, "fastloader: PackedWriter is in use by another thread");
        return -1;
    }
    w->busy = 1;
    return 0;
}

/* A failed write names the size the array had reached: on a full /dev/shm (or
 * memfd limit) that is a MemoryError, like every other shared segment's. */
PyObject *
fl_packed_writer_raise(PackedWriterObject *w, int code, int err)
{
    char what[96];
    snprintf(what, sizeof(what), "writing a packed array (%llu bytes so far)",
             (unsigned long long)(FL_PACKED_HDR_SIZE + w->flushed + w->buf_len));
    return fl_raise(code, err, what);
}

static int
append_gil(PackedWriterObject *w, const char *p, size_t n)
{
    int err = 0, code;
    if (wr_needs_io(w, n)) {
        Py_BEGIN_ALLOW_THREADS
        code = fl_packed_writer_append(w, p, n, &err);
        Py_END_ALLOW_THREADS
    }
    else
        code = fl_packed_writer_append(w, p, n, &err);
    if (code != FL_OK) {
        fl_packed_writer_raise(w, code, err);
        return -1;
    }
    return 0;
}

/* Encode and append one item; the error names the item by its index. */
static int
writer_add(PackedWriterObject *w, PyObject *item)
{
    Py_ssize_t index = (Py_ssize_t)w->noffsets - 1;
    PyObject *tmp = NULL;
    const char *p;
    Py_ssize_t n;
    int rc = -1;
    if (w->kind == FL_PACKED_STR) {
        if (!PyUnicode_Check(item)) {
            PyErr_Format(PyExc_TypeError, "PackedStringArray: item %zd is %.200s, not str",
                         index, Py_TYPE(item)->tp_name);
            return -1;
        }
#if PY_VERSION_HEX < 0x030C0000
        if (PyUnicode_READY(item) < 0)
            return -1;
#endif
        if (PyUnicode_IS_ASCII(item)) {
            /* the characters are the UTF-8: no copy, nothing cached on the str */
            p = (const char *)PyUnicode_DATA(item);
            n = PyUnicode_GET_LENGTH(item);
        }
        else {
            /* a temporary, not PyUnicode_AsUTF8AndSize(), which would attach a
             * UTF-8 copy to every source string for as long as it lives */
            tmp = PyUnicode_AsEncodedString(item, "utf-8", "surrogateescape");
            if (tmp == NULL) {
                fl_packed_raise_from(PyExc_ValueError,
                           "PackedStringArray: item %zd cannot be encoded as UTF-8", index);
                return -1;
            }
            p = PyBytes_AS_STRING(tmp);
            n = PyBytes_GET_SIZE(tmp);
        }
    }
    else {
        PyObject *args[2] = {item, w->protocol};
        tmp = PyObject_Vectorcall(w->dumps, args, 2, NULL);
        if (tmp == NULL) {
            /* out of memory, recursion, Ctrl-C: not the record's fault, let it through */
            if (!PyErr_ExceptionMatches(PyExc_Exception) ||
                PyErr_ExceptionMatches(PyExc_MemoryError) ||
                PyErr_ExceptionMatches(PyExc_RecursionError))
                return -1;
            fl_packed_raise_from(w->pickling_error, "PackedArray: item %zd (of type %.200s) cannot be "
                       "pickled", index, Py_TYPE(item)->tp_name);
            return -1;
        }
        if (!PyBytes_Check(tmp)) {
            PyErr_Format(PyExc_TypeError, "PackedArray: pickle.dumps returned %.200s",
                         Py_TYPE(tmp)->tp_name);
            goto done;
        }
        p = PyBytes_AS_STRING(tmp);
        n = PyBytes_GET_SIZE(tmp);
    }
    rc = append_gil(w, p, (size_t)n);
done:
    Py_XDECREF(tmp);
    return rc;
}

PyDoc_STRVAR(writer_extend_doc,
"extend($self, iterable)\n--\n\n"
"Append every item of `iterable`, consuming it as it goes (no list is built).\n"
"A bad item raises, naming its index; the items before it stay appended.");

static PyObject *
writer_extend(PyObject *self, PyObject *iterable)
{
    PackedWriterObject *w = WRITER(self);
    PyObject *it = NULL, *item = NULL;
    int ok = 0;
    if (fl_packed_writer_enter(w) < 0)
        return NULL;
    if (PyList_CheckExact(iterable) || PyTuple_CheckExact(iterable)) {
        /* indexed, re-reading the size: pickling a record may run code that
         * changes the list */
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(iterable); i++) {
            item = Py_NewRef(PySequence_Fast_GET_ITEM(iterable, i));
            if (writer_add(w, item) < 0)
                goto done;
            Py_CLEAR(item);
        }
    }
    else {
        if ((it = PyObject_GetIter(iterable)) == NULL)
            goto done;
        while ((item = PyIter_Next(it)) != NULL) {
            if (writer_add(w, item) < 0)
                goto done;
            Py_CLEAR(item);
        }
        if (PyErr_Occurred())
            goto done;
    }
    ok = 1;
done:
    Py_XDECREF(item);
    Py_XDECREF(it);
    w->busy = 0;
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

static int
carry_add(PackedWriterObject *w, const uint8_t *p, size_t n)
{
    size_t need;
    if (__builtin_add_overflow(w->carry_len, n, &need))
        return FL_NOMEM;
    if (need > w->carry_cap) {
        size_t cap = w->carry_cap ? w->carry_cap : 4096;
        while (cap < need)
            if (__builtin_mul_overflow(cap, (size_t)2, &cap))
                return FL_NOMEM;
        uint8_t *c = PyMem_RawRealloc(w->carry, cap);
        if (c == NULL)
            return FL_NOMEM;
        w->carry = c;
        w->carry_cap = cap;
    }
    memcpy(w->carry + w->carry_len, p, n);
    w->carry_len += n;
    return FL_OK;
}

/* One line without its "\n": drop a "\r", check the UTF-8, append. */
static int
emit_line(PackedWriterObject *w, const uint8_t *p, size_t n, int *err, size_t *bad)
{
    w->lines++;
    if (n > 0 && p[n - 1] == '\r')
        n--;
    if (!fl_packed_utf8_valid(p, n, bad))
        return FL_CORRUPT;
    return fl_packed_writer_append(w, p, n, err);
}

PyDoc_STRVAR(writer_feed_lines_doc,
"feed_lines($self, buffer, final=False)\n--\n\n"
"Append the lines of a text chunk (UTF-8; \"\\n\" or \"\\r\\n\" endings, stripped).\n"
"A line may span chunks; final=True ends the text (a last line without a newline\n"
"is an item; a final newline adds no empty item). Invalid UTF-8 raises ValueError\n"
"naming the line.");

static PyObject *
writer_feed_lines(PyObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"buffer", "final", NULL};
    PackedWriterObject *w = WRITER(self);
    Py_buffer b;
    int final = 0, code = FL_OK, err = 0;
    size_t bad = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*|p", kwlist, &b, &final))
        return NULL;
    if (fl_packed_writer_enter(w) < 0) {
        PyBuffer_Release(&b);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    const uint8_t *p = b.buf, *end = p + b.len;
    while (p < end) {
        const uint8_t *nl = memchr(p, '\n', (size_t)(end - p));
        if (nl == NULL) {
            code = carry_add(w, p, (size_t)(end - p));
            break;
        }
        if (w->carry_len > 0) {
            if ((code = carry_add(w, p, (size_t)(nl - p))) != FL_OK)
                break;
            code = emit_line(w, w->carry, w->carry_len, &err, &bad);
            w->carry_len = 0;
        }
        else
            code = emit_line(w, p, (size_t)(nl - p), &err, &bad);
        if (code != FL_OK)
            break;
        p = nl + 1;
    }
    if (code == FL_OK && final && w->carry_len > 0) {
        code = emit_line(w, w->carry, w->carry_len, &err, &bad);
        w->carry_len = 0;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    w->busy = 0;
    if (code == FL_CORRUPT)
        return PyErr_Format(PyExc_ValueError,
                            "PackedStringArray: line %llu is not valid UTF-8 (byte %zu of "
                            "the line)", (unsigned long long)w->lines, bad);
    if (code != FL_OK)
        return fl_packed_writer_raise(w, code, err);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(writer_finish_doc,
"finish($self)\n--\n\nReturns int.\n"
"Write the offsets and the header; returns the size of the finished file.");

static PyObject *
writer_finish(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    PackedWriterObject *w = WRITER(self);
    int code, err = 0;
    fl_packed_hdr h;
    if (fl_packed_writer_enter(w) < 0)
        return NULL;
    memset(&h, 0, sizeof(h));
    memcpy(h.magic, FL_PACKED_MAGIC, 8);
    h.version = FL_PACKED_VERSION;
    h.kind = (uint32_t)w->kind;
    h.count = w->noffsets - 1;
    h.data_off = FL_PACKED_HDR_SIZE;
    h.data_nbytes = (uint64_t)w->offsets[w->noffsets - 1];
    h.offsets_off = FL_ALIGN_UP(FL_PACKED_HDR_SIZE + h.data_nbytes, 8);
    h.total = h.offsets_off + 8 * (uint64_t)w->noffsets;
    h.byte_order = FL_PACKED_BYTE_ORDER;
    Py_BEGIN_ALLOW_THREADS
    static const uint8_t zeros[8] = {0};
    uint64_t pad = h.offsets_off - FL_PACKED_HDR_SIZE - h.data_nbytes;
    code = wr_flush(w, &err);
    if (code == FL_OK && pad)
        code = fl_packed_write_all(w->fd, zeros, pad, FL_PACKED_HDR_SIZE + h.data_nbytes, &err);
    if (code == FL_OK)
        code = fl_packed_write_all(w->fd, w->offsets, 8 * w->noffsets, h.offsets_off, &err);
    /* the header last: a file cut short before this point has no magic number */
    if (code == FL_OK)
        code = fl_packed_write_all(w->fd, &h, sizeof(h), 0, &err);
    if (code == FL_OK && ftruncate(w->fd, (off_t)h.total) < 0) {
        err = errno;
        code = FL_ERRNO;
    }
    Py_END_ALLOW_THREADS
    w->busy = 0;
    if (code != FL_OK)
        return fl_packed_writer_raise(w, code, err);
    w->finished = 1;
    writer_free_buffers(w);
    return PyLong_FromUnsignedLongLong(h.total);
}

static PyObject *
writer_get_count(PyObject *self, void *Py_UNUSED(closure))
{
    PackedWriterObject *w = WRITER(self);
    return PyLong_FromSize_t(w->offsets ? w->noffsets - 1 : 0);
}

static PyGetSetDef writer_getset[] = {
    {"count", writer_get_count, NULL, PyDoc_STR("items appended so far"), NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef writer_methods[] = {
    {"extend", writer_extend, METH_O, writer_extend_doc},
    {"feed_lines", (PyCFunction)(void (*)(void))writer_feed_lines, METH_VARARGS | METH_KEYWORDS,
     writer_feed_lines_doc},
    {"finish", writer_finish, METH_NOARGS, writer_finish_doc},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot writer_slots[] = {
    {Py_tp_new, writer_new},
    {Py_tp_dealloc, fl_packed_writer_dealloc},
    {Py_tp_traverse, writer_traverse},
    {Py_tp_getset, writer_getset},
    {Py_tp_methods, writer_methods},
    {Py_tp_doc, (void *)writer_doc},
    {0, NULL},
};

static PyType_Spec writer_spec = {
    .name = "fastloader._core.PackedWriter",
    .basicsize = sizeof(PackedWriterObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = writer_slots,
};

int
fl_packed_writer_init(PyObject *module)
{
    PyObject *t = PyType_FromModuleAndSpec(module, &writer_spec, NULL);
    if (t == NULL)
        return -1;
    int rc = PyModule_AddType(module, (PyTypeObject *)t);
    Py_DECREF(t);
    return rc;
}
