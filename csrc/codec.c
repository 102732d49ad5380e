#define NO_IMPORT_ARRAY
#define PY_ARRAY_UNIQUE_SYMBOL fastloader_ARRAY_API
#include "codec.h"
#include "identity_table.h"
#include "private_text.h"
#include <numpy/arrayobject.h>
#include <numpy/arrayscalars.h>
#include <string.h>

enum {
    T_NONE = 1, T_FALSE, T_TRUE, T_INT, T_FLOAT, T_STR, T_BYTES,
    T_LIST, T_TUPLE, T_DICT, T_NAMEDTUPLE, T_ARRAY, T_TENSOR, T_NPSCALAR, T_PICKLE,
    T_TENSOR_VIEW,  /* a tensor at an offset/strides into a storage (maybe shared) */
    T_ARRAY_F,      /* a Fortran-ordered ndarray: NumPy's pickle keeps that order */
    T_MEMO,         /* the next node is remembered (in completion order) for T_REF */
    T_REF,          /* the same object again, as pickle's memo delivers it */
};

#define FL_DATA_ALIGN 64
#define FL_MAX_DEPTH 200
/* A container this deep travels pickled whole, with its tensors and arrays still
 * out of band: pickle nests as deep as Python's recursion limit allows, as in
 * torch's queue, while the codec's own nesting (which the decoder bounds, as
 * hostile input) stays under FL_MAX_DEPTH. The pickle's buffer list and its
 * leaves take the two levels below. */
#define FL_PICKLE_DEPTH (FL_MAX_DEPTH - 4)

typedef struct {
    uint32_t magic;
    uint32_t version;
    uint64_t stream_len;
    uint64_t data_off;   /* from the start of the batch, multiple of 64 */
    uint64_t total;
    uint64_t stab_len;   /* storage table, right before the node stream */
} fl_batch_hdr;

#define FL_BATCH_VERSION 2

/* One storage table entry (on the wire): where the copied window of a tensor
 * storage lies in the data area, and where that window starts in the storage. */
typedef struct {
    uint64_t off;
    uint64_t nbytes;
    uint64_t wlo;
} fl_stab_entry;

/* Copy the whole storage (as torch's transport does) unless the batch's tensors
 * use only a small part of a big one (a row of a dataset-sized tensor): then only
 * the used bytes travel, so a view of a huge storage does not copy all of it. */
#define FL_WHOLE_STORAGE_SLACK 65536

#define FL_STREAM_OFF 64

enum { OP_MEMCPY = 1, OP_COPYINTO, OP_FILL, OP_RAW };

typedef struct {
    int kind;
    PyObject *obj;            /* ndarray, bytes, deferred stack, or storage (owned) */
    const uint8_t *src;       /* OP_RAW: bytes kept alive by obj */
    PyArray_Descr *descr;     /* OP_COPYINTO / OP_FILL (owned) */
    int ndim;
    npy_intp dims[NPY_MAXDIMS];
    size_t off;               /* relative to the data area */
    size_t nbytes;
} fl_op;

/* A tensor storage of the batch: its bytes travel once, whatever number of
 * tensors view them. */
typedef struct {
    uintptr_t ptr;            /* 0 for a deferred stack (filled by its op) */
    size_t nbytes;            /* the whole storage */
    size_t lo, hi;            /* the bytes the batch's tensors touch */
    PyObject *storage;        /* keeps the bytes alive (owned) */
    Py_ssize_t op;            /* data op of the copied window, -1 until finalised */
    size_t wlo;
} fl_storage;

struct fl_plan {
    uint8_t *stream;
    size_t slen, scap;
    fl_op *ops;
    size_t nops, opcap;
    size_t data_size;
    fl_storage *stor;
    size_t nstor, storcap;
    PyObject *stor_index;     /* storage data_ptr -> index into stor */
    PyObject *memo;           /* id(obj) -> memo index, objects kept alive by `keep` */
    PyObject *keep;
    fl_identity_table texts;  /* str and bytes objects -> memo index (plan_text) */
    uint64_t nmemo;
    fl_stab_entry *stab;      /* built by finalise */
    /* the lists, tuples and dicts being planned, outermost first: one met again
     * inside itself makes the batch recursive (see fl_plan_build) */
    PyObject *open[FL_MAX_DEPTH + 2];
    int nopen;
    int recursive;
};

fl_plan *
fl_plan_new(void)
{
    fl_plan *p = PyMem_Calloc(1, sizeof(fl_plan));
    if (p == NULL)
        PyErr_NoMemory();
    return p;
}

/* Release what a plan holds and make it empty again. */
static void
plan_clear(fl_plan *p)
{
    for (size_t i = 0; i < p->nops; i++) {
        Py_XDECREF(p->ops[i].obj);
        Py_XDECREF(p->ops[i].descr);
    }
    for (size_t i = 0; i < p->nstor; i++)
        Py_XDECREF(p->stor[i].storage);
    Py_XDECREF(p->stor_index);
    Py_XDECREF(p->memo);
    Py_XDECREF(p->keep);
    fl_identity_clear(&p->texts);
    PyMem_Free(p->stor);
    PyMem_Free(p->stab);
    PyMem_Free(p->ops);
    PyMem_Free(p->stream);
    memset(p, 0, sizeof(*p));
}

void
fl_plan_free(fl_plan *p)
{
    if (p == NULL)
        return;
    plan_clear(p);
    PyMem_Free(p);
}

size_t
fl_plan_size(const fl_plan *p)
{
    return FL_ALIGN_UP(FL_STREAM_OFF + p->nstor * sizeof(fl_stab_entry) + p->slen,
                       FL_DATA_ALIGN) +
           p->data_size;
}

/* ---- node stream writing ---- */

static int
put(fl_plan *p, const void *src, size_t n)
{
    if (p->slen + n > p->scap) {
        size_t cap = p->scap ? p->scap * 2 : 256;
        while (cap < p->slen + n)
            cap *= 2;
        uint8_t *s = PyMem_Realloc(p->stream, cap);
        if (s == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        p->stream = s;
        p->scap = cap;
    }
    memcpy(p->stream + p->slen, src, n);
    p->slen += n;
    return 0;
}

static int put_u8(fl_plan *p, uint8_t v) { return put(p, &v, 1); }
static int put_u64(fl_plan *p, uint64_t v) { return put(p, &v, 8); }
static int put_i64(fl_plan *p, int64_t v) { return put(p, &v, 8); }
static int put_i32(fl_plan *p, int32_t v) { return put(p, &v, 4); }

/* The most a batch's arrays may add up to. Each array's size was checked on its
 * own, but arrays that use almost no memory can claim any size (a broadcast view
 * of one byte as 2**62 of them), and a sum that wrapped past SIZE_MAX would give
 * the batch a slot far too small for what is then copied into it. No machine has
 * 2**60 bytes, and below it every later sum (header, slot headroom) fits too. */
#define FL_MAX_PLAN_DATA ((size_t)1 << 60)

static fl_op *
add_op(fl_plan *p, int kind, size_t nbytes)
{
    if (nbytes > FL_MAX_PLAN_DATA ||
        FL_ALIGN_UP(nbytes, FL_DATA_ALIGN) > FL_MAX_PLAN_DATA - p->data_size) {
        PyErr_Format(PyExc_MemoryError,
                     "fastloader: the batch is too large to send: its arrays add up to "
                     "more than %zu bytes", FL_MAX_PLAN_DATA);
        return NULL;
    }
    if (p->nops == p->opcap) {
        size_t cap = p->opcap ? p->opcap * 2 : 8;
        fl_op *o = PyMem_Realloc(p->ops, cap * sizeof(fl_op));
        if (o == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        p->ops = o;
        p->opcap = cap;
    }
    fl_op *op = &p->ops[p->nops++];
    memset(op, 0, sizeof(*op));
    op->kind = kind;
    op->nbytes = nbytes;
    op->off = p->data_size;
    p->data_size += FL_ALIGN_UP(nbytes, FL_DATA_ALIGN);
    return op;
}

static int
allowed_typenum(int t)
{
    return (t >= NPY_BOOL && t <= NPY_CLONGDOUBLE) || t == NPY_HALF;
}

/* The type number pickle's round trip gives: a dtype pickles as its kind and
 * size ("i8"), which names long where long and long long have one size, so a
 * longlong array or scalar arrives as int64 through torch's queue. */
static int
canonical_typenum(int t)
{
#if NPY_SIZEOF_LONG == NPY_SIZEOF_LONGLONG
    if (t == NPY_LONGLONG)
        return NPY_LONG;
    if (t == NPY_ULONGLONG)
        return NPY_ULONG;
#endif
    return t;
}

/* Whether an ndarray travels as dtype number + shape + bytes. A dtype carrying
 * metadata (h5py marks enums and variable-length strings so) would lose it there:
 * such an array is pickled, as torch's transport does, which keeps it. */
static int
plain_array(PyArrayObject *a)
{
    PyArray_Descr *d = PyArray_DESCR(a);
    return allowed_typenum(d->type_num) && PyArray_ISNBO(d->byteorder) &&
           !PyDataType_HASFIELDS(d) && !PyDataType_HASSUBARRAY(d) &&
           PyDataType_METADATA(d) == NULL;
}

/* shape + data of an array-like node; `arr` may be NULL for OP_FILL */
static int
put_array_body(fl_plan *p, int typenum, int ndim, const npy_intp *dims, size_t nbytes,
               fl_op **op_out, int opkind)
{
    if (put_i32(p, typenum) < 0 || put_u64(p, (uint64_t)ndim) < 0)
        return -1;
    for (int i = 0; i < ndim; i++)
        if (put_i64(p, (int64_t)dims[i]) < 0)
            return -1;
    fl_op *op = add_op(p, opkind, nbytes);
    if (op == NULL)
        return -1;
    if (put_u64(p, op->off) < 0 || put_u64(p, nbytes) < 0)
        return -1;
    op->ndim = ndim;
    if (ndim > 0)   /* a 0-d array may have no dims pointer at all */
        memcpy(op->dims, dims, sizeof(npy_intp) * (size_t)ndim);
    *op_out = op;
    return 0;
}

static int plan_obj(fl_state *st, fl_plan *p, PyObject *o, int depth);
static int plan_memo(fl_state *st, fl_plan *p, PyObject *o, int depth);
static int plan_text(fl_state *st, fl_plan *p, PyObject *o, int depth);
static int is_text(PyObject *o);
static int plan_compound(fl_state *st, fl_plan *p, PyObject *o, int depth);
static int plan_open(fl_state *st, fl_plan *p, PyObject *o, int depth);
static int plan_pickle(fl_state *st, fl_plan *p, PyObject *o, int depth);
static int plan_seq(fl_state *st, fl_plan *p, PyObject *o, int depth, Py_ssize_t held);
static int plan_item(fl_state *st, fl_plan *p, PyObject *o, int depth, Py_ssize_t held);

static int
plan_ndarray(fl_plan *p, PyArrayObject *a)
{
    fl_op *op;
    /* an F-only array travels in its own order (tagged T_ARRAY_F by the caller) */
    int contiguous = PyArray_IS_C_CONTIGUOUS(a) || PyArray_IS_F_CONTIGUOUS(a);
    if (put_array_body(p, canonical_typenum(PyArray_TYPE(a)), PyArray_NDIM(a), PyArray_DIMS(a),
                       (size_t)PyArray_NBYTES(a), &op,
                       contiguous ? OP_MEMCPY : OP_COPYINTO) < 0)
        return -1;
    Py_INCREF(a);
    op->obj = (PyObject *)a;
    if (!contiguous) {
        op->descr = PyArray_DESCR(a);
        Py_INCREF(op->descr);
    }
    return 0;
}

/* A new storage table entry; takes a reference to `storage` */
static Py_ssize_t
add_storage(fl_plan *p, uintptr_t ptr, size_t nbytes, PyObject *storage)
{
    if (p->nstor == p->storcap) {
        size_t cap = p->storcap ? p->storcap * 2 : 8;
        fl_storage *n = PyMem_Realloc(p->stor, cap * sizeof(fl_storage));
        if (n == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        p->stor = n;
        p->storcap = cap;
    }
    fl_storage *e = &p->stor[p->nstor];
    e->ptr = ptr;
    e->nbytes = nbytes;
    e->lo = SIZE_MAX;
    e->hi = 0;
    e->storage = Py_XNewRef(storage);
    e->op = -1;
    e->wlo = 0;
    return (Py_ssize_t)p->nstor++;
}

/* The storage entry of a tensor's storage: the same one for every tensor on it.
 * torch keeps one storage object per storage while it lives (the entry holds it,
 * so its address is not reused meanwhile): the same object is the same storage,
 * shared as torch's transport shares it, and two objects are two storages, even
 * over the same bytes (torch.from_numpy() twice on one array), as torch's
 * transport moves each on its own. Keyed by a 1-tuple of the object's address;
 * without an object, by the bytes' address (an int, which no tuple equals). */
static Py_ssize_t
find_storage(fl_plan *p, uintptr_t ptr, size_t nbytes, PyObject *storage)
{
    int empty = ptr == 0 || nbytes == 0;
    if (empty && storage == NULL)
        return add_storage(p, ptr, nbytes, storage);
    if (p->stor_index == NULL && (p->stor_index = PyDict_New()) == NULL)
        return -1;
    PyObject *key = storage != NULL ? Py_BuildValue("(N)", PyLong_FromVoidPtr(storage))
                                    : PyLong_FromSize_t((size_t)ptr);
    if (key == NULL)
        return -1;
    Py_ssize_t idx = -1;
    PyObject *hit = PyDict_GetItemWithError(p->stor_index, key);
    if (hit != NULL) {
        idx = PyLong_AsSsize_t(hit);
        /* two storages at one address with different sizes stay separate */
        if (idx >= 0 && p->stor[idx].nbytes != nbytes)
            idx = add_storage(p, ptr, nbytes, storage);
    }
    else if (!PyErr_Occurred()) {
        idx = add_storage(p, ptr, nbytes, storage);
        PyObject *v = idx >= 0 ? PyLong_FromSsize_t(idx) : NULL;
        if (v == NULL || PyDict_SetItem(p->stor_index, key, v) < 0)
            idx = -1;
        Py_XDECREF(v);
    }
    Py_DECREF(key);
    return idx;
}

static PyObject *
export_error(const char *what)
{
    return PyErr_Format(PyExc_TypeError, "fastloader: tensor export hook misbehaved (%s)",
                        what);
}

static int
plan_tensor(fl_state *st, fl_plan *p, PyObject *t, int depth)
{
    /* hook_export: tensor -> (untyped storage, its data_ptr, its nbytes, dtype code,
     * requires_grad, NumPy typenum of the bytes, storage_offset, shape, stride) */
    PyObject *r = PyObject_CallOneArg(st->hook_export, t);
    PyObject *storage, *shape, *stride;
    unsigned long long ptr;
    Py_ssize_t snbytes;
    int code, rg, typenum, rc = -1;
    long long offset;
    int64_t sizes[NPY_MAXDIMS], strides[NPY_MAXDIMS];
    if (r == NULL)
        return -1;
    if (r == Py_None) { /* not a plain CPU tensor: pickle it as torch would */
        Py_DECREF(r);
        return plan_pickle(st, p, t, depth);
    }
    if (!PyArg_ParseTuple(r, "OKnipiLO!O!", &storage, &ptr, &snbytes, &code, &rg, &typenum,
                          &offset, &PyTuple_Type, &shape, &PyTuple_Type, &stride))
        goto done;
    Py_ssize_t ndim = PyTuple_GET_SIZE(shape);
    if (ndim > NPY_MAXDIMS || PyTuple_GET_SIZE(stride) != ndim || !allowed_typenum(typenum) ||
        code < 0 || code >= 64 || snbytes < 0 || offset < 0) {
        export_error("header");
        goto done;
    }
    PyArray_Descr *descr = PyArray_DescrFromType(typenum);
    if (descr == NULL)
        goto done;
    size_t k = (size_t)PyDataType_ELSIZE(descr);
    Py_DECREF(descr);
    /* numel, the last element, and whether the strides are exactly the C-order ones
     * the decoder's whole-storage tensor gets (NumPy's: every dim counts, a size-1
     * one too). torch's is_contiguous() ignores size-1 dims, but its transport keeps
     * their strides, which tell channels_last from contiguous when C == 1. */
    size_t numel = 1, maxel = (size_t)offset;
    int64_t expect = 1;
    int contiguous = 1;
    for (Py_ssize_t i = ndim - 1; i >= 0; i--) {
        sizes[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
        strides[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(stride, i));
        if (PyErr_Occurred())
            goto done;
        if (sizes[i] < 0 || strides[i] < 0) {
            export_error("negative size or stride");
            goto done;
        }
        if (strides[i] != expect)
            contiguous = 0;
        if (__builtin_mul_overflow(expect, sizes[i], &expect) ||
            __builtin_mul_overflow(numel, (size_t)sizes[i], &numel)) {
            PyErr_SetString(PyExc_OverflowError, "fastloader: tensor too large");
            goto done;
        }
    }
    size_t lo = 0, hi = 0, tbytes = 0;
    if (numel > 0) {
        for (Py_ssize_t i = 0; i < ndim; i++) {
            size_t step;
            if (__builtin_mul_overflow((size_t)(sizes[i] - 1), (size_t)strides[i], &step) ||
                __builtin_add_overflow(maxel, step, &maxel)) {
                PyErr_SetString(PyExc_OverflowError, "fastloader: tensor too large");
                goto done;
            }
        }
        if (__builtin_mul_overflow((size_t)offset, k, &lo) ||
            __builtin_mul_overflow(maxel + 1, k, &hi) || hi > (size_t)snbytes) {
            export_error("tensor outside its storage");
            goto done;
        }
        tbytes = numel * k;
    }
    else {
        /* no elements: any strides are valid, and the decoder's (NumPy's) differ by
         * version, so they travel as they are */
        contiguous = 0;
    }
    Py_ssize_t sidx = find_storage(p, (uintptr_t)ptr, (size_t)snbytes, storage);
    if (sidx < 0)
        goto done;
    fl_storage *e = &p->stor[sidx];
    if (numel > 0) {
        e->lo = lo < e->lo ? lo : e->lo;
        e->hi = hi > e->hi ? hi : e->hi;
    }
    if (offset == 0 && contiguous && tbytes == (size_t)snbytes) {
        /* the common case: the tensor is its whole storage */
        if (put_u8(p, T_TENSOR) < 0 || put_i32(p, code) < 0 || put_i32(p, rg) < 0 ||
            put_i32(p, typenum) < 0 || put_u64(p, (uint64_t)ndim) < 0)
            goto done;
        for (Py_ssize_t i = 0; i < ndim; i++)
            if (put_i64(p, sizes[i]) < 0)
                goto done;
        if (put_u64(p, (uint64_t)sidx) < 0)
            goto done;
    }
    else {
        if (put_u8(p, T_TENSOR_VIEW) < 0 || put_i32(p, code) < 0 || put_i32(p, rg) < 0 ||
            put_i32(p, typenum) < 0 || put_u64(p, (uint64_t)sidx) < 0 ||
            put_i64(p, offset) < 0 || put_u64(p, (uint64_t)ndim) < 0)
            goto done;
        for (Py_ssize_t i = 0; i < ndim; i++)
            if (put_i64(p, sizes[i]) < 0 || put_i64(p, strides[i]) < 0)
                goto done;
    }
    rc = 0;
done:
    Py_DECREF(r);
    return rc;
}

static int
plan_stack(fl_state *st, fl_plan *p, PyObject *s)
{
    /* hook_plan: deferred stack -> (shape tuple, np.dtype, dtype code) */
    PyObject *r = PyObject_CallOneArg(st->hook_plan, s);
    PyObject *shape;
    PyArray_Descr *descr;
    int code;
    npy_intp dims[NPY_MAXDIMS];
    if (r == NULL)
        return -1;
    if (!PyArg_ParseTuple(r, "O!O!i", &PyTuple_Type, &shape, &PyArrayDescr_Type, &descr,
                          &code))
        goto fail;
    Py_ssize_t ndim = PyTuple_GET_SIZE(shape);
    if (ndim > NPY_MAXDIMS || !allowed_typenum(descr->type_num)) {
        PyErr_SetString(PyExc_ValueError, "fastloader: unsupported stacked tensor");
        goto fail;
    }
    size_t nbytes = (size_t)PyDataType_ELSIZE(descr);
    for (Py_ssize_t i = 0; i < ndim; i++) {
        dims[i] = (npy_intp)PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, i));
        if (dims[i] < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "fastloader: negative dimension");
            goto fail;
        }
        if (__builtin_mul_overflow(nbytes, (size_t)dims[i], &nbytes)) {
            PyErr_SetString(PyExc_OverflowError, "fastloader: tensor too large");
            goto fail;
        }
    }
    Py_ssize_t sidx = add_storage(p, 0, nbytes, NULL);
    fl_op *op = sidx < 0 ? NULL : add_op(p, OP_FILL, nbytes);
    if (op == NULL)
        goto fail;
    p->stor[sidx].op = (Py_ssize_t)(op - p->ops);
    op->ndim = (int)ndim;
    if (ndim > 0)
        memcpy(op->dims, dims, sizeof(npy_intp) * (size_t)ndim);
    Py_INCREF(s);
    op->obj = s;
    Py_INCREF(descr);
    op->descr = descr;
    if (put_u8(p, T_TENSOR) < 0 || put_i32(p, code) < 0 || put_i32(p, 0) < 0 ||
        put_i32(p, descr->type_num) < 0 || put_u64(p, (uint64_t)ndim) < 0)
        goto fail;
    for (Py_ssize_t i = 0; i < ndim; i++)
        if (put_i64(p, (int64_t)dims[i]) < 0)
            goto fail;
    if (put_u64(p, (uint64_t)sidx) < 0)
        goto fail;
    Py_DECREF(r);
    return 0;
fail:
    Py_DECREF(r);
    return -1;
}

/* The ids of the open containers around `o` (not `o` itself), or NULL with no
 * exception when there are none. */
static PyObject *
enclosing_ids(fl_plan *p, PyObject *o)
{
    PyObject *ids = NULL;
    for (int i = 0; i < p->nopen; i++) {
        if (p->open[i] == o)
            continue;
        if (ids == NULL && (ids = PySet_New(NULL)) == NULL)
            return NULL;
        PyObject *key = PyLong_FromVoidPtr(p->open[i]);
        if (key == NULL || PySet_Add(ids, key) < 0) {
            Py_XDECREF(key);
            Py_DECREF(ids);
            return NULL;
        }
        Py_DECREF(key);
    }
    return ids;
}

static int
plan_pickle(fl_state *st, fl_plan *p, PyObject *o, int depth)
{
    /* hook_dumps: (obj, enclosing ids) -> (bytes, [tensors and arrays moved out of
     * band]); it raises a RecursionError if the object reaches back to a container
     * around it (a recursion through a pickled object, see plan_open) */
    PyObject *enclosing = enclosing_ids(p, o);
    if (enclosing == NULL && PyErr_Occurred())
        return -1;
    PyObject *r = enclosing ? PyObject_CallFunctionObjArgs(st->hook_dumps, o, enclosing, NULL)
                            : PyObject_CallOneArg(st->hook_dumps, o);
    PyObject *data, *oob;
    if (r == NULL && enclosing != NULL && PyErr_ExceptionMatches(PyExc_RecursionError))
        p->recursive = 1;
    Py_XDECREF(enclosing);
    if (r == NULL)
        return -1;
    if (!PyArg_ParseTuple(r, "O!O!", &PyBytes_Type, &data, &PyList_Type, &oob)) {
        Py_DECREF(r);
        return -1;
    }
    size_t n = (size_t)PyBytes_GET_SIZE(data);
    fl_op *op = NULL;
    int rc = -1;
    if (put_u8(p, T_PICKLE) < 0 || (op = add_op(p, OP_MEMCPY, n)) == NULL)
        goto done;
    Py_INCREF(data);
    op->obj = data;
    if (put_u64(p, op->off) < 0 || put_u64(p, n) < 0)
        goto done;
    /* the buffer list as a plain T_LIST (not through plan_obj: at FL_PICKLE_DEPTH
     * a list would be pickled again); its items are tensors and arrays */
    if (put_u8(p, T_LIST) < 0)
        goto done;
    rc = plan_seq(st, p, oob, depth + 1, 0);
done:
    Py_DECREF(r);
    return rc;
}

/* Plan the items of a list or tuple. `held`: the references the planner's own
 * objects hold to an item that occurs once (see plan_item); 0 if not known. */
static int
plan_seq(fl_state *st, fl_plan *p, PyObject *o, int depth, Py_ssize_t held)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
    if (put_u64(p, (uint64_t)n) < 0)
        return -1;
    if (n > 64) {
        /* a column of strings (file names that the dataset also holds): size their
         * memo once, not by doubling */
        size_t texts = 0;
        for (Py_ssize_t i = 0; i < n; i++)
            texts += is_text(PySequence_Fast_GET_ITEM(o, i)) &&
                     Py_REFCNT(PySequence_Fast_GET_ITEM(o, i)) > held;
        if (texts > 64 && fl_identity_reserve(&p->texts, p->texts.used + texts) < 0)
            return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (plan_item(st, p, PySequence_Fast_GET_ITEM(o, i), depth + 1, held) < 0)
            return -1;
    return 0;
}

/* Whether the instance carries state of its own: attributes in a __dict__ (a tuple
 * subclass cannot have slots of its own), which pickle would restore. */
static int
has_instance_state(PyObject *o)
{
    PyTypeObject *tp = Py_TYPE(o);
    int has_dict = tp->tp_dictoffset != 0;
#ifdef Py_TPFLAGS_MANAGED_DICT
    has_dict = has_dict || (tp->tp_flags & Py_TPFLAGS_MANAGED_DICT);
#endif
    if (!has_dict)
        return 0;
    PyObject *d = PyObject_GenericGetDict(o, NULL);
    if (d == NULL)
        return -1;
    int r = PyDict_Check(d) ? PyDict_GET_SIZE(d) > 0 : 1;
    Py_DECREF(d);
    return r;
}

/* A namedtuple instance travels as its pickled class and its fields, and the main
 * process rebuilds it as pickle would (cls.__new__(cls, *fields), no __init__), if
 * that is all pickle would do: hook_namedtuple decides per class (None: the class
 * pickles its instances its own way), and an instance with attributes of its own
 * is pickled whole too. Returns 1 if the instance must be pickled instead. */
static int
plan_namedtuple(fl_state *st, fl_plan *p, PyObject *o, int depth)
{
    PyObject *cls = (PyObject *)Py_TYPE(o);
    PyObject *pickled = PyDict_GetItemWithError(st->class_cache, cls);
    if (pickled == NULL) {
        if (PyErr_Occurred())
            return -1;
        PyObject *r = PyObject_CallOneArg(st->hook_namedtuple, cls);
        if (r == NULL)
            return -1;
        if ((r != Py_None && !PyBytes_Check(r)) || PyDict_SetItem(st->class_cache, cls, r) < 0) {
            Py_DECREF(r);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "fastloader: cannot pickle namedtuple class");
            return -1;
        }
        pickled = r;
        Py_DECREF(r); /* the cache keeps `pickled` alive */
    }
    if (pickled == Py_None)
        return 1;
    int state = has_instance_state(o);
    if (state != 0)
        return state;
    if (put_u8(p, T_NAMEDTUPLE) < 0 || put_u64(p, (uint64_t)PyBytes_GET_SIZE(pickled)) < 0 ||
        put(p, PyBytes_AS_STRING(pickled), (size_t)PyBytes_GET_SIZE(pickled)) < 0)
        return -1;
    return plan_seq(st, p, o, depth, 1);
}

static int
plan_obj(fl_state *st, fl_plan *p, PyObject *o, int depth)
{
    PyTypeObject *tp = Py_TYPE(o);
    if (depth > FL_MAX_DEPTH) {
        PyErr_SetString(PyExc_RecursionError, "fastloader: batch nested too deeply");
        return -1;
    }
    if (o == Py_None)
        return put_u8(p, T_NONE);
    if (tp == &PyBool_Type)
        return put_u8(p, o == Py_True ? T_TRUE : T_FALSE);
    if (tp == &PyLong_Type) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (v == -1 && PyErr_Occurred())
            return -1;
        if (!overflow)
            return put_u8(p, T_INT) < 0 ? -1 : put_i64(p, (int64_t)v);
        return plan_pickle(st, p, o, depth);
    }
    if (tp == &PyFloat_Type) {
        double d = PyFloat_AS_DOUBLE(o);
        return put_u8(p, T_FLOAT) < 0 ? -1 : put(p, &d, 8);
    }
    if (tp == &PyUnicode_Type || tp == &PyBytes_Type)
        return plan_text(st, p, o, depth);
    return plan_memo(st, p, o, depth);
}

static int
is_text(PyObject *o)
{
    return PyUnicode_CheckExact(o) || PyBytes_CheckExact(o);
}

/* A str or bytes node, not memoized. 1 (nothing written) for a str that is not
 * UTF-8 (lone surrogates), which the caller pickles: pickle keeps it. */
static int
put_text(fl_plan *p, PyObject *o)
{
    Py_ssize_t n;
    const char *s;
    uint8_t tag;
    if (PyUnicode_Check(o)) {
        tag = T_STR;
        s = PyUnicode_AsUTF8AndSize(o, &n);
        if (s == NULL) {
            PyErr_Clear();
            return 1;
        }
    }
    else {
        tag = T_BYTES;
        s = PyBytes_AS_STRING(o);
        n = PyBytes_GET_SIZE(o);
    }
    return (put_u8(p, tag) < 0 || put_u64(p, (uint64_t)n) < 0 || put(p, s, (size_t)n) < 0) ? -1 : 0;
}

/* A str or bytes: like pickle, which memoizes both, the same object met again in
 * the batch is a reference to the first (a label string that every sample shares
 * arrives as one object, as with torch). Its own table, not plan_memo's dict: no
 * allocation per string. The index is given once the node is complete, as in
 * plan_memo (the decoder numbers nodes in completion order). */
static int
plan_text(fl_state *st, fl_plan *p, PyObject *o, int depth)
{
    uint64_t idx;
    if (fl_identity_find(&p->texts, o, &idx))
        return (put_u8(p, T_REF) < 0 || put_u64(p, idx) < 0) ? -1 : 0;
    if (put_u8(p, T_MEMO) < 0)
        return -1;
    int rc = put_text(p, o);
    if (rc > 0)
        rc = plan_pickle(st, p, o, depth);
    if (rc < 0 || fl_identity_add(&p->texts, o, p->nmemo) < 0)
        return -1;
    p->nmemo++;
    return 0;
}

/* An item of a list, tuple or dict. A str or bytes that only the planner's own
 * objects refer to (`held` references: the container's, and the copy or the
 * (key, value) pair it is read through) occurs once in the batch, so it needs no
 * memo: most strings of a batch (tokens, captions) are made by the dataset for it,
 * and pass here without a table look-up. */
static int
plan_item(fl_state *st, fl_plan *p, PyObject *o, int depth, Py_ssize_t held)
{
#ifdef Py_GIL_DISABLED
    held = 0; /* reference counts there are not exact while other threads run */
#endif
    if (is_text(o) && Py_REFCNT(o) <= held) {
        int rc = put_text(p, o);
        return rc > 0 ? plan_pickle(st, p, o, depth) : rc;
    }
    return plan_obj(st, p, o, depth);
}

/* Lists, dicts, tuples, tensors, arrays and pickled objects keep their identity
 * within a batch: the second occurrence of one object is a reference to the first
 * (pickle's memo does the same in torch's transport). Memo indices are given in
 * completion order on both sides; a container met again before it is complete (a
 * recursive structure) makes the batch travel pickled (see plan_open). */
static int
plan_memo(fl_state *st, fl_plan *p, PyObject *o, int depth)
{
    if (p->memo == NULL &&
        ((p->memo = PyDict_New()) == NULL || (p->keep = PyList_New(0)) == NULL))
        return -1;
    PyObject *key = PyLong_FromVoidPtr(o);
    if (key == NULL)
        return -1;
    int rc = -1;
    PyObject *hit = PyDict_GetItemWithError(p->memo, key);
    if (hit != NULL) {
        rc = (put_u8(p, T_REF) < 0 || put_u64(p, PyLong_AsUnsignedLongLong(hit)) < 0) ? -1 : 0;
        goto done;
    }
    if (PyErr_Occurred() || put_u8(p, T_MEMO) < 0 || plan_open(st, p, o, depth) < 0)
        goto done;
    /* `keep` holds the object so that its address is not reused within the batch */
    PyObject *v = PyLong_FromUnsignedLongLong(p->nmemo);
    if (v == NULL || PyDict_SetItem(p->memo, key, v) < 0 || PyList_Append(p->keep, o) < 0) {
        Py_XDECREF(v);
        goto done;
    }
    Py_DECREF(v);
    p->nmemo++;
    rc = 0;
done:
    Py_DECREF(key);
    return rc;
}

/* plan_compound, keeping the stack of open containers. The memo gives an object
 * its index only once it is complete, so a container met again inside itself would
 * be encoded again at every level: that is flagged here, and fl_plan_build pickles
 * the batch whole instead, as torch's transport does (pickle's memo keeps the
 * recursion exact). Only lists, tuples and dicts are entered by the codec itself;
 * a recursion through an object that is pickled (a custom class, a dict key, an
 * OrderedDict, a container cut at FL_PICKLE_DEPTH) is caught by the pickler, which
 * gets the ids of the open containers (plan_pickle). */
static int
plan_open(fl_state *st, fl_plan *p, PyObject *o, int depth)
{
    if (!(PyList_CheckExact(o) || PyDict_CheckExact(o) || PyTuple_Check(o)))
        return plan_compound(st, p, o, depth);
    for (int i = 0; i < p->nopen; i++)
        if (p->open[i] == o) {
            p->recursive = 1;
            PyErr_SetString(PyExc_RecursionError, "fastloader: the batch contains itself");
            return -1;
        }
    if (p->nopen == (int)(sizeof(p->open) / sizeof(p->open[0]))) {
        /* unreachable: plan_obj's depth bound comes first */
        PyErr_SetString(PyExc_RecursionError, "fastloader: batch nested too deeply");
        return -1;
    }
    p->open[p->nopen++] = o;
    int rc = plan_compound(st, p, o, depth);
    p->nopen--;
    return rc;
}

static int
plan_compound(fl_state *st, fl_plan *p, PyObject *o, int depth)
{
    PyTypeObject *tp = Py_TYPE(o);
    if (depth >= FL_PICKLE_DEPTH && (PyTuple_Check(o) || PyList_Check(o) || PyDict_Check(o)))
        return plan_pickle(st, p, o, depth);
    if (tp == &PyList_Type || tp == &PyTuple_Type) {
        int rc;
        if (put_u8(p, tp == &PyList_Type ? T_LIST : T_TUPLE) < 0)
            return -1;
        if (Py_EnterRecursiveCall(" while encoding a batch"))
            return -1;
        if (tp == &PyList_Type) {
            /* a list can change under us only through user code we call (a
             * __reduce__ that clears it): plan a copy, which also keeps every item,
             * and so every open container below, alive (PySequence_Fast would
             * return the list itself) */
            PyObject *snap = PyList_GetSlice(o, 0, PY_SSIZE_T_MAX);
            rc = snap ? plan_seq(st, p, snap, depth, 2) : -1;   /* the list's, the copy's */
            Py_XDECREF(snap);
        }
        else {
            rc = plan_seq(st, p, o, depth, 1);
        }
        Py_LeaveRecursiveCall();
        return rc;
    }
    if (tp == &PyDict_Type) {
        PyObject *items = PyDict_Items(o);
        int rc = -1;
        if (items == NULL)
            return -1;
        if (put_u8(p, T_DICT) < 0 || put_u64(p, (uint64_t)PyList_GET_SIZE(items)) < 0)
            goto dict_done;
        if (Py_EnterRecursiveCall(" while encoding a batch"))
            goto dict_done;
        rc = 0;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items) && rc == 0; i++) {
            PyObject *kv = PyList_GET_ITEM(items, i);
            /* the dict's references and the (key, value) pair's */
            rc = plan_item(st, p, PyTuple_GET_ITEM(kv, 0), depth + 1, 2);
            if (rc == 0)
                rc = plan_item(st, p, PyTuple_GET_ITEM(kv, 1), depth + 1, 2);
        }
        Py_LeaveRecursiveCall();
    dict_done:
        Py_DECREF(items);
        return rc;
    }
    if ((PyObject *)tp == st->tensor_type)
        return plan_tensor(st, p, o, depth);
    if ((PyObject *)tp == st->stack_type)
        return plan_stack(st, p, o);
    if (tp == &PyArray_Type && plain_array((PyArrayObject *)o)) {
        PyArrayObject *a = (PyArrayObject *)o;
        int f_only = !PyArray_IS_C_CONTIGUOUS(a) && PyArray_IS_F_CONTIGUOUS(a);
        return put_u8(p, f_only ? T_ARRAY_F : T_ARRAY) < 0 ? -1 : plan_ndarray(p, a);
    }
    if (PyArray_IsScalar(o, Generic)) {
        PyArray_Descr *d = PyArray_DescrFromScalar(o);
        if (d == NULL)
            return -1;
        int ok = allowed_typenum(d->type_num) && PyDataType_ELSIZE(d) <= 32 &&
                 PyArray_ISNBO(d->byteorder) && tp == d->typeobj;
        int rc = 0;
        if (ok) {
            char buf[32];
            PyArray_ScalarAsCtype(o, buf);
            rc = (put_u8(p, T_NPSCALAR) < 0 || put_i32(p, canonical_typenum(d->type_num)) < 0 ||
                  put_u64(p, (uint64_t)PyDataType_ELSIZE(d)) < 0 || put(p, buf, (size_t)PyDataType_ELSIZE(d)) < 0)
                     ? -1
                     : 0;
        }
        Py_DECREF(d);
        if (ok)
            return rc;
        return plan_pickle(st, p, o, depth);
    }
    if (PyTuple_Check(o)) {
        int has_fields = PyObject_HasAttrString((PyObject *)tp, "_fields");
        if (has_fields) {
            if (Py_EnterRecursiveCall(" while encoding a batch"))
                return -1;
            int rc = plan_namedtuple(st, p, o, depth);
            Py_LeaveRecursiveCall();
            if (rc <= 0)
                return rc;
        }
    }
    return plan_pickle(st, p, o, depth);
}

/* Decide what part of each storage travels, and give it a place in the data area */
static int
plan_finalise(fl_plan *p)
{
    if (p->nstor == 0)
        return 0;
    p->stab = PyMem_Calloc(p->nstor, sizeof(fl_stab_entry));
    if (p->stab == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < p->nstor; i++) {
        fl_storage *e = &p->stor[i];
        if (e->op < 0) {
            size_t lo = e->lo <= e->hi ? e->lo : 0, hi = e->lo <= e->hi ? e->hi : 0;
            size_t span = hi - lo, whi = e->nbytes;
            e->wlo = 0;
            if (e->nbytes - span > (span > FL_WHOLE_STORAGE_SLACK ? span : FL_WHOLE_STORAGE_SLACK)) {
                /* 64-aligned, so every element offset stays a whole number of items */
                e->wlo = lo & ~(size_t)(FL_DATA_ALIGN - 1);
                whi = hi;
            }
            fl_op *op = add_op(p, OP_RAW, whi - e->wlo);
            if (op == NULL)
                return -1;
            op->src = (const uint8_t *)e->ptr + e->wlo;
            op->obj = e->storage; /* the op owns it now */
            e->storage = NULL;
            e->op = (Py_ssize_t)(op - p->ops);
        }
        p->stab[i].off = p->ops[e->op].off;
        p->stab[i].nbytes = p->ops[e->op].nbytes;
        p->stab[i].wlo = e->wlo;
    }
    return 0;
}

int
fl_plan_build(fl_state *st, fl_plan *p, PyObject *batch)
{
    if (plan_obj(st, p, batch, 0) < 0) {
        if (!p->recursive || !PyErr_ExceptionMatches(PyExc_RecursionError))
            return -1;
        /* a recursive batch: start again and pickle it whole (its tensors and
         * arrays still travel out of band) */
        PyErr_Clear();
        plan_clear(p);
        if (plan_pickle(st, p, batch, 0) < 0)
            return -1;
    }
    /* the memo's objects are no longer needed: the ops hold what the write reads */
    Py_CLEAR(p->memo);
    Py_CLEAR(p->keep);
    fl_identity_clear(&p->texts);
    return plan_finalise(p);
}

static PyObject *
dest_array(PyArray_Descr *descr, int ndim, npy_intp *dims, uint8_t *ptr)
{
    Py_INCREF(descr); /* NewFromDescr steals it */
    return PyArray_NewFromDescr(&PyArray_Type, descr, ndim, dims, NULL, ptr,
                                NPY_ARRAY_CARRAY, NULL);
}

int
fl_plan_write(fl_state *st, fl_plan *p, uint8_t *dst, size_t cap)
{
    size_t stab_len = p->nstor * sizeof(fl_stab_entry);
    size_t data_off = FL_ALIGN_UP(FL_STREAM_OFF + stab_len + p->slen, FL_DATA_ALIGN);
    size_t total = data_off + p->data_size;
    if (total > cap) {
        PyErr_SetString(PyExc_SystemError, "fastloader: plan larger than its slot");
        return -1;
    }
    fl_batch_hdr h = {FL_BATCH_MAGIC, FL_BATCH_VERSION, p->slen, data_off, total, stab_len};
    memset(dst, 0, FL_STREAM_OFF);
    memcpy(dst, &h, sizeof(h));
    if (stab_len)
        memcpy(dst + FL_STREAM_OFF, p->stab, stab_len);
    if (p->slen)
        memcpy(dst + FL_STREAM_OFF + stab_len, p->stream, p->slen);
    uint8_t *data = dst + data_off;
    for (size_t i = 0; i < p->nops; i++) {
        fl_op *op = &p->ops[i];
        uint8_t *at = data + op->off;
        if (op->kind == OP_RAW) {
            if (op->nbytes)
                memcpy(at, op->src, op->nbytes);
            continue;
        }
        if (op->kind == OP_MEMCPY) {
            const void *src = PyBytes_Check(op->obj)
                                  ? (const void *)PyBytes_AS_STRING(op->obj)
                                  : PyArray_DATA((PyArrayObject *)op->obj);
            if (op->nbytes)
                memcpy(at, src, op->nbytes);
            continue;
        }
        PyObject *dest = dest_array(op->descr, op->ndim, op->dims, at);
        if (dest == NULL)
            return -1;
        int rc;
        if (op->kind == OP_COPYINTO) {
            rc = PyArray_CopyInto((PyArrayObject *)dest, (PyArrayObject *)op->obj);
        }
        else {
            PyObject *r = PyObject_CallFunctionObjArgs(st->hook_fill, op->obj, dest, NULL);
            rc = r == NULL ? -1 : 0;
            Py_XDECREF(r);
        }
        Py_DECREF(dest);
        if (rc < 0)
            return -1;
    }
    return 0;
}

/* ---- decoding: every read is bounds-checked, so bad bytes raise, never crash ---- */

typedef struct {
    fl_state *st;
    const uint8_t *base;
    const uint8_t *s, *end;   /* node stream cursor */
    const uint8_t *data;
    size_t data_len;
    PyObject *owner;
    fl_stab_entry *stab;     /* a private copy: read once from shared memory */
    size_t nstor;
    PyObject **stor_obj;     /* per storage: the first tensor decoded on it */
    PyObject **memo;
    size_t nmemo, memocap;
    size_t copy_left;        /* bytes this batch may still copy out by share (copied_out) */
} dec;

/* A small tensor or array of a big batch is copied out of the slot into memory of
 * its own, so that keeping it (an eval loop's `labels.append(batch["label"])`)
 * does not keep the whole slot (the epoch's images) as a view would: it then holds
 * what torch's transport would hold.
 * - A batch under FL_COPY_OUT_FLOOR copies nothing: its slot is a few pages, about
 *   what torch's transport holds per kept tensor (a page and a file descriptor).
 * - A storage of at most 1/FL_COPY_OUT_TINY of the batch and FL_COPY_OUT_TINY_MAX
 *   bytes is always copied, wherever it lies in the batch: its copy costs about
 *   what making its Python object does.
 * - A bigger one of at most 1/FL_COPY_OUT_SHARE of the batch is copied while all
 *   the copies stay within that share of its bytes (in the order they are met).
 * So a kept tensor keeps at most ~FL_COPY_OUT_SHARE times its bytes (or a small
 * batch's few pages), unless other pieces of its batch took that share first. A
 * storage of no bytes stays a view (a tensor's gets a storage of its own anyway). */
#define FL_COPY_OUT_FLOOR 16384
#define FL_COPY_OUT_TINY 256
#define FL_COPY_OUT_TINY_MAX 65536
#define FL_COPY_OUT_SHARE 16

static PyObject *
corrupt(const char *what)
{
    return PyErr_Format(PyExc_ValueError, "fastloader: corrupt batch encoding (%s)", what);
}

static int
take(dec *d, void *out, size_t n)
{
    if ((size_t)(d->end - d->s) < n) {
        corrupt("truncated node stream");
        return -1;
    }
    memcpy(out, d->s, n);
    d->s += n;
    return 0;
}

static PyObject *dec_obj(dec *d, int depth);

static int
copied_out(dec *d, size_t nbytes)
{
    if (nbytes == 0 || d->data_len < FL_COPY_OUT_FLOOR)
        return 0;
    if (nbytes <= d->data_len / FL_COPY_OUT_TINY && nbytes <= FL_COPY_OUT_TINY_MAX) {
        d->copy_left -= nbytes < d->copy_left ? nbytes : d->copy_left;
        return 1;
    }
    if (nbytes > d->copy_left)
        return 0;
    d->copy_left -= nbytes;
    return 1;
}

/* an ndarray over `nbytes` bytes of the data area, whose base is the batch owner,
 * or a copy of them (copied_out); the caller has checked the extent */
static PyObject *
view_of_data(dec *d, PyArray_Descr *descr, int ndim, npy_intp *dims, uint64_t off,
             size_t nbytes, int fortran)
{
    /* The encoder places every block at FL_DATA_ALIGN; a misaligned one is not
     * ours, and torch's kernels assume aligned elements. */
    if (((uintptr_t)(d->data + off)) % (size_t)PyDataType_ALIGNMENT(descr) != 0) {
        Py_DECREF(descr);
        return corrupt("data alignment");
    }
    if (copied_out(d, nbytes)) {
        PyObject *own = PyArray_NewFromDescr(&PyArray_Type, descr, ndim, dims, NULL, NULL,
                                             fortran ? NPY_ARRAY_F_CONTIGUOUS : 0, NULL);
        if (own != NULL && nbytes > 0)
            memcpy(PyArray_DATA((PyArrayObject *)own), d->data + off, nbytes);
        return own;
    }
    PyObject *arr = PyArray_NewFromDescr(&PyArray_Type, descr, ndim, dims, NULL,
                                         (void *)(d->data + off),
                                         fortran ? NPY_ARRAY_FARRAY : NPY_ARRAY_CARRAY, NULL);
    if (arr == NULL)
        return NULL;
    Py_INCREF(d->owner);
    if (PyArray_SetBaseObject((PyArrayObject *)arr, d->owner) < 0) {
        Py_DECREF(arr);
        return NULL;
    }
    return arr;
}

static PyObject *
dec_array(dec *d, int *typenum_out, int fortran)
{
    int32_t typenum;
    uint64_t ndim, off, nbytes;
    npy_intp dims[NPY_MAXDIMS];
    if (take(d, &typenum, 4) < 0 || take(d, &ndim, 8) < 0)
        return NULL;
    if (!allowed_typenum(typenum) || ndim > NPY_MAXDIMS)
        return corrupt("array header");
    PyArray_Descr *descr = PyArray_DescrFromType(typenum);
    if (descr == NULL)
        return NULL;
    size_t expect = (size_t)PyDataType_ELSIZE(descr);
    for (uint64_t i = 0; i < ndim; i++) {
        int64_t v;
        if (take(d, &v, 8) < 0 || v < 0 || __builtin_mul_overflow(expect, (size_t)v, &expect)) {
            Py_DECREF(descr);
            return PyErr_Occurred() ? NULL : corrupt("array shape");
        }
        dims[i] = (npy_intp)v;
    }
    if (take(d, &off, 8) < 0 || take(d, &nbytes, 8) < 0 || nbytes != expect ||
        off > d->data_len || nbytes > d->data_len - off) {
        Py_DECREF(descr);
        return PyErr_Occurred() ? NULL : corrupt("array extent");
    }
    PyObject *arr = view_of_data(d, descr, (int)ndim, dims, off, nbytes, fortran);
    if (arr == NULL)
        return NULL;
    *typenum_out = typenum;
    return arr;
}

/* the tensor hook for a view: (source, code, requires_grad, offset, sizes, strides),
 * where source is a tensor whose storage to share, or the bytes of a new one */
static PyObject *
call_view_hook(dec *d, PyObject *src, int32_t code, int32_t rg, int64_t offset,
               uint64_t ndim, const int64_t *sizes, const int64_t *strides)
{
    PyObject *sz = PyTuple_New((Py_ssize_t)ndim), *sd = PyTuple_New((Py_ssize_t)ndim);
    PyObject *c = PyLong_FromLong(code), *o = PyLong_FromLongLong(offset), *r = NULL;
    if (sz == NULL || sd == NULL || c == NULL || o == NULL)
        goto done;
    for (uint64_t i = 0; i < ndim; i++) {
        PyObject *a = PyLong_FromLongLong(sizes[i]), *b = PyLong_FromLongLong(strides[i]);
        if (a == NULL || b == NULL) {
            Py_XDECREF(a);
            Py_XDECREF(b);
            goto done;
        }
        PyTuple_SET_ITEM(sz, (Py_ssize_t)i, a);
        PyTuple_SET_ITEM(sd, (Py_ssize_t)i, b);
    }
    r = PyObject_CallFunctionObjArgs(d->st->hook_to_tensor, src, c, rg ? Py_True : Py_False,
                                     o, sz, sd, NULL);
done:
    Py_XDECREF(sz);
    Py_XDECREF(sd);
    Py_XDECREF(c);
    Py_XDECREF(o);
    return r;
}

/* A tensor header's dtype code is one this torch has, its bytes are of that code's
 * NumPy type (whose alignment view_of_data checks: torch's kernels assume the
 * dtype's), and it asks a gradient only where the dtype can have one. */
static int
known_code(dec *d, int32_t code, int32_t typenum, int32_t rg)
{
    return code >= 0 && code < d->st->ncodes && typenum == d->st->code_typenum[code] &&
           (!rg || d->st->grad_code[code]);
}

/* a tensor that is its whole storage (the common case: one from_numpy call) */
static PyObject *
dec_tensor(dec *d)
{
    int32_t code, rg, typenum;
    uint64_t ndim, sidx;
    int64_t sizes[NPY_MAXDIMS], strides[NPY_MAXDIMS];
    npy_intp dims[NPY_MAXDIMS];
    if (take(d, &code, 4) < 0 || take(d, &rg, 4) < 0 || take(d, &typenum, 4) < 0 ||
        take(d, &ndim, 8) < 0)
        return NULL;
    if (!allowed_typenum(typenum) || ndim > NPY_MAXDIMS || !known_code(d, code, typenum, rg))
        return corrupt("tensor header");
    PyArray_Descr *descr = PyArray_DescrFromType(typenum);
    if (descr == NULL)
        return NULL;
    size_t nbytes = (size_t)PyDataType_ELSIZE(descr);
    for (uint64_t i = 0; i < ndim; i++) {
        if (take(d, &sizes[i], 8) < 0 || sizes[i] < 0 ||
            __builtin_mul_overflow(nbytes, (size_t)sizes[i], &nbytes)) {
            Py_DECREF(descr);
            return PyErr_Occurred() ? NULL : corrupt("tensor shape");
        }
        dims[i] = (npy_intp)sizes[i];
    }
    if (take(d, &sidx, 8) < 0 || sidx >= d->nstor || d->stab[sidx].wlo != 0 ||
        d->stab[sidx].nbytes != nbytes) {
        Py_DECREF(descr);
        return PyErr_Occurred() ? NULL : corrupt("tensor storage");
    }
    PyObject *src = d->stor_obj[sidx];
    if (src != NULL) { /* a second tensor on the same storage (x and x.view(-1)) */
        Py_DECREF(descr);
        int64_t step = 1;
        for (uint64_t i = ndim; i-- > 0;) {
            strides[i] = step;
            /* sizes past a 0 are not bounded by the byte count (0) */
            if (__builtin_mul_overflow(step, sizes[i] ? sizes[i] : 1, &step))
                return corrupt("tensor shape");
        }
        return call_view_hook(d, src, code, rg, 0, ndim, sizes, strides);
    }
    PyObject *arr = view_of_data(d, descr, (int)ndim, dims, d->stab[sidx].off, nbytes, 0);
    if (arr == NULL)
        return NULL;
    PyObject *t;
    if (!rg && d->st->plain_code[code] && d->st->from_numpy && nbytes > 0) {
        /* the common case, without a Python-level call per tensor (the hook gives a
         * tensor of no bytes a resizable storage of its own, as torch's transport does) */
        t = PyObject_CallOneArg(d->st->from_numpy, arr);
    }
    else {
        PyObject *c = PyLong_FromLong(code);
        t = c ? PyObject_CallFunctionObjArgs(d->st->hook_to_tensor, arr, c,
                                             rg ? Py_True : Py_False, NULL)
              : NULL;
        Py_XDECREF(c);
    }
    Py_DECREF(arr);
    if (t != NULL)
        d->stor_obj[sidx] = Py_NewRef(t);
    return t;
}

/* a tensor at an offset and strides into a storage, maybe shared with others */
static PyObject *
dec_tensor_view(dec *d)
{
    int32_t code, rg, typenum;
    uint64_t ndim, sidx;
    int64_t offset, sizes[NPY_MAXDIMS], strides[NPY_MAXDIMS];
    if (take(d, &code, 4) < 0 || take(d, &rg, 4) < 0 || take(d, &typenum, 4) < 0 ||
        take(d, &sidx, 8) < 0 || take(d, &offset, 8) < 0 || take(d, &ndim, 8) < 0)
        return NULL;
    if (!allowed_typenum(typenum) || ndim > NPY_MAXDIMS || !known_code(d, code, typenum, rg) ||
        sidx >= d->nstor || offset < 0)
        return corrupt("tensor view header");
    PyArray_Descr *descr = PyArray_DescrFromType(typenum);
    if (descr == NULL)
        return NULL;
    size_t k = (size_t)PyDataType_ELSIZE(descr);
    size_t align = (size_t)PyDataType_ALIGNMENT(descr);
    Py_DECREF(descr);
    const fl_stab_entry *e = &d->stab[sidx];
    /* element offset within the copied window, and every element inside it */
    size_t boff, numel = 1, maxel;
    if (e->wlo % k != 0 || __builtin_mul_overflow((uint64_t)offset, k, &boff) || boff < e->wlo)
        return corrupt("tensor view offset");
    maxel = (boff - e->wlo) / k;
    int64_t woffset = (int64_t)maxel;
    for (uint64_t i = 0; i < ndim; i++) {
        size_t step;
        if (take(d, &sizes[i], 8) < 0 || take(d, &strides[i], 8) < 0)
            return NULL;
        if (sizes[i] < 0 || strides[i] < 0 ||
            __builtin_mul_overflow(numel, (size_t)sizes[i], &numel))
            return corrupt("tensor view shape");
        if (sizes[i] > 0 &&
            (__builtin_mul_overflow((size_t)(sizes[i] - 1), (size_t)strides[i], &step) ||
             __builtin_add_overflow(maxel, step, &maxel)))
            return corrupt("tensor view shape");
    }
    size_t end;
    if (numel > 0 && (__builtin_add_overflow(maxel, (size_t)1, &end) ||
                      __builtin_mul_overflow(end, k, &end) || end > e->nbytes))
        return corrupt("tensor view extent");
    if (((uintptr_t)(d->data + e->off)) % align != 0)
        return corrupt("tensor view alignment");
    PyObject *src = d->stor_obj[sidx], *fresh = NULL;
    if (src == NULL) {
        npy_intp n = (npy_intp)e->nbytes;
        fresh = view_of_data(d, PyArray_DescrFromType(NPY_UINT8), 1, &n, e->off,
                             (size_t)e->nbytes, 0);
        if (fresh == NULL)
            return NULL;
        src = fresh;
    }
    PyObject *t = call_view_hook(d, src, code, rg, woffset, ndim, sizes, strides);
    if (t != NULL && fresh != NULL)
        d->stor_obj[sidx] = Py_NewRef(t);
    Py_XDECREF(fresh);
    return t;
}

/* The main process's namedtuple classes, by the bytes a worker pickled them to:
 * key -> (class, its module's name, its qualified name split at the dots). Pickle
 * looks a class up by name at each load, and so does a hit here (sys.modules,
 * then the attributes the qualified name names: dict lookups, not an
 * unpickling): a class redefined since (a notebook cell run again, a module
 * reloaded or imported anew) is looked up anew, as torch's unpickling finds it.
 * The name is split once, when the class is cached: a hit costs one getattr per
 * part. A class whose names are not plain strings is looked up anew each time. */
static PyObject *
class_now(PyObject *modname, PyObject *parts)
{
    PyObject *obj = PyImport_GetModule(modname);
    for (Py_ssize_t i = 0; obj != NULL && i < PyTuple_GET_SIZE(parts); i++)
        Py_SETREF(obj, PyObject_GetAttr(obj, PyTuple_GET_ITEM(parts, i)));
    return obj;
}

/* A lookup failed with an ordinary error (the name is gone): cleared, so that the
 * class is unpickled anew, which raises what pickle would. Ctrl-C and other
 * BaseExceptions stay raised. */
static void
clear_lookup_error(void)
{
    if (PyErr_ExceptionMatches(PyExc_Exception))
        PyErr_Clear();
}

static PyObject *
cached_class(PyObject *cache, PyObject *key)
{
    PyObject *entry = PyDict_GetItemWithError(cache, key);
    if (entry == NULL)
        return NULL;
    Py_INCREF(entry);   /* the lookup below may run code that replaces it */
    PyObject *cls = PyTuple_GET_ITEM(entry, 0), *modname = PyTuple_GET_ITEM(entry, 1);
    PyObject *now = modname == Py_None ? NULL : class_now(modname, PyTuple_GET_ITEM(entry, 2));
    if (now == NULL)
        clear_lookup_error();
    else if (now != cls)
        Py_CLEAR(now);
    Py_DECREF(entry);
    return now;
}

static int
cache_class(PyObject *cache, PyObject *key, PyObject *cls)
{
    PyObject *modname = PyObject_GetAttrString(cls, "__module__");
    PyObject *qualname = modname ? PyObject_GetAttrString(cls, "__qualname__") : NULL;
    if (PyErr_Occurred()) {   /* without them: looked up anew each time */
        clear_lookup_error();
        if (PyErr_Occurred()) {
            Py_XDECREF(modname);
            return -1;
        }
    }
    int plain = modname && qualname && PyUnicode_CheckExact(modname) &&
                PyUnicode_CheckExact(qualname);
    PyObject *parts = NULL, *entry = NULL;
    if (plain) {
        PyObject *dot = PyUnicode_FromString(".");
        PyObject *list = dot ? PyUnicode_Split(qualname, dot, -1) : NULL;
        parts = list ? PyList_AsTuple(list) : NULL;
        Py_XDECREF(list);
        Py_XDECREF(dot);
        if (parts != NULL)
            entry = PyTuple_Pack(3, cls, modname, parts);
    } else {
        entry = PyTuple_Pack(3, cls, Py_None, Py_None);
    }
    int rc = entry == NULL ? -1 : PyDict_SetItem(cache, key, entry);
    Py_XDECREF(entry);
    Py_XDECREF(parts);
    Py_XDECREF(modname);
    Py_XDECREF(qualname);
    return rc;
}

static PyObject *
dec_items(dec *d, Py_ssize_t n, int depth, int as_list)
{
    if ((size_t)n > (size_t)(d->end - d->s)) /* every node takes >= 1 byte */
        return corrupt("container length");
    PyObject *c = as_list ? PyList_New(n) : PyTuple_New(n);
    if (c == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = dec_obj(d, depth + 1);
        if (v == NULL) {
            Py_DECREF(c);
            return NULL;
        }
        if (as_list)
            PyList_SET_ITEM(c, i, v);
        else
            PyTuple_SET_ITEM(c, i, v);
    }
    return c;
}

static PyObject *dec_tagged(dec *d, uint8_t tag, int depth);

static PyObject *
dec_obj(dec *d, int depth)
{
    uint8_t tag;
    if (depth > FL_MAX_DEPTH)
        return corrupt("nesting");
    if (take(d, &tag, 1) < 0)
        return NULL;
    return dec_tagged(d, tag, depth);
}

/* `tag` was already taken (read once) from the stream */
static PyObject *
dec_tagged(dec *d, uint8_t tag, int depth)
{
    switch (tag) {
    case T_NONE: Py_RETURN_NONE;
    case T_FALSE: Py_RETURN_FALSE;
    case T_TRUE: Py_RETURN_TRUE;
    case T_INT: {
        int64_t v;
        return take(d, &v, 8) < 0 ? NULL : PyLong_FromLongLong(v);
    }
    case T_FLOAT: {
        double v;
        return take(d, &v, 8) < 0 ? NULL : PyFloat_FromDouble(v);
    }
    case T_STR:
    case T_BYTES: {
        uint64_t n;
        if (take(d, &n, 8) < 0)
            return NULL;
        if (n > (uint64_t)(d->end - d->s))
            return corrupt("string length");
        const char *s = (const char *)d->s;
        d->s += n;
        return tag == T_STR ? fl_utf8_from_shared(s, (Py_ssize_t)n, "strict")
                            : PyBytes_FromStringAndSize(s, (Py_ssize_t)n);
    }
    case T_LIST:
    case T_TUPLE: {
        uint64_t n;
        if (take(d, &n, 8) < 0)
            return NULL;
        return dec_items(d, (Py_ssize_t)(n > PY_SSIZE_T_MAX ? PY_SSIZE_T_MAX : n), depth,
                         tag == T_LIST);
    }
    case T_DICT: {
        uint64_t n;
        if (take(d, &n, 8) < 0)
            return NULL;
        if (n > (uint64_t)(d->end - d->s))
            return corrupt("dict length");
        PyObject *dct = PyDict_New();
        if (dct == NULL)
            return NULL;
        for (uint64_t i = 0; i < n; i++) {
            PyObject *k = dec_obj(d, depth + 1);
            PyObject *v = k ? dec_obj(d, depth + 1) : NULL;
            if (v == NULL || PyDict_SetItem(dct, k, v) < 0) {
                Py_XDECREF(k);
                Py_XDECREF(v);
                Py_DECREF(dct);
                return NULL;
            }
            Py_DECREF(k);
            Py_DECREF(v);
        }
        return dct;
    }
    case T_NAMEDTUPLE: {
        uint64_t clen, n;
        if (take(d, &clen, 8) < 0)
            return NULL;
        if (clen > (uint64_t)(d->end - d->s))
            return corrupt("namedtuple class");
        PyObject *key = PyBytes_FromStringAndSize((const char *)d->s, (Py_ssize_t)clen);
        d->s += clen;
        if (key == NULL)
            return NULL;
        PyObject *cls = cached_class(d->st->class_cache, key);
        if (cls == NULL && !PyErr_Occurred()) {
            PyObject *noob = PyList_New(0);
            cls = noob ? PyObject_CallFunctionObjArgs(d->st->hook_loads, key, noob, NULL)
                       : NULL;
            Py_XDECREF(noob);
            if (cls != NULL && (!PyType_Check(cls) ||
                                !PyType_IsSubtype((PyTypeObject *)cls, &PyTuple_Type))) {
                Py_CLEAR(cls);
                corrupt("namedtuple class");
            }
            if (cls != NULL && cache_class(d->st->class_cache, key, cls) < 0)
                Py_CLEAR(cls);
        }
        Py_DECREF(key);
        if (cls == NULL)
            return NULL;
        PyObject *items = take(d, &n, 8) < 0
                              ? NULL
                              : dec_items(d, (Py_ssize_t)(n > PY_SSIZE_T_MAX ? PY_SSIZE_T_MAX : n),
                                          depth, 0);
        if (items == NULL) {
            Py_DECREF(cls);
            return NULL;
        }
        /* pickle's rebuild: cls.__new__(cls, *fields), and no __init__ (a class's
           tp_new calls its __new__) */
        PyTypeObject *tp = (PyTypeObject *)cls;
        PyObject *r = tp->tp_new ? tp->tp_new(tp, items, NULL)
                                 : PyErr_Format(PyExc_TypeError, "cannot create '%.100s' instances",
                                                tp->tp_name);
        Py_DECREF(items);
        Py_DECREF(cls);
        return r;
    }
    case T_ARRAY:
    case T_ARRAY_F: {
        int typenum;
        return dec_array(d, &typenum, tag == T_ARRAY_F);
    }
    case T_TENSOR:
        return dec_tensor(d);
    case T_TENSOR_VIEW:
        return dec_tensor_view(d);
    case T_MEMO: {
        /* a memo marks one real node: a chain of marks would recurse without depth.
           The marked node's tag is taken once into private memory and dispatched
           from there, so a concurrent writer cannot turn it into another mark
           between the check and the decode. */
        uint8_t inner;
        if (take(d, &inner, 1) < 0)
            return NULL;
        if (inner == T_MEMO || inner == T_REF)
            return corrupt("object memo");
        PyObject *v = dec_tagged(d, inner, depth);
        if (v == NULL)
            return NULL;
        if (d->nmemo == d->memocap) {
            size_t cap = d->memocap ? d->memocap * 2 : 16;
            PyObject **m = PyMem_Realloc(d->memo, cap * sizeof(PyObject *));
            if (m == NULL) {
                Py_DECREF(v);
                return PyErr_NoMemory();
            }
            d->memo = m;
            d->memocap = cap;
        }
        d->memo[d->nmemo++] = Py_NewRef(v);
        return v;
    }
    case T_REF: {
        uint64_t i;
        if (take(d, &i, 8) < 0)
            return NULL;
        if (i >= d->nmemo)
            return corrupt("object reference");
        return Py_NewRef(d->memo[i]);
    }
    case T_NPSCALAR: {
        int32_t typenum;
        uint64_t n;
        if (take(d, &typenum, 4) < 0 || take(d, &n, 8) < 0)
            return NULL;
        if (!allowed_typenum(typenum) || n > 32 || n > (uint64_t)(d->end - d->s))
            return corrupt("numpy scalar");
        PyArray_Descr *descr = PyArray_DescrFromType(typenum);
        if (descr == NULL)
            return NULL;
        if ((uint64_t)PyDataType_ELSIZE(descr) != n) {
            Py_DECREF(descr);
            return corrupt("numpy scalar size");
        }
        char buf[32];
        memcpy(buf, d->s, n);
        d->s += n;
        PyObject *r = PyArray_Scalar(buf, descr, NULL);
        Py_DECREF(descr);
        return r;
    }
    case T_PICKLE: {
        uint64_t off, n;
        if (take(d, &off, 8) < 0 || take(d, &n, 8) < 0)
            return NULL;
        if (off > d->data_len || n > d->data_len - off)
            return corrupt("pickle extent");
        PyObject *oob = dec_obj(d, depth + 1);
        if (oob == NULL)
            return NULL;
        if (!PyList_Check(oob)) {
            Py_DECREF(oob);
            return corrupt("pickle buffers");
        }
        PyObject *mv = PyMemoryView_FromMemory((char *)(d->data + off), (Py_ssize_t)n,
                                               PyBUF_READ);
        PyObject *r = mv ? PyObject_CallFunctionObjArgs(d->st->hook_loads, mv, oob, NULL)
                         : NULL;
        if (mv != NULL) {
            /* The view must not outlive this call: the slot may be reused later. If
             * unpickling failed, its error is the element's own: keep it as it is
             * (calling release with it still set would replace it by a SystemError). */
            PyObject *exc_type, *exc_value, *exc_tb;
            PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
            PyObject *rel = PyObject_CallMethod(mv, "release", NULL);
            if (rel == NULL) {
                Py_CLEAR(r);
                if (exc_type != NULL) /* the element's error wins over release's */
                    PyErr_Clear();
            }
            if (exc_type != NULL)
                PyErr_Restore(exc_type, exc_value, exc_tb);
            Py_XDECREF(rel);
            Py_DECREF(mv);
        }
        Py_DECREF(oob);
        return r;
    }
    default:
        return corrupt("unknown node tag");
    }
}

PyObject *
fl_decode(fl_state *st, const uint8_t *base, size_t cap, PyObject *owner)
{
    fl_batch_hdr h;
    PyObject *r = NULL;
    if (cap < FL_STREAM_OFF)
        return corrupt("short buffer");
    memcpy(&h, base, sizeof(h));
    if (h.magic != FL_BATCH_MAGIC || h.version != FL_BATCH_VERSION)
        return corrupt("bad magic");
    if (h.total > cap || h.data_off > h.total || h.data_off < FL_STREAM_OFF ||
        h.stab_len > h.data_off - FL_STREAM_OFF ||
        h.stream_len > h.data_off - FL_STREAM_OFF - h.stab_len ||
        h.stab_len % sizeof(fl_stab_entry) != 0)
        return corrupt("header extents");
    const uint8_t *stream = base + FL_STREAM_OFF + h.stab_len;
    dec d = {st, base, stream, stream + h.stream_len, base + h.data_off,
             (size_t)(h.total - h.data_off), owner, NULL, 0, NULL, NULL, 0, 0, 0};
    d.copy_left = d.data_len / FL_COPY_OUT_SHARE;
    d.nstor = (size_t)(h.stab_len / sizeof(fl_stab_entry));
    if (d.nstor) {
        d.stab = PyMem_Malloc(h.stab_len);
        d.stor_obj = PyMem_Calloc(d.nstor, sizeof(PyObject *));
        if (d.stab == NULL || d.stor_obj == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        memcpy(d.stab, base + FL_STREAM_OFF, h.stab_len);
        for (size_t i = 0; i < d.nstor; i++)
            if (d.stab[i].off > d.data_len || d.stab[i].nbytes > d.data_len - d.stab[i].off ||
                d.stab[i].nbytes > (uint64_t)NPY_MAX_INTP) {
                corrupt("storage table");
                goto done;
            }
    }
    r = dec_obj(&d, 0);
    if (r != NULL && d.s != d.end) {
        Py_CLEAR(r);
        corrupt("trailing bytes");
    }
done:
    for (size_t i = 0; i < d.nmemo; i++)
        Py_DECREF(d.memo[i]);
    for (size_t i = 0; d.stor_obj != NULL && i < d.nstor; i++)
        Py_XDECREF(d.stor_obj[i]);
    PyMem_Free(d.memo);
    PyMem_Free(d.stor_obj);
    PyMem_Free(d.stab);
    return r;
}
