/* packed_scan(): a sorted directory scan straight into a PackedWriter. */
#define _GNU_SOURCE
#include "packed_internal.h"
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define SCAN_MAX_DEPTH 256

typedef struct {
    uint64_t off;
    uint32_t len;
} scan_ent;

typedef struct {
    /* input */
    uint8_t **suffix;
    size_t *suffix_len;
    size_t nsuffix;
    int follow;
    /* the relative path being built, prefix included, ending in "/" when not empty */
    char *path;
    size_t path_len, path_cap;
    struct {
        dev_t dev;
        ino_t ino;
    } anc[SCAN_MAX_DEPTH + 1];
    int depth;
    /* output */
    char *names;
    size_t names_len, names_cap;
    scan_ent *ents;
    size_t nents, ents_cap;
    /* the first error: errno and the path it concerns */
    int err;
    char *err_path;
    /* whether to look for Ctrl-C (only Python's main thread runs signal handlers);
     * entries since the clock was last read, and when signals were last checked */
    int check_signals;
    unsigned since_clock;
    struct timespec checked;
    int interrupted;
} scan_ctx;

/* A tree of links can hold 2**40 paths (as for os.walk), so a scan must stop on
 * Ctrl-C rather than run on with the GIL released. Looking for a signal takes the
 * GIL, which another thread running Python may hold for up to its switch interval
 * (and then has to give up): so at most every 50 ms, the clock read every 1024
 * entries (tens of nanoseconds against a microsecond an entry). */
#define SCAN_CLOCK_EVERY 1024
#define SCAN_CHECK_NS 50000000L

static int
scan_interrupted(scan_ctx *c)
{
    if (!c->check_signals || ++c->since_clock < SCAN_CLOCK_EVERY)
        return 0;
    c->since_clock = 0;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    if ((now.tv_sec - c->checked.tv_sec) * 1000000000L + (now.tv_nsec - c->checked.tv_nsec)
            < SCAN_CHECK_NS)
        return 0;
    c->checked = now;
    /* this thread released the GIL in packed_scan(); take it back to let Python's
     * handlers run (the KeyboardInterrupt stays set for packed_scan() to return) */
    PyGILState_STATE g = PyGILState_Ensure();
    int r = PyErr_CheckSignals();
    PyGILState_Release(g);
    if (r < 0)
        c->interrupted = 1;
    return r < 0;
}

static int
grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap)
        return 0;
    size_t c = *cap ? *cap : 64, bytes;
    while (c < need)
        if (__builtin_mul_overflow(c, (size_t)2, &c))
            return -1;
    if (__builtin_mul_overflow(c, elem, &bytes))
        return -1;
    void *q = PyMem_RawRealloc(*p, bytes);
    if (q == NULL)
        return -1;
    *p = q;
    *cap = c;
    return 0;
}

static int
scan_fail(scan_ctx *c, int err, const char *name)
{
    if (c->err == 0) {
        size_t n = name ? strlen(name) : 0;
        c->err = err;
        c->err_path = PyMem_RawMalloc(c->path_len + n + 1);
        if (c->err_path != NULL) {
            memcpy(c->err_path, c->path, c->path_len);
            if (n)
                memcpy(c->err_path + c->path_len, name, n);
            c->err_path[c->path_len + n] = '\0';
        }
    }
    return -1;
}

static int
suffix_match(scan_ctx *c, const char *name, size_t n)
{
    if (c->nsuffix == 0)
        return 1;
    for (size_t k = 0; k < c->nsuffix; k++) {
        size_t m = c->suffix_len[k];
        if (m > n)
            continue;
        const uint8_t *tail = (const uint8_t *)name + n - m;
        size_t j = 0;
        for (; j < m; j++) {
            uint8_t ch = tail[j];
            if (ch >= 'A' && ch <= 'Z')
                ch = (uint8_t)(ch + 32);
            if (ch != c->suffix[k][j])
                break;
        }
        if (j == m)
            return 1;
    }
    return 0;
}

static int
scan_add(scan_ctx *c, const char *name, size_t n)
{
    size_t len = c->path_len + n;
    if (len > UINT32_MAX)
        return scan_fail(c, ENAMETOOLONG, name);
    if (len > SIZE_MAX - c->names_len ||
        grow((void **)&c->names, &c->names_cap, c->names_len + len, 1) < 0 ||
        grow((void **)&c->ents, &c->ents_cap, c->nents + 1, sizeof(scan_ent)) < 0)
        return scan_fail(c, ENOMEM, name);
    memcpy(c->names + c->names_len, c->path, c->path_len);
    memcpy(c->names + c->names_len + c->path_len, name, n);
    c->ents[c->nents].off = c->names_len;
    c->ents[c->nents].len = (uint32_t)len;
    c->nents++;
    c->names_len += len;
    return 0;
}

/* Scan the directory open as `fd` (consumed), whose relative path is c->path. */
static int
scan_dir(scan_ctx *c, int fd)
{
    DIR *d = fdopendir(fd);
    int rc = 0;
    if (d == NULL) {
        close(fd);
        return scan_fail(c, errno, NULL);
    }
    for (;;) {
        if (scan_interrupted(c)) {
            rc = -1;
            break;
        }
        errno = 0;
        struct dirent *e = readdir(d);
        if (e == NULL) {
            if (errno != 0)
                rc = scan_fail(c, errno, NULL);
            break;
        }
        const char *name = e->d_name;
        if (name[0] == '.' && (name[1] == '\0' || (name[1] == '.' && name[2] == '\0')))
            continue;
        size_t n = strlen(name);
        int type = e->d_type, via_link = 0;
        struct stat st;
        /* Some filesystems do not fill d_type: ask. An entry removed meanwhile, or a
         * dangling symbolic link, is skipped. */
        if (type == DT_UNKNOWN) {
            if (fstatat(dirfd(d), name, &st, AT_SYMLINK_NOFOLLOW) < 0) {
                if (errno == ENOENT)
                    continue;
                rc = scan_fail(c, errno, name);
                break;
            }
            type = S_ISLNK(st.st_mode) ? DT_LNK : S_ISDIR(st.st_mode) ? DT_DIR
                 : S_ISREG(st.st_mode) ? DT_REG : DT_UNKNOWN;
        }
        /* a symbolic link counts as what it points to (a link to a file is a file,
         * as in os.walk) */
        if (type == DT_LNK) {
            via_link = 1;
            if (fstatat(dirfd(d), name, &st, 0) < 0) {
                if (errno == ENOENT || errno == ELOOP)
                    continue;
                rc = scan_fail(c, errno, name);
                break;
            }
            type = S_ISDIR(st.st_mode) ? DT_DIR : S_ISREG(st.st_mode) ? DT_REG : DT_UNKNOWN;
        }
        if (type == DT_REG) {
            if (suffix_match(c, name, n) && (rc = scan_add(c, name, n)) < 0)
                break;
            continue;
        }
        if (type != DT_DIR || (via_link && !c->follow))
            continue;
        int sub = openat(dirfd(d), name, O_RDONLY | O_DIRECTORY | O_CLOEXEC |
                                         (via_link ? 0 : O_NOFOLLOW));
        if (sub < 0 || fstat(sub, &st) < 0) {
            if (sub >= 0)
                close(sub);
            rc = scan_fail(c, errno, name);
            break;
        }
        int loop = 0;
        for (int k = 0; k <= c->depth; k++)
            if (c->anc[k].dev == st.st_dev && c->anc[k].ino == st.st_ino)
                loop = 1;
        if (loop) {   /* a link back to an ancestor: its files are listed already */
            close(sub);
            continue;
        }
        if (c->depth + 1 > SCAN_MAX_DEPTH) {
            close(sub);
            rc = scan_fail(c, ELOOP, name);
            break;
        }
        size_t saved = c->path_len;
        if (grow((void **)&c->path, &c->path_cap, saved + n + 2, 1) < 0) {
            close(sub);
            rc = scan_fail(c, ENOMEM, name);
            break;
        }
        memcpy(c->path + saved, name, n);
        c->path[saved + n] = '/';
        c->path_len = saved + n + 1;
        c->depth++;
        c->anc[c->depth].dev = st.st_dev;
        c->anc[c->depth].ino = st.st_ino;
        rc = scan_dir(c, sub);
        c->depth--;
        c->path_len = saved;
        if (rc < 0)
            break;
    }
    closedir(d);
    return rc;
}

static int
ent_cmp(const void *x, const void *y, void *arg)
{
    const scan_ent *a = x, *b = y;
    const char *names = arg;
    uint32_t n = a->len < b->len ? a->len : b->len;
    int r = memcmp(names + a->off, names + b->off, n);
    if (r != 0)
        return r;
    return (a->len > b->len) - (a->len < b->len);
}

PyDoc_STRVAR(packed_scan_doc,
"packed_scan(writer, directory, prefix, suffixes, follow_symlinks, main_thread)\n--\n\n"
"Returns int.\n"
"Append to `writer` (a PACKED_STR PackedWriter) the paths, relative to `directory`\n"
"(bytes) and preceded by `prefix` (bytes), of the regular files below it whose\n"
"names end with one of `suffixes` (a tuple of lowercase bytes, matched ignoring\n"
"ASCII case; None: every file), sorted bytewise. Symbolic links count as what they\n"
"point to; linked directories are entered only with follow_symlinks (never twice\n"
"on one path). Runs without the GIL; with main_thread (the caller runs in Python's\n"
"main thread), stops on Ctrl-C (KeyboardInterrupt). Returns the number of paths added.");

static PyObject *
packed_scan(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *writer, *suffixes;
    const char *dir;
    Py_buffer prefix = {0};
    int follow, fd = -1, code = FL_OK, err = 0, rc = -1;
    scan_ctx c;
    PyObject *result = NULL;
    memset(&c, 0, sizeof(c));
    int main_thread;
    if (!PyArg_ParseTuple(args, "Oyy*Opp", &writer, &dir, &prefix, &suffixes, &follow,
                          &main_thread))
        return NULL;
    /* PyGILState_Ensure() knows the main interpreter's thread states only */
    c.check_signals = main_thread && PyInterpreterState_Get() == PyInterpreterState_Main();
    clock_gettime(CLOCK_MONOTONIC, &c.checked);
    if (!fl_packed_has_dealloc(writer, (void *)fl_packed_writer_dealloc) || WRITER(writer)->kind != FL_PACKED_STR) {
        PyErr_SetString(PyExc_TypeError, "packed_scan() needs a PACKED_STR PackedWriter");
        goto done;
    }
    if (suffixes != Py_None) {
        if (!PyTuple_Check(suffixes)) {
            PyErr_SetString(PyExc_TypeError, "suffixes must be a tuple of bytes or None");
            goto done;
        }
        c.nsuffix = (size_t)PyTuple_GET_SIZE(suffixes);
        c.suffix = PyMem_RawCalloc(c.nsuffix + 1, sizeof(uint8_t *));
        c.suffix_len = PyMem_RawCalloc(c.nsuffix + 1, sizeof(size_t));
        if (c.suffix == NULL || c.suffix_len == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        for (size_t k = 0; k < c.nsuffix; k++) {
            PyObject *s = PyTuple_GET_ITEM(suffixes, (Py_ssize_t)k);
            if (!PyBytes_Check(s)) {
                PyErr_SetString(PyExc_TypeError, "suffixes must be a tuple of bytes or None");
                goto done;
            }
            /* a copy: the scan runs without the GIL */
            c.suffix_len[k] = (size_t)PyBytes_GET_SIZE(s);
            c.suffix[k] = PyMem_RawMalloc(c.suffix_len[k] + 1);
            if (c.suffix[k] == NULL) {
                PyErr_NoMemory();
                goto done;
            }
            memcpy(c.suffix[k], PyBytes_AS_STRING(s), c.suffix_len[k]);
        }
        if (c.nsuffix == 0) {   /* an empty tuple matches nothing */
            result = PyLong_FromLong(0);
            goto done;
        }
    }
    c.follow = follow;
    if (grow((void **)&c.path, &c.path_cap, (size_t)prefix.len + 1, 1) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(c.path, prefix.buf, (size_t)prefix.len);
    c.path_len = (size_t)prefix.len;
    PackedWriterObject *w = WRITER(writer);
    if (fl_packed_writer_enter(w) < 0)
        goto done;
    Py_BEGIN_ALLOW_THREADS
    struct stat st;
    fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0 || fstat(fd, &st) < 0) {
        if (fd >= 0)
            close(fd);
        c.err = errno;
    }
    else {
        c.anc[0].dev = st.st_dev;
        c.anc[0].ino = st.st_ino;
        rc = scan_dir(&c, fd);
    }
    if (rc == 0 && c.nents > 0) {
        qsort_r(c.ents, c.nents, sizeof(scan_ent), ent_cmp, c.names);
        for (size_t k = 0; k < c.nents && code == FL_OK; k++)
            code = fl_packed_writer_append(w, c.names + c.ents[k].off, c.ents[k].len, &err);
    }
    Py_END_ALLOW_THREADS
    w->busy = 0;
    if (c.interrupted)
        goto done;   /* the signal handler's exception (KeyboardInterrupt) is set */
    if (c.err != 0) {
        /* the path as the caller would spell it: directory + relative path */
        PyObject *full = c.err_path
            ? PyBytes_FromFormat("%s/%s", dir, c.err_path + prefix.len)
            : PyBytes_FromString(dir);
        if (full != NULL) {
            if (c.err == ELOOP)
                PyErr_Format(PyExc_OSError, "fastloader: directories nested more than %d "
                             "deep under %R", SCAN_MAX_DEPTH, full);
            else {
                errno = c.err;
                PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, full);
            }
            Py_DECREF(full);
        }
        goto done;
    }
    if (code != FL_OK) {
        fl_packed_writer_raise(w, code, err);
        goto done;
    }
    result = PyLong_FromSize_t(c.nents);
done:
    PyBuffer_Release(&prefix);
    for (size_t k = 0; c.suffix != NULL && k < c.nsuffix; k++)
        PyMem_RawFree(c.suffix[k]);
    PyMem_RawFree(c.suffix);
    PyMem_RawFree(c.suffix_len);
    PyMem_RawFree(c.path);
    PyMem_RawFree(c.names);
    PyMem_RawFree(c.ents);
    PyMem_RawFree(c.err_path);
    return result;
}

static PyMethodDef packed_functions[] = {
    {"packed_scan", packed_scan, METH_VARARGS, packed_scan_doc},
    {NULL, NULL, 0, NULL},
};

int
fl_packed_scan_init(PyObject *module)
{
    return PyModule_AddFunctions(module, packed_functions);
}
