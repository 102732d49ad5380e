/* PackedMapping: a read-only MAP_SHARED mapping of a packed segment or file. */
#define _GNU_SOURCE
#include "packed_internal.h"
#include <errno.h>
#include <sys/mman.h>
#include <sys/stat.h>

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

void
fl_packed_mapping_dealloc(PyObject *self)
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
    {Py_tp_dealloc, fl_packed_mapping_dealloc},
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

int
fl_packed_mapping_init(PyObject *module)
{
    PyObject *t = PyType_FromModuleAndSpec(module, &mapping_spec, NULL);
    if (t == NULL)
        return -1;
    int rc = PyModule_AddType(module, (PyTypeObject *)t);
    Py_DECREF(t);
    return rc;
}
