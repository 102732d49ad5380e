#define NO_IMPORT_ARRAY
#define PY_ARRAY_UNIQUE_SYMBOL fastloader_ARRAY_API
#include "codec.h"
#include <numpy/arrayobject.h>
#include <numpy/arrayscalars.h>
#include <string.h>

enum {
    T_NONE = 1, T_FALSE, T_TRUE, T_INT, T_FLOAT, T_STR, T_BYTES,
    T_LIST, T_TUPLE, T_DICT, T_NAMEDTUPLE, T_ARRAY, T_TENSOR, T_NPSCALAR, T_PICKLE,
};

#define FL_DATA_ALIGN 64
#define FL_MAX_DEPTH 200

typedef struct {
    uint32_t magic;
    uint32_t version;
    uint64_t stream_len;
    uint64_t data_off;   /* from the start of the batch, multiple of 64 */
    uint64_t total;
} fl_batch_hdr;

#define FL_STREAM_OFF 64

enum { OP_MEMCPY = 1, OP_COPYINTO, OP_FILL };

typedef struct {
    int kind;
    PyObject *obj;            /* ndarray, bytes, or deferred stack (owned) */
    PyArray_Descr *descr;     /* OP_COPYINTO / OP_FILL (owned) */
    int ndim;
    npy_intp dims[NPY_MAXDIMS];
    size_t off;               /* relative to the data area */
    size_t nbytes;
} fl_op;

struct fl_plan {
    uint8_t *stream;
    size_t slen, scap;
    fl_op *ops;
    size_t nops, opcap;
    size_t data_size;
};

fl_plan *
fl_plan_new(void)
{
    fl_plan *p = PyMem_Calloc(1, sizeof(fl_plan));
    if (p == NULL)
        PyErr_NoMemory();
    return p;
}

void
fl_plan_free(fl_plan *p)
{
    if (p == NULL)
        return;
    for (size_t i = 0; i < p->nops; i++) {
        Py_XDECREF(p->ops[i].obj);
        Py_XDECREF(p->ops[i].descr);
    }
    PyMem_Free(p->ops);
    PyMem_Free(p->stream);
    PyMem_Free(p);
}

size_t
fl_plan_size(const fl_plan *p)
{
    return FL_ALIGN_UP(FL_STREAM_OFF + p->slen, FL_DATA_ALIGN) + p->data_size;
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

static fl_op *
add_op(fl_plan *p, int kind, size_t nbytes)
{
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

static int
plain_array(PyArrayObject *a)
{
    PyArray_Descr *d = PyArray_DESCR(a);
    return allowed_typenum(d->type_num) && PyArray_ISNBO(d->byteorder) &&
           !PyDataType_HASFIELDS(d) && !PyDataType_HASSUBARRAY(d);
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
static int plan_pickle(fl_state *st, fl_plan *p, PyObject *o, int depth);

static int
plan_ndarray(fl_plan *p, PyArrayObject *a)
{
    fl_op *op;
    int contiguous = PyArray_IS_C_CONTIGUOUS(a);
    if (put_array_body(p, PyArray_TYPE(a), PyArray_NDIM(a), PyArray_DIMS(a),
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

static int
plan_tensor(fl_state *st, fl_plan *p, PyObject *t)
{
    /* hook_export: tensor -> (ndarray view of its data, dtype code, requires_grad) */
    PyObject *r = PyObject_CallOneArg(st->hook_export, t);
    int code, rg;
    PyObject *arr;
    if (r == NULL)
        return -1;
    if (r == Py_None) { /* not a plain CPU tensor: pickle it as torch would */
        Py_DECREF(r);
        return plan_pickle(st, p, t, 0);
    }
    if (!PyArg_ParseTuple(r, "Oip", &arr, &code, &rg) || !PyArray_CheckExact(arr) ||
        !plain_array((PyArrayObject *)arr)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "fastloader: tensor export hook misbehaved");
        Py_DECREF(r);
        return -1;
    }
    int rc = put_u8(p, T_TENSOR) < 0 || put_i32(p, code) < 0 || put_i32(p, rg) < 0 ||
             plan_ndarray(p, (PyArrayObject *)arr) < 0;
    Py_DECREF(r);
    return rc ? -1 : 0;
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
    fl_op *op;
    if (put_u8(p, T_TENSOR) < 0 || put_i32(p, code) < 0 || put_i32(p, 0) < 0 ||
        put_array_body(p, descr->type_num, (int)ndim, dims, nbytes, &op, OP_FILL) < 0)
        goto fail;
    Py_INCREF(s);
    op->obj = s;
    Py_INCREF(descr);
    op->descr = descr;
    Py_DECREF(r);
    return 0;
fail:
    Py_DECREF(r);
    return -1;
}

static int
plan_pickle(fl_state *st, fl_plan *p, PyObject *o, int depth)
{
    /* hook_dumps: obj -> (bytes, [tensors and arrays moved out of band]) */
    PyObject *r = PyObject_CallOneArg(st->hook_dumps, o);
    PyObject *data, *oob;
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
    rc = plan_obj(st, p, oob, depth + 1);
done:
    Py_DECREF(r);
    return rc;
}

static int
plan_seq(fl_state *st, fl_plan *p, PyObject *o, int depth)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
    if (put_u64(p, (uint64_t)n) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++)
        if (plan_obj(st, p, PySequence_Fast_GET_ITEM(o, i), depth + 1) < 0)
            return -1;
    return 0;
}

static int
plan_namedtuple(fl_state *st, fl_plan *p, PyObject *o, int depth)
{
    PyObject *cls = (PyObject *)Py_TYPE(o);
    PyObject *pickled = PyDict_GetItemWithError(st->class_cache, cls);
    if (pickled == NULL) {
        if (PyErr_Occurred())
            return -1;
        PyObject *r = PyObject_CallOneArg(st->hook_dumps, cls);
        if (r == NULL)
            return -1;
        pickled = PyTuple_Check(r) && PyTuple_GET_SIZE(r) == 2 ? PyTuple_GET_ITEM(r, 0)
                                                               : NULL;
        if (pickled == NULL || !PyBytes_Check(pickled) ||
            PyDict_SetItem(st->class_cache, cls, pickled) < 0) {
            Py_DECREF(r);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "fastloader: cannot pickle namedtuple class");
            return -1;
        }
        Py_DECREF(r); /* the cache keeps `pickled` alive */
    }
    if (put_u8(p, T_NAMEDTUPLE) < 0 || put_u64(p, (uint64_t)PyBytes_GET_SIZE(pickled)) < 0 ||
        put(p, PyBytes_AS_STRING(pickled), (size_t)PyBytes_GET_SIZE(pickled)) < 0)
        return -1;
    return plan_seq(st, p, o, depth);
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
    if (tp == &PyUnicode_Type) {
        Py_ssize_t n;
        const char *s = PyUnicode_AsUTF8AndSize(o, &n);
        if (s == NULL) { /* lone surrogates: pickle keeps them */
            PyErr_Clear();
            return plan_pickle(st, p, o, depth);
        }
        return (put_u8(p, T_STR) < 0 || put_u64(p, (uint64_t)n) < 0) ? -1 : put(p, s, (size_t)n);
    }
    if (tp == &PyBytes_Type) {
        Py_ssize_t n = PyBytes_GET_SIZE(o);
        return (put_u8(p, T_BYTES) < 0 || put_u64(p, (uint64_t)n) < 0)
                   ? -1
                   : put(p, PyBytes_AS_STRING(o), (size_t)n);
    }
    if (tp == &PyList_Type || tp == &PyTuple_Type) {
        int rc;
        if (put_u8(p, tp == &PyList_Type ? T_LIST : T_TUPLE) < 0)
            return -1;
        if (Py_EnterRecursiveCall(" while encoding a batch"))
            return -1;
        if (tp == &PyList_Type) {
            /* a list can change under us only through user code we call; copy it */
            PyObject *snap = PySequence_Fast(o, "list");
            rc = snap ? plan_seq(st, p, snap, depth) : -1;
            Py_XDECREF(snap);
        }
        else {
            rc = plan_seq(st, p, o, depth);
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
            rc = plan_obj(st, p, PyTuple_GET_ITEM(kv, 0), depth + 1);
            if (rc == 0)
                rc = plan_obj(st, p, PyTuple_GET_ITEM(kv, 1), depth + 1);
        }
        Py_LeaveRecursiveCall();
    dict_done:
        Py_DECREF(items);
        return rc;
    }
    if ((PyObject *)tp == st->tensor_type)
        return plan_tensor(st, p, o);
    if ((PyObject *)tp == st->stack_type)
        return plan_stack(st, p, o);
    if (tp == &PyArray_Type && plain_array((PyArrayObject *)o))
        return put_u8(p, T_ARRAY) < 0 ? -1 : plan_ndarray(p, (PyArrayObject *)o);
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
            rc = (put_u8(p, T_NPSCALAR) < 0 || put_i32(p, d->type_num) < 0 ||
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
            return rc;
        }
    }
    return plan_pickle(st, p, o, depth);
}

int
fl_plan_build(fl_state *st, fl_plan *p, PyObject *batch)
{
    return plan_obj(st, p, batch, 0);
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
    size_t data_off = FL_ALIGN_UP(FL_STREAM_OFF + p->slen, FL_DATA_ALIGN);
    size_t total = data_off + p->data_size;
    if (total > cap) {
        PyErr_SetString(PyExc_SystemError, "fastloader: plan larger than its slot");
        return -1;
    }
    fl_batch_hdr h = {FL_BATCH_MAGIC, 1, p->slen, data_off, total};
    memset(dst, 0, FL_STREAM_OFF);
    memcpy(dst, &h, sizeof(h));
    memcpy(dst + FL_STREAM_OFF, p->stream, p->slen);
    uint8_t *data = dst + data_off;
    for (size_t i = 0; i < p->nops; i++) {
        fl_op *op = &p->ops[i];
        uint8_t *at = data + op->off;
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
} dec;

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

static PyObject *
dec_array(dec *d, int *typenum_out)
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
    PyObject *arr = PyArray_NewFromDescr(&PyArray_Type, descr, (int)ndim, dims, NULL,
                                         (void *)(d->data + off), NPY_ARRAY_CARRAY, NULL);
    if (arr == NULL)
        return NULL;
    Py_INCREF(d->owner);
    if (PyArray_SetBaseObject((PyArrayObject *)arr, d->owner) < 0) {
        Py_DECREF(arr);
        return NULL;
    }
    *typenum_out = typenum;
    return arr;
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

static PyObject *
dec_obj(dec *d, int depth)
{
    uint8_t tag;
    if (depth > FL_MAX_DEPTH)
        return corrupt("nesting");
    if (take(d, &tag, 1) < 0)
        return NULL;
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
        return tag == T_STR ? PyUnicode_DecodeUTF8(s, (Py_ssize_t)n, "strict")
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
        PyObject *cls = PyDict_GetItemWithError(d->st->class_cache, key);
        if (cls == NULL) {
            if (PyErr_Occurred()) {
                Py_DECREF(key);
                return NULL;
            }
            PyObject *noob = PyList_New(0);
            cls = noob ? PyObject_CallFunctionObjArgs(d->st->hook_loads, key, noob, NULL)
                       : NULL;
            Py_XDECREF(noob);
            if (cls == NULL || !PyType_Check(cls) ||
                !PyType_IsSubtype((PyTypeObject *)cls, &PyTuple_Type) ||
                PyDict_SetItem(d->st->class_cache, key, cls) < 0) {
                Py_XDECREF(cls);
                Py_DECREF(key);
                return PyErr_Occurred() ? NULL : corrupt("namedtuple class");
            }
            Py_DECREF(cls); /* the cache holds it */
        }
        Py_DECREF(key);
        if (take(d, &n, 8) < 0)
            return NULL;
        PyObject *items = dec_items(d, (Py_ssize_t)(n > PY_SSIZE_T_MAX ? PY_SSIZE_T_MAX : n),
                                    depth, 0);
        if (items == NULL)
            return NULL;
        PyObject *r = PyObject_Call(cls, items, NULL);
        Py_DECREF(items);
        return r;
    }
    case T_ARRAY: {
        int typenum;
        return dec_array(d, &typenum);
    }
    case T_TENSOR: {
        int32_t code, rg;
        int typenum;
        if (take(d, &code, 4) < 0 || take(d, &rg, 4) < 0)
            return NULL;
        PyObject *arr = dec_array(d, &typenum);
        if (arr == NULL)
            return NULL;
        PyObject *t;
        if (!rg && code >= 0 && code < 64 && d->st->plain_code[code] && d->st->from_numpy) {
            /* the common case, without a Python-level call per tensor */
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
        return t;
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
            /* the view must not outlive this call: the slot may be reused later */
            PyObject *rel = PyObject_CallMethod(mv, "release", NULL);
            if (rel == NULL) {
                Py_CLEAR(r);
            }
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
    if (cap < FL_STREAM_OFF)
        return corrupt("short buffer");
    memcpy(&h, base, sizeof(h));
    if (h.magic != FL_BATCH_MAGIC || h.version != 1)
        return corrupt("bad magic");
    if (h.total > cap || h.data_off > h.total || h.stream_len > h.data_off - FL_STREAM_OFF ||
        h.data_off < FL_STREAM_OFF)
        return corrupt("header extents");
    dec d = {st, base, base + FL_STREAM_OFF, base + FL_STREAM_OFF + h.stream_len,
             base + h.data_off, (size_t)(h.total - h.data_off), owner};
    PyObject *r = dec_obj(&d, 0);
    if (r != NULL && d.s != d.end) {
        Py_DECREF(r);
        return corrupt("trailing bytes");
    }
    return r;
}
