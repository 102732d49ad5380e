/* The codec's module functions: registering the Python hooks it calls, and
 * encode()/decode() on plain bytes (for tests and fuzzing; workers and recv()
 * use fl_plan_* and fl_decode directly on ring slots). */
#define _GNU_SOURCE
#include "objects.h"
#include "codec.h"
#include <string.h>
#include <sys/mman.h>

PyDoc_STRVAR(set_hooks_doc,
"set_hooks(tensor_type, stack_type, export, plan, fill, to_tensor, dumps, loads,\n"
"          namedtuple)\n--\n\n"
"Register the Python side of the codec: how tensors become arrays and back, how\n"
"anything else is pickled with its tensors kept out of band, and which namedtuple\n"
"classes travel as their fields.");

static PyObject *
set_hooks(PyObject *module, PyObject *args)
{
    fl_state *st = fl_state_of_module(module);
    PyObject *h[9];
    if (!PyArg_ParseTuple(args, "OOOOOOOOO", &h[0], &h[1], &h[2], &h[3], &h[4], &h[5], &h[6],
                          &h[7], &h[8]))
        return NULL;
    PyObject **slots[9] = {&st->tensor_type, &st->stack_type,     &st->hook_export,
                           &st->hook_plan,   &st->hook_fill,      &st->hook_to_tensor,
                           &st->hook_dumps,  &st->hook_loads,     &st->hook_namedtuple};
    for (int i = 0; i < 9; i++)
        Py_XSETREF(*slots[i], Py_NewRef(h[i]));
    Py_RETURN_NONE;
}

PyDoc_STRVAR(set_fast_tensor_doc,
"set_fast_tensor(from_numpy, typenums, plain_codes, grad_codes)\n--\n\n"
"The dtype codes: `typenums` (bytes) holds each code's NumPy typenum, in code\n"
"order (at most 64). Tensors whose dtype code is listed in `plain_codes` (bytes)\n"
"and that do not require grad are decoded by calling `from_numpy` on the slot\n"
"view directly; only codes in `grad_codes` may require grad.");

static PyObject *
set_fast_tensor(PyObject *module, PyObject *args)
{
    fl_state *st = fl_state_of_module(module);
    PyObject *fn;
    Py_buffer typenums, plain, grad;
    if (!PyArg_ParseTuple(args, "Oy*y*y*", &fn, &typenums, &plain, &grad))
        return NULL;
    PyObject *ret = NULL;
    if (typenums.len > (Py_ssize_t)sizeof(st->code_typenum)) {
        PyErr_SetString(PyExc_ValueError, "set_fast_tensor: more than 64 dtype codes");
        goto done;
    }
    st->ncodes = (int)typenums.len;
    memcpy(st->code_typenum, typenums.buf, (size_t)typenums.len);
    memset(st->plain_code, 0, sizeof(st->plain_code));
    memset(st->grad_code, 0, sizeof(st->grad_code));
    for (Py_ssize_t i = 0; i < plain.len; i++) {
        uint8_t c = ((const uint8_t *)plain.buf)[i];
        if (c < sizeof(st->plain_code))
            st->plain_code[c] = 1;
    }
    for (Py_ssize_t i = 0; i < grad.len; i++) {
        uint8_t c = ((const uint8_t *)grad.buf)[i];
        if (c < sizeof(st->grad_code))
            st->grad_code[c] = 1;
    }
    Py_XSETREF(st->from_numpy, Py_NewRef(fn));
    ret = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&typenums);
    PyBuffer_Release(&plain);
    PyBuffer_Release(&grad);
    return ret;
}

PyDoc_STRVAR(encode_doc,
"encode(obj)\n--\n\nReturns bytes.\n"
"Encode a batch the way a worker writes it into a slot (for tests and fuzzing).");

static PyObject *
encode(PyObject *module, PyObject *obj)
{
    fl_state *st = fl_state_of_module(module);
    if (!fl_hooks_ready(st))
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

PyDoc_STRVAR(decode_doc,
"decode(buffer)\n--\n\nReturns object.\n"
"Inverse of encode(); raises on bad bytes. The views it returns keep a private\n"
"copy of the bytes alive.");

static PyObject *
decode(PyObject *module, PyObject *arg)
{
    fl_state *st = fl_state_of_module(module);
    if (!fl_hooks_ready(st))
        return NULL;
    PyObject *copy = PyByteArray_FromObject(arg);
    if (copy == NULL)
        return NULL;
    size_t n = (size_t)PyByteArray_GET_SIZE(copy);
    void *addr = mmap(NULL, n ? n : 1, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                      -1, 0);
    if (addr == MAP_FAILED) {
        Py_DECREF(copy);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    memcpy(addr, PyByteArray_AS_STRING(copy), n);
    Py_DECREF(copy);
    SegmentObject *seg = fl_segment_new(st, addr, n ? n : 1);
    if (seg == NULL)
        return NULL;
    PyObject *owner = fl_owner_new(st, seg, NULL, 0, UINT32_MAX);
    Py_DECREF(seg);   /* the owner holds it */
    if (owner == NULL)
        return NULL;
    PyObject *r = fl_decode(st, addr, n, owner);
    Py_DECREF(owner);
    return r;
}

static PyMethodDef codec_functions[] = {
    {"set_hooks", set_hooks, METH_VARARGS, set_hooks_doc},
    {"set_fast_tensor", set_fast_tensor, METH_VARARGS, set_fast_tensor_doc},
    {"encode", encode, METH_O, encode_doc},
    {"decode", decode, METH_O, decode_doc},
    {NULL, NULL, 0, NULL},
};

int
fl_codec_init(PyObject *module)
{
    return PyModule_AddFunctions(module, codec_functions);
}
