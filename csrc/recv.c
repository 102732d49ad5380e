/* recv(): the main process waits for the next result of any worker. The result
 * eventfds and the workers' pidfds go into one poll, with the GIL released, woken
 * by a result, a worker's death, the timeout and Ctrl-C; a published result is
 * taken without any system call. Where the caller says a CPU is spare, it first
 * spins a while (see the doc below). The time spent waiting is added to the
 * wanted channel's wait_s (the loader's data stall), so that the caller need not
 * read a clock around every call. */
#define _GNU_SOURCE
#include "objects.h"
#include "liveness.h"
#include "protocol.h"
#include "self_pid.h"
#include "spin.h"
#include <errno.h>
#include <poll.h>
#include <time.h>
#include <unistd.h>

static double
now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Sleep at most this long without the GIL, so Ctrl-C delivered to another thread
 * still reaches us promptly. */
#define FL_SLICE_MS 100

/* whether channel k of the tuple has a result published */
static int
has_result(PyObject *chans, Py_ssize_t k)
{
    return !fl_res_empty(&((MainChannelObject *)PyTuple_GET_ITEM(chans, k))->ring);
}

/* After Python code ran (a signal handler): whether the channels are still
 * open (a handler may have closed the loader); raises if not. */
static int
still_open(PyObject *chans, Py_ssize_t n)
{
    for (Py_ssize_t k = 0; k < n; k++)
        if (((MainChannelObject *)PyTuple_GET_ITEM(chans, k))->closed) {
            PyErr_SetString(PyExc_ValueError, "fastloader: channel is closed");
            return 0;
        }
    return 1;
}

/* What the spin watches: the rings, gathered with the GIL held, since
 * fl_spin_wait's ready() runs without it (the caller's tuple keeps the channels,
 * and so their control blocks, alive; a ring is read lock-free). */
typedef struct {
    const fl_ring **rings;
    Py_ssize_t n;
} spin_watch;

static int
result_ready(void *arg)
{
    const spin_watch *w = arg;
    for (Py_ssize_t k = 0; k < w->n; k++)
        if (!fl_res_empty(w->rings[k]))
            return 1;
    return 0;
}

/* Spin up to `most` ns for a result of prefer's channel (only_prefer) or any
 * channel's; the score is channels[0]'s. Returns whether one came. */
static int
spin_for_result(PyObject *chans, Py_ssize_t n, Py_ssize_t prefer, int only_prefer,
                uint64_t most)
{
    Py_ssize_t watched = only_prefer ? 1 : n;
    const fl_ring **rings = PyMem_Malloc((size_t)watched * sizeof(*rings));
    if (rings == NULL)
        return 0;   /* no spin: sleep as without one */
    for (Py_ssize_t k = 0; k < watched; k++)
        rings[k] = &((MainChannelObject *)PyTuple_GET_ITEM(chans, (prefer + k) % n))->ring;
    spin_watch watch = {rings, watched};
    fl_spin *score = &((MainChannelObject *)PyTuple_GET_ITEM(chans, 0))->spin;
    int caught;
    Py_BEGIN_ALLOW_THREADS
    caught = fl_spin_wait(score, most, result_ready, &watch);
    Py_END_ALLOW_THREADS
    PyMem_Free(rings);
    return caught;
}

PyDoc_STRVAR(recv_doc,
"recv(channels, prefer, timeout, only_prefer=False, spin_ns=0)\n--\n\n"
"Returns (worker_id, seq, kind, payload, where) or None.\n"
"Take the next result from any channel, starting with `prefer`. Waits with the GIL\n"
"released; wakes on a result, a worker's death (returns seq -1 and kind RES_DEAD),\n"
"the timeout in seconds (returns None; timeout None waits forever) and signals.\n"
"`where`: WHERE_NONE no payload, WHERE_SLOT a ring slot, WHERE_OVERFLOW an overflow\n"
"segment.\n"
"`only_prefer`: a result already published anywhere is taken at once, as without\n"
"it; but once asleep, only prefer's result, a death or the timeout ends the call,\n"
"and what other channels publish meanwhile waits for a later call. For in-order\n"
"delivery, where nothing can be yielded before prefer's result: a wake-up costs\n"
"the main process more CPU than a batch's bookkeeping, and a worker that runs\n"
"ahead would otherwise wake it for every result it publishes.\n"
"`spin_ns`: before the first sleep, spin (GIL released) up to this long for the\n"
"result, while recent spins paid off (the score is channels[0]'s). Only where a\n"
"CPU is spare: a worker that finds the main process asleep pays for waking it, a\n"
"system call and an interrupt to another CPU (on a VM, an exit to the host that\n"
"also leaves the worker's caches colder), ~65 us of worker CPU per batch measured\n"
"on a 2-vCPU KVM guest; a spinning main process needs no wake-up. Where the\n"
"workers use every CPU it would take CPU from one of them instead.");

static PyObject *
fl_recv(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    fl_state *st = fl_state_of_module(module);
    if (!fl_hooks_ready(st))
        return NULL;
    if (nargs < 3 || nargs > 5 || !PyTuple_Check(args[0]))
        return PyErr_Format(PyExc_TypeError, "recv(channels: tuple, prefer: int, timeout, "
                                             "only_prefer=False, spin_ns=0)");
    PyObject *chans = args[0];
    Py_ssize_t n = PyTuple_GET_SIZE(chans);
    Py_ssize_t prefer = PyLong_AsSsize_t(args[1]);
    double timeout = args[2] == Py_None ? -1.0 : PyFloat_AsDouble(args[2]);
    int only_prefer = nargs >= 4 ? PyObject_IsTrue(args[3]) : 0;
    long long spin_ns = nargs == 5 ? PyLong_AsLongLong(args[4]) : 0;
    if (only_prefer < 0 || PyErr_Occurred())
        return NULL;
    if (n == 0)
        return PyErr_Format(PyExc_ValueError, "recv: no channels");
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyTuple_GET_ITEM(chans, i);
        if (Py_TYPE(o) != st->MainChannelType)
            return PyErr_Format(PyExc_TypeError, "recv: expected MainChannel objects");
        if (((MainChannelObject *)o)->closed || ((MainChannelObject *)o)->owner_pid != fl_self_pid())
            return fl_mainchan_unusable((MainChannelObject *)o);
    }
    if (prefer < 0 || prefer >= n)
        prefer = 0;
    double deadline = timeout >= 0 ? now_s() + timeout : 0;
    double asleep_since = -1.0;   /* < 0: not slept (yet) */
    double waiting_since = -1.0;  /* < 0: the fast path found a result */
    int spun = 0;
    struct pollfd *pfds = NULL;
    PyObject *result = NULL;
    for (;;) {
        /* fast path: a published result needs no system call at all (after a sleep
         * with only_prefer, prefer's alone) */
        Py_ssize_t look = only_prefer && asleep_since >= 0 ? 1 : n;
        for (Py_ssize_t k = 0; k < look; k++) {
            MainChannelObject *c = (MainChannelObject *)PyTuple_GET_ITEM(chans, (prefer + k) % n);
            fl_result r;
            int got = fl_res_pop(&c->ring, &r);
            if (got < 0) {
                fl_raise(FL_CORRUPT, 0, "reading the result ring");
                goto done;
            }
            if (got) {
                result = fl_mainchan_take(st, c, &r);
                goto done;
            }
        }
        /* spin first, once per call, where the caller says a CPU is spare; never
         * past the deadline, so a timeout of 0 never spins */
        if (!spun && spin_ns > 0) {
            spun = 1;
            waiting_since = now_s();
            double left = timeout >= 0 ? deadline - waiting_since : -1.0;
            uint64_t most = (uint64_t)spin_ns;
            if (timeout >= 0)
                most = left <= 0 ? 0 : left * 1e9 < (double)most ? (uint64_t)(left * 1e9) : most;
            int caught = most > 0 && spin_for_result(chans, n, prefer, only_prefer, most);
            /* a signal that came while spinning runs its handler now: before a
             * result the spin caught is taken (a KeyboardInterrupt raised on our
             * return would lose it), and before the poll below, which it would
             * not interrupt (Ctrl-C would wait a slice) */
            if (PyErr_CheckSignals() < 0 || !still_open(chans, n))
                goto done;
            if (caught)
                continue;
        }
        /* announce that we sleep (to prefer alone if only_prefer), then look once
         * more (see fl_wake) */
        int any = 0;
        for (Py_ssize_t k = 0; k < n; k++) {
            MainChannelObject *c = (MainChannelObject *)PyTuple_GET_ITEM(chans, k);
            atomic_store(&c->ctl->main_waiting, !only_prefer || k == prefer);
        }
        /* pairs with fl_wake's fence (see the worker's wait for a task) */
        atomic_thread_fence(memory_order_seq_cst);
        if (only_prefer) {
            any = has_result(chans, prefer);
        } else {
            for (Py_ssize_t k = 0; k < n && !any; k++)
                any = has_result(chans, k);
        }
        int slice = FL_SLICE_MS;
        if (timeout >= 0) {
            double left = deadline - now_s();
            if (left <= 0 && !any) {
                result = Py_NewRef(Py_None);
                goto clear_waiting;
            }
            if (left * 1000 < slice)
                slice = left > 0 ? (int)(left * 1000) + 1 : 0;
        }
        if (!any) {
            if (asleep_since < 0)
                asleep_since = now_s();
            if (waiting_since < 0)
                waiting_since = asleep_since;
            if (pfds == NULL) {
                pfds = PyMem_Calloc((size_t)(2 * n), sizeof(struct pollfd));
                if (pfds == NULL) {
                    PyErr_NoMemory();
                    goto clear_waiting;
                }
            }
            for (Py_ssize_t k = 0; k < n; k++) {
                MainChannelObject *c = (MainChannelObject *)PyTuple_GET_ITEM(chans, k);
                pfds[2 * k] = (struct pollfd){.fd = c->efd_main, .events = POLLIN};
                pfds[2 * k + 1] =
                    (struct pollfd){.fd = c->watch ? c->pidfd : -1, .events = POLLIN};
            }
            int rc, saved = 0;
            Py_BEGIN_ALLOW_THREADS
            rc = poll(pfds, (nfds_t)(2 * n), slice);
            saved = errno;
            Py_END_ALLOW_THREADS
            if (rc < 0 && saved != EINTR) {
                fl_raise(FL_ERRNO, saved, "waiting for workers");
                goto clear_waiting;
            }
            for (Py_ssize_t k = 0; k < n; k++) {
                MainChannelObject *c = (MainChannelObject *)PyTuple_GET_ITEM(chans, k);
                if (rc > 0 && (pfds[2 * k].revents & POLLIN))
                    fl_drain_efd(c->efd_main);
                int dead = c->watch && ((rc > 0 && pfds[2 * k + 1].revents) ||
                                        (c->pidfd < 0 && c->pid > 0 &&
                                         fl_proc_dead(c->pid, c->pidfd)));
                /* a worker may publish and then die: deliver what it published first
                 * (from any channel: a death ends only_prefer) */
                if (dead && fl_res_empty(&c->ring)) {
                    result = Py_BuildValue("(iLIOI)", c->worker_id, FL_SEQ_DEAD,
                                           (unsigned)FL_RES_DEAD, Py_None,
                                           (unsigned)FL_WHERE_NONE);
                    goto clear_waiting;
                }
                if (dead)
                    only_prefer = 0;
            }
            if (PyErr_CheckSignals() < 0 || !still_open(chans, n))
                goto clear_waiting;
        }
        for (Py_ssize_t k = 0; k < n; k++)
            atomic_store(&((MainChannelObject *)PyTuple_GET_ITEM(chans, k))->ctl->main_waiting, 0);
    }
clear_waiting:
    for (Py_ssize_t k = 0; k < n; k++)
        atomic_store(&((MainChannelObject *)PyTuple_GET_ITEM(chans, k))->ctl->main_waiting, 0);
done:
    if (waiting_since >= 0)
        ((MainChannelObject *)PyTuple_GET_ITEM(chans, prefer))->wait_s += now_s() - waiting_since;
    PyMem_Free(pfds);
    return result;
}

static PyMethodDef recv_functions[] = {
    {"recv", (PyCFunction)(void (*)(void))fl_recv, METH_FASTCALL, recv_doc},
    {NULL, NULL, 0, NULL},
};

int
fl_recv_init(PyObject *module)
{
    return PyModule_AddFunctions(module, recv_functions);
}
