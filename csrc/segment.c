/* Segment (a mapping) and BatchOwner (the reference every view of a batch holds:
 * its death hands the slot back to the worker). */
#include "objects.h"
#include <sys/mman.h>
#include <unistd.h>

SegmentObject *
fl_segment_new(fl_state *st, void *addr, size_t size)
{
    SegmentObject *s = PyObject_GC_New(SegmentObject, st->SegmentType);
    if (s == NULL) {
        munmap(addr, size);
        return NULL;
    }
    s->addr = addr;
    s->size = size;
    s->pid = getpid();
    PyObject_GC_Track(s);
    return s;
}

static void
segment_dealloc(SegmentObject *s)
{
    PyTypeObject *tp = Py_TYPE(s);
    PyObject_GC_UnTrack(s);
    if (s->addr != NULL && s->pid == getpid())
        munmap(s->addr, s->size);
    tp->tp_free(s);
    Py_DECREF(tp);
}

static int
segment_traverse(SegmentObject *s, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(s));
    return 0;
}

static PyObject *
segment_info(SegmentObject *s, PyObject *Py_UNUSED(ignored))
{
    return Py_BuildValue("(Kn)", (unsigned long long)(uintptr_t)s->addr, (Py_ssize_t)s->size);
}

static PyMethodDef segment_methods[] = {
    {"info", (PyCFunction)segment_info, METH_NOARGS,
     PyDoc_STR("info() -> (address, nbytes) of this mapping in the current process")},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot segment_slots[] = {
    {Py_tp_dealloc, segment_dealloc},
    {Py_tp_traverse, segment_traverse},
    {Py_tp_methods, segment_methods},
    {Py_tp_doc, (void *)PyDoc_STR("A shared-memory mapping owned by fastloader.")},
    {0, NULL},
};

PyType_Spec fl_segment_spec = {
    .name = "fastloader._core.Segment",
    .basicsize = sizeof(SegmentObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = segment_slots,
};

static void
owner_dealloc(OwnerObject *o)
{
    PyTypeObject *tp = Py_TYPE(o);
    PyObject_GC_UnTrack(o);
    MainChannelObject *c = o->chan;
    /* Hand the slot back only in the process that received it, while the worker
     * still runs; the ring is lock-free, and deallocations are serialised by the GIL. */
    if (c != NULL && !c->closed && o->pid == getpid() && c->ctl != NULL &&
        o->slot != UINT32_MAX) {
        (void)fl_free_push(c->ctl, ((uint64_t)o->gen << 32) | o->slot);
        if (o->gen == c->arena_gen && c->held > 0)
            c->held--;
    }
    Py_CLEAR(o->seg);
    Py_CLEAR(o->chan);
    tp->tp_free(o);
    Py_DECREF(tp);
}

static int
owner_traverse(OwnerObject *o, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(o));
    Py_VISIT(o->seg);
    Py_VISIT(o->chan);
    return 0;
}

static int
owner_clear(OwnerObject *o)
{
    Py_CLEAR(o->seg);
    return 0;
}

static PyType_Slot owner_slots[] = {
    {Py_tp_dealloc, owner_dealloc},
    {Py_tp_traverse, owner_traverse},
    {Py_tp_clear, owner_clear},
    {Py_tp_doc, (void *)PyDoc_STR("Keeps one batch's ring slot busy while views of it live.")},
    {0, NULL},
};

PyType_Spec fl_owner_spec = {
    .name = "fastloader._core.BatchOwner",
    .basicsize = sizeof(OwnerObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = owner_slots,
};
