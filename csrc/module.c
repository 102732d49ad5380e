/* fastloader._core: module setup only (multi-phase init, per-module state, heap
 * types). The concepts live in ring.c, shm.c, pool.c, codec.c and the objects. */
#define PY_ARRAY_UNIQUE_SYMBOL fastloader_ARRAY_API
#include "objects.h"
#include "codec.h"
#include "packed.h"
#include "ring.h"
#include <numpy/arrayobject.h>
#include <string.h>

static struct PyModuleDef fl_module;

fl_state *
fl_module_state(PyObject *module)
{
    return (fl_state *)PyModule_GetState(module);
}

fl_state *
fl_get_state_from_type(PyTypeObject *tp)
{
    PyObject *m = PyType_GetModuleByDef(tp, &fl_module);
    return m ? fl_module_state(m) : NULL;
}

PyDoc_STRVAR(set_hooks_doc,
"set_hooks(tensor_type, stack_type, export, plan, fill, to_tensor, dumps, loads)\n--\n\n"
"Register the Python side of the codec: how tensors become arrays and back, and\n"
"how anything else is pickled with its tensors kept out of band.");

static PyObject *
set_hooks(PyObject *module, PyObject *args)
{
    fl_state *st = fl_module_state(module);
    PyObject *h[8];
    if (!PyArg_ParseTuple(args, "OOOOOOOO", &h[0], &h[1], &h[2], &h[3], &h[4], &h[5], &h[6],
                          &h[7]))
        return NULL;
    PyObject **slots[8] = {&st->tensor_type, &st->stack_type, &st->hook_export,
                           &st->hook_plan,   &st->hook_fill,  &st->hook_to_tensor,
                           &st->hook_dumps,  &st->hook_loads};
    for (int i = 0; i < 8; i++)
        Py_XSETREF(*slots[i], Py_NewRef(h[i]));
    Py_RETURN_NONE;
}

PyDoc_STRVAR(set_fast_tensor_doc,
"set_fast_tensor(from_numpy, plain_codes)\n--\n\n"
"Tensors whose dtype code is listed in `plain_codes` (bytes) and that do not\n"
"require grad are decoded by calling `from_numpy` on the slot view directly.");

static PyObject *
set_fast_tensor(PyObject *module, PyObject *args)
{
    fl_state *st = fl_module_state(module);
    PyObject *fn;
    Py_buffer codes;
    if (!PyArg_ParseTuple(args, "Oy*", &fn, &codes))
        return NULL;
    memset(st->plain_code, 0, sizeof(st->plain_code));
    for (Py_ssize_t i = 0; i < codes.len; i++) {
        uint8_t c = ((const uint8_t *)codes.buf)[i];
        if (c < sizeof(st->plain_code))
            st->plain_code[c] = 1;
    }
    PyBuffer_Release(&codes);
    Py_XSETREF(st->from_numpy, Py_NewRef(fn));
    Py_RETURN_NONE;
}

static int
hooks_ready(fl_state *st)
{
    if (st->hook_dumps == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "fastloader._core: set_hooks() was not called");
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(encode_doc,
"encode(obj) -> bytes\n--\n\n"
"Encode a batch the way a worker writes it into a slot (for tests and fuzzing).");

static PyObject *
encode(PyObject *module, PyObject *obj)
{
    fl_state *st = fl_module_state(module);
    if (!hooks_ready(st))
        return NULL;
    fl_plan *p = fl_plan_new();
    PyObject *out = NULL;
    if (p == NULL)
        return NULL;
    if (fl_plan_build(st, p, obj) == 0) {
        size_t n = fl_plan_size(p);
        out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)n);
        if (out && fl_plan_write(st, p, (uint8_t *)PyBytes_AS_STRING(out), n) < 0)
            Py_CLEAR(out);
    }
    fl_plan_free(p);
    return out;
}

static PyObject *
decode(PyObject *module, PyObject *arg)
{
    if (!hooks_ready(fl_module_state(module)))
        return NULL;
    return fl_decode_bytes(module, arg);
}

PyDoc_STRVAR(recv_doc,
"recv(channels, prefer, timeout) -> (worker_id, seq, kind, payload, where) or None\n--\n\n"
"Take the next result from any channel, starting with `prefer`. Waits with the GIL\n"
"released; wakes on a result, a worker's death (returns seq -1 and kind 0), the\n"
"timeout in seconds (returns None; timeout None waits forever) and signals.\n"
"`where`: 0 no payload, 1 a ring slot, 2 an overflow segment.");

static PyObject *
recv(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (!hooks_ready(fl_module_state(module)))
        return NULL;
    return fl_recv(module, args, nargs);
}

static PyMethodDef module_methods[] = {
    {"set_hooks", set_hooks, METH_VARARGS, set_hooks_doc},
    {"set_fast_tensor", set_fast_tensor, METH_VARARGS, set_fast_tensor_doc},
    {"encode", encode, METH_O, encode_doc},
    {"decode", decode, METH_O,
     PyDoc_STR("decode(buffer) -> object\n--\n\nInverse of encode(); raises on bad bytes.")},
    {"recv", (PyCFunction)(void (*)(void))recv, METH_FASTCALL, recv_doc},
    {NULL, NULL, 0, NULL},
};

static int
add_type(PyObject *m, PyType_Spec *spec, PyTypeObject **out)
{
    PyObject *t = PyType_FromModuleAndSpec(m, spec, NULL);
    if (t == NULL)
        return -1;
    *out = (PyTypeObject *)t;
    return PyModule_AddType(m, (PyTypeObject *)t);
}

static int
module_exec(PyObject *m)
{
    fl_state *st = fl_module_state(m);
    if (PyArray_ImportNumPyAPI() < 0)
        return -1;
    st->class_cache = PyDict_New();
    if (st->class_cache == NULL)
        return -1;
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
    if (add_type(m, &fl_segment_spec, &st->SegmentType) < 0 ||
        add_type(m, &fl_owner_spec, &st->OwnerType) < 0 ||
        add_type(m, &fl_main_channel_spec, &st->MainChannelType) < 0 ||
        add_type(m, &fl_worker_channel_spec, &st->WorkerChannelType) < 0)
        return -1;
    struct { const char *name; long v; } consts[] = {
        {"TASK_INDICES", FL_TASK_INDICES}, {"TASK_INDEX", FL_TASK_INDEX},
        {"TASK_NONES", FL_TASK_NONES},     {"TASK_PICKLE", FL_TASK_PICKLE},
        {"TASK_RESUME", FL_TASK_RESUME},   {"TASK_SHUTDOWN", FL_TASK_SHUTDOWN},
        {"TASK_CONTROL", FL_TASK_CONTROL}, {"RES_BATCH_SNAP", FL_RES_BATCH_SNAP},
        {"RES_BATCH", FL_RES_BATCH},       {"RES_ERROR", FL_RES_ERROR},
        {"RES_ITER_END", FL_RES_ITER_END}, {"RES_RESUMED", FL_RES_RESUMED},
        {"RES_DEAD", 0},
        {"WHERE_NONE", FL_WHERE_NONE},     {"WHERE_SLOT", FL_WHERE_SLOT},
        {"WHERE_OVERFLOW", FL_WHERE_OVERFLOW},
        {"STRATEGY_FD", FL_STRATEGY_FD},   {"STRATEGY_FS", FL_STRATEGY_FS},
    };
    for (size_t i = 0; i < sizeof(consts) / sizeof(consts[0]); i++)
        if (PyModule_AddIntConstant(m, consts[i].name, consts[i].v) < 0)
            return -1;
    return fl_packed_init(m);
}

static int
module_traverse(PyObject *m, visitproc visit, void *arg)
{
    fl_state *st = fl_module_state(m);
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
    Py_VISIT(st->class_cache);
    Py_VISIT(st->from_numpy);
    return 0;
}

static int
module_clear(PyObject *m)
{
    fl_state *st = fl_module_state(m);
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

static struct PyModuleDef fl_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "fastloader._core",
    .m_doc = module_doc,
    .m_size = sizeof(fl_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC
PyInit__core(void)
{
    return PyModuleDef_Init(&fl_module);
}
