/* Per-module state of fastloader._core and the one way to reach it.
 *
 * Module functions get it from their module object, methods of the heap types
 * from their type (PyType_GetModuleByDef, so subinterpreters each have their own).
 * Every C file that needs the state includes this header; none calls into
 * module.c, which only sets the module up. */
#ifndef FL_STATE_H
#define FL_STATE_H
#include "fl_common.h"

typedef struct {
    PyObject *FastLoaderError;
    PyObject *WorkerError;
    PyTypeObject *SegmentType;
    PyTypeObject *OwnerType;
    PyTypeObject *MainChannelType;
    PyTypeObject *WorkerChannelType;
    /* Python-side hooks registered by fastloader at import (see _codec_hooks.py) */
    PyObject *tensor_type;     /* torch.Tensor */
    PyObject *stack_type;      /* fastloader's deferred-stack type */
    PyObject *hook_export;     /* tensor -> (ndarray, dtype_code, requires_grad) */
    PyObject *hook_plan;       /* deferred stack -> (shape, np.dtype, dtype_code) */
    PyObject *hook_fill;       /* (deferred stack, dest ndarray) -> None */
    PyObject *hook_to_tensor;  /* (ndarray, dtype_code, requires_grad) -> tensor */
    PyObject *hook_dumps;      /* obj -> (bytes, [out-of-band tensors]) */
    PyObject *hook_loads;      /* (buffer, [tensors]) -> obj */
    PyObject *hook_namedtuple; /* namedtuple class -> its pickle, or None: pickle instances */
    PyObject *class_cache;     /* namedtuple class -> hook_namedtuple's answer (worker);
                                  pickled class bytes -> class (main process) */
    PyObject *from_numpy;      /* torch.from_numpy: the whole decode for plain dtypes */
    /* The dtype codes this torch has (set_fast_tensor): a tensor header naming
     * another code, or bytes of another NumPy type than its code's, or asking a
     * gradient of a code that cannot have one, is refused as corrupt. */
    int ncodes;
    uint8_t plain_code[64];    /* dtype codes that from_numpy alone gets right */
    uint8_t grad_code[64];     /* dtype codes whose tensors can require grad */
    uint8_t code_typenum[64];  /* code -> the NumPy typenum of its bytes */
} fl_state;

/* defined in module.c */
extern struct PyModuleDef fl_module_def;

static inline fl_state *
fl_state_of_module(PyObject *module)
{
    return (fl_state *)PyModule_GetState(module);
}

/* NULL with an exception set if `tp` is not one of this module's types. */
static inline fl_state *
fl_state_of_type(PyTypeObject *tp)
{
    PyObject *m = PyType_GetModuleByDef(tp, &fl_module_def);
    return m ? fl_state_of_module(m) : NULL;
}

/* Component set-up: create a heap type bound to `module` (so its methods find
 * the state), keep it in *out (the state's reference) and add it to the module. */
static inline int
fl_add_type(PyObject *module, PyType_Spec *spec, PyTypeObject **out)
{
    PyObject *t = PyType_FromModuleAndSpec(module, spec, NULL);
    if (t == NULL)
        return -1;
    *out = (PyTypeObject *)t;
    return PyModule_AddType(module, (PyTypeObject *)t);
}

/* The codec needs the Python hooks; 0 with RuntimeError if they are not set. */
static inline int
fl_hooks_ready(fl_state *st)
{
    if (st->hook_dumps == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "fastloader._core: set_hooks() was not called");
        return 0;
    }
    return 1;
}
#endif
