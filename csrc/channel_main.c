/* MainChannel: the main process's end of one worker. It creates the control
 * block, sends tasks, receives results (mapping the worker's arenas and overflow
 * segments as they are announced) and decodes batches into views of the slots.
 * Waiting on every worker at once is recv.c's job. */
#define _GNU_SOURCE
#define NO_IMPORT_ARRAY
#define PY_ARRAY_UNIQUE_SYMBOL fastloader_ARRAY_API
#include "objects.h"
#include "protocol.h"
#include "codec.h"
#include "liveness.h"
#include "shm_names.h"
#include "shm.h"
#include "self_pid.h"
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

static void
close_fd(int *fd)
{
    if (*fd >= 0) {
        close(*fd);
        *fd = -1;
    }
}

/* The task ring is sized for the largest task a loader may send (a pickled batch of
 * arbitrary indices), but a loader's tasks are usually a few hundred bytes: only
 * this much of it is reserved when the block is made (reserving the whole 1 MiB
 * ring cost each worker's start ~0.4 ms, on the path of every short epoch). The
 * rest is reserved as the tasks written first reach it (reserve_tasks). */
#define FL_TASK_CHUNK ((size_t)64 << 10)
/* room past a record's payload: its 32-byte rounding and the next record's header
 * (a ring-end pad record is written where the last record ended) */
#define FL_TASK_SLACK ((size_t)64)

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23   /* Linux 5.14; older kernels answer EINVAL */
#endif

/* The steps the block is reserved in: whole pages (madvise wants a page-aligned
 * start; pages are 16 or 64 KiB on some arm64 and ppc64 kernels). */
static size_t
reserve_step(void)
{
    long page = sysconf(_SC_PAGESIZE);
    return page > 0 && (size_t)page > FL_TASK_CHUNK ? (size_t)page : FL_TASK_CHUNK;
}

/* How far the block is reserved once `end` (bytes from its start) is. */
static size_t
reserve_target(const MainChannelObject *c, size_t end)
{
    size_t want = FL_ALIGN_UP(end, reserve_step());
    return want > c->ctl_size ? c->ctl_size : want;
}

/* Reserve the block's pages up to `end`. Without the fd (closed once the worker
 * started): a populating write-fault fails with an error where a first touch of
 * a page tmpfs cannot back would be a SIGBUS. 0 or an errno. */
static int
reserve_ctl_to(MainChannelObject *c, size_t end)
{
    if (end <= c->ctl_reserved)
        return 0;
    size_t want = reserve_target(c, end);
    int rc;
    do {
        rc = madvise((uint8_t *)c->ctl + c->ctl_reserved, want - c->ctl_reserved,
                     MADV_POPULATE_WRITE);
    } while (rc < 0 && errno == EINTR);
    if (rc < 0)
        return errno == EFAULT ? ENOSPC : errno;   /* EFAULT: a page tmpfs cannot back */
    c->ctl_reserved = want;
    return 0;
}

/* Before committing the task whose payload fl_task_reserve placed at `p`: make
 * sure its record (and the next header) lies in reserved pages. -1 with the
 * Python error set if they cannot be: the task is not committed (the iterator
 * then raises it in that batch's turn). */
static int
reserve_tasks(MainChannelObject *c, const uint8_t *p, uint64_t payload_len)
{
    size_t end = (size_t)(p - (const uint8_t *)c->ctl) + (size_t)payload_len + FL_TASK_SLACK;
    int err = reserve_ctl_to(c, end);
    if (err == 0)
        return 0;
    char what[96];
    snprintf(what, sizeof(what), "reserving %zu bytes of the task ring",
             reserve_target(c, end) - c->ctl_reserved);
    fl_raise(FL_ERRNO, err, what);
    return -1;
}

/* fl_task_reserve, then reserve_tasks: FL_OK, fl_task_reserve's code, or FL_ERRNO
 * with the Python error set (the record's pages cannot be reserved). */
static int
task_room(MainChannelObject *c, uint64_t payload_len, uint8_t **p)
{
    int code = fl_task_reserve(&c->ring, payload_len, p);
    if (code == FL_OK && reserve_tasks(c, *p, payload_len) < 0)
        return FL_ERRNO;
    return code;
}

/* The largest task ring: a padding record's 32-bit length spans up to all of it. */
#define FL_TASK_CAP_MAX ((unsigned long long)1 << 30)

/* Whether this kernel populates (and so reserves) shared pages on request
 * (MADV_POPULATE_WRITE, Linux 5.14), probed once on a page of our own. */
static int
populate_write_works(void)
{
    static int cached = -1;
    if (cached < 0) {
        void *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        cached = p != MAP_FAILED && madvise(p, 4096, MADV_POPULATE_WRITE) == 0;
        if (p != MAP_FAILED)
            munmap(p, 4096);
    }
    return cached;
}

static uint64_t
next_pow2(uint64_t v)
{
    uint64_t p = 1;
    while (p < v)
        p <<= 1;
    return p;
}

static PyObject *
mainchan_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"worker_id", "strategy", "prefix", "task_capacity",
                             "result_capacity", "task_window", NULL};
    int wid, strategy;
    const char *prefix;
    unsigned long long task_cap, task_window = 0;
    unsigned int res_cap;
    int err = 0, code = FL_OK;
    const char *what = "creating the control block";
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iisKI|K", kwlist, &wid, &strategy, &prefix,
                                     &task_cap, &res_cap, &task_window))
        return NULL;
    if (strlen(prefix) >= 180) {
        PyErr_SetString(PyExc_ValueError, "fastloader: segment prefix too long");
        return NULL;
    }
    MainChannelObject *c = (MainChannelObject *)type->tp_alloc(type, 0);
    if (c == NULL)
        return NULL;
    c->ctl_fd = c->efd_main = c->efd_worker = c->sock_main = c->sock_worker = c->pidfd = -1;
    c->worker_id = wid;
    c->strategy = strategy;
    c->owner_pid = fl_self_pid();
    c->watch = 1;
    snprintf(c->prefix, sizeof(c->prefix), "%s-w%d", prefix, wid);

    /* a padding record's length is 32-bit */
    task_cap = next_pow2(task_cap < 4096 ? 4096 : task_cap > FL_TASK_CAP_MAX ? FL_TASK_CAP_MAX
                                                                            : task_cap);
    task_window = task_window == 0                  ? task_cap
                  : task_window > FL_TASK_CAP_MAX ? FL_TASK_CAP_MAX
                                                  : next_pow2(task_window < 4096 ? 4096 : task_window);
    /* Beyond its window the ring is only address space while its pages can be
     * reserved as records first reach them; where they cannot, the whole ring
     * is reserved below, so it is no larger than the window. */
    if (task_window > task_cap || !populate_write_works())
        task_cap = task_window;
    res_cap = (uint32_t)next_pow2(res_cap < 8 ? 8 : res_cap);
    uint32_t free_cap = 4096;
    char ctl_what[96];
    size_t upfront;
    if (fl_fork_guard_install() < 0)
        goto fail_py;
    for (;;) {
        c->ctl_size = fl_ctl_layout(task_cap, res_cap, free_cap);
        /* reserved now: the header, the result and free rings and the task ring's
         * first chunk (a full /dev/shm is a MemoryError here, not a SIGBUS when they
         * are first written); the rest of the task ring as tasks reach it
         * (reserve_tasks) */
        upfront = reserve_target(c, fl_ctl_task_off(res_cap, free_cap) + FL_TASK_CHUNK);
        snprintf(ctl_what, sizeof(ctl_what), "creating a %zu-byte control block", c->ctl_size);
        what = ctl_what;
        if (strategy == FL_STRATEGY_FS) {
            fl_shm_ident ident = {0, 0, 0};
            code = fl_shm_create_unique(c->prefix, 'c', 0, c->ctl_size, upfront, c->ctl_name,
                                        &ident, &c->ctl_fd, &err);
            c->ctl_dev = ident.dev;
            c->ctl_ino = ident.ino;
        }
        else {
            code = fl_shm_create(NULL, c->ctl_size, upfront, &c->ctl_fd, &err);
        }
        /* a file-size limit (RLIMIT_FSIZE) below the ring's address space: the
         * ring is its window alone, as where pages cannot be reserved lazily */
        if (code == FL_ERRNO && err == EFBIG && task_cap > task_window) {
            task_cap = task_window;
            continue;
        }
        break;
    }
    if (code != FL_OK) {
        fl_raise_path(code, err, what, c->ctl_name[0] ? c->ctl_name : NULL);
        c->ctl_name[0] = '\0';   /* not ours (EEXIST) or already removed: never unlink it */
        goto fail_py;
    }
    void *addr;
    code = fl_shm_map(c->ctl_fd, c->ctl_size, &addr, &err);
    if (code != FL_OK)
        goto fail;
    c->ctl = addr;
    fl_shm_dontfork(addr, c->ctl_size);   /* workers map it themselves */
    c->ctl_reserved = upfront;
    /* a kernel without MADV_POPULATE_WRITE (before 5.14): the whole ring now, while
     * the fd is open, as before */
    if (upfront < c->ctl_size && madvise(addr, 4096, MADV_POPULATE_WRITE) < 0) {
        code = fl_shm_reserve(c->ctl_fd, upfront, c->ctl_size - upfront, &err);
        if (code != FL_OK)
            goto fail;
        c->ctl_reserved = c->ctl_size;
    }
    fl_ctl_init(&c->ring, c->ctl, (uint32_t)wid, task_cap, task_window, res_cap, free_cap);
    if (strategy == FL_STRATEGY_FS)
        close_fd(&c->ctl_fd);   /* the worker opens it by name */

    what = "creating eventfds";
    c->efd_main = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    c->efd_worker = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (c->efd_main < 0 || c->efd_worker < 0) {
        err = errno;
        code = FL_ERRNO;
        goto fail;
    }
    if (strategy == FL_STRATEGY_FD) {
        int sv[2];
        what = "creating the fd-passing socket";
        if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0) {
            err = errno;
            code = FL_ERRNO;
            goto fail;
        }
        c->sock_main = sv[0];
        c->sock_worker = sv[1];
    }
    return (PyObject *)c;
fail:
    fl_raise(code, err, what);
fail_py:
    Py_DECREF(c);
    return NULL;
}

static void
unlink_named(MainChannelObject *c)
{
    if (c->strategy != FL_STRATEGY_FS)
        return;
    /* Whatever the worker made and the main process did not open yet (results
     * still queued, an arena never announced, a segment of a worker killed while
     * it made it, the control block if the worker never attached) starts with
     * this channel's prefix. The sweep removes only our own regular files: a name
     * another user planted with our prefix stays theirs. */
    c->ctl_name[0] = '\0';
    fl_shm_unlink_prefix(c->prefix);
}

/* Close every fd and remove named segments; the control block stays mapped until
 * the last batch that points at it is gone. */
static void
mainchan_close_impl(MainChannelObject *c)
{
    if (c->owner_pid != fl_self_pid())
        return;
    unlink_named(c);
    c->closed = 1;
    close_fd(&c->ctl_fd);
    close_fd(&c->efd_main);
    close_fd(&c->efd_worker);
    close_fd(&c->sock_main);
    close_fd(&c->sock_worker);
    close_fd(&c->pidfd);
    Py_CLEAR(c->arena);
}

static void
mainchan_dealloc(MainChannelObject *c)
{
    PyTypeObject *tp = Py_TYPE(c);
    PyObject_GC_UnTrack(c);
    mainchan_close_impl(c);
    if (c->ctl != NULL && c->owner_pid == fl_self_pid())
        munmap(c->ctl, c->ctl_size);
    c->ctl = NULL;
    tp->tp_free(c);
    Py_DECREF(tp);
}

static int
mainchan_traverse(MainChannelObject *c, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(c));
    Py_VISIT(c->arena);
    return 0;
}

static PyObject *
mainchan_close(MainChannelObject *c, PyObject *Py_UNUSED(ignored))
{
    mainchan_close_impl(c);
    Py_RETURN_NONE;
}

PyObject *
fl_mainchan_unusable(const MainChannelObject *c)
{
    if (!c->closed && c->owner_pid != fl_self_pid())
        return PyErr_Format(PyExc_ValueError,
                            "fastloader: this DataLoader iterator's workers serve process %d, "
                            "which this process was forked from: a forked child cannot take "
                            "their batches (call iter(loader) in the child: it starts workers "
                            "of its own)",
                            (int)c->owner_pid);
    return PyErr_Format(PyExc_ValueError, "fastloader: channel is closed");
}

static PyObject *
mainchan_handle(MainChannelObject *c, PyObject *Py_UNUSED(ignored))
{
    if (c->closed)
        return PyErr_Format(PyExc_ValueError, "fastloader: channel is closed");
    return Py_BuildValue("{s:i,s:i,s:i,s:n,s:s,s:K,s:K,s:s,s:i,s:i,s:i,s:i}", "worker_id",
                         c->worker_id, "strategy", c->strategy, "ctl_fd", c->ctl_fd,
                         "ctl_size", (Py_ssize_t)c->ctl_size, "ctl_name", c->ctl_name,
                         "ctl_dev", (unsigned long long)c->ctl_dev, "ctl_ino",
                         (unsigned long long)c->ctl_ino, "prefix", c->prefix, "efd_main",
                         c->efd_main, "efd_worker", c->efd_worker, "sock", c->sock_worker,
                         "main_pid", (int)c->owner_pid);
}

PyDoc_STRVAR(mainchan_started_doc,
"started($self, pid)\n--\n\n"
"Record the worker's pid, open a pidfd on it and close the fds only the child needed.");

static PyObject *
mainchan_started(MainChannelObject *c, PyObject *arg)
{
    long pid = PyLong_AsLong(arg);
    int err = 0;
    if (pid == -1 && PyErr_Occurred())
        return NULL;
    c->pid = (pid_t)pid;
    close_fd(&c->pidfd);
    c->pidfd = fl_pidfd_open(c->pid, &err);  /* -1: fall back to polling the pid */
    close_fd(&c->ctl_fd);
    close_fd(&c->sock_worker);
    Py_RETURN_NONE;
}

static PyObject *
mainchan_main_fds(MainChannelObject *c, PyObject *Py_UNUSED(ignored))
{
    return Py_BuildValue("(iiii)", c->sock_main, c->pidfd, c->efd_main, c->efd_worker);
}

static int
wake_worker(MainChannelObject *c)
{
    c->n_wakeups += (uint64_t)fl_wake(&c->ctl->worker_waiting, c->efd_worker);
    return 0;
}

/* 1 and *out set if `o` is an int within int64; 0 if not (no exception left). */
static int
as_int64(PyObject *o, long long *out)
{
    int ovf = 0;
    long long v = o != NULL && PyLong_Check(o) ? PyLong_AsLongLongAndOverflow(o, &ovf) : -1;
    if (o == NULL || !PyLong_Check(o) || ovf || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    *out = v;
    return 1;
}

/* A range (python/fastloader/index_batches.py) is written exactly as the list of
 * its ints would be, so the worker receives that list; no int object is made per
 * index. A range the ring cannot take as such (ends outside int64, too long, or
 * empty) answers False: the caller then pickles the list. */
static PyObject *
put_range(MainChannelObject *c, long long seq, PyObject *range)
{
    Py_ssize_t n = PyObject_Size(range);
    if (n <= 0) {
        PyErr_Clear();   /* a length beyond Py_ssize_t raises OverflowError */
        Py_RETURN_FALSE;
    }
    /* unlike a list's, a range's length is not bounded by memory: n * 8 could wrap */
    if ((uint64_t)n > c->ring.task_cap / 8)
        Py_RETURN_FALSE;
    /* items, not the start/step attributes: a range computes an item for a
     * fraction of an attribute lookup's cost */
    PyObject *first_o = PySequence_GetItem(range, 0);
    PyObject *second_o = n > 1 ? PySequence_GetItem(range, 1) : NULL;
    PyObject *last_o = PySequence_GetItem(range, n - 1);
    long long first, second = 0, last;
    int fits = as_int64(first_o, &first) & (n == 1 || as_int64(second_o, &second)) &
               as_int64(last_o, &last);
    Py_XDECREF(first_o);
    Py_XDECREF(second_o);
    Py_XDECREF(last_o);
    uint8_t *p;
    int code = fits ? task_room(c, (uint64_t)n * 8, &p) : FL_FULL;
    if (code == FL_ERRNO)
        return NULL;
    if (code != FL_OK)
        Py_RETURN_FALSE;
    /* every item lies between the first and the last, so within int64. In
     * unsigned arithmetic (modulo 2^64) first + i * step is that item even where
     * the step or i * step alone would not fit an int64. */
    uint64_t step = (uint64_t)second - (uint64_t)first;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t v = (uint64_t)first + (uint64_t)i * step;   /* the int64's bits */
        memcpy(p + 8 * i, &v, 8);
    }
    fl_task_commit(&c->ring, FL_TASK_INDICES, seq, (uint64_t)n * 8);
    wake_worker(c);
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(mainchan_put_index_doc,
"put_index($self, seq, index)\n--\n\nReturns bool.\n"
"Queue a fetch task. Lists of ints, ranges, ints and lists of None travel as raw\n"
"int64s (a range as the list of its ints); returns False for any other index, and\n"
"when the ring has no room for it yet (the caller pickles it and offers it with\n"
"offer_task).");

static PyObject *
mainchan_put_index(MainChannelObject *c, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2)
        return PyErr_Format(PyExc_TypeError, "put_index(seq, index)");
    long long seq = PyLong_AsLongLong(args[0]);
    PyObject *idx = args[1];
    uint8_t *p;
    if (seq == -1 && PyErr_Occurred())
        return NULL;
    if (c->closed || c->owner_pid != fl_self_pid())
        return fl_mainchan_unusable(c);
    if (PyLong_CheckExact(idx)) {
        long long v;
        if (!as_int64(idx, &v))
            Py_RETURN_FALSE;   /* beyond int64: pickled */
        int code = task_room(c, 8, &p);
        if (code == FL_ERRNO)
            return NULL;
        if (code == FL_FULL)
            Py_RETURN_FALSE;   /* no room yet: the caller offers it again later */
        if (code != FL_OK)   /* FL_CORRUPT: what the worker left */
            return fl_raise(code, 0, "sending a task");
        memcpy(p, &v, 8);
        fl_task_commit(&c->ring, FL_TASK_INDEX, seq, 8);
        wake_worker(c);
        Py_RETURN_TRUE;
    }
    if (PyRange_Check(idx))
        return put_range(c, seq, idx);
    if (!PyList_CheckExact(idx))
        Py_RETURN_FALSE;
    Py_ssize_t n = PyList_GET_SIZE(idx);
    int all_none = n > 0, all_int = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyList_GET_ITEM(idx, i);
        all_none &= v == Py_None;
        all_int &= PyLong_CheckExact(v);
    }
    if (all_none) {
        int64_t cnt = n;
        int code = task_room(c, 8, &p);
        if (code == FL_ERRNO)
            return NULL;
        if (code == FL_FULL)
            Py_RETURN_FALSE;   /* no room yet: the caller offers it again later */
        if (code != FL_OK)   /* FL_CORRUPT: what the worker left */
            return fl_raise(code, 0, "sending a task");
        memcpy(p, &cnt, 8);
        fl_task_commit(&c->ring, FL_TASK_NONES, seq, 8);
        wake_worker(c);
        Py_RETURN_TRUE;
    }
    if (!all_int)
        Py_RETURN_FALSE;
    int code = task_room(c, (uint64_t)n * 8, &p);
    if (code == FL_ERRNO)
        return NULL;
    if (code != FL_OK)
        Py_RETURN_FALSE;   /* too large for the ring: the pickle path reports it */
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v;
        if (!as_int64(PyList_GET_ITEM(idx, i), &v))
            Py_RETURN_FALSE;   /* beyond int64: pickled; the reservation is not committed */
        memcpy(p + 8 * i, &v, 8);
    }
    fl_task_commit(&c->ring, FL_TASK_INDICES, seq, (uint64_t)n * 8);
    wake_worker(c);
    Py_RETURN_TRUE;
}

/* Queue a control or pickled task: 1 when queued, 0 when the ring has no room
 * for it now (with `may_wait`; otherwise that is an error too), -1 with the error
 * set, a ValueError for a task larger than the ring could ever take. */
static int
queue_task(MainChannelObject *c, PyObject *args, int may_wait)
{
    unsigned int kind;
    long long seq;
    Py_buffer buf = {0};
    uint8_t *p;
    if (!PyArg_ParseTuple(args, "IL|y*", &kind, &seq, &buf))
        return -1;
    int rc = -1;
    if (c->closed || c->owner_pid != fl_self_pid()) {
        (void)fl_mainchan_unusable(c);
        goto done;
    }
    if ((uint64_t)buf.len > fl_task_max_payload(&c->ring)) {
        PyErr_Format(PyExc_ValueError,
                     "fastloader: a task of %zd bytes does not fit the task ring "
                     "(at most %llu bytes); use a smaller batch of indices",
                     buf.len, (unsigned long long)fl_task_max_payload(&c->ring));
        goto done;
    }
    int code = task_room(c, (uint64_t)buf.len, &p);
    if (code == FL_ERRNO)
        goto done;
    if (code == FL_FULL && may_wait) {
        rc = 0;
        goto done;
    }
    if (code != FL_OK) {   /* FL_CORRUPT: what the worker left; or full */
        fl_raise(code, 0, "sending a task");
        goto done;
    }
    if (buf.len)
        memcpy(p, buf.buf, (size_t)buf.len);
    fl_task_commit(&c->ring, kind, seq, (uint64_t)buf.len);
    wake_worker(c);
    rc = 1;
done:
    PyBuffer_Release(&buf);
    return rc;
}

PyDoc_STRVAR(mainchan_put_task_doc,
"put_task($self, kind, seq, payload=b'')\n--\n\n"
"Queue a control or pickled task (payload: bytes-like); raises if there is no room.");

static PyObject *
mainchan_put_task(MainChannelObject *c, PyObject *args)
{
    if (queue_task(c, args, 0) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(mainchan_stop_doc,
"stop($self)\n--\n\n"
"Tell the worker to take no more tasks: the next one it would take reads as\n"
"TASK_SHUTDOWN, and what is queued behind it is skipped (a batch being built is\n"
"finished). Put a TASK_SHUTDOWN after it to wake a worker that waits.");

static PyObject *
mainchan_stop(MainChannelObject *c, PyObject *Py_UNUSED(ignored))
{
    if (!c->closed && c->ctl != NULL && c->owner_pid == fl_self_pid())
        atomic_store_explicit(&c->ctl->stop, 1, memory_order_relaxed);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(mainchan_between_epochs_doc,
"between_epochs($self, over)\n--\n\n"
"Tell a persistent worker whether its epoch is over (True once the iterator ended\n"
"it, False before the next epoch's TASK_RESUME): one idle long enough between\n"
"epochs gives its free slots' pages back.");

static PyObject *
mainchan_between_epochs(MainChannelObject *c, PyObject *over)
{
    int flag = PyObject_IsTrue(over);
    if (flag < 0)
        return NULL;
    if (!c->closed && c->ctl != NULL && c->owner_pid == fl_self_pid())
        atomic_store_explicit(&c->ctl->between_epochs, (uint32_t)flag, memory_order_relaxed);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(mainchan_offer_task_doc,
"offer_task($self, kind, seq, payload=b'')\n--\n\n"
"put_task, but returns False instead of raising when the ring has no room for the\n"
"task until the worker reads the tasks before it; True when queued.");

static PyObject *
mainchan_offer_task(MainChannelObject *c, PyObject *args)
{
    int rc = queue_task(c, args, 1);
    if (rc < 0)
        return NULL;
    return PyBool_FromLong(rc);
}

/* ---- receiving ---- */

/* Map the segment a result announces. Under file_system the name is opened only to
 * find the very file the worker made: anything else (planted by another user, a
 * link, the wrong inode) is refused before a byte of it is read, and `what` names it. */
static int
map_segment(MainChannelObject *c, const fl_result *r, uint64_t size, void **addr, int *err,
            char *what, size_t what_len)
{
    int fd = -1, code;
    char name[FL_NAME_MAX] = "";
    if (c->strategy == FL_STRATEGY_FD) {
        fl_fdmsg m;
        code = fl_recv_fd(c->sock_main, &fd, &m, err);
        if (code != FL_OK)
            return code;
        if (m.seg_id != r->seg || m.size != size) {
            close(fd);
            return FL_CORRUPT;
        }
        /* unsealed, a same-uid process holding the fd could shrink it under our
           mapping: every access would then be a SIGBUS */
        int seals = fcntl(fd, F_GET_SEALS);
        struct stat sb;
        if (seals < 0 || (seals & FL_SEG_SEALS) != FL_SEG_SEALS || fstat(fd, &sb) < 0 ||
            (uint64_t)sb.st_size < size) {
            close(fd);
            return FL_CORRUPT;
        }
    }
    else {
        char why[128];
        fl_shm_ident ident = {r->token, r->dev, r->ino};
        fl_shm_name(name, c->prefix, 's', r->seg, r->token);
        code = fl_shm_open_verified(name, &ident, size, &fd, err, why, sizeof(why));
        if (code != FL_OK) {
            size_t n = strlen(what);
            snprintf(what + n, what_len - n, " %s%s%s%s", FL_SHM_DIR, name,
                     why[0] ? ": refused, " : "", why);
            return code;
        }
    }
    code = fl_shm_map(fd, size, addr, err);
    close(fd);   /* the mapping keeps the memory; holding fds would exhaust ulimit -n */
    /* both sides have it now: the name is no longer needed (kept if the mapping
       failed, so that a later result in it can try again) */
    if (code == FL_OK && name[0])
        shm_unlink(name);
    return code;
}

/* The arena of r's generation is not to be mapped: under file_descriptor its fd
 * was taken (and closed) and will not come again, so later results in it are
 * refused at once; under file_system its name is opened again by the next one. */
static void
lose_arena(MainChannelObject *c, const fl_result *r)
{
    if (c->strategy == FL_STRATEGY_FD) {
        c->arena_lost = 1;
        c->lost_gen = r->gen;
    }
}

/* Turn one result descriptor into (worker_id, seq, kind, payload, where). */
PyObject *
fl_mainchan_take(fl_state *st, MainChannelObject *c, const fl_result *r)
{
    int err = 0, code;
    PyObject *payload = NULL, *owner_obj = NULL;
    if (r->where == FL_WHERE_NONE) {
        payload = Py_NewRef(Py_None);
    }
    else if (r->where == FL_WHERE_SLOT) {
        if (c->arena == NULL || r->gen != c->arena_gen) {
            void *addr;
            if (c->arena_lost && r->gen == c->lost_gen) {
                /* its slots are never handed back: the worker overflows its next
                   batches into segments of their own, which map as usual */
                PyErr_Format(PyExc_RuntimeError,
                             "fastloader: this batch is in worker %d's ring arena, which "
                             "this process could not map (see the error of an earlier "
                             "batch: out of file descriptors or memory)", c->worker_id);
                goto unrebuilt;
            }
            /* (bounded as the worker makes them, so the product cannot overflow) */
            uint64_t size = r->slot_size * r->nslots;
            if (r->nslots == 0 || r->nslots > FL_MAX_SLOTS || r->slot_size == 0 ||
                r->slot_size % FL_SLOT_GRAIN != 0 || r->slot_size > FL_ARENA_MAX ||
                size > FL_ARENA_MAX) {
                if (c->strategy == FL_STRATEGY_FD) {
                    /* the arena's fd came before this result: take it off the
                       socket, or every later segment would be paired with the
                       message before its own */
                    int fd = -1, e2;
                    fl_fdmsg m;
                    if (fl_recv_fd(c->sock_main, &fd, &m, &e2) == FL_OK)
                        close(fd);
                }
                lose_arena(c, r);
                fl_raise(FL_CORRUPT, 0, "receiving a ring arena");
                goto unrebuilt;
            }
            char what[FL_NAME_MAX + 200] = "mapping a worker's ring arena";
            code = map_segment(c, r, size, &addr, &err, what, sizeof(what));
            if (code != FL_OK) {
                lose_arena(c, r);
                fl_raise(code, err, what);
                goto unrebuilt;
            }
            SegmentObject *seg =
                fl_segment_new_batch(st, addr, size, r->nslots, (size_t)r->slot_size);
            if (seg == NULL) {   /* (unmapped by its dealloc) */
                lose_arena(c, r);
                goto unrebuilt;
            }
            Py_XSETREF(c->arena, seg);
            c->arena_gen = r->gen;
            c->arena_slot_size = r->slot_size;
            c->arena_nslots = r->nslots;
            c->n_arenas++;
            c->held = 0;
        }
        if (r->slot >= c->arena_nslots || r->nbytes > c->arena_slot_size) {
            fl_raise(FL_CORRUPT, 0, "receiving a batch");
            goto unrebuilt;
        }
        owner_obj = fl_owner_new(st, c->arena, c, r->gen, r->slot);
        if (owner_obj == NULL) {
            /* no memory for the owner: nothing will ever hand this slot back but
               us, now (kept, it would be lost to its worker for good) */
            (void)fl_free_push(&c->ring, ((uint64_t)r->gen << 32) | r->slot);
            goto unrebuilt;
        }
        c->held++;
        payload = fl_decode(st, (uint8_t *)c->arena->addr + r->slot * c->arena_slot_size,
                            r->nbytes, owner_obj);
        c->n_slot++;
    }
    else if (r->where == FL_WHERE_OVERFLOW) {
        void *addr;
        uint64_t size = FL_ALIGN_UP(r->nbytes, 4096);
        char what[FL_NAME_MAX + 200] = "mapping an overflow segment";
        code = map_segment(c, r, size, &addr, &err, what, sizeof(what));
        if (code != FL_OK) {
            fl_raise(code, err, what);
            goto unrebuilt;
        }
        SegmentObject *seg = fl_segment_new_batch(st, addr, size, 1, size);
        if (seg == NULL)
            goto unrebuilt;
        owner_obj = fl_owner_new(st, seg, NULL, 0, UINT32_MAX);
        Py_DECREF(seg);   /* the owner holds it */
        if (owner_obj == NULL)
            goto unrebuilt;
        payload = fl_decode(st, addr, r->nbytes, owner_obj);
        c->n_overflow++;
    }
    else {
        fl_raise(FL_CORRUPT, 0, "receiving a result");
        goto unrebuilt;
    }
    /* views hold the owner now; if none was made the slot is released right here */
    Py_XDECREF(owner_obj);
unrebuilt:;
    unsigned kind = r->kind;
    if (payload == NULL) {
        /* The result was taken off the ring but cannot be rebuilt here (its
         * segment cannot be mapped, an object whose unpickling fails in this
         * process, bytes or a descriptor that fail validation, no memory to
         * hold it): raising now would lose its seq,
         * and the next next() would wait for it for ever. It becomes that batch's
         * error, raised in its turn as a worker's error is, with the exception
         * itself as the payload. Ctrl-C and other non-Exceptions still propagate
         * at once. */
        if (!PyErr_ExceptionMatches(PyExc_Exception))
            return NULL;
        payload = fl_take_exception();
        if (payload == NULL)
            return NULL;
        kind = FL_RES_ERROR;
    }
    else if (kind == FL_RES_BATCH || kind == FL_RES_BATCH_SNAP) {
        c->n_batches++;
    }
    return Py_BuildValue("(iLINI)", c->worker_id, (long long)r->seq, kind, payload,
                         (unsigned)r->where);
}

static PyObject *
mainchan_stats(MainChannelObject *c, PyObject *Py_UNUSED(ignored))
{
    uint64_t busy = 0, idle = 0, published = 0, overflowed = 0, a_bytes = 0, a_resv = 0,
             main_wakeups = 0;
    /* a forked child does not have the control block mapped (MADV_DONTFORK) */
    if (c->ctl != NULL && c->owner_pid == fl_self_pid()) {
        busy = atomic_load(&c->ctl->busy_ns);
        idle = atomic_load(&c->ctl->idle_ns);
        published = atomic_load(&c->ctl->published);
        overflowed = atomic_load(&c->ctl->overflowed);
        main_wakeups = atomic_load(&c->ctl->main_wakeups);
        a_bytes = atomic_load(&c->ctl->arena_bytes);
        a_resv = atomic_load(&c->ctl->arena_reserved);
    }
    return Py_BuildValue(
        "{s:K,s:K,s:K,s:K,s:K,s:K,s:I,s:K,s:K,s:K,s:d,s:d,s:K,s:K,s:K,s:K}", "arena_bytes",
        (unsigned long long)a_bytes, "arena_reserved_bytes", (unsigned long long)a_resv,
        "received",
        (unsigned long long)c->n_batches, "received_in_slots", (unsigned long long)c->n_slot,
        "received_in_overflow", (unsigned long long)c->n_overflow, "arenas",
        (unsigned long long)c->n_arenas, "slots", c->arena_nslots, "slot_size",
        (unsigned long long)c->arena_slot_size, "slots_held", (unsigned long long)c->held,
        "slots_retired", (unsigned long long)c->n_retired,
        "busy_s", (double)busy * 1e-9, "idle_s", (double)idle * 1e-9, "published",
        (unsigned long long)published, "overflow_segments", (unsigned long long)overflowed,
        "wakeups", (unsigned long long)c->n_wakeups, "main_wakeups",
        (unsigned long long)main_wakeups);
}

static PyObject *
mainchan_arena(MainChannelObject *c, PyObject *Py_UNUSED(ignored))
{
    if (c->arena == NULL)
        Py_RETURN_NONE;
    return Py_BuildValue("(Kn)", (unsigned long long)(uintptr_t)c->arena->addr,
                         (Py_ssize_t)c->arena->size);
}

static PyObject *
mainchan_get_watch(MainChannelObject *c, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(c->watch);
}

static int
mainchan_set_watch(MainChannelObject *c, PyObject *v, void *Py_UNUSED(closure))
{
    int b = v ? PyObject_IsTrue(v) : 0;
    if (b < 0)
        return -1;
    c->watch = b;
    return 0;
}

static PyObject *
mainchan_get_pid(MainChannelObject *c, void *Py_UNUSED(closure))
{
    return PyLong_FromLong((long)c->pid);
}

static PyObject *
mainchan_get_closed(MainChannelObject *c, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(c->closed);
}

static PyObject *
mainchan_get_wait_s(MainChannelObject *c, void *Py_UNUSED(closure))
{
    return PyFloat_FromDouble(c->wait_s);
}

static PyGetSetDef mainchan_getset[] = {
    {"watch", (getter)mainchan_get_watch, (setter)mainchan_set_watch,
     PyDoc_STR("Whether this worker's exit counts as a failure."), NULL},
    {"pid", (getter)mainchan_get_pid, NULL, PyDoc_STR("The worker's pid (0 before start)."), NULL},
    {"closed", (getter)mainchan_get_closed, NULL, PyDoc_STR("True after close()."), NULL},
    {"wait_s", (getter)mainchan_get_wait_s, NULL,
     PyDoc_STR("Seconds recv() slept while this worker's result was the one wanted."), NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef mainchan_methods[] = {
    {"handle", (PyCFunction)mainchan_handle, METH_NOARGS,
     PyDoc_STR("handle() -> dict of what the worker needs to attach")},
    {"started", (PyCFunction)mainchan_started, METH_O, mainchan_started_doc},
    {"main_fds", (PyCFunction)mainchan_main_fds, METH_NOARGS,
     PyDoc_STR("main_fds() -> fds a forked sibling worker must close")},
    {"put_index", (PyCFunction)(void (*)(void))mainchan_put_index, METH_FASTCALL,
     mainchan_put_index_doc},
    {"put_task", (PyCFunction)mainchan_put_task, METH_VARARGS, mainchan_put_task_doc},
    {"offer_task", (PyCFunction)mainchan_offer_task, METH_VARARGS, mainchan_offer_task_doc},
    {"stop", (PyCFunction)mainchan_stop, METH_NOARGS, mainchan_stop_doc},
    {"between_epochs", (PyCFunction)mainchan_between_epochs, METH_O,
     mainchan_between_epochs_doc},
    {"stats", (PyCFunction)mainchan_stats, METH_NOARGS, PyDoc_STR("stats() -> dict")},
    {"arena", (PyCFunction)mainchan_arena, METH_NOARGS,
     PyDoc_STR("arena() -> (address, nbytes) of the current ring arena, or None")},
    {"close", (PyCFunction)mainchan_close, METH_NOARGS,
     PyDoc_STR("close(): close fds and remove named segments")},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot mainchan_slots[] = {
    {Py_tp_new, mainchan_new},
    {Py_tp_dealloc, mainchan_dealloc},
    {Py_tp_traverse, mainchan_traverse},
    {Py_tp_methods, mainchan_methods},
    {Py_tp_getset, mainchan_getset},
    {Py_tp_doc, (void *)PyDoc_STR(
         "MainChannel(worker_id, strategy, prefix, task_capacity, result_capacity,\n"
         "            task_window=task_capacity)\n--\n\n"
         "The main process's end of one worker's shared-memory rings.")},
    {0, NULL},
};

static PyType_Spec fl_main_channel_spec = {
    .name = "fastloader._core.MainChannel",
    .basicsize = sizeof(MainChannelObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .slots = mainchan_slots,
};

int
fl_main_channel_init(PyObject *module, fl_state *st)
{
    return fl_add_type(module, &fl_main_channel_spec, &st->MainChannelType);
}
