/* Segment (a mapping) and BatchOwner (the reference every view of a batch holds:
 * its death hands the slot back to the worker).
 *
 * Forks: a process forked after a loader started (another loader's workers, a
 * subprocess) must not keep this loader's batch memory mapped: that would pin
 * arenas the loader has long replaced or closed. So batch mappings are
 * MADV_DONTFORK. The exception is a batch the user still holds when forking (a
 * dataset that keeps an earlier batch, as torch allows): just before os.fork the
 * parts (slots) that a live batch points into are made inheritable again, so the
 * child can read them, and every other part is not. */
#include "objects.h"
#include "shm.h"
#include "self_pid.h"
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* Every batch mapping of this process; changed and walked with the GIL held. */
static SegmentObject *g_batch_maps;

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
    s->pid = fl_self_pid();
    s->nparts = 0;
    s->part_size = 0;
    s->live = NULL;
    s->inherited = NULL;
    s->prev = s->next = NULL;
    PyObject_GC_Track(s);
    return s;
}

SegmentObject *
fl_segment_new_batch(fl_state *st, void *addr, size_t size, uint32_t nparts, size_t part_size)
{
    SegmentObject *s = fl_segment_new(st, addr, size);
    if (s == NULL)
        return NULL;
    s->live = PyMem_Calloc(nparts ? nparts : 1, sizeof(uint32_t));
    s->inherited = PyMem_Calloc(nparts ? nparts : 1, 1);
    if (s->live == NULL || s->inherited == NULL) {
        Py_DECREF(s);
        return (SegmentObject *)PyErr_NoMemory();
    }
    s->nparts = nparts;
    s->part_size = part_size;
    s->next = g_batch_maps;
    if (g_batch_maps != NULL)
        g_batch_maps->prev = s;
    g_batch_maps = s;
    fl_shm_dontfork(addr, size);
    return s;
}

void
fl_segment_hold(SegmentObject *seg, uint32_t part)
{
    if (seg != NULL && seg->live != NULL && part < seg->nparts)
        seg->live[part]++;
}

int
fl_segment_inherited(const SegmentObject *seg, uint32_t part)
{
    return seg != NULL && seg->inherited != NULL && part < seg->nparts &&
           seg->inherited[part];
}

void
fl_segment_release(SegmentObject *seg, uint32_t part)
{
    if (seg != NULL && seg->live != NULL && part < seg->nparts && seg->live[part] > 0)
        seg->live[part]--;
}

/* os.register_at_fork(before=...): runs in the forking thread with the GIL held. */
static PyObject *
fork_prepare(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(ignored))
{
    pid_t me = fl_self_pid();
    for (SegmentObject *s = g_batch_maps; s != NULL; s = s->next) {
        if (s->pid != me || s->addr == NULL)
            continue;
        /* one madvise per run of parts in the same state */
        uint32_t i = 0;
        while (i < s->nparts) {
            int keep = s->live[i] > 0;
            uint32_t j = i + 1;
            while (j < s->nparts && (s->live[j] > 0) == keep)
                j++;
            /* The child may read these parts at any later time: the worker must
             * never write into them again (marked before the fork: a failed fork
             * only costs the slots). */
            if (keep)
                memset(s->inherited + i, 1, j - i);
            size_t off = (size_t)i * s->part_size;
            size_t end = j == s->nparts ? s->size : (size_t)j * s->part_size;
            if (off < s->size)
                (void)madvise((uint8_t *)s->addr + off, (end < s->size ? end : s->size) - off,
                              keep ? MADV_DOFORK : MADV_DONTFORK);
            i = j;
        }
    }
    Py_RETURN_NONE;
}

static PyMethodDef fork_prepare_def = {
    "_fastloader_fork_prepare", fork_prepare, METH_NOARGS,
    PyDoc_STR("Let the coming fork inherit only the batch memory that live batches use.")};

int
fl_fork_guard_install(void)
{
    static int installed;   /* inherited by forks, like the hook itself */
    PyObject *func = NULL, *reg = NULL, *args = NULL, *kw = NULL, *r = NULL;
    int rc = -1;
    if (installed)
        return 0;
    func = PyCFunction_New(&fork_prepare_def, NULL);
    PyObject *os = PyImport_ImportModule("os");
    if (os != NULL) {
        reg = PyObject_GetAttrString(os, "register_at_fork");
        Py_DECREF(os);
    }
    args = PyTuple_New(0);
    kw = Py_BuildValue("{s:O}", "before", func);
    if (func == NULL || reg == NULL || args == NULL || kw == NULL)
        goto done;
    r = PyObject_Call(reg, args, kw);
    if (r == NULL)
        goto done;
    installed = 1;
    rc = 0;
done:
    Py_XDECREF(func);
    Py_XDECREF(reg);
    Py_XDECREF(args);
    Py_XDECREF(kw);
    Py_XDECREF(r);
    return rc;
}

static void
segment_dealloc(SegmentObject *s)
{
    PyTypeObject *tp = Py_TYPE(s);
    PyObject_GC_UnTrack(s);
    if (s->live != NULL) {
        if (s->prev != NULL)
            s->prev->next = s->next;
        else if (g_batch_maps == s)
            g_batch_maps = s->next;
        if (s->next != NULL)
            s->next->prev = s->prev;
        PyMem_Free(s->live);
    }
    PyMem_Free(s->inherited);
    if (s->addr != NULL && s->pid == fl_self_pid())
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

static PyType_Slot segment_slots[] = {
    {Py_tp_dealloc, segment_dealloc},
    {Py_tp_traverse, segment_traverse},
    {Py_tp_doc, (void *)PyDoc_STR("A shared-memory mapping owned by fastloader.")},
    {0, NULL},
};

static PyType_Spec fl_segment_spec = {
    .name = "fastloader._core.Segment",
    .basicsize = sizeof(SegmentObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = segment_slots,
};

PyObject *
fl_owner_new(fl_state *st, SegmentObject *seg, MainChannelObject *chan, uint32_t gen,
             uint32_t slot)
{
    OwnerObject *o = PyObject_GC_New(OwnerObject, st->OwnerType);
    if (o == NULL)
        return NULL;
    o->seg = (SegmentObject *)Py_NewRef(seg);
    o->chan = (MainChannelObject *)Py_XNewRef(chan);
    o->gen = gen;
    o->slot = slot;
    o->pid = fl_self_pid();
    fl_segment_hold(seg, slot == UINT32_MAX ? 0 : slot);
    PyObject_GC_Track(o);
    return (PyObject *)o;
}

static void
owner_release_part(OwnerObject *o)
{
    if (o->seg != NULL)
        fl_segment_release(o->seg, o->slot == UINT32_MAX ? 0 : o->slot);
}

static void
owner_dealloc(OwnerObject *o)
{
    PyTypeObject *tp = Py_TYPE(o);
    PyObject_GC_UnTrack(o);
    MainChannelObject *c = o->chan;
    /* Hand the slot back only in the process that received it, while the worker
     * still runs; the ring is lock-free, and deallocations are serialised by the GIL. */
    if (c != NULL && !c->closed && o->pid == fl_self_pid() && c->ctl != NULL &&
        o->slot != UINT32_MAX) {
        /* A slot a fork inherited with this batch in it stays busy for good (the
         * child may still read it); the worker overflows when it has no free slot. */
        if (fl_segment_inherited(o->seg, o->slot))
            c->n_retired++;
        else
            (void)fl_free_push(&c->ring, ((uint64_t)o->gen << 32) | o->slot);
        if (o->gen == c->arena_gen && c->held > 0)
            c->held--;
    }
    owner_release_part(o);
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
    owner_release_part(o);
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

static PyType_Spec fl_owner_spec = {
    .name = "fastloader._core.BatchOwner",
    .basicsize = sizeof(OwnerObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = owner_slots,
};

int
fl_segment_init(PyObject *module, fl_state *st)
{
    if (fl_add_type(module, &fl_segment_spec, &st->SegmentType) < 0 ||
        fl_add_type(module, &fl_owner_spec, &st->OwnerType) < 0)
        return -1;
    return 0;
}
