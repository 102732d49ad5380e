/* transpose_tuples(), transpose_dicts(): the columns of a batch of plain tuples
 * or plain dicts (see the header).
 *
 * torch's collate() handles a batch whose first sample is a tuple by checking in
 * Python that every sample has the first one's length, transposing with
 * zip(*batch) and collating each column. For 64 two-field samples that walk costs
 * a worker about as much as its own C fill of the columns. Here it is one pass in
 * C, taken only where its result is certain: a list of exact tuples (not
 * namedtuples or other subclasses) of one length. Anything else returns None,
 * and the caller takes torch's path, with torch's result or error.
 *
 * A batch of dicts goes the same way: torch collates [d[key] for d in batch] for
 * each key of the first sample. Taken only for exact dicts whose keys are exact
 * strs (a lookup then runs no Python code), each holding every key of the
 * first; extra keys in later samples are ignored, as torch ignores them. */
#include "collate_transpose.h"

/* A private copy of `batch` if it is a non-empty exact list whose first sample is
 * exactly of type `first`; NULL otherwise (with an exception set only where the
 * copy failed). The first sample is looked at before the copy only so that other
 * batches cost no allocation: callers check the copy again. Allocating after this
 * may run the garbage collector, and a finalizer could change the caller's list,
 * not the copy (the copy itself is CPython's list slice, as safe as `batch[:]`). */
static PyObject *
private_rows(PyObject *batch, PyTypeObject *first)
{
    if (!PyList_CheckExact(batch) || PyList_GET_SIZE(batch) == 0 ||
        Py_TYPE(PyList_GET_ITEM(batch, 0)) != first)
        return NULL;
    return PyList_GetSlice(batch, 0, PyList_GET_SIZE(batch));
}

PyDoc_STRVAR(transpose_tuples_doc,
"transpose_tuples(batch)\n--\n\nReturns list[tuple] or None.\n"
"The columns of `batch` (list(zip(*batch))) if it is a non-empty list of exact\n"
"tuples that all have the first one's length; None otherwise.");

static PyObject *
transpose_tuples(PyObject *module, PyObject *batch)
{
    (void)module;
    PyObject *rows = private_rows(batch, &PyTuple_Type);   /* tuples cannot change */
    if (rows == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    PyObject *columns = NULL;
    Py_ssize_t n = PyList_GET_SIZE(rows);
    PyObject *first = n ? PyList_GET_ITEM(rows, 0) : NULL;
    if (first == NULL || !PyTuple_CheckExact(first))
        goto not_plain;
    Py_ssize_t width = PyTuple_GET_SIZE(first);
    for (Py_ssize_t i = 1; i < n; i++) {
        PyObject *s = PyList_GET_ITEM(rows, i);
        if (!PyTuple_CheckExact(s) || PyTuple_GET_SIZE(s) != width)
            goto not_plain;
    }
    columns = PyList_New(width);
    if (columns == NULL)
        goto done;
    for (Py_ssize_t j = 0; j < width; j++) {
        PyObject *col = PyTuple_New(n);
        if (col == NULL) {
            Py_CLEAR(columns);
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++)
            PyTuple_SET_ITEM(col, i, Py_NewRef(PyTuple_GET_ITEM(PyList_GET_ITEM(rows, i), j)));
        PyList_SET_ITEM(columns, j, col);
    }
    goto done;
not_plain:
    columns = Py_NewRef(Py_None);
done:
    Py_DECREF(rows);
    return columns;
}

PyDoc_STRVAR(transpose_dicts_doc,
"transpose_dicts(batch)\n--\n\nReturns (keys, list[list]) or None.\n"
"The first sample's keys, in order, and for each the list of every sample's value\n"
"([d[key] for d in batch]) if `batch` is a non-empty list of exact dicts with exact\n"
"str keys that all hold the first one's keys; None otherwise.");

/* every key of exact dict `d` is an exact str: a lookup in it by a str then runs
 * no Python code (no __eq__ of a stored key) */
static int
str_keys_only(PyObject *d)
{
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(d, &pos, &key, &value))
        if (!PyUnicode_CheckExact(key))
            return 0;
    return 1;
}

static PyObject *
transpose_dicts(PyObject *module, PyObject *batch)
{
    (void)module;
    /* Everything is allocated first (a private copy of the list, the first
     * sample's keys, the columns), since an allocation may run the garbage
     * collector and so a finalizer; the checks and the lookups after the last
     * allocation run no Python code, so what they checked still holds when the
     * values are read. */
    PyObject *rows = private_rows(batch, &PyDict_Type);
    if (rows == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    PyObject *result = NULL, *columns = NULL, *keys = NULL;
    if (PyList_GET_SIZE(rows) == 0 || !PyDict_CheckExact(PyList_GET_ITEM(rows, 0)))
        goto not_plain;
    keys = PyDict_Keys(PyList_GET_ITEM(rows, 0));
    if (keys == NULL)
        goto done;
    Py_ssize_t n = PyList_GET_SIZE(rows), width = PyList_GET_SIZE(keys);
    columns = PyList_New(width);
    if (columns == NULL)
        goto done;
    for (Py_ssize_t j = 0; j < width; j++) {
        PyObject *col = PyList_New(n);
        if (col == NULL)
            goto done;
        PyList_SET_ITEM(columns, j, col);
    }
    for (Py_ssize_t j = 0; j < width; j++)
        if (!PyUnicode_CheckExact(PyList_GET_ITEM(keys, j)))
            goto not_plain;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyList_GET_ITEM(rows, i);
        if (!PyDict_CheckExact(d) || !str_keys_only(d))
            goto not_plain;
    }
    for (Py_ssize_t j = 0; j < width; j++) {
        PyObject *key = PyList_GET_ITEM(keys, j);
        PyObject *col = PyList_GET_ITEM(columns, j);
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *v = PyDict_GetItemWithError(PyList_GET_ITEM(rows, i), key);
            if (v == NULL) {
                if (PyErr_Occurred())
                    goto done;
                goto not_plain;   /* a key missing: torch raises its KeyError */
            }
            PyList_SET_ITEM(col, i, Py_NewRef(v));
        }
    }
    result = PyTuple_Pack(2, keys, columns);
    goto done;
not_plain:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(columns);   /* a column's unfilled items are NULL: list_dealloc skips them */
    Py_XDECREF(keys);
    Py_DECREF(rows);
    return result;
}

static PyMethodDef collate_transpose_functions[] = {
    {"transpose_tuples", transpose_tuples, METH_O, transpose_tuples_doc},
    {"transpose_dicts", transpose_dicts, METH_O, transpose_dicts_doc},
    {NULL, NULL, 0, NULL},
};

int
fl_collate_transpose_init(PyObject *module)
{
    return PyModule_AddFunctions(module, collate_transpose_functions);
}
