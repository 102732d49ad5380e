/* PackedView: items [start, start + step, ...) of a mapping; the base class of
 * fastloader.PackedStringArray / PackedArray (python/fastloader/packed.py).
 * Every offset is read once (fl_packed_load_offset) and checked: see packed.c. */
#define _GNU_SOURCE
#include "packed_internal.h"
#include "private_text.h"
#include <errno.h>
#include <stdint.h>
#include <string.h>

static void view_dealloc(PyObject *self);

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
    uint64_t first = fl_packed_load_offset(&off[0]), last = fl_packed_load_offset(&off[h->count]);
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
    uint64_t a = fl_packed_load_offset(&v->offsets[i]), b = fl_packed_load_offset(&v->offsets[i + 1]);
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
         * returns them; valid UTF-8 takes the decoder's fast path regardless. The
         * file may be rewritten under us: decoded from a private copy. */
        return fl_utf8_from_shared(p, n, "surrogateescape");
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
    if (!fl_packed_has_dealloc(mapping, (void *)fl_packed_mapping_dealloc))
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
    if (h.kind == FL_PACKED_PICKLE && (loads = fl_packed_import_attr("pickle", "loads")) == NULL)
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

/* The first position k in [start, stop) whose item equals obj, as list.index
 * compares (identity, then ==); -1 if none, -2 with an exception set. A string
 * array compares UTF-8 bytes (a str that cannot be encoded is stored nowhere, and
 * anything but a str equals no stored item, as `in` has always answered), with no
 * object made per item; records are decoded one by one. The bounds are clamped
 * to [0, len]. */
static Py_ssize_t
view_find(PackedViewObject *v, PyObject *obj, Py_ssize_t start, Py_ssize_t stop)
{
    if (start < 0)
        start = 0;
    if (stop > v->len)
        stop = v->len;
    if (v->kind == FL_PACKED_STR) {
        if (!PyUnicode_Check(obj))
            return -1;
        PyObject *enc = PyUnicode_AsEncodedString(obj, "utf-8", "surrogateescape");
        if (enc == NULL) {
            /* not encodable, so not stored */
            if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError))
                return -2;
            PyErr_Clear();
            return -1;
        }
        const char *want = PyBytes_AS_STRING(enc);
        Py_ssize_t wn = PyBytes_GET_SIZE(enc);
        Py_ssize_t found = -1;
        for (Py_ssize_t k = start; k < stop; k++) {
            const char *p;
            Py_ssize_t n;
            if (raw_item(v, view_pos(v, k), &p, &n) < 0) {
                found = -2;
                break;
            }
            if (n == wn && memcmp(p, want, (size_t)n) == 0) {
                found = k;
                break;
            }
        }
        Py_DECREF(enc);
        return found;
    }
    for (Py_ssize_t k = start; k < stop; k++) {
        PyObject *item = view_item_at(v, k);
        if (item == NULL)
            return -2;
        int eq = PyObject_RichCompareBool(item, obj, Py_EQ);
        Py_DECREF(item);
        if (eq < 0)
            return -2;
        if (eq)
            return k;
    }
    return -1;
}

static int
view_contains(PyObject *self, PyObject *obj)
{
    Py_ssize_t k = view_find(VIEW(self), obj, 0, VIEW(self)->len);
    return k == -2 ? -1 : k >= 0;
}

PyDoc_STRVAR(view_find_doc,
"_find($self, value, start, stop, /)\n--\n\nReturns int.\n"
"The first position in [start, stop) (clamped to the array) whose item equals\n"
"value, as `in` compares; -1 if there is none.");

static PyObject *
view_find_method(PyObject *self, PyObject *args)
{
    PyObject *obj;
    Py_ssize_t start, stop;
    if (!PyArg_ParseTuple(args, "Onn:_find", &obj, &start, &stop))
        return NULL;
    Py_ssize_t k = view_find(VIEW(self), obj, start, stop);
    return k == -2 ? NULL : PyLong_FromSsize_t(k);
}

PyDoc_STRVAR(view_tolist_doc,
"tolist($self)\n--\n\nReturns list.\nEvery item as a new Python object, in a list.");

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

PyDoc_STRVAR(view_getitems_doc,
"__getitems__($self, indices, /)\n--\n\nReturns list.\n"
"[self[i] for i in indices], in one C call: torch's fetcher calls it for a batch\n"
"(the list then goes to collate_fn). Each index means what it means to self[i],\n"
"errors included.");

PyDoc_STRVAR(view_take_doc,
"take($self, indices)\n--\n\nReturns list.\n"
"[self[i] for i in indices], in C (the same as __getitems__).");

/* [self[i] for i in indices]: every key goes through view_subscript, so that every
 * index, and every error, is exactly self[key]'s. */
static PyObject *
view_getitems(PyObject *self, PyObject *indices)
{
    /* A tuple of our own: decoding a pickled record or an __index__ method runs
     * Python code, which could shrink a list we were walking. (A list copies in
     * O(n) pointers; a non-iterable fails as a comprehension over it would.) */
    PyObject *keys = PyTuple_CheckExact(indices) ? Py_NewRef(indices) : PySequence_Tuple(indices);
    if (keys == NULL)
        return NULL;
    /* A subclass that overrides __getitem__ gets its own __getitem__ per key: a
     * batch is then what torch would have built from it, one sample at a time. */
    int own = PyType_GetSlot(Py_TYPE(self), Py_mp_subscript) == (void *)view_subscript;
    Py_ssize_t n = PyTuple_GET_SIZE(keys);
    PyObject *out = PyList_New(n);
    if (out == NULL)
        goto fail;
    for (Py_ssize_t j = 0; j < n; j++) {
        /* view_subscript tries an exact int first: a sampler's index costs a
         * conversion, a bounds check and the decode, no Python call */
        PyObject *key = PyTuple_GET_ITEM(keys, j);
        PyObject *item = own ? view_subscript(self, key) : PyObject_GetItem(self, key);
        if (item == NULL)
            goto fail;
        PyList_SET_ITEM(out, j, item);
    }
    Py_DECREF(keys);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(keys);
    return NULL;
}

static PyObject *
view_get_nbytes(PyObject *self, void *Py_UNUSED(closure))
{
    PackedViewObject *v = VIEW(self);
    uint64_t total = 0;
    if (v->len > 0 && v->step == 1) {
        uint64_t a = fl_packed_load_offset(&v->offsets[v->start]);
        uint64_t b = fl_packed_load_offset(&v->offsets[v->start + v->len]);
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
"_serialize($self)\n--\n\nReturns bytes.\n"
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
"_equal_items($self, other)\n--\n\nReturns True, False or None.\n"
"Compare the items' bytes with another packed view. None: records whose bytes\n"
"differ (equal records may pickle differently), so decode and compare them.");

static PyObject *
view_equal_items(PyObject *self, PyObject *other)
{
    PackedViewObject *a = VIEW(self), *b;
    if (!fl_packed_has_dealloc(other, (void *)view_dealloc))
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
"validate($self)\n--\n\n"
"Check every offset of the whole segment (O(n); reads of single items are\n"
"bounds-checked anyway). Raises ValueError naming the first bad item.");

static PyObject *
view_validate(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    PackedViewObject *v = VIEW(self);
    Py_ssize_t bad = -1;
    uint64_t a = 0, b = 0;
    Py_BEGIN_ALLOW_THREADS
    b = fl_packed_load_offset(&v->offsets[0]);
    for (Py_ssize_t i = 0; i < v->count; i++) {
        a = b;
        b = fl_packed_load_offset(&v->offsets[i + 1]);
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
    {"take", view_getitems, METH_O, view_take_doc},
    {"__getitems__", view_getitems, METH_O, view_getitems_doc},
    {"validate", view_validate, METH_NOARGS, view_validate_doc},
    {"_serialize", view_serialize, METH_NOARGS, view_serialize_doc},
    {"_equal_items", view_equal_items, METH_O, view_equal_doc},
    {"_find", view_find_method, METH_VARARGS, view_find_doc},
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

int
fl_packed_view_init(PyObject *module)
{
    PyObject *t = PyType_FromModuleAndSpec(module, &view_spec, NULL);
    if (t == NULL)
        return -1;
    int rc = PyModule_AddType(module, (PyTypeObject *)t);
    Py_DECREF(t);
    return rc;
}
