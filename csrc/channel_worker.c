/* WorkerChannel: a worker's end. It waits for tasks (GIL released, woken by the
 * main process or its death), and publishes batches: encoded straight into a free
 * slot of the worker's ring arena, or into an overflow segment when the batch is
 * larger than a slot or the consumer still holds every slot. It never blocks on
 * the consumer. The arena is created on the first batch, sized from it, and
 * replaced by a larger one when batches outgrow it. */
#define _GNU_SOURCE
#define NO_IMPORT_ARRAY
#define PY_ARRAY_UNIQUE_SYMBOL fastloader_ARRAY_API
#include "objects.h"
#include "protocol.h"
#include "codec.h"
#include "liveness.h"
#include "shm_names.h"
#include "shm.h"
#include <errno.h>
#include <poll.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>


static PyObject *
workerchan_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"handle", "ctl_fd", "efd_main", "efd_worker", "sock",
                             "nslots", NULL};
    PyObject *h;
    int ctl_fd, efd_main, efd_worker, sock;
    unsigned int nslots;
    int err = 0, code;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!iiiiI", kwlist, &PyDict_Type, &h,
                                     &ctl_fd, &efd_main, &efd_worker, &sock, &nslots))
        return NULL;
    PyObject *o_wid = PyDict_GetItemString(h, "worker_id");
    PyObject *o_strat = PyDict_GetItemString(h, "strategy");
    PyObject *o_size = PyDict_GetItemString(h, "ctl_size");
    PyObject *o_name = PyDict_GetItemString(h, "ctl_name");
    PyObject *o_prefix = PyDict_GetItemString(h, "prefix");
    PyObject *o_pid = PyDict_GetItemString(h, "main_pid");
    PyObject *o_dev = PyDict_GetItemString(h, "ctl_dev");
    PyObject *o_ino = PyDict_GetItemString(h, "ctl_ino");
    if (!o_wid || !o_strat || !o_size || !o_name || !o_prefix || !o_pid || !o_dev || !o_ino)
        return PyErr_Format(PyExc_ValueError, "fastloader: incomplete channel handle");
    WorkerChannelObject *w = (WorkerChannelObject *)type->tp_alloc(type, 0);
    if (w == NULL)
        return NULL;
    w->efd_main = efd_main;
    w->efd_worker = efd_worker;
    w->sock = sock;
    w->main_pidfd = -1;
    w->arena_fd = -1;
    w->worker_id = (int)PyLong_AsLong(o_wid);
    w->strategy = (int)PyLong_AsLong(o_strat);
    w->ctl_size = (size_t)PyLong_AsSsize_t(o_size);
    w->main_pid = (pid_t)PyLong_AsLong(o_pid);
    w->nslots_target = nslots < 2 ? 2 : (nslots > FL_MAX_SLOTS ? FL_MAX_SLOTS : nslots);
    fl_shm_ident ctl_ident = {0, PyLong_AsUnsignedLongLong(o_dev),
                              PyLong_AsUnsignedLongLong(o_ino)};
    const char *prefix = PyUnicode_AsUTF8(o_prefix);
    const char *ctl_name = PyUnicode_AsUTF8(o_name);
    if (PyErr_Occurred() || prefix == NULL || ctl_name == NULL)
        goto fail_py;
    snprintf(w->prefix, sizeof(w->prefix), "%s", prefix);
    if (w->strategy == FL_STRATEGY_FS) {
        char why[128], what[FL_NAME_MAX + 200];
        code = fl_shm_open_verified(ctl_name, &ctl_ident, w->ctl_size, &ctl_fd, &err, why,
                                    sizeof(why));
        if (code != FL_OK) {
            snprintf(what, sizeof(what), "opening the control block %s%s: refused, %s",
                     FL_SHM_DIR, ctl_name, why);
            fl_raise_path(code, err, why[0] ? what : "opening the control block", ctl_name);
            goto fail_py;
        }
    }
    void *addr;
    code = fl_shm_map(ctl_fd, w->ctl_size, &addr, &err);
    close(ctl_fd);
    if (code != FL_OK) {
        fl_raise(code, err, "mapping the control block");
        goto fail_py;
    }
    w->ctl = addr;
    if (w->strategy == FL_STRATEGY_FS)
        shm_unlink(ctl_name);   /* both sides have mapped it */
    if (fl_ring_attach(&w->ring, w->ctl, w->ctl_size) != FL_OK) {
        fl_raise(FL_CORRUPT, 0, "attaching to the control block");
        goto fail_py;
    }
    code = fl_worker_arm(w->ctl, w->strategy == FL_STRATEGY_FS ? w->prefix : NULL,
                         w->main_pid, &err);
    if (code != FL_OK) {
        fl_raise(code, err, "arming the parent-death watch");
        goto fail_py;
    }
    w->main_pidfd = fl_pidfd_open(w->main_pid, &err);
    return (PyObject *)w;
fail_py:
    Py_DECREF(w);
    return NULL;
}

static void
workerchan_dealloc(WorkerChannelObject *w)
{
    PyTypeObject *tp = Py_TYPE(w);
    if (w->arena)
        munmap(w->arena, w->arena_size);
    if (w->arena_fd >= 0)
        close(w->arena_fd);
    PyMem_RawFree(w->busy);
    PyMem_RawFree(w->reserved);
    if (w->ctl) {
        fl_worker_disarm(w->ctl);
        munmap(w->ctl, w->ctl_size);
    }
    if (w->main_pidfd >= 0)
        close(w->main_pidfd);
    tp->tp_free(w);
    Py_DECREF(tp);
}

static int
main_gone(WorkerChannelObject *w)
{
    return fl_proc_dead(w->main_pid, w->main_pidfd);
}

static void
drain_frees(WorkerChannelObject *w)
{
    uint64_t v;
    while (fl_free_pop(&w->ring, &v) > 0) {
        uint32_t gen = (uint32_t)(v >> 32), slot = (uint32_t)v;
        if (gen == w->gen && w->busy != NULL && slot < w->nslots)
            w->busy[slot] = 0;
    }
}

/* A persistent worker whose epoch has been over this long (the main process says
 * so: ctl's between_epochs) while it waits for a task (a validation loop, a
 * checkpoint, the rest of training) gives back the pages of every free slot, and
 * of each slot freed later while it still waits: its ring then holds no memory
 * between epochs, as torch's workers hold no shared memory then. The next epoch
 * reserves and faults those pages in again (~50 ms for 2 workers' slots of 9 MiB
 * image batches, 55 MiB; in the main process too, whose mapping lost them), so a
 * short pause keeps them: a release after 1 s slowed an epoch started 1.5 s after
 * the last from 63 to 116 ms. Never within an epoch, however slow the consumer:
 * there each batch would pay those faults (found by review). */
#define FL_IDLE_RELEASE_NS (5000ull * 1000 * 1000)

static void
release_idle_slots(WorkerChannelObject *w)
{
    if (w->arena == NULL || w->reserved == NULL)
        return;
    for (uint32_t i = 0; i < w->nslots; i++) {
        size_t have = w->reserved[i];
        if (w->busy[i] || have == 0)
            continue;
        if (fl_shm_release(w->arena_fd, (size_t)i * w->slot_size, have) < 0)
            continue;
        w->reserved[i] = 0;
        atomic_fetch_sub(&w->ctl->arena_reserved, have);
    }
}

static PyObject *
task_to_python(const fl_task_hdr *h, const uint8_t *p)
{
    int64_t v;
    switch (h->kind) {
    case FL_TASK_INDEX:
        if (h->payload_len != 8)
            break;
        memcpy(&v, p, 8);
        return PyLong_FromLongLong(v);
    case FL_TASK_NONES: {
        if (h->payload_len != 8)
            break;
        memcpy(&v, p, 8);
        if (v < 0 || v > (1 << 30))
            break;
        PyObject *l = PyList_New((Py_ssize_t)v);
        if (l == NULL)
            return NULL;
        for (int64_t i = 0; i < v; i++)
            PyList_SET_ITEM(l, i, Py_NewRef(Py_None));
        return l;
    }
    case FL_TASK_INDICES: {
        if (h->payload_len % 8)
            break;
        Py_ssize_t n = (Py_ssize_t)(h->payload_len / 8);
        PyObject *l = PyList_New(n);
        if (l == NULL)
            return NULL;
        for (Py_ssize_t i = 0; i < n; i++) {
            memcpy(&v, p + 8 * i, 8);
            PyObject *x = PyLong_FromLongLong(v);
            if (x == NULL) {
                Py_DECREF(l);
                return NULL;
            }
            PyList_SET_ITEM(l, i, x);
        }
        return l;
    }
    case FL_TASK_PICKLE:
        return PyBytes_FromStringAndSize((const char *)p, (Py_ssize_t)h->payload_len);
    case FL_TASK_RESUME:
    case FL_TASK_SHUTDOWN:
    case FL_TASK_CONTROL:
        return PyBytes_FromStringAndSize((const char *)p, (Py_ssize_t)h->payload_len);
    default:
        break;
    }
    return fl_raise(FL_CORRUPT, 0, "reading a task");
}

PyDoc_STRVAR(workerchan_get_task_doc,
"get_task($self)\n--\n\nReturns (kind, seq, index) or None.\n"
"Wait for the next task (GIL released). None: the main process is gone.");

/* (for fl_spin_wait) a task, or a corrupt ring, is there to read */
static int
task_ready(void *ring)
{
    fl_task_hdr h;
    const uint8_t *p;
    return fl_task_peek((const fl_ring *)ring, &h, &p) != 0;
}

static PyObject *
workerchan_get_task(WorkerChannelObject *w, PyObject *Py_UNUSED(ignored))
{
    uint64_t entered = fl_now_ns(), over_since = 0;
    if (w->last_task_ns)
        atomic_fetch_add_explicit(&w->ctl->busy_ns, entered - w->last_task_ns,
                                  memory_order_relaxed);
    for (;;) {
        fl_task_hdr h;
        const uint8_t *p;
        if (atomic_load_explicit(&w->ctl->stop, memory_order_relaxed)) {
            /* told to stop: what is queued is not ours to build (and where the
             * SHUTDOWN task found no room, this ends the wait: polls time out) */
            w->last_task_ns = fl_now_ns();
            return Py_BuildValue("(iiy)", FL_TASK_SHUTDOWN, -1, "");
        }
        int got = fl_task_peek(&w->ring, &h, &p);
        if (got < 0)
            return fl_raise(FL_CORRUPT, 0, "reading the task ring");
        if (got) {
            PyObject *idx = task_to_python(&h, p);
            fl_task_pop(&w->ring, &h);
            w->last_task_ns = fl_now_ns();
            atomic_fetch_add_explicit(&w->ctl->idle_ns, w->last_task_ns - entered,
                                      memory_order_relaxed);
            if (idx == NULL)
                return NULL;
            return Py_BuildValue("(ILN)", (unsigned)h.kind, (long long)h.seq, idx);
        }
        drain_frees(w);
        /* the wait counts from the epoch's end, not from this worker's last task:
         * behind a slow loop the workers wait long before it (found by review) */
        if (!atomic_load_explicit(&w->ctl->between_epochs, memory_order_relaxed))
            over_since = 0;
        else if (over_since == 0)
            over_since = fl_now_ns();
        else if (fl_now_ns() - over_since >= FL_IDLE_RELEASE_NS)
            release_idle_slots(w);
        int spun;
        Py_BEGIN_ALLOW_THREADS
        spun = fl_spin_wait(&w->spin, FL_SPIN_MAX_NS, task_ready, &w->ring);
        Py_END_ALLOW_THREADS
        if (spun)
            continue;
        atomic_store(&w->ctl->worker_waiting, 1);
        /* pairs with fl_wake's fence: the flag's store is ordered before the
         * ring's re-check even where an acquire load could pass a store */
        atomic_thread_fence(memory_order_seq_cst);
        got = fl_task_peek(&w->ring, &h, &p);
        if (got != 0) {
            atomic_store(&w->ctl->worker_waiting, 0);
            continue;
        }
        fl_worker_watch_retry();
        struct pollfd pf[2] = {{.fd = w->efd_worker, .events = POLLIN},
                               {.fd = w->main_pidfd, .events = POLLIN}};
        int rc, saved;
        Py_BEGIN_ALLOW_THREADS
        rc = poll(pf, 2, 200);
        saved = errno;
        Py_END_ALLOW_THREADS
        atomic_store(&w->ctl->worker_waiting, 0);
        if (rc < 0 && saved != EINTR)
            return fl_raise(FL_ERRNO, saved, "waiting for a task");
        if (rc > 0 && (pf[0].revents & POLLIN))
            fl_drain_efd(w->efd_worker);
        if ((rc > 0 && pf[1].revents) || (w->main_pidfd < 0 && main_gone(w)))
            Py_RETURN_NONE;
        if (PyErr_CheckSignals() < 0)
            return NULL;
    }
}

/* The current arena is going away: its fd is closed, and if the main process was
 * never told of it, its name (never to be opened) is removed. */
static void
drop_arena_handles(WorkerChannelObject *w)
{
    if (w->arena_fd >= 0) {
        close(w->arena_fd);
        w->arena_fd = -1;
    }
    if (w->strategy == FL_STRATEGY_FS && w->arena_name[0] && !w->arena_announced)
        shm_unlink(w->arena_name);
    w->arena_name[0] = '\0';
}

/* Make (or replace) the arena so that a batch of `need` bytes fits a slot.
 * Only its size is set here: no slot is reserved until a batch needs it
 * (reserve_slot), so the memory an arena takes is what was in flight at once,
 * not slots x slot size. The main process learns of it with the first batch
 * placed in it (the fd travels then, see send_seg_fd), so nothing here can leave
 * it a stray fd. */
static int
new_arena(WorkerChannelObject *w, size_t need, int *err)
{
    size_t slot = FL_ALIGN_UP(need + need / 4 + 4096, FL_SLOT_GRAIN);
    uint32_t nslots = w->nslots_target;
    if (slot > FL_ARENA_MAX / 2)
        return FL_FULL;
    while ((size_t)nslots * slot > FL_ARENA_MAX && nslots > 2)
        nslots--;
    size_t size = slot * nslots;
    int fs = w->strategy == FL_STRATEGY_FS;
    uint8_t *busy = PyMem_RawCalloc(nslots, 1);
    size_t *reserved = PyMem_RawCalloc(nslots, sizeof(size_t));
    if (busy == NULL || reserved == NULL) {
        PyMem_RawFree(busy);
        PyMem_RawFree(reserved);
        return FL_NOMEM;
    }
    if (fs && fl_worker_begin_create() < 0) {
        PyMem_RawFree(busy);
        PyMem_RawFree(reserved);
        *err = ESRCH;   /* the main process is gone */
        return FL_ERRNO;
    }
    uint64_t id = atomic_fetch_add(&w->ctl->next_seg_id, 1);
    char name[FL_NAME_MAX] = "";
    fl_shm_ident ident = {0, 0, 0};
    int fd = -1, code;
    void *addr = NULL;
    if (fs)
        code = fl_shm_create_unique(w->prefix, 's', id, size, 0, name, &ident, &fd, err);
    else
        code = fl_shm_create(NULL, size, 0, &fd, err);
    if (fs)
        fl_worker_end_create();
    if (code != FL_OK)
        goto fail;
    code = fl_shm_map(fd, size, &addr, err);
    if (code == FL_OK && fl_test_fail_arena_setup > 0) {   /* test seam: the last step fails */
        fl_test_fail_arena_setup--;
        code = FL_NOMEM;
    }
    if (code != FL_OK)
        goto fail;
    /* nothing can fail from here on */
    drop_arena_handles(w);
    if (w->arena)
        munmap(w->arena, w->arena_size);   /* the main process keeps its own mapping */
    PyMem_RawFree(w->busy);
    PyMem_RawFree(w->reserved);
    w->busy = busy;
    w->reserved = reserved;
    w->arena = addr;
    w->arena_fd = fd;
    snprintf(w->arena_name, sizeof(w->arena_name), "%s", name);
    w->arena_token = ident.token;
    w->arena_dev = ident.dev;
    w->arena_ino = ident.ino;
    w->arena_announced = 0;
    w->arena_size = size;
    w->slot_size = slot;
    w->nslots = nslots;
    w->arena_seg = id;
    w->gen++;
    atomic_store(&w->ctl->arena_bytes, size);
    atomic_store(&w->ctl->arena_reserved, 0);
    return FL_OK;
fail:
    if (addr != NULL)
        munmap(addr, size);
    if (fd >= 0) {
        close(fd);
        if (fs && name[0])
            shm_unlink(name);
    }
    PyMem_RawFree(busy);
    PyMem_RawFree(reserved);
    return code;
}

/* Reserve the pages of slot `slot` that a batch of `need` bytes will write, so
 * that a full /dev/shm is an error here (the batch then goes to an overflow
 * segment, whose own failure is the MemoryError the user sees), never a SIGBUS
 * while encoding. A slot keeps what it reserved for the next batches. */
static int
reserve_slot(WorkerChannelObject *w, uint32_t slot, size_t need, int *err)
{
    size_t want = FL_ALIGN_UP(need, 4096);
    if (want > w->slot_size)
        want = w->slot_size;
    size_t have = w->reserved[slot];
    if (want <= have)
        return FL_OK;
    int code = fl_shm_reserve(w->arena_fd, (size_t)slot * w->slot_size + have, want - have, err);
    if (code != FL_OK)
        return code;
    w->reserved[slot] = want;
    atomic_fetch_add(&w->ctl->arena_reserved, want - have);
    return FL_OK;
}

/* A free slot keeps reserved what a typical batch needs, so that batches of about
 * one size reuse pages already there (no page faults, no zeroing: the ring's
 * point). One far larger than typical (an outlier batch, a bucket of long
 * samples) is given back once its slot is free and this worker publishes again:
 * kept, every slot that ever held a big batch would hold its memory for the
 * worker's life. The slot about to be written (`chosen`) keeps what its batch
 * needs too. Hysteresis (twice, plus FL_TRIM_SLACK) keeps batches that vary in
 * size from punching and refaulting the same pages batch after batch. */
#define FL_TRIM_SLACK ((size_t)1 << 20)

static void
trim_slots(WorkerChannelObject *w, uint32_t chosen, size_t need)
{
    w->typical = w->typical == 0 ? need : w->typical - w->typical / 8 + need / 8;
    size_t keep = FL_ALIGN_UP(w->typical, 4096);
    for (uint32_t i = 0; i < w->nslots; i++) {
        if (w->busy[i] && i != chosen)
            continue;
        size_t target = keep;
        if (i == chosen && FL_ALIGN_UP(need, 4096) > target)
            target = FL_ALIGN_UP(need, 4096);
        if (target > w->slot_size)
            target = w->slot_size;
        size_t have = w->reserved[i];
        if (have <= 2 * target + FL_TRIM_SLACK)
            continue;
        if (fl_shm_release(w->arena_fd, (size_t)i * w->slot_size + target, have - target) < 0)
            continue;
        w->reserved[i] = target;
        atomic_fetch_sub(&w->ctl->arena_reserved, have - target);
    }
}

/* file_descriptor strategy: send a segment's fd right before the result that
 * names it, once nothing can fail between the two (the result has room), so the
 * main process always pairs an fd with its own result. */
static int
send_seg_fd(WorkerChannelObject *w, int fd, uint64_t id, uint64_t size, int *err)
{
    if (!fl_res_has_room(&w->ring))
        return FL_FULL;
    fl_fdmsg m = {id, size};
    return fl_send_fd(w->sock, fd, &m, err);
}

static int
make_overflow(WorkerChannelObject *w, size_t need, uint8_t **addr, size_t *size, uint64_t *id,
              int *fd, char *name, fl_shm_ident *ident, int *err)
{
    int fs = w->strategy == FL_STRATEGY_FS;
    *size = FL_ALIGN_UP(need, 4096);
    if (fs && fl_worker_begin_create() < 0) {
        *err = ESRCH;   /* the main process is gone */
        return FL_ERRNO;
    }
    *id = atomic_fetch_add(&w->ctl->next_seg_id, 1);
    int code;
    if (fs)
        code = fl_shm_create_unique(w->prefix, 's', *id, *size, *size, name, ident, fd, err);
    else
        code = fl_shm_create(NULL, *size, *size, fd, err);
    if (fs)
        fl_worker_end_create();
    if (code != FL_OK)
        return code;
    void *p;
    code = fl_shm_map(*fd, *size, &p, err);
    if (code != FL_OK) {
        close(*fd);
        *fd = -1;
        if (fs)
            shm_unlink(name);
        name[0] = '\0';
        return code;
    }
    *addr = p;
    return FL_OK;
}

static int
push_result(WorkerChannelObject *w, const fl_result *r)
{
    int code = fl_res_push(&w->ring, r);
    if (code != FL_OK)
        return code;
    if (fl_wake(&w->ctl->main_waiting, w->efd_main))
        atomic_fetch_add_explicit(&w->ctl->main_wakeups, 1, memory_order_relaxed);
    return FL_OK;
}

PyDoc_STRVAR(workerchan_publish_doc,
"publish($self, kind, seq, obj=None)\n--\n\n"
"Encode obj into a ring slot (or an overflow segment) and hand it to the main\n"
"process. With obj None and kind not a batch, sends a bare notification.");

static PyObject *
workerchan_publish(WorkerChannelObject *w, PyObject *args)
{
    unsigned int kind;
    long long seq;
    PyObject *obj = NULL;
    if (!PyArg_ParseTuple(args, "IL|O", &kind, &seq, &obj))
        return NULL;
    fl_state *st = fl_state_of_type(Py_TYPE(w));
    fl_result r;
    memset(&r, 0, sizeof(r));
    r.seq = seq;
    r.kind = kind;
    if (obj == NULL) {
        r.where = FL_WHERE_NONE;
        int code = push_result(w, &r);
        if (code != FL_OK)
            return fl_raise(code, 0, "publishing a result");
        Py_RETURN_NONE;
    }
    fl_plan *plan = fl_plan_new();
    int err = 0, code = FL_OK, ovf_fd = -1;
    uint8_t *ovf = NULL;
    size_t ovf_size = 0;
    uint64_t ovf_id = 0;
    char ovf_name[FL_NAME_MAX] = "";
    fl_shm_ident ovf_ident = {0, 0, 0};
    int pushed = 0;
    PyObject *ret = NULL;
    if (plan == NULL)
        return NULL;
    if (fl_plan_build(st, plan, obj) < 0)
        goto done;
    size_t need = fl_plan_size(plan);
    drain_frees(w);
    if (w->arena == NULL || need > w->slot_size) {
        /* Whatever went wrong (too big for any arena, no memory for a whole arena),
         * this batch still gets a segment of its own size below, and a failure
         * there is what the user sees. */
        (void)new_arena(w, need, &err);
    }
    uint32_t slot = UINT32_MAX;
    if (w->arena != NULL && need <= w->slot_size) {
        for (uint32_t i = 0; i < w->nslots; i++)
            if (!w->busy[i]) {
                slot = i;
                break;
            }
    }
    if (w->arena != NULL)
        trim_slots(w, slot, need);
    /* a slot whose pages cannot be reserved: this batch overflows */
    if (slot != UINT32_MAX && reserve_slot(w, slot, need, &err) != FL_OK)
        slot = UINT32_MAX;
    if (slot != UINT32_MAX) {
        if (fl_plan_write(st, plan, w->arena + (size_t)slot * w->slot_size, w->slot_size) < 0)
            goto done;
        r.where = FL_WHERE_SLOT;
        r.gen = w->gen;
        r.slot = slot;
        r.seg = w->arena_seg;
        r.slot_size = w->slot_size;
        r.nslots = w->nslots;
        r.token = w->arena_token;
        r.dev = w->arena_dev;
        r.ino = w->arena_ino;
        if (!w->arena_announced && w->strategy == FL_STRATEGY_FD) {
            code = send_seg_fd(w, w->arena_fd, w->arena_seg, w->arena_size, &err);
            if (code != FL_OK) {
                fl_raise(code, err, "sending a ring arena");
                goto done;
            }
        }
    }
    else {
        code = make_overflow(w, need, &ovf, &ovf_size, &ovf_id, &ovf_fd, ovf_name, &ovf_ident,
                             &err);
        if (code != FL_OK) {
            char what[96];
            snprintf(what, sizeof(what), "creating a %zu-byte overflow segment", ovf_size);
            fl_raise(code, err, what);
            goto done;
        }
        if (fl_plan_write(st, plan, ovf, ovf_size) < 0)
            goto done;
        if (w->strategy == FL_STRATEGY_FD) {
            code = send_seg_fd(w, ovf_fd, ovf_id, ovf_size, &err);
            if (code != FL_OK) {
                fl_raise(code, err, "sending an overflow segment");
                goto done;
            }
        }
        r.where = FL_WHERE_OVERFLOW;
        r.seg = ovf_id;
        r.token = ovf_ident.token;
        r.dev = ovf_ident.dev;
        r.ino = ovf_ident.ino;
    }
    r.nbytes = need;
    /* counted before the push, so that whoever sees the batch sees it counted */
    atomic_fetch_add_explicit(&w->ctl->published, 1, memory_order_relaxed);
    code = push_result(w, &r);
    if (code != FL_OK) {
        atomic_fetch_sub_explicit(&w->ctl->published, 1, memory_order_relaxed);
        fl_raise(code, 0, "publishing a result");
        goto done;
    }
    pushed = 1;
    if (slot != UINT32_MAX) {
        w->busy[slot] = 1;
        w->arena_announced = 1;
    }
    else {
        atomic_fetch_add_explicit(&w->ctl->overflowed, 1, memory_order_relaxed);
    }
    ret = Py_NewRef(Py_None);
done:
    if (ovf != NULL)
        munmap(ovf, ovf_size);
    if (ovf_fd >= 0)
        close(ovf_fd);
    if (!pushed && ovf_name[0])
        shm_unlink(ovf_name);   /* never announced: nobody else will open it */
    fl_plan_free(plan);
    return ret;
}

/* The worker leaves its loop, whichever way. Results it published stay: the main
 * process still opens them (and removes what it never opened when it closes the
 * channel). Only if the main process is gone is everything removed here. */
static PyObject *
workerchan_cleanup(WorkerChannelObject *w, PyObject *Py_UNUSED(ignored))
{
    drop_arena_handles(w);
    if (main_gone(w))
        fl_worker_unlink_pending();
    Py_RETURN_NONE;
}

PyDoc_STRVAR(workerchan_test_hook_doc,
"_test_hook(name, value)\n--\n\n"
"Test seam (this process only): 'name_tokens' (a list of ints) are the next\n"
"segment name tokens, before random ones; 'fail_arena_setup' (an int) ring arena\n"
"set-ups fail at their last step as if memory ran out.");

static PyObject *
workerchan_test_hook(PyObject *Py_UNUSED(cls), PyObject *args)
{
    const char *name;
    PyObject *value;
    if (!PyArg_ParseTuple(args, "sO", &name, &value))
        return NULL;
    if (strcmp(name, "fail_arena_setup") == 0) {
        int n = (int)PyLong_AsLong(value);
        if (n == -1 && PyErr_Occurred())
            return NULL;
        fl_test_fail_arena_setup = n;
        Py_RETURN_NONE;
    }
    if (strcmp(name, "name_tokens") == 0) {
        uint64_t tokens[8];
        PyObject *seq = PySequence_Fast(value, "name_tokens: a sequence of ints");
        if (seq == NULL)
            return NULL;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        if (n > 8)
            n = 8;
        for (Py_ssize_t i = 0; i < n; i++) {
            tokens[i] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(seq, i));
            if (PyErr_Occurred()) {
                Py_DECREF(seq);
                return NULL;
            }
        }
        Py_DECREF(seq);
        fl_shm_test_tokens(tokens, (size_t)n);
        Py_RETURN_NONE;
    }
    return PyErr_Format(PyExc_ValueError, "_test_hook: unknown name %s", name);
}

static PyMethodDef workerchan_methods[] = {
    {"get_task", (PyCFunction)workerchan_get_task, METH_NOARGS, workerchan_get_task_doc},
    {"publish", (PyCFunction)workerchan_publish, METH_VARARGS, workerchan_publish_doc},
    {"cleanup", (PyCFunction)workerchan_cleanup, METH_NOARGS,
     PyDoc_STR("cleanup(): the worker leaves; if the main process is gone, remove its "
               "named segments")},
    {"_test_hook", (PyCFunction)workerchan_test_hook, METH_VARARGS | METH_STATIC,
     workerchan_test_hook_doc},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot workerchan_slots[] = {
    {Py_tp_new, workerchan_new},
    {Py_tp_dealloc, workerchan_dealloc},
    {Py_tp_methods, workerchan_methods},
    {Py_tp_doc, (void *)PyDoc_STR(
         "WorkerChannel(handle, ctl_fd, efd_main, efd_worker, sock, nslots)\n--\n\n"
         "A worker's end of its shared-memory rings.")},
    {0, NULL},
};

static PyType_Spec fl_worker_channel_spec = {
    .name = "fastloader._core.WorkerChannel",
    .basicsize = sizeof(WorkerChannelObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = workerchan_slots,
};

int
fl_worker_channel_init(PyObject *module, fl_state *st)
{
    return fl_add_type(module, &fl_worker_channel_spec, &st->WorkerChannelType);
}
