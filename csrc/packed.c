/* Packed arrays (see packed.h for the layout).
 *
 *   PackedMapping  a read-only MAP_SHARED mapping of a packed segment or file
 *   PackedView     items [start, start + step, ...) of a mapping; the base class of
 *                  fastloader.PackedStringArray / PackedArray (python/fastloader/packed.py)
 *   PackedWriter   streams items into a segment or file through pwrite()
 *   packed_scan()  a sorted directory scan straight into a writer
 *
 * Reading an item touches only the mapping (shared pages) and creates the one
 * object returned, so forked workers dirty no copy-on-write pages.
 *
 * The mapping is shared memory that another process may write while we read it
 * (a loaded file, a named segment). So every offset is read exactly once
 * (load_offset) into a local, checked against the data size, and only the checked
 * local is used; code that needs an item twice keeps what it read the first time.
 * Index arithmetic on views is overflow-checked. A corrupt, hostile or concurrently
 * changing file thus yields an exception or stale bytes, never an access outside
 * the mapping or a buffer; that is what lets load() skip an O(n) check. (A file
 * truncated while mapped is another matter: the kernel raises SIGBUS on the
 * missing pages, hence the documented rule to replace a loaded file by rename.) */
#define _GNU_SOURCE
#include "packed.h"
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

_Static_assert(sizeof(fl_packed_hdr) == FL_PACKED_HDR_SIZE, "packed header is 64 bytes");

/* The one read of an offset in shared memory. A relaxed atomic load: the compiler
 * may neither repeat it nor tear it, so the value checked is the value used. */
static inline uint64_t
load_offset(const int64_t *p)
{
    return (uint64_t)__atomic_load_n(p, __ATOMIC_RELAXED);
}

/* ---- small helpers ------------------------------------------------------------ */

/* The exception being raised, normalised, with its traceback attached. */
static PyObject *
take_exception(void)
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

/* Raise exc_type(message) "from" the exception being raised now. */
static void
raise_from(PyObject *exc_type, const char *fmt, ...)
{
    PyObject *cause = take_exception();
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

static int
write_all(int fd, const void *buf, size_t n, uint64_t off, int *err)
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
static int
utf8_valid(const uint8_t *s, size_t n, size_t *bad)
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

/* Heap types are told apart by their dealloc function: no per-module state needed. */
static void mapping_dealloc(PyObject *self);
static void view_dealloc(PyObject *self);
static void writer_dealloc(PyObject *self);

static int
has_dealloc(PyObject *obj, void *fn)
{
    for (PyTypeObject *tp = Py_TYPE(obj); tp != NULL; tp = tp->tp_base)
        if (PyType_GetSlot(tp, Py_tp_dealloc) == fn)
            return 1;
    return 0;
}

/* ---- PackedMapping ------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    uint8_t *addr;
    size_t size;
} PackedMappingObject;

PyDoc_STRVAR(mapping_doc,
"PackedMapping(fd, size, populate=False)\n--\n\n"
"Map `size` bytes of the packed segment or file `fd` read-only and shared.\n"
"populate=True maps every page at once (MAP_POPULATE): processes that map the\n"
"segment later then share these pages instead of counting them as private.\n"
"Exports a read-only buffer; unmapped when the last reference goes.");

static PyObject *
mapping_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"fd", "size", "populate", NULL};
    int fd, populate = 0, err = 0;
    Py_ssize_t size;
    void *p;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "in|p", kwlist, &fd, &size, &populate))
        return NULL;
    if (size <= 0)
        return PyErr_Format(PyExc_ValueError, "fastloader: cannot map %zd bytes", size);
    /* A size beyond the end of the file (a stale or crafted handle) would map pages
     * that fault with SIGBUS when read: refuse it now. */
    struct stat st;
    if (fstat(fd, &st) < 0)
        return fl_raise(FL_ERRNO, errno, "mapping a packed array");
    if (S_ISREG(st.st_mode) && (uint64_t)st.st_size < (uint64_t)size)
        return PyErr_Format(PyExc_ValueError, "fastloader: cannot map %zd bytes of a packed "
                            "array file of %lld bytes", size, (long long)st.st_size);
    Py_BEGIN_ALLOW_THREADS
    p = mmap(NULL, (size_t)size, PROT_READ, MAP_SHARED | (populate ? MAP_POPULATE : 0), fd, 0);
    if (p == MAP_FAILED)
        err = errno;
    Py_END_ALLOW_THREADS
    if (p == MAP_FAILED)
        return fl_raise(FL_ERRNO, err, "mapping a packed array");
    PackedMappingObject *m = (PackedMappingObject *)type->tp_alloc(type, 0);
    if (m == NULL) {
        munmap(p, (size_t)size);
        return NULL;
    }
    m->addr = p;
    m->size = (size_t)size;
    return (PyObject *)m;
}

static void
mapping_dealloc(PyObject *self)
{
    PackedMappingObject *m = (PackedMappingObject *)self;
    PyTypeObject *tp = Py_TYPE(self);
    if (m->addr != NULL)
        munmap(m->addr, m->size);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static int
mapping_getbuffer(PyObject *self, Py_buffer *view, int flags)
{
    PackedMappingObject *m = (PackedMappingObject *)self;
    return PyBuffer_FillInfo(view, self, m->addr, (Py_ssize_t)m->size, 1, flags);
}

static PyObject *
mapping_get_size(PyObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSize_t(((PackedMappingObject *)self)->size);
}

static PyObject *
mapping_get_address(PyObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromVoidPtr(((PackedMappingObject *)self)->addr);
}

static PyGetSetDef mapping_getset[] = {
    {"size", mapping_get_size, NULL, PyDoc_STR("bytes mapped"), NULL},
    {"address", mapping_get_address, NULL, PyDoc_STR("where, in this process"), NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot mapping_slots[] = {
    {Py_tp_new, mapping_new},
    {Py_tp_dealloc, mapping_dealloc},
    {Py_tp_getset, mapping_getset},
    {Py_bf_getbuffer, mapping_getbuffer},
    {Py_tp_doc, (void *)mapping_doc},
    {0, NULL},
};

static PyType_Spec mapping_spec = {
    .name = "fastloader._core.PackedMapping",
    .basicsize = sizeof(PackedMappingObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = mapping_slots,
};

/* ---- PackedView -------------------------------------------------------------------- */

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

/* Check the header against the mapping; ValueError (naming the byte offset or
 * the sizes involved) when it does not describe a packed array of this size. */
static int
check_header(PackedMappingObject *m, fl_packed_hdr *h)
{
    const char *pfx = "fastloader: packed array";
    if (m->size < FL_PACKED_HDR_SIZE) {
        PyErr_Format(PyExc_ValueError,
                     "%s: truncated: %zu bytes, shorter than the %d-byte header", pfx,
                     m->size, FL_PACKED_HDR_SIZE);
        return -1;
    }
    memcpy(h, m->addr, sizeof(*h));
    if (memcmp(h->magic, FL_PACKED_MAGIC, 8) != 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s: not a fastloader packed array (bytes 0-7 are not its magic number)",
                     pfx);
        return -1;
    }
    if (h->byte_order != FL_PACKED_BYTE_ORDER) {
        PyErr_Format(PyExc_ValueError,
                     "%s: written with another byte order (byte-order mark at offset 56 "
                     "is 0x%08x)", pfx, h->byte_order);
        return -1;
    }
    if (h->version != FL_PACKED_VERSION) {
        PyErr_Format(PyExc_ValueError,
                     "%s: format version %u (at offset 8) is not supported; this "
                     "fastloader reads version %d", pfx, h->version, FL_PACKED_VERSION);
        return -1;
    }
    if (h->kind != FL_PACKED_STR && h->kind != FL_PACKED_PICKLE) {
        PyErr_Format(PyExc_ValueError, "%s: unknown item kind %u at offset 12", pfx, h->kind);
        return -1;
    }
    if (h->total != m->size) {
        if (h->total > m->size)
            PyErr_Format(PyExc_ValueError,
                         "%s: truncated: the header says %llu bytes, only %zu are there", pfx,
                         (unsigned long long)h->total, m->size);
        else
            PyErr_Format(PyExc_ValueError,
                         "%s: %zu bytes where the header says %llu (trailing data)", pfx,
                         m->size, (unsigned long long)h->total);
        return -1;
    }
    uint64_t tbl = 0;
    if (h->data_off != FL_PACKED_HDR_SIZE || h->offsets_off % 8 != 0 ||
        h->offsets_off < h->data_off || h->data_nbytes > h->offsets_off - h->data_off ||
        h->offsets_off > h->total || h->count >= (uint64_t)PY_SSIZE_T_MAX / 8 ||
        (tbl = (h->count + 1) * 8) != h->total - h->offsets_off) {
        PyErr_Format(PyExc_ValueError,
                     "%s: corrupt header: %llu items, data at %llu (%llu bytes), offset "
                     "table at %llu, %llu bytes in all", pfx, (unsigned long long)h->count,
                     (unsigned long long)h->data_off, (unsigned long long)h->data_nbytes,
                     (unsigned long long)h->offsets_off, (unsigned long long)h->total);
        return -1;
    }
    const int64_t *off = (const int64_t *)(m->addr + h->offsets_off);
    uint64_t first = load_offset(&off[0]), last = load_offset(&off[h->count]);
    if (first != 0 || last != h->data_nbytes) {
        PyErr_Format(PyExc_ValueError,
                     "%s: corrupt offset table at byte %llu: it runs from %lld to %lld, "
                     "the data holds %llu bytes", pfx, (unsigned long long)h->offsets_off,
                     (long long)first, (long long)last, (unsigned long long)h->data_nbytes);
        return -1;
    }
    return 0;
}

/* a and b: the offsets as they were read (re-reading them could show other values) */
static PyObject *
corrupt_item(PackedViewObject *v, Py_ssize_t i, uint64_t a, uint64_t b)
{
    return PyErr_Format(PyExc_ValueError,
                        "fastloader: packed array is corrupt at item %zd: offsets %lld..%lld "
                        "(byte %llu of the segment) outside its %llu data bytes", i,
                        (long long)a, (long long)b,
                        (unsigned long long)((const uint8_t *)&v->offsets[i] - v->map->addr),
                        (unsigned long long)v->data_nbytes);
}

/* Offset and length of item i of the segment (not of the view): each offset read
 * once, then bounds-checked. */
static inline int
item_span(PackedViewObject *v, Py_ssize_t i, uint64_t *off, uint64_t *len)
{
    uint64_t a = load_offset(&v->offsets[i]), b = load_offset(&v->offsets[i + 1]);
    if (a > b || b > v->data_nbytes) {
        corrupt_item(v, i, a, b);
        return -1;
    }
    *off = a;
    *len = b - a;
    return 0;
}

/* Bytes of item i of the segment, bounds-checked (data_nbytes < PY_SSIZE_T_MAX, see
 * check_header, so the length fits). */
static inline int
raw_item(PackedViewObject *v, Py_ssize_t i, const char **p, Py_ssize_t *n)
{
    uint64_t a, len;
    if (item_span(v, i, &a, &len) < 0)
        return -1;
    *p = (const char *)v->data + a;
    *n = (Py_ssize_t)len;
    return 0;
}

/* Segment index of item k of view v. view_new checked that the first and last
 * items of a view lie in the segment without overflow, and slicing only narrows a
 * view, so for 0 <= k < len this neither overflows nor leaves the segment. */
static inline Py_ssize_t
view_pos(PackedViewObject *v, Py_ssize_t k)
{
    return v->start + k * v->step;
}

static PyObject *
decode_item(PackedViewObject *v, Py_ssize_t i)
{
    const char *p;
    Py_ssize_t n;
    if (raw_item(v, i, &p, &n) < 0)
        return NULL;
    if (v->kind == FL_PACKED_STR)
        /* surrogateescape: file names that are not UTF-8 round-trip as os.listdir()
         * returns them; valid UTF-8 takes the decoder's fast path regardless. */
        return PyUnicode_DecodeUTF8(p, n, "surrogateescape");
    if (v->loads == NULL)   /* cleared by the garbage collector, mid-cycle */
        return PyErr_Format(PyExc_ValueError, "fastloader: packed array was cleared");
    /* A private copy: the unpickler then reads bytes that no other process can
     * change while it parses them. */
    PyObject *copy = PyBytes_FromStringAndSize(p, n);
    if (copy == NULL)
        return NULL;
    PyObject *obj = PyObject_CallOneArg(v->loads, copy);
    Py_DECREF(copy);
    return obj;
}

static inline PyObject *
view_item_at(PackedViewObject *v, Py_ssize_t k)
{
    return decode_item(v, view_pos(v, k));
}

static PyObject *
import_attr(const char *module, const char *name)
{
    PyObject *m = PyImport_ImportModule(module);
    if (m == NULL)
        return NULL;
    PyObject *a = PyObject_GetAttrString(m, name);
    Py_DECREF(m);
    return a;
}

PyDoc_STRVAR(view_doc,
"PackedView(storage, mapping, start=0, step=1, length=-1)\n--\n\n"
"Items start, start + step, ... (length of them; -1: all) of the packed segment\n"
"mapped by `mapping` (a PackedMapping); `storage` is kept for pickling. Base class\n"
"of fastloader.PackedStringArray and fastloader.PackedArray: use those.");

/* A subclass that names its item kind (_KIND: PackedStringArray's str, PackedArray's
 * pickles) only ever views segments of that kind, however it is made (load, a
 * pickle, a handle): a file handed over as strings is never unpickled. */
static int
check_type_kind(PyTypeObject *type, uint32_t kind)
{
    PyObject *want = PyObject_GetAttrString((PyObject *)type, "_KIND");
    if (want == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    long k = PyLong_Check(want) ? PyLong_AsLong(want) : 0;
    Py_DECREF(want);
    if (k == -1 && PyErr_Occurred())
        return -1;
    if (k != 0 && (uint32_t)k != kind) {
        PyErr_Format(PyExc_ValueError,
                     "fastloader: packed array: holds %s, not the %s a %.200s holds",
                     kind == FL_PACKED_PICKLE ? "pickled records" : "strings",
                     k == FL_PACKED_PICKLE ? "pickled records" : "strings", type->tp_name);
        return -1;
    }
    return 0;
}

static PyObject *
view_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"storage", "mapping", "start", "step", "length", NULL};
    PyObject *storage, *mapping, *loads = NULL;
    Py_ssize_t start = 0, step = 1, length = -1;
    fl_packed_hdr h;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|nnn", kwlist, &storage, &mapping, &start,
                                     &step, &length))
        return NULL;
    if (!has_dealloc(mapping, (void *)mapping_dealloc))
        return PyErr_Format(PyExc_TypeError, "mapping must be a PackedMapping, not %.200s",
                            Py_TYPE(mapping)->tp_name);
    PackedMappingObject *m = (PackedMappingObject *)mapping;
    if (check_header(m, &h) < 0)
        return NULL;
    Py_ssize_t count = (Py_ssize_t)h.count;
    if (length < 0) {
        start = 0;
        step = 1;
        length = count;
    }
    else if (length == 0) {
        start = 0;
        step = 1;
    }
    else {
        /* The first and the last item inside the segment, computed without overflow
         * (the arguments may come from a crafted handle, the count from a sparse file
         * of billions of items): every item between them is then inside too. */
        Py_ssize_t span, last;
        if (step == 0 || length > count || start < 0 || start >= count ||
            __builtin_mul_overflow(length - 1, step, &span) ||
            __builtin_add_overflow(start, span, &last) || last < 0 || last >= count)
            return PyErr_Format(PyExc_ValueError,
                                "fastloader: packed view start=%zd step=%zd length=%zd does "
                                "not fit %zd items", start, step, length, count);
        if (length == 1)
            step = 1;
    }
    if (check_type_kind(type, h.kind) < 0)
        return NULL;
    if (h.kind == FL_PACKED_PICKLE && (loads = import_attr("pickle", "loads")) == NULL)
        return NULL;
    PackedViewObject *v = (PackedViewObject *)type->tp_alloc(type, 0);
    if (v == NULL) {
        Py_XDECREF(loads);
        return NULL;
    }
    v->storage = Py_NewRef(storage);
    v->map = (PackedMappingObject *)Py_NewRef(mapping);
    v->loads = loads;
    v->offsets = (const int64_t *)(m->addr + h.offsets_off);
    v->data = m->addr + h.data_off;
    v->data_nbytes = h.data_nbytes;
    v->count = count;
    v->start = start;
    v->step = step;
    v->len = length;
    v->kind = (int)h.kind;
    return (PyObject *)v;
}

/* A view of the same segment and the same (possibly Python-level) type. */
static PyObject *
view_sub(PackedViewObject *v, Py_ssize_t start, Py_ssize_t step, Py_ssize_t len)
{
    PyTypeObject *type = Py_TYPE(v);
    PackedViewObject *s = (PackedViewObject *)type->tp_alloc(type, 0);
    if (s == NULL)
        return NULL;
    s->storage = Py_NewRef(v->storage);
    s->map = (PackedMappingObject *)Py_NewRef(v->map);
    s->loads = Py_XNewRef(v->loads);
    s->offsets = v->offsets;
    s->data = v->data;
    s->data_nbytes = v->data_nbytes;
    s->count = v->count;
    s->kind = v->kind;
    if (len <= 0) {
        start = 0;
        step = 1;
        len = 0;
    }
    else if (len == 1)
        step = 1;
    s->start = start;
    s->step = step;
    s->len = len;
    return (PyObject *)s;
}

static int
view_traverse(PyObject *self, visitproc visit, void *arg)
{
    PackedViewObject *v = VIEW(self);
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(v->storage);
    Py_VISIT(v->map);
    Py_VISIT(v->loads);
    return 0;
}

static int
view_clear(PyObject *self)
{
    /* The mapping stays: the data pointers point into it until dealloc. */
    Py_CLEAR(VIEW(self)->storage);
    Py_CLEAR(VIEW(self)->loads);
    return 0;
}

static void
view_dealloc(PyObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    view_clear(self);
    Py_CLEAR(VIEW(self)->map);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static Py_ssize_t
view_length(PyObject *self)
{
    return VIEW(self)->len;
}

static PyObject *
index_error(PackedViewObject *v)
{
    return PyErr_Format(PyExc_IndexError, "%s index out of range", Py_TYPE(v)->tp_name);
}

static PyObject *
view_sq_item(PyObject *self, Py_ssize_t k)
{
    PackedViewObject *v = VIEW(self);
    if (k < 0 || k >= v->len)
        return index_error(v);
    return view_item_at(v, k);
}

static PyObject *
view_subscript(PyObject *self, PyObject *key)
{
    PackedViewObject *v = VIEW(self);
    if (PyLong_CheckExact(key) || PyIndex_Check(key)) {
        Py_ssize_t k = PyLong_CheckExact(key) ? PyLong_AsSsize_t(key)
                                               : PyNumber_AsSsize_t(key, PyExc_IndexError);
        if (k == -1 && PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            return index_error(v);
        }
        if (k == -1 && PyErr_Occurred())
            return NULL;
        if (k < 0)
            k += v->len;
        if (k < 0 || k >= v->len)
            return index_error(v);
        return view_item_at(v, k);
    }
    if (PySlice_Check(key)) {
        Py_ssize_t a, b, st, n;
        if (PySlice_Unpack(key, &a, &b, &st) < 0)
            return NULL;
        n = PySlice_AdjustIndices(v->len, &a, &b, st);
        if (n <= 1)
            return view_sub(v, n ? view_pos(v, a) : 0, 1, n);
        /* |step * st| * (n - 1) <= |step| * (len - 1) < count: no overflow, but the
         * check is cheap and keeps this true if the invariant is ever broken */
        Py_ssize_t sub_step;
        if (__builtin_mul_overflow(v->step, st, &sub_step))
            return PyErr_Format(PyExc_OverflowError, "fastloader: packed view step overflows");
        return view_sub(v, view_pos(v, a), sub_step, n);
    }
    return PyErr_Format(PyExc_TypeError, "%s indices must be integers or slices, not %.200s",
                        Py_TYPE(v)->tp_name, Py_TYPE(key)->tp_name);
}

static int
view_contains(PyObject *self, PyObject *obj)
{
    PackedViewObject *v = VIEW(self);
    if (v->kind == FL_PACKED_STR) {
        if (!PyUnicode_Check(obj))
            return 0;
        PyObject *enc = PyUnicode_AsEncodedString(obj, "utf-8", "surrogateescape");
        if (enc == NULL) {
            /* not encodable, so not stored */
            if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError))
                return -1;
            PyErr_Clear();
            return 0;
        }
        const char *want = PyBytes_AS_STRING(enc);
        Py_ssize_t wn = PyBytes_GET_SIZE(enc);
        int found = 0;
        for (Py_ssize_t k = 0; k < v->len && !found; k++) {
            const char *p;
            Py_ssize_t n;
            if (raw_item(v, view_pos(v, k), &p, &n) < 0) {
                found = -1;
                break;
            }
            found = n == wn && memcmp(p, want, (size_t)n) == 0;
        }
        Py_DECREF(enc);
        return found;
    }
    for (Py_ssize_t k = 0; k < v->len; k++) {
        PyObject *item = view_item_at(v, k);
        if (item == NULL)
            return -1;
        int eq = PyObject_RichCompareBool(item, obj, Py_EQ);
        Py_DECREF(item);
        if (eq != 0)
            return eq;
    }
    return 0;
}

PyDoc_STRVAR(view_tolist_doc,
"tolist() -> list\n--\n\nEvery item as a new Python object, in a list.");

static PyObject *
view_tolist(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    PackedViewObject *v = VIEW(self);
    PyObject *out = PyList_New(v->len);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t k = 0; k < v->len; k++) {
        PyObject *item = view_item_at(v, k);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, k, item);
    }
    return out;
}

PyDoc_STRVAR(view_take_doc,
"take(indices) -> list\n--\n\n"
"[self[i] for i in indices], in C: for a dataset's __getitems__.");

static PyObject *
view_take(PyObject *self, PyObject *indices)
{
    PackedViewObject *v = VIEW(self);
    PyObject *out = NULL, *seq = PySequence_Fast(indices, "take() needs a sequence of indices");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    out = PyList_New(n);
    if (out == NULL)
        goto fail;
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_ssize_t k = PyNumber_AsSsize_t(PySequence_Fast_GET_ITEM(seq, j), PyExc_IndexError);
        if (k == -1 && PyErr_Occurred())
            goto fail;
        if (k < 0)
            k += v->len;
        if (k < 0 || k >= v->len) {
            index_error(v);
            goto fail;
        }
        PyObject *item = view_item_at(v, k);
        if (item == NULL)
            goto fail;
        PyList_SET_ITEM(out, j, item);
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

static PyObject *
view_get_nbytes(PyObject *self, void *Py_UNUSED(closure))
{
    PackedViewObject *v = VIEW(self);
    uint64_t total = 0;
    if (v->len > 0 && v->step == 1) {
        uint64_t a = load_offset(&v->offsets[v->start]);
        uint64_t b = load_offset(&v->offsets[v->start + v->len]);
        if (a > b || b > v->data_nbytes)
            return corrupt_item(v, v->start, a, b);
        total = b - a;
    }
    else {
        /* each item's length is at most data_nbytes < 2**63: the sum of len of them
         * could still wrap in theory, so it is checked */
        for (Py_ssize_t k = 0; k < v->len; k++) {
            uint64_t off, n;
            if (item_span(v, view_pos(v, k), &off, &n) < 0)
                return NULL;
            if (__builtin_add_overflow(total, n, &total))
                return PyErr_NoMemory();
        }
    }
    return PyLong_FromUnsignedLongLong(total + 8 * (uint64_t)v->len);
}

PyDoc_STRVAR(view_serialize_doc,
"_serialize() -> bytes\n--\n\n"
"This view's items as a complete packed segment (header, data, offsets).");

static PyObject *
view_serialize(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    PackedViewObject *v = VIEW(self);
    PyObject *out = NULL;
    uint64_t *src = NULL;     /* where each item's bytes start, as read in pass 1 */
    int64_t *dst_off = NULL;  /* the new offset table: len + 1 entries */
    size_t n = (size_t)v->len;
    /* Pass 1 reads every offset once and keeps what it read; pass 2 copies with
     * those values only. Another process may rewrite the offsets meanwhile: it
     * then changes what pass 1 sees, never how much pass 2 writes. */
    if (n + 1 > SIZE_MAX / sizeof(uint64_t))
        return PyErr_NoMemory();
    src = PyMem_RawMalloc((n ? n : 1) * sizeof(uint64_t));
    dst_off = PyMem_RawMalloc((n + 1) * sizeof(int64_t));
    if (src == NULL || dst_off == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t data_nbytes = 0;
    dst_off[0] = 0;
    for (size_t k = 0; k < n; k++) {
        uint64_t off, len;
        if (item_span(v, view_pos(v, (Py_ssize_t)k), &off, &len) < 0)
            goto done;
        if (__builtin_add_overflow(data_nbytes, len, &data_nbytes) ||
            data_nbytes > (uint64_t)PY_SSIZE_T_MAX) {
            PyErr_NoMemory();
            goto done;
        }
        src[k] = off;
        dst_off[k + 1] = (int64_t)data_nbytes;
    }
    fl_packed_hdr h;
    uint64_t offsets_off, table, total;
    if (__builtin_add_overflow((uint64_t)FL_PACKED_HDR_SIZE + 7, data_nbytes, &offsets_off) ||
        __builtin_mul_overflow((uint64_t)n + 1, (uint64_t)8, &table) ||
        __builtin_add_overflow(offsets_off & ~(uint64_t)7, table, &total) ||
        total > (uint64_t)PY_SSIZE_T_MAX) {
        PyErr_NoMemory();
        goto done;
    }
    memset(&h, 0, sizeof(h));
    memcpy(h.magic, FL_PACKED_MAGIC, 8);
    h.version = FL_PACKED_VERSION;
    h.kind = (uint32_t)v->kind;
    h.count = (uint64_t)n;
    h.data_off = FL_PACKED_HDR_SIZE;
    h.data_nbytes = data_nbytes;
    h.offsets_off = offsets_off & ~(uint64_t)7;
    h.total = total;
    h.byte_order = FL_PACKED_BYTE_ORDER;
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)h.total);
    if (out == NULL)
        goto done;
    uint8_t *base = (uint8_t *)PyBytes_AS_STRING(out);
    memset(base, 0, (size_t)h.offsets_off);
    memcpy(base, &h, sizeof(h));
    uint8_t *dst = base + FL_PACKED_HDR_SIZE;
    for (size_t k = 0; k < n; k++)
        memcpy(dst + dst_off[k], v->data + src[k], (size_t)(dst_off[k + 1] - dst_off[k]));
    memcpy(base + h.offsets_off, dst_off, (size_t)table);
done:
    PyMem_RawFree(src);
    PyMem_RawFree(dst_off);
    return out;
}

PyDoc_STRVAR(view_equal_doc,
"_equal_items(other) -> True, False or None\n--\n\n"
"Compare the items' bytes with another packed view. None: records whose bytes\n"
"differ (equal records may pickle differently), so decode and compare them.");

static PyObject *
view_equal_items(PyObject *self, PyObject *other)
{
    PackedViewObject *a = VIEW(self), *b;
    if (!has_dealloc(other, (void *)view_dealloc))
        return PyErr_Format(PyExc_TypeError, "expected a packed view, not %.200s",
                            Py_TYPE(other)->tp_name);
    b = VIEW(other);
    if (a->len != b->len || a->kind != b->kind)
        Py_RETURN_FALSE;
    for (Py_ssize_t k = 0; k < a->len; k++) {
        const char *p, *q;
        Py_ssize_t n, m;
        if (raw_item(a, view_pos(a, k), &p, &n) < 0 || raw_item(b, view_pos(b, k), &q, &m) < 0)
            return NULL;
        if (n != m || memcmp(p, q, (size_t)n) != 0) {
            if (a->kind == FL_PACKED_STR)
                Py_RETURN_FALSE;
            Py_RETURN_NONE;
        }
    }
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(view_validate_doc,
"validate() -> None\n--\n\n"
"Check every offset of the whole segment (O(n); reads of single items are\n"
"bounds-checked anyway). Raises ValueError naming the first bad item.");

static PyObject *
view_validate(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    PackedViewObject *v = VIEW(self);
    Py_ssize_t bad = -1;
    uint64_t a = 0, b = 0;
    Py_BEGIN_ALLOW_THREADS
    b = load_offset(&v->offsets[0]);
    for (Py_ssize_t i = 0; i < v->count; i++) {
        a = b;
        b = load_offset(&v->offsets[i + 1]);
        if (a > b || b > v->data_nbytes) {
            bad = i;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    if (bad >= 0)
        return corrupt_item(v, bad, a, b);
    Py_RETURN_NONE;
}

#define VIEW_INT_GETTER(field)                                                   \
    static PyObject *view_get_##field(PyObject *self, void *Py_UNUSED(closure)) \
    {                                                                            \
        return PyLong_FromSsize_t(VIEW(self)->field);                            \
    }
VIEW_INT_GETTER(start)
VIEW_INT_GETTER(step)
VIEW_INT_GETTER(count)

static PyObject *
view_get_kind(PyObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLong(VIEW(self)->kind);
}

static PyObject *
view_get_storage(PyObject *self, void *Py_UNUSED(closure))
{
    PyObject *s = VIEW(self)->storage;
    return Py_NewRef(s ? s : Py_None);
}

static PyObject *
view_get_mapping(PyObject *self, void *Py_UNUSED(closure))
{
    return Py_NewRef((PyObject *)VIEW(self)->map);
}

static PyObject *
view_get_whole(PyObject *self, void *Py_UNUSED(closure))
{
    PackedViewObject *v = VIEW(self);
    return PyBool_FromLong(v->len == v->count && (v->len == 0 || (v->start == 0 && v->step == 1)));
}

static PyGetSetDef view_getset[] = {
    {"nbytes", view_get_nbytes, NULL,
     PyDoc_STR("bytes of packed data this array covers: its items' bytes plus 8 bytes of "
               "offset per item"), NULL},
    {"_start", view_get_start, NULL, NULL, NULL},
    {"_step", view_get_step, NULL, NULL, NULL},
    {"_count", view_get_count, NULL, PyDoc_STR("items in the whole segment"), NULL},
    {"_kind", view_get_kind, NULL, NULL, NULL},
    {"_storage", view_get_storage, NULL, NULL, NULL},
    {"_mapping", view_get_mapping, NULL, NULL, NULL},
    {"_whole", view_get_whole, NULL, PyDoc_STR("True when this view is its whole segment"),
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef view_methods[] = {
    {"tolist", view_tolist, METH_NOARGS, view_tolist_doc},
    {"take", view_take, METH_O, view_take_doc},
    {"validate", view_validate, METH_NOARGS, view_validate_doc},
    {"_serialize", view_serialize, METH_NOARGS, view_serialize_doc},
    {"_equal_items", view_equal_items, METH_O, view_equal_doc},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot view_slots[] = {
    {Py_tp_new, view_new},
    {Py_tp_dealloc, view_dealloc},
    {Py_tp_traverse, view_traverse},
    {Py_tp_clear, view_clear},
    {Py_tp_getset, view_getset},
    {Py_tp_methods, view_methods},
    {Py_sq_length, view_length},
    {Py_sq_item, view_sq_item},
    {Py_sq_contains, view_contains},
    {Py_mp_length, view_length},
    {Py_mp_subscript, view_subscript},
    {Py_tp_doc, (void *)view_doc},
    {0, NULL},
};

static PyType_Spec view_spec = {
    .name = "fastloader._core.PackedView",
    .basicsize = sizeof(PackedViewObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE |
             Py_TPFLAGS_SEQUENCE | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = view_slots,
};

/* ---- PackedWriter ----------------------------------------------------------------- */

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
        w->dumps = import_attr("pickle", "dumps");
        w->pickling_error = import_attr("pickle", "PicklingError");
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

static void
writer_dealloc(PyObject *self)
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
    int code = write_all(w->fd, w->buf, w->buf_len, FL_PACKED_HDR_SIZE + w->flushed, err);
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

static int
wr_append(PackedWriterObject *w, const void *p, size_t n, int *err)
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
            code = write_all(w->fd, p, n, FL_PACKED_HDR_SIZE + w->flushed, err);
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

static int
writer_enter(PackedWriterObject *w)
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
static PyObject *
writer_raise(PackedWriterObject *w, int code, int err)
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
        code = wr_append(w, p, n, &err);
        Py_END_ALLOW_THREADS
    }
    else
        code = wr_append(w, p, n, &err);
    if (code != FL_OK) {
        writer_raise(w, code, err);
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
                raise_from(PyExc_ValueError,
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
            raise_from(w->pickling_error, "PackedArray: item %zd (of type %.200s) cannot be "
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
"extend(iterable) -> None\n--\n\n"
"Append every item of `iterable`, consuming it as it goes (no list is built).\n"
"A bad item raises, naming its index; the items before it stay appended.");

static PyObject *
writer_extend(PyObject *self, PyObject *iterable)
{
    PackedWriterObject *w = WRITER(self);
    PyObject *it = NULL, *item = NULL;
    int ok = 0;
    if (writer_enter(w) < 0)
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
    if (!utf8_valid(p, n, bad))
        return FL_CORRUPT;
    return wr_append(w, p, n, err);
}

PyDoc_STRVAR(writer_feed_lines_doc,
"feed_lines(buffer, final=False) -> None\n--\n\n"
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
    if (writer_enter(w) < 0) {
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
        return writer_raise(w, code, err);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(writer_finish_doc,
"finish() -> int\n--\n\n"
"Write the offsets and the header; returns the size of the finished file.");

static PyObject *
writer_finish(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    PackedWriterObject *w = WRITER(self);
    int code, err = 0;
    fl_packed_hdr h;
    if (writer_enter(w) < 0)
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
        code = write_all(w->fd, zeros, pad, FL_PACKED_HDR_SIZE + h.data_nbytes, &err);
    if (code == FL_OK)
        code = write_all(w->fd, w->offsets, 8 * w->noffsets, h.offsets_off, &err);
    /* the header last: a file cut short before this point has no magic number */
    if (code == FL_OK)
        code = write_all(w->fd, &h, sizeof(h), 0, &err);
    if (code == FL_OK && ftruncate(w->fd, (off_t)h.total) < 0) {
        err = errno;
        code = FL_ERRNO;
    }
    Py_END_ALLOW_THREADS
    w->busy = 0;
    if (code != FL_OK)
        return writer_raise(w, code, err);
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
    {Py_tp_dealloc, writer_dealloc},
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

/* ---- packed_scan: a sorted directory scan ------------------------------------------- */

#define SCAN_MAX_DEPTH 256

typedef struct {
    uint64_t off;
    uint32_t len;
} scan_ent;

typedef struct {
    /* input */
    uint8_t **suffix;
    size_t *suffix_len;
    size_t nsuffix;
    int follow;
    /* the relative path being built, prefix included, ending in "/" when not empty */
    char *path;
    size_t path_len, path_cap;
    struct {
        dev_t dev;
        ino_t ino;
    } anc[SCAN_MAX_DEPTH + 1];
    int depth;
    /* output */
    char *names;
    size_t names_len, names_cap;
    scan_ent *ents;
    size_t nents, ents_cap;
    /* the first error: errno and the path it concerns */
    int err;
    char *err_path;
} scan_ctx;

static int
grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap)
        return 0;
    size_t c = *cap ? *cap : 64, bytes;
    while (c < need)
        if (__builtin_mul_overflow(c, (size_t)2, &c))
            return -1;
    if (__builtin_mul_overflow(c, elem, &bytes))
        return -1;
    void *q = PyMem_RawRealloc(*p, bytes);
    if (q == NULL)
        return -1;
    *p = q;
    *cap = c;
    return 0;
}

static int
scan_fail(scan_ctx *c, int err, const char *name)
{
    if (c->err == 0) {
        size_t n = name ? strlen(name) : 0;
        c->err = err;
        c->err_path = PyMem_RawMalloc(c->path_len + n + 1);
        if (c->err_path != NULL) {
            memcpy(c->err_path, c->path, c->path_len);
            if (n)
                memcpy(c->err_path + c->path_len, name, n);
            c->err_path[c->path_len + n] = '\0';
        }
    }
    return -1;
}

static int
suffix_match(scan_ctx *c, const char *name, size_t n)
{
    if (c->nsuffix == 0)
        return 1;
    for (size_t k = 0; k < c->nsuffix; k++) {
        size_t m = c->suffix_len[k];
        if (m > n)
            continue;
        const uint8_t *tail = (const uint8_t *)name + n - m;
        size_t j = 0;
        for (; j < m; j++) {
            uint8_t ch = tail[j];
            if (ch >= 'A' && ch <= 'Z')
                ch = (uint8_t)(ch + 32);
            if (ch != c->suffix[k][j])
                break;
        }
        if (j == m)
            return 1;
    }
    return 0;
}

static int
scan_add(scan_ctx *c, const char *name, size_t n)
{
    size_t len = c->path_len + n;
    if (len > UINT32_MAX)
        return scan_fail(c, ENAMETOOLONG, name);
    if (len > SIZE_MAX - c->names_len ||
        grow((void **)&c->names, &c->names_cap, c->names_len + len, 1) < 0 ||
        grow((void **)&c->ents, &c->ents_cap, c->nents + 1, sizeof(scan_ent)) < 0)
        return scan_fail(c, ENOMEM, name);
    memcpy(c->names + c->names_len, c->path, c->path_len);
    memcpy(c->names + c->names_len + c->path_len, name, n);
    c->ents[c->nents].off = c->names_len;
    c->ents[c->nents].len = (uint32_t)len;
    c->nents++;
    c->names_len += len;
    return 0;
}

/* Scan the directory open as `fd` (consumed), whose relative path is c->path. */
static int
scan_dir(scan_ctx *c, int fd)
{
    DIR *d = fdopendir(fd);
    int rc = 0;
    if (d == NULL) {
        close(fd);
        return scan_fail(c, errno, NULL);
    }
    for (;;) {
        errno = 0;
        struct dirent *e = readdir(d);
        if (e == NULL) {
            if (errno != 0)
                rc = scan_fail(c, errno, NULL);
            break;
        }
        const char *name = e->d_name;
        if (name[0] == '.' && (name[1] == '\0' || (name[1] == '.' && name[2] == '\0')))
            continue;
        size_t n = strlen(name);
        int type = e->d_type, via_link = 0;
        struct stat st;
        /* Some filesystems do not fill d_type: ask. An entry removed meanwhile, or a
         * dangling symbolic link, is skipped. */
        if (type == DT_UNKNOWN) {
            if (fstatat(dirfd(d), name, &st, AT_SYMLINK_NOFOLLOW) < 0) {
                if (errno == ENOENT)
                    continue;
                rc = scan_fail(c, errno, name);
                break;
            }
            type = S_ISLNK(st.st_mode) ? DT_LNK : S_ISDIR(st.st_mode) ? DT_DIR
                 : S_ISREG(st.st_mode) ? DT_REG : DT_UNKNOWN;
        }
        /* a symbolic link counts as what it points to (a link to a file is a file,
         * as in os.walk) */
        if (type == DT_LNK) {
            via_link = 1;
            if (fstatat(dirfd(d), name, &st, 0) < 0) {
                if (errno == ENOENT || errno == ELOOP)
                    continue;
                rc = scan_fail(c, errno, name);
                break;
            }
            type = S_ISDIR(st.st_mode) ? DT_DIR : S_ISREG(st.st_mode) ? DT_REG : DT_UNKNOWN;
        }
        if (type == DT_REG) {
            if (suffix_match(c, name, n) && (rc = scan_add(c, name, n)) < 0)
                break;
            continue;
        }
        if (type != DT_DIR || (via_link && !c->follow))
            continue;
        int sub = openat(dirfd(d), name, O_RDONLY | O_DIRECTORY | O_CLOEXEC |
                                         (via_link ? 0 : O_NOFOLLOW));
        if (sub < 0 || fstat(sub, &st) < 0) {
            if (sub >= 0)
                close(sub);
            rc = scan_fail(c, errno, name);
            break;
        }
        int loop = 0;
        for (int k = 0; k <= c->depth; k++)
            if (c->anc[k].dev == st.st_dev && c->anc[k].ino == st.st_ino)
                loop = 1;
        if (loop) {   /* a link back to an ancestor: its files are listed already */
            close(sub);
            continue;
        }
        if (c->depth + 1 > SCAN_MAX_DEPTH) {
            close(sub);
            rc = scan_fail(c, ELOOP, name);
            break;
        }
        size_t saved = c->path_len;
        if (grow((void **)&c->path, &c->path_cap, saved + n + 2, 1) < 0) {
            close(sub);
            rc = scan_fail(c, ENOMEM, name);
            break;
        }
        memcpy(c->path + saved, name, n);
        c->path[saved + n] = '/';
        c->path_len = saved + n + 1;
        c->depth++;
        c->anc[c->depth].dev = st.st_dev;
        c->anc[c->depth].ino = st.st_ino;
        rc = scan_dir(c, sub);
        c->depth--;
        c->path_len = saved;
        if (rc < 0)
            break;
    }
    closedir(d);
    return rc;
}

static int
ent_cmp(const void *x, const void *y, void *arg)
{
    const scan_ent *a = x, *b = y;
    const char *names = arg;
    uint32_t n = a->len < b->len ? a->len : b->len;
    int r = memcmp(names + a->off, names + b->off, n);
    if (r != 0)
        return r;
    return (a->len > b->len) - (a->len < b->len);
}

PyDoc_STRVAR(packed_scan_doc,
"packed_scan(writer, directory, prefix, suffixes, follow_symlinks) -> int\n--\n\n"
"Append to `writer` (a PACKED_STR PackedWriter) the paths, relative to `directory`\n"
"(bytes) and preceded by `prefix` (bytes), of the regular files below it whose\n"
"names end with one of `suffixes` (a tuple of lowercase bytes, matched ignoring\n"
"ASCII case; None: every file), sorted bytewise. Symbolic links count as what they\n"
"point to; linked directories are entered only with follow_symlinks (never twice\n"
"on one path). Runs without the GIL. Returns the number of paths added.");

static PyObject *
packed_scan(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *writer, *suffixes;
    const char *dir;
    Py_buffer prefix = {0};
    int follow, fd = -1, code = FL_OK, err = 0, rc = -1;
    scan_ctx c;
    PyObject *result = NULL;
    memset(&c, 0, sizeof(c));
    if (!PyArg_ParseTuple(args, "Oyy*Op", &writer, &dir, &prefix, &suffixes, &follow))
        return NULL;
    if (!has_dealloc(writer, (void *)writer_dealloc) || WRITER(writer)->kind != FL_PACKED_STR) {
        PyErr_SetString(PyExc_TypeError, "packed_scan() needs a PACKED_STR PackedWriter");
        goto done;
    }
    if (suffixes != Py_None) {
        if (!PyTuple_Check(suffixes)) {
            PyErr_SetString(PyExc_TypeError, "suffixes must be a tuple of bytes or None");
            goto done;
        }
        c.nsuffix = (size_t)PyTuple_GET_SIZE(suffixes);
        c.suffix = PyMem_RawCalloc(c.nsuffix + 1, sizeof(uint8_t *));
        c.suffix_len = PyMem_RawCalloc(c.nsuffix + 1, sizeof(size_t));
        if (c.suffix == NULL || c.suffix_len == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        for (size_t k = 0; k < c.nsuffix; k++) {
            PyObject *s = PyTuple_GET_ITEM(suffixes, (Py_ssize_t)k);
            if (!PyBytes_Check(s)) {
                PyErr_SetString(PyExc_TypeError, "suffixes must be a tuple of bytes or None");
                goto done;
            }
            /* a copy: the scan runs without the GIL */
            c.suffix_len[k] = (size_t)PyBytes_GET_SIZE(s);
            c.suffix[k] = PyMem_RawMalloc(c.suffix_len[k] + 1);
            if (c.suffix[k] == NULL) {
                PyErr_NoMemory();
                goto done;
            }
            memcpy(c.suffix[k], PyBytes_AS_STRING(s), c.suffix_len[k]);
        }
        if (c.nsuffix == 0) {   /* an empty tuple matches nothing */
            result = PyLong_FromLong(0);
            goto done;
        }
    }
    c.follow = follow;
    if (grow((void **)&c.path, &c.path_cap, (size_t)prefix.len + 1, 1) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(c.path, prefix.buf, (size_t)prefix.len);
    c.path_len = (size_t)prefix.len;
    PackedWriterObject *w = WRITER(writer);
    if (writer_enter(w) < 0)
        goto done;
    Py_BEGIN_ALLOW_THREADS
    struct stat st;
    fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0 || fstat(fd, &st) < 0) {
        if (fd >= 0)
            close(fd);
        c.err = errno;
    }
    else {
        c.anc[0].dev = st.st_dev;
        c.anc[0].ino = st.st_ino;
        rc = scan_dir(&c, fd);
    }
    if (rc == 0 && c.nents > 0) {
        qsort_r(c.ents, c.nents, sizeof(scan_ent), ent_cmp, c.names);
        for (size_t k = 0; k < c.nents && code == FL_OK; k++)
            code = wr_append(w, c.names + c.ents[k].off, c.ents[k].len, &err);
    }
    Py_END_ALLOW_THREADS
    w->busy = 0;
    if (c.err != 0) {
        /* the path as the caller would spell it: directory + relative path */
        PyObject *full = c.err_path
            ? PyBytes_FromFormat("%s/%s", dir, c.err_path + prefix.len)
            : PyBytes_FromString(dir);
        if (full != NULL) {
            if (c.err == ELOOP)
                PyErr_Format(PyExc_OSError, "fastloader: directories nested more than %d "
                             "deep under %R", SCAN_MAX_DEPTH, full);
            else {
                errno = c.err;
                PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, full);
            }
            Py_DECREF(full);
        }
        goto done;
    }
    if (code != FL_OK) {
        writer_raise(w, code, err);
        goto done;
    }
    result = PyLong_FromSize_t(c.nents);
done:
    PyBuffer_Release(&prefix);
    for (size_t k = 0; c.suffix != NULL && k < c.nsuffix; k++)
        PyMem_RawFree(c.suffix[k]);
    PyMem_RawFree(c.suffix);
    PyMem_RawFree(c.suffix_len);
    PyMem_RawFree(c.path);
    PyMem_RawFree(c.names);
    PyMem_RawFree(c.ents);
    PyMem_RawFree(c.err_path);
    return result;
}

static PyMethodDef packed_functions[] = {
    {"packed_scan", packed_scan, METH_VARARGS, packed_scan_doc},
    {NULL, NULL, 0, NULL},
};

/* ---- module set-up ----------------------------------------------------------------- */

static int
add_packed_type(PyObject *module, PyType_Spec *spec)
{
    PyObject *t = PyType_FromModuleAndSpec(module, spec, NULL);
    if (t == NULL)
        return -1;
    int rc = PyModule_AddType(module, (PyTypeObject *)t);
    Py_DECREF(t);
    return rc;
}

int
fl_packed_init(PyObject *module)
{
    if (add_packed_type(module, &mapping_spec) < 0 || add_packed_type(module, &view_spec) < 0 ||
        add_packed_type(module, &writer_spec) < 0)
        return -1;
    if (PyModule_AddFunctions(module, packed_functions) < 0)
        return -1;
    if (PyModule_AddIntConstant(module, "PACKED_STR", FL_PACKED_STR) < 0 ||
        PyModule_AddIntConstant(module, "PACKED_PICKLE", FL_PACKED_PICKLE) < 0 ||
        PyModule_AddIntConstant(module, "PACKED_HEADER_SIZE", FL_PACKED_HDR_SIZE) < 0)
        return -1;
    return 0;
}
