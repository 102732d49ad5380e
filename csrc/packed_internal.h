/* What the packed files share (not part of the module's interface): the object
 * layouts, the type checks and a few helpers. See packed.c for the overview. */
#ifndef FL_PACKED_INTERNAL_H
#define FL_PACKED_INTERNAL_H
#include "packed.h"
#include <stdint.h>

/* The one read of an offset in shared memory. A relaxed atomic load: the compiler
 * may neither repeat it nor tear it, so the value checked is the value used. */
static inline uint64_t
fl_packed_load_offset(const int64_t *p)
{
    return (uint64_t)__atomic_load_n(p, __ATOMIC_RELAXED);
}

typedef struct {
    PyObject_HEAD
    uint8_t *addr;
    size_t size;
} PackedMappingObject;

typedef struct {
    PyObject_HEAD
    PyObject *storage;            /* the Python owner of the segment (fd, name, path) */
    PackedMappingObject *map;
    PyObject *loads;              /* records: pickle.loads */
    const int64_t *offsets;       /* count + 1 entries */
    const uint8_t *data;
    uint64_t data_nbytes;
    Py_ssize_t count;             /* items in the whole segment */
    Py_ssize_t start, step, len;  /* this view: items start + k * step for k < len */
    int kind;
} PackedViewObject;

#define VIEW(o) ((PackedViewObject *)(o))

#define WRITER_BUF (4u << 20)

typedef struct {
    PyObject_HEAD
    int fd;                       /* not owned */
    int kind;
    int busy;                     /* a call is running with the GIL released */
    int finished;
    PyObject *dumps;              /* records: pickle.dumps */
    PyObject *protocol;
    PyObject *pickling_error;     /* pickle.PicklingError */
    uint8_t *buf;                 /* data not yet written */
    size_t buf_len;
    uint64_t flushed;             /* data bytes already written */
    int64_t *offsets;             /* count + 1 */
    size_t noffsets, offsets_cap;
    uint8_t *carry;               /* feed_lines(): a line split across buffers */
    size_t carry_len, carry_cap;
    uint64_t lines;
} PackedWriterObject;

#define WRITER(o) ((PackedWriterObject *)(o))

/* Heap types are told apart by their dealloc function: no per-module state needed. */
void fl_packed_mapping_dealloc(PyObject *self);
void fl_packed_writer_dealloc(PyObject *self);
static inline int
fl_packed_has_dealloc(PyObject *obj, void *fn)
{
    for (PyTypeObject *tp = Py_TYPE(obj); tp != NULL; tp = tp->tp_base)
        if (PyType_GetSlot(tp, Py_tp_dealloc) == fn)
            return 1;
    return 0;
}

/* packed_util.c */
void fl_packed_raise_from(PyObject *exc_type, const char *fmt, ...);
int fl_packed_write_all(int fd, const void *buf, size_t n, uint64_t off, int *err);
int fl_packed_utf8_valid(const uint8_t *s, size_t n, size_t *bad);
PyObject *fl_packed_import_attr(const char *module, const char *name);

/* packed_writer.c, for packed_scan: the GIL-free append and its error */
int fl_packed_writer_enter(PackedWriterObject *w);
int fl_packed_writer_append(PackedWriterObject *w, const void *p, size_t n, int *err);
PyObject *fl_packed_writer_raise(PackedWriterObject *w, int code, int err);

/* one set-up function per file, called by fl_packed_init (packed.c) */
int fl_packed_mapping_init(PyObject *module);
int fl_packed_view_init(PyObject *module);
int fl_packed_writer_init(PyObject *module);
int fl_packed_scan_init(PyObject *module);
#endif
