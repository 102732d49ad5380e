/* Identity-keyed object set with values: see identity_table.h. */
#include "identity_table.h"
#include <string.h>

static size_t
home(PyObject *obj, size_t cap)
{
    /* objects of one size lie at a fixed stride in memory: mix every bit of the
       address into the low ones (murmur3's finaliser) */
    uint64_t h = (uint64_t)(uintptr_t)obj;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return (size_t)h & (cap - 1);
}

static void
put_slot(fl_identity_slot *slots, size_t cap, PyObject *obj, uint64_t value)
{
    size_t i = home(obj, cap);
    while (slots[i].obj != NULL)
        i = (i + 1) & (cap - 1);
    slots[i].obj = obj;
    slots[i].value = value;
}

/* Rehash into a table of `cap` slots (a power of two). */
static int
resize(fl_identity_table *t, size_t cap)
{
    if (cap > PY_SSIZE_T_MAX / sizeof(fl_identity_slot)) {
        PyErr_NoMemory();
        return -1;
    }
    fl_identity_slot *slots = PyMem_Calloc(cap, sizeof(fl_identity_slot));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < t->cap; i++)
        if (t->slots[i].obj != NULL)
            put_slot(slots, cap, t->slots[i].obj, t->slots[i].value);
    PyMem_Free(t->slots);
    t->slots = slots;
    t->cap = cap;
    return 0;
}

/* The load stays at or under one half, so that probes stay short. */
int
fl_identity_reserve(fl_identity_table *t, size_t n)
{
    size_t cap = t->cap ? t->cap : 64;
    while (cap / 2 < n) {
        if (cap > PY_SSIZE_T_MAX / 2) {
            PyErr_NoMemory();
            return -1;
        }
        cap *= 2;
    }
    return cap == t->cap ? 0 : resize(t, cap);
}

int
fl_identity_find(const fl_identity_table *t, PyObject *obj, uint64_t *value)
{
    if (t->cap == 0)
        return 0;
    for (size_t i = home(obj, t->cap); t->slots[i].obj != NULL; i = (i + 1) & (t->cap - 1))
        if (t->slots[i].obj == obj) {
            *value = t->slots[i].value;
            return 1;
        }
    return 0;
}

int
fl_identity_add(fl_identity_table *t, PyObject *obj, uint64_t value)
{
    if (fl_identity_reserve(t, t->used + 1) < 0)
        return -1;
    put_slot(t->slots, t->cap, Py_NewRef(obj), value);
    t->used++;
    return 0;
}

void
fl_identity_clear(fl_identity_table *t)
{
    for (size_t i = 0; i < t->cap; i++)
        Py_XDECREF(t->slots[i].obj);
    PyMem_Free(t->slots);
    memset(t, 0, sizeof(*t));
}
