/* C fill for default collation (see collate_fill.h).
 *
 * default_collate turns a column of ints into torch.tensor(column) (int64), of
 * floats into float64, of bools into bool, and a column of same-shape NumPy arrays
 * into torch.stack of their tensors. Doing that in torch costs a Python-list parse
 * and a temporary tensor per column; here the values go straight into the slot.
 * Only columns whose result is certain are taken: exact types (no subclasses, no
 * mix of int and bool or float, which torch would promote), ints that fit int64
 * (torch raises otherwise, and the fallback lets it), arrays of one native numeric
 * dtype and one shape, with strides torch.as_tensor accepts. Everything else
 * stays on torch's path. */
#define NO_IMPORT_ARRAY
#define PY_ARRAY_UNIQUE_SYMBOL fastloader_ARRAY_API
#include "collate_fill.h"
#include <numpy/arrayobject.h>
#include <string.h>

static int
numeric_native(PyArrayObject *a)
{
    PyArray_Descr *d = PyArray_DESCR(a);
    int t = d->type_num;
    int ok_type = (t >= NPY_BOOL && t <= NPY_CDOUBLE && t != NPY_LONGDOUBLE) || t == NPY_HALF;
    return ok_type && PyArray_ISNBO(d->byteorder) && !PyDataType_HASFIELDS(d) &&
           !PyDataType_HASSUBARRAY(d);
}

/* Whether torch.as_tensor takes this array as it is: it refuses (ValueError) a
 * negative stride, or one not a multiple of the item size, whatever the shape;
 * such a column stays on torch's path so that the same error is raised. */
static int
strides_torch_accepts(PyArrayObject *a)
{
    npy_intp item = PyArray_ITEMSIZE(a);
    npy_intp *strides = PyArray_STRIDES(a);
    for (int i = 0; i < PyArray_NDIM(a); i++)
        if (strides[i] < 0 || (item != 0 && strides[i] % item != 0))
            return 0;
    return 1;
}

static int
same_array_layout(PyArrayObject *a, PyArrayObject *first)
{
    int nd = PyArray_NDIM(first);
    if (Py_TYPE(a) != &PyArray_Type || PyArray_NDIM(a) != nd ||
        PyArray_DESCR(a)->type_num != PyArray_DESCR(first)->type_num || !numeric_native(a) ||
        !strides_torch_accepts(a))
        return 0;
    return nd == 0 || memcmp(PyArray_DIMS(a), PyArray_DIMS(first), sizeof(npy_intp) * nd) == 0;
}

/* The kind of a column, or FL_COL_OTHER; -1 with an exception only on bad arguments */
static int
kind_of(PyObject *seq)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    if (n == 0)
        return FL_COL_OTHER;
    PyTypeObject *tp = Py_TYPE(items[0]);
    if (tp == &PyLong_Type) {
        for (Py_ssize_t i = 0; i < n; i++) {
            int overflow = 0;
            if (Py_TYPE(items[i]) != &PyLong_Type)
                return FL_COL_OTHER;
            (void)PyLong_AsLongLongAndOverflow(items[i], &overflow);
            if (overflow)
                return FL_COL_OTHER;
        }
        return FL_COL_INT64;
    }
    if (tp == &PyFloat_Type || tp == &PyBool_Type) {
        for (Py_ssize_t i = 0; i < n; i++)
            if (Py_TYPE(items[i]) != tp)
                return FL_COL_OTHER;
        return tp == &PyFloat_Type ? FL_COL_FLOAT64 : FL_COL_BOOL;
    }
    if (tp == &PyArray_Type) {
        PyArrayObject *first = (PyArrayObject *)items[0];
        if (!numeric_native(first) || !strides_torch_accepts(first))
            return FL_COL_OTHER;
        /* told apart because torch.as_tensor warns (once per process) about an
         * array that is not writable, and the collate must too */
        int readonly = !PyArray_ISWRITEABLE(first);
        for (Py_ssize_t i = 1; i < n; i++) {
            if (!same_array_layout((PyArrayObject *)items[i], first))
                return FL_COL_OTHER;
            readonly |= !PyArray_ISWRITEABLE((PyArrayObject *)items[i]);
        }
        return readonly ? FL_COL_ARRAY_READONLY : FL_COL_ARRAY;
    }
    return FL_COL_OTHER;
}

PyDoc_STRVAR(column_kind_doc,
"column_kind(samples)\n--\n\nReturns int.\n"
"Which C fill can collate this column exactly as torch's default_collate does:\n"
"1 int64, 2 float64, 3 bool, 4 same-shape numeric arrays, 5 the same with at least\n"
"one array not writable, 0 none (torch's path).");

static PyObject *
column_kind(PyObject *module, PyObject *arg)
{
    (void)module;
    PyObject *seq = PySequence_Fast(arg, "column_kind() needs a sequence");
    if (seq == NULL)
        return NULL;
    int k = kind_of(seq);
    Py_DECREF(seq);
    return k < 0 ? NULL : PyLong_FromLong(k);
}

static int
fill_error(const char *what)
{
    PyErr_Format(PyExc_ValueError, "fastloader: fill_column: %s", what);
    return -1;
}

/* Fill `dst` (exactly n * item bytes) from the column; re-checks what column_kind
 * proved, because the slot must never be written past its end whatever happened
 * to the column in between. */
static int
fill(PyObject *seq, PyArrayObject *dest)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int kind = kind_of(seq);
    if (kind <= 0)
        return kind < 0 ? -1 : fill_error("the column changed since it was checked");
    if (kind == FL_COL_ARRAY_READONLY)   /* the warning is the collate's, not the fill's */
        kind = FL_COL_ARRAY;
    if (!PyArray_IS_C_CONTIGUOUS(dest) || !PyArray_ISWRITEABLE(dest))
        return fill_error("destination is not a writable C-contiguous array");
    size_t cap = (size_t)PyArray_NBYTES(dest);
    char *dst = PyArray_BYTES(dest);
    size_t item;
    if (kind == FL_COL_ARRAY)
        item = (size_t)PyArray_NBYTES((PyArrayObject *)items[0]);
    else
        item = kind == FL_COL_BOOL ? 1 : 8;
    size_t need;
    if (__builtin_mul_overflow(item, (size_t)n, &need) || need != cap ||
        (size_t)PyArray_ITEMSIZE(dest) != (kind == FL_COL_ARRAY
                                               ? (size_t)PyArray_ITEMSIZE((PyArrayObject *)items[0])
                                               : item))
        return fill_error("destination size does not match the column");
    for (Py_ssize_t i = 0; i < n; i++, dst += item) {
        PyObject *o = items[i];
        if (kind == FL_COL_INT64) {
            int64_t v = (int64_t)PyLong_AsLongLong(o);
            if (v == -1 && PyErr_Occurred())
                return -1;
            memcpy(dst, &v, 8);
        }
        else if (kind == FL_COL_FLOAT64) {
            double v = PyFloat_AS_DOUBLE(o);
            memcpy(dst, &v, 8);
        }
        else if (kind == FL_COL_BOOL) {
            *dst = (char)(o == Py_True);
        }
        else {
            PyArrayObject *a = (PyArrayObject *)o;
            if (PyArray_IS_C_CONTIGUOUS(a)) {
                memcpy(dst, PyArray_DATA(a), item);
            }
            else {
                /* strided: let NumPy walk it into a C-ordered view of this row */
                PyArray_Descr *d = PyArray_DESCR(a);
                Py_INCREF(d);
                PyObject *row = PyArray_NewFromDescr(&PyArray_Type, d, PyArray_NDIM(a),
                                                     PyArray_DIMS(a), NULL, dst,
                                                     NPY_ARRAY_CARRAY, NULL);
                if (row == NULL)
                    return -1;
                int rc = PyArray_CopyInto((PyArrayObject *)row, a);
                Py_DECREF(row);
                if (rc < 0)
                    return -1;
            }
        }
    }
    return 0;
}

PyDoc_STRVAR(fill_column_doc,
"fill_column(samples, dest)\n--\n\nReturns None.\n"
"Write a column that column_kind() accepted into `dest` (a C-contiguous array\n"
"over the slot, sized for the whole column), as default_collate would stack it.");

static PyObject *
fill_column(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *samples, *seq;
    PyArrayObject *dest;
    if (!PyArg_ParseTuple(args, "OO!", &samples, &PyArray_Type, &dest))
        return NULL;
    seq = PySequence_Fast(samples, "fill_column() needs a sequence");
    if (seq == NULL)
        return NULL;
    int rc = fill(seq, dest);
    Py_DECREF(seq);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef collate_fill_functions[] = {
    {"column_kind", column_kind, METH_O, column_kind_doc},
    {"fill_column", fill_column, METH_VARARGS, fill_column_doc},
    {NULL, NULL, 0, NULL},
};

int
fl_collate_fill_init(PyObject *module)
{
    return PyModule_AddFunctions(module, collate_fill_functions);
}
