/* A set of Python objects keyed by identity (their address), each with a number:
 * the codec's memo for str and bytes. Pickle memoizes every str and bytes object,
 * so the same object twice in a batch arrives as one object in torch's main
 * process; a dict keyed by PyLong(address) would cost two allocations per string,
 * and a batch can hold thousands of them. Open addressing, no allocation per
 * entry. The table owns a reference to each object, so that no address is reused
 * while it is in the table. */
#ifndef FL_IDENTITY_TABLE_H
#define FL_IDENTITY_TABLE_H

#include <Python.h>
#include <stdint.h>

typedef struct {
    PyObject *obj;
    uint64_t value;
} fl_identity_slot;

typedef struct {
    fl_identity_slot *slots;
    size_t cap;      /* a power of two, or 0 before the first add */
    size_t used;
} fl_identity_table;

/* 1 and *value if obj is in the table, else 0. */
int fl_identity_find(const fl_identity_table *t, PyObject *obj, uint64_t *value);

/* Add obj, which is not in the table, with `value`: 0, or -1 with MemoryError set. */
int fl_identity_add(fl_identity_table *t, PyObject *obj, uint64_t value);

/* Make room for n entries in all, so that adding them does not rehash: 0, or -1
 * with MemoryError set. */
int fl_identity_reserve(fl_identity_table *t, size_t n);

/* Drop every entry and its reference; the table is empty and reusable. */
void fl_identity_clear(fl_identity_table *t);

#endif
