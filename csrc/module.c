/* fastloader._core: module setup only (multi-phase init, per-module state in
 * state.h, heap types). Each component adds its own types and functions through
 * its init function; the concepts live in the files those name. */
#define PY_ARRAY_UNIQUE_SYMBOL fastloader_ARRAY_API
#include "objects.h"
#include "codec.h"
#include "collate_fill.h"
#include "collate_transpose.h"
#include "packed.h"
#include "protocol.h"
#include "self_pid.h"
#include <numpy/arrayobject.h>

static int
add_errors(PyObject *m, fl_state *st)
{
    st->FastLoaderError = PyErr_NewExceptionWithDoc(
        "fastloader.FastLoaderError", "Base class of fastloader's errors.", NULL, NULL);
    if (st->FastLoaderError == NULL)
        return -1;
    PyObject *bases = PyTuple_Pack(2, st->FastLoaderError, PyExc_RuntimeError);
    if (bases == NULL)
        return -1;
    st->WorkerError = PyErr_NewExceptionWithDoc(
        "fastloader.WorkerError", "A DataLoader worker process died or misbehaved.", bases,
        NULL);
    Py_DECREF(bases);
    if (st->WorkerError == NULL)
        return -1;
    if (PyModule_AddObjectRef(m, "FastLoaderError", st->FastLoaderError) < 0 ||
        PyModule_AddObjectRef(m, "WorkerError", st->WorkerError) < 0)
        return -1;
    return 0;
}

/* the worker protocol's numbers (protocol.h) and the sharing strategies */
static int
add_constants(PyObject *m)
{
#define FL_CONST_ENTRY(name, value) {name, value},
    static const struct { const char *name; long v; } consts[] = {
        FL_PROTOCOL_CONSTANTS(FL_CONST_ENTRY)
        {"STRATEGY_FD", FL_STRATEGY_FD},
        {"STRATEGY_FS", FL_STRATEGY_FS},
    };
#undef FL_CONST_ENTRY
    for (size_t i = 0; i < sizeof(consts) / sizeof(consts[0]); i++)
        if (PyModule_AddIntConstant(m, consts[i].name, consts[i].v) < 0)
            return -1;
    return 0;
}

static int
module_exec(PyObject *m)
{
    fl_state *st = fl_state_of_module(m);
    if (PyArray_ImportNumPyAPI() < 0)
        return -1;
    if (fl_self_pid_init() < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    st->class_cache = PyDict_New();
    if (st->class_cache == NULL)
        return -1;
    if (add_errors(m, st) < 0 || add_constants(m) < 0 ||
        fl_segment_init(m, st) < 0 ||         /* Segment, BatchOwner */
        fl_main_channel_init(m, st) < 0 ||    /* MainChannel */
        fl_worker_channel_init(m, st) < 0 ||  /* WorkerChannel */
        fl_recv_init(m) < 0 ||                /* recv() */
        fl_codec_init(m) < 0 ||               /* set_hooks(), encode(), decode() ... */
        fl_collate_fill_init(m) < 0 ||        /* column_kind(), fill_column() */
        fl_collate_transpose_init(m) < 0 ||   /* transpose_tuples(), transpose_dicts() */
        fl_packed_init(m) < 0)                /* Packed*, packed_scan(), PACKED_* */
        return -1;
    return 0;
}

static int
module_traverse(PyObject *m, visitproc visit, void *arg)
{
    fl_state *st = fl_state_of_module(m);
    Py_VISIT(st->FastLoaderError);
    Py_VISIT(st->WorkerError);
    Py_VISIT(st->SegmentType);
    Py_VISIT(st->OwnerType);
    Py_VISIT(st->MainChannelType);
    Py_VISIT(st->WorkerChannelType);
    Py_VISIT(st->tensor_type);
    Py_VISIT(st->stack_type);
    Py_VISIT(st->hook_export);
    Py_VISIT(st->hook_plan);
    Py_VISIT(st->hook_fill);
    Py_VISIT(st->hook_to_tensor);
    Py_VISIT(st->hook_dumps);
    Py_VISIT(st->hook_loads);
    Py_VISIT(st->hook_namedtuple);
    Py_VISIT(st->class_cache);
    Py_VISIT(st->from_numpy);
    return 0;
}

static int
module_clear(PyObject *m)
{
    fl_state *st = fl_state_of_module(m);
    Py_CLEAR(st->FastLoaderError);
    Py_CLEAR(st->WorkerError);
    Py_CLEAR(st->SegmentType);
    Py_CLEAR(st->OwnerType);
    Py_CLEAR(st->MainChannelType);
    Py_CLEAR(st->WorkerChannelType);
    Py_CLEAR(st->tensor_type);
    Py_CLEAR(st->stack_type);
    Py_CLEAR(st->hook_export);
    Py_CLEAR(st->hook_plan);
    Py_CLEAR(st->hook_fill);
    Py_CLEAR(st->hook_to_tensor);
    Py_CLEAR(st->hook_dumps);
    Py_CLEAR(st->hook_loads);
    Py_CLEAR(st->hook_namedtuple);
    Py_CLEAR(st->class_cache);
    Py_CLEAR(st->from_numpy);
    return 0;
}

static void
module_free(void *m)
{
    module_clear((PyObject *)m);
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

PyDoc_STRVAR(module_doc, "fastloader's C core: shared-memory rings, workers, batch codec.");

struct PyModuleDef fl_module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "fastloader._core",
    .m_doc = module_doc,
    .m_size = sizeof(fl_state),
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC
PyInit__core(void)
{
    return PyModuleDef_Init(&fl_module_def);
}
